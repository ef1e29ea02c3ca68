//! Sharded traces (docs/trace-format.md, "Sharded traces", "Merging rank traces"): the `shard`
//! attribute as writers and readers hold it, and `trace-merge`, each refusal with a negative
//! control beside it, and a round trip through a real engine trace of fixtures/tiny-qwen3.

use std::path::{Path, PathBuf};
use std::process::Command;

use serde_json::{json, Value};
use tracegate_trace::{Attributes, DType, Shard, ShardKind, Trace, TraceWriter};

use crate::common::{edit_index, split_index};

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// Where cargo put `trace-merge`, and beside it the workspace's other binaries (`engine`,
/// `trace-diff`: scripts/test.sh builds them before the tests).
fn bin(name: &str) -> PathBuf {
    let dir = Path::new(env!("CARGO_BIN_EXE_trace-merge"))
        .parent()
        .unwrap();
    let path = dir.join(name);
    assert!(
        path.exists(),
        "{} is not built: cargo build --release --bins",
        path.display()
    );
    path
}

struct Run {
    code: i32,
    stdout: String,
    stderr: String,
}

fn merge_cli(inputs: &[&Path], out: &Path) -> Run {
    let o = Command::new(env!("CARGO_BIN_EXE_trace-merge"))
        .args(inputs)
        .arg("--out")
        .arg(out)
        .output()
        .unwrap();
    Run {
        code: o.status.code().unwrap(),
        stdout: String::from_utf8(o.stdout).unwrap(),
        stderr: String::from_utf8(o.stderr).unwrap(),
    }
}

fn provenance() -> Value {
    json!({"producer": "engine", "dtype": "f32", "prompt_tokens": [3, 17, 5],
           "weights_digest": "00112233445566778899aabbccddeeff"})
}

fn f32_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

/// One tensor of a hand-made rank trace: name, shape, values, shard attribute (None: none).
type T<'a> = (&'a str, &'a [u64], &'a [f32], Option<&'a str>);

fn rank_trace(dir: &Path, file: &str, provenance: Value, tensors: &[T]) -> PathBuf {
    let path = dir.join(file);
    let mut w = TraceWriter::create(&path, provenance).unwrap();
    for (name, shape, v, shard) in tensors {
        let mut a = Attributes::default();
        if let Some(s) = shard {
            a.extra.insert("shard".into(), s.to_string());
        }
        w.tensor(name, DType::F32, shape, &f32_bytes(v), &a)
            .unwrap();
    }
    w.decision("logits.argmax", &[1], &[2], Some(&[0.5]))
        .unwrap();
    w.finish().unwrap();
    path
}

/// Two ranks holding `x` [1, 4] as halves along axis 1 and `h` replicated.
fn two_good_ranks(dir: &Path) -> (PathBuf, PathBuf) {
    let a = rank_trace(
        dir,
        "r0.trace",
        provenance(),
        &[
            ("h", &[1, 2], &[1.0, 2.0], Some("rank=0/2;replicated")),
            (
                "x",
                &[1, 2],
                &[1.0, 2.0],
                Some("rank=0/2;slice;axis=1;offset=0;length=2;size=4"),
            ),
        ],
    );
    let b = rank_trace(
        dir,
        "r1.trace",
        provenance(),
        &[
            ("h", &[1, 2], &[1.0, 2.0], Some("rank=1/2;replicated")),
            (
                "x",
                &[1, 2],
                &[3.0, 4.0],
                Some("rank=1/2;slice;axis=1;offset=2;length=2;size=4"),
            ),
        ],
    );
    (a, b)
}

/// `trace-merge INPUTS --out OUT` refuses: exit 2, one line, naming every word in `words`;
/// nothing at `out`.
fn refused(inputs: &[&Path], out: &Path, words: &[&str]) {
    let run = merge_cli(inputs, out);
    assert_eq!(run.code, 2, "{}{}", run.stdout, run.stderr);
    assert_eq!(run.stderr.trim_end().lines().count(), 1, "{}", run.stderr);
    for w in words {
        assert!(
            run.stderr.contains(w),
            "{:?} does not name {w:?}",
            run.stderr
        );
    }
    assert!(!out.exists());
}

