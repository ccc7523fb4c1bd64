//! Token datasets on disk: what `cadenza tokenize` writes and training reads.
//!
//! A dataset folder holds `tokens.bin` (every piece as `BOS tokens EOS`, u16
//! little-endian ids, back to back), `pieces.json` (where each piece starts,
//! its length and source file), `manifest.json` (counts, skipped files, the
//! vocabulary hash) and `vocab.json`.
//!
//! Invariants: `tokenize` never replaces an existing dataset, run folder or
//! other non-empty folder unless asked to (`--force`, [`check_output_dir`]);
//! [`Dataset::open`] checks that every id is inside the vocabulary, so a
//! corrupt `tokens.bin` is refused with its name before any model sees it.

use std::io::Write;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use rayon::prelude::*;
use serde::{Deserialize, Serialize};

use super::{encode, Vocab, BOS_ID, EOS_ID};
use crate::limits::Limits;

pub const TOKENS_FILE: &str = "tokens.bin";
pub const PIECES_FILE: &str = "pieces.json";
pub const MANIFEST_FILE: &str = "manifest.json";
pub const VOCAB_FILE: &str = "vocab.json";
/// What marks a training run folder (`train::checkpoint::CONFIG_FILE`).
const RUN_CONFIG_FILE: &str = "config.json";

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Piece {
    /// Source file, relative to the input it was found under.
    pub source: String,
    /// Offset of its BOS in `tokens.bin`, in tokens.
    pub offset: u64,
    /// Length including BOS and EOS.
    pub len: u64,
    pub notes: u64,
}

