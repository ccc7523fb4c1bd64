//! Objective music statistics for comparing generated pieces with real ones
//! (see docs "Music statistics"): pitch-class entropy over 1- and 4-bar
//! windows, grooving similarity, note density, polyphony, pitch range, share
//! of empty bars and scale consistency. [`compare`] reports each statistic as
//! a distance in standard deviations of a real, held-out set.
//!
//! Conventions, shared by all statistics:
//! - Bars follow the score's time-signature map exactly as
//!   [`Score::bar_ticks`] does (4/4 before the first event, a signature change
//!   starts a new bar), from tick 0 through the bar holding the last note
//!   onset. At most [`MAX_BARS`] bars are looked at; in a pathological score
//!   with more, the notes starting after them are left out of the bar-based
//!   statistics (entropies, grooving, density, empty bars) but still count
//!   for `notes`, polyphony, pitch range and scale consistency.
//! - A note belongs to the bar (and window) in which it starts.
//! - Pitch statistics (entropies, range, scale consistency) use non-drum
//!   notes only; rhythm statistics (grooving, polyphony, empty bars, density)
//!   use all notes.
//! - Every function is total: whatever the score, the results are finite,
//!   and 0 where a statistic is undefined (no notes, no pairs of bars...).

use serde::{Deserialize, Serialize};

use crate::midi::Score;

/// Most bars a piece is looked at over (guards against pathological scores,
/// e.g. `ticks_per_quarter = 0` with far-away onsets).
pub const MAX_BARS: usize = 100_000;

/// Grid steps per quarter note for onset vectors (independent of the score's
/// own resolution).
pub const GRID_PER_QUARTER: u64 = 12;

/// Upper bound on grid positions in one bar (255/1 time is 12,240).
const MAX_POSITIONS: u64 = 1 << 16;

/// Floor on the real standard deviation in [`compare`].
pub const SD_EPSILON: f64 = 1e-6;

/// Major-scale pitch classes relative to the tonic.
const MAJOR: [u8; 7] = [0, 2, 4, 5, 7, 9, 11];
/// Natural-minor pitch classes relative to the tonic.
const MINOR: [u8; 7] = [0, 2, 3, 5, 7, 8, 10];

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct PieceStats {
    /// All notes, drums included.
    pub notes: usize,
    /// Bars from tick 0 through the bar of the last onset (0 without notes).
    pub bars: usize,
    /// Base-2 entropy of the 12-bin pitch-class histogram (non-drum notes) of
    /// each bar, averaged over bars with at least one non-drum note.
    pub pitch_class_entropy: f64,
    /// The same over non-overlapping 4-bar windows (bars 0-3, 4-7, ...).
    pub pitch_class_entropy_4bar: f64,
    /// Per bar, a binary onset vector over a 12-per-quarter grid (all notes);
    /// the mean over all pairs of non-empty bars of 1 - hamming / positions,
    /// where positions is the longer bar's grid length (a shorter bar's vector
    /// is padded with zeros). Computed exactly over all pairs in time linear
    /// in the onsets, from per-position counts. 0 with fewer than two
    /// non-empty bars.
    pub grooving_similarity: f64,
    /// Notes (in the bars looked at) per bar.
    pub notes_per_bar: f64,
    /// Mean, over distinct onset ticks, of the notes sounding there (started
    /// at or before it and not yet ended; a zero-length note sounds for one
    /// tick). All notes, drums included.
    pub polyphony: f64,
    /// Highest minus lowest non-drum pitch (0 without non-drum notes). It
    /// grows with the length of a piece: compare pieces of like length, or
    /// use `pitch_range_8bar`.
    pub pitch_range: f64,
    /// The same within non-overlapping 8-bar windows (bars 0-7, 8-15, ...)
    /// by onset, averaged over windows with a non-drum note: how widely a
    /// piece moves at one time, whatever its length.
    #[serde(default)]
    pub pitch_range_8bar: f64,
    /// Share of bars without any onset.
    pub empty_bar_share: f64,
    /// Highest share of non-drum notes whose pitch class lies in one scale,
    /// over the 12 major and 12 natural-minor keys (0 without such notes).
    pub scale_consistency: f64,
}

