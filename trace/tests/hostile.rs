//! Hostile input: every malformed file is an error with a reason, never a panic, never an
//! allocation sized by an unchecked number.
use crate::common;

use common::*;
use proptest::prelude::*;
use serde_json::json;
use tracegate_trace::{Error, Malformed, Tampered, Trace};
use xxhash_rust::xxh3::xxh3_128;

/// Builds a file around an arbitrary index: header, `data` (placed at 64), index, footer with a
/// correct index hash, so the reader's index validation is what gets exercised.
fn craft(index: &[u8], data_len: usize) -> Vec<u8> {
    let mut f = vec![0u8; 64];
    f[..8].copy_from_slice(b"TGTRACE\0");
    f[8] = 1;
    f.extend(std::iter::repeat_n(0u8, data_len));
    let index_offset = f.len() as u64;
    f.extend_from_slice(index);
    f.extend_from_slice(&index_offset.to_le_bytes());
    f.extend_from_slice(&(index.len() as u64).to_le_bytes());
    f.extend_from_slice(&xxh3_128(index).to_be_bytes());
    f.extend_from_slice(b"TGTREND\0");
    f
}

fn index_with(tensors: serde_json::Value) -> Vec<u8> {
    serde_json::to_vec(&json!({
        "format": "tracegate.trace", "version": [1, 0], "digest": "00".repeat(32),
        "tensors": tensors, "decisions": [], "provenance": {}
    }))
    .unwrap()
}

fn tensor(name: &str, shape: serde_json::Value, offset: u64, nbytes: u64) -> serde_json::Value {
    json!({"name": name, "dtype": "f32", "shape": shape, "offset": offset, "nbytes": nbytes,
           "xxh3": "00".repeat(16), "attributes": {}})
}

/// What the path was, when `e` refuses it as not a regular file.
fn not_regular(e: &Error) -> Option<&'static str> {
    match e {
        Error::Malformed {
            kind: Malformed::NotRegularFile { what },
            ..
        } => Some(what),
        _ => None,
    }
}

fn open_bytes(bytes: &[u8]) -> Result<Trace, Error> {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("h.trace");
    std::fs::write(&p, bytes).unwrap();
    Trace::open(&p).and_then(|t| t.verify().map(|_| t))
}

/// Opens and verifies `bytes`: refused as `$class::$kind` (`Malformed::BadMagic`), with `needle`
/// in the message.
macro_rules! refused {
    ($bytes:expr, $class:ident :: $kind:ident, $needle:expr $(,)?) => {{
        let e = open_bytes($bytes).expect_err("hostile file was accepted");
        assert!(
            matches!(
                &e,
                Error::$class {
                    kind: $class::$kind { .. },
                    ..
                }
            ),
            "expected {} but got {e:?}",
            stringify!($class::$kind)
        );
        let (text, needle) = (e.to_string(), $needle);
        assert!(text.contains(needle), "expected {needle:?} in: {text}");
    }};
}

#[test]
fn crafted_index_is_accepted_when_consistent() {
    // Control: the crafting helper itself produces files the reader accepts (digest aside).
    let f = craft(&index_with(json!([tensor("a", json!([2]), 64, 8)])), 64);
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("ok.trace");
    std::fs::write(&p, f).unwrap();
    let t = Trace::open(&p).unwrap();
    assert_eq!(t.tensors().len(), 1);
    // verify() catches the fake per-tensor digest.
    let e = t.verify().unwrap_err();
    assert!(
        matches!(&e, Error::Tampered { kind: Tampered::TensorDigestMismatch { tensor, .. }, .. } if tensor == "a"),
        "{e:?}"
    );
}

/// The same index with one field a 1.0 reader does not know, in a file claiming minor `minor`.
fn with_unknown_field(minor: u8) -> Vec<u8> {
    let mut index: serde_json::Value =
        serde_json::from_slice(&index_with(json!([tensor("a", json!([2]), 64, 8)]))).unwrap();
    index["version"] = json!([1, minor]);
    index["tensors"][0]["added_in_a_later_minor"] = json!("optional");
    let mut f = craft(&serde_json::to_vec(&index).unwrap(), 64);
    f[10] = minor;
    f
}

