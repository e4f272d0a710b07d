//! One rank of the demo's data-parallel, FSDP2-style training: it holds a `Shard(0)`
//! slice of every parameter in bf16, all-gathers full weights for forward/backward,
//! all-reduces gradients, clips the global norm and steps its shards with fo: in one
//! sequential step (`clip_grad_norm`, then `step`), or overlapped (`step_begin`, each
//! layer's gradient handed over in backward's order, `step_end` clipping through the comm).
use fo::comm::{Comm, ReduceOp};
use fo::optim::overlap::{OverlapOptions, OverlapStats};
use fo::optim::{Algorithm, OptimConfig, Optimizer, StateFormat};
use fo::shard::{chunk_range, Placement, ShardSpec};
use fo::{DType, Result, TensorView};

use super::mlp::{self, PARAMS};

/// What every rank agrees on before training.
#[derive(Clone)]
pub struct Setup {
    pub seed: u64,
    pub steps: usize,
    pub batch: usize,
    pub lr: f64,
    pub max_norm: f64,
    /// Step with the overlapped step (`step_begin` / `grads_ready` / `step_end`).
    pub overlap: bool,
    /// Per parameter: true when the offload planner put it on the host.
    pub offloaded: Vec<bool>,
}

impl Setup {
    /// Cosine decay from `lr` to 10% of it: a schedule, so param groups change between steps.
    pub fn lr_at(&self, step: usize) -> f64 {
        let t = step as f64 / self.steps.max(1) as f64;
        self.lr * (0.1 + 0.9 * 0.5 * (1.0 + (std::f64::consts::PI * t).cos()))
    }

    pub fn teacher(&self) -> Vec<Vec<f32>> {
        mlp::init_params(self.seed.wrapping_add(1))
    }
}

pub struct Rank {
    pub comm: Comm,
    pub specs: Vec<ShardSpec>,
    /// bf16 bit patterns of this rank's shards; the optimizer updates them in place, so
    /// these buffers never reallocate.
    pub params: Vec<Vec<u16>>,
    pub opt: Optimizer,
    teacher: Vec<Vec<f32>>,
}

pub fn spec_for(shape: &[usize], world: usize, rank: usize) -> Result<ShardSpec> {
    ShardSpec::new(
        shape.to_vec(),
        vec![world],
        vec![rank],
        vec![Placement::Shard(0)],
    )
}

pub fn bf16_bits(x: f32) -> u16 {
    half::bf16::from_f32(x).to_bits()
}

pub fn bf16_value(b: u16) -> f32 {
    half::bf16::from_bits(b).to_f32()
}

impl Rank {
    /// A rank with its shards of `full` (f32 values, rounded to bf16), group 0 holding the
    /// planner's host-offloaded parameters and group 1 the rest.
    pub fn new(comm: Comm, setup: &Setup, full: &[Vec<f32>]) -> Result<Rank> {
        let (world, rank) = (comm.world_size(), comm.rank());
        let mut cfg = OptimConfig::default_for(Algorithm::AdamW);
        cfg.lr = setup.lr;
        cfg.weight_decay = 0.01;
        cfg.state_format = StateFormat::Quant8;
        cfg.master_weight_bits = 24;
        let mut opt = Optimizer::new(cfg.clone())?;
        let device_group = opt.add_param_group(cfg)?;
        let mut specs = Vec::new();
        let mut params = Vec::new();
        for (i, (_, shape)) in PARAMS.iter().enumerate() {
            let spec = spec_for(shape, world, rank)?;
            params.push(
                local_rows(&full[i], shape, &spec)?
                    .into_iter()
                    .map(bf16_bits)
                    .collect::<Vec<u16>>(),
            );
            specs.push(spec);
        }
        for (i, (name, _)) in PARAMS.iter().enumerate() {
            let group = if setup.offloaded[i] { 0 } else { device_group };
            let view = host_view(
                params[i].as_mut_ptr() as *mut u8,
                DType::BF16,
                &specs[i].local_shape(),
            )?;
            // SAFETY: `params[i]` is owned by this Rank, never reallocated, and outlives `opt`.
            unsafe { opt.add_param(name, view, Some(specs[i].clone()), group)? };
        }
        Ok(Rank {
            comm,
            specs,
            params,
            opt,
            teacher: setup.teacher(),
        })
    }

    /// Full f32 parameters, all-gathered: every rank contributes its rows, zeros elsewhere.
    pub fn gather_full(&self) -> Result<Vec<Vec<f32>>> {
        let sizes: Vec<usize> = PARAMS.iter().map(|(_, s)| mlp::numel(s)).collect();
        let mut flat = vec![0f32; sizes.iter().sum()];
        let mut at = 0;
        for (i, (_, shape)) in PARAMS.iter().enumerate() {
            let rows = self.specs[i].runs(0)?;
            let row_len: usize = shape[1..].iter().product();
            if let Some(r) = rows.0.first() {
                let dst = &mut flat[at + r.start * row_len..at + r.end * row_len];
                for (d, &b) in dst.iter_mut().zip(&self.params[i]) {
                    *d = bf16_value(b);
                }
            }
            at += sizes[i];
        }
        self.comm.all_reduce_f32_sum(&mut flat)?;
        let mut out = Vec::new();
        let mut at = 0;
        for s in sizes {
            out.push(flat[at..at + s].to_vec());
            at += s;
        }
        Ok(out)
    }

