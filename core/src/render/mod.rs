//! Turning a [`Score`](crate::midi::Score) into things a person can check:
//! audio (a stereo WAV rendered with a SoundFont through `rustysynth`), a
//! piano-roll picture, simple line plots (loss curves, per-position NLL),
//! and a bars x bars self-similarity matrix beside a piece's piano roll.
//!
//! Everything here writes plain files: audio through `rustysynth` and
//! `hound`; pictures are drawn with `plotters` into memory and encoded with
//! `png` (module `picture`), their text anti-aliased in the DejaVu Sans font
//! compiled into the crate (module `font`), so no system font is needed.

mod font;
mod gm;
mod pianoroll;
mod picture;
mod plot;
mod similarity;
mod wav;

pub use gm::gm_program_name;
pub use pianoroll::{piano_roll_png, PianoRollOptions};
pub use plot::{line_plot_png, Series, PLOT_HEIGHT, PLOT_WIDTH};
pub use similarity::{self_similarity_png, SelfSimilarityOptions, MATRIX_SIDE};
pub use wav::{
    find_soundfont, render_samples, render_wav, RenderOptions, RenderStats, KNOWN_SOUNDFONTS,
    MAX_RENDER_SECONDS,
};

use crate::midi::{Note, Score, DEFAULT_US_PER_QUARTER};

/// Tick -> seconds conversion following a score's tempo map, with the same
/// meaning as [`Score::tick_to_seconds`] but robust to unsorted maps and fast
/// (binary search) for many look-ups.
#[derive(Debug, Clone)]
pub(crate) struct TempoMap {
    /// (start tick, seconds at start tick, seconds per tick from there on)
    segments: Vec<(u64, f64, f64)>,
}

impl TempoMap {
    pub(crate) fn new(score: &Score) -> Self {
        let tpq = score.ticks_per_quarter.max(1) as f64;
        let per_tick = |us: u32| us as f64 * 1e-6 / tpq;
        let mut tempos = score.tempos.clone();
        tempos.sort_by_key(|t| t.tick);
        let mut segments: Vec<(u64, f64, f64)> = vec![(0, 0.0, per_tick(DEFAULT_US_PER_QUARTER))];
        for t in &tempos {
            let last = *segments.last().expect("never empty");
            if t.tick == last.0 {
                // A later change at the same tick wins.
                segments.last_mut().expect("never empty").2 = per_tick(t.us_per_quarter);
            } else {
                let secs = last.1 + (t.tick - last.0) as f64 * last.2;
                segments.push((t.tick, secs, per_tick(t.us_per_quarter)));
            }
        }
        TempoMap { segments }
    }

    pub(crate) fn seconds(&self, tick: u64) -> f64 {
        let idx = self.segments.partition_point(|s| s.0 <= tick);
        let (start, secs, spt) = self.segments[idx.saturating_sub(1)];
        secs + (tick - start) as f64 * spt
    }
}

/// End tick of a note without overflowing on absurd durations.
pub(crate) fn note_end(n: &Note) -> u64 {
    n.start.saturating_add(n.duration)
}

/// End tick of the last note (0 when there are none), overflow-free.
pub(crate) fn score_end(score: &Score) -> u64 {
    score.notes.iter().map(note_end).max().unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::midi::TempoChange;

    #[test]
    fn tempo_map_matches_score() {
        let mut s = Score::new(480);
        s.tempos.push(TempoChange {
            tick: 0,
            us_per_quarter: 400_000,
        });
        s.tempos.push(TempoChange {
            tick: 960,
            us_per_quarter: 1_000_000,
        });
        s.tempos.push(TempoChange {
            tick: 1000,
            us_per_quarter: 250_000,
        });
        let m = TempoMap::new(&s);
        for tick in [0u64, 1, 480, 959, 960, 961, 1000, 1001, 5000] {
            let a = m.seconds(tick);
            let b = s.tick_to_seconds(tick);
            assert!((a - b).abs() < 1e-9, "tick {tick}: {a} vs {b}");
        }
        // Unsorted maps are handled too.
        s.tempos.reverse();
        let m2 = TempoMap::new(&s);
        assert!((m2.seconds(5000) - m.seconds(5000)).abs() < 1e-9);
        // No tempo: 120 BPM.
        let e = TempoMap::new(&Score::new(480));
        assert!((e.seconds(960) - 1.0).abs() < 1e-12);
        assert!(e.seconds(u64::MAX).is_finite());
    }
}
