//! The GPU half of `fo selftest` (feature `cuda`): device memory through the raw driver
//! API (the device's primary context, the one fo's launcher uses), the GPU-vs-CPU
//! comparison and the throughput table. It has not been run on a GPU yet.
use std::time::Instant;

use cudarc::driver::{result as cu, sys as cusys};
use fo::ckpt::{pack, Mode, ParamsAs, SaveOptions};
use fo::kernels::step_table::StateLayout;
use fo::optim::overlap::{OverlapOptions, OverlapStats};
use fo::optim::{Algorithm, Arithmetic, OptimConfig, Optimizer, StateFormat};
use fo::{DType, Device, TensorView};

use super::bench_util::{best, fill};
use super::selftest_cases::{rules, state_mismatches, FORMATS};

/// Why there is no GPU to test, or None when the driver reports at least one device.
pub fn no_gpu() -> Option<String> {
    // SAFETY: only tries to load libcuda.
    if !unsafe { cusys::is_culib_present() } {
        return Some("the CUDA driver library (libcuda.so) could not be loaded".into());
    }
    if let Err(e) = cu::init() {
        return Some(format!("cuInit failed ({e:?}): no usable CUDA device"));
    }
    match cu::device::get_count() {
        Ok(0) => Some("the CUDA driver reports no device".into()),
        Ok(_) => None,
        Err(e) => Some(format!("cuDeviceGetCount failed ({e:?})")),
    }
}

fn cuda<T>(what: &str, r: Result<T, cu::DriverError>) -> Result<T, String> {
    r.map_err(|e| format!("{what}: {e:?}"))
}

/// Device memory, freed on drop.
struct Buf {
    ptr: u64,
    bytes: usize,
}

impl Buf {
    fn upload(bytes: &[u8]) -> Result<Buf, String> {
        // SAFETY: fresh allocations of the right size; the context is current (`run`).
        unsafe {
            let ptr = cuda("cuMemAlloc", cu::malloc_sync(bytes.len().max(1)))?;
            let b = Buf {
                ptr,
                bytes: bytes.len(),
            };
            if !bytes.is_empty() {
                cuda("cuMemcpyHtoD", cu::memcpy_htod_sync(ptr, bytes))?;
            }
            Ok(b)
        }
    }

    fn download(&self) -> Result<Vec<u8>, String> {
        let mut v = vec![0u8; self.bytes];
        if !v.is_empty() {
            // SAFETY: `self.bytes` bytes were allocated at `ptr`.
            cuda("cuMemcpyDtoH", unsafe {
                cu::memcpy_dtoh_sync(&mut v, self.ptr)
            })?;
        }
        Ok(v)
    }

    fn view(&self, device: Device, dtype: DType, n: usize) -> Result<TensorView, String> {
        // SAFETY: a view only; fo hands device views to the GPU, never reads them.
        unsafe { TensorView::on(device, self.ptr as *mut u8, dtype, &[n as i64], None, "t") }
            .map_err(|e| e.to_string())
    }
}

impl Drop for Buf {
    fn drop(&mut self) {
        // SAFETY: allocated by cuMemAlloc in the current context.
        let _ = unsafe { cu::free_sync(self.ptr) };
    }
}

fn encode(dtype: DType, v: &[f32]) -> Vec<u8> {
    let f32s = v.iter().flat_map(|x| x.to_le_bytes()).collect();
    fo::cast::cast(f32s, DType::F32, dtype, "selftest values").expect("floats cast to floats")
}

/// Inputs spanning small and large magnitudes, with exact zeros.
fn values(n: usize, seed: u64, scale: f32) -> Vec<f32> {
    let mut v = fill(n, seed, scale);
    for (i, x) in v.iter_mut().enumerate() {
        match i % 11 {
            0 => *x = 0.0,
            1 => *x *= 1e-6,
            2 => *x *= 1e3,
            _ => {}
        }
    }
    v
}

const SIZES: [usize; 4] = [1000, 33, 4097, 65543];
const STEPS: usize = 3;

