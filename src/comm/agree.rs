//! Turning a rank-local outcome into a collective one, so that a check failing on one
//! rank fails every rank the same way instead of leaving the others in a collective.
use super::{Comm, ReduceOp};
use crate::error::{Error, Result};

/// Bytes of the message broadcast from the failing rank (longer messages are cut).
const MESSAGE_BYTES: usize = 4096;

/// If any rank's `local` is an error, every rank returns the error of the lowest failing
/// rank: same variant, same message (suffixed with that rank when the group has more than
/// one). Costs one all-reduce, plus one broadcast when something failed. Every rank must
/// call it at the same point; use it for local checks, not after a failed collective.
pub fn agree<T>(comm: &Comm, local: Result<T>) -> Result<T> {
    let w = comm.world_size();
    let mut flag = [if local.is_err() {
        (w - comm.rank()) as f64
    } else {
        0.0
    }];
    comm.all_reduce_f64(&mut flag, ReduceOp::Max)?;
    if flag[0] == 0.0 {
        return local;
    }
    let owner = w - flag[0] as usize;
    let mut buf = vec![0u8; MESSAGE_BYTES];
    if comm.rank() == owner {
        let e = local.as_ref().err().expect("the owner failed");
        encode(e, &mut buf);
    }
    comm.broadcast(&mut buf, owner)?;
    let e = decode(&buf);
    Err(if w > 1 { on_rank(e, owner) } else { e })
}

fn parts(e: &Error) -> (u8, String, String) {
    match e {
        Error::InvalidArgument { name, reason } => (0, name.clone(), reason.clone()),
        Error::Dtype(m) => (1, m.clone(), String::new()),
        Error::Shape(m) => (2, m.clone(), String::new()),
        Error::NotFound(m) => (3, m.clone(), String::new()),
        Error::Comm(m) => (4, m.clone(), String::new()),
        Error::Numerics(m) => (5, m.clone(), String::new()),
        Error::Unsupported(m) => (6, m.clone(), String::new()),
        Error::Internal(m) => (7, m.clone(), String::new()),
        Error::Io { path, source } => (8, path.display().to_string(), source.to_string()),
        Error::Corrupt { path, detail } => (9, path.display().to_string(), detail.clone()),
        Error::Busy(m) => (10, m.clone(), String::new()),
        Error::Timeout(m) => (11, m.clone(), String::new()),
    }
}

fn encode(e: &Error, buf: &mut [u8]) {
    let (code, a, b) = parts(e);
    buf[0] = code;
    let mut at = 1;
    for s in [a, b] {
        let room = (buf.len() - at - 2) / 2;
        let mut n = s.len().min(room);
        while !s.is_char_boundary(n) {
            n -= 1;
        }
        buf[at..at + 2].copy_from_slice(&(n as u16).to_le_bytes());
        buf[at + 2..at + 2 + n].copy_from_slice(&s.as_bytes()[..n]);
        at += 2 + n;
    }
}

fn decode(buf: &[u8]) -> Error {
    let mut at = 1;
    let mut take = || {
        let n = u16::from_le_bytes([buf[at], buf[at + 1]]) as usize;
        let s = String::from_utf8_lossy(&buf[at + 2..at + 2 + n]).into_owned();
        at += 2 + n;
        s
    };
    let (a, b) = (take(), take());
    match buf[0] {
        0 => Error::InvalidArgument { name: a, reason: b },
        1 => Error::Dtype(a),
        2 => Error::Shape(a),
        3 => Error::NotFound(a),
        4 => Error::Comm(a),
        5 => Error::Numerics(a),
        6 => Error::Unsupported(a),
        8 => Error::io(a, std::io::Error::other(b)),
        9 => Error::corrupt(a, b),
        10 => Error::Busy(a),
        11 => Error::Timeout(a),
        _ => Error::Internal(a),
    }
}

fn on_rank(e: Error, rank: usize) -> Error {
    let tag = |m: String| format!("{m} (on rank {rank})");
    match e {
        Error::InvalidArgument { name, reason } => Error::InvalidArgument {
            name,
            reason: tag(reason),
        },
        Error::Dtype(m) => Error::Dtype(tag(m)),
        Error::Shape(m) => Error::Shape(tag(m)),
        Error::NotFound(m) => Error::NotFound(tag(m)),
        Error::Comm(m) => Error::Comm(tag(m)),
        Error::Numerics(m) => Error::Numerics(tag(m)),
        Error::Unsupported(m) => Error::Unsupported(tag(m)),
        Error::Internal(m) => Error::Internal(tag(m)),
        Error::Busy(m) => Error::Busy(tag(m)),
        Error::Timeout(m) => Error::Timeout(tag(m)),
        Error::Io { path, source } => Error::Io {
            path,
            source: std::io::Error::other(tag(source.to_string())),
        },
        Error::Corrupt { path, detail } => Error::Corrupt {
            path,
            detail: tag(detail),
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::comm::LocalGroupOptions;
    use std::time::Duration;

    #[test]
    fn every_rank_gets_the_lowest_failing_ranks_error() {
        let comms = Comm::local_group_with(
            4,
            LocalGroupOptions {
                timeout: Duration::from_secs(5),
            },
        );
        let handles: Vec<_> = comms
            .into_iter()
            .map(|c| {
                std::thread::spawn(move || {
                    let local: Result<()> = match c.rank() {
                        1 => Err(Error::Shape("key w: [2] vs [3]".into())),
                        3 => Err(Error::invalid("dests[0]", "bad")),
                        _ => Ok(()),
                    };
                    agree(&c, local).unwrap_err()
                })
            })
            .collect();
        for h in handles {
            let e = h.join().unwrap();
            assert!(matches!(e, Error::Shape(_)), "{e:?}");
            assert_eq!(
                e.to_string(),
                "shape mismatch: key w: [2] vs [3] (on rank 1)"
            );
        }
    }

    #[test]
    fn encoding_round_trips_every_variant_and_cuts_long_messages() {
        for e in [
            Error::invalid("a", "b"),
            Error::Numerics("n".into()),
            Error::corrupt("/f", "d"),
            Error::Busy("fo_clip_grad_norm: the communicator is busy".into()),
        ] {
            let mut buf = vec![0u8; MESSAGE_BYTES];
            encode(&e, &mut buf);
            assert_eq!(decode(&buf).to_string(), e.to_string());
        }
        let long = Error::NotFound("é".repeat(5000));
        let mut buf = vec![0u8; MESSAGE_BYTES];
        encode(&long, &mut buf);
        assert!(decode(&buf).to_string().len() < MESSAGE_BYTES);
    }
}
