//! `--force-decisions` (docs/producers.md, "Forced decisions"): a run forced by its own trace
//! computes exactly what the unforced run does; a run forced from an altered trace carries the
//! altered choices, with margins that say it would have chosen otherwise; a trace that cannot
//! serve the run is refused naming the file and the decision.

use crate::common;

use std::path::{Path, PathBuf};

use common::*;
use tracegate_engine::{run_layer, run_trace, LayerOptions, TraceOptions};
use tracegate_trace::{Trace, TraceWriter};

const PROMPT: [i64; 7] = [3, 17, 5, 0, 42, 17, 9];

struct Fixture {
    _tmp: tempfile::TempDir,
    dir: PathBuf,
    moe: PathBuf,
}

fn fixture() -> Fixture {
    let tmp = tempfile::tempdir().unwrap();
    let moe = tmp.path().join("moe");
    // moe_config: 6 experts, top-2, layers 0 and 2 sparse, layer 1 dense.
    make_model(&moe, &moe_config(), "BF16", 2);
    Fixture {
        dir: tmp.path().to_path_buf(),
        _tmp: tmp,
        moe,
    }
}

fn opts(model: &Path, out: PathBuf, cache: bool, force: Option<&Path>) -> TraceOptions {
    TraceOptions {
        model_dir: model.to_path_buf(),
        tokens: PROMPT.to_vec(),
        out,
        internals: true,
        generate: 3,
        cache,
        threads: 2,
        command_line: vec![],
        force_decisions: force.map(Path::to_path_buf),
        prompt_text: None,
        shards: None,
    }
}

fn trace(f: &Fixture, name: &str, cache: bool, force: Option<&Path>) -> Trace {
    let out = f.dir.join(name);
    run_trace(&opts(&f.moe, out.clone(), cache, force)).unwrap();
    Trace::open(out).unwrap()
}

fn values(t: &Trace, name: &str) -> Vec<i64> {
    t.decision_values(
        t.decision_info(name)
            .unwrap_or_else(|| panic!("no decision {name}")),
    )
}

fn margins(t: &Trace, name: &str) -> Vec<f32> {
    t.decision_margins(t.decision_info(name).unwrap()).unwrap()
}

/// A copy of `t` with `edit` applied to its decisions (values only; margins kept).
fn altered(t: &Trace, out: &Path, edit: impl Fn(&str, &mut Vec<i64>)) -> PathBuf {
    let mut w = TraceWriter::create(out, t.provenance().clone()).unwrap();
    for i in t.tensors() {
        w.tensor(&i.name, i.dtype, &i.shape, t.data(i), &i.attributes)
            .unwrap();
    }
    for d in t.decisions() {
        let mut v = t.decision_values(d);
        edit(&d.name, &mut v);
        w.decision(&d.name, &d.shape, &v, t.decision_margins(d).as_deref())
            .unwrap();
    }
    w.finish().unwrap();
    out.to_path_buf()
}

#[test]
fn forced_by_its_own_trace_computes_exactly_the_unforced_run() {
    let f = fixture();
    let own = trace(&f, "own.trace", true, None);
    for cache in [true, false] {
        let forced = trace(
            &f,
            &format!("forced-{cache}.trace"),
            cache,
            Some(own.path()),
        );
        let names: Vec<&str> = forced.tensors().iter().map(|i| i.name.as_str()).collect();
        assert_eq!(
            names,
            own.tensors()
                .iter()
                .map(|i| i.name.as_str())
                .collect::<Vec<_>>()
        );
        for (a, b) in own.tensors().iter().zip(forced.tensors()) {
            assert_eq!(own.data(a), forced.data(b), "{}", a.name);
        }
        for d in own.decisions() {
            assert_eq!(
                values(&forced, &d.name),
                values(&own, &d.name),
                "{}",
                d.name
            );
            let bits = |m: Vec<f32>| m.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(
                bits(margins(&forced, &d.name)),
                bits(margins(&own, &d.name)),
                "{}",
                d.name
            );
        }
        // The attribute starts right after layer 0's router decision: its expert outputs.
        let digest = own.digest().hex();
        let first = forced
            .tensors()
            .iter()
            .position(|i| i.attributes.extra.get("forced") == Some(&digest))
            .unwrap();
        assert!(
            forced.tensors()[first].name.starts_with("layer.00.expert."),
            "{}",
            forced.tensors()[first].name
        );
        assert!(forced.tensors()[first..]
            .iter()
            .all(|i| i.attributes.extra.get("forced") == Some(&digest)));
        assert!(forced.tensors()[..first]
            .iter()
            .all(|i| i.attributes.extra.is_empty()));
        assert!(own.tensors().iter().all(|i| i.attributes.extra.is_empty()));
        let rec = &forced.provenance()["forced_decisions"];
        assert_eq!(rec["trace_digest"], digest.as_str());
        assert_eq!(rec["rows_overridden"], 0);
        assert_eq!(rec["overridden"], serde_json::json!({}));
        assert_eq!(rec["overridden_rows"], serde_json::json!({}));
        let names: Vec<&str> = rec["decisions"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_str().unwrap())
            .collect();
        assert_eq!(
            names,
            [
                "layer.00.router.topk",
                "layer.02.router.topk",
                "logits.argmax",
                "decode.0000.argmax",
                "decode.0001.argmax",
                "decode.0002.argmax"
            ]
        );
        assert_ne!(forced.digest(), own.digest(), "the attribute is content");
    }
}

