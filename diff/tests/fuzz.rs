//! A bounded, deterministic fuzz of `trace-diff` (issue 12, "keep it from coming back"): the
//! conformance vectors (`fixtures/format/`) and a model-shaped trace are mutated — bit flips,
//! truncation, index edits with a re-digested footer, and content edits written through the
//! real writer — and the real binary runs on (original, mutated). Whatever the bytes: no panic
//! (exit 101), no signal, and an exit status that agrees with the content: a file the reader
//! refuses or `verify` fails is `unreadable` (2); a verified file whose content digest equals
//! the original's is IDENTICAL (0) unless provenance makes it incomparable (3); any other is
//! never 0. A few seconds; every seed is fixed, so a failure names a reproducible case.

use crate::common;

use std::path::{Path, PathBuf};
use std::process::Command;

use common::*;
use serde_json::{json, Value};
use tracegate_trace::{Trace, TraceWriter};

/// Cases per input are multiplied by `TRACEGATE_FUZZ_SCALE` (default 1, a few seconds): the
/// long run is `TRACEGATE_FUZZ_SCALE=1000 cargo test --release -p tracegate-diff --test fuzz`.
fn scale() -> usize {
    std::env::var("TRACEGATE_FUZZ_SCALE")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(1)
        .max(1)
}

/// `TRACEGATE_FUZZ_SEED=N` (default 0, the cases CI runs): another campaign, every stream's seed
/// changed by N, so a long run can explore cases the fixed seeds never reach. A failure names
/// its case; rerun it with the same N.
fn campaign() -> u64 {
    std::env::var("TRACEGATE_FUZZ_SEED")
        .ok()
        .and_then(|s| s.parse::<u64>().ok())
        .map_or(0, |n| n.wrapping_mul(0xa076_1d64_78bd_642f))
}

/// xorshift64*: fixed seeds, no dependency.
struct Rng(u64);

impl Rng {
    /// One fixed stream per (test, input), so a larger scale replays the default cases first.
    fn seeded(test: u64, input: usize) -> Rng {
        Rng(0x5eed_0000
            ^ (test << 32)
            ^ (input as u64 + 1).wrapping_mul(0x9e37_79b9_7f4a_7c15)
            ^ campaign())
    }
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }
}

fn vectors() -> Vec<PathBuf> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../fixtures/format");
    ["empty.trace", "dtypes.trace", "decisions.trace"]
        .iter()
        .map(|n| dir.join(n))
        .collect()
}

/// The originals: the three conformance vectors and a model-shaped trace (13 tensors with
/// attributes, router top-k and argmax decisions with margins).
fn originals(dir: &Path) -> Vec<PathBuf> {
    let mut all = vectors();
    all.push(model().write(&dir.join("model.trace")));
    all
}

/// What the reader says of a file: Err(reason) if it refuses it or `verify` fails, else the
/// verified content digest.
fn judge(path: &Path) -> Result<String, String> {
    let t = Trace::open(path).map_err(|e| e.to_string())?;
    t.verify().map_err(|e| e.to_string())?;
    Ok(t.digest().hex())
}

struct Outcome {
    code: i32,
    stdout: String,
}

fn trace_diff(args: &[&Path], flags: &[&str], case: &str) -> Outcome {
    let out = Command::new(env!("CARGO_BIN_EXE_trace-diff"))
        .args(flags)
        .args(args)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    let code = out.status.code().unwrap_or_else(|| {
        panic!(
            "{case}: trace-diff {flags:?} was killed by a signal ({:?})\n{stderr}",
            out.status
        )
    });
    assert_ne!(
        code, 101,
        "{case}: trace-diff {flags:?} panicked:\n{stderr}"
    );
    assert!(!stderr.contains("panicked"), "{case}: {stderr}");
    Outcome {
        code,
        stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
    }
}

/// How the cases fell, printed (uncaptured) so a run shows what it covered.
#[derive(Default)]
struct Tally {
    refused: u32,
    equal: u32,
    different: u32,
    refused_by_writer: u32,
}

