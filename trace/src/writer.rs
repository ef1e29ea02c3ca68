use std::collections::HashSet;
use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use serde_json::Value;
use xxhash_rust::xxh3::{xxh3_128, Xxh3};

use crate::attrs::Attributes;
use crate::canonical::Canonical;
use crate::digest::{xxh3_hex, Digest};
use crate::dtype::{element_count, DType};
use crate::error::{Error, Result};
use crate::layout::{self, *};

struct PendingTensor {
    name: String,
    dtype: DType,
    shape: Vec<u64>,
    offset: u64,
    nbytes: u64,
    xxh3: u128,
    attributes: Attributes,
}

/// A decision's index entry; its bytes are in the file and read back for the content digest,
/// so the writer holds only the index in memory.
struct PendingDecision {
    name: String,
    shape: Vec<u64>,
    values_offset: u64,
    values_len: usize,
    margins_offset: Option<u64>,
    margins_len: usize,
    xxh3: u128,
}

/// Streams a trace to `<dir>/.<name>.<pid>.<n>.tracegate-tmp`; `finish` fsyncs and renames it
/// to the final path. Dropping an unfinished writer removes the temporary file.
pub struct TraceWriter {
    out: Option<BufWriter<File>>,
    tmp_path: PathBuf,
    final_path: PathBuf,
    pos: u64,
    tensors: Vec<PendingTensor>,
    decisions: Vec<PendingDecision>,
    tensor_names: HashSet<String>,
    decision_names: HashSet<String>,
    provenance: Value,
    renamed: bool,
}

static TMP_COUNTER: AtomicU64 = AtomicU64::new(0);

fn check_name(kind: &str, name: &str) -> Result<()> {
    layout::check_name(kind, name).map_err(Error::Invalid)
}

fn check_shape(kind: &str, name: &str, shape: &[u64]) -> Result<u64> {
    if shape.len() > MAX_RANK {
        return Err(Error::Invalid(format!(
            "{kind} {name:?}: rank {} exceeds the limit {MAX_RANK}",
            shape.len()
        )));
    }
    element_count(shape).ok_or_else(|| {
        Error::Invalid(format!(
            "{kind} {name:?}: shape {shape:?} overflows u64 elements"
        ))
    })
}

/// Removes `.<file_name>.<pid>.<n>.tracegate-tmp` files in `dir` whose writer process is gone
/// (killed before it could clean up). A live writer's temporary is kept: its pid still has a
/// `/proc` entry (a reused pid errs on the side of keeping). Without `/proc` nothing is removed.
fn remove_stale_temporaries(dir: &Path, file_name: &str) {
    let proc = Path::new("/proc");
    if !proc.join("self").exists() {
        return;
    }
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    let prefix = format!(".{file_name}.");
    for entry in entries.flatten() {
        let name = entry.file_name();
        let Some(rest) = name
            .to_str()
            .and_then(|n| n.strip_prefix(&prefix))
            .and_then(|r| r.strip_suffix(TMP_SUFFIX))
        else {
            continue;
        };
        // rest is "<pid>.<n>", both decimal, or the name belongs to something else.
        let Some((pid, n)) = rest.split_once('.') else {
            continue;
        };
        let decimal = |s: &str| !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit());
        if !decimal(pid) || !decimal(n) || proc.join(pid).exists() {
            continue;
        }
        let _ = std::fs::remove_file(entry.path());
    }
}

