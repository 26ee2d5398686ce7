//! `ferrotron report`: one self-contained HTML page comparing runs and sweeps.
//!
//! The page carries its data (the runs' metrics, summaries and configurations, the sweeps'
//! tables) as JSON inside the file and draws every chart with its own inline script as SVG:
//! it fetches nothing, so it opens from disk, from an e-mail or from a CI artifact alike.
//!
//! It shows overlaid loss curves with an adjustable smoothing, the learning rate, tokens/s,
//! MFU, memory by category, a table of the runs' summaries, the configuration keys whose
//! values differ between runs, and for a sweep directory its grid.

use std::path::{Path, PathBuf};

use serde::Serialize;
use serde_json::{Map, Value};

use crate::ReportError;

/// The metrics of each step the page keeps (others are dropped to keep the page small).
const STEP_KEYS: [&str; 6] = ["step", "loss", "lr", "tokens_per_s", "mfu", "grad_norm"];

/// One run: its name on the page, its steps and, when it finished, its summary.
#[derive(Debug, Clone, Serialize)]
pub struct PageRun {
    /// The directory as given (or `sweep/layout`).
    pub name: String,
    /// Each step's kept metrics: step, loss, lr, tokens_per_s, mfu, grad_norm.
    pub steps: Vec<Value>,
    /// `summary.json` (with the run's configuration), when written.
    pub summary: Option<Value>,
}

/// One sweep: its `sweep.csv` as a table.
#[derive(Debug, Clone, Serialize)]
pub struct PageSweep {
    /// The directory as given.
    pub name: String,
    /// The CSV's header.
    pub header: Vec<String>,
    /// Its rows, field by field.
    pub rows: Vec<Vec<String>>,
}

/// Everything the page shows.
#[derive(Debug, Clone, Default, Serialize)]
pub struct PageData {
    /// Runs, in the order given (a sweep's runs after it).
    pub runs: Vec<PageRun>,
    /// Sweeps, in the order given.
    pub sweeps: Vec<PageSweep>,
    /// The memory categories, in the ledger's order.
    pub categories: Vec<String>,
}

/// Reads every directory: a run (`metrics.jsonl`, and `summary.json` where written) or a
/// sweep (`sweep.csv`, and each layout's run directory that holds metrics).
///
/// # Errors
///
/// [`ReportError::NoData`] naming a directory that is neither, or a run without steps;
/// [`ReportError::Parse`] naming the file and line of a malformed metrics line, summary or
/// CSV; [`ReportError::Io`].
pub fn collect(dirs: &[PathBuf]) -> Result<PageData, ReportError> {
    let mut data = PageData {
        categories: crate::MEMORY_CATEGORIES
            .iter()
            .map(|c| c.to_string())
            .collect(),
        ..PageData::default()
    };
    for dir in dirs {
        let name = dir.display().to_string();
        if dir.join("sweep.csv").is_file() {
            let sweep = read_sweep(dir, name)?;
            for row in &sweep.rows {
                let run = dir.join(&row[0]);
                if run.join("metrics.jsonl").is_file() {
                    data.runs
                        .push(read_run(&run, format!("{}/{}", sweep.name, row[0]))?);
                }
            }
            data.sweeps.push(sweep);
        } else if dir.join("metrics.jsonl").is_file() {
            data.runs.push(read_run(dir, name)?);
        } else {
            return Err(ReportError::NoData {
                path: dir.clone(),
                message: "neither a run directory (metrics.jsonl) nor a sweep (sweep.csv): \
                          pass the run.dir of a `ferrotron train` or the --out of a sweep"
                    .into(),
            });
        }
    }
    Ok(data)
}

fn read(path: &Path) -> Result<String, ReportError> {
    std::fs::read_to_string(path).map_err(|source| ReportError::Io {
        action: "read",
        path: path.to_owned(),
        source,
    })
}

