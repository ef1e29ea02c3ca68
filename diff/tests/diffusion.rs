//! Block-diffusion traces (docs/diff.md, "Diffusion decisions" and "Sampling divergence"):
//! a synthetic trace of a prompt pass, two blocks of denoise steps and a commit pass, written
//! with the real TraceWriter; each test plants one difference and asks what the differ calls
//! it. The attacks try to make a rule that excuses or leaves something out hide a defect.

use crate::common;

use common::*;
use serde_json::{json, Value};
use tracegate_diff::{render_human, Policy, Report, Verdict};
use tracegate_trace::{Attributes, DType};

const C: usize = 4;
const H: usize = 8;
const V: usize = 16;
/// The prompt's length: block b's rows sit at positions N + b·C ..
const N: i64 = 4;
/// DG13.3's entropy bound and DG13.5's confidence threshold of these traces.
const BETA: f32 = 2.0;
const THRESHOLD: f32 = 1.0;

fn policy() -> Policy {
    Policy::load(
        &std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../fixtures/policy/oracle-default.json"),
    )
    .unwrap()
}

fn attrs(path: &str, mask: &str, first: i64, rows: usize) -> Attributes {
    Attributes::default()
        .with_path(path)
        .with_mask(mask)
        .with_positions((first..first + rows as i64).collect())
}

fn f32t(name: &str, shape: &[u64], seed: u32, a: Attributes) -> T {
    let n = shape.iter().product::<u64>() as usize;
    T {
        attrs: a,
        ..t_f32(name, shape, &values(n, seed))
    }
}

/// Row `row` of the tempered logits of block `b` step `s`.
fn tempered(b: usize, s: usize) -> String {
    format!("denoise.{b:04}.{s:04}.logits.tempered")
}

/// The trace: a prompt pass (4 tokens, one layer with a router), blocks 0 (steps 0 and 1) and
/// 1 (step 0) of a canvas of 4 rows, block 0's commit pass; every decision taken from it by
/// [`decide`]. Provenance `rng` "splitmix64-dg15", seed 7.
fn trace() -> Spec {
    let mut tensors = Vec::new();
    let enc = |first, rows| attrs("encode", "causal", first, rows);
    tensors.push(f32t("embed.out", &[4, 8], 1, enc(0, 4)));
    for (i, p) in ["hidden_in", "attn_out", "mlp_out", "hidden_out"]
        .iter()
        .enumerate()
    {
        tensors.push(f32t(
            &format!("layer.00.{p}"),
            &[4, 8],
            2 + i as u32,
            enc(0, 4),
        ));
    }
    tensors.push(f32t("layer.00.router.logits", &[4, 4], 9, enc(0, 4)));
    let mut seed = 10;
    for (b, steps) in [(0usize, 2usize), (1, 1)] {
        let first = N + (b * C) as i64;
        let den = |rows| attrs("denoise", "bidirectional", first, rows);
        for s in 0..steps {
            let pre = format!("denoise.{b:04}.{s:04}.");
            let canvas: Vec<u8> = (0..C as i64).flat_map(|x| (x + 3).to_le_bytes()).collect();
            tensors.push(T {
                attrs: den(C),
                ..t_raw(&format!("{pre}canvas"), DType::I64, &[C as u64], canvas)
            });
            for p in ["embed.out", "layer.00.hidden_in", "layer.00.attn_out"] {
                seed += 1;
                tensors.push(f32t(&format!("{pre}{p}"), &[4, 8], seed, den(C)));
            }
            seed += 1;
            tensors.push(f32t(
                &format!("{pre}layer.00.router.logits"),
                &[4, 4],
                seed,
                den(C),
            ));
            for p in ["layer.00.mlp_out", "layer.00.hidden_out", "final_norm.out"] {
                seed += 1;
                tensors.push(f32t(&format!("{pre}{p}"), &[4, 8], seed, den(C)));
            }
            for p in ["logits", "logits.tempered"] {
                seed += 1;
                tensors.push(f32t(&format!("{pre}{p}"), &[4, V as u64], seed, den(C)));
            }
            // Entropies in (0, ln V): positive, and apart by more than any test's noise.
            let h: Vec<f32> = (0..C)
                .map(|r| 0.4 + 0.5 * ((r + s + b) % C) as f32)
                .collect();
            tensors.push(T {
                attrs: den(C),
                ..t_f32(&format!("{pre}entropy"), &[C as u64], &h)
            });
        }
        if b == 0 {
            for p in ["hidden_in", "mlp_out", "hidden_out"] {
                seed += 1;
                tensors.push(f32t(
                    &format!("encode.0000.layer.00.{p}"),
                    &[4, 8],
                    seed,
                    enc(first, C),
                ));
            }
        }
    }
    let d = |name: &str, shape: &[u64], margins: bool| D {
        name: name.into(),
        shape: shape.to_vec(),
        values: vec![0; shape.iter().product::<u64>() as usize],
        margins: margins.then(|| vec![0.0; shape[0] as usize]),
    };
    let mut decisions = vec![d("layer.00.router.topk", &[4, 2], true)];
    for (b, steps) in [(0usize, 2usize), (1, 1)] {
        decisions.push(d(
            &format!("denoise.{b:04}.init_canvas"),
            &[C as u64],
            false,
        ));
        for s in 0..steps {
            let pre = format!("denoise.{b:04}.{s:04}.");
            decisions.push(d(&format!("{pre}layer.00.router.topk"), &[4, 2], true));
            decisions.push(d(&format!("{pre}argmax"), &[C as u64], true));
            decisions.push(d(&format!("{pre}sampled"), &[C as u64], true));
            decisions.push(d(&format!("{pre}accept"), &[C as u64], true));
            decisions.push(d(&format!("{pre}renoise"), &[C as u64], false));
            decisions.push(d(&format!("{pre}stop"), &[3], true));
        }
        decisions.push(d(&format!("denoise.{b:04}.commit"), &[C as u64], true));
    }
    let mut spec = Spec {
        provenance: json!({"producer": "engine", "versions": {"tracegate": "0.1.0"}, "dtype": "f32",
            "device": "cpu", "weights_digest": "w-dg", "prompt_tokens": [2, 5, 7, 11],
            "rng": "splitmix64-dg15", "seed": 7}),
        tensors,
        decisions,
    };
    for s in 0..2 {
        // Step 1's argmax canvas differs from step 0's in row 0: never stable, whatever flips.
        spec.raise(&tempered(0, s), 0, 2 + s, 1.0);
    }
    decide(&mut spec);
    spec
}

