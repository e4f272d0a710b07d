//! `fo bench ckpt`: save and load throughput of a sharded optimizer state on in-process
//! ranks, against a plain sequential write and read of the same bytes in the same run,
//! and the size of that state compressed (quant8) vs portable (f32).
use std::io::{Read, Write};
use std::os::unix::io::AsRawFd;
use std::path::{Path, PathBuf};
use std::time::Instant;

use fo::ckpt::{naming, save, Checkpoint, PackOptions, Packed, StateEntry};
use fo::optim::math::quant8;
use fo::shard::{Placement, ShardSpec};
use fo::{DType, Tensor};

use super::bench_dir::{BenchDir, MARKER};
use super::progress;

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
    ShardSpec::new(
        vec![rows, COLS],
        vec![world],
        vec![rank],
        vec![Placement::Shard(0)],
    )
    .unwrap()
}

fn dir_bytes(dir: &Path) -> u64 {
    std::fs::read_dir(dir)
        .into_iter()
        .flatten()
        .filter_map(|e| e.ok())
        .filter(|e| e.file_name() != MARKER)
        .filter_map(|e| e.metadata().ok())
        .map(|m| m.len())
        .sum()
}

fn gbps(bytes: u64, secs: f64) -> f64 {
    bytes as f64 / secs / 1e9
}

#[derive(Debug, clap::Args)]
#[command(after_help = "Examples:
  fo bench ckpt                              2 GiB over 4 ranks in a temporary directory
  fo bench ckpt --size-mib 512 --rounds 5 --dir /mnt/nvme/fo-bench --keep

--dir must be new, empty, or one an earlier run left with --keep; the benchmark removes what
it wrote (and DIR, if it created it) unless --keep. Each round saves with fo (every rank's file in parallel, fsync'd) and writes the same bytes as
one plain file (write + fsync), then reads both back cold (posix_fadvise DONTNEED first):
fo on every rank at once, checksums verified, and resharded onto ranks - 1; the plain file
sequentially. Rounds alternate which side goes first; medians over the rounds are reported.")]
pub struct BenchCkptArgs {
    /// Size of the optimizer state in MiB (8 f32 tensors of 4096 columns), >= 1.
    #[arg(long, default_value_t = 2048, value_parser = clap::value_parser!(u64).range(1..=1 << 30))]
    pub size_mib: u64,
    /// In-process ranks saving and loading (Shard(0)), 1..=1024.
    #[arg(long, default_value_t = 4, value_parser = clap::value_parser!(u16).range(1..=super::args::MAX_RANKS as i64))]
    pub ranks: u16,
    /// Seed of the data.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Directory to write into: new, empty, or left by a run with --keep (default: a new
    /// one under the temporary directory).
    #[arg(long, value_name = "DIR")]
    pub dir: Option<PathBuf>,
    /// Keep what was written (the checkpoints) afterwards.
    #[arg(long)]
    pub keep: bool,
    /// Only measure the save.
    #[arg(long)]
    pub save_only: bool,
    /// Rounds of fo and the baseline, interleaved; medians are reported (1..=1000).
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u32).range(1..=1000))]
    pub rounds: u32,
    /// Measure `fo_state_save_async` instead: the call's return time vs a synchronous
    /// save of the same optimizer state, N steps with the save in flight vs N steps
    /// alone, and the staging pool's high-water mark (`bench_ckpt_async.rs`).
    #[arg(long = "async")]
    pub async_save: bool,
    /// With --async: optimizer steps run while the save is in flight (1..=10000).
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u32).range(1..=10000))]
    pub steps: u32,
    /// With --async: the staging pool's budget in MiB (0: fo's default, the state's size
    /// within half the available memory; at most 1048576).
    #[arg(long, default_value_t = 0, value_parser = clap::value_parser!(u32).range(0..=1048576))]
    pub staging_mib: u32,
}

