//! Commands around the tokenizer: encode, decode, inspect, tokenize, vocab,
//! and the log subscriber both binaries start with ([`init_logging`]).
//!
//! What a command produces (tokens, tables, the files it wrote) goes to
//! stdout; warnings, progress and details go to stderr through `tracing`,
//! so a pipe such as `cadenza encode x.mid | wc -l` only ever sees tokens.

use std::io::{IsTerminal, Write};
use std::path::PathBuf;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use tracing::{info, warn};

use crate::midi;
use crate::tokenizer::{self, dataset};

/// The log filter used when neither `CADENZA_LOG` nor `RUST_LOG` is set:
/// warnings from every crate, progress and summaries from cadenza's own.
pub const DEFAULT_LOG_FILTER: &str = "warn,cadenza=info,cadenza_core=info,cadenza_torch=info";

/// What `--verbose` adds on top of the filter: debug logs of cadenza's crates.
pub const VERBOSE_LOG_DIRECTIVES: &[&str] =
    &["cadenza=debug", "cadenza_core=debug", "cadenza_torch=debug"];

/// The filter of [`init_logging`]: `CADENZA_LOG`, else `RUST_LOG`, else
/// [`DEFAULT_LOG_FILTER`]; `verbose` raises cadenza's crates to debug.
/// A filter that does not parse is an error that names its variable.
pub fn log_filter(
    verbose: bool,
    cadenza_log: Option<&str>,
    rust_log: Option<&str>,
) -> Result<tracing_subscriber::EnvFilter> {
    use tracing_subscriber::EnvFilter;
    let (name, text) = match (cadenza_log, rust_log) {
        (Some(c), _) if !c.trim().is_empty() => ("CADENZA_LOG", c),
        (_, Some(r)) if !r.trim().is_empty() => ("RUST_LOG", r),
        _ => ("the default filter", DEFAULT_LOG_FILTER),
    };
    let mut filter = EnvFilter::builder()
        .parse(text)
        .map_err(|e| anyhow::anyhow!("{name}={text:?} is not a log filter: {e}"))?;
    if verbose {
        for d in VERBOSE_LOG_DIRECTIVES {
            filter = filter.add_directive(d.parse().expect("valid directive"));
        }
    }
    Ok(filter)
}

/// Starts the one log subscriber of the process: compact lines on stderr
/// (colour only on a terminal), no timestamps, filtered by [`log_filter`]
/// from the environment.
pub fn init_logging(verbose: bool) -> Result<()> {
    let var = |n: &str| std::env::var(n).ok();
    let filter = log_filter(
        verbose,
        var("CADENZA_LOG").as_deref(),
        var("RUST_LOG").as_deref(),
    )?;
    tracing_subscriber::fmt()
        .compact()
        .without_time()
        .with_target(false)
        .with_ansi(std::io::stderr().is_terminal())
        .with_writer(std::io::stderr)
        .with_env_filter(filter)
        .try_init()
        .map_err(|e| anyhow::anyhow!("cannot start logging: {e}"))
}

/// The most characters of a bad token an error quotes.
pub const MAX_SHOWN_TOKEN: usize = 64;

/// The most characters of a reason (a reader's warning or error) a log line quotes.
pub const MAX_SHOWN_REASON: usize = 500;

/// A skipped file as a log line quotes it: its name and reason, bounded and
/// escaped (a file name found in a folder may hold a newline).
fn skipped_line(s: &dataset::Skipped) -> String {
    format!(
        "{}: {}",
        crate::util::excerpt(&s.path, crate::util::MAX_SHOWN_PATH),
        crate::util::excerpt(&s.reason, MAX_SHOWN_REASON)
    )
}

/// Options shared by commands that tokenize.
#[derive(clap::Args, Debug, Clone)]
pub struct VocabOpt {
    /// Vocabulary JSON file (default: the built-in default REMI+ vocabulary,
    /// the same as vocab/remi-default.json).
    #[arg(long)]
    pub vocab: Option<PathBuf>,
}

impl VocabOpt {
    /// The vocabulary of `--vocab`, or the built-in default.
    pub fn load(&self) -> Result<tokenizer::Vocab> {
        match &self.vocab {
            Some(p) => tokenizer::Vocab::load(p),
            None => tokenizer::Vocab::new(tokenizer::RemiConfig::default()),
        }
    }
}

