//! The demo's closing report and the checks that make it a test.
use std::path::Path;

use super::rank::Setup;
use super::Trace;

type Checks = Vec<(bool, String)>;

fn dir_bytes(dir: &Path) -> u64 {
    std::fs::read_dir(dir)
        .map(|rd| {
            rd.filter_map(|e| e.ok())
                .filter_map(|e| e.metadata().ok())
                .map(|m| m.len())
                .sum()
        })
        .unwrap_or(0)
}

fn max_abs_diff(a: &[f64], b: &[f64]) -> f64 {
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f64::max)
}

fn max_rel_diff(a: &[f64], b: &[f64]) -> f64 {
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs() / y.abs().max(1e-12))
        .fold(0.0, f64::max)
}

fn check(checks: &mut Checks, ok: bool, what: String) {
    println!("  [{}] {what}", if ok { "ok" } else { "FAILED" });
    checks.push((ok, what));
}

pub(super) fn report(
    setup: &Setup,
    ranks: usize,
    out: &Path,
    reference: &[Trace],
    same: &[Trace],
    resharded: &[Trace],
    broadcast: &[Trace],
) -> Result<Checks, String> {
    let half = setup.steps / 2;
    let r = &reference[0].losses;
    let tail = &r[half..];
    let (a, b, c) = (&same[0].losses, &resharded[0].losses, &broadcast[0].losses);
    let mut checks = Checks::new();

    println!(
        "\nloss curve (uninterrupted reference vs the three restarts from step {}):",
        half + 1
    );
    println!(
        "  {:>5}  {:>12}  {:>12}  {:>12}  {:>12}",
        "step",
        "reference",
        format!("{ranks} ranks"),
        format!("{} resharded", ranks - 1),
        format!("{} broadcast", ranks - 1)
    );
    let every = (setup.steps / 10).max(1);
    for (i, step) in (half..setup.steps).enumerate() {
        if step % every == 0 || step + 1 == setup.steps {
            println!(
                "  {:>5}  {:>12.6}  {:>12.6}  {:>12.6}  {:>12.6}",
                step + 1,
                tail[i],
                a[i],
                b[i],
                c[i]
            );
        }
    }
    println!(
        "  mean step time: {:.2} ms ({ranks} ranks), {:.2} ms ({} ranks)",
        reference[0].step_ms,
        resharded[0].step_ms,
        ranks - 1
    );

    println!("\nchecks:");
    let (first, last) = (r[0], r[r.len() - 1]);
    check(
        &mut checks,
        last < 0.9 * first,
        format!("training learns: loss {first:.5} -> {last:.5} (at least 10% lower)"),
    );
    let d_same = max_abs_diff(a, tail);
    check(
        &mut checks,
        d_same == 0.0,
        format!("restart on {ranks} ranks (same sharding) is identical: max |diff| = {d_same:e}"),
    );
    // Another rank count regroups quant8 codes and changes the order of gradient sums, so
    // the trajectories differ slightly; the bound says they stay the same training run.
    let d_resh = max_rel_diff(b, tail);
    check(
        &mut checks,
        d_resh < 0.05,
        format!(
            "restart on {} ranks (resharded): max relative loss difference {d_resh:.2e} (< 5%)",
            ranks - 1
        ),
    );
    let d_bc = max_rel_diff(c, tail);
    check(&mut checks, d_bc < 0.05, format!("restart via consolidated checkpoint + broadcast: max relative loss difference {d_bc:.2e} (< 5%)"));

    let fo_state = reference[0].state_bytes_per_param;
    let fo_total = fo_state + 2.0 + 2.0;
    check(
        &mut checks,
        fo_total < 16.0,
        format!(
            "optimizer memory: {fo_state:.3} B/param of state; {fo_total:.3} B/param counting a bf16 param and bf16 grad, \
             vs 16 B/param for fp32 AdamW (param, grad, exp_avg, exp_avg_sq)"
        ),
    );

    let (comp, port) = (
        dir_bytes(&out.join("compressed")),
        dir_bytes(&out.join("portable")),
    );
    check(
        &mut checks,
        comp > 0 && comp < port,
        format!(
            "checkpoint size: compressed {comp} B vs portable {port} B ({:.2}x smaller)",
            port as f64 / comp.max(1) as f64
        ),
    );

    for (rank, t) in broadcast.iter().enumerate() {
        let Some(bc) = &t.broadcast else {
            check(
                &mut checks,
                false,
                format!("rank {rank}: no broadcast report"),
            );
            continue;
        };
        if rank == 0 {
            println!(
                "  rank 0 (source) held the full state dict: {} B",
                bc.full_bytes
            );
            continue;
        }
        // The payload is exactly this rank's shards; the table is the only other traffic.
        let total = bc.bytes_received + bc.table_bytes;
        check(
            &mut checks,
            bc.bytes_received == bc.shard_bytes && total < bc.full_bytes,
            format!(
                "rank {rank} received {total} B in the broadcast = its shards {} B + the {} B table (full state dict {} B)",
                bc.shard_bytes, bc.table_bytes, bc.full_bytes
            ),
        );
    }
    Ok(checks)
}

/// The overlapped run against the reference: the same losses bit for bit, and the step
/// time left exposed after the last gradient both ways.
pub(super) fn report_overlap(checks: &mut Checks, reference: &[Trace], overlapped: &[Trace]) {
    let (r, o) = (&reference[0], &overlapped[0]);
    println!(
        "  exposed step time (last gradient ready -> step done), mean per step on rank 0: \
         sequential clip + step {:.3} ms, overlapped step_end {:.3} ms",
        r.exposed_ms, o.exposed_ms
    );
    println!(
        "  (here every gradient is final at once, after the all-reduce: there is no backward to \
         hide the step behind; `fo bench overlap` measures that)"
    );
    let same = r
        .losses
        .iter()
        .zip(&o.losses)
        .all(|(a, b)| a.to_bits() == b.to_bits());
    check(
        checks,
        same && r.losses.len() == o.losses.len(),
        format!(
            "overlapped step (clipping through step_end) follows the sequential run bit for bit: {} losses identical",
            o.losses.len()
        ),
    );
}
