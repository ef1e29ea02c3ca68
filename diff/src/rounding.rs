//! A bf16 candidate that truncates where it should round, or rounds away from zero (docs/traps.md,
//! trap 17; docs/diff.md, "Rounding mode"). An f32 value with any of its low 16 bits set lies
//! between two bf16 values: the one towards zero (its truncation) and the next one away from
//! zero; rounding to nearest even picks one of them. A store in another mode moves every element
//! where it picks the other one step, which a bf16 policy may call noise; but the candidate's
//! values then *are* that mode's, element after element, and rounding noise does not pick the
//! same wrong neighbour every time. The check is made per tensor (a reference f32, a candidate
//! bf16, same shape and positions), over the elements where the candidate holds one of the two
//! neighbours.

use tracegate_trace::{DType, TensorInfo, Trace};

use crate::{positions, Finding, FindingKind, Options, Report};

/// How often the wrong neighbour must win, by chance, for a producer that rounds to nearest
/// even: a finding needs the tally to be less likely than this under "either neighbour, as
/// likely as the other".
const CHANCE: f64 = 1e-9;

/// The share of those elements the wrong neighbour must hold. An honest bf16 computation is not
/// a fair coin between the neighbours: its own rounding errors lean one way (SmolLM2 in bf16
/// against itself in f32: 1,542 of 2,672 elements of one tensor away from zero, 58 %, far beyond
/// chance), while a store in another mode holds the other neighbour nearly everywhere.
const MIN_LEAN: f64 = 0.9;

/// Of the elements where rounding to nearest even picks one neighbour, how many the candidate
/// holds there (`with`) and how many the other neighbour (`against`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Side {
    pub with: u64,
    pub against: u64,
}

impl Side {
    /// The chance of at least `against` of the `with + against` elements holding the other
    /// neighbour if each neighbour were as likely as the other, bounded above by Chernoff:
    /// exp(−n·KL(a/n ‖ ½)) (2^−n when every one does).
    pub fn chance_bound(&self) -> f64 {
        let n = (self.with + self.against) as f64;
        if n == 0.0 || self.against <= self.with {
            return 1.0;
        }
        let q = self.against as f64 / n;
        let term = |p: f64| if p > 0.0 { p * (2.0 * p).ln() } else { 0.0 };
        (-n * (term(q) + term(1.0 - q))).exp()
    }

    /// The other neighbour far more often than chance allows a producer that rounds, and in
    /// nearly every element (`MIN_LEAN`).
    pub fn other_mode(&self) -> bool {
        let n = (self.with + self.against) as f64;
        self.chance_bound() < CHANCE && self.against as f64 >= MIN_LEAN * n
    }
}

/// One tensor's tally: where rounding to nearest even moves the magnitude up (the candidate
/// against it holds the truncation) and where it keeps the truncation (the candidate against it
/// holds the value away from zero).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Tally {
    pub rounds_up: Side,
    pub rounds_down: Side,
    /// The elements counted at all (finite, not exact in bf16), neighbours of the reference's
    /// value or not.
    pub counted: u64,
}

impl Tally {
    /// Counts an f32 reference (little-endian bytes) against a bf16 candidate of as many
    /// elements; infinities, NaNs and values exact in bf16 are not counted.
    pub fn of(reference: &[u8], candidate: &[u8]) -> Tally {
        let mut t = Tally::default();
        for (r, c) in reference.chunks_exact(4).zip(candidate.chunks_exact(2)) {
            let bits = u32::from_le_bytes([r[0], r[1], r[2], r[3]]);
            if bits & 0x7f80_0000 == 0x7f80_0000 || bits & 0xffff == 0 {
                continue;
            }
            t.counted += 1;
            let toward = (bits >> 16) as u16;
            let away = toward.wrapping_add(1); // sign and magnitude: one step away from zero
            let odd = (bits >> 16) & 1;
            let rne_up = (bits & 0xffff) + odd > 0x8000;
            let cand = u16::from_le_bytes([c[0], c[1]]);
            let (side, with, against) = if rne_up {
                (&mut t.rounds_up, away, toward)
            } else {
                (&mut t.rounds_down, toward, away)
            };
            if cand == with {
                side.with += 1;
            } else if cand == against {
                side.against += 1;
            }
        }
        t
    }

    /// The mode the candidate's values show instead of nearest even, if any: only of a tensor
    /// that is a rounding of the reference's, most of its elements one of the two neighbours.
    /// A computation that drifted keeps a few elements there, and they lean as its drift does
    /// (SmolLM2's honest bf16 decode.0013.logits: 93 of 94 away from zero, of 49,152).
    pub fn mode(&self) -> Option<&'static str> {
        let neighbours = self.rounds_up.with
            + self.rounds_up.against
            + self.rounds_down.with
            + self.rounds_down.against;
        if 2 * neighbours < self.counted {
            None
        } else if self.rounds_up.other_mode() {
            Some("truncated (rounded towards zero)")
        } else if self.rounds_down.other_mode() {
            Some("rounded away from zero")
        } else {
            None
        }
    }
}

/// The tensors of an f32 reference and a bf16 candidate that the filter selects, compared on the
/// same rows.
fn pairs<'a>(
    r: &'a Trace,
    c: &'a Trace,
    opts: &'a Options,
) -> impl Iterator<Item = (&'a TensorInfo, &'a TensorInfo)> + 'a {
    r.tensors()
        .iter()
        .filter(|ri| ri.dtype == DType::F32 && opts.selects(&ri.name))
        .filter_map(|ri| c.tensor_info(&ri.name).map(|ci| (ri, ci)))
        .filter(|(ri, ci)| {
            ci.dtype == DType::BF16 && ci.shape == ri.shape && !positions::rerouted(ri, ci)
        })
}

