//! An emulated stream: a worker thread running its jobs in order after random delays, so
//! work on different streams interleaves unpredictably; the registry of created streams.
use std::collections::HashMap;
use std::sync::{mpsc, Arc, Mutex, OnceLock};
use std::time::Duration;

pub(super) type Job = Box<dyn FnOnce() + Send>;

/// One stream: a worker thread running its jobs in order, each after a random delay, so
/// work on different streams interleaves unpredictably. Only `order_streams` (events)
/// and waits order two streams, as on a GPU with non-blocking streams.
pub(super) struct Worker {
    tx: Mutex<mpsc::Sender<Job>>,
    pub(super) device: i32,
}

impl Worker {
    pub(super) fn spawn(device: i32, seed: u64) -> Arc<Worker> {
        let (tx, rx) = mpsc::channel::<Job>();
        std::thread::Builder::new()
            .name(format!("fo-emulated-{device}-{seed:x}"))
            .spawn(move || {
                let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
                for job in rx {
                    x ^= x << 13;
                    x ^= x >> 7;
                    x ^= x << 17;
                    if x.is_multiple_of(2) {
                        std::thread::sleep(Duration::from_micros(x % 300));
                    }
                    job();
                }
            })
            .expect("a stream worker thread");
        Arc::new(Worker {
            tx: Mutex::new(tx),
            device,
        })
    }

    pub(super) fn push(&self, job: Job) {
        let _ = self.tx.lock().unwrap().send(job);
    }

    /// Waits for every job queued so far.
    pub(super) fn sync(&self) {
        let (tx, rx) = mpsc::channel();
        self.push(Box::new(move || {
            let _ = tx.send(());
        }));
        let _ = rx.recv();
    }
}

/// Streams made by `create_stream`, by handle.
pub(super) fn streams() -> &'static Mutex<HashMap<usize, Arc<Worker>>> {
    static S: OnceLock<Mutex<HashMap<usize, Arc<Worker>>>> = OnceLock::new();
    S.get_or_init(Default::default)
}

/// A new stream of emulated device `ordinal` (a handle that is never 0).
pub fn create_stream(ordinal: i32) -> usize {
    let mut s = streams().lock().unwrap();
    let handle = 0x5000 + 0x10 * (s.len() + 1);
    s.insert(handle, Worker::spawn(ordinal, handle as u64));
    handle
}
