//! The override record and the row rule, on traces written as an adversary would (TraceWriter):
//! a record left out or contradicting itself is not read as none; each overridden row is judged
//! by its own margin, not by a count of rows with a margin ≤ 0 anywhere; an exact tie broken the
//! other way inside a top-k is a tie.

use serde_json::{json, Value};
use tracegate_diff::{compare, Options};
use tracegate_trace::{Attributes, Trace, TraceWriter};

use super::*;

/// A forced trace of `logits` [rows, 4] and `logits.argmax` (values, margins), and a router's
/// `router.logits` [rows, 4] and `router.topk` [rows, 2], with `forced` as
/// `forced_decisions` (its `decisions` added).
struct Forced<'a> {
    logits: &'a [[f32; 4]],
    argmax: (&'a [i64], &'a [f32]),
    router_logits: &'a [[f32; 4]],
    topk: &'a [[i64; 2]],
}

/// The f32 margin a producer records for `chosen` among `probs` (weakest chosen − strongest
/// unchosen, in f64 here, rounded once).
fn margin(v: &[f64], chosen: &[i64]) -> f32 {
    let weakest = chosen
        .iter()
        .map(|&c| v[c as usize])
        .fold(f64::INFINITY, f64::min);
    let strongest = (0..v.len() as i64)
        .filter(|i| !chosen.contains(i))
        .map(|i| v[i as usize])
        .fold(f64::NEG_INFINITY, f64::max);
    (weakest - strongest) as f32
}

fn softmax(z: &[f32; 4]) -> Vec<f64> {
    let max = z.iter().fold(f32::NEG_INFINITY, |m, &x| m.max(x)) as f64;
    let e: Vec<f64> = z.iter().map(|&x| (x as f64 - max).exp()).collect();
    let sum: f64 = e.iter().sum();
    e.iter().map(|x| x / sum).collect()
}

fn write(dir: &std::path::Path, x: &Forced, forced: Value) -> Trace {
    write_as(&dir.join("forced.trace"), x, forced)
}

fn write_as(path: &std::path::Path, x: &Forced, forced: Value) -> Trace {
    let mut f = forced;
    f["decisions"] = json!(["layer.00.router.topk", "logits.argmax"]);
    f["trace_digest"] = json!("00");
    let mut w = TraceWriter::create(path, json!({ "forced_decisions": f })).unwrap();
    let a = Attributes::default();
    let flat = |rows: &[[f32; 4]]| rows.iter().flatten().copied().collect::<Vec<f32>>();
    let n = x.router_logits.len() as u64;
    w.tensor_f32(
        "layer.00.router.logits",
        &[n, 4],
        &flat(x.router_logits),
        &a,
    )
    .unwrap();
    let margins: Vec<f32> = x
        .router_logits
        .iter()
        .zip(x.topk)
        .map(|(z, c)| margin(&softmax(z), c))
        .collect();
    let topk: Vec<i64> = x.topk.iter().flatten().copied().collect();
    w.decision("layer.00.router.topk", &[n, 2], &topk, Some(&margins))
        .unwrap();
    let m = x.logits.len() as u64;
    w.tensor_f32("logits", &[m, 4], &flat(x.logits), &a)
        .unwrap();
    w.decision("logits.argmax", &[m], x.argmax.0, Some(x.argmax.1))
        .unwrap();
    w.finish().unwrap();
    Trace::open(path).unwrap()
}

/// The argmax's own margin for each forced token, as an honest producer records it.
fn honest(logits: &[[f32; 4]], tokens: &[i64]) -> Vec<f32> {
    logits
        .iter()
        .zip(tokens)
        .map(|(z, &t)| margin(&z.map(f64::from), &[t]))
        .collect()
}

const LOGITS: [[f32; 4]; 3] = [
    [2.0, 1.0, 0.0, -1.0],
    [1.0, 0.5, 0.0, -1.0],
    [0.0, 3.0, 1.0, -1.0],
];
const ROUTER: [[f32; 4]; 1] = [[1.0, 0.5, 0.0, -1.0]];

fn judged(t: &Trace) -> Judged {
    let rows = record(t).unwrap();
    let opts = Options::default();
    let rep = compare(t, t, &opts);
    let j = judge(
        t,
        &rep,
        &rows,
        &Against {
            reference: t,
            opts: &opts,
        },
    );
    // Every listed row is judged once, in order; the per-row outcomes agree with the totals.
    let listed: Vec<(String, u64)> = rows
        .iter()
        .flat_map(|(n, rs)| rs.iter().map(move |&r| (n.clone(), r)))
        .collect();
    let got: Vec<(String, u64)> = j.rows.iter().map(|r| (r.decision.clone(), r.row)).collect();
    assert_eq!(got, listed);
    let ties = j.rows.iter().filter(|r| r.outcome == Outcome::Tie).count() as u64;
    assert_eq!(ties, j.ties.values().sum::<u64>());
    j
}