pub fn run(a: &BenchCkptArgs) -> Result<(), String> {
    if a.async_save {
        return super::bench_ckpt_async::run(a);
    }
    let (mib, world, seed) = (a.size_mib as usize, a.ranks as usize, a.seed);
    let rows = (mib << 20) / 4 / COLS / TENSORS;
    let bytes = (rows * COLS * 4 * TENSORS) as u64;
    // In memory: every rank's state, its compressed copy and a full read back; on disk:
    // the checkpoint, the plain file and the compressed checkpoint.
    let what = format!("--size-mib {mib}");
    super::mem::check_memory(bytes.checked_mul(3), &what)?;
    let target = a.dir.clone().unwrap_or_else(std::env::temp_dir);
    super::mem::check_disk(&target, bytes.checked_mul(5).map(|b| b / 2), &what)?;
    let (bench_dir, guards) = BenchDir::open(a.dir.as_deref(), world, seed)?;
    let result = bench(a, &bench_dir.dir, rows, bytes, world, seed);
    if !a.keep || result.is_err() {
        bench_dir.remove()?;
    }
    drop(guards);
    result
}

fn bench(
    a: &BenchCkptArgs,
    dir: &Path,
    rows: usize,
    bytes: u64,
    world: usize,
    seed: u64,
) -> Result<(), String> {
    let dir = dir.to_path_buf();
    eprintln!(
        "fo bench ckpt: {TENSORS} f32 tensors [{rows}, {COLS}] = {}, Shard(0) over {world} in-process ranks, dir {}",
        super::ckpt::bytes(bytes),
        dir.display()
    );
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
                    StateEntry::new(
                        naming::state_key(&format!("layer{k}"), naming::EXP_AVG),
                        t,
                        Some(s),
                    )
                })
                .collect();
            let mut o = PackOptions::new(r, world);
            o.mode = "portable".into();
            o.save_id = format!("bench-{seed}");
            Packed::new(entries, o).unwrap()
        })
        .collect();
    // The checkpoint goes straight into DIR (tests/ckpt_faults.rs kills a save there).
    let fo_dir = dir.clone();
    let plain = dir.join("plain.bin");
    let to = world.max(2) - 1;
    let mut m = Measured::default();
    let pb = progress::bytes(
        "bench ckpt",
        bytes * a.rounds as u64 * if a.save_only { 2 } else { 5 },
    );
    // Interleaved: each round runs fo and the baseline back to back, alternating which goes
    // first, so both see the same machine state; reads start cold (page cache dropped).
    for round in 0..a.rounds {
        let fo_side = |m: &mut Measured| -> Result<(), String> {
            m.save
                .push(timed(|| save(&fo_dir, &packs).map_err(|e| e.to_string()))?);
            pb.inc(bytes);
            if !a.save_only {
                drop_cache(&fo_dir)?;
                m.load.push(timed(|| load(&fo_dir, rows, world))?);
                drop_cache(&fo_dir)?;
                m.reshard.push(timed(|| load(&fo_dir, rows, to))?);
                pb.inc(2 * bytes);
            }
            Ok(())
        };
        let plain_side = |m: &mut Measured| -> Result<(), String> {
            m.plain_write.push(timed(|| plain_write(&plain, &packs))?);
            pb.inc(bytes);
            if !a.save_only {
                drop_cache(&plain)?;
                m.plain_read.push(timed(|| plain_read(&plain, bytes))?);
                pb.inc(bytes);
            }
            Ok(())
        };
        if round % 2 == 0 {
            fo_side(&mut m)?;
            plain_side(&mut m)?;
        } else {
            plain_side(&mut m)?;
            fo_side(&mut m)?;
        }
    }
    pb.finish_and_clear();
    std::fs::remove_file(&plain).ok();
    m.print(bytes, world, to, a.save_only);
    if a.save_only {
        return Ok(());
    }
    let portable = dir_bytes(&fo_dir);
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
                let base = naming::state_key(&format!("layer{k}"), naming::EXP_AVG);
                let ck = naming::codes_key(&base);
                let codes = Tensor::new(
                    DType::I8,
                    t.shape.clone(),
                    codes.into_iter().map(|c| c as u8).collect(),
                )
                .unwrap();
                let sc = Tensor::new(
                    DType::F16,
                    vec![scales.len()],
                    scales
                        .iter()
                        .flat_map(|s| s.to_bits().to_le_bytes())
                        .collect(),
                )
                .unwrap();
                entries.push(StateEntry::new(
                    ck.clone(),
                    codes,
                    Some(spec(rows, world, p.opts.rank)),
                ));
                entries.push(StateEntry::group_scales(naming::scales_key(&base), sc, ck));
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
        "checkpoint size: portable {} ({portable} bytes), compressed {} ({compressed} bytes), {:.3}x",
        super::ckpt::bytes(portable),
        super::ckpt::bytes(compressed),
        compressed as f64 / portable as f64
    );
    Ok(())
}

