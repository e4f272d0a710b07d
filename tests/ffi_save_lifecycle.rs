//! Async saves through the C ABI, lifecycle: `fo_comm_destroy` racing `fo_save_wait` on
//! another thread never frees the communicator under the wait (the wait either commits
//! through it first, or finds the save detached and fails with FO_ERR_COMM); a second
//! save while one is in flight waits for the first's writer.
use std::ffi::{CStr, CString};
use std::path::PathBuf;

use fo::ffi::*;

fn last() -> String {
    unsafe { CStr::from_ptr(fo_last_error_message()) }
        .to_string_lossy()
        .into_owned()
}

/// An fp32 AdamW optimizer over one 64 Ki-element f32 param (256 KiB of state a save
/// writes, enough that the writer is still at work when the next call comes).
struct Fixture {
    opt: *mut fo_optimizer,
    w: Vec<f32>,
    g: Vec<f32>,
    shape: [i64; 1],
}

impl Fixture {
    fn new() -> Box<Fixture> {
        let n = 1 << 16;
        let mut f = Box::new(Fixture {
            opt: std::ptr::null_mut(),
            w: (0..n).map(|i| (i as f32 * 0.01).sin()).collect(),
            g: (0..n).map(|i| (i as f32 * 0.03).cos()).collect(),
            shape: [n as i64],
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

    fn step(&mut self) {
        let g = self.g.as_mut_ptr();
        let g = self.tensor(g);
        assert_eq!(
            unsafe { fo_optimizer_step(self.opt, &g, 1) },
            FO_OK,
            "{}",
            last()
        );
    }
}

impl Drop for Fixture {
    fn drop(&mut self) {
        unsafe { fo_optimizer_destroy(self.opt) };
    }
}

fn options(id: &CStr, budget: u64) -> fo_save_options {
    fo_save_options {
        pack: fo_pack_options {
            rank: 0,
            world_size: 1,
            mode: FO_PACK_MODE_COMPRESSED,
            params: 0,
            write_unsharded: -1,
            save_id: id.as_ptr(),
        },
        staging_budget_bytes: budget,
    }
}

fn tmp(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("fo-ffi-save-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    d
}

#[test]
fn destroying_the_comm_while_another_thread_waits_never_frees_it_under_the_wait() {
    let mut f = Fixture::new();
    f.step();
    let dir = tmp("race");
    let cdir = CString::new(dir.to_str().unwrap()).unwrap();
    // A committed checkpoint to begin with: a detached save leaves it the visible one.
    let base = options(c"base", 0).pack;
    assert_eq!(unsafe { fo_state_save(f.opt, cdir.as_ptr(), &base) }, FO_OK);
    let (mut committed, mut detached) = (0, 0);
    for round in 0..40 {
        let mut comm: *mut fo_comm = std::ptr::null_mut();
        assert_eq!(
            unsafe { fo_comm_create_local_group(1, 60.0, &mut comm) },
            FO_OK
        );
        let id = CString::new(format!("r{round}")).unwrap();
        let mut save: *mut fo_save = std::ptr::null_mut();
        let o = options(&id, 0);
        let s = unsafe { fo_state_save_async(f.opt, cdir.as_ptr(), &o, comm, &mut save) };
        assert_eq!(s, FO_OK, "{}", last());
        f.step();
        // The destroy runs on another thread: done before the wait (even rounds), or
        // racing it (odd rounds: either may enter the communicator first).
        let addr = comm as usize;
        let mut destroyer = Some(std::thread::spawn(move || unsafe {
            fo_comm_destroy(addr as *mut fo_comm)
        }));
        if round % 2 == 0 {
            destroyer.take().unwrap().join().unwrap();
        }
        let status = loop {
            match unsafe { fo_save_wait(save, -1.0) } {
                // The destroy holds the communicator: wait again (then it is detached).
                FO_ERR_BUSY => std::thread::yield_now(),
                s => break s,
            }
        };
        match status {
            FO_OK => committed += 1,
            FO_ERR_COMM => {
                assert!(
                    last().contains("destroyed before fo_save_wait"),
                    "{}",
                    last()
                );
                detached += 1;
            }
            s => panic!("round {round}: status {s}: {}", last()),
        }
        if let Some(d) = destroyer {
            d.join().unwrap();
        }
        // Settled: the same status again, without the communicator.
        assert_eq!(unsafe { fo_save_wait(save, 0.0) }, status);
        unsafe { fo_save_destroy(save) };
        assert_eq!(
            unsafe { fo_checkpoint_verify(cdir.as_ptr()) },
            FO_OK,
            "{}",
            last()
        );
    }
    assert_eq!(committed + detached, 40);
    assert!(detached >= 20, "{detached} saves detached");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_second_save_while_one_is_in_flight_waits_for_the_first_writer() {
    let mut f = Fixture::new();
    f.step();
    let (a, b) = (tmp("two-a"), tmp("two-b"));
    let (ca, cb) = (
        CString::new(a.to_str().unwrap()).unwrap(),
        CString::new(b.to_str().unwrap()).unwrap(),
    );
    let (mut s1, mut s2): (*mut fo_save, *mut fo_save) =
        (std::ptr::null_mut(), std::ptr::null_mut());
    unsafe {
        // A 4 KiB pool: the step after the call waits for the writer param by param.
        assert_eq!(
            fo_state_save_async(
                f.opt,
                ca.as_ptr(),
                &options(c"x", 4096),
                std::ptr::null(),
                &mut s1
            ),
            FO_OK
        );
        f.step();
        assert_eq!(
            fo_state_save_async(
                f.opt,
                cb.as_ptr(),
                &options(c"y", 0),
                std::ptr::null(),
                &mut s2
            ),
            FO_OK
        );
        let mut st = std::mem::zeroed::<fo_save_stats>();
        assert_eq!(fo_save_stats_get(s1, &mut st), FO_OK);
        // The second call returned after the first's writer took everything.
        assert_eq!(st.bytes_written, st.bytes_total);
        f.step();
        assert_eq!(fo_save_wait(s2, -1.0), FO_OK, "{}", last());
        assert_eq!(fo_save_wait(s1, -1.0), FO_OK, "{}", last());
        fo_save_destroy(s1);
        fo_save_destroy(s2);
        assert_eq!(fo_checkpoint_verify(ca.as_ptr()), FO_OK);
        assert_eq!(fo_checkpoint_verify(cb.as_ptr()), FO_OK);
    }
    for d in [a, b] {
        std::fs::remove_dir_all(d).unwrap();
    }
}

/// Issue 38, item 3: `fo_save_wait(s, INFINITY)` (and any timeout beyond a week) waits
/// without limit, as a negative timeout does; NaN stays an error naming `timeout_s`.
#[test]
fn an_infinite_or_huge_timeout_waits_without_limit() {
    let mut f = Fixture::new();
    f.step();
    let dir = tmp("inf");
    let cdir = CString::new(dir.to_str().unwrap()).unwrap();
    for (k, t) in [f64::INFINITY, 1e300, 8.0 * 24.0 * 3600.0, f64::MAX]
        .into_iter()
        .enumerate()
    {
        let id = CString::new(format!("inf{k}")).unwrap();
        let mut s: *mut fo_save = std::ptr::null_mut();
        unsafe {
            let st = fo_state_save_async(
                f.opt,
                cdir.as_ptr(),
                &options(&id, 0),
                std::ptr::null(),
                &mut s,
            );
            assert_eq!(st, FO_OK, "{}", last());
            assert_eq!(fo_save_wait(s, f64::NAN), FO_ERR_INVALID_ARGUMENT);
            assert!(last().contains("timeout_s"), "{}", last());
            assert_eq!(fo_save_wait(s, t), FO_OK, "timeout {t}: {}", last());
            fo_save_destroy(s);
        }
        f.step();
    }
    assert_eq!(unsafe { fo_checkpoint_verify(cdir.as_ptr()) }, FO_OK);
    std::fs::remove_dir_all(dir).unwrap();
}

/// Issue 38, item 1 through the C ABI: with a communicator, a second save into the same
/// directory before the first's wait is FO_ERR_BUSY naming the save in flight, and the
/// first still commits at its wait.
#[test]
fn a_second_save_before_the_first_comm_wait_is_busy_naming_it() {
    let mut f = Fixture::new();
    f.step();
    let dir = tmp("busy");
    let cdir = CString::new(dir.to_str().unwrap()).unwrap();
    unsafe {
        let mut comm: *mut fo_comm = std::ptr::null_mut();
        assert_eq!(fo_comm_create_local_group(1, 60.0, &mut comm), FO_OK);
        let (mut a, mut b): (*mut fo_save, *mut fo_save) =
            (std::ptr::null_mut(), std::ptr::null_mut());
        assert_eq!(
            fo_state_save_async(f.opt, cdir.as_ptr(), &options(c"first", 0), comm, &mut a),
            FO_OK
        );
        f.step();
        let s = fo_state_save_async(f.opt, cdir.as_ptr(), &options(c"second", 0), comm, &mut b);
        assert_eq!(s, FO_ERR_BUSY, "{}", last());
        assert!(last().contains("\"first\""), "{}", last());
        assert!(b.is_null());
        assert_eq!(fo_save_wait(a, -1.0), FO_OK, "{}", last());
        fo_save_destroy(a);
        assert_eq!(
            fo_state_save_async(f.opt, cdir.as_ptr(), &options(c"second", 0), comm, &mut b),
            FO_OK
        );
        assert_eq!(fo_save_wait(b, -1.0), FO_OK, "{}", last());
        fo_save_destroy(b);
        fo_comm_destroy(comm);
    }
    std::fs::remove_dir_all(dir).unwrap();
}