#[test]
fn a_record_left_out_or_contradicting_itself_is_never_read_as_none() {
    let dir = tempfile::tempdir().unwrap();
    let tokens = [0, 0, 1];
    let margins = honest(&LOGITS, &tokens);
    let x = Forced {
        logits: &LOGITS,
        argmax: (&tokens, &margins),
        router_logits: &ROUTER,
        topk: &[[0, 1]],
    };
    let refused = |forced: Value| record(&write(dir.path(), &x, forced)).unwrap_err();
    // A forced port that records nothing of what it overrode.
    let why = refused(json!({}));
    assert!(why.contains("records no overridden"), "{why}");
    // Counts without the rows they count.
    let why = refused(json!({"rows_overridden": 1, "overridden": {"logits.argmax": 1}}));
    assert!(why.contains("records no overridden_rows"), "{why}");
    for (forced, said) in [
        (
            json!({"rows_overridden": 2, "overridden": {"logits.argmax": 2}, "overridden_rows": {"logits.argmax": [1]}}),
            "overridden counts 2 rows of logits.argmax, overridden_rows lists 1",
        ),
        (
            json!({"rows_overridden": 1, "overridden": {}, "overridden_rows": {"logits.argmax": [1]}}),
            "overridden counts 0 rows of logits.argmax, overridden_rows lists 1",
        ),
        (
            json!({"rows_overridden": 1, "overridden": {"logits.argmax": 1}, "overridden_rows": {"logits.argmax": [3]}}),
            "lists row 3; the decision has 3 rows",
        ),
        (
            json!({"rows_overridden": 2, "overridden": {"logits.argmax": 2}, "overridden_rows": {"logits.argmax": [1, 1]}}),
            "lists row 1 twice",
        ),
        (
            json!({"rows_overridden": 1, "overridden": {"decode.0000.argmax": 1}, "overridden_rows": {"decode.0000.argmax": [0]}}),
            "names decode.0000.argmax, a decision the forced trace does not hold",
        ),
        (
            json!({"rows_overridden": 0, "overridden": {"logits.argmax": 1}, "overridden_rows": {"logits.argmax": [1]}}),
            "rows_overridden is 0, not the 1 rows",
        ),
        (
            json!({"overridden": {}, "overridden_rows": {}}),
            "rows_overridden is missing or not a count",
        ),
    ] {
        let why = refused(forced);
        assert!(why.contains(said), "{why}");
    }
    let t = write(
        dir.path(),
        &x,
        json!({"rows_overridden": 0, "overridden": {}, "overridden_rows": {}}),
    );
    assert_eq!(record(&t).unwrap(), OverriddenRows::new());
}

#[test]
fn each_overridden_row_is_judged_by_its_own_margin_not_by_a_count() {
    let dir = tempfile::tempdir().unwrap();
    // The reference's tokens are the scores' own everywhere; the candidate says it overrode
    // row 0 (its rule took the second-best there) and manufactures a margin ≤ 0 in row 2, which
    // it did not override: one row overridden, one margin ≤ 0 — a count would call it explained.
    let tokens = [0, 0, 1];
    let mut margins = honest(&LOGITS, &tokens);
    margins[2] = -0.0;
    let x = Forced {
        logits: &LOGITS,
        argmax: (&tokens, &margins),
        router_logits: &ROUTER,
        topk: &[[0, 1]],
    };
    let forced = json!({"rows_overridden": 1, "overridden": {"logits.argmax": 1}, "overridden_rows": {"logits.argmax": [0]}});
    let j = judged(&write(dir.path(), &x, forced));
    assert_eq!(j.unexplained.len(), 1, "{j:?}");
    let u = &j.unexplained[0];
    assert_eq!(
        (u.decision.as_str(), u.rows.as_slice()),
        ("logits.argmax", &[0u64][..])
    );
    assert!(
        u.why.contains("its margin 1e0 > 0") && u.why.contains("put the reference's choice on top"),
        "{}",
        u.why
    );
    assert_eq!(
        unexplained_words(&j.unexplained, 3),
        format!("logits.argmax row 0: {}", u.why)
    );
    // Row 1 overridden (its scores rank token 0 above the reference's 2, margin < 0): judged by
    // the near-tie rule, which here (judged by bits, and this reference's own logits do not
    // make its choice) explains nothing — a margin ≤ 0 is never an excuse by itself.
    let tokens = [0, 2, 1];
    let margins = honest(&LOGITS, &tokens);
    assert!(margins[1] < 0.0);
    let x = Forced {
        argmax: (&tokens, &margins),
        ..x
    };
    let forced = json!({"rows_overridden": 1, "overridden": {"logits.argmax": 1}, "overridden_rows": {"logits.argmax": [1]}});
    let j = judged(&write(dir.path(), &x, forced));
    assert!(j.not_checked.is_empty() && j.ties.is_empty(), "{j:?}");
    assert_eq!(
        (j.rows[0].row, j.rows[0].outcome, j.rows[0].margin),
        (1, Outcome::Unexplained, Some(Real(margins[1] as f64)))
    );
    assert_eq!(j.rows[0].own.as_deref(), Some(&[0i64][..]));
    assert!(
        j.unexplained[0].why.starts_with(
            "its own logits make [0] where the reference chose [2] (margin -1e0 ≤ 0), nor a near-tie: judged by bits"
        ),
        "{j:?}"
    );
    // The same run recording row 0 instead: row 0's margin is the scores' own top, so it is not
    // explained; and row 1, whose margin < 0 says it was overridden, is missing from the record.
    let forced = json!({"rows_overridden": 1, "overridden": {"logits.argmax": 1}, "overridden_rows": {"logits.argmax": [0]}});
    let j = judged(&write(dir.path(), &x, forced));
    assert_eq!(j.unexplained[0].rows, [0]);
    assert!(
        j.not_checked.len() == 1
            && j.not_checked[0].starts_with("logits.argmax row 1: its margin -1e0 < 0"),
        "{j:?}"
    );
    // A margin that its own scores contradict explains nothing, whatever its sign.
    let mut margins = honest(&LOGITS, &tokens);
    margins[1] = -0.25;
    let x = Forced {
        argmax: (&tokens, &margins),
        ..x
    };
    let forced = json!({"rows_overridden": 1, "overridden": {"logits.argmax": 1}, "overridden_rows": {"logits.argmax": [1]}});
    let j = judged(&write(dir.path(), &x, forced));
    assert!(
        j.unexplained[0]
            .why
            .starts_with("its recorded margin -2.5e-1 contradicts its own logits (-1e0"),
        "{j:?}"
    );
}

