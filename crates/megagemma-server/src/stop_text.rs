//! Stop strings on detokenized text. Text that could still be the start of a stop string is
//! held back, so a stop string is never streamed to the client, even when split across tokens.

pub struct StopText {
    stops: Vec<String>,
    /// Generated text not yet released.
    held: String,
}

/// Text to release now, and whether a stop string ended the output.
pub struct Released {
    pub text: String,
    pub stopped: bool,
}

impl StopText {
    pub fn new(stops: Vec<String>) -> Self {
        StopText { stops, held: String::new() }
    }

    /// Adds a piece of output text.
    pub fn push(&mut self, piece: &str) -> Released {
        self.held.push_str(piece);
        if let Some(at) = self.stops.iter().filter_map(|s| self.held.find(s.as_str())).min() {
            let text = self.held[..at].to_string();
            self.held.clear();
            return Released { text, stopped: true };
        }
        let keep = self.unsafe_suffix_start();
        let text = self.held[..keep].to_string();
        self.held.replace_range(..keep, "");
        Released { text, stopped: false }
    }

    /// The text still held back, when the output ends for another reason.
    pub fn finish(&mut self) -> String {
        std::mem::take(&mut self.held)
    }

    /// Start of the longest suffix of `held` that begins some stop string.
    fn unsafe_suffix_start(&self) -> usize {
        let held = self.held.as_str();
        held.char_indices()
            .map(|(i, _)| i)
            .find(|&i| self.stops.iter().any(|s| s.starts_with(&held[i..])))
            .unwrap_or(held.len())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(stops: &[&str], pieces: &[&str]) -> (String, bool) {
        let mut st = StopText::new(stops.iter().map(|s| s.to_string()).collect());
        let mut out = String::new();
        for p in pieces {
            let r = st.push(p);
            out.push_str(&r.text);
            if r.stopped {
                return (out, true);
            }
        }
        out.push_str(&st.finish());
        (out, false)
    }

    #[test]
    fn stop_split_across_pieces_is_never_released() {
        assert_eq!(run(&["END"], &["abc E", "N", "D tail"]), ("abc ".to_string(), true));
    }

    #[test]
    fn a_false_start_is_released_later() {
        let mut st = StopText::new(vec!["END".into()]);
        assert_eq!(st.push("x EN").text, "x ");
        assert_eq!(st.push("O").text, "ENO");
    }

    #[test]
    fn no_stop_releases_everything() {
        assert_eq!(run(&["zz"], &["héllo ", "wörld z"]), ("héllo wörld z".to_string(), false));
        assert_eq!(run(&[], &["a", "b"]), ("ab".to_string(), false));
    }

    #[test]
    fn earliest_of_several_stops_wins() {
        assert_eq!(run(&["cd", "b"], &["abcd"]), ("a".to_string(), true));
    }
}
