//! Piano-roll pictures, drawn with plotters: time (seconds, following the
//! tempo map) across, pitch up, one colour per program, drums in light grey,
//! velocity as brightness, bar lines, C lines named in a pitch column on the
//! left, a legend of programs on top.
//!
//! A piece that fits `max_width` at `pixels_per_second` is one row; a longer
//! one is wrapped into rows of `bars_per_row` bars (or of equal time where the
//! bar grid is unusable), all on one horizontal scale chosen so that the
//! longest row fits `max_width`. Every row has the same pitch range, its bar
//! numbers above it and an m:ss time axis below it. Layout invariants: the
//! picture is never wider than `max(max_width, LEFT + RIGHT + MIN_PLOT_W)`,
//! never taller than [`MAX_HEIGHT`] plus one row block (rows are lengthened
//! rather than added past that), and its height grows with the number of
//! rows only.

use std::path::Path;

use anyhow::Result;
use plotters::prelude::*;
use plotters::style::text_anchor::HPos;

use super::font::{text_width, Text};
use super::gm::gm_program_name;
use super::picture::{colour, draw_png, hsv, shade, Area, DrawResult, Rgb};
use super::{note_end, score_end, TempoMap};
use crate::midi::Score;

/// How to draw a piano roll.
#[derive(Debug, Clone, PartialEq)]
pub struct PianoRollOptions {
    /// Horizontal scale; lowered when the longest row would not fit
    /// `max_width`.
    pub pixels_per_second: f64,
    /// Cap on the whole image's width; a piece longer than this at
    /// `pixels_per_second` is wrapped into rows.
    pub max_width: u32,
    /// Pixels per semitone.
    pub row_height: u32,
    /// Semitones shown above the highest and below the lowest note.
    pub pitch_margin: u8,
    /// Draw a legend of programs above the roll.
    pub legend: bool,
    /// Optional title line above the legend.
    pub title: Option<String>,
    /// Bars in one row of a wrapped roll (0 counts as 1); halved while a
    /// row would have to be squeezed below half of `pixels_per_second`, and
    /// raised when the picture would otherwise pass [`MAX_HEIGHT`].
    pub bars_per_row: u32,
}

impl Default for PianoRollOptions {
    fn default() -> Self {
        PianoRollOptions {
            pixels_per_second: 100.0,
            max_width: 2000,
            row_height: 5,
            pitch_margin: 2,
            legend: true,
            title: None,
            bars_per_row: 8,
        }
    }
}

/// Width of the pitch-name column on the left.
const LEFT: u32 = 40;
/// Blank column on the right.
const RIGHT: u32 = 10;
/// Blank strip above everything.
const TOP: u32 = 6;
/// Blank strip below the last row.
const BOTTOM: u32 = 4;
/// Bar-number strip above each row.
const HEADER: u32 = 16;
/// Time-axis strip below each row.
const FOOTER: u32 = 16;
/// Space between two rows.
const GAP: u32 = 10;
/// Narrowest roll area, however short the piece.
const MIN_PLOT_W: u32 = 64;
/// Tallest semitone allowed (keeps the image bounded).
const MAX_ROW_H: u32 = 32;
/// Height the rows of a wrapped roll stay within (see the module doc).
pub const MAX_HEIGHT: u32 = 12_000;
/// Most rows a roll is wrapped into.
const MAX_ROWS: usize = 200;

const TITLE_SIZE: f64 = 15.0;
const TEXT_SIZE: f64 = 12.0;
const SMALL_SIZE: f64 = 11.0;

pub(crate) const BG: Rgb = [12, 12, 16];
const ROLL_BG: Rgb = [22, 22, 29];
const BLACK_KEY_BG: Rgb = [17, 17, 23];
const C_LINE: Rgb = [60, 60, 76];
const BAR_LINE: Rgb = [46, 46, 58];
pub(crate) const TEXT: Rgb = [190, 190, 200];
pub(crate) const DIM_TEXT: Rgb = [120, 120, 132];
const DRUM: Rgb = [225, 225, 225];

/// Legend key for a note: program, or None for drums.
type Key = Option<u8>;

fn colour_for(key: Key, programs: &[u8]) -> Rgb {
    match key {
        None => DRUM,
        Some(p) => {
            let i = programs.iter().position(|&q| q == p).unwrap_or(0);
            // Golden-ratio hue steps keep neighbours in the list apart.
            hsv(0.02 + i as f64 * 0.618_034, 0.7, 1.0)
        }
    }
}

