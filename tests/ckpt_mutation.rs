//! Random mutations of 2-rank checkpoints (quant8 compressed and portable): header and
//! metadata byte edits, header length edits, offset edits and swaps between ranks (some
//! with the digests recomputed, as a format-aware editor would), removed entries, dtype
//! edits, data byte flips, truncations. Each mutated checkpoint must either fail cleanly
//! or read back exactly the original: the same keys, the same bytes of every key, the same
//! `param_groups`. Never different values with OK. Deterministic seed.
mod ckpt_util;
use ckpt_util::*;

use std::collections::BTreeMap;
use std::fs::File;
use std::path::{Path, PathBuf};

use fo::ckpt::naming::shard_file_name;
use fo::ckpt::naming::COMMIT_FILE;
use fo::ckpt::{encode_header, header_digest, read_header, DIGEST_KEY};
use fo::ckpt::{save_optimizer, Checkpoint, Mode, SaveOptions};
use fo::optim::StateFormat;
use fo::DType;
use serde_json::Value;

/// splitmix64: a fixed, dependency-free stream of random numbers.
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E3779B97F4A7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58476D1CE4E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D049BB133111EB);
        z ^ (z >> 31)
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }
}

/// Everything a reader returns for a checkpoint: keys with their dtype, global shape and
/// bytes, and `param_groups`. Err: the reader refused it.
type Contents = (BTreeMap<String, (DType, Vec<usize>, Vec<u8>)>, Value);

fn contents(dir: &Path) -> fo::Result<Contents> {
    let ck = Checkpoint::open(dir)?;
    let mut keys = BTreeMap::new();
    for (k, info) in &ck.keys {
        let t = ck.read_full(k)?;
        keys.insert(
            k.clone(),
            (info.dtype, info.global_shape.clone(), t.data.clone()),
        );
    }
    Ok((
        keys,
        ck.meta
            .as_ref()
            .map_or(Value::Null, |m| m.param_groups.clone()),
    ))
}

fn save(name: &str, format: StateFormat, mode: Mode) -> PathBuf {
    let dir = tmp(name);
    let rs = ranks(2, &config(format, 0), DType::F32, 2);
    for (r, rank) in rs.iter().enumerate() {
        let mut o = SaveOptions::new(r, 2, mode);
        o.save_id = "m".into();
        save_optimizer(&rank.opt, &dir, &o).unwrap();
    }
    dir
}

fn copy_dir(from: &Path, to: &Path) {
    let _ = std::fs::remove_dir_all(to);
    std::fs::create_dir_all(to).unwrap();
    for e in std::fs::read_dir(from).unwrap() {
        let e = e.unwrap();
        if e.path().is_file() {
            std::fs::copy(e.path(), to.join(e.file_name())).unwrap();
        }
    }
}

/// Parsed header of a rank file plus its data bytes.
struct Parsed {
    meta: BTreeMap<String, String>,
    tensors: Vec<fo::ckpt::TensorEntry>,
    fo: Value,
    data: Vec<u8>,
}

fn parse(path: &Path) -> Parsed {
    let h = read_header(path, &File::open(path).unwrap()).unwrap();
    let bytes = std::fs::read(path).unwrap();
    let fo = serde_json::from_str(&h.metadata["fo"]).unwrap();
    Parsed {
        meta: h.metadata,
        tensors: h.tensors,
        fo,
        data: bytes[h.data_start as usize..].to_vec(),
    }
}

/// Writes `p` back; with `redigest` the digest and the commit record follow the edit.
fn write(path: &Path, mut p: Parsed, redigest: bool) {
    p.meta.insert("fo".into(), p.fo.to_string());
    if redigest {
        let d = header_digest(&p.meta, &p.tensors);
        p.meta.insert(DIGEST_KEY.into(), d.clone());
        let rec = path.parent().unwrap().join(COMMIT_FILE);
        let mut c: Value = serde_json::from_slice(&std::fs::read(&rec).unwrap()).unwrap();
        let rank =
            fo::ckpt::naming::parse_shard_file_name(path.file_name().unwrap().to_str().unwrap())
                .unwrap();
        c["digests"][rank] = Value::String(d);
        std::fs::write(&rec, c.to_string()).unwrap();
    }
    let mut out = encode_header(&p.meta, &p.tensors);
    out.extend_from_slice(&p.data);
    std::fs::write(path, out).unwrap();
}

