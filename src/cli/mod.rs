//! The `cadenza` command line.
//!
//! Every command has one `clap::Args` struct of its own; options that
//! several commands share (`--vocab`, the per-file limits) are flattened
//! groups. Every choice is a fixed list that clap checks, shows in `--help`
//! and offers to shell completion ([`Preset`], [`Positional`], [`DeviceArg`],
//! the shells of `completions`), spelled as the configuration files spell it.
//!
//! Output and logs: what a command produces (tokens, tables, the files it
//! wrote) goes to stdout; warnings, progress and details go to stderr through
//! `tracing` (`cadenza_core::commands::init_logging`).

mod generate;
mod learn;

use std::ffi::OsStr;
use std::fmt;

use cadenza_core::commands as tokens;
pub use generate::{GenerateArgs, PieceRecord, RenderArgs, StatsArgs, RECORD_EXTENSION};
pub use learn::{CompareArgs, ContinueEvalArgs, EvalArgs, ExportArgs, TrainArgs};
pub use tokens::{LimitOpt, VocabOpt};

use anyhow::Result;
use clap::builder::{PossibleValue, TypedValueParser, ValueParserFactory};
use clap::{Parser, Subcommand, ValueEnum};

/// The whole command line, as `cadenza-torch` parses it.
#[derive(Parser, Debug)]
#[command(
    name = "cadenza",
    version,
    about = "Symbolic music with a linear-attention Performer and stochastic positional encoding"
)]
pub struct Cli {
    /// Print debug logs.
    #[arg(long, short, global = true)]
    pub verbose: bool,
    /// The command to run.
    #[command(subcommand)]
    pub command: Command,
}

/// The commands of [`Cli`]. Parsed once per process, so the size of its
/// largest variant (`generate`'s many flags) costs nothing worth a box.
#[derive(Subcommand, Debug)]
#[allow(clippy::large_enum_variant)]
pub enum Command {
    /// Print the REMI tokens of a MIDI file, one per line.
    Encode(tokens::EncodeArgs),
    /// Turn a token file (one token per line or whitespace-separated) into MIDI.
    Decode(tokens::DecodeArgs),
    /// Summarize a MIDI file: tracks, notes, tempos, time signatures, tokens.
    Inspect(tokens::InspectArgs),
    /// Tokenize MIDI files and folders into a training dataset.
    Tokenize(tokens::TokenizeArgs),
    /// Write the tokenizer's vocabulary as JSON.
    Vocab(tokens::VocabArgs),
    /// Train a model (or resume a run) on a dataset or a MIDI folder.
    Train(learn::TrainArgs),
    /// Per-position NLL, per-token-type metrics and pitch context of a trained
    /// model on held-out pieces.
    Eval(learn::EvalArgs),
    /// Continue the first bars of held-out pieces; compare key, density,
    /// range and repeated notes with the real continuations.
    ContinueEval(learn::ContinueEvalArgs),
    /// Write the batches and validation windows of a run's options (for the
    /// reference models of scripts/reference/).
    ExportProbe(learn::ExportArgs),
    /// Plot and tabulate several `eval --json` reports together.
    CompareEval(learn::CompareArgs),
    /// Continue a prompt (or start from nothing) with a trained model.
    Generate(generate::GenerateArgs),
    /// Compare music statistics of generated pieces with real ones.
    Stats(generate::StatsArgs),
    /// Render a MIDI file to WAV with a General MIDI SoundFont.
    Render(generate::RenderArgs),
    /// A local web studio: pick or upload a prompt, generate, listen,
    /// compare and download, in the browser.
    Serve(crate::serve::ServeArgs),
    /// Print a shell completion script for every command and flag
    /// (e.g. `cadenza completions bash > ~/.local/share/bash-completion/completions/cadenza`).
    Completions(CompletionsArgs),
}

/// `cadenza completions`: a completion script on stdout.
#[derive(clap::Args, Debug)]
pub struct CompletionsArgs {
    /// The shell to complete for.
    #[arg(value_enum)]
    pub shell: clap_complete::Shell,
}

/// Writes the completion script of the whole command line for `shell`.
pub fn completions(shell: clap_complete::Shell, out: &mut dyn std::io::Write) {
    use clap::CommandFactory;
    let mut cmd = Cli::command();
    clap_complete::generate(shell, &mut cmd, "cadenza", out);
}

