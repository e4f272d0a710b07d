//! Fixtures the placement tests share: byte buffers seen as flat host tensors, registered
//! as parameters `p0, p1, ...`, given to a step as its gradients or claimed as mirrors on
//! the emulated device.
use crate::device::emulated::{self, EMULATED};
use crate::dtype::DType;
use crate::optim::math::config::OptimConfig;
use crate::optim::Optimizer;
use crate::tensor::TensorView;

/// `b` as a flat host tensor of `n` elements of `dt`.
pub(super) fn view(b: &mut [u8], dt: DType, n: usize) -> TensorView {
    unsafe { TensorView::host(b.as_mut_ptr(), dt, &[n as i64], None, "t").unwrap() }
}

/// `bufs[i]` as `sizes[i]` elements of `dt`, every one given (a step's gradients).
pub(super) fn grads_of(
    bufs: &mut [Vec<u8>],
    dt: DType,
    sizes: &[usize],
) -> Vec<Option<TensorView>> {
    bufs.iter_mut()
        .enumerate()
        .map(|(i, b)| Some(view(b, dt, sizes[i])))
        .collect()
}

/// An optimizer of config `c` holding `bufs[i]` as host parameter `p{i}` (`sizes[i]`
/// elements of `dt`).
pub(super) fn optimizer_over(
    c: &OptimConfig,
    bufs: &mut [Vec<u8>],
    dt: DType,
    sizes: &[usize],
) -> Optimizer {
    let mut opt = Optimizer::new(c.clone()).unwrap();
    for (i, b) in bufs.iter_mut().enumerate() {
        unsafe { opt.add_param(&format!("p{i}"), view(b, dt, sizes[i]), None, 0) }.unwrap();
    }
    opt
}

/// Sets `mirrors[i]`, claimed as memory of emulated device `EMULATED`, as the mirror of
/// parameter `i` of `opt` (`sizes[i]` elements of `dt`).
pub(super) fn set_mirrors(
    opt: &mut Optimizer,
    mirrors: &mut [Vec<u8>],
    dt: DType,
    sizes: &[usize],
) {
    for (i, m) in mirrors.iter_mut().enumerate() {
        let on = emulated::on(emulated::dev(EMULATED), &view(m, dt, sizes[i]));
        unsafe { opt.set_mirror(i, Some(on)) }.unwrap();
    }
}