/// Per-file limits of commands that read MIDI (see `crate::limits`).
#[derive(clap::Args, Debug, Clone)]
pub struct LimitOpt {
    /// Largest input file read, in MiB (a bigger one is refused).
    #[arg(long, default_value_t = crate::limits::DEFAULT_MAX_FILE_BYTES >> 20)]
    pub max_file_mb: u64,
    /// Most MIDI events in one file.
    #[arg(long, default_value_t = crate::limits::DEFAULT_MAX_EVENTS)]
    pub max_events: usize,
    /// Longest piece, in quarter notes up to its last event.
    #[arg(long, default_value_t = crate::limits::DEFAULT_MAX_QUARTERS)]
    pub max_quarters: u64,
    /// Most tokens in one piece.
    #[arg(long, default_value_t = crate::limits::DEFAULT_MAX_TOKENS)]
    pub max_tokens: usize,
}

impl LimitOpt {
    /// The limits these flags give.
    pub fn limits(&self) -> crate::limits::Limits {
        crate::limits::Limits {
            max_file_bytes: self.max_file_mb.saturating_mul(1 << 20),
            max_events: self.max_events,
            max_quarters: self.max_quarters,
            max_tokens: self.max_tokens,
        }
    }
}

/// `cadenza encode`: print the REMI tokens of a MIDI file.
#[derive(clap::Args, Debug)]
pub struct EncodeArgs {
    /// MIDI file.
    pub file: PathBuf,
    #[command(flatten)]
    pub vocab: VocabOpt,
    /// Print ids instead of token strings.
    #[arg(long)]
    pub ids: bool,
    #[command(flatten)]
    pub limits: LimitOpt,
}

/// `cadenza decode`: turn a token file into MIDI.
#[derive(clap::Args, Debug)]
pub struct DecodeArgs {
    /// Token file: token strings (or ids) separated by whitespace.
    pub tokens: PathBuf,
    /// Output MIDI file.
    #[arg(short, long)]
    pub output: PathBuf,
    #[command(flatten)]
    pub vocab: VocabOpt,
    #[command(flatten)]
    pub limits: LimitOpt,
}

/// `cadenza inspect`: summarize a MIDI file.
#[derive(clap::Args, Debug)]
pub struct InspectArgs {
    /// MIDI file.
    pub file: PathBuf,
    #[command(flatten)]
    pub vocab: VocabOpt,
    #[command(flatten)]
    pub limits: LimitOpt,
}

/// `cadenza tokenize`: MIDI files and folders into a dataset.
#[derive(clap::Args, Debug)]
pub struct TokenizeArgs {
    /// MIDI files and folders (searched recursively for .mid/.midi).
    #[arg(required = true)]
    pub inputs: Vec<PathBuf>,
    /// Dataset folder to write.
    #[arg(short, long)]
    pub output: PathBuf,
    #[command(flatten)]
    pub vocab: VocabOpt,
    /// Exit with status 2 when any file was skipped.
    #[arg(long)]
    pub strict: bool,
    /// Worker threads (default: all cores; at most the number of files and
    /// 4 per core).
    #[arg(long, short = 'j')]
    pub threads: Option<usize>,
    /// Replace the output folder when it already holds a dataset, a run or
    /// other files.
    #[arg(long)]
    pub force: bool,
    #[command(flatten)]
    pub limits: LimitOpt,
}

/// `cadenza vocab`: write the tokenizer's vocabulary as JSON.
#[derive(clap::Args, Debug)]
pub struct VocabArgs {
    /// Output JSON file.
    #[arg(short, long, default_value = "vocab/remi-default.json")]
    pub output: PathBuf,
    /// Tokenizer config (TOML) to build the vocabulary from (default: defaults).
    #[arg(long)]
    pub config: Option<PathBuf>,
}

