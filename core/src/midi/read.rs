//! Standard MIDI file -> [`Score`].

use std::collections::VecDeque;

use rustc_hash::FxHashMap;
use std::path::Path;

use midly::{Format, MetaMessage, MidiMessage, Timing, TrackEventKind};

use super::score::{
    clean_name, InstrumentName, KeySignature, Note, Score, TempoChange, TimeSignature,
};
pub use crate::limits::Limits;

/// Ticks per quarter used when a SMPTE-timed file is converted to a metrical grid
/// (at a fixed 120 BPM, so that seconds are preserved).
pub const SMPTE_TICKS_PER_QUARTER: u32 = 480;

#[derive(Debug, thiserror::Error)]
pub enum MidiError {
    #[error("cannot read {path}: {source}")]
    Io {
        path: String,
        source: std::io::Error,
    },
    #[error("{path}: not a valid MIDI file: {reason}")]
    Parse { path: String, reason: String },
    /// Not a regular file, too big, too long: refused by a [`Limits`] check.
    #[error("{0:#}")]
    Refused(anyhow::Error),
}

/// What the reader had to repair or ignore; never fatal.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ReadReport {
    /// Notes still sounding at the end of their track, closed there.
    pub unclosed_notes: usize,
    /// NoteOffs with no matching NoteOn.
    pub orphan_note_offs: usize,
    /// Tracks that ended without an EndOfTrack event (truncated or corrupt).
    pub truncated_tracks: usize,
    /// The file used SMPTE (timecode) timing and was converted.
    pub smpte_converted: bool,
    /// The header gave 0 ticks per quarter (invalid); read as 1.
    pub zero_division: bool,
}

impl ReadReport {
    pub fn warnings(&self) -> Vec<String> {
        let mut w = Vec::new();
        if self.unclosed_notes > 0 {
            w.push(format!(
                "{} note(s) never closed: closed at the end of their track",
                self.unclosed_notes
            ));
        }
        if self.orphan_note_offs > 0 {
            w.push(format!(
                "{} note-off(s) without a note-on ignored",
                self.orphan_note_offs
            ));
        }
        if self.truncated_tracks > 0 {
            w.push(format!(
                "{} track(s) end without EndOfTrack (file may be truncated)",
                self.truncated_tracks
            ));
        }
        if self.smpte_converted {
            w.push("SMPTE timing converted to 480 ticks per quarter at 120 BPM".into());
        }
        if self.zero_division {
            w.push(
                "the header gives 0 ticks per quarter (invalid): read as 1 tick per quarter, \
                 so timing is likely wrong"
                    .into(),
            );
        }
        w
    }
}

/// Reads and parses a MIDI file within the default [`Limits`]; errors name the file.
pub fn read_file(path: &Path) -> Result<(Score, ReadReport), MidiError> {
    read_file_with(path, &Limits::default())
}

/// Reads and parses a MIDI file within `limits`: only a regular file is
/// opened, and at most `limits.max_file_bytes` of it are read.
pub fn read_file_with(path: &Path, limits: &Limits) -> Result<(Score, ReadReport), MidiError> {
    let bytes =
        crate::limits::read_file(path, limits.max_file_bytes).map_err(MidiError::Refused)?;
    parse_named_with(&bytes, path, limits)
}

/// Parses bytes read from `path` (default limits); the error names the file.
pub fn parse_named(bytes: &[u8], path: &Path) -> Result<(Score, ReadReport), MidiError> {
    parse_named_with(bytes, path, &Limits::default())
}

/// Parses bytes read from `path` within `limits`; the error names the file.
pub fn parse_named_with(
    bytes: &[u8],
    path: &Path,
    limits: &Limits,
) -> Result<(Score, ReadReport), MidiError> {
    parse_inner(bytes, limits).map_err(|f| match f {
        Fail::Invalid(reason) => MidiError::Parse {
            path: path.display().to_string(),
            reason,
        },
        Fail::Limit(reason) => {
            MidiError::Refused(anyhow::anyhow!("{}: refused: {reason}", path.display()))
        }
    })
}

