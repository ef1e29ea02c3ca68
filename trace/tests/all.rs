//! Every integration test of the crate, one module a file, built as one binary (Cargo.toml
//! `autotests = false`): `cargo test -p tracegate-trace --test all fuzz::` runs one file's.

mod common;
mod conformance;
mod container;
mod fuzz;
mod hostile;
mod index_keys;
mod interop;
mod memory;
mod merge;
#[cfg(feature = "ndarray")]
mod views;
