//! A minimal SVG writer: shapes, text, axes with "nice" ticks, and number formatting.
//!
//! Coordinates are pixels with y growing downwards, as in SVG; [`Scale`] maps data values
//! onto a pixel range (pass the range reversed for a y axis).

use std::fmt::Write;

/// Colours used across the charts (colour-blind friendly, from the Okabe–Ito palette).
pub const BLUE: &str = "#0072B2";
/// Second series colour.
pub const ORANGE: &str = "#E69F00";
/// Third series colour.
pub const VERMILLION: &str = "#D55E00";
/// Fourth series colour.
pub const GREEN: &str = "#009E73";
/// Fifth series colour.
pub const PURPLE: &str = "#CC79A7";
/// Sixth series colour.
pub const SKY: &str = "#56B4E9";
/// Axes, ticks and labels.
pub const INK: &str = "#333333";
/// Seventh series colour (Okabe–Ito yellow).
pub const YELLOW: &str = "#F0E442";
/// Grid lines and empty slots.
pub const FAINT: &str = "#DDDDDD";

/// Horizontal anchoring of a text.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Anchor {
    /// Text starts at x.
    Start,
    /// Text is centred on x.
    Middle,
    /// Text ends at x.
    End,
}

impl Anchor {
    fn as_str(self) -> &'static str {
        match self {
            Anchor::Start => "start",
            Anchor::Middle => "middle",
            Anchor::End => "end",
        }
    }
}

/// An SVG document being written.
pub struct Svg {
    width: f64,
    height: f64,
    body: String,
}

/// Escapes text for use inside SVG elements and attribute values.
pub fn escape(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&apos;"),
            c if (c as u32) < 0x20 && c != '\n' && c != '\t' => out.push(' '),
            c => out.push(c),
        }
    }
    out
}

impl Svg {
    /// An empty `width` × `height` document with a white background.
    pub fn new(width: f64, height: f64) -> Self {
        Svg {
            width,
            height,
            body: String::new(),
        }
    }

    /// A filled rectangle (`[x, y, width, height]`); `class` and a hover `title` are optional.
    pub fn rect(&mut self, [x, y, w, h]: [f64; 4], fill: &str, class: &str, title: &str) {
        let _ = write!(
            self.body,
            r#"<rect class="{class}" x="{x:.1}" y="{y:.1}" width="{:.1}" height="{:.1}" fill="{fill}">"#,
            w.max(0.0),
            h.max(0.0)
        );
        let _ = writeln!(self.body, "<title>{}</title></rect>", escape(title));
    }

    /// A closed outline of `[x, y, width, height]` (a path, not a `rect`), dashed when
    /// `dashed`; used for legend swatches and empty slots.
    pub fn outline(&mut self, [x, y, w, h]: [f64; 4], fill: &str, stroke: &str, dashed: bool) {
        let dash = if dashed {
            r#" stroke-dasharray="4 3""#
        } else {
            ""
        };
        let _ = writeln!(
            self.body,
            r#"<path d="M{x:.1},{y:.1}h{w:.1}v{h:.1}h{:.1}z" fill="{fill}" stroke="{stroke}"{dash}/>"#,
            -w
        );
    }

    /// A straight line.
    pub fn line(&mut self, x1: f64, y1: f64, x2: f64, y2: f64, stroke: &str, width: f64) {
        let _ = writeln!(
            self.body,
            r#"<line x1="{x1:.1}" y1="{y1:.1}" x2="{x2:.1}" y2="{y2:.1}" stroke="{stroke}" stroke-width="{width}"/>"#
        );
    }

    /// A polyline through `points`, with a `class` naming the series.
    pub fn polyline(&mut self, points: &[(f64, f64)], stroke: &str, width: f64, class: &str) {
        let pts: Vec<String> = points
            .iter()
            .map(|(x, y)| format!("{x:.1},{y:.1}"))
            .collect();
        let _ = writeln!(
            self.body,
            r#"<polyline class="{class}" points="{}" fill="none" stroke="{stroke}" stroke-width="{width}" stroke-linejoin="round"/>"#,
            pts.join(" ")
        );
    }

    /// A dot with a hover `title`.
    pub fn circle(&mut self, cx: f64, cy: f64, r: f64, fill: &str, class: &str, title: &str) {
        let _ = writeln!(
            self.body,
            r#"<circle class="{class}" cx="{cx:.1}" cy="{cy:.1}" r="{r}" fill="{fill}" stroke="white"><title>{}</title></circle>"#,
            escape(title)
        );
    }

    /// A text label of `size` px.
    pub fn text(&mut self, x: f64, y: f64, text: &str, size: f64, anchor: Anchor) {
        self.text_rotated(x, y, text, size, anchor, 0.0);
    }

