//! The converter and the diff as library calls (what `fo_checkpoint_convert`,
//! `fo_checkpoint_diff_json` and Python's `fo.ckpt.convert`/`diff` run): torch's checkpoint
//! resharded onto 3 ranks equals its full file, a failed convert leaves nothing at DST, and
//! DST is checked against SRC before anything is written.
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use fo::ckpt::Checkpoint;
use fo::ckpt::{convert, ConvertFormat, ConvertOptions};
use fo::ckpt::{diff, DiffOptions};
use fo::shard::Placement;

fn oracle(rel: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/oracle")
        .join(rel)
}

fn tmp(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("fo-convert-lib-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn entries(d: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(d)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    v.sort();
    v
}

fn no_progress() -> impl FnMut(u64, u64) {
    |_, _| {}
}

#[test]
fn torch_checkpoint_converted_onto_a_2x2_mesh_equals_its_full_file() {
    let t = tmp("mesh");
    let dst = t.join("out");
    let o = ConvertOptions {
        mesh: Some(vec![2, 2]),
        placements: Some(vec![Placement::Shard(0), Placement::Shard(1)]),
        ..Default::default()
    };
    let r = convert(
        &oracle("ckpt_fsdp2_4ranks/sharded"),
        &dst,
        &o,
        &mut no_progress(),
    )
    .unwrap();
    assert_eq!((r.keys, r.world, r.mode), (48, 4, "portable"));
    assert!(r.requantized.is_empty());
    let ck = Checkpoint::open(&dst).unwrap();
    assert_eq!(ck.keys.len(), 48);
    let full = oracle("ckpt_fsdp2_4ranks/full.safetensors");
    let rep = diff(&dst, &full, &DiffOptions::default(), &mut no_progress()).unwrap();
    assert_eq!(rep.differing(), 0, "{}", rep.summary());
    assert_eq!(rep.count("equal"), 48);
    assert_eq!(rep.to_json()["equal"], true);
    // Only DST and nothing else (no staging directory) beside it.
    assert_eq!(entries(&t), ["out"]);
    std::fs::remove_dir_all(&t).unwrap();
}

#[test]
fn compressed_convert_is_within_the_requantization_bound_and_reported() {
    let t = tmp("q");
    let q = t.join("q");
    let o = ConvertOptions {
        to: Some(ConvertFormat::Compressed),
        ranks: Some(3),
        ..Default::default()
    };
    let src = oracle("ckpt_fsdp2_4ranks/sharded");
    let mut calls = 0;
    let r = convert(&src, &q, &o, &mut |done, total| {
        calls += 1;
        assert!(done <= total);
    })
    .unwrap();
    assert!(calls > 0);
    assert_eq!(r.mode, "compressed");
    let rep = diff(&q, &src, &DiffOptions::default(), &mut no_progress()).unwrap();
    // quant8 moments decode close to, not exactly, the f32 values they were made from.
    let moments: Vec<_> = rep
        .rows
        .iter()
        .filter(|(k, _, _)| k.contains(".exp_avg"))
        .collect();
    assert!(!moments.is_empty());
    // f32 moments are written compressed; torch's bf16 ones (mixer.weight) stay as saved.
    let (q8, kept): (Vec<_>, Vec<_>) = moments
        .iter()
        .copied()
        .partition(|(_, lk, _)| lk.compressed);
    assert!(q8.len() > 2 && kept.len() == 2, "{moments:?}");
    assert!(kept
        .iter()
        .all(|(k, _, d)| k.contains("mixer.weight") && d.status() == "equal"));
    assert!(moments.iter().any(|(_, _, d)| d.status() == "differs"));
    let loose = DiffOptions {
        atol: 1.0,
        rtol: 1.0,
        ..Default::default()
    };
    let rep = diff(&q, &src, &loose, &mut no_progress()).unwrap();
    assert_eq!(rep.differing(), 0, "{}", rep.summary());
    std::fs::remove_dir_all(&t).unwrap();
}

#[test]
fn failed_convert_leaves_nothing_at_dst_and_keeps_a_replaced_one() {
    let t = tmp("fail");
    let src = oracle("ckpt_fsdp2_4ranks/sharded");
    let good = t.join("good");
    convert(&src, &good, &ConvertOptions::default(), &mut no_progress()).unwrap();
    // A copy of SRC whose last data byte is flipped: the checksum fails mid-way.
    let bad = t.join("bad");
    std::fs::create_dir(&bad).unwrap();
    for e in std::fs::read_dir(&good).unwrap() {
        let p = e.unwrap().path();
        std::fs::copy(&p, bad.join(p.file_name().unwrap())).unwrap();
    }
    let f1 = bad.join("shard-00002-model-00001-of-00001.safetensors");
    let f = File::options().read(true).write(true).open(&f1).unwrap();
    let len = f.metadata().unwrap().len();
    let mut b = [0u8];
    f.read_exact_at(&mut b, len - 1).unwrap();
    f.write_all_at(&[b[0] ^ 0xff], len - 1).unwrap();
    let two = ConvertOptions {
        ranks: Some(2),
        ..Default::default()
    };
    let e = convert(&bad, &t.join("new/deeper"), &two, &mut no_progress()).unwrap_err();
    assert!(e.to_string().contains("checksum"), "{e}");
    assert_eq!(
        entries(&t),
        ["bad", "good"],
        "nothing created, not even DST's parent"
    );
    // Replacing a good DST with --force fails the same way: the good one stays.
    let before = entries(&good);
    let force = ConvertOptions {
        force: true,
        ..two.clone()
    };
    convert(&bad, &good, &force, &mut no_progress()).unwrap_err();
    assert_eq!(entries(&good), before);
    assert_eq!(entries(&t), ["bad", "good"]);
    std::fs::remove_dir_all(&t).unwrap();
}

#[test]
fn dst_is_checked_against_src_and_force_before_anything_is_written() {
    let t = tmp("dst");
    let src = oracle("ckpt_fsdp2_4ranks/sharded");
    let o = ConvertOptions::default();
    let e = convert(&src, &src.join("sub"), &o, &mut no_progress()).unwrap_err();
    assert!(e.to_string().contains("inside the source"), "{e}");
    let e = convert(&src, &src, &o, &mut no_progress()).unwrap_err();
    assert!(e.to_string().contains("is the source"), "{e}");
    let full = t.join("full");
    std::fs::create_dir(&full).unwrap();
    std::fs::write(full.join("x"), b"mine").unwrap();
    let e = convert(&src, &full, &o, &mut no_progress()).unwrap_err();
    assert!(
        e.to_string().contains("not empty (force replaces it)"),
        "{e}"
    );
    assert_eq!(entries(&full), ["x"]);
    let bad_mesh = ConvertOptions {
        ranks: Some(3),
        mesh: Some(vec![2, 2]),
        ..Default::default()
    };
    let e = convert(&src, &t.join("m"), &bad_mesh, &mut no_progress()).unwrap_err();
    assert!(
        e.to_string()
            .contains("mesh 2,2 holds 4 ranks, not ranks 3"),
        "{e}"
    );
    let bad_dim = ConvertOptions {
        placements: Some(vec![Placement::Shard(7)]),
        ..Default::default()
    };
    let e = convert(&src, &t.join("m"), &bad_dim, &mut no_progress()).unwrap_err();
    assert!(e.to_string().contains("no key of SRC has dim 7"), "{e}");
    assert_eq!(entries(&t), ["full"]);
    std::fs::remove_dir_all(&t).unwrap();
}
