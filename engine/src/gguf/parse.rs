//! The GGUF container (v2 and v3, little-endian): header, metadata key/values, tensor infos and
//! the data section's layout, every count, length and offset checked against the file before use.
//!
//! Layout (docs/numerics.md §21.1): `"GGUF"`, `u32 version`, `u64 tensor_count`, `u64 kv_count`,
//! then `kv_count` × (`string key`, `u32 value type`, value), then `tensor_count` × (`string
//! name`, `u32 n_dims`, `n_dims × u64 ne` (innermost first), `u32 ggml type`, `u64 offset`), then
//! zero padding to `general.alignment` (default 32): the data section, where each tensor's offset
//! (relative to it) is the padded sizes of the tensors before it. A string is `u64 length` and
//! that many UTF-8 bytes.

use crate::{err, Result};

use super::dequant::GgmlType;

/// "GGUF" read as a little-endian u32.
const MAGIC: [u8; 4] = *b"GGUF";
/// ggml's `GGML_MAX_DIMS`.
pub const MAX_DIMS: usize = 4;
/// Arrays of arrays deeper than this are refused (real files nest none; this bounds recursion).
const MAX_NESTING: usize = 8;
/// A key or tensor name as a refusal quotes it: escaped as Rust's `{:?}` does (`\n`,
/// `\u{1b}`, ...), so a name holding control bytes cannot break a refusal over two lines, move
/// the cursor or colour the terminal; an ordinary name is itself.
pub fn shown(name: &str) -> String {
    name.escape_debug().to_string()
}

/// Alignment when `general.alignment` is absent.
pub const DEFAULT_ALIGNMENT: u64 = 32;

/// A metadata value, as typed in the file.
#[derive(Clone, Debug, PartialEq)]
pub enum Value {
    U8(u8),
    I8(i8),
    U16(u16),
    I16(i16),
    U32(u32),
    I32(i32),
    F32(f32),
    Bool(bool),
    Str(String),
    U64(u64),
    I64(i64),
    F64(f64),
    Array(Array),
}

/// An array's items, kept by type (no per-item tag: a large array takes about the memory its
/// bytes in the file do); an array of arrays holds each inner array with its own item type.
#[derive(Clone, Debug, PartialEq)]
pub enum Array {
    U8(Vec<u8>),
    I8(Vec<i8>),
    U16(Vec<u16>),
    I16(Vec<i16>),
    U32(Vec<u32>),
    I32(Vec<i32>),
    F32(Vec<f32>),
    Bool(Vec<bool>),
    Str(Vec<String>),
    U64(Vec<u64>),
    I64(Vec<i64>),
    F64(Vec<f64>),
    Array(Vec<Array>),
}

impl Array {
    pub fn len(&self) -> usize {
        match self {
            Array::U8(v) => v.len(),
            Array::I8(v) => v.len(),
            Array::U16(v) => v.len(),
            Array::I16(v) => v.len(),
            Array::U32(v) => v.len(),
            Array::I32(v) => v.len(),
            Array::F32(v) => v.len(),
            Array::Bool(v) => v.len(),
            Array::Str(v) => v.len(),
            Array::U64(v) => v.len(),
            Array::I64(v) => v.len(),
            Array::F64(v) => v.len(),
            Array::Array(v) => v.len(),
        }
    }
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl Value {
    /// The GGUF type name (`UINT32`, `ARRAY`, ...), for messages.
    pub fn type_name(&self) -> &'static str {
        match self {
            Value::U8(_) => "UINT8",
            Value::I8(_) => "INT8",
            Value::U16(_) => "UINT16",
            Value::I16(_) => "INT16",
            Value::U32(_) => "UINT32",
            Value::I32(_) => "INT32",
            Value::F32(_) => "FLOAT32",
            Value::Bool(_) => "BOOL",
            Value::Str(_) => "STRING",
            Value::U64(_) => "UINT64",
            Value::I64(_) => "INT64",
            Value::F64(_) => "FLOAT64",
            Value::Array(_) => "ARRAY",
        }
    }

    pub fn as_str(&self) -> Option<&str> {
        match self {
            Value::Str(s) => Some(s),
            _ => None,
        }
    }

    /// An integer of any width, as i128 (every GGUF integer fits).
    pub fn as_int(&self) -> Option<i128> {
        Some(match *self {
            Value::U8(v) => v.into(),
            Value::I8(v) => v.into(),
            Value::U16(v) => v.into(),
            Value::I16(v) => v.into(),
            Value::U32(v) => v.into(),
            Value::I32(v) => v.into(),
            Value::U64(v) => v.into(),
            Value::I64(v) => v.into(),
            _ => return None,
        })
    }
}

