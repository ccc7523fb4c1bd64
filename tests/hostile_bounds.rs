//! Hostile configs and flags (issue 28, "configs and flags without bounds"):
//! every config field out of its range, every unknown key and every flag
//! past its bound is refused with an error naming the file or flag and the
//! field, before anything is allocated or created; the vocabulary and model
//! config loaders never panic on perturbed input (property runs).
//!
//! Commands run as child processes with a deadline (a hang or an abort is a
//! failure); the cases that need a trained run use the library.

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

use cadenza::midi;
use cadenza::model::ModelConfig;
use cadenza::tokenizer::{dataset, RemiConfig, Vocab};
use proptest::prelude::*;

/// The result of one child run.
struct Out {
    code: i32,
    stderr: String,
}

/// Runs `cadenza ARGS`, killed and failed past `deadline_s` seconds.
fn cadenza(args: &[&str], deadline_s: f64) -> Out {
    // a signal (an abort) has no code: -1 fails every assertion below
    let (code, stderr) = common::run_cadenza(args, deadline_s);
    Out { code, stderr }
}

/// Asserts a clean refusal (exit code 1, no panic or backtrace) whose
/// message holds every one of `needles`.
fn refused(out: &Out, needles: &[&str]) {
    assert_eq!(out.code, 1, "{}", out.stderr);
    assert!(
        !out.stderr.contains("panicked") && !out.stderr.contains("backtrace"),
        "{}",
        out.stderr
    );
    for n in needles {
        assert!(out.stderr.contains(n), "{n:?} missing from: {}", out.stderr);
    }
}

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

/// A few scales written as MIDI files into `dir/midi`, tokenized into `dir/data`.
fn scales_dataset(dir: &Path) -> PathBuf {
    common::scales_dataset(dir, "midi", 4, 50)
}

/// A model folder holding the shipped model's `config.json` changed by
/// `edit`, and its vocabulary (no weights: the config is refused first).
fn model_folder(dir: &Path, edit: impl Fn(&mut serde_json::Value)) -> PathBuf {
    let m = dir.join("model");
    std::fs::create_dir_all(&m).unwrap();
    let shipped = Path::new("models/cadenza-small");
    std::fs::copy(shipped.join("vocab.json"), m.join("vocab.json")).unwrap();
    let mut v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(shipped.join("config.json")).unwrap())
            .unwrap();
    edit(&mut v);
    std::fs::write(m.join("config.json"), v.to_string()).unwrap();
    m
}

#[test]
fn hostile_vocabulary_configs_are_refused_naming_file_and_field() {
    let tmp = tempfile::tempdir().unwrap();
    for (toml_text, field) in [
        ("tempo_ratio = 1.0000000001", "tempo_ratio"),
        (
            "exact_duration_quarters = 4294967295\nmax_duration_quarters = 4294967295",
            "exact_duration_quarters",
        ),
        (
            "tempo_min_bpm = 1e-300\ntempo_max_bpm = 1e300",
            "tempo_min_bpm",
        ),
        ("tempo_max_bpm = inf", "tempo_max_bpm"),
        ("tempo_ratio = nan", "tempo_ratio"),
        ("long_duration_ratio = -inf", "long_duration_ratio"),
        ("tempo_ratios = 1.1", "tempo_ratios"),
    ] {
        let cfg = tmp.path().join("bad.toml");
        std::fs::write(&cfg, toml_text).unwrap();
        let out = tmp.path().join("v.json");
        let r = cadenza(&["vocab", "--config", s(&cfg), "-o", s(&out)], 30.0);
        refused(&r, &["bad.toml", field]);
        assert!(!out.exists(), "{toml_text}: a vocabulary was written");
    }
}