#[derive(Clone, Copy)]
enum Case {
    Refused,
    Equal,
    Different,
}

impl Tally {
    fn add(&mut self, c: Case) {
        match c {
            Case::Refused => self.refused += 1,
            Case::Equal => self.equal += 1,
            Case::Different => self.different += 1,
        }
    }
    fn print(&self, what: &str) {
        use std::io::Write;
        let _ = writeln!(
            std::io::stderr(),
            "fuzz {what}: {} refused (unreadable), {} equal content (identical), {} different content{}",
            self.refused,
            self.equal,
            self.different,
            if self.refused_by_writer > 0 { format!(", {} edits the writer refused", self.refused_by_writer) } else { String::new() }
        );
    }
}

/// Runs trace-diff (original, mutated) verified and unverified, and `--show` on the mutated
/// file, and checks each exit status against what the reader says of the mutated file.
fn check_pair(original: &Path, mutated: &Path, case: &str) -> Case {
    let expected = judge(original).expect("originals verify");
    let verdict = judge(mutated);
    let out = trace_diff(&[original, mutated], &[], case);
    match &verdict {
        Err(why) => assert_eq!(
            out.code, 2,
            "{case}: the reader refuses it ({why}) but trace-diff exits {}:\n{}",
            out.code, out.stdout
        ),
        Ok(d) if *d == expected => {
            assert!(
                out.code == 0 || out.code == 3,
                "{case}: equal content, exit {}:\n{}",
                out.code,
                out.stdout
            );
            if out.code == 0 {
                assert!(
                    out.stdout.starts_with("IDENTICAL"),
                    "{case}: {}",
                    out.stdout
                );
            }
        }
        Ok(_) => assert!(
            out.code == 1 || out.code == 3,
            "{case}: content differs, exit {}:\n{}",
            out.code,
            out.stdout
        ),
    }
    // Unverified, a verified file's content still decides; other files only must not crash.
    let loose = trace_diff(&[original, mutated], &["--no-verify", "--all"], case);
    match &verdict {
        Ok(d) if *d == expected => assert!(
            loose.code == 0 || loose.code == 3,
            "{case}: --no-verify on equal content, exit {}:\n{}",
            loose.code,
            loose.stdout
        ),
        Ok(_) => assert!(
            loose.code == 1 || loose.code == 3,
            "{case}: --no-verify on different content, exit {}:\n{}",
            loose.code,
            loose.stdout
        ),
        Err(_) => assert!((0..=3).contains(&loose.code), "{case}: exit {}", loose.code),
    }
    let show = trace_diff(&[], &["--show", mutated.to_str().unwrap()], case);
    assert_eq!(
        show.code == 0,
        verdict.is_ok(),
        "{case}: --show exits {} but the reader says {verdict:?}",
        show.code
    );
    match verdict {
        Err(_) => Case::Refused,
        Ok(d) if d == expected => Case::Equal,
        Ok(_) => Case::Different,
    }
}

#[test]
fn bit_flips_anywhere() {
    let dir = tempfile::tempdir().unwrap();
    let mut tally = Tally::default();
    for (i, original) in originals(dir.path()).into_iter().enumerate() {
        let mut rng = Rng::seeded(1, i);
        let bytes = std::fs::read(&original).unwrap();
        for k in 0..12 * scale() {
            let mut m = bytes.clone();
            let at = rng.below(m.len());
            m[at] ^= 1 << rng.below(8);
            let path = dir.path().join("flip.trace");
            std::fs::write(&path, &m).unwrap();
            tally.add(check_pair(
                &original,
                &path,
                &format!("{} flip #{k} at byte {at}", original.display()),
            ));
        }
    }
    tally.print("bit flips");
}

