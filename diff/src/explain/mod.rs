//! `--explain`: is the first difference of a matmul or norm output a summation order, or a bug?
//! (docs/diff.md, "Explaining a difference"). The tensor's first differing elements are
//! recomputed from each side's own inputs (and the model's weights) under every order of
//! `orders`; an order *reproduces* a side when it gives that side's stored bits exactly on every
//! element checked. Points with a recomputable definition are in `points`.

mod orders;
mod points;

use std::path::Path;

use tracegate_trace::{DType, TensorInfo, Trace};

use crate::measures::compare_element;
use crate::numeric::{element_bits, element_value, unravel};
use crate::Pair;
pub use orders::{Inputs, Inv, Mean, NormOrder, Order, Scale, Sum};
use points::{Definition, Recompute};

/// Differing elements checked per row, from the row's first one on, with every agreeing element
/// between them (an order that reproduces a kernel reproduces those too).
pub const PER_ROW: usize = 4;
/// A row's elements checked end after this many, whatever they hold (the next row's come next).
pub const ROW_SPAN: usize = 64;
/// At most this many differing elements are checked in all.
pub const DIFFERING_CHECKED: usize = 32;
/// And at most this many elements, whatever they hold.
pub const WINDOW: usize = 256;

/// What `--explain` found for one tensor.
#[derive(Clone, Debug)]
pub struct Explanation {
    pub tensor: String,
    pub outcome: Outcome,
}

#[derive(Clone, Debug)]
pub enum Outcome {
    /// Nothing was recomputed, and why (a point without a recomputable definition, an input or
    /// weight missing, no `--model`, no difference at all).
    NotExplained(String),
    Checked(Box<Checked>),
}

/// The recomputation of one tensor's first differing elements.
#[derive(Clone, Debug)]
pub struct Checked {
    /// The definition recomputed, in words, e.g. "logits = final_norm.out · Wᵀ …".
    pub definition: String,
    /// What the inputs and weights were, and what was checked of them.
    pub notes: Vec<String>,
    /// The checked elements' coordinates, whether the two sides differ there, and by how many
    /// ULPs (None: a NaN pair).
    pub elements: Vec<Checked1>,
    pub orders_tried: usize,
    pub reference: SideResult,
    pub candidate: SideResult,
}

#[derive(Clone, Debug)]
pub struct Checked1 {
    pub coords: Vec<u64>,
    pub flat_index: u64,
    /// Reference vs candidate: None when the bits are equal, Some(ULP) otherwise (u64::MAX: NaN).
    pub differs: Option<u64>,
}

/// How the orders fared against one side's stored bits.
#[derive(Clone, Debug)]
pub struct SideResult {
    /// Every order that gives the stored bits of every checked element, in the order tried.
    pub reproduced_by: Vec<String>,
    /// The order nearest to the stored bits: its name, its largest distance over the checked
    /// elements (ULP of the side's dtype), how many elements it misses, and its distance per
    /// element (u64::MAX: NaN on one side).
    pub closest: (String, u64, usize, Vec<u64>),
}

impl Explanation {
    fn not(tensor: &str, why: impl Into<String>) -> Explanation {
        Explanation {
            tensor: tensor.to_string(),
            outcome: Outcome::NotExplained(why.into()),
        }
    }

    /// Whether some order reproduced the candidate.
    pub fn reproduced(&self) -> Option<&str> {
        match &self.outcome {
            Outcome::Checked(c) => c.candidate.reproduced_by.first().map(String::as_str),
            Outcome::NotExplained(_) => None,
        }
    }

    /// The explanation as text, one block of lines (docs/diff.md shows one).
    pub fn render(&self) -> String {
        let mut s = format!("explain {}: ", self.tensor);
        let c = match &self.outcome {
            Outcome::NotExplained(why) => return format!("{s}NOT EXPLAINED — {why}\n"),
            Outcome::Checked(c) => c,
        };
        s.push_str(&c.definition);
        s.push('\n');
        for n in &c.notes {
            s.push_str(&format!("  {n}\n"));
        }
        let differing = c.elements.iter().filter(|e| e.differs.is_some()).count();
        let rows: std::collections::BTreeSet<u64> =
            c.elements.iter().map(|e| e.coords[0]).collect();
        s.push_str(&format!(
            "  checked: {differing} differing and {} agreeing elements in {} row{} (from each row's first difference, up to {PER_ROW} differing or {ROW_SPAN} elements); reproduced = the side's exact stored bits on every one of them; {} orders tried\n",
            c.elements.len() - differing,
            rows.len(),
            if rows.len() == 1 { "" } else { "s" },
            c.orders_tried
        ));
        for (who, r) in [("reference", &c.reference), ("candidate", &c.candidate)] {
            s.push_str(&format!("  {who}: {}\n", side_words(r, c.elements.len())));
        }
        let best = &c.candidate.closest;
        s.push_str(&format!(
            "  per differing element: reference→candidate ULP, then what {} leaves\n",
            best.0
        ));
        for (e, left) in c.elements.iter().zip(&best.3) {
            if let Some(d) = e.differs {
                s.push_str(&format!(
                    "    {:?}  {} → {}\n",
                    e.coords,
                    ulp_words(d),
                    ulp_words(*left)
                ));
            }
        }
        s
    }
}

