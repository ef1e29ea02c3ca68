//! The producer protocol's argument grammar as the gate writes and reads it: the two verbs and
//! their arguments (docs/producers.md), and command words (split, quoted, displayed).

/// Arguments of one protocol verb; rendered identically for every producer. `force`: the
/// optional `--force-decisions TRACE` (docs/producers.md), passed only when set; `seed`: the
/// optional `--seed S` of a sampling family (block diffusion, docs/diffusion-gemma.md), passed
/// only when set; `shards`: the optional split of a sharded run (docs/numerics.md §23), passed
/// only when set, by the flag of the producer that runs it (`Producer::argv`).
#[derive(Clone, Debug)]
pub enum Verb {
    Trace {
        model: String,
        tokens: Vec<i64>,
        out: String,
        internals: bool,
        generate: usize,
        cache: bool,
        force: Option<String>,
        seed: Option<u64>,
        shards: Option<Shards>,
    },
    /// `decode_from`: `layer --decode-from P` (docs/producers.md, the decode extension).
    Layer {
        model: String,
        layer: usize,
        input: String,
        input_name: String,
        out: String,
        internals: bool,
        force: Option<String>,
        decode_from: Option<i64>,
    },
}

/// Where a sharded run's `--out` puts each rank's number (docs/producers.md, `--out`).
pub const RANK: &str = "{rank}";

/// The flag every producer takes a sharded run's split by, but the oracle (`--distributed`).
pub const SHARDS_FLAG: &str = "--shards";

/// A sharded run's split (docs/numerics.md §23): `tp=N` (tensor parallel) or `ep=N` (expert
/// parallel) over N ranks, as the producers spell it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Shards {
    /// `tp` or `ep`.
    pub mode: &'static str,
    pub world: usize,
}

impl Shards {
    /// `tp=N` or `ep=N`, N a decimal ≥ 1 without sign or leading zero (the producers' grammar).
    pub fn parse(s: &str) -> crate::error::Result<Shards> {
        let bad = || {
            crate::error::gerr!(
                "shards {s:?}: expected tp=N or ep=N, N a whole number of at least 1"
            )
        };
        let (mode, n) = s.split_once('=').ok_or_else(bad)?;
        let mode = match mode {
            "tp" => "tp",
            "ep" => "ep",
            _ => return Err(bad()),
        };
        if n.is_empty() || n.starts_with('0') || !n.bytes().all(|b| b.is_ascii_digit()) {
            return Err(bad());
        }
        let world = n.parse::<usize>().map_err(|_| bad())?;
        Ok(Shards { mode, world })
    }

    /// Rank `rank`'s trace: `out` with [`RANK`] replaced.
    pub fn rank_path(out: &str, rank: usize) -> String {
        out.replace(RANK, &rank.to_string())
    }
}

impl std::fmt::Display for Shards {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}={}", self.mode, self.world)
    }
}

