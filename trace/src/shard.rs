//! The `shard` attribute (docs/trace-format.md, "Sharded traces"): which part of a logical
//! tensor one rank of a sharded run holds. One string with one spelling per value:
//!
//! ```text
//! rank=R/W;replicated
//! rank=R/W;partial
//! rank=R/W;slice;axis=A;offset=O;length=L;size=N
//! rank=R/W;experts;held=E1,E2,...;of=N
//! ```
//!
//! Numbers are decimal without leading zeros. Parsing refuses every other spelling, so two
//! producers that mean the same shard write the same bytes (the attribute is content).

use std::fmt;

/// The attribute's key among a tensor's extra (string) attributes.
pub const KEY: &str = "shard";

/// What part of the logical tensor a rank holds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ShardKind {
    /// Every rank holds the whole tensor; the ranks must agree bit for bit.
    Replicated,
    /// This rank's summand: the logical tensor is the ranks' tensors summed in rank order.
    Partial,
    /// Elements `offset .. offset + length` along `axis` of a logical axis of `size`.
    Slice {
        axis: usize,
        offset: u64,
        length: u64,
        size: u64,
    },
    /// An expert-scoped tensor (`layer.NN.expert.EEE.*`) of a rank holding experts `held`
    /// (strictly ascending) of `of`: the logical layer's experts are the union of the ranks'.
    Experts { held: Vec<u64>, of: u64 },
}

/// A parsed `shard` attribute.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Shard {
    pub rank: u64,
    pub world: u64,
    pub kind: ShardKind,
}

impl fmt::Display for Shard {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "rank={}/{};", self.rank, self.world)?;
        match &self.kind {
            ShardKind::Replicated => f.write_str("replicated"),
            ShardKind::Partial => f.write_str("partial"),
            ShardKind::Slice {
                axis,
                offset,
                length,
                size,
            } => write!(
                f,
                "slice;axis={axis};offset={offset};length={length};size={size}"
            ),
            ShardKind::Experts { held, of } => {
                f.write_str("experts;held=")?;
                for (i, e) in held.iter().enumerate() {
                    if i > 0 {
                        f.write_str(",")?;
                    }
                    write!(f, "{e}")?;
                }
                write!(f, ";of={of}")
            }
        }
    }
}

/// A decimal number in its one spelling: digits only, no sign, no leading zero (but `0`).
fn number(what: &str, s: &str) -> Result<u64, String> {
    let canonical =
        !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit()) && (s == "0" || !s.starts_with('0'));
    if !canonical {
        return Err(format!(
            "{what} {s:?} is not a decimal number without leading zeros"
        ));
    }
    s.parse()
        .map_err(|_| format!("{what} {s:?} does not fit 64 bits"))
}

/// `key=value`, the key exactly `key`.
fn field<'a>(part: Option<&'a str>, key: &str) -> Result<&'a str, String> {
    let part = part.ok_or_else(|| format!("{key}= is missing"))?;
    part.strip_prefix(key)
        .and_then(|r| r.strip_prefix('='))
        .ok_or_else(|| format!("{part:?} where {key}= belongs"))
}

impl Shard {
    pub fn new(rank: u64, world: u64, kind: ShardKind) -> Shard {
        Shard { rank, world, kind }
    }

    /// Parses the attribute's value; `Err` is the reason, without the tensor's name.
    pub fn parse(value: &str) -> Result<Shard, String> {
        let mut parts = value.split(';');
        let rank_part = field(parts.next(), "rank")?;
        let (r, w) = rank_part
            .split_once('/')
            .ok_or_else(|| format!("rank={rank_part:?} is not RANK/WORLD"))?;
        let rank = number("rank", r)?;
        let world = number("world size", w)?;
        if world == 0 {
            return Err("world size 0".into());
        }
        if rank >= world {
            return Err(format!("rank {rank} is not below the world size {world}"));
        }
        let kind = match parts.next() {
            Some("replicated") => ShardKind::Replicated,
            Some("partial") => ShardKind::Partial,
            Some("slice") => {
                let axis = number("axis", field(parts.next(), "axis")?)?;
                let offset = number("offset", field(parts.next(), "offset")?)?;
                let length = number("length", field(parts.next(), "length")?)?;
                let size = number("size", field(parts.next(), "size")?)?;
                let axis = usize::try_from(axis)
                    .ok()
                    .filter(|&a| a < crate::layout::MAX_RANK)
                    .ok_or_else(|| format!("axis {axis} is past the largest rank 32"))?;
                if offset.checked_add(length).is_none_or(|end| end > size) {
                    return Err(format!(
                        "offset {offset} + length {length} is past size {size}"
                    ));
                }
                ShardKind::Slice {
                    axis,
                    offset,
                    length,
                    size,
                }
            }
            Some("experts") => {
                let list = field(parts.next(), "held")?;
                let held = list
                    .split(',')
                    .map(|e| number("expert", e))
                    .collect::<Result<Vec<u64>, String>>()?;
                let of = number("of", field(parts.next(), "of")?)?;
                if let Some(w) = held.windows(2).find(|w| w[0] >= w[1]) {
                    return Err(format!(
                        "held experts are not strictly ascending ({} then {})",
                        w[0], w[1]
                    ));
                }
                if let Some(e) = held.iter().find(|&&e| e >= of) {
                    return Err(format!("expert {e} is not below of={of}"));
                }
                ShardKind::Experts { held, of }
            }
            Some(other) => {
                return Err(format!(
                    "kind {other:?} is none of replicated, partial, slice, experts"
                ))
            }
            None => return Err("the kind is missing after rank=R/W".into()),
        };
        if let Some(extra) = parts.next() {
            return Err(format!("{extra:?} follows a complete shard"));
        }
        Ok(Shard { rank, world, kind })
    }

