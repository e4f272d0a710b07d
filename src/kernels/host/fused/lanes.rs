//! Sixteen f32 (or u32) lanes and the operations the fused step is written in. Every
//! operation has one exact result (IEEE f32 arithmetic with one rounding, fused
//! multiply-add fused, integer operations on bits, saturating packs), so the AVX-512
//! backend (`super::avx512`) and this portable one give the same bits for the same
//! inputs: the fused kernel is written once, against this trait. The arithmetic the
//! update rules use is its supertrait, `Arith`, defined with the rules.
//!
//! A backend is a zero-sized token passed by value; the AVX-512 one can only be made
//! where the CPU has the instructions, which is what makes its safe methods sound.
use crate::optim::math::rule::arith::Arith;

/// Lanes of one vector (the fused kernel handles a 32-element quantization group as two).
pub const W: usize = 16;

pub trait Lanes: Arith {
    /// 16 × u32 (bit patterns, integers).
    type I: Copy;
    /// Whether the kernel is worth compiling once more per common storage layout (see
    /// `fused::run_groups`): yes where speed matters, no for the portable fallback.
    const SPECIALIZE: bool;

    fn isplat(self, x: u32) -> Self::I;
    /// `a < b ? a : b` (x86's `minps`: the second operand when either is NaN).
    fn min(self, a: Self::F, b: Self::F) -> Self::F;
    /// `a > b ? a : b` (x86's `maxps`).
    fn max(self, a: Self::F, b: Self::F) -> Self::F;
    /// The sign bit cleared.
    fn abs(self, a: Self::F) -> Self::F;

    fn to_bits(self, a: Self::F) -> Self::I;
    fn bits_as_f(self, i: Self::I) -> Self::F;
    /// Signed 32-bit integers to f32 (round to nearest even).
    fn i2f(self, i: Self::I) -> Self::F;
    /// floor(a) as a signed 32-bit integer; NaN and values out of range give `i32::MIN`
    /// (x86's integer indefinite).
    fn floor_i(self, a: Self::F) -> Self::I;
    /// Toward zero to i32, as `floor_i` out of range.
    fn trunc_i(self, a: Self::F) -> Self::I;

    fn and(self, a: Self::I, b: Self::I) -> Self::I;
    fn or(self, a: Self::I, b: Self::I) -> Self::I;
    fn iadd(self, a: Self::I, b: Self::I) -> Self::I;
    fn isub(self, a: Self::I, b: Self::I) -> Self::I;
    fn shl<const N: u32>(self, a: Self::I) -> Self::I;
    /// Logical shift right.
    fn shr<const N: u32>(self, a: Self::I) -> Self::I;
    fn umax(self, a: Self::I, b: Self::I) -> Self::I;

    /// Not NaN.
    fn ord(self, a: Self::F) -> Self::M;
    /// Unsigned `a < b`.
    fn ult(self, a: Self::I, b: Self::I) -> Self::M;
    fn any(self, m: Self::M) -> bool;
    fn iselect(self, m: Self::M, a: Self::I, b: Self::I) -> Self::I;
    /// Lanes from `n` on set to 0.
    fn keep(self, n: usize, a: Self::F) -> Self::F;

    /// f16 bit patterns (low 16 bits of each lane) to f32, exactly.
    fn f16_to_f32(self, i: Self::I) -> Self::F;
    /// f32 to f16 bit patterns, round to nearest even.
    fn f32_to_f16(self, a: Self::F) -> Self::I;
    /// Lane `j` = the largest lane of `x[j]`, for lanes that are all non-negative and not
    /// NaN (so the order in which a backend reduces cannot change the result).
    fn max16(self, x: &[Self::F; W]) -> Self::F;

    // Memory: `n` (at most `W`) elements; lanes past `n` load as 0 and are not stored.
    /// # Safety
    /// `p` is valid for reading `n` elements.
    unsafe fn load_f32(self, p: *const f32, n: usize) -> Self::F;
    /// # Safety
    /// `p` is valid for writing `n` elements.
    unsafe fn store_f32(self, p: *mut f32, n: usize, a: Self::F);
    /// 16-bit values, zero-extended.
    /// # Safety
    /// As `load_f32`.
    unsafe fn load_u16(self, p: *const u16, n: usize) -> Self::I;
    /// The low 16 bits of each lane.
    /// # Safety
    /// As `store_f32`.
    unsafe fn store_u16(self, p: *mut u16, n: usize, a: Self::I);
    /// Sign-extended.
    /// # Safety
    /// As `load_f32`.
    unsafe fn load_i8(self, p: *const i8, n: usize) -> Self::I;
    /// Zero-extended.
    /// # Safety
    /// As `load_f32`.
    unsafe fn load_u8(self, p: *const u8, n: usize) -> Self::I;
    /// Sign-extended.
    /// # Safety
    /// As `load_f32`.
    unsafe fn load_i16(self, p: *const i16, n: usize) -> Self::I;
    /// Signed 32-bit lanes saturated to i8.
    /// # Safety
    /// As `store_f32`.
    unsafe fn store_i8_sat(self, p: *mut i8, n: usize, a: Self::I);
    /// Unsigned 32-bit lanes saturated to u8.
    /// # Safety
    /// As `store_f32`.
    unsafe fn store_u8_sat(self, p: *mut u8, n: usize, a: Self::I);
    /// Signed 32-bit lanes saturated to i16.
    /// # Safety
    /// As `store_f32`.
    unsafe fn store_i16_sat(self, p: *mut i16, n: usize, a: Self::I);
}

