//! The C ABI over [`tracegate_trace::TraceWriter`] (`include/tracegate.h`): what a C, C++, CUDA,
//! Swift or Metal port links to write traces. Every entry point returns a status code and leaves
//! its message in a thread-local for `tg_last_error`; a panic is caught at the boundary and
//! reported as `TG_ERR_INTERNAL`, never unwound into C.

use std::cell::RefCell;
use std::collections::BTreeMap;
use std::ffi::{c_char, c_int, c_void, CStr, CString};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::Path;
use std::sync::{Arc, Mutex};

use tracegate_trace::{Attributes, DType, Error, TraceWriter};

pub const TG_OK: c_int = 0;
pub const TG_ERR_INVALID: c_int = 1;
pub const TG_ERR_IO: c_int = 2;
pub const TG_ERR_NOT_FOUND: c_int = 3;
pub const TG_ERR_ARGUMENT: c_int = 4;
pub const TG_ERR_INTERNAL: c_int = 5;

/// `tg_dtype` of the header: `DType::ALL[n - 1]`, 0 (a zeroed field) no type. The header's
/// numbers are checked against this list by the test below: a reordered `ALL` fails it.
const DTYPES: [DType; 10] = DType::ALL;

/// `tg_attrs` of the header.
#[repr(C)]
pub struct TgAttrs {
    pub path: *const c_char,
    pub mask: *const c_char,
    pub positions: *const i64,
    pub n_positions: usize,
    pub step: *const i64,
    pub extra_keys: *const *const c_char,
    pub extra_values: *const *const c_char,
    pub n_extra: usize,
}

/// The opaque `tg_writer`. A `*mut TgWriter` is never dereferenced: it is the number of a
/// handle in [`LIVE`] (see [`Handles`]), so a closed, aborted or never-issued one is refused,
/// not followed.
pub struct TgWriter {
    _opaque: [u8; 0],
}

/// The writers of the live handles, by number. A number is issued once and never again (a
/// counter that refuses to wrap), so a handle closed twice, used after `tg_close` or `tg_abort`, or made up
/// (garbage, a pointer from elsewhere) names no writer and is refused in a line: nothing is
/// freed twice or read after it is freed. Each writer has its own lock (the registry's is held
/// only to look a number up), so writers on different threads do not wait for each other; one
/// handle's misuse from two threads at once is serialized rather than a data race.
struct Handles {
    next: usize,
    live: BTreeMap<usize, Arc<Mutex<Option<TraceWriter>>>>,
    /// The readers (reader.rs), numbered from the same counter: a writer's number is never a
    /// reader's, so one passed for the other is refused as not live.
    readers: BTreeMap<usize, Arc<tracegate_trace::Trace>>,
}

/// Numbers start high and go up in steps of 2 (all odd): small integers, NULL-adjacent garbage
/// and real (aligned) pointers are never issued, so they are refused as never opened.
const FIRST_HANDLE: usize = 0x7467_0001;

static LIVE: Mutex<Handles> = Mutex::new(Handles {
    next: FIRST_HANDLE,
    live: BTreeMap::new(),
    readers: BTreeMap::new(),
});

mod reader;
pub use reader::*;

fn registry() -> std::sync::MutexGuard<'static, Handles> {
    // A panic while it was held (caught at the boundary) leaves the map consistent: every
    // update is one insert or remove.
    LIVE.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

fn dead(w: *mut TgWriter) -> Failure {
    if w.is_null() {
        argument("the writer is NULL".into())
    } else {
        argument(format!(
            "the writer {w:p} is not a live handle: already closed or aborted, or never returned by tg_open"
        ))
    }
}

/// Registers `w` and returns its handle.
fn issue(w: TraceWriter) -> Result<*mut TgWriter, Failure> {
    let mut r = registry();
    let n = next_number(&mut r)?;
    r.live.insert(n, Arc::new(Mutex::new(Some(w))));
    Ok(n as *mut TgWriter)
}

