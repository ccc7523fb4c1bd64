//! Tokenizer throughput benchmark (harness = false): prints a markdown table.
//!
//! Reads and tokenizes every MIDI file of a corpus with the default REMI+ vocabulary,
//! 1. single-threaded (a plain loop on the main thread),
//! 2. on all cores (rayon),
//! 3. with MidiTok's REMI (Python, single-threaded) on the same file list, when
//!    `CADENZA_MIDITOK_PYTHON` names a Python that has `miditok` installed
//!    (`scripts/bench-tokenize.sh` makes one and sets it),
//!
//! and prints files/s, notes/s and MB/s (input bytes, 10^6) for each, then the
//! cadenza/MidiTok ratio.
//!
//! Environment knobs (defaults in brackets):
//! - `CADENZA_CORPUS` [`../shared/corpus` from the crate root]: folder (or file) to tokenize;
//! - `CADENZA_BENCH_FILES` [all]: use this many files, evenly spaced over the sorted list
//!   (so every sub-folder is represented);
//! - `CADENZA_BENCH_REPEAT` [3]: cadenza rows report the fastest of this many runs;
//! - `CADENZA_MIDITOK_PYTHON` [unset: no MidiTok row]: Python interpreter for
//!   `scripts/miditok_bench.py`.
//!
//! The file list is written to `CARGO_TARGET_TMPDIR/bench-tokenize-files.txt` and
//! handed to the Python script, so both sides measure exactly the same files. All
//! files are read once before any timing so that every row sees a warm page cache.
//! cadenza rows time the whole loop (wall clock); the MidiTok row is the sum of its
//! per-file `tokenizer(path)` times, which leaves out its loop overhead.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Instant;

use anyhow::{bail, Context, Result};
use cadenza::tokenizer::{dataset, RemiConfig, Vocab};
use rayon::prelude::*;

/// What one row measured.
#[derive(Default, Clone)]
struct Run {
    files: usize,
    errors: usize,
    notes: u64,
    tokens: u64,
    bytes: u64,
    seconds: f64,
}

impl Run {
    fn add(mut self, other: Run) -> Run {
        self.files += other.files;
        self.errors += other.errors;
        self.notes += other.notes;
        self.tokens += other.tokens;
        self.bytes += other.bytes;
        self
    }

    fn files_per_s(&self) -> f64 {
        self.files as f64 / self.seconds
    }
}

fn env_opt(name: &str) -> Option<String> {
    std::env::var(name).ok().filter(|s| !s.trim().is_empty())
}

/// `limit` paths evenly spaced over `files` (all of them when `limit` is larger).
fn spread(files: Vec<PathBuf>, limit: Option<usize>) -> Vec<PathBuf> {
    match limit {
        Some(n) if n < files.len() => (0..n).map(|i| files[i * files.len() / n].clone()).collect(),
        _ => files,
    }
}

fn one_file(path: &Path, vocab: &Vocab, first_error: &mut Option<String>) -> Run {
    match dataset::tokenize_file(path, vocab) {
        Ok(t) => Run {
            files: 1,
            notes: t.notes as u64,
            tokens: t.tokens.len() as u64,
            bytes: t.bytes,
            ..Run::default()
        },
        Err(e) => {
            first_error.get_or_insert_with(|| format!("{e:#}"));
            Run {
                files: 1,
                errors: 1,
                bytes: std::fs::metadata(path).map(|m| m.len()).unwrap_or(0),
                ..Run::default()
            }
        }
    }
}

fn cadenza_single(files: &[PathBuf], vocab: &Vocab) -> (Run, Option<String>) {
    let mut first_error = None;
    let start = Instant::now();
    let mut run = Run::default();
    for p in files {
        run = run.add(one_file(p, vocab, &mut first_error));
    }
    run.seconds = start.elapsed().as_secs_f64();
    (run, first_error)
}

fn cadenza_parallel(files: &[PathBuf], vocab: &Vocab, pool: &rayon::ThreadPool) -> Run {
    let start = Instant::now();
    let mut run = pool.install(|| {
        files
            .par_iter()
            .map(|p| one_file(p, vocab, &mut None))
            .reduce(Run::default, Run::add)
    });
    run.seconds = start.elapsed().as_secs_f64();
    run
}

/// Fastest of `repeat` runs.
fn best_of(repeat: usize, mut f: impl FnMut() -> Run) -> Run {
    (0..repeat.max(1))
        .map(|_| f())
        .min_by(|a, b| a.seconds.total_cmp(&b.seconds))
        .unwrap()
}

struct MidiTok {
    run: Run,
    version: String,
    vocab: u64,
    first_errors: Vec<String>,
}

fn miditok(python: &str, list: &Path) -> Result<MidiTok> {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("scripts/miditok_bench.py");
    eprintln!(
        "running MidiTok: {python} {} --list {}",
        script.display(),
        list.display()
    );
    let out = Command::new(python)
        .arg(&script)
        .arg("--list")
        .arg(list)
        .stdin(Stdio::null())
        .stderr(Stdio::inherit())
        .output()
        .with_context(|| format!("cannot run {python}"))?;
    if !out.status.success() {
        bail!("{} failed ({})", script.display(), out.status);
    }
    let stdout = String::from_utf8_lossy(&out.stdout);
    let line = stdout
        .lines()
        .rev()
        .find(|l| l.trim_start().starts_with('{'))
        .context("no JSON result from miditok_bench.py")?;
    let v: serde_json::Value =
        serde_json::from_str(line).context("bad JSON from miditok_bench.py")?;
    let u = |k: &str| v[k].as_u64().unwrap_or(0);
    Ok(MidiTok {
        run: Run {
            files: u("files") as usize,
            errors: u("errors") as usize,
            notes: u("notes"),
            tokens: u("tokens"),
            bytes: u("bytes"),
            seconds: v["seconds"].as_f64().context("no seconds")?,
        },
        version: format!(
            "{} (symusic {})",
            v["miditok"].as_str().unwrap_or("?"),
            v["symusic"].as_str().unwrap_or("?")
        ),
        vocab: u("vocab"),
        first_errors: v["first_errors"]
            .as_array()
            .map(|a| {
                a.iter()
                    .filter_map(|e| e.as_str().map(String::from))
                    .collect()
            })
            .unwrap_or_default(),
    })
}

