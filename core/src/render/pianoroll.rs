//! Piano-roll pictures: time (seconds, following the tempo map) across,
//! pitch up, one colour per program, drums in light grey, velocity as
//! brightness, bar lines, C lines with octave labels, a legend on top and a
//! time axis (m:ss) below.

use std::path::Path;

use anyhow::{Context, Result};

use super::canvas::{hsv, shade, text_height, Canvas, Rgb};
use super::font::text_width;
use super::gm::gm_program_name;
use super::{note_end, score_end, TempoMap};
use crate::midi::Score;

/// How to draw a piano roll.
#[derive(Debug, Clone, PartialEq)]
pub struct PianoRollOptions {
    /// Horizontal scale before capping at `max_width`.
    pub pixels_per_second: f64,
    /// Cap on the whole image's width; longer pieces are squeezed to fit.
    pub max_width: u32,
    /// Pixels per semitone.
    pub row_height: u32,
    /// Semitones shown above the highest and below the lowest note.
    pub pitch_margin: u8,
    /// Draw a legend of programs above the roll.
    pub legend: bool,
    /// Optional title line above the legend.
    pub title: Option<String>,
}

impl Default for PianoRollOptions {
    fn default() -> Self {
        PianoRollOptions {
            pixels_per_second: 100.0,
            max_width: 4000,
            row_height: 5,
            pitch_margin: 2,
            legend: true,
            title: None,
        }
    }
}

/// Width of the pitch-label column on the left.
const LEFT: usize = 26;
/// Blank column on the right.
const RIGHT: usize = 4;
/// Time axis strip below the roll.
const BOTTOM: usize = 12;
/// Narrowest roll area, however short the piece.
const MIN_PLOT_W: usize = 64;
/// Tallest row allowed (keeps the image bounded).
const MAX_ROW_H: u32 = 32;

const BG: Rgb = [12, 12, 16];
const ROLL_BG: Rgb = [22, 22, 29];
const BLACK_KEY_BG: Rgb = [17, 17, 23];
const C_LINE: Rgb = [60, 60, 76];
const BAR_LINE: Rgb = [46, 46, 58];
const TEXT: Rgb = [190, 190, 200];
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

