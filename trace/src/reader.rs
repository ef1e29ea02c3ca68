use std::fs::File;
use std::io::{BufRead, BufReader, Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};

use memmap2::Mmap;
use rayon::prelude::*;
use serde_json::Value;
use xxhash_rust::xxh3::{xxh3_128, Xxh3};

use crate::attrs::Attributes;
use crate::canonical::Canonical;
use crate::digest::{parse_xxh3_hex, Digest};
use crate::dtype::{element_count, first_bad_bool, DType};
use crate::error::{
    Entry, Error, KeyPlace, Malformed, Overflow, Payload, Resized, Result, Tampered,
};
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

/// Alignment, inside the data region `64..index_offset`, no overflow.
fn check_range(
    payload: impl Fn() -> Payload,
    offset: u64,
    nbytes: u64,
    index_offset: u64,
) -> std::result::Result<(), Malformed> {
    let end = offset
        .checked_add(nbytes)
        .ok_or_else(|| Malformed::RangeOverflow {
            payload: payload(),
            offset,
            nbytes,
        })?;
    if !offset.is_multiple_of(ALIGN) {
        return Err(Malformed::Misaligned {
            payload: payload(),
            offset,
        });
    }
    if offset < HEADER_LEN || end > index_offset {
        return Err(Malformed::OutsideData {
            payload: payload(),
            start: offset,
            end,
            index_offset,
        });
    }
    Ok(())
}

fn check_rank(entry: impl Fn() -> Entry, shape: &[u64]) -> std::result::Result<(), Malformed> {
    if shape.len() > MAX_RANK {
        return Err(Malformed::RankTooHigh {
            entry: entry(),
            rank: shape.len(),
        });
    }
    Ok(())
}

fn check_xxh3(entry: impl Fn() -> Entry, xxh3: &str) -> std::result::Result<u128, Malformed> {
    parse_xxh3_hex(xxh3).ok_or_else(|| Malformed::BadXxh3 {
        entry: entry(),
        xxh3: xxh3.to_string(),
    })
}