impl TraceWriter {
    /// Starts a trace that will appear at `path` when finished. `provenance` must be a JSON object.
    pub fn create(path: impl AsRef<Path>, provenance: Value) -> Result<TraceWriter> {
        let final_path = path.as_ref().to_path_buf();
        if !provenance.is_object() {
            return Err(Error::Invalid("provenance must be a JSON object".into()));
        }
        let file_name = final_path
            .file_name()
            .ok_or_else(|| Error::Invalid(format!("{}: not a file path", final_path.display())))?
            .to_string_lossy()
            .into_owned();
        let dir = match final_path.parent() {
            Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
            _ => PathBuf::from("."),
        };
        if final_path.is_dir() {
            return Err(Error::Invalid(format!(
                "{}: is a directory, not a trace file path",
                final_path.display()
            )));
        }
        // Said here, with the path the caller gave: the temporary's name is an internal detail.
        match std::fs::metadata(&dir) {
            Ok(m) if m.is_dir() => {}
            Ok(_) => {
                return Err(Error::Invalid(format!(
                    "{}: {} is not a directory",
                    final_path.display(),
                    dir.display()
                )))
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                return Err(Error::NotFound(format!(
                    "{}: the directory {} does not exist",
                    final_path.display(),
                    dir.display()
                )))
            }
            Err(e) => return Err(Error::io(&dir, e)),
        }
        remove_stale_temporaries(&dir, &file_name);
        let n = TMP_COUNTER.fetch_add(1, Ordering::Relaxed);
        let tmp_path = dir.join(format!(
            ".{file_name}.{}.{n}{TMP_SUFFIX}",
            std::process::id()
        ));
        // Readable too: decision payloads are read back for the content digest at finish.
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .open(&tmp_path)
            .map_err(|e| Error::Io {
                path: final_path.clone(),
                source: std::io::Error::new(
                    e.kind(),
                    format!("cannot create its temporary file in {}: {e}", dir.display()),
                ),
            })?;
        let mut out = BufWriter::with_capacity(1 << 20, file);
        out.write_all(&header_bytes())
            .map_err(|e| Error::io(&tmp_path, e))?;
        Ok(TraceWriter {
            out: Some(out),
            tmp_path,
            final_path,
            pos: HEADER_LEN,
            tensors: Vec::new(),
            decisions: Vec::new(),
            tensor_names: HashSet::new(),
            decision_names: HashSet::new(),
            provenance,
            renamed: false,
        })
    }

    /// Writes `bytes` at the next 64-byte boundary and returns its offset.
    fn write_aligned(&mut self, bytes: &[u8]) -> Result<u64> {
        let offset =
            align_up(self.pos).ok_or_else(|| Error::Invalid("trace larger than u64".into()))?;
        let out = self
            .out
            .as_mut()
            .ok_or_else(|| Error::Invalid("writer already finished".into()))?;
        let pad = (offset - self.pos) as usize;
        let zeros = [0u8; ALIGN as usize];
        out.write_all(&zeros[..pad])
            .map_err(|e| Error::io(&self.tmp_path, e))?;
        out.write_all(bytes)
            .map_err(|e| Error::io(&self.tmp_path, e))?;
        self.pos = offset + bytes.len() as u64;
        Ok(offset)
    }

    /// Records a tensor: `bytes` are its elements in row-major order, little-endian.
    pub fn tensor(
        &mut self,
        name: &str,
        dtype: DType,
        shape: &[u64],
        bytes: &[u8],
        attributes: &Attributes,
    ) -> Result<()> {
        check_name("tensor", name)?;
        let count = check_shape("tensor", name, shape)?;
        let expected = count.checked_mul(dtype.size() as u64);
        if expected != Some(bytes.len() as u64) {
            return Err(Error::Invalid(format!(
                "tensor {name:?}: payload is {} bytes but shape {shape:?} of {dtype} needs {} elements x {} bytes = {}",
                bytes.len(),
                count,
                dtype.size(),
                expected.map(|e| e.to_string()).unwrap_or_else(|| "overflow".into())
            )));
        }
        if dtype == DType::Bool {
            if let Some(i) = bytes.iter().position(|&b| b > 1) {
                return Err(Error::Invalid(format!(
                    "tensor {name:?}: bool element {i} is {} (must be 0 or 1)",
                    bytes[i]
                )));
            }
        }
        attributes
            .validate()
            .map_err(|e| Error::Invalid(format!("tensor {name:?}: {e}")))?;
        // One position per row of the token axis (axis 0 for a name outside the documented
        // points): a list of another length says nothing about which row is which token.
        if let Some(p) = &attributes.positions {
            let axis = crate::names::token_axis(name).unwrap_or(0);
            let rows = shape.get(axis).copied();
            if rows != Some(p.len() as u64) {
                return Err(Error::Invalid(format!(
                    "tensor {name:?}: {} positions for {} rows (shape {shape:?}, token axis {axis}): one per row",
                    p.len(),
                    rows.map_or("no".to_string(), |r| r.to_string())
                )));
            }
        }
        // validate() parsed it: here, whether the registry lets this point be held so.
        if let Ok(Some(shard)) = attributes.shard() {
            shard.check_for(name, shape).map_err(|e| {
                Error::Invalid(format!(
                    "tensor {name:?}: attribute shard {shard:?}: {e}",
                    shard = shard.to_string()
                ))
            })?;
        }
        if self.tensor_names.contains(name) {
            return Err(Error::Invalid(format!("duplicate tensor name {name:?}")));
        }
        // Hash on another core while the bytes go to the file: writing stays the only cost.
        let (xxh3, offset) = if bytes.len() >= 1 << 20 {
            rayon::join(|| xxh3_128(bytes), || self.write_aligned(bytes))
        } else {
            (xxh3_128(bytes), self.write_aligned(bytes))
        };
        let offset = offset?;
        self.tensor_names.insert(name.to_string());
        self.tensors.push(PendingTensor {
            name: name.to_string(),
            dtype,
            shape: shape.to_vec(),
            offset,
            nbytes: bytes.len() as u64,
            xxh3,
            attributes: attributes.clone(),
        });
        Ok(())
    }

