//! Round trips, digest semantics, tamper refusal and crash safety of the container.
use crate::common;

use std::path::Path;

use common::*;
use proptest::prelude::*;
use serde_json::json;
use tracegate_trace::{Attributes, DType, Error, Malformed, Tampered, Trace, TraceWriter};

fn tmp() -> tempfile::TempDir {
    tempfile::tempdir().unwrap()
}

#[test]
fn round_trip_reads_back_everything() {
    let dir = tmp();
    let p = dir.path().join("a.trace");
    let digest = write_sample(&p, sample_provenance());
    let t = Trace::open(&p).unwrap();
    t.verify().unwrap();
    assert_eq!(t.digest(), digest);
    let names: Vec<&str> = t.tensors().iter().map(|x| x.name.as_str()).collect();
    assert_eq!(names, ["embed.out", "ids", "flags"]);
    assert_eq!(t.f32_slice("embed.out").unwrap()[5], 0.5);
    let info = t.tensor_info("embed.out").unwrap();
    assert_eq!(info.shape, vec![3, 4]);
    assert_eq!(info.offset % 64, 0);
    assert_eq!(info.attributes, attrs());
    let d = t.decision_info("logits.argmax").unwrap();
    assert_eq!(t.decision_values(d), vec![5, 7, 5]);
    assert_eq!(t.decision_margins(d), Some(vec![0.25, 1.5, 0.125]));
    let r = t.decision_info("layer.00.router.topk").unwrap();
    assert_eq!(t.decision_margins(r), None);
    assert_eq!(t.provenance(), &sample_provenance());
    assert_eq!(digest.hex().len(), 64);
    assert_eq!(digest.short(), digest.hex()[..16]);
}

#[test]
fn digest_is_stable_across_writes_and_independent_of_provenance() {
    let dir = tmp();
    let a = write_sample(&dir.path().join("a.trace"), sample_provenance());
    let b = write_sample(&dir.path().join("b.trace"), sample_provenance());
    let c = write_sample(
        &dir.path().join("c.trace"),
        json!({"producer": "other", "cmd": ["x", "y"], "seed": 7}),
    );
    assert_eq!(a, b);
    assert_eq!(a, c);
    // The files differ (provenance is recorded verbatim) while the content digest does not.
    let fa = std::fs::read(dir.path().join("a.trace")).unwrap();
    let fc = std::fs::read(dir.path().join("c.trace")).unwrap();
    assert_ne!(fa, fc);
    assert_eq!(
        Trace::open(dir.path().join("c.trace"))
            .unwrap()
            .provenance()["seed"],
        7
    );
}

/// Each closure changes one content field of a one-tensor, one-decision trace.
#[test]
fn every_content_field_changes_the_digest() {
    type Edit = fn(&mut Case);
    #[derive(Clone)]
    struct Case {
        name: String,
        dtype: DType,
        shape: Vec<u64>,
        bytes: Vec<u8>,
        attrs: Attributes,
        dname: String,
        dshape: Vec<u64>,
        values: Vec<i64>,
        margins: Option<Vec<f32>>,
    }
    fn digest(c: &Case, dir: &Path, file: &str) -> tracegate_trace::Digest {
        let mut w = TraceWriter::create(dir.join(file), json!({})).unwrap();
        w.tensor(&c.name, c.dtype, &c.shape, &c.bytes, &c.attrs)
            .unwrap();
        w.decision(&c.dname, &c.dshape, &c.values, c.margins.as_deref())
            .unwrap();
        w.finish().unwrap()
    }
    let base = Case {
        name: "t".into(),
        dtype: DType::I32,
        shape: vec![2, 2],
        bytes: vec![1; 16],
        attrs: attrs().with_positions(vec![0, 1]),
        dname: "d".into(),
        dshape: vec![2],
        values: vec![3, 4],
        margins: Some(vec![0.5, 0.25]),
    };
    let edits: Vec<(&str, Edit)> = vec![
        ("tensor name", |c| c.name = "u".into()),
        ("dtype", |c| c.dtype = DType::F32),
        ("shape", |c| c.shape = vec![2, 1, 2]),
        ("one byte", |c| c.bytes[7] = 2),
        ("path", |c| c.attrs.path = Some("decode".into())),
        ("mask", |c| c.attrs.mask = Some("bidirectional".into())),
        ("positions", |c| c.attrs.positions = Some(vec![0, 3])),
        ("step", |c| c.attrs.step = Some(0)),
        ("extra attribute", |c| {
            c.attrs.extra.insert("note".into(), "x".into());
        }),
        ("decision name", |c| c.dname = "e".into()),
        ("decision shape", |c| c.dshape = vec![2, 1]),
        ("decision value", |c| c.values = vec![4, 3]),
        ("margin", |c| c.margins = Some(vec![0.5, 0.125])),
        ("margins absent", |c| c.margins = None),
        ("signed zero margin", |c| c.margins = Some(vec![0.5, -0.0])),
    ];
    let dir = tmp();
    let reference = digest(&base, dir.path(), "base.trace");
    for (what, edit) in edits {
        let mut c = base.clone();
        edit(&mut c);
        assert_ne!(
            digest(&c, dir.path(), "edit.trace"),
            reference,
            "changing the {what} did not change the digest"
        );
    }
}

