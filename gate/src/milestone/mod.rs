//! The milestone gate: `gate m0|m1|run|check|init` (docs/gate.md). A milestone's every model and
//! prompt runs through the engine, the contract and the oracle (or a port's candidate against
//! its golden traces), and its checks assert counts exactly; the report is JSON, text and HTML.
//!
//! The parts, from the bottom up; none imports one above it:
//! - check.rs: the checks by name;
//! - milestones.rs, baselines.rs: milestones.json and baselines.json; tokenizer.rs: a model's
//!   tokenizer digest (a port's prompts are tokenized by it);
//! - run/: running a milestone and its checks, the report's types;
//! - render.rs (text and HTML) and ci.rs (JUnit, GitHub annotations): the report rendered;
//! - init.rs: `gate init`, a port's first milestone, written by running it;
//! - threads.rs: a hint to pin a slow port's BLAS threads, from its runs' seconds.
//!
//! A port whose `agrees` fails is localised by a bisection (run/port.rs calls crate::bisect,
//! which sits below this part and imports nothing of it).

pub mod baselines;
pub mod check;
pub mod ci;
pub mod init;
pub mod milestones;
pub mod render;
pub mod run;
pub mod threads;
pub mod tokenizer;