fn read_run(dir: &Path, name: String) -> Result<PageRun, ReportError> {
    let path = dir.join("metrics.jsonl");
    let mut steps = Vec::new();
    for (i, line) in read(&path)?.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let row: Map<String, Value> =
            serde_json::from_str(line).map_err(|e| ReportError::Parse {
                path: path.clone(),
                line: Some(i + 1),
                message: format!("not a metrics row: {e}"),
            })?;
        let kept: Map<String, Value> = STEP_KEYS
            .iter()
            .filter_map(|k| row.get(*k).map(|v| (k.to_string(), v.clone())))
            .collect();
        steps.push(Value::Object(kept));
    }
    if steps.is_empty() {
        return Err(ReportError::NoData {
            path,
            message: "holds no step: the run stopped before its first step finished".into(),
        });
    }
    let summary_path = dir.join("summary.json");
    let summary =
        match summary_path.is_file() {
            true => Some(serde_json::from_str(&read(&summary_path)?).map_err(|e| {
                ReportError::Parse {
                    path: summary_path,
                    line: None,
                    message: e.to_string(),
                }
            })?),
            false => None,
        };
    Ok(PageRun {
        name,
        steps,
        summary,
    })
}

fn read_sweep(dir: &Path, name: String) -> Result<PageSweep, ReportError> {
    let path = dir.join("sweep.csv");
    let text = read(&path)?;
    let mut lines = parse_csv(&text).into_iter();
    let header = lines.next().unwrap_or_default();
    let rows: Vec<Vec<String>> = lines.filter(|r| !r.is_empty()).collect();
    if let Some((i, r)) = rows
        .iter()
        .enumerate()
        .find(|(_, r)| r.len() != header.len())
    {
        return Err(ReportError::Parse {
            path,
            line: Some(i + 2),
            message: format!("{} fields, the header has {}", r.len(), header.len()),
        });
    }
    Ok(PageSweep { name, header, rows })
}

/// The records of a CSV as [`crate::csv_field`] writes them (quoted fields may hold commas,
/// doubled quotes and newlines).
fn parse_csv(text: &str) -> Vec<Vec<String>> {
    let mut records = Vec::new();
    let (mut record, mut field) = (Vec::new(), String::new());
    let mut quoted = false;
    let mut chars = text.chars().peekable();
    while let Some(c) = chars.next() {
        match (quoted, c) {
            (true, '"') if chars.peek() == Some(&'"') => {
                field.push('"');
                chars.next();
            }
            (true, '"') => quoted = false,
            (true, c) => field.push(c),
            (false, '"') => quoted = true,
            (false, ',') => record.push(std::mem::take(&mut field)),
            (false, '\n') => {
                record.push(std::mem::take(&mut field));
                records.push(std::mem::take(&mut record));
            }
            (false, '\r') => {}
            (false, c) => field.push(c),
        }
    }
    if !field.is_empty() || !record.is_empty() {
        record.push(field);
        records.push(record);
    }
    records
}

/// The page: `data` as JSON in the file, drawn by the inline script.
pub fn report_html(data: &PageData) -> String {
    // `</` inside the JSON could close the script element: escape it.
    let json = serde_json::to_string(data)
        .expect("page data serialises")
        .replace("</", "<\\/");
    include_str!("page/report.html")
        .replace("/*STYLE*/", include_str!("page/report.css"))
        .replace("/*SCRIPT*/", include_str!("page/report.js"))
        .replace("{\"DATA\":0}", &json)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn csv_fields_round_trip_through_the_writers_quoting() {
        let fields = ["plain", "a,b", "say \"hi\"", "two\nlines", ""];
        let line: Vec<String> = fields.iter().map(|f| crate::csv_field(f)).collect();
        let text = format!("h1,h2,h3,h4,h5\n{}\n", line.join(","));
        let records = parse_csv(&text);
        assert_eq!(records.len(), 2);
        assert_eq!(records[1], fields.map(String::from).to_vec());
    }

    #[test]
    fn the_data_cannot_close_its_script_element() {
        let data = PageData {
            runs: vec![PageRun {
                name: "</script><b>".into(),
                steps: vec![],
                summary: None,
            }],
            ..PageData::default()
        };
        let html = report_html(&data);
        assert_eq!(
            html.matches("</script>").count(),
            2,
            "the page's own two scripts"
        );
        assert!(html.contains("<\\/script><b>"));
    }
}
