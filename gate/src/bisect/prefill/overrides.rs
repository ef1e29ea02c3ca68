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
//! by that row's own numbers when the choice its own scores make is one the near-tie rule
//! excuses: the reference's own scores put it within `F·h` of the reference's choice, `h` the
//! row's honest noise (the noise reference's, else the policy's `near_tie.noise_abs`; never the
//! candidate's own difference: docs/diff.md, "The near-tie rule"). Its recorded margin for the
//! forced choice (agreeing with its own scores where its trace holds them) says which case: ≤ 0,
//! its scores make another choice, measured so, and NOT CHECKED where no scores say which; > 0
//! on a top-k (the same experts, in another order), its scores ranking the forced order as
//! theirs with an exact tie in it (two experts whose scores are equal: it broke the tie the
//! other way — a tie where the reference's scores tie them too, else that order measured so),
//! or another order, measured so. Anything else is a rule that is not argmax.

use std::collections::BTreeMap;

use serde::Serialize;
use serde_json::Value;
use tracegate_diff::{
    override_gap, own_scores, passes, FindingKind, Options, OverrideGap, Real, Report,
};
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

tracegate_diff::string_enum! {
    /// What an overridden row's own numbers say.
    pub enum Outcome {
        /// The reference's experts in another order, or another choice, among scores that tie
        /// exactly in the reference's own scores too.
        Tie = "tie",
        /// The choice its own scores make (another choice, margin ≤ 0, or the reference's
        /// experts in their order), which the near-tie rule excuses (gap ≤ F·h in the
        /// reference's scores).
        NearTie = "near_tie",
        /// Not explained by its own numbers.
        Unexplained = "unexplained",
        /// Could not be told.
        NotChecked = "not_checked",
    }
}

/// One overridden row of a decision taken from numbers, as judged: its own recorded margin for
/// the reference's choice and, where its own scores order the reference's experts otherwise,
/// that order and the near-tie rule's measures.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct JudgedRow {
    pub decision: String,
    pub row: u64,
    /// Its recorded margin for the reference's choice; null when it records none.
    pub margin: Option<Real>,
    pub outcome: Outcome,
    /// The choice its own scores make, where that is another choice (margin ≤ 0) or the
    /// reference's experts in another order.
    pub own: Option<Vec<i64>>,
    /// The near-tie rule's measures of that choice (docs/diff.md, "The near-tie rule"), when
    /// they could be read: the gap in the reference's scores, the row's honest noise, where it
    /// came from, and the bound F·h.
    pub gap: Option<Real>,
    pub honest_noise: Option<Real>,
    pub honest_noise_from: Option<String>,
    pub noise_bound: Option<Real>,
}

impl JudgedRow {
    /// Row `row` of `decision`, nothing read yet.
    fn new(decision: &str, row: u64) -> JudgedRow {
        JudgedRow {
            decision: decision.to_string(),
            row,
            margin: None,
            outcome: Outcome::NotChecked,
            own: None,
            gap: None,
            honest_noise: None,
            honest_noise_from: None,
            noise_bound: None,
        }
    }
}

/// The forced candidate's overrides judged row by row.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Judged {
    pub unexplained: Vec<Unexplained>,
    /// Rows explained as exact ties (a top-k in another order among equal scores), per decision.
    pub ties: BTreeMap<String, u64>,
    /// Rows explained as near-ties (a top-k in its own scores' order, within the honest-noise
    /// bound of the reference's), per decision.
    pub near_ties: BTreeMap<String, u64>,
    /// Every overridden row judged, in decision and row order.
    pub rows: Vec<JudgedRow>,
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
    /// The same choices in another order, among scores equal in the reference's too.
    Tie,
    /// Its own scores' choice (another, or the same in another order), within the near-tie
    /// rule's bound.
    NearTie,
    Unexplained(String),
    NotChecked(String),
}

/// The reference and the judge of a near-tie: the reference's trace, the policy and the noise
/// reference (`Options::policy`, `Options::noise`).
pub struct Against<'a> {
    pub reference: &'a Trace,
    pub opts: &'a Options,
}

