use std::fs::File;
use std::io::{BufRead, BufReader, Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};

use memmap2::Mmap;
use rayon::prelude::*;
use serde_json::Value;
use xxhash_rust::xxh3::{xxh3_128, Xxh3};

use crate::attrs::Attributes;
use crate::digest::{parse_xxh3_hex, Canonical, Digest};
use crate::dtype::{bad_bool_reason, element_count, first_bad_bool, DType};
use crate::error::{Error, Result};
use crate::index::{parse as parse_index, Sink};
use crate::json::file_kind;
use crate::layout::*;

/// One tensor's index entry.
#[derive(Clone, Debug)]
pub struct TensorInfo {
    pub name: String,
    pub dtype: DType,
    pub shape: Vec<u64>,
    pub offset: u64,
    pub nbytes: u64,
    /// xxh3-128 of the payload bytes.
    pub digest: u128,
    pub attributes: Attributes,
}

impl TensorInfo {
    pub fn element_count(&self) -> u64 {
        self.shape.iter().product()
    }
}

/// One decision's index entry; values are i64 (shape product of them), margins f32 per row.
#[derive(Clone, Debug)]
pub struct DecisionInfo {
    pub name: String,
    pub shape: Vec<u64>,
    pub values_offset: u64,
    pub margins_offset: Option<u64>,
    pub digest: u128,
}

impl DecisionInfo {
    pub fn has_margins(&self) -> bool {
        self.margins_offset.is_some()
    }
    pub fn count(&self) -> u64 {
        self.shape.iter().product()
    }
    /// Rows: the first axis, or 1 for a rank-0 decision.
    pub fn rows(&self) -> u64 {
        self.shape.first().copied().unwrap_or(1)
    }
}

/// A finished trace, memory-mapped. Opening validates the header, footer and the whole index;
/// [`Trace::verify`] additionally re-hashes every payload.
pub struct Trace {
    path: PathBuf,
    /// Kept open so the file's size can be re-checked before pages are touched.
    file: File,
    map: Mmap,
    tensors: Vec<TensorInfo>,
    decisions: Vec<DecisionInfo>,
    /// Indices into `tensors` / `decisions` sorted by name: 4 bytes an entry, not a second
    /// copy of every name.
    by_name: Vec<u32>,
    decision_by_name: Vec<u32>,
    provenance: Value,
    digest: Digest,
    version: (u16, u16),
    index_offset: u64,
}

impl std::fmt::Debug for Trace {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Trace({}, {})", self.path.display(), self.digest.short())
    }
}

/// What a path is, for a refusal of anything but a regular file.
/// `Err` is the reason: alignment, inside the data region `64..index_offset`, no overflow.
fn check_range(
    what: &dyn Fn() -> String,
    offset: u64,
    nbytes: u64,
    index_offset: u64,
) -> std::result::Result<(), String> {
    let end = offset
        .checked_add(nbytes)
        .ok_or_else(|| format!("{}: offset {offset} + {nbytes} bytes overflows", what()))?;
    if !offset.is_multiple_of(ALIGN) {
        return Err(format!(
            "{}: offset {offset} is not {ALIGN}-byte aligned",
            what()
        ));
    }
    if offset < HEADER_LEN || end > index_offset {
        return Err(format!(
            "{}: bytes {offset}..{end} lie outside the data region {HEADER_LEN}..{index_offset}",
            what()
        ));
    }
    Ok(())
}

fn check_rank(what: &dyn Fn() -> String, shape: &[u64]) -> std::result::Result<(), String> {
    if shape.len() > MAX_RANK {
        return Err(format!(
            "{}: rank {} exceeds {MAX_RANK}",
            what(),
            shape.len()
        ));
    }
    Ok(())
}