fn set_dcp(p: &mut Parsed, name: &str, off: &Value) {
    let mut dcp: Value = serde_json::from_str(&p.meta["DCP_SHARDING_INFO"]).unwrap();
    dcp[name]["saved_offsets"] = off.clone();
    p.meta.insert("DCP_SHARDING_INFO".into(), dcp.to_string());
}

/// Applies mutation `kind` to checkpoint `dir`; returns its name.
fn mutate(dir: &Path, kind: usize, rng: &mut Rng) -> &'static str {
    let files: Vec<PathBuf> = (0..2).map(|r| dir.join(shard_file_name(r))).collect();
    let f = &files[rng.below(2)];
    let redigest = rng.below(2) == 0;
    match kind {
        0 => {
            // A random byte of the header JSON set to a random byte.
            let mut b = std::fs::read(f).unwrap();
            let n = u64::from_le_bytes(b[..8].try_into().unwrap()) as usize;
            let i = 8 + rng.below(n);
            b[i] = rng.next() as u8;
            std::fs::write(f, b).unwrap();
            "header byte"
        }
        1 => {
            // A digit of the header changed to another digit (valid JSON, other numbers).
            let mut b = std::fs::read(f).unwrap();
            let n = u64::from_le_bytes(b[..8].try_into().unwrap()) as usize;
            let digits: Vec<usize> = (8..8 + n).filter(|&i| b[i].is_ascii_digit()).collect();
            let i = digits[rng.below(digits.len())];
            b[i] = b'0' + ((b[i] - b'0' + 1 + rng.below(9) as u8) % 10);
            std::fs::write(f, b).unwrap();
            "header digit"
        }
        2 => {
            let mut b = std::fs::read(f).unwrap();
            b[rng.below(8)] ^= 1 << rng.below(8);
            std::fs::write(f, b).unwrap();
            "header length"
        }
        3 => {
            // One chunk's offset moved by +-1 on one dim, in fo's table and DCP's info.
            let mut p = parse(f);
            let names: Vec<String> = p
                .tensors
                .iter()
                .filter(|t| !t.shape.is_empty())
                .map(|t| t.name.clone())
                .collect();
            let name = &names[rng.below(names.len())];
            let mut off: Vec<i64> =
                serde_json::from_value(p.fo["tensors"][name]["global_offset"].clone()).unwrap();
            let d = rng.below(off.len());
            off[d] = (off[d] + if rng.below(2) == 0 { 1 } else { -1 }).max(0);
            let v = serde_json::json!(off);
            p.fo["tensors"][name]["global_offset"] = v.clone();
            if rng.below(4) != 0 {
                set_dcp(&mut p, name, &v);
            }
            write(f, p, redigest);
            "offset edit"
        }
        4 => {
            // The offsets of one key's chunks swapped between the two ranks.
            let (mut a, mut b) = (parse(&files[0]), parse(&files[1]));
            let common: Vec<String> = a
                .tensors
                .iter()
                .filter(|t| b.tensors.iter().any(|u| u.name == t.name))
                .map(|t| t.name.clone())
                .collect();
            let name = &common[rng.below(common.len())];
            let (oa, ob) = (
                a.fo["tensors"][name]["global_offset"].clone(),
                b.fo["tensors"][name]["global_offset"].clone(),
            );
            a.fo["tensors"][name]["global_offset"] = ob.clone();
            b.fo["tensors"][name]["global_offset"] = oa.clone();
            set_dcp(&mut a, name, &ob);
            set_dcp(&mut b, name, &oa);
            write(&files[0], a, redigest);
            write(&files[1], b, redigest);
            "offset swap"
        }
        5 => {
            // An entry removed: from the header, fo's table or DCP's info.
            let mut p = parse(f);
            let i = rng.below(p.tensors.len());
            let name = p.tensors[i].name.clone();
            match rng.below(3) {
                0 => {
                    p.tensors.remove(i);
                }
                1 => {
                    p.fo["tensors"].as_object_mut().unwrap().remove(&name);
                }
                _ => {
                    let mut dcp: Value =
                        serde_json::from_str(&p.meta["DCP_SHARDING_INFO"]).unwrap();
                    dcp.as_object_mut().unwrap().remove(&name);
                    p.meta.insert("DCP_SHARDING_INFO".into(), dcp.to_string());
                }
            }
            write(f, p, redigest);
            "removed entry"
        }
        6 => {
            // A dtype changed to another of the same size, in the header and maybe in fo's.
            let mut p = parse(f);
            let i = rng.below(p.tensors.len());
            let t = &mut p.tensors[i];
            t.dtype = match t.dtype {
                DType::F32 => DType::I32,
                DType::I32 => DType::F32,
                DType::I8 => DType::U8,
                DType::U8 => DType::I8,
                DType::F16 => DType::BF16,
                DType::BF16 => DType::F16,
                d => d,
            };
            let (name, dt) = (t.name.clone(), t.dtype.safetensors_name());
            if rng.below(2) == 0 {
                p.fo["tensors"][&name]["dtype"] = Value::String(dt.into());
            }
            write(f, p, redigest);
            "dtype edit"
        }
        7 => {
            let mut b = std::fs::read(f).unwrap();
            let n = u64::from_le_bytes(b[..8].try_into().unwrap()) as usize;
            let i = 8 + n + rng.below(b.len() - 8 - n);
            b[i] ^= 1 + rng.below(255) as u8;
            std::fs::write(f, b).unwrap();
            "data flip"
        }
        8 => {
            // param_groups edited (one rank; with the digest recomputed or not).
            let mut p = parse(f);
            p.fo["param_groups"][0]["lr"] = serde_json::json!(0.5);
            write(f, p, redigest);
            "param_groups edit"
        }
        _ => {
            let b = std::fs::read(f).unwrap();
            std::fs::write(f, &b[..rng.below(b.len())]).unwrap();
            "truncation"
        }
    }
}

