//! `tracegate._native`: the Rust container exposed to Python. The numpy-facing API lives in
//! `python/tracegate/__init__.py`; this layer moves bytes and never panics across the boundary.

use std::collections::BTreeMap;
use std::os::raw::{c_int, c_void};
use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use pyo3::create_exception;
use pyo3::exceptions::PyException;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyList};
use tracegate_trace::{Attributes, DType, Trace, TraceWriter};

create_exception!(
    _native,
    TraceError,
    PyException,
    "A trace could not be written, read or verified."
);
create_exception!(
    _native,
    CompareError,
    PyException,
    "Two traces could not be compared as asked (a bad policy, a filter that selects nothing)."
);

fn err(e: tracegate_trace::Error) -> PyErr {
    TraceError::new_err(e.to_string())
}

#[pyclass(module = "tracegate._native")]
struct NativeWriter {
    inner: Mutex<Option<TraceWriter>>,
}

impl NativeWriter {
    fn with<T>(
        &self,
        f: impl FnOnce(&mut TraceWriter) -> tracegate_trace::Result<T>,
    ) -> PyResult<T> {
        let mut guard = self
            .inner
            .lock()
            .map_err(|_| TraceError::new_err("writer lock poisoned"))?;
        let w = guard
            .as_mut()
            .ok_or_else(|| TraceError::new_err("trace writer is already finished or aborted"))?;
        f(w).map_err(err)
    }
}

#[pymethods]
impl NativeWriter {
    #[new]
    fn new(path: PathBuf, provenance_json: &str) -> PyResult<Self> {
        let provenance: serde_json::Value = serde_json::from_str(provenance_json)
            .map_err(|e| TraceError::new_err(format!("provenance is not JSON: {e}")))?;
        let w = TraceWriter::create(&path, provenance).map_err(err)?;
        Ok(NativeWriter {
            inner: Mutex::new(Some(w)),
        })
    }

    #[pyo3(signature = (name, dtype, shape, data, path=None, mask=None, positions=None, step=None, extra=None))]
    #[allow(clippy::too_many_arguments)]
    fn tensor(
        &self,
        name: &str,
        dtype: &str,
        shape: Vec<u64>,
        data: pyo3::buffer::PyBuffer<u8>,
        path: Option<String>,
        mask: Option<String>,
        positions: Option<Vec<i64>>,
        step: Option<i64>,
        extra: Option<BTreeMap<String, String>>,
    ) -> PyResult<()> {
        let dtype = DType::parse(dtype).map_err(err)?;
        let attrs = Attributes {
            path,
            mask,
            positions,
            step,
            extra: extra.map(|m| m.into_iter().collect()).unwrap_or_default(),
        };
        if !data.is_c_contiguous() {
            return Err(TraceError::new_err(format!(
                "tensor {name:?}: payload buffer is not contiguous"
            )));
        }
        // SAFETY: a C-contiguous u8 buffer of len_bytes bytes, held by `data` for this call;
        // the GIL is held, so no Python code can resize it meanwhile.
        let bytes =
            unsafe { std::slice::from_raw_parts(data.buf_ptr() as *const u8, data.len_bytes()) };
        self.with(|w| w.tensor(name, dtype, &shape, bytes, &attrs))
    }

    #[pyo3(signature = (name, shape, values, margins=None))]
    fn decision(
        &self,
        name: &str,
        shape: Vec<u64>,
        values: Vec<i64>,
        margins: Option<Vec<f32>>,
    ) -> PyResult<()> {
        self.with(|w| w.decision(name, &shape, &values, margins.as_deref()))
    }

    fn finish(&self) -> PyResult<String> {
        let w = self
            .inner
            .lock()
            .map_err(|_| TraceError::new_err("writer lock poisoned"))?
            .take()
            .ok_or_else(|| TraceError::new_err("trace writer is already finished or aborted"))?;
        w.finish().map(|d| d.hex()).map_err(err)
    }

    /// Drops the unfinished trace: nothing is left at the final path or in the temp file.
    fn abort(&self) -> PyResult<()> {
        if let Ok(mut g) = self.inner.lock() {
            g.take();
        }
        Ok(())
    }
}

#[pyclass(module = "tracegate._native", frozen)]
struct NativeTrace {
    inner: Arc<Trace>,
}

/// A read-only buffer over one payload inside the map; keeps the map alive.
#[pyclass(module = "tracegate._native", frozen)]
struct Payload {
    trace: Arc<Trace>,
    offset: usize,
    len: usize,
}

