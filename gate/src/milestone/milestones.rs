//! milestones.json: each milestone states one falsifiable claim, the model and prompts it is
//! about, what the engine is expected to produce, and exactly which divergences are declared.

use std::collections::BTreeMap;
use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::milestone::check::{Check, FindingKind};
use crate::{gerr, Result};

#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MilestoneFile {
    pub schema: u32,
    pub milestones: Vec<Milestone>,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Milestone {
    pub id: String,
    /// One falsifiable sentence (naming every model it is about).
    pub claim: String,
    pub prompts: PromptRecord,
    /// Greedy tokens generated per prompt unless `--generate` says otherwise (a block-diffusion
    /// model: new tokens, in whole canvases).
    pub generate: usize,
    /// A block-diffusion model's sampling seed (`--seed`; 0 when absent). The engine and the
    /// contract draw from it; the oracle is forced by the engine's draws.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub seed: Option<u64>,
    /// `internals` to run every producer with `--capture internals` (absent: `default`). A
    /// block-diffusion milestone needs it: its router margins are judged against the
    /// `router.logits` they come from, which only internals records.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub capture: Option<String>,
    /// The policy that judges engine ≈ oracle: a bundled name (f32, bf16, f16, q8) or a path
    /// relative to the project root.
    pub policy: String,
    /// The checkpoints the claim is about, each with its own expectations; a run checks every
    /// one of them on every selected prompt.
    pub models: Vec<MilestoneModel>,
    /// A port milestone (`gate init`): a user's engine judged against golden reference traces
    /// instead of tracegate's engine against its contract and oracle (docs/gate.md, "Gate your
    /// own engine"). Its one model's `expect` stays empty: the port's own are here.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub port: Option<Port>,
}

/// What a port milestone runs and what it recorded.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Port {
    pub candidate: PortCandidate,
    pub reference: PortReference,
    /// `default` or `internals`: the capture of the golden traces and of every candidate run.
    pub capture: String,
    /// Per prompt id: its golden reference trace.
    #[serde(default)]
    pub golden: BTreeMap<String, Golden>,
    /// Per prompt id: the noise trace beside its golden trace — tracegate's own reference run
    /// in the claimed precision (docs/gate.md, "The noise run"), which sizes near-ties and any
    /// noise-relative bound. Absent: none was recorded (said in the report).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub noise: BTreeMap<String, Golden>,
    /// Per prompt id: what the candidate produced when last blessed.
    #[serde(default)]
    pub expect: BTreeMap<String, PortExpectation>,
    /// The text prompts' ids as the model's tokenizer gave them when blessed, with that
    /// tokenizer's digest: a changed tokenizer is refused as a changed prompt.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tokenized: Option<Tokenized>,
}

/// Text prompts tokenized once (`python -m tracegate.text --prompts`, docs/producers.md).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Tokenized {
    /// `tracegate.text.tokenizer_digest` of the model directory (crate::milestone::tokenizer).
    pub tokenizer_digest: String,
    /// Per text prompt id: its ids and the chat template used (null without `chat`).
    pub prompts: BTreeMap<String, TokenizedPrompt>,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TokenizedPrompt {
    pub tokens: Vec<i64>,
    pub template: Option<String>,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PortCandidate {
    /// The producer command template, run in the project root (docs/producers.md).
    pub cmd: String,
    /// Whether the candidate claims the same digest on every run: then `stable` is a check,
    /// otherwise its digest is an observation.
    pub deterministic: bool,
    /// Whether it answers `trace --cache off` (found by `gate init`): `generation` compares
    /// its cached decode with its uncached one, else is NOT CHECKED.
    pub cache_off: bool,
    /// A sharded port (`gate init --ranks N`): its world size. Each `trace` run writes one
    /// trace per rank at `--out` with `{rank}` replaced by 0..N−1, which the gate merges
    /// (docs/producers.md, "Sharded engines"). Absent: one process, one trace.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ranks: Option<u64>,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PortReference {
    /// `oracle` (transformers' own class, from tracegate's installation) or `cmd`.
    pub producer: String,
    /// The command template of a `cmd` reference.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cmd: Option<String>,
    /// The oracle's `--dtype` (f32, bf16, f16) and `--device` (cpu, cuda).
    pub dtype: String,
    pub device: String,
}

/// A golden trace: where it is, relative to the project root, and its content digest.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Golden {
    pub trace: String,
    pub digest: String,
    /// Its greedy tokens (`decode.SSSS.argmax`).
    pub generated: Vec<i64>,
    /// sha256 of the provenance the judge relies on (producer, dtype, device, versions), which
    /// the content digest does not cover ([`provenance_pin`]); empty in a milestone recorded
    /// before it was pinned (refused: re-record with --bless).
    #[serde(default)]
    pub provenance: String,
}

