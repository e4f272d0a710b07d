//! The GPU half of the C ABI on a machine that cannot run it (no `cuda` feature, or no
//! libcuda / NVRTC, or no device): every device entry is refused with a status and a
//! message naming what is missing, and nothing changes. Where a device can step, the
//! refusal checks are skipped (printed), the argument checks still run.
use std::ffi::{c_void, CStr};
use std::ptr::{null, null_mut};

use fo::ffi::*;

fn msg() -> String {
    unsafe { CStr::from_ptr(fo_last_error_message()) }
        .to_string_lossy()
        .into_owned()
}

fn create() -> *mut fo_optimizer {
    let mut cfg = std::mem::MaybeUninit::<fo_optim_config>::zeroed();
    let mut opt = null_mut();
    unsafe {
        fo_optim_config_default(0, cfg.as_mut_ptr());
        assert_eq!(fo_optimizer_create(cfg.as_ptr(), &mut opt), FO_OK);
    }
    opt
}

fn tensor(data: &mut [u16], shape: &[i64; 1], device: i32) -> fo_tensor {
    fo_tensor {
        data: data.as_mut_ptr() as *mut c_void,
        dtype: 2,
        ndim: 1,
        shape: shape.as_ptr(),
        strides: null(),
        device,
    }
}

/// Whether this process can step device 0 (then the refusals below do not apply).
fn gpu_usable() -> bool {
    fo::device::open_device(fo::device::Device::Cuda(0)).is_ok()
}

#[test]
fn set_stream_is_refused_without_gpu_support_and_checks_its_handle() {
    assert_eq!(
        unsafe { fo_optimizer_set_stream(null_mut(), null_mut()) },
        FO_ERR_INVALID_ARGUMENT
    );
    assert!(msg().contains("opt"), "{}", msg());
    let opt = create();
    let status = unsafe { fo_optimizer_set_stream(opt, 0x10 as *mut c_void) };
    if fo::device::stream_support().is_ok() {
        eprintln!("skipped the refusal: this build and machine take a stream");
        assert_eq!(status, FO_OK);
    } else {
        let m = msg();
        assert_eq!(status, FO_ERR_UNSUPPORTED, "{m}");
        assert!(m.contains("fo_optimizer_set_stream: "), "{m}");
        assert!(
            m.contains("--features cuda") || m.contains("libcuda") || m.contains("NVRTC"),
            "{m}"
        );
    }
    unsafe { fo_optimizer_destroy(opt) };
}

#[test]
fn device_params_and_grads_are_refused_clearly_and_change_nothing() {
    let opt = create();
    let shape = [4i64];
    let (mut p, mut g) = ([0x3f80u16; 4], [0x3f80u16; 4]);
    let mut idx = -1;
    let bad = tensor(&mut p, &shape, -3);
    let s = unsafe { fo_optimizer_add_param(opt, c"w".as_ptr(), &bad, null(), &mut idx) };
    assert_eq!(s, FO_ERR_INVALID_ARGUMENT);
    assert!(msg().contains("param.device"), "{}", msg());
    if gpu_usable() {
        eprintln!("skipped the device refusal: device 0 can step tensors here");
    } else {
        let dev = tensor(&mut p, &shape, 0);
        let s = unsafe { fo_optimizer_add_param(opt, c"w".as_ptr(), &dev, null(), &mut idx) };
        assert_eq!(s, FO_ERR_UNSUPPORTED);
        assert!(
            msg().starts_with("unsupported: param.device = 0: "),
            "{}",
            msg()
        );
    }
    let host = tensor(&mut p, &shape, -1);
    let s = unsafe { fo_optimizer_add_param(opt, c"h".as_ptr(), &host, null(), &mut idx) };
    assert_eq!(s, FO_OK, "{}", msg());
    // The offload case (device grads of a host param) needs device 1: refused here, and
    // never read on the host.
    let gdev = tensor(&mut g, &shape, 1);
    assert_eq!(
        unsafe { fo_optimizer_step(opt, &gdev, 1) },
        FO_ERR_UNSUPPORTED
    );
    assert!(msg().contains("gradient of h: device = 1"), "{}", msg());
    assert_eq!(p, [0x3f80u16; 4]);
    unsafe { fo_optimizer_destroy(opt) };
}

