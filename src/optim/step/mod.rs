//! The step's entry: `step` (validate every gradient, then step device parameters on
//! their GPU while host ones step on the CPU), and the helpers only steps use.
use rayon::prelude::*;

pub mod numerics;

use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::kernels::host::{self as kernel, push_jobs, Job};
use crate::optim::math::config::OptimConfig;
use crate::optim::math::rule::Rule;
use crate::optim::optimizer::{is_param_dtype, Optimizer, Param};
use crate::optim::threads;
use crate::tensor::TensorView;

/// Counts host parameter `p`'s step (when it has state) and gives the rule for it and
/// SGD's `first` flag; None without state.
pub(in crate::optim) fn begin_param_step(p: &mut Param, cfg: &OptimConfig) -> Option<(Rule, bool)> {
    let st = p.state.as_mut()?;
    st.step += 1;
    // torch's SGD copies the first gradient into a buffer that did not exist yet.
    let first = !st.m_valid;
    st.m_valid = true;
    Some((Rule::new(cfg, st.step), first))
}

/// Advances host parameter `p`'s step (when it has state) and pushes the jobs that step
/// it with gradient bytes `g` of `grad_dtype`.
///
/// # Safety
/// `p`'s memory must be valid for the jobs' lifetime.
pub(in crate::optim) unsafe fn push_param_jobs<'a>(
    jobs: &mut Vec<Job<'a>>,
    p: &'a mut Param,
    cfg: &OptimConfig,
    g: &'a [u8],
    grad_dtype: DType,
) {
    let Some((rule, first)) = begin_param_step(p, cfg) else {
        return;
    };
    if p.tensor().numel() > 0 {
        let (tensor, state) = p.tensor_and_state();
        let st = state.as_mut().expect("begin_param_step saw state");
        push_jobs(jobs, tensor, g, grad_dtype, st, rule, first);
    }
}

impl Optimizer {
    /// Checks gradient `g` of parameter `i` as `step` does: its shape, dtype and device,
    /// and that it does not overlap parameter memory the step writes.
    pub(in crate::optim) fn check_grad(&self, i: usize, g: &TensorView) -> Result<()> {
        let p = self.entry(i);
        if g.shape() != p.tensor().shape() {
            return Err(Error::Shape(format!(
                "gradient of {}: shape {:?} does not match the parameter's {:?}",
                p.fqn(),
                g.shape(),
                p.tensor().shape()
            )));
        }
        if !is_param_dtype(g.dtype()) {
            return Err(Error::Dtype(format!(
                "gradient of {}: dtype {} is not one of F32, BF16, F16",
                p.fqn(),
                g.dtype()
            )));
        }
        self.check_grad_device(i, g)?;
        // Parameters are written while gradients are read, from several threads (or
        // GPU threads: the check compares addresses only).
        if let Some(q) = self.overlapping_param(g) {
            return Err(Error::invalid(
                "grads",
                format!(
                    "the gradient of {} overlaps the memory of parameter {}, which the step writes",
                    p.fqn(),
                    self.entry(q).fqn()
                ),
            ));
        }
        Ok(())
    }

