//! Commands around the model: train, eval, continue-eval, export-probe,
//! compare-eval.

use std::path::PathBuf;

use anyhow::{Context, Result};

use tracing::info;

use super::{device_name, DeviceArg, Positional, Preset};
use crate::model::Precision;
use crate::train::{self, eval};

/// What defines a run's configuration, shared by `train` and `export-probe`.
#[derive(clap::Args, Debug)]
pub struct RunSpec {
    /// A dataset made by `cadenza tokenize`, or a folder of MIDI files.
    #[arg(long)]
    pub data: Option<PathBuf>,
    /// Model size (default: the config file's, else small).
    #[arg(long, value_enum)]
    pub preset: Option<Preset>,
    /// Positional encoding (default: the config file's, else the preset's).
    #[arg(long, value_enum)]
    pub positional: Option<Positional>,
    /// TOML file with `preset`, `positional`, `[model]` and `[train]` tables.
    #[arg(long)]
    pub config: Option<PathBuf>,
    /// Optimizer steps of the whole schedule (default: the preset's).
    #[arg(long)]
    pub steps: Option<u64>,
    /// Tokens per training window (default: the preset's).
    #[arg(long)]
    pub seq_len: Option<i64>,
    /// Windows per optimizer step (default: the preset's).
    #[arg(long)]
    pub batch: Option<i64>,
    /// Peak learning rate, reached after the warm-up (default: the preset's).
    #[arg(long)]
    pub lr: Option<f64>,
    /// Seed of the split, the data order, the initial weights and every
    /// random draw of training (default: 0).
    #[arg(long)]
    pub seed: Option<u64>,
    /// Vocabulary JSON (default: the built-in REMI+ vocabulary).
    #[arg(long)]
    pub vocab: Option<PathBuf>,
}

/// `cadenza train`.
#[derive(clap::Args, Debug)]
pub struct TrainArgs {
    /// Run folder: config, vocabulary, checkpoints, metrics, plots.
    #[arg(short, long)]
    pub output: PathBuf,
    #[command(flatten)]
    pub spec: RunSpec,
    /// Device to train on: auto (CUDA when available), cpu, cuda or cuda:N.
    #[arg(long)]
    pub device: Option<DeviceArg>,
    /// CPU threads for libtorch (default: all cores).
    #[arg(long)]
    pub threads: Option<usize>,
    /// Continue the run in the output folder from its last checkpoint, on the
    /// schedule it started with (the same --steps; any other flag is refused).
    #[arg(long)]
    pub resume: bool,
    /// With --resume: accept a different --steps. The cosine decay is then
    /// stretched from the current step to the new end, so the learning rate
    /// jumps up. To split one schedule over sessions instead, start with
    /// --steps N --stop-after M and resume without --steps.
    #[arg(long, requires = "resume")]
    pub extend: bool,
    /// Stop after this step (the schedule still follows --steps).
    #[arg(long)]
    pub stop_after: Option<u64>,
    /// Precision of the dense products: auto (bf16 on CUDA and on CPUs with AMX or
    /// AVX512-BF16, f32 elsewhere), f32 or bf16; saved with the run, which resumes in it.
    #[arg(long, value_enum)]
    pub precision: Option<Precision>,
    /// Start from the weights of this trained model (a run or model folder with the
    /// same vocabulary and parameter shapes) instead of fresh ones; the optimizer and
    /// the schedule start anew. Recorded in the run's config.json.
    #[arg(long, conflicts_with = "resume")]
    pub init: Option<PathBuf>,
    /// Under `mpirun` (a build with `--features distributed`): seconds a rank waits for
    /// the others in a step before it ends the job (a rank hangs or died). Must exceed
    /// rank 0's longest validation plus checkpoint.
    #[arg(long, default_value_t = train::distributed::DEFAULT_RANK_TIMEOUT_S)]
    pub rank_timeout: u64,
}

