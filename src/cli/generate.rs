//! Commands that make music: generate, render, stats.
//!
//! `generate` takes its sampling settings from the flags, then the model's
//! `generation_config.json`, then the built-in defaults, and writes beside
//! every piece `OUT.json` ([`PieceRecord`]): the model's hashes, the seed,
//! every setting, the prompt and what happened, enough to make the piece
//! again. Like every output, it is checked against the inputs before the
//! model runs and written atomically.

use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{bail, Context, Result};
use serde::{Deserialize, Serialize};
use tracing::{debug, info, warn};

use crate::eval::form;
use crate::midi;
use crate::render;
use crate::sample::{self, pieces, SampleConfig};
use crate::tokenizer;
use crate::train::checkpoint;

/// `cadenza generate`. The sampling flags without a default here take the
/// model's `generation_config.json` when it has one, else the built-in
/// defaults shown in their help ([`checkpoint::GenerationConfig`]).
#[derive(clap::Args, Debug)]
pub struct GenerateArgs {
    /// Trained run folder or shipped model folder (e.g. models/cadenza-small).
    #[arg(long)]
    pub model: PathBuf,
    /// MIDI file to continue (default: start from nothing).
    #[arg(long)]
    pub prompt: Option<PathBuf>,
    /// Use only the first N bars of the prompt.
    #[arg(long)]
    pub prompt_bars: Option<usize>,
    /// Tokens to draw after the prompt: the model may not end a piece
    /// sooner unless --allow-early-end, --min-tokens or --max-bars says
    /// otherwise. A note left unfinished by the limit (its Position, Program,
    /// Pitch and Velocity without a Duration) is dropped, so a piece keeps up
    /// to 4 tokens fewer [default: 3072].
    #[arg(long)]
    pub tokens: Option<usize>,
    /// Let the model end a piece (EOS) before --tokens.
    #[arg(long)]
    pub allow_early_end: bool,
    /// Let the model end a piece, but only after this many tokens (implies
    /// --allow-early-end).
    #[arg(long)]
    pub min_tokens: Option<usize>,
    /// Stop when the piece reaches this many bars.
    #[arg(long)]
    pub max_bars: Option<usize>,
    /// Write a set of tunes: where the model ends a tune, the piece goes on with
    /// a new one (at the next bar line, in its own metre and tempo) instead of the
    /// model being kept from ending it. The piece still runs to --tokens or
    /// --max-bars; not with --allow-early-end or --min-tokens.
    #[arg(long)]
    pub set: bool,
    /// Sample without the repetition guard (which masks notes longer than
    /// --max-note-quarters, a pitch already played --max-same-pitch times
    /// in a row by one instrument, and a note that would make a phrase of 8
    /// pitches one instrument has played --max-phrase-repeats times already
    /// within its last 256 notes).
    #[arg(long)]
    pub no_repetition_guard: bool,
    /// Repetition guard: longest note, in quarter notes (0 = no limit)
    /// [default: 16].
    #[arg(long)]
    pub max_note_quarters: Option<f64>,
    /// Repetition guard: most notes in a row of one pitch on one instrument;
    /// drums are exempt (0 = no limit) [default: 8].
    #[arg(long)]
    pub max_same_pitch: Option<usize>,
    /// Repetition guard: how often one instrument may play a phrase of 8
    /// pitches within its last 256 notes; drums are exempt (0 = no limit;
    /// loop-based styles such as video-game music want 0 or a higher limit)
    /// [default: 8].
    #[arg(long)]
    pub max_phrase_repeats: Option<usize>,
    /// Repetition guard: how often one instrument may play a phrase of 16
    /// pitches within its last 512 notes, so that a whole phrase or strain
    /// is not looped to the end; drums are exempt (0 = no limit) [default: 4].
    #[arg(long)]
    pub max_long_phrase_repeats: Option<usize>,
    /// Pieces to generate (as one batch): OUT-1.mid, OUT-2.mid ... (at
    /// most 100000, and as many as --max-memory-mb allows).
    #[arg(long, default_value_t = 1)]
    pub num_samples: usize,
    /// Sampling temperature (1 = the model's distribution) [default: 1].
    #[arg(long)]
    pub temperature: Option<f64>,
    /// Keep the k most likely tokens (0 = off) [default: 0].
    #[arg(long)]
    pub top_k: Option<usize>,
    /// Nucleus sampling threshold (1 = off) [default: 0.95].
    #[arg(long)]
    pub top_p: Option<f64>,
    /// Keep only the tokens at least this fraction as likely as the likeliest one
    /// (min-p sampling; 0 = off): it cuts more where the model is sure, as when it
    /// plays a strain again, and less where it is not [default: 0].
    #[arg(long)]
    pub min_p: Option<f64>,
    /// Seed of the sampling and of the frozen SPE noise and FAVOR+ features.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Sample without the grammar constraint.
    #[arg(long)]
    pub unconstrained: bool,
    /// Instruments the piece may use: `prompt` (those of the prompt; any
    /// when there is no prompt), `any`, or General MIDI program numbers and
    /// `drums`, comma-separated (e.g. `0,33,drums`); in a --set without a prompt,
    /// `prompt` keeps the first tune's instruments [default: prompt].
    #[arg(long)]
    pub programs: Option<String>,
    /// Device to run the model on: auto (CUDA when available), cpu, cuda or cuda:N.
    #[arg(long)]
    pub device: Option<super::DeviceArg>,
    /// CPU threads for libtorch (default: all cores). Reading the prompt uses them all;
    /// the steps of up to 8 pieces run on one.
    #[arg(long, default_value_t = 0)]
    pub threads: usize,
    /// Precision of the dense products: auto (bf16 on CUDA and on CPUs with AMX or
    /// AVX512-BF16, f32 elsewhere), f32 or bf16 (on the CPU: bf16 weights, f32 sums).
    #[arg(long, value_enum, default_value_t = crate::model::Precision::Auto)]
    pub precision: crate::model::Precision,
    /// Output MIDI file; a record of how it was made (model, seed, every
    /// setting) is written beside it as OUT.json.
    #[arg(short, long)]
    pub output: PathBuf,
    /// Also render audio (WAV) here.
    #[arg(long)]
    pub wav: Option<PathBuf>,
    /// Also draw a piano roll (PNG) here.
    #[arg(long)]
    pub png: Option<PathBuf>,
    /// Also write the token strings here.
    #[arg(long)]
    pub tokens_out: Option<PathBuf>,
    /// SoundFont for --wav (default: a system General MIDI SoundFont).
    #[arg(long)]
    pub soundfont: Option<PathBuf>,
    /// Longest prompt, in tokens (after --prompt-bars); a longer one is refused.
    #[arg(long, default_value_t = 16_384)]
    pub max_prompt_tokens: usize,
    /// Memory that generation may use, in MiB (default: half of the memory
    /// available now, or 8 GiB where unknown). --num-samples, --tokens and
    /// the prompt are checked against it before the model runs.
    #[arg(long)]
    pub max_memory_mb: Option<u64>,
    #[command(flatten)]
    pub limits: super::LimitOpt,
}