/// Every decision as a producer takes it from the spec's tensors: routers and argmax (top-1
/// minus top-2 of the tempered logits), `sampled` (the draws kept in its values, margin the
/// drawn token's f32 softmax probability), `accept` (DG13.3 with β = 2), `stop` (DG13.5,
/// stability threshold 1, confidence threshold 1), `commit` (the last step's argmax);
/// `init_canvas` and `renoise` are draws, whose values [`draw`] sets.
fn decide(spec: &mut Spec) {
    spec.decide();
    let names: Vec<String> = spec.decisions.iter().map(|d| d.name.clone()).collect();
    let mut last_argmax: Option<(Vec<i64>, Vec<f32>)> = None;
    let mut previous_argmax: Option<Vec<i64>> = None;
    for name in names {
        let Some(pre) = name.rsplit_once('.').map(|x| x.0.to_string()) else {
            continue;
        };
        let point = name.rsplit('.').next().unwrap().to_string();
        match point.as_str() {
            "argmax" => {
                let z = spec.f32s(&format!("{pre}.logits.tempered"));
                let (mut v, mut m) = (Vec::new(), Vec::new());
                for row in z.chunks(V) {
                    let o = ranked(row);
                    v.push(o[0] as i64);
                    m.push(row[o[0]] - row[o[1]]);
                }
                let d = spec.decision_mut(&name);
                (d.values, d.margins) = (v.clone(), Some(m.clone()));
                if name.ends_with(".0000.argmax") {
                    previous_argmax = None;
                }
                last_argmax = Some((v, m));
            }
            "sampled" => {
                let z = spec.f32s(&format!("{pre}.logits.tempered"));
                let d = spec.decision_mut(&name);
                if d.values.iter().all(|&x| x == 0) {
                    d.values = (0..C as i64).map(|r| (r * 5 + 1) % V as i64).collect();
                }
                let m = z
                    .chunks(V)
                    .zip(&d.values)
                    .map(|(row, &t)| softmax(row)[t as usize])
                    .collect();
                d.margins = Some(m);
            }
            "accept" => {
                let h = spec.f32s(&format!("{pre}.entropy"));
                let (v, m) = accept(&h);
                let d = spec.decision_mut(&name);
                (d.values, d.margins) = (v, Some(m));
            }
            "stop" => {
                let h = spec.f32s(&format!("{pre}.entropy"));
                let argmax = last_argmax.clone().unwrap().0;
                let run = match &previous_argmax {
                    Some(p) if *p == argmax => 1f32,
                    _ => 0.0,
                };
                previous_argmax = Some(argmax);
                let stable = run >= 1.0;
                let mu = h.iter().fold(0f32, |a, &x| a + x) / C as f32;
                let confident = mu < THRESHOLD;
                let m_stable = if stable { run - 1.0 } else { 1.0 - run };
                let m_conf = if confident {
                    THRESHOLD - mu
                } else {
                    mu - THRESHOLD
                };
                let d = spec.decision_mut(&name);
                d.values = vec![
                    stable as i64,
                    confident as i64,
                    (stable && confident) as i64,
                ];
                d.margins = Some(vec![
                    m_stable,
                    m_conf,
                    if stable { m_conf } else { m_stable },
                ]);
            }
            "commit" => {
                let (v, m) = last_argmax.clone().unwrap();
                let d = spec.decision_mut(&name);
                (d.values, d.margins) = (v, Some(m));
            }
            "renoise" => {
                let accepted = spec.decision_mut(&format!("{pre}.accept")).values.clone();
                let d = spec.decision_mut(&name);
                d.values = accepted
                    .iter()
                    .enumerate()
                    .map(|(r, &a)| {
                        if a == 1 {
                            -1
                        } else {
                            (r as i64 * 7 + 2) % V as i64
                        }
                    })
                    .collect();
            }
            "init_canvas" => {
                let d = spec.decision_mut(&name);
                if d.values.iter().all(|&x| x == 0) {
                    d.values = (0..C as i64).map(|r| (r * 3 + 1) % V as i64).collect();
                }
            }
            _ => {}
        }
    }
}

