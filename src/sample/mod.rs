//! Generation: a prompt is run once through the parallel forward pass, then
//! each new token is one recurrent step with constant state (FAVOR+ prefix
//! sums S, z per layer; frozen SPE noise and features), so a 16,384-token
//! piece costs per token what a 16-token one does.

pub mod guard;
pub mod pieces;
pub mod set;

use anyhow::{bail, Result};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde::{Deserialize, Serialize};
use tch::{Device, Kind, Tensor};

use crate::model::Transformer;
use crate::tokenizer::{Grammar, Token, TokenType, Vocab, BAR_ID, BOS_ID, DRUMS, EOS_ID, PAD_ID};
pub use guard::{GuardConfig, GuardState};

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct SampleConfig {
    /// Tokens to generate after the prompt: exactly this many unless
    /// `earliest_end` lets the model end sooner or `max_bars` stops it.
    pub max_tokens: usize,
    /// Stop before the piece would exceed this many bars in all (prompt included).
    pub max_bars: Option<usize>,
    pub temperature: f64,
    /// Keep the k most likely tokens (0 = all).
    pub top_k: usize,
    /// Keep the smallest set of tokens whose probability reaches p (1 = all).
    pub top_p: f64,
    /// Keep the tokens at least this fraction as likely as the likeliest (0 = all):
    /// min-p sampling, which cuts more where the model is sure (a strain it is
    /// playing again) and less where it is not.
    pub min_p: f64,
    pub seed: u64,
    /// Forbid tokens the REMI grammar does not allow (on by default).
    pub constrained: bool,
    /// The earliest end: EOS may be drawn once this many tokens are
    /// generated. `None` (the default) forbids EOS altogether, so a piece
    /// runs to `max_tokens` (or `max_bars`); `Some(0)` lets it end anywhere.
    pub earliest_end: Option<usize>,
    /// A set of tunes ([`set`]): when the model ends a tune, the piece goes on
    /// with a new one (the model reads EOS and BOS, as between the pieces of a
    /// training window), joined into one piece; it still runs to `max_tokens` or
    /// `max_bars`. A tune may end once it has a bar. Not with `earliest_end`.
    pub set: bool,
    /// In a set where `programs` names no instruments: the later tunes are played
    /// on those of the first tune that had notes (on by default; `generate
    /// --programs any` turns it off, so each tune may bring in any).
    pub keep_first_instruments: bool,
    /// The repetition guard (on by default).
    pub guard: GuardConfig,
    /// The instruments a piece may use (`Program` values, [`DRUMS`] for the
    /// kit); `None` lets the model bring in any. `cadenza generate` sets it
    /// to the prompt's instruments, so a solo-piano prompt stays a piano piece.
    pub programs: Option<Vec<u8>>,
}

impl Default for SampleConfig {
    fn default() -> Self {
        SampleConfig {
            max_tokens: 3072,
            max_bars: None,
            temperature: 1.0,
            top_k: 0,
            top_p: 0.95,
            min_p: 0.0,
            seed: 0,
            constrained: true,
            earliest_end: None,
            set: false,
            keep_first_instruments: true,
            guard: GuardConfig::default(),
            programs: None,
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
        if !(0.0..1.0).contains(&self.min_p) {
            bail!("--min-p must be in [0, 1) (got {})", self.min_p);
        }
        if self.max_bars == Some(0) {
            bail!("--max-bars must be at least 1");
        }
        if self.set && self.earliest_end.is_some() {
            bail!(
                "--set goes on with a new tune where the model ends one, so a piece never \
                 ends early: leave out --allow-early-end and --min-tokens"
            );
        }
        if self.programs.as_ref().is_some_and(|p| p.is_empty()) {
            bail!("--programs must name at least one instrument");
        }
        self.guard.validate()
    }
}

/// Why a sample stopped.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Stop {
    Eos,
    MaxTokens,
    MaxBars,
}

#[derive(Debug, Clone, Serialize)]
pub struct Sample {
    /// The whole sequence: BOS, prompt, continuation (no EOS); the tunes of a
    /// set joined into one piece ([`set::Join`]).
    pub tokens: Vec<u32>,
    pub prompt_len: usize,
    pub stop: Stop,
    /// Steps where the unconstrained draw would have picked a token the
    /// grammar forbids (the constrained draw replaced it).
    pub grammar_corrections: usize,
    /// Steps where the repetition guard changed the token drawn.
    pub guard_changes: usize,
    /// Tokens drawn after the prompt: those kept, plus EOS or the Bar past
    /// the bar limit that ended the piece and the unfinished note or bare
    /// Position dropped at the end ([`trim_incomplete`]), and in a set each
    /// EOS that ended a tune. The progress of a job counts these.
    pub drawn: usize,
    /// The tunes in the piece: 1, or more in a set ([`SampleConfig::set`]).
    pub tunes: usize,
}