#[test]
fn an_unknown_field_is_refused_in_a_known_minor_and_ignored_in_a_later_one() {
    refused!(
        &with_unknown_field(0),
        Malformed::UnknownField,
        "unknown field \"added_in_a_later_minor\" in tensors[0]",
    );
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("later.trace");
    std::fs::write(&p, with_unknown_field(1)).unwrap();
    let t = Trace::open(&p).expect("a later minor version only adds what may be ignored");
    assert_eq!((t.version(), t.tensors().len()), ((1, 1), 1));
}

#[test]
fn unknown_and_duplicate_top_level_keys() {
    let f = sample_bytes();
    refused!(
        &edit_index(&f, |i| i["added_later"] = json!(1)),
        Malformed::UnknownField,
        "unknown field \"added_later\" (format 1.0 has no such field)",
    );
    refused!(
        &edit_index(&f, |i| i["decisions"][0]["extra"] = json!(1)),
        Malformed::UnknownField,
        "unknown field \"extra\" in decisions[0]",
    );
    // A later minor version may add a top-level key; this reader ignores it.
    let mut later = edit_index(&f, |i| {
        i["added_later"] = json!({"x": [1, 2]});
        i["version"] = json!([1, 1]);
    });
    later[10] = 1;
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("later.trace");
    std::fs::write(&p, &later).unwrap();
    Trace::open(&p)
        .expect("a later minor's optional key is ignored")
        .verify()
        .unwrap();
    // A key given twice would let a second list of entries replace or join the first.
    let (data, index) = split_index(&f);
    let text = serde_json::to_string(&index).unwrap();
    let twice = text.replacen("\"decisions\":", "\"decisions\":[],\"decisions\":", 1);
    let mut g = data.clone();
    g.extend_from_slice(twice.as_bytes());
    g.extend_from_slice(&(data.len() as u64).to_le_bytes());
    g.extend_from_slice(&(twice.len() as u64).to_le_bytes());
    g.extend_from_slice(&xxh3_128(twice.as_bytes()).to_be_bytes());
    g.extend_from_slice(b"TGTREND\0");
    refused!(&g, Malformed::BadIndex, "duplicate field `decisions`");
}

#[test]
fn an_index_not_aligned_to_64_is_refused() {
    let f = sample_bytes();
    let (mut data, index) = split_index(&f);
    data.push(0);
    refused!(
        &with_index(&data, &index),
        Malformed::IndexMisaligned,
        "which is not 64-byte aligned"
    );
}

#[test]
fn bad_magic() {
    let mut f = craft(&index_with(json!([])), 0);
    f[0] = b'X';
    refused!(&f, Malformed::BadMagic, "bad magic");
}

#[test]
fn empty_and_tiny_files() {
    refused!(&[], Malformed::TooShort, "shorter than header + footer");
    refused!(
        &[0u8; 103],
        Malformed::TooShort,
        "shorter than header + footer"
    );
    let dir = tempfile::tempdir().unwrap();
    let e = Trace::open(dir.path()).expect_err("a directory is not a trace");
    assert_eq!(not_regular(&e), Some("a directory"), "{e:?}");
    assert!(e.to_string().contains("not a regular file"), "{e}");
}

#[test]
fn truncation_at_every_byte_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("t.trace");
    write_sample(&p, sample_provenance());
    let full = std::fs::read(&p).unwrap();
    for cut in 0..full.len() {
        assert!(
            open_bytes(&full[..cut]).is_err(),
            "truncated at {cut} of {} bytes was accepted",
            full.len()
        );
    }
    assert!(open_bytes(&full).is_ok());
}

#[test]
fn index_out_of_range() {
    refused!(
        &craft(&index_with(json!([tensor("a", json!([64]), 64, 256)])), 64),
        Malformed::OutsideData,
        "outside the data region",
    );
    refused!(
        &craft(&index_with(json!([tensor("a", json!([1]), 0, 4)])), 64),
        Malformed::OutsideData,
        "outside the data region",
    );
}

#[test]
fn unaligned_offset() {
    refused!(
        &craft(&index_with(json!([tensor("a", json!([1]), 68, 4)])), 128),
        Malformed::Misaligned,
        "not 64-byte aligned",
    );
}

#[test]
fn overlapping_ranges() {
    let t = json!([
        tensor("a", json!([32]), 64, 128),
        tensor("b", json!([4]), 128, 16)
    ]);
    refused!(&craft(&index_with(t), 192), Malformed::Overlap, "overlaps");
}

