//! PNG charts for the benchmark reports: plotters' bitmap backend, with the DejaVu Sans font
//! compiled in (the `dejavu` crate), so drawing text needs no system font library.

use std::path::Path;
use std::sync::OnceLock;

use anyhow::{anyhow, bail, Result};
use plotters::prelude::*;
use plotters::style::FontStyle;

/// One line of a chart, with a marker at each point.
#[derive(Debug, Clone)]
pub struct Series {
    pub label: String,
    pub points: Vec<(f64, f64)>,
    /// Dashed (a model or a simulation beside a measurement), or solid.
    pub dashed: bool,
    /// Markers only, no line (a scatter).
    pub markers_only: bool,
    /// Index into the palette: series that belong together share a colour.
    pub color: usize,
}

impl Series {
    pub fn line(label: impl Into<String>, color: usize, points: Vec<(f64, f64)>) -> Self {
        Self {
            label: label.into(),
            points,
            dashed: false,
            markers_only: false,
            color,
        }
    }

    pub fn dashed(label: impl Into<String>, color: usize, points: Vec<(f64, f64)>) -> Self {
        Self {
            dashed: true,
            ..Self::line(label, color, points)
        }
    }

    pub fn scatter(label: impl Into<String>, color: usize, points: Vec<(f64, f64)>) -> Self {
        Self {
            markers_only: true,
            ..Self::line(label, color, points)
        }
    }
}

/// One panel.
#[derive(Debug, Clone)]
pub struct Chart {
    pub title: String,
    pub x_desc: String,
    pub y_desc: String,
    /// x on a base-2 logarithmic axis (session counts).
    pub log2_x: bool,
    /// Draw y = x (predicted against measured).
    pub diagonal: bool,
    pub series: Vec<Series>,
}

const PALETTE: [RGBColor; 8] = [
    RGBColor(31, 119, 180),
    RGBColor(214, 39, 40),
    RGBColor(44, 160, 44),
    RGBColor(255, 127, 14),
    RGBColor(148, 103, 189),
    RGBColor(140, 86, 75),
    RGBColor(23, 190, 207),
    RGBColor(80, 80, 80),
];

fn register_font() -> Result<()> {
    static LOADED: OnceLock<bool> = OnceLock::new();
    let ok = *LOADED.get_or_init(|| {
        plotters::style::register_font("sans-serif", FontStyle::Normal, dejavu::sans::regular())
            .is_ok()
    });
    if !ok {
        bail!("the embedded DejaVu Sans font did not load");
    }
    Ok(())
}

fn bounds(values: impl Iterator<Item = f64>) -> Option<(f64, f64)> {
    values.filter(|v| v.is_finite()).fold(None, |b, v| {
        Some(b.map_or((v, v), |(lo, hi)| (v.min(lo), v.max(hi))))
    })
}

/// Draw `charts` side by side into one PNG at `path` (`width` pixels per panel).
pub fn draw(path: &Path, charts: &[Chart], width: u32, height: u32) -> Result<()> {
    register_font()?;
    if charts.is_empty() {
        bail!("no chart to draw into {}", path.display());
    }
    let err = |e: &dyn std::fmt::Display| anyhow!("drawing {}: {e}", path.display());
    let root = BitMapBackend::new(path, (width * charts.len() as u32, height)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| err(&e))?;
    for (area, c) in root.split_evenly((1, charts.len())).iter().zip(charts) {
        panel(area, c).map_err(|e| err(&e))?;
    }
    root.present().map_err(|e| err(&e))?;
    Ok(())
}

type Area<'a> = DrawingArea<BitMapBackend<'a>, plotters::coord::Shift>;