fn tensor_entry(t: TensorJson, index_offset: u64) -> std::result::Result<TensorInfo, String> {
    check_name("tensor", &t.name)?;
    let what = || format!("tensor {:?}", t.name);
    let dtype = DType::parse(&t.dtype).map_err(|e| format!("{}: {e}", what()))?;
    check_rank(&what, &t.shape)?;
    let expected = element_count(&t.shape)
        .and_then(|n| n.checked_mul(dtype.size() as u64))
        .ok_or_else(|| {
            format!(
                "{}: shape {:?} x {} bytes overflows",
                what(),
                t.shape,
                dtype.size()
            )
        })?;
    if expected != t.nbytes {
        return Err(format!(
            "{}: nbytes {} but shape {:?} of {dtype} needs {expected}",
            what(),
            t.nbytes,
            t.shape
        ));
    }
    check_range(&what, t.offset, t.nbytes, index_offset)?;
    let digest = parse_xxh3_hex(&t.xxh3).ok_or_else(|| {
        format!(
            "{}: xxh3 {:?} is not 32 lowercase hex digits",
            what(),
            t.xxh3
        )
    })?;
    if let Some(dup) = &t.attributes.duplicate {
        return Err(format!("{}: attributes: {dup}", what()));
    }
    let attributes =
        Attributes::from_json(&t.attributes.value).map_err(|e| format!("{}: {e}", what()))?;
    // A fresh exact allocation: shrinking serde's grown one in place keeps its larger chunk.
    let shape = t.shape.to_vec();
    Ok(TensorInfo {
        name: t.name,
        dtype,
        shape,
        offset: t.offset,
        nbytes: t.nbytes,
        digest,
        attributes,
    })
}

fn decision_entry(d: DecisionJson, index_offset: u64) -> std::result::Result<DecisionInfo, String> {
    check_name("decision", &d.name)?;
    let what = || format!("decision {:?}", d.name);
    check_rank(&what, &d.shape)?;
    let nbytes = element_count(&d.shape)
        .and_then(|n| n.checked_mul(8))
        .ok_or_else(|| format!("{}: shape {:?} overflows", what(), d.shape))?;
    check_range(
        &|| format!("{} values", what()),
        d.values_offset,
        nbytes,
        index_offset,
    )?;
    if let Some(m) = d.margins_offset {
        let rows = d.shape.first().copied().unwrap_or(1);
        let len = rows
            .checked_mul(4)
            .ok_or_else(|| format!("{}: rows overflow", what()))?;
        check_range(&|| format!("{} margins", what()), m, len, index_offset)?;
    }
    let digest = parse_xxh3_hex(&d.xxh3).ok_or_else(|| {
        format!(
            "{}: xxh3 {:?} is not 32 lowercase hex digits",
            what(),
            d.xxh3
        )
    })?;
    let shape = d.shape.to_vec();
    Ok(DecisionInfo {
        name: d.name,
        shape,
        values_offset: d.values_offset,
        margins_offset: d.margins_offset,
        digest,
    })
}

/// Entry indices sorted by name; `Err` names the first duplicate.
fn sorted_by_name<T>(
    entries: &[T],
    name: impl Fn(&T) -> &str,
    kind: &str,
) -> std::result::Result<Vec<u32>, String> {
    let mut order: Vec<u32> = (0..entries.len() as u32).collect();
    order.sort_unstable_by(|&a, &b| name(&entries[a as usize]).cmp(name(&entries[b as usize])));
    for pair in order.windows(2) {
        let n = name(&entries[pair[0] as usize]);
        if n == name(&entries[pair[1] as usize]) {
            return Err(format!("duplicate {kind} name {n:?}"));
        }
    }
    Ok(order)
}

fn lookup<'t, T>(
    entries: &'t [T],
    order: &[u32],
    name: impl Fn(&T) -> &str,
    key: &str,
) -> Option<&'t T> {
    order
        .binary_search_by(|&i| name(&entries[i as usize]).cmp(key))
        .ok()
        .map(|at| &entries[order[at] as usize])
}

/// Every non-empty payload as (start, end, what), sorted by start.
fn payload_ranges(tensors: &[TensorInfo], decisions: &[DecisionInfo]) -> Vec<(u64, u64, Owner)> {
    let mut ranges = Vec::new();
    for (i, t) in tensors.iter().enumerate() {
        if t.nbytes > 0 {
            ranges.push((t.offset, t.offset + t.nbytes, Owner::Tensor(i as u32)));
        }
    }
    for (i, d) in decisions.iter().enumerate() {
        if d.count() > 0 {
            ranges.push((
                d.values_offset,
                d.values_offset + d.count() * 8,
                Owner::Values(i as u32),
            ));
        }
        if let Some(m) = d.margins_offset.filter(|_| d.rows() > 0) {
            ranges.push((m, m + d.rows() * 4, Owner::Margins(i as u32)));
        }
    }
    ranges.sort_unstable();
    ranges
}

#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Owner {
    Tensor(u32),
    Values(u32),
    Margins(u32),
}

