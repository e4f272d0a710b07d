//! Per-parameter optimizer state in its stored format, and chunk views of it that the
//! kernels decode to f32, update and encode back.
use half::f16;

pub use super::live::F32Buf;
use super::master_split::{encode_one, reconstruct_one, ErrorCode, Half};
use super::quant8::{self, GROUP};

/// Runs `$body` with `$hc` bound to the constant `Half` variant matching `$h`, so the
/// per-element conversions inside are specialized (no per-element branch on the format).
macro_rules! with_half {
    ($h:expr, $hc:ident => $body:expr) => {
        match $h {
            Half::BF16 => {
                let $hc = Half::BF16;
                $body
            }
            Half::F16 => {
                let $hc = Half::F16;
                $body
            }
        }
    };
}

/// How a variance state is companded into uint8: FlashOptim's square root, or fo's
/// fourth root (`StateFormat::Quant8Wide`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Root {
    Sqrt,
    Fourth,
}

/// One moment state (`exp_avg`, `exp_avg_sq` or `momentum_buffer`) as stored.
#[derive(Debug, Clone, PartialEq)]
pub enum Moment {
    /// f32 values, in a buffer fo can lend out live (`live`).
    F32(F32Buf),
    /// bf16/f16 bit patterns (the `param_dtype` format on 16-bit params).
    Half(Half, Vec<u16>),
    /// quant8 momentum: int8 softsign codes, fp16 scale per 32.
    Signed { codes: Vec<i8>, scales: Vec<f16> },
    /// quant8 variance: uint8 codes of `v^(1/2)` (or `v^(1/4)`), fp16 scale per 32.
    Unsigned {
        codes: Vec<u8>,
        scales: Vec<f16>,
        root: Root,
    },
}

/// Error bits completing a 16-bit parameter into a 24- or 32-bit master.
#[derive(Debug, Clone, PartialEq)]
pub enum ErrorBits {
    I8(Vec<i8>),
    I16(Vec<i16>),
}

impl ErrorBits {
    pub fn nbytes(&self) -> usize {
        match self {
            ErrorBits::I8(v) => v.len(),
            ErrorBits::I16(v) => 2 * v.len(),
        }
    }
}

/// Everything one parameter's optimizer holds once it has taken (or loaded) a step.
#[derive(Debug, Clone, PartialEq)]
pub struct ParamState {
    pub step: u64,
    /// `exp_avg` (Adam, Lion) or `momentum_buffer` (SGD with momentum).
    pub m: Option<Moment>,
    /// `exp_avg_sq` (Adam).
    pub v: Option<Moment>,
    pub error_bits: Option<ErrorBits>,
    /// The momentum state holds a value (stepped or loaded). Until then SGD's first step
    /// sets it to the gradient, undampened, as torch does.
    pub m_valid: bool,
}

impl ParamState {
    /// `m` (k = 0) or `v` (k = 1).
    pub fn moment(&self, k: usize) -> Option<&Moment> {
        [&self.m, &self.v][k].as_ref()
    }

    /// Makes `new` this state and returns the state it replaces, keeping every lent f32
    /// buffer live (`F32Buf::adopt`: its values copied in place rather than the buffer
    /// swapped out). What loads, rollbacks and undos write a whole state through.
    pub fn replace(&mut self, mut new: ParamState) -> ParamState {
        for (live, m) in [(&mut self.m, &mut new.m), (&mut self.v, &mut new.v)] {
            if let (Some(Moment::F32(a)), Some(Moment::F32(b))) = (live.as_mut(), m.as_mut()) {
                a.adopt(b);
            } else {
                std::mem::swap(live, m);
            }
        }
        std::mem::swap(&mut self.step, &mut new.step);
        std::mem::swap(&mut self.m_valid, &mut new.m_valid);
        std::mem::swap(&mut self.error_bits, &mut new.error_bits);
        new
    }