#[test]
fn mutated_checkpoints_fail_cleanly_or_read_back_the_original() {
    let n: usize = std::env::var("FO_MUTATIONS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(1200);
    let originals = [
        save("mut-q8", StateFormat::Quant8, Mode::Compressed),
        save("mut-portable", StateFormat::Quant8, Mode::Portable),
    ];
    let want: Vec<Contents> = originals.iter().map(|d| contents(d).unwrap()).collect();
    assert!(
        want[0].0.keys().any(|k| k.ends_with("::scales")),
        "the quant8 checkpoint holds compressed state"
    );
    let work = tmp("mut-work");
    let mut rng = Rng(0x5EED_0011);
    let (mut refused, mut identical) = (0, 0);
    let mut by_kind: BTreeMap<&str, (usize, usize)> = BTreeMap::new();
    for i in 0..n {
        let which = i % 2;
        copy_dir(&originals[which], &work);
        let kind = mutate(&work, rng.below(10), &mut rng);
        let e = by_kind.entry(kind).or_default();
        match contents(&work) {
            Err(_) => {
                refused += 1;
                e.0 += 1;
            }
            Ok(got) => {
                assert!(
                    got == want[which],
                    "mutation {i} ({kind}) of {} loaded different values with OK",
                    originals[which].display()
                );
                identical += 1;
                e.1 += 1;
            }
        }
    }
    eprintln!("{n} mutations: {refused} refused, {identical} read back identical, 0 wrong; by kind (refused, identical): {by_kind:?}");
    assert_eq!(refused + identical, n);
    std::fs::remove_dir_all(&work).unwrap();
}
