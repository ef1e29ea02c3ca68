//! GGUF weights (llama.cpp's single-file format) as a checkpoint of the engine: the file parsed and
//! checked (`parse`), its tensors dequantized to f32 bit for bit as ggml's Python reference does
//! (`dequant`), and read as the Hugging Face checkpoint transformers' GGUF loader makes of it
//! (`hf`: names, llama's q/k un-permutation, gemma3's norms stored plus one, `config.json`). docs/numerics.md §21 is the
//! definition.
//!
//! `load` parses and maps (cheap: no tensor is read); `GgufModel::read` dequantizes one tensor
//! into Hugging Face layout; `GgufModel::into_store` gives the engine its `Store`, where f32 and
//! bf16 tensors stored as the model reads them stay views into the mapped file and every other
//! tensor is dequantized once into one anonymous f32 mapping.

mod dequant;
mod hf;
mod parse;
#[cfg(test)]
mod tests;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use memmap2::{Mmap, MmapOptions};
use rayon::prelude::*;

pub use dequant::{dequantize_row, f16_to_f32, q4_k_scale_min, GgmlType};
pub use hf::{hf_name, stored_plus_one, unpermuted_row, Arch};
pub use parse::{parse, Array, Header, TensorInfo, Value, DEFAULT_ALIGNMENT, MAX_DIMS};

use crate::weights::{open_weights_file, Entry, Opened, Store};
use crate::{err, Result};

/// One tensor of the Hugging Face checkpoint and where its values come from.
#[derive(Clone, Debug)]
pub struct HfTensor {
    /// The Hugging Face name (`model.layers.0.self_attn.q_proj.weight`).
    pub name: String,
    /// Row-major shape (the GGUF dims reversed).
    pub shape: Vec<usize>,
    /// Index of its GGUF tensor in `GgufModel::header.tensors`.
    pub source: usize,
    /// llama's q/k: the head count of the row permutation to undo (`hf::unpermuted_row`).
    pub permuted_heads: Option<usize>,
    /// gemma3's norm weights: stored as `w + 1`, read as `stored ⊖ 1` (`hf::stored_plus_one`).
    pub minus_one: bool,
}

/// A GGUF file read as a Hugging Face checkpoint.
pub struct GgufModel {
    pub path: PathBuf,
    /// The file `map` maps, as opened.
    file: Opened,
    map: Mmap,
    pub header: Header,
    pub arch: Arch,
    /// The `config.json` transformers' GGUF loader builds (`model_type`, `architectures`, ...).
    pub config: serde_json::Value,
    /// In the file's tensor order.
    pub tensors: Vec<HfTensor>,
}

/// The GGUF file `path` names, if it names one (`tracegate_trace::gguf_file`: the rule the
/// weights digest follows too), its refusals as checkpoint errors.
pub fn model_file(path: &Path) -> Result<Option<PathBuf>> {
    tracegate_trace::gguf_file(path).map_err(|e| err!(Checkpoint: "{e}"))
}

