//! The three charts of one training run: `loss.svg`, `memory.svg` and `time.svg`.

use std::path::{Path, PathBuf};

use crate::run_data::{read_metrics, read_summary, StepRecord, Summary, MEMORY_CATEGORIES};
use crate::svg::{self, fmt_bytes, fmt_num, nice_ticks, Anchor, Frame, Scale, Svg};
use crate::{write_atomic, ReportError};

/// At most this many bars in `time.svg`; longer runs are averaged over groups of steps.
const MAX_TIME_BARS: usize = 60;

/// Reads `<run_dir>/metrics.jsonl` and `<run_dir>/summary.json` and writes `loss.svg`,
/// `memory.svg` and `time.svg` next to them (each atomically), returning their paths.
/// Fails with the file named when either input is missing, malformed or holds no step.
pub fn write_run_plots(run_dir: &Path) -> Result<Vec<PathBuf>, ReportError> {
    let steps = read_metrics(&run_dir.join("metrics.jsonl"))?;
    let summary = read_summary(&run_dir.join("summary.json"))?;
    let charts = [
        ("loss.svg", loss_svg(&steps, &summary)),
        ("memory.svg", memory_svg(&summary)),
        ("time.svg", time_svg(&steps)),
    ];
    let mut paths = Vec::with_capacity(charts.len());
    for (name, text) in charts {
        let path = run_dir.join(name);
        write_atomic(&path, text.as_bytes())?;
        paths.push(path);
    }
    Ok(paths)
}

/// Finite values of `values`' range, or `None` when none is finite.
fn range(values: impl Iterator<Item = f64>) -> Option<(f64, f64)> {
    values
        .filter(|v| v.is_finite())
        .fold(None, |acc, v| match acc {
            None => Some((v, v)),
            Some((lo, hi)) => Some((lo.min(v), hi.max(v))),
        })
}

fn ends(ticks: &[f64]) -> (f64, f64) {
    (ticks[0], ticks[ticks.len() - 1])
}

fn fmt_step(v: f64) -> String {
    format!("{}", v.round() as i64)
}

/// Loss per step (the `loss` polyline has one point per step with a finite loss), with the
/// learning rate in a small panel below on the same step axis.
pub fn loss_svg(steps: &[StepRecord], summary: &Summary) -> String {
    let mut svg = Svg::new(760.0, 500.0);
    let top = Frame {
        left: 80.0,
        top: 50.0,
        width: 600.0,
        height: 260.0,
    };
    let low = Frame {
        left: 80.0,
        top: 360.0,
        width: 600.0,
        height: 80.0,
    };
    let first = steps.first().map_or(1, |s| s.step) as f64;
    let last = steps.last().map_or(1, |s| s.step) as f64;
    let x_ticks = nice_ticks(first, last, 8);
    let whole = |t: &f64| *t >= first && *t <= last && t.fract() == 0.0;
    let x_ticks: Vec<f64> = x_ticks.into_iter().filter(whole).collect();
    let x = Scale::new(first, last, top.left, top.right());
    let mut title = format!("Training loss over {} steps", steps.len());
    if let Some(l) = summary.final_loss {
        title.push_str(&format!(" — final {l:.4}"));
    }
    if let Some(l) = summary.tail_loss {
        title.push_str(&format!(", mean of last 10% {l:.4}"));
    }
    svg.text(top.left, 28.0, &title, 15.0, Anchor::Start);

    let panels = [
        (
            top,
            "loss (nats)",
            "loss",
            svg::BLUE,
            steps.iter().map(|s| s.loss).collect::<Vec<_>>(),
        ),
        (
            low,
            "learning rate",
            "lr",
            svg::ORANGE,
            steps.iter().map(|s| s.lr).collect(),
        ),
    ];
    for (frame, label, class, colour, values) in panels {
        let ticks = match range(values.iter().copied()) {
            Some((lo, hi)) => nice_ticks(lo, hi, if class == "loss" { 6 } else { 2 }),
            None => nice_ticks(0.0, 1.0, 2),
        };
        let (lo, hi) = ends(&ticks);
        let y = Scale::new(lo, hi, frame.bottom(), frame.top);
        frame.y_axis(&mut svg, &y, &ticks, fmt_num, label, false);
        let axis_label = if class == "lr" { "step" } else { "" };
        frame.x_axis(&mut svg, &x, &x_ticks, fmt_step, axis_label);
        let points: Vec<(f64, f64)> = steps
            .iter()
            .zip(&values)
            .filter(|(_, v)| v.is_finite())
            .map(|(s, v)| (x.map(s.step as f64), y.map(*v)))
            .collect();
        svg.polyline(&points, colour, 2.0, class);
        if let [(px, py)] = points[..] {
            svg.circle(px, py, 3.0, colour, class, label);
        }
        if points.len() < values.len() {
            let note = format!(
                "{} non-finite values not drawn",
                values.len() - points.len()
            );
            svg.text(frame.right(), frame.top - 4.0, &note, 11.0, Anchor::End);
        }
    }
    svg.finish()
}

