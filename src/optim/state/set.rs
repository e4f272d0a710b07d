//! Writing a parameter's state by key (`set_states`): portable, raw and FlashOptim keys
//! checked as a whole, then quantized or split into place; reading is in `io`.
use half::f16;

use super::io::{le_bytes, m_name, values};
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::optim::keys::{
    split_state_name, CODES_PART, ERROR_BITS, EXP_AVG_SQ, MASTER, SCALES_PART, STEP,
};
use crate::optim::math::master_split::{encode_one, Half};
use crate::optim::math::quant8;
use crate::optim::math::state::{ErrorBits, Moment, ParamState};
use crate::optim::optimizer::Optimizer;
use crate::tensor::Tensor;

impl Optimizer {
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
        let p = self.entry(i);
        let fqn = p.fqn().to_string();
        let shape = p.tensor().shape().to_vec();
        let n = p.tensor().numel();
        let a = self.config(p.group()).algorithm;
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
            param_bytes = Some(match Half::from_dtype(self.entry(i).tensor().dtype()) {
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