#[test]
fn payload_length_is_checked_at_write_time() {
    let dir = tmp();
    let mut w = TraceWriter::create(dir.path().join("a.trace"), json!({})).unwrap();
    let e = w
        .tensor("x", DType::F32, &[2, 3], &[0u8; 20], &Attributes::default())
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("20 bytes") && e.contains("6 elements") && e.contains("= 24"),
        "{e}"
    );
    let e = w
        .decision("d", &[2], &[1, 2, 3], None)
        .unwrap_err()
        .to_string();
    assert!(e.contains("3 values") && e.contains("holds 2"), "{e}");
    let e = w
        .decision("d", &[2, 1], &[1, 2], Some(&[0.5]))
        .unwrap_err()
        .to_string();
    assert!(e.contains("1 margins") && e.contains("2 rows"), "{e}");
    let e = w
        .tensor("b", DType::Bool, &[1], &[2], &Attributes::default())
        .unwrap_err()
        .to_string();
    assert!(e.contains("bool"), "{e}");
}

#[test]
fn duplicate_names_are_refused() {
    let dir = tmp();
    let mut w = TraceWriter::create(dir.path().join("a.trace"), json!({})).unwrap();
    w.tensor_f32("x", &[1], &[1.0], &Attributes::default())
        .unwrap();
    let e = w
        .tensor_f32("x", &[1], &[1.0], &Attributes::default())
        .unwrap_err()
        .to_string();
    assert!(e.contains("duplicate tensor name \"x\""), "{e}");
    w.decision("d", &[1], &[1], None).unwrap();
    assert!(w
        .decision("d", &[1], &[1], None)
        .unwrap_err()
        .to_string()
        .contains("duplicate decision"));
}

#[test]
fn a_directory_is_refused_as_the_output_path() {
    // A private parent, so the count below sees only what this test's writer could leave.
    let dir = tmp();
    let target = dir.path().join("out");
    std::fs::create_dir(&target).unwrap();
    let e = TraceWriter::create(&target, json!({}))
        .err()
        .expect("a directory is not a trace path")
        .to_string();
    assert!(e.contains("is a directory"), "{e}");
    let names: Vec<String> = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    assert_eq!(
        names,
        ["out"],
        "the refused writer left something beside its target"
    );
}

#[test]
fn an_output_path_in_a_missing_directory_says_so_without_the_temporary_name() {
    let dir = tmp();
    let p = dir.path().join("no-such-dir").join("a.trace");
    let e = TraceWriter::create(&p, json!({}))
        .err()
        .expect("the directory does not exist")
        .to_string();
    assert!(
        e.contains(&format!("{}: the directory", p.display())) && e.contains("does not exist"),
        "{e}"
    );
    assert!(
        !e.contains("tracegate-tmp"),
        "the message shows the internal temporary name: {e}"
    );
}

