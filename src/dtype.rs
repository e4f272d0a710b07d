//! Element types: what a tensor's bytes are (`F32`, `BF16`, ...), with the C codes of
//! `fo_tensor.dtype` and the names safetensors files use.
use crate::error::{Error, Result};

crate::codes::code_table! {
    /// Element types, with the C codes of `fo_tensor.dtype` (part of the ABI) and the
    /// names safetensors files use (`F32`, `BF16`, `F8_E4M3`: also the C constants' suffix).
    #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
    pub enum DType {
        noun = "dtype", c_prefix = "FO_DTYPE_", c_type = i32, c_doc = "`fo_tensor.dtype`: ";
        F32 = 0, "F32", "32-bit float.";
        F16 = 1, "F16", "IEEE half.";
        BF16 = 2, "BF16", "bfloat16.";
        F64 = 3, "F64", "64-bit float.";
        I8 = 4, "I8", "signed 8-bit integer.";
        U8 = 5, "U8", "unsigned 8-bit integer.";
        I16 = 6, "I16", "signed 16-bit integer.";
        I32 = 7, "I32", "signed 32-bit integer.";
        I64 = 8, "I64", "signed 64-bit integer.";
        Bool = 9, "BOOL", "bool, one byte (0 or 1).";
        F8E4M3 = 10, "F8_E4M3", "float8 e4m3 (torch `float8_e4m3fn`).";
        F8E5M2 = 11, "F8_E5M2", "float8 e5m2 (torch `float8_e5m2`).";
    }
}

impl DType {
    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            DType::F64 | DType::I64 => 8,
            DType::F32 | DType::I32 => 4,
            DType::F16 | DType::BF16 | DType::I16 => 2,
            DType::I8 | DType::U8 | DType::Bool | DType::F8E4M3 | DType::F8E5M2 => 1,
        }
    }

    /// The name safetensors uses in its header (`"F32"`, `"BF16"`, `"F8_E4M3"`, ...).
    pub fn safetensors_name(self) -> &'static str {
        self.name()
    }

    pub fn from_safetensors_name(name: &str) -> Result<DType> {
        DType::by_name(name)
            .ok_or_else(|| Error::Dtype(format!("unsupported safetensors dtype {name:?}")))
    }

    pub fn is_float(self) -> bool {
        matches!(
            self,
            DType::F32 | DType::F16 | DType::BF16 | DType::F64 | DType::F8E4M3 | DType::F8E5M2
        )
    }

    pub fn is_float8(self) -> bool {
        matches!(self, DType::F8E4M3 | DType::F8E5M2)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codes_round_trip_and_match_the_abi() {
        for d in DType::ALL {
            assert_eq!(DType::from_code(d.code(), "dtype").unwrap(), d);
            assert_eq!(
                DType::from_safetensors_name(d.safetensors_name()).unwrap(),
                d
            );
        }
        assert_eq!(DType::BF16.code(), 2);
        assert_eq!(DType::F8E5M2.code(), 11);
    }

    #[test]
    fn unknown_code_names_the_argument() {
        let e = DType::from_code(12, "grads[3].dtype").unwrap_err();
        assert!(e.to_string().contains("grads[3].dtype"), "{e}");
        assert!(e.to_string().contains("12"), "{e}");
    }
}
