//! Optional JSON files of a checkpoint directory (`generation_config.json`, `tokenizer_config.json`).

use std::path::Path;

use anyhow::{anyhow, Result};
use serde_json::Value;

/// The parsed file, `None` when it does not exist, an error naming the file when it is unreadable
/// or not JSON.
pub(crate) fn read_json_if_present(path: &Path) -> Result<Option<Value>> {
    if !path.is_file() {
        return Ok(None);
    }
    let text = std::fs::read_to_string(path).map_err(|e| anyhow!("cannot read {}: {e}", path.display()))?;
    let value = serde_json::from_str(&text).map_err(|e| anyhow!("invalid JSON in {}: {e}", path.display()))?;
    Ok(Some(value))
}
