//! What a model has learned, measured per token type on real pieces.
//!
//! A single validation loss hides what matters for music: structural tokens
//! (Bar, Position, Duration) are easy and dominate the mean, while a model
//! that does not use its context for pitch can still reach a decent loss.
//! This module breaks the next-token metrics down by the type of the token
//! predicted, and measures how much probability the model puts, when it
//! predicts a pitch, on the pitch classes heard in the last few bars.
//!
//! Definitions (the reference scripts in `scripts/reference/` compute the
//! same ones, so their numbers are comparable):
//! * targets are `ids[t + 1]` for inputs `ids[..=t]`; PAD targets are ignored;
//! * `by_type.<T>`: mean NLL (nats), top-1 accuracy (arg max over the whole
//!   vocabulary) and count of the targets of type `T`;
//! * `pitch_context`: over `Pitch` targets whose context is not empty, the
//!   context being the pitch classes of the `Pitch` tokens of the current bar
//!   and the [`CONTEXT_BARS`] bars before it, up to the input position:
//!   `model_mass` = mean of P(pitch class in context) / P(any pitch), and
//!   `true_share` = share of true pitches whose class is in the context.
//!   A model that uses its context has `model_mass` close to `true_share`;
//!   one that ignores it stays near the share of those classes among all
//!   pitches (about 0.5-0.6 for tonal music).
//!
//! Invariants: every metric is a mean over counted targets, so the reports
//! of several windows combine by weighting with `count`.

pub mod continuation;
pub mod form;
pub mod stats;

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use tch::{Kind, Tensor};

use crate::model::Transformer;
use crate::tokenizer::{Token, TokenType, Vocab, BAR_ID, PAD_ID};

/// Bars before the current one whose pitches form the context.
pub const CONTEXT_BARS: usize = 4;

/// Mean NLL, top-1 accuracy and count of one token type.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct TypeMetrics {
    pub nll: f64,
    pub top1: f64,
    pub count: u64,
}

/// Probability the model gives to the pitch classes of the context, next to
/// the share of true pitches that are in it.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct PitchContext {
    pub model_mass: f64,
    pub true_share: f64,
    pub count: u64,
}

/// Next-token metrics over a set of windows.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TokenMetrics {
    /// Mean NLL over every non-PAD target.
    pub loss: f64,
    pub tokens: u64,
    pub by_type: BTreeMap<String, TypeMetrics>,
    pub pitch_context: PitchContext,
}

/// Running sums behind [`TokenMetrics`].
#[derive(Debug, Clone, Default)]
pub struct Accumulator {
    nll: f64,
    tokens: u64,
    /// type -> (nll sum, top-1 hits, count)
    types: BTreeMap<TokenType, (f64, u64, u64)>,
    mass: f64,
    true_in: u64,
    ctx: u64,
}

/// One scored target.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Scored {
    pub kind: TokenType,
    pub nll: f64,
    pub top1: bool,
    /// For a Pitch target with a non-empty context: (model mass on the
    /// context's classes, whether the true pitch class is in the context).
    pub context: Option<(f64, bool)>,
}

impl Accumulator {
    pub fn add(&mut self, s: &Scored) {
        self.nll += s.nll;
        self.tokens += 1;
        let e = self.types.entry(s.kind).or_default();
        e.0 += s.nll;
        e.1 += s.top1 as u64;
        e.2 += 1;
        if let Some((mass, inside)) = s.context {
            self.mass += mass;
            self.true_in += inside as u64;
            self.ctx += 1;
        }
    }

    pub fn merge(&mut self, o: &Accumulator) {
        self.nll += o.nll;
        self.tokens += o.tokens;
        for (k, v) in &o.types {
            let e = self.types.entry(*k).or_default();
            e.0 += v.0;
            e.1 += v.1;
            e.2 += v.2;
        }
        self.mass += o.mass;
        self.true_in += o.true_in;
        self.ctx += o.ctx;
    }

