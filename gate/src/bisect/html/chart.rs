//! The per-layer chart: whole-run, isolated and calibration error on one log scale.

use tracegate_diff::html::{fmt_real, json_text, LogChart, Mark, Point, Series};

use super::View;
use crate::bisect::prefill::LayerRow;

/// One series over the layers: `field` of each row, tied to `/layers/N/<field>`.
fn series(
    v: &View,
    key: &str,
    legend: &str,
    field: &str,
    get: impl Fn(&LayerRow) -> Option<f64>,
) -> Series {
    let points = v
        .rows
        .iter()
        .enumerate()
        .map(|(i, row)| {
            let y = get(row);
            Point {
                x: i,
                y,
                pointer: format!("{}/{i}/{field}", v.rows_at),
                json: json_text(&y),
                title: format!("layer {:02} {field}: {}", row.layer, fmt_real(y)),
            }
        })
        .collect();
    Series {
        key: key.into(),
        legend: legend.into(),
        points,
    }
}

pub(super) fn chart(v: &View) -> String {
    let layers = v.rows;
    let mut all = vec![
        series(
            v,
            "whole",
            "blue ring: whole run, layer.NN.hidden_out rel L2 (reference vs candidate)",
            "whole_rel_l2",
            |l| l.whole_rel_l2,
        ),
        series(
            v,
            "isolated",
            "red: isolated, the candidate's layer verb on the reference's input",
            "isolated_rel_l2",
            |l| l.isolated_rel_l2,
        ),
    ];
    if layers.iter().any(|l| l.calibration_rel_l2.is_some()) {
        all.push(series(v, "calibration", "amber: calibration, what a 1-ULP perturbation of the calibration layer's input grows to", "calibration_rel_l2", |l| l.calibration_rel_l2));
    }
    let mut marks = Vec::new();
    if let Some(w) = v.first_wrong {
        let names = v.stage.map_or(format!("layer {w:02}"), |s| {
            format!("{} ({})", s.tensor, s.block.words())
        });
        marks.push(Mark {
            x: w,
            id: format!("{}chart-layers-wrong-layer", v.id),
            class: "mark-fv".into(),
            label: "wrong layer".into(),
            names,
        });
    }
    for l in layers.iter().filter(|l| l.suspicious) {
        marks.push(Mark {
            x: l.layer,
            id: format!("{}chart-layers-suspicious-{:02}", v.id, l.layer),
            class: "mark-suspicious".into(),
            label: "suspicious".into(),
            names: format!("layer {:02}", l.layer),
        });
    }
    let groups = layers
        .iter()
        .enumerate()
        .map(|(i, l)| (i, format!("L{:02}", l.layer)))
        .collect();
    let mut s = LogChart {
        id: format!("{}chart-layers", v.id),
        y_label: "relative L2 of layer.NN.hidden_out (log)".into(),
        n: layers.len(),
        groups,
        series: all,
        bounds: Vec::new(),
        marks,
    }
    .render();
    s.push_str("<div class=\"note\">on the 0 line: identical · missing: not measured (a layer not isolated has no red point)</div>");
    s
}
