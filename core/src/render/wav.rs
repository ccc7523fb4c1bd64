//! Audio rendering: the score drives a `rustysynth` synthesizer directly (no
//! MIDI file in between) and the result is written as 16-bit stereo WAV.

use std::collections::HashMap;
use std::fs::File;
use std::io::BufReader;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::{bail, Context, Result};
use rustysynth::{SoundFont, Synthesizer, SynthesizerSettings};

use super::{note_end, score_end, TempoMap};
use crate::midi::Score;

/// Places searched (in order) when neither an explicit path nor
/// `$CADENZA_SOUNDFONT` names a SoundFont. SF3 files are not listed:
/// `rustysynth` reads SF2 only.
pub const KNOWN_SOUNDFONTS: &[&str] = &[
    "/usr/share/sounds/sf2/TimGM6mb.sf2",
    "/usr/share/sounds/sf2/FluidR3_GM.sf2",
    "/usr/share/sounds/sf2/default-GM.sf2",
    "/usr/share/sounds/sf2/FluidR3_GS.sf2",
    "/usr/share/soundfonts/default.sf2",
    "/usr/share/soundfonts/FluidR3_GM.sf2",
    "/usr/share/soundfonts/TimGM6mb.sf2",
    "/usr/local/share/soundfonts/default.sf2",
    "/usr/share/sounds/sf2/GeneralUser.sf2",
];

/// Longest piece [`render_samples`] agrees to render (one hour); anything
/// longer is almost surely a broken score and would need gigabytes.
pub const MAX_RENDER_SECONDS: f64 = 3600.0;

/// Finds a SoundFont: `explicit` if given (an error naming it if it is not a
/// file), else `$CADENZA_SOUNDFONT` if set and non-empty (likewise), else the
/// first of [`KNOWN_SOUNDFONTS`] that exists.
pub fn find_soundfont(explicit: Option<&Path>) -> Result<PathBuf> {
    if let Some(p) = explicit {
        if p.is_file() {
            return Ok(p.to_path_buf());
        }
        bail!(
            "soundfont {} {}",
            p.display(),
            if p.exists() {
                "is not a regular file"
            } else {
                "does not exist"
            }
        );
    }
    if let Some(v) = std::env::var_os("CADENZA_SOUNDFONT") {
        if !v.is_empty() {
            let p = PathBuf::from(v);
            if p.is_file() {
                return Ok(p);
            }
            bail!(
                "CADENZA_SOUNDFONT names {}, which is not an existing file",
                p.display()
            );
        }
    }
    for cand in KNOWN_SOUNDFONTS {
        let p = Path::new(cand);
        if p.is_file() {
            return Ok(p.to_path_buf());
        }
    }
    bail!(
        "no SoundFont found (looked in {}); install one (Debian/Ubuntu: \
         `apt-get install timgm6mb-soundfont` or `fluid-soundfont-gm`), set \
         CADENZA_SOUNDFONT=/path/to/file.sf2, or pass --soundfont /path/to/file.sf2",
        KNOWN_SOUNDFONTS.join(", ")
    )
}

/// How to render audio.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RenderOptions {
    /// Output sample rate in Hz (rustysynth accepts 16000..=192000).
    pub sample_rate: u32,
    /// Seconds rendered after the end of the last note, for release and reverb.
    pub tail_seconds: f64,
    /// Linear gain applied to the synthesizer's output. [`render_wav`] then
    /// scales down (never up) so that the peak stays below clipping.
    pub gain: f32,
    /// Loudness [`render_wav`] brings the signal to, as a linear RMS level
    /// (0.158 = -16 dBFS), up or down, its peak still kept below clipping
    /// (so a very spiky piece ends up quieter); `None` leaves the level as
    /// `gain` makes it.
    pub target_rms: Option<f32>,
}

impl Default for RenderOptions {
    fn default() -> Self {
        RenderOptions {
            sample_rate: 44_100,
            tail_seconds: 1.0,
            gain: 1.0,
            target_rms: None,
        }
    }
}

