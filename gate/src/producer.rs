//! Running producers. The engine runs in process; the contract, the oracle and a user's engine
//! run as subprocesses through a command template that answers the two protocol verbs
//! (`docs/producers.md`). Every run records its exact invocation, seconds and peak RSS, and a
//! crash is a result with its stderr tail, never a dropped row.

use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Instant;

use serde::Serialize;

/// Arguments of one protocol verb; rendered identically for every producer.
#[derive(Clone, Debug)]
pub enum Verb {
    Trace { model: String, tokens: Vec<i64>, out: String, internals: bool, generate: usize, cache: bool },
    Layer { model: String, layer: usize, input: String, input_name: String, out: String, internals: bool },
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
        match self {
            Verb::Trace { model, tokens, out, internals, generate, cache } => {
                let toks: Vec<String> = tokens.iter().map(|t| t.to_string()).collect();
                let mut a = vec!["--model".into(), model.clone(), "--tokens".into(), toks.join(","), "--out".into(), out.clone()];
                a.extend(["--capture".into(), capture(*internals)]);
                if *generate > 0 {
                    a.extend(["--generate".into(), generate.to_string(), "--cache".into(), if *cache { "on" } else { "off" }.into()]);
                }
                a
            }
            Verb::Layer { model, layer, input, input_name, out, internals } => vec![
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
            ],
        }
    }
}

#[derive(Clone, Debug)]
pub enum Producer {
    /// The reference engine, in this process.
    Engine { threads: usize },
    /// A command template, split into words once (`Producer::command` checks it): `{verb}` is
    /// replaced by the verb, `{args}` by its arguments (appended when absent). Words are split
    /// on whitespace; single or double quotes group.
    Command { name: String, words: Vec<String> },
}

#[derive(Clone, Debug, Serialize)]
pub struct RunRecord {
    pub producer: String,
    pub verb: &'static str,
    /// The exact command line (for the engine: the equivalent `engine` CLI invocation, run in process).
    pub invocation: String,
    pub ok: bool,
    pub exit_code: Option<i32>,
    pub seconds: f64,
    pub peak_rss_kib: Option<u64>,
    /// The last lines of stderr (or the error), for a failed run.
    pub stderr_tail: String,
    pub out: String,
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
    if !word.is_empty() && word.chars().all(|c| c.is_ascii_alphanumeric() || "-_./,=:+@".contains(c)) {
        word.to_string()
    } else {
        format!("'{}'", word.replace('\'', "'\\''"))
    }
}

pub fn display(argv: &[String]) -> String {
    argv.iter().map(|w| quote(w)).collect::<Vec<_>>().join(" ")
}

fn tail(text: &str, lines: usize) -> String {
    let all: Vec<&str> = text.lines().collect();
    all[all.len().saturating_sub(lines)..].join("\n")
}

impl Producer {
    /// A subprocess producer, its template checked now rather than failing every run later.
    pub fn command(name: &str, template: &str) -> crate::Result<Producer> {
        let bad = |why: &str| crate::gerr!("{name} command template {template:?}: {why} (example: 'my-engine {{verb}} {{args}}'; docs/producers.md)");
        let words = split_words(template).map_err(|e| bad(&e))?;
        if words.is_empty() {
            return Err(bad("empty"));
        }
        if !words.iter().any(|w| w.contains("{verb}")) {
            return Err(bad("no {verb}: the producer would not be told which verb to run"));
        }
        if words.iter().any(|w| w.contains("{args}") && w != "{args}") {
            return Err(bad("{args} must be a word of its own"));
        }
        Ok(Producer::Command { name: name.into(), words })
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

    /// Runs `verb` with `root` as the working directory (paths in the verb are relative to it).
    pub fn run(&self, root: &Path, verb: &Verb) -> RunRecord {
        let argv = self.argv(verb);
        let invocation = display(&argv);
        let start = Instant::now();
        let (ok, exit_code, peak, stderr) = match self {
            Producer::Engine { .. } => run_engine_in_process(root, verb, &argv),
            Producer::Command { .. } => run_command(root, &argv),
        };
        RunRecord {
            producer: self.name(),
            verb: verb.name(),
            invocation,
            ok: ok && root.join(verb.out()).is_file(),
            exit_code,
            seconds: start.elapsed().as_secs_f64(),
            peak_rss_kib: peak,
            stderr_tail: if ok && !root.join(verb.out()).is_file() {
                format!("exited 0 but wrote no trace at {}", verb.out())
            } else {
                tail(&stderr, 15)
            },
            out: verb.out().to_string(),
        }
    }
}

/// Peak RSS of this process since the last reset (Linux: VmHWM; reset via clear_refs 5).
fn reset_peak_rss() {
    let _ = std::fs::write("/proc/self/clear_refs", "5");
}

fn peak_rss_kib() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    line.split_whitespace().nth(1)?.parse().ok()
}

