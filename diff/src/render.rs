//! Human-readable output: one summary line first, then the details a person needs to act on.

use std::borrow::Cow;
use std::fmt::Write;

use serde::ser::{SerializeMap, SerializeSeq, SerializeStruct};
use serde::{Serialize, Serializer};
use tracegate_trace::{Attributes, DType, DecisionInfo, TensorInfo, Trace};

use crate::stats::{each_with_stats, Scalar, TensorStats};
use crate::{
    DecisionStatus, Element, FilterSummary, FindingKind, Flip, Label, Margins, Real, Report,
    RowSet, RowStatus, Special, TensorRow, Verdict,
};

/// Names wider than this overflow their column instead of widening it: a format width is at
/// most 65,535 (wider panics), and one long name must not pad every other row.
const MAX_COLUMN: usize = 80;

/// Control characters (but the newline) and bidirectional-formatting characters: names,
/// attributes and provenance come from files, and raw they could move the cursor, recolour or
/// rewrite a terminal, or reorder what it shows.
fn needs_escape(c: char) -> bool {
    (c.is_control() && c != '\n')
        || matches!(c, '\u{200e}' | '\u{200f}' | '\u{061c}' | '\u{202a}'..='\u{202e}' | '\u{2066}'..='\u{2069}')
}

fn escape_with(s: &str, escape: fn(&mut String, char)) -> Cow<'_, str> {
    if !s.chars().any(needs_escape) {
        return Cow::Borrowed(s);
    }
    let mut out = String::with_capacity(s.len() + 16);
    for c in s.chars() {
        if needs_escape(c) {
            escape(&mut out, c);
        } else {
            out.push(c);
        }
    }
    Cow::Owned(out)
}

/// Text for a terminal: each character [`needs_escape`] names is written as `\u{1b}`.
pub fn terminal_safe(s: &str) -> Cow<'_, str> {
    escape_with(s, |o, c| {
        let _ = write!(o, "\\u{{{:x}}}", c as u32);
    })
}

/// serde_json's pretty layout, with every string fragment passed through [`needs_escape`]:
/// serde_json escapes U+0000..U+001F itself; DEL, the C1 controls and the bidirectional
/// characters become `\u007f`-style escapes here (all in the BMP), the same string once parsed.
struct SafeJson<'a>(serde_json::ser::PrettyFormatter<'a>);

macro_rules! delegate {
    ($($name:ident($($arg:ident: $ty:ty),*)),* $(,)?) => {$(
        fn $name<W: ?Sized + std::io::Write>(&mut self, w: &mut W $(, $arg: $ty)*) -> std::io::Result<()> {
            self.0.$name(w $(, $arg)*)
        }
    )*};
}

impl serde_json::ser::Formatter for SafeJson<'_> {
    delegate!(
        begin_array(),
        end_array(),
        begin_array_value(first: bool),
        end_array_value(),
        begin_object(),
        end_object(),
        begin_object_key(first: bool),
        end_object_key(),
        begin_object_value(),
        end_object_value(),
    );
    fn write_string_fragment<W: ?Sized + std::io::Write>(
        &mut self,
        w: &mut W,
        fragment: &str,
    ) -> std::io::Result<()> {
        let safe = escape_with(fragment, |o, c| {
            let _ = write!(o, "\\u{:04x}", c as u32);
        });
        w.write_all(safe.as_bytes())
    }
}

/// Writes the JSON report streamed (no whole-report string), pretty, newline-terminated.
pub fn write_json(rep: &Report, out: &mut dyn std::io::Write) -> std::io::Result<()> {
    pretty_json(rep, out)
}

fn pretty_json(value: &impl Serialize, out: &mut dyn std::io::Write) -> std::io::Result<()> {
    let mut ser = serde_json::Serializer::with_formatter(
        &mut *out,
        SafeJson(serde_json::ser::PrettyFormatter::new()),
    );
    value.serialize(&mut ser).map_err(std::io::Error::other)?;
    out.write_all(b"\n")?;
    out.flush()
}

