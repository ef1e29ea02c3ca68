//! `tracegate._native`: the Rust container exposed to Python. The numpy-facing API lives in
//! `python/tracegate/__init__.py`; this layer hands out tensors as read-only numpy arrays over
//! the mapped file (through the `numpy` crate) and never panics across the boundary.

use std::collections::BTreeMap;
use std::os::raw::c_void;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use half::{bf16, f16};
use numpy::{PyArrayDyn, PyArrayMethods, PyUntypedArray};
use pyo3::create_exception;
use pyo3::exceptions::PyException;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyList};
use tracegate_trace::ndarray::ArrayViewD;
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

/// A container error as a TraceError: its message unchanged, its kind as `kind` (the
/// variant's name, docs/trace-format.md "Refusals in Python").
fn err(e: tracegate_trace::Error) -> PyErr {
    refused(e.to_string(), error_kind(&e))
}

/// A TraceError with `kind` set; a failure to set it is the error raised instead.
fn refused(message: impl Into<String>, kind: &'static str) -> PyErr {
    let e = TraceError::new_err(message.into());
    Python::attach(|py| match e.value(py).setattr("kind", kind) {
        Ok(()) => e,
        Err(set) => set,
    })
}

/// Every kind's name, from a match the compiler holds complete: a new variant does not build
/// until it is listed here (and binding/tests/test_error_kinds.py wants it in the docs).
macro_rules! error_kinds {
    ($($class:ident: [$($kind:ident),* $(,)?]),* ; $($other:ident),* $(,)?) => {
        fn error_kind(e: &tracegate_trace::Error) -> &'static str {
            use tracegate_trace::Error;
            match e {
                $(Error::$class { kind, .. } => match kind {
                    $(tracegate_trace::$class::$kind { .. } => stringify!($kind),)*
                },)*
                $(Error::$other { .. } => stringify!($other),)*
            }
        }
        /// (kind, what it is: `Malformed`, `Tampered` or `Error` for the container's others).
        const ERROR_KINDS: &[(&str, &str)] = &[
            $($((stringify!($kind), stringify!($class)),)*)*
            $((stringify!($other), "Error"),)*
        ];
    };
}

error_kinds! {
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
    ];
    Io, Invalid, NotFound, WrongDType, NotViewable,
}

fn provenance(json: &str) -> PyResult<serde_json::Value> {
    serde_json::from_str(json)
        .map_err(|e| refused(format!("provenance is not JSON: {e}"), "Invalid"))
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
            .ok_or_else(|| refused("trace writer is already finished or aborted", "Invalid"))?;
        f(w).map_err(err)
    }
}