/// One rule x format x dtype on both sides from the same inputs: mismatching elements
/// (params and state) of the GPU's plain step and of its overlapped one (each parameter
/// handed over alone, last to first, stepped early on the step lane), mismatching
/// entries of the checkpoints (`fo_state_pack`), and the parameters stepped early.
fn compare(device: Device, cfg: &OptimConfig, dtype: DType) -> Result<(usize, usize, u64), String> {
    let err = |e: fo::Error| e.to_string();
    let (mut cpu, mut gpu, mut ov) = (
        Optimizer::new(cfg.clone()).map_err(err)?,
        Optimizer::new(cfg.clone()).map_err(err)?,
        Optimizer::new(cfg.clone()).map_err(err)?,
    );
    let mut host: Vec<Vec<u8>> = Vec::new();
    let (mut dev, mut dev_ov): (Vec<Buf>, Vec<Buf>) = (Vec::new(), Vec::new());
    for (i, &n) in SIZES.iter().enumerate() {
        let bytes = encode(dtype, &values(n, 7 + i as u64, 2.0));
        dev.push(Buf::upload(&bytes)?);
        dev_ov.push(Buf::upload(&bytes)?);
        host.push(bytes);
    }
    for (i, &n) in SIZES.iter().enumerate() {
        let name = format!("p{i}");
        // SAFETY: the buffers outlive both optimizers (dropped after them, below).
        unsafe {
            let h = TensorView::host(host[i].as_mut_ptr(), dtype, &[n as i64], None, "p")
                .map_err(err)?;
            cpu.add_param(&name, h, None, 0).map_err(err)?;
            gpu.add_param(&name, dev[i].view(device, dtype, n)?, None, 0)
                .map_err(err)?;
            ov.add_param(&name, dev_ov[i].view(device, dtype, n)?, None, 0)
                .map_err(err)?;
        }
    }
    let mut early = 0;
    for s in 0..STEPS {
        let grads: Vec<Vec<u8>> = SIZES
            .iter()
            .enumerate()
            .map(|(i, &n)| encode(dtype, &values(n, 100 + (s * 10 + i) as u64, 0.1)))
            .collect();
        let dgrads = grads
            .iter()
            .map(|g| Buf::upload(g))
            .collect::<Result<Vec<_>, _>>()?;
        // SAFETY: host grads are live for the call; device grads until the synchronize.
        unsafe {
            let hv = grads
                .iter()
                .zip(SIZES)
                .map(|(g, n)| {
                    TensorView::host(g.as_ptr() as *mut u8, dtype, &[n as i64], None, "g").map(Some)
                })
                .collect::<Result<Vec<_>, _>>()
                .map_err(err)?;
            cpu.step(&hv).map_err(err)?;
            let dv = dgrads
                .iter()
                .zip(SIZES)
                .map(|(g, n)| g.view(device, dtype, n).map(Some))
                .collect::<Result<Vec<_>, _>>()?;
            gpu.step(&dv).map_err(err)?;
            let mut st = OverlapStats::default();
            ov.step_begin(OverlapOptions::default()).map_err(err)?;
            for (i, g) in dv.iter().enumerate().rev() {
                let g = g.as_ref().expect("every gradient is given");
                ov.grads_ready(&[i], std::slice::from_ref(g)).map_err(err)?;
            }
            ov.step_end(None, &mut st).map_err(err)?;
            early += st.speculative;
        }
        cuda("cuCtxSynchronize", cu::ctx::synchronize())?;
    }
    let mut bad = 0;
    let w = dtype.size();
    for i in 0..SIZES.len() {
        let want = cpu.param_state(i).ok_or("the CPU step created no state")?;
        for (buf, opt) in [(&dev[i], &gpu), (&dev_ov[i], &ov)] {
            let got = buf.download()?;
            bad += got
                .chunks(w)
                .zip(host[i].chunks(w))
                .filter(|(a, b)| a != b)
                .count();
            bad += state_mismatches(&opt.device_state(i).map_err(err)?, want);
        }
    }
    // The GPU state's checkpoint, staged through the host, is the CPU state's.
    let mut o = SaveOptions::new(0, 1, Mode::Compressed);
    o.params = Some(ParamsAs::Stored);
    let (a, b) = (pack(&cpu, &o).map_err(err)?, pack(&gpu, &o).map_err(err)?);
    let ckpt = a.entries.len().abs_diff(b.entries.len())
        + a.entries
            .iter()
            .zip(&b.entries)
            .filter(|(x, y)| x != y)
            .count();
    drop((cpu, gpu, ov));
    Ok((bad, ckpt, early))
}

