//! Per-position negative log-likelihood on held-out pieces: the measurement
//! behind SPE's claim that a model keeps working beyond its training length.
//!
//! Two optional measurements ride on the same pass:
//! * **Context gain** ([`ContextGain`], `--context-cut C`): positions p = from,
//!   from + stride, ... (p <= `max_len`) of every piece long enough are scored with
//!   the whole past (the ordinary forward over the piece from its start) and with
//!   only the last C tokens (tokens p-C..p-1 as a fresh window at absolute offset
//!   p-C, whose last logits score token p). Both figures are means over exactly
//!   the same positions, so they are paired; cut windows are batched only with
//!   windows of the same offset (the same p in other pieces), so every window sees
//!   the absolute positions, and hence the lags, of the full pass. With C >= p the
//!   cut window is the whole past and the two figures agree (up to float sums).
//! * **Ablation** ([`Ablation`], `--ablate favor|local`): after loading, the input
//!   columns of every layer's `layers.{i}.attn_out.weight` that read the FAVOR+
//!   (or the local) heads are zeroed. The heads are concatenated in head order
//!   before that projection, local heads 0..local_heads first, each `head_dim`
//!   wide, so head h owns columns h*head_dim..(h+1)*head_dim.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use serde::{Deserialize, Serialize};
use tch::nn::VarStore;

use super::checkpoint::{self, LoadedModel};
use super::data;
use crate::eval::GroupedMetrics;
use crate::tokenizer::dataset::Dataset;

#[derive(Debug, Clone)]
pub struct EvalOptions {
    pub model_dir: PathBuf,
    /// A dataset, or MIDI files and folders, to evaluate on (default: the
    /// run's own held-out pieces).
    pub data: Vec<PathBuf>,
    /// Positions to score (default: twice the training length).
    pub max_len: Option<usize>,
    pub bin: usize,
    /// Only pieces at least this long (default: none).
    pub min_len: usize,
    /// At most this many pieces, spread evenly over the list (0 = all).
    pub max_pieces: usize,
    pub device: Option<String>,
    pub seed: u64,
    /// libtorch CPU threads (0 = all cores).
    pub threads: usize,
    /// Precision of the dense products (`auto` resolved for the device).
    pub precision: crate::model::Precision,
}

/// What [`evaluate_probed`] measures beyond [`evaluate`]: the context gain and an
/// ablation (the default: neither).
#[derive(Debug, Clone, PartialEq)]
pub struct Probes {
    /// Context gain: the cuts C (empty: not measured) ...
    pub context_cut: Vec<usize>,
    /// ... from this position on (default: [`default_context_from`]) ...
    pub context_from: Option<usize>,
    /// ... every this many positions ...
    pub context_stride: usize,
    /// ... this many scored positions per cut window (1: every cut exactly C tokens).
    pub context_block: usize,
    /// Heads whose output is zeroed before scoring (none: the model as it is).
    pub ablate: Option<Ablation>,
}

impl Default for Probes {
    fn default() -> Self {
        Probes {
            context_cut: Vec::new(),
            context_from: None,
            context_stride: DEFAULT_CONTEXT_STRIDE,
            context_block: 1,
            ablate: None,
        }
    }
}

fn one() -> usize {
    1
}

/// Default `--context-stride`.
pub const DEFAULT_CONTEXT_STRIDE: usize = 16;

/// Cut windows per forward call (at most; fewer when fewer pieces reach a position).
pub const CUT_BATCH: usize = 16;

/// Most `--context-cut` values in one run (each costs a forward of C tokens per position).
pub const MAX_CUTS: usize = 16;

/// Default first scored position of the context gain: twice the largest cut, at least 1,024.
pub fn default_context_from(cuts: &[usize]) -> usize {
    (2 * cuts.iter().copied().max().unwrap_or(0)).max(1024)
}

/// The heads an ablation silences.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum Ablation {
    /// The FAVOR+ heads (heads local_heads..n_heads).
    Favor,
    /// The local softmax heads (heads 0..local_heads).
    Local,
}

impl Ablation {
    /// The name used on the command line and in the report.
    pub fn name(self) -> &'static str {
        match self {
            Ablation::Favor => "favor",
            Ablation::Local => "local",
        }
    }

    /// The heads `start..end` this ablation zeroes in a model of `cfg`, refused (naming
    /// `what`, the model) where the model has none of them or nothing else would be left.
    pub fn heads(self, cfg: &crate::model::ModelConfig, what: &str) -> Result<(i64, i64)> {
        let (hl, h) = (cfg.local_heads, cfg.n_heads);
        let favor = matches!(
            cfg.attention,
            crate::model::config::AttentionKind::Favor { .. }
        );
        match self {
            Ablation::Favor if !favor => bail!(
                "--ablate favor: {what} has no FAVOR+ heads (its global heads are exact softmax)"
            ),
            Ablation::Favor if hl == h => {
                bail!("--ablate favor: {what} has no FAVOR+ heads (all {h} heads are local)")
            }
            Ablation::Favor if hl == 0 => bail!(
                "--ablate favor: {what} has no local heads, so zeroing its FAVOR+ heads would \
                 zero the whole attention output"
            ),
            Ablation::Favor => Ok((hl, h)),
            Ablation::Local if hl == 0 => bail!("--ablate local: {what} has no local heads"),
            Ablation::Local if hl == h => bail!(
                "--ablate local: all {h} heads of {what} are local, so zeroing them would zero \
                 the whole attention output"
            ),
            Ablation::Local => Ok((0, hl)),
        }
    }
}

/// Zeroes, in every layer, the input columns of `layers.{i}.attn_out.weight` that read
/// the heads of `ablation` (see the module docs for the layout). Returns the number of
/// weights zeroed.
pub fn ablate(
    vs: &VarStore,
    cfg: &crate::model::ModelConfig,
    ablation: Ablation,
    what: &str,
) -> Result<usize> {
    let (start, end) = ablation.heads(cfg, what)?;
    let (d, hd) = (cfg.d_model, cfg.head_dim());
    let vars = vs.variables();
    let mut zeroed = 0;
    for i in 0..cfg.n_layers {
        let name = format!("layers.{i}.attn_out.weight");
        let w = vars
            .get(&name)
            .with_context(|| format!("--ablate: {what} has no variable {name}"))?;
        if w.size() != [d, d] {
            bail!("--ablate: {what}: {name} is {:?}, not ({d}, {d})", w.size());
        }
        let cols = (end - start) * hd;
        tch::no_grad(|| {
            let _ = w.narrow(1, start * hd, cols).zero_();
        });
        zeroed += (d * cols) as usize;
    }
    Ok(zeroed)
}

/// Mean NLL with the whole past and with each cut, over one set of positions.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct GainFigures {
    /// Positions scored.
    pub positions: u64,
    /// Mean NLL with the whole past.
    pub full: f64,
    /// Mean NLL with only the last C tokens, keyed by C.
    pub cut: BTreeMap<String, f64>,
}

