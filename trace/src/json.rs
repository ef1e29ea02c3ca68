//! Reading the JSON files people hand to tracegate (policies, milestones.json, baselines.json,
//! prompt sets, model configs): one regular file, read once, at most [`MAX_JSON_LEN`] bytes, and
//! refused when an object repeats a key. serde_json keeps the last of two equal keys, so without
//! the check a second `"policy"` in a milestone would silently replace the first.
//!
//! The file is opened with `O_NONBLOCK` (opening a FIFO for reading would otherwise block until
//! something writes to it) and its type is taken from `fstat` of the opened descriptor, so what
//! is read is what was checked; the read stops one byte past the bound (`/dev/zero` and friends
//! never get that far: they are not regular files).

use std::fmt;
use std::io::Read;
use std::path::Path;

use serde::de::{DeserializeOwned, DeserializeSeed, Deserializer, MapAccess, SeqAccess, Visitor};
use serde::{Deserialize, Serialize, Serializer};
use serde_json::Value;

/// The most bytes a JSON input file may hold (64 MiB: the largest shipped one is a few KiB).
pub const MAX_JSON_LEN: u64 = 64 << 20;

/// What kind of file `meta` describes, for a refusal ("a FIFO, not a regular file").
pub fn file_kind(meta: &std::fs::Metadata) -> &'static str {
    use std::os::unix::fs::FileTypeExt;
    let t = meta.file_type();
    if t.is_dir() {
        "a directory"
    } else if t.is_fifo() {
        "a FIFO"
    } else if t.is_socket() {
        "a socket"
    } else if t.is_block_device() || t.is_char_device() {
        "a device"
    } else {
        "not a regular file"
    }
}

/// The bytes of `path`, which must be a regular file of at most `limit` bytes. `Err` names the
/// file and says why (its kind, or its size against the limit).
pub fn read_bytes(path: &Path, limit: u64) -> Result<Vec<u8>, String> {
    use std::os::unix::fs::OpenOptionsExt;
    let shown = path.display();
    let file = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK)
        .open(path)
        .map_err(|e| format!("{shown}: {e}"))?;
    let meta = file.metadata().map_err(|e| format!("{shown}: {e}"))?;
    if !meta.is_file() {
        return Err(format!(
            "{shown}: {}, not a regular file: a JSON input is one regular file",
            file_kind(&meta)
        ));
    }
    if meta.len() > limit {
        return Err(format!(
            "{shown}: {} bytes, more than the limit of {limit} for a JSON input",
            meta.len()
        ));
    }
    // The size can change after fstat (a file still being written): read at most one byte past
    // the limit, so a file that grew is refused instead of read without end.
    let mut bytes = Vec::with_capacity(meta.len() as usize);
    (&file)
        .take(limit + 1)
        .read_to_end(&mut bytes)
        .map_err(|e| format!("{shown}: {e}"))?;
    if bytes.len() as u64 > limit {
        return Err(format!(
            "{shown}: grew past the limit of {limit} bytes for a JSON input while being read"
        ));
    }
    Ok(bytes)
}

/// `path` parsed as a `T` (see [`parse`]), read by [`read_bytes`] with [`MAX_JSON_LEN`]. `Err`
/// starts with the file's path.
pub fn read<T: DeserializeOwned>(path: &Path) -> Result<T, String> {
    let bytes = read_bytes(path, MAX_JSON_LEN)?;
    parse(&bytes).map_err(|e| format!("{}: {e}", path.display()))
}

/// `bytes` parsed as a `T`, after a first pass that refuses any object repeating a key (named
/// with where it is: `duplicate key "policy" in milestones[0]`). The second pass is serde_json's
/// own, so its errors keep their line and column.
pub fn parse<T: DeserializeOwned>(bytes: &[u8]) -> Result<T, String> {
    check_unique_keys(bytes)?;
    serde_json::from_slice(bytes).map_err(|e| e.to_string())
}

/// `Err` names the first object key that appears twice in the same object, or says why `bytes`
/// is not JSON.
pub fn check_unique_keys(bytes: &[u8]) -> Result<(), String> {
    let mut de = serde_json::Deserializer::from_slice(bytes);
    let dup = Unique { at: &At::Root }
        .deserialize(&mut de)
        .map_err(|e| e.to_string())?;
    de.end().map_err(|e| e.to_string())?;
    match dup.duplicate {
        Some(d) => Err(d),
        None => Ok(()),
    }
}

