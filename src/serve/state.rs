//! What the studio remembers: prompts, jobs and the pieces of the output
//! folder (those of earlier studios are read back from their `NAME.json`
//! records at start), and how generated files are named
//! (`PROMPT-seedSEED-VARIATION`, never reused).

use std::collections::{BTreeMap, HashSet};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::{SyncSender, TrySendError};
use std::sync::{Arc, Mutex, MutexGuard};

use serde::{Deserialize, Serialize};

use super::host::HostCheck;
pub use super::settings::JobRequest;
use super::ServeOptions;
use crate::eval::stats::PieceStats;
use crate::sample::Stop;
use crate::tokenizer::{dataset, Vocab, BAR_ID};

/// A job sent to the worker.
pub(crate) struct Work {
    pub job: u64,
    /// The prompt's tokens without BOS (empty: start from nothing).
    pub body: Arc<Vec<u32>>,
    /// The prompt file as read (none: start from nothing); the written pieces
    /// keep its own events.
    pub file: Option<Arc<crate::midi::Score>>,
    pub prompt_name: Option<String>,
    pub req: JobRequest,
    pub cancel: Arc<AtomicBool>,
}

/// What the handlers know of the model.
pub(crate) struct ModelInfo {
    pub vocab: Vocab,
    pub name: String,
    pub preset: String,
    pub parameters: i64,
}

/// Prompts kept (the oldest are forgotten first).
const MAX_PROMPTS: usize = 64;
/// Finished jobs kept (their pieces stay in the gallery).
const MAX_FINISHED_JOBS: usize = 256;

/// A prompt the page can generate from.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct PromptInfo {
    pub id: u64,
    pub name: String,
    /// "upload", "sample" or "piece".
    pub source: String,
    pub bars: usize,
    pub tokens: usize,
    pub notes: usize,
    pub seconds: f64,
    pub warnings: Vec<String>,
}

pub(crate) struct Prompt {
    pub info: PromptInfo,
    pub body: Arc<Vec<u32>>,
    /// The file as read, whose own events the pieces keep.
    pub file: Arc<crate::midi::Score>,
}

#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum JobState {
    Queued,
    Running,
    Rendering,
    Done,
    Failed,
    Cancelled,
}

impl JobState {
    pub fn finished(self) -> bool {
        matches!(
            self,
            JobState::Done | JobState::Failed | JobState::Cancelled
        )
    }
}

/// The files of a piece, as URLs.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct PieceFilesView {
    pub midi: String,
    pub wav: Option<String>,
    pub png: String,
    pub tokens: String,
    pub settings: String,
}

impl PieceFilesView {
    /// Every URL, the MIDI file's first.
    pub fn urls(&self) -> Vec<&str> {
        let mut v = vec![self.midi.as_str()];
        v.extend(self.wav.as_deref());
        v.extend([
            self.png.as_str(),
            self.tokens.as_str(),
            self.settings.as_str(),
        ]);
        v
    }
}

/// One generated piece.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct PieceView {
    pub id: u64,
    pub job: u64,
    /// 1-based, within its job.
    pub index: usize,
    /// The files' common name, e.g. `piece-0007`.
    pub name: String,
    pub prompt_name: Option<String>,
    pub files: PieceFilesView,
    pub prompt_tokens: usize,
    pub tokens: usize,
    /// Tokens drawn after the prompt, as the progress counted them (EOS and
    /// an unfinished note cut at the end are drawn but not kept).
    #[serde(default)]
    pub drawn: usize,
    pub notes: usize,
    pub seconds: f64,
    /// Length of the WAV file (none without a SoundFont).
    pub audio_seconds: Option<f64>,
    pub stop: Stop,
    pub stats: PieceStats,
    /// Statistics of the part of the prompt used (none without a prompt).
    pub prompt_stats: Option<PieceStats>,
    /// Where the prompt ends in the piece, in seconds (none without a prompt).
    #[serde(default)]
    pub prompt_seconds: Option<f64>,
    /// Instruments allowed (or of the prompt) that played no note after the
    /// prompt, by name, and why (none when every one played).
    #[serde(default)]
    pub silent: Option<String>,
    pub settings: JobRequest,
}