/// The reason in an error message about `path`: reader errors start with
/// the path already, which a "skipped PATH: reason" line would say twice.
pub fn skip_reason(path: &Path, message: &str) -> String {
    let prefix = format!("{}: ", path.display());
    message.strip_prefix(&prefix).unwrap_or(message).to_owned()
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Skipped {
    pub path: String,
    pub reason: String,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Manifest {
    pub format_version: u32,
    pub vocab_hash: String,
    pub vocab_size: usize,
    pub pieces: usize,
    pub tokens: u64,
    pub notes: u64,
    pub input_bytes: u64,
    pub files_seen: usize,
    pub skipped: Vec<Skipped>,
    /// Files tokenized with warnings (dropped or clipped notes ...), with them.
    pub warnings: Vec<Skipped>,
}

/// Refuses to write a dataset into `dir` when it already holds one, a
/// training run or other files, unless `force`.
pub fn check_output_dir(dir: &Path, force: bool) -> Result<()> {
    let meta = match std::fs::metadata(dir) {
        Ok(m) => m,
        Err(_) => return Ok(()),
    };
    if !meta.is_dir() {
        bail!("{}: exists and is not a folder", dir.display());
    }
    let names: Vec<String> = std::fs::read_dir(dir)
        .with_context(|| format!("cannot list {}", dir.display()))?
        .filter_map(|e| e.ok())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    // Empty, or what an interrupted `tokenize` left (no manifest yet).
    let incomplete = names.iter().all(|n| {
        [TOKENS_FILE, PIECES_FILE, VOCAB_FILE].contains(&n.as_str())
            || (n.starts_with('.') && n.ends_with(".tmp"))
    });
    if incomplete || force {
        return Ok(());
    }
    let what = if dir.join(MANIFEST_FILE).is_file() {
        let n = serde_json::from_slice::<Manifest>(
            &std::fs::read(dir.join(MANIFEST_FILE)).unwrap_or_default(),
        )
        .map(|m| format!(" of {} pieces", m.pieces))
        .unwrap_or_default();
        format!("holds a dataset{n}")
    } else if dir.join(RUN_CONFIG_FILE).is_file() {
        "is a training run folder (its vocab.json would be replaced)".to_string()
    } else {
        "is not empty".to_string()
    };
    bail!(
        "{} {what}; pass --force to replace it, or choose another folder",
        dir.display()
    )
}

/// Sorts paths in `Path`'s order (component by component). `Path`'s own
/// comparison parses both paths into components at every comparison, which
/// was a thirtieth of tokenizing a corpus: parse each path once.
fn sort_paths(paths: &mut Vec<PathBuf>) {
    let order: Vec<usize> = {
        let keys: Vec<Vec<std::path::Component<'_>>> =
            paths.iter().map(|p| p.components().collect()).collect();
        let mut idx: Vec<usize> = (0..paths.len()).collect();
        idx.sort_by(|&a, &b| keys[a].cmp(&keys[b]));
        idx
    };
    let mut taken: Vec<Option<PathBuf>> = std::mem::take(paths).into_iter().map(Some).collect();
    *paths = order
        .into_iter()
        .map(|i| taken[i].take().expect("a permutation"))
        .collect();
}

/// Every `.mid`/`.midi` file (any case) under the inputs, recursively, sorted.
/// A missing input is an error that names it.
pub fn collect_midi_files(inputs: &[PathBuf]) -> Result<Vec<(PathBuf, String)>> {
    let mut out = Vec::new();
    for input in inputs {
        let meta =
            std::fs::metadata(input).with_context(|| format!("cannot read {}", input.display()))?;
        if !meta.is_dir() {
            // A file, or something else (FIFO, device) that reading refuses
            // by its metadata, without opening it.
            let name = input
                .file_name()
                .map(|n| n.to_string_lossy().into_owned())
                .unwrap_or_default();
            out.push((input.clone(), name));
        } else {
            let mut found = Vec::new();
            walk(input, &mut found)?;
            sort_paths(&mut found);
            // Sources are named from the folder given, including its own name
            // ("folk/essen/x.mid" for the input "corpus/folk"), so that reports
            // can group pieces by collection.
            let base = input.canonicalize().unwrap_or_else(|_| input.clone());
            let top = base
                .file_name()
                .map(|n| n.to_string_lossy().into_owned())
                .unwrap_or_default();
            for p in found {
                let rel = p.strip_prefix(input).unwrap_or(&p).to_string_lossy();
                let name = if top.is_empty() {
                    rel.into_owned()
                } else {
                    format!("{top}/{rel}")
                };
                out.push((p, name));
            }
        }
    }
    Ok(out)
}

pub fn is_midi_path(p: &Path) -> bool {
    p.extension()
        .and_then(|e| e.to_str())
        .is_some_and(|e| e.eq_ignore_ascii_case("mid") || e.eq_ignore_ascii_case("midi"))
}

fn walk(dir: &Path, out: &mut Vec<PathBuf>) -> Result<()> {
    let entries =
        std::fs::read_dir(dir).with_context(|| format!("cannot list {}", dir.display()))?;
    for e in entries {
        let e = e.with_context(|| format!("cannot list {}", dir.display()))?;
        let p = e.path();
        let ft = e
            .file_type()
            .with_context(|| format!("cannot stat {}", p.display()))?;
        if ft.is_dir() {
            walk(&p, out)?;
        } else if is_midi_path(&p) {
            out.push(p);
        }
    }
    Ok(())
}

/// One file's tokens, or why it was skipped.
pub struct Tokenized {
    pub tokens: Vec<u32>,
    pub notes: usize,
    pub bytes: u64,
    pub warnings: Vec<String>,
}

/// Reads and tokenizes one file (no BOS/EOS) within the default limits.
pub fn tokenize_file(path: &Path, vocab: &Vocab) -> Result<Tokenized> {
    tokenize_file_with(path, vocab, &Limits::default())
}

/// Reads and tokenizes one file (no BOS/EOS) within `limits`: a FIFO, a
/// device, a file too big or a piece too long is refused, naming the file.
pub fn tokenize_file_with(path: &Path, vocab: &Vocab, limits: &Limits) -> Result<Tokenized> {
    let bytes = crate::limits::read_file(path, limits.max_file_bytes)?;
    let (score, read_report) = crate::midi::parse_named_with(&bytes, path, limits)?;
    let (tokens, q) = encode(&score, vocab);
    limits
        .check_tokens(tokens.len())
        .map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))?;
    let mut warnings = read_report.warnings();
    warnings.extend(q.warnings());
    Ok(Tokenized {
        tokens,
        notes: q.notes_out,
        bytes: bytes.len() as u64,
        warnings,
    })
}

/// Tokenizes `files` in parallel (rayon), calling `progress` after each file.
/// Returns per-file results in input order; one bad file never stops the rest.
pub fn tokenize_files(
    files: &[(PathBuf, String)],
    vocab: &Vocab,
    progress: &(dyn Fn() + Sync),
) -> Vec<Result<Tokenized>> {
    tokenize_files_with(files, vocab, &Limits::default(), progress)
}

