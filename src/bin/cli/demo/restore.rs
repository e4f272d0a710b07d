//! Where a phase starts from, and the two ways the demo brings state back: loading a
//! sharded checkpoint with resharding, and broadcasting a consolidated one from rank 0.
use std::path::{Path, PathBuf};

use fo::broadcast::{broadcast_state_dict, BroadcastDest, BroadcastOptions};
use fo::ckpt::naming::{self, CONSOLIDATED_FILE};
use fo::ckpt::{self, Checkpoint, LoadOptions, Mode, ParamsAs, SaveOptions};
use fo::{DType, Result, Tensor, TensorView};

use super::mlp::PARAMS;
use super::rank::{host_view, Rank};

pub enum Start {
    /// Fresh parameters (f32 values, stored as bf16).
    Fresh(Vec<Vec<f32>>),
    /// A sharded checkpoint directory, loaded with resharding.
    Checkpoint(PathBuf),
    /// A consolidated checkpoint directory: rank 0 reads it, the others receive their shards.
    Broadcast(PathBuf),
}

/// One rank's view of its broadcast: what it received against what it holds.
#[derive(Clone, Debug)]
pub struct BroadcastReport {
    pub bytes_received: u64,
    pub table_bytes: u64,
    pub shard_bytes: u64,
    pub full_bytes: u64,
}

/// Every rank writes its file of a compressed and of a portable checkpoint, parameters
/// included as stored (bf16), so a restart needs nothing else.
pub fn save_checkpoints(rank: &Rank, dir: &Path) -> Result<()> {
    for (mode, sub) in [
        (Mode::Compressed, "compressed"),
        (Mode::Portable, "portable"),
    ] {
        let mut opts = SaveOptions::new(rank.comm.rank(), rank.comm.world_size(), mode);
        opts.params = Some(ParamsAs::Stored);
        ckpt::save_optimizer_comm(&rank.opt, &dir.join(sub), &opts, &rank.comm)?;
    }
    Ok(())
}

pub fn restore(rank: &mut Rank, start: &Start) -> Result<Option<BroadcastReport>> {
    match start {
        Start::Fresh(_) => Ok(None),
        Start::Checkpoint(dir) => {
            let ck = Checkpoint::open(dir)?;
            for (i, (name, _)) in PARAMS.iter().enumerate() {
                let t = ck.read(name, &rank.specs[i])?;
                copy_into_bf16(&mut rank.params[i], &t)?;
            }
            ckpt::load(&mut rank.opt, dir, &LoadOptions::default())?;
            Ok(None)
        }
        Start::Broadcast(dir) => broadcast_restore(rank, dir).map(Some),
    }
}

fn copy_into_bf16(dst: &mut [u16], t: &Tensor) -> Result<()> {
    if t.dtype != DType::BF16 || t.data.len() != dst.len() * 2 {
        return Err(fo::Error::Shape(format!(
            "restored parameter is {} {:?}, expected {} bf16 values",
            t.dtype,
            t.shape,
            dst.len()
        )));
    }
    for (d, c) in dst.iter_mut().zip(t.data.chunks_exact(2)) {
        *d = u16::from_le_bytes([c[0], c[1]]);
    }
    Ok(())
}

/// Every tensor of a consolidated checkpoint (one safetensors file), owned and aligned.
fn read_consolidated(dir: &Path) -> Result<Vec<(String, Tensor)>> {
    let path = dir.join(CONSOLIDATED_FILE);
    let bytes = std::fs::read(&path).map_err(|e| fo::Error::io(&path, e))?;
    let st = safetensors::SafeTensors::deserialize(&bytes)
        .map_err(|e| fo::Error::corrupt(&path, e.to_string()))?;
    st.tensors()
        .into_iter()
        .map(|(name, view)| {
            let dtype = DType::from_safetensors_name(&format!("{:?}", view.dtype()))?;
            Ok((
                name,
                Tensor::new(dtype, view.shape().to_vec(), view.data().to_vec())?,
            ))
        })
        .collect()
}

