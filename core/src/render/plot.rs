//! Line plots (loss curves, per-position NLL) as PNG, drawn with plotters:
//! a title, axis labels, 1-2-5 ticks with numeric labels, a grid, several
//! series in distinct colours and a legend. Non-finite points are skipped
//! (they break the line); values are clamped to +-1e300 and segments are
//! clipped to the axes here, before plotters sees them, so that no pixel
//! coordinate can overflow.

use std::ops::Range;
use std::path::Path;

use anyhow::Result;
use plotters::coord::ranged1d::{DefaultFormatting, KeyPointHint, Ranged};
use plotters::prelude::*;
use plotters::style::text_anchor::HPos;

use super::font::{text_width, Direction, Text};
use super::picture::{colour, draw_png, hsv, Rgb};

/// Width of the pictures [`line_plot_png`] draws.
pub const PLOT_WIDTH: u32 = 900;
/// Height of the pictures [`line_plot_png`] draws.
pub const PLOT_HEIGHT: u32 = 540;

/// One named line of (x, y) points.
#[derive(Debug, Clone, PartialEq)]
pub struct Series {
    /// Its legend entry.
    pub name: String,
    /// The points in drawing order.
    pub points: Vec<(f64, f64)>,
}

/// Space left of the axes (y tick labels and the y axis label).
const LEFT: u32 = 88;
/// Space right of the axes.
const RIGHT: u32 = 24;
/// Space above the axes (the title).
const TOP: u32 = 44;
/// Space below the axes (x tick labels and the x axis label).
const BOTTOM: u32 = 56;
const TITLE_SIZE: f64 = 20.0;
const LABEL_SIZE: f64 = 13.0;
const DESC_SIZE: f64 = 14.0;
const BG: Rgb = [255, 255, 255];
const AXIS: Rgb = [40, 40, 40];
const GRID: Rgb = [228, 228, 232];
const TEXT: Rgb = [20, 20, 20];

const PALETTE: [Rgb; 10] = [
    [31, 119, 180],
    [255, 127, 14],
    [44, 160, 44],
    [214, 39, 40],
    [148, 103, 189],
    [140, 86, 75],
    [227, 119, 194],
    [127, 127, 127],
    [188, 189, 34],
    [23, 190, 207],
];

fn series_colour(i: usize) -> Rgb {
    PALETTE
        .get(i)
        .copied()
        .unwrap_or_else(|| hsv(i as f64 * 0.618_034, 0.8, 0.75))
}

/// Values beyond this are clamped so that ranges stay finite.
const BIG: f64 = 1e300;

fn usable(v: f64) -> Option<f64> {
    v.is_finite().then(|| v.clamp(-BIG, BIG))
}

/// A 1-2-5 step giving about `target` intervals over `range` (> 0).
fn nice_step(range: f64, target: f64) -> f64 {
    let raw = range / target;
    let mag = 10f64.powf(raw.log10().floor());
    let norm = raw / mag;
    let m = if norm <= 1.0 {
        1.0
    } else if norm <= 2.0 {
        2.0
    } else if norm <= 5.0 {
        5.0
    } else {
        10.0
    };
    m * mag
}

/// Widens a degenerate range.
fn widen(lo: f64, hi: f64) -> (f64, f64) {
    if hi > lo {
        (lo, hi)
    } else {
        let pad = if lo == 0.0 { 1.0 } else { lo.abs() * 0.1 };
        (lo - pad, hi + pad)
    }
}

fn fmt_tick(v: f64, step: f64) -> String {
    if v.abs() < step * 1e-6 {
        return "0".to_string();
    }
    if step >= 1e-4 && v.abs() < 1e7 {
        // Fewest decimals that represent the step exactly (0.25 -> 2).
        let decimals = (0..=6usize)
            .find(|&d| {
                let scaled = step * 10f64.powi(d as i32);
                (scaled - scaled.round()).abs() < 1e-6 * scaled.max(1.0)
            })
            .unwrap_or(6);
        format!("{v:.decimals$}")
    } else {
        let s = format!("{v:.2e}");
        // Trim "1.50e6" to "1.5e6".
        match s.split_once('e') {
            Some((m, e)) => {
                let m = m.trim_end_matches('0').trim_end_matches('.');
                format!("{m}e{e}")
            }
            None => s,
        }
    }
}