#[test]
fn an_exact_tie_ordered_otherwise_inside_a_top_k_is_a_tie_and_only_that() {
    let dir = tempfile::tempdir().unwrap();
    let tokens = [0, 0, 1];
    let margins = honest(&LOGITS, &tokens);
    // The reference is the forced trace itself here: a tie in its scores is the reference's.
    // Row 0: experts 0 and 1 score exactly alike; the candidate's tie rule (lowest index first)
    // chose [0, 1], the reference's [1, 0]: the same experts, margin > 0, a tie.
    // Row 1: [1, 0] where its scores rank 0 above 1: another order, not a tie.
    // Row 2: at the edge, experts 1 and 2 tie: the reference took 2, margin 0.
    // Row 3: [0, 1] is exactly its own order: nothing of its own to override.
    let router = [
        [0.5, 0.5, 0.0, -1.0],
        [1.0, 0.5, 0.0, -1.0],
        [1.0, 0.5, 0.5, -1.0],
        [1.0, 0.5, 0.0, -1.0],
    ];
    let x = Forced {
        logits: &LOGITS,
        argmax: (&tokens, &margins),
        router_logits: &router,
        topk: &[[1, 0], [1, 0], [0, 2], [0, 1]],
    };
    let name = "layer.00.router.topk";
    let forced = |rows: &[u64]| json!({"rows_overridden": rows.len(), "overridden": {name: rows.len()}, "overridden_rows": {name: rows}});
    let j = judged(&write(dir.path(), &x, forced(&[0, 2])));
    // Row 2's margin 0 says its own scores make another choice: [0, 1] by the tie rule, which
    // the reference's scores make too (1 and 2 tie): a tie, not a flip excused by its word.
    assert_eq!(j.ties.get(name), Some(&2), "{j:?}");
    assert_eq!(j.rows[1].own.as_deref(), Some(&[0i64, 1][..]), "{j:?}");
    assert!(
        j.unexplained.is_empty() && j.not_checked.is_empty(),
        "{j:?}"
    );
    let j = judged(&write(dir.path(), &x, forced(&[0, 1, 3])));
    assert_eq!(j.ties.get(name), Some(&1), "{j:?}");
    assert_eq!(j.unexplained.len(), 1, "{j:?}");
    assert_eq!(j.unexplained[0].rows, [1, 3], "{j:?}");
    assert!(
        j.unexplained[0]
            .why
            .contains("do not rank them so: it ranks 1 (score 0.5) above 0 (score 1); not a tie"),
        "{j:?}"
    );
    let j = judged(&write(dir.path(), &x, forced(&[3])));
    assert!(
        j.unexplained[0].why.contains("with no tie among them"),
        "{j:?}"
    );
}

/// A policy whose honest noise for router logits is `noise_abs` (none: no `near_tie` entry for
/// them), near-tie factor 2.
fn policy(noise_abs: Option<f64>) -> tracegate_diff::Policy {
    policy_for("layer.*.router.logits", noise_abs)
}

/// A policy whose honest noise for `pattern` is `noise_abs`, near-tie factor 2, every tensor
/// within a relative L2 of 1 (the forced comparison does not stand in the rule's way).
fn policy_for(pattern: &str, noise_abs: Option<f64>) -> tracegate_diff::Policy {
    let entries = noise_abs.map_or(String::new(), |h| {
        format!(r#"{{"pattern": "{pattern}", "max_abs": {h}}}"#)
    });
    tracegate_diff::Policy::parse(&format!(
        r#"{{"format": "tracegate-policy/1", "name": "t", "rules": [{{"pattern": "**", "max_rel_l2": 1}}],
            "near_tie": {{"margin_factor": 2.0, "noise_abs": [{entries}]}}}}"#
    ))
    .unwrap()
}

