//! Overlap arithmetic: which elements of a saved box land where in a destination box.
//! Both boxes live inside row-major storage (a saved chunk is its own storage; a
//! destination chunk sits at some offset inside the local tensor), and runs are
//! coalesced across trailing dims that both storages hold whole, so a same-sharding load
//! is one run per chunk and a dim-0 reshard one run per overlap.
use crate::shard::{Chunk, ShardSpec};
use crate::tensor::{contiguous_strides, Tensor};

/// A box of a global tensor and where it sits in its row-major storage.
#[derive(Debug, Clone, Copy)]
pub(crate) struct BoxIn<'a> {
    pub(crate) global_offset: &'a [usize],
    pub(crate) shape: &'a [usize],
    pub(crate) storage_shape: &'a [usize],
    pub(crate) storage_offset: &'a [usize],
}

impl<'a> BoxIn<'a> {
    /// A shard's chunk, inside the local tensor of shape `storage_shape` that holds it.
    pub(crate) fn of_chunk(c: &'a Chunk, storage_shape: &'a [usize]) -> BoxIn<'a> {
        BoxIn {
            global_offset: &c.global_offset,
            shape: &c.shape,
            storage_shape,
            storage_offset: &c.local_offset,
        }
    }
}

/// `len` consecutive elements from storage position `src` to storage position `dst`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Run {
    pub(crate) src: usize,
    pub(crate) dst: usize,
    pub(crate) len: usize,
}

/// The runs copying the overlap of `src` into `dst` (empty when they do not meet).
pub(crate) fn overlap_runs(src: &BoxIn, dst: &BoxIn) -> Vec<Run> {
    let nd = src.shape.len();
    if nd == 0 {
        return vec![Run {
            src: 0,
            dst: 0,
            len: 1,
        }];
    }
    let mut lo = vec![0; nd];
    let mut ext = vec![0; nd];
    for d in 0..nd {
        let l = src.global_offset[d].max(dst.global_offset[d]);
        let h = (src.global_offset[d] + src.shape[d]).min(dst.global_offset[d] + dst.shape[d]);
        if l >= h {
            return vec![];
        }
        lo[d] = l;
        ext[d] = h - l;
    }
    let spos: Vec<usize> = (0..nd)
        .map(|d| lo[d] - src.global_offset[d] + src.storage_offset[d])
        .collect();
    let dpos: Vec<usize> = (0..nd)
        .map(|d| lo[d] - dst.global_offset[d] + dst.storage_offset[d])
        .collect();
    let (ss, ds) = (
        contiguous_strides(src.storage_shape),
        contiguous_strides(dst.storage_shape),
    );
    // Merge dims k..nd-1 into one run while the dims after k are held whole by both.
    let mut k = nd - 1;
    let mut len = ext[k];
    while k > 0 && ext[k] == src.storage_shape[k] && ext[k] == dst.storage_shape[k] {
        k -= 1;
        len *= ext[k];
    }
    let outer: usize = ext[..k].iter().product();
    let mut out = Vec::with_capacity(outer);
    let mut idx = vec![0usize; k];
    for _ in 0..outer {
        let (mut s, mut t) = (spos[k] * ss[k], dpos[k] * ds[k]);
        for d in 0..k {
            s += (spos[d] + idx[d]) * ss[d];
            t += (dpos[d] + idx[d]) * ds[d];
        }
        out.push(Run {
            src: s,
            dst: t,
            len,
        });
        for d in (0..k).rev() {
            idx[d] += 1;
            if idx[d] < ext[d] {
                break;
            }
            idx[d] = 0;
        }
    }
    out
}

/// The local shard `spec` describes, cut out of a full tensor (what a rank holds; used to
/// build in-process ranks in tests and benchmarks).
pub fn local_shard(global: &Tensor, spec: &ShardSpec) -> Tensor {
    let local_shape = spec.local_shape();
    let mut out = Tensor::zeros(global.dtype, local_shape.clone());
    let es = global.dtype.size();
    let zeros = vec![0; global.shape.len()];
    let src = BoxIn {
        global_offset: &zeros,
        shape: &global.shape,
        storage_shape: &global.shape,
        storage_offset: &zeros,
    };
    for c in spec.chunks() {
        let dst = BoxIn::of_chunk(&c, &local_shape);
        for r in overlap_runs(&src, &dst) {
            out.data[r.dst * es..(r.dst + r.len) * es]
                .copy_from_slice(&global.data[r.src * es..(r.src + r.len) * es]);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn b<'a>(go: &'a [usize], shape: &'a [usize], st: &'a [usize], so: &'a [usize]) -> BoxIn<'a> {
        BoxIn {
            global_offset: go,
            shape,
            storage_shape: st,
            storage_offset: so,
        }
    }

    /// `overlap_runs` as (src, dst, len) triples, to compare with a table.
    fn runs(src: &BoxIn, dst: &BoxIn) -> Vec<(usize, usize, usize)> {
        overlap_runs(src, dst)
            .into_iter()
            .map(|r| (r.src, r.dst, r.len))
            .collect()
    }

    #[test]
    fn same_box_is_one_run() {
        let r = runs(
            &b(&[4, 0], &[3, 7], &[3, 7], &[0, 0]),
            &b(&[4, 0], &[3, 7], &[3, 7], &[0, 0]),
        );
        assert_eq!(r, [(0, 0, 21)]);
    }

    #[test]
    fn column_split_gives_one_run_per_row() {
        // saved rows 0..2, all 4 columns; destination holds columns 1..3 of rows 0..4.
        let r = runs(
            &b(&[0, 0], &[2, 4], &[2, 4], &[0, 0]),
            &b(&[0, 1], &[4, 2], &[4, 2], &[0, 0]),
        );
        assert_eq!(r, [(1, 0, 2), (5, 2, 2)]);
    }

    #[test]
    fn disjoint_boxes_give_nothing_and_scalars_one_element() {
        assert!(runs(&b(&[0], &[3], &[3], &[0]), &b(&[3], &[2], &[2], &[0])).is_empty());
        assert_eq!(
            runs(&b(&[], &[], &[], &[]), &b(&[], &[], &[], &[])),
            [(0, 0, 1)]
        );
    }

    #[test]
    fn destination_box_inside_larger_storage() {
        // strided destination: its second box (global rows 8..10) sits at local rows 2..4.
        let r = runs(
            &b(&[5, 0], &[5, 2], &[5, 2], &[0, 0]),
            &b(&[8, 0], &[2, 2], &[4, 2], &[2, 0]),
        );
        assert_eq!(r, [(6, 4, 4)]);
    }
}