    pub fn tensor_f32(
        &mut self,
        name: &str,
        shape: &[u64],
        data: &[f32],
        attributes: &Attributes,
    ) -> Result<()> {
        // Little-endian hosts write the elements' own bytes: no copy of the tensor.
        #[cfg(target_endian = "little")]
        // SAFETY: f32 has no padding and every byte of it is initialised; u8 needs no alignment.
        let bytes =
            unsafe { std::slice::from_raw_parts(data.as_ptr().cast::<u8>(), data.len() * 4) };
        #[cfg(not(target_endian = "little"))]
        let bytes = &data
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .collect::<Vec<u8>>();
        self.tensor(name, DType::F32, shape, bytes, attributes)
    }

    /// Replaces the provenance given to `create`: a producer that streams its tensors learns
    /// some of it (a digest computed beside the run, what was forced) only at the end.
    pub fn set_provenance(&mut self, provenance: Value) -> Result<()> {
        if !provenance.is_object() {
            return Err(Error::Invalid("provenance must be a JSON object".into()));
        }
        self.provenance = provenance;
        Ok(())
    }

    /// Records a discrete decision: `values` in row-major order over `shape`, and optionally
    /// one margin per row (row = index along the first axis; a rank-0 decision has one row).
    pub fn decision(
        &mut self,
        name: &str,
        shape: &[u64],
        values: &[i64],
        margins: Option<&[f32]>,
    ) -> Result<()> {
        check_name("decision", name)?;
        let count = check_shape("decision", name, shape)?;
        if count != values.len() as u64 {
            return Err(Error::Invalid(format!(
                "decision {name:?}: {} values given but shape {shape:?} holds {count}",
                values.len()
            )));
        }
        let rows = shape.first().copied().unwrap_or(1);
        if let Some(m) = margins {
            if m.len() as u64 != rows {
                return Err(Error::Invalid(format!(
                    "decision {name:?}: {} margins given but it has {rows} rows",
                    m.len()
                )));
            }
        }
        if self.decision_names.contains(name) {
            return Err(Error::Invalid(format!("duplicate decision name {name:?}")));
        }
        let values: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
        let margins: Option<Vec<u8>> =
            margins.map(|m| m.iter().flat_map(|v| v.to_le_bytes()).collect());
        let mut h = Xxh3::new();
        h.update(&values);
        if let Some(m) = &margins {
            h.update(m);
        }
        let values_offset = self.write_aligned(&values)?;
        let margins_offset = match &margins {
            Some(m) => Some(self.write_aligned(m)?),
            None => None,
        };
        self.decision_names.insert(name.to_string());
        self.decisions.push(PendingDecision {
            name: name.to_string(),
            shape: shape.to_vec(),
            values_offset,
            values_len: values.len(),
            margins_offset,
            margins_len: margins.as_ref().map_or(0, Vec::len),
            xxh3: h.digest128(),
        });
        Ok(())
    }

