//! The optimizer glue: pack an `Optimizer`'s local state (compressed or portable), save
//! it streaming, and load any checkpoint back into it, all-or-nothing.
use std::borrow::Cow;
use std::collections::BTreeSet;
use std::path::Path;

use serde_json::Value;

use super::naming::{
    self, codes_key, num_groups, part_key, scales_key, split_state_name, state_key, Part,
    ERROR_BITS, EXP_AVG_SQ, MASTER, STEP,
};
use super::pack::{EntryMeta, Layout, PackOptions, Packed};
use super::reader::Checkpoint;
use super::writer::{finish, resolve_save_id, stage_rank_file};
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::optim::staging::StagedParam;
use crate::optim::{Optimizer, StateFormat};
use crate::shard::ShardSpec;
use crate::tensor::Tensor;

/// What the state is saved as.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// FlashOptim's layout: int8/uint8 codes + fp16 scales, error bits (smallest).
    /// `quant8_wide` variance (4th-root codes) is saved dequantized, as f32.
    Compressed,
    /// Dequantized f32 `exp_avg` / `exp_avg_sq` / `momentum_buffer` (what torch loads).
    Portable,
}

/// Whether to save the parameters themselves, under their plain FQN.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ParamsAs {
    /// As stored (e.g. bf16).
    Stored,
    /// f32 masters reconstructed from the param and its error bits.
    Master,
}

#[derive(Debug, Clone)]
pub struct SaveOptions {
    pub rank: usize,
    pub world_size: usize,
    pub mode: Mode,
    pub params: Option<ParamsAs>,
    pub write_unsharded: Option<bool>,
    pub save_id: String,
}

impl SaveOptions {
    pub fn new(rank: usize, world_size: usize, mode: Mode) -> SaveOptions {
        SaveOptions {
            rank,
            world_size,
            mode,
            params: None,
            write_unsharded: None,
            save_id: String::new(),
        }
    }
}

/// Where an entry's data comes from.
pub(super) enum Source {
    State { i: usize, key: String, dtype: DType },
    Param(usize),
}

/// Indices of the params to pack: those with elements. (A memory region cannot be
/// registered twice: the optimizer refuses overlapping params, so no state is doubled;
/// `pack::plan` also packs a repeated key once.)
fn packed_params(opt: &Optimizer) -> Vec<usize> {
    (0..opt.num_params())
        .filter(|&i| opt.param(i).numel() > 0)
        .collect()
}

pub(super) fn plan_entries(
    opt: &Optimizer,
    o: &SaveOptions,
) -> Result<(Vec<EntryMeta>, Vec<Source>)> {
    let (mut metas, mut srcs) = (Vec::new(), Vec::new());
    let mut push = |key: String, dtype, shape: Vec<usize>, spec: Option<ShardSpec>, layout, src| {
        metas.push(EntryMeta {
            key,
            dtype,
            local_shape: shape,
            spec,
            layout,
        });
        srcs.push(src);
    };
    for i in packed_params(opt) {
        let (fqn, p, spec) = (opt.param_fqn(i), opt.param(i), opt.param_spec(i).cloned());
        let shape = p.shape().to_vec();
        let cfg = opt.group_config(opt.param_group(i));
        match o.params {
            Some(ParamsAs::Stored) => push(
                fqn.into(),
                p.dtype(),
                shape.clone(),
                spec.clone(),
                Layout::Elementwise,
                Source::Param(i),
            ),
            Some(ParamsAs::Master) => {
                let src = Source::State {
                    i,
                    key: MASTER.into(),
                    dtype: DType::F32,
                };
                push(
                    fqn.into(),
                    DType::F32,
                    shape.clone(),
                    spec.clone(),
                    Layout::Elementwise,
                    src,
                )
            }
            None => {}
        }
        let keys = opt.state_keys(i);
        let mut done = BTreeSet::new();
        for k in &keys {
            let (name, raw) = split_state_name(k);
            let full = |n: &str| state_key(fqn, n);
            let st = |key: &str, dtype| Source::State {
                i,
                key: key.into(),
                dtype,
            };
            let wide_v = name == EXP_AVG_SQ && cfg.state_format == StateFormat::Quant8Wide;
            match (name, raw) {
                (STEP, _) => push(
                    full(STEP),
                    DType::F32,
                    vec![],
                    None,
                    Layout::Elementwise,
                    st(STEP, DType::F32),
                ),
                (ERROR_BITS, _) => {
                    let d = if cfg.master_weight_bits == 32 {
                        DType::I16
                    } else {
                        DType::I8
                    };
                    push(
                        full(name),
                        d,
                        shape.clone(),
                        spec.clone(),
                        Layout::Elementwise,
                        st(name, d),
                    )
                }
                (_, Some(_)) if o.mode == Mode::Portable || wide_v => {
                    if done.insert(name) {
                        push(
                            full(name),
                            DType::F32,
                            shape.clone(),
                            spec.clone(),
                            Layout::Elementwise,
                            st(name, DType::F32),
                        );
                    }
                }
                (_, Some(naming::CODES_PART)) => {
                    let d = if name == EXP_AVG_SQ {
                        DType::U8
                    } else {
                        DType::I8
                    };
                    push(
                        full(k),
                        d,
                        shape.clone(),
                        spec.clone(),
                        Layout::Elementwise,
                        st(k, d),
                    )
                }
                (_, Some(_)) => {
                    let g = num_groups(p.numel());
                    let of = full(&codes_key(name));
                    push(
                        full(k),
                        DType::F16,
                        vec![g],
                        None,
                        Layout::GroupScales { of },
                        st(k, DType::F16),
                    )
                }
                (_, None) => {
                    // param-dtype state stays in its dtype when compressed (exact), f32 when portable.
                    let d = if o.mode == Mode::Compressed
                        && cfg.state_format == StateFormat::ParamDtype
                    {
                        p.dtype()
                    } else {
                        DType::F32
                    };
                    push(
                        full(name),
                        d,
                        shape.clone(),
                        spec.clone(),
                        Layout::Elementwise,
                        st(name, d),
                    )
                }
            }
        }
    }
    Ok((metas, srcs))
}

