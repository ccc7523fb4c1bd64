//! Training windows from a token dataset: a seeded split by piece, windows
//! that start at bar lines and run on into further pieces (so no padding),
//! and transposition augmentation.

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use crate::tokenizer::dataset::Dataset;
use crate::tokenizer::{TokenType, Vocab, BAR_ID, PAD_ID};
use crate::train::config::TrainConfig;

/// One piece's ids (BOS ... EOS) and the offsets where its bars start.
pub struct PieceTokens {
    pub source: String,
    pub ids: Vec<u32>,
    /// Offsets of BOS and of every Bar token: where windows may start.
    pub starts: Vec<usize>,
}

impl PieceTokens {
    pub fn new(source: String, ids: Vec<u32>) -> Self {
        let starts = std::iter::once(0)
            .chain(
                ids.iter()
                    .enumerate()
                    .filter(|(_, &t)| t == BAR_ID)
                    .map(|(i, _)| i),
            )
            .collect();
        PieceTokens {
            source,
            ids,
            starts,
        }
    }
}

/// Deterministic split: a piece goes to validation when the hash of its
/// source name and the seed falls under the fraction.
pub fn is_validation(source: &str, seed: u64, fraction: f64) -> bool {
    // FNV-1a: stable across platforms and Rust versions.
    let mut h: u64 = 0xcbf2_9ce4_8422_2325 ^ seed.wrapping_mul(0x9e37_79b9_7f4a_7c15);
    for b in source.bytes() {
        h ^= b as u64;
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    (h >> 11) as f64 / (1u64 << 53) as f64 <= fraction
}

pub struct Split {
    pub train: Vec<PieceTokens>,
    pub val: Vec<PieceTokens>,
}

/// Loads every piece and splits them. With a single piece, it trains and
/// validates on that piece.
pub fn split(ds: &Dataset, seed: u64, fraction: f64) -> Split {
    let mut train = Vec::new();
    let mut val = Vec::new();
    for (i, p) in ds.pieces.iter().enumerate() {
        let piece = PieceTokens::new(p.source.clone(), ds.piece_tokens(i));
        if fraction > 0.0 && is_validation(&p.source, seed, fraction) {
            val.push(piece);
        } else {
            train.push(piece);
        }
    }
    if train.is_empty() && !val.is_empty() {
        train.push(val.pop().expect("non-empty"));
    }
    if val.is_empty() && !train.is_empty() {
        // Too few pieces to hold any out: validate on the last training piece.
        let last = train.last().expect("non-empty");
        val.push(PieceTokens::new(last.source.clone(), last.ids.clone()));
    }
    Split { train, val }
}

/// Shifts every `Pitch` token by `semitones`; `None` when one would leave the
/// range (drum pitches never move).
pub fn transpose(ids: &[u32], semitones: i64, vocab: &Vocab) -> Option<Vec<u32>> {
    if semitones == 0 {
        return Some(ids.to_vec());
    }
    let range = vocab.range(TokenType::Pitch);
    ids.iter()
        .map(|&id| {
            if range.contains(&id) {
                let shifted = id as i64 + semitones;
                (shifted >= range.start as i64 && shifted < range.end as i64)
                    .then_some(shifted as u32)
            } else {
                Some(id)
            }
        })
        .collect()
}

/// Draws training batches; batch `step` depends only on (seed, step), so a
/// resumed run sees exactly the batches an uninterrupted one would.
pub struct Batcher<'a> {
    pieces: &'a [PieceTokens],
    /// Cumulative token counts, for picking pieces in proportion to length.
    cumulative: Vec<u64>,
    vocab: &'a Vocab,
    seed: u64,
    transpose: i64,
    /// Share of windows that begin at a piece's BOS ([`Batcher::with_piece_starts`]).
    piece_starts: f64,
    /// Share of windows drawn whole from one piece ([`Batcher::with_one_piece_windows`]).
    one_piece: f64,
    /// Pieces entered at their BOS drawn uniformly ([`Batcher::with_openings_by_piece`]).
    openings_by_piece: bool,
}

