//! The clip on host, strided and emulated-device gradients: device norms and scaling as
//! the host's, one agreement per clip, ranks that disagree, stream ordering.
use super::*;
use crate::comm::Comm;
use crate::device::backend::Backend as _;
use crate::device::emulated::{self, EMULATED};
use crate::tensor::Device;

fn grad(b: &mut [u8], dtype: DType, n: usize) -> TensorView {
    unsafe { TensorView::host(b.as_mut_ptr(), dtype, &[n as i64], None, "g").unwrap() }
}

/// Device gradients (on the emulated device) give the host norm and clip, bit for bit.
#[test]
fn device_gradients_clip_as_host_ones() {
    if emulated::skip() {
        return;
    }
    let vals: Vec<f32> = (0..77).map(|i| (i as f32 - 30.0) * 0.731).collect();
    let f32s: Vec<u8> = vals.iter().flat_map(|x| x.to_le_bytes()).collect();
    for dtype in [DType::F32, DType::BF16, DType::F16] {
        let src = crate::cast::cast(f32s.clone(), DType::F32, dtype, "g").unwrap();
        for p in [2.0, 1.0, 3.0, f64::INFINITY] {
            let comm = Comm::local_group(1).pop().unwrap();
            let (mut h0, mut h1, mut d0, mut d1) =
                (src.clone(), src.clone(), src.clone(), src.clone());
            let host = vec![
                (grad(&mut h0, dtype, 77), true),
                (grad(&mut h1, dtype, 77), false),
            ];
            let want = unsafe { clip_grad_norm(&comm, &host, 1.5, p, true) }.unwrap();
            let dev = vec![
                ClipGrad {
                    tensor: emulated::on(emulated::dev(EMULATED), &grad(&mut d0, dtype, 77)),
                    is_shard: true,
                },
                ClipGrad {
                    tensor: grad(&mut d1, dtype, 77),
                    is_shard: false,
                },
            ];
            let got = unsafe { clip_grad_norm_checked(&comm, Ok(dev), 1.5, p, true) }.unwrap();
            assert_eq!(got.to_bits(), want.to_bits(), "{dtype} p={p}");
            assert_eq!((&d0, &d1), (&h0, &h1), "{dtype} p={p}");
            assert_ne!(d0, src, "clipped");
        }
    }
    let comm = Comm::local_group(1).pop().unwrap();
    let mut b = vec![0u8; 8 * 4];
    let strided =
        unsafe { TensorView::host(b.as_mut_ptr(), DType::F32, &[4], Some(&[2]), "g").unwrap() };
    let e = unsafe {
        clip_grad_norm_checked(
            &comm,
            Ok(vec![ClipGrad {
                tensor: emulated::on(emulated::dev(EMULATED), &strided),
                is_shard: true,
            }]),
            1.0,
            2.0,
            false,
        )
    }
    .unwrap_err()
    .to_string();
    assert!(
        e.contains("grads[0]") && e.contains("a device gradient must be contiguous"),
        "{e}"
    );
}

