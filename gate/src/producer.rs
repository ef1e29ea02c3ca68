//! Running producers. Every producer is a subprocess with a timeout: the contract, the oracle and
//! a user's engine through a command template that answers the two protocol verbs
//! (`docs/producers.md`), the engine as a child of the gate's own executable. Every run records
//! its exact invocation, seconds and peak RSS, and a crash or a hang is a result with the head
//! and tail of its stderr, never a dropped row or a dead gate.

use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use serde::Serialize;

/// Arguments of one protocol verb; rendered identically for every producer. `force`: the
/// optional `--force-decisions TRACE` (docs/producers.md), passed only when set.
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

    pub fn args(&self) -> Vec<String> {
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
    pub fn parse(argv: &[String]) -> std::result::Result<(Verb, usize), String> {
        let (verb, rest) = match argv {
            [engine, verb, rest @ ..] if engine == "engine" => (verb.as_str(), rest),
            _ => {
                return Err(format!(
                    "expected `engine trace|layer ARGS`, got {}",
                    display(argv)
                ))
            }
        };
        if rest.len() % 2 != 0 {
            return Err(format!(
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
                .ok_or_else(|| format!("{verb}: missing {name}"))
        };
        let number =
            |name: &str, v: &str| v.parse::<usize>().map_err(|e| format!("{name} {v:?}: {e}"));
        let internals = match take("--capture")? {
            "default" => false,
            "internals" => true,
            other => {
                return Err(format!(
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
                let tokens = crate::prompts::parse_tokens(tokens).map_err(|e| e.to_string())?;
                let generate = match args.remove("--generate") {
                    Some(g) => number("--generate", g)?,
                    None => 0,
                };
                let cache = match args.remove("--cache") {
                    None | Some("on") => true,
                    Some("off") => false,
                    Some(other) => return Err(format!("--cache {other:?}: expected on or off")),
                };
                Verb::Trace {
                    model,
                    tokens,
                    out,
                    internals,
                    generate,
                    cache,
                    force,
                }
            }
            "layer" => {
                let layer = number("--layer", take("--layer")?)?;
                let input = take("--input")?.to_string();
                let input_name = take("--input-name")?.to_string();
                let decode_from = match args.remove("--decode-from") {
                    Some(p) => Some(
                        p.parse::<i64>()
                            .map_err(|e| format!("--decode-from {p:?}: {e}"))?,
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
            other => return Err(format!("unknown verb {other:?}: expected trace or layer")),
        };
        match args.keys().next() {
            Some(extra) => Err(format!("{verb}: unexpected argument {extra}")),
            None => Ok((parsed, threads)),
        }
    }
}

#[derive(Clone, Debug)]
pub enum Producer {
    /// The reference engine (linked into the gate; run as a child process, see `Producer::run`).
    Engine { threads: usize },
    /// A command template, split into words once (`Producer::command` checks it): `{verb}` is
    /// replaced by the verb, `{args}` by its arguments (appended when absent). Words are split
    /// on whitespace; single or double quotes group. `serve`: the index of the word
    /// `{verb|serve}` (the verb, and a declaration that `PREFIX serve` answers requests; see
    /// crate::worker), when the template has it.
    Command {
        name: String,
        words: Vec<String>,
        serve: Option<usize>,
    },
}

#[derive(Clone, Debug, Serialize)]
pub struct RunRecord {
    pub producer: String,
    pub verb: &'static str,
    /// The exact command line (for the engine: the equivalent `engine` CLI invocation, which the
    /// gate runs as a child of its own executable).
    pub invocation: String,
    pub ok: bool,
    pub exit_code: Option<i32>,
    /// Killed after `--timeout` seconds.
    pub timed_out: bool,
    pub seconds: f64,
    pub peak_rss_kib: Option<u64>,
    /// stderr (stdout when stderr is empty and the run failed), bounded: its first and last
    /// CAPTURE_HEAD / CAPTURE_TAIL bytes, with how many bytes between them were not kept; then,
    /// for a failed run, how it ended (`[exit status 3]`, `[killed by signal 6 (SIGABRT)]`).
    pub stderr: String,
    /// Bytes the producer wrote to stderr, all of them (`stderr` keeps at most head + tail).
    pub stderr_bytes: u64,
    pub out: String,
    /// The pid of the worker that answered this run (docs/producers.md, "Serving"); the
    /// invocation above is then the equivalent per-call command line.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub served_by: Option<u32>,
}

impl RunRecord {
    /// One bounded message for a failed run: the head and tail of what it said.
    pub fn why(&self) -> String {
        let text = self.stderr.trim();
        if text.len() <= 2 * WHY_BYTES {
            return text.to_string();
        }
        let head = &text[..floor_char(text, WHY_BYTES)];
        let tail = &text[ceil_char(text, text.len() - WHY_BYTES)..];
        format!("{head} […] {tail}")
    }
}

fn floor_char(s: &str, mut i: usize) -> usize {
    while !s.is_char_boundary(i) {
        i -= 1;
    }
    i
}

fn ceil_char(s: &str, mut i: usize) -> usize {
    while !s.is_char_boundary(i) {
        i += 1;
    }
    i
}

/// What a producer's output may cost the gate, per stream, in memory and in the report.
pub const CAPTURE_HEAD: usize = 8 * 1024;
pub const CAPTURE_TAIL: usize = 8 * 1024;
/// A failure message (check detail, refusal) keeps this much of each end of the capture.
const WHY_BYTES: usize = 1024;
/// How long output is still read after the producer exited (from a child that left its
/// process group and kept the pipe open) before the gate stops listening.
pub(crate) const DRAIN_GRACE: Duration = Duration::from_secs(2);
/// Default `--timeout`: the slowest fixture run (the oracle, about 7 s) with a wide margin.
pub const DEFAULT_TIMEOUT_S: u64 = 300;

/// The first CAPTURE_HEAD and last CAPTURE_TAIL bytes of a stream, and its total length.
#[derive(Default)]
pub struct Capture {
    head: Vec<u8>,
    tail: std::collections::VecDeque<u8>,
    total: u64,
}

impl Capture {
    pub fn push(&mut self, mut bytes: &[u8]) {
        self.total += bytes.len() as u64;
        let room = CAPTURE_HEAD - self.head.len();
        let n = room.min(bytes.len());
        self.head.extend_from_slice(&bytes[..n]);
        bytes = &bytes[n..];
        if bytes.len() >= CAPTURE_TAIL {
            self.tail.clear();
            bytes = &bytes[bytes.len() - CAPTURE_TAIL..];
        }
        let over = (self.tail.len() + bytes.len()).saturating_sub(CAPTURE_TAIL);
        self.tail.drain(..over);
        self.tail.extend(bytes);
    }

    pub fn total(&self) -> u64 {
        self.total
    }

    /// Kept bytes, at most CAPTURE_HEAD + CAPTURE_TAIL (plus the note of what was left out).
    pub fn text(&self) -> String {
        let head = String::from_utf8_lossy(&self.head);
        let tail: Vec<u8> = self.tail.iter().copied().collect();
        let tail = String::from_utf8_lossy(&tail);
        let left_out = self.total - (self.head.len() + self.tail.len()) as u64;
        if left_out == 0 {
            format!("{head}{tail}")
        } else {
            format!(
                "{head}\n[… {left_out} of {} bytes not kept …]\n{tail}",
                self.total
            )
        }
    }
}

pub fn split_words(s: &str) -> std::result::Result<Vec<String>, String> {
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
        return Err(format!("unterminated {q} quote"));
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

impl Producer {
    /// A subprocess producer, its template checked now rather than failing every run later.
    pub fn command(name: &str, template: &str) -> crate::Result<Producer> {
        let bad = |why: &str| {
            crate::gerr!("{name} command template {template:?}: {why} (example: 'my-engine {{verb}} {{args}}'; docs/producers.md)")
        };
        let words = split_words(template).map_err(|e| bad(&e))?;
        if words.is_empty() {
            return Err(bad("empty"));
        }
        let serve = words.iter().position(|w| w == SERVE_VERB);
        if words
            .iter()
            .any(|w| w.contains(SERVE_VERB) && w != SERVE_VERB)
            || words.iter().filter(|w| *w == SERVE_VERB).count() > 1
        {
            return Err(bad("{verb|serve} must be a word of its own, once"));
        }
        if serve.is_some_and(|i| {
            words[..i]
                .iter()
                .any(|w| w.contains("{verb}") || w.contains("{args}"))
        }) {
            return Err(bad(
                "the words before {verb|serve} start the worker and may not hold {verb} or {args}",
            ));
        }
        if serve.is_none() && !words.iter().any(|w| w.contains("{verb}")) {
            return Err(bad(
                "no {verb}: the producer would not be told which verb to run",
            ));
        }
        if words.iter().any(|w| w.contains("{args}") && w != "{args}") {
            return Err(bad("{args} must be a word of its own"));
        }
        Ok(Producer::Command {
            name: name.into(),
            words,
            serve,
        })
    }

    pub fn name(&self) -> String {
        match self {
            Producer::Engine { .. } => "engine".into(),
            Producer::Command { name, .. } => name.clone(),
        }
    }

    pub fn argv(&self, verb: &Verb) -> Vec<String> {
        match self {
            Producer::Engine { threads } => {
                let mut a = vec!["engine".to_string(), verb.name().to_string()];
                a.extend(verb.args());
                a.extend(["--threads".into(), threads.to_string()]);
                a
            }
            Producer::Command { words, .. } => {
                let mut out = Vec::new();
                let mut placed = false;
                for w in words {
                    if w == "{args}" {
                        out.extend(verb.args());
                        placed = true;
                    } else if w == SERVE_VERB {
                        out.push(verb.name().to_string());
                    } else {
                        out.push(w.replace("{verb}", verb.name()));
                    }
                }
                if !placed {
                    out.extend(verb.args());
                }
                out
            }
        }
    }

    /// The worker command line (`PREFIX serve`) of a template that declares `{verb|serve}`,
    /// unless TRACEGATE_SERVE=0 asks for per-call runs.
    fn serve_argv(&self) -> Option<(usize, Vec<String>)> {
        match self {
            Producer::Command {
                words,
                serve: Some(i),
                ..
            } if std::env::var("TRACEGATE_SERVE").as_deref() != Ok("0") => {
                let mut a = words[..*i].to_vec();
                a.push("serve".into());
                Some((*i, a))
            }
            _ => None,
        }
    }

    /// Starts a serving producer's worker now (nothing for the others), so that its start-up
    /// overlaps what the gate does before the first request.
    pub fn prestart(&self, root: &Path) {
        if let Some((_, serve_argv)) = self.serve_argv() {
            crate::worker::prestart(root, &serve_argv);
        }
    }

    /// A request outside the two verbs (the oracle's `versions`) to this producer's worker;
    /// None when it does not serve. Err: why it failed, its stderr's last line last.
    pub fn ask_worker(
        &self,
        root: &Path,
        request: &[String],
        timeout: Duration,
    ) -> Option<std::result::Result<(), String>> {
        let (_, serve_argv) = self.serve_argv()?;
        let (e, _) = crate::worker::request(root, &serve_argv, request, timeout);
        Some(match (e.ok, e.timed_out) {
            (true, _) => Ok(()),
            (false, true) => Err(format!(
                "timed out after {} s (--timeout) and was killed: $ {}",
                timeout.as_secs_f64(),
                display(&serve_argv)
            )),
            (false, false) => Err(e.text),
        })
    }

    /// Runs `verb` with `root` as the working directory (paths in the verb are relative to it),
    /// killed after `timeout`. The engine runs as a child of the gate's own executable (the
    /// hidden verb ENGINE_CHILD), so an engine that aborts or hangs ends a run, not the gate.
    pub fn run(&self, root: &Path, verb: &Verb, timeout: Duration) -> RunRecord {
        let argv = self.argv(verb);
        let invocation = display(&argv);
        let start = Instant::now();
        let mut served_by = None;
        let spawned = match self {
            Producer::Engine { .. } => match std::env::current_exe() {
                Ok(exe) => {
                    let mut a = vec![exe.display().to_string(), ENGINE_CHILD.to_string()];
                    a.extend(argv.iter().cloned());
                    run_command(root, &a, timeout)
                }
                Err(e) => Ended::failed(format!(
                    "cannot find the gate's own executable to run the engine: {e}"
                )),
            },
            Producer::Command { .. } => match self.serve_argv() {
                Some((i, serve_argv)) => {
                    let (ended, pid) =
                        crate::worker::request(root, &serve_argv, &argv[i..], timeout);
                    served_by = pid;
                    ended
                }
                None => run_command(root, &argv, timeout),
            },
        };
        let wrote = root.join(verb.out()).is_file();
        let ok = spawned.ok && wrote;
        let mut stderr = spawned.text;
        if spawned.ok && !wrote {
            stderr = format!("exited 0 but wrote no trace at {}", verb.out());
        }
        if spawned.timed_out {
            stderr = format!(
                "{}\n[timed out after {} s (--timeout); killed: $ {invocation}]",
                stderr.trim_end(),
                timeout.as_secs_f64()
            );
        }
        RunRecord {
            producer: self.name(),
            verb: verb.name(),
            invocation,
            ok,
            exit_code: spawned.exit_code,
            timed_out: spawned.timed_out,
            seconds: start.elapsed().as_secs_f64(),
            peak_rss_kib: spawned.peak_rss_kib,
            stderr,
            stderr_bytes: spawned.stderr_bytes,
            out: verb.out().to_string(),
            served_by,
        }
    }
}

/// The template word that is the verb and declares that the command answers `serve`.
pub const SERVE_VERB: &str = "{verb|serve}";

/// The hidden first argument with which the gate runs itself as the engine producer.
pub const ENGINE_CHILD: &str = "__engine-producer";

/// The engine side of ENGINE_CHILD: `argv` is the equivalent engine command line
/// (`engine trace|layer ARGS --threads N`, as `Producer::argv` writes it).
pub fn engine_child(argv: &[String]) -> Result<(), String> {
    let (verb, threads) = Verb::parse(argv)?;
    let e = |e: tracegate_engine::Error| e.to_string();
    match verb {
        Verb::Trace {
            model,
            tokens,
            out,
            internals,
            generate,
            cache,
            force,
        } => tracegate_engine::run_trace(&tracegate_engine::TraceOptions {
            model_dir: PathBuf::from(model),
            tokens,
            out: PathBuf::from(out),
            internals,
            generate,
            cache,
            threads,
            command_line: argv.to_vec(),
            force_decisions: force.map(PathBuf::from),
        })
        .map(|_| ())
        .map_err(e),
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
        .map_err(e),
    }
}

/// How a subprocess ended.
pub(crate) struct Ended {
    pub(crate) ok: bool,
    pub(crate) exit_code: Option<i32>,
    pub(crate) timed_out: bool,
    pub(crate) peak_rss_kib: Option<u64>,
    /// stderr (or stdout, see RunRecord::stderr), with how it ended when it failed.
    pub(crate) text: String,
    pub(crate) stderr_bytes: u64,
    pub(crate) stdout: String,
}

impl Ended {
    pub(crate) fn failed(why: String) -> Ended {
        Ended {
            ok: false,
            exit_code: None,
            timed_out: false,
            peak_rss_kib: None,
            text: why,
            stderr_bytes: 0,
            stdout: String::new(),
        }
    }
}

/// Runs a helper command (not a producer: e.g. the oracle's version probe) under the same
/// timeout and bounds; its stdout when it succeeds, else why not.
pub fn run_helper(
    root: &Path,
    argv: &[String],
    timeout: Duration,
) -> std::result::Result<String, String> {
    let e = run_command(root, argv, timeout);
    match (e.ok, e.timed_out) {
        (true, _) => Ok(e.stdout),
        (false, true) => Err(format!(
            "timed out after {} s (--timeout) and was killed: $ {}",
            timeout.as_secs_f64(),
            display(argv)
        )),
        (false, false) => Err(e.text),
    }
}

fn signal_name(sig: i32) -> &'static str {
    match sig {
        libc::SIGABRT => "SIGABRT",
        libc::SIGKILL => "SIGKILL",
        libc::SIGSEGV => "SIGSEGV",
        libc::SIGBUS => "SIGBUS",
        libc::SIGTERM => "SIGTERM",
        libc::SIGINT => "SIGINT",
        libc::SIGPIPE => "SIGPIPE",
        libc::SIGFPE => "SIGFPE",
        libc::SIGILL => "SIGILL",
        _ => "",
    }
}

/// A wait status as (ok, exit code, how it ended).
pub(crate) fn exit_text(status: libc::c_int) -> (bool, Option<i32>, String) {
    if libc::WIFEXITED(status) {
        let code = libc::WEXITSTATUS(status);
        (code == 0, Some(code), format!("exit status {code}"))
    } else if libc::WIFSIGNALED(status) {
        let sig = libc::WTERMSIG(status);
        let name = signal_name(sig);
        (
            false,
            None,
            if name.is_empty() {
                format!("killed by signal {sig}")
            } else {
                format!("killed by signal {sig} ({name})")
            },
        )
    } else {
        (false, None, "ended abnormally".to_string())
    }
}

/// Spawns the command in a process group of its own, reads its output into bounded captures
/// while it runs, and reaps it with wait4 for its peak RSS. At `timeout` the whole group is
/// killed. When it exits, what it left running in its group is killed too, and a pipe still
/// held open (by a child that left the group) is read for DRAIN_GRACE at most: a producer's
/// leftovers never block the gate.
fn run_command(root: &Path, argv: &[String], timeout: Duration) -> Ended {
    use std::os::fd::AsRawFd;
    use std::os::unix::process::CommandExt;
    let Some((prog, rest)) = argv.split_first() else {
        return Ended::failed("empty command template".into());
    };
    let mut cmd = Command::new(prog);
    cmd.args(rest)
        .current_dir(root)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .process_group(0);
    // SAFETY: prctl is async-signal-safe; it only asks the kernel to kill the child if the gate
    // dies first (Ctrl-C), since a child in its own group does not get the terminal's SIGINT.
    unsafe {
        cmd.pre_exec(|| {
            libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
            Ok(())
        });
    }
    let mut child = match cmd.spawn() {
        Ok(c) => c,
        Err(e) => return Ended::failed(format!("could not start {prog:?}: {e}")),
    };
    let pid = child.id() as libc::pid_t;
    let as_file = |fd: Option<std::os::fd::OwnedFd>| fd.map(std::fs::File::from);
    // [stdout, stderr]; None once closed or abandoned.
    let mut pipes = [
        as_file(child.stdout.take().map(Into::into)),
        as_file(child.stderr.take().map(Into::into)),
    ];
    for f in pipes.iter().flatten() {
        // SAFETY: fcntl on descriptors this function owns.
        unsafe {
            let flags = libc::fcntl(f.as_raw_fd(), libc::F_GETFL);
            libc::fcntl(f.as_raw_fd(), libc::F_SETFL, flags | libc::O_NONBLOCK);
        }
    }
    let mut caps = [Capture::default(), Capture::default()];
    let start = Instant::now();
    let mut status: libc::c_int = 0;
    // SAFETY: rusage is a plain out-parameter.
    let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
    let mut ended: Option<Instant> = None;
    let mut timed_out = false;
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        let open: Vec<usize> = (0..2).filter(|&i| pipes[i].is_some()).collect();
        if open.is_empty() && ended.is_some() {
            break;
        }
        if open.is_empty() {
            std::thread::sleep(Duration::from_millis(5));
        } else {
            let mut pfds: Vec<libc::pollfd> = open
                .iter()
                .map(|&i| libc::pollfd {
                    fd: pipes[i].as_ref().map_or(-1, |f| f.as_raw_fd()),
                    events: libc::POLLIN,
                    revents: 0,
                })
                .collect();
            // SAFETY: pfds is a live array of pollfd of the given length.
            unsafe { libc::poll(pfds.as_mut_ptr(), pfds.len() as libc::nfds_t, 20) };
            for (&i, p) in open.iter().zip(&pfds) {
                if p.revents == 0 {
                    continue;
                }
                // One read per round, so an endless writer cannot keep the loop from the clock.
                let Some(f) = pipes[i].as_mut() else { continue };
                match f.read(&mut buf) {
                    Ok(0) => pipes[i] = None,
                    Ok(n) => caps[i].push(&buf[..n]),
                    Err(e)
                        if matches!(
                            e.kind(),
                            std::io::ErrorKind::Interrupted | std::io::ErrorKind::WouldBlock
                        ) => {}
                    Err(_) => pipes[i] = None,
                }
            }
        }
        match ended {
            Some(at) if at.elapsed() >= DRAIN_GRACE => break,
            Some(_) => {}
            None => {
                // Exited, not yet reaped: while the leader is a zombie its pid (the group's id)
                // cannot be reused, so killing the group cannot hit a stranger.
                // SAFETY: waitid on our own child; info is an out-parameter.
                let mut info: libc::siginfo_t = unsafe { std::mem::zeroed() };
                let rc = unsafe {
                    libc::waitid(
                        libc::P_PID,
                        pid as libc::id_t,
                        &mut info,
                        libc::WEXITED | libc::WNOHANG | libc::WNOWAIT,
                    )
                };
                let exited = rc == 0 && unsafe { info.si_pid() } == pid;
                if rc == -1
                    && std::io::Error::last_os_error().kind() != std::io::ErrorKind::Interrupted
                {
                    return Ended::failed(format!(
                        "waitid failed: {}",
                        std::io::Error::last_os_error()
                    ));
                }
                let over = !exited && start.elapsed() >= timeout;
                if exited || over {
                    // SAFETY: signals the group this child leads (kept alive as a zombie, see
                    // above); then reaps it with wait4 for its status and peak RSS.
                    unsafe { libc::kill(-pid, libc::SIGKILL) };
                    while unsafe { libc::wait4(pid, &mut status, 0, &mut usage) } == -1
                        && std::io::Error::last_os_error().kind() == std::io::ErrorKind::Interrupted
                    {
                    }
                    timed_out = over;
                    ended = Some(Instant::now());
                }
            }
        }
    }
    // `child` was reaped above; dropping it neither waits nor kills.
    drop(child);
    let [out, err] = caps;
    let (ok, code, how) = if timed_out {
        (false, None, String::new())
    } else {
        exit_text(status)
    };
    let stdout = out.text();
    let mut text = err.text();
    if !ok {
        if text.trim().is_empty() {
            text = stdout.clone();
        }
        if !how.is_empty() {
            text.truncate(text.trim_end().len());
            text.push_str(&format!("\n[{how}]"));
        }
    }
    Ended {
        ok,
        exit_code: code,
        timed_out,
        peak_rss_kib: Some(usage.ru_maxrss as u64),
        text,
        stderr_bytes: err.total(),
        stdout,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_capture_keeps_its_head_and_tail_whatever_is_pushed() {
        let mut c = Capture::default();
        c.push(b"FIRST\n");
        for _ in 0..5_000 {
            c.push(&[b'x'; 10_000]);
        }
        c.push(b"\nLAST\n");
        assert_eq!(c.total(), 6 + 50_000_000 + 6);
        assert_eq!(c.head.len() + c.tail.len(), CAPTURE_HEAD + CAPTURE_TAIL);
        let text = c.text();
        assert!(
            text.starts_with("FIRST\n") && text.ends_with("\nLAST\n"),
            "{}",
            &text[..64]
        );
        assert!(text.contains(&format!(
            "[… {} of 50000012 bytes not kept …]",
            50_000_012 - CAPTURE_HEAD - CAPTURE_TAIL
        )));
        // Under the bound, everything is kept, in order.
        let mut small = Capture::default();
        small.push(b"one ");
        small.push(&[b'y'; CAPTURE_HEAD]);
        small.push(b" two");
        assert_eq!(
            small.text(),
            format!("one {} two", "y".repeat(CAPTURE_HEAD))
        );
    }

    #[test]
    fn a_serving_template_is_the_per_call_command_and_a_worker_command() {
        let p = Producer::command("c", "py -m x {verb|serve} {args} --threads 1").unwrap();
        let verb = Verb::Trace {
            model: "m".into(),
            tokens: vec![1],
            out: "o".into(),
            internals: false,
            generate: 0,
            cache: true,
            force: None,
        };
        assert_eq!(
            display(&p.argv(&verb)),
            "py -m x trace --model m --tokens 1 --out o --capture default --threads 1"
        );
        assert_eq!(
            p.serve_argv().map(|(i, a)| (i, display(&a))),
            Some((3, "py -m x serve".to_string()))
        );
        assert!(Producer::command("c", "py {verb} {args}")
            .unwrap()
            .serve_argv()
            .is_none());
        for bad in [
            "py x{verb|serve} {args}",
            "py {verb|serve} {verb|serve}",
            "py {args} {verb|serve}",
        ] {
            assert!(Producer::command("c", bad).is_err(), "{bad}");
        }
    }

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
            },
            Verb::Trace {
                model: "/abs/m".into(),
                tokens: vec![0],
                out: "o.trace".into(),
                internals: false,
                generate: 0,
                cache: true,
                force: Some("w/ref.trace".into()),
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
        assert!(err.contains("missing --capture"), "{err}");
    }
}
