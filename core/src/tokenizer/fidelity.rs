//! How faithfully `decode(encode(x))` reproduces `x`, measured note by note
//! against the bounds (onsets within half a step, durations within
//! half a step up to the exact range then 1/8 relative, velocities +-2,
//! tempos 2%, supported time signatures exact). Without velocity tokens
//! (`velocities = false`) velocities are not compared: every note decodes at
//! the config's `default_velocity`.
//!
//! A second stage follows the decoded score through a MIDI file, as
//! `cadenza decode` writes it: `read(write(decode(encode(x))))`, quantized
//! again, must give back every decoded note exactly (onset, duration, pitch,
//! velocity, program, drum flag). Every note that does not is counted by
//! reason ([`MidiLosses`]), so a round trip never loses a note silently.

use std::collections::BTreeMap;

use serde::Serialize;

use crate::midi::{Note, Score, DEFAULT_US_PER_QUARTER};

use super::{decode, encode, quantize, to_output_resolution, QuantizeReport, Vocab};

/// How the notes of a piece fared through tokens and a MIDI file:
/// `quantize(x)` against `quantize(read(write(decode(encode(x)))))`, the
/// file written by [`crate::midi::to_bytes`] and read by
/// [`crate::midi::parse`]. Notes are grouped by (onset, pitch, program, drum
/// flag); within a group, notes equal in duration and velocity are matched
/// first. `kept + changed + missing` is the number of quantized notes.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct MidiLosses {
    /// Notes that came back exactly.
    pub kept: usize,
    /// Notes that came back at their onset but with another duration or
    /// velocity: a note-off was paired with the wrong note-on.
    pub changed: usize,
    /// Notes with nothing left at their onset, pitch and program.
    pub missing: usize,
    /// Notes read back that the quantized input does not have.
    pub extra: usize,
    /// The decoded score could not be written or its file not read (every
    /// note is then counted as missing).
    pub unwritable: bool,
}

impl MidiLosses {
    /// Notes that did not come back exactly.
    pub fn lost(&self) -> usize {
        self.changed + self.missing
    }

    /// Adds another file's counts.
    pub fn add(&mut self, other: &MidiLosses) {
        self.kept += other.kept;
        self.changed += other.changed;
        self.missing += other.missing;
        self.extra += other.extra;
        self.unwritable |= other.unwritable;
    }
}

/// Writes a decoded score (on the grid) to MIDI bytes as `cadenza decode`
/// does, reads them back and quantizes the result onto the grid again.
pub fn midi_round_trip(decoded: &Score, vocab: &Vocab) -> Result<Score, String> {
    let bytes = crate::midi::to_bytes(&to_output_resolution(decoded))
        .map_err(|e| format!("cannot write the decoded score: {e:#}"))?;
    let (back, _) = crate::midi::parse(&bytes)
        .map_err(|e| format!("cannot read the written file back: {e}"))?;
    Ok(quantize(&back, vocab.config()).0)
}

/// Matches `want` against `got` (both on the same grid), see [`MidiLosses`].
pub fn compare_notes(want: &[Note], got: &[Note]) -> MidiLosses {
    // (start, pitch, program, drum) -> the (duration, velocity) of each side.
    type Onset = (u64, u8, u8, bool);
    type Sides = (Vec<(u64, u8)>, Vec<(u64, u8)>);
    let onset = |n: &Note| (n.start, n.pitch, n.program, n.is_drum);
    let mut groups: BTreeMap<Onset, Sides> = BTreeMap::new();
    for n in want {
        groups
            .entry(onset(n))
            .or_default()
            .0
            .push((n.duration, n.velocity));
    }
    for n in got {
        groups
            .entry(onset(n))
            .or_default()
            .1
            .push((n.duration, n.velocity));
    }
    let mut out = MidiLosses::default();
    for (_, (mut a, mut b)) in groups {
        a.sort_unstable();
        b.sort_unstable();
        // Exact matches: a merge of the two sorted lists.
        let (mut i, mut j, mut same) = (0, 0, 0);
        while i < a.len() && j < b.len() {
            match a[i].cmp(&b[j]) {
                std::cmp::Ordering::Equal => {
                    same += 1;
                    i += 1;
                    j += 1;
                }
                std::cmp::Ordering::Less => i += 1,
                std::cmp::Ordering::Greater => j += 1,
            }
        }
        let changed = a.len().min(b.len()) - same;
        out.kept += same;
        out.changed += changed;
        out.missing += a.len() - same - changed;
        out.extra += b.len() - same - changed;
    }
    out
}

