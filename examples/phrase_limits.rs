//! How often real (or generated) pieces repeat a phrase, to choose the
//! repetition guard's phrase rule (see `src/sample/guard.rs`).
//!
//! ```sh
//! cargo run --release --example phrase_limits -- models/cadenza-small/vocab.json 1500 ../shared/corpus/classical ../shared/corpus/folk
//! cargo run --release --example phrase_limits -- models/cadenza-small/vocab.json 0 out/gen
//! ```
//!
//! Arguments: a vocabulary, how many pieces to take at most (spread evenly
//! over the sorted file list; 0 = all), then MIDI files or folders. Each
//! piece is tokenized; per melodic program, every note is checked the slow
//! way: does the phrase of N pitches ending on it occur R times or more
//! among the program's previous W notes? It prints, per (W, N, R), the
//! share of notes that would have been masked and the share of pieces with
//! any such note: short phrases over `PHRASE_WINDOW` notes, long ones over
//! `LONG_PHRASE_WINDOW`. The guard's phrase rule uses N = `PHRASE_NOTES`
//! and R = `max_phrase_repeats`, its long rule N = `LONG_PHRASE_NOTES` and
//! R = `max_long_phrase_repeats`; its unit tests check it against this same
//! count.

use std::path::PathBuf;

use anyhow::{Context, Result};
use cadenza::sample::guard::{LONG_PHRASE_WINDOW, PHRASE_WINDOW};
use cadenza::tokenizer::{dataset, Token, Vocab, DRUMS};

/// The (window, phrase notes, repeats) cells of the table.
fn cells() -> Vec<(usize, usize, usize)> {
    let mut out = Vec::new();
    for n in [4, 6, 8, 12] {
        for r in [4, 6, 8, 12] {
            out.push((PHRASE_WINDOW, n, r));
        }
    }
    for n in [16, 24, 32] {
        for r in [3, 4, 5, 6] {
            out.push((LONG_PHRASE_WINDOW, n, r));
        }
    }
    out
}

/// Earlier occurrences of the `n` pitches ending at `s[m]` among the
/// `window` notes before it.
fn repeats(s: &[u8], m: usize, n: usize, window: usize) -> usize {
    if m + 1 < n {
        return 0;
    }
    let gram = &s[m + 1 - n..=m];
    let lo = m.saturating_sub(window);
    (lo..(m + 1).saturating_sub(n))
        .filter(|&i| i + n <= m && &s[i..i + n] == gram)
        .count()
}

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    anyhow::ensure!(
        args.len() >= 3,
        "usage: phrase_limits VOCAB MAX_PIECES PATH..."
    );
    let vocab = Vocab::load(&PathBuf::from(&args[0]))?;
    let max: usize = args[1].parse().context("MAX_PIECES")?;
    let inputs: Vec<PathBuf> = args[2..].iter().map(PathBuf::from).collect();
    let mut files = dataset::collect_midi_files(&inputs)?;
    if max > 0 && files.len() > max {
        let n = files.len();
        files = (0..max).map(|i| files[i * n / max].clone()).collect();
    }
    let grid = cells();
    let cells = grid.len();
    let mut masked = vec![0usize; cells];
    let mut pieces_hit = vec![0usize; cells];
    let (mut notes, mut pieces) = (0usize, 0usize);
    for (path, _) in &files {
        let Ok(t) = dataset::tokenize_file(path, &vocab) else {
            continue;
        };
        pieces += 1;
        let mut melodies: Vec<Vec<u8>> = vec![Vec::new(); DRUMS as usize];
        let mut program = None;
        let mut hit = vec![false; cells];
        for &id in &t.tokens {
            match vocab.token(id) {
                Some(Token::Program(p)) => program = Some(p),
                Some(Token::Pitch(pitch)) => {
                    let Some(s) = program.and_then(|p| melodies.get_mut(p as usize)) else {
                        continue;
                    };
                    s.push(pitch);
                    notes += 1;
                    for (k, &(w, n, r)) in grid.iter().enumerate() {
                        if repeats(s, s.len() - 1, n, w) >= r {
                            masked[k] += 1;
                            hit[k] = true;
                        }
                    }
                }
                _ => {}
            }
        }
        for (p, h) in pieces_hit.iter_mut().zip(hit) {
            *p += h as usize;
        }
    }
    println!("{pieces} pieces, {notes} melodic notes\n");
    println!(
        "| window W (notes) | phrase notes N | repeats R | notes masked | pieces with a masked note |"
    );
    println!("| ---: | ---: | ---: | ---: | ---: |");
    for (k, (w, n, r)) in grid.iter().enumerate() {
        println!(
            "| {w} | {n} | {r} | {:.3}% | {:.1}% |",
            100.0 * masked[k] as f64 / notes.max(1) as f64,
            100.0 * pieces_hit[k] as f64 / pieces.max(1) as f64
        );
    }
    Ok(())
}
