//! Reading and writing a parameter's state by key, as torch and FlashOptim name it:
//! `step`, `exp_avg`, `exp_avg_sq`, `momentum_buffer` (decoded f32, any format), the raw
//! compressed keys `<name>::quantized` / `<name>::scales` and `error_bits`, and `master`
//! (the f32 master weight: the param, completed by its error bits).
use half::f16;

use super::config::Algorithm;
use super::master_split::{encode_one, reconstruct_one, Half};
use super::optimizer::Optimizer;
use super::quant8;
use super::staging::StagedParam;
use super::state::{ErrorBits, Moment, ParamState};
use crate::ckpt::naming::{
    self, split_state_name, CODES_PART, ERROR_BITS, EXP_AVG, EXP_AVG_SQ, MASTER, MOMENTUM_BUFFER,
    SCALES_PART, STEP,
};
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::tensor::Tensor;

/// The name of the momentum-like state of an algorithm.
fn m_name(a: Algorithm) -> &'static str {
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

fn le_bytes<T: Copy, const N: usize>(v: &[T], f: impl Fn(T) -> [u8; N]) -> Vec<u8> {
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
fn values(key: &str, t: &Tensor) -> Result<Vec<f32>> {
    match t.dtype {
        DType::F32 | DType::F64 | DType::BF16 | DType::F16 => t.to_f32(),
        d => Err(Error::Dtype(format!(
            "state key {key}: a {d} tensor was given where a float tensor is expected"
        ))),
    }
}

impl Optimizer {
    /// The keys `get_state` / checkpoints use for parameter `i`'s native state (empty
    /// before its first step). `step` is listed for Adam/AdamW, as torch stores it.
    pub fn state_keys(&self, i: usize) -> Vec<String> {
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
                self.state_keys(i).join(", ")
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
            DType::BF16 => le_bytes(&v, |x| super::master_split::bf16_bits_rne(x).to_le_bytes()),
            _ => le_bytes(&v, |x| f16::from_f32(x).to_bits().to_le_bytes()),
        };
        Ok(Tensor {
            dtype,
            shape: t.shape,
            data,
        })
    }

    /// Loads state entries for parameter `i` (creating its state if absent). Accepts the
    /// portable keys (`exp_avg`, ... as any float dtype; quantized on load when the
    /// format is quantized), the native raw keys (`<name>::quantized` with
    /// `<name>::scales` as F16, or BF16 holding f16 bits as FlashOptim saves them),
    /// `error_bits` (I8/I16, or BF16 as FlashOptim saves them), `step` and `master`
    /// (rounds into the parameter and sets its error bits). Every entry is checked before
    /// anything changes; on error nothing is modified.
    pub fn set_states(&mut self, i: usize, entries: &[(String, Tensor)]) -> Result<()> {
        self.check_index(i)?;
        self.refuse_if_step_open("set_state")?;
        let mut st: ParamState = match self.staged_state(i)? {
            Some(s) => s.into_owned(),
            None => self.new_state(i),
        };
        let p = &self.params[i];
        let fqn = p.fqn.clone();
        let shape = p.tensor.shape().to_vec();
        let n = p.tensor.numel();
        let a = self.groups[p.group].algorithm;
        let mut seen: Vec<&str> = Vec::new();
        let mut raw_pending: Vec<(&str, &str, &Tensor)> = Vec::new();
        let mut master: Option<Vec<f32>> = None;
        let mut error_bits: Option<&Tensor> = None;
        let bad_shape = |key: &str, t: &Tensor, want: &[usize]| {
            Error::Shape(format!(
                "key {key} of parameter {fqn}: shape {:?} does not match the expected {want:?}",
                t.shape
            ))
        };
        for (key, t) in entries {
            let key = key.as_str();
            let (name, raw) = split_state_name(key);
            if seen.contains(&name) && raw.is_none() || seen.contains(&key) {
                return Err(Error::invalid(
                    "entries",
                    format!("key {key} of parameter {fqn} is given twice"),
                ));
            }
            seen.push(if raw.is_none() { name } else { key });
            match (name, raw) {
                (STEP, None) => {
                    let v = match t.dtype {
                        DType::I64 if t.numel() == 1 => i64::from_le_bytes(t.data[..8].try_into().unwrap()) as f64,
                        DType::I32 if t.numel() == 1 => i32::from_le_bytes(t.data[..4].try_into().unwrap()) as f64,
                        _ if t.numel() == 1 => values(key, t)?[0] as f64,
                        _ => return Err(bad_shape(key, t, &[])),
                    };
                    if !(v >= 0.0 && v.fract() == 0.0 && v < 9.0e15) {
                        return Err(Error::invalid(
                            "step",
                            format!("parameter {fqn}: step {v} is not a non-negative integer"),
                        ));
                    }
                    st.step = v as u64;
                }
                (MASTER, None) => {
                    if t.shape != shape {
                        return Err(bad_shape(key, t, &shape));
                    }
                    master = Some(values(key, t)?);
                }
                (ERROR_BITS, None) => {
                    if t.shape != shape {
                        return Err(bad_shape(key, t, &shape));
                    }
                    if st.error_bits.is_none() {
                        return Err(Error::NotFound(format!(
                            "parameter {fqn} keeps no error_bits (master_weight_bits is 0 or the param is f32)"
                        )));
                    }
                    error_bits = Some(t);
                }
                (nm, None) if nm == m_name(a) || nm == EXP_AVG_SQ => {
                    if t.shape != shape {
                        return Err(bad_shape(key, t, &shape));
                    }
                    let vals = values(key, t)?;
                    // One non-finite value would poison its whole quant8 group (an
                    // inf absmax scale decodes every element to NaN) and the next step.
                    if let Some(j) = vals.iter().position(|x| !x.is_finite()) {
                        return Err(Error::invalid(
                            key,
                            format!(
                                "parameter {fqn}: value {} at flat index {j} is not finite",
                                vals[j]
                            ),
                        ));
                    }
                    if nm == EXP_AVG_SQ && vals.iter().any(|x| *x < 0.0) {
                        return Err(Error::invalid(
                            key,
                            format!("parameter {fqn}: exp_avg_sq holds negative values"),
                        ));
                    }
                    let target = if nm == EXP_AVG_SQ {
                        st.v.as_mut()
                    } else {
                        st.m.as_mut()
                    };
                    let target = target.ok_or_else(|| Error::NotFound(format!("parameter {fqn} keeps no {nm}")))?;
                    target.encode(&vals);
                    st.m_valid |= nm != EXP_AVG_SQ;
                }
                (nm, Some(r @ (CODES_PART | SCALES_PART))) if nm == m_name(a) || nm == EXP_AVG_SQ => {
                    raw_pending.push((nm, r, t));
                }
                _ => {
                    return Err(Error::NotFound(format!(
                    "parameter {fqn}: unknown state key {key:?} for {} (accepted: step, master, {}, exp_avg_sq where \
                         it applies, their ::quantized/::scales, error_bits)",
                    a.name(),
                    m_name(a)
                )))
                }
            }
        }
        for (nm, _, _) in &raw_pending {
            let q = raw_pending
                .iter()
                .find(|(n2, r, _)| n2 == nm && *r == CODES_PART);
            let s = raw_pending
                .iter()
                .find(|(n2, r, _)| n2 == nm && *r == SCALES_PART);
            let (Some((_, _, q)), Some((_, _, s))) = (q, s) else {
                return Err(Error::invalid(
                    "entries",
                    format!(
                        "parameter {fqn}: {nm}::quantized and {nm}::scales must be given together"
                    ),
                ));
            };
            let target = if *nm == EXP_AVG_SQ {
                st.v.as_mut()
            } else {
                st.m.as_mut()
            };
            let target =
                target.ok_or_else(|| Error::NotFound(format!("parameter {fqn} keeps no {nm}")))?;
            set_raw(target, q, s, &fqn, nm, &shape, n)?;
            st.m_valid |= *nm != EXP_AVG_SQ;
        }
        // `master` rounds into the param and splits its error bits; explicit `error_bits`
        // (raw state as stored) then take precedence, so a checkpoint holding the bf16
        // param and its error bits restores both exactly.
        let mut param_bytes: Option<Vec<u8>> = None;
        if let Some(mv) = master {
            param_bytes = Some(match Half::from_dtype(self.params[i].tensor.dtype()) {
                Err(_) => le_bytes(&mv, f32::to_le_bytes),
                Ok(h) => {
                    let bits: Vec<u16> = mv.iter().map(|&x| h.from_f32(x)).collect();
                    match st.error_bits.as_mut() {
                        Some(ErrorBits::I8(e)) => e
                            .iter_mut()
                            .zip(&mv)
                            .zip(&bits)
                            .for_each(|((e, &x), &b)| *e = encode_one(h, x, b)),
                        Some(ErrorBits::I16(e)) => e
                            .iter_mut()
                            .zip(&mv)
                            .zip(&bits)
                            .for_each(|((e, &x), &b)| *e = encode_one(h, x, b)),
                        None => {}
                    }
                    le_bytes(&bits, u16::to_le_bytes)
                }
            });
        }
        if let (Some(t), Some(e)) = (error_bits, st.error_bits.as_mut()) {
            set_error_bits(e, t, &fqn)?;
        }
        // All checked: apply.
        if let Some(data) = param_bytes {
            self.write_param(i, &data)?;
        }
        self.store_state(i, st)
    }
}