impl PieceStats {
    /// The statistics [`compare`] reports, by name, in a fixed order (the
    /// raw counts `notes` and `bars` are sizes, not style, and are left out).
    pub fn named_values(&self) -> [(&'static str, f64); 9] {
        [
            ("pitch_class_entropy", self.pitch_class_entropy),
            ("pitch_class_entropy_4bar", self.pitch_class_entropy_4bar),
            ("grooving_similarity", self.grooving_similarity),
            ("notes_per_bar", self.notes_per_bar),
            ("polyphony", self.polyphony),
            ("pitch_range", self.pitch_range),
            ("pitch_range_8bar", self.pitch_range_8bar),
            ("empty_bar_share", self.empty_bar_share),
            ("scale_consistency", self.scale_consistency),
        ]
    }
}

/// Bar boundaries: `bounds[i]..bounds[i + 1]` is bar `i`.
struct Bars {
    bounds: Vec<u64>,
}

impl Bars {
    /// Bars covering tick 0 through `last_onset`, at most [`MAX_BARS`]; same
    /// rule as [`Score::bar_ticks`], with saturating arithmetic.
    fn new(score: &Score, last_onset: u64) -> Bars {
        let tpq = score.ticks_per_quarter as u64;
        let sigs = &score.time_signatures;
        let mut bounds = Vec::new();
        let mut sig = (4u64, 4u64);
        let mut tick = 0u64;
        let mut next = 0usize;
        loop {
            while next < sigs.len() && sigs[next].tick <= tick {
                let ts = sigs[next];
                sig = (ts.numerator.max(1) as u64, ts.denominator.max(1) as u64);
                next += 1;
            }
            bounds.push(tick);
            let len = (tpq * 4 * sig.0 / sig.1).max(1);
            let mut nt = tick.saturating_add(len);
            if let Some(ts) = sigs.get(next) {
                if ts.tick > tick && ts.tick < nt {
                    nt = ts.tick;
                }
            }
            // `nt == tick` only when saturated at u64::MAX (>= every onset).
            if nt > last_onset || nt == tick || bounds.len() >= MAX_BARS {
                bounds.push(nt);
                return Bars { bounds };
            }
            tick = nt;
        }
    }

    fn count(&self) -> usize {
        self.bounds.len() - 1
    }

    /// The bar in which `tick` falls, if it is among the bars looked at.
    fn index(&self, tick: u64) -> Option<usize> {
        let n = self.count();
        let i = self.bounds[..n]
            .partition_point(|&b| b <= tick)
            .checked_sub(1)?;
        // The last bar also takes ticks at its end when that end saturated.
        if tick < self.bounds[i + 1] || (i + 1 == n && self.bounds[n] == self.bounds[n - 1]) {
            Some(i)
        } else {
            None
        }
    }

    /// Grid positions of bar `i` (at least 1).
    fn positions(&self, i: usize, tpq: u64) -> u64 {
        let len = (self.bounds[i + 1] - self.bounds[i]) as u128;
        let p = (len * GRID_PER_QUARTER as u128).div_ceil(tpq as u128);
        (p.min(MAX_POSITIONS as u128) as u64).max(1)
    }

    /// Grid position of `tick` within bar `i` (rounded to the nearest step).
    fn position(&self, i: usize, tick: u64, tpq: u64, positions: u64) -> u64 {
        let off = (tick - self.bounds[i]) as u128;
        let p = (off * GRID_PER_QUARTER as u128 * 2 + tpq as u128) / (2 * tpq as u128);
        (p.min(positions as u128 - 1)) as u64
    }
}

/// Base-2 entropy of a histogram (0 for an empty one).
fn entropy(hist: &[u32; 12]) -> f64 {
    let total: u32 = hist.iter().sum();
    if total == 0 {
        return 0.0;
    }
    let total = total as f64;
    let h: f64 = hist
        .iter()
        .filter(|&&c| c > 0)
        .map(|&c| {
            let p = c as f64 / total;
            -p * p.log2()
        })
        .sum();
    h.max(0.0)
}

/// Mean entropy over the non-empty histograms (0 if none).
fn mean_entropy<'a>(hists: impl Iterator<Item = &'a [u32; 12]>) -> f64 {
    let (mut sum, mut n) = (0.0, 0usize);
    for h in hists {
        if h.iter().any(|&c| c > 0) {
            sum += entropy(h);
            n += 1;
        }
    }
    if n == 0 {
        0.0
    } else {
        sum / n as f64
    }
}

