//! Model benchmark (harness = false): prints markdown tables.
//!
//! 1. forward+backward training-step throughput (tokens/s), FAVOR+ vs softmax, batch 1;
//! 2. peak resident memory (VmHWM of a child process) of one forward+backward at a long length;
//! 3. recurrent `step` latency (microseconds per token) at several absolute positions.
//!
//! Environment knobs (defaults in brackets):
//! CADENZA_BENCH_PRESET [small], CADENZA_BENCH_LENS [512,1024,2048], CADENZA_BENCH_STEPS [2],
//! CADENZA_BENCH_MEM_LEN [3072], CADENZA_BENCH_POSITIONS [0,1024,3072],
//! CADENZA_BENCH_STEP_TOKENS [32], CADENZA_BENCH_POSITIONAL [spe-sine],
//! CADENZA_BENCH_SOFTMAX [1] (0 skips the softmax rows), CADENZA_BENCH_THREADS [torch default].
//! Timings are best-of (training) and median (steps) to resist other load on small machines.

use std::time::Instant;

use cadenza::model::{AttentionKind, ModelConfig, Transformer};
use tch::{nn, Device, Kind, Tensor};

const VOCAB: i64 = 333;
const CHILD_ENV: &str = "CADENZA_BENCH_CHILD";

fn env_or(name: &str, default: &str) -> String {
    std::env::var(name).unwrap_or_else(|_| default.to_string())
}

fn env_list(name: &str, default: &str) -> Vec<i64> {
    env_or(name, default)
        .split(',')
        .filter(|s| !s.trim().is_empty())
        .map(|s| s.trim().parse().expect(name))
        .collect()
}

fn config(attn: &str) -> ModelConfig {
    let preset = env_or("CADENZA_BENCH_PRESET", "small");
    let mut cfg = ModelConfig::preset(&preset, VOCAB)
        .unwrap()
        .with_positional(&env_or("CADENZA_BENCH_POSITIONAL", "spe-sine"))
        .unwrap();
    if attn == "softmax" {
        cfg.attention = AttentionKind::Softmax;
    }
    cfg
}

fn random_tokens(b: i64, l: i64) -> Tensor {
    Tensor::randint(VOCAB, [b, l], (Kind::Int64, Device::Cpu))
}

/// One forward+backward at length l; returns seconds.
fn train_step(vs: &nn::VarStore, m: &Transformer, l: i64) -> f64 {
    let toks = random_tokens(1, l + 1);
    let t0 = Instant::now();
    let logits = m.forward_t(&toks.narrow(1, 0, l), 0, true);
    let loss = logits
        .reshape([-1, VOCAB])
        .cross_entropy_for_logits(&toks.narrow(1, 1, l).reshape([-1]));
    loss.backward();
    let dt = t0.elapsed().as_secs_f64();
    for v in vs.trainable_variables() {
        let mut g = v.grad();
        if g.defined() {
            let _ = g.zero_();
        }
    }
    dt
}

fn vm_kb(field: &str) -> i64 {
    let s = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    s.lines()
        .find(|l| l.starts_with(field))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|v| v.parse().ok())
        .unwrap_or(-1)
}

/// Child process: build the model, record RSS, run one forward+backward, print the peak.
fn memory_child(spec: &str) {
    let mut it = spec.split(':');
    let attn = it.next().unwrap();
    let l: i64 = it.next().unwrap().parse().unwrap();
    tch::manual_seed(0);
    let vs = nn::VarStore::new(Device::Cpu);
    let m = Transformer::new(&vs.root(), &config(attn)).unwrap();
    let base = vm_kb("VmRSS:");
    let dt = train_step(&vs, &m, l);
    println!(
        "RESULT base_kb={base} hwm_kb={} secs={dt:.3}",
        vm_kb("VmHWM:")
    );
}

