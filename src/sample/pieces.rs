//! From a prompt file to the files of a generated piece: the steps that
//! `cadenza generate` and `cadenza serve` share (same prompt checks, same
//! rendering), so the two give the same results for the same settings.

use std::path::{Path, PathBuf};

use anyhow::{bail, Result};

use super::Sample;
use crate::midi::{self, ReadReport, Score};
use crate::render;
use crate::tokenizer::{self, Vocab};

/// The tokens of a prompt (without BOS), and the warnings of reading and
/// quantizing it. `name` names the prompt in messages. An error when the
/// prompt has no notes.
pub fn prompt_body(
    score: &Score,
    report: &ReadReport,
    vocab: &Vocab,
    name: &str,
) -> Result<(Vec<u32>, Vec<String>)> {
    let mut warnings = report.warnings();
    let (ids, q) = tokenizer::encode(score, vocab);
    warnings.extend(q.warnings());
    if ids.is_empty() {
        bail!("{name}: the prompt has no notes");
    }
    Ok((ids, warnings))
}

/// [`prompt_body`] of MIDI bytes, parsed with the reader's checks (a file
/// that is not MIDI gets the same message as on the command line).
pub fn prompt_from_bytes(
    bytes: &[u8],
    name: &str,
    vocab: &Vocab,
) -> Result<(Score, Vec<u32>, Vec<String>)> {
    let (score, report) = midi::parse_named(bytes, Path::new(name))?;
    let (ids, warnings) = prompt_body(&score, &report, vocab, name)?;
    Ok((score, ids, warnings))
}

/// The `--programs` value: `None` for any instrument, else the allowed
/// `Program` values. `prompt` means those of the prompt (`in_prompt`), or any
/// when the prompt has none.
pub fn parse_programs(arg: &str, in_prompt: &[u8]) -> Result<Option<Vec<u8>>> {
    match arg.trim() {
        "any" => return Ok(None),
        "prompt" => return Ok((!in_prompt.is_empty()).then(|| in_prompt.to_vec())),
        _ => {}
    }
    let mut out = Vec::new();
    for part in arg.split(',').map(str::trim) {
        let p = match part {
            "drums" => tokenizer::DRUMS,
            n => match n.parse::<u8>() {
                Ok(p) if p < 128 => p,
                _ => bail!(
                    "--programs: `{part}` is not a General MIDI program (0-127) or `drums`; \
                     use `prompt`, `any` or a comma-separated list such as 0,33,drums"
                ),
            },
        };
        out.push(p);
    }
    out.sort_unstable();
    out.dedup();
    Ok(Some(out))
}

/// Loudness of the rendered pieces: -16 dBFS RMS (a level near that of
/// released music; pieces whose peaks would clip end up quieter).
pub const TARGET_RMS: f32 = 0.158;

/// How generated pieces are rendered to audio.
pub fn render_options() -> render::RenderOptions {
    render::RenderOptions {
        gain: 2.0,
        target_rms: Some(TARGET_RMS),
        ..render::RenderOptions::default()
    }
}

/// The token strings of `tokens`, one a line.
pub fn token_text(tokens: &[u32], vocab: &Vocab) -> String {
    tokens
        .iter()
        .map(|&id| format!("{}\n", vocab.string(id).unwrap_or("?")))
        .collect()
}

/// Where one piece's files go: the MIDI file always, the others when named.
#[derive(Debug, Clone, Default)]
pub struct PieceFiles {
    pub midi: PathBuf,
    pub tokens: Option<PathBuf>,
    pub wav: Option<PathBuf>,
    pub png: Option<PathBuf>,
    /// How to draw the piano roll.
    pub piano_roll: render::PianoRollOptions,
}

/// What [`write_piece`] wrote.
#[derive(Debug, Clone)]
pub struct WrittenPiece {
    /// The decoded piece, at the output resolution.
    pub score: Score,
    /// Tokens the decoder skipped.
    pub skipped: usize,
    /// The audio written, when a WAV file and a SoundFont were given.
    pub audio: Option<render::RenderStats>,
}

/// Decodes a sample and writes its files: MIDI, then tokens, WAV (with
/// `soundfont`) and piano roll where `files` names them.
pub fn write_piece(
    sample: &Sample,
    vocab: &Vocab,
    files: &PieceFiles,
    soundfont: Option<&Path>,
) -> Result<WrittenPiece> {
    let (score, rep) = tokenizer::decode(&sample.tokens, vocab);
    let score = tokenizer::to_output_resolution(&score);
    midi::write_file(&score, &files.midi)?;
    if let Some(path) = &files.tokens {
        crate::util::write_atomic(path, token_text(&sample.tokens, vocab).as_bytes())?;
    }
    let audio = match (&files.wav, soundfont) {
        (Some(path), Some(sf)) => Some(render::render_wav(&score, sf, &render_options(), path)?),
        _ => None,
    };
    if let Some(path) = &files.png {
        render::piano_roll_png(&score, path, &files.piano_roll)?;
    }
    Ok(WrittenPiece {
        score,
        skipped: rep.skipped,
        audio,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn programs_flag() {
        assert_eq!(parse_programs("any", &[0]).unwrap(), None);
        assert_eq!(
            parse_programs("prompt", &[0, 40]).unwrap(),
            Some(vec![0, 40])
        );
        assert_eq!(parse_programs("prompt", &[]).unwrap(), None);
        assert_eq!(
            parse_programs("33, drums,0,33", &[]).unwrap(),
            Some(vec![0, 33, tokenizer::DRUMS])
        );
        for bad in ["128", "piano", "", "1,,2"] {
            let e = parse_programs(bad, &[]).unwrap_err().to_string();
            assert!(e.contains("--programs"), "{e}");
        }
    }
}