/// A job as `/api/jobs/{id}` shows it.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct JobView {
    pub id: u64,
    pub state: JobState,
    /// Jobs ahead of this one while it waits.
    pub queue_position: Option<usize>,
    pub settings: JobRequest,
    pub prompt_name: Option<String>,
    /// Steps done (each step adds a token to every piece).
    pub tokens_done: usize,
    pub tokens_total: usize,
    /// Tokens per second, all pieces together.
    pub tokens_per_second: f64,
    pub elapsed_seconds: f64,
    pub error: Option<String>,
    pub pieces: Vec<PieceView>,
}

pub(crate) struct JobEntry {
    pub view: JobView,
    pub cancel: Arc<AtomicBool>,
}

#[derive(Default)]
pub(crate) struct Inner {
    pub prompts: BTreeMap<u64, Prompt>,
    pub jobs: BTreeMap<u64, JobEntry>,
    pub gallery: Vec<PieceView>,
    /// File names under the output folder that `/files/` may serve.
    pub files: HashSet<String>,
}

pub(crate) struct Shared {
    pub inner: Mutex<Inner>,
    tx: SyncSender<Work>,
    next_id: AtomicU64,
    /// Held while a name is chosen.
    naming: Mutex<()>,
    pub out: PathBuf,
    pub samples: Option<PathBuf>,
    pub max_upload: usize,
    pub queue: usize,
    pub model: ModelInfo,
    pub soundfont: Option<PathBuf>,
    /// The `Host` headers answered.
    pub host: HostCheck,
}

/// Why a job was not queued.
pub(crate) enum SubmitError {
    Invalid(String),
    Busy,
}

impl Shared {
    pub fn new(
        opts: &ServeOptions,
        model: ModelInfo,
        soundfont: Option<PathBuf>,
        tx: SyncSender<Work>,
        host: HostCheck,
    ) -> Shared {
        Shared {
            inner: Mutex::new(Inner::default()),
            tx,
            next_id: AtomicU64::new(1),
            naming: Mutex::new(()),
            out: opts.out.clone(),
            samples: opts.samples.clone(),
            max_upload: opts.max_upload,
            queue: opts.queue,
            model,
            soundfont,
            host,
        }
    }

    pub fn lock(&self) -> MutexGuard<'_, Inner> {
        // A panic while the lock was held leaves consistent enough data.
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub fn vocab(&self) -> &Vocab {
        &self.model.vocab
    }

    fn id(&self) -> u64 {
        self.next_id.fetch_add(1, Ordering::Relaxed)
    }

    /// The sample prompts offered: MIDI files of the samples folder, by name.
    pub fn sample_names(&self) -> Vec<String> {
        let Some(dir) = &self.samples else {
            return Vec::new();
        };
        let mut names: Vec<String> = std::fs::read_dir(dir)
            .into_iter()
            .flatten()
            .flatten()
            .map(|e| e.path())
            .filter(|p| p.is_file() && dataset::is_midi_path(p))
            .filter_map(|p| p.file_name().map(|n| n.to_string_lossy().into_owned()))
            .collect();
        names.sort();
        names
    }

    /// Parses MIDI bytes as a prompt (the command line's checks) and keeps it.
    pub fn add_prompt(&self, bytes: &[u8], name: &str, source: &str) -> anyhow::Result<PromptInfo> {
        let (score, body, warnings) =
            crate::sample::pieces::prompt_from_bytes(bytes, name, self.vocab())?;
        let info = PromptInfo {
            id: self.id(),
            name: name.to_string(),
            source: source.to_string(),
            bars: body.iter().filter(|&&t| t == BAR_ID).count(),
            tokens: body.len(),
            notes: score.notes.len(),
            seconds: score.duration_seconds(),
            warnings,
        };
        let mut inner = self.lock();
        inner.prompts.insert(
            info.id,
            Prompt {
                info: info.clone(),
                body: Arc::new(body),
                file: Arc::new(score),
            },
        );
        while inner.prompts.len() > MAX_PROMPTS {
            inner.prompts.pop_first();
        }
        Ok(info)
    }