/// The device kernels' sums, maxima and scaling equal the host's bit for bit for every
/// dtype, across chunk boundaries, with several gradients in one launch (an empty one
/// among them), and NaN and infinity are seen wherever they sit.
#[test]
fn device_norms_and_scaling_are_the_hosts_across_chunks() {
    if emulated::skip() {
        return;
    }
    let sizes = [0usize, 1, 8191, 8192, 8193, 20000];
    for dtype in [DType::F32, DType::BF16, DType::F16, DType::F64] {
        let srcs: Vec<Vec<u8>> = sizes
            .iter()
            .enumerate()
            .map(|(k, &n)| {
                let f32s = emulated::encode(DType::F32, &emulated::values(n, 7 + k as u64));
                crate::cast::cast(f32s, DType::F32, dtype, "g").unwrap()
            })
            .collect();
        for poison in [None, Some(f64::INFINITY), Some(f64::NAN)] {
            let mut srcs = srcs.clone();
            if let Some(x) = poison {
                // One element deep in the last chunk of the largest gradient.
                let w = dtype.size();
                let at = 19_000 * w;
                let bytes =
                    crate::cast::cast(x.to_le_bytes().to_vec(), DType::F64, dtype, "x").unwrap();
                srcs[5][at..at + w].copy_from_slice(&bytes);
            }
            for p in [2.0, 1.0, f64::INFINITY, 3.0] {
                let mut host = srcs.clone();
                let mut dev = srcs.clone();
                let mk = |bufs: &mut Vec<Vec<u8>>, device: Device| -> Vec<ClipGrad> {
                    bufs.iter_mut()
                        .zip(sizes)
                        .map(|(b, n)| ClipGrad {
                            tensor: emulated::on(device, &grad(b, dtype, n)),
                            is_shard: true,
                        })
                        .collect()
                };
                let on_device = emulated::dev(EMULATED);
                let (h, d) = (mk(&mut host, Device::Host), mk(&mut dev, on_device));
                let want = unsafe { norms::norms(&h, p, 0) }.unwrap();
                let got = unsafe { norms::norms(&d, p, 0) }.unwrap();
                for (i, (w, g)) in want.iter().zip(&got).enumerate() {
                    let ctx = format!("{dtype} p={p} poison {poison:?} grad {i}");
                    assert_eq!(
                        (w.0.to_bits(), w.1.to_bits()),
                        (g.0.to_bits(), g.1.to_bits()),
                        "{ctx}"
                    );
                }
                assert_eq!(want[5].0.is_nan(), poison.is_some_and(|x| x.is_nan()));
                if poison.is_none() {
                    unsafe { norms::scale_all(&h, 0.37, 0) }.unwrap();
                    unsafe { norms::scale_all(&d, 0.37, 0) }.unwrap();
                    assert_eq!(host, dev, "{dtype} p={p} scaled");
                    assert_ne!(host, srcs, "{dtype} scaled");
                }
            }
        }
    }
}

/// A strided host gradient (read through a copy) gives the norm of its elements and is
/// scaled in place without touching the gaps; a contiguous one is read in place.
#[test]
fn strided_host_gradients_clip_their_elements_only() {
    let n = 9000; // two chunks
    let vals: Vec<f32> = emulated::values(n, 3);
    for p in [2.0, 1.0, 3.0, f64::INFINITY] {
        let comm = Comm::local_group(1).pop().unwrap();
        let mut dense = emulated::encode(DType::F32, &vals);
        let mut gapped: Vec<u8> = vals
            .iter()
            .flat_map(|x| [x.to_le_bytes(), 7f32.to_le_bytes()])
            .flatten()
            .collect();
        let strided = unsafe {
            TensorView::host(
                gapped.as_mut_ptr(),
                DType::F32,
                &[n as i64],
                Some(&[2]),
                "g",
            )
        }
        .unwrap();
        let want = unsafe {
            clip_grad_norm(
                &comm,
                &[(grad(&mut dense, DType::F32, n), true)],
                0.5,
                p,
                true,
            )
        }
        .unwrap();
        let got = unsafe { clip_grad_norm(&comm, &[(strided, true)], 0.5, p, true) }.unwrap();
        assert_eq!(got.to_bits(), want.to_bits(), "p={p}");
        for (i, c) in gapped.chunks(8).enumerate() {
            assert_eq!(&c[..4], &dense[4 * i..4 * i + 4], "p={p} element {i}");
            assert_eq!(&c[4..], &7f32.to_le_bytes(), "p={p} gap {i}");
        }
        assert_ne!(dense, emulated::encode(DType::F32, &vals), "scaled");
    }
}

/// A one-rank backend that records the collectives it is asked for.
struct Recording(std::sync::Arc<std::sync::Mutex<Vec<String>>>);

impl Recording {
    fn record(&self, what: String) -> Result<()> {
        self.0.lock().unwrap().push(what);
        Ok(())
    }
}

impl crate::comm::Backend for Recording {
    fn broadcast(&self, buf: &mut [u8], _root: usize) -> Result<()> {
        self.record(format!("broadcast {}", buf.len()))
    }
    fn all_reduce_f64(&self, vals: &mut [f64], op: ReduceOp) -> Result<()> {
        self.record(format!("{op:?} {}", vals.len()))
    }
    fn barrier(&self) -> Result<()> {
        self.record("barrier".into())
    }
    fn supports_scatter(&self) -> bool {
        false
    }
    fn scatter(&self, _: Option<Vec<Vec<u8>>>, _: &mut [u8], _: usize) -> Result<()> {
        unreachable!("no scatter")
    }
}