/// `cadenza eval`.
#[derive(clap::Args, Debug)]
pub struct EvalArgs {
    /// Run folder (or model folder) to evaluate.
    #[arg(long)]
    pub model: PathBuf,
    /// A dataset, or MIDI files and folders (default: the run's own held-out
    /// pieces). Pieces are grouped by their first folder in the report.
    #[arg(long, num_args = 1..)]
    pub data: Vec<PathBuf>,
    /// Positions to score (default: twice the training length).
    #[arg(long)]
    pub max_len: Option<usize>,
    /// Bin width for the per-position curve.
    #[arg(long, default_value_t = 128)]
    pub bin: usize,
    /// Only pieces at least this many tokens long.
    #[arg(long, default_value_t = 0)]
    pub min_len: usize,
    /// At most this many pieces, spread evenly over the list (0 = all).
    #[arg(long, default_value_t = 0)]
    pub max_pieces: usize,
    /// Write the report as JSON here.
    #[arg(long)]
    pub json: Option<PathBuf>,
    /// Write the plot here (default: next to --json, or MODEL/eval.png).
    #[arg(long)]
    pub png: Option<PathBuf>,
    /// Device to run the model on: auto (CUDA when available), cpu, cuda or cuda:N.
    #[arg(long)]
    pub device: Option<DeviceArg>,
    /// Seed of the frozen SPE noise and FAVOR+ features.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// CPU threads for libtorch (default: all cores).
    #[arg(long, default_value_t = 0)]
    pub threads: usize,
    /// Precision of the dense products: auto (bf16 on CUDA and on CPUs with AMX or
    /// AVX512-BF16, f32 elsewhere), f32 or bf16.
    #[arg(long, value_enum, default_value_t = Precision::Auto)]
    pub precision: Precision,
    /// Context gain: also score positions from --context-from on with only the last C
    /// tokens as context (a fresh window at its absolute offset), next to the whole past;
    /// one or more cuts, comma-separated (each at least 1 and below --context-from).
    #[arg(long, value_delimiter = ',', num_args = 1..)]
    pub context_cut: Vec<usize>,
    /// First position the context gain scores (default: twice the largest cut, at
    /// least 1024); below --max-len.
    #[arg(long, requires = "context_cut")]
    pub context_from: Option<usize>,
    /// Score every S-th position from --context-from on (each costs a forward of C
    /// tokens per cut).
    #[arg(long, default_value_t = eval::DEFAULT_CONTEXT_STRIDE, requires = "context_cut")]
    pub context_stride: usize,
    /// Score B scored positions per cut window (one forward of C + (B-1)*S tokens for B
    /// positions): the j-th of each block sees the last C + j*S tokens instead of exactly
    /// C. With --context-stride 1 and a block of 8, every position is scored in about 1/8
    /// of the exact time.
    #[arg(long, default_value_t = 1, requires = "context_cut")]
    pub context_block: usize,
    /// Zero the output of these heads in every layer before scoring: favor (the FAVOR+
    /// heads) or local (the local softmax heads).
    #[arg(long, value_enum)]
    pub ablate: Option<eval::Ablation>,
}

/// `cadenza continue-eval`.
#[derive(clap::Args, Debug)]
pub struct ContinueEvalArgs {
    /// Run folder (or model folder) to evaluate.
    #[arg(long)]
    pub model: PathBuf,
    /// A dataset, or MIDI files and folders (default: the run's own held-out
    /// pieces).
    #[arg(long, num_args = 1..)]
    pub data: Vec<PathBuf>,
    /// Bars of each piece given as the prompt.
    #[arg(long, default_value_t = 4)]
    pub prompt_bars: usize,
    /// Bars continued, by the model and by the piece itself.
    #[arg(long, default_value_t = 8)]
    pub bars: usize,
    /// At most this many pieces, spread evenly over the list.
    #[arg(long, default_value_t = 100)]
    pub pieces: usize,
    /// Sampling temperature (1 = the model's distribution).
    #[arg(long, default_value_t = 1.0)]
    pub temperature: f64,
    /// Nucleus sampling threshold (1 = off).
    #[arg(long, default_value_t = 0.95)]
    pub top_p: f64,
    /// Keep only the tokens at least this fraction as likely as the likeliest one
    /// (min-p sampling; 0 = off).
    #[arg(long, default_value_t = 0.0)]
    pub min_p: f64,
    /// Seed of the sampling and of the frozen SPE noise and FAVOR+ features.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Sample without the repetition guard (`generate`'s default guard otherwise), to
    /// measure what it costs the returns that real music makes.
    #[arg(long)]
    pub no_repetition_guard: bool,
    /// Write the report as JSON here.
    #[arg(long)]
    pub json: Option<PathBuf>,
    /// Device to run the model on: auto (CUDA when available), cpu, cuda or cuda:N.
    #[arg(long)]
    pub device: Option<DeviceArg>,
    /// CPU threads for libtorch (default: all cores).
    #[arg(long, default_value_t = 0)]
    pub threads: usize,
    /// Precision of the dense products: auto (bf16 on CUDA and on CPUs with AMX or
    /// AVX512-BF16, f32 elsewhere), f32 or bf16.
    #[arg(long, value_enum, default_value_t = Precision::Auto)]
    pub precision: Precision,
}