#[test]
fn the_writer_and_reader_refuse_a_malformed_shard_naming_tensor_and_value() {
    let dir = tempfile::tempdir().unwrap();
    let mut w = TraceWriter::create(dir.path().join("t.trace"), json!({})).unwrap();
    let mut bad = Attributes::default();
    bad.extra.insert("shard".into(), "rank=2/2;partial".into());
    let e = w
        .tensor("layer.00.attn_out", DType::F32, &[1], &[0; 4], &bad)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("layer.00.attn_out")
            && e.contains("rank=2/2;partial")
            && e.contains("not below"),
        "{e}"
    );
    // The registry: hidden_in is replicated, never a slice; q only along its heads.
    let heads = Shard::new(
        0,
        2,
        ShardKind::Slice {
            axis: 0,
            offset: 0,
            length: 1,
            size: 2,
        },
    );
    let e = w
        .tensor(
            "layer.00.q",
            DType::F32,
            &[1, 1, 1],
            &[0; 4],
            &Attributes::default().with_shard(&heads),
        )
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("layer.00.q") && e.contains("slice along axis 1"),
        "{e}"
    );
    // Negative control: the same attribute, well formed and allowed, is written.
    let ok = Shard::new(
        0,
        2,
        ShardKind::Slice {
            axis: 1,
            offset: 0,
            length: 1,
            size: 2,
        },
    );
    w.tensor(
        "layer.00.q",
        DType::F32,
        &[1, 1, 1],
        &[0; 4],
        &Attributes::default().with_shard(&ok),
    )
    .unwrap();
    let path = dir.path().join("t.trace");
    w.finish().unwrap();
    let t = Trace::open(&path).unwrap();
    assert_eq!(t.tensors()[0].attributes.shard().unwrap(), Some(ok));

    // A reader refuses the attribute edited into a malformed one, naming tensor and value.
    let bytes = std::fs::read(&path).unwrap();
    let (_, index) = split_index(&bytes);
    assert_eq!(
        index["tensors"][0]["attributes"]["shard"],
        "rank=0/2;slice;axis=1;offset=0;length=1;size=2"
    );
    let edited = edit_index(&bytes, |ix| {
        ix["tensors"][0]["attributes"]["shard"] =
            json!("rank=0/2;slice;axis=1;offset=01;length=1;size=2");
    });
    let bad_path = dir.path().join("bad.trace");
    std::fs::write(&bad_path, edited).unwrap();
    let e = Trace::open(&bad_path).err().unwrap().to_string();
    assert!(
        e.contains("layer.00.q") && e.contains("offset=01") && e.contains("leading zeros"),
        "{e}"
    );
    assert_eq!(e.lines().count(), 1);
}

#[test]
fn the_conformance_vectors_parse_and_refuse_as_listed() {
    let text = std::fs::read_to_string(root().join("fixtures/format/shard.json")).unwrap();
    let v: Value = serde_json::from_str(&text).unwrap();
    for case in v["valid"].as_array().unwrap() {
        let s = case["value"].as_str().unwrap();
        let shard = Shard::parse(s).unwrap_or_else(|e| panic!("{s:?}: {e}"));
        assert_eq!(shard.to_string(), s);
        assert_eq!(shard.rank, case["rank"].as_u64().unwrap(), "{s}");
        assert_eq!(shard.world, case["world"].as_u64().unwrap(), "{s}");
        let kind = case["kind"].as_str().unwrap();
        let fields = match &shard.kind {
            ShardKind::Replicated => ("replicated", json!({})),
            ShardKind::Partial => ("partial", json!({})),
            ShardKind::Slice {
                axis,
                offset,
                length,
                size,
            } => (
                "slice",
                json!({"axis": axis, "offset": offset, "length": length, "size": size}),
            ),
            ShardKind::Experts { held, of } => ("experts", json!({"held": held, "of": of})),
        };
        assert_eq!(fields.0, kind, "{s}");
        assert_eq!(fields.1, case["fields"], "{s}");
    }
    for case in v["invalid"].as_array().unwrap() {
        let s = case["value"].as_str().unwrap();
        assert!(Shard::parse(s).is_err(), "{s:?} was accepted");
    }
    assert!(v["valid"].as_array().unwrap().len() >= 4);
    assert!(v["invalid"].as_array().unwrap().len() >= 8);
}

#[test]
fn the_merge_vectors_come_out_bit_for_bit() {
    let text = std::fs::read_to_string(root().join("fixtures/format/shard.json")).unwrap();
    let v: Value = serde_json::from_str(&text).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let hex32 = |x: &Value| -> Vec<f32> {
        x.as_array()
            .unwrap()
            .iter()
            .map(|h| f32::from_bits(u32::from_str_radix(h.as_str().unwrap(), 16).unwrap()))
            .collect()
    };
    for (n, case) in v["merge"].as_array().unwrap().iter().enumerate() {
        let name = case["tensor"].as_str().unwrap();
        let mut paths = Vec::new();
        for (r, rank) in case["ranks"].as_array().unwrap().iter().enumerate() {
            let shape: Vec<u64> = serde_json::from_value(rank["shape"].clone()).unwrap();
            let values = hex32(&rank["bits"]);
            paths.push(rank_trace(
                dir.path(),
                &format!("{n}.{r}.trace"),
                provenance(),
                &[(name, &shape, &values, Some(rank["shard"].as_str().unwrap()))],
            ));
        }
        // Given rotated (2, 0, 1 for three): the order is the ranks', never the command line's.
        paths.rotate_right(1);
        let out = dir.path().join(format!("{n}.merged"));
        let refs: Vec<&Path> = paths.iter().map(|p| p.as_path()).collect();
        let run = merge_cli(&refs, &out);
        assert_eq!(run.code, 0, "{}: {}", case["name"], run.stderr);
        let t = Trace::open(&out).unwrap();
        let info = t.tensor_info(name).unwrap();
        let shape: Vec<u64> = serde_json::from_value(case["shape"].clone()).unwrap();
        assert_eq!(info.shape, shape, "{}", case["name"]);
        let got: Vec<u32> = t
            .f32_slice(name)
            .unwrap()
            .iter()
            .map(|x| x.to_bits())
            .collect();
        let want: Vec<u32> = hex32(&case["bits"]).iter().map(|x| x.to_bits()).collect();
        assert_eq!(got, want, "{}", case["name"]);
    }
}

