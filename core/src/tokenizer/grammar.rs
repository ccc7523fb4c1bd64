//! The REMI+ grammar of canonical sequences: what may follow a prefix.
//!
//! A piece is `BOS? (Bar TimeSig? (Position Tempo? (Program Pitch Velocity
//! Duration)*)*)* EOS? PAD*`, with: positions strictly increasing inside a
//! bar and inside it; a Position followed by something; TimeSig and Tempo only
//! when they change the current value; notes at one position in
//! non-decreasing (program, pitch, velocity, duration) order, drums last;
//! `PitchDrum` after the drum program and `Pitch` after any other; EOS never
//! right after a bare Bar. These are exactly the sequences `encode` writes, so
//! for them `encode(decode(x)) == x`.
//!
//! The config's options change a note's tokens: with `program_changes` a
//! note is `Program? Pitch ...`, where the `Program` is there exactly when it
//! differs from the previous note's program (across positions and bars), so
//! it is required for the first note of a piece and forbidden when it repeats
//! the current one; without `velocities` there is no `Velocity` and `Pitch`
//! is followed by `Duration`.

use std::fmt;

use super::vocab::{Token, TokenType, Vocab, DRUMS};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Expect {
    Start,
    AfterBar,
    AfterTimeSig,
    AfterPosition,
    AfterTempo,
    AfterProgram,
    AfterPitch,
    AfterVelocity,
    AfterDuration,
    Ended,
}

/// Sort key of a note at one position: (program order, pitch, velocity bin, duration index).
type NoteKey = [u16; 4];

/// The grammar's state after a prefix.
#[derive(Debug, Clone)]
pub struct Grammar<'v> {
    vocab: &'v Vocab,
    expect: Expect,
    sig: (u8, u8),
    position: Option<u16>,
    tempo: Option<u16>,
    /// The program of the last note (or of a `Program` just read).
    program: Option<u8>,
    last_key: Option<NoteKey>,
    key: NoteKey,
    seen_bos: bool,
    len: usize,
}

/// The first token of a sequence that breaks the grammar.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GrammarError {
    pub index: usize,
    pub token: String,
    pub expected: Vec<TokenType>,
}

impl fmt::Display for GrammarError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let expected: Vec<String> = self.expected.iter().map(|t| t.to_string()).collect();
        write!(
            f,
            "token {} ({}) is not allowed here; expected one of: {}",
            self.index,
            self.token,
            expected.join(", ")
        )
    }
}

impl std::error::Error for GrammarError {}

fn program_order(p: u8) -> u16 {
    p as u16 // DRUMS (128) sorts after every melodic program
}

impl<'v> Grammar<'v> {
    pub fn new(vocab: &'v Vocab) -> Self {
        Grammar {
            vocab,
            expect: Expect::Start,
            sig: (4, 4),
            position: None,
            tempo: None,
            program: None,
            last_key: None,
            key: [0; 4],
            seen_bos: false,
            len: 0,
        }
    }

    /// Number of tokens accepted so far.
    pub fn len(&self) -> usize {
        self.len
    }
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    pub fn is_ended(&self) -> bool {
        self.expect == Expect::Ended
    }

    /// The current time signature (for samplers that count bars).
    pub fn time_signature(&self) -> (u8, u8) {
        self.sig
    }

    /// Whether `id` may come next.
    pub fn allows(&self, id: u32) -> bool {
        match self.vocab.token(id) {
            Some(t) => self.allows_token(t),
            None => false,
        }
    }

    fn key_allows(&self, field: usize, value: u16) -> bool {
        match self.last_key {
            None => true,
            Some(last) => {
                // Lexicographic order: only constrained while the prefix ties.
                if self.key[..field] != last[..field] {
                    true
                } else {
                    value >= last[field]
                }
            }
        }
    }

    /// Whether a note may start with `Program(p)` here.
    fn program_allowed(&self, p: u8) -> bool {
        let changes_only = self.vocab.config().program_changes;
        self.key_allows(0, program_order(p)) && !(changes_only && self.program == Some(p))
    }

    /// Whether a note may start with its pitch, playing the current program
    /// (only under `program_changes`).
    fn pitch_allowed(&self, t: Token) -> bool {
        if !self.vocab.config().program_changes {
            return false;
        }
        let Some(prog) = self.program else {
            return false;
        };
        match t {
            Token::Pitch(p) => prog != DRUMS && self.key_allows_with(program_order(prog), p),
            Token::PitchDrum(p) => prog == DRUMS && self.key_allows_with(program_order(prog), p),
            _ => false,
        }
    }

    /// `key_allows(1, pitch)` for a note of program order `prog`.
    fn key_allows_with(&self, prog: u16, pitch: u8) -> bool {
        match self.last_key {
            None => true,
            Some(last) => prog > last[0] || (prog == last[0] && pitch as u16 >= last[1]),
        }
    }

