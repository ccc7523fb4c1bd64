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
//!
//! When `bars >= prompt_bars` (= P), the report also gives the strain
//! return (module [`form`](super::form)) of both continuations: the
//! similarity of the continued bars P+1..2P to the prompt's bars 1..P, its
//! mean over the pieces where it is defined and the share of those pieces
//! at >= 0.5. A continuation that stops before bar 2P has none.

use serde::{Deserialize, Serialize};

use super::form;
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
    /// The strain return of both continuations; present when `bars` is at
    /// least `prompt_bars`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub strain_return: Option<StrainComparison>,
}

/// Strain return over a set of continuations.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct StrainStats {
    /// Mean strain return over the pieces where it is defined (null: none).
    pub mean: Option<f64>,
    /// Share of those pieces whose strain return is >= 0.5 (null: none).
    pub share: Option<f64>,
    /// Pieces where it is defined.
    pub pieces: usize,
}

/// The strain return of the model's continuations next to the real ones'.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct StrainComparison {
    /// P: the prompt's bars, compared with the continued bars P+1..2P.
    pub strain_bars: usize,
    pub real: StrainStats,
    pub generated: StrainStats,
    /// generated mean / real mean (null when either is undefined or the
    /// real mean is 0).
    pub ratio: Option<f64>,
}

/// Mean and share >= [`form::NEAR_COPY`] of the defined strain returns.
pub fn strain_stats(values: &[Option<f64>]) -> StrainStats {
    let v: Vec<f64> = values.iter().flatten().copied().collect();
    if v.is_empty() {
        return StrainStats::default();
    }
    let n = v.len() as f64;
    StrainStats {
        mean: Some(v.iter().sum::<f64>() / n),
        share: Some(v.iter().filter(|&&x| x >= form::NEAR_COPY).count() as f64 / n),
        pieces: v.len(),
    }
}

/// Compares the strain returns of generated and real continuations.
pub fn strain_comparison(
    p: usize,
    real: &[Option<f64>],
    generated: &[Option<f64>],
) -> StrainComparison {
    let (r, g) = (strain_stats(real), strain_stats(generated));
    StrainComparison {
        strain_bars: p,
        real: r,
        generated: g,
        ratio: match (g.mean, r.mean) {
            (Some(g), Some(r)) if r > 0.0 => Some(g / r),
            _ => None,
        },
    }
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
    // Strain returns (bars P+1..2P against 1..P), when the continuation is
    // long enough to hold bars P+1..2P.
    let strain = bars >= prompt_bars;
    let (mut real_strain, mut gen_strain) = (Vec::new(), Vec::new());
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
        if strain {
            let whole: Vec<u32> = prompt.iter().chain(cont).copied().collect();
            real_strain.push(form::strain_return(&form::bars(&whole, vocab), prompt_bars));
            gen_strain.push(form::strain_return(
                &form::bars(&s[0].tokens, vocab),
                prompt_bars,
            ));
        }
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
        strain_return: strain.then(|| strain_comparison(prompt_bars, &real_strain, &gen_strain)),
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
    if let Some(st) = &r.strain_return {
        let p = st.strain_bars;
        let ratio = st.ratio.map_or("-".to_string(), |x| format!("{x:.2}x"));
        out.push_str(&format!(
            "| strain return (bars {}-{} vs 1-{p}) | {} | {} | {ratio} |\n",
            p + 1,
            2 * p,
            form::cell(st.generated.mean),
            form::cell(st.real.mean),
        ));
        out.push_str(&format!(
            "| share with strain return >= {} | {} | {} | |\n",
            form::NEAR_COPY,
            form::cell(st.generated.share),
            form::cell(st.real.share),
        ));
        out.push_str(&format!(
            "\nstrain return defined for {} generated and {} real continuations\n",
            st.generated.pieces, st.real.pieces
        ));
    }
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
    fn strain_return_of_continuations() {
        let c = strain_comparison(8, &[Some(1.0), Some(0.2), None], &[Some(0.1), None, None]);
        assert_eq!(c.real.pieces, 2);
        assert!((c.real.mean.unwrap() - 0.6).abs() < 1e-12);
        assert_eq!(c.real.share, Some(0.5));
        assert_eq!(c.generated.share, Some(0.0));
        assert!((c.ratio.unwrap() - 0.1 / 0.6).abs() < 1e-12);
        let none = strain_comparison(8, &[None], &[Some(0.3)]);
        assert_eq!(none.real, StrainStats::default());
        assert_eq!(none.ratio, None);
        let r = ContinuationReport {
            pieces: 3,
            prompt_bars: 8,
            bars: 8,
            real: ContinuationStats::default(),
            generated: ContinuationStats::default(),
            ratio: ContinuationStats::default(),
            strain_return: Some(c),
        };
        let md = markdown(&r);
        assert!(
            md.contains("| strain return (bars 9-16 vs 1-8) | 0.100 | 0.600 | 0.17x |"),
            "{md}"
        );
        assert!(
            md.contains("| share with strain return >= 0.5 | 0.000 | 0.500 | |"),
            "{md}"
        );
        let j = serde_json::to_value(&r).unwrap();
        assert_eq!(j["strain_return"]["real"]["pieces"], 2);
        assert!(j["in_scale"].is_null() && j["real"]["in_scale"].is_number());
        let without = ContinuationReport {
            strain_return: None,
            ..r
        };
        assert!(!markdown(&without).contains("strain"));
        assert!(serde_json::to_value(&without)
            .unwrap()
            .get("strain_return")
            .is_none());
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
