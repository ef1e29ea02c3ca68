//! A chart over capture points with a log-scale y axis, drawn as hand-written SVG: the
//! trace-diff page's curves and the gate's bisect chart.

use std::fmt::Write as _;

use super::esc;

/// One point of a [`LogChart`] series: `y` None is not measured (not drawn), 0 is drawn on the
/// chart's zero line, a non-finite value at its top edge.
pub struct Point {
    pub x: usize,
    pub y: Option<f64>,
    /// The JSON pointer and text of the value (the DOM's `data-json`, `data-v`).
    pub pointer: String,
    pub json: String,
    pub title: String,
}

pub struct Series {
    /// A class name (`s-<key>` on the group) and the legend's words.
    pub key: String,
    pub legend: String,
    pub points: Vec<Point>,
}

/// A limit drawn as a short horizontal bar over one x.
pub struct BoundBar {
    pub x: usize,
    pub y: f64,
    pub pointer: String,
    pub json: String,
}

/// A vertical line over one x (first bit difference, first violation, wrong layer).
pub struct Mark {
    pub x: usize,
    pub id: String,
    pub class: String,
    pub label: String,
    /// `data-tensor` (or whatever the mark names).
    pub names: String,
}

/// A chart over `n` positions (capture order) with a log-scale y axis.
pub struct LogChart {
    pub id: String,
    pub y_label: String,
    pub n: usize,
    /// Group labels along x: (first x of the group, text), e.g. layer numbers.
    pub groups: Vec<(usize, String)>,
    pub series: Vec<Series>,
    pub bounds: Vec<BoundBar>,
    pub marks: Vec<Mark>,
}

pub(super) const W: f64 = 1100.0;
const H: f64 = 250.0;
// Plot margins: left, right, top, bottom.
const L: f64 = 64.0;
pub(super) const R: f64 = 16.0;
pub(super) const T: f64 = 22.0;
const B: f64 = 40.0;
/// A generous width of one character of an 11-px label (digits and capitals are about 7 px).
const GROUP_CHAR_PX: f64 = 8.0;

/// Whole decades covering every positive finite value (at least one decade).
pub(super) fn decades(values: impl Iterator<Item = f64>) -> (i32, i32) {
    let (mut lo, mut hi) = (f64::INFINITY, f64::NEG_INFINITY);
    for v in values.filter(|v| v.is_finite() && *v > 0.0) {
        lo = lo.min(v);
        hi = hi.max(v);
    }
    if !lo.is_finite() {
        return (-1, 0);
    }
    let (a, b) = (lo.log10().floor() as i32, hi.log10().ceil() as i32);
    (a, if b > a { b } else { a + 1 })
}

