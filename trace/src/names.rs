//! Capture-point names (docs/capture-points.md), built and parsed here and nowhere else in Rust.
//!
//! A name is `[decode.SSSS.][layer.NN.[expert.EEE.]]POINT`. The numbers are written zero-padded to
//! at least 4, 2 and 3 digits and read with every digit they have, so layer 100 is
//! `layer.100.x`, never read as layer 10. The Python side is `tracegate.names`.

use std::fmt;

/// Minimum widths of the zero-padded numbers.
const STEP_WIDTH: usize = 4;
const LAYER_WIDTH: usize = 2;
const EXPERT_WIDTH: usize = 3;

/// `layer.NN.POINT`, e.g. `layer(3, "mlp_out")` = `layer.03.mlp_out`.
pub fn layer(layer: usize, point: &str) -> String {
    format!("layer.{layer:0LAYER_WIDTH$}.{point}")
}

/// `layer.NN.` — the prefix every name of that layer starts with.
pub fn layer_prefix(layer: usize) -> String {
    format!("layer.{layer:0LAYER_WIDTH$}.")
}

/// `layer.NN.expert.EEE.POINT`, e.g. `expert(1, 7, "out")` = `layer.01.expert.007.out`.
pub fn expert(layer: usize, expert: usize, point: &str) -> String {
    format!("layer.{layer:0LAYER_WIDTH$}.expert.{expert:0EXPERT_WIDTH$}.{point}")
}

/// `decode.SSSS.REST`, e.g. `decode(2, "logits")` = `decode.0002.logits`.
pub fn decode(step: usize, rest: &str) -> String {
    format!("decode.{step:0STEP_WIDTH$}.{rest}")
}

/// The axis of a documented capture point that holds its tokens (docs/capture-points.md):
/// `attn_probs` is `[heads, tokens, keys]`, `linear.state` one row at its last token's
/// position, every other point token-major. None for a name outside the table (a port's own
/// point), whose layout is not known.
pub fn token_axis(name: &str) -> Option<usize> {
    let n = Name::parse(name);
    let known = match (n.layer, n.expert) {
        (None, _) => matches!(n.point, "embed.out" | "final_norm.out" | "logits"),
        (Some(_), Some(_)) => n.point == "out",
        (Some(_), None) => matches!(
            n.point,
            "hidden_in"
                | "q"
                | "k"
                | "v"
                | "attn_probs"
                | "attn_out"
                | "attn_gate"
                | "router.logits"
                | "mlp_out"
                | "hidden_out"
                | "linear.conv_out"
                | "linear.q"
                | "linear.k"
                | "linear.g"
                | "linear.beta"
                | "linear.core"
                | "linear.norm_out"
                | "linear.state"
                | "shared_expert.gate"
                | "shared_expert.out"
        ),
    };
    match n.point {
        _ if !known => None,
        "attn_probs" => Some(1),
        _ => Some(0),
    }
}

/// A capture-point or decision name taken apart. Every name parses: one without the prefixes is
/// all `point` (`logits`, `embed.out`, `final_norm.out`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Name<'a> {
    pub decode_step: Option<usize>,
    pub layer: Option<usize>,
    pub expert: Option<usize>,
    /// What follows the prefixes: `mlp_out`, `router.topk`, `out` (of an expert), `logits`, ….
    pub point: &'a str,
}

impl<'a> Name<'a> {
    /// Takes `name` apart. A prefix counts only with at least one digit and a following dot
    /// (`layer.x.y` is all point); a number too large for `usize` is not a number either.
    pub fn parse(name: &'a str) -> Self {
        let (decode_step, rest) = numbered("decode.", name);
        let (layer, rest) = numbered("layer.", rest);
        let (expert, rest) = match layer {
            Some(_) => numbered("expert.", rest),
            None => (None, rest),
        };
        Name {
            decode_step,
            layer,
            expert,
            point: rest,
        }
    }

    /// The same point without its decode-step prefix (the prefill name of a decode tensor).
    pub fn without_step(self) -> Self {
        Name {
            decode_step: None,
            ..self
        }
    }
}

impl fmt::Display for Name<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if let Some(s) = self.decode_step {
            write!(f, "decode.{s:0STEP_WIDTH$}.")?;
        }
        if let Some(l) = self.layer {
            write!(f, "layer.{l:0LAYER_WIDTH$}.")?;
        }
        if let Some(e) = self.expert {
            write!(f, "expert.{e:0EXPERT_WIDTH$}.")?;
        }
        f.write_str(self.point)
    }
}

/// Reads `PREFIX<digits>.` off the front of `s`.
fn numbered<'a>(prefix: &str, s: &'a str) -> (Option<usize>, &'a str) {
    let Some(rest) = s.strip_prefix(prefix) else {
        return (None, s);
    };
    let digits = rest.bytes().take_while(u8::is_ascii_digit).count();
    if digits == 0 || rest.as_bytes().get(digits) != Some(&b'.') {
        return (None, s);
    }
    match rest[..digits].parse() {
        Ok(n) => (Some(n), &rest[digits + 1..]),
        Err(_) => (None, s),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn builds_with_minimum_widths_and_grows_past_them() {
        assert_eq!(layer(3, "mlp_out"), "layer.03.mlp_out");
        assert_eq!(layer(100, "mlp_out"), "layer.100.mlp_out");
        assert_eq!(layer_prefix(7), "layer.07.");
        assert_eq!(expert(1, 7, "out"), "layer.01.expert.007.out");
        assert_eq!(expert(1, 1234, "out"), "layer.01.expert.1234.out");
        assert_eq!(decode(2, "logits"), "decode.0002.logits");
        assert_eq!(
            decode(12345, &layer(101, "hidden_in")),
            "decode.12345.layer.101.hidden_in"
        );
    }

    #[test]
    fn parses_every_digit() {
        let n = Name::parse("layer.100.attn_out");
        assert_eq!((n.layer, n.point), (Some(100), "attn_out"));
        let n = Name::parse("decode.10000.layer.05.mlp_out");
        assert_eq!(
            (n.decode_step, n.layer, n.point),
            (Some(10000), Some(5), "mlp_out")
        );
        let n = Name::parse("layer.02.expert.1000.out");
        assert_eq!((n.layer, n.expert, n.point), (Some(2), Some(1000), "out"));
        let n = Name::parse("layer.7.router.topk");
        assert_eq!((n.layer, n.point), (Some(7), "router.topk"));
    }

    #[test]
    fn names_without_numbers_are_all_point() {
        for s in [
            "logits",
            "embed.out",
            "final_norm.out",
            "layer.x.y",
            "layer.12",
            "layer..x",
        ] {
            assert_eq!(
                Name::parse(s),
                Name {
                    decode_step: None,
                    layer: None,
                    expert: None,
                    point: s
                }
            );
        }
        // An expert prefix outside a layer is not one.
        assert_eq!(Name::parse("expert.001.out").expert, None);
        // Too large for usize: not a number.
        assert_eq!(Name::parse("layer.99999999999999999999999.x").layer, None);
    }

    #[test]
    fn display_rebuilds_the_canonical_name() {
        for s in [
            "decode.0003.layer.101.hidden_out",
            "layer.00.expert.063.out",
            "logits",
        ] {
            assert_eq!(Name::parse(s).to_string(), s);
        }
        assert_eq!(
            Name::parse("decode.0003.final_norm.out")
                .without_step()
                .to_string(),
            "final_norm.out"
        );
    }
}
