//! [`Score`] -> standard MIDI file (format 1: a tempo/meta track, then one
//! track per instrument voice; drums on channel 10).
//!
//! Voices: the notes of one instrument (a program, or the drums) are split
//! into as few voices as keep two notes of the same pitch from sounding at
//! once in one voice ([`assign_voices`], at most [`MAX_VOICES`]); each voice
//! is a track of its own, after the instrument's first. A score with no such
//! overlap has one track per instrument. Since a reader pairs a note-off with a note-on of the same
//! channel and pitch (first in, first out in ours, [`super::parse`]), a
//! second note of a pitch that is already sounding would otherwise take the
//! first one's note-off: both notes would come back with the wrong
//! durations, or, in readers that end a note at the next note-on of its
//! pitch, one of them would be lost.
//!
//! Channels: with at most 15 melodic voices each gets a channel of its own
//! (channel 10 is left to drums) and one program change at tick 0, so even
//! a reader that merges tracks by channel keeps every note. With more, the
//! 15 melodic channels are shared in time ([`allocate_channels`]): a note
//! goes to a channel already set to its program that sounds no note of its
//! pitch, else to a channel with nothing sounding (a program change at the
//! note's start, in the note's own track), else, when more than 15 programs
//! sound at once, to the channel whose notes end soonest and that sounds no
//! note of the same pitch (again with a program change at the note's
//! start). A note of another voice that takes a channel at the tick of its
//! program change repeats that change in its own track, as a reader may
//! meet its note-on before the other track's change. So under the rule that
//! MIDI players and readers follow (per
//! channel, the last program change before a note-on decides its program),
//! every note keeps its program; no two tracks put a program change and a
//! note-on of another program on one channel at the same tick. Drum voices
//! all play on channel 10: readers that pair per track (ours, and most
//! libraries) keep overlapping drum notes of one pitch apart, a reader that
//! merges tracks by channel may not.
//!
//! Within a track, at one tick note-offs come before note-ons (a repeated
//! pitch is released before it is struck again), except the note-off of a
//! note of no length, which follows its own note-on.

use std::path::Path;

use anyhow::{bail, Context, Result};
use midly::num::{u15, u24, u28, u4, u7};
use midly::{Format, Header, MetaMessage, MidiMessage, Smf, Timing, TrackEvent, TrackEventKind};

use super::score::{Note, Score};

/// An instrument of the output: a program, or the drums.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
struct Instrument {
    is_drum: bool,
    program: u8,
}

impl Instrument {
    fn of(n: &Note) -> Instrument {
        Instrument {
            is_drum: n.is_drum,
            program: if n.is_drum { 0 } else { n.program },
        }
    }
}

/// One track of the output: a voice of an instrument.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
struct Layer {
    instrument: Instrument,
    voice: u32,
}

/// The end of a note as far as sharing a key goes: a note of no length
/// still holds its key for its own tick.
fn held_until(n: &Note) -> u64 {
    n.start
        .saturating_add(n.duration)
        .max(n.start.saturating_add(1))
}

/// The most voices (tracks) of one instrument. Real music never comes near
/// it; it keeps a hostile score (thousands of copies of one note) within
/// MIDI's 65,535 tracks. Notes beyond it share the last voice, where a
/// reader may pair them wrongly (a round trip counts them).
pub const MAX_VOICES: u32 = 256;

