//! The repetition guard: masks that keep a sampler out of two degenerate
//! loops a weak model falls into, a note held for dozens of bars and one
//! pitch struck over and over.
//!
//! The guard only speaks where the next token's type is fixed (only
//! Durations can follow: after a Velocity, or after a Pitch in a vocabulary
//! without velocities) or a Pitch may come (after a Program, or after a
//! Position, Tempo or Duration when Program tokens mark changes only), and it
//! only removes the token ids it names, so no other draw moves. Its limits are chosen from the corpus
//! (1,500 classical and folk pieces drawn at random, 240 k notes):
//!
//! - 16 quarter notes (4 bars of 4/4): 99.1% of the notes, and every note
//!   of 97% of the pieces, are no longer (8 quarters would already touch
//!   1.5% of the notes, such as Palestrina's final longas);
//! - 8 notes in a row of one pitch: longer runs are 0.013% of the notes
//!   and occur in 0.9% of the pieces (measured on all of a piece's
//!   melodic notes together, not per program).
//!
//! Drums are not guarded: a hi-hat struck on every eighth is music.

use serde::{Deserialize, Serialize};

use crate::tokenizer::{Grammar, Token, TokenType, Vocab, DRUMS};

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct GuardConfig {
    /// Apply the guard at all (on by default).
    pub enabled: bool,
    /// Mask Duration tokens longer than this many quarter notes (0 = no
    /// limit). When the grammar allows no shorter duration, the shortest it
    /// allows is kept.
    pub max_note_quarters: f64,
    /// Once the last this-many notes of one (non-drum) program all had the
    /// same pitch, mask that pitch for its next note (0 = no limit).
    pub max_same_pitch: usize,
}

impl Default for GuardConfig {
    fn default() -> Self {
        GuardConfig {
            enabled: true,
            max_note_quarters: 16.0,
            max_same_pitch: 8,
        }
    }
}

impl GuardConfig {
    /// The guard switched off.
    pub fn off() -> Self {
        GuardConfig {
            enabled: false,
            ..Default::default()
        }
    }

    pub fn validate(&self) -> anyhow::Result<()> {
        if !(self.max_note_quarters >= 0.0 && self.max_note_quarters.is_finite()) {
            anyhow::bail!(
                "--max-note-quarters must be 0 (no limit) or positive (got {})",
                self.max_note_quarters
            );
        }
        Ok(())
    }
}

/// What the guard remembers of one sequence: the previous token's type, the
/// current program, and per melodic program the pitch of its last note and
/// how many notes in a row had it.
#[derive(Debug, Clone)]
pub struct GuardState {
    prev: Option<TokenType>,
    program: Option<u8>,
    runs: Vec<(u8, usize)>,
}

impl Default for GuardState {
    fn default() -> Self {
        GuardState {
            prev: None,
            program: None,
            runs: vec![(0, 0); DRUMS as usize],
        }
    }
}

impl GuardState {
    pub fn new() -> Self {
        Self::default()
    }

    /// Takes in one token of the sequence (prompt tokens included).
    pub fn observe(&mut self, vocab: &Vocab, id: u32) {
        let tok = vocab.token(id);
        match tok {
            Some(Token::Program(p)) => self.program = Some(p),
            Some(Token::Pitch(pitch)) => {
                if let Some(run) = self.program.and_then(|p| self.runs.get_mut(p as usize)) {
                    *run = if run.1 > 0 && run.0 == pitch {
                        (pitch, run.1 + 1)
                    } else {
                        (pitch, 1)
                    };
                }
            }
            _ => {}
        }
        self.prev = tok.map(|t| t.kind());
    }

    /// How many notes in a row the current program has played at one pitch,
    /// and that pitch (`None` before any note, or for drums).
    pub fn run(&self) -> Option<(u8, usize)> {
        let p = self.program?;
        self.runs.get(p as usize).copied().filter(|r| r.1 > 0)
    }

