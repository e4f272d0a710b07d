//! `fo shard`: a DTensor layout as a table, one row per mesh coordinate (local shape and
//! what it holds of the global tensor), for a global shape, mesh and placements.
use super::args::Csv;
use fo::shard::{mesh_coords, Placement, ShardSpec};

#[derive(Debug, clap::Args)]
#[command(
    after_help = "Placements: R (Replicate), P (Partial), S<dim> (Shard), SS<dim>:<sf> (_StridedShard).

Examples:
  fo shard --shape 10,7 --mesh 2,3 --placements SS0:3,S0   FSDP2 over TP: the strided layout
  fo shard --shape 6 --mesh 4 --placements S0              torch's uneven chunks (rank 3 empty)"
)]
pub struct ShardArgs {
    /// The global shape, comma-separated (empty for a 0-dim tensor).
    #[arg(long, value_name = "D0,D1,..")]
    pub shape: Csv<usize>,
    /// The device mesh's shape, comma-separated.
    #[arg(long, value_name = "M0,M1,..")]
    pub mesh: Csv<usize>,
    /// One placement per mesh dim, comma-separated.
    #[arg(long, value_name = "P0,P1,..")]
    pub placements: Csv<Placement>,
}

/// `fo shard`: one row per mesh coordinate, as a person debugging a layout reads it.
pub fn run(a: &ShardArgs) -> Result<(), String> {
    let (shape, mesh, placements) = (a.shape.0.clone(), a.mesh.0.clone(), a.placements.0.clone());
    let first = ShardSpec::new(
        shape.clone(),
        mesh.clone(),
        vec![0; mesh.len()],
        placements.clone(),
    )
    .map_err(|e| e.to_string())?;
    let names: Vec<String> = placements.iter().map(|p| p.to_string()).collect();
    println!(
        "global shape {shape:?}, mesh {mesh:?}, placements [{}]",
        names.join(", ")
    );
    println!(
        "{:<6} {:<12} {:<14} {:<14} {:<4} indices held (per dim)",
        "rank", "coord", "local shape", "global offset", "box"
    );
    for (rank, coord) in mesh_coords(&mesh).into_iter().enumerate() {
        let spec = first.at_coord(coord.clone()).map_err(|e| e.to_string())?;
        let info = spec.info();
        let ranges: Vec<String> = (0..shape.len())
            .map(|d| {
                let runs = spec.runs(d).map_err(|e| e.to_string())?;
                Ok(if runs.is_empty() {
                    "{}".to_string()
                } else {
                    runs.0
                        .iter()
                        .map(|r| format!("[{},{})", r.start, r.end))
                        .collect::<Vec<_>>()
                        .join("+")
                })
            })
            .collect::<Result<_, String>>()?;
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
