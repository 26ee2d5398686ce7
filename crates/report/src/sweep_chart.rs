//! The sweep chart: one bar per layout (tokens/s per rank, best first), MFU as a line of
//! points on a secondary axis, failed layouts as labelled empty slots at the end.

use crate::svg::{self, fmt_num, nice_ticks, Anchor, Frame, Scale, Svg};

/// One layout of a sweep as the chart sees it.
#[derive(Debug, Clone, PartialEq)]
pub struct SweepBar {
    /// Layout name, e.g. `dp2-tp1-zero1`.
    pub name: String,
    /// `ok`, or the failure class (`invalid_layout`, `out_of_memory`, `crashed`, …).
    pub status: String,
    /// Throughput divided by the number of ranks (only for `ok` layouts).
    pub tokens_per_s_per_rank: Option<f64>,
    /// Model FLOP utilisation, 0–1 (only when known).
    pub mfu: Option<f64>,
}

impl SweepBar {
    fn value(&self) -> Option<f64> {
        self.tokens_per_s_per_rank
            .filter(|v| self.status == "ok" && v.is_finite() && *v >= 0.0)
    }
}

/// Width of a bar's slot, at most, in pixels.
const SLOT: f64 = 56.0;

/// Draws the sweep: exactly one `<rect>` per successful layout, sorted by tokens/s per rank
/// (highest first); every other layout gets a dashed empty slot labelled with its status.
pub fn sweep_svg(title: &str, bars: &[SweepBar]) -> String {
    let order = ranked(bars);
    let longest = order
        .iter()
        .map(|b| b.name.chars().count())
        .max()
        .unwrap_or(0) as f64;
    let width = (180.0 + SLOT * order.len() as f64).max(640.0);
    let label_room = 30.0 + 6.5 * longest * 0.6;
    let frame = Frame {
        left: 90.0,
        top: 70.0,
        width: width - 180.0,
        height: 300.0,
    };
    let mut svg = Svg::new(width, frame.bottom() + label_room + 40.0);
    svg.text(frame.left, 28.0, title, 15.0, Anchor::Start);
    svg.legend(
        frame.left,
        52.0,
        &[
            (svg::BLUE, "tokens/s per rank"),
            (svg::VERMILLION, "MFU (right axis)"),
        ],
    );
    let scales = axes(&mut svg, &frame, &order);
    let step = frame.width / order.len().max(1) as f64;
    let mut mfu_points = Vec::new();
    for (i, bar) in order.iter().enumerate() {
        let centre = frame.left + step * (i as f64 + 0.5);
        let w = step.min(SLOT) * 0.7;
        mfu_points.extend(draw_bar(&mut svg, &frame, &scales, bar, (centre, w)));
    }
    let line: Vec<(f64, f64)> = mfu_points.iter().map(|(x, y, _)| (*x, *y)).collect();
    svg.polyline(&line, svg::VERMILLION, 1.5, "mfu");
    for (x, y, tip) in &mfu_points {
        svg.circle(*x, *y, 4.0, svg::VERMILLION, "mfu", tip);
    }
    if order.is_empty() {
        svg.text(
            frame.left + frame.width / 2.0,
            frame.top + frame.height / 2.0,
            "no layouts",
            13.0,
            Anchor::Middle,
        );
    }
    svg.finish()
}

/// The bars in drawing order: successful layouts by tokens/s per rank, highest first, then
/// the others in their given order.
fn ranked(bars: &[SweepBar]) -> Vec<&SweepBar> {
    let mut order: Vec<&SweepBar> = bars.iter().filter(|b| b.value().is_some()).collect();
    order.sort_by(|a, b| {
        b.value()
            .partial_cmp(&a.value())
            .unwrap_or(std::cmp::Ordering::Equal)
    });
    order.extend(bars.iter().filter(|b| b.value().is_none()));
    order
}

/// The chart's vertical scales: tokens/s per rank (left) and MFU in percent (right).
struct Scales {
    tps: Scale,
    mfu: Scale,
}