/// The settings of one `generate` run after flags, the model's
/// `generation_config.json` and the built-in defaults are merged.
#[derive(Debug, Clone, PartialEq)]
struct Resolved {
    tokens: usize,
    earliest_end: Option<usize>,
    max_bars: Option<usize>,
    set: bool,
    temperature: f64,
    top_k: usize,
    top_p: f64,
    min_p: f64,
    constrained: bool,
    guard: sample::GuardConfig,
    programs: String,
}

/// Flags first, then the file's values (`g`).
fn resolve(a: &GenerateArgs, g: &checkpoint::GenerationConfig) -> Resolved {
    let earliest_end = match (a.min_tokens, a.allow_early_end) {
        (Some(m), _) => Some(m),
        (None, true) => Some(0),
        (None, false) => g.earliest_end(),
    };
    Resolved {
        tokens: a.tokens.unwrap_or(g.tokens),
        earliest_end,
        max_bars: a.max_bars.or(g.max_bars),
        set: a.set || g.set,
        temperature: a.temperature.unwrap_or(g.temperature),
        top_k: a.top_k.unwrap_or(g.top_k),
        top_p: a.top_p.unwrap_or(g.top_p),
        min_p: a.min_p.unwrap_or(g.min_p),
        constrained: !a.unconstrained && g.constrained,
        guard: sample::GuardConfig {
            enabled: !a.no_repetition_guard && g.repetition_guard,
            max_note_quarters: a.max_note_quarters.unwrap_or(g.max_note_quarters),
            max_same_pitch: a.max_same_pitch.unwrap_or(g.max_same_pitch),
            max_phrase_repeats: a.max_phrase_repeats.unwrap_or(g.max_phrase_repeats),
            max_long_phrase_repeats: a
                .max_long_phrase_repeats
                .unwrap_or(g.max_long_phrase_repeats),
        },
        programs: a.programs.clone().unwrap_or_else(|| g.programs.clone()),
    }
}

/// The extension of the record written beside every piece (`OUT.json`).
pub const RECORD_EXTENSION: &str = "json";

/// The model a piece came from.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ModelRecord {
    /// `--model` as given.
    pub path: String,
    /// SHA-256 of the weights (`model.safetensors`) sampled with.
    pub weights_sha256: String,
    /// SHA-256 of its `config.json`.
    pub config_sha256: String,
    /// The `generation_config.json` whose defaults applied, if any.
    pub generation_config: Option<String>,
}

fn one_tune() -> usize {
    1
}

/// The prompt a piece continued.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PromptRecord {
    /// `--prompt` as given.
    pub path: String,
    /// `--prompt-bars` (none: the whole file).
    pub bars: Option<usize>,
}

