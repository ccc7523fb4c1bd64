//! The repetition guard: masks that keep a sampler out of four degenerate
//! loops a weak model falls into, a note held for dozens of bars, one
//! pitch struck over and over, one short phrase played again and again, and
//! one whole phrase or strain looped to the end of the piece.
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
//! - a phrase of [`PHRASE_NOTES`] pitches played 8 times already within the
//!   instrument's last [`PHRASE_WINDOW`] notes: 0.22% of the notes would
//!   have been masked, in 0.9% of the pieces (1,500 classical and folk pieces
//!   spread evenly over the corpus; 6-note phrases would already touch 0.34%
//!   of the notes and 2.4% of the pieces). 8 pieces of 3,072 tokens sampled
//!   from the RoPE model of stop 17 without this rule had 7.6% of their notes
//!   masked, in 7 of the 8; once a phrase is a habit the model comes back to
//!   it, so a rule on exact loops alone (tried first) only broke them for
//!   one note in eight bars. Loop-based styles repeat more: in the corpus's
//!   41 video-game pieces the rule would touch 11% of the notes; switch it
//!   off for them (`examples/phrase_limits.rs` prints these tables).
//!
//! - a long phrase of [`LONG_PHRASE_NOTES`] pitches played 4 times already
//!   within the instrument's last [`LONG_PHRASE_WINDOW`] notes: a whole
//!   phrase or strain looped, which the short rule cannot see (an 8-bar
//!   strain of 50 notes fits 5 times in 256 notes, so none of its 8-note
//!   phrases reaches 8). In 1,499 classical and folk pieces spread over the
//!   corpus 0.25% of the notes would have been masked, in 1.9% of the pieces
//!   (3 times: 0.90% and 10%; a tune's AABB plays each strain twice); in 64
//!   unprompted pieces of the stage-2 model (2026-12-05, guard without this
//!   rule) 25% of the notes of the 11 pieces that loop a phrase to the end
//!   (bar similarity 16 bars back > 0.6) and 1.5% of the other 53's.
//!
//! A phrase is exact and per program: [`PHRASE_NOTES`] pitches in a row in
//! the program's sequence of notes (token order, chords included, rhythm
//! ignored). Before each note of a melodic program, the guard counts, for
//! every pitch x, how often the last `PHRASE_NOTES - 1` pitches followed by
//! x occur among the program's last [`PHRASE_WINDOW`] notes, and masks the
//! pitches whose count has reached `max_phrase_repeats`; the long rule does
//! the same with [`LONG_PHRASE_NOTES`] pitches over [`LONG_PHRASE_WINDOW`]
//! notes and `max_long_phrase_repeats`. A trill over a bar or two is not
//! touched, nor a strain played twice and the whole tune again; a one-bar
//! figure played for 8 bars or more is, and an 8-bar strain played a fifth
//! time.
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
    /// Mask a pitch for a (non-drum) program's next note when it would play
    /// a phrase of [`PHRASE_NOTES`] pitches that occurs this many times
    /// already among the program's last [`PHRASE_WINDOW`] notes (0 = no
    /// limit).
    pub max_phrase_repeats: usize,
    /// Mask a pitch for a (non-drum) program's next note when it would play
    /// a phrase of [`LONG_PHRASE_NOTES`] pitches that occurs this many times
    /// already among the program's last [`LONG_PHRASE_WINDOW`] notes (0 = no
    /// limit).
    pub max_long_phrase_repeats: usize,
}

