//! A plain, format-independent view of a piece: what the tokenizer, the
//! renderer and the statistics need, and nothing of MIDI's wire format.

use serde::{Deserialize, Serialize};

/// MIDI's default tempo (120 BPM) in microseconds per quarter note.
pub const DEFAULT_US_PER_QUARTER: u32 = 500_000;

/// One sounding note. Times are in ticks of the owning [`Score`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct Note {
    pub start: u64,
    pub duration: u64,
    pub pitch: u8,
    pub velocity: u8,
    /// General MIDI program (0..=127); 0 for drums.
    pub program: u8,
    /// MIDI channel (0..=15) the note came from; 9 for drums when written.
    pub channel: u8,
    pub is_drum: bool,
}

impl Note {
    /// A melodic note on channel 0.
    pub fn melodic(start: u64, duration: u64, pitch: u8, velocity: u8, program: u8) -> Note {
        Note {
            start,
            duration,
            pitch,
            velocity,
            program,
            channel: 0,
            is_drum: false,
        }
    }

    pub fn end(&self) -> u64 {
        self.start + self.duration
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct TempoChange {
    pub tick: u64,
    pub us_per_quarter: u32,
}

impl TempoChange {
    pub fn bpm(&self) -> f64 {
        60_000_000.0 / self.us_per_quarter as f64
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct TimeSignature {
    pub tick: u64,
    pub numerator: u8,
    /// The written denominator (4 for x/4), not MIDI's power of two.
    pub denominator: u8,
}

impl TimeSignature {
    /// Length of one bar in quarter notes, as a fraction (num, den).
    pub fn quarters_per_bar(&self) -> (u64, u64) {
        (4 * self.numerator as u64, self.denominator as u64)
    }
}

/// A key signature from `tick` on: `sharps` sharps (flats when negative,
/// -7..=7 in a valid file), in a major or a minor key.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct KeySignature {
    pub tick: u64,
    pub sharps: i8,
    pub minor: bool,
}

/// The name of the track an instrument's notes came from (the first such
/// track that had a name).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct InstrumentName {
    /// General MIDI program; 0 for drums.
    pub program: u8,
    pub is_drum: bool,
    pub name: String,
}

/// Longest name kept from a file, in bytes.
pub const MAX_NAME_BYTES: usize = 128;

/// A track name as kept: UTF-8 (invalid bytes replaced), control characters
/// dropped, trimmed, at most [`MAX_NAME_BYTES`]; `None` when nothing is left.
pub fn clean_name(bytes: &[u8]) -> Option<String> {
    let text = String::from_utf8_lossy(bytes);
    let mut out = String::new();
    for c in text.chars().filter(|c| !c.is_control()) {
        if out.len() + c.len_utf8() > MAX_NAME_BYTES {
            break;
        }
        out.push(c);
    }
    let out = out.trim();
    (!out.is_empty()).then(|| out.to_string())
}

/// A piece of music: notes sorted by (start, program, pitch), tempo, time
/// signature and key signature maps sorted by tick. Without a tempo or
/// time-signature event at tick 0, MIDI's defaults (120 BPM, 4/4) apply until
/// the first one. Key signatures, the title and the instruments' names are
/// what a file said of itself: the tokenizer ignores them, the writer writes
/// them back.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Score {
    pub ticks_per_quarter: u32,
    pub notes: Vec<Note>,
    pub tempos: Vec<TempoChange>,
    pub time_signatures: Vec<TimeSignature>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub key_signatures: Vec<KeySignature>,
    /// The name of the file's first track when it holds no notes (or of the
    /// only track of a format 0 file): the piece's title, as most editors
    /// write it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub title: Option<String>,
    /// Sorted by (is_drum, program); one entry per instrument at most.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub instrument_names: Vec<InstrumentName>,
}

impl Score {
    pub fn new(ticks_per_quarter: u32) -> Self {
        Score {
            ticks_per_quarter,
            notes: Vec::new(),
            tempos: Vec::new(),
            time_signatures: Vec::new(),
            key_signatures: Vec::new(),
            title: None,
            instrument_names: Vec::new(),
        }
    }

    /// The name given to an instrument, if the file named it.
    pub fn instrument_name(&self, program: u8, is_drum: bool) -> Option<&str> {
        self.instrument_names
            .iter()
            .find(|n| n.is_drum == is_drum && (is_drum || n.program == program))
            .map(|n| n.name.as_str())
    }

    /// Tick at which the last note ends (0 for an empty score).
    pub fn end_tick(&self) -> u64 {
        self.notes.iter().map(Note::end).max().unwrap_or(0)
    }

    /// Puts notes and maps in their canonical order.
    pub fn sort(&mut self) {
        // Readers and the quantizer mostly hand over notes in order, or in
        // long sorted runs, which the (stable) merge sort takes as they are:
        // check first.
        let key = |n: &Note| {
            (
                n.start, n.is_drum, n.program, n.pitch, n.velocity, n.duration, n.channel,
            )
        };
        if !self.notes.is_sorted_by_key(key) {
            self.notes.sort_by_key(key);
        }
        self.tempos.sort_by_key(|t| t.tick);
        self.time_signatures.sort_by_key(|t| t.tick);
        self.key_signatures.sort_by_key(|t| t.tick);
        self.instrument_names
            .sort_by_key(|n| (n.is_drum, n.program));
    }