/// Why parsing stopped: a broken file, or one over a limit.
enum Fail {
    Invalid(String),
    Limit(String),
}

impl From<String> for Fail {
    fn from(s: String) -> Self {
        Fail::Invalid(s)
    }
}

/// Parses MIDI bytes within the default [`Limits`]. The error is a
/// human-readable reason.
pub fn parse(bytes: &[u8]) -> Result<(Score, ReadReport), String> {
    parse_with(bytes, &Limits::default())
}

/// Parses MIDI bytes; a file over `limits` (events, length in quarters) is
/// refused before its notes are built.
pub fn parse_with(bytes: &[u8], limits: &Limits) -> Result<(Score, ReadReport), String> {
    parse_inner(bytes, limits).map_err(|f| match f {
        Fail::Invalid(r) | Fail::Limit(r) => r,
    })
}

/// Refuses an SMPTE division whose frame rate is not one of the four SMPTE
/// rates (-24, -25, -29, -30 as a signed byte). midly refuses them too, but
/// negates the byte first, which overflows for -128 and panics in a debug
/// build (midly 0.5.3, `Timing::read`): the check has to come before it.
fn check_smpte_rate(bytes: &[u8]) -> Result<(), Fail> {
    let Some(at) = bytes.windows(4).position(|w| w == b"MThd") else {
        return Ok(());
    };
    match bytes.get(at + 12) {
        Some(&b) if b & 0x80 != 0 && ![0xE8, 0xE7, 0xE3, 0xE2].contains(&b) => Err(Fail::Invalid(
            format!("invalid SMPTE frame rate {} in the header", b as i8),
        )),
        _ => Ok(()),
    }
}

