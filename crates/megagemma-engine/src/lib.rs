pub mod tokenizer;
pub mod gguf_tokenizer;
pub mod chat_template;
pub mod sampling;
pub mod generate;
mod json_file;