fn note_name(pitch: u8) -> String {
    const NAMES: [&str; 12] = [
        "C", "C#", "D", "D#", "E", "F", "F#", "G", "G#", "A", "A#", "B",
    ];
    format!("{}{}", NAMES[pitch as usize % 12], pitch as i32 / 12 - 1)
}

fn mss(secs: f64) -> String {
    let s = secs.max(0.0).round() as u64;
    format!("{}:{:02}", s / 60, s % 60)
}

/// Bar-start ticks up to `end`, or none when there would be absurdly many
/// (broken tick grids, huge durations).
fn bars(score: &Score, end: u64) -> Vec<u64> {
    let tpq = score.ticks_per_quarter as u64;
    let min_len = score
        .time_signatures
        .iter()
        .map(|t| (t.numerator.max(1) as u64, t.denominator.max(1) as u64))
        .chain(std::iter::once((4, 4)))
        .map(|(n, d)| (tpq * 4 * n / d).max(1))
        .min()
        .unwrap_or(1);
    let estimate = (end / min_len).saturating_add(score.time_signatures.len() as u64 + 1);
    if end > u64::MAX / 4 || estimate > 200_000 {
        return Vec::new();
    }
    score.bar_ticks(end)
}

/// One row of the roll: a span of time and the bars starting in it.
#[derive(Debug, Clone, PartialEq)]
struct Row {
    /// Seconds at its left edge.
    start: f64,
    /// Seconds at its right edge (the next row's start, or the piece's end).
    end: f64,
    /// (bar number from 1, seconds) of each bar starting in the row.
    bars: Vec<(usize, f64)>,
}

/// Where everything goes; computed before drawing so that tests can check it.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Layout {
    pub(crate) width: u32,
    pub(crate) height: u32,
    /// Roll area width (the same for every row).
    plot_w: u32,
    /// Pixels per second (the same for every row).
    x_scale: f64,
    /// Lowest and highest pitch shown.
    lo: u8,
    hi: u8,
    /// Pixels per semitone.
    rh: u32,
    rows: Vec<Row>,
    /// Top of the first row's header strip.
    rows_top: u32,
    /// Title baseline, when there is a title.
    title_y: Option<i32>,
    /// Legend entries: (x, baseline, key, label).
    legend: Vec<(i32, i32, Key, String)>,
    programs: Vec<u8>,
}

impl Layout {
    /// Height of one row's block: header, roll, footer and gap.
    fn block(&self) -> u32 {
        HEADER + self.roll_h() + FOOTER + GAP
    }

    fn roll_h(&self) -> u32 {
        (self.hi - self.lo + 1) as u32 * self.rh
    }

    /// Top of row `r`'s roll area.
    fn roll_top(&self, r: usize) -> i32 {
        (self.rows_top + r as u32 * self.block() + HEADER) as i32
    }

    /// x of `secs` in a row starting at `row_start`, kept near the picture.
    fn x_of(&self, row_start: f64, secs: f64) -> i32 {
        let x = LEFT as f64 + (secs - row_start) * self.x_scale;
        x.clamp(-1.0, (self.width + 1) as f64).floor() as i32
    }

    /// y of the top of `pitch`'s semitone in row `r`.
    fn y_of(&self, r: usize, pitch: u8) -> i32 {
        self.roll_top(r) + ((self.hi - pitch) as u32 * self.rh) as i32
    }
}

/// Splits `0..duration` into rows: `bar_secs` (bar start seconds, the first
/// at 0) grouped `per_row` at a time, at most `max_rows` rows (more bars per
/// row past that); without bars, rows of `chunk` seconds.
fn split_rows(
    bar_secs: &[f64],
    duration: f64,
    per_row: usize,
    chunk: f64,
    max_rows: usize,
) -> Vec<Row> {
    let max_rows = max_rows.max(1);
    if bar_secs.len() > 1 {
        let per_row = per_row.max(1).max(bar_secs.len().div_ceil(max_rows));
        let groups: Vec<&[f64]> = bar_secs.chunks(per_row).collect();
        return groups
            .iter()
            .enumerate()
            .map(|(k, g)| Row {
                start: g[0],
                end: groups.get(k + 1).map_or(duration, |n| n[0]),
                bars: g
                    .iter()
                    .enumerate()
                    .map(|(i, &s)| (k * per_row + i + 1, s))
                    .collect(),
            })
            .collect();
    }
    let n = if chunk > 0.0 && chunk.is_finite() {
        ((duration / chunk).ceil() as usize).clamp(1, max_rows)
    } else {
        1
    };
    let len = duration / n as f64;
    (0..n)
        .map(|k| Row {
            start: k as f64 * len,
            end: if k + 1 == n {
                duration
            } else {
                (k + 1) as f64 * len
            },
            bars: if k == 0 && bar_secs.len() == 1 {
                vec![(1, 0.0)]
            } else {
                Vec::new()
            },
        })
        .collect()
}

