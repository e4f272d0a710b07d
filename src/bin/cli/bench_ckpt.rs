//! `fo bench ckpt`: save and load throughput of a sharded optimizer state on in-process
//! ranks, against a plain sequential write and read of the same bytes in the same run,
//! and the size of that state compressed (quant8) vs portable (f32).
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::time::Instant;

use fo::ckpt::{save, Checkpoint, PackOptions, Packed, StateEntry};
use fo::optim::quant8;
use fo::shard::{Placement, ShardSpec};
use fo::{DType, Tensor};

const COLS: usize = 4096;
const TENSORS: usize = 8;

/// Pseudo-random f32 bytes (xorshift), cheap enough for gigabytes.
fn fill(n: usize, seed: u64) -> Vec<u8> {
    let mut s = seed.wrapping_mul(0x9E3779B97F4A7C15) | 1;
    let mut out = Vec::with_capacity(n * 4);
    for _ in 0..n {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        out.extend_from_slice(&(((s >> 40) as f32 / (1u64 << 24) as f32) - 0.5).to_le_bytes());
    }
    out
}

fn spec(rows: usize, world: usize, rank: usize) -> ShardSpec {
    ShardSpec::new(vec![rows, COLS], vec![world], vec![rank], vec![Placement::Shard(0)]).unwrap()
}

fn dir_bytes(dir: &Path) -> u64 {
    std::fs::read_dir(dir)
        .unwrap()
        .filter_map(|e| e.ok()?.metadata().ok())
        .map(|m| m.len())
        .sum()
}

fn gbps(bytes: u64, secs: f64) -> f64 {
    bytes as f64 / secs / 1e9
}

#[derive(Debug, clap::Args)]
#[command(after_help = "Examples:
  fo bench ckpt                              2 GiB over 4 ranks in a temporary directory
  fo bench ckpt --size-mib 512 --dir /mnt/nvme/fo-bench --keep")]
pub struct BenchCkptArgs {
    /// Size of the optimizer state in MiB (8 f32 tensors of 4096 columns).
    #[arg(long, default_value_t = 2048)]
    pub size_mib: usize,
    /// In-process ranks saving and loading (Shard(0)).
    #[arg(long, default_value_t = 4)]
    pub ranks: usize,
    /// Seed of the data.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Directory to write into (default: a new one under the temporary directory).
    #[arg(long, value_name = "DIR")]
    pub dir: Option<PathBuf>,
    /// Keep the directory afterwards.
    #[arg(long)]
    pub keep: bool,
    /// Only measure the save.
    #[arg(long)]
    pub save_only: bool,
}

