//! Every integration test of the crate, one module a file, built as one binary (Cargo.toml
//! `autotests = false`): `cargo test -p tracegate-engine --test all force::` runs one file's.

mod common;
mod conformance;
mod diffusion_gemma;
mod engine;
mod force;
mod qwen3_5;
mod shard;
mod stream;
