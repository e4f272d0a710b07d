//! Lending a parameter's f32 state as live memory (`fo_optimizer_share_state`): what lets
//! fo.torch's `state_dict()` hand out its fp32 moments as torch hands out its own, by
//! reference, so a DCP save copies them once rather than after a decode into fresh
//! tensors. Only state stored as f32 on the host can be lent; everything else is read by
//! decoding (`io`). Why a lent buffer stays valid and live: `math::live`.
use super::io::moment_of;
use crate::error::{Error, Result};
use crate::optim::keys::split_state_name;
use crate::optim::math::live::Share;
use crate::optim::math::state::{Moment, ParamState};
use crate::optim::optimizer::Optimizer;

impl Optimizer {
    /// A hold on the live f32 storage of state `key` (`exp_avg`, `exp_avg_sq` or
    /// `momentum_buffer`) of host parameter `i`: the parameter's elements in order, which
    /// every later step, load and rollback writes in place while the state keeps its
    /// format (fp32). The memory stays valid while the hold lives, even after the state
    /// or the optimizer is gone (then it no longer follows the state).
    pub fn share_state(&self, i: usize, key: &str) -> Result<Share> {
        self.check_index(i)?;
        self.refuse_if_step_open("share_state")?;
        let p = self.entry(i);
        let fqn = p.fqn();
        if self.param_device(i).is_cuda() {
            return Err(Error::Unsupported(format!(
                "state {key} of parameter {fqn} lives on {}: only host state can be shared; \
                 read it with fo_optimizer_get_state",
                self.param_device(i)
            )));
        }
        let a = self.config(p.group()).algorithm;
        let (name, raw) = split_state_name(key);
        let st = p.state.as_ref().ok_or_else(|| {
            Error::NotFound(format!(
                "parameter {fqn} has no optimizer state yet (no step taken, nothing loaded)"
            ))
        })?;
        // Raw keys (`::quantized`, `::scales`) name parts of compressed state: never lent.
        let m = if raw.is_none() {
            moment_of(st, a, name)
        } else {
            None
        }
        .ok_or_else(|| {
            Error::NotFound(format!(
                "parameter {fqn} has no shareable state key {key:?} (its keys: {})",
                self.keys_of(i).join(", ")
            ))
        })?;
        match m {
            Moment::F32(b) => Ok(b.share()),
            _ => Err(Error::Unsupported(format!(
                "state {key} of parameter {fqn} is stored compressed ({}); only float32 \
                 state can be shared live: read it with fo_optimizer_get_state",
                self.config(p.group()).state_format.name()
            ))),
        }
    }

    /// Whether a hold from `share_state` on some state of parameter `i` is alive: an
    /// async save then copies that state at its call, since a borrower may write it at
    /// any time without fo knowing.
    pub(crate) fn lends_state(&self, i: usize) -> bool {
        let lent = |m: &Option<Moment>| matches!(m, Some(Moment::F32(b)) if b.is_shared());
        self.entry(i)
            .state
            .as_ref()
            .is_some_and(|s: &ParamState| lent(&s.m) || lent(&s.v))
    }
}