/// DG13.3: rows by (entropy, index) ascending; x = the entropies ranked before; accepted when
/// x ≤ β, margin the distance to β.
fn accept(h: &[f32]) -> (Vec<i64>, Vec<f32>) {
    let mut order: Vec<usize> = (0..h.len()).collect();
    order.sort_by(|&a, &b| h[a].total_cmp(&h[b]).then(a.cmp(&b)));
    let (mut v, mut m) = (vec![0; h.len()], vec![0f32; h.len()]);
    let mut sum = 0f32;
    for &r in &order {
        let x = sum;
        sum += h[r];
        v[r] = (x <= BETA) as i64;
        m[r] = if x <= BETA { BETA - x } else { x - BETA };
    }
    (v, m)
}

/// Honest rounding noise: every third element of every float tensor after the prompt's
/// embedding moved by one ULP (as another summation order does), and the decisions taken again.
fn noisy(spec: &Spec) -> Spec {
    let mut c = spec.clone();
    let names: Vec<String> = c
        .tensors
        .iter()
        .filter(|t| t.dtype == DType::F32 && !t.name.ends_with("embed.out"))
        .map(|t| t.name.clone())
        .collect();
    for n in names {
        let count = c.tensor_mut(&n).bytes.len() / 4;
        for i in (0..count).step_by(3) {
            c.poke_f32_bits(&n, i, |b| b ^ 1);
        }
    }
    decide(&mut c);
    c
}

/// Another producer, another generator: the same arithmetic up to rounding, `rng` "torch:cpu",
/// and every draw different from block 0's initial canvas on.
fn other_rng(spec: &Spec) -> Spec {
    let mut c = noisy(spec);
    c.provenance["rng"] = json!("torch:cpu");
    for d in c.decisions.iter_mut() {
        if d.name.ends_with("init_canvas") || d.name.ends_with("sampled") {
            for v in d.values.iter_mut() {
                *v = (*v + 1) % V as i64;
            }
        }
    }
    // A different canvas from step 1 on: its tensors move, far outside the policy.
    let later: Vec<String> = c
        .tensors
        .iter()
        .filter(|t| t.dtype == DType::F32)
        .filter(|t| {
            t.name.starts_with("denoise.0000.0001.")
                || t.name.starts_with("encode.")
                || t.name.starts_with("denoise.0001.")
        })
        .map(|t| t.name.clone())
        .collect();
    for n in later {
        let count = c.tensor_mut(&n).bytes.len() / 4;
        for i in 0..count {
            c.poke_f32_bits(&n, i, |b| (f32::from_bits(b) * 1.5 + 0.25).to_bits());
        }
    }
    decide(&mut c);
    c
}

fn status<'a>(rep: &'a Report, tensor: &str) -> &'a str {
    tensor_row(rep, tensor).status.as_str()
}

/// The label of row `row` of `decision`'s flip.
fn label(rep: &Report, decision: &str, row: u64) -> String {
    flip_at(rep, decision, row).label.as_str().to_string()
}

fn kinds(rep: &Report) -> Vec<&str> {
    rep.findings.iter().map(|f| f.kind.as_str()).collect()
}

fn json_of(rep: &Report) -> Value {
    report_json(rep)
}

// --- the trace itself, and honest noise ------------------------------------------------------

#[test]
fn the_trace_against_itself_and_against_honest_noise() {
    let r = trace();
    assert_eq!(diff(&r, &r, None).verdict, Verdict::Identical);
    // Negative control for every attack below: rounding noise alone is within the policy,
    // every decision equal.
    let c = noisy(&r);
    let rep = diff(&r, &c, Some(policy()));
    assert_eq!(rep.verdict, Verdict::WithinPolicy, "{}", render_human(&rep));
    assert!(rep.decisions.results.iter().all(|d| d.differing_rows == 0));
    assert!(rep.decisions.sampling_divergence.is_none());
    // The argmax is taken from its tempered logits, a router from its pass's router logits.
    let source = |n: &str| decision_result(&rep, n).source.clone();
    assert_eq!(source("denoise.0000.0001.argmax"), Some(tempered(0, 1)));
    assert_eq!(
        source("denoise.0000.0001.layer.00.router.topk").as_deref(),
        Some("denoise.0000.0001.layer.00.router.logits")
    );
    assert_eq!(source("denoise.0000.0001.sampled"), None);
}

