//! The engine producer's other side: the gate runs its own executable with the hidden first
//! argument ENGINE_CHILD, and this reads back the engine command line it wrote.

use std::path::PathBuf;

use crate::verb::Verb;

/// The hidden first argument with which the gate runs itself as the engine producer.
pub const ENGINE_CHILD: &str = "__engine-producer";

/// The engine side of ENGINE_CHILD: `argv` is the equivalent engine command line
/// (`engine trace|layer ARGS --threads N`, as `Producer::argv` writes it).
pub fn engine_child(argv: &[String]) -> crate::error::Result<()> {
    let (verb, threads) = Verb::parse(argv)?;
    match verb {
        Verb::Trace {
            model,
            tokens,
            out,
            internals,
            generate,
            cache,
            force,
            seed,
            shards,
        } => {
            let o = tracegate_engine::TraceOptions {
                model_dir: PathBuf::from(model),
                tokens,
                out: PathBuf::from(out),
                internals,
                generate,
                cache,
                threads,
                command_line: argv.to_vec(),
                force_decisions: force.map(PathBuf::from),
                prompt_text: None,
                // The engine's own reading of the split the gate wrote (one grammar).
                shards: shards
                    .map(|s| tracegate_engine::Shards::parse(&s.to_string()))
                    .transpose()?,
            };
            match o.shards {
                // One trace per rank at `out` with {rank} replaced.
                Some(_) => tracegate_engine::run_trace_ranks(&o).map(|_| ()),
                // A sampling family's seed; the other knobs are the checkpoint's.
                None => tracegate_engine::run_trace_with(
                    &o,
                    &tracegate_engine::DiffusionOptions {
                        seed,
                        ..Default::default()
                    },
                )
                .map(|_| ()),
            }
            .map_err(crate::error::Error::from)
        }
        Verb::Layer {
            model,
            layer,
            input,
            input_name,
            out,
            internals,
            force,
            decode_from,
        } => tracegate_engine::run_layer(&tracegate_engine::LayerOptions {
            model_dir: PathBuf::from(model),
            layer,
            input: PathBuf::from(input),
            input_name,
            out: PathBuf::from(out),
            internals,
            threads,
            command_line: argv.to_vec(),
            force_decisions: force.map(PathBuf::from),
            decode_from,
        })
        .map(|_| ())
        .map_err(crate::error::Error::from),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Producer;

    #[test]
    fn the_engine_child_reads_back_exactly_the_arguments_the_gate_wrote() {
        let verbs = [
            Verb::Trace {
                model: "fixtures/m".into(),
                tokens: vec![3, 17, 5],
                out: "w/a b.trace".into(),
                internals: true,
                generate: 4,
                cache: false,
                force: None,
                seed: None,
                shards: Some(crate::Shards {
                    mode: "ep",
                    world: 2,
                }),
            },
            Verb::Trace {
                model: "/abs/m".into(),
                tokens: vec![0],
                out: "o.trace".into(),
                internals: false,
                generate: 0,
                cache: true,
                force: Some("w/ref.trace".into()),
                seed: Some(u64::MAX),
                shards: None,
            },
            Verb::Layer {
                model: "m".into(),
                layer: 3,
                input: "r.trace".into(),
                input_name: "layer.03.hidden_in".into(),
                out: "c.trace".into(),
                internals: false,
                force: None,
                decode_from: None,
            },
            Verb::Layer {
                model: "m".into(),
                layer: 0,
                input: "r.trace".into(),
                input_name: "layer.00.hidden_in".into(),
                out: "c.trace".into(),
                internals: true,
                force: Some("r.trace".into()),
                decode_from: Some(7),
            },
        ];
        for verb in verbs {
            let argv = Producer::Engine { threads: 2 }.argv(&verb);
            let (back, threads) = Verb::parse(&argv).unwrap();
            assert_eq!(
                (Producer::Engine { threads }.argv(&back), threads),
                (argv, 2)
            );
        }
        let err = Verb::parse(&[
            "engine".into(),
            "trace".into(),
            "--model".into(),
            "m".into(),
        ])
        .unwrap_err();
        assert!(err.to_string().contains("missing --capture"), "{err}");
    }
}
