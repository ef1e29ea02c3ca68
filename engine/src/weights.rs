//! Checkpoint access: a careful safetensors header parser, tensor views that widen bf16/f16 to
//! f32 at use (never a full f32 copy), the inventory check and the weights digest. The files
//! stay mapped; a bf16 matrix the model multiplies by is repacked once, still bf16, into row
//! panels (`Layout::Panels`) when decode first uses it (`Weight`): decode streams them without
//! a transpose.
//!
//! safetensors layout: `u64 LE header length N`, `N bytes of JSON`, then the data buffer. The
//! JSON maps tensor names to `{dtype, shape, data_offsets: [begin, end]}` (offsets relative to
//! the data buffer) plus an optional `__metadata__` string map. Every size is checked before use.

use std::collections::BTreeMap;
use std::fs::File;
use std::path::{Path, PathBuf};

use memmap2::{Advice, Mmap, MmapMut, MmapOptions, UncheckedAdvice};

// The matrix layouts are the matmul's (matmul::layout); re-exported for the checkpoint's users.
use crate::matmul::layout::wants_panels;
pub use crate::matmul::layout::{widen, Layout, Mat, WDType, PANEL};
use crate::{err, Result};

/// Largest header accepted; real headers are kilobytes, this bounds a hostile length field.
const MAX_HEADER_BYTES: u64 = 100 << 20;

/// Element size of every safetensors dtype, so offsets of tensors we do not use are still checked.
fn st_dtype_size(s: &str) -> Option<usize> {
    Some(match s {
        "BOOL" | "U8" | "I8" | "F8_E4M3" | "F8_E5M2" => 1,
        "I16" | "U16" | "F16" | "BF16" => 2,
        "I32" | "U32" | "F32" => 4,
        "I64" | "U64" | "F64" => 8,
        _ => return None,
    })
}

/// One tensor entry of a parsed header.
#[derive(Clone, Debug)]
pub struct Entry {
    pub dtype: String,
    pub shape: Vec<u64>,
    /// Absolute byte range in the file.
    pub start: usize,
    pub end: usize,
}

