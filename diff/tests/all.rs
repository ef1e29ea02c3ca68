//! Every integration test of the crate, one module a file, built as one binary (Cargo.toml
//! `autotests = false`): `cargo test -p tracegate-diff --test all fuzz::` runs one file's.

mod claims;
mod cli;
mod common;
mod diffusion;
mod early;
mod explain;
mod explain_layer;
mod fuzz;
mod labels;
mod mixed;
mod noise_reference;
mod passing_bounds;
mod reroute;
mod rounding;
mod seeded;
mod show_filters;
