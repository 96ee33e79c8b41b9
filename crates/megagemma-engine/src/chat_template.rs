//! HuggingFace-style Jinja chat templates rendered with minijinja.
//!
//! The environment mimics `transformers`' `apply_chat_template`: `trim_blocks` and
//! `lstrip_blocks`, `raise_exception`, `strftime_now`, a Python-`json.dumps`-compatible
//! `tojson`, loop controls and Python string/dict methods.

use std::path::{Path, PathBuf};

use anyhow::{anyhow, bail, Result};
use minijinja::value::Kwargs;
use minijinja::{context, Environment, Error as JinjaError, ErrorKind, Value};
use serde::{Deserialize, Serialize};

use crate::tokenizer::Tokenizer;

/// Gemma 4 turn format (spec §7), used when a model directory ships no template.
/// The system turn appears only for a leading system/developer message or `enable_thinking`;
/// thinking blocks (`<|channel>…<channel|>`) are stripped from earlier model answers.
/// Gemma 3's turn format (`<start_of_turn>` / `<end_of_turn>`); a system message is folded
/// into the first user turn, as Gemma 3 has no system role. Used for checkpoints that ship no
/// template of their own (GGUF files without `tokenizer.chat_template`).
pub const GEMMA3_TEMPLATE: &str = r#"{{- bos_token -}}
{%- set first_user_prefix = (messages[0]['content'] | trim) ~ '\n\n' if messages and messages[0]['role'] == 'system' else '' -%}
{%- for message in messages if message['role'] != 'system' -%}
    {%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}
    {{- '<start_of_turn>' ~ role ~ '\n' ~ (first_user_prefix if loop.first else '') ~ (message['content'] | trim) ~ '<end_of_turn>\n' -}}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- '<start_of_turn>model\n' -}}{%- endif -%}
"#;

pub const GEMMA4_TEMPLATE: &str = r#"{{- bos_token -}}
{%- set has_system = messages and messages[0]['role'] in ['system', 'developer'] -%}
{%- if has_system or enable_thinking -%}
    {{- '<|turn>system\n' -}}
    {%- if enable_thinking -%}{{- '<|think|>\n' -}}{%- endif -%}
    {%- if has_system -%}{{- messages[0]['content'] | trim -}}{%- endif -%}
    {{- '<turn|>\n' -}}
{%- endif -%}
{%- for message in (messages[1:] if has_system else messages) -%}
    {%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}
    {%- set ns = namespace(content=message['content']) -%}
    {%- if role == 'model' -%}
        {#- Keep text outside <|channel>…<channel|> blocks. -#}
        {%- set ns.content = '' -%}
        {%- for part in message['content'] | split('<channel|>') -%}
            {%- set ns.content = ns.content ~ (part | split('<|channel>') | first) -%}
        {%- endfor -%}
    {%- endif -%}
    {{- '<|turn>' ~ role ~ '\n' ~ (ns.content | trim) ~ '<turn|>\n' -}}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- '<|turn>model\n' -}}{%- endif -%}
"#;

const TEMPLATE_NAME: &str = "chat";

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChatMessage {
    pub role: String,
    pub content: String,
}

impl ChatMessage {
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> Self {
        Self { role: role.into(), content: content.into() }
    }
    pub fn system(content: impl Into<String>) -> Self {
        Self::new("system", content)
    }
    pub fn user(content: impl Into<String>) -> Self {
        Self::new("user", content)
    }
    pub fn assistant(content: impl Into<String>) -> Self {
        Self::new("assistant", content)
    }
}

/// Where the template text came from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum TemplateSource {
    JinjaFile(PathBuf),
    TokenizerConfig(PathBuf),
    BuiltinGemma4,
    Inline,
}

pub struct ChatTemplate {
    env: Environment<'static>,
    source: TemplateSource,
    bos_token: String,
    eos_token: String,
}

impl std::fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChatTemplate")
            .field("source", &self.source)
            .field("bos_token", &self.bos_token)
            .field("eos_token", &self.eos_token)
            .finish()
    }
}