/// A JSON value read with every object's keys checked: `duplicate` is the first repeated key
/// (with its place), else None. For a parser that must name the entry holding the value before
/// refusing it (the trace reader names the tensor), instead of failing inside the value.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct UniqueValue {
    pub value: Value,
    pub duplicate: Option<String>,
}

impl From<Value> for UniqueValue {
    fn from(value: Value) -> UniqueValue {
        UniqueValue {
            value,
            duplicate: None,
        }
    }
}

impl Serialize for UniqueValue {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        self.value.serialize(s)
    }
}

impl<'de> Deserialize<'de> for UniqueValue {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<UniqueValue, D::Error> {
        Unique { at: &At::Root }.deserialize(d)
    }
}

/// Where a value sits, built on the way down and printed only for a refusal.
enum At<'a> {
    Root,
    Key(&'a At<'a>, &'a str),
    Index(&'a At<'a>, usize),
}

impl fmt::Display for At<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            At::Root => Ok(()),
            At::Key(p, k) => {
                if !matches!(p, At::Root) {
                    write!(f, "{p}.")?;
                }
                f.write_str(k)
            }
            At::Index(p, i) => write!(f, "{p}[{i}]"),
        }
    }
}

struct Unique<'a> {
    at: &'a At<'a>,
}

impl<'de> DeserializeSeed<'de> for Unique<'_> {
    type Value = UniqueValue;
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<UniqueValue, D::Error> {
        d.deserialize_any(self)
    }
}

fn plain<E>(value: Value) -> Result<UniqueValue, E> {
    Ok(UniqueValue::from(value))
}

impl<'de> Visitor<'de> for Unique<'_> {
    type Value = UniqueValue;
    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a JSON value")
    }
    fn visit_bool<E>(self, v: bool) -> Result<UniqueValue, E> {
        plain(Value::Bool(v))
    }
    fn visit_i64<E>(self, v: i64) -> Result<UniqueValue, E> {
        plain(Value::from(v))
    }
    fn visit_u64<E>(self, v: u64) -> Result<UniqueValue, E> {
        plain(Value::from(v))
    }
    fn visit_f64<E>(self, v: f64) -> Result<UniqueValue, E> {
        plain(Value::from(v))
    }
    fn visit_str<E>(self, v: &str) -> Result<UniqueValue, E> {
        plain(Value::String(v.to_string()))
    }
    fn visit_string<E>(self, v: String) -> Result<UniqueValue, E> {
        plain(Value::String(v))
    }
    fn visit_unit<E>(self) -> Result<UniqueValue, E> {
        plain(Value::Null)
    }
    fn visit_none<E>(self) -> Result<UniqueValue, E> {
        plain(Value::Null)
    }
    fn visit_some<D: Deserializer<'de>>(self, d: D) -> Result<UniqueValue, D::Error> {
        self.deserialize(d)
    }
    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<UniqueValue, A::Error> {
        let mut out = Vec::new();
        let mut duplicate = None;
        while let Some(v) = seq.next_element_seed(Unique {
            at: &At::Index(self.at, out.len()),
        })? {
            duplicate = duplicate.or(v.duplicate);
            out.push(v.value);
        }
        Ok(UniqueValue {
            value: Value::Array(out),
            duplicate,
        })
    }
    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<UniqueValue, A::Error> {
        let mut out = serde_json::Map::new();
        let mut duplicate = None;
        while let Some(key) = map.next_key::<String>()? {
            let v = map.next_value_seed(Unique {
                at: &At::Key(self.at, &key),
            })?;
            if duplicate.is_none() && out.contains_key(&key) {
                duplicate = Some(match self.at {
                    At::Root => format!("duplicate key {key:?}"),
                    at => format!("duplicate key {key:?} in {at}"),
                });
            }
            duplicate = duplicate.or(v.duplicate);
            out.insert(key, v.value);
        }
        Ok(UniqueValue {
            value: Value::Object(out),
            duplicate,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn duplicates_are_named_with_their_place() {
        let e = check_unique_keys(br#"{"a": 1, "b": [{"x": 1}, {"y": 2, "y": 3}]}"#).unwrap_err();
        assert_eq!(e, r#"duplicate key "y" in b[1]"#);
        let e = check_unique_keys(br#"{"a": 1, "a": 1}"#).unwrap_err();
        assert_eq!(e, r#"duplicate key "a""#);
        // Equal keys in different objects are not duplicates.
        check_unique_keys(br#"{"a": {"a": 1}, "b": [{"a": 1}, {"a": 2}]}"#).unwrap();
        // Escapes are decoded before comparing: "\u0061" is "a".
        assert!(check_unique_keys(br#"{"a": 1, "\u0061": 2}"#).is_err());
    }
}
