//! The named integer codes a C caller passes or gets back (`fo_tensor.dtype`,
//! `fo_optim_config.algorithm`, ...), one `#define` each in `fo.h`.
//!
//! cbindgen copies a constant's literal, so each value is written here once more than in
//! the core enum it names; the tests below tie the two together (an exhaustive match per
//! enum: a new variant without a constant does not compile, a changed value fails).
//! Placement kinds, reduce ops and status codes live beside their structs (`types.rs`,
//! `comm.rs`, `status.rs`).

/// `fo_tensor.dtype`: 32-bit float.
pub const FO_DTYPE_F32: i32 = 0;
/// `fo_tensor.dtype`: IEEE half.
pub const FO_DTYPE_F16: i32 = 1;
/// `fo_tensor.dtype`: bfloat16.
pub const FO_DTYPE_BF16: i32 = 2;
/// `fo_tensor.dtype`: 64-bit float.
pub const FO_DTYPE_F64: i32 = 3;
/// `fo_tensor.dtype`: signed 8-bit integer.
pub const FO_DTYPE_I8: i32 = 4;
/// `fo_tensor.dtype`: unsigned 8-bit integer.
pub const FO_DTYPE_U8: i32 = 5;
/// `fo_tensor.dtype`: signed 16-bit integer.
pub const FO_DTYPE_I16: i32 = 6;
/// `fo_tensor.dtype`: signed 32-bit integer.
pub const FO_DTYPE_I32: i32 = 7;
/// `fo_tensor.dtype`: signed 64-bit integer.
pub const FO_DTYPE_I64: i32 = 8;
/// `fo_tensor.dtype`: bool, one byte (0 or 1).
pub const FO_DTYPE_BOOL: i32 = 9;
/// `fo_tensor.dtype`: float8 e4m3 (torch `float8_e4m3fn`).
pub const FO_DTYPE_F8_E4M3: i32 = 10;
/// `fo_tensor.dtype`: float8 e5m2 (torch `float8_e5m2`).
pub const FO_DTYPE_F8_E5M2: i32 = 11;

/// `fo_tensor.device` for host memory (a value >= 0 is a CUDA ordinal).
pub const FO_DEVICE_HOST: i32 = -1;

/// `fo_optim_config.algorithm`: Adam with decoupled weight decay.
pub const FO_ALGORITHM_ADAMW: i32 = 0;
/// `fo_optim_config.algorithm`: Adam with L2 weight decay (torch `Adam(weight_decay=)`).
pub const FO_ALGORITHM_ADAM: i32 = 1;
/// `fo_optim_config.algorithm`: SGD with momentum, dampening, Nesterov; L2 weight decay.
pub const FO_ALGORITHM_SGD: i32 = 2;
/// `fo_optim_config.algorithm`: SGD with decoupled weight decay.
pub const FO_ALGORITHM_SGDW: i32 = 3;
/// `fo_optim_config.algorithm`: Lion, decoupled weight decay.
pub const FO_ALGORITHM_LION: i32 = 4;

/// `fo_optim_config.state_format`: f32 state, torch.optim's arithmetic.
pub const FO_STATE_FORMAT_FP32: i32 = 0;
/// `fo_optim_config.state_format`: state in the parameter's dtype.
pub const FO_STATE_FORMAT_PARAM_DTYPE: i32 = 1;
/// `fo_optim_config.state_format`: FlashOptim 0.1.4's 8-bit grouped state, bit-exact.
pub const FO_STATE_FORMAT_QUANT8: i32 = 2;
/// `fo_optim_config.state_format`: fo's 8-bit variant (variance by its fourth root).
pub const FO_STATE_FORMAT_QUANT8_WIDE: i32 = 3;

/// `fo_optim_config.arithmetic`: FlashOptim's operations, bit-exact (the default).
pub const FO_ARITHMETIC_EXACT: i32 = 0;
/// `fo_optim_config.arithmetic`: reformulated for speed, within a stated bound of exact.
pub const FO_ARITHMETIC_FAST: i32 = 1;

/// `fo_pack_options.mode`: FlashOptim's layout (int8/uint8 codes, fp16 scales, error bits).
pub const FO_PACK_MODE_COMPRESSED: i32 = 0;
/// `fo_pack_options.mode`: dequantized f32 state (what torch loads).
pub const FO_PACK_MODE_PORTABLE: i32 = 1;

/// `fo_pack_options.params`: optimizer state only.
pub const FO_PACK_PARAMS_NONE: i32 = 0;
/// `fo_pack_options.params`: also the params under their plain FQN, as stored.
pub const FO_PACK_PARAMS_STORED: i32 = 1;
/// `fo_pack_options.params`: also the params as f32 masters (param + error bits).
pub const FO_PACK_PARAMS_MASTER: i32 = 2;

