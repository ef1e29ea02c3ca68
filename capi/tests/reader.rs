//! Reading traces from C (`tg_trace_*`, capi/src/reader.rs): a trace the Rust writer wrote reads
//! back with its dtype, shape, bytes and digest; each misuse is a code and a line naming it — a
//! tensor not in the trace, a buffer of the wrong size, a shape buffer too small, an edited
//! trace (refused at open), a closed handle and a writer's handle passed as a reader's.

use std::ffi::{c_char, c_int, CStr, CString};

use tracegate_capi::{
    tg_last_error, tg_open, tg_trace_bytes, tg_trace_close, tg_trace_digest, tg_trace_info,
    tg_trace_open, TgTrace, TG_ERR_ARGUMENT, TG_ERR_NOT_FOUND, TG_OK,
};
use tracegate_trace::{Attributes, DType, TraceWriter};

fn last_error() -> String {
    // SAFETY: tg_last_error returns a NUL-terminated string valid until this thread's next call.
    unsafe { CStr::from_ptr(tg_last_error()) }
        .to_string_lossy()
        .into_owned()
}

fn c(s: &str) -> CString {
    CString::new(s).unwrap()
}

fn info(t: *mut TgTrace, name: &str, cap: usize) -> (c_int, c_int, Vec<u64>) {
    let (mut dtype, mut rank, mut shape) = (0 as c_int, 0usize, vec![0u64; cap]);
    // SAFETY: dtype and rank point to one value each, shape to `cap`.
    let rc = unsafe {
        tg_trace_info(
            t,
            c(name).as_ptr(),
            &mut dtype,
            shape.as_mut_ptr(),
            cap,
            &mut rank,
        )
    };
    shape.truncate(rank);
    (rc, dtype, shape)
}

#[test]
fn a_trace_reads_back_and_each_misuse_is_a_code_and_a_line() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("t.trace");
    let mut w = TraceWriter::create(&path, serde_json::json!({"producer": "test"})).unwrap();
    let bf16: Vec<u8> = [0x3f80u16, 0xbf80, 0x4000]
        .iter()
        .flat_map(|b| b.to_le_bytes())
        .collect();
    w.tensor(
        "layer.00.k",
        DType::BF16,
        &[1, 3],
        &bf16,
        &Attributes::default(),
    )
    .unwrap();
    let digest = w.finish().unwrap().hex();
    let p = c(path.to_str().unwrap());
    // SAFETY: a NUL-terminated path.
    let t = unsafe { tg_trace_open(p.as_ptr()) };
    assert!(!t.is_null(), "{}", last_error());

    let (rc, dtype, shape) = info(t, "layer.00.k", 4);
    assert_eq!((rc, dtype, shape), (TG_OK, 4, vec![1, 3])); // TG_BF16
    let mut out = vec![0u8; bf16.len()];
    // SAFETY: out holds its length.
    let rc = unsafe {
        tg_trace_bytes(
            t,
            c("layer.00.k").as_ptr(),
            out.as_mut_ptr().cast(),
            out.len(),
        )
    };
    assert_eq!(rc, TG_OK, "{}", last_error());
    assert_eq!(out, bf16);
    let mut hex = [0 as c_char; 65];
    // SAFETY: hex holds 65 bytes.
    assert_eq!(
        unsafe { tg_trace_digest(t, hex.as_mut_ptr(), hex.len()) },
        TG_OK
    );
    // SAFETY: tg_trace_digest wrote a NUL-terminated string.
    assert_eq!(
        unsafe { CStr::from_ptr(hex.as_ptr()) }.to_str().unwrap(),
        digest
    );

    // Misuses: each a code and a line naming it.
    assert_eq!(info(t, "layer.00.q", 4).0, TG_ERR_NOT_FOUND);
    assert!(
        last_error().contains("no tensor \"layer.00.q\""),
        "{}",
        last_error()
    );
    assert_eq!(info(t, "layer.00.k", 1).0, TG_ERR_ARGUMENT);
    assert!(last_error().contains("its rank is 2"), "{}", last_error());
    let mut small = vec![0u8; 2];
    // SAFETY: small holds its length.
    let rc = unsafe {
        tg_trace_bytes(
            t,
            c("layer.00.k").as_ptr(),
            small.as_mut_ptr().cast(),
            small.len(),
        )
    };
    assert_eq!(rc, TG_ERR_ARGUMENT);
    assert!(
        last_error().contains("the buffer holds 2 bytes, its payload is 6"),
        "{}",
        last_error()
    );
    // SAFETY: t is live; closing it twice is refused, not followed.
    unsafe { tg_trace_close(t) };
    assert_eq!(last_error(), "");
    unsafe { tg_trace_close(t) };
    assert!(
        last_error().contains("is not a live handle"),
        "{}",
        last_error()
    );
    assert_eq!(info(t, "layer.00.k", 4).0, TG_ERR_ARGUMENT);
    // A writer's handle is no reader's.
    let wp = c(dir.path().join("w.trace").to_str().unwrap());
    // SAFETY: two NUL-terminated strings.
    let writer = unsafe { tg_open(wp.as_ptr(), c(r#"{"producer": "x"}"#).as_ptr()) };
    assert!(!writer.is_null());
    assert_eq!(info(writer.cast(), "layer.00.k", 4).0, TG_ERR_ARGUMENT);

    // An edited payload is refused when the trace is opened.
    let mut bytes = std::fs::read(&path).unwrap();
    let at = bytes.windows(2).position(|w| w == [0x80, 0xbf]).unwrap();
    bytes[at] ^= 1;
    let edited = dir.path().join("edited.trace");
    std::fs::write(&edited, bytes).unwrap();
    let e = c(edited.to_str().unwrap());
    // SAFETY: a NUL-terminated path.
    assert!(unsafe { tg_trace_open(e.as_ptr()) }.is_null());
    assert!(!last_error().is_empty());
}