/// [`tokenize_files`] within `limits`.
pub fn tokenize_files_with(
    files: &[(PathBuf, String)],
    vocab: &Vocab,
    limits: &Limits,
    progress: &(dyn Fn() + Sync),
) -> Vec<Result<Tokenized>> {
    files
        .par_iter()
        .map(|(p, _)| {
            let r = tokenize_file_with(p, vocab, limits);
            progress();
            r
        })
        .collect()
}

/// Writes a dataset from tokenization results. Empty pieces are skipped
/// (reported as such). [`DatasetWriter`] does the same piece by piece.
pub fn write_dataset(
    dir: &Path,
    vocab: &Vocab,
    files: &[(PathBuf, String)],
    results: Vec<Result<Tokenized>>,
) -> Result<Manifest> {
    let mut w = DatasetWriter::create(dir, vocab)?;
    for ((path, rel), r) in files.iter().zip(results) {
        w.push(path, rel, r)?;
    }
    w.finish()
}

/// Files per chunk of [`DatasetWriter::tokenize`]: enough to keep every thread
/// busy, few enough that a chunk's tokens are a few megabytes.
pub const TOKENIZE_CHUNK: usize = 1024;

/// Writes a dataset one file's result at a time, so that a corpus of any
/// size is tokenized in bounded memory: each piece's ids go straight to a
/// temporary `tokens.bin` in the dataset folder, and only the piece index
/// stays in memory.
///
/// Invariants: nothing of an existing dataset in the folder is touched
/// before [`DatasetWriter::finish`], which replaces `tokens.bin`, then the
/// index and vocabulary, and writes the manifest last. A writer dropped
/// without `finish` (an error, nothing to write) removes its temporary
/// file, and the folder when it made it and left it empty; a process
/// stopped by SIGINT or SIGTERM while it writes removes its temporary files
/// as it dies ([`crate::util::RemoveOnSignal`]), and those of a process
/// killed outright are removed by the next writer in the folder.
pub struct DatasetWriter<'v> {
    dir: PathBuf,
    vocab: &'v Vocab,
    /// The temporary `tokens.bin` (`.tokens.bin.<pid>.tmp`) and its writer
    /// (`None` once closed by `finish`).
    tmp: PathBuf,
    out: Option<std::io::BufWriter<std::fs::File>>,
    /// Whether the temporary file has become `tokens.bin`.
    moved: bool,
    made_dir: bool,
    /// One piece's ids as stored (u16 little-endian), reused.
    buf: Vec<u8>,
    pieces: Vec<Piece>,
    skipped: Vec<Skipped>,
    warnings: Vec<Skipped>,
    tokens: u64,
    notes: u64,
    input_bytes: u64,
    files_seen: usize,
    /// Removes this process's temporary files in the folder on SIGINT/SIGTERM.
    _on_signal: crate::util::RemoveOnSignal,
}

