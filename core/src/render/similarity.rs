//! A piece's bars x bars self-similarity matrix beside its piano roll.
//!
//! The matrix comes in as plain data (row i, column j: the similarity of
//! bars i + 1 and j + 1, in 0..=1, or None where it is undefined, e.g. an
//! empty bar); the root crate's form measures compute it. Bar 1 is at the
//! top left, so the diagonal runs down to the right, and a strain that
//! returns after P bars shows as a bright line P cells beside the diagonal.
//!
//! Layout invariants: the piano roll (drawn exactly as
//! [`piano_roll_png`](super::piano_roll_png) draws it) is on the left; the
//! matrix, at most [`MATRIX_SIDE`] pixels square (each bar at least one
//! pixel wide while the bars fit, sampled when there are more bars than
//! pixels), is on the right, under a title, with bar numbers on its left
//! and bottom edges and a colour ramp below. Colours: similarity 0 to 1
//! runs from near-black through blue to pale yellow; undefined cells are
//! dark red. The picture is `roll width + GAP + matrix block width` wide
//! and as tall as the taller of the two.

use std::path::Path;

use anyhow::{bail, Result};
use plotters::style::text_anchor::HPos;

use super::font::{text_width, Direction};
use super::pianoroll::{self, fill, text, PianoRollOptions, BG, DIM_TEXT, TEXT};
use super::picture::{colour, draw_png, Area, DrawResult, Rgb};
use super::TempoMap;
use crate::midi::Score;

/// Largest side of the matrix, in pixels.
pub const MATRIX_SIDE: u32 = 640;
/// Widest cell (a short piece's bars are not drawn bigger than this).
const MAX_CELL: u32 = 24;
/// Space between the roll and the matrix block.
const GAP: u32 = 16;
/// Bar-number column left of the matrix.
const M_LEFT: u32 = 44;
/// Blank column right of the matrix.
const M_RIGHT: u32 = 12;
/// Title strip above the matrix.
const M_TOP: u32 = 30;
/// Bar-number strip, colour ramp and its labels below the matrix.
const M_BOTTOM: u32 = 70;
/// Most bars a matrix may have (its data is bars^2 values).
const MAX_MATRIX_BARS: usize = 4096;

const TITLE_SIZE: f64 = 15.0;
const SMALL_SIZE: f64 = 11.0;

/// The colour of an undefined cell.
const UNDEFINED: Rgb = [96, 24, 28];
/// Stops of the colour ramp, at similarity 0, 0.5 and 1.
const RAMP: [Rgb; 3] = [[26, 26, 34], [52, 104, 196], [255, 236, 140]];

/// How to draw a self-similarity picture.
#[derive(Debug, Clone, PartialEq)]
pub struct SelfSimilarityOptions {
    /// The piano roll on the left.
    pub piano_roll: PianoRollOptions,
    /// Title above the matrix (default: "bar self-similarity").
    pub title: Option<String>,
}

impl Default for SelfSimilarityOptions {
    fn default() -> Self {
        SelfSimilarityOptions {
            piano_roll: PianoRollOptions {
                max_width: 1100,
                ..PianoRollOptions::default()
            },
            title: None,
        }
    }
}

/// The ramp's colour for a similarity (clamped to 0..=1), or [`UNDEFINED`].
pub(crate) fn cell_colour(v: Option<f64>) -> Rgb {
    let Some(v) = v.filter(|v| v.is_finite()) else {
        return UNDEFINED;
    };
    let v = v.clamp(0.0, 1.0) * 2.0;
    let (a, b, f) = if v <= 1.0 {
        (RAMP[0], RAMP[1], v)
    } else {
        (RAMP[1], RAMP[2], v - 1.0)
    };
    [0, 1, 2].map(|k| (a[k] as f64 + (b[k] as f64 - a[k] as f64) * f).round() as u8)
}