#[test]
fn partial_sums_are_reduced_in_rank_order_and_the_report_says_so() {
    let dir = tempfile::tempdir().unwrap();
    // In f32, (1e8 + 1) - 1e8 = 0 but (1e8 - 1e8) + 1 = 1: the order shows in the result.
    let parts = [1e8f32, 1.0, -1e8];
    let paths: Vec<PathBuf> = (0..3)
        .map(|r| {
            let s = format!("rank={r}/3;partial");
            rank_trace(
                dir.path(),
                &format!("r{r}.trace"),
                provenance(),
                &[("layer.00.attn_out", &[1, 1], &[parts[r]], Some(&s))],
            )
        })
        .collect();
    let out = dir.path().join("m.trace");
    // Given as 2, 0, 1: summed in that order it would be 1.
    let run = merge_cli(&[&paths[2], &paths[0], &paths[1]], &out);
    assert_eq!(run.code, 0, "{}", run.stderr);
    assert!(
        run.stdout.contains("((rank 0 + rank 1) + rank 2)"),
        "{}",
        run.stdout
    );
    let t = Trace::open(&out).unwrap();
    assert_eq!(t.f32_slice("layer.00.attn_out").unwrap(), &[0.0]);
    // The merged tensor is the logical one: no shard attribute left.
    assert_eq!(t.tensors()[0].attributes, Attributes::default());
    // Provenance: the common keys, the order, and each rank trace's digest.
    let p = t.provenance();
    assert_eq!(p["prompt_tokens"], json!([3, 17, 5]));
    assert!(p["shards"]["reduction"]
        .as_str()
        .unwrap()
        .contains("((rank 0 + rank 1) + rank 2)"));
    for r in 0..3 {
        let d = Trace::open(&paths[r]).unwrap().digest().hex();
        assert_eq!(p["shards"]["ranks"][r]["digest"], json!(d));
        assert_eq!(p["shards"]["ranks"][r]["rank"], json!(r));
        assert!(run.stdout.contains(&d[..16]), "{}", run.stdout);
    }
}

#[test]
fn a_gap_or_an_overlap_is_refused_naming_the_rank() {
    let dir = tempfile::tempdir().unwrap();
    let (r0, r1) = two_good_ranks(dir.path());
    let out = dir.path().join("m.trace");
    // Negative control: the two halves merge into [1, 2, 3, 4].
    let run = merge_cli(&[&r0, &r1], &out);
    assert_eq!(run.code, 0, "{}", run.stderr);
    assert_eq!(
        Trace::open(&out).unwrap().f32_slice("x").unwrap(),
        &[1.0, 2.0, 3.0, 4.0]
    );
    std::fs::remove_file(&out).unwrap();

    let slice = |o: u64, l: u64| format!("rank=1/2;slice;axis=1;offset={o};length={l};size=4");
    let h: T = ("h", &[1, 2], &[1.0, 2.0], Some("rank=1/2;replicated"));
    for (shard, len, words) in [
        (slice(3, 1), 1usize, vec!["gap", "elements 2..3", "rank 1"]),
        (
            slice(1, 3),
            3,
            vec!["rank 1", "overlapping", "elements 1..4"],
        ),
    ] {
        let v = vec![9.0; len];
        let shape = [1, len as u64];
        let bad = rank_trace(
            dir.path(),
            "bad.trace",
            provenance(),
            &[h, ("x", &shape, &v, Some(&shard))],
        );
        refused(&[&r0, &bad], &out, &words);
    }
    // A gap at the end: names the rank whose slice ends before the size.
    let short = rank_trace(
        dir.path(),
        "bad.trace",
        provenance(),
        &[h, ("x", &[1, 1], &[3.0], Some(&slice(2, 1)))],
    );
    refused(&[&r0, &short], &out, &["gap", "3..4", "rank 1"]);
}

#[test]
fn a_missing_or_repeated_rank_and_a_disagreeing_world_size_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let (r0, r1) = two_good_ranks(dir.path());
    let out = dir.path().join("m.trace");
    refused(&[&r0], &out, &["rank 1 of world size 2 is missing"]);
    refused(&[&r1, &r1], &out, &["rank 1 is given twice"]);
    let three = rank_trace(
        dir.path(),
        "w3.trace",
        provenance(),
        &[
            ("h", &[1, 2], &[1.0, 2.0], Some("rank=1/3;replicated")),
            (
                "x",
                &[1, 2],
                &[3.0, 4.0],
                Some("rank=1/3;slice;axis=1;offset=2;length=2;size=4"),
            ),
        ],
    );
    refused(
        &[&r0, &three],
        &out,
        &["rank 1", "world size 3", "rank 0", "2"],
    );
    // One trace that says two ranks is no rank trace.
    let mixed = rank_trace(
        dir.path(),
        "mixed.trace",
        provenance(),
        &[
            ("h", &[1, 2], &[1.0, 2.0], Some("rank=1/2;replicated")),
            (
                "x",
                &[1, 2],
                &[3.0, 4.0],
                Some("rank=0/2;slice;axis=1;offset=2;length=2;size=4"),
            ),
        ],
    );
    refused(
        &[&r0, &mixed],
        &out,
        &["mixed.trace", "one trace is one rank"],
    );
    // Negative control.
    assert_eq!(merge_cli(&[&r1, &r0], &out).code, 0);
}