#[test]
fn unfinished_writer_leaves_nothing() {
    let dir = tmp();
    let p = dir.path().join("a.trace");
    {
        let mut w = TraceWriter::create(&p, json!({})).unwrap();
        w.tensor_f32("x", &[2], &[1.0, 2.0], &Attributes::default())
            .unwrap();
        assert!(w.temporary_path().exists());
    }
    assert!(!p.exists());
    assert_eq!(
        std::fs::read_dir(dir.path()).unwrap().count(),
        0,
        "temporary file left behind"
    );
}

/// Child half of `killed_writer_leaves_nothing_at_final_path`: writes, then dies mid-trace.
#[test]
fn crash_child() {
    let Ok(path) = std::env::var("TRACEGATE_CRASH_CHILD") else {
        return;
    };
    let mut w = TraceWriter::create(&path, json!({})).unwrap();
    w.tensor_f32("x", &[1024], &vec![1.0; 1024], &Attributes::default())
        .unwrap();
    std::process::abort();
}

#[test]
fn killed_writer_leaves_nothing_at_final_path() {
    let dir = tmp();
    let p = dir.path().join("killed.trace");
    let status = std::process::Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "container::crash_child",
            "--nocapture",
            "--test-threads=1",
        ])
        .env("TRACEGATE_CRASH_CHILD", &p)
        .status()
        .unwrap();
    assert!(!status.success(), "the child was supposed to abort");
    assert!(!p.exists(), "a killed writer left a file at the final path");
    // The partial temporary file is recognisable as such and is refused if opened.
    let leftovers: Vec<_> = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    assert_eq!(leftovers.len(), 1);
    assert!(leftovers[0].to_string_lossy().ends_with(".tracegate-tmp"));
    assert!(matches!(
        Trace::open(&leftovers[0]),
        Err(Error::Malformed {
            kind: Malformed::TemporaryFile,
            ..
        })
    ));
}

/// Child half of the two tests below: records a trace, copies `TRACEGATE_COMPLETE_FROM` (a
/// finished trace) over its own temporary when given (the state between writing the footer and
/// the rename), and dies without unwinding.
#[test]
fn crash_child_with_complete_temporary() {
    let Ok(path) = std::env::var("TRACEGATE_CRASH_CHILD_COMPLETE") else {
        return;
    };
    let mut w = TraceWriter::create(&path, json!({})).unwrap();
    w.tensor_f32("x", &[4], &[1.0; 4], &Attributes::default())
        .unwrap();
    if let Ok(from) = std::env::var("TRACEGATE_COMPLETE_FROM") {
        std::fs::copy(from, w.temporary_path()).unwrap();
    }
    std::process::abort();
}

fn run_crash_child(target: &Path, complete_from: Option<&Path>) {
    let mut cmd = std::process::Command::new(std::env::current_exe().unwrap());
    cmd.args([
        "--exact",
        "container::crash_child_with_complete_temporary",
        "--nocapture",
        "--test-threads=1",
    ]);
    cmd.env("TRACEGATE_CRASH_CHILD_COMPLETE", target);
    if let Some(from) = complete_from {
        cmd.env("TRACEGATE_COMPLETE_FROM", from);
    }
    let status = cmd.status().unwrap();
    assert!(!status.success(), "the child was supposed to abort");
}

fn temporaries(dir: &Path) -> Vec<std::path::PathBuf> {
    let mut v: Vec<_> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.to_string_lossy().ends_with(".tracegate-tmp"))
        .collect();
    v.sort();
    v
}

#[test]
fn a_writer_killed_after_its_footer_leaves_nothing_a_reader_accepts() {
    let dir = tmp();
    let finished = dir.path().join("finished.trace");
    write_sample(&finished, sample_provenance());
    let target = dir.path().join("killed.trace");
    run_crash_child(&target, Some(&finished));
    assert!(!target.exists());
    let left = temporaries(dir.path());
    assert_eq!(left.len(), 1, "{left:?}");
    // Byte for byte a finished trace, yet refused: its name says no writer finished it.
    assert_eq!(
        std::fs::read(&left[0]).unwrap(),
        std::fs::read(&finished).unwrap()
    );
    let e = Trace::open(&left[0]).expect_err("a killed writer's temporary was accepted");
    assert!(
        matches!(
            e,
            Error::Malformed {
                kind: Malformed::TemporaryFile,
                ..
            }
        ),
        "{e:?}"
    );
    let e = e.to_string();
    assert!(
        e.contains("temporary file") && e.contains(&left[0].display().to_string()),
        "{e}"
    );
}