/// What `generate` writes beside every piece (`OUT.json`): enough to make
/// the same piece again ([`PieceRecord::generate_args`]). Its keys follow
/// the studio's record (`model`, `prompt`, `sample`, `sample_config`,
/// `prompt_tokens`, `tokens`, `stop`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PieceRecord {
    /// The model sampled.
    pub model: ModelRecord,
    /// Hash of the vocabulary (`vocab.json`).
    pub vocab_hash: String,
    /// `--seed`.
    pub seed: u64,
    /// `--device` as resolved (e.g. `cpu`, `cuda:0`).
    pub device: String,
    /// `--precision` as resolved (`f32` or `bf16`; records from before it: f32).
    #[serde(default = "crate::model::precision::f32_before_it_was_recorded")]
    pub precision: crate::model::Precision,
    /// None when the piece started from nothing.
    pub prompt: Option<PromptRecord>,
    /// This piece's number in its batch, from 1.
    pub sample: usize,
    /// `--num-samples`: the pieces of one batch are drawn together.
    pub num_samples: usize,
    /// `--programs` as applied (before the prompt's instruments replace `prompt`).
    pub programs: String,
    /// Every sampling setting, as the sampler took it.
    pub sample_config: SampleConfig,
    /// Tokens of BOS and the prompt.
    pub prompt_tokens: usize,
    /// Tokens of the whole piece (prompt included).
    pub tokens: usize,
    /// Why sampling stopped.
    pub stop: sample::Stop,
    /// The tunes in the piece: more than 1 only with `--set` (records from
    /// before it: 1).
    #[serde(default = "one_tune")]
    pub tunes: usize,
    /// Draws the grammar replaced.
    pub grammar_corrections: usize,
    /// Draws the repetition guard changed.
    pub guard_changes: usize,
    /// The `generate` arguments that make this piece again (add `-o`).
    pub command: Vec<String>,
}

impl PieceRecord {
    /// The arguments of `cadenza generate` (without the program name and
    /// the outputs) that sample this record's batch again, from its fields.
    pub fn generate_args(&self) -> Vec<String> {
        let c = &self.sample_config;
        let mut v: Vec<String> = vec!["generate".into(), "--model".into(), self.model.path.clone()];
        let mut flag = |f: &str, x: String| {
            v.push(f.to_string());
            v.push(x);
        };
        if let Some(p) = &self.prompt {
            flag("--prompt", p.path.clone());
            if let Some(b) = p.bars {
                flag("--prompt-bars", b.to_string());
            }
        }
        flag("--seed", self.seed.to_string());
        flag("--device", self.device.clone());
        flag("--precision", self.precision.to_string());
        flag("--num-samples", self.num_samples.to_string());
        flag("--tokens", c.max_tokens.to_string());
        flag("--temperature", c.temperature.to_string());
        flag("--top-k", c.top_k.to_string());
        flag("--top-p", c.top_p.to_string());
        flag("--min-p", c.min_p.to_string());
        flag("--max-note-quarters", c.guard.max_note_quarters.to_string());
        flag("--max-same-pitch", c.guard.max_same_pitch.to_string());
        flag(
            "--max-phrase-repeats",
            c.guard.max_phrase_repeats.to_string(),
        );
        flag(
            "--max-long-phrase-repeats",
            c.guard.max_long_phrase_repeats.to_string(),
        );
        flag("--programs", self.programs.clone());
        if let Some(b) = c.max_bars {
            flag("--max-bars", b.to_string());
        }
        if let Some(m) = c.earliest_end {
            flag("--min-tokens", m.to_string());
        }
        if c.set {
            v.push("--set".into());
        }
        if !c.guard.enabled {
            v.push("--no-repetition-guard".into());
        }
        if !c.constrained {
            v.push("--unconstrained".into());
        }
        v
    }
}

/// SHA-256 of a file, in hex; errors name it.
fn sha256_file(path: &Path) -> Result<String> {
    use sha2::{Digest, Sha256};
    let mut f =
        std::fs::File::open(path).with_context(|| format!("cannot read {}", path.display()))?;
    let mut h = Sha256::new();
    std::io::copy(&mut f, &mut h).with_context(|| format!("cannot read {}", path.display()))?;
    Ok(h.finalize().iter().map(|b| format!("{b:02x}")).collect())
}

/// `cadenza render`.
#[derive(clap::Args, Debug)]
pub struct RenderArgs {
    /// MIDI file.
    pub input: PathBuf,
    /// Output WAV file.
    #[arg(short, long)]
    pub output: PathBuf,
    /// Also draw a piano roll (PNG) here.
    #[arg(long)]
    pub png: Option<PathBuf>,
    /// General MIDI SoundFont (default: a system General MIDI SoundFont).
    #[arg(long)]
    pub soundfont: Option<PathBuf>,
    /// Samples per second of the WAV file.
    #[arg(long, default_value_t = 44_100)]
    pub sample_rate: u32,
    #[command(flatten)]
    pub limits: super::LimitOpt,
}

