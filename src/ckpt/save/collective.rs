//! Saves through a communicator: the ranks agree on the save id, each stages its file,
//! they report success to each other, and rank 0 writes the commit record once every
//! rank has staged. When this returns OK on any rank, the checkpoint is committed; when
//! it fails, it fails on every rank with the first failing rank's error and the previous
//! checkpoint stays the visible one.
use std::borrow::Cow;
use std::path::Path;

use super::commit::{mark_done, try_commit};
use super::optim::{pack_options, plan_entries, Fetcher, SaveOptions};
use super::writer::{generated_save_id, publish, stage_rank_file};
use crate::comm::{agree, Comm};
use crate::error::{Error, Result};
use crate::optim::Optimizer;

/// Longest save id agreed through the communicator (bytes).
const MAX_ID: usize = 1024;

/// Rank 0's save id (its `save_id`, or a generated one when empty), on every rank. A rank
/// that names a different id fails every rank.
pub(crate) fn agree_save_id(comm: &Comm, save_id: &str) -> Result<String> {
    let mine = if save_id.is_empty() && comm.rank() == 0 {
        generated_save_id()
    } else {
        save_id.to_string()
    };
    let local = if mine.len() > MAX_ID {
        Err(Error::invalid(
            "save_id",
            format!("is {} bytes, at most {MAX_ID}", mine.len()),
        ))
    } else {
        Ok(())
    };
    agree(comm, local)?;
    let mut buf = vec![0u8; MAX_ID + 8];
    if comm.rank() == 0 {
        buf[..8].copy_from_slice(&(mine.len() as u64).to_le_bytes());
        buf[8..8 + mine.len()].copy_from_slice(mine.as_bytes());
    }
    comm.broadcast(&mut buf, 0)?;
    let n = (u64::from_le_bytes(buf[..8].try_into().unwrap()) as usize).min(MAX_ID);
    let id = String::from_utf8_lossy(&buf[8..8 + n]).into_owned();
    let local = if !save_id.is_empty() && save_id != id {
        Err(Error::invalid(
            "save_id",
            format!(
                "rank {} saves {save_id:?} while rank 0 saves {id:?}",
                comm.rank()
            ),
        ))
    } else {
        Ok(())
    };
    agree(comm, local)?;
    Ok(id)
}

/// Longest directory path agreed through the communicator (bytes).
const MAX_DIR: usize = 4096;

/// Every rank's arguments against rank 0's: the directory and the options that shape the
/// checkpoint (mode, params, world size). Rank 0 broadcasts its own; a rank that differs
/// fails every rank with an error naming both values.
pub(crate) fn agree_arguments(comm: &Comm, dir: &Path, o: &SaveOptions) -> Result<()> {
    let mine = format!(
        "{}\0{:?}\0{:?}\0{}",
        dir.display(),
        o.mode,
        o.params,
        o.world_size
    );
    let mut buf = vec![0u8; MAX_DIR + 256];
    let fits = mine.len() + 8 <= buf.len();
    agree(
        comm,
        if fits {
            Ok(())
        } else {
            Err(Error::invalid(
                "dir",
                format!("is {} bytes, at most {MAX_DIR}", dir.as_os_str().len()),
            ))
        },
    )?;
    if comm.rank() == 0 {
        buf[..8].copy_from_slice(&(mine.len() as u64).to_le_bytes());
        buf[8..8 + mine.len()].copy_from_slice(mine.as_bytes());
    }
    comm.broadcast(&mut buf, 0)?;
    let n = (u64::from_le_bytes(buf[..8].try_into().unwrap()) as usize).min(buf.len() - 8);
    let theirs = String::from_utf8_lossy(&buf[8..8 + n]).into_owned();
    let local = if theirs == mine {
        Ok(())
    } else {
        let (a, b): (Vec<&str>, Vec<&str>) =
            (theirs.split('\0').collect(), mine.split('\0').collect());
        let names = [
            "dir",
            "options.mode",
            "options.params",
            "options.world_size",
        ];
        let i = (0..names.len())
            .find(|&i| a.get(i) != b.get(i))
            .unwrap_or(0);
        Err(Error::invalid(
            names[i],
            format!(
                "rank {} passes {:?} while rank 0 passes {:?}; every rank of one save must pass the same",
                comm.rank(),
                b.get(i).unwrap_or(&""),
                a.get(i).unwrap_or(&"")
            ),
        ))
    };
    agree(comm, local)
}