impl Trace {
    pub fn open(path: impl AsRef<Path>) -> Result<Trace> {
        let path = path.as_ref().to_path_buf();
        let bad = |reason: String| Error::Malformed {
            path: path.clone(),
            reason,
        };
        if path
            .file_name()
            .is_some_and(|n| n.to_string_lossy().ends_with(TMP_SUFFIX))
        {
            return Err(bad(format!(
                "a writer's temporary file (*{TMP_SUFFIX}): the trace was never finished, or its writer is still running"
            )));
        }
        // Look before opening: opening a FIFO for reading blocks until something writes to it.
        let meta = std::fs::metadata(&path).map_err(|e| Error::io(&path, e))?;
        if !meta.is_file() {
            return Err(bad(format!(
                "{}, not a regular file: a trace is one regular file",
                file_kind(&meta)
            )));
        }
        let file = File::open(&path).map_err(|e| Error::io(&path, e))?;
        let meta = file.metadata().map_err(|e| Error::io(&path, e))?;
        if !meta.is_file() {
            return Err(bad(format!(
                "{}, not a regular file: a trace is one regular file",
                file_kind(&meta)
            )));
        }
        let len = meta.len();
        if len < HEADER_LEN + FOOTER_LEN {
            return Err(bad(format!(
                "file is {len} bytes, shorter than header + footer ({})",
                HEADER_LEN + FOOTER_LEN
            )));
        }
        // SAFETY: the map is read-only; a trace is never modified in place after it is renamed
        // into position, and every read below is bounds-checked against the map's length. A
        // file truncated by someone else while mapped is caught by `check_size` before payloads
        // are read (see docs/trace-format.md for the window that remains).
        let map = unsafe { Mmap::map(&file) }.map_err(|e| Error::io(&path, e))?;
        let bytes: &[u8] = &map;
        if bytes.len() as u64 != len {
            return Err(bad(format!(
                "file is {len} bytes but {} were mapped: it changed while being opened",
                bytes.len()
            )));
        }
        if &bytes[..8] != MAGIC {
            return Err(bad(format!(
                "bad magic {:02x?} (expected \"TGTRACE\\0\"): not a tracegate trace",
                &bytes[..8]
            )));
        }
        let major = u16::from_le_bytes([bytes[8], bytes[9]]);
        let minor = u16::from_le_bytes([bytes[10], bytes[11]]);
        if major != FORMAT_MAJOR {
            return Err(bad(format!("format version {major}.{minor} is not supported (this reader reads {FORMAT_MAJOR}.x)")));
        }
        if let Some(i) = bytes[12..HEADER_LEN as usize].iter().position(|&b| b != 0) {
            return Err(bad(format!(
                "header byte {} is {:#04x}: header bytes 12..64 must be zero",
                12 + i,
                bytes[12 + i]
            )));
        }
        let footer = &bytes[(len - FOOTER_LEN) as usize..];
        if &footer[32..40] != FOOTER_MAGIC {
            return Err(bad(
                "no footer: the file is truncated or was never finished".into(),
            ));
        }
        let index_offset = u64::from_le_bytes(footer[0..8].try_into().expect("8 bytes"));
        let index_len = u64::from_le_bytes(footer[8..16].try_into().expect("8 bytes"));
        let index_hash = u128::from_be_bytes(footer[16..32].try_into().expect("16 bytes"));
        let data_end = len - FOOTER_LEN;
        if index_len > MAX_INDEX_LEN {
            return Err(bad(format!(
                "index length {index_len} exceeds the limit {MAX_INDEX_LEN}"
            )));
        }
        if index_offset < HEADER_LEN || index_offset.checked_add(index_len) != Some(data_end) {
            return Err(bad(format!(
                "footer places the index at {index_offset}..+{index_len}, but it must end at the footer ({data_end}) and start after the header"
            )));
        }
        if !index_offset.is_multiple_of(ALIGN) {
            return Err(bad(format!(
                "footer places the index at {index_offset}, which is not {ALIGN}-byte aligned"
            )));
        }
        // The index is hashed and parsed from reads of the file, not through the map: parsed
        // entries are what the reader keeps, and the index's own pages need not stay resident.
        let index_reader = || {
            let mut f = &file;
            f.seek(SeekFrom::Start(index_offset))
                .map(|_| BufReader::with_capacity(1 << 16, f.take(index_len)))
        };
        let mut hasher = Xxh3::new();
        let hashed = index_reader().and_then(|mut r| {
            let mut n = 0u64;
            loop {
                let chunk = r.fill_buf()?;
                if chunk.is_empty() {
                    return Ok(n);
                }
                hasher.update(chunk);
                let k = chunk.len();
                n += k as u64;
                r.consume(k);
            }
        });
        match hashed.map_err(|e| Error::io(&path, e))? {
            n if n != index_len => return Err(bad(format!("index is {n} bytes on reading, {index_len} in the footer: the file changed while being opened"))),
            _ => {}
        }
        if hasher.digest128() != index_hash {
            return Err(Error::Tampered {
                path: path.clone(),
                reason: "the index does not match the footer's xxh3-128".into(),
            });
        }
        // One pass that notes the first field the schema does not have. A later minor version
        // only adds optional fields, which this reader may ignore; in a version it knows
        // completely, such a field is damage, not news.
        let mut unknown: Option<String> = None;
        let mut tensors = Vec::new();
        let mut decisions = Vec::new();
        let mut on_tensor =
            |t: TensorJson| tensor_entry(t, index_offset).map(|info| tensors.push(info));
        let mut on_decision =
            |d: DecisionJson| decision_entry(d, index_offset).map(|info| decisions.push(info));
        let mut sink = Sink {
            tensor: &mut on_tensor,
            decision: &mut on_decision,
            refusal: None,
        };
        let mut json =
            serde_json::Deserializer::from_reader(index_reader().map_err(|e| Error::io(&path, e))?);
        let parsed = parse_index(
            serde_ignored::Deserializer::new(&mut json, &mut |p: serde_ignored::Path| {
                unknown.get_or_insert_with(|| unknown_field(&p));
            }),
            &mut sink,
        )
        .and_then(|head| json.end().map(|_| head));
        let refusal = sink.refusal.take();
        let head = match (parsed, refusal) {
            (_, Some(reason)) => return Err(bad(reason)),
            (Err(e), None) => return Err(bad(format!("index is not valid: {e}"))),
            (Ok(head), None) => head,
        };
        let later_minor = minor > FORMAT_MINOR;
        if let Some(field) = unknown.filter(|_| !later_minor) {
            return Err(bad(format!("index is not valid: unknown field {field} (format {major}.{minor} has no such field)")));
        }
        if head.format != FORMAT_NAME {
            return Err(bad(format!(
                "index format {:?} is not {FORMAT_NAME:?}",
                head.format
            )));
        }
        if head.version != [major, minor] {
            return Err(bad(format!(
                "index version {}.{} disagrees with header {major}.{minor}",
                head.version[0], head.version[1]
            )));
        }
        let digest = Some(&head.digest)
            .filter(|d| is_lower_hex(d))
            .and_then(|d| Digest::from_hex(d))
            .ok_or_else(|| {
                bad(format!(
                    "digest {:?} is not 64 lowercase hex digits",
                    head.digest
                ))
            })?;
        if let Some(dup) = &head.provenance.duplicate {
            return Err(bad(format!("provenance: {dup}")));
        }
        let provenance = head.provenance.value;
        if !provenance.is_object() {
            return Err(bad("provenance is not a JSON object".into()));
        }
        tensors.shrink_to_fit();
        decisions.shrink_to_fit();
        let by_name = sorted_by_name(&tensors, |t| &t.name, "tensor").map_err(&bad)?;
        let decision_by_name = sorted_by_name(&decisions, |d| &d.name, "decision").map_err(&bad)?;

        let ranges = payload_ranges(&tensors, &decisions);
        let what = |o: Owner| match o {
            Owner::Tensor(i) => format!("tensor {:?}", tensors[i as usize].name),
            Owner::Values(i) => format!("decision {:?} values", decisions[i as usize].name),
            Owner::Margins(i) => format!("decision {:?} margins", decisions[i as usize].name),
        };
        for pair in ranges.windows(2) {
            let ((s0, e0, o0), (s1, e1, o1)) = (pair[0], pair[1]);
            if s1 < e0 {
                return Err(bad(format!(
                    "{} (bytes {s1}..{e1}) overlaps {} (bytes {s0}..{e0})",
                    what(o1),
                    what(o0)
                )));
            }
        }
        drop(ranges);

        Ok(Trace {
            path,
            file,
            map,
            tensors,
            decisions,
            by_name,
            decision_by_name,
            provenance,
            digest,
            version: (major, minor),
            index_offset,
        })
    }