/// Map and parse the GGUF file at `path`, synthesize its config and name its tensors. Refuses
/// (naming the file and the key or tensor): another architecture than llama, qwen3 or gemma3, a split
/// file, a tensor name the family does not have, a tensor type `GgmlType::SUPPORTED` does not
/// list, a llama q/k tensor whose rows do not split into its heads' pairs.
pub fn load(path: &Path) -> Result<GgufModel> {
    let shown = path.display().to_string();
    let f = open_weights_file(path)?;
    // SAFETY: mapped read-only; the file must not change while the engine runs (as for the
    // safetensors mappings).
    let map =
        unsafe { Mmap::map(&f.file) }.map_err(|e| err!(Checkpoint: "{shown}: cannot map: {e}"))?;
    let header = parse(&map, &shown)?;
    let arch_name = match header.get("general.architecture") {
        Some(Value::Str(s)) => s.clone(),
        Some(v) => {
            return Err(err!(Checkpoint:
                "{shown}: general.architecture is a {}, not a string",
                v.type_name()
            ))
        }
        None => return Err(err!(Checkpoint: "{shown}: no general.architecture")),
    };
    let arch = Arch::from_name(&arch_name).ok_or_else(|| {
        err!(Checkpoint: "{shown}: general.architecture = {arch_name:?} not supported ({})", Arch::NAMES)
    })?;
    if let Some(n) = header.get("split.count").and_then(Value::as_int) {
        if n > 1 {
            return Err(err!(Checkpoint:
                "{shown}: split GGUF (split.count = {n}) not supported: merge it into one file"
            ));
        }
    }
    let config = hf::config(&header, arch).map_err(|e| err!(Checkpoint: "{shown}: {e}"))?;
    let mut tensors = Vec::with_capacity(header.tensors.len());
    for (i, t) in header.tensors.iter().enumerate() {
        let name = hf_name(arch, &t.name).ok_or_else(|| {
            err!(Checkpoint:
                "{shown}: tensor {}: not a tensor of a {arch_name} model (no Hugging Face name for it)",
                parse::shown(&t.name)
            )
        })?;
        if !t.ggml_type.is_supported() {
            return Err(err!(Checkpoint:
                "{shown}: tensor {}: type {} (id {}) not supported ({})",
                t.name,
                t.ggml_type.name(),
                t.ggml_type.id(),
                GgmlType::supported_list()
            ));
        }
        let shape = t.shape();
        let permuted_heads = hf::permuted_heads(arch, &t.name, &config)
            .map_err(|e| err!(Checkpoint: "{shown}: {e}"))?;
        if let Some(heads) = permuted_heads {
            let rows = shape.first().copied().unwrap_or(1);
            let pairs = heads.checked_mul(2);
            if shape.len() > 2 || pairs.is_none_or(|p| rows % p != 0) {
                return Err(err!(Checkpoint:
                    "{shown}: tensor {}: shape {shape:?} does not split into {heads} heads of row pairs (needed to undo llama.cpp's q/k permutation)",
                    t.name
                ));
            }
        }
        tensors.push(HfTensor {
            name,
            shape,
            source: i,
            permuted_heads,
            minus_one: stored_plus_one(arch, &t.name),
        });
    }
    Ok(GgufModel {
        path: path.to_path_buf(),
        file: f,
        map,
        header,
        arch,
        config,
        tensors,
    })
}

/// transformers' `weights - 1` on a gemma3 norm weight (f32 numpy minus a Python int: one f32
/// subtraction, rounded to nearest even), in place; nothing for any other tensor.
fn minus_one(t: &HfTensor, values: &mut [f32]) {
    if t.minus_one {
        for v in values {
            *v -= 1.0;
        }
    }
}

impl GgufModel {
    /// The GGUF tensor `t` comes from.
    pub fn info(&self, t: &HfTensor) -> &TensorInfo {
        &self.header.tensors[t.source]
    }

    /// The stored bytes of `t`'s GGUF tensor.
    pub fn bytes(&self, t: &HfTensor) -> &[u8] {
        let info = self.info(t);
        &self.map[info.start..info.end]
    }

    /// Values per row of `t` (`ne0`: whole blocks) and its number of rows.
    pub fn rows(&self, t: &HfTensor) -> (usize, usize) {
        let cols = self.info(t).dims.first().copied().unwrap_or(1) as usize;
        let n: usize = t.shape.iter().product();
        (cols, n.checked_div(cols).unwrap_or(0))
    }

    /// Dequantize row `r` of a 2-D `t` in Hugging Face layout into `out` (`cols` values): the
    /// stored row `r`, or for a permuted llama q/k the stored row it came from.
    fn read_row(&self, t: &HfTensor, r: usize, out: &mut [f32]) -> Result<()> {
        let info = self.info(t);
        let (cols, rows) = self.rows(t);
        if t.shape.len() != 2 || r >= rows || out.len() != cols {
            return Err(err!(Internal:
                "tensor {}: row {r} of {rows}, {} values for {cols}",
                t.name,
                out.len()
            ));
        }
        let row_bytes = (info.end - info.start) / rows;
        let s = t.permuted_heads.map_or(r, |h| unpermuted_row(r, rows, h));
        dequantize_row(
            info.ggml_type,
            &self.bytes(t)[s * row_bytes..(s + 1) * row_bytes],
            out,
        )
        .map_err(|e| err!(Checkpoint: "{}: tensor {}: {e}", self.path.display(), info.name))?;
        minus_one(t, out);
        Ok(())
    }

    /// Dequantize `t` into `out` (its element count) in Hugging Face layout. A 2-D tensor row by
    /// row; any other whole (a permuted llama q/k bias: its elements are the permuted rows).
    pub fn read(&self, t: &HfTensor, out: &mut [f32]) -> Result<()> {
        let n: usize = t.shape.iter().product();
        if out.len() != n {
            return Err(err!(Internal: "tensor {}: {} values for {n}", t.name, out.len()));
        }
        if t.shape.len() == 2 {
            let (cols, _) = self.rows(t);
            for (r, o) in out.chunks_exact_mut(cols.max(1)).enumerate() {
                self.read_row(t, r, o)?;
            }
            return Ok(());
        }
        let info = self.info(t);
        let whole = |out: &mut [f32]| {
            dequantize_row(info.ggml_type, self.bytes(t), out).map_err(
                |e| err!(Checkpoint: "{}: tensor {}: {e}", self.path.display(), info.name),
            )?;
            minus_one(t, out);
            Ok(())
        };
        match t.permuted_heads {
            None => whole(out),
            Some(heads) => {
                let mut stored = vec![0.0; n];
                whole(&mut stored)?;
                for (r, o) in out.iter_mut().enumerate() {
                    *o = stored[unpermuted_row(r, n, heads)];
                }
                Ok(())
            }
        }
    }