#[derive(Debug, Clone, Default, Serialize)]
pub struct Fidelity {
    pub notes: usize,
    pub dropped_out_of_range: usize,
    pub clipped: usize,
    pub lengthened: usize,
    /// Notes whose (program, drum, pitch) group lost or gained notes.
    pub missing_or_extra: usize,
    pub onset_errors: usize,
    pub duration_errors: usize,
    pub velocity_errors: usize,
    /// Note onsets where the tempo in force differs by more than 2%.
    pub tempo_errors: usize,
    pub time_signature_errors: usize,
    pub unsupported_time_signatures: usize,
    pub max_onset_error_steps: f64,
    pub max_velocity_error: i32,
    pub max_tempo_error: f64,
    pub skipped_tokens: usize,
    /// decode(encode(x)) differs from quantize(x).
    pub not_quantized_exactly: bool,
    /// encode(decode(tokens)) differs from tokens.
    pub tokens_not_stable: bool,
    /// The quantized input against what a MIDI file of the decoded score
    /// gives back ([`midi_round_trip`]).
    pub midi: MidiLosses,
}

impl Fidelity {
    pub fn is_perfect(&self) -> bool {
        self.missing_or_extra == 0
            && self.onset_errors == 0
            && self.duration_errors == 0
            && self.velocity_errors == 0
            && self.tempo_errors == 0
            && self.time_signature_errors == 0
            && self.skipped_tokens == 0
            && !self.not_quantized_exactly
            && !self.tokens_not_stable
            && self.midi.lost() == 0
            && self.midi.extra == 0
            && !self.midi.unwritable
    }

    /// Notes of the input that came back exactly through tokens and a MIDI
    /// file (notes out of the pitch range and notes lost on the way are not).
    /// `notes == notes_back() + dropped_out_of_range + midi.lost()`.
    pub fn notes_back(&self) -> usize {
        self.midi.kept
    }
}

fn tempo_at(tempos: &[crate::midi::TempoChange], tick: u64) -> u32 {
    let i = tempos.partition_point(|t| t.tick <= tick);
    if i == 0 {
        DEFAULT_US_PER_QUARTER
    } else {
        tempos[i - 1].us_per_quarter
    }
}

fn sig_at(sigs: &[crate::midi::TimeSignature], tick: u64) -> (u8, u8) {
    let i = sigs.partition_point(|t| t.tick <= tick);
    if i == 0 {
        (4, 4)
    } else {
        (sigs[i - 1].numerator, sigs[i - 1].denominator)
    }
}

