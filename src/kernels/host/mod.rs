//! Drives the update rules over parameters: every tensor is cut into chunks of `CHUNK`
//! elements (a multiple of the 32-element quantization group, so chunks never split a
//! group), chunks of all tensors run in parallel on fo's rayon pool, and each chunk is
//! decoded to f32, updated by its `Rule`, and encoded back, staying in cache.
//! f32 params, grads and states are updated in place without copies.
//!
//! Speed (`fo bench step`, `benches/optim_stages.rs`): fp32 AdamW runs at the memory
//! ceiling (a no-math loop with the same 4-read/3-write pattern). The compressed step
//! moves 12.25 bytes per parameter instead of 28 but is bound by arithmetic, not memory:
//! reproducing FlashOptim's values bit for bit needs, per element, 7 correctly rounded
//! divisions and 2 square roots (AdamW: `m/bc1`, `v/bc2`, sqrt, the step quotient; master
//! reconstruction `code/127`; momentum encode `x/a` and `2y/(1+|y|)`; variance encode
//! `sqrt(v)/a`), which no reciprocal multiply may replace without changing last bits.
//! These run vectorized (AVX-512 or AVX2, picked at run time); the stage timings in
//! `optim_stages` show where the remaining time goes. Groups with `Arithmetic::Fast`
//! (`fast.rs`) skip the chunk buffers: `fused` steps them one block of quantization groups
//! at a time in registers (measured against exact in docs/performance.md).
pub mod fused;
mod job;

pub use job::Job;

use std::cell::RefCell;

use crate::dtype::DType;
use crate::optim::math::master_split::Half;
use crate::optim::math::rule::fast::FastRule;
use crate::optim::math::rule::Rule;
use crate::optim::math::state::{
    ErrChunk, ErrorBits, GradChunk, Moment, MomentChunk, MomentView, ParamChunk, ParamState,
};
use crate::tensor::TensorView;

/// Elements per chunk when something must be decoded: the 4 f32 buffers (32 KiB) stay
/// in L1 between decode, update and encode.
pub const CHUNK: usize = 2048;
/// Elements per chunk when params, grads and states are all f32 and updated in place
/// (no buffers): larger, to keep scheduling overhead small.
pub const CHUNK_DIRECT: usize = 16384;

/// Elements decoded, updated and encoded at a time within a chunk: the four f32 buffers
/// (4 KiB) and the stored bytes they come from stay in L1 together.
pub const BLOCK: usize = 256;

thread_local! {
    static SCRATCH: RefCell<Vec<f32>> = RefCell::new(vec![0f32; 4 * BLOCK]);
}

/// Runs a job block by block (element-wise rules and group-aligned blocks: the same
/// values as one pass over the chunk).
#[inline(always)]
fn run_blocks(mut job: Job<'_>, scratch: &mut [f32]) {
    let n = job.p.len();
    if matches!(job.p, ParamChunk::F32(_))
        && matches!(job.g, GradChunk::F32(_))
        && matches!(job.m, None | Some(MomentChunk::F32(_)))
        && matches!(job.v, None | Some(MomentChunk::F32(_)))
    {
        return run_generic(job, scratch);
    }
    for lo in (0..n).step_by(BLOCK) {
        let hi = (lo + BLOCK).min(n);
        let sub = Job {
            p: job.p.sub(lo, hi),
            g: job.g.sub(lo, hi),
            m: job.m.as_mut().map(|m| m.sub(lo, hi)),
            v: job.v.as_mut().map(|v| v.sub(lo, hi)),
            old: [0, 1].map(|k| job.old[k].as_ref().map(|o| o.sub(lo, hi))),
            rule: job.rule,
            first: job.first,
        };
        run_generic(sub, scratch);
    }
}

