//! Training, resuming, evaluating and generating with the tiny preset on the
//! bundled sample files (no shared corpus needed).

use std::path::{Path, PathBuf};
use std::process::Command;

use cadenza::midi;
use cadenza::sample::{self, SampleConfig};
use cadenza::tokenizer::{self, dataset, validate, Vocab};
use cadenza::train::{self, checkpoint, TrainOptions};

/// libtorch's random generator is global to the process: tests that train
/// in this process take turns, or their random draws would interleave.
static TORCH_RNG: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn torch_rng() -> std::sync::MutexGuard<'static, ()> {
    TORCH_RNG.lock().unwrap_or_else(|e| e.into_inner())
}

fn bin() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_cadenza"))
}

/// A small dataset: the sample prompts plus generated scales and arpeggios
/// with drums, so the tests need nothing outside the repository.
fn dataset_dir(dir: &Path) -> PathBuf {
    let midi_dir = dir.join("midi");
    std::fs::create_dir_all(&midi_dir).unwrap();
    for f in std::fs::read_dir("midi_samples").unwrap() {
        let p = f.unwrap().path();
        if dataset::is_midi_path(&p) {
            std::fs::copy(&p, midi_dir.join(p.file_name().unwrap())).unwrap();
        }
    }
    for k in 0..12u8 {
        let mut s = midi::Score::new(480);
        for i in 0..64u64 {
            let degree = [0u8, 2, 4, 5, 7, 9, 11, 12][(i % 8) as usize];
            s.notes.push(midi::Note {
                start: i * 240,
                duration: 240,
                pitch: 48 + k + degree,
                velocity: 64 + (i % 4) as u8 * 8,
                program: k % 3,
                channel: 0,
                is_drum: false,
            });
            if i % 2 == 0 {
                s.notes.push(midi::Note {
                    start: i * 240,
                    duration: 120,
                    pitch: if i % 4 == 0 { 36 } else { 38 },
                    velocity: 100,
                    program: 0,
                    channel: 9,
                    is_drum: true,
                });
            }
        }
        s.sort();
        midi::write_file(&s, &midi_dir.join(format!("scale{k}.mid"))).unwrap();
    }
    let out = dir.join("data");
    let vocab = Vocab::new(Default::default()).unwrap();
    let files = dataset::collect_midi_files(&[midi_dir]).unwrap();
    let results = dataset::tokenize_files(&files, &vocab, &|| {});
    let m = dataset::write_dataset(&out, &vocab, &files, results).unwrap();
    assert_eq!(m.pieces, 15);
    out
}

fn tiny_opts(run: &Path, data: &Path, steps: u64) -> TrainOptions {
    TrainOptions {
        run_dir: run.to_path_buf(),
        data: Some(data.to_path_buf()),
        preset: Some("tiny".into()),
        steps: Some(steps),
        seq_len: Some(64),
        batch: Some(4),
        // The preset's own learning rate: the tiny model must learn with it.
        seed: Some(1),
        // Tests run in parallel: one libtorch thread each avoids oversubscription.
        threads: Some(1),
        // The same numbers on every machine (`auto` picks bf16 where the CPU has AMX).
        precision: Some(cadenza::model::Precision::F32),
        ..Default::default()
    }
}

#[test]
fn bf16_run_learns_saves_its_precision_and_resumes_exactly() {
    use cadenza::model::Precision;
    let _rng = torch_rng();
    let tmp = tempfile::tempdir().unwrap();
    let data = dataset_dir(tmp.path());
    let vocab = Vocab::new(Default::default()).unwrap();
    let bf16 = |run: &Path| TrainOptions {
        precision: Some(Precision::Bf16),
        ..tiny_opts(run, &data, 40)
    };
    let full = tmp.path().join("full");
    let s = train::train(&bf16(&full)).unwrap();
    let uniform = (vocab.len() as f64).ln();
    let val = s.last_val_loss.unwrap();
    assert!(
        val < 0.6 * uniform,
        "bf16 validation loss {val} vs uniform {uniform}"
    );
    let saved: train::config::RunConfig =
        cadenza::util::read_json(&full.join("config.json")).unwrap();
    assert_eq!(saved.train.precision, Precision::Bf16);

    // stopped at a checkpoint and resumed: the same losses, bit for bit
    let part = tmp.path().join("part");
    let mut o = bf16(&part);
    o.stop_after = Some(20);
    train::train(&o).unwrap();
    let resume = |precision| TrainOptions {
        resume: true,
        preset: None,
        seq_len: None,
        batch: None,
        precision,
        ..tiny_opts(&part, &data, 40)
    };
    let err = train::train(&resume(Some(Precision::F32)))
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("bf16") && err.contains("--precision f32"),
        "{err}"
    );
    train::train(&resume(None)).unwrap();
    let a = train::read_metrics(&full).unwrap();
    let b = train::read_metrics(&part).unwrap();
    assert_eq!(a.len(), b.len());
    for (x, y) in a.iter().zip(&b) {
        assert_eq!(x.train_loss, y.train_loss, "step {}", x.step);
        assert_eq!(x.val_loss, y.val_loss, "step {}", x.step);
    }

    // the same weights evaluated in f32 and in bf16: close, not equal
    let eval = |precision| {
        train::eval::evaluate(&train::eval::EvalOptions {
            model_dir: full.clone(),
            data: vec![data.clone()],
            max_len: Some(64),
            bin: 32,
            min_len: 0,
            max_pieces: 6,
            device: Some("cpu".into()),
            seed: 0,
            threads: 1,
            precision,
        })
        .unwrap()
    };
    let (e32, e16) = (eval(Precision::F32), eval(Precision::Bf16));
    assert_eq!(
        (e32.precision, e16.precision),
        (Precision::F32, Precision::Bf16)
    );
    let (l32, l16) = (e32.metrics.all.loss, e16.metrics.all.loss);
    assert!(
        l32 != l16 && (l32 - l16).abs() < 0.02 * l32,
        "f32 {l32} bf16 {l16}"
    );

    // generate in bf16 from the command line: recorded, and replayed with it
    let piece = tmp.path().join("bf16.mid");
    let out = Command::new(bin())
        .args([
            "generate",
            "--model",
            &full.display().to_string(),
            "--tokens",
            "40",
        ])
        .args([
            "--precision",
            "bf16",
            "--device",
            "cpu",
            "-o",
            &piece.display().to_string(),
        ])
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("precision: bf16"),
        "{out:?}"
    );
    let rec: cadenza::cli::PieceRecord =
        checkpoint::read_json(&piece.with_extension("json")).unwrap();
    assert_eq!(rec.precision, Precision::Bf16);
    let args = rec.generate_args();
    assert!(
        args.windows(2).any(|w| w == ["--precision", "bf16"]),
        "{args:?}"
    );
}

