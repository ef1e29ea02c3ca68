//! Frozen prompt sets: named token sequences, schema-versioned, identified by their sha256.

use std::collections::HashSet;
use std::path::{Path, PathBuf};

use serde::Deserialize;

use crate::{gerr, Result};

#[derive(Clone, Debug)]
pub struct Prompt {
    pub id: String,
    /// The token ids; for a text prompt, empty until the model's tokenizer has given them (a
    /// port milestone records them: milestone/run/port.rs).
    pub tokens: Vec<i64>,
    /// A text prompt: tokenized once by the model's own tokenizer (docs/gate.md, "Prompt sets").
    pub text: Option<TextPrompt>,
}

/// A prompt given as text, optionally through the tokenizer's chat template.
#[derive(Clone, Debug, PartialEq)]
pub struct TextPrompt {
    pub text: String,
    pub chat: bool,
}

#[derive(Clone, Debug)]
pub struct PromptSet {
    pub path: PathBuf,
    pub sha256: String,
    pub prompts: Vec<Prompt>,
}

// Unknown fields are refused, not dropped: a field the gate ignores (a `generate` per prompt,
// a second token list) would be a claim nobody checks, and `--bless` would record it as passed.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct PromptFile {
    schema: u32,
    /// What the set is for (free text).
    #[serde(default)]
    #[allow(dead_code)]
    about: String,
    /// The smallest vocabulary holding every token id of the set (scripts/fixture_margins.py).
    #[serde(default)]
    #[allow(dead_code)]
    vocab_min: Option<u64>,
    prompts: Vec<PromptEntry>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct PromptEntry {
    id: String,
    #[serde(default)]
    tokens: Option<Vec<i64>>,
    #[serde(default)]
    text: Option<String>,
    #[serde(default)]
    chat: Option<bool>,
}

const FILE_FIELDS: [&str; 4] = ["schema", "about", "vocab_min", "prompts"];
const ENTRY_FIELDS: [&str; 4] = ["id", "tokens", "text", "chat"];

/// The shape of a prompt set, as a refusal says it (docs/gate.md, "Prompt sets").
const SHAPE: &str = r#"a prompt set is one JSON object: {"schema": 1, "prompts": [{"id": "short", "tokens": [3, 17, 5]}, {"id": "hello", "text": "Hello", "chat": true}]} (docs/gate.md, "Prompt sets")"#;

/// What a JSON value is, for a refusal ("an array", "a string \"yes\"").
fn kind(v: &serde_json::Value) -> String {
    use serde_json::Value as V;
    match v {
        V::Null => "null".into(),
        V::Bool(b) => format!("{b}"),
        V::Number(n) => format!("the number {n}"),
        V::String(s) => format!("the string {s:?}"),
        V::Array(_) => "an array".into(),
        V::Object(_) => "an object".into(),
    }
}

/// The first field of the file or of a prompt entry that the gate does not read, or that has
/// the wrong type, named with the entry and the type expected (serde's own refusal names
/// neither: `invalid type: map, expected u32`).
fn check_shape(raw: &serde_json::Value) -> std::result::Result<(), String> {
    use serde_json::Value as V;
    let Some(top) = raw.as_object() else {
        return Err(format!("the file is {}: {SHAPE}", kind(raw)));
    };
    if let Some(k) = top.keys().find(|k| !FILE_FIELDS.contains(&k.as_str())) {
        return Err(format!(
            "unknown field {k:?} (a prompt set has {})",
            FILE_FIELDS.join(", ")
        ));
    }
    let expected =
        |field: &str, v: &V, want: &str| format!("field {field:?} is {}, expected {want}", kind(v));
    for (field, want, ok) in [
        ("schema", "the integer 1", top.get("schema").map(V::is_u64)),
        ("about", "a string", top.get("about").map(V::is_string)),
        (
            "vocab_min",
            "a non-negative integer",
            top.get("vocab_min").map(|v| v.is_u64() || v.is_null()),
        ),
        (
            "prompts",
            "an array of prompts",
            top.get("prompts").map(V::is_array),
        ),
    ] {
        if ok == Some(false) {
            return Err(format!("{}: {SHAPE}", expected(field, &top[field], want)));
        }
    }
    let entries = top.get("prompts").and_then(|p| p.as_array());
    for (i, e) in entries.into_iter().flatten().enumerate() {
        let Some(e) = e.as_object() else {
            return Err(format!(
                "prompts[{i}] is {}, expected an object: {SHAPE}",
                kind(e)
            ));
        };
        let id = e.get("id").map_or("(no id)".to_string(), |v| v.to_string());
        if let Some(k) = e.keys().find(|k| !ENTRY_FIELDS.contains(&k.as_str())) {
            return Err(format!(
                "prompts[{i}] (id {id}): unknown field {k:?} (a prompt has {})",
                ENTRY_FIELDS.join(", ")
            ));
        }
        let ids = |v: &V| {
            v.as_array()
                .is_some_and(|a| a.iter().all(serde_json::Value::is_i64))
        };
        for (field, want, ok) in [
            ("id", "a string", e.get("id").map(V::is_string)),
            (
                "tokens",
                "an array of integer token ids",
                e.get("tokens").map(ids),
            ),
            ("text", "a string", e.get("text").map(V::is_string)),
            ("chat", "true or false", e.get("chat").map(V::is_boolean)),
        ] {
            if ok == Some(false) {
                return Err(format!(
                    "prompts[{i}] (id {id}): {}",
                    expected(field, &e[field], want)
                ));
            }
        }
    }
    Ok(())
}