/// Plain Rust over arrays; the compiler vectorizes it for whatever the enclosing
/// function's target features allow.
#[derive(Clone, Copy)]
pub struct Portable;

type Fa = [f32; W];
type Ia = [u32; W];

#[inline(always)]
fn map<T: Copy, U>(a: [T; W], f: impl Fn(T) -> U) -> [U; W] {
    std::array::from_fn(|i| f(a[i]))
}

#[inline(always)]
fn zip<T: Copy, U: Copy, V>(a: [T; W], b: [U; W], f: impl Fn(T, U) -> V) -> [V; W] {
    std::array::from_fn(|i| f(a[i], b[i]))
}

#[inline(always)]
fn bitmask(f: impl Fn(usize) -> bool) -> u16 {
    (0..W).fold(0u16, |m, i| m | ((f(i) as u16) << i))
}

impl Arith for Portable {
    type F = Fa;
    type M = u16;

    #[inline(always)]
    fn splat(self, x: f32) -> Fa {
        [x; W]
    }
    #[inline(always)]
    fn add(self, a: Fa, b: Fa) -> Fa {
        zip(a, b, |x, y| x + y)
    }
    #[inline(always)]
    fn sub(self, a: Fa, b: Fa) -> Fa {
        zip(a, b, |x, y| x - y)
    }
    #[inline(always)]
    fn mul(self, a: Fa, b: Fa) -> Fa {
        zip(a, b, |x, y| x * y)
    }
    #[inline(always)]
    fn div(self, a: Fa, b: Fa) -> Fa {
        zip(a, b, |x, y| x / y)
    }
    #[inline(always)]
    fn sqrt(self, a: Fa) -> Fa {
        map(a, f32::sqrt)
    }
    #[inline(always)]
    fn fma(self, a: Fa, b: Fa, c: Fa) -> Fa {
        std::array::from_fn(|i| a[i].mul_add(b[i], c[i]))
    }
    #[inline(always)]
    fn fms(self, a: Fa, b: Fa, c: Fa) -> Fa {
        std::array::from_fn(|i| a[i].mul_add(b[i], -c[i]))
    }
    #[inline(always)]
    fn lt(self, a: Fa, b: Fa) -> u16 {
        bitmask(|i| a[i] < b[i])
    }
    #[inline(always)]
    fn gt(self, a: Fa, b: Fa) -> u16 {
        bitmask(|i| a[i] > b[i])
    }
    #[inline(always)]
    fn select(self, m: u16, a: Fa, b: Fa) -> Fa {
        std::array::from_fn(|i| if m >> i & 1 != 0 { a[i] } else { b[i] })
    }
}

