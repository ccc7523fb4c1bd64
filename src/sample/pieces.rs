//! From a prompt file to the files of a generated piece: the steps that
//! `cadenza generate` and `cadenza serve` share (same prompt checks, same
//! rendering), so the two give the same results for the same settings.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use anyhow::{bail, Result};

use super::Sample;
use crate::midi::{self, Note, ReadReport, Score, TempoChange, TimeSignature};
use crate::render;
use crate::tokenizer::{self, Vocab, BAR_ID};

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

/// The `--programs` value that lets the model bring in any instrument.
const ANY: &str = "any";

/// Whether the later tunes of a set keep the first tune's instruments
/// ([`crate::sample::SampleConfig::keep_first_instruments`]) under this
/// `--programs` value: every value but `any` (`prompt`, the default, extends to
/// a set as the first tune's instruments; a list fixes them anyway).
pub fn keeps_first_instruments(arg: &str) -> bool {
    arg.trim() != ANY
}

/// The `--programs` value: `None` for any instrument, else the allowed
/// `Program` values. `prompt` means those of the prompt (`in_prompt`), or any
/// when the prompt has none.
pub fn parse_programs(arg: &str, in_prompt: &[u8]) -> Result<Option<Vec<u8>>> {
    match arg.trim() {
        ANY => return Ok(None),
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
    /// The piece as written (with a prompt file, its own events kept).
    pub score: Score,
    /// The instruments of the notes the model wrote after the prompt
    /// (programs, [`tokenizer::DRUMS`] for drums), sorted.
    pub played: Vec<u8>,
    /// Tokens the decoder skipped.
    pub skipped: usize,
    /// The audio written, when a WAV file and a SoundFont were given.
    pub audio: Option<render::RenderStats>,
}

/// The piece as written when it continues a prompt file: the file's own
/// events over the prompt's span (notes with their exact times and
/// velocities, tempos, time and key signatures, the title and the
/// instruments' names), then what the model added, decoded from its tokens.
/// `tokens` are a sample's (BOS, the prompt, the continuation), the first
/// `prompt_len` of them BOS and the prompt.
///
/// The span is the prompt's bars on the tokenizer's grid: an event of the
/// file is kept when its tick, rounded to the grid as the tokenizer rounds
/// it, lies before the first bar the prompt's tokens do not hold (with
/// `--prompt-bars`, the bars left out are left out here too). The model's
/// notes are those of the decoded piece that the decoded prompt lacks; its
/// tempo and time-signature events are kept where they change what is in
/// effect, so a model restating the prompt's binned tempo (118.6 BPM for
/// the file's 120) leaves the file's tempo as it was. The resolution is the
/// least common multiple of the file's and the grid's when MIDI can hold it
/// (both parts then land on it exactly), else the decoder's.
pub fn keep_prompt(file: &Score, tokens: &[u32], prompt_len: usize, vocab: &Vocab) -> Score {
    splice(file, &Decoded::of(tokens, prompt_len, vocab), vocab)
}

/// A sample decoded once for everything [`write_piece`] derives from it.
struct Decoded {
    /// The whole piece, at the output resolution.
    all: Score,
    /// BOS and the prompt alone, at the same resolution.
    pre: Score,
    /// `Bar` tokens of the prompt.
    prompt_bars: usize,
    /// Tokens the decoder skipped in the whole piece.
    skipped: usize,
}

impl Decoded {
    fn of(tokens: &[u32], prompt_len: usize, vocab: &Vocab) -> Decoded {
        let head = &tokens[..prompt_len.min(tokens.len())];
        let (all, rep) = tokenizer::decode(tokens, vocab);
        Decoded {
            all: tokenizer::to_output_resolution(&all),
            pre: tokenizer::to_output_resolution(&tokenizer::decode(head, vocab).0),
            prompt_bars: head.iter().filter(|&&t| t == BAR_ID).count(),
            skipped: rep.skipped,
        }
    }

    /// The notes the model added after the prompt.
    fn added_notes(&self) -> Vec<Note> {
        added(&self.all.notes, &self.pre.notes)
    }
}

/// [`keep_prompt`] of a decoded sample.
fn splice(file: &Score, d: &Decoded, vocab: &Vocab) -> Score {
    let grid = vocab.config().positions_per_quarter.max(1) as u64;
    let src = file.ticks_per_quarter.max(1) as u64;
    let dec = d.all.ticks_per_quarter.max(1) as u64;
    let tpq = lcm(src, grid).filter(|&l| l <= 0x7fff).unwrap_or(dec);
    // The first grid step after the prompt (decoded ticks lie on the grid).
    let cut = bar_start(&d.pre, d.prompt_bars) * grid / dec;
    let in_prompt = |tick: u64| rescale_tick(tick, src, grid) < cut;
    let from_file = |tick: u64| rescale_tick(tick, src, tpq);
    let from_model = |tick: u64| rescale_tick(tick, dec, tpq);

    let mut out = Score::new(tpq as u32);
    let notes = |ns: &mut dyn Iterator<Item = Note>, conv: &dyn Fn(u64) -> u64| {
        ns.map(|n| {
            let start = conv(n.start);
            Note {
                start,
                duration: conv(n.end()) - start,
                ..n
            }
        })
        .collect::<Vec<_>>()
    };
    out.notes = notes(
        &mut file.notes.iter().copied().filter(|n| in_prompt(n.start)),
        &from_file,
    );
    out.notes
        .extend(notes(&mut d.added_notes().into_iter(), &from_model));

    let tempo = |t: &TempoChange| (t.tick, t.us_per_quarter);
    out.tempos = file
        .tempos
        .iter()
        .filter(|t| in_prompt(t.tick))
        .map(|t| TempoChange {
            tick: from_file(t.tick),
            ..*t
        })
        .collect();
    let model_tempos = changes(
        &d.all.tempos.iter().map(tempo).collect::<Vec<_>>(),
        &d.pre.tempos.iter().map(tempo).collect::<Vec<_>>(),
    );
    out.tempos
        .extend(model_tempos.into_iter().map(|(tick, us)| TempoChange {
            tick: from_model(tick),
            us_per_quarter: us,
        }));

    let sig = |t: &TimeSignature| (t.tick, (t.numerator, t.denominator));
    out.time_signatures = file
        .time_signatures
        .iter()
        .filter(|t| in_prompt(t.tick))
        .map(|t| TimeSignature {
            tick: from_file(t.tick),
            ..*t
        })
        .collect();
    let model_sigs = changes(
        &d.all.time_signatures.iter().map(sig).collect::<Vec<_>>(),
        &d.pre.time_signatures.iter().map(sig).collect::<Vec<_>>(),
    );
    out.time_signatures
        .extend(model_sigs.into_iter().map(|(tick, (n, d))| TimeSignature {
            tick: from_model(tick),
            numerator: n,
            denominator: d,
        }));

    out.key_signatures = file
        .key_signatures
        .iter()
        .filter(|k| in_prompt(k.tick))
        .map(|k| midi::KeySignature {
            tick: from_file(k.tick),
            ..*k
        })
        .collect();
    out.title = file.title.clone();
    out.instrument_names = file.instrument_names.clone();
    out.sort();
    out
}

/// `tick` at `from` ticks per quarter, at `to` (rounded half up, as the
/// tokenizer rounds to its grid).
fn rescale_tick(tick: u64, from: u64, to: u64) -> u64 {
    let (t, f, o) = (tick as u128, from.max(1) as u128, to as u128);
    ((t * o * 2 + f) / (f * 2)) as u64
}

fn lcm(a: u64, b: u64) -> Option<u64> {
    let gcd = |mut a: u64, mut b: u64| {
        while b != 0 {
            (a, b) = (b, a % b);
        }
        a
    };
    (a / gcd(a, b).max(1)).checked_mul(b)
}

/// The tick at which bar `index` (0-based) of `score` starts.
fn bar_start(score: &Score, index: usize) -> u64 {
    let mut end = score.end_tick().max(score.ticks_per_quarter as u64);
    loop {
        if let Some(&t) = score.bar_ticks(end).get(index) {
            return t;
        }
        end = end.saturating_mul(2);
    }
}

/// The notes of `all` that `part` lacks (as multisets).
fn added(all: &[Note], part: &[Note]) -> Vec<Note> {
    let mut left: BTreeMap<Note, usize> = BTreeMap::new();
    for n in part {
        *left.entry(*n).or_default() += 1;
    }
    all.iter()
        .filter(|n| match left.get_mut(n) {
            Some(c) if *c > 0 => {
                *c -= 1;
                false
            }
            _ => true,
        })
        .copied()
        .collect()
}

/// The events of the map `all` (in tick order) that `part` lacks and that
/// change the value in effect before them.
fn changes<V: Ord + Copy>(all: &[(u64, V)], part: &[(u64, V)]) -> Vec<(u64, V)> {
    let mut left: BTreeMap<(u64, V), usize> = BTreeMap::new();
    for e in part {
        *left.entry(*e).or_default() += 1;
    }
    let mut current = None;
    let mut out = Vec::new();
    for &(tick, v) in all {
        let from_part = match left.get_mut(&(tick, v)) {
            Some(c) if *c > 0 => {
                *c -= 1;
                true
            }
            _ => false,
        };
        if !from_part && current != Some(v) {
            out.push((tick, v));
        }
        current = Some(v);
    }
    out
}

/// The instruments of the notes that the tokens after the first
/// `prompt_len` add (programs, [`tokenizer::DRUMS`] for drums), sorted.
pub fn played_after_prompt(tokens: &[u32], prompt_len: usize, vocab: &Vocab) -> Vec<u8> {
    instruments(&Decoded::of(tokens, prompt_len, vocab).added_notes())
}

/// The instruments of `notes` (programs, [`tokenizer::DRUMS`]), sorted.
fn instruments(notes: &[Note]) -> Vec<u8> {
    let mut out: Vec<u8> = notes
        .iter()
        .map(|n| {
            if n.is_drum {
                tokenizer::DRUMS
            } else {
                n.program
            }
        })
        .collect();
    out.sort_unstable();
    out.dedup();
    out
}

/// The instruments of `wanted` (`--programs` as applied; `None`: any) that
/// `played` lacks.
fn not_played(wanted: Option<&[u8]>, played: &[u8]) -> Vec<u8> {
    wanted
        .unwrap_or_default()
        .iter()
        .copied()
        .filter(|p| !played.contains(p))
        .collect()
}

/// An instrument as people name it: `drums`, or the General MIDI name and
/// program (`Acoustic Bass (32)`).
pub fn instrument_label(program: u8) -> String {
    if program == tokenizer::DRUMS {
        "drums".to_string()
    } else {
        format!("{} ({program})", render::gm_program_name(program))
    }
}

/// The warning for the instruments of `wanted` (`--programs` as applied,
/// which is the prompt's by default) that are not in `played`
/// ([`WrittenPiece::played`]): sampling bans the others but forces none to play.
pub fn silence_warning(wanted: Option<&[u8]>, played: &[u8]) -> Option<String> {
    let silent = not_played(wanted, played);
    (!silent.is_empty()).then(|| {
        let names: Vec<String> = silent.iter().map(|&p| instrument_label(p)).collect();
        format!(
            "{} played no note after the prompt: the model picks the instruments it plays \
             (the instruments chosen only keep it from others), and plays rarely what it rarely saw in \
             training (see its model card)",
            names.join(", ")
        )
    })
}

/// Decodes a sample and writes its files: MIDI, then tokens, WAV (with
/// `soundfont`) and piano roll where `files` names them. With `prompt` (the
/// prompt file as read), the written piece keeps the file's own events
/// ([`keep_prompt`]).
pub fn write_piece(
    sample: &Sample,
    vocab: &Vocab,
    files: &PieceFiles,
    soundfont: Option<&Path>,
    prompt: Option<&Score>,
) -> Result<WrittenPiece> {
    let decoded = Decoded::of(&sample.tokens, sample.prompt_len, vocab);
    let score = match prompt {
        Some(file) => splice(file, &decoded, vocab),
        None => decoded.all.clone(),
    };
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
        played: instruments(&decoded.added_notes()),
        skipped: decoded.skipped,
        audio,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::midi::{InstrumentName, KeySignature};
    use crate::tokenizer::{RemiConfig, Token, TokenType, BOS_ID};

    /// Four 4/4 bars of quarter notes at 96 ticks per quarter, a tick off the
    /// grid, velocities 80/95/105, 120 BPM, D major, a title and a name.
    fn prompt_file() -> Score {
        let mut s = Score::new(96);
        for i in 0..16u64 {
            let vel = [80, 95, 105][i as usize % 3];
            s.notes
                .push(Note::melodic(i * 96 + 1, 90, 60 + (i % 5) as u8, vel, 0));
        }
        s.tempos.push(TempoChange {
            tick: 0,
            us_per_quarter: 500_000,
        });
        s.time_signatures.push(TimeSignature {
            tick: 0,
            numerator: 4,
            denominator: 4,
        });
        s.key_signatures.push(KeySignature {
            tick: 0,
            sharps: 2,
            minor: false,
        });
        s.title = Some("Tune".into());
        s.instrument_names.push(InstrumentName {
            program: 0,
            is_drum: false,
            name: "Fiddle".into(),
        });
        s
    }

    /// BOS and the file's first two bars, then those two bars again as the
    /// model's continuation.
    fn prompt_and_repeat(file: &Score, vocab: &Vocab) -> (Vec<u32>, usize) {
        let (body, _) = tokenizer::encode(file, vocab);
        let prompt = super::super::prompt_tokens(&body, Some(2));
        let mut tokens = prompt.clone();
        tokens.extend_from_slice(&prompt[1..]);
        (tokens, prompt.len())
    }

    #[test]
    fn a_continued_prompt_keeps_the_files_own_events() {
        let vocab = Vocab::new(RemiConfig::default()).unwrap();
        let file = prompt_file();
        let (tokens, prompt_len) = prompt_and_repeat(&file, &vocab);
        assert_eq!(tokens[0], BOS_ID);
        let out = keep_prompt(&file, &tokens, prompt_len, &vocab);
        let k = out.ticks_per_quarter as u64 / 96;
        assert_eq!(out.ticks_per_quarter as u64 % 96, 0);
        let bar = 4 * 96 * k;
        // The prompt's two bars as the file has them: times a tick off the
        // grid, three velocities; the file's bars 3-4 are not in the prompt.
        let (ours, theirs): (Vec<Note>, Vec<Note>) =
            out.notes.iter().partition(|n| n.start < 2 * bar);
        let expect: Vec<Note> = file.notes[..8]
            .iter()
            .map(|n| Note {
                start: n.start * k,
                duration: n.duration * k,
                ..*n
            })
            .collect();
        assert_eq!(ours, expect);
        // The model's two bars, on the grid, at the vocabulary's velocities.
        assert_eq!(theirs.len(), 8);
        for (n, f) in theirs.iter().zip(&file.notes) {
            assert_eq!(n.velocity, vocab.config().quantized_velocity(f.velocity));
        }
        assert!(theirs.iter().all(|n| n.start % (k * 96 / 12) == 0));
        assert_eq!(theirs[0].start, 2 * bar);
        // Restated tempo and signature: the file's exact ones stay alone.
        assert_eq!(
            out.tempos,
            vec![TempoChange {
                tick: 0,
                us_per_quarter: 500_000
            }]
        );
        assert_eq!(out.time_signatures.len(), 1);
        assert_eq!(out.key_signatures, file.key_signatures);
        assert_eq!(out.title.as_deref(), Some("Tune"));
        assert_eq!(out.instrument_name(0, false), Some("Fiddle"));
        // It writes and reads back as such.
        let (back, _) = midi::parse(&midi::to_bytes(&out).unwrap()).unwrap();
        assert_eq!(back.notes.len(), 16);
        assert_eq!(back.title.as_deref(), Some("Tune"));
    }

    #[test]
    fn a_tempo_change_of_the_model_is_kept() {
        let vocab = Vocab::new(RemiConfig::default()).unwrap();
        let file = prompt_file();
        let (mut tokens, prompt_len) = prompt_and_repeat(&file, &vocab);
        let (bin, _) = vocab.config().tempo_bin(500_000);
        let faster = vocab.id(Token::Tempo(bin + 3)).unwrap();
        let at = prompt_len
            + tokens[prompt_len..]
                .iter()
                .position(|&t| vocab.kind(t) == Some(TokenType::Tempo))
                .expect("the repeat restates the tempo");
        tokens[at] = faster;
        let out = keep_prompt(&file, &tokens, prompt_len, &vocab);
        let bar = 4 * out.ticks_per_quarter as u64;
        assert_eq!(out.tempos.len(), 2, "{:?}", out.tempos);
        assert_eq!(out.tempos[0].us_per_quarter, 500_000);
        assert_eq!(out.tempos[1].tick, 2 * bar);
        assert_eq!(
            out.tempos[1].us_per_quarter,
            vocab.config().tempo_us(bin + 3)
        );
    }

    #[test]
    fn silent_instruments_are_named() {
        let vocab = Vocab::new(RemiConfig::default()).unwrap();
        let file = prompt_file();
        let (tokens, prompt_len) = prompt_and_repeat(&file, &vocab);
        assert_eq!(played_after_prompt(&tokens, prompt_len, &vocab), vec![0]);
        assert!(played_after_prompt(&tokens, tokens.len(), &vocab).is_empty());
        let silent = not_played(Some(&[0, 33, tokenizer::DRUMS]), &[0]);
        assert_eq!(silent, vec![33, tokenizer::DRUMS]);
        assert!(not_played(None, &[0]).is_empty());
        let w = silence_warning(Some(&[0, 33, tokenizer::DRUMS]), &[0]).unwrap();
        assert!(
            w.starts_with("Fingered Bass (33), drums played no note"),
            "{w}"
        );
        assert_eq!(silence_warning(Some(&[0]), &[0]), None);
        assert_eq!(silence_warning(None, &[]), None);
    }

    #[test]
    fn multiset_helpers() {
        let n = |s| Note::melodic(s, 1, 60, 90, 0);
        assert_eq!(added(&[n(0), n(0), n(1)], &[n(0)]), vec![n(0), n(1)]);
        let all = [(0, 5), (4, 5), (8, 6), (8, 7)];
        assert_eq!(changes(&all, &[(0, 5)]), vec![(8, 6), (8, 7)]);
        assert_eq!(lcm(96, 12), Some(96));
        assert_eq!(lcm(1000, 12), Some(3000));
        assert_eq!(rescale_tick(1, 96, 12), 0);
        assert_eq!(rescale_tick(4, 96, 12), 1);
    }

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
