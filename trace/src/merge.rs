//! `trace-merge`: the logical trace of a sharded run from its rank traces (docs/trace-format.md,
//! "Merging rank traces"). Slices are concatenated, partial sums reduced in rank order, expert
//! tensors united, replicated tensors and decisions required identical on every rank. Every
//! refusal is one line naming the rank (and its file).

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

use half::{bf16, f16};
use serde_json::{json, Map, Value};

use crate::attrs::Attributes;
use crate::digest::Digest;
use crate::dtype::DType;
use crate::reader::{TensorInfo, Trace};
use crate::shard::{Shard, ShardKind, KEY};
use crate::writer::TraceWriter;

/// Provenance keys that say which run a trace belongs to: rank traces of one run agree on each
/// (a key absent on one rank and present on another disagrees).
pub const RUN_KEYS: [&str; 3] = ["prompt_tokens", "weights_digest", "run_id"];

/// The placeholder a sharded run's `--out` holds, replaced by each rank's number
/// (docs/producers.md, "Sharded engines").
pub const RANK: &str = "{rank}";

/// The files on disk that match `pattern` (a path whose file name holds [`RANK`] once), with
/// their ranks, in rank order: `dir/r{rank}.trace` → `(0, dir/r0.trace)`, `(1, dir/r1.trace)`,
/// … Only decimal ranks match; a pattern without the placeholder matches nothing.
pub fn rank_files(pattern: &Path) -> Vec<(u64, PathBuf)> {
    let (Some(dir), Some(name)) = (
        pattern.parent(),
        pattern.file_name().and_then(|n| n.to_str()),
    ) else {
        return Vec::new();
    };
    let Some((head, tail)) = name.split_once(RANK) else {
        return Vec::new();
    };
    let dir = if dir.as_os_str().is_empty() {
        Path::new(".")
    } else {
        dir
    };
    let mut found: Vec<(u64, PathBuf)> = std::fs::read_dir(dir)
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| {
            let n = e.file_name().into_string().ok()?;
            let digits = n.strip_prefix(head)?.strip_suffix(tail)?;
            if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
                return None;
            }
            Some((digits.parse().ok()?, pattern.with_file_name(&n)))
        })
        .collect();
    found.sort();
    found
}

/// The rank traces of `pattern` (see [`rank_files`]), or why there are none.
pub fn rank_traces(pattern: &Path) -> Result<Vec<PathBuf>, String> {
    let found = rank_files(pattern);
    if found.is_empty() {
        return Err(format!(
            "{}: no rank trace matches (the file name's {RANK} stands for a rank number: 0, 1, …)",
            pattern.display()
        ));
    }
    Ok(found.into_iter().map(|(_, p)| p).collect())
}

/// What a merge did, for its report.
#[derive(Debug, Clone)]
pub struct Merged {
    pub world: u64,
    pub digest: Digest,
    /// Each rank's file and content digest, in rank order.
    pub ranks: Vec<(PathBuf, Digest)>,
    /// The tensors reduced from partial sums (in rank order, left to right).
    pub reduced: Vec<String>,
    pub concatenated: usize,
    pub experts: usize,
    pub replicated: usize,
}

impl Merged {
    /// The reduction order, as the report and the provenance state it.
    pub fn reduction_order(&self) -> String {
        reduction_order(self.world)
    }
}

fn reduction_order(world: u64) -> String {
    let mut s = "rank 0".to_string();
    for r in 1..world {
        s = format!("({s} + rank {r})");
    }
    s
}

struct Rank {
    path: PathBuf,
    trace: Trace,
    rank: u64,
}

impl Rank {
    fn who(&self) -> String {
        format!("rank {} ({})", self.rank, self.path.display())
    }
}

/// A tensor's `shard`, a tensor without one read as replicated.
fn shard_of(t: &TensorInfo, rank: u64, world: u64) -> Result<Shard, String> {
    Ok(t.attributes
        .shard()
        .map_err(|e| format!("tensor {:?}: {e}", t.name))?
        .unwrap_or(Shard::new(rank, world, ShardKind::Replicated)))
}

fn without_shard(a: &Attributes) -> Attributes {
    let mut out = a.clone();
    out.extra = a
        .extra
        .iter()
        .filter(|(k, _)| k.as_str() != KEY)
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect();
    out
}

