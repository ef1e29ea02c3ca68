//! The decisions' operations: §10.3 router top-k, §12 argmax and margin, and the margin of a
//! forced choice.

/// §10.3 the k largest entries ordered by (descending value, ascending index), plus the
/// (k+1)-th in that order when it exists. IEEE `>`; callers refuse NaN first.
pub fn topk(p: &[f32], k: usize) -> (Vec<usize>, Option<usize>) {
    let mut idx: Vec<usize> = (0..p.len()).collect();
    // Stable sort by descending value keeps ascending index among equals.
    idx.sort_by(|&a, &b| p[b].partial_cmp(&p[a]).unwrap_or(std::cmp::Ordering::Equal));
    let next = idx.get(k).copied();
    idx.truncate(k);
    (idx, next)
}

/// §12 argmax (ties to the lowest index, IEEE `>`) and margin `top1 ⊖ top2`. Requires no NaN
/// and length ≥ 2 (checked by the caller).
pub fn argmax_margin(v: &[f32]) -> (usize, f32) {
    let mut best = 0;
    for i in 1..v.len() {
        if v[i] > v[best] {
            best = i;
        }
    }
    let mut second = f32::NEG_INFINITY;
    for (i, &x) in v.iter().enumerate() {
        if i != best && x > second {
            second = x;
        }
    }
    (best, v[best] - second)
}

/// The margin of a given choice (docs/producers.md, forced decisions): the value of the chosen
/// index that comes last in rank order (descending value, ascending index) ⊖ the value of the
/// unchosen index that comes first. For the producer's own choice this is the margin above
/// (`argmax_margin`, and `p[k-th] ⊖ p[(k+1)-th]` of `topk`); for another choice it is what this
/// producer's numbers say about it, negative where they rank an unchosen index higher.
/// Requires no NaN and at least one unchosen index.
pub fn margin_of(v: &[f32], chosen: &[usize]) -> f32 {
    // a before b in rank order (IEEE equality: ±0 tie and go by index).
    let before = |a: usize, b: usize| v[a] > v[b] || (v[a] == v[b] && a < b);
    let mut weakest = chosen[0];
    for &c in &chosen[1..] {
        if before(weakest, c) {
            weakest = c;
        }
    }
    let mut strongest: Option<usize> = None;
    for i in 0..v.len() {
        if !chosen.contains(&i) && strongest.is_none_or(|s| before(i, s)) {
            strongest = Some(i);
        }
    }
    v[weakest] - v[strongest.expect("an unchosen index exists")]
}
