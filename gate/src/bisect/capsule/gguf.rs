//! A GGUF model's capsule weights: the failing layer's tensors as quantised (every `blk.L.`
//! tensor's blocks, bytes unchanged) in `layer.safetensors` as `U8` tensors of their byte length,
//! their ggml type and GGUF dims in its `__metadata__`; and the replay GGUF, written as
//! `model.gguf`: the source's header re-written (its metadata, less the `tokenizer.*` keys when
//! `<arch>.vocab_size` gives the vocabulary, and every tensor info with its offset unchanged),
//! the layer's blocks at their offsets and every other tensor's bytes zero (a hole). Zero bytes
//! are a valid block of every type the engine reads: every scale (and min) is a zero f16/f32,
//! so each value is 0·q (− 0·m) = 0 (tested below against the engine's dequantiser). The header
//! is kept in the manifest (`replay_header_hex`) with where each layer tensor goes
//! (`replay_offsets`) and the file's length, so any writer (this one, the pytest file) places
//! the same bytes and the replay's weights digest is the one the capsule's reference records.

use std::io::{Seek, SeekFrom, Write};
use std::path::Path;

use serde_json::{json, Map, Value};
use tracegate_engine::gguf::{parse, Array, Header, Value as Kv};

use super::weights::{entries, header_text, read_range, LayerWeights};
use crate::{gerr, Result};

/// Whether GGUF tensor `name` is decoder layer `layer`'s (`blk.3.attn_q.weight`).
fn of_layer(name: &str, layer: usize) -> bool {
    let mut parts = name.split('.');
    parts.next() == Some("blk") && parts.next() == Some(layer.to_string().as_str())
}

fn put_str(out: &mut Vec<u8>, s: &str) {
    out.extend((s.len() as u64).to_le_bytes());
    out.extend(s.as_bytes());
}

/// GGUF's value type ids (ggml's gguf.h), the array's item type and its items.
fn put_array(out: &mut Vec<u8>, a: &Array) {
    macro_rules! items {
        ($id:expr, $v:expr, $put:expr) => {{
            out.extend(($id as u32).to_le_bytes());
            out.extend(($v.len() as u64).to_le_bytes());
            for x in $v {
                $put(&mut *out, x);
            }
        }};
    }
    match a {
        Array::U8(v) => items!(0, v, |o: &mut Vec<u8>, x: &u8| o.push(*x)),
        Array::I8(v) => items!(1, v, |o: &mut Vec<u8>, x: &i8| o.extend(x.to_le_bytes())),
        Array::U16(v) => items!(2, v, |o: &mut Vec<u8>, x: &u16| o.extend(x.to_le_bytes())),
        Array::I16(v) => items!(3, v, |o: &mut Vec<u8>, x: &i16| o.extend(x.to_le_bytes())),
        Array::U32(v) => items!(4, v, |o: &mut Vec<u8>, x: &u32| o.extend(x.to_le_bytes())),
        Array::I32(v) => items!(5, v, |o: &mut Vec<u8>, x: &i32| o.extend(x.to_le_bytes())),
        Array::F32(v) => items!(6, v, |o: &mut Vec<u8>, x: &f32| o.extend(x.to_le_bytes())),
        Array::Bool(v) => items!(7, v, |o: &mut Vec<u8>, x: &bool| o.push(*x as u8)),
        Array::Str(v) => items!(8, v, |o: &mut Vec<u8>, x: &String| put_str(o, x)),
        Array::Array(v) => items!(9, v, |o: &mut Vec<u8>, x: &Array| put_array(o, x)),
        Array::U64(v) => items!(10, v, |o: &mut Vec<u8>, x: &u64| o.extend(x.to_le_bytes())),
        Array::I64(v) => items!(11, v, |o: &mut Vec<u8>, x: &i64| o.extend(x.to_le_bytes())),
        Array::F64(v) => items!(12, v, |o: &mut Vec<u8>, x: &f64| o.extend(x.to_le_bytes())),
    }
}

