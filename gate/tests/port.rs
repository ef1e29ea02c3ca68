//! Gate your own engine (docs/gate.md, "Gate your own engine"): `gate init` in a user's own
//! directory outside the checkout, with `examples/producer` as the user's port, records golden
//! oracle traces; `gate run port` then judges the port against them with no torch. Negative
//! controls: a planted k_norm defect fails `agrees` and is localised at layer 03 stage k; a
//! cached-decode defect that leaves the first tokens alone fails `generation`; an edited,
//! swapped or missing golden trace is refused; a deterministic candidate whose digest moves
//! fails `stable`.

use crate::common;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, OnceLock};

use serde_json::Value;

use common::repo;

/// The user's port: the example producer, built beside the gate (`cargo build --release --bins`).
fn example_producer() -> PathBuf {
    common::sibling("example-producer")
}

fn port_cmd(extra: &str) -> String {
    format!(
        "'{}' {{verb}} {{args}}{extra}",
        example_producer().display()
    )
}

/// A Python that cannot import torch: the oracle is unavailable to it.
fn torchless(dir: &Path) -> PathBuf {
    let block = dir.join("block");
    std::fs::create_dir_all(&block).unwrap();
    std::fs::write(block.join("torch.py"), "raise ImportError('blocked')\n").unwrap();
    block
}

pub(crate) struct Out {
    pub(crate) code: i32,
    pub(crate) stdout: String,
    pub(crate) stderr: String,
}

pub(crate) fn gate(dir: &Path, args: &[&str], env: &[(&str, &str)]) -> Out {
    let mut cmd = common::gate();
    cmd.current_dir(dir).args(args).env_remove("GITHUB_ACTIONS");
    for (k, v) in env {
        cmd.env(k, v);
    }
    let out = cmd.output().unwrap();
    Out {
        code: out.status.code().unwrap_or(-1),
        stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
    }
}

const PROMPTS: &str = r#"{"schema": 1, "about": "two prompts of a port's own", "prompts": [
  {"id": "short", "tokens": [12, 218, 345, 152, 81]},
  {"id": "mid", "tokens": [438, 493, 24, 203, 157, 369, 394, 425, 82, 100, 321]}]}"#;

/// A user's project in a temp directory outside the checkout: the model and a prompt file,
/// initialised with `gate init … extra` (exit 0 expected). Each test gets its own copy, to edit
/// as it likes, of one project `gate init` made for `extra` in this test binary: each init is
/// a torch start-up and every reference run, and the tests of init itself call `init_with`.
pub(crate) fn project(extra: &[&str]) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    common::copy_dir(&initialised(extra), dir.path());
    dir
}

/// The project `gate init … extra` made, once per test binary and `extra` (tests asking for
/// another `extra` meanwhile do not wait for it); removed when the test binary exits.
fn initialised(extra: &[&str]) -> PathBuf {
    type Made = Mutex<BTreeMap<Vec<String>, Arc<OnceLock<PathBuf>>>>;
    static MADE: Made = Mutex::new(BTreeMap::new());
    static KEPT: Mutex<Vec<PathBuf>> = Mutex::new(Vec::new());
    extern "C" fn remove_kept() {
        if let Ok(kept) = KEPT.lock() {
            for d in kept.iter() {
                let _ = std::fs::remove_dir_all(d);
            }
        }
    }
    let key = extra.iter().map(|a| a.to_string()).collect();
    let cell = MADE.lock().unwrap().entry(key).or_default().clone();
    cell.get_or_init(|| {
        let (dir, out) = init_with(&port_cmd(""), extra);
        assert_eq!(out.code, 0, "{}\n{}", out.stdout, out.stderr);
        let mut kept = KEPT.lock().unwrap();
        if kept.is_empty() {
            // Statics are never dropped: the kept directories go when the process exits.
            // SAFETY: `remove_kept` is a plain function that neither unwinds nor exits.
            unsafe { libc::atexit(remove_kept) };
        }
        kept.push(dir.keep());
        kept.last().unwrap().clone()
    })
    .clone()
}

/// `gate init` of a new project with candidate `cmd`, and what it said.
fn init_with(cmd: &str, extra: &[&str]) -> (tempfile::TempDir, Out) {
    let dir = tempfile::tempdir().unwrap();
    assert!(!dir.path().starts_with(repo().canonicalize().unwrap()));
    common::copy_dir(
        &repo().join("fixtures/tiny-qwen3"),
        &dir.path().join("model"),
    );
    std::fs::write(dir.path().join("my-prompts.json"), PROMPTS).unwrap();
    // The project's own Python environment, without tracegate: the gate must use its own.
    let decoy = dir.path().join(".venv/bin/python");
    std::fs::create_dir_all(decoy.parent().unwrap()).unwrap();
    std::fs::write(
        &decoy,
        "#!/bin/sh\necho 'the project .venv was used' >&2\nexit 3\n",
    )
    .unwrap();
    let mut perm = std::fs::metadata(&decoy).unwrap().permissions();
    std::os::unix::fs::PermissionsExt::set_mode(&mut perm, 0o755);
    std::fs::set_permissions(&decoy, perm).unwrap();
    let mut args = vec![
        "init",
        "--model",
        "model",
        "--candidate-cmd",
        cmd,
        "--prompts",
        "my-prompts.json",
        "--generate",
        "4",
    ];
    args.extend(extra);
    let out = gate(dir.path(), &args, &[]);
    (dir, out)
}

pub(crate) fn report(path: &Path) -> Value {
    let r: Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    for rep in r.as_array().unwrap() {
        common::validator("gate-report.schema.json").assert_valid(rep);
    }
    r[0].clone()
}

pub(crate) fn milestones(dir: &Path) -> Value {
    serde_json::from_str(&std::fs::read_to_string(dir.join("milestones.json")).unwrap()).unwrap()
}

/// The port milestone's candidate command, replaced (a planted defect appended).
pub(crate) fn set_candidate(dir: &Path, cmd: &str) {
    let mut m = milestones(dir);
    m["milestones"][0]["port"]["candidate"]["cmd"] = Value::String(cmd.into());
    std::fs::write(
        dir.join("milestones.json"),
        serde_json::to_string_pretty(&m).unwrap(),
    )
    .unwrap();
}

fn statuses(r: &Value) -> Vec<(String, String, String)> {
    r["prompts"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|p| {
            p["checks"].as_array().unwrap().iter().map(move |c| {
                (
                    p["id"].as_str().unwrap().to_string(),
                    c["check"].as_str().unwrap().to_string(),
                    c["status"].as_str().unwrap().to_string(),
                )
            })
        })
        .collect()
}

#[test]
fn init_records_golden_traces_and_run_passes_without_torch() {
    let dir = project(&["--capture", "internals"]);
    let d = dir.path();
    let m = milestones(d);
    let ms = &m["milestones"][0];
    assert_eq!(ms["id"], "port");
    assert_eq!(ms["prompts"]["set"], "my-prompts.json");
    assert_eq!(ms["policy"], "f32", "the example producer computes in f32");
    assert_eq!(ms["port"]["candidate"]["cache_off"], true);
    // Each golden trace is the oracle's (transformers' own class), recorded as it was digested.
    for id in ["short", "mid"] {
        let g = &ms["port"]["golden"][id];
        assert_eq!(g["trace"], format!("golden/{id}.trace"));
        let t = tracegate_trace::Trace::open(d.join(g["trace"].as_str().unwrap())).unwrap();
        t.verify().unwrap();
        assert_eq!(t.digest().hex(), g["digest"].as_str().unwrap());
        assert_eq!(t.provenance()["producer"], "oracle");
        assert!(t.provenance()["versions"]["transformers"].is_string());
        assert_eq!(g["generated"].as_array().unwrap().len(), 4);
    }
    let baselines: Value =
        serde_json::from_str(&std::fs::read_to_string(d.join("baselines.json")).unwrap()).unwrap();
    assert_eq!(baselines["baselines"].as_array().unwrap().len(), 2);
    // The run: no torch anywhere (the oracle's Python cannot import it).
    let block = torchless(d);
    let rp = d.join("r.json");
    let out = gate(
        d,
        &["run", "port", "--report", rp.to_str().unwrap()],
        &[
            ("PYTHONPATH", block.to_str().unwrap()),
            ("TRACEGATE_PYTHON", "/nonexistent/python"),
        ],
    );
    assert_eq!(out.code, 0, "{}\n{}", out.stdout, out.stderr);
    let r = report(&rp);
    let got = statuses(&r);
    let want: Vec<(String, String, String)> = ["short", "mid"]
        .iter()
        .flat_map(|p| {
            ["agrees", "generation", "generation_reference"]
                .map(|c| (p.to_string(), c.to_string(), "PASS".to_string()))
        })
        .collect();
    assert_eq!(got, want);
    assert_eq!(r["totals"]["PASS"], 8, "6 checks and 2 baselines");
    assert_eq!(r["verdict"], "PASS");
    // Not deterministic by declaration: the digest is an observation, not a check.
    assert!(r["prompts"][0]["observations"][0]
        .as_str()
        .unwrap()
        .contains("not a check"));
    assert!(r["prompts"][0]["localised"].is_null());
}