/// What [`render_wav`] wrote (levels are of the written signal, in -1..=1).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RenderStats {
    pub seconds: f64,
    /// Frames per channel.
    pub samples: usize,
    pub peak: f32,
    pub rms: f32,
}

/// Peak level written by [`render_wav`] at most.
const PEAK_LIMIT: f32 = 0.98;

/// The gain [`render_wav`] applies to a signal of this peak and RMS: up or
/// down to `target` RMS when one is set (and the signal is not silence),
/// else 1; then down as far as needed to keep the peak at [`PEAK_LIMIT`].
fn level_scale(peak: f32, rms: f32, target: Option<f32>) -> f32 {
    let wanted = match target {
        Some(t) if t > 0.0 && rms > 1e-6 => t / rms,
        _ => 1.0,
    };
    if peak * wanted > PEAK_LIMIT {
        PEAK_LIMIT / peak
    } else {
        wanted
    }
}

#[derive(Debug, Clone, Copy)]
struct Event {
    sample: usize,
    /// 0 = note off, 1 = note on: offs go first at equal times.
    kind: u8,
    note: usize,
}

/// Gives each melodic program a MIDI channel (all but 9). With at most 15
/// programs every program keeps its own channel; beyond that a program
/// takes over the least recently used idle channel, or failing that the
/// channel with the fewest sounding notes (rustysynth voices keep the sound
/// they started with, so a program change does not alter sounding notes).
struct ChannelAllocator {
    /// Per channel: current program (None = unused), sounding notes, last use.
    program: [Option<u8>; 16],
    active: [u32; 16],
    last_use: [u64; 16],
    clock: u64,
}

impl ChannelAllocator {
    const MELODIC: [usize; 15] = [0, 1, 2, 3, 4, 5, 6, 7, 8, 10, 11, 12, 13, 14, 15];

    fn new() -> Self {
        ChannelAllocator {
            program: [None; 16],
            active: [0; 16],
            last_use: [0; 16],
            clock: 0,
        }
    }

    /// Channel for a note-on of `program`; `Some(program)` in the second
    /// field when a program change must be sent first.
    fn acquire(&mut self, program: u8) -> (usize, Option<u8>) {
        self.clock += 1;
        let chosen = Self::MELODIC
            .iter()
            .copied()
            .find(|&c| self.program[c] == Some(program));
        let (ch, change) = match chosen {
            Some(c) => (c, None),
            None => {
                let c = Self::MELODIC
                    .iter()
                    .copied()
                    .find(|&c| self.program[c].is_none())
                    .or_else(|| {
                        Self::MELODIC
                            .iter()
                            .copied()
                            .filter(|&c| self.active[c] == 0)
                            .min_by_key(|&c| self.last_use[c])
                    })
                    .unwrap_or_else(|| {
                        Self::MELODIC
                            .iter()
                            .copied()
                            .min_by_key(|&c| (self.active[c], self.last_use[c]))
                            .expect("15 channels")
                    });
                self.program[c] = Some(program);
                (c, Some(program))
            }
        };
        self.active[ch] += 1;
        self.last_use[ch] = self.clock;
        (ch, change)
    }

    fn release(&mut self, ch: usize) {
        self.active[ch] = self.active[ch].saturating_sub(1);
    }
}

/// Renders `score` with the SoundFont at `soundfont`; returns (left, right)
/// at `opts.sample_rate`, `opts.gain` applied, not normalized. The length is
/// the end of the last note plus `opts.tail_seconds`; an empty score gives
/// `tail_seconds` of silence. Drums play on channel 9 (standard kit, or the
/// drum notes' `program` as kit number).
///
/// A corrupt SoundFont can make `rustysynth` panic (an index out of bounds
/// in its preset or sample data); that panic is caught here and becomes an
/// error naming the `.sf2`, never a crash.
pub fn render_samples(
    score: &Score,
    soundfont: &Path,
    opts: &RenderOptions,
) -> Result<(Vec<f32>, Vec<f32>)> {
    match crate::util::catch_panic(|| render_samples_unguarded(score, soundfont, opts)) {
        Ok(r) => r,
        Err(msg) => bail!(
            "{}: corrupt or unsupported SoundFont (the synthesizer failed: {msg})",
            soundfont.display()
        ),
    }
}