/// Round-trips `score` through the tokenizer and measures the differences.
pub fn measure(score: &Score, vocab: &Vocab) -> Fidelity {
    let cfg = vocab.config();
    let (ids, q): (Vec<u32>, QuantizeReport) = encode(score, vocab);
    let (quantized, _) = super::quantize(score, cfg);
    let (decoded, drep) = decode(&ids, vocab);
    let mut f = Fidelity {
        notes: score.notes.len(),
        dropped_out_of_range: q.dropped_out_of_range,
        clipped: q.clipped_durations,
        lengthened: q.lengthened_short_notes,
        unsupported_time_signatures: q.unsupported_time_signatures.len(),
        skipped_tokens: drep.skipped + drep.unknown,
        not_quantized_exactly: decoded != quantized,
        tokens_not_stable: super::encode_quantized(&decoded, vocab) != ids,
        ..Default::default()
    };
    f.midi = match midi_round_trip(&decoded, vocab) {
        Ok(back) => compare_notes(&quantized.notes, &back.notes),
        Err(_) => MidiLosses {
            missing: quantized.notes.len(),
            unwritable: true,
            ..Default::default()
        },
    };
    // Steps -> original ticks.
    let tpq = score.ticks_per_quarter.max(1) as f64;
    let ppq = cfg.positions_per_quarter as f64;
    let step_ticks = tpq / ppq;
    let exact_ticks = cfg.exact_duration_quarters as f64 * tpq;

    type Key = (bool, u8, u8);
    let mut orig: BTreeMap<Key, Vec<&Note>> = BTreeMap::new();
    for n in &score.notes {
        let (lo, hi) = if n.is_drum {
            (cfg.drum_pitch_min, cfg.drum_pitch_max)
        } else {
            (cfg.pitch_min, cfg.pitch_max)
        };
        if (lo..=hi).contains(&n.pitch) {
            orig.entry((n.is_drum, if n.is_drum { 0 } else { n.program }, n.pitch))
                .or_default()
                .push(n);
        }
    }
    let mut dec: BTreeMap<Key, Vec<&Note>> = BTreeMap::new();
    for n in &decoded.notes {
        dec.entry((n.is_drum, n.program, n.pitch))
            .or_default()
            .push(n);
    }
    for (key, mut a) in orig {
        let mut b = dec.remove(&key).unwrap_or_default();
        // Pair notes in the order quantization keeps.
        let snap = |t: u64| (t as f64 / step_ticks).round() as u64;
        a.sort_by_key(|n| (snap(n.start), snap(n.duration).max(1), n.velocity, n.start));
        b.sort_by_key(|n| (n.start, n.duration, n.velocity));
        f.missing_or_extra += a.len().abs_diff(b.len());
        for (x, y) in a.iter().zip(&b) {
            let onset_err = (y.start as f64 * step_ticks - x.start as f64).abs() / step_ticks;
            f.max_onset_error_steps = f.max_onset_error_steps.max(onset_err);
            if onset_err > 0.5 + 1e-9 {
                f.onset_errors += 1;
            }
            let d0 = x.duration as f64;
            let d1 = y.duration as f64 * step_ticks;
            let dur_ok = if d0 < step_ticks / 2.0 {
                y.duration == 1 // lengthened to one step
            } else if d0 <= exact_ticks {
                (d1 - d0).abs() <= step_ticks / 2.0 + 1e-9
            } else if d0 <= cfg.max_duration_quarters as f64 * tpq {
                (d1 / d0 - 1.0).abs() <= 0.125 + (step_ticks / 2.0) / d0
            } else {
                true // clipped, counted apart
            };
            if !dur_ok {
                f.duration_errors += 1;
            }
            // Without velocity tokens every note plays at the default velocity
            // by design: that is not an error.
            if cfg.velocities {
                let verr = (y.velocity as i32 - x.velocity as i32).abs();
                f.max_velocity_error = f.max_velocity_error.max(verr);
                if verr > 2 {
                    f.velocity_errors += 1;
                }
            }
            let t0 = tempo_at(&score.tempos, x.start) as f64;
            let t1 = tempo_at(&decoded.tempos, y.start) as f64;
            let terr = (t1 / t0 - 1.0).abs();
            let in_range = {
                let bpm = 60e6 / t0;
                bpm >= cfg.tempo_min_bpm && bpm <= cfg.tempo_max_bpm
            };
            if in_range {
                f.max_tempo_error = f.max_tempo_error.max(terr);
                if terr > 0.02 {
                    f.tempo_errors += 1;
                }
            }
        }
    }
    f.missing_or_extra += dec.values().map(Vec::len).sum::<usize>();
    // Every supported signature event holds from its (quantized) tick on,
    // unless a later event at the same step replaced it or it was moved to a
    // bar line (reported by quantize).
    let to_step = |t: u64| (t as f64 / step_ticks).round() as u64;
    if q.moved_time_signatures == 0 {
        for (i, ts) in score.time_signatures.iter().enumerate() {
            let s = to_step(ts.tick);
            // A later event within the first bar cuts that bar short: the
            // short bar then carries a signature of its own length.
            let bar = cfg.bar_steps(ts.numerator.max(1), ts.denominator.max(1)) as u64;
            let replaced = score.time_signatures[i + 1..]
                .iter()
                .any(|t| to_step(t.tick) < s + bar);
            if !replaced
                && cfg.is_supported_time_signature(ts.numerator, ts.denominator)
                && sig_at(&decoded.time_signatures, s) != (ts.numerator, ts.denominator)
            {
                f.time_signature_errors += 1;
            }
        }
    }

    f
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tokenizer::RemiConfig;

    fn note(start: u64, duration: u64, pitch: u8, velocity: u8, program: u8) -> Note {
        Note::melodic(start, duration, pitch, velocity, program)
    }

    #[test]
    fn compare_counts_each_note_by_reason() {
        let want = [
            note(0, 4, 60, 80, 0),
            note(0, 8, 60, 80, 0),
            note(4, 4, 62, 80, 0),
            note(8, 4, 64, 80, 0),
        ];
        let got = [
            note(0, 8, 60, 80, 0), // kept
            note(0, 2, 60, 80, 0), // the other one, another duration
            note(4, 4, 62, 64, 0), // another velocity
            note(8, 4, 64, 80, 1), // another program: 64 missing, this extra
        ];
        let m = compare_notes(&want, &got);
        assert_eq!(
            m,
            MidiLosses {
                kept: 1,
                changed: 2,
                missing: 1,
                extra: 1,
                unwritable: false
            }
        );
        assert_eq!(m.lost(), 3);
        assert_eq!(compare_notes(&want, &want).kept, 4);
    }

    #[test]
    fn overlapping_notes_of_two_tracks_with_one_program_come_back() {
        // Two parts of one program (two tracks of a file), the second
        // holding a note of the first's pitch while the first plays it
        // again: one REMI+ stream, one MIDI track, and the note-offs paired
        // the wrong way round before the writer split voices.
        let vocab = Vocab::new(RemiConfig::default()).unwrap();
        let mut s = Score::new(480);
        s.notes = vec![
            note(0, 1920, 67, 80, 48),
            note(480, 480, 67, 100, 48),
            note(960, 480, 67, 60, 48),
            note(0, 960, 60, 80, 48),
            note(0, 480, 60, 80, 48),
            note(0, 480, 60, 80, 48), // identical to the one before
            note(960, 480, 55, 90, 48),
        ];
        s.sort();
        let f = measure(&s, &vocab);
        assert_eq!(f.midi.lost(), 0, "{f:?}");
        assert_eq!(f.midi.extra, 0);
        assert_eq!(f.notes_back(), s.notes.len());
        assert!(f.is_perfect(), "{f:?}");
    }

    #[test]
    fn notes_out_of_the_pitch_range_are_the_only_ones_not_back() {
        let vocab = Vocab::new(RemiConfig::default()).unwrap();
        let mut s = Score::new(480);
        s.notes = vec![note(0, 480, 10, 80, 0), note(0, 480, 60, 80, 0)];
        s.sort();
        let f = measure(&s, &vocab);
        assert_eq!(f.dropped_out_of_range, 1);
        assert_eq!(f.notes_back(), 1);
        assert_eq!(
            f.notes,
            f.notes_back() + f.dropped_out_of_range + f.midi.lost()
        );
    }
}
