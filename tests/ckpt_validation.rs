//! Regression tests for issue 11 items 1-3: layouts `verify` rejects must be rejected by
//! every reader (open, load, consolidate, verify) before a byte reaches the destination,
//! a tensor listed in fo's metadata but missing from its header is an error (never zero
//! filled), and edits of placement, dtype or `param_groups` are detected even when the
//! edited header is otherwise consistent (its digest recomputed by the editor).
mod ckpt_util;
use ckpt_util::*;

use std::collections::BTreeMap;
use std::fs::File;
use std::path::{Path, PathBuf};

use fo::ckpt::naming::shard_file_name;
use fo::ckpt::{
    consolidate, load, save_optimizer, verify, Checkpoint, LoadOptions, Mode, SaveOptions,
};
use fo::ckpt::{encode_header, header_digest, read_header, TensorEntry, DIGEST_KEY};
use fo::optim::StateFormat;
use fo::DType;
use serde_json::Value;

const KEY: &str = "state.fc.weight.exp_avg";

fn fixture(name: &str) -> PathBuf {
    let dir = tmp(name);
    let rs = ranks(2, &config(StateFormat::Fp32, 0), DType::F32, 2);
    for (r, rank) in rs.iter().enumerate() {
        let mut o = SaveOptions::new(r, 2, Mode::Portable);
        o.save_id = "v".into();
        save_optimizer(&rank.opt, &dir, &o).unwrap();
    }
    dir
}

/// Rewrites a rank file's header through `edit(metadata, tensors, fo)`, keeping its data.
/// With `redigest`, the digest is recomputed (an editor who knows the format).
fn rewrite(
    path: &Path,
    redigest: bool,
    edit: impl FnOnce(&mut BTreeMap<String, String>, &mut Vec<TensorEntry>, &mut Value),
) {
    let h = read_header(path, &File::open(path).unwrap()).unwrap();
    let bytes = std::fs::read(path).unwrap();
    let data = &bytes[h.data_start as usize..];
    let (mut meta, mut tensors) = (h.metadata, h.tensors);
    let mut fo: Value = meta
        .get("fo")
        .map_or(Value::Null, |s| serde_json::from_str(s).unwrap());
    edit(&mut meta, &mut tensors, &mut fo);
    if !fo.is_null() {
        meta.insert("fo".into(), fo.to_string());
    }
    if redigest {
        let d = header_digest(&meta, &tensors);
        meta.insert(DIGEST_KEY.into(), d.clone());
        // ... and names the new digest in the commit record too.
        let rec = path.parent().unwrap().join(fo::ckpt::naming::COMMIT_FILE);
        if let Ok(b) = std::fs::read(&rec) {
            let mut c: Value = serde_json::from_slice(&b).unwrap();
            let rank = fo::ckpt::naming::parse_shard_file_name(
                path.file_name().unwrap().to_str().unwrap(),
            )
            .unwrap();
            c["digests"][rank] = Value::String(d);
            std::fs::write(&rec, c.to_string()).unwrap();
        }
    }
    let mut out = encode_header(&meta, &tensors);
    out.extend_from_slice(data);
    std::fs::write(path, out).unwrap();
}

/// Sets tensor `name`'s global offset in fo's table and in DCP's sharding info alike.
fn set_offset(meta: &mut BTreeMap<String, String>, fo: &mut Value, name: &str, off: &[usize]) {
    fo["tensors"][name]["global_offset"] = serde_json::json!(off);
    let mut dcp: Value = serde_json::from_str(&meta["DCP_SHARDING_INFO"]).unwrap();
    dcp[name]["saved_offsets"] = serde_json::json!(off);
    meta.insert("DCP_SHARDING_INFO".into(), dcp.to_string());
}

fn offset_of(path: &Path, name: &str) -> Vec<usize> {
    let h = read_header(path, &File::open(path).unwrap()).unwrap();
    let fo: Value = serde_json::from_str(&h.metadata["fo"]).unwrap();
    serde_json::from_value(fo["tensors"][name]["global_offset"].clone()).unwrap()
}

/// Every reader refuses `dir` with an error containing `needle`: open, verify,
/// consolidate (writing nothing), and a strict load (leaving the optimizer unchanged).
fn all_readers_refuse(dir: &Path, needle: &str) {
    let e = Checkpoint::open(dir).unwrap_err().to_string();
    assert!(e.contains(needle), "open: {e:?} should mention {needle:?}");
    data_readers_refuse(dir, needle);
}