#[test]
fn truncation_at_every_offset_of_a_small_trace() {
    let dir = tempfile::tempdir().unwrap();
    let original = vectors().remove(0);
    let bytes = std::fs::read(&original).unwrap();
    for len in 0..bytes.len() {
        let path = dir.path().join("cut.trace");
        std::fs::write(&path, &bytes[..len]).unwrap();
        let case = format!("{} cut to {len} bytes", original.display());
        assert!(
            Trace::open(&path).is_err(),
            "{case}: a truncated trace opened"
        );
        // The binary on every 4th length (the reader, in-process, on every one).
        if len % 4 == 0 {
            check_pair(&original, &path, &case);
        }
    }
}

/// One edit of the index JSON; the footer is re-digested by `rewrite_index`, so the file
/// opens unless the edit breaks the index itself.
fn edit_index(ix: &mut Value, rng: &mut Rng) -> String {
    let n_t = ix["tensors"].as_array().map_or(0, Vec::len);
    let n_d = ix["decisions"].as_array().map_or(0, Vec::len);
    let (t, d) = (rng.below(n_t), rng.below(n_d));
    let values = [
        json!(0),
        json!(-1),
        json!(1u64 << 62),
        json!(u64::MAX),
        json!(""),
        json!(null),
        json!([]),
        json!({}),
        json!("\u{1b}[2J"),
        json!(64),
        json!(1.5),
    ];
    let v = values[rng.below(values.len())].clone();
    let tensor_fields = [
        "name",
        "dtype",
        "shape",
        "offset",
        "nbytes",
        "xxh3",
        "attributes",
    ];
    let decision_fields = ["name", "shape", "values_offset", "margins_offset", "xxh3"];
    match rng.below(7) {
        0 if n_t > 0 => {
            let f = tensor_fields[rng.below(tensor_fields.len())];
            ix["tensors"][t][f] = v.clone();
            format!("tensors[{t}].{f} = {v}")
        }
        1 if n_d > 0 => {
            let f = decision_fields[rng.below(decision_fields.len())];
            ix["decisions"][d][f] = v.clone();
            format!("decisions[{d}].{f} = {v}")
        }
        2 if n_t > 0 => {
            let key = ["step", "note", "path", "mask", "positions", ""][rng.below(6)];
            ix["tensors"][t]["attributes"][key] = v.clone();
            format!("tensors[{t}].attributes.{key:?} = {v}")
        }
        3 => {
            ix["provenance"]["seed"] = v.clone();
            format!("provenance.seed = {v}")
        }
        4 if n_t > 1 => {
            ix["tensors"].as_array_mut().unwrap().swap(0, t);
            format!("tensors[0] <-> tensors[{t}]")
        }
        5 => {
            let f = [
                "digest",
                "format",
                "version",
                "tensors",
                "decisions",
                "provenance",
            ][rng.below(6)];
            ix[f] = v.clone();
            format!("{f} = {v}")
        }
        _ if n_t > 0 => {
            let dup = ix["tensors"][t].clone();
            ix["tensors"].as_array_mut().unwrap().push(dup);
            format!("tensors[{t}] duplicated")
        }
        _ => {
            ix["unknown_field"] = v.clone();
            format!("unknown_field = {v}")
        }
    }
}

#[test]
fn index_edits_with_a_redigested_footer() {
    let dir = tempfile::tempdir().unwrap();
    let mut tally = Tally::default();
    for (i, original) in originals(dir.path()).into_iter().enumerate() {
        let mut rng = Rng::seeded(2, i);
        for k in 0..16 * scale() {
            let path = dir.path().join("edit.trace");
            std::fs::copy(&original, &path).unwrap();
            let mut what = String::new();
            rewrite_index(&path, |ix| what = edit_index(ix, &mut rng));
            tally.add(check_pair(
                &original,
                &path,
                &format!("{} edit #{k}: {what}", original.display()),
            ));
        }
    }
    tally.print("index edits");
}

fn try_write(s: &Spec, path: &Path) -> tracegate_trace::Result<()> {
    let mut w = TraceWriter::create(path, s.provenance.clone())?;
    for t in &s.tensors {
        w.tensor(&t.name, t.dtype, &t.shape, &t.bytes, &t.attrs)?;
    }
    for d in &s.decisions {
        w.decision(&d.name, &d.shape, &d.values, d.margins.as_deref())?;
    }
    w.finish()?;
    Ok(())
}

