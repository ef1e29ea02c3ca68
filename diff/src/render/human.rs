//! The human report, streamed: the summary line, both sides, what was compared, the first
//! violation and the first divergence, the per-tensor curve, decisions and findings.

use std::fmt::Write;

use tracegate_trace::DType;

use super::decisions::decisions;
use super::headline::summary;
use super::sink::Sink;
use super::{coords, cosine, left_out, opt_u, real, thousands, MAX_COLUMN};
use crate::{Element, Report, RowSet, TensorRow, TensorViolation, Verdict};

/// An element's distance in words: its ULPs (integers: |difference|), or what kind of
/// difference it is when it has no distance. A mixed pair counted in the candidate's coarser
/// dtype adds the distance in the reference's (`reference`: its dtype), so an f16 candidate
/// outside an f32 policy never reads as "0 ULP" alone.
fn distance(dtype: &str, e: &Element, reference: &str) -> String {
    let (ulp, special) = (e.ulp, e.special);
    let unit = if matches!(dtype, "f64" | "f32" | "f16" | "bf16") {
        format!("ULP ({dtype})")
    } else {
        "absolute".into()
    };
    let dist = match (ulp, e.reference_dtype_ulp) {
        (Some(u), Some(r)) if reference != dtype => format!(
            "{} {unit}, {} ULP ({reference}, the reference's dtype)",
            thousands(u),
            thousands(r)
        ),
        (Some(u), _) => format!("{} {unit}", thousands(u)),
        (None, _) => "none (NaN)".into(),
    };
    let special = special
        .map(|s| format!("  — {}", s.describe()))
        .unwrap_or_default();
    format!("{dist}{special}")
}

/// An element in one line: "[2,5]: 0.5 (0x3f000000) vs 0.50000006 (0x3f000001), 1 ULP (f32)".
fn element_words(dtype: &str, e: &Element, reference: &str) -> String {
    format!(
        "[{}]: {} ({}) vs {} ({}), {}",
        coords(&e.coords),
        e.reference_value,
        e.reference_bits,
        e.candidate_value,
        e.candidate_bits,
        distance(dtype, e, reference)
    )
}

/// A tensor outside the policy in one line (see [`TensorViolation`]).
impl std::fmt::Display for TensorViolation {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let broken: Vec<String> = self.violations.iter().map(|v| v.to_string()).collect();
        write!(f, "{}", broken.join("; "))?;
        if let Some(r) = &self.rule {
            write!(f, " (rule #{} {})", r.index, r.pattern)?;
        }
        if let Some(e) = &self.worst_element {
            write!(
                f,
                "; worst at {}",
                element_words(self.ulp_dtype.unwrap_or(self.dtype), e, self.dtype)
            )?;
        }
        Ok(())
    }
}

/// The lines naming one element: where, both values with their bits, the distance.
fn element_lines(o: &mut Sink<'_>, dtype: &str, reference: &str, label: &str, e: &Element) {
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
    let _ = writeln!(o, "  distance   {}", distance(dtype, e, reference));
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
    if matches!(rep.verdict, Verdict::Unreadable | Verdict::Incomparable)
        && rep.decisions.sampling_divergence.is_none()
    {
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
    if rep.policy.is_none() && rep.verdict == Verdict::Different {
        // By bits, a producer that is not ordered differs everywhere: say that a policy exists.
        let unordered = [&rep.reference, &rep.candidate]
            .into_iter()
            .filter_map(|s| s.producer.as_deref())
            .find(|p| !matches!(*p, "engine" | "contract"));
        if let Some(p) = unordered {
            let _ = writeln!(
                o,
                "  judged by bits: {p} is not a bit-exact producer (engine, contract); --policy f32 (or bf16, f16, q8: the precision claimed) judges by tolerances (docs/diff.md)"
            );
        }
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
            if let Some(rows) = &r.noise_rows {
                let _ = writeln!(o, "  noise rows {}", noise_rows(rows));
            }
        }
        for b in &v.violations {
            let _ = writeln!(o, "  broken     {}: {b}", b.bound);
        }
        if let Some(e) = &v.worst_element {
            element_lines(o, v.ulp_dtype.unwrap_or(v.dtype), v.dtype, "worst", e);
        }
        // "Which tolerance?": what the measurements say would have passed, per rule.
        for p in rep.passing_bounds() {
            let bounds: Vec<String> = p.bounds.iter().map(|(k, v)| format!("{k} {v}")).collect();
            let _ = writeln!(
                o,
                "  to pass    rule #{} {} ({} tensor(s) outside): {}",
                p.rule.index,
                p.rule.pattern,
                p.tensors.len(),
                if bounds.is_empty() {
                    "-".to_string()
                } else {
                    bounds.join(", ")
                }
            );
            for u in &p.unpassable {
                let _ = writeln!(o, "             no bound passes {u}");
            }
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
            &d.dtype,
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
                element_words(r.ulp_dtype.map_or(r.dtype, DType::name), e, r.dtype)
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

/// The noise ratio per token row, as the first violation shows it.
fn noise_rows(rows: &crate::NoiseRows) -> String {
    match rows {
        crate::NoiseRows::None => {
            "none: no token rows (no token axis by name, or not one position per row), the whole-tensor noise ratio alone".into()
        }
        crate::NoiseRows::Rows {
            rows,
            worst,
            undefined,
            first_undefined,
        } => {
            let worst = worst.map_or("no row has a defined ratio".into(), |w| {
                format!(
                    "worst at position {}: {:.3}× (relative L2 {:.3e} / noise {:.3e})",
                    w.position, w.ratio.0, w.rel_l2.0, w.noise_rel_l2.0
                )
            });
            let undefined = first_undefined.map_or(String::new(), |p| {
                format!("; {undefined} undefined, the first at position {p}")
            });
            format!("{rows} rows, {worst}{undefined}")
        }
    }
}