/// Parse and validate a safetensors header against the file length. Refuses: short files,
/// oversized/overrunning header lengths, non-UTF-8 or non-object JSON, duplicate names, unknown
/// dtypes, shapes whose byte size overflows or disagrees with the offsets, out-of-bounds or
/// overlapping ranges, and bytes of the data buffer no tensor covers.
pub fn parse_header(bytes: &[u8], file: &str) -> Result<BTreeMap<String, Entry>> {
    if bytes.len() < 8 {
        return Err(err!(Checkpoint:
            "{file}: not a safetensors file ({} bytes, need at least 8)",
            bytes.len()
        ));
    }
    let n = u64::from_le_bytes(bytes[..8].try_into().expect("8 bytes"));
    let avail = bytes.len() as u64 - 8;
    if n > MAX_HEADER_BYTES || n > avail {
        return Err(
            err!(Checkpoint: "{file}: safetensors header length {n} exceeds the file ({avail} bytes after the length) or the {MAX_HEADER_BYTES}-byte limit"),
        );
    }
    let n = n as usize;
    let text = std::str::from_utf8(&bytes[8..8 + n])
        .map_err(|e| err!(Checkpoint: "{file}: safetensors header is not UTF-8: {e}"))?;
    if !text.starts_with('{') {
        return Err(err!(Checkpoint: "{file}: safetensors header does not start with '{{'"));
    }
    let raw: UniqueMap = serde_json::from_str(text)
        .map_err(|e| err!(Checkpoint: "{file}: safetensors header is not valid JSON: {e}"))?;
    let data_start = 8 + n;
    let data_len = bytes.len() - data_start;
    let mut out = BTreeMap::new();
    for (name, v) in raw.0 {
        if name == "__metadata__" {
            let ok = v
                .as_object()
                .is_some_and(|m| m.values().all(|x| x.is_string()));
            if !ok {
                return Err(err!(Checkpoint: "{file}: __metadata__ must be an object of strings"));
            }
            continue;
        }
        let obj = v
            .as_object()
            .ok_or_else(|| err!(Checkpoint: "{file}: tensor {name}: entry is not an object"))?;
        let dtype = obj
            .get("dtype")
            .and_then(|d| d.as_str())
            .ok_or_else(|| err!(Checkpoint: "{file}: tensor {name}: missing string dtype"))?;
        let esize = st_dtype_size(dtype)
            .ok_or_else(|| err!(Checkpoint: "{file}: tensor {name}: unknown dtype {dtype:?}"))?;
        let shape: Vec<u64> = obj
            .get("shape")
            .and_then(|s| s.as_array())
            .and_then(|a| a.iter().map(|d| d.as_u64()).collect::<Option<Vec<_>>>())
            .ok_or_else(|| {
                err!(Checkpoint: "{file}: tensor {name}: shape must be an array of non-negative integers")
            })?;
        let offs: Vec<u64> = obj
            .get("data_offsets")
            .and_then(|s| s.as_array())
            .and_then(|a| a.iter().map(|d| d.as_u64()).collect::<Option<Vec<_>>>())
            .filter(|a| a.len() == 2)
            .ok_or_else(
                || err!(Checkpoint: "{file}: tensor {name}: data_offsets must be [begin, end]"),
            )?;
        let (b, e) = (offs[0], offs[1]);
        if b > e || e > data_len as u64 {
            return Err(
                err!(Checkpoint: "{file}: tensor {name}: data_offsets [{b}, {e}] outside the {data_len}-byte data buffer"),
            );
        }
        let nbytes = shape
            .iter()
            .try_fold(esize as u64, |acc, &d| acc.checked_mul(d))
            .ok_or_else(|| err!(Checkpoint: "{file}: tensor {name}: shape {shape:?} overflows"))?;
        if nbytes != e - b {
            return Err(
                err!(Checkpoint: "{file}: tensor {name}: shape {shape:?} of {dtype} needs {nbytes} bytes, data_offsets give {}", e - b),
            );
        }
        let entry = Entry {
            dtype: dtype.to_string(),
            shape,
            start: data_start + b as usize,
            end: data_start + e as usize,
        };
        out.insert(name, entry);
    }
    // The data buffer must be tiled exactly: no overlaps, no gaps (as the format requires).
    let mut ranges: Vec<(usize, usize, &str)> = out
        .iter()
        .map(|(k, e)| (e.start, e.end, k.as_str()))
        .collect();
    ranges.sort();
    let mut pos = data_start;
    for (s, e, name) in ranges {
        if s != pos {
            let what = if s < pos {
                "overlaps the previous tensor"
            } else {
                "leaves a gap before it"
            };
            return Err(err!(Checkpoint: "{file}: tensor {name}: data range {what}"));
        }
        pos = e;
    }
    if pos != bytes.len() {
        return Err(err!(Checkpoint:
            "{file}: {} trailing bytes of the data buffer belong to no tensor",
            bytes.len() - pos
        ));
    }
    Ok(out)
}

/// A JSON object that refuses duplicate keys (serde_json's map silently keeps the last one).
struct UniqueMap(Vec<(String, serde_json::Value)>);

impl<'de> serde::Deserialize<'de> for UniqueMap {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        struct V;
        impl<'de> serde::de::Visitor<'de> for V {
            type Value = UniqueMap;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("a JSON object")
            }
            fn visit_map<A: serde::de::MapAccess<'de>>(
                self,
                mut m: A,
            ) -> std::result::Result<UniqueMap, A::Error> {
                let mut seen = std::collections::HashSet::new();
                let mut out = Vec::new();
                while let Some((k, v)) = m.next_entry::<String, serde_json::Value>()? {
                    if !seen.insert(k.clone()) {
                        return Err(serde::de::Error::custom(format!(
                            "duplicate tensor name {k:?}"
                        )));
                    }
                    out.push((k, v));
                }
                Ok(UniqueMap(out))
            }
        }
        d.deserialize_map(V)
    }
}

/// A matrix the model multiplies by: the file's row-major view, and for a bf16 matrix with an
/// even K its row panels, packed on first use by a decode-sized matmul (`view`). Lazily, so a
/// run that never decodes (a prefill trace, a bisect layer) pays no packing and keeps only the
/// pages it touched, and a MoE model packs only the experts it routes to.
pub struct Weight<'a> {
    name: String,
    rows: Mat<'a>,
    store: &'a Store,
    panels: std::sync::OnceLock<Mat<'a>>,
}

