use std::path::PathBuf;

use crate::dtype::{DType, UnknownDType};

/// Every failure of the container: the message names the file, the tensor and the numbers.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    /// The file is not a finished, well-formed trace.
    #[error("{path}: malformed trace: {reason}")]
    Malformed { path: PathBuf, reason: String },
    /// The file is well formed but its content does not match its recorded digests.
    #[error("{path}: edited after capture: {reason}")]
    Tampered { path: PathBuf, reason: String },
    /// A writer was asked to record something the format cannot hold.
    #[error("invalid trace content: {0}")]
    Invalid(String),
    #[error("{0}")]
    NotFound(String),
    /// A tensor was asked for as an element type other than the one it holds.
    #[error("{path}: tensor {tensor:?} is {stored}, not {asked}")]
    WrongDType {
        path: PathBuf,
        tensor: String,
        asked: DType,
        stored: DType,
    },
    /// A tensor's payload cannot be viewed in place as the type asked for (misaligned, a length
    /// that is not its element count, a shape this host cannot index).
    #[error("{path}: tensor {tensor:?} cannot be viewed as {asked} in place: {reason}")]
    NotViewable {
        path: PathBuf,
        tensor: String,
        asked: DType,
        reason: String,
    },
}

pub type Result<T> = std::result::Result<T, Error>;

impl From<UnknownDType> for Error {
    fn from(e: UnknownDType) -> Self {
        Error::Invalid(e.to_string())
    }
}

impl Error {
    pub(crate) fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        Error::Io {
            path: path.into(),
            source,
        }
    }
}
