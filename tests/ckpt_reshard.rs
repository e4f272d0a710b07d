//! Save on N in-process ranks, load on M ranks, for every pair of layouts below (world
//! sizes 1..5, uneven, strided, 2-D meshes, replicated dims): every destination shard
//! equals the same slice of the original tensor, bit for bit, for every dtype.
use fo::ckpt::{local_shard, save, Checkpoint, PackOptions, Packed, StateEntry};
use fo::shard::{mesh_coords, Placement, ShardSpec};
use fo::{DType, Tensor};

struct Layout {
    mesh: Vec<usize>,
    placements: Vec<&'static str>,
}

fn layouts() -> Vec<Layout> {
    let l = |mesh: &[usize], p: &[&'static str]| Layout {
        mesh: mesh.to_vec(),
        placements: p.to_vec(),
    };
    vec![
        l(&[1], &["R"]),
        l(&[2], &["S0"]),
        l(&[3], &["S0"]),
        l(&[4], &["S0"]),
        l(&[5], &["S0"]),
        l(&[3], &["S1"]),
        l(&[2], &["SS0:2"]),
        l(&[2], &["SS0:3"]),
        l(&[3], &["SS0:2"]),
        l(&[2, 2], &["SS0:2", "S0"]),
        l(&[2, 2], &["S0", "S1"]),
        l(&[2, 2], &["R", "S0"]),
        l(&[5], &["SS1:3"]),
    ]
}

fn spec(shape: &[usize], l: &Layout, coord: Vec<usize>) -> ShardSpec {
    let pl: Vec<Placement> = l.placements.iter().map(|p| p.parse().unwrap()).collect();
    // A placement on a dim the tensor lacks (1-D tensors under S1) falls back to Replicate.
    let pl = pl
        .into_iter()
        .map(|p| {
            if p.shard_dim().is_some_and(|d| d >= shape.len()) {
                Placement::Replicate
            } else {
                p
            }
        })
        .collect();
    ShardSpec::new(shape.to_vec(), l.mesh.clone(), coord, pl).unwrap()
}

/// Deterministic bytes that differ everywhere (so a misplaced element is caught).
fn tensor(dtype: DType, shape: &[usize], seed: u32) -> Tensor {
    let n: usize = shape.iter().product::<usize>() * dtype.size();
    let data = (0..n as u32)
        .map(|i| (i.wrapping_mul(2654435761).wrapping_add(seed) >> 13) as u8)
        .collect();
    Tensor::new(dtype, shape.to_vec(), data).unwrap()
}

fn globals() -> Vec<(&'static str, Tensor, bool)> {
    vec![
        (
            "state.fc.weight.exp_avg",
            tensor(DType::F32, &[10, 7], 1),
            true,
        ),
        (
            "state.fc.weight.exp_avg_sq",
            tensor(DType::BF16, &[11, 9], 2),
            true,
        ),
        (
            "state.fc.bias.momentum_buffer",
            tensor(DType::F64, &[13], 3),
            true,
        ),
        (
            "state.fc.weight.error_bits",
            tensor(DType::I16, &[10, 7], 4),
            true,
        ),
        ("state.tiny.exp_avg", tensor(DType::F32, &[2, 3], 5), true),
        (
            "state.fc.weight.step",
            Tensor::from_f32(vec![], &[3.0]).unwrap(),
            false,
        ),
        ("bn.num_batches_tracked", tensor(DType::I64, &[], 6), false),
        ("empty", Tensor::zeros(DType::F32, vec![0, 4]), true),
    ]
}

fn save_layout(dir: &std::path::Path, l: &Layout) {
    let coords = mesh_coords(&l.mesh);
    let packs: Vec<Packed> = coords
        .iter()
        .enumerate()
        .map(|(rank, c)| {
            let entries = globals()
                .into_iter()
                .map(|(k, g, sharded)| {
                    if sharded {
                        let s = spec(&g.shape, l, c.clone());
                        StateEntry::new(k, local_shard(&g, &s), Some(s))
                    } else {
                        StateEntry::new(k, g, None)
                    }
                })
                .collect();
            let mut o = PackOptions::new(rank, coords.len());
            o.save_id = "t".into();
            Packed::new(entries, o).unwrap()
        })
        .collect();
    save(dir, &packs).unwrap();
}