impl<'a> Weight<'a> {
    /// The view a matmul with `rows` rows of x reads: the panels once made (made now when the
    /// matmul wants them: `matmul::layout::wants_panels`); the file's rows before that (prefill tiles widen a block and reuse
    /// it for every row, so the layout matters little there). Same bits either way (tested).
    pub fn view(&self, rows: usize) -> Mat<'a> {
        if let Some(p) = self.panels.get() {
            return *p;
        }
        if wants_panels(&self.rows, rows) {
            return self.pack();
        }
        self.rows
    }

    /// The panels, made now if not yet (for a matrix that cannot be packed, or whose panels
    /// cannot be allocated, the file's rows: same bits, slower decode; said once on stderr).
    pub fn pack(&self) -> Mat<'a> {
        *self.panels.get_or_init(|| {
            self.store
                .panels(&self.name, self.rows)
                .unwrap_or_else(|e| {
                    eprintln!("engine: note: {e}; it is read from the file's rows (same values)");
                    self.rows
                })
        })
    }
}

/// Opens weights file `p` for mapping: refused unless a regular file (symlinks followed), looked
/// at before and after a non-blocking open (`tracegate_trace::open_weights_file`, the weights
/// digest's own check), so a FIFO never blocks the load. Returns the file and what it was when
/// opened (`Opened`), for `Store::unchanged`.
pub(crate) fn open_weights_file(p: &Path) -> Result<Opened> {
    let file = tracegate_trace::open_weights_file(p).map_err(|e| err!(Checkpoint: "{e}"))?;
    let stamp = Stamp::of(&file, p)?;
    Ok(Opened {
        path: p.to_path_buf(),
        file,
        stamp,
    })
}

/// A weights file as the engine opened it: the handle its mapping was made from, and its
/// size, modification and change times then.
pub(crate) struct Opened {
    pub(crate) path: PathBuf,
    pub(crate) file: File,
    stamp: Stamp,
}

/// What `fstat` says of an open file that a write to it changes: its size and modification
/// time. Not `ctime`: renaming another file over this one's path (which the mapping survives:
/// `Store::weights_digest`) or a `chmod` moves it too. A writer that puts both back (`cp -p` onto
/// the same file) is not seen.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
struct Stamp {
    len: u64,
    mtime: (i64, i64),
}

impl Stamp {
    fn of(f: &File, p: &Path) -> Result<Stamp> {
        use std::os::unix::fs::MetadataExt;
        let m = f
            .metadata()
            .map_err(|e| err!(Checkpoint: "{}: {e}", p.display()))?;
        Ok(Stamp {
            len: m.len(),
            mtime: (m.mtime(), m.mtime_nsec()),
        })
    }
}

/// The safetensors files of a model directory, sorted by file name (byte order). With a
/// `model.safetensors.index.json` they must be exactly the shards it names; without one, exactly
/// `model.safetensors`. This one list feeds both the loader and the weights digest.
pub fn safetensors_files(dir: &Path) -> Result<Vec<PathBuf>> {
    let rd = std::fs::read_dir(dir)
        .map_err(|e| err!(Checkpoint: "{}: cannot read model directory: {e}", dir.display()))?;
    let mut names = Vec::new();
    for ent in rd {
        let ent = ent.map_err(|e| err!(Checkpoint: "{}: {e}", dir.display()))?;
        let name = ent.file_name().to_string_lossy().into_owned();
        if name.ends_with(".safetensors") {
            names.push(name);
        }
    }
    names.sort();
    let index = dir.join("model.safetensors.index.json");
    let expected: Vec<String> = if index.exists() {
        let map = read_index(&index)?;
        let mut shards: Vec<String> = map.into_values().collect();
        shards.sort();
        shards.dedup();
        shards
    } else {
        vec!["model.safetensors".to_string()]
    };
    for n in &names {
        if !expected.contains(n) {
            return Err(err!(Checkpoint:
                "{}: safetensors file {n} is not part of the checkpoint (expected {expected:?})",
                dir.display()
            ));
        }
    }
    for n in &expected {
        if !names.contains(n) {
            return Err(err!(Checkpoint: "{}: missing safetensors file {n}", dir.display()));
        }
    }
    Ok(names.iter().map(|n| dir.join(n)).collect())
}

