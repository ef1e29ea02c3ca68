//! Every integration test of the crate, one module a file, built as one binary (Cargo.toml
//! `autotests = false`): `cargo test -p tracegate-gate --test all port::` runs one file's.

mod atomic;
mod bisect;
mod bisect_adversary;
mod bisect_decode;
mod bisect_diffusion;
mod bisect_ranks;
mod bisect_stored;
mod capsule;
mod capsule_explain;
mod ci;
mod common;
mod gate;
mod inputs;
mod measures;
mod outputs;
mod plants;
mod port;
mod ranks;
mod readme;
mod recorded;
mod resident;
mod sharded;
