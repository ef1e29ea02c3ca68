use std::io::Read;
use std::path::{Path, PathBuf};

use sha2::{Digest as _, Sha256};
use xxhash_rust::xxh3::Xxh3;

use crate::attrs::{AttrValue, Attributes};
use crate::dtype::DType;
use crate::error::{Error, Result};

/// The whole-trace content digest: sha256 over the canonical encoding.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct Digest(pub [u8; 32]);

impl Digest {
    pub fn hex(&self) -> String {
        hex::encode(self.0)
    }
    /// The first 16 hex digits, for tables.
    pub fn short(&self) -> String {
        self.hex()[..16].to_string()
    }
    pub fn from_hex(s: &str) -> Option<Digest> {
        let mut out = [0u8; 32];
        hex::decode_to_slice(s, &mut out).ok()?;
        Some(Digest(out))
    }
}

impl std::fmt::Debug for Digest {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Digest({})", self.hex())
    }
}
impl std::fmt::Display for Digest {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.hex())
    }
}

/// xxh3-128 as 32 hex digits, big-endian (xxHash's canonical representation).
pub fn xxh3_hex(h: u128) -> String {
    hex::encode(h.to_be_bytes())
}

/// Only the canonical (lowercase) form: one value, one spelling.
pub(crate) fn parse_xxh3_hex(s: &str) -> Option<u128> {
    if !crate::layout::is_lower_hex(s) {
        return None;
    }
    let mut out = [0u8; 16];
    hex::decode_to_slice(s, &mut out).ok()?;
    Some(u128::from_be_bytes(out))
}

/// Canonical content encoding, fed straight into sha256 (see docs/trace-format.md).
pub(crate) struct Canonical(Sha256);

impl Canonical {
    pub fn new(n_tensors: usize) -> Self {
        let mut c = Canonical(Sha256::new());
        c.str("tracegate-content-v1");
        c.u64(n_tensors as u64);
        c
    }
    fn u64(&mut self, v: u64) {
        self.0.update(v.to_le_bytes());
    }
    fn str(&mut self, s: &str) {
        self.u64(s.len() as u64);
        self.0.update(s.as_bytes());
    }
    fn shape(&mut self, shape: &[u64]) {
        self.u64(shape.len() as u64);
        for &d in shape {
            self.u64(d);
        }
    }
    pub fn tensor(
        &mut self,
        name: &str,
        dtype: DType,
        shape: &[u64],
        attrs: &Attributes,
        xxh3: u128,
    ) {
        self.str(name);
        self.str(dtype.name());
        self.shape(shape);
        let sorted = attrs.sorted();
        self.u64(sorted.len() as u64);
        for (key, value) in sorted {
            self.str(key);
            match value {
                AttrValue::Str(s) => {
                    self.0.update([1u8]);
                    self.str(s);
                }
                AttrValue::Int(i) => {
                    self.0.update([2u8]);
                    self.0.update(i.to_le_bytes());
                }
                AttrValue::Ints(list) => {
                    self.0.update([3u8]);
                    self.u64(list.len() as u64);
                    for i in list {
                        self.0.update(i.to_le_bytes());
                    }
                }
            }
        }
        self.0.update(xxh3.to_be_bytes());
    }
    pub fn begin_decisions(&mut self, n: usize) {
        self.u64(n as u64);
    }
    /// `values` and `margins` are the little-endian payload bytes as stored.
    pub fn decision(&mut self, name: &str, shape: &[u64], values: &[u8], margins: Option<&[u8]>) {
        self.str(name);
        self.shape(shape);
        self.u64((values.len() / 8) as u64);
        self.0.update(values);
        match margins {
            None => self.0.update([0u8]),
            Some(m) => {
                self.0.update([1u8]);
                self.u64((m.len() / 4) as u64);
                self.0.update(m);
            }
        }
    }
    pub fn finish(self) -> Digest {
        Digest(self.0.finalize().into())
    }
}

/// xxh3-128 over the bytes of the model's weight files, streamed: every `*.safetensors` file of
/// the directory `model` in sorted file-name order; or, for a GGUF model (`model` is a `.gguf`
/// file, or a directory whose weights are one `.gguf` file and no safetensors), that file's
/// bytes — its tensor data with the header that places it, so a quantized port that loads the
/// file records the digest every producer of that file records. Recorded in provenance so two
/// producers that read different weights are refused.
pub fn weights_digest(model: &Path) -> Result<String> {
    let mut files = weight_files(model)?;
    files.sort();
    hash_files(&files)
}

