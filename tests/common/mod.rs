//! Shared test helpers: a small deterministic RNG, aligned buffers, and running one
//! closure per rank on its own thread under a hard deadline (a hang fails the test).
#![allow(dead_code)]
use std::sync::mpsc;
use std::time::{Duration, Instant};

use fo::comm::{Comm, LocalGroupOptions};
use fo::{DType, TensorView};

/// xorshift64*: deterministic, dependency-free.
pub struct Rng(pub u64);

impl Rng {
    pub fn new(seed: u64) -> Rng {
        Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }
    pub fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    pub fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
    pub fn chance(&mut self, num: usize, den: usize) -> bool {
        self.below(den) < num
    }
    pub fn f32(&mut self) -> f32 {
        ((self.next() >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    }
    pub fn bytes(&mut self, n: usize) -> Vec<u8> {
        (0..n).map(|_| self.next() as u8).collect()
    }
}

/// Host memory aligned for any dtype.
#[derive(Clone)]
pub struct Buf(Vec<u64>, usize);

impl Buf {
    pub fn from_bytes(b: &[u8]) -> Buf {
        let mut v = vec![0u64; b.len().div_ceil(8)];
        unsafe { std::ptr::copy_nonoverlapping(b.as_ptr(), v.as_mut_ptr() as *mut u8, b.len()) };
        Buf(v, b.len())
    }
    pub fn filled(n: usize, byte: u8) -> Buf {
        Buf::from_bytes(&vec![byte; n])
    }
    pub fn ptr(&mut self) -> *mut u8 {
        self.0.as_mut_ptr() as *mut u8
    }
    pub fn bytes(&self) -> &[u8] {
        unsafe { std::slice::from_raw_parts(self.0.as_ptr() as *const u8, self.1) }
    }
    /// A contiguous view of the whole buffer.
    pub fn view(&mut self, dtype: DType, shape: &[usize]) -> TensorView {
        let s: Vec<i64> = shape.iter().map(|&x| x as i64).collect();
        unsafe { TensorView::host(self.ptr(), dtype, &s, None, "test").unwrap() }
    }
    /// A view with element strides.
    pub fn strided(&mut self, dtype: DType, shape: &[usize], strides: &[usize]) -> TensorView {
        let s: Vec<i64> = shape.iter().map(|&x| x as i64).collect();
        let st: Vec<i64> = strides.iter().map(|&x| x as i64).collect();
        unsafe { TensorView::host(self.ptr(), dtype, &s, Some(&st), "test").unwrap() }
    }
}

/// Runs `f(rank's comm)` on one thread per rank and returns the results in rank order.
/// Panics (failing the test) if any rank has not returned within `deadline`.
pub fn run_ranks<T, F>(comms: Vec<Comm>, deadline: Duration, f: F) -> Vec<T>
where
    T: Send + 'static,
    F: Fn(Comm) -> T + Send + Sync + Clone + 'static,
{
    let n = comms.len();
    let (tx, rx) = mpsc::channel();
    for c in comms {
        let (tx, f) = (tx.clone(), f.clone());
        std::thread::spawn(move || {
            let r = c.rank();
            let out = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| f(c)));
            let _ = tx.send((r, out));
        });
    }
    drop(tx);
    let end = Instant::now() + deadline;
    let mut out: Vec<Option<T>> = (0..n).map(|_| None).collect();
    for _ in 0..n {
        let left = end.saturating_duration_since(Instant::now());
        match rx.recv_timeout(left) {
            Ok((r, Ok(v))) => out[r] = Some(v),
            Ok((r, Err(p))) => {
                let msg = p
                    .downcast_ref::<String>()
                    .cloned()
                    .or(p.downcast_ref::<&str>().map(|s| s.to_string()));
                panic!("rank {r} panicked: {}", msg.unwrap_or_default());
            }
            Err(_) => {
                let missing: Vec<usize> = (0..n).filter(|&r| out[r].is_none()).collect();
                panic!("hang: ranks {missing:?} did not finish within {deadline:?}");
            }
        }
    }
    out.into_iter().map(Option::unwrap).collect()
}

/// An in-process group whose collectives give up after `secs` seconds.
pub fn group(world: usize, secs: f64) -> Vec<Comm> {
    Comm::local_group_with(
        world,
        LocalGroupOptions {
            timeout: Duration::from_secs_f64(secs),
        },
    )
}