impl<'v> DatasetWriter<'v> {
    /// Starts a dataset in `dir` (made when missing), removing temporary
    /// files left there by killed processes.
    pub fn create(dir: &Path, vocab: &'v Vocab) -> Result<Self> {
        if vocab.len() > u16::MAX as usize + 1 {
            bail!(
                "a vocabulary of {} tokens does not fit the dataset's 16-bit ids",
                vocab.len()
            );
        }
        let made_dir = !dir.exists();
        std::fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))?;
        for p in crate::util::clean_stale_temps(dir) {
            tracing::warn!("removed {} left by a process that was killed", p.display());
        }
        let tmp = crate::util::temp_path(&dir.join(TOKENS_FILE))?;
        let temps = [TOKENS_FILE, PIECES_FILE, VOCAB_FILE, MANIFEST_FILE]
            .iter()
            .map(|f| crate::util::temp_path(&dir.join(f)))
            .collect::<Result<Vec<_>>>()?;
        let on_signal = crate::util::RemoveOnSignal::new(&temps);
        // Made fresh: a leftover under this pid (or a planted FIFO or link)
        // is removed, never opened.
        if std::fs::symlink_metadata(&tmp).is_ok() {
            std::fs::remove_file(&tmp)
                .with_context(|| format!("cannot remove {}", tmp.display()))?;
        }
        let file = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(&tmp)
            .with_context(|| format!("cannot create {}", tmp.display()))?;
        Ok(DatasetWriter {
            dir: dir.to_path_buf(),
            vocab,
            tmp,
            out: Some(std::io::BufWriter::with_capacity(1 << 20, file)),
            moved: false,
            made_dir,
            buf: Vec::new(),
            pieces: Vec::new(),
            skipped: Vec::new(),
            warnings: Vec::new(),
            tokens: 0,
            notes: 0,
            input_bytes: 0,
            files_seen: 0,
            _on_signal: on_signal,
        })
    }

    /// Adds one input file's result: a piece (`BOS tokens EOS`), or a
    /// skipped file (an error, or no notes) with its reason.
    pub fn push(&mut self, path: &Path, rel: &str, r: Result<Tokenized>) -> Result<()> {
        self.files_seen += 1;
        let t = match r {
            Err(e) => {
                self.skipped.push(Skipped {
                    path: path.display().to_string(),
                    reason: skip_reason(path, &format!("{e:#}")),
                });
                return Ok(());
            }
            Ok(t) if t.notes == 0 => {
                self.skipped.push(Skipped {
                    path: path.display().to_string(),
                    reason: "no notes".into(),
                });
                return Ok(());
            }
            Ok(t) => t,
        };
        if !t.warnings.is_empty() {
            self.warnings.push(Skipped {
                path: path.display().to_string(),
                reason: t.warnings.join("; "),
            });
        }
        self.buf.clear();
        for id in std::iter::once(BOS_ID)
            .chain(t.tokens.iter().copied())
            .chain(std::iter::once(EOS_ID))
        {
            // Fits: `create` checked the vocabulary's size.
            self.buf.extend_from_slice(&(id as u16).to_le_bytes());
        }
        let out = self
            .out
            .as_mut()
            .expect("a writer is finished only by finish(self)");
        out.write_all(&self.buf)
            .with_context(|| format!("cannot write {}", self.tmp.display()))?;
        let len = t.tokens.len() as u64 + 2;
        self.pieces.push(Piece {
            source: rel.to_owned(),
            offset: self.tokens,
            len,
            notes: t.notes as u64,
        });
        self.tokens += len;
        self.notes += t.notes as u64;
        self.input_bytes += t.bytes;
        Ok(())
    }

    /// Tokenizes `files` and adds their results in input order, a chunk of
    /// [`TOKENIZE_CHUNK`] files at a time, in parallel within a chunk (on the
    /// current rayon pool), calling `progress` after each file: memory stays
    /// bounded by one chunk's tokens whatever the number of files.
    pub fn tokenize(
        &mut self,
        files: &[(PathBuf, String)],
        limits: &Limits,
        progress: &(dyn Fn() + Sync),
    ) -> Result<()> {
        for chunk in files.chunks(TOKENIZE_CHUNK) {
            let results = tokenize_files_with(chunk, self.vocab, limits, progress);
            for ((path, rel), r) in chunk.iter().zip(results) {
                self.push(path, rel, r)?;
            }
        }
        Ok(())
    }

    /// Pieces written so far.
    pub fn pieces(&self) -> usize {
        self.pieces.len()
    }

    /// Files skipped so far, with their reasons.
    pub fn skipped(&self) -> &[Skipped] {
        &self.skipped
    }

    /// Puts the dataset in place: `tokens.bin`, `pieces.json`, `vocab.json`,
    /// then `manifest.json`, whose presence means the dataset is complete.
    pub fn finish(mut self) -> Result<Manifest> {
        let out = self.out.take().expect("finished once");
        let file = out
            .into_inner()
            .map_err(|e| e.into_error())
            .and_then(|f| f.sync_all().map(|_| f))
            .with_context(|| format!("cannot write {}", self.tmp.display()))?;
        drop(file);
        // A replaced dataset is incomplete (no manifest) until the new one is in.
        let old_manifest = self.dir.join(MANIFEST_FILE);
        if old_manifest.is_file() {
            std::fs::remove_file(&old_manifest)
                .with_context(|| format!("cannot remove {}", old_manifest.display()))?;
        }
        let bin = self.dir.join(TOKENS_FILE);
        std::fs::rename(&self.tmp, &bin)
            .with_context(|| format!("cannot move {} to {}", self.tmp.display(), bin.display()))?;
        self.moved = true;
        let manifest = Manifest {
            format_version: 1,
            vocab_hash: self.vocab.hash().to_string(),
            vocab_size: self.vocab.len(),
            pieces: self.pieces.len(),
            tokens: self.tokens,
            notes: self.notes,
            input_bytes: self.input_bytes,
            files_seen: self.files_seen,
            skipped: std::mem::take(&mut self.skipped),
            warnings: std::mem::take(&mut self.warnings),
        };
        crate::util::write_atomic(
            &self.dir.join(PIECES_FILE),
            &serde_json::to_vec(&self.pieces)?,
        )?;
        self.vocab.save(&self.dir.join(VOCAB_FILE))?;
        crate::util::write_json(&self.dir.join(MANIFEST_FILE), &manifest)?;
        Ok(manifest)
    }
}

