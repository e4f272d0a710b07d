//! Shared helpers for the optimizer tests: read `tests/oracle/optim/` with the
//! `safetensors` crate.
#![allow(dead_code)]
use safetensors::SafeTensors;

pub fn oracle_path(file: &str) -> std::path::PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/oracle/optim")
        .join(file)
}

pub fn read(file: &str) -> Vec<u8> {
    std::fs::read(oracle_path(file)).unwrap_or_else(|e| panic!("{file}: {e}"))
}

pub fn manifest() -> serde_json::Value {
    serde_json::from_slice(&read("manifest.json")).unwrap()
}

pub struct Oracle<'a>(pub SafeTensors<'a>);

impl<'a> Oracle<'a> {
    pub fn new(bytes: &'a [u8]) -> Oracle<'a> {
        Oracle(SafeTensors::deserialize(bytes).unwrap())
    }
    pub fn has(&self, key: &str) -> bool {
        self.0.tensor(key).is_ok()
    }
    fn raw(&self, key: &str) -> safetensors::tensor::TensorView<'a> {
        self.0
            .tensor(key)
            .unwrap_or_else(|e| panic!("oracle key {key}: {e}"))
    }
    pub fn shape(&self, key: &str) -> Vec<usize> {
        self.raw(key).shape().to_vec()
    }
    pub fn dtype(&self, key: &str) -> safetensors::Dtype {
        self.raw(key).dtype()
    }
    pub fn bytes(&self, key: &str) -> Vec<u8> {
        self.raw(key).data().to_vec()
    }
    pub fn f32(&self, key: &str) -> Vec<f32> {
        let t = self.raw(key);
        match t.dtype() {
            safetensors::Dtype::F32 => t
                .data()
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
                .collect(),
            safetensors::Dtype::BF16 => self
                .u16(key)
                .iter()
                .map(|&b| f32::from_bits((b as u32) << 16))
                .collect(),
            safetensors::Dtype::F16 => self
                .u16(key)
                .iter()
                .map(|&b| half::f16::from_bits(b).to_f32())
                .collect(),
            safetensors::Dtype::I64 => t
                .data()
                .chunks_exact(8)
                .map(|c| i64::from_le_bytes(c.try_into().unwrap()) as f32)
                .collect(),
            d => panic!("{key}: cannot read {d:?} as f32"),
        }
    }
    /// Raw 16-bit patterns (bf16 / f16 / i16).
    pub fn u16(&self, key: &str) -> Vec<u16> {
        self.raw(key)
            .data()
            .chunks_exact(2)
            .map(|c| u16::from_le_bytes([c[0], c[1]]))
            .collect()
    }
    pub fn i16(&self, key: &str) -> Vec<i16> {
        self.u16(key).into_iter().map(|b| b as i16).collect()
    }
    pub fn i8(&self, key: &str) -> Vec<i8> {
        self.raw(key).data().iter().map(|&b| b as i8).collect()
    }
    pub fn u8(&self, key: &str) -> Vec<u8> {
        self.raw(key).data().to_vec()
    }
}

/// Cosine and normalized MSE (Σ(a−b)²/Σb²) in f64, as the oracle README defines them.
pub fn cosine_nmse(a: &[f32], b: &[f32]) -> (f64, f64) {
    assert_eq!(a.len(), b.len());
    let (mut ab, mut aa, mut bb, mut d2) = (0f64, 0f64, 0f64, 0f64);
    for (&x, &y) in a.iter().zip(b) {
        let (x, y) = (x as f64, y as f64);
        ab += x * y;
        aa += x * x;
        bb += y * y;
        d2 += (x - y) * (x - y);
    }
    (ab / (aa.sqrt() * bb.sqrt()), d2 / bb)
}

/// Bit equality that treats every NaN as equal to every NaN.
pub fn same_f32(a: f32, b: f32) -> bool {
    a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan())
}

use fo::optim::{Algorithm, OptimConfig, Optimizer, StateFormat};
use fo::{DType, TensorView};

