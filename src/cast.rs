//! Converting a tensor's elements to another dtype, under fo's rules:
//! - f32, bf16, f16 and f64 convert in any direction, rounding to nearest even
//!   (from f64, through f32);
//! - float8 values are never converted implicitly;
//! - any conversion touching an integer or bool dtype needs the caller's opt-in; then
//!   floats truncate toward zero, and a value the target cannot hold is an error.
use half::{bf16, f16};

use crate::dtype::DType;
use crate::error::{Error, Result};

fn is_wide_float(d: DType) -> bool {
    matches!(d, DType::F32 | DType::F16 | DType::BF16 | DType::F64)
}

/// Whether `src` values may be written into a `dst` tensor; the error says why not.
pub fn check(src: DType, dst: DType, allow_int_float_cast: bool) -> Result<()> {
    if src == dst || (is_wide_float(src) && is_wide_float(dst)) {
        return Ok(());
    }
    if src.is_float8() || dst.is_float8() {
        return Err(Error::Dtype(format!(
            "{src} -> {dst}: float8 values are never converted implicitly"
        )));
    }
    if !allow_int_float_cast {
        return Err(Error::Dtype(format!(
            "{src} -> {dst}: conversions involving integer or bool dtypes need allow_int_float_cast"
        )));
    }
    Ok(())
}

enum Value {
    F(f64),
    I(i128),
}

fn read(d: DType, b: &[u8]) -> Value {
    match d {
        DType::F32 => Value::F(f32::from_le_bytes(b.try_into().unwrap()) as f64),
        DType::F64 => Value::F(f64::from_le_bytes(b.try_into().unwrap())),
        DType::BF16 => Value::F(bf16::from_le_bytes([b[0], b[1]]).to_f64()),
        DType::F16 => Value::F(f16::from_le_bytes([b[0], b[1]]).to_f64()),
        DType::I8 => Value::I(b[0] as i8 as i128),
        DType::U8 => Value::I(b[0] as i128),
        DType::Bool => Value::I((b[0] != 0) as i128),
        DType::I16 => Value::I(i16::from_le_bytes([b[0], b[1]]) as i128),
        DType::I32 => Value::I(i32::from_le_bytes(b.try_into().unwrap()) as i128),
        DType::I64 => Value::I(i64::from_le_bytes(b.try_into().unwrap()) as i128),
        DType::F8E4M3 | DType::F8E5M2 => unreachable!("float8 is only ever copied"),
    }
}

fn write(d: DType, v: Value, out: &mut Vec<u8>) -> std::result::Result<(), String> {
    let int = |v: Value, lo: i128, hi: i128| -> std::result::Result<i128, String> {
        let i = match v {
            Value::I(i) => i,
            Value::F(f) if f.is_finite() && f.trunc() >= lo as f64 && f.trunc() <= hi as f64 => {
                f.trunc() as i128
            }
            Value::F(f) => return Err(format!("{f} does not fit {d}")),
        };
        if i < lo || i > hi {
            return Err(format!("{i} does not fit {d}"));
        }
        Ok(i)
    };
    let float = |v: Value| match v {
        Value::F(f) => f,
        Value::I(i) => i as f64,
    };
    match d {
        DType::F64 => out.extend(float(v).to_le_bytes()),
        DType::F32 => out.extend((float(v) as f32).to_le_bytes()),
        DType::BF16 => out.extend(bf16::from_f32(float(v) as f32).to_le_bytes()),
        DType::F16 => out.extend(f16::from_f32(float(v) as f32).to_le_bytes()),
        DType::Bool => out.push(match v {
            Value::I(i) => (i != 0) as u8,
            Value::F(f) => (f != 0.0) as u8,
        }),
        DType::I8 => out.push(int(v, i8::MIN as i128, i8::MAX as i128)? as i8 as u8),
        DType::U8 => out.push(int(v, 0, u8::MAX as i128)? as u8),
        DType::I16 => {
            out.extend((int(v, i16::MIN as i128, i16::MAX as i128)? as i16).to_le_bytes())
        }
        DType::I32 => {
            out.extend((int(v, i32::MIN as i128, i32::MAX as i128)? as i32).to_le_bytes())
        }
        DType::I64 => {
            out.extend((int(v, i64::MIN as i128, i64::MAX as i128)? as i64).to_le_bytes())
        }
        DType::F8E4M3 | DType::F8E5M2 => unreachable!("float8 is only ever copied"),
    }
    Ok(())
}