fn ulp_words(d: u64) -> String {
    if d == u64::MAX {
        "NaN".into()
    } else {
        format!("{d} ULP")
    }
}

/// Other reproducing orders named in the text (all are in [`SideResult::reproduced_by`]).
const SHOWN: usize = 6;

fn side_words(r: &SideResult, checked: usize) -> String {
    match r.reproduced_by.split_first() {
        Some((first, [])) => format!("REPRODUCED by {first}"),
        Some((first, rest)) => format!(
            "REPRODUCED by {first} (also by {} other order{}: {}{})",
            rest.len(),
            if rest.len() == 1 { "" } else { "s" },
            rest[..rest.len().min(SHOWN)].join("; "),
            if rest.len() > SHOWN { "; …" } else { "" }
        ),
        None => format!(
            "NOT REPRODUCED — no order tried gives its bits (closest: {}, {} away, {} of {checked} elements off): a defect, not one of these summation orders (docs/diff.md, \"Explaining a difference\", says what is not tried)",
            r.closest.0,
            ulp_words(r.closest.1),
            r.closest.2
        ),
    }
}

/// Explains the first differing tensor of a comparison: `tensor` is the report's first bit
/// difference (None: none differs), `model` the checkpoint directory the traces ran.
pub fn explain_first(
    reference: &Trace,
    candidate: &Trace,
    tensor: Option<&str>,
    model: Option<&Path>,
) -> Explanation {
    match tensor {
        None => Explanation::not(
            "(no tensor)",
            "no tensor differs by bits: there is no difference to explain",
        ),
        Some(t) => explain(reference, candidate, t, model),
    }
}

/// [`explain_first`] of two trace files, as text; a file that cannot be opened is NOT EXPLAINED
/// with the reason (the comparison before it says more).
pub fn explain_files(
    reference: &Path,
    candidate: &Path,
    tensor: Option<&str>,
    model: Option<&Path>,
) -> String {
    let open = |p: &Path| {
        Trace::open(p).map_err(|e| format!("explain: NOT EXPLAINED — {}: {e}\n", p.display()))
    };
    match (open(reference), open(candidate)) {
        (Ok(r), Ok(c)) => explain_first(&r, &c, tensor, model).render(),
        (Err(e), _) | (_, Err(e)) => e,
    }
}

/// Recomputes `tensor`'s first differing elements under every order (module comment).
pub fn explain(
    reference: &Trace,
    candidate: &Trace,
    tensor: &str,
    model: Option<&Path>,
) -> Explanation {
    match try_explain(reference, candidate, tensor, model) {
        Ok(c) => Explanation {
            tensor: tensor.to_string(),
            outcome: Outcome::Checked(Box::new(c)),
        },
        Err(why) => Explanation::not(tensor, why),
    }
}

fn try_explain(
    reference: &Trace,
    candidate: &Trace,
    tensor: &str,
    model: Option<&Path>,
) -> Result<Checked, String> {
    let def = Definition::of(tensor)?;
    let model = model.ok_or_else(|| {
        format!(
            "no --model DIR: {} needs the model's {} (give the checkpoint the traces ran)",
            def.words(),
            def.needs()
        )
    })?;
    let (r_info, c_info) = (
        info(reference, tensor, "reference")?,
        info(candidate, tensor, "candidate")?,
    );
    if r_info.shape != c_info.shape {
        return Err(format!(
            "shapes differ (reference {:?}, candidate {:?}): nothing to recompute element by element",
            r_info.shape, c_info.shape
        ));
    }
    let pair = Pair::new(r_info.dtype, c_info.dtype)
        .filter(|_| float(r_info.dtype) && float(c_info.dtype))
        .ok_or_else(|| {
            format!(
                "dtypes {} / {}: only f32, bf16 and f16 tensors are recomputed",
                r_info.dtype, c_info.dtype
            )
        })?;
    let elements = window(pair, reference, r_info, candidate, c_info);
    if elements.iter().all(|e| e.differs.is_none()) {
        return Err("no element differs by bits: there is no difference to explain".into());
    }
    if r_info.shape.len() < 2 {
        return Err(format!(
            "shape {:?}: a [rows, …] tensor was expected",
            r_info.shape
        ));
    }
    // (row, column within the row): `[rows, heads, head_dim]` is the projection's output
    // `[rows, heads·head_dim]` (docs/capture-points.md, head layout).
    let width = row_width(r_info);
    let at: Vec<(usize, usize)> = elements
        .iter()
        .map(|e| {
            (
                (e.flat_index / width) as usize,
                (e.flat_index % width) as usize,
            )
        })
        .collect();
    let rc = Recompute::load(&def, model, reference, candidate, &at)?;
    let mut notes = rc.notes.clone();
    let ref_side = rc.side(reference, r_info, "reference")?;
    let cand_side = rc.side(candidate, c_info, "candidate")?;
    notes.push(points::inputs_note(&ref_side, &cand_side));
    let (tried, reference_r) = rc.search(
        &ref_side,
        &at,
        r_info.dtype,
        &stored(reference, r_info, &elements),
    );
    let (_, candidate_r) = rc.search(
        &cand_side,
        &at,
        c_info.dtype,
        &stored(candidate, c_info, &elements),
    );
    Ok(Checked {
        definition: rc.definition.clone(),
        notes,
        elements,
        orders_tried: tried,
        reference: reference_r,
        candidate: candidate_r,
    })
}

