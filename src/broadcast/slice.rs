//! Cutting one mesh coordinate's shard out of a full row-major tensor.
use crate::shard::ShardSpec;
use crate::tensor::contiguous_strides;

/// The shard's elements in local row-major order, read from `full` (the row-major bytes
/// of a tensor of `spec.global_shape()`, `esize` bytes per element). Trailing dims the
/// shard holds whole are copied as one block per run.
pub fn gather_shard(full: &[u8], esize: usize, spec: &ShardSpec) -> Vec<u8> {
    let shape = spec.global_shape();
    let local_numel = spec.local_numel();
    let mut out = Vec::with_capacity(local_numel * esize);
    if local_numel == 0 {
        return out;
    }
    let runs: Vec<_> = (0..shape.len()).map(|d| spec.dim_runs(d)).collect();
    // `j`: the last dim the shard does not hold whole; dims after it form one block.
    let Some(j) = (0..shape.len()).rev().find(|&d| runs[d].len() != shape[d]) else {
        out.extend_from_slice(full);
        return out;
    };
    let strides = contiguous_strides(shape);
    let block = esize * strides[j];
    let outer: Vec<Vec<usize>> = (0..j).map(|d| runs[d].to_vec()).collect();
    let mut pick = vec![0usize; j];
    loop {
        let base: usize = (0..j)
            .map(|d| outer[d][pick[d]] * strides[d])
            .sum::<usize>()
            * esize;
        for run in &runs[j].0 {
            let start = base + run.start * block;
            out.extend_from_slice(&full[start..start + run.len() * block]);
        }
        // Advance the odometer over the outer dims.
        let mut d = j;
        loop {
            if d == 0 {
                return out;
            }
            d -= 1;
            pick[d] += 1;
            if pick[d] < outer[d].len() {
                break;
            }
            pick[d] = 0;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::shard::Placement::*;

    #[test]
    fn strided_rows_and_sharded_columns_come_out_in_local_order() {
        // 4x3 tensor of bytes 0..12; rank (1, 1) of a 2x2 mesh, rows _StridedShard(0, 2), cols Shard(1).
        let full: Vec<u8> = (0..12).collect();
        let pl = vec![
            StridedShard {
                dim: 0,
                split_factor: 2,
            },
            Shard(1),
        ];
        let spec = ShardSpec::new(vec![4, 3], vec![2, 2], vec![1, 1], pl).unwrap();
        // rows {1, 3}, cols {2}
        assert_eq!(gather_shard(&full, 1, &spec), vec![5, 11]);
        let whole = ShardSpec::unsharded(vec![4, 3]).unwrap();
        assert_eq!(gather_shard(&full, 1, &whole), full);
        let empty = ShardSpec::new(vec![1, 3], vec![2], vec![1], vec![Shard(0)]).unwrap();
        assert!(gather_shard(&full[..3], 1, &empty).is_empty());
    }
}
