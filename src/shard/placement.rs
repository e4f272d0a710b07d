//! One mesh dim's DTensor placement, its CLI spelling and the grouped-weight shift.
use crate::error::{Error, Result};
use crate::tensor::MAX_DIMS;

/// How a tensor is laid out along one mesh dim: torch's DTensor placements.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Placement {
    /// Every coordinate along this mesh dim holds the same data.
    Replicate,
    /// `Shard(dim)`: tensor dim `dim` is split with `torch.chunk` semantics.
    Shard(usize),
    /// `_StridedShard(dim, split_factor)`: what FSDP2 produces on top of tensor parallel.
    /// The current index list is chunked into `split_factor` pieces, each piece into the
    /// mesh dim's size, and a coordinate takes its chunk of every piece.
    StridedShard { dim: usize, split_factor: usize },
    /// A pending reduction. For layout purposes it holds the full tensor, like Replicate.
    Partial,
}

impl Placement {
    /// The tensor dim this placement splits, if any.
    pub fn shard_dim(&self) -> Option<usize> {
        match *self {
            Placement::Shard(d) | Placement::StridedShard { dim: d, .. } => Some(d),
            Placement::Replicate | Placement::Partial => None,
        }
    }

    /// The grouped-weight shift: a placement written for a 2-D `(out, in)` weight,
    /// applied to the stacked `(num_gemms, out, in)` tensor, splits one dim later. The
    /// stacked tensor has one more dim, so a shifted dim must stay below `MAX_DIMS`
    /// (an error naming `dim` otherwise).
    pub fn shifted_for_grouped(&self) -> Result<Placement> {
        self.shifted_named("dim")
    }

    fn shifted_named(&self, name: &str) -> Result<Placement> {
        if let Some(d) = self.shard_dim() {
            if d + 1 >= MAX_DIMS {
                return Err(Error::invalid(
                    name,
                    format!(
                        "{d}: the stacked tensor's dim {} would exceed FO_MAX_DIMS",
                        d + 1
                    ),
                ));
            }
        }
        Ok(match *self {
            Placement::Shard(d) => Placement::Shard(d + 1),
            Placement::StridedShard { dim, split_factor } => Placement::StridedShard {
                dim: dim + 1,
                split_factor,
            },
            other => other,
        })
    }
}

/// Every placement of a weight shifted for its grouped (stacked) form; a bad one is
/// named `placements[i].dim`, as `ShardSpec::new` names its placements.
pub fn grouped_placements(placements: &[Placement]) -> Result<Vec<Placement>> {
    placements
        .iter()
        .enumerate()
        .map(|(i, p)| p.shifted_named(&format!("placements[{i}].dim")))
        .collect()
}

/// `R`, `P`, `S<dim>` and `SS<dim>:<split_factor>`: the compact spelling the CLI uses.
impl std::str::FromStr for Placement {
    type Err = Error;

    fn from_str(s: &str) -> Result<Placement> {
        let bad = || {
            Error::invalid(
                "placement",
                format!("{s:?} is not one of R, P, S<dim>, SS<dim>:<split_factor>"),
            )
        };
        let t = s.trim();
        match t {
            "R" => return Ok(Placement::Replicate),
            "P" => return Ok(Placement::Partial),
            _ => {}
        }
        if let Some(rest) = t.strip_prefix("SS") {
            let (d, sf) = rest.split_once(':').ok_or_else(bad)?;
            let dim = d.parse().map_err(|_| bad())?;
            let split_factor = sf.parse().map_err(|_| bad())?;
            return Ok(Placement::StridedShard { dim, split_factor });
        }
        if let Some(rest) = t.strip_prefix('S') {
            return Ok(Placement::Shard(rest.parse().map_err(|_| bad())?));
        }
        Err(bad())
    }
}

/// Torch's spelling: `Replicate()`, `Shard(dim=0)`, `_StridedShard(dim=0, sf=3)`, `Partial()`.
impl std::fmt::Display for Placement {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Placement::Replicate => write!(f, "Replicate()"),
            Placement::Shard(d) => write!(f, "Shard(dim={d})"),
            Placement::StridedShard { dim, split_factor } => {
                write!(f, "_StridedShard(dim={dim}, sf={split_factor})")
            }
            Placement::Partial => write!(f, "Partial()"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_the_cli_spelling() {
        assert_eq!("R".parse::<Placement>().unwrap(), Placement::Replicate);
        assert_eq!("P".parse::<Placement>().unwrap(), Placement::Partial);
        assert_eq!("S1".parse::<Placement>().unwrap(), Placement::Shard(1));
        assert_eq!(
            "SS0:3".parse::<Placement>().unwrap(),
            Placement::StridedShard {
                dim: 0,
                split_factor: 3
            }
        );
        let e = "S".parse::<Placement>().unwrap_err();
        assert!(e.to_string().contains("\"S\""), "{e}");
        assert!("SS0".parse::<Placement>().is_err());
        assert!("X2".parse::<Placement>().is_err());
    }

    #[test]
    fn grouped_shift_moves_shard_dims_only() {
        assert_eq!(
            Placement::Shard(0).shifted_for_grouped().unwrap(),
            Placement::Shard(1)
        );
        assert_eq!(
            Placement::StridedShard {
                dim: 1,
                split_factor: 2
            }
            .shifted_for_grouped()
            .unwrap(),
            Placement::StridedShard {
                dim: 2,
                split_factor: 2
            }
        );
        assert_eq!(
            Placement::Replicate.shifted_for_grouped().unwrap(),
            Placement::Replicate
        );
    }

    #[test]
    fn a_shift_past_max_dims_is_refused() {
        let last = Placement::Shard(MAX_DIMS - 1);
        let e = last.shifted_for_grouped().unwrap_err();
        assert!(e.to_string().starts_with("invalid argument `dim`"), "{e}");
        let e = grouped_placements(&[Placement::Replicate, last]).unwrap_err();
        assert_eq!(
            e.to_string(),
            "invalid argument `placements[1].dim`: 7: the stacked tensor's dim 8 would exceed FO_MAX_DIMS"
        );
        assert!(grouped_placements(&[Placement::Shard(MAX_DIMS - 2)]).is_ok());
    }

    #[test]
    fn displays_torch_names() {
        assert_eq!(
            Placement::StridedShard {
                dim: 0,
                split_factor: 3
            }
            .to_string(),
            "_StridedShard(dim=0, sf=3)"
        );
        assert_eq!(Placement::Shard(2).to_string(), "Shard(dim=2)");
    }
}
