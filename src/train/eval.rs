//! Per-position negative log-likelihood on held-out pieces: the measurement
//! behind SPE's claim that a model keeps working beyond its training length.

use std::path::{Path, PathBuf};

use anyhow::{bail, Result};
use serde::{Deserialize, Serialize};

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

pub fn evaluate(o: &EvalOptions) -> Result<EvalReport> {
    let device = checkpoint::parse_device(o.device.as_deref())?;
    super::set_threads(o.threads);
    let mut m = checkpoint::load_model(&o.model_dir, device)?;
    m.model.freeze(o.seed);
    let precision = m.model.set_precision(o.precision);
    tracing::info!("precision: {precision}");
    let train_len = m.config.train.seq_len as usize;
    let max_len = o.max_len.unwrap_or(2 * train_len);
    if o.bin == 0 || max_len == 0 {
        bail!("--bin and --max-len must be positive");
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
            let n = p.ids.len().min(max_len + 1);
            (p.source.clone(), p.ids[..n].to_vec())
        })
        .collect();
    let mut sums = vec![0.0; max_len];
    let mut counts = vec![0u64; max_len];
    let table = crate::eval::PitchTable::new(&m.vocab);
    let mut groups: std::collections::BTreeMap<String, crate::eval::Accumulator> =
        Default::default();
    for (source, ids) in &windows {
        let acc = groups.entry(crate::eval::source_group(source)).or_default();
        for (i, s) in crate::eval::score_window(&m.model, &m.vocab, &table, ids)
            .iter()
            .enumerate()
        {
            sums[i] += s.nll;
            counts[i] += 1;
            acc.add(s);
        }
    }
    let metrics = GroupedMetrics::from_groups(&groups);
    let bins = (0..max_len)
        .step_by(o.bin)
        .filter_map(|start| {
            let end = (start + o.bin).min(max_len);
            let tokens: u64 = counts[start..end].iter().sum();
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
