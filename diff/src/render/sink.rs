//! The human report's writer: text streamed to a writer, made terminal-safe on the way.

use std::fmt::Write;

use super::escape::terminal_safe;

/// Text on its way to a writer, made [`terminal_safe`] and flushed every 64 KiB at a line end,
/// so a report of a million rows never sits in memory whole. The first write error is kept.
pub(super) struct Sink<'a> {
    buf: String,
    out: &'a mut dyn std::io::Write,
    error: Option<std::io::Error>,
}

impl<'a> Sink<'a> {
    pub(super) fn new(out: &'a mut dyn std::io::Write) -> Self {
        Sink {
            buf: String::new(),
            out,
            error: None,
        }
    }
    fn flush(&mut self) {
        if self.error.is_none() {
            if let Err(e) = self.out.write_all(terminal_safe(&self.buf).as_bytes()) {
                self.error = Some(e);
            }
        }
        self.buf.clear();
    }
    pub(super) fn finish(mut self) -> std::io::Result<()> {
        self.flush();
        match self.error.take() {
            Some(e) => Err(e),
            None => self.out.flush(),
        }
    }
}

impl Write for Sink<'_> {
    fn write_str(&mut self, s: &str) -> std::fmt::Result {
        self.buf.push_str(s);
        if self.buf.len() >= 1 << 16 && self.buf.ends_with('\n') {
            self.flush();
        }
        Ok(())
    }
}