impl ChatTemplate {
    /// Loads `chat_template.jinja`, else `chat_template` from `tokenizer_config.json`, else the
    /// built-in Gemma 4 template. BOS/EOS texts come from `tokenizer_config.json`
    /// (default `<bos>`/`<eos>`).
    pub fn from_model_dir(dir: impl AsRef<Path>) -> Result<Self> {
        let dir = dir.as_ref();
        let config_path = dir.join("tokenizer_config.json");
        let config = crate::json_file::read_json_if_present(&config_path)?;
        let bos = config.as_ref().and_then(|c| special_token_text(c, "bos_token")).unwrap_or("<bos>".into());
        let eos = config.as_ref().and_then(|c| special_token_text(c, "eos_token")).unwrap_or("<eos>".into());

        let jinja_path = dir.join("chat_template.jinja");
        if jinja_path.is_file() {
            let text = std::fs::read_to_string(&jinja_path)
                .map_err(|e| anyhow!("cannot read {}: {e}", jinja_path.display()))?;
            return Self::build(text, TemplateSource::JinjaFile(jinja_path), bos, eos);
        }
        if let Some(config) = &config {
            if let Some(text) = template_from_config(config, &config_path)? {
                return Self::build(text, TemplateSource::TokenizerConfig(config_path), bos, eos);
            }
        }
        Self::build(GEMMA4_TEMPLATE.to_string(), TemplateSource::BuiltinGemma4, bos, eos)
    }

    /// Compiles template text; errors (one line) on a syntax error.
    pub fn from_template(
        template: impl Into<String>,
        bos_token: impl Into<String>,
        eos_token: impl Into<String>,
    ) -> Result<Self> {
        Self::build(template.into(), TemplateSource::Inline, bos_token.into(), eos_token.into())
    }

    /// The built-in Gemma 4 template with `<bos>`/`<eos>`.
    /// The built-in Gemma 3 template ([`GEMMA3_TEMPLATE`]).
    pub fn gemma3() -> Self {
        Self::build(GEMMA3_TEMPLATE.to_string(), TemplateSource::Inline, "<bos>".into(), "<eos>".into())
            .expect("built-in Gemma 3 template compiles")
    }

    pub fn gemma4() -> Self {
        Self::build(GEMMA4_TEMPLATE.to_string(), TemplateSource::BuiltinGemma4, "<bos>".into(), "<eos>".into())
            .expect("built-in Gemma 4 template compiles")
    }

    pub fn source(&self) -> &TemplateSource {
        &self.source
    }

    pub fn bos_token(&self) -> &str {
        &self.bos_token
    }

    pub fn eos_token(&self) -> &str {
        &self.eos_token
    }

    /// Renders the conversation to prompt text.
    ///
    /// The result usually starts with the BOS token text (`<bos>`): encode it with
    /// `add_special_tokens = false`, or the tokenizer adds a second BOS. [`encode_chat`] does this.
    pub fn render(&self, messages: &[ChatMessage], add_generation_prompt: bool) -> Result<String> {
        self.render_with(messages, add_generation_prompt, ())
    }

    /// Like [`render`](Self::render) with extra template variables, e.g.
    /// `serde_json::json!({"enable_thinking": true})` or `tools`.
    pub fn render_with(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
        extra: impl Serialize,
    ) -> Result<String> {
        let template = self.env.get_template(TEMPLATE_NAME).expect("template added in build");
        let ctx = context! {
            messages => messages,
            add_generation_prompt => add_generation_prompt,
            bos_token => &self.bos_token,
            eos_token => &self.eos_token,
            ..Value::from_serialize(extra)
        };
        template.render(ctx).map_err(|e| anyhow!("chat template ({}) failed to render: {e}", self.source_label()))
    }

    fn build(text: String, source: TemplateSource, bos_token: String, eos_token: String) -> Result<Self> {
        let mut env = hf_environment();
        let label = source_label(&source);
        env.add_template_owned(TEMPLATE_NAME, text).map_err(|e| anyhow!("invalid chat template ({label}): {e}"))?;
        Ok(Self { env, source, bos_token, eos_token })
    }

    fn source_label(&self) -> String {
        source_label(&self.source)
    }
}

/// Renders the conversation with a generation prompt and encodes it, with exactly one leading
/// BOS: special tokens are added only when the template itself did not emit the BOS text.
pub fn encode_chat(tokenizer: &Tokenizer, template: &ChatTemplate, messages: &[ChatMessage]) -> Result<Vec<u32>> {
    encode_chat_with(tokenizer, template, messages, ())
}