/// Continues the first bars of held-out pieces and compares with the real
/// continuations (key, density, range, repeated notes).
pub fn continue_eval(a: ContinueEvalArgs) -> Result<i32> {
    use crate::eval::continuation;
    train::config::check_threads(a.threads, "--threads")?;
    if let Some(j) = &a.json {
        model_plan(&a.model, &a.data).write("--json", j).check()?;
    }
    let device = train::checkpoint::parse_device(device_name(a.device).as_deref())?;
    train::set_threads(a.threads);
    let mut m = train::checkpoint::load_model(&a.model, device)?;
    m.model.freeze(a.seed);
    info!("precision: {}", m.model.set_precision(a.precision));
    let (what, pieces) = eval::eval_pieces(&a.data, &m)?;
    let pieces: Vec<Vec<u32>> = pieces
        .into_iter()
        .filter_map(|p| continuation::split_piece(&p.ids, a.prompt_bars, a.bars).map(|_| p.ids))
        .collect();
    let pieces = eval::spread(pieces, a.pieces);
    if a.prompt_bars == 0 || a.bars == 0 {
        anyhow::bail!("--prompt-bars and --bars must be at least 1");
    }
    let base = crate::sample::SampleConfig {
        temperature: a.temperature,
        top_p: a.top_p,
        min_p: a.min_p,
        seed: a.seed,
        guard: if a.no_repetition_guard {
            crate::sample::GuardConfig::off()
        } else {
            crate::sample::GuardConfig::default()
        },
        ..Default::default()
    };
    let r = continuation::evaluate(
        &m.model,
        &m.vocab,
        &pieces,
        a.prompt_bars,
        a.bars,
        &base,
        |i, n| {
            if i % 10 == 0 || i == n {
                info!("{i}/{n} pieces");
            }
        },
    )
    .with_context(|| format!("{what}: continuation evaluation"))?;
    print!("{}", continuation::markdown(&r));
    if let Some(j) = &a.json {
        crate::train::checkpoint::write_json(j, &r)?;
        println!("wrote {}", j.display());
    }
    Ok(0)
}

/// `cadenza export-probe`: the options of a run, without training it.
#[derive(clap::Args, Debug)]
pub struct ExportArgs {
    #[command(flatten)]
    pub spec: RunSpec,
    /// Run folder: with --resume, the run whose saved configuration is
    /// exported (otherwise unused).
    #[arg(short, long)]
    pub output: Option<PathBuf>,
    /// Export the saved configuration of the run in --output.
    #[arg(long, requires = "output")]
    pub resume: bool,
    /// Folder to write the probe into (must not exist).
    #[arg(long)]
    pub probe: PathBuf,
}

/// Writes a run's training batches and validation windows for reference models.
pub fn export(a: ExportArgs) -> Result<i32> {
    let probe = a.probe.clone();
    let opts = train::TrainOptions {
        run_dir: a.output.unwrap_or_default(),
        resume: a.resume,
        ..spec_options(a.spec)
    };
    train::export_probe(&opts, &probe)?;
    println!("wrote {}", probe.display());
    Ok(0)
}

