//! `--only GLOB` / `--skip GLOB`: which tensor and decision names a comparison (or `--show`)
//! covers. A left-out name is neither compared nor counted anywhere; the report says how many
//! were left out, so a narrowed comparison can never read as a whole one.

use serde::Serialize;
use tracegate_trace::Trace;

use crate::policy::glob_match;

/// Globs over tensor and decision names, in the policy syntax ([`glob_match`]: `*` stops at
/// `.`, `**` crosses it, `?` is one character). A name is selected when it matches some `only`
/// glob (any name, when there is none) and no `skip` glob.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct Filter {
    pub only: Vec<String>,
    pub skip: Vec<String>,
}

impl Filter {
    pub fn is_empty(&self) -> bool {
        self.only.is_empty() && self.skip.is_empty()
    }

    pub fn selects(&self, name: &str) -> bool {
        (self.only.is_empty() || self.only.iter().any(|g| glob_match(g, name)))
            && !self.skip.iter().any(|g| glob_match(g, name))
    }

    /// What this filter leaves out of `traces` (one for `--show`, two for a comparison), over
    /// their distinct names; None without a filter.
    pub fn summary(&self, traces: &[&Trace]) -> Option<FilterSummary> {
        if self.is_empty() {
            return None;
        }
        let mut s = FilterSummary {
            filter: self.clone(),
            ..FilterSummary::default()
        };
        let globs: Vec<&String> = self.only.iter().chain(&self.skip).collect();
        let mut matched = vec![false; globs.len()];
        let mut tally = |name: &str, selected: &mut usize, left_out: &mut usize| {
            for (g, m) in globs.iter().zip(matched.iter_mut()) {
                *m = *m || glob_match(g, name);
            }
            if self.selects(name) {
                *selected += 1;
            } else {
                *left_out += 1;
            }
        };
        for (i, t) in traces.iter().enumerate() {
            // A name in an earlier trace was counted there.
            let earlier = &traces[..i];
            for x in t
                .tensors()
                .iter()
                .filter(|x| !earlier.iter().any(|e| e.tensor_info(&x.name).is_some()))
            {
                tally(&x.name, &mut s.tensors_selected, &mut s.tensors_left_out);
            }
            for x in t
                .decisions()
                .iter()
                .filter(|x| !earlier.iter().any(|e| e.decision_info(&x.name).is_some()))
            {
                tally(
                    &x.name,
                    &mut s.decisions_selected,
                    &mut s.decisions_left_out,
                );
            }
        }
        s.unmatched = globs
            .into_iter()
            .zip(matched)
            .filter(|(_, m)| !m)
            .map(|(g, _)| g.clone())
            .collect();
        Some(s)
    }
}

/// The flags as a person typed them: `--only 'layer.03.**' --skip '*.attn_out'`.
impl std::fmt::Display for Filter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let flags: Vec<String> = self
            .only
            .iter()
            .map(|g| format!("--only '{g}'"))
            .chain(self.skip.iter().map(|g| format!("--skip '{g}'")))
            .collect();
        f.write_str(&flags.join(" "))
    }
}

/// What a [`Filter`] left out: counts, not names (a trace may hold a million).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct FilterSummary {
    #[serde(flatten)]
    pub filter: Filter,
    /// Distinct tensor names (over every trace read) the filter leaves out.
    pub tensors_left_out: usize,
    pub decisions_left_out: usize,
    /// Globs that match no tensor or decision name at all: most likely a typo.
    pub unmatched: Vec<String>,
    #[serde(skip)]
    tensors_selected: usize,
    #[serde(skip)]
    decisions_selected: usize,
}

impl FilterSummary {
    pub fn selects(&self, name: &str) -> bool {
        self.filter.selects(name)
    }

    /// Whether anything was left out: only then does a verdict cover less than the whole traces.
    pub fn left_out_any(&self) -> bool {
        self.tensors_left_out + self.decisions_left_out > 0
    }

    /// The error when nothing is selected: zero checks must never read as a pass.
    pub fn nothing_selected(&self) -> Option<String> {
        (self.tensors_selected + self.decisions_selected == 0).then(|| {
            format!(
                "{} selects no tensor or decision name: nothing to compare or list",
                self.filter
            )
        })
    }

    /// One warning per glob that matches no name.
    pub fn warnings(&self) -> impl Iterator<Item = String> + '_ {
        self.unmatched.iter().map(|g| {
            let flag = if self.filter.only.contains(g) {
                "--only"
            } else {
                "--skip"
            };
            // The usual slip: `layer.0*` for "every tensor of layers 00-09".
            let hint = match (g.contains('*') && !g.contains("**"), g.ends_with('*')) {
                (true, true) => {
                    format!(" (`*` stops at `.`, `**` crosses it: did you mean '{g}.**'?)")
                }
                (true, false) => " (`*` stops at `.`, `**` crosses it)".to_string(),
                _ => String::new(),
            };
            format!("{flag} '{g}' matches no tensor or decision name{hint}")
        })
    }
}
