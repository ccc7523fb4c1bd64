//! REMI+ encoding of a quantized score, and the lenient decoder.

use crate::midi::{Note, Score, TempoChange, TimeSignature};

use super::config::nearest_duration;
use super::quantize::{quantize, QuantizeReport};
use super::vocab::{Token, Vocab, DRUMS};

/// Encodes a score: quantizes it, then writes its tokens (no BOS/EOS).
pub fn encode(score: &Score, vocab: &Vocab) -> (Vec<u32>, QuantizeReport) {
    let (q, report) = quantize(score, vocab.config());
    (encode_quantized(&q, vocab), report)
}

/// Writes the tokens of a score already on the grid (`quantize`'s output).
pub fn encode_quantized(q: &Score, vocab: &Vocab) -> Vec<u32> {
    let cfg = vocab.config();
    let durations = vocab.durations();
    let mut out: Vec<u32> = Vec::with_capacity(q.notes.len() * 5 + 16);
    let id = |t: Token| vocab.id(t).expect("quantized values have tokens");
    let last_event = q
        .notes
        .iter()
        .map(|n| n.start)
        .chain(q.tempos.iter().map(|t| t.tick))
        .chain(q.time_signatures.iter().map(|t| t.tick))
        .max();
    let Some(last_event) = last_event else {
        return out;
    };
    let (mut ni, mut ti, mut si) = (0usize, 0usize, 0usize);
    let mut sig = (4u8, 4u8);
    let mut bar_start = 0u64;
    // The program of the previous note (for `program_changes`).
    let mut program: Option<u8> = None;
    while bar_start <= last_event {
        out.push(id(Token::Bar));
        if let Some(ts) = q.time_signatures.get(si) {
            if ts.tick == bar_start {
                sig = (ts.numerator, ts.denominator);
                out.push(id(Token::TimeSig {
                    numerator: sig.0,
                    denominator: sig.1,
                }));
                si += 1;
            }
        }
        let bar_end = bar_start + cfg.bar_steps(sig.0, sig.1) as u64;
        loop {
            let next_note = q.notes.get(ni).map(|n| n.start).filter(|&s| s < bar_end);
            let next_tempo = q.tempos.get(ti).map(|t| t.tick).filter(|&s| s < bar_end);
            let pos = match (next_note, next_tempo) {
                (Some(a), Some(b)) => a.min(b),
                (Some(a), None) | (None, Some(a)) => a,
                (None, None) => break,
            };
            out.push(id(Token::Position((pos - bar_start) as u16)));
            if next_tempo == Some(pos) {
                let (bin, _) = cfg.tempo_bin(q.tempos[ti].us_per_quarter);
                out.push(id(Token::Tempo(bin)));
                ti += 1;
            }
            while let Some(n) = q.notes.get(ni).filter(|n| n.start == pos) {
                let prog = if n.is_drum { DRUMS } else { n.program };
                if !cfg.program_changes || program != Some(prog) {
                    out.push(id(Token::Program(prog)));
                    program = Some(prog);
                }
                out.push(id(if n.is_drum {
                    Token::PitchDrum(n.pitch)
                } else {
                    Token::Pitch(n.pitch)
                }));
                if cfg.velocities {
                    out.push(id(Token::Velocity(cfg.velocity_bin(n.velocity))));
                }
                let (di, _) = nearest_duration(durations, n.duration.min(u32::MAX as u64) as u32);
                out.push(id(Token::Duration(di as u16)));
                ni += 1;
            }
        }
        bar_start = bar_end;
    }
    out
}

/// What the decoder could not use.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct DecodeReport {
    /// Tokens ignored because they did not fit the grammar where they stood
    /// (including the parts of notes left unfinished).
    pub skipped: usize,
    /// Unknown ids.
    pub unknown: usize,
    /// Tokens after EOS.
    pub after_eos: usize,
}

impl DecodeReport {
    pub fn is_clean(&self) -> bool {
        self.skipped == 0 && self.unknown == 0 && self.after_eos == 0
    }
}

