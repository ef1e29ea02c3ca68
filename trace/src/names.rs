//! Capture-point names (docs/capture-points.md), built and parsed here and nowhere else in Rust.
//!
//! A name is `[decode.SSSS.][layer.NN.[expert.EEE.]]POINT`, or for a diffusion model
//! (docs/diffusion-gemma.md DG16) `[encode.BBBB.|denoise.BBBB.SSSS.|denoise.BBBB.]` in place of
//! the decode prefix. The numbers are written zero-padded to at least 4, 2 and 3 digits and read
//! with every digit they have, so layer 100 is `layer.100.x`, never read as layer 10. The Python
//! side is `tracegate.names`.

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

/// `denoise.BBBB.SSSS.REST`: step `step` of diffusion block `block` (docs/diffusion-gemma.md DG16),
/// e.g. `denoise(1, 3, "logits")` = `denoise.0001.0003.logits`.
pub fn denoise(block: usize, step: usize, rest: &str) -> String {
    format!("denoise.{block:0STEP_WIDTH$}.{step:0STEP_WIDTH$}.{rest}")
}

/// `denoise.BBBB.REST`: a decision of diffusion block `block` as a whole (`init_canvas`,
/// `commit`), e.g. `denoise_block(0, "commit")` = `denoise.0000.commit`.
pub fn denoise_block(block: usize, rest: &str) -> String {
    format!("denoise.{block:0STEP_WIDTH$}.{rest}")
}

/// `encode.BBBB.REST`: the encoder pass over diffusion block `block`'s committed canvas, e.g.
/// `encode(0, "embed.out")` = `encode.0000.embed.out`. The prompt's encoder pass is unprefixed.
pub fn encode(block: usize, rest: &str) -> String {
    format!("encode.{block:0STEP_WIDTH$}.{rest}")
}

/// The axis of a registered capture point that holds its tokens ([`Point::token_axis`]). None
/// for a name outside the registry (a port's own point), whose layout is not known, and for a
/// registered point that is not token-major.
pub fn token_axis(name: &str) -> Option<usize> {
    point(name)
        .filter(|p| p.kind == Kind::Tensor)
        .and_then(|p| p.token_axis)
}

/// Where a point's name lives: the whole model (`logits`), one layer (`layer.NN.POINT`) or one
/// expert of a layer (`layer.NN.expert.EEE.POINT`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Scope {
    Model,
    Layer,
    Expert,
}

/// A tensor, or a discrete decision recorded with its margins.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Kind {
    Tensor,
    Decision,
}

/// The block of the model a point belongs to; bisection names a wrong layer's stage by it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Block {
    Embedding,
    /// The residual stream entering a layer.
    Input,
    /// The token mixer: softmax attention or linear attention, up to its output projection.
    Attention,
    Router,
    /// The routed experts' outputs and the shared expert beside them.
    Experts,
    /// The layer's feed-forward output: a dense MLP or the combined MoE.
    FeedForward,
    /// The layer's output after both residual adds.
    Residual,
    /// Final norm, logits and the token decision.
    Head,
    /// A diffusion decoder's self-conditioning on the previous step's logits, before layer 0.
    SelfConditioning,
    /// A diffusion step's draws and decisions after the head: sampling, acceptance, renoising,
    /// stopping, the committed canvas.
    Sampler,
}

/// Which `--capture` level asks for a point.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Capture {
    Default,
    Internals,
}

/// The dtype a point is stored in.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Stored {
    /// The dtype the producer computes in (provenance `dtype`).
    Computed,
    /// f32 whatever the model's dtype: transformers computes these in f32 under bf16/f16 (the
    /// linear attention's L2-normed q and k, its decay and its state).
    F32,
    /// Token ids, i64 (a diffusion step's input canvas).
    Tokens,
}