/// Draws `score` as a piano roll PNG at `out`. An empty score gives an
/// empty roll (C3..C5, one second wide) rather than an error.
pub fn piano_roll_png(score: &Score, out: &Path, opts: &PianoRollOptions) -> Result<()> {
    let tempo = TempoMap::new(score);
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
    let rows = (hi - lo) as usize + 1;
    let rh = opts.row_height.clamp(1, MAX_ROW_H) as usize;

    let max_w = (opts.max_width as usize).max(LEFT + RIGHT + MIN_PLOT_W);
    let pps = if opts.pixels_per_second.is_finite() && opts.pixels_per_second > 0.0 {
        opts.pixels_per_second
    } else {
        100.0
    };
    let want = (duration * pps).round();
    let plot_w = if want.is_finite() {
        (want.min(1e9) as usize).clamp(MIN_PLOT_W, max_w - LEFT - RIGHT)
    } else {
        max_w - LEFT - RIGHT
    };
    let width = LEFT + plot_w + RIGHT;
    let x_scale = plot_w as f64 / duration;

    // Legend and title layout (flowing, wrapped at the image width).
    let mut programs: Vec<u8> = notes
        .iter()
        .filter(|n| !n.is_drum)
        .map(|n| n.program.min(127))
        .collect();
    programs.sort_unstable();
    programs.dedup();
    let has_drums = notes.iter().any(|n| n.is_drum);
    let mut entries: Vec<(Key, String)> = programs
        .iter()
        .map(|&p| (Some(p), format!("{p} {}", gm_program_name(p))))
        .collect();
    if has_drums {
        entries.push((None, "Drums".to_string()));
    }
    let line_h = text_height(1) + 4;
    let mut top = 4usize;
    let title_y = top;
    if opts.title.is_some() {
        top += line_h;
    }
    let mut placed: Vec<(usize, usize, Key, String)> = Vec::new();
    if opts.legend && !entries.is_empty() {
        let (mut x, mut y) = (LEFT, top);
        for (key, label) in entries {
            let w = 10 + text_width(&label, 1);
            if x > LEFT && x + w > width - RIGHT {
                x = LEFT;
                y += line_h;
            }
            placed.push((x, y, key, label));
            x += w + 12;
        }
        top = y + line_h;
    }
    let roll_top = top + 2;
    let roll_h = rows * rh;
    let height = roll_top + roll_h + BOTTOM;

    let mut c = Canvas::new(width, height, BG);
    if let Some(t) = &opts.title {
        c.text(LEFT as i64, title_y as i64, t, 1, TEXT);
    }
    for (x, y, key, label) in &placed {
        let col = colour_for(*key, &programs);
        c.fill(*x as i64, *y as i64, *x as i64 + 7, *y as i64 + 7, col);
        c.text(*x as i64 + 10, *y as i64, label, 1, TEXT);
    }

    // Rows, C lines and octave labels.
    let (x0, x1) = (LEFT as i64, (LEFT + plot_w) as i64);
    let row_y = |p: u8| (roll_top + (hi - p) as usize * rh) as i64;
    for p in lo..=hi {
        let bg = if matches!(p % 12, 1 | 3 | 6 | 8 | 10) {
            BLACK_KEY_BG
        } else {
            ROLL_BG
        };
        let y = row_y(p);
        c.fill(x0, y, x1, y + rh as i64, bg);
    }
    for p in lo..=hi {
        if p % 12 == 0 {
            let y = row_y(p) + rh as i64 - 1; // bottom edge of the C row
            c.hline(x0, x1, y, C_LINE);
            let label = note_name(p);
            let ty = (y - text_height(1) as i64 + 1).max(roll_top as i64);
            c.text(2, ty, &label, 1, TEXT);
        }
    }

    // Bar lines, thinned out when closer than 4 px.
    let x_of = |secs: f64| -> i64 {
        let x = LEFT as f64 + secs * x_scale;
        x.clamp(-1.0, (width + 1) as f64).floor() as i64
    };
    let bar_list = bars(score, end_tick);
    let (y0, y1) = (roll_top as i64, (roll_top + roll_h) as i64);
    let mut last_x = i64::MIN / 2;
    for &b in &bar_list {
        let x = x_of(tempo.seconds(b));
        if x >= x1 {
            break;
        }
        if x - last_x >= 4 {
            c.vline(x, y0, y1, BAR_LINE);
            last_x = x;
        }
    }

    // Notes: body in the instrument colour scaled by velocity, a darker
    // first column so that repeated notes stay apart.
    let gap = if rh >= 3 { 1 } else { 0 };
    for n in &notes {
        let key = if n.is_drum {
            None
        } else {
            Some(n.program.min(127))
        };
        let base = colour_for(key, &programs);
        let col = shade(base, 0.35 + 0.65 * n.velocity.min(127) as f64 / 127.0);
        let xs = x_of(tempo.seconds(n.start));
        let xe = x_of(tempo.seconds(note_end(n))).max(xs + 1);
        let y = row_y(n.pitch);
        c.fill(xs, y, xe, y + rh as i64 - gap, col);
        if xe - xs >= 3 {
            c.vline(xs, y, y + rh as i64 - gap, shade(col, 0.55));
        }
    }

    // Time axis: m:ss labels at least 60 px apart.
    let steps = [1.0, 2.0, 5.0, 10.0, 15.0, 30.0, 60.0, 120.0, 300.0, 600.0];
    let step = steps
        .iter()
        .copied()
        .find(|s| s * x_scale >= 60.0)
        .unwrap_or_else(|| (60.0 / x_scale / 600.0).ceil().max(1.0) * 600.0);
    let axis_y = (roll_top + roll_h) as i64;
    let mut k = 0u64;
    loop {
        let t = k as f64 * step;
        if t > duration + 1e-9 || k > 10_000 {
            break;
        }
        let x = x_of(t);
        c.vline(x, axis_y, axis_y + 3, TEXT);
        let label = mss(t);
        let w = text_width(&label, 1) as i64;
        let tx = (x - w / 2).clamp(0, width as i64 - w);
        c.text(tx, axis_y + 4, &label, 1, TEXT);
        k += 1;
    }

    c.write_png(out)
        .with_context(|| format!("cannot save piano roll {}", out.display()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::midi::{Note, TimeSignature};
    use std::collections::HashSet;

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

    fn decode(p: &Path) -> (u32, u32, Vec<u8>) {
        let dec = png::Decoder::new(std::fs::File::open(p).unwrap());
        let mut r = dec.read_info().unwrap();
        let mut buf = vec![0; r.output_buffer_size()];
        let info = r.next_frame(&mut buf).unwrap();
        assert_eq!(info.color_type, png::ColorType::Rgb);
        buf.truncate(info.buffer_size());
        (info.width, info.height, buf)
    }

    fn colours(buf: &[u8]) -> HashSet<[u8; 3]> {
        buf.chunks_exact(3).map(|c| [c[0], c[1], c[2]]).collect()
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
        assert_eq!(w as usize, LEFT + 400 + RIGHT);
        // Pitches 36..=74 with margin 2: 39 rows of 5 px, plus furniture.
        let rows = 74 - 36 + 1;
        assert!(h as usize > rows * 5 + BOTTOM && (h as usize) < rows * 5 + BOTTOM + 60);
        let cols = colours(&buf);
        assert!(cols.len() >= 8, "only {} colours", cols.len());
        assert!(
            cols.contains(&DRUM),
            "drums at full velocity are drawn in DRUM"
        );
        assert!(cols.contains(&BAR_LINE) && cols.contains(&C_LINE));

        // A long piece is squeezed to the width cap.
        let mut long = s.clone();
        long.notes.push(note(0, 480 * 2 * 600, 60, 80, 0, false)); // 10 minutes
        piano_roll_png(&long, &out, &PianoRollOptions::default()).unwrap();
        assert_eq!(decode(&out).0, 4000);
    }

    #[test]
    fn odd_scores_do_not_panic() {
        let dir = tempfile::tempdir().unwrap();
        let out = dir.path().join("odd.png");
        let o = PianoRollOptions::default();
        piano_roll_png(&Score::new(480), &out, &o).unwrap();
        let (w, _, _) = decode(&out);
        assert_eq!(w as usize, LEFT + 100 + RIGHT);

        let mut s = Score::new(0);
        s.notes.push(note(0, u64::MAX, 0, 0, 127, false));
        s.notes.push(note(u64::MAX, u64::MAX, 127, 255, 200, false));
        s.notes.push(note(5, 0, 64, 100, 0, true));
        piano_roll_png(&s, &out, &o).unwrap();
        let (w, h, _) = decode(&out);
        assert_eq!(w, 4000);
        assert!(h as usize >= 128 * 5);

        let weird = PianoRollOptions {
            pixels_per_second: f64::NAN,
            max_width: 0,
            row_height: 0,
            pitch_margin: 255,
            legend: true,
            title: Some(String::new()),
        };
        let mut s = Score::new(480);
        s.notes.push(note(0, 480, 60, 100, 0, false));
        piano_roll_png(&s, &out, &weird).unwrap();
        decode(&out);

        let err = piano_roll_png(&s, Path::new("/nonexistent/dir/r.png"), &o).unwrap_err();
        assert!(format!("{err:#}").contains("r.png"));
    }
}