/// Opens, verifies and orders the rank traces; the world size is what their `shard` attributes
/// say.
fn open_ranks(paths: &[PathBuf]) -> Result<(Vec<Rank>, u64), String> {
    if paths.is_empty() {
        return Err("no rank traces given".into());
    }
    let mut ranks: Vec<Rank> = Vec::new();
    let mut world: Option<(u64, String)> = None;
    for path in paths {
        let trace = Trace::open(path).map_err(|e| e.to_string())?;
        trace.verify().map_err(|e| e.to_string())?;
        let mut said: Option<(u64, u64, &str)> = None;
        for t in trace.tensors() {
            let Some(s) = t
                .attributes
                .shard()
                .map_err(|e| format!("{}: tensor {:?}: {e}", path.display(), t.name))?
            else {
                continue;
            };
            match said {
                None => said = Some((s.rank, s.world, &t.name)),
                Some((r, w, first)) if (r, w) != (s.rank, s.world) => {
                    return Err(format!(
                        "{}: tensor {:?} says rank {}/{} but tensor {first:?} says rank {r}/{w}: one trace is one rank",
                        path.display(),
                        t.name,
                        s.rank,
                        s.world
                    ))
                }
                Some(_) => {}
            }
        }
        let Some((rank, w, _)) = said else {
            return Err(format!(
                "{}: no tensor has a shard attribute, so it names no rank: not a rank trace",
                path.display()
            ));
        };
        match &world {
            None => world = Some((w, format!("rank {rank} ({})", path.display()))),
            Some((w0, first)) if *w0 != w => {
                return Err(format!(
                    "rank {rank} ({}) says world size {w}, but {first} says {w0}",
                    path.display()
                ))
            }
            Some(_) => {}
        }
        if let Some(other) = ranks.iter().find(|r| r.rank == rank) {
            return Err(format!(
                "rank {rank} is given twice: {} and {}",
                other.path.display(),
                path.display()
            ));
        }
        ranks.push(Rank {
            path: path.clone(),
            trace,
            rank,
        });
    }
    let world = world.expect("at least one rank").0;
    ranks.sort_by_key(|r| r.rank);
    let given: Vec<String> = ranks.iter().map(|r| r.rank.to_string()).collect();
    for r in 0..world {
        if !ranks.iter().any(|x| x.rank == r) {
            return Err(format!(
                "rank {r} of world size {world} is missing (given: rank {})",
                given.join(", ")
            ));
        }
    }
    Ok((ranks, world))
}

/// Rank traces of another run: a run key that differs from rank 0's.
fn check_same_run(ranks: &[Rank]) -> Result<(), String> {
    let first = &ranks[0];
    for r in &ranks[1..] {
        for key in RUN_KEYS {
            let a = first.trace.provenance().get(key);
            let b = r.trace.provenance().get(key);
            if a != b {
                let show = |v: Option<&Value>| v.map_or("absent".to_string(), |v| v.to_string());
                return Err(format!(
                    "{} is of another run: provenance {key} {} but rank 0's is {}",
                    r.who(),
                    show(b),
                    show(a)
                ));
            }
        }
    }
    Ok(())
}

/// Element `i` as its bits, most significant byte first, and its value for f32 and f64.
fn element_bits(bytes: &[u8], dtype: DType, i: usize) -> String {
    let size = dtype.size();
    let mut b = bytes[i * size..(i + 1) * size].to_vec();
    let value = match dtype {
        DType::F32 => format!(
            " = {:?}",
            f32::from_le_bytes(b[..].try_into().expect("4 bytes"))
        ),
        DType::F64 => format!(
            " = {:?}",
            f64::from_le_bytes(b[..].try_into().expect("8 bytes"))
        ),
        _ => String::new(),
    };
    b.reverse();
    format!("{}{value}", hex::encode(b))
}

/// The first element (flat index) where two payloads of one dtype differ.
fn first_difference(a: &[u8], b: &[u8], size: usize) -> Option<usize> {
    a.chunks_exact(size)
        .zip(b.chunks_exact(size))
        .position(|(x, y)| x != y)
}