    fn allows_token(&self, t: Token) -> bool {
        use Expect::*;
        let velocities = self.vocab.config().velocities;
        let bar_steps = self.vocab.config().bar_steps(self.sig.0, self.sig.1);
        let position_ok = |p: u16| (p as u32) < bar_steps && self.position.is_none_or(|c| p > c);
        let next_of_bar = |t: Token| match t {
            Token::Position(p) => position_ok(p),
            Token::Bar => true,
            _ => false,
        };
        match (self.expect, t) {
            (Ended, Token::Pad) => true,
            (Ended, _) => false,
            (Start, Token::Bos) => !self.seen_bos && self.len == 0,
            (Start, Token::Bar | Token::Eos) => true,
            (
                AfterBar,
                Token::TimeSig {
                    numerator,
                    denominator,
                },
            ) => (numerator, denominator) != self.sig,
            (AfterBar, Token::Bar) => true,
            (AfterBar, Token::Position(p)) => position_ok(p),
            (AfterTimeSig, Token::Eos) => true,
            (AfterTimeSig, t) => next_of_bar(t),
            (AfterPosition, Token::Tempo(b)) => self.tempo != Some(b),
            (AfterPosition | AfterTempo | AfterDuration, Token::Program(p)) => {
                self.program_allowed(p)
            }
            (AfterPosition | AfterTempo | AfterDuration, Token::Pitch(_) | Token::PitchDrum(_)) => {
                self.pitch_allowed(t)
            }
            (AfterTempo | AfterDuration, Token::Eos) => true,
            (AfterTempo | AfterDuration, t) => next_of_bar(t),
            (AfterProgram, Token::Pitch(p)) => {
                self.key[0] != DRUMS as u16 && self.key_allows(1, p as u16)
            }
            (AfterProgram, Token::PitchDrum(p)) => {
                self.key[0] == DRUMS as u16 && self.key_allows(1, p as u16)
            }
            (AfterPitch, Token::Velocity(b)) => velocities && self.key_allows(2, b as u16),
            (AfterPitch, Token::Duration(d)) => !velocities && self.key_allows(3, d),
            (AfterVelocity, Token::Duration(d)) => self.key_allows(3, d),
            _ => false,
        }
    }

    /// Accepts `id` or says why not (the state is unchanged on error).
    pub fn push(&mut self, id: u32) -> Result<(), GrammarError> {
        let tok = self.vocab.token(id).filter(|&t| self.allows_token(t));
        let Some(tok) = tok else {
            return Err(GrammarError {
                index: self.len,
                token: self
                    .vocab
                    .string(id)
                    .map(str::to_owned)
                    .unwrap_or_else(|| format!("unknown id {id}")),
                expected: self.allowed_types(),
            });
        };
        use Expect::*;
        self.expect = match tok {
            Token::Pad => Ended,
            Token::Bos => {
                self.seen_bos = true;
                Start
            }
            Token::Eos => Ended,
            Token::Bar => {
                self.position = None;
                self.last_key = None;
                AfterBar
            }
            Token::TimeSig {
                numerator,
                denominator,
            } => {
                self.sig = (numerator, denominator);
                AfterTimeSig
            }
            Token::Position(p) => {
                self.position = Some(p);
                self.last_key = None;
                AfterPosition
            }
            Token::Tempo(b) => {
                self.tempo = Some(b);
                AfterTempo
            }
            Token::Program(p) => {
                self.key = [program_order(p), 0, 0, 0];
                self.program = Some(p);
                AfterProgram
            }
            Token::Pitch(p) | Token::PitchDrum(p) => {
                if self.expect != AfterProgram {
                    // A note of the current program, without a Program token.
                    let prog = self.program.expect("allowed only with a current program");
                    self.key = [program_order(prog), 0, 0, 0];
                }
                self.key[1] = p as u16;
                AfterPitch
            }
            Token::Velocity(b) => {
                self.key[2] = b as u16;
                AfterVelocity
            }
            Token::Duration(d) => {
                self.key[3] = d;
                self.last_key = Some(self.key);
                AfterDuration
            }
        };
        self.len += 1;
        Ok(())
    }

    /// The token types that may come next (some of their values may not).
    pub fn allowed_types(&self) -> Vec<TokenType> {
        use TokenType::*;
        let all = [
            Pad, Bos, Eos, Bar, TimeSig, Position, Tempo, Program, Pitch, PitchDrum, Velocity,
            Duration,
        ];
        all.into_iter()
            .filter(|&k| self.vocab.range(k).any(|id| self.allows(id)))
            .collect()
    }

    /// Fills `mask[id]` with whether each id may come next.
    pub fn fill_mask(&self, mask: &mut [bool]) {
        for (id, m) in mask.iter_mut().enumerate() {
            *m = self.allows(id as u32);
        }
    }
}

/// Checks a whole sequence; the error names the first invalid token.
pub fn validate(ids: &[u32], vocab: &Vocab) -> Result<(), GrammarError> {
    let mut g = Grammar::new(vocab);
    ids.iter().try_for_each(|&id| g.push(id))
}

/// The token types that may follow `prefix`, or the prefix's first error.
pub fn next_types(prefix: &[u32], vocab: &Vocab) -> Result<Vec<TokenType>, GrammarError> {
    let mut g = Grammar::new(vocab);
    for &id in prefix {
        g.push(id)?;
    }
    Ok(g.allowed_types())
}
