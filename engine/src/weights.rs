//! Checkpoint access: a careful safetensors header parser, tensor views that widen bf16/f16 to
//! f32 at use (never a full f32 copy), the inventory check and the weights digest. The files'
//! bytes are held as the file mapping (the default) or copied, unconverted, into anonymous
//! memory asking for huge pages: `TRACEGATE_ENGINE_WEIGHTS` (`Residence`).
//!
//! safetensors layout: `u64 LE header length N`, `N bytes of JSON`, then the data buffer. The
//! JSON maps tensor names to `{dtype, shape, data_offsets: [begin, end]}` (offsets relative to
//! the data buffer) plus an optional `__metadata__` string map. Every size is checked before use.

use std::collections::BTreeMap;
use std::fs::File;
use std::path::{Path, PathBuf};

use memmap2::{Advice, Mmap, MmapMut, MmapOptions};
use rayon::prelude::*;

use crate::{err, Result};

/// Largest header accepted; real headers are kilobytes, this bounds a hostile length field.
const MAX_HEADER_BYTES: u64 = 100 << 20;

/// Storage dtypes the engine can widen exactly to f32.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WDType {
    F32,
    F16,
    BF16,
}

impl WDType {
    pub fn size(self) -> usize {
        match self {
            WDType::F32 => 4,
            WDType::F16 | WDType::BF16 => 2,
        }
    }
    pub fn name(self) -> &'static str {
        match self {
            WDType::F32 => "F32",
            WDType::F16 => "F16",
            WDType::BF16 => "BF16",
        }
    }
}

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

/// A 2-D weight matrix `[rows, cols]` (row-major) viewed in place in the mapped file.
#[derive(Clone, Copy)]
pub struct Mat<'a> {
    pub dtype: WDType,
    pub rows: usize,
    pub cols: usize,
    pub bytes: &'a [u8],
}

impl<'a> Mat<'a> {
    /// Rows `r0 .. r0+n` as their own matrix (used to split fused expert tensors).
    pub fn row_block(&self, r0: usize, n: usize) -> Mat<'a> {
        let rb = self.cols * self.dtype.size();
        Mat {
            dtype: self.dtype,
            rows: n,
            cols: self.cols,
            bytes: &self.bytes[r0 * rb..(r0 + n) * rb],
        }
    }

    /// Widen `out.len()` elements of row `r` starting at column `c0` (exact).
    #[inline]
    pub fn widen_row(&self, r: usize, c0: usize, out: &mut [f32]) {
        let s = self.dtype.size();
        let off = (r * self.cols + c0) * s;
        let b = &self.bytes[off..off + out.len() * s];
        widen(self.dtype, b, out);
    }

    /// Whole matrix widened (only for small tensors: norms, biases).
    pub fn to_vec(&self) -> Vec<f32> {
        let mut v = vec![0.0; self.rows * self.cols];
        widen(self.dtype, self.bytes, &mut v);
        v
    }
}

/// Exact widening of little-endian storage to f32.
#[inline]
pub fn widen(dtype: WDType, b: &[u8], out: &mut [f32]) {
    match dtype {
        WDType::F32 => {
            for (o, c) in out.iter_mut().zip(b.chunks_exact(4)) {
                *o = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
            }
        }
        WDType::BF16 => {
            for (o, c) in out.iter_mut().zip(b.chunks_exact(2)) {
                *o = f32::from_bits((u16::from_le_bytes([c[0], c[1]]) as u32) << 16);
            }
        }
        WDType::F16 => {
            for (o, c) in out.iter_mut().zip(b.chunks_exact(2)) {
                *o = half::f16::from_bits(u16::from_le_bytes([c[0], c[1]])).to_f32();
            }
        }
    }
}