/// OUT.mid for one sample, OUT-1.mid, OUT-2.mid ... for several.
pub fn numbered(path: &Path, i: usize, n: usize) -> PathBuf {
    if n == 1 {
        return path.to_path_buf();
    }
    let stem = path
        .file_stem()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_default();
    let name = match path.extension() {
        Some(e) => format!("{stem}-{}.{}", i + 1, e.to_string_lossy()),
        None => format!("{stem}-{}", i + 1),
    };
    path.with_file_name(name)
}

/// Every output path of `generate` (numbered per sample), with its flag.
fn generate_outputs(a: &GenerateArgs) -> Vec<(&'static str, PathBuf)> {
    let n = a.num_samples;
    let mut out = Vec::new();
    for i in 0..n {
        let midi = numbered(&a.output, i, n);
        out.push(("the record of -o", midi.with_extension(RECORD_EXTENSION)));
        out.push(("-o", midi));
        for (flag, p) in [
            ("--wav", &a.wav),
            ("--png", &a.png),
            ("--tokens-out", &a.tokens_out),
        ] {
            if let Some(p) = p {
                out.push((flag, numbered(p, i, n)));
            }
        }
    }
    out
}

/// Most pieces of one `generate` (`--num-samples`): checked before the
/// output paths are listed.
pub const MAX_NUM_SAMPLES: usize = 100_000;

/// Refuses an earliest end after the last token (`--min-tokens` above
/// `--tokens`), naming where the minimum came from.
fn check_earliest_end(r: &Resolved, from_flag: bool, file: Option<&Path>) -> Result<()> {
    if let Some(m) = r.earliest_end.filter(|&m| m > r.tokens) {
        let source = match (from_flag, file) {
            (false, Some(f)) => format!("min_tokens {m} of {}", f.display()),
            _ => format!("--min-tokens {m}"),
        };
        bail!(
            "{source} is more than --tokens {}: a piece ends after {} tokens at the latest",
            r.tokens,
            r.tokens
        );
    }
    Ok(())
}

/// Refuses a generation whose estimated memory exceeds the budget.
fn check_memory(
    a: &GenerateArgs,
    tokens: usize,
    cfg: &crate::model::ModelConfig,
    prompt_len: usize,
) -> Result<()> {
    let need = sample::estimate_bytes(cfg, a.num_samples, prompt_len, tokens);
    let (budget, source) = match a.max_memory_mb {
        Some(mb) => (mb as u128 * (1 << 20), "--max-memory-mb"),
        None => match crate::limits::available_memory() {
            Some(b) => (b as u128 / 2, "half of the available memory"),
            None => (8u128 << 30, "the default 8 GiB"),
        },
    };
    if need > budget {
        bail!(
            "--num-samples {} x (a {prompt_len}-token prompt + --tokens {}) needs about {} MiB, \
             more than {} MiB ({source}); generate fewer or shorter pieces, or raise \
             --max-memory-mb",
            a.num_samples,
            tokens,
            need >> 20,
            budget >> 20
        );
    }
    Ok(())
}

