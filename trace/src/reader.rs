use std::collections::HashMap;
use std::fs::File;
use std::path::{Path, PathBuf};

use memmap2::Mmap;
use rayon::prelude::*;
use serde_json::Value;
use xxhash_rust::xxh3::{xxh3_128, Xxh3};

use crate::attrs::Attributes;
use crate::digest::{parse_xxh3_hex, Canonical, Digest};
use crate::dtype::{element_count, DType};
use crate::error::{Error, Result};
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
    map: Mmap,
    tensors: Vec<TensorInfo>,
    decisions: Vec<DecisionInfo>,
    by_name: HashMap<String, usize>,
    decision_by_name: HashMap<String, usize>,
    provenance: Value,
    digest: Digest,
    version: (u16, u16),
}

impl std::fmt::Debug for Trace {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Trace({}, {})", self.path.display(), self.digest.short())
    }
}

impl Trace {
    pub fn open(path: impl AsRef<Path>) -> Result<Trace> {
        let path = path.as_ref().to_path_buf();
        let file = File::open(&path).map_err(|e| Error::io(&path, e))?;
        let meta = file.metadata().map_err(|e| Error::io(&path, e))?;
        let bad = |reason: String| Error::Malformed { path: path.clone(), reason };
        if !meta.is_file() {
            return Err(bad("not a regular file (a trace is one file; is this a directory?)".into()));
        }
        let len = meta.len();
        if len < HEADER_LEN + FOOTER_LEN {
            return Err(bad(format!("file is {len} bytes, shorter than header + footer ({})", HEADER_LEN + FOOTER_LEN)));
        }
        // SAFETY: the map is read-only; a trace is never modified in place after it is renamed
        // into position, and every read below is bounds-checked against the map's length.
        let map = unsafe { Mmap::map(&file) }.map_err(|e| Error::io(&path, e))?;
        let bytes: &[u8] = &map;
        if &bytes[..8] != MAGIC {
            return Err(bad(format!("bad magic {:02x?} (expected \"TGTRACE\\0\"): not a tracegate trace", &bytes[..8])));
        }
        let major = u16::from_le_bytes([bytes[8], bytes[9]]);
        let minor = u16::from_le_bytes([bytes[10], bytes[11]]);
        if major != FORMAT_MAJOR {
            return Err(bad(format!("format version {major}.{minor} is not supported (this reader reads {FORMAT_MAJOR}.x)")));
        }
        let footer = &bytes[(len - FOOTER_LEN) as usize..];
        if &footer[32..40] != FOOTER_MAGIC {
            return Err(bad("no footer: the file is truncated or was never finished".into()));
        }
        let index_offset = u64::from_le_bytes(footer[0..8].try_into().expect("8 bytes"));
        let index_len = u64::from_le_bytes(footer[8..16].try_into().expect("8 bytes"));
        let index_hash = u128::from_be_bytes(footer[16..32].try_into().expect("16 bytes"));
        let data_end = len - FOOTER_LEN;
        if index_len > MAX_INDEX_LEN {
            return Err(bad(format!("index length {index_len} exceeds the limit {MAX_INDEX_LEN}")));
        }
        if index_offset < HEADER_LEN || index_offset.checked_add(index_len) != Some(data_end) {
            return Err(bad(format!(
                "footer places the index at {index_offset}..+{index_len}, but it must end at the footer ({data_end}) and start after the header"
            )));
        }
        let index_bytes = &bytes[index_offset as usize..data_end as usize];
        if xxh3_128(index_bytes) != index_hash {
            return Err(Error::Tampered { path: path.clone(), reason: "the index does not match the footer's xxh3-128".into() });
        }
        // One pass that notes the first field the schema does not have. A later minor version
        // only adds optional fields, which this reader may ignore; in a version it knows
        // completely, such a field is damage, not news.
        let mut unknown: Option<String> = None;
        let index: IndexJson = serde_ignored::deserialize(&mut serde_json::Deserializer::from_slice(index_bytes), |path| {
            unknown.get_or_insert_with(|| unknown_field(&path));
        })
        .map_err(|e| bad(format!("index is not valid: {e}")))?;
        let later_minor = minor > FORMAT_MINOR;
        if let Some(field) = unknown.filter(|_| !later_minor) {
            return Err(bad(format!("index is not valid: unknown field {field} (format {major}.{minor} has no such field)")));
        }
        if index.format != FORMAT_NAME {
            return Err(bad(format!("index format {:?} is not {FORMAT_NAME:?}", index.format)));
        }
        if index.version[0] != major {
            return Err(bad(format!("index version {}.{} disagrees with header {major}.{minor}", index.version[0], index.version[1])));
        }
        let digest = Digest::from_hex(&index.digest).ok_or_else(|| bad(format!("digest {:?} is not 64 hex digits", index.digest)))?;
        if !index.provenance.is_object() {
            return Err(bad("provenance is not a JSON object".into()));
        }

        // Every payload range must lie in the data region and no two may overlap.
        let mut ranges: Vec<(u64, u64, String)> = Vec::new();
        let mut check_range = |what: &str, offset: u64, nbytes: u64| -> Result<()> {
            let end = offset.checked_add(nbytes).ok_or_else(|| bad(format!("{what}: offset {offset} + {nbytes} bytes overflows")))?;
            if !offset.is_multiple_of(ALIGN) {
                return Err(bad(format!("{what}: offset {offset} is not {ALIGN}-byte aligned")));
            }
            if offset < HEADER_LEN || end > index_offset {
                return Err(bad(format!("{what}: bytes {offset}..{end} lie outside the data region {HEADER_LEN}..{index_offset}")));
            }
            if nbytes > 0 {
                ranges.push((offset, end, what.to_string()));
            }
            Ok(())
        };

        let mut tensors = Vec::with_capacity(index.tensors.len());
        let mut by_name = HashMap::with_capacity(index.tensors.len());
        for t in index.tensors {
            let what = format!("tensor {:?}", t.name);
            if t.name.is_empty() {
                return Err(bad("a tensor has an empty name".into()));
            }
            let dtype = DType::parse(&t.dtype).map_err(|e| bad(format!("{what}: {e}")))?;
            if t.shape.len() > MAX_RANK {
                return Err(bad(format!("{what}: rank {} exceeds {MAX_RANK}", t.shape.len())));
            }
            let expected = element_count(&t.shape)
                .and_then(|n| n.checked_mul(dtype.size() as u64))
                .ok_or_else(|| bad(format!("{what}: shape {:?} x {} bytes overflows", t.shape, dtype.size())))?;
            if expected != t.nbytes {
                return Err(bad(format!("{what}: nbytes {} but shape {:?} of {dtype} needs {expected}", t.nbytes, t.shape)));
            }
            check_range(&what, t.offset, t.nbytes)?;
            let digest = parse_xxh3_hex(&t.xxh3).ok_or_else(|| bad(format!("{what}: xxh3 {:?} is not 32 hex digits", t.xxh3)))?;
            let attributes = Attributes::from_json(&t.attributes).map_err(|e| bad(format!("{what}: {e}")))?;
            if by_name.insert(t.name.clone(), tensors.len()).is_some() {
                return Err(bad(format!("duplicate tensor name {:?}", t.name)));
            }
            tensors.push(TensorInfo { name: t.name, dtype, shape: t.shape, offset: t.offset, nbytes: t.nbytes, digest, attributes });
        }

        let mut decisions = Vec::with_capacity(index.decisions.len());
        let mut decision_by_name = HashMap::with_capacity(index.decisions.len());
        for d in index.decisions {
            let what = format!("decision {:?}", d.name);
            if d.name.is_empty() {
                return Err(bad("a decision has an empty name".into()));
            }
            if d.shape.len() > MAX_RANK {
                return Err(bad(format!("{what}: rank {} exceeds {MAX_RANK}", d.shape.len())));
            }
            let nbytes = element_count(&d.shape)
                .and_then(|n| n.checked_mul(8))
                .ok_or_else(|| bad(format!("{what}: shape {:?} overflows", d.shape)))?;
            check_range(&format!("{what} values"), d.values_offset, nbytes)?;
            if let Some(m) = d.margins_offset {
                let rows = d.shape.first().copied().unwrap_or(1);
                check_range(&format!("{what} margins"), m, rows.checked_mul(4).ok_or_else(|| bad(format!("{what}: rows overflow")))?)?;
            }
            let digest = parse_xxh3_hex(&d.xxh3).ok_or_else(|| bad(format!("{what}: xxh3 {:?} is not 32 hex digits", d.xxh3)))?;
            if decision_by_name.insert(d.name.clone(), decisions.len()).is_some() {
                return Err(bad(format!("duplicate decision name {:?}", d.name)));
            }
            decisions.push(DecisionInfo { name: d.name, shape: d.shape, values_offset: d.values_offset, margins_offset: d.margins_offset, digest });
        }

        ranges.sort();
        for pair in ranges.windows(2) {
            if pair[1].0 < pair[0].1 {
                return Err(bad(format!("{} (bytes {}..{}) overlaps {} (bytes {}..{})", pair[1].2, pair[1].0, pair[1].1, pair[0].2, pair[0].0, pair[0].1)));
            }
        }

        Ok(Trace {
            path,
            map,
            tensors,
            decisions,
            by_name,
            decision_by_name,
            provenance: index.provenance,
            digest,
            version: (major, minor),
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }
    /// The whole mapped file (for bindings that hand out views into it).
    pub fn raw_map(&self) -> &[u8] {
        &self.map
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
        self.by_name.get(name).map(|&i| &self.tensors[i])
    }
    /// The payload bytes, zero-copy (offsets were bounds-checked at open).
    pub fn data(&self, info: &TensorInfo) -> &[u8] {
        &self.map[info.offset as usize..(info.offset + info.nbytes) as usize]
    }
    fn tensor_or_err(&self, name: &str) -> Result<&TensorInfo> {
        self.tensor_info(name)
            .ok_or_else(|| Error::NotFound(format!("{}: no tensor named {name:?}", self.path.display())))
    }
    /// A tensor's bytes as a zero-copy `&[f32]` (payloads are 64-byte aligned in the map).
    pub fn f32_slice(&self, name: &str) -> Result<&[f32]> {
        let info = self.tensor_or_err(name)?;
        if info.dtype != DType::F32 {
            return Err(Error::Invalid(format!("tensor {name:?} is {}, not f32", info.dtype)));
        }
        if cfg!(target_endian = "big") {
            return Err(Error::Invalid("zero-copy f32 views need a little-endian host".into()));
        }
        let bytes = self.data(info);
        // SAFETY: the offset is a multiple of 64 from a page-aligned map, so the pointer is
        // aligned for f32; the length is a multiple of 4 (checked at open); f32 has no invalid bits.
        let (prefix, floats, suffix) = unsafe { bytes.align_to::<f32>() };
        if !prefix.is_empty() || !suffix.is_empty() {
            return Err(Error::Invalid(format!("tensor {name:?} is not aligned for f32")));
        }
        Ok(floats)
    }
    pub fn f32_vec(&self, name: &str) -> Result<Vec<f32>> {
        Ok(self.f32_slice(name)?.to_vec())
    }
    pub fn decisions(&self) -> &[DecisionInfo] {
        &self.decisions
    }
    pub fn decision_info(&self, name: &str) -> Option<&DecisionInfo> {
        self.decision_by_name.get(name).map(|&i| &self.decisions[i])
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
        self.values_bytes(d).chunks_exact(8).map(|c| i64::from_le_bytes(c.try_into().expect("8 bytes"))).collect()
    }
    pub fn decision_margins(&self, d: &DecisionInfo) -> Option<Vec<f32>> {
        self.margins_bytes(d).map(|m| m.chunks_exact(4).map(|c| f32::from_le_bytes(c.try_into().expect("4 bytes"))).collect())
    }

    /// Recomputes every payload digest (in parallel) and the whole-trace digest; the first
    /// mismatch in capture order is named.
    pub fn verify(&self) -> Result<()> {
        let bad_tensor = self
            .tensors
            .par_iter()
            .map(|t| xxh3_128(self.data(t)) != t.digest)
            .collect::<Vec<bool>>();
        if let Some(i) = bad_tensor.iter().position(|&b| b) {
            let t = &self.tensors[i];
            return Err(Error::Tampered {
                path: self.path.clone(),
                reason: format!("tensor {:?} (bytes {}..{}) no longer matches its xxh3-128", t.name, t.offset, t.offset + t.nbytes),
            });
        }
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
            return Err(Error::Tampered {
                path: self.path.clone(),
                // Every payload matched its own digest above, so what changed is index content
                // (a name, dtype, shape or attribute), which has no second copy to name it by.
                reason: format!(
                    "content digest is {} but the index records {}: every payload matches its digest, so the index itself (a name, dtype, shape or attribute) was edited",
                    recomputed.hex(),
                    self.digest.hex()
                ),
            });
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
            Some { parent } | NewtypeStruct { parent } | NewtypeVariant { parent } => place(parent, out),
        }
    }
    match path {
        serde_ignored::Path::Map { parent, key } => {
            let mut at = String::new();
            place(parent, &mut at);
            if at.is_empty() { format!("{key:?}") } else { format!("{key:?} in {at}") }
        }
        other => other.to_string(),
    }
}
