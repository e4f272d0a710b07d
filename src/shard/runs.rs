//! Sets of global indices along one tensor dim, kept as sorted disjoint runs so a shard
//! of a 64M-row tensor costs a few ranges, not 64M integers.
use std::ops::Range;

use crate::error::{Error, Result};

/// `torch.chunk` along a list of length `len` into `n` pieces: piece `r` is
/// `[min(len, c*r), min(len, c*(r+1)))` with `c = ceil(len/n)`; trailing pieces may be empty.
pub fn chunk_range(len: usize, n: usize, r: usize) -> Range<usize> {
    let c = len.div_ceil(n);
    let start = len.min(c.saturating_mul(r));
    let end = len.min(c.saturating_mul(r + 1));
    start..end
}

/// FSDP2's padded shard size: every rank's shard is padded to `ceil(len/world)` rows.
/// A world of 0 ranks is an error naming `world` (not a division by zero).
pub fn padded_shard_size(len: usize, world: usize) -> Result<usize> {
    if world == 0 {
        return Err(Error::invalid("world", "must be >= 1, got 0"));
    }
    Ok(len.div_ceil(world))
}

/// Sorted, disjoint, non-empty runs of global indices, in local storage order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Runs(pub Vec<Range<usize>>);

impl Runs {
    #[allow(clippy::single_range_in_vec_init)] // one run: the whole dim
    pub fn full(len: usize) -> Runs {
        Runs(if len == 0 { vec![] } else { vec![0..len] })
    }

    pub fn len(&self) -> usize {
        self.0.iter().map(|r| r.len()).sum()
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// The indices at local positions `pos` (positions in the concatenated list).
    pub fn slice(&self, pos: Range<usize>) -> Runs {
        let mut out = Vec::new();
        let mut base = 0;
        for r in &self.0 {
            let (lo, hi) = (base, base + r.len());
            let s = pos.start.max(lo);
            let e = pos.end.min(hi);
            if s < e {
                push_merged(&mut out, r.start + (s - lo)..r.start + (e - lo));
            }
            base = hi;
            if base >= pos.end {
                break;
            }
        }
        Runs(out)
    }

    /// `Shard` along a mesh dim of size `n`, at coordinate `r`.
    pub fn shard(&self, n: usize, r: usize) -> Runs {
        self.slice(chunk_range(self.len(), n, r))
    }

    /// `_StridedShard` with `split_factor` along a mesh dim of size `n`, at coordinate `r`.
    pub fn strided_shard(&self, split_factor: usize, n: usize, r: usize) -> Runs {
        let len = self.len();
        let mut out = Vec::new();
        // Pieces past the first `len` are empty (`chunk_range` gives them `len..len`), so
        // the work is O(min(split_factor, len)) whatever the factor.
        for j in 0..split_factor.min(len) {
            let piece = chunk_range(len, split_factor, j);
            let mine = chunk_range(piece.len(), n, r);
            for run in self
                .slice(piece.start + mine.start..piece.start + mine.end)
                .0
            {
                push_merged(&mut out, run);
            }
        }
        Runs(out)
    }

    pub fn first(&self) -> Option<usize> {
        self.0.first().map(|r| r.start)
    }

    /// The runs' indices, ascending, into `out` (which must hold `len()` entries); unlike
    /// `to_vec` this allocates nothing, so a caller's buffer bounds the work.
    pub fn write_into(&self, out: &mut [i64]) {
        for (o, i) in out.iter_mut().zip(self.0.iter().flat_map(|r| r.clone())) {
            *o = i as i64;
        }
    }

    pub fn to_vec(&self) -> Vec<usize> {
        self.0.iter().flat_map(|r| r.clone()).collect()
    }
}

fn push_merged(out: &mut Vec<Range<usize>>, run: Range<usize>) {
    match out.last_mut() {
        Some(last) if last.end == run.start => last.end = run.end,
        _ => out.push(run),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunk_range_follows_torch_chunk() {
        // torch.chunk(arange(10), 4) -> sizes 3,3,3,1
        let sizes: Vec<usize> = (0..4).map(|r| chunk_range(10, 4, r).len()).collect();
        assert_eq!(sizes, vec![3, 3, 3, 1]);
        // torch.chunk(arange(6), 4) -> sizes 2,2,2 and an empty fourth
        let sizes: Vec<usize> = (0..4).map(|r| chunk_range(6, 4, r).len()).collect();
        assert_eq!(sizes, vec![2, 2, 2, 0]);
        assert_eq!(chunk_range(0, 3, 1), 0..0);
        assert_eq!(padded_shard_size(10, 4).unwrap(), 3);
        assert_eq!(padded_shard_size(0, 4).unwrap(), 0);
        let e = padded_shard_size(10, 0).unwrap_err();
        assert_eq!(
            e.to_string(),
            "invalid argument `world`: must be >= 1, got 0"
        );
    }

    #[test]
    fn slice_spans_runs_and_merges_neighbours() {
        let r = Runs(vec![0..3, 5..8]);
        assert_eq!(r.slice(2..5).0, vec![2..3, 5..7]);
        assert_eq!(Runs(vec![0..3, 3..5]).slice(0..5).0, vec![0..5]);
        let mut out = vec![];
        push_merged(&mut out, 0..2);
        push_merged(&mut out, 2..4);
        assert_eq!(out, vec![0..4]);
    }

    #[test]
    fn strided_shard_takes_a_chunk_of_every_piece() {
        // 10 rows, split_factor 2 -> pieces [0,5) [5,10); 2 ranks -> rank 1 holds [3,5) and [8,10)
        let r = Runs::full(10).strided_shard(2, 2, 1);
        assert_eq!(r.to_vec(), vec![3, 4, 8, 9]);
        assert_eq!(r.0.len(), 2);
    }

    #[test]
    fn a_split_factor_far_beyond_the_length_costs_only_the_length() {
        // 3 rows, split factor i32::MAX: pieces 0..3 hold one row each, the rest are empty.
        let r = Runs::full(3).strided_shard(i32::MAX as usize, 2, 0);
        assert_eq!(r.to_vec(), vec![0, 1, 2]);
        assert!(Runs::full(3)
            .strided_shard(i32::MAX as usize, 2, 1)
            .is_empty());
    }
}
