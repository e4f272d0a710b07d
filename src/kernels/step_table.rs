//! The tensor table of one multi-tensor launch: Rust mirrors of the kernel's
//! `fo_step_tensor` and `fo_rule` (gpu/fo_step.cuh, gpu/fo_rules.cuh), and the
//! function that fills a param group's table from fo's own types. Not feature-gated: the
//! layout and every field are tested on the host, so the launcher (which cannot run in
//! CI) only uploads bytes whose meaning is already pinned.
//!
//! The layout is pinned twice with the same numbers: `table_layout_matches_the_kernel`
//! here and `table_layout()` in cpp_tests/test_gpu_kernels_host.cpp (static_assert on the
//! C++ struct the kernel reads). Pointers are `u64` on this side: a `CUdeviceptr` on the
//! GPU, a host address in tests; both are 8 bytes, as `void*` is on the 64-bit hosts fo
//! supports.
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::optim::math::config::{OptimConfig, StateFormat};
use crate::optim::math::quant8::GROUP;
use crate::optim::math::rule::fast::FastRule;
use crate::optim::math::rule::lion::Lion;
use crate::optim::math::rule::sgd::Sgd;
use crate::optim::math::rule::{Betas, Rule};
use crate::optim::math::state::{ErrorBits, F32Buf, Moment, ParamState, Root};

/// `fo_rule_kind` of fo_rules.cuh.
pub const RULE_TORCH_ADAM: i32 = 0;
pub const RULE_FLASH_ADAM: i32 = 1;
pub const RULE_TORCH_SGD: i32 = 2;
pub const RULE_FLASH_SGD: i32 = 3;
pub const RULE_TORCH_LION: i32 = 4;
pub const RULE_FLASH_LION: i32 = 5;
/// The fast arithmetic (`Rule::Fast`): Adam's own kind, SGD and Lion with torch's
/// operations; all three code their compressed states as fo_fast.cuh does.
pub const RULE_FAST_ADAM: i32 = 6;
pub const RULE_FAST_SGD: i32 = 7;
pub const RULE_FAST_LION: i32 = 8;

/// `fo_rule`: one tensor's scalars for one step. Unused fields are 0 (as `make_rule` in
/// the C++ test leaves them), so two tables built from the same rule are byte-equal.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct FoRule {
    pub kind: i32,
    pub has_l2: i32,
    pub has_momentum: i32,
    pub nesterov: i32,
    pub l2: f32,
    pub decay: f32,
    pub b1: f32,
    pub w1: f32,
    pub b2: f32,
    pub w2: f32,
    pub bc1: f32,
    pub bc2: f32,
    pub bc2_sqrt: f32,
    pub eps: f32,
    pub lr: f32,
    pub momentum: f32,
    pub wdamp: f32,
}

/// `fo_moment_kind` of fo_step.cuh: how a moment is stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(i32)]
pub enum MomentKind {
    None = 0,
    F32 = 1,
    F16 = 2,
    BF16 = 3,
    Q8Signed = 4,
    Q8Sqrt = 5,
    Q8Fourth = 6,
}

impl MomentKind {
    pub fn of(m: &Moment) -> MomentKind {
        use crate::optim::math::master_split::Half;
        match m {
            Moment::F32(_) => MomentKind::F32,
            Moment::Half(Half::F16, _) => MomentKind::F16,
            Moment::Half(Half::BF16, _) => MomentKind::BF16,
            Moment::Signed { .. } => MomentKind::Q8Signed,
            Moment::Unsigned {
                root: Root::Sqrt, ..
            } => MomentKind::Q8Sqrt,
            Moment::Unsigned {
                root: Root::Fourth, ..
            } => MomentKind::Q8Fourth,
        }
    }
}

/// How a parameter's state is stored, from its group's config and its dtype, laid out as
/// `Optimizer::new_state` lays out host state (so the device mirrors the same bytes).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StateLayout {
    pub m: MomentKind,
    pub v: MomentKind,
    /// 0, 8 (int8 error bits) or 16 (int16).
    pub error_bits_width: i32,
}