/// Minimum encoded size of one value of type `t` (bounds an array's count by the bytes left).
fn min_value_size(t: u32) -> Option<u64> {
    Some(match t {
        0 | 1 | 7 => 1,
        2 | 3 => 2,
        4..=6 => 4,
        8 => 8,
        9 => 12,
        10..=12 => 8,
        _ => return None,
    })
}

/// One tensor info, its data range resolved and checked.
#[derive(Clone, Debug)]
pub struct TensorInfo {
    pub name: String,
    /// `ne`, innermost (fastest-varying) first, as in the file.
    pub dims: Vec<u64>,
    pub ggml_type: GgmlType,
    /// Absolute byte range in the file.
    pub start: usize,
    pub end: usize,
}

impl TensorInfo {
    /// The row-major (numpy / Hugging Face) shape: `dims` reversed.
    pub fn shape(&self) -> Vec<usize> {
        self.dims.iter().rev().map(|&d| d as usize).collect()
    }
}

/// A parsed GGUF header.
#[derive(Clone, Debug)]
pub struct Header {
    pub version: u32,
    /// In file order; keys are unique.
    pub metadata: Vec<(String, Value)>,
    /// In file order (which is also data order); names are unique.
    pub tensors: Vec<TensorInfo>,
    pub alignment: u64,
    /// Absolute offset of the data section.
    pub data_start: usize,
}

impl Header {
    pub fn get(&self, key: &str) -> Option<&Value> {
        self.metadata.iter().find(|(k, _)| k == key).map(|(_, v)| v)
    }
}

/// Reads little-endian fields from `bytes`, naming the file and what was being read on failure.
struct Cursor<'a> {
    bytes: &'a [u8],
    pos: usize,
    file: &'a str,
}

impl<'a> Cursor<'a> {
    fn left(&self) -> u64 {
        (self.bytes.len() - self.pos) as u64
    }

    fn take(&mut self, n: u64, what: &dyn Fn() -> String) -> Result<&'a [u8]> {
        if n > self.left() {
            return Err(err!(Checkpoint:
                "{}: truncated: {} needs {n} bytes at offset {}, the file has {} left",
                self.file,
                what(),
                self.pos,
                self.left()
            ));
        }
        let s = &self.bytes[self.pos..self.pos + n as usize];
        self.pos += n as usize;
        Ok(s)
    }

    fn array<const N: usize>(&mut self, what: &dyn Fn() -> String) -> Result<[u8; N]> {
        Ok(self.take(N as u64, what)?.try_into().expect("N bytes"))
    }
    fn u32(&mut self, what: &dyn Fn() -> String) -> Result<u32> {
        Ok(u32::from_le_bytes(self.array(what)?))
    }
    fn u64(&mut self, what: &dyn Fn() -> String) -> Result<u64> {
        Ok(u64::from_le_bytes(self.array(what)?))
    }

    fn string(&mut self, what: &dyn Fn() -> String) -> Result<String> {
        let n = self.u64(&|| format!("the length of {}", what()))?;
        let b = self.take(n, what)?;
        String::from_utf8(b.to_vec())
            .map_err(|e| err!(Checkpoint: "{}: {} is not UTF-8: {e}", self.file, what()))
    }

    fn bool(&mut self, key: &str) -> Result<bool> {
        match self.array::<1>(&|| format!("metadata {key}"))?[0] {
            0 => Ok(false),
            1 => Ok(true),
            b => Err(err!(Checkpoint:
                "{}: metadata {key}: BOOL byte {b} at offset {} (must be 0 or 1)",
                self.file,
                self.pos - 1
            )),
        }
    }

    /// A value of type `t`; `key` names the metadata entry for messages.
    fn value(&mut self, t: u32, key: &str) -> Result<Value> {
        let what = || format!("metadata {key}");
        Ok(match t {
            0 => Value::U8(self.array::<1>(&what)?[0]),
            1 => Value::I8(self.array::<1>(&what)?[0] as i8),
            2 => Value::U16(u16::from_le_bytes(self.array(&what)?)),
            3 => Value::I16(i16::from_le_bytes(self.array(&what)?)),
            4 => Value::U32(u32::from_le_bytes(self.array(&what)?)),
            5 => Value::I32(i32::from_le_bytes(self.array(&what)?)),
            6 => Value::F32(f32::from_le_bytes(self.array(&what)?)),
            7 => Value::Bool(self.bool(key)?),
            8 => Value::Str(self.string(&what)?),
            9 => Value::Array(self.items(key, 0)?),
            10 => Value::U64(u64::from_le_bytes(self.array(&what)?)),
            11 => Value::I64(i64::from_le_bytes(self.array(&what)?)),
            12 => Value::F64(f64::from_le_bytes(self.array(&what)?)),
            _ => {
                return Err(err!(Checkpoint:
                    "{}: metadata {key}: unknown value type {t} (GGUF value types are 0..=12)",
                    self.file
                ))
            }
        })
    }

    /// An array value (item type, count, items); `depth` counts the arrays it is inside.
    fn items(&mut self, key: &str, depth: usize) -> Result<Array> {
        if depth >= MAX_NESTING {
            return Err(err!(Checkpoint:
                "{}: metadata {key}: arrays nested deeper than {MAX_NESTING}",
                self.file
            ));
        }
        let item = self.u32(&|| format!("the item type of metadata {key}"))?;
        let min = min_value_size(item).ok_or_else(|| {
            err!(Checkpoint:
                "{}: metadata {key}: unknown array item type {item} (GGUF value types are 0..=12)",
                self.file
            )
        })?;
        let n = self.u64(&|| format!("the length of metadata {key}"))?;
        // Each item takes at least `min` bytes: a count the rest of the file cannot hold is
        // refused before anything is reserved.
        if n > self.left() / min {
            return Err(err!(Checkpoint:
                "{}: metadata {key}: array of {n} items of type {item} cannot fit in the {} bytes left",
                self.file,
                self.left()
            ));
        }
        let what = || format!("metadata {key}");
        // Fixed-size items: all their bytes at once, then decoded.
        macro_rules! fixed {
            ($variant:ident, $t:ty) => {{
                let b = self.take(n * min, &what)?;
                Array::$variant(
                    b.chunks_exact(min as usize)
                        .map(|c| <$t>::from_le_bytes(c.try_into().expect("item size")))
                        .collect(),
                )
            }};
        }
        Ok(match item {
            0 => fixed!(U8, u8),
            1 => fixed!(I8, i8),
            2 => fixed!(U16, u16),
            3 => fixed!(I16, i16),
            4 => fixed!(U32, u32),
            5 => fixed!(I32, i32),
            6 => fixed!(F32, f32),
            7 => Array::Bool((0..n).map(|_| self.bool(key)).collect::<Result<_>>()?),
            8 => Array::Str((0..n).map(|_| self.string(&what)).collect::<Result<_>>()?),
            9 => Array::Array(
                (0..n)
                    .map(|_| self.items(key, depth + 1))
                    .collect::<Result<_>>()?,
            ),
            10 => fixed!(U64, u64),
            11 => fixed!(I64, i64),
            _ => fixed!(F64, f64),
        })
    }
}