    /// Queues a job, or says why not.
    /// A job without a seed gets a new one here: its view shows the seed used.
    pub fn submit(&self, mut req: JobRequest) -> Result<JobView, SubmitError> {
        req.validate().map_err(SubmitError::Invalid)?;
        req.seed = Some(req.seed.unwrap_or_else(super::settings::new_seed));
        let (body, file, prompt_name) = match req.prompt {
            Some(id) => {
                let inner = self.lock();
                let p = inner.prompts.get(&id).ok_or_else(|| {
                    SubmitError::Invalid(format!(
                        "prompt {id} is unknown (forgotten, or never uploaded): choose it again"
                    ))
                })?;
                (
                    p.body.clone(),
                    Some(p.file.clone()),
                    Some(p.info.name.clone()),
                )
            }
            None => (Arc::new(Vec::new()), None, None),
        };
        let id = self.id();
        let cancel = Arc::new(AtomicBool::new(false));
        let view = JobView {
            id,
            state: JobState::Queued,
            queue_position: None,
            settings: req.clone(),
            prompt_name: prompt_name.clone(),
            tokens_done: 0,
            tokens_total: req.tokens,
            tokens_per_second: 0.0,
            elapsed_seconds: 0.0,
            error: None,
            pieces: Vec::new(),
        };
        // The entry exists before the worker can see the job.
        self.lock().jobs.insert(
            id,
            JobEntry {
                view: view.clone(),
                cancel: cancel.clone(),
            },
        );
        let work = Work {
            job: id,
            body,
            file,
            prompt_name,
            req,
            cancel,
        };
        match self.tx.try_send(work) {
            Ok(()) => Ok(view),
            Err(e) => {
                self.lock().jobs.remove(&id);
                match e {
                    TrySendError::Full(_) => Err(SubmitError::Busy),
                    TrySendError::Disconnected(_) => {
                        Err(SubmitError::Invalid("the generator has stopped".into()))
                    }
                }
            }
        }
    }

    /// A job's view, with its place in the queue.
    pub fn job(&self, id: u64) -> Option<JobView> {
        let inner = self.lock();
        let mut view = inner.jobs.get(&id)?.view.clone();
        if view.state == JobState::Queued {
            let ahead = inner
                .jobs
                .range(..id)
                .filter(|(_, j)| !j.view.state.finished())
                .count();
            view.queue_position = Some(ahead);
        }
        Some(view)
    }

    /// The jobs not finished yet, oldest first, with their places in the queue.
    pub fn active_jobs(&self) -> Vec<JobView> {
        let ids: Vec<u64> = {
            let inner = self.lock();
            inner
                .jobs
                .iter()
                .filter(|(_, j)| !j.view.state.finished())
                .map(|(&k, _)| k)
                .collect()
        };
        ids.into_iter().filter_map(|id| self.job(id)).collect()
    }

    /// Asks a job to stop; false for an unknown job.
    pub fn cancel(&self, id: u64) -> bool {
        match self.lock().jobs.get(&id) {
            Some(j) => {
                j.cancel.store(true, Ordering::Relaxed);
                true
            }
            None => false,
        }
    }

    /// Changes a job's view.
    pub fn update(&self, id: u64, f: impl FnOnce(&mut JobView)) {
        let mut inner = self.lock();
        if let Some(j) = inner.jobs.get_mut(&id) {
            f(&mut j.view);
        }
    }

    /// Ends a job: its pieces join the gallery; old finished jobs are forgotten.
    pub fn finish(&self, id: u64, state: JobState, error: Option<String>) {
        let mut inner = self.lock();
        let Some(j) = inner.jobs.get_mut(&id) else {
            return;
        };
        j.view.state = state;
        j.view.error = error;
        let pieces = j.view.pieces.clone();
        inner.gallery.extend(pieces);
        let finished: Vec<u64> = inner
            .jobs
            .iter()
            .filter(|(_, j)| j.view.state.finished())
            .map(|(&k, _)| k)
            .collect();
        for k in finished
            .iter()
            .take(finished.len().saturating_sub(MAX_FINISHED_JOBS))
        {
            inner.jobs.remove(k);
        }
    }

