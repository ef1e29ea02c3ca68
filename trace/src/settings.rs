//! The environment variables that change what the gate does (docs/producers.md, "Settings"),
//! each parsed strictly by one parser per kind: a bad value is refused in one line naming the
//! variable, the value and what is accepted, never replaced by a default (issue 51).
//!
//! Kinds: a switch (`switch`: `1 true yes on` / `0 false no off`, any case), a positive number
//! of seconds (`seconds`: an integer ≥ 1) and a positive size in MiB (`mib`: an integer ≥ 1).
//! `check` reads every setting once; the gate calls it first and exits 2 on its answer.

/// The switches that accept `1|true|yes|on` and `0|false|no|off` (any case).
const SWITCH: &str = "1, true, yes, on (on) or 0, false, no, off (off), any case";

/// The gate's settings, each with its kind: all that `check` reads.
pub const GATE_SETTINGS: &[(&str, Kind)] = &[
    ("TRACEGATE_RESIDENT", Kind::Switch),
    ("TRACEGATE_RESIDENT_IDLE", Kind::Seconds),
    ("TRACEGATE_RESIDENT_MAX_MB", Kind::Mib),
    ("TRACEGATE_SERVE", Kind::Switch),
    // Read by the Python worker (tracegate.serve); refused here too, before any worker starts.
    ("TRACEGATE_SERVE_STALE_CHECK", Kind::Switch),
    ("GITHUB_ACTIONS", Kind::Switch),
    // Read by tracegate.text (the gate's tokenization) and by the engine's --text helper.
    ("TRACEGATE_TEXT_TIMEOUT", Kind::Seconds),
    ("TRACEGATE_TEXT_MAX_MB", Kind::Mib),
    // The test hook of gate/src/journal.rs: a journal step number.
    ("TRACEGATE_FAULT_AT", Kind::Count),
];

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    Switch,
    Seconds,
    Mib,
    /// A whole number ≥ 1 of anything else (a step number).
    Count,
}

/// The refusal of `name=value`: one line, what is accepted last.
fn refuse(name: &str, value: &str, accepted: &str) -> String {
    format!("{name}={value:?} is not accepted: {name} takes {accepted}")
}

/// `name`'s value: None when unset; a value that is not UTF-8 is refused.
pub fn raw(name: &str) -> Result<Option<String>, String> {
    match std::env::var(name) {
        Ok(v) => Ok(Some(v)),
        Err(std::env::VarError::NotPresent) => Ok(None),
        Err(std::env::VarError::NotUnicode(v)) => {
            Err(format!("{name}={v:?} is not accepted: it is not UTF-8"))
        }
    }
}

/// A switch's value: `1 true yes on` → true, `0 false no off` → false (any case, nothing else).
pub fn parse_switch(name: &str, v: &str) -> Result<bool, String> {
    match v.to_ascii_lowercase().as_str() {
        "1" | "true" | "yes" | "on" => Ok(true),
        "0" | "false" | "no" | "off" => Ok(false),
        _ => Err(refuse(name, v, SWITCH)),
    }
}

/// A positive integer (`what` names the unit in the refusal).
fn parse_positive(name: &str, v: &str, what: &str) -> Result<u64, String> {
    let ok = !v.is_empty() && v.bytes().all(|b| b.is_ascii_digit());
    match v.parse::<u64>() {
        Ok(n) if ok && n >= 1 => Ok(n),
        _ => Err(refuse(name, v, what)),
    }
}

/// A positive number of seconds: an integer ≥ 1, digits only (`30`, not `30s`).
pub fn parse_seconds(name: &str, v: &str) -> Result<u64, String> {
    parse_positive(name, v, "a whole number of seconds, at least 1 (e.g. 30)")
}

/// A positive size in MiB: an integer ≥ 1, digits only (`2048`, not `2GB`).
pub fn parse_mib(name: &str, v: &str) -> Result<u64, String> {
    parse_positive(name, v, "a whole number of MiB, at least 1 (e.g. 2048)")
}