impl<'a> Batcher<'a> {
    pub fn new(pieces: &'a [PieceTokens], vocab: &'a Vocab, seed: u64, transpose: i64) -> Self {
        let mut total = 0u64;
        let cumulative = pieces
            .iter()
            .map(|p| {
                total += p.ids.len() as u64;
                total
            })
            .collect();
        Batcher {
            pieces,
            cumulative,
            vocab,
            seed,
            transpose,
            piece_starts: 0.0,
            one_piece: 0.0,
            openings_by_piece: false,
        }
    }

    /// The batcher of a training configuration: its seed, transposition and window
    /// draws (`piece_starts`, `one_piece_windows`, `openings_by_piece`).
    pub fn for_config(pieces: &'a [PieceTokens], vocab: &'a Vocab, tc: &TrainConfig) -> Self {
        Batcher::new(pieces, vocab, tc.seed, tc.transpose)
            .with_piece_starts(tc.piece_starts)
            .with_one_piece_windows(tc.one_piece_windows)
            .with_openings_by_piece(tc.openings_by_piece)
    }

    /// The batcher that draws the pieces a window enters at their start (its BOS),
    /// the window's first piece under `piece_starts` and every piece it runs on
    /// into, uniformly over the pieces instead of in proportion to their length.
    /// What follows a BOS in training is then the corpus's mix of pieces, not its
    /// mix of tokens (on the corpus: 87% folk tunes against 59% of the tokens, a
    /// Palestrina movement being 3x a tune's length), and an unprompted piece opens
    /// in each style as often as the corpus's pieces do. A window that begins at a
    /// bar line inside a piece still draws it in proportion to length, so every
    /// token stays as likely to be trained on. With `false` no draw changes.
    pub fn with_openings_by_piece(mut self, on: bool) -> Self {
        self.openings_by_piece = on;
        self
    }

    /// The batcher whose windows begin at a piece's start (its BOS) with probability
    /// `share`, at a bar line drawn uniformly otherwise. With 0 no coin is tossed, so
    /// the batches are those of a batcher without it.
    pub fn with_piece_starts(mut self, share: f64) -> Self {
        self.piece_starts = share;
        self
    }

    /// The batcher whose windows, with probability `share`, lie whole inside one
    /// piece at least as long as the window: the piece drawn in proportion to its
    /// length among those, the window from one of its bar lines (or its BOS) that
    /// leaves room for the whole window. So every position of such a window has
    /// its own piece's past behind it, as far back as the window reaches, where a
    /// plain window of 2,048 tokens mostly strings short tunes together. Where no
    /// piece is long enough, or with probability `1 - share`, the plain draw. With
    /// 0 no coin is tossed, so the batches are those of a batcher without it.
    pub fn with_one_piece_windows(mut self, share: f64) -> Self {
        self.one_piece = share;
        self
    }

    /// A piece of at least `len` tokens, drawn in proportion to length, and the
    /// index into its `starts` of a start that leaves `len` tokens; `None` when no
    /// piece is that long.
    fn pick_whole(&self, rng: &mut ChaCha8Rng, len: usize) -> Option<(&'a PieceTokens, usize)> {
        let long: Vec<&PieceTokens> = self.pieces.iter().filter(|p| p.ids.len() >= len).collect();
        let total: u64 = long.iter().map(|p| p.ids.len() as u64).sum();
        if total == 0 {
            return None;
        }
        let mut x = rng.gen_range(0..total);
        let piece = long
            .iter()
            .find(|p| {
                let n = p.ids.len() as u64;
                if x < n {
                    return true;
                }
                x -= n;
                false
            })
            .copied()?;
        // starts are increasing; starts[0] (BOS, 0) always leaves room
        let room = piece
            .starts
            .partition_point(|&s| s + len <= piece.ids.len());
        Some((piece, rng.gen_range(0..room.max(1))))
    }