#[test]
fn a_planted_k_norm_defect_fails_agrees_and_is_localised_at_layer_03_stage_k() {
    let dir = project(&["--capture", "internals", "--deterministic"]);
    let d = dir.path();
    set_candidate(d, &port_cmd(" --plant k-norm:3"));
    let page = d.join("r.html");
    let (out, r) = run_short_with(d, 1, &["--html", page.to_str().unwrap()], &[]);
    let p = &r["prompts"][0];
    let check = |name: &str| {
        p["checks"]
            .as_array()
            .unwrap()
            .iter()
            .find(|c| c["check"] == name)
            .unwrap_or_else(|| panic!("no {name}: {p}"))
            .clone()
    };
    assert_eq!(check("agrees")["status"], "FAIL");
    // Declared deterministic: its moved digest is a failed claim.
    assert_eq!(check("stable")["status"], "FAIL");
    assert_eq!(check("stable")["findings"][0]["kind"], "digest_changed");
    let l = &p["localised"];
    assert_eq!(l["verdict"], "wrong_layer", "{l}");
    assert_eq!(l["first_wrong_layer"], 3, "{l}");
    assert_eq!(l["stage"]["tensor"], "layer.03.k", "{l}");
    assert!(d.join(l["report"].as_str().unwrap()).is_file());
    assert!(
        out.stdout
            .contains("localised by gate bisect against the golden trace: layer 03"),
        "{}",
        out.stdout
    );
    // The page says it too, its layer tied to the report's number.
    let html = std::fs::read_to_string(&page).unwrap();
    assert!(
        html.contains("id=\"localised-0\"")
            && html.contains("data-json=\"/prompts/0/localised/first_wrong_layer\"")
            && html.contains("<code>layer.03.k</code>")
            && html.contains("<th>candidate digest</th>"),
        "{html}"
    );
    // The repro capsule of layer 03, named with the command that replays it, everywhere the
    // localisation is told (text, JSON, page); that command fails the planted port as
    // recorded, and the same capsule passes the unplanted one.
    let c = &l["capsule"];
    assert_eq!(c["written"], true, "{l}");
    assert_eq!(c["stage"], "layer.03.k", "{l}");
    let path = c["path"].as_str().unwrap();
    let replay = c["replay"].as_str().unwrap();
    assert!(d.join(path).join("manifest.json").is_file(), "{l}");
    assert!(
        out.stdout
            .contains(&format!("; capsule {path}, replay: {replay}")),
        "{}",
        out.stdout
    );
    assert!(html.contains("id=\"capsule-0\""), "{html}");
    let (code, text) = replay_capsule(d, replay);
    assert_eq!(code, 1, "{text}");
    assert!(
        text.contains("layer 03 body is wrong") && text.contains("as recorded"),
        "{text}"
    );
    let clean = format!(
        "gate capsule run {path} --candidate-cmd \"'{}' {{verb}} {{args}}\"",
        example_producer().display()
    );
    let (code, text) = replay_capsule(d, &clean);
    assert_eq!(code, 0, "{text}");
}

/// A report's replay command (`gate capsule run …`), run by the shell in the project `d` with
/// the gate under test for `gate`: exit code and output.
fn replay_capsule(d: &Path, command: &str) -> (i32, String) {
    let rest = command.strip_prefix("gate ").expect(command);
    let gate = env!("CARGO_BIN_EXE_gate");
    let out = std::process::Command::new("sh")
        .arg("-c")
        .arg(format!("'{gate}' {rest}"))
        .current_dir(d)
        .env("TRACEGATE_RESIDENT", "0")
        .output()
        .unwrap();
    common::code_and_output(&out)
}

/// A port whose whole run alone is wrong (tests/producers/whole_run_only.py): its `trace` verb
/// loads layer 2's feed-forward norm from the last block, its `layer` verb loads the one layer
/// it runs, correctly.
fn whole_run_only_cmd() -> String {
    format!(
        "'{}' '{}' {{verb}} {{args}}",
        common::python().display(),
        repo()
            .join("gate/tests/producers/whole_run_only.py")
            .display()
    )
}

/// The line that names it: the port's layer verb against its own whole run.
const WHOLE_RUN_ONLY: &str = "the layer verb disagrees with the whole run at layer 02";

/// Issue 52: layer 02's input agrees with the golden trace and its output does not, while the
/// layer verb (which does not have the defect) matches the golden trace there. `gate run port`
/// said "no layer body is wrong; the divergence accumulates" with layer 02 "inherits"; its
/// localisation must run the self-check and name the layer verb disagreeing with the whole run.
/// And that line comes first: in the text output, the JUnit failure message, the ::error
/// annotation and the HTML page.
#[test]
fn a_whole_run_only_defect_is_named_by_the_localisation_which_comes_first_everywhere() {
    let dir = project(&[]);
    let d = dir.path();
    set_candidate(d, &whole_run_only_cmd());
    let (page, junit) = (d.join("r.html"), d.join("j.xml"));
    let (out, r) = run_short_with(
        d,
        1,
        &[
            "--html",
            page.to_str().unwrap(),
            "--junit",
            junit.to_str().unwrap(),
        ],
        &[("GITHUB_ACTIONS", "true")],
    );
    let l = &r["prompts"][0]["localised"];
    assert_eq!(l["verdict"], "inconsistent_producer", "{l}");
    assert!(l["first_wrong_layer"].is_null(), "{l}");
    let summary = l["summary"].as_str().unwrap();
    assert!(summary.starts_with(WHOLE_RUN_ONLY), "{summary}");
    assert!(
        summary.contains("layer 02's input agrees with the reference"),
        "{summary}"
    );
    let bisected: Value = serde_json::from_str(
        &std::fs::read_to_string(d.join(l["report"].as_str().unwrap())).unwrap(),
    )
    .unwrap();
    assert_eq!(bisected["self_consistency"]["inconsistent"]["layer"], 2);
    assert_eq!(bisected["layers"][2]["status"], "inconsistent");
    // No layer body is wrong: no capsule, and the line says why.
    assert_eq!(l["capsule"]["written"], false, "{l}");
    assert!(!walk(d).iter().any(|p| p.ends_with("capsule/manifest.json")));
    assert!(
        out.stdout.contains("; capsule NOT WRITTEN: the bisection names no wrong layer, at the prefill or a decode step (verdict inconsistent_producer)"),
        "{}",
        out.stdout
    );

    // Text: the localisation before the table and every check's detail and finding.
    let lines: Vec<&str> = out.stdout.lines().collect();
    let at = |pred: &dyn Fn(&str) -> bool| lines.iter().position(|l| pred(l));
    let loc = at(&|l: &str| l.contains("localised by gate bisect")).expect("no localisation");
    assert!(lines[loc].starts_with("short: localised by gate bisect against the golden trace: the layer verb disagrees with the whole run at layer 02"), "{}", out.stdout);
    let table = at(&|l: &str| l.starts_with("prompt ")).unwrap();
    let detail = at(&|l: &str| l.starts_with("short/agrees FAIL")).unwrap();
    let finding = at(&|l: &str| l.starts_with("    finding")).unwrap();
    assert!(
        loc < table && loc < detail && loc < finding,
        "{}",
        out.stdout
    );
    // Said once in the text (the annotations, after it, are their own view).
    let said = |l: &&&str| !l.starts_with("::") && l.contains("localised by gate bisect");
    assert_eq!(lines.iter().filter(said).count(), 1, "{}", out.stdout);

    // JUnit: the agrees case's failure message opens with it.
    let xml = std::fs::read_to_string(&junit).unwrap();
    let case = &xml[xml.find("name=\"agrees\"").expect("an agrees case")..];
    let message = &case[case.find("message=\"").unwrap() + 9..];
    assert!(
        message.starts_with(&format!(
            "localised by gate bisect against the golden trace: {WHOLE_RUN_ONLY}"
        )),
        "{xml}"
    );

    // The ::error annotation of agrees opens with it.
    let error = lines
        .iter()
        .find(|l| l.starts_with("::error ") && l.contains("short/agrees%3A FAIL::"))
        .unwrap_or_else(|| panic!("no agrees annotation: {}", out.stdout));
    assert!(
        error.contains(&format!("short/agrees%3A FAIL::localised by gate bisect against the golden trace: {WHOLE_RUN_ONLY}")),
        "{error}"
    );

    // The page: the localisation before the checks table and the findings.
    let html = std::fs::read_to_string(&page).unwrap();
    let pos = |s: &str| html.find(s).unwrap_or_else(|| panic!("no {s} in {html}"));
    assert!(
        pos("id=\"localised-0\"") < pos("id=\"milestone-table\""),
        "{html}"
    );
    assert!(
        pos("id=\"localised-0\"") < pos("<h2>Findings</h2>"),
        "{html}"
    );
    assert!(html.contains(WHOLE_RUN_ONLY), "{html}");
}