/// 18676984 → "18,676,984".
pub fn thousands(n: u64) -> String {
    let s = n.to_string();
    let mut out = String::new();
    for (i, ch) in s.chars().enumerate() {
        if i > 0 && (s.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(ch);
    }
    out
}

fn real(x: Option<Real>) -> String {
    match x {
        None => "-".into(),
        Some(Real(v)) if v.is_nan() => "nan".into(),
        Some(Real(v)) if v.is_infinite() => {
            if v > 0.0 {
                "inf".into()
            } else {
                "-inf".into()
            }
        }
        Some(Real(0.0)) => "0".into(),
        Some(Real(v)) if (1e-3..1e6).contains(&v.abs()) => format!("{v:.6}")
            .trim_end_matches('0')
            .trim_end_matches('.')
            .to_string(),
        Some(Real(v)) => format!("{v:.3e}"),
    }
}

/// Cosine near 1 is printed as its distance from 1, so 1 − 1e-15 never reads as exactly 1.
fn cosine(x: Option<Real>) -> String {
    match x {
        Some(Real(1.0)) => "1".into(),
        Some(Real(v)) if v.is_finite() && v > 0.999 => format!("1-{:.2e}", 1.0 - v),
        Some(Real(v)) if v.is_finite() => format!("{v:.6}"),
        other => real(other),
    }
}

fn coords(c: &[u64]) -> String {
    c.iter()
        .map(|x| x.to_string())
        .collect::<Vec<_>>()
        .join(",")
}

fn opt_u(x: Option<u64>) -> String {
    x.map(thousands).unwrap_or_else(|| "-".into())
}

fn decisions_clause(rep: &Report) -> String {
    let d = &rep.decisions;
    let n = d.reference_count;
    if d.differing == 0 && d.missing.is_empty() && d.extra.is_empty() && d.compared == n {
        format!("{n} decision{}", if n == 1 { "" } else { "s" })
    } else {
        let mut s = format!("{} of {} decisions differ", d.differing, n);
        let mut notes = Vec::new();
        let uncompared = n.saturating_sub(d.compared + d.missing.len());
        if uncompared > 0 {
            notes.push(format!("{uncompared} not compared: shape differs"));
        }
        if !d.missing.is_empty() || !d.extra.is_empty() {
            notes.push(format!(
                "{} missing, {} extra",
                d.missing.len(),
                d.extra.len()
            ));
        }
        notes.extend(near_ties_note(rep));
        if !notes.is_empty() {
            s += &format!(" ({})", notes.join("; "));
        }
        s
    }
}

/// "2 near-ties excused: layer.00.router.topk row 5, …; 14 rows after a near-tie not judged",
/// so a verdict never hides what it excused.
fn near_ties_note(rep: &Report) -> Option<String> {
    let n = rep
        .decisions
        .near_ties
        .as_ref()
        .filter(|n| !n.excused.is_empty())?;
    const SHOWN: usize = 3;
    let mut which: Vec<String> = n
        .excused
        .iter()
        .take(SHOWN)
        .map(|e| format!("{} row {}", e.decision, e.row))
        .collect();
    if n.excused.len() > SHOWN {
        which.push(format!("{} more", n.excused.len() - SHOWN));
    }
    let k = n.excused.len();
    let rows = n.rows_after();
    Some(format!(
        "{k} near-tie{} excused: {}; {rows} row{} after a near-tie not judged",
        if k == 1 { "" } else { "s" },
        which.join(", "),
        if rows == 1 { "" } else { "s" }
    ))
}

/// How a flip's label reads: with the upstream tensor, the near-tie it follows, or the gap
/// against the noise bound (the gate prints flips the same way).
pub fn label_text(f: &Flip) -> String {
    let vs = |op: &str| match (f.gap, f.noise_bound) {
        (Some(g), Some(b)) => format!(" (gap {} {op} bound {})", real(Some(g)), real(Some(b))),
        _ => String::new(),
    };
    match f.label {
        Label::Consequence => format!("consequence of {}", f.upstream.as_deref().unwrap_or("?")),
        Label::AfterNearTie => format!("after a near-tie ({})", f.after.as_deref().unwrap_or("?")),
        Label::NearTie => format!("near-tie{}", vs("≤")),
        Label::Defect => format!("{}{}", f.label, vs(">")),
    }
}

fn summary(rep: &Report) -> String {
    let t = &rep.tensors;
    let common = rep.per_tensor.len();
    match rep.verdict {
        Verdict::Unreadable | Verdict::Incomparable => {
            let word = if rep.verdict == Verdict::Unreadable { "UNREADABLE" } else { "INCOMPARABLE" };
            let refusals: Vec<_> = rep.findings.iter().filter(|f| f.kind != FindingKind::StackMismatchAllowed).collect();
            let first = refusals.first().map(|f| match f.tensor() {
                Some(t) => format!("{} ({t}): {}", f.kind, f.detail),
                None => format!("{}: {}", f.kind, f.detail),
            });
            let more = if refusals.len() > 1 { format!(" (+{} more)", refusals.len() - 1) } else { String::new() };
            format!("{word} — {}{more}", first.unwrap_or_default())
        }
        Verdict::Identical => format!(
            "IDENTICAL — {common} tensors ({} by digest, {} element-wise), 0 differing elements, {}",
            t.matched_by_digest.len(),
            t.compared_elementwise.len(),
            decisions_clause(rep)
        ),
        Verdict::WithinPolicy => {
            let within = rep.per_tensor.iter().filter(|r| r.status == RowStatus::WithinPolicy).count();
            format!(
                "WITHIN POLICY — {common} tensors judged by policy {:?} ({} bit-identical, {within} within bounds), {}",
                rep.policy.as_ref().map(|p| p.name.as_str()).unwrap_or(""),
                common - within,
                decisions_clause(rep)
            )
        }
        Verdict::Different => {
            let mut parts = Vec::new();
            if rep.policy.is_some() {
                // Under a policy bits are not the question (the first bit difference may be
                // rounding noise within it): the headline names the first tensor outside it.
                parts.extend(policy_clauses(rep));
            } else if let Some(d) = &rep.first_divergence {
                let dist = match (d.special, d.ulp) {
                    (Some(s), _) if d.ulp.is_none() || d.ulp == Some(0) => s.describe().to_string(),
                    // Across dtypes the unit is named: the coarser dtype's ULPs.
                    (_, Some(u)) if d.candidate_dtype != d.dtype => format!("{} ULP ({})", thousands(u), d.ulp_dtype.as_deref().unwrap_or("-")),
                    (_, Some(u)) if d.ulp_dtype.is_some() => format!("{} ULP", thousands(u)),
                    (_, Some(u)) => format!("|diff| {}", thousands(u)),
                    _ => String::new(),
                };
                parts.push(format!(
                    "first at {}[{}]: {} ({}) vs {} ({}), {} ({}/{} elements differ)",
                    d.tensor,
                    coords(&d.coords),
                    d.reference_value,
                    d.reference_bits,
                    d.candidate_value,
                    d.candidate_bits,
                    dist,
                    thousands(d.differing_elements),
                    thousands(d.total_elements)
                ));
            } else if common > 0 && rerouted_clause(rep).is_none() {
                // Equal values in two dtypes are not identical: say so, not "identical".
                match rep.per_tensor.iter().filter(|r| r.candidate_dtype.name() != r.dtype).count() {
                    0 => parts.push(format!("values identical in all {common} common tensors")),
                    mixed => parts.push(format!("values equal in all {common} common tensors, {mixed} of them in two dtypes (never bit-identical)")),
                }
            }
            if rep.policy.is_none() {
                parts.extend(rerouted_clause(rep));
            }
            let structural = rep
                .findings
                .iter()
                .filter(|f| {
                    matches!(
                        f.kind,
                        FindingKind::MissingTensor
                            | FindingKind::ExtraTensor
                            | FindingKind::DtypeMismatch
                            | FindingKind::ShapeMismatch
                            | FindingKind::OrderMismatch
                            | FindingKind::DecisionOrderMismatch
                            | FindingKind::DecisionShapeMismatch
                    )
                })
                .count();
            if structural > 0 {
                parts.push(format!("{structural} structure finding{}", if structural == 1 { "" } else { "s" }));
            }
            // Content beyond values and decision rows: otherwise this line could read as equal.
            let content: Vec<&str> = rep
                .findings
                .iter()
                .filter(|f| {
                    matches!(
                        f.kind,
                        FindingKind::AttributeDiffers
                            | FindingKind::MarginDiffers
                            | FindingKind::MarginPresenceMismatch
                            | FindingKind::ContentDigestDiffers
                    )
                })
                .map(|f| f.kind.as_str())
                .collect();
            if let Some(first) = content.first() {
                parts.push(format!("{} content finding{} (first: {})", content.len(), if content.len() == 1 { "" } else { "s" }, first.replace('_', " ")));
            }
            parts.push(decisions_clause(rep));
            format!("DIFFERENT — {}", parts.join("; "))
        }
    }
}

/// The headline's account of the tensors under a policy: how many fail, and the first
/// violation with its first broken bound; else that every tensor is within it.
fn policy_clauses(rep: &Report) -> Vec<String> {
    let common = rep.per_tensor.len();
    let mut parts = Vec::new();
    let outside = rep
        .per_tensor
        .iter()
        .filter(|r| r.status == RowStatus::OutsidePolicy)
        .count();
    if let Some(v) = rep.first_violation() {
        let more = match v.violations.len() {
            0 | 1 => String::new(),
            n => format!(" (+{} more bound{})", n - 1, if n == 2 { "" } else { "s" }),
        };
        let bound = v
            .violations
            .first()
            .map(|b| b.to_string())
            .unwrap_or_default();
        let rule = v
            .rule
            .as_ref()
            .map(|x| format!(" by rule #{} {}", x.index, x.pattern))
            .unwrap_or_default();
        parts.push(format!(
            "{outside} of {common} tensors outside the policy, first {}: {bound}{more}{rule}",
            v.tensor
        ));
    }
    let unruled: Vec<&TensorRow> = rep
        .per_tensor
        .iter()
        .filter(|r| r.status == RowStatus::NoRule)
        .collect();
    if let Some(first) = unruled.first() {
        let n = unruled.len();
        parts.push(format!(
            "{n} tensor{} without a policy rule (first: {})",
            if n == 1 { "" } else { "s" },
            first.tensor
        ));
    }
    parts.extend(rerouted_clause(rep));
    if parts.is_empty() && common > 0 {
        let within = rep
            .per_tensor
            .iter()
            .filter(|r| r.status == RowStatus::WithinPolicy)
            .count();
        parts.push(format!(
            "all {common} tensors within the policy ({} bit-identical, {within} within bounds)",
            common - within
        ));
    }
    parts
}

/// Expert tensors the routing sent other tokens (docs/diff.md, "Rerouted experts"): they fail
/// even where every row both sides hold is equal, so the headline names them.
fn rerouted_clause(rep: &Report) -> Option<String> {
    let rerouted: Vec<&TensorRow> = rep
        .per_tensor
        .iter()
        .filter(|r| r.status == RowStatus::Rerouted)
        .collect();
    let n = rerouted.len();
    rerouted.first().map(|first| {
        format!(
            "{n} expert tensor{} rerouted (first: {})",
            if n == 1 { "" } else { "s" },
            first.tensor
        )
    })
}

/// An element's distance in words: its ULPs (integers: |difference|), or what kind of
/// difference it is when it has no distance.
fn distance(dtype: &str, ulp: Option<u64>, special: Option<Special>) -> String {
    let unit = if matches!(dtype, "f64" | "f32" | "f16" | "bf16") {
        format!("ULP ({dtype})")
    } else {
        "absolute".into()
    };
    let dist = match ulp {
        Some(u) => format!("{} {unit}", thousands(u)),
        None => "none (NaN)".into(),
    };
    let special = special
        .map(|s| format!("  — {}", s.describe()))
        .unwrap_or_default();
    format!("{dist}{special}")
}

/// An element in one line: "[2,5]: 0.5 (0x3f000000) vs 0.50000006 (0x3f000001), 1 ULP (f32)".
pub(crate) fn element_words(dtype: &str, e: &Element) -> String {
    format!(
        "[{}]: {} ({}) vs {} ({}), {}",
        coords(&e.coords),
        e.reference_value,
        e.reference_bits,
        e.candidate_value,
        e.candidate_bits,
        distance(dtype, e.ulp, e.special)
    )
}

/// The lines naming one element: where, both values with their bits, the distance.
fn element_lines(o: &mut Sink<'_>, dtype: &str, label: &str, e: &Element) {
    let _ = writeln!(
        o,
        "  {label:<9}  [{}]  (flat index {})",
        coords(&e.coords),
        thousands(e.flat_index)
    );
    let _ = writeln!(
        o,
        "  reference  {}  ({})",
        e.reference_value, e.reference_bits
    );
    let _ = writeln!(
        o,
        "  candidate  {}  ({})",
        e.candidate_value, e.candidate_bits
    );
    let _ = writeln!(o, "  distance   {}", distance(dtype, e.ulp, e.special));
}

/// Text on its way to a writer, made [`terminal_safe`] and flushed every 64 KiB at a line end,
/// so a report of a million rows never sits in memory whole. The first write error is kept.
struct Sink<'a> {
    buf: String,
    out: &'a mut dyn std::io::Write,
    error: Option<std::io::Error>,
}

