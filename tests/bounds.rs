//! Issue 11 point 5, through the C ABI: calls that used to hang, spin, abort or wrap now
//! return a status with a message naming the argument, quickly, and nothing on stderr
//! (no caught panic). One test per call of the issue; each would hang or abort before.
use std::ffi::CStr;
use std::ptr::{null, null_mut};
use std::time::{Duration, Instant};

use fo::ffi::*;

fn msg() -> String {
    unsafe { CStr::from_ptr(fo_last_error_message()) }
        .to_string_lossy()
        .into_owned()
}

/// The call's status must be `code`, its message must name `needle`, and it must be quick.
fn refused(code: fo_status, t0: Instant, needle: &str) {
    let m = msg();
    assert_eq!(code, FO_ERR_INVALID_ARGUMENT, "status {code}: {m}");
    assert!(m.contains(needle), "message {m:?} does not name {needle:?}");
    assert!(
        t0.elapsed() < Duration::from_secs(5),
        "took {:?}",
        t0.elapsed()
    );
}

#[test]
fn thread_counts_are_capped_and_setting_one_starts_no_thread() {
    let mut n = 0;
    let t0 = Instant::now();
    refused(unsafe { fo_set_num_threads(100_000) }, t0, "at most 1024");
    refused(unsafe { fo_set_num_threads(-1) }, t0, "negative");
    assert_eq!(unsafe { fo_set_num_threads(1024) }, FO_OK);
    assert!(
        !fo::optim::threads::started(),
        "setting the count must not start threads"
    );
    assert_eq!(unsafe { fo_get_num_threads(&mut n) }, FO_OK);
    assert_eq!(n, 1024);
    assert_eq!(unsafe { fo_set_num_threads(0) }, FO_OK);
}

fn strided(dim: i32, split_factor: i32) -> fo_placement {
    fo_placement {
        kind: FO_PLACEMENT_STRIDED_SHARD,
        dim,
        split_factor,
    }
}

#[test]
fn a_split_factor_of_int32_max_is_answered_at_once() {
    let (mesh, coord) = ([2i64], [0i64]);
    let mut info = fo_shard_info::default();
    let t0 = Instant::now();
    // A short dim: every non-empty piece is one row, the answer is exact and immediate.
    let shape = [10i64, 3];
    let st = unsafe {
        fo_wrap_uneven(
            2,
            shape.as_ptr(),
            1,
            mesh.as_ptr(),
            coord.as_ptr(),
            &strided(0, i32::MAX),
            &mut info,
        )
    };
    assert_eq!(st, FO_OK, "{}", msg());
    assert_eq!(info.local_shape[..2], [10, 3]);
    assert!(t0.elapsed() < Duration::from_secs(5));
    // A long dim: ~2^31 boxes would be materialized; refused by name instead.
    let t0 = Instant::now();
    let shape = [1i64 << 40];
    let st = unsafe {
        fo_wrap_uneven(
            1,
            shape.as_ptr(),
            1,
            mesh.as_ptr(),
            coord.as_ptr(),
            &strided(0, i32::MAX),
            &mut info,
        )
    };
    refused(st, t0, "boxes");
}

#[test]
fn a_huge_local_group_is_an_error_not_an_allocation_abort() {
    let mut out = [null_mut::<fo_comm>(); 2];
    let t0 = Instant::now();
    refused(
        unsafe { fo_comm_create_local_group(i32::MAX, 1.0, out.as_mut_ptr()) },
        t0,
        "1..=1024",
    );
    refused(
        unsafe { fo_comm_create_local_group(1025, 1.0, out.as_mut_ptr()) },
        t0,
        "world_size",
    );
    refused(
        unsafe { fo_comm_create_local_group(-3, 1.0, out.as_mut_ptr()) },
        t0,
        "world_size",
    );
    assert!(out.iter().all(|p| p.is_null()), "nothing written on error");
}

#[test]
fn local_group_timeouts_must_be_finite_and_positive() {
    let mut out = [null_mut::<fo_comm>(); 2];
    for t in [f64::NAN, f64::INFINITY, f64::NEG_INFINITY, 0.0, -1.0, 1e9] {
        let t0 = Instant::now();
        refused(
            unsafe { fo_comm_create_local_group(2, t, out.as_mut_ptr()) },
            t0,
            "timeout_s",
        );
    }
    assert_eq!(
        unsafe { fo_comm_create_local_group(2, 0.5, out.as_mut_ptr()) },
        FO_OK
    );
    out.iter().for_each(|&c| unsafe { fo_comm_destroy(c) });
}