/// Mean over all pairs of onset sets of 1 - hamming / max(positions), from
/// per-position counts: bars are grouped by length; pairs within a group and
/// with every shorter group are counted when the group is reached, using the
/// running per-position counts of the shorter groups. `bars` holds, per
/// non-empty bar, its grid length and its sorted, deduplicated positions.
fn grooving(mut bars: Vec<(u64, Vec<u64>)>) -> f64 {
    let n = bars.len();
    if n < 2 {
        return 0.0;
    }
    bars.sort_by_key(|b| b.0);
    let max_p = bars.last().map_or(1, |b| b.0) as usize;
    // Running counts over the shorter groups already seen.
    let mut cum = vec![0u64; max_p];
    let mut cum_n = 0u64;
    let mut cum_total = 0u64; // sum of `cum`
    let mut weighted = 0.0f64; // sum over pairs of hamming / positions
    let mut counts = vec![0u64; max_p];
    let mut start = 0;
    while start < n {
        let p = bars[start].0;
        let end = start + bars[start..].partition_point(|b| b.0 == p);
        let n_h = (end - start) as u64;
        let mut touched = Vec::new();
        for (_, ons) in &bars[start..end] {
            for &q in ons {
                let q = q as usize;
                if counts[q] == 0 {
                    touched.push(q);
                }
                counts[q] += 1;
            }
        }
        // within: sum_q c_q (n_h - c_q); cross with shorter groups:
        // sum_q c_q (cum_n - cum_q) + cum_q (n_h - c_q)
        //   = cum_n * sum c + n_h * cum_total - 2 sum_q c_q cum_q.
        let (mut within, mut sum_c, mut dot) = (0u128, 0u128, 0u128);
        for &q in &touched {
            let c = counts[q] as u128;
            within += c * (n_h as u128 - c);
            sum_c += c;
            dot += c * cum[q] as u128;
        }
        let cross = cum_n as u128 * sum_c + n_h as u128 * cum_total as u128 - 2 * dot;
        weighted += (within + cross) as f64 / p as f64;
        for &q in &touched {
            cum[q] += counts[q];
            cum_total += counts[q];
            counts[q] = 0;
        }
        cum_n += n_h;
        start = end;
    }
    let pairs = n as f64 * (n as f64 - 1.0) / 2.0;
    (1.0 - weighted / pairs).clamp(0.0, 1.0)
}

/// Mean number of notes sounding at each distinct onset.
fn polyphony(score: &Score) -> f64 {
    let mut starts: Vec<u64> = score.notes.iter().map(|n| n.start).collect();
    let mut ends: Vec<u64> = score
        .notes
        .iter()
        .map(|n| n.start.saturating_add(n.duration.max(1)))
        .collect();
    starts.sort_unstable();
    ends.sort_unstable();
    let (mut sum, mut onsets) = (0u64, 0u64);
    let (mut si, mut ei) = (0usize, 0usize);
    while si < starts.len() {
        let t = starts[si];
        while si < starts.len() && starts[si] == t {
            si += 1;
        }
        while ei < ends.len() && ends[ei] <= t {
            ei += 1;
        }
        // A note saturated at u64::MAX may "end" where it starts.
        sum += si.saturating_sub(ei).max(1) as u64;
        onsets += 1;
    }
    if onsets == 0 {
        0.0
    } else {
        sum as f64 / onsets as f64
    }
}

/// Best share of the pitch classes in `hist` that one major or natural-minor
/// scale holds (0 for an empty histogram).
fn scale_consistency(hist: &[u64; 12]) -> f64 {
    let total: u64 = hist.iter().sum();
    if total == 0 {
        return 0.0;
    }
    let mut best = 0u64;
    for tonic in 0..12u8 {
        for scale in [&MAJOR, &MINOR] {
            let inside: u64 = scale
                .iter()
                .map(|&d| hist[((tonic + d) % 12) as usize])
                .sum();
            best = best.max(inside);
        }
    }
    best as f64 / total as f64
}

/// The piece cut to its first `bars` bars (bars as [`piece_stats`] counts
/// them): the notes that start in them, whole; tempos and time signatures
/// are kept. Whole-piece statistics such as the pitch range grow with a
/// piece's length, so sets of unlike lengths compare only once cut alike.
pub fn first_bars(score: &Score, bars: usize) -> Score {
    let mut out = score.clone();
    let Some(last_onset) = score.notes.iter().map(|n| n.start).max() else {
        return out;
    };
    let b = Bars::new(score, last_onset);
    if b.count() > bars {
        let end = b.bounds[bars];
        out.notes.retain(|n| n.start < end);
    }
    out
}