#[test]
fn the_next_writer_removes_a_dead_writers_temporaries_and_keeps_a_live_ones() {
    let dir = tmp();
    let target = dir.path().join("t.trace");
    run_crash_child(&target, None);
    let mut dead = temporaries(dir.path());
    assert_eq!(dead.len(), 1, "{dead:?}");
    // A second dead writer's (no process has a pid this large: pid_max is at most 2^22).
    dead.push(dir.path().join(".t.trace.999999999.3.tracegate-tmp"));
    std::fs::write(&dead[1], b"x").unwrap();
    // A live writer of the same target (this process) and another target's dead temporary.
    let live = TraceWriter::create(&target, json!({})).unwrap();
    let other = dir.path().join(".u.trace.999999999.0.tracegate-tmp");
    std::fs::write(&other, b"x").unwrap();
    let mut second = TraceWriter::create(&target, json!({})).unwrap();
    for d in &dead {
        assert!(
            !d.exists(),
            "a dead writer's temporary {} was kept",
            d.display()
        );
    }
    assert!(
        live.temporary_path().exists(),
        "a live writer's temporary was removed"
    );
    assert!(other.exists(), "another target's temporary was removed");
    second
        .tensor_f32("x", &[1], &[1.0], &Attributes::default())
        .unwrap();
    second.finish().unwrap();
    drop(live);
    Trace::open(&target).unwrap().verify().unwrap();
}

fn flip(path: &Path, at: usize) {
    let mut bytes = std::fs::read(path).unwrap();
    bytes[at] ^= 0x01;
    std::fs::write(path, bytes).unwrap();
}

#[test]
fn a_flipped_data_byte_is_named_by_verify() {
    let dir = tmp();
    let p = dir.path().join("a.trace");
    write_sample(&p, sample_provenance());
    let off = Trace::open(&p).unwrap().tensor_info("ids").unwrap().offset as usize;
    flip(&p, off + 4);
    let t = Trace::open(&p).unwrap(); // structure is intact
    let e = t.verify().unwrap_err();
    assert!(
        matches!(&e, Error::Tampered { kind: Tampered::TensorDigestMismatch { tensor, .. }, .. } if tensor == "ids"),
        "{e:?}"
    );
    assert!(e.to_string().contains("tensor \"ids\""), "{e}");
}

#[test]
fn a_flipped_decision_byte_is_named_by_verify() {
    let dir = tmp();
    let p = dir.path().join("a.trace");
    write_sample(&p, sample_provenance());
    let off = Trace::open(&p)
        .unwrap()
        .decision_info("logits.argmax")
        .unwrap()
        .values_offset as usize;
    flip(&p, off);
    let e = Trace::open(&p).unwrap().verify().unwrap_err();
    assert!(
        matches!(&e, Error::Tampered { kind: Tampered::DecisionDigestMismatch { decision }, .. } if decision == "logits.argmax"),
        "{e:?}"
    );
    assert!(e.to_string().contains("decision \"logits.argmax\""), "{e}");
}

#[test]
fn a_flipped_index_byte_is_refused_at_open() {
    let dir = tmp();
    let p = dir.path().join("a.trace");
    write_sample(&p, sample_provenance());
    let len = std::fs::metadata(&p).unwrap().len() as usize;
    flip(&p, len - 41); // last byte of the index
    let e = Trace::open(&p).unwrap_err();
    assert!(
        matches!(
            e,
            Error::Tampered {
                kind: Tampered::IndexDigestMismatch,
                ..
            }
        ),
        "{e}"
    );
}

