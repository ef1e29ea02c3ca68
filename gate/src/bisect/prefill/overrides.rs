//! A forced candidate's own overrides (docs/producers.md, "Recorded."; docs/bisect.md, "Decisions
//! that differ" and "Block diffusion"): which rows of each forced decision it would itself have
//! decided otherwise, read from its forced trace's provenance and checked, and each argmax or
//! router row among them judged by that row's own margin.
//!
//! The record is `forced_decisions.overridden` (`{decision: rows}`, counts) and
//! `forced_decisions.overridden_rows` (`{decision: [row, …]}`). One missing, or the two
//! disagreeing, leaves the overrides NOT CHECKED — never read as none.
//!
//! An overridden row of a decision taken from numbers (an argmax, a router's top-k) is explained
//! by that row's own numbers when its recorded margin for the forced choice — agreeing with its
//! own scores where its trace holds them — is ≤ 0 (its scores rank another choice at or above
//! the reference's), or, for a top-k with a margin > 0 (the same experts, in another order), when
//! its scores rank the forced order as theirs with an exact tie in it (two experts whose scores
//! are equal: whoever ranked them broke the tie). Anything else is a rule that is not argmax.

use std::collections::BTreeMap;

use serde::Serialize;
use serde_json::Value;
use tracegate_diff::{own_scores, passes, FindingKind, Report};
use tracegate_trace::names::Name;
use tracegate_trace::Trace;

/// Per decision, the rows the candidate would have decided otherwise (ascending, none empty).
pub type OverriddenRows = BTreeMap<String, Vec<u64>>;

/// An argmax or router decision whose overridden rows its own numbers do not explain.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Unexplained {
    pub decision: String,
    /// The rows not explained, ascending.
    pub rows: Vec<u64>,
    /// Why not, for the first of them.
    pub why: String,
}

/// The forced candidate's overrides judged row by row.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Judged {
    pub unexplained: Vec<Unexplained>,
    /// Rows explained as exact ties (a top-k in another order among equal scores), per decision.
    pub ties: BTreeMap<String, u64>,
    /// Why some could not be judged (each names the decision and row).
    pub not_checked: Vec<String>,
}

/// A decision taken from numbers alone: a router's top-k, an argmax (`logits.argmax`, a decode
/// step's, a denoise step's) — not a draw or a sampler rule over thresholds.
pub fn from_numbers(name: &str) -> bool {
    let n = Name::parse(name);
    n.point == "router.topk"
        || n.point == "logits.argmax"
        || n.point == "argmax" && (n.decode_step.is_some() || n.diffusion.is_some())
}

/// A draw of a block-diffusion sampler: the generator's, with no choice of the model's own.
pub fn is_draw(name: &str) -> bool {
    passes::place(name)
        .and_then(|p| p.sampler)
        .is_some_and(passes::Sampler::is_draw)
}

