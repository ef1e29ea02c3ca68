//! What a command writes besides traces: report files written whole or not at all, stdout
//! that a closed pipe does not turn into a crash, and text from outside (a producer's stderr,
//! a file's names) made safe for a terminal ([`printable`]).

use std::borrow::Cow;
use std::io::Write;
use std::path::{Path, PathBuf};

/// A file that could not be written, and why.
#[derive(Debug)]
pub struct WriteError {
    pub path: PathBuf,
    pub error: std::io::Error,
}

impl std::fmt::Display for WriteError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}: {}", self.path.display(), self.error)
    }
}

impl std::error::Error for WriteError {}

/// Writes every file or none of them: each goes to a temporary beside it first (fsynced), and
/// only when all are complete are they renamed into place. On any failure (a full disk, a
/// read-only directory) every temporary is removed and the final paths keep what they held, so
/// no report is half written and none disagrees with another (a JSON report saying exit 0 beside
/// an HTML page that could not be written).
pub fn write_whole(files: &[(&Path, &[u8])]) -> Result<(), WriteError> {
    // A directory in the way would fail only at the rename, after others were renamed.
    if let Some((path, _)) = files.iter().find(|(p, _)| p.is_dir()) {
        return Err(WriteError {
            path: path.to_path_buf(),
            error: std::io::Error::new(std::io::ErrorKind::IsADirectory, "is a directory"),
        });
    }
    let tmps: Vec<PathBuf> = files.iter().map(|(p, _)| temporary(p)).collect();
    let cleanup = |upto: usize| {
        for t in &tmps[..upto] {
            let _ = std::fs::remove_file(t);
        }
    };
    for (i, ((_, bytes), tmp)) in files.iter().zip(&tmps).enumerate() {
        let written = std::fs::File::create(tmp).and_then(|mut f| {
            f.write_all(bytes)?;
            f.sync_all()
        });
        if let Err(error) = written {
            cleanup(i + 1);
            return Err(WriteError {
                path: files[i].0.to_path_buf(),
                error,
            });
        }
    }
    for (i, ((path, _), tmp)) in files.iter().zip(&tmps).enumerate() {
        if let Err(error) = std::fs::rename(tmp, path) {
            for t in &tmps[i..] {
                let _ = std::fs::remove_file(t);
            }
            return Err(WriteError {
                path: path.to_path_buf(),
                error,
            });
        }
    }
    Ok(())
}

/// `.NAME.PID.tracegate-tmp` beside `path`: hidden, and never another run's.
fn temporary(path: &Path) -> PathBuf {
    let name = path.file_name().unwrap_or_default().to_string_lossy();
    path.with_file_name(format!(".{name}.{}.tracegate-tmp", std::process::id()))
}

/// Prints to stdout. A closed pipe (`| head`, `| true`) is the reader's choice, not a failure:
/// the rest is dropped and the command goes on (its reports are still written, its exit status
/// stands). Any other write error is returned.
pub fn print(text: &str) -> std::io::Result<()> {
    let mut out = std::io::stdout().lock();
    match out.write_all(text.as_bytes()).and_then(|()| out.flush()) {
        Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => Ok(()),
        r => r,
    }
}