/// `weight_map` of a sharded checkpoint index: tensor name → shard file name.
fn read_index(path: &Path) -> Result<BTreeMap<String, String>> {
    // One regular file, bounded, no repeated key (two `weight_map`s, or one tensor named twice).
    let bytes = tracegate_trace::json::read_bytes(path, tracegate_trace::json::MAX_JSON_LEN)
        .map_err(|e| err!(Checkpoint: "{e}"))?;
    let v: serde_json::Value = tracegate_trace::json::parse(&bytes)
        .map_err(|e| err!(Checkpoint: "{}: invalid JSON: {e}", path.display()))?;
    let wm = v
        .get("weight_map")
        .and_then(|m| m.as_object())
        .ok_or_else(|| err!(Checkpoint: "{}: missing object weight_map", path.display()))?;
    let mut out = BTreeMap::new();
    for (k, f) in wm {
        let f = f.as_str().ok_or_else(
            || err!(Checkpoint: "{}: weight_map[{k}] is not a string", path.display()),
        )?;
        if f.contains('/') || f.contains('\\') || !f.ends_with(".safetensors") {
            return Err(err!(Checkpoint:
                "{}: weight_map[{k}] names {f:?}, not a safetensors file in the directory",
                path.display()
            ));
        }
        out.insert(k.clone(), f.to_string());
    }
    Ok(out)
}

/// Huge-page size the panels are aligned to (x86-64 and aarch64 with 4 KiB base pages).
const HUGE_PAGE: usize = 2 << 20;

/// Zeroed anonymous memory for `len` bytes of panels, starting on a huge-page boundary when it
/// spans one, advised `MADV_HUGEPAGE` (decode streams every weight once per token; through 4 KiB
/// pages that is a TLB walk per page). Returns the mapping and the offset of the buffer in it.
fn panel_buffer(len: usize) -> std::io::Result<(MmapMut, usize)> {
    let pad = if len >= HUGE_PAGE { HUGE_PAGE } else { 0 };
    let map = MmapOptions::new().len(len.max(1) + pad).map_anon()?;
    let off = if pad > 0 {
        (HUGE_PAGE - map.as_ptr() as usize % HUGE_PAGE) % HUGE_PAGE
    } else {
        0
    };
    // A hint: without transparent huge pages the panels keep 4 KiB pages (the bench prints how
    // much of the process is on huge pages: `anon_huge_bytes`).
    let _ = map.advise(Advice::HugePage);
    Ok((map, off))
}

fn page_size() -> usize {
    // SAFETY: sysconf has no preconditions.
    let p = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    if p > 0 {
        p as usize
    } else {
        4096
    }
}

/// All tensors of a checkpoint, read-only. `take` hands out views and records which
/// names were claimed, so `finish_claims` can refuse tensors no module uses.
pub struct Store {
    maps: Vec<Mmap>,
    /// The checkpoint's files, mapped as `maps[..files.len()]` in the weights digest's order.
    files: Vec<Opened>,
    /// The panels `panels` made (never moved or dropped before the store: views point in).
    panels: std::sync::Mutex<Vec<MmapMut>>,
    /// name → (map index, entry)
    tensors: BTreeMap<String, (usize, Entry)>,
    claimed: std::sync::Mutex<std::collections::BTreeSet<String>>,
}

