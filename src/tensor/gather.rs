//! A strided view's elements copied out row-major (`TensorView::to_tensor`): how a gradient
//! of any strides (a transposed weight's, a channels_last convolution's) becomes the
//! contiguous bytes the kernels read, at every step. Dims of size 1 are dropped and dims
//! that run on in memory merged, so most views become one or two dims; the last two are
//! copied in square tiles, so a transposed read touches each cache line once per tile
//! instead of once per element. (An fp32 AdamW step of 12 f32 1024 x 1024 parameters with
//! column-major gradients, one thread of the 2-vCPU development VM: 47 ms when each element's
//! offset was computed and copied alone, 16 ms now, against about 7 ms with row-major ones.)

/// Tile side in elements: 16 rows of 16 elements stay in L1 for any element size here.
const TILE: usize = 16;

/// Appends the view at `ptr` (`shape`, element `strides`, elements of `es` bytes) to `out`
/// in row-major order. `out` must have room for every element (its spare capacity).
///
/// # Safety
/// `ptr` must be valid for reads of every element the shape and strides address.
pub(super) unsafe fn gather(
    ptr: *const u8,
    shape: &[usize],
    strides: &[usize],
    es: usize,
    out: &mut Vec<u8>,
) {
    let n: usize = shape.iter().product();
    let start = out.len();
    assert!(
        out.capacity() - start >= n * es,
        "gather: no room for the view"
    );
    if n == 0 {
        return;
    }
    let dims = merged(shape, strides);
    let dst = out.as_mut_ptr().add(start);
    match es {
        1 => copy_dims::<u8>(ptr, &dims, dst),
        2 => copy_dims::<u16>(ptr, &dims, dst),
        4 => copy_dims::<u32>(ptr, &dims, dst),
        8 => copy_dims::<u64>(ptr, &dims, dst),
        _ => unreachable!("element sizes are 1, 2, 4 or 8 bytes"),
    }
    out.set_len(start + n * es);
}

/// `(size, stride)` per dim, outermost first, without dims of size 1 and with each dim
/// merged into the one outside it where the outer one's stride is the inner one's extent
/// (they walk memory as one dim). At least one dim (`(1, 0)` for a single element).
fn merged(shape: &[usize], strides: &[usize]) -> Vec<(usize, usize)> {
    let mut dims: Vec<(usize, usize)> = Vec::with_capacity(shape.len());
    for (&n, &s) in shape.iter().zip(strides).filter(|(&n, _)| n != 1) {
        match dims.last_mut() {
            Some(last) if last.1 == s * n => *last = (last.0 * n, s),
            _ => dims.push((n, s)),
        }
    }
    if dims.is_empty() {
        dims.push((1, 0));
    }
    dims
}

/// Copies the view described by `dims` (non-empty, no zero size) into `dst`, row-major:
/// the dims before the last two by an odometer, the last two in tiles.
unsafe fn copy_dims<T: Copy>(src: *const u8, dims: &[(usize, usize)], dst: *mut u8) {
    let src = src as *const T;
    let mut dst = dst as *mut T;
    let k = dims.len();
    if k == 1 {
        let (n, s) = dims[0];
        copy_rows::<T>(src, (1, 0), (n, s), dst);
        return;
    }
    let (outer, last2) = dims.split_at(k - 2);
    let (rows, cols) = (last2[0], last2[1]);
    let per = rows.0 * cols.0;
    let mut idx = vec![0usize; outer.len()];
    loop {
        let base: usize = idx.iter().zip(outer).map(|(i, d)| i * d.1).sum();
        copy_rows::<T>(src.add(base), rows, cols, dst);
        dst = dst.add(per);
        // the next outer index, outermost last to change; done when it wraps
        let mut d = outer.len();
        loop {
            if d == 0 {
                return;
            }
            d -= 1;
            idx[d] += 1;
            if idx[d] < outer[d].0 {
                break;
            }
            idx[d] = 0;
        }
    }
}