#[test]
fn a_vocabulary_file_whose_size_or_keys_are_wrong_is_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let p = tmp.path().join("v.json");
    Vocab::new(RemiConfig::default()).unwrap().save(&p).unwrap();
    let good: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&p).unwrap()).unwrap();
    let load_with = |edit: &dyn Fn(&mut serde_json::Value)| {
        let mut v = good.clone();
        edit(&mut v);
        std::fs::write(&p, v.to_string()).unwrap();
        format!("{:#}", Vocab::load(&p).unwrap_err())
    };
    let e = load_with(&|v| v["size"] = serde_json::json!(878));
    assert!(
        e.contains("v.json") && e.contains("878") && e.contains("877"),
        "{e}"
    );
    let e = load_with(&|v| v["extra"] = serde_json::json!(1));
    assert!(e.contains("extra"), "{e}");
    // what `tempo_max_bpm = inf` once wrote
    let e = load_with(&|v| v["config"]["tempo_max_bpm"] = serde_json::Value::Null);
    assert!(e.contains("v.json"), "{e}");
    let e = load_with(&|v| v["config"]["tempo_ratio"] = serde_json::json!(1.0000000001));
    assert!(e.contains("v.json") && e.contains("tempo_ratio"), "{e}");
}

#[test]
fn a_tokens_file_one_byte_too_long_gives_the_byte_sizes() {
    let tmp = tempfile::tempdir().unwrap();
    let data = scales_dataset(tmp.path());
    let tokens = data.join(dataset::TOKENS_FILE);
    let n = std::fs::metadata(&tokens).unwrap().len();
    let mut f = std::fs::OpenOptions::new()
        .append(true)
        .open(&tokens)
        .unwrap();
    std::io::Write::write_all(&mut f, &[0]).unwrap();
    let e = format!("{:#}", dataset::Dataset::open(&data).err().unwrap());
    assert!(
        e.contains(&format!("{} bytes", n + 1)) && e.contains(&format!("{n} bytes")),
        "{e}"
    );
}

#[test]
fn hostile_model_configs_give_the_same_clear_error_from_generate_and_eval() {
    let tmp = tempfile::tempdir().unwrap();
    type Edit = fn(&mut serde_json::Value);
    let cases: [(Edit, &str); 8] = [
        (|v| v["model"]["n_layers"] = 100_000i64.into(), "n_layers"),
        (|v| v["model"]["d_model"] = (1i64 << 40).into(), "d_model"),
        (|v| v["model"]["d_ff"] = (1i64 << 40).into(), "d_ff"),
        (
            |v| v["model"]["attention"]["features"] = (1i64 << 40).into(),
            "attention.features",
        ),
        (
            |v| v["model"]["positional"]["realizations"] = (1i64 << 40).into(),
            "positional.realizations",
        ),
        (
            |v| v["model"]["positional"]["sines"] = (1i64 << 40).into(),
            "positional.sines",
        ),
        (|v| v["model"]["local_window"] = 1e15.into(), "local_window"),
        (|v| v["model"]["local_head"] = 2i64.into(), "local_head"),
    ];
    for (i, (edit, field)) in cases.iter().enumerate() {
        let dir = tmp.path().join(i.to_string());
        let m = model_folder(&dir, edit);
        let out = dir.join("out.mid");
        let g = cadenza(
            &[
                "generate",
                "--model",
                s(&m),
                "-o",
                s(&out),
                "--device",
                "cpu",
            ],
            30.0,
        );
        refused(&g, &["config.json", field]);
        assert!(!g.stderr.contains("--tokens"), "{}", g.stderr);
        let e = cadenza(&["eval", "--model", s(&m), "--device", "cpu"], 30.0);
        refused(&e, &["config.json", field]);
        assert!(!out.exists());
    }
    // the convolutional kernel too
    let m = model_folder(&tmp.path().join("conv"), |v| {
        v["model"]["positional"] = serde_json::json!({
            "kind": "spe-conv", "kernel": 1i64 << 40, "realizations": 32,
            "gated": true, "shared": true
        })
    });
    let g = cadenza(
        &[
            "generate",
            "--model",
            s(&m),
            "-o",
            s(&tmp.path().join("c.mid")),
        ],
        30.0,
    );
    refused(&g, &["config.json", "positional.kernel"]);
}

