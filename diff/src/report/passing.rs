//! "Which tolerance?" answered from the measurements: for each rule with tensors outside the
//! policy, the smallest bounds that would have passed every one of them (JSON `passing_bounds`).
//! Every bound is inclusive (`value <= max_*`, `cosine >= min_cosine`, `|scale error| <=
//! max_scale_error`), so the measured value itself is the smallest passing bound; the loosest of
//! them over the rule's tensors passes all. A tensor no bound can pass — NaN or infinity where the
//! reference is finite, an undefined relative L2 or cosine, an infinite relative error — is named
//! instead: loosening a policy never excuses it.

use std::collections::BTreeMap;

use serde::Serialize;

use super::{Report, RuleRef, TensorRow};
use crate::{Amount, Violation};

/// One rule's tensors outside the policy and the bounds that would have passed them.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct PassingBounds {
    pub rule: RuleRef,
    /// The tensors outside the policy under this rule, in reference order.
    pub tensors: Vec<String>,
    /// Per broken bound, the smallest value of it that passes every tensor above (the others
    /// the rule sets are not in the way).
    pub bounds: BTreeMap<&'static str, Amount>,
    /// Tensors no value of a bound passes, each with why.
    pub unpassable: Vec<String>,
}

/// The smallest passing value of one broken bound, or why there is none.
fn needed(v: &Violation) -> Result<Amount, String> {
    let value = v.value.ok_or_else(|| format!("{} is undefined", v.bound))?;
    match (v.bound, value) {
        (crate::policy::NONFINITE, Amount::Count(n)) => {
            Err(format!("{n} NaN or infinite difference(s)"))
        }
        ("max_scale_error", Amount::Real(r)) if r.0.is_finite() => {
            Ok(Amount::Real(crate::Real(r.0.abs())))
        }
        ("min_cosine", Amount::Real(r)) if (-1.0..=1.0).contains(&r.0) => Ok(value),
        (_, Amount::Real(r)) if r.0.is_finite() && r.0 >= 0.0 => Ok(value),
        (_, Amount::Count(_)) => Ok(value),
        (bound, _) => Err(format!("{bound} is {value}")),
    }
}

/// The looser of two passing values of `bound`.
fn looser(bound: &str, a: Amount, b: Amount) -> Amount {
    let key = |x: &Amount| match x {
        Amount::Count(n) => *n as f64,
        Amount::Real(r) => r.0,
    };
    let b_looser = if bound == "min_cosine" {
        key(&b) < key(&a)
    } else {
        key(&b) > key(&a)
    };
    if b_looser {
        b
    } else {
        a
    }
}

impl Report {
    /// Per rule (in rule order) with a tensor outside the policy: the bounds that would have
    /// passed (module doc). Empty without a policy or a violation.
    pub fn passing_bounds(&self) -> Vec<PassingBounds> {
        let mut by_rule: BTreeMap<usize, PassingBounds> = BTreeMap::new();
        for row in &self.per_tensor {
            let Some(v) = TensorRow::violation(row) else {
                continue;
            };
            let Some(rule) = v.rule else { continue };
            let entry = by_rule.entry(rule.index).or_insert_with(|| PassingBounds {
                rule: rule.clone(),
                tensors: Vec::new(),
                bounds: BTreeMap::new(),
                unpassable: Vec::new(),
            });
            entry.tensors.push(v.tensor.clone());
            for b in &v.violations {
                match needed(b) {
                    Ok(n) => {
                        let now = match entry.bounds.get(b.bound) {
                            Some(old) => looser(b.bound, *old, n),
                            None => n,
                        };
                        entry.bounds.insert(b.bound, now);
                    }
                    Err(why) => entry.unpassable.push(format!("{}: {why}", v.tensor)),
                }
            }
        }
        by_rule.into_values().collect()
    }
}