impl<'a> Sink<'a> {
    fn new(out: &'a mut dyn std::io::Write) -> Self {
        Sink {
            buf: String::new(),
            out,
            error: None,
        }
    }
    fn flush(&mut self) {
        if self.error.is_none() {
            if let Err(e) = self.out.write_all(terminal_safe(&self.buf).as_bytes()) {
                self.error = Some(e);
            }
        }
        self.buf.clear();
    }
    fn finish(mut self) -> std::io::Result<()> {
        self.flush();
        match self.error.take() {
            Some(e) => Err(e),
            None => self.out.flush(),
        }
    }
}

impl Write for Sink<'_> {
    fn write_str(&mut self, s: &str) -> std::fmt::Result {
        self.buf.push_str(s);
        if self.buf.len() >= 1 << 16 && self.buf.ends_with('\n') {
            self.flush();
        }
        Ok(())
    }
}

/// The full human report.
pub fn render_human(rep: &Report) -> String {
    let mut out = Vec::new();
    write_human(rep, &mut out).expect("writing to a Vec cannot fail");
    String::from_utf8(out).expect("the report is text")
}

/// Writes the human report, streamed (see [`Sink`]).
pub fn write_human(rep: &Report, out: &mut dyn std::io::Write) -> std::io::Result<()> {
    let mut sink = Sink::new(out);
    human(&mut sink, rep);
    sink.finish()
}

