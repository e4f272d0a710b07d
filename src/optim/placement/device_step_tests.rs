//! The device half's checks, on machines without a GPU: device parameters are registered
//! through `register` (as `add_param` does once the device opens) over host memory the
//! step never reaches, since every case here fails before a launch.
use super::*;
use crate::device::emulated::{each_on, on};
use crate::dtype::DType;
use crate::optim::math::config::{Algorithm, OptimConfig, StateFormat};

fn view(buf: &mut [f32], shape: &[i64], strides: Option<&[i64]>) -> TensorView {
    unsafe {
        TensorView::host(buf.as_mut_ptr() as *mut u8, DType::F32, shape, strides, "t").unwrap()
    }
}

fn no_gpu() -> bool {
    crate::device::open_device(Device::Cuda(0)).is_err()
}

/// Host param "h" (index 0) and device-0 param "d" (index 1), both f32 with 40 elements.
fn hybrid(cfg: OptimConfig, h: &mut [f32], d: &mut [f32]) -> Optimizer {
    let mut opt = Optimizer::new(cfg).unwrap();
    unsafe {
        opt.add_param("h", view(h, &[40], None), None, 0).unwrap();
        opt.register("d", on(Device::Cuda(0), &view(d, &[40], None)), None, 0)
            .unwrap();
    }
    opt
}

fn adamw(format: StateFormat) -> OptimConfig {
    let mut c = OptimConfig::default_for(Algorithm::AdamW);
    c.state_format = format;
    c.master_weight_bits = 0;
    c
}

#[test]
fn device_param_registration_says_what_is_missing() {
    if !no_gpu() {
        eprintln!("skipped: device 0 can step tensors on this machine");
        return;
    }
    let mut opt = Optimizer::new(adamw(StateFormat::Fp32)).unwrap();
    let mut w = vec![1f32; 4];
    let e = unsafe { opt.add_param("w", on(Device::Cuda(0), &view(&mut w, &[4], None)), None, 0) }
        .unwrap_err()
        .to_string();
    assert!(e.starts_with("unsupported: param.device = 0: "), "{e}");
    #[cfg(not(feature = "cuda"))]
    assert!(e.contains("--features cuda"), "{e}");
    #[cfg(feature = "cuda")]
    assert!(
        e.contains("libcuda") || e.contains("NVRTC") || e.contains("CUDA device"),
        "{e}"
    );
    assert_eq!(opt.num_params(), 0);
}

#[test]
fn device_grads_of_host_params_need_a_usable_device_and_nothing_changes() {
    let mut opt = Optimizer::new(adamw(StateFormat::Quant8)).unwrap();
    let (mut w, mut g) = (vec![1f32; 40], vec![0.5f32; 40]);
    unsafe {
        opt.add_param("w", view(&mut w, &[40], None), None, 0)
            .unwrap()
    };
    let g = on(Device::Cuda(1), &view(&mut g, &[40], None));
    let e = unsafe { opt.step(&[Some(g)]) }.unwrap_err();
    let m = e.to_string();
    assert!(m.contains("gradient of w: device = 1: "), "{m}");
    assert!(matches!(e, Error::Unsupported(_)));
    assert!(w.iter().all(|&x| x == 1.0) && !opt.has_state(0));
}

#[test]
fn device_steps_are_validated_before_anything_changes() {
    let (mut h, mut d) = (vec![1f32; 40], vec![2f32; 40]);
    let (mut gh, mut gd, mut gs) = (vec![0.5f32; 40], vec![0.25f32; 40], vec![0.1f32; 80]);
    let mut try_step = |cfg: OptimConfig, devices: [i32; 2], strided: bool| {
        let devices = devices.map(|d| Device::from_c(d, "grads").unwrap());
        let mut opt = hybrid(cfg, &mut h, &mut d);
        let g1 = if strided {
            view(&mut gs, &[40], Some(&[2]))
        } else {
            view(&mut gd, &[40], None)
        };
        let grads = [Some(view(&mut gh, &[40], None)), Some(g1)];
        let e = unsafe { opt.step(&each_on(&devices, &grads)) }.unwrap_err();
        assert!(!opt.has_state(0) && !opt.has_state(1), "{e}");
        e.to_string()
    };
    let e = try_step(adamw(StateFormat::Fp32), [-1, -1], false);
    assert!(e.contains("gradient of d: the parameter is on CUDA device 0, its gradient must be too (got device -1)"), "{e}");
    let e = try_step(adamw(StateFormat::Fp32), [-1, 3], false);
    assert!(e.contains("(got device 3)"), "{e}");
    let e = try_step(adamw(StateFormat::Fp32), [-1, 0], true);
    assert!(e.contains("a device gradient must be contiguous"), "{e}");
    let mut c = adamw(StateFormat::Fp32);
    c.check_numerics = true;
    let e = try_step(c, [-1, 0], false);
    assert!(
        e.contains("check_numerics reads gradients on the host"),
        "{e}"
    );
    if no_gpu() {
        // Everything valid: the device state cannot be created here, so the step fails
        // before the host half runs.
        let e = try_step(adamw(StateFormat::Quant8), [-1, 0], false);
        assert!(e.contains("device = 0: "), "{e}");
    }
    assert!(h.iter().all(|&x| x == 1.0) && d.iter().all(|&x| x == 2.0));
}

#[test]
fn the_stream_is_taken_only_where_the_gpu_half_can_run() {
    let mut opt = Optimizer::new(adamw(StateFormat::Fp32)).unwrap();
    match crate::device::stream_support() {
        Ok(()) => {
            opt.set_stream(0x1234).unwrap();
            assert_eq!(opt.stream(), 0x1234);
        }
        Err(_) => {
            let e = opt.set_stream(0x1234).unwrap_err().to_string();
            assert!(e.contains("fo_optimizer_set_stream: "), "{e}");
            #[cfg(not(feature = "cuda"))]
            assert!(e.contains("--features cuda"), "{e}");
            #[cfg(feature = "cuda")]
            assert!(e.contains("libcuda") || e.contains("NVRTC"), "{e}");
            assert_eq!(opt.stream(), 0);
        }
    }
}

#[test]
fn state_accessors_say_where_the_state_is() {
    let (mut h, mut d) = (vec![1f32; 40], vec![2f32; 40]);
    let mut opt = hybrid(adamw(StateFormat::Fp32), &mut h, &mut d);
    assert!(opt.param_state(0).is_none() && opt.param_state(1).is_none());
    let e = opt.device_state(0).unwrap_err().to_string();
    assert!(e.contains("parameter h is in host memory"), "{e}");
    let e = opt.device_state(1).unwrap_err().to_string();
    assert!(e.contains("parameter d has no optimizer state yet"), "{e}");
    assert!(opt.device_state(2).is_err());
    let mut g = vec![0.5f32; 40];
    unsafe { opt.step(&[Some(view(&mut g, &[40], None)), None]) }.unwrap();
    assert_eq!(opt.param_state(0).unwrap().step, 1);
}

#[test]
fn a_device_gradient_aliasing_a_device_param_is_refused() {
    let (mut h, mut d) = (vec![1f32; 40], vec![2f32; 40]);
    let mut opt = hybrid(adamw(StateFormat::Fp32), &mut h, &mut d);
    let alias = on(Device::Cuda(0), &view(&mut d, &[40], None));
    let e = unsafe { opt.step(&[None, Some(alias)]) }
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("the gradient of d overlaps the memory of parameter d"),
        "{e}"
    );
    assert!(!opt.has_state(1));
}