/// A trace read back into the builder's form, to be edited and written by the real writer.
fn spec_of(path: &Path) -> Spec {
    let t = Trace::open(path).unwrap();
    Spec {
        provenance: t.provenance().clone(),
        tensors: t
            .tensors()
            .iter()
            .map(|i| T {
                name: i.name.clone(),
                dtype: i.dtype,
                shape: i.shape.clone(),
                bytes: t.data(i).to_vec(),
                attrs: i.attributes.clone(),
            })
            .collect(),
        decisions: t
            .decisions()
            .iter()
            .map(|d| D {
                name: d.name.clone(),
                shape: d.shape.clone(),
                values: t.decision_values(d),
                margins: t.decision_margins(d),
            })
            .collect(),
    }
}

/// One content edit (or a provenance-only one, which leaves the content digest alone).
fn edit_content(s: &mut Spec, rng: &mut Rng) -> String {
    let (nt, nd) = (s.tensors.len(), s.decisions.len());
    let (t, d) = (rng.below(nt), rng.below(nd));
    match rng.below(11) {
        0 if nt > 0 && !s.tensors[t].bytes.is_empty() => {
            let b = rng.below(s.tensors[t].bytes.len());
            s.tensors[t].bytes[b] ^= 1 << rng.below(8);
            format!("tensor {} byte {b} flipped", s.tensors[t].name)
        }
        1 if nd > 0
            && s.decisions[d]
                .margins
                .as_ref()
                .is_some_and(|m| !m.is_empty()) =>
        {
            let m = s.decisions[d].margins.as_mut().unwrap();
            let r = rng.below(m.len());
            m[r] = f32::from_bits(m[r].to_bits() ^ (1 << rng.below(32)));
            format!("decision {} margin {r} bit flipped", s.decisions[d].name)
        }
        2 if nd > 0 && s.decisions[d].margins.is_some() => {
            let m = s.decisions[d].margins.as_mut().unwrap();
            m.iter_mut()
                .for_each(|x| *x = if *x == 0.0 { -*x } else { 1e6 });
            format!(
                "decision {} margins set to 1e6 (zeros negated)",
                s.decisions[d].name
            )
        }
        3 if nd > 0 => {
            let rows = s.decisions[d].shape.first().copied().unwrap_or(1) as usize;
            let m = &mut s.decisions[d].margins;
            *m = if m.is_some() {
                None
            } else {
                Some(vec![0.5; rows])
            };
            format!("decision {} margins toggled", s.decisions[d].name)
        }
        4 if nd > 0 && !s.decisions[d].values.is_empty() => {
            let r = rng.below(s.decisions[d].values.len());
            s.decisions[d].values[r] ^= 1;
            format!("decision {} value {r} changed", s.decisions[d].name)
        }
        5 if nt > 0 => {
            let key = ["note", "rounding"][rng.below(2)];
            s.tensors[t].attrs.extra.insert(
                key.into(),
                if rng.below(2) == 0 {
                    String::new()
                } else {
                    "x".into()
                },
            );
            format!("tensor {} extra attribute {key}", s.tensors[t].name)
        }
        6 if nt > 0 => {
            s.tensors[t].attrs.step = Some(rng.below(3) as i64);
            format!("tensor {} step", s.tensors[t].name)
        }
        7 if nt > 1 => {
            s.tensors.swap(0, t.max(1));
            format!("tensors 0 and {} swapped", t.max(1))
        }
        8 if nt > 0 => {
            s.tensors[t].name.push_str(".renamed");
            format!("tensor {} renamed", s.tensors[t].name)
        }
        9 if nt > 0 => {
            let name = s.tensors.remove(t).name;
            format!("tensor {name} dropped")
        }
        _ => {
            s.provenance["producer"] = json!("fuzz");
            "provenance producer changed (content unchanged)".into()
        }
    }
}

