//! `cadenza eval --context-cut` and `--ablate` end to end: a tiny run with local and
//! FAVOR+ heads, evaluated by the binary, the JSON report read back.

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;

use cadenza_core::midi;
use common::{bin, run_cadenza, scales_dataset};

/// A 2-step tiny run on `data`; `local`: with 2 RoPE local heads of 16 tokens.
fn tiny_run(dir: &Path, data: &Path, local: bool) -> PathBuf {
    // libtorch's generator is global to the process: the two runs take turns
    static TORCH: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let _turn = TORCH.lock().unwrap_or_else(|e| e.into_inner());
    std::fs::create_dir_all(dir).unwrap();
    let cfg = dir.join("c.toml");
    let model = if local {
        "[model]\nlocal_heads = 2\nlocal_window = 16\nlocal_position = \"rope\"\n"
    } else {
        ""
    };
    std::fs::write(&cfg, format!("{model}[train]\ntranspose = 0\n")).unwrap();
    let run = dir.join("run");
    cadenza::train::train(&cadenza::train::TrainOptions {
        run_dir: run.clone(),
        data: Some(data.to_path_buf()),
        preset: Some("tiny".into()),
        config_file: Some(cfg),
        steps: Some(2),
        seq_len: Some(16),
        batch: Some(2),
        seed: Some(1),
        device: Some("cpu".into()),
        threads: Some(1),
        ..Default::default()
    })
    .unwrap();
    run
}

/// `cadenza eval` on `run` over `data` (96 positions) with `extra` flags, the report
/// written to `json`: (stdout, the report).
fn eval(run: &Path, data: &Path, json: &Path, extra: &[&str]) -> (String, serde_json::Value) {
    eval_len(run, data, json, 96, extra)
}

/// [`eval`] over the first `max_len` tokens of every piece.
fn eval_len(
    run: &Path,
    data: &Path,
    json: &Path,
    max_len: usize,
    extra: &[&str],
) -> (String, serde_json::Value) {
    let s = |p: &Path| p.to_str().unwrap().to_string();
    let mut args = vec![
        "eval".to_string(),
        "--model".into(),
        s(run),
        "--data".into(),
        s(data),
        "--max-len".into(),
        max_len.to_string(),
        "--bin".into(),
        "32".into(),
        "--device".into(),
        "cpu".into(),
        "--threads".into(),
        "1".into(),
        "--json".into(),
        s(json),
    ];
    args.extend(extra.iter().map(|a| a.to_string()));
    let out = Command::new(bin()).args(&args).output().unwrap();
    assert!(
        out.status.success(),
        "cadenza {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let report = serde_json::from_str(&std::fs::read_to_string(json).unwrap()).unwrap();
    (String::from_utf8(out.stdout).unwrap(), report)
}

#[test]
fn context_gain_and_ablation_reports() {
    let tmp = tempfile::tempdir().unwrap();
    let data = scales_dataset(tmp.path(), "scales", 4, 50);
    let run = tiny_run(&tmp.path().join("local"), &data, true);
    // every piece, tokenized from its MIDI file (the dataset itself would give the
    // run's held-out split)
    let data = tmp.path().join("scales");

    let (_, plain) = eval(&run, &data, &tmp.path().join("plain.json"), &[]);
    assert!(plain.get("context_gain").is_none() && plain.get("ablate").is_none());

    let (out, r) = eval(
        &run,
        &data,
        &tmp.path().join("gain.json"),
        &[
            "--context-cut",
            "8,4",
            "--context-from",
            "32",
            "--context-stride",
            "8",
        ],
    );
    let g = &r["context_gain"];
    assert_eq!(
        (g["from"].as_u64(), g["stride"].as_u64()),
        (Some(32), Some(8))
    );
    // positions 32, 40, ..., 96 (up to --max-len) in each of the 4 pieces
    assert_eq!(g["positions"].as_u64(), Some(4 * 9), "{g}");
    assert_eq!(g["pieces"].as_u64(), Some(4));
    let full = g["full"].as_f64().unwrap();
    assert!(full.is_finite() && full > 0.0);
    for c in ["4", "8"] {
        let v = g["cut"][c].as_f64().unwrap();
        assert!(v.is_finite() && v > 0.0, "cut {c}: {v}");
        assert!((g["ratio"][c].as_f64().unwrap() - v / full).abs() < 1e-9);
    }
    let by_type = g["by_type"].as_object().unwrap();
    assert!(by_type.contains_key("Pitch"), "{g}");
    let n: u64 = by_type
        .values()
        .map(|t| t["positions"].as_u64().unwrap())
        .sum();
    assert_eq!(n, 36);
    assert!(
        out.contains("context gain") && out.contains("last 4"),
        "{out}"
    );
    // the rest of the report is the plain one
    assert_eq!(r["loss"], plain["loss"]);

    for (which, other) in [("favor", "local"), ("local", "favor")] {
        let (out, a) = eval(
            &run,
            &data,
            &tmp.path().join(format!("{which}.json")),
            &["--ablate", which],
        );
        assert_eq!(a["ablate"].as_str(), Some(which));
        assert!(out.contains(&format!("the {which} heads")), "{out}");
        let (l, p) = (a["loss"].as_f64().unwrap(), plain["loss"].as_f64().unwrap());
        assert!(
            (l - p).abs() > 1e-6,
            "--ablate {which} did not change the loss ({l})"
        );
        assert_ne!(Some(other), a["ablate"].as_str());
    }
}

#[test]
fn bad_context_and_ablation_flags_are_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let data = scales_dataset(tmp.path(), "scales", 2, 50);
    let run = tiny_run(&tmp.path().join("plain"), &data, false);
    let (r, d) = (run.to_str().unwrap(), data.to_str().unwrap());
    let base = [
        "eval",
        "--model",
        r,
        "--data",
        d,
        "--device",
        "cpu",
        "--threads",
        "1",
    ];
    let refused = |extra: &[&str], words: &[&str]| {
        let args: Vec<&str> = base.iter().chain(extra).copied().collect();
        let (code, err) = run_cadenza(&args, 60.0);
        assert!(code != 0 && code != -1, "{extra:?}: exit {code}");
        for w in words {
            assert!(err.contains(w), "{extra:?}: {w:?} not in {err}");
        }
        assert!(!err.contains("panicked"), "{err}");
    };
    refused(&["--context-cut", "0"], &["--context-cut 0", "at least 1"]);
    refused(
        &["--context-cut", "40", "--context-from", "32"],
        &["--context-cut 40", "--context-from 32"],
    );
    refused(
        &["--context-cut", "4", "--context-stride", "0"],
        &["--context-stride 0"],
    );
    refused(
        &[
            "--context-cut",
            "4",
            "--context-from",
            "500",
            "--max-len",
            "96",
        ],
        &["--context-from 500", "--max-len 96"],
    );
    refused(&["--context-cut", "x"], &["--context-cut"]);
    refused(
        &["--ablate", "favor"],
        &["--ablate favor", "no local heads"],
    );
    refused(
        &["--ablate", "local"],
        &["--ablate local", "no local heads"],
    );
    refused(&["--ablate", "mlp"], &["--ablate"]);
}

