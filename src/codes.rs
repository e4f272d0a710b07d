//! The integer codes that cross the C ABI, each written once. `code_table!` declares an
//! enum from rows of (variant, code, name, C doc) and derives everything else from them:
//! `code`, `from_code`, `name`, `Display`, and the `C_CODES` table that the C constants
//! (`src/ffi/codes.rs`, hence `fo.h` and Python's `_codes.py`) are generated from.
//!
//! Why generated rather than derived at compile time: cbindgen reads the source without
//! expanding macros, so the header's constants must be literal in the source. The
//! generator (`ffi::code_tables`) writes them from these tables and fails while the
//! committed file differs.

/// One code of a table.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CodeRow {
    pub code: i32,
    /// The Rust side's name (`name()`, messages, checkpoint metadata); the C constant is
    /// the table's prefix followed by this name in upper case.
    pub name: &'static str,
    /// The C constant's doc comment after the table's doc prefix; `\n` breaks lines.
    pub c_doc: &'static str,
}

/// The C side of a set of codes: one `pub const` per row in `src/ffi/codes.rs`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CodeTable {
    /// `FO_ALGORITHM_`: a row's constant is this prefix + its name in upper case.
    pub c_prefix: &'static str,
    /// The Rust type of the constants (`i32`, `fo_status`, `usize`, ...).
    pub c_type: &'static str,
    /// Starts every row's doc comment (the field the codes are for); empty for none.
    pub c_doc: &'static str,
    pub rows: &'static [CodeRow],
}

impl CodeTable {
    /// The C constant's name for a row: `FO_ALGORITHM_` + `ADAMW`.
    pub fn c_name(&self, row: &CodeRow) -> String {
        format!("{}{}", self.c_prefix, row.name.to_ascii_uppercase())
    }

    /// The valid codes with their names, for messages: `0 = exact, 1 = fast`.
    pub fn valid(&self) -> String {
        let rows = self.rows.iter().map(|r| format!("{} = {}", r.code, r.name));
        rows.collect::<Vec<_>>().join(", ")
    }

    /// The valid names, for messages: `exact, fast`.
    pub fn names(&self) -> String {
        let names: Vec<&str> = self.rows.iter().map(|r| r.name).collect();
        names.join(", ")
    }
}

/// Declares an enum whose variants are C codes, from one row per variant:
///
/// ```ignore
/// code_table! {
///     /// The enum's doc.
///     #[derive(Debug, Clone, Copy, PartialEq, Eq)]
///     pub enum Arithmetic {
///         noun = "arithmetic", c_prefix = "FO_ARITHMETIC_", c_type = i32,
///         c_doc = "`fo_optim_config.arithmetic`: ";
///         /// The variant's doc.
///         Exact = 0, "exact", "FlashOptim's operations, bit-exact (the default).";
///         Fast = 1, "fast", "reformulated for speed, within a stated bound of exact.";
///     }
/// }
/// ```
///
/// and derives `ALL` (row order), `C_CODES`, `code`, `name`, `name_c` (NUL-terminated),
/// `by_code`, `by_name`, `from_code` (an invalid-argument error listing the valid codes)
/// and `Display` (the name). A code or name given twice is an unreachable match arm,
/// which `-D warnings` rejects.
macro_rules! code_table {
    (
        $(#[$meta:meta])*
        $vis:vis enum $ty:ident {
            noun = $noun:literal, c_prefix = $prefix:literal, c_type = $cty:ident,
            c_doc = $cdoc:literal;
            $(
                $(#[$vmeta:meta])*
                $v:ident = $code:literal, $name:literal, $vcdoc:literal;
            )+
        }
    ) => {
        $(#[$meta])*
        $vis enum $ty {
            $( $(#[$vmeta])* $v, )+
        }

        impl $ty {
            /// Every variant, in the table's order (the codes' order).
            pub const ALL: [$ty; [$($name),+].len()] = [$($ty::$v),+];

            /// The table itself: what the C constants are generated from.
            pub const C_CODES: $crate::codes::CodeTable = $crate::codes::CodeTable {
                c_prefix: $prefix,
                c_type: stringify!($cty),
                c_doc: $cdoc,
                rows: &[$($crate::codes::CodeRow { code: $code, name: $name, c_doc: $vcdoc }),+],
            };

            /// The C code.
            pub fn code(self) -> i32 {
                match self {
                    $($ty::$v => $code,)+
                }
            }

            /// The name (messages, metadata; the C constant's suffix in upper case).
            pub fn name(self) -> &'static str {
                match self {
                    $($ty::$v => $name,)+
                }
            }

            /// The name as a static C string.
            pub fn name_c(self) -> &'static std::ffi::CStr {
                let s: &'static str = match self {
                    $($ty::$v => concat!($name, "\0"),)+
                };
                std::ffi::CStr::from_bytes_with_nul(s.as_bytes()).expect("one NUL, at the end")
            }

            pub fn by_code(code: i32) -> Option<$ty> {
                match code {
                    $($code => Some($ty::$v),)+
                    _ => None,
                }
            }

            pub fn by_name(name: &str) -> Option<$ty> {
                match name {
                    $($name => Some($ty::$v),)+
                    _ => None,
                }
            }

            /// The variant for a C code; `what` names the argument in the error.
            pub fn from_code(code: i32, what: &str) -> $crate::error::Result<$ty> {
                $ty::by_code(code).ok_or_else(|| {
                    $crate::error::Error::invalid(
                        what,
                        format!(
                            "unknown {} code {code} (valid: {})",
                            $noun,
                            $ty::C_CODES.valid()
                        ),
                    )
                })
            }
        }

        impl std::fmt::Display for $ty {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str(self.name())
            }
        }
    };
}
pub(crate) use code_table;

#[cfg(test)]
mod tests {
    code_table! {
        /// A table for the tests.
        #[derive(Debug, Clone, Copy, PartialEq, Eq)]
        pub enum Color {
            noun = "color", c_prefix = "FO_COLOR_", c_type = i32, c_doc = "`x.color`: ";
            Red = 0, "red", "red.";
            DeepBlue = 2, "deep_blue", "two lines\nof doc.";
        }
    }

    #[test]
    fn rows_give_codes_names_and_constants() {
        assert_eq!(Color::ALL, [Color::Red, Color::DeepBlue]);
        assert_eq!(Color::DeepBlue.code(), 2);
        assert_eq!(Color::by_code(2), Some(Color::DeepBlue));
        assert_eq!(Color::by_code(1), None);
        assert_eq!(Color::by_name("red"), Some(Color::Red));
        assert_eq!(Color::DeepBlue.to_string(), "deep_blue");
        assert_eq!(Color::Red.name_c().to_bytes(), b"red");
        let t = Color::C_CODES;
        assert_eq!(t.c_name(&t.rows[1]), "FO_COLOR_DEEP_BLUE");
        assert_eq!(
            (t.c_type, t.valid()),
            ("i32", "0 = red, 2 = deep_blue".into())
        );
    }

    #[test]
    fn unknown_code_names_the_argument_and_the_valid_codes() {
        let e = Color::from_code(7, "opts.color").unwrap_err().to_string();
        assert_eq!(
            e,
            "invalid argument `opts.color`: unknown color code 7 (valid: 0 = red, 2 = deep_blue)"
        );
    }
}
