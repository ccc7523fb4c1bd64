//! Per-position negative log-likelihood on held-out pieces: the measurement
//! behind SPE's claim that a model keeps working beyond its training length.

use std::path::{Path, PathBuf};

use anyhow::{bail, Result};
use serde::{Deserialize, Serialize};
use tch::{Kind, Tensor};

use super::checkpoint::{self, LoadedModel};
use super::data;
use crate::tokenizer::dataset::Dataset;

#[derive(Debug, Clone)]
pub struct EvalOptions {
    pub model_dir: PathBuf,
    /// Dataset to evaluate on (default: the run's own, held-out pieces).
    pub data: Option<PathBuf>,
    /// Positions to score (default: twice the training length).
    pub max_len: Option<usize>,
    pub bin: usize,
    /// Only pieces at least this long (default: none).
    pub min_len: usize,
    pub max_pieces: usize,
    pub device: Option<String>,
    pub seed: u64,
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
}

/// NLL of each next token of `ids` (length n-1), with the model's frozen noise.
pub fn token_nll(m: &LoadedModel, ids: &[u32]) -> Vec<f64> {
    tch::no_grad(|| {
        let device = m.vs.device();
        let x: Vec<i64> = ids.iter().map(|&t| t as i64).collect();
        let t = Tensor::from_slice(&x).view([1, -1]).to_device(device);
        let n = x.len() as i64;
        let logits = m.model.forward_t(&t.narrow(1, 0, n - 1), 0, false);
        let logp = logits.to_kind(Kind::Float).log_softmax(-1, Kind::Float);
        let target = t.narrow(1, 1, n - 1).unsqueeze(-1);
        let nll = -logp
            .gather(-1, &target, false)
            .squeeze_dim(-1)
            .squeeze_dim(0);
        Vec::<f64>::try_from(nll.to_kind(Kind::Double).to_device(tch::Device::Cpu))
            .unwrap_or_default()
    })
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

pub fn evaluate(o: &EvalOptions) -> Result<EvalReport> {
    let device = checkpoint::parse_device(o.device.as_deref())?;
    super::set_threads(0);
    let mut m = checkpoint::load_model(&o.model_dir, device)?;
    m.model.freeze(o.seed);
    let train_len = m.config.train.seq_len as usize;
    let max_len = o.max_len.unwrap_or(2 * train_len);
    if o.bin == 0 || max_len == 0 {
        bail!("--bin and --max-len must be positive");
    }
    let own = PathBuf::from(&m.config.dataset);
    let data_path = o.data.clone().unwrap_or(own.clone());
    let ds = Dataset::open(&data_path)?;
    checkpoint::check_vocab(&m.config, &ds.vocab, &data_path)?;
    let same = data_path.canonicalize().ok() == own.canonicalize().ok();
    let pieces: Vec<data::PieceTokens> = if same {
        data::split(&ds, m.config.train.seed, m.config.train.val_fraction).val
    } else {
        (0..ds.pieces.len())
            .map(|i| data::PieceTokens::new(ds.pieces[i].source.clone(), ds.piece_tokens(i)))
            .collect()
    };
    let pieces: Vec<_> = pieces
        .into_iter()
        .filter(|p| p.ids.len() >= o.min_len.max(2))
        .take(o.max_pieces)
        .collect();
    if pieces.is_empty() {
        bail!(
            "{}: no held-out pieces of at least {} tokens",
            data_path.display(),
            o.min_len
        );
    }
    let mut sums = vec![0.0; max_len];
    let mut counts = vec![0u64; max_len];
    for p in &pieces {
        let n = p.ids.len().min(max_len + 1);
        for (i, v) in token_nll(&m, &p.ids[..n]).into_iter().enumerate() {
            sums[i] += v;
            counts[i] += 1;
        }
    }
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
        positional: m.config.model.positional.name().to_string(),
        train_len,
        max_len,
        pieces: pieces.len(),
        bins,
        mean_within: mean_over(&sums, &counts, 0, train_len).unwrap_or(f64::NAN),
        mean_beyond: mean_over(&sums, &counts, train_len, max_len),
        mean_1x_2x: mean_over(&sums, &counts, train_len, 2 * train_len),
        mean_2x_4x: mean_over(&sums, &counts, 2 * train_len, 4 * train_len),
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