/// The clip is three collectives whatever the norm: the agreement on local checks, one
/// max (shard max, replicated part, non-finite flag, and the max and negated min of
/// norm_type, max_norm, error_if_nonfinite, which check that every rank passed the
/// same), one sum.
#[test]
fn a_clip_is_one_agreement_one_max_and_one_sum() {
    for p in [2.0, f64::INFINITY, 3.0] {
        let log = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        let comm = Comm::from_backend(0, 1, Box::new(Recording(log.clone()))).unwrap();
        let (mut a, mut b) = (
            emulated::encode(DType::F32, &[3.0, -4.0]),
            emulated::encode(DType::F32, &[12.0]),
        );
        let grads = [
            (grad(&mut a, DType::F32, 2), true),
            (grad(&mut b, DType::F32, 1), false),
        ];
        let total = unsafe { clip_grad_norm(&comm, &grads, 100.0, p, true) }.unwrap();
        let want = if p == 2.0 {
            13.0
        } else if p.is_infinite() {
            12.0
        } else {
            (27.0f64 + 64.0 + 1728.0).powf(1.0 / 3.0)
        };
        assert_eq!(total, want, "p={p}");
        assert_eq!(*log.lock().unwrap(), ["Max 1", "Max 9", "Sum 1"], "p={p}");
    }
}

/// Ranks passing different norm types (or max norms) fail alike, naming the argument,
/// instead of adding partial sums of different norms; no gradient is scaled.
#[test]
fn ranks_disagreeing_on_norm_type_or_max_norm_fail_every_rank() {
    for (p1, m1, what) in [(1.0, 1e-3, "norm_type"), (2.0, 5.0, "max_norm")] {
        let comms = Comm::local_group(2);
        let handles: Vec<_> = comms
            .into_iter()
            .map(|c| {
                std::thread::spawn(move || {
                    let mut b: Vec<u8> =
                        [3.0f32, 4.0].iter().flat_map(|x| x.to_le_bytes()).collect();
                    let before = b.clone();
                    let (p, m) = if c.rank() == 0 { (2.0, 1e-3) } else { (p1, m1) };
                    let g = vec![(grad(&mut b, DType::F32, 2), true)];
                    let e = unsafe { clip_grad_norm(&c, &g, m, p, false) }.unwrap_err();
                    drop(g);
                    assert_eq!(b, before, "nothing scaled");
                    e.to_string()
                })
            })
            .collect();
        for h in handles {
            let e = h.join().unwrap();
            assert!(e.contains(what) && e.contains("ranks disagree"), "{e}");
        }
    }
}

/// The norm reads the gradients after the work queued on the communicator's stream (a
/// backward still writing them), not on the legacy default stream.
#[test]
fn device_gradients_are_read_after_the_work_on_the_communicators_stream() {
    let Some((dev, s)) = emulated::device_and_stream() else {
        return;
    };
    let vals = emulated::values(1000, 21);
    let want: f64 = vals
        .iter()
        .map(|&v| v as f64 * v as f64)
        .sum::<f64>()
        .sqrt();
    let mut g = vec![0u8; 4000];
    // "Backward" writes the gradient on stream s, late.
    dev.stall(s, 150);
    unsafe {
        dev.upload(
            g.as_mut_ptr() as u64,
            &emulated::encode(DType::F32, &vals),
            s,
        )
    }
    .unwrap();
    let mut comm = Comm::local_group(1).pop().unwrap();
    comm.set_stream(s).unwrap();
    let grads = vec![ClipGrad {
        tensor: emulated::on(emulated::dev(EMULATED), &grad(&mut g, DType::F32, 1000)),
        is_shard: true,
    }];
    let total = unsafe { clip_grad_norm_checked(&comm, Ok(grads), 1e9, 2.0, true) }.unwrap();
    emulated::synchronize_all();
    assert!((total - want).abs() <= 1e-9 * want, "{total} vs {want}");
    // A stream of another device is refused, naming the gradient, and nothing is read.
    comm.set_stream(emulated::create_stream(EMULATED + 1))
        .unwrap();
    let grads = vec![ClipGrad {
        tensor: emulated::on(emulated::dev(EMULATED), &grad(&mut g, DType::F32, 1000)),
        is_shard: true,
    }];
    let e = unsafe { clip_grad_norm_checked(&comm, Ok(grads), 1.0, 2.0, true) }
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("is a stream of another CUDA context than device 77"),
        "{e}"
    );
}