#[test]
fn ranks_of_another_run_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let (r0, _) = two_good_ranks(dir.path());
    let out = dir.path().join("m.trace");
    for (key, value) in [
        ("prompt_tokens", json!([3, 17, 6])),
        ("weights_digest", json!("ffffffffffffffffffffffffffffffff")),
        ("run_id", json!("another")),
    ] {
        let mut p = provenance();
        p[key] = value;
        let other = rank_trace(
            dir.path(),
            "other.trace",
            p,
            &[
                ("h", &[1, 2], &[1.0, 2.0], Some("rank=1/2;replicated")),
                (
                    "x",
                    &[1, 2],
                    &[3.0, 4.0],
                    Some("rank=1/2;slice;axis=1;offset=2;length=2;size=4"),
                ),
            ],
        );
        refused(&[&r0, &other], &out, &["rank 1", "another run", key]);
    }
}

#[test]
fn a_tensor_on_some_ranks_only_or_a_differing_replica_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let (r0, _) = two_good_ranks(dir.path());
    let out = dir.path().join("m.trace");
    let x: T = (
        "x",
        &[1, 2],
        &[3.0, 4.0],
        Some("rank=1/2;slice;axis=1;offset=2;length=2;size=4"),
    );
    let without_h = rank_trace(dir.path(), "r1.trace", provenance(), &[x]);
    refused(&[&r0, &without_h], &out, &["tensor \"h\"", "not on rank 1"]);
    let other_h = rank_trace(
        dir.path(),
        "r1.trace",
        provenance(),
        &[("h", &[1, 2], &[1.0, 2.5], Some("rank=1/2;replicated")), x],
    );
    refused(
        &[&r0, &other_h],
        &out,
        &["tensor \"h\" is replicated", "rank 1", "element 1"],
    );
    // A tensor without a shard attribute is replicated: it too must be identical.
    let bare_h = rank_trace(
        dir.path(),
        "r1.trace",
        provenance(),
        &[("h", &[1, 2], &[1.0, 2.5], None), x],
    );
    refused(&[&r0, &bare_h], &out, &["rank 1", "element 1"]);
    // Held two ways: a partial on one rank, a slice on the other.
    let partial_x = rank_trace(
        dir.path(),
        "r1.trace",
        provenance(),
        &[
            ("h", &[1, 2], &[1.0, 2.0], Some("rank=1/2;replicated")),
            ("x", &[1, 2], &[3.0, 4.0], Some("rank=1/2;partial")),
        ],
    );
    refused(
        &[&r0, &partial_x],
        &out,
        &["tensor \"x\"", "rank 1", "partial"],
    );
}

