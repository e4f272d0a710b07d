//! `fo ckpt inspect|verify|consolidate DIR`: look into a checkpoint directory (fo's or
//! PyTorch's HuggingFace DCP files).
use std::io::Write;
use std::path::Path;

use super::Flags;
use fo::ckpt::{consolidate, verify, Checkpoint};

/// Progress on stderr for checkpoints above 64 MiB: a bar on a terminal, otherwise a
/// line per 10%.
pub struct Progress {
    what: &'static str,
    last: u64,
    tty: bool,
}

impl Progress {
    pub fn new(what: &'static str) -> Progress {
        Progress {
            what,
            last: u64::MAX,
            tty: unsafe { libc::isatty(2) } == 1,
        }
    }

    pub fn update(&mut self, done: u64, total: u64) {
        if total < 64 << 20 {
            return;
        }
        let pct = done * 100 / total.max(1);
        let step = if self.tty { pct } else { pct / 10 * 10 };
        if step == self.last {
            return;
        }
        self.last = step;
        let gib = |b: u64| b as f64 / (1u64 << 30) as f64;
        if self.tty {
            let bar: String = (0..40).map(|i| if i * 100 < pct * 40 { '#' } else { ' ' }).collect();
            eprint!(
                "\r{} [{bar}] {pct:3}% {:.2}/{:.2} GiB",
                self.what,
                gib(done),
                gib(total)
            );
            if done >= total {
                eprintln!();
            }
        } else {
            eprintln!("{} {pct}% ({:.2}/{:.2} GiB)", self.what, gib(done), gib(total));
        }
        let _ = std::io::stderr().flush();
    }
}

const USAGE: &str = "usage: fo ckpt inspect DIR | verify DIR | consolidate DIR OUT";

pub fn run(args: &[String]) -> Result<(), String> {
    let f = Flags::parse(args)?;
    let pos: Vec<&str> = f.positional.iter().map(String::as_str).collect();
    match pos.as_slice() {
        ["inspect", dir] => inspect(Path::new(dir)),
        ["verify", dir] => {
            let mut p = Progress::new("verify");
            let v = verify(Path::new(dir), &mut |d, t| p.update(d, t)).map_err(|e| e.to_string())?;
            println!(
                "ok: {} files, {} keys, {} chunks, {} bytes; every element saved exactly once; {} of {} chunks checksummed and verified",
                v.files, v.keys, v.chunks, v.bytes, v.checksummed_chunks, v.chunks
            );
            Ok(())
        }
        ["consolidate", dir, out] => {
            let mut p = Progress::new("consolidate");
            let c =
                consolidate(Path::new(dir), Path::new(out), &mut |d, t| p.update(d, t)).map_err(|e| e.to_string())?;
            println!(
                "wrote {} ({} keys, {} bytes) and {}",
                c.file.display(),
                c.keys,
                c.bytes,
                c.index.display()
            );
            Ok(())
        }
        _ => Err(USAGE.to_string()),
    }
}

fn inspect(dir: &Path) -> Result<(), String> {
    let ck = Checkpoint::open(dir).map_err(|e| e.to_string())?;
    match &ck.meta {
        Some(m) => println!(
            "fo checkpoint: {} files, mode {}, fo {}, save_id {:?}, {} param groups",
            ck.files.len(),
            m.mode,
            m.fo_version,
            m.save_id,
            m.param_groups.as_array().map_or(0, Vec::len)
        ),
        None => println!(
            "checkpoint without fo metadata (PyTorch DCP HuggingFace files): {} files",
            ck.files.len()
        ),
    }
    println!(
        "{:<48} {:<5} {:<14} {:<28} {:>7} {:>12}",
        "key", "dtype", "global shape", "sharding", "chunks", "bytes"
    );
    let mut total = 0usize;
    for (k, info) in &ck.keys {
        let bytes: usize = info.chunks.iter().map(|c| c.nbytes).sum();
        total += bytes;
        let sharding = match &info.fo {
            Some(f) if f.group_scales_of.is_some() => format!("scales of [{}] groups", f.placements.join(",")),
            Some(f) => format!("mesh {:?} [{}]", f.mesh, f.placements.join(",")),
            None => "saved_offsets only".to_string(),
        };
        println!(
            "{:<48} {:<5} {:<14} {:<28} {:>7} {:>12}",
            k,
            info.dtype.to_string(),
            format!("{:?}", info.global_shape),
            sharding,
            info.chunks.len(),
            bytes
        );
    }
    let compressed = ck.keys.keys().any(|k| k.ends_with("::quantized"));
    println!(
        "{} keys, {total} bytes of tensor data; state is {}",
        ck.keys.len(),
        if compressed { "compressed (quant8)" } else { "portable" }
    );
    Ok(())
}