/// Refuse a path that is not a regular file before opening it: opening a FIFO for reading blocks
/// until a writer comes, which may be never. (A file swapped between this check and the open is
/// not caught; the checkpoint must not change while the engine runs, as for the mapping.)
pub fn regular_file(p: &Path) -> Result<()> {
    let m = std::fs::metadata(p).map_err(|e| err!(Checkpoint: "{}: {e}", p.display()))?;
    if m.is_file() {
        Ok(())
    } else {
        Err(err!(Checkpoint: "{}: not a regular file", p.display()))
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
    regular_file(path)?;
    let text =
        std::fs::read_to_string(path).map_err(|e| err!(Checkpoint: "{}: {e}", path.display()))?;
    let v: serde_json::Value = serde_json::from_str(&text)
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

/// Where the checkpoint's bytes live while the engine runs, chosen by the environment variable
/// `TRACEGATE_ENGINE_WEIGHTS`.
///
/// - `mmap` (the default, also when the variable is unset or empty): the file mapping itself.
///   No load-time copy, and only the pages a run touches are read (a MoE run that routes to
///   few experts resides in less memory).
/// - `copy`: each file is read once with `pread`, unconverted, into anonymous memory aligned to
///   2 MiB and advised `MADV_HUGEPAGE` (transparent huge pages are normally available to
///   anonymous memory only). Decode streams every weight once per token; through 4 KiB pages
///   that costs a TLB walk per page. Measured (docs/benchmarks.md, "Decode at one and two
///   threads"): faster decode on the AMD development machine, no difference for this access
///   pattern on the 16-core Xeon, and seconds of load time on a loaded machine for the 0.6B
///   shape, hence opt-in. The file is never mapped beyond its header, so peak RSS is the
///   checkpoint's size (bf16: half the f32 weights), not that plus the file's pages.
///
/// The bytes are the same either way (tested), so every output bit is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Residence {
    Copy,
    Mmap,
}

/// The environment variable that picks the `Residence`.
pub const WEIGHTS_ENV: &str = "TRACEGATE_ENGINE_WEIGHTS";

impl Residence {
    /// The value of `TRACEGATE_ENGINE_WEIGHTS` (`None`: unset).
    pub fn parse(v: Option<&std::ffi::OsStr>) -> Result<Residence> {
        match v.map(|v| v.to_str()) {
            None | Some(Some("" | "mmap")) => Ok(Residence::Mmap),
            Some(Some("copy")) => Ok(Residence::Copy),
            Some(other) => Err(err!(Input:
                "{WEIGHTS_ENV}={}: expected copy or mmap",
                other.map_or_else(|| format!("{v:?}"), |s| format!("{s:?}"))
            )),
        }
    }

    pub fn from_env() -> Result<Residence> {
        Residence::parse(std::env::var_os(WEIGHTS_ENV).as_deref())
    }
}

/// Huge-page size the copy is aligned to (x86-64 and aarch64 with 4 KiB base pages).
const HUGE_PAGE: usize = 2 << 20;
/// Bytes per `pread` of the copy; the pieces are read on the pool.
const READ_CHUNK: usize = 16 << 20;

/// One file's bytes: its mapping, or its copy at `off..off + len` of an anonymous mapping
/// (padded by `HUGE_PAGE` so the copy can start on a huge-page boundary).
enum FileBytes {
    Mapped(Mmap),
    Copied {
        map: MmapMut,
        off: usize,
        len: usize,
    },
}

impl std::ops::Deref for FileBytes {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        match self {
            FileBytes::Mapped(m) => m,
            FileBytes::Copied { map, off, len } => &map[*off..*off + *len],
        }
    }
}

/// Read all `len` bytes of `f` (named `path` in errors) into anonymous memory on a huge-page
/// boundary, advised `MADV_HUGEPAGE`, the pieces read in parallel.
fn copy_file(f: &File, path: &Path, len: usize) -> Result<FileBytes> {
    use std::os::unix::fs::FileExt;
    let mut map = MmapOptions::new().len(len + HUGE_PAGE).map_anon().map_err(
        |e| err!(Checkpoint: "{}: cannot allocate {len} bytes for the copy: {e}", path.display()),
    )?;
    let off = (HUGE_PAGE - map.as_ptr() as usize % HUGE_PAGE) % HUGE_PAGE;
    // A hint: a kernel without transparent huge pages refuses it and the copy keeps 4 KiB pages
    // (the bench prints how much of the process is on huge pages: `anon_huge_bytes`).
    let _ = map.advise(Advice::HugePage);
    map[off..off + len]
        .par_chunks_mut(READ_CHUNK)
        .enumerate()
        .try_for_each(|(i, chunk)| f.read_exact_at(chunk, (i * READ_CHUNK) as u64))
        .map_err(|e| err!(Checkpoint: "{}: cannot read: {e}", path.display()))?;
    Ok(FileBytes::Copied { map, off, len })
}

/// All tensors of a checkpoint, read-only. `take` hands out views and records which
/// names were claimed, so `finish_claims` can refuse tensors no module uses.
pub struct Store {
    maps: Vec<FileBytes>,
    /// name → (map index, entry)
    tensors: BTreeMap<String, (usize, Entry)>,
    claimed: std::cell::RefCell<std::collections::BTreeSet<String>>,
}

impl Store {
    /// Open the checkpoint in `dir`, its bytes held as `TRACEGATE_ENGINE_WEIGHTS` says.
    pub fn open(dir: &Path) -> Result<Store> {
        Store::open_with(dir, Residence::from_env()?)
    }

