//! What milestones.json records is checked or refused (issue 51), in a project made by `gate
//! init` (tests/port.rs): one id names one milestone.

use serde_json::json;

use crate::port::{gate, milestones, project};

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