fn human(o: &mut Sink<'_>, rep: &Report) {
    let _ = writeln!(o, "{}", summary(rep));
    for (label, s) in [("reference", &rep.reference), ("candidate", &rep.candidate)] {
        let digest = s
            .digest
            .as_deref()
            .map(|d| &d[..16.min(d.len())])
            .unwrap_or("-");
        let verified = if s.verified {
            "verified"
        } else {
            "not verified"
        };
        let _ = writeln!(
            o,
            "  {label}  {}  digest {digest}  {verified}{}",
            s.path.as_deref().unwrap_or("-"),
            s.producer
                .as_deref()
                .map(|p| format!("  producer {p}"))
                .unwrap_or_default()
        );
    }
    if let Some(f) = &rep.filter {
        let _ = writeln!(o, "  filter     {} (not compared, not counted); the verdict covers only what was compared", left_out(f));
    }
    if matches!(rep.verdict, Verdict::Unreadable | Verdict::Incomparable) {
        findings(o, rep);
        return;
    }
    let t = &rep.tensors;
    let _ = writeln!(
        o,
        "  tensors    {} in reference, {} in candidate; {} matched by digest, {} compared element-wise, {} not scanned; {} missing, {} extra",
        t.reference_count,
        t.candidate_count,
        t.matched_by_digest.len(),
        t.compared_elementwise.len(),
        t.not_scanned.len(),
        t.missing.len(),
        t.extra.len()
    );
    if !t.compared_elementwise.is_empty() {
        let shown = t.compared_elementwise.len().min(8);
        let more = t.compared_elementwise.len() - shown;
        let more = if more > 0 {
            format!(" and {more} more")
        } else {
            String::new()
        };
        let names: Vec<&str> = rep.names(RowSet::CompareElementwise).take(shown).collect();
        let _ = writeln!(o, "  element-wise: {}{more}", names.join(", "));
    }
    if rep.scan != "all" && (!t.matched_by_digest.is_empty() || t.compared_elementwise.len() > 8) {
        let _ = writeln!(
            o,
            "  (--all prints every tensor with how it was compared; --json lists both sets)"
        );
    }
    if let Some(v) = &rep.first_violation() {
        let _ = writeln!(o, "first violation (the first tensor outside the policy)");
        let dtypes = if v.candidate_dtype == v.dtype {
            v.dtype.to_string()
        } else {
            format!("{} vs {}", v.dtype, v.candidate_dtype)
        };
        let _ = writeln!(o, "  tensor     {}  {dtypes} {:?}", v.tensor, v.shape);
        if let Some(r) = &v.rule {
            let _ = writeln!(o, "  rule       #{} {}", r.index, r.pattern);
        }
        for b in &v.violations {
            let _ = writeln!(o, "  broken     {}: {b}", b.bound);
        }
        if let Some(e) = &v.worst_element {
            element_lines(o, v.ulp_dtype.unwrap_or(v.dtype), "worst", e);
        }
    }
    if let Some(d) = &rep.first_divergence {
        // Under a policy the first bit difference may be within it; it is still where the
        // bits first part, so it stays, named for what it is.
        let _ = writeln!(
            o,
            "{}",
            if rep.policy.is_some() {
                "first bit difference"
            } else {
                "first divergence"
            }
        );
        let dtypes = if d.candidate_dtype == d.dtype {
            d.dtype.clone()
        } else {
            format!("{} vs {}", d.dtype, d.candidate_dtype)
        };
        let _ = writeln!(o, "  tensor     {}  {dtypes} {:?}", d.tensor, d.shape);
        element_lines(
            o,
            d.ulp_dtype.as_deref().unwrap_or(&d.dtype),
            "element",
            &d.element(),
        );
        let _ = writeln!(
            o,
            "  elements   {} of {} differ",
            thousands(d.differing_elements),
            thousands(d.total_elements)
        );
        let _ = writeln!(
            o,
            "  ULP        max {}, median {}",
            opt_u(d.max_ulp),
            opt_u(d.median_ulp)
        );
        let _ = writeln!(
            o,
            "  abs / rel  max abs {}, max rel {}",
            real(Some(d.max_abs)),
            real(Some(d.max_rel))
        );
        let _ = writeln!(
            o,
            "  cosine     {}, relative L2 {}",
            cosine(d.cosine),
            real(d.rel_l2)
        );
    }
    if rep.scan == "first" && !t.not_scanned.is_empty() {
        let n = t.not_scanned.len();
        let _ = writeln!(o, "not scanned after the first difference: {n} later tensor{} (what follows a divergence is noise; --all scans them)", if n == 1 { "" } else { "s" });
    }
    if rep.scan == "all" && !rep.per_tensor.is_empty() {
        curve(o, rep);
    }
    decisions(o, rep);
    findings(o, rep);
}