    /// The token ids the guard forbids for the next draw (empty when it has
    /// nothing to say). With a grammar, only ids the grammar allows are
    /// listed, and some allowed id is always left over.
    pub fn bans(&self, cfg: &GuardConfig, vocab: &Vocab, grammar: Option<&Grammar>) -> Vec<u32> {
        if !cfg.enabled {
            return Vec::new();
        }
        let allows = |id: u32| grammar.is_none_or(|g| g.allows(id));
        let rc = vocab.config();
        // Where the next token's type is fixed: with a grammar, by what it
        // allows; without, by the previous token under the vocabulary's options
        // (no Velocity tokens: Duration follows Pitch; Program tokens only at
        // changes: a Pitch may follow Position, Tempo or Duration).
        let duration_next = match grammar {
            Some(g) => {
                let mut types = g.allowed_types();
                types.retain(|&t| t != TokenType::Duration);
                types.is_empty()
            }
            None => match self.prev {
                Some(TokenType::Velocity) => true,
                Some(TokenType::Pitch) => !rc.velocities,
                _ => false,
            },
        };
        let pitch_next = match self.prev {
            Some(TokenType::Program) => true,
            Some(TokenType::Position | TokenType::Tempo | TokenType::Duration) => {
                rc.program_changes
            }
            _ => false,
        };
        if pitch_next && cfg.max_same_pitch > 0 {
            let Some((pitch, _)) = self.run().filter(|r| r.1 >= cfg.max_same_pitch) else {
                return Vec::new();
            };
            let Some(id) = vocab.id(Token::Pitch(pitch)).filter(|&id| allows(id)) else {
                return Vec::new();
            };
            // A chord's order may leave this pitch the only one allowed.
            let other = vocab.range(TokenType::Pitch).any(|i| i != id && allows(i));
            return if other { vec![id] } else { Vec::new() };
        }
        if duration_next && cfg.max_note_quarters > 0.0 {
            let ppq = vocab.config().positions_per_quarter as f64;
            let limit = (cfg.max_note_quarters * ppq).round() as u32;
            let range = vocab.range(TokenType::Duration);
            let allowed: Vec<(u32, u32)> = range
                .clone()
                .zip(vocab.durations())
                .filter(|&(id, _)| allows(id))
                .map(|(id, &steps)| (id, steps))
                .collect();
            let mut banned: Vec<u32> = allowed
                .iter()
                .filter(|&&(_, steps)| steps > limit)
                .map(|&(id, _)| id)
                .collect();
            if banned.len() == allowed.len() {
                // Nothing short enough is allowed: keep the shortest.
                banned.retain(|&id| Some(&id) != allowed.first().map(|(i, _)| i));
            }
            return banned;
        }
        Vec::new()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tokenizer::{RemiConfig, BAR_ID, BOS_ID};

    fn vocab() -> Vocab {
        Vocab::new(RemiConfig::default()).unwrap()
    }

    /// BOS Bar Position_0, then `n` notes of `pitch` on program 0 at
    /// successive positions, ending after the last Duration.
    fn repeated(v: &Vocab, pitch: u8, n: usize) -> Vec<u32> {
        let mut ids = vec![BOS_ID, BAR_ID];
        for i in 0..n {
            ids.push(v.id(Token::Position(i as u16 * 3)).unwrap());
            ids.push(v.id(Token::Program(0)).unwrap());
            ids.push(v.id(Token::Pitch(pitch)).unwrap());
            ids.push(v.id(Token::Velocity(20)).unwrap());
            ids.push(v.id(Token::Duration(2)).unwrap());
        }
        ids
    }

    fn state_and_grammar<'v>(v: &'v Vocab, ids: &[u32]) -> (GuardState, Grammar<'v>) {
        let mut s = GuardState::new();
        let mut g = Grammar::new(v);
        for &id in ids {
            g.push(id).unwrap();
            s.observe(v, id);
        }
        (s, g)
    }