/// Whether a `--prompts` value is a path (it has a `/` or ends in `.json`) rather than a set name.
pub fn is_path(spec: &str) -> bool {
    spec.contains('/') || spec.ends_with(".json")
}

/// `--prompts NAME` names `fixtures/prompts/NAME.json`; anything with a `/` or `.json` is a path.
pub fn resolve(root: &Path, spec: &str) -> PathBuf {
    if is_path(spec) {
        PathBuf::from(spec)
    } else {
        root.join("fixtures/prompts").join(format!("{spec}.json"))
    }
}

/// For a named set that is not there (`--prompts frozn`): the sets there are.
fn known_sets(path: &Path) -> String {
    let Some(dir) = path.parent().filter(|d| d.ends_with("fixtures/prompts")) else {
        return String::new();
    };
    if path.exists() {
        return String::new();
    }
    let mut names: Vec<String> = std::fs::read_dir(dir)
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| {
            let name = e.file_name().into_string().ok()?;
            name.strip_suffix(".json").map(str::to_string)
        })
        .collect();
    names.sort();
    format!(
        " (the named prompt sets are {}; a path is read as a file)",
        names.join(", ")
    )
}

pub fn load(path: &Path) -> Result<PromptSet> {
    // One read: the sha256 the milestone records is of the bytes that were parsed (hashing a
    // second read would let a file swapped in between pass under the old hash).
    let bytes = tracegate_trace::json::read_bytes(path, tracegate_trace::json::MAX_JSON_LEN)
        .map_err(|e| gerr!(File: "{e}{}", known_sets(path)))?;
    let raw: serde_json::Value =
        tracegate_trace::json::parse(&bytes).map_err(|e| gerr!(File: "{}: {e}", path.display()))?;
    check_shape(&raw).map_err(|e| gerr!(File: "{}: {e}", path.display()))?;
    let file: PromptFile =
        serde_json::from_value(raw).map_err(|e| gerr!(File: "{}: {e}", path.display()))?;
    if file.schema != 1 {
        return Err(gerr!(
            "{}: prompt schema {} is not supported (this gate reads schema 1)",
            path.display(),
            file.schema
        ));
    }
    let mut seen = HashSet::new();
    for p in &file.prompts {
        if p.id.is_empty()
            || !p
                .id
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-')
        {
            return Err(gerr!(
                "{}: prompt id {:?} must be non-empty [A-Za-z0-9_-]",
                path.display(),
                p.id
            ));
        }
        if !seen.insert(p.id.clone()) {
            return Err(gerr!(
                "{}: prompt id {:?} appears twice",
                path.display(),
                p.id
            ));
        }
        let at = |what: &str| gerr!("{}: prompt {:?} {what}", path.display(), p.id);
        let tokens = match (&p.tokens, &p.text, p.chat) {
            (Some(_), Some(_), _) => {
                return Err(at(
                    "has both tokens and text: give one (docs/gate.md, \"Prompt sets\")",
                ))
            }
            (None, None, _) => return Err(at("has neither tokens nor text")),
            (Some(_), None, Some(_)) => return Err(at("has chat without text")),
            (None, Some(t), _) if t.is_empty() => return Err(at("has an empty text")),
            (None, Some(_), _) => continue,
            (Some(t), None, None) => t,
        };
        if tokens.is_empty() {
            return Err(gerr!("{}: prompt {:?} has no tokens", path.display(), p.id));
        }
        if let Some(t) = tokens.iter().find(|&&t| t < 0) {
            return Err(gerr!(
                "{}: prompt {:?} has a negative token id {t}",
                path.display(),
                p.id
            ));
        }
    }
    if file.prompts.is_empty() {
        return Err(gerr!("{}: no prompts", path.display()));
    }
    Ok(PromptSet {
        path: path.to_path_buf(),
        sha256: {
            use sha2::Digest;
            hex::encode(sha2::Sha256::digest(&bytes))
        },
        prompts: file
            .prompts
            .into_iter()
            .map(|p| Prompt {
                id: p.id,
                tokens: p.tokens.unwrap_or_default(),
                text: p.text.map(|text| TextPrompt {
                    text,
                    chat: p.chat.unwrap_or(false),
                }),
            })
            .collect(),
    })
}

impl PromptSet {
    /// The prompts named by `--only` (in the file's order); an unknown id is refused.
    pub fn select(&self, only: Option<&[String]>) -> Result<Vec<Prompt>> {
        let Some(only) = only else {
            return Ok(self.prompts.clone());
        };
        for id in only {
            if !self.prompts.iter().any(|p| &p.id == id) {
                let known: Vec<&str> = self.prompts.iter().map(|p| p.id.as_str()).collect();
                return Err(gerr!(
                    "--only: unknown prompt id {id:?} in {} (known: {})",
                    self.path.display(),
                    known.join(", ")
                ));
            }
        }
        Ok(self
            .prompts
            .iter()
            .filter(|p| only.contains(&p.id))
            .cloned()
            .collect())
    }