fn set_error_bits(e: &mut ErrorBits, t: &Tensor, fqn: &str) -> Result<()> {
    let bits16 = || {
        t.data
            .chunks_exact(2)
            .map(|c| u16::from_le_bytes([c[0], c[1]]))
            .collect::<Vec<u16>>()
    };
    match (e, t.dtype) {
        (ErrorBits::I8(e), DType::I8) => e.iter_mut().zip(&t.data).for_each(|(e, &b)| *e = b as i8),
        (ErrorBits::I16(e), DType::I16 | DType::BF16) => {
            e.iter_mut().zip(bits16()).for_each(|(e, b)| *e = b as i16)
        }
        (ErrorBits::I8(e), DType::BF16) => {
            // FlashOptim saves int8 error bits converted by value to bf16.
            let vals: Vec<f32> = bits16()
                .into_iter()
                .map(|b| f32::from_bits((b as u32) << 16))
                .collect();
            if let Some(x) = vals
                .iter()
                .find(|x| !(x.fract() == 0.0 && (-128.0..=127.0).contains(*x)))
            {
                return Err(Error::invalid(
                    "error_bits",
                    format!("parameter {fqn}: {x} is not an int8 error code"),
                ));
            }
            e.iter_mut().zip(vals).for_each(|(e, x)| *e = x as i8);
        }
        (e, d) => {
            let want = if matches!(e, ErrorBits::I8(_)) {
                "I8 (24-bit masters)"
            } else {
                "I16 (32-bit masters)"
            };
            return Err(Error::Dtype(format!(
                "error_bits of parameter {fqn}: {d} given, {want} expected"
            )));
        }
    }
    Ok(())
}