/// Adds one `rounding_mode` finding when some bf16 tensor of the candidate holds the
/// reference's f32 values rounded in another mode than nearest even; true when one does (the
/// comparison fails).
pub(crate) fn check(r: &Trace, c: &Trace, opts: &Options, rep: &mut Report) -> bool {
    let found: Vec<(&str, Tally, &str)> = pairs(r, c, opts)
        .map(|(ri, ci)| (ri.name.as_str(), Tally::of(r.data(ri), c.data(ci))))
        .filter_map(|(name, t)| t.mode().map(|m| (name, t, m)))
        .collect();
    let Some((first, t, mode)) = found.first() else {
        return false;
    };
    let n = found.iter().filter(|f| f.2 == *mode).count();
    let (side, where_, holds) = if t.rounds_up.other_mode() {
        (t.rounds_up, "rounds up", "the truncation")
    } else {
        (
            t.rounds_down,
            "keeps the truncation",
            "the value away from zero",
        )
    };
    rep.findings.push(Finding::new(
        FindingKind::RoundingMode,
        Some(first),
        format!(
            "rounding mode: the candidate's bf16 values are the reference's f32 values {mode}, not rounded to nearest even: of the {} elements where nearest even {where_} and the candidate holds one of the two neighbours, {} hold {holds} ({n} tensor{} so, first {first}; by chance at most {:.1e}); a store in another rounding mode (docs/traps.md, trap 17)",
            side.with + side.against,
            side.against,
            if n == 1 { "" } else { "s" },
            side.chance_bound(),
        ),
    ));
    true
}

/// The headline's clause for a `rounding_mode` finding: a failure within every bound must say
/// why it fails.
pub(crate) fn headline(rep: &Report) -> Option<String> {
    rep.findings
        .iter()
        .find(|f| f.kind == FindingKind::RoundingMode)
        .map(|f| {
            let mode = if f.detail.contains("truncated") {
                "truncated"
            } else {
                "rounded away from zero"
            };
            format!(
                "rounding mode: bf16 {mode} where it should round to nearest even (first: {})",
                f.tensor().unwrap_or("-")
            )
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn f32s(v: &[u32]) -> Vec<u8> {
        v.iter().flat_map(|b| b.to_le_bytes()).collect()
    }
    fn bf16s(v: &[u16]) -> Vec<u8> {
        v.iter().flat_map(|b| b.to_le_bytes()).collect()
    }

    const fn side(with: u64, against: u64) -> Side {
        Side { with, against }
    }

    #[test]
    fn each_element_counts_on_the_side_nearest_even_takes() {
        // 1.0 exactly and a NaN (not counted); above half a step (nearest even rounds up);
        // below it (keeps the truncation); a tie with an even upper half (keeps it); a tie
        // with an odd one (rounds up); a negative value above half a step (up in magnitude).
        let r = f32s(&[
            0x3f80_0000,
            0x7fc0_0001,
            0x3f80_8001,
            0x3f80_7fff,
            0x3f80_8000,
            0x3f81_8000,
            0xbf80_c000,
        ]);
        let nearest = bf16s(&[0x3f80, 0x7fc0, 0x3f81, 0x3f80, 0x3f80, 0x3f82, 0xbf81]);
        let truncated = bf16s(&[0x3f80, 0x7fc0, 0x3f80, 0x3f80, 0x3f80, 0x3f81, 0xbf80]);
        let away = bf16s(&[0x3f80, 0x7fc0, 0x3f81, 0x3f81, 0x3f81, 0x3f82, 0xbf81]);
        let t = |c: &[u8]| Tally::of(&r, c);
        assert_eq!(
            t(&nearest),
            Tally {
                rounds_up: side(3, 0),
                rounds_down: side(2, 0),
                counted: 5
            }
        );
        assert_eq!(
            t(&truncated),
            Tally {
                rounds_up: side(0, 3),
                rounds_down: side(2, 0),
                counted: 5
            }
        );
        assert_eq!(
            t(&away),
            Tally {
                rounds_up: side(3, 0),
                rounds_down: side(0, 2),
                counted: 5
            }
        );
    }

    #[test]
    fn the_bound_needs_the_other_neighbour_far_beyond_chance() {
        // Every one the other neighbour: 2^-n, below 1e-9 from n = 30.
        assert!(!side(0, 29).other_mode());
        assert!(side(0, 30).other_mode());
        // As many either way, or more with nearest even: no finding at any size.
        assert!(!side(10_000, 10_000).other_mode());
        assert!(!side(10_000, 0).other_mode());
        // A lean that chance explains is no finding; a large one is.
        assert!(!side(40, 60).other_mode());
        assert!(side(100, 900).other_mode());
        // An honest bf16 run's lean, far beyond chance but not a mode (SmolLM2, measured).
        assert!(!side(1_130, 1_542).other_mode());
    }

    #[test]
    fn a_drifted_tensor_with_few_neighbours_left_shows_no_mode() {
        // SmolLM2's honest bf16 decode.0013.logits: 93 of its 94 neighbours away from zero,
        // 94 of 49,152 elements; the same lean over most of the tensor is a mode.
        let drifted = Tally {
            rounds_up: Side::default(),
            rounds_down: side(1, 93),
            counted: 49_152,
        };
        assert_eq!(drifted.mode(), None);
        let rounded = Tally {
            counted: 150,
            ..drifted
        };
        assert_eq!(rounded.mode(), Some("rounded away from zero"));
    }
}
