//! Reading a parameter's state by key, as torch and FlashOptim name it (writing is in
//! `state_set`): `step`, `exp_avg`, `exp_avg_sq`, `momentum_buffer` (decoded f32, any
//! format), the raw compressed keys `<name>::quantized` / `<name>::scales` and
//! `error_bits`, and `master` (the f32 master weight: the param, completed by its error
//! bits).
use half::f16;

use super::config::Algorithm;
use super::optimizer::Optimizer;
use crate::ckpt::naming::{
    self, split_state_name, CODES_PART, ERROR_BITS, EXP_AVG, EXP_AVG_SQ, MASTER, MOMENTUM_BUFFER,
    SCALES_PART, STEP,
};
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::optim::math::master_split::{reconstruct_one, Half};
use crate::optim::math::state::{ErrorBits, Moment};
use crate::optim::placement::staging::StagedParam;
use crate::tensor::Tensor;

/// The name of the momentum-like state of an algorithm.
pub(super) fn m_name(a: Algorithm) -> &'static str {
    if a.is_sgd() {
        MOMENTUM_BUFFER
    } else {
        EXP_AVG
    }
}

fn moment_keys(name: &str, m: &Moment, out: &mut Vec<String>) {
    match m {
        Moment::F32(_) | Moment::Half(..) => out.push(name.to_string()),
        Moment::Signed { .. } | Moment::Unsigned { .. } => {
            out.push(naming::codes_key(name));
            out.push(naming::scales_key(name));
        }
    }
}

pub(super) fn le_bytes<T: Copy, const N: usize>(v: &[T], f: impl Fn(T) -> [u8; N]) -> Vec<u8> {
    v.iter().flat_map(|&x| f(x)).collect()
}

fn f32_tensor(shape: &[usize], v: &[f32]) -> Tensor {
    Tensor {
        dtype: DType::F32,
        shape: shape.to_vec(),
        data: le_bytes(v, f32::to_le_bytes),
    }
}

/// A float tensor's values as f32, or an error naming the key.
pub(super) fn values(key: &str, t: &Tensor) -> Result<Vec<f32>> {
    match t.dtype {
        DType::F32 | DType::F64 | DType::BF16 | DType::F16 => t.to_f32(),
        d => Err(Error::Dtype(format!(
            "state key {key}: a {d} tensor was given where a float tensor is expected"
        ))),
    }
}

impl Optimizer {
    /// The keys `get_state` / checkpoints use for parameter `i`'s native state (empty
    /// before its first step). `step` is listed for Adam/AdamW, as torch stores it. An
    /// out-of-range `i` is an error naming `index`.
    pub fn state_keys(&self, i: usize) -> Result<Vec<String>> {
        self.check_index(i)?;
        Ok(self.keys_of(i))
    }

    /// `state_keys` for internal loops over known indices (unchecked).
    pub(crate) fn keys_of(&self, i: usize) -> Vec<String> {
        let p = &self.params[i];
        // A device state's keys follow from its layout: nothing is read back for them.
        let empty;
        let st = match (&p.state, &p.gpu) {
            (Some(st), _) => st,
            (None, Some(g)) => {
                empty = g.layout.zeroed(0);
                &empty
            }
            (None, None) => return vec![],
        };
        let a = self.groups[p.group].algorithm;
        let mut out = Vec::new();
        if a.is_adam() {
            out.push(STEP.to_string());
        }
        if let Some(m) = &st.m {
            moment_keys(m_name(a), m, &mut out);
        }
        if let Some(v) = &st.v {
            moment_keys(EXP_AVG_SQ, v, &mut out);
        }
        if st.error_bits.is_some() {
            out.push(ERROR_BITS.to_string());
        }
        out
    }

    /// The f32 master weights of parameter `i` (error bits applied when present).
    pub fn master(&self, i: usize) -> Result<Vec<f32>> {
        self.master_staged(&mut self.stage(i)?)
    }

    fn master_staged(&self, sp: &mut StagedParam<'_>) -> Result<Vec<f32>> {
        sp.param(self)?;
        let (t, st) = (sp.param.as_ref().expect("read above"), sp.state.as_deref());
        Ok(
            match (
                Half::from_dtype(t.dtype),
                st.and_then(|s| s.error_bits.as_ref()),
            ) {
                (Ok(h), Some(e)) => {
                    let bits: Vec<u16> = t
                        .data
                        .chunks_exact(2)
                        .map(|c| u16::from_le_bytes([c[0], c[1]]))
                        .collect();
                    match e {
                        ErrorBits::I8(e) => bits
                            .iter()
                            .zip(e)
                            .map(|(&b, &c)| reconstruct_one(h, b, c))
                            .collect(),
                        ErrorBits::I16(e) => bits
                            .iter()
                            .zip(e)
                            .map(|(&b, &c)| reconstruct_one(h, b, c))
                            .collect(),
                    }
                }
                _ => t.to_f32()?,
            },
        )
    }