/// The optimizer config of a manifest case (torch, lion-pytorch or FlashOptim kwargs).
pub fn config_for(case: &serde_json::Value, format: StateFormat) -> OptimConfig {
    let alg = match case["optimizer"].as_str().unwrap() {
        "torch.optim.AdamW" | "flashoptim.FlashAdamW" => Algorithm::AdamW,
        "torch.optim.Adam" | "flashoptim.FlashAdam" => Algorithm::Adam,
        "torch.optim.SGD" | "flashoptim.FlashSGD" => Algorithm::Sgd,
        "lion_pytorch.Lion" | "flashoptim.FlashLion" => Algorithm::Lion,
        o => panic!("unknown optimizer {o}"),
    };
    let k = &case["constructor_kwargs"];
    let f = |name: &str, d: f64| k[name].as_f64().unwrap_or(d);
    let mut c = OptimConfig::default_for(alg);
    c.lr = f("lr", 1e-3);
    c.initial_lr = c.lr;
    if let Some(b) = k["betas"].as_array() {
        c.beta1 = b[0].as_f64().unwrap();
        c.beta2 = b[1].as_f64().unwrap();
    }
    c.eps = f("eps", c.eps);
    c.weight_decay = f("weight_decay", 0.0);
    c.momentum = f("momentum", 0.0);
    c.dampening = f("dampening", 0.0);
    c.nesterov = k["nesterov"].as_bool().unwrap_or(false);
    c.decouple_lr = k["decoupled_weight_decay"].as_bool().unwrap_or(false);
    c.state_format = format;
    c.master_weight_bits = k["master_weight_bits"].as_u64().unwrap_or(0) as u32;
    c
}

/// Parameters owned by a test, registered with an optimizer.
pub struct Run {
    pub opt: Optimizer,
    pub bufs: Vec<Vec<u8>>,
    pub shapes: Vec<Vec<usize>>,
    pub dtype: DType,
}

pub fn dtype_of(d: safetensors::Dtype) -> DType {
    DType::from_safetensors_name(&format!("{d:?}")).unwrap()
}

impl Run {
    /// Registers `p{i}.init` of the oracle file with `cfg`.
    pub fn new(o: &Oracle, n_params: usize, cfg: OptimConfig) -> Run {
        let mut opt = Optimizer::new(cfg).unwrap();
        let mut bufs: Vec<Vec<u8>> = (0..n_params)
            .map(|i| o.bytes(&format!("p{i}.init")))
            .collect();
        let shapes: Vec<Vec<usize>> = (0..n_params)
            .map(|i| o.shape(&format!("p{i}.init")))
            .collect();
        let dtype = dtype_of(o.dtype("p0.init"));
        for (i, b) in bufs.iter_mut().enumerate() {
            let shape: Vec<i64> = shapes[i].iter().map(|&s| s as i64).collect();
            let t =
                unsafe { TensorView::host(b.as_mut_ptr(), dtype, &shape, None, "param").unwrap() };
            unsafe { opt.add_param(&format!("p{i}"), t, None, 0).unwrap() };
        }
        Run {
            opt,
            bufs,
            shapes,
            dtype,
        }
    }

    /// Steps with `p{i}.grads[t]`.
    pub fn step(&mut self, o: &Oracle, t: usize) {
        let mut grads: Vec<Vec<u8>> = Vec::new();
        for i in 0..self.bufs.len() {
            let all = o.bytes(&format!("p{i}.grads"));
            let per = all.len() / o.shape(&format!("p{i}.grads"))[0];
            grads.push(all[t * per..(t + 1) * per].to_vec());
        }
        let gdt = dtype_of(o.dtype("p0.grads"));
        let views: Vec<Option<TensorView>> = grads
            .iter_mut()
            .zip(&self.shapes)
            .map(|(g, s)| {
                let shape: Vec<i64> = s.iter().map(|&x| x as i64).collect();
                Some(unsafe {
                    TensorView::host(g.as_mut_ptr(), gdt, &shape, None, "grad").unwrap()
                })
            })
            .collect();
        unsafe { self.opt.step(&views).unwrap() };
    }

    pub fn param_f32(&self, i: usize) -> Vec<f32> {
        fo::Tensor {
            dtype: self.dtype,
            shape: self.shapes[i].clone(),
            data: self.bufs[i].clone(),
        }
        .to_f32()
        .unwrap()
    }
}

/// Row `t` of a per-step oracle tensor `[T, *shape]`, as raw bytes.
pub fn row(o: &Oracle, key: &str, t: usize) -> Vec<u8> {
    let all = o.bytes(key);
    let per = all.len() / o.shape(key)[0];
    all[t * per..(t + 1) * per].to_vec()
}

pub fn f32s(b: &[u8]) -> Vec<f32> {
    b.chunks_exact(4)
        .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
        .collect()
}

pub fn case(part: &str, name: &str) -> serde_json::Value {
    let m = manifest();
    let list = if part == "torch" {
        &m["torch_reference"]["cases"]
    } else {
        &m["flashoptim"]["trajectories"]
    };
    list.as_array()
        .unwrap()
        .iter()
        .find(|c| c["name"] == name)
        .unwrap_or_else(|| panic!("no case {name}"))
        .clone()
}