/// How [`filtered_probs`] cuts the distribution after the temperature: each keeps a
/// prefix of the tokens sorted by probability, and the shortest prefix wins.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Filter {
    /// Keep the k most likely tokens (0 = all).
    pub top_k: usize,
    /// Keep the smallest set whose probability reaches p (1 = all).
    pub top_p: f64,
    /// Keep the tokens at least this fraction as likely as the likeliest (0 = all).
    pub min_p: f64,
}

impl Filter {
    /// Nothing cut.
    pub const NONE: Filter = Filter {
        top_k: 0,
        top_p: 1.0,
        min_p: 0.0,
    };
}

impl From<&SampleConfig> for Filter {
    fn from(c: &SampleConfig) -> Filter {
        Filter {
            top_k: c.top_k,
            top_p: c.top_p,
            min_p: c.min_p,
        }
    }
}

/// Turns logits into a probability vector: temperature, then top-k, top-p
/// (nucleus) and min-p. Entries outside the kept set are zero.
pub fn filtered_probs(logits: &[f32], temperature: f64, f: Filter) -> Vec<f64> {
    let Filter {
        top_k,
        top_p,
        min_p,
    } = f;
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
    if min_p > 0.0 {
        // the likeliest token always stays (its own fraction is 1)
        let floor = min_p * p[order[0]];
        keep = keep.min(order.iter().take_while(|&&i| p[i] >= floor).count().max(1));
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

/// One draw with the uniform number `u`: the tokens in `banned` get no
/// probability (before temperature, top-k and top-p, so the others share
/// their mass), then the grammar, if any, replaces a token it forbids by the
/// draw over the tokens it allows. Returns the token and whether the grammar
/// replaced it.
pub fn choose(
    logits: &[f32],
    cfg: &SampleConfig,
    grammar: Option<&Grammar>,
    banned: &[u32],
    u: f64,
) -> (u32, bool) {
    let mut ban = vec![false; logits.len()];
    for &id in banned {
        if let Some(b) = ban.get_mut(id as usize) {
            *b = true;
        }
    }
    let masked: Option<Vec<f32>> = (!banned.is_empty()).then(|| {
        let neg = |(l, &b): (&f32, &bool)| if b { f32::NEG_INFINITY } else { *l };
        logits.iter().zip(&ban).map(neg).collect()
    });
    let logits = masked.as_deref().unwrap_or(logits);
    let p = filtered_probs(logits, cfg.temperature, Filter::from(cfg));
    let free = draw(&p, u, |_| true).unwrap_or(0);
    let allowed = |i: usize| !ban[i] && grammar.is_none_or(|g| g.allows(i as u32));
    if allowed(free) {
        return (free as u32, false);
    }
    let corrected = grammar.is_some_and(|g| !g.allows(free as u32));
    let chosen = draw(&p, u, allowed).or_else(|| {
        // Every allowed token was cut by top-k/top-p/min-p: fall back to all of them.
        let full = filtered_probs(logits, cfg.temperature, Filter::NONE);
        draw(&full, u, allowed)
    });
    let chosen = chosen.unwrap_or_else(|| {
        // Logits without mass on any allowed token (e.g. -inf): first allowed,
        // or, if the bans leave none, the first the grammar allows.
        (0..logits.len())
            .find(|&i| allowed(i))
            .or_else(|| (0..logits.len()).find(|&i| grammar.is_none_or(|g| g.allows(i as u32))))
            .unwrap_or(EOS_ID as usize)
    });
    (chosen as u32, corrected)
}

/// The outcome of one sampling step.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Pick {
    pub token: u32,
    /// The grammar replaced the token the model's distribution gave.
    pub grammar_corrected: bool,
    /// The guard's bans changed the token (same draw without them differs).
    pub guard_changed: bool,
}

/// The `Program` tokens of instruments outside `programs` (none when
/// `programs` is `None`): banned at every step.
pub fn program_bans(vocab: &Vocab, programs: Option<&[u8]>) -> Vec<u32> {
    let Some(keep) = programs else {
        return Vec::new();
    };
    vocab
        .range(TokenType::Program)
        .filter(|&id| !matches!(vocab.token(id), Some(Token::Program(p)) if keep.contains(&p)))
        .collect()
}

/// The instruments a token sequence uses: its `Program` values, and
/// [`DRUMS`] when it has drum pitches, sorted.
pub fn programs_of(vocab: &Vocab, tokens: &[u32]) -> Vec<u8> {
    let mut out: Vec<u8> = tokens
        .iter()
        .filter_map(|&t| match vocab.token(t) {
            Some(Token::Program(p)) => Some(p),
            Some(Token::PitchDrum(_)) => Some(DRUMS),
            _ => None,
        })
        .collect();
    out.sort_unstable();
    out.dedup();
    out
}

/// Picks the next token with one uniform draw from `rng`. EOS is forbidden
/// unless `end_allowed`, and so are `fixed_bans` (e.g. [`program_bans`]);
/// `guard_bans` (from [`GuardState::bans`]) are forbidden too, and the step
/// counts as changed by the guard when the same draw without them would have
/// given another token.
pub fn pick(
    logits: &[f32],
    cfg: &SampleConfig,
    grammar: Option<&Grammar>,
    end_allowed: bool,
    fixed_bans: &[u32],
    guard_bans: &[u32],
    rng: &mut ChaCha8Rng,
) -> Pick {
    let u: f64 = rng.gen();
    let mut rules: Vec<u32> = fixed_bans.to_vec();
    if !end_allowed {
        rules.push(EOS_ID);
    }
    if guard_bans.is_empty() {
        let (token, grammar_corrected) = choose(logits, cfg, grammar, &rules, u);
        return Pick {
            token,
            grammar_corrected,
            guard_changed: false,
        };
    }
    let unguarded = choose(logits, cfg, grammar, &rules, u).0;
    rules.extend_from_slice(guard_bans);
    let (token, grammar_corrected) = choose(logits, cfg, grammar, &rules, u);
    Pick {
        token,
        grammar_corrected,
        guard_changed: token != unguarded,
    }
}

/// One sequence being sampled: its grammar and guard state, random
/// generator, bar count and tokens. Both samplers step it the same way.
struct Sequence<'v> {
    grammar: Grammar<'v>,
    /// [`program_bans`] of the config.
    program_bans: Vec<u32>,
    guard: GuardState,
    rng: ChaCha8Rng,
    bars: usize,
    /// Bars of the current tune (the prompt's count for the first).
    tune_bars: usize,
    done: bool,
    /// The tokens the model has read (with the EOS and BOS between a set's tunes).
    fed: Vec<u32>,
    /// A set's tune has just ended: the next token is BOS.
    bos_next: bool,
    join: set::Join<'v>,
    sample: Sample,
}