/// `fo_pack_options.write_unsharded`: rank 0 writes the unsharded entries (0 or 1 say
/// whether this rank does).
pub const FO_WRITE_UNSHARDED_RANK0: i32 = -1;

/// `fo_convert_options.to`: the moments keep SRC's format.
pub const FO_CONVERT_FORMAT_KEEP: i32 = 0;
/// `fo_convert_options.to`: f32 moments (what torch loads).
pub const FO_CONVERT_FORMAT_PORTABLE: i32 = 1;
/// `fo_convert_options.to`: quant8 moments (int8/uint8 codes + fp16 scales per 32 elements).
pub const FO_CONVERT_FORMAT_COMPRESSED: i32 = 2;

/// `fo_broadcast_options.strategy`: each rank receives only its shard.
pub const FO_BROADCAST_STRATEGY_SCATTER: i32 = 0;
/// `fo_broadcast_options.strategy`: every rank receives every full tensor.
pub const FO_BROADCAST_STRATEGY_FULL_BROADCAST: i32 = 1;

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dtype::DType;
    use crate::optim::{Algorithm, Arithmetic, StateFormat};

    // One exhaustive match per core enum: adding a variant breaks the build here until
    // it has a constant.
    fn dtype(d: DType) -> i32 {
        match d {
            DType::F32 => FO_DTYPE_F32,
            DType::F16 => FO_DTYPE_F16,
            DType::BF16 => FO_DTYPE_BF16,
            DType::F64 => FO_DTYPE_F64,
            DType::I8 => FO_DTYPE_I8,
            DType::U8 => FO_DTYPE_U8,
            DType::I16 => FO_DTYPE_I16,
            DType::I32 => FO_DTYPE_I32,
            DType::I64 => FO_DTYPE_I64,
            DType::Bool => FO_DTYPE_BOOL,
            DType::F8E4M3 => FO_DTYPE_F8_E4M3,
            DType::F8E5M2 => FO_DTYPE_F8_E5M2,
        }
    }

    fn algorithm(a: Algorithm) -> i32 {
        match a {
            Algorithm::AdamW => FO_ALGORITHM_ADAMW,
            Algorithm::Adam => FO_ALGORITHM_ADAM,
            Algorithm::Sgd => FO_ALGORITHM_SGD,
            Algorithm::SgdW => FO_ALGORITHM_SGDW,
            Algorithm::Lion => FO_ALGORITHM_LION,
        }
    }

    fn state_format(s: StateFormat) -> i32 {
        match s {
            StateFormat::Fp32 => FO_STATE_FORMAT_FP32,
            StateFormat::ParamDtype => FO_STATE_FORMAT_PARAM_DTYPE,
            StateFormat::Quant8 => FO_STATE_FORMAT_QUANT8,
            StateFormat::Quant8Wide => FO_STATE_FORMAT_QUANT8_WIDE,
        }
    }

    fn arithmetic(a: Arithmetic) -> i32 {
        match a {
            Arithmetic::Exact => FO_ARITHMETIC_EXACT,
            Arithmetic::Fast => FO_ARITHMETIC_FAST,
        }
    }

    #[test]
    fn dtype_constants_are_the_core_codes() {
        for d in DType::ALL {
            assert_eq!(dtype(d), d.code(), "{d}");
            assert_eq!(DType::from_code(dtype(d), "dtype").unwrap(), d);
        }
        assert!(DType::from_code(FO_DTYPE_F8_E5M2 + 1, "dtype").is_err());
    }

    #[test]
    fn optimizer_constants_are_the_core_codes() {
        for a in Algorithm::ALL {
            assert_eq!(algorithm(a), a.code(), "{}", a.name());
            assert_eq!(Algorithm::from_code(algorithm(a)).unwrap(), a);
        }
        assert!(Algorithm::from_code(FO_ALGORITHM_LION + 1).is_err());
        let formats = [
            StateFormat::Fp32,
            StateFormat::ParamDtype,
            StateFormat::Quant8,
            StateFormat::Quant8Wide,
        ];
        for s in formats {
            assert_eq!(state_format(s), s.code(), "{}", s.name());
            assert_eq!(StateFormat::from_code(state_format(s)).unwrap(), s);
        }
        assert!(StateFormat::from_code(FO_STATE_FORMAT_QUANT8_WIDE + 1).is_err());
        for a in [Arithmetic::Exact, Arithmetic::Fast] {
            assert_eq!(arithmetic(a), a.code(), "{}", a.name());
            assert_eq!(Arithmetic::from_code(arithmetic(a)).unwrap(), a);
        }
        assert!(Arithmetic::from_code(FO_ARITHMETIC_FAST + 1).is_err());
    }
}