fn curve(o: &mut Sink<'_>, rep: &Report) {
    let w = rep
        .per_tensor
        .iter()
        .map(|r| r.tensor.len())
        .max()
        .unwrap_or(6)
        .clamp(6, MAX_COLUMN);
    let _ = writeln!(o, "per tensor (reference order)");
    let with_rule = rep.policy.is_some();
    let _ = writeln!(
        o,
        "  {:w$}  {:14}  {:>21}  {:>12}  {:>10}  {:>10}  {:>11}  {}",
        "tensor",
        "status",
        "differing/total",
        "max ULP",
        "max rel",
        "rel L2",
        "cosine",
        if with_rule { "rule" } else { "method" }
    );
    for r in &rep.per_tensor {
        let diff = match r.differing_elements {
            Some(d) => format!("{}/{}", thousands(d), thousands(r.total_elements)),
            None => format!("?/{}", thousands(r.total_elements)),
        };
        let last = if with_rule {
            r.rule
                .as_ref()
                .map(|x| format!("#{} {}", x.index, x.pattern))
                .unwrap_or_else(|| "NO RULE".into())
        } else {
            r.method.to_string()
        };
        let _ = writeln!(
            o,
            "  {:w$}  {:14}  {:>21}  {:>12}  {:>10}  {:>10}  {:>11}  {}",
            r.tensor,
            r.status,
            diff,
            max_ulp_cell(r),
            real(r.max_rel),
            real(r.rel_l2),
            cosine(r.cosine),
            last
        );
        for v in &r.violations {
            let _ = writeln!(o, "  {:w$}    ! {}: {v}", "", v.bound);
        }
        if let Some(e) = &r.worst_element {
            let _ = writeln!(
                o,
                "  {:w$}    ! worst at {}",
                "",
                element_words(r.ulp_dtype.map_or(r.dtype, DType::name), e)
            );
        }
    }
}