    /// Whether capture point `name` may be held this way by its registry entry (a name outside
    /// the registry may be held any way), checked against the tensor's `shape`; `Err` is the
    /// reason, without the tensor's name.
    pub fn check_for(&self, name: &str, shape: &[u64]) -> Result<(), String> {
        match &self.kind {
            ShardKind::Slice { axis, length, .. } => {
                let held = shape.get(*axis).copied();
                if held != Some(*length) {
                    return Err(format!(
                        "slice of length {length} along axis {axis}, but the shape {shape:?} holds {}",
                        held.map_or("no such axis".to_string(), |h| h.to_string())
                    ));
                }
            }
            ShardKind::Experts { held, .. } => {
                let n = crate::names::Name::parse(name);
                let Some(e) = n.expert else {
                    return Err(
                        "experts applies to an expert's tensor (layer.NN.expert.EEE.*)".into(),
                    );
                };
                if !held.contains(&(e as u64)) {
                    return Err(format!("expert {e} is not among the rank's held experts"));
                }
            }
            _ => {}
        }
        let Some(point) = crate::names::point(name) else {
            return Ok(());
        };
        let how = point.shard;
        let allowed = match &self.kind {
            ShardKind::Replicated => true,
            ShardKind::Partial => how.partial,
            ShardKind::Slice { axis, .. } => how.slice_axis == Some(*axis),
            ShardKind::Experts { .. } => how.experts,
        };
        if allowed {
            Ok(())
        } else {
            Err(format!(
                "capture point {:?} may be sharded only as {} (docs/trace-format.md, \"Sharded traces\")",
                point.name,
                how.describe()
            ))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_kind_round_trips_in_its_one_spelling() {
        for s in [
            "rank=0/1;replicated",
            "rank=1/2;partial",
            "rank=1/2;slice;axis=1;offset=4;length=4;size=8",
            "rank=0/4;slice;axis=0;offset=0;length=0;size=0",
            "rank=3/4;experts;held=6,7;of=8",
            "rank=0/2;experts;held=0;of=1",
        ] {
            assert_eq!(Shard::parse(s).unwrap().to_string(), s);
        }
    }

    #[test]
    fn other_spellings_and_impossible_values_are_refused() {
        for (s, why) in [
            ("", "where rank= belongs"),
            ("rank=01/2;partial", "leading zeros"),
            ("rank=+1/2;partial", "decimal"),
            ("rank=2/2;partial", "not below the world size 2"),
            ("rank=0/0;partial", "world size 0"),
            ("rank=0/2", "kind is missing"),
            ("rank=0/2;sum", "none of replicated"),
            ("rank=0/2;partial;", "follows a complete shard"),
            (
                "rank=0/2;slice;axis=1;offset=4;length=5;size=8",
                "past size 8",
            ),
            (
                "rank=0/2;slice;offset=0;axis=1;length=1;size=8",
                "axis= belongs",
            ),
            (
                "rank=0/2;slice;axis=40;offset=0;length=1;size=8",
                "largest rank",
            ),
            ("rank=0/2;experts;held=1,1;of=4", "strictly ascending"),
            ("rank=0/2;experts;held=4;of=4", "not below of=4"),
            ("rank=0/2;experts;held=;of=4", "expert \"\""),
            ("rank=0/99999999999999999999;partial", "64 bits"),
            ("Rank=0/2;partial", "rank= belongs"),
        ] {
            let e = Shard::parse(s).unwrap_err();
            assert!(e.contains(why), "{s:?}: {e}");
        }
    }

    #[test]
    fn the_registry_says_how_each_point_may_be_held() {
        let p = |s: &str| Shard::parse(s).unwrap();
        let heads = p("rank=0/2;slice;axis=1;offset=0;length=2;size=4");
        assert_eq!(heads.check_for("layer.00.q", &[5, 2, 8]), Ok(()));
        assert!(heads.check_for("layer.00.q", &[5, 3, 8]).is_err());
        assert!(heads
            .check_for("layer.00.hidden_in", &[5, 2])
            .unwrap_err()
            .contains("only as replicated"));
        assert_eq!(
            p("rank=1/2;partial").check_for("layer.00.attn_out", &[5, 8]),
            Ok(())
        );
        assert_eq!(
            p("rank=1/2;partial").check_for("decode.0001.layer.00.attn_out", &[1, 8]),
            Ok(())
        );
        assert!(p("rank=1/2;partial")
            .check_for("final_norm.out", &[5, 8])
            .is_err());
        assert_eq!(
            p("rank=1/2;replicated").check_for("logits", &[5, 8]),
            Ok(())
        );
        // A vocabulary-parallel embedding's rows are partial sums.
        assert_eq!(
            p("rank=1/2;partial").check_for("embed.out", &[5, 8]),
            Ok(())
        );
        let ep = p("rank=1/2;experts;held=2,3;of=4");
        assert_eq!(ep.check_for("layer.01.expert.003.out", &[2, 8]), Ok(()));
        assert!(ep
            .check_for("layer.01.expert.001.out", &[2, 8])
            .unwrap_err()
            .contains("expert 1 is not among"));
        assert!(ep.check_for("layer.01.mlp_out", &[2, 8]).is_err());
        // A port's own point: any kind.
        assert_eq!(p("rank=1/2;partial").check_for("my.point", &[3]), Ok(()));
    }
}