    /// The content digest of everything recorded so far (flushes the buffered bytes first).
    fn content_digest(&mut self) -> Result<Digest> {
        use std::os::unix::fs::FileExt;
        let out = self
            .out
            .as_mut()
            .ok_or_else(|| Error::Invalid("writer already finished".into()))?;
        out.flush().map_err(|e| Error::io(&self.tmp_path, e))?;
        let file = out.get_ref();
        let read = |offset: u64, len: usize| -> Result<Vec<u8>> {
            let mut buf = vec![0u8; len];
            file.read_exact_at(&mut buf, offset)
                .map_err(|e| Error::io(&self.tmp_path, e))?;
            Ok(buf)
        };
        let mut c = Canonical::new(self.tensors.len());
        for t in &self.tensors {
            c.tensor(&t.name, t.dtype, &t.shape, &t.attributes, t.xxh3);
        }
        c.begin_decisions(self.decisions.len());
        for d in &self.decisions {
            let values = read(d.values_offset, d.values_len)?;
            let margins = d
                .margins_offset
                .map(|o| read(o, d.margins_len))
                .transpose()?;
            c.decision(&d.name, &d.shape, &values, margins.as_deref());
        }
        Ok(c.finish())
    }

    /// Writes the index and footer, fsyncs, and renames the file into place.
    pub fn finish(mut self) -> Result<Digest> {
        let digest = self.content_digest()?;
        let index = IndexJson {
            format: FORMAT_NAME.to_string(),
            version: [FORMAT_MAJOR, FORMAT_MINOR],
            digest: digest.hex(),
            tensors: self
                .tensors
                .iter()
                .map(|t| TensorJson {
                    name: t.name.clone(),
                    dtype: t.dtype.name().to_string(),
                    shape: t.shape.clone(),
                    offset: t.offset,
                    nbytes: t.nbytes,
                    xxh3: xxh3_hex(t.xxh3),
                    attributes: t.attributes.to_json().into(),
                })
                .collect(),
            decisions: self
                .decisions
                .iter()
                .map(|d| DecisionJson {
                    name: d.name.clone(),
                    shape: d.shape.clone(),
                    values_offset: d.values_offset,
                    margins_offset: d.margins_offset,
                    xxh3: xxh3_hex(d.xxh3),
                })
                .collect(),
            provenance: std::mem::take(&mut self.provenance),
        };
        let index_bytes =
            serde_json::to_vec(&index).map_err(|e| Error::Invalid(format!("index: {e}")))?;
        let index_offset = self.write_aligned(&index_bytes)?;
        let footer = footer_bytes(
            index_offset,
            index_bytes.len() as u64,
            xxh3_128(&index_bytes),
        );
        let out = self
            .out
            .take()
            .ok_or_else(|| Error::Invalid("writer already finished".into()))?;
        let tmp = self.tmp_path.clone();
        let mut out = out;
        out.write_all(&footer).map_err(|e| Error::io(&tmp, e))?;
        let file = out
            .into_inner()
            .map_err(|e| Error::io(&tmp, e.into_error()))?;
        file.sync_all().map_err(|e| Error::io(&tmp, e))?;
        drop(file);
        std::fs::rename(&tmp, &self.final_path).map_err(|e| Error::io(&self.final_path, e))?;
        self.renamed = true;
        // Make the rename itself durable.
        if let Some(dir) = self.final_path.parent() {
            let dir = if dir.as_os_str().is_empty() {
                Path::new(".")
            } else {
                dir
            };
            if let Ok(d) = File::open(dir) {
                let _ = d.sync_all();
            }
        }
        Ok(digest)
    }

    /// Where the unfinished trace is being written.
    pub fn temporary_path(&self) -> &Path {
        &self.tmp_path
    }
}

impl Drop for TraceWriter {
    fn drop(&mut self) {
        // An unfinished (or failed) writer leaves nothing behind.
        if !self.renamed {
            drop(self.out.take());
            let _ = std::fs::remove_file(&self.tmp_path);
        }
    }
}
