use std::path::PathBuf;

use crate::digest::Digest;
use crate::dtype::{DType, UnknownDType};
use crate::layout::{
    ALIGN, FOOTER_LEN, FORMAT_MAJOR, FORMAT_NAME, HEADER_LEN, MAX_INDEX_LEN, MAX_RANK, TMP_SUFFIX,
};

/// Every failure of the container: the message names the file, the tensor and the numbers.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    /// The file is not a finished, well-formed trace; `kind` says what is wrong.
    #[error("{path}: malformed trace: {kind}")]
    Malformed { path: PathBuf, kind: Malformed },
    /// The file is well formed but its content does not match its recorded digests.
    #[error("{path}: edited after capture: {kind}")]
    Tampered { path: PathBuf, kind: Tampered },
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

/// What makes a file not a finished, well-formed trace, in the order the reader checks
/// (docs/trace-format.md "Reading and refusal rules"). Each kind carries the names and numbers
/// its message shows.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Malformed {
    #[error("a writer's temporary file (*{}): the trace was never finished, or its writer is still running", TMP_SUFFIX)]
    TemporaryFile,
    /// `what` is the file's type as [`crate::json::file_kind`] words it ("a FIFO").
    #[error("{what}, not a regular file: a trace is one regular file")]
    NotRegularFile { what: &'static str },
    #[error("file is {len} bytes, shorter than header + footer ({})", HEADER_LEN + FOOTER_LEN)]
    TooShort { len: u64 },
    #[error("{0}")]
    SizeChanged(Resized),
    #[error("bad magic {found:02x?} (expected \"TGTRACE\\0\"): not a tracegate trace")]
    BadMagic { found: [u8; 8] },
    #[error(
        "format version {major}.{minor} is not supported (this reader reads {}.x)",
        FORMAT_MAJOR
    )]
    UnsupportedVersion { major: u16, minor: u16 },
    #[error("header byte {at} is {value:#04x}: header bytes 12..64 must be zero")]
    NonZeroHeader { at: usize, value: u8 },
    #[error("no footer: the file is truncated or was never finished")]
    NoFooter,
    #[error("index length {len} exceeds the limit {}", MAX_INDEX_LEN)]
    IndexTooLong { len: u64 },
    #[error("footer places the index at {offset}..+{len}, but it must end at the footer ({data_end}) and start after the header")]
    IndexMisplaced {
        offset: u64,
        len: u64,
        data_end: u64,
    },
    #[error(
        "footer places the index at {offset}, which is not {}-byte aligned",
        ALIGN
    )]
    IndexMisaligned { offset: u64 },
    /// Not the schema: not UTF-8 or JSON, a missing, repeated or mistyped field (serde's words).
    #[error("index is not valid: {reason}")]
    BadIndex { reason: String },
    /// `field` as `"key"` or `"key" in tensors[0]`.
    #[error(
        "index is not valid: unknown field {field} (format {major}.{minor} has no such field)"
    )]
    UnknownField {
        field: String,
        major: u16,
        minor: u16,
    },
    #[error("index format {found:?} is not {:?}", FORMAT_NAME)]
    WrongFormat { found: String },
    #[error("index version {}.{} disagrees with header {}.{}", .index[0], .index[1], .header[0], .header[1])]
    VersionDisagrees { index: [u16; 2], header: [u16; 2] },
    #[error("digest {digest:?} is not 64 lowercase hex digits")]
    BadDigest { digest: String },
    #[error("{place}: {duplicate}")]
    DuplicateKey { place: KeyPlace, duplicate: String },
    #[error("provenance is not a JSON object")]
    ProvenanceNotObject,
    /// `reason` is the name rule's (empty, too long, a control character), naming the entry.
    #[error("{reason}")]
    BadName { reason: String },
    #[error("tensor {tensor:?}: {unknown}")]
    BadDtype {
        tensor: String,
        unknown: UnknownDType,
    },
    #[error("{entry}: rank {rank} exceeds {}", MAX_RANK)]
    RankTooHigh { entry: Entry, rank: usize },
    #[error("{0}")]
    ShapeOverflow(Overflow),
    #[error("tensor {tensor:?}: nbytes {nbytes} but shape {shape:?} of {dtype} needs {needed}")]
    NbytesMismatch {
        tensor: String,
        nbytes: u64,
        shape: Vec<u64>,
        dtype: DType,
        needed: u64,
    },
    #[error("{payload}: offset {offset} + {nbytes} bytes overflows")]
    RangeOverflow {
        payload: Payload,
        offset: u64,
        nbytes: u64,
    },
    #[error("{payload}: offset {offset} is not {}-byte aligned", ALIGN)]
    Misaligned { payload: Payload, offset: u64 },
    #[error(
        "{payload}: bytes {start}..{end} lie outside the data region {}..{index_offset}",
        HEADER_LEN
    )]
    OutsideData {
        payload: Payload,
        start: u64,
        end: u64,
        index_offset: u64,
    },
    #[error("{entry}: xxh3 {xxh3:?} is not 32 lowercase hex digits")]
    BadXxh3 { entry: Entry, xxh3: String },
    /// `reason` is the attribute rule's (an empty key, a mistyped value, a `shard` outside its
    /// grammar).
    #[error("tensor {tensor:?}: {reason}")]
    BadAttributes { tensor: String, reason: String },
    #[error("duplicate {} name {:?}", .entry.kind(), .entry.name())]
    DuplicateName { entry: Entry },
    /// `payload` (bytes `start..end`) begins inside `other` (bytes `other_start..other_end`).
    #[error(
        "{payload} (bytes {start}..{end}) overlaps {other} (bytes {other_start}..{other_end})"
    )]
    Overlap {
        payload: Payload,
        start: u64,
        end: u64,
        other: Payload,
        other_start: u64,
        other_end: u64,
    },
    /// Found by `verify` and by a typed view: it would not be a Rust `bool`.
    #[error("tensor {tensor:?}: bool element {element} is {value} (must be 0 or 1)")]
    BadBool {
        tensor: String,
        element: usize,
        value: u8,
    },
}

