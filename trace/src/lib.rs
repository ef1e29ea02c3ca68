//! The tracegate `.trace` container: a single file holding the tensors a producer captured,
//! the discrete decisions it made, and where it came from. The byte layout is specified in
//! `docs/trace-format.md`; this crate is its reference implementation.
//!
//! Writing streams each tensor to a temporary file in the destination directory and renames it
//! into place on [`TraceWriter::finish`], so a crashed producer never leaves a file at the final
//! path. Reading maps the file and validates the whole index before handing out any view:
//! [`Trace::slice`] (`&[T]`) and, with the default `ndarray` feature, [`Trace::view`]
//! (`ndarray::ArrayViewD<T>` with the tensor's shape) read a tensor in place, typed by
//! [`Element`] (`f64 f32 half::f16 half::bf16 i64 i32 i16 i8 u8 bool`).

mod attrs;
mod canonical;
pub mod child;
mod digest;
mod dtype;
mod error;
mod index;
pub mod json;
mod layout;
pub mod merge;
pub mod names;
pub mod output;
pub mod protocol;
mod reader;
pub mod settings;
pub mod shard;
mod view;
mod weights;
mod writer;

pub use attrs::{Attributes, ExtraAttrs};
pub use digest::{xxh3_hex, Digest};
pub use dtype::{DType, UnknownDType};
pub use error::{Entry, Error, KeyPlace, Malformed, Overflow, Payload, Resized, Result, Tampered};
pub use layout::{ALIGN, FOOTER_LEN, FORMAT_MAJOR, FORMAT_MINOR, HEADER_LEN};
pub use reader::{DecisionInfo, TensorInfo, Trace};
pub use shard::{Shard, ShardKind};
pub use view::Element;
pub use weights::{gguf_file, open_weights_file, weights_digest, weights_digest_of};
pub use writer::TraceWriter;

/// The `ndarray` this crate's views ([`Trace::view`]) are made of, for callers that name its types.
#[cfg(feature = "ndarray")]
pub use ndarray;