impl StateLayout {
    pub fn of(cfg: &OptimConfig, param_dtype: DType) -> StateLayout {
        let plain = match (cfg.state_format, param_dtype) {
            (StateFormat::ParamDtype, DType::F16) => MomentKind::F16,
            (StateFormat::ParamDtype, DType::BF16) => MomentKind::BF16,
            _ => MomentKind::F32,
        };
        let m = match (cfg.has_momentum_state(), cfg.state_format.is_quantized()) {
            (false, _) => MomentKind::None,
            (true, true) => MomentKind::Q8Signed,
            (true, false) => plain,
        };
        let v = match (cfg.algorithm.is_adam(), cfg.state_format) {
            (false, _) => MomentKind::None,
            (true, StateFormat::Quant8) => MomentKind::Q8Sqrt,
            (true, StateFormat::Quant8Wide) => MomentKind::Q8Fourth,
            (true, _) => plain,
        };
        let half = matches!(param_dtype, DType::F16 | DType::BF16);
        let error_bits_width = match cfg.master_weight_bits {
            24 if half => 8,
            32 if half => 16,
            _ => 0,
        };
        StateLayout {
            m,
            v,
            error_bits_width,
        }
    }

    /// Zeroed host state of `n` elements in this layout: `Optimizer::new_state` builds
    /// host state here, so host and device state follow one decision.
    pub fn zeroed(&self, n: usize) -> ParamState {
        use crate::optim::math::master_split::Half;
        let moment = |kind: MomentKind| match kind {
            MomentKind::None => None,
            MomentKind::F32 => Some(Moment::F32(F32Buf::zeros(n))),
            MomentKind::F16 => Some(Moment::Half(Half::F16, vec![0; n])),
            MomentKind::BF16 => Some(Moment::Half(Half::BF16, vec![0; n])),
            MomentKind::Q8Signed => Some(Moment::zeros_signed(n)),
            MomentKind::Q8Sqrt => Some(Moment::zeros_unsigned(n, Root::Sqrt)),
            MomentKind::Q8Fourth => Some(Moment::zeros_unsigned(n, Root::Fourth)),
        };
        ParamState {
            step: 0,
            m: moment(self.m),
            v: moment(self.v),
            error_bits: match self.error_bits_width {
                8 => Some(ErrorBits::I8(vec![0; n])),
                16 => Some(ErrorBits::I16(vec![0; n])),
                _ => None,
            },
            m_valid: false,
        }
    }

    /// Bytes of a moment's codes or values and of its fp16 scales, for `n` elements.
    pub fn moment_bytes(kind: MomentKind, n: usize) -> (usize, usize) {
        let scales = 2 * n.div_ceil(GROUP);
        match kind {
            MomentKind::None => (0, 0),
            MomentKind::F32 => (4 * n, 0),
            MomentKind::F16 | MomentKind::BF16 => (2 * n, 0),
            MomentKind::Q8Signed | MomentKind::Q8Sqrt | MomentKind::Q8Fourth => (n, scales),
        }
    }

    /// Bytes of the state of `n` elements (as `ParamState::nbytes` counts them).
    pub fn nbytes(&self, n: usize) -> usize {
        let (m, ms) = Self::moment_bytes(self.m, n);
        let (v, vs) = Self::moment_bytes(self.v, n);
        m + ms + v + vs + n * self.error_bits_width as usize / 8
    }
}

/// `fo_step_tensor`: one tensor of a launch.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct FoStepTensor {
    pub param: u64,
    pub grad: u64,
    pub error_bits: u64,
    pub m: u64,
    pub m_scales: u64,
    pub v: u64,
    pub v_scales: u64,
    pub numel: u64,
    pub group_begin: u64,
    pub param_dtype: i32,
    pub grad_dtype: i32,
    pub error_bits_width: i32,
    pub m_kind: i32,
    pub v_kind: i32,
    /// The C struct's tail padding (to its 8-byte alignment), spelled out so the table's
    /// bytes are all initialized when they are copied to the device (and compare equal
    /// from step to step, so an unchanged table is not uploaded again).
    pub _pad: i32,
}

