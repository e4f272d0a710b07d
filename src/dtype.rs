//! Element types: what a tensor's bytes are (`F32`, `BF16`, ...), with the C codes of
//! `fo_tensor.dtype` and the names safetensors files use.
use crate::error::{Error, Result};

/// Element types, with the C codes of `fo_tensor.dtype` (part of the ABI).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum DType {
    F32,
    F16,
    BF16,
    F64,
    I8,
    U8,
    I16,
    I32,
    I64,
    Bool,
    F8E4M3,
    F8E5M2,
}

impl DType {
    pub const ALL: [DType; 12] = [
        DType::F32,
        DType::F16,
        DType::BF16,
        DType::F64,
        DType::I8,
        DType::U8,
        DType::I16,
        DType::I32,
        DType::I64,
        DType::Bool,
        DType::F8E4M3,
        DType::F8E5M2,
    ];

    /// The dtype for a C code; `what` names the argument in the error.
    pub fn from_code(code: i32, what: &str) -> Result<DType> {
        DType::ALL
            .iter()
            .copied()
            .find(|d| d.code() == code)
            .ok_or_else(|| {
                Error::invalid(what, format!("unknown dtype code {code} (valid: 0..=11)"))
            })
    }

    /// The C code (`fo_tensor.dtype`); the order of `ALL` is the ABI.
    pub fn code(self) -> i32 {
        DType::ALL.iter().position(|d| *d == self).unwrap() as i32
    }

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
        match self {
            DType::F32 => "F32",
            DType::F16 => "F16",
            DType::BF16 => "BF16",
            DType::F64 => "F64",
            DType::I8 => "I8",
            DType::U8 => "U8",
            DType::I16 => "I16",
            DType::I32 => "I32",
            DType::I64 => "I64",
            DType::Bool => "BOOL",
            DType::F8E4M3 => "F8_E4M3",
            DType::F8E5M2 => "F8_E5M2",
        }
    }

    pub fn from_safetensors_name(name: &str) -> Result<DType> {
        DType::ALL
            .iter()
            .copied()
            .find(|d| d.safetensors_name() == name)
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

impl std::fmt::Display for DType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.safetensors_name())
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
