// Records the compiler version and target for the build id in trace provenance.
fn main() {
    let rustc = std::env::var("RUSTC").unwrap_or_else(|_| "rustc".into());
    let version = std::process::Command::new(rustc)
        .arg("--version")
        .output()
        .ok()
        .and_then(|o| String::from_utf8(o.stdout).ok())
        .map(|s| s.trim().to_string())
        .unwrap_or_else(|| "unknown".into());
    println!("cargo:rustc-env=ENGINE_RUSTC_VERSION={version}");
    println!("cargo:rustc-env=ENGINE_TARGET={}", std::env::var("TARGET").unwrap_or_default());
    println!("cargo:rustc-env=ENGINE_PROFILE={}", std::env::var("PROFILE").unwrap_or_default());
    println!("cargo:rerun-if-changed=build.rs");
}