impl FoRule {
    /// The kernel's scalars for `rule` (every rule has a GPU kernel giving the host's bits).
    pub fn new(rule: &Rule) -> Result<FoRule> {
        let l2 = |l2: Option<f32>| (l2.is_some() as i32, l2.unwrap_or(0.0));
        fn sgd<O>(kind: i32, c: &Sgd<O>) -> FoRule {
            FoRule {
                kind,
                has_l2: c.l2.is_some() as i32,
                l2: c.l2.unwrap_or(0.0),
                has_momentum: c.momentum.is_some() as i32,
                momentum: c.momentum.unwrap_or(0.0),
                nesterov: c.nesterov as i32,
                decay: c.decay,
                wdamp: c.wdamp,
                lr: c.lr,
                ..FoRule::default()
            }
        }
        fn lion<O>(kind: i32, c: &Lion<O>) -> FoRule {
            FoRule {
                kind,
                decay: c.decay,
                b1: c.betas.b1,
                w1: c.betas.w1,
                b2: c.betas.b2,
                w2: c.betas.w2,
                lr: c.lr,
                ..FoRule::default()
            }
        }
        // FlashOptim's and the fast arithmetic's Adam: the fields they share.
        let adam = |kind, l2: Option<f32>, decay, b: Betas, eps, lr| FoRule {
            kind,
            has_l2: l2.is_some() as i32,
            l2: l2.unwrap_or(0.0),
            decay,
            b1: b.b1,
            w1: b.w1,
            b2: b.b2,
            w2: b.w2,
            eps,
            lr,
            ..FoRule::default()
        };
        let r = match rule {
            Rule::TorchAdam(u) => FoRule {
                kind: RULE_TORCH_ADAM,
                has_l2: l2(u.l2).0,
                l2: l2(u.l2).1,
                decay: u.decay,
                w1: u.betas.w1,
                b2: u.betas.b2,
                w2: u.betas.w2,
                bc2_sqrt: u.bc2_sqrt,
                eps: u.eps,
                lr: u.neg_step,
                ..FoRule::default()
            },
            Rule::FlashAdam(u) => FoRule {
                bc1: u.bc1,
                bc2: u.bc2,
                ..adam(RULE_FLASH_ADAM, u.l2, u.decay, u.betas, u.eps, u.lr)
            },
            Rule::TorchSgd(u) => sgd(RULE_TORCH_SGD, u),
            Rule::FlashSgd(u) => sgd(RULE_FLASH_SGD, u),
            Rule::TorchLion(u) => lion(RULE_TORCH_LION, u),
            Rule::FlashLion(u) => lion(RULE_FLASH_LION, u),
            // Fast Adam's `v_root` is the kernel's too: it holds the root exactly where
            // the row's variance is quantized, as `FastRule::new` decides from the format.
            Rule::Fast(FastRule::Adam(u)) => FoRule {
                bc2_sqrt: u.inv_sqrt_bc2,
                ..adam(RULE_FAST_ADAM, u.l2, u.decay, u.betas, u.eps, u.step)
            },
            Rule::Fast(FastRule::Sgd(u)) => sgd(RULE_FAST_SGD, u),
            Rule::Fast(FastRule::Lion(u)) => lion(RULE_FAST_LION, u),
        };
        Ok(r)
    }
}

/// Where one moment's buffers are (device addresses on the GPU).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MomentPtrs {
    pub kind: MomentKind,
    pub data: u64,
    /// The fp16 scales of the quantized kinds, else 0.
    pub scales: u64,
}

/// Where one parameter's state buffers are: what the table needs of a `ParamState`,
/// wherever its bytes live.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StatePtrs {
    pub m: Option<MomentPtrs>,
    pub v: Option<MomentPtrs>,
    /// int8 (width 8) or int16 (width 16) error bits, or (0, 0).
    pub error_bits: u64,
    pub error_bits_width: i32,
}

fn moment_ptrs(m: &mut Moment) -> MomentPtrs {
    let kind = MomentKind::of(m);
    let (data, scales) = match m {
        Moment::F32(v) => (v.as_mut_ptr() as u64, 0),
        Moment::Half(_, v) => (v.as_mut_ptr() as u64, 0),
        Moment::Signed { codes, scales } => (codes.as_mut_ptr() as u64, scales.as_mut_ptr() as u64),
        Moment::Unsigned { codes, scales, .. } => {
            (codes.as_mut_ptr() as u64, scales.as_mut_ptr() as u64)
        }
    };
    MomentPtrs { kind, data, scales }
}

impl StatePtrs {
    /// The addresses of a state held in host memory (the host build of the kernel reads
    /// these; the GPU launcher mirrors the same buffers on the device).
    pub fn of_host(st: &mut ParamState) -> StatePtrs {
        let (error_bits, error_bits_width) = match st.error_bits.as_mut() {
            None => (0, 0),
            Some(ErrorBits::I8(e)) => (e.as_mut_ptr() as u64, 8),
            Some(ErrorBits::I16(e)) => (e.as_mut_ptr() as u64, 16),
        };
        StatePtrs {
            m: st.m.as_mut().map(moment_ptrs),
            v: st.v.as_mut().map(moment_ptrs),
            error_bits,
            error_bits_width,
        }
    }
}

/// One tensor to step: its buffers, dtypes, rule and SGD's `first` flag.
#[derive(Debug, Clone, Copy)]
pub struct TableEntry {
    pub param: u64,
    pub param_dtype: DType,
    pub grad: u64,
    pub grad_dtype: DType,
    pub numel: usize,
    pub state: StatePtrs,
    pub rule: Rule,
    /// The momentum buffer is created by this step (SGD copies the gradient).
    pub first: bool,
}