#[test]
fn shard_indices_of_a_2_63_row_tensor_is_a_clean_size_error() {
    let (shape, mesh, coord) = ([i64::MAX, 1], [1i64], [0i64]);
    let pl = fo_placement {
        kind: FO_PLACEMENT_SHARD,
        dim: 0,
        split_factor: 0,
    };
    let mut buf = [0i64; 4];
    let mut len = 0i64;
    let t0 = Instant::now();
    let st = unsafe {
        fo_shard_indices(
            2,
            shape.as_ptr(),
            1,
            mesh.as_ptr(),
            coord.as_ptr(),
            &pl,
            0,
            buf.as_mut_ptr(),
            4,
            &mut len,
        )
    };
    refused(st, t0, "capacity");
    assert_eq!(len, i64::MAX, "the count is still reported");
    // Dim 1 holds one index: answered without listing dim 0.
    let st = unsafe {
        fo_shard_indices(
            2,
            shape.as_ptr(),
            1,
            mesh.as_ptr(),
            coord.as_ptr(),
            &pl,
            1,
            buf.as_mut_ptr(),
            4,
            &mut len,
        )
    };
    assert_eq!((st, len, buf[0]), (FO_OK, 1, 0), "{}", msg());
    // [INT64_MAX, 2] has more elements than i64 counts: refused as a shape.
    let big = [i64::MAX, 2];
    let t0 = Instant::now();
    let st = unsafe {
        fo_shard_indices(
            2,
            big.as_ptr(),
            1,
            mesh.as_ptr(),
            coord.as_ptr(),
            &pl,
            1,
            buf.as_mut_ptr(),
            4,
            &mut len,
        )
    };
    refused(st, t0, "global_shape");
}

#[test]
fn grouped_placements_never_wrap_a_dim() {
    let src = [fo_placement {
        kind: FO_PLACEMENT_SHARD,
        dim: i32::MAX,
        split_factor: 0,
    }];
    let mut out = [fo_placement {
        kind: 9,
        dim: 9,
        split_factor: 9,
    }];
    let t0 = Instant::now();
    refused(
        unsafe { fo_grouped_placements(1, src.as_ptr(), out.as_mut_ptr()) },
        t0,
        "placements[0].dim",
    );
    assert_eq!(out[0].kind, 9, "nothing written on error");
    let src = [strided(7, 2)];
    refused(
        unsafe { fo_grouped_placements(1, src.as_ptr(), out.as_mut_ptr()) },
        t0,
        "FO_MAX_DIMS",
    );
    let src = [strided(6, 2)];
    assert_eq!(
        unsafe { fo_grouped_placements(1, src.as_ptr(), out.as_mut_ptr()) },
        FO_OK
    );
    assert_eq!(out[0], strided(7, 2));
}

fn adamw() -> fo_optim_config {
    let mut cfg = std::mem::MaybeUninit::<fo_optim_config>::zeroed();
    unsafe {
        fo_optim_config_default(0, cfg.as_mut_ptr());
        cfg.assume_init()
    }
}