    pub fn open_with(dir: &Path, residence: Residence) -> Result<Store> {
        let files = safetensors_files(dir)?;
        let index = dir.join("model.safetensors.index.json");
        let weight_map = if index.exists() {
            Some(read_index(&index)?)
        } else {
            None
        };
        let mut maps = Vec::new();
        let mut tensors = BTreeMap::new();
        for p in &files {
            regular_file(p)?;
            let f = File::open(p).map_err(|e| err!(Checkpoint: "{}: {e}", p.display()))?;
            // SAFETY: mapped read-only; the checkpoint must not be modified while the engine runs
            // (the same contract every mmap-based loader has).
            let m = unsafe { Mmap::map(&f) }
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
            maps.push(match residence {
                Residence::Mmap => FileBytes::Mapped(m),
                // The header is checked on the mapping (only its pages read); the mapping goes
                // before the copy is made, so its pages never add to the copy's.
                Residence::Copy => {
                    let len = m.len();
                    drop(m);
                    copy_file(&f, p, len)?
                }
            });
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
        Ok(Store {
            maps,
            tensors,
            claimed: Default::default(),
        })
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
        self.claimed.borrow_mut().insert(name.to_string());
        let (rows, cols) = match shape {
            [n] => (1, *n),
            [r, c] => (*r, *c),
            [a, r, c] => (a * r, *c),
            _ => return Err(err!(Checkpoint: "tensor {name}: unsupported rank {}", shape.len())),
        };
        Ok(Mat {
            dtype,
            rows,
            cols,
            bytes: &self.maps[*mi][e.start..e.end],
        })
    }

    /// Refuse the checkpoint if any tensor was not claimed by the model.
    pub fn finish_claims(&self) -> Result<()> {
        let claimed = self.claimed.borrow();
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
        let mut claimed = self.claimed.borrow_mut();
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

    /// The first tensor (name order) whose bytes in the store differ from the file's.
    fn first_difference(store: &Store, file: &[u8]) -> Option<String> {
        store
            .tensors
            .iter()
            .find(|(_, (mi, e))| store.maps[*mi][e.start..e.end] != file[e.start..e.end])
            .map(|(name, _)| name.clone())
    }

    #[test]
    fn copied_weights_equal_the_files_bytes_for_every_tensor() {
        let tmp = tempfile::tempdir().unwrap();
        // "big" spans several READ_CHUNK pieces (the last one partial), read in parallel.
        let big = READ_CHUNK * 2 / 4 + 12345;
        let tensors = [
            ("a", "BF16", vec![3, 5]),
            ("big", "F32", vec![big]),
            ("c", "F16", vec![7]),
            ("d", "F32", vec![2, 2]),
        ];
        let file = write_checkpoint(tmp.path(), &tensors);
        assert!(file.len() > 2 * READ_CHUNK);
        for residence in [Residence::Copy, Residence::Mmap] {
            let store = Store::open_with(tmp.path(), residence).unwrap();
            assert_eq!(first_difference(&store, &file), None, "{residence:?}");
            // What the model reads: `take` hands out the same bytes.
            for (name, _, shape) in &tensors {
                let e = &store.tensors[*name].1;
                assert_eq!(
                    store.take(name, shape).unwrap().bytes,
                    &file[e.start..e.end]
                );
            }
            match (&store.maps[0], residence) {
                (FileBytes::Copied { map, off, .. }, Residence::Copy) => {
                    assert_eq!((map.as_ptr() as usize + off) % HUGE_PAGE, 0)
                }
                (FileBytes::Mapped(_), Residence::Mmap) => {}
                _ => panic!("{residence:?}: the store holds the other kind of bytes"),
            }
        }
        // Control: one flipped byte in the copy (the last of "big", in the partial last piece)
        // is caught and named.
        let mut store = Store::open_with(tmp.path(), Residence::Copy).unwrap();
        let at = store.tensors["big"].1.end - 1;
        let FileBytes::Copied { map, off, .. } = &mut store.maps[0] else {
            panic!("not a copy")
        };
        map[*off + at] ^= 0x10;
        assert_eq!(first_difference(&store, &file).as_deref(), Some("big"));
    }

    #[test]
    fn copy_load_errors_name_the_file_and_tensor() {
        let tmp = tempfile::tempdir().unwrap();
        let mut file = write_checkpoint(tmp.path(), &[("w", "BF16", vec![4, 8])]);
        let store = Store::open_with(tmp.path(), Residence::Copy).unwrap();
        let e = store.take("w", &[8, 4]).err().unwrap().to_string();
        assert!(e.contains("tensor w: shape [4, 8], expected [8, 4]"), "{e}");
        let e = store.take("v", &[1]).err().unwrap().to_string();
        assert!(e.contains("missing tensor v"), "{e}");
        // A truncated data buffer: refused on the header, naming the file, before any copy.
        file.truncate(file.len() - 2);
        std::fs::write(tmp.path().join("model.safetensors"), &file).unwrap();
        for residence in [Residence::Copy, Residence::Mmap] {
            let e = Store::open_with(tmp.path(), residence)
                .err()
                .unwrap()
                .to_string();
            assert!(
                e.contains("model.safetensors: tensor w: data_offsets [0, 64] outside"),
                "{residence:?}: {e}"
            );
        }
    }

    #[test]
    fn weights_env_values() {
        use std::ffi::OsStr;
        let p = |v: Option<&str>| Residence::parse(v.map(OsStr::new));
        assert_eq!(p(None).unwrap(), Residence::Mmap);
        assert_eq!(p(Some("")).unwrap(), Residence::Mmap);
        assert_eq!(p(Some("copy")).unwrap(), Residence::Copy);
        assert_eq!(p(Some("mmap")).unwrap(), Residence::Mmap);
        let e = p(Some("Mmap")).err().unwrap().to_string();
        assert_eq!(
            e,
            "TRACEGATE_ENGINE_WEIGHTS=\"Mmap\": expected copy or mmap"
        );
    }
}