/// `--max-len` sizes nothing: any number is scored like the pieces' own length (it once
/// sized two buffers of that many positions, and a huge one aborted the process).
#[test]
fn a_huge_max_len_scores_like_the_pieces_own_length() {
    let tmp = tempfile::tempdir().unwrap();
    let data = scales_dataset(tmp.path(), "scales", 2, 50);
    let run = tiny_run(&tmp.path().join("plain"), &data, false);
    let (_, whole) = eval_len(&run, &data, &tmp.path().join("a.json"), 100_000, &[]);
    let (_, huge) = eval_len(&run, &data, &tmp.path().join("b.json"), usize::MAX, &[]);
    assert!(whole["bins"].as_array().is_some_and(|b| !b.is_empty()));
    for key in ["bins", "mean_within", "pieces"] {
        assert_eq!(whole[key], huge[key], "{key}");
    }
}

/// MIDI files of `bars` bars of 4/4 each, bar b playing the figure of bar b mod `period`
/// (eighth notes; each figure its own pitches).
fn periodic_pieces(dir: &Path, pieces: u8, bars: u64, period: u64) -> PathBuf {
    std::fs::create_dir_all(dir).unwrap();
    for k in 0..pieces {
        let mut sc = midi::Score::new(480);
        for b in 0..bars {
            let figure = (b % period) as u8;
            for i in 0..8u64 {
                sc.notes.push(midi::Note {
                    start: (b * 8 + i) * 240,
                    duration: 240,
                    pitch: 50 + k + 3 * figure + [0u8, 4, 7, 12, 7, 4, 2, 5][i as usize],
                    velocity: 80,
                    program: 0,
                    channel: 0,
                    is_drum: false,
                });
            }
        }
        midi::write_file(&sc, &dir.join(format!("p{k}.mid"))).unwrap();
    }
    dir.to_path_buf()
}

#[test]
fn the_return_probe_sorts_returning_and_fresh_bars() {
    let tmp = tempfile::tempdir().unwrap();
    let data = scales_dataset(tmp.path(), "scales", 2, 50);
    let run = tiny_run(&tmp.path().join("run"), &data, false);
    // 4 different bars, then bars 1-4 again: bars 0-3 fresh (no earlier bar like them),
    // bars 4-7 returning (the same bar 4 back), bar 4 entering the return and 5-7
    // continuing it
    let midi = periodic_pieces(&tmp.path().join("periodic"), 2, 8, 4);
    let (out, r) = eval_len(&run, &midi, &tmp.path().join("r.json"), 1000, &[]);
    let p = &r["returns"];
    assert_eq!(p["min_lag"].as_u64(), Some(4), "{p}");
    let n = |k: &str| p[k]["tokens"].as_u64().unwrap();
    let total = r["tokens"].as_u64().unwrap();
    assert!(n("fresh") > 0 && n("returning") > 0, "{p}");
    assert_eq!(n("entering") + n("continuing"), n("returning"));
    assert!(
        n("continuing") > n("entering"),
        "three continuing bars per entering one"
    );
    // every scored token of these pieces is in a fresh or a returning bar, but for the
    // few before the first bar line
    assert!(n("fresh") + n("returning") <= total && n("fresh") + n("returning") + 8 > total);
    // one entering bar per piece, and its first pitch alone in entry_pitch
    assert_eq!(n("entry_pitch"), 2, "{p}");
    assert_eq!(
        p["entry_pitch"]["by_type"]["Pitch"]["count"].as_u64(),
        Some(2)
    );
    assert!(
        out.contains("returning (exact copy >= 4 bars back)"),
        "{out}"
    );
}