    /// A text label rotated by `degrees` around its anchor point.
    pub fn text_rotated(
        &mut self,
        x: f64,
        y: f64,
        text: &str,
        size: f64,
        anchor: Anchor,
        degrees: f64,
    ) {
        let rotate = if degrees == 0.0 {
            String::new()
        } else {
            format!(r#" transform="rotate({degrees} {x:.1} {y:.1})""#)
        };
        let _ = writeln!(
            self.body,
            r#"<text x="{x:.1}" y="{y:.1}" font-size="{size}" text-anchor="{}" fill="{INK}"{rotate}>{}</text>"#,
            anchor.as_str(),
            escape(text)
        );
    }

    /// A legend: one swatch and label per entry, in a row starting at (`x`, `y`).
    pub fn legend(&mut self, x: f64, y: f64, entries: &[(&str, &str)]) {
        let mut at = x;
        for (colour, label) in entries {
            self.outline([at, y - 9.0, 10.0, 10.0], colour, colour, false);
            self.text(at + 14.0, y, label, 12.0, Anchor::Start);
            at += 30.0 + 6.5 * label.chars().count() as f64;
        }
    }

    /// The finished document.
    pub fn finish(self) -> String {
        format!(
            "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{w}\" height=\"{h}\" viewBox=\"0 0 {w} {h}\" font-family=\"sans-serif\" style=\"background:#ffffff\">\n{}</svg>\n",
            self.body,
            w = self.width,
            h = self.height,
        )
    }
}

/// A linear map from data values `[d0, d1]` onto pixels `[p0, p1]`.
#[derive(Debug, Clone, Copy)]
pub struct Scale {
    d0: f64,
    d1: f64,
    p0: f64,
    p1: f64,
}

impl Scale {
    /// Maps `[d0, d1]` onto `[p0, p1]`; an empty data range is widened so nothing divides by 0.
    pub fn new(d0: f64, d1: f64, p0: f64, p1: f64) -> Self {
        let d1 = if d1 > d0 { d1 } else { d0 + 1.0 };
        Scale { d0, d1, p0, p1 }
    }

    /// Pixel position of `v`.
    pub fn map(&self, v: f64) -> f64 {
        self.p0 + (v - self.d0) / (self.d1 - self.d0) * (self.p1 - self.p0)
    }
}

/// About `target` evenly spaced round ticks (1, 2 or 5 × 10ᵏ apart) covering `[lo, hi]`:
/// the first tick is ≤ `lo` and the last ≥ `hi`, so the ends serve as the axis range.
pub fn nice_ticks(lo: f64, hi: f64, target: usize) -> Vec<f64> {
    let (lo, hi) = match (lo.is_finite(), hi.is_finite()) {
        (true, true) if hi > lo => (lo, hi),
        (true, true) => (lo - 0.5 * lo.abs().max(1.0), lo + 0.5 * lo.abs().max(1.0)),
        _ => (0.0, 1.0),
    };
    let raw = (hi - lo) / target.max(1) as f64;
    let magnitude = 10f64.powf(raw.log10().floor());
    let step = [1.0, 2.0, 5.0, 10.0]
        .iter()
        .map(|m| m * magnitude)
        .find(|s| *s >= raw)
        .unwrap_or(10.0 * magnitude);
    let first = (lo / step).floor();
    let last = (hi / step).ceil();
    let count = ((last - first) as usize).min(50);
    (0..=count).map(|i| (first + i as f64) * step).collect()
}

/// A compact number: `12.3k`, `4.5M`, `7722`, `4.155`, `0.25`, `3e-4`.
pub fn fmt_num(v: f64) -> String {
    let a = v.abs();
    if v == 0.0 {
        "0".to_string()
    } else if a >= 1e9 {
        format!("{}G", trim(v / 1e9, 1))
    } else if a >= 1e6 {
        format!("{}M", trim(v / 1e6, 1))
    } else if a >= 1e4 {
        format!("{}k", trim(v / 1e3, 1))
    } else if a >= 0.01 {
        // Four significant digits.
        let decimals = (3.0 - a.log10().floor()).max(0.0) as usize;
        trim(v, decimals)
    } else {
        format!("{v:.0e}")
    }
}

/// Bytes with binary units: `512 B`, `1.5 KiB`, `3.2 MiB`, `1 GiB`.
pub fn fmt_bytes(v: f64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut value = v;
    let mut unit = 0;
    while value.abs() >= 1024.0 && unit < UNITS.len() - 1 {
        value /= 1024.0;
        unit += 1;
    }
    format!("{} {}", trim(value, 1), UNITS[unit])
}

/// `v` with at most `decimals` decimals and no trailing zeros.
fn trim(v: f64, decimals: usize) -> String {
    let s = format!("{v:.decimals$}");
    if s.contains('.') {
        s.trim_end_matches('0').trim_end_matches('.').to_string()
    } else {
        s
    }
}

/// The plotting area of a chart, in pixels.
#[derive(Debug, Clone, Copy)]
pub struct Frame {
    /// Left edge.
    pub left: f64,
    /// Top edge.
    pub top: f64,
    /// Width.
    pub width: f64,
    /// Height.
    pub height: f64,
}

impl Frame {
    /// Right edge.
    pub fn right(&self) -> f64 {
        self.left + self.width
    }