fn float(d: DType) -> bool {
    matches!(d, DType::F32 | DType::BF16 | DType::F16)
}

fn info<'t>(t: &'t Trace, name: &str, who: &str) -> Result<&'t TensorInfo, String> {
    t.tensor_info(name)
        .ok_or_else(|| format!("the {who} trace holds no tensor {name}"))
}

/// The checked elements, row by row (`[rows, n]`): in each row with a difference, from its first
/// differing element on, every element until `PER_ROW` differ; at most `DIFFERING_CHECKED`
/// differing and `WINDOW` elements in all. Several rows, because a norm's elements of one row
/// share one `inv`: one row tests one reciprocal, each further row another.
fn window(
    pair: Pair,
    reference: &Trace,
    r: &TensorInfo,
    candidate: &Trace,
    c: &TensorInfo,
) -> Vec<Checked1> {
    let (rd, cd) = (reference.data(r), candidate.data(c));
    let width = row_width(r);
    let differs = |i: u64| {
        let d = compare_element(
            pair,
            element_bits(r.dtype, rd, i),
            element_bits(c.dtype, cd, i),
        );
        d.map(|(_, ulp)| ulp.unwrap_or(u64::MAX))
    };
    let mut out = Vec::new();
    let mut total = 0;
    for row in 0..r.shape.first().copied().unwrap_or(0) {
        let span = row * width..(row + 1) * width;
        let Some(first) = span.clone().find(|&i| differs(i).is_some()) else {
            continue;
        };
        let (mut count, start) = (0, out.len());
        for i in first..span.end {
            let d = differs(i);
            count += d.is_some() as usize;
            out.push(Checked1 {
                coords: unravel(i, &r.shape),
                flat_index: i,
                differs: d,
            });
            if count == PER_ROW
                || out.len() - start == ROW_SPAN
                || total + count == DIFFERING_CHECKED
                || out.len() == WINDOW
            {
                break;
            }
        }
        total += count;
        if total == DIFFERING_CHECKED || out.len() == WINDOW {
            break;
        }
    }
    out
}

/// Elements per row of a `[rows, …]` tensor (0 for a scalar or a vector).
fn row_width(info: &TensorInfo) -> u64 {
    match info.shape.len() {
        0 | 1 => 0,
        _ => info.shape[1..].iter().product(),
    }
}

/// One side's stored bits at the checked elements.
fn stored(t: &Trace, info: &TensorInfo, elements: &[Checked1]) -> Vec<u64> {
    let d = t.data(info);
    elements
        .iter()
        .map(|e| element_bits(info.dtype, d, e.flat_index))
        .collect()
}

/// A float tensor of a trace, widened exactly to f32 (f32, bf16, f16).
fn widened(t: &Trace, info: &TensorInfo) -> Result<Vec<f32>, String> {
    if !float(info.dtype) {
        return Err(format!(
            "{} is {}: only f32, bf16 and f16 inputs are read",
            info.name, info.dtype
        ));
    }
    let d = t.data(info);
    Ok((0..info.element_count())
        .map(|i| element_value(info.dtype, d, i) as f32)
        .collect())
}

/// `v` stored as `dtype` (round to nearest even), as its bits.
fn store_as(dtype: DType, v: f32) -> u64 {
    match dtype {
        DType::BF16 => half::bf16::from_f32(v).to_bits() as u64,
        DType::F16 => half::f16::from_f32(v).to_bits() as u64,
        _ => v.to_bits() as u64,
    }
}

/// ULPs between two elements of one dtype (0: the same bits; u64::MAX: a NaN pair).
fn distance(dtype: DType, a: u64, b: u64) -> u64 {
    let pair = Pair {
        reference: dtype,
        candidate: dtype,
    };
    if a == b {
        return 0;
    }
    // Other bits are never 0 away: +0 and −0 are one step apart here.
    match compare_element(pair, a, b) {
        None => 1,
        Some((_, d)) => d.unwrap_or(u64::MAX).max(1),
    }
}