fn render_samples_unguarded(
    score: &Score,
    soundfont: &Path,
    opts: &RenderOptions,
) -> Result<(Vec<f32>, Vec<f32>)> {
    let sr = opts.sample_rate;
    if !(16_000..=192_000).contains(&sr) {
        bail!("sample rate {sr} Hz is outside the supported 16000..=192000");
    }
    let tempo = TempoMap::new(score);
    let tail = if opts.tail_seconds.is_finite() {
        opts.tail_seconds.max(0.0)
    } else {
        0.0
    };
    let end_seconds = tempo.seconds(score_end(score));
    let total_seconds = end_seconds + tail;
    if !total_seconds.is_finite() || total_seconds > MAX_RENDER_SECONDS {
        bail!(
            "score lasts {end_seconds:.1} s (+{tail:.1} s tail), longer than the \
             {MAX_RENDER_SECONDS} s render limit"
        );
    }
    let to_sample = |secs: f64| (secs * sr as f64).round() as usize;
    let total = to_sample(total_seconds);

    let file = File::open(soundfont)
        .with_context(|| format!("cannot open soundfont {}", soundfont.display()))?;
    let sf = SoundFont::new(&mut BufReader::new(file))
        .map_err(|e| anyhow::anyhow!("{e:?}"))
        .with_context(|| format!("cannot read soundfont {}", soundfont.display()))?;
    let sf = Arc::new(sf);
    let mut settings = SynthesizerSettings::new(sr as i32);
    settings.maximum_polyphony = 256;
    let mut synth = Synthesizer::new(&sf, &settings)
        .map_err(|e| anyhow::anyhow!("{e:?}"))
        .with_context(|| format!("cannot start synthesizer with {}", soundfont.display()))?;

    let mut events = Vec::with_capacity(score.notes.len() * 2);
    for (i, n) in score.notes.iter().enumerate() {
        if n.duration == 0 || n.velocity == 0 || n.pitch > 127 {
            continue;
        }
        let on = to_sample(tempo.seconds(n.start)).min(total);
        let off = to_sample(tempo.seconds(note_end(n))).min(total);
        events.push(Event {
            sample: on,
            kind: 1,
            note: i,
        });
        events.push(Event {
            sample: off.max(on),
            kind: 0,
            note: i,
        });
    }
    events.sort_by_key(|e| (e.sample, e.kind, e.note));

    // Drum kit: the most common program among drum notes (0 = standard).
    let mut kits: HashMap<u8, usize> = HashMap::new();
    for n in score.notes.iter().filter(|n| n.is_drum) {
        *kits.entry(n.program.min(127)).or_default() += 1;
    }
    let kit = kits
        .into_iter()
        .max_by_key(|&(k, c)| (c, std::cmp::Reverse(k)))
        .map_or(0, |(k, _)| k);
    synth.process_midi_message(9, 0xC0, kit as i32, 0);

    let mut left = vec![0f32; total];
    let mut right = vec![0f32; total];
    let mut alloc = ChannelAllocator::new();
    // Channel assigned to each sounding note; sounding count per (channel, key)
    // so that an overlapping note of the same key is not cut short.
    let mut note_channel: HashMap<usize, usize> = HashMap::new();
    let mut sounding: HashMap<(usize, u8), u32> = HashMap::new();
    let mut cursor = 0usize;
    for ev in &events {
        if ev.sample > cursor {
            synth.render(&mut left[cursor..ev.sample], &mut right[cursor..ev.sample]);
            cursor = ev.sample;
        }
        let n = &score.notes[ev.note];
        if ev.kind == 1 {
            let ch = if n.is_drum {
                9
            } else {
                let (ch, change) = alloc.acquire(n.program.min(127));
                if let Some(p) = change {
                    synth.process_midi_message(ch as i32, 0xC0, p as i32, 0);
                }
                ch
            };
            note_channel.insert(ev.note, ch);
            *sounding.entry((ch, n.pitch)).or_default() += 1;
            synth.note_on(ch as i32, n.pitch as i32, n.velocity.min(127) as i32);
        } else if let Some(ch) = note_channel.remove(&ev.note) {
            if ch != 9 {
                alloc.release(ch);
            }
            let count = sounding.entry((ch, n.pitch)).or_default();
            *count = count.saturating_sub(1);
            if *count == 0 {
                sounding.remove(&(ch, n.pitch));
                synth.note_off(ch as i32, n.pitch as i32);
            }
        }
    }
    if cursor < total {
        synth.render(&mut left[cursor..], &mut right[cursor..]);
    }
    let gain = if opts.gain.is_finite() {
        opts.gain
    } else {
        1.0
    };
    if gain != 1.0 {
        left.iter_mut()
            .chain(right.iter_mut())
            .for_each(|s| *s *= gain);
    }
    Ok((left, right))
}