    /// Bottom edge.
    pub fn bottom(&self) -> f64 {
        self.top + self.height
    }

    /// Draws a y axis at the left (`right = false`) or right edge with `ticks` labelled by
    /// `fmt` and a rotated `label`; left axes also draw horizontal grid lines.
    pub fn y_axis(
        &self,
        svg: &mut Svg,
        scale: &Scale,
        ticks: &[f64],
        fmt: fn(f64) -> String,
        label: &str,
        right: bool,
    ) {
        let x = if right { self.right() } else { self.left };
        svg.line(x, self.top, x, self.bottom(), INK, 1.0);
        let (dir, anchor) = if right {
            (1.0, Anchor::Start)
        } else {
            (-1.0, Anchor::End)
        };
        for &t in ticks {
            let y = scale.map(t);
            if !right {
                svg.line(self.left, y, self.right(), y, FAINT, 1.0);
            }
            svg.line(x, y, x + 5.0 * dir, y, INK, 1.0);
            svg.text(x + 8.0 * dir, y + 4.0, &fmt(t), 11.0, anchor);
        }
        let lx = x + 58.0 * dir;
        let ly = self.top + self.height / 2.0;
        svg.text_rotated(
            lx,
            ly,
            label,
            12.0,
            Anchor::Middle,
            if right { 90.0 } else { -90.0 },
        );
    }

    /// Draws the x axis with `ticks` labelled by `fmt` and a `label` below.
    pub fn x_axis(
        &self,
        svg: &mut Svg,
        scale: &Scale,
        ticks: &[f64],
        fmt: fn(f64) -> String,
        label: &str,
    ) {
        let y = self.bottom();
        svg.line(self.left, y, self.right(), y, INK, 1.0);
        for &t in ticks {
            let x = scale.map(t);
            svg.line(x, y, x, y + 5.0, INK, 1.0);
            svg.text(x, y + 18.0, &fmt(t), 11.0, Anchor::Middle);
        }
        svg.text(
            self.left + self.width / 2.0,
            y + 36.0,
            label,
            12.0,
            Anchor::Middle,
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ticks_are_round_and_cover_the_range() {
        assert_eq!(
            nice_ticks(0.0, 10.0, 5),
            vec![0.0, 2.0, 4.0, 6.0, 8.0, 10.0]
        );
        let t = nice_ticks(0.13, 0.87, 4);
        assert_eq!(t.first().copied(), Some(0.0));
        assert!(
            (t[1] - 0.2).abs() < 1e-12 && *t.last().unwrap() >= 0.87,
            "{t:?}"
        );
        // Degenerate and non-finite ranges still give a usable axis.
        assert!(nice_ticks(5.0, 5.0, 4).len() >= 2);
        assert_eq!(nice_ticks(f64::NAN, 1.0, 4).first().copied(), Some(0.0));
    }

    #[test]
    fn numbers_and_bytes_format_compactly() {
        assert_eq!(fmt_num(0.0), "0");
        assert_eq!(fmt_num(12_345.0), "12.3k");
        assert_eq!(fmt_num(2_500_000.0), "2.5M");
        assert_eq!(fmt_num(0.25), "0.25");
        assert_eq!(fmt_num(7721.602), "7722");
        assert_eq!(fmt_num(4.155), "4.155");
        assert_eq!(fmt_num(0.0123), "0.0123");
        assert_eq!(fmt_num(0.0003), "3e-4");
        assert_eq!(fmt_bytes(512.0), "512 B");
        assert_eq!(fmt_bytes(1536.0), "1.5 KiB");
        assert_eq!(fmt_bytes(3.0 * 1024.0 * 1024.0 * 1024.0), "3 GiB");
    }

    #[test]
    fn text_is_escaped_and_scale_maps_linearly() {
        let mut svg = Svg::new(10.0, 10.0);
        svg.text(0.0, 0.0, "a<b & \"c\"", 10.0, Anchor::Start);
        let s = svg.finish();
        assert!(
            s.starts_with("<svg") && s.contains("a&lt;b &amp; &quot;c&quot;"),
            "{s}"
        );
        let y = Scale::new(0.0, 10.0, 100.0, 0.0);
        assert_eq!(y.map(0.0), 100.0);
        assert_eq!(y.map(5.0), 50.0);
        assert_eq!(Scale::new(3.0, 3.0, 0.0, 10.0).map(3.0), 0.0);
    }
}
