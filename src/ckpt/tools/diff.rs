//! Comparing two checkpoints key by key, whatever their shardings (fo's or torch's, sharded
//! or consolidated, compressed state dequantized), slab by slab: the report `fo ckpt diff`,
//! `fo_checkpoint_diff_json` and Python's `fo.ckpt.diff` give.
//!
//! An element is within tolerance when `|a - b| <= atol + rtol * |b|` (torch.allclose; NaN
//! equals NaN). A key's status: `equal`, `within` (tolerance), `differs`, `mismatch` (global
//! shapes differ) or `missing` (on one side only).
use std::path::{Path, PathBuf};

use serde_json::{json, Value};

use super::info::LogicalKey;
use super::logical::{Source, SLAB_ELEMS};
use crate::error::{Error, Result};

/// How to compare.
#[derive(Debug, Clone, Copy)]
pub struct DiffOptions {
    /// Relative tolerance (>= 0, finite).
    pub rtol: f64,
    /// Absolute tolerance (>= 0, finite).
    pub atol: f64,
    /// Elements read per slab and side (bounds memory), >= 1.
    pub slab_elems: usize,
}

impl Default for DiffOptions {
    fn default() -> Self {
        DiffOptions {
            rtol: 0.0,
            atol: 0.0,
            slab_elems: SLAB_ELEMS,
        }
    }
}

/// One key's comparison.
#[derive(Debug, Default, Clone)]
pub struct KeyDiff {
    pub numel: usize,
    pub max_abs: f64,
    pub max_rel: f64,
    pub out_of_tol: usize,
    /// Why the values were not compared (shape or presence), if so.
    pub mismatch: Option<String>,
}

impl KeyDiff {
    pub fn status(&self) -> &'static str {
        match &self.mismatch {
            Some(m) if m.starts_with("only in") => "missing",
            Some(_) => "mismatch",
            None if self.out_of_tol > 0 => "differs",
            None if self.max_abs == 0.0 => "equal",
            None => "within",
        }
    }

    pub fn differs(&self) -> bool {
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
            // An infinite distance is never within tolerance (`rtol * |y|` would be NaN
            // for rtol 0 and y infinite, and any comparison with NaN is false).
            if d.is_infinite() || d > atol + rtol * y.abs() {
                self.out_of_tol += 1;
            }
        }
    }
}

/// The comparison of checkpoints `a` and `b`, one row per logical key of either, sorted.
#[derive(Debug, Clone)]
pub struct DiffReport {
    pub a: PathBuf,
    pub b: PathBuf,
    pub rtol: f64,
    pub atol: f64,
    pub rows: Vec<(String, LogicalKey, KeyDiff)>,
}

fn num(x: f64) -> Value {
    // JSON has no infinity: a relative difference against 0 is reported as null.
    if x.is_finite() {
        json!(x)
    } else {
        Value::Null
    }
}

impl DiffReport {
    /// Keys that differ, have mismatched shapes or are missing on one side.
    pub fn differing(&self) -> usize {
        self.rows.iter().filter(|r| r.2.differs()).count()
    }

    /// Keys with `status`.
    pub fn count(&self, status: &str) -> usize {
        self.rows.iter().filter(|r| r.2.status() == status).count()
    }

    /// `{"a", "b", "rtol", "atol", "keys": [{"key", "status", "shape", "numel", "max_abs",
    /// "max_rel", "out_of_tolerance", "reason"}], "keys_compared", "keys_differing", "equal"}`
    /// (`max_abs`/`max_rel` null when infinite).
    pub fn to_json(&self) -> Value {
        let keys: Vec<Value> = self
            .rows
            .iter()
            .map(|(k, lk, d)| {
                json!({"key": k, "status": d.status(), "shape": lk.shape, "numel": d.numel,
                       "max_abs": num(d.max_abs), "max_rel": num(d.max_rel),
                       "out_of_tolerance": d.out_of_tol, "reason": d.mismatch})
            })
            .collect();
        let differing = self.differing();
        json!({"a": self.a, "b": self.b, "rtol": self.rtol, "atol": self.atol, "keys": keys,
               "keys_compared": self.rows.len(), "keys_differing": differing, "equal": differing == 0})
    }

