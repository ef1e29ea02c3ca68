//! What a forward pass records, for every family (diffusion Gemma's passes and token canvases
//! too): tensors at the named capture points (default set, plus the internals when asked) and
//! decisions, in the order they were produced. A disabled capture
//! records nothing. A decode step's capture (`Capture::step`) keeps the last row of the
//! decode-step points only, renamed `decode.SSSS.*` (docs/producers.md). Under
//! `--force-decisions` it also records which decisions were forced and marks every tensor
//! captured after the first of them.
//!
//! A capture given a trace writer (`Capture::stream_to`) writes each tensor as it is recorded,
//! so the trace never sits in memory (peak RSS does not grow with it: docs/benchmarks.md);
//! decisions are small and kept to the end, after the tensors, as the format lays them out.
//! Without one (a decode step's capture, the layer verb's joined rows) tensors are kept.

use serde_json::Value;
use tracegate_trace::names::{self, Name};
use tracegate_trace::{Attributes, DType, Digest, Shard, ShardKind, TraceWriter};

use crate::force::Record;
use crate::{err, Error, Result};

pub struct Tensor {
    pub name: String,
    pub shape: Vec<u64>,
    pub data: Vec<f32>,
    pub positions: Vec<i64>,
    /// What part of the logical tensor a rank of a sharded run holds (None: the whole).
    pub shard: Option<ShardKind>,
}