/// The forced trace `t`'s override record, checked: both `overridden` and `overridden_rows`
/// present, naming the same decisions of `t` with as many rows as counted, each a row of the
/// decision and none twice, and `rows_overridden` their total. Err: why not, in a line.
pub fn record(t: &Trace) -> Result<OverriddenRows, String> {
    let f = &t.provenance()["forced_decisions"];
    let at = "the forced trace's provenance forced_decisions";
    let counts = f.get("overridden").and_then(Value::as_object).ok_or_else(|| {
        format!("{at} records no overridden (its count per decision): what the candidate would have decided otherwise is unknown, not none")
    })?;
    let lists = f.get("overridden_rows").and_then(Value::as_object).ok_or_else(|| {
        format!("{at} records no overridden_rows (the rows per decision): which rows the candidate would have decided otherwise is unknown, so its own numbers cannot explain them")
    })?;
    let mut out = OverriddenRows::new();
    let mut total = 0u64;
    for name in counts.keys().chain(lists.keys()) {
        if out.contains_key(name) {
            continue;
        }
        let count = match counts.get(name) {
            None => None,
            Some(v) => Some(
                v.as_u64()
                    .ok_or_else(|| format!("{at}.overridden.{name} is {v}, not a row count"))?,
            ),
        };
        let rows: Option<Vec<u64>> = match lists.get(name) {
            None => None,
            Some(v) => Some(
                v.as_array()
                    .and_then(|a| a.iter().map(Value::as_u64).collect())
                    .ok_or_else(|| {
                        format!("{at}.overridden_rows.{name} is {v}, not a list of rows")
                    })?,
            ),
        };
        let n = rows.as_ref().map_or(0, |r| r.len() as u64);
        if count.unwrap_or(0) != n {
            return Err(format!(
                "{at}.overridden counts {} rows of {name}, overridden_rows lists {n}: the record contradicts itself",
                count.unwrap_or(0)
            ));
        }
        let Some(mut rows) = rows.filter(|r| !r.is_empty()) else {
            continue;
        };
        let info = t.decision_info(name).ok_or_else(|| {
            format!("{at}.overridden_rows names {name}, a decision the forced trace does not hold")
        })?;
        rows.sort_unstable();
        if let Some(r) = rows.iter().find(|&&r| r >= info.rows()) {
            return Err(format!(
                "{at}.overridden_rows.{name} lists row {r}; the decision has {} rows",
                info.rows()
            ));
        }
        if let Some(w) = rows.windows(2).find(|w| w[0] == w[1]) {
            return Err(format!(
                "{at}.overridden_rows.{name} lists row {} twice",
                w[0]
            ));
        }
        total += n;
        out.insert(name.clone(), rows);
    }
    match f.get("rows_overridden").map(|v| v.as_u64()) {
        Some(Some(n)) if n == total => Ok(out),
        got => Err(format!(
            "{at}.rows_overridden is {}, not the {total} rows of overridden_rows",
            got.flatten()
                .map_or_else(|| "missing or not a count".to_string(), |n| n.to_string())
        )),
    }
}

/// What one overridden row's own numbers say.
enum Row {
    /// Its scores rank another choice at or above the reference's (margin ≤ 0).
    Flip,
    /// The same choices in another order, among equal scores.
    Tie,
    Unexplained(String),
    NotChecked(String),
}

/// Row `row` of decision `name` in the forced trace `t`, which the candidate overrode.
fn judge_row(t: &Trace, name: &str, row: u64) -> Row {
    let Some(info) = t.decision_info(name) else {
        return Row::NotChecked(format!("{name} is not a decision of the forced trace"));
    };
    let width = info.count().checked_div(info.rows()).unwrap_or(0) as usize;
    let values = t.decision_values(info);
    let chosen = &values[row as usize * width..(row as usize + 1) * width];
    let Some(m) = t
        .decision_margins(info)
        .and_then(|ms| ms.get(row as usize).copied())
    else {
        return Row::Unexplained(
            "no margin recorded, so nothing says its own scores rank another choice".to_string(),
        );
    };
    let own = own_scores(t, name, row);
    if let Some(Err(want)) = own.as_ref().and_then(|s| s.margin_agrees(chosen, m)) {
        return Row::Unexplained(format!(
            "its recorded margin {m:e} contradicts its own {} ({want:e} for the reference's choice)",
            own.as_ref().map_or("", |s| s.source())
        ));
    }
    if m.is_nan() {
        return Row::Unexplained("its margin is NaN".to_string());
    }
    if m <= 0.0 {
        return Row::Flip;
    }
    if width < 2 {
        return Row::Unexplained(format!(
            "its margin {m:e} > 0 — its own scores put the reference's choice on top, and it chose otherwise"
        ));
    }
    let Some(s) = own else {
        return Row::NotChecked(format!(
            "{name} row {row}: its margin {m:e} > 0 makes the reference's experts its own scores' top-k, so it ordered them otherwise — at an exact tie, or by a rule that is not top-k — and the forced trace holds no router.logits to tell which (--capture internals)"
        ));
    };
    if let Err(e) = s.picks(chosen) {
        return Row::Unexplained(format!(
            "the reference's experts {chosen:?} in another order (margin {m:e} > 0), and its own {} do not rank them so: it {e}; not a tie",
            s.source()
        ));
    }
    if chosen.windows(2).any(|w| s.tied(w[0], w[1])) {
        return Row::Tie;
    }
    Row::Unexplained(format!(
        "its own {} rank the reference's experts {chosen:?} as their top-k in that order, with no tie among them (margin {m:e} > 0): the choice it would have taken is not its scores'",
        s.source()
    ))
}