fn parse_inner(bytes: &[u8], limits: &Limits) -> Result<(Score, ReadReport), Fail> {
    if bytes.len() < 14 || &bytes[..4] != b"MThd" {
        // midly accepts RIFF-wrapped files too; anything else without a header is junk.
        if !(bytes.len() >= 4 && &bytes[..4] == b"RIFF") {
            return Err(Fail::Invalid("missing MThd header".into()));
        }
    }
    // midly's lazy reader: each event is parsed once, straight into `events`
    // below, and a file with too many is refused as soon as the count passes
    // the limit, before they are all in memory. In midly's lenient mode (ours)
    // a bad chunk is skipped and a bad event ends its track, exactly as in
    // `Smf::parse`.
    check_smpte_rate(bytes)?;
    let (header, tracks) = midly::parse(bytes).map_err(|e| e.to_string())?;
    let mut report = ReadReport::default();
    let (ticks_per_quarter, scale) = match header.timing {
        Timing::Metrical(tpq) => {
            if tpq.as_int() == 0 {
                report.zero_division = true;
            }
            (tpq.as_int().max(1) as u32, None)
        }
        Timing::Timecode(fps, sub) => {
            report.smpte_converted = true;
            let ticks_per_second = (fps.as_f32() as f64 * sub.max(1) as f64).max(1.0);
            // 120 BPM: a quarter lasts half a second.
            let per_tick = SMPTE_TICKS_PER_QUARTER as f64 * 2.0 / ticks_per_second;
            (SMPTE_TICKS_PER_QUARTER, Some(per_tick))
        }
    };
    let conv = |t: u64| -> u64 {
        match scale {
            None => t,
            Some(s) => (t as f64 * s).round() as u64,
        }
    };
    // Length check before any note is built: one event after a huge delta
    // would otherwise make millions of empty bars.
    let check_length = |tick: u64| -> Result<(), Fail> {
        let quarters = conv(tick) / ticks_per_quarter as u64;
        if quarters > limits.max_quarters {
            return Err(Fail::Limit(format!(
                "an event lies {quarters} quarter notes from the start, more than the limit of {} \
                 (raise it with --max-quarters)",
                limits.max_quarters
            )));
        }
        Ok(())
    };

    // Absolute-time events of every track, merged in time order. Format 2 tracks
    // are independent songs: play them one after another. Only the events the
    // score is made of are kept (controllers, bends, texts and the like are
    // counted against the limit and dropped), 24 bytes each.
    let mut events: Vec<Event> = Vec::new();
    let mut seen = 0usize;
    let mut track_ends = Vec::new();
    // The first name of each track (names are kept apart from `events`,
    // which stay small and `Copy`).
    let mut track_names: Vec<Option<String>> = Vec::new();
    let mut offset = 0u64;
    for (ti, track) in tracks.flatten().enumerate() {
        let mut tick = offset;
        let mut ended = false;
        track_names.push(None);
        for ev in track.map_while(|e| e.ok()) {
            tick += ev.delta.as_int() as u64;
            if seen == limits.max_events {
                return Err(Fail::Limit(format!(
                    "more than {} MIDI events (raise the limit with --max-events)",
                    limits.max_events
                )));
            }
            seen += 1;
            match ev.kind {
                TrackEventKind::Meta(MetaMessage::EndOfTrack) => ended = true,
                TrackEventKind::Meta(MetaMessage::TrackName(name)) if track_names[ti].is_none() => {
                    track_names[ti] = clean_name(name);
                }
                _ => {}
            }
            let Some(what) = What::of(ev.kind) else {
                continue;
            };
            events.push(Event {
                tick,
                track: ti as u32,
                what,
            });
        }
        if !ended {
            report.truncated_tracks += 1;
        }
        check_length(tick)?;
        track_ends.push(tick);
        if header.format == Format::Sequential {
            offset = tick;
        }
    }
    // Time order, ties in (track, event) order, which is the order of
    // `events`: a stable sort, which takes the tracks' sorted runs as they
    // are, and none when one track holds everything.
    if !events.is_sorted_by_key(|e| e.tick) {
        events.sort_by_key(|e| e.tick);
    }
    // midly's lenient mode reads a cut-off chunk as far as it goes: tell.
    report.truncated_tracks = report.truncated_tracks.max(cut_chunks(bytes));
    if bytes.starts_with(b"MThd") && bytes.len() >= 12 {
        let declared = u16::from_be_bytes([bytes[10], bytes[11]]) as usize;
        report.truncated_tracks += declared.saturating_sub(track_ends.len());
    }

    let mut score = Score::new(ticks_per_quarter);
    let mut programs = [0u8; 16];
    // Open notes per (track, channel, pitch), first in first out. FxHash: the
    // keys are small integers from the file, and the default SipHash was a
    // tenth of tokenizing a corpus; leftovers are sorted, so no order leaks.
    let mut open: FxHashMap<NoteKey, VecDeque<OpenNote>> = FxHashMap::default();
    // Per instrument (program, drums), the first track that played it.
    let mut first_track: FxHashMap<(u8, bool), usize> = FxHashMap::default();
    for &Event { tick, track, what } in &events {
        let ti = track as usize;
        match what {
            What::Program { ch, program } => programs[ch as usize] = program,
            What::On { ch, key, vel } => {
                let inst = if ch == 9 {
                    (0, true)
                } else {
                    (programs[ch as usize], false)
                };
                first_track.entry(inst).or_insert(ti);
                open.entry((ti, ch, key)).or_default().push_back((
                    tick,
                    vel,
                    programs[ch as usize],
                ));
            }
            What::Off { ch, key } => match open.get_mut(&(ti, ch, key)).and_then(|q| q.pop_front())
            {
                Some((start, velocity, program)) => score.notes.push(make_note(
                    conv(start),
                    conv(tick),
                    key,
                    velocity,
                    program,
                    ch,
                )),
                None => report.orphan_note_offs += 1,
            },
            What::Tempo(us) if scale.is_none() => {
                let us = us.max(1);
                match score.tempos.last_mut() {
                    Some(last) if last.tick == tick => last.us_per_quarter = us,
                    _ => score.tempos.push(TempoChange {
                        tick,
                        us_per_quarter: us,
                    }),
                }
            }
            What::Tempo(_) => {}
            What::KeySig { sharps, minor } => {
                let ks = KeySignature {
                    tick: conv(tick),
                    sharps,
                    minor,
                };
                match score.key_signatures.last_mut() {
                    Some(last) if last.tick == ks.tick => *last = ks,
                    _ => score.key_signatures.push(ks),
                }
            }
            What::TimeSig { num, den_pow } => {
                let ts = TimeSignature {
                    tick: conv(tick),
                    numerator: num,
                    denominator: 1u8.checked_shl(den_pow as u32).unwrap_or(0),
                };
                match score.time_signatures.last_mut() {
                    Some(last) if last.tick == ts.tick => *last = ts,
                    _ => score.time_signatures.push(ts),
                }
            }
        }
    }
    if scale.is_some() {
        score.tempos.push(TempoChange {
            tick: 0,
            us_per_quarter: 500_000,
        });
    }
    // Close what is still open at the end of its track.
    let mut leftovers: Vec<_> = open.into_iter().collect();
    leftovers.sort_by_key(|(k, _)| *k);
    for ((ti, ch, pitch), queue) in leftovers {
        for (start, velocity, program) in queue {
            report.unclosed_notes += 1;
            let end = track_ends[ti].max(start);
            score.notes.push(make_note(
                conv(start),
                conv(end),
                pitch,
                velocity,
                program,
                ch,
            ));
        }
    }
    name_instruments(&mut score, header.format, &track_names, &first_track);
    score.sort();
    Ok((score, report))
}