#[pymethods]
impl NativeWriter {
    #[new]
    fn new(path: PathBuf, provenance_json: &str) -> PyResult<Self> {
        let w = TraceWriter::create(&path, provenance(provenance_json)?).map_err(err)?;
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
        let dtype = DType::parse(dtype).map_err(|e| err(e.into()))?;
        let attrs = Attributes {
            path,
            mask,
            positions,
            step,
            extra: extra.map(|m| m.into_iter().collect()).unwrap_or_default(),
        };
        if !data.is_c_contiguous() {
            return Err(refused(
                format!("tensor {name:?}: payload buffer is not contiguous"),
                "Invalid",
            ));
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

    /// Replaces the provenance: a streaming producer knows all of it only at the end.
    fn set_provenance(&self, provenance_json: &str) -> PyResult<()> {
        let provenance = provenance(provenance_json)?;
        self.with(|w| w.set_provenance(provenance))
    }

    fn finish(&self) -> PyResult<String> {
        let w = self
            .inner
            .lock()
            .map_err(|_| TraceError::new_err("writer lock poisoned"))?
            .take()
            .ok_or_else(|| refused("trace writer is already finished or aborted", "Invalid"))?;
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

/// A read-only numpy array over `view`'s elements, whose `base` is `owner`: the `NativeTrace`
/// that owns the mapping, so the map outlives every array handed out of it. numpy's own
/// refusal (an empty shape whose byte size overflows, such as `[0, 2**62]` of f32) is a
/// ValueError, which the Python layer words as a TraceError naming the tensor and its shape.
fn readonly_array<'py, T: numpy::Element>(
    view: ArrayViewD<'_, T>,
    owner: &Bound<'py, NativeTrace>,
) -> PyResult<Bound<'py, PyUntypedArray>> {
    use numpy::npyffi::{get_type_object, npy_intp, NpyTypes, PY_ARRAY_API};
    use numpy::PyArrayDescrMethods;
    let py = owner.py();
    // ndarray bounds each dimension and stride by isize::MAX, so these casts are exact.
    let mut dims: Vec<npy_intp> = view.shape().iter().map(|&d| d as npy_intp).collect();
    let item = std::mem::size_of::<T>() as npy_intp;
    let mut strides: Vec<npy_intp> = view
        .strides()
        .iter()
        .map(|&s| s as npy_intp * item)
        .collect();
    // SAFETY: `view` points into the map owned by `owner`'s Arc<Trace>, which is never
    // replaced (the class is frozen) and lives as long as the array holds `owner` as its base;
    // flags 0 makes the array read-only, so numpy never writes through the pointer. A null
    // result is numpy's raised error, returned as is, before anything is done with it.
    unsafe {
        let raw = PY_ARRAY_API.PyArray_NewFromDescr(
            py,
            get_type_object(py, NpyTypes::PyArray_Type),
            T::get_dtype(py).into_dtype_ptr(),
            dims.len() as std::os::raw::c_int,
            dims.as_mut_ptr(),
            strides.as_mut_ptr(),
            view.as_ptr() as *mut c_void,
            0,
            std::ptr::null_mut(),
        );
        // (Not PyArray::borrow_from_array: it sets the base of a null array, numpy's refusal.)
        let array = Bound::from_owned_ptr_or_err(py, raw)?.cast_into_unchecked::<PyArrayDyn<T>>();
        // Steals the new reference to `owner`, also when it fails.
        let base = owner.clone().into_any().into_ptr();
        if PY_ARRAY_API.PyArray_SetBaseObject(py, raw.cast(), base) != 0 {
            return Err(PyErr::fetch(py));
        }
        Ok(array.as_untyped().clone())
    }
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

    /// Tensor `name` as a read-only numpy array viewing the mapped file (no copy) with its
    /// shape; the array's `base` is this object, which keeps the mapping alive. bf16 comes as
    /// uint16 bits (numpy has no bf16). KeyError for an unknown name; TraceError for a file
    /// truncated since it was opened (a page past its new end would raise SIGBUS when read).
    fn array<'py>(slf: &Bound<'py, Self>, name: &str) -> PyResult<Bound<'py, PyUntypedArray>> {
        // A shape the view cannot index is numpy's refusal too: a ValueError, worded by the
        // Python layer like numpy's own.
        let err = |e: tracegate_trace::Error| match e {
            tracegate_trace::Error::NotViewable { reason, .. } => {
                pyo3::exceptions::PyValueError::new_err(reason)
            }
            e => err(e),
        };
        let t = &slf.get().inner;
        let info = t
            .tensor_info(name)
            .ok_or_else(|| pyo3::exceptions::PyKeyError::new_err(name.to_string()))?;
        match info.dtype {
            DType::F64 => readonly_array(t.view_of::<f64>(info).map_err(err)?, slf),
            DType::F32 => readonly_array(t.view_of::<f32>(info).map_err(err)?, slf),
            DType::F16 => readonly_array(t.view_of::<f16>(info).map_err(err)?, slf),
            DType::BF16 => {
                let v = t.view_of::<bf16>(info).map_err(err)?;
                // SAFETY: bf16 is a transparent u16 (half's documented layout): same shape,
                // strides and pointer, read as the bits.
                let bits =
                    unsafe { ArrayViewD::from_shape_ptr(v.raw_dim(), v.as_ptr().cast::<u16>()) };
                readonly_array(bits, slf)
            }
            DType::I64 => readonly_array(t.view_of::<i64>(info).map_err(err)?, slf),
            DType::I32 => readonly_array(t.view_of::<i32>(info).map_err(err)?, slf),
            DType::I16 => readonly_array(t.view_of::<i16>(info).map_err(err)?, slf),
            DType::I8 => readonly_array(t.view_of::<i8>(info).map_err(err)?, slf),
            DType::U8 => readonly_array(t.view_of::<u8>(info).map_err(err)?, slf),
            DType::Bool => readonly_array(t.view_of::<bool>(info).map_err(err)?, slf),
        }
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

/// A registry word as Python reads it: `FeedForward` -> `feed_forward`.
fn word(debug: impl std::fmt::Debug) -> String {
    let mut out = String::new();
    for (i, c) in format!("{debug:?}").chars().enumerate() {
        if c.is_ascii_uppercase() && i > 0 {
            out.push('_');
        }
        out.push(c.to_ascii_lowercase());
    }
    out
}

/// The capture-point registry (`tracegate_trace::names::POINTS`), one dict a point in
/// computation order; `tracegate.names.POINTS` is built from it.
#[pyfunction]
fn capture_points(py: Python<'_>) -> PyResult<Bound<'_, PyList>> {
    use tracegate_trace::names::POINTS;
    let out = PyList::empty(py);
    for p in POINTS {
        let d = pyo3::types::PyDict::new(py);
        d.set_item("name", p.name)?;
        d.set_item("scope", word(p.scope))?;
        d.set_item("kind", word(p.kind))?;
        d.set_item("block", word(p.block))?;
        d.set_item("capture", word(p.capture))?;
        d.set_item("token_axis", p.token_axis)?;
        d.set_item("stored", word(p.stored))?;
        d.set_item("needs", word(p.needs))?;
        d.set_item("in_decode", word(p.in_decode))?;
        let shard = pyo3::types::PyDict::new(py);
        shard.set_item("slice_axis", p.shard.slice_axis)?;
        shard.set_item("partial", p.shard.partial)?;
        shard.set_item("experts", p.shard.experts)?;
        d.set_item("shard", shard)?;
        out.append(d)?;
    }
    Ok(out)
}

/// A `shard` attribute value parsed (docs/trace-format.md, "Sharded traces"): `rank`, `world`,
/// `kind` and the kind's fields; a malformed one raises TraceError naming the value and why.
#[pyfunction]
fn parse_shard<'py>(py: Python<'py>, value: &str) -> PyResult<Bound<'py, pyo3::types::PyDict>> {
    use tracegate_trace::ShardKind;
    let s = tracegate_trace::Shard::parse(value)
        .map_err(|e| refused(format!("shard {value:?} is malformed: {e}"), "Invalid"))?;
    let d = pyo3::types::PyDict::new(py);
    d.set_item("rank", s.rank)?;
    d.set_item("world", s.world)?;
    match s.kind {
        ShardKind::Replicated => d.set_item("kind", "replicated")?,
        ShardKind::Partial => d.set_item("kind", "partial")?,
        ShardKind::Slice {
            axis,
            offset,
            length,
            size,
        } => {
            d.set_item("kind", "slice")?;
            d.set_item("axis", axis)?;
            d.set_item("offset", offset)?;
            d.set_item("length", length)?;
            d.set_item("size", size)?;
        }
        ShardKind::Experts { held, of } => {
            d.set_item("kind", "experts")?;
            d.set_item("held", held)?;
            d.set_item("of", of)?;
        }
    }
    Ok(d)
}

/// The registry's families: `model_type` -> the features its layers have.
#[pyfunction]
fn capture_families(py: Python<'_>) -> PyResult<Bound<'_, pyo3::types::PyDict>> {
    let out = pyo3::types::PyDict::new(py);
    for (family, features) in tracegate_trace::names::FAMILIES {
        let words: Vec<String> = features.iter().map(word).collect();
        out.set_item(family, words)?;
    }
    Ok(out)
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
            if report
                .findings
                .iter()
                .any(|f| f.kind == tracegate_diff::FindingKind::NothingSelected)
            {
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
    // Raised by `compare` from its report's findings: no kind (the report words the cause).
    m.py()
        .get_type::<TraceError>()
        .setattr("kind", m.py().None())?;
    m.add("ERROR_KINDS", ERROR_KINDS.to_vec())?;
    m.add_class::<NativeReport>()?;
    m.add_function(wrap_pyfunction!(compare, m)?)?;
    m.add_class::<NativeWriter>()?;
    m.add_class::<NativeTrace>()?;
    m.add_function(wrap_pyfunction!(weights_digest, m)?)?;
    m.add_function(wrap_pyfunction!(capture_points, m)?)?;
    m.add_function(wrap_pyfunction!(capture_families, m)?)?;
    m.add_function(wrap_pyfunction!(parse_shard, m)?)?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    m.add(
        "FORMAT_VERSION",
        (tracegate_trace::FORMAT_MAJOR, tracegate_trace::FORMAT_MINOR),
    )?;
    Ok(())
}
