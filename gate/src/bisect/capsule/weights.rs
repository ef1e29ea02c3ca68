//! A capsule's weights: the failing layer's tensors as the checkpoint stores them
//! (`layer.safetensors`, every dtype kept), and the replay model a candidate loads as it loads
//! any model: `config.json` and one `model.safetensors` holding every tensor of the checkpoint,
//! the layer's with their bytes and all others zero. The zeros are a hole in the file (sparse on
//! disk); the layer verb never reads another layer's, the embedding's or the head's weights.
//! The replay file's header is recorded whole in the manifest, so any writer (this one, the
//! generated pytest file) places the same bytes and the replay model's weights digest is the
//! one the capsule's reference trace records.

use std::collections::BTreeMap;
use std::io::{Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};

use serde_json::{json, Map, Value};

use crate::{gerr, Result};

/// Largest safetensors header read (the format's own readers allow 100 MB).
const MAX_HEADER: u64 = 100 << 20;

/// One tensor of a checkpoint: where its bytes are.
#[derive(Clone, Debug)]
pub(super) struct Entry {
    pub name: String,
    pub dtype: String,
    pub shape: Vec<u64>,
    pub file: PathBuf,
    /// Absolute byte range in `file`.
    pub begin: u64,
    pub end: u64,
}

fn header(path: &Path) -> Result<(Map<String, Value>, u64)> {
    let shown = path.display();
    let mut f = std::fs::File::open(path).map_err(|e| gerr!(File: "{shown}: {e}"))?;
    let mut len = [0u8; 8];
    f.read_exact(&mut len)
        .map_err(|e| gerr!(File: "{shown}: not a safetensors file: {e}"))?;
    let len = u64::from_le_bytes(len);
    if len > MAX_HEADER {
        return Err(gerr!(File: "{shown}: not a safetensors file: header of {len} bytes"));
    }
    let mut text = vec![0u8; len as usize];
    f.read_exact(&mut text)
        .map_err(|e| gerr!(File: "{shown}: safetensors header of {len} bytes: {e}"))?;
    let map: Map<String, Value> = serde_json::from_slice(&text)
        .map_err(|e| gerr!(File: "{shown}: safetensors header: {e}"))?;
    Ok((map, 8 + len))
}

/// Every tensor of `file`, by its header.
pub(super) fn entries(file: &Path) -> Result<Vec<Entry>> {
    let (map, start) = header(file)?;
    let mut out = Vec::new();
    for (name, v) in map.iter().filter(|(k, _)| *k != "__metadata__") {
        let bad = || gerr!(File: "{}: safetensors header entry {name:?} is not {{dtype, shape, data_offsets}}", file.display());
        let dtype = v.get("dtype").and_then(Value::as_str).ok_or_else(bad)?;
        let shape = v
            .get("shape")
            .and_then(Value::as_array)
            .ok_or_else(bad)?
            .iter()
            .map(|d| d.as_u64().ok_or_else(bad))
            .collect::<Result<Vec<u64>>>()?;
        let off = v
            .get("data_offsets")
            .and_then(Value::as_array)
            .filter(|o| o.len() == 2)
            .ok_or_else(bad)?;
        let (b, e) = (
            off[0].as_u64().ok_or_else(bad)?,
            off[1].as_u64().ok_or_else(bad)?,
        );
        if e < b {
            return Err(bad());
        }
        out.push(Entry {
            name: name.clone(),
            dtype: dtype.to_string(),
            shape,
            file: file.to_path_buf(),
            begin: start + b,
            end: start + e,
        });
    }
    Ok(out)
}

/// What the capsule keeps of layer `layer`'s weights in `model`: a GGUF model's quantised
/// blocks (super::gguf), else the safetensors checkpoint's tensors as stored.
pub(super) fn of_model(model: &Path, layer: usize) -> Result<LayerWeights> {
    match tracegate_trace::gguf_file(model).map_err(|e| gerr!(File: "{e}"))? {
        Some(g) => super::gguf::layer_weights(&g, layer),
        None => layer_weights(&checkpoint(model)?, layer, model),
    }
}