/// Draws the axes (the MFU axis only when some successful layout has an MFU) and the
/// baseline; returns their scales.
fn axes(svg: &mut Svg, frame: &Frame, order: &[&SweepBar]) -> Scales {
    let max_tps = order.iter().filter_map(|b| b.value()).fold(0.0, f64::max);
    let ticks = nice_ticks(0.0, if max_tps > 0.0 { max_tps } else { 1.0 }, 5);
    let y = Scale::new(0.0, ticks[ticks.len() - 1], frame.bottom(), frame.top);
    frame.y_axis(svg, &y, &ticks, fmt_num, "tokens/s per rank", false);
    let mfus: Vec<f64> = order
        .iter()
        .filter(|b| b.value().is_some())
        .filter_map(|b| b.mfu)
        .filter(|m| m.is_finite())
        .collect();
    let max_mfu = mfus.iter().fold(0.0, |a: f64, b| a.max(*b)) * 100.0;
    let mfu_ticks = nice_ticks(0.0, if max_mfu > 0.0 { max_mfu } else { 1.0 }, 5);
    let y_mfu = Scale::new(
        0.0,
        mfu_ticks[mfu_ticks.len() - 1],
        frame.bottom(),
        frame.top,
    );
    if !mfus.is_empty() {
        frame.y_axis(
            svg,
            &y_mfu,
            &mfu_ticks,
            |v| format!("{}%", fmt_num(v)),
            "MFU",
            true,
        );
    }
    svg.line(
        frame.left,
        frame.bottom(),
        frame.right(),
        frame.bottom(),
        svg::INK,
        1.0,
    );
    Scales { tps: y, mfu: y_mfu }
}

/// Draws one layout's bar (or, failed, its labelled empty slot) `w` wide at `centre`, and
/// its name; returns its MFU point (x, y, tooltip) when it has one.
fn draw_bar(
    svg: &mut Svg,
    frame: &Frame,
    scales: &Scales,
    bar: &SweepBar,
    (centre, w): (f64, f64),
) -> Option<(f64, f64, String)> {
    let mut point = None;
    match bar.value() {
        Some(v) => {
            let top = scales.tps.map(v);
            let tip = format!("{}: {v:.1} tokens/s per rank", bar.name);
            svg.rect(
                [centre - w / 2.0, top, w, frame.bottom() - top],
                svg::BLUE,
                "bar",
                &tip,
            );
            svg.text(centre, top - 5.0, &fmt_num(v), 11.0, Anchor::Middle);
            point = bar.mfu.filter(|m| m.is_finite()).map(|m| {
                (
                    centre,
                    scales.mfu.map(m * 100.0),
                    format!("{}: MFU {:.2}%", bar.name, m * 100.0),
                )
            });
        }
        None => {
            let h = frame.height * 0.45;
            svg.outline(
                [centre - w / 2.0, frame.bottom() - h, w, h],
                "none",
                svg::FAINT,
                true,
            );
            svg.text_rotated(
                centre + 4.0,
                frame.bottom() - 6.0,
                &bar.status,
                11.0,
                Anchor::Start,
                -90.0,
            );
        }
    }
    let ly = frame.bottom() + 14.0;
    svg.text_rotated(centre, ly, &bar.name, 11.0, Anchor::End, -35.0);
    point
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bar(name: &str, status: &str, tps: Option<f64>, mfu: Option<f64>) -> SweepBar {
        SweepBar {
            name: name.into(),
            status: status.into(),
            tokens_per_s_per_rank: tps,
            mfu,
        }
    }

    #[test]
    fn bars_are_sorted_and_failures_are_empty_slots() {
        let bars = [
            bar("slow", "ok", Some(10.0), Some(0.1)),
            bar("bad", "invalid_layout", None, None),
            bar("fast", "ok", Some(30.0), Some(0.3)),
            bar("oom", "out_of_memory", None, None),
        ];
        let text = sweep_svg("sweep", &bars);
        assert!(text.starts_with("<svg"));
        assert_eq!(text.matches("<rect").count(), 2);
        assert_eq!(text.matches(r#"<circle class="mfu""#).count(), 2);
        let pos = |s: &str| text.find(&format!(">{s}</text>")).unwrap();
        assert!(pos("fast") < pos("slow") && pos("slow") < pos("bad") && pos("bad") < pos("oom"));
        assert!(text.contains(">invalid_layout</text>") && text.contains(">out_of_memory</text>"));
        assert!(text.contains("30%"), "MFU axis reaches 30%");
    }

    #[test]
    fn all_failed_or_empty_sweeps_still_draw() {
        let text = sweep_svg("sweep", &[bar("x", "crashed", None, None)]);
        assert_eq!(text.matches("<rect").count(), 0);
        assert!(text.contains(">crashed</text>"));
        assert!(sweep_svg("sweep", &[]).contains("no layouts"));
    }
}
