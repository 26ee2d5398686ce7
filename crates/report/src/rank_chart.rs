//! The per-rank time breakdown of a traced run: one stacked bar per rank, split into compute,
//! exposed communication, pipeline bubble and other (from the step report).

use crate::run_data::MEMORY_CATEGORIES;
use crate::svg::{self, fmt_num, nice_ticks, Anchor, Frame, Scale, Svg};

/// One rank's seconds over the traced steps.
#[derive(Debug, Clone, Copy)]
pub struct RankTime {
    /// World rank.
    pub rank: usize,
    /// Computing.
    pub compute: f64,
    /// Blocked on communication other than the pipeline.
    pub exposed: f64,
    /// Blocked on a pipeline neighbour.
    pub bubble: f64,
    /// Not covered by any span.
    pub other: f64,
}

/// The chart as SVG text.
pub fn ranks_svg(ranks: &[RankTime]) -> String {
    let mut svg = Svg::new(760.0, 440.0);
    let frame = Frame {
        left: 80.0,
        top: 70.0,
        width: 620.0,
        height: 290.0,
    };
    let parts = |r: &RankTime| [r.compute, r.exposed, r.bubble, r.other.max(0.0)];
    let max = ranks
        .iter()
        .map(|r| parts(r).iter().sum::<f64>())
        .fold(0.0, f64::max);
    let ticks = nice_ticks(0.0, if max > 0.0 { max } else { 1.0 }, 5);
    let hi = ticks.last().copied().unwrap_or(1.0).max(max);
    let y = Scale::new(0.0, hi, frame.bottom(), frame.top);
    svg.text(
        frame.left,
        28.0,
        "Time per rank over the traced steps",
        15.0,
        Anchor::Start,
    );
    let names = [
        "compute",
        "exposed communication",
        "pipeline bubble",
        "other",
    ];
    let colours = [svg::BLUE, svg::VERMILLION, svg::ORANGE, svg::FAINT];
    let entries: Vec<(&str, &str)> = (0..4).map(|i| (colours[i], names[i])).collect();
    svg.legend(frame.left, 52.0, &entries);
    frame.y_axis(&mut svg, &y, &ticks, fmt_num, "seconds", false);
    svg.line(
        frame.left,
        frame.bottom(),
        frame.right(),
        frame.bottom(),
        svg::INK,
        1.0,
    );
    let slot = frame.width / ranks.len().max(1) as f64;
    for (i, r) in ranks.iter().enumerate() {
        let x = frame.left + slot * i as f64 + slot * 0.15;
        let mut base = 0.0;
        for (k, v) in parts(r).iter().enumerate() {
            let (top, bottom) = (y.map(base + v), y.map(base));
            let title = format!("rank {}: {} {:.3} s", r.rank, names[k], v);
            svg.rect(
                [x, top, slot * 0.7, bottom - top],
                colours[k],
                "part",
                &title,
            );
            base += v;
        }
        svg.text(
            x + slot * 0.35,
            frame.bottom() + 18.0,
            &format!("rank {}", r.rank),
            11.0,
            Anchor::Middle,
        );
    }
    svg.finish()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_stacked_bar_of_four_parts_per_rank() {
        let ranks: Vec<RankTime> = (0..3)
            .map(|rank| RankTime {
                rank,
                compute: 1.0,
                exposed: 0.2,
                bubble: 0.1 * rank as f64,
                other: 0.01,
            })
            .collect();
        let text = ranks_svg(&ranks);
        assert!(text.starts_with("<svg"));
        assert_eq!(text.matches("class=\"part\"").count(), 12);
        assert!(text.contains("rank 2: pipeline bubble 0.200 s"));
    }
}

/// Memory per category over the traced steps of one rank: one line per category, from
/// samples `(seconds, bytes per category)` taken at the edges of its layers' spans.
pub fn memory_timeline_svg(
    rank: usize,
    samples: &[(f64, [usize; ferrotron_config::MemoryCategory::COUNT])],
) -> String {
    let mut svg = Svg::new(760.0, 440.0);
    let frame = Frame {
        left: 90.0,
        top: 70.0,
        width: 610.0,
        height: 290.0,
    };
    let t0 = samples.first().map(|s| s.0).unwrap_or(0.0);
    let t1 = samples.last().map(|s| s.0).unwrap_or(1.0).max(t0 + 1e-9);
    let mib = |b: usize| b as f64 / (1u64 << 20) as f64;
    let max = samples
        .iter()
        .flat_map(|s| s.1.iter().map(|b| mib(*b)))
        .fold(0.0, f64::max);
    let yt = nice_ticks(0.0, if max > 0.0 { max } else { 1.0 }, 5);
    let y = Scale::new(
        0.0,
        yt.last().copied().unwrap_or(1.0).max(max),
        frame.bottom(),
        frame.top,
    );
    let xt = nice_ticks(0.0, t1 - t0, 6);
    let x = Scale::new(
        0.0,
        xt.last().copied().unwrap_or(t1 - t0).max(t1 - t0),
        frame.left,
        frame.right(),
    );
    svg.text(
        frame.left,
        28.0,
        &format!("Memory per category over the traced steps (rank {rank})"),
        15.0,
        Anchor::Start,
    );
    let colours = [
        svg::BLUE,
        svg::SKY,
        svg::GREEN,
        svg::ORANGE,
        svg::PURPLE,
        svg::VERMILLION,
        svg::YELLOW,
    ];
    let entries: Vec<(&str, &str)> = (0..colours.len())
        .map(|i| (colours[i], MEMORY_CATEGORIES[i]))
        .collect();
    svg.legend(frame.left, 52.0, &entries);
    frame.y_axis(&mut svg, &y, &yt, fmt_num, "MiB", false);
    frame.x_axis(&mut svg, &x, &xt, fmt_num, "seconds");
    for (i, colour) in colours.iter().enumerate() {
        let points: Vec<(f64, f64)> = samples
            .iter()
            .map(|(t, b)| (x.map(t - t0), y.map(mib(b[i]))))
            .collect();
        svg.polyline(&points, colour, 1.5, MEMORY_CATEGORIES[i]);
    }
    svg.finish()
}

#[cfg(test)]
mod timeline_tests {
    use super::*;

    #[test]
    fn one_line_per_category_through_every_sample() {
        let samples: Vec<(f64, [usize; ferrotron_config::MemoryCategory::COUNT])> = (0..5)
            .map(|i| {
                (
                    i as f64 * 0.1,
                    [1 << 20, 0, 2 << 20, i << 20, 0, 0, 3 << 20],
                )
            })
            .collect();
        let text = memory_timeline_svg(0, &samples);
        assert!(text.starts_with("<svg"));
        assert_eq!(text.matches("<polyline").count(), 7);
    }
}