/// Where the matrix goes inside its block.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct MatrixLayout {
    /// Bars (rows and columns).
    pub(crate) bars: usize,
    /// Side of the matrix in pixels.
    pub(crate) side: u32,
    /// Width and height of the whole block.
    pub(crate) width: u32,
    pub(crate) height: u32,
    /// Bars between two numbered ticks.
    pub(crate) step: usize,
}

impl MatrixLayout {
    pub(crate) fn new(bars: usize) -> MatrixLayout {
        let n = bars.max(1);
        let side = if n as u32 as usize == n && n as u32 <= MATRIX_SIDE {
            n as u32 * (MATRIX_SIDE / n as u32).clamp(1, MAX_CELL)
        } else {
            MATRIX_SIDE
        };
        // Numbered ticks at least 22 px apart, on 1, 2, 4, 8 ... bars.
        let px_per_bar = side as f64 / n as f64;
        let mut step = 1usize;
        while (step as f64) * px_per_bar < 22.0 && step < n {
            step *= 2;
        }
        MatrixLayout {
            bars,
            side,
            width: M_LEFT + side + M_RIGHT,
            height: M_TOP + side + M_BOTTOM,
            step,
        }
    }

    /// The bar (from 0) that pixel `p` (from 0) of the matrix shows.
    pub(crate) fn bar_at(&self, p: u32) -> usize {
        (p as usize * self.bars.max(1) / self.side as usize).min(self.bars.saturating_sub(1))
    }

    /// The first pixel of bar `b` (from 0), and the pixel after its last.
    pub(crate) fn span(&self, b: usize) -> (u32, u32) {
        let n = self.bars.max(1);
        let at = |k: usize| (k * self.side as usize).div_ceil(n) as u32;
        (at(b), at(b + 1).max(at(b) + 1).min(self.side))
    }
}

/// Draws `score`'s piano roll with its bars x bars `matrix` beside it (see
/// the module doc) into the PNG `out`. The matrix must be square; an empty
/// one (a piece without bars) draws an empty frame.
pub fn self_similarity_png(
    score: &Score,
    matrix: &[Vec<Option<f64>>],
    out: &Path,
    opts: &SelfSimilarityOptions,
) -> Result<()> {
    let n = matrix.len();
    if n > MAX_MATRIX_BARS {
        bail!(
            "cannot draw {}: the self-similarity matrix has {n} bars, more than {MAX_MATRIX_BARS}",
            out.display()
        );
    }
    if let Some((i, row)) = matrix.iter().enumerate().find(|(_, r)| r.len() != n) {
        bail!(
            "cannot draw {}: the self-similarity matrix is not square (row {} has {} values, \
             there are {n} rows)",
            out.display(),
            i + 1,
            row.len()
        );
    }
    let tempo = TempoMap::new(score);
    let roll = pianoroll::layout(score, &tempo, &opts.piano_roll);
    let m = MatrixLayout::new(n);
    let width = roll.width + GAP + m.width;
    let height = roll.height.max(m.height);
    draw_png(out, "self-similarity picture", width, height, |area| {
        area.fill(&colour(BG))?;
        let (left, right) = area.split_horizontally(roll.width + GAP);
        pianoroll::paint(&left, score, &tempo, &opts.piano_roll, &roll)?;
        paint_matrix(&right, matrix, &m, opts)
    })
}

