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

/// A configuration's deserialisation error on one line (`… in \`train\``), and for an unknown
/// field the known one it most likely meant (`did you mean \`steps\`?`).
pub(crate) fn explain(e: &toml::de::Error) -> String {
    let text = e.to_string();
    let mut line: String = text
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty())
        .collect::<Vec<_>>()
        .join(" ");
    if let Some(guess) = closest_field(&text) {
        line.push_str(&format!(" (did you mean `{guess}`?)"));
    }
    line
}

/// For serde's "unknown field `x`, expected one of `a`, `b`, …": the listed field within two
/// edits of `x` (a third of its length for short names), the nearest first.
fn closest_field(text: &str) -> Option<String> {
    let rest = text.split("unknown field `").nth(1)?;
    let (field, rest) = rest.split_once('`')?;
    let known = rest.split("expected one of ").nth(1)?.lines().next()?;
    let names = known.split(", ").map(|n| n.trim_matches('`'));
    let limit = (field.len() / 3).clamp(1, 2);
    names
        .map(|n| (edits(field, n), n))
        .filter(|&(d, _)| d <= limit)
        .min()
        .map(|(_, n)| n.to_string())
}

/// Levenshtein distance, with a swap of neighbours counting once.
fn edits(a: &str, b: &str) -> usize {
    let (a, b): (Vec<char>, Vec<char>) = (a.chars().collect(), b.chars().collect());
    let mut d = vec![vec![0usize; b.len() + 1]; a.len() + 1];
    for (i, row) in d.iter_mut().enumerate() {
        row[0] = i;
    }
    for (j, cell) in d[0].iter_mut().enumerate() {
        *cell = j;
    }
    for i in 1..=a.len() {
        for j in 1..=b.len() {
            let sub = d[i - 1][j - 1] + usize::from(a[i - 1] != b[j - 1]);
            let mut best = sub.min(d[i - 1][j] + 1).min(d[i][j - 1] + 1);
            if i > 1 && j > 1 && a[i - 1] == b[j - 2] && a[i - 2] == b[j - 1] {
                best = best.min(d[i - 2][j - 2] + 1);
            }
            d[i][j] = best;
        }
    }
    d[a.len()][b.len()]
}

#[cfg(test)]
mod tests {
    #[test]
    fn an_unknown_field_names_the_one_it_likely_meant() {
        let err = crate::Config::load(None, &["train.stpes=5".to_string()]).unwrap_err();
        let text = err.to_string();
        assert!(text.contains("did you mean `steps`?"), "{text}");
        assert!(!text.contains('\n'), "{text}");
        // Nothing close: no guess.
        let err = crate::Config::load(None, &["train.zzzzzz=5".to_string()]).unwrap_err();
        assert!(!err.to_string().contains("did you mean"), "{err}");
        assert_eq!(super::edits("micro_bacth", "micro_batch"), 1);
        assert_eq!(super::edits("lr", "lr"), 0);
        assert_eq!(super::edits("kitten", "sitting"), 3);
    }
}