    /// One line: how many keys are equal, within tolerance, and differ or are missing.
    pub fn summary(&self) -> String {
        format!(
            "{} keys: {} equal, {} within tolerance (rtol {}, atol {}), {} differ or are missing",
            self.rows.len(),
            self.count("equal"),
            self.count("within"),
            self.rtol,
            self.atol,
            self.differing()
        )
    }
}

fn check_tolerance(v: f64, name: &str) -> Result<()> {
    if v.is_finite() && v >= 0.0 {
        Ok(())
    } else {
        Err(Error::invalid(
            name,
            format!("must be a finite number >= 0, got {v}"),
        ))
    }
}

/// Compares checkpoints `a` and `b` (directories or .safetensors files, `Source::open`).
/// `progress(bytes_read, bytes_total)` is called after each slab.
pub fn diff(
    a: &Path,
    b: &Path,
    o: &DiffOptions,
    progress: &mut dyn FnMut(u64, u64),
) -> Result<DiffReport> {
    check_tolerance(o.rtol, "rtol")?;
    check_tolerance(o.atol, "atol")?;
    if o.slab_elems == 0 {
        return Err(Error::invalid("slab_elems", "must be >= 1"));
    }
    let (sa, sb) = (Source::open(a)?, Source::open(b)?);
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
    let mut done = 0u64;
    let mut rows = Vec::new();
    for name in names {
        let d = match (ka.get(name), kb.get(name)) {
            (Some(x), Some(y)) => {
                let mut d = KeyDiff::default();
                if x.shape != y.shape {
                    d.mismatch = Some(format!("global shape {:?} vs {:?}", x.shape, y.shape));
                } else {
                    for slab in Source::slabs(&x.shape, o.slab_elems)? {
                        let (va, vb) = (sa.read(name, x, &slab)?, sb.read(name, y, &slab)?);
                        d.add(&va, &vb, o.rtol, o.atol);
                        done += (va.len() * (x.dtype.size() + y.dtype.size())) as u64;
                        progress(done, total);
                    }
                }
                d
            }
            (Some(_), None) => KeyDiff {
                mismatch: Some(format!("only in {}", a.display())),
                ..Default::default()
            },
            _ => KeyDiff {
                mismatch: Some(format!("only in {}", b.display())),
                ..Default::default()
            },
        };
        let lk = ka.get(name).or(kb.get(name)).unwrap().clone();
        rows.push((name.clone(), lk, d));
    }
    Ok(DiffReport {
        a: a.to_path_buf(),
        b: b.to_path_buf(),
        rtol: o.rtol,
        atol: o.atol,
        rows,
    })
}

/// [`diff`] as the JSON of [`DiffReport::to_json`].
pub(crate) fn diff_json(a: &Path, b: &Path, o: &DiffOptions) -> Result<String> {
    Ok(diff(a, b, o, &mut |_, _| {})?.to_json().to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nan_equals_nan_and_infinities_of_different_sign_are_apart() {
        let mut d = KeyDiff::default();
        d.add(&[f64::NAN, 1.0], &[f64::NAN, 1.0], 0.0, 0.0);
        assert_eq!(d.status(), "equal");
        d.add(&[f64::INFINITY], &[f64::NEG_INFINITY], 0.0, 0.0);
        assert_eq!((d.status(), d.out_of_tol, d.numel), ("differs", 1, 3));
        assert!(d.max_abs.is_infinite());
    }

    #[test]
    fn tolerance_is_torch_allclose() {
        let mut d = KeyDiff::default();
        d.add(&[1.05], &[1.0], 0.1, 0.0);
        assert_eq!(d.status(), "within");
        let mut d = KeyDiff::default();
        d.add(&[1.2], &[1.0], 0.1, 0.05);
        assert_eq!(d.status(), "differs");
    }

    #[test]
    fn bad_tolerances_are_refused_before_reading() {
        let o = DiffOptions {
            rtol: -1.0,
            ..Default::default()
        };
        let e = diff(
            Path::new("/nonexistent/a"),
            Path::new("/nonexistent/b"),
            &o,
            &mut |_, _| {},
        )
        .unwrap_err();
        assert!(e.to_string().contains("rtol"), "{e}");
        let o = DiffOptions {
            atol: f64::NAN,
            ..Default::default()
        };
        let e = diff_json(Path::new("/x"), Path::new("/y"), &o).unwrap_err();
        assert!(e.to_string().contains("atol"), "{e}");
    }
}
