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