#[test]
fn content_edits_through_the_writer_are_never_identical() {
    let dir = tempfile::tempdir().unwrap();
    let mut tally = Tally::default();
    for (i, original) in originals(dir.path()).into_iter().enumerate() {
        let mut rng = Rng::seeded(3, i);
        let base = spec_of(&original);
        for k in 0..20 * scale() {
            let mut s = base.clone();
            let what = edit_content(&mut s, &mut rng);
            let path = dir.path().join("content.trace");
            let _ = std::fs::remove_file(&path);
            // The writer may refuse an edit (a duplicate name): then there is nothing to compare.
            if try_write(&s, &path).is_ok() {
                let case = format!("{} content edit #{k}: {what}", original.display());
                assert!(
                    judge(&path).is_ok(),
                    "{case}: the writer's output does not verify"
                );
                tally.add(check_pair(&original, &path, &case));
            } else {
                tally.refused_by_writer += 1;
            }
        }
    }
    tally.print("content edits through the writer");
}

/// A value no margin tolerance may accept against a finite margin: ±inf, NaNs of both signs and
/// other payloads, or a random bit pattern with an all-ones exponent.
fn nonfinite(rng: &mut Rng) -> f32 {
    match rng.below(5) {
        0 => f32::INFINITY,
        1 => f32::NEG_INFINITY,
        2 => f32::NAN,
        3 => -f32::NAN,
        _ => f32::from_bits(0x7f80_0000 | (rng.next() as u32 & 0x807f_ffff)),
    }
}

#[test]
fn nonfinite_margins_are_never_within_a_policy() {
    // Under a policy a margin may move by its tolerance (2·d + 1e-5·max(1,|a|,|b|)); a margin
    // made ±inf or NaN on either side would make that tolerance infinite or NaN. The property:
    // never exit 0, with the policy or by bits, whichever side holds the non-finite margin.
    let dir = tempfile::tempdir().unwrap();
    let policy =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../fixtures/policy/oracle-default.json");
    let original = model().write(&dir.path().join("model.trace"));
    let base = spec_of(&original);
    let with_policy = ["--policy", policy.to_str().unwrap()];
    // The control: the unmutated pair agrees under the policy.
    let same = trace_diff(&[&original, &original], &with_policy, "control");
    assert_eq!(same.code, 0, "control: {}", same.stdout);
    let mut rng = Rng::seeded(4, 0);
    let (mut cases, mut runs) = (0, 0);
    for k in 0..40 * scale() {
        let mut s = base.clone();
        let d = rng.below(s.decisions.len());
        let rows = s.decisions[d].margins.as_ref().map_or(0, |m| m.len());
        if rows == 0 {
            continue;
        }
        let r = rng.below(rows);
        let v = nonfinite(&mut rng);
        s.decisions[d].margins.as_mut().unwrap()[r] = v;
        let path = dir.path().join("margin.trace");
        let _ = std::fs::remove_file(&path);
        try_write(&s, &path).expect("the writer takes any margin bits");
        let case = format!(
            "margin #{k}: {} row {r} = {v:?} ({:#010x})",
            s.decisions[d].name,
            v.to_bits()
        );
        cases += 1;
        for (a, b, side) in [
            (&original, &path, "candidate"),
            (&path, &original, "reference"),
        ] {
            for flags in [&with_policy[..], &[][..]] {
                let out = trace_diff(&[a, b], flags, &case);
                runs += 1;
                assert!(
                    out.code == 1,
                    "{case} on the {side} side, flags {flags:?}: exit {}:\n{}",
                    out.code,
                    out.stdout
                );
            }
        }
    }
    use std::io::Write;
    let _ = writeln!(
        std::io::stderr(),
        "fuzz non-finite margins: {cases} cases, {runs} trace-diff runs, none within policy or identical"
    );
}

// ---------------------------------------------------------------------------------------------
// Hostile inputs beside the traces (issue 33 items 5, 7, 8, 12): patterns and policy files.