/// Every tensor of the safetensors checkpoint in `model` (all its `*.safetensors` files), by
/// name.
pub(super) fn checkpoint(model: &Path) -> Result<Vec<Entry>> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(model)
        .map_err(|e| gerr!(File: "{}: {e}", model.display()))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "safetensors"))
        .collect();
    files.sort();
    if files.is_empty() {
        return Err(gerr!(File: "{}: no *.safetensors file", model.display()));
    }
    let mut all = Vec::new();
    for f in &files {
        all.extend(entries(f)?);
    }
    all.sort_by(|a, b| a.name.cmp(&b.name));
    if let Some(w) = all.windows(2).find(|w| w[0].name == w[1].name) {
        return Err(gerr!(File: "{}: tensor {} is in two files", model.display(), w[0].name));
    }
    Ok(all)
}

/// Whether `name` is one of decoder layer `layer`'s tensors: a `layers.L.` component
/// (`model.layers.3.mlp.up_proj.weight`, `model.language_model.layers.3.…`).
pub(super) fn of_layer(name: &str, layer: usize) -> bool {
    let parts: Vec<&str> = name.split('.').collect();
    let l = layer.to_string();
    parts.windows(2).any(|w| w[0] == "layers" && w[1] == l)
}

/// A safetensors header over `tensors` (name, dtype, shape, byte length), in name order, data
/// contiguous; padded with spaces so the data starts 8-byte aligned.
pub(super) fn header_text(tensors: &[(&str, &str, &[u64], u64)]) -> (String, u64) {
    let mut map = Map::new();
    map.insert("__metadata__".into(), json!({"format": "pt"}));
    let mut at = 0u64;
    for (name, dtype, shape, len) in tensors {
        map.insert(
            name.to_string(),
            json!({"dtype": dtype, "shape": shape, "data_offsets": [at, at + len]}),
        );
        at += len;
    }
    let mut text = Value::Object(map).to_string();
    while !(8 + text.len()).is_multiple_of(8) {
        text.push(' ');
    }
    (text, at)
}

pub(super) fn read_range(e: &Entry) -> Result<Vec<u8>> {
    let shown = e.file.display();
    let mut f = std::fs::File::open(&e.file).map_err(|err| gerr!(File: "{shown}: {err}"))?;
    f.seek(SeekFrom::Start(e.begin))
        .map_err(|err| gerr!(File: "{shown}: {err}"))?;
    let mut buf = vec![0u8; (e.end - e.begin) as usize];
    f.read_exact(&mut buf)
        .map_err(|err| gerr!(File: "{shown}: tensor {}: {err}", e.name))?;
    Ok(buf)
}

/// What the capsule keeps of the weights: `layer.safetensors`'s bytes (the layer's tensors as
/// stored), whether the model's `config.json` is copied (a GGUF's config is its header), and
/// the manifest's `weights` fields that say how the replay model is built (`materialise`).
pub(super) struct LayerWeights {
    pub layer_file: Vec<u8>,
    pub config: bool,
    pub replay: Map<String, Value>,
}

pub(super) fn layer_weights(all: &[Entry], layer: usize, model: &Path) -> Result<LayerWeights> {
    let mine: Vec<&Entry> = all.iter().filter(|e| of_layer(&e.name, layer)).collect();
    if mine.is_empty() {
        return Err(
            gerr!(File: "{}: no tensor of layer {layer} (no name with a layers.{layer}. component)", model.display()),
        );
    }
    let spec = |es: &[&Entry]| -> (String, u64) {
        let refs: Vec<(&str, &str, &[u64], u64)> = es
            .iter()
            .map(|e| {
                (
                    e.name.as_str(),
                    e.dtype.as_str(),
                    e.shape.as_slice(),
                    e.end - e.begin,
                )
            })
            .collect();
        header_text(&refs)
    };
    let (text, _) = spec(&mine);
    let mut layer_file = (text.len() as u64).to_le_bytes().to_vec();
    layer_file.extend_from_slice(text.as_bytes());
    for e in &mine {
        layer_file.extend(read_range(e)?);
    }
    let (replay_header, _) = spec(&all.iter().collect::<Vec<_>>());
    let names: Vec<&str> = mine.iter().map(|e| e.name.as_str()).collect();
    let replay = json!({
        "format": "safetensors", "layer_file": "layer.safetensors", "tensors": names,
        "other_tensors": all.len() - mine.len(), "replay_file": "model.safetensors",
        "replay_header": replay_header,
    });
    Ok(LayerWeights {
        layer_file,
        config: true,
        replay: replay.as_object().cloned().unwrap_or_default(),
    })
}