/// The forced trace `t`'s overrides judged against `reference` under `opts`.
fn judged_against(reference: &Trace, t: &Trace, opts: &Options) -> Judged {
    let rep = compare(reference, t, opts);
    judge(t, &rep, &record(t).unwrap(), &Against { reference, opts })
}

/// The reference's router (rows of `router`, its top-2 `topk`) and a forced candidate that took
/// those top-2s, its own router logits `own`, saying it overrode `rows`: the overrides judged
/// under `opts`.
fn near_tie_judged(
    dir: &std::path::Path,
    router: &[[f32; 4]],
    topk: &[[i64; 2]],
    own: &[[f32; 4]],
    rows: &[u64],
    opts: &Options,
) -> Judged {
    let tokens = [0, 0, 1];
    let margins = honest(&LOGITS, &tokens);
    let base = Forced {
        logits: &LOGITS,
        argmax: (&tokens, &margins),
        router_logits: router,
        topk,
    };
    let own = Forced {
        router_logits: own,
        ..base
    };
    overrides_judged(
        dir,
        (&base, &own),
        ("layer.00.router.topk", rows),
        true,
        opts,
    )
}

/// The reference trace `reference` and a forced candidate `own` that says it overrode `rows` of
/// decision `name`; `scores`: whether its forced trace holds its scores. The overrides judged
/// under `opts`.
fn overrides_judged(
    dir: &std::path::Path,
    (reference, own): (&Forced, &Forced),
    (name, rows): (&str, &[u64]),
    scores: bool,
    opts: &Options,
) -> Judged {
    let r = write_as(&dir.join("reference.trace"), reference, json!({}));
    let forced = json!({"rows_overridden": rows.len(), "overridden": {name: rows.len()}, "overridden_rows": {name: rows}});
    let path = dir.join("forced.trace");
    let t = match scores {
        true => write_as(&path, own, forced),
        false => write_without_scores(&path, own, forced),
    };
    judged_against(&r, &t, opts)
}

