//! Does a model continue a real piece as the piece goes on? For each held-out
//! piece: its first `prompt_bars` bars are the prompt, its next `bars` bars
//! the real continuation, and the model writes a continuation of the same
//! number of bars. Both continuations are measured against the prompt:
//!
//! * `in_scale`: share of pitched notes inside the prompt's key, the major or
//!   natural-minor scale that holds most of the prompt's notes;
//! * `notes_per_bar`: pitched notes per bar;
//! * `pitch_range`: highest minus lowest pitch, in semitones;
//! * `repeat_share`: share of notes with the same pitch as the note before
//!   (in token order, so within a chord too).
//!
//! Each statistic is averaged over pieces, and the report gives the ratio
//! generated / real: 1.0 is the real music's texture, and an in-scale ratio
//! under 1 a model that wanders out of key. Drums are left out.

use serde::{Deserialize, Serialize};

use crate::model::Transformer;
use crate::sample::{self, SampleConfig};
use crate::tokenizer::{Token, Vocab, BAR_ID, BOS_ID, EOS_ID};

const MAJOR: [u8; 7] = [0, 2, 4, 5, 7, 9, 11];
const MINOR: [u8; 7] = [0, 2, 3, 5, 7, 8, 10];

/// Statistics of one continuation.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct ContinuationStats {
    pub in_scale: f64,
    pub notes_per_bar: f64,
    pub pitch_range: f64,
    pub repeat_share: f64,
    pub notes: usize,
}

/// Means over pieces for real and generated continuations, and their ratio.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ContinuationReport {
    pub pieces: usize,
    pub prompt_bars: usize,
    pub bars: usize,
    pub real: ContinuationStats,
    pub generated: ContinuationStats,
    /// generated / real for each statistic.
    pub ratio: ContinuationStats,
}

/// The 12-bit mask of the best-fitting key's scale for a pitch-class
/// histogram (ties: the first of C major, C minor, C# major, ...).
pub fn key_scale(hist: &[u32; 12]) -> u16 {
    let mut best = (0u32, 0u16);
    for tonic in 0..12u8 {
        for scale in [MAJOR, MINOR] {
            let mask = scale.iter().fold(0u16, |m, &d| m | 1 << ((tonic + d) % 12));
            let inside = (0..12)
                .filter(|&pc| mask & (1 << pc) != 0)
                .map(|pc| hist[pc])
                .sum();
            if inside > best.0 || best.1 == 0 {
                best = (inside, mask);
            }
        }
    }
    best.1
}

/// Pitches (non-drum) of a token sequence, in order.
pub fn pitches(tokens: &[u32], vocab: &Vocab) -> Vec<u8> {
    tokens
        .iter()
        .filter_map(|&t| match vocab.token(t) {
            Some(Token::Pitch(p)) => Some(p),
            _ => None,
        })
        .collect()
}

/// Statistics of a continuation of `bars` bars against the prompt's scale.
pub fn continuation_stats(pitches: &[u8], scale: u16, bars: usize) -> ContinuationStats {
    let n = pitches.len();
    if n == 0 {
        return ContinuationStats::default();
    }
    let inside = pitches
        .iter()
        .filter(|&&p| scale & (1 << (p % 12)) != 0)
        .count();
    let repeats = pitches.windows(2).filter(|w| w[0] == w[1]).count();
    let lo = *pitches.iter().min().expect("non-empty");
    let hi = *pitches.iter().max().expect("non-empty");
    ContinuationStats {
        in_scale: inside as f64 / n as f64,
        notes_per_bar: n as f64 / bars.max(1) as f64,
        pitch_range: (hi - lo) as f64,
        repeat_share: if n > 1 {
            repeats as f64 / (n - 1) as f64
        } else {
            0.0
        },
        notes: n,
    }
}

/// Splits a piece (BOS, body, EOS) into the prompt (BOS and its first
/// `prompt_bars` bars) and the tokens of the next `bars` bars; `None` when
/// the piece is too short for both or the prompt has no pitched note.
pub fn split_piece(ids: &[u32], prompt_bars: usize, bars: usize) -> Option<(Vec<u32>, Vec<u32>)> {
    let body: Vec<u32> = ids
        .iter()
        .copied()
        .filter(|&t| t != BOS_ID && t != EOS_ID)
        .collect();
    let bar_starts: Vec<usize> = body
        .iter()
        .enumerate()
        .filter(|(_, &t)| t == BAR_ID)
        .map(|(i, _)| i)
        .collect();
    if bar_starts.len() < prompt_bars + bars + 1 {
        return None; // the continuation's last bar must be complete
    }
    let cut = bar_starts[prompt_bars];
    let end = bar_starts[prompt_bars + bars];
    let mut prompt = vec![BOS_ID];
    prompt.extend_from_slice(&body[..cut]);
    Some((prompt, body[cut..end].to_vec()))
}