/// What a well-formed file's content no longer matches.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Tampered {
    #[error("the index does not match the footer's xxh3-128")]
    IndexDigestMismatch,
    #[error("tensor {tensor:?} (bytes {start}..{end}) no longer matches its xxh3-128")]
    TensorDigestMismatch {
        tensor: String,
        start: u64,
        end: u64,
    },
    #[error("decision {decision:?} no longer matches its xxh3-128")]
    DecisionDigestMismatch { decision: String },
    /// `payloads_checked`: every tensor's payload matched its digest first, so the edit is in
    /// the index's own content.
    #[error("content digest is {} but the index records {}: {}", .recomputed.hex(), .recorded.hex(), if *.payloads_checked {
        "every payload matches its digest, so the index itself (a name, dtype, shape or attribute) was edited"
    } else {
        "the index (a name, dtype, shape, attribute or recorded tensor digest) was edited"
    })]
    ContentDigestMismatch {
        recomputed: Digest,
        recorded: Digest,
        payloads_checked: bool,
    },
    /// Bytes outside every payload are covered by no digest: anything but zero there is data
    /// smuggled past `verify`.
    #[error(
        "padding byte {at} (in the gap {start}..{end} between payloads) is {value:#04x}, not zero"
    )]
    NonZeroPadding {
        at: u64,
        start: u64,
        end: u64,
        value: u8,
    },
}

/// A file whose size changed under the reader.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Resized {
    #[error("file is {len} bytes but {mapped} were mapped: it changed while being opened")]
    WhileMapping { len: u64, mapped: u64 },
    #[error("index is {read} bytes on reading, {footer} in the footer: the file changed while being opened")]
    WhileReadingIndex { read: u64, footer: u64 },
    /// Found before payloads are read ([`crate::Trace::check_size`]).
    #[error("the file is now {now} bytes but was {was} when opened: it was truncated or rewritten while in use")]
    InUse { now: u64, was: u64 },
}

/// A shape whose size does not fit u64.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Overflow {
    #[error("tensor {tensor:?}: shape {shape:?} x {size} bytes overflows")]
    TensorBytes {
        tensor: String,
        shape: Vec<u64>,
        size: usize,
    },
    #[error("decision {decision:?}: shape {shape:?} overflows")]
    DecisionValues { decision: String, shape: Vec<u64> },
    #[error("decision {decision:?}: rows overflow")]
    DecisionMargins { decision: String },
}

/// An index entry, shown as `tensor "name"` or `decision "name"`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Entry {
    #[error("tensor {0:?}")]
    Tensor(String),
    #[error("decision {0:?}")]
    Decision(String),
}

impl Entry {
    pub fn kind(&self) -> &'static str {
        match self {
            Entry::Tensor(_) => "tensor",
            Entry::Decision(_) => "decision",
        }
    }
    pub fn name(&self) -> &str {
        match self {
            Entry::Tensor(n) | Entry::Decision(n) => n,
        }
    }
}

/// One payload in the data region: a tensor's, or a decision's values or margins.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Payload {
    #[error("tensor {0:?}")]
    Tensor(String),
    #[error("decision {0:?} values")]
    Values(String),
    #[error("decision {0:?} margins")]
    Margins(String),
}

/// Where a repeated JSON key was found.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum KeyPlace {
    #[error("provenance")]
    Provenance,
    #[error("tensor {0:?}: attributes")]
    Attributes(String),
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