/// Peak bytes per memory category of rank 0, one bar each, labelled with its size.
pub fn memory_svg(summary: &Summary) -> String {
    let mut svg = Svg::new(760.0, 420.0);
    let frame = Frame {
        left: 90.0,
        top: 50.0,
        width: 620.0,
        height: 290.0,
    };
    let mut bars: Vec<(&str, u64)> = MEMORY_CATEGORIES
        .iter()
        .map(|c| (*c, summary.memory_peak_bytes.get(*c).copied().unwrap_or(0)))
        .collect();
    for (name, bytes) in &summary.memory_peak_bytes {
        if !MEMORY_CATEGORIES.contains(&name.as_str()) {
            bars.push((name, *bytes));
        }
    }
    let max = bars.iter().map(|b| b.1).max().unwrap_or(0).max(1) as f64;
    // Ticks at round multiples of the binary unit the largest bar is expressed in.
    let unit = (0..5)
        .map(|k| 1024f64.powi(k))
        .take_while(|u| *u <= max)
        .last()
        .unwrap_or(1.0);
    let ticks: Vec<f64> = nice_ticks(0.0, max / unit, 5)
        .into_iter()
        .map(|t| t * unit)
        .collect();
    let (_, hi) = ends(&ticks);
    let y = Scale::new(0.0, hi, frame.bottom(), frame.top);
    let total = summary
        .memory_total_peak_bytes
        .map(|b| fmt_bytes(b as f64))
        .unwrap_or_else(|| "unknown".into());
    let title = format!("Peak memory per category, rank 0 — total peak {total}");
    svg.text(frame.left, 28.0, &title, 15.0, Anchor::Start);
    frame.y_axis(&mut svg, &y, &ticks, fmt_bytes, "peak bytes", false);
    svg.line(
        frame.left,
        frame.bottom(),
        frame.right(),
        frame.bottom(),
        svg::INK,
        1.0,
    );
    let slot = frame.width / bars.len() as f64;
    let colours = [
        svg::BLUE,
        svg::ORANGE,
        svg::GREEN,
        svg::VERMILLION,
        svg::PURPLE,
        svg::SKY,
        svg::YELLOW,
    ];
    for (i, (name, bytes)) in bars.iter().enumerate() {
        let x = frame.left + slot * i as f64 + slot * 0.15;
        let top = y.map(*bytes as f64);
        let label = fmt_bytes(*bytes as f64);
        svg.rect(
            [x, top, slot * 0.7, frame.bottom() - top],
            colours[i % colours.len()],
            "bar",
            &format!("{name}: {bytes} bytes"),
        );
        svg.text(x + slot * 0.35, top - 5.0, &label, 11.0, Anchor::Middle);
        svg.text(
            x + slot * 0.35,
            frame.bottom() + 18.0,
            name,
            12.0,
            Anchor::Middle,
        );
    }
    svg.finish()
}