impl<'v> Sequence<'v> {
    fn new(vocab: &'v Vocab, prompt: &[u32], seed: u64, cfg: &SampleConfig) -> Result<Self> {
        let mut guard = GuardState::new();
        for &t in prompt {
            guard.observe(vocab, t);
        }
        let bars = prompt.iter().filter(|&&t| t == BAR_ID).count();
        Ok(Sequence {
            join: set::Join::new(vocab),
            grammar: prompt_grammar(vocab, prompt)?,
            program_bans: program_bans(vocab, cfg.programs.as_deref()),
            guard,
            rng: ChaCha8Rng::seed_from_u64(seed),
            bars,
            tune_bars: bars,
            done: false,
            fed: prompt.to_vec(),
            bos_next: false,
            sample: Sample {
                tokens: prompt.to_vec(),
                prompt_len: prompt.len(),
                stop: Stop::MaxTokens,
                grammar_corrections: 0,
                guard_changes: 0,
                drawn: 0,
                tunes: 1,
            },
        })
    }

    /// Draws the token after `generated` new ones from `logits`; `None`
    /// when the sequence ends here (EOS, or the bar limit). In a set, the
    /// token after a tune's EOS is its successor's BOS, drawn from nothing.
    fn step(
        &mut self,
        logits: &[f32],
        generated: usize,
        vocab: &'v Vocab,
        cfg: &SampleConfig,
    ) -> Option<u32> {
        if self.done {
            return None;
        }
        if self.bos_next {
            self.begin_tune(vocab, cfg);
            return Some(BOS_ID);
        }
        let g = cfg.constrained.then_some(&self.grammar);
        let end_allowed = if cfg.set {
            self.tune_bars > 0
        } else {
            cfg.earliest_end.is_some_and(|m| generated >= m)
        };
        let bans = self.guard.bans(&cfg.guard, vocab, g);
        let p = pick(
            logits,
            cfg,
            g,
            end_allowed,
            &self.program_bans,
            &bans,
            &mut self.rng,
        );
        self.sample.grammar_corrections += p.grammar_corrected as usize;
        self.sample.guard_changes += p.guard_changed as usize;
        self.sample.drawn += 1;
        let tok = p.token;
        if tok == EOS_ID && cfg.set {
            // The tune ends; the piece goes on (the tune's last note is whole:
            // the grammar allows EOS only after a Duration, a TimeSig or a Tempo).
            self.bos_next = true;
            self.fed.push(EOS_ID);
            return Some(EOS_ID);
        }
        if tok == EOS_ID {
            self.sample.stop = Stop::Eos;
            self.done = true;
            return None;
        }
        if tok == BAR_ID {
            if cfg.max_bars.is_some_and(|m| self.bars >= m) {
                self.sample.stop = Stop::MaxBars;
                self.done = true;
                return None;
            }
            self.bars += 1;
            self.tune_bars += 1;
        }
        // Unconstrained sampling may produce anything; keep the grammar
        // state only while it holds.
        let _ = self.grammar.push(tok);
        self.guard.observe(vocab, tok);
        self.fed.push(tok);
        self.join.push(tok, &mut self.sample.tokens);
        Some(tok)
    }