/// Row `row` of decision `name` in the forced trace `t`, which the candidate overrode; `out`
/// gets its own order of the reference's experts and the near-tie rule's measures, where read.
fn judge_row(t: &Trace, name: &str, row: u64, against: &Against, out: &mut JudgedRow) -> Row {
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
    out.margin = Some(Real(m as f64));
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
        return flip(t, name, row, chosen, m, own.as_ref(), against, out);
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
        // Its own scores order the reference's experts otherwise: a near-tie only where the
        // reference's own scores put that order within the honest-noise bound of theirs.
        let order = s.order(chosen);
        let not_so = format!(
            "the reference's experts {chosen:?} in another order (margin {m:e} > 0), and its own {} do not rank them so: it {e}; not a tie",
            s.source()
        );
        return near_tie(t, name, row, &order, against, out, &not_so);
    }
    if chosen.windows(2).any(|w| s.tied(w[0], w[1])) {
        return tie(t, name, row, chosen, m, &s, against, out);
    }
    Row::Unexplained(format!(
        "its own {} rank the reference's experts {chosen:?} as their top-k in that order, with no tie among them (margin {m:e} > 0): the choice it would have taken is not its scores'",
        s.source()
    ))
}

/// Its own scores' choice by the tie rule; where that is the reference's `chosen` (an exact tie
/// at the edge, margin 0), the other way the tie breaks.
fn own_choice(s: &tracegate_diff::OwnScores, chosen: &[i64]) -> Vec<i64> {
    let choice = s.choice(chosen.len(), true);
    if choice == chosen {
        s.choice(chosen.len(), false)
    } else {
        choice
    }
}

/// A row whose recorded margin for the reference's choice is ≤ 0 (agreeing with its own scores
/// where the trace holds them): its own scores make another choice. That is the candidate's
/// word, not an excuse: the choice its own scores make is held to the near-tie rule like any
/// reorder — the reference's scores must put it within `F·h` of the reference's choice, `h`
/// honest noise, never the candidate's own difference (docs/diff.md, "The near-tie rule"; a
/// candidate that moves two logits within the policy's relative L2 can put any token on top
/// of its own scores). Without its own scores, or the reference's, nothing measures the gap:
/// NOT CHECKED, never excused.
#[allow(clippy::too_many_arguments)]
fn flip(
    t: &Trace,
    name: &str,
    row: u64,
    chosen: &[i64],
    m: f32,
    own: Option<&tracegate_diff::OwnScores>,
    against: &Against,
    out: &mut JudgedRow,
) -> Row {
    let Some(s) = own else {
        return Row::NotChecked(format!(
            "{name} row {row}: its margin {m:e} ≤ 0 says its own scores make another choice, and the forced trace holds none of the decision's scores (logits; router.logits: --capture internals) to say which, so the gap that choice crossed in the reference's scores cannot be measured"
        ));
    };
    let Some(theirs) = own_scores(against.reference, name, row) else {
        return Row::NotChecked(format!(
            "{name} row {row}: its margin {m:e} ≤ 0 says its own {} make another choice, and the reference holds no {} to measure the gap that choice crossed in its scores",
            s.source(),
            s.source()
        ));
    };
    let choice = own_choice(s, chosen);
    if choice == chosen {
        return Row::Unexplained(format!(
            "its margin {m:e} ≤ 0, yet its own {} make the reference's choice {chosen:?} whichever way their ties break: nothing says which choice it would have taken",
            s.source()
        ));
    }
    // The reference's own scores make both choices (they tie where the two differ, up to what
    // the stored scores cannot resolve): either is theirs, whoever broke the tie (a gap of 0).
    if theirs.picks(chosen).is_ok() && theirs.picks(&choice).is_ok() {
        out.own = Some(choice);
        return Row::Tie;
    }
    let said = format!(
        "its own {} make {choice:?} where the reference chose {chosen:?} (margin {m:e} ≤ 0)",
        s.source()
    );
    near_tie(t, name, row, &choice, against, out, &said)
}

