//! The producer command line's shared grammar (docs/producers.md); the Python side is
//! `tracegate.protocol`. One grammar, so the engine, the contract, the oracle and the gate take
//! and refuse the same `--tokens`.

/// One id of `--tokens IDS` (comma-separated): ASCII digits with an optional leading `-`,
/// nothing else — no spaces, no `+`, no `_` (Python's `int` takes ` 17`, `+5` and `1_0`; Rust's
/// takes `+5`), so `3, 17, 5` is refused everywhere, not read by some producers only.
pub fn token_id(text: &str) -> Result<i64, String> {
    let digits = text.strip_prefix('-').unwrap_or(text);
    if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return Err(format!(
            "expected comma-separated integers (digits only, no spaces), got {text:?}"
        ));
    }
    text.parse()
        .map_err(|_| format!("{text} is outside the i64 range"))
}

#[cfg(test)]
mod tests {
    #[test]
    fn only_digits_with_an_optional_minus_are_ids() {
        for ok in ["0", "17", "-1", "007"] {
            assert_eq!(super::token_id(ok), Ok(ok.parse().unwrap()), "{ok}");
        }
        for bad in ["", " 17", "17 ", "+5", "1_0", "-", "1e3", "٣", "0x10"] {
            assert!(super::token_id(bad).is_err(), "{bad:?} accepted");
        }
        assert!(super::token_id("99999999999999999999").is_err());
    }
}