/// What a layer must have for a point to exist in it. A family has the points whose feature it
/// has ([`FAMILIES`]); `Any` points exist in every family.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Feature {
    Any,
    /// Softmax attention (a full- or sliding-attention layer).
    SoftmaxAttention,
    /// Gated DeltaNet linear attention (a hybrid family's linear layers).
    LinearAttention,
    /// A sigmoid gate on the attention output, taken from `q_proj` (Qwen3.5).
    OutputGate,
    /// A routed mixture of experts.
    Moe,
    /// A gated shared expert beside the routed ones.
    SharedExpert,
    /// A next-token head: `logits.argmax` over the prompt's rows (every causal family).
    Autoregressive,
    /// Block diffusion (docs/diffusion-gemma.md): canvases, self-conditioning, denoise steps'
    /// draws and decisions, and its layers' dense MLP beside the routed experts.
    Diffusion,
}

/// Whether a point is also written for each decode step (`decode.SSSS.` + its name, docs/
/// capture-points.md "Rows and positions on each path").
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum InDecode {
    Never,
    /// In the prompt's trace and, under `--capture internals` (`logits` always), each step's.
    Also,
    /// Only as a decode step's (`decode.SSSS.argmax`).
    Only,
}

/// One capture point of docs/capture-points.md.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Point {
    /// The name after its prefixes: `attn_out`, `out` (of an expert), `logits.argmax`.
    pub name: &'static str,
    pub scope: Scope,
    pub kind: Kind,
    pub block: Block,
    pub capture: Capture,
    /// The axis that holds one row per token: 0 for most, 1 for `attn_probs`
    /// (`[heads, tokens, keys]`); None when the point is not token-major.
    pub token_axis: Option<usize>,
    pub stored: Stored,
    pub needs: Feature,
    pub in_decode: InDecode,
    /// How a rank of a sharded run may hold it (docs/trace-format.md, "Sharded traces"):
    /// replicated always, and the ways listed here.
    pub shard: ShardAs,
}

const fn at(
    scope: Scope,
    name: &'static str,
    block: Block,
    capture: Capture,
    needs: Feature,
) -> Point {
    Point {
        name,
        scope,
        kind: Kind::Tensor,
        block,
        capture,
        token_axis: Some(0),
        stored: Stored::Computed,
        needs,
        in_decode: InDecode::Never,
        shard: ShardAs::REPLICATED,
    }
}

const fn decision(scope: Scope, name: &'static str, block: Block, needs: Feature) -> Point {
    Point {
        kind: Kind::Decision,
        ..at(scope, name, block, Capture::Default, needs)
    }
}

const fn per_step(p: Point) -> Point {
    Point {
        in_decode: InDecode::Also,
        ..p
    }
}

const fn internals(p: Point) -> Point {
    Point {
        capture: Capture::Internals,
        ..p
    }
}

/// Split along `axis` across ranks (heads, the vocabulary).
const fn sliced(axis: usize, p: Point) -> Point {
    Point {
        shard: ShardAs {
            slice_axis: Some(axis),
            ..p.shard
        },
        ..p
    }
}

/// A partial sum on each rank before the all-reduce (a row-parallel projection's output).
const fn partial(p: Point) -> Point {
    Point {
        shard: ShardAs {
            partial: true,
            ..p.shard
        },
        ..p
    }
}

/// Held by the rank that holds its expert.
const fn by_expert(p: Point) -> Point {
    Point {
        shard: ShardAs {
            experts: true,
            ..p.shard
        },
        ..p
    }
}

const fn f32_stored(p: Point) -> Point {
    Point {
        stored: Stored::F32,
        ..p
    }
}