/// What a forward hands the capture: f32 activations, or token ids (diffusion's `canvas`,
/// stored as i64, written only by a streaming capture).
#[derive(Clone, Copy)]
enum Values<'a> {
    F32(&'a [f32]),
    I64(&'a [i64]),
}

pub struct Decision {
    pub name: String,
    pub shape: Vec<u64>,
    pub values: Vec<i64>,
    pub margins: Option<Vec<f32>>,
}

pub struct Capture {
    on: bool,
    internals: bool,
    /// The `path` attribute of a name without a pass prefix: "prefill" for whole forwards,
    /// "layer" for the layer verb, "encode" for diffusion's prompt pass (a `decode.`, `encode.`
    /// or `denoise.` name has its own: `attributes`).
    path: &'static str,
    pub tensors: Vec<Tensor>,
    pub decisions: Vec<Decision>,
    /// The decisions taken from the forcing trace, in the order they were recorded.
    pub forced: Vec<Record>,
    /// How many tensors were captured before the first forced decision.
    first_forced: Option<usize>,
    /// A decode step's capture: its step number (names `decode.SSSS.*`).
    step: Option<usize>,
    /// `layer --decode-from P`: written as the attribute `decode_from` on every tensor.
    pub decode_from: Option<i64>,
    /// A rank of a sharded run (rank, world): every tensor is written with its `shard`
    /// attribute (docs/numerics.md §23.2), `replicated` where none was given.
    rank: Option<(u64, u64)>,
    /// How many tensors were recorded (kept or written): `first_forced` counts in it.
    recorded: usize,
    /// Where each tensor goes as it is recorded (None: kept in `tensors`).
    sink: Option<Box<Sink>>,
    /// The first write that failed: the forward goes on, `finish` returns it.
    failed: Option<Error>,
}

/// The `mask` attribute of a tensor by its parsed name.
pub type MaskOf = dyn Fn(&Name) -> String + Send;

/// A streaming capture's writer, with what the attributes need that the capture does not know.
struct Sink {
    w: TraceWriter,
    /// The `mask` attribute of a tensor, by its name (its pass, its layer).
    mask_of: Box<MaskOf>,
    /// `forced = <digest>` (the forcing trace's) on every tensor after a forced decision.
    forcing_digest: Option<String>,
}

impl Capture {
    pub fn new(path: &'static str, internals: bool) -> Capture {
        Capture {
            on: true,
            internals,
            path,
            tensors: vec![],
            decisions: vec![],
            forced: vec![],
            first_forced: None,
            step: None,
            decode_from: None,
            rank: None,
            recorded: 0,
            sink: None,
            failed: None,
        }
    }
    pub fn off() -> Capture {
        Capture {
            on: false,
            internals: false,
            path: "",
            ..Capture::new("", false)
        }
    }
    /// Decode step `s`'s forward, cached (one row) or uncached (the whole sequence): records
    /// `decode.SSSS.logits` and, under `internals`, the layers' `hidden_in`, `attn_out`,
    /// `mlp_out`, `hidden_out` and `final_norm.out`, each of the last row only — so a cached and
    /// an uncached step record the same tensors. No internal points, no decisions.
    pub fn step(s: usize, internals: bool) -> Capture {
        Capture {
            step: Some(s),
            ..Capture::new("decode", internals)
        }
    }
    /// The capture of rank `rank` = (rank, world) of a sharded run (None: a whole run).
    pub fn of_rank(self, rank: Option<(u64, u64)>) -> Capture {
        Capture { rank, ..self }
    }

    /// True when internal points (q, k, v, attn_probs, router, experts) are recorded.
    pub fn internals(&self) -> bool {
        self.on && self.internals && self.step.is_none()
    }

    /// Whether a decode step records the point `name`: its logits always, under internals the
    /// other points the registry says decode steps write (docs/producers.md).
    fn step_keeps(&self, name: &str) -> bool {
        name == "logits"
            || (self.internals
                && names::point(name).is_some_and(|p| p.in_decode == names::InDecode::Also))
    }

    /// A default-set capture point.
    pub fn tensor(&mut self, name: &str, shape: &[usize], data: &[f32], positions: &[i64]) {
        self.tensor_as(name, shape, data, positions, None)
    }

    /// A default-set capture point that a rank holds as `shard` (None: replicated).
    pub fn tensor_as(
        &mut self,
        name: &str,
        shape: &[usize],
        data: &[f32],
        positions: &[i64],
        shard: Option<ShardKind>,
    ) {
        if let Some(s) = self.step {
            if self.on && self.step_keeps(name) && !positions.is_empty() {
                let (rows, cols) = (positions.len(), data.len() / positions.len());
                let shape = [1, cols as u64];
                let last = &data[(rows - 1) * cols..];
                self.record(
                    &names::decode(s, name),
                    &shape,
                    Values::F32(last),
                    &positions[rows - 1..],
                    shard,
                );
            }
            return;
        }
        if self.on {
            let shape: Vec<u64> = shape.iter().map(|&d| d as u64).collect();
            self.record(name, &shape, Values::F32(data), positions, shard);
        }
    }

    /// A default-set point of token ids (diffusion's `canvas`), stored as i64; not kept by a
    /// decode step.
    pub fn tokens(&mut self, name: &str, shape: &[usize], ids: &[i64], positions: &[i64]) {
        if self.on && self.step.is_none() {
            let shape: Vec<u64> = shape.iter().map(|&d| d as u64).collect();
            self.record(name, &shape, Values::I64(ids), positions, None);
        }
    }

    /// Writes the tensor when streaming, else keeps it.
    fn record(
        &mut self,
        name: &str,
        shape: &[u64],
        data: Values,
        positions: &[i64],
        shard: Option<ShardKind>,
    ) {
        // Captured after the first forced decision: every tensor from here on.
        let forced = self.first_forced.is_some();
        self.recorded += 1;
        let Some(sink) = self.sink.as_mut() else {
            let Values::F32(data) = data else {
                // Token ids come only from diffusion's passes, whose capture streams from the
                // start: kept, they would have no f32 to be.
                self.failed.get_or_insert(
                    err!(Internal: "{name}: token ids recorded by a capture that is not streaming"),
                );
                return;
            };
            self.tensors.push(Tensor {
                name: name.to_string(),
                shape: shape.to_vec(),
                data: data.to_vec(),
                positions: positions.to_vec(),
                shard,
            });
            return;
        };
        if self.failed.is_some() {
            return;
        }
        let attrs = attributes(
            self.path,
            self.rank,
            self.decode_from,
            sink,
            forced,
            name,
            positions,
            shard,
        );
        let written = match data {
            Values::F32(v) => sink.w.tensor_f32(name, shape, v, &attrs),
            Values::I64(v) => {
                let bytes: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
                sink.w.tensor(name, DType::I64, shape, &bytes, &attrs)
            }
        };
        if let Err(e) = written {
            self.failed = Some(e.into());
        }
    }

    /// An internals-only capture point.
    pub fn internal(&mut self, name: &str, shape: &[usize], data: &[f32], positions: &[i64]) {
        self.internal_as(name, shape, data, positions, None)
    }

    /// An internals-only capture point that a rank holds as `shard` (None: replicated).
    pub fn internal_as(
        &mut self,
        name: &str,
        shape: &[usize],
        data: &[f32],
        positions: &[i64],
        shard: Option<ShardKind>,
    ) {
        if self.internals() {
            self.tensor_as(name, shape, data, positions, shard);
        }
    }

    pub fn decision(
        &mut self,
        name: &str,
        shape: &[usize],
        values: Vec<i64>,
        margins: Option<Vec<f32>>,
    ) {
        if self.on && self.step.is_none() {
            let shape = shape.iter().map(|&d| d as u64).collect();
            self.decisions.push(Decision {
                name: name.to_string(),
                shape,
                values,
                margins,
            });
        }
    }

    /// A decision, and under `--force-decisions` (`overridden` Some) that it was forced, with
    /// the rows where this producer would have chosen otherwise.
    pub fn decided(
        &mut self,
        name: &str,
        shape: &[usize],
        values: Vec<i64>,
        margins: Option<Vec<f32>>,
        overridden: Option<Vec<u64>>,
    ) {
        self.decision(name, shape, values, margins);
        if let Some(rows) = overridden {
            self.forced(name, rows);
        }
    }

    /// Marks the decision just recorded as forced; `overridden`: the rows (ascending) where this
    /// producer would have chosen otherwise.
    pub fn forced(&mut self, name: &str, overridden: Vec<u64>) {
        if self.on && self.step.is_none() {
            self.first_forced.get_or_insert(self.recorded);
            self.forced.push(Record {
                name: name.to_string(),
                overridden,
            });
        }
    }

    /// Rows recorded one at a time (`layer --decode-from`: one decode row per forward), joined
    /// into one tensor per name in first-seen order; the decisions are dropped. A joined tensor
    /// counts as captured after the first forced decision when any of its rows was.
    pub fn join_rows(&mut self) {
        let mut joined: Vec<(Tensor, bool)> = Vec::new();
        for (i, t) in std::mem::take(&mut self.tensors).into_iter().enumerate() {
            let forced = self.first_forced.is_some_and(|f| i >= f);
            match joined.iter_mut().find(|(j, _)| j.name == t.name) {
                Some((j, f)) => {
                    j.shape[0] += t.shape[0];
                    j.data.extend_from_slice(&t.data);
                    j.positions.extend_from_slice(&t.positions);
                    *f |= forced;
                }
                None => joined.push((t, forced)),
            }
        }
        if self.first_forced.is_some() {
            self.first_forced = Some(joined.iter().position(|(_, f)| *f).unwrap_or(joined.len()));
        }
        self.tensors = joined.into_iter().map(|(t, _)| t).collect();
        self.recorded = self.tensors.len();
        self.decisions.clear();
    }

    pub fn get(&self, name: &str) -> Option<&Tensor> {
        self.tensors.iter().find(|t| t.name == name)
    }

    /// A tensor kept in memory before, recorded again (into this capture or its sink).
    fn record_kept(&mut self, t: Tensor) {
        let data = Values::F32(&t.data);
        self.record(&t.name, &t.shape, data, &t.positions, t.shard);
    }

    /// A decode step's tensors, after everything recorded so far.
    pub fn append(&mut self, step: Capture) {
        for t in step.tensors {
            self.record_kept(t);
        }
    }

    /// From here on every tensor goes to `w` as it is recorded, with `path` (`decode`,
    /// `encode` or `denoise` for a name of that pass, the capture's own otherwise), `mask`
    /// (`mask_of` of the parsed name) and `positions` attributes, and `forced = <forcing_digest>` on every tensor
    /// captured after a forced decision; the tensors kept so far are written first, in order.
    pub fn stream_to(
        mut self,
        w: TraceWriter,
        forcing_digest: Option<&str>,
        mask_of: Box<MaskOf>,
    ) -> Capture {
        let kept = std::mem::take(&mut self.tensors);
        let first_forced = self.first_forced;
        (self.recorded, self.first_forced) = (0, None);
        self.sink = Some(Box::new(Sink {
            w,
            mask_of,
            forcing_digest: forcing_digest.map(str::to_string),
        }));
        for (i, t) in kept.into_iter().enumerate() {
            // Recorded again in order: the first forced decision falls where it fell.
            if first_forced == Some(i) {
                self.first_forced = Some(i);
            }
            self.record_kept(t);
        }
        if first_forced.is_some() {
            self.first_forced = first_forced;
        }
        self
    }

    /// Ends a streaming capture: the decisions after the tensors, then the index with
    /// `provenance`, and the file renamed into place. A write that failed is the error, and
    /// nothing is left at the final path (the writer removes its temporary).
    pub fn finish(mut self, provenance: Value) -> Result<Digest> {
        let Some(mut sink) = self.sink.take() else {
            return Err(err!(Internal: "Capture::finish: the capture has no trace writer"));
        };
        if let Some(e) = self.failed.take() {
            return Err(e);
        }
        for d in &self.decisions {
            sink.w
                .decision(&d.name, &d.shape, &d.values, d.margins.as_deref())?;
        }
        sink.w.set_provenance(provenance)?;
        Ok(sink.w.finish()?)
    }
}

/// A tensor's attributes as written (`Capture::stream_to` says which).
#[allow(clippy::too_many_arguments)]
fn attributes(
    path: &str,
    rank: Option<(u64, u64)>,
    decode_from: Option<i64>,
    sink: &Sink,
    forced: bool,
    name: &str,
    positions: &[i64],
    shard: Option<ShardKind>,
) -> Attributes {
    let parsed = Name::parse(name);
    let path = match (parsed.decode_step, parsed.diffusion) {
        (Some(_), _) => "decode",
        (None, Some(names::Diffusion::Encode { .. })) => "encode",
        (None, Some(_)) => "denoise",
        (None, None) => path,
    };
    let mask = (sink.mask_of)(&parsed);
    let mut attrs = Attributes::default()
        .with_path(path)
        .with_mask(&mask)
        .with_positions(positions.to_vec());
    if let Some((rank, world)) = rank {
        let kind = shard.unwrap_or(ShardKind::Replicated);
        attrs = attrs.with_shard(&Shard::new(rank, world, kind));
    }
    if let Some(p) = decode_from {
        attrs.extra.insert("decode_from".into(), p.to_string());
    }
    if let (Some(d), true) = (&sink.forcing_digest, forced) {
        attrs.extra.insert("forced".into(), d.clone());
    }
    attrs
}
