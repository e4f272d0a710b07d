//! The writer's pause while a step runs (`Snapshot::mark_step`): it fetches nothing until
//! the step ends, except for a mutator that waits for it and once after each step's end.
use std::sync::mpsc;
use std::time::Duration;

use crate::ckpt::{save_async_held, Mode, SaveOptions};
use crate::optim::{Algorithm, OptimConfig, Optimizer, StateFormat};
use crate::{DType, TensorView};

fn view(b: &mut [f32]) -> TensorView {
    // SAFETY: the buffers outlive the optimizer in each test.
    unsafe {
        TensorView::host(
            b.as_mut_ptr() as *mut u8,
            DType::F32,
            &[b.len() as i64],
            None,
            "t",
        )
    }
    .unwrap()
}

/// Fails the test process instead of hanging it when `f` does not return in time.
fn within<T>(what: &str, f: impl FnOnce() -> T) -> T {
    let (tx, rx) = mpsc::channel::<()>();
    let what = what.to_string();
    let dog = std::thread::spawn(move || {
        if rx.recv_timeout(Duration::from_secs(60)).is_err() {
            eprintln!("{what}: still waiting after 60 s (a deadlock)");
            std::process::abort();
        }
    });
    let out = f();
    tx.send(()).unwrap();
    dog.join().unwrap();
    out
}

#[test]
fn the_writer_pauses_for_a_step_fetches_once_after_each_and_serves_a_waiting_mutator() {
    let mut params: Vec<Vec<f32>> = (0..3).map(|k| vec![0.1 * k as f32; 8192]).collect();
    let mut grads: Vec<Vec<f32>> = (0..3).map(|k| vec![0.01 * (k + 1) as f32; 8192]).collect();
    let mut cfg = OptimConfig::default_for(Algorithm::AdamW);
    cfg.state_format = StateFormat::Fp32;
    cfg.master_weight_bits = 0;
    let mut opt = Optimizer::new(cfg).unwrap();
    for (i, p) in params.iter_mut().enumerate() {
        unsafe { opt.add_param(&format!("w{i}"), view(p), None, 0) }.unwrap();
    }
    let gs: Vec<Option<TensorView>> = grads.iter_mut().map(|g| Some(view(g))).collect();
    unsafe { opt.step(&gs) }.unwrap();
    let dir = std::env::temp_dir().join(format!("fo-step-pause-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let mut o = SaveOptions::new(0, 1, Mode::Compressed);
    o.save_id = "pause".into();
    // A pool of 1 byte holds no copy: a mutation must wait for the writer to read.
    let mut save = save_async_held(&mut opt, &dir, &o, None, 1).unwrap();
    let first = opt.mark_step().expect("a save is in flight");
    save.hold_writer(false);
    std::thread::sleep(Duration::from_millis(300));
    assert_eq!(
        save.stats().bytes_written,
        0,
        "the writer fetched while a step ran"
    );
    // Steps back to back (the next one marked before the last one ends): after each
    // step's end the writer fetches once more, so it is never starved; then it pauses.
    let second = opt.mark_step().expect("a save is in flight");
    drop(first);
    let t0 = std::time::Instant::now();
    while save.stats().bytes_written == 0 {
        assert!(t0.elapsed() < Duration::from_secs(60), "the writer starved");
        std::thread::sleep(Duration::from_millis(1));
    }
    let once = save.stats().bytes_written;
    std::thread::sleep(Duration::from_millis(300));
    assert_eq!(
        save.stats().bytes_written,
        once,
        "more than one fetch during a step"
    );
    assert!(once < save.stats().bytes_total);
    // A mutation during the step waits for the writer, which goes on for it.
    within("before_write during a step", || opt.before_write(2)).unwrap();
    assert!(save.stats().bytes_written > once);
    drop(second);
    within("the save after the step", || save.wait(None, None)).unwrap();
    let st = save.stats();
    assert_eq!(st.bytes_written, st.bytes_total, "{st:?}");
    drop(save);
    drop(opt);
    std::fs::remove_dir_all(&dir).unwrap();
}
