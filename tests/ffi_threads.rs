//! Issue 23: a handle used from several threads. Every entry point takes the handle's
//! guard, so a second caller gets FO_ERR_BUSY naming the call in progress instead of a
//! data race; the optimizer ends as if the calls that returned OK ran one at a time.
use std::ffi::CStr;

use fo::ffi::*;

fn last() -> String {
    unsafe { CStr::from_ptr(fo_last_error_message()) }
        .to_string_lossy()
        .into_owned()
}

/// An f32 AdamW optimizer with one 4096-element param `w`.
struct Fixture {
    opt: *mut fo_optimizer,
    w: Vec<f32>,
    shape: [i64; 1],
}

impl Fixture {
    fn new() -> Box<Fixture> {
        let mut f = Box::new(Fixture {
            opt: std::ptr::null_mut(),
            w: vec![0.5; 4096],
            shape: [4096],
        });
        unsafe {
            let mut cfg = std::mem::zeroed::<fo_optim_config>();
            fo_optim_config_default(0, &mut cfg);
            cfg.master_weight_bits = 0;
            cfg.state_format = 0;
            assert_eq!(fo_optimizer_create(&cfg, &mut f.opt), FO_OK, "{}", last());
            let w = f.w.as_mut_ptr();
            let p = f.tensor(w);
            let mut idx = -1;
            let s = fo_optimizer_add_param(f.opt, c"w".as_ptr(), &p, std::ptr::null(), &mut idx);
            assert_eq!(s, FO_OK, "{}", last());
        }
        f
    }

    fn tensor(&self, data: *mut f32) -> fo_tensor {
        fo_tensor {
            data: data.cast(),
            dtype: 0,
            ndim: 1,
            shape: self.shape.as_ptr(),
            strides: std::ptr::null(),
            device: -1,
        }
    }
}

static BUSY: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);

/// Counts OK answers; any status but OK and BUSY (with a message naming `call` and the
/// call in progress) fails the test.
fn judge(call: &str, s: fo_status, ok: &mut u32) {
    match s {
        FO_OK => *ok += 1,
        FO_ERR_BUSY => {
            BUSY.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            let m = last();
            assert!(
                m.contains(call) && m.contains("is busy in fo_optimizer_"),
                "{m}"
            );
        }
        _ => panic!("{call}: status {s}: {}", last()),
    }
}

#[test]
fn step_and_set_state_from_two_threads_get_ok_or_busy_and_stay_consistent() {
    let f = Fixture::new();
    let opt = f.opt as usize;
    let rounds = 400;
    let setter = {
        let shape = f.shape;
        std::thread::spawn(move || {
            let mut m = vec![0.25f32; 4096];
            // Retries until it has `rounds` successes: the stepper re-takes the handle
            // at once, so a caller that gives up on BUSY may never get in.
            let mut ok = 0;
            while ok < rounds {
                std::thread::yield_now();
                let v = fo_tensor {
                    data: m.as_mut_ptr().cast(),
                    dtype: 0,
                    ndim: 1,
                    shape: shape.as_ptr(),
                    strides: std::ptr::null(),
                    device: -1,
                };
                let keys = [c"exp_avg".as_ptr()];
                let s = unsafe { fo_optimizer_set_state(opt as *mut _, 0, keys.as_ptr(), &v, 1) };
                judge("fo_optimizer_set_state", s, &mut ok);
            }
            ok
        })
    };
    let mut g = vec![0.01f32; 4096];
    let gt = f.tensor(g.as_mut_ptr());
    let mut steps = 0;
    while steps < rounds {
        std::thread::yield_now();
        judge(
            "fo_optimizer_step",
            unsafe { fo_optimizer_step(f.opt, &gt, 1) },
            &mut steps,
        );
    }
    let sets = setter.join().unwrap();
    assert_eq!((steps, sets), (rounds, rounds));
    eprintln!(
        "{} calls answered FO_ERR_BUSY",
        BUSY.load(std::sync::atomic::Ordering::Relaxed)
    );
    let mut step = [0f32; 1];
    let mut out = fo_tensor {
        data: step.as_mut_ptr().cast(),
        dtype: 0,
        ndim: 0,
        shape: f.shape.as_ptr(),
        strides: std::ptr::null(),
        device: -1,
    };
    unsafe {
        assert_eq!(
            fo_optimizer_get_state(f.opt, 0, c"step".as_ptr(), &mut out),
            FO_OK,
            "{}",
            last()
        );
        assert_eq!(step[0], steps as f32);
        assert!(f.w.iter().all(|x| x.is_finite()));
        fo_optimizer_destroy(f.opt);
    }
}

#[test]
fn busy_has_its_own_code_and_name() {
    assert_eq!(FO_ERR_BUSY, 11);
    let name = unsafe { CStr::from_ptr(fo_status_name(FO_ERR_BUSY)) };
    assert_eq!(name.to_str().unwrap(), "FO_ERR_BUSY");
}