/// A handle number never issued before.
fn next_number(r: &mut Handles) -> Result<usize, Failure> {
    let n = r.next;
    r.next = n
        .checked_add(2)
        .ok_or_else(|| Failure(TG_ERR_INTERNAL, "the handle numbers are spent".into()))?;
    Ok(n)
}

/// The writer of live handle `w`.
fn lookup(w: *mut TgWriter) -> Result<Arc<Mutex<Option<TraceWriter>>>, Failure> {
    registry()
        .live
        .get(&(w as usize))
        .cloned()
        .ok_or_else(|| dead(w))
}

/// Ends handle `w`: from here on it names nothing. Its writer, taken out, is the caller's.
fn retire(w: *mut TgWriter) -> Result<TraceWriter, Failure> {
    let cell = registry()
        .live
        .remove(&(w as usize))
        .ok_or_else(|| dead(w))?;
    let mut slot = cell.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
    slot.take().ok_or_else(|| dead(w))
}

/// Runs `f` on the writer of live handle `w`.
fn with_writer<T>(
    w: *mut TgWriter,
    f: impl FnOnce(&mut TraceWriter) -> Result<T, Failure>,
) -> Result<T, Failure> {
    let cell = lookup(w)?;
    let mut slot = cell.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
    // Closed by another thread between the lookup and the lock: as dead as never opened.
    let writer = slot.as_mut().ok_or_else(|| dead(w))?;
    f(writer)
}

/// A failure on its way to C: the code and its one line.
struct Failure(c_int, String);

impl From<Error> for Failure {
    fn from(e: Error) -> Self {
        let code = match e {
            Error::Io { .. } => TG_ERR_IO,
            Error::NotFound(_) => TG_ERR_NOT_FOUND,
            _ => TG_ERR_INVALID,
        };
        Failure(code, e.to_string())
    }
}

fn argument(what: String) -> Failure {
    Failure(TG_ERR_ARGUMENT, what)
}

thread_local! {
    static LAST_ERROR: RefCell<CString> = RefCell::new(CString::default());
}

fn set_last_error(message: &str) {
    // A message holding NUL (from a hostile name) is cut there rather than lost.
    let text = message.split('\0').next().unwrap_or_default();
    let text = CString::new(text).unwrap_or_default();
    LAST_ERROR.with(|e| *e.borrow_mut() = text);
}

/// Runs `f` at the boundary: its failure (or panic) becomes the thread's last error and a code.
fn boundary<T>(on_error: T, f: impl FnOnce() -> Result<T, Failure>) -> (T, c_int) {
    set_last_error("");
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(Ok(v)) => (v, TG_OK),
        Ok(Err(Failure(code, message))) => {
            set_last_error(&message);
            (on_error, code)
        }
        Err(panic) => {
            let what = panic
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| panic.downcast_ref::<String>().cloned())
                .unwrap_or_default();
            set_last_error(&format!("internal error in libtracegate_capi: {what}"));
            (on_error, TG_ERR_INTERNAL)
        }
    }
}

/// A required C string argument, as UTF-8.
///
/// # Safety
/// `p` is NULL or a NUL-terminated string that lives for `'a`.
unsafe fn text<'a>(p: *const c_char, what: &str) -> Result<&'a str, Failure> {
    if p.is_null() {
        return Err(argument(format!("{what} is NULL")));
    }
    CStr::from_ptr(p)
        .to_str()
        .map_err(|e| argument(format!("{what} is not UTF-8: {e}")))
}

/// An optional C string argument (NULL = absent).
unsafe fn optional_text(p: *const c_char, what: &str) -> Result<Option<String>, Failure> {
    if p.is_null() {
        Ok(None)
    } else {
        text(p, what).map(|s| Some(s.to_string()))
    }
}

/// `n` elements at `p`; NULL is allowed only for none.
unsafe fn slice<'a, T>(p: *const T, n: usize, what: &str) -> Result<&'a [T], Failure> {
    match (p.is_null(), n) {
        (true, 0) => Ok(&[]),
        (true, _) => Err(argument(format!("{what} is NULL but its count is {n}"))),
        (false, _) => Ok(std::slice::from_raw_parts(p, n)),
    }
}

