//! Generation: a prompt is run once through the chunked forward pass, then
//! each new token is one recurrent step with constant state (FAVOR+ prefix
//! sums S, z per layer; frozen SPE noise and features), so a 16,384-token
//! piece costs per token what a 16-token one does.

pub mod stats;

use anyhow::{bail, Result};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde::{Deserialize, Serialize};
use tch::{Device, Kind, Tensor};

use crate::model::Transformer;
use crate::tokenizer::{Grammar, TokenType, Vocab, BAR_ID, BOS_ID, EOS_ID, PAD_ID};

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct SampleConfig {
    /// Tokens to generate after the prompt (at most).
    pub max_tokens: usize,
    /// Stop before the piece would exceed this many bars in all (prompt included).
    pub max_bars: Option<usize>,
    pub temperature: f64,
    /// Keep the k most likely tokens (0 = all).
    pub top_k: usize,
    /// Keep the smallest set of tokens whose probability reaches p (1 = all).
    pub top_p: f64,
    pub seed: u64,
    /// Forbid tokens the REMI grammar does not allow (on by default).
    pub constrained: bool,
    /// Forbid EOS until this many tokens are generated.
    pub min_tokens: usize,
}

impl Default for SampleConfig {
    fn default() -> Self {
        SampleConfig {
            max_tokens: 3072,
            max_bars: None,
            temperature: 1.0,
            top_k: 0,
            top_p: 0.95,
            seed: 0,
            constrained: true,
            min_tokens: 0,
        }
    }
}

impl SampleConfig {
    pub fn validate(&self) -> Result<()> {
        if !(self.temperature > 0.0 && self.temperature.is_finite()) {
            bail!("--temperature must be positive (got {})", self.temperature);
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            bail!("--top-p must be in (0, 1] (got {})", self.top_p);
        }
        if self.max_bars == Some(0) {
            bail!("--max-bars must be at least 1");
        }
        Ok(())
    }
}

/// Why a sample stopped.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub enum Stop {
    Eos,
    MaxTokens,
    MaxBars,
}

#[derive(Debug, Clone, Serialize)]
pub struct Sample {
    /// The whole sequence: BOS, prompt, continuation (no EOS).
    pub tokens: Vec<u32>,
    pub prompt_len: usize,
    pub stop: Stop,
    /// Steps where the unconstrained draw would have picked a token the
    /// grammar forbids (the constrained draw replaced it).
    pub grammar_corrections: usize,
}

/// Turns logits into a probability vector: temperature, then top-k, then
/// top-p (nucleus). Entries outside the kept set are zero.
pub fn filtered_probs(logits: &[f32], temperature: f64, top_k: usize, top_p: f64) -> Vec<f64> {
    let max = logits.iter().cloned().fold(f32::NEG_INFINITY, f32::max) as f64;
    let mut p: Vec<f64> = logits
        .iter()
        .map(|&l| {
            if l.is_finite() {
                ((l as f64 - max) / temperature).exp()
            } else {
                0.0
            }
        })
        .collect();
    let total: f64 = p.iter().sum();
    if total <= 0.0 || !total.is_finite() {
        return p;
    }
    p.iter_mut().for_each(|x| *x /= total);
    let mut order: Vec<usize> = (0..p.len()).collect();
    order.sort_by(|&a, &b| p[b].total_cmp(&p[a]).then(a.cmp(&b)));
    let mut keep = order.len();
    if top_k > 0 {
        keep = keep.min(top_k);
    }
    if top_p < 1.0 {
        let mut acc = 0.0;
        for (i, &idx) in order.iter().enumerate().take(keep) {
            acc += p[idx];
            if acc >= top_p {
                keep = i + 1;
                break;
            }
        }
    }
    for &idx in &order[keep..] {
        p[idx] = 0.0;
    }
    p
}

/// Inverse-CDF draw with `u` in [0, 1) over the entries `allowed` admits;
/// `None` when they carry no mass.
fn draw(p: &[f64], u: f64, allowed: impl Fn(usize) -> bool) -> Option<usize> {
    let total: f64 = p
        .iter()
        .enumerate()
        .filter(|(i, _)| allowed(*i))
        .map(|(_, x)| x)
        .sum();
    if total <= 0.0 {
        return None;
    }
    let target = u * total;
    let mut acc = 0.0;
    let mut last = None;
    for (i, &x) in p.iter().enumerate() {
        if x > 0.0 && allowed(i) {
            acc += x;
            last = Some(i);
            if acc > target {
                return Some(i);
            }
        }
    }
    last
}