impl Lanes for Portable {
    const SPECIALIZE: bool = false;
    type I = Ia;
    #[inline(always)]
    fn isplat(self, x: u32) -> Ia {
        [x; W]
    }
    #[inline(always)]
    fn min(self, a: Fa, b: Fa) -> Fa {
        zip(a, b, |x, y| if x < y { x } else { y })
    }
    #[inline(always)]
    fn max(self, a: Fa, b: Fa) -> Fa {
        zip(a, b, |x, y| if x > y { x } else { y })
    }
    #[inline(always)]
    fn abs(self, a: Fa) -> Fa {
        map(a, |x| f32::from_bits(x.to_bits() & 0x7fff_ffff))
    }
    #[inline(always)]
    fn to_bits(self, a: Fa) -> Ia {
        map(a, f32::to_bits)
    }
    #[inline(always)]
    fn bits_as_f(self, i: Ia) -> Fa {
        map(i, f32::from_bits)
    }
    #[inline(always)]
    fn i2f(self, i: Ia) -> Fa {
        map(i, |x| x as i32 as f32)
    }
    #[inline(always)]
    fn floor_i(self, a: Fa) -> Ia {
        map(a, |x| to_i32(x.floor()))
    }
    #[inline(always)]
    fn trunc_i(self, a: Fa) -> Ia {
        map(a, |x| to_i32(x.trunc()))
    }
    #[inline(always)]
    fn and(self, a: Ia, b: Ia) -> Ia {
        zip(a, b, |x, y| x & y)
    }
    #[inline(always)]
    fn or(self, a: Ia, b: Ia) -> Ia {
        zip(a, b, |x, y| x | y)
    }
    #[inline(always)]
    fn iadd(self, a: Ia, b: Ia) -> Ia {
        zip(a, b, u32::wrapping_add)
    }
    #[inline(always)]
    fn isub(self, a: Ia, b: Ia) -> Ia {
        zip(a, b, u32::wrapping_sub)
    }
    #[inline(always)]
    fn shl<const N: u32>(self, a: Ia) -> Ia {
        map(a, |x| x << N)
    }
    #[inline(always)]
    fn shr<const N: u32>(self, a: Ia) -> Ia {
        map(a, |x| x >> N)
    }
    #[inline(always)]
    fn umax(self, a: Ia, b: Ia) -> Ia {
        zip(a, b, u32::max)
    }
    #[inline(always)]
    fn ord(self, a: Fa) -> u16 {
        bitmask(|i| !a[i].is_nan())
    }
    #[inline(always)]
    fn ult(self, a: Ia, b: Ia) -> u16 {
        bitmask(|i| a[i] < b[i])
    }
    #[inline(always)]
    fn any(self, m: u16) -> bool {
        m != 0
    }
    #[inline(always)]
    fn iselect(self, m: u16, a: Ia, b: Ia) -> Ia {
        std::array::from_fn(|i| if m >> i & 1 != 0 { a[i] } else { b[i] })
    }
    #[inline(always)]
    fn keep(self, n: usize, a: Fa) -> Fa {
        std::array::from_fn(|i| if i < n { a[i] } else { 0.0 })
    }
    #[inline(always)]
    fn f16_to_f32(self, i: Ia) -> Fa {
        map(i, |x| {
            if x & 0x7c00 == 0x7c00 && x & 0x3ff != 0 {
                // NaN as `vcvtph2ps` gives it: quieted, payload kept.
                f32::from_bits((x & 0x8000) << 16 | 0x7fc0_0000 | (x & 0x3ff) << 13)
            } else {
                half::f16::from_bits(x as u16).to_f32()
            }
        })
    }
    #[inline(always)]
    fn f32_to_f16(self, a: Fa) -> Ia {
        map(a, |x| {
            if x.is_nan() {
                // As `vcvtps2ph`: quieted, the payload's top bits kept.
                let b = x.to_bits();
                (b >> 16 & 0x8000) | 0x7e00 | (b >> 13 & 0x3ff)
            } else {
                half::f16::from_f32(x).to_bits() as u32
            }
        })
    }
    #[inline(always)]
    fn max16(self, x: &[Fa; W]) -> Fa {
        std::array::from_fn(|j| x[j].iter().fold(0f32, |m, &v| if v > m { v } else { m }))
    }

    #[inline(always)]
    unsafe fn load_f32(self, p: *const f32, n: usize) -> Fa {
        std::array::from_fn(|i| if i < n { *p.add(i) } else { 0.0 })
    }
    #[inline(always)]
    unsafe fn store_f32(self, p: *mut f32, n: usize, a: Fa) {
        for (i, &x) in a.iter().enumerate().take(n) {
            *p.add(i) = x;
        }
    }
    #[inline(always)]
    unsafe fn load_u16(self, p: *const u16, n: usize) -> Ia {
        std::array::from_fn(|i| if i < n { *p.add(i) as u32 } else { 0 })
    }
    #[inline(always)]
    unsafe fn store_u16(self, p: *mut u16, n: usize, a: Ia) {
        for (i, &x) in a.iter().enumerate().take(n) {
            *p.add(i) = x as u16;
        }
    }
    #[inline(always)]
    unsafe fn load_i8(self, p: *const i8, n: usize) -> Ia {
        std::array::from_fn(|i| if i < n { *p.add(i) as i32 as u32 } else { 0 })
    }
    #[inline(always)]
    unsafe fn load_u8(self, p: *const u8, n: usize) -> Ia {
        std::array::from_fn(|i| if i < n { *p.add(i) as u32 } else { 0 })
    }
    #[inline(always)]
    unsafe fn load_i16(self, p: *const i16, n: usize) -> Ia {
        std::array::from_fn(|i| if i < n { *p.add(i) as i32 as u32 } else { 0 })
    }
    #[inline(always)]
    unsafe fn store_i8_sat(self, p: *mut i8, n: usize, a: Ia) {
        for (i, &x) in a.iter().enumerate().take(n) {
            *p.add(i) = (x as i32).clamp(-128, 127) as i8;
        }
    }
    #[inline(always)]
    unsafe fn store_u8_sat(self, p: *mut u8, n: usize, a: Ia) {
        for (i, &x) in a.iter().enumerate().take(n) {
            *p.add(i) = x.min(255) as u8;
        }
    }
    #[inline(always)]
    unsafe fn store_i16_sat(self, p: *mut i16, n: usize, a: Ia) {
        for (i, &x) in a.iter().enumerate().take(n) {
            *p.add(i) = (x as i32).clamp(-32768, 32767) as i16;
        }
    }
}

/// An integral f32 as i32; out of range or NaN as x86's "integer indefinite".
#[inline(always)]
fn to_i32(f: f32) -> u32 {
    // The comparisons are false for NaN.
    if (-2147483648.0..2147483648.0).contains(&f) {
        f as i32 as u32
    } else {
        0x8000_0000
    }
}