/// [`encode_chat`] with extra template variables (e.g. `{"enable_thinking": true}`).
pub fn encode_chat_with(
    tokenizer: &Tokenizer,
    template: &ChatTemplate,
    messages: &[ChatMessage],
    extra: impl Serialize,
) -> Result<Vec<u32>> {
    let prompt = template.render_with(messages, true, extra)?;
    let bos = template.bos_token();
    let template_has_bos = !bos.is_empty() && prompt.starts_with(bos);
    let mut ids = tokenizer.encode(&prompt, !template_has_bos)?;
    // Guard against a template whose BOS text differs from the tokenizer's idea of it.
    if let Some(bos_id) = tokenizer.token_to_id(bos) {
        while ids.len() >= 2 && ids[0] == bos_id && ids[1] == bos_id {
            ids.remove(0);
        }
    }
    Ok(ids)
}

fn source_label(source: &TemplateSource) -> String {
    match source {
        TemplateSource::JinjaFile(p) | TemplateSource::TokenizerConfig(p) => p.display().to_string(),
        TemplateSource::BuiltinGemma4 => "built-in Gemma 4".into(),
        TemplateSource::Inline => "inline".into(),
    }
}

/// `bos_token` etc. are either a string or an AddedToken object with a `content` field.
fn special_token_text(config: &serde_json::Value, key: &str) -> Option<String> {
    let value = config.get(key)?;
    value.as_str().or_else(|| value.get("content")?.as_str()).map(str::to_string)
}

/// `chat_template` is a string or a list of `{name, template}`; the list's "default" is used.
fn template_from_config(config: &serde_json::Value, path: &Path) -> Result<Option<String>> {
    match config.get("chat_template") {
        None | Some(serde_json::Value::Null) => Ok(None),
        Some(serde_json::Value::String(text)) => Ok(Some(text.clone())),
        Some(serde_json::Value::Array(items)) => items
            .iter()
            .find(|item| item.get("name").and_then(|n| n.as_str()) == Some("default"))
            .and_then(|item| item.get("template")?.as_str().map(str::to_string))
            .map(Some)
            .ok_or_else(|| anyhow!("no template named \"default\" in the chat_template list of {}", path.display())),
        Some(_) => bail!("chat_template in {} must be a string or a list of {{name, template}}", path.display()),
    }
}

/// An environment configured like transformers' `_compile_jinja_template`.
fn hf_environment() -> Environment<'static> {
    let mut env = Environment::new();
    env.set_trim_blocks(true);
    env.set_lstrip_blocks(true);
    env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
    env.add_function("raise_exception", raise_exception);
    env.add_function("strftime_now", strftime_now);
    env.add_filter("tojson", tojson);
    env
}

fn raise_exception(message: String) -> Result<Value, JinjaError> {
    Err(JinjaError::new(ErrorKind::InvalidOperation, message))
}

/// Current UTC time formatted with a subset of Python's `strftime` codes.
fn strftime_now(format: String) -> String {
    let secs = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0);
    strftime(&format, secs)
}

const MONTHS: [&str; 12] = [
    "January",
    "February",
    "March",
    "April",
    "May",
    "June",
    "July",
    "August",
    "September",
    "October",
    "November",
    "December",
];
const WEEKDAYS: [&str; 7] = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"];

/// Formats a Unix time (UTC). Supports %Y %y %m %d %e %H %I %M %S %p %j %B %b %A %a %%;
/// unknown codes are kept verbatim. Public for testing.
pub fn strftime(format: &str, unix_secs: u64) -> String {
    let days = (unix_secs / 86_400) as i64;
    let secs_of_day = unix_secs % 86_400;
    let (year, month, day) = civil_from_days(days);
    let (hour, minute, second) = (secs_of_day / 3600, secs_of_day / 60 % 60, secs_of_day % 60);
    let weekday = ((days + 3).rem_euclid(7)) as usize; // 1970-01-01 was a Thursday (index 3).
    let day_of_year = days - days_from_civil(year, 1, 1) + 1;
    let hour12 = if hour % 12 == 0 { 12 } else { hour % 12 };

    let mut out = String::new();
    let mut chars = format.chars();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        match chars.next() {
            Some('Y') => out.push_str(&year.to_string()),
            Some('y') => out.push_str(&format!("{:02}", year.rem_euclid(100))),
            Some('m') => out.push_str(&format!("{month:02}")),
            Some('d') => out.push_str(&format!("{day:02}")),
            Some('e') => out.push_str(&format!("{day:>2}")),
            Some('H') => out.push_str(&format!("{hour:02}")),
            Some('I') => out.push_str(&format!("{hour12:02}")),
            Some('M') => out.push_str(&format!("{minute:02}")),
            Some('S') => out.push_str(&format!("{second:02}")),
            Some('p') => out.push_str(if hour < 12 { "AM" } else { "PM" }),
            Some('j') => out.push_str(&format!("{day_of_year:03}")),
            Some('B') => out.push_str(MONTHS[month as usize - 1]),
            Some('b') => out.push_str(&MONTHS[month as usize - 1][..3]),
            Some('A') => out.push_str(WEEKDAYS[weekday]),
            Some('a') => out.push_str(&WEEKDAYS[weekday][..3]),
            Some('%') => out.push('%'),
            Some(other) => {
                out.push('%');
                out.push(other);
            }
            None => out.push('%'),
        }
    }
    out
}

