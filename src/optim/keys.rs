//! Optimizer state key names, the one owner: the state names as torch and FlashOptim
//! spell them, the `<name>::<part>` spelling of a compressed pair, and the helpers that
//! build and split those keys.
//!
//! The optimizer's own state keys (`fo_optimizer_get_state`) and a checkpoint's
//! (`state.<fqn>.<name>`, `ckpt::naming`, which re-exports these) use the same names, so
//! they live here, below the checkpoints. Python takes these strings from
//! `python/fo/_codes.py`, which `scripts/gen_py_codes.py` generates from this file's and
//! `ckpt/format/naming.rs`'s `pub const ..: &str` items.

/// Separator between a state name and its compressed part (`exp_avg::quantized`).
pub const PART_SEPARATOR: &str = "::";
/// The raw part names after [`PART_SEPARATOR`] (`exp_avg::quantized`, `exp_avg::scales`).
pub const CODES_PART: &str = "quantized";
pub const SCALES_PART: &str = "scales";
/// Suffix of a compressed pair's codes key ([`PART_SEPARATOR`] + [`CODES_PART`]).
pub const CODES_SUFFIX: &str = "::quantized";
/// Suffix of a compressed pair's scales key ([`PART_SEPARATOR`] + [`SCALES_PART`]).
pub const SCALES_SUFFIX: &str = "::scales";

/// State names, as torch and FlashOptim spell them.
pub const STEP: &str = "step";
pub const EXP_AVG: &str = "exp_avg";
pub const EXP_AVG_SQ: &str = "exp_avg_sq";
pub const MOMENTUM_BUFFER: &str = "momentum_buffer";
/// The low bits of a bf16/f16 param's f32 master weight (int8 or int16).
pub const ERROR_BITS: &str = "error_bits";
/// The f32 master weight (the param completed by its error bits); never saved as state.
pub const MASTER: &str = "master";

/// A compressed part of a state key.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Part {
    /// int8 (momentum) or uint8 (variance) codes.
    Codes,
    /// fp16 scales, one per group.
    Scales,
}

/// The codes key of compressed `base` (`state.w.exp_avg` -> `state.w.exp_avg::quantized`).
pub fn codes_key(base: &str) -> String {
    format!("{base}{CODES_SUFFIX}")
}

/// The scales key of compressed `base`.
pub fn scales_key(base: &str) -> String {
    format!("{base}{SCALES_SUFFIX}")
}

/// The key of `part` of compressed `base`.
pub fn part_key(base: &str, part: Part) -> String {
    match part {
        Part::Codes => codes_key(base),
        Part::Scales => scales_key(base),
    }
}

/// `(base, part)` of a compressed part's key, None for any other key.
pub fn split_part(key: &str) -> Option<(&str, Part)> {
    key.strip_suffix(CODES_SUFFIX)
        .map(|b| (b, Part::Codes))
        .or_else(|| key.strip_suffix(SCALES_SUFFIX).map(|b| (b, Part::Scales)))
}

/// `(name, raw)` of an optimizer state key: `exp_avg::scales` -> `("exp_avg", Some("scales"))`,
/// `step` -> `("step", None)`.
pub fn split_state_name(key: &str) -> (&str, Option<&str>) {
    key.split_once(PART_SEPARATOR)
        .map_or((key, None), |(n, r)| (n, Some(r)))
}

/// The raw part name of `part` (`quantized` / `scales`), as [`split_state_name`] gives it.
pub fn part_name(part: Part) -> &'static str {
    match part {
        Part::Codes => CODES_PART,
        Part::Scales => SCALES_PART,
    }
}

/// Whether the moment state `name` is quantized signed (momentum: int8 softsign) or
/// unsigned (variance: uint8 sqrt); None: `name` is no moment.
pub fn moment_signed(name: &str) -> Option<bool> {
    match name {
        EXP_AVG | MOMENTUM_BUFFER => Some(true),
        EXP_AVG_SQ => Some(false),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn state_names_split_and_pair_suffixes_agree() {
        for part in [Part::Codes, Part::Scales] {
            let key = part_key(EXP_AVG, part);
            assert_eq!(split_part(&key), Some((EXP_AVG, part)));
            assert_eq!(split_state_name(&key), (EXP_AVG, Some(part_name(part))));
        }
        assert_eq!(split_part(EXP_AVG), None);
        assert_eq!(split_state_name(STEP), (STEP, None));
        assert_eq!(CODES_SUFFIX, format!("{PART_SEPARATOR}{CODES_PART}"));
        assert_eq!(SCALES_SUFFIX, format!("{PART_SEPARATOR}{SCALES_PART}"));
        assert_eq!(moment_signed(EXP_AVG_SQ), Some(false));
        assert_eq!(moment_signed(MOMENTUM_BUFFER), Some(true));
        assert_eq!(moment_signed("w.exp_avg"), None);
        assert_eq!(moment_signed(STEP), None);
    }
}