#[test]
fn unknown_major_version_is_refused() {
    let dir = tmp();
    let p = dir.path().join("a.trace");
    write_sample(&p, sample_provenance());
    let mut bytes = std::fs::read(&p).unwrap();
    bytes[8] = 2;
    std::fs::write(&p, bytes).unwrap();
    let e = Trace::open(&p).unwrap_err();
    assert!(
        matches!(
            e,
            Error::Malformed {
                kind: Malformed::UnsupportedVersion { major: 2, minor: 0 },
                ..
            }
        ),
        "{e:?}"
    );
    assert!(
        e.to_string()
            .contains("format version 2.0 is not supported"),
        "{e}"
    );
}

fn arb_dtype() -> impl Strategy<Value = DType> {
    proptest::sample::select(DType::ALL.to_vec())
}

fn arb_shape() -> impl Strategy<Value = Vec<u64>> {
    // Rank 0..=5 with small dims, zero allowed: covers 0-size, scalars and rank 5.
    proptest::collection::vec(0u64..4, 0..=5)
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, .. ProptestConfig::default() })]

    #[test]
    fn any_tensor_round_trips(dtype in arb_dtype(), shape in arb_shape(), seed in any::<u64>()) {
        let n: u64 = shape.iter().product();
        let nbytes = (n as usize) * dtype.size();
        let mut state = seed | 1;
        let bytes: Vec<u8> = (0..nbytes).map(|_| {
            state ^= state << 13; state ^= state >> 7; state ^= state << 17;
            if dtype == DType::Bool { (state & 1) as u8 } else { state as u8 }
        }).collect();
        let dir = tmp();
        let p = dir.path().join("p.trace");
        let mut w = TraceWriter::create(&p, json!({})).unwrap();
        // One position per row; a scalar has no rows to give positions to.
        let a = match shape.first() {
            Some(&rows) => attrs().with_positions((0..rows as i64).collect()),
            None => Attributes { positions: None, ..attrs() },
        };
        w.tensor("t", dtype, &shape, &bytes, &a).unwrap();
        let d = w.finish().unwrap();
        let t = Trace::open(&p).unwrap();
        t.verify().unwrap();
        prop_assert_eq!(t.digest(), d);
        let info = t.tensor_info("t").unwrap();
        prop_assert_eq!(info.dtype, dtype);
        prop_assert_eq!(&info.shape, &shape);
        prop_assert_eq!(t.data(info), &bytes[..]);
    }
}

#[test]
fn positions_must_name_one_position_per_row_of_the_token_axis() {
    let dir = tmp();
    let mut w = TraceWriter::create(dir.path().join("p.trace"), json!({})).unwrap();
    let bytes = |n: usize| vec![0u8; n * 4];
    // Two positions for a 3-row tensor: which row is which token is then unknown.
    let e = w
        .tensor(
            "layer.00.hidden_in",
            DType::F32,
            &[3, 2],
            &bytes(6),
            &attrs().with_positions(vec![0, 1]),
        )
        .unwrap_err();
    assert!(e.to_string().contains("2 positions for 3 rows"), "{e}");
    // attn_probs is [heads, tokens, keys]: one position per token of axis 1, not per head.
    let probs = attrs().with_positions(vec![0, 1, 2]);
    assert!(w
        .tensor(
            "layer.00.attn_probs",
            DType::F32,
            &[2, 3, 3],
            &bytes(18),
            &probs
        )
        .is_ok());
    let e = w
        .tensor(
            "layer.01.attn_probs",
            DType::F32,
            &[3, 2, 3],
            &bytes(18),
            &probs,
        )
        .unwrap_err();
    assert!(e.to_string().contains("3 positions for 2 rows"), "{e}");
    // A scalar has no rows; a name outside the documented points is read on axis 0.
    assert!(w
        .tensor(
            "s",
            DType::F32,
            &[],
            &bytes(1),
            &attrs().with_positions(vec![0])
        )
        .is_err());
    assert!(w
        .tensor("my.point", DType::F32, &[3, 1], &bytes(3), &probs)
        .is_ok());
    // The control: rows and positions agree.
    assert!(w
        .tensor("layer.00.q", DType::F32, &[3, 2], &bytes(6), &probs)
        .is_ok());
    w.finish().unwrap();
}