/// A row's max ULP; across dtypes with the dtype whose ULPs it counts, e.g. `3 bf16`.
fn max_ulp_cell(r: &TensorRow) -> String {
    match r.ulp_dtype {
        Some(u) if r.candidate_dtype.name() != r.dtype && r.max_ulp.is_some() => {
            format!("{} {u}", opt_u(r.max_ulp))
        }
        _ => opt_u(r.max_ulp),
    }
}

fn decisions(o: &mut Sink<'_>, rep: &Report) {
    let d = &rep.decisions;
    if d.results.is_empty() && d.missing.is_empty() && d.extra.is_empty() {
        return;
    }
    let _ = writeln!(
        o,
        "decisions  {} compared, {} differ",
        d.compared, d.differing
    );
    for r in &d.results {
        let state = match r.status {
            DecisionStatus::Identical => format!("identical ({} rows)", r.rows),
            DecisionStatus::ShapeMismatch => "shape mismatch".into(),
            DecisionStatus::Different => {
                let reord = if r.reordered_rows > 0 {
                    format!(", {} same values in a different order", r.reordered_rows)
                } else {
                    String::new()
                };
                format!("{} of {} rows differ{reord}", r.differing_rows, r.rows)
            }
        };
        let after = if r.rows_after_near_tie > 0 {
            format!("; {} after a near-tie, not judged", r.rows_after_near_tie)
        } else {
            String::new()
        };
        let state = state + &after;
        let _ = writeln!(o, "  {} {:?}  {state}", r.name, r.shape);
        if let Some(m) = &r.first_margin_difference {
            let n = if r.margins == Margins::WithinTolerance {
                r.margin_differing_rows
            } else {
                r.margin_outside_rows
            };
            let bound = m
                .tolerance
                .map(|t| format!(", tolerance {}", real(Some(t))))
                .unwrap_or_default();
            let _ = writeln!(
                o,
                "    margins {}: {n} row{} (first row {}: {} ({}) vs {} ({}){bound})",
                r.margins.as_str().replace('_', " "),
                if n == 1 { "" } else { "s" },
                m.row,
                real(Some(m.reference)),
                m.reference_bits,
                real(Some(m.candidate)),
                m.candidate_bits
            );
        } else if let Some(side) = match r.margins {
            Margins::ReferenceOnly => Some("reference"),
            Margins::CandidateOnly => Some("candidate"),
            _ => None,
        } {
            let _ = writeln!(o, "    margins in the {side} only");
        }
        for f in r.flips.iter().take(10) {
            let what = if f.same_values_different_order {
                "  same values, different order"
            } else {
                ""
            };
            let _ = writeln!(
                o,
                "    row {}: {:?} vs {:?}{what}; margin ref {} cand {}; {} divergence {} → {}",
                f.row,
                f.reference,
                f.candidate,
                real(f.reference_margin),
                real(f.candidate_margin),
                r.source.as_deref().unwrap_or("(no source tensor)"),
                real(f.source_divergence),
                label_text(f)
            );
        }
        if r.flips.len() > 10 {
            let _ = writeln!(
                o,
                "    … {} more differing rows (see --json)",
                r.flips.len() - 10
            );
        }
    }
    if let Some(n) = d.near_ties.as_ref().filter(|n| !n.excused.is_empty()) {
        let which: Vec<String> = n
            .excused
            .iter()
            .map(|e| format!("{} row {} (position {})", e.decision, e.row, e.position))
            .collect();
        let _ = writeln!(
            o,
            "near-ties  {} excused by the policy (gap ≤ {}·divergence): {}",
            n.excused.len(),
            real(Some(Real(n.margin_factor))),
            which.join(", ")
        );
        let mut after: Vec<String> = n
            .tensors
            .iter()
            .map(|t| {
                format!(
                    "{} {} row{}",
                    t.tensor,
                    t.rows,
                    if t.rows == 1 { "" } else { "s" }
                )
            })
            .collect();
        if n.decision_rows > 0 {
            after.push(format!(
                "{} decision row{}",
                n.decision_rows,
                if n.decision_rows == 1 { "" } else { "s" }
            ));
        }
        if !after.is_empty() {
            let _ = writeln!(o, "  after a near-tie, not judged: {}", after.join(", "));
        }
    }
}

fn findings(o: &mut Sink<'_>, rep: &Report) {
    if rep.findings.is_empty() {
        return;
    }
    let _ = writeln!(o, "findings   {}", rep.findings.len());
    for f in &rep.findings {
        match f.tensor() {
            Some(t) => {
                let _ = writeln!(o, "  {}  {t}: {}", f.kind, f.detail);
            }
            None => {
                let _ = writeln!(o, "  {}  {}", f.kind, f.detail);
            }
        }
    }
}