    /// A new name, `stem` or else `stem-2`, `stem-3`, ..., none of whose
    /// files exists in the output folder (the MIDI file is created empty to
    /// hold the name).
    pub fn reserve_name(&self, stem: &str) -> std::io::Result<String> {
        let _one_at_a_time = self.naming.lock().unwrap_or_else(|e| e.into_inner());
        for k in 1u64.. {
            let name = if k == 1 {
                stem.to_string()
            } else {
                format!("{stem}-{k}")
            };
            if PIECE_EXTENSIONS
                .iter()
                .skip(1)
                .chain(&["zip"])
                .any(|e| self.out.join(format!("{name}.{e}")).exists())
            {
                continue;
            }
            match std::fs::OpenOptions::new()
                .write(true)
                .create_new(true)
                .open(self.out.join(format!("{name}.mid")))
            {
                Ok(_) => return Ok(name),
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => continue,
                Err(e) => return Err(e),
            }
        }
        unreachable!("u64 names run out")
    }

    /// Adds a finished piece to its job (the gallery gets it when the job ends).
    pub fn add_piece(&self, job: u64, mut piece: PieceView) {
        piece.id = self.id();
        self.update(job, |v| v.pieces.push(piece));
    }

    /// The piece with this id, from the gallery or a running job.
    pub fn piece(&self, id: u64) -> Option<PieceView> {
        let inner = self.lock();
        inner
            .gallery
            .iter()
            .chain(inner.jobs.values().flat_map(|j| j.view.pieces.iter()))
            .find(|p| p.id == id)
            .cloned()
    }

    /// Lists the pieces an earlier studio left in the output folder: every
    /// `NAME.json` record with a `piece` entry whose MIDI file is there, in
    /// the order they were written; their files become downloadable. Returns
    /// how many were listed and how many records could not be read.
    pub fn load_gallery(&self) -> (usize, usize) {
        let mut found: Vec<(std::time::SystemTime, PieceView)> = Vec::new();
        let mut unreadable = 0;
        let entries = std::fs::read_dir(&self.out).into_iter().flatten().flatten();
        for e in entries {
            let path = e.path();
            let Some(name) = path
                .file_name()
                .and_then(|n| n.to_str())
                .and_then(|n| n.strip_suffix(".json"))
            else {
                continue;
            };
            if name.starts_with('.') {
                continue;
            }
            match recorded_piece(&path, name, &self.out) {
                Ok(Some(p)) => {
                    let when = e
                        .metadata()
                        .and_then(|m| m.modified())
                        .unwrap_or(std::time::UNIX_EPOCH);
                    found.push((when, p));
                }
                Ok(None) => {}
                Err(()) => unreadable += 1,
            }
        }
        found.sort_by(|a, b| a.0.cmp(&b.0).then_with(|| a.1.name.cmp(&b.1.name)));
        let n = found.len();
        for (_, mut piece) in found {
            piece.id = self.id();
            piece.job = 0;
            self.publish(
                piece
                    .files
                    .urls()
                    .iter()
                    .filter_map(|u| u.strip_prefix("/files/"))
                    .map(str::to_string)
                    .collect::<Vec<_>>(),
            );
            self.lock().gallery.push(piece);
        }
        (n, unreadable)
    }

    /// Lets `/files/` serve these names.
    pub fn publish(&self, names: impl IntoIterator<Item = String>) {
        self.lock().files.extend(names);
    }

    pub fn file_path(&self, name: &str) -> Option<PathBuf> {
        self.lock()
            .files
            .contains(name)
            .then(|| self.out.join(name))
    }
}

