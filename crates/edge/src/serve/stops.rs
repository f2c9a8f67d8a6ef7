//! Stop sequences over streamed text: text is let out only where no stop sequence can still begin
//! in it, and the first stop sequence that appears ends the answer before it (OpenAI's `stop`).

/// See the module docs.
#[derive(Debug, Clone, Default)]
pub struct Stops {
    stops: Vec<String>,
    /// Text taken but not yet let out (it could be the start of a stop sequence).
    held: String,
    stopped: bool,
}

impl Stops {
    pub fn new(stops: Vec<String>) -> Self {
        Self {
            stops: stops.into_iter().filter(|s| !s.is_empty()).collect(),
            held: String::new(),
            stopped: false,
        }
    }

    /// Whether a stop sequence appeared.
    pub fn stopped(&self) -> bool {
        self.stopped
    }

    /// Take `text`; returns what may be shown now. After a stop sequence nothing more is.
    pub fn push(&mut self, text: &str) -> String {
        if self.stopped {
            return String::new();
        }
        self.held.push_str(text);
        if let Some(at) = self
            .stops
            .iter()
            .filter_map(|s| self.held.find(s.as_str()))
            .min()
        {
            self.stopped = true;
            let out = self.held[..at].to_string();
            self.held.clear();
            return out;
        }
        // Hold back the longest tail of the text that begins a stop sequence.
        let keep = self
            .stops
            .iter()
            .flat_map(|s| {
                (1..s.len())
                    .filter(|&k| s.is_char_boundary(k))
                    .filter(|&k| self.held.ends_with(&s[..k]))
            })
            .max()
            .unwrap_or(0);
        let cut = self.held.len() - keep;
        let out = self.held[..cut].to_string();
        self.held.drain(..cut);
        out
    }

    /// The end of the answer: what was held back is text after all.
    pub fn finish(&mut self) -> String {
        std::mem::take(&mut self.held)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn text_is_held_only_while_a_stop_could_begin_and_cut_at_the_first_stop() {
        let mut s = Stops::new(vec!["END".into(), "\n\n".into()]);
        assert_eq!(s.push("Hello E"), "Hello ");
        assert_eq!(s.push("N"), "");
        assert_eq!(s.push("x wor"), "ENx wor");
        assert_eq!(s.push("ld\n"), "ld");
        assert_eq!(s.push("\nmore"), "");
        assert!(s.stopped());
        assert_eq!(s.push("after"), "");
        let mut s = Stops::new(vec!["END".into()]);
        assert_eq!(s.push("a b EN"), "a b ");
        assert_eq!(s.finish(), "EN", "no stop came: the held text is text");
        let mut none = Stops::new(vec![]);
        assert_eq!(none.push("anything"), "anything");
    }
}
