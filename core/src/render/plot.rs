//! Line plots (loss curves, per-position NLL) as PNG: a title, axis labels,
//! ticks with numeric labels, grid, several series in distinct colours and a
//! legend. Non-finite points are skipped (they break the line).

use std::path::Path;

use anyhow::{Context, Result};

use super::canvas::{hsv, text_height, Canvas, Rgb};
use super::font::text_width;

/// Size of the pictures [`line_plot_png`] draws.
pub const PLOT_WIDTH: u32 = 900;
pub const PLOT_HEIGHT: u32 = 540;

/// One named line of (x, y) points.
#[derive(Debug, Clone, PartialEq)]
pub struct Series {
    pub name: String,
    pub points: Vec<(f64, f64)>,
}

const LEFT: i64 = 84;
const RIGHT: i64 = 24;
const TOP: i64 = 40;
const BOTTOM: i64 = 52;

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
    let (w, h) = (PLOT_WIDTH as i64, PLOT_HEIGHT as i64);
    let mut c = Canvas::new(w as usize, h as usize, BG);
    let (px0, py0, px1, py1) = (LEFT, TOP, w - RIGHT, h - BOTTOM);

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
    let sx = (px1 - px0 - 1) as f64 / (x_hi - x_lo);
    let sy = (py1 - py0 - 1) as f64 / (y_hi - y_lo);
    let to_px = |x: f64, y: f64| {
        (
            px0 as f64 + (x - x_lo) * sx,
            (py1 - 1) as f64 - (y - y_lo) * sy,
        )
    };

    // Grid, ticks and labels.
    let th = text_height(1) as i64;
    for (v, label) in ticks(y_lo, y_hi, y_step) {
        let y = to_px(x_lo, v).1.round() as i64;
        c.hline(px0, px1, y, GRID);
        c.hline(px0 - 5, px0, y, AXIS);
        let tw = text_width(&label, 1) as i64;
        c.text(px0 - 8 - tw, y - th / 2, &label, 1, TEXT);
    }
    let x_ticks = ticks(x_lo, x_hi, x_step);
    // Thin out x labels that would overlap.
    let widest = x_ticks
        .iter()
        .map(|(_, l)| text_width(l, 1))
        .max()
        .unwrap_or(0) as f64;
    let every = ((widest + 12.0) / (x_step * sx)).ceil().max(1.0) as usize;
    for (i, (v, label)) in x_ticks.iter().enumerate() {
        let x = to_px(*v, y_lo).0.round() as i64;
        c.vline(x, py0, py1, GRID);
        c.vline(x, py1, py1 + 5, AXIS);
        if i % every == 0 {
            let tw = text_width(label, 1) as i64;
            c.text(x - tw / 2, py1 + 9, label, 1, TEXT);
        }
    }
    c.rect(px0, py0, px1, py1, AXIS);

    // Title and axis labels.
    let tw = text_width(title, 2) as i64;
    c.text(((w - tw) / 2).max(2), 12, title, 2, TEXT);
    let xw = text_width(x_label, 1) as i64;
    c.text(
        px0 + ((px1 - px0 - xw) / 2).max(0),
        h - 16,
        x_label,
        1,
        TEXT,
    );
    let yw = text_width(y_label, 1) as i64;
    c.text_up(8, py0 + (py1 - py0 + yw) / 2, y_label, 1, TEXT);

    if no_data {
        let msg = "no data";
        let mw = text_width(msg, 2) as i64;
        c.text(
            (px0 + px1 - mw) / 2,
            (py0 + py1) / 2 - th,
            msg,
            2,
            [150, 150, 150],
        );
    }

    // Lines; a point without usable neighbours is drawn as a dot.
    let clip = (px0 + 1, py0 + 1, px1 - 1, py1 - 1);
    for (i, s) in series.iter().enumerate() {
        let col = series_colour(i);
        let pts: Vec<Option<(f64, f64)>> = s
            .points
            .iter()
            .map(|&(x, y)| match (usable(x), usable(y)) {
                (Some(x), Some(y)) => Some(to_px(x, y)),
                _ => None,
            })
            .collect();
        for (j, p) in pts.iter().enumerate() {
            let Some(p) = *p else { continue };
            let next = pts.get(j + 1).copied().flatten();
            if let Some(q) = next {
                c.line(p, q, 2, clip, col);
            }
            let prev = if j > 0 { pts[j - 1] } else { None };
            if prev.is_none() && next.is_none() {
                let (x, y) = (p.0.round() as i64, p.1.round() as i64);
                if x >= clip.0 && x < clip.2 && y >= clip.1 && y < clip.3 {
                    c.fill(x - 1, y - 1, x + 2, y + 2, col);
                }
            }
        }
    }

    // Legend, top right inside the axes.
    if !series.is_empty() {
        let name_w = series
            .iter()
            .map(|s| text_width(&s.name, 1))
            .max()
            .unwrap_or(0) as i64;
        let bw = name_w + 34;
        let bh = series.len() as i64 * 12 + 8;
        let bx = (px1 - 8 - bw).max(px0 + 2);
        let by = py0 + 8;
        c.fill(bx, by, bx + bw, by + bh, BG);
        c.rect(bx, by, bx + bw, by + bh, [180, 180, 180]);
        for (i, s) in series.iter().enumerate() {
            let y = by + 5 + i as i64 * 12;
            let col = series_colour(i);
            c.fill(bx + 6, y + 2, bx + 24, y + 5, col);
            c.text(bx + 28, y, &s.name, 1, TEXT);
        }
    }

    c.write_png(out)
        .with_context(|| format!("cannot save plot {}", out.display()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashSet;

    fn decode(p: &Path) -> (u32, u32, Vec<u8>) {
        let dec = png::Decoder::new(std::fs::File::open(p).unwrap());
        let mut r = dec.read_info().unwrap();
        let mut buf = vec![0; r.output_buffer_size()];
        let info = r.next_frame(&mut buf).unwrap();
        buf.truncate(info.buffer_size());
        (info.width, info.height, buf)
    }

    fn colours(buf: &[u8]) -> HashSet<[u8; 3]> {
        buf.chunks_exact(3).map(|c| [c[0], c[1], c[2]]).collect()
    }

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