pub fn run(a: &BenchCkptArgs) -> Result<(), String> {
    let (mib, world, seed) = (a.size_mib, a.ranks, a.seed);
    let dir = a
        .dir
        .clone()
        .unwrap_or_else(|| std::env::temp_dir().join(format!("fo-bench-ckpt-{}", std::process::id())));
    let rows = (mib << 20) / 4 / COLS / TENSORS;
    let bytes = (rows * COLS * 4 * TENSORS) as u64;
    eprintln!("fo bench ckpt: {TENSORS} f32 tensors [{rows}, {COLS}] = {:.2} GiB, Shard(0) over {world} in-process ranks, dir {}", bytes as f64 / (1u64 << 30) as f64, dir.display());
    let packs: Vec<Packed> = (0..world)
        .map(|r| {
            let entries = (0..TENSORS)
                .map(|k| {
                    let s = spec(rows, world, r);
                    let t = Tensor::new(
                        DType::F32,
                        s.local_shape(),
                        fill(s.local_numel(), seed * 1000 + (k * world + r) as u64),
                    )
                    .unwrap();
                    StateEntry::new(format!("state.layer{k}.exp_avg"), t, Some(s))
                })
                .collect();
            let mut o = PackOptions::new(r, world);
            o.mode = "portable".into();
            o.save_id = format!("bench-{seed}");
            Packed::new(entries, o).unwrap()
        })
        .collect();
    let t = Instant::now();
    save(&dir, &packs).map_err(|e| e.to_string())?;
    let save_s = t.elapsed().as_secs_f64();
    println!("save  {world} ranks: {:.2} GB/s ({:.2} s)", gbps(bytes, save_s), save_s);
    if a.save_only {
        return Ok(());
    }
    let t = Instant::now();
    let ck = Checkpoint::open(&dir).map_err(|e| e.to_string())?;
    std::thread::scope(|sc| {
        for r in 0..world {
            let ck = &ck;
            sc.spawn(move || {
                for k in 0..TENSORS {
                    ck.read(&format!("state.layer{k}.exp_avg"), &spec(rows, world, r))
                        .unwrap();
                }
            });
        }
    });
    let load_s = t.elapsed().as_secs_f64();
    println!(
        "load  {world} ranks: {:.2} GB/s ({:.2} s), checksums verified",
        gbps(bytes, load_s),
        load_s
    );
    let to = world.max(2) - 1;
    let t = Instant::now();
    std::thread::scope(|sc| {
        for r in 0..to {
            let ck = &ck;
            sc.spawn(move || {
                for k in 0..TENSORS {
                    ck.read(&format!("state.layer{k}.exp_avg"), &spec(rows, to, r)).unwrap();
                }
            });
        }
    });
    let re_s = t.elapsed().as_secs_f64();
    println!(
        "load  resharded {world}->{to} ranks: {:.2} GB/s ({:.2} s)",
        gbps(bytes, re_s),
        re_s
    );
    // Baseline: the same bytes, one file, plain sequential write + fsync and read.
    let plain = dir.join("plain.bin");
    let t = Instant::now();
    {
        let mut w = std::fs::File::create(&plain).map_err(|e| e.to_string())?;
        for p in &packs {
            for i in 0..p.plan.chunks.len() {
                w.write_all(p.chunk_data(i)).map_err(|e| e.to_string())?;
            }
        }
        w.sync_all().map_err(|e| e.to_string())?;
    }
    let pw = t.elapsed().as_secs_f64();
    let t = Instant::now();
    let mut buf = Vec::with_capacity(bytes as usize);
    std::fs::File::open(&plain)
        .and_then(|mut r| r.read_to_end(&mut buf))
        .map_err(|e| e.to_string())?;
    let pr = t.elapsed().as_secs_f64();
    drop(buf);
    std::fs::remove_file(&plain).ok();
    println!(
        "plain sequential write+fsync: {:.2} GB/s ({pw:.2} s); read: {:.2} GB/s ({pr:.2} s)",
        gbps(bytes, pw),
        gbps(bytes, pr)
    );
    let portable = dir_bytes(&dir);
    // The same state as quant8 momentum codes + fp16 scales, saved the same way.
    let cdir = dir.join("compressed");
    let cpacks: Vec<Packed> = packs
        .iter()
        .map(|p| {
            let mut entries = vec![];
            for (k, t) in p.entries.iter().enumerate() {
                let x = t.to_f32().unwrap();
                let mut codes = vec![0i8; x.len()];
                let mut scales = vec![half::f16::ZERO; quant8::num_groups(x.len())];
                quant8::quantize_signed(&x, &mut codes, &mut scales);
                let ck = format!("state.layer{k}.exp_avg::quantized");
                let codes =
                    Tensor::new(DType::I8, t.shape.clone(), codes.into_iter().map(|c| c as u8).collect()).unwrap();
                let sc = Tensor::new(
                    DType::F16,
                    vec![scales.len()],
                    scales.iter().flat_map(|s| s.to_bits().to_le_bytes()).collect(),
                )
                .unwrap();
                entries.push(StateEntry::new(ck.clone(), codes, Some(spec(rows, world, p.opts.rank))));
                entries.push(StateEntry::group_scales(
                    format!("state.layer{k}.exp_avg::scales"),
                    sc,
                    ck,
                ));
            }
            Packed::new(
                entries,
                PackOptions {
                    mode: "compressed".into(),
                    ..p.opts.clone()
                },
            )
            .unwrap()
        })
        .collect();
    save(&cdir, &cpacks).map_err(|e| e.to_string())?;
    let compressed = dir_bytes(&cdir);
    println!(
        "checkpoint size: portable {portable} bytes, compressed {compressed} bytes ({:.3}x)",
        compressed as f64 / portable as f64
    );
    if !a.keep {
        std::fs::remove_dir_all(&dir).map_err(|e| e.to_string())?;
    }
    Ok(())
}