/// Seconds of one bar of `time.svg`: compute + other, exposed reduction, pipeline wait.
fn split(s: &StepRecord) -> [f64; 3] {
    let finite = |v: f64| if v.is_finite() { v.max(0.0) } else { 0.0 };
    let exposed = finite(s.reduce_exposed_s);
    let wait = finite(s.pipeline_wait_s);
    [
        (finite(s.step_time_s) - exposed - wait).max(0.0),
        exposed,
        wait,
    ]
}

/// Names of the parts of a `time.svg` bar, bottom first.
const TIME_PARTS: [&str; 3] = ["compute + other", "exposed reduction", "pipeline wait"];

/// Per-step time as stacked bars: exposed gradient reduction, pipeline wait and the rest
/// ("compute + other"); runs longer than 60 steps are shown as means over groups of steps.
pub fn time_svg(steps: &[StepRecord]) -> String {
    let mut svg = Svg::new(760.0, 440.0);
    let frame = Frame {
        left: 80.0,
        top: 70.0,
        width: 620.0,
        height: 290.0,
    };
    let group = steps.len().div_ceil(MAX_TIME_BARS).max(1);
    let bars = time_bars(steps, group);
    let max = bars
        .iter()
        .map(|(_, b)| b.iter().sum::<f64>())
        .fold(0.0, f64::max);
    // Milliseconds for sub-second steps, so the axis reads 2, 4, 6 rather than 2e-3.
    let (unit, unit_name) = if max < 1.0 { (1e3, "ms") } else { (1.0, "s") };
    let bars: Vec<(usize, [f64; 3])> = bars
        .into_iter()
        .map(|(s, b)| (s, b.map(|v| v * unit)))
        .collect();
    let max = max * unit;
    let ticks = nice_ticks(0.0, if max > 0.0 { max } else { 1.0 }, 5);
    let (_, hi) = ends(&ticks);
    let y = Scale::new(0.0, hi, frame.bottom(), frame.top);
    let mut title = "Time per step".to_string();
    if group > 1 {
        title.push_str(&format!(" (each bar: mean of {group} steps)"));
    }
    svg.text(frame.left, 28.0, &title, 15.0, Anchor::Start);
    time_legend(&mut svg, &frame, steps);
    let axis = if unit_name == "ms" {
        "milliseconds per step"
    } else {
        "seconds per step"
    };
    frame.y_axis(&mut svg, &y, &ticks, fmt_num, axis, false);
    svg.line(
        frame.left,
        frame.bottom(),
        frame.right(),
        frame.bottom(),
        svg::INK,
        1.0,
    );
    draw_time_bars(&mut svg, &frame, &y, &bars, unit_name);
    svg.text(
        frame.left + frame.width / 2.0,
        frame.bottom() + 36.0,
        "step",
        12.0,
        Anchor::Middle,
    );
    svg.finish()
}

/// The bars of `time.svg`: the first step of each group of `group` steps and the mean of
/// the group's parts ([`split`]), in seconds.
fn time_bars(steps: &[StepRecord], group: usize) -> Vec<(usize, [f64; 3])> {
    steps
        .chunks(group)
        .map(|chunk| {
            let mut sum = [0.0; 3];
            for s in chunk {
                for (acc, v) in sum.iter_mut().zip(split(s)) {
                    *acc += v;
                }
            }
            (chunk[0].step, sum.map(|v| v / chunk.len() as f64))
        })
        .collect()
}

/// The legend of `time.svg`: each part with its share of the run's time.
fn time_legend(svg: &mut Svg, frame: &Frame, steps: &[StepRecord]) {
    let totals: [f64; 3] = steps
        .iter()
        .map(split)
        .fold([0.0; 3], |a, b| [a[0] + b[0], a[1] + b[1], a[2] + b[2]]);
    let all: f64 = totals.iter().sum();
    let share = |i: usize| {
        if all > 0.0 {
            100.0 * totals[i] / all
        } else {
            0.0
        }
    };
    let labels: Vec<String> = (0..3)
        .map(|i| format!("{} {:.1}%", TIME_PARTS[i], share(i)))
        .collect();
    let entries: Vec<(&str, &str)> = (0..3)
        .map(|i| (TIME_COLOURS[i], labels[i].as_str()))
        .collect();
    svg.legend(frame.left, 52.0, &entries);
}

