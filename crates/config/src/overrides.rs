//! `--set section.key=value` overrides applied to the TOML tree before typing.

use crate::ConfigError;

/// Applies one `section.key=value` override to `table`. The value is parsed as a TOML value
/// (`3`, `1e-3`, `true`, `"text"`, `[1, 2]`); anything that does not parse as one is taken as
/// a string, so `--set run.dir=runs/x` works without quotes.
pub fn apply_override(table: &mut toml::Table, item: &str) -> Result<(), ConfigError> {
    let bad = |why: &str| ConfigError::Override(item.to_string(), why.to_string());
    let (path, raw) = item
        .split_once('=')
        .ok_or_else(|| bad("expected section.key=value"))?;
    let keys: Vec<&str> = path.trim().split('.').collect();
    if keys.len() < 2 || keys.iter().any(|k| k.is_empty()) {
        return Err(bad("expected section.key=value"));
    }
    let value = parse_value(raw.trim());
    let mut node = table;
    for key in &keys[..keys.len() - 1] {
        let entry = node
            .entry(key.to_string())
            .or_insert_with(|| toml::Value::Table(toml::Table::new()));
        node = entry
            .as_table_mut()
            .ok_or_else(|| bad(&format!("`{key}` is not a section")))?;
    }
    node.insert(keys[keys.len() - 1].to_string(), value);
    Ok(())
}

fn parse_value(raw: &str) -> toml::Value {
    let doc = format!("v = {raw}");
    match toml::from_str::<toml::Table>(&doc) {
        Ok(mut t) => t
            .remove("v")
            .unwrap_or_else(|| toml::Value::String(raw.to_string())),
        Err(_) => toml::Value::String(raw.to_string()),
    }
}