fn set_raw(
    target: &mut Moment,
    q: &Tensor,
    s: &Tensor,
    fqn: &str,
    nm: &str,
    shape: &[usize],
    n: usize,
) -> Result<()> {
    let g = quant8::num_groups(n);
    if q.shape != shape {
        return Err(Error::Shape(format!(
            "key {nm}::quantized of parameter {fqn}: shape {:?}, expected {shape:?}",
            q.shape
        )));
    }
    if s.numel() != g || !matches!(s.dtype, DType::F16 | DType::BF16) {
        return Err(Error::Shape(format!(
            "key {nm}::scales of parameter {fqn}: {} {:?} given, {g} F16 scales expected",
            s.dtype, s.shape
        )));
    }
    let sc: Vec<f16> = s
        .data
        .chunks_exact(2)
        .map(|c| f16::from_bits(u16::from_le_bytes([c[0], c[1]])))
        .collect();
    // An absmax scale is finite and >= 0: anything else decodes its group to NaN/inf.
    if let Some(j) = sc.iter().position(|x| !x.is_finite() || x.to_f32() < 0.0) {
        return Err(Error::invalid(
            format!("{nm}::scales"),
            format!(
                "parameter {fqn}: scale {j} is {}; scales must be finite and >= 0",
                sc[j]
            ),
        ));
    }
    match (target, q.dtype) {
        (Moment::Signed { codes, scales }, DType::I8) => {
            codes.iter_mut().zip(&q.data).for_each(|(c, &b)| *c = b as i8);
            *scales = sc;
        }
        (Moment::Unsigned { codes, scales, .. }, DType::U8) => {
            codes.copy_from_slice(&q.data);
            *scales = sc;
        }
        (Moment::Signed { .. }, d) | (Moment::Unsigned { .. }, d) => {
            return Err(Error::Dtype(format!(
                "key {nm}::quantized of parameter {fqn}: {d} codes do not fit this state"
            )))
        }
        _ => {
            return Err(Error::NotFound(format!(
                "parameter {fqn}: {nm} is not stored quantized; give it as {nm} (float) instead of ::quantized/::scales"
            )))
        }
    }
    Ok(())
}