#[test]
fn shape_times_size_overflow() {
    let huge = json!([u64::MAX / 2, 4]);
    refused!(
        &craft(&index_with(json!([tensor("a", huge, 64, 0)])), 0),
        Malformed::ShapeOverflow,
        "overflows",
    );
    refused!(
        &craft(
            &index_with(json!([tensor("a", json!([u64::MAX / 2]), 64, 0)])),
            0,
        ),
        Malformed::ShapeOverflow,
        "overflows",
    );
}

#[test]
fn offset_plus_length_overflow() {
    refused!(
        &craft(
            &index_with(json!([tensor("a", json!([32]), u64::MAX - 63, 128)])),
            0,
        ),
        Malformed::RangeOverflow,
        "overflows",
    );
}

#[test]
fn nbytes_disagreeing_with_shape() {
    refused!(
        &craft(&index_with(json!([tensor("a", json!([3]), 64, 16)])), 64),
        Malformed::NbytesMismatch,
        "needs 12",
    );
}

#[test]
fn absurd_rank_and_counts() {
    let rank = json!(vec![1u64; 1000]);
    refused!(
        &craft(&index_with(json!([tensor("a", rank, 64, 4)])), 64),
        Malformed::RankTooHigh,
        "rank 1000",
    );
    // A footer that declares a 2^62-byte index is refused before anything is read or allocated.
    let mut f = craft(&index_with(json!([])), 0);
    let n = f.len();
    f[n - 32..n - 24].copy_from_slice(&(1u64 << 62).to_le_bytes());
    refused!(&f, Malformed::IndexTooLong, "exceeds the limit");
}

#[test]
fn footer_pointing_into_itself_or_the_header() {
    let mut f = craft(&index_with(json!([])), 0);
    let n = f.len();
    // Index offset inside the footer.
    f[n - 40..n - 32].copy_from_slice(&((n - 30) as u64).to_le_bytes());
    refused!(&f, Malformed::IndexMisplaced, "must end at the footer");
    let mut g = craft(&index_with(json!([])), 0);
    g[n - 40..n - 32].copy_from_slice(&0u64.to_le_bytes());
    refused!(&g, Malformed::IndexMisplaced, "must end at the footer");
}

#[test]
fn non_utf8_name() {
    let mut index = index_with(json!([tensor("ab", json!([1]), 64, 4)]));
    let at = index.windows(4).position(|w| w == b"\"ab\"").unwrap() + 1;
    index[at] = 0xff;
    refused!(
        &craft(&index, 64),
        Malformed::BadIndex,
        "index is not valid"
    );
}

#[test]
fn unknown_fields_and_dtypes() {
    let mut t = tensor("a", json!([1]), 64, 4);
    t["dtype"] = json!("f128");
    refused!(
        &craft(&index_with(json!([t])), 64),
        Malformed::BadDtype,
        "unknown dtype"
    );
    let mut t = tensor("a", json!([1]), 64, 4);
    t["surprise"] = json!(1);
    refused!(
        &craft(&index_with(json!([t])), 64),
        Malformed::UnknownField,
        "unknown field \"surprise\" in tensors[0]"
    );
}

#[test]
fn duplicate_names_in_index() {
    let t = json!([
        tensor("a", json!([1]), 64, 4),
        tensor("a", json!([1]), 128, 4)
    ]);
    refused!(
        &craft(&index_with(t), 128),
        Malformed::DuplicateName,
        "duplicate tensor name"
    );
}

fn sample_bytes() -> Vec<u8> {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("s.trace");
    write_sample(&p, sample_provenance());
    std::fs::read(&p).unwrap()
}

#[test]
fn header_bytes_12_to_64_must_be_zero() {
    let mut f = sample_bytes();
    f[40] = 1;
    refused!(
        &f,
        Malformed::NonZeroHeader,
        "header byte 40 is 0x01: header bytes 12..64 must be zero",
    );
}

#[test]
fn header_minor_version_must_equal_the_index_version() {
    let mut f = sample_bytes();
    f[10] = 1;
    refused!(
        &f,
        Malformed::VersionDisagrees,
        "index version 1.0 disagrees with header 1.1"
    );
    let g = edit_index(&sample_bytes(), |i| i["version"] = json!([1, 1]));
    refused!(
        &g,
        Malformed::VersionDisagrees,
        "index version 1.1 disagrees with header 1.0"
    );
}