/// Issue 50: a top-k the candidate's own scores order otherwise than the reference's is a
/// near-tie only by the near-tie rule (docs/diff.md): the reference's own scores put the
/// candidate's order within F·h of theirs, h the row's honest noise — the noise reference's
/// row, else the policy's `near_tie.noise_abs`, never the candidate's own difference. Each rule
/// that excuses is attacked: a gap above the bound (however large the candidate's own
/// difference), no bound, judged by bits, a NaN in the row, a reference whose scores do not
/// make its own choice, a noise reference that measures this row tighter than the policy.
#[test]
fn a_near_reorder_inside_a_top_k_is_a_near_tie_only_within_the_honest_bound() {
    let dir = tempfile::tempdir().unwrap();
    let name = "layer.00.router.topk";
    let under = |p: Option<f64>| Options {
        policy: Some(policy(p)),
        ..Options::default()
    };
    // The reference's router `reference` and the candidate's own `own`, expert 1 above 0.
    let near_tie_one = |reference: &[[f32; 4]], own: &[[f32; 4]], opts: &Options| {
        near_tie_judged(dir.path(), reference, &[[1, 0]], own, &[0], opts)
    };
    // The reference ranks expert 1 above 0 by 5e-5; the candidate's own logits swap them.
    let near = [[1.0, 1.00005, 0.0, -1.0]];
    let near_own = [[1.00005, 1.0, 0.0, -1.0]];
    let gap = (1.00005f32 - 1.0f32) as f64;
    let j = near_tie_one(&near, &near_own, &under(Some(1e-4)));
    assert!(
        j.unexplained.is_empty() && j.not_checked.is_empty(),
        "{j:?}"
    );
    assert_eq!(j.near_ties.get(name), Some(&1), "{j:?}");
    assert!(j.ties.is_empty(), "a near-tie is not an exact tie: {j:?}");
    let r = &j.rows[0];
    assert_eq!(
        (r.outcome, r.own.as_deref(), r.honest_noise_from.as_deref()),
        (Outcome::NearTie, Some(&[0i64, 1][..]), Some("policy"))
    );
    assert_eq!(r.gap, Some(Real(gap)));
    assert_eq!(r.honest_noise, Some(Real(1e-4)));
    assert_eq!(r.noise_bound, Some(Real(2e-4)));
    assert!(r.margin.is_some_and(|m| m.0 > 0.0), "{r:?}");

    let far = [[1.0, 1.5, 0.0, -1.0]];
    // An exact tie only in its own scores is its claim, not a tie (issue 50 item 6): against a
    // reference that ranks expert 1 above 0 by 0.5, a candidate whose own logits tie them (moved
    // within the policy) and that breaks the tie its way is held to the near-tie rule, and
    // fails it — it was once excused as a tie whatever the reference's gap.
    let tied_own = [[1.00005, 1.00005, 0.0, -1.0]];
    let j = near_tie_one(&far, &tied_own, &under(Some(1e-4)));
    assert!(j.ties.is_empty() && j.near_ties.is_empty(), "{j:?}");
    assert_eq!(
        (j.rows[0].outcome, j.rows[0].gap, j.rows[0].own.as_deref()),
        (Outcome::Unexplained, Some(Real(0.5)), Some(&[0i64, 1][..])),
        "{j:?}"
    );
    assert!(
        j.unexplained[0].why.contains(
            "its own layer.00.router.logits tie experts of the reference's choice [1, 0]"
        ) && j.unexplained[0]
            .why
            .contains("5e-1 from theirs, above the honest-noise bound 2e-4"),
        "{j:?}"
    );
    // The honest controls: the same tie against a reference 5e-5 apart (within F·h = 2e-4) is a
    // near-tie; where the reference's own scores tie them too (the engine and torch breaking a
    // bit-identical tie each its way), a tie, under a policy or by bits.
    let j = near_tie_one(&near, &tied_own, &under(Some(1e-4)));
    assert_eq!(
        (j.rows[0].outcome, j.rows[0].gap, j.near_ties.get(name)),
        (Outcome::NearTie, Some(Real(gap)), Some(&1)),
        "{j:?}"
    );
    for opts in [under(Some(1e-4)), Options::default()] {
        let j = near_tie_one(&tied_own, &tied_own, &opts);
        assert_eq!(
            (j.rows[0].outcome, j.ties.get(name)),
            (Outcome::Tie, Some(&1)),
            "{j:?}"
        );
    }
    // Without the reference's scores nothing says whether they tie there too: NOT CHECKED.
    let reference = {
        let path = dir.path().join("reference-no-scores.trace");
        let mut w = TraceWriter::create(&path, json!({})).unwrap();
        // Its margin is the candidate's: nothing else differs.
        let m = margin(&softmax(&tied_own[0]), &[1, 0]);
        w.decision(name, &[1, 2], &[1, 0], Some(&[m])).unwrap();
        w.finish().unwrap();
        Trace::open(&path).unwrap()
    };
    let t = write(
        dir.path(),
        &Forced {
            logits: &LOGITS,
            argmax: (&[0, 0, 1], &honest(&LOGITS, &[0, 0, 1])),
            router_logits: &tied_own,
            topk: &[[1, 0]],
        },
        json!({"rows_overridden": 1, "overridden": {name: 1}, "overridden_rows": {name: [0]}}),
    );
    let opts = under(Some(1e-4));
    let j = judge(
        &t,
        &compare(&reference, &t, &opts),
        &record(&t).unwrap(),
        &Against {
            reference: &reference,
            opts: &opts,
        },
    );
    assert_eq!(j.rows[0].outcome, Outcome::NotChecked, "{j:?}");
    assert!(
        j.not_checked[0].contains("the reference holds no layer.00.router.logits"),
        "{j:?}"
    );

    // A manufactured reorder: the reference ranks expert 1 above 0 by 0.5 and the candidate's
    // own logits swap them. Its own difference (0.5) would excuse a gap up to 1.0; the honest
    // bound 2e-4 does not.
    let far_own = [[1.5, 1.0, 0.0, -1.0]];
    let j = near_tie_one(&far, &far_own, &under(Some(1e-4)));
    assert!(j.near_ties.is_empty(), "{j:?}");
    assert_eq!(j.unexplained.len(), 1, "{j:?}");
    assert!(
        j.unexplained[0].why.contains("nor a near-tie: the reference's layer.00.router.logits put its own order [0, 1] 5e-1 from theirs, above the honest-noise bound 2e-4 (F·h, h 1e-4 from the policy)"),
        "{j:?}"
    );
    assert_eq!(
        (j.rows[0].outcome, j.rows[0].gap),
        (Outcome::Unexplained, Some(Real(0.5)))
    );

    // Within the bound, but nothing bounds it: no honest noise for router logits.
    let j = near_tie_one(&near, &near_own, &under(None));
    assert!(
        j.unexplained[0].why.ends_with("nor a near-tie: no honest noise bounds layer.00.router.logits: no noise reference measures it and the policy's near_tie.noise_abs has no pattern for it"),
        "{j:?}"
    );
    // Judged by bits: no near-ties at all.
    let j = near_tie_one(&near, &near_own, &Options::default());
    assert!(
        j.unexplained[0]
            .why
            .ends_with("nor a near-tie: judged by bits, which has no near-ties"),
        "{j:?}"
    );
    // A NaN in its own row explains nothing, whatever the gap (its margins, NaN-born, differ
    // first; the near-tie rule refuses it on its own).
    let nan_own = [[1.00005, 1.0, 0.0, f32::NAN]];
    let j = near_tie_one(&near, &nan_own, &under(Some(1e-4)));
    assert_eq!(j.rows[0].outcome, Outcome::Unexplained, "{j:?}");
    let open = |f: &str| Trace::open(dir.path().join(f)).unwrap();
    let why = tracegate_diff::override_gap(
        &open("reference.trace"),
        &open("forced.trace"),
        name,
        0,
        &[0, 1],
        Some(&policy(Some(1e-4))),
        None,
    )
    .unwrap_err();
    assert_eq!(
        why,
        "a NaN or infinity differs in layer.00.router.logits row 0"
    );
    // A reference whose own scores do not make its choice gives no gap to measure.
    let j = near_tie_judged(
        dir.path(),
        &near,
        &[[0, 1]],
        &[[1.0, 1.00005, 0.0, -1.0]],
        &[0],
        &under(Some(1e-4)),
    );
    assert!(
        j.unexplained[0].why.contains("nor a near-tie: the reference's own layer.00.router.logits row do not pick its choice [0, 1]"),
        "{j:?}"
    );

    // The noise reference's row is the bound where it measures one: 1e-6 in row 0 (tighter
    // than the policy's 1e-4, so the 5e-5 gap is not explained), 1e-3 in row 1 (looser: it
    // explains row 1's 5e-4 gap, which the policy's bound would not).
    let two = [[1.0, 1.00005, 0.0, -1.0], [2.0, 2.0005, 0.0, -1.0]];
    let two_own = [[1.00005, 1.0, 0.0, -1.0], [2.0005, 2.0, 0.0, -1.0]];
    let tokens = [0, 0, 1];
    let margins = honest(&LOGITS, &tokens);
    let noisy = [[1.000001, 1.00005, 0.0, -1.0], [2.0, 2.0005, 0.0, -1.001]];
    let noise = write_as(
        &dir.path().join("noise.trace"),
        &Forced {
            logits: &LOGITS,
            argmax: (&tokens, &margins),
            router_logits: &noisy,
            topk: &[[1, 0], [1, 0]],
        },
        json!({}),
    );
    let opts = Options {
        noise: Some(tracegate_diff::NoiseReference(std::sync::Arc::new(noise))),
        ..under(Some(1e-4))
    };
    let both = [[1, 0], [1, 0]];
    let j = near_tie_judged(dir.path(), &two, &both, &two_own, &[0, 1], &opts);
    let outcomes: Vec<_> = j
        .rows
        .iter()
        .map(|r| (r.row, r.outcome, r.honest_noise_from.as_deref()))
        .collect();
    assert_eq!(
        outcomes,
        [
            (0, Outcome::Unexplained, Some("noise_reference")),
            (1, Outcome::NearTie, Some("noise_reference"))
        ],
        "{j:?}"
    );
    let h = j.rows[0].honest_noise.unwrap().0;
    assert_eq!(h, (1.000001f32 - 1.0f32) as f64);
    assert_eq!(
        j.rows[1].honest_noise,
        Some(Real((1.001f32 - 1.0f32) as f64))
    );
    // Without it, the policy's bound explains row 0 and not row 1.
    let j = near_tie_judged(
        dir.path(),
        &two,
        &both,
        &two_own,
        &[0, 1],
        &under(Some(1e-4)),
    );
    let outcomes: Vec<_> = j.rows.iter().map(|r| r.outcome).collect();
    assert_eq!(outcomes, [Outcome::NearTie, Outcome::Unexplained], "{j:?}");
}