#[test]
fn save_on_any_layout_loads_on_any_other_bit_for_bit() {
    let root = std::env::temp_dir().join(format!("fo-reshard-{}", std::process::id()));
    for (i, src) in layouts().iter().enumerate() {
        let dir = root.join(format!("src{i}"));
        save_layout(&dir, src);
        let ck = Checkpoint::open(&dir).unwrap();
        let ranks = mesh_coords(&src.mesh).len();
        assert!(
            ck.files.len() >= ranks,
            "a rank file per rank, plus strided shards' parts"
        );
        let dest = root.join(format!("whole{i}"));
        let file = fo::ckpt::consolidate(&dir, &dest, &mut |_, _| {})
            .unwrap()
            .file;
        let bytes = std::fs::read(file).unwrap();
        let whole = safetensors::SafeTensors::deserialize(&bytes).unwrap();
        for (key, g, _) in globals().into_iter().filter(|(_, g, _)| g.numel() > 0) {
            let got = whole.tensor(key).unwrap();
            assert_eq!(got.shape(), g.shape.as_slice(), "{key}");
            assert_eq!(
                got.data(),
                g.data.as_slice(),
                "{key}: consolidated from {:?} {:?}",
                src.mesh,
                src.placements
            );
        }
        for dst in layouts() {
            for coord in mesh_coords(&dst.mesh) {
                for (key, g, sharded) in globals() {
                    if g.numel() == 0 {
                        assert!(
                            !ck.keys.contains_key(key),
                            "0-element entries produce no chunk"
                        );
                        continue;
                    }
                    let s = if sharded {
                        spec(&g.shape, &dst, coord.clone())
                    } else {
                        ShardSpec::unsharded(g.shape.clone()).unwrap()
                    };
                    let got = ck.read(key, &s).unwrap_or_else(|e| {
                        panic!("{key} {:?}->{:?}: {e}", src.placements, dst.placements)
                    });
                    assert_eq!(
                        got,
                        local_shard(&g, &s),
                        "{key}: saved {:?} {:?}, loaded {:?} {:?} at {coord:?}",
                        src.mesh,
                        src.placements,
                        dst.mesh,
                        dst.placements
                    );
                }
            }
        }
    }
    std::fs::remove_dir_all(&root).unwrap();
}

