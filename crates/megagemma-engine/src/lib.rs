pub mod backends;
pub mod chat_template;
pub mod generate;
pub mod gguf_tokenizer;
mod json_file;
pub mod model_files;
pub mod sampling;
pub mod tokenizer;