/// `bytes` (row-major `src` elements) as `dst` elements. Call `check` first; `what`
/// names the tensor in a value error.
pub fn cast(bytes: Vec<u8>, src: DType, dst: DType, what: &str) -> Result<Vec<u8>> {
    if src == dst {
        return Ok(bytes);
    }
    let n = bytes.len() / src.size();
    let mut out = Vec::with_capacity(n * dst.size());
    for (i, b) in bytes.chunks_exact(src.size()).enumerate() {
        write(dst, read(src, b), &mut out)
            .map_err(|m| Error::Numerics(format!("{what}: element {i} ({src} -> {dst}): {m}")))?;
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn f32s(v: &[f32]) -> Vec<u8> {
        v.iter().flat_map(|x| x.to_le_bytes()).collect()
    }

    #[test]
    fn f32_to_bf16_and_f16_round_to_nearest_even() {
        // 1 + 2^-8 is halfway between two bf16 values: ties go to the even mantissa (1.0).
        let vals = [
            1.0 + 2f32.powi(-8),
            1.0 + 3.0 * 2f32.powi(-8),
            -3.3e-5,
            65504.0,
            1e30,
        ];
        let b = cast(f32s(&vals), DType::F32, DType::BF16, "t").unwrap();
        let want: Vec<u8> = vals
            .iter()
            .flat_map(|&x| bf16::from_f32(x).to_le_bytes())
            .collect();
        assert_eq!(b, want);
        assert_eq!(bf16::from_le_bytes([b[0], b[1]]).to_f32(), 1.0);
        let h = cast(f32s(&vals), DType::F32, DType::F16, "t").unwrap();
        let want: Vec<u8> = vals
            .iter()
            .flat_map(|&x| f16::from_f32(x).to_le_bytes())
            .collect();
        assert_eq!(h, want);
        // bf16 -> f16 -> f32 of a small value goes through the exact f32 path.
        let back = cast(
            cast(b, DType::BF16, DType::F16, "t").unwrap(),
            DType::F16,
            DType::F32,
            "t",
        )
        .unwrap();
        assert_eq!(back.len(), 20);
    }

    #[test]
    fn float8_never_converts_and_integers_need_opt_in() {
        let e = check(DType::F8E4M3, DType::BF16, true).unwrap_err();
        assert!(e.to_string().contains("float8"), "{e}");
        assert!(check(DType::F8E5M2, DType::F8E5M2, false).is_ok());
        let e = check(DType::I64, DType::F32, false).unwrap_err();
        assert!(e.to_string().contains("allow_int_float_cast"), "{e}");
        assert!(check(DType::I64, DType::F32, true).is_ok());
        assert!(check(DType::BF16, DType::F64, false).is_ok());
    }

    #[test]
    fn opted_in_integer_casts_truncate_and_refuse_what_does_not_fit() {
        let out = cast(f32s(&[2.9, -2.9]), DType::F32, DType::I32, "step").unwrap();
        assert_eq!(
            out,
            [2i32, -2]
                .iter()
                .flat_map(|x| x.to_le_bytes())
                .collect::<Vec<u8>>()
        );
        let e = cast(f32s(&[300.0]), DType::F32, DType::U8, "step").unwrap_err();
        assert!(
            e.to_string().contains("step") && e.to_string().contains("U8"),
            "{e}"
        );
        assert!(cast(f32s(&[f32::NAN]), DType::F32, DType::I64, "s").is_err());
        let i: Vec<u8> = 7i64.to_le_bytes().to_vec();
        assert_eq!(
            cast(i, DType::I64, DType::F32, "s").unwrap(),
            7f32.to_le_bytes().to_vec()
        );
    }
}