/// Samples pieces and writes them, each with its record.
pub fn generate(a: GenerateArgs) -> Result<i32> {
    if !(1..=MAX_NUM_SAMPLES).contains(&a.num_samples) {
        bail!(
            "--num-samples must be in 1..={MAX_NUM_SAMPLES} (got {})",
            a.num_samples
        );
    }
    if a.prompt_bars == Some(0) {
        bail!("--prompt-bars 0 would drop the whole prompt; give at least 1 bar, or leave out --prompt to start from nothing");
    }
    if a.prompt_bars.is_some() && a.prompt.is_none() {
        bail!("--prompt-bars needs --prompt");
    }
    crate::train::config::check_threads(a.threads, "--threads")?;
    {
        // The model and run folders are read whole (crate::output): no
        // output may replace any file in them.
        let mut plan = crate::output::Plan::new();
        plan.read("--model", &a.model)
            .read("--model", checkpoint::run_folder(&a.model));
        if let Some(p) = &a.prompt {
            plan.read("--prompt", p);
        }
        if let Some(sf) = &a.soundfont {
            plan.read("--soundfont", sf);
        }
        for (flag, p) in &generate_outputs(&a) {
            plan.write(flag, p);
        }
        plan.check()?;
    }
    let (defaults, defaults_file) = checkpoint::read_generation_config(&a.model)?;
    if let Some(f) = &defaults_file {
        debug!("sampling defaults from {}", f.display());
    }
    let r = resolve(&a, &defaults);
    check_earliest_end(&r, a.min_tokens.is_some(), defaults_file.as_deref())?;
    let device_name = super::device_name(a.device);
    let device = checkpoint::parse_device(device_name.as_deref())?;
    crate::train::set_threads(a.threads);
    // Fail early on a missing SoundFont rather than after sampling.
    let soundfont = match &a.wav {
        Some(_) => Some(render::find_soundfont(a.soundfont.as_deref())?),
        None => None,
    };
    let mut m = checkpoint::load_model(&a.model, device)?;
    m.model.freeze(a.seed);
    let precision = m.model.set_precision(a.precision);
    info!("precision: {precision}");
    let vocab = &m.vocab;
    let limits = a.limits.limits();
    let (prompt_file, body) = match &a.prompt {
        Some(p) => {
            let (score, report) = midi::read_file_with(p, &limits)?;
            let name = p.display().to_string();
            let (ids, warnings) = pieces::prompt_body(&score, &report, vocab, &name)?;
            for w in warnings {
                warn!("{name}: {w}");
            }
            (Some(score), ids)
        }
        None => (None, Vec::new()),
    };
    let prompt = sample::prompt_tokens(&body, a.prompt_bars);
    if prompt.len() > a.max_prompt_tokens {
        bail!(
            "{}: the prompt is {} tokens long, more than --max-prompt-tokens {}; \
             use --prompt-bars to keep its beginning, or raise the limit",
            a.prompt.as_deref().unwrap_or(Path::new("prompt")).display(),
            prompt.len(),
            a.max_prompt_tokens
        );
    }
    check_memory(&a, r.tokens, &m.config.model, prompt.len())?;
    let programs = pieces::parse_programs(&r.programs, &sample::programs_of(vocab, &prompt))?;
    let cfg = SampleConfig {
        max_tokens: r.tokens,
        max_bars: r.max_bars,
        temperature: r.temperature,
        top_k: r.top_k,
        top_p: r.top_p,
        min_p: r.min_p,
        seed: a.seed,
        constrained: r.constrained,
        earliest_end: r.earliest_end,
        set: r.set,
        keep_first_instruments: pieces::keeps_first_instruments(&r.programs),
        guard: r.guard.clone(),
        programs,
    };
    debug!("sampling with {cfg:?}");
    let model_record = ModelRecord {
        path: a.model.display().to_string(),
        weights_sha256: sha256_file(&m.dir.join(checkpoint::MODEL_FILE))?,
        config_sha256: sha256_file(&m.run.join(checkpoint::CONFIG_FILE))?,
        generation_config: defaults_file.map(|f| f.display().to_string()),
    };
    let device_used = match device {
        tch::Device::Cpu => "cpu".to_string(),
        tch::Device::Cuda(n) => format!("cuda:{n}"),
        other => format!("{other:?}"),
    };
    let pb = indicatif::ProgressBar::new(r.tokens as u64);
    pb.set_style(
        indicatif::ProgressStyle::with_template(
            "{spinner} generating [{bar:30}] {pos}/{len} tokens {per_sec} ETA {eta}",
        )
        .expect("valid template")
        .progress_chars("=> "),
    );
    let t0 = Instant::now();
    let samples = sample::generate(&m.model, vocab, &prompt, a.num_samples, &cfg, &mut |n| {
        pb.set_position(n as u64)
    })?;
    pb.finish_and_clear();
    let secs = t0.elapsed().as_secs_f64();
    let generated: usize = samples.iter().map(|s| s.tokens.len() - s.prompt_len).sum();
    let guarded: usize = samples.iter().map(|s| s.guard_changes).sum();
    info!(
        "generated {generated} tokens in {secs:.1} s ({:.0} tokens/s)",
        generated as f64 / secs.max(1e-9)
    );
    // Every piece is written before anything is printed, so a reader that
    // stops early (`| head -1`, which ends the process) loses none of them.
    let mut report = vec![format!(
        "generated {generated} tokens after a {}-token prompt; \
         the repetition guard changed {guarded} draw(s){}",
        prompt.len(),
        if cfg.guard.enabled { "" } else { " (off)" }
    )];
    let n = samples.len();
    for (i, s) in samples.iter().enumerate() {
        let files = pieces::PieceFiles {
            midi: numbered(&a.output, i, n),
            tokens: a.tokens_out.as_ref().map(|t| numbered(t, i, n)),
            wav: a.wav.as_ref().map(|w| numbered(w, i, n)),
            png: a.png.as_ref().map(|p| numbered(p, i, n)),
            piano_roll: render::PianoRollOptions::default(),
        };
        let w = pieces::write_piece(s, vocab, &files, soundfont.as_deref(), prompt_file.as_ref())?;
        if let Some(msg) = pieces::silence_warning(cfg.programs.as_deref(), &w.played) {
            warn!("{}: {msg}", files.midi.display());
        }
        let mut record = PieceRecord {
            model: model_record.clone(),
            vocab_hash: vocab.hash().to_string(),
            seed: a.seed,
            device: device_used.clone(),
            precision: precision.precision,
            prompt: a.prompt.as_ref().map(|p| PromptRecord {
                path: p.display().to_string(),
                bars: a.prompt_bars,
            }),
            sample: i + 1,
            num_samples: n,
            programs: r.programs.clone(),
            sample_config: cfg.clone(),
            prompt_tokens: s.prompt_len,
            tokens: s.tokens.len(),
            stop: s.stop,
            tunes: s.tunes,
            grammar_corrections: s.grammar_corrections,
            guard_changes: s.guard_changes,
            command: Vec::new(),
        };
        record.command = record.generate_args();
        let record_path = files.midi.with_extension(RECORD_EXTENSION);
        crate::util::write_json(&record_path, &record)?;
        report.push(format!(
            "{}: {} tokens, {} notes, {:.1} s{}, stopped by {:?}; {} grammar correction(s), \
             {} guard change(s), {} skipped token(s)",
            files.midi.display(),
            s.tokens.len(),
            w.score.notes.len(),
            w.score.duration_seconds(),
            if cfg.set {
                let plural = if s.tunes == 1 { "" } else { "s" };
                format!(", a set of {} tune{plural}", s.tunes)
            } else {
                String::new()
            },
            s.stop,
            s.grammar_corrections,
            s.guard_changes,
            w.skipped
        ));
        report.push(format!("{}: how it was made", record_path.display()));
        if let Some(path) = &files.tokens {
            report.push(format!("{}: tokens", path.display()));
        }
        if let (Some(path), Some(st)) = (&files.wav, &w.audio) {
            report.push(format!("{}: {:.1} s of audio", path.display(), st.seconds));
        }
        if let Some(path) = &files.png {
            report.push(format!("{}: piano roll", path.display()));
        }
    }
    for line in report {
        println!("{line}");
    }
    Ok(0)
}

