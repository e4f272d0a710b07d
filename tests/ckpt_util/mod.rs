//! In-process ranks of a small model for the checkpoint tests: each rank owns an
//! `Optimizer` over its local shards of the same global parameters, stepped with its
//! slices of the same global gradients.
#![allow(dead_code)]
use fo::ckpt::local_shard;
use fo::optim::{Algorithm, OptimConfig, Optimizer, StateFormat};
use fo::shard::{Placement, ShardSpec};
use fo::tensor::TensorView;
use fo::{DType, Tensor};

/// (fqn, global shape, placement on a 1-D mesh, has a gradient)
pub const MODEL: [(&str, &[usize], &str, bool); 6] = [
    ("fc.weight", &[10, 7], "S0", true),
    ("fc.bias", &[10], "S0", true),
    ("head.weight", &[6, 5], "SS0:2", true),
    ("head.bias", &[3], "R", true),
    ("frozen", &[4], "S0", false),
    ("empty", &[0, 4], "S0", true),
];

pub fn config(format: StateFormat, bits: u32) -> OptimConfig {
    let mut c = OptimConfig::default_for(Algorithm::AdamW);
    c.lr = 1e-2;
    c.state_format = format;
    c.master_weight_bits = bits;
    c
}

pub fn value(i: usize, seed: f32) -> f32 {
    ((i as f32 * 0.731 + seed).sin() * 0.5 + (i % 7) as f32 * 0.01)
        * if i.is_multiple_of(3) { 3.0 } else { 1.0 }
}

pub fn global(dtype: DType, shape: &[usize], seed: f32) -> Tensor {
    let n: usize = shape.iter().product();
    let v: Vec<f32> = (0..n).map(|i| value(i, seed)).collect();
    let t = Tensor::from_f32(shape.to_vec(), &v).unwrap();
    match dtype {
        DType::F32 => t,
        _ => Tensor::new(
            DType::BF16,
            shape.to_vec(),
            v.iter()
                .flat_map(|x| half::bf16::from_f32(*x).to_bits().to_le_bytes())
                .collect(),
        )
        .unwrap(),
    }
}

pub fn spec(shape: &[usize], placement: &str, world: usize, rank: usize) -> ShardSpec {
    let p: Placement = placement.parse().unwrap();
    ShardSpec::new(shape.to_vec(), vec![world], vec![rank], vec![p]).unwrap()
}

/// Caller memory for params and grads: u64 words keep every dtype aligned.
pub struct Buf(Vec<u64>, Tensor);

impl Buf {
    pub fn new(t: Tensor) -> Buf {
        let mut words = vec![0u64; t.data.len().div_ceil(8)];
        unsafe {
            std::ptr::copy_nonoverlapping(
                t.data.as_ptr(),
                words.as_mut_ptr() as *mut u8,
                t.data.len(),
            )
        };
        Buf(words, t)
    }
    pub fn view(&mut self) -> TensorView {
        let shape: Vec<i64> = self.1.shape.iter().map(|&d| d as i64).collect();
        unsafe {
            TensorView::host(
                self.0.as_mut_ptr() as *mut u8,
                self.1.dtype,
                &shape,
                None,
                "t",
            )
            .unwrap()
        }
    }
    pub fn bytes(&self) -> &[u8] {
        unsafe { std::slice::from_raw_parts(self.0.as_ptr() as *const u8, self.1.data.len()) }
    }
}

pub struct Rank {
    pub opt: Optimizer,
    pub params: Vec<Buf>,
    pub specs: Vec<ShardSpec>,
    pub dtype: DType,
}

impl Rank {
    /// Rank `rank` of `world`, with `layout(placement)` choosing each param's placement.
    pub fn new(world: usize, rank: usize, cfg: OptimConfig, dtype: DType) -> Rank {
        let mut opt = Optimizer::new(cfg).unwrap();
        let mut params = Vec::new();
        let mut specs = Vec::new();
        for (k, (fqn, shape, pl, _)) in MODEL.iter().enumerate() {
            let s = spec(shape, pl, world, rank);
            let mut b = Buf::new(local_shard(&global(dtype, shape, k as f32), &s));
            let sp = if world == 1 { None } else { Some(s.clone()) };
            unsafe { opt.add_param(fqn, b.view(), sp, 0).unwrap() };
            params.push(b);
            specs.push(s);
        }
        Rank {
            opt,
            params,
            specs,
            dtype,
        }
    }

    /// One step with this rank's slices of the global gradients of step `t`.
    pub fn step(&mut self, t: usize) {
        let mut grads: Vec<Option<Buf>> = MODEL
            .iter()
            .zip(&self.specs)
            .enumerate()
            .map(|(k, ((_, shape, _, has), s))| {
                has.then(|| {
                    Buf::new(local_shard(
                        &global(self.dtype, shape, 100.0 + (t * 10 + k) as f32),
                        s,
                    ))
                })
            })
            .collect();
        let views: Vec<Option<TensorView>> = grads
            .iter_mut()
            .map(|g| g.as_mut().map(Buf::view))
            .collect();
        unsafe { self.opt.step(&views).unwrap() };
    }
}

pub fn ranks(world: usize, cfg: &OptimConfig, dtype: DType, steps: usize) -> Vec<Rank> {
    (0..world)
        .map(|r| {
            let mut rank = Rank::new(world, r, cfg.clone(), dtype);
            for t in 0..steps {
                rank.step(t);
            }
            rank
        })
        .collect()
}

pub fn tmp(name: &str) -> std::path::PathBuf {
    let d = std::env::temp_dir().join(format!("fo-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    d
}