fn panel(area: &Area<'_>, c: &Chart) -> Result<()> {
    let fx = |x: f64| if c.log2_x { x.max(1e-9).log2() } else { x };
    let all = || c.series.iter().flat_map(|s| s.points.iter());
    let (x0, x1) = bounds(all().map(|p| fx(p.0))).unwrap_or((0.0, 1.0));
    let (y0, y1) = bounds(all().map(|p| p.1)).unwrap_or((0.0, 1.0));
    let (y0, y1) = if c.diagonal {
        let (lo, hi) = (x0.min(y0), x1.max(y1));
        (lo.min(0.0), hi * 1.08)
    } else {
        (y0.min(0.0), (y1 * 1.1).max(y0 + 1e-9))
    };
    let (x0, x1) = if c.diagonal {
        (y0, y1)
    } else {
        let pad = ((x1 - x0) * 0.04).max(if c.log2_x { 0.2 } else { 1e-9 });
        (x0 - pad, x1 + pad)
    };
    let mut chart = ChartBuilder::on(area)
        .caption(&c.title, ("sans-serif", 20))
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(60)
        .build_cartesian_2d(x0..x1, y0..y1)?;
    let log2 = c.log2_x;
    let fmt_x = move |v: &f64| {
        if log2 {
            let x = 2f64.powf(*v);
            if (x - x.round()).abs() < 0.05 {
                format!("{}", x.round())
            } else {
                String::new()
            }
        } else {
            format!("{v}")
        }
    };
    chart
        .configure_mesh()
        .x_desc(c.x_desc.as_str())
        .y_desc(c.y_desc.as_str())
        .x_label_formatter(&fmt_x)
        .label_style(("sans-serif", 14))
        .axis_desc_style(("sans-serif", 15))
        .draw()?;
    if c.diagonal {
        chart
            .draw_series(LineSeries::new(
                vec![(x0, x0), (x1, x1)],
                BLACK.mix(0.4).stroke_width(1),
            ))?
            .label("predicted = measured")
            .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], BLACK.mix(0.4)));
    }
    for s in &c.series {
        let color = PALETTE[s.color % PALETTE.len()];
        let pts: Vec<(f64, f64)> = s.points.iter().map(|&(x, y)| (fx(x), y)).collect();
        let style = color.stroke_width(2);
        if s.markers_only {
            chart.draw_series(pts.iter().map(|&p| Circle::new(p, 5, color.filled())))?;
        } else if s.dashed {
            chart.draw_series(DashedLineSeries::new(pts.clone(), 8, 5, style))?;
            chart.draw_series(pts.iter().map(|&p| Cross::new(p, 5, style)))?;
        } else {
            chart.draw_series(LineSeries::new(pts.clone(), style))?;
            chart.draw_series(pts.iter().map(|&p| Circle::new(p, 4, color.filled())))?;
        }
        // An invisible series carries the legend entry.
        let dashed = s.dashed;
        chart
            .draw_series(std::iter::empty::<Circle<(f64, f64), i32>>())?
            .label(s.label.as_str())
            .legend(move |(x, y)| {
                if dashed {
                    PathElement::new(vec![(x, y), (x + 8, y)], style)
                } else {
                    PathElement::new(vec![(x, y), (x + 20, y)], style)
                }
            });
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperLeft)
        .label_font(("sans-serif", 13))
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK.mix(0.5))
        .draw()?;
    Ok(())
}

/// The file is a PNG of some size: what the benchmark's sanity check asks of a plot.
pub fn looks_like_png(path: &Path) -> bool {
    std::fs::read(path)
        .map(|b| b.len() > 2048 && b.starts_with(b"\x89PNG\r\n\x1a\n"))
        .unwrap_or(false)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn draws_a_png_with_text_and_both_axes() {
        let dir = std::env::temp_dir().join(format!("tandem-plot-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("t.png");
        let c = Chart {
            title: "ITL vs sessions".into(),
            x_desc: "sessions".into(),
            y_desc: "ms".into(),
            log2_x: true,
            diagonal: false,
            series: vec![
                Series::line("measured", 0, vec![(1.0, 10.0), (4.0, 12.0), (64.0, 80.0)]),
                Series::dashed("model", 0, vec![(1.0, 11.0), (4.0, 13.0), (64.0, 70.0)]),
            ],
        };
        let d = Chart {
            title: "predicted vs measured".into(),
            x_desc: "measured".into(),
            y_desc: "predicted".into(),
            log2_x: false,
            diagonal: true,
            series: vec![Series::scatter("rows", 1, vec![(10.0, 11.0), (50.0, 45.0)])],
        };
        draw(&path, &[c, d], 400, 300).unwrap();
        assert!(looks_like_png(&path));
        std::fs::write(&path, b"not a png").unwrap();
        assert!(!looks_like_png(&path));
        std::fs::remove_dir_all(&dir).ok();
        assert!(draw(&path, &[], 400, 300).is_err());
    }
}
