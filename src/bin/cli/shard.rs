use super::Flags;
use fo::shard::{mesh_coords, Placement, ShardSpec};

/// `fo shard`: one row per mesh coordinate, as a person debugging a layout reads it.
pub fn run(f: &Flags) -> Result<(), String> {
    let shape: Vec<usize> = f.list("shape")?;
    let mesh: Vec<usize> = f.list("mesh")?;
    let placements: Vec<Placement> =
        f.require("placements")?.split(',').map(|s| s.parse().map_err(|e: fo::Error| e.to_string())).collect::<Result<_, _>>()?;
    let first = ShardSpec::new(shape.clone(), mesh.clone(), vec![0; mesh.len()], placements.clone())
        .map_err(|e| e.to_string())?;
    let names: Vec<String> = placements.iter().map(|p| p.to_string()).collect();
    println!("global shape {shape:?}, mesh {mesh:?}, placements [{}]", names.join(", "));
    println!("{:<6} {:<12} {:<14} {:<14} {:<4} indices held (per dim)", "rank", "coord", "local shape", "global offset", "box");
    for (rank, coord) in mesh_coords(&mesh).into_iter().enumerate() {
        let spec = first.at_coord(coord.clone()).map_err(|e| e.to_string())?;
        let info = spec.info();
        let ranges: Vec<String> = (0..shape.len())
            .map(|d| {
                let runs = spec.runs(d);
                if runs.is_empty() {
                    "{}".to_string()
                } else {
                    runs.0.iter().map(|r| format!("[{},{})", r.start, r.end)).collect::<Vec<_>>().join("+")
                }
            })
            .collect();
        println!(
            "{:<6} {:<12} {:<14} {:<14} {:<4} {}",
            rank,
            format!("{coord:?}"),
            format!("{:?}", info.local_shape),
            format!("{:?}", info.global_offset),
            if info.is_box { "yes" } else { "no" },
            ranges.join(" x ")
        );
    }
    Ok(())
}
