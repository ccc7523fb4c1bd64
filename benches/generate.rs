//! Generation benchmark (harness = false): prints a markdown table.
//!
//! For the `small` preset (random weights: speed does not depend on them) on
//! the CPU: tokens/s at batch 1 and 8 for pieces of 1,024, 3,072 and 16,384
//! tokens, the time per token over the first and the last 512 tokens, and the
//! peak memory of each run (VmHWM of a child process). Then the reference
//! implementation's way, recomputing the whole prefix for every token, at
//! 3,072 tokens: timed at prefix lengths spread over 0..3,072 and integrated
//! (timing all 3,072 full forwards would take a long time on 2 cores).
//!
//! Knobs: CADENZA_BENCH_PRESET [small], CADENZA_BENCH_LENGTHS [1024,3072,16384],
//! CADENZA_BENCH_BATCHES [1,8], CADENZA_BENCH_RECOMPUTE_POINTS [8],
//! CADENZA_BENCH_LOCAL_HEADS [0; the shipped model has 2 local softmax heads
//! over 512 tokens with RoPE], CADENZA_BENCH_LOCAL_WINDOW [128],
//! CADENZA_BENCH_LOCAL_POSITION [shared; `rope` for the shipped model],
//! CADENZA_BENCH_PRECISIONS [f32; a comma list of f32, bf16: each length and batch runs
//! once per precision, in that order, so that the rows of a pair are alternated].

use std::time::Instant;

use cadenza::model::{ModelConfig, Precision, Transformer};
use cadenza::sample::{self, SampleConfig};
use cadenza::tokenizer::{Vocab, BOS_ID};
use tch::{nn, Device, Tensor};

const CHILD: &str = "CADENZA_BENCH_GEN_CHILD";

fn env_list(name: &str, default: &str) -> Vec<usize> {
    std::env::var(name)
        .unwrap_or_else(|_| default.to_string())
        .split(',')
        .filter_map(|s| s.trim().parse().ok())
        .collect()
}

fn peak_kb() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmHWM:"))
                .and_then(|l| l.split_whitespace().nth(1)?.parse().ok())
        })
        .unwrap_or(0)
}

/// An integer knob from the environment, `default` when unset or not a number.
fn knob(name: &str, default: i64) -> i64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(default)
}

/// Whether the local heads use RoPE (CADENZA_BENCH_LOCAL_POSITION=rope).
fn rope_knob() -> bool {
    std::env::var("CADENZA_BENCH_LOCAL_POSITION").as_deref() == Ok("rope")
}

/// The precisions of CADENZA_BENCH_PRECISIONS (default f32).
fn precisions() -> Vec<Precision> {
    let raw = std::env::var("CADENZA_BENCH_PRECISIONS").unwrap_or_else(|_| "f32".into());
    raw.split(',')
        .map(|p| match p.trim() {
            "f32" => Precision::F32,
            "bf16" => Precision::Bf16,
            other => panic!("CADENZA_BENCH_PRECISIONS: {other:?} is neither f32 nor bf16"),
        })
        .collect()
}

fn model(preset: &str, vocab: &Vocab) -> (nn::VarStore, Transformer) {
    tch::manual_seed(0);
    let vs = nn::VarStore::new(Device::Cpu);
    let mut cfg = ModelConfig::preset(preset, vocab.len() as i64).expect("preset");
    cfg.local_heads = knob("CADENZA_BENCH_LOCAL_HEADS", 0);
    cfg.local_window = knob("CADENZA_BENCH_LOCAL_WINDOW", 128);
    if rope_knob() {
        cfg.local_position = cadenza::model::LocalPosition::Rope;
    }
    cfg.validate().expect("local heads");
    let mut m = Transformer::new(&vs.root(), &cfg).expect("model");
    m.freeze(1);
    (vs, m)
}

/// One run in this process: prints "tokens_per_s first_us last_us peak_kb".
fn child(spec: &str) {
    let mut it = spec.split(',');
    let preset = it.next().unwrap_or("small").to_string();
    let len: usize = it.next().and_then(|s| s.parse().ok()).unwrap_or(1024);
    let batch: usize = it.next().and_then(|s| s.parse().ok()).unwrap_or(1);
    let precision = match it.next() {
        Some("bf16") => Precision::Bf16,
        _ => Precision::F32,
    };
    cadenza::train::set_threads(0);
    let vocab = Vocab::new(Default::default()).expect("vocab");
    let (_vs, mut m) = model(&preset, &vocab);
    m.set_precision(precision);
    // Grammar-constrained, EOS forbidden (the default), so that every run makes `len` tokens.
    let cfg = SampleConfig {
        max_tokens: len,
        constrained: true,
        temperature: 1.0,
        top_p: 1.0,
        ..Default::default()
    };
    let mut stamps = Vec::with_capacity(len + 1);
    let t0 = Instant::now();
    stamps.push(t0);
    let samples = sample::generate(&m, &vocab, &[BOS_ID], batch, &cfg, &mut |_| {
        stamps.push(Instant::now())
    })
    .expect("generate");
    let total = t0.elapsed().as_secs_f64();
    let made = stamps.len() - 1;
    let per =
        |a: usize, b: usize| (stamps[b] - stamps[a]).as_secs_f64() * 1e6 / (b - a).max(1) as f64;
    let w = 512.min(made / 2).max(1);
    let first = per(0, w);
    let last = per(made - w, made);
    let _ = samples;
    println!(
        "{} {} {} {} {}",
        made as f64 * batch as f64 / total,
        first,
        last,
        peak_kb(),
        made
    );
}