unsafe fn attributes(name: &str, a: *const TgAttrs) -> Result<Attributes, Failure> {
    let Some(a) = a.as_ref() else {
        return Ok(Attributes::default());
    };
    let at = |field: &str| format!("tensor {name:?}: attrs.{field}");
    let positions = if a.positions.is_null() {
        if a.n_positions != 0 {
            return Err(argument(format!(
                "{} is NULL but n_positions is {}",
                at("positions"),
                a.n_positions
            )));
        }
        None
    } else {
        Some(slice(a.positions, a.n_positions, &at("positions"))?.to_vec())
    };
    let keys = slice(a.extra_keys, a.n_extra, &at("extra_keys"))?;
    let values = slice(a.extra_values, a.n_extra, &at("extra_values"))?;
    let mut extra = Vec::with_capacity(keys.len());
    for (i, (k, v)) in keys.iter().zip(values).enumerate() {
        let key = text(*k, &at(&format!("extra_keys[{i}]")))?;
        let value = text(*v, &at(&format!("extra_values[{i}]")))?;
        if extra.iter().any(|(seen, _): &(String, String)| seen == key) {
            return Err(Failure(
                TG_ERR_INVALID,
                format!("tensor {name:?}: extra attribute {key:?} given twice"),
            ));
        }
        extra.push((key.to_string(), value.to_string()));
    }
    Ok(Attributes {
        path: optional_text(a.path, &at("path"))?,
        mask: optional_text(a.mask, &at("mask"))?,
        positions,
        step: a.step.as_ref().copied(),
        extra: extra.into_iter().collect(),
    })
}

/// Writes `text` and a NUL into `out[..cap]`.
unsafe fn copy_out(text: &str, out: *mut c_char, cap: usize, what: &str) -> Result<(), Failure> {
    if out.is_null() || cap < text.len() + 1 {
        return Err(argument(format!(
            "{what}: the buffer holds {cap} bytes, {} are needed",
            text.len() + 1
        )));
    }
    std::ptr::copy_nonoverlapping(text.as_ptr(), out.cast::<u8>(), text.len());
    *out.add(text.len()) = 0;
    Ok(())
}

/// # Safety
/// `path` and `provenance_json` are NULL or NUL-terminated strings.
#[no_mangle]
pub unsafe extern "C" fn tg_open(
    path: *const c_char,
    provenance_json: *const c_char,
) -> *mut TgWriter {
    boundary(std::ptr::null_mut(), || {
        let path = text(path, "path")?;
        let provenance = text(provenance_json, "provenance_json")?;
        let provenance: serde_json::Value = serde_json::from_str(provenance).map_err(|e| {
            Failure(
                TG_ERR_INVALID,
                format!("{path}: provenance is not JSON: {e}"),
            )
        })?;
        issue(TraceWriter::create(path, provenance)?)
    })
    .0
}

/// # Safety
/// The pointers hold the counts the header gives (`w` may be anything: a handle that is not
/// live is refused).
#[no_mangle]
pub unsafe extern "C" fn tg_tensor(
    w: *mut TgWriter,
    name: *const c_char,
    dtype: c_int,
    shape: *const u64,
    rank: usize,
    data: *const c_void,
    nbytes: usize,
    attrs: *const TgAttrs,
) -> c_int {
    boundary((), || {
        with_writer(w, |w| {
            let name = text(name, "name")?;
            let dtype = usize::try_from(dtype)
                .ok()
                .and_then(|d| d.checked_sub(1))
                .and_then(|d| DTYPES.get(d))
                .copied()
                .ok_or_else(|| {
                    argument(format!(
                        "tensor {name:?}: dtype {dtype} is none of TG_F64 (1) .. TG_BOOL (10)"
                    ))
                })?;
            let shape = slice(shape, rank, &format!("tensor {name:?}: shape"))?;
            let bytes = slice(data.cast::<u8>(), nbytes, &format!("tensor {name:?}: data"))?;
            let attrs = attributes(name, attrs)?;
            Ok(w.tensor(name, dtype, shape, bytes, &attrs)?)
        })
    })
    .1
}