/// Picks the next token: one uniform draw, used for the unconstrained pick
/// (to count grammar corrections) and for the constrained one.
pub fn pick(
    logits: &[f32],
    cfg: &SampleConfig,
    grammar: Option<&Grammar>,
    rng: &mut ChaCha8Rng,
) -> (u32, bool) {
    let p = filtered_probs(logits, cfg.temperature, cfg.top_k, cfg.top_p);
    let u: f64 = rng.gen();
    let free = draw(&p, u, |_| true).unwrap_or(0);
    let Some(g) = grammar else {
        return (free as u32, false);
    };
    if g.allows(free as u32) {
        return (free as u32, false);
    }
    let chosen = draw(&p, u, |i| g.allows(i as u32)).or_else(|| {
        // Every allowed token was cut by top-k/top-p: fall back to all of them.
        let full = filtered_probs(logits, cfg.temperature, 0, 1.0);
        draw(&full, u, |i| g.allows(i as u32))
    });
    let chosen = chosen.unwrap_or_else(|| {
        // Logits without mass on any allowed token (e.g. -inf): first allowed.
        (0..logits.len())
            .find(|&i| g.allows(i as u32))
            .unwrap_or(EOS_ID as usize)
    });
    (chosen as u32, true)
}

fn logits_rows(t: &Tensor) -> Vec<Vec<f32>> {
    let t = t.to_kind(Kind::Float).to_device(Device::Cpu);
    let (b, v) = t.size2().expect("(B, V) logits");
    let flat = Vec::<f32>::try_from(t.contiguous().view([-1])).unwrap_or_default();
    (0..b as usize)
        .map(|i| flat[i * v as usize..(i + 1) * v as usize].to_vec())
        .collect()
}

/// The grammar state after `prompt`, or why the prompt is not a valid sequence.
fn prompt_grammar<'v>(vocab: &'v Vocab, prompt: &[u32]) -> Result<Grammar<'v>> {
    let mut g = Grammar::new(vocab);
    for &t in prompt {
        g.push(t)
            .map_err(|e| anyhow::anyhow!("the prompt is not a valid token sequence: {e}"))?;
    }
    Ok(g)
}

/// Generates `n` continuations of `prompt` (which starts with BOS) as one
/// batch. `on_token` is called after every step with the tokens generated so far.
pub fn generate(
    model: &Transformer,
    vocab: &Vocab,
    prompt: &[u32],
    n: usize,
    cfg: &SampleConfig,
    on_token: &mut dyn FnMut(usize),
) -> Result<Vec<Sample>> {
    cfg.validate()?;
    if n == 0 {
        bail!("--num-samples must be at least 1");
    }
    if prompt.first() != Some(&BOS_ID) {
        bail!("a prompt must start with BOS");
    }
    let base = prompt_grammar(vocab, prompt)?;
    let prompt_bars = prompt.iter().filter(|&&t| t == BAR_ID).count();
    let device = model.device();
    let mut grammars: Vec<Grammar> = vec![base; n];
    let mut rngs: Vec<ChaCha8Rng> = (0..n)
        .map(|i| ChaCha8Rng::seed_from_u64(cfg.seed.wrapping_add((i as u64) << 32)))
        .collect();
    let mut samples: Vec<Sample> = (0..n)
        .map(|_| Sample {
            tokens: prompt.to_vec(),
            prompt_len: prompt.len(),
            stop: Stop::MaxTokens,
            grammar_corrections: 0,
        })
        .collect();
    let mut done = vec![false; n];
    let mut bars = vec![prompt_bars; n];

    let ids: Vec<i64> = prompt.iter().map(|&t| t as i64).collect();
    let batch = Tensor::from_slice(&ids)
        .view([1, -1])
        .repeat([n as i64, 1])
        .to_device(device);
    let mut state = model.begin(n as i64);
    let logits = model.prefill(&batch, &mut state);
    let mut last = logits.select(1, prompt.len() as i64 - 1);
    for generated in 0..cfg.max_tokens {
        let mut rows = logits_rows(&last);
        let mut next = vec![PAD_ID as i64; n];
        for i in 0..n {
            if done[i] {
                continue;
            }
            let g = cfg.constrained.then_some(&grammars[i]);
            if generated < cfg.min_tokens {
                rows[i][EOS_ID as usize] = f32::NEG_INFINITY;
            }
            let (tok, corrected) = pick(&rows[i], cfg, g, &mut rngs[i]);
            samples[i].grammar_corrections += corrected as usize;
            if tok == EOS_ID {
                samples[i].stop = Stop::Eos;
                done[i] = true;
                continue;
            }
            if tok == BAR_ID {
                if cfg.max_bars.is_some_and(|m| bars[i] >= m) {
                    samples[i].stop = Stop::MaxBars;
                    done[i] = true;
                    continue;
                }
                bars[i] += 1;
            }
            // Unconstrained sampling may produce anything; keep the grammar
            // state only while it holds.
            let _ = grammars[i].push(tok);
            samples[i].tokens.push(tok);
            next[i] = tok as i64;
        }
        on_token(generated + 1);
        if done.iter().all(|&d| d) || generated + 1 == cfg.max_tokens {
            break;
        }
        let input = Tensor::from_slice(&next).to_device(device);
        last = model.step(&input, &mut state);
    }
    for s in &mut samples {
        if s.stop != Stop::Eos {
            trim_incomplete(vocab, &mut s.tokens, s.prompt_len);
        }
    }
    Ok(samples)
}