/// The title and the instruments' names from the tracks' names: a track's
/// name goes to the instruments it played first; the name of a first track
/// that plays nothing (a format 1 file's tempo track) or of a format 0 file's
/// one track is the title.
fn name_instruments(
    score: &mut Score,
    format: Format,
    track_names: &[Option<String>],
    first_track: &FxHashMap<(u8, bool), usize>,
) {
    let plays = |ti: usize| first_track.values().any(|&t| t == ti);
    score.title = match track_names.first() {
        Some(Some(name)) if format == Format::SingleTrack || !plays(0) => Some(name.clone()),
        _ => None,
    };
    if format == Format::SingleTrack {
        return;
    }
    score.instrument_names = first_track
        .iter()
        .filter_map(|(&(program, is_drum), &ti)| {
            let name = track_names.get(ti)?.clone()?;
            Some(InstrumentName {
                program,
                is_drum,
                name,
            })
        })
        .collect();
}

/// An event the score is made of, at its absolute tick in its track.
#[derive(Clone, Copy)]
struct Event {
    tick: u64,
    track: u32,
    what: What,
}

/// What an [`Event`] does (channels, keys and velocities are 0-127).
#[derive(Clone, Copy)]
enum What {
    Program {
        ch: u8,
        program: u8,
    },
    /// A NoteOn with a velocity above 0.
    On {
        ch: u8,
        key: u8,
        vel: u8,
    },
    /// A NoteOff, or a NoteOn of velocity 0.
    Off {
        ch: u8,
        key: u8,
    },
    /// Microseconds per quarter.
    Tempo(u32),
    TimeSig {
        num: u8,
        den_pow: u8,
    },
    KeySig {
        sharps: i8,
        minor: bool,
    },
}