/// The digest pinning a recorded trace's provenance: sha256 of its `producer`, `dtype`,
/// `device` and `versions` as canonical JSON. A golden trace swapped for another producer's
/// output with its content digest re-recorded still carries that producer's provenance.
pub fn provenance_pin(provenance: &serde_json::Value) -> String {
    use sha2::Digest;
    let pinned = serde_json::json!({
        "producer": provenance.get("producer"),
        "dtype": provenance.get("dtype"),
        "device": provenance.get("device"),
        "versions": provenance.get("versions"),
    });
    let text = serde_json::to_string(&pinned).unwrap_or_default();
    let d = sha2::Sha256::digest(text.as_bytes());
    d.iter().map(|b| format!("{b:02x}")).collect()
}

/// What a port's candidate produced for one prompt when it was blessed.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PortExpectation {
    pub candidate_digest: String,
    pub tensors: usize,
    pub decisions: usize,
    pub generated: Vec<i64>,
    /// Decisions that differ from the golden trace's and are not near-ties (0 unless declared).
    pub decisions_differing: usize,
}

/// One checkpoint of a milestone and what it is expected to produce.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MilestoneModel {
    /// Model directory, relative to the project root.
    pub model: String,
    /// The language model's `model_type` (`text_config.model_type` in the multimodal layout,
    /// see [`crate::prompts::text_fields`]): a `--model` override must be of the same family.
    pub family: String,
    /// Per prompt id: what the engine is expected to produce.
    #[serde(default)]
    pub expect: BTreeMap<String, Expectation>,
    /// Differences that are known and accepted, each naming exactly what it excuses.
    #[serde(default)]
    pub declared_divergences: Vec<DeclaredDivergence>,
    /// A sharded milestone (docs/gate.md, "m2"): the splits each prompt runs under (`tp=2`,
    /// `ep=2`), each against the one-process run. Absent: a one-process milestone.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub shards: Vec<String>,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PromptRecord {
    /// The set name (`fixtures/prompts/<set>.json`).
    pub set: String,
    pub sha256: String,
    /// The prompts of the set the milestone is about, when not all (`--only` still narrows).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub only: Option<Vec<String>>,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Expectation {
    /// The engine trace's content digest (prefill + generation decisions).
    pub engine_digest: String,
    pub tensors: usize,
    pub decisions: usize,
    /// Engine vs contract: always 0 for a bit-exact claim; recorded so a change is a finding.
    pub differing_elements: u64,
    /// Greedy tokens the engine generated.
    pub generated: Vec<i64>,
    /// Engine vs oracle: decisions that differ (0 unless declared).
    pub oracle_decisions_differing: usize,
}

/// Excuses exactly one finding: same prompt, check, kind, name and count.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DeclaredDivergence {
    pub prompt: String,
    /// `matches`, `agrees` or `generation`.
    pub check: Check,
    /// The finding kind, e.g. `decision_differs`, `outside_policy`, `tokens_differ`.
    pub kind: FindingKind,
    /// The tensor or decision it is about.
    pub name: String,
    /// The count the finding reports (differing rows, elements, tokens).
    pub count: u64,
    pub reason: String,
}

/// The milestones.json format this gate reads. Schema 1 had one model per milestone; 2 lists
/// `models`, each with its own `family`, `expect` and `declared_divergences`.
pub const SCHEMA: u32 = 2;

