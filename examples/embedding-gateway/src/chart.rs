//! A hand-written SVG line chart: one line per tenant, tokens per second over time.

use std::fmt::Write as _;

/// One line of the chart.
#[derive(Debug, Clone)]
pub struct Series {
    /// Its name in the legend.
    pub name: String,
    /// Values at times `0, step, 2·step, ...`.
    pub values: Vec<f64>,
}

const COLORS: [&str; 8] = ["#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#17becf"];

/// A horizontal dashed line across the chart, labelled.
#[derive(Debug, Clone)]
pub struct Reference {
    /// Its label, drawn above it at the right.
    pub label: String,
    /// Its value.
    pub value: f64,
}

/// An SVG document plotting `series` against time, one value every `step_secs` from 0,
/// with dashed `references`.
#[must_use]
pub fn line_chart(title: &str, y_label: &str, step_secs: f64, series: &[Series], references: &[Reference]) -> String {
    let (width, height) = (860.0, 420.0);
    let (left, right, top, bottom) = (72.0, 170.0, 40.0, 50.0);
    let plot_w: f64 = width - left - right;
    let plot_h: f64 = height - top - bottom;
    let points = series.iter().map(|s| s.values.len()).max().unwrap_or(0).max(2);
    let duration = (points - 1) as f64 * step_secs;
    let max = series
        .iter()
        .flat_map(|s| s.values.iter().copied())
        .chain(references.iter().map(|r| r.value))
        .fold(0.0, f64::max);
    // A little room above the highest line or reference, for its label.
    let (y_max, y_step) = nice_scale(max * 1.08);
    let x = |t: f64| left + t / duration * plot_w;
    let y = |v: f64| top + plot_h - v / y_max * plot_h;

    let mut svg = String::new();
    let _ = writeln!(
        svg,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" viewBox="0 0 {width} {height}" font-family="sans-serif" font-size="12">"#
    );
    let _ = writeln!(svg, r#"<rect width="{width}" height="{height}" fill="white"/>"#);
    let _ = writeln!(svg, r#"<text x="{left}" y="24" font-size="15" font-weight="bold">{}</text>"#, escape(title));
    // Grid and y ticks.
    let mut v = 0.0;
    while v <= y_max + y_step / 2.0 {
        let yy = y(v);
        let _ = writeln!(
            svg,
            r##"<line x1="{left}" y1="{yy:.1}" x2="{:.1}" y2="{yy:.1}" stroke="#e0e0e0"/><text x="{:.1}" y="{:.1}" text-anchor="end">{}</text>"##,
            left + plot_w,
            left - 6.0,
            yy + 4.0,
            short_number(v)
        );
        v += y_step;
    }
    // X ticks, every second (or every few when long).
    let step = (duration / 10.0).ceil().max(1.0);
    let mut t = 0.0;
    while t <= duration + 1e-9 {
        let xx = x(t);
        let _ = writeln!(
            svg,
            r##"<line x1="{xx:.1}" y1="{:.1}" x2="{xx:.1}" y2="{:.1}" stroke="#999"/><text x="{xx:.1}" y="{:.1}" text-anchor="middle">{t}s</text>"##,
            top + plot_h,
            top + plot_h + 5.0,
            top + plot_h + 19.0
        );
        t += step;
    }
    let _ =
        writeln!(svg, r##"<rect x="{left}" y="{top}" width="{plot_w}" height="{plot_h}" fill="none" stroke="#333"/>"##);
    let _ = writeln!(
        svg,
        r#"<text x="{:.1}" y="{:.1}" text-anchor="middle">time</text>"#,
        left + plot_w / 2.0,
        height - 10.0
    );
    let _ = writeln!(
        svg,
        r#"<text transform="translate(16 {:.1}) rotate(-90)" text-anchor="middle">{}</text>"#,
        top + plot_h / 2.0,
        escape(y_label)
    );
    for r in references {
        let yy = y(r.value);
        let _ = writeln!(
            svg,
            r##"<line x1="{left}" y1="{yy:.1}" x2="{:.1}" y2="{yy:.1}" stroke="#555" stroke-dasharray="6 4"/><text x="{:.1}" y="{:.1}" text-anchor="end" fill="#555">{}</text>"##,
            left + plot_w,
            left + plot_w - 4.0,
            yy - 4.0,
            escape(&r.label)
        );
    }
    // Lines and legend.
    for (i, s) in series.iter().enumerate() {
        let color = COLORS[i % COLORS.len()];
        let mut points = String::new();
        for (k, value) in s.values.iter().enumerate() {
            let _ = write!(points, "{:.1},{:.1} ", x(k as f64 * step_secs), y(*value));
        }
        let _ = writeln!(
            svg,
            r#"<polyline fill="none" stroke="{color}" stroke-width="2" points="{}"/>"#,
            points.trim_end()
        );
        let ly = top + 10.0 + i as f64 * 20.0;
        let lx = left + plot_w + 16.0;
        let _ = writeln!(
            svg,
            r#"<line x1="{lx:.1}" y1="{ly:.1}" x2="{:.1}" y2="{ly:.1}" stroke="{color}" stroke-width="3"/><text x="{:.1}" y="{:.1}">{}</text>"#,
            lx + 22.0,
            lx + 28.0,
            ly + 4.0,
            escape(&s.name)
        );
    }
    svg.push_str("</svg>\n");
    svg
}

/// A top of the axis and a tick step: 1, 2 or 5 times a power of ten, about five ticks.
fn nice_scale(max: f64) -> (f64, f64) {
    if max <= 0.0 || !max.is_finite() {
        return (1.0, 0.2);
    }
    let raw = max / 5.0;
    let magnitude = 10f64.powf(raw.log10().floor());
    let step = [1.0, 2.0, 5.0, 10.0].iter().map(|m| m * magnitude).find(|s| *s >= raw).unwrap_or(10.0 * magnitude);
    ((max / step).ceil() * step, step)
}

fn short_number(v: f64) -> String {
    if v >= 1000.0 { format!("{}k", (v / 100.0).round() / 10.0) } else { format!("{}", v.round()) }
}

fn escape(text: &str) -> String {
    text.replace('&', "&amp;").replace('<', "&lt;").replace('>', "&gt;").replace('"', "&quot;")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scales_are_round() {
        assert_eq!(nice_scale(9_300.0), (10_000.0, 2_000.0));
        assert_eq!(nice_scale(0.0), (1.0, 0.2));
        assert_eq!(nice_scale(47.0), (50.0, 10.0));
    }

    #[test]
    fn charts_are_svg_with_one_line_per_series() {
        let svg = line_chart(
            "t",
            "tokens/s",
            0.5,
            &[Series { name: "a<b".into(), values: vec![1.0, 2.0] }, Series { name: "c".into(), values: vec![3.0] }],
            &[Reference { label: "cap".into(), value: 4.0 }],
        );
        assert!(svg.starts_with("<svg"));
        assert_eq!(svg.matches("<polyline").count(), 2);
        assert!(svg.contains("a&lt;b"));
        assert!(svg.contains("stroke-dasharray"));
    }
}
