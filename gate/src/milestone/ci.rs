//! A milestone run's checks as a CI system reads them: JUnit XML (`--junit FILE`: one test case
//! per prompt and check, one per baseline) and, under GitHub Actions, one `::error` line per
//! FAIL and one `::warning` line per NOT CHECKED (docs/ci.md). Both are views of the report:
//! every check of it appears, none is added, and a NOT CHECKED is a skipped case with its
//! reason, never a pass. A port's failing `agrees` that was localised carries the localisation
//! line first, in its failure message and its annotation.

use std::fmt::Write as _;

use crate::milestone::check::Check;
use crate::milestone::run::{CheckResult, MilestoneReport, Status};

/// Where a check sits: milestone, model, prompt (or `baselines`), check.
struct Case<'a> {
    milestone: &'a str,
    model: String,
    group: &'a str,
    check: &'a CheckResult,
    /// A failing `agrees` localised (PromptResult::localisation_line): first in its message.
    localised: Option<String>,
    /// A sharded port's `agrees`, whose detail says how its rank traces were merged: kept as
    /// the case's output when it passes too.
    merged: bool,
}

impl Case<'_> {
    /// The failure's one-line message: the localisation first, then the detail's first line.
    fn message(&self) -> String {
        let first = self.check.detail.lines().next().unwrap_or_default();
        match &self.localised {
            Some(l) => format!("{l}; {}: {first}", self.check.check),
            None => first.to_string(),
        }
    }

    /// The check's detail and findings, after the localisation when there is one.
    fn body(&self) -> String {
        match &self.localised {
            Some(l) => format!("{l}\n{}", body(self.check)),
            None => body(self.check),
        }
    }
}

fn cases(reps: &[MilestoneReport]) -> Vec<Case<'_>> {
    let mut out = Vec::new();
    for r in reps {
        let model = crate::milestone::run::dir_name(&r.model);
        for p in &r.prompts {
            for c in &p.checks {
                out.push(Case {
                    milestone: &r.milestone,
                    model: model.clone(),
                    group: &p.id,
                    check: c,
                    localised: (c.check == Check::Agrees && c.status == Status::Fail)
                        .then(|| p.localisation_line())
                        .flatten(),
                    merged: c.check == Check::Agrees && !p.sharded.is_empty(),
                });
            }
        }
        for c in &r.baselines {
            out.push(Case {
                milestone: &r.milestone,
                model: model.clone(),
                group: "baselines",
                check: c,
                localised: None,
                merged: false,
            });
        }
    }
    out
}

/// The check's detail and each of its findings, one per line (excused ones marked).
fn body(c: &CheckResult) -> String {
    let mut s = c.detail.clone();
    for f in &c.findings {
        let _ = write!(s, "\n{} {}: {}", f.kind, f.about.name, f.detail);
    }
    for f in &c.excused {
        let _ = write!(s, "\nexcused {} {}: {}", f.kind, f.about.name, f.detail);
    }
    s
}

/// XML text and attribute escaping; characters XML 1.0 cannot hold become U+FFFD.
fn xml(s: &str) -> String {
    let mut o = String::with_capacity(s.len());
    for ch in s.chars() {
        match ch {
            '&' => o.push_str("&amp;"),
            '<' => o.push_str("&lt;"),
            '>' => o.push_str("&gt;"),
            '"' => o.push_str("&quot;"),
            '\'' => o.push_str("&apos;"),
            '\n' => o.push_str("&#10;"),
            '\t' | '\r' => o.push(ch),
            c if (c as u32) < 0x20 || c == '\u{fffe}' || c == '\u{ffff}' => o.push('\u{fffd}'),
            c => o.push(c),
        }
    }
    o
}

