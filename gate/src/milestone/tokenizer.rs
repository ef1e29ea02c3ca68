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

/// The way out for a GGUF model without tokenizer files, as `tracegate.text` (binding/)
/// says it.
pub const GGUF_FIX: &str = "give token ids (--tokens, or \"tokens\" in a prompt set), or a directory holding the tokenizer's files (transformers' AutoTokenizer.from_pretrained(dir, gguf_file=...).save_pretrained(dir) writes them; scripts/real_model.py convert does this)";

/// Adds `name`'s entry to `h`, reading the file a chunk at a time: a tokenizer file of
/// gigabytes costs one chunk of memory, not its size (issue 51).
fn hash_file(h: &mut Sha256, name: &str, path: &Path) -> Result<()> {
    use std::io::Read;
    let cannot = |e: std::io::Error| gerr!(File: "{}: cannot read: {e}", path.display());
    let mut f = std::fs::File::open(path).map_err(cannot)?;
    let size = f.metadata().map_err(cannot)?.len();
    h.update(name.as_bytes());
    h.update([0u8]);
    h.update(size.to_le_bytes());
    let mut buf = vec![0u8; 1 << 20];
    let mut n = 0u64;
    loop {
        match f.read(&mut buf) {
            Ok(0) => break,
            Ok(k) => {
                h.update(&buf[..k]);
                n += k as u64;
            }
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(cannot(e)),
        }
    }
    if n != size {
        return Err(
            gerr!(File: "{}: changed while it was read ({size} bytes, then {n})", path.display()),
        );
    }
    Ok(())
}

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
        hash_file(&mut h, name, &path)?;
        found = true;
    }
    if !found {
        // A GGUF model (the file, or a directory holding one): its tokenizer is in metadata the
        // digest does not read; the way out `tracegate.text` gives for it.
        let gguf = tracegate_trace::gguf_file(dir).is_ok_and(|f| f.is_some());
        return Err(gerr!(
            "{}: no tokenizer (looked for {}){}",
            dir.display(),
            TOKENIZER_FILES.join(", "),
            if gguf {
                format!("; a GGUF's tokenizer is in its metadata, which a text prompt does not read: {GGUF_FIX}")
            } else {
                String::new()
            }
        ));
    }
    Ok(hex::encode(h.finalize()))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The known answers docs/producers.md states (and binding/tests/test_text.py pins for
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

    /// A GGUF model without tokenizer files is refused with the way out (issue 52: on main a
    /// GGUF directory got only "no tokenizer"); a directory without a .gguf gets no GGUF advice.
    #[test]
    fn a_gguf_model_without_tokenizer_files_gets_the_way_out() {
        let dir = tempfile::tempdir().unwrap();
        let plain = tokenizer_digest(dir.path()).unwrap_err().to_string();
        assert!(!plain.contains("GGUF"), "{plain}");
        std::fs::write(dir.path().join("m.gguf"), b"GGUF").unwrap();
        for model in [dir.path().to_path_buf(), dir.path().join("m.gguf")] {
            let e = tokenizer_digest(&model).unwrap_err().to_string();
            assert!(
                e.contains("no tokenizer (looked for tokenizer.json")
                    && e.contains(GGUF_FIX)
                    && e.contains(&model.display().to_string()),
                "{e}"
            );
        }
    }

    /// The digest of a 512 MiB (sparse) vocab.json costs a chunk of memory, not the file: a
    /// child process (this test binary, run for this test alone) digests it and reports its peak
    /// resident memory (VmHWM), which must stay under 128 MiB. Reading the file whole, as the
    /// digest once did, peaks above 512 MiB.
    #[test]
    fn a_huge_tokenizer_file_is_hashed_in_bounded_memory() {
        const CHILD: &str = "TRACEGATE_TEST_TOKENIZER_DIGEST_DIR";
        if let Ok(dir) = std::env::var(CHILD) {
            let digest = tokenizer_digest(Path::new(&dir)).unwrap();
            let status = std::fs::read_to_string("/proc/self/status").unwrap();
            let hwm = status.lines().find(|l| l.starts_with("VmHWM:")).unwrap();
            println!("DIGEST {digest}\nPEAK {hwm}");
            return;
        }
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("tokenizer.json"), b"{}").unwrap();
        let vocab = std::fs::File::create(dir.path().join("vocab.json")).unwrap();
        vocab.set_len(512 << 20).unwrap();
        let out = std::process::Command::new(std::env::current_exe().unwrap())
            .args([
                "--exact",
                "milestone::tokenizer::tests::a_huge_tokenizer_file_is_hashed_in_bounded_memory",
                "--nocapture",
                "--test-threads=1",
            ])
            .env(CHILD, dir.path())
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success(),
            "{text}{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let kib: u64 = text
            .lines()
            .find_map(|l| l.strip_prefix("PEAK VmHWM:"))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
            .unwrap_or_else(|| panic!("no peak in {text}"));
        assert!(kib < 128 << 10, "peak {kib} KiB digesting a 512 MiB file");
        // The bytes are those of the definition: the same digest as hashing them at once.
        let mut h = Sha256::new();
        h.update(b"tokenizer.json\x00");
        h.update(2u64.to_le_bytes());
        h.update(b"{}");
        h.update(b"vocab.json\x00");
        h.update((512u64 << 20).to_le_bytes());
        let zeros = vec![0u8; 1 << 20];
        for _ in 0..512 {
            h.update(&zeros);
        }
        let want = hex::encode(h.finalize());
        assert!(text.contains(&format!("DIGEST {want}")), "{text}");
    }
}