    /// One optimizer step. `grads[i]` is parameter `i`'s gradient, `None` to skip it
    /// (no state is created for it), on its parameter's device, or on a CUDA device for a
    /// host parameter (the offload case). Device parameters step on the GPU (one launch
    /// per param group and device, on the optimizer's stream, not waited for) while host
    /// parameters step on the CPU. Everything is validated before anything is written: on
    /// error, parameters and state are unchanged (a CUDA error while launching is
    /// reported, and then the device parameters' state is undefined).
    ///
    /// # Safety
    /// Every gradient must be valid for reads for the call (device gradients: memory of
    /// their device, valid until the launched kernels have run); registered parameters
    /// must still be valid.
    pub unsafe fn step(&mut self, grads: &[Option<TensorView>]) -> Result<()> {
        self.refuse_if_step_open("step")?;
        if grads.len() != self.num_params() {
            return Err(Error::invalid(
                "grads",
                format!(
                    "{} gradients given for {} parameters",
                    grads.len(),
                    self.num_params()
                ),
            ));
        }
        // Strided gradients are gathered into contiguous copies first, on the pool when
        // there are several (each copy is one thread's: a transposed 1024 x 1024 f32 one
        // took about 0.8 ms on one core of the development VM).
        let mut strided = Vec::new();
        for (i, g) in grads.iter().enumerate() {
            if let Some(g) = g {
                self.check_grad(i, g)?;
                if !g.is_contiguous() && !g.device().is_cuda() {
                    strided.push(i);
                }
            }
        }
        let gather = |&i: &usize| -> Result<(usize, Vec<u8>)> {
            let g = grads[i].as_ref().expect("a strided gradient is given");
            Ok((i, g.try_to_tensor("grads")?.data))
        };
        let copies: Vec<(usize, Vec<u8>)> = match strided.len() {
            0 | 1 => strided.iter().map(gather).collect::<Result<_>>()?,
            _ => threads::pool()?
                .install(|| strided.par_iter().map(gather).collect::<Result<_>>())?,
        };
        let mut gathered: Vec<Option<Vec<u8>>> = vec![None; grads.len()];
        for (i, v) in copies {
            gathered[i] = Some(v);
        }
        // Device gradients are never read on the host: the kernel reads them, or they
        // come down through the device's pinned ring first (the offload case).
        let staged: Vec<(usize, Vec<u8>)>;
        let mut grad_bytes: Vec<Option<&[u8]>> = grads
            .iter()
            .zip(&gathered)
            .map(|(g, own)| match (g, own) {
                (None, _) => None,
                (Some(g), _) if g.device().is_cuda() => None,
                (Some(_), Some(v)) => Some(&v[..]),
                (Some(g), None) => g.contiguous_bytes(),
            })
            .collect();
        let pool = threads::pool()?;
        // Host parameters with device gradients (the offload case): the gradients come
        // down all at once where check_numerics must read them first, else one by one
        // while the CPU steps (`offload_step`).
        let offloaded = self.offloaded(grads);
        let mut pipelined = offloaded.clone();
        if offloaded
            .iter()
            .any(|&(i, _)| self.param_config(i).check_numerics)
        {
            staged = self.download_all(grads, &offloaded)?;
            for (i, b) in &staged {
                grad_bytes[*i] = Some(&b[..]);
            }
            pipelined.clear();
        }
        // A hand-off to the pool and back costs tens of microseconds (its threads sleep):
        // a step with nothing for the host (every gradient a device parameter's) skips it.
        if grad_bytes.iter().any(Option::is_some) {
            pool.install(|| numerics::check(self, grads, &grad_bytes))?;
        }
        let device_step = self.prepare_device_step(grads)?;
        // An async save in flight gets what it still needs of every parameter this step
        // writes before anything is written (a failure here changes nothing), and its
        // writer waits for the step's end.
        let _mark = self.mark_step();
        for (i, g) in grads.iter().enumerate() {
            if g.is_some() {
                self.before_write(i)?;
            }
        }
        let undo = numerics::Undo::capture(self, &grad_bytes)?;

        // From here on nothing can fail but a CUDA launch or copy (see `step`), or a
        // non-finite result under check_numerics. The GPU half is launched first, so it
        // runs while the CPU steps the host parameters; under check_numerics, after the
        // host result is known good, so a rolled-back step changed nothing anywhere.
        let device_step = if undo.is_empty() {
            self.run_device_step(device_step, self.stream())?;
            None
        } else {
            Some(device_step)
        };
        for (i, g) in grad_bytes.iter().enumerate() {
            let offload = pipelined.iter().any(|&(j, _)| j == i);
            if (g.is_some() || offload) && self.entry(i).state.is_none() {
                self.entry_mut(i).state = Some(self.new_state(i));
            }
        }
        let mut jobs: Vec<Job<'_>> = Vec::new();
        let (params, groups) = self.params_mut_with_groups();
        for ((p, g), gt) in params.iter_mut().zip(&grad_bytes).zip(grads) {
            if let (Some(gb), Some(gt)) = (g, gt) {
                push_param_jobs(&mut jobs, p, &groups[p.group()], gb, gt.dtype());
            }
        }
        if !jobs.is_empty() {
            pool.install(|| jobs.into_par_iter().for_each(kernel::run));
        }
        undo.check_result(self)?;
        if let Some(d) = device_step {
            self.run_device_step(d, self.stream())?;
        }
        let stepped = grad_bytes.iter().enumerate().filter(|(_, g)| g.is_some());
        self.write_mirrors(stepped.map(|(i, _)| i).collect::<Vec<_>>())?;
        self.step_offloaded(grads, &pipelined)
    }
}