/// Every capture point and decision, in computation order: the one registry that the writer's
/// positions check, the differ's row excusal, bisection's stage descent, the policies' coverage
/// test, the oracle's hooks and docs/capture-points.md's tables are held to (mirrored in Python
/// as `tracegate.names.POINTS`). A linear-attention layer holds the `linear.*` points, a softmax
/// one `q` to `attn_probs`; the rest of a layer is shared.
pub const POINTS: &[Point] = {
    use Block as B;
    use Capture::{Default as D, Internals as I};
    use Feature as F;
    use Scope::{Expert as E, Layer as L, Model as M};
    &[
        Point {
            stored: Stored::Tokens,
            ..at(M, "canvas", B::Embedding, D, F::Diffusion)
        },
        // A vocabulary-parallel embedding: each rank looks up its rows, zeros elsewhere.
        partial(at(M, "embed.out", B::Embedding, D, F::Any)),
        at(M, "sc.soft", B::SelfConditioning, D, F::Diffusion),
        internals(at(M, "sc.mlp_out", B::SelfConditioning, D, F::Diffusion)),
        at(M, "sc.out", B::SelfConditioning, D, F::Diffusion),
        per_step(at(L, "hidden_in", B::Input, D, F::Any)),
        at(L, "linear.conv_out", B::Attention, I, F::LinearAttention),
        sliced(
            1,
            f32_stored(at(L, "linear.q", B::Attention, I, F::LinearAttention)),
        ),
        sliced(
            1,
            f32_stored(at(L, "linear.k", B::Attention, I, F::LinearAttention)),
        ),
        sliced(
            1,
            f32_stored(at(L, "linear.g", B::Attention, I, F::LinearAttention)),
        ),
        sliced(1, at(L, "linear.beta", B::Attention, I, F::LinearAttention)),
        sliced(1, at(L, "linear.core", B::Attention, I, F::LinearAttention)),
        sliced(
            1,
            at(L, "linear.norm_out", B::Attention, I, F::LinearAttention),
        ),
        // One row: the state after the call's last token, at that token's position.
        sliced(
            1,
            f32_stored(at(L, "linear.state", B::Attention, I, F::LinearAttention)),
        ),
        sliced(1, at(L, "q", B::Attention, I, F::SoftmaxAttention)),
        sliced(1, at(L, "k", B::Attention, I, F::SoftmaxAttention)),
        sliced(1, at(L, "v", B::Attention, I, F::SoftmaxAttention)),
        sliced(1, at(L, "attn_gate", B::Attention, I, F::OutputGate)),
        sliced(
            0,
            Point {
                token_axis: Some(1),
                ..at(L, "attn_probs", B::Attention, I, F::SoftmaxAttention)
            },
        ),
        partial(per_step(at(L, "attn_out", B::Attention, D, F::Any))),
        // Diffusion Gemma's layer: the attention residual, then a dense MLP and the routed
        // experts side by side, each normed, summed and normed again into `mlp_out`.
        at(L, "attn_residual", B::Residual, I, F::Diffusion),
        partial(at(L, "dense_mlp.out", B::FeedForward, I, F::Diffusion)),
        at(L, "dense_mlp.branch", B::FeedForward, D, F::Diffusion),
        at(L, "router.logits", B::Router, I, F::Moe),
        decision(L, "router.topk", B::Router, F::Moe),
        by_expert(partial(at(E, "out", B::Experts, I, F::Moe))),
        at(L, "moe.out", B::FeedForward, I, F::Diffusion),
        at(L, "moe.branch", B::FeedForward, D, F::Diffusion),
        at(L, "shared_expert.gate", B::Experts, I, F::SharedExpert),
        partial(at(L, "shared_expert.out", B::Experts, I, F::SharedExpert)),
        partial(per_step(at(L, "mlp_out", B::FeedForward, D, F::Any))),
        per_step(at(L, "hidden_out", B::Residual, D, F::Any)),
        per_step(at(M, "final_norm.out", B::Head, D, F::Any)),
        at(M, "logits.uncapped", B::Head, I, F::Diffusion),
        sliced(1, partial(per_step(at(M, "logits", B::Head, D, F::Any)))),
        at(M, "logits.tempered", B::Head, D, F::Diffusion),
        at(M, "entropy", B::Head, D, F::Diffusion),
        decision(M, "logits.argmax", B::Head, F::Autoregressive),
        // A decode step's token, and a denoise step's argmax canvas.
        Point {
            in_decode: InDecode::Only,
            ..decision(M, "argmax", B::Head, F::Any)
        },
        // A diffusion block's initial canvas (`denoise.BBBB.`), then each step's draws and
        // decisions (`denoise.BBBB.SSSS.`), then the block's committed canvas.
        decision(M, "init_canvas", B::Sampler, F::Diffusion),
        decision(M, "sampled", B::Sampler, F::Diffusion),
        decision(M, "accept", B::Sampler, F::Diffusion),
        decision(M, "renoise", B::Sampler, F::Diffusion),
        decision(M, "stop", B::Sampler, F::Diffusion),
        decision(M, "commit", B::Sampler, F::Diffusion),
    ]
};