/// Generates a continuation for each piece and compares it with the real one.
/// Pieces too short, or whose prompt has no pitched note, are skipped.
pub fn evaluate(
    model: &Transformer,
    vocab: &Vocab,
    pieces: &[Vec<u32>],
    prompt_bars: usize,
    bars: usize,
    base: &SampleConfig,
    mut progress: impl FnMut(usize, usize),
) -> anyhow::Result<ContinuationReport> {
    let mut real = Vec::new();
    let mut gen = Vec::new();
    let usable: Vec<(Vec<u32>, Vec<u32>)> = pieces
        .iter()
        .filter_map(|p| split_piece(p, prompt_bars, bars))
        .filter(|(prompt, _)| !pitches(prompt, vocab).is_empty())
        .collect();
    for (i, (prompt, cont)) in usable.iter().enumerate() {
        let mut hist = [0u32; 12];
        for p in pitches(prompt, vocab) {
            hist[(p % 12) as usize] += 1;
        }
        let scale = key_scale(&hist);
        // Enough tokens for the bars at several times the real density.
        let cfg = SampleConfig {
            max_tokens: (cont.len() * 4).max(256),
            max_bars: Some(prompt_bars + bars),
            seed: base.seed.wrapping_add(i as u64),
            ..base.clone()
        };
        let s = sample::generate(model, vocab, prompt, 1, &cfg, &mut |_| {})?;
        let made = &s[0].tokens[s[0].prompt_len..];
        real.push(continuation_stats(&pitches(cont, vocab), scale, bars));
        gen.push(continuation_stats(&pitches(made, vocab), scale, bars));
        progress(i + 1, usable.len());
    }
    if real.is_empty() {
        anyhow::bail!(
            "no piece has {} bars with notes in its first {prompt_bars}",
            prompt_bars + bars
        );
    }
    let (r, g) = (mean(&real), mean(&gen));
    let div = |a: f64, b: f64| if b > 0.0 { a / b } else { f64::NAN };
    Ok(ContinuationReport {
        pieces: real.len(),
        prompt_bars,
        bars,
        real: r,
        generated: g,
        ratio: ContinuationStats {
            in_scale: div(g.in_scale, r.in_scale),
            notes_per_bar: div(g.notes_per_bar, r.notes_per_bar),
            pitch_range: div(g.pitch_range, r.pitch_range),
            repeat_share: div(g.repeat_share, r.repeat_share),
            notes: 0,
        },
    })
}

fn mean(s: &[ContinuationStats]) -> ContinuationStats {
    let n = s.len().max(1) as f64;
    let sum = |f: fn(&ContinuationStats) -> f64| s.iter().map(f).sum::<f64>() / n;
    ContinuationStats {
        in_scale: sum(|x| x.in_scale),
        notes_per_bar: sum(|x| x.notes_per_bar),
        pitch_range: sum(|x| x.pitch_range),
        repeat_share: sum(|x| x.repeat_share),
        notes: s.iter().map(|x| x.notes).sum(),
    }
}

/// A markdown table of a report.
pub fn markdown(r: &ContinuationReport) -> String {
    let row = |name: &str, f: fn(&ContinuationStats) -> f64| {
        format!(
            "| {name} | {:.3} | {:.3} | {:.2}x |\n",
            f(&r.generated),
            f(&r.real),
            f(&r.ratio)
        )
    };
    let mut out = format!(
        "{} pieces, prompt {} bars, continuation {} bars\n\n\
         | statistic | generated | real | ratio |\n| --- | ---: | ---: | ---: |\n",
        r.pieces, r.prompt_bars, r.bars
    );
    out.push_str(&row("in-scale share", |x| x.in_scale));
    out.push_str(&row("notes per bar", |x| x.notes_per_bar));
    out.push_str(&row("pitch range", |x| x.pitch_range));
    out.push_str(&row("repeat share", |x| x.repeat_share));
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tokenizer::RemiConfig;

    #[test]
    fn key_of_a_c_major_and_a_d_major_tune() {
        let mut h = [0u32; 12];
        for pc in [0, 2, 4, 5, 7, 9, 11, 0, 4, 7] {
            h[pc] += 1;
        }
        let c_major = MAJOR.iter().fold(0u16, |m, &d| m | 1 << d);
        assert_eq!(key_scale(&h), c_major);
        // A D-major tune with one chromatic passing note: D major (F#, C#)
        let mut h = [0u32; 12];
        for pc in [2, 4, 6, 7, 9, 11, 1, 2, 6, 9, 3] {
            h[pc] += 1;
        }
        let d_major = MAJOR.iter().fold(0u16, |m, &d| m | 1 << ((2 + d) % 12));
        assert_eq!(key_scale(&h), d_major);
        assert_ne!(d_major, c_major);
    }

    #[test]
    fn stats_of_a_continuation() {
        let c_major = MAJOR.iter().fold(0u16, |m, &d| m | 1 << d);
        let s = continuation_stats(&[60, 60, 62, 61, 72], c_major, 2);
        assert!((s.in_scale - 0.8).abs() < 1e-12);
        assert_eq!(s.notes_per_bar, 2.5);
        assert_eq!(s.pitch_range, 12.0);
        assert!((s.repeat_share - 0.25).abs() < 1e-12);
        assert_eq!(
            continuation_stats(&[], c_major, 2),
            ContinuationStats::default()
        );
    }

    #[test]
    fn split_keeps_whole_bars() {
        let v = Vocab::new(RemiConfig::default()).unwrap();
        let p = |x: u8| v.id(Token::Pitch(x)).unwrap();
        let mut ids = vec![BOS_ID];
        for b in 0..6u8 {
            ids.extend([BAR_ID, p(60 + b)]);
        }
        ids.push(EOS_ID);
        let (prompt, cont) = split_piece(&ids, 2, 3).unwrap();
        assert_eq!(prompt, vec![BOS_ID, BAR_ID, p(60), BAR_ID, p(61)]);
        assert_eq!(cont, vec![BAR_ID, p(62), BAR_ID, p(63), BAR_ID, p(64)]);
        assert!(
            split_piece(&ids, 2, 4).is_none(),
            "the last bar must be complete"
        );
    }
}