#[test]
fn padding_between_payloads_must_be_zero() {
    // embed.out is 48 bytes at 64, so 112..128 is padding before the next payload.
    let mut f = sample_bytes();
    f[115] = 0x5a;
    refused!(
        &f,
        Tampered::NonZeroPadding,
        "padding byte 115 (in the gap 112..128 between payloads) is 0x5a, not zero",
    );
    // The gap between the last payload and the index is padding too.
    let mut g = sample_bytes();
    let (data, _) = split_index(&g);
    let last = data.len() - 1;
    g[last] = 1;
    refused!(
        &g,
        Tampered::NonZeroPadding,
        &format!("padding byte {last}")
    );
}

#[test]
fn digests_must_be_canonical_lower_case_hex() {
    let f = sample_bytes();
    let upper = edit_index(&f, |i| {
        i["digest"] = json!(i["digest"].as_str().unwrap().to_uppercase())
    });
    refused!(
        &upper,
        Malformed::BadDigest,
        "is not 64 lowercase hex digits"
    );
    let upper = edit_index(&f, |i| {
        i["tensors"][1]["xxh3"] = json!(i["tensors"][1]["xxh3"].as_str().unwrap().to_uppercase())
    });
    refused!(&upper, Malformed::BadXxh3, "tensor \"ids\": xxh3");
    let upper = edit_index(&f, |i| {
        i["decisions"][0]["xxh3"] =
            json!(i["decisions"][0]["xxh3"].as_str().unwrap().to_uppercase())
    });
    refused!(
        &upper,
        Malformed::BadXxh3,
        "decision \"logits.argmax\": xxh3"
    );
}

#[test]
fn the_reader_enforces_the_name_and_attribute_limits() {
    let f = sample_bytes();
    refused!(
        &edit_index(&f, |i| i["tensors"][0]["name"] = json!("a".repeat(4097))),
        Malformed::BadName,
        "is 4097 bytes long (limit 4096)",
    );
    refused!(
        &edit_index(&f, |i| i["tensors"][0]["name"] = json!("a\u{7}b")),
        Malformed::BadName,
        "contains a control character",
    );
    refused!(
        &edit_index(&f, |i| i["decisions"][0]["name"] = json!("d\nx")),
        Malformed::BadName,
        "decision name \"d\\nx\" contains a control character",
    );
    refused!(
        &edit_index(&f, |i| i["decisions"][1]["name"] = json!("b".repeat(5000))),
        Malformed::BadName,
        "decision name",
    );
    refused!(
        &edit_index(&f, |i| i["tensors"][0]["attributes"][""] = json!("x")),
        Malformed::BadAttributes,
        "tensor \"embed.out\": an attribute has an empty name",
    );
    // The limit itself is allowed (verify then fails only on the content digest).
    let at_limit = edit_index(&f, |i| i["tensors"][0]["name"] = json!("a".repeat(4096)));
    refused!(
        &at_limit,
        Tampered::ContentDigestMismatch,
        "content digest is"
    );
}

#[test]
fn bool_bytes_other_than_0_or_1_are_refused_even_with_matching_digests() {
    let f = sample_bytes();
    let (mut data, mut index) = split_index(&f);
    let offset = index["tensors"][2]["offset"].as_u64().unwrap() as usize;
    assert_eq!(index["tensors"][2]["dtype"], "bool");
    data[offset + 1] = 2;
    index["tensors"][2]["xxh3"] = json!(tracegate_trace::xxh3_hex(xxh3_128(
        &data[offset..offset + 2]
    )));
    refused!(
        &with_index(&data, &index),
        Malformed::BadBool,
        "tensor \"flags\": bool element 1 is 2 (must be 0 or 1)",
    );
}

/// Opens `path` on another thread; `None` if it did not answer within 10 s.
fn open_within_timeout(path: &std::path::Path) -> Option<Result<Trace, Error>> {
    let (tx, rx) = std::sync::mpsc::channel();
    let p = path.to_path_buf();
    std::thread::spawn(move || {
        let _ = tx.send(Trace::open(&p));
    });
    rx.recv_timeout(std::time::Duration::from_secs(10)).ok()
}

#[test]
fn a_fifo_is_refused_without_blocking() {
    let dir = tempfile::tempdir().unwrap();
    let fifo = dir.path().join("pipe.trace");
    let made = std::process::Command::new("mkfifo")
        .arg(&fifo)
        .status()
        .expect("mkfifo runs");
    assert!(made.success());
    let answer = open_within_timeout(&fifo)
        .expect("opening a FIFO blocked (a reader must look before it opens)");
    let e = answer.expect_err("a FIFO was accepted");
    assert_eq!(not_regular(&e), Some("a FIFO"), "{e:?}");
    let e = e.to_string();
    assert!(
        e.contains("a FIFO, not a regular file") && e.contains("pipe.trace"),
        "{e}"
    );
}

