//! [`Score`] -> standard MIDI file (format 1: a tempo/meta track, then one
//! track per instrument; drums on channel 10).

use std::path::Path;

use anyhow::{bail, Context, Result};
use midly::num::{u15, u24, u28, u4, u7};
use midly::{Format, Header, MetaMessage, MidiMessage, Smf, Timing, TrackEvent, TrackEventKind};

use super::score::Score;

/// An instrument of the output: one track and one channel.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
struct Instrument {
    is_drum: bool,
    program: u8,
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
    let mut tracks: Vec<Vec<TrackEvent<'static>>> = Vec::new();

    // Meta track: tempos and time signatures, in time order.
    let mut meta: Vec<(u64, u8, TrackEventKind<'static>)> = Vec::new();
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
    meta.sort_by_key(|(t, k, _)| (*t, *k));
    tracks.push(with_deltas(
        meta.into_iter().map(|(t, _, e)| (t, e)).collect(),
    )?);

    let mut instruments: Vec<Instrument> = score
        .notes
        .iter()
        .map(|n| Instrument {
            is_drum: n.is_drum,
            program: if n.is_drum { 0 } else { n.program },
        })
        .collect();
    instruments.sort();
    instruments.dedup();
    let mut melodic_channel = 0u8;
    for inst in instruments {
        let channel = if inst.is_drum {
            9
        } else {
            let c = melodic_channel;
            melodic_channel = (melodic_channel + 1) % 15;
            // Skip channel 10 (index 9), reserved for drums.
            if c >= 9 {
                c + 1
            } else {
                c
            }
        };
        let ch = u4::new(channel);
        let mut evs: Vec<(u64, u8, TrackEventKind<'static>)> = vec![(
            0,
            0,
            TrackEventKind::Midi {
                channel: ch,
                message: MidiMessage::ProgramChange {
                    program: to_u7(inst.program, "program")?,
                },
            },
        )];
        for n in score
            .notes
            .iter()
            .filter(|n| n.is_drum == inst.is_drum && (n.is_drum || n.program == inst.program))
        {
            let key = to_u7(n.pitch, "pitch")?;
            let vel = to_u7(n.velocity.max(1), "velocity")?;
            // Note-offs sort before note-ons at the same tick, so a repeated
            // pitch is released before it is struck again.
            evs.push((
                n.end(),
                1,
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

/// Writes a score to `path` (atomically: a temporary file, then a rename).
pub fn write_file(score: &Score, path: &Path) -> Result<()> {
    let bytes = to_bytes(score).with_context(|| format!("cannot write {}", path.display()))?;
    crate::util::write_atomic(path, &bytes)
}

fn with_deltas(events: Vec<(u64, TrackEventKind<'static>)>) -> Result<Vec<TrackEvent<'static>>> {
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
