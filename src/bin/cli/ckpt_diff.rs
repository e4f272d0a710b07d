//! `fo ckpt diff A B`: compare two checkpoints key by key whatever their shardings (fo's
//! or torch's, sharded or consolidated, compressed state dequantized), slab by slab.
use std::path::PathBuf;

use serde_json::{json, Value};

use super::args::non_negative_f64;
use super::ckpt_source::{LogicalKey, Source, SLAB_ELEMS};
use super::progress;

#[derive(Debug, clap::Args)]
#[command(
    after_help = "An element is within tolerance when |a - b| <= atol + rtol * |b| (torch.allclose; NaN equals
NaN). A and B may be sharded checkpoint directories (any world size, mesh or placements), a
consolidated directory, or one .safetensors file. Compressed (quant8) state is compared as
its dequantized values. The report (table and summary line, or --json) goes to stdout, and
nothing to stderr unless a checkpoint cannot be read. Exit status: 0 every key within
tolerance, 1 a key differs or is missing on one side (or a checkpoint cannot be read), 2 bad
usage.

Examples:
  fo ckpt diff ckpt/step-1000 ckpt/step-1000-on-3-ranks
  fo ckpt diff tests/oracle/ckpt_fsdp2_4ranks/sharded tests/oracle/ckpt_fsdp2_4ranks/full.safetensors
  fo ckpt diff A B --atol 1e-2 --json | jq '.keys[] | select(.status != \"equal\")'"
)]
pub struct DiffArgs {
    /// The first checkpoint (directory or .safetensors file).
    pub a: PathBuf,
    /// The second checkpoint, the reference of the relative difference.
    pub b: PathBuf,
    /// Relative tolerance (>= 0).
    #[arg(long, default_value_t = 0.0, allow_negative_numbers = true, value_parser = non_negative_f64)]
    pub rtol: f64,
    /// Absolute tolerance (>= 0).
    #[arg(long, default_value_t = 0.0, allow_negative_numbers = true, value_parser = non_negative_f64)]
    pub atol: f64,
    /// One JSON object on stdout instead of the table.
    #[arg(long)]
    pub json: bool,
    /// Elements read per slab and side (bounds memory; tests make it tiny).
    #[arg(long, default_value_t = SLAB_ELEMS, hide = true,
          value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..=SLAB_ELEMS as u64))]
    pub slab_elems: usize,
}

/// One key's comparison.
#[derive(Debug, Default)]
struct KeyDiff {
    numel: usize,
    max_abs: f64,
    max_rel: f64,
    out_of_tol: usize,
    /// Why the values were not compared (shape or presence), if so.
    mismatch: Option<String>,
}

impl KeyDiff {
    fn status(&self) -> &'static str {
        match &self.mismatch {
            Some(m) if m.starts_with("only in") => "missing",
            Some(_) => "mismatch",
            None if self.out_of_tol > 0 => "differs",
            None if self.max_abs == 0.0 => "equal",
            None => "within",
        }
    }

    fn differs(&self) -> bool {
        matches!(self.status(), "missing" | "mismatch" | "differs")
    }

    fn add(&mut self, a: &[f64], b: &[f64], rtol: f64, atol: f64) {
        for (&x, &y) in a.iter().zip(b) {
            self.numel += 1;
            if x.is_nan() && y.is_nan() {
                continue;
            }
            let d = (x - y).abs();
            // NaN against a number, or infinities of different sign, are infinitely apart.
            let d = if d.is_nan() || (x != y && d.is_infinite()) {
                f64::INFINITY
            } else if x == y {
                0.0
            } else {
                d
            };
            let rel = if d == 0.0 { 0.0 } else { d / y.abs() };
            self.max_abs = self.max_abs.max(d);
            self.max_rel = self.max_rel.max(rel);
            if d > atol + rtol * y.abs() {
                self.out_of_tol += 1;
            }
        }
    }
}

fn num(x: f64) -> Value {
    // JSON has no infinity: a relative difference against 0 is reported as null.
    if x.is_finite() {
        json!(x)
    } else {
        Value::Null
    }
}