/// Refuses an output path that names one of the command's inputs, or another output of it:
/// writing a report there would destroy the trace or file it was computed from (`--html
/// e.trace`), or one report would overwrite the other. The same file is told by device and
/// inode, so another spelling of the path or a link to it is caught too; two outputs not there
/// yet collide only when spelled alike.
pub fn refuse_clobbering(
    outputs: &[(&str, &Path)],
    inputs: &[(&str, &Path)],
) -> Result<(), String> {
    use std::os::unix::fs::MetadataExt;
    let id = |p: &Path| std::fs::metadata(p).ok().map(|m| (m.dev(), m.ino()));
    for (i, (flag, out)) in outputs.iter().enumerate() {
        let out_id = id(out);
        if let Some((what, input)) = inputs
            .iter()
            .find(|(_, input)| out_id.is_some() && id(input) == out_id)
        {
            return Err(format!(
                "{flag} {} is the {what} ({}): writing there would destroy it; name another file",
                out.display(),
                input.display()
            ));
        }
        let same = |o: &Path| o == *out || (out_id.is_some() && id(o) == out_id);
        if let Some((other, _)) = outputs[..i].iter().find(|(_, o)| same(o)) {
            return Err(format!(
                "{flag} {} is also {other}: one would overwrite the other",
                out.display()
            ));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_failed_file_leaves_neither_temporaries_nor_the_other_files() {
        let dir = tempfile::tempdir().unwrap();
        let good = dir.path().join("report.json");
        std::fs::write(&good, "old").unwrap();
        // A directory in the way: the second file cannot be created.
        let bad = dir.path().join("missing").join("page.html");
        let err = write_whole(&[(&good, b"new"), (&bad, b"<html>")]).unwrap_err();
        assert_eq!(err.path, bad);
        assert_eq!(std::fs::read_to_string(&good).unwrap(), "old");
        let left: Vec<_> = std::fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        assert_eq!(left, vec!["report.json".to_string()], "{left:?}");
        // The control: both writable, both written.
        std::fs::create_dir(dir.path().join("missing")).unwrap();
        write_whole(&[(&good, b"new"), (&bad, b"<html>")]).unwrap();
        assert_eq!(std::fs::read_to_string(&good).unwrap(), "new");
        assert_eq!(std::fs::read_to_string(&bad).unwrap(), "<html>");
    }

    #[test]
    fn an_output_that_is_an_input_or_another_output_is_refused_by_any_spelling() {
        let dir = tempfile::tempdir().unwrap();
        let input = dir.path().join("e.trace");
        std::fs::write(&input, b"trace").unwrap();
        let link = dir.path().join("link.trace");
        std::os::unix::fs::symlink(&input, &link).unwrap();
        let dotted = dir.path().join(".").join("e.trace");
        for out in [&input, &link, &dotted] {
            let e = refuse_clobbering(&[("--html", out)], &[("reference", &input)]).unwrap_err();
            assert!(
                e.contains("is the reference") && e.contains("destroy"),
                "{e}"
            );
        }
        let fresh = dir.path().join("report.html");
        assert_eq!(
            refuse_clobbering(&[("--html", &fresh)], &[("reference", &input)]),
            Ok(())
        );
        let e = refuse_clobbering(&[("--report", &fresh), ("--html", &fresh)], &[]).unwrap_err();
        assert!(e.contains("--html") && e.contains("also --report"), "{e}");
        assert_eq!(std::fs::read(&input).unwrap(), b"trace");
    }
}

/// Control characters (but the newline), bidirectional-formatting characters and the other
/// invisible format characters (Unicode's Cf: zero-width spaces and joiners, the soft hyphen,
/// the byte-order mark, the tag characters, …). Text that comes from outside — a producer's
/// stderr, names, attributes and provenance read from files — could with them move the cursor,
/// clear, retitle or recolour a terminal, reorder what it or a browser shows, or make two
/// different names look the same.
pub fn needs_escape(c: char) -> bool {
    (c.is_control() && c != '\n')
        || matches!(c,
            '\u{00ad}' | '\u{0600}'..='\u{0605}' | '\u{061c}' | '\u{06dd}' | '\u{070f}'
            | '\u{0890}'..='\u{0891}' | '\u{08e2}' | '\u{180e}' | '\u{200b}'..='\u{200f}'
            | '\u{202a}'..='\u{202e}' | '\u{2060}'..='\u{2064}' | '\u{2066}'..='\u{206f}'
            | '\u{feff}' | '\u{fff9}'..='\u{fffb}' | '\u{110bd}' | '\u{110cd}'
            | '\u{13430}'..='\u{1343f}' | '\u{1bca0}'..='\u{1bca3}' | '\u{1d173}'..='\u{1d17a}'
            | '\u{e0001}' | '\u{e0020}'..='\u{e007f}')
}

/// Text a producer wrote (its stderr, or stdout when it said nothing else), as the gate prints
/// and reports it: every character [`needs_escape`] names but the tab is written visibly as
/// `\u{1b}` (ESC), so a clear-screen, a window title or a colour reaches no terminal, and a
/// carriage return cannot overwrite a line already shown. Lines and tabs stay. Applying it twice
/// changes nothing more.
pub fn printable(s: &str) -> Cow<'_, str> {
    let escaped = |c: char| c != '\t' && needs_escape(c);
    if !s.chars().any(escaped) {
        return Cow::Borrowed(s);
    }
    let mut out = String::with_capacity(s.len() + 16);
    for c in s.chars() {
        if escaped(c) {
            out.push_str(&format!("\\u{{{:x}}}", c as u32));
        } else {
            out.push(c);
        }
    }
    Cow::Owned(out)
}

#[cfg(test)]
mod printable_tests {
    use super::printable;

    #[test]
    fn control_sequences_are_shown_not_obeyed_and_lines_and_tabs_stay() {
        let raw = "\u{1b}[2J\u{1b}]0;pwned\u{7}red \u{1b}[31mX\u{1b}[0m\tok\nline\rover\u{7f}\u{9b}2J\u{202e}";
        let shown = printable(raw);
        assert_eq!(
            shown,
            "\\u{1b}[2J\\u{1b}]0;pwned\\u{7}red \\u{1b}[31mX\\u{1b}[0m\tok\nline\\u{d}over\\u{7f}\\u{9b}2J\\u{202e}"
        );
        assert!(!shown
            .chars()
            .any(|c| c.is_control() && c != '\n' && c != '\t'));
        // Once is enough: the escapes hold nothing to escape.
        assert_eq!(printable(&shown), shown);
        // Plain text is not copied.
        assert!(matches!(
            printable("a\tb\nc"),
            std::borrow::Cow::Borrowed(_)
        ));
    }
}