/// All statistics of one piece. Never panics; every value is finite.
pub fn piece_stats(score: &Score) -> PieceStats {
    let notes = &score.notes;
    let Some(last_onset) = notes.iter().map(|n| n.start).max() else {
        return PieceStats::default();
    };
    let tpq = (score.ticks_per_quarter as u64).max(1);
    let bars = Bars::new(score, last_onset);
    let n_bars = bars.count();

    let mut bar_pc = vec![[0u32; 12]; n_bars];
    // per bar: (lowest, highest) non-drum pitch; (u8::MAX, 0) when none
    let mut bar_lo_hi = vec![(u8::MAX, 0u8); n_bars];
    let mut onsets: Vec<(usize, u64)> = Vec::with_capacity(notes.len());
    let mut in_bars = 0usize;
    let mut pc_all = [0u64; 12];
    let (mut lo, mut hi) = (u8::MAX, 0u8);
    for n in notes {
        if !n.is_drum {
            pc_all[(n.pitch % 12) as usize] += 1;
            lo = lo.min(n.pitch);
            hi = hi.max(n.pitch);
        }
        let Some(i) = bars.index(n.start) else {
            continue;
        };
        in_bars += 1;
        if !n.is_drum {
            bar_pc[i][(n.pitch % 12) as usize] += 1;
            let (l, h) = &mut bar_lo_hi[i];
            *l = (*l).min(n.pitch);
            *h = (*h).max(n.pitch);
        }
        let positions = bars.positions(i, tpq);
        onsets.push((i, bars.position(i, n.start, tpq, positions)));
    }
    onsets.sort_unstable();
    onsets.dedup();

    // Per non-empty bar: (grid length, onset positions).
    let mut groove_bars: Vec<(u64, Vec<u64>)> = Vec::new();
    let mut last_bar = None;
    for &(i, q) in &onsets {
        if last_bar != Some(i) {
            groove_bars.push((bars.positions(i, tpq), Vec::new()));
            last_bar = Some(i);
        }
        if let Some(b) = groove_bars.last_mut() {
            b.1.push(q);
        }
    }
    let non_empty = groove_bars.len();

    let windows4: Vec<[u32; 12]> = bar_pc
        .chunks(4)
        .map(|w| {
            let mut h = [0u32; 12];
            for b in w {
                for (acc, c) in h.iter_mut().zip(b) {
                    *acc += c;
                }
            }
            h
        })
        .collect();

    let ranges8: Vec<f64> = bar_lo_hi
        .chunks(8)
        .filter_map(|w| {
            let l = w.iter().map(|b| b.0).min()?;
            let h = w.iter().map(|b| b.1).max()?;
            (l <= h).then(|| (h - l) as f64)
        })
        .collect();

    PieceStats {
        notes: notes.len(),
        bars: n_bars,
        pitch_class_entropy: mean_entropy(bar_pc.iter()),
        pitch_class_entropy_4bar: mean_entropy(windows4.iter()),
        grooving_similarity: grooving(groove_bars),
        notes_per_bar: in_bars as f64 / n_bars as f64,
        polyphony: polyphony(score),
        pitch_range: if lo <= hi { (hi - lo) as f64 } else { 0.0 },
        pitch_range_8bar: if ranges8.is_empty() {
            0.0
        } else {
            ranges8.iter().sum::<f64>() / ranges8.len() as f64
        },
        empty_bar_share: (n_bars - non_empty) as f64 / n_bars as f64,
        scale_consistency: scale_consistency(&pc_all),
    }
}

/// One statistic of a generated set against a real one.
#[derive(Debug, Clone, Serialize)]
pub struct StatComparison {
    pub name: String,
    pub generated_mean: f64,
    pub real_mean: f64,
    /// Sample standard deviation (n - 1) of the real values; 0 for fewer
    /// than two.
    pub real_sd: f64,
    /// |generated mean - real mean| / max(real sd, [`SD_EPSILON`]).
    pub z_distance: f64,
}

