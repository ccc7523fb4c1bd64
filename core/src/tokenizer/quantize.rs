//! Snaps a score onto the tokenizer's grids. The result is exactly what
//! `decode(encode(score))` gives back, so it is what round trips compare to.

use crate::midi::{Note, Score, TempoChange, TimeSignature};

use super::config::{nearest_duration, RemiConfig};

/// What quantization changed beyond rounding to the grid.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize)]
pub struct QuantizeReport {
    pub notes_in: usize,
    pub notes_out: usize,
    /// Notes outside the pitch (or drum pitch) range, dropped.
    pub dropped_out_of_range: usize,
    /// Notes longer than the longest duration, clipped.
    pub clipped_durations: usize,
    /// Notes shorter than half a step, lengthened to one step.
    pub lengthened_short_notes: usize,
    /// Tempos outside the tempo range, clamped.
    pub clamped_tempos: usize,
    /// Time signatures without a token of their own (replaced).
    pub unsupported_time_signatures: Vec<String>,
    /// Time signature changes moved to the next bar line.
    pub moved_time_signatures: usize,
}

impl QuantizeReport {
    pub fn warnings(&self) -> Vec<String> {
        let mut w = Vec::new();
        if self.dropped_out_of_range > 0 {
            w.push(format!(
                "{} note(s) outside the pitch range dropped",
                self.dropped_out_of_range
            ));
        }
        if self.clipped_durations > 0 {
            w.push(format!(
                "{} note(s) longer than the longest duration clipped",
                self.clipped_durations
            ));
        }
        if self.clamped_tempos > 0 {
            w.push(format!(
                "{} tempo(s) outside the tempo range clamped",
                self.clamped_tempos
            ));
        }
        if !self.unsupported_time_signatures.is_empty() {
            w.push(format!(
                "unsupported time signature(s) replaced: {}",
                self.unsupported_time_signatures.join(", ")
            ));
        }
        if self.moved_time_signatures > 0 {
            w.push(format!(
                "{} time signature change(s) moved to the next bar line",
                self.moved_time_signatures
            ));
        }
        w
    }
}

/// A supported signature for `num/den`: itself, an equal-length spelling
/// (6/16 -> 3/8), or 4/4.
fn supported_signature(cfg: &RemiConfig, num: u8, den: u8) -> Option<(u8, u8)> {
    if cfg.is_supported_time_signature(num, den) {
        return Some((num, den));
    }
    let (mut n, mut d) = (num as u32, den as u32);
    while n > 0 && d > 1 && n % 2 == 0 && d > *cfg.denominators.iter().min()? as u32 {
        n /= 2;
        d /= 2;
    }
    while n > 0 && n * 2 <= cfg.max_numerator as u32 && d < *cfg.denominators.iter().max()? as u32 {
        if cfg.is_supported_time_signature(n as u8, d as u8) {
            break;
        }
        n *= 2;
        d *= 2;
    }
    (n <= 255 && d <= 255 && cfg.is_supported_time_signature(n as u8, d as u8))
        .then_some((n as u8, d as u8))
}

/// A supported signature whose bar lasts `steps`, preferring denominator `den`.
fn signature_of_length(cfg: &RemiConfig, steps: u64, den: u8) -> Option<(u8, u8)> {
    let mut dens = cfg.denominators.clone();
    dens.sort_by_key(|&d| (d != den, d));
    dens.into_iter().find_map(|d| {
        let whole = 4 * cfg.positions_per_quarter as u64;
        let num = steps * d as u64 / whole;
        (num >= 1
            && num * whole == steps * d as u64
            && num <= 255
            && cfg.is_supported_time_signature(num as u8, d))
        .then_some((num as u8, d))
    })
}

/// Sets the signature from `tick` on: replaces one already there, and keeps
/// the map free of repeats.
fn set_signature(sigs: &mut Vec<TimeSignature>, tick: u64, sig: (u8, u8)) {
    if sigs.last().is_some_and(|t| t.tick == tick) {
        sigs.pop();
    }
    let current = sigs
        .last()
        .map(|t| (t.numerator, t.denominator))
        .unwrap_or((4, 4));
    if current != sig {
        sigs.push(TimeSignature {
            tick,
            numerator: sig.0,
            denominator: sig.1,
        });
    }
}