impl Drop for DatasetWriter<'_> {
    fn drop(&mut self) {
        if !self.moved {
            self.out.take();
            std::fs::remove_file(&self.tmp).ok();
            if self.made_dir {
                // Only when empty: remove_dir fails otherwise.
                std::fs::remove_dir(&self.dir).ok();
            }
        }
    }
}

/// A dataset opened for reading; token ids are memory-mapped.
pub struct Dataset {
    pub dir: PathBuf,
    pub manifest: Manifest,
    pub pieces: Vec<Piece>,
    pub vocab: Vocab,
    tokens: memmap2::Mmap,
}

impl Dataset {
    pub fn open(dir: &Path) -> Result<Dataset> {
        let read = |name: &str| -> Result<Vec<u8>> {
            let p = dir.join(name);
            crate::limits::read_file(&p, crate::limits::MAX_INDEX_BYTES).with_context(|| {
                format!(
                    "cannot read {} (is {} a dataset made by `cadenza tokenize`?)",
                    p.display(),
                    dir.display()
                )
            })
        };
        let manifest: Manifest = serde_json::from_slice(&read(MANIFEST_FILE)?)
            .with_context(|| format!("{}: bad manifest", dir.join(MANIFEST_FILE).display()))?;
        let pieces: Vec<Piece> = serde_json::from_slice(&read(PIECES_FILE)?)
            .with_context(|| format!("{}: bad piece index", dir.join(PIECES_FILE).display()))?;
        let vocab = Vocab::load(&dir.join(VOCAB_FILE))?;
        if vocab.hash() != manifest.vocab_hash {
            bail!(
                "{}: vocabulary hash {} differs from the manifest's {}",
                dir.display(),
                vocab.hash(),
                manifest.vocab_hash
            );
        }
        let path = dir.join(TOKENS_FILE);
        let file = std::fs::File::open(&path)
            .with_context(|| format!("cannot open {}", path.display()))?;
        // SAFETY: the file is opened read-only and datasets are written
        // atomically (temporary file + rename), never modified in place.
        let tokens = unsafe { memmap2::Mmap::map(&file) }
            .with_context(|| format!("cannot map {}", path.display()))?;
        let n = tokens.len() as u64 / 2;
        if tokens.len() % 2 != 0 || n != manifest.tokens {
            bail!(
                "{}: {} bytes, but the manifest's {} tokens of 2 bytes make {} bytes",
                path.display(),
                tokens.len(),
                manifest.tokens,
                manifest.tokens as u128 * 2
            );
        }
        // Every id must be in the vocabulary: an id past its end would index
        // out of the embedding (a libtorch abort) or print garbage.
        let size = vocab.len();
        if let Some((i, id)) = tokens
            .chunks_exact(2)
            .map(|c| u16::from_le_bytes([c[0], c[1]]) as usize)
            .enumerate()
            .find(|&(_, id)| id >= size)
        {
            bail!(
                "{}: token {i} has id {id}, outside the vocabulary of {size} tokens \
                 (file corrupt or from another vocabulary)",
                path.display()
            );
        }
        for p in &pieces {
            if p.offset.checked_add(p.len).is_none_or(|end| end > n) || p.len < 2 {
                bail!(
                    "{}: piece {} lies outside tokens.bin",
                    dir.display(),
                    p.source
                );
            }
        }
        Ok(Dataset {
            dir: dir.to_path_buf(),
            manifest,
            pieces,
            vocab,
            tokens,
        })
    }

    pub fn total_tokens(&self) -> u64 {
        self.tokens.len() as u64 / 2
    }

    /// Token `i` of the whole stream.
    pub fn token(&self, i: u64) -> u32 {
        let i = i as usize * 2;
        u16::from_le_bytes([self.tokens[i], self.tokens[i + 1]]) as u32
    }