/// `weights_digest(model)` on another thread; `None` if it did not answer within 10 s.
fn digest_within_timeout(model: &std::path::Path) -> Option<Result<String, Error>> {
    let (tx, rx) = std::sync::mpsc::channel();
    let p = model.to_path_buf();
    std::thread::spawn(move || {
        let _ = tx.send(tracegate_trace::weights_digest(&p));
    });
    rx.recv_timeout(std::time::Duration::from_secs(10)).ok()
}

fn mkfifo(path: &std::path::Path) {
    let made = std::process::Command::new("mkfifo")
        .arg(path)
        .status()
        .expect("mkfifo runs");
    assert!(made.success());
}

#[test]
fn a_weights_file_that_is_not_a_regular_file_is_refused_without_blocking() {
    let dir = tempfile::tempdir().unwrap();
    // A FIFO as the one safetensors file of a directory, as a .gguf model, and /dev/zero behind
    // a symlink (endless): each refused in one line naming the path and what it is.
    let st = dir.path().join("st");
    std::fs::create_dir(&st).unwrap();
    mkfifo(&st.join("model.safetensors"));
    let fifo_gguf = dir.path().join("pipe.gguf");
    mkfifo(&fifo_gguf);
    let zero = dir.path().join("zero");
    std::fs::create_dir(&zero).unwrap();
    std::os::unix::fs::symlink("/dev/zero", zero.join("model.safetensors")).unwrap();
    let zero_gguf = dir.path().join("zero.gguf");
    std::os::unix::fs::symlink("/dev/zero", &zero_gguf).unwrap();
    let cases = [
        (st.clone(), "model.safetensors: a FIFO, not a regular file"),
        (fifo_gguf, "pipe.gguf: a FIFO, not a regular file"),
        (zero, "model.safetensors: a device, not a regular file"),
        (zero_gguf.clone(), "zero.gguf: a device, not a regular file"),
        (
            dir.path().join("st/../zero.gguf"),
            "a device, not a regular file",
        ),
    ];
    for (model, want) in cases {
        let e = digest_within_timeout(&model)
            .unwrap_or_else(|| panic!("{}: the weights digest blocked", model.display()))
            .expect_err("a file that is not regular was hashed")
            .to_string();
        assert!(e.contains(want) && !e.contains('\n'), "{e}");
    }
    // Control: a symlink to a regular file is followed and hashed as its target.
    let real = dir.path().join("real.gguf");
    std::fs::write(&real, b"GGUF bytes").unwrap();
    let link = dir.path().join("link.gguf");
    std::os::unix::fs::symlink(&real, &link).unwrap();
    assert_eq!(
        tracegate_trace::weights_digest(&link).unwrap(),
        tracegate_trace::xxh3_hex(xxh3_128(b"GGUF bytes"))
    );
    assert_eq!(
        tracegate_trace::weights_digest_of([&b"GGUF "[..], &b"bytes"[..]]),
        tracegate_trace::xxh3_hex(xxh3_128(b"GGUF bytes"))
    );
}

#[test]
fn a_device_is_refused() {
    let e = Trace::open("/dev/null").expect_err("a device was accepted");
    assert_eq!(not_regular(&e), Some("a device"), "{e:?}");
    let e = e.to_string();
    assert!(
        e.contains("/dev/null") && e.contains("a device, not a regular file"),
        "{e}"
    );
}

/// Every kind's name, from a match the compiler holds complete: a new kind does not build until
/// it is listed here, and then `every_kind_is_produced_by_a_file` wants a file that makes it.
macro_rules! kinds {
    ($($class:ident: [$($kind:ident),* $(,)?]),* $(,)?) => {
        fn kind_name(e: &Error) -> Option<&'static str> {
            match e {
                $(Error::$class { kind, .. } => Some(match kind {
                    $($class::$kind { .. } => stringify!($kind),)*
                }),)*
                _ => None,
            }
        }
        const KINDS: &[&str] = &[$($(stringify!($kind),)*)*];
    };
}

