//! Printing elements: each value as the shortest decimal that reads back to its bits in its
//! own dtype, the raw bits in hex, and a flat index as coordinates.

use tracegate_trace::DType;

/// Hex of the raw bits at the dtype's width, e.g. `0x3f800000` for f32 1.0.
pub fn hex_bits(dtype: DType, bits: u64) -> String {
    let width = dtype.size() * 2;
    let mask = if dtype.size() == 8 {
        u64::MAX
    } else {
        (1u64 << (dtype.size() * 8)) - 1
    };
    format!("0x{:0width$x}", bits & mask)
}

/// The value as the shortest decimal that reads back to the same bits in its own dtype.
pub fn format_value(dtype: DType, bits: u64) -> String {
    match dtype {
        DType::F64 => fmt_float(f64::from_bits(bits)),
        // Rust's float Display is the shortest round-trip form for the float's own width.
        DType::F32 => {
            let v = f32::from_bits(bits as u32);
            if v.is_finite() && v != 0.0 && !(1e-5..1e16).contains(&v.abs()) {
                format!("{v:e}")
            } else {
                fmt_special(v as f64).unwrap_or_else(|| format!("{v}"))
            }
        }
        DType::F16 => shortest16(
            bits as u16,
            |b| half::f16::from_bits(b).to_f64(),
            |x| half::f16::from_f64(x).to_bits(),
        ),
        DType::BF16 => shortest16(
            bits as u16,
            |b| half::bf16::from_bits(b).to_f64(),
            |x| half::bf16::from_f64(x).to_bits(),
        ),
        DType::Bool => {
            if bits & 0xff != 0 {
                "true".into()
            } else {
                "false".into()
            }
        }
        DType::U8 => format!("{}", bits as u8),
        _ => format!("{}", bits as i64),
    }
}

fn fmt_special(v: f64) -> Option<String> {
    if v.is_nan() {
        Some("NaN".into())
    } else if v.is_infinite() {
        Some(if v > 0.0 { "inf".into() } else { "-inf".into() })
    } else {
        None
    }
}

fn fmt_float(v: f64) -> String {
    if let Some(s) = fmt_special(v) {
        return s;
    }
    if v != 0.0 && !(1e-5..1e16).contains(&v.abs()) {
        format!("{v:e}")
    } else {
        format!("{v}")
    }
}

/// Shortest decimal for a 16-bit float: the fewest significant digits whose correctly rounded
/// conversion back to the dtype gives the same bits (printing the widened f32 would show
/// digits the format does not have: bf16 0.1 is not "0.10009765625").
fn shortest16(bits: u16, widen: impl Fn(u16) -> f64, narrow: impl Fn(f64) -> u16) -> String {
    let v = widen(bits);
    if let Some(s) = fmt_special(v) {
        return s;
    }
    if v == 0.0 {
        return if bits & 0x8000 != 0 {
            "-0".into()
        } else {
            "0".into()
        };
    }
    for digits in 1..=17 {
        let s = format!("{:.*e}", digits - 1, v);
        let x: f64 = s.parse().expect("formatted float parses");
        if narrow(x) == bits {
            return fmt_float(x);
        }
    }
    fmt_float(v)
}

/// Row-major coordinates of a flat index.
pub fn unravel(mut index: u64, shape: &[u64]) -> Vec<u64> {
    let mut coords = vec![0u64; shape.len()];
    for (c, &d) in coords.iter_mut().zip(shape).rev() {
        if d > 0 {
            *c = index % d;
            index /= d;
        }
    }
    coords
}

/// Exposed for tests and tools: the dtype's printed value for raw bits.
pub fn describe_bits(dtype: DType, bits: u64) -> (String, String) {
    (format_value(dtype, bits), hex_bits(dtype, bits))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shortest_printing() {
        assert_eq!(
            format_value(DType::BF16, half::bf16::from_f32(0.1).to_bits() as u64),
            "0.1"
        );
        assert_eq!(
            format_value(DType::F16, half::f16::from_f32(0.1).to_bits() as u64),
            "0.1"
        );
        assert_eq!(format_value(DType::F32, 0.1f32.to_bits() as u64), "0.1");
        assert_eq!(format_value(DType::F32, (-0.0f32).to_bits() as u64), "-0");
        assert_eq!(format_value(DType::F32, 1e-30f32.to_bits() as u64), "1e-30");
        assert_eq!(format_value(DType::F64, 0.1f64.to_bits()), "0.1");
        assert_eq!(hex_bits(DType::F32, 1.0f32.to_bits() as u64), "0x3f800000");
        assert_eq!(hex_bits(DType::BF16, 0x3f80), "0x3f80");
    }

    #[test]
    fn unravel_row_major() {
        assert_eq!(unravel(0, &[2, 3]), vec![0, 0]);
        assert_eq!(unravel(5, &[2, 3]), vec![1, 2]);
        assert_eq!(unravel(7, &[2, 3, 4]), vec![0, 1, 3]);
    }
}