/// Per-parameter receive buffers for the portable optimizer state.
struct StateBuffers {
    exp_avg: Vec<f32>,
    exp_avg_sq: Vec<f32>,
    error_bits: Vec<i8>,
    step: f32,
}

fn broadcast_restore(rank: &mut Rank, dir: &Path) -> Result<BroadcastReport> {
    // Rank 0 alone reads the consolidated file.
    let full: Vec<(String, Tensor)> = if rank.comm.rank() == 0 {
        read_consolidated(dir)?
    } else {
        vec![]
    };
    let full_views: Vec<(String, TensorView)> = full
        .iter()
        .map(|(k, t)| {
            Ok((
                k.clone(),
                host_view(t.data.as_ptr() as *mut u8, t.dtype, &t.shape)?,
            ))
        })
        .collect::<Result<_>>()?;
    let mut bufs: Vec<StateBuffers> = rank
        .params
        .iter()
        .map(|p| StateBuffers {
            exp_avg: vec![0.0; p.len()],
            exp_avg_sq: vec![0.0; p.len()],
            error_bits: vec![0; p.len()],
            step: 0.0,
        })
        .collect();
    let mut dests = Vec::new();
    let mut shard_bytes = 0u64;
    for (i, (name, _)) in PARAMS.iter().enumerate() {
        let local = rank.specs[i].local_shape();
        let spec = Some(rank.specs[i].clone());
        let b = &mut bufs[i];
        let entries = [
            (
                name.to_string(),
                host_view(rank.params[i].as_mut_ptr() as *mut u8, DType::BF16, &local)?,
            ),
            (
                naming::state_key(name, naming::EXP_AVG),
                host_view(b.exp_avg.as_mut_ptr() as *mut u8, DType::F32, &local)?,
            ),
            (
                naming::state_key(name, naming::EXP_AVG_SQ),
                host_view(b.exp_avg_sq.as_mut_ptr() as *mut u8, DType::F32, &local)?,
            ),
            (
                naming::state_key(name, naming::ERROR_BITS),
                host_view(b.error_bits.as_mut_ptr() as *mut u8, DType::I8, &local)?,
            ),
        ];
        for (key, tensor) in entries {
            shard_bytes += tensor.nbytes() as u64;
            dests.push(BroadcastDest {
                key,
                tensor,
                spec: spec.clone(),
            });
        }
        let step = host_view(&mut b.step as *mut f32 as *mut u8, DType::F32, &[])?;
        shard_bytes += 4;
        dests.push(BroadcastDest {
            key: naming::state_key(name, naming::STEP),
            tensor: step,
            spec: None,
        });
    }
    let full_bytes = {
        let mut n = [full.iter().map(|(_, t)| t.nbytes() as f64).sum::<f64>()];
        rank.comm.all_reduce_f64(&mut n, fo::comm::ReduceOp::Max)?;
        n[0] as u64
    };
    let root = if rank.comm.rank() == 0 {
        Some(full_views.as_slice())
    } else {
        None
    };
    // SAFETY: every destination view points into `rank.params` or `bufs`, alive and unaliased here.
    let stats =
        unsafe { broadcast_state_dict(&rank.comm, root, &dests, &BroadcastOptions::default())? };
    drop(dests);
    for (i, b) in bufs.iter().enumerate() {
        let local = rank.specs[i].local_shape();
        let entries = vec![
            (
                naming::STEP.to_string(),
                Tensor::from_f32(vec![], &[b.step])?,
            ),
            (
                naming::EXP_AVG.to_string(),
                Tensor::from_f32(local.clone(), &b.exp_avg)?,
            ),
            (
                naming::EXP_AVG_SQ.to_string(),
                Tensor::from_f32(local.clone(), &b.exp_avg_sq)?,
            ),
            (
                naming::ERROR_BITS.to_string(),
                Tensor::new(
                    DType::I8,
                    local,
                    b.error_bits.iter().map(|&x| x as u8).collect(),
                )?,
            ),
        ];
        rank.opt.set_states(i, &entries)?;
    }
    Ok(BroadcastReport {
        bytes_received: stats.bytes_received,
        table_bytes: stats.table_bytes,
        shard_bytes,
        full_bytes,
    })
}