/// Drops a trailing unfinished note (Program, Pitch, Velocity without their
/// Duration) and a trailing Position with nothing at it, so that a piece cut
/// by a length limit decodes without skipping anything.
pub fn trim_incomplete(vocab: &Vocab, tokens: &mut Vec<u32>, keep: usize) {
    while tokens.len() > keep {
        match tokens.last().and_then(|&t| vocab.kind(t)) {
            Some(
                TokenType::Program
                | TokenType::Pitch
                | TokenType::PitchDrum
                | TokenType::Velocity
                | TokenType::Position,
            ) => {
                tokens.pop();
            }
            _ => break,
        }
    }
}

/// The same sampling done the way the reference implementation did it:
/// the whole prefix is run again for every new token (quadratic in the
/// length). Used by the benchmark and to check the recurrence.
pub fn generate_by_recompute(
    model: &Transformer,
    vocab: &Vocab,
    prompt: &[u32],
    cfg: &SampleConfig,
) -> Result<Sample> {
    let mut grammar = prompt_grammar(vocab, prompt)?;
    let mut rng = ChaCha8Rng::seed_from_u64(cfg.seed);
    let mut tokens = prompt.to_vec();
    let mut corrections = 0;
    let mut stop = Stop::MaxTokens;
    for _ in 0..cfg.max_tokens {
        let ids: Vec<i64> = tokens.iter().map(|&t| t as i64).collect();
        let x = Tensor::from_slice(&ids)
            .view([1, -1])
            .to_device(model.device());
        let logits = tch::no_grad(|| model.forward_t(&x, 0, false));
        let last = logits.select(1, tokens.len() as i64 - 1);
        let row = logits_rows(&last).remove(0);
        let (tok, corrected) = pick(&row, cfg, cfg.constrained.then_some(&grammar), &mut rng);
        corrections += corrected as usize;
        if tok == EOS_ID {
            stop = Stop::Eos;
            break;
        }
        let _ = grammar.push(tok);
        tokens.push(tok);
    }
    Ok(Sample {
        tokens,
        prompt_len: prompt.len(),
        stop,
        grammar_corrections: corrections,
    })
}

/// BOS + the prompt's tokens, cut before its (`bars` + 1)-th bar when asked.
pub fn prompt_tokens(body: &[u32], bars: Option<usize>) -> Vec<u32> {
    let mut out = vec![BOS_ID];
    let mut seen = 0;
    for &t in body {
        if t == BAR_ID {
            seen += 1;
            if bars.is_some_and(|b| seen > b) {
                break;
            }
        }
        out.push(t);
    }
    // A prompt must not end on a bare Bar: the model continues it anyway.
    out
}

/// Counts the tokens of a type (for reports).
pub fn count_type(tokens: &[u32], vocab: &Vocab, kind: TokenType) -> usize {
    tokens
        .iter()
        .filter(|&&t| vocab.kind(t) == Some(kind))
        .count()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn filters_in_order_and_renormalize() {
        let logits = [2.0f32, 1.0, 0.0, -1.0];
        let p = filtered_probs(&logits, 1.0, 0, 1.0);
        assert!((p.iter().sum::<f64>() - 1.0).abs() < 1e-12);
        let k2 = filtered_probs(&logits, 1.0, 2, 1.0);
        assert_eq!(k2.iter().filter(|&&x| x > 0.0).count(), 2);
        let nucleus = filtered_probs(&logits, 1.0, 0, 0.5);
        assert_eq!(nucleus.iter().filter(|&&x| x > 0.0).count(), 1);
        let hot = filtered_probs(&logits, 100.0, 0, 1.0);
        assert!(hot[3] > 0.2, "high temperature flattens");
    }

    #[test]
    fn draw_respects_the_allowed_set() {
        let p = [0.5, 0.3, 0.2];
        assert_eq!(draw(&p, 0.1, |_| true), Some(0));
        assert_eq!(draw(&p, 0.1, |i| i != 0), Some(1));
        assert_eq!(draw(&p, 0.99, |i| i == 2), Some(2));
        assert_eq!(draw(&p, 0.5, |_| false), None);
    }

    #[test]
    fn prompt_is_cut_at_bars() {
        let body = [BAR_ID, 10, BAR_ID, 11, BAR_ID, 12];
        assert_eq!(
            prompt_tokens(&body, Some(2)),
            vec![BOS_ID, BAR_ID, 10, BAR_ID, 11]
        );
        assert_eq!(prompt_tokens(&body, None).len(), 7);
    }
}
