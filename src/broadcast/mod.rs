//! `broadcast_state_dict`: rank 0 holds the full state dict, every rank holds destination
//! tensors (whole, or its shard with a `ShardSpec`), and each destination is filled.
//!
//! The protocol, identical on every rank so that no rank waits on a collective the
//! others skip:
//! 1. rank 0 builds the table (its own check, agreed: a bad full dict fails everyone);
//! 2. rank 0 broadcasts the table (length, then bytes);
//! 3. every rank checks its destinations against it (agreed: the lowest failing rank's
//!    error is every rank's error);
//! 4. ranks compare per-key layout fingerprints (one all-reduce), so a key present on
//!    some ranks only, or sharded differently, fails everywhere with the same message;
//! 5. keys move in sorted order: whole tensors by broadcast, shards by scatter (each rank
//!    receives only its slice), into buffers; casts happen on arrival;
//! 6. cast failures are agreed, and only then are destinations written.
mod plan;
mod slice;
mod table;

pub use slice::gather_shard;
pub use table::{Entry, Table};

use std::borrow::Cow;

use crate::cast;
use crate::comm::{agree, Comm, ReduceOp};
use crate::error::{Error, Result};
use crate::shard::{rank_to_coord, ShardSpec};
use crate::tensor::{checked_numel, try_zeroed, TensorView};

/// One destination: the key, this rank's tensor, and where it lies in the global tensor
/// (`None`: the whole tensor, e.g. a buffer).
#[derive(Debug, Clone)]
pub struct BroadcastDest {
    pub key: String,
    /// In host memory, or contiguous memory of a CUDA device, written from host memory
    /// in order on the legacy default stream once every rank has everything.
    pub tensor: TensorView,
    pub spec: Option<ShardSpec>,
}

/// Device destinations are written from host memory: contiguous, on a usable device.
fn check_device_dests(dests: &[BroadcastDest]) -> Result<()> {
    for (i, d) in dests
        .iter()
        .enumerate()
        .filter(|(_, d)| d.tensor.device().is_cuda())
    {
        let (arg, context) = (format!("dests[{i}].tensor"), format!("key {:?}", d.key));
        let a = crate::device::check::DeviceArg {
            arg: &arg,
            context: &context,
            noun: "destination",
            by_arg: true,
        };
        // SAFETY: the address is only looked up.
        unsafe { crate::device::check::check_tensor(&d.tensor, &a) }?;
    }
    Ok(())
}

/// How sharded entries travel.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Strategy {
    /// Each rank receives only its shard (falls back to `FullBroadcast` when the
    /// communicator has no scatter).
    #[default]
    Scatter,
    /// Every rank receives every full tensor and keeps its slice (what accelerate does;
    /// for comparison).
    FullBroadcast,
}

#[derive(Debug, Clone, Default)]
pub struct BroadcastOptions {
    /// Allow conversions involving integer or bool dtypes (see `cast`).
    pub allow_int_float_cast: bool,
    pub strategy: Strategy,
}

/// What one rank moved. `bytes_received` counts tensor payload arriving in this rank's
/// buffers (rank 0 included: its own shard), in rank 0's dtype.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct BroadcastStats {
    pub bytes_received: u64,
    /// The table broadcast: its 8-byte length plus its body.
    pub table_bytes: u64,
    /// Payload rank 0 sent to other ranks (0 elsewhere).
    pub bytes_sent: u64,
    /// Bytes of the agreement all-reduces (f64 flags and fingerprints) this rank contributed.
    pub control_bytes: u64,
    /// Entries filled on this rank.
    pub tensors: u64,
}

