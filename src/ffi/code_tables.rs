//! Every named integer of the C ABI, in the order `fo.h` lists them: the core's code
//! tables (`code_table!`), and here the ones only the ABI has (options fields with no core
//! enum, sentinels, limits, the ABI version). `src/ffi/codes.rs` is generated from
//! `SECTIONS`: cbindgen copies literals and expands no macros, so the header's constants
//! must be spelled out in the source, and the test below writes them from these tables
//! (`FO_BLESS=1 cargo test --lib ffi::code_tables` rewrites the file; the test fails while
//! it is stale). The generated file is the only other place a code appears.
// The tables that only the generator reads are unused outside the tests.
#![cfg_attr(not(test), allow(dead_code))]
use super::status::Status;
use crate::codes::{CodeRow, CodeTable};
use crate::comm::ReduceOp;
use crate::dtype::DType;
use crate::optim::{Algorithm, Arithmetic, StateFormat};

const fn row(code: i32, name: &'static str, c_doc: &'static str) -> CodeRow {
    CodeRow { code, name, c_doc }
}

const fn table(
    c_prefix: &'static str,
    c_type: &'static str,
    c_doc: &'static str,
    rows: &'static [CodeRow],
) -> CodeTable {
    CodeTable {
        c_prefix,
        c_type,
        c_doc,
        rows,
    }
}

const DEVICE: CodeTable = table(
    "FO_DEVICE_",
    "i32",
    "`fo_tensor.device` ",
    &[row(
        crate::device::HOST,
        "host",
        "for host memory (a value >= 0 is a CUDA ordinal).",
    )],
);

/// `fo_pack_options.mode` (`ckpt::Mode`).
pub(super) const PACK_MODE: CodeTable = table(
    "FO_PACK_MODE_",
    "i32",
    "`fo_pack_options.mode`: ",
    &[
        row(
            0,
            "compressed",
            "FlashOptim's layout (int8/uint8 codes, fp16 scales, error bits).",
        ),
        row(1, "portable", "dequantized f32 state (what torch loads)."),
    ],
);

/// `fo_pack_options.params` (none, or a `ckpt::ParamsAs`).
pub(super) const PACK_PARAMS: CodeTable = table(
    "FO_PACK_PARAMS_",
    "i32",
    "`fo_pack_options.params`: ",
    &[
        row(0, "none", "optimizer state only."),
        row(
            1,
            "stored",
            "also the params under their plain FQN, as stored.",
        ),
        row(
            2,
            "master",
            "also the params as f32 masters (param + error bits).",
        ),
    ],
);

const WRITE_UNSHARDED: CodeTable = table(
    "FO_WRITE_UNSHARDED_",
    "i32",
    "`fo_pack_options.write_unsharded`: ",
    &[row(
        -1,
        "rank0",
        "rank 0 writes the unsharded entries (0 or 1 say\nwhether this rank does).",
    )],
);

/// `fo_convert_options.to` (keep, or a `ckpt::convert::Format`).
pub(super) const CONVERT_FORMAT: CodeTable = table(
    "FO_CONVERT_FORMAT_",
    "i32",
    "`fo_convert_options.to`: ",
    &[
        row(0, "keep", "the moments keep SRC's format."),
        row(1, "portable", "f32 moments (what torch loads)."),
        row(
            2,
            "compressed",
            "quant8 moments (int8/uint8 codes + fp16 scales per 32 elements).",
        ),
    ],
);

/// `fo_broadcast_options.strategy` (`broadcast::Strategy`).
pub(super) const BROADCAST_STRATEGY: CodeTable = table(
    "FO_BROADCAST_STRATEGY_",
    "i32",
    "`fo_broadcast_options.strategy`: ",
    &[
        row(0, "scatter", "each rank receives only its shard."),
        row(
            1,
            "full_broadcast",
            "every rank receives every full tensor.",
        ),
    ],
);

// The limits are the core's own constants, so each number stays written once.
const MAX_DIMS: CodeTable = table(
    "FO_MAX_",
    "usize",
    "",
    &[row(
        crate::tensor::MAX_DIMS as i32,
        "dims",
        "Most tensor or mesh dims fo accepts.",
    )],
);

const MAX_COUNTS: CodeTable = table(
    "FO_MAX_",
    "i32",
    "",
    &[
        row(
            crate::optim::threads::MAX_THREADS as i32,
            "threads",
            "Most threads `fo_set_num_threads` accepts.",
        ),
        row(
            crate::comm::MAX_LOCAL_WORLD as i32,
            "local_world",
            "Most ranks of an in-process group (`fo_comm_create_local_group`).",
        ),
        row(
            crate::ckpt::save::commit::MAX_WORLD_SIZE as i32,
            "world_size",
            "Most ranks of one checkpoint (`fo_pack_options.world_size`).",
        ),
    ],
);