/// `(p0 + p1) + p2 …` element by element; f16/bf16 widened to f32, summed, rounded once.
fn reduce(name: &str, dtype: DType, parts: &[&[u8]]) -> Result<Vec<u8>, String> {
    fn sum<const N: usize>(
        parts: &[&[u8]],
        to: impl Fn([u8; N]) -> f64,
        from: impl Fn(f64) -> [u8; N],
        add: impl Fn(f64, f64) -> f64,
    ) -> Vec<u8> {
        let n = parts[0].len() / N;
        let mut out = Vec::with_capacity(parts[0].len());
        for i in 0..n {
            let at = |p: &[u8]| to(p[i * N..(i + 1) * N].try_into().expect("N bytes"));
            let mut acc = at(parts[0]);
            for p in &parts[1..] {
                acc = add(acc, at(p));
            }
            out.extend_from_slice(&from(acc));
        }
        out
    }
    // Each addition rounded to f32 (for f32, f16, bf16) or f64: the values carried in f64 are
    // exactly the f32 results, so `f32(a + b)` is the f32 addition.
    let add32 = |a: f64, b: f64| ((a as f32) + (b as f32)) as f64;
    Ok(match dtype {
        DType::F64 => sum::<8>(parts, f64::from_le_bytes, |x| x.to_le_bytes(), |a, b| a + b),
        DType::F32 => sum::<4>(
            parts,
            |b| f32::from_le_bytes(b) as f64,
            |x| (x as f32).to_le_bytes(),
            add32,
        ),
        DType::F16 => sum::<2>(
            parts,
            |b| f16::from_le_bytes(b).to_f32() as f64,
            |x| f16::from_f32(x as f32).to_le_bytes(),
            add32,
        ),
        DType::BF16 => sum::<2>(
            parts,
            |b| bf16::from_le_bytes(b).to_f32() as f64,
            |x| bf16::from_f32(x as f32).to_le_bytes(),
            add32,
        ),
        other => {
            return Err(format!(
            "tensor {name:?}: a partial sum of {other} (only f64, f32, f16 and bf16 are reduced)"
        ))
        }
    })
}

/// Concatenates rank slices along `axis`, in `order` (rank indices sorted by offset).
fn concatenate(shape: &[u64], axis: usize, size: usize, parts: &[(&[u8], u64)]) -> Vec<u8> {
    let outer: u64 = shape[..axis].iter().product();
    let inner: u64 = shape[axis + 1..].iter().product::<u64>() * size as u64;
    let mut out = Vec::new();
    for o in 0..outer as usize {
        for (bytes, length) in parts {
            let chunk = (*length * inner) as usize;
            out.extend_from_slice(&bytes[o * chunk..(o + 1) * chunk]);
        }
    }
    out
}

struct Out {
    name: String,
    dtype: DType,
    shape: Vec<u64>,
    bytes: Vec<u8>,
    attributes: Attributes,
}