impl Default for GuardConfig {
    fn default() -> Self {
        GuardConfig {
            enabled: true,
            max_note_quarters: 16.0,
            max_same_pitch: 8,
            max_phrase_repeats: 8,
            max_long_phrase_repeats: 4,
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

/// Length, in notes, of the phrases the phrase rule counts.
pub const PHRASE_NOTES: usize = 8;

/// How many of a program's latest notes the phrase rule looks back over.
pub const PHRASE_WINDOW: usize = 256;

/// Length, in notes, of the phrases the long phrase rule counts.
pub const LONG_PHRASE_NOTES: usize = 16;

/// How many of a program's latest notes the long phrase rule looks back over.
pub const LONG_PHRASE_WINDOW: usize = 512;

/// How many of a program's latest pitches a [`Melody`] keeps: the longer window.
const MEMORY: usize = if LONG_PHRASE_WINDOW > PHRASE_WINDOW {
    LONG_PHRASE_WINDOW
} else {
    PHRASE_WINDOW
};

/// One program's last [`LONG_PHRASE_WINDOW`] pitches and how many notes in a
/// row ended on the latest one.
#[derive(Debug, Clone, Default)]
pub struct Melody {
    /// Oldest first; at most MEMORY.
    recent: std::collections::VecDeque<u8>,
    /// Notes in a row at the last pitch (0 before any note).
    same: usize,
}

impl Melody {
    /// Takes in the program's next note.
    pub fn push(&mut self, pitch: u8) {
        self.same = if self.recent.back() == Some(&pitch) {
            self.same + 1
        } else {
            1
        };
        if self.recent.len() == MEMORY {
            self.recent.pop_front();
        }
        self.recent.push_back(pitch);
        // One slice for counts (moves at most MEMORY bytes).
        self.recent.make_contiguous();
    }

    /// The last pitch and how many notes in a row had it.
    pub fn run(&self) -> Option<(u8, usize)> {
        Some((*self.recent.back()?, self.same))
    }

    /// Per pitch x (indexed by x), how often the latest `PHRASE_NOTES - 1`
    /// pitches followed by x occur among the last [`PHRASE_WINDOW`] notes;
    /// all zero before `PHRASE_NOTES - 1` notes.
    pub fn phrase_counts(&self) -> [u16; 128] {
        self.counts(PHRASE_NOTES, PHRASE_WINDOW)
    }

    /// [`Melody::phrase_counts`] for the long rule: phrases of
    /// [`LONG_PHRASE_NOTES`] pitches among the last [`LONG_PHRASE_WINDOW`] notes.
    pub fn long_phrase_counts(&self) -> [u16; 128] {
        self.counts(LONG_PHRASE_NOTES, LONG_PHRASE_WINDOW)
    }

    /// Per pitch x, how often the latest `n - 1` pitches followed by x occur
    /// among the last `window` notes (at most MEMORY).
    fn counts(&self, n: usize, window: usize) -> [u16; 128] {
        let mut counts = [0u16; 128];
        let all = self.recent.as_slices().0; // contiguous: see push
        let notes = &all[all.len().saturating_sub(window)..];
        let k = n - 1;
        let Some(suffix) = notes.len().checked_sub(k).map(|n| &notes[n..]) else {
            return counts;
        };
        // Every earlier occurrence of the suffix with a note after it.
        for w in notes.windows(n) {
            if &w[..k] == suffix {
                if let Some(c) = counts.get_mut(w[k] as usize) {
                    *c += 1;
                }
            }
        }
        counts
    }
}

/// What the guard remembers of one sequence: the previous token's type, the
/// current program and each melodic program's [`Melody`].
#[derive(Debug, Clone)]
pub struct GuardState {
    prev: Option<TokenType>,
    program: Option<u8>,
    melodies: Vec<Melody>,
}

impl Default for GuardState {
    fn default() -> Self {
        GuardState {
            prev: None,
            program: None,
            melodies: vec![Melody::default(); DRUMS as usize],
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
                if let Some(m) = self.melody_mut() {
                    m.push(pitch);
                }
            }
            _ => {}
        }
        self.prev = tok.map(|t| t.kind());
    }

    fn melody_mut(&mut self) -> Option<&mut Melody> {
        let p = self.program?;
        self.melodies.get_mut(p as usize)
    }

    /// The current program's [`Melody`] (`None` for drums or before any
    /// Program token).
    pub fn melody(&self) -> Option<&Melody> {
        self.melodies.get(self.program? as usize)
    }

    /// How many notes in a row the current program has played at one pitch,
    /// and that pitch (`None` before any note, or for drums).
    pub fn run(&self) -> Option<(u8, usize)> {
        self.melody()?.run()
    }

    /// The pitches the guard's three pitch rules would mask for the current
    /// program's next note, ignoring the grammar (may repeat a pitch).
    pub fn pitch_bans(&self, cfg: &GuardConfig) -> Vec<u8> {
        let Some(m) = self.melody() else {
            return Vec::new();
        };
        let mut out = Vec::new();
        if let Some((pitch, run)) = m.run() {
            if cfg.max_same_pitch > 0 && run >= cfg.max_same_pitch {
                out.push(pitch);
            }
        }
        let rules = [
            (cfg.max_phrase_repeats, PHRASE_NOTES, PHRASE_WINDOW),
            (
                cfg.max_long_phrase_repeats,
                LONG_PHRASE_NOTES,
                LONG_PHRASE_WINDOW,
            ),
        ];
        for (limit, notes, window) in rules {
            if limit > 0 {
                let counts = m.counts(notes, window);
                out.extend((0..128u8).filter(|&x| counts[x as usize] as usize >= limit));
            }
        }
        out
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
        if pitch_next {
            let mut ids: Vec<u32> = self
                .pitch_bans(cfg)
                .into_iter()
                .filter_map(|p| vocab.id(Token::Pitch(p)))
                .filter(|&id| allows(id))
                .collect();
            ids.sort_unstable();
            ids.dedup();
            if ids.is_empty() {
                return ids;
            }
            // A chord's order may leave only banned pitches allowed.
            let other = vocab
                .range(TokenType::Pitch)
                .any(|i| allows(i) && ids.binary_search(&i).is_err());
            return if other { ids } else { Vec::new() };
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

    /// The phrase counts of a whole history, found the slow way: per pitch
    /// x, the occurrences of the last `notes - 1` pitches followed by x that
    /// lie within the last `window` notes.
    fn brute_counts(history: &[u8], notes: usize, window: usize) -> [u16; 128] {
        let mut counts = [0u16; 128];
        let n = history.len();
        let k = notes - 1;
        if n < k {
            return counts;
        }
        let window = &history[n.saturating_sub(window)..];
        let suffix = &history[n - k..];
        for w in window.windows(notes) {
            if &w[..k] == suffix {
                counts[w[k] as usize] += 1;
            }
        }
        counts
    }

    proptest::proptest! {
        #[test]
        fn phrase_counts_match_a_brute_force_search(
            notes in proptest::collection::vec(60u8..63, 0..700)
        ) {
            // Three pitches, so phrases recur; past PHRASE_WINDOW and
            // LONG_PHRASE_WINDOW notes the windows slide.
            let mut m = Melody::default();
            let mut history = Vec::new();
            for pitch in notes {
                m.push(pitch);
                history.push(pitch);
                proptest::prop_assert_eq!(
                    m.phrase_counts(),
                    brute_counts(&history, PHRASE_NOTES, PHRASE_WINDOW)
                );
                proptest::prop_assert_eq!(
                    m.long_phrase_counts(),
                    brute_counts(&history, LONG_PHRASE_NOTES, LONG_PHRASE_WINDOW)
                );
                let same = history.iter().rev().take_while(|&&h| h == pitch).count();
                proptest::prop_assert_eq!(m.run(), Some((pitch, same)));
            }
        }
    }

    /// Position, Program 0, Pitch, Velocity and Duration of one note.
    fn note_ids(v: &Vocab, position: u16, pitch: u8) -> [u32; 5] {
        [
            v.id(Token::Position(position)).unwrap(),
            v.id(Token::Program(0)).unwrap(),
            v.id(Token::Pitch(pitch)).unwrap(),
            v.id(Token::Velocity(20)).unwrap(),
            v.id(Token::Duration(4)).unwrap(),
        ]
    }

    /// BOS, then `bars` bars each playing `phrase` on program 0 as eighth
    /// notes, then the Position and Program of one more note.
    fn looped(v: &Vocab, phrase: &[u8], bars: usize) -> Vec<u32> {
        let mut bar = vec![BAR_ID];
        for (i, &pitch) in phrase.iter().enumerate() {
            bar.extend(note_ids(v, i as u16 * 6, pitch));
        }
        let mut ids = vec![BOS_ID];
        for _ in 0..bars {
            ids.extend_from_slice(&bar);
        }
        ids.push(BAR_ID);
        ids.push(v.id(Token::Position(0)).unwrap());
        ids.push(v.id(Token::Program(0)).unwrap());
        ids
    }

    #[test]
    fn masks_a_phrase_played_eight_times_already() {
        let v = vocab();
        // the short rule alone (the long one would stop this loop sooner)
        let cfg = GuardConfig {
            max_long_phrase_repeats: 0,
            ..GuardConfig::default()
        };
        // The demo's loop of stop 17: one bar of six pitches, over and
        // over. After 10 bars (60 notes) the 8-note phrase 83 79 79 74 79
        // 81 83 79 | 81 has occurred 8 times: it starts on the second note
        // of bars 1 to 8.
        let phrase = [81, 83, 79, 79, 74, 79];
        let (s, g) = state_and_grammar(&v, &looped(&v, &phrase, 10));
        assert_eq!(s.melody().unwrap().phrase_counts()[81], 8);
        assert_eq!(
            s.bans(&cfg, &v, Some(&g)),
            vec![v.id(Token::Pitch(81)).unwrap()]
        );
        // One bar fewer is not enough; neither is the rule switched off or
        // the guard as a whole.
        let (s8, g8) = state_and_grammar(&v, &looped(&v, &phrase, 9));
        assert_eq!(s8.melody().unwrap().phrase_counts()[81], 7);
        assert!(s8.bans(&cfg, &v, Some(&g8)).is_empty());
        let no_limit = GuardConfig {
            max_phrase_repeats: 0,
            ..cfg.clone()
        };
        assert!(s.bans(&no_limit, &v, Some(&g)).is_empty());
        assert!(s.bans(&GuardConfig::off(), &v, Some(&g)).is_empty());
        // Another program's next note is free.
        let mut other = looped(&v, &phrase, 10);
        *other.last_mut().unwrap() = v.id(Token::Program(40)).unwrap();
        let (so, go) = state_and_grammar(&v, &other);
        assert!(so.bans(&cfg, &v, Some(&go)).is_empty());
        // Chords: with only the looping pitch allowed, nothing is masked.
        let only: Vec<u32> = vec![v.id(Token::Pitch(81)).unwrap()];
        let bans = s.bans(&cfg, &v, Some(&g));
        assert!(v
            .range(TokenType::Pitch)
            .any(|i| g.allows(i) && !only.contains(&i)));
        assert_eq!(bans, only);
    }

    /// An 8-bar strain of 32 varied pitches (no 8-note phrase of it repeats
    /// inside it), four quarter notes a bar.
    fn strain() -> Vec<u8> {
        (0..32u8).map(|i| 60 + (i * 7) % 19).collect()
    }

    /// BOS, then `plays` plays of `strain` and the first `more` notes of one
    /// more, then the Position and Program of the next note.
    fn strain_played(v: &Vocab, strain: &[u8], plays: usize, more: usize) -> Vec<u32> {
        let notes: Vec<u8> = strain
            .iter()
            .cycle()
            .take(plays * strain.len() + more)
            .copied()
            .collect();
        let mut ids = vec![BOS_ID];
        for (i, &pitch) in notes.iter().enumerate() {
            if i % 4 == 0 {
                ids.push(BAR_ID);
            }
            ids.extend(note_ids(v, (i % 4) as u16 * 12, pitch));
        }
        if notes.len().is_multiple_of(4) {
            ids.push(BAR_ID);
        }
        ids.push(
            v.id(Token::Position((notes.len() % 4) as u16 * 12))
                .unwrap(),
        );
        ids.push(v.id(Token::Program(0)).unwrap());
        ids
    }

    #[test]
    fn masks_a_strain_looped_a_fifth_time_but_not_a_return() {
        let v = vocab();
        let cfg = GuardConfig::default();
        let a = strain();
        let pitch = |p: u8| v.id(Token::Pitch(p)).unwrap();
        // Four plays and 15 notes of a fifth: the 16-note phrase a[0..16]
        // has been played 4 times, so its last note is masked.
        let (s, g) = state_and_grammar(&v, &strain_played(&v, &a, 4, 15));
        assert_eq!(s.melody().unwrap().long_phrase_counts()[a[15] as usize], 4);
        assert_eq!(s.bans(&cfg, &v, Some(&g)), vec![pitch(a[15])]);
        // The short rule alone lets the loop go on: 8-note phrases of a
        // 32-note strain fit 8 times in 256 notes only after 8 plays.
        let short = GuardConfig {
            max_long_phrase_repeats: 0,
            ..cfg.clone()
        };
        assert!(s.bans(&short, &v, Some(&g)).is_empty());
        // Three plays and the start of a fourth: free (AABB AA...).
        let (s3, g3) = state_and_grammar(&v, &strain_played(&v, &a, 3, 15));
        assert_eq!(s3.melody().unwrap().long_phrase_counts()[a[15] as usize], 3);
        assert!(s3.bans(&cfg, &v, Some(&g3)).is_empty());
        // A tune played twice (AABB AABB) and into its third time: each strain
        // has been played four times, and the third A is cut at its 16th note.
        let b: Vec<u8> = a.iter().map(|p| p + 20).collect();
        let tune: Vec<u8> = [&a[..], &a[..], &b[..], &b[..]].concat();
        let twice = strain_played(&v, &tune, 2, 0);
        let (st, gt) = state_and_grammar(&v, &twice);
        assert!(st.bans(&cfg, &v, Some(&gt)).is_empty());
        let (st, gt) = state_and_grammar(&v, &strain_played(&v, &tune, 2, 15));
        assert_eq!(st.bans(&cfg, &v, Some(&gt)), vec![pitch(a[15])]);
    }

    #[test]
    fn a_trill_of_two_bars_or_a_tune_played_twice_is_free() {
        let v = vocab();
        let cfg = GuardConfig::default();
        // A trill of 16 eighths over two bars: the 8-note phrase 74 72 ...
        // 74 | 72 has occurred 4 times before the next note.
        let trill = [72, 74, 72, 74, 72, 74, 72, 74];
        let (s, g) = state_and_grammar(&v, &looped(&v, &trill, 2));
        assert_eq!(s.melody().unwrap().phrase_counts()[72], 4);
        assert!(s.bans(&cfg, &v, Some(&g)).is_empty());
        // A 16-bar tune of varied bars, played twice: each phrase once
        // before.
        let mut ids = vec![BOS_ID];
        for _ in 0..2 {
            for bar in 0..16u8 {
                ids.push(BAR_ID);
                for i in 0..4u8 {
                    ids.extend(note_ids(&v, i as u16 * 12, 60 + (bar * 5 + i * 3) % 17));
                }
            }
        }
        ids.push(BAR_ID);
        ids.push(v.id(Token::Position(0)).unwrap());
        ids.push(v.id(Token::Program(0)).unwrap());
        let (s, g) = state_and_grammar(&v, &ids);
        assert!(s.melody().unwrap().phrase_counts().iter().all(|&c| c <= 1));
        assert!(s.bans(&cfg, &v, Some(&g)).is_empty());
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
