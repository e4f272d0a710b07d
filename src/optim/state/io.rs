//! Reading a parameter's state by key, as torch and FlashOptim name it (writing is in
//! `set`): `step`, `exp_avg`, `exp_avg_sq`, `momentum_buffer` (decoded f32, any
//! format), the raw compressed keys `<name>::quantized` / `<name>::scales` and
//! `error_bits`, and `master` (the f32 master weight: the param, completed by its error
//! bits).
use super::out::{fill, is_float, Source};
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::optim::keys::{
    self, split_state_name, CODES_PART, ERROR_BITS, EXP_AVG, EXP_AVG_SQ, MASTER, MOMENTUM_BUFFER,
    SCALES_PART, STEP,
};
use crate::optim::math::config::Algorithm;
use crate::optim::math::state::{ErrorBits, Moment, ParamState};
use crate::optim::optimizer::Optimizer;
use crate::optim::placement::staging::StagedParam;
use crate::tensor::{try_with_capacity, Tensor, TensorView};

/// The name of the momentum-like state of an algorithm.
pub(super) fn m_name(a: Algorithm) -> &'static str {
    if a.is_sgd() {
        MOMENTUM_BUFFER
    } else {
        EXP_AVG
    }
}

/// The moment state name `name` (`exp_avg`/`momentum_buffer` as `a` calls it, or
/// `exp_avg_sq`) stands for in `st`, if `st` holds it.
pub(super) fn moment_of<'s>(st: &'s ParamState, a: Algorithm, name: &str) -> Option<&'s Moment> {
    if name == m_name(a) {
        st.m.as_ref()
    } else if name == EXP_AVG_SQ {
        st.v.as_ref()
    } else {
        None
    }
}

fn moment_keys(name: &str, m: &Moment, out: &mut Vec<String>) {
    match m {
        Moment::F32(_) | Moment::Half(..) => out.push(name.to_string()),
        Moment::Signed { .. } | Moment::Unsigned { .. } => {
            out.push(keys::codes_key(name));
            out.push(keys::scales_key(name));
        }
    }
}