fn put_value(out: &mut Vec<u8>, v: &Kv) {
    let (id, bytes): (u32, Vec<u8>) = match v {
        Kv::U8(x) => (0, vec![*x]),
        Kv::I8(x) => (1, x.to_le_bytes().to_vec()),
        Kv::U16(x) => (2, x.to_le_bytes().to_vec()),
        Kv::I16(x) => (3, x.to_le_bytes().to_vec()),
        Kv::U32(x) => (4, x.to_le_bytes().to_vec()),
        Kv::I32(x) => (5, x.to_le_bytes().to_vec()),
        Kv::F32(x) => (6, x.to_le_bytes().to_vec()),
        Kv::Bool(x) => (7, vec![*x as u8]),
        Kv::Str(s) => {
            out.extend(8u32.to_le_bytes());
            return put_str(out, s);
        }
        Kv::Array(a) => {
            out.extend(9u32.to_le_bytes());
            return put_array(out, a);
        }
        Kv::U64(x) => (10, x.to_le_bytes().to_vec()),
        Kv::I64(x) => (11, x.to_le_bytes().to_vec()),
        Kv::F64(x) => (12, x.to_le_bytes().to_vec()),
    };
    out.extend(id.to_le_bytes());
    out.extend(bytes);
}

/// The replay file's header: `h`'s metadata less the tokenizer's when the vocabulary size is a
/// key of its own (the tokenizer is the header's bulk: 1.7 MB of SmolLM2's 1.8 MB), and its
/// tensor infos with their offsets, zero-padded to the alignment. Returns (header, the keys
/// dropped). The data section's layout is the source's: offsets are relative to its start.
fn replay_header(h: &Header) -> (Vec<u8>, Vec<String>) {
    let arch = match h.get("general.architecture") {
        Some(Kv::Str(a)) => a.clone(),
        _ => String::new(),
    };
    let vocab_key = h.get(&format!("{arch}.vocab_size")).is_some();
    let (keep, dropped): (Vec<_>, Vec<_>) = h
        .metadata
        .iter()
        .partition(|(k, _)| !(vocab_key && k.starts_with("tokenizer.")));
    let mut out = b"GGUF".to_vec();
    out.extend(h.version.to_le_bytes());
    out.extend((h.tensors.len() as u64).to_le_bytes());
    out.extend((keep.len() as u64).to_le_bytes());
    for (k, v) in &keep {
        put_str(&mut out, k);
        put_value(&mut out, v);
    }
    for t in &h.tensors {
        put_str(&mut out, &t.name);
        out.extend((t.dims.len() as u32).to_le_bytes());
        for d in &t.dims {
            out.extend(d.to_le_bytes());
        }
        out.extend(t.ggml_type.id().to_le_bytes());
        out.extend(((t.start - h.data_start) as u64).to_le_bytes());
    }
    while !(out.len() as u64).is_multiple_of(h.alignment) {
        out.push(0);
    }
    (out, dropped.into_iter().map(|(k, _)| k.clone()).collect())
}

/// The capsule's weights of layer `layer` of the GGUF file `file`.
pub(super) fn layer_weights(file: &Path, layer: usize) -> Result<LayerWeights> {
    let shown = file.display().to_string();
    let bytes = std::fs::read(file).map_err(|e| gerr!(File: "{shown}: {e}"))?;
    let h = parse(&bytes, &shown).map_err(|e| gerr!(File: "{e}"))?;
    let mine: Vec<_> = h
        .tensors
        .iter()
        .filter(|t| of_layer(&t.name, layer))
        .collect();
    if mine.is_empty() {
        return Err(gerr!(File: "{shown}: no tensor of layer {layer} (no name blk.{layer}.*)"));
    }
    let (header, dropped) = replay_header(&h);
    let base = header.len() as u64;
    let names: Vec<&str> = mine.iter().map(|t| t.name.as_str()).collect();
    let lens: Vec<(u64, [u64; 1])> = mine
        .iter()
        .map(|t| ((t.end - t.start) as u64, [(t.end - t.start) as u64]))
        .collect();
    let spec: Vec<(&str, &str, &[u64], u64)> = names
        .iter()
        .zip(&lens)
        .map(|(n, (len, shape))| (*n, "U8", &shape[..], *len))
        .collect();
    let (text, _) = header_text(&spec);
    // Each tensor's ggml type and GGUF dims (innermost first), where a reader of the file sees
    // them: the tensors themselves are their blocks' bytes.
    let mut layout: Map<String, Value> = serde_json::from_str(&text).unwrap_or_default();
    let mut meta = Map::new();
    meta.insert("format".into(), json!("gguf blocks"));
    for t in &mine {
        let what = format!("{} {:?}", t.ggml_type.name(), t.dims);
        meta.insert(t.name.clone(), json!(what));
    }
    layout.insert("__metadata__".into(), Value::Object(meta));
    let mut text = Value::Object(layout).to_string();
    while !(8 + text.len()).is_multiple_of(8) {
        text.push(' ');
    }
    let mut layer_file = (text.len() as u64).to_le_bytes().to_vec();
    layer_file.extend_from_slice(text.as_bytes());
    let mut offsets = Map::new();
    let mut tensors = Vec::new();
    for t in &mine {
        layer_file.extend_from_slice(&bytes[t.start..t.end]);
        let at = base + (t.start - h.data_start) as u64;
        offsets.insert(t.name.clone(), json!([at, at + (t.end - t.start) as u64]));
        tensors.push(json!({"name": t.name, "ggml_type": t.ggml_type.name(), "dims": t.dims}));
    }
    let end = h
        .tensors
        .iter()
        .map(|t| t.end - h.data_start)
        .max()
        .unwrap_or(0) as u64;
    let replay = json!({
        "format": "gguf", "layer_file": "layer.safetensors", "tensors": tensors,
        "other_tensors": h.tensors.len() - mine.len(), "replay_file": "model.gguf",
        "replay_header_hex": hex::encode(&header), "metadata_dropped": dropped,
        "replay_offsets": offsets, "replay_length": base + end,
    });
    Ok(LayerWeights {
        layer_file,
        config: false,
        replay: replay.as_object().cloned().unwrap_or_default(),
    })
}

