use megagemma_engine::chat_template::{strftime, ChatMessage, ChatTemplate, TemplateSource};
use serde::Serialize;

fn temp_dir(name: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("megagemma-chat-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

fn conversation() -> Vec<ChatMessage> {
    vec![
        ChatMessage::system("  You are a helpful assistant.\n"),
        ChatMessage::user("Hi!"),
        ChatMessage::assistant("Hello! How can I help?"),
        ChatMessage::user("  What is 2+2?  "),
    ]
}

#[test]
fn builtin_gemma4_renders_spec_turn_format() {
    let rendered = ChatTemplate::gemma4().render(&conversation(), true).unwrap();
    let expected = "<bos><|turn>system\nYou are a helpful assistant.<turn|>\n\
                    <|turn>user\nHi!<turn|>\n\
                    <|turn>model\nHello! How can I help?<turn|>\n\
                    <|turn>user\nWhat is 2+2?<turn|>\n\
                    <|turn>model\n";
    assert_eq!(rendered, expected);
}

#[test]
fn builtin_gemma4_without_system_or_generation_prompt() {
    let template = ChatTemplate::gemma4();
    let messages = [ChatMessage::user("Hi"), ChatMessage::assistant("Yo")];
    assert_eq!(template.render(&messages, false).unwrap(), "<bos><|turn>user\nHi<turn|>\n<|turn>model\nYo<turn|>\n");
    assert_eq!(template.render(&[], true).unwrap(), "<bos><|turn>model\n");
}

#[test]
fn builtin_gemma4_strips_previous_thinking_and_supports_enable_thinking() {
    let template = ChatTemplate::gemma4();
    let messages = [
        ChatMessage::user("Q"),
        ChatMessage::assistant("Sure. <|channel>thought\nlet me think<channel|>Answer"),
        ChatMessage::user("Q2"),
    ];
    let rendered = template.render_with(&messages, true, serde_json::json!({"enable_thinking": true})).unwrap();
    assert_eq!(
        rendered,
        "<bos><|turn>system\n<|think|>\n<turn|>\n<|turn>user\nQ<turn|>\n\
         <|turn>model\nSure. Answer<turn|>\n<|turn>user\nQ2<turn|>\n<|turn>model\n"
    );
}

#[test]
fn template_from_tokenizer_config_with_object_bos_and_python_methods() {
    let dir = temp_dir("config");
    let template = "{{ bos_token }}{% for m in messages %}\
        {% if m.role not in ['user', 'assistant'] %}{{ raise_exception('bad role ' + m.role) }}{% endif %}\
        [{{ m.role.upper() }}] {{ m.content.strip() }}{% if m.content.startswith('x') %}!{% endif %}{{ eos_token }}\n\
        {% endfor %}{% if add_generation_prompt %}[ASSISTANT]{% endif %}";
    let config = serde_json::json!({
        "bos_token": {"content": "<s>", "lstrip": false},
        "eos_token": "</s>",
        "chat_template": template,
    });
    std::fs::write(dir.join("tokenizer_config.json"), config.to_string()).unwrap();

    let chat = ChatTemplate::from_model_dir(&dir).unwrap();
    assert_eq!(chat.source(), &TemplateSource::TokenizerConfig(dir.join("tokenizer_config.json")));
    assert_eq!(chat.bos_token(), "<s>");
    let rendered = chat.render(&[ChatMessage::user("  hi "), ChatMessage::assistant("xyz")], true).unwrap();
    assert_eq!(rendered, "<s>[USER] hi</s>\n[ASSISTANT] xyz!</s>\n[ASSISTANT]");

    let err = chat.render(&[ChatMessage::system("s")], false).unwrap_err().to_string();
    assert!(err.contains("bad role system"), "{err}");
}

#[test]
fn template_list_form_uses_default_and_jinja_file_wins() {
    let dir = temp_dir("list");
    let config = serde_json::json!({
        "chat_template": [
            {"name": "tool_use", "template": "TOOLS"},
            {"name": "default", "template": "DEFAULT {{ messages | length }}"},
        ],
    });
    std::fs::write(dir.join("tokenizer_config.json"), config.to_string()).unwrap();
    let chat = ChatTemplate::from_model_dir(&dir).unwrap();
    assert_eq!(chat.render(&conversation(), false).unwrap(), "DEFAULT 4");
    // Without tokenizer_config.json BOS/EOS default to Gemma's.
    assert_eq!(chat.bos_token(), "<bos>");

    std::fs::write(dir.join("chat_template.jinja"), "JINJA {{ bos_token }}").unwrap();
    let chat = ChatTemplate::from_model_dir(&dir).unwrap();
    assert_eq!(chat.source(), &TemplateSource::JinjaFile(dir.join("chat_template.jinja")));
    assert_eq!(chat.render(&conversation(), false).unwrap(), "JINJA <bos>");
}

#[test]
fn empty_dir_falls_back_to_builtin_gemma4() {
    let dir = temp_dir("empty");
    let chat = ChatTemplate::from_model_dir(&dir).unwrap();
    assert_eq!(chat.source(), &TemplateSource::BuiltinGemma4);
    assert!(chat.render(&conversation(), true).unwrap().starts_with("<bos><|turn>system\n"));
}

#[test]
fn broken_templates_give_errors_not_panics() {
    let syntax = ChatTemplate::from_template("{% for m in %}{{ m }}{% endfor %}", "<bos>", "<eos>");
    let err = syntax.unwrap_err().to_string();
    assert!(err.contains("invalid chat template"), "{err}");
    assert!(!err.contains('\n'), "error should be one line: {err}");

    let unclosed = ChatTemplate::from_template("{% if x %}never closed", "<bos>", "<eos>");
    assert!(unclosed.is_err());

    let runtime = ChatTemplate::from_template("{{ messages[0].content.no_such_method() }}", "", "").unwrap();
    assert!(runtime.render(&conversation(), false).is_err());

    let dir = temp_dir("broken");
    std::fs::write(dir.join("tokenizer_config.json"), r#"{"chat_template": "{{ unclosed"}"#).unwrap();
    let err = ChatTemplate::from_model_dir(&dir).unwrap_err().to_string();
    assert!(err.contains("tokenizer_config.json"), "{err}");

    std::fs::write(dir.join("tokenizer_config.json"), r#"{"chat_template": [{"name": "x", "template": ""}]}"#).unwrap();
    let err = ChatTemplate::from_model_dir(&dir).unwrap_err().to_string();
    assert!(err.contains("default"), "{err}");

    std::fs::write(dir.join("tokenizer_config.json"), "{oops").unwrap();
    assert!(ChatTemplate::from_model_dir(&dir).unwrap_err().to_string().contains("invalid JSON"));
}

#[derive(Serialize)]
struct Tool {
    name: &'static str,
    description: &'static str,
    params: Vec<u32>,
}

/// Struct fields serialise in declaration order, which the template must keep (like a Python dict).
#[derive(Serialize)]
struct Ctx {
    tool: Tool,
}

#[test]
fn tojson_matches_python_json_dumps() {
    let chat = ChatTemplate::from_template(
        "{{ tool | tojson }}|{{ tool | tojson(sort_keys=true) }}|{{ tool.params | tojson(indent=2) }}",
        "",
        "",
    )
    .unwrap();
    let tool = Tool { name: "get_weather", description: "<city> & \"quotes\" é", params: vec![1, 2] };
    let rendered = chat.render_with(&[], false, Ctx { tool }).unwrap();
    // Python json.dumps(x, ensure_ascii=False): insertion order, ", " and ": " separators,
    // no HTML escaping of < > & (minijinja's own tojson would write \u003c).
    assert_eq!(
        rendered,
        "{\"name\": \"get_weather\", \"description\": \"<city> & \\\"quotes\\\" é\", \"params\": [1, 2]}|\
         {\"description\": \"<city> & \\\"quotes\\\" é\", \"name\": \"get_weather\", \"params\": [1, 2]}|\
         [\n  1,\n  2\n]"
    );
}

#[test]
fn strftime_formats_known_timestamp_and_is_callable_from_templates() {
    // 2023-11-14 22:13:20 UTC, a Tuesday.
    assert_eq!(strftime("%d %b %Y %H:%M:%S %A %j %I%p %%", 1_700_000_000), "14 Nov 2023 22:13:20 Tuesday 318 10PM %");
    assert_eq!(strftime("%Y-%m-%d %a", 951_782_400), "2000-02-29 Tue");
    let chat = ChatTemplate::from_template("{{ strftime_now('%Y') }}", "", "").unwrap();
    let year: u32 = chat.render(&[], false).unwrap().parse().unwrap();
    assert!(year >= 2025);
}