    #[test]
    fn masks_a_pitch_after_k_repeats_only_before_a_pitch() {
        let v = vocab();
        let cfg = GuardConfig::default();
        let mut ids = repeated(&v, 60, 8);
        let (s, g) = state_and_grammar(&v, &ids);
        assert_eq!(s.run(), Some((60, 8)));
        // After a Duration the next token is no Pitch: nothing to say.
        assert!(s.bans(&cfg, &v, Some(&g)).is_empty());
        ids.push(v.id(Token::Position(30)).unwrap());
        ids.push(v.id(Token::Program(0)).unwrap());
        let (s, g) = state_and_grammar(&v, &ids);
        assert_eq!(
            s.bans(&cfg, &v, Some(&g)),
            vec![v.id(Token::Pitch(60)).unwrap()]
        );
        // Seven repeats are not enough, and the switch turns it off.
        let mut seven = repeated(&v, 60, 7);
        seven.push(v.id(Token::Position(30)).unwrap());
        seven.push(v.id(Token::Program(0)).unwrap());
        let (s7, g7) = state_and_grammar(&v, &seven);
        assert!(s7.bans(&cfg, &v, Some(&g7)).is_empty());
        assert!(s.bans(&GuardConfig::off(), &v, Some(&g)).is_empty());
        let no_limit = GuardConfig {
            max_same_pitch: 0,
            ..cfg.clone()
        };
        assert!(s.bans(&no_limit, &v, Some(&g)).is_empty());
    }

    #[test]
    fn guards_the_compact_vocabulary_too() {
        // Program tokens only at changes and no Velocity: a Pitch follows a
        // Position, a Duration follows a Pitch.
        let v = Vocab::new(RemiConfig {
            program_changes: true,
            velocities: false,
            ..RemiConfig::default()
        })
        .unwrap();
        let cfg = GuardConfig::default();
        let mut ids = vec![BOS_ID, BAR_ID];
        for i in 0..8u16 {
            ids.push(v.id(Token::Position(i * 3)).unwrap());
            if i == 0 {
                ids.push(v.id(Token::Program(0)).unwrap());
            }
            ids.push(v.id(Token::Pitch(67)).unwrap());
            ids.push(v.id(Token::Duration(2)).unwrap());
        }
        ids.push(v.id(Token::Position(30)).unwrap());
        let (s, g) = state_and_grammar(&v, &ids);
        assert_eq!(s.run(), Some((67, 8)));
        assert_eq!(
            s.bans(&cfg, &v, Some(&g)),
            vec![v.id(Token::Pitch(67)).unwrap()]
        );
        assert_eq!(
            s.bans(&cfg, &v, None),
            vec![v.id(Token::Pitch(67)).unwrap()]
        );
        // After a Pitch only Durations may follow: the long ones are masked.
        ids.push(v.id(Token::Pitch(64)).unwrap());
        let (s, g) = state_and_grammar(&v, &ids);
        let limit = 16 * v.config().positions_per_quarter;
        let long: Vec<u32> = v
            .range(TokenType::Duration)
            .zip(v.durations())
            .filter(|&(_, &steps)| steps > limit)
            .map(|(id, _)| id)
            .collect();
        assert!(!long.is_empty());
        assert_eq!(s.bans(&cfg, &v, Some(&g)), long);
        assert_eq!(s.bans(&cfg, &v, None), long);
    }

    #[test]
    fn runs_are_per_program_and_drums_are_free() {
        let v = vocab();
        let cfg = GuardConfig::default();
        let mut ids = repeated(&v, 60, 8);
        // A violin note of the same pitch: program 40 has its own run.
        ids.push(v.id(Token::Position(30)).unwrap());
        ids.push(v.id(Token::Program(40)).unwrap());
        let (s, g) = state_and_grammar(&v, &ids);
        assert_eq!(s.run(), None);
        assert!(s.bans(&cfg, &v, Some(&g)).is_empty());
        // Eight snare hits, then a ninth: never masked.
        let mut drums = vec![BOS_ID, BAR_ID];
        for i in 0..9u16 {
            drums.push(v.id(Token::Position(i * 3)).unwrap());
            drums.push(v.id(Token::Program(DRUMS)).unwrap());
            if i == 8 {
                break;
            }
            drums.push(v.id(Token::PitchDrum(38)).unwrap());
            drums.push(v.id(Token::Velocity(20)).unwrap());
            drums.push(v.id(Token::Duration(2)).unwrap());
        }
        let (s, g) = state_and_grammar(&v, &drums);
        assert!(s.bans(&cfg, &v, Some(&g)).is_empty());
    }