/// Renders `score` (see [`render_samples`]) and writes 16-bit stereo WAV to
/// `out`. If the peak would clip it is scaled down to 0.98; a quieter
/// signal is left as is. An empty score gives a silent file of
/// `opts.tail_seconds`.
pub fn render_wav(
    score: &Score,
    soundfont: &Path,
    opts: &RenderOptions,
    out: &Path,
) -> Result<RenderStats> {
    let (mut left, mut right) = render_samples(score, soundfont, opts)
        .with_context(|| format!("cannot render audio for {}", out.display()))?;
    let (peak_in, sq_in) = left
        .iter()
        .chain(right.iter())
        .fold((0f32, 0f64), |(m, q), s| {
            if s.is_finite() {
                (m.max(s.abs()), q + f64::from(*s) * f64::from(*s))
            } else {
                (m, q)
            }
        });
    let rms_in = if left.is_empty() {
        0.0
    } else {
        (sq_in / (2 * left.len()) as f64).sqrt() as f32
    };
    let scale = level_scale(peak_in, rms_in, opts.target_rms);
    let mut peak = 0f32;
    let mut sum_sq = 0f64;
    for s in left.iter_mut().chain(right.iter_mut()) {
        let v = if s.is_finite() { *s * scale } else { 0.0 };
        *s = v;
        peak = peak.max(v.abs());
        sum_sq += (v as f64) * (v as f64);
    }
    let frames = left.len();
    let rms = if frames > 0 {
        (sum_sq / (2 * frames) as f64).sqrt() as f32
    } else {
        0.0
    };
    let spec = hound::WavSpec {
        channels: 2,
        sample_rate: opts.sample_rate,
        bits_per_sample: 16,
        sample_format: hound::SampleFormat::Int,
    };
    let ctx = || format!("cannot write WAV {}", out.display());
    crate::util::write_via_temp(out, |tmp| {
        let mut w = hound::WavWriter::create(tmp, spec).with_context(ctx)?;
        {
            let mut w16 = w.get_i16_writer((frames * 2) as u32);
            for (l, r) in left.iter().zip(&right) {
                w16.write_sample((l.clamp(-1.0, 1.0) * 32767.0).round() as i16);
                w16.write_sample((r.clamp(-1.0, 1.0) * 32767.0).round() as i16);
            }
            w16.flush().with_context(ctx)?;
        }
        w.finalize().with_context(ctx)
    })?;
    Ok(RenderStats {
        seconds: frames as f64 / opts.sample_rate as f64,
        samples: frames,
        peak,
        rms,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::midi::{Note, TempoChange};

    fn note(start: u64, duration: u64, pitch: u8, program: u8, is_drum: bool) -> Note {
        Note {
            start,
            duration,
            pitch,
            velocity: 100,
            program,
            channel: if is_drum { 9 } else { 0 },
            is_drum,
        }
    }

    fn soundfont_or_skip() -> Option<PathBuf> {
        match find_soundfont(None) {
            Ok(p) => Some(p),
            Err(e) => {
                eprintln!("SKIPPED: no soundfont available: {e:#}");
                None
            }
        }
    }

    fn rms(x: &[i16]) -> f64 {
        if x.is_empty() {
            return 0.0;
        }
        let s: f64 = x.iter().map(|&v| (v as f64 / 32768.0).powi(2)).sum();
        (s / x.len() as f64).sqrt()
    }

    #[test]
    fn explicit_missing_soundfont_is_named() {
        let p = Path::new("/nonexistent/dir/some_font.sf2");
        let err = find_soundfont(Some(p)).unwrap_err().to_string();
        assert!(err.contains("some_font.sf2"), "{err}");
        let dir = tempfile::tempdir().unwrap();
        let f = dir.path().join("x.sf2");
        std::fs::write(&f, b"not really").unwrap();
        assert_eq!(find_soundfont(Some(&f)).unwrap(), f);
        assert!(find_soundfont(Some(dir.path())).is_err());
    }

    #[test]
    fn bad_soundfont_file_is_an_error_naming_it() {
        let dir = tempfile::tempdir().unwrap();
        let f = dir.path().join("broken.sf2");
        std::fs::write(&f, b"RIFF....garbage").unwrap();
        let mut s = Score::new(480);
        s.notes.push(note(0, 480, 60, 0, false));
        let err = render_samples(&s, &f, &RenderOptions::default()).unwrap_err();
        assert!(format!("{err:#}").contains("broken.sf2"), "{err:#}");
    }

    #[test]
    fn renders_small_score_with_right_length_and_silence() {
        let Some(sf) = soundfont_or_skip() else {
            return;
        };
        // 90 BPM: a quarter is 2/3 s. Tempo change at tick 960 to 120 BPM.
        let mut s = Score::new(480);
        s.tempos.push(TempoChange {
            tick: 0,
            us_per_quarter: 666_667,
        });
        s.tempos.push(TempoChange {
            tick: 960,
            us_per_quarter: 500_000,
        });
        // Loud part in the first quarter (piano chord, strings, a drum).
        for p in [60, 64, 67] {
            s.notes.push(note(0, 480, p, 0, false));
        }
        s.notes.push(note(0, 480, 48, 48, false));
        s.notes.push(note(0, 240, 38, 0, true));
        // Then silence until tick 960 + 8*480 (1.333 s + 4 s), and one more note.
        let late = 960 + 8 * 480;
        s.notes.push(note(late, 480, 72, 0, false));
        s.sort();
        let late_s = s.tick_to_seconds(late);
        assert!((late_s - (4.0 / 3.0 + 4.0)).abs() < 1e-3);
        let expected = s.duration_seconds() + 1.0;

        let dir = tempfile::tempdir().unwrap();
        let out = dir.path().join("small.wav");
        let opts = RenderOptions::default();
        let stats = render_wav(&s, &sf, &opts, &out).unwrap();
        assert!((stats.seconds - expected).abs() < 0.005, "{stats:?}");

        let mut r = hound::WavReader::open(&out).unwrap();
        let spec = r.spec();
        assert_eq!((spec.channels, spec.bits_per_sample), (2, 16));
        assert_eq!(spec.sample_rate, 44_100);
        let frames = r.duration() as f64;
        assert!((frames / 44_100.0 - expected).abs() < 0.005, "{frames}");
        let samples: Vec<i16> = r.samples::<i16>().map(|x| x.unwrap()).collect();
        let at = |secs: f64| ((secs * 44_100.0) as usize * 2).min(samples.len());
        let loud = rms(&samples[at(0.0)..at(0.6)]);
        let quiet = rms(&samples[at(3.0)..at(late_s - 0.01)]);
        let late_part = rms(&samples[at(late_s)..at(late_s + 0.4)]);
        let overall = rms(&samples);
        eprintln!("rms loud {loud:.4} quiet {quiet:.6} late {late_part:.4} overall {overall:.4}");
        assert!(loud > 0.01, "first notes not audible: {loud}");
        assert!(late_part > 0.005, "late note not audible: {late_part}");
        assert!(quiet < 0.002, "silent region not quiet: {quiet}");
        assert!(quiet * 20.0 < loud);
        assert!(stats.peak <= 0.99 && stats.peak > 0.01, "{stats:?}");
        assert!(stats.rms > 0.001);
    }

    #[test]
    fn many_programs_and_odd_notes_render() {
        let Some(sf) = soundfont_or_skip() else {
            return;
        };
        let mut s = Score::new(96);
        for p in 0..40u8 {
            s.notes
                .push(note(p as u64 * 12, 48, 40 + p, p * 3 % 128, false));
        }
        s.notes.push(note(0, 96, 0, 0, false));
        s.notes.push(note(0, 96, 127, 0, false));
        s.notes.push(note(10, 0, 60, 0, false)); // zero length: ignored
        s.notes.push(note(20, 96, 60, 0, false)); // overlapping same key
        s.notes.push(note(30, 96, 60, 0, false));
        s.sort();
        let opts = RenderOptions {
            sample_rate: 22_050,
            tail_seconds: 0.5,
            gain: 2.0,
            target_rms: None,
        };
        let (l, r) = render_samples(&s, &sf, &opts).unwrap();
        assert_eq!(l.len(), r.len());
        let expected = (s.duration_seconds() + 0.5) * 22_050.0;
        assert!((l.len() as f64 - expected).abs() <= 1.0);
        let energy: f32 = l.iter().map(|x| x * x).sum();
        assert!(energy > 1.0, "{energy}");
    }

    #[test]
    fn levels_reach_the_target_without_clipping() {
        // A quiet signal (peak -19 dBFS, RMS -30 dBFS) comes up to -16 dBFS RMS.
        let (peak, rms) = (0.112, 0.0316);
        let g = level_scale(peak, rms, Some(0.158));
        assert!((rms * g - 0.158).abs() < 1e-4, "{g}");
        // A spiky one stops at the peak limit.
        let g = level_scale(0.5, 0.01, Some(0.158));
        assert!((0.5 * g - PEAK_LIMIT).abs() < 1e-6, "{g}");
        // A loud one comes down; silence and no target are left alone.
        assert!(level_scale(0.9, 0.4, Some(0.158)) < 1.0);
        assert_eq!(level_scale(0.0, 0.0, Some(0.158)), 1.0);
        assert_eq!(level_scale(0.5, 0.1, None), 1.0);
        assert!((level_scale(1.96, 0.5, None) - 0.5).abs() < 1e-6);
    }

    #[test]
    fn empty_score_gives_silent_tail_and_huge_score_errors() {
        let Some(sf) = soundfont_or_skip() else {
            return;
        };
        let dir = tempfile::tempdir().unwrap();
        let out = dir.path().join("empty.wav");
        let stats = render_wav(&Score::new(480), &sf, &RenderOptions::default(), &out).unwrap();
        assert_eq!(stats.samples, 44_100);
        assert_eq!(stats.peak, 0.0);
        assert_eq!(hound::WavReader::open(&out).unwrap().duration(), 44_100);
        let no_tail = RenderOptions {
            tail_seconds: f64::NAN,
            ..RenderOptions::default()
        };
        let stats = render_wav(&Score::new(480), &sf, &no_tail, &out).unwrap();
        assert_eq!((stats.samples, stats.rms), (0, 0.0));
        assert_eq!(hound::WavReader::open(&out).unwrap().duration(), 0);

        let mut s = Score::new(480);
        s.notes.push(note(0, u64::MAX, 60, 0, false));
        s.notes.push(note(u64::MAX - 5, u64::MAX, 60, 0, false));
        let err = render_wav(&s, &sf, &RenderOptions::default(), &out).unwrap_err();
        assert!(format!("{err:#}").contains("limit"), "{err:#}");
        let bad = RenderOptions {
            sample_rate: 100,
            ..RenderOptions::default()
        };
        assert!(render_samples(&Score::new(480), &sf, &bad).is_err());
    }

    #[test]
    fn unwritable_output_is_named() {
        let Some(sf) = soundfont_or_skip() else {
            return;
        };
        let out = Path::new("/nonexistent/dir/out.wav");
        let err = render_wav(&Score::new(480), &sf, &RenderOptions::default(), out).unwrap_err();
        assert!(format!("{err:#}").contains("out.wav"), "{err:#}");
    }
}