/// Renders a MIDI file to WAV (and a piano roll).
pub fn render_cmd(a: RenderArgs) -> Result<i32> {
    {
        let mut inputs: Vec<(&str, &Path)> = vec![("input", &a.input)];
        if let Some(sf) = &a.soundfont {
            inputs.push(("--soundfont", sf));
        }
        let mut outputs: Vec<(&str, &Path)> = vec![("-o", &a.output)];
        if let Some(p) = &a.png {
            outputs.push(("--png", p));
        }
        crate::util::check_outputs(&inputs, &outputs)?;
    }
    let (score, report) = midi::read_file_with(&a.input, &a.limits.limits())?;
    for w in report.warnings() {
        warn!("{}: {w}", a.input.display());
    }
    let sf = render::find_soundfont(a.soundfont.as_deref())?;
    let opts = render::RenderOptions {
        sample_rate: a.sample_rate,
        ..pieces::render_options()
    };
    let st = render::render_wav(&score, &sf, &opts, &a.output)
        .with_context(|| format!("cannot render {}", a.input.display()))?;
    println!(
        "{}: {:.1} s, peak {:.2}, rms {:.3}",
        a.output.display(),
        st.seconds,
        st.peak,
        st.rms
    );
    if let Some(p) = &a.png {
        render::piano_roll_png(&score, p, &render::PianoRollOptions::default())?;
        println!("{}: piano roll", p.display());
    }
    Ok(0)
}

/// `cadenza stats`.
#[derive(clap::Args, Debug)]
pub struct StatsArgs {
    /// Generated MIDI files or folders.
    #[arg(required = true)]
    pub generated: Vec<PathBuf>,
    /// Real pieces: MIDI files or folders, or a dataset folder (its held-out
    /// split, as training draws it with --seed and --val-fraction).
    #[arg(long, required = true, num_args = 1..)]
    pub real: Vec<PathBuf>,
    /// Seed of the split of a --real dataset (the run's --seed).
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Held-out share of a --real dataset (the run's val_fraction).
    #[arg(long, default_value_t = 0.05)]
    pub val_fraction: f64,
    /// At most this many real pieces, spread evenly over the list.
    #[arg(long, default_value_t = 500)]
    pub max_real: usize,
    /// Look at the first N bars of every piece only, generated and real, so
    /// that pieces of unlike lengths compare (the pitch range of a piece
    /// grows with its length).
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..))]
    pub bars: Option<u32>,
    /// Leave out real pieces shorter than N bars, to compare long generated
    /// pieces with real pieces of their length.
    #[arg(long)]
    pub min_real_bars: Option<usize>,
    /// Strain length P of the strain return: bars P+1..2P against bars 1..P.
    #[arg(long, default_value_t = form::DEFAULT_STRAIN_BARS as u32,
          value_parser = clap::value_parser!(u32).range(1..=MAX_STRAIN_BARS as i64))]
    pub strain_bars: u32,
    /// Vocabulary JSON whose grid the form measures read bars on: every
    /// piece is encoded with it (default: the vocabulary of the first --real
    /// dataset, else the built-in REMI+ vocabulary).
    #[arg(long)]
    pub vocab: Option<PathBuf>,
    /// Write the table here too.
    #[arg(long)]
    pub markdown: Option<PathBuf>,
    /// Write the statistics and the form measures (per piece and on
    /// average, generated and real) here as JSON.
    #[arg(long)]
    pub json: Option<PathBuf>,
    /// Draw, for every generated piece, its piano roll beside its bars x bars
    /// self-similarity matrix into this folder (STEM.png; STEM-2.png ... when
    /// two pieces share a name).
    #[arg(long)]
    pub form_png: Option<PathBuf>,
}