/// One kernel launch over `count` rows of a table from row `row`: the rows whose tensors
/// step with the same rule scalars and SGD `first` flag (usually all of a param group's;
/// more launches only where parameters' step counts differ). The rule goes by value with
/// the launch, so the rows hold nothing that changes from step to step.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct StepLaunch {
    pub row: usize,
    pub count: usize,
    /// The 32-element groups of these rows (one thread per group).
    pub total_groups: u64,
    pub rule: FoRule,
    pub first: bool,
    /// The kernel's path for these rows (`step_path::launch_path`; 0: the generic entry).
    pub path: u32,
}

/// A param group's table (what stays resident on the device) and its launches.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct StepTable {
    pub tensors: Vec<FoStepTensor>,
    pub launches: Vec<StepLaunch>,
}

impl StepTable {
    /// The table's bytes as the kernel reads them.
    pub fn as_bytes(&self) -> &[u8] {
        // SAFETY: FoStepTensor is repr(C) plain data without implicit padding (its tail
        // padding is the `_pad` field), so every byte is initialized.
        unsafe {
            std::slice::from_raw_parts(
                self.tensors.as_ptr() as *const u8,
                std::mem::size_of_val(&self.tensors[..]),
            )
        }
    }
}

fn float_dtype(d: DType, what: &str) -> Result<i32> {
    match d {
        DType::F32 | DType::F16 | DType::BF16 => Ok(d.code()),
        other => Err(Error::Dtype(format!(
            "{what}: dtype {other} has no GPU kernel (F32, F16, BF16)"
        ))),
    }
}

/// Builds a param group's table from `entries`: empty tensors are left out (no group to
/// step); the rest are ordered by launch (entries sharing rule scalars and `first`, in
/// the order each first appears, then in entry order), and `group_begin` is the running
/// sum of groups within a launch, so the kernel finds the tensor of any of its groups
/// (a binary search over a launch's rows for a thread's first group, then a walk forward).
pub fn build_table(entries: &[TableEntry]) -> Result<StepTable> {
    let mut launches: Vec<(FoRule, bool, Vec<FoStepTensor>, u64)> = Vec::new();
    for (i, e) in entries.iter().enumerate() {
        if e.numel == 0 {
            continue;
        }
        let kind_of = |m: Option<MomentPtrs>| m.map_or(MomentKind::None, |m| m.kind) as i32;
        let ptrs = |m: Option<MomentPtrs>| m.map_or((0, 0), |m| (m.data, m.scales));
        let ((m, m_scales), (v, v_scales)) = (ptrs(e.state.m), ptrs(e.state.v));
        let rule = FoRule::new(&e.rule)?;
        // Compared as bits: a NaN scalar still lands in one launch with its equals.
        let same = |l: &&mut (FoRule, bool, Vec<FoStepTensor>, u64)| {
            rule_bits(&l.0) == rule_bits(&rule) && l.1 == e.first
        };
        let at = match launches.iter_mut().position(|l| same(&l)) {
            Some(k) => k,
            None => {
                launches.push((rule, e.first, Vec::new(), 0));
                launches.len() - 1
            }
        };
        let l = &mut launches[at];
        l.2.push(FoStepTensor {
            param: e.param,
            grad: e.grad,
            error_bits: e.state.error_bits,
            m,
            m_scales,
            v,
            v_scales,
            numel: e.numel as u64,
            group_begin: l.3,
            param_dtype: float_dtype(e.param_dtype, &format!("table entry {i}: param"))?,
            grad_dtype: float_dtype(e.grad_dtype, &format!("table entry {i}: grad"))?,
            error_bits_width: e.state.error_bits_width,
            m_kind: kind_of(e.state.m),
            v_kind: kind_of(e.state.v),
            _pad: 0,
        });
        l.3 += e.numel.div_ceil(GROUP) as u64;
    }
    let mut t = StepTable::default();
    for (rule, first, rows, total_groups) in launches {
        t.launches.push(StepLaunch {
            row: t.tensors.len(),
            count: rows.len(),
            total_groups,
            rule,
            first,
            path: super::step_path::launch_path(&rows, &rule),
        });
        t.tensors.extend(rows);
    }
    Ok(t)
}

/// A rule's scalars as bits, for grouping entries into launches.
fn rule_bits(r: &FoRule) -> [u32; 17] {
    // SAFETY: FoRule is repr(C), 17 four-byte fields, no padding (pinned by the layout test).
    unsafe { std::mem::transmute_copy(r) }
}

#[cfg(test)]
#[path = "step_table_tests.rs"]
mod tests;