/// The families some producer here implements (their config's `model_type`), with the features
/// their layers have; a family has every point whose [`Point::needs`] it lists, and the `Any`
/// ones. A MoE family may also have dense layers (`mlp_only_layers`).
pub const FAMILIES: &[(&str, &[Feature])] = {
    use Feature::*;
    const DENSE: &[Feature] = &[Autoregressive, SoftmaxAttention];
    const MOE: &[Feature] = &[Autoregressive, SoftmaxAttention, Moe];
    const HYBRID: &[Feature] = &[
        Autoregressive,
        SoftmaxAttention,
        LinearAttention,
        OutputGate,
    ];
    const HYBRID_MOE: &[Feature] = &[
        Autoregressive,
        SoftmaxAttention,
        LinearAttention,
        OutputGate,
        Moe,
        SharedExpert,
    ];
    const DIFFUSION: &[Feature] = &[SoftmaxAttention, Moe, Diffusion];
    &[
        ("llama", DENSE),
        ("mistral", DENSE),
        ("qwen2", DENSE),
        ("qwen3", DENSE),
        ("gemma3_text", DENSE),
        ("olmo2", DENSE),
        ("phi3", DENSE),
        ("qwen3_moe", MOE),
        ("mixtral", MOE),
        ("olmoe", MOE),
        ("qwen3_5_text", HYBRID),
        ("qwen3_5", HYBRID),
        ("qwen3_5_moe_text", HYBRID_MOE),
        ("qwen3_5_moe", HYBRID_MOE),
        ("diffusion_gemma", DIFFUSION),
    ]
};

/// The registered point a full name is an instance of (its decode step, diffusion prefix, layer
/// and expert numbers set aside); None for a name outside the registry.
pub fn point(name: &str) -> Option<&'static Point> {
    let n = Name::parse(name);
    let scope = match (n.layer, n.expert) {
        (None, _) => Scope::Model,
        (Some(_), None) => Scope::Layer,
        (Some(_), Some(_)) => Scope::Expert,
    };
    POINTS
        .iter()
        .find(|p| p.scope == scope && p.name == n.point)
}

/// The features of family `model_type`; None for a family no producer here implements.
pub fn family_features(model_type: &str) -> Option<&'static [Feature]> {
    FAMILIES
        .iter()
        .find(|(f, _)| *f == model_type)
        .map(|(_, features)| *features)
}

/// Whether family `model_type` has point `p`; None for an unknown family.
pub fn family_has(model_type: &str, p: &Point) -> Option<bool> {
    family_features(model_type).map(|fs| p.needs == Feature::Any || fs.contains(&p.needs))
}

/// A capture-point or decision name taken apart. Every name parses: one without the prefixes is
/// all `point` (`logits`, `embed.out`, `final_norm.out`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Name<'a> {
    pub decode_step: Option<usize>,
    /// A diffusion model's pass (docs/diffusion-gemma.md DG16); never together with a decode step.
    pub diffusion: Option<Diffusion>,
    pub layer: Option<usize>,
    pub expert: Option<usize>,
    /// What follows the prefixes: `mlp_out`, `router.topk`, `out` (of an expert), `logits`, ….
    pub point: &'a str,
}

/// Where a diffusion model's name lives: the encoder pass over block `block`'s committed canvas
/// (`encode.BBBB.`), step `step` of block `block` (`denoise.BBBB.SSSS.`), or block `block` as a
/// whole (`denoise.BBBB.`: its initial and committed canvas). The prompt's encoder pass has no
/// prefix.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Diffusion {
    Encode { block: usize },
    Denoise { block: usize, step: usize },
    Block { block: usize },
}