#[test]
fn experts_are_united_and_one_on_two_ranks_or_none_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("m.trace");
    let e = |l: usize, x: usize| format!("layer.{l:02}.expert.{x:03}.out");
    // Rank `rank` holding `held` of 4 experts, writing layer 00's tensors of `experts`; layer 00's
    // router sends its 2 rows to `routed[0]` (2 experts each), layer 01's to `routed[1]`, whose
    // tensors are not recorded (no expert tensor of layer 01 on any rank: the routing holds no
    // rank to writing one).
    let write_routed =
        |file: &str, rank: u64, held: &str, experts: &[usize], routed: [[i64; 4]; 2]| {
            let path = dir.path().join(file);
            let mut w = TraceWriter::create(&path, provenance()).unwrap();
            let shard = |kind: &str| {
                let mut a = Attributes::default();
                a.extra
                    .insert("shard".into(), format!("rank={rank}/2;{kind}"));
                a
            };
            let mut t = |name: &str, v: &[f32], a: &Attributes| {
                w.tensor(name, DType::F32, &[1, v.len() as u64], &f32_bytes(v), a)
                    .unwrap()
            };
            t("layer.00.router.logits", &[0.0; 4], &shard("replicated"));
            for &x in experts {
                let held = shard(&format!("experts;held={held};of=4"));
                t(&e(0, x), &[x as f32, 1.0], &held);
            }
            t("layer.00.mlp_out", &[1.0, 1.0], &shard("partial"));
            for (l, r) in routed.iter().enumerate() {
                w.decision(
                    &format!("layer.{l:02}.router.topk"),
                    &[2, 2],
                    r,
                    Some(&[0.1, 0.1]),
                )
                .unwrap();
            }
            w.finish().unwrap();
            path
        };
    let write = |file: &str, rank: u64, held: &str, experts: &[usize]| {
        write_routed(file, rank, held, experts, [[1, 2, 3, 2], [0, 1, 2, 3]])
    };
    let r0 = write("r0.trace", 0, "0,1", &[1]);
    let r1 = write("r1.trace", 1, "2,3", &[2, 3]);
    let run = merge_cli(&[&r0, &r1], &out);
    assert_eq!(run.code, 0, "{}", run.stderr);
    let t = Trace::open(&out).unwrap();
    let names: Vec<&str> = t.tensors().iter().map(|t| t.name.as_str()).collect();
    assert_eq!(
        names,
        [
            "layer.00.router.logits",
            "layer.00.expert.001.out",
            "layer.00.expert.002.out",
            "layer.00.expert.003.out",
            "layer.00.mlp_out"
        ]
    );
    assert_eq!(t.f32_slice("layer.00.mlp_out").unwrap(), &[2.0, 2.0]);
    std::fs::remove_file(&out).unwrap();

    // Expert 2 computed on both ranks: the tensor, its layer, the ranks, and rank 0's the extra
    // one under the contiguous split (experts 2..3 are rank 1's).
    let twice = write("r0.trace", 0, "0,1,2", &[1, 2]);
    refused(
        &[&twice, &r1],
        &out,
        &[
            "tensor \"layer.00.expert.002.out\" (expert 2 of layer 00) is on ranks 0, 1",
            "rank 0's the extra one (under the contiguous split expert 2 is rank 1's: experts 2..3)",
        ],
    );
    // Expert 2 held by both, though computed on one: the layer that routes to it and who wrote it.
    let both = write("r0.trace", 0, "0,1,2", &[1]);
    refused(
        &[&both, &r1],
        &out,
        &[
            "rank 1",
            "expert 2",
            "rank 0 holds too",
            "rank 0's the extra one",
            "layer 00 routes rows to it (decision \"layer.00.router.topk\") and rank 1 wrote tensor \"layer.00.expert.002.out\"",
        ],
    );
    // Expert 1 held by none, routed in layer 00: the layer, the tensor no rank wrote, and the rank
    // the contiguous split gives it, with its own held= list.
    let none = write("r0.trace", 0, "0", &[0]);
    refused(
        &[&none, &r1],
        &out,
        &["expert 1 of 4 is held by no rank: layer 00 routes rows to it (decision \"layer.00.router.topk\") but no rank wrote tensor \"layer.00.expert.001.out\"; under the contiguous split rank 0 holds experts 0..1 (its held= list: 0)"],
    );
    // Held by none and routed nowhere: no value is wrong, but the claim is malformed, said so.
    let unrouted = [[0, 2, 3, 2], [0, 2, 3, 0]];
    let r1 = write_routed("r1.trace", 1, "2,3", &[2, 3], unrouted);
    let none = write_routed("r0.trace", 0, "0", &[0], unrouted);
    refused(
        &[&none, &r1],
        &out,
        &["expert 1 of 4 is held by no rank: no layer routes rows to it (2 router decisions), so no value is wrong: the held= lists themselves are malformed; under the contiguous split rank 0 holds experts 0..1 (its held= list: 0)"],
    );

    // Held lists intact, but rank 0 skipped expert 1, which layer 00 routes rows to: named at its
    // layer, its tensor and its holder.
    let routed = [[0, 1, 3, 2], [0, 1, 2, 3]];
    let r1 = write_routed("r1.trace", 1, "2,3", &[2, 3], routed);
    let skipped = write_routed("r0.trace", 0, "0,1", &[0], routed);
    refused(
        &[&skipped, &r1],
        &out,
        &["tensor \"layer.00.expert.001.out\" is written by no rank, though layer 00 routes rows to expert 1 (decision \"layer.00.router.topk\")", "an expert computed on no rank; rank 0 holds it (its held= list: 0,1), as the contiguous split has it (experts 0..1)"],
    );
    // Its control: the same ranks with expert 1 written merge.
    let honest = write_routed("r0.trace", 0, "0,1", &[0, 1], routed);
    let run = merge_cli(&[&honest, &r1], &out);
    assert_eq!(run.code, 0, "{}", run.stderr);
}

// ---- the round trip through a real engine trace ------------------------------------------

/// The slice `offset .. offset + length` along `axis` of a row-major payload.
fn take(
    bytes: &[u8],
    shape: &[u64],
    axis: usize,
    size: usize,
    offset: u64,
    length: u64,
) -> Vec<u8> {
    let outer: u64 = shape[..axis].iter().product();
    let inner = shape[axis + 1..].iter().product::<u64>() as usize * size;
    let n = shape[axis] as usize;
    let mut out = Vec::new();
    for o in 0..outer as usize {
        let base = o * n * inner;
        out.extend_from_slice(
            &bytes[base + offset as usize * inner..base + (offset + length) as usize * inner],
        );
    }
    out
}