fn row(name: &str, threads: usize, r: &Run) {
    let s = r.seconds;
    println!(
        "| {name} | {threads} | {} | {} | {:.3} | {:.0} | {:.0} | {:.2} | {} |",
        r.files,
        r.errors,
        s,
        r.files_per_s(),
        r.notes as f64 / s,
        r.bytes as f64 / 1e6 / s,
        r.tokens,
    );
}

fn main() -> Result<()> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let corpus = env_opt("CADENZA_CORPUS")
        .map(PathBuf::from)
        .unwrap_or_else(|| root.join("../shared/corpus"));
    let corpus = corpus
        .canonicalize()
        .with_context(|| format!("corpus {} not found (set CADENZA_CORPUS)", corpus.display()))?;
    let limit = env_opt("CADENZA_BENCH_FILES")
        .map(|s| s.trim().parse::<usize>())
        .transpose()
        .context("CADENZA_BENCH_FILES must be a number")?;
    let repeat = env_opt("CADENZA_BENCH_REPEAT")
        .map(|s| s.trim().parse::<usize>())
        .transpose()
        .context("CADENZA_BENCH_REPEAT must be a number")?
        .unwrap_or(3);

    let all: Vec<PathBuf> = dataset::collect_midi_files(std::slice::from_ref(&corpus))?
        .into_iter()
        .map(|(p, _)| p)
        .collect();
    let found = all.len();
    let files = spread(all, limit);
    if files.is_empty() {
        bail!("no MIDI files under {}", corpus.display());
    }

    // Same list for MidiTok.
    let list = Path::new(env!("CARGO_TARGET_TMPDIR")).join("bench-tokenize-files.txt");
    let mut text = String::new();
    for p in &files {
        text.push_str(&p.to_string_lossy());
        text.push('\n');
    }
    std::fs::write(&list, text).with_context(|| format!("cannot write {}", list.display()))?;

    // Warm the page cache (and count the input bytes).
    let mut bytes = 0u64;
    for p in &files {
        bytes += std::fs::read(p)
            .with_context(|| format!("cannot read {}", p.display()))?
            .len() as u64;
    }

    let vocab = Vocab::new(RemiConfig::default())?;
    let pool = rayon::ThreadPoolBuilder::new().build()?;
    let threads = pool.current_num_threads();
    eprintln!(
        "tokenizing {} of {found} files ({:.1} MB) under {}, best of {repeat}",
        files.len(),
        bytes as f64 / 1e6,
        corpus.display()
    );

    let mut first_error = None;
    let single = best_of(repeat, || {
        let (r, e) = cadenza_single(&files, &vocab);
        first_error = first_error.take().or(e);
        r
    });
    let parallel = best_of(repeat, || cadenza_parallel(&files, &vocab, &pool));

    let python = env_opt("CADENZA_MIDITOK_PYTHON");
    let mt = match &python {
        Some(py) => match miditok(py, &list) {
            Ok(m) => Some(m),
            Err(e) => {
                eprintln!("MidiTok row skipped: {e:#}");
                None
            }
        },
        None => None,
    };

    println!();
    println!(
        "Tokenizer throughput: read + tokenize {} MIDI files ({:.1} MB) from {}",
        files.len(),
        bytes as f64 / 1e6,
        corpus.display()
    );
    println!();
    println!(
        "| tokenizer | threads | files | errors | time (s) | files/s | notes/s | MB/s | tokens |"
    );
    println!("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |");
    row("cadenza REMI+", 1, &single);
    row("cadenza REMI+", threads, &parallel);
    match &mt {
        Some(m) => row(&format!("MidiTok {} REMI", m.version), 1, &m.run),
        None => println!(
            "| MidiTok REMI | 1 | - | - | - | - | - | - | {} |",
            if python.is_some() {
                "failed"
            } else {
                "not run (set CADENZA_MIDITOK_PYTHON or use scripts/bench-tokenize.sh)"
            }
        ),
    }
    println!();
    println!(
        "cadenza vocabulary: {} tokens; cadenza rows: fastest of {repeat} runs; notes: notes written as tokens.",
        vocab.len()
    );
    if let Some(e) = &first_error {
        println!("cadenza: first error: {e}");
    }
    if let Some(m) = &mt {
        println!(
            "MidiTok vocabulary: {} tokens; MidiTok notes: Pitch/PitchDrum tokens; time: sum of per-file `tokenizer(path)` calls.",
            m.vocab
        );
        for e in &m.first_errors {
            println!("MidiTok: error: {e}");
        }
        let ratio = single.files_per_s() / m.run.files_per_s();
        println!();
        println!(
            "**Speed-up over MidiTok (files/s, same files): {ratio:.1}x single-threaded ({}), {:.1}x on {threads} threads.**",
            if ratio >= 10.0 { "target >= 10x met" } else { "target >= 10x NOT met" },
            parallel.files_per_s() / m.run.files_per_s(),
        );
    }
    Ok(())
}