pub fn run(a: &DiffArgs) -> Result<(), String> {
    let (sa, sb) = (Source::open(&a.a)?, Source::open(&a.b)?);
    let (ka, kb) = (sa.keys(), sb.keys());
    let mut names: Vec<&String> = ka.keys().chain(kb.keys()).collect();
    names.sort();
    names.dedup();
    let total: u64 = ka
        .iter()
        .filter_map(|(k, x)| kb.get(k).map(|y| (x, y)))
        .map(|(x, y)| {
            (x.shape.iter().product::<usize>() * (x.dtype.size() + y.dtype.size())) as u64
        })
        .sum();
    let pb = progress::bytes("diff", total);
    let mut rows = Vec::new();
    for name in names {
        let d = match (ka.get(name), kb.get(name)) {
            (Some(x), Some(y)) => compare(&sa, &sb, name, (x, y), a, &pb)?,
            (Some(_), None) => KeyDiff {
                mismatch: Some(format!("only in {}", a.a.display())),
                ..Default::default()
            },
            _ => KeyDiff {
                mismatch: Some(format!("only in {}", a.b.display())),
                ..Default::default()
            },
        };
        rows.push((
            name.clone(),
            ka.get(name).or(kb.get(name)).unwrap().clone(),
            d,
        ));
    }
    pb.finish_and_clear();
    let differing = rows.iter().filter(|r| r.2.differs()).count();
    if a.json {
        let keys: Vec<Value> = rows
            .iter()
            .map(|(k, lk, d)| {
                json!({"key": k, "status": d.status(), "shape": lk.shape, "numel": d.numel,
                       "max_abs": num(d.max_abs), "max_rel": num(d.max_rel),
                       "out_of_tolerance": d.out_of_tol, "reason": d.mismatch})
            })
            .collect();
        let out = json!({"a": a.a, "b": a.b, "rtol": a.rtol, "atol": a.atol, "keys": keys,
                         "keys_compared": rows.len(), "keys_differing": differing, "equal": differing == 0});
        println!("{}", serde_json::to_string_pretty(&out).unwrap());
    } else {
        print_table(&rows);
    }
    let summary = format!(
        "{} keys: {} equal, {} within tolerance (rtol {}, atol {}), {differing} differ or are missing",
        rows.len(),
        rows.iter().filter(|r| r.2.status() == "equal").count(),
        rows.iter().filter(|r| r.2.status() == "within").count(),
        a.rtol,
        a.atol
    );
    if !a.json {
        println!("{summary}");
    }
    if differing > 0 {
        // Reported on stdout: exit 1 with nothing more to say.
        return Err(super::REPORTED.into());
    }
    Ok(())
}

fn compare(
    sa: &Source,
    sb: &Source,
    name: &str,
    (x, y): (&LogicalKey, &LogicalKey),
    a: &DiffArgs,
    pb: &indicatif::ProgressBar,
) -> Result<KeyDiff, String> {
    let mut d = KeyDiff::default();
    if x.shape != y.shape {
        d.mismatch = Some(format!("global shape {:?} vs {:?}", x.shape, y.shape));
        return Ok(d);
    }
    for slab in Source::slabs(&x.shape, a.slab_elems)? {
        let (va, vb) = (sa.read(name, x, &slab)?, sb.read(name, y, &slab)?);
        d.add(&va, &vb, a.rtol, a.atol);
        pb.inc((va.len() * (x.dtype.size() + y.dtype.size())) as u64);
    }
    Ok(d)
}

fn print_table(rows: &[(String, LogicalKey, KeyDiff)]) {
    println!(
        "{:<48} {:<9} {:<14} {:>11} {:>11} {:>14}",
        "key", "status", "global shape", "max abs", "max rel", "out of tol"
    );
    for (k, lk, d) in rows {
        if let Some(m) = &d.mismatch {
            println!(
                "{:<48} {:<9} {:<14} {m}",
                k,
                d.status(),
                format!("{:?}", lk.shape)
            );
            continue;
        }
        println!(
            "{:<48} {:<9} {:<14} {:>11.3e} {:>11.3e} {:>14}",
            k,
            d.status(),
            format!("{:?}", lk.shape),
            d.max_abs,
            d.max_rel,
            format!("{}/{}", d.out_of_tol, d.numel)
        );
    }
}
