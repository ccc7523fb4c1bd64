//! Listen-proof checks of the shipped model under `models/cadenza-small`.
//! The generation check needs nothing else; the validation-loss check needs
//! the shared corpus and is ignored by default (`.ci/run` runs it).

use std::path::{Path, PathBuf};

use cadenza::sample::{self, SampleConfig};
use cadenza::tokenizer::{self, dataset, validate};
use cadenza::train::{self, checkpoint, data};
use cadenza::{eval, midi};

const MODEL: &str = "models/cadenza-small";

/// The validation loss the model card states (nats/token).
fn card_val_loss() -> f64 {
    let card = std::fs::read_to_string(Path::new(MODEL).join("README.md")).unwrap();
    let line = card
        .lines()
        .find(|l| l.contains("validation loss:"))
        .expect("the card states a validation loss");
    line.split("validation loss:")
        .nth(1)
        .and_then(|s| s.split_whitespace().next())
        .and_then(|s| {
            s.trim_matches(|c: char| !c.is_ascii_digit() && c != '.')
                .parse()
                .ok()
        })
        .expect("a number after 'validation loss:'")
}

#[test]
fn shipped_model_generates_plausible_music() {
    let mut m = checkpoint::load_model(Path::new(MODEL), tch::Device::Cpu).unwrap();
    m.model.freeze(1);
    let (score, _) = midi::read_file(Path::new("midi_samples/oneills-reel-4-4.mid")).unwrap();
    let (body, _) = tokenizer::encode(&score, &m.vocab);
    let prompt = sample::prompt_tokens(&body, Some(4));
    let cfg = SampleConfig {
        max_tokens: 768,
        seed: 1,
        ..Default::default()
    };
    let s = &sample::generate(&m.model, &m.vocab, &prompt, 1, &cfg, &mut |_| {}).unwrap()[0];
    validate(&s.tokens, &m.vocab).unwrap();
    let (decoded, rep) = tokenizer::decode(&s.tokens, &m.vocab);
    assert!(rep.is_clean(), "{rep:?}");
    let cont: Vec<_> = decoded.notes.iter().filter(|n| !n.is_drum).collect();
    assert!(cont.len() > 100, "only {} notes", cont.len());
    let lo = cont.iter().map(|n| n.pitch).min().unwrap();
    let hi = cont.iter().map(|n| n.pitch).max().unwrap();
    assert!(
        (36..=84).contains(&lo) && (48..=100).contains(&hi) && hi - lo >= 7,
        "range {lo}..{hi}"
    );
    let stats = eval::stats::piece_stats(&decoded);
    assert!(
        (2.0..=40.0).contains(&stats.notes_per_bar),
        "{} notes per bar",
        stats.notes_per_bar
    );
    assert!(stats.empty_bar_share < 0.3, "{stats:?}");
    // It holds a key (the first model, which ignored its context, was at 0.64).
    assert!(stats.scale_consistency > 0.85, "{stats:?}");
    // Rhythm like the corpus's: bars mostly repeat their onset patterns.
    assert!(stats.grooving_similarity > 0.8, "{stats:?}");
    // The grammar stepped in for a minority of draws (the card says ~13%).
    assert!(
        s.grammar_corrections * 4 < s.tokens.len(),
        "{} corrections",
        s.grammar_corrections
    );
}

#[test]
#[ignore]
fn shipped_model_validation_loss_matches_its_card() {
    let corpus = std::env::var_os("CADENZA_CORPUS")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("../shared/corpus"));
    assert!(corpus.is_dir(), "corpus {} not found", corpus.display());
    let mut m = checkpoint::load_model(Path::new(MODEL), tch::Device::Cpu).unwrap();
    // Training validated with noise and features frozen from its seed.
    m.model.freeze(m.config.train.seed);
    let tmp = tempfile::tempdir().unwrap();
    let files =
        dataset::collect_midi_files(&[corpus.join("classical"), corpus.join("folk")]).unwrap();
    // Sources start with each input folder's name, as `cadenza tokenize classical folk` writes them.
    let results = dataset::tokenize_files(&files, &m.vocab, &|| {});
    dataset::write_dataset(tmp.path(), &m.vocab, &files, results).unwrap();
    let ds = dataset::Dataset::open(tmp.path()).unwrap();
    let tc = &m.config.train;
    let split = data::split(&ds, tc.seed, tc.val_fraction);
    let windows = data::validation_windows(&split.val, tc.seq_len as usize + 1, tc.val_windows);
    let loss = train::validation_loss(
        &m.model,
        &windows,
        None,
        tc.batch as usize,
        tch::Device::Cpu,
    );
    let card = card_val_loss();
    // The same windows with the dense products in bf16 (native where the CPU has AMX or
    // AVX512-BF16, the same numbers through f32 kernels elsewhere).
    m.model.set_precision(cadenza::model::Precision::Bf16);
    let bf16 = train::validation_loss(
        &m.model,
        &windows,
        None,
        tc.batch as usize,
        tch::Device::Cpu,
    );
    println!("validation loss {loss:.4} (bf16 products: {bf16:.4}), card {card:.4}");
    assert!(
        (loss - card).abs() < 0.05,
        "validation loss {loss} vs card {card}"
    );
    assert!(
        (bf16 - loss).abs() < 0.01,
        "validation loss in bf16 {bf16} against {loss} in f32"
    );
}

#[test]
fn generate_writes_every_piece_when_its_reader_leaves() {
    // `cadenza generate ... | head -1`: the pipe closes before anything is
    // printed. Every piece is still written, and nothing panics.
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("s.mid");
    let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_cadenza"))
        .args([
            "generate",
            "--model",
            MODEL,
            "--tokens",
            "64",
            "--num-samples",
            "2",
        ])
        .arg("-o")
        .arg(&out)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    drop(child.stdout.take());
    let done = child.wait_with_output().unwrap();
    let stderr = String::from_utf8_lossy(&done.stderr);
    assert!(!stderr.contains("panicked"), "{stderr}");
    for i in 1..=2 {
        let piece = dir.path().join(format!("s-{i}.mid"));
        midi::read_file(&piece).unwrap_or_else(|e| panic!("{}: {e}", piece.display()));
    }
}