    /// A set's next tune begins: fresh grammar and guard, as at a piece's start,
    /// and the instruments of the first tune that had notes
    /// ([`SampleConfig::keep_first_instruments`]).
    fn begin_tune(&mut self, vocab: &'v Vocab, cfg: &SampleConfig) {
        self.bos_next = false;
        // (the first tune with notes fixes them: nothing is banned before)
        if cfg.keep_first_instruments && cfg.programs.is_none() && self.program_bans.is_empty() {
            let band = programs_of(vocab, &self.sample.tokens);
            if !band.is_empty() {
                self.program_bans = program_bans(vocab, Some(&band));
            }
        }
        // (the ended tune's grammar, before its EOS: the step does not push it)
        self.join.begin_tune(&self.grammar);
        self.grammar = Grammar::new(vocab);
        let _ = self.grammar.push(BOS_ID);
        self.guard = GuardState::new();
        self.tune_bars = 0;
        self.fed.push(BOS_ID);
        self.sample.tunes = self.join.tunes();
    }

    fn finish(mut self, vocab: &Vocab) -> Sample {
        if self.join.dropped() > 0 {
            tracing::debug!(
                "{} token(s) of later tunes restated the piece and were left out",
                self.join.dropped()
            );
        }
        if self.sample.stop != Stop::Eos {
            let keep = self.sample.prompt_len;
            trim_incomplete(vocab, &mut self.sample.tokens, keep);
        }
        self.sample
    }
}

/// The seed of sequence `i` of a batch.
fn sequence_seed(seed: u64, i: usize) -> u64 {
    seed.wrapping_add((i as u64) << 32)
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
    generate_until(model, vocab, prompt, n, cfg, &mut |k| {
        on_token(k);
        true
    })
}

/// Returned (inside `anyhow::Error`) by [`generate_until`] when its callback
/// asked it to stop.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("generation cancelled")]
pub struct Cancelled;

/// [`generate`] that can be stopped: `on_token` is called after every step
/// with the tokens generated so far and returns whether to go on; when it
/// returns `false` the result is the error [`Cancelled`].
pub fn generate_until(
    model: &Transformer,
    vocab: &Vocab,
    prompt: &[u32],
    n: usize,
    cfg: &SampleConfig,
    on_token: &mut dyn FnMut(usize) -> bool,
) -> Result<Vec<Sample>> {
    cfg.validate()?;
    if n == 0 {
        bail!("--num-samples must be at least 1");
    }
    if prompt.first() != Some(&BOS_ID) {
        bail!("a prompt must start with BOS");
    }
    let device = model.device();
    let mut seqs = (0..n)
        .map(|i| Sequence::new(vocab, prompt, sequence_seed(cfg.seed, i), cfg))
        .collect::<Result<Vec<_>>>()?;

    let ids: Vec<i64> = prompt.iter().map(|&t| t as i64).collect();
    let batch = Tensor::from_slice(&ids)
        .view([1, -1])
        .repeat([n as i64, 1])
        .to_device(device);
    let mut state = model.begin(n as i64);
    let logits = model.prefill(&batch, &mut state);
    let mut last = logits.select(1, prompt.len() as i64 - 1);
    let prefill_threads = tch::get_num_threads();
    if device == Device::Cpu {
        tch::set_num_threads(step_threads(n, prefill_threads));
    }
    for generated in 0..cfg.max_tokens {
        let rows = logits_rows(&last);
        let next: Vec<i64> = seqs
            .iter_mut()
            .zip(&rows)
            .map(|(s, row)| {
                s.step(row, generated, vocab, cfg)
                    .map_or(PAD_ID as i64, |t| t as i64)
            })
            .collect();
        if !on_token(generated + 1) {
            tch::set_num_threads(prefill_threads);
            return Err(Cancelled.into());
        }
        if seqs.iter().all(|s| s.done) || generated + 1 == cfg.max_tokens {
            break;
        }
        let input = Tensor::from_slice(&next).to_device(device);
        last = model.step(&input, &mut state);
    }
    tch::set_num_threads(prefill_threads);
    Ok(seqs.into_iter().map(|s| s.finish(vocab)).collect())
}