    /// Seconds at which `tick` sounds, following the tempo map.
    pub fn tick_to_seconds(&self, tick: u64) -> f64 {
        let tpq = self.ticks_per_quarter.max(1) as f64;
        let mut seconds = 0.0;
        let mut last_tick = 0u64;
        let mut us = DEFAULT_US_PER_QUARTER as f64;
        for t in &self.tempos {
            if t.tick >= tick {
                break;
            }
            seconds += (t.tick - last_tick) as f64 / tpq * us * 1e-6;
            last_tick = t.tick;
            us = t.us_per_quarter as f64;
        }
        seconds + (tick - last_tick) as f64 / tpq * us * 1e-6
    }

    /// Total duration in seconds, up to the end of the last note.
    pub fn duration_seconds(&self) -> f64 {
        self.tick_to_seconds(self.end_tick())
    }

    /// The same piece on another tick grid (rounding to the nearest tick).
    pub fn rescaled(&self, ticks_per_quarter: u32) -> Score {
        let from = self.ticks_per_quarter.max(1) as u128;
        let to = ticks_per_quarter as u128;
        let conv = |t: u64| ((t as u128 * to + from / 2) / from) as u64;
        let mut out = Score::new(ticks_per_quarter);
        out.notes = self
            .notes
            .iter()
            .map(|n| {
                let start = conv(n.start);
                let end = conv(n.end());
                Note {
                    start,
                    duration: end - start,
                    ..*n
                }
            })
            .collect();
        out.tempos = self
            .tempos
            .iter()
            .map(|t| TempoChange {
                tick: conv(t.tick),
                ..*t
            })
            .collect();
        out.time_signatures = self
            .time_signatures
            .iter()
            .map(|t| TimeSignature {
                tick: conv(t.tick),
                ..*t
            })
            .collect();
        out.key_signatures = self
            .key_signatures
            .iter()
            .map(|k| KeySignature {
                tick: conv(k.tick),
                ..*k
            })
            .collect();
        out.title = self.title.clone();
        out.instrument_names = self.instrument_names.clone();
        out
    }

    /// Bar start ticks covering `0..=end`, following the time-signature map
    /// (4/4 before the first event). A signature change starts a new bar.
    pub fn bar_ticks(&self, end: u64) -> Vec<u64> {
        let tpq = self.ticks_per_quarter as u64;
        let mut bars = Vec::new();
        let mut sig = (4u64, 4u64);
        let mut tick = 0u64;
        let mut next = 0usize;
        while tick <= end {
            while next < self.time_signatures.len() && self.time_signatures[next].tick <= tick {
                let ts = self.time_signatures[next];
                sig = (ts.numerator.max(1) as u64, ts.denominator.max(1) as u64);
                next += 1;
            }
            bars.push(tick);
            let len = (tpq * 4 * sig.0 / sig.1).max(1);
            let mut nt = tick + len;
            if let Some(ts) = self.time_signatures.get(next) {
                if ts.tick > tick && ts.tick < nt {
                    nt = ts.tick;
                }
            }
            tick = nt;
        }
        bars
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn seconds_follow_tempo_map() {
        let mut s = Score::new(480);
        s.tempos.push(TempoChange {
            tick: 0,
            us_per_quarter: 500_000,
        });
        s.tempos.push(TempoChange {
            tick: 960,
            us_per_quarter: 1_000_000,
        });
        assert!((s.tick_to_seconds(960) - 1.0).abs() < 1e-9);
        assert!((s.tick_to_seconds(1440) - 2.0).abs() < 1e-9);
    }

    #[test]
    fn bars_follow_time_signatures() {
        let mut s = Score::new(4);
        s.time_signatures.push(TimeSignature {
            tick: 0,
            numerator: 3,
            denominator: 4,
        });
        s.time_signatures.push(TimeSignature {
            tick: 24,
            numerator: 6,
            denominator: 8,
        });
        assert_eq!(s.bar_ticks(40), vec![0, 12, 24, 36]);
    }

    #[test]
    fn names_are_cleaned_and_bounded() {
        assert_eq!(clean_name(b"  Violin I\n").as_deref(), Some("Violin I"));
        assert_eq!(clean_name(b"\x00\x01 "), None);
        assert_eq!(clean_name(b"Fl\xfcte").as_deref(), Some("Fl\u{fffd}te"));
        let long = clean_name(&[b'a'; 1000]).unwrap();
        assert_eq!(long.len(), MAX_NAME_BYTES);
        // A multi-byte character is never cut in half.
        let wide = clean_name("\u{e9}".repeat(100).as_bytes()).unwrap();
        assert!(wide.len() <= MAX_NAME_BYTES && wide.chars().all(|c| c == '\u{e9}'));
    }

    #[test]
    fn rescale_keeps_key_signatures_and_names() {
        let mut s = Score::new(960);
        s.key_signatures.push(KeySignature {
            tick: 1920,
            sharps: -3,
            minor: true,
        });
        s.title = Some("Air".into());
        s.instrument_names.push(InstrumentName {
            program: 40,
            is_drum: false,
            name: "Violin".into(),
        });
        let r = s.rescaled(480);
        assert_eq!(r.key_signatures[0].tick, 960);
        assert_eq!(r.title.as_deref(), Some("Air"));
        assert_eq!(r.instrument_name(40, false), Some("Violin"));
        assert_eq!(r.instrument_name(0, false), None);
    }

    #[test]
    fn rescale_keeps_note_ends() {
        let mut s = Score::new(10_080);
        s.notes.push(Note {
            start: 10_080,
            duration: 5_040,
            pitch: 60,
            velocity: 80,
            program: 0,
            channel: 0,
            is_drum: false,
        });
        let r = s.rescaled(480);
        assert_eq!((r.notes[0].start, r.notes[0].duration), (480, 240));
    }
}
