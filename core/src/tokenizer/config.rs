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

/// Bounds of the [`RemiConfig`] fields (see [`RemiConfig::validate`]).
pub mod bounds {
    /// Largest `positions_per_quarter`.
    pub const MAX_POSITIONS_PER_QUARTER: u32 = 480;
    /// Largest `exact_duration_quarters` and `max_duration_quarters`.
    pub const MAX_DURATION_QUARTERS: u32 = 1024;
    /// `long_duration_ratio` lies in this closed range.
    pub const LONG_DURATION_RATIO: (f64, f64) = (1.01, 16.0);
    /// `tempo_min_bpm` and `tempo_max_bpm` lie in this closed range.
    pub const TEMPO_BPM: (f64, f64) = (1.0, 10_000.0);
    /// `tempo_ratio` lies in this closed range.
    pub const TEMPO_RATIO: (f64, f64) = (1.001, 4.0);
    /// Largest `max_numerator`.
    pub const MAX_NUMERATOR: u8 = 64;
    /// Largest denominator.
    pub const MAX_DENOMINATOR: u8 = 64;
    /// Most Position tokens (steps of the longest bar).
    pub const MAX_BAR_STEPS: u32 = 4096;
    /// Most tokens of a vocabulary: ids are stored as u16.
    pub const MAX_TOKENS: u64 = u16::MAX as u64;
}

impl RemiConfig {
    /// Checks every field against its documented range ([`bounds`]) and
    /// the size of the vocabulary it builds, from arithmetic alone: nothing
    /// is allocated before it passes, and every error names the field and
    /// the range it must lie in. A config that passes builds a vocabulary of
    /// at most [`bounds::MAX_TOKENS`] tokens with finite grids.
    pub fn validate(&self) -> anyhow::Result<()> {
        use anyhow::{bail, ensure};
        use bounds::*;
        ensure!(
            (1..=MAX_POSITIONS_PER_QUARTER).contains(&self.positions_per_quarter),
            "positions_per_quarter must be in 1..={MAX_POSITIONS_PER_QUARTER} (got {})",
            self.positions_per_quarter
        );
        ensure!(
            self.pitch_max <= 127,
            "pitch_max must be in 0..=127 (got {})",
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
            "drum_pitch_max must be in 0..=127 (got {})",
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
            "velocity_bins must divide 128: one of 1, 2, 4, 8, 16, 32, 64, 128 (got {})",
            self.velocity_bins
        );
        ensure!(
            (1..=MAX_DURATION_QUARTERS).contains(&self.exact_duration_quarters),
            "exact_duration_quarters must be in 1..={MAX_DURATION_QUARTERS} (got {})",
            self.exact_duration_quarters
        );
        ensure!(
            (self.exact_duration_quarters..=MAX_DURATION_QUARTERS)
                .contains(&self.max_duration_quarters),
            "max_duration_quarters must be in exact_duration_quarters..={MAX_DURATION_QUARTERS}, \
             that is {}..={MAX_DURATION_QUARTERS} (got {})",
            self.exact_duration_quarters,
            self.max_duration_quarters
        );
        let in_range = |name: &str, v: f64, (lo, hi): (f64, f64)| -> anyhow::Result<()> {
            // NaN fails both comparisons; infinities are outside any range
            if !(v >= lo && v <= hi) {
                bail!("{name} must be a finite number in [{lo}, {hi}] (got {v})");
            }
            Ok(())
        };
        in_range(
            "long_duration_ratio",
            self.long_duration_ratio,
            LONG_DURATION_RATIO,
        )?;
        in_range("tempo_min_bpm", self.tempo_min_bpm, TEMPO_BPM)?;
        in_range("tempo_max_bpm", self.tempo_max_bpm, TEMPO_BPM)?;
        ensure!(
            self.tempo_max_bpm > self.tempo_min_bpm,
            "tempo_max_bpm ({}) must be above tempo_min_bpm ({})",
            self.tempo_max_bpm,
            self.tempo_min_bpm
        );
        in_range("tempo_ratio", self.tempo_ratio, TEMPO_RATIO)?;
        ensure!(
            (1..=MAX_NUMERATOR).contains(&self.max_numerator),
            "max_numerator must be in 1..={MAX_NUMERATOR} (got {})",
            self.max_numerator
        );
        ensure!(
            !self.denominators.is_empty()
                && self
                    .denominators
                    .iter()
                    .all(|d| d.is_power_of_two() && *d <= MAX_DENOMINATOR),
            "denominators must be a non-empty list of powers of two in 1..={MAX_DENOMINATOR} \
             (got {:?})",
            self.denominators
        );
        let mut dens = self.denominators.clone();
        dens.sort_unstable();
        dens.dedup();
        ensure!(
            dens.len() == self.denominators.len(),
            "denominators must not repeat a value (got {:?})",
            self.denominators
        );
        ensure!(
            (1..=127).contains(&self.default_velocity),
            "default_velocity must be in 1..=127 (got {})",
            self.default_velocity
        );
        let positions = self.max_bar_steps();
        ensure!(
            positions <= MAX_BAR_STEPS,
            "bars too long: max_numerator / the smallest denominator x 4 x \
             positions_per_quarter makes {positions} positions, more than {MAX_BAR_STEPS}"
        );
        let tokens = self.token_count_bound();
        ensure!(
            tokens <= MAX_TOKENS,
            "the vocabulary would hold about {tokens} tokens, more than the {MAX_TOKENS} that \
             u16 ids allow (exact_duration_quarters x positions_per_quarter = {} duration \
             tokens, {} tempo tokens)",
            self.exact_duration_quarters as u64 * self.positions_per_quarter as u64,
            self.tempo_count()
        );
        Ok(())
    }