    #[test]
    fn a_chord_can_break_a_run_and_a_forced_pitch_is_kept() {
        let v = vocab();
        let cfg = GuardConfig::default();
        let mut ids = repeated(&v, 60, 7);
        // A chord 60 + 64 at the next position: the run restarts at 64.
        ids.push(v.id(Token::Position(30)).unwrap());
        for p in [60, 64] {
            ids.push(v.id(Token::Program(0)).unwrap());
            ids.push(v.id(Token::Pitch(p)).unwrap());
            ids.push(v.id(Token::Velocity(20)).unwrap());
            ids.push(v.id(Token::Duration(2)).unwrap());
        }
        let (s, _) = state_and_grammar(&v, &ids);
        assert_eq!(s.run(), Some((64, 1)));
        // Eight notes at pitch 108 (the top), then another note at the same
        // position: the grammar allows only 108 again, so nothing is masked.
        let mut top = vec![BOS_ID, BAR_ID];
        top.push(v.id(Token::Position(0)).unwrap());
        for _ in 0..8 {
            top.push(v.id(Token::Program(0)).unwrap());
            top.push(v.id(Token::Pitch(108)).unwrap());
            top.push(v.id(Token::Velocity(20)).unwrap());
            top.push(v.id(Token::Duration(2)).unwrap());
        }
        top.push(v.id(Token::Program(0)).unwrap());
        let (s, g) = state_and_grammar(&v, &top);
        assert_eq!(s.run(), Some((108, 8)));
        assert!(s.bans(&cfg, &v, Some(&g)).is_empty());
        // Unconstrained, the pitch is masked.
        assert_eq!(s.bans(&cfg, &v, None).len(), 1);
    }

    #[test]
    fn masks_long_durations_but_keeps_the_shortest_allowed() {
        let v = vocab();
        let cfg = GuardConfig::default();
        let ppq = v.config().positions_per_quarter;
        let mut ids = repeated(&v, 60, 1);
        ids.push(v.id(Token::Program(0)).unwrap());
        ids.push(v.id(Token::Pitch(62)).unwrap());
        ids.push(v.id(Token::Velocity(20)).unwrap());
        let (s, g) = state_and_grammar(&v, &ids);
        let bans = s.bans(&cfg, &v, Some(&g));
        let range = v.range(TokenType::Duration);
        let steps = |id: u32| v.durations()[(id - range.start) as usize];
        assert!(!bans.is_empty());
        assert!(bans.iter().all(|&id| steps(id) > 16 * ppq), "{bans:?}");
        let longer = range.clone().filter(|&id| steps(id) > 16 * ppq).count();
        assert_eq!(bans.len(), longer);
        // A limit below the shortest duration keeps the shortest one.
        let tiny = GuardConfig {
            max_note_quarters: 0.01,
            ..cfg.clone()
        };
        let bans = s.bans(&tiny, &v, Some(&g));
        assert_eq!(bans.len(), range.len() - 1);
        assert!(!bans.contains(&range.start));
        // The grammar forces a duration at least as long as an identical
        // note's before it: the shortest of those is kept.
        let mut dup = vec![BOS_ID, BAR_ID, v.id(Token::Position(0)).unwrap()];
        let long = range.end - 1;
        for id in [
            v.id(Token::Program(0)).unwrap(),
            v.id(Token::Pitch(60)).unwrap(),
            v.id(Token::Velocity(20)).unwrap(),
            long - 1,
            v.id(Token::Program(0)).unwrap(),
            v.id(Token::Pitch(60)).unwrap(),
            v.id(Token::Velocity(20)).unwrap(),
        ] {
            dup.push(id);
        }
        let (s, g) = state_and_grammar(&v, &dup);
        assert_eq!(s.bans(&cfg, &v, Some(&g)), vec![long]);
        // Switched off or unlimited: nothing.
        assert!(s.bans(&GuardConfig::off(), &v, Some(&g)).is_empty());
        let unlimited = GuardConfig {
            max_note_quarters: 0.0,
            ..cfg
        };
        assert!(s.bans(&unlimited, &v, Some(&g)).is_empty());
    }
}