/// Merges one tensor present on every rank.
fn merge_common(ranks: &[Rank], world: u64, name: &str) -> Result<(Out, &'static str), String> {
    let infos: Vec<&TensorInfo> = ranks
        .iter()
        .map(|r| r.trace.tensor_info(name).expect("checked present"))
        .collect();
    let shards: Vec<Shard> = ranks
        .iter()
        .zip(&infos)
        .map(|(r, t)| shard_of(t, r.rank, world).map_err(|e| format!("{}: {e}", r.who())))
        .collect::<Result<_, _>>()?;
    let first = infos[0];
    let attributes = without_shard(&first.attributes);
    for ((r, t), s) in ranks.iter().zip(&infos).zip(&shards).skip(1) {
        if t.dtype != first.dtype {
            return Err(format!(
                "tensor {name:?}: {} holds it as {}, rank 0 as {}",
                r.who(),
                t.dtype,
                first.dtype
            ));
        }
        if std::mem::discriminant(&s.kind) != std::mem::discriminant(&shards[0].kind) {
            return Err(format!(
                "tensor {name:?}: {} holds it as {s}, rank 0 as {}",
                r.who(),
                shards[0]
            ));
        }
        if without_shard(&t.attributes) != attributes {
            return Err(format!(
                "tensor {name:?}: {} records other attributes (path, mask, positions, step) than rank 0",
                r.who()
            ));
        }
    }
    let size = first.dtype.size();
    let data: Vec<&[u8]> = ranks
        .iter()
        .zip(&infos)
        .map(|(r, t)| r.trace.data(t))
        .collect();
    let same_shape = |what: &str| -> Result<(), String> {
        for (r, t) in ranks.iter().zip(&infos).skip(1) {
            if t.shape != first.shape {
                return Err(format!(
                    "tensor {name:?} ({what}): {} has shape {:?}, rank 0 {:?}",
                    r.who(),
                    t.shape,
                    first.shape
                ));
            }
        }
        Ok(())
    };
    let out = |shape: Vec<u64>, bytes: Vec<u8>| Out {
        name: name.to_string(),
        dtype: first.dtype,
        shape,
        bytes,
        attributes: attributes.clone(),
    };
    match &shards[0].kind {
        ShardKind::Replicated => {
            same_shape("replicated")?;
            for (r, d) in ranks.iter().zip(&data).skip(1) {
                if let Some(i) = first_difference(data[0], d, size) {
                    return Err(format!(
                        "tensor {name:?} is replicated but {} differs from rank 0 at element {i} (bits {} vs {})",
                        r.who(),
                        element_bits(d, first.dtype, i),
                        element_bits(data[0], first.dtype, i)
                    ));
                }
            }
            Ok((out(first.shape.clone(), data[0].to_vec()), "replicated"))
        }
        ShardKind::Partial => {
            same_shape("partial")?;
            Ok((
                out(first.shape.clone(), reduce(name, first.dtype, &data)?),
                "partial",
            ))
        }
        ShardKind::Slice { axis, size: n, .. } => {
            let mut pieces: Vec<(u64, u64, usize)> = Vec::new();
            for (i, (r, s)) in ranks.iter().zip(&shards).enumerate() {
                let ShardKind::Slice {
                    axis: a,
                    offset,
                    length,
                    size: m,
                } = s.kind
                else {
                    unreachable!("same kind checked above")
                };
                if (a, m) != (*axis, *n) {
                    return Err(format!(
                        "tensor {name:?}: {} slices axis {a} of size {m}, rank 0 axis {axis} of size {n}",
                        r.who()
                    ));
                }
                s.check_for(name, &infos[i].shape)
                    .map_err(|e| format!("tensor {name:?}: {}: {e}", r.who()))?;
                let mut theirs = infos[i].shape.clone();
                let mut ours = first.shape.clone();
                theirs[a] = 0;
                ours[a] = 0;
                if theirs != ours {
                    return Err(format!(
                        "tensor {name:?}: {} has shape {:?}, rank 0 {:?}: only axis {a} may differ",
                        r.who(),
                        infos[i].shape,
                        first.shape
                    ));
                }
                pieces.push((offset, length, i));
            }
            pieces.sort();
            let mut end = 0u64;
            for &(offset, length, i) in &pieces {
                let who = ranks[i].who();
                if offset > end {
                    return Err(format!(
                        "tensor {name:?}: a gap: elements {end}..{offset} of axis {axis} are held by no rank ({who} starts at {offset})"
                    ));
                }
                if offset < end {
                    return Err(format!(
                        "tensor {name:?}: {who} holds elements {offset}..{} of axis {axis}, overlapping elements held before it (up to {end})",
                        offset + length
                    ));
                }
                end = offset + length;
            }
            if end != *n {
                let last = ranks[pieces.last().expect("one rank at least").2].who();
                return Err(format!(
                    "tensor {name:?}: a gap: elements {end}..{n} of axis {axis} are held by no rank (the last slice, {last}'s, ends at {end})"
                ));
            }
            let parts: Vec<(&[u8], u64)> =
                pieces.iter().map(|&(_, l, i)| (data[i], l)).collect();
            let mut shape = first.shape.clone();
            shape[*axis] = *n;
            Ok((
                out(shape.clone(), concatenate(&shape, *axis, size, &parts)),
                "slice",
            ))
        }
        ShardKind::Experts { .. } => Err(format!(
            "tensor {name:?} is held as experts on every rank: an expert's tensor is computed on one rank (docs/trace-format.md, \"Sharded traces\")"
        )),
    }
}

