//! Where a name of a block-diffusion trace stands in the run (docs/capture-points.md,
//! "Diffusion Gemma", Order): the prompt's encoder pass, then per block its initial canvas,
//! its denoise steps (each: routers, tensors, then `argmax`, `sampled`, `accept`, `renoise`,
//! `stop`), its commit, then its commit pass. The order is read from the names, never from a
//! trace's own order, so a trace cannot move a tensor before a draw by recording it earlier.

use tracegate_trace::names::{Diffusion, Name};

/// A decision of the sampler (docs/diffusion-gemma.md DG13, DG14).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Sampler {
    InitCanvas,
    Argmax,
    Sampled,
    Accept,
    Renoise,
    Stop,
    Commit,
}

impl Sampler {
    /// A draw: its values come from the generator (DG15), not from the model alone.
    pub fn is_draw(self) -> bool {
        matches!(
            self,
            Sampler::InitCanvas | Sampler::Sampled | Sampler::Renoise
        )
    }
}

/// A name's place: block, step (for a step's names), and which sampler decision, if one.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Place {
    pub block: usize,
    pub step: Option<usize>,
    pub sampler: Option<Sampler>,
    pub layer: Option<usize>,
    /// The commit pass (`encode.BBBB.`).
    pub encode: bool,
}

/// Run order: the prompt pass (unprefixed) is (0, …); block b's init_canvas (b+1, 0), its step
/// s (b+1, 1, s, k) with k the sampler decision's rank in the step (0 for tensors and routers),
/// its commit (b+1, 2), its commit pass (b+1, 3).
pub type Key = (usize, u8, usize, u8);

/// The place of a diffusion name; None for an unprefixed (prompt pass) or other name.
pub fn place(name: &str) -> Option<Place> {
    let n = Name::parse(name);
    let sampler = |point: &str| match point {
        "init_canvas" => Some(Sampler::InitCanvas),
        "argmax" => Some(Sampler::Argmax),
        "sampled" => Some(Sampler::Sampled),
        "accept" => Some(Sampler::Accept),
        "renoise" => Some(Sampler::Renoise),
        "stop" => Some(Sampler::Stop),
        "commit" => Some(Sampler::Commit),
        _ => None,
    };
    let (block, step, encode) = match n.diffusion? {
        Diffusion::Encode { block } => (block, None, true),
        Diffusion::Denoise { block, step } => (block, Some(step), false),
        Diffusion::Block { block } => (block, None, false),
    };
    let own = n.layer.is_none() && !encode;
    Some(Place {
        block,
        step,
        sampler: sampler(n.point).filter(|s| {
            own && match s {
                Sampler::InitCanvas | Sampler::Commit => step.is_none(),
                _ => step.is_some(),
            }
        }),
        layer: n.layer,
        encode,
    })
}

/// The run-order key of a tensor or decision name (see [`Key`]). A `denoise.BBBB.` name that is
/// neither init_canvas nor commit sorts with the commit; any other name of a step with its
/// tensors, before its sampler decisions.
pub fn key(name: &str) -> Key {
    let Some(p) = place(name) else {
        return (0, 0, 0, 0);
    };
    let b = p.block.saturating_add(1);
    if p.encode {
        return (b, 3, 0, 0);
    }
    match (p.step, p.sampler) {
        (None, Some(Sampler::InitCanvas)) => (b, 0, 0, 0),
        (None, _) => (b, 2, 0, 0),
        (Some(s), sampler) => {
            let k = match sampler {
                // A step's tensors and routers: before its sampler decisions.
                None => 0,
                Some(Sampler::Argmax) => 1,
                Some(Sampler::Sampled) => 2,
                Some(Sampler::Accept) => 3,
                Some(Sampler::Renoise) => 4,
                Some(Sampler::Stop) => 5,
                Some(Sampler::InitCanvas | Sampler::Commit) => 6,
            };
            (b, 1, s, k)
        }
    }
}