/// Decodes tokens into a score on the grid (ticks are steps). Never panics:
/// tokens that cannot be used where they stand are skipped and counted.
pub fn decode(ids: &[u32], vocab: &Vocab) -> (Score, DecodeReport) {
    let cfg = vocab.config();
    let durations = vocab.durations();
    let mut score = Score::new(cfg.positions_per_quarter);
    let mut rep = DecodeReport::default();
    let mut sig = (4u8, 4u8);
    let mut bar: Option<u64> = None; // start of the current bar
    let mut bar_has_content = false;
    let mut pos: Option<u64> = None; // absolute step of the current position
    let mut pos_has_notes = false;
    // Without velocity tokens a note is complete after its pitch.
    let velocity_of = |n: &PartialNote| match n.pitch {
        Some(_) if !cfg.velocities => Some(cfg.default_velocity),
        _ => n.velocity,
    };
    let mut note = PartialNote::default();
    // The program of the last finished note: a Pitch without its own Program
    // token plays it (only under `program_changes`).
    let mut program: Option<u8> = None;
    for (i, &raw) in ids.iter().enumerate() {
        let Some(tok) = vocab.token(raw) else {
            rep.unknown += 1;
            continue;
        };
        match tok {
            Token::Pad | Token::Bos => {}
            Token::Eos => {
                rep.after_eos = ids[i + 1..]
                    .iter()
                    .filter(|&&t| t != super::vocab::PAD_ID)
                    .count();
                break;
            }
            Token::Bar => {
                note.abandon(&mut rep);
                bar = Some(match bar {
                    None => 0,
                    Some(b) => b + cfg.bar_steps(sig.0, sig.1) as u64,
                });
                bar_has_content = false;
                pos = None;
            }
            Token::TimeSig {
                numerator,
                denominator,
            } => match bar {
                Some(b) if !bar_has_content && (numerator, denominator) != sig => {
                    sig = (numerator, denominator);
                    score.time_signatures.push(TimeSignature {
                        tick: b,
                        numerator,
                        denominator,
                    });
                    bar_has_content = true;
                }
                _ => rep.skipped += 1,
            },
            Token::Position(p) => match bar {
                Some(b)
                    if (p as u32) < cfg.bar_steps(sig.0, sig.1)
                        && pos.is_none_or(|cur| b + p as u64 > cur) =>
                {
                    note.abandon(&mut rep);
                    pos = Some(b + p as u64);
                    pos_has_notes = false;
                    bar_has_content = true;
                }
                _ => rep.skipped += 1,
            },
            Token::Tempo(bin) => {
                let us = cfg.tempo_us(bin);
                match pos {
                    Some(at)
                        if !pos_has_notes
                            && note.program.is_none()
                            && score.tempos.last().is_none_or(|t| t.tick < at)
                            && score.tempos.last().map(|t| t.us_per_quarter) != Some(us) =>
                    {
                        score.tempos.push(TempoChange {
                            tick: at,
                            us_per_quarter: us,
                        });
                    }
                    _ => rep.skipped += 1,
                }
            }
            Token::Program(p) => {
                if pos.is_some() {
                    note.abandon(&mut rep);
                    note.program = Some(p);
                    note.tokens = 1;
                } else {
                    rep.skipped += 1;
                }
            }
            Token::Pitch(p) | Token::PitchDrum(p) => {
                let drum_token = matches!(tok, Token::PitchDrum(_));
                let carried = if cfg.program_changes && pos.is_some() && note.program.is_none() {
                    program
                } else {
                    None
                };
                match note.program.or(carried) {
                    Some(prog) if note.pitch.is_none() && (prog == DRUMS) == drum_token => {
                        note.program = Some(prog);
                        note.pitch = Some(p);
                        note.tokens += 1;
                    }
                    _ => rep.skipped += 1,
                }
            }
            Token::Velocity(b) => {
                if note.pitch.is_some() && note.velocity.is_none() {
                    note.velocity = Some(cfg.velocity_value(b));
                    note.tokens += 1;
                } else {
                    rep.skipped += 1;
                }
            }
            Token::Duration(d) => match (note.program, note.pitch, velocity_of(&note), pos) {
                (Some(prog), Some(pitch), Some(velocity), Some(start)) => {
                    let is_drum = prog == DRUMS;
                    score.notes.push(Note {
                        start,
                        duration: durations[d as usize] as u64,
                        pitch,
                        velocity,
                        program: if is_drum { 0 } else { prog },
                        channel: if is_drum { 9 } else { 0 },
                        is_drum,
                    });
                    note = PartialNote::default();
                    program = Some(prog);
                    pos_has_notes = true;
                }
                _ => rep.skipped += 1,
            },
        }
    }
    note.abandon(&mut rep);
    // A piece without notes is empty, as `quantize` makes it.
    if score.notes.is_empty() {
        score.tempos.clear();
        score.time_signatures.clear();
    }
    score.sort();
    (score, rep)
}

/// The tokens of a note seen so far.
#[derive(Default)]
struct PartialNote {
    program: Option<u8>,
    pitch: Option<u8>,
    velocity: Option<u8>,
    tokens: usize,
}

impl PartialNote {
    /// Drops an unfinished note, counting its tokens as skipped.
    fn abandon(&mut self, rep: &mut DecodeReport) {
        rep.skipped += self.tokens;
        *self = PartialNote::default();
    }
}