/// Seconds of the best of `iters` GPU steps over `n` parameters in 64 tensors, and the
/// bytes one step moves per parameter (reads plus writes).
fn step_time(
    device: Device,
    cfg: &OptimConfig,
    dtype: DType,
    n: usize,
    iters: usize,
) -> Result<(f64, f64), String> {
    let err = |e: fo::Error| e.to_string();
    let k = 64;
    let sizes: Vec<usize> = (0..k).map(|i| n / k + usize::from(i < n % k)).collect();
    let mut opt = Optimizer::new(cfg.clone()).map_err(err)?;
    let (mut params, mut grads) = (Vec::new(), Vec::new());
    for (i, &s) in sizes.iter().enumerate() {
        params.push(Buf::upload(&encode(dtype, &fill(s, 10 + i as u64, 1.0)))?);
        grads.push(Buf::upload(&encode(
            dtype,
            &fill(s, 1000 + i as u64, 0.02),
        ))?);
        // SAFETY: the buffers outlive the optimizer (dropped after it).
        unsafe { opt.add_param(&format!("p{i}"), params[i].view(device, dtype, s)?, None, 0) }
            .map_err(err)?;
    }
    let gv = grads
        .iter()
        .zip(&sizes)
        .map(|(g, &s)| g.view(device, dtype, s).map(Some))
        .collect::<Result<Vec<_>, _>>()?;
    let mut times = Vec::new();
    for it in 0..=iters {
        cuda("cuCtxSynchronize", cu::ctx::synchronize())?;
        let t0 = Instant::now();
        // SAFETY: every buffer is live until the synchronize.
        unsafe { opt.step(&gv) }.map_err(err)?;
        cuda("cuCtxSynchronize", cu::ctx::synchronize())?;
        if it > 0 {
            times.push(t0.elapsed().as_secs_f64());
        }
    }
    let state = StateLayout::of(cfg, dtype).nbytes(n) as f64 / n as f64;
    let per_param = 3.0 * dtype.size() as f64 + 2.0 * state;
    drop(opt);
    Ok((best(times), per_param))
}

/// Seconds of the best of `iters` device-to-device copies of `bytes` bytes.
fn copy_time(bytes: usize, iters: usize) -> Result<f64, String> {
    // SAFETY: two fresh allocations of `bytes`; the copy stays within them.
    unsafe {
        let src = Buf {
            ptr: cuda("cuMemAlloc", cu::malloc_sync(bytes.max(1)))?,
            bytes,
        };
        let dst = Buf {
            ptr: cuda("cuMemAlloc", cu::malloc_sync(bytes.max(1)))?,
            bytes,
        };
        let mut times = Vec::new();
        for it in 0..=iters {
            cuda("cuCtxSynchronize", cu::ctx::synchronize())?;
            let t0 = Instant::now();
            cuda(
                "cuMemcpyDtoD",
                cu::memcpy_dtod_sync(dst.ptr, src.ptr, bytes),
            )?;
            cuda("cuCtxSynchronize", cu::ctx::synchronize())?;
            if it > 0 {
                times.push(t0.elapsed().as_secs_f64());
            }
        }
        Ok(best(times))
    }
}