/// Issue 52: `gate bisect --reference trace:golden/X.trace` on the golden traces `gate init`
/// writes by default (default capture, decode steps) was refused whatever the flags (its
/// --generate implied internals). It bisects with what they hold: layer boundaries, and a decode
/// step named by its logits, its layers said NOT CHECKED for want of internals; asking
/// --capture internals of such a trace is refused naming both.
#[test]
fn gate_bisect_runs_from_the_default_golden_traces_with_what_they_hold() {
    let dir = project(&[]);
    let d = dir.path();
    let bisect = |candidate: &str, extra: &[&str], report: &str| {
        let mut args = vec![
            "bisect",
            "--model",
            "model",
            "--reference",
            "trace:golden/short.trace",
            "--candidate",
            "cmd",
            "--candidate-cmd",
            candidate,
            "--work",
            report,
            "--report",
        ];
        let rp = format!("{report}.json");
        args.push(&rp);
        args.extend(extra);
        let out = gate(d, &args, &[]);
        let r: Value = serde_json::from_str(&std::fs::read_to_string(d.join(&rp)).unwrap())
            .unwrap_or_else(|e| panic!("{e}: {}\n{}", out.stdout, out.stderr));
        (out, r)
    };
    // The whole-run-only defect, from the prefill's layer boundaries.
    let (out, r) = bisect(&whole_run_only_cmd(), &[], "whole");
    assert_eq!(out.code, 1, "{}\n{}", out.stdout, out.stderr);
    common::assert_valid_bisect_report(&r);
    assert_eq!(r["verdict"], "inconsistent_producer", "{}", out.stdout);
    assert!(
        r["summary"].as_str().unwrap().starts_with(WHOLE_RUN_ONLY),
        "{}",
        out.stdout
    );
    assert_eq!(r["capture"], "default");
    // A cached-decode defect: the step is named, the cache self-check runs, and the isolation
    // at that step says what it would need.
    let (out, r) = bisect(&port_cmd(" --plant decode-pos"), &[], "decode");
    assert_eq!(out.code, 6, "{}\n{}", out.stdout, out.stderr);
    assert_eq!(r["verdict"], "cached_decode_differs", "{}", out.stdout);
    assert_eq!(r["decode"]["first_diverging_step"], 1, "{}", out.stdout);
    let why = r["decode"]["isolation_not_checked"]
        .as_str()
        .unwrap_or_default();
    assert!(
        why.contains("--capture default") && why.contains("gate init --capture internals"),
        "{}",
        out.stdout
    );
    // Negative control: internals asked of a trace without them is refused, naming both.
    let (out, r) = bisect(
        &whole_run_only_cmd(),
        &["--capture", "internals"],
        "refused",
    );
    assert_eq!(out.code, 2, "{}\n{}", out.stdout, out.stderr);
    assert_eq!(r["verdict"], "refused");
    let said = r["summary"].as_str().unwrap();
    assert!(
        said.contains("recorded with --capture default, this bisection asks --capture internals"),
        "{said}"
    );
}

#[test]
fn a_cached_decode_defect_fails_generation_though_the_first_tokens_agree() {
    let dir = project(&[]);
    let d = dir.path();
    set_candidate(d, &port_cmd(" --plant decode-pos"));
    let gen = failing_check(d, "generation");
    assert_fails_at(&gen, "decode.0001.logits", Some("outside_policy"));
}

#[test]
fn a_candidate_without_an_uncached_path_leaves_generation_not_checked() {
    // The port refuses `--cache off` (exit 2), as a producer that has only a cached path would.
    let cmd = format!(
        "sh -c 'case \"$*\" in *\"--cache off\"*) echo no uncached path >&2; exit 2;; esac; exec \"$0\" \"$@\"' '{}' {{verb}} {{args}}",
        example_producer().display()
    );
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    std::fs::write(d.join("p.json"), PROMPTS).unwrap();
    let model = repo().join("fixtures/tiny-qwen3");
    let out = gate(
        d,
        &[
            "init",
            "--model",
            model.to_str().unwrap(),
            "--candidate-cmd",
            &cmd,
            "--prompts",
            "p.json",
            "--generate",
            "2",
        ],
        &[],
    );
    assert_eq!(out.code, 4, "{}\n{}", out.stdout, out.stderr);
    assert!(out.stdout.contains("does not answer `trace --cache off`"));
    assert_eq!(
        milestones(d)["milestones"][0]["port"]["candidate"]["cache_off"],
        false
    );
    let rp = d.join("r.json");
    let out = gate(d, &["run", "port", "--report", rp.to_str().unwrap()], &[]);
    assert_eq!(out.code, 4, "NOT CHECKED is not a pass: {}", out.stdout);
    let r = report(&rp);
    let gens: Vec<&Value> = r["prompts"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|p| p["checks"].as_array().unwrap())
        .filter(|c| c["check"] == "generation")
        .collect();
    assert_eq!(gens.len(), 2);
    assert!(gens.iter().all(|c| c["status"] == "NOT CHECKED"));
}