impl Verb {
    pub fn name(&self) -> &'static str {
        match self {
            Verb::Trace { .. } => "trace",
            Verb::Layer { .. } => "layer",
        }
    }

    pub fn out(&self) -> &str {
        match self {
            Verb::Trace { out, .. } | Verb::Layer { out, .. } => out,
        }
    }

    /// The traces the verb writes: one per rank for a sharded run, else `out`.
    pub fn outs(&self) -> Vec<String> {
        match self {
            Verb::Trace {
                out,
                shards: Some(s),
                ..
            } => (0..s.world).map(|r| Shards::rank_path(out, r)).collect(),
            _ => vec![self.out().to_string()],
        }
    }

    pub fn args(&self) -> Vec<String> {
        self.args_with(SHARDS_FLAG)
    }

    /// The arguments, a sharded run's split given by `shards_flag`.
    pub fn args_with(&self, shards_flag: &str) -> Vec<String> {
        let capture = |internals: bool| if internals { "internals" } else { "default" }.to_string();
        let (mut a, force) = match self {
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
                let toks: Vec<String> = tokens.iter().map(|t| t.to_string()).collect();
                let mut a = vec![
                    "--model".into(),
                    model.clone(),
                    "--tokens".into(),
                    toks.join(","),
                    "--out".into(),
                    out.clone(),
                ];
                a.extend(["--capture".into(), capture(*internals)]);
                if *generate > 0 {
                    a.extend([
                        "--generate".into(),
                        generate.to_string(),
                        "--cache".into(),
                        if *cache { "on" } else { "off" }.into(),
                    ]);
                }
                if let Some(s) = seed {
                    a.extend(["--seed".into(), s.to_string()]);
                }
                if let Some(s) = shards {
                    a.extend([shards_flag.to_string(), s.to_string()]);
                }
                (a, force)
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
            } => (
                [
                    "--model".into(),
                    model.clone(),
                    "--layer".into(),
                    layer.to_string(),
                    "--input".into(),
                    input.clone(),
                    "--input-name".into(),
                    input_name.clone(),
                    "--out".into(),
                    out.clone(),
                    "--capture".into(),
                    capture(*internals),
                ]
                .into_iter()
                .chain(
                    decode_from
                        .iter()
                        .flat_map(|p| ["--decode-from".to_string(), p.to_string()]),
                )
                .collect(),
                force,
            ),
        };
        if let Some(f) = force {
            a.extend(["--force-decisions".into(), f.clone()]);
        }
        a
    }

    /// The inverse of `Producer::argv` for the engine: `engine VERB ARGS --threads N`.
    pub fn parse(argv: &[String]) -> crate::error::Result<(Verb, usize)> {
        let (verb, rest) = match argv {
            [engine, verb, rest @ ..] if engine == "engine" => (verb.as_str(), rest),
            _ => {
                return Err(crate::error::gerr!(
                    "expected `engine trace|layer ARGS`, got {}",
                    display(argv)
                ))
            }
        };
        if rest.len() % 2 != 0 {
            return Err(crate::error::gerr!(
                "arguments are not --name value pairs: {}",
                display(rest)
            ));
        }
        let mut args: std::collections::BTreeMap<&str, &str> = rest
            .chunks(2)
            .map(|p| (p[0].as_str(), p[1].as_str()))
            .collect();
        let mut take = |name: &str| {
            args.remove(name)
                .ok_or_else(|| crate::error::gerr!("{verb}: missing {name}"))
        };
        let number = |name: &str, v: &str| {
            v.parse::<usize>()
                .map_err(|e| crate::error::gerr!("{name} {v:?}: {e}"))
        };
        let internals = match take("--capture")? {
            "default" => false,
            "internals" => true,
            other => {
                return Err(crate::error::gerr!(
                    "--capture {other:?}: expected default or internals"
                ))
            }
        };
        let threads = number("--threads", take("--threads")?)?;
        let model = take("--model")?.to_string();
        let out = take("--out")?.to_string();
        let force = take("--force-decisions").ok().map(str::to_string);
        let parsed = match verb {
            "trace" => {
                let tokens = take("--tokens")?;
                let tokens = parse_tokens(tokens)?;
                let generate = match args.remove("--generate") {
                    Some(g) => number("--generate", g)?,
                    None => 0,
                };
                let cache = match args.remove("--cache") {
                    None | Some("on") => true,
                    Some("off") => false,
                    Some(other) => {
                        return Err(crate::error::gerr!("--cache {other:?}: expected on or off"))
                    }
                };
                let seed = match args.remove("--seed") {
                    Some(s) => Some(
                        s.parse::<u64>()
                            .map_err(|e| crate::error::gerr!("--seed {s:?}: {e}"))?,
                    ),
                    None => None,
                };
                let shards = args.remove(SHARDS_FLAG).map(Shards::parse).transpose()?;
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
                }
            }
            "layer" => {
                let layer = number("--layer", take("--layer")?)?;
                let input = take("--input")?.to_string();
                let input_name = take("--input-name")?.to_string();
                let decode_from = match args.remove("--decode-from") {
                    Some(p) => Some(
                        p.parse::<i64>()
                            .map_err(|e| crate::error::gerr!("--decode-from {p:?}: {e}"))?,
                    ),
                    None => None,
                };
                Verb::Layer {
                    model,
                    layer,
                    input,
                    input_name,
                    out,
                    internals,
                    force,
                    decode_from,
                }
            }
            other => {
                return Err(crate::error::gerr!(
                    "unknown verb {other:?}: expected trace or layer"
                ))
            }
        };
        match args.keys().next() {
            Some(extra) => Err(crate::error::gerr!("{verb}: unexpected argument {extra}")),
            None => Ok((parsed, threads)),
        }
    }
}

/// Token ids as the protocol writes them (`3,17,5`).
pub fn parse_tokens(s: &str) -> crate::error::Result<Vec<i64>> {
    // The producers' grammar (tracegate_trace::protocol): what the gate takes, they take.
    let tokens: std::result::Result<Vec<i64>, _> = s
        .split(',')
        .map(tracegate_trace::protocol::token_id)
        .collect();
    let tokens = tokens.map_err(|e| crate::error::gerr!("--tokens {s:?}: {e} (e.g. 3,17,5)"))?;
    if tokens.is_empty() || tokens.iter().any(|&t| t < 0) {
        return Err(crate::error::gerr!(
            "--tokens {s:?}: need at least one non-negative token id"
        ));
    }
    Ok(tokens)
}

/// The template word that is the verb and declares that the command answers `serve`.
pub const SERVE_VERB: &str = "{verb|serve}";

pub fn split_words(s: &str) -> crate::error::Result<Vec<String>> {
    let mut words = Vec::new();
    let mut cur = String::new();
    let mut quote: Option<char> = None;
    let mut any = false;
    for ch in s.chars() {
        match quote {
            Some(q) if ch == q => quote = None,
            Some(_) => cur.push(ch),
            None if ch == '\'' || ch == '"' => {
                quote = Some(ch);
                any = true;
            }
            None if ch.is_whitespace() => {
                if any || !cur.is_empty() {
                    words.push(std::mem::take(&mut cur));
                    any = false;
                }
            }
            None => cur.push(ch),
        }
    }
    if let Some(q) = quote {
        return Err(crate::error::gerr!("unterminated {q} quote"));
    }
    if any || !cur.is_empty() {
        words.push(cur);
    }
    Ok(words)
}

fn quote(word: &str) -> String {
    if !word.is_empty()
        && word
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || "-_./,=:+@".contains(c))
    {
        word.to_string()
    } else {
        format!("'{}'", word.replace('\'', "'\\''"))
    }
}

pub fn display(argv: &[String]) -> String {
    argv.iter().map(|w| quote(w)).collect::<Vec<_>>().join(" ")
}