impl Diffusion {
    pub fn block(self) -> usize {
        match self {
            Diffusion::Encode { block }
            | Diffusion::Denoise { block, .. }
            | Diffusion::Block { block } => block,
        }
    }
}

impl<'a> Name<'a> {
    /// Takes `name` apart. A prefix counts only with at least one digit and a following dot
    /// (`layer.x.y` is all point); a number too large for `usize` is not a number either.
    pub fn parse(name: &'a str) -> Self {
        let (decode_step, rest) = numbered("decode.", name);
        let (diffusion, rest) = match decode_step {
            Some(_) => (None, rest),
            None => diffusion(rest),
        };
        let (layer, rest) = numbered("layer.", rest);
        let (expert, rest) = match layer {
            Some(_) => numbered("expert.", rest),
            None => (None, rest),
        };
        Name {
            decode_step,
            diffusion,
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
        match self.diffusion {
            Some(Diffusion::Encode { block: b }) => write!(f, "encode.{b:0STEP_WIDTH$}.")?,
            Some(Diffusion::Denoise { block: b, step: s }) => {
                write!(f, "denoise.{b:0STEP_WIDTH$}.{s:0STEP_WIDTH$}.")?
            }
            Some(Diffusion::Block { block: b }) => write!(f, "denoise.{b:0STEP_WIDTH$}.")?,
            None => {}
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

/// Reads a diffusion prefix off the front of `s`: `encode.BBBB.`, `denoise.BBBB.SSSS.` or
/// `denoise.BBBB.` (a block's own decision: the rest does not start with a number).
fn diffusion(s: &str) -> (Option<Diffusion>, &str) {
    if let (Some(block), rest) = numbered("encode.", s) {
        return (Some(Diffusion::Encode { block }), rest);
    }
    let (Some(block), rest) = numbered("denoise.", s) else {
        return (None, s);
    };
    match numbered("", rest) {
        (Some(step), rest) => (Some(Diffusion::Denoise { block, step }), rest),
        (None, rest) => (Some(Diffusion::Block { block }), rest),
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

/// How the registry lets a capture point be sharded (`Point::shard`). Every point may be
/// replicated; these say what else it may be.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct ShardAs {
    /// A slice along this axis (heads, vocabulary).
    pub slice_axis: Option<usize>,
    /// A partial sum, before the all-reduce (a row-parallel projection's output).
    pub partial: bool,
    /// Held by the rank holding its expert (expert parallelism).
    pub experts: bool,
}

impl ShardAs {
    pub const REPLICATED: ShardAs = ShardAs {
        slice_axis: None,
        partial: false,
        experts: false,
    };

    /// `replicated, partial, slice along axis 1`, for a refusal.
    pub fn describe(&self) -> String {
        let mut out = vec!["replicated".to_string()];
        if let Some(a) = self.slice_axis {
            out.push(format!("slice along axis {a}"));
        }
        if self.partial {
            out.push("partial".into());
        }
        if self.experts {
            out.push("experts".into());
        }
        out.join(", ")
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
                    diffusion: None,
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
    fn registry_names_are_unique_and_found_by_any_instance() {
        for (i, p) in POINTS.iter().enumerate() {
            assert!(
                !POINTS[..i]
                    .iter()
                    .any(|q| q.scope == p.scope && q.name == p.name),
                "{} registered twice",
                p.name
            );
        }
        assert_eq!(
            point("decode.0003.layer.101.mlp_out").unwrap().name,
            "mlp_out"
        );
        assert_eq!(
            point("layer.02.expert.1000.out").unwrap().block,
            Block::Experts
        );
        assert_eq!(point("logits.argmax").unwrap().kind, Kind::Decision);
        // Scope matters: `out` alone is no point, `mlp_out` outside a layer neither.
        assert_eq!(point("out"), None);
        assert_eq!(point("mlp_out"), None);
        assert_eq!(point("layer.01.my_port_point"), None);
    }

    #[test]
    fn token_axis_follows_the_registry() {
        assert_eq!(token_axis("layer.03.attn_probs"), Some(1));
        assert_eq!(token_axis("decode.0001.layer.03.attn_probs"), Some(1));
        assert_eq!(token_axis("layer.03.linear.state"), Some(0));
        assert_eq!(token_axis("layer.03.expert.007.out"), Some(0));
        assert_eq!(token_axis("embed.out"), Some(0));
        assert_eq!(token_axis("layer.03.unknown"), None);
        // A decision's name is no tensor's layout.
        assert_eq!(token_axis("logits.argmax"), None);
    }

    #[test]
    fn families_have_the_points_of_their_features() {
        let gate = point("layer.00.attn_gate").unwrap();
        let topk = point("layer.00.router.topk").unwrap();
        let logits = point("logits").unwrap();
        assert_eq!(family_has("qwen3", gate), Some(false));
        assert_eq!(family_has("qwen3_5_text", gate), Some(true));
        assert_eq!(family_has("qwen3", topk), Some(false));
        assert_eq!(family_has("mixtral", topk), Some(true));
        assert_eq!(family_has("llama", logits), Some(true));
        assert_eq!(family_has("no_such_family", logits), None);
    }

    #[test]
    fn diffusion_prefixes_parse_and_rebuild() {
        let n = Name::parse("denoise.0001.0003.layer.02.expert.005.out");
        assert_eq!(
            (n.diffusion, n.layer, n.expert, n.point),
            (
                Some(Diffusion::Denoise { block: 1, step: 3 }),
                Some(2),
                Some(5),
                "out"
            )
        );
        let n = Name::parse("denoise.0002.commit");
        assert_eq!(
            (n.diffusion, n.point),
            (Some(Diffusion::Block { block: 2 }), "commit")
        );
        let n = Name::parse("encode.0000.layer.01.hidden_out");
        assert_eq!(
            (n.diffusion, n.layer, n.point),
            (Some(Diffusion::Encode { block: 0 }), Some(1), "hidden_out")
        );
        // Four digits are a minimum, not a limit; a decode step is never also a diffusion pass.
        assert_eq!(
            Name::parse("denoise.10000.20000.logits").diffusion,
            Some(Diffusion::Denoise {
                block: 10000,
                step: 20000
            })
        );
        assert_eq!(Name::parse("decode.0001.denoise.0001.x").diffusion, None);
        // Without a number it is no prefix.
        assert_eq!(Name::parse("denoise.x.y").diffusion, None);
        assert_eq!(Name::parse("encode.logits").point, "encode.logits");
        for s in [
            "denoise.0001.0003.layer.02.expert.005.out",
            "denoise.0002.init_canvas",
            "encode.0003.embed.out",
            "denoise.0000.0000.sc.soft",
        ] {
            assert_eq!(Name::parse(s).to_string(), s);
        }
        assert_eq!(denoise(1, 3, "logits"), "denoise.0001.0003.logits");
        assert_eq!(denoise_block(0, "commit"), "denoise.0000.commit");
        assert_eq!(encode(2, &layer(1, "k")), "encode.0002.layer.01.k");
    }

    #[test]
    fn diffusion_points_are_found_in_every_pass() {
        assert_eq!(
            point("denoise.0000.0001.layer.03.attn_probs")
                .unwrap()
                .token_axis,
            Some(1)
        );
        assert_eq!(
            point("denoise.0000.0001.canvas").unwrap().stored,
            Stored::Tokens
        );
        assert_eq!(
            point("denoise.0000.0001.argmax").unwrap().kind,
            Kind::Decision
        );
        assert_eq!(point("denoise.0004.commit").unwrap().block, Block::Sampler);
        assert_eq!(
            point("encode.0000.layer.00.moe.branch").unwrap().block,
            Block::FeedForward
        );
        let dense = point("layer.00.dense_mlp.branch").unwrap();
        assert_eq!(family_has("diffusion_gemma", dense), Some(true));
        assert_eq!(family_has("qwen3_moe", dense), Some(false));
        // A diffusion model has no next-token head over its prompt.
        let argmax = point("logits.argmax").unwrap();
        assert_eq!(family_has("diffusion_gemma", argmax), Some(false));
        assert_eq!(family_has("llama", argmax), Some(true));
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