pub(super) fn le_bytes<T: Copy, const N: usize>(v: &[T], f: impl Fn(T) -> [u8; N]) -> Vec<u8> {
    v.iter().flat_map(|&x| f(x)).collect()
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
        let p = self.entry(i);
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
        let a = self.config(p.group()).algorithm;
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
        let t = self.get_state(i, MASTER)?;
        Ok(t.data
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect())
    }

    /// Where state `key` of staged parameter `sp` is read from, and its shape. For
    /// `master`, `sp.param` must have been read (`StagedParam::param`).
    fn source<'s>(&self, sp: &'s StagedParam<'_>, key: &str) -> Result<(Source<'s>, Vec<usize>)> {
        let i = sp.i;
        let p = self.entry(i);
        let shape = p.tensor().shape().to_vec();
        let st = sp.state.as_deref();
        if key == MASTER {
            let param = sp.param.as_ref().ok_or_else(|| {
                Error::Internal(format!("master of {} read before its parameter", p.fqn()))
            })?;
            let err = st.and_then(|s| s.error_bits.as_ref());
            return Ok((Source::Master { param, err }, shape));
        }
        let st = st.ok_or_else(|| {
            Error::NotFound(format!(
                "parameter {} has no optimizer state yet (no step taken, nothing loaded)",
                p.fqn()
            ))
        })?;
        let a = self.config(p.group()).algorithm;
        let missing = || {
            Error::NotFound(format!(
                "parameter {} has no state key {key:?} (it has: step, master, {})",
                p.fqn(),
                self.keys_of(i).join(", ")
            ))
        };
        if key == STEP {
            return Ok((Source::Step(st.step as f32), vec![]));
        }
        if key == ERROR_BITS {
            return match st.error_bits.as_ref().ok_or_else(missing)? {
                ErrorBits::I8(e) => Ok((Source::I8(e), shape)),
                ErrorBits::I16(e) => Ok((Source::I16(e), shape)),
            };
        }
        let (name, raw) = split_state_name(key);
        let m = moment_of(st, a, name).ok_or_else(missing)?;
        match (raw, m) {
            (None, m) => Ok((Source::Decoded(m), shape)),
            (Some(CODES_PART), Moment::Signed { codes, .. }) => Ok((Source::I8(codes), shape)),
            (Some(CODES_PART), Moment::Unsigned { codes, .. }) => Ok((Source::U8(codes), shape)),
            (
                Some(SCALES_PART),
                Moment::Signed { scales, .. } | Moment::Unsigned { scales, .. },
            ) => Ok((Source::F16(scales), vec![scales.len()])),
            _ => Err(missing()),
        }
    }

    /// The dtype and shape `get_state` gives for `key`, without decoding anything.
    pub fn state_info(&self, i: usize, key: &str) -> Result<(DType, Vec<usize>)> {
        let sp = self.stage(i)?;
        if key == MASTER {
            return Ok((DType::F32, self.entry(i).tensor().shape().to_vec()));
        }
        let (src, shape) = self.source(&sp, key)?;
        Ok((src.dtype(), shape))
    }

    /// One state entry of parameter `i`: raw keys as stored, moment names decoded to f32,
    /// `step` as an f32 0-dim tensor, `master` as f32.
    pub fn get_state(&self, i: usize, key: &str) -> Result<Tensor> {
        self.get_state_staged(&mut self.stage(i)?, key)
    }

    /// `get_state` of a staged parameter.
    fn get_state_staged(&self, sp: &mut StagedParam<'_>, key: &str) -> Result<Tensor> {
        self.get_state_as_staged(sp, key, None)
    }

    /// `get_state` converted to `dtype`: float values convert to any float dtype (bf16
    /// state read as bf16 is exact); integer keys must be asked for in their own dtype.
    pub fn get_state_as(&self, i: usize, key: &str, dtype: DType) -> Result<Tensor> {
        self.get_state_as_staged(&mut self.stage(i)?, key, dtype)
    }

    /// `get_state_as` of a staged parameter (`None`: the entry's own dtype), decoded on
    /// the caller's thread: checkpoint writers read through here, and an asynchronous one
    /// must not take fo's pool from the steps it runs beside.
    pub(crate) fn get_state_as_staged(
        &self,
        sp: &mut StagedParam<'_>,
        key: &str,
        dtype: impl Into<Option<DType>>,
    ) -> Result<Tensor> {
        if key == MASTER {
            sp.param(self)?;
        }
        let (src, shape) = self.source(sp, key)?;
        let dtype = dtype.into().unwrap_or(src.dtype());
        read_as(key, &src, dtype)?;
        let n: usize = shape.iter().product();
        let mut data = try_with_capacity::<u8>(n * dtype.size(), &format!("state {key}"))?;
        data.resize(n * dtype.size(), 0);
        fill(&src, dtype, &mut data, false)?;
        Ok(Tensor { dtype, shape, data })
    }

    /// `get_state_as(i, key, dst.dtype())` written into `dst`, caller memory of the
    /// entry's shape (any strides), decoded in parallel on fo's pool straight into it when
    /// it is contiguous. Nothing is written unless the key, dtype and shape are right.
    ///
    /// # Safety
    /// `dst` must be valid for writes and not accessed by anyone else during the call.
    pub unsafe fn get_state_into(&self, i: usize, key: &str, dst: &TensorView) -> Result<()> {
        let mut sp = self.stage(i)?;
        if key == MASTER {
            sp.param(self)?;
        }
        let (src, shape) = self.source(&sp, key)?;
        read_as(key, &src, dst.dtype())?;
        if shape != dst.shape() {
            return Err(Error::Shape(format!(
                "state {key} has shape {shape:?}; out has shape {:?}",
                dst.shape()
            )));
        }
        match dst.contiguous_bytes_mut() {
            Some(out) => fill(&src, dst.dtype(), out, true),
            None => {
                // A strided destination: decode contiguously, then scatter.
                let mut v = try_with_capacity::<u8>(dst.nbytes(), "out")?;
                v.resize(dst.nbytes(), 0);
                fill(&src, dst.dtype(), &mut v, true)?;
                dst.write_bytes(&v)
            }
        }
    }
}

/// An error unless `src` can be read as `dtype`: its own dtype, or any float dtype for
/// decoded (f32) values.
fn read_as(key: &str, src: &Source, dtype: DType) -> Result<()> {
    if dtype == src.dtype() || (src.dtype() == DType::F32 && is_float(dtype)) {
        return Ok(());
    }
    Err(Error::Dtype(format!(
        "state key {key} is {}; it cannot be read as {dtype}",
        src.dtype()
    )))
}