    /// A piece entered at its BOS: uniformly with `openings_by_piece`, else [`Self::pick`].
    fn pick_opening(&self, rng: &mut ChaCha8Rng) -> &'a PieceTokens {
        if self.openings_by_piece && !self.pieces.is_empty() {
            &self.pieces[rng.gen_range(0..self.pieces.len())]
        } else {
            self.pick(rng)
        }
    }

    fn pick(&self, rng: &mut ChaCha8Rng) -> &'a PieceTokens {
        let total = *self.cumulative.last().unwrap_or(&1);
        let x = rng.gen_range(0..total.max(1));
        let i = self.cumulative.partition_point(|&c| c <= x);
        &self.pieces[i.min(self.pieces.len() - 1)]
    }

    /// One window of `len` tokens: from a bar line of a random piece, running
    /// on into further random pieces.
    pub fn window(&self, rng: &mut ChaCha8Rng, len: usize) -> Vec<u32> {
        self.window_with_bars(rng, len).0
    }

    /// [`Batcher::window`] (the same draws), and the number of bars its piece began
    /// before the window's first token: the bar index the window starts from
    /// ([`crate::model::clock::BarIndex`]; 0 for a window that begins at BOS).
    pub fn window_with_bars(&self, rng: &mut ChaCha8Rng, len: usize) -> (Vec<u32>, i64) {
        let mut out = Vec::with_capacity(len);
        let whole = if self.one_piece > 0.0 && rng.gen::<f64>() < self.one_piece {
            self.pick_whole(rng, len)
        } else {
            None
        };
        // starts[0] is BOS, starts[j] the j-th Bar: j - 1 bars lie before it
        let (first, j) = match whole {
            Some(found) => found,
            None if self.openings_by_piece => {
                // the coin first: an opening is drawn per piece, a bar line per token
                // (the arm below keeps the old order of draws, so that runs without
                // the flag see the batches they always saw)
                let at_start = self.piece_starts > 0.0 && rng.gen::<f64>() < self.piece_starts;
                if at_start {
                    (self.pick_opening(rng), 0)
                } else {
                    let first = self.pick(rng);
                    (first, rng.gen_range(0..first.starts.len()))
                }
            }
            None => {
                let first = self.pick(rng);
                let at_start = self.piece_starts > 0.0 && rng.gen::<f64>() < self.piece_starts;
                let j = if at_start {
                    0
                } else {
                    rng.gen_range(0..first.starts.len())
                };
                (first, j)
            }
        };
        let start = first.starts[j];
        let bars_before = j.saturating_sub(1) as i64;
        out.extend_from_slice(&first.ids[start..first.ids.len().min(start + len)]);
        while out.len() < len {
            let p = self.pick_opening(rng);
            let need = len - out.len();
            out.extend_from_slice(&p.ids[..p.ids.len().min(need)]);
        }
        if self.transpose > 0 {
            let k = rng.gen_range(-self.transpose..=self.transpose);
            if let Some(t) = transpose(&out, k, self.vocab) {
                out = t;
            }
        }
        (out, bars_before)
    }

    /// A (batch, len) batch of ids, flattened row-major.
    pub fn batch(&self, step: u64, batch: usize, len: usize) -> Vec<i64> {
        self.batch_with_bars(step, batch, len).0
    }

    /// [`Batcher::batch`], and the bar index each of its rows starts from
    /// ([`Batcher::window_with_bars`]).
    pub fn batch_with_bars(&self, step: u64, batch: usize, len: usize) -> (Vec<i64>, Vec<i64>) {
        let mut rng =
            ChaCha8Rng::seed_from_u64(self.seed ^ step.wrapping_mul(0x9e37_79b9_7f4a_7c15));
        let mut ids = Vec::with_capacity(batch * len);
        let mut bars = Vec::with_capacity(batch);
        for _ in 0..batch {
            let (w, b) = self.window_with_bars(&mut rng, len);
            ids.extend(w.into_iter().map(|t| t as i64));
            bars.push(b);
        }
        (ids, bars)
    }
}

