//! Hyper-parameters of one param group, with FlashOptim 0.1.4's defaults and checks.
use crate::error::{Error, Result};

crate::codes::code_table! {
    /// The update rule. Codes are the C ABI's `fo_optim_config.algorithm`; the names are
    /// what checkpoints record (`"AdamW"`).
    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    pub enum Algorithm {
        noun = "algorithm", c_prefix = "FO_ALGORITHM_", c_type = i32,
        c_doc = "`fo_optim_config.algorithm`: ";
        /// Adam with decoupled weight decay (`p *= 1 - lr·wd`).
        AdamW = 0, "AdamW", "Adam with decoupled weight decay.";
        /// Adam with L2 weight decay added to the gradient (torch `Adam(weight_decay=)`).
        Adam = 1, "Adam", "Adam with L2 weight decay (torch `Adam(weight_decay=)`).";
        /// SGD with momentum, dampening, Nesterov; L2 (coupled) weight decay.
        Sgd = 2, "SGD", "SGD with momentum, dampening, Nesterov; L2 weight decay.";
        /// SGD with decoupled weight decay (`p *= 1 - lr·wd` before the update).
        SgdW = 3, "SGDW", "SGD with decoupled weight decay.";
        /// Lion (sign of interpolated momentum), decoupled weight decay.
        Lion = 4, "Lion", "Lion, decoupled weight decay.";
    }
}

impl Algorithm {
    pub fn is_adam(self) -> bool {
        matches!(self, Algorithm::AdamW | Algorithm::Adam)
    }
    pub fn is_sgd(self) -> bool {
        matches!(self, Algorithm::Sgd | Algorithm::SgdW)
    }
    /// Weight decay multiplies the parameter (instead of adding to the gradient).
    pub fn decoupled_decay(self) -> bool {
        matches!(self, Algorithm::AdamW | Algorithm::SgdW | Algorithm::Lion)
    }
}

crate::codes::code_table! {
    /// How optimizer state is stored. Codes are `fo_optim_config.state_format`.
    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    pub enum StateFormat {
        noun = "state format", c_prefix = "FO_STATE_FORMAT_", c_type = i32,
        c_doc = "`fo_optim_config.state_format`: ";
        /// f32 state; arithmetic reproduces torch.optim's single-tensor CPU implementation.
        Fp32 = 0, "fp32", "f32 state, torch.optim's arithmetic.";
        /// State in the parameter's dtype (bf16 for bf16 params), FlashOptim `quantize=False`.
        ParamDtype = 1, "param_dtype", "state in the parameter's dtype.";
        /// FlashOptim's 8-bit grouped state (int8 softsign momentum, uint8 sqrt variance,
        /// fp16 scale per 32 elements). Bit-exact with FlashOptim 0.1.4.
        Quant8 = 2, "quant8", "FlashOptim 0.1.4's 8-bit grouped state, bit-exact.";
        /// fo's opt-in variant of `Quant8`, same bytes per parameter: the variance is stored
        /// by its fourth root (`v^(1/4)`, uint8, fp16 scale per 32), so a group spans 65025:1
        /// in `sqrt(v)` instead of 255:1, and an element whose variance code is 0 while its
        /// momentum is not is stepped as if `v^(1/4)` were half the smallest non-zero level
        /// (the largest value the code 0 can stand for), never by `m/eps`. This keeps
        /// FlashOptim's divergence on tiny-variance elements away (oracle case
        /// `flash_adamw_mw24_wide_grads`: worst cosine 0.99999, nmse 2.5e-5 against torch's
        /// fp32 run, where `Quant8` reaches nmse 9.5e8). Momentum is FlashOptim's int8 format.
        /// The arithmetic is FlashOptim's, as for `Quant8`.
        Quant8Wide = 3, "quant8_wide", "fo's 8-bit variant (variance by its fourth root).";
    }
}

impl StateFormat {
    pub fn is_quantized(self) -> bool {
        matches!(self, StateFormat::Quant8 | StateFormat::Quant8Wide)
    }
}

crate::codes::code_table! {
    /// How the compressed formats' arithmetic is carried out. Codes are
    /// `fo_optim_config.arithmetic`. Groups with fp32 state (torch's arithmetic, already at
    /// memory speed) step the same way under either.
    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    pub enum Arithmetic {
        noun = "arithmetic", c_prefix = "FO_ARITHMETIC_", c_type = i32,
        c_doc = "`fo_optim_config.arithmetic`: ";
        /// FlashOptim 0.1.4's operations in its order, each correctly rounded: bit-exact with
        /// its kernels (the testing contract; the default).
        Exact = 0, "exact", "FlashOptim's operations, bit-exact (the default).";
        /// Reformulated for speed (reciprocal multiplies, fused multiply-adds, table-free
        /// decode, one square root per element): within the bound `fast::ULP_BOUND` of
        /// `Exact` per step, the same bits on every instruction set.
        Fast = 1, "fast", "reformulated for speed, within a stated bound of exact.";
    }
}

