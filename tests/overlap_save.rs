//! An overlapped step while an async save is in flight: every parameter the step writes
//! early is handed to the save first (its `before_write` copy), so the checkpoint is still
//! byte-identical to a synchronous save at the call; the step gives the bits of `step`.
mod ckpt_util;

use std::path::Path;

use ckpt_util::{config, global, tmp, Buf, Rank, MODEL};
use fo::ckpt::{local_shard, save_async_held, save_optimizer, Mode, ParamsAs, SaveOptions};
use fo::optim::overlap::{OverlapOptions, OverlapStats};
use fo::optim::StateFormat;
use fo::tensor::TensorView;
use fo::DType;

fn options() -> SaveOptions {
    let mut o = SaveOptions::new(0, 1, Mode::Compressed);
    o.save_id = "overlap".into();
    o.params = Some(ParamsAs::Stored);
    o
}

fn files(d: &Path) -> Vec<(String, Vec<u8>)> {
    let mut v: Vec<(String, Vec<u8>)> = std::fs::read_dir(d)
        .unwrap()
        .map(|e| e.unwrap())
        .filter(|e| !e.file_name().to_string_lossy().starts_with('.'))
        .map(|e| {
            let name = e.file_name().into_string().unwrap();
            (name, std::fs::read(e.path()).unwrap())
        })
        .collect();
    v.sort();
    v
}

#[test]
fn an_overlapped_step_during_an_async_save_keeps_the_checkpoint_at_the_call() {
    let cfg = config(StateFormat::Quant8, 24);
    let (sync, asy) = (tmp("overlap-save-sync"), tmp("overlap-save"));
    let mut a = Rank::new(1, 0, cfg.clone(), DType::BF16);
    let mut b = Rank::new(1, 0, cfg, DType::BF16);
    a.step(0);
    b.step(0);
    save_optimizer(&b.opt, &sync, &options()).unwrap();
    let mut save = save_async_held(&mut b.opt, &asy, &options(), None, 0).unwrap();
    // Step 1's gradients, handed over last to first while the writer is held.
    let mut grads: Vec<Option<Buf>> = MODEL
        .iter()
        .enumerate()
        .map(|(k, (_, shape, _, has))| {
            has.then(|| {
                let s = &b.specs[k];
                Buf::new(local_shard(
                    &global(DType::BF16, shape, 100.0 + (10 + k) as f32),
                    s,
                ))
            })
        })
        .collect();
    let views: Vec<Option<TensorView>> = grads
        .iter_mut()
        .map(|g| g.as_mut().map(Buf::view))
        .collect();
    let mut st = OverlapStats::default();
    unsafe {
        b.opt.step_begin(OverlapOptions::default()).unwrap();
        for (i, g) in views.iter().enumerate().rev() {
            if let Some(g) = g {
                b.opt.grads_ready(&[i], std::slice::from_ref(g)).unwrap();
            }
        }
        b.opt.step_end(None, &mut st).unwrap();
    }
    a.step(1);
    assert!(st.speculative > 0, "{st:?}");
    assert!(save.stats().copies > 0, "{:?}", save.stats());
    save.hold_writer(false);
    save.wait(None, None).unwrap();
    assert!(
        files(&asy) == files(&sync),
        "the checkpoint holds the state at the call"
    );
    for (x, y) in a.params.iter().zip(&b.params) {
        assert_eq!(
            x.bytes(),
            y.bytes(),
            "the overlapped step gives step's bits"
        );
    }
    for d in [sync, asy] {
        std::fs::remove_dir_all(d).unwrap();
    }
}
