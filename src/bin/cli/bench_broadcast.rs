//! `fo bench broadcast`: distribute a state dict from rank 0 to an in-process group,
//! scatter (each rank receives its shard) against the naive full broadcast (every rank
//! receives every full tensor and keeps its slice), in one run: bytes and time.
use std::sync::Arc;
use std::time::Instant;

use fo::broadcast::{
    broadcast_state_dict, BroadcastDest, BroadcastOptions, BroadcastStats, Strategy,
};
use fo::comm::Comm;
use fo::shard::{Placement, ShardSpec};
use fo::{DType, TensorView};

/// f32 storage of `n` elements, filled with each element's global index.
fn iota(n: usize, from: usize) -> Vec<f32> {
    (0..n).map(|i| (from + i) as f32).collect()
}

fn view(buf: &mut [f32], shape: &[usize]) -> TensorView {
    let s: Vec<i64> = shape.iter().map(|&x| x as i64).collect();
    unsafe {
        TensorView::host(buf.as_mut_ptr() as *mut u8, DType::F32, &s, None, "bench")
            .expect("valid view")
    }
}

struct Outcome {
    seconds: f64,
    stats: Vec<BroadcastStats>,
}

fn run_once(
    ranks: usize,
    tensors: usize,
    rows: usize,
    cols: usize,
    strategy: Strategy,
) -> Result<Outcome, String> {
    let full: Arc<Vec<Vec<f32>>> = Arc::new(
        (0..tensors)
            .map(|t| iota(rows * cols, t * rows * cols))
            .collect(),
    );
    let handles: Vec<_> = Comm::local_group(ranks)
        .into_iter()
        .map(|comm| {
            let full = full.clone();
            std::thread::spawn(move || -> Result<(f64, BroadcastStats), String> {
                let r = comm.rank();
                let mut src: Vec<Vec<f32>> = if r == 0 { (*full).clone() } else { Vec::new() };
                let full_views: Vec<(String, TensorView)> = src
                    .iter_mut()
                    .enumerate()
                    .map(|(t, b)| (format!("layers.{t}.weight"), view(b, &[rows, cols])))
                    .collect();
                let specs: Vec<ShardSpec> = (0..tensors)
                    .map(|_| {
                        ShardSpec::new(
                            vec![rows, cols],
                            vec![ranks],
                            vec![r],
                            vec![Placement::Shard(0)],
                        )
                    })
                    .collect::<Result<_, _>>()
                    .map_err(|e| e.to_string())?;
                let mut dst: Vec<Vec<f32>> =
                    specs.iter().map(|s| vec![0f32; s.local_numel()]).collect();
                let dests: Vec<BroadcastDest> = dst
                    .iter_mut()
                    .zip(&specs)
                    .enumerate()
                    .map(|(t, (b, s))| BroadcastDest {
                        key: format!("layers.{t}.weight"),
                        tensor: view(b, &s.local_shape()),
                        spec: Some(s.clone()),
                    })
                    .collect();
                let opts = BroadcastOptions {
                    strategy,
                    ..Default::default()
                };
                comm.barrier().map_err(|e| e.to_string())?;
                let t0 = Instant::now();
                let stats = unsafe {
                    broadcast_state_dict(&comm, (r == 0).then_some(&full_views[..]), &dests, &opts)
                }
                .map_err(|e| e.to_string())?;
                let secs = t0.elapsed().as_secs_f64();
                // Spot-check: each shard starts at its first global row.
                for (t, (b, s)) in dst.iter().zip(&specs).enumerate() {
                    if let (Some(&v), Some(row)) =
                        (b.first(), s.runs(0).map_err(|e| e.to_string())?.first())
                    {
                        let want = (t * rows * cols + row * cols) as f32;
                        if v != want {
                            return Err(format!("rank {r} tensor {t}: got {v}, expected {want}"));
                        }
                    }
                }
                Ok((secs, stats))
            })
        })
        .collect();
    let mut out = Outcome {
        seconds: 0.0,
        stats: Vec::new(),
    };
    for h in handles {
        let (s, st) = h.join().map_err(|_| "a rank panicked".to_string())??;
        out.seconds = out.seconds.max(s);
        out.stats.push(st);
    }
    Ok(out)
}

fn mib(b: u64) -> f64 {
    b as f64 / (1u64 << 20) as f64
}

#[derive(Debug, clap::Args)]
#[command(after_help = "Examples:
  fo bench broadcast                    1 GiB over 4 ranks
  fo bench broadcast --ranks 8 --size-mib 256 --tensors 4")]
pub struct BroadcastArgs {
    /// In-process ranks, 1..=1024.
    #[arg(long, default_value_t = 4, value_parser = clap::value_parser!(u16).range(1..=super::args::MAX_RANKS as i64))]
    pub ranks: u16,
    /// Size of rank 0's state dict in MiB (>= 1).
    #[arg(long, default_value_t = 1024, value_parser = clap::value_parser!(u64).range(1..=1 << 30))]
    pub size_mib: u64,
    /// Number of f32 tensors it is split into (1..=65536).
    #[arg(long, default_value_t = 16, value_parser = clap::value_parser!(u32).range(1..=65536))]
    pub tensors: u32,
}

pub fn run(a: &BroadcastArgs) -> Result<(), String> {
    let (ranks, size_mib, tensors) = (a.ranks as usize, a.size_mib as usize, a.tensors as usize);
    let cols = 4096usize;
    let rows = ((size_mib << 20) / 4 / cols / tensors).max(1);
    let total = (tensors * rows * cols * 4) as u64;
    // Rank 0's state dict and its copy, every rank's shards, and the full broadcast's
    // per-tensor receive buffers on every rank.
    let need = total
        .checked_mul(3)
        .and_then(|x| x.checked_add((total / tensors as u64).checked_mul(ranks as u64)?));
    super::mem::check_memory(
        need,
        &format!("--size-mib {size_mib} --ranks {ranks} --tensors {tensors}"),
    )?;
    println!(
        "fo bench broadcast: {tensors} f32 tensors of [{rows}, {cols}] = {:.1} MiB, Shard(0) over {ranks} in-process ranks",
        mib(total)
    );
    println!(
        "{:<16} {:>10} {:>22} {:>22} {:>16}",
        "strategy", "time (s)", "received/rank (MiB)", "received, all (MiB)", "sent by 0 (MiB)"
    );
    for (name, strategy) in [
        ("scatter", Strategy::Scatter),
        ("full broadcast", Strategy::FullBroadcast),
    ] {
        let o = run_once(ranks, tensors, rows, cols, strategy)?;
        let per_rank: Vec<String> = o
            .stats
            .iter()
            .map(|s| format!("{:.1}", mib(s.bytes_received)))
            .collect();
        let all: u64 = o.stats.iter().map(|s| s.bytes_received).sum();
        println!(
            "{:<16} {:>10.3} {:>22} {:>22.1} {:>16.1}",
            name,
            o.seconds,
            per_rank.join("/"),
            mib(all),
            mib(o.stats[0].bytes_sent)
        );
        println!(
            "{:<16} table {} B per rank, agreement {} B per rank",
            "", o.stats[0].table_bytes, o.stats[0].control_bytes
        );
    }
    Ok(())
}