    /// An upper bound of the number of tokens the vocabulary of this config
    /// holds, from arithmetic only (the grids are not built). Meaningful for
    /// a config whose fields lie within [`bounds`].
    fn token_count_bound(&self) -> u64 {
        let ppq = self.positions_per_quarter as u64;
        let exact = self.exact_duration_quarters as u64 * ppq;
        let max = self.max_duration_quarters as u64 * ppq;
        // exact steps, then at most one value per ratio step up to max, then max
        let long = ((max as f64 / exact as f64).ln() / self.long_duration_ratio.ln()).ceil();
        let durations = exact + long.max(0.0) as u64 + 1;
        let time_sigs = self.max_numerator as u64 * self.denominators.len() as u64;
        let pitches = (self.pitch_max - self.pitch_min) as u64 + 1;
        let drums = (self.drum_pitch_max - self.drum_pitch_min) as u64 + 1;
        4 + time_sigs
            + self.max_bar_steps() as u64
            + self.tempo_count() as u64
            + 129
            + pitches
            + drums
            + self.velocity_bins as u64
            + durations
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

    /// The error of `validate` on the default config changed by `change`.
    fn refused(change: impl FnOnce(&mut RemiConfig)) -> String {
        let mut c = RemiConfig::default();
        change(&mut c);
        format!("{:#}", c.validate().unwrap_err())
    }

    #[test]
    fn hostile_values_are_refused_naming_the_field_and_range() {
        // 221 GB of tempo bins
        let e = refused(|c| c.tempo_ratio = 1.000_000_000_1);
        assert!(e.contains("tempo_ratio") && e.contains("[1.001, 4]"), "{e}");
        // exact * ppq overflowed u32
        let e = refused(|c| {
            c.exact_duration_quarters = u32::MAX;
            c.max_duration_quarters = u32::MAX;
        });
        assert!(
            e.contains("exact_duration_quarters") && e.contains("1..=1024"),
            "{e}"
        );
        // 0 tempo tokens, then a panic in f64::clamp
        let e = refused(|c| {
            c.tempo_min_bpm = 1e-300;
            c.tempo_max_bpm = 1e300;
        });
        assert!(e.contains("tempo_min_bpm"), "{e}");
        for bad in [f64::INFINITY, f64::NAN, -1.0] {
            let e = refused(|c| c.tempo_max_bpm = bad);
            assert!(e.contains("tempo_max_bpm") && e.contains("finite"), "{e}");
            let e = refused(|c| c.long_duration_ratio = bad);
            assert!(e.contains("long_duration_ratio"), "{e}");
        }
        let e = refused(|c| c.tempo_max_bpm = c.tempo_min_bpm);
        assert!(e.contains("above tempo_min_bpm"), "{e}");
        let e = refused(|c| c.max_duration_quarters = 5);
        assert!(
            e.contains("max_duration_quarters") && e.contains("12..=1024"),
            "{e}"
        );
        let e = refused(|c| c.denominators = vec![4, 4]);
        assert!(e.contains("repeat"), "{e}");
        let e = refused(|c| c.velocity_bins = 3);
        assert!(e.contains("velocity_bins") && e.contains("got 3"), "{e}");
        // every field in range, but too many tokens for u16 ids
        let e = refused(|c| {
            c.positions_per_quarter = 480;
            c.exact_duration_quarters = 200;
            c.max_duration_quarters = 200;
            c.max_numerator = 2;
        });
        assert!(e.contains("u16 ids") && e.contains("96000"), "{e}");
    }

    #[test]
    fn configs_at_the_bounds_are_accepted() {
        let c = RemiConfig {
            tempo_min_bpm: 1.0,
            tempo_max_bpm: 10_000.0,
            tempo_ratio: 1.001,
            long_duration_ratio: 1.01,
            exact_duration_quarters: 1,
            max_duration_quarters: 1024,
            ..RemiConfig::default()
        };
        c.validate().unwrap();
        let bound = c.token_count_bound();
        let v = crate::tokenizer::Vocab::new(c).unwrap();
        assert!(v.len() as u64 <= bound, "{} > {bound}", v.len());
        assert!(v.num_tempos() >= 2);
    }

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
