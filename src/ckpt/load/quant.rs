//! quant8 state on load: reading compressed state into a portable (f32) destination, and
//! compressed state into a compressed destination of any sharding.
//!
//! Same layout (the destination shard is exactly one saved coordinate's shard): codes and
//! scales are copied, bit for bit. Any other destination: every element is dequantized
//! with the scale of the group it had when saved, then the destination's own groups of
//! 32 are quantized afresh. Error bound of that requantization, per element, against the
//! dequantized saved value x (a' = the destination group's max |x|, or max sqrt(v) for
//! variance; scales in fp16's normal range):
//! - momentum (signed softsign): |x' - x| <= a' * (1/127 + 2^-10)
//! - variance (unsigned sqrt):  |sqrt(v') - sqrt(v)| <= a' * (1/510 + 2^-10)
//!   (half a code step of the decode map, whose slope is at most 2 for softsign and 1
//!   for sqrt, plus the fp16 rounding of the new scale). `tests/ckpt_quant.rs` checks it.
use super::reader::Checkpoint;
use super::reshard::{overlap_runs, BoxIn};
use crate::ckpt::format::index::KeyInfo;
use crate::ckpt::format::naming::{codes_key, num_groups, scales_key, GROUP};
use crate::ckpt::save::pack::owner_coords;
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::optim::math::quant8;
use crate::shard::{Chunk, Placement, ShardSpec};
use crate::tensor::Tensor;

/// Compressed state read for one destination.
#[derive(Debug, Clone)]
pub struct Quant8 {
    /// int8 (momentum) or uint8 (variance) codes, destination local shape.
    pub codes: Tensor,
    /// fp16 scales, `[ceil(local numel / 32)]`.
    pub scales: Tensor,
    /// True when copied bit for bit (same layout), false when requantized.
    pub exact: bool,
}

impl Checkpoint {
    /// The sharding `info` was saved with, at mesh coordinate 0.
    fn saved_spec(&self, info: &KeyInfo) -> Result<ShardSpec> {
        let fo = info.fo.as_ref().ok_or_else(|| {
            Error::Unsupported(format!(
                "key {}: quant8 scales without fo metadata cannot be mapped to their groups",
                info.key
            ))
        })?;
        let placements = fo
            .placements
            .iter()
            .map(|p| p.parse::<Placement>())
            .collect::<Result<Vec<_>>>()?;
        ShardSpec::new(
            info.global_shape.clone(),
            fo.mesh.clone(),
            vec![0; fo.mesh.len()],
            placements,
        )
    }

    /// Whether `base` is saved compressed (`::quantized` + `::scales`).
    pub fn is_compressed(&self, base: &str) -> bool {
        self.keys.contains_key(&codes_key(base)) && self.keys.contains_key(&scales_key(base))
    }

    /// The f32 values of state `base` for `dest`: read from a float key, or dequantized
    /// from compressed codes with the groups they were saved with.
    pub fn read_f32(&self, base: &str, dest: &ShardSpec) -> Result<Vec<f32>> {
        if self.keys.contains_key(base) {
            return self
                .read(base, dest)?
                .to_f32()
                .map_err(|e| Error::Dtype(format!("key {base}: {e}")));
        }
        if !self.is_compressed(base) {
            return Err(Error::NotFound(format!(
                "key {base} (or its ::quantized/::scales pair) is not in checkpoint {}",
                self.dir.display()
            )));
        }
        let (ck, sk) = (codes_key(base), scales_key(base));
        let codes = self.read(&ck, dest)?;
        let saved = self.saved_spec(self.key(&ck)?)?;
        let scales = f16s(&self.read_full(&sk)?, &sk)?;
        let n = dest.local_numel();
        let mut scale_of = vec![usize::MAX; n];
        let mut prefix = 0;
        let dchunks = dest.chunks();
        let dshape = dest.local_shape();
        for c in owner_coords(&saved) {
            let cshape = c.local_shape();
            for ch in c.chunks() {
                let src = BoxIn::of_chunk(&ch, &cshape);
                for d in &dchunks {
                    let dst = BoxIn::of_chunk(d, &dshape);
                    for r in overlap_runs(&src, &dst) {
                        for t in 0..r.len {
                            scale_of[r.dst + t] = prefix + (r.src + t) / GROUP;
                        }
                    }
                }
            }
            prefix += num_groups(c.local_numel());
        }
        if prefix != scales.len() {
            return Err(Error::corrupt(
                &self.dir,
                format!(
                    "key {sk}: {} scales saved, the codes' sharding needs {prefix}",
                    scales.len()
                ),
            ));
        }
        decode_codes(&codes, &ck, |e| scales[scale_of[e]])
    }