fn paint_matrix(
    area: &Area,
    matrix: &[Vec<Option<f64>>],
    m: &MatrixLayout,
    opts: &SelfSimilarityOptions,
) -> DrawResult {
    let title = opts.title.as_deref().unwrap_or("bar self-similarity");
    text(title, TITLE_SIZE, TEXT, HPos::Left).draw(area, M_LEFT as i32, 20)?;
    let (x0, y0) = (M_LEFT as i32, M_TOP as i32);
    let side = m.side as i32;
    if matrix.is_empty() {
        fill(area, x0, y0, x0 + side, y0 + 1, DIM_TEXT)?;
        fill(area, x0, y0 + side - 1, x0 + side, y0 + side, DIM_TEXT)?;
        return Ok(());
    }
    // Cells: whole rectangles while every bar has its own pixels, else one
    // sampled value per pixel.
    if m.bars <= m.side as usize {
        for (i, row) in matrix.iter().enumerate() {
            let (ya, yb) = m.span(i);
            for (j, v) in row.iter().enumerate() {
                let (xa, xb) = m.span(j);
                fill(
                    area,
                    x0 + xa as i32,
                    y0 + ya as i32,
                    x0 + xb as i32,
                    y0 + yb as i32,
                    cell_colour(*v),
                )?;
            }
        }
    } else {
        for py in 0..m.side {
            let row = &matrix[m.bar_at(py)];
            for px in 0..m.side {
                let c = cell_colour(row[m.bar_at(px)]);
                area.draw_pixel((x0 + px as i32, y0 + py as i32), &colour(c))?;
            }
        }
    }
    // Bar numbers: ticks at bars 1, 1 + step, 1 + 2 step ... on the left
    // (rows) and along the bottom (columns).
    let bottom = y0 + side;
    text("bar", SMALL_SIZE, DIM_TEXT, HPos::Right).draw(area, x0 - 6, y0 - 4)?;
    let mut b = 0usize;
    while b < m.bars {
        let (a, e) = m.span(b);
        let mid = ((a + e) / 2) as i32;
        let label = (b + 1).to_string();
        fill(area, x0 - 4, y0 + mid, x0, y0 + mid + 1, TEXT)?;
        text(&label, SMALL_SIZE, TEXT, HPos::Right).draw(area, x0 - 6, y0 + mid + 4)?;
        fill(area, x0 + mid, bottom, x0 + mid + 1, bottom + 4, TEXT)?;
        text(&label, SMALL_SIZE, TEXT, HPos::Center).draw(area, x0 + mid, bottom + 15)?;
        b += m.step;
    }
    // The colour ramp, with 0, 0.5 and 1 under it, and the undefined swatch.
    let ry = bottom + 26;
    let ramp_w = (side / 2).max(60);
    for px in 0..ramp_w {
        let v = px as f64 / (ramp_w - 1).max(1) as f64;
        fill(
            area,
            x0 + px,
            ry,
            x0 + px + 1,
            ry + 10,
            cell_colour(Some(v)),
        )?;
    }
    for (v, align) in [(0.0, HPos::Left), (0.5, HPos::Center), (1.0, HPos::Right)] {
        let x = x0 + ((ramp_w - 1) as f64 * v).round() as i32;
        text(&format!("{v}"), SMALL_SIZE, TEXT, align).draw(area, x, ry + 23)?;
    }
    let label = "similarity (Jaccard)";
    let lx = x0 + ramp_w + 10;
    text(label, SMALL_SIZE, DIM_TEXT, HPos::Left).draw(area, lx, ry + 9)?;
    let sx = lx + text_width(label, SMALL_SIZE) + 14;
    fill(area, sx, ry, sx + 10, ry + 10, UNDEFINED)?;
    text("empty bar", SMALL_SIZE, DIM_TEXT, HPos::Left).draw(area, sx + 14, ry + 9)?;
    // "bar" along the bottom axis reads across; the row axis label reads up.
    text("bar", SMALL_SIZE, DIM_TEXT, HPos::Center).draw_dir(area, 12, y0 + side / 2, Direction::Up)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::midi::Note;
    use crate::render::picture::tests::{colours, decode};

    fn pixel(buf: &[u8], w: u32, x: u32, y: u32) -> Rgb {
        let i = ((y * w + x) * 3) as usize;
        [buf[i], buf[i + 1], buf[i + 2]]
    }

    fn score(bars: u64) -> Score {
        let mut s = Score::new(480);
        for b in 0..bars {
            s.notes.push(Note {
                start: b * 1920,
                duration: 960,
                pitch: 60 + (b % 8) as u8,
                velocity: 90,
                program: 0,
                channel: 0,
                is_drum: false,
            });
        }
        s
    }

    #[test]
    fn ramp_and_layout() {
        assert_eq!(cell_colour(Some(0.0)), RAMP[0]);
        assert_eq!(cell_colour(Some(0.5)), RAMP[1]);
        assert_eq!(cell_colour(Some(1.0)), RAMP[2]);
        assert_eq!(cell_colour(Some(7.0)), RAMP[2]);
        assert_eq!(cell_colour(None), UNDEFINED);
        assert_eq!(cell_colour(Some(f64::NAN)), UNDEFINED);
        // 32 bars: 20 px a bar, numbered every 2 bars
        let m = MatrixLayout::new(32);
        assert_eq!((m.side, m.step), (640, 2));
        assert_eq!(m.span(0), (0, 20));
        assert_eq!(m.span(31), (620, 640));
        // 4 bars: the cell is capped
        assert_eq!(MatrixLayout::new(4).side, 4 * MAX_CELL);
        // 2000 bars: sampled, every pixel shows a bar inside the matrix
        let big = MatrixLayout::new(2000);
        assert_eq!(big.side, MATRIX_SIDE);
        assert_eq!(big.bar_at(0), 0);
        assert_eq!(big.bar_at(MATRIX_SIDE - 1), 1996);
        assert!(big.step >= 64);
    }

    #[test]
    fn matrix_is_drawn_beside_the_roll() {
        // 4 bars: 1 and 3 the same, 2 different, 4 empty.
        let v = |x: f64| Some(x);
        let matrix = vec![
            vec![v(1.0), v(0.0), v(1.0), None],
            vec![v(0.0), v(1.0), v(0.0), None],
            vec![v(1.0), v(0.0), v(1.0), None],
            vec![None, None, None, None],
        ];
        let s = score(4);
        let dir = tempfile::tempdir().unwrap();
        let out = dir.path().join("form.png");
        let opts = SelfSimilarityOptions::default();
        self_similarity_png(&s, &matrix, &out, &opts).unwrap();
        let (w, h, buf) = decode(&out);
        let roll = pianoroll::layout(&s, &TempoMap::new(&s), &opts.piano_roll);
        let m = MatrixLayout::new(4);
        assert_eq!(w, roll.width + GAP + m.width);
        assert_eq!(h, roll.height.max(m.height));
        let cols = colours(&buf);
        assert!(cols.contains(&UNDEFINED) && cols.contains(&RAMP[2]));
        // the centre of cell (row, column) has the cell's colour
        let at = |r: usize, c: usize| {
            let (ya, yb) = m.span(r);
            let (xa, xb) = m.span(c);
            let x = roll.width + GAP + M_LEFT + (xa + xb) / 2;
            let y = M_TOP + (ya + yb) / 2;
            pixel(&buf, w, x, y)
        };
        assert_eq!(at(0, 2), RAMP[2]);
        assert_eq!(at(0, 1), RAMP[0]);
        assert_eq!(at(3, 0), UNDEFINED);
        assert_eq!(at(1, 1), RAMP[2]);

        // A matrix that is not square is refused, naming the file.
        let bad = vec![vec![v(1.0)], vec![v(1.0), v(0.0)]];
        let err = self_similarity_png(&s, &bad, &out, &opts).unwrap_err();
        let msg = format!("{err:#}");
        assert!(
            msg.contains("form.png") && msg.contains("not square"),
            "{msg}"
        );
        // No bars: an empty frame, not an error.
        self_similarity_png(&Score::new(480), &[], &out, &opts).unwrap();
        // More bars than pixels: sampled.
        let n = 700;
        let big: Vec<Vec<Option<f64>>> = (0..n)
            .map(|i| (0..n).map(|j| v(if i == j { 1.0 } else { 0.0 })).collect())
            .collect();
        self_similarity_png(&score(8), &big, &out, &opts).unwrap();
        let (_, _, buf) = decode(&out);
        assert!(colours(&buf).contains(&RAMP[2]));
    }
}
