//! Checkpoint naming, the one owner of checkpoint keys and files: the `state.` prefix of
//! state keys, the group size quant8 pairs use, and every file name in a checkpoint
//! directory. The state names and their quant8 pair suffixes are the optimizer's
//! (`optim::keys`), re-exported here so every checkpoint reader names them as before.
//!
//! Keys follow `torch.distributed.checkpoint` with `flatten_optimizer_state_dict=True`:
//! `state.<fqn>.<name>`; FlashOptim's compressed state is the pair `<key>::quantized`
//! (int8/uint8 codes) + `<key>::scales` (one fp16 scale per [`GROUP`] elements). The
//! optimizer's own state keys (`fo_optimizer_get_state`) use the same `<name>::<part>`
//! spelling. Python takes these strings from `python/fo/_codes.py`, which
//! `scripts/gen_py_codes.py` generates from this file's and `optim/keys.rs`'s
//! `pub const ..: &str` items.

/// Prefix of every optimizer-state key of a checkpoint (`state.<fqn>.<name>`).
pub const STATE_PREFIX: &str = "state.";
/// The optimizer's state names and the `<name>::<part>` spelling of a compressed pair:
/// the optimizer owns them (`optim::keys`), checkpoints name them as it does.
pub use crate::optim::keys::{
    codes_key, moment_signed, part_key, part_name, scales_key, split_part, split_state_name, Part,
    CODES_PART, CODES_SUFFIX, ERROR_BITS, EXP_AVG, EXP_AVG_SQ, MASTER, MOMENTUM_BUFFER,
    PART_SEPARATOR, SCALES_PART, SCALES_SUFFIX, STEP,
};

/// Elements per quant8 group (one fp16 scale per 32 consecutive elements of a rank's
/// flattened local tensor) and the scales count of `numel` elements: the codec's own
/// (`optim::math::quant8` owns the math), named here for every reader and writer.
pub use crate::optim::math::quant8::{num_groups, GROUP};

/// The file of a consolidated checkpoint (one full safetensors file).
pub const CONSOLIDATED_FILE: &str = "model-00001-of-00001.safetensors";
/// The index beside [`CONSOLIDATED_FILE`], as Hugging Face names it.
pub const INDEX_FILE: &str = "model.safetensors.index.json";
/// The record that commits a save (`save/commit.rs`).
pub const COMMIT_FILE: &str = "fo-commit.json";
/// Prefix of a save's staging directory inside the checkpoint directory (`save/commit.rs`).
pub const COMMIT_STAGE_PREFIX: &str = ".fo-stage-";
/// Marker inside the name of a file being written (`.<name>.tmp-<pid>...`).
pub const TMP_MARKER: &str = ".tmp-";

/// `state.<fqn>.<name>`.
pub fn state_key(fqn: &str, name: &str) -> String {
    format!("{STATE_PREFIX}{fqn}.{name}")
}

/// The file rank `rank` (0-based) writes, named as PyTorch's HuggingFace writer names it.
pub fn shard_file_name(rank: usize) -> String {
    format!("shard-{:05}-model-00001-of-00001.safetensors", rank + 1)
}

/// The 0-based rank of a shard file name, or None for any other name.
pub fn parse_shard_file_name(name: &str) -> Option<usize> {
    let n = name
        .strip_prefix("shard-")?
        .strip_suffix("-model-00001-of-00001.safetensors")?;
    if n.len() != 5 || !n.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    n.parse::<usize>().ok()?.checked_sub(1)
}

/// The file holding part `j` (of `num_parts`) of rank `rank`'s state. Part 0 is the rank
/// file ([`shard_file_name`]); a rank whose strided shard of some key is several boxes
/// stores box `j` in part `j`, named like a file of torch's HuggingFace writer, so every
/// file holds a key at most once and torch's reader sees the boxes as chunks of one key.
pub fn part_file_name(rank: usize, j: usize, num_parts: usize) -> String {
    if j == 0 {
        shard_file_name(rank)
    } else {
        format!(
            "shard-{:05}-model-{:05}-of-{:05}.safetensors",
            rank + 1,
            j + 1,
            num_parts
        )
    }
}