kinds! {
    Malformed: [
        TemporaryFile, NotRegularFile, TooShort, SizeChanged, BadMagic, UnsupportedVersion,
        NonZeroHeader, NoFooter, IndexTooLong, IndexMisplaced, IndexMisaligned, BadIndex,
        UnknownField, WrongFormat, VersionDisagrees, BadDigest, DuplicateKey, ProvenanceNotObject,
        BadName, BadDtype, RankTooHigh, ShapeOverflow, NbytesMismatch, RangeOverflow, Misaligned,
        OutsideData, BadXxh3, BadAttributes, DuplicateName, Overlap, BadBool,
    ],
    Tampered: [
        IndexDigestMismatch, TensorDigestMismatch, DecisionDigestMismatch, ContentDigestMismatch,
        NonZeroPadding,
    ],
}

fn refusal(bytes: &[u8]) -> Error {
    open_bytes(bytes).expect_err("hostile file was accepted")
}

/// The sample trace with byte `at` (counted from the end when negative) set to `value`.
fn sample_with(at: isize, value: u8) -> Error {
    let mut f = sample_bytes();
    let i = if at < 0 {
        f.len() - at.unsigned_abs()
    } else {
        at as usize
    };
    f[i] = value;
    refusal(&f)
}

fn sample_edited(edit: impl FnOnce(&mut serde_json::Value)) -> Error {
    refusal(&edit_index(&sample_bytes(), edit))
}

/// A crafted file of one tensor entry and `data_len` zero bytes of data.
fn one_tensor(t: serde_json::Value, data_len: usize) -> Error {
    refusal(&craft(&index_with(json!([t])), data_len))
}

fn with_dtype(mut t: serde_json::Value, dtype: &str) -> serde_json::Value {
    t["dtype"] = json!(dtype);
    t
}

/// One file (or file system object) per kind, each refused as that kind.
fn one_refusal_per_kind() -> Vec<(&'static str, Error)> {
    let dir = tempfile::tempdir().unwrap();
    let tmp = dir.path().join("s.trace.tracegate-tmp");
    std::fs::write(&tmp, sample_bytes()).unwrap();
    let shrunk = dir.path().join("shrunk.trace");
    std::fs::write(&shrunk, sample_bytes()).unwrap();
    let open = Trace::open(&shrunk).unwrap();
    std::fs::OpenOptions::new()
        .write(true)
        .open(&shrunk)
        .unwrap()
        .set_len(64)
        .unwrap();
    let (mut data, index) = split_index(&sample_bytes());
    let (mut bools, mut bools_index) = (data.clone(), index.clone());
    data.push(0);
    let at = bools_index["tensors"][2]["offset"].as_u64().unwrap() as usize;
    bools[at + 1] = 2;
    bools_index["tensors"][2]["xxh3"] =
        json!(tracegate_trace::xxh3_hex(xxh3_128(&bools[at..at + 2])));
    let values = index["decisions"][0]["values_offset"].as_u64().unwrap() as isize;
    let repeated = String::from_utf8(index_with(json!([])))
        .unwrap()
        .replace("\"provenance\":{}", "\"provenance\":{\"a\":1,\"a\":2}");
    let f32 = |shape, offset, nbytes| tensor("a", shape, offset, nbytes);
    vec![
        ("TemporaryFile", Trace::open(&tmp).unwrap_err()),
        ("NotRegularFile", Trace::open(dir.path()).unwrap_err()),
        ("TooShort", refusal(&[])),
        ("SizeChanged", open.verify().unwrap_err()),
        ("BadMagic", sample_with(0, b'X')),
        ("UnsupportedVersion", sample_with(8, 2)),
        ("NonZeroHeader", sample_with(40, 1)),
        ("NoFooter", sample_with(-2, b'x')),
        // The top byte of the footer's index length, and of its index offset.
        ("IndexTooLong", sample_with(-25, 0x40)),
        ("IndexMisplaced", sample_with(-33, 1)),
        ("IndexMisaligned", refusal(&with_index(&data, &index))),
        ("BadIndex", refusal(&craft(b"{", 0))),
        ("UnknownField", sample_edited(|i| i["later"] = json!(1))),
        ("WrongFormat", sample_edited(|i| i["format"] = json!("x"))),
        ("VersionDisagrees", sample_with(10, 1)),
        ("BadDigest", sample_edited(|i| i["digest"] = json!("00"))),
        ("DuplicateKey", refusal(&craft(repeated.as_bytes(), 0))),
        (
            "ProvenanceNotObject",
            sample_edited(|i| i["provenance"] = json!([])),
        ),
        (
            "BadName",
            sample_edited(|i| i["tensors"][0]["name"] = json!("")),
        ),
        (
            "BadDtype",
            one_tensor(with_dtype(f32(json!([1]), 64, 4), "f128"), 64),
        ),
        (
            "RankTooHigh",
            one_tensor(f32(json!(vec![1; 33]), 64, 4), 64),
        ),
        (
            "ShapeOverflow",
            one_tensor(f32(json!([u64::MAX / 2, 4]), 64, 0), 0),
        ),
        ("NbytesMismatch", one_tensor(f32(json!([3]), 64, 16), 64)),
        (
            "RangeOverflow",
            one_tensor(f32(json!([32]), u64::MAX - 63, 128), 0),
        ),
        ("Misaligned", one_tensor(f32(json!([1]), 68, 4), 128)),
        ("OutsideData", one_tensor(f32(json!([1]), 0, 4), 64)),
        (
            "BadXxh3",
            sample_edited(|i| i["decisions"][0]["xxh3"] = json!("zz")),
        ),
        (
            "BadAttributes",
            sample_edited(|i| i["tensors"][0]["attributes"]["step"] = json!("x")),
        ),
        (
            "DuplicateName",
            refusal(&craft(
                &index_with(json!([f32(json!([1]), 64, 4), f32(json!([1]), 128, 4)])),
                128,
            )),
        ),
        (
            "Overlap",
            refusal(&craft(
                &index_with(json!([
                    tensor("a", json!([32]), 64, 128),
                    tensor("b", json!([4]), 128, 16)
                ])),
                192,
            )),
        ),
        ("BadBool", refusal(&with_index(&bools, &bools_index))),
        ("IndexDigestMismatch", sample_with(-41, b']')),
        (
            "TensorDigestMismatch",
            one_tensor(f32(json!([2]), 64, 8), 64),
        ),
        ("DecisionDigestMismatch", sample_with(values, 9)),
        (
            "ContentDigestMismatch",
            sample_edited(|i| i["tensors"][0]["attributes"]["path"] = json!("decode")),
        ),
        ("NonZeroPadding", sample_with(115, 0x5a)),
    ]
}

