//! The random numbers of the bit-exact diffusion producers (docs/diffusion-gemma.md DG15):
//! SplitMix64 streams keyed by (seed, purpose, block, step), uniforms, uniform tokens and the
//! categorical draw. The contract draws the same numbers; torch's generator is never reproduced.

const GAMMA: u64 = 0x9E37_79B9_7F4A_7C15;

/// The purposes of DG15.2, each its own stream per (block, step).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Purpose {
    Init = 1,
    Sample = 2,
    Renoise = 3,
}

/// DG15.1 the finaliser.
pub fn mix64(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// DG15.2 the key of stream (seed, purpose, block, step); block and step below 2^32.
pub fn key(seed: u64, purpose: Purpose, block: u64, step: u64) -> u64 {
    mix64(mix64(mix64(seed) ^ purpose as u64) ^ ((block << 32) | step))
}

/// DG15.1 output i of the stream with key `k`: `mix64(k + (i + 1)·GAMMA)`.
pub fn output(k: u64, i: u64) -> u64 {
    mix64(k.wrapping_add(i.wrapping_add(1).wrapping_mul(GAMMA)))
}

/// DG15.3 a binary64 in [0, 1): the top 53 bits.
pub fn uniform(x: u64) -> f64 {
    (x >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
}

/// DG15.3 a uniform token in [0, v): the high 64 bits of x·v.
pub fn token(x: u64, v: u64) -> u64 {
    ((x as u128 * v as u128) >> 64) as u64
}

/// DG15.4 the categorical draw from f32 probabilities `p` with uniform `u`: binary64 running
/// sums in ascending order, the first index whose sum exceeds `u · total`; when rounding leaves
/// none, the largest index with p > 0. None when no probability is positive.
pub fn categorical(p: &[f32], u: f64) -> Option<usize> {
    let mut cum = Vec::with_capacity(p.len());
    let mut c = 0.0f64;
    for &x in p {
        c += x as f64;
        cum.push(c);
    }
    let t = u * c;
    cum.iter()
        .position(|&s| s > t)
        .or_else(|| p.iter().rposition(|&x| x > 0.0))
}

#[cfg(test)]
mod tests {
    use super::*;

    // The vectors of DG15.5, computed independently of this code.
    #[test]
    fn splitmix_from_zero() {
        let out: Vec<u64> = (0..3).map(|i| output(0, i)).collect();
        assert_eq!(
            out,
            [0xE220A8397B1DCDAF, 0x6E789E6AA1B965F4, 0x06C45D188009454F]
        );
    }

    #[test]
    fn keys_outputs_uniforms_tokens() {
        let k = key(0, Purpose::Init, 0, 0);
        assert_eq!(k, 0x7AB40E090F363A7D);
        let x: Vec<u64> = (0..4).map(|i| output(k, i)).collect();
        assert_eq!(
            x,
            [
                0x4181B152FB77616F,
                0x169C646D52269D62,
                0x4A5DE8D8D53B7280,
                0x90F7EFBD6C5ECAF3
            ]
        );
        let u: Vec<f64> = x.iter().map(|&x| uniform(x)).collect();
        assert_eq!(
            u,
            [
                0.2558852031320078,
                0.08832385701148338,
                0.29049544614575296,
                0.5662832105120926
            ]
        );
        let t: Vec<u64> = x.iter().map(|&x| token(x, 97)).collect();
        assert_eq!(t, [24, 8, 28, 54]);

        // (seed, purpose, block, step, key, outputs 0..3, their tokens for V = 262144)
        type Case = (u64, Purpose, u64, u64, u64, [u64; 4], [u64; 4]);
        let cases: [Case; 3] = [
            (
                42,
                Purpose::Init,
                0,
                0,
                0x2DA7A738F2B89A82,
                [
                    0xEC8BA47C73582A61,
                    0xF908D7465CAEDE21,
                    0xEAA55833E011DC53,
                    0xF4409B04BEDE3B0A,
                ],
                [242222, 255011, 240277, 250114],
            ),
            (
                42,
                Purpose::Renoise,
                1,
                3,
                0x452C95CBE62F1B47,
                [
                    0xD5620DEA60F7A276,
                    0xBFB18F267794A46D,
                    0xB9C7CA1BCFFAB214,
                    0x447EFDF3B62BAA79,
                ],
                [218504, 196294, 190239, 70139],
            ),
            (
                u64::MAX,
                Purpose::Renoise,
                2,
                47,
                0x089B3D3D7D743456,
                [
                    0x0EF911EBFC55BA78,
                    0x168A8C418D22758F,
                    0xC014C6D31B24AB85,
                    0x6D114766440780F9,
                ],
                [15332, 23082, 196691, 111685],
            ),
        ];
        for (seed, purpose, b, s, want_key, want_x, want_tok) in cases {
            let k = key(seed, purpose, b, s);
            assert_eq!(k, want_key, "key({seed}, {purpose:?}, {b}, {s})");
            let x: Vec<u64> = (0..4).map(|i| output(k, i)).collect();
            assert_eq!(x, want_x);
            let t: Vec<u64> = x.iter().map(|&x| token(x, 262144)).collect();
            assert_eq!(t, want_tok);
        }
    }

    #[test]
    fn categorical_draws() {
        let k = key(7, Purpose::Sample, 0, 1);
        assert_eq!(k, 0x73A3DA3129D32AA0);
        let mut p = [0.0f32; 5];
        crate::ops::softmax(&[0.5, 1.0, 0.25, -1.0, 0.75], |_| true, &mut p);
        let bits: Vec<u32> = p.iter().map(|x| x.to_bits()).collect();
        assert_eq!(
            bits,
            [0x3E4F82D3, 0x3EAB105D, 0x3E219C18, 0x3D393537, 0x3E853987]
        );
        let x: Vec<u64> = (0..10).map(|i| output(k, i)).collect();
        assert_eq!(
            x[..3],
            [0x6EC7848DD13C79F5, 0x090FA5833006CBE5, 0x091462B03A8ADFDA]
        );
        let u: Vec<f64> = x.iter().map(|&x| uniform(x)).collect();
        assert_eq!(
            u,
            [
                0.4327318998559678,
                0.035394997146819596,
                0.035467308067875236,
                0.4543556737589547,
                0.3340769351061771,
                0.05890132588431107,
                0.9030040381379189,
                0.1387302925670567,
                0.7054735822552192,
                0.9808359786388151
            ]
        );
        let toks: Vec<usize> = u.iter().map(|&u| categorical(&p, u).unwrap()).collect();
        assert_eq!(toks, [1, 0, 0, 1, 1, 0, 4, 0, 3, 4]);
    }

    #[test]
    fn categorical_edges() {
        // A zero-probability token is never drawn, even at u's top end.
        assert_eq!(categorical(&[0.5, 0.5, 0.0], 0.999_999_999), Some(1));
        assert_eq!(categorical(&[0.0, 1.0], 0.0), Some(1));
        assert_eq!(categorical(&[0.0, 0.0], 0.5), None);
    }
}
