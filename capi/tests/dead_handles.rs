//! A handle that is not live — closed, aborted, NULL or never issued — is refused with
//! `TG_ERR_ARGUMENT` and a line, never followed: the header promises that no call aborts the
//! process, and these misuses once ended in SIGSEGV (a double free or a read of freed memory).

use std::ffi::{c_char, CStr, CString};

use tracegate_capi::{
    tg_abort, tg_close, tg_decision, tg_last_error, tg_open, tg_tensor, TgWriter, TG_ERR_ARGUMENT,
    TG_OK,
};

fn last_error() -> String {
    // SAFETY: tg_last_error returns a NUL-terminated string valid until this thread's next call.
    unsafe { CStr::from_ptr(tg_last_error()) }
        .to_str()
        .unwrap()
        .to_string()
}

/// A writer on a fresh trace in `dir`.
fn open(dir: &std::path::Path, name: &str) -> *mut TgWriter {
    let path = CString::new(dir.join(name).to_str().unwrap()).unwrap();
    let provenance = CString::new(r#"{"producer": "c-port"}"#).unwrap();
    // SAFETY: two NUL-terminated strings.
    let w = unsafe { tg_open(path.as_ptr(), provenance.as_ptr()) };
    assert!(!w.is_null(), "{}", last_error());
    w
}

fn tensor(w: *mut TgWriter, name: &str) -> i32 {
    let name = CString::new(name).unwrap();
    let data = [0u8; 8];
    let shape = [2u64];
    // SAFETY: the pointers hold the counts given.
    unsafe {
        tg_tensor(
            w,
            name.as_ptr(),
            2,
            shape.as_ptr(),
            1,
            data.as_ptr().cast(),
            data.len(),
            std::ptr::null(),
        )
    }
}

fn decision(w: *mut TgWriter) -> i32 {
    let name = CString::new("logits.argmax").unwrap();
    let (shape, values) = ([1u64], [3i64]);
    // SAFETY: the pointers hold the counts given.
    unsafe {
        tg_decision(
            w,
            name.as_ptr(),
            shape.as_ptr(),
            1,
            values.as_ptr(),
            1,
            std::ptr::null(),
            0,
        )
    }
}

fn close(w: *mut TgWriter) -> i32 {
    let mut digest = [0 as c_char; 65];
    // SAFETY: the buffer holds 65 bytes.
    unsafe { tg_close(w, digest.as_mut_ptr(), digest.len()) }
}

fn abort(w: *mut TgWriter) {
    // SAFETY: none needed: any handle is checked.
    unsafe { tg_abort(w) }
}

/// The refusal of a dead handle: its code and a line naming it.
fn refused(code: i32, w: *mut TgWriter) {
    let message = last_error();
    assert_eq!(code, TG_ERR_ARGUMENT, "{message}");
    assert!(
        message.contains(&format!("{w:p}")) && message.contains("not a live handle"),
        "{message}"
    );
}

#[test]
fn a_double_close_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let w = open(dir.path(), "t.trace");
    assert_eq!(tensor(w, "layer.00.hidden_out"), TG_OK, "{}", last_error());
    assert_eq!(close(w), TG_OK, "{}", last_error());
    assert_eq!(last_error(), "");
    refused(close(w), w);
    // The closed trace is whole, and the second close left nothing beside it.
    let t = tracegate_trace::Trace::open(dir.path().join("t.trace")).unwrap();
    t.verify().unwrap();
    assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 1);
}

#[test]
fn a_tensor_or_decision_after_close_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let w = open(dir.path(), "t.trace");
    assert_eq!(close(w), TG_OK, "{}", last_error());
    refused(tensor(w, "layer.00.hidden_out"), w);
    refused(decision(w), w);
}

#[test]
fn a_close_after_abort_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let w = open(dir.path(), "t.trace");
    abort(w);
    assert_eq!(last_error(), "");
    refused(close(w), w);
    refused(tensor(w, "layer.00.hidden_out"), w);
    // Aborted: nothing at the path, no temporary left.
    assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0);
}

#[test]
fn a_double_abort_is_refused_in_the_last_error() {
    let dir = tempfile::tempdir().unwrap();
    let w = open(dir.path(), "t.trace");
    abort(w);
    abort(w);
    refused(TG_ERR_ARGUMENT, w);
    // NULL is still ignored, and clears the last error like any call.
    abort(std::ptr::null_mut());
    assert_eq!(last_error(), "");
}

#[test]
fn a_handle_never_issued_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let live = open(dir.path(), "live.trace");
    // A pointer to memory that is not a writer, small integers, all ones, a neighbour of a
    // live handle: none is followed.
    let mut stack = [0u64; 4];
    let garbage: [*mut TgWriter; 5] = [
        stack.as_mut_ptr().cast(),
        8 as *mut TgWriter,
        usize::MAX as *mut TgWriter,
        (live as usize + 1) as *mut TgWriter,
        (live as usize).wrapping_sub(2) as *mut TgWriter,
    ];
    for w in garbage {
        refused(tensor(w, "layer.00.hidden_out"), w);
        refused(decision(w), w);
        refused(close(w), w);
        abort(w);
        refused(TG_ERR_ARGUMENT, w);
    }
    assert_eq!(stack, [0; 4]);
    // NULL: refused by name.
    let code = tensor(std::ptr::null_mut(), "x");
    assert_eq!(code, TG_ERR_ARGUMENT);
    assert!(
        last_error().contains("the writer is NULL"),
        "{}",
        last_error()
    );
    assert_eq!(close(std::ptr::null_mut()), TG_ERR_ARGUMENT);
    // The live writer was touched by none of it (control: it still writes and closes).
    assert_eq!(
        tensor(live, "layer.00.hidden_out"),
        TG_OK,
        "{}",
        last_error()
    );
    assert_eq!(close(live), TG_OK, "{}", last_error());
    let t = tracegate_trace::Trace::open(dir.path().join("live.trace")).unwrap();
    assert_eq!(t.tensors().len(), 1);
}

#[test]
fn writers_on_many_threads_stay_apart() {
    let dir = tempfile::tempdir().unwrap();
    let handles: Vec<_> = (0..8)
        .map(|i| {
            let path = dir.path().to_path_buf();
            std::thread::spawn(move || {
                let w = open(&path, &format!("t{i}.trace"));
                for k in 0..20 {
                    assert_eq!(tensor(w, &format!("layer.{k:02}.hidden_out")), TG_OK);
                }
                assert_eq!(close(w), TG_OK, "{}", last_error());
                refused(close(w), w);
            })
        })
        .collect();
    for h in handles {
        h.join().unwrap();
    }
    for i in 0..8 {
        let t = tracegate_trace::Trace::open(dir.path().join(format!("t{i}.trace"))).unwrap();
        assert_eq!(t.tensors().len(), 20);
    }
}