    /// One training step; returns (global mean loss, global grad norm before clipping,
    /// the exposed step time in seconds: from the last gradient ready to the step done).
    pub fn step(&mut self, setup: &Setup, step: usize) -> Result<(f64, f64, f64)> {
        let full = self.gather_full()?;
        let mut grads: Vec<Vec<f32>> = full.iter().map(|v| vec![0f32; v.len()]).collect();
        let mine = chunk_range(setup.batch, self.comm.world_size(), self.comm.rank());
        let mut loss = 0f64;
        for index in mine {
            let (x, t) = mlp::sample(setup.seed, step, index, &self.teacher);
            loss += mlp::backward(&full, &x, &t, 1.0 / setup.batch as f32, &mut grads);
        }
        // Gradient average: the local sums are already scaled by 1/global_batch.
        let mut flat: Vec<f32> = grads.concat();
        self.comm.all_reduce_f32_sum(&mut flat)?;
        let mut l = [loss];
        self.comm.all_reduce_f64(&mut l, ReduceOp::Sum)?;
        let mut shards: Vec<Vec<f32>> = Vec::new();
        let mut at = 0;
        for (i, (_, shape)) in PARAMS.iter().enumerate() {
            let n = mlp::numel(shape);
            shards.push(local_rows(&flat[at..at + n], shape, &self.specs[i])?);
            at += n;
        }
        let mut views = Vec::new();
        for (g, spec) in shards.iter_mut().zip(&self.specs) {
            views.push(host_view(
                g.as_mut_ptr() as *mut u8,
                DType::F32,
                &spec.local_shape(),
            )?);
        }
        for g in 0..self.opt.num_groups() {
            self.opt.set_group_lr(g, setup.lr_at(step))?;
        }
        let loss = l[0] / setup.batch as f64;
        if setup.overlap {
            let (norm, exposed) = self.overlapped(setup, &views)?;
            return Ok((loss, norm, exposed));
        }
        let t = std::time::Instant::now();
        let with_flags: Vec<(TensorView, bool)> = views.iter().map(|v| (v.clone(), true)).collect();
        // SAFETY: the views point into `shards`, alive and unaliased for these calls.
        let norm = unsafe {
            fo::clip::clip_grad_norm(&self.comm, &with_flags, setup.max_norm, 2.0, true)?
        };
        let grads: Vec<Option<TensorView>> = views.into_iter().map(Some).collect();
        unsafe { self.opt.step(&grads)? };
        Ok((loss, norm, t.elapsed().as_secs_f64()))
    }

    /// The overlapped step: each layer's gradient handed over last layer first (the order
    /// backward makes them final), the clip norm combined at `step_end` through the comm.
    /// Returns (total norm, seconds from the last gradient handed over to step_end done).
    fn overlapped(&mut self, setup: &Setup, views: &[TensorView]) -> Result<(f64, f64)> {
        let opts = OverlapOptions {
            max_norm: setup.max_norm,
            error_if_nonfinite: true,
            ..OverlapOptions::default()
        };
        let mut stats = OverlapStats::default();
        // SAFETY: the views point into the caller's gradient buffers, alive and unchanged
        // until step_end returns; nothing else touches `opt` meanwhile.
        unsafe {
            self.opt.step_begin(opts)?;
            for i in (0..views.len()).rev() {
                self.opt.grads_ready(&[i], &views[i..i + 1])?;
            }
            let t = std::time::Instant::now();
            self.opt.step_end(Some(&self.comm), &mut stats)?;
            Ok((stats.total_norm, t.elapsed().as_secs_f64()))
        }
    }

    /// Local parameter elements (what the optimizer steps on this rank).
    pub fn local_numel(&self) -> usize {
        self.params.iter().map(Vec::len).sum()
    }
}

/// The rows of a row-major `full` tensor that `spec` holds along dim 0 (one run: Shard(0)).
pub fn local_rows(full: &[f32], shape: &[usize], spec: &ShardSpec) -> Result<Vec<f32>> {
    let row_len: usize = shape[1..].iter().product();
    Ok(spec
        .runs(0)?
        .0
        .iter()
        .flat_map(|r| full[r.start * row_len..r.end * row_len].iter().copied())
        .collect())
}

pub fn host_view(ptr: *mut u8, dtype: DType, shape: &[usize]) -> Result<TensorView> {
    let shape: Vec<i64> = shape.iter().map(|&d| d as i64).collect();
    // SAFETY: callers pass a pointer to a live buffer of exactly `shape` elements.
    unsafe { TensorView::host(ptr, dtype, &shape, None, "demo tensor") }
}