// --- near-ties at a denoise argmax -----------------------------------------------------------

/// Row `row` of block 0 step `s`'s tempered logits: tokens 5 and 9 two ULPs apart at 3.0 in
/// the reference (5 on top), the other way round in the candidate: a flip whose gap, 2 ULP, is
/// within twice the row's divergence.
fn argmax_near_tie(s: usize, row: usize, gap_ulps: u32) -> (Spec, Spec) {
    let mut r = trace();
    let t = tempered(0, s);
    let below = f32::from_bits(3.0f32.to_bits() - gap_ulps);
    r.set_f32(&t, row * V + 5, 3.0);
    r.set_f32(&t, row * V + 9, below);
    decide(&mut r);
    let mut c = noisy(&r);
    c.set_f32(&t, row * V + 5, below);
    c.set_f32(&t, row * V + 9, 3.0);
    decide(&mut c);
    (r, c)
}

#[test]
fn an_argmax_near_tie_is_excused_with_its_commit_row_and_the_commit_pass_row() {
    let (r, c) = argmax_near_tie(1, 2, 2);
    let rep = diff(&r, &c, Some(policy()));
    // The stability rows and the commit pass row it excuses were not judged: exit 4.
    assert_eq!(rep.verdict, Verdict::NotChecked, "{}", render_human(&rep));
    assert_eq!(label(&rep, "denoise.0000.0001.argmax", 2), "near-tie");
    // The commit is that argmax (DG13.6): its row takes the near-tie's label, not a defect.
    assert_eq!(label(&rep, "denoise.0000.commit", 2), "near-tie");
    let nt = rep.decisions.near_ties.as_ref().unwrap();
    assert_eq!(
        nt.excused.len(),
        1,
        "one near-tie, not two: {:?}",
        nt.excused
    );
    assert_eq!(nt.excused[0].position, N + 2);
    // The committed token enters the commit pass: its row there is left out.
    assert!(
        nt.tensors
            .iter()
            .any(|t| t.tensor == "encode.0000.layer.00.hidden_out"),
        "{:?}",
        nt.tensors
    );

    // Negative control: the candidate's scores are the reference's up to rounding, and it
    // chose token 9, 40 ULPs below: its own scores do not make that choice, a defect (its
    // margin says so honestly, so no margin finding decides this).
    let (r, _) = argmax_near_tie(1, 2, 40);
    let mut c = noisy(&r);
    let row: Vec<f32> = c.f32s(&tempered(0, 1))[2 * V..3 * V].to_vec();
    let best_other = (0..V)
        .filter(|&j| j != 9)
        .map(|j| row[j])
        .fold(f32::MIN, f32::max);
    for n in ["denoise.0000.0001.argmax", "denoise.0000.commit"] {
        let d = c.decision_mut(n);
        d.values[2] = 9;
        d.margins.as_mut().unwrap()[2] = row[9] - best_other;
    }
    let rep = diff(&r, &c, Some(policy()));
    assert_eq!(rep.verdict, Verdict::Different);
    assert_eq!(label(&rep, "denoise.0000.0001.argmax", 2), "defect");
    assert_eq!(label(&rep, "denoise.0000.commit", 2), "defect");
}

#[test]
fn attack_an_argmax_near_tie_excuses_no_row_of_a_later_step() {
    // The argmax canvas enters no tensor (the next canvas is drawn): a near-tie at step 0 row 2
    // must not excuse row 2 of step 1, where a defect is planted.
    let (r, mut c) = argmax_near_tie(0, 2, 2);
    let control = diff(&r, &c, Some(policy()));
    assert_eq!(
        control.verdict,
        Verdict::NotChecked,
        "{}",
        render_human(&control)
    );
    assert_eq!(label(&control, "denoise.0000.0000.argmax", 2), "near-tie");
    let t = "denoise.0000.0001.layer.00.mlp_out";
    for i in 2 * H..3 * H {
        c.poke_f32_bits(t, i, |b| (f32::from_bits(b) * 1.1).to_bits());
    }
    let rep = diff(&r, &c, Some(policy()));
    assert_eq!(rep.verdict, Verdict::Different, "{}", render_human(&rep));
    assert_eq!(status(&rep, t), "outside_policy");
    // Step 1's argmax row 2 did not flip: the excused row 2 of step 0 did not leak into it.
    assert!(decision_result(&rep, "denoise.0000.0001.argmax")
        .flips
        .is_empty());
}

// --- (h) a commit that is not its own argmax --------------------------------------------------

