//! `--force-decisions TRACE`: the run takes its router top-k and greedy tokens from another
//! trace instead of computing them, so its numbers can be compared past a decision that flipped
//! legitimately (docs/producers.md, "Forced decisions"). Everything is checked before the
//! forward runs; a trace that cannot serve this run is refused in one line naming the file and
//! the decision.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde_json::{json, Value};
use tracegate_trace::Trace;

use crate::{err, ops, Error, Result};

/// The decisions of the forcing trace, by name: shape and values.
pub struct Forcing {
    pub path: PathBuf,
    /// The forcing trace's content digest (hex): recorded in provenance and in the `forced`
    /// attribute.
    pub digest: String,
    decisions: BTreeMap<String, (Vec<u64>, Vec<i64>)>,
    provenance: Value,
}

/// What this producer would have chosen differs from the forced choice in rows `overridden`
/// (the decision's row indexes, ascending).
#[derive(Clone, Debug)]
pub struct Record {
    pub name: String,
    pub overridden: Vec<u64>,
}

impl Forcing {
    pub fn open(path: &Path) -> Result<Forcing> {
        let refuse =
            |e: tracegate_trace::Error| err!(Input: "--force-decisions {}: {e}", path.display());
        let t = Trace::open(path).map_err(refuse)?;
        // The digest recorded with the forced run must be that of the bytes the choices came from.
        t.verify().map_err(refuse)?;
        let decisions = t
            .decisions()
            .iter()
            .map(|d| (d.name.clone(), (d.shape.clone(), t.decision_values(d))))
            .collect();
        Ok(Forcing {
            path: path.to_path_buf(),
            digest: t.digest().hex(),
            decisions,
            provenance: t.provenance().clone(),
        })
    }

    fn refuse(&self, what: impl std::fmt::Display) -> Error {
        err!(Input: "--force-decisions {}: {what}", self.path.display())
    }

    /// The forcing trace must be a run of this prompt (when it records one).
    pub fn check_prompt(&self, tokens: &[i64]) -> Result<()> {
        match self
            .provenance
            .get("prompt_tokens")
            .filter(|v| !v.is_null())
        {
            Some(v) if *v != json!(tokens) => Err(self.refuse(format!(
                "its prompt_tokens {v} are not this run's {}",
                json!(tokens)
            ))),
            _ => Ok(()),
        }
    }

    /// The forcing trace must be a run of these weights (when it records them).
    pub fn check_weights(&self, weights_digest: &str) -> Result<()> {
        match self
            .provenance
            .get("weights_digest")
            .and_then(|v| v.as_str())
        {
            Some(w) if w != weights_digest => Err(self.refuse(format!(
                "its weights_digest {w} is not this run's {weights_digest}"
            ))),
            _ => Ok(()),
        }
    }

    /// Checks that decision `name` exists, has `width` values per row (rank 1 when `width` is
    /// None) and, when `rows` is given, exactly that many rows; every value in `[0, range)`, and
    /// no value twice in one row (a router row names distinct experts). Returns its row count.
    pub fn require(
        &self,
        name: &str,
        rows: Option<usize>,
        width: Option<usize>,
        range: usize,
    ) -> Result<usize> {
        let (shape, values) = self.decisions.get(name).ok_or_else(|| {
            self.refuse(format!("decision {name} is missing (this run needs it)"))
        })?;
        let want: Vec<String> = [rows.map_or("rows".to_string(), |r| r.to_string())]
            .into_iter()
            .chain(width.map(|w| w.to_string()))
            .collect();
        let ok = match (shape.as_slice(), width) {
            ([n], None) => rows.is_none_or(|r| *n == r as u64),
            ([n, w], Some(k)) => rows.is_none_or(|r| *n == r as u64) && *w == k as u64,
            _ => false,
        };
        if !ok {
            return Err(self.refuse(format!(
                "decision {name} has shape {shape:?}, this run needs [{}]",
                want.join(", ")
            )));
        }
        let per_row = width.unwrap_or(1);
        for (r, row) in values.chunks(per_row).enumerate() {
            if let Some(v) = row.iter().find(|&&v| v < 0 || v as u64 >= range as u64) {
                return Err(self.refuse(format!(
                    "decision {name} row {r}: value {v} outside [0, {range})"
                )));
            }
            if let Some((i, v)) = row.iter().enumerate().find(|(i, v)| row[..*i].contains(v)) {
                return Err(self.refuse(format!(
                    "decision {name} row {r}: value {v} repeated (position {i})"
                )));
            }
        }
        Ok(shape[0] as usize)
    }