/// # Safety
/// The pointers hold the counts the header gives (`w` may be anything: a handle that is not
/// live is refused).
#[no_mangle]
pub unsafe extern "C" fn tg_decision(
    w: *mut TgWriter,
    name: *const c_char,
    shape: *const u64,
    rank: usize,
    values: *const i64,
    n_values: usize,
    margins: *const f32,
    n_margins: usize,
) -> c_int {
    boundary((), || {
        with_writer(w, |w| {
            let name = text(name, "name")?;
            let shape = slice(shape, rank, &format!("decision {name:?}: shape"))?;
            let values = slice(values, n_values, &format!("decision {name:?}: values"))?;
            let margins = if margins.is_null() && n_margins == 0 {
                None
            } else {
                Some(slice(
                    margins,
                    n_margins,
                    &format!("decision {name:?}: margins"),
                )?)
            };
            Ok(w.decision(name, shape, values, margins)?)
        })
    })
    .1
}

/// # Safety
/// `digest_hex` holds `cap` bytes. `w` may be anything: a live handle is ended whatever this
/// returns, any other is refused.
#[no_mangle]
pub unsafe extern "C" fn tg_close(w: *mut TgWriter, digest_hex: *mut c_char, cap: usize) -> c_int {
    boundary((), || {
        // The handle is dead from here on, finished or not.
        let w = retire(w)?;
        // A buffer too small is refused before the trace appears: an error leaves nothing.
        const HEX: usize = 64;
        if !digest_hex.is_null() && cap < HEX + 1 {
            return Err(argument(format!(
                "tg_close digest_hex: the buffer holds {cap} bytes, {} are needed; the trace is not written",
                HEX + 1
            )));
        }
        let digest = w.finish()?;
        if !digest_hex.is_null() {
            copy_out(&digest.hex(), digest_hex, cap, "tg_close digest_hex")?;
        }
        Ok(())
    })
    .1
}

/// # Safety
/// None: `w` may be anything. NULL is ignored; a handle that is not live is refused in
/// `tg_last_error` (there is no code to return).
#[no_mangle]
pub unsafe extern "C" fn tg_abort(w: *mut TgWriter) {
    boundary((), || {
        if !w.is_null() {
            drop(retire(w)?);
        }
        Ok(())
    });
}

/// # Safety
/// `model_dir` is NULL or a NUL-terminated string; `out` holds `cap` bytes.
#[no_mangle]
pub unsafe extern "C" fn tg_weights_digest(
    model_dir: *const c_char,
    out: *mut c_char,
    cap: usize,
) -> c_int {
    boundary((), || {
        let dir = text(model_dir, "model_dir")?;
        let digest = tracegate_trace::weights_digest(Path::new(dir))?;
        copy_out(&digest, out, cap, "tg_weights_digest out")
    })
    .1
}

#[no_mangle]
pub extern "C" fn tg_last_error() -> *const c_char {
    LAST_ERROR.with(|e| e.borrow().as_ptr())
}

#[cfg(test)]
mod tests {
    /// Every `TG_<NAME> = N` of the header's tg_dtype names `DTYPES[N - 1]`, and every dtype has one.
    #[test]
    fn the_headers_dtype_numbers_are_the_librarys() {
        let header = include_str!("../include/tracegate.h");
        let start = header.find("typedef enum tg_dtype").unwrap();
        let body = &header[start..header[start..].find('}').unwrap() + start];
        let mut seen = Vec::new();
        for line in body.lines().filter_map(|l| l.trim().strip_prefix("TG_")) {
            let (name, number) = line.split_once('=').unwrap();
            let n: usize = number.trim().trim_end_matches(',').parse().unwrap();
            assert_eq!(
                super::DTYPES[n - 1].name(),
                name.trim().to_lowercase(),
                "TG_{line}"
            );
            seen.push(n);
        }
        assert_eq!(seen, (1..=super::DTYPES.len()).collect::<Vec<_>>());
    }
}