/// A positive count: an integer ≥ 1, digits only.
pub fn parse_count(name: &str, v: &str) -> Result<u64, String> {
    parse_positive(name, v, "a whole number, at least 1")
}

/// The count `name`: None when unset.
pub fn count(name: &str) -> Result<Option<u64>, String> {
    raw(name)?.map(|v| parse_count(name, &v)).transpose()
}

/// The switch `name`: None when unset.
pub fn switch(name: &str) -> Result<Option<bool>, String> {
    raw(name)?.map(|v| parse_switch(name, &v)).transpose()
}

/// The seconds `name`: None when unset.
pub fn seconds(name: &str) -> Result<Option<u64>, String> {
    raw(name)?.map(|v| parse_seconds(name, &v)).transpose()
}

/// The MiB `name`: None when unset.
pub fn mib(name: &str) -> Result<Option<u64>, String> {
    raw(name)?.map(|v| parse_mib(name, &v)).transpose()
}

/// Whether `CI` says this is a CI job: set and not empty, `0`, `false` or `no` (any case). `CI`
/// is not ours: services set `true`, `1`, `True` or their own name, so every other value means
/// a CI job (documented; the one lenient reading, as pytest's root conftest.py reads it).
pub fn ci() -> bool {
    std::env::var("CI").is_ok_and(|v| {
        !matches!(
            v.trim().to_ascii_lowercase().as_str(),
            "" | "0" | "false" | "no"
        )
    })
}

/// Reads every setting of GATE_SETTINGS: the first bad one's refusal.
pub fn check() -> Result<(), String> {
    for (name, kind) in GATE_SETTINGS {
        match kind {
            Kind::Switch => switch(name).map(drop)?,
            Kind::Seconds => seconds(name).map(drop)?,
            Kind::Mib => mib(name).map(drop)?,
            Kind::Count => count(name).map(drop)?,
        }
    }
    Ok(())
}

/// A setting's value where the caller cannot return an error: the gate (and the resident
/// daemon) ran `check` first, so a refusal here is a setting changed mid-run; it is said, never
/// replaced by a default.
pub fn or_refuse<T>(r: Result<T, String>) -> T {
    r.unwrap_or_else(|e| {
        eprintln!("error: {e}");
        std::process::exit(2)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn switches_take_the_documented_words_only() {
        for v in ["1", "true", "TRUE", "yes", "On"] {
            assert_eq!(parse_switch("X", v), Ok(true), "{v}");
        }
        for v in ["0", "false", "No", "off", "OFF"] {
            assert_eq!(parse_switch("X", v), Ok(false), "{v}");
        }
        for v in ["", "disable", "n", "y", " 0", "2", "enabled"] {
            let e = parse_switch("TRACEGATE_RESIDENT", v).unwrap_err();
            assert!(
                e.starts_with(&format!("TRACEGATE_RESIDENT={v:?} is not accepted"))
                    && e.contains("0, false, no, off")
                    && !e.contains('\n'),
                "{e}"
            );
        }
    }

    #[test]
    fn seconds_and_sizes_are_positive_whole_numbers() {
        assert_eq!(parse_seconds("X", "30"), Ok(30));
        assert_eq!(parse_mib("X", "2048"), Ok(2048));
        for v in [
            "2s",
            "abc",
            "-1",
            "0",
            "",
            "1.5",
            "+3",
            " 30",
            "99999999999999999999",
        ] {
            let e = parse_seconds("TRACEGATE_RESIDENT_IDLE", v).unwrap_err();
            assert!(
                e.contains("TRACEGATE_RESIDENT_IDLE=") && e.contains("seconds"),
                "{e}"
            );
        }
        for v in ["1MB", "0.5", "-1", "0"] {
            let e = parse_mib("TRACEGATE_RESIDENT_MAX_MB", v).unwrap_err();
            assert!(
                e.contains("TRACEGATE_RESIDENT_MAX_MB=") && e.contains("MiB"),
                "{e}"
            );
        }
    }
}