#[test]
fn attack_h_a_commit_not_its_own_last_argmax_is_a_defect_even_after_an_excused_near_tie() {
    let (r, mut c) = argmax_near_tie(1, 2, 2);
    // The candidate commits its sampled token at row 2 instead of its argmax (the "reply from
    // the sampled canvas" bug), which also differs from the reference's commit.
    let sampled = c.decision_mut("denoise.0000.0001.sampled").values[2];
    c.decision_mut("denoise.0000.commit").values[2] = sampled;
    let rep = diff(&r, &c, Some(policy()));
    assert_eq!(rep.verdict, Verdict::Different, "{}", render_human(&rep));
    assert_eq!(label(&rep, "denoise.0000.0001.argmax", 2), "near-tie");
    assert_eq!(label(&rep, "denoise.0000.commit", 2), "defect");
    assert!(
        kinds(&rep).contains(&"commit_not_argmax"),
        "{:?}",
        kinds(&rep)
    );

    // And where the wrong commit happens to equal the reference's: after an excused near-tie
    // the candidate commits the reference's token, not its own argmax. No flip, still caught.
    let (r, mut c) = argmax_near_tie(1, 2, 2);
    let theirs = r
        .decisions
        .iter()
        .find(|d| d.name == "denoise.0000.commit")
        .unwrap()
        .values[2];
    c.decision_mut("denoise.0000.commit").values[2] = theirs;
    let rep = diff(&r, &c, Some(policy()));
    assert_eq!(rep.verdict, Verdict::Different, "{}", render_human(&rep));
    assert_eq!(margins_of(&rep, "denoise.0000.commit").differing_rows, 0);
    let f = rep
        .findings
        .iter()
        .find(|f| f.kind.as_str() == "commit_not_argmax")
        .unwrap();
    assert!(f.detail.contains("candidate"), "{}", f.detail);
    assert!(!kinds(&diff(&r, &noisy(&r), Some(policy()))).contains(&"commit_not_argmax"));
}

// --- the sampler's decisions are never near-ties ---------------------------------------------

#[test]
fn attack_e_an_accept_or_stop_flip_with_a_tiny_margin_is_a_defect() {
    // Row 3's accept is 1e-7 nats from the bound on both sides, and the candidate decides the
    // other way with clean inputs. A margin is no distance the near-tie rule understands.
    let mut r = trace();
    r.decision_mut("denoise.0000.0000.accept")
        .margins
        .as_mut()
        .unwrap()[3] = 1e-7;
    let mut c = noisy(&r);
    let a = c.decision_mut("denoise.0000.0000.accept");
    a.values[3] = 1 - a.values[3];
    a.margins.as_mut().unwrap()[3] = 1e-7;
    let rep = diff(&r, &c, Some(policy()));
    assert_eq!(rep.verdict, Verdict::Different, "{}", render_human(&rep));
    assert_eq!(label(&rep, "denoise.0000.0000.accept", 3), "defect");

    let mut c = noisy(&r);
    let s = c.decision_mut("denoise.0000.0001.stop");
    s.values[1] = 1 - s.values[1];
    s.margins.as_mut().unwrap()[1] = 1e-7;
    let rep = diff(&r, &c, Some(policy()));
    assert_eq!(rep.verdict, Verdict::Different);
    assert_eq!(label(&rep, "denoise.0000.0001.stop", 1), "defect");
}

#[test]
fn a_sampler_flip_after_a_tensor_outside_the_policy_is_its_consequence() {
    let r = trace();
    let mut c = noisy(&r);
    c.poke_f32_bits("denoise.0000.0000.entropy", 3, |b| {
        (f32::from_bits(b) + 1.0).to_bits()
    });
    let a = c.decision_mut("denoise.0000.0000.accept");
    a.values[3] = 1 - a.values[3];
    let rep = diff(&r, &c, Some(policy()));
    assert_eq!(rep.verdict, Verdict::Different);
    assert_eq!(label(&rep, "denoise.0000.0000.accept", 3), "consequence");
    // An earlier tensor explains it; a later one does not.
    let mut c = noisy(&r);
    c.poke_f32_bits("denoise.0001.0000.entropy", 3, |b| {
        (f32::from_bits(b) + 1.0).to_bits()
    });
    let a = c.decision_mut("denoise.0000.0000.accept");
    a.values[3] = 1 - a.values[3];
    let rep = diff(&r, &c, Some(policy()));
    assert_eq!(label(&rep, "denoise.0000.0000.accept", 3), "defect");
}

// --- sampling divergence ---------------------------------------------------------------------