impl LogChart {
    pub fn render(&self) -> String {
        let mut s = String::new();
        let all = self
            .series
            .iter()
            .flat_map(|s| s.points.iter().filter_map(|p| p.y))
            .chain(self.bounds.iter().map(|b| b.y));
        let (lo, hi) = decades(all);
        let (pw, ph) = (W - L - R, H - T - B);
        let n = self.n.max(1) as f64;
        let x = |i: usize| L + (i as f64 + 0.5) * pw / n;
        let y = |v: f64| T + ph - (v.log10() - lo as f64) / (hi - lo) as f64 * ph;
        // 14 px below the axis: the zero line's tick clears the lowest decade's (11-px text).
        let zero_y = T + ph + 14.0;
        let _ = write!(s, "<svg id=\"{}\" class=\"chart\" viewBox=\"0 0 {W} {H}\" width=\"{W}\" height=\"{H}\" role=\"img\" data-n=\"{}\">", esc(&self.id), self.n);
        // Above the plot, right of the tick column: clear of the top decade's tick.
        let _ = write!(s, "<text x=\"{L}\" y=\"13\">{}</text>", esc(&self.y_label));
        for d in lo..=hi {
            let yy = y(10f64.powi(d));
            let _ = write!(s, "<line class=\"grid\" x1=\"{L}\" x2=\"{}\" y1=\"{yy:.1}\" y2=\"{yy:.1}\"/><text class=\"tick\" x=\"{}\" y=\"{:.1}\" text-anchor=\"end\">1e{d}</text>", W - R, L - 4.0, yy + 4.0);
        }
        let _ = write!(
            s,
            "<text class=\"tick\" x=\"{}\" y=\"{:.1}\" text-anchor=\"end\">0</text>",
            L - 4.0,
            zero_y + 4.0
        );
        // A group is labelled (and its boundary drawn) only where its label clears the last one:
        // 30 layers over 25 decode steps are 750 groups, whose labels would overprint.
        // A group of one position (a layer of the bisect chart) is labelled under its point;
        // a wider group (a layer's tensors) from its boundary, where its points start.
        let mut free_from = f64::NEG_INFINITY;
        for (k, (g, text)) in self.groups.iter().enumerate() {
            let xx = L + *g as f64 * pw / n;
            let width = GROUP_CHAR_PX * text.chars().count() as f64;
            let next = self.groups.get(k + 1).map_or(self.n, |(next, _)| *next);
            let (left, at, anchor) = if next == g + 1 {
                (x(*g) - width / 2.0, x(*g), "middle")
            } else {
                (xx + 2.0, xx + 2.0, "start")
            };
            if left < free_from {
                continue;
            }
            free_from = left + width + 4.0;
            let _ = write!(s, "<line class=\"grid\" x1=\"{xx:.1}\" x2=\"{xx:.1}\" y1=\"{T}\" y2=\"{}\"/><text class=\"group\" x=\"{at:.1}\" y=\"{}\" text-anchor=\"{anchor}\">{}</text>", T + ph, H - 8.0, esc(text));
        }
        let _ = write!(s, "<line class=\"axis\" x1=\"{L}\" x2=\"{L}\" y1=\"{T}\" y2=\"{}\"/><line class=\"axis\" x1=\"{L}\" x2=\"{}\" y1=\"{}\" y2=\"{}\"/>", T + ph, W - R, T + ph, T + ph);
        let half = (pw / n / 2.0).clamp(1.5, 8.0);
        for b in &self.bounds {
            if b.y > 0.0 && b.y.is_finite() {
                let (xx, yy) = (x(b.x), y(b.y));
                let _ = write!(s, "<line class=\"bound\" data-x=\"{}\" data-json=\"{}\" data-v=\"{}\" x1=\"{:.1}\" x2=\"{:.1}\" y1=\"{yy:.1}\" y2=\"{yy:.1}\"/>", b.x, esc(&b.pointer), esc(&b.json), xx - half, xx + half);
            }
        }
        for m in &self.marks {
            let xx = x(m.x);
            let _ = write!(
                s,
                "<g id=\"{}\" class=\"mark\" data-x=\"{}\" data-names=\"{}\"><line class=\"{}\" x1=\"{xx:.1}\" x2=\"{xx:.1}\" y1=\"{T}\" y2=\"{}\"/><text x=\"{:.1}\" y=\"{}\">{}</text><title>{}</title></g>",
                esc(&m.id),
                m.x,
                esc(&m.names),
                esc(&m.class),
                T + ph,
                xx + 3.0,
                T + 10.0,
                esc(&m.label),
                esc(&format!("{}: {}", m.label, m.names))
            );
        }
        for se in &self.series {
            let _ = write!(s, "<g class=\"series s-{}\">", esc(&se.key));
            for p in &se.points {
                let Some(v) = p.y else { continue };
                let (cy, class) = if v == 0.0 {
                    (zero_y, "pt zero")
                } else if !v.is_finite() {
                    (T, "pt off")
                } else {
                    (y(v), "pt")
                };
                let _ = write!(
                    s,
                    "<circle class=\"{class}\" data-x=\"{}\" data-json=\"{}\" data-v=\"{}\" cx=\"{:.1}\" cy=\"{cy:.1}\" r=\"3\"><title>{}</title></circle>",
                    p.x,
                    esc(&p.pointer),
                    esc(&p.json),
                    x(p.x),
                    esc(&p.title)
                );
            }
            s.push_str("</g>");
        }
        s.push_str("</svg>");
        let legend: Vec<String> = self.series.iter().map(|se| esc(&se.legend)).collect();
        let _ = write!(s, "<div class=\"note\">{}</div>", legend.join(" · "));
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chart(n: usize, groups: &[(usize, &str)]) -> String {
        let points = (0..n)
            .map(|x| Point {
                x,
                y: Some(0.1),
                pointer: String::new(),
                json: String::new(),
                title: String::new(),
            })
            .collect();
        LogChart {
            id: "c".into(),
            y_label: String::new(),
            n,
            groups: groups.iter().map(|(g, t)| (*g, t.to_string())).collect(),
            series: vec![Series {
                key: "s".into(),
                legend: String::new(),
                points,
            }],
            bounds: Vec::new(),
            marks: Vec::new(),
        }
        .render()
    }

    /// The `x` (or `cx`) of the element whose tag holds `what`, or whose text follows it.
    fn attr_x(svg: &str, open: &str, what: &str) -> f64 {
        let at = svg
            .find(what)
            .unwrap_or_else(|| panic!("{what} not in {svg}"));
        let start = svg[..at].rfind(open).unwrap();
        let tag = &svg[start..start + svg[start..].find('>').unwrap()];
        let v = tag
            .split(" x=\"")
            .nth(1)
            .or_else(|| tag.split(" cx=\"").nth(1));
        v.unwrap().split('"').next().unwrap().parse().unwrap()
    }

    #[test]
    fn a_one_point_group_is_labelled_under_its_point_and_a_wider_one_from_its_boundary() {
        // The bisect chart at decode: two layers, each one point 500 px wide; the labels sat at
        // the slots' left edges, half a slot from their points.
        let svg = chart(2, &[(0, "L00"), (1, "L01")]);
        for (i, label) in ["L00", "L01"].iter().enumerate() {
            let label_x = attr_x(&svg, "<text", &format!(">{label}<"));
            let point_x = attr_x(&svg, "<circle", &format!("data-x=\"{i}\""));
            assert_eq!(label_x, point_x, "{label}: {svg}");
        }
        assert!(svg.contains("text-anchor=\"middle\">L01<"), "{svg}");
        // A layer of four tensors: labelled from the group's boundary, as before.
        let svg = chart(8, &[(0, "L00"), (4, "L01")]);
        let boundary = L + 4.0 * (W - L - R) / 8.0;
        assert_eq!(attr_x(&svg, "<text", ">L01<"), boundary + 2.0, "{svg}");
        assert!(svg.contains("text-anchor=\"start\">L01<"), "{svg}");
    }
}