/// `E` of an `experts;held=…;of=E` kind (0 for another kind).
fn of_experts(kind: &ShardKind) -> u64 {
    match kind {
        ShardKind::Experts { of, .. } => *of,
        _ => 0,
    }
}

/// "layer 01" of a name (with its decode step or diffusion prefix when it has one), or "no layer".
fn layer_words(name: &str) -> String {
    let n = crate::names::Name::parse(name);
    let prefix = crate::names::Name {
        layer: None,
        expert: None,
        point: "",
        ..n
    }
    .to_string();
    match n.layer {
        Some(l) if prefix.is_empty() => format!("layer {l:02}"),
        Some(l) => format!("layer {l:02} of {}", prefix.trim_end_matches('.')),
        None => "no layer".into(),
    }
}

/// The rank whose block of `n` experts holds expert `e` under docs/numerics.md §23.1's contiguous
/// split over `world` ranks, and that block. A port may split otherwise: callers say "under the
/// contiguous split" beside it.
fn split_holder(e: u64, n: u64, world: u64) -> (u64, std::ops::Range<u64>) {
    let block = |r: u64| n * r / world..n * (r + 1) / world;
    let r = (0..world).find(|&r| block(r).contains(&e)).unwrap_or(0);
    (r, block(r))
}

/// For an expert on the ranks `on`: which of them the contiguous split does not give it ("rank 1's
/// is the extra one" — the rank named first, so the gate attributes the refusal to it).
fn extra_holder(e: u64, n: u64, world: u64, on: &[u64]) -> String {
    let (h, b) = split_holder(e, n, world);
    let extra: Vec<String> = on
        .iter()
        .filter(|&&r| r != h)
        .map(|r| format!("rank {r}'s"))
        .collect();
    if on.contains(&h) {
        format!(
            ", {} the extra one (under the contiguous split expert {e} is rank {h}'s: experts {}..{})",
            extra.join(" and "),
            b.start,
            b.end - 1
        )
    } else {
        format!(
            "; under the contiguous split expert {e} is in rank {h}'s block (experts {}..{}), none of these",
            b.start,
            b.end - 1
        )
    }
}

/// The router decisions (rank 0's, in trace order; the merge later requires them identical on
/// every rank) with the experts each routes rows to, ascending.
fn routing(first: &Trace) -> Vec<(String, std::collections::BTreeSet<u64>)> {
    first
        .decisions()
        .iter()
        .filter(|d| crate::names::Name::parse(&d.name).point == "router.topk")
        .map(|d| {
            let chosen = first
                .decision_values(d)
                .into_iter()
                .filter_map(|v| u64::try_from(v).ok())
                .collect();
            (d.name.clone(), chosen)
        })
        .collect()
}

/// The tensor expert `e`'s output would be recorded as, beside the router decision `decision`
/// (`layer.01.router.topk` → `layer.01.expert.005.out`; docs/capture-points.md).
fn expert_tensor(decision: &str, e: u64) -> String {
    let prefix = decision.strip_suffix("router.topk").unwrap_or(decision);
    format!("{prefix}expert.{e:03}.out")
}

/// A rank's held= list in words ("4,6,7"), or that it has none (it wrote no expert tensor).
fn held_words(held_by: &BTreeMap<u64, (usize, Vec<u64>)>, rank: u64) -> String {
    match held_by.get(&rank) {
        Some((_, h)) => format!(
            "its held= list: {}",
            h.iter().map(u64::to_string).collect::<Vec<_>>().join(",")
        ),
        None => "it wrote no expert tensor, so no held= list".into(),
    }
}