/// The training options a [`RunSpec`] gives (the rest at their defaults).
fn spec_options(s: RunSpec) -> train::TrainOptions {
    train::TrainOptions {
        data: s.data,
        preset: s.preset.as_ref().map(super::choice_name),
        positional: s.positional.as_ref().map(super::choice_name),
        config_file: s.config,
        steps: s.steps,
        seq_len: s.seq_len,
        batch: s.batch,
        lr: s.lr,
        seed: s.seed,
        vocab: s.vocab,
        ..Default::default()
    }
}

fn options(a: TrainArgs, dist: &train::distributed::Dist) -> train::TrainOptions {
    train::TrainOptions {
        run_dir: a.output.clone(),
        device: device_name(a.device),
        resume: a.resume,
        extend: a.extend,
        stop_after: a.stop_after,
        threads: a.threads,
        precision: a.precision,
        init: a.init,
        progress: true,
        dist: dist.clone(),
        ..spec_options(a.spec)
    }
}

/// The output plan of a command that reads a model (its folder and its run
/// folder, whole) and `--data` (files or folders).
fn model_plan(model: &std::path::Path, data: &[PathBuf]) -> crate::output::Plan {
    let mut plan = crate::output::Plan::new();
    plan.read("--model", model)
        .read("--model", train::checkpoint::run_folder(model));
    for d in data {
        plan.read("--data", d);
    }
    plan
}

/// Trains (or resumes) a run.
pub fn train(a: TrainArgs) -> Result<i32> {
    let output = a.output.clone();
    {
        // The run's files are train's own, but never the files it was given.
        let mut plan = crate::output::Plan::new();
        for (flag, p) in [
            ("--config", &a.spec.config),
            ("--vocab", &a.spec.vocab),
            ("--data", &a.spec.data),
        ] {
            if let Some(p) = p {
                plan.read(flag, p);
            }
        }
        for f in [
            train::checkpoint::CONFIG_FILE,
            train::checkpoint::VOCAB_FILE,
            train::checkpoint::GENERATION_CONFIG_FILE,
            train::METRICS_FILE,
            train::PLOT_FILE,
        ] {
            plan.owned("-o", &output.join(f));
        }
        plan.check()?;
    }
    // Joins the job when `mpirun` started this process (finalizes MPI on drop).
    let session = train::distributed::Session::start(a.rank_timeout)?;
    let dist = session.dist().clone();
    let opts = options(a, &dist);
    let s = train::train(&opts).map_err(|e| session.fail(e))?;
    if !dist.is_root() {
        return Ok(if s.interrupted { 130 } else { 0 });
    }
    info!(
        "step {}: train loss {:.4}, validation loss {}, {:.0} tokens/s{}",
        s.steps_done,
        s.last_train_loss,
        s.last_val_loss
            .map(|v| format!("{v:.4}"))
            .unwrap_or_else(|| "-".into()),
        s.tokens_per_s,
        if s.interrupted { " (interrupted)" } else { "" }
    );
    println!("run folder: {}", output.display());
    Ok(if s.interrupted { 130 } else { 0 })
}