/// `(rank, j, num_parts)` of an extra part file name (`j >= 1`), or None for any other name.
pub fn parse_part_file_name(name: &str) -> Option<(usize, usize, usize)> {
    let rest = name.strip_prefix("shard-")?.strip_suffix(".safetensors")?;
    let num = |s: &str| {
        (s.len() == 5 && s.bytes().all(|b| b.is_ascii_digit()))
            .then(|| s.parse::<usize>().ok())
            .flatten()
    };
    let (r, rest) = rest.split_once("-model-")?;
    let (j, n) = rest.split_once("-of-")?;
    let (r, j, n) = (num(r)?.checked_sub(1)?, num(j)?.checked_sub(1)?, num(n)?);
    (j >= 1 && j < n).then_some((r, j, n))
}

/// The prefix of every temporary file written for `name` (`.<name>.tmp-`).
pub fn tmp_prefix(name: &str) -> String {
    format!(".{name}{TMP_MARKER}")
}

/// The staging directory of an output directory `name` written by `verb` (`convert`,
/// `consolidate`) in process `pid`, beside it: `.<name>.<verb>-<pid>`.
pub fn output_stage_name(name: &str, verb: &str, pid: u32) -> String {
    format!(".{name}.{verb}-{pid}")
}

/// The pid (as written) and whether it is a moved-aside old copy (`.old`), of a staging
/// directory name of output `name` and `verb`; None for any other name.
pub fn parse_output_stage_name<'a>(
    file: &'a str,
    name: &str,
    verb: &str,
) -> Option<(&'a str, bool)> {
    let rest = file.strip_prefix(&format!(".{name}.{verb}-"))?;
    Some(match rest.strip_suffix(".old") {
        Some(p) => (p, true),
        None => (rest, false),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_round_trip() {
        let base = state_key("layers.0.w", EXP_AVG);
        assert_eq!(base, "state.layers.0.w.exp_avg");
        assert_eq!(codes_key(&base), "state.layers.0.w.exp_avg::quantized");
        assert_eq!(scales_key(&base), "state.layers.0.w.exp_avg::scales");
        for part in [Part::Codes, Part::Scales] {
            assert_eq!(
                split_part(&part_key(&base, part)),
                Some((base.as_str(), part))
            );
        }
        assert_eq!(split_part(&base), None);
        // the state names themselves and their parts: optim::keys's own test
    }

    #[test]
    fn shard_file_names_round_trip() {
        assert_eq!(
            shard_file_name(0),
            "shard-00001-model-00001-of-00001.safetensors"
        );
        assert_eq!(part_file_name(0, 0, 3), shard_file_name(0));
        assert_eq!(
            part_file_name(1, 2, 3),
            "shard-00002-model-00003-of-00003.safetensors"
        );
        assert_eq!(
            parse_part_file_name(&part_file_name(1, 2, 3)),
            Some((1, 2, 3))
        );
        assert_eq!(parse_part_file_name(&shard_file_name(1)), None);
        assert_eq!(parse_shard_file_name(&part_file_name(1, 2, 3)), None);
        assert_eq!(parse_shard_file_name(&shard_file_name(41)), Some(41));
        assert_eq!(parse_shard_file_name("model.safetensors"), None);
        assert_eq!(
            parse_shard_file_name("shard-00000-model-00001-of-00001.safetensors"),
            None
        );
    }

    #[test]
    fn file_names_round_trip() {
        assert_eq!(
            shard_file_name(0),
            "shard-00001-model-00001-of-00001.safetensors"
        );
        assert_eq!(
            part_file_name(1, 2, 3),
            "shard-00002-model-00003-of-00003.safetensors"
        );
        assert_eq!(parse_shard_file_name(&shard_file_name(41)), Some(41));
        assert_eq!(
            parse_part_file_name(&part_file_name(1, 2, 3)),
            Some((1, 2, 3))
        );
        assert_eq!(parse_shard_file_name("model.safetensors"), None);
        let s = output_stage_name("out", "convert", 12);
        assert_eq!(s, ".out.convert-12");
        assert_eq!(
            parse_output_stage_name(&s, "out", "convert"),
            Some(("12", false))
        );
        let old = format!("{s}.old");
        assert_eq!(
            parse_output_stage_name(&old, "out", "convert"),
            Some(("12", true))
        );
        assert_eq!(parse_output_stage_name(&s, "out", "consolidate"), None);
        assert_eq!(tmp_prefix("a.safetensors"), ".a.safetensors.tmp-");
    }
}