/// JUnit XML of the run's reports: a suite per milestone and model, a case per prompt and check
/// (`classname` `MILESTONE.MODEL.PROMPT`, `name` the check), FAIL a `<failure>`, NOT CHECKED a
/// `<skipped>`, each with the check's detail and findings.
pub fn junit(reps: &[MilestoneReport]) -> String {
    let all = cases(reps);
    let count = |s: Status| all.iter().filter(|c| c.check.status == s).count();
    let mut o = String::from("<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n");
    let _ = writeln!(
        o,
        "<testsuites name=\"gate\" tests=\"{}\" failures=\"{}\" skipped=\"{}\" errors=\"0\">",
        all.len(),
        count(Status::Fail),
        count(Status::NotChecked)
    );
    for r in reps {
        let model = crate::milestone::run::dir_name(&r.model);
        let mine: Vec<&Case> = all
            .iter()
            .filter(|c| c.milestone == r.milestone && c.model == model)
            .collect();
        let n = |s: Status| mine.iter().filter(|c| c.check.status == s).count();
        let _ = writeln!(
            o,
            "  <testsuite name=\"{}\" tests=\"{}\" failures=\"{}\" skipped=\"{}\" errors=\"0\" time=\"{:.3}\">",
            xml(&format!("gate {} {model}", r.milestone)),
            mine.len(),
            n(Status::Fail),
            n(Status::NotChecked),
            r.wall_s.get("total").copied().unwrap_or(0.0)
        );
        for c in mine {
            let head = format!(
                "    <testcase classname=\"{}\" name=\"{}\"",
                xml(&format!("{}.{}.{}", c.milestone, c.model, c.group)),
                xml(&c.check.check.to_string())
            );
            let first = c.check.detail.lines().next().unwrap_or_default();
            match c.check.status {
                Status::Pass if c.merged => {
                    let _ = writeln!(
                        o,
                        "{head}>\n      <system-out>{}</system-out>\n    </testcase>",
                        xml(&c.check.detail)
                    );
                }
                Status::Pass => {
                    let _ = writeln!(o, "{head}/>");
                }
                Status::Fail => {
                    let _ = writeln!(
                        o,
                        "{head}>\n      <failure message=\"{}\" type=\"FAIL\">{}</failure>\n    </testcase>",
                        xml(&c.message()),
                        xml(&c.body())
                    );
                }
                Status::NotChecked => {
                    let _ = writeln!(
                        o,
                        "{head}>\n      <skipped message=\"{}\">{}</skipped>\n    </testcase>",
                        xml(&format!("NOT CHECKED: {first}")),
                        xml(&body(c.check))
                    );
                }
            }
        }
        o.push_str("  </testsuite>\n");
    }
    o.push_str("</testsuites>\n");
    o
}

/// A GitHub workflow command's message: `%`, CR and LF escaped as the runner reads them.
fn gh_data(s: &str) -> String {
    s.replace('%', "%25")
        .replace('\r', "%0D")
        .replace('\n', "%0A")
}

/// A workflow command's property value: also `:` and `,`.
fn gh_property(s: &str) -> String {
    gh_data(s).replace(':', "%3A").replace(',', "%2C")
}

/// GitHub Actions annotations: `::error` per FAIL, `::warning` per NOT CHECKED, titled
/// `gate MILESTONE MODEL PROMPT/CHECK`; nothing for a PASS.
pub fn github_annotations(reps: &[MilestoneReport]) -> Vec<String> {
    cases(reps)
        .iter()
        .filter_map(|c| {
            let (level, what) = match c.check.status {
                Status::Pass => return None,
                Status::Fail => ("error", "FAIL"),
                Status::NotChecked => ("warning", "NOT CHECKED"),
            };
            let title = format!(
                "gate {} {} {}/{}: {what}",
                c.milestone, c.model, c.group, c.check.check
            );
            Some(format!(
                "::{level} title={}::{}",
                gh_property(&title),
                gh_data(&c.body())
            ))
        })
        .collect()
}

/// Whether this process runs under GitHub Actions (the runner sets `GITHUB_ACTIONS=true`): the
/// switch GITHUB_ACTIONS (tracegate_producers::settings: `true`, `TRUE`, `1`… on; `false`, `0`…
/// or unset off; anything else refused, as `gate` does first, never read as off).
pub fn on_github_actions() -> Result<bool, String> {
    Ok(tracegate_producers::settings::switch("GITHUB_ACTIONS")?.unwrap_or(false))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn xml_escapes_markup_and_replaces_what_xml_cannot_hold() {
        assert_eq!(
            xml("a<b & \"c\" 'd'>\n\u{1}"),
            "a&lt;b &amp; &quot;c&quot; &apos;d&apos;&gt;&#10;\u{fffd}"
        );
    }

    #[test]
    fn workflow_commands_escape_what_the_runner_would_split_on() {
        assert_eq!(gh_data("50% of\r\nrows"), "50%25 of%0D%0Arows");
        assert_eq!(gh_property("m1 a/b: FAIL, x"), "m1 a/b%3A FAIL%2C x");
    }
}