#[test]
fn a_mirror_is_device_memory_of_a_host_param_and_needs_a_usable_device() {
    let mut p = [0x3f80u16; 4];
    let mut m = [0u16; 4];
    let shape = [4i64];
    let opt = create();
    let mut idx = -1;
    let host = tensor(&mut p, &shape, -1);
    let s = unsafe { fo_optimizer_add_param(opt, c"h".as_ptr(), &host, null(), &mut idx) };
    assert_eq!(s, FO_OK, "{}", msg());
    let on_host = tensor(&mut m, &shape, -1);
    assert_eq!(
        unsafe { fo_optimizer_set_mirror(opt, idx, &on_host) },
        FO_ERR_INVALID_ARGUMENT
    );
    assert!(
        msg().contains("a mirror is device memory (device >= 0), got -1"),
        "{}",
        msg()
    );
    if gpu_usable() {
        eprintln!("skipped the refusal: device 0 can take a mirror here");
    } else {
        let dev = tensor(&mut m, &shape, 0);
        assert_eq!(
            unsafe { fo_optimizer_set_mirror(opt, idx, &dev) },
            FO_ERR_UNSUPPORTED
        );
        assert!(msg().contains("device = 0: "), "{}", msg());
    }
    assert_eq!(m, [0u16; 4], "nothing was written");
    assert_eq!(unsafe { fo_optimizer_set_mirror(opt, idx, null()) }, FO_OK);
    assert_eq!(
        unsafe { fo_optimizer_set_mirror(opt, 5, null()) },
        FO_ERR_INVALID_ARGUMENT
    );
    unsafe { fo_optimizer_destroy(opt) };
}

#[test]
fn a_device_gradient_to_clip_needs_a_usable_device_and_changes_nothing() {
    let Some(comm) = comm_without_gpu() else {
        return;
    };
    let mut g = [0x4000u16; 4];
    let shape = [4i64];
    let grad = fo_clip_grad {
        tensor: tensor(&mut g, &shape, 0),
        is_shard: 1,
    };
    let mut total = -1.0;
    let s = unsafe { fo_clip_grad_norm(comm, &grad, 1, 0.5, 2.0, 0, &mut total) };
    assert_eq!(s, FO_ERR_UNSUPPORTED, "{}", msg());
    assert!(msg().contains("grads[0].device = 0: "), "{}", msg());
    assert_eq!((g, total), ([0x4000u16; 4], -1.0));
    unsafe { fo_comm_destroy(comm) };
}

#[test]
fn a_device_destination_needs_a_usable_device_and_nothing_is_written() {
    let Some(comm) = comm_without_gpu() else {
        return;
    };
    let (mut src, mut dst) = ([0x4000u16; 4], [0u16; 4]);
    let shape = [4i64];
    let full = fo_broadcast_source {
        key: c"w".as_ptr(),
        tensor: tensor(&mut src, &shape, -1),
    };
    let dest = fo_broadcast_dest {
        key: c"w".as_ptr(),
        tensor: tensor(&mut dst, &shape, 0),
        spec: null(),
    };
    let s = unsafe { fo_broadcast_state_dict(comm, &full, 1, &dest, 1, null(), null_mut()) };
    assert_eq!(s, FO_ERR_UNSUPPORTED, "{}", msg());
    assert!(msg().contains("dests[0].tensor.device = 0: "), "{}", msg());
    assert_eq!(dst, [0u16; 4]);
    unsafe { fo_comm_destroy(comm) };
}

/// A one-rank communicator, or None (printed) where device 0 can be used.
fn comm_without_gpu() -> Option<*mut fo_comm> {
    if gpu_usable() {
        eprintln!("skipped: device 0 can be used here");
        return None;
    }
    let mut comm = null_mut();
    assert_eq!(
        unsafe { fo_comm_create_local_group(1, 5.0, &mut comm) },
        FO_OK
    );
    Some(comm)
}