#[test]
fn hostile_training_configs_are_refused_naming_the_file_and_field() {
    let tmp = tempfile::tempdir().unwrap();
    for (i, (text, field)) in [
        ("[train]\ngrad_clip = nan", "grad_clip"),
        ("[train]\nweight_decay = nan", "weight_decay"),
        ("[train]\ngrad_clip = -1.0", "grad_clip"),
        ("[train]\nweight_decay = -0.5", "weight_decay"),
        ("[train]\neps = -1e-8", "eps"),
        ("[train]\neps = 0.0", "eps"),
        ("[train]\nlr = 1e-3\nmin_lr = 1e-2", "min_lr"),
        ("[model]\nlocal_head = 2", "local_head"),
        ("[model]\nn_layers = 100000", "n_layers"),
        ("[model]\nlocal_window = 1e15", "local_window"),
    ]
    .iter()
    .enumerate()
    {
        let cfg = tmp.path().join(format!("c{i}.toml"));
        std::fs::write(&cfg, text).unwrap();
        let run = tmp.path().join(format!("run{i}"));
        let r = cadenza(
            &[
                "train",
                "--config",
                s(&cfg),
                "--data",
                "midi_samples",
                "-o",
                s(&run),
                "--device",
                "cpu",
            ],
            30.0,
        );
        refused(&r, &[&format!("c{i}.toml"), field]);
        assert!(!run.join("config.json").exists(), "{text}");
        assert!(!run.join("train.lock").exists(), "{text}");
    }
}

#[test]
fn flags_past_their_bounds_are_refused_naming_the_flag() {
    let tmp = tempfile::tempdir().unwrap();
    let t = tmp.path();
    let run = t.join("run");
    let train = |extra: &[&str]| {
        let mut a = vec!["train", "--data", "midi_samples", "-o", s(&run)];
        a.extend_from_slice(extra);
        cadenza(&a, 30.0)
    };
    let r = train(&["--threads", "100000"]);
    refused(&r, &["--threads 100000", "1024"]);
    assert!(
        !run.exists(),
        "train made its folder before refusing --threads"
    );
    refused(&train(&["--stop-after", "0"]), &["--stop-after 0"]);
    assert!(!run.exists());
    refused(&train(&["--batch", "100000000"]), &["--batch"]);
    assert!(!run.join("train.lock").exists());
    refused(&train(&["--seq-len", "100000000"]), &["--seq-len"]);

    let m = model_folder(&t.join("m"), |_| {});
    for cmd in ["eval", "continue-eval"] {
        let r = cadenza(&[cmd, "--model", s(&m), "--threads", "100000"], 30.0);
        refused(&r, &["--threads 100000"]);
    }
    let out = t.join("g.mid");
    let generate = |extra: &[&str], deadline_s: f64| {
        let mut a = vec!["generate", "--model", s(&m), "-o", s(&out)];
        a.extend_from_slice(extra);
        cadenza(&a, deadline_s)
    };
    let r = generate(&["--num-samples", "10000000"], 10.0);
    refused(&r, &["--num-samples", "100000"]);
    refused(
        &generate(&["--threads", "100000"], 10.0),
        &["--threads 100000"],
    );
    let r = generate(&["--min-tokens", "100", "--tokens", "10"], 30.0);
    refused(&r, &["--min-tokens 100", "--tokens 10"]);
    assert!(!out.exists());
    for v in ["nan", "1", "-0.5"] {
        let flag = format!("--val-fraction={v}");
        let r = cadenza(
            &["stats", "midi_samples", "--real", "midi_samples", &flag],
            30.0,
        );
        refused(&r, &["--val-fraction"]);
    }

    // export-probe: checked before the probe folder exists
    let data = scales_dataset(&t.join("d"));
    for flag in ["--seq-len", "--batch", "--steps"] {
        let probe = t.join(format!("probe{flag}"));
        let r = cadenza(
            &[
                "export-probe",
                "--data",
                s(&data),
                "--preset",
                "tiny",
                flag,
                "100000000",
                "--probe",
                s(&probe),
            ],
            30.0,
        );
        refused(&r, &[flag]);
        assert!(!probe.exists(), "{flag}: the probe folder was made");
    }
}

