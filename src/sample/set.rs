//! Sets of tunes ([`super::SampleConfig::set`]): when the model ends a tune, the
//! piece goes on with the next one, as folk musicians play tunes in sets.
//!
//! The model reads `EOS BOS` between two tunes, as it did in training, where a
//! window runs on from one piece into the next. The piece written out is one
//! REMI sequence without them: [`Join`] appends each tune's tokens to it so that
//! it decodes to the tunes one after the other, each starting at a bar line.
//!
//! Invariants:
//! * The first tune's tokens (the prompt's and those after it) pass through
//!   unchanged, so a set that never reaches an EOS is the piece sampled without `set`.
//! * A later tune begins at its first `Bar`, in its own time signature: a tune
//!   starts in 4/4 unless it says otherwise, so where the piece before it was in
//!   another metre, `TimeSig 4/4` is written after that `Bar`.
//! * Tokens of a later tune that restate what the piece already holds (its time
//!   signature, its tempo, a program the grammar does not take again) are left out
//!   of the piece, since the decoder would skip them; nothing else is.

use crate::tokenizer::{Grammar, Token, TokenType, Vocab, BAR_ID};

/// Where the next token of the current tune lands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Stage {
    /// Inside the first tune: every token is kept as it is.
    First,
    /// A later tune has begun (BOS read); its first `Bar` comes next.
    AwaitBar,
    /// Right after a later tune's first `Bar`: a `TimeSig` may follow.
    AfterBar,
    /// Inside a later tune.
    Later,
}

/// The piece written out, built from the tunes' tokens.
#[derive(Debug, Clone)]
pub struct Join<'v> {
    vocab: &'v Vocab,
    /// The grammar state of the joined piece (not of the current tune), kept from
    /// the first join on: before it the piece is the first tune, whose grammar the
    /// sampler keeps already, so a piece that is one tune costs no second grammar.
    piece: Option<Grammar<'v>>,
    stage: Stage,
    /// The tunes begun so far (the prompt's counts as the first).
    tunes: usize,
    /// Tokens of later tunes left out as restatements.
    dropped: usize,
}

impl<'v> Join<'v> {
    /// A join inside the first tune.
    pub fn new(vocab: &'v Vocab) -> Self {
        Join {
            vocab,
            piece: None,
            stage: Stage::First,
            tunes: 1,
            dropped: 0,
        }
    }

    /// A new tune begins (the model has read its BOS); `ended` is the grammar of
    /// the tune that ended, before its EOS (at the first join, the piece's).
    pub fn begin_tune(&mut self, ended: &Grammar<'v>) {
        if self.piece.is_none() {
            self.piece = Some(ended.clone());
        }
        self.stage = Stage::AwaitBar;
        self.tunes += 1;
    }

    /// The tunes begun so far.
    pub fn tunes(&self) -> usize {
        self.tunes
    }

    /// Tokens of later tunes that restated the piece's state and were left out.
    pub fn dropped(&self) -> usize {
        self.dropped
    }

    /// Appends to `out` (the piece's tokens) what the current tune's token `id` adds.
    pub fn push(&mut self, id: u32, out: &mut Vec<u32>) {
        match self.stage {
            Stage::First => self.emit(id, out),
            Stage::AwaitBar => {
                // A tune's grammar allows only Bar after BOS (its EOS ends no set).
                self.emit(id, out);
                if id == BAR_ID {
                    self.stage = Stage::AfterBar;
                }
            }
            Stage::AfterBar => {
                self.stage = Stage::Later;
                let is_sig = matches!(self.vocab.token(id), Some(Token::TimeSig { .. }));
                let sig_now = self.piece.as_ref().map_or((4, 4), Grammar::time_signature);
                if !is_sig && sig_now != (4, 4) {
                    let common = Token::TimeSig {
                        numerator: 4,
                        denominator: 4,
                    };
                    if let Some(sig) = self.vocab.id(common) {
                        self.emit(sig, out);
                    }
                }
                self.later(id, out);
            }
            Stage::Later => self.later(id, out),
        }
    }

    /// A later tune's token: kept unless it restates the piece's state.
    fn later(&mut self, id: u32, out: &mut Vec<u32>) {
        let restates = matches!(
            self.vocab.kind(id),
            Some(TokenType::TimeSig | TokenType::Tempo | TokenType::Program)
        ) && self.piece.as_ref().is_some_and(|p| !p.allows(id));
        if restates {
            self.dropped += 1;
        } else {
            self.emit(id, out);
        }
    }