/// One 2-D block: `rows` (count, stride) of `cols` (count, stride) elements into `dst`,
/// `rows.0 * cols.0` elements row-major. Unit-stride rows are copied whole; others in
/// `TILE` x `TILE` tiles, so reading down a column reuses each line fetched.
unsafe fn copy_rows<T: Copy>(
    src: *const T,
    rows: (usize, usize),
    cols: (usize, usize),
    dst: *mut T,
) {
    let ((nr, sr), (nc, sc)) = (rows, cols);
    if sc == 1 {
        for i in 0..nr {
            std::ptr::copy_nonoverlapping(src.add(i * sr), dst.add(i * nc), nc);
        }
        return;
    }
    for i0 in (0..nr).step_by(TILE) {
        let i1 = (i0 + TILE).min(nr);
        for j0 in (0..nc).step_by(TILE) {
            let j1 = (j0 + TILE).min(nc);
            for i in i0..i1 {
                let (s, d) = (src.add(i * sr), dst.add(i * nc));
                for j in j0..j1 {
                    d.add(j).write_unaligned(s.add(j * sc).read_unaligned());
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Row-major reference: each element's offset from its index, one at a time.
    fn reference(src: &[u8], shape: &[usize], strides: &[usize], es: usize) -> Vec<u8> {
        let n: usize = shape.iter().product();
        let mut out = Vec::with_capacity(n * es);
        for flat in 0..n {
            let (mut rest, mut off) = (flat, 0);
            for (d, &sz) in shape.iter().enumerate().rev() {
                off += (rest % sz) * strides[d];
                rest /= sz;
            }
            out.extend_from_slice(&src[off * es..(off + 1) * es]);
        }
        out
    }

    fn check(shape: &[usize], strides: &[usize], es: usize) {
        let n: usize = shape.iter().product();
        let span = if n == 0 {
            0
        } else {
            shape
                .iter()
                .zip(strides)
                .map(|(&s, &t)| (s - 1) * t)
                .sum::<usize>()
                + 1
        };
        let src: Vec<u8> = (0..span * es).map(|i| (i * 7 + i / 251) as u8).collect();
        let mut out = Vec::with_capacity(n * es + 3);
        out.extend_from_slice(&[9, 9, 9]); // appended after what is there
        unsafe { gather(src.as_ptr(), shape, strides, es, &mut out) };
        assert_eq!(&out[..3], &[9, 9, 9]);
        assert_eq!(
            out[3..],
            reference(&src, shape, strides, es)[..],
            "{shape:?} {strides:?} es {es}"
        );
    }

    #[test]
    fn every_layout_comes_out_row_major() {
        for es in [1, 2, 4, 8] {
            check(&[37, 53], &[1, 37], es); // a transpose, tiles with short edges
            check(&[5, 7, 3, 3], &[63, 1, 21, 7], es); // channels_last
            check(&[4, 6], &[12, 2], es); // every other element of every other row
            check(&[3, 1, 17], &[17, 5, 1], es); // a size-1 dim with any stride
            check(&[2, 3, 4], &[12, 4, 1], es); // contiguous: one merged dim
            check(&[6, 5], &[0, 1], es); // broadcast rows (stride 0)
            check(&[3, 4, 33, 2], &[1, 3, 24, 12 * 66], es); // four dims, none in order
            check(&[1, 1], &[4, 9], es); // a single element
            check(&[3, 0, 4], &[4, 4, 1], es); // empty
            check(&[40], &[3], es); // one strided dim
        }
    }

    #[test]
    fn dims_merge_only_where_memory_runs_on() {
        assert_eq!(merged(&[2, 3, 4], &[12, 4, 1]), vec![(24, 1)]);
        assert_eq!(
            merged(&[8, 16, 5, 5], &[400, 1, 80, 16]),
            vec![(8, 400), (16, 1), (25, 16)]
        );
        assert_eq!(merged(&[4, 3], &[1, 4]), vec![(4, 1), (3, 4)]);
        assert_eq!(merged(&[1, 1], &[7, 7]), vec![(1, 0)]);
    }
}