    pub fn finish(&self) -> TokenMetrics {
        let div = |a: f64, n: u64| if n > 0 { a / n as f64 } else { f64::NAN };
        TokenMetrics {
            loss: div(self.nll, self.tokens),
            tokens: self.tokens,
            by_type: self
                .types
                .iter()
                .map(|(k, &(nll, hits, n))| {
                    (
                        k.to_string(),
                        TypeMetrics {
                            nll: div(nll, n),
                            top1: div(hits as f64, n),
                            count: n,
                        },
                    )
                })
                .collect(),
            pitch_context: PitchContext {
                model_mass: div(self.mass, self.ctx),
                true_share: div(self.true_in as f64, self.ctx),
                count: self.ctx,
            },
        }
    }
}

/// Pitch class of a (non-drum) Pitch token.
pub fn pitch_class(vocab: &Vocab, id: u32) -> Option<u8> {
    match vocab.token(id) {
        Some(Token::Pitch(p)) => Some(p % 12),
        _ => None,
    }
}

/// For every position t of `ids`: the 12-bit mask of the pitch classes of
/// the Pitch tokens at positions <= t in the current bar and the `bars` bars
/// before it (bars are delimited by Bar tokens; before the first Bar the
/// window's start counts as the start of a bar).
pub fn context_masks(ids: &[u32], vocab: &Vocab, bars: usize) -> Vec<u16> {
    // (bar index, mask) of the notes so far, per bar
    let mut per_bar: Vec<u16> = vec![0];
    let mut out = Vec::with_capacity(ids.len());
    for &id in ids {
        if id == BAR_ID {
            per_bar.push(0);
        } else if let Some(pc) = pitch_class(vocab, id) {
            *per_bar.last_mut().expect("one bar") |= 1 << pc;
        }
        let from = per_bar.len().saturating_sub(bars + 1);
        out.push(per_bar[from..].iter().fold(0, |a, &m| a | m));
    }
    out
}

/// Per-pitch-token class table and Pitch id range, for the mass computation.
pub struct PitchTable {
    start: i64,
    /// (P,) int64: class of each Pitch id.
    classes: Tensor,
}

impl PitchTable {
    pub fn new(vocab: &Vocab) -> PitchTable {
        let r = vocab.range(TokenType::Pitch);
        let classes: Vec<i64> = r
            .clone()
            .map(|id| pitch_class(vocab, id).expect("pitch id") as i64)
            .collect();
        PitchTable {
            start: r.start as i64,
            classes: Tensor::from_slice(&classes),
        }
    }
}

/// Scores every target of one window (ids of length n >= 2, no PAD inside
/// except at the end) with the model's frozen noise: one forward pass.
pub fn score_window(
    model: &Transformer,
    vocab: &Vocab,
    table: &PitchTable,
    ids: &[u32],
) -> Vec<Scored> {
    let n = ids.iter().rposition(|&t| t != PAD_ID).map_or(0, |i| i + 1);
    if n < 2 {
        return Vec::new();
    }
    let ids = &ids[..n];
    let masks = context_masks(ids, vocab, CONTEXT_BARS);
    tch::no_grad(|| {
        let device = model.device();
        let x: Vec<i64> = ids.iter().map(|&t| t as i64).collect();
        let t = Tensor::from_slice(&x).view([1, -1]).to_device(device);
        let n = n as i64;
        let logits = model
            .forward_t(&t.narrow(1, 0, n - 1), 0, false)
            .squeeze_dim(0)
            .to_kind(Kind::Float)
            .to_device(tch::Device::Cpu); // (n-1, V)
        let logp = logits.log_softmax(-1, Kind::Float);
        let target = t
            .narrow(1, 1, n - 1)
            .squeeze_dim(0)
            .to_device(tch::Device::Cpu);
        let nll = -logp
            .gather(-1, &target.unsqueeze(-1), false)
            .squeeze_dim(-1);
        let top1 = logp.argmax(-1, false).eq_tensor(&target);
        // P over pitch ids, renormalized, and the context's share of it
        let pcount = table.classes.size()[0];
        let pp = logp.narrow(-1, table.start, pcount).exp(); // (n-1, P)
        let m: Vec<i64> = masks[..n as usize - 1].iter().map(|&m| m as i64).collect();
        let m = Tensor::from_slice(&m).unsqueeze(-1); // (n-1, 1)
        let inside = m
            .bitwise_right_shift(&table.classes.unsqueeze(0))
            .bitwise_and(1)
            .to_kind(Kind::Float); // (n-1, P)

        // The pitch total is clamped: a model sure of a non-pitch token can underflow it.
        let mass = (&pp * inside).sum_dim_intlist([-1i64].as_slice(), false, None)
            / pp.sum_dim_intlist([-1i64].as_slice(), false, None)
                .clamp_min(1e-30);
        let nll = Vec::<f32>::try_from(nll).unwrap_or_default();
        let top1 = Vec::<bool>::try_from(top1).unwrap_or_default();
        let mass = Vec::<f32>::try_from(mass).unwrap_or_default();
        (0..(n as usize - 1))
            .filter(|&i| ids[i + 1] != PAD_ID)
            .map(|i| {
                let target = ids[i + 1];
                let kind = vocab.kind(target).unwrap_or(TokenType::Pad);
                let context = match pitch_class(vocab, target) {
                    Some(pc) if masks[i] != 0 => Some((mass[i] as f64, masks[i] & (1 << pc) != 0)),
                    _ => None,
                };
                Scored {
                    kind,
                    nll: nll[i] as f64,
                    top1: top1[i],
                    context,
                }
            })
            .collect()
    })
}