/// The tied embedding of fixtures/tiny-qwen3 (`model.embed_tokens.weight`, f32 [vocab, hidden]).
fn tied_head() -> (Vec<f32>, usize) {
    let bytes = std::fs::read(root().join("fixtures/tiny-qwen3/model.safetensors")).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header: Value = serde_json::from_slice(&bytes[8..8 + n]).unwrap();
    let e = &header["model.embed_tokens.weight"];
    assert_eq!(e["dtype"], "F32");
    let [a, b] = [0, 1].map(|i| e["data_offsets"][i].as_u64().unwrap() as usize);
    let w = bytes[8 + n + a..8 + n + b]
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
        .collect();
    (w, e["shape"][1].as_u64().unwrap() as usize)
}

/// The ordered dot of docs/numerics.md §2 over `k in range`, from +0.0, no FMA.
fn dot(x: &[f32], w: &[f32], range: std::ops::Range<usize>) -> f32 {
    let mut acc = 0.0f32;
    for k in range {
        acc += x[k] * w[k];
    }
    acc
}

enum Logits {
    /// Split along the vocabulary: each rank holds its columns.
    Vocab,
    /// Split along the hidden size: each rank computes half of every dot product.
    Hidden,
}

/// Writes rank `rank` of 2 of the engine trace `src`: q, k, v by heads, attn_probs by heads,
/// logits as `logits` says, every other tensor replicated.
fn split_rank(src: &Trace, rank: u64, logits: &Logits, out: &Path) {
    let mut w = TraceWriter::create(out, src.provenance().clone()).unwrap();
    let (head, hidden) = tied_head();
    for t in src.tensors() {
        let point = tracegate_trace::names::point(&t.name).map(|p| p.name);
        let bytes = src.data(t);
        let size = t.dtype.size();
        let slice_axis = match point {
            Some("q" | "k" | "v") => Some(1),
            Some("attn_probs") => Some(0),
            // decode.0000.logits (the prompt's last row again) has no final_norm.out of its
            // own: sliced by the vocabulary either way.
            Some("logits")
                if matches!(logits, Logits::Vocab)
                    || src
                        .tensor_info(&t.name.replace("logits", "final_norm.out"))
                        .is_none() =>
            {
                Some(1)
            }
            _ => None,
        };
        let (shard, shape, data) = if let Some(axis) = slice_axis {
            let n = t.shape[axis];
            let (offset, length) = if rank == 0 {
                (0, n / 2)
            } else {
                (n / 2, n - n / 2)
            };
            let mut shape = t.shape.clone();
            shape[axis] = length;
            (
                ShardKind::Slice {
                    axis,
                    offset,
                    length,
                    size: n,
                },
                shape,
                take(bytes, &t.shape, axis, size, offset, length),
            )
        } else if point == Some("logits") {
            // The tied head's dot products, each rank over its half of the hidden size.
            let x = src
                .f32_slice(&t.name.replace("logits", "final_norm.out"))
                .unwrap();
            let (rows, vocab) = (t.shape[0] as usize, t.shape[1] as usize);
            let k = if rank == 0 {
                0..hidden / 2
            } else {
                hidden / 2..hidden
            };
            let mut v = Vec::with_capacity(rows * vocab);
            for r in 0..rows {
                for c in 0..vocab {
                    v.push(dot(
                        &x[r * hidden..(r + 1) * hidden],
                        &head[c * hidden..(c + 1) * hidden],
                        k.clone(),
                    ));
                }
            }
            (ShardKind::Partial, t.shape.clone(), f32_bytes(&v))
        } else {
            (ShardKind::Replicated, t.shape.clone(), bytes.to_vec())
        };
        let attrs = t.attributes.clone().with_shard(&Shard::new(rank, 2, shard));
        w.tensor(&t.name, t.dtype, &shape, &data, &attrs).unwrap();
    }
    for d in src.decisions() {
        let m = src.decision_margins(d);
        w.decision(&d.name, &d.shape, &src.decision_values(d), m.as_deref())
            .unwrap();
    }
    w.finish().unwrap();
}