/// `fo_clip_grad_norm` over device gradients against the same gradients in host memory:
/// (cases, mismatching totals, mismatching gradient elements after the clip).
fn clip_compare(device: Device) -> Result<(usize, usize, usize), String> {
    use fo::clip::{clip_grad_norm_checked, ClipGrad};
    let err = |e: fo::Error| e.to_string();
    let (mut cases, mut totals, mut elems) = (0, 0, 0);
    for dtype in [DType::F32, DType::BF16, DType::F16, DType::F64] {
        for p in [2.0, 1.0, f64::INFINITY, 3.0] {
            let srcs: Vec<Vec<u8>> = SIZES
                .iter()
                .enumerate()
                .map(|(k, &n)| {
                    let f32s = encode(DType::F32, &values(n, 50 + k as u64, 1.0));
                    fo::cast::cast(f32s, DType::F32, dtype, "clip values").expect("floats")
                })
                .collect();
            let mut host = srcs.clone();
            let dev: Vec<Buf> = srcs
                .iter()
                .map(|b| Buf::upload(b))
                .collect::<Result<_, _>>()?;
            let grads = |on_device: bool, host: &mut [Vec<u8>]| -> Result<Vec<ClipGrad>, String> {
                (0..SIZES.len())
                    .map(|k| {
                        let tensor = if on_device {
                            dev[k].view(device, dtype, SIZES[k])?
                        } else {
                            // SAFETY: a view of a live host buffer of this size.
                            unsafe {
                                TensorView::host(
                                    host[k].as_mut_ptr(),
                                    dtype,
                                    &[SIZES[k] as i64],
                                    None,
                                    "g",
                                )
                            }
                            .map_err(err)?
                        };
                        Ok(ClipGrad {
                            tensor,
                            is_shard: k % 2 == 0,
                        })
                    })
                    .collect()
            };
            let comm = fo::comm::Comm::local_group(1).pop().expect("one rank");
            let h = grads(false, &mut host)?;
            let d = grads(true, &mut host)?;
            // SAFETY: every gradient is live memory of its side for the calls.
            let want =
                unsafe { clip_grad_norm_checked(&comm, Ok(h), 0.5, p, false) }.map_err(err)?;
            let got =
                unsafe { clip_grad_norm_checked(&comm, Ok(d), 0.5, p, false) }.map_err(err)?;
            cases += 1;
            totals += usize::from(want.to_bits() != got.to_bits());
            for (b, hb) in dev.iter().zip(&host) {
                let w = dtype.size();
                let db = b.download()?;
                elems += db
                    .chunks(w)
                    .zip(hb.chunks(w))
                    .filter(|(x, y)| x != y)
                    .count();
            }
        }
    }
    Ok((cases, totals, elems))
}