#[test]
fn tokenize_clamps_its_worker_threads() {
    let tmp = tempfile::tempdir().unwrap();
    let mdir = tmp.path().join("midi");
    std::fs::create_dir_all(&mdir).unwrap();
    let mut sc = midi::Score::new(480);
    for i in 0..8u64 {
        sc.notes.push(midi::Note {
            start: i * 480,
            duration: 480,
            pitch: 60 + i as u8,
            velocity: 80,
            program: 0,
            channel: 0,
            is_drum: false,
        });
    }
    for k in 0..200 {
        midi::write_file(&sc, &mdir.join(format!("f{k}.mid"))).unwrap();
    }
    let out = tmp.path().join("data");
    let t0 = Instant::now();
    let r = cadenza(&["tokenize", s(&mdir), "-o", s(&out), "-j", "3000"], 60.0);
    assert_eq!(r.code, 0, "{}", r.stderr);
    assert!(out.join(dataset::MANIFEST_FILE).is_file());
    assert!(t0.elapsed().as_secs_f64() < 30.0);
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    assert_eq!(
        cadenza_core::commands::tokenize_threads(Some(3000), 20_000),
        4 * cores
    );
}

#[test]
fn resume_refuses_steps_and_stop_after_behind_the_checkpoint() {
    let tmp = tempfile::tempdir().unwrap();
    let data = scales_dataset(tmp.path());
    let run = tmp.path().join("run");
    let opts = cadenza::train::TrainOptions {
        run_dir: run.clone(),
        data: Some(data),
        preset: Some("tiny".into()),
        steps: Some(6),
        seq_len: Some(16),
        batch: Some(2),
        seed: Some(1),
        device: Some("cpu".into()),
        threads: Some(1),
        stop_after: Some(4),
        ..Default::default()
    };
    cadenza::train::train(&opts).unwrap();
    let config = std::fs::read(run.join("config.json")).unwrap();
    let resume = |steps: Option<u64>, extend: bool, stop_after: Option<u64>| {
        let o = cadenza::train::TrainOptions {
            run_dir: run.clone(),
            resume: true,
            steps,
            extend,
            stop_after,
            threads: Some(1),
            device: Some("cpu".into()),
            ..Default::default()
        };
        cadenza::train::train(&o)
    };
    let e = format!("{:#}", resume(Some(3), true, None).err().unwrap());
    assert!(
        e.contains("--extend --steps 3") && e.contains("step 4"),
        "{e}"
    );
    let e = format!("{:#}", resume(None, false, Some(2)).err().unwrap());
    assert!(e.contains("--stop-after 2") && e.contains("step 4"), "{e}");
    let e = format!("{:#}", resume(None, false, Some(4)).err().unwrap());
    assert!(e.contains("--stop-after 4"), "{e}");
    assert_eq!(std::fs::read(run.join("config.json")).unwrap(), config);
    assert!(!run.join("train.lock").exists());
    // a later step is fine
    let done = resume(None, false, Some(5)).unwrap();
    assert_eq!(done.steps_done, 5);
}

#[test]
fn the_generate_help_promises_what_it_does_for_tokens() {
    let out = Command::new(env!("CARGO_BIN_EXE_cadenza"))
        .args(["generate", "--help"])
        .output()
        .unwrap();
    let help = String::from_utf8_lossy(&out.stdout).replace(char::is_whitespace, " ");
    let help = help.split_whitespace().collect::<Vec<_>>().join(" ");
    assert!(!help.contains("exactly this many"), "{help}");
    assert!(help.contains("up to 4 tokens fewer"), "{help}");
}

#[test]
fn everything_shipped_loads() {
    for p in std::fs::read_dir("vocab").unwrap() {
        let p = p.unwrap().path();
        Vocab::load(&p).unwrap_or_else(|e| panic!("{}: {e:#}", p.display()));
    }
    let m = Path::new("models/cadenza-small");
    Vocab::load(&m.join("vocab.json")).unwrap();
    let c: cadenza::train::config::RunConfig =
        cadenza::util::read_json(&m.join("config.json")).unwrap();
    c.model.validate().unwrap();
    c.train.validate().unwrap();
    cadenza::train::checkpoint::read_generation_config(m).unwrap();
}