/// Writes `out/model.gguf` as the manifest's `weights` say: the header, each tensor of
/// `layer.safetensors` at its `replay_offsets` (its length checked), zeros to `replay_length`.
pub(super) fn materialise(capsule: &Path, weights: &Value, out: &Path) -> Result<()> {
    let manifest = capsule.join("manifest.json");
    let bad =
        |what: &str| gerr!(File: "{}: weights.{what} is missing or malformed", manifest.display());
    let header = weights["replay_header_hex"]
        .as_str()
        .and_then(|h| hex::decode(h).ok())
        .ok_or_else(|| bad("replay_header_hex"))?;
    let length = weights["replay_length"]
        .as_u64()
        .ok_or_else(|| bad("replay_length"))?;
    let offsets = weights["replay_offsets"]
        .as_object()
        .ok_or_else(|| bad("replay_offsets"))?;
    let path = out.join("model.gguf");
    let io = |e: std::io::Error| gerr!(File: "{}: {e}", path.display());
    let mut f = std::fs::File::create(&path).map_err(io)?;
    f.write_all(&header).map_err(io)?;
    let layer_file = capsule.join("layer.safetensors");
    let mine = entries(&layer_file)?;
    if mine.len() != offsets.len() {
        return Err(
            gerr!(File: "{}: {} tensors, weights.replay_offsets places {}", layer_file.display(), mine.len(), offsets.len()),
        );
    }
    for e in mine {
        let at = offsets[&e.name].as_array();
        let (Some(b), Some(end)) = (
            at.and_then(|a| a.first()).and_then(Value::as_u64),
            at.and_then(|a| a.get(1)).and_then(Value::as_u64),
        ) else {
            return Err(
                gerr!(File: "{}: tensor {} is not in weights.replay_offsets", layer_file.display(), e.name),
            );
        };
        if end.checked_sub(b) != Some(e.end - e.begin) || end > length || b < header.len() as u64 {
            return Err(
                gerr!(File: "{}: tensor {} holds {} bytes, weights.replay_offsets places [{b}, {end}) in a file of {length}", layer_file.display(), e.name, e.end - e.begin),
            );
        }
        let bytes = read_range(&e)?;
        f.seek(SeekFrom::Start(b))
            .and_then(|_| f.write_all(&bytes))
            .map_err(io)?;
    }
    f.set_len(length).map_err(io)
}

#[cfg(test)]
mod tests {
    use super::*;
    use tracegate_engine::gguf::{dequantize_row, GgmlType};

    /// The zeros of the replay file are a valid block of every supported type, and dequantise
    /// to 0: the other layers read as zero weights, whatever their type.
    #[test]
    fn zero_blocks_dequantise_to_zero_for_every_supported_type() {
        for t in GgmlType::SUPPORTED {
            let n = t.block_size() as usize;
            let mut out = vec![f32::NAN; 2 * n];
            dequantize_row(t, &vec![0u8; 2 * t.type_size() as usize], &mut out).unwrap();
            assert!(out.iter().all(|x| *x == 0.0), "{}: {out:?}", t.name());
        }
    }

    #[test]
    fn of_layer_reads_the_whole_index() {
        assert!(of_layer("blk.1.attn_q.weight", 1));
        assert!(!of_layer("blk.10.attn_q.weight", 1));
        assert!(!of_layer("token_embd.weight", 1));
        assert!(!of_layer("output.blk.1", 1));
    }
}