/// `--only`/`--skip` globs matched by the recursive reading of the syntax, computed bottom-up
/// over (pattern suffix, name suffix) pairs: no recursion, (m+1)·(n+1) cells. Independent of
/// the matcher under test (an automaton over tokens with collapsed star runs).
fn reference_glob(p: &str, n: &str) -> bool {
    let (p, n): (Vec<char>, Vec<char>) = (p.chars().collect(), n.chars().collect());
    let w = n.len() + 1;
    let mut dp = vec![false; (p.len() + 2) * w];
    dp[p.len() * w + n.len()] = true;
    for i in (0..p.len()).rev() {
        for j in (0..=n.len()).rev() {
            let next = |di: usize, dj: usize| dp[(i + di) * w + j + dj];
            let here = j < n.len();
            dp[i * w + j] = match p[i] {
                '*' if p.get(i + 1) == Some(&'*') => next(2, 0) || (here && next(0, 1)),
                '*' => next(1, 0) || (here && n[j] != '.' && next(0, 1)),
                '?' => here && next(1, 1),
                c => here && n[j] == c && next(1, 1),
            };
        }
    }
    dp[0]
}

/// One hostile or random pattern, a description, and what it must match among `names` (for a
/// long star run the family says it outright: the reference's table would be too large).
fn hostile_pattern(rng: &mut Rng, names: &[String]) -> (String, String, Vec<bool>) {
    let star = if rng.below(2) == 0 { "*" } else { "**" };
    match rng.below(3) {
        0 => {
            // A long star run (a 200,000-star pattern overflowed the recursive matcher's stack;
            // the policy below has one), alone or before a literal. Up to 130,000: one argument
            // of a command line holds at most 128 KiB on Linux.
            let k = 1 + rng.below(130_000);
            let tail = ["", "b", "a.b"][rng.below(3)];
            let p = format!("{}{tail}", "*".repeat(k));
            let want = names
                .iter()
                .map(|n| {
                    let body = &n[..n.len() - tail.len().min(n.len())];
                    n.ends_with(tail) && (k > 1 || !body.contains('.'))
                })
                .collect();
            (format!("{k} stars then {tail:?}"), p, want)
        }
        1 => {
            // A backtracking shape: exponential for a backtracking matcher on a long name.
            let k = 5 + rng.below(36);
            let p = format!("{}{star}b", format!("{star}a").repeat(k));
            let want = names.iter().map(|n| reference_glob(&p, n)).collect();
            (format!("({star}a)x{k}{star}b"), p, want)
        }
        _ => {
            let alphabet = ['a', 'b', '.', '*', '?'];
            let p: String = (0..1 + rng.below(10))
                .map(|_| alphabet[rng.below(alphabet.len())])
                .collect();
            let want = names.iter().map(|n| reference_glob(&p, n)).collect();
            (format!("random {p:?}"), p, want)
        }
    }
}

fn run_capture(args: &[&std::ffi::OsStr], case: &str) -> (i32, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_trace-diff"))
        .args(args)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    let code = out.status.code().unwrap_or_else(|| {
        panic!(
            "{case}: trace-diff was killed by a signal ({:?})\n{stderr}",
            out.status
        )
    });
    assert!(
        code != 101 && !stderr.contains("panicked"),
        "{case}: {stderr}"
    );
    (
        code,
        String::from_utf8_lossy(&out.stdout).into_owned(),
        stderr,
    )
}