/// Prints the tokens (or ids) of a MIDI file, one per line.
pub fn encode(a: EncodeArgs) -> Result<i32> {
    let vocab = a.vocab.load()?;
    let limits = a.limits.limits();
    let (score, report) = midi::read_file_with(&a.file, &limits)?;
    for w in report.warnings() {
        warn!(
            "{}: {}",
            crate::util::shown(&a.file),
            crate::util::excerpt(&w, MAX_SHOWN_REASON)
        );
    }
    let (ids, q) = tokenizer::encode(&score, &vocab);
    limits
        .check_tokens(ids.len())
        .map_err(|e| anyhow::anyhow!("{}: {e}", a.file.display()))?;
    for w in q.warnings() {
        warn!(
            "{}: {}",
            crate::util::shown(&a.file),
            crate::util::excerpt(&w, MAX_SHOWN_REASON)
        );
    }
    let mut out = std::io::BufWriter::new(std::io::stdout().lock());
    for id in ids {
        if a.ids {
            writeln!(out, "{id}")?;
        } else {
            writeln!(out, "{}", vocab.string(id).unwrap_or("?"))?;
        }
    }
    out.flush()?;
    Ok(0)
}

/// Reads a regular file of token strings or ids separated by whitespace,
/// within `limits` (bytes, tokens); errors name the file, the line and the token.
pub fn read_token_file_with(
    path: &std::path::Path,
    vocab: &tokenizer::Vocab,
    limits: &crate::limits::Limits,
) -> Result<Vec<u32>> {
    let text = crate::limits::read_text(path, limits.max_file_bytes)?;
    parse_tokens(&text, vocab, limits)
        .map_err(|e| anyhow::anyhow!("{}:{e}", crate::util::shown(path)))
}

/// Parses token strings or ids separated by whitespace. The error starts
/// with the line number ("3: unknown token ...") and quotes a bad token as a
/// bounded, escaped excerpt ([`crate::util::excerpt`], [`MAX_SHOWN_TOKEN`]
/// characters).
pub fn parse_tokens(
    text: &str,
    vocab: &tokenizer::Vocab,
    limits: &crate::limits::Limits,
) -> Result<Vec<u32>> {
    let mut ids = Vec::new();
    for (ln, line) in text.lines().enumerate() {
        for word in line.split_whitespace() {
            let id = match vocab.parse_token(word) {
                Some(id) => id,
                None => match word.parse::<u32>() {
                    Ok(id) if (id as usize) < vocab.len() => id,
                    _ => bail!(
                        "{}: unknown token \"{}\" for vocabulary {}",
                        ln + 1,
                        crate::util::excerpt(word, MAX_SHOWN_TOKEN),
                        vocab.hash()
                    ),
                },
            };
            ids.push(id);
            if ids.len() > limits.max_tokens {
                bail!(
                    "{}: more than {} tokens (raise the limit with --max-tokens)",
                    ln + 1,
                    limits.max_tokens
                );
            }
        }
    }
    Ok(ids)
}

/// Writes the MIDI file of a token file.
pub fn decode(a: DecodeArgs) -> Result<i32> {
    let mut plan = crate::output::Plan::new();
    plan.read("tokens", &a.tokens).write("-o", &a.output);
    if let Some(v) = &a.vocab.vocab {
        plan.read("--vocab", v);
    }
    plan.check()?;
    let vocab = a.vocab.load()?;
    let ids = read_token_file_with(&a.tokens, &vocab, &a.limits.limits())?;
    let (score, report) = tokenizer::decode(&ids, &vocab);
    if !report.is_clean() {
        warn!(
            "{}: {} token(s) skipped by the grammar, {} after EOS",
            crate::util::shown(&a.tokens),
            report.skipped,
            report.after_eos
        );
    }
    let score = tokenizer::to_output_resolution(&score);
    midi::write_file(&score, &a.output)?;
    println!(
        "wrote {} ({} notes, {:.1} s)",
        a.output.display(),
        score.notes.len(),
        score.duration_seconds()
    );
    Ok(0)
}

