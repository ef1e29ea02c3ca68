//! The built-in producers: the contract's and the oracle's command templates and the Python
//! they run under (docs/producers.md). Resident workers serve only these (resident.rs).

use std::path::{Path, PathBuf};

/// The tracegate checkout this gate was built from: its `.venv` serves a project that has none
/// of its own (a port's directory, `gate init`).
pub fn install_root() -> PathBuf {
    let manifest = Path::new(env!("CARGO_MANIFEST_DIR"));
    manifest.parent().unwrap_or(manifest).to_path_buf()
}

/// The Python of the contract and the oracle: `specific` or TRACEGATE_PYTHON when set, else a
/// tracegate checkout's own `.venv`, else the installation's — never a user project's `.venv`,
/// which need not hold tracegate's packages (symlinks kept: a venv's python is one).
pub fn python(root: &Path, specific: &str) -> String {
    std::env::var(specific)
        .or_else(|_| std::env::var("TRACEGATE_PYTHON"))
        .unwrap_or_else(|_| {
            let own = root.join(".venv/bin/python");
            if own.exists() && root.join("oracle/tracegate_oracle").is_dir() {
                own
            } else {
                install_root().join(".venv/bin/python")
            }
            .display()
            .to_string()
        })
}

pub fn default_contract_cmd(root: &Path) -> String {
    // {verb|serve}: one worker answers every run of the gate (docs/producers.md, "Serving").
    format!(
        "'{}' -m tracegate_contract {{verb|serve}} {{args}}",
        python(root, "TRACEGATE_CONTRACT_PYTHON")
    )
}

/// The flag the oracle's `trace` takes a sharded run's split by (its ranks are torchrun's).
pub const ORACLE_SHARDS_FLAG: &str = "--distributed";

pub fn default_oracle_cmd(root: &Path) -> String {
    format!(
        "'{}' -m tracegate_oracle {{verb|serve}} {{args}} --threads 1",
        python(root, "TRACEGATE_ORACLE_PYTHON")
    )
}
