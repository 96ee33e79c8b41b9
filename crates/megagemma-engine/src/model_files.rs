//! What a front end needs beside the weights: the tokenizer, the chat template and the
//! generation defaults, read from a checkpoint directory or a GGUF file's metadata.

use crate::chat_template::ChatTemplate;
use crate::sampling::{read_generation_config, GenerationDefaults};
use crate::tokenizer::Tokenizer;
use anyhow::Result;
use megagemma_model::config::Family;
use megagemma_model::gguf::GgufFile;
use megagemma_model::quant::load::QuantMode;
use megagemma_model::Model;
use std::path::Path;

/// [`Model::load_with`] with a spinner on a terminal (loading is quick for a memory-mapped
/// checkpoint, longer when quantizing on load). `cpu_only`: only a CPU backend will run the
/// model, so its matrices are laid out for the CPU kernels now and keep no other layout
/// ([`megagemma_model::weights::ModelWeights::keep_cpu_layouts_only`]: a 4-bit model is not held
/// twice).
pub fn load_model(path: &Path, quant: QuantMode, cpu_only: bool) -> Result<Model> {
    let what =
        if quant == QuantMode::Stored { "loading".to_string() } else { format!("loading and quantizing to {quant}") };
    let spinner = crate::progress::spinner(format!("{what} {}", path.display()));
    let model = Model::load_with(path, quant).map(|mut m| {
        if cpu_only {
            m.weights.keep_cpu_layouts_only();
        }
        m
    });
    crate::progress::finish(spinner);
    Ok(model?)
}

pub fn is_gguf(path: &Path) -> bool {
    path.is_file() && path.extension().is_some_and(|e| e.eq_ignore_ascii_case("gguf"))
}

/// `tokenizer.json` in a checkpoint directory, or the tokenizer stored in the GGUF file's metadata.
pub fn load_tokenizer(model: &Path, gguf: Option<&GgufFile>) -> Result<Option<Tokenizer>> {
    if let Some(file) = gguf {
        if !crate::gguf_tokenizer::gguf_has_tokenizer(file) {
            return Ok(None);
        }
        return Ok(Some(crate::gguf_tokenizer::tokenizer_from_gguf(file)?));
    }
    if model.join("tokenizer.json").exists() {
        return Ok(Some(Tokenizer::from_model_dir(model)?));
    }
    Ok(None)
}

/// The checkpoint's own chat template, else the built-in one for its family.
pub fn chat_template(model_path: &Path, gguf: Option<&GgufFile>, model: &Model) -> Result<ChatTemplate> {
    let Some(file) = gguf else {
        return ChatTemplate::from_model_dir(model_path);
    };
    if let Some(t) = file.get_str("tokenizer.chat_template") {
        return ChatTemplate::from_template(t, "<bos>", "<eos>");
    }
    Ok(match model.config.family {
        Family::Gemma3 => ChatTemplate::gemma3(),
        Family::Gemma4 => ChatTemplate::gemma4(),
    })
}

/// What text in or out needs beside the weights.
#[derive(Default)]
pub struct TextFiles {
    pub tokenizer: Option<Tokenizer>,
    /// The chat template, when asked for and a tokenizer exists.
    pub template: Option<ChatTemplate>,
}

/// The tokenizer of the model at `path` and, `with_template`, its chat template (a GGUF file's
/// both come from its metadata: parsed once here).
pub fn text_files(path: &Path, model: &Model, with_template: bool) -> Result<TextFiles> {
    let gguf = if is_gguf(path) { Some(GgufFile::open(path)?) } else { None };
    let tokenizer = load_tokenizer(path, gguf.as_ref())?;
    let template = match tokenizer {
        Some(_) if with_template => Some(chat_template(path, gguf.as_ref(), model)?),
        _ => None,
    };
    Ok(TextFiles { tokenizer, template })
}

/// A checkpoint directory's generation_config.json / config.json (errors reported, not
/// ignored); a GGUF file carries its stop ids in its metadata instead (see [`stop_ids`]).
pub fn generation_defaults(model_path: &Path) -> Result<GenerationDefaults> {
    if model_path.is_dir() {
        read_generation_config(model_path)
    } else {
        Ok(GenerationDefaults::default())
    }
}

/// Ids that end generation: the generation config's, else the model config's.
pub fn stop_ids(defaults: &GenerationDefaults, model: &Model) -> Vec<u32> {
    if defaults.eos_token_ids.is_empty() {
        model.config.eos_token_ids.clone()
    } else {
        defaults.eos_token_ids.clone()
    }
}

/// Runs `side` on a thread of its own while `main` runs on this one, and returns both results (on
/// two errors, `side`'s). Start-up builds the tokenizer this way while the backend opens: from a
/// GGUF file's metadata the tokenizer is the slower half of it (Gemma 3 270M on two cores: ~0.6 s
/// beside ~0.4 s of CPU weight layouts).
pub fn concurrently<A: Send, B>(
    side: impl FnOnce() -> Result<A> + Send,
    main: impl FnOnce() -> Result<B>,
) -> Result<(A, B)> {
    std::thread::scope(|s| {
        let side = s.spawn(side);
        let b = main();
        let a = side.join().unwrap_or_else(|panic| std::panic::resume_unwind(panic));
        Ok((a?, b?))
    })
}

/// Tokenizer, chat template and defaults of a model opened for chat (`serve`, `chat`).
pub struct ChatModel {
    pub tokenizer: Tokenizer,
    pub template: ChatTemplate,
    pub defaults: GenerationDefaults,
    pub stop_ids: Vec<u32>,
}

impl ChatModel {
    /// Everything beside the weights of the model at `path`; errors when it has no tokenizer.
    pub fn open(path: &Path, model: &Model) -> Result<ChatModel> {
        let TextFiles { tokenizer: Some(tokenizer), template: Some(template) } = text_files(path, model, true)? else {
            anyhow::bail!("no tokenizer found for {}: serving text needs tokenizer.json", path.display());
        };
        let defaults = generation_defaults(path)?;
        let stop_ids = stop_ids(&defaults, model);
        Ok(ChatModel { tokenizer, template, defaults, stop_ids })
    }
}

#[cfg(test)]
mod tests {
    use super::concurrently;
    use std::sync::mpsc;
    use std::time::Duration;

    #[test]
    fn both_sides_run_at_once_and_return_their_results() {
        // Each side waits for a message from the other: run one after the other, they would
        // time out instead.
        let (to_main, from_side) = mpsc::channel();
        let (to_side, from_main) = mpsc::channel();
        let (a, b) = concurrently(
            move || {
                to_main.send(1).unwrap();
                Ok(from_main.recv_timeout(Duration::from_secs(10))? + 10)
            },
            || {
                to_side.send(2).unwrap();
                Ok(from_side.recv_timeout(Duration::from_secs(10))? + 20)
            },
        )
        .unwrap();
        assert_eq!((a, b), (12, 21));
    }

    #[test]
    fn the_side_error_comes_first_and_the_main_one_otherwise() {
        let both = concurrently(
            || -> anyhow::Result<()> { anyhow::bail!("side") },
            || -> anyhow::Result<()> { anyhow::bail!("main") },
        );
        assert_eq!(both.unwrap_err().to_string(), "side");
        let main_only = concurrently(|| Ok(1), || -> anyhow::Result<()> { anyhow::bail!("main") });
        assert_eq!(main_only.unwrap_err().to_string(), "main");
    }
}