    /// The ids of piece `i` (with BOS and EOS).
    pub fn piece_tokens(&self, i: usize) -> Vec<u32> {
        let p = &self.pieces[i];
        (p.offset..p.offset + p.len)
            .map(|j| self.token(j))
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sort_paths_is_path_order() {
        let mut v: Vec<PathBuf> = [
            "a/b-c.mid",
            "a-b/c.mid",
            "a/b/c.mid",
            "A/z.mid",
            "a/b.mid",
            "./x.mid",
            "/r/s.mid",
            "a/b/c.mid",
            "a/./b/d.mid",
        ]
        .iter()
        .map(PathBuf::from)
        .collect();
        let mut want = v.clone();
        want.sort();
        sort_paths(&mut v);
        assert_eq!(v, want);
        assert_ne!(
            want[0],
            PathBuf::from("a/b-c.mid"),
            "the case is not trivial"
        );
    }

    fn piece(tokens: &[u32], notes: usize) -> Result<Tokenized> {
        Ok(Tokenized {
            tokens: tokens.to_vec(),
            notes,
            bytes: 10,
            warnings: Vec::new(),
        })
    }

    #[test]
    fn writer_writes_pieces_in_order_and_reports_skips() {
        let vocab = Vocab::new(crate::tokenizer::RemiConfig::default()).unwrap();
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("ds");
        let mut w = DatasetWriter::create(&dir, &vocab).unwrap();
        w.push(Path::new("a.mid"), "c/a.mid", piece(&[5, 6, 7], 1))
            .unwrap();
        w.push(
            Path::new("b.mid"),
            "c/b.mid",
            Err(anyhow::anyhow!("b.mid: broken")),
        )
        .unwrap();
        w.push(Path::new("e.mid"), "c/e.mid", piece(&[], 0))
            .unwrap();
        w.push(Path::new("d.mid"), "c/d.mid", piece(&[9, 8], 2))
            .unwrap();
        assert_eq!(w.pieces(), 2);
        let m = w.finish().unwrap();
        assert_eq!((m.pieces, m.tokens, m.notes, m.files_seen), (2, 9, 3, 4));
        let reasons: Vec<_> = m.skipped.iter().map(|s| s.reason.as_str()).collect();
        assert_eq!(reasons, ["broken", "no notes"]);
        let ds = Dataset::open(&dir).unwrap();
        assert_eq!(ds.piece_tokens(0), [BOS_ID, 5, 6, 7, EOS_ID]);
        assert_eq!(ds.piece_tokens(1), [BOS_ID, 9, 8, EOS_ID]);
        assert_eq!(
            (ds.pieces[1].source.as_str(), ds.pieces[1].offset),
            ("c/d.mid", 5)
        );
        let names: Vec<_> = std::fs::read_dir(&dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .collect();
        assert!(names.iter().all(|n| !n.ends_with(".tmp")), "{names:?}");
    }

    #[test]
    fn an_unfinished_writer_leaves_the_folder_as_it_was() {
        let vocab = Vocab::new(crate::tokenizer::RemiConfig::default()).unwrap();
        let tmp = tempfile::tempdir().unwrap();
        // A folder it made goes with it.
        let dir = tmp.path().join("new");
        let mut w = DatasetWriter::create(&dir, &vocab).unwrap();
        w.push(Path::new("a.mid"), "a.mid", piece(&[5], 1)).unwrap();
        drop(w);
        assert!(!dir.exists());
        // An existing dataset stays whole: same manifest, same tokens.
        let dir = tmp.path().join("old");
        let files = [(PathBuf::from("a.mid"), "a.mid".to_string())];
        write_dataset(&dir, &vocab, &files, vec![piece(&[5, 6], 1)]).unwrap();
        let before: Vec<_> = [TOKENS_FILE, PIECES_FILE, MANIFEST_FILE]
            .iter()
            .map(|f| std::fs::read(dir.join(f)).unwrap())
            .collect();
        let mut w = DatasetWriter::create(&dir, &vocab).unwrap();
        w.push(Path::new("b.mid"), "b.mid", piece(&[7, 7, 7], 1))
            .unwrap();
        drop(w);
        let after: Vec<_> = [TOKENS_FILE, PIECES_FILE, MANIFEST_FILE]
            .iter()
            .map(|f| std::fs::read(dir.join(f)).unwrap())
            .collect();
        assert_eq!(before, after);
        assert_eq!(
            std::fs::read_dir(&dir).unwrap().count(),
            4,
            "no temporary file left"
        );
    }
}
