//! The one thread that owns the model: it takes jobs from the bounded
//! channel one at a time, samples with progress and cancellation, and writes
//! each piece's files with the same code as `cadenza generate`.

use std::panic::AssertUnwindSafe;
use std::path::PathBuf;
use std::sync::atomic::Ordering;
use std::sync::mpsc::{Receiver, SyncSender};
use std::sync::Weak;
use std::time::Instant;

use anyhow::{Context, Result};

use super::state::{
    self, file_url, JobState, ModelInfo, PieceFilesView, PieceView, Shared, Work, PIECE_EXTENSIONS,
};
use super::ServeOptions;
use crate::eval::stats;
use crate::sample::{self, pieces, Cancelled};
use crate::tokenizer;
use crate::train::checkpoint::{self, LoadedModel};

/// Starts the worker: it loads the model and, once that worked, waits for
/// `Shared` (through the returned sender) and then for jobs.
pub(crate) fn spawn(
    opts: &ServeOptions,
    rx: Receiver<Work>,
) -> Result<(ModelInfo, SyncSender<Weak<Shared>>)> {
    let (ready_tx, ready_rx) = std::sync::mpsc::sync_channel::<Result<ModelInfo>>(1);
    let (shared_tx, shared_rx) = std::sync::mpsc::sync_channel::<Weak<Shared>>(1);
    let model_dir = opts.model.clone();
    let device = opts.device.clone();
    let threads = opts.threads;
    let precision = opts.precision;
    std::thread::Builder::new()
        .name("cadenza-generator".into())
        .spawn(move || {
            let loaded = (|| -> Result<LoadedModel> {
                let device = checkpoint::parse_device(device.as_deref())?;
                crate::train::set_threads(threads);
                checkpoint::load_model(&model_dir, device)
            })();
            let mut m = match loaded {
                Ok(m) => m,
                Err(e) => {
                    let _ = ready_tx.send(Err(e));
                    return;
                }
            };
            tracing::info!("precision: {}", m.model.set_precision(precision));
            let name = model_dir
                .canonicalize()
                .unwrap_or(model_dir.clone())
                .file_name()
                .map(|n| n.to_string_lossy().into_owned())
                .unwrap_or_else(|| model_dir.display().to_string());
            let info = ModelInfo {
                vocab: m.vocab.clone(),
                name,
                preset: m.config.preset.clone(),
                parameters: m
                    .vs
                    .trainable_variables()
                    .iter()
                    .map(|t| t.numel() as i64)
                    .sum(),
            };
            if ready_tx.send(Ok(info)).is_err() {
                return;
            }
            let Ok(shared) = shared_rx.recv() else {
                return;
            };
            // Ends when every sender (the handlers' state) is gone.
            while let Ok(work) = rx.recv() {
                let Some(shared) = shared.upgrade() else {
                    break;
                };
                let job = work.job;
                let out = std::panic::catch_unwind(AssertUnwindSafe(|| run(&mut m, &shared, work)));
                let (state, error) = match out {
                    Ok(Ok(())) => (JobState::Done, None),
                    Ok(Err(e)) if e.downcast_ref::<Cancelled>().is_some() => {
                        (JobState::Cancelled, None)
                    }
                    Ok(Err(e)) => (JobState::Failed, Some(format!("{e:#}"))),
                    Err(p) => {
                        let msg = p
                            .downcast_ref::<String>()
                            .cloned()
                            .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
                            .unwrap_or_else(|| "unknown".into());
                        (
                            JobState::Failed,
                            Some(format!("the generator failed: {msg}")),
                        )
                    }
                };
                shared.finish(job, state, error);
            }
        })
        .context("cannot start the generator thread")?;
    let info = ready_rx
        .recv()
        .context("the generator thread stopped while loading the model")??;
    Ok((info, shared_tx))
}

/// Piano rolls sized for the page: a whole piece in at most 1,200 pixels.
fn studio_roll() -> crate::render::PianoRollOptions {
    crate::render::PianoRollOptions {
        pixels_per_second: 40.0,
        max_width: 1200,
        row_height: 6,
        ..Default::default()
    }
}

/// Seconds at which bar `bars + 1` of `score` starts: where a prompt of
/// `bars` bars ends (none when the piece is no longer than that).
fn prompt_end_seconds(score: &crate::midi::Score, bars: usize) -> Option<f64> {
    let starts = score.bar_ticks(score.end_tick());
    starts.get(bars).map(|&t| score.tick_to_seconds(t))
}