pub(crate) fn layout(score: &Score, tempo: &TempoMap, opts: &PianoRollOptions) -> Layout {
    let notes: Vec<_> = score.notes.iter().filter(|n| n.pitch <= 127).collect();
    let end_tick = score_end(score);
    let mut duration = tempo.seconds(end_tick);
    if !(duration.is_finite() && duration > 0.0) {
        duration = 1.0;
    }
    let (lo, hi) = if notes.is_empty() {
        (48u8, 72u8)
    } else {
        let min = notes.iter().map(|n| n.pitch).min().unwrap_or(60);
        let max = notes.iter().map(|n| n.pitch).max().unwrap_or(60);
        (
            min.saturating_sub(opts.pitch_margin),
            max.saturating_add(opts.pitch_margin).min(127),
        )
    };
    let rh = opts.row_height.clamp(1, MAX_ROW_H);
    let width = opts.max_width.max(LEFT + RIGHT + MIN_PLOT_W);
    let max_plot_w = width - LEFT - RIGHT;
    let pps = if opts.pixels_per_second.is_finite() && opts.pixels_per_second > 0.0 {
        opts.pixels_per_second
    } else {
        100.0
    };

    // Legend and title (flowing, wrapped at the image width).
    let mut programs: Vec<u8> = notes
        .iter()
        .filter(|n| !n.is_drum)
        .map(|n| n.program.min(127))
        .collect();
    programs.sort_unstable();
    programs.dedup();
    let mut entries: Vec<(Key, String)> = programs
        .iter()
        .map(|&p| (Some(p), format!("{p} {}", gm_program_name(p))))
        .collect();
    if notes.iter().any(|n| n.is_drum) {
        entries.push((None, "Drums".to_string()));
    }
    let line_h = 18;
    let mut top = TOP as i32;
    let title_y = opts.title.as_ref().filter(|t| !t.is_empty()).map(|_| {
        top += line_h + 2;
        top - 6
    });
    let mut legend = Vec::new();
    if opts.legend && !entries.is_empty() {
        let (mut x, mut y) = (LEFT as i32, top + line_h - 5);
        for (key, label) in entries {
            let w = 14 + text_width(&label, TEXT_SIZE);
            if x > LEFT as i32 && x + w > (width - RIGHT) as i32 {
                x = LEFT as i32;
                y += line_h;
            }
            legend.push((x, y, key, label));
            x += w + 16;
        }
        top = y + 5;
    }
    let rows_top = top as u32 + 2;
    let roll_h = (hi - lo + 1) as u32 * rh;
    let block = HEADER + roll_h + FOOTER + GAP;

    let natural = duration * pps;
    let (rows, x_scale, plot_w) = if natural <= max_plot_w as f64 {
        let plot_w = (natural.round() as u32).clamp(MIN_PLOT_W, max_plot_w);
        let bar_list = bars(score, end_tick);
        let row = Row {
            start: 0.0,
            end: duration,
            bars: bar_list
                .iter()
                .map(|&b| tempo.seconds(b))
                .take_while(|&s| s < duration)
                .enumerate()
                .map(|(i, s)| (i + 1, s))
                .collect(),
        };
        (vec![row], plot_w as f64 / duration, plot_w)
    } else {
        let bar_secs: Vec<f64> = bars(score, end_tick)
            .iter()
            .map(|&b| tempo.seconds(b))
            .take_while(|&s| s < duration)
            .collect();
        let max_rows = (MAX_HEIGHT.saturating_sub(rows_top) / block).clamp(1, MAX_ROWS as u32);
        let longest_of = |rows: &[Row]| rows.iter().map(|r| r.end - r.start).fold(0.0, f64::max);
        // Halve the bars per row while a row would be squeezed below half
        // of `pixels_per_second` (slow tempi, long bars).
        let mut per_row = opts.bars_per_row.max(1) as usize;
        let rows = loop {
            let rows = split_rows(
                &bar_secs,
                duration,
                per_row,
                max_plot_w as f64 / pps,
                max_rows as usize,
            );
            let fits = longest_of(&rows) * pps <= 2.0 * max_plot_w as f64;
            if fits || per_row == 1 || rows.len() >= max_rows as usize {
                break rows;
            }
            per_row /= 2;
        };
        let longest = longest_of(&rows);
        let scale = if longest > 0.0 {
            pps.min(max_plot_w as f64 / longest)
        } else {
            pps
        };
        let plot_w = ((longest * scale).ceil() as u32).clamp(MIN_PLOT_W, max_plot_w);
        (rows, scale, plot_w)
    };
    let height = rows_top + rows.len() as u32 * block - GAP + BOTTOM;
    Layout {
        width: LEFT + plot_w + RIGHT,
        height,
        plot_w,
        x_scale,
        lo,
        hi,
        rh,
        rows,
        rows_top,
        title_y,
        legend,
        programs,
    }
}

