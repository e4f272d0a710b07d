//! Every case of `tests/oracle/shard_cases.json` (computed by PyTorch 2.15 itself):
//! local shape, global offset, index lists and global stride, at every mesh coordinate.
use fo::shard::{Placement, ShardSpec};
use serde_json::Value;

fn placement(v: &Value) -> Placement {
    let dim = || v["dim"].as_u64().unwrap() as usize;
    match v["kind"].as_str().unwrap() {
        "replicate" => Placement::Replicate,
        "shard" => Placement::Shard(dim()),
        "strided_shard" => Placement::StridedShard {
            dim: dim(),
            split_factor: v["split_factor"].as_u64().unwrap() as usize,
        },
        "partial" => Placement::Partial,
        k => panic!("unknown placement kind {k}"),
    }
}

fn usizes(v: &Value) -> Vec<usize> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as usize)
        .collect()
}

#[test]
fn matches_every_torch_shard_case() {
    let text = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/oracle/shard_cases.json"
    ))
    .unwrap();
    let doc: Value = serde_json::from_str(&text).unwrap();
    let cases = doc["cases"].as_array().unwrap();
    assert_eq!(cases.len() as u64, doc["num_cases"].as_u64().unwrap());
    let mut coords_checked = 0;
    let mut failures = Vec::new();
    for case in cases {
        let id = case["id"].as_str().unwrap();
        let shape = usizes(&case["global_shape"]);
        let mesh = usizes(&case["mesh_shape"]);
        let pl: Vec<Placement> = case["placements"]
            .as_array()
            .unwrap()
            .iter()
            .map(placement)
            .collect();
        for r in case["ranks"].as_array().unwrap() {
            let coord = usizes(&r["coord"]);
            let spec =
                ShardSpec::new(shape.clone(), mesh.clone(), coord.clone(), pl.clone()).unwrap();
            let info = spec.info();
            let want_idx: Vec<Vec<usize>> = r["indices"]
                .as_array()
                .unwrap()
                .iter()
                .map(usizes)
                .collect();
            let got_idx: Vec<Vec<usize>> = (0..shape.len()).map(|d| spec.indices(d)).collect();
            let ok = info.local_shape == usizes(&r["local_shape"])
                && info.global_offset == usizes(&r["global_offset"])
                && info.global_stride == usizes(&case["global_stride"])
                && got_idx == want_idx;
            if !ok {
                failures.push(format!(
                    "{id} coord {coord:?}: local {:?} offset {:?} indices {got_idx:?}; torch: local {} offset {} indices {}",
                    info.local_shape, info.global_offset, r["local_shape"], r["global_offset"], r["indices"]
                ));
            }
            // is_box must agree with the index lists themselves.
            let contiguous = want_idx
                .iter()
                .all(|v| v.windows(2).all(|w| w[1] == w[0] + 1));
            assert_eq!(info.is_box, contiguous, "{id} coord {coord:?}: is_box");
            coords_checked += 1;
        }
    }
    assert!(
        failures.is_empty(),
        "{} of {coords_checked} coordinates differ from torch:\n{}",
        failures.len(),
        failures.join("\n")
    );
    assert!(
        coords_checked > 1000,
        "only {coords_checked} coordinates checked"
    );
}

#[test]
fn chunks_cover_the_shard_exactly() {
    // The boxes of a strided shard, in local order, reassemble the index lists.
    let spec = ShardSpec::new(
        vec![10, 7],
        vec![2, 3],
        vec![1, 2],
        vec![
            Placement::StridedShard {
                dim: 1,
                split_factor: 3,
            },
            Placement::Shard(0),
        ],
    )
    .unwrap();
    let chunks = spec.chunks();
    let n: usize = chunks
        .iter()
        .map(|c| c.shape.iter().product::<usize>())
        .sum();
    assert_eq!(n, spec.local_numel());
    for c in &chunks {
        for d in 0..2 {
            let idx = spec.indices(d);
            for k in 0..c.shape[d] {
                assert_eq!(idx[c.local_offset[d] + k], c.global_offset[d] + k);
            }
        }
    }
}