/// Splits each instrument's notes into voices such that no two notes of one
/// voice hold the same pitch at once (a note may start where another ends):
/// per note of `score` (by index), its voice, 0 for every note that overlaps
/// nothing. Greedy in onset order, a note takes the lowest voice whose last
/// note of that pitch has ended, which uses as few voices as the most notes
/// of one pitch sounding together (up to [`MAX_VOICES`]).
fn assign_voices(score: &Score) -> Vec<u32> {
    use std::cmp::Reverse;
    use std::collections::BinaryHeap;
    let mut order: Vec<usize> = (0..score.notes.len()).collect();
    order.sort_by_key(|&i| {
        let n = &score.notes[i];
        (Instrument::of(n), n.pitch, n.start, held_until(n), i)
    });
    let mut voices = vec![0u32; score.notes.len()];
    // For the current (instrument, pitch): until when each voice is held,
    // the held ones by end (entries whose voice was taken again since are
    // stale), and the free ones.
    let mut held_to: Vec<u64> = Vec::new();
    let mut is_free: Vec<bool> = Vec::new();
    let mut held: BinaryHeap<Reverse<(u64, u32)>> = BinaryHeap::new();
    let mut free: BinaryHeap<Reverse<u32>> = BinaryHeap::new();
    let mut current: Option<(Instrument, u8)> = None;
    for i in order {
        let n = &score.notes[i];
        let key = (Instrument::of(n), n.pitch);
        if current != Some(key) {
            current = Some(key);
            held_to.clear();
            is_free.clear();
            held.clear();
            free.clear();
        }
        while let Some(&Reverse((end, v))) = held.peek() {
            if end > n.start {
                break;
            }
            held.pop();
            if held_to[v as usize] == end && !is_free[v as usize] {
                is_free[v as usize] = true;
                free.push(Reverse(v));
            }
        }
        let v = match free.pop() {
            Some(Reverse(v)) => v,
            None if (held_to.len() as u32) < MAX_VOICES => {
                held_to.push(0);
                is_free.push(false);
                held_to.len() as u32 - 1
            }
            None => MAX_VOICES - 1,
        };
        let end = held_to[v as usize].max(held_until(n));
        held_to[v as usize] = end;
        is_free[v as usize] = false;
        held.push(Reverse((end, v)));
        voices[i] = v;
    }
    voices
}

fn to_u7(value: u8, what: &str) -> Result<u7> {
    u7::try_from(value).with_context(|| format!("{what} {value} is out of MIDI's 0..=127 range"))
}