impl What {
    /// What a MIDI event does to the score, or `None` for the events it ignores
    /// (controllers, bends, aftertouch, system and meta events but tempo, time
    /// and key signature; track names are read apart).
    fn of(kind: TrackEventKind) -> Option<What> {
        Some(match kind {
            TrackEventKind::Midi { channel, message } => {
                let ch = channel.as_int();
                match message {
                    MidiMessage::ProgramChange { program } => What::Program {
                        ch,
                        program: program.as_int(),
                    },
                    MidiMessage::NoteOn { key, vel } if vel.as_int() > 0 => What::On {
                        ch,
                        key: key.as_int(),
                        vel: vel.as_int(),
                    },
                    MidiMessage::NoteOn { key, .. } | MidiMessage::NoteOff { key, .. } => {
                        What::Off {
                            ch,
                            key: key.as_int(),
                        }
                    }
                    _ => return None,
                }
            }
            TrackEventKind::Meta(MetaMessage::Tempo(us)) => What::Tempo(us.as_int()),
            TrackEventKind::Meta(MetaMessage::TimeSignature(num, den_pow, _, _)) => {
                What::TimeSig { num, den_pow }
            }
            TrackEventKind::Meta(MetaMessage::KeySignature(sharps, minor)) => {
                What::KeySig { sharps, minor }
            }
            _ => return None,
        })
    }
}

/// (track, channel, pitch): notes pair first-in first-out within one key.
type NoteKey = (usize, u8, u8);
/// (start tick, velocity, program) of a sounding note.
type OpenNote = (u64, u8, u8);

/// Chunks whose declared length runs past the end of the file.
fn cut_chunks(bytes: &[u8]) -> usize {
    let mut at = if bytes.starts_with(b"RIFF") { 20 } else { 0 };
    let mut cut = 0;
    while at + 8 <= bytes.len() {
        let len = u32::from_be_bytes([bytes[at + 4], bytes[at + 5], bytes[at + 6], bytes[at + 7]]);
        let next = at + 8 + len as usize;
        if next > bytes.len() {
            cut += 1;
            break;
        }
        at = next;
    }
    cut
}

