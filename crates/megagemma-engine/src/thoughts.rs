//! Gemma 4 thinking mode: the chat template turns it on (`enable_thinking`, which puts `<|think|>`
//! in the system turn), and the model then writes its reasoning in a thought channel,
//! `<|channel>thought\n…<channel|>`, before the answer. [`ThoughtSplitter`] tells, token by
//! token, which part of the output an id belongs to, so a front end can hide or set apart the
//! thoughts and keep only the answer in the conversation history.

use crate::chat_template::{ChatMessage, ChatTemplate};
use crate::tokenizer::Tokenizer;
use anyhow::{bail, Result};

/// Opens the thought channel.
pub const CHANNEL_OPEN: &str = "<|channel>";
/// Closes it.
pub const CHANNEL_CLOSE: &str = "<channel|>";

/// Where one generated token belongs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Part {
    /// The answer the user sees and the history keeps.
    Answer,
    /// Inside the thought channel (its name, `thought`, included).
    Thought,
    /// `<|channel>` or `<channel|>` itself.
    Marker,
}

/// Routes generated ids between the thought channel and the answer.
#[derive(Clone, Debug)]
pub struct ThoughtSplitter {
    open: Option<u32>,
    close: Option<u32>,
    inside: bool,
}

impl ThoughtSplitter {
    /// With the channel's ids from `tokenizer`; a tokenizer without them yields only answers.
    pub fn new(tokenizer: &Tokenizer) -> Self {
        Self::from_ids(tokenizer.token_to_id(CHANNEL_OPEN), tokenizer.token_to_id(CHANNEL_CLOSE))
    }

    pub fn from_ids(open: Option<u32>, close: Option<u32>) -> Self {
        ThoughtSplitter { open, close, inside: false }
    }

    /// Whether the next token would be inside the thought channel.
    pub fn in_thought(&self) -> bool {
        self.inside
    }

    pub fn route(&mut self, id: u32) -> Part {
        if Some(id) == self.open {
            self.inside = true;
            Part::Marker
        } else if Some(id) == self.close {
            self.inside = false;
            Part::Marker
        } else if self.inside {
            Part::Thought
        } else {
            Part::Answer
        }
    }
}

/// The template variables that turn thinking on, after checking that `template` reacts to
/// them (a template that ignores `enable_thinking` would silently not think).
pub fn thinking_context(template: &ChatTemplate) -> Result<serde_json::Value> {
    let probe = [ChatMessage::user("Hello")];
    let on = serde_json::json!({ "enable_thinking": true });
    if template.render_with(&probe, true, &on)? == template.render_with(&probe, true, serde_json::json!({}))? {
        bail!("this model's chat template has no thinking mode (it ignores enable_thinking): --think needs a Gemma 4 template");
    }
    Ok(on)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn splits_thoughts_from_the_answer() {
        // 7 = <|channel>, 8 = <channel|>
        let mut s = ThoughtSplitter::from_ids(Some(7), Some(8));
        let parts: Vec<Part> = [7, 1, 2, 3, 8, 4, 5].iter().map(|&t| s.route(t)).collect();
        use Part::*;
        assert_eq!(parts, [Marker, Thought, Thought, Thought, Marker, Answer, Answer]);
        assert!(!s.in_thought());
        // An unclosed channel (budget ran out while thinking) stays a thought.
        let mut s = ThoughtSplitter::from_ids(Some(7), Some(8));
        assert_eq!([1, 7, 2].map(|t| s.route(t)), [Answer, Marker, Thought]);
        assert!(s.in_thought());
        // No channel ids: everything is answer.
        let mut s = ThoughtSplitter::from_ids(None, None);
        assert_eq!([7, 8].map(|t| s.route(t)), [Answer, Answer]);
    }

    #[test]
    fn thinking_needs_a_template_that_uses_it() {
        let ctx = thinking_context(&ChatTemplate::gemma4()).unwrap();
        assert_eq!(ctx["enable_thinking"], true);
        let on = ChatTemplate::gemma4().render_with(&[ChatMessage::user("Hi")], true, &ctx).unwrap();
        assert!(on.contains("<|think|>"), "{on}");
        let e = thinking_context(&ChatTemplate::gemma3()).unwrap_err().to_string();
        assert!(e.contains("no thinking mode"), "{e}");
    }
}