/// A row whose own scores rank the reference's experts `chosen` as their top-k in that order
/// with an exact tie among them (margin > 0): the candidate broke the tie the other way. An
/// exact tie in the *reference's* scores is a tie (issue 50: either order is theirs); one only
/// in the candidate's is its claim, which it can make by moving its router logits within the
/// policy: held to the near-tie rule like a flip — the reference's scores must put the other
/// order within `F·h` of theirs. Without the reference's scores, NOT CHECKED.
#[allow(clippy::too_many_arguments)]
fn tie(
    t: &Trace,
    name: &str,
    row: u64,
    chosen: &[i64],
    m: f32,
    s: &tracegate_diff::OwnScores,
    against: &Against,
    out: &mut JudgedRow,
) -> Row {
    // The order its tie breaks the other way.
    let other = own_choice(s, chosen);
    out.own = Some(other.clone());
    let Some(theirs) = own_scores(against.reference, name, row) else {
        return Row::NotChecked(format!(
            "{name} row {row}: its own {} tie experts of the reference's choice {chosen:?} (margin {m:e} > 0), and the reference holds no {} to say whether they tie there too",
            s.source(),
            s.source()
        ));
    };
    if theirs.picks(chosen).is_ok() && theirs.picks(&other).is_ok() {
        return Row::Tie;
    }
    let said = format!(
        "its own {} tie experts of the reference's choice {chosen:?} (margin {m:e} > 0), so it would have taken {other:?}; the reference's scores do not tie them",
        s.source()
    );
    near_tie(t, name, row, &other, against, out, &said)
}

/// The near-tie rule on the forced candidate's own choice `own` for `row` (another choice, or
/// the reference's experts in another order): a near-tie when the reference's scores put it
/// within `F·h` of the reference's choice; else unexplained, `said` what its own scores did,
/// with the gap, the bound and `h` in the words.
fn near_tie(
    t: &Trace,
    name: &str,
    row: u64,
    own: &[i64],
    against: &Against,
    out: &mut JudgedRow,
    said: &str,
) -> Row {
    let measured = override_gap(
        against.reference,
        t,
        name,
        row,
        own,
        against.opts.policy.as_ref(),
        against.opts.noise.as_ref().map(|n| &*n.0),
    );
    out.own = Some(own.to_vec());
    match measured {
        Ok(g) => {
            record_gap(&g, out);
            if g.within() {
                Row::NearTie
            } else {
                Row::Unexplained(format!(
                    "{said}, nor a near-tie: the reference's {} put its own {} {own:?} {:e} from theirs, above the honest-noise bound {:e} (F·h, h {:e} from the {})",
                    g.source,
                    if Name::parse(name).point == "router.topk" { "order" } else { "choice" },
                    g.gap,
                    g.noise_bound,
                    g.honest_noise,
                    g.honest_noise_from.replace('_', " ")
                ))
            }
        }
        Err(why) => Row::Unexplained(format!("{said}, nor a near-tie: {why}")),
    }
}

/// The near-tie rule's measures of a row, into its judged row.
fn record_gap(g: &OverrideGap, out: &mut JudgedRow) {
    out.gap = Some(Real(g.gap));
    out.honest_noise = Some(Real(g.honest_noise));
    out.honest_noise_from = Some(g.honest_noise_from.to_string());
    out.noise_bound = Some(Real(g.noise_bound));
}

/// The forced trace `t`'s overrides `rows` of the decisions the comparison's filter keeps that
/// are taken from numbers, judged row by row against the reference (`against`: its scores
/// measure a reorder's gap, the options' policy and noise reference its bound); `rep`: the
/// forced comparison with the reference, whose `margin_differs` findings leave a decision's
/// overrides unexplained (its margins are outside what the judged scores allow). A row whose
/// margin is < 0 the record does not list is an override the record misses: NOT CHECKED.
pub fn judge(t: &Trace, rep: &Report, rows: &OverriddenRows, against: &Against) -> Judged {
    let selects = |n: &str| against.opts.selects(n);
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
            let margins = t.decision_margins(info);
            out.rows.extend(listed.iter().map(|&r| {
                JudgedRow {
                    margin: margins
                        .as_ref()
                        .and_then(|ms| ms.get(r as usize))
                        .map(|&m| Real(m as f64)),
                    outcome: Outcome::Unexplained,
                    ..JudgedRow::new(name, r)
                }
            }));
            continue;
        }
        let mut bad: Option<Unexplained> = None;
        for &r in listed {
            let mut row = JudgedRow::new(name, r);
            let judged = judge_row(t, name, r, against, &mut row);
            row.outcome = match &judged {
                Row::Tie => Outcome::Tie,
                Row::NearTie => Outcome::NearTie,
                Row::Unexplained(_) => Outcome::Unexplained,
                Row::NotChecked(_) => Outcome::NotChecked,
            };
            out.rows.push(row);
            match judged {
                Row::Tie => *out.ties.entry(name.to_string()).or_insert(0) += 1,
                Row::NearTie => *out.near_ties.entry(name.to_string()).or_insert(0) += 1,
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