/// NLL of the tokens at indices `at` of every window, each token scored from the tokens
/// before it in its window: `out[b][i]` is the NLL of `windows[b][at[i]]` given
/// `windows[b][..at[i]]`. Every window of one call has the same length, begins at absolute
/// position `offset` and is one row of a single batched forward with the frozen noise;
/// every index in `at` is at least 1 and below the length. One forward thus scores many
/// positions of a window, each with its own amount of past (the context gain's blocks):
/// this is the "only the last C tokens" half of the context gain, the window starting at
/// its absolute offset so that relative position codes see the lags of the full pass.
pub fn window_nll(
    model: &Transformer,
    windows: &[&[u32]],
    at: &[usize],
    offset: usize,
    bars: Option<&[i64]>,
) -> Vec<Vec<f64>> {
    let Some(n) = windows.first().map(|w| w.len()) else {
        return Vec::new();
    };
    assert!(
        windows.iter().all(|w| w.len() == n),
        "windows of one length"
    );
    assert!(
        at.iter().all(|&i| i >= 1 && i < n),
        "scored indices within 1..{n}"
    );
    if at.is_empty() {
        return vec![Vec::new(); windows.len()];
    }
    tch::no_grad(|| {
        // the input is the window without its last token, whose logits score nothing
        let x: Vec<i64> = windows
            .iter()
            .flat_map(|w| w[..n - 1].iter().map(|&t| t as i64))
            .collect();
        let x = Tensor::from_slice(&x)
            .view([windows.len() as i64, n as i64 - 1])
            .to_device(model.device());
        // the logits at index i - 1 predict token i
        let rows: Vec<i64> = at.iter().map(|&i| i as i64 - 1).collect();
        let logits = model
            .forward_from(&x, offset as i64, false, bars)
            .index_select(1, &Tensor::from_slice(&rows).to_device(model.device()))
            .to_kind(Kind::Float)
            .to_device(tch::Device::Cpu); // (B, |at|, V)
        let logp = logits.log_softmax(-1, Kind::Float);
        let t: Vec<i64> = windows
            .iter()
            .flat_map(|w| at.iter().map(|&i| w[i] as i64))
            .collect();
        let t = Tensor::from_slice(&t).view([windows.len() as i64, at.len() as i64, 1]);
        let nll = -logp.gather(-1, &t, false).squeeze_dim(-1); // (B, |at|)
        let flat = Vec::<f32>::try_from(nll.reshape([-1])).unwrap_or_default();
        flat.chunks(at.len())
            .map(|row| row.iter().map(|&v| f64::from(v)).collect())
            .collect()
    })
}

/// The absolute position of each target [`score_window`] scores, in its order: the
/// positions t >= 1 of `ids` whose token is not PAD.
pub fn scored_positions(ids: &[u32]) -> Vec<usize> {
    (1..ids.len()).filter(|&t| ids[t] != PAD_ID).collect()
}

/// First component of a piece's source path: the collection it came from
/// ("folk", "classical", ...), or "." for a bare file name.
pub fn source_group(source: &str) -> String {
    let mut parts = source.split(['/', '\\']).filter(|s| !s.is_empty());
    match (parts.next(), parts.next()) {
        (Some(first), Some(_)) => first.to_string(),
        _ => ".".to_string(),
    }
}