#[test]
fn replicated_and_unsharded_entries_are_written_once() {
    let dir = std::env::temp_dir().join(format!("fo-once-{}", std::process::id()));
    save_layout(
        &dir,
        &Layout {
            mesh: vec![2, 2],
            placements: vec!["R", "S0"],
        },
    );
    let ck = Checkpoint::open(&dir).unwrap();
    let w = &ck.keys["state.fc.weight.exp_avg"];
    assert_eq!(w.chunks.len(), 2, "two distinct shards, each written once");
    assert!(
        w.chunks.iter().all(|c| c.file < 2),
        "written by coordinates (0, *)"
    );
    assert_eq!(ck.keys["state.fc.weight.step"].chunks.len(), 1);
    assert_eq!(ck.keys["state.fc.weight.step"].chunks[0].file, 0);
    assert!(!ck.keys.contains_key("empty"));
    assert_eq!(
        fo::ckpt::verify(&dir, &mut |_, _| {}).unwrap().chunks,
        ck.keys.values().map(|k| k.chunks.len()).sum::<usize>()
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A rank holding a strided shard as several boxes writes box j into its part file j, under
/// the key itself with DCP's offsets, so torch's HF reader sees chunks of one key; the
/// commit record counts the parts and a later save with fewer parts removes the stale ones.
#[test]
fn strided_shards_are_chunks_of_one_key_in_part_files() {
    let dir = std::env::temp_dir().join(format!("fo-strided-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    save_layout(
        &dir,
        &Layout {
            mesh: vec![2],
            placements: vec!["SS0:3"],
        },
    );
    let dcp_info = |name: &str| {
        let bytes = std::fs::read(dir.join(name)).unwrap();
        let (_, meta) = safetensors::SafeTensors::read_metadata(&bytes).unwrap();
        let md = meta.metadata().as_ref().unwrap().clone();
        assert_eq!(md["format"], "pt");
        assert_eq!(md["DCP_VERSION"], "1.0");
        let info: serde_json::Value = serde_json::from_str(&md["DCP_SHARDING_INFO"]).unwrap();
        info["state.fc.weight.exp_avg"]["saved_offsets"].clone()
    };
    // (10, 7) rows split 4+4+2 into 3 pieces, each over 2 ranks: rank 1 holds rows 2..4,
    // 6..8 and 9..10.
    assert_eq!(
        dcp_info("shard-00002-model-00001-of-00001.safetensors"),
        serde_json::json!([2, 0])
    );
    assert_eq!(
        dcp_info("shard-00002-model-00002-of-00003.safetensors"),
        serde_json::json!([6, 0])
    );
    assert_eq!(
        dcp_info("shard-00002-model-00003-of-00003.safetensors"),
        serde_json::json!([9, 0])
    );
    let commit: serde_json::Value =
        serde_json::from_slice(&std::fs::read(dir.join("fo-commit.json")).unwrap()).unwrap();
    assert_eq!(commit["parts"], serde_json::json!([3, 3]));
    let ck = Checkpoint::open(&dir).unwrap();
    assert_eq!(ck.files.len(), 6);
    assert!(ck.keys.keys().all(|k| !k.contains('#')));
    drop(ck);
    // A box save over it: the 3-part files go, and the checkpoint is the new one.
    save_layout(
        &dir,
        &Layout {
            mesh: vec![2],
            placements: vec!["S0"],
        },
    );
    let names: Vec<String> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .filter(|n| n.ends_with(".safetensors"))
        .collect();
    assert_eq!(names.len(), 2, "{names:?}");
    let ck = Checkpoint::open(&dir).unwrap();
    assert_eq!(ck.files.len(), 2);
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A rank file naming a part whose file is gone, or a part from another save, is refused.
#[test]
fn missing_or_foreign_part_files_are_refused() {
    let root = std::env::temp_dir().join(format!("fo-parts-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&root);
    let l = Layout {
        mesh: vec![2],
        placements: vec!["SS0:3"],
    };
    let a = root.join("a");
    save_layout(&a, &l);
    let part = "shard-00001-model-00002-of-00003.safetensors";
    // Rank 1's part 2 (same save) in place of rank 0's.
    std::fs::copy(
        a.join("shard-00002-model-00002-of-00003.safetensors"),
        a.join(part),
    )
    .unwrap();
    let e = Checkpoint::open(&a).unwrap_err().to_string();
    assert!(e.contains(part), "{e}");
    std::fs::remove_file(a.join(part)).unwrap();
    let e = Checkpoint::open(&a).unwrap_err().to_string();
    assert!(e.contains(part) && e.contains("missing"), "{e}");
    std::fs::remove_dir_all(&root).unwrap();
}

/// Tensors larger than one 4 MiB checksum block: partial reads gather runs across blocks,
/// and verify only the blocks they touch.
#[test]
fn multi_block_tensors_reshard_and_verify_only_touched_blocks() {
    let dir = std::env::temp_dir().join(format!("fo-blocks-{}", std::process::id()));
    let g = tensor(DType::F32, &[1100, 1024], 9); // 4.3 MiB on one rank: two blocks
    save(
        &dir,
        &[Packed::new(
            vec![StateEntry::new("big", g.clone(), None)],
            PackOptions::new(0, 1),
        )
        .unwrap()],
    )
    .unwrap();
    let ck = Checkpoint::open(&dir).unwrap();
    for l in [
        Layout {
            mesh: vec![3],
            placements: vec!["S0"],
        },
        Layout {
            mesh: vec![3],
            placements: vec!["S1"],
        },
        Layout {
            mesh: vec![2],
            placements: vec!["SS0:2"],
        },
    ] {
        for c in mesh_coords(&l.mesh) {
            let s = spec(&g.shape, &l, c);
            assert_eq!(
                ck.read("big", &s).unwrap(),
                local_shard(&g, &s),
                "{:?}",
                l.placements
            );
        }
    }
    // Corrupt the second block: rows in the first block still read, rows in the second fail.
    let c = &ck.keys["big"].chunks[0];
    let path = ck.files[c.file].clone();
    let at = c.data_start as usize + (4 << 20) + 100;
    drop(ck);
    let mut b = std::fs::read(&path).unwrap();
    b[at] ^= 1;
    std::fs::write(&path, b).unwrap();
    let ck = Checkpoint::open(&dir).unwrap();
    let first = ShardSpec::new(
        vec![1100, 1024],
        vec![3],
        vec![0],
        vec![Placement::Shard(0)],
    )
    .unwrap(); // rows 0..367: bytes < 1.5 MiB
    assert!(ck.read("big", &first).is_ok());
    let last = ShardSpec::new(
        vec![1100, 1024],
        vec![3],
        vec![2],
        vec![Placement::Shard(0)],
    )
    .unwrap();
    let e = ck.read("big", &last).unwrap_err().to_string();
    assert!(
        e.contains("checksum mismatch in block 1") && e.contains("big"),
        "{e}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

/// fo's layout before part files: a rank's boxes of a strided key in its one file, named
/// `<key>#<j>`. A part-file checkpoint rewritten that way (digests and commit record
/// recomputed) still opens, verifies and loads into any sharding.
#[test]
fn old_single_file_strided_layout_still_loads() {
    use fo::ckpt::naming::shard_file_name;
    use fo::ckpt::{
        encode_header, header_digest, read_header, sharding_info, FoMeta, TensorEntry, DIGEST_KEY,
    };
    use std::collections::BTreeMap;
    let dir = std::env::temp_dir().join(format!("fo-old-strided-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let src = Layout {
        mesh: vec![2],
        placements: vec!["SS0:3"],
    };
    save_layout(&dir, &src);
    let commit_path = dir.join("fo-commit.json");
    let mut commit: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&commit_path).unwrap()).unwrap();
    for r in 0..2 {
        let main = dir.join(shard_file_name(r));
        let read = |p: &std::path::Path| {
            let h = read_header(p, &std::fs::File::open(p).unwrap()).unwrap();
            let m: FoMeta = serde_json::from_str(&h.metadata["fo"]).unwrap();
            (std::fs::read(p).unwrap(), h, m)
        };
        let first = read(&main);
        let n = first.2.parts.len() + 1;
        assert!(n > 1, "rank {r} holds several boxes");
        let parts: Vec<_> = (1..n)
            .map(|j| {
                dir.join(format!(
                    "shard-{:05}-model-{:05}-of-{n:05}.safetensors",
                    r + 1,
                    j + 1
                ))
            })
            .collect();
        let mut by_key: BTreeMap<String, Vec<_>> = BTreeMap::new();
        for (bytes, h, m) in std::iter::once(first.clone()).chain(parts.iter().map(|p| read(p))) {
            for t in &h.tensors {
                let data = bytes
                    [(h.data_start + t.start) as usize..(h.data_start + t.end) as usize]
                    .to_vec();
                let ft = m.tensors[&t.name].clone();
                by_key
                    .entry(ft.key.clone())
                    .or_default()
                    .push((t.clone(), ft, data));
            }
        }
        let (mut entries, mut data, mut tensors, mut offsets) =
            (vec![], vec![], BTreeMap::new(), vec![]);
        for (key, chunks) in by_key {
            let k = chunks.len();
            for (j, (t, ft, d)) in chunks.into_iter().enumerate() {
                let name = if k == 1 {
                    key.clone()
                } else {
                    format!("{key}#{j}")
                };
                offsets.push((name.clone(), ft.global_offset.clone()));
                entries.push(TensorEntry {
                    name: name.clone(),
                    dtype: t.dtype,
                    shape: t.shape.clone(),
                    start: data.len() as u64,
                    end: (data.len() + d.len()) as u64,
                });
                data.extend(d);
                tensors.insert(name, ft);
            }
        }
        let mut fo = first.2.clone();
        fo.tensors = tensors;
        fo.parts = vec![];
        let mut md = first.1.metadata.clone();
        md.remove(DIGEST_KEY);
        md.insert("fo".into(), serde_json::to_string(&fo).unwrap());
        md.insert("DCP_SHARDING_INFO".into(), sharding_info(&offsets));
        let digest = header_digest(&md, &entries);
        md.insert(DIGEST_KEY.into(), digest.clone());
        let mut out = encode_header(&md, &entries);
        out.extend(data);
        std::fs::write(&main, out).unwrap();
        for p in parts {
            std::fs::remove_file(p).unwrap();
        }
        commit["digests"][r] = serde_json::json!(digest);
    }
    commit.as_object_mut().unwrap().remove("parts");
    std::fs::write(&commit_path, serde_json::to_vec(&commit).unwrap()).unwrap();

    let ck = Checkpoint::open(&dir).unwrap();
    assert_eq!(ck.files.len(), 2);
    let w = &ck.keys["state.fc.weight.exp_avg"];
    assert!(
        w.chunks
            .iter()
            .any(|c| c.name == "state.fc.weight.exp_avg#2"),
        "{:?}",
        w.chunks
    );
    fo::ckpt::verify(&dir, &mut |_, _| {}).unwrap();
    for dst in layouts() {
        for coord in mesh_coords(&dst.mesh) {
            for (key, g, sharded) in globals().into_iter().filter(|(_, g, _)| g.numel() > 0) {
                let s = if sharded {
                    spec(&g.shape, &dst, coord.clone())
                } else {
                    ShardSpec::unsharded(g.shape.clone()).unwrap()
                };
                assert_eq!(
                    ck.read(key, &s).unwrap(),
                    local_shard(&g, &s),
                    "{key} -> {:?}",
                    dst.placements
                );
            }
        }
    }
    std::fs::remove_dir_all(&dir).unwrap();
}
