// Records the compiler, target and a digest of the sources for the build id in trace provenance:
// two engines built from different code must not claim the same build.
use std::path::{Path, PathBuf};

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for e in entries.flatten() {
        let p = e.path();
        if p.is_dir() {
            rust_files(&p, out);
        } else if p.extension().is_some_and(|x| x == "rs") {
            out.push(p);
        }
    }
}

/// FNV-1a 64 over each file's relative path and bytes, in sorted path order: stable across
/// compilers, which std's hasher is not.
fn source_digest(root: &Path, dirs: &[&str]) -> String {
    let mut files = Vec::new();
    for d in dirs {
        rust_files(&root.join(d), &mut files);
        println!("cargo:rerun-if-changed={}", root.join(d).display());
    }
    files.sort();
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for f in &files {
        let rel = f
            .strip_prefix(root)
            .unwrap_or(f)
            .to_string_lossy()
            .into_owned();
        for b in rel.bytes().chain(std::fs::read(f).unwrap_or_default()) {
            h = (h ^ b as u64).wrapping_mul(0x0000_0100_0000_01b3);
        }
    }
    format!("{h:016x}")
}

fn main() {
    let rustc = std::env::var("RUSTC").unwrap_or_else(|_| "rustc".into());
    let version = std::process::Command::new(rustc)
        .arg("--version")
        .output()
        .ok()
        .and_then(|o| String::from_utf8(o.stdout).ok())
        .map(|s| s.trim().to_string())
        .unwrap_or_else(|| "unknown".into());
    let manifest =
        PathBuf::from(std::env::var("CARGO_MANIFEST_DIR").unwrap_or_else(|_| ".".into()));
    let workspace = manifest.parent().unwrap_or(&manifest).to_path_buf();
    // The engine's own code and the trace writer it links: both decide a trace's bytes.
    println!(
        "cargo:rustc-env=ENGINE_SOURCE_DIGEST={}",
        source_digest(&workspace, &["engine/src", "trace/src"])
    );
    println!("cargo:rustc-env=ENGINE_RUSTC_VERSION={version}");
    println!(
        "cargo:rustc-env=ENGINE_TARGET={}",
        std::env::var("TARGET").unwrap_or_default()
    );
    println!(
        "cargo:rustc-env=ENGINE_PROFILE={}",
        std::env::var("PROFILE").unwrap_or_default()
    );
    println!("cargo:rerun-if-changed=build.rs");
}
