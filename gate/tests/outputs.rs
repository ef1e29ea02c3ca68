//! What the gate writes besides traces, under hostile conditions: a closed stdout (`gate … |
//! true`) is no crash and loses no report; an output location that cannot take a file is
//! refused before anything runs. (A write that fails midway leaves none of the run's reports and
//! no temporary: trace/src/output.rs's test, and trace-diff's full-disk test in diff/tests/cli.rs.)

use crate::common;

use std::path::Path;
use std::process::{Command, Stdio};

use common::{python, repo};

/// A pipe whose reading end is already closed: every write to it fails with EPIPE.
fn closed_pipe() -> Stdio {
    let (reader, writer) = std::io::pipe().unwrap();
    drop(reader);
    Stdio::from(writer)
}

/// `gate m0` on one prompt, the oracle left out by a Python without torch (it is NOT CHECKED).
fn m0(dir: &Path, report: &Path, html: &Path) -> Command {
    let block = dir.join("block");
    std::fs::create_dir_all(&block).unwrap();
    std::fs::write(block.join("torch.py"), "raise ImportError('blocked')\n").unwrap();
    let mut cmd = common::gate();
    cmd.current_dir(repo())
        .args(["m0", "--model", "fixtures/tiny-qwen3", "--only", "edge64"])
        .arg("--work")
        .arg(dir.join("work"))
        .arg("--report")
        .arg(report)
        .arg("--html")
        .arg(html)
        .env("TRACEGATE_PYTHON", python())
        .env("PYTHONPATH", &block);
    cmd
}

fn names(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    v.sort();
    v
}

#[test]
fn a_closed_stdout_is_no_crash_and_the_reports_are_written() {
    let dir = tempfile::tempdir().unwrap();
    // The control: the same run with stdout read.
    let (report, html) = (dir.path().join("a.json"), dir.path().join("a.html"));
    let seen = m0(dir.path(), &report, &html).output().unwrap();
    let expected = seen.status.code();
    assert!(
        matches!(expected, Some(0 | 4)),
        "{}",
        String::from_utf8_lossy(&seen.stderr)
    );
    assert!(report.is_file() && html.is_file());
    let (report, html) = (dir.path().join("b.json"), dir.path().join("b.html"));
    let out = m0(dir.path(), &report, &html)
        .stdout(closed_pipe())
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), expected, "{stderr}");
    assert!(!stderr.contains("panicked"), "{stderr}");
    assert!(report.is_file() && html.is_file(), "{stderr}");
    let a: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.path().join("a.json")).unwrap()).unwrap();
    let b: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&report).unwrap()).unwrap();
    assert_eq!(a[0]["exit_code"], b[0]["exit_code"]);

    // The verb that only prints.
    let out = common::gate()
        .arg("workers")
        .env("TRACEGATE_RUNTIME_DIR", dir.path().join("runtime"))
        .stdout(closed_pipe())
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "{stderr}");
    assert!(!stderr.contains("panicked"), "{stderr}");
}

#[test]
fn an_output_location_that_cannot_take_a_file_is_refused_before_anything_runs() {
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("missing");
    let file = dir.path().join("a-file");
    std::fs::write(&file, "").unwrap();
    let ok = |name: &str| dir.path().join(name);
    for (report, html, flag, why) in [
        (
            missing.join("r.json"),
            ok("p.html"),
            "--report",
            "does not exist",
        ),
        (
            ok("r.json"),
            missing.join("p.html"),
            "--html",
            "does not exist",
        ),
        (
            ok("r.json"),
            file.join("p.html"),
            "--html",
            "is not a directory",
        ),
        (
            dir.path().to_path_buf(),
            ok("p.html"),
            "--report",
            "is a directory",
        ),
        // One path for both: one report would overwrite the other.
        (ok("same"), ok("same"), "--html", "is also --report"),
        // A page's path that is a directory would fail only at the rename, after the run.
        (
            ok("r.json"),
            dir.path().to_path_buf(),
            "--html",
            "is a directory",
        ),
    ] {
        let _ = std::fs::remove_dir_all(dir.path().join("work"));
        let out = m0(dir.path(), &report, &html).output().unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{flag}: {stderr}");
        assert!(stderr.contains(flag) && stderr.contains(why), "{stderr}");
        // Refused before any producer ran: no trace directory, nothing printed.
        assert!(
            !dir.path().join("work").exists(),
            "{flag}: the gate ran first"
        );
        assert!(
            out.stdout.is_empty(),
            "{}",
            String::from_utf8_lossy(&out.stdout)
        );
        assert!(!ok("r.json").exists(), "{flag}: a report was written");
    }
    // The control: writable locations, both written, no temporary beside them.
    let out_dir = dir.path().join("out");
    std::fs::create_dir(&out_dir).unwrap();
    let out = m0(dir.path(), &out_dir.join("r.json"), &out_dir.join("p.html"))
        .output()
        .unwrap();
    assert!(matches!(out.status.code(), Some(0 | 4)));
    assert_eq!(
        names(&out_dir),
        ["p.html".to_string(), "r.json".to_string()]
    );
}