/// Fills every rank's `dests` from rank 0's `full` (ignored on other ranks).
/// Received data is held in buffers (this rank's shard bytes) until every rank has all
/// of its data and casts succeeded; only then are destinations written.
///
/// # Safety
/// Every `TensorView` must point at memory valid for the call; destinations writable.
pub unsafe fn broadcast_state_dict(
    comm: &Comm,
    full: Option<&[(String, TensorView)]>,
    dests: &[BroadcastDest],
    opts: &BroadcastOptions,
) -> Result<BroadcastStats> {
    broadcast_state_dict_checked(comm, Ok(full.map(|f| f.to_vec())), Ok(dests.to_vec()), opts)
}

/// `broadcast_state_dict` for callers whose arguments may have failed to convert on this
/// rank (the C ABI): such a failure still takes part in the protocol and becomes every
/// rank's error, instead of leaving the other ranks waiting.
///
/// # Safety
/// As `broadcast_state_dict`.
pub unsafe fn broadcast_state_dict_checked(
    comm: &Comm,
    full: Result<Option<Vec<(String, TensorView)>>>,
    dests: Result<Vec<BroadcastDest>>,
    opts: &BroadcastOptions,
) -> Result<BroadcastStats> {
    let (rank, world) = (comm.rank(), comm.world_size());
    let mut stats = BroadcastStats::default();
    let is_root = rank == 0;
    // 1. rank 0's table (a non-root rank's argument errors wait for step 3).
    let (full, full_err) = match full {
        Ok(f) => (f.filter(|_| is_root), None),
        Err(e) => (None, Some(e)),
    };
    let root_table = if is_root {
        match (&full, full_err) {
            (_, Some(e)) => Err(e),
            (None, None) => Err(Error::invalid(
                "full",
                "rank 0 must pass the full state dict",
            )),
            (Some(f), None) => Table::from_full(f).map(Some),
        }
    } else {
        Ok(None)
    };
    stats.control_bytes += 8;
    let root_table = agree(comm, root_table)?;
    // 2. the table.
    let mut bytes = root_table.as_ref().map(Table::encode).unwrap_or_default();
    let mut len = (bytes.len() as u64).to_le_bytes();
    comm.broadcast(&mut len, 0)?;
    bytes.resize(u64::from_le_bytes(len) as usize, 0);
    comm.broadcast(&mut bytes, 0)?;
    stats.table_bytes = 8 + bytes.len() as u64;
    let table = match root_table {
        Some(t) => Ok(t),
        None => Table::decode(&bytes),
    };
    // 3. this rank's destinations against the table.
    let checked = table
        .and_then(|t| dests.map(|d| (t, d)))
        .and_then(|(t, d)| {
            check_device_dests(&d)?;
            plan::plan(rank, world, &t, &d, opts).map(|p| (t, d, p))
        });
    stats.control_bytes += 8;
    let (table, dests, plans) = agree(comm, checked)?;
    // 4. agreement on which keys move, and how.
    let k = table.0.len();
    let mut fp: Vec<f64> = plans.iter().map(plan::layout_fingerprint).collect();
    fp.extend(plans.iter().map(|p| -plan::layout_fingerprint(p)));
    stats.control_bytes += 8 * fp.len() as u64;
    comm.all_reduce_f64(&mut fp, ReduceOp::Max)?;
    if let Some(i) = (0..k).find(|&i| fp[i] != -fp[k + i]) {
        return Err(Error::Comm(format!(
            "key {:?}: ranks disagree on its destination (it is missing on some ranks, or they shard it \
             with different meshes or placements)",
            table.0[i].key
        )));
    }
    // 5. the data, in table (sorted) order.
    let by_key: std::collections::HashMap<&str, &TensorView> = full
        .iter()
        .flatten()
        .map(|(key, t)| (key.as_str(), t))
        .collect();
    let mut received: Vec<(usize, Vec<u8>)> = Vec::new();
    let mut cast_err: Option<Error> = None;
    for (i, p) in plans.iter().enumerate() {
        let Some(p) = p else { continue };
        let e = &table.0[i];
        let src: Option<Cow<[u8]>> = match by_key.get(e.key.as_str()) {
            None => None,
            Some(t) => Some(match t.contiguous_bytes() {
                Some(b) => Cow::Borrowed(b),
                None => Cow::Owned(t.try_to_tensor(&format!("full[{:?}]", e.key))?.data),
            }),
        };
        let buf = move_one(comm, e, p, src.as_deref(), opts, &mut stats)?;
        stats.tensors += 1;
        if cast_err.is_none() {
            match cast::cast(
                buf,
                e.dtype,
                dests[p.dest].tensor.dtype(),
                &format!("key {:?}", e.key),
            ) {
                Ok(b) => received.push((p.dest, b)),
                Err(err) => cast_err = Some(err),
            }
        }
    }
    // 6. write only when every rank has everything.
    stats.control_bytes += 8;
    let stream = comm.stream();
    let local = cast_err
        .map_or(Ok(()), Err)
        .and_then(|()| check_dest_streams(&dests, stream));
    agree(comm, local)?;
    for (d, b) in received {
        crate::device::write_tensor(&dests[d].tensor, &b, stream)?;
    }
    Ok(stats)
}

