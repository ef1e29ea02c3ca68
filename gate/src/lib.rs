//! The gate: claims about producers, checked every time. `gate m0|m1` runs the engine (in
//! process), the contract and the oracle (subprocesses) on frozen prompts and asserts counts
//! exactly; `gate check` re-derives every milestone; `gate bisect` names the first layer whose
//! body is wrong.

pub mod baselines;
pub mod bisect;
pub mod milestones;
pub mod producer;
pub mod prompts;
pub mod report;
pub mod run;

use std::path::{Path, PathBuf};

/// A refusal or failure with the offending name, path and numbers; the CLI prints it and exits 2.
#[derive(Debug)]
pub struct Error(pub String);

impl std::fmt::Display for Error {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}
impl std::error::Error for Error {}

pub type Result<T> = std::result::Result<T, Error>;

#[macro_export]
macro_rules! gerr {
    ($($t:tt)*) => { $crate::Error(format!($($t)*)) };
}

/// The project root: the nearest ancestor of `start` holding `milestones.json`.
pub fn find_root(start: &Path) -> Result<PathBuf> {
    let mut cur = Some(start);
    while let Some(dir) = cur {
        if dir.join("milestones.json").is_file() {
            return Ok(dir.to_path_buf());
        }
        cur = dir.parent();
    }
    Err(gerr!("no milestones.json in {} or any parent: run the gate inside a tracegate checkout, or pass --root", start.display()))
}

pub fn sha256_file(path: &Path) -> Result<String> {
    use sha2::Digest;
    let bytes = std::fs::read(path).map_err(|e| gerr!("{}: {e}", path.display()))?;
    Ok(hex::encode(sha2::Sha256::digest(&bytes)))
}

pub fn read_json<T: serde::de::DeserializeOwned>(path: &Path) -> Result<T> {
    let text = std::fs::read_to_string(path).map_err(|e| gerr!("{}: {e}", path.display()))?;
    serde_json::from_str(&text).map_err(|e| gerr!("{}: {e}", path.display()))
}

/// Writes JSON through a temporary file and a rename, so a crash never leaves half a file.
pub fn write_json_atomic(path: &Path, value: &impl serde::Serialize) -> Result<()> {
    let text = serde_json::to_string_pretty(value).map_err(|e| gerr!("{}: {e}", path.display()))? + "\n";
    let tmp = path.with_extension("json.tmp");
    std::fs::write(&tmp, text).map_err(|e| gerr!("{}: {e}", tmp.display()))?;
    std::fs::rename(&tmp, path).map_err(|e| gerr!("{}: {e}", path.display()))
}