/// Ticks (value, label) between `lo` and `hi`.
fn ticks(lo: f64, hi: f64, step: f64) -> Vec<(f64, String)> {
    let first = (lo / step).ceil();
    let last = (hi / step).floor();
    if !(first.is_finite() && last.is_finite()) || last - first > 100.0 {
        return Vec::new();
    }
    let mut out = Vec::new();
    let mut k = first;
    while k <= last {
        let v = k * step;
        out.push((v, fmt_tick(v, step)));
        k += 1.0;
    }
    out
}

/// A linear f64 axis for plotters' coordinate mapping only: its grid, ticks
/// and labels are drawn here from [`ticks`], so it offers no key points.
struct TickedAxis {
    lo: f64,
    hi: f64,
}

impl Ranged for TickedAxis {
    type FormatOption = DefaultFormatting;
    type ValueType = f64;

    fn map(&self, v: &f64, limit: (i32, i32)) -> i32 {
        let t = (v - self.lo) / (self.hi - self.lo);
        let px = limit.0 as f64 + t * (limit.1 - limit.0) as f64;
        // Saturating: values far outside the axis stay far outside it.
        px.round().clamp(-1e7, 1e7) as i32
    }

    fn key_points<H: KeyPointHint>(&self, _hint: H) -> Vec<f64> {
        Vec::new()
    }

    fn range(&self) -> Range<f64> {
        self.lo..self.hi
    }
}

/// Text in the plots' text colour.
fn label(text: &str, size: f64, align: HPos) -> Text<'_> {
    Text {
        text,
        size,
        colour: colour(TEXT),
        align,
    }
}

/// The part of the segment `a`-`b` inside the box `[x0, x1] x [y0, y1]`
/// (Liang-Barsky), or None when it misses the box.
fn clip_segment(
    a: (f64, f64),
    b: (f64, f64),
    (x0, x1, y0, y1): (f64, f64, f64, f64),
) -> Option<((f64, f64), (f64, f64))> {
    let (dx, dy) = (b.0 - a.0, b.1 - a.1);
    let (mut t0, mut t1) = (0.0f64, 1.0f64);
    for (p, q) in [
        (-dx, a.0 - x0),
        (dx, x1 - a.0),
        (-dy, a.1 - y0),
        (dy, y1 - a.1),
    ] {
        if p == 0.0 {
            if q < 0.0 {
                return None;
            }
        } else {
            let r = q / p;
            if p < 0.0 {
                t0 = t0.max(r);
            } else {
                t1 = t1.min(r);
            }
        }
    }
    (t0 <= t1 && t0.is_finite() && t1.is_finite()).then_some((
        (a.0 + t0 * dx, a.1 + t0 * dy),
        (a.0 + t1 * dx, a.1 + t1 * dy),
    ))
}

/// Points joined by straight segments.
type Polyline = Vec<(f64, f64)>;

/// A series' drawable parts inside `bounds`: polylines of clipped segments
/// between usable neighbours, and the usable points with no usable
/// neighbour (drawn as dots).
fn pieces(s: &Series, bounds: (f64, f64, f64, f64)) -> (Vec<Polyline>, Vec<(f64, f64)>) {
    let pts: Vec<Option<(f64, f64)>> = s
        .points
        .iter()
        .map(|&(x, y)| Some((usable(x)?, usable(y)?)))
        .collect();
    let mut lines: Vec<Polyline> = Vec::new();
    let mut dots = Vec::new();
    let mut open = false; // the last polyline ends where the next segment starts
    for (j, p) in pts.iter().enumerate() {
        let Some(p) = *p else {
            open = false;
            continue;
        };
        let prev = j.checked_sub(1).and_then(|i| pts[i]);
        let next = pts.get(j + 1).copied().flatten();
        if prev.is_none() && next.is_none() {
            dots.push(p);
        }
        let Some(q) = next else {
            open = false;
            continue;
        };
        match clip_segment(p, q, bounds) {
            Some((a, b)) => {
                let line = lines.last_mut().filter(|_| open && a == p);
                match line {
                    Some(l) => l.push(b),
                    None => lines.push(vec![a, b]),
                }
                open = b == q;
            }
            None => open = false,
        }
    }
    (lines, dots)
}