#[test]
fn forced_from_an_altered_trace_carries_the_altered_choices() {
    let f = fixture();
    let own = trace(&f, "own.trace", true, None);
    let before = values(&own, "layer.00.router.topk");
    // Row 2 of layer 0 goes to the two lowest experts it did not choose; decode step 1 is
    // another token.
    let (row, k) = (2usize, 2usize);
    let others: Vec<i64> = (0..6)
        .filter(|e| !before[row * k..row * k + k].contains(e))
        .take(2)
        .collect();
    let tok1 = values(&own, "decode.0001.argmax")[0];
    let alt = altered(&own, &f.dir.join("alt.trace"), |name, v| match name {
        "layer.00.router.topk" => v[row * k..row * k + k].copy_from_slice(&others),
        "decode.0001.argmax" => v[0] = (tok1 + 1) % 53,
        _ => {}
    });
    let forced = trace(&f, "forced.trace", true, Some(&alt));
    let after = values(&forced, "layer.00.router.topk");
    assert_eq!(after[row * k..row * k + k], others[..]);
    assert_eq!(
        [&after[..row * k], &after[row * k + k..]],
        [&before[..row * k], &before[row * k + k..]]
    );
    assert_eq!(values(&forced, "decode.0001.argmax"), [(tok1 + 1) % 53]);
    // The margin of the forced row is the engine's own for that choice: below the weakest
    // forced expert's probability lies an unchosen one's, so it is negative. Expected from the
    // recorded router logits, with a softmax of this test's own in f64.
    let g = own.f32_vec("layer.00.router.logits").unwrap();
    let g = &g[row * 6..row * 6 + 6];
    let mx = g.iter().cloned().fold(f32::NEG_INFINITY, f32::max) as f64;
    let z: f64 = g.iter().map(|&x| (x as f64 - mx).exp()).sum();
    let p: Vec<f64> = g.iter().map(|&x| (x as f64 - mx).exp() / z).collect();
    let weakest = others
        .iter()
        .map(|&e| p[e as usize])
        .fold(f64::INFINITY, f64::min);
    let strongest = (0..6)
        .filter(|e| !others.contains(e))
        .map(|e| p[e as usize])
        .fold(0.0, f64::max);
    let m = margins(&forced, "layer.00.router.topk")[row] as f64;
    assert!(
        m < 0.0 && (m - (weakest - strongest)).abs() < 1e-6,
        "{m} vs {}",
        weakest - strongest
    );
    let rec = &forced.provenance()["forced_decisions"];
    assert_eq!(rec["overridden"]["layer.00.router.topk"], 1, "{rec}");
    assert!(rec["overridden"]["decode.0001.argmax"] == 1, "{rec}");
    // Which rows: the bisection judges each by its own margin (docs/producers.md, "Recorded.").
    let rows = &rec["overridden_rows"];
    assert_eq!(
        rows["layer.00.router.topk"],
        serde_json::json!([row]),
        "{rec}"
    );
    assert_eq!(rows["decode.0001.argmax"], serde_json::json!([0]), "{rec}");
    // One list per count, as long as it; the total is theirs.
    let counts = rec["overridden"].as_object().unwrap();
    assert_eq!(rows.as_object().unwrap().len(), counts.len(), "{rec}");
    let mut total = 0;
    for (name, n) in counts {
        assert_eq!(
            rows[name].as_array().unwrap().len() as u64,
            n.as_u64().unwrap()
        );
        total += n.as_u64().unwrap();
    }
    assert_eq!(rec["rows_overridden"], total, "{rec}");
    // Numbers past the flip differ; before it they do not.
    assert_eq!(
        forced.data(forced.tensor_info("layer.00.router.logits").unwrap()),
        own.data(own.tensor_info("layer.00.router.logits").unwrap())
    );
    assert_ne!(
        forced.f32_vec("layer.00.mlp_out").unwrap(),
        own.f32_vec("layer.00.mlp_out").unwrap()
    );
    // Negative control: without forcing, the same run takes its own choices again.
    let again = trace(&f, "again.trace", true, None);
    assert_eq!(values(&again, "layer.00.router.topk"), before);
    assert_eq!(again.digest(), own.digest());
}