/// Prints a summary of a MIDI file.
pub fn inspect(a: InspectArgs) -> Result<i32> {
    let vocab = a.vocab.load()?;
    let limits = a.limits.limits();
    let bytes = crate::limits::read_file(&a.file, limits.max_file_bytes)?;
    let (score, report) = midi::parse_named_with(&bytes, &a.file, &limits)?;
    let smf = midly::Smf::parse(&bytes)
        .map_err(|e| anyhow::anyhow!("{}: not a valid MIDI file: {e}", a.file.display()))?;
    let (ids, q) = tokenizer::encode(&score, &vocab);
    limits
        .check_tokens(ids.len())
        .map_err(|e| anyhow::anyhow!("{}: {e}", a.file.display()))?;
    println!("file:            {}", a.file.display());
    println!("format:          {:?}", smf.header.format);
    println!("timing:          {:?}", smf.header.timing);
    println!("tracks:          {}", smf.tracks.len());
    println!("ticks/quarter:   {}", score.ticks_per_quarter);
    println!("notes:           {}", score.notes.len());
    println!("duration:        {:.1} s", score.duration_seconds());
    if let (Some(lo), Some(hi)) = (
        score.notes.iter().map(|n| n.pitch).min(),
        score.notes.iter().map(|n| n.pitch).max(),
    ) {
        println!("pitch range:     {lo}..={hi}");
    }
    let mut programs: Vec<String> = score
        .notes
        .iter()
        .map(|n| {
            if n.is_drum {
                "drums".to_string()
            } else {
                n.program.to_string()
            }
        })
        .collect();
    programs.sort();
    programs.dedup();
    println!("programs:        {}", programs.join(" "));
    println!("tempo changes:   {}", score.tempos.len());
    for t in score.tempos.iter().take(5) {
        println!("  tick {:>8}: {:.2} BPM", t.tick, t.bpm());
    }
    println!("time signatures: {}", score.time_signatures.len());
    for t in score.time_signatures.iter().take(5) {
        println!("  tick {:>8}: {}/{}", t.tick, t.numerator, t.denominator);
    }
    println!("tokens:          {}", ids.len());
    for w in report.warnings().into_iter().chain(q.warnings()) {
        println!("warning:         {w}");
    }
    Ok(0)
}

/// Most worker threads of `tokenize` per core: more only add memory (each
/// worker holds a file) and contention.
pub const TOKENIZE_THREADS_PER_CORE: usize = 4;

/// The worker threads of `tokenize -j`: the request (all cores when absent
/// or 0) clamped to the number of files and to
/// [`TOKENIZE_THREADS_PER_CORE`] x the cores, with a note when clamped.
pub fn tokenize_threads(requested: Option<usize>, files: usize) -> usize {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let want = requested.filter(|&j| j > 0).unwrap_or(cores);
    let n = want
        .min(files.max(1))
        .min(TOKENIZE_THREADS_PER_CORE * cores);
    if requested.is_some_and(|j| j > n) {
        info!(
            "-j {}: using {n} worker threads ({files} files, {cores} cores, at most \
             {TOKENIZE_THREADS_PER_CORE} per core)",
            requested.unwrap_or(0)
        );
    }
    n
}

