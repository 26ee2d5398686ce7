//! Sweep grids: `--grid section.key=v1,v2,...` axes, their cartesian product, and a short,
//! unique, filesystem-safe name for every layout (`dp2-tp1-zero1`).

use crate::ReportError;

/// One swept key and its values, in the order given.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GridAxis {
    /// Dotted configuration key, e.g. `parallel.dp`.
    pub key: String,
    /// Raw values, as they would follow `--set key=`.
    pub values: Vec<String>,
}

/// One point of the grid.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Layout {
    /// Unique name, also the run directory's name.
    pub name: String,
    /// `(key, value)` per grid axis, in axis order.
    pub assignments: Vec<(String, String)>,
}

impl Layout {
    /// The assignments as `--set` overrides (`key=value`).
    pub fn overrides(&self) -> Vec<String> {
        self.assignments
            .iter()
            .map(|(k, v)| format!("{k}={v}"))
            .collect()
    }
}

fn grid_error(spec: &str, message: impl Into<String>) -> ReportError {
    ReportError::Grid {
        spec: spec.to_string(),
        message: message.into(),
    }
}

/// Parses `--grid` arguments (`section.key=v1,v2,...`; values may not contain commas).
/// Rejects a missing `=`, a key without a section, an empty value and a key given twice.
pub fn parse_grid(specs: &[String]) -> Result<Vec<GridAxis>, ReportError> {
    let mut axes: Vec<GridAxis> = Vec::with_capacity(specs.len());
    for spec in specs {
        let (key, values) = spec.split_once('=').ok_or_else(|| {
            grid_error(
                spec,
                "expected section.key=v1,v2,... (e.g. parallel.dp=1,2,4)",
            )
        })?;
        let key = key.trim();
        let parts: Vec<&str> = key.split('.').collect();
        if parts.len() < 2 || parts.iter().any(|p| p.is_empty()) {
            return Err(grid_error(
                spec,
                format!("key `{key}` must be section.key, e.g. parallel.dp"),
            ));
        }
        let values: Vec<String> = values.split(',').map(|v| v.trim().to_string()).collect();
        if values.iter().any(String::is_empty) {
            return Err(grid_error(
                spec,
                "empty value: give comma-separated values such as parallel.dp=1,2,4",
            ));
        }
        if axes.iter().any(|a| a.key == key) {
            return Err(grid_error(
                spec,
                format!("`{key}` is swept twice: merge its values into one --grid"),
            ));
        }
        axes.push(GridAxis {
            key: key.to_string(),
            values,
        });
    }
    Ok(axes)
}

/// Keeps letters, digits, `.`, `_` and `-`; replaces anything else with `_`.
fn sanitize(text: &str) -> String {
    text.chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-') {
                c
            } else {
                '_'
            }
        })
        .collect()
}

/// The cartesian product of `axes` (the first axis varies slowest). Names join
/// `<last key segment><value>` with `-` (`dp2-zero1`; values that are not numbers get an `_`:
/// `pp_schedule_afab`); the full key is used when two axes share a last segment, and
/// a numeric suffix settles any remaining clash. No axes: one layout named `base`.
pub fn expand_layouts(axes: &[GridAxis]) -> Vec<Layout> {
    let last = |k: &str| k.rsplit('.').next().unwrap_or(k).to_string();
    let clash = axes
        .iter()
        .enumerate()
        .any(|(i, a)| axes[..i].iter().any(|b| last(&b.key) == last(&a.key)));
    let short: Vec<String> = axes
        .iter()
        .map(|a| {
            if clash {
                a.key.replace('.', "_")
            } else {
                last(&a.key)
            }
        })
        .collect();
    let mut layouts: Vec<Layout> = vec![Layout {
        name: String::new(),
        assignments: Vec::new(),
    }];
    for axis in axes {
        layouts = layouts
            .into_iter()
            .flat_map(|l| {
                axis.values.iter().map(move |v| {
                    let mut next = l.clone();
                    next.assignments.push((axis.key.clone(), v.clone()));
                    next
                })
            })
            .collect();
    }
    let mut seen = std::collections::HashSet::new();
    for layout in &mut layouts {
        let parts: Vec<String> = layout
            .assignments
            .iter()
            .zip(&short)
            .map(|((_, v), s)| {
                let numeric = v.parse::<f64>().is_ok();
                sanitize(&if numeric {
                    format!("{s}{v}")
                } else {
                    format!("{s}_{v}")
                })
            })
            .collect();
        let base = if parts.is_empty() {
            "base".to_string()
        } else {
            parts.join("-")
        };
        let mut name = base.clone();
        let mut n = 2;
        while !seen.insert(name.clone()) {
            name = format!("{base}-{n}");
            n += 1;
        }
        layout.name = name;
    }
    layouts
}

#[cfg(test)]
mod tests {
    use super::*;

    fn specs(s: &[&str]) -> Vec<String> {
        s.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn product_and_names() {
        let axes = parse_grid(&specs(&[
            "parallel.dp=1,2",
            "parallel.pp_schedule=afab, 1f1b",
        ]))
        .unwrap();
        let layouts = expand_layouts(&axes);
        let names: Vec<_> = layouts.iter().map(|l| l.name.as_str()).collect();
        assert_eq!(
            names,
            [
                "dp1-pp_schedule_afab",
                "dp1-pp_schedule_1f1b",
                "dp2-pp_schedule_afab",
                "dp2-pp_schedule_1f1b"
            ]
        );
        assert_eq!(
            layouts[3].overrides(),
            ["parallel.dp=2", "parallel.pp_schedule=1f1b"]
        );
        assert_eq!(expand_layouts(&[])[0].name, "base");
    }

    #[test]
    fn clashing_segments_and_odd_values_stay_unique_and_safe() {
        let axes = parse_grid(&specs(&["a.x=1", "b.x=1", "run.tag=a/b,a_b"])).unwrap();
        let names: Vec<_> = expand_layouts(&axes).into_iter().map(|l| l.name).collect();
        assert_eq!(names, ["a_x1-b_x1-run_tag_a_b", "a_x1-b_x1-run_tag_a_b-2"]);
    }

    #[test]
    fn bad_grids_are_explained() {
        let err = |s: &str| parse_grid(&specs(&[s])).unwrap_err().to_string();
        assert!(err("parallel.dp").contains("expected section.key=v1,v2"));
        assert!(err("dp=1,2").contains("must be section.key"));
        assert!(err("parallel.dp=1,,2").contains("empty value"));
        let twice = parse_grid(&specs(&["parallel.dp=1", "parallel.dp=2"]))
            .unwrap_err()
            .to_string();
        assert!(
            twice.contains("--grid `parallel.dp=2`: `parallel.dp` is swept twice"),
            "{twice}"
        );
    }
}