/// Parse and check a GGUF file's header against its length (`file` names it in messages).
/// Refuses: a wrong magic, a version other than 2 or 3 (and big-endian files), counts the file
/// cannot hold, truncated or non-UTF-8 strings, unknown value or tensor types, duplicate keys or
/// tensor names, a `general.alignment` that is not a UINT32 power of two, more than 4 dims, an
/// element count that overflows or a row (`ne0`) that is not whole blocks, an offset that is not
/// where the tensors before it end (padded to the alignment, as ggml requires), tensor data past
/// the end of the file, and bytes after the data section.
pub fn parse(bytes: &[u8], file: &str) -> Result<Header> {
    let mut c = Cursor {
        bytes,
        pos: 0,
        file,
    };
    let magic: [u8; 4] = c.array(&|| "the magic".to_string())?;
    if magic != MAGIC {
        return Err(err!(Checkpoint:
            "{file}: not a GGUF file (it starts with b\"{}\", not b\"GGUF\")",
            magic.escape_ascii()
        ));
    }
    let version = c.u32(&|| "the version".to_string())?;
    if version & 0xffff == 0 && version != 0 {
        return Err(err!(Checkpoint:
            "{file}: big-endian GGUF (version field {version:#010x}) not supported"
        ));
    }
    if !(2..=3).contains(&version) {
        return Err(err!(Checkpoint:
            "{file}: GGUF version {version} not supported (2 or 3)"
        ));
    }
    let tensor_count = c.u64(&|| "the tensor count".to_string())?;
    let kv_count = c.u64(&|| "the metadata count".to_string())?;
    // Smallest encodings: a key/value is a key length, a type and a one-byte value (13 bytes); a
    // tensor info a name length, n_dims, type and offset (24 bytes).
    let left = c.left();
    if kv_count
        .saturating_mul(13)
        .saturating_add(tensor_count.saturating_mul(24))
        > left
    {
        return Err(err!(Checkpoint:
            "{file}: {kv_count} metadata entries and {tensor_count} tensors cannot fit in the {left} bytes after the header"
        ));
    }

    let mut metadata: Vec<(String, Value)> = Vec::with_capacity(kv_count as usize);
    let mut keys = std::collections::HashSet::new();
    for i in 0..kv_count {
        let key = c.string(&|| format!("metadata key #{i}"))?;
        let ks = shown(&key);
        let t = c.u32(&|| format!("the type of metadata {ks}"))?;
        let v = c.value(t, &ks)?;
        if !keys.insert(key.clone()) {
            return Err(err!(Checkpoint: "{file}: metadata key {ks} appears twice"));
        }
        metadata.push((key, v));
    }
    let alignment = match metadata.iter().find(|(k, _)| k == "general.alignment") {
        None => DEFAULT_ALIGNMENT,
        Some((_, Value::U32(a))) if a.is_power_of_two() => *a as u64,
        Some((_, v)) => {
            return Err(err!(Checkpoint:
                "{file}: general.alignment = {} {v:?} must be a UINT32 power of two",
                v.type_name()
            ))
        }
    };

    // (name, dims, type, offset relative to the data section)
    let mut infos = Vec::with_capacity(tensor_count as usize);
    let mut names = std::collections::HashSet::new();
    for i in 0..tensor_count {
        let raw_name = c.string(&|| format!("tensor name #{i}"))?;
        let name = shown(&raw_name);
        let n_dims = c.u32(&|| format!("the dimension count of tensor {name}"))?;
        if n_dims as usize > MAX_DIMS {
            return Err(err!(Checkpoint:
                "{file}: tensor {name}: {n_dims} dimensions (at most {MAX_DIMS})"
            ));
        }
        let mut dims = Vec::with_capacity(n_dims as usize);
        for d in 0..n_dims {
            dims.push(c.u64(&|| format!("dimension {d} of tensor {name}"))?);
        }
        let type_id = c.u32(&|| format!("the type of tensor {name}"))?;
        let offset = c.u64(&|| format!("the offset of tensor {name}"))?;
        let ggml_type = GgmlType::from_id(type_id).ok_or_else(
            || err!(Checkpoint: "{file}: tensor {name}: unknown ggml type id {type_id}"),
        )?;
        if !names.insert(raw_name.clone()) {
            return Err(err!(Checkpoint: "{file}: tensor {name} appears twice"));
        }
        infos.push((raw_name, dims, ggml_type, offset));
    }

    let header_end = c.pos as u64;
    let data_start = header_end.next_multiple_of(alignment);
    let file_len = bytes.len() as u64;
    let mut tensors = Vec::with_capacity(infos.len());
    // Where the next tensor must start, relative to the data section.
    let mut next = 0u64;
    for (raw_name, dims, ggml_type, offset) in infos {
        let name = shown(&raw_name);
        let elements = dims
            .iter()
            .try_fold(1u64, |acc, &d| acc.checked_mul(d))
            .filter(|&n| n <= i64::MAX as u64)
            .ok_or_else(|| err!(Checkpoint: "{file}: tensor {name}: dims {dims:?} overflow"))?;
        let (block, type_size) = (ggml_type.block_size(), ggml_type.type_size());
        let ne0 = dims.first().copied().unwrap_or(1);
        if ne0 % block != 0 {
            return Err(err!(Checkpoint:
                "{file}: tensor {name}: ne0 = {ne0} is not a multiple of {}'s block of {block}",
                ggml_type.name()
            ));
        }
        let nbytes = (elements / block)
            .checked_mul(type_size)
            .ok_or_else(|| err!(Checkpoint: "{file}: tensor {name}: dims {dims:?} overflow"))?;
        if offset != next {
            return Err(err!(Checkpoint:
                "{file}: tensor {name}: offset {offset}, expected {next} (the tensors before it end there, padded to {alignment})"
            ));
        }
        let start = data_start.saturating_add(offset);
        let end = start.saturating_add(nbytes);
        if end > file_len {
            return Err(err!(Checkpoint:
                "{file}: tensor {name}: {nbytes} bytes at offset {offset} (data section at {data_start}) run past the end of the file ({file_len} bytes)"
            ));
        }
        next = offset
            .checked_add(nbytes)
            .and_then(|e| e.checked_next_multiple_of(alignment))
            .ok_or_else(|| err!(Checkpoint: "{file}: tensor {name}: offset {offset} + {nbytes} bytes overflows"))?;
        tensors.push(TensorInfo {
            name: raw_name,
            dims,
            ggml_type,
            start: start as usize,
            end: end as usize,
        });
    }
    // The last tensor's padding may be cut off; anything past it belongs to no tensor.
    let data_end = data_start.saturating_add(next);
    if file_len > data_end.max(header_end) {
        return Err(err!(Checkpoint:
            "{file}: {} bytes after the data section (which ends at {data_end}) belong to no tensor",
            file_len - data_end.max(header_end)
        ));
    }
    Ok(Header {
        version,
        metadata,
        tensors,
        alignment,
        data_start: data_start as usize,
    })
}