/// The kinds no case produced.
fn unreached(produced: &[&str]) -> Vec<&'static str> {
    KINDS
        .iter()
        .copied()
        .filter(|k| !produced.contains(k))
        .collect()
}

#[test]
fn every_kind_is_produced_by_a_file() {
    let cases = one_refusal_per_kind();
    for (want, e) in &cases {
        assert_eq!(kind_name(e), Some(*want), "{e:?}");
        let text = e.to_string();
        assert!(!text.contains('\n') && text.contains(": "), "{text}");
    }
    let produced: Vec<&str> = cases.iter().map(|(k, _)| *k).collect();
    assert_eq!(
        unreached(&produced),
        Vec::<&str>::new(),
        "a kind no file produces"
    );
    // Negative controls: a case left out is noticed, and other errors are no kind.
    assert_eq!(unreached(&produced[1..]), vec![produced[0]]);
    assert_eq!(kind_name(&Error::Invalid("x".into())), None);
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, .. ProptestConfig::default() })]

    /// Arbitrary byte corruption anywhere: never a panic, and either open or verify refuses the
    /// file or what it reads is the original content (an edit that wrote a byte's own value).
    #[test]
    fn random_corruption_is_refused_or_harmless(edits in proptest::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 1..6)) {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("s.trace");
        write_sample(&p, sample_provenance());
        let original = Trace::open(&p).unwrap();
        let mut bytes = std::fs::read(&p).unwrap();
        for (at, value) in edits {
            let i = at.index(bytes.len());
            bytes[i] = value;
        }
        if let Ok(t) = open_bytes(&bytes) {
            prop_assert!(same_content(&t, &original), "a corrupted file verified with different content");
        }
    }

    /// Arbitrary offsets, sizes and shapes with a correct footer hash: never a panic, and never
    /// accepted (the per-tensor digest is a placeholder no payload matches).
    #[test]
    fn random_indexes_are_refused(offset in any::<u64>(), nbytes in any::<u64>(), dims in proptest::collection::vec(any::<u64>(), 0..4)) {
        let f = craft(&index_with(json!([tensor("a", json!(dims), offset, nbytes)])), 128);
        prop_assert!(open_bytes(&f).is_err());
    }
}