    fn emit(&mut self, id: u32, out: &mut Vec<u32>) {
        // Unconstrained sampling may write what the grammar refuses: the piece
        // keeps it, and its grammar state stays where it was.
        if let Some(piece) = &mut self.piece {
            let _ = piece.push(id);
        }
        out.push(id);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tokenizer::{validate, BOS_ID};

    fn vocab() -> Vocab {
        Vocab::new(crate::tokenizer::RemiConfig::default()).unwrap()
    }

    /// One bar of a tune: its Bar, an optional time signature, then one note at
    /// position 0 with an optional tempo and its program.
    fn bar(v: &Vocab, sig: Option<(u8, u8)>, tempo: Option<u16>, pitch: u8) -> Vec<u32> {
        let mut t = vec![BAR_ID];
        if let Some((numerator, denominator)) = sig {
            t.push(
                v.id(Token::TimeSig {
                    numerator,
                    denominator,
                })
                .unwrap(),
            );
        }
        t.push(v.id(Token::Position(0)).unwrap());
        if let Some(b) = tempo {
            t.push(v.id(Token::Tempo(b)).unwrap());
        }
        t.push(v.id(Token::Program(0)).unwrap());
        t.push(v.id(Token::Pitch(pitch)).unwrap());
        if v.config().velocities {
            t.push(v.range(TokenType::Velocity).start);
        }
        t.push(v.range(TokenType::Duration).start);
        t
    }

    /// Joins tunes (each without BOS/EOS) as the sampler does, from `BOS`,
    /// keeping each tune's grammar as the sampler keeps it.
    fn join<'v>(v: &'v Vocab, tunes: &[Vec<u32>]) -> (Vec<u32>, Join<'v>) {
        let fresh = || {
            let mut g = Grammar::new(v);
            g.push(BOS_ID).unwrap();
            g
        };
        let mut j = Join::new(v);
        let mut out = vec![BOS_ID];
        let mut grammar = fresh();
        for (i, tune) in tunes.iter().enumerate() {
            if i > 0 {
                j.begin_tune(&grammar);
                grammar = fresh();
            }
            for &t in tune {
                grammar.push(t).unwrap();
                j.push(t, &mut out);
            }
        }
        (out, j)
    }

    #[test]
    fn the_first_tune_passes_through_unchanged() {
        let v = vocab();
        let tune = [bar(&v, Some((3, 4)), Some(5), 60), bar(&v, None, None, 62)].concat();
        let (out, j) = join(&v, std::slice::from_ref(&tune));
        assert_eq!(out[1..], tune[..]);
        assert_eq!((j.tunes(), j.dropped()), (1, 0));
    }

    #[test]
    fn a_later_tune_starts_in_its_own_metre_without_restating_the_piece() {
        let v = vocab();
        // A 3/4 tune at tempo 5, then a tune in 4/4 (no TimeSig: the default) at
        // the same tempo, then one in 3/4 at another tempo.
        let a = [bar(&v, Some((3, 4)), Some(5), 60), bar(&v, None, None, 62)].concat();
        let b = [bar(&v, None, Some(5), 64), bar(&v, None, None, 65)].concat();
        let c = bar(&v, Some((3, 4)), Some(7), 67);
        let (out, j) = join(&v, &[a.clone(), b, c]);
        assert_eq!(j.tunes(), 3);
        // The piece is one valid sequence and decodes without a skipped token.
        validate(&out, &v).unwrap();
        let (score, report) = crate::tokenizer::decode(&out, &v);
        assert!(report.is_clean(), "{report:?}");
        let sigs: Vec<_> = score
            .time_signatures
            .iter()
            .map(|s| (s.numerator, s.denominator))
            .collect();
        assert_eq!(sigs, [(3, 4), (4, 4), (3, 4)]);
        // b's tempo restated a's and was left out; c's new tempo stays.
        assert_eq!(j.dropped(), 1);
        assert_eq!(score.tempos.len(), 2);
        assert_eq!(score.notes.len(), 5);
        // Tune b starts right after a's two bars of 3/4.
        let steps = v.config().bar_steps(3, 4) as u64;
        let starts: Vec<u64> = score.notes.iter().map(|n| n.start).collect();
        assert_eq!(starts[2], 2 * steps);
        assert_eq!(out[1..=a.len()], a[..]);
    }
}
