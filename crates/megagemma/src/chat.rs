//! `megagemma chat`: an interactive, streaming conversation in the terminal.

use crate::backend_args::{BackendArgs, QuantArgs};
use crate::sampling_args::SamplingArgs;
use anyhow::{Context, Result};
use clap::Args;
use megagemma_engine::backends::open_backend;
use megagemma_engine::chat_template::{encode_chat_with, ChatMessage};
use megagemma_engine::generate::{generate, DraftParams, GenerateParams};
use megagemma_engine::model_files::{concurrently, ChatModel};
use megagemma_engine::thoughts::{thinking_context, Part, ThoughtSplitter};
use rustyline::error::ReadlineError;
use std::io::{BufRead, IsTerminal, Write};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

#[derive(Args, Debug)]
pub struct ChatArgs {
    /// Model: a Hugging Face checkpoint directory, a .gguf file, or a name `megagemma pull` knows.
    #[arg(short, long)]
    pub model: PathBuf,
    /// System message for the conversation (change it with /system TEXT).
    #[arg(long)]
    pub system: Option<String>,
    /// Most tokens per answer.
    #[arg(short = 'n', long, default_value_t = 1024)]
    pub max_new_tokens: usize,
    /// Do not stop at end-of-sequence ids: every answer runs to --max-new-tokens (or Ctrl-C).
    #[arg(long)]
    pub ignore_eos: bool,
    #[command(flatten)]
    pub sampling: SamplingArgs,
    #[command(flatten)]
    pub weights: QuantArgs,
    #[command(flatten)]
    pub backend: BackendArgs,
    /// Gemma 4 thinking mode: the model reasons in a thought channel before answering (hidden
    /// unless --show-thoughts; never kept in the conversation).
    #[arg(long)]
    pub think: bool,
    /// With --think: print the thoughts (on stderr, so stdout holds only answers).
    #[arg(long, requires = "think")]
    pub show_thoughts: bool,
}

const HELP: &str = "Type a message and press Enter (end a line with \\ to continue it on the next).
Commands: /reset (forget the conversation), /system TEXT (set the system message), /quit.
Ctrl-C stops the current answer; Ctrl-D or /quit leaves. Up/Down recall earlier messages (in a terminal).";

pub fn chat(args: ChatArgs) -> Result<()> {
    let path = crate::run::resolve_model(&args.model)?;
    let opts = args.backend.options()?;
    let model = Arc::new(args.weights.load(&path, &opts)?);
    let (files, mut backend) = concurrently(|| ChatModel::open(&path, &model), || open_backend(model.clone(), &opts))?;
    // The host's weights live on only in a CPU backend: on CUDA their copy is given back here.
    drop(model);
    let template_vars = if args.think { thinking_context(&files.template)? } else { serde_json::json!({}) };
    let sampling = args.sampling.params(&files.defaults)?;
    let params = GenerateParams {
        max_new_tokens: args.max_new_tokens,
        sampling,
        stop_ids: files.stop_ids.clone(),
        ignore_eos: args.ignore_eos,
        keep_logits: false,
        draft: DraftParams::default(),
    };

    // Ctrl-C ends the answer being written, not the program.
    let interrupted = Arc::new(AtomicBool::new(false));
    let flag = interrupted.clone();
    ctrlc::set_handler(move || flag.store(true, Ordering::SeqCst)).context("cannot install the Ctrl-C handler")?;

    eprintln!("{HELP}");
    let mut system = args.system.clone();
    let mut history: Vec<ChatMessage> = Vec::new();
    let mut reader = LineReader::new();
    loop {
        let Some(input) = reader.read_message()? else { break };
        let input = input.trim();
        if input.is_empty() {
            continue;
        }
        match input {
            "/quit" | "/exit" => break,
            "/reset" => {
                history.clear();
                eprintln!("(conversation cleared)");
                continue;
            }
            "/help" => {
                eprintln!("{HELP}");
                continue;
            }
            _ => {}
        }
        if let Some(rest) = input.strip_prefix("/system") {
            system = Some(rest.trim().to_string()).filter(|s| !s.is_empty());
            history.clear();
            eprintln!("(system message {}; conversation cleared)", if system.is_some() { "set" } else { "removed" });
            continue;
        }
        if input.starts_with('/') {
            eprintln!("unknown command `{input}` (/help lists them)");
            continue;
        }

        history.push(ChatMessage::user(input));
        let mut messages: Vec<ChatMessage> = system.iter().map(|s| ChatMessage::system(s.clone())).collect();
        messages.extend(history.iter().cloned());
        let prompt = encode_chat_with(&files.tokenizer, &files.template, &messages, &template_vars)?;
        interrupted.store(false, Ordering::SeqCst);
        // Answer and thoughts decode separately: a thought's last bytes never leak into the answer.
        let mut stream = files.tokenizer.stream_decoder(true);
        let mut thought_stream = files.tokenizer.stream_decoder(true);
        let mut splitter = ThoughtSplitter::new(&files.tokenizer);
        let mut answer_ids: Vec<u32> = Vec::new();
        let mut thought_tokens = 0usize;
        let stdout = std::io::stdout();
        let result = generate(backend.as_mut(), &prompt, &params, |tok| {
            if files.stop_ids.contains(&tok) {
                return !interrupted.load(Ordering::SeqCst);
            }
            match splitter.route(tok) {
                Part::Answer => {
                    answer_ids.push(tok);
                    if let Ok(Some(piece)) = stream.step(tok) {
                        let mut out = stdout.lock();
                        let _ = out.write_all(piece.as_bytes());
                        let _ = out.flush();
                    }
                }
                Part::Thought => {
                    thought_tokens += 1;
                    if args.show_thoughts {
                        if let Ok(Some(piece)) = thought_stream.step(tok) {
                            eprint!("{piece}");
                        }
                    }
                }
                Part::Marker if splitter.in_thought() => {
                    thought_stream = files.tokenizer.stream_decoder(true);
                    eprint!("{}", if args.show_thoughts { "[thinking] " } else { "(thinking...)" });
                }
                Part::Marker => {
                    if args.show_thoughts {
                        if let Ok(Some(rest)) = thought_stream.flush() {
                            eprint!("{rest}");
                        }
                        eprintln!("\n[/thinking]");
                    } else {
                        eprintln!(" ({thought_tokens} thought tokens)");
                    }
                }
            }
            !interrupted.load(Ordering::SeqCst)
        });
        let gen = match result {
            Ok(g) => g,
            Err(e) => {
                // A conversation past the context, say: report it and keep the REPL going.
                history.pop();
                eprintln!("error: {e:#}");
                continue;
            }
        };
        if let Some(rest) = stream.flush()? {
            print!("{rest}");
        }
        println!();
        if splitter.in_thought() {
            eprintln!("\n(the answer ended inside the thought channel: raise -n for a longer budget)");
        }
        history.push(ChatMessage::assistant(files.tokenizer.decode(&answer_ids, true)?));
        let stopped = if interrupted.load(Ordering::SeqCst) { " (stopped)" } else { "" };
        eprintln!("[{} tokens, {:.1} tok/s{stopped}]", gen.ids.len(), gen.decode_tokens_per_second());
    }
    Ok(())
}

