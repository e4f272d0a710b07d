//! Loading any checkpoint into an `Optimizer`, resharded to each param's spec and
//! all-or-nothing: read and checked into fresh buffers first, then applied (or rolled back).
use std::collections::BTreeSet;
use std::path::Path;

use serde_json::Value;

use super::reader::Checkpoint;
use crate::ckpt::format::naming::{
    self, codes_key, part_key, scales_key, split_state_name, state_key, Part, ERROR_BITS,
    EXP_AVG_SQ, MASTER, STEP,
};
use crate::ckpt::save::optim::packed_params;
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::optim::{Optimizer, StateFormat};
use crate::shard::ShardSpec;
use crate::tensor::Tensor;

#[derive(Debug, Clone)]
pub struct LoadOptions {
    /// Error on missing or unexpected keys (torch's default). Off: skip and report them.
    pub strict: bool,
    /// Also load params saved under their plain FQN (as masters: rounds into the param
    /// and sets its error bits).
    pub params: bool,
    /// Restore each group's hyper-parameters from the saved `param_groups`.
    pub param_groups: bool,
}

impl Default for LoadOptions {
    fn default() -> Self {
        LoadOptions {
            strict: true,
            params: false,
            param_groups: true,
        }
    }
}

/// What a load did.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct LoadReport {
    pub loaded: Vec<String>,
    /// Keys the optimizer has state for but the checkpoint lacks (non-strict only).
    pub missing: Vec<String>,
    /// `state.*` keys of the checkpoint no parameter takes (non-strict only).
    pub unexpected: Vec<String>,
    /// Compressed keys requantized because the sharding changed.
    pub requantized: Vec<String>,
}

impl LoadReport {
    /// `{"loaded": [...], "missing": [...], "unexpected": [...], "requantized": [...]}`.
    pub fn to_json(&self) -> Value {
        serde_json::json!({"loaded": self.loaded, "missing": self.missing, "unexpected": self.unexpected, "requantized": self.requantized})
    }
}

/// A staged entry holding the param's own bytes (saved as stored), written to its memory.
const RAW_PARAM: &str = "\0param";

/// The base name of a saved state key (`exp_avg::scales` -> `exp_avg`).
fn base(name: &str) -> &str {
    split_state_name(name).0
}

/// Loads checkpoint `dir` into `opt`, resharding to each param's spec. Everything is
/// read and checked into fresh buffers first; the optimizer changes only if all of it
/// applies (a failure while applying restores every param's previous state).
pub fn load(opt: &mut Optimizer, dir: &Path, o: &LoadOptions) -> Result<LoadReport> {
    let ck = Checkpoint::open(dir)?;
    let mut report = LoadReport::default();
    let mut taken = BTreeSet::new();
    let mut staged: Vec<(usize, Vec<(String, Tensor)>)> = Vec::new();
    // A rank whose shard of a param is empty takes nothing but expects nothing either.
    for i in (0..opt.num_params()).filter(|&i| opt.param(i).numel() == 0) {
        let prefix = state_key(opt.param_fqn(i), "");
        taken.extend(ck.keys.keys().filter(|k| k.starts_with(&prefix)).cloned());
    }
    for i in packed_params(opt) {
        let fqn = opt.param_fqn(i).to_string();
        let p = opt.param(i);
        let dest = match opt.param_spec(i) {
            Some(s) => s.clone(),
            None => ShardSpec::unsharded(p.shape().to_vec())?,
        };
        let cfg = opt.param_config(i).clone();
        let prefix = state_key(&fqn, "");
        let saved: BTreeSet<String> = ck
            .keys
            .keys()
            .filter_map(|k| k.strip_prefix(&prefix))
            .map(|n| base(n).to_string())
            .collect();
        let expected: BTreeSet<String> =
            opt.keys_of(i).iter().map(|k| base(k).to_string()).collect();
        for m in expected.difference(&saved) {
            report.missing.push(format!("{prefix}{m}"));
        }
        let mut entries = Vec::new();
        for name in &saved {
            let key = format!("{prefix}{name}");
            let has_bits =
                cfg.master_weight_bits != 0 && matches!(p.dtype(), DType::BF16 | DType::F16);
            if name == ERROR_BITS && !has_bits {
                continue; // no master split here: reported as unexpected below
            }
            for k in [key.clone(), codes_key(&key), scales_key(&key)] {
                taken.insert(k);
            }
            let quantized = cfg.state_format == StateFormat::Quant8
                || (cfg.state_format == StateFormat::Quant8Wide && name != EXP_AVG_SQ);
            let signed = naming::moment_signed(name);
            if let (Some(signed), true) = (signed, quantized && ck.is_compressed(&key)) {
                let q = ck.read_quant8(&key, &dest, signed)?;
                if !q.exact {
                    report.requantized.push(key.clone());
                }
                entries.push((part_key(name, Part::Codes), q.codes));
                entries.push((part_key(name, Part::Scales), q.scales));
            } else if signed.is_some() {
                let v = ck.read_f32(&key, &dest)?;
                entries.push((name.clone(), Tensor::from_f32(dest.local_shape(), &v)?));
            } else if name == STEP {
                entries.push((name.clone(), ck.read_full(&key)?));
            } else {
                entries.push((name.clone(), ck.read(&key, &dest)?));
            }
            report.loaded.push(key);
        }
        if o.params && ck.keys.contains_key(&fqn) {
            taken.insert(fqn.clone());
            let t = ck.read(&fqn, &dest)?;
            if t.dtype == p.dtype() {
                // Saved as stored: the bytes go back as they were, and the saved error bits
                // stay (a "master" entry would recompute them from the rounded value).
                entries.push((RAW_PARAM.into(), t));
            } else {
                let v = t
                    .to_f32()
                    .map_err(|e| Error::Dtype(format!("key {fqn}: {e}")))?;
                entries.push((MASTER.into(), Tensor::from_f32(dest.local_shape(), &v)?));
            }
            report.loaded.push(fqn.clone());
        }
        if !entries.is_empty() {
            staged.push((i, entries));
        }
    }
    report.unexpected.extend(
        ck.keys
            .keys()
            .filter(|k| k.starts_with("state.") && !taken.contains(*k))
            .cloned(),
    );
    if o.strict && !(report.missing.is_empty() && report.unexpected.is_empty()) {
        return Err(Error::NotFound(format!(
            "checkpoint {} does not match the optimizer (strict load): missing keys [{}], unexpected keys [{}]",
            dir.display(),
            report.missing.join(", "),
            report.unexpected.join(", ")
        )));
    }
    let groups = if o.param_groups {
        saved_groups(&ck, opt)?
    } else {
        vec![]
    };
    apply(opt, staged, groups)?;
    Ok(report)
}