    /// The shape of a decision of the forcing trace (None: it has none of that name).
    pub fn shape(&self, name: &str) -> Option<&[u64]> {
        self.decisions.get(name).map(|(s, _)| s.as_slice())
    }

    /// The forced values of a decision checked by `require`, row-major.
    pub fn values(&self, name: &str) -> Option<&[i64]> {
        self.decisions.get(name).map(|(_, v)| v.as_slice())
    }

    /// The provenance record: which trace, which decisions, which rows this producer would have
    /// decided otherwise (counted in total and per decision that has any, and listed per
    /// decision: docs/producers.md, "Recorded.").
    pub fn provenance(&self, records: &[Record]) -> Value {
        let any = || records.iter().filter(|r| !r.overridden.is_empty());
        let counts: serde_json::Map<String, Value> = any()
            .map(|r| (r.name.clone(), json!(r.overridden.len())))
            .collect();
        let rows: serde_json::Map<String, Value> = any()
            .map(|r| (r.name.clone(), json!(r.overridden)))
            .collect();
        json!({
            "trace": self.path.display().to_string(),
            "trace_digest": self.digest,
            "decisions": records.iter().map(|r| r.name.as_str()).collect::<Vec<_>>(),
            "rows_overridden": records.iter().map(|r| r.overridden.len()).sum::<usize>(),
            "overridden": counts,
            "overridden_rows": rows,
        })
    }
}

/// The values of decision `name` this run must take (None: the run is not forced), checked as
/// the run reaches it (a diffusion run's steps are known only then): `len` values, each
/// accepted by `ok` (`want` says what is accepted); an error naming the decision when the
/// forcing trace lacks it or holds another shape.
pub fn forced_values(
    f: Option<&Forcing>,
    name: &str,
    len: usize,
    ok: impl Fn(i64) -> bool,
    want: &str,
) -> Result<Option<Vec<i64>>> {
    let Some(f) = f else { return Ok(None) };
    let (Some(shape), Some(values)) = (f.shape(name), f.values(name)) else {
        return Err(f.refuse(format!("decision {name} is missing (this run needs it)")));
    };
    if shape != [len as u64] {
        return Err(f.refuse(format!(
            "decision {name} has shape {shape:?}, this run needs [{len}]"
        )));
    }
    if let Some((i, v)) = values.iter().enumerate().find(|(_, &v)| !ok(v)) {
        return Err(f.refuse(format!("decision {name} value {i} is {v}, not {want}")));
    }
    Ok(Some(values.to_vec()))
}

/// §12 argmax decision on one logits row: this producer's argmax and margin, or under
/// `--force-decisions` the `forced` token with this producer's margin for it. Returns (token,
/// margin, overridden: forced and this producer's own argmax is another token). A NaN in the
/// row is an error, `NaN {what}`.
pub fn argmax_or_forced(
    row: &[f32],
    forced: Option<i64>,
    what: impl FnOnce() -> String,
) -> Result<(i64, f32, bool)> {
    if row.iter().any(|x| x.is_nan()) {
        return Err(err!(NaN: "NaN {}", what()));
    }
    let (own, margin) = ops::argmax_margin(row);
    match forced {
        Some(tok) => Ok((tok, ops::margin_of(row, &[tok as usize]), tok != own as i64)),
        None => Ok((own as i64, margin, false)),
    }
}

/// The rows (ascending) where a forced decision differs from this producer's own choice, one
/// `differs` a row.
pub fn overridden(differs: impl Iterator<Item = bool>) -> Vec<u64> {
    differs
        .enumerate()
        .filter(|&(_, d)| d)
        .map(|(r, _)| r as u64)
        .collect()
}