fn run_engine_in_process(root: &Path, verb: &Verb, argv: &[String]) -> (bool, Option<i32>, Option<u64>, String) {
    // `root` is the working directory the gate set; joining "." keeps recorded paths relative.
    let abs = |p: &str| -> PathBuf { if root == Path::new(".") { PathBuf::from(p) } else { root.join(p) } };
    reset_peak_rss();
    let result = std::panic::catch_unwind(|| match verb {
        Verb::Trace { model, tokens, out, internals, generate, cache } => tracegate_engine::run_trace(&tracegate_engine::TraceOptions {
            model_dir: abs(model),
            tokens: tokens.clone(),
            out: abs(out),
            internals: *internals,
            generate: *generate,
            cache: *cache,
            threads: engine_threads(argv),
            command_line: argv.to_vec(),
        })
        .map(|_| ()),
        Verb::Layer { model, layer, input, input_name, out, internals } => tracegate_engine::run_layer(&tracegate_engine::LayerOptions {
            model_dir: abs(model),
            layer: *layer,
            input: abs(input),
            input_name: input_name.clone(),
            out: abs(out),
            internals: *internals,
            threads: engine_threads(argv),
            command_line: argv.to_vec(),
        })
        .map(|_| ()),
    });
    let peak = peak_rss_kib();
    match result {
        Ok(Ok(())) => (true, Some(0), peak, String::new()),
        Ok(Err(e)) => (false, Some(2), peak, format!("engine: {e}")),
        Err(panic) => {
            let msg = panic.downcast_ref::<String>().cloned().or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()));
            (false, None, peak, format!("engine panicked: {}", msg.unwrap_or_default()))
        }
    }
}

fn engine_threads(argv: &[String]) -> usize {
    argv.iter().position(|a| a == "--threads").and_then(|i| argv.get(i + 1)).and_then(|t| t.parse().ok()).unwrap_or(1)
}

/// Spawns the command, drains its output, and reaps it with wait4 for the child's peak RSS.
fn run_command(root: &Path, argv: &[String]) -> (bool, Option<i32>, Option<u64>, String) {
    let Some((prog, rest)) = argv.split_first() else {
        return (false, None, None, "empty command template".into());
    };
    let child = Command::new(prog)
        .args(rest)
        .current_dir(root)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn();
    let mut child = match child {
        Ok(c) => c,
        Err(e) => return (false, None, None, format!("could not start {prog:?}: {e}")),
    };
    let mut stdout = child.stdout.take().expect("piped");
    let mut stderr = child.stderr.take().expect("piped");
    let out_thread = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = stdout.read_to_string(&mut s);
        s
    });
    let err_thread = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = stderr.read_to_string(&mut s);
        s
    });
    let pid = child.id() as libc::pid_t;
    let mut status: libc::c_int = 0;
    // SAFETY: plain wait4 on our own child; rusage is a zeroed out-parameter.
    let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
    let rc = loop {
        let rc = unsafe { libc::wait4(pid, &mut status, 0, &mut usage) };
        if rc == -1 && std::io::Error::last_os_error().kind() == std::io::ErrorKind::Interrupted {
            continue;
        }
        break rc;
    };
    let out = out_thread.join().unwrap_or_default();
    let err = err_thread.join().unwrap_or_default();
    if rc == -1 {
        return (false, None, None, format!("wait4 failed: {}", std::io::Error::last_os_error()));
    }
    let (ok, code, how) = if libc::WIFEXITED(status) {
        let code = libc::WEXITSTATUS(status);
        (code == 0, Some(code), format!("exit status {code}"))
    } else if libc::WIFSIGNALED(status) {
        (false, None, format!("killed by signal {}", libc::WTERMSIG(status)))
    } else {
        (false, None, "ended abnormally".to_string())
    };
    let mut text = err;
    if !ok {
        if text.trim().is_empty() {
            text = out;
        }
        text.push_str(&format!("\n[{how}]"));
    }
    (ok, code, Some(usage.ru_maxrss as u64), text)
}