/// Metrics over all windows and per source group.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct GroupedMetrics {
    #[serde(flatten)]
    pub all: TokenMetrics,
    pub by_source: BTreeMap<String, TokenMetrics>,
}

impl GroupedMetrics {
    /// Combines per-group sums into the overall and per-group metrics.
    pub fn from_groups(groups: &BTreeMap<String, Accumulator>) -> GroupedMetrics {
        let mut all = Accumulator::default();
        for a in groups.values() {
            all.merge(a);
        }
        GroupedMetrics {
            all: all.finish(),
            by_source: groups
                .iter()
                .map(|(k, a)| (k.clone(), a.finish()))
                .collect(),
        }
    }
}

/// A markdown table of the per-type metrics (one row per type).
pub fn type_table(m: &TokenMetrics) -> String {
    let mut out = String::from("| type | NLL | top-1 | count |\n| --- | ---: | ---: | ---: |\n");
    for (k, t) in &m.by_type {
        out.push_str(&format!(
            "| {k} | {:.3} | {:.1}% | {} |\n",
            t.nll,
            t.top1 * 100.0,
            t.count
        ));
    }
    out.push_str(&format!(
        "\npitch context: model mass {:.3}, true share {:.3} ({} pitches)\n",
        m.pitch_context.model_mass, m.pitch_context.true_share, m.pitch_context.count
    ));
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tokenizer::RemiConfig;

    fn vocab() -> Vocab {
        Vocab::new(RemiConfig::default()).unwrap()
    }

    #[test]
    fn context_covers_current_and_previous_bars_only() {
        let v = vocab();
        let p = |x: u8| v.id(Token::Pitch(x)).unwrap();
        // bar 0: C; bar 1: D; ... bar 5: A; then the C of bar 0 is 5 bars back
        let mut ids = vec![1u32];
        for pitch in [60u8, 62, 64, 65, 67, 69] {
            ids.push(BAR_ID);
            ids.push(p(pitch));
        }
        let m = context_masks(&ids, &v, 4);
        assert_eq!(m[0], 0);
        assert_eq!(m[2], 1 << 0); // after C
        let bit = |pc: u8| 1u16 << pc;
        // last position: bars with E F G A and D (4 before the current) but not C
        let want = bit(2) | bit(4) | bit(5) | bit(7) | bit(9);
        assert_eq!(*m.last().unwrap(), want);
        // the Bar token itself starts a bar without notes yet
        assert_eq!(m[ids.len() - 2] & bit(9), 0);
    }

    #[test]
    fn drums_are_not_pitch_context() {
        let v = vocab();
        let ids = vec![1, BAR_ID, v.id(Token::PitchDrum(36)).unwrap()];
        assert_eq!(context_masks(&ids, &v, 4), vec![0, 0, 0]);
        assert_eq!(pitch_class(&v, v.id(Token::Pitch(61)).unwrap()), Some(1));
    }

    #[test]
    fn accumulator_means_and_merge() {
        let mut a = Accumulator::default();
        let s = |kind, nll, top1, context| Scored {
            kind,
            nll,
            top1,
            context,
        };
        a.add(&s(TokenType::Pitch, 2.0, true, Some((0.8, true))));
        a.add(&s(TokenType::Pitch, 4.0, false, Some((0.4, false))));
        let mut b = Accumulator::default();
        b.add(&s(TokenType::Bar, 0.0, true, None));
        a.merge(&b);
        let m = a.finish();
        assert_eq!(m.tokens, 3);
        assert!((m.loss - 2.0).abs() < 1e-12);
        let p = m.by_type["Pitch"];
        assert_eq!((p.count, p.top1, p.nll), (2, 0.5, 3.0));
        assert!((m.pitch_context.model_mass - 0.6).abs() < 1e-12);
        assert_eq!(m.pitch_context.true_share, 0.5);
        assert_eq!(m.by_type["Bar"].count, 1);
    }

    #[test]
    fn source_groups() {
        assert_eq!(source_group("folk/essen/a.mid"), "folk");
        assert_eq!(source_group("a.mid"), ".");
    }
}
