//! Faults: a writer killed mid-save leaves the previous checkpoint loadable; flipped
//! bytes, truncation, a broken header, a missing shard, a missing key, a wrong shape, an
//! unknown dtype and mixed saves each give a clear error naming the file and key, and a
//! failed load leaves the optimizer as it was.
mod ckpt_util;
use ckpt_util::*;

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use fo::ckpt::{load, save_optimizer, verify, Checkpoint, LoadOptions, Mode, SaveOptions};
use fo::optim::StateFormat;
use fo::{DType, ShardSpec};

fn shard(dir: &Path, r: usize) -> PathBuf {
    dir.join(fo::ckpt::naming::shard_file_name(r))
}

/// A 2-rank fp32 checkpoint of the test model, and rank 0's optimizer after 2 steps.
fn fixture(name: &str) -> (PathBuf, Vec<Rank>) {
    let dir = tmp(name);
    let cfg = config(StateFormat::Fp32, 0);
    let rs = ranks(2, &cfg, DType::F32, 2);
    for (r, rank) in rs.iter().enumerate() {
        let mut o = SaveOptions::new(r, 2, Mode::Portable);
        o.save_id = "fixture".into();
        save_optimizer(&rank.opt, &dir, &o).unwrap();
    }
    (dir, rs)
}

fn snapshot(rank: &Rank) -> Vec<fo::Tensor> {
    (0..MODEL.len())
        .flat_map(|i| {
            rank.opt
                .state_keys(i)
                .unwrap()
                .into_iter()
                .map(move |k| (i, k))
        })
        .map(|(i, k)| rank.opt.get_state(i, &k).unwrap())
        .collect()
}

/// Loads `dir` into a stepped optimizer: must fail with a message containing every
/// `needle`, and leave the optimizer's state exactly as it was.
fn assert_load_fails(dir: &Path, needles: &[&str]) {
    let mut rank = ranks(2, &config(StateFormat::Fp32, 0), DType::F32, 1).remove(0);
    let before = snapshot(&rank);
    let e = load(&mut rank.opt, dir, &LoadOptions::default())
        .unwrap_err()
        .to_string();
    for n in needles {
        assert!(e.contains(n), "error {e:?} should mention {n:?}");
    }
    assert!(
        snapshot(&rank) == before,
        "a failed load changed the optimizer"
    );
}

fn chunk_of(dir: &Path, key: &str) -> (PathBuf, u64) {
    let ck = Checkpoint::open(dir).unwrap();
    let c = &ck.keys[key].chunks[0];
    (ck.files[c.file].clone(), c.data_start)
}

#[test]
fn flipped_byte_is_a_checksum_error_naming_file_and_key() {
    let (dir, _) = fixture("flip");
    let (file, at) = chunk_of(&dir, "state.fc.weight.exp_avg_sq");
    let mut b = std::fs::read(&file).unwrap();
    b[at as usize + 5] ^= 0x40;
    std::fs::write(&file, b).unwrap();
    let name = file.file_name().unwrap().to_str().unwrap();
    assert_load_fails(
        &dir,
        &["checksum mismatch", "state.fc.weight.exp_avg_sq", name],
    );
    let e = verify(&dir, &mut |_, _| {}).unwrap_err().to_string();
    assert!(e.contains("checksum mismatch") && e.contains(name), "{e}");
}

#[test]
fn truncated_file_and_broken_header_are_named() {
    let (dir, _) = fixture("trunc");
    let f = shard(&dir, 1);
    let b = std::fs::read(&f).unwrap();
    std::fs::write(&f, &b[..b.len() - 3]).unwrap();
    assert_load_fails(
        &dir,
        &["truncated", "shard-00002-model-00001-of-00001.safetensors"],
    );
    let mut h = b.clone();
    h[8] = b'#';
    std::fs::write(&f, h).unwrap();
    assert_load_fails(&dir, &["not valid JSON", "shard-00002"]);
}

#[test]
fn missing_shard_missing_key_shape_and_dtype_errors() {
    let (dir, _) = fixture("missing");
    let ck = Checkpoint::open(&dir).unwrap();
    let e = ck
        .read(
            "state.nope.exp_avg",
            &ShardSpec::unsharded(vec![3]).unwrap(),
        )
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("state.nope.exp_avg") && e.contains(dir.to_str().unwrap()),
        "{e}"
    );
    let e = ck
        .read(
            "state.fc.weight.exp_avg",
            &ShardSpec::unsharded(vec![10, 6]).unwrap(),
        )
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("state.fc.weight.exp_avg") && e.contains("[10, 7]") && e.contains("[10, 6]"),
        "{e}"
    );
    drop(ck);
    // Unknown dtype: same length, so only the dtype is wrong.
    let f = shard(&dir, 0);
    let b = std::fs::read(&f).unwrap();
    let pat = b"\"dtype\":\"F32\"";
    let at = b.windows(pat.len()).position(|w| w == pat).unwrap();
    let mut bad = b.clone();
    bad[at + 9..at + 12].copy_from_slice(b"Q32");
    std::fs::write(&f, &bad).unwrap();
    assert_load_fails(&dir, &["unknown dtype", "Q32", "shard-00001"]);
    std::fs::write(&f, &b).unwrap();
    std::fs::remove_file(shard(&dir, 1)).unwrap();
    assert_load_fails(
        &dir,
        &[
            "shard-00002-model-00001-of-00001.safetensors",
            "missing",
            "2 ranks",
        ],
    );
}