/// The context gain (see the module docs): overall, per token type of the target and per
/// source group.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ContextGain {
    /// First scored position.
    pub from: usize,
    /// Distance between scored positions.
    pub stride: usize,
    /// Scored positions per cut window: the j-th of a block sees the last C + j * stride
    /// tokens (1: every cut exactly C; reports written before this field read 1).
    #[serde(default = "one")]
    pub block: usize,
    /// Positions scored over all pieces.
    pub positions: u64,
    /// Pieces with at least one scored position.
    pub pieces: usize,
    /// Mean NLL with the whole past.
    pub full: f64,
    /// Mean NLL with only the last C tokens, keyed by C.
    pub cut: BTreeMap<String, f64>,
    /// cut / full, keyed by C (above 1: the tokens beyond C back help).
    pub ratio: BTreeMap<String, f64>,
    /// The same per type of the target token.
    pub by_type: BTreeMap<String, GainFigures>,
    /// The same per source group.
    pub by_source: BTreeMap<String, GainFigures>,
    /// The same by where the nearest verbatim copy of the target's bar begins
    /// ([`crate::eval::form::bar_copy_distances`]), in bands of distance d split at the
    /// cuts (see [`copy_bands`]): "copy <= C1 back", "copy C1+1-C2 back", ...,
    /// "copy > Ck back", and "fresh" (no earlier copy). A cut to C keeps the copies of
    /// the bands up to C and loses the others: where the past beyond C could be copied,
    /// the bands beyond C say whether the model does (absent in reports from before it).
    /// With `block` > 1 the j-th position of a block sees C + j * stride tokens, so a copy
    /// up to that much further back is still in its cut window. The last bar of a window
    /// is compared as far as the window reaches (a copy it would have further on is not
    /// seen).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub by_copy: BTreeMap<String, GainFigures>,
}

/// The labels of [`ContextGain::by_copy`]'s bands for sorted, distinct `cuts`: the copy
/// bands nearest first (distance d <= C1, C1 < d <= C2, ..., d > Ck; "copy C2 back" when
/// C2 = C1 + 1), then "fresh".
pub fn copy_bands(cuts: &[usize]) -> Vec<String> {
    let mut out = Vec::with_capacity(cuts.len() + 2);
    let mut low = 0;
    for &c in cuts {
        out.push(if low == 0 {
            format!("copy <= {c} back")
        } else if low + 1 == c {
            format!("copy {c} back")
        } else {
            format!("copy {}-{c} back", low + 1)
        });
        low = c;
    }
    if let Some(&last) = cuts.last() {
        out.push(format!("copy > {last} back"));
    }
    out.push("fresh".to_string());
    out
}

/// The index in [`copy_bands`]`(cuts)` of the band a copy `distance` back (None: no
/// copy) falls in.
fn copy_band(distance: Option<usize>, cuts: &[usize]) -> usize {
    match distance {
        None => cuts.len() + 1,
        Some(d) => cuts.iter().take_while(|&&c| d > c).count(),
    }
}

/// Running sums behind [`GainFigures`]: (full sum, per-cut sums, count).
#[derive(Debug, Clone, Default)]
struct GainSums {
    full: f64,
    cut: BTreeMap<usize, f64>,
    n: u64,
}

impl GainSums {
    fn add(&mut self, full: f64, cut: usize, nll: f64, first_cut: bool) {
        if first_cut {
            self.full += full;
            self.n += 1;
        }
        *self.cut.entry(cut).or_default() += nll;
    }

    fn finish(&self) -> GainFigures {
        let n = self.n.max(1) as f64;
        GainFigures {
            positions: self.n,
            full: self.full / n,
            cut: self
                .cut
                .iter()
                .map(|(c, s)| (c.to_string(), s / n))
                .collect(),
        }
    }
}

/// Refuses cuts, first position, stride and block that make no sense: a cut below 1 or
/// not below `from`, a stride or block below 1, more than [`MAX_CUTS`] cuts; returns the
/// sorted distinct cuts and `from`.
pub fn check_context(
    cuts: &[usize],
    from: Option<usize>,
    stride: usize,
    block: usize,
) -> Result<(Vec<usize>, usize)> {
    let set: BTreeSet<usize> = cuts.iter().copied().collect();
    if set.len() > MAX_CUTS {
        bail!("--context-cut: at most {MAX_CUTS} cuts (got {})", set.len());
    }
    if let Some(&c) = set.iter().find(|&&c| c < 1) {
        bail!("--context-cut {c}: a cut must be at least 1 token");
    }
    let from = from.unwrap_or_else(|| default_context_from(cuts));
    if let Some(&c) = set.iter().find(|&&c| c >= from) {
        bail!(
            "--context-cut {c}: a cut must be below the first scored position \
             (--context-from {from}), or it would not cut anything"
        );
    }
    if stride < 1 {
        bail!("--context-stride {stride}: must be at least 1");
    }
    if block < 1 {
        bail!("--context-block {block}: must be at least 1");
    }
    Ok((set.into_iter().collect(), from))
}

/// The bar index after `ids` ([`crate::model::clock::BarIndex`]): the bars begun
/// since the last `BOS`, or all of them.
fn bars_before(ids: &[u32]) -> i64 {
    let mut at = crate::model::clock::BarIndex(Some(0));
    for &id in ids {
        at.advance(id as i64, i64::MAX);
    }
    at.0.unwrap_or(0)
}

