//! `trace-diff --show FILE`: what one trace holds, as text or JSON, streamed.

use std::fmt::Write;

use serde::ser::{SerializeMap, SerializeSeq, SerializeStruct};
use serde::{Serialize, Serializer};
use tracegate_trace::{Attributes, DecisionInfo, TensorInfo, Trace};

use super::escape::pretty_json;
use super::{left_out, real, terminal_safe, MAX_COLUMN};
use crate::stats::{each_with_stats, Scalar, TensorStats};
use crate::{FilterSummary, Real};

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
                // NaN is below nothing, so the minimum passes over it: count it aloud instead.
                let nan: Vec<usize> = (0..m.len()).filter(|&i| m[i].is_nan()).collect();
                let nan_note = match nan.first() {
                    None => String::new(),
                    Some(r) => format!("; {} NaN (first row {r})", nan.len()),
                };
                if m.is_empty() {
                    "-".into()
                } else if nan.len() == m.len() {
                    format!("NaN in every row ({})", m.len())
                } else {
                    format!("{} (row {row}){nan_note}", real(Some(Real(v as f64))))
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
/// "--show"), streamed like [`write_json`](super::write_json), with the same escaping.
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