/// The saved hyper-parameters for each group of `opt` (same algorithm and format only).
fn saved_groups(
    ck: &Checkpoint,
    opt: &Optimizer,
) -> Result<Vec<(usize, crate::optim::OptimConfig)>> {
    let Some(Value::Array(groups)) = ck.meta.as_ref().map(|m| &m.param_groups) else {
        return Ok(vec![]);
    };
    let mut out = Vec::new();
    for (g, v) in groups.iter().enumerate().take(opt.num_groups()) {
        let mut c = opt.group_config(g)?.clone();
        if v["algorithm"] != c.algorithm.name() {
            return Err(Error::invalid(
                "param_groups",
                format!(
                    "saved group {g} is {}, the optimizer's is {}",
                    v["algorithm"],
                    c.algorithm.name()
                ),
            ));
        }
        let f = |k: &str, d: f64| v[k].as_f64().unwrap_or(d);
        c.lr = f("lr", c.lr);
        c.beta1 = v["betas"][0].as_f64().unwrap_or(c.beta1);
        c.beta2 = v["betas"][1].as_f64().unwrap_or(c.beta2);
        c.eps = f("eps", c.eps);
        c.weight_decay = f("weight_decay", c.weight_decay);
        c.momentum = f("momentum", c.momentum);
        c.dampening = f("dampening", c.dampening);
        c.initial_lr = f("initial_lr", c.initial_lr);
        c.nesterov = v["nesterov"].as_bool().unwrap_or(c.nesterov);
        c.decouple_lr = v["decouple_lr"].as_bool().unwrap_or(c.decouple_lr);
        c.validate()?;
        out.push((g, c));
    }
    Ok(out)
}

/// Applies staged entries; on any failure puts every touched param (state and memory)
/// and group back as it was.
fn apply(
    opt: &mut Optimizer,
    staged: Vec<(usize, Vec<(String, Tensor)>)>,
    groups: Vec<(usize, crate::optim::OptimConfig)>,
) -> Result<()> {
    let before = staged
        .iter()
        .map(|(i, _)| Ok((*i, opt.snapshot(*i)?)))
        .collect::<Result<Vec<_>>>()?;
    let old_groups: Vec<_> = groups
        .iter()
        .map(|(g, _)| Ok((*g, opt.group_config(*g)?.clone())))
        .collect::<Result<_>>()?;
    let result = (|| {
        for (i, entries) in &staged {
            let (raw, states): (Vec<_>, Vec<_>) =
                entries.iter().cloned().partition(|(k, _)| k == RAW_PARAM);
            for (_, t) in raw {
                opt.write_param(*i, &t.data)?;
            }
            opt.set_states(*i, &states)?;
        }
        for (g, c) in &groups {
            opt.set_group_config(*g, c.clone())?;
        }
        Ok(())
    })();
    if result.is_err() {
        for (i, snap) in before {
            opt.restore(i, snap)?;
        }
        for (g, c) in old_groups {
            opt.restore_group_config(g, c);
        }
    }
    result
}