/// The forced trace `t`'s overrides `rows` of the decisions `selects` keeps that are taken from
/// numbers, judged row by row; `rep`: the forced comparison with the reference, whose
/// `margin_differs` findings leave a decision's overrides unexplained (its margins are outside
/// what the judged scores allow). A row whose margin is < 0 the record does not list is an
/// override the record misses: NOT CHECKED.
pub fn judge(
    t: &Trace,
    rep: &Report,
    rows: &OverriddenRows,
    selects: &dyn Fn(&str) -> bool,
) -> Judged {
    let mut out = Judged::default();
    let forced: Vec<&str> = t.provenance()["forced_decisions"]["decisions"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(Value::as_str)
        .collect();
    for info in t.decisions() {
        let name = info.name.as_str();
        if !(from_numbers(name) && selects(name) && forced.contains(&name)) {
            continue;
        }
        let listed = rows.get(name).map_or(&[][..], |r| r.as_slice());
        let missed = t.decision_margins(info).and_then(|ms| {
            ms.iter()
                .enumerate()
                .find(|(r, m)| **m < 0.0 && !listed.contains(&(*r as u64)))
                .map(|(r, &m)| (r, m))
        });
        if let Some((r, m)) = missed {
            out.not_checked.push(format!(
                "{name} row {r}: its margin {m:e} < 0 says the candidate would have decided otherwise, and the override record does not list it: the record is not its run's"
            ));
        }
        if listed.is_empty() {
            continue;
        }
        if let Some(f) = rep
            .findings
            .iter()
            .find(|f| f.kind == FindingKind::MarginDiffers && f.tensor() == Some(name))
        {
            out.unexplained.push(Unexplained {
                decision: name.to_string(),
                rows: listed.to_vec(),
                why: format!(
                    "its margins differ from the reference's beyond the policy: {}",
                    f.detail
                ),
            });
            continue;
        }
        let mut bad: Option<Unexplained> = None;
        for &r in listed {
            match judge_row(t, name, r) {
                Row::Flip => {}
                Row::Tie => *out.ties.entry(name.to_string()).or_insert(0) += 1,
                Row::NotChecked(why) => out.not_checked.push(why),
                Row::Unexplained(why) => match &mut bad {
                    Some(u) => u.rows.push(r),
                    None => {
                        bad = Some(Unexplained {
                            decision: name.to_string(),
                            rows: vec![r],
                            why,
                        })
                    }
                },
            }
        }
        out.unexplained.extend(bad);
    }
    out
}

/// "row R" or "rows R, S, …" (the first eight).
pub fn rows_words(rows: &[u64]) -> String {
    let shown: Vec<String> = rows.iter().take(8).map(|r| r.to_string()).collect();
    format!(
        "row{} {}{}",
        if rows.len() == 1 { "" } else { "s" },
        shown.join(", "),
        if rows.len() > 8 { ", …" } else { "" }
    )
}

/// One unexplained decision's rows and why, without its name: "row R: WHY", or "rows R, S
/// (row R: WHY)".
pub fn why_words(u: &Unexplained) -> String {
    match u.rows.as_slice() {
        [r] => format!("row {r}: {}", u.why),
        [r, ..] => format!("{} (row {r}: {})", rows_words(&u.rows), u.why),
        [] => u.why.clone(),
    }
}

/// The unexplained overrides in words: "NAME row R: WHY", the first `shown`.
pub fn unexplained_words(u: &[Unexplained], shown: usize) -> String {
    let mut items: Vec<String> = u
        .iter()
        .take(shown)
        .map(|x| format!("{} {}", x.decision, why_words(x)))
        .collect();
    if u.len() > shown {
        items.push(format!("… ({} decisions)", u.len()));
    }
    items.join("; ")
}

#[cfg(test)]
mod tests;