/// One job, start to end; `Err(Cancelled)` when asked to stop.
fn run(m: &mut LoadedModel, shared: &Shared, work: Work) -> Result<()> {
    let Work {
        job,
        body,
        file,
        prompt_name,
        req,
        cancel,
    } = work;
    if cancel.load(Ordering::Relaxed) {
        return Err(Cancelled.into());
    }
    let t0 = Instant::now();
    shared.update(job, |v| v.state = JobState::Running);
    let vocab = &m.vocab;
    let prompt = sample::prompt_tokens(&body, req.prompt_bars);
    let programs = pieces::parse_programs(&req.programs, &sample::programs_of(vocab, &prompt))?;
    let prompt_bars = prompt.iter().filter(|&&t| t == tokenizer::BAR_ID).count();
    let cfg = req.sample_config(programs, prompt_bars);
    m.model.freeze(cfg.seed);
    let n = req.num_samples;
    let samples = sample::generate_until(&m.model, vocab, &prompt, n, &cfg, &mut |k| {
        let secs = t0.elapsed().as_secs_f64();
        shared.update(job, |v| {
            v.tokens_done = k;
            v.elapsed_seconds = secs;
            v.tokens_per_second = (k * n) as f64 / secs.max(1e-9);
        });
        !cancel.load(Ordering::Relaxed)
    })?;
    shared.update(job, |v| v.state = JobState::Rendering);

    let prompt_stats = (!body.is_empty()).then(|| {
        let (score, _) = tokenizer::decode(&prompt, vocab);
        stats::piece_stats(&tokenizer::to_output_resolution(&score))
    });
    for (i, s) in samples.iter().enumerate() {
        if cancel.load(Ordering::Relaxed) {
            return Err(Cancelled.into());
        }
        let stem = state::piece_stem(prompt_name.as_deref(), cfg.seed, i + 1);
        let name = shared
            .reserve_name(&stem)
            .with_context(|| format!("cannot create a file in {}", shared.out.display()))?;
        let path = |ext: &str| -> PathBuf { shared.out.join(format!("{name}.{ext}")) };
        let files = pieces::PieceFiles {
            midi: path("mid"),
            tokens: Some(path("tokens.txt")),
            wav: shared.soundfont.as_ref().map(|_| path("wav")),
            png: Some(path("png")),
            piano_roll: studio_roll(),
        };
        let w = pieces::write_piece(
            s,
            vocab,
            &files,
            shared.soundfont.as_deref(),
            file.as_deref(),
        )?;
        let file = |ext: &str| file_url(&format!("{name}.{ext}"));
        let view = PieceView {
            id: 0,
            job,
            index: i + 1,
            name: name.clone(),
            prompt_name: prompt_name.clone(),
            files: PieceFilesView {
                midi: file("mid"),
                wav: w.audio.map(|_| file("wav")),
                png: file("png"),
                tokens: file("tokens.txt"),
                settings: file("json"),
            },
            prompt_tokens: s.prompt_len,
            tokens: s.tokens.len(),
            drawn: s.drawn,
            notes: w.score.notes.len(),
            seconds: w.score.duration_seconds(),
            audio_seconds: w.audio.map(|a| a.seconds),
            stop: s.stop,
            stats: stats::piece_stats(&w.score),
            prompt_stats: prompt_stats.clone(),
            prompt_seconds: (!body.is_empty())
                .then(|| prompt_end_seconds(&w.score, prompt_bars))
                .flatten(),
            silent: pieces::silence_warning(cfg.programs.as_deref(), &w.played),
            settings: req.clone(),
        };
        // The record of the piece; `piece` lets a later studio list it.
        let settings = serde_json::json!({
            "model": shared.model.name,
            "prompt": prompt_name,
            "sample": i + 1,
            "settings": req,
            "sample_config": cfg,
            "prompt_tokens": s.prompt_len,
            "tokens": s.tokens.len(),
            "stop": s.stop,
            "piece": view,
        });
        crate::util::write_json(&path("json"), &settings)?;
        shared.publish(
            PIECE_EXTENSIONS
                .iter()
                .filter(|e| **e != "wav" || w.audio.is_some())
                .map(|e| format!("{name}.{e}")),
        );
        shared.add_piece(job, view);
    }
    Ok(())
}
