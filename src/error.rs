//! fo's one error type: what went wrong, naming the argument, key, shape or file at
//! fault; the C ABI maps each variant to one status code.
use std::path::PathBuf;

/// Everything that can go wrong in fo. Each variant carries what a user needs to act:
/// the argument, key, shape or file at fault. Variants map one-to-one onto the C status
/// codes (`ffi::status::status_of`, the one place that maps them).
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A caller-supplied value is out of range, NULL, or inconsistent with another.
    #[error("invalid argument `{name}`: {reason}")]
    InvalidArgument { name: String, reason: String },
    /// An element type is unknown, unsupported here, or differs from what is required.
    #[error("dtype error: {0}")]
    Dtype(String),
    /// Shapes disagree (a tensor against its key's recorded shape, a grad against its param).
    #[error("shape mismatch: {0}")]
    Shape(String),
    /// A key, parameter or file that must exist does not.
    #[error("not found: {0}")]
    NotFound(String),
    /// The operating system refused a file operation.
    #[error("I/O error on {path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    /// A file exists but its contents are wrong: truncated, bad header, bad checksum.
    #[error("corrupt data in {path}: {detail}")]
    Corrupt { path: PathBuf, detail: String },
    /// A collective failed or ranks disagreed.
    #[error("communication error: {0}")]
    Comm(String),
    /// A non-finite gradient or an unrepresentable update (with numerics checks on).
    #[error("numerics error: {0}")]
    Numerics(String),
    /// A valid request this build or machine cannot serve (no CUDA, a format not yet read).
    #[error("unsupported: {0}")]
    Unsupported(String),
    /// A wait ran out of time; the work it waited for goes on (wait again).
    #[error("timed out: {0}")]
    Timeout(String),
    /// A bug in fo: a panic caught at the boundary, or a broken invariant.
    #[error("internal error: {0}")]
    Internal(String),
    /// A handle is in use by another call (another thread, or a callback re-entering fo):
    /// the message names both calls. Nothing was done; retry once the other call returned.
    #[error("handle busy: {0}")]
    Busy(String),
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

/// A copy, for errors kept and reported twice (an async save's background failure, an
/// overlapped step's first failure): an I/O error keeps its kind and text, not its
/// OS payload.
/// The text a panic carries (`panic!("...")` gives a `&str` or a `String`), if any: one
/// reading of the payload for every place that turns a panic into a message.
pub fn panic_message(payload: &(dyn std::any::Any + Send)) -> Option<&str> {
    payload
        .downcast_ref::<&str>()
        .copied()
        .or_else(|| payload.downcast_ref::<String>().map(String::as_str))
}

impl Clone for Error {
    fn clone(&self) -> Error {
        match self {
            Error::InvalidArgument { name, reason } => Error::invalid(name.clone(), reason.clone()),
            Error::Dtype(m) => Error::Dtype(m.clone()),
            Error::Shape(m) => Error::Shape(m.clone()),
            Error::NotFound(m) => Error::NotFound(m.clone()),
            Error::Io { path, source } => Error::io(
                path.clone(),
                std::io::Error::new(source.kind(), source.to_string()),
            ),
            Error::Corrupt { path, detail } => Error::corrupt(path.clone(), detail.clone()),
            Error::Comm(m) => Error::Comm(m.clone()),
            Error::Numerics(m) => Error::Numerics(m.clone()),
            Error::Unsupported(m) => Error::Unsupported(m.clone()),
            Error::Timeout(m) => Error::Timeout(m.clone()),
            Error::Busy(m) => Error::Busy(m.clone()),
            Error::Internal(m) => Error::Internal(m.clone()),
        }
    }
}

impl Error {
    /// Shorthand for the most common error: a named argument with the reason it is bad.
    pub fn invalid(name: impl Into<String>, reason: impl Into<String>) -> Self {
        Error::InvalidArgument {
            name: name.into(),
            reason: reason.into(),
        }
    }

    pub fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        Error::Io {
            path: path.into(),
            source,
        }
    }

    pub fn corrupt(path: impl Into<PathBuf>, detail: impl Into<String>) -> Self {
        Error::Corrupt {
            path: path.into(),
            detail: detail.into(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn invalid_argument_message_names_the_argument() {
        let e = Error::invalid("mesh_shape[1]", "must be >= 1, got 0");
        assert_eq!(
            e.to_string(),
            "invalid argument `mesh_shape[1]`: must be >= 1, got 0"
        );
    }
}