#[test]
fn tiny_model_learns_resumes_exactly_and_generates() {
    let _rng = torch_rng();
    let tmp = tempfile::tempdir().unwrap();
    let data = dataset_dir(tmp.path());
    let vocab = Vocab::new(Default::default()).unwrap();

    // An uninterrupted run.
    let full = tmp.path().join("full");
    let s = train::train(&tiny_opts(&full, &data, 60)).unwrap();
    let uniform = (vocab.len() as f64).ln();
    let val = s.last_val_loss.unwrap();
    assert!(
        val < 0.6 * uniform,
        "validation loss {val} vs uniform {uniform}"
    );

    // The best validation weights are kept apart and load as a model.
    let best = checkpoint::load_model(&full.join(checkpoint::BEST_DIR), tch::Device::Cpu)
        .expect("best checkpoint loads");
    let best_val = best.state.as_ref().and_then(|st| st.best_val_loss).unwrap();
    assert!(best_val <= val + 1e-12, "{best_val} vs {val}");

    // The same run stopped at step 40 (a checkpoint) and resumed.
    let part = tmp.path().join("part");
    let mut o = tiny_opts(&part, &data, 60);
    o.stop_after = Some(40);
    train::train(&o).unwrap();
    // Resuming on another schedule length needs --extend: the cosine would move.
    let mut other = tiny_opts(&part, &data, 90);
    other.resume = true;
    other.preset = None;
    other.seq_len = None;
    other.batch = None;
    let err = train::train(&other).unwrap_err().to_string();
    assert!(err.contains("--extend") && err.contains("60"), "{err}");
    let mut o = tiny_opts(&part, &data, 60);
    o.resume = true;
    o.preset = None;
    o.seq_len = None;
    o.batch = None;
    o.lr = None;
    train::train(&o).unwrap();
    let a = train::read_metrics(&full).unwrap();
    let b = train::read_metrics(&part).unwrap();
    assert_eq!(a.len(), b.len());
    for (x, y) in a.iter().zip(&b) {
        assert_eq!(x.step, y.step);
        let (lx, ly) = (x.train_loss.unwrap(), y.train_loss.unwrap());
        assert!(
            (lx - ly).abs() <= 1e-5 * lx.abs(),
            "step {}: {lx} vs {ly}",
            x.step
        );
    }
    // No half-written checkpoint folders are left behind.
    for e in std::fs::read_dir(&part).unwrap() {
        let name = e.unwrap().file_name().to_string_lossy().into_owned();
        assert!(!name.contains(".tmp"), "leftover {name}");
    }

    // Evaluation writes a per-position curve.
    let r = train::eval::evaluate(&train::eval::EvalOptions {
        model_dir: full.clone(),
        data: vec![data.clone()],
        max_len: Some(128),
        bin: 32,
        min_len: 0,
        max_pieces: 20,
        device: Some("cpu".into()),
        seed: 0,
        threads: 1,
        precision: cadenza::model::Precision::F32,
    })
    .unwrap();
    assert_eq!(r.bins.len(), 4);
    assert!(r.mean_within < uniform && r.mean_beyond.unwrap() < uniform);
    // The per-type report covers every scored token, and its loss is the
    // count-weighted mean of the per-type losses.
    let all = &r.metrics.all;
    let counted: u64 = all.by_type.values().map(|t| t.count).sum();
    assert_eq!(counted, all.tokens);
    let weighted: f64 = all
        .by_type
        .values()
        .map(|t| t.nll * t.count as f64)
        .sum::<f64>()
        / counted as f64;
    assert!(
        (weighted - all.loss).abs() < 1e-9,
        "{weighted} vs {}",
        all.loss
    );
    assert!(all.by_type.contains_key("Pitch") && all.by_type.contains_key("Bar"));
    assert!(all.pitch_context.count > 0);
    assert!((0.0..=1.0).contains(&all.pitch_context.model_mass));
    assert!(!r.metrics.by_source.is_empty());

    // Generation: valid, prompt kept, deterministic, samples differ.
    let mut m = checkpoint::load_model(&full, tch::Device::Cpu).unwrap();
    m.model.freeze(3);
    let (score, _) = midi::read_file(Path::new("midi_samples/oneills-reel-4-4.mid")).unwrap();
    let (body, _) = tokenizer::encode(&score, &m.vocab);
    let prompt = sample::prompt_tokens(&body, Some(2));
    let cfg = SampleConfig {
        max_tokens: 200,
        seed: 5,
        ..Default::default()
    };
    let run = |n| sample::generate(&m.model, &m.vocab, &prompt, n, &cfg, &mut |_| {}).unwrap();
    let first = run(3);
    let again = run(3);
    assert_eq!(first[0].tokens, again[0].tokens, "same seed, same piece");
    assert_ne!(first[0].tokens, first[1].tokens, "samples differ");
    for s in &first {
        assert_eq!(&s.tokens[..prompt.len()], &prompt[..]);
        validate(&s.tokens, &m.vocab).unwrap();
        let (d, rep) = tokenizer::decode(&s.tokens, &m.vocab);
        assert!(rep.is_clean(), "{rep:?}");
        let bytes = midi::to_bytes(&tokenizer::to_output_resolution(&d)).unwrap();
        assert!(midi::parse(&bytes).is_ok());
    }
    // Without a prompt too.
    let free = sample::generate(
        &m.model,
        &m.vocab,
        &[tokenizer::BOS_ID],
        1,
        &cfg,
        &mut |_| {},
    )
    .unwrap();
    validate(&free[0].tokens, &m.vocab).unwrap();

    // The recurrence samples what recomputing the whole prefix samples.
    let short = SampleConfig {
        max_tokens: 40,
        ..cfg.clone()
    };
    let rec = sample::generate(&m.model, &m.vocab, &prompt, 1, &short, &mut |_| {}).unwrap();
    let full_recompute =
        sample::generate_by_recompute(&m.model, &m.vocab, &prompt, &short).unwrap();
    assert_eq!(rec[0].tokens, full_recompute.tokens);
    // Both apply the repetition guard the same way: with limits tight
    // enough that it changes draws, they still give the same piece.
    let tight = SampleConfig {
        guard: sample::GuardConfig {
            enabled: true,
            max_note_quarters: 0.01,
            max_same_pitch: 1,
            max_phrase_repeats: 1,
            max_long_phrase_repeats: 1,
        },
        ..short.clone()
    };
    let rec = sample::generate(&m.model, &m.vocab, &prompt, 1, &tight, &mut |_| {}).unwrap();
    let full_recompute =
        sample::generate_by_recompute(&m.model, &m.vocab, &prompt, &tight).unwrap();
    assert!(rec[0].guard_changes > 0, "the guard never acted");
    assert_eq!(rec[0].tokens, full_recompute.tokens);
    assert_eq!(rec[0].guard_changes, full_recompute.guard_changes);
    // By default a piece runs to its full length.
    assert!(first.iter().all(|s| s.stop == sample::Stop::MaxTokens));

    // The first-token distribution after the prompt matches the parallel forward.
    let ids: Vec<i64> = prompt.iter().map(|&t| t as i64).collect();
    let x = tch::Tensor::from_slice(&ids).view([1, -1]);
    let par = m
        .model
        .forward_t(&x, 0, false)
        .select(1, ids.len() as i64 - 1);
    let mut st = m.model.begin(1);
    let pre = m.model.prefill(&x, &mut st).select(1, ids.len() as i64 - 1);
    let pp = par.softmax(-1, tch::Kind::Float);
    let pr = pre.softmax(-1, tch::Kind::Float);
    assert!((pp - pr).abs().max().double_value(&[]) < 1e-5);

    // The command line: full length by default, the guard's count reported.
    let gen = |extra: &[&str]| {
        let out = Command::new(bin())
            .args(["generate", "--model", &full.display().to_string()])
            .args(["--tokens", "60", "--device", "cpu", "-o"])
            .arg(tmp.path().join("g.mid"))
            .args(extra)
            .output()
            .unwrap();
        assert!(out.status.success(), "{out:?}");
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    let text = gen(&[]);
    assert!(text.contains("stopped by MaxTokens"), "{text}");
    assert!(text.contains("the repetition guard changed"), "{text}");
    assert!(text.contains("guard change(s)"), "{text}");
    let text = gen(&["--allow-early-end", "--no-repetition-guard"]);
    assert!(text.contains("draw(s) (off)"), "{text}");

    // The run folder names its dataset relative to itself, and its sampling
    // defaults are generate's built-in ones.
    let cfg: train::config::RunConfig =
        checkpoint::read_json(&full.join(checkpoint::CONFIG_FILE)).unwrap();
    assert!(!Path::new(&cfg.dataset).is_absolute(), "{}", cfg.dataset);
    assert!(checkpoint::dataset_path(&full, &cfg)
        .join(dataset::MANIFEST_FILE)
        .is_file());
    let (defaults, from) = checkpoint::read_generation_config(&full).unwrap();
    assert_eq!(defaults, checkpoint::GenerationConfig::default());
    assert_eq!(from, Some(full.join(checkpoint::GENERATION_CONFIG_FILE)));
    // A checkpoint folder of the run reads the run's defaults.
    let (_, from) = checkpoint::read_generation_config(&full.join(checkpoint::BEST_DIR)).unwrap();
    assert_eq!(from, Some(full.join(checkpoint::GENERATION_CONFIG_FILE)));

    // Every piece comes with a record that makes it again.
    let run_cli = |args: &[String]| {
        let out = Command::new(bin()).args(args).output().unwrap();
        assert!(out.status.success(), "{args:?}: {out:?}");
    };
    let piece = |name: &str| {
        let out = tmp.path().join(format!("{name}.mid"));
        let toks = tmp.path().join(format!("{name}.txt"));
        (out, toks)
    };
    let (r1, t1) = piece("r1");
    let mut first_args: Vec<String> = [
        "generate",
        "--model",
        &full.display().to_string(),
        "--prompt",
        "midi_samples/oneills-reel-4-4.mid",
        "--prompt-bars",
        "2",
        "--tokens",
        "50",
        "--seed",
        "9",
        "--temperature",
        "0.9",
        "--top-k",
        "40",
        "--top-p",
        "0.9",
        "--min-p",
        "0.02",
        "--max-same-pitch",
        "3",
        "--min-tokens",
        "20",
        "--device",
        "cpu",
    ]
    .iter()
    .map(|a| a.to_string())
    .collect();
    first_args.extend([
        "-o".into(),
        r1.display().to_string(),
        "--tokens-out".into(),
        t1.display().to_string(),
    ]);
    run_cli(&first_args);
    // The piece begins with the prompt's two bars as the file has them: times,
    // velocities and tempo, not the model's reading of them.
    let (given, _) = midi::read_file(Path::new("midi_samples/oneills-reel-4-4.mid")).unwrap();
    let (made, _) = midi::read_file(&r1).unwrap();
    let k = (made.ticks_per_quarter / given.ticks_per_quarter) as u64;
    assert_eq!(
        made.ticks_per_quarter as u64,
        k * given.ticks_per_quarter as u64
    );
    let bar = 4 * given.ticks_per_quarter as u64;
    let head = |s: &midi::Score, scale: u64| -> Vec<(u64, u64, u8, u8)> {
        s.notes
            .iter()
            .filter(|n| n.start * scale < 2 * bar * k - bar * k / 8)
            .map(|n| (n.start * scale, n.duration * scale, n.pitch, n.velocity))
            .collect()
    };
    // (the model may add notes after the prompt's last one in bar 2)
    let (given_head, made_head) = (head(&given, k), head(&made, 1));
    assert!(!given_head.is_empty());
    for n in &given_head {
        assert!(
            made_head.contains(n),
            "{n:?} of the prompt is not in the piece"
        );
    }
    assert_eq!(
        made.tempos[0].us_per_quarter,
        given.tempos[0].us_per_quarter
    );
    let rec: cadenza::cli::PieceRecord = checkpoint::read_json(&r1.with_extension("json")).unwrap();
    assert_eq!(rec.seed, 9);
    assert_eq!(rec.vocab_hash, vocab.hash());
    assert_eq!(rec.sample_config.temperature, 0.9);
    assert_eq!(rec.sample_config.top_k, 40);
    assert_eq!(rec.sample_config.min_p, 0.02);
    assert_eq!(rec.sample_config.guard.max_same_pitch, 3);
    assert_eq!(rec.sample_config.earliest_end, Some(20));
    assert_eq!(rec.prompt.as_ref().and_then(|p| p.bars), Some(2));
    assert_eq!(rec.model.weights_sha256.len(), 64);
    // `auto` recorded as what it resolved to, and replayed as that
    assert_ne!(rec.precision, cadenza::model::Precision::Auto);
    assert_eq!(rec.command, rec.generate_args());
    let (r2, t2) = piece("r2");
    let mut again = rec.generate_args();
    again.extend([
        "-o".into(),
        r2.display().to_string(),
        "--tokens-out".into(),
        t2.display().to_string(),
    ]);
    run_cli(&again);
    assert_eq!(
        std::fs::read_to_string(&t1).unwrap(),
        std::fs::read_to_string(&t2).unwrap(),
        "the record's settings make the same piece"
    );
    let rec2: cadenza::cli::PieceRecord =
        checkpoint::read_json(&r2.with_extension("json")).unwrap();
    assert_eq!(rec2.command, rec.command);
    assert_eq!(rec2.tokens, rec.tokens);

    // generation_config.json gives the defaults; flags win over it.
    std::fs::write(
        full.join(checkpoint::GENERATION_CONFIG_FILE),
        r#"{"tokens": 30, "temperature": 0.5, "min_p": 0.2, "set": true, "repetition_guard": false}"#,
    )
    .unwrap();
    let (r3, _) = piece("r3");
    let base = |o: &Path| -> Vec<String> {
        vec![
            "generate".into(),
            "--model".into(),
            full.display().to_string(),
            "--device".into(),
            "cpu".into(),
            "-o".into(),
            o.display().to_string(),
        ]
    };
    run_cli(&base(&r3));
    let rec: cadenza::cli::PieceRecord = checkpoint::read_json(&r3.with_extension("json")).unwrap();
    assert_eq!(rec.sample_config.max_tokens, 30);
    assert_eq!(rec.sample_config.temperature, 0.5);
    assert_eq!(rec.sample_config.min_p, 0.2);
    assert!(rec.sample_config.set);
    assert!(rec.command.contains(&"--set".to_string()));
    assert!(rec.tunes >= 1);
    assert!(!rec.sample_config.guard.enabled);
    assert_eq!(
        rec.sample_config.top_p, 0.95,
        "keys left out keep their defaults"
    );
    assert!(rec.model.generation_config.is_some());
    let mut flags = base(&r3);
    flags.extend(["--tokens".into(), "12".into()]);
    run_cli(&flags);
    let rec: cadenza::cli::PieceRecord = checkpoint::read_json(&r3.with_extension("json")).unwrap();
    assert_eq!(rec.sample_config.max_tokens, 12);
    assert_eq!(rec.sample_config.temperature, 0.5);
    // A corrupt file is an error that names it; a missing one means the
    // built-in defaults.
    for bad in [
        r#"{"tokens": 30"#,
        r#"{"top-p": 0.5}"#,
        r#"{"top_p": 7}"#,
        r#"{"min_p": 1}"#,
        r#"{"set": true, "allow_early_end": true}"#,
    ] {
        std::fs::write(full.join(checkpoint::GENERATION_CONFIG_FILE), bad).unwrap();
        let out = Command::new(bin()).args(base(&r3)).output().unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{bad}: {err}");
        assert!(err.contains("generation_config.json"), "{bad}: {err}");
    }
    std::fs::remove_file(full.join(checkpoint::GENERATION_CONFIG_FILE)).unwrap();
    let mut flags = base(&r3);
    flags.extend(["--tokens".into(), "12".into()]);
    run_cli(&flags);
    let rec: cadenza::cli::PieceRecord = checkpoint::read_json(&r3.with_extension("json")).unwrap();
    assert_eq!(rec.sample_config.temperature, 1.0);
    assert!(rec.sample_config.guard.enabled);
    assert!(rec.model.generation_config.is_none());

    // A vocabulary the model was not trained with is refused.
    let other = Vocab::new(tokenizer::RemiConfig {
        velocity_bins: 16,
        ..Default::default()
    })
    .unwrap();
    other.save(&full.join("vocab.json")).unwrap();
    let err = checkpoint::load_model(&full, tch::Device::Cpu)
        .err()
        .unwrap()
        .to_string();
    assert!(err.contains("vocab"), "{err}");
}

#[test]
fn sigkill_and_resume_reach_the_same_losses() {
    let tmp = tempfile::tempdir().unwrap();
    let data = dataset_dir(tmp.path());
    let args = |run: &Path| {
        vec![
            "train".to_string(),
            "--data".into(),
            data.display().to_string(),
            "-o".into(),
            run.display().to_string(),
            "--preset".into(),
            "tiny".into(),
            "--steps".into(),
            "40".into(),
            "--seq-len".into(),
            "48".into(),
            "--batch".into(),
            "2".into(),
            "--seed".into(),
            "9".into(),
            "--threads".into(),
            "1".into(),
        ]
    };
    let full = tmp.path().join("full");
    let st = Command::new(bin()).args(args(&full)).output().unwrap();
    assert!(
        st.status.success(),
        "{}",
        String::from_utf8_lossy(&st.stderr)
    );

    let killed = tmp.path().join("killed");
    let mut child = Command::new(bin())
        .args(args(&killed))
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    // Kill it once a checkpoint exists and it has gone on a little past it.
    let state = killed.join("checkpoint").join("state.json");
    let t0 = std::time::Instant::now();
    while !state.exists() && t0.elapsed().as_secs() < 300 {
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    std::thread::sleep(std::time::Duration::from_millis(300));
    child.kill().unwrap(); // SIGKILL
    let _ = child.wait();
    let st = Command::new(bin())
        .args([
            "train",
            "-o",
            &killed.display().to_string(),
            "--resume",
            "--threads",
            "1",
        ])
        .output()
        .unwrap();
    assert!(
        st.status.success(),
        "{}",
        String::from_utf8_lossy(&st.stderr)
    );
    let a = train::read_metrics(&full).unwrap();
    let b = train::read_metrics(&killed).unwrap();
    assert_eq!(a.len(), 40);
    assert_eq!(b.len(), 40);
    for (x, y) in a.iter().zip(&b) {
        let (lx, ly) = (x.train_loss.unwrap(), y.train_loss.unwrap());
        assert!(
            (lx - ly).abs() <= 1e-5 * lx.abs(),
            "step {}: {lx} vs {ly}",
            x.step
        );
    }
}

#[test]
fn cli_reports_bad_inputs_clearly() {
    let tmp = tempfile::tempdir().unwrap();
    let junk = tmp.path().join("junk.mid");
    std::fs::write(&junk, b"definitely not midi").unwrap();
    let out = Command::new(bin())
        .args(["inspect", &junk.display().to_string()])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("junk.mid") && err.contains("not a valid MIDI"),
        "{err}"
    );

    // One bad file in a folder is skipped and reported; --strict makes it an error code.
    let dir = tmp.path().join("in");
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::copy("midi_samples/oneills-jig-6-8.mid", dir.join("a.MID")).unwrap();
    std::fs::copy(&junk, dir.join("b.mid")).unwrap();
    let ds = tmp.path().join("ds");
    let out = Command::new(bin())
        .args([
            "tokenize",
            &dir.display().to_string(),
            "-o",
            &ds.display().to_string(),
        ])
        .output()
        .unwrap();
    assert!(out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("b.mid"));
    let d = dataset::Dataset::open(&ds).unwrap();
    assert_eq!(d.pieces.len(), 1);
    assert_eq!(d.manifest.skipped.len(), 1);
    let out = Command::new(bin())
        .args([
            "tokenize",
            &dir.display().to_string(),
            "-o",
            &ds.display().to_string(),
            "--strict",
            // The folder now holds a dataset: replacing it needs --force.
            "--force",
        ])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));

    // A model folder that is not one.
    let out = Command::new(bin())
        .args([
            "generate",
            "--model",
            &tmp.path().display().to_string(),
            "-o",
            "x.mid",
        ])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("config.json"));

    // A bad flag value.
    let out = Command::new(bin())
        .args(["generate", "--model", "m", "-o", "x.mid", "--top-p", "abc"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));

    // encode / decode round trip through files.
    let toks = tmp.path().join("t.txt");
    let out = Command::new(bin())
        .args(["encode", "midi_samples/oneills-air-3-4.mid"])
        .output()
        .unwrap();
    std::fs::write(&toks, &out.stdout).unwrap();
    let mid = tmp.path().join("t.mid");
    let out = Command::new(bin())
        .args([
            "decode",
            &toks.display().to_string(),
            "-o",
            &mid.display().to_string(),
        ])
        .output()
        .unwrap();
    assert!(out.status.success());
    let (a, _) = midi::read_file(Path::new("midi_samples/oneills-air-3-4.mid")).unwrap();
    let (b, _) = midi::read_file(&mid).unwrap();
    assert_eq!(a.notes.len(), b.notes.len());
}

