//! `cadenza eval --context-cut` and `--ablate` end to end: a tiny run with local and
//! FAVOR+ heads, evaluated by the binary, the JSON report read back.

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;

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
    let s = |p: &Path| p.to_str().unwrap().to_string();
    let mut args = vec![
        "eval".to_string(),
        "--model".into(),
        s(run),
        "--data".into(),
        s(data),
        "--max-len".into(),
        "96".into(),
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