    /// Refuses a set with text prompts where nothing tokenizes them: only a port milestone
    /// records a tokenizer's ids (`gate init`); `what` names the place that needs ids.
    pub fn token_ids_only(&self, what: &str) -> Result<()> {
        match self.prompts.iter().find(|p| p.text.is_some()) {
            Some(p) => Err(gerr!(
                "{}: prompt {:?} is text, and {what} needs token ids: text prompts are tokenized by a port milestone (gate init, docs/gate.md \"Gate your own engine\"), or give tokens",
                self.path.display(),
                p.id
            )),
            None => Ok(()),
        }
    }

    pub fn get(&self, id: &str) -> Result<&Prompt> {
        self.prompts.iter().find(|p| p.id == id).ok_or_else(|| {
            let known: Vec<&str> = self.prompts.iter().map(|p| p.id.as_str()).collect();
            gerr!(
                "unknown prompt id {id:?} in {} (known: {})",
                self.path.display(),
                known.join(", ")
            )
        })
    }
}

/// Refuses, before any producer runs, a prompt whose positions (its tokens, then `generate`
/// greedy tokens, as the oracle counts them) exceed the model's `max_position_embeddings` (the
/// language model's: see [`text_fields`]).
/// `model` is the model directory as the producers get it (relative to `root`).
pub fn check_fits(
    root: &Path,
    model: &str,
    id: Option<&str>,
    tokens: usize,
    generate: usize,
) -> Result<()> {
    let (config, path) = model_config(&root.join(model)).map_err(|e| gerr!("--model: {e}"))?;
    let Some(limit) = text_fields(&config).get("max_position_embeddings") else {
        return Ok(());
    };
    let limit = limit.as_u64().filter(|&n| n > 0).ok_or_else(|| {
        gerr!(
            "{}: max_position_embeddings {limit} is not a positive integer",
            crate::paths::shown(&path)
        )
    })?;
    // Checked: `--generate 18446744073709551615` must be refused here, not wrap past the limit.
    let positions = (tokens as u64).checked_add(generate as u64);
    if positions.is_none_or(|p| p > limit) {
        let positions =
            positions.map_or_else(|| format!("more than {}", u64::MAX), |p| p.to_string());
        let what = id
            .map(|id| format!("prompt {id:?}"))
            .unwrap_or_else(|| "--tokens".into());
        let gen = if generate > 0 {
            format!(" + {generate} generated")
        } else {
            String::new()
        };
        return Err(gerr!(
            "{what}: {tokens} tokens{gen} = {positions} positions exceed max_position_embeddings {limit} of {}",
            crate::paths::shown(&path)
        ));
    }
    Ok(())
}

/// A model's `config.json` as JSON, unvalidated (a port's family may be one the engine does not
/// compute), and the file it came from: `DIR/config.json`, or for a GGUF model (a `.gguf` file, or
/// a directory holding one) the config its metadata makes (docs/numerics.md §21.5).
pub fn model_config(model: &Path) -> Result<(serde_json::Value, std::path::PathBuf)> {
    let gguf = tracegate_engine::gguf::model_file(model).map_err(|e| gerr!("{e}"))?;
    match gguf {
        Some(file) => {
            let m = tracegate_engine::gguf::load(&file).map_err(|e| gerr!("{e}"))?;
            Ok((m.config, file))
        }
        None => {
            let path = model.join("config.json");
            Ok((crate::read_json(&path)?, path))
        }
    }
}

/// The language model's fields of a config.json: `text_config` in the multimodal layout
/// (`model_type` `qwen3_5` / `qwen3_5_moe`, as the engine reads it), else the config itself.
pub fn text_fields(config: &serde_json::Value) -> &serde_json::Value {
    let multimodal = matches!(
        config.get("model_type").and_then(serde_json::Value::as_str),
        Some("qwen3_5" | "qwen3_5_moe" | "diffusion_gemma")
    );
    match config.get("text_config") {
        Some(tc) if multimodal && tc.is_object() => tc,
        _ => config,
    }
}

/// The language model's `model_type` (a milestone's `family`), "" when there is none. A
/// block-diffusion checkpoint is its own family (`diffusion_gemma`), not its text config's.
pub fn family(config: &serde_json::Value) -> &str {
    let top = config.get("model_type").and_then(serde_json::Value::as_str);
    if top.is_some_and(samples) {
        return top.unwrap_or("");
    }
    text_fields(config)
        .get("model_type")
        .and_then(serde_json::Value::as_str)
        .unwrap_or("")
}

/// Whether family `model_type` samples (block diffusion: the registry's Diffusion feature).
pub fn samples(model_type: &str) -> bool {
    use tracegate_trace::names::{family_features, Feature};
    family_features(model_type).is_some_and(|f| f.contains(&Feature::Diffusion))
}