fn tensor_entry(t: TensorJson, index_offset: u64) -> std::result::Result<TensorInfo, Malformed> {
    check_name("tensor", &t.name).map_err(|reason| Malformed::BadName { reason })?;
    let tensor = || t.name.clone();
    let dtype = DType::parse(&t.dtype).map_err(|unknown| Malformed::BadDtype {
        tensor: tensor(),
        unknown,
    })?;
    check_rank(|| Entry::Tensor(tensor()), &t.shape)?;
    let needed = element_count(&t.shape)
        .and_then(|n| n.checked_mul(dtype.size() as u64))
        .ok_or_else(|| {
            Malformed::ShapeOverflow(Overflow::TensorBytes {
                tensor: tensor(),
                shape: t.shape.to_vec(),
                size: dtype.size(),
            })
        })?;
    if needed != t.nbytes {
        return Err(Malformed::NbytesMismatch {
            tensor: tensor(),
            nbytes: t.nbytes,
            shape: t.shape.to_vec(),
            dtype,
            needed,
        });
    }
    check_range(
        || Payload::Tensor(tensor()),
        t.offset,
        t.nbytes,
        index_offset,
    )?;
    let digest = check_xxh3(|| Entry::Tensor(tensor()), &t.xxh3)?;
    if let Some(duplicate) = &t.attributes.duplicate {
        return Err(Malformed::DuplicateKey {
            place: KeyPlace::Attributes(tensor()),
            duplicate: duplicate.clone(),
        });
    }
    let attributes =
        Attributes::from_json(&t.attributes.value).map_err(|reason| Malformed::BadAttributes {
            tensor: tensor(),
            reason,
        })?;
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

fn decision_entry(
    d: DecisionJson,
    index_offset: u64,
) -> std::result::Result<DecisionInfo, Malformed> {
    check_name("decision", &d.name).map_err(|reason| Malformed::BadName { reason })?;
    let decision = || d.name.clone();
    check_rank(|| Entry::Decision(decision()), &d.shape)?;
    let nbytes = element_count(&d.shape)
        .and_then(|n| n.checked_mul(8))
        .ok_or_else(|| {
            Malformed::ShapeOverflow(Overflow::DecisionValues {
                decision: decision(),
                shape: d.shape.to_vec(),
            })
        })?;
    check_range(
        || Payload::Values(decision()),
        d.values_offset,
        nbytes,
        index_offset,
    )?;
    if let Some(m) = d.margins_offset {
        let rows = d.shape.first().copied().unwrap_or(1);
        let len = rows.checked_mul(4).ok_or_else(|| {
            Malformed::ShapeOverflow(Overflow::DecisionMargins {
                decision: decision(),
            })
        })?;
        check_range(|| Payload::Margins(decision()), m, len, index_offset)?;
    }
    let digest = check_xxh3(|| Entry::Decision(decision()), &d.xxh3)?;
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
    entry: impl Fn(String) -> Entry,
) -> std::result::Result<Vec<u32>, Malformed> {
    let mut order: Vec<u32> = (0..entries.len() as u32).collect();
    order.sort_unstable_by(|&a, &b| name(&entries[a as usize]).cmp(name(&entries[b as usize])));
    for pair in order.windows(2) {
        let n = name(&entries[pair[0] as usize]);
        if n == name(&entries[pair[1] as usize]) {
            return Err(Malformed::DuplicateName {
                entry: entry(n.to_string()),
            });
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
        let bad = |kind: Malformed| Error::Malformed {
            path: path.clone(),
            kind,
        };
        if path
            .file_name()
            .is_some_and(|n| n.to_string_lossy().ends_with(TMP_SUFFIX))
        {
            return Err(bad(Malformed::TemporaryFile));
        }
        // Look before opening: opening a FIFO for reading blocks until something writes to it.
        let meta = std::fs::metadata(&path).map_err(|e| Error::io(&path, e))?;
        if !meta.is_file() {
            return Err(bad(Malformed::NotRegularFile {
                what: file_kind(&meta),
            }));
        }
        let file = File::open(&path).map_err(|e| Error::io(&path, e))?;
        let meta = file.metadata().map_err(|e| Error::io(&path, e))?;
        if !meta.is_file() {
            return Err(bad(Malformed::NotRegularFile {
                what: file_kind(&meta),
            }));
        }
        let len = meta.len();
        if len < HEADER_LEN + FOOTER_LEN {
            return Err(bad(Malformed::TooShort { len }));
        }
        // SAFETY: the map is read-only; a trace is never modified in place after it is renamed
        // into position, and every read below is bounds-checked against the map's length. A
        // file truncated by someone else while mapped is caught by `check_size` before payloads
        // are read (see docs/trace-format.md for the window that remains).
        let map = unsafe { Mmap::map(&file) }.map_err(|e| Error::io(&path, e))?;
        let bytes: &[u8] = &map;
        if bytes.len() as u64 != len {
            return Err(bad(Malformed::SizeChanged(Resized::WhileMapping {
                len,
                mapped: bytes.len() as u64,
            })));
        }
        if &bytes[..8] != MAGIC {
            return Err(bad(Malformed::BadMagic {
                found: bytes[..8].try_into().expect("8 bytes"),
            }));
        }
        let major = u16::from_le_bytes([bytes[8], bytes[9]]);
        let minor = u16::from_le_bytes([bytes[10], bytes[11]]);
        if major != FORMAT_MAJOR {
            return Err(bad(Malformed::UnsupportedVersion { major, minor }));
        }
        if let Some(i) = bytes[12..HEADER_LEN as usize].iter().position(|&b| b != 0) {
            return Err(bad(Malformed::NonZeroHeader {
                at: 12 + i,
                value: bytes[12 + i],
            }));
        }
        let footer = &bytes[(len - FOOTER_LEN) as usize..];
        if &footer[32..40] != FOOTER_MAGIC {
            return Err(bad(Malformed::NoFooter));
        }
        let index_offset = u64::from_le_bytes(footer[0..8].try_into().expect("8 bytes"));
        let index_len = u64::from_le_bytes(footer[8..16].try_into().expect("8 bytes"));
        let index_hash = u128::from_be_bytes(footer[16..32].try_into().expect("16 bytes"));
        let data_end = len - FOOTER_LEN;
        if index_len > MAX_INDEX_LEN {
            return Err(bad(Malformed::IndexTooLong { len: index_len }));
        }
        if index_offset < HEADER_LEN || index_offset.checked_add(index_len) != Some(data_end) {
            return Err(bad(Malformed::IndexMisplaced {
                offset: index_offset,
                len: index_len,
                data_end,
            }));
        }
        if !index_offset.is_multiple_of(ALIGN) {
            return Err(bad(Malformed::IndexMisaligned {
                offset: index_offset,
            }));
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
            n if n != index_len => {
                return Err(bad(Malformed::SizeChanged(Resized::WhileReadingIndex {
                    read: n,
                    footer: index_len,
                })))
            }
            _ => {}
        }
        if hasher.digest128() != index_hash {
            return Err(Error::Tampered {
                path: path.clone(),
                kind: Tampered::IndexDigestMismatch,
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
            (_, Some(kind)) => return Err(bad(kind)),
            (Err(e), None) => {
                return Err(bad(Malformed::BadIndex {
                    reason: e.to_string(),
                }))
            }
            (Ok(head), None) => head,
        };
        let later_minor = minor > FORMAT_MINOR;
        if let Some(field) = unknown.filter(|_| !later_minor) {
            return Err(bad(Malformed::UnknownField {
                field,
                major,
                minor,
            }));
        }
        if head.format != FORMAT_NAME {
            return Err(bad(Malformed::WrongFormat { found: head.format }));
        }
        if head.version != [major, minor] {
            return Err(bad(Malformed::VersionDisagrees {
                index: head.version,
                header: [major, minor],
            }));
        }
        let digest = Some(&head.digest)
            .filter(|d| is_lower_hex(d))
            .and_then(|d| Digest::from_hex(d))
            .ok_or_else(|| {
                bad(Malformed::BadDigest {
                    digest: head.digest.clone(),
                })
            })?;
        if let Some(duplicate) = head.provenance.duplicate {
            return Err(bad(Malformed::DuplicateKey {
                place: KeyPlace::Provenance,
                duplicate,
            }));
        }
        let provenance = head.provenance.value;
        if !provenance.is_object() {
            return Err(bad(Malformed::ProvenanceNotObject));
        }
        tensors.shrink_to_fit();
        decisions.shrink_to_fit();
        let by_name = sorted_by_name(&tensors, |t| &t.name, Entry::Tensor).map_err(&bad)?;
        let decision_by_name =
            sorted_by_name(&decisions, |d| &d.name, Entry::Decision).map_err(&bad)?;

        let ranges = payload_ranges(&tensors, &decisions);
        let payload = |o: Owner| match o {
            Owner::Tensor(i) => Payload::Tensor(tensors[i as usize].name.clone()),
            Owner::Values(i) => Payload::Values(decisions[i as usize].name.clone()),
            Owner::Margins(i) => Payload::Margins(decisions[i as usize].name.clone()),
        };
        for pair in ranges.windows(2) {
            let ((s0, e0, o0), (s1, e1, o1)) = (pair[0], pair[1]);
            if s1 < e0 {
                return Err(bad(Malformed::Overlap {
                    payload: payload(o1),
                    start: s1,
                    end: e1,
                    other: payload(o0),
                    other_start: s0,
                    other_end: e0,
                }));
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
            return Err(self.malformed(Malformed::SizeChanged(Resized::InUse { now, was: mapped })));
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
        self.tampered(Tampered::TensorDigestMismatch {
            tensor: t.name.clone(),
            start: t.offset,
            end: t.offset + t.nbytes,
        })
    }

    pub(crate) fn malformed(&self, kind: Malformed) -> Error {
        Error::Malformed {
            path: self.path.clone(),
            kind,
        }
    }

    fn tampered(&self, kind: Tampered) -> Error {
        Error::Tampered {
            path: self.path.clone(),
            kind,
        }
    }

    fn check_bools(&self, t: &TensorInfo) -> Result<()> {
        if t.dtype != DType::Bool {
            return Ok(());
        }
        match first_bad_bool(self.data(t)) {
            Some((element, value)) => Err(self.malformed(Malformed::BadBool {
                tensor: t.name.clone(),
                element,
                value,
            })),
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
                return Err(self.tampered(Tampered::DecisionDigestMismatch {
                    decision: d.name.clone(),
                }));
            }
            c.decision(&d.name, &d.shape, values, margins);
        }
        let recomputed = c.finish();
        if recomputed != self.digest {
            return Err(self.tampered(Tampered::ContentDigestMismatch {
                recomputed,
                recorded: self.digest,
                payloads_checked,
            }));
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
                let at = start + i as u64;
                return Err(self.tampered(Tampered::NonZeroPadding {
                    at,
                    start,
                    end,
                    value: self.map[at as usize],
                }));
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