fn attrs(a: &Attributes) -> String {
    let mut parts = Vec::new();
    if let Some(p) = &a.path {
        parts.push(format!("path={p}"));
    }
    if let Some(m) = &a.mask {
        parts.push(format!("mask={m}"));
    }
    if let Some(p) = &a.positions {
        let s = match p.len() {
            0 => "[]".to_string(),
            1..=4 => format!("{p:?}"),
            n => format!("[{}..{}]({n})", p[0], p[n - 1]),
        };
        parts.push(format!("positions={s}"));
    }
    if let Some(s) = a.step {
        parts.push(format!("step={s}"));
    }
    for (k, v) in &a.extra {
        parts.push(format!("{k}={v}"));
    }
    parts.join(" ")
}

/// "--only 'x' left out 120 tensors and 7 decisions".
fn left_out(f: &FilterSummary) -> String {
    let plural = |n: usize, what: &str| {
        format!(
            "{} {what}{}",
            thousands(n as u64),
            if n == 1 { "" } else { "s" }
        )
    };
    format!(
        "{} left out {} and {}",
        f.filter,
        plural(f.tensors_left_out, "tensor"),
        plural(f.decisions_left_out, "decision")
    )
}

/// The tensors and decisions `--show` lists: those the filter selects, in capture order.
fn shown<'a>(
    t: &'a Trace,
    filter: Option<&'a FilterSummary>,
) -> (
    impl Iterator<Item = &'a TensorInfo> + Clone,
    impl Iterator<Item = &'a DecisionInfo> + Clone,
) {
    let keep = move |name: &str| filter.is_none_or(|f| f.selects(name));
    (
        t.tensors().iter().filter(move |x| keep(&x.name)),
        t.decisions().iter().filter(move |x| keep(&x.name)),
    )
}

fn scalar(x: Option<Scalar>) -> String {
    match x {
        Some(Scalar::Int(v)) => v.to_string(),
        Some(Scalar::Float(v)) => real(Some(Real(v))),
        None => "-".into(),
    }
}

/// `trace-diff --show FILE`: what a trace holds, for a person (see [`write_show`]).
pub fn render_show(
    t: &Trace,
    verify: Option<&Result<(), String>>,
    filter: Option<&FilterSummary>,
) -> String {
    let mut out = Vec::new();
    write_show(t, verify, filter, &mut out).expect("writing to a Vec cannot fail");
    String::from_utf8(out).expect("every line is a String")
}

/// Writes `--show` line by line, each made [`terminal_safe`]: memory stays one line (and one
/// batch of statistics), not the whole listing, however many tensors the trace holds. With a
/// filter, only the tensors and decisions it selects are listed.
pub fn write_show(
    t: &Trace,
    verify: Option<&Result<(), String>>,
    filter: Option<&FilterSummary>,
    out: &mut impl std::io::Write,
) -> std::io::Result<()> {
    let mut line = String::new();
    let emit = |line: &mut String, out: &mut dyn std::io::Write| -> std::io::Result<()> {
        line.push('\n');
        out.write_all(terminal_safe(line).as_bytes())?;
        line.clear();
        Ok(())
    };
    macro_rules! say {
        ($($arg:tt)*) => {{
            let _ = write!(line, $($arg)*);
            emit(&mut line, out)?;
        }};
    }
    say!("{}", t.path().display());
    say!("  digest   {}", t.digest().hex());
    say!("  format   {}.{}", t.version().0, t.version().1);
    say!(
        "  verify   {}",
        match verify {
            None => "skipped (--no-verify)".to_string(),
            Some(Ok(())) => "ok (every digest recomputed)".to_string(),
            Some(Err(e)) => format!("FAILED: {e}"),
        }
    );
    if let Some(f) = filter {
        say!("  filter   {}", left_out(f));
    }
    say!("provenance");
    let pretty = serde_json::to_string_pretty(t.provenance()).unwrap_or_default();
    for l in pretty.lines() {
        say!("  {l}");
    }
    let (tensors, decisions) = shown(t, filter);
    say!("tensors ({})", tensors.clone().count());
    let w = tensors
        .clone()
        .map(|x| x.name.len())
        .max()
        .unwrap_or(4)
        .clamp(4, MAX_COLUMN);
    say!(
        "  {:w$}  {:5}  {:18}  {:>10}  {:>10}  {:>10}  {:>10}  {:>5}  {:>5}  {:16}  attributes",
        "name",
        "dtype",
        "shape",
        "min",
        "max",
        "mean",
        "max |x|",
        "NaN",
        "Inf",
        "xxh3-128"
    );
    each_with_stats(t, tensors, |x, st: TensorStats| {
        let digest = format!("{:032x}", x.digest);
        say!(
            "  {:w$}  {:5}  {:18}  {:>10}  {:>10}  {:>10}  {:>10}  {:>5}  {:>5}  {:16}  {}",
            x.name,
            x.dtype.name(),
            format!("{:?}", x.shape),
            scalar(st.min),
            scalar(st.max),
            real(st.mean),
            real(st.max_abs),
            st.nan,
            st.inf,
            &digest[..16],
            attrs(&x.attributes)
        );
        Ok::<(), std::io::Error>(())
    })?;
    say!("decisions ({})", decisions.clone().count());
    let w = decisions
        .clone()
        .map(|x| x.name.len())
        .max()
        .unwrap_or(4)
        .clamp(4, MAX_COLUMN);
    say!(
        "  {:w$}  {:10}  {:24}  min margin",
        "name",
        "shape",
        "first values"
    );
    for d in decisions {
        let values = t.decision_values(d);
        let mut first: Vec<String> = values.iter().take(8).map(|v| v.to_string()).collect();
        if values.len() > 8 {
            first.push("…".into());
        }
        let min_margin = match t.decision_margins(d) {
            None => "-".to_string(),
            Some(m) => {
                let (row, v) =
                    m.iter()
                        .enumerate()
                        .fold((0usize, f32::INFINITY), |acc, (i, &x)| {
                            if x < acc.1 {
                                (i, x)
                            } else {
                                acc
                            }
                        });
                if m.is_empty() {
                    "-".into()
                } else {
                    format!("{} (row {row})", real(Some(Real(v as f64))))
                }
            }
        };
        say!(
            "  {:w$}  {:10}  {:24}  {min_margin}",
            d.name,
            format!("{:?}", d.shape),
            first.join(" ")
        );
    }
    Ok(())
}

