//! Whether a gradient stepped early is still the one its step read: a loop may edit it
//! between hand-over and `step_end` in ways its caller cannot see (torch counts in-place
//! edits in `Tensor._version`, but not those made through `.data`), or in ways that leave
//! its bits as they were (torch's `clip_grad_norm_` multiplies every gradient by its clip
//! coefficient clamped to 1, so a clip that does not trigger multiplies by 1.0: an edit by
//! the counter, the same bits). An early host step records a fingerprint of the gradient
//! bytes it read: always a sampled one (8 bytes at every `SAMPLE_STRIDE`, the whole
//! gradient when shorter, and its last 8 bytes: an edit that scales or averages a gradient
//! changes them, at a cost of one cache line in 16), and, where the optimizer asks for it
//! (`set_full_fingerprints`), one over every byte. `grads_changed` reads the gradients
//! again and names the parameters whose fingerprint moved, so the caller can redo the step
//! with the final gradients where, and only where, they differ.
//!
//! The hash is a 4-lane multiply-xorshift over 8-byte words: no cryptographic strength is
//! needed (an edit is no adversary), only that a changed word changes it and that it keeps
//! up with memory (a full fingerprint reads the gradient once more).
use rayon::prelude::*;

use super::open::OpenStep;
use crate::error::{Error, Result};
use crate::optim::optimizer::Optimizer;

/// Bytes between the words a sampled fingerprint reads.
pub(super) const SAMPLE_STRIDE: usize = 1024;

/// What an early host step recorded of the gradient it read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Fingerprint {
    pub sampled: u64,
    pub full: Option<u64>,
}

impl Fingerprint {
    pub fn of(bytes: &[u8], full: bool) -> Fingerprint {
        Fingerprint {
            sampled: sampled(bytes),
            full: full.then(|| hash(bytes)),
        }
    }
}

const K: [u64; 4] = [
    0x9e37_79b9_7f4a_7c15,
    0xc2b2_ae3d_27d4_eb4f,
    0x1656_67b1_9e37_79f9,
    0x85eb_ca77_c2b2_ae63,
];

fn mix(h: u64, w: u64, k: u64) -> u64 {
    let x = (h ^ w).wrapping_mul(k);
    x ^ (x >> 29)
}

fn word(b: &[u8]) -> u64 {
    let mut w = [0u8; 8];
    w[..b.len()].copy_from_slice(b);
    u64::from_le_bytes(w)
}

fn finish(lanes: [u64; 4], len: usize) -> u64 {
    let h = lanes
        .iter()
        .zip(K)
        .fold(len as u64, |h, (&l, k)| mix(h.rotate_left(23), l, k));
    mix(h, h >> 32, K[0])
}

/// Every byte of `b`.
pub(super) fn hash(b: &[u8]) -> u64 {
    let mut lanes = K;
    let mut blocks = b.chunks_exact(32);
    for blk in &mut blocks {
        for (l, (w, k)) in lanes.iter_mut().zip(blk.chunks_exact(8).zip(K)) {
            *l = mix(*l, word(w), k);
        }
    }
    for (j, w) in blocks.remainder().chunks(8).enumerate() {
        lanes[j] = mix(lanes[j], word(w), K[j]);
    }
    finish(lanes, b.len())
}

/// 8 bytes at every `SAMPLE_STRIDE` and the last 8 (all of `b` when shorter than a stride).
pub(super) fn sampled(b: &[u8]) -> u64 {
    if b.len() <= SAMPLE_STRIDE {
        return hash(b);
    }
    let mut lanes = K;
    for (j, at) in (0..b.len()).step_by(SAMPLE_STRIDE).enumerate() {
        let w = word(&b[at..(at + 8).min(b.len())]);
        lanes[j % 4] = mix(lanes[j % 4], w, K[j % 4]);
    }
    lanes[3] = mix(lanes[3], word(&b[b.len() - 8..]), K[3]);
    finish(lanes, b.len())
}

impl Optimizer {
    /// From the next overlapped step on, early host steps also record a fingerprint of
    /// every byte of their gradient (`grads_changed`' `full`); `false`: sampled only. A
    /// full fingerprint reads each gradient once more on the pool.
    pub fn set_full_fingerprints(&mut self, full: bool) -> Result<()> {
        self.refuse_if_step_open("set_full_fingerprints")?;
        self.full_fingerprints = full;
        Ok(())
    }