/// Bumped on every breaking change of the ABI.
const ABI_VERSION: CodeTable = table(
    "FO_ABI_",
    "u32",
    "The ABI version this header describes; compare with `fo_abi_version()` at load time.",
    &[row(2, "version", "")],
);

/// `fo_placement.kind` (`shard::Placement`, whose variants carry a dim).
pub(super) const PLACEMENT: CodeTable = table(
    "FO_PLACEMENT_",
    "i32",
    "",
    &[
        row(0, "replicate", ""),
        row(1, "shard", ""),
        row(2, "strided_shard", ""),
        row(3, "partial", ""),
    ],
);

/// Every table, in the order of `src/ffi/codes.rs` and hence of `fo.h`.
pub(super) const SECTIONS: [CodeTable; 16] = [
    DType::C_CODES,
    DEVICE,
    Algorithm::C_CODES,
    StateFormat::C_CODES,
    Arithmetic::C_CODES,
    PACK_MODE,
    PACK_PARAMS,
    WRITE_UNSHARDED,
    CONVERT_FORMAT,
    BROADCAST_STRATEGY,
    MAX_DIMS,
    MAX_COUNTS,
    ABI_VERSION,
    PLACEMENT,
    ReduceOp::C_CODES,
    Status::C_CODES,
];

#[cfg(test)]
mod tests {
    use super::*;

    const PATH: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/src/ffi/codes.rs");

    const PREAMBLE: &str = "\
//! The named integer codes of the C ABI (`fo_tensor.dtype`, `fo_optim_config.algorithm`,
//! the status codes, the limits, ...), one `#define` each in `fo.h`.
//!
//! GENERATED by `ffi::code_tables` from the code tables -- do not edit. Each code is
//! written once, in its table (`code_table!` in `dtype.rs`, `optim/math/config.rs`,
//! `comm/mod.rs`, `ffi/status.rs`; the ABI-only ones in `ffi/code_tables.rs`); it is repeated
//! here as a literal because cbindgen reads literals, not macros. After changing a table:
//! `FO_BLESS=1 cargo test --lib ffi::code_tables`, `FO_BLESS=1 cargo test --test header`,
//! `python3 scripts/gen_py_codes.py`.
use super::status::fo_status;
";

    /// A literal as the header has always shown it: large powers of two as shifts.
    fn literal(code: i32) -> String {
        if code >= 1 << 16 && code.count_ones() == 1 {
            format!("1 << {}", code.trailing_zeros())
        } else {
            code.to_string()
        }
    }

    fn render() -> String {
        let mut out = String::from(PREAMBLE);
        for t in SECTIONS {
            out.push('\n');
            for r in t.rows {
                let doc = format!("{}{}", t.c_doc, r.c_doc);
                for line in doc.lines() {
                    out.push_str(&format!("/// {line}\n"));
                }
                let (name, ty, lit) = (t.c_name(r), t.c_type, literal(r.code));
                out.push_str(&format!("pub const {name}: {ty} = {lit};\n"));
            }
        }
        out
    }

    #[test]
    fn committed_codes_match_the_tables() {
        let generated = render();
        if std::env::var_os("FO_BLESS").is_some() {
            std::fs::write(PATH, &generated).expect("write src/ffi/codes.rs");
            return;
        }
        let committed = std::fs::read_to_string(PATH).unwrap_or_default();
        assert!(
            committed == generated,
            "src/ffi/codes.rs is stale: a code table changed. Run \
             `FO_BLESS=1 cargo test --lib ffi::code_tables`, then \
             `FO_BLESS=1 cargo test --test header`, and commit both files"
        );
    }

    #[test]
    fn every_constant_has_one_name_and_each_table_distinct_codes() {
        let mut names = Vec::new();
        for t in SECTIONS {
            names.extend(t.rows.iter().map(|r| t.c_name(r)));
            if t.c_prefix == "FO_MAX_" {
                continue; // limits, not codes: two may be equal
            }
            let mut codes: Vec<i32> = t.rows.iter().map(|r| r.code).collect();
            codes.sort();
            codes.dedup();
            assert_eq!(codes.len(), t.rows.len(), "{}", t.c_prefix);
        }
        let n = names.len();
        names.sort();
        names.dedup();
        assert_eq!(names.len(), n);
    }
}