/// Tokenizes MIDI files and folders into a dataset; 2 with `--strict` when a file was skipped.
pub fn tokenize(a: TokenizeArgs) -> Result<i32> {
    let vocab = a.vocab.load()?;
    dataset::check_output_dir(&a.output, a.force)?;
    let files = dataset::collect_midi_files(&a.inputs)?;
    if files.is_empty() {
        bail!("no .mid/.midi files found under the inputs");
    }
    {
        // What tokenize reads is exactly the files found (and --vocab); the
        // dataset's files must be none of them, nor devices or FIFOs.
        let mut plan = crate::output::Plan::new();
        for (p, _) in &files {
            plan.read("input", p);
        }
        if let Some(v) = &a.vocab.vocab {
            plan.read("--vocab", v);
        }
        for f in [
            dataset::TOKENS_FILE,
            dataset::PIECES_FILE,
            dataset::VOCAB_FILE,
            dataset::MANIFEST_FILE,
        ] {
            plan.write("-o", &a.output.join(f));
        }
        plan.check()?;
    }
    let limits = a.limits.limits();
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(tokenize_threads(a.threads, files.len()))
        .build()
        .context("cannot start worker threads")?;
    let pb = indicatif::ProgressBar::new(files.len() as u64);
    pb.set_style(
        indicatif::ProgressStyle::with_template(
            "{spinner} tokenizing [{bar:40}] {pos}/{len} files {per_sec} ETA {eta}",
        )
        .expect("valid template")
        .progress_chars("=> "),
    );
    let t0 = Instant::now();
    // pieces are written as they come: memory stays bounded whatever the corpus
    let mut writer = dataset::DatasetWriter::create(&a.output, &vocab)?;
    pool.install(|| writer.tokenize(&files, &limits, &|| pb.inc(1)))?;
    pb.finish_and_clear();
    let secs = t0.elapsed().as_secs_f64();
    if writer.pieces() == 0 {
        for s in writer.skipped() {
            warn!("skipped {}", skipped_line(s));
        }
        bail!(
            "none of the {} input file(s) could be tokenized; no dataset written to {}",
            files.len(),
            a.output.display()
        );
    }
    let m = writer.finish()?;
    for s in &m.skipped {
        warn!("skipped {}", skipped_line(s));
    }
    info!(
        "{} pieces, {} tokens, {} notes from {} files in {:.1} s ({:.0} files/s); {} skipped; {} with warnings",
        m.pieces,
        m.tokens,
        m.notes,
        m.files_seen,
        secs,
        m.files_seen as f64 / secs.max(1e-9),
        m.skipped.len(),
        m.warnings.len()
    );
    println!("dataset written to {}", a.output.display());
    Ok(if a.strict && !m.skipped.is_empty() {
        2
    } else {
        0
    })
}

/// Writes a vocabulary JSON file.
pub fn vocab(a: VocabArgs) -> Result<i32> {
    let mut plan = crate::output::Plan::new();
    plan.write("-o", &a.output);
    if let Some(c) = &a.config {
        plan.read("--config", c);
    }
    plan.check()?;
    let config = match &a.config {
        Some(p) => {
            let text = crate::limits::read_text(p, crate::limits::MAX_CONFIG_BYTES)?;
            toml::from_str(&text)
                .with_context(|| format!("{}: bad tokenizer config", p.display()))?
        }
        None => tokenizer::RemiConfig::default(),
    };
    let v = tokenizer::Vocab::new(config).with_context(|| match &a.config {
        Some(p) => format!("{}: bad tokenizer config", p.display()),
        None => "bad default tokenizer config".to_string(),
    })?;
    v.save(&a.output)?;
    println!(
        "wrote {} ({} tokens, hash {})",
        a.output.display(),
        v.len(),
        v.hash()
    );
    Ok(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn log_filter_takes_cadenza_log_then_rust_log_then_the_default() {
        let f = |v, c, r| log_filter(v, c, r).unwrap().to_string();
        assert!(f(false, Some("cadenza=trace"), Some("error")).contains("cadenza=trace"));
        assert!(!f(false, Some("cadenza=trace"), Some("error")).contains("error"));
        assert!(f(false, None, Some("cadenza_core=error")).contains("cadenza_core=error"));
        assert!(f(false, Some("  "), Some("cadenza_core=error")).contains("cadenza_core=error"));
        let default = f(false, None, None);
        assert!(default.contains("cadenza=info") && default.contains("warn"));
        assert!(!default.contains("debug"));
        let verbose = f(true, None, None);
        for d in VERBOSE_LOG_DIRECTIVES {
            assert!(verbose.contains(d), "{verbose}");
        }
    }

    #[test]
    fn tokenize_threads_are_clamped_to_files_and_cores() {
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        assert_eq!(tokenize_threads(Some(3000), 20_000), 4 * cores);
        assert_eq!(tokenize_threads(Some(3000), 1), 1);
        assert_eq!(tokenize_threads(Some(1), 100), 1);
        assert_eq!(tokenize_threads(None, 100_000), cores);
        assert_eq!(tokenize_threads(Some(0), 100_000), cores);
    }

    #[test]
    fn a_bad_log_filter_is_an_error_naming_its_variable() {
        let e = log_filter(false, Some("cadenza=loud"), None)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("CADENZA_LOG") && e.contains("cadenza=loud"),
            "{e}"
        );
        let e = log_filter(false, None, Some("=x="))
            .unwrap_err()
            .to_string();
        assert!(e.contains("RUST_LOG"), "{e}");
    }
}