/// Longest `--strain-bars` (the form measures read at most
/// [`form::MAX_FORM_BARS`] bars, and a strain return needs twice P).
pub const MAX_STRAIN_BARS: usize = form::MAX_FORM_BARS / 2;

/// The MIDI files of `inputs`, each read, with its path; unreadable files
/// are skipped with a warning.
fn midi_scores(files: &[(PathBuf, String)]) -> Vec<(String, midi::Score)> {
    let mut out = Vec::new();
    for (p, _) in files {
        match midi::read_file(p) {
            Ok((s, _)) => out.push((p.display().to_string(), s)),
            Err(e) => warn!("skipped {}", crate::util::excerpt(&format!("{e:#}"), 800)),
        }
    }
    out
}

/// A piece read by `stats`: where it came from, its score, and its tokens
/// when they come from a dataset in the vocabulary of the form measures.
struct StatsPiece {
    source: String,
    score: midi::Score,
    ids: Option<Vec<u32>>,
}

/// The form measures of one set of pieces, in `stats`'s JSON.
#[derive(Debug, Serialize)]
struct FormSet {
    summary: form::FormSummary,
    pieces: Vec<form::PieceForm>,
}

/// What `stats --json` writes (docs/commands.md, `stats`).
#[derive(Debug, Serialize)]
struct StatsReport {
    /// `--bars`, when given.
    bars: Option<u32>,
    /// `--strain-bars`.
    strain_bars: usize,
    /// Hash of the vocabulary the bars were read with.
    vocab_hash: String,
    /// The music statistics, as in the table.
    statistics: Vec<crate::eval::stats::StatComparison>,
    generated: FormSet,
    real: FormSet,
}

/// `DIR/STEM.png` for each source, numbered from 2 where a name repeats.
fn form_png_paths(dir: &Path, sources: &[PathBuf]) -> Vec<PathBuf> {
    let mut seen = std::collections::HashMap::<String, usize>::new();
    sources
        .iter()
        .map(|p| {
            let stem = p
                .file_stem()
                .map(|s| s.to_string_lossy().into_owned())
                .unwrap_or_else(|| "piece".into());
            let k = seen.entry(stem.clone()).or_insert(0);
            *k += 1;
            match *k {
                1 => dir.join(format!("{stem}.png")),
                k => dir.join(format!("{stem}-{k}.png")),
            }
        })
        .collect()
}

