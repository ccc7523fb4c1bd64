//! The tokenizer's options and the value grids derived from them.

use serde::{Deserialize, Serialize};

/// REMI+ options. The defaults resolve sixteenths and triplets (12 positions
/// per quarter), keep velocities within +-2 (32 bins) and tempos within 2%
/// (log-spaced bins).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RemiConfig {
    /// Grid steps per quarter note.
    pub positions_per_quarter: u32,
    pub pitch_min: u8,
    pub pitch_max: u8,
    pub drum_pitch_min: u8,
    pub drum_pitch_max: u8,
    /// Velocity bins over 0..128; must divide 128.
    pub velocity_bins: u32,
    /// Durations up to this many quarters are exact on the grid.
    pub exact_duration_quarters: u32,
    /// Longer durations are clipped to this many quarters.
    pub max_duration_quarters: u32,
    /// Ratio between consecutive long durations (relative error <= ratio/2 - ish).
    pub long_duration_ratio: f64,
    pub tempo_min_bpm: f64,
    pub tempo_max_bpm: f64,
    /// Ratio between consecutive tempo bins.
    pub tempo_ratio: f64,
    /// Largest numerator of a time signature.
    pub max_numerator: u8,
    /// Denominators with their own tokens.
    pub denominators: Vec<u8>,
    /// Write a `Program` token only when a note's program differs from the
    /// previous note's (MidiTok's `program_changes`); the program carries
    /// across positions and bars. Off: every note has its `Program` token.
    #[serde(skip_serializing_if = "is_false")]
    pub program_changes: bool,
    /// Write a `Velocity` token after each pitch. Off: the vocabulary has no
    /// velocity tokens and every note decodes at `default_velocity`.
    #[serde(skip_serializing_if = "is_true")]
    pub velocities: bool,
    /// The velocity of every note when `velocities` is off (1..=127).
    #[serde(skip_serializing_if = "is_default_velocity")]
    pub default_velocity: u8,
}

/// `default_velocity` when none is given.
pub const DEFAULT_VELOCITY: u8 = 90;

// The new options are left out of the JSON at their defaults, so that a
// config that does not use them serializes (and hashes) as before they existed.
fn is_false(b: &bool) -> bool {
    !*b
}
fn is_true(b: &bool) -> bool {
    *b
}
fn is_default_velocity(v: &u8) -> bool {
    *v == DEFAULT_VELOCITY
}

impl Default for RemiConfig {
    fn default() -> Self {
        RemiConfig {
            positions_per_quarter: 12,
            pitch_min: 21,
            pitch_max: 108,
            drum_pitch_min: 27,
            drum_pitch_max: 88,
            velocity_bins: 32,
            exact_duration_quarters: 12,
            max_duration_quarters: 96,
            long_duration_ratio: 1.2,
            tempo_min_bpm: 20.0,
            tempo_max_bpm: 320.0,
            tempo_ratio: 1.035,
            max_numerator: 12,
            denominators: vec![2, 4, 8],
            program_changes: false,
            velocities: true,
            default_velocity: DEFAULT_VELOCITY,
        }
    }
}

impl RemiConfig {
    pub fn validate(&self) -> anyhow::Result<()> {
        use anyhow::ensure;
        ensure!(
            (1..=480).contains(&self.positions_per_quarter),
            "positions_per_quarter must be in 1..=480 (got {})",
            self.positions_per_quarter
        );
        ensure!(
            self.pitch_max <= 127,
            "pitch_max must be at most 127 (got {})",
            self.pitch_max
        );
        ensure!(
            self.pitch_min <= self.pitch_max,
            "pitch_min ({}) must not be above pitch_max ({})",
            self.pitch_min,
            self.pitch_max
        );
        ensure!(
            self.drum_pitch_max <= 127,
            "drum_pitch_max must be at most 127 (got {})",
            self.drum_pitch_max
        );
        ensure!(
            self.drum_pitch_min <= self.drum_pitch_max,
            "drum_pitch_min ({}) must not be above drum_pitch_max ({})",
            self.drum_pitch_min,
            self.drum_pitch_max
        );
        ensure!(
            self.velocity_bins >= 1 && self.velocity_bins <= 128 && 128 % self.velocity_bins == 0,
            "velocity_bins must divide 128"
        );
        ensure!(
            self.exact_duration_quarters >= 1
                && self.max_duration_quarters >= self.exact_duration_quarters,
            "need 1 <= exact_duration_quarters <= max_duration_quarters"
        );
        ensure!(
            self.long_duration_ratio > 1.0 && self.tempo_ratio > 1.0,
            "ratios must be > 1"
        );
        ensure!(
            self.tempo_min_bpm > 0.0 && self.tempo_max_bpm > self.tempo_min_bpm,
            "bad tempo range"
        );
        ensure!(
            (1..=64).contains(&self.max_numerator),
            "max_numerator must be in 1..=64"
        );
        ensure!(
            !self.denominators.is_empty()
                && self
                    .denominators
                    .iter()
                    .all(|d| d.is_power_of_two() && *d <= 64),
            "denominators must be powers of two <= 64"
        );
        ensure!(
            (1..=127).contains(&self.default_velocity),
            "default_velocity must be in 1..=127"
        );
        let positions = self.max_bar_steps();
        ensure!(positions <= 4096, "bars too long: {positions} positions");
        Ok(())
    }

    /// Steps in a bar of `num/den`.
    pub fn bar_steps(&self, num: u8, den: u8) -> u32 {
        self.positions_per_quarter * 4 * num as u32 / den.max(1) as u32
    }

    /// Steps in the longest representable bar (the number of Position tokens).
    pub fn max_bar_steps(&self) -> u32 {
        let min_den = *self.denominators.iter().min().unwrap_or(&4);
        self.bar_steps(self.max_numerator, min_den).max(1)
    }