    /// Refuses a file whose size changed since it was opened: reading a mapped page past a new
    /// end of file would kill the process with SIGBUS. Call before touching payloads that were
    /// not read since the last check; a truncation after the check is not covered.
    pub fn check_size(&self) -> Result<()> {
        let now = self
            .file
            .metadata()
            .map_err(|e| Error::io(&self.path, e))?
            .len();
        let mapped = self.map.len() as u64;
        if now != mapped {
            return Err(Error::Malformed {
                path: self.path.clone(),
                reason: format!("the file is now {now} bytes but was {mapped} when opened: it was truncated or rewritten while in use"),
            });
        }
        Ok(())
    }

    pub fn path(&self) -> &Path {
        &self.path
    }
    /// The recorded whole-trace content digest ([`Trace::verify`] proves it).
    pub fn digest(&self) -> Digest {
        self.digest
    }
    pub fn version(&self) -> (u16, u16) {
        self.version
    }
    pub fn provenance(&self) -> &Value {
        &self.provenance
    }
    /// Tensors in capture order.
    pub fn tensors(&self) -> &[TensorInfo] {
        &self.tensors
    }
    pub fn tensor_info(&self, name: &str) -> Option<&TensorInfo> {
        lookup(&self.tensors, &self.by_name, |t| &t.name, name)
    }
    /// The payload bytes, zero-copy (offsets were bounds-checked at open).
    pub fn data(&self, info: &TensorInfo) -> &[u8] {
        &self.map[info.offset as usize..(info.offset + info.nbytes) as usize]
    }
    pub(crate) fn tensor_or_err(&self, name: &str) -> Result<&TensorInfo> {
        self.tensor_info(name).ok_or_else(|| {
            Error::NotFound(format!("{}: no tensor named {name:?}", self.path.display()))
        })
    }
    /// A tensor's elements as a zero-copy `&[f32]` ([`Trace::slice`]).
    pub fn f32_slice(&self, name: &str) -> Result<&[f32]> {
        self.slice::<f32>(name)
    }
    pub fn f32_vec(&self, name: &str) -> Result<Vec<f32>> {
        Ok(self.f32_slice(name)?.to_vec())
    }
    pub fn decisions(&self) -> &[DecisionInfo] {
        &self.decisions
    }
    pub fn decision_info(&self, name: &str) -> Option<&DecisionInfo> {
        lookup(&self.decisions, &self.decision_by_name, |d| &d.name, name)
    }
    fn values_bytes(&self, d: &DecisionInfo) -> &[u8] {
        let start = d.values_offset as usize;
        &self.map[start..start + d.count() as usize * 8]
    }
    fn margins_bytes(&self, d: &DecisionInfo) -> Option<&[u8]> {
        d.margins_offset.map(|m| {
            let start = m as usize;
            &self.map[start..start + d.rows() as usize * 4]
        })
    }
    pub fn decision_values(&self, d: &DecisionInfo) -> Vec<i64> {
        self.values_bytes(d)
            .chunks_exact(8)
            .map(|c| i64::from_le_bytes(c.try_into().expect("8 bytes")))
            .collect()
    }
    pub fn decision_margins(&self, d: &DecisionInfo) -> Option<Vec<f32>> {
        self.margins_bytes(d).map(|m| {
            m.chunks_exact(4)
                .map(|c| f32::from_le_bytes(c.try_into().expect("4 bytes")))
                .collect()
        })
    }

