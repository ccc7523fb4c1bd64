//! The `cadenza` command.
//!
//! The commands that need no model (encode, decode, inspect, tokenize, vocab)
//! run in this binary, which is built from `cadenza-core` and the token
//! commands only: it does not link libtorch, so it starts in about a
//! millisecond instead of a fifth of a second. Every other command, and
//! `--help` and `--version`, is handed to `cadenza-torch`, the full command
//! line, which is built and installed next to this binary, with the same
//! arguments (on Unix by `exec`: its exit status, signals and terminal are
//! those of the command the user typed). `completions` is handed over too:
//! its scripts cover the full command tree, which only `cadenza-torch` has.
//!
//! Both binaries log through the same subscriber
//! (`cadenza_core::commands::init_logging`): `-v` or `CADENZA_LOG`/`RUST_LOG`.

use std::ffi::OsString;
use std::path::PathBuf;
use std::process::Command as Process;

use cadenza_core::commands as tokens;
use clap::{Parser, Subcommand};

/// The model-free part of the command line.
#[derive(Parser, Debug)]
#[command(name = "cadenza", version)]
struct Cli {
    /// Print debug logs.
    #[arg(long, short, global = true)]
    verbose: bool,
    /// The command to run.
    #[command(subcommand)]
    command: Light,
}

/// The model-free commands; their documentation is that of `cadenza::cli`.
#[derive(Subcommand, Debug)]
enum Light {
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
}

/// The subcommands [`Light`] runs here.
const LIGHT: &[&str] = &["encode", "decode", "inspect", "tokenize", "vocab"];

/// The subcommand the arguments name: the first argument after the program
/// that is not the global `--verbose` flag (`None` when there is none, or
/// it is not valid UTF-8).
fn subcommand(args: &[OsString]) -> Option<&str> {
    let first = args
        .iter()
        .skip(1)
        .find(|a| !matches!(a.to_str(), Some("-v" | "--verbose")))?;
    first.to_str()
}

/// Whether this binary runs the command itself.
fn runs_here(args: &[OsString]) -> bool {
    subcommand(args).is_some_and(|c| LIGHT.contains(&c))
}

/// `cadenza-torch` next to this executable (or `CADENZA_TORCH_BIN`).
fn torch_binary() -> anyhow::Result<PathBuf> {
    if let Some(p) = std::env::var_os("CADENZA_TORCH_BIN") {
        return Ok(PathBuf::from(p));
    }
    let exe = std::env::current_exe()?;
    let name = format!("cadenza-torch{}", std::env::consts::EXE_SUFFIX);
    let path = exe.with_file_name(name);
    if !path.is_file() {
        anyhow::bail!(
            "{} is missing: the commands that run a model live in `cadenza-torch`, which is \
             built and installed next to `cadenza` (`cargo build --release` or `cargo install \
             --path .` makes both)",
            path.display()
        );
    }
    Ok(path)
}

/// Runs `cadenza-torch` with the same arguments; returns only on failure
/// (Unix) or with its exit status (elsewhere).
fn hand_over(args: &[OsString]) -> anyhow::Result<i32> {
    let bin = torch_binary()?;
    let mut cmd = Process::new(&bin);
    cmd.args(&args[1..]);
    #[cfg(unix)]
    {
        use std::os::unix::process::CommandExt;
        if let Some(arg0) = args.first() {
            cmd.arg0(arg0);
        }
        let err = cmd.exec();
        Err(anyhow::anyhow!("{}: {err}", bin.display()))
    }
    #[cfg(not(unix))]
    {
        let status = cmd
            .status()
            .map_err(|e| anyhow::anyhow!("{}: {e}", bin.display()))?;
        Ok(status.code().unwrap_or(1))
    }
}

fn run(cli: Cli) -> anyhow::Result<i32> {
    match cli.command {
        Light::Encode(a) => tokens::encode(a),
        Light::Decode(a) => tokens::decode(a),
        Light::Inspect(a) => tokens::inspect(a),
        Light::Tokenize(a) => tokens::tokenize(a),
        Light::Vocab(a) => tokens::vocab(a),
    }
}

fn main() {
    cadenza_core::util::quiet_on_broken_pipe();
    let args: Vec<OsString> = std::env::args_os().collect();
    let result = if runs_here(&args) {
        let cli = Cli::parse_from(&args);
        cadenza_core::commands::init_logging(cli.verbose).and_then(|()| run(cli))
    } else {
        hand_over(&args)
    };
    match result {
        Ok(code) => std::process::exit(code),
        Err(e) => {
            // Bounded and escaped: an error may quote input (crate::util::excerpt).
            let text = format!("{e:#}");
            eprintln!(
                "error: {}",
                cadenza_core::util::excerpt(&text, cadenza_core::util::MAX_ERROR_CHARS)
            );
            std::process::exit(1);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(a: &[&str]) -> Vec<OsString> {
        a.iter().map(OsString::from).collect()
    }

    #[test]
    fn model_free_commands_run_here_and_the_rest_is_handed_over() {
        for c in LIGHT {
            assert!(runs_here(&args(&["cadenza", c, "x.mid"])), "{c}");
            assert!(runs_here(&args(&["cadenza", "-v", c])), "{c}");
        }
        for a in [
            vec!["cadenza"],
            vec!["cadenza", "--help"],
            vec!["cadenza", "--version"],
            vec!["cadenza", "train", "--data", "d"],
            vec!["cadenza", "-v", "generate"],
            vec!["cadenza", "render", "x.mid"],
            vec!["cadenza", "help", "encode"],
            vec!["cadenza", "completions", "bash"],
        ] {
            assert!(!runs_here(&args(&a)), "{a:?}");
        }
    }

    #[test]
    fn the_light_commands_are_those_of_the_full_command_line() {
        use clap::CommandFactory;
        let light = Cli::command();
        let names: Vec<&str> = light.get_subcommands().map(|c| c.get_name()).collect();
        assert_eq!(names, LIGHT);
    }
}