/// `trace-diff --show FILE --json`: the trace's description as JSON (fields in docs/diff.md,
/// "--show"), streamed like [`write_json`], with the same escaping.
pub fn write_show_json(
    t: &Trace,
    verify: Option<&Result<(), String>>,
    filter: Option<&FilterSummary>,
    out: &mut dyn std::io::Write,
) -> std::io::Result<()> {
    pretty_json(&ShowJson { t, verify, filter }, out)
}

struct ShowJson<'a> {
    t: &'a Trace,
    verify: Option<&'a Result<(), String>>,
    filter: Option<&'a FilterSummary>,
}

impl Serialize for ShowJson<'_> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let t = self.t;
        let mut st = s.serialize_struct("Show", 9)?;
        st.serialize_field("path", &t.path().display().to_string())?;
        st.serialize_field("digest", &t.digest().hex())?;
        st.serialize_field("format", &format!("{}.{}", t.version().0, t.version().1))?;
        // null: not verified (--no-verify); false: verification failed, with the reason.
        st.serialize_field("verified", &self.verify.map(|v| v.is_ok()))?;
        st.serialize_field("verify_error", &self.verify.and_then(|v| v.as_ref().err()))?;
        st.serialize_field("provenance", t.provenance())?;
        st.serialize_field("filter", &self.filter)?;
        st.serialize_field("tensors", &TensorList(t, self.filter))?;
        st.serialize_field("decisions", &DecisionList(t, self.filter))?;
        st.end()
    }
}

/// The listed tensors with their statistics, computed batch by batch while serialising.
struct TensorList<'a>(&'a Trace, Option<&'a FilterSummary>);

impl Serialize for TensorList<'_> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let mut seq = s.serialize_seq(None)?;
        each_with_stats(self.0, shown(self.0, self.1).0, |x, statistics| {
            seq.serialize_element(&TensorJson { x, statistics })
        })?;
        seq.end()
    }
}

struct TensorJson<'a> {
    x: &'a TensorInfo,
    statistics: TensorStats,
}

impl Serialize for TensorJson<'_> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let x = self.x;
        let mut st = s.serialize_struct("Tensor", 6)?;
        st.serialize_field("name", &x.name)?;
        st.serialize_field("dtype", x.dtype.name())?;
        st.serialize_field("shape", &x.shape)?;
        st.serialize_field("attributes", &AttrsJson(&x.attributes))?;
        st.serialize_field("digest", &format!("{:032x}", x.digest))?;
        st.serialize_field("statistics", &self.statistics)?;
        st.end()
    }
}

/// Attributes as one object: `path`, `mask`, `positions`, `step` when present, then the
/// extra string attributes (which never reuse those four keys).
struct AttrsJson<'a>(&'a Attributes);

impl Serialize for AttrsJson<'_> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let a = self.0;
        let mut m = s.serialize_map(None)?;
        if let Some(v) = &a.path {
            m.serialize_entry("path", v)?;
        }
        if let Some(v) = &a.mask {
            m.serialize_entry("mask", v)?;
        }
        if let Some(v) = &a.positions {
            m.serialize_entry("positions", v)?;
        }
        if let Some(v) = &a.step {
            m.serialize_entry("step", v)?;
        }
        for (k, v) in &a.extra {
            m.serialize_entry(k, v)?;
        }
        m.end()
    }
}

struct DecisionList<'a>(&'a Trace, Option<&'a FilterSummary>);

impl Serialize for DecisionList<'_> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        #[derive(Serialize)]
        struct Decision<'a> {
            name: &'a str,
            shape: &'a [u64],
            has_margins: bool,
        }
        s.collect_seq(shown(self.0, self.1).1.map(|d| Decision {
            name: &d.name,
            shape: &d.shape,
            has_margins: d.has_margins(),
        }))
    }
}