/// The experts' claims against each other and against the routing (docs/trace-format.md,
/// "Merging rank traces"): an expert in two ranks' held= lists; an expert of `n` in none (once
/// every rank's list is known); a routed expert whose tensor no rank wrote, in a layer whose
/// expert tensors are recorded (a rank that skipped it). Each refusal names the layer (the first
/// whose router sends rows to the expert), the tensor that would hold it, and the rank the
/// contiguous split gives it — said as the split's, not as the port's.
fn check_experts(
    ranks: &[Rank],
    world: u64,
    n: u64,
    held_by: &BTreeMap<u64, (usize, Vec<u64>)>,
    holders: &HashMap<&str, Vec<usize>>,
) -> Result<(), String> {
    let routed = routing(&ranks[0].trace);
    let written = |t: &str| holders.contains_key(t);
    // The first layer routing rows to `e`, in words, with the tensor it names.
    let where_routed = |e: u64| -> String {
        match routed.iter().find(|(_, chosen)| chosen.contains(&e)) {
            Some((d, _)) => {
                let t = expert_tensor(d, e);
                let wrote = match holders.get(t.as_str()) {
                    Some(on) => format!(
                        "rank {} wrote",
                        on.iter().map(|&j| ranks[j].rank.to_string()).collect::<Vec<_>>().join(", ")
                    ),
                    None => "no rank wrote".into(),
                };
                format!(
                    "{} routes rows to it (decision {d:?}) and {wrote} tensor {t:?}",
                    layer_words(d)
                )
            }
            None => format!(
                "no layer routes rows to it ({} router decisions), so no value is wrong: the held= lists themselves are malformed",
                routed.len()
            ),
        }
    };
    let mut owner: BTreeMap<u64, u64> = BTreeMap::new();
    for (rank, (_, held)) in held_by {
        for e in held {
            if let Some(o) = owner.insert(*e, *rank) {
                let who = ranks[held_by[rank].0].who();
                return Err(format!(
                    "{who} holds expert {e}, which rank {o} holds too: an expert on two ranks{}; {}",
                    extra_holder(*e, n, world, &[o, *rank]),
                    where_routed(*e)
                ));
            }
        }
    }
    let split = |e: u64| {
        let (h, b) = split_holder(e, n, world);
        format!(
            "under the contiguous split rank {h} holds experts {}..{} ({})",
            b.start,
            b.end - 1,
            held_words(held_by, h)
        )
    };
    if held_by.len() as u64 == world {
        if let Some(e) = (0..n).find(|e| !owner.contains_key(e)) {
            return Err(format!(
                "expert {e} of {n} is held by no rank: {}; {}",
                where_routed(e).replacen(" and no rank wrote", " but no rank wrote", 1),
                split(e)
            ));
        }
    }
    // Expert tensors are recorded (internals) where a layer has one on some rank: every expert
    // that layer routes rows to then has its tensor on its holder.
    for (d, chosen) in &routed {
        let prefix = expert_tensor(d, 0);
        let prefix = prefix.trim_end_matches("000.out");
        if !holders.keys().any(|t| t.starts_with(prefix)) {
            continue;
        }
        if let Some(e) = chosen
            .iter()
            .copied()
            .find(|&e| !written(&expert_tensor(d, e)))
        {
            let t = expert_tensor(d, e);
            let (h, b) = split_holder(e, n, world);
            let holder = match owner.get(&e) {
                Some(&r) if r == h => format!(
                    "rank {r} holds it ({}), as the contiguous split has it (experts {}..{})",
                    held_words(held_by, r),
                    b.start,
                    b.end - 1
                ),
                Some(&r) => format!(
                    "rank {r} holds it ({}); {}",
                    held_words(held_by, r),
                    split(e)
                ),
                None => split(e),
            };
            return Err(format!(
                "tensor {t:?} is written by no rank, though {} routes rows to expert {e} (decision {d:?}) and the layer's other expert tensors are recorded: an expert computed on no rank; {holder}",
                layer_words(d),
            ));
        }
    }
    Ok(())
}