impl Arithmetic {
    pub fn from_name(s: &str) -> Result<Arithmetic> {
        Arithmetic::by_name(s).ok_or_else(|| {
            let valid = Arithmetic::C_CODES.names();
            Error::invalid(
                "arithmetic",
                format!("unknown arithmetic {s:?} (valid: {valid})"),
            )
        })
    }
}

/// One param group's hyper-parameters. Doubles, as the host frameworks hold them.
#[derive(Debug, Clone, PartialEq)]
pub struct OptimConfig {
    pub algorithm: Algorithm,
    pub lr: f64,
    pub beta1: f64,
    pub beta2: f64,
    pub eps: f64,
    pub weight_decay: f64,
    pub momentum: f64,
    pub dampening: f64,
    pub nesterov: bool,
    /// Decay by `wd·lr/initial_lr` instead of `wd·lr` (decoupled-decay algorithms only).
    pub decouple_lr: bool,
    pub initial_lr: f64,
    pub state_format: StateFormat,
    /// 0 (none), 24 (int8 error bits) or 32 (int16) for bf16/f16 params.
    pub master_weight_bits: u32,
    pub check_numerics: bool,
    /// Exact (FlashOptim's bits) or fast arithmetic for the compressed formats.
    pub arithmetic: Arithmetic,
}

impl OptimConfig {
    /// FlashOptim 0.1.4's defaults for `a`: quant8 state, 24-bit master weights,
    /// AdamW lr 1e-3 betas (0.9, 0.999) eps 1e-8 wd 1e-2; Adam the same with wd 0;
    /// SGD/SGDW lr 1e-3, no momentum; Lion lr 1e-3 betas (0.9, 0.99) wd 0.
    pub fn default_for(a: Algorithm) -> OptimConfig {
        let (beta1, beta2, weight_decay) = match a {
            Algorithm::AdamW => (0.9, 0.999, 1e-2),
            Algorithm::Adam => (0.9, 0.999, 0.0),
            Algorithm::Lion => (0.9, 0.99, 0.0),
            Algorithm::Sgd | Algorithm::SgdW => (0.0, 0.0, 0.0),
        };
        OptimConfig {
            algorithm: a,
            lr: 1e-3,
            beta1,
            beta2,
            eps: if a.is_adam() { 1e-8 } else { 0.0 },
            weight_decay,
            momentum: 0.0,
            dampening: 0.0,
            nesterov: false,
            decouple_lr: false,
            initial_lr: 1e-3,
            state_format: StateFormat::Quant8,
            master_weight_bits: 24,
            check_numerics: false,
            arithmetic: Arithmetic::Exact,
        }
    }

    /// torch's own range checks (`torch.optim.AdamW`/`Adam`/`SGD`, lion-pytorch), plus
    /// finiteness, with the offending field named: lr, eps, weight_decay, momentum >= 0;
    /// betas in [0, 1) (beta = 1 makes Adam's bias correction divide by zero and every
    /// parameter NaN at the first step); Nesterov needs momentum > 0 and dampening 0.
    pub fn validate(&self) -> Result<()> {
        let finite = |name: &str, v: f64| {
            if v.is_finite() {
                Ok(())
            } else {
                Err(Error::invalid(name, format!("must be finite, got {v}")))
            }
        };
        for (n, v) in [
            ("lr", self.lr),
            ("beta1", self.beta1),
            ("beta2", self.beta2),
            ("eps", self.eps),
            ("weight_decay", self.weight_decay),
            ("momentum", self.momentum),
            ("dampening", self.dampening),
            ("initial_lr", self.initial_lr),
        ] {
            finite(n, v)?;
        }
        if self.lr < 0.0 {
            return Err(Error::invalid(
                "lr",
                format!("invalid learning rate {} (must be >= 0)", self.lr),
            ));
        }
        if self.algorithm.is_adam() || self.algorithm == Algorithm::Lion {
            for (n, b) in [("beta1", self.beta1), ("beta2", self.beta2)] {
                if !(0.0..1.0).contains(&b) {
                    return Err(Error::invalid(
                        n,
                        format!("invalid beta {b} (must be in [0, 1))"),
                    ));
                }
            }
        }
        if self.eps < 0.0 {
            return Err(Error::invalid(
                "eps",
                format!("invalid epsilon {} (must be >= 0)", self.eps),
            ));
        }
        if self.weight_decay < 0.0 {
            return Err(Error::invalid(
                "weight_decay",
                format!("invalid weight_decay {} (must be >= 0)", self.weight_decay),
            ));
        }
        if self.algorithm.is_sgd() {
            if self.momentum < 0.0 {
                return Err(Error::invalid(
                    "momentum",
                    format!("invalid momentum {} (must be >= 0)", self.momentum),
                ));
            }
            if !(0.0..=1.0).contains(&self.dampening) {
                return Err(Error::invalid(
                    "dampening",
                    format!("invalid dampening {} (must be in [0, 1])", self.dampening),
                ));
            }
            if self.nesterov && (self.momentum <= 0.0 || self.dampening != 0.0) {
                return Err(Error::invalid(
                    "nesterov",
                    "Nesterov momentum requires a momentum and zero dampening",
                ));
            }
        } else if self.nesterov {
            return Err(Error::invalid(
                "nesterov",
                format!(
                    "only SGD and SGDW take nesterov, not {}",
                    self.algorithm.name()
                ),
            ));
        }
        if self.decouple_lr {
            if !self.algorithm.decoupled_decay() {
                return Err(Error::invalid(
                    "decouple_lr",
                    format!(
                        "{} adds weight decay to the gradient; decouple_lr needs AdamW, SGDW or Lion",
                        self.algorithm.name()
                    ),
                ));
            }
            if self.initial_lr <= 0.0 {
                return Err(Error::invalid(
                    "initial_lr",
                    format!("must be > 0 with decouple_lr, got {}", self.initial_lr),
                ));
            }
        }
        if ![0, 24, 32].contains(&self.master_weight_bits) {
            return Err(Error::invalid(
                "master_weight_bits",
                format!("{} is not one of 0, 24, 32", self.master_weight_bits),
            ));
        }
        Ok(())
    }

