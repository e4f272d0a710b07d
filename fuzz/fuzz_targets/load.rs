//! A one-rank checkpoint whose only file is the input, through verify, load and consolidate.
#![no_main]
use std::sync::Mutex;

use libfuzzer_sys::fuzz_target;

struct Fixture {
    dir: std::path::PathBuf,
    out: std::path::PathBuf,
    opt: fo::optim::Optimizer,
}

static FIXTURE: Mutex<Option<Fixture>> = Mutex::new(None);

fuzz_target!(|data: &[u8]| {
    let mut g = FIXTURE.lock().unwrap();
    let f = g.get_or_insert_with(|| {
        let root = fo_fuzz::scratch("load");
        let dir = root.join("ckpt");
        std::fs::create_dir_all(&dir).unwrap();
        Fixture { dir, out: root.join("out"), opt: fo_fuzz::fixture_optimizer() }
    });
    fo_fuzz::load_all(&f.dir, &f.out, &mut f.opt, data);
});