#[pymethods]
impl Payload {
    unsafe fn __getbuffer__(
        slf: Bound<'_, Self>,
        view: *mut pyo3::ffi::Py_buffer,
        flags: c_int,
    ) -> PyResult<()> {
        if view.is_null() {
            return Err(pyo3::exceptions::PyBufferError::new_err("null view"));
        }
        if flags & pyo3::ffi::PyBUF_WRITABLE == pyo3::ffi::PyBUF_WRITABLE {
            return Err(pyo3::exceptions::PyBufferError::new_err(
                "trace payloads are read-only",
            ));
        }
        let me = slf.get();
        let base: &[u8] = me.trace.raw_map();
        // Empty payloads still need a valid pointer.
        let ptr = if me.len == 0 {
            base.as_ptr()
        } else {
            base[me.offset..me.offset + me.len].as_ptr()
        };
        // SAFETY: the buffer points into the map owned by `me.trace`, which lives as long as
        // `slf` (PyBuffer_FillInfo takes a reference to it); the buffer is marked read-only.
        let rc = unsafe {
            pyo3::ffi::PyBuffer_FillInfo(
                view,
                slf.as_ptr(),
                ptr as *mut c_void,
                me.len as isize,
                1,
                flags,
            )
        };
        if rc != 0 {
            return Err(PyErr::fetch(slf.py()));
        }
        Ok(())
    }

    unsafe fn __releasebuffer__(&self, _view: *mut pyo3::ffi::Py_buffer) {}
}

fn attrs_json(a: &Attributes) -> String {
    let mut map = serde_json::Map::new();
    if let Some(p) = &a.path {
        map.insert("path".into(), p.clone().into());
    }
    if let Some(m) = &a.mask {
        map.insert("mask".into(), m.clone().into());
    }
    if let Some(p) = &a.positions {
        map.insert("positions".into(), p.clone().into());
    }
    if let Some(s) = a.step {
        map.insert("step".into(), s.into());
    }
    for (k, v) in &a.extra {
        map.insert(k.clone(), v.clone().into());
    }
    serde_json::Value::Object(map).to_string()
}

#[pymethods]
impl NativeTrace {
    #[new]
    fn new(py: Python<'_>, path: PathBuf) -> PyResult<Self> {
        let t = py.detach(|| Trace::open(&path)).map_err(err)?;
        Ok(NativeTrace { inner: Arc::new(t) })
    }

    /// Tensor names in capture order: the one per-tensor list the Python side holds (dtype and
    /// shape are asked for by name), so a large index costs one string a tensor in Python.
    fn names<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        PyList::new(py, self.inner.tensors().iter().map(|t| t.name.as_str()))
    }

    fn count(&self) -> usize {
        self.inner.tensors().len()
    }

    fn contains(&self, name: &str) -> bool {
        self.inner.tensor_info(name).is_some()
    }

    /// (dtype, shape) of one tensor.
    fn meta(&self, name: &str) -> PyResult<(&'static str, Vec<u64>)> {
        let t = self
            .inner
            .tensor_info(name)
            .ok_or_else(|| pyo3::exceptions::PyKeyError::new_err(name.to_string()))?;
        Ok((t.dtype.name(), t.shape.clone()))
    }

    fn payload(&self, name: &str) -> PyResult<Payload> {
        let t = self
            .inner
            .tensor_info(name)
            .ok_or_else(|| pyo3::exceptions::PyKeyError::new_err(name.to_string()))?;
        // A page past a new end of file would raise SIGBUS when numpy reads it.
        self.inner.check_size().map_err(err)?;
        Ok(Payload {
            trace: self.inner.clone(),
            offset: t.offset as usize,
            len: t.nbytes as usize,
        })
    }

    fn attributes_json(&self, name: &str) -> PyResult<String> {
        let t = self
            .inner
            .tensor_info(name)
            .ok_or_else(|| pyo3::exceptions::PyKeyError::new_err(name.to_string()))?;
        Ok(attrs_json(&t.attributes))
    }

    fn tensor_digest(&self, name: &str) -> PyResult<String> {
        let t = self
            .inner
            .tensor_info(name)
            .ok_or_else(|| pyo3::exceptions::PyKeyError::new_err(name.to_string()))?;
        Ok(tracegate_trace::xxh3_hex(t.digest))
    }

    /// (name, shape, values as little-endian i64 bytes, margins as little-endian f32 bytes or None).
    #[allow(clippy::type_complexity)]
    fn decisions<'py>(
        &self,
        py: Python<'py>,
    ) -> PyResult<
        Vec<(
            String,
            Vec<u64>,
            Bound<'py, PyBytes>,
            Option<Bound<'py, PyBytes>>,
        )>,
    > {
        self.inner.check_size().map_err(err)?;
        Ok(self
            .inner
            .decisions()
            .iter()
            .map(|d| {
                let values: Vec<u8> = self
                    .inner
                    .decision_values(d)
                    .iter()
                    .flat_map(|v| v.to_le_bytes())
                    .collect();
                let margins = self.inner.decision_margins(d).map(|m| {
                    PyBytes::new(
                        py,
                        &m.iter().flat_map(|v| v.to_le_bytes()).collect::<Vec<u8>>(),
                    )
                });
                (
                    d.name.clone(),
                    d.shape.clone(),
                    PyBytes::new(py, &values),
                    margins,
                )
            })
            .collect())
    }

    fn provenance_json(&self) -> String {
        self.inner.provenance().to_string()
    }

    fn digest(&self) -> String {
        self.inner.digest().hex()
    }

    fn version(&self) -> (u16, u16) {
        self.inner.version()
    }

    fn verify(&self, py: Python<'_>) -> PyResult<()> {
        let t = self.inner.clone();
        py.detach(move || t.verify()).map_err(err)
    }
}