/// The model must be able to use its context at all: on pieces that repeat
/// one random pitch, a tiny FAVOR+/SineSPE model learns to copy the pitch of
/// an unseen piece from earlier in the sequence (an attention "phase change"
/// that needs about a thousand steps; before it, every pitch is a guess).
#[test]
fn tiny_spe_model_learns_to_copy_a_pitch_from_context() {
    let _rng = torch_rng();
    use cadenza::tokenizer::TokenType;
    let tmp = tempfile::tempdir().unwrap();
    let mdir = tmp.path().join("midi");
    std::fs::create_dir_all(&mdir).unwrap();
    let piece = |pitch: u8, notes: u64| {
        let mut s = midi::Score::new(480);
        for i in 0..notes {
            s.notes.push(midi::Note {
                start: i * 480,
                duration: 480,
                pitch,
                velocity: 80,
                program: 0,
                channel: 0,
                is_drum: false,
            });
        }
        s
    };
    for k in 0..200u64 {
        let s = piece(40 + ((k * 37) % 48) as u8, 40);
        midi::write_file(&s, &mdir.join(format!("p{k}.mid"))).unwrap();
    }
    let vocab = Vocab::new(Default::default()).unwrap();
    let files = dataset::collect_midi_files(&[mdir]).unwrap();
    let results = dataset::tokenize_files(&files, &vocab, &|| {});
    let data = tmp.path().join("data");
    dataset::write_dataset(&data, &vocab, &files, results).unwrap();
    let cfg = tmp.path().join("c.toml");
    std::fs::write(
        &cfg,
        "[train]\ntranspose = 0\nval_every = 500\ncheckpoint_every = 1500\n",
    )
    .unwrap();
    let run = tmp.path().join("run");
    train::train(&TrainOptions {
        run_dir: run.clone(),
        data: Some(data),
        preset: Some("tiny".into()),
        positional: Some("spe-sine".into()),
        config_file: Some(cfg),
        steps: Some(1500),
        seq_len: Some(128),
        batch: Some(8),
        threads: Some(1),
        // The thresholds below were measured in f32 (`auto` is bf16 where the CPU has
        // AMX or AVX512-BF16).
        precision: Some(cadenza::model::Precision::F32),
        ..Default::default()
    })
    .unwrap();
    let m = checkpoint::load_model(&run, tch::Device::Cpu).unwrap();
    let (body, _) = tokenizer::encode(&piece(61, 20), &vocab);
    let mut ids = vec![tokenizer::BOS_ID as i64];
    ids.extend(body.iter().map(|&t| t as i64));
    let x = tch::Tensor::from_slice(&ids).view([1, -1]);
    let p = m
        .model
        .forward_t(&x, 0, false)
        .squeeze_dim(0)
        .softmax(-1, tch::Kind::Float);
    let pitches = vocab.range(TokenType::Pitch);
    let probs: Vec<f64> = (0..ids.len() - 1)
        .filter(|&i| pitches.contains(&(ids[i + 1] as u32)))
        .map(|i| p.double_value(&[i as i64, ids[i + 1]]))
        .collect();
    // The first pitch is a guess (about 1/48); every later one is a copy.
    assert!(probs[0] < 0.1, "{probs:?}");
    let later = probs[4..].iter().sum::<f64>() / (probs.len() - 4) as f64;
    assert!(
        later > 0.3,
        "copied pitch probability {later:.3}: {probs:?}"
    );
}