/// A forced trace of `logits.argmax` alone (no scores), as `write_as` otherwise.
fn write_without_scores(path: &std::path::Path, x: &Forced, forced: Value) -> Trace {
    let mut f = forced;
    f["decisions"] = json!(["logits.argmax"]);
    f["trace_digest"] = json!("00");
    let mut w = TraceWriter::create(path, json!({ "forced_decisions": f })).unwrap();
    let m = x.logits.len() as u64;
    w.decision("logits.argmax", &[m], x.argmax.0, Some(x.argmax.1))
        .unwrap();
    w.finish().unwrap();
    Trace::open(path).unwrap()
}

/// The reference's argmax over `reference` (its tokens `tokens`, honest margins) and a forced
/// candidate that took those tokens, its own logits `own` and the margins they give them (≤ 0
/// where its own scores make another choice), saying it overrode `rows`; `scores`: whether its
/// forced trace holds its logits. The overrides judged under `opts`.
fn flip_judged(
    dir: &std::path::Path,
    (reference, own): (&[[f32; 4]], &[[f32; 4]]),
    tokens: &[i64],
    rows: &[u64],
    scores: bool,
    opts: &Options,
) -> Judged {
    let ref_margins = honest(reference, tokens);
    let base = Forced {
        logits: reference,
        argmax: (tokens, &ref_margins),
        router_logits: &ROUTER,
        topk: &[[0, 1]],
    };
    let own_margins = honest(own, tokens);
    let own = Forced {
        logits: own,
        argmax: (tokens, &own_margins),
        ..base
    };
    overrides_judged(dir, (&base, &own), ("logits.argmax", rows), scores, opts)
}

