//! Reading traces from C (`tg_trace_*` in include/tracegate.h): what a port's own tests need to
//! check its output against a reference trace — a tensor's dtype, shape and payload as stored —
//! over [`tracegate_trace::Trace`]. Comparing is the caller's (e.g. the `test_capsule.c` a
//! repro capsule carries, docs/bisect.md "Capsules"). Handles are numbers in the writers'
//! registry, refused when not live, as the writers' are.

use std::ffi::{c_char, c_int, c_void};
use std::sync::Arc;

use tracegate_trace::Trace;

use super::*;

/// The opaque `tg_trace`: a handle number, never dereferenced.
pub struct TgTrace {
    _opaque: [u8; 0],
}

fn dead_reader(t: *mut TgTrace) -> Failure {
    if t.is_null() {
        argument("the trace is NULL".into())
    } else {
        argument(format!(
            "the trace {t:p} is not a live handle: already closed, or never returned by tg_trace_open"
        ))
    }
}

fn reader(t: *mut TgTrace) -> Result<Arc<Trace>, Failure> {
    registry()
        .readers
        .get(&(t as usize))
        .cloned()
        .ok_or_else(|| dead_reader(t))
}

/// The tensor `name` of live trace `t`.
unsafe fn tensor(
    trace: &Trace,
    name: *const c_char,
) -> Result<&tracegate_trace::TensorInfo, Failure> {
    let name = text(name, "name")?;
    trace.tensor_info(name).ok_or_else(|| {
        Failure(
            TG_ERR_NOT_FOUND,
            format!("{}: no tensor {name:?}", trace.path().display()),
        )
    })
}

/// # Safety
/// `path` is NULL or a NUL-terminated string.
#[no_mangle]
pub unsafe extern "C" fn tg_trace_open(path: *const c_char) -> *mut TgTrace {
    boundary(std::ptr::null_mut(), || {
        let path = text(path, "path")?;
        let trace = Trace::open(path)?;
        // Every payload against its digest: a reader's numbers are the trace's, or refused.
        trace.verify()?;
        let mut r = registry();
        let n = next_number(&mut r)?;
        r.readers.insert(n, Arc::new(trace));
        Ok(n as *mut TgTrace)
    })
    .0
}

/// # Safety
/// `name` is NULL or a NUL-terminated string; `dtype` and `rank` point to one value each,
/// `shape` to `cap` (NULL when `cap` is 0). `t` may be anything: one not live is refused.
#[no_mangle]
pub unsafe extern "C" fn tg_trace_info(
    t: *mut TgTrace,
    name: *const c_char,
    dtype: *mut c_int,
    shape: *mut u64,
    cap: usize,
    rank: *mut usize,
) -> c_int {
    boundary((), || {
        let trace = reader(t)?;
        let info = tensor(&trace, name)?;
        if dtype.is_null() || rank.is_null() {
            return Err(argument(format!(
                "tensor {:?}: dtype or rank is NULL",
                info.name
            )));
        }
        if info.shape.len() > cap || (shape.is_null() && !info.shape.is_empty()) {
            return Err(argument(format!(
                "tensor {:?}: shape holds {cap} dimensions, its rank is {}",
                info.name,
                info.shape.len()
            )));
        }
        let number = DTYPES.iter().position(|d| *d == info.dtype).unwrap_or(0) + 1;
        *dtype = number as c_int;
        *rank = info.shape.len();
        if !info.shape.is_empty() {
            std::ptr::copy_nonoverlapping(info.shape.as_ptr(), shape, info.shape.len());
        }
        Ok(())
    })
    .1
}

/// # Safety
/// `name` is NULL or a NUL-terminated string; `out` holds `nbytes` bytes.
#[no_mangle]
pub unsafe extern "C" fn tg_trace_bytes(
    t: *mut TgTrace,
    name: *const c_char,
    out: *mut c_void,
    nbytes: usize,
) -> c_int {
    boundary((), || {
        let trace = reader(t)?;
        let info = tensor(&trace, name)?;
        let data = trace.data(info);
        if out.is_null() || nbytes != data.len() {
            return Err(argument(format!(
                "tensor {:?}: the buffer holds {nbytes} bytes, its payload is {}",
                info.name,
                data.len()
            )));
        }
        std::ptr::copy_nonoverlapping(data.as_ptr(), out.cast::<u8>(), data.len());
        Ok(())
    })
    .1
}

/// # Safety
/// `out` holds `cap` bytes. `t` may be anything: one not live is refused.
#[no_mangle]
pub unsafe extern "C" fn tg_trace_digest(t: *mut TgTrace, out: *mut c_char, cap: usize) -> c_int {
    boundary((), || {
        let trace = reader(t)?;
        copy_out(&trace.digest().hex(), out, cap, "tg_trace_digest out")
    })
    .1
}

/// # Safety
/// None: `t` may be anything. NULL is ignored; a handle that is not live is refused in
/// `tg_last_error`.
#[no_mangle]
pub unsafe extern "C" fn tg_trace_close(t: *mut TgTrace) {
    boundary((), || {
        if !t.is_null() && registry().readers.remove(&(t as usize)).is_none() {
            return Err(dead_reader(t));
        }
        Ok(())
    });
}
