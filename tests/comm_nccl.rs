//! The NCCL constructor never panics: without the `cuda` feature it says how to get it;
//! with it, a missing libcuda or libnccl is FO_ERR_UNSUPPORTED naming the library.
use fo::comm::Comm;
use fo::Error;

#[test]
fn nccl_comm_is_a_clear_error_where_it_cannot_work() {
    let r = unsafe { Comm::from_nccl(std::ptr::null_mut(), std::ptr::null_mut(), 0, 1) };
    match r {
        #[cfg(not(feature = "cuda"))]
        Err(Error::Unsupported(m)) => assert!(m.contains("--features cuda"), "{m}"),
        #[cfg(feature = "cuda")]
        Err(Error::Unsupported(m)) => {
            assert!(m.contains("libcuda") || m.contains("libnccl"), "{m}")
        }
        // With both libraries present, the NULL communicator itself is refused.
        #[cfg(feature = "cuda")]
        Err(Error::InvalidArgument { name, .. }) => assert_eq!(name, "nccl_comm"),
        Err(e) => panic!("unexpected error: {e}"),
        Ok(_) => panic!("a NULL ncclComm_t must not make a communicator"),
    }
}

/// Where torch put NCCL (`FO_TEST_NCCL_LIBRARY`: the `nvidia-nccl-cu*` wheel's
/// `site-packages/nvidia/nccl/lib/libnccl.so.2`, which scripts/test.sh finds or installs),
/// loaded by its full path as torch's RPATH loads it: fo finds that copy although no
/// `libnccl.so` / `libnccl.so.1x` is on the search path, and calls `ncclGetVersion`
/// (no GPU needed).
///
/// In a process of its own (this binary again, this test alone): fo keeps the first NCCL
/// it loads, and the other test loads one by the search, a system copy where there is one
/// (the GPU machine has `/usr/lib/x86_64-linux-gnu/libnccl.so.2`), before this test runs.
#[cfg(feature = "cuda")]
#[test]
fn nccl_is_found_as_the_copy_torch_loaded_from_the_wheel() {
    let Some(path) = std::env::var_os("FO_TEST_NCCL_LIBRARY") else {
        eprintln!("skipped: FO_TEST_NCCL_LIBRARY (the wheel's libnccl.so.2) is not set");
        return;
    };
    const ALONE: &str = "FO_TEST_NCCL_ALONE";
    if std::env::var_os(ALONE).is_none() {
        let name = "nccl_is_found_as_the_copy_torch_loaded_from_the_wheel";
        let out = std::process::Command::new(std::env::current_exe().unwrap())
            .args(["--exact", name, "--nocapture", "--test-threads", "1"])
            .env(ALONE, "1")
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&out.stdout).to_string()
            + &String::from_utf8_lossy(&out.stderr);
        assert!(
            out.status.success(),
            "the test in its own process failed:\n{text}"
        );
        assert!(
            text.contains("1 passed"),
            "the test did not run alone:\n{text}"
        );
        eprintln!(
            "{}",
            text.lines().find(|l| l.starts_with("NCCL ")).unwrap_or("")
        );
        return;
    }
    assert!(
        std::env::var_os("FO_NCCL_LIBRARY").is_none(),
        "this test checks the search, not FO_NCCL_LIBRARY"
    );
    let c = std::ffi::CString::new(path.to_str().unwrap()).unwrap();
    // SAFETY: loading NCCL runs no CUDA code.
    let h = unsafe { libc::dlopen(c.as_ptr(), libc::RTLD_NOW | libc::RTLD_GLOBAL) };
    assert!(!h.is_null(), "dlopen {path:?}");
    let (found, version) = fo::comm::nccl_library().unwrap();
    assert_eq!(
        std::fs::canonicalize(&found).unwrap(),
        std::fs::canonicalize(&path).unwrap(),
        "fo uses the copy already loaded"
    );
    assert!(
        (21400..100000).contains(&version),
        "ncclGetVersion gave {version}"
    );
    eprintln!("NCCL {version} from {found}");
}
