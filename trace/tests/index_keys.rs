//! The index has exactly the keys docs/trace-format.md lists, each once: an attacker who repeats
//! an attribute or provenance key, or leaves out a required one, is refused by name. Each case
//! starts from a trace written by `TraceWriter` and edits the index text (serde_json's `Value`
//! cannot hold a repeated key), re-digesting the footer so the footer check passes.
use crate::common;

use common::*;
use tracegate_trace::{Error, KeyPlace, Malformed, Trace};

/// The raw index text of a finished trace and the bytes before it.
fn raw_index(file: &[u8]) -> (Vec<u8>, String) {
    let n = file.len();
    let offset = u64::from_le_bytes(file[n - 40..n - 32].try_into().unwrap()) as usize;
    (
        file[..offset].to_vec(),
        String::from_utf8(file[offset..n - 40].to_vec()).unwrap(),
    )
}

fn rebuilt(data: &[u8], index: &str) -> Vec<u8> {
    let index = index.as_bytes();
    let mut f = data.to_vec();
    f.extend_from_slice(index);
    f.extend_from_slice(&(data.len() as u64).to_le_bytes());
    f.extend_from_slice(&(index.len() as u64).to_le_bytes());
    f.extend_from_slice(&xxhash_rust::xxh3::xxh3_128(index).to_be_bytes());
    f.extend_from_slice(b"TGTREND\0");
    f
}

/// A sample trace whose index text has the first `from` (in capture order) replaced by `to`.
fn edited(from: &str, to: &str) -> Vec<u8> {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("s.trace");
    write_sample(&p, sample_provenance());
    let file = std::fs::read(&p).unwrap();
    let (data, index) = raw_index(&file);
    assert!(index.contains(from), "{from:?} in {index}");
    rebuilt(&data, &index.replacen(from, to, 1))
}

/// Opens and verifies `bytes`: Ok when the reader accepts the whole file.
fn open(bytes: &[u8]) -> Result<(), Error> {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("h.trace");
    std::fs::write(&p, bytes).unwrap();
    Trace::open(&p).and_then(|t| t.verify())
}

/// The repeated key's place, when `e` is that refusal.
fn duplicate_key(e: &Error) -> Option<&KeyPlace> {
    match e {
        Error::Malformed {
            kind: Malformed::DuplicateKey { place, .. },
            ..
        } => Some(place),
        _ => None,
    }
}

#[test]
fn the_unedited_and_a_same_length_rewrite_are_accepted() {
    // Controls: the text surgery alone changes nothing the reader checks.
    open(&edited("\"mask\":\"causal\"", "\"mask\":\"causal\"")).unwrap();
    open(&edited("\"threads\":1", "\"threads\":1")).unwrap();
}

#[test]
fn a_repeated_attribute_key_is_refused_naming_the_tensor_and_key() {
    // The first "mask" says bidirectional, the last (which serde_json alone keeps, and which
    // the content digest covers) says causal: a reader taking either silently is wrong.
    let e = open(&edited(
        "\"mask\":\"causal\"",
        "\"mask\":\"bidirectional\",\"mask\":\"causal\"",
    ))
    .unwrap_err();
    assert_eq!(
        duplicate_key(&e),
        Some(&KeyPlace::Attributes("embed.out".into())),
        "{e:?}"
    );
    let e = e.to_string();
    assert!(
        e.contains("tensor \"embed.out\": attributes: duplicate key \"mask\""),
        "{e}"
    );
}

#[test]
fn a_repeated_provenance_key_is_refused() {
    let e = open(&edited("\"threads\":1", "\"threads\":8,\"threads\":1")).unwrap_err();
    assert_eq!(duplicate_key(&e), Some(&KeyPlace::Provenance), "{e:?}");
    let e = e.to_string();
    assert!(e.contains("provenance: duplicate key \"threads\""), "{e}");
}

#[test]
fn a_repeated_key_inside_a_provenance_value_is_refused_with_its_place() {
    let e = open(&edited(
        "\"threads\":1",
        "\"threads\":1,\"host\":{\"cpu\":\"a\",\"cpu\":\"b\"}",
    ))
    .unwrap_err();
    assert_eq!(duplicate_key(&e), Some(&KeyPlace::Provenance), "{e:?}");
    let e = e.to_string();
    assert!(
        e.contains("provenance: duplicate key \"cpu\" in host"),
        "{e}"
    );
}

#[test]
fn a_missing_margins_offset_is_refused() {
    // layer.00.router.topk has no margins: the spec writes "margins_offset": null, never omits it.
    let e = open(&edited(",\"margins_offset\":null", "")).unwrap_err();
    assert!(
        matches!(
            e,
            Error::Malformed {
                kind: Malformed::BadIndex { .. },
                ..
            }
        ),
        "{e:?}"
    );
    let e = e.to_string();
    assert!(e.contains("missing field `margins_offset`"), "{e}");
    // Present and null stays accepted (the control above reads the same file unedited).
}
