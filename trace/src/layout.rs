//! Byte layout constants and the index schema (see docs/trace-format.md).

use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::json::UniqueValue;

pub const MAGIC: &[u8; 8] = b"TGTRACE\0";
pub const FOOTER_MAGIC: &[u8; 8] = b"TGTREND\0";
pub const FORMAT_MAJOR: u16 = 1;
pub const FORMAT_MINOR: u16 = 0;
/// Header: magic, major u16, minor u16, zero padding to 64 bytes.
pub const HEADER_LEN: u64 = 64;
/// Footer: index offset u64, index length u64, xxh3-128 of the index (big-endian), magic.
pub const FOOTER_LEN: u64 = 40;
/// Every tensor and decision payload starts at a multiple of this.
pub const ALIGN: u64 = 64;
/// An index larger than this is refused before it is parsed.
pub const MAX_INDEX_LEN: u64 = 1 << 30;
pub const MAX_RANK: usize = 32;
pub const MAX_NAME_LEN: usize = 4096;

pub fn header_bytes() -> [u8; HEADER_LEN as usize] {
    let mut h = [0u8; HEADER_LEN as usize];
    h[..8].copy_from_slice(MAGIC);
    h[8..10].copy_from_slice(&FORMAT_MAJOR.to_le_bytes());
    h[10..12].copy_from_slice(&FORMAT_MINOR.to_le_bytes());
    h
}

pub fn footer_bytes(
    index_offset: u64,
    index_len: u64,
    index_hash: u128,
) -> [u8; FOOTER_LEN as usize] {
    let mut f = [0u8; FOOTER_LEN as usize];
    f[0..8].copy_from_slice(&index_offset.to_le_bytes());
    f[8..16].copy_from_slice(&index_len.to_le_bytes());
    f[16..32].copy_from_slice(&index_hash.to_be_bytes());
    f[32..40].copy_from_slice(FOOTER_MAGIC);
    f
}

pub fn align_up(x: u64) -> Option<u64> {
    x.checked_add(ALIGN - 1).map(|v| v / ALIGN * ALIGN)
}

#[derive(Serialize, Deserialize)]
pub struct IndexJson {
    pub format: String,
    pub version: [u16; 2],
    pub digest: String,
    pub tensors: Vec<TensorJson>,
    pub decisions: Vec<DecisionJson>,
    pub provenance: Value,
}

#[derive(Serialize, Deserialize)]
pub struct TensorJson {
    pub name: String,
    pub dtype: String,
    pub shape: Vec<u64>,
    pub offset: u64,
    pub nbytes: u64,
    pub xxh3: String,
    /// Read with its keys checked: the spec gives each attribute key once, and serde_json alone
    /// would keep the last of two `"mask"` keys.
    pub attributes: UniqueValue,
}

#[derive(Serialize, Deserialize)]
pub struct DecisionJson {
    pub name: String,
    pub shape: Vec<u64>,
    pub values_offset: u64,
    /// Required, `null` when there are no margins: `deserialize_with` makes serde refuse a
    /// missing key instead of reading it as `None` (the spec lists the key in every entry).
    #[serde(deserialize_with = "Option::deserialize")]
    pub margins_offset: Option<u64>,
    pub xxh3: String,
}

pub const FORMAT_NAME: &str = "tracegate.trace";

/// The suffix of a writer's temporary file; readers refuse such a path (an unfinished trace).
pub const TMP_SUFFIX: &str = ".tracegate-tmp";

/// The spec's rule for tensor and decision names, shared by the writer and the reader; `Err`
/// is the reason without the file name. A long name is shown by its length only.
pub fn check_name(kind: &str, name: &str) -> Result<(), String> {
    if name.is_empty() {
        return Err(format!("{kind} with an empty name"));
    }
    if name.len() > MAX_NAME_LEN {
        let head: String = name.chars().take(32).flat_map(char::escape_debug).collect();
        return Err(format!(
            "{kind} name \"{head}...\" is {} bytes long (limit {MAX_NAME_LEN})",
            name.len()
        ));
    }
    if name.chars().any(char::is_control) {
        return Err(format!("{kind} name {name:?} contains a control character"));
    }
    Ok(())
}

/// Canonical hex as the spec writes it: lowercase digits only.
pub fn is_lower_hex(s: &str) -> bool {
    s.bytes()
        .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
}