/// The context gain of `model` over `windows` (source, tokens from the piece's start),
/// `full[k][p]` being the NLL of token p of window k with the whole past (NaN where not
/// scored). Positions p = from, from + stride, ... below each window's length, taken in
/// blocks of `block` consecutive scored positions: cut C scores the block q_0, q_1, ... of
/// a piece in one fresh window from max(0, q_0 - C) at its absolute offset, so q_j sees
/// the last C + j * stride tokens (exactly C with `block` 1). `cuts` must be sorted,
/// distinct and >= 1; `stride` and `block` >= 1.
#[allow(clippy::too_many_arguments)]
pub fn context_gain(
    model: &crate::model::Transformer,
    vocab: &crate::tokenizer::Vocab,
    windows: &[(String, Vec<u32>)],
    full: &[Vec<f64>],
    cuts: &[usize],
    from: usize,
    stride: usize,
    block: usize,
) -> ContextGain {
    assert!(stride >= 1 && block >= 1 && cuts.iter().all(|&c| c >= 1));
    let longest = windows.iter().map(|(_, w)| w.len()).max().unwrap_or(0);
    let mut all = GainSums::default();
    let mut types: BTreeMap<String, GainSums> = BTreeMap::new();
    let mut sources: BTreeMap<String, GainSums> = BTreeMap::new();
    // per band of copy_bands(cuts), nearest first: each position's band, found once
    let mut copies = vec![GainSums::default(); cuts.len() + 2];
    let distances: Vec<Vec<Option<usize>>> = windows
        .iter()
        .map(|(_, w)| crate::eval::form::bar_copy_distances(w))
        .collect();
    let mut used = BTreeSet::new();
    let positions: Vec<usize> = (from.max(1)..longest).step_by(stride).collect();
    for chunk in positions.chunks(block) {
        // the pieces by how many of the block's positions they reach: one batch shape each
        let mut reach: BTreeMap<usize, Vec<usize>> = BTreeMap::new();
        for (k, (_, w)) in windows.iter().enumerate() {
            let m = chunk.iter().take_while(|&&p| p < w.len()).count();
            if m > 0 {
                reach.entry(m).or_default().push(k);
            }
        }
        for (&m, ks) in &reach {
            let block_at = &chunk[..m];
            let (first, last) = (block_at[0], block_at[m - 1]);
            for (ci, &c) in cuts.iter().enumerate() {
                let start = first.saturating_sub(c);
                let at: Vec<usize> = block_at.iter().map(|&p| p - start).collect();
                for batch in ks.chunks(CUT_BATCH) {
                    let ws: Vec<&[u32]> =
                        batch.iter().map(|&k| &windows[k].1[start..=last]).collect();
                    // the bar each cut window begins in, as the full pass knows it
                    let bars: Vec<i64> = batch
                        .iter()
                        .map(|&k| bars_before(&windows[k].1[..start]))
                        .collect();
                    let nll = crate::eval::window_nll(model, &ws, &at, start, Some(&bars));
                    for (&k, row) in batch.iter().zip(&nll) {
                        for (&p, &v) in block_at.iter().zip(row) {
                            let f = full[k][p];
                            if f.is_nan() {
                                continue; // not scored by the full pass (PAD)
                            }
                            let kind = vocab
                                .kind(windows[k].1[p])
                                .unwrap_or(crate::tokenizer::TokenType::Pad)
                                .to_string();
                            let first_cut = ci == 0;
                            all.add(f, c, v, first_cut);
                            types.entry(kind).or_default().add(f, c, v, first_cut);
                            sources
                                .entry(crate::eval::source_group(&windows[k].0))
                                .or_default()
                                .add(f, c, v, first_cut);
                            copies[copy_band(distances[k][p], cuts)].add(f, c, v, first_cut);
                            used.insert(k);
                        }
                    }
                }
            }
        }
    }
    let overall = all.finish();
    let ratio = overall
        .cut
        .iter()
        .map(|(c, v)| (c.clone(), v / overall.full))
        .collect();
    ContextGain {
        from,
        stride,
        block,
        positions: overall.positions,
        pieces: used.len(),
        full: overall.full,
        cut: overall.cut,
        ratio,
        by_type: types.iter().map(|(k, s)| (k.clone(), s.finish())).collect(),
        by_source: sources
            .iter()
            .map(|(k, s)| (k.clone(), s.finish()))
            .collect(),
        by_copy: copy_bands(cuts)
            .into_iter()
            .zip(&copies)
            .filter(|(_, s)| s.n > 0)
            .map(|(band, s)| (band, s.finish()))
            .collect(),
    }
}

/// The return probe as a markdown table: loss and pitch figures over the
/// tokens of returning and of fresh bars.
pub fn returns_table(r: &ReturnProbe) -> String {
    let mut out = String::from(
        "| bars | tokens | loss | pitch NLL | pitch top-1 | pitches |\n\
         | --- | ---: | ---: | ---: | ---: | ---: |\n",
    );
    let mut rows = vec![(
        format!("returning (exact copy >= {} bars back)", r.min_lag),
        &r.returning,
    )];
    if let (Some(e), Some(c)) = (&r.entering, &r.continuing) {
        rows.push(("- entering (the bar before did not return)".into(), e));
        rows.push(("- continuing (the bar before returned)".into(), c));
    }
    if let Some(f) = &r.entry_pitch {
        rows.push(("- the first pitch of each entering bar".into(), f));
    }
    rows.push(("fresh (no near copy before)".into(), &r.fresh));
    for (name, m) in rows {
        let pitch = m
            .by_type
            .get(&crate::tokenizer::TokenType::Pitch.to_string());
        out.push_str(&format!(
            "| {name} | {} | {:.4} | {} | {} | {} |\n",
            m.tokens,
            m.loss,
            pitch.map_or("-".into(), |p| format!("{:.4}", p.nll)),
            pitch.map_or("-".into(), |p| format!("{:.1}%", 100.0 * p.top1)),
            pitch.map_or(0, |p| p.count),
        ));
    }
    out
}