#[test]
fn the_layer_verb_takes_the_layers_router_rows_by_position() {
    let f = fixture();
    let own = trace(&f, "own.trace", true, None);
    let before = values(&own, "layer.02.router.topk");
    let alt = altered(&own, &f.dir.join("alt.trace"), |name, v| {
        if name == "layer.02.router.topk" {
            v.swap(0, 1); // row 0's experts in the other order
        }
    });
    let layer = |force: Option<&Path>, out: &str| {
        let out = f.dir.join(out);
        run_layer(&LayerOptions {
            model_dir: f.moe.clone(),
            layer: 2,
            input: own.path().to_path_buf(),
            input_name: "layer.02.hidden_in".into(),
            out: out.clone(),
            internals: false,
            threads: 1,
            command_line: vec![],
            force_decisions: force.map(Path::to_path_buf),
            decode_from: None,
        })
        .map(|_| Trace::open(out).unwrap())
    };
    let t = layer(Some(&alt), "l2.trace").unwrap();
    let v = values(&t, "layer.02.router.topk");
    assert_eq!(v[..2], [before[1], before[0]]);
    assert_eq!(v[2..], before[2..]);
    assert_eq!(
        t.provenance()["forced_decisions"]["overridden"]["layer.02.router.topk"],
        1
    );
    assert_eq!(
        t.provenance()["forced_decisions"]["overridden_rows"]["layer.02.router.topk"],
        serde_json::json!([0])
    );
    // Unforced: its own order again.
    assert_eq!(
        values(
            &layer(None, "l2-own.trace").unwrap(),
            "layer.02.router.topk"
        ),
        before
    );
    // A forcing decision without a row for every input position is refused.
    let short = f.dir.join("short.trace");
    let mut w = TraceWriter::create(&short, own.provenance().clone()).unwrap();
    w.decision("layer.02.router.topk", &[3, 2], &before[..6], None)
        .unwrap();
    w.finish().unwrap();
    let e = layer(Some(&short), "l2-short.trace")
        .err()
        .unwrap()
        .to_string();
    assert_eq!(e, format!("--force-decisions {}: decision layer.02.router.topk has 3 rows, the input holds position 3", short.display()));
}

/// The one-line refusal of a forced run, which names the forcing trace first.
fn refusal(o: TraceOptions) -> String {
    let e = run_trace(&o)
        .err()
        .unwrap_or_else(|| panic!("accepted {:?}", o.force_decisions))
        .to_string();
    assert_eq!(e.lines().count(), 1, "{e}");
    let path = o.force_decisions.unwrap();
    assert!(
        e.starts_with(&format!("--force-decisions {}: ", path.display())),
        "{e}"
    );
    e
}

#[test]
fn a_trace_that_cannot_serve_the_run_is_refused_naming_file_and_decision() {
    let f = fixture();
    let own = trace(&f, "own.trace", true, None);
    let out = f.dir.join("x.trace");
    let p = own.path();

    // A longer generation than the trace holds.
    let mut o = opts(&f.moe, out.clone(), true, Some(p));
    o.generate = 4;
    assert!(refusal(o).ends_with("decision decode.0003.argmax is missing (this run needs it)"));
    // Another prompt.
    let mut o = opts(&f.moe, out.clone(), true, Some(p));
    o.tokens[0] = 4;
    assert!(refusal(o)
        .contains("its prompt_tokens [3,17,5,0,42,17,9] are not this run's [4,17,5,0,42,17,9]"));
    // An expert id out of range, and one twice in a row.
    let bad = altered(&own, &f.dir.join("bad.trace"), |n, v| {
        if n == "layer.02.router.topk" {
            v[5] = 6
        }
    });
    assert!(refusal(opts(&f.moe, out.clone(), true, Some(&bad)))
        .ends_with("decision layer.02.router.topk row 2: value 6 outside [0, 6)"));
    let twice = altered(&own, &f.dir.join("twice.trace"), |n, v| {
        if n == "layer.00.router.topk" {
            v[1] = v[0]
        }
    });
    assert!(refusal(opts(&f.moe, out.clone(), true, Some(&twice)))
        .contains("decision layer.00.router.topk row 0: value"));
    // Another checkpoint of the same config.
    let other = f.dir.join("other");
    make_model(&other, &moe_config(), "BF16", 3);
    let e = refusal(TraceOptions {
        model_dir: other,
        ..opts(&f.moe, out.clone(), true, Some(p))
    });
    assert!(
        e.contains("its weights_digest ") && e.contains("is not this run's"),
        "{e}"
    );
    assert!(!out.exists(), "a refused run writes nothing");

    // The CLI: exit 2, one line.
    let o = std::process::Command::new(env!("CARGO_BIN_EXE_engine"))
        .args(["trace", "--model"])
        .arg(&f.moe)
        .args(["--tokens", "3,17,5,0,42,17,9", "--generate", "4", "--out"])
        .arg(&out)
        .arg("--force-decisions")
        .arg(p)
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(2));
    let err = String::from_utf8(o.stderr).unwrap();
    assert_eq!(err.lines().count(), 1, "{err}");
    assert!(
        err.contains("decode.0003.argmax") && err.contains(&p.display().to_string()),
        "{err}"
    );
}