/// Compares music statistics and form measures of generated and real
/// pieces (tables on stdout).
pub fn stats(a: StatsArgs) -> Result<i32> {
    use crate::eval::stats;
    crate::train::config::check_val_fraction(a.val_fraction, "--val-fraction")?;
    let generated_files = tokenizer::dataset::collect_midi_files(&a.generated)?;
    let pngs = a
        .form_png
        .as_ref()
        .map(|d| {
            form_png_paths(
                d,
                &generated_files
                    .iter()
                    .map(|f| f.0.clone())
                    .collect::<Vec<_>>(),
            )
        })
        .unwrap_or_default();
    {
        let mut plan = crate::output::Plan::new();
        for p in &a.generated {
            plan.read("generated", p);
        }
        for p in &a.real {
            plan.read("--real", p);
        }
        if let Some(v) = &a.vocab {
            plan.read("--vocab", v);
        }
        if let Some(m) = &a.markdown {
            plan.write("--markdown", m);
        }
        if let Some(j) = &a.json {
            plan.write("--json", j);
        }
        for p in &pngs {
            plan.write("--form-png", p);
        }
        plan.check()?;
    }
    let mut vocab = match &a.vocab {
        Some(p) => Some(tokenizer::Vocab::load(p)?),
        None => None,
    };
    let generated: Vec<StatsPiece> = midi_scores(&generated_files)
        .into_iter()
        .map(|(source, score)| StatsPiece {
            source,
            score,
            ids: None,
        })
        .collect();
    let mut real = Vec::new();
    for r in &a.real {
        if r.join(tokenizer::dataset::MANIFEST_FILE).is_file() {
            let ds = tokenizer::dataset::Dataset::open(r)?;
            let v = vocab.get_or_insert_with(|| ds.vocab.clone());
            let same = v.hash() == ds.vocab.hash();
            for p in crate::train::data::split(&ds, a.seed, a.val_fraction).val {
                let score = tokenizer::decode(&p.ids, &ds.vocab).0;
                real.push(StatsPiece {
                    source: p.source,
                    score,
                    ids: same.then_some(p.ids),
                });
            }
        } else {
            let files = tokenizer::dataset::collect_midi_files(std::slice::from_ref(r))?;
            real.extend(
                midi_scores(&files)
                    .into_iter()
                    .map(|(source, score)| StatsPiece {
                        source,
                        score,
                        ids: None,
                    }),
            );
        }
    }
    let vocab = match vocab {
        Some(v) => v,
        None => tokenizer::Vocab::new(tokenizer::RemiConfig::default())?,
    };
    if let Some(n) = a.min_real_bars {
        real.retain(|p| stats::piece_stats(&p.score).bars >= n);
    }
    // Spread over the whole list: its first files are one collection.
    let real = crate::train::eval::spread(real, a.max_real);
    if generated.is_empty() || real.is_empty() {
        bail!("need at least one generated and one real piece");
    }
    let measure = |s: &midi::Score| match a.bars {
        Some(n) => stats::piece_stats(&stats::first_bars(s, n as usize)),
        None => stats::piece_stats(s),
    };
    let g: Vec<_> = generated.iter().map(|p| measure(&p.score)).collect();
    let r: Vec<_> = real.iter().map(|p| measure(&p.score)).collect();
    // Form: the bars of the piece's tokens in `vocab` (one definition of a
    // bar for generated and real pieces), cut to --bars.
    let strain = a.strain_bars as usize;
    let form_bars = |p: &StatsPiece| {
        let mut bars = match &p.ids {
            Some(ids) => form::bars(ids, &vocab),
            None => form::bars(&tokenizer::encode(&p.score, &vocab).0, &vocab),
        };
        if let Some(n) = a.bars {
            bars.truncate(n as usize);
        }
        bars
    };
    let forms = |set: &[StatsPiece]| -> FormSet {
        let pieces: Vec<form::PieceForm> = set
            .iter()
            .map(|p| form::piece_form(&p.source, &form_bars(p), strain))
            .collect();
        FormSet {
            summary: form::summarize(&pieces, strain),
            pieces,
        }
    };
    let gf = forms(&generated);
    let rf = forms(&real);
    // Sizes first: whole-piece statistics such as the pitch range grow with
    // the length of a piece, so a reader must see whether the sets compare.
    let sizes = |v: &[stats::PieceStats]| {
        let n = v.len().max(1) as f64;
        let notes = v.iter().map(|s| s.notes as f64).sum::<f64>() / n;
        let bars = v.iter().map(|s| s.bars as f64).sum::<f64>() / n;
        format!(
            "{} pieces of {notes:.0} notes in {bars:.0} bars on average",
            v.len()
        )
    };
    let mut cut = a
        .bars
        .map_or(String::new(), |n| format!(" (first {n} bars of each)"));
    if let Some(n) = a.min_real_bars {
        cut += &format!(" (real pieces of at least {n} bars)");
    }
    let heading = format!("generated: {}; real: {}{cut}", sizes(&g), sizes(&r));
    let rows = stats::compare(&g, &r);
    let table = stats::markdown(&rows);
    let form_text = format!(
        "\nform (bars read on the grid of vocabulary {}):\n\n{}\ngenerated pieces:\n\n{}",
        vocab.hash(),
        form::markdown(&gf.summary, &rf.summary),
        form::piece_table(&gf.pieces)
    );
    println!("{heading}\n");
    print!("{table}");
    print!("{form_text}");
    if let Some(m) = &a.markdown {
        crate::util::write_atomic(m, format!("{heading}\n\n{table}{form_text}").as_bytes())?;
    }
    if let Some(j) = &a.json {
        let report = StatsReport {
            bars: a.bars,
            strain_bars: strain,
            vocab_hash: vocab.hash().to_string(),
            statistics: rows,
            generated: gf,
            real: rf,
        };
        crate::util::write_json(j, &report)?;
        println!("{}: statistics and form measures", j.display());
    }
    if let Some(dir) = &a.form_png {
        std::fs::create_dir_all(dir)
            .with_context(|| format!("cannot create --form-png folder {}", dir.display()))?;
        // `generated` holds the files that could be read, in order.
        let by_source: std::collections::HashMap<String, &PathBuf> = generated_files
            .iter()
            .zip(&pngs)
            .map(|((p, _), png)| (p.display().to_string(), png))
            .collect();
        for p in &generated {
            let Some(png) = by_source.get(&p.source) else {
                continue;
            };
            let matrix = form::self_similarity(&form_bars(p));
            let opts = render::SelfSimilarityOptions {
                title: Some(format!("bar self-similarity: {}", p.source)),
                ..Default::default()
            };
            let score = match a.bars {
                Some(n) => stats::first_bars(&p.score, n as usize),
                None => p.score.clone(),
            };
            render::self_similarity_png(&score, &matrix, png, &opts)?;
            println!(
                "{}: piano roll and self-similarity of {} bars",
                png.display(),
                matrix.len()
            );
        }
    }
    Ok(0)
}