/// Model sizes of `train --preset` (the names of `model::config::PRESETS`).
#[derive(ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum Preset {
    /// d_model 64, 2 layers: for tests and quick checks.
    Tiny,
    /// d_model 256, 4 layers: the shipped model's size.
    Small,
    /// The largest preset.
    Base,
}

/// Positional encodings of `train --positional` (the names of
/// `model::config::POSITIONALS`).
#[derive(ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum Positional {
    /// Stochastic positional encoding with sines (SineSPE).
    SpeSine,
    /// Stochastic positional encoding with convolutions (ConvSPE).
    SpeConv,
    /// Learned absolute position embeddings.
    Ape,
    /// No positional encoding.
    #[value(name = "none")]
    Off,
}

/// The name a [`ValueEnum`] value is spelled with on the command line and in
/// the configuration files.
pub fn choice_name<T: ValueEnum>(v: &T) -> String {
    v.to_possible_value()
        .expect("every value is visible")
        .get_name()
        .to_string()
}

/// `--device`: `auto` (CUDA when available), `cpu`, `cuda` (the first GPU)
/// or `cuda:N`. Its [`fmt::Display`] is the spelling
/// `train::checkpoint::parse_device` takes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DeviceArg {
    /// CUDA when libtorch sees a GPU, else the CPU.
    Auto,
    /// The CPU.
    Cpu,
    /// The first CUDA device.
    Cuda,
    /// CUDA device N.
    CudaN(usize),
}

impl DeviceArg {
    /// The fixed spellings, with their help (`cuda:N` is offered as `cuda:0`).
    fn possible_values() -> [PossibleValue; 4] {
        [
            PossibleValue::new("auto").help("CUDA when available, else the CPU"),
            PossibleValue::new("cpu").help("The CPU"),
            PossibleValue::new("cuda").help("The first CUDA device"),
            PossibleValue::new("cuda:0").help("CUDA device N (cuda:0, cuda:1, ...)"),
        ]
    }

    /// Parses `auto`, `cpu`, `cuda` or `cuda:N`.
    pub fn parse(s: &str) -> std::result::Result<DeviceArg, String> {
        match s {
            "auto" => Ok(DeviceArg::Auto),
            "cpu" => Ok(DeviceArg::Cpu),
            "cuda" => Ok(DeviceArg::Cuda),
            other => other
                .strip_prefix("cuda:")
                .and_then(|n| n.parse::<usize>().ok())
                .map(DeviceArg::CudaN)
                .ok_or_else(|| format!("{other:?}: expected auto, cpu, cuda or cuda:N")),
        }
    }
}

impl fmt::Display for DeviceArg {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            DeviceArg::Auto => f.write_str("auto"),
            DeviceArg::Cpu => f.write_str("cpu"),
            DeviceArg::Cuda => f.write_str("cuda"),
            DeviceArg::CudaN(n) => write!(f, "cuda:{n}"),
        }
    }
}

/// The clap parser of [`DeviceArg`]: checks the spelling and offers the
/// fixed values to `--help` and shell completion.
#[derive(Clone, Debug)]
pub struct DeviceParser;

impl TypedValueParser for DeviceParser {
    type Value = DeviceArg;

    fn parse_ref(
        &self,
        cmd: &clap::Command,
        arg: Option<&clap::Arg>,
        value: &OsStr,
    ) -> std::result::Result<DeviceArg, clap::Error> {
        let flag = arg.map_or("--device".to_string(), |a| a.to_string());
        let text = value.to_str().ok_or_else(|| {
            clap::Error::raw(
                clap::error::ErrorKind::InvalidUtf8,
                format!("invalid value for '{flag}': not UTF-8\n"),
            )
            .with_cmd(cmd)
        })?;
        DeviceArg::parse(text).map_err(|e| {
            clap::Error::raw(
                clap::error::ErrorKind::InvalidValue,
                format!("invalid value for '{flag}': {e}\n"),
            )
            .with_cmd(cmd)
        })
    }

    fn possible_values(&self) -> Option<Box<dyn Iterator<Item = PossibleValue> + '_>> {
        Some(Box::new(DeviceArg::possible_values().into_iter()))
    }
}

impl ValueParserFactory for DeviceArg {
    type Parser = DeviceParser;
    fn value_parser() -> DeviceParser {
        DeviceParser
    }
}