impl Store {
    /// Map the safetensors checkpoint in `dir` and check its headers (and index, if any); a GGUF
    /// checkpoint is `crate::open_store`'s.
    pub fn open(dir: &Path) -> Result<Store> {
        let files = safetensors_files(dir)?;
        let index = dir.join("model.safetensors.index.json");
        let weight_map = if index.exists() {
            Some(read_index(&index)?)
        } else {
            None
        };
        let mut maps = Vec::new();
        let mut tensors = BTreeMap::new();
        let mut opened = Vec::new();
        for p in &files {
            let f = open_weights_file(p)?;
            // SAFETY: mapped read-only; the checkpoint must not be modified while the engine runs
            // (the same contract every mmap-based loader has; `Store::unchanged` refuses a run
            // during which it was).
            let m = unsafe { Mmap::map(&f.file) }
                .map_err(|e| err!(Checkpoint: "{}: cannot map: {e}", p.display()))?;
            let fname = p
                .file_name()
                .map(|s| s.to_string_lossy().into_owned())
                .unwrap_or_default();
            let entries = parse_header(&m, &fname)?;
            for (name, e) in entries {
                if let Some(wm) = &weight_map {
                    if wm.get(&name) != Some(&fname) {
                        return Err(err!(Checkpoint:
                            "tensor {name} is in {fname} but the index names {:?}",
                            wm.get(&name)
                        ));
                    }
                }
                if tensors.insert(name.clone(), (maps.len(), e)).is_some() {
                    return Err(err!(Checkpoint:
                        "tensor {name} appears in more than one safetensors file"
                    ));
                }
            }
            maps.push(m);
            opened.push(f);
        }
        if let Some(wm) = &weight_map {
            for (name, f) in wm {
                if !tensors.contains_key(name) {
                    return Err(err!(Checkpoint:
                        "tensor {name}: listed in the index for {f} but not in that file"
                    ));
                }
            }
        }
        Ok(Store::from_maps(maps, opened, tensors))
    }

    /// A store over mappings already checked and their entries (`tensors`: name → (index into
    /// `maps`, entry)); `files` are the checkpoint's files that `maps[..files.len()]` map, in
    /// the weights digest's order. The GGUF source builds one (`gguf::GgufModel::into_store`).
    pub(crate) fn from_maps(
        maps: Vec<Mmap>,
        files: Vec<Opened>,
        tensors: BTreeMap<String, (usize, Entry)>,
    ) -> Store {
        debug_assert!(files.len() <= maps.len());
        Store {
            maps,
            files,
            tensors,
            panels: Default::default(),
            claimed: Default::default(),
        }
    }

    /// The weights digest (`tracegate_trace::weights_digest`'s definition) of the bytes this
    /// store maps, which are those the model computes with: a checkpoint renamed over since it
    /// was opened does not change it (the path now names other bytes; the mapping does not).
    /// Refused if a file was written in place since (`unchanged`).
    pub fn weights_digest(&self) -> Result<String> {
        let digest = tracegate_trace::weights_digest_of(
            self.maps[..self.files.len()].iter().map(|m| &m[..]),
        );
        self.unchanged()?;
        Ok(digest)
    }

    /// Refuses, naming the file, if a checkpoint file was written in place since it was opened
    /// (its size or mtime moved, `Stamp`): the mapping then shows bytes the run may have read only
    /// in part, and no digest says which weights it computed with.
    pub fn unchanged(&self) -> Result<()> {
        for f in &self.files {
            let now = Stamp::of(&f.file, &f.path)?;
            if now != f.stamp {
                return Err(err!(Checkpoint:
                    "{}: the weights file was written while the engine ran (size {} -> {}, mtime {}.{:09} -> {}.{:09}): no digest says which weights the run computed with; rerun it",
                    f.path.display(),
                    f.stamp.len, now.len,
                    f.stamp.mtime.0, f.stamp.mtime.1, now.mtime.0, now.mtime.1
                ));
            }
        }
        Ok(())
    }

    pub fn contains(&self, name: &str) -> bool {
        self.tensors.contains_key(name)
    }