/// The GGUF file a model path names, if it names one: the path itself when it is a file (read as
/// GGUF, refused by its magic if it is not one), or the one `*.gguf` of a directory that holds no
/// `*.safetensors`; `None` for a safetensors checkpoint, or a directory that cannot be listed (its
/// loader names what is missing). A path that does not exist is refused as such (not as a
/// missing `PATH/config.json`, which sent a mistyped `X.gguf` to look for a config). A directory holding both kinds, or several `.gguf` files, is
/// refused: which weights a producer read would be a guess. The one rule of the engine's loader
/// and of [`weights_digest`].
pub fn gguf_file(model: &Path) -> Result<Option<PathBuf>> {
    let meta = match std::fs::metadata(model) {
        Ok(meta) => meta,
        // An I/O error naming the path (TG_ERR_IO through the C ABI, as before).
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Err(Error::io(model, e)),
        Err(_) => return Ok(None),
    };
    if !meta.is_dir() {
        return Ok(Some(model.to_path_buf()));
    }
    let Ok(entries) = std::fs::read_dir(model) else {
        return Ok(None);
    };
    let (mut gguf, mut safetensors) = (Vec::new(), false);
    for entry in entries {
        let name = entry.map_err(|e| Error::io(model, e))?.file_name();
        let name = name.to_string_lossy();
        safetensors |= name.ends_with(".safetensors");
        if name.ends_with(".gguf") {
            gguf.push(name.into_owned());
        }
    }
    gguf.sort();
    match gguf.as_slice() {
        [] => Ok(None),
        _ if safetensors => Err(Error::NotFound(format!(
            "{}: holds both *.safetensors and .gguf files: keep one kind, or give --model FILE.gguf",
            model.display()
        ))),
        [one] => Ok(Some(model.join(one))),
        many => Err(Error::NotFound(format!(
            "{}: {} .gguf files ({}): expected exactly one (split GGUF files are not supported)",
            model.display(),
            many.len(),
            many.join(", ")
        ))),
    }
}

/// The files `weights_digest` hashes (docs/producers.md, "Weights digest").
fn weight_files(model: &Path) -> Result<Vec<PathBuf>> {
    if let Some(file) = gguf_file(model)? {
        return if file.extension().is_some_and(|e| e == "gguf") {
            Ok(vec![file])
        } else {
            Err(Error::NotFound(format!(
                "{}: a model is a directory of *.safetensors or a .gguf file",
                model.display()
            )))
        };
    }
    let entries = std::fs::read_dir(model).map_err(|e| Error::io(model, e))?;
    let mut files = Vec::new();
    for entry in entries {
        let entry = entry.map_err(|e| Error::io(model, e))?;
        if entry
            .file_name()
            .to_string_lossy()
            .ends_with(".safetensors")
        {
            files.push(entry.path());
        }
    }
    if files.is_empty() {
        return Err(Error::NotFound(format!(
            "{}: no *.safetensors or .gguf files",
            model.display()
        )));
    }
    Ok(files)
}

/// Opens the weights file `path` for reading, refused in one line naming it and what it is
/// unless it is a regular file (a symlink is followed): looked at before the open (opening a
/// FIFO for reading blocks until a writer comes, which may be never; `/dev/zero` never ends),
/// opened non-blocking (a FIFO swapped in between cannot block either) and looked at again
/// through the handle, which is what is then read. The one check of every reader of weights
/// files: this digest, the engine's loaders, the C ABI and the Python binding.
pub fn open_weights_file(path: &Path) -> Result<std::fs::File> {
    use std::os::unix::fs::OpenOptionsExt;
    let refuse = |meta: &std::fs::Metadata| {
        Error::NotFound(format!(
            "{}: {}, not a regular file: a weights file must be one",
            path.display(),
            crate::json::file_kind(meta)
        ))
    };
    let meta = std::fs::metadata(path).map_err(|e| Error::io(path, e))?;
    if !meta.is_file() {
        return Err(refuse(&meta));
    }
    let file = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK)
        .open(path)
        .map_err(|e| Error::io(path, e))?;
    let meta = file.metadata().map_err(|e| Error::io(path, e))?;
    if !meta.is_file() {
        return Err(refuse(&meta));
    }
    Ok(file)
}

/// The weights digest of bytes already in memory: `parts` are the weight files' whole contents
/// in [`weights_digest`]'s order. A producer that mapped the files hashes what it computed with,
/// whatever has been renamed over their paths since (the engine: `Store::weights_digest`).
pub fn weights_digest_of<'a>(parts: impl IntoIterator<Item = &'a [u8]>) -> String {
    let mut hasher = Xxh3::new();
    for part in parts {
        hasher.update(part);
    }
    xxh3_hex(hasher.digest128())
}

fn hash_files(files: &[PathBuf]) -> Result<String> {
    let mut hasher = Xxh3::new();
    let mut buf = vec![0u8; 1 << 20];
    for path in files {
        let mut f = open_weights_file(path)?;
        loop {
            let n = f.read(&mut buf).map_err(|e| Error::io(path, e))?;
            if n == 0 {
                break;
            }
            hasher.update(&buf[..n]);
        }
    }
    Ok(xxh3_hex(hasher.digest128()))
}