fn main() {
    if let Ok(spec) = std::env::var(CHILD) {
        child(&spec);
        return;
    }
    let preset = std::env::var("CADENZA_BENCH_PRESET").unwrap_or_else(|_| "small".into());
    let lengths = env_list("CADENZA_BENCH_LENGTHS", "1024,3072,16384");
    let batches = env_list("CADENZA_BENCH_BATCHES", "1,8");
    let exe = std::env::current_exe().expect("exe");
    // the value the model is built with, not the raw variable
    let local = knob("CADENZA_BENCH_LOCAL_HEADS", 0);
    let window = knob("CADENZA_BENCH_LOCAL_WINDOW", 128);
    let rope = rope_knob();
    let local = if local > 0 {
        format!(
            "{local} local heads over {window} tokens{}",
            if rope { " with RoPE" } else { "" }
        )
    } else {
        "FAVOR+ in every head".to_string()
    };
    println!(
        "## Recurrent generation, preset `{preset}`, {local}, CPU ({} threads)\n",
        tch::get_num_threads()
    );
    println!("| tokens | batch | weights | tokens/s (all sequences) | us/token first 512 | us/token last 512 | last/first | peak RSS |");
    println!("| --- | --- | --- | --- | --- | --- | --- | --- |");
    let mut per_token_3072 = None;
    for &len in &lengths {
        for &b in &batches {
            for p in precisions() {
                let out = std::process::Command::new(&exe)
                    .env(CHILD, format!("{preset},{len},{b},{p}"))
                    .output()
                    .expect("child");
                let text = String::from_utf8_lossy(&out.stdout);
                let v: Vec<f64> = text
                    .split_whitespace()
                    .filter_map(|s| s.parse().ok())
                    .collect();
                if v.len() < 5 {
                    println!(
                        "| {len} | {b} | {p} | failed: {} |",
                        String::from_utf8_lossy(&out.stderr).trim()
                    );
                    continue;
                }
                println!(
                    "| {len} | {b} | {p} | {:.0} | {:.0} | {:.0} | {:.2} | {:.0} MB |",
                    v[0],
                    v[1],
                    v[2],
                    v[2] / v[1],
                    v[3] / 1024.0
                );
                if len == 3072 && b == 1 && p == Precision::F32 {
                    per_token_3072 = Some(1e6 / v[0]);
                }
            }
        }
    }

    // The reference's way: a full forward over the prefix for every token.
    let points = env_list("CADENZA_BENCH_RECOMPUTE_POINTS", "8")[0].max(2);
    let vocab = Vocab::new(Default::default()).expect("vocab");
    let (_vs, m) = model(&preset, &vocab);
    let target = 3072usize;
    let mut xs = Vec::new();
    let mut ys = Vec::new();
    for i in 0..points {
        let l = 1 + i * (target - 1) / (points - 1);
        let ids = Tensor::zeros([1, l as i64], (tch::Kind::Int64, Device::Cpu));
        let t0 = Instant::now();
        let _ = tch::no_grad(|| m.forward_t(&ids, 0, false));
        xs.push(l as f64);
        ys.push(t0.elapsed().as_secs_f64());
    }
    // Trapezoid over prefix lengths 1..=3072.
    let mut total = 0.0;
    for i in 1..xs.len() {
        total += (xs[i] - xs[i - 1]) * (ys[i] + ys[i - 1]) / 2.0;
    }
    println!(
        "\n## Recomputing the prefix for every token (the reference), {target} tokens, batch 1\n"
    );
    println!("| prefix length | one full forward |\n| --- | --- |");
    for (x, y) in xs.iter().zip(&ys) {
        println!("| {x:.0} | {:.1} ms |", y * 1e3);
    }
    let per = total / target as f64 * 1e6;
    println!(
        "\nestimated: {:.0} s for {target} tokens ({per:.0} us/token)",
        total
    );
    if let Some(rec) = per_token_3072 {
        println!(
            "recurrent sampler at {target} tokens: {rec:.0} us/token; speed-up {:.1}x",
            per / rec
        );
    }
}