    /// Compressed state `base` for `dest`: copied when `dest` is a saved coordinate's
    /// shard, else requantized (from compressed or portable state) in `dest`'s groups.
    /// `signed`: momentum (int8 softsign) or variance (uint8 sqrt).
    pub fn read_quant8(&self, base: &str, dest: &ShardSpec, signed: bool) -> Result<Quant8> {
        if self.is_compressed(base) {
            let (ck, sk) = (codes_key(base), scales_key(base));
            let ci = self.key(&ck)?;
            let want = if signed { DType::I8 } else { DType::U8 };
            if ci.dtype != want {
                return Err(Error::Dtype(format!(
                    "key {ck}: saved as {}, the destination needs {want}",
                    ci.dtype
                )));
            }
            if ci.global_shape == dest.global_shape() {
                let saved = self.saved_spec(ci)?;
                let mut prefix = 0;
                for c in owner_coords(&saved) {
                    let g = num_groups(c.local_numel());
                    if (0..dest.global_shape().len()).all(|d| c.dim_runs(d) == dest.dim_runs(d)) {
                        let codes = self.read(&ck, dest)?;
                        let si = self.key(&sk)?;
                        let whole = Chunk {
                            local_offset: vec![0],
                            global_offset: vec![prefix],
                            shape: vec![g],
                        };
                        let scales = if g == 0 {
                            Tensor::zeros(si.dtype, vec![0])
                        } else {
                            self.read_chunks(si, &[g], &[whole])?
                        };
                        return Ok(Quant8 {
                            codes,
                            scales,
                            exact: true,
                        });
                    }
                    prefix += g;
                }
            }
        }
        let x = self.read_f32(base, dest)?;
        let shape = dest.local_shape();
        let g = num_groups(x.len());
        let mut codes = vec![0u8; x.len()];
        let mut scales = vec![half::f16::ZERO; g];
        if signed {
            let c: &mut [i8] = bytemuck_i8(&mut codes);
            quant8::quantize_signed(&x, c, &mut scales);
        } else {
            quant8::quantize_unsigned_sqrt(&x, &mut codes, &mut scales);
        }
        let dtype = if signed { DType::I8 } else { DType::U8 };
        Ok(Quant8 {
            codes: Tensor::new(dtype, shape, codes)?,
            scales: Tensor::new(
                DType::F16,
                vec![g],
                scales
                    .iter()
                    .flat_map(|s| s.to_bits().to_le_bytes())
                    .collect(),
            )?,
            exact: false,
        })
    }
}

/// Views bytes as int8 codes (same size and alignment).
fn bytemuck_i8(b: &mut [u8]) -> &mut [i8] {
    // SAFETY: u8 and i8 have identical layout; the borrow is carried over.
    unsafe { std::slice::from_raw_parts_mut(b.as_mut_ptr() as *mut i8, b.len()) }
}

/// The fp16 scales of a scales tensor (F16, or BF16 holding f16 bits as FlashOptim's
/// state dict stores them).
fn f16s(t: &Tensor, key: &str) -> Result<Vec<half::f16>> {
    match t.dtype {
        DType::F16 | DType::BF16 => Ok(t
            .data
            .chunks_exact(2)
            .map(|b| half::f16::from_bits(u16::from_le_bytes([b[0], b[1]])))
            .collect()),
        other => Err(Error::Dtype(format!(
            "key {key}: quant8 scales must be F16, found {other}"
        ))),
    }
}

/// Quant8 codes of key `ck` (I8: momentum softsign, U8: variance sqrt) decoded element by
/// element, element `e` with the fp16 scale `scale(e)` of the group it was saved in.
pub(crate) fn decode_codes(
    codes: &Tensor,
    ck: &str,
    scale: impl Fn(usize) -> half::f16,
) -> Result<Vec<f32>> {
    let signed = match codes.dtype {
        DType::I8 => true,
        DType::U8 => false,
        other => {
            return Err(Error::Dtype(format!(
                "key {ck}: quant8 codes must be I8 or U8, found {other}"
            )))
        }
    };
    Ok(codes
        .data
        .iter()
        .enumerate()
        .map(|(e, &q)| {
            let mut x = [0f32];
            if signed {
                quant8::decode_signed_group(&[q as i8], scale(e), &mut x);
            } else {
                quant8::decode_unsigned_sqrt_group(&[q], scale(e), &mut x);
            }
            x[0]
        })
        .collect())
}