/// As `all_readers_refuse` for damage only the data shows (open reads headers only).
fn data_readers_refuse(dir: &Path, needle: &str) {
    let e = verify(dir, &mut |_, _| {}).unwrap_err().to_string();
    assert!(e.contains(needle), "verify: {e:?}");
    let out = dir.with_extension("out");
    let e = consolidate(dir, &out, &mut |_, _| {})
        .unwrap_err()
        .to_string();
    assert!(e.contains(needle), "consolidate: {e:?}");
    assert!(
        !out.join("model-00001-of-00001.safetensors").exists(),
        "consolidate wrote its output"
    );
    let mut rank = ranks(2, &config(StateFormat::Fp32, 0), DType::F32, 1).remove(0);
    let before = rank.opt.get_state(0, "exp_avg").unwrap();
    let e = load(&mut rank.opt, dir, &LoadOptions::default())
        .unwrap_err()
        .to_string();
    assert!(e.contains(needle), "load: {e:?}");
    assert!(
        rank.opt.get_state(0, "exp_avg").unwrap() == before,
        "a failed load changed the state"
    );
}

fn shard(dir: &Path, r: usize) -> PathBuf {
    dir.join(shard_file_name(r))
}

#[test]
fn shifted_chunk_offset_is_an_overlap_for_every_reader() {
    let dir = fixture("val-shift");
    // Rank 1 holds rows 5..10; moved to rows 4..9 it overlaps rank 0 and leaves row 9 unsaved.
    assert_eq!(offset_of(&shard(&dir, 1), KEY), [5, 0]);
    rewrite(&shard(&dir, 1), true, |m, _, fo| {
        set_offset(m, fo, KEY, &[4, 0])
    });
    all_readers_refuse(&dir, "overlaps");
    // The same edit without the digest recomputed is a digest error.
    let dir = fixture("val-shift-raw");
    rewrite(&shard(&dir, 1), false, |m, _, fo| {
        set_offset(m, fo, KEY, &[4, 0])
    });
    all_readers_refuse(&dir, "digest mismatch");
}

#[test]
fn tensor_removed_from_the_header_is_an_error_not_zeros() {
    for name in [KEY, "state.fc.weight.step"] {
        let dir = fixture("val-removed");
        let f = (0..2)
            .map(|r| shard(&dir, r))
            .find(|f| offset_of_opt(f, name))
            .unwrap();
        rewrite(&f, true, |_, ts, _| ts.retain(|t| t.name != name));
        // Its bytes stay in the file, unaccounted for: safetensors' layout rule (checked
        // first, issue 23) refuses the hole before fo's table is compared.
        all_readers_refuse(&dir, "invalid offset");
    }
}

fn offset_of_opt(path: &Path, name: &str) -> bool {
    let h = read_header(path, &File::open(path).unwrap()).unwrap();
    h.tensors.iter().any(|t| t.name == name)
}

#[test]
fn offsets_swapped_between_ranks_are_detected() {
    let dir = fixture("val-swap");
    let (a, b) = (
        offset_of(&shard(&dir, 0), KEY),
        offset_of(&shard(&dir, 1), KEY),
    );
    rewrite(&shard(&dir, 0), true, |m, _, fo| set_offset(m, fo, KEY, &b));
    rewrite(&shard(&dir, 1), true, |m, _, fo| set_offset(m, fo, KEY, &a));
    // Consistent headers, full coverage: the checksums, bound to the offsets, catch it.
    Checkpoint::open(&dir).unwrap();
    data_readers_refuse(&dir, "checksum mismatch");
    let dir = fixture("val-swap-raw");
    rewrite(&shard(&dir, 0), false, |m, _, fo| {
        set_offset(m, fo, KEY, &b)
    });
    rewrite(&shard(&dir, 1), false, |m, _, fo| {
        set_offset(m, fo, KEY, &a)
    });
    all_readers_refuse(&dir, "digest mismatch");
}

#[test]
fn edited_lr_in_param_groups_is_detected() {
    let dir = fixture("val-lr");
    rewrite(&shard(&dir, 1), false, |_, _, fo| {
        fo["param_groups"][0]["lr"] = serde_json::json!(0.5)
    });
    all_readers_refuse(&dir, "digest mismatch");
    let dir = fixture("val-lr2");
    rewrite(&shard(&dir, 1), true, |_, _, fo| {
        fo["param_groups"][0]["lr"] = serde_json::json!(0.5)
    });
    all_readers_refuse(&dir, "param_groups differs");
}

#[test]
fn dtype_edited_in_the_header_is_detected() {
    let dir = fixture("val-dtype");
    rewrite(&shard(&dir, 0), false, |_, ts, _| {
        ts.iter_mut().find(|t| t.name == KEY).unwrap().dtype = DType::I32;
    });
    all_readers_refuse(&dir, "digest mismatch");
    let dir = fixture("val-dtype2");
    rewrite(&shard(&dir, 0), true, |_, ts, _| {
        ts.iter_mut().find(|t| t.name == KEY).unwrap().dtype = DType::I32;
    });
    all_readers_refuse(&dir, "the header says I32 but fo saved F32");
}