/// Issue 50 item 3: a forced candidate's override whose own margin is ≤ 0 ("my own scores made
/// another choice") is the candidate's word, not an excuse. The choice its own scores make is a
/// near-tie only where the reference's own scores put it within F·h of the reference's choice,
/// h honest noise — never the candidate's own difference. Adversaries: a flip far from any tie
/// recorded with a consistent margin ≤ 0 (it moved two logits, within the policy's relative
/// L2); the same flip judged by bits; the flip with no scores to measure (NOT CHECKED, never
/// excused); and the honest near-tie, still excused.
#[test]
fn a_flip_is_excused_only_within_the_honest_bound_of_the_references_scores() {
    let dir = tempfile::tempdir().unwrap();
    let name = "logits.argmax";
    let under = |h: Option<f64>| Options {
        policy: Some(policy_for("logits", h)),
        ..Options::default()
    };
    // The reference's row 0 puts token 0 a whole logit above token 1; the candidate's own
    // logits put 1 above 0 (margin −0.5 for the forced 0, which its scores bear out).
    let reference = [[2.0, 1.0, 0.0, -1.0], [0.0, 3.0, 1.0, -1.0]];
    let far = [[0.75, 1.25, 0.0, -1.0], [0.0, 3.0, 1.0, -1.0]];
    let tokens = [0, 1];
    let flip = |sides: (&[[f32; 4]], &[[f32; 4]]), scores: bool, opts: &Options| {
        flip_judged(dir.path(), sides, &tokens, &[0], scores, opts)
    };
    let j = flip((&reference, &far), true, &under(Some(1e-3)));
    assert!(
        j.near_ties.is_empty() && j.ties.is_empty() && j.not_checked.is_empty(),
        "{j:?}"
    );
    assert_eq!(j.unexplained.len(), 1, "{j:?}");
    assert_eq!(
        j.unexplained[0].why,
        "its own logits make [1] where the reference chose [0] (margin -5e-1 ≤ 0), nor a near-tie: the reference's logits put its own choice [1] 1e0 from theirs, above the honest-noise bound 2e-3 (F·h, h 1e-3 from the policy)"
    );
    let r = &j.rows[0];
    assert_eq!(
        (
            r.outcome,
            r.own.as_deref(),
            r.gap,
            r.noise_bound,
            r.honest_noise_from.as_deref()
        ),
        (
            Outcome::Unexplained,
            Some(&[1i64][..]),
            Some(Real(1.0)),
            Some(Real(2e-3)),
            Some("policy")
        )
    );
    // The verdict it gives a clean prefill: decisions_differ, the row named with gap and bound.
    let f = crate::bisect::prefill::DecisionsForced {
        status: crate::bisect::prefill::Forcing::Forced,
        reason: None,
        from: "r.trace".into(),
        from_digest: "00".into(),
        candidate_trace: Some("c.trace".into()),
        unforced: vec![],
        rows_overridden: Some(1),
        overridden: None,
        overridden_rows: None,
        overrides_not_checked: None,
        overrides_unexplained: j.unexplained.clone(),
        overrides_ties: j.ties.clone(),
        overrides_near_ties: j.near_ties.clone(),
        overrides_rows: j.rows.clone(),
    };
    let (v, s) = crate::bisect::prefill::with_own_overrides(
        &f,
        (
            crate::bisect::prefill::BisectVerdict::NothingWrong,
            "nothing wrong: they agree".into(),
        ),
    );
    assert_eq!(
        v,
        crate::bisect::prefill::BisectVerdict::DecisionsDiffer,
        "{s}"
    );
    assert!(
        s.contains("logits.argmax row 0: its own logits make [1] where the reference chose [0]")
            && s.contains("above the honest-noise bound 2e-3"),
        "{s}"
    );

    // The same flip judged by bits: not excused.
    let j = flip((&reference, &far), true, &Options::default());
    // (its margins already differ from the reference's: by bits nothing is within anything)
    assert_eq!(
        (j.rows[0].outcome, j.unexplained.len()),
        (Outcome::Unexplained, 1),
        "{j:?}"
    );
    // No honest noise for logits: no bound, not excused.
    let j = flip((&reference, &far), true, &under(None));
    assert!(
        j.unexplained[0]
            .why
            .contains("nor a near-tie: no honest noise bounds logits"),
        "{j:?}"
    );

    // No scores in the forced trace (a margin 1e-6 from the reference's, within the margins'
    // tolerance): which choice it would have made, and the gap it crossed, cannot be told —
    // NOT CHECKED, never excused. (With the far flip's margins it is unexplained already: its
    // margins differ beyond what a source-less row allows.)
    let close = [[1.0, 0.999999, 0.0, -1.0], [0.0, 3.0, 1.0, -1.0]];
    let close_own = [[0.999999, 1.0, 0.0, -1.0], [0.0, 3.0, 1.0, -1.0]];
    let j = flip((&close, &close_own), false, &under(Some(1e-3)));
    assert!(
        j.unexplained.is_empty() && j.near_ties.is_empty() && j.ties.is_empty(),
        "{j:?}"
    );
    assert_eq!(j.rows[0].outcome, Outcome::NotChecked, "{j:?}");
    assert!(
        j.not_checked.len() == 1 && j.not_checked[0].starts_with("logits.argmax row 0: its margin -1.013279e-6 ≤ 0 says its own scores make another choice, and the forced trace holds none of the decision's scores"),
        "{j:?}"
    );
    let j = flip((&reference, &far), false, &under(Some(1e-3)));
    assert_eq!(j.rows[0].outcome, Outcome::Unexplained, "{j:?}");

    // The honest near-tie: the reference's 0 leads 1 by 5e-4 (≤ 2·1e-3); the candidate's own
    // logits, within 3e-4 of them, put 1 on top. Excused, its measures said.
    let near = [[1.0, 0.9995, 0.0, -1.0], [0.0, 3.0, 1.0, -1.0]];
    let near_own = [[0.9997, 0.9998, 0.0, -1.0], [0.0, 3.0, 1.0, -1.0]];
    let j = flip((&near, &near_own), true, &under(Some(1e-3)));
    assert!(
        j.unexplained.is_empty() && j.not_checked.is_empty(),
        "{j:?}"
    );
    assert_eq!(j.near_ties.get(name), Some(&1), "{j:?}");
    let r = &j.rows[0];
    assert_eq!(
        (r.outcome, r.own.as_deref()),
        (Outcome::NearTie, Some(&[1i64][..]))
    );
    assert_eq!(r.gap, Some(Real((1.0f32 - 0.9995f32) as f64)));
    // The same candidate under a tighter honest noise (1e-4: bound 2e-4 < the 5e-4 gap).
    let j = flip((&near, &near_own), true, &under(Some(1e-4)));
    assert_eq!(j.rows[0].outcome, Outcome::Unexplained, "{j:?}");

    // An exact tie in the reference's scores, broken the other way: a tie, by bits too.
    let tie = [[1.0, 1.0, 0.0, -1.0], [0.0, 3.0, 1.0, -1.0]];
    let j = flip_judged(
        dir.path(),
        (&tie, &tie),
        &[1, 1],
        &[0],
        true,
        &Options::default(),
    );
    assert!(
        j.unexplained.is_empty() && j.not_checked.is_empty(),
        "{j:?}"
    );
    assert_eq!(
        (
            j.rows[0].outcome,
            j.rows[0].own.as_deref(),
            j.ties.get(name)
        ),
        (Outcome::Tie, Some(&[0i64][..]), Some(&1))
    );
}