    /// Claim tensor `name` and check its shape; returns it as a matrix (`[n]` is `1 × n`).
    pub fn take(&self, name: &str, shape: &[usize]) -> Result<Mat<'_>> {
        let (mi, e) = self
            .tensors
            .get(name)
            .ok_or_else(|| err!(Checkpoint: "missing tensor {name} (expected shape {shape:?})"))?;
        let got: Vec<usize> = e.shape.iter().map(|&d| d as usize).collect();
        if got != shape {
            return Err(err!(Checkpoint: "tensor {name}: shape {got:?}, expected {shape:?}"));
        }
        let dtype = match e.dtype.as_str() {
            "F32" => WDType::F32,
            "F16" => WDType::F16,
            "BF16" => WDType::BF16,
            d => {
                return Err(err!(Checkpoint:
                    "tensor {name}: dtype {d} not supported (BF16, F16, F32)"
                ))
            }
        };
        self.claimed().insert(name.to_string());
        let (rows, cols) = match shape {
            [n] => (1, *n),
            [r, c] => (*r, *c),
            [a, r, c] => (a * r, *c),
            _ => return Err(err!(Checkpoint: "tensor {name}: unsupported rank {}", shape.len())),
        };
        Ok(Mat::rows(
            dtype,
            rows,
            cols,
            &self.maps[*mi][e.start..e.end],
        ))
    }

    fn claimed(&self) -> std::sync::MutexGuard<'_, std::collections::BTreeSet<String>> {
        // A panic elsewhere cannot leave the set half-written: insert and extend are whole.
        self.claimed.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// `take` a matrix the model multiplies by (`Weight`: panels made on first decode use).
    pub fn weight(&self, name: &str, shape: &[usize]) -> Result<Weight<'_>> {
        Ok(self.weight_of(name, self.take(name, shape)?))
    }

    /// A `Weight` over part of a tensor already taken (`name` for messages): a fused expert's
    /// rows.
    pub fn weight_of<'s>(&'s self, name: &str, m: Mat<'s>) -> Weight<'s> {
        Weight {
            name: name.to_string(),
            rows: m,
            store: self,
            panels: std::sync::OnceLock::new(),
        }
    }

    /// `take` a matrix and keep only rows `rows` and columns `cols` of it, copied into memory the
    /// store owns (docs/numerics.md §23.2: a rank of a sharded run holds its block and reads
    /// nothing else of the tensor); a `Weight` over that copy.
    pub fn weight_block(
        &self,
        name: &str,
        shape: &[usize],
        rows: std::ops::Range<usize>,
        cols: std::ops::Range<usize>,
    ) -> Result<Weight<'_>> {
        let m = self.take(name, shape)?;
        Ok(self.weight_of(name, self.block(name, m, rows, cols)?))
    }

    /// Rows `rows` and columns `cols` of the row-major `m` (a view into this store's files),
    /// copied into memory the store owns (kept with the panels: never moved or dropped before
    /// the store).
    pub fn block<'s>(
        &'s self,
        name: &str,
        m: Mat<'s>,
        rows: std::ops::Range<usize>,
        cols: std::ops::Range<usize>,
    ) -> Result<Mat<'s>> {
        assert!(m.layout == Layout::Rows && rows.end <= m.rows && cols.end <= m.cols);
        let (s, n, k) = (m.dtype.size(), rows.len(), cols.len());
        let len = n * k * s;
        let (mut map, off) = panel_buffer(len).map_err(
            |e| err!(Checkpoint: "tensor {name}: cannot allocate {len} bytes for this rank's block: {e}"),
        )?;
        for (i, r) in rows.enumerate() {
            let src = (r * m.cols + cols.start) * s;
            map[off + i * k * s..off + (i + 1) * k * s].copy_from_slice(&m.bytes[src..src + k * s]);
        }
        let ptr = map[off..].as_ptr();
        self.panels
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(map);
        // SAFETY: as in `panels`: the mapping just pushed lives, unmoved, as long as `self`.
        let bytes = unsafe { std::slice::from_raw_parts(ptr, len) };
        Ok(Mat::rows(m.dtype, n, k, bytes))
    }

    /// `m` (a view into this store's files; `name` for errors) repacked as `Layout::Panels` in
    /// memory the store owns, when `m.can_pack()`; else `m` itself. The file's pages of `m` are
    /// then released (what a run reads is the panels; a page read again would come back from
    /// the file): resident memory stays one copy of the bf16 weights, not two.
    pub fn panels<'s>(&'s self, name: &str, m: Mat<'s>) -> Result<Mat<'s>> {
        if !m.can_pack() {
            return Ok(m);
        }
        let len = m.panels_len();
        let (mut map, off) = panel_buffer(len).map_err(
            |e| err!(Checkpoint: "tensor {name}: cannot allocate {len} bytes for its panels: {e}"),
        )?;
        m.pack_into(&mut map[off..off + len]);
        let (ptr, page) = (map[off..].as_ptr(), page_size());
        self.panels
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(map);
        if let Some(file) = self
            .maps
            .iter()
            .find(|f| f.as_ptr_range().contains(&m.bytes.as_ptr()))
        {
            let start = m.bytes.as_ptr() as usize - file.as_ptr() as usize;
            let (a, b) = (
                start.next_multiple_of(page),
                (start + m.bytes.len()) / page * page,
            );
            if a < b {
                // SAFETY: a private read-only file mapping: dropping its pages loses nothing (a
                // later read faults them in from the file again); only whole pages of `m` go.
                let _ = unsafe { file.unchecked_advise_range(UncheckedAdvice::DontNeed, a, b - a) };
            }
        }
        // SAFETY: the mapping just pushed lives, unmoved and unwritten, as long as `self` (the
        // vector only grows; a mapping's memory does not move with the vector's storage).
        let bytes = unsafe { std::slice::from_raw_parts(ptr, len) };
        Ok(Mat {
            layout: Layout::Panels,
            bytes,
            ..m
        })
    }

    /// Refuse the checkpoint if any tensor was not claimed by the model.
    pub fn finish_claims(&self) -> Result<()> {
        let claimed = self.claimed();
        for name in self.tensors.keys() {
            if !claimed.contains(name) {
                return Err(err!(Checkpoint:
                    "unclaimed tensor {name}: no module of this config uses it"
                ));
            }
        }
        Ok(())
    }

    pub fn tensor_count(&self) -> usize {
        self.tensors.len()
    }

    /// The stored shape of `name`, without claiming it (for checking a config before loading).
    pub fn shape(&self, name: &str) -> Option<&[u64]> {
        self.tensors.get(name).map(|(_, e)| e.shape.as_slice())
    }

    /// Claim, without using them, every tensor under one of `prefixes` (parts of a checkpoint
    /// the language model does not run: Qwen3.5's vision tower and multi-token-prediction head),
    /// and say how many each prefix held, in the order given, prefixes holding none left out.
    pub fn set_aside(&self, prefixes: &[&str]) -> Vec<(String, usize)> {
        let mut claimed = self.claimed();
        let mut out = Vec::new();
        for p in prefixes {
            let names: Vec<&String> = self.tensors.keys().filter(|k| k.starts_with(p)).collect();
            if !names.is_empty() {
                out.push((p.to_string(), names.len()));
                claimed.extend(names.into_iter().cloned());
            }
        }
        out
    }

    /// One past the highest `N` of the checkpoint's `{model}layers.N.*` tensors (0: none);
    /// `model` is the language model's prefix (`model.`, or `model.language_model.`).
    pub fn layer_count(&self, model: &str) -> usize {
        let layers = format!("{model}layers.");
        self.tensors
            .keys()
            .filter_map(|k| {
                k.strip_prefix(&layers)?
                    .split('.')
                    .next()?
                    .parse::<usize>()
                    .ok()
            })
            .max()
            .map_or(0, |n| n.saturating_add(1))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A single-file checkpoint of `(name, dtype, shape)` tensors filled with varied bytes
    /// (an LCG, so no two tensors or positions look alike); returns the file's bytes.
    fn write_checkpoint(dir: &Path, tensors: &[(&str, &str, Vec<usize>)]) -> Vec<u8> {
        let (mut header, mut data) = (serde_json::Map::new(), Vec::new());
        let mut s = 0x2545_f491_4f6c_dd1du64;
        for (name, dtype, shape) in tensors {
            let n = shape.iter().product::<usize>() * st_dtype_size(dtype).unwrap();
            let b = data.len();
            data.extend((0..n).map(|_| {
                s = s
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                (s >> 56) as u8
            }));
            header.insert(
                name.to_string(),
                serde_json::json!({"dtype": dtype, "shape": shape, "data_offsets": [b, data.len()]}),
            );
        }
        let h = serde_json::Value::Object(header).to_string();
        let mut file = (h.len() as u64).to_le_bytes().to_vec();
        file.extend_from_slice(h.as_bytes());
        file.extend_from_slice(&data);
        std::fs::write(dir.join("model.safetensors"), &file).unwrap();
        file
    }

    /// The first element (tensor, row, column) where `m` differs from the row-major bf16 or
    /// f32 tensor at `file[start..]`, widened by the scalar reference.
    fn first_difference(m: Mat, file: &[u8], start: usize) -> Option<(usize, usize)> {
        let s = m.dtype.size();
        let mut row = vec![0.0f32; m.cols];
        let mut want = vec![0.0f32; m.cols];
        for r in 0..m.rows {
            m.widen_row(r, 0, &mut row);
            let at = start + r * m.cols * s;
            widen(m.dtype, &file[at..at + m.cols * s], &mut want);
            if let Some(c) = (0..m.cols).find(|&c| row[c].to_bits() != want[c].to_bits()) {
                return Some((r, c));
            }
        }
        None
    }

    #[test]
    fn panels_hold_every_weight_of_the_file() {
        let tmp = tempfile::tempdir().unwrap();
        // Whole and partial panels, fewer rows than a panel, and matrices that stay row-major
        // (f32; bf16 with an odd number of columns).
        let tensors = [
            ("a", "BF16", vec![37, 10]),
            ("b", "BF16", vec![16, 64]),
            ("c", "BF16", vec![5, 2]),
            ("d", "F32", vec![20, 4]),
            ("e", "BF16", vec![17, 5]),
        ];
        let file = write_checkpoint(tmp.path(), &tensors);
        let store = Store::open(tmp.path()).unwrap();
        for (name, dtype, shape) in &tensors {
            let w = store.weight(name, shape).unwrap();
            // Prefill before any decode reads the file; a decode-sized call packs (when it can),
            // and from then on every call reads the panels.
            assert_eq!(w.view(64).layout, Layout::Rows, "{name}");
            let m = w.view(crate::matmul::MATVEC_ROWS);
            let packed = *dtype == "BF16" && shape[1] % 2 == 0;
            let want = if packed && crate::matmul::panels_pay() {
                Layout::Panels
            } else {
                Layout::Rows
            };
            assert_eq!(m.layout, want, "{name}");
            assert_eq!(w.view(64).layout, want, "{name}");
            let start = store.tensors[*name].1.start;
            assert_eq!(first_difference(m, &file, start), None, "{name}");
            if packed {
                // The panels themselves, whichever view this CPU's kernels take.
                let m = w.pack();
                assert_eq!(m.layout, Layout::Panels, "{name}");
                assert_eq!(first_difference(m, &file, start), None, "{name}");
                let (rows, cols) = (shape[0], shape[1]);
                assert_eq!(m.bytes.len(), rows.div_ceil(PANEL) * PANEL * cols * 2);
                // The last panel's padding rows are zero.
                let last = &m.bytes[rows / PANEL * PANEL * cols * 2..];
                for q in 0..(cols / 2) * usize::from(rows % PANEL > 0) {
                    for j in rows % PANEL..PANEL {
                        let at = q * PANEL * 4 + j * 4;
                        assert_eq!(last[at..at + 4], [0; 4], "{name} pad row {j} pair {q}");
                    }
                }
            }
        }
        // Controls: one flipped byte in the panels is caught at its element; the same bytes
        // read as row-major are not the matrix.
        let m = store.weight("a", &[37, 10]).unwrap().pack();
        let mut bytes = m.bytes.to_vec();
        // Row 20 (panel 1, word 4), column pair 3, high byte of column 7.
        bytes[PANEL * 10 * 2 + 3 * PANEL * 4 + 4 * 4 + 3] ^= 0x40;
        let start = store.tensors["a"].1.start;
        let flipped = Mat { bytes: &bytes, ..m };
        assert_eq!(first_difference(flipped, &file, start), Some((20, 7)));
        let rows = Mat::rows(WDType::BF16, 37, 10, &m.bytes[..37 * 10 * 2]);
        assert!(first_difference(rows, &file, start).is_some());
    }

    #[test]
    fn load_errors_name_the_file_and_tensor() {
        let tmp = tempfile::tempdir().unwrap();
        let mut file = write_checkpoint(tmp.path(), &[("w", "BF16", vec![4, 8])]);
        let store = Store::open(tmp.path()).unwrap();
        let e = store.weight("w", &[8, 4]).err().unwrap().to_string();
        assert!(e.contains("tensor w: shape [4, 8], expected [8, 4]"), "{e}");
        let e = store.take("v", &[1]).err().unwrap().to_string();
        assert!(e.contains("missing tensor v"), "{e}");
        // A truncated data buffer: refused on the header, naming the file.
        file.truncate(file.len() - 2);
        std::fs::write(tmp.path().join("model.safetensors"), &file).unwrap();
        let e = Store::open(tmp.path()).err().unwrap().to_string();
        assert!(
            e.contains("model.safetensors: tensor w: data_offsets [0, 64] outside"),
            "{e}"
        );
    }
}
