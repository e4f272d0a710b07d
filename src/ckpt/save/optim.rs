//! Saving an `Optimizer`: which entries its local state packs to (compressed or portable),
//! where each one's data comes from, and the streaming save; `load/optim.rs` reads them back.
use std::borrow::Cow;
use std::collections::BTreeSet;
use std::path::Path;

use serde_json::Value;

use super::commit::{check_world_size, MAX_WORLD_SIZE};
use super::pack::{EntryMeta, Layout, PackOptions, Packed};
use super::writer::{finish, resolve_save_id, stage_rank_file};
use crate::ckpt::format::naming::{
    self, codes_key, num_groups, split_state_name, state_key, ERROR_BITS, EXP_AVG_SQ, MASTER, STEP,
};
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::optim::placement::staging::StagedParam;
use crate::optim::{Optimizer, StateFormat};
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

    /// Every entry taking options (pack, save, async and collective save) calls this
    /// first, so a Rust caller meets the same refusal the C ABI reports (`options.*`
    /// names: the fields of `fo_pack_options`).
    pub fn validate(&self) -> Result<()> {
        check_world_size(self.world_size).map_err(|_| {
            Error::invalid(
                "options.world_size",
                format!("{} is outside 1..={MAX_WORLD_SIZE}", self.world_size),
            )
        })?;
        if self.rank >= self.world_size {
            return Err(Error::invalid(
                "options.rank",
                format!("{} is outside a world of {}", self.rank, self.world_size),
            ));
        }
        Ok(())
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
pub(crate) fn packed_params(opt: &Optimizer) -> Vec<usize> {
    (0..opt.num_params())
        .filter(|&i| opt.param(i).numel() > 0)
        .collect()
}

pub(super) fn plan_entries(
    opt: &Optimizer,
    o: &SaveOptions,
) -> Result<(Vec<EntryMeta>, Vec<Source>)> {
    let (mut metas, mut srcs) = (Vec::new(), Vec::new());
    let mut push = |meta: EntryMeta, src| {
        metas.push(meta);
        srcs.push(src);
    };
    for i in packed_params(opt) {
        let (fqn, p, spec) = (opt.param_fqn(i), opt.param(i), opt.param_spec(i).cloned());
        let shape = p.shape().to_vec();
        let cfg = opt.param_config(i);
        // Most entries are one value per element of the param, sharded as it is.
        let elem = |key: String, dtype| EntryMeta {
            key,
            dtype,
            local_shape: shape.clone(),
            spec: spec.clone(),
            layout: Layout::Elementwise,
        };
        let st = |key: &str, dtype| Source::State {
            i,
            key: key.into(),
            dtype,
        };
        match o.params {
            Some(ParamsAs::Stored) => push(elem(fqn.into(), p.dtype()), Source::Param(i)),
            Some(ParamsAs::Master) => push(elem(fqn.into(), DType::F32), st(MASTER, DType::F32)),
            None => {}
        }
        let keys = opt.keys_of(i);
        let mut done = BTreeSet::new();
        for k in &keys {
            let (name, raw) = split_state_name(k);
            let full = |n: &str| state_key(fqn, n);
            let wide_v = name == EXP_AVG_SQ && cfg.state_format == StateFormat::Quant8Wide;
            match (name, raw) {
                (STEP, _) => push(
                    EntryMeta {
                        key: full(STEP),
                        dtype: DType::F32,
                        local_shape: vec![],
                        spec: None,
                        layout: Layout::Elementwise,
                    },
                    st(STEP, DType::F32),
                ),
                (ERROR_BITS, _) => {
                    let d = if cfg.master_weight_bits == 32 {
                        DType::I16
                    } else {
                        DType::I8
                    };
                    push(elem(full(name), d), st(name, d))
                }
                (_, Some(_)) if o.mode == Mode::Portable || wide_v => {
                    if done.insert(name) {
                        push(elem(full(name), DType::F32), st(name, DType::F32));
                    }
                }
                (_, Some(naming::CODES_PART)) => {
                    let d = if name == EXP_AVG_SQ {
                        DType::U8
                    } else {
                        DType::I8
                    };
                    push(elem(full(k), d), st(k, d))
                }
                (_, Some(_)) => push(
                    EntryMeta {
                        key: full(k),
                        dtype: DType::F16,
                        local_shape: vec![num_groups(p.numel())],
                        spec: None,
                        layout: Layout::GroupScales {
                            of: full(&codes_key(name)),
                        },
                    },
                    st(k, DType::F16),
                ),
                (_, None) => {
                    // param-dtype state stays in its dtype when compressed (exact), f32 when portable.
                    let d = if o.mode == Mode::Compressed
                        && cfg.state_format == StateFormat::ParamDtype
                    {
                        p.dtype()
                    } else {
                        DType::F32
                    };
                    push(elem(full(name), d), st(name, d))
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
    o.validate()?;
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
    o.validate()?;
    let (metas, srcs) = plan_entries(opt, o)?;
    let mut popts = pack_options(opt, o);
    popts.save_id = resolve_save_id(&o.save_id, o.world_size)?;
    let plan = super::pack::plan(&metas, &popts)?;
    let mut fetcher = Fetcher::new(opt, &srcs);
    let staged = stage_rank_file(dir, &plan, &popts, &mut |e| fetcher.get(e).map(Cow::Owned))?;
    finish(dir, staged)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::comm::Comm;
    use crate::error::Error;
    use crate::optim::{Algorithm, OptimConfig};

    fn refused(r: Result<impl std::fmt::Debug>, name: &str, reason: &str) {
        match r {
            Err(Error::InvalidArgument {
                name: n,
                reason: why,
            }) => {
                assert_eq!((n.as_str(), why.as_str()), (name, reason))
            }
            other => panic!("expected {name} refused, got {other:?}"),
        }
    }

    /// Every entry taking `SaveOptions` refuses a rank outside its world (and a world
    /// outside 1..=MAX_WORLD_SIZE) before touching the directory, as the C ABI does.
    #[test]
    fn every_save_entry_refuses_bad_rank_and_world_size() {
        let mut opt = Optimizer::new(OptimConfig::default_for(Algorithm::AdamW)).unwrap();
        let dir = std::env::temp_dir().join(format!("fo-save-opts-{}", std::process::id()));
        let rank = SaveOptions::new(2, 2, Mode::Compressed);
        let world = SaveOptions::new(0, 0, Mode::Portable);
        let too_big = SaveOptions::new(0, MAX_WORLD_SIZE + 1, Mode::Portable);
        let (r, w) = ("2 is outside a world of 2", "0 is outside 1..=1048576");
        refused(pack(&opt, &rank), "options.rank", r);
        refused(pack(&opt, &world), "options.world_size", w);
        refused(
            pack(&opt, &too_big),
            "options.world_size",
            "1048577 is outside 1..=1048576",
        );
        refused(save(&opt, &dir, &rank), "options.rank", r);
        refused(save(&opt, &dir, &world), "options.world_size", w);
        let a = crate::ckpt::save_async(&mut opt, &dir, &rank, None, 0).map(|_| ());
        refused(a, "options.rank", r);
        let comm = Comm::local_group(1).pop().unwrap();
        let bad = SaveOptions::new(1, 1, Mode::Compressed);
        refused(
            crate::ckpt::save_optimizer_comm(&opt, &dir, &bad, &comm),
            "options.rank",
            "1 is outside a world of 1",
        );
        assert!(!dir.exists(), "a refused save created {}", dir.display());
        assert!(SaveOptions::new(1, 2, Mode::Compressed).validate().is_ok());
    }
}
