//! The demo's live view of speculation: verified text as the answer, the draft's unverified tail
//! dimmed after it (on a terminal), each token the target rejected struck through in red before its
//! correction in green. Without a terminal only verified text is printed, and the corrections are
//! listed at the end.

use std::io::{IsTerminal, Write};

use crate::speculate::Shown;

pub struct Live<W: Write> {
    out: W,
    tty: bool,
    width: usize,
    /// Column after the last verified character.
    col: usize,
    /// Columns of tentative text on screen now, and that text.
    shown: usize,
    shown_text: String,
    next_is_correction: bool,
    pub corrections: Vec<(String, String)>,
}

const DIM: &str = "\x1b[2m";
const STRUCK_RED: &str = "\x1b[9;31m";
const GREEN: &str = "\x1b[32m";
const RESET: &str = "\x1b[0m";

impl Live<std::io::Stdout> {
    pub fn stdout() -> Self {
        let out = std::io::stdout();
        let tty = out.is_terminal();
        Self::new(out, tty, terminal_width())
    }
}

impl<W: Write> Live<W> {
    pub fn new(out: W, tty: bool, width: usize) -> Self {
        Self {
            out,
            tty,
            width: width.max(20),
            col: 0,
            shown: 0,
            shown_text: String::new(),
            next_is_correction: false,
            corrections: Vec::new(),
        }
    }

    /// Start the answer at column `col` (after a label).
    pub fn at_column(mut self, col: usize) -> Self {
        self.col = col;
        self
    }

    fn erase(&mut self) {
        if self.shown > 0 {
            let _ = write!(self.out, "\x1b[{}D\x1b[K", self.shown);
            self.shown = 0;
            self.shown_text.clear();
        }
    }

    fn advance(&mut self, text: &str) {
        for c in text.chars() {
            if c == '\n' {
                self.col = 0;
            } else {
                self.col = (self.col + 1) % self.width;
            }
        }
    }

    pub fn show(&mut self, s: Shown<'_>) {
        match s {
            Shown::Committed(t) => {
                self.erase();
                if self.tty && self.next_is_correction {
                    let _ = write!(self.out, "{GREEN}{t}{RESET}");
                } else {
                    let _ = write!(self.out, "{t}");
                }
                self.next_is_correction = false;
                self.advance(t);
            }
            Shown::Correction { draft, target } => {
                self.corrections
                    .push((draft.to_string(), target.to_string()));
                if self.tty {
                    self.erase();
                    let d = draft.replace('\n', "⏎");
                    let _ = write!(self.out, "{STRUCK_RED}{d}{RESET}");
                    self.advance(&d);
                    self.next_is_correction = true;
                }
            }
            Shown::Tentative(t) => {
                // Only what fits on this line, so that erasing it never has to cross lines.
                let room = self.width.saturating_sub(self.col + 1);
                let t: String = t.replace('\n', "⏎").chars().take(room).collect();
                if self.tty && t != self.shown_text {
                    self.erase();
                    let n = t.chars().count();
                    if n > 0 {
                        let _ = write!(self.out, "{DIM}{t}{RESET}");
                        self.shown = n;
                        self.shown_text = t;
                    }
                }
            }
        }
        let _ = self.out.flush();
    }

    /// Clear any tentative text (at the end of a run).
    pub fn finish(&mut self) {
        self.erase();
        let _ = self.out.flush();
    }
}

/// Columns of the terminal on stdout ($COLUMNS, else 80).
fn terminal_width() -> usize {
    std::env::var("COLUMNS")
        .ok()
        .and_then(|c| c.parse().ok())
        .unwrap_or(80)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tentative_text_is_erased_and_corrections_are_marked() {
        let mut buf = Vec::new();
        {
            let mut l = Live::new(&mut buf, true, 80);
            l.show(Shown::Committed("The capital"));
            l.show(Shown::Tentative(" of France was"));
            l.show(Shown::Committed(" of France"));
            l.show(Shown::Correction {
                draft: " was",
                target: " is",
            });
            l.show(Shown::Committed(" is"));
            l.finish();
            assert_eq!(l.corrections, vec![(" was".into(), " is".into())]);
        }
        let s = String::from_utf8(buf).unwrap();
        assert!(
            s.contains("\x1b[2m of France was\x1b[0m\x1b[14D\x1b[K"),
            "{s:?}"
        );
        assert!(s.contains("\x1b[9;31m was\x1b[0m"), "{s:?}");
        // Without a terminal only verified text is written.
        let mut plain = Vec::new();
        let mut l = Live::new(&mut plain, false, 80);
        l.show(Shown::Committed("A"));
        l.show(Shown::Tentative("BC"));
        l.show(Shown::Correction {
            draft: "B",
            target: "D",
        });
        l.show(Shown::Committed("D"));
        drop(l);
        assert_eq!(String::from_utf8(plain).unwrap(), "AD");
    }
}