    /// [`ParamState::replace`] on a parameter's optional state.
    pub fn replace_in(
        slot: &mut Option<ParamState>,
        new: Option<ParamState>,
    ) -> Option<ParamState> {
        match (slot.as_mut(), new) {
            (Some(live), Some(new)) => Some(live.replace(new)),
            (_, new) => std::mem::replace(slot, new),
        }
    }

    pub fn nbytes(&self) -> usize {
        self.m.as_ref().map_or(0, Moment::nbytes)
            + self.v.as_ref().map_or(0, Moment::nbytes)
            + self.error_bits.as_ref().map_or(0, ErrorBits::nbytes)
    }
}

/// A kernel-side decode table for variance codes: FlashOptim's exact one, or for
/// `Quant8Wide` one where code 0 stands for half the smallest level (never 0).
fn root_decode(root: Root, code: u8, scale: f32, floor_zero: bool) -> f32 {
    let t = quant8::unsigned_table();
    let u = if floor_zero && code == 0 {
        0.5 / 255.0 * scale
    } else {
        t[code as usize] * scale
    };
    match root {
        Root::Sqrt => u * u,
        Root::Fourth => (u * u) * (u * u),
    }
}

impl Moment {
    pub fn zeros_signed(n: usize) -> Moment {
        Moment::Signed {
            codes: vec![0; n],
            scales: vec![f16::ZERO; quant8::num_groups(n)],
        }
    }
    pub fn zeros_unsigned(n: usize, root: Root) -> Moment {
        Moment::Unsigned {
            codes: vec![0; n],
            scales: vec![f16::ZERO; quant8::num_groups(n)],
            root,
        }
    }

    pub fn numel(&self) -> usize {
        match self {
            Moment::F32(v) => v.len(),
            Moment::Half(_, v) => v.len(),
            Moment::Signed { codes, .. } => codes.len(),
            Moment::Unsigned { codes, .. } => codes.len(),
        }
    }

    pub fn nbytes(&self) -> usize {
        match self {
            Moment::F32(v) => 4 * v.len(),
            Moment::Half(_, v) => 2 * v.len(),
            Moment::Signed { codes, scales } => codes.len() + 2 * scales.len(),
            Moment::Unsigned { codes, scales, .. } => codes.len() + 2 * scales.len(),
        }
    }

    /// Views of `chunk`-element pieces (`chunk` a multiple of 32), in order.
    pub fn chunks_mut(&mut self, chunk: usize) -> Vec<MomentChunk<'_>> {
        let n = self.numel();
        self.range_chunks_mut(0, n, chunk)
    }

    /// Views of `chunk`-element pieces of elements `lo..hi` (`lo` and `chunk` multiples of
    /// 32), in order: the same views as `chunks_mut` gives over that range when `lo` is a
    /// multiple of `chunk`, without making views of the rest (the offload pipeline steps
    /// a tensor one piece at a time).
    pub fn range_chunks_mut(&mut self, lo: usize, hi: usize, chunk: usize) -> Vec<MomentChunk<'_>> {
        debug_assert_eq!(chunk % GROUP, 0);
        debug_assert_eq!(lo % GROUP, 0);
        let groups = lo / GROUP..hi.div_ceil(GROUP);
        match self {
            Moment::F32(v) => v[lo..hi].chunks_mut(chunk).map(MomentChunk::F32).collect(),
            Moment::Half(h, v) => v[lo..hi]
                .chunks_mut(chunk)
                .map(|c| MomentChunk::Half(*h, c))
                .collect(),
            Moment::Signed { codes, scales } => codes[lo..hi]
                .chunks_mut(chunk)
                .zip(scales[groups].chunks_mut(chunk / GROUP))
                .map(|(c, s)| MomentChunk::Signed(c, s))
                .collect(),
            Moment::Unsigned {
                codes,
                scales,
                root,
            } => codes[lo..hi]
                .chunks_mut(chunk)
                .zip(scales[groups].chunks_mut(chunk / GROUP))
                .map(|(c, s)| MomentChunk::Unsigned(c, s, *root))
                .collect(),
        }
    }

    /// Elements `lo..hi` (group-aligned `lo`), read-only: what state reads decode from
    /// (no `&mut`, so a read never copies the moment to get a chunk of it).
    #[inline(always)]
    pub fn view(&self, lo: usize, hi: usize) -> MomentView<'_> {
        let (gl, gh) = (lo / GROUP, hi.div_ceil(GROUP));
        match self {
            Moment::F32(v) => MomentView::F32(&v[lo..hi]),
            Moment::Half(h, v) => MomentView::Half(*h, &v[lo..hi]),
            Moment::Signed { codes, scales } => MomentView::Signed(&codes[lo..hi], &scales[gl..gh]),
            Moment::Unsigned {
                codes,
                scales,
                root,
            } => MomentView::Unsigned(&codes[lo..hi], &scales[gl..gh], *root),
        }
    }

    /// Overwrites the values from f32 (quantizing where the format is quantized).
    pub fn encode(&mut self, src: &[f32]) {
        for (i, mut c) in self.chunks_mut(1 << 14).into_iter().enumerate() {
            let lo = i << 14;
            let hi = (lo + (1 << 14)).min(src.len());
            c.store(&src[lo..hi]);
        }
    }
}