/// Howard Hinnant's days → (year, month, day) in the proleptic Gregorian calendar.
fn civil_from_days(days: i64) -> (i64, u32, u32) {
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let month = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    let year = yoe + era * 400 + i64::from(month <= 2);
    (year, month, day)
}

fn days_from_civil(year: i64, month: u32, day: u32) -> i64 {
    let y = if month <= 2 { year - 1 } else { year };
    let era = y.div_euclid(400);
    let yoe = y.rem_euclid(400);
    let m = month as i64;
    let doy = (153 * (if m > 2 { m - 3 } else { m + 9 }) + 2) / 5 + day as i64 - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

/// `tojson` as transformers defines it: Python `json.dumps(ensure_ascii=False)` — separators
/// `", "`/`": "`, no HTML escaping (minijinja's built-in escapes `<`, which would corrupt
/// tool schemas and special tokens).
fn tojson(value: &Value, kwargs: Kwargs) -> Result<Value, JinjaError> {
    let indent: Option<usize> = kwargs.get("indent")?;
    let sort_keys: Option<bool> = kwargs.get("sort_keys")?;
    let ensure_ascii: Option<bool> = kwargs.get("ensure_ascii")?;
    kwargs.assert_all_used()?;
    let to_err =
        |e: serde_json::Error| JinjaError::new(ErrorKind::InvalidOperation, "cannot serialize to JSON").with_source(e);

    let mut out = Vec::new();
    if sort_keys == Some(true) {
        let mut json = serde_json::to_value(value).map_err(to_err)?;
        json.sort_all_objects();
        write_json(&json, indent, &mut out).map_err(to_err)?;
    } else {
        write_json(value, indent, &mut out).map_err(to_err)?;
    }
    let mut text = String::from_utf8(out).expect("serde_json writes UTF-8");
    if ensure_ascii == Some(true) {
        text = escape_non_ascii(&text);
    }
    Ok(Value::from_safe_string(text))
}

fn write_json(value: &impl Serialize, indent: Option<usize>, out: &mut Vec<u8>) -> serde_json::Result<()> {
    match indent {
        Some(n) => {
            let indent = " ".repeat(n);
            let formatter = serde_json::ser::PrettyFormatter::with_indent(indent.as_bytes());
            value.serialize(&mut serde_json::Serializer::with_formatter(out, formatter))
        }
        None => value.serialize(&mut serde_json::Serializer::with_formatter(out, PythonCompactFormatter)),
    }
}

/// Python's default `json.dumps` separators: `", "` between items, `": "` after keys.
struct PythonCompactFormatter;

impl serde_json::ser::Formatter for PythonCompactFormatter {
    fn begin_array_value<W: ?Sized + std::io::Write>(&mut self, writer: &mut W, first: bool) -> std::io::Result<()> {
        if first {
            Ok(())
        } else {
            writer.write_all(b", ")
        }
    }
    fn begin_object_key<W: ?Sized + std::io::Write>(&mut self, writer: &mut W, first: bool) -> std::io::Result<()> {
        if first {
            Ok(())
        } else {
            writer.write_all(b", ")
        }
    }
    fn begin_object_value<W: ?Sized + std::io::Write>(&mut self, writer: &mut W) -> std::io::Result<()> {
        writer.write_all(b": ")
    }
}

/// Non-ASCII characters only occur inside JSON strings, so escaping them all is safe.
fn escape_non_ascii(json: &str) -> String {
    let mut out = String::with_capacity(json.len());
    for c in json.chars() {
        if c.is_ascii() {
            out.push(c);
        } else {
            let mut units = [0u16; 2];
            for unit in c.encode_utf16(&mut units) {
                out.push_str(&format!("\\u{unit:04x}"));
            }
        }
    }
    out
}