#[test]
fn another_rng_diverges_at_the_first_draw_and_what_follows_is_not_judged_loudly() {
    let r = trace();
    let c = other_rng(&r);
    let rep = diff(&r, &c, Some(policy()));
    let text = render_human(&rep);
    assert_eq!(rep.verdict, Verdict::Incomparable, "{text}");
    let s = rep
        .decisions
        .sampling_divergence
        .as_ref()
        .expect("a sampling divergence");
    assert_eq!(s.decision, "denoise.0000.init_canvas");
    assert_eq!(
        (s.block, s.step, s.rows.clone()),
        (0, None, vec![0, 1, 2, 3])
    );
    assert!(s.tensors_not_judged > 0 && s.decisions_not_judged > 0);
    assert_eq!(
        label(&rep, "denoise.0000.init_canvas", 0),
        "sampling-divergence"
    );
    assert_eq!(
        label(&rep, "denoise.0000.0000.sampled", 0),
        "after-sampling-divergence"
    );
    // Before the draw: judged. After it: not judged, counted, and said.
    assert_eq!(status(&rep, "layer.00.mlp_out"), "within_policy");
    assert_eq!(
        status(&rep, "denoise.0000.0001.layer.00.mlp_out"),
        "after_sampling_divergence"
    );
    assert_eq!(
        status(&rep, "encode.0000.layer.00.hidden_out"),
        "after_sampling_divergence"
    );
    let loud = format!(
        "{} tensors, {} decisions after the sampling divergence at block 0: not judged; force the candidate with --force-decisions REF to compare them",
        s.tensors_not_judged, s.decisions_not_judged
    );
    assert!(text.lines().next().unwrap().contains(&loud), "{text}");
    assert!(kinds(&rep).contains(&"sampling_divergence"));
    let j = json_of(&rep);
    assert_eq!(
        j["decisions"]["sampling_divergence"]["reference_rng"],
        "splitmix64-dg15"
    );
    let html = tracegate_diff::html::render_html(&rep);
    assert!(
        html.contains("not judged</b>; force the candidate"),
        "the page says it too"
    );

    // A later first draw: init_canvas equal, sampled at step 0 differs.
    let mut c2 = other_rng(&r);
    let init = r
        .decisions
        .iter()
        .find(|d| d.name == "denoise.0000.init_canvas")
        .unwrap()
        .values
        .clone();
    c2.decision_mut("denoise.0000.init_canvas").values = init;
    let rep = diff(&r, &c2, Some(policy()));
    let s = rep.decisions.sampling_divergence.as_ref().unwrap();
    assert_eq!(
        (s.decision.as_str(), s.step),
        ("denoise.0000.0000.sampled", Some(0))
    );
    assert_eq!(status(&rep, "denoise.0000.0000.entropy"), "within_policy");
    assert_eq!(
        status(&rep, "denoise.0000.0001.layer.00.mlp_out"),
        "after_sampling_divergence"
    );
    // The step's accept and stop read no draw: judged, not left out. A flip there fails.
    let accept = margins_of(&rep, "denoise.0000.0000.accept");
    assert_eq!(accept.differing_rows, 0);
    let mut c3 = c2.clone();
    let a = c3.decision_mut("denoise.0000.0000.accept");
    a.values[3] = 1 - a.values[3];
    let rep = diff(&r, &c3, Some(policy()));
    assert_eq!(rep.verdict, Verdict::Different, "{}", render_human(&rep));
    assert_eq!(label(&rep, "denoise.0000.0000.accept", 3), "defect");
    // While the next step's accept, after the draw, is not judged.
    let mut c4 = c2.clone();
    let a = c4.decision_mut("denoise.0000.0001.accept");
    a.values[3] = 1 - a.values[3];
    let rep = diff(&r, &c4, Some(policy()));
    assert_eq!(rep.verdict, Verdict::Incomparable);
    assert_eq!(
        label(&rep, "denoise.0000.0001.accept", 3),
        "after-sampling-divergence"
    );
}

#[test]
fn after_the_sampling_divergence_a_step_one_side_ran_is_no_structure_difference() {
    // On its own canvas the candidate's stop ends block 0 after step 0: step 1 is not in it.
    let r = trace();
    let mut c = other_rng(&r);
    c.tensors
        .retain(|t| !t.name.starts_with("denoise.0000.0001."));
    c.decisions
        .retain(|d| !d.name.starts_with("denoise.0000.0001."));
    // Its commit is its own last argmax, step 0's; held to that, not to the reference's step.
    let stale = c.clone();
    decide(&mut c);
    let rep = diff(&r, &stale, Some(policy()));
    assert!(
        kinds(&rep).contains(&"commit_not_argmax"),
        "{:?}",
        kinds(&rep)
    );
    let rep = diff(&r, &c, Some(policy()));
    assert_eq!(rep.verdict, Verdict::Incomparable, "{}", render_human(&rep));
    assert!(kinds(&rep).contains(&"after_sampling_divergence"));
    assert!(!kinds(&rep).contains(&"missing_tensor"));
    // Negative controls: a name missing from a step both sides ran is still a difference,
    // after the draw as before it; and without the divergence a missing step fails.
    for gone in ["denoise.0000.0000.entropy", "layer.00.mlp_out"] {
        let mut c2 = c.clone();
        c2.tensors.retain(|t| t.name != gone);
        let rep = diff(&r, &c2, Some(policy()));
        assert_eq!(rep.verdict, Verdict::Different, "{gone}");
        assert!(kinds(&rep).contains(&"missing_tensor"), "{gone}");
    }
    let mut c3 = noisy(&r);
    c3.tensors
        .retain(|t| !t.name.starts_with("denoise.0000.0001."));
    c3.decisions
        .retain(|d| !d.name.starts_with("denoise.0000.0001."));
    let rep = diff(&r, &c3, Some(policy()));
    assert_eq!(rep.verdict, Verdict::Different);
    assert!(!kinds(&rep).contains(&"after_sampling_divergence"));
}