/// Checks, before anything is written, that every device destination's device takes
/// `stream` (the communicator's), so a bad one fails every rank and writes nothing.
fn check_dest_streams(dests: &[BroadcastDest], stream: usize) -> Result<()> {
    for (i, d) in dests
        .iter()
        .enumerate()
        .filter(|(_, d)| d.tensor.device().is_cuda() && stream != 0)
    {
        let device = d.tensor.device();
        // SAFETY: the communicator's stream, live while set (`Comm::set_stream`).
        unsafe { crate::device::backend(device)?.check_stream(stream) }.map_err(|e| match e {
            Error::InvalidArgument { reason, .. } => Error::invalid(
                "stream",
                format!("dests[{i}] (device {}): {reason}", device.to_c()),
            ),
            e => e,
        })?;
    }
    Ok(())
}

/// Moves one entry to this rank, in rank 0's dtype. `src`: rank 0's row-major bytes.
fn move_one(
    comm: &Comm,
    e: &Entry,
    p: &plan::Plan,
    src: Option<&[u8]>,
    opts: &BroadcastOptions,
    stats: &mut BroadcastStats,
) -> Result<Vec<u8>> {
    let es = e.dtype.size();
    let full_bytes = checked_numel(&e.shape, &format!("key {:?}", e.key))?
        .checked_mul(es)
        .ok_or_else(|| {
            Error::invalid(
                format!("key {:?}", e.key),
                format!("shape {:?} overflows", e.shape),
            )
        })?;
    let others = comm.world_size() as u64 - 1;
    let broadcast_full = |stats: &mut BroadcastStats| -> Result<Vec<u8>> {
        let mut buf = match src {
            Some(s) => s.to_vec(),
            None => try_zeroed(full_bytes, &format!("key {:?}", e.key))?,
        };
        comm.broadcast(&mut buf, 0)?;
        stats.bytes_received += full_bytes as u64;
        if src.is_some() {
            stats.bytes_sent += full_bytes as u64 * others;
        }
        Ok(buf)
    };
    let Some(spec) = &p.spec else {
        return broadcast_full(stats);
    };
    if opts.strategy == Strategy::FullBroadcast || !comm.supports_scatter() {
        let full = broadcast_full(stats)?;
        return Ok(gather_shard(&full, es, spec));
    }
    let parts: Option<Vec<Vec<u8>>> = match src {
        Some(src) => Some(
            (0..comm.world_size())
                .map(|r| {
                    Ok(gather_shard(
                        src,
                        es,
                        &spec.at_coord(rank_to_coord(r, spec.mesh_shape()))?,
                    ))
                })
                .collect::<Result<_>>()?,
        ),
        None => None,
    };
    if let Some(parts) = &parts {
        stats.bytes_sent += parts
            .iter()
            .enumerate()
            .filter(|(r, _)| *r != comm.rank())
            .map(|(_, x)| x.len() as u64)
            .sum::<u64>();
    }
    let mut recv = try_zeroed(spec.local_numel() * es, &format!("key {:?}", e.key))?;
    comm.scatter(parts, &mut recv, 0)?;
    stats.bytes_received += recv.len() as u64;
    Ok(recv)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::device::backend::Backend as _;
    use crate::device::emulated::{self, EMULATED};
    use crate::device::Device;
    use crate::dtype::DType;

    fn view(b: &mut [f32], shape: &[i64], strides: Option<&[i64]>) -> TensorView {
        unsafe {
            TensorView::host(b.as_mut_ptr() as *mut u8, DType::F32, shape, strides, "t").unwrap()
        }
    }

    /// A device destination is written after the work queued on the communicator's
    /// stream (the caller's last use of it), not on the legacy default stream.
    #[test]
    fn device_destinations_are_written_after_the_work_on_the_communicators_stream() {
        let Some((dev, s)) = emulated::device_and_stream() else {
            return;
        };
        let mut src: Vec<f32> = (0..12).map(|i| i as f32 + 1.0).collect();
        let full = vec![("w".to_string(), view(&mut src, &[3, 4], None))];
        let mut d = vec![0f32; 12];
        // The caller's stream still writes the old contents when the broadcast is called.
        dev.stall(s, 150);
        let stale = vec![0x7fu8; 48];
        unsafe { dev.upload(d.as_mut_ptr() as u64, &stale, s) }.unwrap();
        let mut comm = Comm::local_group(1).pop().unwrap();
        comm.set_stream(s).unwrap();
        let dest = BroadcastDest {
            key: "w".into(),
            tensor: emulated::on(emulated::dev(EMULATED), &view(&mut d, &[3, 4], None)),
            spec: None,
        };
        unsafe { broadcast_state_dict(&comm, Some(&full), &[dest], &BroadcastOptions::default()) }
            .unwrap();
        emulated::synchronize_all();
        assert_eq!(d, src);
    }

    /// A device destination (the emulated device) receives what a host one does; a
    /// strided one is refused before anything moves.
    #[test]
    fn device_destinations_receive_what_host_ones_do() {
        if emulated::skip() {
            return;
        }
        let comm = Comm::local_group(1).pop().unwrap();
        let mut src: Vec<f32> = (0..12).map(|i| i as f32 * 0.5 - 2.0).collect();
        let full = vec![("w".to_string(), view(&mut src, &[3, 4], None))];
        let (mut host, mut dev) = (vec![0f32; 12], vec![0f32; 12]);
        let dest = |t: TensorView, device: Device| BroadcastDest {
            key: "w".into(),
            tensor: emulated::on(device, &t),
            spec: None,
        };
        let opts = BroadcastOptions::default();
        unsafe {
            broadcast_state_dict(
                &comm,
                Some(&full),
                &[dest(view(&mut host, &[3, 4], None), Device::Host)],
                &opts,
            )
            .unwrap();
            broadcast_state_dict(
                &comm,
                Some(&full),
                &[dest(view(&mut dev, &[3, 4], None), emulated::dev(EMULATED))],
                &opts,
            )
            .unwrap();
        }
        assert_eq!(host, src);
        emulated::synchronize_all();
        assert_eq!(dev, host);
        let mut wide = vec![0f32; 24];
        let e = unsafe {
            broadcast_state_dict(
                &comm,
                Some(&full),
                &[dest(
                    view(&mut wide, &[3, 4], Some(&[8, 1])),
                    emulated::dev(EMULATED),
                )],
                &opts,
            )
        }
        .unwrap_err()
        .to_string();
        assert!(
            e.contains("dests[0].tensor") && e.contains("a device destination must be contiguous"),
            "{e}"
        );
        assert!(wide.iter().all(|&x| x == 0.0));
    }
}