#[test]
fn export_probe_writes_the_training_batches_and_eval_windows() {
    let tmp = tempfile::tempdir().unwrap();
    let data = dataset_dir(tmp.path());
    let probe = tmp.path().join("probe");
    let mut o = tiny_opts(&tmp.path().join("run"), &data, 5);
    o.stop_after = Some(3);
    train::export_probe(&o, &probe).unwrap();
    let meta: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(probe.join("meta.json")).unwrap()).unwrap();
    let (l, b) = (
        meta["seq_len"].as_u64().unwrap(),
        meta["batch"].as_u64().unwrap(),
    );
    assert_eq!((l, b, meta["steps"].as_u64().unwrap()), (64, 4, 3));
    let train_bytes = std::fs::read(probe.join("train.bin")).unwrap();
    assert_eq!(train_bytes.len() as u64, 3 * b * (l + 1) * 4);
    // The batches are the ones training draws.
    let ds = dataset::Dataset::open(&data).unwrap();
    let split = train::data::split(&ds, 1, 0.05);
    let vocab = Vocab::new(Default::default()).unwrap();
    let batcher = train::data::Batcher::new(&split.train, &vocab, 1, 6);
    let step2: Vec<u32> = batcher
        .batch(2, b as usize, l as usize + 1)
        .iter()
        .map(|&t| t as u32)
        .collect();
    let at = (2 * b * (l + 1) * 4) as usize;
    let got: Vec<u32> = train_bytes[at..]
        .chunks(4)
        .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect();
    assert_eq!(got, step2);
    // One validation window per held-out piece, with its context masks.
    let n = meta["val_windows"].as_u64().unwrap() as usize;
    assert_eq!(n, split.val.len());
    let ctx = std::fs::read(probe.join("val_ctx.bin")).unwrap();
    assert_eq!(ctx.len(), n * l as usize * 2);
    let first = &split.val[0].ids;
    let want = cadenza::eval::context_masks(first, &vocab, cadenza::eval::CONTEXT_BARS);
    let got: Vec<u16> = ctx[..l as usize * 2]
        .chunks(2)
        .map(|c| u16::from_le_bytes([c[0], c[1]]))
        .collect();
    let k = want.len().min(l as usize);
    assert_eq!(got[..k], want[..k]);
    // The folder is never overwritten.
    assert!(train::export_probe(&o, &probe).is_err());
}