#[pyfunction]
fn weights_digest(py: Python<'_>, model_dir: PathBuf) -> PyResult<String> {
    py.detach(|| tracegate_trace::weights_digest(&model_dir))
        .map_err(err)
}

/// The outcome of [`compare`]: the differ's own report, serialised on demand.
#[pyclass(module = "tracegate._native", frozen)]
struct NativeReport {
    inner: tracegate_diff::Report,
}

#[pymethods]
impl NativeReport {
    /// The report as `trace-diff --json` prints it (docs/diff-report.schema.json).
    fn to_json(&self) -> PyResult<String> {
        let mut out = Vec::new();
        tracegate_diff::write_json(&self.inner, &mut out)
            .map_err(|e| CompareError::new_err(format!("cannot serialise the report: {e}")))?;
        String::from_utf8(out)
            .map_err(|e| CompareError::new_err(format!("report is not UTF-8: {e}")))
    }

    /// Writes the `trace-diff --html` page of this report to `path`.
    fn write_html(&self, py: Python<'_>, path: PathBuf) -> PyResult<()> {
        py.detach(|| tracegate_diff::write_html(&self.inner, &path))
            .map_err(|e| pyo3::exceptions::PyOSError::new_err(format!("{}: {e}", path.display())))
    }

    /// The human report, as `trace-diff` prints it.
    fn to_text(&self) -> String {
        tracegate_diff::render_human(&self.inner)
    }

    fn exit_code(&self) -> i32 {
        self.inner.exit_code()
    }
}

/// `trace-diff REFERENCE CANDIDATE [--policy P] [--all] [--only GLOB...] [--skip GLOB...]`,
/// in-process. An unreadable or tampered trace raises TraceError, a bad policy or a filter
/// that selects nothing CompareError; every other outcome (incomparable included) is a report.
#[pyfunction]
#[pyo3(signature = (reference, candidate, policy=None, all=false, only=None, skip=None))]
fn compare(
    py: Python<'_>,
    reference: PathBuf,
    candidate: PathBuf,
    policy: Option<String>,
    all: bool,
    only: Option<Vec<String>>,
    skip: Option<Vec<String>>,
) -> PyResult<NativeReport> {
    use tracegate_diff::{Filter, Options, Policy, Verdict};
    let policy = match policy {
        None => None,
        Some(p) => Some(
            Policy::resolve(&p, std::path::Path::new(""))
                .map_err(|e| CompareError::new_err(format!("bad policy: {e}")))?,
        ),
    };
    let opts = Options {
        all,
        policy,
        filter: Filter {
            only: only.unwrap_or_default(),
            skip: skip.unwrap_or_default(),
        },
        ..Options::default()
    };
    let report = py.detach(|| tracegate_diff::compare_files(&reference, &candidate, &opts));
    if report.verdict == Verdict::Unreadable {
        let why: Vec<String> = report.findings.iter().map(|f| f.detail.clone()).collect();
        let why = why.join("; ");
        return Err(
            if report.findings.iter().any(|f| f.kind == "nothing_selected") {
                CompareError::new_err(why)
            } else {
                TraceError::new_err(why)
            },
        );
    }
    Ok(NativeReport { inner: report })
}

#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("TraceError", m.py().get_type::<TraceError>())?;
    m.add("CompareError", m.py().get_type::<CompareError>())?;
    m.add_class::<NativeReport>()?;
    m.add_function(wrap_pyfunction!(compare, m)?)?;
    m.add_class::<NativeWriter>()?;
    m.add_class::<NativeTrace>()?;
    m.add_class::<Payload>()?;
    m.add_function(wrap_pyfunction!(weights_digest, m)?)?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    m.add(
        "FORMAT_VERSION",
        (tracegate_trace::FORMAT_MAJOR, tracegate_trace::FORMAT_MINOR),
    )?;
    Ok(())
}