#[test]
fn an_engine_trace_split_into_two_ranks_merges_back() {
    let dir = tempfile::tempdir().unwrap();
    let reference = dir.path().join("engine.trace");
    let o = Command::new(bin("engine"))
        .args(["trace", "--model"])
        .arg(root().join("fixtures/tiny-qwen3"))
        .args([
            "--tokens",
            "3,17,5,9",
            "--capture",
            "internals",
            "--generate",
            "2",
            "--out",
        ])
        .arg(&reference)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let src = Trace::open(&reference).unwrap();
    // Cached decode steps too: their logits are split like the prompt's.
    assert!(src.tensor_info("decode.0001.logits").is_some());
    assert!(src.tensor_info("decode.0001.final_norm.out").is_some());
    assert!(src.tensor_info("decode.0001.layer.00.attn_out").is_some());
    // The head recomputed here in the engine's order is the engine's logits, bit for bit: the
    // split below differs from it only by where the sum is cut.
    let (head, hidden) = tied_head();
    let x = src.f32_slice("final_norm.out").unwrap();
    let logits = src.f32_slice("logits").unwrap();
    let vocab = src.tensor_info("logits").unwrap().shape[1] as usize;
    for (i, l) in logits.iter().enumerate() {
        let (r, c) = (i / vocab, i % vocab);
        let full = dot(
            &x[r * hidden..(r + 1) * hidden],
            &head[c * hidden..(c + 1) * hidden],
            0..hidden,
        );
        assert_eq!(full.to_bits(), l.to_bits(), "logits element {i}");
    }

    // Heads, probabilities and the vocabulary sliced, the rest replicated: the merge is the
    // unsharded trace, digest for digest, and trace-diff says IDENTICAL.
    let ranks = [dir.path().join("v0.trace"), dir.path().join("v1.trace")];
    for (r, p) in ranks.iter().enumerate() {
        split_rank(&src, r as u64, &Logits::Vocab, p);
    }
    let merged = dir.path().join("vocab.trace");
    let run = merge_cli(&[&ranks[1], &ranks[0]], &merged);
    assert_eq!(run.code, 0, "{}", run.stderr);
    assert_eq!(Trace::open(&merged).unwrap().digest(), src.digest());
    let diff = Command::new(bin("trace-diff"))
        .arg(&reference)
        .arg(&merged)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&diff.stdout);
    assert_eq!(
        diff.status.code(),
        Some(0),
        "{stdout}{}",
        String::from_utf8_lossy(&diff.stderr)
    );
    assert!(stdout.contains("IDENTICAL"), "{stdout}");

    // The head split along the hidden size: two partial dot products reduced in rank order are
    // the one-process dot cut in two, within rounding of it (not bit for bit: the one-process
    // order adds the second half onto the first's running sum). trace-diff under the f32
    // policy judges it, and no decision moves.
    for (r, p) in ranks.iter().enumerate() {
        split_rank(&src, r as u64, &Logits::Hidden, p);
    }
    let merged = dir.path().join("hidden.trace");
    let run = merge_cli(&[&ranks[0], &ranks[1]], &merged);
    assert_eq!(run.code, 0, "{}", run.stderr);
    assert!(
        run.stdout
            .contains("(rank 0 + rank 1): 2 tensor(s) (first logits)"),
        "{}",
        run.stdout
    );
    let diff = Command::new(bin("trace-diff"))
        .arg(&reference)
        .arg(&merged)
        .args(["--policy", "f32"])
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&diff.stdout);
    assert_eq!(
        diff.status.code(),
        Some(0),
        "{stdout}{}",
        String::from_utf8_lossy(&diff.stderr)
    );
    // Negative control: a rank whose half of the head is lost (zeros) is far outside.
    let src1 = Trace::open(&ranks[1]).unwrap();
    let zeros = dir.path().join("z1.trace");
    let mut w = TraceWriter::create(&zeros, src1.provenance().clone()).unwrap();
    for t in src1.tensors() {
        let data = if t.name == "logits" {
            vec![0u8; t.nbytes as usize]
        } else {
            src1.data(t).to_vec()
        };
        w.tensor(&t.name, t.dtype, &t.shape, &data, &t.attributes)
            .unwrap();
    }
    for d in src1.decisions() {
        let m = src1.decision_margins(d);
        w.decision(&d.name, &d.shape, &src1.decision_values(d), m.as_deref())
            .unwrap();
    }
    w.finish().unwrap();
    let bad = dir.path().join("bad.trace");
    assert_eq!(merge_cli(&[&ranks[0], &zeros], &bad).code, 0);
    let diff = Command::new(bin("trace-diff"))
        .arg(&reference)
        .arg(&bad)
        .args(["--policy", "f32"])
        .output()
        .unwrap();
    assert_eq!(
        diff.status.code(),
        Some(1),
        "{}",
        String::from_utf8_lossy(&diff.stdout)
    );
}

// ---- bounded fuzz: the parser on any string, the merge on random splits -------------------

mod fuzz {
    use super::*;
    use proptest::prelude::*;
    use proptest::test_runner::RngSeed;