/// torch's files (no fo metadata): the checks come from DCP's sharding info.
fn torch_copy(name: &str) -> PathBuf {
    let dir = tmp(name);
    std::fs::create_dir_all(&dir).unwrap();
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/oracle/ckpt_fsdp2_4ranks/sharded");
    for e in std::fs::read_dir(src).unwrap() {
        let e = e.unwrap();
        std::fs::copy(e.path(), dir.join(e.file_name())).unwrap();
    }
    dir
}

#[test]
fn torch_checkpoint_with_shifted_or_missing_chunk_is_refused() {
    let dir = torch_copy("val-torch-shift");
    Checkpoint::open(&dir).unwrap();
    // A chunk of rank 1 (non-empty, not at offset 0) moved one row back overlaps rank 0's.
    let f = shard(&dir, 1);
    let h = read_header(&f, &File::open(&f).unwrap()).unwrap();
    let dcp: Value = serde_json::from_str(&h.metadata["DCP_SHARDING_INFO"]).unwrap();
    let t = h
        .tensors
        .iter()
        .find(|t| {
            t.shape.iter().product::<usize>() > 0
                && dcp[&t.name]["saved_offsets"][0].as_u64().unwrap() > 0
        })
        .unwrap()
        .clone();
    let e = {
        rewrite(&f, false, |m, _, _| {
            let mut d: Value = serde_json::from_str(&m["DCP_SHARDING_INFO"]).unwrap();
            let o = d[&t.name]["saved_offsets"][0].as_u64().unwrap();
            d[&t.name]["saved_offsets"][0] = serde_json::json!(o - 1);
            m.insert("DCP_SHARDING_INFO".into(), d.to_string());
        });
        Checkpoint::open(&dir).unwrap_err().to_string()
    };
    assert!(e.contains("overlaps") && e.contains(&t.name), "{e}");
    let e = verify(&dir, &mut |_, _| {}).unwrap_err().to_string();
    assert!(e.contains("overlaps"), "{e}");
    // A chunk removed: a gap.
    let dir = torch_copy("val-torch-gap");
    rewrite(&shard(&dir, 1), false, |_, ts, _| {
        ts.retain(|x| x.name != t.name)
    });
    let e = Checkpoint::open(&dir).unwrap_err().to_string();
    assert!(e.contains("invalid offset") && e.contains("a gap"), "{e}");
    let out = dir.with_extension("out");
    assert!(consolidate(&dir, &out, &mut |_, _| {}).is_err());
    assert!(!out.join("model-00001-of-00001.safetensors").exists());
}

/// Issue 23 item 7: safetensors' layout rules hold before any digest is looked at, so
/// an editor who recomputes the digests still cannot alias, shift or overlap tensors.
#[test]
fn aliased_or_shifted_data_offsets_are_refused_even_with_digests_recomputed() {
    let dir = fixture("val-alias");
    rewrite(&shard(&dir, 0), true, |_, ts, _| {
        let sq = ts
            .iter()
            .find(|t| t.name == "state.fc.weight.exp_avg_sq")
            .unwrap();
        let (s, e) = (sq.start, sq.end);
        let t = ts.iter_mut().find(|t| t.name == KEY).unwrap();
        (t.start, t.end) = (s, e);
    });
    all_readers_refuse(&dir, "invalid offset");
    let dir = fixture("val-shift4");
    rewrite(&shard(&dir, 0), true, |_, ts, _| {
        let t = ts.iter_mut().find(|t| t.name == KEY).unwrap();
        (t.start, t.end) = (t.start + 4, t.end + 4);
    });
    all_readers_refuse(&dir, "invalid offset");
}

/// Metadata this fo cannot honour is refused; metadata it can (an unknown extra field)
/// loads, with a warning on stderr.
#[test]
fn unknown_checksum_mode_or_version_is_refused_and_unknown_fields_are_not() {
    for (name, field, value, needle) in [
        (
            "val-xxh3",
            "checksum",
            "xxh3",
            "checksum algorithm \"xxh3\"",
        ),
        ("val-mode", "mode", "sparse", "mode \"sparse\""),
        (
            "val-version",
            "fo_version",
            "nightly",
            "fo_version \"nightly\"",
        ),
    ] {
        let dir = fixture(name);
        for r in 0..2 {
            rewrite(&shard(&dir, r), true, |_, _, fo| {
                fo[field] = serde_json::json!(value)
            });
        }
        all_readers_refuse(&dir, needle);
    }
    let dir = fixture("val-extra-field");
    for r in 0..2 {
        rewrite(&shard(&dir, r), true, |_, _, fo| {
            fo["compression"] = serde_json::json!("zstd-next")
        });
    }
    verify(&dir, &mut |_, _| {}).unwrap();
}