/// Medians of each measurement, in seconds.
#[derive(Default)]
struct Measured {
    save: Vec<f64>,
    load: Vec<f64>,
    reshard: Vec<f64>,
    plain_write: Vec<f64>,
    plain_read: Vec<f64>,
}

pub(super) fn median(v: &[f64]) -> f64 {
    let mut v = v.to_vec();
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

impl Measured {
    fn print(&self, bytes: u64, world: usize, to: usize, save_only: bool) {
        let rounds = self.save.len();
        let row = |what: &str, fo: &[f64], base: &[f64], base_name: &str| {
            let (f, b) = (median(fo), median(base));
            println!(
                "{what:<28} fo {:>6.2} GB/s ({f:.3} s)   {base_name:<17} {:>6.2} GB/s ({b:.3} s)   fo/plain {:.2}x",
                gbps(bytes, f),
                gbps(bytes, b),
                b / f
            );
        };
        println!("medians of {rounds} interleaved rounds; reads cold (posix_fadvise DONTNEED before each)");
        row(
            &format!("save, {world} ranks"),
            &self.save,
            &self.plain_write,
            "plain write+fsync",
        );
        if save_only {
            return;
        }
        row(
            &format!("load, {world} ranks"),
            &self.load,
            &self.plain_read,
            "plain read",
        );
        row(
            &format!("load resharded {world}->{to}"),
            &self.reshard,
            &self.plain_read,
            "plain read",
        );
    }
}

fn timed(f: impl FnOnce() -> Result<(), String>) -> Result<f64, String> {
    let t = Instant::now();
    f()?;
    Ok(t.elapsed().as_secs_f64())
}

/// Every rank of `world` reads its Shard(0) of every tensor (checksums verified).
fn load(dir: &Path, rows: usize, world: usize) -> Result<(), String> {
    let ck = Checkpoint::open(dir).map_err(|e| e.to_string())?;
    std::thread::scope(|sc| {
        let hs: Vec<_> = (0..world)
            .map(|r| {
                let ck = &ck;
                sc.spawn(move || {
                    for k in 0..TENSORS {
                        ck.read(
                            &naming::state_key(&format!("layer{k}"), naming::EXP_AVG),
                            &spec(rows, world, r),
                        )
                        .map_err(|e| e.to_string())?;
                    }
                    Ok::<(), String>(())
                })
            })
            .collect();
        hs.into_iter().try_for_each(|h| {
            h.join()
                .map_err(|_| "a reader thread panicked".to_string())?
        })
    })
}

/// The baseline: the same bytes, one file, plain sequential write + fsync.
fn plain_write(path: &Path, packs: &[Packed]) -> Result<(), String> {
    let mut w = std::fs::File::create(path).map_err(|e| format!("{}: {e}", path.display()))?;
    for p in packs {
        for i in 0..p.plan.chunks.len() {
            let data = p.chunk_data(i).map_err(|e| e.to_string())?;
            w.write_all(data).map_err(|e| e.to_string())?;
        }
    }
    w.sync_all().map_err(|e| e.to_string())
}

fn plain_read(path: &Path, bytes: u64) -> Result<(), String> {
    let mut buf = Vec::with_capacity(bytes as usize);
    std::fs::File::open(path)
        .and_then(|mut r| r.read_to_end(&mut buf))
        .map_err(|e| format!("{}: {e}", path.display()))?;
    std::hint::black_box(&buf);
    Ok(())
}

/// Drops `path`'s pages (a file, or every file of a directory) from the page cache, so
/// the next read comes from the disk. The files were fsync'd, so their pages are clean.
fn drop_cache(path: &Path) -> Result<(), String> {
    let files: Vec<PathBuf> = if path.is_dir() {
        std::fs::read_dir(path)
            .map_err(|e| e.to_string())?
            .filter_map(|e| Some(e.ok()?.path()))
            .filter(|p| p.is_file())
            .collect()
    } else {
        vec![path.to_path_buf()]
    };
    for f in files {
        let file = std::fs::File::open(&f).map_err(|e| format!("{}: {e}", f.display()))?;
        // SAFETY: a valid open descriptor; offset 0 and length 0 mean the whole file.
        let rc = unsafe { libc::posix_fadvise(file.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED) };
        if rc != 0 {
            return Err(format!("posix_fadvise({}): error {rc}", f.display()));
        }
    }
    Ok(())
}