#[test]
fn an_edited_swapped_or_missing_golden_trace_is_refused() {
    let dir = project(&[]);
    let d = dir.path();
    let short = d.join("golden/short.trace");
    let kept = std::fs::read(&short).unwrap();
    // One bit of a tensor's payload.
    let mut bytes = kept.clone();
    bytes[4096] ^= 1;
    std::fs::write(&short, &bytes).unwrap();
    let out = gate(d, &["run", "port"], &[]);
    assert_eq!(out.code, 2, "{}\n{}", out.stdout, out.stderr);
    assert!(
        out.stderr.contains("golden trace golden/short.trace") && out.stderr.contains("--bless"),
        "{}",
        out.stderr
    );
    // A whole valid trace in its place: another prompt's.
    std::fs::copy(d.join("golden/mid.trace"), &short).unwrap();
    let out = gate(d, &["run", "port"], &[]);
    assert_eq!(out.code, 2, "{}", out.stderr);
    assert!(
        out.stderr.contains("differs from milestones.json's record"),
        "{}",
        out.stderr
    );
    std::fs::remove_file(&short).unwrap();
    let out = gate(d, &["run", "port"], &[]);
    assert_eq!(out.code, 2, "{}", out.stderr);
    assert!(
        out.stderr.contains("golden trace golden/short.trace"),
        "{}",
        out.stderr
    );
    // Negative control: the file as recorded runs.
    std::fs::write(&short, &kept).unwrap();
    let out = gate(d, &["run", "port"], &[]);
    assert_eq!(out.code, 0, "{}\n{}", out.stdout, out.stderr);
    // The model's weights changed under golden traces that are intact: refused, named once.
    let weights = d.join("model/model.safetensors");
    let mut w = std::fs::read(&weights).unwrap();
    let last = w.len() - 1;
    w[last] ^= 1;
    std::fs::write(&weights, &w).unwrap();
    let out = gate(d, &["run", "port"], &[]);
    assert_eq!(out.code, 2, "{}\n{}", out.stdout, out.stderr);
    assert!(out.stderr.contains("its weights changed"), "{}", out.stderr);
    // A FIFO in its place (issue 51): the weights check read it outside --timeout and waited for
    // a writer forever. Refused in one line before anything runs; a hang is killed at 120 s.
    std::fs::remove_file(&weights).unwrap();
    let made = std::process::Command::new("mkfifo")
        .arg(&weights)
        .status()
        .unwrap();
    assert!(made.success());
    let mut cmd = common::gate();
    cmd.current_dir(d)
        .args(["run", "port", "--timeout", "5"])
        .env_remove("GITHUB_ACTIONS")
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped());
    let mut child = cmd.spawn().unwrap();
    let start = std::time::Instant::now();
    while child.try_wait().unwrap().is_none() {
        if start.elapsed() > std::time::Duration::from_secs(120) {
            child.kill().unwrap();
            child.wait().unwrap();
            panic!("gate run port waited on a FIFO weights file");
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    let out = child.wait_with_output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    let lines: Vec<&str> = stderr.lines().collect();
    assert_eq!(lines.len(), 1, "{stderr}");
    assert!(
        lines[0].contains("model/model.safetensors: a FIFO, not a regular file"),
        "{stderr}"
    );
}

#[test]
fn bless_re_records_a_changed_prompt_and_prints_what_changed() {
    let dir = project(&[]);
    let d = dir.path();
    let before = milestones(d);
    std::fs::write(
        d.join("my-prompts.json"),
        PROMPTS.replace("[12, 218, 345, 152, 81]", "[12, 218, 345, 152, 82]"),
    )
    .unwrap();
    let out = gate(d, &["run", "port"], &[]);
    assert_eq!(
        out.code, 2,
        "a changed prompt file is refused: {}",
        out.stdout
    );
    assert!(out.stderr.contains("--bless"), "{}", out.stderr);
    let out = gate(d, &["run", "port", "--bless"], &[]);
    assert_eq!(out.code, 0, "{}\n{}", out.stdout, out.stderr);
    assert!(
        out.stdout.contains("port: prompts sha256"),
        "{}",
        out.stdout
    );
    let after = milestones(d);
    let golden = |m: &Value, id: &str| m["milestones"][0]["port"]["golden"][id]["digest"].clone();
    assert_ne!(golden(&before, "short"), golden(&after, "short"));
    assert_eq!(golden(&before, "mid"), golden(&after, "mid"));
    assert!(
        out.stdout.contains("port/short: golden trace")
            && out.stdout.contains("port/mid: golden trace unchanged"),
        "{}",
        out.stdout
    );
    let out = gate(d, &["run", "port"], &[]);
    assert_eq!(out.code, 0, "{}\n{}", out.stdout, out.stderr);
}

#[test]
fn init_refuses_what_it_cannot_gate_in_one_line() {
    let dir = project(&[]);
    let d = dir.path();
    let cmd = port_cmd("");
    let refused = |args: &[&str], says: &str| {
        let mut all = vec!["init", "--candidate-cmd", &cmd];
        all.extend(args);
        let out = gate(d, &all, &[]);
        assert_eq!(out.code, 2, "{all:?}: {}", out.stderr);
        assert!(out.stderr.contains(says), "{all:?}: {}", out.stderr);
        assert_eq!(out.stderr.trim().lines().count(), 1, "{}", out.stderr);
    };
    refused(&["--model", "model"], "already holds milestones.json");
    let fresh = tempfile::tempdir().unwrap();
    let f = fresh.path().to_str().unwrap();
    refused(&["--root", f, "--model", "nowhere"], "nowhere");
    let too_big = fresh.path().join("big.json");
    std::fs::write(
        &too_big,
        r#"{"schema": 1, "prompts": [{"id": "a", "tokens": [1, 100000]}]}"#,
    )
    .unwrap();
    refused(
        &[
            "--root",
            f,
            "--model",
            "model",
            "--prompts",
            too_big.to_str().unwrap(),
        ],
        "token id 100000",
    );
    refused(
        &["--root", f, "--model", "model", "--reference", "cmd"],
        "--reference cmd needs --reference-cmd",
    );
    // Nothing was written by any refusal.
    assert_eq!(std::fs::read_dir(fresh.path()).unwrap().count(), 1);
}

/// An executable shell script `name` in `dir` with body `body`.
fn script(dir: &Path, name: &str, body: &str) -> PathBuf {
    let p = dir.join(name);
    std::fs::write(&p, format!("#!/bin/sh\n{body}\n")).unwrap();
    let mut perm = std::fs::metadata(&p).unwrap().permissions();
    std::os::unix::fs::PermissionsExt::set_mode(&mut perm, 0o755);
    std::fs::set_permissions(&p, perm).unwrap();
    p
}

/// Issue 52: `gate init` and `--bless` ran the reference on every prompt (minutes of torch on a
/// real model) before the candidate was tried once. An unstartable candidate — not there, not
/// executable, exiting non-zero — is now refused before the reference runs: the reference here
/// is a command that leaves a mark when it runs, and leaves none. Negative control: with a
/// working candidate the same reference runs (and leaves its mark).
#[test]
fn an_unstartable_candidate_is_refused_before_the_reference_runs() {
    let marks = tempfile::tempdir().unwrap();
    let mark = marks.path().join("reference-ran");
    let reference = script(
        marks.path(),
        "reference.sh",
        &format!("echo ran >> '{}'\nexit 1", mark.display()),
    );
    let reference_cmd = format!("'{}' {{verb}} {{args}}", reference.display());
    let with_reference = ["--reference", "cmd", "--reference-cmd", &reference_cmd];
    let not_executable = marks.path().join("port.sh");
    std::fs::write(&not_executable, "#!/bin/sh\nexit 0\n").unwrap();
    let exits_3 = script(
        marks.path(),
        "bad.sh",
        "echo 'my-port: cannot load weights' >&2\nexit 3",
    );
    for (cmd, says) in [
        ("./my-port {verb} {args}".to_string(), "./my-port"),
        (
            format!("'{}' {{verb}} {{args}}", not_executable.display()),
            "port.sh",
        ),
        (
            format!("'{}' {{verb}} {{args}}", exits_3.display()),
            "my-port: cannot load weights",
        ),
    ] {
        let (dir, out) = init_with(&cmd, &with_reference);
        assert_eq!(out.code, 2, "{cmd}: {}\n{}", out.stdout, out.stderr);
        assert!(
            out.stderr.contains(
                "the candidate, tried once on prompt \"short\" before the reference runs"
            ) && out.stderr.contains(says)
                && out.stderr.contains("nothing was recorded"),
            "{cmd}: {}",
            out.stderr
        );
        assert!(!mark.exists(), "{cmd}: the reference ran: {}", out.stderr);
        assert!(!dir.path().join("milestones.json").exists());
    }
    // Negative control: a candidate that runs is followed by the reference.
    let (_dir, out) = init_with(&port_cmd(""), &with_reference);
    assert_eq!(out.code, 2, "{}", out.stderr);
    assert!(
        out.stderr.contains("the reference failed"),
        "{}",
        out.stderr
    );
    assert!(mark.exists(), "{}", out.stderr);
    // `--bless` of a project: the oracle (its Python, here a command that leaves a mark) is not
    // run for a candidate that cannot start.
    let _ = std::fs::remove_file(&mark);
    let dir = project(&[]);
    let d = dir.path();
    set_candidate(d, &format!("'{}' {{verb}} {{args}}", exits_3.display()));
    let oracle_python = script(
        marks.path(),
        "python",
        &format!("echo ran >> '{}'\nexit 1", mark.display()),
    );
    let out = gate(
        d,
        &["run", "port", "--bless"],
        &[("TRACEGATE_ORACLE_PYTHON", oracle_python.to_str().unwrap())],
    );
    assert_eq!(out.code, 2, "{}\n{}", out.stdout, out.stderr);
    assert!(
        out.stderr.contains("my-port: cannot load weights") && !mark.exists(),
        "{}",
        out.stderr
    );
}

/// The adversary port (tests/producers/port_adversary.py): the example producer with its trace
/// rewritten by TraceWriter.
fn adversary(edits: &str) -> String {
    format!(
        "'{}' '{}' --exe '{}' {edits} {{verb}} {{args}}",
        repo().join(".venv/bin/python").display(),
        repo()
            .join("gate/tests/producers/port_adversary.py")
            .display(),
        example_producer().display()
    )
}

/// `check` FAILed with a finding about `name` (of `kind`, when given).
fn assert_fails_at(check: &Value, name: &str, kind: Option<&str>) {
    assert_eq!(check["status"], "FAIL", "{check}");
    assert!(
        check["findings"]
            .as_array()
            .unwrap()
            .iter()
            .any(|f| f["name"] == name && kind.is_none_or(|k| f["kind"] == k)),
        "{check}"
    );
}

/// `gate run port --only short --report r.json`, which must exit `code`: its output and report.
fn run_short(d: &Path, code: i32) -> (Out, Value) {
    run_short_with(d, code, &[], &[])
}

/// `run_short` with more arguments and environment.
fn run_short_with(d: &Path, code: i32, extra: &[&str], env: &[(&str, &str)]) -> (Out, Value) {
    let rp = d.join("r.json");
    let mut args = vec![
        "run",
        "port",
        "--only",
        "short",
        "--report",
        rp.to_str().unwrap(),
    ];
    args.extend(extra);
    let out = gate(d, &args, env);
    assert_eq!(out.code, code, "{}\n{}", out.stdout, out.stderr);
    (out, report(&rp))
}

/// `gate run port --only short`, which must fail (exit 1): its check `name`.
fn failing_check(d: &Path, name: &str) -> Value {
    common::check(&run_short(d, 1).1, name).clone()
}

#[test]
fn a_decode_step_left_out_of_the_uncached_run_fails_generation() {
    let dir = project(&[]);
    let d = dir.path();
    // Negative control: the adversary with no edit passes.
    set_candidate(d, &adversary(""));
    run_short(d, 0);
    // The same tokens, and the cached trace as clean as ever; the uncached one lacks a step's
    // logits, so a comparison of what both hold would see no difference.
    set_candidate(d, &adversary("--when off --drop decode.0001.logits"));
    let gen = failing_check(d, "generation");
    assert_fails_at(&gen, "decode.0001.logits", None);
}

/// The example producer behind a shell that rewrites the value after `flag` by the shell
/// assignment `assign` (of `a`, the value).
fn rewriting(flag: &str, assign: &str) -> String {
    format!(
        "sh -c 'p=; for a; do shift; if [ \"$p\" = {flag} ]; then {assign}; fi; set -- \"$@\" \"$a\"; p=$a; done; exec \"$0\" \"$@\"' '{}' {{verb}} {{args}}",
        example_producer().display()
    )
}

/// Every `--cache off` turned into `--cache on`: a port that ignores `--cache off`, as one
/// without an uncached path that accepts the flag would.
fn ignores_cache_off() -> String {
    rewriting("--cache", "a=on")
}

/// One greedy token fewer than the gate asked for: a decode loop that stops a step early.
fn generates_one_fewer() -> String {
    rewriting("--generate", "a=$((a-1))")
}

#[test]
fn a_port_whose_trace_is_not_the_run_asked_for_fails_agrees_naming_what() {
    // Each of these once passed `agrees` (its values are the honest port's) or was told "1 of 8
    // greedy tokens differ" of a decode one step short: what ran must be what was asked.
    let dir = project(&[]);
    let d = dir.path();
    for (cmd, name, said) in [
        (
            adversary("--unset prompt_tokens"),
            "prompt_tokens",
            "records no provenance prompt_tokens",
        ),
        (
            adversary("--set generate=3"),
            "generate",
            "its provenance says generate 3",
        ),
        (
            generates_one_fewer(),
            "greedy tokens",
            "greedy token(s) where the golden trace holds",
        ),
    ] {
        set_candidate(d, &cmd);
        let agrees = failing_check(d, "agrees");
        assert_fails_at(&agrees, name, Some("not_as_asked"));
        assert!(
            agrees["detail"].as_str().unwrap().contains(said),
            "{agrees}"
        );
    }
    // Negative control: the adversary with no edit passes.
    set_candidate(d, &adversary(""));
    run_short(d, 0);
}

#[test]
fn a_port_that_ignores_cache_off_fails_generation_naming_it() {
    // Its "uncached" trace is its cached one (provenance cache "on"), so comparing the two once
    // passed and the claim said "the same with and without its KV cache". gate init runs the
    // check too: it records cache_off (the port answers) and its own run fails, saying why.
    let (dir, out) = init_with(&ignores_cache_off(), &[]);
    assert_eq!(out.code, 1, "{}\n{}", out.stdout, out.stderr);
    assert!(
        out.stdout.contains("ignored `--cache off`"),
        "{}",
        out.stdout
    );
    let d = dir.path();
    let gen = failing_check(d, "generation");
    assert_fails_at(&gen, "candidate-uncached", Some("not_as_asked"));
    assert!(
        gen["detail"]
            .as_str()
            .unwrap()
            .contains(r#"asked for `--cache off` and its provenance says cache "on""#),
        "{gen}"
    );
    // A run that does not record `cache` cannot be verified: NOT CHECKED (exit 4), never a pass.
    set_candidate(d, &adversary("--when off --unset cache"));
    let gen = common::check(&run_short(d, 4).1, "generation").clone();
    assert_eq!(gen["status"], "NOT CHECKED", "{gen}");
    assert!(
        gen["detail"]
            .as_str()
            .unwrap()
            .contains("uncached run records no provenance `cache`"),
        "{gen}"
    );
    // Negative control: the honest port passes generation on the same golden traces.
    set_candidate(d, &port_cmd(""));
    run_short(d, 0);
}

#[test]
fn a_port_with_foreign_provenance_is_named_as_the_port_never_as_the_golden_trace() {
    let dir = project(&[]);
    let d = dir.path();
    // Foreign weights (a sha256 of the file, not tracegate's digest): generation_reference once
    // said "the reference's is not a tracegate weights digest", sending the user to the golden
    // trace; the port's run is the one named.
    let sha = "ab".repeat(32);
    set_candidate(d, &adversary(&format!("--set 'weights_digest=\"{sha}\"'")));
    let gen_ref = failing_check(d, "generation_reference");
    let said = gen_ref["detail"].as_str().unwrap();
    assert!(
        said.contains(&format!(
            "candidate vs golden: weights_digest differs: {sha} in the candidate, "
        )) && said.contains(" in the golden (the candidate's is not a tracegate weights digest"),
        "{said}"
    );
    // A port whose provenance says producer "oracle": told the name is reserved, not offered
    // --allow-stack-mismatch (which `gate run` does not even take).
    set_candidate(d, &adversary("--set 'producer=\"oracle\"'"));
    let (out, r) = run_short(d, 1);
    assert!(
        out.stdout.contains("the candidate claims to be the oracle")
            && !out.stdout.contains("--allow-stack-mismatch"),
        "{}",
        out.stdout
    );
    for name in ["agrees", "generation_reference"] {
        let c = common::check(&r, name);
        assert_eq!(c["status"], "FAIL", "{c}");
        assert!(
            c["findings"].as_array().unwrap().iter().all(|f| f["detail"]
                .as_str()
                .unwrap()
                .contains("the candidate claims to be the oracle")),
            "{c}"
        );
    }
}

#[test]
fn a_nan_in_both_runs_of_the_candidate_fails_agrees() {
    // NaN in the same element of the cached and the uncached trace: the two paths agree with
    // each other bit for bit, and the golden trace still says the value is a number.
    let dir = project(&[]);
    let d = dir.path();
    set_candidate(d, &adversary("--bits decode.0002.logits=7fc00000"));
    let agrees = failing_check(d, "agrees");
    assert_fails_at(&agrees, "decode.0002.logits", None);
}

/// docs/ci.md's workflow: each step's name and its `run:` command, as written there.
/// One step of a workflow block of docs/ci.md: its name, its `run:` command, its `if:` and the
/// `path:` entries of its `with:` (an upload's, a cache's).
#[derive(Debug, Default)]
struct Step {
    name: String,
    run: Option<String>,
    cond: Option<String>,
    paths: Vec<String>,
}

/// The steps of the first yaml block after `heading` in docs/ci.md (the subset of YAML the
/// documented workflows use: one-line `run:` and `if:`, `path:` one line or a `|` block).
fn workflow(heading: &str) -> Vec<Step> {
    let doc = std::fs::read_to_string(repo().join("docs/ci.md")).unwrap();
    let at = doc
        .find(heading)
        .unwrap_or_else(|| panic!("docs/ci.md has {heading:?}"));
    let block = &doc[at..];
    let start = block.find("```yaml\n").expect("a yaml block") + 8;
    let end = start + block[start..].find("```").unwrap();
    let mut steps: Vec<Step> = Vec::new();
    let mut in_paths = None;
    for raw in block[start..end].lines() {
        let indent = raw.len() - raw.trim_start().len();
        let line = raw.trim();
        if let Some(min) = in_paths {
            if indent >= min && !line.is_empty() {
                steps.last_mut().unwrap().paths.push(line.to_string());
                continue;
            }
            in_paths = None;
        }
        if let Some(n) = line.strip_prefix("- name: ") {
            steps.push(Step {
                name: n.to_string(),
                ..Step::default()
            });
        } else if line.starts_with("- ") {
            steps.push(Step::default()); // an unnamed step (`- uses: …`)
        } else if let Some(step) = steps.last_mut().filter(|s| !s.name.is_empty()) {
            if let Some(run) = line.strip_prefix("run: ") {
                // A single-quoted YAML scalar is the command between the quotes.
                let run = run
                    .strip_prefix('\'')
                    .and_then(|r| r.strip_suffix('\''))
                    .unwrap_or(run);
                step.run = Some(run.replace("''", "'"));
            } else if let Some(c) = line.strip_prefix("if: ") {
                step.cond = Some(c.to_string());
            } else if line == "path: |" {
                in_paths = Some(indent + 1);
            } else if let Some(p) = line.strip_prefix("path: ") {
                step.paths.push(p.to_string());
            }
        }
    }
    steps.retain(|s| !s.name.is_empty());
    steps
}

fn documented_steps() -> Vec<(String, String)> {
    workflow("## A port's workflow")
        .into_iter()
        .filter_map(|s| Some((s.name, s.run?)))
        .collect()
}

/// Issue 52: the workflow uploaded `target/gate/` (160–180 MB of traces after one failing run)
/// as its artifact. The reports' upload names the reports alone, each there after a failing run
/// (`dir`), none of them a trace or under `target/gate/` — where the traces are; the traces'
/// upload is opt-in.
fn assert_uploads_the_reports_only(steps: &[Step], dir: &Path) {
    let reports = steps
        .iter()
        .find(|s| s.name == "Upload the reports")
        .expect("an upload of the reports");
    assert_eq!(reports.cond.as_deref(), Some("always()"));
    assert!(!reports.paths.is_empty());
    for p in &reports.paths {
        assert!(
            !p.starts_with("target/gate") && !p.ends_with(".trace") && !p.contains('*'),
            "the reports' upload names {p}"
        );
        assert!(dir.join(p).is_file(), "{p} is not a report the run wrote");
    }
    let traces: Vec<PathBuf> = walk(&dir.join("target/gate"))
        .into_iter()
        .filter(|f| f.extension().is_some_and(|e| e == "trace"))
        .collect();
    assert!(
        !traces.is_empty(),
        "the failing run left no traces to leave out"
    );
    let opt_in = steps
        .iter()
        .find(|s| s.name == "Upload the traces")
        .expect("an opt-in upload of the traces");
    assert_eq!(opt_in.paths, ["target/gate/"]);
    assert_eq!(
        opt_in.cond.as_deref(),
        Some("failure() && vars.GATE_UPLOAD_TRACES == 'true'")
    );
}

/// Every file under `dir`.
fn walk(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    for e in std::fs::read_dir(dir).into_iter().flatten().flatten() {
        let p = e.path();
        if p.is_dir() {
            out.extend(walk(&p));
        } else {
            out.push(p);
        }
    }
    out
}

#[test]
fn the_documented_workflow_gates_a_port() {
    let steps = documented_steps();
    let names: Vec<&str> = steps.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(
        names,
        [
            "Fetch tracegate",
            "Build the gate",
            "Build the port",
            "Gate the port"
        ]
    );
    // This checkout's build stands in for the fetched and built tracegate.
    let home = tempfile::tempdir().unwrap();
    std::fs::create_dir_all(home.path().join("target/release")).unwrap();
    std::os::unix::fs::symlink(
        env!("CARGO_BIN_EXE_gate"),
        home.path().join("target/release/gate"),
    )
    .unwrap();
    let dir = project(&[]);
    let d = dir.path();
    let run_steps = |d: &Path| -> (i32, String) {
        let mut last = (0, String::new());
        for (name, run) in &steps[2..] {
            let run = if name == "Build the port" {
                assert_eq!(run, "make");
                "true".to_string()
            } else {
                run.clone()
            };
            let out = std::process::Command::new("bash")
                .args(["-euo", "pipefail", "-c", &run])
                .current_dir(d)
                .env("TRACEGATE_HOME", home.path())
                .env("GITHUB_ACTIONS", "true")
                .env("TRACEGATE_RESIDENT", "0")
                .output()
                .unwrap();
            last = (
                out.status.code().unwrap_or(-1),
                String::from_utf8_lossy(&out.stdout).into_owned()
                    + &String::from_utf8_lossy(&out.stderr),
            );
        }
        last
    };
    let (code, text) = run_steps(d);
    assert_eq!(code, 0, "{text}");
    assert!(!text.contains("::error"), "{text}");
    for f in ["gate-report.json", "gate-report.html", "gate-junit.xml"] {
        assert!(d.join(f).is_file(), "{f} missing:\n{text}");
    }
    report(&d.join("gate-report.json"));
    // Negative control: a planted defect fails the job and is annotated.
    set_candidate(d, &port_cmd(" --plant k-norm:3"));
    let (code, text) = run_steps(d);
    assert_eq!(code, 1, "{text}");
    assert!(
        text.contains("::error title=gate port model short/agrees"),
        "{text}"
    );
    assert_uploads_the_reports_only(&workflow("## A port's workflow"), d);
}

/// The `tracegate` wheel the checkout's set-up built (scripts/setup.sh: `maturin build` into the
/// target directory's `wheels/`, beside the gate under test): the newest there.
fn built_wheel() -> PathBuf {
    let dir = Path::new(env!("CARGO_BIN_EXE_gate"))
        .parent()
        .and_then(Path::parent)
        .unwrap()
        .join("wheels");
    std::fs::read_dir(&dir)
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| e.path())
        .filter(|p| {
            p.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with("tracegate-") && n.ends_with(".whl"))
        })
        .max_by_key(|p| std::fs::metadata(p).and_then(|m| m.modified()).ok())
        .unwrap_or_else(|| {
            panic!(
                "no tracegate wheel in {}: scripts/setup.sh builds it (maturin build --release -m binding/Cargo.toml)",
                dir.display()
            )
        })
}