#[test]
fn attack_a_a_defect_in_the_prompt_pass_before_the_first_draw_still_fails() {
    let r = trace();
    let mut c = other_rng(&r);
    c.poke_f32_bits("layer.00.mlp_out", 5, |b| {
        (f32::from_bits(b) + 0.5).to_bits()
    });
    let rep = diff(&r, &c, Some(policy()));
    assert_eq!(rep.verdict, Verdict::Different, "{}", render_human(&rep));
    assert_eq!(status(&rep, "layer.00.mlp_out"), "outside_policy");
    assert!(rep.decisions.sampling_divergence.is_some());
    // And one in block 0's step 0, before its `sampled` (the first differing draw), too.
    let mut c = other_rng(&r);
    let init = r
        .decisions
        .iter()
        .find(|d| d.name == "denoise.0000.init_canvas")
        .unwrap()
        .values
        .clone();
    c.decision_mut("denoise.0000.init_canvas").values = init;
    c.poke_f32_bits("denoise.0000.0000.layer.00.hidden_out", 5, |b| {
        (f32::from_bits(b) + 0.5).to_bits()
    });
    let rep = diff(&r, &c, Some(policy()));
    assert_eq!(rep.verdict, Verdict::Different);
    assert_eq!(
        status(&rep, "denoise.0000.0000.layer.00.hidden_out"),
        "outside_policy"
    );
}

#[test]
fn attack_b_other_rng_with_equal_draws_judges_everything() {
    let r = trace();
    let mut c = noisy(&r);
    c.provenance["rng"] = json!("torch:cpu");
    let control = diff(&r, &c, Some(policy()));
    assert_eq!(control.verdict, Verdict::WithinPolicy);
    assert!(control.decisions.sampling_divergence.is_none());
    let t = "denoise.0001.0000.layer.00.mlp_out";
    c.poke_f32_bits(t, 3, |b| (f32::from_bits(b) + 0.5).to_bits());
    let rep = diff(&r, &c, Some(policy()));
    assert_eq!(rep.verdict, Verdict::Different);
    assert_eq!(status(&rep, t), "outside_policy");
    assert!(rep.decisions.sampling_divergence.is_none());
}

/// The reference against `other_rng`'s candidate with its provenance edited by `edit`.
fn draws_differ_with(edit: impl Fn(&mut Spec)) -> Report {
    let r = trace();
    let mut c = other_rng(&r);
    edit(&mut c);
    diff(&r, &c, Some(policy()))
}

#[test]
fn attack_c_d_g_a_differing_draw_is_a_defect_with_the_same_rng_a_forced_candidate_or_no_rng() {
    for (what, rep) in [
        (
            "same rng",
            draws_differ_with(|c| c.provenance["rng"] = json!("splitmix64-dg15")),
        ),
        (
            "forced",
            draws_differ_with(|c| {
                c.provenance["forced_decisions"] =
                    json!({"trace": "ref.trace", "trace_digest": "00", "decisions": []})
            }),
        ),
        (
            "no rng in the candidate",
            draws_differ_with(|c| {
                c.provenance.as_object_mut().unwrap().remove("rng");
            }),
        ),
    ] {
        assert_eq!(
            rep.verdict,
            Verdict::Different,
            "{what}: {}",
            render_human(&rep)
        );
        assert!(rep.decisions.sampling_divergence.is_none(), "{what}");
        assert_eq!(
            label(&rep, "denoise.0000.init_canvas", 0),
            "defect",
            "{what}"
        );
        assert!(
            !rep.per_tensor
                .iter()
                .any(|t| t.status.as_str() == "after_sampling_divergence"),
            "{what}"
        );
    }
    // (c) with a differing `sampled` alone, the same rng: a defect.
    let r = trace();
    let mut c = noisy(&r);
    c.decision_mut("denoise.0000.0001.sampled").values[3] = 2;
    decide(&mut c);
    let rep = diff(&r, &c, Some(policy()));
    assert_eq!(rep.verdict, Verdict::Different);
    assert_eq!(label(&rep, "denoise.0000.0001.sampled", 3), "defect");
}

#[test]
fn attack_f_nan_after_the_sampling_divergence_is_still_found() {
    let r = trace();
    let mut c = other_rng(&r);
    let t = "denoise.0001.0000.layer.00.hidden_out";
    c.set_f32(t, 4, f32::NAN);
    let rep = diff(&r, &c, Some(policy()));
    assert_eq!(rep.verdict, Verdict::Different, "{}", render_human(&rep));
    assert!(rep.decisions.sampling_divergence.is_some());
    assert_eq!(status(&rep, t), "outside_policy");
    assert!(tensor_row(&rep, t).nan_mismatch > 0);
    assert!(
        rep.findings.iter().any(|f| f.tensor() == Some(t)),
        "{:?}",
        kinds(&rep)
    );
}