/// A JSON value that may be anything a hostile file holds.
fn arb_json() -> impl Strategy<Value = serde_json::Value> {
    use serde_json::json;
    prop_oneof![
        Just(serde_json::Value::Null),
        any::<bool>().prop_map(|b| json!(b)),
        any::<i64>().prop_map(|i| json!(i)),
        any::<u64>().prop_map(|i| json!(i)),
        (-1000i64..1000).prop_map(|i| json!(i)),
        any::<f64>()
            .prop_filter("JSON has no NaN or inf", |f| f.is_finite())
            .prop_map(|f| json!(f)),
        (0.5f64..4.0).prop_map(|f| json!(f)),
        "[a-z]{0,6}".prop_map(|s| json!(s)),
        prop::collection::vec(0u8..=200, 0..5).prop_map(|v| json!(v)),
        Just(json!({})),
    ]
}

/// Sets `key` of the object at `path` inside `v` (creating nothing else).
fn set(v: &mut serde_json::Value, path: &[&str], key: &str, x: serde_json::Value) {
    let mut at = v;
    for p in path {
        at = &mut at[*p];
    }
    if let Some(o) = at.as_object_mut() {
        o.insert(key.to_string(), x);
    }
}

const REMI_KEYS: &[&str] = &[
    "positions_per_quarter",
    "pitch_min",
    "pitch_max",
    "drum_pitch_min",
    "drum_pitch_max",
    "velocity_bins",
    "exact_duration_quarters",
    "max_duration_quarters",
    "long_duration_ratio",
    "tempo_min_bpm",
    "tempo_max_bpm",
    "tempo_ratio",
    "max_numerator",
    "denominators",
    "program_changes",
    "velocities",
    "default_velocity",
    "unknown_key",
];

const MODEL_KEYS: &[(&[&str], &str)] = &[
    (&[], "vocab_size"),
    (&[], "d_model"),
    (&[], "n_layers"),
    (&[], "n_heads"),
    (&[], "d_ff"),
    (&[], "dropout"),
    (&[], "chunk_size"),
    (&[], "short_conv"),
    (&[], "local_heads"),
    (&[], "local_window"),
    (&[], "local_position"),
    (&[], "tie_embeddings"),
    (&[], "no_such_key"),
    (&["positional"], "sines"),
    (&["positional"], "realizations"),
    (&["positional"], "kind"),
    (&["positional"], "kernel"),
    (&["attention"], "features"),
    (&["attention"], "redraw_prob"),
    (&["attention"], "kind"),
];