fn make_note(start: u64, end: u64, pitch: u8, velocity: u8, program: u8, channel: u8) -> Note {
    let is_drum = channel == 9;
    Note {
        start,
        duration: end.saturating_sub(start),
        pitch,
        velocity,
        program: if is_drum { 0 } else { program },
        channel,
        is_drum,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use midly::num::{u15, u28, u4, u7};
    use midly::{Header, Smf, TrackEvent};

    #[test]
    fn an_smpte_rate_of_minus_128_is_refused_not_a_panic() {
        // MThd, length 6, format 0, 1 track, division 0x8000 (SMPTE, -128 fps)
        let mut bytes = b"MThd\0\0\0\x06\0\0\0\x01\x80\0".to_vec();
        bytes.extend_from_slice(b"MTrk\0\0\0\x04\0\xff\x2f\0");
        let e = parse(&bytes).unwrap_err();
        assert!(e.contains("invalid SMPTE frame rate -128"), "{e}");
        // a real SMPTE rate (-25 fps, 40 subframes) still reads
        bytes[12..14].copy_from_slice(&[0xE7, 40]);
        assert!(parse(&bytes).is_ok());
    }

    /// (delta, channel, key, velocity): velocity 0 is a note-off.
    fn track(events: &[(u32, u8, u8, u8)]) -> Vec<TrackEvent<'static>> {
        let mut t: Vec<TrackEvent<'static>> = events
            .iter()
            .map(|&(delta, ch, key, vel)| TrackEvent {
                delta: u28::new(delta),
                kind: TrackEventKind::Midi {
                    channel: u4::new(ch),
                    message: if vel > 0 {
                        MidiMessage::NoteOn {
                            key: u7::new(key),
                            vel: u7::new(vel),
                        }
                    } else {
                        MidiMessage::NoteOff {
                            key: u7::new(key),
                            vel: u7::new(0),
                        }
                    },
                },
            })
            .collect();
        t.push(TrackEvent {
            delta: u28::new(0),
            kind: TrackEventKind::Meta(MetaMessage::EndOfTrack),
        });
        t
    }

    fn file(tracks: Vec<Vec<TrackEvent<'static>>>) -> Vec<u8> {
        let smf = Smf {
            header: Header::new(Format::Parallel, Timing::Metrical(u15::new(480))),
            tracks,
        };
        let mut out = Vec::new();
        smf.write_std(&mut out).unwrap();
        out
    }

    fn spans(score: &Score) -> Vec<(u64, u64, u8, u8)> {
        score
            .notes
            .iter()
            .map(|n| (n.start, n.duration, n.pitch, n.velocity))
            .collect()
    }

    fn named(name: &'static [u8], mut t: Vec<TrackEvent<'static>>) -> Vec<TrackEvent<'static>> {
        t.insert(
            0,
            TrackEvent {
                delta: u28::new(0),
                kind: TrackEventKind::Meta(MetaMessage::TrackName(name)),
            },
        );
        t
    }

    #[test]
    fn a_track_name_goes_to_the_instrument_it_plays_first() {
        // Track 0 plays (channel 0, program 0) and is named: a name, no title.
        let bytes = file(vec![
            named(b"Right hand", track(&[(0, 0, 60, 90), (480, 0, 60, 0)])),
            named(b"Kit", track(&[(0, 9, 36, 90), (120, 9, 36, 0)])),
            named(b"Unused", track(&[])),
        ]);
        let (s, _) = parse(&bytes).unwrap();
        assert_eq!(s.title, None);
        assert_eq!(s.instrument_name(0, false), Some("Right hand"));
        assert_eq!(s.instrument_name(0, true), Some("Kit"));
        assert_eq!(s.instrument_names.len(), 2);
        // A first track with no notes names the piece.
        let bytes = file(vec![
            named(b"Song", track(&[])),
            named(b"Lead", track(&[(0, 0, 60, 90), (480, 0, 60, 0)])),
        ]);
        let (s, _) = parse(&bytes).unwrap();
        assert_eq!(s.title.as_deref(), Some("Song"));
        assert_eq!(s.instrument_name(0, false), Some("Lead"));
    }

    #[test]
    fn key_signatures_are_read_last_one_per_tick() {
        let key = |delta: u32, sharps: i8, minor: bool| TrackEvent {
            delta: u28::new(delta),
            kind: TrackEventKind::Meta(MetaMessage::KeySignature(sharps, minor)),
        };
        let mut t = vec![key(0, 1, false), key(0, -2, true), key(960, 3, false)];
        t.extend(track(&[(0, 0, 60, 90), (480, 0, 60, 0)]));
        let (s, _) = parse(&file(vec![t])).unwrap();
        let got: Vec<_> = s
            .key_signatures
            .iter()
            .map(|k| (k.tick, k.sharps, k.minor))
            .collect();
        assert_eq!(got, vec![(0, -2, true), (960, 3, false)]);
    }

    #[test]
    fn tracks_on_one_channel_pair_their_own_notes() {
        // Two tracks on channel 0, one pitch: 0..960 in the first, 240..480
        // in the second. Merged by channel, the first note-off (480) would
        // end the first note.
        let bytes = file(vec![
            track(&[(0, 0, 60, 80), (960, 0, 60, 0)]),
            track(&[(240, 0, 60, 90), (240, 0, 60, 0)]),
        ]);
        let (score, report) = parse(&bytes).unwrap();
        assert_eq!(spans(&score), vec![(0, 960, 60, 80), (240, 240, 60, 90)]);
        assert_eq!(report, ReadReport::default());
    }

    #[test]
    fn one_track_pairs_first_in_first_out() {
        // Within one track and channel the first note-on takes the first
        // note-off, whatever the writer meant.
        let bytes = file(vec![track(&[
            (0, 0, 60, 80),
            (240, 0, 60, 90),
            (240, 0, 60, 0),
            (480, 0, 60, 0),
        ])]);
        let (score, _) = parse(&bytes).unwrap();
        assert_eq!(spans(&score), vec![(0, 480, 60, 80), (240, 720, 60, 90)]);
    }
}