#[test]
fn without_a_policy_there_is_no_sampling_divergence() {
    let r = trace();
    let rep = diff(&r, &other_rng(&r), None);
    assert_eq!(rep.verdict, Verdict::Different);
    assert!(rep.decisions.sampling_divergence.is_none());
}

// --- margins of the sampler's decisions ------------------------------------------------------

/// A forced comparison: the candidate has the reference's decision values, and its own
/// margins for them from its own tensors, whose tempered logits of block 0 step 1 row 2 and
/// entropies of that step are moved by `by` (relative).
fn forced_pair(by: f32) -> (Spec, Spec) {
    let r = trace();
    let mut c = noisy(&r);
    c.provenance["forced_decisions"] =
        json!({"trace": "ref.trace", "trace_digest": "00", "decisions": []});
    let t = tempered(0, 1);
    for i in 2 * V..3 * V {
        c.poke_f32_bits(&t, i, |b| (f32::from_bits(b) * (1.0 + by)).to_bits());
    }
    for i in 0..C {
        c.poke_f32_bits("denoise.0000.0001.entropy", i, |b| {
            (f32::from_bits(b) * (1.0 + by)).to_bits()
        });
    }
    decide(&mut c);
    (r, c)
}

fn margins_of<'a>(rep: &'a Report, name: &str) -> &'a tracegate_diff::DecisionResult {
    decision_result(rep, name)
}

#[test]
fn attack_i_sampler_margins_in_a_forced_comparison_within_and_beyond_their_tolerance() {
    // Honest: 5e-5 relative on the tempered row and the entropies (within the policy) moves
    // `accept`'s nats and `stop`'s mean entropy by more than the general 1e-5·max(1, |m|)
    // allows, and by less than what the rows' divergence bounds.
    let (r, c) = forced_pair(5e-5);
    let rep = diff(&r, &c, Some(policy()));
    assert_eq!(rep.verdict, Verdict::WithinPolicy, "{}", render_human(&rep));
    for n in [
        "denoise.0000.0001.sampled",
        "denoise.0000.0001.accept",
        "denoise.0000.0001.stop",
    ] {
        let m = margins_of(&rep, n);
        assert_eq!(
            m.margins.as_str(),
            "within_tolerance",
            "{n}: {:?}",
            m.first_margin_difference
        );
    }
    let stop = margins_of(&rep, "denoise.0000.0001.stop")
        .first_margin_difference
        .clone()
        .unwrap();
    assert!(
        (stop.reference.0 - stop.candidate.0).abs() > 1e-5,
        "{stop:?}"
    );
    // Each margin just beyond its bound: the tolerance a row got, plus a bit, fails.
    for n in [
        "denoise.0000.0001.sampled",
        "denoise.0000.0001.accept",
        "denoise.0000.0001.stop",
    ] {
        let m = margins_of(&rep, n).first_margin_difference.clone().unwrap();
        let tol = m.tolerance.unwrap().0;
        let mut c2 = c.clone();
        let row = m.row as usize;
        let want = (m.reference.0 + 1.5 * tol) as f32;
        c2.decision_mut(n).margins.as_mut().unwrap()[row] = want;
        let rep2 = diff(&r, &c2, Some(policy()));
        assert_eq!(
            rep2.verdict,
            Verdict::Different,
            "{n} at {want} vs {} (tol {tol})",
            m.reference.0
        );
        assert_eq!(margins_of(&rep2, n).margins.as_str(), "different", "{n}");
    }
    // (i) a drawn token's probability 0.9 against 0.1: far off.
    let (mut r, mut c) = forced_pair(5e-5);
    r.decision_mut("denoise.0000.0001.sampled")
        .margins
        .as_mut()
        .unwrap()[0] = 0.9;
    c.decision_mut("denoise.0000.0001.sampled")
        .margins
        .as_mut()
        .unwrap()[0] = 0.1;
    let rep = diff(&r, &c, Some(policy()));
    assert_eq!(rep.verdict, Verdict::Different);
    assert!(kinds(&rep).contains(&"margin_differs"));
}

// --- where the first divergence is, in words -------------------------------------------------

#[test]
fn the_headline_names_block_step_and_layer() {
    let r = trace();
    let mut c = noisy(&r);
    c.poke_f32_bits("denoise.0000.0001.layer.00.mlp_out", 3, |b| {
        (f32::from_bits(b) + 1.0).to_bits()
    });
    let rep = diff(&r, &c, Some(policy()));
    let first = render_human(&rep).lines().next().unwrap().to_string();
    assert!(
        first.contains("first denoise.0000.0001.layer.00.mlp_out (block 0 step 1 layer 00)"),
        "{first}"
    );
    let mut c = r.clone();
    c.poke_f32_bits("encode.0000.layer.00.mlp_out", 3, |b| b ^ 1);
    let rep = diff(&r, &c, None);
    let first = render_human(&rep).lines().next().unwrap().to_string();
    assert!(first.contains("(block 0 commit pass layer 00)"), "{first}");
}