    /// One state entry of parameter `i`: raw keys as stored, moment names decoded to f32,
    /// `step` as an f32 0-dim tensor, `master` as f32.
    pub fn get_state(&self, i: usize, key: &str) -> Result<Tensor> {
        self.get_state_staged(&mut self.stage(i)?, key)
    }

    /// `get_state` of a staged parameter.
    pub(crate) fn get_state_staged(&self, sp: &mut StagedParam<'_>, key: &str) -> Result<Tensor> {
        let i = sp.i;
        let p = &self.params[i];
        let shape = p.tensor.shape().to_vec();
        if key == MASTER {
            return Ok(f32_tensor(&shape, &self.master_staged(sp)?));
        }
        let st = sp.state.as_deref().ok_or_else(|| {
            Error::NotFound(format!(
                "parameter {} has no optimizer state yet (no step taken, nothing loaded)",
                p.fqn
            ))
        })?;
        let a = self.groups[p.group].algorithm;
        let missing = || {
            Error::NotFound(format!(
                "parameter {} has no state key {key:?} (it has: step, master, {})",
                p.fqn,
                self.keys_of(i).join(", ")
            ))
        };
        if key == STEP {
            return Ok(f32_tensor(&[], &[st.step as f32]));
        }
        if key == ERROR_BITS {
            return match st.error_bits.as_ref().ok_or_else(missing)? {
                ErrorBits::I8(e) => Ok(Tensor {
                    dtype: DType::I8,
                    shape,
                    data: le_bytes(e, i8::to_le_bytes),
                }),
                ErrorBits::I16(e) => Ok(Tensor {
                    dtype: DType::I16,
                    shape,
                    data: le_bytes(e, i16::to_le_bytes),
                }),
            };
        }
        let (name, raw) = split_state_name(key);
        let m = if name == m_name(a) {
            st.m.as_ref()
        } else if name == EXP_AVG_SQ {
            st.v.as_ref()
        } else {
            None
        }
        .ok_or_else(missing)?;
        match (raw, m) {
            (None, m) => Ok(f32_tensor(&shape, &m.decode())),
            (Some(CODES_PART), Moment::Signed { codes, .. }) => Ok(Tensor {
                dtype: DType::I8,
                shape,
                data: le_bytes(codes, i8::to_le_bytes),
            }),
            (Some(CODES_PART), Moment::Unsigned { codes, .. }) => Ok(Tensor {
                dtype: DType::U8,
                shape,
                data: codes.clone(),
            }),
            (
                Some(SCALES_PART),
                Moment::Signed { scales, .. } | Moment::Unsigned { scales, .. },
            ) => Ok(Tensor {
                dtype: DType::F16,
                shape: vec![scales.len()],
                data: le_bytes(scales, |s| s.to_le_bytes()),
            }),
            _ => Err(missing()),
        }
    }

    /// `get_state` converted to `dtype`: float values convert to any float dtype (bf16
    /// state read as bf16 is exact); integer keys must be asked for in their own dtype.
    pub fn get_state_as(&self, i: usize, key: &str, dtype: DType) -> Result<Tensor> {
        self.get_state_as_staged(&mut self.stage(i)?, key, dtype)
    }

    /// `get_state_as` of a staged parameter.
    pub(crate) fn get_state_as_staged(
        &self,
        sp: &mut StagedParam<'_>,
        key: &str,
        dtype: DType,
    ) -> Result<Tensor> {
        let t = self.get_state_staged(sp, key)?;
        if t.dtype == dtype {
            return Ok(t);
        }
        if t.dtype != DType::F32
            || !matches!(dtype, DType::F32 | DType::F64 | DType::BF16 | DType::F16)
        {
            return Err(Error::Dtype(format!(
                "state key {key} is {}; it cannot be read as {dtype}",
                t.dtype
            )));
        }
        let v = t.to_f32()?;
        let data = match dtype {
            DType::F64 => le_bytes(&v, |x| (x as f64).to_le_bytes()),
            DType::BF16 => le_bytes(&v, |x| {
                crate::optim::math::master_split::bf16_bits_rne(x).to_le_bytes()
            }),
            _ => le_bytes(&v, |x| f16::from_f32(x).to_bits().to_le_bytes()),
        };
        Ok(Tensor {
            dtype,
            shape: t.shape,
            data,
        })
    }
}