/// The device flag as the training and evaluation options take it.
fn device_name(d: Option<DeviceArg>) -> Option<String> {
    d.map(|d| d.to_string())
}

/// Runs the command; returns the process's exit status.
pub fn run(cli: Cli) -> Result<i32> {
    match cli.command {
        Command::Encode(a) => tokens::encode(a),
        Command::Decode(a) => tokens::decode(a),
        Command::Inspect(a) => tokens::inspect(a),
        Command::Tokenize(a) => tokens::tokenize(a),
        Command::Vocab(a) => tokens::vocab(a),
        Command::Train(a) => learn::train(a),
        Command::Eval(a) => learn::eval(a),
        Command::ContinueEval(a) => learn::continue_eval(a),
        Command::ExportProbe(a) => learn::export(a),
        Command::CompareEval(a) => learn::compare(a),
        Command::Generate(a) => generate::generate(a),
        Command::Stats(a) => generate::stats(a),
        Command::Render(a) => generate::render_cmd(a),
        Command::Serve(a) => crate::serve::serve(a),
        Command::Completions(a) => {
            let mut out = std::io::stdout().lock();
            completions(a.shell, &mut out);
            std::io::Write::flush(&mut out)?;
            Ok(0)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;

    #[test]
    fn choices_are_spelled_as_the_model_configuration_spells_them() {
        let presets: Vec<String> = Preset::value_variants().iter().map(choice_name).collect();
        assert_eq!(presets, crate::model::config::PRESETS);
        let positionals: Vec<String> = Positional::value_variants()
            .iter()
            .map(choice_name)
            .collect();
        assert_eq!(positionals, crate::model::config::POSITIONALS);
    }

    #[test]
    fn devices_keep_their_spellings_and_bad_ones_are_refused() {
        for s in ["auto", "cpu", "cuda", "cuda:0", "cuda:3"] {
            assert_eq!(DeviceArg::parse(s).unwrap().to_string(), s);
        }
        for s in ["gpu", "cuda:", "cuda:x", "CPU", ""] {
            let e = DeviceArg::parse(s).unwrap_err();
            assert!(e.contains("expected auto, cpu, cuda or cuda:N"), "{s}: {e}");
        }
        let e = Cli::try_parse_from(["cadenza", "eval", "--model", "m", "--device", "gpu"])
            .unwrap_err()
            .to_string();
        assert!(e.contains("--device") && e.contains("gpu"), "{e}");
        let e = Cli::try_parse_from(["cadenza", "train", "-o", "r", "--positional", "rope"])
            .unwrap_err()
            .to_string();
        assert!(e.contains("spe-sine") && e.contains("none"), "{e}");
    }

    /// Every flag and positional argument of every command says what it is.
    #[test]
    fn every_argument_has_a_help_line() {
        fn walk(cmd: &clap::Command, path: &str, missing: &mut Vec<String>) {
            for a in cmd.get_arguments() {
                let id = a.get_id().as_str();
                if id == "help" || id == "version" {
                    continue;
                }
                if a.get_help().is_none_or(|h| h.to_string().trim().is_empty()) {
                    missing.push(format!("{path} {id}"));
                }
            }
            for sub in cmd.get_subcommands() {
                if sub.get_about().is_none() {
                    missing.push(format!("{path} {} (no about)", sub.get_name()));
                }
                walk(sub, &format!("{path} {}", sub.get_name()), missing);
            }
        }
        let mut missing = Vec::new();
        walk(&Cli::command(), "cadenza", &mut missing);
        assert!(missing.is_empty(), "without help: {missing:?}");
        Cli::command().debug_assert();
    }

    #[test]
    fn completions_cover_every_command_and_choice() {
        for shell in clap_complete::Shell::value_variants() {
            let mut out = Vec::new();
            completions(*shell, &mut out);
            let text = String::from_utf8(out).unwrap();
            for word in ["generate", "continue-eval", "completions", "top-p"] {
                assert!(text.contains(word), "{shell}: no {word}");
            }
        }
        let mut out = Vec::new();
        completions(clap_complete::Shell::Bash, &mut out);
        let text = String::from_utf8(out).unwrap();
        for word in ["spe-sine", "spe-conv", "cuda", "tiny", "zsh"] {
            assert!(text.contains(word), "bash: no {word}");
        }
    }
}