#[inline(always)]
fn run_generic(job: Job<'_>, scratch: &mut [f32]) {
    let Job {
        mut p,
        g,
        mut m,
        mut v,
        old,
        rule,
        first,
    } = job;
    let n = p.len();
    let (pb, rest) = scratch.split_at_mut(BLOCK);
    let (gb, rest) = rest.split_at_mut(BLOCK);
    let (mb, vb) = rest.split_at_mut(BLOCK);
    let gs: &[f32] = match &g {
        GradChunk::F32(s) => s,
        other => {
            other.load(&mut gb[..n]);
            &gb[..n]
        }
    };
    let ps: &mut [f32] = match &mut p {
        ParamChunk::F32(s) => s,
        other => {
            other.load(&mut pb[..n]);
            &mut pb[..n]
        }
    };
    // A moment read from elsewhere (`Job::old`) is decoded from there; an f32 one
    // updated in place gets its values copied in first.
    let ms = load_moment(&mut m, &old[0], mb, n);
    let vs = load_moment(&mut v, &old[1], vb, n);
    rule.apply(ps, gs, ms, vs, first);
    if !matches!(p, ParamChunk::F32(_)) {
        p.store(&pb[..n]);
    }
    if let Some(c) = m.as_mut().filter(|c| !matches!(c, MomentChunk::F32(_))) {
        c.store(&mb[..n]);
    }
    if let Some(c) = v.as_mut().filter(|c| !matches!(c, MomentChunk::F32(_))) {
        c.store(&vb[..n]);
    }
}