/// Draws `series` as lines on one set of axes and writes a
/// [`PLOT_WIDTH`] x [`PLOT_HEIGHT`] PNG to `out`. Points with NaN or
/// infinite coordinates are left out (the line is broken there); with no
/// usable point at all the axes are drawn over "no data".
pub fn line_plot_png(
    title: &str,
    x_label: &str,
    y_label: &str,
    series: &[Series],
    out: &Path,
) -> Result<()> {
    // Data ranges over usable points.
    let mut xr = (f64::INFINITY, f64::NEG_INFINITY);
    let mut yr = (f64::INFINITY, f64::NEG_INFINITY);
    for s in series {
        for &(x, y) in &s.points {
            if let (Some(x), Some(y)) = (usable(x), usable(y)) {
                xr = (xr.0.min(x), xr.1.max(x));
                yr = (yr.0.min(y), yr.1.max(y));
            }
        }
    }
    let no_data = xr.0 > xr.1;
    if no_data {
        xr = (0.0, 1.0);
        yr = (0.0, 1.0);
    }
    let (x_lo, x_hi) = widen(xr.0, xr.1);
    let (y_lo, y_hi) = widen(yr.0, yr.1);
    let x_step = nice_step(x_hi - x_lo, 8.0);
    let y_step = nice_step(y_hi - y_lo, 6.0);
    // The y axis runs to whole steps; the x axis spans the data.
    let (y_lo, y_hi) = {
        let lo = (y_lo / y_step).floor() * y_step;
        let hi = (y_hi / y_step).ceil() * y_step;
        if lo.is_finite() && hi.is_finite() && hi > lo {
            (lo, hi)
        } else {
            (y_lo, y_hi)
        }
    };
    let y_ticks = ticks(y_lo, y_hi, y_step);
    let x_ticks = ticks(x_lo, x_hi, x_step);
    // Keep every n-th x tick so that labels stay apart.
    let plot_w = (PLOT_WIDTH - LEFT - RIGHT) as f64;
    let widest = x_ticks
        .iter()
        .map(|(_, l)| text_width(l, LABEL_SIZE))
        .max()
        .unwrap_or(0) as f64;
    let tick_px = x_step / (x_hi - x_lo) * plot_w;
    let every = ((widest + 14.0) / tick_px).ceil().clamp(1.0, 1e6) as usize;
    let bounds = (x_lo, x_hi, y_lo, y_hi);
    let drawn: Vec<_> = series.iter().map(|s| pieces(s, bounds)).collect();

    let (px0, py0) = (LEFT as i32, TOP as i32);
    let (px1, py1) = ((PLOT_WIDTH - RIGHT) as i32, (PLOT_HEIGHT - BOTTOM) as i32);
    draw_png(out, "plot", PLOT_WIDTH, PLOT_HEIGHT, |root| {
        root.fill(&colour(BG))?;
        let axes = root.margin(TOP, BOTTOM, LEFT, RIGHT);
        let mut chart = ChartBuilder::on(&axes).build_cartesian_2d(
            TickedAxis { lo: x_lo, hi: x_hi },
            TickedAxis { lo: y_lo, hi: y_hi },
        )?;
        let line = |a: (i32, i32), b: (i32, i32), c: Rgb| {
            root.draw(&PathElement::new(vec![a, b], colour(c)))
        };

        // Grid, ticks and their labels.
        for (v, l) in &y_ticks {
            let y = chart.backend_coord(&(x_lo, *v)).1;
            line((px0, y), (px1 - 1, y), GRID)?;
            line((px0 - 5, y), (px0, y), AXIS)?;
            label(l, LABEL_SIZE, HPos::Right).draw(root, px0 - 8, y + 5)?;
        }
        for (v, l) in x_ticks.iter().step_by(every) {
            let x = chart.backend_coord(&(*v, y_lo)).0;
            line((x, py0), (x, py1 - 1), GRID)?;
            line((x, py1), (x, py1 + 5), AXIS)?;
            label(l, LABEL_SIZE, HPos::Center).draw(root, x, py1 + 20)?;
        }
        root.draw(&Rectangle::new([(px0, py0), (px1, py1)], colour(AXIS)))?;

        // Title and axis labels.
        label(title, TITLE_SIZE, HPos::Center).draw(root, PLOT_WIDTH as i32 / 2, 28)?;
        label(x_label, DESC_SIZE, HPos::Center).draw(
            root,
            (px0 + px1) / 2,
            PLOT_HEIGHT as i32 - 10,
        )?;
        label(y_label, DESC_SIZE, HPos::Center).draw_dir(
            root,
            22,
            (py0 + py1) / 2,
            Direction::Up,
        )?;
        if no_data {
            Text {
                text: "no data",
                size: 24.0,
                colour: RGBColor(150, 150, 150),
                align: HPos::Center,
            }
            .draw(root, (px0 + px1) / 2, (py0 + py1) / 2 + 8)?;
        }

        // Lines and lone points.
        for (i, (lines, dots)) in drawn.iter().enumerate() {
            let col = colour(series_colour(i));
            for l in lines {
                chart.draw_series(std::iter::once(PathElement::new(
                    l.clone(),
                    col.stroke_width(2),
                )))?;
            }
            chart.draw_series(dots.iter().map(|&p| {
                EmptyElement::at(p) + Rectangle::new([(-1, -1), (2, 2)], col.filled())
            }))?;
        }

        // Legend, top right inside the axes.
        if !series.is_empty() {
            let name_w = series
                .iter()
                .map(|s| text_width(&s.name, LABEL_SIZE))
                .max()
                .unwrap_or(0);
            let (bw, bh) = (name_w + 40, series.len() as i32 * 18 + 10);
            let bx = (px1 - 10 - bw).max(px0 + 2);
            let by = py0 + 10;
            root.draw(&Rectangle::new(
                [(bx, by), (bx + bw, by + bh)],
                colour(BG).filled(),
            ))?;
            root.draw(&Rectangle::new(
                [(bx, by), (bx + bw, by + bh)],
                RGBColor(180, 180, 180),
            ))?;
            for (i, s) in series.iter().enumerate() {
                let y = by + 18 + i as i32 * 18;
                let col = colour(series_colour(i));
                root.draw(&Rectangle::new(
                    [(bx + 8, y - 6), (bx + 28, y - 2)],
                    col.filled(),
                ))?;
                label(&s.name, LABEL_SIZE, HPos::Left).draw(root, bx + 34, y)?;
            }
        }
        Ok(())
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::render::picture::tests::{colours, decode};

    #[test]
    fn loss_plot_has_size_and_series_colours() {
        let train = Series {
            name: "train".into(),
            points: (0..500)
                .map(|i| (i as f64 * 10.0, 5.0 * (-(i as f64) / 100.0).exp() + 1.0))
                .collect(),
        };
        let valid = Series {
            name: "valid".into(),
            points: (0..50)
                .map(|i| (i as f64 * 100.0, 5.0 * (-(i as f64) / 10.0).exp() + 1.3))
                .collect(),
        };
        let dir = tempfile::tempdir().unwrap();
        let out = dir.path().join("loss.png");
        line_plot_png("Loss", "step", "nll (nats)", &[train, valid], &out).unwrap();
        let (w, h, buf) = decode(&out);
        assert_eq!((w, h), (PLOT_WIDTH, PLOT_HEIGHT));
        let cols = colours(&buf);
        for c in [PALETTE[0], PALETTE[1], BG, TEXT, GRID] {
            assert!(cols.contains(&c), "missing {c:?}");
        }
        // The first series' colour appears well beyond the legend swatch.
        let n0 = buf.chunks_exact(3).filter(|c| c == &PALETTE[0]).count();
        assert!(n0 > 500, "{n0}");
        // The train curve starts high on the left: its colour is in the
        // top-left quarter of the axes, and the legend swatch top right.
        let at = |x: u32, y: u32| -> Rgb {
            let i = ((y * w + x) * 3) as usize;
            [buf[i], buf[i + 1], buf[i + 2]]
        };
        let region_has = |x0: u32, x1: u32, y0: u32, y1: u32, c: Rgb| {
            (y0..y1).any(|y| (x0..x1).any(|x| at(x, y) == c))
        };
        assert!(region_has(LEFT, LEFT + 40, TOP, TOP + 120, PALETTE[0]));
        assert!(region_has(
            PLOT_WIDTH / 2,
            PLOT_WIDTH - RIGHT,
            TOP,
            TOP + 60,
            PALETTE[1]
        ));
        // Anti-aliased text leaves grey levels between TEXT and BG.
        let greys = cols
            .iter()
            .filter(|c| c[0] == c[1] && c[1] == c[2] && c[0] > 40 && c[0] < 200)
            .count();
        assert!(greys > 10, "{greys} greys");
        // Nothing is drawn past the legend box's right edge into the margin
        // except the axes frame.
        assert!(!region_has(
            PLOT_WIDTH - RIGHT + 2,
            PLOT_WIDTH,
            0,
            PLOT_HEIGHT,
            PALETTE[0]
        ));
    }

    #[test]
    fn segments_are_clipped_and_broken_at_gaps() {
        let b = (0.0, 10.0, 0.0, 10.0);
        assert_eq!(
            clip_segment((-10.0, 5.0), (20.0, 5.0), b),
            Some(((0.0, 5.0), (10.0, 5.0)))
        );
        assert_eq!(clip_segment((-10.0, -1.0), (20.0, -1.0), b), None);
        let s = Series {
            name: "s".into(),
            points: vec![
                (0.0, 1.0),
                (1.0, 2.0),
                (2.0, 3.0),
                (3.0, f64::NAN),
                (4.0, 4.0),
                (5.0, f64::NAN),
                (6.0, 5.0),
                (7.0, 6.0),
            ],
        };
        let (lines, dots) = pieces(&s, b);
        assert_eq!(
            lines,
            vec![
                vec![(0.0, 1.0), (1.0, 2.0), (2.0, 3.0)],
                vec![(6.0, 5.0), (7.0, 6.0)]
            ]
        );
        assert_eq!(dots, vec![(4.0, 4.0)]);
    }

    #[test]
    fn odd_inputs_do_not_panic() {
        let dir = tempfile::tempdir().unwrap();
        let out = dir.path().join("odd.png");
        let nan = Series {
            name: "nan".into(),
            points: vec![
                (0.0, f64::NAN),
                (1.0, 2.0),
                (f64::INFINITY, 3.0),
                (3.0, f64::NEG_INFINITY),
                (4.0, 1.0),
                (5.0, 1.5),
            ],
        };
        let all_nan = Series {
            name: "all nan".into(),
            points: vec![(f64::NAN, f64::NAN); 3],
        };
        let constant = Series {
            name: "flat".into(),
            points: vec![(7.0, 7.0), (7.0, 7.0)],
        };
        let huge = Series {
            name: "huge".into(),
            points: vec![(-1e308, f64::MAX), (1e308, -f64::MAX), (0.0, 1e-300)],
        };
        let empty = Series {
            name: String::new(),
            points: vec![],
        };
        for set in [
            vec![],
            vec![empty.clone()],
            vec![all_nan.clone()],
            vec![nan.clone(), all_nan, empty],
            vec![constant],
            vec![huge],
            vec![nan.clone(); 14],
        ] {
            line_plot_png("", "", "", &set, &out).unwrap();
            let (w, h, buf) = decode(&out);
            assert_eq!((w, h), (PLOT_WIDTH, PLOT_HEIGHT));
            assert!(colours(&buf).len() >= 3);
        }
        let err =
            line_plot_png("t", "x", "y", &[nan], Path::new("/nonexistent/p.png")).unwrap_err();
        assert!(format!("{err:#}").contains("p.png"));
    }

    #[test]
    fn tick_labels() {
        assert_eq!(nice_step(10.0, 5.0), 2.0);
        assert_eq!(nice_step(0.7, 6.0), 0.2);
        assert_eq!(fmt_tick(0.4, 0.2), "0.4");
        assert_eq!(fmt_tick(1500.0, 500.0), "1500");
        assert_eq!(fmt_tick(-1e-17, 0.1), "0");
        assert_eq!(fmt_tick(2e9, 1e9), "2e9");
        let t = ticks(0.0, 1.0, 0.25);
        assert_eq!(t.len(), 5);
        assert_eq!(t[4].1, "1.00");
    }
}