/// Saves `opt`'s state of this rank (`o.rank`/`o.world_size` must be the communicator's)
/// and commits the save collectively. Returns the save id.
pub fn save_optimizer_comm(
    opt: &Optimizer,
    dir: &Path,
    o: &SaveOptions,
    comm: &Comm,
) -> Result<String> {
    save_optimizer_comm_checked(comm, Ok((opt, dir, o.clone())))
}

/// `save_optimizer_comm` for callers whose arguments may have failed to convert on this
/// rank (the C ABI): the ranks first agree on every rank's local checks (the first
/// failing rank's error becomes every rank's), then on the directory and options.
pub(crate) fn save_optimizer_comm_checked(
    comm: &Comm,
    local: Result<(&Optimizer, &Path, SaveOptions)>,
) -> Result<String> {
    let local = local.and_then(|(opt, dir, o)| {
        o.validate()?;
        if o.rank != comm.rank() || o.world_size != comm.world_size() {
            return Err(Error::invalid(
                "options.rank",
                format!(
                    "rank {} of {} differs from the communicator's rank {} of {}",
                    o.rank,
                    o.world_size,
                    comm.rank(),
                    comm.world_size()
                ),
            ));
        }
        super::writer::check_dir(dir)?;
        Ok((opt, dir, o))
    });
    let (opt, dir, o) = agree(comm, local)?;
    let o = &o;
    agree_arguments(comm, dir, o)?;
    let save_id = agree_save_id(comm, &o.save_id)?;
    let staged = (|| {
        let (metas, srcs) = plan_entries(opt, o)?;
        let mut popts = pack_options(opt, o);
        popts.save_id = save_id.clone();
        let plan = super::pack::plan(&metas, &popts)?;
        let mut fetcher = Fetcher::new(opt, &srcs);
        let staged = stage_rank_file(dir, &plan, &popts, &mut |e| fetcher.get(e).map(Cow::Owned))?;
        let parts = staged.num_parts();
        let digest = publish(dir, staged)?;
        mark_done(dir, &save_id, o.rank, o.world_size, &digest, parts)
    })();
    commit_collective(comm, dir, &save_id, o.world_size, staged)?;
    Ok(save_id)
}

/// The collective end of a save: every rank reports how its staging went (`staged`);
/// when all succeeded, rank 0 writes the commit record; every rank returns the same
/// outcome. Run on the caller's thread (the synchronous save, and `fo_save_wait` of an
/// async one), so a communicator is never used from two threads at once.
pub(crate) fn commit_collective(
    comm: &Comm,
    dir: &Path,
    save_id: &str,
    world_size: usize,
    staged: Result<()>,
) -> Result<()> {
    agree(comm, staged)?;
    let committed = if comm.rank() == 0 {
        try_commit(dir, save_id, world_size).and_then(|done| {
            if done {
                Ok(())
            } else {
                Err(markers_unseen(dir, save_id, world_size))
            }
        })
    } else {
        Ok(())
    };
    agree(comm, committed)
}

/// Every rank staged its file, yet rank 0 does not see all done markers: the ranks wrote
/// into different directories behind one path (a relative path from different working
/// directories, a disk that is not shared between hosts). The caller's setup, not fo's.
fn markers_unseen(dir: &Path, save_id: &str, world_size: usize) -> Error {
    let stage = super::commit::stage_dir(dir, save_id);
    let unseen: Vec<usize> = (0..world_size)
        .filter(|r| !stage.join(format!("done-{r}.json")).exists())
        .take(16)
        .collect();
    Error::invalid(
        "dir",
        format!(
            "every rank reported its file of save {save_id:?} staged, but rank 0 does not see              the files of ranks {unseen:?} in {}: every rank must save into the same directory,              one that rank 0 can read (a shared filesystem)",
            dir.display()
        ),
    )
}