/// A fresh virtual environment, the job's Python: numpy (the wheel's one dependency, from the
/// repository's .venv, so pip needs no index) and nothing of tracegate.
fn job_python(dir: &Path) -> PathBuf {
    let venv = dir.join("venv");
    let py = common::python();
    common::succeeded(
        std::process::Command::new(&py)
            .args(["-m", "venv"])
            .arg(&venv),
    );
    let where_ = |code: &str, py: &Path| -> String {
        let out = common::succeeded(
            std::process::Command::new(py)
                .args(["-c", code])
                .env_remove("PYTHONPATH"),
        );
        String::from_utf8_lossy(&out.stdout).trim().to_string()
    };
    let numpy_site = PathBuf::from(where_(
        "import numpy, os; print(os.path.dirname(os.path.dirname(numpy.__file__)))",
        &py,
    ));
    let deps = dir.join("deps");
    std::fs::create_dir_all(&deps).unwrap();
    for e in std::fs::read_dir(&numpy_site).unwrap().flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        if name == "numpy"
            || name == "numpy.libs"
            || (name.starts_with("numpy-") && name.ends_with(".dist-info"))
        {
            std::os::unix::fs::symlink(e.path(), deps.join(&name)).unwrap();
        }
    }
    let site = where_(
        "import sysconfig; print(sysconfig.get_paths()['purelib'])",
        &venv.join("bin/python"),
    );
    std::fs::write(
        Path::new(&site).join("numpy-only.pth"),
        format!("{}\n", deps.display()),
    )
    .unwrap();
    venv
}