    /// Strings near the grammar: its own tokens in any order, digits, separators, and a few
    /// bytes outside it.
    fn near_grammar() -> impl Strategy<Value = String> {
        let token = prop::sample::select(vec![
            "rank=",
            "/",
            ";",
            ",",
            "=",
            "0",
            "1",
            "2",
            "01",
            "9",
            "18446744073709551616",
            "replicated",
            "partial",
            "slice",
            "experts",
            "axis=",
            "offset=",
            "length=",
            "size=",
            "held=",
            "of=",
            " ",
            "-",
            "é",
            "\u{0}",
        ]);
        prop::collection::vec(token, 0..14).prop_map(|v| v.concat())
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 256, rng_seed: RngSeed::Fixed(53), .. ProptestConfig::default() })]

        /// Never a panic; what is accepted has exactly the spelling it prints.
        #[test]
        fn the_parser_refuses_or_round_trips(s in prop_oneof![near_grammar(), ".{0,40}"]) {
            if let Ok(shard) = Shard::parse(&s) {
                prop_assert_eq!(shard.to_string(), s);
            }
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 24, rng_seed: RngSeed::Fixed(53), .. ProptestConfig::default() })]

        /// A tensor cut along either axis at random points (empty pieces included) into 1 to 4
        /// ranks merges back to its own bits, and a replicated one stays as it is.
        #[test]
        fn a_random_split_merges_back(
            rows in 0u64..5,
            cols in 1u64..6,
            axis in 0usize..2,
            cuts in prop::collection::vec(0u64..6, 0..3),
            seed in any::<u32>(),
        ) {
            let shape = [rows, cols];
            let n = shape[axis];
            let mut cuts: Vec<u64> = cuts.into_iter().map(|c| c.min(n)).collect();
            cuts.sort();
            let bounds: Vec<u64> = std::iter::once(0).chain(cuts).chain(std::iter::once(n)).collect();
            let world = bounds.len() as u64 - 1;
            let values: Vec<f32> = (0..rows * cols)
                .map(|i| f32::from_bits((i as u32).wrapping_mul(2654435761) ^ seed))
                .collect();
            let bytes = f32_bytes(&values);
            let dir = tempfile::tempdir().unwrap();
            let mut paths = Vec::new();
            for r in 0..world {
                let (o, l) = (bounds[r as usize], bounds[r as usize + 1] - bounds[r as usize]);
                let mut s = shape;
                s[axis] = l;
                let part: Vec<f32> = take(&bytes, &shape, axis, 4, o, l)
                    .chunks_exact(4)
                    .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
                    .collect();
                let sl = format!("rank={r}/{world};slice;axis={axis};offset={o};length={l};size={n}");
                let rep = format!("rank={r}/{world};replicated");
                paths.push(rank_trace(
                    dir.path(),
                    &format!("r{r}.trace"),
                    provenance(),
                    &[("x", &s, &part, Some(&sl)), ("h", &shape, &values, Some(&rep))],
                ));
            }
            paths.reverse();
            let out = dir.path().join("m.trace");
            let m = tracegate_trace::merge::merge(&paths, &out).unwrap();
            prop_assert_eq!(m.world, world);
            let t = Trace::open(&out).unwrap();
            for name in ["x", "h"] {
                let info = t.tensor_info(name).unwrap();
                prop_assert_eq!(&info.shape, &shape.to_vec());
                prop_assert_eq!(t.data(info), &bytes[..]);
            }
        }
    }
}

#[test]
fn a_rank_pattern_takes_the_rank_files_on_disk_in_trace_merge_and_trace_diff() {
    let dir = tempfile::tempdir().unwrap();
    let ranks = dir.path().join("ranks");
    std::fs::create_dir(&ranks).unwrap();
    let (r0, r1) = two_good_ranks(&ranks);
    let pattern = ranks.join("r{rank}.trace");
    let (listed, by_pattern) = (dir.path().join("a.trace"), dir.path().join("b.trace"));
    assert_eq!(merge_cli(&[&r0, &r1], &listed).code, 0);
    let run = merge_cli(&[&pattern], &by_pattern);
    assert_eq!(run.code, 0, "{}", run.stderr);
    let digest = |p: &Path| Trace::open(p).unwrap().digest();
    assert_eq!(digest(&listed), digest(&by_pattern));

    // trace-diff merges a {rank} side first and says so; a defect in a rank still shows.
    let diff = |reference: &Path, candidate: &Path| {
        let o = Command::new(bin("trace-diff"))
            .arg(reference)
            .arg(candidate)
            .output()
            .unwrap();
        let out = String::from_utf8(o.stdout).unwrap();
        (
            o.status.code().unwrap(),
            out,
            String::from_utf8(o.stderr).unwrap(),
        )
    };
    let (code, out, err) = diff(&listed, &pattern);
    assert_eq!(code, 0, "{out}{err}");
    assert!(
        out.lines()
            .next()
            .unwrap()
            .starts_with("candidate: 2 rank traces of world size 2 merged"),
        "{out}"
    );
    rank_trace(
        &ranks,
        "r1.trace",
        provenance(),
        &[
            ("h", &[1, 2], &[1.0, 2.0], Some("rank=1/2;replicated")),
            (
                "x",
                &[1, 2],
                &[3.0, 4.5],
                Some("rank=1/2;slice;axis=1;offset=2;length=2;size=4"),
            ),
        ],
    );
    let (code, out, _) = diff(&listed, &pattern);
    assert_eq!(code, 1, "{out}");
    assert!(out.contains("\"x\"") || out.contains(" x "), "{out}");

    // A missing rank and a pattern that matches nothing are refused, naming why.
    std::fs::remove_file(ranks.join("r1.trace")).unwrap();
    let out = dir.path().join("c.trace");
    refused(&[&pattern], &out, &["rank 1 of world size 2 is missing"]);
    let (code, _, err) = diff(&listed, &pattern);
    assert_eq!(code, 2);
    assert!(err.contains("rank 1 of world size 2 is missing"), "{err}");
    refused(
        &[&ranks.join("s{rank}.trace")],
        &out,
        &["no rank trace matches"],
    );
}