fn main() {
    if let Ok(t) = std::env::var("CADENZA_BENCH_THREADS") {
        tch::set_num_threads(t.parse().expect("CADENZA_BENCH_THREADS"));
    }
    if let Ok(spec) = std::env::var(CHILD_ENV) {
        memory_child(&spec);
        return;
    }
    // `cargo bench` passes "--bench"; nothing else is accepted.
    let lens = env_list("CADENZA_BENCH_LENS", "512,1024,2048");
    let steps = env_list("CADENZA_BENCH_STEPS", "2")[0].max(1);
    let mem_len = env_list("CADENZA_BENCH_MEM_LEN", "3072")[0];
    let positions = env_list("CADENZA_BENCH_POSITIONS", "0,1024,3072");
    let step_tokens = env_list("CADENZA_BENCH_STEP_TOKENS", "32")[0].max(1);
    let with_softmax = env_or("CADENZA_BENCH_SOFTMAX", "1") != "0";
    let attns: Vec<&str> = if with_softmax {
        vec!["favor", "softmax"]
    } else {
        vec!["favor"]
    };
    let cfg = config("favor");
    println!(
        "# cadenza model benchmark\n\npreset {} (d_model {}, {} layers, {} heads, d_ff {}), positional {}, {} torch threads, CPU\n",
        env_or("CADENZA_BENCH_PRESET", "small"),
        cfg.d_model,
        cfg.n_layers,
        cfg.n_heads,
        cfg.d_ff,
        cfg.positional.name(),
        tch::get_num_threads()
    );

    // 1. training throughput
    println!("## Training step (forward+backward, batch 1)\n");
    println!("| attention | L | s/step (best of {steps}) | tokens/s |\n|---|---:|---:|---:|");
    for attn in &attns {
        tch::manual_seed(0);
        let vs = nn::VarStore::new(Device::Cpu);
        let m = Transformer::new(&vs.root(), &config(attn)).unwrap();
        for &l in &lens {
            train_step(&vs, &m, l); // warm-up
                                    // best of `steps`: robust to other processes sharing the (small) machine
            let per = (0..steps)
                .map(|_| train_step(&vs, &m, l))
                .fold(f64::INFINITY, f64::min);
            println!("| {attn} | {l} | {per:.3} | {:.0} |", l as f64 / per);
        }
    }

    // 2. peak memory in child processes
    println!("\n## Peak memory, forward+backward at L={mem_len} (child process VmHWM)\n");
    println!("| attention | RSS after build (MiB) | peak RSS (MiB) | peak - build (MiB) | s |\n|---|---:|---:|---:|---:|");
    let exe = std::env::current_exe().unwrap();
    for attn in &attns {
        let out = std::process::Command::new(&exe)
            .env(CHILD_ENV, format!("{attn}:{mem_len}"))
            .output();
        match out {
            Ok(o) if o.status.success() => {
                let s = String::from_utf8_lossy(&o.stdout);
                let line = s.lines().find(|l| l.starts_with("RESULT")).unwrap_or("");
                let get = |k: &str| -> f64 {
                    line.split_whitespace()
                        .find_map(|kv| kv.strip_prefix(k))
                        .and_then(|v| v.parse().ok())
                        .unwrap_or(f64::NAN)
                };
                let (base, hwm, secs) = (
                    get("base_kb=") / 1024.0,
                    get("hwm_kb=") / 1024.0,
                    get("secs="),
                );
                println!(
                    "| {attn} | {base:.0} | {hwm:.0} | {:.0} | {secs:.2} |",
                    hwm - base
                );
            }
            Ok(o) => println!(
                "| {attn} | failed: {} | | | |",
                String::from_utf8_lossy(&o.stderr)
                    .lines()
                    .last()
                    .unwrap_or("")
            ),
            Err(e) => println!("| {attn} | could not spawn: {e} | | | |"),
        }
    }

    // 3. recurrent step latency
    println!("\n## Recurrent step latency (batch 1, median of {step_tokens} steps per position)\n");
    println!("| attention | position | us/token |\n|---|---:|---:|");
    for attn in &attns {
        tch::manual_seed(0);
        let vs = nn::VarStore::new(Device::Cpu);
        let mut m = Transformer::new(&vs.root(), &config(attn)).unwrap();
        m.freeze(1);
        for &p in &positions {
            let mut st = m.begin(1);
            let mut done = 0;
            while done < p {
                let n = (p - done).min(1024);
                let _ = m.prefill(&random_tokens(1, n), &mut st);
                done += n;
            }
            for _ in 0..3 {
                let _ = m.step(&random_tokens(1, 1).view([1]), &mut st); // warm-up
            }
            let toks: Vec<Tensor> = (0..step_tokens)
                .map(|_| random_tokens(1, 1).view([1]))
                .collect();
            let mut times: Vec<f64> = toks
                .iter()
                .map(|t| {
                    let t0 = Instant::now();
                    let _ = m.step(t, &mut st);
                    t0.elapsed().as_secs_f64() * 1e6
                })
                .collect();
            times.sort_by(|a, b| a.partial_cmp(b).unwrap());
            let us = times[times.len() / 2]; // median
            println!("| {attn} | {p} | {us:.0} |");
        }
    }
}