/// Fills the pixels [x0, x1) x [y0, y1) (nothing when the box is empty).
pub(crate) fn fill(area: &Area, x0: i32, y0: i32, x1: i32, y1: i32, c: Rgb) -> DrawResult {
    if x1 > x0 && y1 > y0 {
        area.draw(&Rectangle::new([(x0, y0), (x1, y1)], colour(c).filled()))?;
    }
    Ok(())
}

/// A label in colour `c`, aligned at its anchor by `align`.
pub(crate) fn text(s: &str, size: f64, c: Rgb, align: HPos) -> Text<'_> {
    Text {
        text: s,
        size,
        colour: colour(c),
        align,
    }
}

/// Draws `score` as a piano roll PNG at `out` (see the module doc for the
/// layout). An empty score gives an empty roll (C3..C5, one second wide)
/// rather than an error.
pub fn piano_roll_png(score: &Score, out: &Path, opts: &PianoRollOptions) -> Result<()> {
    let tempo = TempoMap::new(score);
    let lay = layout(score, &tempo, opts);
    draw_png(out, "piano roll", lay.width, lay.height, |area| {
        paint(area, score, &tempo, opts, &lay)
    })
}

pub(crate) fn paint(
    area: &Area,
    score: &Score,
    tempo: &TempoMap,
    opts: &PianoRollOptions,
    lay: &Layout,
) -> DrawResult {
    area.fill(&colour(BG))?;
    if let (Some(t), Some(y)) = (&opts.title, lay.title_y) {
        text(t, TITLE_SIZE, TEXT, HPos::Left).draw(area, LEFT as i32, y)?;
    }
    for (x, y, key, label) in &lay.legend {
        let col = colour_for(*key, &lay.programs);
        fill(area, *x, y - 9, x + 9, *y, col)?;
        text(label, TEXT_SIZE, TEXT, HPos::Left).draw(area, x + 14, *y)?;
    }

    let (x0, x1) = (LEFT as i32, (LEFT + lay.plot_w) as i32);
    let rh = lay.rh as i32;
    let notes: Vec<_> = score.notes.iter().filter(|n| n.pitch <= 127).collect();
    let spans: Vec<(f64, f64)> = notes
        .iter()
        .map(|n| (tempo.seconds(n.start), tempo.seconds(note_end(n))))
        .collect();
    let gap = if rh >= 3 { 1 } else { 0 };
    let last = lay.rows.len().saturating_sub(1);
    for (r, row) in lay.rows.iter().enumerate() {
        let top = lay.roll_top(r);
        let bottom = top + lay.roll_h() as i32;
        let row_x1 = lay.x_of(row.start, row.end).clamp(x0 + 1, x1);

        // Semitone rows, C lines and their names.
        for p in lay.lo..=lay.hi {
            let bg = if matches!(p % 12, 1 | 3 | 6 | 8 | 10) {
                BLACK_KEY_BG
            } else {
                ROLL_BG
            };
            let y = lay.y_of(r, p);
            fill(area, x0, y, row_x1, y + rh, bg)?;
        }
        let has_c = (lay.lo..=lay.hi).any(|p| p % 12 == 0);
        for p in lay.lo..=lay.hi {
            if p % 12 == 0 || (!has_c && p == lay.lo) {
                let y = lay.y_of(r, p) + rh - 1; // bottom edge of the row
                if p % 12 == 0 {
                    fill(area, x0, y, row_x1, y + 1, C_LINE)?;
                }
                let name = note_name(p);
                let base = (y + 1).clamp(top + 9, bottom);
                text(&name, SMALL_SIZE, TEXT, HPos::Right).draw(area, x0 - 5, base)?;
            }
        }

        // Bar lines (thinned out when closer than 4 px) and bar numbers
        // (when their labels do not overlap).
        if !row.bars.is_empty() {
            text("bar", SMALL_SIZE, DIM_TEXT, HPos::Right).draw(area, x0 - 5, top - 4)?;
        }
        let mut last_line = i32::MIN / 2;
        let mut label_end = i32::MIN / 2;
        for &(number, secs) in &row.bars {
            let x = lay.x_of(row.start, secs);
            if x >= row_x1 {
                break;
            }
            if x - last_line >= 4 {
                fill(area, x, top, x + 1, bottom, BAR_LINE)?;
                last_line = x;
            }
            let label = number.to_string();
            if x >= label_end {
                text(&label, SMALL_SIZE, TEXT, HPos::Left).draw(area, x + 2, top - 4)?;
                label_end = x + 2 + text_width(&label, SMALL_SIZE) + 6;
            }
        }

        // Notes: body in the instrument colour scaled by velocity, a darker
        // first column so that repeated notes stay apart. A note crossing a
        // row's end goes on in the next row.
        for (n, &(s, e)) in notes.iter().zip(&spans) {
            let starts_here = s >= row.start && (s < row.end || (r == last && s <= row.end));
            let goes_on_here = s < row.start && e > row.start;
            if !(starts_here || goes_on_here) {
                continue;
            }
            let key = if n.is_drum {
                None
            } else {
                Some(n.program.min(127))
            };
            let base = colour_for(key, &lay.programs);
            let col = shade(base, 0.35 + 0.65 * n.velocity.min(127) as f64 / 127.0);
            let xs = lay.x_of(row.start, s.max(row.start));
            let xe = lay.x_of(row.start, e.min(row.end)).max(xs + 1);
            let y = lay.y_of(r, n.pitch);
            fill(area, xs, y, xe, y + rh - gap, col)?;
            if starts_here && xe - xs >= 3 {
                fill(area, xs, y, xs + 1, y + rh - gap, shade(col, 0.55))?;
            }
        }

        // Time axis: m:ss labels at least 60 px apart.
        let steps = [1.0, 2.0, 5.0, 10.0, 15.0, 30.0, 60.0, 120.0, 300.0, 600.0];
        let step = steps
            .iter()
            .copied()
            .find(|s| s * lay.x_scale >= 60.0)
            .unwrap_or_else(|| (60.0 / lay.x_scale / 600.0).ceil().max(1.0) * 600.0);
        let first = (row.start / step).ceil();
        for k in 0..=10_000u32 {
            let t = (first + k as f64) * step;
            if t.is_nan() || t > row.end + 1e-9 {
                break;
            }
            let x = lay.x_of(row.start, t);
            fill(area, x, bottom, x + 1, bottom + 4, TEXT)?;
            let label = mss(t);
            let w = text_width(&label, SMALL_SIZE);
            let tx = (x - w / 2).clamp(0, lay.width as i32 - w);
            text(&label, SMALL_SIZE, TEXT, HPos::Left).draw(area, tx, bottom + 14)?;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::midi::{Note, TimeSignature};
    use crate::render::picture::tests::{colours, decode};

    fn note(start: u64, duration: u64, pitch: u8, velocity: u8, program: u8, drum: bool) -> Note {
        Note {
            start,
            duration,
            pitch,
            velocity,
            program,
            channel: if drum { 9 } else { 0 },
            is_drum: drum,
        }
    }

    fn pixel(buf: &[u8], w: u32, x: i32, y: i32) -> Rgb {
        let i = ((y as u32 * w + x as u32) * 3) as usize;
        [buf[i], buf[i + 1], buf[i + 2]]
    }

    #[test]
    fn piano_roll_has_expected_size_and_colours() {
        // 4 s at 120 BPM (8 quarters), pitches 48..=72.
        let mut s = Score::new(480);
        s.time_signatures.push(TimeSignature {
            tick: 0,
            numerator: 3,
            denominator: 4,
        });
        for i in 0..8u64 {
            s.notes.push(note(
                i * 480,
                480,
                48 + 3 * i as u8,
                40 + 10 * i as u8,
                0,
                false,
            ));
            s.notes.push(note(i * 480, 240, 72, 100, 33, false));
            s.notes.push(note(i * 480 + 240, 120, 38, 127, 0, true));
        }
        s.sort();
        let dir = tempfile::tempdir().unwrap();
        let out = dir.path().join("roll.png");
        let opts = PianoRollOptions {
            title: Some("test roll".into()),
            ..Default::default()
        };
        piano_roll_png(&s, &out, &opts).unwrap();
        let (w, h, buf) = decode(&out);
        assert_eq!(w, LEFT + 400 + RIGHT);
        // Pitches 36..=74 with margin 2: 39 rows of 5 px, one row block,
        // plus title and legend.
        let roll = (74 - 36 + 1) * 5;
        let one_block = HEADER + roll + FOOTER;
        assert!(h > one_block && h < one_block + 80, "height {h}");
        let cols = colours(&buf);
        assert!(cols.len() >= 8, "only {} colours", cols.len());
        assert!(
            cols.contains(&DRUM),
            "drums at full velocity are drawn in DRUM"
        );
        assert!(cols.contains(&BAR_LINE) && cols.contains(&C_LINE));

        // A note is drawn where it belongs: the first drum hit (tick 240,
        // 0.25 s to 0.375 s) on pitch 38 ...
        let lay = layout(&s, &TempoMap::new(&s), &opts);
        assert_eq!(lay.rows.len(), 1);
        let y = lay.y_of(0, 38) + 2;
        assert_eq!(pixel(&buf, w, lay.x_of(0.0, 0.32), y), DRUM);
        // ... and not between the hits (0.45 s).
        assert_ne!(pixel(&buf, w, lay.x_of(0.0, 0.45), y), DRUM);

        // A long piece is wrapped into rows of 8 bars of 3/4 (12 s, 1200 px).
        let mut long = s.clone();
        long.notes.push(note(0, 480 * 2 * 600, 60, 80, 0, false)); // 10 minutes
        piano_roll_png(&long, &out, &PianoRollOptions::default()).unwrap();
        let (w, h, _) = decode(&out);
        assert_eq!(w, LEFT + 1200 + RIGHT);
        assert!(h > 20 * one_block, "height {h}");
    }

    #[test]
    fn long_pieces_wrap_into_rows_of_bars() {
        // 40 bars of 4/4 at 120 BPM (2 s a bar): 80 s, 8000 px at 100 px/s.
        let mut s = Score::new(480);
        for bar in 0..40u64 {
            for beat in 0..4u64 {
                let pitch = 60 + ((bar + beat) % 12) as u8;
                s.notes
                    .push(note((bar * 4 + beat) * 480, 240, pitch, 100, 0, false));
            }
        }
        // A note across the row boundary between bars 8 and 9.
        s.notes.push(note(7 * 1920 + 960, 1920, 50, 100, 40, false));
        s.sort();
        let tempo = TempoMap::new(&s);
        let opts = PianoRollOptions::default();
        let lay = layout(&s, &tempo, &opts);
        assert_eq!(lay.rows.len(), 5, "40 bars in rows of 8");
        for (k, row) in lay.rows.iter().enumerate() {
            assert!((row.start - 16.0 * k as f64).abs() < 1e-9);
            // The last row ends with the last note (79.75 s).
            let len = if k == 4 { 15.75 } else { 16.0 };
            assert!((row.end - row.start - len).abs() < 1e-9, "{row:?}");
            let numbers: Vec<usize> = row.bars.iter().map(|b| b.0).collect();
            assert_eq!(numbers, (8 * k + 1..=8 * k + 8).collect::<Vec<_>>());
        }
        // 16 s a row at 100 px/s fits 2000 px: the scale is kept.
        assert_eq!(lay.x_scale, 100.0);
        assert_eq!(lay.plot_w, 1600);
        assert_eq!(lay.width, LEFT + 1600 + RIGHT);
        assert_eq!(lay.height, lay.rows_top + 5 * lay.block() - GAP + BOTTOM);

        let dir = tempfile::tempdir().unwrap();
        let out = dir.path().join("long.png");
        piano_roll_png(&s, &out, &opts).unwrap();
        let (w, h, buf) = decode(&out);
        assert_eq!((w, h), (lay.width, lay.height));
        // The crossing note (program 40, the second colour) ends row 1 and
        // starts row 2.
        let col = colour_for(Some(40), &lay.programs);
        let col = shade(col, 0.35 + 0.65 * 100.0 / 127.0);
        let y0 = lay.y_of(0, 50) + 2;
        let y1 = lay.y_of(1, 50) + 2;
        assert_eq!(pixel(&buf, w, lay.x_of(0.0, 15.5), y0), col);
        assert_eq!(pixel(&buf, w, lay.x_of(16.0, 16.5), y1), col);
        assert_ne!(pixel(&buf, w, lay.x_of(16.0, 17.5), y1), col);
        // Bar lines start every row at its left edge... and the header
        // strips carry text (bar numbers): some pixel there is not BG.
        for r in 0..lay.rows.len() {
            let top = lay.roll_top(r);
            let header_ink = (top - HEADER as i32..top)
                .any(|y| (LEFT as i32..LEFT as i32 + 20).any(|x| pixel(&buf, w, x, y) != BG));
            assert!(header_ink, "row {r} has no bar number");
            assert_eq!(pixel(&buf, w, LEFT as i32, top + 1), BAR_LINE);
        }

        // Fewer bars per row give more rows; a cap on height lengthens rows.
        let eight = layout(
            &s,
            &tempo,
            &PianoRollOptions {
                bars_per_row: 4,
                ..opts.clone()
            },
        );
        assert_eq!(eight.rows.len(), 10);
        let tall = layout(
            &s,
            &tempo,
            &PianoRollOptions {
                bars_per_row: 1,
                row_height: MAX_ROW_H,
                ..opts.clone()
            },
        );
        assert!(tall.height <= MAX_HEIGHT + tall.block(), "{}", tall.height);
        assert!(tall.rows.len() < 40);
        assert!(tall.width <= 2000);

        // At 30 BPM a bar lasts 8 s: 8 bars (6400 px) would be squeezed to
        // under a third of the scale, so rows hold 4 bars (32 s, 61 px/s).
        let mut slow = s.clone();
        slow.tempos.push(crate::midi::TempoChange {
            tick: 0,
            us_per_quarter: 2_000_000,
        });
        let lay = layout(&slow, &TempoMap::new(&slow), &opts);
        assert_eq!(lay.rows.len(), 10);
        assert_eq!(lay.rows[1].bars[0].0, 5);
        assert!(
            (lay.x_scale - 1950.0 / 32.0).abs() < 1e-9,
            "{}",
            lay.x_scale
        );
        assert_eq!(lay.width, 2000);
    }

    #[test]
    fn odd_scores_do_not_panic() {
        let dir = tempfile::tempdir().unwrap();
        let out = dir.path().join("odd.png");
        let o = PianoRollOptions::default();
        piano_roll_png(&Score::new(480), &out, &o).unwrap();
        let (w, _, _) = decode(&out);
        assert_eq!(w, LEFT + 100 + RIGHT);

        let mut s = Score::new(0);
        s.notes.push(note(0, u64::MAX, 0, 0, 127, false));
        s.notes.push(note(u64::MAX, u64::MAX, 127, 255, 200, false));
        s.notes.push(note(5, 0, 64, 100, 0, true));
        piano_roll_png(&s, &out, &o).unwrap();
        let (w, h, _) = decode(&out);
        assert!(w <= 2000, "width {w}");
        assert!(
            (128 * 5..=MAX_HEIGHT + 128 * 5 + 200).contains(&h),
            "height {h}"
        );

        let weird = PianoRollOptions {
            pixels_per_second: f64::NAN,
            max_width: 0,
            row_height: 0,
            pitch_margin: 255,
            legend: true,
            title: Some(String::new()),
            bars_per_row: 0,
        };
        let mut s = Score::new(480);
        s.notes.push(note(0, 480, 60, 100, 0, false));
        s.notes.push(note(0, 480 * 400, 61, 100, 0, false));
        piano_roll_png(&s, &out, &weird).unwrap();
        let (w, _, _) = decode(&out);
        assert_eq!(w, LEFT + MIN_PLOT_W + RIGHT);

        let err = piano_roll_png(&s, Path::new("/nonexistent/dir/r.png"), &o).unwrap_err();
        assert!(format!("{err:#}").contains("r.png"));
    }
}