/// Mean and sample standard deviation of the finite values (0, 0 if none).
fn mean_sd(values: impl Iterator<Item = f64>) -> (f64, f64) {
    let v: Vec<f64> = values.filter(|x| x.is_finite()).collect();
    if v.is_empty() {
        return (0.0, 0.0);
    }
    let mean = v.iter().sum::<f64>() / v.len() as f64;
    if v.len() < 2 || !mean.is_finite() {
        return (if mean.is_finite() { mean } else { 0.0 }, 0.0);
    }
    let var = v.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / (v.len() - 1) as f64;
    (mean, if var.is_finite() { var.sqrt() } else { 0.0 })
}

/// For each statistic of [`PieceStats::named_values`]: the generated mean, the
/// real mean and standard deviation, and the distance in real standard
/// deviations. Non-finite values (e.g. from hand-edited JSON) are skipped;
/// an empty set has mean 0.
pub fn compare(generated: &[PieceStats], real: &[PieceStats]) -> Vec<StatComparison> {
    let names = PieceStats::default().named_values().map(|(name, _)| name);
    names
        .iter()
        .enumerate()
        .map(|(k, name)| {
            let (generated_mean, _) = mean_sd(generated.iter().map(|s| s.named_values()[k].1));
            let (real_mean, real_sd) = mean_sd(real.iter().map(|s| s.named_values()[k].1));
            let z = (generated_mean - real_mean).abs() / real_sd.max(SD_EPSILON);
            StatComparison {
                name: name.to_string(),
                generated_mean,
                real_mean,
                real_sd,
                z_distance: if z.is_finite() { z } else { f64::MAX },
            }
        })
        .collect()
}