/// A read-only piece of a `Moment`, starting at a group boundary: the one decoder that
/// steps (through `MomentChunk::load`) and state reads share, so both see the same bits.
pub enum MomentView<'a> {
    F32(&'a [f32]),
    Half(Half, &'a [u16]),
    Signed(&'a [i8], &'a [f16]),
    Unsigned(&'a [u8], &'a [f16], Root),
}

impl MomentView<'_> {
    /// Elements `lo..hi` (group-aligned `lo`).
    #[inline(always)]
    pub fn sub(&self, lo: usize, hi: usize) -> MomentView<'_> {
        let (gl, gh) = (lo / GROUP, hi.div_ceil(GROUP));
        match self {
            MomentView::F32(s) => MomentView::F32(&s[lo..hi]),
            MomentView::Half(h, s) => MomentView::Half(*h, &s[lo..hi]),
            MomentView::Signed(c, s) => MomentView::Signed(&c[lo..hi], &s[gl..gh]),
            MomentView::Unsigned(c, s, r) => MomentView::Unsigned(&c[lo..hi], &s[gl..gh], *r),
        }
    }

    /// Decodes into `out` (same length). `kernel`: the values the update uses, where
    /// `Quant8Wide` floors a zero variance code (see `StateFormat::Quant8Wide`).
    #[inline(always)]
    pub fn load(&self, out: &mut [f32], kernel: bool) {
        match self {
            MomentView::F32(s) => out.copy_from_slice(s),
            MomentView::Half(h, s) => with_half!(*h, hc => {
                for (o, &b) in out.iter_mut().zip(s.iter()) {
                    *o = hc.to_f32(b);
                }
            }),
            MomentView::Signed(c, s) => {
                for ((c, &s), o) in c.chunks(GROUP).zip(s.iter()).zip(out.chunks_mut(GROUP)) {
                    quant8::decode_signed_group(c, s, o);
                }
            }
            MomentView::Unsigned(c, s, root) => {
                let floor = kernel && *root == Root::Fourth;
                for ((c, &s), o) in c.chunks(GROUP).zip(s.iter()).zip(out.chunks_mut(GROUP)) {
                    if *root == Root::Sqrt {
                        quant8::decode_unsigned_sqrt_group(c, s, o);
                    } else {
                        let sc = s.to_f32();
                        for (o, &c) in o.iter_mut().zip(c) {
                            *o = root_decode(*root, c, sc, floor);
                        }
                    }
                }
            }
        }
    }
}