/// docs/ci.md's Python port workflow, its steps run as written (issue 52: a Python port's CI
/// needs the `tracegate` module, installed from a wheel built once). The port is the contract,
/// its package in the project; the job's Python a fresh venv. Negative control: without the
/// module installed, the port cannot write a trace and the job fails.
#[test]
fn the_documented_python_workflow_gates_a_python_port() {
    let steps = workflow("## A Python port's workflow");
    let names: Vec<&str> = steps
        .iter()
        .filter(|s| s.run.is_some())
        .map(|s| s.name.as_str())
        .collect();
    assert_eq!(
        names,
        [
            "Fetch tracegate",
            "Build the gate",
            "Build the tracegate wheel",
            "Install the tracegate module",
            "Install the port",
            "Gate the port"
        ]
    );
    let run_of = |name: &str| -> String {
        steps
            .iter()
            .find(|s| s.name == name)
            .and_then(|s| s.run.clone())
            .unwrap()
    };
    // The wheel step builds what the set-up builds, which stands in for it here.
    assert!(
        run_of("Build the tracegate wheel")
            .contains("maturin build --release -m \"$TRACEGATE_HOME/binding/Cargo.toml\""),
        "{}",
        run_of("Build the tracegate wheel")
    );
    let job = tempfile::tempdir().unwrap();
    let built = job.path().join("built");
    std::fs::create_dir_all(built.join("wheels")).unwrap();
    std::os::unix::fs::symlink(env!("CARGO_BIN_EXE_gate"), built.join("gate")).unwrap();
    let wheel = built_wheel();
    std::fs::copy(
        &wheel,
        built.join("wheels").join(wheel.file_name().unwrap()),
    )
    .unwrap();
    let venv = job_python(job.path());
    // The user's project: golden traces recorded once; the port is the contract (numpy and the
    // tracegate module), its package in the checkout.
    let dir = project(&[]);
    let d = dir.path();
    let copy = std::process::Command::new("cp")
        .arg("-r")
        .arg(repo().join("contract/tracegate_contract"))
        .arg(d)
        .status()
        .unwrap();
    assert!(copy.success());
    std::fs::write(d.join("requirements.txt"), "numpy==2.4.6\n").unwrap();
    set_candidate(d, "python -m tracegate_contract {verb} {args}");
    let path = format!(
        "{}:{}",
        venv.join("bin").display(),
        std::env::var("PATH").unwrap_or_default()
    );
    let run_steps = |names: &[&str]| -> (i32, String) {
        let mut last = (0, String::new());
        for name in names {
            let out = std::process::Command::new("bash")
                .args(["-euo", "pipefail", "-c", &run_of(name)])
                .current_dir(d)
                .env("PATH", &path)
                .env_remove("PYTHONPATH")
                .env_remove("VIRTUAL_ENV")
                .env("PIP_NO_INDEX", "1")
                .env("PIP_DISABLE_PIP_VERSION_CHECK", "1")
                .env("TRACEGATE_BUILT", &built)
                .env("GITHUB_ACTIONS", "true")
                .env("TRACEGATE_RESIDENT", "0")
                .output()
                .unwrap();
            last = (
                out.status.code().unwrap_or(-1),
                String::from_utf8_lossy(&out.stdout).into_owned()
                    + &String::from_utf8_lossy(&out.stderr),
            );
            if last.0 != 0 {
                return (last.0, format!("{name}: {}", last.1));
            }
        }
        last
    };
    let (code, text) = run_steps(&[
        "Install the tracegate module",
        "Install the port",
        "Gate the port",
    ]);
    assert_eq!(code, 0, "{text}");
    assert!(!text.contains("::error"), "{text}");
    let r = report(&d.join("gate-report.json"));
    assert_eq!(r["verdict"], "PASS", "{text}");
    assert!(d.join("gate-report.html").is_file() && d.join("gate-junit.xml").is_file());
    // The port imported the module the wheel installed in the job's Python.
    let at = std::process::Command::new(venv.join("bin/python"))
        .args(["-c", "import tracegate._native as n; print(n.__file__)"])
        .current_dir(job.path())
        .env_remove("PYTHONPATH")
        .output()
        .unwrap();
    let at = String::from_utf8_lossy(&at.stdout).trim().to_string();
    assert!(at.starts_with(&venv.display().to_string()), "{at}");
    // Negative control: the module uninstalled, the port fails and so does the job.
    common::succeeded(std::process::Command::new(venv.join("bin/python")).args([
        "-m",
        "pip",
        "uninstall",
        "-y",
        "-q",
        "tracegate",
    ]));
    let (code, text) = run_steps(&["Install the port", "Gate the port"]);
    assert_eq!(code, 1, "{text}");
    assert!(
        text.contains("::error") && text.contains("No module named 'tracegate'"),
        "{text}"
    );
    // Its uploads are the port workflow's, which the_documented_workflow_gates_a_port holds to
    // a failing run's files: the reports, the traces opt-in.
    let uploads = |steps: &[Step]| -> Vec<(String, Option<String>, Vec<String>)> {
        steps
            .iter()
            .filter(|s| s.name.starts_with("Upload"))
            .map(|s| (s.name.clone(), s.cond.clone(), s.paths.clone()))
            .collect()
    };
    assert_eq!(uploads(&steps), uploads(&workflow("## A port's workflow")));
}