/// The piece a `NAME.json` record describes, its files' URLs rebuilt from
/// what is in `out` (a missing WAV is dropped, so is a piece without its
/// MIDI file); `Ok(None)` for JSON that is not a studio record, `Err` for a
/// record that cannot be read.
fn recorded_piece(path: &Path, name: &str, out: &Path) -> Result<Option<PieceView>, ()> {
    let text = std::fs::read_to_string(path).map_err(|_| ())?;
    let v: serde_json::Value = serde_json::from_str(&text).map_err(|_| ())?;
    let Some(piece) = v.get("piece") else {
        return Ok(None);
    };
    let mut piece: PieceView = serde_json::from_value(piece.clone()).map_err(|_| ())?;
    if piece.name != name || !out.join(format!("{name}.mid")).is_file() {
        return Ok(None);
    }
    let url = |ext: &str| file_url(&format!("{name}.{ext}"));
    let wav = out
        .join(format!("{name}.wav"))
        .is_file()
        .then(|| url("wav"));
    if wav.is_none() {
        piece.audio_seconds = None;
    }
    piece.files = PieceFilesView {
        midi: url("mid"),
        wav,
        png: url("png"),
        tokens: url("tokens.txt"),
        settings: url("json"),
    };
    Ok(Some(piece))
}

/// The files of one piece: `NAME.EXT`, the MIDI file first.
pub const PIECE_EXTENSIONS: [&str; 5] = ["mid", "wav", "png", "tokens.txt", "json"];

/// Longest prompt part of a piece's name.
const MAX_STEM_CHARS: usize = 40;

/// The name a piece's files start with: the prompt's file name (letters,
/// digits and dashes; `new` without a prompt), the job's seed and the
/// variation, e.g. `oneills-reel-4-4-seed7-1`.
pub fn piece_stem(prompt_name: Option<&str>, seed: u64, variation: usize) -> String {
    let base = prompt_name.map_or("", |n| {
        let n = n.trim();
        let lower = n.to_ascii_lowercase();
        [".midi", ".mid", ".smf"]
            .iter()
            .find_map(|e| lower.ends_with(e).then(|| &n[..n.len() - e.len()]))
            .unwrap_or(n)
    });
    let mut slug = String::new();
    for c in base.chars() {
        if c.is_ascii_alphanumeric() {
            slug.push(c.to_ascii_lowercase());
        } else if !slug.is_empty() && !slug.ends_with('-') {
            slug.push('-');
        }
        if slug.len() >= MAX_STEM_CHARS {
            break;
        }
    }
    let slug = slug.trim_end_matches('-');
    let slug = if slug.is_empty() {
        if prompt_name.is_some() {
            "prompt"
        } else {
            "new"
        }
    } else {
        slug
    };
    format!("{slug}-seed{seed}-{variation}")
}

/// The URL of a file under `/files/`.
pub fn file_url(name: &str) -> String {
    format!("/files/{name}")
}

/// The file name part of an uploaded name, shortened; "prompt.mid" when none.
pub fn clean_name(name: Option<&str>) -> String {
    let base = name
        .and_then(|n| Path::new(n).file_name())
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let base: String = base.chars().filter(|c| !c.is_control()).take(120).collect();
    if base.trim().is_empty() {
        "prompt.mid".into()
    } else {
        base
    }
}

#[cfg(test)]
mod tests {
    use super::piece_stem;

    #[test]
    fn pieces_are_named_after_prompt_seed_and_variation() {
        let s = |p: Option<&str>| piece_stem(p, 7, 2);
        assert_eq!(s(Some("oneills-reel-4-4.mid")), "oneills-reel-4-4-seed7-2");
        assert_eq!(s(Some("My Song (take 2).MIDI")), "my-song-take-2-seed7-2");
        assert_eq!(s(None), "new-seed7-2");
        assert_eq!(s(Some("日本.mid")), "prompt-seed7-2");
        assert_eq!(s(Some("../../x.mid")), "x-seed7-2");
        let long = "a".repeat(200);
        assert_eq!(s(Some(&long)), format!("{}-seed7-2", "a".repeat(40)));
        for name in [Some("a/b\\c:d*e?.mid"), Some("-.-"), None] {
            let n = s(name);
            assert!(
                n.chars().all(|c| c.is_ascii_alphanumeric() || c == '-'),
                "{n}"
            );
        }
    }
}