/// The prefill's verdict with a forced run's overrides (verdict.rs `with_own_overrides`): rows
/// its own numbers do not explain make a clean run `decisions_differ`; a record that could not
/// be judged makes it NOT CHECKED, never nothing wrong; exact ties are said.
#[test]
fn a_clean_verdict_takes_the_overrides_judgement() {
    use crate::bisect::prefill::{with_own_overrides, BisectVerdict, DecisionsForced, Forcing};
    let f = |unexplained: Vec<Unexplained>, not_checked: Option<&str>, ties: &[(&str, u64)]| {
        DecisionsForced {
            status: Forcing::Forced,
            reason: None,
            from: "r.trace".into(),
            from_digest: "00".into(),
            candidate_trace: Some("c.trace".into()),
            unforced: vec![],
            rows_overridden: Some(1),
            overridden: None,
            overridden_rows: None,
            overrides_not_checked: not_checked.map(str::to_string),
            overrides_unexplained: unexplained,
            overrides_ties: ties.iter().map(|(n, k)| (n.to_string(), *k)).collect(),
            overrides_near_ties: Default::default(),
            overrides_rows: vec![],
        }
    };
    let clean = || {
        (
            BisectVerdict::NothingWrong,
            "nothing wrong: they agree".to_string(),
        )
    };
    let (v, s) = with_own_overrides(&f(vec![], None, &[("layer.00.router.topk", 1)]), clean());
    assert_eq!(v, BisectVerdict::NothingWrong);
    assert!(
        s.ends_with("tie exactly (said, not failed): layer.00.router.topk: 1"),
        "{s}"
    );
    let (v, s) = with_own_overrides(&f(vec![], Some("no rows"), &[]), clean());
    assert_eq!(v, BisectVerdict::NotChecked);
    assert_eq!(
        s,
        "the candidate's own overrides NOT CHECKED: no rows; nothing wrong: they agree"
    );
    let u = Unexplained {
        decision: "logits.argmax".into(),
        rows: vec![2, 4],
        why: "its margin 1e0 > 0".into(),
    };
    let (v, s) = with_own_overrides(&f(vec![u.clone()], Some("no rows"), &[]), clean());
    assert_eq!(v, BisectVerdict::DecisionsDiffer);
    assert_eq!(
        s,
        "the candidate's own decisions differ on the reference's numbers, not explained by its own numbers: logits.argmax rows 2, 4 (row 2: its margin 1e0 > 0); they agree; the candidate's own overrides NOT CHECKED: no rows"
    );
    // A verdict that already fails keeps its own and says the overrides after it.
    let (v, s) = with_own_overrides(
        &f(vec![u], None, &[]),
        (BisectVerdict::WrongLayer, "layer 01 is wrong".into()),
    );
    assert_eq!(v, BisectVerdict::WrongLayer);
    assert!(
        s.starts_with("layer 01 is wrong; the candidate's own decisions differ"),
        "{s}"
    );
}