/// `fo selftest` on CUDA device `device`: `size` parameters per throughput case, the best
/// of `iters` timed steps.
pub fn run(device: Device, size: usize, iters: usize) -> Result<(), String> {
    // fo compiles its kernels here (NVRTC), so a GPU it cannot use fails now, clearly.
    fo::device::open_device(device).map_err(|e| e.to_string())?;
    // The driver takes the C ordinal.
    let ordinal = device.to_c();
    let dev = cuda("cuDeviceGet", cu::device::get(ordinal))?;
    let name = cuda("cuDeviceGetName", cu::device::get_name(dev))?;
    // SAFETY: the device's primary context, current on this thread for the allocations.
    unsafe {
        let ctx = cuda("cuDevicePrimaryCtxRetain", cu::primary_ctx::retain(dev))?;
        cuda("cuCtxSetCurrent", cu::ctx::set_current(ctx))?;
    }
    println!("fo selftest on CUDA device {ordinal} ({name}): GPU vs CPU, bit for bit");
    let (mut combos, mut bad, mut bad_ckpt, mut early) = (0, 0, 0, 0);
    // Both arithmetics: fp32 state steps torch's rule under either, the compressed formats
    // FlashOptim's (exact) or fo's fast one, each with the host's bits.
    for arith in [Arithmetic::Exact, Arithmetic::Fast] {
        for (rule, base) in rules() {
            for format in FORMATS {
                if arith == Arithmetic::Fast && format == StateFormat::Fp32 {
                    continue;
                }
                for (dtype, mw) in [(DType::F32, 0), (DType::BF16, 24), (DType::F16, 32)] {
                    let mut cfg = base.clone();
                    (cfg.state_format, cfg.master_weight_bits) = (format, mw);
                    cfg.arithmetic = arith;
                    let (m, c, e) = compare(device, &cfg, dtype)?;
                    early += e;
                    if m + c > 0 {
                        println!(
                            "  {rule} {} {} {dtype} mw{mw}: {m} mismatching elements, {c} mismatching checkpoint entries",
                            arith.name(),
                            format.name()
                        );
                    }
                    (combos, bad, bad_ckpt) = (combos + 1, bad + m, bad_ckpt + c);
                }
            }
        }
    }
    println!(
        "{combos} combinations (rule x format x dtype, exact and fast) x {STEPS} steps, tensors of {SIZES:?} elements, plain and \
         overlapped ({early} of {} parameter steps early on the step lane): {bad} mismatching elements, {bad_ckpt} mismatching checkpoint entries",
        combos * STEPS * SIZES.len()
    );
    let (cases, bad_totals, bad_clip) = clip_compare(device)?;
    println!(
        "fo_clip_grad_norm, {cases} cases (f32/bf16/f16/f64 x p = 2, 1, inf, 3) on device vs host gradients: \
         {bad_totals} mismatching totals, {bad_clip} mismatching elements after the clip"
    );
    let n = size.max(64);
    let mut fp32 = OptimConfig::default_for(Algorithm::AdamW);
    (fp32.state_format, fp32.master_weight_bits) = (StateFormat::Fp32, 0);
    let q8 = OptimConfig::default_for(Algorithm::AdamW);
    let mut q8_bare = q8.clone();
    q8_bare.master_weight_bits = 0;
    // fo.torch's default for CUDA bf16 parameters: quant8 state without master bits, fast.
    let (mut q8_fast, mut q8_bare_fast) = (q8.clone(), q8_bare.clone());
    q8_fast.arithmetic = Arithmetic::Fast;
    q8_bare_fast.arithmetic = Arithmetic::Fast;
    println!(
        "throughput, {n} parameters in 64 tensors, best of {} steps:",
        iters
    );
    for (label, cfg, dtype) in [
        ("fp32 AdamW (f32 params, fp32 state)", fp32, DType::F32),
        (
            "AdamW bf16 + quant8 + 24-bit master, exact",
            q8,
            DType::BF16,
        ),
        (
            "AdamW bf16 + quant8 + 24-bit master, fast",
            q8_fast,
            DType::BF16,
        ),
        ("AdamW bf16 + quant8, exact", q8_bare, DType::BF16),
        (
            "AdamW bf16 + quant8, fast (fo.torch's default)",
            q8_bare_fast,
            DType::BF16,
        ),
    ] {
        let (t, per_param) = step_time(device, &cfg, dtype, n, iters)?;
        // A copy of S bytes reads S and writes S: the step's bytes are B = 2S.
        let bytes = per_param * n as f64;
        let tc = copy_time((bytes / 2.0) as usize, iters)?;
        println!(
            "  {label}: {:.1} G params/s, {:.0} GB/s at {per_param:.3} B/param = {:.2}x a device-to-device copy of the same bytes ({:.0} GB/s)",
            n as f64 / t / 1e9,
            bytes / t / 1e9,
            tc / t,
            bytes / tc / 1e9
        );
    }
    if bad + bad_ckpt > 0 {
        return Err(format!(
            "{bad} elements and {bad_ckpt} checkpoint entries differ between the GPU and the CPU step"
        ));
    }
    if bad_totals + bad_clip > 0 {
        return Err(format!(
            "fo_clip_grad_norm: {bad_totals} totals and {bad_clip} elements differ between device and host gradients"
        ));
    }
    let steps = (combos * STEPS * SIZES.len()) as u64;
    if early != steps {
        return Err(format!(
            "the overlapped step stepped {early} of {steps} device parameter steps early (no undo budget was set: all of them should)"
        ));
    }
    Ok(())
}