/// A markdown table of [`compare`]'s rows. Where the real pieces do not vary
/// (one real piece, or all alike) the distance reads `-`: a difference over a
/// zero spread is no number of standard deviations.
pub fn markdown(rows: &[StatComparison]) -> String {
    let mut out = String::from(
        "| statistic | generated mean | real mean | real sd | distance (real sd) |\n\
         |---|---:|---:|---:|---:|\n",
    );
    for r in rows {
        let distance = if r.real_sd < SD_EPSILON {
            "-".to_string()
        } else {
            format!("{:.2}", r.z_distance)
        };
        out.push_str(&format!(
            "| {} | {:.3} | {:.3} | {:.3} | {distance} |\n",
            r.name, r.generated_mean, r.real_mean, r.real_sd
        ));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::midi::{Note, TimeSignature};

    fn note(start: u64, duration: u64, pitch: u8) -> Note {
        Note {
            start,
            duration,
            pitch,
            velocity: 80,
            program: 0,
            channel: 0,
            is_drum: false,
        }
    }

    fn score(tpq: u32, notes: Vec<Note>) -> Score {
        let mut s = Score::new(tpq);
        s.notes = notes;
        s.sort();
        s
    }

    fn close(a: f64, b: f64) -> bool {
        (a - b).abs() < 1e-9
    }

    fn all_finite(s: &PieceStats) -> bool {
        s.named_values().iter().all(|(_, v)| v.is_finite())
            && s.pitch_class_entropy.is_finite()
            && s.notes_per_bar.is_finite()
    }

    #[test]
    fn c_major_scale() {
        // C D E F G A B C' as eighth notes in one 4/4 bar at 12 ticks/quarter.
        let pitches = [60, 62, 64, 65, 67, 69, 71, 72];
        let notes = pitches
            .iter()
            .enumerate()
            .map(|(i, &p)| note(i as u64 * 6, 6, p))
            .collect();
        let st = piece_stats(&score(12, notes));
        assert_eq!((st.notes, st.bars), (8, 1));
        assert!(close(st.scale_consistency, 1.0));
        assert!(close(st.pitch_range, 12.0));
        assert!(close(st.pitch_range_8bar, 12.0));
        // C twice, six others once: -(2/8 log2 2/8) - 6 (1/8 log2 1/8) = 0.5 + 2.25.
        assert!(close(st.pitch_class_entropy, 2.75), "{st:?}");
        assert!(close(st.pitch_class_entropy_4bar, 2.75));
        assert!(close(st.notes_per_bar, 8.0));
        assert!(close(st.polyphony, 1.0));
        assert!(close(st.empty_bar_share, 0.0));
        assert!(close(st.grooving_similarity, 0.0)); // a single bar: no pairs

        // An F# spoils the key: 8 of 9 notes fit (C major or G major).
        let mut s = score(12, Vec::new());
        s.notes = pitches.iter().map(|&p| note(0, 6, p)).collect();
        s.notes.push(note(0, 6, 66));
        assert!(close(piece_stats(&s).scale_consistency, 8.0 / 9.0));
    }

    #[test]
    fn cluster_entropy_exceeds_repeated_note() {
        let cluster = score(12, (60..72).map(|p| note(0, 12, p)).collect());
        let repeated = score(12, (0..8).map(|i| note(i * 6, 6, 60)).collect());
        let c = piece_stats(&cluster);
        let r = piece_stats(&repeated);
        assert!(close(c.pitch_class_entropy, 12f64.log2()));
        assert!(close(r.pitch_class_entropy, 0.0));
        assert!(c.pitch_class_entropy > r.pitch_class_entropy);
        assert!(close(c.polyphony, 12.0));
        assert!(close(r.pitch_range, 0.0));
        assert!(close(c.pitch_range, 11.0));
    }

    #[test]
    fn windows_average_over_non_empty_bars() {
        // Bar 0: C and G (entropy 1); bar 1 empty; bar 2: C (entropy 0).
        // 4-bar window: C, C, G -> -(2/3 log2 2/3) - (1/3 log2 1/3).
        let s = score(
            12,
            vec![note(0, 12, 60), note(12, 12, 67), note(96, 12, 60)],
        );
        let st = piece_stats(&s);
        assert_eq!(st.bars, 3);
        assert!(close(st.pitch_class_entropy, 0.5));
        let h4 = -(2.0 / 3.0 * (2.0f64 / 3.0).log2()) - (1.0 / 3.0 * (1.0f64 / 3.0).log2());
        assert!(close(st.pitch_class_entropy_4bar, h4));
        assert!(close(st.empty_bar_share, 1.0 / 3.0));
        assert!(close(st.notes_per_bar, 1.0));
    }

    #[test]
    fn windowed_range_does_not_grow_with_length() {
        // 16 bars of 4/4 at 12 ticks/quarter: bars 0-7 move between C4 and
        // G4, bars 8-15 between C5 and G5. The whole piece spans 19
        // semitones; each 8-bar window 7.
        let mut notes = Vec::new();
        for bar in 0..16u64 {
            let base = if bar < 8 { 60 } else { 72 };
            notes.push(note(bar * 48, 12, base));
            notes.push(note(bar * 48 + 24, 12, base + 7));
        }
        // a drum far outside is not a pitch
        let mut drum = note(0, 12, 20);
        drum.is_drum = true;
        notes.push(drum);
        let st = piece_stats(&score(12, notes));
        assert!(close(st.pitch_range, 19.0));
        assert!(close(st.pitch_range_8bar, 7.0), "{st:?}");
        // a window with only empty bars is not averaged in
        let sparse = score(
            12,
            vec![note(0, 12, 60), note(0, 12, 64), note(48 * 16, 12, 70)],
        );
        let st = piece_stats(&sparse);
        assert_eq!(st.bars, 17);
        assert!(close(st.pitch_range_8bar, 2.0), "{st:?}"); // (4 + 0) / 2
    }

    /// Bars of 4/4 with onsets at the given quarter-note offsets.
    fn rhythm(tpq: u32, bars: &[&[u64]]) -> Score {
        let q = tpq as u64;
        let mut notes = Vec::new();
        for (b, onsets) in bars.iter().enumerate() {
            for &o in onsets.iter() {
                notes.push(note(b as u64 * 4 * q + o * q / 2, q / 2, 60));
            }
        }
        score(tpq, notes)
    }

    #[test]
    fn grooving_of_identical_and_alternating_bars() {
        // Offsets in eighths.
        let a: &[u64] = &[0, 2, 4, 6];
        let b: &[u64] = &[0, 4];
        let same = piece_stats(&rhythm(12, &[a, a, a, a]));
        assert!(close(same.grooving_similarity, 1.0));
        // ABAB: 4 of 6 pairs differ in 2 of 48 positions.
        let expected = 1.0 - 4.0 * 2.0 / 48.0 / 6.0;
        for tpq in [12, 480, 7] {
            let alt = piece_stats(&rhythm(tpq, &[a, b, a, b]));
            assert!(alt.grooving_similarity < 1.0);
            assert!(
                close(alt.grooving_similarity, expected),
                "tpq {tpq}: {}",
                alt.grooving_similarity
            );
        }
        // An empty bar between is skipped, not compared.
        let gap = piece_stats(&rhythm(12, &[a, &[], a]));
        assert!(close(gap.grooving_similarity, 1.0));
        assert!(close(gap.empty_bar_share, 1.0 / 3.0));
    }

    /// Pairwise reference for the grooving computation.
    fn grooving_naive(bars: &[(u64, Vec<u64>)]) -> f64 {
        let mut sum = 0.0;
        let mut pairs = 0.0;
        for i in 0..bars.len() {
            for j in i + 1..bars.len() {
                let p = bars[i].0.max(bars[j].0);
                let a = &bars[i].1;
                let b = &bars[j].1;
                let diff = a.iter().filter(|x| !b.contains(x)).count()
                    + b.iter().filter(|x| !a.contains(x)).count();
                sum += 1.0 - diff as f64 / p as f64;
                pairs += 1.0;
            }
        }
        if pairs == 0.0 {
            0.0
        } else {
            sum / pairs
        }
    }

    #[test]
    fn grooving_counts_match_pairwise_reference() {
        // Deterministic pseudo-random bars of mixed lengths.
        let mut x = 12345u64;
        let mut rnd = |m: u64| {
            x = x
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            (x >> 33) % m
        };
        for _ in 0..20 {
            let n = 2 + rnd(12) as usize;
            let bars: Vec<(u64, Vec<u64>)> = (0..n)
                .map(|_| {
                    let p = [24, 36, 48, 48, 48][rnd(5) as usize];
                    let mut ons: Vec<u64> = (0..1 + rnd(6)).map(|_| rnd(p)).collect();
                    ons.sort_unstable();
                    ons.dedup();
                    (p, ons)
                })
                .collect();
            let fast = grooving(bars.clone());
            let slow = grooving_naive(&bars);
            assert!((fast - slow).abs() < 1e-9, "{fast} vs {slow}");
        }
    }

    #[test]
    fn bars_agree_with_score_bar_ticks() {
        let mut s = score(12, vec![note(0, 12, 60), note(200, 12, 62)]);
        for (tick, numerator, denominator) in [(0, 3, 4), (30, 6, 8), (100, 5, 4)] {
            s.time_signatures.push(TimeSignature {
                tick,
                numerator,
                denominator,
            });
        }
        let bars = Bars::new(&s, 200);
        let reference = s.bar_ticks(200);
        assert_eq!(&bars.bounds[..bars.count()], &reference[..]);
        assert_eq!(piece_stats(&s).bars, reference.len());
    }

    #[test]
    fn first_bars_cuts_the_range_to_the_bars_kept() {
        // One note per 4/4 bar at 12 ticks/quarter, climbing a semitone a
        // bar over 10 bars, then a 3/4 bar from bar 10 on.
        let mut s = score(
            12,
            (0..12).map(|b| note(b * 48, 12, 60 + b as u8)).collect(),
        );
        s.time_signatures.push(TimeSignature {
            tick: 10 * 48,
            numerator: 3,
            denominator: 4,
        });
        assert_eq!(piece_stats(&s).pitch_range, 11.0);
        let cut = first_bars(&s, 4);
        assert_eq!(cut.notes.len(), 4);
        let st = piece_stats(&cut);
        assert_eq!((st.bars, st.pitch_range), (4, 3.0));
        assert_eq!(cut.time_signatures, s.time_signatures);
        // Bars of 3/4 count as bars: bar 11 starts at 10 * 48 + 36.
        assert_eq!(first_bars(&s, 11).notes.len(), 11);
        // More bars than the piece has, or no notes: unchanged.
        assert_eq!(first_bars(&s, 100), s);
        assert_eq!(first_bars(&Score::new(12), 3), Score::new(12));
    }

    #[test]
    fn chord_polyphony_and_empty_bars() {
        // A C-major triad on every quarter of bar 0, then nothing until bar 3.
        let mut notes = Vec::new();
        for q in 0..4 {
            for p in [60, 64, 67] {
                notes.push(note(q * 12, 12, p));
            }
        }
        notes.push(note(3 * 48, 12, 60));
        let st = piece_stats(&score(12, notes.clone()));
        assert_eq!(st.bars, 4);
        assert!(close(st.empty_bar_share, 0.5));
        // 4 onsets with 3 sounding, 1 with 1.
        assert!(close(st.polyphony, 13.0 / 5.0));
        notes.pop();
        let st = piece_stats(&score(12, notes));
        assert!(close(st.polyphony, 3.0));
        assert!(close(st.empty_bar_share, 0.0));
        // A held note adds to the onsets it spans.
        let held = score(12, vec![note(0, 48, 48), note(0, 12, 60), note(24, 12, 62)]);
        assert!(close(piece_stats(&held).polyphony, 2.0));
    }

    #[test]
    fn empty_and_degenerate_scores() {
        assert_eq!(piece_stats(&Score::new(480)), PieceStats::default());
        assert_eq!(piece_stats(&Score::new(0)), PieceStats::default());

        let mut drums = score(480, (0..8).map(|i| note(i * 240, 10, 36)).collect());
        for n in &mut drums.notes {
            n.is_drum = true;
        }
        let st = piece_stats(&drums);
        assert!(all_finite(&st));
        assert_eq!(st.notes, 8);
        assert!(close(st.pitch_range, 0.0));
        assert!(close(st.scale_consistency, 0.0));
        assert!(close(st.pitch_class_entropy, 0.0));
        assert!(close(st.polyphony, 1.0));

        // Zero resolution, far-away and saturating notes, odd signatures.
        let mut weird = score(
            0,
            vec![
                note(0, u64::MAX, 60),
                note(5, 0, 61),
                note(1 << 40, u64::MAX, 127),
                note(u64::MAX, u64::MAX, 0),
            ],
        );
        weird.time_signatures.push(TimeSignature {
            tick: 3,
            numerator: 0,
            denominator: 0,
        });
        let st = piece_stats(&weird);
        assert!(all_finite(&st), "{st:?}");
        assert_eq!(st.bars, MAX_BARS);
        assert_eq!(st.notes, 4);

        let mut huge = score(u32::MAX, vec![note(u64::MAX, u64::MAX, 60), note(0, 1, 60)]);
        huge.time_signatures.push(TimeSignature {
            tick: 0,
            numerator: 255,
            denominator: 1,
        });
        let st = piece_stats(&huge);
        assert!(all_finite(&st), "{st:?}");
        assert!(st.bars <= MAX_BARS);
    }

    #[test]
    fn compare_identical_and_shifted_sets() {
        let set: Vec<PieceStats> = (0..3)
            .map(|i| PieceStats {
                pitch_class_entropy: 1.0 + i as f64,
                polyphony: 2.0,
                ..Default::default()
            })
            .collect();
        let same = compare(&set, &set);
        assert_eq!(same.len(), PieceStats::default().named_values().len());
        assert!(same.iter().all(|r| r.z_distance == 0.0), "{same:?}");

        let shifted: Vec<PieceStats> = set
            .iter()
            .map(|s| PieceStats {
                pitch_class_entropy: s.pitch_class_entropy + 2.0,
                ..s.clone()
            })
            .collect();
        let rows = compare(&shifted, &set);
        let e = rows
            .iter()
            .find(|r| r.name == "pitch_class_entropy")
            .unwrap();
        assert!(close(e.real_mean, 2.0) && close(e.real_sd, 1.0));
        assert!(close(e.generated_mean, 4.0));
        assert!(close(e.z_distance, 2.0));
        let p = rows.iter().find(|r| r.name == "polyphony").unwrap();
        assert_eq!(p.z_distance, 0.0);

        // Degenerate inputs stay finite.
        assert!(compare(&[], &[])
            .iter()
            .all(|r| r.z_distance == 0.0 && r.real_mean == 0.0));
        let nan = PieceStats {
            polyphony: f64::NAN,
            ..Default::default()
        };
        assert!(
            compare(std::slice::from_ref(&nan), std::slice::from_ref(&nan))
                .iter()
                .all(|r| r.z_distance.is_finite())
        );

        let table = markdown(&rows);
        assert!(table.starts_with("| statistic |"));
        assert_eq!(table.lines().count(), 2 + rows.len());
        assert!(table.contains("| pitch_class_entropy | 4.000 | 2.000 | 1.000 | 2.00 |"));
        // real pieces that do not vary: no distance in their standard deviations
        assert!(
            table.contains("| polyphony | 2.000 | 2.000 | 0.000 | - |"),
            "{table}"
        );
        let one = compare(&shifted[..1], &set[..1]);
        assert!(markdown(&one).contains("| pitch_class_entropy | 3.000 | 1.000 | 0.000 | - |"));
    }
}