#[test]
fn flags_outside_their_documented_values_are_refused() {
    let mut opt = null_mut();
    assert_eq!(unsafe { fo_optimizer_create(&adamw(), &mut opt) }, FO_OK);
    let t0 = Instant::now();
    let pack = |write_unsharded, params, mode| fo_pack_options {
        rank: 0,
        world_size: 1,
        mode,
        params,
        write_unsharded,
        save_id: null(),
    };
    let mut packed = null_mut();
    refused(
        unsafe { fo_state_pack(opt, &pack(5, 0, 0), &mut packed) },
        t0,
        "options.write_unsharded",
    );
    refused(
        unsafe { fo_state_pack(opt, &pack(-2, 0, 0), &mut packed) },
        t0,
        "options.write_unsharded",
    );
    refused(
        unsafe { fo_state_pack(opt, &pack(1, 3, 0), &mut packed) },
        t0,
        "options.params",
    );
    refused(
        unsafe { fo_state_pack(opt, &pack(1, 0, 2), &mut packed) },
        t0,
        "options.mode",
    );
    assert!(packed.is_null());
    let dir = c"/nonexistent-dir-for-fo-bounds";
    for (o, name) in [
        (
            fo_load_options {
                strict: 7,
                params: 0,
                param_groups: 1,
            },
            "options.strict",
        ),
        (
            fo_load_options {
                strict: 1,
                params: -1,
                param_groups: 1,
            },
            "options.params",
        ),
        (
            fo_load_options {
                strict: 1,
                params: 0,
                param_groups: 2,
            },
            "options.param_groups",
        ),
    ] {
        refused(
            unsafe { fo_state_load(opt, dir.as_ptr(), &o, null_mut()) },
            t0,
            name,
        );
    }
    for field in ["nesterov", "decouple_lr", "check_numerics"] {
        let mut cfg = adamw();
        match field {
            "nesterov" => cfg.nesterov = 2,
            "decouple_lr" => cfg.decouple_lr = -1,
            _ => cfg.check_numerics = 100,
        }
        let mut o2 = null_mut();
        refused(unsafe { fo_optimizer_create(&cfg, &mut o2) }, t0, field);
        assert!(o2.is_null());
    }
    unsafe { fo_optimizer_destroy(opt) };
}

#[test]
fn collective_flags_are_refused_on_every_rank() {
    let mut comm = null_mut();
    assert_eq!(
        unsafe { fo_comm_create_local_group(1, 5.0, &mut comm) },
        FO_OK
    );
    let mut total = 0.0;
    let t0 = Instant::now();
    refused(
        unsafe { fo_clip_grad_norm(comm, null(), 0, 1.0, 2.0, 2, &mut total) },
        t0,
        "error_if_nonfinite",
    );
    let g = [1.0f32, 2.0];
    let shape = [2i64];
    let grad = fo_clip_grad {
        tensor: fo_tensor {
            data: g.as_ptr() as *mut _,
            dtype: 0,
            ndim: 1,
            shape: shape.as_ptr(),
            strides: null(),
            device: -1,
        },
        is_shard: 3,
    };
    refused(
        unsafe { fo_clip_grad_norm(comm, &grad, 1, 1.0, 2.0, 0, &mut total) },
        t0,
        "grads[0].is_shard",
    );
    let opts = fo_broadcast_options {
        allow_int_float_cast: 4,
        strategy: 0,
    };
    let full = fo_broadcast_source {
        key: c"w".as_ptr(),
        tensor: grad.tensor,
    };
    let st = unsafe { fo_broadcast_state_dict(comm, &full, 1, null(), 0, &opts, null_mut()) };
    refused(st, t0, "opts.allow_int_float_cast");
    unsafe { fo_comm_destroy(comm) };
}

#[test]
fn a_stride_0_view_of_2_61_bytes_is_an_error_not_an_allocation_abort() {
    let mut cfg = adamw();
    cfg.master_weight_bits = 0;
    let mut opt = null_mut();
    assert_eq!(unsafe { fo_optimizer_create(&cfg, &mut opt) }, FO_OK);
    let mut w = [1.0f32; 4];
    let shape4 = [4i64];
    let p = fo_tensor {
        data: w.as_mut_ptr() as *mut _,
        dtype: 0,
        ndim: 1,
        shape: shape4.as_ptr(),
        strides: null(),
        device: -1,
    };
    let mut idx = -1;
    assert_eq!(
        unsafe { fo_optimizer_add_param(opt, c"w".as_ptr(), &p, null(), &mut idx) },
        FO_OK,
        "{}",
        msg()
    );
    let mut one = 0f32;
    let (huge, zero) = ([1i64 << 59], [0i64]);
    let v = fo_tensor {
        data: &mut one as *mut f32 as *mut _,
        dtype: 0,
        ndim: 1,
        shape: huge.as_ptr(),
        strides: zero.as_ptr(),
        device: -1,
    };
    let keys = [c"exp_avg".as_ptr()];
    let t0 = Instant::now();
    refused(
        unsafe { fo_optimizer_set_state(opt, 0, keys.as_ptr(), &v, 1) },
        t0,
        "values[0]",
    );
    unsafe { fo_optimizer_destroy(opt) };
}