#[test]
fn directory_mixing_two_saves_is_refused() {
    let (dir, rs) = fixture("mixed");
    let other = tmp("mixed-other");
    let mut o = SaveOptions::new(1, 2, Mode::Portable);
    o.save_id = "another".into();
    save_optimizer(&rs[1].opt, &other, &o).unwrap();
    // One rank of two saved: nothing is committed, the file waits in the staging directory.
    assert!(!shard(&other, 1).exists() && Checkpoint::open(&other).is_err());
    let staged = fo::ckpt::stage_dir(&other, "another").join(fo::ckpt::naming::shard_file_name(1));
    std::fs::copy(staged, shard(&dir, 1)).unwrap();
    assert_load_fails(&dir, &["mixes two saves", "shard-00002"]);
    // Without the record (fo 0.1.0's directories), the save ids still tell.
    std::fs::remove_file(dir.join(fo::ckpt::naming::COMMIT_FILE)).unwrap();
    assert_load_fails(&dir, &["mixes two saves", "shard-00002"]);
}

/// Temporary files in `dir` and its staging directories.
fn temporaries(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    for e in std::fs::read_dir(dir).unwrap().filter_map(|e| e.ok()) {
        let p = e.path();
        if p.is_dir() {
            out.extend(temporaries(&p));
        } else if e.file_name().to_string_lossy().contains(".tmp-") {
            out.push(p);
        }
    }
    out
}

/// Runs `fo bench ckpt --save-only` into `dir` and SIGKILLs it as soon as a temporary
/// file holds data. Returns false if the child finished first.
fn kill_mid_save(dir: &Path, mib: usize) -> bool {
    let mut child = Command::new(env!("CARGO_BIN_EXE_fo"))
        .args([
            "bench",
            "ckpt",
            "--save-only",
            "--seed",
            "2",
            "--size-mib",
            &mib.to_string(),
            "--dir",
            dir.to_str().unwrap(),
        ])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let start = Instant::now();
    while start.elapsed() < Duration::from_secs(60) {
        let writing = temporaries(dir)
            .iter()
            .any(|p| p.metadata().is_ok_and(|m| m.len() > 1 << 20));
        if writing {
            child.kill().unwrap(); // SIGKILL
            child.wait().unwrap();
            return true;
        }
        if child.try_wait().unwrap().is_some() {
            return false;
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    child.kill().unwrap();
    child.wait().unwrap();
    panic!("the writer neither wrote nor finished in 60 s");
}

#[test]
fn writer_killed_mid_save_leaves_the_previous_checkpoint_loadable() {
    let dir = tmp("kill");
    let ok = Command::new(env!("CARGO_BIN_EXE_fo"))
        .args([
            "bench",
            "ckpt",
            "--save-only",
            "--seed",
            "1",
            "--size-mib",
            "4",
            "--keep",
            "--dir",
            dir.to_str().unwrap(),
        ])
        .output()
        .unwrap();
    assert!(
        ok.status.success(),
        "{}",
        String::from_utf8_lossy(&ok.stderr)
    );
    let before = Checkpoint::open(&dir).unwrap();
    let want = before.read_full("state.layer3.exp_avg").unwrap();
    drop(before);
    let killed = [96, 256, 768]
        .into_iter()
        .any(|mib| kill_mid_save(&dir, mib));
    assert!(killed, "could not catch the writer mid-save");
    let after = Checkpoint::open(&dir).unwrap();
    assert_eq!(
        after.meta.as_ref().unwrap().save_id,
        "bench-1",
        "the previous save is still the checkpoint"
    );
    assert!(after.read_full("state.layer3.exp_avg").unwrap() == want);
    verify(&dir, &mut |_, _| {}).unwrap();
    // The next save of the same files clears the killed writer's temporaries.
    let ok = Command::new(env!("CARGO_BIN_EXE_fo"))
        .args([
            "bench",
            "ckpt",
            "--save-only",
            "--size-mib",
            "4",
            "--dir",
            dir.to_str().unwrap(),
        ])
        .output()
        .unwrap();
    assert!(ok.status.success());
    let left = temporaries(&dir);
    assert!(left.is_empty(), "stale temporaries: {left:?}");
    let stages: Vec<_> = std::fs::read_dir(&dir)
        .unwrap()
        .filter_map(|e| e.ok())
        .filter(|e| e.file_name().to_string_lossy().starts_with(".fo-stage-"))
        .collect();
    assert!(
        stages.is_empty(),
        "staging directories left after a commit: {stages:?}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}