    /// The decoupled decay amount `wd·lr` (or `wd·(lr/initial_lr)` with `decouple_lr`), in
    /// double as FlashOptim's host code computes it.
    pub fn decay_amount(&self) -> f64 {
        if self.decouple_lr {
            self.weight_decay * (self.lr / self.initial_lr)
        } else {
            self.weight_decay * self.lr
        }
    }

    /// Whether this group keeps a momentum-like state (`exp_avg` / `momentum_buffer`).
    pub fn has_momentum_state(&self) -> bool {
        !self.algorithm.is_sgd() || self.momentum != 0.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_validate_and_bad_values_name_the_field() {
        for a in Algorithm::ALL {
            OptimConfig::default_for(a).validate().unwrap();
            assert_eq!(Algorithm::from_code(a.code(), "algorithm").unwrap(), a);
        }
        let mut c = OptimConfig::default_for(Algorithm::AdamW);
        c.beta2 = 1.5;
        assert!(c.validate().unwrap_err().to_string().contains("beta2"));
        let mut c = OptimConfig::default_for(Algorithm::Sgd);
        c.nesterov = true;
        assert!(c
            .validate()
            .unwrap_err()
            .to_string()
            .contains("Nesterov momentum requires"));
        let mut c = OptimConfig::default_for(Algorithm::AdamW);
        c.lr = -1.0;
        assert!(c.validate().unwrap_err().to_string().contains("lr"));
        c.lr = 1e-3;
        c.master_weight_bits = 16;
        assert!(c
            .validate()
            .unwrap_err()
            .to_string()
            .contains("master_weight_bits"));
        assert!(Arithmetic::from_code(2, "arithmetic")
            .unwrap_err()
            .to_string()
            .contains("valid: 0 = exact, 1 = fast"));
        assert_eq!(Arithmetic::from_name("fast").unwrap(), Arithmetic::Fast);
        assert!(Arithmetic::from_name("quick")
            .unwrap_err()
            .to_string()
            .contains("arithmetic"));
        for a in [Algorithm::AdamW, Algorithm::Adam, Algorithm::Lion] {
            for (field, v) in [("beta1", 1.0), ("beta2", 1.0), ("beta1", -0.1)] {
                let mut c = OptimConfig::default_for(a);
                *if field == "beta1" {
                    &mut c.beta1
                } else {
                    &mut c.beta2
                } = v;
                let e = c.validate().unwrap_err().to_string();
                assert!(e.contains(field) && e.contains("[0, 1)"), "{a:?}: {e}");
            }
        }
        let mut c = OptimConfig::default_for(Algorithm::AdamW);
        c.eps = -1e-8;
        assert!(c.validate().unwrap_err().to_string().contains("eps"));
        c.eps = f64::NAN;
        assert!(c.validate().unwrap_err().to_string().contains("finite"));
        let mut c = OptimConfig::default_for(Algorithm::Sgd);
        c.momentum = 0.9;
        c.dampening = 0.1;
        c.nesterov = true;
        assert!(c.validate().unwrap_err().to_string().contains("Nesterov"));
        c.dampening = 0.0;
        c.validate().unwrap();
        c.momentum = -0.9;
        assert!(c.validate().unwrap_err().to_string().contains("momentum"));
        let mut c = OptimConfig::default_for(Algorithm::Adam);
        c.decouple_lr = true;
        assert!(c
            .validate()
            .unwrap_err()
            .to_string()
            .contains("decouple_lr"));
    }
}