/// Standard input, read with line editing and history (Up/Down, kept across runs in the
/// megagemma cache) when it, stdout and stderr are a terminal, else line by line.
enum LineReader {
    Editor { editor: Box<rustyline::DefaultEditor>, history: Option<PathBuf> },
    Plain(std::io::Lines<std::io::StdinLock<'static>>),
}

impl LineReader {
    fn new() -> LineReader {
        // The editor draws on stdout: only when answers are not being redirected.
        if std::io::stdin().is_terminal() && std::io::stdout().is_terminal() && std::io::stderr().is_terminal() {
            if let Ok(mut editor) = rustyline::DefaultEditor::new() {
                let history = megagemma_engine::pull::cache_dir().ok().map(|d| d.join("chat_history"));
                if let Some(h) = &history {
                    let _ = editor.load_history(h);
                }
                return LineReader::Editor { editor: Box::new(editor), history };
            }
        }
        LineReader::Plain(std::io::stdin().lock().lines())
    }

    /// One message: a line, or several joined when each but the last ends with `\`. `None` at
    /// end of input.
    fn read_message(&mut self) -> Result<Option<String>> {
        match self {
            LineReader::Plain(lines) => read_message(lines),
            LineReader::Editor { editor, history } => {
                let mut message = String::new();
                loop {
                    let prompt = if message.is_empty() { "> " } else { ". " };
                    match editor.readline(prompt) {
                        Ok(line) => match line.strip_suffix('\\') {
                            Some(part) => {
                                message.push_str(part);
                                message.push('\n');
                            }
                            None => {
                                message.push_str(&line);
                                if !message.trim().is_empty() {
                                    let _ = editor.add_history_entry(message.as_str());
                                    if let Some(h) = history {
                                        if let Some(dir) = h.parent() {
                                            let _ = std::fs::create_dir_all(dir);
                                        }
                                        let _ = editor.save_history(h);
                                    }
                                }
                                return Ok(Some(message));
                            }
                        },
                        // Ctrl-C at the prompt drops what was typed.
                        Err(ReadlineError::Interrupted) => message.clear(),
                        Err(ReadlineError::Eof) => return Ok((!message.is_empty()).then_some(message)),
                        Err(e) => return Err(e).context("cannot read the terminal"),
                    }
                }
            }
        }
    }
}

/// One message: a line, or several joined when each but the last ends with `\`. `None` at
/// end of input.
fn read_message(lines: &mut impl Iterator<Item = std::io::Result<String>>) -> Result<Option<String>> {
    let mut out = std::io::stderr();
    let _ = write!(out, "> ");
    let _ = out.flush();
    let mut message = String::new();
    loop {
        let Some(line) = lines.next() else {
            return Ok((!message.is_empty()).then_some(message));
        };
        let line = line.context("cannot read standard input")?;
        match line.strip_suffix('\\') {
            Some(part) => {
                message.push_str(part);
                message.push('\n');
                let _ = write!(out, ". ");
                let _ = out.flush();
            }
            None => {
                message.push_str(&line);
                return Ok(Some(message));
            }
        }
    }
}