/// The context gain as a markdown table: one row overall, then one per token type, per
/// source group (when there are several) and per copy band, nearest first; columns full
/// NLL, then per cut its NLL and its ratio to full.
pub fn context_table(g: &ContextGain) -> String {
    // the cuts in numeric order (the JSON's keys are strings: "1000" sorts before "128")
    let mut cuts: Vec<&String> = g.cut.keys().collect();
    cuts.sort_by_key(|c| (c.parse::<usize>().unwrap_or(usize::MAX), c.to_string()));
    let mut out = String::from("| positions | n | full past |");
    let mut rule = String::from("| --- | ---: | ---: |");
    for c in &cuts {
        out.push_str(&format!(" last {c} | ratio |"));
        rule.push_str(" ---: | ---: |");
    }
    out.push('\n');
    out.push_str(&rule);
    out.push('\n');
    let mut row = |name: &str, f: &GainFigures| {
        out.push_str(&format!("| {name} | {} | {:.4} |", f.positions, f.full));
        for &c in &cuts {
            let v = f.cut.get(c).copied().unwrap_or(f64::NAN);
            out.push_str(&format!(" {v:.4} | {:.3} |", v / f.full));
        }
        out.push('\n');
    };
    row(
        "all",
        &GainFigures {
            positions: g.positions,
            full: g.full,
            cut: g.cut.clone(),
        },
    );
    for (k, f) in &g.by_type {
        row(k, f);
    }
    if g.by_source.len() > 1 {
        for (k, f) in &g.by_source {
            row(&format!("source {k}"), f);
        }
    }
    // the copy bands nearest first (as labelled for these cuts), then any other key
    let numeric: Vec<usize> = cuts.iter().filter_map(|c| c.parse().ok()).collect();
    let mut bands = copy_bands(&numeric);
    bands.retain(|b| g.by_copy.contains_key(b));
    bands.extend(
        g.by_copy
            .keys()
            .filter(|k| !bands.contains(k))
            .cloned()
            .collect::<Vec<_>>(),
    );
    for b in &bands {
        let name = if b == "fresh" {
            "fresh bar (no verbatim copy before)".to_string()
        } else {
            format!("bar, {b}")
        };
        row(&name, &g.by_copy[b]);
    }
    out
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Bin {
    pub start: usize,
    pub end: usize,
    pub mean_nll: f64,
    pub tokens: u64,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct EvalReport {
    pub model: String,
    /// The precision the model ran in (f32 or bf16; reports from before it: f32).
    #[serde(default = "crate::model::precision::f32_before_it_was_recorded")]
    pub precision: crate::model::Precision,
    pub positional: String,
    pub train_len: usize,
    pub max_len: usize,
    pub pieces: usize,
    pub bins: Vec<Bin>,
    /// Mean NLL over positions < train_len.
    pub mean_within: f64,
    /// Mean NLL over positions >= train_len.
    pub mean_beyond: Option<f64>,
    /// Mean NLL over [train_len, 2 train_len) and [2 train_len, 4 train_len).
    pub mean_1x_2x: Option<f64>,
    pub mean_2x_4x: Option<f64>,
    /// Loss, per-type metrics and pitch context over every scored position,
    /// and the same per source collection (`by_source`).
    #[serde(flatten)]
    pub metrics: GroupedMetrics,
    /// The heads silenced before scoring (`--ablate`; absent: none).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ablate: Option<Ablation>,
    /// The context gain (`--context-cut`; absent when not asked for).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub context_gain: Option<ContextGain>,
    /// The return probe: the same metrics over the tokens of bars the past
    /// predicts and of bars it cannot (absent in reports from before it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub returns: Option<ReturnProbe>,
}

/// Least lag, in bars, of the earlier copy that makes a bar "returning" in
/// the return probe (one-bar and two-bar loops do not count).
pub const RETURN_MIN_LAG: usize = 4;

/// Next-token metrics over the tokens of *returning* bars (an earlier bar at
/// least `min_lag` bars back has exactly their notes: a model that uses its
/// past can predict them) and of *fresh* bars (no earlier bar is a near
/// copy), as [`crate::eval::form::bar_returns`] sorts them. A model that
/// copies has a much higher pitch top-1 on the returning bars than on the
/// fresh ones; one that ignores the return has about the same on both.
/// The returning bars are also split by where they stand in their run:
/// `entering` (the bar before is not returning: the model has to know that
/// a return starts here) and `continuing` (the bar before returned too, so
/// matching the last notes against the past is enough).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ReturnProbe {
    pub min_lag: usize,
    pub returning: crate::eval::TokenMetrics,
    #[serde(default)]
    pub entering: Option<crate::eval::TokenMetrics>,
    #[serde(default)]
    pub continuing: Option<crate::eval::TokenMetrics>,
    /// The first pitch of each entering bar alone: where the return is decided.
    #[serde(default)]
    pub entry_pitch: Option<crate::eval::TokenMetrics>,
    pub fresh: crate::eval::TokenMetrics,
}

/// The sums of the return probe: fresh, returning, entering, continuing, entry pitch.
type ReturnSums = [crate::eval::Accumulator; 5];

/// Adds the scored targets of one window to the returning and fresh sums.
fn add_returns(
    ids: &[u32],
    vocab: &crate::tokenizer::Vocab,
    scored: &[crate::eval::Scored],
    sums: &mut ReturnSums,
) {
    let form = crate::eval::form::bar_returns(&crate::eval::form::bars(ids, vocab), RETURN_MIN_LAG);
    let at = crate::eval::form::token_bars(ids, vocab);
    // the last bar whose first pitch was seen
    let mut entered: Option<usize> = None;
    for (s, p) in scored.iter().zip(crate::eval::scored_positions(ids)) {
        let Some(b) = at[p] else { continue };
        match form[b] {
            Some(false) => sums[0].add(s),
            Some(true) => {
                sums[1].add(s);
                let continues = b > 0 && form[b - 1] == Some(true);
                sums[if continues { 3 } else { 2 }].add(s);
                if !continues && s.kind == crate::tokenizer::TokenType::Pitch && entered != Some(b)
                {
                    entered = Some(b);
                    sums[4].add(s);
                }
            }
            None => {}
        }
    }
}

fn mean_over(sums: &[f64], counts: &[u64], from: usize, to: usize) -> Option<f64> {
    let to = to.min(sums.len());
    if from >= to {
        return None;
    }
    let s: f64 = sums[from..to].iter().sum();
    let c: u64 = counts[from..to].iter().sum();
    (c > 0).then(|| s / c as f64)
}

/// `n` items spread evenly over `items` (all of them when `n` is 0 or larger).
pub fn spread<T>(items: Vec<T>, n: usize) -> Vec<T> {
    let len = items.len();
    if n == 0 || n >= len {
        return items;
    }
    let keep: std::collections::HashSet<usize> = (0..n).map(|i| i * len / n).collect();
    items
        .into_iter()
        .enumerate()
        .filter_map(|(i, x)| keep.contains(&i).then_some(x))
        .collect()
}

/// The pieces to evaluate: the run's held-out split of its own dataset, or
/// every piece of another dataset, or MIDI files tokenized on the fly.
pub fn eval_pieces(data: &[PathBuf], m: &LoadedModel) -> Result<(String, Vec<data::PieceTokens>)> {
    let own = checkpoint::dataset_path(&m.run, &m.config);
    let single = match data {
        [] => Some(own.clone()),
        [one] if one.join(crate::tokenizer::dataset::MANIFEST_FILE).is_file() => Some(one.clone()),
        _ => None,
    };
    if let Some(path) = single {
        let ds = Dataset::open(&path)?;
        checkpoint::check_vocab(&m.config, &ds.vocab, &path)?;
        let same = path.canonicalize().ok() == own.canonicalize().ok();
        let pieces = if same {
            data::split(&ds, m.config.train.seed, m.config.train.val_fraction).val
        } else {
            (0..ds.pieces.len())
                .map(|i| data::PieceTokens::new(ds.pieces[i].source.clone(), ds.piece_tokens(i)))
                .collect()
        };
        return Ok((path.display().to_string(), pieces));
    }
    let files = crate::tokenizer::dataset::collect_midi_files(data)?;
    if files.is_empty() {
        bail!(
            "{}: neither a dataset nor MIDI files",
            data.iter()
                .map(|p| p.display().to_string())
                .collect::<Vec<_>>()
                .join(", ")
        );
    }
    let results = crate::tokenizer::dataset::tokenize_files(&files, &m.vocab, &|| {});
    let mut pieces = Vec::new();
    for ((path, source), r) in files.iter().zip(results) {
        match r {
            Ok(t) if !t.tokens.is_empty() => {
                let mut ids = Vec::with_capacity(t.tokens.len() + 2);
                ids.push(crate::tokenizer::BOS_ID);
                ids.extend(t.tokens);
                ids.push(crate::tokenizer::EOS_ID);
                pieces.push(data::PieceTokens::new(source.clone(), ids));
            }
            Ok(_) => tracing::warn!("skipped {}: no notes", path.display()),
            Err(e) => tracing::warn!(
                "skipped {}: {}",
                path.display(),
                crate::tokenizer::dataset::skip_reason(path, &format!("{e:#}"))
            ),
        }
    }
    Ok((format!("{} MIDI files", files.len()), pieces))
}

/// Scores the model of `o` on its pieces (no context gain, no ablation).
pub fn evaluate(o: &EvalOptions) -> Result<EvalReport> {
    evaluate_probed(o, &Probes::default())
}

/// [`evaluate`], with the context gain and the ablation of `probes`.
pub fn evaluate_probed(o: &EvalOptions, probes: &Probes) -> Result<EvalReport> {
    let device = checkpoint::parse_device(o.device.as_deref())?;
    super::set_threads(o.threads);
    let context = if probes.context_cut.is_empty() {
        None
    } else {
        Some(check_context(
            &probes.context_cut,
            probes.context_from,
            probes.context_stride,
            probes.context_block,
        )?)
    };
    let mut m = checkpoint::load_model(&o.model_dir, device)?;
    if let Some(a) = probes.ablate {
        let what = o.model_dir.display().to_string();
        let n = ablate(&m.vs, &m.config.model, a, &what)?;
        tracing::info!("--ablate {}: {n} weights of attn_out zeroed", a.name());
    }
    m.model.freeze(o.seed);
    let precision = m.model.set_precision(o.precision);
    tracing::info!("precision: {precision}");
    let train_len = m.config.train.seq_len as usize;
    let max_len = o.max_len.unwrap_or(2 * train_len);
    if o.bin == 0 || max_len == 0 {
        bail!("--bin and --max-len must be positive");
    }
    if let Some((_, from)) = &context {
        if *from >= max_len {
            bail!(
                "--context-from {from}: no position to score below --max-len {max_len} \
                 (raise --max-len or lower the cut)"
            );
        }
    }
    let (what, pieces) = eval_pieces(&o.data, &m)?;
    let pieces: Vec<_> = pieces
        .into_iter()
        .filter(|p| p.ids.len() >= o.min_len.max(2))
        .collect();
    let pieces = spread(pieces, o.max_pieces);
    if pieces.is_empty() {
        bail!("{what}: no pieces of at least {} tokens", o.min_len.max(2));
    }
    let windows: Vec<(String, Vec<u32>)> = pieces
        .iter()
        .map(|p| {
            let n = p.ids.len().min(max_len.saturating_add(1));
            (p.source.clone(), p.ids[..n].to_vec())
        })
        .collect();
    // Positions are counted up to the longest window scored, not up to --max-len, which
    // may be any number a user types (a huge one must not size these buffers).
    let scored_len = windows.iter().map(|(_, ids)| ids.len()).max().unwrap_or(0);
    let mut sums = vec![0.0; max_len.min(scored_len)];
    let mut counts = vec![0u64; max_len.min(scored_len)];
    let table = crate::eval::PitchTable::new(&m.vocab);
    let mut groups: std::collections::BTreeMap<String, crate::eval::Accumulator> =
        Default::default();
    // per window, the NLL of each token with the whole past (NaN: not scored)
    let mut full: Vec<Vec<f64>> = Vec::new();
    let mut returns: ReturnSums = Default::default();
    for (source, ids) in &windows {
        let acc = groups.entry(crate::eval::source_group(source)).or_default();
        let scored = crate::eval::score_window(&m.model, &m.vocab, &table, ids);
        add_returns(ids, &m.vocab, &scored, &mut returns);
        let mut at = vec![f64::NAN; ids.len()];
        for (s, p) in scored.iter().zip(crate::eval::scored_positions(ids)) {
            // (bin index p - 1: the input position whose logits predict token p)
            sums[p - 1] += s.nll;
            counts[p - 1] += 1;
            acc.add(s);
            at[p] = s.nll;
        }
        if context.is_some() {
            full.push(at);
        }
    }
    let metrics = GroupedMetrics::from_groups(&groups);
    let context_gain = match &context {
        Some((cuts, from)) => {
            let g = context_gain(
                &m.model,
                &m.vocab,
                &windows,
                &full,
                cuts,
                *from,
                probes.context_stride,
                probes.context_block,
            );
            if g.positions == 0 {
                bail!(
                    "{what}: no piece reaches position {from} (--context-from) within \
                     --max-len {max_len}"
                );
            }
            Some(g)
        }
        None => None,
    };
    let bins = (0..max_len.min(sums.len()))
        .step_by(o.bin)
        .filter_map(|start| {
            let end = (start + o.bin).min(max_len);
            let tokens: u64 = counts[start..end.min(counts.len())].iter().sum();
            mean_over(&sums, &counts, start, end).map(|mean_nll| Bin {
                start,
                end,
                mean_nll,
                tokens,
            })
        })
        .collect();
    Ok(EvalReport {
        model: o.model_dir.display().to_string(),
        precision: precision.precision,
        positional: m.config.model.positional.name().to_string(),
        train_len,
        max_len,
        pieces: pieces.len(),
        bins,
        mean_within: mean_over(&sums, &counts, 0, train_len).unwrap_or(f64::NAN),
        mean_beyond: mean_over(&sums, &counts, train_len, max_len),
        mean_1x_2x: mean_over(&sums, &counts, train_len, 2 * train_len),
        mean_2x_4x: mean_over(&sums, &counts, 2 * train_len, 4 * train_len),
        metrics,
        ablate: probes.ablate,
        context_gain,
        returns: Some(ReturnProbe {
            min_lag: RETURN_MIN_LAG,
            returning: returns[1].finish(),
            entering: Some(returns[2].finish()),
            continuing: Some(returns[3].finish()),
            entry_pitch: Some(returns[4].finish()),
            fresh: returns[0].finish(),
        }),
    })
}

/// Plots the binned NLL of one or more reports (one line each).
pub fn plot(reports: &[(String, &EvalReport)], out: &Path) -> Result<()> {
    use crate::render::{line_plot_png, Series};
    let series: Vec<Series> = reports
        .iter()
        .map(|(name, r)| Series {
            name: name.clone(),
            points: r
                .bins
                .iter()
                .map(|b| ((b.start + b.end) as f64 / 2.0, b.mean_nll))
                .collect(),
        })
        .collect();
    line_plot_png(
        "Per-position NLL",
        "position (tokens)",
        "NLL (nats)",
        &series,
        out,
    )
}

fn cell(v: Option<f64>) -> String {
    v.map(|x| format!("{x:.4}")).unwrap_or_else(|| "-".into())
}

/// A markdown table of mean NLL within the training length and in the bands
/// beyond it, one row per report.
pub fn markdown_table(reports: &[EvalReport]) -> String {
    let mut out = String::from(
        "| model | positional | pieces | NLL 0..L | NLL L..2L | NLL 2L..4L | change 2L..4L vs 0..L |\n\
         | --- | --- | --- | --- | --- | --- | --- |\n",
    );
    for r in reports {
        let change = r
            .mean_2x_4x
            .map(|b| format!("{:+.1}%", (b / r.mean_within - 1.0) * 100.0))
            .unwrap_or_else(|| "-".into());
        out.push_str(&format!(
            "| {} | {} | {} | {:.4} | {} | {} | {} |\n",
            r.model,
            r.positional,
            r.pieces,
            r.mean_within,
            cell(r.mean_1x_2x),
            cell(r.mean_2x_4x),
            change
        ));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::eval::{score_window, scored_positions, PitchTable};
    use crate::model::config::{AttentionKind, LocalPosition};
    use crate::model::{ModelConfig, Transformer};
    use crate::tokenizer::{RemiConfig, Vocab};
    use tch::{nn::VarStore, Device, Kind, Tensor};

    fn vocab() -> Vocab {
        Vocab::new(RemiConfig::default()).unwrap()
    }

    /// A tiny model (4 heads of 16, 2 layers), `local` of them RoPE local heads of
    /// `window` tokens, with weights scaled up so that its predictions depend on the
    /// context more than a fresh model's (std 0.02) do.
    fn model(v: &Vocab, pos: &str, local: i64, window: i64) -> (VarStore, Transformer) {
        let mut cfg = ModelConfig::preset("tiny", v.len() as i64)
            .unwrap()
            .with_positional(pos)
            .unwrap();
        cfg.chunk_size = 16;
        cfg.local_heads = local;
        cfg.local_window = if local > 0 { window } else { 0 };
        cfg.local_position = LocalPosition::Rope;
        cfg.validate().unwrap();
        let vs = VarStore::new(Device::Cpu);
        let m = Transformer::new(&vs.root(), &cfg).unwrap();
        tch::no_grad(|| {
            for (name, w) in vs.variables() {
                if name.contains("attn_") || name.contains("tok_embed") {
                    let _ = w.shallow_clone().g_mul_scalar_(8.0);
                }
            }
        });
        (vs, m)
    }

    /// Deterministic pseudo-random ids in 1..V (no PAD).
    fn ids(v: &Vocab, n: usize, seed: u64) -> Vec<u32> {
        let mut x = seed
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (0..n)
            .map(|_| {
                x = x
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                1 + ((x >> 33) % (v.len() as u64 - 1)) as u32
            })
            .collect()
    }

    /// Per window, the NLL of each token with the whole past, as `evaluate` keeps it.
    fn full_nll(m: &Transformer, v: &Vocab, windows: &[(String, Vec<u32>)]) -> Vec<Vec<f64>> {
        let table = PitchTable::new(v);
        windows
            .iter()
            .map(|(_, w)| {
                let mut at = vec![f64::NAN; w.len()];
                for (s, p) in score_window(m, v, &table, w)
                    .iter()
                    .zip(scored_positions(w))
                {
                    at[p] = s.nll;
                }
                at
            })
            .collect()
    }

    /// A folk and a classical piece of `a.0` and `b.0` ids (seeds `a.1`, `b.1`).
    fn two_pieces(v: &Vocab, a: (usize, u64), b: (usize, u64)) -> Vec<(String, Vec<u32>)> {
        vec![
            ("folk/a.mid".into(), ids(v, a.0, a.1)),
            ("classical/b.mid".into(), ids(v, b.0, b.1)),
        ]
    }

    /// NLL of `targets[b]` after `windows[b]` at `offset`: [`crate::eval::window_nll`]
    /// with each target appended to its window.
    fn last_token_nll(
        m: &Transformer,
        windows: &[&[u32]],
        targets: &[u32],
        offset: usize,
    ) -> Vec<f64> {
        let whole: Vec<Vec<u32>> = windows
            .iter()
            .zip(targets)
            .map(|(w, &t)| w.iter().copied().chain([t]).collect())
            .collect();
        let whole: Vec<&[u32]> = whole.iter().map(|w| w.as_slice()).collect();
        let last = windows.first().map_or(0, |w| w.len());
        crate::eval::window_nll(m, &whole, &[last], offset, None)
            .into_iter()
            .map(|v| v[0])
            .collect()
    }

    /// NLL of `w[p]` from `w[start..p]` alone, at its absolute offset and with the bar
    /// index the whole past gives it: one position's own cut window.
    fn own_window_nll(m: &Transformer, w: &[u32], start: usize, p: usize) -> f64 {
        let bars = [bars_before(&w[..start])];
        crate::eval::window_nll(m, &[&w[start..=p]], &[p - start], start, Some(&bars))[0][0]
    }

    fn mean_loss(m: &Transformer, v: &Vocab, w: &[u32]) -> f64 {
        let s = score_window(m, v, &PitchTable::new(v), w);
        s.iter().map(|s| s.nll).sum::<f64>() / s.len() as f64
    }

    #[test]
    fn a_cut_longer_than_the_past_is_the_full_pass() {
        let v = vocab();
        let (_vs, m) = model(&v, "spe-sine", 2, 8);
        let windows = two_pieces(&v, (40, 1), (33, 2));
        let full = full_nll(&m, &v, &windows);
        // cut 64 >= every p: the window is the whole past; cut 3 is a real cut
        let g = context_gain(&m, &v, &windows, &full, &[3, 64], 10, 3, 1);
        // p = 10, 13, ..., 37 in the first piece (10 positions), up to 31 in the second (8)
        assert_eq!((g.positions, g.pieces), (18, 2));
        let mut want = 0.0;
        for p in (10..40).step_by(3) {
            want += full[0][p];
        }
        for p in (10..33).step_by(3) {
            want += full[1][p];
        }
        assert!(
            (g.full - want / 18.0).abs() < 1e-12,
            "full is the full pass's"
        );
        let whole = g.cut["64"];
        assert!(
            (whole - g.full).abs() < 1e-5 * g.full,
            "cut >= past: {whole} vs full {}",
            g.full
        );
        assert!((g.ratio["64"] - 1.0).abs() < 1e-5);
        let short = g.cut["3"];
        assert!(
            (short - g.full).abs() > 1e-3,
            "a 3-token cut changed nothing: {short} vs {}",
            g.full
        );
        // per type and per source: the same positions split, every cut on each
        let n: u64 = g.by_type.values().map(|f| f.positions).sum();
        assert_eq!(n, 18);
        assert_eq!(g.by_source.len(), 2);
        assert_eq!(g.by_source["folk"].positions, 10);
        for f in g.by_type.values().chain(g.by_source.values()) {
            assert!((f.cut["64"] - f.full).abs() < 1e-5 * f.full.max(1.0));
        }
        let table = context_table(&g);
        assert!(
            table.contains("last 3") && table.contains("source folk"),
            "{table}"
        );
    }

    #[test]
    fn a_block_scores_each_position_with_its_own_past() {
        let v = vocab();
        let (_vs, m) = model(&v, "spe-sine", 2, 8);
        let windows = two_pieces(&v, (40, 1), (33, 2));
        let full = full_nll(&m, &v, &windows);
        let exact = context_gain(&m, &v, &windows, &full, &[3], 10, 1, 1);
        let blocks = context_gain(&m, &v, &windows, &full, &[3], 10, 1, 4);
        // every position 10..40 and 10..33: the same positions, the same full figure
        assert_eq!((blocks.positions, blocks.pieces, blocks.block), (53, 2, 4));
        assert_eq!(exact.positions, 53);
        assert!((blocks.full - exact.full).abs() < 1e-12);
        // one window per block: position q0 + j sees the 3 + j tokens from q0 - 3, the
        // last block of the shorter piece (30, 31, 32) in a batch of its own
        let mut want = 0.0;
        for (_, w) in &windows {
            for p in 10..w.len() {
                let q0 = p - (p - 10) % 4;
                want += own_window_nll(&m, w, q0 - 3, p);
            }
        }
        let got = blocks.cut["3"];
        assert!(
            (got - want / 53.0).abs() < 1e-5,
            "blocks {got} vs one window per position {}",
            want / 53.0
        );
        assert!(
            (got - exact.cut["3"]).abs() > 1e-4,
            "blocks saw no more past than exact cuts"
        );
        // stride 2, blocks of 3, two cuts, per token type: q_j sees C + 2j tokens; the
        // shorter piece (positions 10, 12, ..., 30) reaches only 28 and 30 of its last block
        // (and a PAD at position 20 of the first, which neither pass scores)
        let mut windows = two_pieces(&v, (40, 3), (31, 4));
        windows[0].1[20] = crate::tokenizer::PAD_ID;
        let full = full_nll(&m, &v, &windows);
        let g = context_gain(&m, &v, &windows, &full, &[3, 5], 10, 2, 3);
        assert_eq!((g.positions, g.block), (15 - 1 + 11, 3));
        // (type, cut) -> (sum, count), one window of its own per position
        let mut want: BTreeMap<(String, usize), (f64, u64)> = BTreeMap::new();
        for (_, w) in &windows {
            for p in (10..w.len()).step_by(2) {
                if w[p] == crate::tokenizer::PAD_ID {
                    continue;
                }
                let q0 = p - 2 * (((p - 10) / 2) % 3);
                for c in [3, 5] {
                    let kind = v.kind(w[p]).unwrap().to_string();
                    let e = want.entry((kind, c)).or_default();
                    e.0 += own_window_nll(&m, w, q0 - c, p);
                    e.1 += 1;
                }
            }
        }
        for ((kind, c), (sum, n)) in &want {
            let f = &g.by_type[kind];
            assert_eq!(f.positions, *n, "{kind}");
            let got = f.cut[&c.to_string()];
            assert!(
                (got - sum / *n as f64).abs() < 1e-5,
                "{kind}, cut {c}: {got} vs {}",
                sum / *n as f64
            );
        }
    }

    #[test]
    fn positions_are_banded_by_where_their_bars_copy_lies() {
        use crate::tokenizer::BAR_ID;
        let v = vocab();
        let (_vs, m) = model(&v, "spe-sine", 2, 8);
        let no_bars = |n, seed| -> Vec<u32> {
            ids(&v, n, seed)
                .into_iter()
                .map(|t| if t == BAR_ID { BAR_ID + 1 } else { t })
                .collect()
        };
        // piece a: bars at 4, 8, 20, 24, 30; the bar at 20 is the one at 4 again (16 back)
        let mut a = no_bars(40, 5);
        a[4..9].copy_from_slice(&[BAR_ID, 100, 101, 102, BAR_ID]);
        a[20..25].copy_from_slice(&[BAR_ID, 100, 101, 102, BAR_ID]);
        a[30] = BAR_ID;
        // piece b: bars at 10, 13, 16, 20, 23; 13 copies 10 (3 back), 20 copies 13 (7 back)
        let mut b = no_bars(36, 6);
        b[10..17].copy_from_slice(&[BAR_ID, 100, 101, BAR_ID, 100, 101, BAR_ID]);
        b[20..24].copy_from_slice(&[BAR_ID, 100, 101, BAR_ID]);
        let windows = vec![("a.mid".to_string(), a), ("b.mid".to_string(), b)];
        let full = full_nll(&m, &v, &windows);
        let g = context_gain(&m, &v, &windows, &full, &[3, 10], 10, 1, 1);
        assert_eq!(g.positions, 30 + 26);
        // (band, positions) as built above: a 20..=23, b 13..=15 and 20..=22
        let want: [(&str, Vec<(usize, usize)>); 3] = [
            ("copy > 10 back", (20..24).map(|p| (0, p)).collect()),
            ("copy <= 3 back", (13..16).map(|p| (1, p)).collect()),
            ("copy 4-10 back", (20..23).map(|p| (1, p)).collect()),
        ];
        let mut copied = 0;
        for (band, at) in &want {
            let f = &g.by_copy[*band];
            assert_eq!(f.positions, at.len() as u64, "{band}");
            let mean = |nll: &dyn Fn(usize, usize) -> f64| {
                at.iter().map(|&(k, p)| nll(k, p)).sum::<f64>() / at.len() as f64
            };
            assert!((f.full - mean(&|k, p| full[k][p])).abs() < 1e-12, "{band}");
            let cut3 = mean(&|k, p| own_window_nll(&m, &windows[k].1, p - 3, p));
            assert!(
                (f.cut["3"] - cut3).abs() < 1e-5,
                "{band}: {} vs {cut3}",
                f.cut["3"]
            );
            copied += at.len() as u64;
        }
        assert_eq!(g.by_copy["fresh"].positions, g.positions - copied);
        assert_eq!(g.by_copy.len(), 4);
        let t = context_table(&g);
        let rows: Vec<usize> = [
            "copy <= 3 back",
            "copy 4-10 back",
            "copy > 10 back",
            "fresh bar",
        ]
        .iter()
        .map(|r| t.find(r).unwrap_or_else(|| panic!("{r} missing: {t}")))
        .collect();
        assert!(rows.windows(2).all(|w| w[0] < w[1]), "{t}");
        assert_eq!(copy_bands(&[]), ["fresh"]);
        assert_eq!(
            copy_bands(&[2, 3, 5]),
            [
                "copy <= 2 back",
                "copy 3 back",
                "copy 4-5 back",
                "copy > 5 back",
                "fresh"
            ]
        );
        let band = |d| copy_bands(&[3, 10])[copy_band(d, &[3, 10])].clone();
        assert_eq!(band(Some(3)), "copy <= 3 back");
        assert_eq!(band(Some(4)), "copy 4-10 back");
        assert_eq!(band(Some(11)), "copy > 10 back");
        assert_eq!(band(None), "fresh");
    }

    #[test]
    fn cut_windows_sit_at_their_absolute_offset() {
        // All heads local (window 4, 2 layers: 7 tokens of receptive field) with APE: a
        // cut of 8 sees all the full pass sees, at the same absolute positions, so it
        // scores alike; at offset 0 the APE codes differ, and so do the scores. Compared
        // over the whole next-token distribution (every target), not one target's NLL:
        // one token's score can move by less than the tolerance under an unlucky init
        // (this happened in CI, where the tiny model's weights are drawn afresh).
        let v = vocab();
        tch::manual_seed(11);
        let (_vs, m) = model(&v, "ape", 4, 4);
        let w = ids(&v, 30, 3);
        let full = full_nll(&m, &v, &[("a".into(), w.clone())]);
        let every: Vec<u32> = (1..v.len() as u32).collect();
        // the NLL of every target after w[p-c..p] at `offset`: (V - 1) scores
        let dist = |p: usize, c: usize, offset: usize| {
            let windows: Vec<&[u32]> = vec![&w[p - c..p]; every.len()];
            last_token_nll(&m, &windows, &every, offset)
        };
        for p in [12usize, 20, 29] {
            let c = 8;
            let at = dist(p, c, p - c);
            let own = at[w[p] as usize - 1];
            assert!(
                (own - full[0][p]).abs() < 1e-4,
                "p {p}: {own} vs {}",
                full[0][p]
            );
            let zero = dist(p, c, 0);
            let moved = at
                .iter()
                .zip(&zero)
                .map(|(a, b)| (a - b).abs())
                .fold(0.0, f64::max);
            assert!(moved > 1e-3, "p {p}: offset 0 scored alike ({moved})");
        }
        // batched windows of one offset score as they do alone
        let (a, b) = (ids(&v, 9, 4), ids(&v, 9, 5));
        let both = last_token_nll(&m, &[&a[..8], &b[..8]], &[a[8], b[8]], 5);
        let one = last_token_nll(&m, &[&b[..8]], &[b[8]], 5);
        assert!((both[1] - one[0]).abs() < 1e-5);
    }

    #[test]
    fn ablation_zeroes_the_heads_columns_and_matches_silent_values() {
        let v = vocab();
        let w = ids(&v, 48, 7);
        for ab in [Ablation::Favor, Ablation::Local] {
            let (vs, m) = model(&v, "spe-sine", 2, 8);
            // the same weights, for the layout check below
            let (mut vs2, m2) = model(&v, "spe-sine", 2, 8);
            vs2.copy(&vs).unwrap();
            let before = mean_loss(&m, &v, &w);
            let outs: Vec<Tensor> = (0..2)
                .map(|i| vs.variables()[&format!("layers.{i}.attn_out.weight")].copy())
                .collect();
            let n = ablate(&vs, m.config(), ab, "tiny").unwrap();
            assert_eq!(n, 2 * 64 * 32);
            let (lo, hi) = if ab == Ablation::Favor {
                (32, 64)
            } else {
                (0, 32)
            };
            let keep = if ab == Ablation::Favor {
                (0, 32)
            } else {
                (32, 64)
            };
            for (i, was) in outs.iter().enumerate() {
                let now = &vs.variables()[&format!("layers.{i}.attn_out.weight")];
                assert_eq!(
                    now.narrow(1, lo, hi - lo)
                        .abs()
                        .sum(Kind::Float)
                        .double_value(&[]),
                    0.0
                );
                assert!(now.narrow(1, keep.0, 32).equal(&was.narrow(1, keep.0, 32)));
            }
            let after = mean_loss(&m, &v, &w);
            // (a random tiny model is nearly uniform: silencing heads moves its loss by
            // 1e-4 or so, by less with some draws; leaving them on moves it by nothing)
            assert!((after - before).abs() > 1e-6, "{ab:?}: {before} -> {after}");

            // The layout check: the same heads silenced by zeroing their values (rows
            // 2d + h*hd.. of attn_qkv) give the same logits.
            tch::no_grad(|| {
                for i in 0..2 {
                    let vars = vs2.variables();
                    for part in ["weight", "bias"] {
                        let t = &vars[&format!("layers.{i}.attn_qkv.{part}")];
                        let _ = t.narrow(0, 128 + lo, hi - lo).zero_();
                    }
                }
            });
            let x =
                Tensor::from_slice(&w.iter().map(|&t| t as i64).collect::<Vec<_>>()).view([1, -1]);
            let (y1, y2) = tch::no_grad(|| (m.forward_t(&x, 0, false), m2.forward_t(&x, 0, false)));
            let diff = (y1 - y2).abs().max().double_value(&[]);
            assert!(diff < 1e-4, "{ab:?}: columns and values disagree by {diff}");
        }
    }

    #[test]
    fn ablations_without_the_heads_are_refused() {
        let v = vocab();
        let tiny = |local: i64| {
            let mut c = ModelConfig::preset("tiny", v.len() as i64).unwrap();
            c.local_heads = local;
            c.local_window = if local > 0 { 8 } else { 0 };
            c
        };
        let err = |c: &ModelConfig, a: Ablation| format!("{:#}", a.heads(c, "m").unwrap_err());
        assert!(err(&tiny(0), Ablation::Favor).contains("no local heads"));
        assert!(err(&tiny(0), Ablation::Favor).contains("zero the whole"));
        assert!(err(&tiny(4), Ablation::Favor).contains("no FAVOR+ heads"));
        assert!(err(&tiny(0), Ablation::Local).contains("no local heads"));
        assert!(err(&tiny(4), Ablation::Local).contains("zero the whole"));
        let mut soft = tiny(2);
        soft.attention = AttentionKind::Softmax;
        assert!(err(&soft, Ablation::Favor).contains("exact softmax"));
        assert_eq!(Ablation::Local.heads(&soft, "m").unwrap(), (0, 2));
        assert_eq!(Ablation::Favor.heads(&tiny(1), "m").unwrap(), (1, 4));
    }

    #[test]
    fn the_context_table_lists_cuts_in_numeric_order() {
        let cut: BTreeMap<String, f64> = [("1000".to_string(), 1.0), ("128".to_string(), 2.0)]
            .into_iter()
            .collect();
        let f = GainFigures {
            positions: 4,
            full: 1.0,
            cut: cut.clone(),
        };
        let g = ContextGain {
            from: 1024,
            stride: 1,
            block: 8,
            positions: 4,
            pieces: 1,
            full: 1.0,
            ratio: cut.clone(),
            cut,
            by_type: [("Pitch".to_string(), f.clone())].into_iter().collect(),
            by_source: BTreeMap::new(),
            by_copy: BTreeMap::new(),
        };
        let t = context_table(&g);
        let (a, b) = (t.find("last 128").unwrap(), t.find("last 1000").unwrap());
        assert!(a < b, "{t}");
        // each row's figures follow the header's order: 128 (2.0) first
        assert!(
            t.contains("| all | 4 | 1.0000 | 2.0000 | 2.000 | 1.0000 | 1.000 |"),
            "{t}"
        );
        assert!(t.contains("| Pitch | 4 | 1.0000 | 2.0000 |"), "{t}");
    }

    #[test]
    fn context_flags_are_checked() {
        let e = |c: &[usize], f: Option<usize>, s: usize| {
            format!("{:#}", check_context(c, f, s, 1).unwrap_err())
        };
        assert!(e(&[0], None, 16).contains("--context-cut 0"));
        assert!(e(&[100, 2000], Some(1500), 16).contains("--context-cut 2000"));
        assert!(e(&[512], Some(512), 16).contains("--context-from 512"));
        assert!(e(&[8], None, 0).contains("--context-stride 0"));
        assert!(
            format!("{:#}", check_context(&[8], None, 1, 0).unwrap_err())
                .contains("--context-block 0")
        );
        let many: Vec<usize> = (1..=20).collect();
        assert!(e(&many, None, 1).contains("at most"));
        assert_eq!(
            check_context(&[512, 128, 512], None, 16, 1).unwrap(),
            (vec![128, 512], 1024)
        );
        assert_eq!(check_context(&[700], None, 1, 64).unwrap().1, 1400);
        assert_eq!(check_context(&[5], Some(6), 1, 1).unwrap().1, 6);
    }
}