    /// Recomputes every payload digest (in parallel) and the whole-trace digest; the first
    /// mismatch in capture order is named.
    pub fn verify(&self) -> Result<()> {
        self.check_size()?;
        let bad_tensor = self
            .tensors
            .par_iter()
            .map(|t| xxh3_128(self.data(t)) != t.digest)
            .collect::<Vec<bool>>();
        if let Some(i) = bad_tensor.iter().position(|&b| b) {
            return Err(self.tampered_tensor(&self.tensors[i]));
        }
        for t in self.tensors.iter().filter(|t| t.dtype == DType::Bool) {
            self.check_bools(t)?;
        }
        self.verify_all_but_tensors(true)
    }

    /// Everything [`Trace::verify`] checks but the tensors' payloads: the decisions' bytes, the
    /// content digest recomputed from the index (so every recorded per-tensor digest is the
    /// producer's) and the padding. With [`Trace::verify_tensor`] on each tensor read, a reader
    /// that stops early has verified what it read (trace-diff, docs/diff.md).
    pub fn verify_index(&self) -> Result<()> {
        self.check_size()?;
        self.verify_all_but_tensors(false)
    }

    /// One tensor's payload against its recorded xxh3-128 (and its `bool` bytes).
    pub fn verify_tensor(&self, t: &TensorInfo) -> Result<()> {
        self.check_size()?;
        if xxh3_128(self.data(t)) != t.digest {
            return Err(self.tampered_tensor(t));
        }
        self.check_bools(t)
    }

