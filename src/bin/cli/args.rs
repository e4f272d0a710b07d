//! Value types shared by several commands' flags.
use std::fmt::Display;
use std::str::FromStr;

/// A comma-separated list in one argument (`--shape 10,7`); an empty string is an empty
/// list (a 0-dim shape).
#[derive(Debug, Clone, PartialEq)]
pub struct Csv<T>(pub Vec<T>);

impl<T: FromStr> FromStr for Csv<T>
where
    T::Err: Display,
{
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        if s.trim().is_empty() {
            return Ok(Csv(vec![]));
        }
        s.split(',')
            .map(|x| {
                x.trim()
                    .parse::<T>()
                    .map_err(|e| format!("{:?}: {e}", x.trim()))
            })
            .collect::<Result<_, _>>()
            .map(Csv)
    }
}

/// An element count with an optional K or M suffix (`16M` = 16 * 2^20).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Count(pub usize);

impl FromStr for Count {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        let s = s.trim();
        let (num, mul) = match s.chars().last() {
            Some('M' | 'm') => (&s[..s.len() - 1], 1 << 20),
            Some('K' | 'k') => (&s[..s.len() - 1], 1 << 10),
            _ => (s, 1),
        };
        num.parse::<usize>()
            .map(|n| Count(n * mul))
            .map_err(|_| "expected a count like 4096, 64K or 16M".to_string())
    }
}
