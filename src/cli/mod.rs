//! The `cadenza` command line.

mod generate;
mod learn;

use cadenza_core::commands as tokens;
pub use tokens::{LimitOpt, VocabOpt};

use anyhow::Result;
use clap::{Parser, Subcommand};

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
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Subcommand, Debug)]
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
}

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
    }
}