pub(super) fn pack_options(opt: &Optimizer, o: &SaveOptions) -> PackOptions {
    PackOptions {
        rank: o.rank,
        world_size: o.world_size,
        write_unsharded: o.write_unsharded,
        mode: if o.mode == Mode::Compressed {
            "compressed"
        } else {
            "portable"
        }
        .into(),
        param_groups: opt.param_groups_json(),
        extra: Value::Null,
        save_id: o.save_id.clone(),
        keep_empty_keys: false,
    }
}

/// Reads planned entries, staging each parameter once for a run of its entries: a
/// device parameter's state is read back once for all its keys, not once per key (peak
/// extra memory: one parameter's state and the entry being written).
pub(super) struct Fetcher<'a> {
    opt: &'a Optimizer,
    srcs: &'a [Source],
    cur: Option<StagedParam<'a>>,
}

impl<'a> Fetcher<'a> {
    pub(super) fn new(opt: &'a Optimizer, srcs: &'a [Source]) -> Fetcher<'a> {
        Fetcher {
            opt,
            srcs,
            cur: None,
        }
    }

    /// Entry `e`'s tensor.
    pub(super) fn get(&mut self, e: usize) -> Result<Tensor> {
        let s = &self.srcs[e];
        let i = match s {
            Source::State { i, .. } | Source::Param(i) => *i,
        };
        let sp = match &mut self.cur {
            Some(sp) if sp.i == i => sp,
            cur => cur.insert(self.opt.stage(i)?),
        };
        match s {
            Source::State { key, dtype, .. } => self.opt.get_state_as_staged(sp, key, *dtype),
            Source::Param(_) => match sp.param.take() {
                Some(t) => Ok(t),
                None => self.opt.param_tensor(i),
            },
        }
    }
}

/// The optimizer's local state as named chunks, data included (`fo_state_pack`).
pub fn pack(opt: &Optimizer, o: &SaveOptions) -> Result<Packed> {
    let (metas, srcs) = plan_entries(opt, o)?;
    let mut fetcher = Fetcher::new(opt, &srcs);
    let entries = metas
        .into_iter()
        .enumerate()
        .map(|(e, meta)| {
            Ok(super::pack::StateEntry {
                meta,
                tensor: fetcher.get(e)?,
            })
        })
        .collect::<Result<Vec<_>>>()?;
    Packed::new(entries, pack_options(opt, o))
}

/// Saves this rank's state into `dir`, one entry at a time (peak extra memory: the
/// largest entry).
pub fn save(opt: &Optimizer, dir: &Path, o: &SaveOptions) -> Result<()> {
    let (metas, srcs) = plan_entries(opt, o)?;
    let mut popts = pack_options(opt, o);
    popts.save_id = resolve_save_id(&o.save_id, o.world_size)?;
    let plan = super::pack::plan(&metas, &popts)?;
    let mut fetcher = Fetcher::new(opt, &srcs);
    let staged = stage_rank_file(dir, &plan, &popts, &mut |e| fetcher.get(e).map(Cow::Owned))?;
    finish(dir, staged)
}

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
        let cfg = opt.group_config(opt.param_group(i)).clone();
        let prefix = state_key(&fqn, "");
        let saved: BTreeSet<String> = ck
            .keys
            .keys()
            .filter_map(|k| k.strip_prefix(&prefix))
            .map(|n| base(n).to_string())
            .collect();
        let expected: BTreeSet<String> = opt
            .state_keys(i)
            .iter()
            .map(|k| base(k).to_string())
            .collect();
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
        let mut c = opt.group_config(g).clone();
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
        .map(|(g, _)| (*g, opt.group_config(*g).clone()))
        .collect();
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
            opt.groups[g] = c;
        }
    }
    result
}
