//! Value types shared by several commands' flags. Every bound is checked while clap
//! parses, so a value that cannot be honoured is a usage error (exit 2) naming the flag.
use std::fmt::Display;
use std::str::FromStr;

/// The most in-process ranks, threads or files of one converted checkpoint: what
/// `fo_comm_local_group` and the optimizer's thread pool accept.
pub const MAX_RANKS: usize = fo::comm::MAX_LOCAL_WORLD;

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

/// A list that must hold at least one value.
pub fn non_empty_csv<T: FromStr>(s: &str) -> Result<Csv<T>, String>
where
    T::Err: Display,
{
    let v: Csv<T> = s.parse()?;
    if v.0.is_empty() {
        return Err("needs at least one value".into());
    }
    Ok(v)
}

/// The largest element count a flag accepts: 2^50, far beyond any machine's memory (the
/// commands then say how much memory it would take), and small enough that every buffer
/// size derived from it fits in u64.
pub const MAX_COUNT: usize = 1 << 50;

/// An element count with an optional K or M suffix (`16M` = 16 * 2^20), 1..=2^50.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Count(pub usize);

impl FromStr for Count {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        let s = s.trim();
        let (num, mul) = match s.chars().last() {
            Some('M' | 'm') => (&s[..s.len() - 1], 1usize << 20),
            Some('K' | 'k') => (&s[..s.len() - 1], 1 << 10),
            _ => (s, 1),
        };
        let n = num
            .parse::<usize>()
            .map_err(|_| "expected a count like 4096, 64K or 16M".to_string())?;
        match n.checked_mul(mul) {
            Some(0) => Err("must be at least 1".into()),
            Some(c) if c <= MAX_COUNT => Ok(Count(c)),
            _ => Err(format!(
                "too large: at most {MAX_COUNT} ({}M)",
                MAX_COUNT >> 20
            )),
        }
    }
}

/// An integer in `LO..=HI` (thread counts in a list).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Bounded<const LO: usize, const HI: usize>(pub usize);

impl<const LO: usize, const HI: usize> FromStr for Bounded<LO, HI> {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        match s.trim().parse::<usize>() {
            Ok(n) if (LO..=HI).contains(&n) => Ok(Bounded(n)),
            _ => Err(format!("expected an integer in {LO}..={HI}")),
        }
    }
}

/// A finite number > 0 (NaN and infinities are refused).
pub fn positive_f64(s: &str) -> Result<f64, String> {
    match s.trim().parse::<f64>() {
        Ok(x) if x.is_finite() && x > 0.0 => Ok(x),
        Ok(_) => Err("must be a finite number > 0".into()),
        Err(e) => Err(e.to_string()),
    }
}

/// A finite number >= 0. Paired with `allow_negative_numbers`, so `--rtol -1` reaches
/// this check and is refused for its value instead of being taken for a flag.
pub fn non_negative_f64(s: &str) -> Result<f64, String> {
    match s.trim().parse::<f64>() {
        Ok(x) if x.is_finite() && x >= 0.0 => Ok(x),
        Ok(_) => Err("must be a finite number >= 0".into()),
        Err(e) => Err(e.to_string()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_refuse_zero_and_overflow() {
        assert_eq!("16M".parse::<Count>(), Ok(Count(16 << 20)));
        assert!("0".parse::<Count>().unwrap_err().contains("at least 1"));
        assert!("99999999999999M"
            .parse::<Count>()
            .unwrap_err()
            .contains("too large"));
        assert!("1073741825M".parse::<Count>().is_err());
        assert!("1073741824M".parse::<Count>().is_ok());
    }

    #[test]
    fn bounded_and_floats() {
        assert!("0".parse::<Bounded<1, 1024>>().is_err());
        assert_eq!("8".parse::<Bounded<1, 1024>>(), Ok(Bounded(8)));
        assert!(positive_f64("nan").is_err() && positive_f64("0").is_err());
        assert!(non_negative_f64("-1").unwrap_err().contains(">= 0"));
        assert_eq!(non_negative_f64("1e-3"), Ok(1e-3));
    }
}