/// A contiguous piece of a `Moment`, starting at a group boundary.
pub enum MomentChunk<'a> {
    F32(&'a mut [f32]),
    Half(Half, &'a mut [u16]),
    Signed(&'a mut [i8], &'a mut [f16]),
    Unsigned(&'a mut [u8], &'a mut [f16], Root),
}

impl MomentChunk<'_> {
    /// Elements `lo..hi` (group-aligned `lo`), reborrowed.
    #[inline(always)]
    pub fn sub(&mut self, lo: usize, hi: usize) -> MomentChunk<'_> {
        let (gl, gh) = (lo / GROUP, hi.div_ceil(GROUP));
        match self {
            MomentChunk::F32(s) => MomentChunk::F32(&mut s[lo..hi]),
            MomentChunk::Half(h, s) => MomentChunk::Half(*h, &mut s[lo..hi]),
            MomentChunk::Signed(c, s) => MomentChunk::Signed(&mut c[lo..hi], &mut s[gl..gh]),
            MomentChunk::Unsigned(c, s, r) => {
                MomentChunk::Unsigned(&mut c[lo..hi], &mut s[gl..gh], *r)
            }
        }
    }

    /// This piece, read-only.
    #[inline(always)]
    pub fn view(&self) -> MomentView<'_> {
        match self {
            MomentChunk::F32(s) => MomentView::F32(s),
            MomentChunk::Half(h, s) => MomentView::Half(*h, s),
            MomentChunk::Signed(c, s) => MomentView::Signed(c, s),
            MomentChunk::Unsigned(c, s, r) => MomentView::Unsigned(c, s, *r),
        }
    }

    /// Decodes into `out` (same length): `MomentView::load`.
    #[inline(always)]
    pub fn load(&self, out: &mut [f32], kernel: bool) {
        self.view().load(out, kernel)
    }

    /// Encodes `src` (same length) into this piece.
    #[inline(always)]
    pub fn store(&mut self, src: &[f32]) {
        match self {
            MomentChunk::F32(s) => s.copy_from_slice(src),
            MomentChunk::Half(h, s) => with_half!(*h, hc => {
                for (b, &x) in s.iter_mut().zip(src) {
                    *b = hc.from_f32(x);
                }
            }),
            MomentChunk::Signed(c, s) => {
                for ((x, c), s) in src.chunks(GROUP).zip(c.chunks_mut(GROUP)).zip(s.iter_mut()) {
                    *s = quant8::encode_signed_group(x, c);
                }
            }
            MomentChunk::Unsigned(c, s, root) => {
                let mut scratch = [0f32; GROUP];
                for ((x, c), s) in src.chunks(GROUP).zip(c.chunks_mut(GROUP)).zip(s.iter_mut()) {
                    *s = match root {
                        Root::Sqrt => quant8::encode_unsigned_sqrt_group(x, c, &mut scratch),
                        Root::Fourth => encode_fourth_root_group(x, c, &mut scratch),
                    };
                }
            }
        }
    }
}

/// `Quant8Wide` variance: uint8 codes of `v^(1/4)` relative to the group's maximum.
#[inline(always)]
fn encode_fourth_root_group(v: &[f32], codes: &mut [u8], scratch: &mut [f32; GROUP]) -> f16 {
    let r = &mut scratch[..v.len()];
    for (r, &v) in r.iter_mut().zip(v) {
        *r = v.sqrt().sqrt();
    }
    let a = r
        .iter()
        .fold(0f32, |a, x| a.max(*x))
        .max(quant8::ABSMAX_FLOOR);
    for (c, &r) in codes.iter_mut().zip(r.iter()) {
        *c = quant8::to_code(((r / a) * 255.0 + 0.5).floor(), 0.0, 255.0) as u8;
    }
    f16::from_f32(a)
}

/// A piece of a parameter: f32 in place, or 16-bit with optional error bits.
pub enum ParamChunk<'a> {
    F32(&'a mut [f32]),
    Half {
        h: Half,
        bits: &'a mut [u16],
        err: ErrChunk<'a>,
    },
}

