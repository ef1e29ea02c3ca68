//! The tokenizer digest of a model directory, as docs/producers.md ("Text prompts") defines it
//! and `tracegate.text.tokenizer_digest` computes it: a port milestone records it with the ids of
//! its text prompts, and a run refuses a tokenizer that changed since (a changed prompt).

use std::path::Path;

use sha2::{Digest, Sha256};

use crate::{gerr, Result};

/// The tokenizer files, in digest order.
pub const TOKENIZER_FILES: [&str; 9] = [
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
    "chat_template.json",
];

/// SHA-256 (lowercase hex) over each tokenizer file that is a regular file in `dir` (symlinks
/// followed), in [`TOKENIZER_FILES`] order: its name, a 0x00 byte, its length as u64
/// little-endian, its bytes. A directory with none of them is refused naming what was looked for.
pub fn tokenizer_digest(dir: &Path) -> Result<String> {
    let mut h = Sha256::new();
    let mut found = false;
    for name in TOKENIZER_FILES {
        let path = dir.join(name);
        if !std::fs::metadata(&path).is_ok_and(|m| m.is_file()) {
            continue;
        }
        let bytes = std::fs::read(&path)
            .map_err(|e| gerr!(File: "{}: cannot read: {e}", path.display()))?;
        h.update(name.as_bytes());
        h.update([0u8]);
        h.update((bytes.len() as u64).to_le_bytes());
        h.update(&bytes);
        found = true;
    }
    if !found {
        return Err(gerr!(
            "{}: no tokenizer (looked for {})",
            dir.display(),
            TOKENIZER_FILES.join(", ")
        ));
    }
    Ok(hex::encode(h.finalize()))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The known answers docs/producers.md states (and trace/python/tests/test_text.py pins for
    /// the Python side): both sides give them from the definition's text.
    #[test]
    fn the_documented_known_answers() {
        let dir = tempfile::tempdir().unwrap();
        assert!(tokenizer_digest(dir.path())
            .unwrap_err()
            .to_string()
            .contains("no tokenizer (looked for tokenizer.json, tokenizer_config.json"));
        std::fs::write(dir.path().join("tokenizer.json"), b"{}").unwrap();
        assert_eq!(
            tokenizer_digest(dir.path()).unwrap(),
            "17120e8581415f4473d7a6fe45a9aca632bfe53e6a6a2ef7c2ab81905d25e7f2"
        );
        std::fs::write(dir.path().join("merges.txt"), b"a b\n").unwrap();
        // A directory in a file's place is skipped, not read.
        std::fs::create_dir(dir.path().join("vocab.json")).unwrap();
        assert_eq!(
            tokenizer_digest(dir.path()).unwrap(),
            "f0575d0f69217ab81f87d45aebc4e2173b8c6bfb6c86d2af281f4707472b71f7"
        );
    }
}