/// Scores a model on held-out pieces: tables on stdout, plot and JSON on request.
pub fn eval(a: EvalArgs) -> Result<i32> {
    train::config::check_threads(a.threads, "--threads")?;
    let png = a.png.clone().unwrap_or_else(|| match &a.json {
        Some(j) => j.with_extension("png"),
        None => a.model.join("eval.png"),
    });
    {
        let mut plan = model_plan(&a.model, &a.data);
        if let Some(j) = &a.json {
            plan.write("--json", j);
        }
        match (&a.png, &a.json) {
            (Some(_), _) => plan.write("--png", &png),
            (None, Some(_)) => plan.write("the plot beside --json", &png),
            // The default plot is eval's own file in the model folder.
            (None, None) => plan.owned("the plot in --model", &png),
        };
        plan.check()?;
    }
    let probes = eval::Probes {
        context_cut: a.context_cut,
        context_from: a.context_from,
        context_stride: a.context_stride,
        context_block: a.context_block,
        ablate: a.ablate,
    };
    if !probes.context_cut.is_empty() {
        // refused before the model loads
        eval::check_context(
            &probes.context_cut,
            probes.context_from,
            probes.context_stride,
            probes.context_block,
        )?;
    }
    let r = eval::evaluate_probed(
        &eval::EvalOptions {
            model_dir: a.model.clone(),
            data: a.data,
            max_len: a.max_len,
            bin: a.bin,
            min_len: a.min_len,
            max_pieces: a.max_pieces,
            device: device_name(a.device),
            seed: a.seed,
            threads: a.threads,
            precision: a.precision,
        },
        &probes,
    )?;
    println!(
        "{} ({}), {} pieces, training length {}",
        r.model, r.positional, r.pieces, r.train_len
    );
    if let Some(ab) = r.ablate {
        println!(
            "ablated: the {} heads' output zeroed in every layer",
            ab.name()
        );
    }
    println!("| positions | mean NLL | tokens |\n| --- | --- | --- |");
    for b in &r.bins {
        println!(
            "| {}..{} | {:.4} | {} |",
            b.start, b.end, b.mean_nll, b.tokens
        );
    }
    println!("mean NLL within the training length: {:.4}", r.mean_within);
    println!(
        "\nall pieces: loss {:.4} over {} tokens",
        r.metrics.all.loss, r.metrics.all.tokens
    );
    print!("{}", crate::eval::type_table(&r.metrics.all));
    for (group, m) in &r.metrics.by_source {
        println!("\n{group}: loss {:.4} over {} tokens", m.loss, m.tokens);
        print!("{}", crate::eval::type_table(m));
    }
    if let Some(v) = r.mean_beyond {
        println!("mean NLL beyond it:                  {v:.4}");
    }
    if let Some(g) = &r.context_gain {
        println!(
            "\ncontext gain: positions {}, {}, ... over {} pieces ({} positions){}",
            g.from,
            g.from + g.stride,
            g.pieces,
            g.positions,
            if g.block > 1 {
                format!(
                    "; blocks of {}: cut C sees the last C to C + {} tokens",
                    g.block,
                    (g.block - 1).saturating_mul(g.stride)
                )
            } else {
                String::new()
            }
        );
        print!("{}", eval::context_table(g));
    }
    if let Some(ret) = &r.returns {
        println!("\nreturn probe: bars the past predicts, and bars it cannot");
        print!("{}", eval::returns_table(ret));
    }
    if let Some(j) = &a.json {
        crate::train::checkpoint::write_json(j, &r)?;
        println!("wrote {}", j.display());
    }
    eval::plot(&[(r.positional.clone(), &r)], &png)?;
    println!("wrote {}", png.display());
    Ok(0)
}

/// `cadenza compare-eval`.
#[derive(clap::Args, Debug)]
pub struct CompareArgs {
    /// Reports written by `cadenza eval --json`.
    #[arg(required = true)]
    pub reports: Vec<PathBuf>,
    /// Plot of all curves.
    #[arg(long)]
    pub png: PathBuf,
    /// Markdown table of the bands (also printed).
    #[arg(long)]
    pub markdown: Option<PathBuf>,
}

/// Plots and tabulates `eval --json` reports together.
pub fn compare(a: CompareArgs) -> Result<i32> {
    {
        let inputs: Vec<(&str, &std::path::Path)> =
            a.reports.iter().map(|p| ("report", p.as_path())).collect();
        let mut outputs: Vec<(&str, &std::path::Path)> = vec![("--png", &a.png)];
        if let Some(m) = &a.markdown {
            outputs.push(("--markdown", m));
        }
        crate::util::check_outputs(&inputs, &outputs)?;
    }
    let reports: Vec<eval::EvalReport> = a
        .reports
        .iter()
        .map(|p| crate::train::checkpoint::read_json(p))
        .collect::<Result<_>>()?;
    let named: Vec<(String, &eval::EvalReport)> =
        reports.iter().map(|r| (r.positional.clone(), r)).collect();
    eval::plot(&named, &a.png)?;
    let table = eval::markdown_table(&reports);
    print!("{table}");
    if let Some(m) = &a.markdown {
        crate::util::write_atomic(m, table.as_bytes())?;
    }
    println!("wrote {}", a.png.display());
    Ok(0)
}