    /// Waits for the open step's early host steps, then reads their gradients again and
    /// returns, by index, the parameters whose gradient differs from the one their early
    /// step read: by the full fingerprint for those in `full` (a parameter there without
    /// one, its step's gradient brought down from a device or recorded before
    /// `set_full_fingerprints`, counts as changed), else by the sampled one. Parameters
    /// stepped at `step_end` or on a device are not named: their step has not read
    /// anything yet, or not on the host.
    ///
    /// # Safety
    /// The handed-over gradients are still valid for reads (`grads_ready`'s contract).
    pub unsafe fn grads_changed(&self, full: &[usize]) -> Result<Vec<usize>> {
        let open = self
            .open_step()
            .ok_or_else(|| super::open::no_step("grads_changed"))?;
        for (k, &i) in full.iter().enumerate() {
            self.check_index(i).map_err(|_| {
                Error::invalid(
                    format!("full[{k}]"),
                    format!("{i} is out of range ({} parameters)", self.num_params()),
                )
            })?;
        }
        // By index: `full` may name every parameter of a large model.
        let mut by_every_byte = vec![false; self.num_params()];
        full.iter().for_each(|&i| by_every_byte[i] = true);
        let recorded = open.inbox.fingerprints();
        let mut changed: Vec<usize> = open.pool.install(|| {
            recorded
                .into_par_iter()
                .filter_map(|(i, fp)| unsafe { changed_since(open, i, fp, by_every_byte[i]) })
                .collect()
        });
        changed.sort_unstable();
        Ok(changed)
    }
}

/// `Some(i)` when parameter `i`'s gradient no longer has fingerprint `fp` (`full`: by
/// every byte).
///
/// # Safety
/// As `grads_changed`.
unsafe fn changed_since(
    open: &OpenStep,
    i: usize,
    fp: Option<Fingerprint>,
    full: bool,
) -> Option<usize> {
    let Some(fp) = fp else {
        // A gradient brought down from a device: not read again here (on the host only
        // its copy was read), so only an edit the caller saw counts.
        return full.then_some(i);
    };
    let g = &open.given[i].as_ref()?.grad;
    let gathered;
    let bytes = match g.contiguous_bytes() {
        Some(b) => b,
        None => match g.try_to_tensor("grads") {
            Ok(t) => {
                gathered = t.data;
                &gathered[..]
            }
            Err(_) => return Some(i),
        },
    };
    let same = match (full, fp.full) {
        (true, Some(h)) => hash(bytes) == h,
        (true, None) => false,
        (false, _) => sampled(bytes) == fp.sampled,
    };
    (!same).then_some(i)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_changed_byte_changes_the_full_hash_wherever_it_is() {
        for len in [0usize, 1, 7, 8, 31, 32, 33, 4096 + 5] {
            let b: Vec<u8> = (0..len).map(|k| (k * 7 + 3) as u8).collect();
            let h = hash(&b);
            for at in 0..len {
                let mut c = b.clone();
                c[at] ^= 0x10;
                assert_ne!(hash(&c), h, "len {len}, byte {at}");
            }
        }
        // The length counts: zero bytes appended are a change.
        assert_ne!(hash(&[0u8; 8]), hash(&[0u8; 16]));
    }

    #[test]
    fn the_sampled_hash_sees_a_scaled_gradient_and_not_a_single_unsampled_element() {
        let g: Vec<f32> = (0..100_000).map(|k| (k as f32 * 0.37).sin()).collect();
        let bytes = |v: &[f32]| v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>();
        let s = sampled(&bytes(&g));
        let scaled: Vec<f32> = g.iter().map(|x| x * 0.5).collect();
        assert_ne!(sampled(&bytes(&scaled)), s);
        assert_eq!(sampled(&bytes(&g)), s, "deterministic");
        // The last element is always read; one between samples is not (only the full
        // fingerprint sees it).
        let mut last = g.clone();
        *last.last_mut().unwrap() += 1.0;
        assert_ne!(sampled(&bytes(&last)), s);
        let mut one = g.clone();
        one[SAMPLE_STRIDE / 4 + 5] += 1.0;
        assert_eq!(sampled(&bytes(&one)), s);
        assert_ne!(hash(&bytes(&one)), hash(&bytes(&g)));
        // Short gradients are sampled whole.
        let short = bytes(&g[..200]);
        let mut edited = short.clone();
        edited[401] ^= 1;
        assert_ne!(sampled(&short), sampled(&edited));
    }
}

#[cfg(test)]
#[path = "fingerprint_tests.rs"]
mod optimizer_tests;