#[test]
fn shipped_model_folder_has_the_files_hub_users_expect() {
    let dir = Path::new("models/cadenza-small");
    let card = std::fs::read_to_string(dir.join("README.md")).unwrap();
    let front = card
        .strip_prefix("---\n")
        .and_then(|rest| rest.split_once("\n---\n"))
        .map(|(front, _)| front)
        .expect("README.md starts with YAML front matter");
    for key in [
        "license:",
        "library_name:",
        "tags:",
        "datasets:",
        "pipeline_tag:",
    ] {
        assert!(
            front.lines().any(|l| l.starts_with(key)),
            "no {key} in {front}"
        );
    }
    assert!(!dir.join("MODEL_CARD.md").exists());
    // Its sampling defaults are generate's built-in ones, so the demo's
    // pieces do not change with the file.
    let (g, from) = checkpoint::read_generation_config(dir).unwrap();
    assert_eq!(g, checkpoint::GenerationConfig::default());
    assert_eq!(from, Some(dir.join(checkpoint::GENERATION_CONFIG_FILE)));
    // No path of the machine it was trained on.
    let cfg: train::config::RunConfig =
        checkpoint::read_json(&dir.join(checkpoint::CONFIG_FILE)).unwrap();
    assert!(!Path::new(&cfg.dataset).is_absolute(), "{}", cfg.dataset);
    for f in [
        checkpoint::CONFIG_FILE,
        checkpoint::GENERATION_CONFIG_FILE,
        "README.md",
    ] {
        let text = std::fs::read_to_string(dir.join(f)).unwrap();
        assert!(
            !text.contains("/work/") && !text.contains("/home/"),
            "{f} names a machine path"
        );
    }
}

