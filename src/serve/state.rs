//! What the studio remembers: prompts, jobs and the pieces made since it
//! started, and how generated files are named.

use std::collections::{BTreeMap, HashSet};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::{SyncSender, TrySendError};
use std::sync::{Arc, Mutex, MutexGuard};

use serde::{Deserialize, Serialize};

use super::{ServeOptions, MAX_SAMPLES, MAX_TOKENS};
use crate::eval::stats::PieceStats;
use crate::sample::Stop;
use crate::tokenizer::{dataset, Vocab, BAR_ID};

/// A job sent to the worker.
pub(crate) struct Work {
    pub job: u64,
    /// The prompt's tokens without BOS (empty: start from nothing).
    pub body: Arc<Vec<u32>>,
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
}

/// The settings of a job, as the page sends them.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct JobRequest {
    /// A prompt id from `/api/prompts...`; none starts from nothing.
    pub prompt: Option<u64>,
    /// Use only the first bars of the prompt (none: all of it).
    pub prompt_bars: Option<usize>,
    pub tokens: usize,
    pub temperature: f64,
    pub top_k: usize,
    pub top_p: f64,
    pub seed: u64,
    pub num_samples: usize,
    /// Instruments the pieces may use, as `generate --programs` takes them:
    /// `prompt` (the prompt's; any without a prompt), `any`, or program
    /// numbers and `drums`, comma-separated.
    pub programs: String,
}

impl Default for JobRequest {
    fn default() -> Self {
        JobRequest {
            prompt: None,
            prompt_bars: Some(4),
            tokens: 512,
            temperature: 1.0,
            top_k: 0,
            top_p: 0.95,
            seed: 0,
            num_samples: 1,
            programs: "prompt".into(),
        }
    }
}

impl JobRequest {
    pub fn validate(&self) -> Result<(), String> {
        if self.tokens == 0 || self.tokens > MAX_TOKENS {
            return Err(format!(
                "tokens must be between 1 and {MAX_TOKENS} (got {})",
                self.tokens
            ));
        }
        if self.num_samples == 0 || self.num_samples > MAX_SAMPLES {
            return Err(format!(
                "the number of samples must be between 1 and {MAX_SAMPLES} (got {})",
                self.num_samples
            ));
        }
        if self.prompt_bars == Some(0) {
            return Err("prompt bars must be at least 1 (leave it empty for all)".into());
        }
        crate::sample::pieces::parse_programs(&self.programs, &[]).map_err(|e| format!("{e:#}"))?;
        self.sample_config(None)
            .validate()
            .map_err(|e| format!("{e:#}"))
    }

    /// The sampler's settings, with the instruments allowed.
    pub fn sample_config(&self, programs: Option<Vec<u8>>) -> crate::sample::SampleConfig {
        crate::sample::SampleConfig {
            max_tokens: self.tokens,
            temperature: self.temperature,
            top_k: self.top_k,
            top_p: self.top_p,
            seed: self.seed,
            programs,
            ..Default::default()
        }
    }
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
    pub notes: usize,
    pub seconds: f64,
    /// Length of the WAV file (none without a SoundFont).
    pub audio_seconds: Option<f64>,
    pub stop: Stop,
    pub stats: PieceStats,
    /// Statistics of the part of the prompt used (none without a prompt).
    pub prompt_stats: Option<PieceStats>,
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
    next_piece: Mutex<u64>,
    pub out: PathBuf,
    pub samples: Option<PathBuf>,
    pub max_upload: usize,
    pub queue: usize,
    pub model: ModelInfo,
    pub soundfont: Option<PathBuf>,
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
    ) -> Shared {
        Shared {
            inner: Mutex::new(Inner::default()),
            tx,
            next_id: AtomicU64::new(1),
            next_piece: Mutex::new(1),
            out: opts.out.clone(),
            samples: opts.samples.clone(),
            max_upload: opts.max_upload,
            queue: opts.queue,
            model,
            soundfont,
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
            },
        );
        while inner.prompts.len() > MAX_PROMPTS {
            inner.prompts.pop_first();
        }
        Ok(info)
    }

    /// Queues a job, or says why not.
    pub fn submit(&self, req: JobRequest) -> Result<JobView, SubmitError> {
        req.validate().map_err(SubmitError::Invalid)?;
        let (body, prompt_name) = match req.prompt {
            Some(id) => {
                let inner = self.lock();
                let p = inner.prompts.get(&id).ok_or_else(|| {
                    SubmitError::Invalid(format!(
                        "prompt {id} is unknown (forgotten, or never uploaded): choose it again"
                    ))
                })?;
                (p.body.clone(), Some(p.info.name.clone()))
            }
            None => (Arc::new(Vec::new()), None),
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

    /// A new name `piece-NNNN` none of whose files exists in the output
    /// folder (the MIDI file is created empty to hold the name).
    pub fn reserve_name(&self) -> std::io::Result<String> {
        let mut next = self.next_piece.lock().unwrap_or_else(|e| e.into_inner());
        loop {
            let name = format!("piece-{:04}", *next);
            *next += 1;
            if PIECE_EXTENSIONS
                .iter()
                .skip(1)
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

/// The files of one piece: `NAME.EXT`, the MIDI file first.
pub const PIECE_EXTENSIONS: [&str; 5] = ["mid", "wav", "png", "tokens.txt", "json"];

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
