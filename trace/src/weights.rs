//! The weights digest: which model files a producer read, hashed as stored (provenance's
//! `weights_digest`; docs/trace-format.md).

use std::io::Read;
use std::path::{Path, PathBuf};

use xxhash_rust::xxh3::Xxh3;

use crate::digest::xxh3_hex;
use crate::error::{Error, Result};

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
