//! A forced candidate's own overrides on the page (docs/bisect.md, "Forcing decisions" and
//! "Block diffusion"): how many rows of each decision it would have decided otherwise, which,
//! each argmax or router row's own margin and how its own numbers judge it, and NOT CHECKED
//! where the record is missing or could not be judged — every number the JSON's.

use std::fmt::Write as _;

use tracegate_diff::html::{esc, fmt_real, val};
use tracegate_diff::{thousands, Real};

use crate::bisect::prefill::{DecisionsForced, Forcing};

/// `at`: the JSON pointer of `f` (`/decisions_forced`, `/diffusion/forced`); `id`: the prefix of
/// every element id.
pub(super) fn overrides(f: &DecisionsForced, at: &str, id: &str, h: &mut String) {
    if f.status != Forcing::Forced {
        return;
    }
    if let Some(why) = &f.overrides_not_checked {
        let _ = write!(
            h,
            "<p id=\"{id}overrides-not-checked\" class=\"s-FAIL\">its own overrides NOT CHECKED: {}</p>",
            val("span", "text", &format!("{at}/overrides_not_checked"), why, why)
        );
    }
    let counts = f.overridden.as_ref().and_then(|v| v.as_object());
    let Some(counts) = counts else {
        // The record itself is missing: the line above says so; nothing is read as none.
        return;
    };
    let _ = write!(
        h,
        "<p id=\"{id}overrides\">rows it would itself have decided otherwise: {} in all</p>",
        val(
            "span",
            "num",
            &format!("{at}/rows_overridden"),
            &f.rows_overridden,
            &f.rows_overridden.map_or("-".into(), thousands)
        ),
    );
    if !counts.is_empty() {
        let _ = write!(h, "<table id=\"{id}overrides-per-decision\">");
        h.push_str("<tr><th>decision</th><th>rows overridden</th><th>which</th></tr>");
        for (name, n) in counts {
            let key = pointer_key(name);
            let listed = f.overridden_rows.as_ref().and_then(|v| v.get(name));
            // A count without its rows is a record contradicting itself (NOT CHECKED above).
            let which = match listed {
                Some(v) => {
                    let rows: Vec<String> = v
                        .as_array()
                        .into_iter()
                        .flatten()
                        .map(|r| r.to_string())
                        .collect();
                    let p = format!("{at}/overridden_rows/{key}");
                    val("td", "rows", &p, v, &rows.join(", "))
                }
                None => "<td>-</td>".into(),
            };
            let _ = write!(
                h,
                "<tr data-decision=\"{}\"><td class=\"mono\">{}</td>{}{which}</tr>",
                esc(name),
                esc(name),
                val(
                    "td",
                    "num",
                    &format!("{at}/overridden/{key}"),
                    n,
                    &n.to_string()
                ),
            );
        }
        h.push_str("</table>");
    }
    if f.overrides_rows.is_empty() {
        return;
    }
    let _ = write!(h, "<table id=\"{id}overrides-judged\">");
    h.push_str("<tr><th>decision</th><th>row</th><th>its own margin</th><th>judged</th><th>its own choice</th><th>gap</th><th>bound F·h</th><th>h from</th></tr>");
    let real = |p: &str, v: &Option<Real>| val("td", "num", p, v, &fmt_real(v.map(|r| r.0)));
    for (i, r) in f.overrides_rows.iter().enumerate() {
        let p = |x: &str| format!("{at}/overrides_rows/{i}/{x}");
        let own = r.own.as_ref().map_or("-".into(), |o| format!("{o:?}"));
        let from = r.honest_noise_from.as_deref().unwrap_or("-");
        let _ = write!(
            h,
            "<tr class=\"{}\" data-decision=\"{}\" data-row=\"{}\"><td class=\"mono\">{}</td>{}{}{}{}{}{}{}</tr>",
            r.outcome,
            esc(&r.decision),
            r.row,
            esc(&r.decision),
            val("td", "num", &p("row"), &r.row, &r.row.to_string()),
            real(&p("margin"), &r.margin),
            val("td", "text", &p("outcome"), &r.outcome, r.outcome.as_str()),
            val("td", "order", &p("own"), &r.own, &own),
            real(&p("gap"), &r.gap),
            real(&p("noise_bound"), &r.noise_bound),
            val("td", "from", &p("honest_noise_from"), &r.honest_noise_from, from),
        );
    }
    h.push_str("</table>");
}

/// A JSON object key as one JSON pointer token (RFC 6901: `~` as `~0`, `/` as `~1`).
fn pointer_key(k: &str) -> String {
    k.replace('~', "~0").replace('/', "~1")
}
