//! Saves through a communicator: the ranks agree on a generated save id, rank 0 commits
//! once every rank staged, and a rank naming another save id fails every rank with the
//! previous checkpoint still the visible one.
mod ckpt_util;
use ckpt_util::*;

use fo::ckpt::{save_optimizer_comm, verify, Checkpoint, Mode, SaveOptions};
use fo::comm::Comm;
use fo::optim::StateFormat;
use fo::DType;

fn save_all(rs: &[Rank], dir: &std::path::Path, ids: [&str; 2]) -> Vec<fo::Result<String>> {
    let comms = Comm::local_group(2);
    std::thread::scope(|s| {
        let hs: Vec<_> = rs
            .iter()
            .zip(comms)
            .zip(ids)
            .enumerate()
            .map(|(r, ((rank, comm), id))| {
                s.spawn(move || {
                    let mut o = SaveOptions::new(r, 2, Mode::Compressed);
                    o.save_id = id.into();
                    save_optimizer_comm(&rank.opt, dir, &o, &comm)
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

#[test]
fn ranks_agree_on_a_generated_save_id_and_commit_together() {
    let dir = tmp("commit-comm");
    let rs = ranks(2, &config(StateFormat::Quant8, 0), DType::F32, 2);
    let ids = save_all(&rs, &dir, ["", ""]);
    let (a, b) = (ids[0].as_ref().unwrap(), ids[1].as_ref().unwrap());
    assert!(a == b && a.starts_with("auto-"), "{a} {b}");
    verify(&dir, &mut |_, _| {}).unwrap();
    assert_eq!(&Checkpoint::open(&dir).unwrap().meta.unwrap().save_id, a);
    // Rank 1 names another save: every rank fails the same way, nothing is committed.
    let res = save_all(&rs, &dir, ["s2", "other"]);
    for r in &res {
        let e = r.as_ref().unwrap_err().to_string();
        assert!(e.contains("save_id") && e.contains("\"other\""), "{e}");
    }
    assert_eq!(&Checkpoint::open(&dir).unwrap().meta.unwrap().save_id, a);
    let ids = save_all(&rs, &dir, ["s3", "s3"]);
    assert_eq!(ids[1].as_ref().unwrap(), "s3");
    assert_eq!(Checkpoint::open(&dir).unwrap().meta.unwrap().save_id, "s3");
    let stages = std::fs::read_dir(&dir)
        .unwrap()
        .filter(|e| e.as_ref().unwrap().file_name().to_string_lossy().starts_with(".fo-stage-"))
        .count();
    assert_eq!(stages, 0, "staging directories left after the commit");
    std::fs::remove_dir_all(&dir).unwrap();
}