#[test]
fn hostile_patterns_select_what_the_reference_reading_selects() {
    // Names: short random ones over {a, b, .} and legal long ones a backtracking matcher
    // cannot get through (4000 and 4001 bytes; the trace's name limit is 4096).
    let dir = tempfile::tempdir().unwrap();
    let mut rng = Rng::seeded(20, 0);
    let mut names: Vec<String> = vec![
        "a".repeat(4000),
        format!("{}b", "a".repeat(4000)),
        format!("{}b", "a.".repeat(2000)),
        format!("{}ba", "a".repeat(3998)),
    ];
    while names.len() < 40 {
        let n: String = (0..1 + rng.below(8))
            .map(|_| ['a', 'b', '.'][rng.below(3)])
            .collect();
        if !names.contains(&n) {
            names.push(n);
        }
    }
    let spec = Spec {
        provenance: engine_provenance(),
        tensors: names.iter().map(|n| t_f32(n, &[4], &[1.0; 4])).collect(),
        decisions: vec![],
    };
    let trace = spec.write(&dir.path().join("names.trace"));
    let (mut selected, mut empty) = (0, 0);
    for k in 0..24 * scale() {
        let (what, p, matches) = hostile_pattern(&mut rng, &names);
        let skip = rng.below(2) == 0;
        let case = format!(
            "case #{k}: {} {what}",
            if skip { "--skip" } else { "--only" }
        );
        let want: Vec<&String> = names
            .iter()
            .zip(&matches)
            .filter(|(_, &m)| m != skip)
            .map(|(n, _)| n)
            .collect();
        let flag = if skip { "--skip" } else { "--only" };
        let (code, stdout, stderr) = run_capture(
            &[
                "--show".as_ref(),
                trace.as_os_str(),
                flag.as_ref(),
                p.as_ref(),
                "--json".as_ref(),
            ],
            &case,
        );
        if want.is_empty() {
            assert_eq!(code, 2, "{case}: selects nothing, exit {code}");
            assert!(stderr.contains("selects no tensor"), "{case}: {stderr}");
            empty += 1;
            continue;
        }
        assert_eq!(code, 0, "{case}: {stderr}");
        let shown: Value = serde_json::from_str(&stdout).unwrap();
        let got: Vec<&str> = shown["tensors"]
            .as_array()
            .unwrap()
            .iter()
            .map(|t| t["name"].as_str().unwrap())
            .collect();
        let want: Vec<&str> = want.iter().map(|n| n.as_str()).collect();
        assert_eq!(got, want, "{case}");
        selected += 1;
    }
    // Both outcomes occur, so neither branch is vacuous.
    assert!(
        selected > 0 && empty > 0,
        "{selected} selecting, {empty} empty"
    );
    eprintln!("fuzz patterns: {selected} selections checked name by name, {empty} empty");

    // The same shapes as policy rules: the first rule whose pattern matches judges a tensor.
    let rules: Vec<Value> = [
        "*".repeat(200_000),
        format!("{}*b", "*a".repeat(40)),
        format!("{}**b", "**a".repeat(40)),
        "**".to_string(),
    ]
    .into_iter()
    .map(|p| json!({"pattern": p, "max_ulp": 0}))
    .collect();
    let policy = dir.path().join("policy.json");
    let text = json!({"format": "tracegate-policy/1", "name": "hostile", "rules": rules});
    std::fs::write(&policy, text.to_string()).unwrap();
    let (code, stdout, stderr) = run_capture(
        &[
            "--policy".as_ref(),
            policy.as_os_str(),
            trace.as_os_str(),
            trace.as_os_str(),
        ],
        "hostile policy patterns",
    );
    assert_eq!(code, 0, "{stdout}{stderr}");
}

/// `v` as JSON text with one member of its `target`-th non-empty object (pre-order) written twice. the
/// copy before or after the original with a value from `values`. Returns the repeated key.
fn with_repeat(v: &Value, target: usize, rng: &mut Rng, out: &mut String) -> Option<String> {
    fn go(
        v: &Value,
        target: usize,
        seen: &mut usize,
        rng: &mut Rng,
        out: &mut String,
        dup: &mut Option<String>,
    ) {
        match v {
            Value::Object(m) => {
                // Only objects with a member are counted: there is something to repeat.
                let here = !m.is_empty() && *seen == target;
                *seen += !m.is_empty() as usize;
                let pick = rng.below(m.len().max(1));
                let before = rng.below(2) == 0;
                let copy = [
                    v.clone(),
                    json!(0),
                    json!(-1),
                    json!("x"),
                    Value::Null,
                    json!([]),
                ][rng.below(6)]
                .clone();
                out.push('{');
                for (i, (k, x)) in m.iter().enumerate() {
                    if i > 0 {
                        out.push(',');
                    }
                    let key = serde_json::to_string(k).unwrap();
                    if here && i == pick && before {
                        out.push_str(&format!("{key}:{copy},"));
                    }
                    out.push_str(&key);
                    out.push(':');
                    go(x, target, seen, rng, out, dup);
                    if here && i == pick && !before {
                        out.push_str(&format!(",{key}:{copy}"));
                    }
                    if here && i == pick {
                        *dup = Some(k.clone());
                    }
                }
                out.push('}');
            }
            Value::Array(a) => {
                out.push('[');
                for (i, x) in a.iter().enumerate() {
                    if i > 0 {
                        out.push(',');
                    }
                    go(x, target, seen, rng, out, dup);
                }
                out.push(']');
            }
            x => out.push_str(&x.to_string()),
        }
    }
    let mut dup = None;
    go(v, target, &mut 0, rng, out, &mut dup);
    dup
}