    fn tampered_tensor(&self, t: &TensorInfo) -> Error {
        Error::Tampered {
            path: self.path.clone(),
            reason: format!(
                "tensor {:?} (bytes {}..{}) no longer matches its xxh3-128",
                t.name,
                t.offset,
                t.offset + t.nbytes
            ),
        }
    }

    fn check_bools(&self, t: &TensorInfo) -> Result<()> {
        if t.dtype != DType::Bool {
            return Ok(());
        }
        match first_bad_bool(self.data(t)) {
            Some((i, b)) => Err(Error::Malformed {
                path: self.path.clone(),
                reason: bad_bool_reason(&t.name, i, b),
            }),
            None => Ok(()),
        }
    }

    /// Decisions, content digest and padding; `payloads_checked`: every tensor's payload was
    /// verified first (then a digest mismatch can only be the index's).
    fn verify_all_but_tensors(&self, payloads_checked: bool) -> Result<()> {
        let mut c = Canonical::new(self.tensors.len());
        for t in &self.tensors {
            c.tensor(&t.name, t.dtype, &t.shape, &t.attributes, t.digest);
        }
        c.begin_decisions(self.decisions.len());
        for d in &self.decisions {
            let values = self.values_bytes(d);
            let margins = self.margins_bytes(d);
            let mut h = Xxh3::new();
            h.update(values);
            if let Some(m) = margins {
                h.update(m);
            }
            if h.digest128() != d.digest {
                return Err(Error::Tampered {
                    path: self.path.clone(),
                    reason: format!("decision {:?} no longer matches its xxh3-128", d.name),
                });
            }
            c.decision(&d.name, &d.shape, values, margins);
        }
        let recomputed = c.finish();
        if recomputed != self.digest {
            let what = if payloads_checked {
                // Every payload matched its own digest, so what changed is index content (a
                // name, dtype, shape or attribute), which has no second copy to name it by.
                "every payload matches its digest, so the index itself (a name, dtype, shape or attribute) was edited"
            } else {
                "the index (a name, dtype, shape, attribute or recorded tensor digest) was edited"
            };
            return Err(Error::Tampered {
                path: self.path.clone(),
                reason: format!(
                    "content digest is {} but the index records {}: {what}",
                    recomputed.hex(),
                    self.digest.hex()
                ),
            });
        }
        self.check_padding()
    }

    /// Every byte of the data region outside a payload must be zero: such bytes are covered by
    /// no digest, so anything else there is data smuggled past `verify`.
    fn check_padding(&self) -> Result<()> {
        let mut at = HEADER_LEN;
        let mut gaps = Vec::new();
        for (start, end, _) in payload_ranges(&self.tensors, &self.decisions) {
            gaps.push((at, start.max(at)));
            at = at.max(end);
        }
        gaps.push((at, self.index_offset));
        for (start, end) in gaps {
            if let Some(i) = self.map[start as usize..end as usize]
                .iter()
                .position(|&b| b != 0)
            {
                let byte = start + i as u64;
                return Err(Error::Tampered {
                    path: self.path.clone(),
                    reason: format!("padding byte {byte} (in the gap {start}..{end} between payloads) is {:#04x}, not zero", self.map[byte as usize]),
                });
            }
        }
        Ok(())
    }
}

/// An ignored field's path as `"key"` (top level) or `"key" in tensors[0]`.
fn unknown_field(path: &serde_ignored::Path) -> String {
    fn place(p: &serde_ignored::Path, out: &mut String) {
        use serde_ignored::Path::*;
        match p {
            Root => {}
            Seq { parent, index } => {
                place(parent, out);
                out.push_str(&format!("[{index}]"));
            }
            Map { parent, key } => {
                place(parent, out);
                if !out.is_empty() {
                    out.push('.');
                }
                out.push_str(key);
            }
            Some { parent } | NewtypeStruct { parent } | NewtypeVariant { parent } => {
                place(parent, out)
            }
        }
    }
    match path {
        serde_ignored::Path::Map { parent, key } => {
            let mut at = String::new();
            place(parent, &mut at);
            if at.is_empty() {
                format!("{key:?}")
            } else {
                format!("{key:?} in {at}")
            }
        }
        other => other.to_string(),
    }
}