/// Writes the replay model the manifest's `weights` describe into `out` (emptied first) and
/// returns its weights digest (`tracegate_trace::weights_digest`, the one definition). A GGUF
/// capsule: super::gguf::materialise. Else `config.json` from the capsule and
/// `model.safetensors` with `replay_header`'s layout, the layer file's tensors at their offsets
/// and zeros (a hole) elsewhere.
pub(super) fn materialise(capsule: &Path, weights: &Value, out: &Path) -> Result<String> {
    let io = |p: &Path, e: std::io::Error| gerr!(File: "{}: {e}", p.display());
    if out.exists() {
        std::fs::remove_dir_all(out).map_err(|e| io(out, e))?;
    }
    std::fs::create_dir_all(out).map_err(|e| io(out, e))?;
    if weights["format"] == "gguf" {
        super::gguf::materialise(capsule, weights, out)?;
        return tracegate_trace::weights_digest(out)
            .map_err(|e| gerr!(File: "{}: {e}", out.display()));
    }
    let header = weights["replay_header"].as_str().unwrap_or_default();
    std::fs::copy(capsule.join("config.json"), out.join("config.json"))
        .map_err(|e| io(&capsule.join("config.json"), e))?;
    let layout: Map<String, Value> = serde_json::from_str(header).map_err(
        |e| gerr!(File: "{}: replay header: {e}", capsule.join("manifest.json").display()),
    )?;
    let start = 8 + header.len() as u64;
    let mut total = 0u64;
    let mut at: BTreeMap<&str, (u64, u64)> = BTreeMap::new();
    for (name, v) in layout.iter().filter(|(k, _)| *k != "__metadata__") {
        let off = v.get("data_offsets").and_then(Value::as_array);
        let (Some(b), Some(e)) = (
            off.and_then(|o| o.first()).and_then(Value::as_u64),
            off.and_then(|o| o.get(1)).and_then(Value::as_u64),
        ) else {
            return Err(
                gerr!(File: "{}: replay header entry {name:?} has no data_offsets", capsule.join("manifest.json").display()),
            );
        };
        total = total.max(e);
        at.insert(name, (b, e));
    }
    let path = out.join("model.safetensors");
    let mut f = std::fs::File::create(&path).map_err(|e| io(&path, e))?;
    f.write_all(&(header.len() as u64).to_le_bytes())
        .and_then(|()| f.write_all(header.as_bytes()))
        .map_err(|e| io(&path, e))?;
    let layer_file = capsule.join("layer.safetensors");
    for e in entries(&layer_file)? {
        let Some(&(b, end)) = at.get(e.name.as_str()) else {
            return Err(
                gerr!(File: "{}: tensor {} is not in the replay header", layer_file.display(), e.name),
            );
        };
        if end - b != e.end - e.begin {
            return Err(
                gerr!(File: "{}: tensor {} holds {} bytes, the replay header {}", layer_file.display(), e.name, e.end - e.begin, end - b),
            );
        }
        let bytes = read_range(&e)?;
        f.seek(SeekFrom::Start(start + b))
            .and_then(|_| f.write_all(&bytes))
            .map_err(|err| io(&path, err))?;
    }
    f.set_len(start + total).map_err(|e| io(&path, e))?;
    drop(f);
    tracegate_trace::weights_digest(out).map_err(|e| gerr!(File: "{}: {e}", out.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `layers.1.` is layer 1's, never layer 10's or 11's.
    #[test]
    fn of_layer_reads_the_whole_index() {
        assert!(of_layer("model.layers.1.mlp.up_proj.weight", 1));
        assert!(of_layer(
            "model.language_model.layers.1.input_layernorm.weight",
            1
        ));
        assert!(!of_layer("model.layers.10.mlp.up_proj.weight", 1));
        assert!(!of_layer("model.layers.11.mlp.up_proj.weight", 1));
        assert!(!of_layer("model.embed_tokens.weight", 1));
    }
}