fn objects(v: &Value) -> usize {
    match v {
        Value::Object(m) => (!m.is_empty()) as usize + m.values().map(objects).sum::<usize>(),
        Value::Array(a) => a.iter().map(objects).sum(),
        _ => 0,
    }
}

#[test]
fn policy_files_with_a_repeated_key_or_that_are_not_one_regular_file_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let trace = model().write(&dir.path().join("model.trace"));
    let run = |policy: &Path, case: &str| {
        run_capture(
            &[
                "--policy".as_ref(),
                policy.as_os_str(),
                trace.as_os_str(),
                trace.as_os_str(),
            ],
            case,
        )
    };
    let policies = Path::new(env!("CARGO_MANIFEST_DIR")).join("../fixtures/policy");
    for (i, name) in ["oracle-default.json", "bf16.json", "f16.json", "q8.json"]
        .iter()
        .enumerate()
    {
        let v: Value =
            serde_json::from_str(&std::fs::read_to_string(policies.join(name)).unwrap()).unwrap();
        let n = objects(&v);
        let mut rng = Rng::seeded(21, i);
        let file = dir.path().join("policy.json");
        // Negative control: the same writer without a repeat is a policy that loads.
        let mut plain = String::new();
        assert_eq!(with_repeat(&v, usize::MAX, &mut rng, &mut plain), None);
        std::fs::write(&file, &plain).unwrap();
        let (code, out, err) = run(&file, name);
        assert_eq!(code, 0, "{name} rewritten: {out}{err}");
        for k in 0..12 * scale() {
            let target = rng.below(n);
            let mut text = String::new();
            let key = with_repeat(&v, target, &mut rng, &mut text).expect("a non-empty object");
            std::fs::write(&file, &text).unwrap();
            let case = format!("{name} repeat #{k}: key {key:?} in object {target}");
            let (code, out, err) = run(&file, &case);
            assert_eq!(code, 2, "{case}: exit {code}\n{out}{err}");
            let want = format!("duplicate key {}", serde_json::to_string(&key).unwrap());
            assert!(
                err.contains(&want) && err.contains("policy.json"),
                "{case}: {err}"
            );
        }
    }
    // Not one regular file: each refused by kind, none read (a FIFO opened without a writer
    // would block, /dev/zero would be read until memory ran out).
    let fifo = dir.path().join("fifo.json");
    assert!(Command::new("mkfifo")
        .arg(&fifo)
        .status()
        .unwrap()
        .success());
    let big = dir.path().join("big.json");
    std::fs::File::create(&big)
        .unwrap()
        .set_len(tracegate_trace::json::MAX_JSON_LEN + 1)
        .unwrap();
    for (path, want) in [
        (fifo.as_path(), "a FIFO, not a regular file"),
        (Path::new("/dev/zero"), "a device, not a regular file"),
        (Path::new("/dev/null"), "a device, not a regular file"),
        (dir.path(), "a directory, not a regular file"),
        (big.as_path(), "more than the limit"),
    ] {
        let (code, out, err) = run(path, &path.display().to_string());
        assert_eq!(code, 2, "{}: {out}{err}", path.display());
        assert!(err.contains(want), "{}: {err}", path.display());
    }
}