/// A score with a few notes and a tempo, for encoding with a random vocabulary.
fn small_score(us_per_quarter: u32) -> midi::Score {
    let mut sc = midi::Score::new(480);
    sc.tempos.push(midi::TempoChange {
        tick: 0,
        us_per_quarter,
    });
    for i in 0..6u64 {
        sc.notes.push(midi::Note {
            start: i * 700,
            duration: 100 + i * 5000,
            pitch: 30 + 15 * i as u8,
            velocity: 1 + 25 * i as u8,
            program: 0,
            channel: 0,
            is_drum: i == 5,
        });
    }
    sc
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 96, .. ProptestConfig::default() })]

    /// A vocabulary file with up to three config values replaced by anything
    /// loads or is refused; one that loads encodes a score without panicking.
    #[test]
    fn perturbed_vocabulary_files_load_or_fail_cleanly(
        edits in prop::collection::vec((0..REMI_KEYS.len(), arb_json()), 1..4),
        us in 1u32..20_000_000,
    ) {
        let tmp = tempfile::tempdir().unwrap();
        let p = tmp.path().join("v.json");
        Vocab::new(RemiConfig::default()).unwrap().save(&p).unwrap();
        let mut v: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&p).unwrap()).unwrap();
        for (k, x) in &edits {
            set(&mut v, &["config"], REMI_KEYS[*k], x.clone());
        }
        std::fs::write(&p, v.to_string()).unwrap();
        match Vocab::load(&p) {
            // only an edit that left the config as it was can load (the
            // token list and hash are the default's)
            Ok(voc) => prop_assert_eq!(voc.config(), &RemiConfig::default()),
            Err(e) => {
                let e = format!("{e:#}");
                prop_assert!(e.contains("v.json"), "{}", e);
            }
        }
        // the same config built directly: an accepted one works end to end
        if let Ok(cfg) = serde_json::from_value::<RemiConfig>(v["config"].clone()) {
            if let Ok(voc) = Vocab::new(cfg) {
                prop_assert!(voc.len() <= u16::MAX as usize);
                let (ids, _) = cadenza::tokenizer::encode(&small_score(us), &voc);
                prop_assert!(ids.iter().all(|&id| (id as usize) < voc.len()));
            }
        }
    }

    /// Random values for every numeric field of a tokenizer config: the
    /// config validates or not, and one that does builds a vocabulary
    /// within u16 ids whose tempo grid decodes every tempo.
    #[test]
    fn random_remi_configs_build_or_are_refused(
        ppq in 0u32..1000,
        exact in prop_oneof![0u32..40, Just(u32::MAX)],
        max in prop_oneof![0u32..2000, Just(u32::MAX)],
        long_ratio in prop_oneof![-1.0f64..20.0, Just(f64::NAN), Just(f64::INFINITY)],
        tmin in prop_oneof![1e-300f64..50.0, Just(0.0)],
        tmax in prop_oneof![10.0f64..20_000.0, Just(1e300), Just(f64::INFINITY)],
        tratio in prop_oneof![1.0f64..5.0, Just(1.000_000_000_1), Just(f64::NAN)],
        num in 0u8..80,
        dens in prop::collection::vec(0u8..130, 0..4),
        us in 1u32..20_000_000,
    ) {
        let cfg = RemiConfig {
            positions_per_quarter: ppq,
            exact_duration_quarters: exact,
            max_duration_quarters: max,
            long_duration_ratio: long_ratio,
            tempo_min_bpm: tmin,
            tempo_max_bpm: tmax,
            tempo_ratio: tratio,
            max_numerator: num,
            denominators: dens,
            ..RemiConfig::default()
        };
        if cfg.validate().is_ok() {
            let voc = Vocab::new(cfg.clone()).unwrap();
            prop_assert!(voc.len() <= u16::MAX as usize);
            prop_assert!(voc.num_tempos() >= 2);
            let (bin, _) = cfg.tempo_bin(us);
            prop_assert!((bin as usize) < voc.num_tempos());
            let (ids, _) = cadenza::tokenizer::encode(&small_score(us), &voc);
            prop_assert!(ids.iter().all(|&id| (id as usize) < voc.len()));
        } else {
            prop_assert!(Vocab::new(cfg).is_err());
        }
    }

    /// A model folder's config.json with up to three values replaced by
    /// anything: the loader refuses it naming the file, before any weights
    /// (the folder has none), and a config it accepts is within the bound.
    #[test]
    fn perturbed_model_configs_load_or_fail_cleanly(
        edits in prop::collection::vec((0..MODEL_KEYS.len(), arb_json()), 1..4),
    ) {
        let tmp = tempfile::tempdir().unwrap();
        let m = model_folder(tmp.path(), |v| {
            for (k, x) in &edits {
                let (path, key) = MODEL_KEYS[*k];
                let mut full = vec!["model"];
                full.extend_from_slice(path);
                set(v, &full, key, x.clone());
            }
        });
        let e = cadenza::train::checkpoint::load_model(&m, tch::Device::Cpu)
            .err()
            .expect("a folder without weights never loads");
        let e = format!("{e:#}");
        prop_assert!(e.contains(s(&m)), "{}", e);
        let text = std::fs::read_to_string(m.join("config.json")).unwrap();
        let v: serde_json::Value = serde_json::from_str(&text).unwrap();
        if let Ok(c) = serde_json::from_value::<ModelConfig>(v["model"].clone()) {
            if c.validate().is_ok() {
                prop_assert!(c.estimated_values() <= cadenza::model::config::bounds::MAX_VALUES);
            }
        }
    }
}