/// Whether a name (tensor or decision) comes after the draw `draw` (a sampler draw decision's
/// name) in the run, so that what it holds may follow from the draw's values. A step's own
/// `accept` and `stop` do not: they read that step's entropy and the argmax canvases, never its
/// draws (DG13.3, DG13.5), so they stay judged.
pub fn after_draw(draw: &str, name: &str) -> bool {
    let (d, n) = (key(draw), key(name));
    if n <= d {
        return false;
    }
    let same_step = d.0 == n.0 && d.1 == 1 && n.1 == 1 && d.2 == n.2;
    let reads_no_draw = matches!(
        place(name).and_then(|p| p.sampler),
        Some(Sampler::Accept | Sampler::Stop)
    );
    !(same_step && reads_no_draw)
}

/// Whether a trace is a block-diffusion trace: some name carries a diffusion prefix.
pub(crate) fn is_diffusion<'a>(mut names: impl Iterator<Item = &'a str>) -> bool {
    names.any(|n| Name::parse(n).diffusion.is_some())
}

/// The place in words, for a headline: "block 0 step 3 layer 01", "block 1 commit pass layer
/// 00", "block 2"; None for a name without a diffusion prefix.
pub fn in_words(name: &str) -> Option<String> {
    let p = place(name)?;
    let mut s = format!("block {}", p.block);
    if let Some(step) = p.step {
        s += &format!(" step {step}");
    }
    if p.encode {
        s += " commit pass";
    }
    if let Some(l) = p.layer {
        s += &format!(" layer {l:02}");
    }
    Some(s)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn run_order() {
        let order = [
            "layer.00.hidden_out",
            "denoise.0000.init_canvas",
            "denoise.0000.0000.canvas",
            "denoise.0000.0000.layer.00.router.topk",
            "denoise.0000.0000.entropy",
            "denoise.0000.0000.argmax",
            "denoise.0000.0000.sampled",
            "denoise.0000.0000.accept",
            "denoise.0000.0000.renoise",
            "denoise.0000.0000.stop",
            "denoise.0000.0001.canvas",
            "denoise.0000.commit",
            "encode.0000.layer.00.hidden_out",
            "denoise.0001.init_canvas",
        ];
        for w in order.windows(2) {
            assert!(key(w[0]) <= key(w[1]), "{} before {}", w[0], w[1]);
        }
        assert!(key("denoise.0000.0000.canvas") == key("denoise.0000.0000.entropy"));
        assert_eq!(
            place("denoise.0000.0000.layer.00.router.topk")
                .unwrap()
                .sampler,
            None
        );
        assert_eq!(
            place("encode.0000.layer.00.router.topk").unwrap().sampler,
            None
        );
        assert_eq!(place("logits.argmax"), None);
    }

    #[test]
    fn what_follows_a_draw() {
        let s = "denoise.0000.0001.sampled";
        assert!(!after_draw(s, "denoise.0000.0001.entropy"));
        assert!(!after_draw(s, "denoise.0000.0001.argmax"));
        assert!(!after_draw(s, "denoise.0000.0001.accept"));
        assert!(!after_draw(s, "denoise.0000.0001.stop"));
        assert!(after_draw(s, "denoise.0000.0001.renoise"));
        assert!(after_draw(s, "denoise.0000.0002.canvas"));
        assert!(after_draw(s, "denoise.0000.commit"));
        assert!(after_draw(s, "encode.0000.layer.00.hidden_in"));
        assert!(!after_draw(s, "layer.00.hidden_in"));
        let i = "denoise.0001.init_canvas";
        assert!(!after_draw(i, "encode.0000.layer.00.hidden_in"));
        assert!(after_draw(i, "denoise.0001.0000.canvas"));
        assert!(after_draw(i, "denoise.0001.0000.accept"));
    }

    #[test]
    fn places_in_words() {
        assert_eq!(
            in_words("denoise.0000.0003.layer.01.mlp_out").as_deref(),
            Some("block 0 step 3 layer 01")
        );
        assert_eq!(
            in_words("encode.0001.layer.00.attn_out").as_deref(),
            Some("block 1 commit pass layer 00")
        );
        assert_eq!(in_words("layer.00.attn_out"), None);
    }
}