/// Builds the logical trace of the rank traces `paths` at `out`.
pub fn merge(paths: &[PathBuf], out: &Path) -> Result<Merged, String> {
    let (ranks, world) = open_ranks(paths)?;
    check_same_run(&ranks)?;

    // Which rank holds each tensor; an expert's tensor lives on one rank, the rest on all.
    let mut holders: HashMap<&str, Vec<usize>> = HashMap::new();
    for (i, r) in ranks.iter().enumerate() {
        for t in r.trace.tensors() {
            holders.entry(&t.name).or_default().push(i);
        }
    }
    let mut held_by: BTreeMap<u64, (usize, Vec<u64>)> = BTreeMap::new();
    let mut of: Option<(u64, usize)> = None;
    for (i, r) in ranks.iter().enumerate() {
        for t in r.trace.tensors() {
            let s = shard_of(t, r.rank, world).map_err(|e| format!("{}: {e}", r.who()))?;
            let ShardKind::Experts { held, of: n } = &s.kind else {
                continue;
            };
            s.check_for(&t.name, &t.shape)
                .map_err(|e| format!("{}: tensor {:?}: {e}", r.who(), t.name))?;
            let on = &holders[t.name.as_str()];
            if on.len() > 1 {
                let list: Vec<u64> = on.iter().map(|&j| ranks[j].rank).collect();
                let (e, n) = (
                    crate::names::Name::parse(&t.name).expert.unwrap_or(0) as u64,
                    of_experts(&s.kind),
                );
                return Err(format!(
                    "tensor {:?} (expert {e} of {}) is on ranks {}: an expert computed on more than one rank{}",
                    t.name,
                    layer_words(&t.name),
                    list.iter().map(u64::to_string).collect::<Vec<_>>().join(", "),
                    extra_holder(e, n, world, &list)
                ));
            }
            match of {
                None => of = Some((*n, i)),
                Some((m, j)) if m != *n => {
                    return Err(format!(
                        "{} says of={n} experts, {} of={m}",
                        r.who(),
                        ranks[j].who()
                    ))
                }
                Some(_) => {}
            }
            match held_by.get(&r.rank) {
                Some((_, h)) if h != held => {
                    return Err(format!(
                    "{}: tensor {:?} says it holds experts {held:?}, another of its tensors {h:?}",
                    r.who(),
                    t.name
                ))
                }
                Some(_) => {}
                None => {
                    held_by.insert(r.rank, (i, held.clone()));
                }
            }
        }
    }
    if let Some((n, _)) = of {
        check_experts(&ranks, world, n, &held_by, &holders)?;
    }

    // Every other tensor and every decision is on every rank.
    let is_expert = |i: usize, name: &str| -> bool {
        ranks[i]
            .trace
            .tensor_info(name)
            .and_then(|t| t.attributes.shard().ok().flatten())
            .is_some_and(|s| matches!(s.kind, ShardKind::Experts { .. }))
    };
    for (i, r) in ranks.iter().enumerate() {
        for t in r.trace.tensors() {
            let on = &holders[t.name.as_str()];
            if on.len() as u64 != world && !is_expert(i, &t.name) {
                let missing = ranks
                    .iter()
                    .enumerate()
                    .find(|(j, _)| !on.contains(j))
                    .map(|(_, x)| x.who())
                    .expect("some rank lacks it");
                return Err(format!(
                    "tensor {:?} is on {} but not on {missing}",
                    t.name,
                    r.who()
                ));
            }
        }
        for d in r.trace.decisions() {
            for other in &ranks {
                if other.trace.decision_info(&d.name).is_none() {
                    return Err(format!(
                        "decision {:?} is on {} but not on {}",
                        d.name,
                        r.who(),
                        other.who()
                    ));
                }
            }
        }
    }

    // The order: rank 0's tensors held on every rank; each expert tensor after the common tensor
    // that precedes it on its rank, those of one place in (layer, expert) order.
    // Keyed by the common tensor before them (None: the start); (layer, expert, rank index, name).
    type Placed = Vec<(usize, usize, usize, String)>;
    let mut after: HashMap<Option<String>, Placed> = HashMap::new();
    for (i, r) in ranks.iter().enumerate() {
        let mut anchor: Option<String> = None;
        for t in r.trace.tensors() {
            if is_expert(i, &t.name) {
                let n = crate::names::Name::parse(&t.name);
                after.entry(anchor.clone()).or_default().push((
                    n.layer.unwrap_or(0),
                    n.expert.unwrap_or(0),
                    i,
                    t.name.clone(),
                ));
            } else {
                anchor = Some(t.name.clone());
            }
        }
    }
    for v in after.values_mut() {
        v.sort();
    }
    let mut order: Vec<(Option<usize>, String)> = Vec::new();
    let mut place = |anchor: Option<String>, order: &mut Vec<(Option<usize>, String)>| {
        for (_, _, i, name) in after.remove(&anchor).unwrap_or_default() {
            order.push((Some(i), name));
        }
    };
    place(None, &mut order);
    for t in ranks[0].trace.tensors() {
        if !is_expert(0, &t.name) {
            order.push((None, t.name.clone()));
            place(Some(t.name.clone()), &mut order);
        }
    }
    if let Some((_, list)) = after.into_iter().next() {
        // An anchor rank 0 does not have cannot be, since common tensors are on every rank.
        return Err(format!(
            "tensor {:?}: no place for it in rank 0's order",
            list[0].3
        ));
    }

    // Decisions: identical on every rank, values and margins' bits.
    let first = &ranks[0].trace;
    for d in first.decisions() {
        let values = first.decision_values(d);
        let margins = first.decision_margins(d);
        for r in &ranks[1..] {
            let e = r.trace.decision_info(&d.name).expect("checked present");
            let (v, m) = (r.trace.decision_values(e), r.trace.decision_margins(e));
            let bits = |m: &Option<Vec<f32>>| {
                m.as_ref()
                    .map(|m| m.iter().map(|x| x.to_bits()).collect::<Vec<_>>())
            };
            if e.shape != d.shape || v != values || bits(&m) != bits(&margins) {
                let at = v
                    .iter()
                    .zip(&values)
                    .position(|(a, b)| a != b)
                    .map_or("its shape or margins".to_string(), |i| format!("value {i}"));
                return Err(format!(
                    "decision {:?}: {} differs from rank 0 at {at}: a decision is the same on every rank",
                    d.name,
                    r.who()
                ));
            }
        }
    }

    // Provenance: what every rank agrees on, and each rank's trace.
    let mut provenance = Map::new();
    if let Some(p0) = first.provenance().as_object() {
        for (k, v) in p0 {
            if ranks[1..]
                .iter()
                .all(|r| r.trace.provenance().get(k) == Some(v))
            {
                provenance.insert(k.clone(), v.clone());
            }
        }
    }
    provenance.insert(
        "shards".into(),
        json!({
            "merged_by": "trace-merge",
            "world": world,
            "reduction": format!("partial sums in rank order, left to right: {}", reduction_order(world)),
            "ranks": ranks.iter().map(|r| json!({
                "rank": r.rank,
                "file": r.path.display().to_string(),
                "digest": r.trace.digest().hex(),
            })).collect::<Vec<_>>(),
        }),
    );

    // One merged tensor in memory at a time; a refusal from here on drops the writer, which
    // removes its temporary: nothing appears at `out`.
    let mut merged = Merged {
        world,
        digest: Digest([0; 32]),
        ranks: ranks
            .iter()
            .map(|r| (r.path.clone(), r.trace.digest()))
            .collect(),
        reduced: Vec::new(),
        concatenated: 0,
        experts: 0,
        replicated: 0,
    };
    let mut w = TraceWriter::create(out, Value::Object(provenance)).map_err(|e| e.to_string())?;
    let mut write = |o: Out| {
        w.tensor(&o.name, o.dtype, &o.shape, &o.bytes, &o.attributes)
            .map_err(|e| format!("{}: {e}", out.display()))
    };
    for (owner, name) in &order {
        match owner {
            Some(i) => {
                let r = &ranks[*i];
                let t = r.trace.tensor_info(name).expect("listed from it");
                merged.experts += 1;
                write(Out {
                    name: name.clone(),
                    dtype: t.dtype,
                    shape: t.shape.clone(),
                    bytes: r.trace.data(t).to_vec(),
                    attributes: without_shard(&t.attributes),
                })?;
            }
            None => {
                let (o, how) = merge_common(&ranks, world, name)?;
                match how {
                    "partial" => merged.reduced.push(name.clone()),
                    "slice" => merged.concatenated += 1,
                    _ => merged.replicated += 1,
                }
                write(o)?;
            }
        }
    }
    for d in first.decisions() {
        let margins = first.decision_margins(d);
        w.decision(
            &d.name,
            &d.shape,
            &first.decision_values(d),
            margins.as_deref(),
        )
        .map_err(|e| format!("{}: {e}", out.display()))?;
    }
    merged.digest = w.finish().map_err(|e| e.to_string())?;
    Ok(merged)
}