#[test]
fn text_prompts_are_tokenized_once_and_a_changed_tokenizer_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    // A model with a tokenizer (binding/tests/tiny_tokenizer.py: a WordLevel one in a copy
    // of tiny-qwen3, with a chat template).
    let made = std::process::Command::new(repo().join(".venv/bin/python"))
        .args([
            "-c",
            "import sys; sys.path.insert(0, sys.argv[1]); import tiny_tokenizer as t; t.model_with_tokenizer(sys.argv[2])",
        ])
        .arg(repo().join("binding/tests"))
        .arg(d.join("model"))
        .output()
        .unwrap();
    assert!(
        made.status.success(),
        "{}",
        String::from_utf8_lossy(&made.stderr)
    );
    std::fs::write(
        d.join("p.json"),
        r#"{"schema": 1, "prompts": [{"id": "plain", "text": "the cat sat on a mat"},
            {"id": "chat", "text": "hello world", "chat": true}, {"id": "ids", "tokens": [5, 6, 7]}]}"#,
    )
    .unwrap();
    let cmd = port_cmd("");
    let out = gate(
        d,
        &[
            "init",
            "--model",
            "model",
            "--candidate-cmd",
            &cmd,
            "--prompts",
            "p.json",
            "--generate",
            "2",
        ],
        &[],
    );
    assert_eq!(out.code, 0, "{}\n{}", out.stdout, out.stderr);
    let m = milestones(d);
    let t = &m["milestones"][0]["port"]["tokenized"];
    // The tokenizer's own ids, asked of it independently of the gate.
    let asked = std::process::Command::new(repo().join(".venv/bin/python"))
        .args([
            "-c",
            "import sys, json; from tokenizers import Tokenizer; t = Tokenizer.from_file(sys.argv[1]); print(json.dumps(t.encode('the cat sat on a mat').ids))",
        ])
        .arg(d.join("model/tokenizer.json"))
        .output()
        .unwrap();
    let want: Value = serde_json::from_slice(&asked.stdout).unwrap();
    assert_eq!(t["prompts"]["plain"]["tokens"], want);
    assert!(t["prompts"]["chat"]["template"].is_string());
    assert!(
        t["prompts"].get("ids").is_none(),
        "a token prompt is not tokenized"
    );
    // The golden trace is of those ids.
    let g = tracegate_trace::Trace::open(d.join("golden/plain.trace")).unwrap();
    assert_eq!(g.provenance()["prompt_tokens"], want);
    // No Python at run time: the tokenizer's digest is the gate's own (crate::tokenizer).
    let out = gate(
        d,
        &["run", "port"],
        &[("TRACEGATE_PYTHON", "/nonexistent/python")],
    );
    assert_eq!(out.code, 0, "{}\n{}", out.stdout, out.stderr);
    // A changed tokenizer is a changed prompt.
    let cfg = d.join("model/tokenizer_config.json");
    let mut bytes = std::fs::read(&cfg).unwrap();
    bytes.push(b'\n');
    std::fs::write(&cfg, &bytes).unwrap();
    let out = gate(d, &["run", "port"], &[]);
    assert_eq!(out.code, 2, "{}", out.stdout);
    assert!(
        out.stderr.contains("the tokenizer changed"),
        "{}",
        out.stderr
    );
    let out = gate(d, &["run", "port", "--bless"], &[]);
    assert_eq!(out.code, 0, "{}\n{}", out.stdout, out.stderr);
    assert!(
        out.stdout.contains("text prompts tokenized (tokenizer "),
        "{}",
        out.stdout
    );
    let out = gate(d, &["run", "port"], &[]);
    assert_eq!(out.code, 0, "{}\n{}", out.stdout, out.stderr);
    // Where nothing tokenizes, a text prompt is refused: the self-checks and gate bisect.
    for args in [
        vec!["m0", "--prompts"],
        vec![
            "bisect",
            "--model",
            "fixtures/tiny-qwen3",
            "--reference",
            "engine",
            "--candidate",
            "contract",
            "--prompt",
            "plain",
            "--prompts",
        ],
    ] {
        let mut args = args.clone();
        let p = d.join("p.json");
        args.push(p.to_str().unwrap());
        let out = gate(&repo(), &args, &[]);
        assert_eq!(out.code, 2, "{args:?}: {}", out.stderr);
        assert!(
            out.stderr.contains("prompt \"plain\" is text"),
            "{args:?}: {}",
            out.stderr
        );
    }
}

#[test]
fn a_bf16_golden_trace_holds_an_f32_port_to_the_bf16_policy_which_still_catches_a_cache_defect() {
    // The coarser side sets the precision: an f32 candidate against transformers in bf16.
    let dir = project(&["--dtype", "bf16"]);
    let d = dir.path();
    assert_eq!(milestones(d)["milestones"][0]["policy"], "bf16");
    let out = gate(d, &["run", "port"], &[]);
    assert_eq!(out.code, 0, "{}\n{}", out.stdout, out.stderr);
    // (A dropped k_norm weight is not caught here: on this fixture it moves layer 03's attn_out
    // by a relative L2 of 3.8e-2, inside the bf16 bounds; the f32 test above catches it.)
    set_candidate(d, &port_cmd(" --plant decode-pos"));
    let gen = failing_check(d, "generation");
    assert_eq!(gen["status"], "FAIL", "{gen}");
}

#[test]
fn a_cached_token_no_score_explains_fails_generation() {
    // The cached run's third token replaced, every tensor of both runs as computed: the differ
    // labels the flip a defect (nothing upstream moved, the scores do not pick it), which no
    // near-tie rule may excuse.
    let dir = project(&[]);
    let d = dir.path();
    set_candidate(d, &adversary("--when on --flip decode.0002.argmax"));
    let gen = failing_check(d, "generation");
    assert_fails_at(&gen, "decode.0002.argmax", Some("decision_differs"));
}