/// Serializes a score to SMF bytes.
pub fn to_bytes(score: &Score) -> Result<Vec<u8>> {
    let tpq = score.ticks_per_quarter;
    if tpq == 0 || tpq > 0x7fff {
        bail!("ticks per quarter {tpq} cannot be written to a MIDI file (1..=32767)");
    }
    let mut tracks: Vec<Vec<TrackEvent<'_>>> = Vec::new();

    // Meta track: the title, then tempos, time and key signatures, in time order.
    let mut meta: Vec<(u64, u8, TrackEventKind<'_>)> = Vec::new();
    if let Some(title) = &score.title {
        meta.push((
            0,
            0,
            TrackEventKind::Meta(MetaMessage::TrackName(title.as_bytes())),
        ));
    }
    for ts in &score.time_signatures {
        let den = ts.denominator;
        if ts.numerator == 0 || den == 0 || !den.is_power_of_two() {
            bail!(
                "time signature {}/{} cannot be written to MIDI",
                ts.numerator,
                den
            );
        }
        meta.push((
            ts.tick,
            0,
            TrackEventKind::Meta(MetaMessage::TimeSignature(
                ts.numerator,
                den.trailing_zeros() as u8,
                24,
                8,
            )),
        ));
    }
    for t in &score.tempos {
        let us = t.us_per_quarter.clamp(1, 0xff_ffff);
        meta.push((
            t.tick,
            1,
            TrackEventKind::Meta(MetaMessage::Tempo(u24::new(us))),
        ));
    }
    for k in &score.key_signatures {
        meta.push((
            k.tick,
            2,
            TrackEventKind::Meta(MetaMessage::KeySignature(k.sharps.clamp(-7, 7), k.minor)),
        ));
    }
    meta.sort_by_key(|(t, k, _)| (*t, *k));
    tracks.push(with_deltas(
        meta.into_iter().map(|(t, _, e)| (t, e)).collect(),
    )?);

    // Per note: its instrument's voice (see `assign_voices`); one track per
    // (instrument, voice), voices of an instrument next to each other.
    let voices = assign_voices(score);
    let mut layers: Vec<Layer> = score
        .notes
        .iter()
        .zip(&voices)
        .map(|(n, &voice)| Layer {
            instrument: Instrument::of(n),
            voice,
        })
        .collect();
    layers.sort();
    layers.dedup();
    let melodic = layers.iter().filter(|l| !l.instrument.is_drum).count();
    // Per note: its channel and whether a program change precedes it.
    let shared = if melodic > MELODIC_CHANNELS.len() {
        Some(allocate_channels(score))
    } else {
        None
    };
    // Each layer's notes, in score order.
    let mut notes_of: std::collections::BTreeMap<Layer, Vec<usize>> = Default::default();
    for (i, n) in score.notes.iter().enumerate() {
        notes_of
            .entry(Layer {
                instrument: Instrument::of(n),
                voice: voices[i],
            })
            .or_default()
            .push(i);
    }
    let mut melodic_index = 0usize;
    for layer in layers {
        let inst = layer.instrument;
        let channel = if inst.is_drum {
            9
        } else {
            melodic_index += 1;
            MELODIC_CHANNELS[(melodic_index - 1) % MELODIC_CHANNELS.len()]
        };
        let program = to_u7(inst.program, "program")?;
        let mut evs: Vec<(u64, u8, TrackEventKind<'_>)> = Vec::new();
        if let Some(name) = score.instrument_name(inst.program, inst.is_drum) {
            evs.push((
                0,
                0,
                TrackEventKind::Meta(MetaMessage::TrackName(name.as_bytes())),
            ));
        }
        if shared.is_none() || inst.is_drum {
            evs.push((
                0,
                0,
                TrackEventKind::Midi {
                    channel: u4::new(channel),
                    message: MidiMessage::ProgramChange { program },
                },
            ));
        }
        for &i in &notes_of[&layer] {
            let n = &score.notes[i];
            let ch = match (&shared, n.is_drum) {
                (Some(alloc), false) => {
                    let (c, change) = alloc[i];
                    if change {
                        evs.push((
                            n.start,
                            0,
                            TrackEventKind::Midi {
                                channel: u4::new(c),
                                message: MidiMessage::ProgramChange { program },
                            },
                        ));
                    }
                    u4::new(c)
                }
                _ => u4::new(channel),
            };
            let key = to_u7(n.pitch, "pitch")?;
            let vel = to_u7(n.velocity.max(1), "velocity")?;
            // Note-offs sort before note-ons at the same tick, so a repeated
            // pitch is released before it is struck again; the note-off of a
            // note of no length follows its own note-on.
            evs.push((
                n.end(),
                if n.duration == 0 { 3 } else { 1 },
                TrackEventKind::Midi {
                    channel: ch,
                    message: MidiMessage::NoteOff {
                        key,
                        vel: u7::new(0),
                    },
                },
            ));
            evs.push((
                n.start,
                2,
                TrackEventKind::Midi {
                    channel: ch,
                    message: MidiMessage::NoteOn { key, vel },
                },
            ));
        }
        evs.sort_by_key(|(t, k, _)| (*t, *k));
        tracks.push(with_deltas(
            evs.into_iter().map(|(t, _, e)| (t, e)).collect(),
        )?);
    }

    let smf = Smf {
        header: Header::new(Format::Parallel, Timing::Metrical(u15::new(tpq as u16))),
        tracks,
    };
    let mut out = Vec::new();
    smf.write_std(&mut out)
        .context("cannot serialize MIDI data")?;
    Ok(out)
}

/// The 15 melodic channels (0-based), channel 10 (index 9) left to drums.
const MELODIC_CHANNELS: [u8; 15] = [0, 1, 2, 3, 4, 5, 6, 7, 8, 10, 11, 12, 13, 14, 15];

/// Shares the melodic channels in time (see the module docs): for every note
/// of `score` (by index; drum notes get a dummy), its channel and whether a
/// program change must precede it.
pub fn allocate_channels(score: &Score) -> Vec<(u8, bool)> {
    #[derive(Clone, Default)]
    struct Channel {
        program: Option<u8>,
        /// End of the last note that sounds on it.
        busy_until: u64,
        /// Start of its latest note-on.
        last_start: Option<u64>,
        /// (end, pitch) of its notes, for the pitches still sounding.
        sounding: Vec<(u64, u8)>,
        /// Tick of its latest program change.
        changed_at: Option<u64>,
    }
    let mut chans: Vec<Channel> = vec![Channel::default(); 15];
    let mut out = vec![(9u8, false); score.notes.len()];
    let mut order: Vec<usize> = (0..score.notes.len())
        .filter(|&i| !score.notes[i].is_drum)
        .collect();
    order.sort_by_key(|&i| (score.notes[i].start, score.notes[i].program, i));
    for i in order {
        let n = &score.notes[i];
        let end = n.end().max(n.start + 1);
        // A channel already set to this program, unless a note of this pitch
        // sounds on it (a reader would pair their note-offs by the channel).
        let same = (0..15).find(|&c| {
            let ch = &chans[c];
            ch.program == Some(n.program)
                && !ch
                    .sounding
                    .iter()
                    .any(|&(e, p)| p == n.pitch && e > n.start)
        });
        // A note of this pitch ending right now on another track could be
        // ordered after this note-on by a reader: avoid such a channel.
        let idle = || {
            (0..15)
                .filter(|&c| chans[c].busy_until <= n.start)
                .min_by_key(|&c| {
                    let ch = &chans[c];
                    let ends_now = ch
                        .sounding
                        .iter()
                        .any(|&(e, p)| p == n.pitch && e == n.start);
                    (ch.program.is_some(), ends_now, ch.busy_until)
                })
        };
        // More programs sounding than channels: the channel with no note-on
        // at this very tick, no sounding note of this pitch (whose note-off
        // would end this one), and whose notes end soonest.
        let busy = || {
            (0..15)
                .min_by_key(|&c| {
                    let ch = &chans[c];
                    let same_pitch = ch
                        .sounding
                        .iter()
                        .any(|&(e, p)| p == n.pitch && e > n.start);
                    (ch.last_start == Some(n.start), same_pitch, ch.busy_until)
                })
                .unwrap_or(0)
        };
        // A program change at this very tick may lie in another voice's
        // track, which a reader may meet after this note-on: repeat it in
        // this note's track (a change to the program the channel has is
        // harmless).
        let (c, change) = match same {
            Some(c) => (c, chans[c].changed_at == Some(n.start)),
            None => (idle().unwrap_or_else(busy), true),
        };
        let ch = &mut chans[c];
        if change {
            ch.changed_at = Some(n.start);
        }
        ch.program = Some(n.program);
        ch.busy_until = ch.busy_until.max(end);
        ch.last_start = Some(n.start);
        ch.sounding.retain(|&(e, _)| e >= n.start);
        ch.sounding.push((end, n.pitch));
        out[i] = (MELODIC_CHANNELS[c], change);
    }
    out
}

/// Writes a score to `path` (atomically: a temporary file, then a rename).
pub fn write_file(score: &Score, path: &Path) -> Result<()> {
    let bytes = to_bytes(score).with_context(|| format!("cannot write {}", path.display()))?;
    crate::util::write_atomic(path, &bytes)
}

fn with_deltas(events: Vec<(u64, TrackEventKind<'_>)>) -> Result<Vec<TrackEvent<'_>>> {
    let mut out = Vec::with_capacity(events.len() + 1);
    let mut last = 0u64;
    for (tick, kind) in events {
        out.push(TrackEvent {
            delta: delta(tick - last)?,
            kind,
        });
        last = tick;
    }
    out.push(TrackEvent {
        delta: u28::new(0),
        kind: TrackEventKind::Meta(MetaMessage::EndOfTrack),
    });
    Ok(out)
}

fn delta(d: u64) -> Result<u28> {
    if d > 0x0fff_ffff {
        bail!("a gap of {d} ticks between events is too long for MIDI");
    }
    Ok(u28::new(d as u32))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::midi::parse;

    fn note(start: u64, duration: u64, pitch: u8, velocity: u8, program: u8) -> Note {
        Note::melodic(start, duration, pitch, velocity, program)
    }

    fn drum(start: u64, duration: u64, pitch: u8) -> Note {
        Note {
            channel: 9,
            is_drum: true,
            ..note(start, duration, pitch, 100, 0)
        }
    }

    fn score(notes: Vec<Note>) -> Score {
        let mut s = Score::new(480);
        s.notes = notes;
        s.sort();
        s
    }

    /// What a note is, channel aside: (start, duration, pitch, velocity,
    /// program or 128 for drums).
    type Key = (u64, u64, u8, u8, u8);

    fn keys(notes: &[Note]) -> Vec<Key> {
        let mut v: Vec<Key> = notes
            .iter()
            .map(|n| {
                let p = if n.is_drum { 128 } else { n.program };
                (n.start, n.duration, n.pitch, n.velocity, p)
            })
            .collect();
        v.sort_unstable();
        v
    }

    /// The notes as a reader that merges all tracks and pairs note-offs per
    /// (channel, pitch), first in first out, would see them.
    fn by_channel(bytes: &[u8]) -> Vec<Key> {
        let smf = Smf::parse(bytes).unwrap();
        let mut evs = Vec::new();
        for (ti, t) in smf.tracks.iter().enumerate() {
            let mut tick = 0u64;
            for (ei, e) in t.iter().enumerate() {
                tick += e.delta.as_int() as u64;
                evs.push((tick, ti, ei, e.kind));
            }
        }
        evs.sort_by_key(|&(t, ti, ei, _)| (t, ti, ei));
        let mut program = [0u8; 16];
        let mut open: std::collections::HashMap<(u8, u8), std::collections::VecDeque<_>> =
            Default::default();
        let mut out = Vec::new();
        for (tick, _, _, kind) in evs {
            let TrackEventKind::Midi { channel, message } = kind else {
                continue;
            };
            let ch = channel.as_int();
            match message {
                MidiMessage::ProgramChange { program: p } => program[ch as usize] = p.as_int(),
                MidiMessage::NoteOn { key, vel } if vel.as_int() > 0 => {
                    let p = if ch == 9 { 128 } else { program[ch as usize] };
                    open.entry((ch, key.as_int()))
                        .or_default()
                        .push_back((tick, vel.as_int(), p));
                }
                MidiMessage::NoteOn { key, .. } | MidiMessage::NoteOff { key, .. } => {
                    if let Some((start, vel, p)) = open
                        .get_mut(&(ch, key.as_int()))
                        .and_then(|q| q.pop_front())
                    {
                        out.push((start, tick - start, key.as_int(), vel, p));
                    }
                }
                _ => {}
            }
        }
        out.sort_unstable();
        out
    }

    /// Writes `s`, reads it back with our reader, and checks every note came
    /// back; returns the bytes.
    fn round_trip(s: &Score) -> Vec<u8> {
        let bytes = to_bytes(s).unwrap();
        let (back, report) = parse(&bytes).unwrap();
        assert_eq!(keys(&back.notes), keys(&s.notes), "our reader");
        assert_eq!(report.orphan_note_offs, 0);
        assert_eq!(report.unclosed_notes, 0);
        bytes
    }

    fn track_count(bytes: &[u8]) -> usize {
        Smf::parse(bytes).unwrap().tracks.len()
    }

    #[test]
    fn title_key_signatures_and_instrument_names_come_back() {
        use crate::midi::{InstrumentName, KeySignature};
        let mut s = score(vec![
            note(0, 480, 60, 80, 0),
            note(0, 480, 36, 70, 33),
            drum(0, 120, 42),
            drum(480, 120, 36),
        ]);
        s.title = Some("Reel".into());
        s.key_signatures = vec![
            KeySignature {
                tick: 0,
                sharps: 2,
                minor: false,
            },
            KeySignature {
                tick: 960,
                sharps: -1,
                minor: true,
            },
        ];
        s.instrument_names = vec![
            InstrumentName {
                program: 0,
                is_drum: false,
                name: "Piano".into(),
            },
            InstrumentName {
                program: 0,
                is_drum: true,
                name: "Kit".into(),
            },
        ];
        s.sort();
        let (back, _) = parse(&to_bytes(&s).unwrap()).unwrap();
        assert_eq!(back.title.as_deref(), Some("Reel"));
        assert_eq!(back.key_signatures, s.key_signatures);
        assert_eq!(back.instrument_names, s.instrument_names);
        assert_eq!(keys(&back.notes), keys(&s.notes));
    }

    #[test]
    fn same_program_notes_of_one_pitch_that_overlap_come_back() {
        // Pairs of notes of one program and pitch, as two tracks of a file
        // would give them: each pair lost or swapped durations (or
        // velocities) when both shared a track and a channel.
        let cases = [
            // One inside the other: first in, first out swapped their ends.
            vec![note(0, 960, 60, 80, 0), note(240, 240, 60, 80, 0)],
            // Crossing.
            vec![note(0, 480, 60, 80, 0), note(240, 480, 60, 80, 0)],
            // Identical notes (same onset, pitch and program).
            vec![note(0, 480, 60, 80, 0), note(0, 480, 60, 80, 0)],
            // Same onset, the louder one shorter.
            vec![note(0, 960, 60, 40, 0), note(0, 240, 60, 100, 0)],
            // Same end.
            vec![note(0, 960, 60, 80, 5), note(480, 480, 60, 90, 5)],
            // Three deep, with a note of another pitch and program.
            vec![
                note(0, 1920, 64, 70, 40),
                note(240, 960, 64, 80, 40),
                note(480, 240, 64, 90, 40),
                note(480, 240, 65, 90, 41),
            ],
        ];
        for notes in cases {
            let s = score(notes.clone());
            let bytes = round_trip(&s);
            // Few voices: each has a channel, so a reader that merges
            // tracks by channel keeps every note too.
            assert_eq!(by_channel(&bytes), keys(&s.notes), "{notes:?}");
            let instruments = {
                let mut p: Vec<u8> = notes.iter().map(|n| n.program).collect();
                p.dedup();
                p.len()
            };
            assert!(track_count(&bytes) > 1 + instruments, "{notes:?}");
        }
    }

    #[test]
    fn notes_that_never_overlap_keep_one_track_per_instrument() {
        // Repeated and legato notes of one pitch (one starts where the last
        // ends), chords: one voice.
        let s = score(vec![
            note(0, 480, 60, 80, 0),
            note(480, 480, 60, 80, 0),
            note(960, 240, 60, 80, 0),
            note(960, 240, 64, 80, 0),
            note(0, 960, 60, 80, 33),
            drum(0, 120, 36),
            drum(120, 120, 36),
        ]);
        let bytes = round_trip(&s);
        assert_eq!(track_count(&bytes), 1 + 3);
        assert_eq!(by_channel(&bytes), keys(&s.notes));
        assert_eq!(assign_voices(&s), vec![0; s.notes.len()]);
    }

    #[test]
    fn voices_are_as_few_as_the_deepest_overlap() {
        // At most two notes of pitch 60 sound together, although five
        // overlap something: two voices.
        let s = score(vec![
            note(0, 480, 60, 80, 0),
            note(240, 480, 60, 80, 0),
            note(480, 480, 60, 80, 0),
            note(720, 480, 60, 80, 0),
            note(960, 480, 60, 80, 0),
        ]);
        let v = assign_voices(&s);
        assert_eq!(v.iter().max(), Some(&1));
        assert_eq!(track_count(&round_trip(&s)), 1 + 2);
    }

    #[test]
    fn thousands_of_copies_of_one_note_stay_within_max_voices() {
        let s = score((0..1000).map(|_| note(0, 480, 60, 80, 0)).collect());
        let v = assign_voices(&s);
        assert_eq!(v.iter().max(), Some(&(MAX_VOICES - 1)));
        let bytes = to_bytes(&s).unwrap();
        assert_eq!(track_count(&bytes), 1 + MAX_VOICES as usize);
        // Identical notes: however they pair, each comes back.
        let (back, _) = parse(&bytes).unwrap();
        assert_eq!(keys(&back.notes), keys(&s.notes));
    }

    #[test]
    fn overlapping_drums_come_back_on_channel_10() {
        let s = score(vec![drum(0, 480, 38), drum(120, 120, 38), drum(0, 480, 38)]);
        let bytes = round_trip(&s);
        let (back, _) = parse(&bytes).unwrap();
        assert!(back.notes.iter().all(|n| n.is_drum && n.channel == 9));
        assert_eq!(track_count(&bytes), 1 + 3);
    }

    #[test]
    fn notes_of_no_length_come_back() {
        let s = score(vec![
            note(0, 0, 60, 80, 0),
            note(0, 480, 60, 80, 0),
            note(480, 0, 60, 80, 0),
            note(960, 0, 62, 80, 0),
        ]);
        let bytes = round_trip(&s);
        assert_eq!(by_channel(&bytes), keys(&s.notes));
    }

    #[test]
    fn more_voices_than_channels_keep_every_note_and_program() {
        // Ten programs, each with two voices (a note inside another): 20
        // melodic tracks share the 15 channels; distinct pitches per program,
        // so a reader by channel keeps them too.
        let mut notes = Vec::new();
        for k in 0..10u8 {
            let p = 40 + 2 * k;
            notes.push(note(0, 1920, p, 80, k * 7));
            notes.push(note(480, 480, p, 90, k * 7));
            notes.push(note(1920, 480, p + 1, 70, k * 7));
        }
        let s = score(notes);
        let bytes = round_trip(&s);
        assert_eq!(track_count(&bytes), 1 + 20);
        assert_eq!(by_channel(&bytes), keys(&s.notes));
        // Twenty notes of one pitch and program sounding together (more than
        // the channels): our reader, which pairs per track, keeps them all.
        let deep = score((0..20).map(|i| note(i * 10, 2000, 60, 80, 1)).collect());
        round_trip(&deep);
    }

    #[test]
    fn shared_channels_keep_every_note_for_a_reader_by_channel() {
        // 18 programs one after another, then all at once, then in
        // overlapping pairs, with one program holding a pitch twice: the
        // shared channels must still keep notes apart for a reader that
        // merges tracks by channel.
        let mut notes = Vec::new();
        for k in 0..18u8 {
            let p = k * 7;
            notes.push(note(k as u64 * 480, 480, 50 + k, 80, p));
            notes.push(note(18 * 480, 1440, 50 + k, 80, p));
            notes.push(note(24 * 480 + k as u64 * 240, 480, 70 + k, 80, p));
            notes.push(note(24 * 480 + k as u64 * 240, 240, 71 + k, 80, p));
        }
        notes.push(note(18 * 480 + 240, 480, 50, 100, 0));
        for i in 0..30u64 {
            notes.push(drum(i * 480, 120, 42));
        }
        let s = score(notes);
        let bytes = round_trip(&s);
        assert_eq!(track_count(&bytes), 1 + 19 + 1);
        assert_eq!(by_channel(&bytes), keys(&s.notes));
    }

    #[test]
    fn generated_scores_with_shared_programs_come_back() {
        // A fixed pseudo-random series: notes of few pitches and programs,
        // so that overlaps on one pitch are common, sometimes with more
        // than 15 voices.
        let mut state = 0x9e37_79b9_7f4a_7c15u64;
        let mut next = |n: u64| {
            state = state
                .wrapping_mul(6_364_136_223_846_793_005)
                .wrapping_add(1_442_695_040_888_963_407);
            (state >> 33) % n
        };
        for case in 0..200 {
            let programs = 1 + next(if case % 4 == 0 { 24 } else { 4 });
            let count = 2 + next(60);
            let notes = (0..count)
                .map(|_| {
                    let n = note(
                        next(16) * 120,
                        next(12) * 60,
                        60 + next(3) as u8,
                        1 + next(127) as u8,
                        (next(programs) * 5) as u8,
                    );
                    if next(8) == 0 {
                        Note {
                            channel: 9,
                            is_drum: true,
                            program: 0,
                            ..n
                        }
                    } else {
                        n
                    }
                })
                .collect();
            let sc = score(notes);
            let bytes = round_trip(&sc);
            // A reader by channel: every note-on keeps its program (in
            // shared channels too) ...
            let onsets = |k: &[Key]| {
                let mut v: Vec<_> = k.iter().map(|&(s, _, p, _, prog)| (s, p, prog)).collect();
                v.sort_unstable();
                v
            };
            let seen = by_channel(&bytes);
            assert_eq!(onsets(&seen), onsets(&keys(&sc.notes)), "case {case}");
            // ... and, when every melodic voice has a channel and drums do
            // not overlap, every note its duration and velocity.
            let voices = assign_voices(&sc);
            let mut layers: Vec<_> = sc
                .notes
                .iter()
                .zip(&voices)
                .map(|(n, &v)| (n.is_drum, n.program, v))
                .collect();
            layers.sort_unstable();
            layers.dedup();
            if layers.iter().filter(|l| !l.0).count() <= 15
                && !layers.iter().any(|l| l.0 && l.2 > 0)
            {
                assert_eq!(seen, keys(&sc.notes), "case {case}");
            }
        }
    }
}