/// Fixed validation windows, at most `max`: pieces spread evenly over the
/// whole held-out list (not its first files, which are one collection), each
/// cut from its start into windows of `len` tokens (the last one padded with
/// PAD, which the loss ignores).
pub fn validation_windows(pieces: &[PieceTokens], len: usize, max: usize) -> Vec<Vec<u32>> {
    validation_windows_with_bars(pieces, len, max)
        .into_iter()
        .map(|(w, _)| w)
        .collect()
}

/// [`validation_windows`], each with the number of bars its piece began before
/// the window's first token (the bar index it starts from).
pub fn validation_windows_with_bars(
    pieces: &[PieceTokens],
    len: usize,
    max: usize,
) -> Vec<(Vec<u32>, i64)> {
    let mut out = Vec::new();
    let n = pieces.len();
    let order: Vec<&PieceTokens> = if max > 0 && max < n {
        (0..max).map(|i| &pieces[i * n / max]).collect()
    } else {
        pieces.iter().collect()
    };
    'outer: for p in order {
        let mut at = 0;
        while at + 1 < p.ids.len() {
            let end = (at + len).min(p.ids.len());
            let mut w = p.ids[at..end].to_vec();
            w.resize(len, PAD_ID);
            // starts[0] is BOS; the Bar offsets after it that lie before `at`
            let bars = p.starts[1..].partition_point(|&s| s < at) as i64;
            out.push((w, bars));
            if out.len() >= max {
                break 'outer;
            }
            at += len - 1;
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tokenizer::{RemiConfig, Token, DRUMS};

    #[test]
    fn transposition_keeps_drums_and_range() {
        let v = Vocab::new(RemiConfig::default()).unwrap();
        let ids: Vec<u32> = [
            Token::Program(0),
            Token::Pitch(60),
            Token::Program(DRUMS),
            Token::PitchDrum(36),
        ]
        .iter()
        .map(|&t| v.id(t).unwrap())
        .collect();
        let up = transpose(&ids, 5, &v).unwrap();
        assert_eq!(v.token(up[1]), Some(Token::Pitch(65)));
        assert_eq!(v.token(up[3]), Some(Token::PitchDrum(36)));
        assert_eq!(up[0], ids[0]);
        let high = vec![v.id(Token::Pitch(106)).unwrap()];
        assert!(transpose(&high, 3, &v).is_none());
        assert!(transpose(&high, -3, &v).is_some());
    }

    #[test]
    fn batches_are_a_function_of_seed_and_step() {
        let v = Vocab::new(RemiConfig::default()).unwrap();
        let pieces: Vec<PieceTokens> = (0..5)
            .map(|i| {
                let mut ids = vec![1u32];
                for _ in 0..(10 + i * 7) {
                    ids.extend([BAR_ID, v.id(Token::Position(0)).unwrap()]);
                }
                ids.push(2);
                PieceTokens::new(format!("p{i}"), ids)
            })
            .collect();
        let b = Batcher::new(&pieces, &v, 7, 0);
        assert_eq!(b.batch(3, 4, 33), b.batch(3, 4, 33));
        assert_ne!(b.batch(3, 4, 33), b.batch(4, 4, 33));
        let batch = b.batch(5, 2, 33);
        assert_eq!(batch.len(), 66);
        // Windows start at BOS or a bar line.
        for row in batch.chunks(33) {
            assert!(row[0] == 1 || row[0] == BAR_ID as i64, "{row:?}");
        }
    }

    #[test]
    fn piece_starts_share_begins_windows_at_bos() {
        let v = Vocab::new(RemiConfig::default()).unwrap();
        let pieces: Vec<PieceTokens> = (0..4)
            .map(|i| {
                let mut ids = vec![1u32];
                for _ in 0..200 {
                    ids.extend([BAR_ID, v.id(Token::Position(0)).unwrap()]);
                }
                ids.push(2);
                PieceTokens::new(format!("p{i}"), ids)
            })
            .collect();
        let count = |share: f64| {
            let b = Batcher::new(&pieces, &v, 3, 0).with_piece_starts(share);
            (0..50)
                .flat_map(|s| b.batch(s, 8, 17))
                .collect::<Vec<_>>()
                .chunks(17)
                .filter(|w| w[0] == 1)
                .count()
        };
        // 400 windows; about 1 in 201 bar lines is the BOS without the share
        let (none, half, all) = (count(0.0), count(0.5), count(1.0));
        assert!(none < 15, "{none}");
        assert!((150..250).contains(&half), "{half}");
        assert_eq!(all, 400);
        // share 0 leaves the batches as they were
        let plain = Batcher::new(&pieces, &v, 3, 0);
        let zero = Batcher::new(&pieces, &v, 3, 0).with_piece_starts(0.0);
        assert_eq!(plain.batch(9, 4, 17), zero.batch(9, 4, 17));
    }

    #[test]
    fn openings_by_piece_draw_what_follows_bos_per_piece() {
        let v = Vocab::new(RemiConfig::default()).unwrap();
        // one long piece (Position 1 in every bar) and nine short ones (Position 2):
        // the long one holds half the tokens and a tenth of the pieces
        let piece = |pos: u16, bars: usize| {
            let p = v.id(Token::Position(pos)).unwrap();
            let mut ids = vec![1u32];
            for _ in 0..bars {
                ids.extend([BAR_ID, p]);
            }
            ids.push(2);
            PieceTokens::new(format!("p{pos}-{bars}"), ids)
        };
        let mut pieces = vec![piece(1, 90)];
        pieces.extend((0..9).map(|_| piece(2, 10)));
        let long_pos = v.id(Token::Position(1)).unwrap() as i64;
        // share of the BOS tokens of a batch's windows that open the long piece
        let long_openings = |by_piece: bool| {
            let b = Batcher::new(&pieces, &v, 3, 0)
                .with_piece_starts(0.5)
                .with_openings_by_piece(by_piece);
            let (mut long, mut all) = (0usize, 0usize);
            for step in 0..100 {
                let ids = b.batch(step, 4, 60);
                for w in ids.chunks(60) {
                    for i in 0..w.len() - 2 {
                        if w[i] == 1 {
                            all += 1;
                            long += (w[i + 2] == long_pos) as usize;
                        }
                    }
                }
            }
            long as f64 / all as f64
        };
        let (by_length, by_piece) = (long_openings(false), long_openings(true));
        assert!((0.35..0.65).contains(&by_length), "{by_length}");
        assert!((0.04..0.18).contains(&by_piece), "{by_piece}");
        // false leaves the batches as they were
        let plain = Batcher::new(&pieces, &v, 3, 0).with_piece_starts(0.5);
        let off = Batcher::new(&pieces, &v, 3, 0)
            .with_piece_starts(0.5)
            .with_openings_by_piece(false);
        assert_eq!(plain.batch(9, 4, 41), off.batch(9, 4, 41));
    }

    #[test]
    fn one_piece_windows_lie_whole_inside_a_long_piece() {
        let v = Vocab::new(RemiConfig::default()).unwrap();
        let eos = 2u32;
        // piece i: BOS, then bars of (Bar, Position(i)), then EOS; only piece 3 is
        // longer than a 41-token window
        let pieces: Vec<PieceTokens> = (0..4u16)
            .map(|i| {
                let pos = v.id(Token::Position(i)).unwrap();
                let mut ids = vec![1u32];
                for _ in 0..(if i == 3 { 60 } else { 5 }) {
                    ids.extend([BAR_ID, pos]);
                }
                ids.push(eos);
                PieceTokens::new(format!("p{i}"), ids)
            })
            .collect();
        let long_pos = v.id(Token::Position(3)).unwrap() as i64;
        let b = Batcher::new(&pieces, &v, 3, 0).with_one_piece_windows(1.0);
        for step in 0..50 {
            for w in b.batch(step, 4, 41).chunks(41) {
                // one piece: its tokens only, and its EOS at most as the last token,
                // so the window never runs on into another
                let (last, body) = w.split_last().unwrap();
                assert!(
                    body.iter()
                        .all(|&t| t == 1 || t == BAR_ID as i64 || t == long_pos),
                    "{w:?}"
                );
                assert!(
                    [BAR_ID as i64, long_pos, eos as i64].contains(last),
                    "{w:?}"
                );
            }
        }
        // windows that reach a short piece: about half as many at share 0.5 as
        // without it (200 windows)
        let short_ids: Vec<i64> = (0..3u16)
            .map(|i| v.id(Token::Position(i)).unwrap() as i64)
            .collect();
        let reaching = |share: f64| {
            let b = Batcher::new(&pieces, &v, 3, 0).with_one_piece_windows(share);
            (0..50)
                .flat_map(|s| b.batch(s, 4, 41))
                .collect::<Vec<_>>()
                .chunks(41)
                .filter(|w| w.iter().any(|t| short_ids.contains(t)))
                .count()
        };
        let (none, half) = (reaching(0.0), reaching(0.5));
        assert!(
            none > 60 && half > 10 && half * 10 < none * 7,
            "{none} {half}"
        );
        // no piece long enough: the plain draw, never a panic
        let short = Batcher::new(&pieces[..3], &v, 3, 0).with_one_piece_windows(1.0);
        assert_eq!(short.batch(1, 2, 41).len(), 82);
        // share 0 leaves the batches as they were
        let plain = Batcher::new(&pieces, &v, 3, 0);
        let zero = Batcher::new(&pieces, &v, 3, 0).with_one_piece_windows(0.0);
        assert_eq!(plain.batch(9, 4, 41), zero.batch(9, 4, 41));
    }

    /// A piece whose bar k (from 1) holds Position(k): its first bar tells where
    /// a window begins.
    fn numbered_bars(v: &Vocab, bars: u16) -> PieceTokens {
        let mut ids = vec![1u32];
        for k in 1..=bars {
            ids.extend([BAR_ID, v.id(Token::Position(k)).unwrap()]);
        }
        ids.push(2);
        PieceTokens::new("p".into(), ids)
    }

    #[test]
    fn windows_know_the_bar_they_begin_in() {
        let v = Vocab::new(RemiConfig::default()).unwrap();
        let pieces = vec![numbered_bars(&v, 40), numbered_bars(&v, 25)];
        let b = Batcher::new(&pieces, &v, 5, 0).with_piece_starts(0.2);
        for step in 0..20 {
            let (ids, bars) = b.batch_with_bars(step, 6, 9);
            assert_eq!(ids, b.batch(step, 6, 9), "the same batches");
            for (row, &before) in ids.chunks(9).zip(&bars) {
                if row[0] == 1 {
                    assert_eq!(before, 0);
                } else {
                    // the row's first bar is bar before + 1
                    let pos = v.token(row[1] as u32);
                    assert_eq!(pos, Some(Token::Position(before as u16 + 1)), "{row:?}");
                }
            }
        }
        let val = validation_windows_with_bars(&pieces, 7, 100);
        let plain = validation_windows(&pieces, 7, 100);
        assert_eq!(val.iter().map(|w| w.0.clone()).collect::<Vec<_>>(), plain);
        // windows step by 6 tokens (3 bars) through a piece: 0, 3, 6, ... bars before
        let firsts: Vec<i64> = val.iter().take(4).map(|w| w.1).collect();
        assert_eq!(firsts, vec![0, 3, 6, 9]);
    }

    #[test]
    fn split_is_deterministic_and_roughly_proportional() {
        let names: Vec<String> = (0..2000).map(|i| format!("folk/x{i}.mid")).collect();
        let val = names.iter().filter(|n| is_validation(n, 3, 0.1)).count();
        assert!((150..250).contains(&val), "{val}");
        let again = names.iter().filter(|n| is_validation(n, 3, 0.1)).count();
        assert_eq!(val, again);
    }
}
