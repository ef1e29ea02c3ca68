//! What a port milestone records is checked or refused (issue 51): each field of milestones.json
//! hand-edited in a project made by `gate init` (tests/port.rs) is caught, by the gate run it
//! falsifies (exit 1, a finding naming the field) or before anything runs (exit 2, one line
//! naming the field); the unedited project passes. And one id names one milestone.

use serde_json::{json, Value};

use crate::port::{gate, milestones, project, report};

/// An edit of a milestone of milestones.json.
type Edit = Box<dyn Fn(&mut Value)>;

/// milestones.json with `edit` applied to its only milestone.
fn edited(original: &Value, edit: impl Fn(&mut Value)) -> String {
    let mut m = original.clone();
    edit(&mut m["milestones"][0]);
    serde_json::to_string_pretty(&m).unwrap()
}

/// A count one more than recorded.
fn bump(v: &mut Value) {
    *v = json!(v.as_u64().unwrap() + 1);
}

/// A token other than the one recorded.
fn other_token(v: &mut Value) {
    *v = json!(v.as_i64().unwrap() ^ 1);
}

/// The check `name` of prompt `prompt` in report `r`.
fn check<'a>(r: &'a Value, prompt: &str, name: &str) -> &'a Value {
    r["prompts"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["id"] == prompt)
        .and_then(|p| {
            p["checks"]
                .as_array()
                .unwrap()
                .iter()
                .find(|c| c["check"] == name)
        })
        .unwrap_or_else(|| panic!("no {prompt}/{name} in {r}"))
}

#[test]
fn every_recorded_field_of_a_port_is_checked_or_refused_naming_it() {
    let dir = project(&[]);
    let d = dir.path();
    let ms_path = d.join("milestones.json");
    let original = milestones(d);
    let rp = d.join("r.json");
    let run = |text: &str| {
        std::fs::write(&ms_path, text).unwrap();
        let _ = std::fs::remove_file(&rp);
        gate(d, &["run", "port", "--report", rp.to_str().unwrap()], &[])
    };
    assert!(
        original["milestones"][0]["port"]["noise"]["short"].is_object(),
        "gate init recorded no noise trace: {original}"
    );

    // Negative controls: the project as recorded passes, and so does a divergence declared
    // for a prompt the set holds (it excuses nothing here).
    let out = run(&serde_json::to_string_pretty(&original).unwrap());
    assert_eq!(out.code, 0, "{}\n{}", out.stdout, out.stderr);
    let out = run(&edited(&original, |m| {
        m["models"][0]["declared_divergences"] = json!([{"prompt": "short", "check": "agrees",
            "kind": "decision_differs", "name": "decode.0000.argmax", "count": 1,
            "reason": "a declared flip"}]);
    }));
    assert_eq!(out.code, 0, "{}\n{}", out.stdout, out.stderr);

    // Refused before anything runs (exit 2), one line naming the field.
    let refused: [(&str, Edit); 4] = [
        (
            "port.golden.short.generated",
            Box::new(|m| other_token(&mut m["port"]["golden"]["short"]["generated"][0])),
        ),
        (
            "port.noise.mid.generated",
            Box::new(|m| m["port"]["noise"]["mid"]["generated"] = json!([1, 2, 3, 4])),
        ),
        (
            "models[0].family",
            Box::new(|m| m["models"][0]["family"] = json!("llama")),
        ),
        (
            "models[0].declared_divergences[0] is for prompt \"gone\"",
            Box::new(|m| {
                m["models"][0]["declared_divergences"] = json!([{"prompt": "gone",
                    "check": "agrees", "kind": "decision_differs", "name": "decode.0000.argmax",
                    "count": 1, "reason": "a prompt that is not in the set"}]);
            }),
        ),
    ];
    for (field, edit) in &refused {
        let out = run(&edited(&original, edit));
        assert_eq!(out.code, 2, "{field}: {}\n{}", out.stdout, out.stderr);
        assert!(out.stderr.contains(field), "{field}: {}", out.stderr);
        assert_eq!(out.stderr.trim().lines().count(), 1, "{}", out.stderr);
    }

    // Held to the run (exit 1): a finding naming the field, in the check that holds it.
    let failed: [(&str, &str, &str, Edit); 3] = [
        (
            "expect.short.tensors",
            "agrees",
            "count_changed",
            Box::new(|m| bump(&mut m["port"]["expect"]["short"]["tensors"])),
        ),
        (
            "expect.mid.decisions",
            "agrees",
            "count_changed",
            Box::new(|m| bump(&mut m["port"]["expect"]["mid"]["decisions"])),
        ),
        (
            "expect.short.generated",
            "generation_reference",
            "tokens_changed",
            Box::new(|m| other_token(&mut m["port"]["expect"]["short"]["generated"][3])),
        ),
    ];
    for (field, name, kind, edit) in &failed {
        let out = run(&edited(&original, edit));
        assert_eq!(out.code, 1, "{field}: {}\n{}", out.stdout, out.stderr);
        let prompt = field.split('.').nth(1).unwrap();
        let c = check(&report(&rp), prompt, name).clone();
        assert_eq!(c["status"], "FAIL", "{field}: {c}");
        let findings = c["findings"].as_array().unwrap();
        assert!(
            findings
                .iter()
                .any(|f| f["kind"] == *kind && f["detail"].as_str().unwrap().contains(field)),
            "{field}: {c}"
        );
        assert!(out.stdout.contains(field), "{field}: {}", out.stdout);
    }
}

#[test]
fn two_milestones_of_one_id_are_refused_at_load_naming_both() {
    let dir = project(&[]);
    let d = dir.path();
    let ms_path = d.join("milestones.json");
    let original = milestones(d);
    // A second milestone whose candidate fails everything.
    let mut second = original["milestones"][0].clone();
    second["port"]["candidate"]["cmd"] = json!("/bin/false {verb} {args}");
    let with_second = |id: &str| {
        let mut m = original.clone();
        let mut s = second.clone();
        s["id"] = json!(id);
        m["milestones"].as_array_mut().unwrap().push(s);
        std::fs::write(&ms_path, serde_json::to_string_pretty(&m).unwrap()).unwrap();
    };
    with_second("port");
    for args in [&["check"][..], &["run", "port"]] {
        let out = gate(d, args, &[]);
        assert_eq!(out.code, 2, "{args:?}: {}\n{}", out.stdout, out.stderr);
        assert!(
            out.stderr.contains(
                "milestone id \"port\" is used twice, by milestones[0] and milestones[1]"
            ),
            "{}",
            out.stderr
        );
    }
    // Negative control: under an id of its own, the second milestone runs, and fails.
    with_second("port-false");
    let out = gate(d, &["check"], &[]);
    assert_eq!(out.code, 1, "{}\n{}", out.stdout, out.stderr);
    assert!(
        out.stdout.contains("== gate check: 2 milestones") && out.stdout.contains("port-false"),
        "{}",
        out.stdout
    );
}