    pub fn is_supported_time_signature(&self, num: u8, den: u8) -> bool {
        num >= 1
            && num <= self.max_numerator
            && self.denominators.contains(&den)
            && self.bar_steps(num, den) >= 1
            && (self.positions_per_quarter * 4 * num as u32).is_multiple_of(den as u32)
    }

    /// Width of one velocity bin.
    fn velocity_width(&self) -> u32 {
        128 / self.velocity_bins
    }

    pub fn velocity_bin(&self, velocity: u8) -> u8 {
        ((velocity as u32 / self.velocity_width()).min(self.velocity_bins - 1)) as u8
    }

    /// The velocity a note keeps after quantization: its bin's value, or
    /// `default_velocity` when velocities are not tokens.
    pub fn quantized_velocity(&self, velocity: u8) -> u8 {
        if self.velocities {
            self.velocity_value(self.velocity_bin(velocity))
        } else {
            self.default_velocity
        }
    }

    /// The velocity a bin decodes to: the middle of the bin, at least 1.
    pub fn velocity_value(&self, bin: u8) -> u8 {
        let w = self.velocity_width();
        (bin as u32 * w + w / 2).clamp(1, 127) as u8
    }

    /// Duration values in steps, increasing: every step up to
    /// `exact_duration_quarters`, then a geometric series to the maximum.
    pub fn durations(&self) -> Vec<u32> {
        let ppq = self.positions_per_quarter;
        let exact = self.exact_duration_quarters * ppq;
        let max = self.max_duration_quarters * ppq;
        let mut v: Vec<u32> = (1..=exact).collect();
        let mut x = exact as f64;
        loop {
            x *= self.long_duration_ratio;
            let d = x.round() as u32;
            if d >= max {
                break;
            }
            if d > *v.last().unwrap_or(&0) {
                v.push(d);
            }
        }
        if *v.last().unwrap_or(&0) < max {
            v.push(max);
        }
        v
    }

    /// Number of tempo bins: log-spaced from the minimum to the maximum,
    /// no further apart than `tempo_ratio`.
    fn tempo_count(&self) -> usize {
        ((self.tempo_max_bpm / self.tempo_min_bpm).ln() / self.tempo_ratio.ln()).ceil() as usize + 1
    }

    /// The ratio between consecutive tempo bins (at most `tempo_ratio`).
    fn tempo_step(&self) -> f64 {
        (self.tempo_max_bpm / self.tempo_min_bpm).powf(1.0 / (self.tempo_count() - 1) as f64)
    }

    /// Tempo bins in BPM, increasing.
    pub fn tempos(&self) -> Vec<f64> {
        let step = self.tempo_step();
        (0..self.tempo_count())
            .map(|i| self.tempo_min_bpm * step.powi(i as i32))
            .collect()
    }

    /// The bin of a tempo given in microseconds per quarter; `clamped` says
    /// whether it lay outside the representable range.
    pub fn tempo_bin(&self, us_per_quarter: u32) -> (u16, bool) {
        let bpm = 60_000_000.0 / us_per_quarter.max(1) as f64;
        let n = self.tempo_count() as f64;
        let x = (bpm / self.tempo_min_bpm).ln() / self.tempo_step().ln();
        let clamped = bpm < self.tempo_min_bpm * 0.999 || bpm > self.tempo_max_bpm * 1.001;
        (x.round().clamp(0.0, n - 1.0) as u16, clamped)
    }

    /// The microseconds per quarter a tempo bin decodes to.
    pub fn tempo_us(&self, bin: u16) -> u32 {
        let bpm = self.tempo_min_bpm * self.tempo_step().powi(bin as i32);
        (60_000_000.0 / bpm).round() as u32
    }
}

/// Index of the nearest duration value (relative distance above the exact
/// range), and whether `steps` had to be clipped to the longest value.
pub fn nearest_duration(durations: &[u32], steps: u32) -> (usize, bool) {
    let max = *durations.last().expect("durations are never empty");
    if steps >= max {
        return (durations.len() - 1, steps > max);
    }
    let steps = steps.max(1);
    let i = durations.partition_point(|&d| d < steps);
    if durations[i] == steps || i == 0 {
        return (i, false);
    }
    // Between durations[i-1] and durations[i]: nearest in ratio.
    let lo = durations[i - 1] as f64;
    let hi = durations[i] as f64;
    let s = steps as f64;
    if s / lo <= hi / s {
        (i - 1, false)
    } else {
        (i, false)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_grids_meet_fidelity_bounds() {
        let c = RemiConfig::default();
        c.validate().unwrap();
        for v in 1..=127u8 {
            let back = c.velocity_value(c.velocity_bin(v));
            assert!(
                (back as i32 - v as i32).abs() <= 2,
                "velocity {v} -> {back}"
            );
        }
        for bpm10 in 200..=3200u32 {
            let us = (600_000_000.0 / bpm10 as f64) as u32;
            let (bin, clamped) = c.tempo_bin(us);
            assert!(!clamped);
            let err = (c.tempo_us(bin) as f64 / us as f64 - 1.0).abs();
            assert!(err < 0.02, "tempo {bpm10}/10 bpm err {err}");
        }
        let d = c.durations();
        let one_bar = 12 * 12;
        for s in 1..=one_bar {
            assert_eq!(d[nearest_duration(&d, s).0], s);
        }
        for s in one_bar..=96 * 12 {
            let v = d[nearest_duration(&d, s).0] as f64;
            assert!((v / s as f64 - 1.0).abs() <= 0.125, "duration {s} -> {v}");
        }
        assert!(nearest_duration(&d, 96 * 12 + 1).1);
        assert_eq!(c.max_bar_steps(), 288);
    }
}