    /// `read` into a new vector.
    pub fn to_f32(&self, t: &HfTensor) -> Result<Vec<f32>> {
        let mut v = vec![0.0; t.shape.iter().product()];
        self.read(t, &mut v)?;
        Ok(v)
    }

    /// Whether the engine can read `t`'s stored bytes as they are (f32 or bf16, widened exactly
    /// at use by `weights::widen`, the same values `read` gives) instead of a dequantized copy.
    fn stored_as_read(&self, t: &HfTensor) -> bool {
        let ty = self.info(t).ggml_type;
        t.permuted_heads.is_none() && !t.minus_one && (ty == GgmlType::F32 || ty == GgmlType::BF16)
    }

    /// The engine's `Store` over this model: the file's mapping, plus one anonymous mapping
    /// holding every tensor not `stored_as_read`, dequantized (tensors on the rayon pool, each
    /// written once, then the mapping made read-only).
    pub fn into_store(self) -> Result<Store> {
        const F32_ALIGN: usize = 64;
        let mut entries = BTreeMap::new();
        let mut converted: Vec<(&HfTensor, usize, usize)> = Vec::new();
        let mut len = 0usize;
        for t in &self.tensors {
            let shape: Vec<u64> = t.shape.iter().map(|&d| d as u64).collect();
            if self.stored_as_read(t) {
                let info = self.info(t);
                let dtype = if info.ggml_type == GgmlType::F32 {
                    "F32"
                } else {
                    "BF16"
                };
                let e = Entry {
                    dtype: dtype.to_string(),
                    shape,
                    start: info.start,
                    end: info.end,
                };
                entries.insert(t.name.clone(), (0, e));
            } else {
                let start = len.next_multiple_of(F32_ALIGN);
                let end = t
                    .shape
                    .iter()
                    .try_fold(4usize, |a, &d| a.checked_mul(d))
                    .and_then(|b| b.checked_add(start))
                    .ok_or_else(
                        || err!(Checkpoint: "tensor {}: shape {:?} overflows", t.name, t.shape),
                    )?;
                let e = Entry {
                    dtype: "F32".to_string(),
                    shape,
                    start,
                    end,
                };
                entries.insert(t.name.clone(), (1, e));
                converted.push((t, start, end));
                len = end;
            }
        }
        let mut anon = MmapOptions::new().len(len.max(1)).map_anon().map_err(|e| {
            err!(Checkpoint: "{}: cannot allocate {len} bytes for the dequantized tensors: {e}", self.path.display())
        })?;
        // Disjoint slices of the mapping, one per converted tensor, in order.
        let mut slices = Vec::with_capacity(converted.len());
        let mut rest: &mut [u8] = &mut anon[..];
        let mut at = 0;
        for &(t, start, end) in &converted {
            let (_, tail) = rest.split_at_mut(start - at);
            let (mine, tail) = tail.split_at_mut(end - start);
            slices.push((t, mine));
            rest = tail;
            at = end;
        }
        let put = |out: &mut [u8], values: &[f32]| {
            for (b, v) in out.chunks_exact_mut(4).zip(values) {
                b.copy_from_slice(&v.to_le_bytes());
            }
        };
        slices
            .into_par_iter()
            .try_for_each(|(t, bytes)| -> Result<()> {
                if t.shape.len() != 2 {
                    put(bytes, &self.to_f32(t)?);
                    return Ok(());
                }
                // Row by row: no second copy of a large matrix.
                let (cols, _) = self.rows(t);
                let mut row = vec![0.0f32; cols];
                for (r, out) in bytes.chunks_exact_mut(4 * cols.max(1)).enumerate() {
                    self.read_row(t, r, &mut row)?;
                    put(out, &row);
                }
                Ok(())
            })?;
        let anon = anon.make_read_only().map_err(|e| {
            err!(Checkpoint: "{}: cannot protect the dequantized tensors: {e}", self.path.display())
        })?;
        Ok(Store::from_maps(
            vec![self.map, anon],
            vec![self.file],
            entries,
        ))
    }
}