#[test]
fn init_carries_the_weights_into_a_musical_rope_run_that_generates() {
    let _rng = torch_rng();
    let tmp = tempfile::tempdir().unwrap();
    let data = dataset_dir(tmp.path());
    let vocab = Vocab::new(Default::default()).unwrap();
    let cfg = tmp.path().join("music.toml");
    std::fs::write(
        &cfg,
        "[model]\nlocal_heads = 2\nlocal_window = 32\nlocal_position = \"rope\"\n\
         musical_rope = { bar_pairs = 2, position_pairs = 2 }\n[train]\npiece_starts = 0.5\n",
    )
    .unwrap();
    let mut a = tiny_opts(&tmp.path().join("a"), &data, 40);
    a.config_file = Some(cfg.clone());
    let sa = train::train(&a).unwrap();

    // one step at a vanishing rate from a's weights: b starts where a ended
    let still = tmp.path().join("still.toml");
    let text = std::fs::read_to_string(&cfg).unwrap() + "min_lr = 1e-10\nwarmup_steps = 0\n";
    std::fs::write(&still, text).unwrap();
    let mut b = tiny_opts(&tmp.path().join("b"), &data, 1);
    b.config_file = Some(still.clone());
    b.init = Some(tmp.path().join("a"));
    b.lr = Some(1e-9);
    let sb = train::train(&b).unwrap();
    let (va, vb) = (sa.last_val_loss.unwrap(), sb.last_val_loss.unwrap());
    assert!(
        (va - vb).abs() < 0.02 * va,
        "a ended at {va}, b from it at {vb}"
    );
    let uniform = (vocab.len() as f64).ln();
    assert!(vb < 0.6 * uniform, "{vb} against uniform {uniform}");
    // a's weights into a model that adds a write gate to its FAVOR+ heads (whose zero
    // start is the ungated model): it starts where a ended too
    let gate = tmp.path().join("gate.toml");
    let text = std::fs::read_to_string(&still).unwrap();
    std::fs::write(
        &gate,
        text.replace("[model]\n", "[model]\nfavor_write_gate = true\n"),
    )
    .unwrap();
    let mut g = tiny_opts(&tmp.path().join("g"), &data, 1);
    g.config_file = Some(gate);
    g.init = Some(tmp.path().join("a"));
    g.lr = Some(1e-9);
    let vg = train::train(&g).unwrap().last_val_loss.unwrap();
    assert!(
        (va - vg).abs() < 0.02 * va,
        "a ended at {va}, the gated run from it at {vg}"
    );
    // the same run from fresh weights is far behind
    let mut c = tiny_opts(&tmp.path().join("c"), &data, 1);
    c.config_file = Some(still);
    c.lr = Some(1e-9);
    let vc = train::train(&c).unwrap().last_val_loss.unwrap();
    assert!(vc > vb + 0.5, "fresh {vc} against init {vb}");

    let saved: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(tmp.path().join("b/config.json")).unwrap())
            .unwrap();
    assert!(saved["init"].as_str().unwrap().ends_with("a"), "{saved}");
    let m = &saved["model"]["musical_rope"];
    let r = vocab.range(tokenizer::TokenType::Position);
    assert_eq!(m["position_first"], r.start as i64);
    assert_eq!(m["positions"], (r.end - r.start) as i64);
    assert_eq!(saved["train"]["piece_starts"], 0.5);

    // the musical clock runs in the recurrence too: a piece comes out
    let piece = tmp.path().join("g.mid");
    let out = Command::new(bin())
        .args(["generate", "--model"])
        .arg(tmp.path().join("b"))
        .args(["--tokens", "80", "--device", "cpu", "-o"])
        .arg(&piece)
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    assert!(midi::read_file(&piece).is_ok());

    // window_bars: every window knows its bar; recorded, and refused without a table
    let bars = tmp.path().join("bars.toml");
    std::fs::write(
        &bars,
        "[model]\nbar_embedding = 8\n[train]\npiece_starts = 0.25\nwindow_bars = true\n",
    )
    .unwrap();
    let mut e = tiny_opts(&tmp.path().join("e"), &data, 3);
    e.config_file = Some(bars);
    assert!(train::train(&e).unwrap().last_val_loss.unwrap().is_finite());
    let saved: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(tmp.path().join("e/config.json")).unwrap())
            .unwrap();
    assert_eq!(saved["train"]["window_bars"], true);
    let lone = tmp.path().join("lone.toml");
    std::fs::write(&lone, "[train]\nwindow_bars = true\n").unwrap();
    let mut f = tiny_opts(&tmp.path().join("f"), &data, 1);
    f.config_file = Some(lone);
    let err = format!("{:#}", train::train(&f).unwrap_err());
    assert!(
        err.contains("window_bars") && err.contains("bar_embedding"),
        "{err}"
    );

    // a missing model is named
    let mut d = tiny_opts(&tmp.path().join("d"), &data, 1);
    d.init = Some(tmp.path().join("nowhere"));
    let err = format!("{:#}", train::train(&d).unwrap_err());
    assert!(err.contains("--init") && err.contains("nowhere"), "{err}");
}