/// A job's moment of `n` elements as the f32 values its update reads and writes: an f32
/// chunk itself, else the first `n` of `buf` holding its decoded values; read from `old`
/// where given.
#[inline(always)]
fn load_moment<'a>(
    c: &'a mut Option<MomentChunk<'_>>,
    old: &Option<MomentView<'_>>,
    buf: &'a mut [f32],
    n: usize,
) -> &'a mut [f32] {
    match (c, old) {
        (Some(MomentChunk::F32(s)), None) => s,
        (Some(MomentChunk::F32(s)), Some(o)) => {
            o.load(s, true);
            s
        }
        (Some(c), None) => {
            c.load(&mut buf[..n], true);
            &mut buf[..n]
        }
        (Some(_), Some(o)) => {
            o.load(&mut buf[..n], true);
            &mut buf[..n]
        }
        (None, _) => &mut [],
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")]
unsafe fn run_avx512(job: Job<'_>, scratch: &mut [f32]) {
    run_blocks(job, scratch)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn run_avx2(job: Job<'_>, scratch: &mut [f32]) {
    run_blocks(job, scratch)
}

#[derive(Clone, Copy)]
enum Isa {
    #[cfg(target_arch = "x86_64")]
    Avx512(fused::Avx512),
    Avx2,
    Generic,
}

/// The widest instruction set available, once per process. `FO_KERNEL_ISA=generic|avx2`
/// caps it (to check that every path gives the same bits); `FO_NO_AVX512` = `avx2`.
fn isa() -> Isa {
    static ISA: std::sync::OnceLock<Isa> = std::sync::OnceLock::new();
    *ISA.get_or_init(|| {
        let cap = std::env::var("FO_KERNEL_ISA").unwrap_or_default();
        if cap == "generic" {
            return Isa::Generic;
        }
        #[cfg(target_arch = "x86_64")]
        {
            let no512 = cap == "avx2" || std::env::var_os("FO_NO_AVX512").is_some();
            if let Some(t) = fused::Avx512::detect().filter(|_| !no512) {
                return Isa::Avx512(t);
            }
            if is_x86_feature_detected!("avx2")
                && is_x86_feature_detected!("fma")
                && is_x86_feature_detected!("f16c")
            {
                return Isa::Avx2;
            }
        }
        Isa::Generic
    })
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")]
unsafe fn fast_avx512(l: fused::Avx512, job: Job<'_>, rule: &FastRule) {
    fused::run(l, job, rule)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn fast_avx2(job: Job<'_>, rule: &FastRule) {
    fused::run(fused::Portable, job, rule)
}

/// Runs one chunk with the widest vector instructions this CPU has. The arithmetic is
/// the same on every path: IEEE f32 operations, `mul_add` always fused.
pub fn run(job: Job<'_>) {
    if let Rule::Fast(rule) = job.rule {
        return match isa() {
            // SAFETY: the features were detected at run time.
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512(l) => unsafe { fast_avx512(l, job, &rule) },
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2 => unsafe { fast_avx2(job, &rule) },
            _ => fused::run(fused::Portable, job, &rule),
        };
    }
    SCRATCH.with(|s| {
        let s = &mut s.borrow_mut()[..];
        match isa() {
            // SAFETY: the features were detected at run time.
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512(_) => unsafe { run_avx512(job, s) },
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2 => unsafe { run_avx2(job, s) },
            _ => run_blocks(job, s),
        }
    })
}

/// Cuts one parameter (and its gradient and state) into chunk jobs.
pub(crate) unsafe fn push_jobs<'a>(
    jobs: &mut Vec<Job<'a>>,
    param: &TensorView,
    grad: &'a [u8],
    grad_dtype: DType,
    st: &'a mut ParamState,
    rule: Rule,
    first: bool,
) {
    push_range_jobs(
        jobs,
        param,
        0..param.numel(),
        grad,
        grad_dtype,
        st,
        rule,
        first,
    )
}

/// The elements per job for a parameter of `param_dtype` stepped from `grad_dtype`
/// gradients with state `st` (`push_jobs` cuts at multiples of it).
pub(crate) fn chunk_for(param_dtype: DType, grad_dtype: DType, st: &ParamState) -> usize {
    let direct = |m: &Option<Moment>| matches!(m, None | Some(Moment::F32(_)));
    if param_dtype == DType::F32 && grad_dtype == DType::F32 && direct(&st.m) && direct(&st.v) {
        CHUNK_DIRECT
    } else {
        CHUNK
    }
}

/// `push_jobs` over elements `range` of the parameter only, with `grad` holding the
/// gradient of just those elements. `range.start` must be a multiple of `chunk_for`, so
/// the jobs are exactly the ones `push_jobs` makes over that range (the same bits,
/// however a tensor is cut into ranges).
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn push_range_jobs<'a>(
    jobs: &mut Vec<Job<'a>>,
    param: &TensorView,
    range: std::ops::Range<usize>,
    grad: &'a [u8],
    grad_dtype: DType,
    st: &'a mut ParamState,
    rule: Rule,
    first: bool,
) {
    let chunk = chunk_for(param.dtype(), grad_dtype, st);
    let (lo, hi) = (range.start, range.end);
    debug_assert!(lo.is_multiple_of(chunk) && hi <= param.numel() && lo <= hi);
    let n = hi - lo;
    let ptr = param.as_ptr();
    let pchunks: Vec<ParamChunk<'a>> = match param.dtype() {
        DType::F32 => std::slice::from_raw_parts_mut((ptr as *mut f32).add(lo), n)
            .chunks_mut(chunk)
            .map(ParamChunk::F32)
            .collect(),
        d => {
            let h = Half::from_dtype(d).expect("param dtypes are checked at add_param");
            let bits = std::slice::from_raw_parts_mut((ptr as *mut u16).add(lo), n);
            let errs: Vec<ErrChunk<'a>> = match st.error_bits.as_mut() {
                None => (0..n.div_ceil(chunk)).map(|_| ErrChunk::None).collect(),
                Some(ErrorBits::I8(e)) => e[lo..hi].chunks_mut(chunk).map(ErrChunk::I8).collect(),
                Some(ErrorBits::I16(e)) => e[lo..hi].chunks_mut(chunk).map(ErrChunk::I16).collect(),
            };
            bits.chunks_mut(chunk)
                .zip(errs)
                .map(|(bits, err)| ParamChunk::Half { h, bits, err })
                .collect()
        }
    };
    let gchunks: Vec<GradChunk<'a>> = match grad_dtype {
        DType::F32 => {
            let g = std::slice::from_raw_parts(grad.as_ptr() as *const f32, n);
            g.chunks(chunk).map(GradChunk::F32).collect()
        }
        d => {
            let h = Half::from_dtype(d).expect("grad dtypes are checked before the step");
            let g = std::slice::from_raw_parts(grad.as_ptr() as *const u16, n);
            g.chunks(chunk).map(|c| GradChunk::Half(h, c)).collect()
        }
    };
    let mut ms =
        st.m.as_mut()
            .map(|m| m.range_chunks_mut(lo, hi, chunk).into_iter());
    let mut vs =
        st.v.as_mut()
            .map(|v| v.range_chunks_mut(lo, hi, chunk).into_iter());
    for (p, g) in pchunks.into_iter().zip(gchunks) {
        let m = ms.as_mut().and_then(|it| it.next());
        let v = vs.as_mut().and_then(|it| it.next());
        jobs.push(Job {
            p,
            g,
            m,
            v,
            old: [None, None],
            rule,
            first,
        });
    }
}