/// Quantizes `score` to grid steps: the returned score has
/// `ticks_per_quarter == positions_per_quarter`, so ticks are steps.
pub fn quantize(score: &Score, cfg: &RemiConfig) -> (Score, QuantizeReport) {
    let ppq = cfg.positions_per_quarter as u64;
    let tpq = score.ticks_per_quarter.max(1) as u64;
    // round(t * ppq / tpq), in u64 when it cannot overflow (every real file),
    // else in u128
    let step = |t: u64| match t.checked_mul(ppq * 2) {
        Some(x) if x <= u64::MAX - tpq => (x + tpq) / (tpq * 2),
        _ => ((t as u128 * ppq as u128 * 2 + tpq as u128) / (tpq as u128 * 2)) as u64,
    };
    let mut report = QuantizeReport {
        notes_in: score.notes.len(),
        ..Default::default()
    };
    let mut out = Score::new(cfg.positions_per_quarter);

    // Time signatures: a supported spelling, starting a bar. A change in the
    // middle of a bar ends that bar early, as in MIDI: the short bar gets a
    // signature of its own length when one exists, else the change moves to
    // the next bar line.
    let mut sig = (4u8, 4u8);
    let mut bar_start = 0u64;
    for ts in &score.time_signatures {
        let wanted = match supported_signature(cfg, ts.numerator, ts.denominator) {
            Some(s) => {
                if s != (ts.numerator, ts.denominator) {
                    report.unsupported_time_signatures.push(format!(
                        "{}/{} -> {}/{}",
                        ts.numerator, ts.denominator, s.0, s.1
                    ));
                }
                s
            }
            None => {
                report
                    .unsupported_time_signatures
                    .push(format!("{}/{} -> 4/4", ts.numerator, ts.denominator));
                (4, 4)
            }
        };
        let mut at = step(ts.tick).max(bar_start);
        let len = cfg.bar_steps(sig.0, sig.1) as u64;
        let into_bar = (at - bar_start) % len;
        if into_bar != 0 {
            let line = at - into_bar;
            match signature_of_length(cfg, into_bar, sig.1) {
                Some(short) => set_signature(&mut out.time_signatures, line, short),
                None => {
                    report.moved_time_signatures += 1;
                    at = line + len;
                }
            }
        }
        set_signature(&mut out.time_signatures, at, wanted);
        sig = wanted;
        bar_start = at;
    }

    // Tempos: binned; the last of several at one step wins; repeats dropped.
    let mut tempos: Vec<(u64, u16)> = Vec::new();
    for t in &score.tempos {
        let (bin, clamped) = cfg.tempo_bin(t.us_per_quarter);
        report.clamped_tempos += clamped as usize;
        let s = step(t.tick);
        match tempos.last_mut() {
            Some(last) if last.0 == s => last.1 = bin,
            _ => tempos.push((s, bin)),
        }
    }
    let mut current = None;
    for (s, bin) in tempos {
        if current != Some(bin) {
            current = Some(bin);
            out.tempos.push(TempoChange {
                tick: s,
                us_per_quarter: cfg.tempo_us(bin),
            });
        }
    }

    let durations = cfg.durations();
    for n in &score.notes {
        let (lo, hi) = if n.is_drum {
            (cfg.drum_pitch_min, cfg.drum_pitch_max)
        } else {
            (cfg.pitch_min, cfg.pitch_max)
        };
        if n.pitch < lo || n.pitch > hi {
            report.dropped_out_of_range += 1;
            continue;
        }
        let raw = step(n.duration);
        if raw == 0 {
            report.lengthened_short_notes += 1;
        }
        let (di, clipped) = nearest_duration(&durations, raw.min(u32::MAX as u64) as u32);
        report.clipped_durations += clipped as usize;
        out.notes.push(Note {
            start: step(n.start),
            duration: durations[di] as u64,
            pitch: n.pitch,
            velocity: cfg.quantized_velocity(n.velocity),
            program: if n.is_drum { 0 } else { n.program },
            channel: if n.is_drum { 9 } else { 0 },
            is_drum: n.is_drum,
        });
    }
    report.notes_out = out.notes.len();
    if out.notes.is_empty() {
        // Nothing to play: meta events alone do not make a piece.
        out.tempos.clear();
        out.time_signatures.clear();
    }
    out.sort();
    (out, report)
}