pub enum ErrChunk<'a> {
    None,
    I8(&'a mut [i8]),
    I16(&'a mut [i16]),
}

impl ParamChunk<'_> {
    /// Elements `lo..hi`, reborrowed.
    #[inline(always)]
    pub fn sub(&mut self, lo: usize, hi: usize) -> ParamChunk<'_> {
        match self {
            ParamChunk::F32(s) => ParamChunk::F32(&mut s[lo..hi]),
            ParamChunk::Half { h, bits, err } => ParamChunk::Half {
                h: *h,
                bits: &mut bits[lo..hi],
                err: match err {
                    ErrChunk::None => ErrChunk::None,
                    ErrChunk::I8(e) => ErrChunk::I8(&mut e[lo..hi]),
                    ErrChunk::I16(e) => ErrChunk::I16(&mut e[lo..hi]),
                },
            },
        }
    }
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
    pub fn len(&self) -> usize {
        match self {
            ParamChunk::F32(s) => s.len(),
            ParamChunk::Half { bits, .. } => bits.len(),
        }
    }

    /// The master values (reconstructed from error bits when present).
    #[inline(always)]
    pub fn load(&self, out: &mut [f32]) {
        match self {
            ParamChunk::F32(s) => out.copy_from_slice(s),
            ParamChunk::Half { h, bits, err } => with_half!(*h, hc => match err {
                ErrChunk::None => {
                    for (o, &b) in out.iter_mut().zip(bits.iter()) {
                        *o = hc.to_f32(b);
                    }
                }
                ErrChunk::I8(e) => reconstruct_loop(hc, bits, e, out),
                ErrChunk::I16(e) => reconstruct_loop(hc, bits, e, out),
            }),
        }
    }

    /// Rounds masters `src` into the parameter and splits off the error bits.
    #[inline(always)]
    pub fn store(&mut self, src: &[f32]) {
        match self {
            ParamChunk::F32(s) => s.copy_from_slice(src),
            ParamChunk::Half { h, bits, err } => with_half!(*h, hc => {
                for (b, &x) in bits.iter_mut().zip(src) {
                    *b = hc.from_f32(x);
                }
                match err {
                    ErrChunk::None => {}
                    ErrChunk::I8(e) => encode_loop(hc, bits, e, src),
                    ErrChunk::I16(e) => encode_loop(hc, bits, e, src),
                }
            }),
        }
    }
}

#[inline(always)]
fn reconstruct_loop<C: ErrorCode>(h: Half, bits: &[u16], codes: &[C], out: &mut [f32]) {
    for ((o, &b), &c) in out.iter_mut().zip(bits).zip(codes) {
        *o = reconstruct_one(h, b, c);
    }
}

#[inline(always)]
fn encode_loop<C: ErrorCode>(h: Half, bits: &[u16], codes: &mut [C], src: &[f32]) {
    for ((e, &x), &b) in codes.iter_mut().zip(src).zip(bits) {
        *e = encode_one(h, x, b);
    }
}

/// A piece of a gradient, read-only.
pub enum GradChunk<'a> {
    F32(&'a [f32]),
    Half(Half, &'a [u16]),
}

impl GradChunk<'_> {
    /// Elements `lo..hi`.
    #[inline(always)]
    pub fn sub(&self, lo: usize, hi: usize) -> GradChunk<'_> {
        match self {
            GradChunk::F32(s) => GradChunk::F32(&s[lo..hi]),
            GradChunk::Half(h, s) => GradChunk::Half(*h, &s[lo..hi]),
        }
    }
    #[inline(always)]
    pub fn load(&self, out: &mut [f32]) {
        match self {
            GradChunk::F32(s) => out.copy_from_slice(s),
            GradChunk::Half(h, s) => with_half!(*h, hc => {
                for (o, &b) in out.iter_mut().zip(s.iter()) {
                    *o = hc.to_f32(b);
                }
            }),
        }
    }
}