impl MilestoneFile {
    pub fn load(path: &Path) -> Result<MilestoneFile> {
        // The schema is read first, so an old file is refused by its number, not by a field.
        let raw: serde_json::Value = crate::read_json(path)?;
        let schema = raw.get("schema").and_then(serde_json::Value::as_u64);
        if schema != Some(SCHEMA as u64) {
            return Err(gerr!(
                "{}: schema {} is not supported (this gate reads schema {SCHEMA}: a milestone lists its models, docs/gate.md)",
                path.display(),
                raw.get("schema").map_or("(missing)".into(), |s| s.to_string())
            ));
        }
        let file: MilestoneFile =
            serde_json::from_value(raw).map_err(|e| gerr!(File: "{}: {e}", path.display()))?;
        // One id, one milestone: `gate check` and `gate run ID` find a milestone by its id, so
        // a second one of the same id would never run (and its checks never fail).
        for (i, m) in file.milestones.iter().enumerate() {
            if let Some(first) = file.milestones[..i].iter().position(|x| x.id == m.id) {
                return Err(gerr!(
                    "{}: milestone id {:?} is used twice, by milestones[{first}] and milestones[{i}]: give each milestone its own id",
                    path.display(),
                    m.id
                ));
            }
        }
        for m in &file.milestones {
            if m.models.is_empty() {
                return Err(gerr!(
                    "{}: milestone {} lists no models",
                    path.display(),
                    m.id
                ));
            }
            if m.port.is_some() && m.models.len() != 1 {
                return Err(gerr!(
                    "{}: milestone {} is a port milestone and lists {} models: its golden traces are of one",
                    path.display(),
                    m.id,
                    m.models.len()
                ));
            }
            if let Some(0) = m.port.as_ref().and_then(|p| p.candidate.ranks) {
                return Err(gerr!(
                    "{}: milestone {}: port.candidate.ranks 0: a sharded port runs on at least 1 rank",
                    path.display(),
                    m.id
                ));
            }
            for (i, a) in m.models.iter().enumerate() {
                if m.models[..i].iter().any(|b| b.model == a.model) {
                    return Err(gerr!(
                        "{}: milestone {} lists model {} twice",
                        path.display(),
                        m.id,
                        a.model
                    ));
                }
            }
            // A sharded milestone shards every model; each split is read as the producers read it,
            // over at least 2 ranks (one rank has nothing to show sharded).
            let sharded = m.models.iter().filter(|mm| !mm.shards.is_empty()).count();
            if sharded != 0 && sharded != m.models.len() {
                return Err(gerr!(
                    "{}: milestone {}: some models list shards and some do not: a sharded milestone shards every model",
                    path.display(),
                    m.id
                ));
            }
            for (i, mm) in m.models.iter().enumerate() {
                for (j, s) in mm.shards.iter().enumerate() {
                    let at = format!(
                        "{}: milestone {}: models[{i}].shards[{j}]",
                        path.display(),
                        m.id
                    );
                    match tracegate_producers::Shards::parse(s) {
                        Ok(x) if x.world >= 2 => {}
                        Ok(x) => {
                            return Err(gerr!(
                                "{at}: {x} has one rank: a sharded milestone needs at least 2"
                            ))
                        }
                        Err(e) => return Err(gerr!("{at}: {e}")),
                    }
                    if mm.shards[..j].contains(s) {
                        return Err(gerr!("{at}: {s} is listed twice"));
                    }
                }
            }
            for d in m.models.iter().flat_map(|mm| &mm.declared_divergences) {
                if !matches!(
                    d.check,
                    Check::Matches | Check::Agrees | Check::Generation | Check::GenerationReference
                ) {
                    return Err(gerr!("{}: milestone {}: declared divergence check {:?} is not matches/agrees/generation/generation_reference", path.display(), m.id, d.check.to_string()));
                }
                if d.reason.trim().is_empty() {
                    return Err(gerr!(
                        "{}: milestone {}: a declared divergence needs a reason",
                        path.display(),
                        m.id
                    ));
                }
            }
        }
        Ok(file)
    }

    pub fn get(&self, id: &str) -> Result<&Milestone> {
        self.milestones.iter().find(|m| m.id == id).ok_or_else(|| {
            let known: Vec<&str> = self.milestones.iter().map(|m| m.id.as_str()).collect();
            gerr!(
                "no milestone {id:?} in milestones.json (known: {})",
                known.join(", ")
            )
        })
    }

    pub fn get_mut(&mut self, id: &str) -> Option<&mut Milestone> {
        self.milestones.iter_mut().find(|m| m.id == id)
    }
}