/// Libtorch threads for the recurrent steps of a batch of `batch` sequences
/// on the CPU, given `available` threads (the prompt is read with all of
/// them). One step is small (matrix-vector products at batch 1; a CPU f32
/// step of the shipped shape does its arithmetic on the host, in one thread,
/// below batch 4: see `Transformer::step`), too small to share among threads:
/// measured on 2 cores with
/// the shipped model, 1 thread gives 783 tokens/s at batch 1 against 562 with
/// 2, and the same at batch 8 (2,797 against 2,776). One thread also keeps a
/// busy neighbour process from stalling every step, since libtorch's OpenMP
/// threads wait for each other by spinning. Batches above 8 use them all.
pub fn step_threads(batch: usize, available: i32) -> i32 {
    if batch <= 8 {
        1
    } else {
        available.max(1)
    }
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
/// length). Used by the benchmark and to check the recurrence: it steps the
/// sequence exactly as [`generate`] steps its first one (same random draws,
/// end rule, bar limit and repetition guard), so the two give the same piece.
pub fn generate_by_recompute(
    model: &Transformer,
    vocab: &Vocab,
    prompt: &[u32],
    cfg: &SampleConfig,
) -> Result<Sample> {
    cfg.validate()?;
    let mut seq = Sequence::new(vocab, prompt, sequence_seed(cfg.seed, 0), cfg)?;
    for generated in 0..cfg.max_tokens {
        let ids: Vec<i64> = seq.fed.iter().map(|&t| t as i64).collect();
        let x = Tensor::from_slice(&ids)
            .view([1, -1])
            .to_device(model.device());
        let logits = tch::no_grad(|| model.forward_t(&x, 0, false));
        let last = logits.select(1, ids.len() as i64 - 1);
        let row = logits_rows(&last).remove(0);
        if seq.step(&row, generated, vocab, cfg).is_none() {
            break;
        }
    }
    Ok(seq.finish(vocab))
}

/// A rough upper estimate of the memory, in bytes, that [`generate`] needs for
/// `n` pieces of a `prompt_len`-token prompt and `tokens` new tokens each:
/// the prefill's activations and logits over the prompt, the recurrent state
/// (FAVOR+ sums, local heads' windows and short-convolution tails, or the
/// softmax reference's cache) and the per-piece
/// bookkeeping (tokens, grammar and guard state, a row of probabilities).
pub fn estimate_bytes(
    cfg: &crate::model::ModelConfig,
    n: usize,
    prompt_len: usize,
    tokens: usize,
) -> u128 {
    let (n, p, t) = (n as u128, prompt_len as u128, tokens as u128);
    let d = cfg.d_model.max(1) as u128;
    let v = cfg.vocab_size.max(1) as u128;
    let ff = cfg.d_ff.max(1) as u128;
    let layers = cfg.n_layers.max(1) as u128;
    let heads = cfg.n_heads.max(1) as u128;
    let hd = cfg.head_dim().max(1) as u128;
    let prefill = p * (v + 8 * d + ff) * 4;
    // (the linear heads' features: FAVOR+'s, or the Taylor map's 1 + n + n^2)
    let state = match cfg.linear_features() {
        Some(features) => layers * heads * features.max(1) as u128 * (hd + 1) * 4,
        None => layers * (p + t) * 2 * d * 4,
    };
    let windows = layers
        * cfg.local_heads.max(0) as u128
        * cfg.local_window.max(1) as u128
        * (cfg.local_qk_dim().max(1) as u128 + hd)
        * 4;
    let tails = layers * (cfg.short_conv.max(1) as u128 - 1) * 3 * d * 4;
    let state = state + windows + tails;
    let bookkeeping = (p + t) * 16 + v * 16;
    n * (prefill + state + bookkeeping)
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
    fn memory_estimate_counts_local_windows_and_conv_tails() {
        let base = crate::model::ModelConfig::preset("small", 845).unwrap();
        let mut local = base.clone();
        local.local_heads = 2;
        local.local_window = 128;
        // per piece: 4 layers x 2 heads x a ring of 128 slots x (32 + 64) floats
        let extra = estimate_bytes(&local, 3, 10, 100) - estimate_bytes(&base, 3, 10, 100);
        assert_eq!(extra, 3 * 4 * 2 * 128 * (32 + 64) * 4);
        // RoPE local heads keep whole head-sized keys (64), not SPE's R = 32 columns
        let mut rope = local.clone();
        rope.local_position = crate::model::LocalPosition::Rope;
        let extra = estimate_bytes(&rope, 3, 10, 100) - estimate_bytes(&base, 3, 10, 100);
        assert_eq!(extra, 3 * 4 * 2 * 128 * (64 + 64) * 4);
        let mut conv = base.clone();
        conv.short_conv = 4;
        let extra = estimate_bytes(&conv, 1, 10, 100) - estimate_bytes(&base, 1, 10, 100);
        assert_eq!(extra, 4 * 3 * 3 * 256 * 4);
        // the Taylor map's state: 1 + 16 + 256 features per head where FAVOR+ has 64
        let mut taylor = base.clone();
        taylor.taylor_dim = Some(16);
        let extra = estimate_bytes(&taylor, 1, 10, 100) - estimate_bytes(&base, 1, 10, 100);
        assert_eq!(extra, 4 * 4 * (273 - 64) * (64 + 1) * 4);
    }

    #[test]
    fn filters_in_order_and_renormalize() {
        let logits = [2.0f32, 1.0, 0.0, -1.0];
        let cut = |top_k, top_p, min_p| Filter {
            top_k,
            top_p,
            min_p,
        };
        let kept = |p: &[f64]| p.iter().filter(|&&x| x > 0.0).count();
        let p = filtered_probs(&logits, 1.0, Filter::NONE);
        assert!((p.iter().sum::<f64>() - 1.0).abs() < 1e-12);
        assert_eq!(kept(&filtered_probs(&logits, 1.0, cut(2, 1.0, 0.0))), 2);
        assert_eq!(kept(&filtered_probs(&logits, 1.0, cut(0, 0.5, 0.0))), 1);
        let hot = filtered_probs(&logits, 100.0, Filter::NONE);
        assert!(hot[3] > 0.2, "high temperature flattens");
        // min-p: p = 0.644, 0.237, 0.087, 0.032; a floor of 0.3 x 0.644 keeps two,
        // 0.1 x 0.644 three, and the kept ones keep their probabilities
        let m = filtered_probs(&logits, 1.0, cut(0, 1.0, 0.3));
        assert_eq!(kept(&m), 2);
        assert_eq!(&m[..2], &p[..2]);
        assert_eq!(kept(&filtered_probs(&logits, 1.0, cut(0, 1.0, 0.1))), 3);
        // the shortest of the prefixes wins, whichever filter gives it
        assert_eq!(kept(&filtered_probs(&logits, 1.0, cut(3, 0.99, 0.3))), 2);
        assert_eq!(kept(&filtered_probs(&logits, 1.0, cut(1, 1.0, 0.1))), 1);
        // a flat distribution keeps everything at any min-p; the likeliest always stays
        assert_eq!(kept(&filtered_probs(&[0.0; 5], 1.0, cut(0, 1.0, 0.99))), 5);
        assert_eq!(
            kept(&filtered_probs(&[9.0, 0.0], 1.0, cut(0, 1.0, 0.999))),
            1
        );
        // after the temperature: hotter logits let more tokens over the same floor
        assert_eq!(kept(&filtered_probs(&logits, 4.0, cut(0, 1.0, 0.3))), 4);
    }

    #[test]
    fn sampling_values_out_of_range_are_refused_naming_the_flag() {
        let ok = SampleConfig::default();
        assert!(ok.validate().is_ok());
        let bad = [
            (
                SampleConfig {
                    temperature: 0.0,
                    ..ok.clone()
                },
                "--temperature",
            ),
            (
                SampleConfig {
                    top_p: 0.0,
                    ..ok.clone()
                },
                "--top-p",
            ),
            (
                SampleConfig {
                    top_p: 1.5,
                    ..ok.clone()
                },
                "--top-p",
            ),
            (
                SampleConfig {
                    min_p: -0.1,
                    ..ok.clone()
                },
                "--min-p",
            ),
            (
                SampleConfig {
                    min_p: 1.0,
                    ..ok.clone()
                },
                "--min-p",
            ),
            (
                SampleConfig {
                    min_p: f64::NAN,
                    ..ok.clone()
                },
                "--min-p",
            ),
        ];
        for (c, flag) in bad {
            let e = c.validate().unwrap_err().to_string();
            assert!(e.contains(flag), "{e}");
        }
        assert!(SampleConfig { min_p: 0.5, ..ok }.validate().is_ok());
    }

    #[test]
    fn draw_respects_the_allowed_set() {
        let p = [0.5, 0.3, 0.2];
        assert_eq!(draw(&p, 0.1, |_| true), Some(0));
        assert_eq!(draw(&p, 0.1, |i| i != 0), Some(1));
        assert_eq!(draw(&p, 0.99, |i| i == 2), Some(2));
        assert_eq!(draw(&p, 0.5, |_| false), None);
    }

    fn vocab() -> Vocab {
        Vocab::new(crate::tokenizer::RemiConfig::default()).unwrap()
    }

    /// Logits that are 0 except for `bias` on some ids: a fabricated model
    /// that wants the same tokens at every step.
    fn fake_logits(v: &Vocab, bias: &[(u32, f32)]) -> Vec<f32> {
        let mut l = vec![0.0f32; v.len()];
        for &(id, b) in bias {
            l[id as usize] = b;
        }
        l
    }

    /// Samples from `BOS` with the same logits at every step, as `generate`
    /// steps a sequence.
    fn run_fake(v: &Vocab, cfg: &SampleConfig, logits: &[f32]) -> Sample {
        let mut seq = Sequence::new(v, &[BOS_ID], cfg.seed, cfg).unwrap();
        for generated in 0..cfg.max_tokens {
            if seq.step(logits, generated, v, cfg).is_none() {
                break;
            }
        }
        seq.finish(v)
    }

    fn cfg(max_tokens: usize, seed: u64) -> SampleConfig {
        SampleConfig {
            max_tokens,
            seed,
            ..Default::default()
        }
    }

    #[test]
    fn programs_outside_the_allowed_set_are_never_drawn() {
        let v = vocab();
        let cello = v.id(Token::Program(42)).unwrap();
        let piano = v.id(Token::Program(0)).unwrap();
        // A model that prefers the cello by far.
        let logits = fake_logits(&v, &[(cello, 12.0), (piano, 2.0)]);
        let free = run_fake(&v, &cfg(400, 1), &logits);
        assert_eq!(programs_of(&v, &free.tokens), vec![42]);
        let piano_only = SampleConfig {
            programs: Some(vec![0]),
            ..cfg(400, 1)
        };
        let kept = run_fake(&v, &piano_only, &logits);
        assert_eq!(programs_of(&v, &kept.tokens), vec![0]);
        // The ban leaves the rest of the piece to the model: it still has notes.
        let notes = kept.tokens.iter().filter(|&&t| t == piano).count();
        assert!(notes > 10, "{notes} notes");
        assert_eq!(program_bans(&v, None), Vec::<u32>::new());
        assert_eq!(
            program_bans(&v, Some(&[0, DRUMS])).len(),
            v.range(TokenType::Program).len() - 2
        );
        let empty = SampleConfig {
            programs: Some(vec![]),
            ..cfg(4, 0)
        };
        assert!(empty.validate().is_err());
    }

    #[test]
    fn eos_waits_for_the_full_length_unless_an_early_end_is_allowed() {
        let v = vocab();
        let logits = fake_logits(&v, &[(EOS_ID, 30.0)]);
        for seed in 0..5 {
            let s = run_fake(&v, &cfg(300, seed), &logits);
            assert_eq!(s.stop, Stop::MaxTokens);
            assert!(!s.tokens.contains(&EOS_ID));
            // Only a trailing unfinished note may be trimmed; every draw counts.
            assert!(s.tokens.len() - s.prompt_len > 295, "{}", s.tokens.len());
            assert_eq!(s.drawn, 300);
            crate::tokenizer::validate(&s.tokens, &v).unwrap();
        }
        // Allowed anywhere: the first token is EOS.
        let early = SampleConfig {
            earliest_end: Some(0),
            ..cfg(300, 0)
        };
        let s = run_fake(&v, &early, &logits);
        assert_eq!((s.stop, s.tokens.len(), s.drawn), (Stop::Eos, 1, 1));
        // Allowed after 50: it ends as soon as the grammar allows.
        let after = SampleConfig {
            earliest_end: Some(50),
            ..cfg(300, 0)
        };
        let s = run_fake(&v, &after, &logits);
        assert_eq!(s.stop, Stop::Eos);
        let made = s.tokens.len() - s.prompt_len;
        assert!((50..60).contains(&made), "{made}");
        // Masked EOS never comes back through a fallback, even unconstrained
        // with every other token at -inf.
        let mut only_eos = vec![f32::NEG_INFINITY; v.len()];
        only_eos[EOS_ID as usize] = 0.0;
        let mut rng = ChaCha8Rng::seed_from_u64(0);
        let g = Grammar::new(&v);
        let p = pick(&only_eos, &cfg(1, 0), Some(&g), false, &[], &[], &mut rng);
        assert_ne!(p.token, EOS_ID);
    }

    #[test]
    fn a_set_goes_on_with_a_new_tune_where_the_model_ends_one() {
        let v = vocab();
        // A model that would end every tune as soon as the grammar lets it.
        let logits = fake_logits(&v, &[(EOS_ID, 6.0), (BAR_ID, 3.0)]);
        let set = SampleConfig {
            set: true,
            ..cfg(400, 3)
        };
        let mut seq = Sequence::new(&v, &[BOS_ID], set.seed, &set).unwrap();
        for generated in 0..set.max_tokens {
            if seq.step(&logits, generated, &v, &set).is_none() {
                break;
            }
        }
        let fed = seq.fed.clone();
        let s = seq.finish(&v);
        assert_eq!(s.stop, Stop::MaxTokens);
        assert!(s.tunes > 10, "{} tunes", s.tunes);
        // The model read EOS BOS between tunes; the piece holds neither.
        let eos = fed.iter().filter(|&&t| t == EOS_ID).count();
        let bos = fed.iter().filter(|&&t| t == BOS_ID).count();
        assert_eq!((eos, bos), (s.tunes - 1, s.tunes));
        assert!(fed.windows(2).all(|w| w[0] != EOS_ID || w[1] == BOS_ID));
        assert!(!s.tokens.contains(&EOS_ID));
        assert_eq!(s.tokens.iter().filter(|&&t| t == BOS_ID).count(), 1);
        // Every EOS was drawn after a bar of its tune; the piece is one valid
        // sequence that decodes without a skipped token.
        crate::tokenizer::validate(&s.tokens, &v).unwrap();
        let (_, report) = crate::tokenizer::decode(&s.tokens, &v);
        assert!(report.is_clean(), "{report:?}");
        // The later tunes are played on the instruments of the first with notes.
        let band = (0..fed.len())
            .filter(|&i| fed[i] == EOS_ID)
            .map(|i| programs_of(&v, &fed[..i]))
            .find(|p| !p.is_empty())
            .unwrap();
        assert_eq!(programs_of(&v, &s.tokens), band);
        assert!(s.tokens.len() > 100);
        // Unless each tune may bring in any: then the later ones do.
        let any = SampleConfig {
            keep_first_instruments: false,
            ..set.clone()
        };
        let free = run_fake(&v, &any, &logits);
        assert!(programs_of(&v, &free.tokens).len() > band.len() + 5);
        // Without `set` the same model is kept from ending: one tune.
        let one = run_fake(&v, &cfg(400, 3), &logits);
        assert_eq!((one.tunes, one.stop), (1, Stop::MaxTokens));
        // A set never ends early, so an earliest end is refused, naming the flags.
        let both = SampleConfig {
            earliest_end: Some(0),
            ..set
        };
        let err = both.validate().unwrap_err().to_string();
        assert!(
            err.contains("--set") && err.contains("--allow-early-end"),
            "{err}"
        );
    }

    /// The longest run of one pitch among the Pitch tokens after the prompt.
    fn longest_run(v: &Vocab, s: &Sample, pitch: u32) -> usize {
        let (mut run, mut best) = (0, 0);
        for &t in &s.tokens[s.prompt_len..] {
            if v.kind(t) == Some(TokenType::Pitch) {
                run = if t == pitch { run + 1 } else { 0 };
                best = best.max(run);
            }
        }
        best
    }

    #[test]
    fn the_guard_breaks_a_run_of_one_pitch() {
        let v = vocab();
        let c60 = v.id(crate::tokenizer::Token::Pitch(60)).unwrap();
        let prog0 = v.id(crate::tokenizer::Token::Program(0)).unwrap();
        let logits = fake_logits(&v, &[(c60, 20.0), (prog0, 20.0)]);
        let off = SampleConfig {
            guard: GuardConfig::off(),
            ..cfg(400, 1)
        };
        let free = run_fake(&v, &off, &logits);
        assert!(longest_run(&v, &free, c60) > 20, "{:?}", free.tokens);
        assert_eq!(free.guard_changes, 0);
        let guarded = run_fake(&v, &cfg(400, 1), &logits);
        assert!(longest_run(&v, &guarded, c60) <= 8);
        assert!(
            longest_run(&v, &guarded, c60) >= 8,
            "the model still gets its way up to K"
        );
        assert!(guarded.guard_changes > 0);
        crate::tokenizer::validate(&guarded.tokens, &v).unwrap();
        // Fewer allowed repeats, shorter runs.
        let strict = SampleConfig {
            guard: GuardConfig {
                max_same_pitch: 3,
                ..Default::default()
            },
            ..cfg(400, 1)
        };
        assert_eq!(longest_run(&v, &run_fake(&v, &strict, &logits), c60), 3);
    }

    #[test]
    fn the_guard_cuts_long_notes() {
        let v = vocab();
        let range = v.range(TokenType::Duration);
        let longest = range.end - 1;
        let logits = fake_logits(&v, &[(longest, 20.0)]);
        let limit = 16 * v.config().positions_per_quarter;
        let long_notes = |s: &Sample| {
            s.tokens
                .iter()
                .filter(|&&t| {
                    range.contains(&t) && v.durations()[(t - range.start) as usize] > limit
                })
                .count()
        };
        let off = SampleConfig {
            guard: GuardConfig::off(),
            ..cfg(300, 2)
        };
        let free = run_fake(&v, &off, &logits);
        assert!(long_notes(&free) > 5, "{}", long_notes(&free));
        let guarded = run_fake(&v, &cfg(300, 2), &logits);
        assert_eq!(long_notes(&guarded), 0);
        assert!(guarded.guard_changes >= long_notes(&free).min(1));
        assert!(count_type(&guarded.tokens, &v, TokenType::Duration) > 5);
    }

    #[test]
    fn bans_apply_before_top_k_and_top_p() {
        let logits = [5.0f32, 4.0, 3.0, 2.0];
        let top1 = SampleConfig {
            top_k: 1,
            ..Default::default()
        };
        for u in [0.0, 0.5, 0.99] {
            assert_eq!(choose(&logits, &top1, None, &[0], u), (1, false));
        }
        // The nucleus is taken over what the bans leave: 1 alone holds 0.95
        // of the mass once 0 is gone and 2, 3 are far below.
        let logits = [9.0f32, 8.0, 0.0, 0.0];
        let nucleus = SampleConfig {
            top_p: 0.9,
            ..Default::default()
        };
        for u in [0.0, 0.5, 0.99] {
            assert_eq!(choose(&logits, &nucleus, None, &[0], u).0, 1);
        }
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