#[test]
fn attack_a_port_cannot_choose_its_own_precision() {
    // The defect: layer 3's k_norm dropped (rel L2 3.7e-2 at layer.03.attn_out, ~145,000x f32
    // rounding): the f32 policy sees it, the bf16 and q8 policies do not.
    let plant = " --plant k-norm:3";
    // Initialised with the defective port declaring q8 (or writing one tensor as bf16), the
    // project once recorded `policy auto -> q8` (bf16) and passed: the user's claim (f32 by
    // default) is recorded instead, and the defect fails.
    for edit in ["--declare q8", "--bf16 embed.out"] {
        let (dir, out) = init_with(&format!("{}{plant}", adversary(edit)), &[]);
        assert_eq!(out.code, 1, "{edit}: {}\n{}", out.stdout, out.stderr);
        assert_eq!(
            milestones(dir.path())["milestones"][0]["policy"],
            "f32",
            "{edit}"
        );
    }
    // --precision records the claim, a claim per capture-point pattern too (the port's
    // attention output in f16, the rest f32); a claim naming no precision is refused.
    let (dir, out) = init_with(&port_cmd(""), &["--precision", "bf16"]);
    assert_eq!(out.code, 0, "{}\n{}", out.stdout, out.stderr);
    assert_eq!(milestones(dir.path())["milestones"][0]["policy"], "bf16");
    let mixed = "layer.*.attn_out=f16,**=f32";
    let (dir, out) = init_with(&port_cmd(""), &["--precision", mixed]);
    assert_eq!(out.code, 0, "{}\n{}", out.stdout, out.stderr);
    assert_eq!(milestones(dir.path())["milestones"][0]["policy"], mixed);
    let (_dir, out) = init_with(&port_cmd(""), &["--precision", "**=fp8"]);
    assert_eq!(out.code, 2, "{}\n{}", out.stdout, out.stderr);
    assert!(
        out.stderr.contains("\"fp8\" is not one of"),
        "{}",
        out.stderr
    );
    let dir = project(&[]);
    let d = dir.path();
    assert_eq!(milestones(d)["milestones"][0]["policy"], "f32");
    let run = |cmd: &str| {
        set_candidate(d, cmd);
        gate(d, &["run", "port", "--only", "short"], &[])
    };
    // A declaration with a pattern that matches no tensor (`vision.tower.*`: q8) is refused,
    // naming the pattern; it once picked the q8 policy and "nothing wrong".
    let out = run(&format!(
        "{}{plant}",
        adversary(r#"--declare '{"*":"f32","vision.tower.*":"q8"}'"#)
    ));
    assert_eq!(out.code, 1, "{}\n{}", out.stdout, out.stderr);
    assert!(
        out.stdout.contains("vision.tower.*") && out.stdout.contains("matches no tensor"),
        "{}",
        out.stdout
    );
    // One tensor written as bf16, nothing declared: still judged by the claim (f32), and the
    // defect fails `agrees`; it once chose bf16 ("its tensors' dtype").
    let out = run(&format!("{}{plant}", adversary("--bf16 embed.out")));
    assert_eq!(out.code, 1, "{}\n{}", out.stdout, out.stderr);
    assert!(out.stdout.contains(", policy f32"), "{}", out.stdout);
    // The control: the honest port passes the f32 claim.
    let out = run(&port_cmd(""));
    assert_eq!(out.code, 0, "{}\n{}", out.stdout, out.stderr);
    // A milestone recorded as `auto` (an older init), blessed with a port declaring bf16: the
    // golden traces' precision (f32) is recorded, never the candidate's declaration.
    set_candidate(d, &adversary("--declare bf16"));
    let path = d.join("milestones.json");
    let mut ms = milestones(d);
    ms["milestones"][0]["policy"] = "auto".into();
    std::fs::write(&path, serde_json::to_string_pretty(&ms).unwrap()).unwrap();
    let out = gate(d, &["run", "port", "--bless"], &[]);
    assert_eq!(out.code, 0, "{}\n{}", out.stdout, out.stderr);
    assert_eq!(milestones(d)["milestones"][0]["policy"], "f32");
    // A declaration that names no precision fails, naming it.
    let out = run(&adversary("--declare fp8"));
    assert_eq!(out.code, 1, "{}\n{}", out.stdout, out.stderr);
    assert!(
        out.stdout
            .contains(r#"provenance precision is "fp8": expected one of f32, f16, bf16, q8"#),
        "{}",
        out.stdout
    );
}

#[test]
fn attack_evidence_is_pinned_a_golden_or_noise_trace_swapped_for_the_ports_own_is_refused() {
    let dir = project(&[]);
    let d = dir.path();
    // gate init recorded, beside each golden trace, a noise trace from tracegate's own f32 run
    // (the engine computes qwen3), its digest and provenance pinned in milestones.json.
    let ms = milestones(d);
    let noise = &ms["milestones"][0]["port"]["noise"]["short"];
    assert_eq!(noise["trace"], "golden/short.noise.trace", "{ms:#}");
    let n = tracegate_trace::Trace::open(d.join("golden/short.noise.trace")).unwrap();
    assert_eq!(n.provenance()["producer"], "engine");
    assert_eq!(noise["digest"].as_str(), Some(n.digest().hex().as_str()));
    run_short(d, 0);
    // The defective port's own output, kept.
    set_candidate(d, &port_cmd(" --plant k-norm:3"));
    failing_check(d, "agrees");
    let own = d.join("own.trace");
    std::fs::copy(d.join("target/gate/port/model/short/candidate.trace"), &own).unwrap();
    let own_t = tracegate_trace::Trace::open(&own).unwrap();
    let pin = tracegate_gate::milestone::milestones::provenance_pin(own_t.provenance());
    let path = d.join("milestones.json");
    let original = std::fs::read(&path).unwrap();
    // The adversary puts it in the golden trace's place and edits every record to match: its
    // digest, its provenance pin, its tokens. The producer it records is not the reference's.
    std::fs::copy(&own, d.join("golden/short.trace")).unwrap();
    let mut ms = milestones(d);
    let g = &mut ms["milestones"][0]["port"]["golden"]["short"];
    g["digest"] = own_t.digest().hex().into();
    g["provenance"] = pin.clone().into();
    std::fs::write(&path, serde_json::to_string_pretty(&ms).unwrap()).unwrap();
    let out = gate(d, &["run", "port", "--only", "short"], &[]);
    assert_eq!(out.code, 2, "{}\n{}", out.stdout, out.stderr);
    assert!(
        out.stderr.contains(r#"written by "example-producer""#)
            && out.stderr.contains("reference is the oracle in f32"),
        "{}",
        out.stderr
    );
    // Without editing the pin, the provenance itself is refused.
    let mut ms: Value = serde_json::from_slice(&original).unwrap();
    ms["milestones"][0]["port"]["golden"]["short"]["digest"] = own_t.digest().hex().into();
    std::fs::write(&path, serde_json::to_string_pretty(&ms).unwrap()).unwrap();
    let out = gate(d, &["run", "port", "--only", "short"], &[]);
    assert_eq!(out.code, 2, "{}\n{}", out.stdout, out.stderr);
    assert!(
        out.stderr.contains("is not the one milestones.json pins"),
        "{}",
        out.stderr
    );
    // The noise trace swapped for the port's own output (every record edited): refused, the
    // noise is tracegate's run.
    let out = gate(d, &["run", "port", "--bless"], &[]);
    assert_eq!(out.code, 1, "{}\n{}", out.stdout, out.stderr);
    std::fs::copy(&own, d.join("golden/short.noise.trace")).unwrap();
    let mut ms = milestones(d);
    let n = &mut ms["milestones"][0]["port"]["noise"]["short"];
    n["digest"] = own_t.digest().hex().into();
    n["provenance"] = pin.into();
    std::fs::write(&path, serde_json::to_string_pretty(&ms).unwrap()).unwrap();
    let out = gate(d, &["run", "port", "--only", "short"], &[]);
    assert_eq!(out.code, 2, "{}\n{}", out.stdout, out.stderr);
    assert!(
        out.stderr
            .contains("not one of tracegate's reference producers"),
        "{}",
        out.stderr
    );
}

/// A port with an RMSNorm eps ten times the config's (1e-5 for 1e-6) is within every f32 bound
/// on this fixture (rel L2 <= 1.9e-5): the noise run recorded by gate init (the engine) sees it
/// at 30-56x its own difference from the oracle; an honest non-bit-exact port (squares summed in
/// f64) sits at ~1x and passes. Without the noise traces the defect passes: the noise run, not a
/// looser or tighter bound, separates them (fixtures/policy/MEASUREMENTS.md, "The noise ratio").
#[test]
fn an_eps_ten_times_the_configs_fails_against_the_noise_run_and_an_honest_port_passes() {
    let contract = |defect: &str| {
        format!(
            "'{}' '{}' --defect {defect} {{verb}} {{args}}",
            repo().join(".venv/bin/python").display(),
            repo()
                .join("gate/tests/producers/defective_contract.py")
                .display()
        )
    };
    let (dir, out) = init_with(&contract("f64-sumsq"), &[]);
    assert_eq!(out.code, 0, "{}\n{}", out.stdout, out.stderr);
    let d = dir.path();
    set_candidate(d, &contract("eps-x10"));
    let agrees = failing_check(d, "agrees");
    assert!(
        agrees["findings"]
            .as_array()
            .unwrap()
            .iter()
            .any(|f| f["detail"]
                .as_str()
                .unwrap()
                .contains("the noise reference's")),
        "{agrees}"
    );
    // Localised by the same judge: the layer alone is held to the noise ratio the whole runs
    // are, so the bisection blames layer 00 (its first norm) rather than calling every layer
    // right in isolation and the divergence accumulated.
    let localised = report(&d.join("r.json"))["prompts"][0]["localised"]["summary"].clone();
    assert!(
        localised
            .as_str()
            .is_some_and(|s| s.starts_with("layer 00 body is wrong")),
        "{localised}"
    );
    // The same defect without the noise traces (an older init): within every f32 bound.
    let path = d.join("milestones.json");
    let mut ms = milestones(d);
    ms["milestones"][0]["port"]
        .as_object_mut()
        .unwrap()
        .remove("noise");
    std::fs::write(&path, serde_json::to_string_pretty(&ms).unwrap()).unwrap();
    let (out, _) = run_short(d, 0);
    assert!(
        out.stdout.contains("no noise trace recorded"),
        "{}",
        out.stdout
    );
}

#[test]
fn a_port_that_computes_as_the_noise_run_is_never_said_to_be_sized_by_it() {
    // The candidate is tracegate's own engine: its output is the f32 noise run's, bit for bit.
    // That noise trace is not read (a candidate never sizes its own near-ties), not recorded,
    // and no line says the near-ties' noise was read from it.
    let engine = common::sibling("engine");
    let (dir, out) = init_with(&format!("'{}' {{verb}} {{args}}", engine.display()), &[]);
    assert_eq!(out.code, 0, "{}\n{}", out.stdout, out.stderr);
    assert!(
        out.stdout
            .contains("is the candidate's own content: not read")
            && !out.stdout.contains("honest noise read from"),
        "{}",
        out.stdout
    );
    assert!(milestones(dir.path())["milestones"][0]["port"]["noise"]
        .as_object()
        .is_none_or(|n| n.is_empty()));
    let run = gate(dir.path(), &["run", "port", "--only", "short"], &[]);
    assert_eq!(run.code, 0, "{}\n{}", run.stdout, run.stderr);
    assert!(
        run.stdout
            .contains("or one whose noise run was the candidate's own content"),
        "{}",
        run.stdout
    );
}

#[test]
fn outside_a_project_the_gate_names_gate_init() {
    // A port user runs `gate run port` in the wrong directory: the fix is theirs (gate init, or
    // --root), not a tracegate checkout.
    let dir = tempfile::tempdir().unwrap();
    let out = gate(dir.path(), &["run", "port"], &[]);
    assert_eq!(out.code, 2, "{}\n{}", out.stdout, out.stderr);
    assert!(
        out.stderr.contains("no milestones.json in ")
            && out.stderr.contains("a project made by `gate init`")
            && out.stderr.contains("--root"),
        "{}",
        out.stderr
    );
}