/// Colours of the parts of a `time.svg` bar, as [`TIME_PARTS`].
const TIME_COLOURS: [&str; 3] = [svg::BLUE, svg::VERMILLION, svg::ORANGE];

/// Draws the stacked bars (values in `unit_name`) over scale `y`, labelling at most about
/// 12 of them with their step.
fn draw_time_bars(
    svg: &mut Svg,
    frame: &Frame,
    y: &Scale,
    bars: &[(usize, [f64; 3])],
    unit_name: &str,
) {
    let slot = frame.width / bars.len().max(1) as f64;
    let label_every = bars.len().div_ceil(12).max(1);
    for (i, (step, parts)) in bars.iter().enumerate() {
        let x = frame.left + slot * i as f64 + slot * 0.1;
        let mut base = 0.0;
        for (k, part) in parts.iter().enumerate() {
            let (y0, y1) = (y.map(base), y.map(base + part));
            let tip = format!("step {step}: {} {part:.4} {unit_name}", TIME_PARTS[k]);
            svg.rect([x, y1, slot * 0.8, y0 - y1], TIME_COLOURS[k], "bar", &tip);
            base += part;
        }
        if i % label_every == 0 {
            svg.text(
                x + slot * 0.4,
                frame.bottom() + 18.0,
                &step.to_string(),
                11.0,
                Anchor::Middle,
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn step(step: usize, loss: f64, time: f64, exposed: f64, wait: f64) -> StepRecord {
        StepRecord {
            step,
            loss,
            lr: 1e-3,
            step_time_s: time,
            tokens_per_s: 100.0,
            mfu: None,
            reduce_exposed_s: exposed,
            pipeline_wait_s: wait,
        }
    }

    #[test]
    fn loss_polyline_has_one_point_per_finite_step() {
        let steps: Vec<_> = (1..=5)
            .map(|i| step(i, 5.0 - i as f64 * 0.5, 0.1, 0.0, 0.0))
            .collect();
        let text = loss_svg(&steps, &Summary::default());
        let line = text
            .lines()
            .find(|l| l.contains(r#"class="loss""#))
            .unwrap();
        assert_eq!(
            line.split("points=\"")
                .nth(1)
                .unwrap()
                .split('"')
                .next()
                .unwrap()
                .split(' ')
                .count(),
            5
        );
        let mut diverged = steps.clone();
        diverged[4].loss = f64::NAN;
        assert!(loss_svg(&diverged, &Summary::default()).contains("1 non-finite values not drawn"));
    }

    #[test]
    fn memory_bars_follow_categories_and_sizes() {
        let mut summary = Summary::default();
        summary
            .memory_peak_bytes
            .insert("weights".into(), 2 * 1024 * 1024);
        summary
            .memory_peak_bytes
            .insert("optimizer".into(), 4 * 1024 * 1024);
        summary.memory_total_peak_bytes = Some(6 * 1024 * 1024);
        let text = memory_svg(&summary);
        assert_eq!(text.matches(r#"<rect class="bar""#).count(), 7);
        assert!(
            text.contains("total peak 6 MiB") && text.contains(">4 MiB<") && text.contains(">0 B<"),
            "{text}"
        );
    }

    #[test]
    fn time_bars_stack_three_parts_and_group_long_runs() {
        let steps: Vec<_> = (1..=4).map(|i| step(i, 1.0, 1.0, 0.25, 0.25)).collect();
        let text = time_svg(&steps);
        assert_eq!(text.matches(r#"<rect class="bar""#).count(), 12);
        assert!(
            text.contains("compute + other 50.0%") && text.contains("pipeline wait 25.0%"),
            "{text}"
        );
        let long: Vec<_> = (1..=130).map(|i| step(i, 1.0, 1.0, 0.0, 0.0)).collect();
        let text = time_svg(&long);
        assert!(text.contains("mean of 3 steps"));
        assert_eq!(text.matches(r#"<rect class="bar""#).count(), 44 * 3);
    }
}
