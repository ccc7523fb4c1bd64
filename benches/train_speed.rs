//! Training-step throughput and peak memory of one configuration
//! (harness = false), for `scripts/bench-vs-pytorch.sh`.
//!
//! ```text
//! cargo bench --bench train_speed -- --len 512 --batch 8 [--steps 3] [--threads 2]
//!     [--preset small] [--vocab 845] [--attention favor|softmax] [--positional spe-sine]
//!     [--chunk C] [--local-heads N] [--local-window W] [--precision f32|bf16]
//! ```
//!
//! One step is what `cadenza train` does per batch: forward, mean
//! cross-entropy, backward, gradient clipping at 1.0 and the AdamW update.
//! Random tokens (the cost does not depend on the ids). One untimed warm-up
//! step, then `--steps` timed ones. Prints one JSON line: the mean seconds
//! per step, tokens per second (batch x len / seconds) and the process's peak
//! resident memory (VmHWM; run one configuration per process to read it),
//! and the mean milliseconds of each phase (forward with the loss, backward,
//! clipping, update with zeroing the gradients).

use std::time::Instant;

use cadenza::model::{AttentionKind, LocalPosition, ModelConfig, Precision, Transformer};
use cadenza::train::{adamw::AdamW, train_loss};
use tch::{nn, Device, Kind, Tensor};

struct Opts {
    len: i64,
    batch: i64,
    steps: usize,
    threads: i32,
    preset: String,
    vocab: i64,
    attention: String,
    positional: String,
    /// FAVOR+ chunk size (0 = the preset's; the fused CPU kernel takes none).
    chunk: i64,
    /// Heads of exact softmax over the last `local_window` tokens (the
    /// shipped model: 2 of 4, window 128).
    local_heads: i64,
    local_window: i64,
    /// `shared` (the SPE-filtered queries and keys) or `rope`.
    local_position: String,
    /// `f32` or `bf16` (the dense products; see `cadenza::model::precision`).
    precision: Precision,
}

fn parse() -> Opts {
    let mut o = Opts {
        len: 512,
        batch: 8,
        steps: 3,
        threads: 2,
        preset: "small".into(),
        vocab: 845,
        attention: "favor".into(),
        positional: "spe-sine".into(),
        chunk: 0,
        local_heads: 0,
        local_window: 128,
        local_position: "shared".into(),
        precision: Precision::F32,
    };
    let args: Vec<String> = std::env::args().skip(1).collect();
    let mut i = 0;
    while i < args.len() {
        let key = args[i].as_str();
        // `cargo bench` adds `--bench`.
        if key == "--bench" {
            i += 1;
            continue;
        }
        let val = args
            .get(i + 1)
            .unwrap_or_else(|| panic!("{key} needs a value"));
        let num = |v: &str| v.parse::<i64>().unwrap_or_else(|_| panic!("{key} {v}"));
        match key {
            "--len" => o.len = num(val),
            "--batch" => o.batch = num(val),
            "--steps" => o.steps = num(val) as usize,
            "--threads" => o.threads = num(val) as i32,
            "--preset" => o.preset = val.clone(),
            "--vocab" => o.vocab = num(val),
            "--attention" => o.attention = val.clone(),
            "--positional" => o.positional = val.clone(),
            "--chunk" => o.chunk = num(val),
            "--local-heads" => o.local_heads = num(val),
            "--local-window" => o.local_window = num(val),
            "--local-position" => o.local_position = val.clone(),
            "--precision" => {
                o.precision = match val.as_str() {
                    "f32" => Precision::F32,
                    "bf16" => Precision::Bf16,
                    other => panic!("--precision {other}: f32 or bf16"),
                }
            }
            _ => panic!("unknown option {key}"),
        }
        i += 2;
    }
    o
}

fn vm_mb(field: &str) -> f64 {
    let s = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    s.lines()
        .find(|l| l.starts_with(field))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|v| v.parse::<f64>().ok())
        .map_or(f64::NAN, |kb| kb / 1024.0)
}

fn main() {
    let o = parse();
    tch::set_num_threads(o.threads);
    tch::manual_seed(0);
    let mut cfg = ModelConfig::preset(&o.preset, o.vocab)
        .unwrap()
        .with_positional(&o.positional)
        .unwrap();
    if o.attention == "softmax" {
        cfg.attention = AttentionKind::Softmax;
    }
    if o.chunk > 0 {
        cfg.chunk_size = o.chunk;
    }
    cfg.local_heads = o.local_heads;
    cfg.local_window = o.local_window;
    cfg.local_position = match o.local_position.as_str() {
        "shared" => LocalPosition::Shared,
        "rope" => LocalPosition::Rope,
        other => panic!("--local-position {other}: shared or rope"),
    };
    cfg.validate().unwrap();
    let vs = nn::VarStore::new(Device::Cpu);
    let mut model = Transformer::new(&vs.root(), &cfg).unwrap();
    model.set_precision(o.precision);
    let mut opt = AdamW::new(vs.variables(), 0.9, 0.98, 1e-8, 0.01);
    let base = vm_mb("VmRSS:");
    // seconds of each phase: forward with the loss, backward, clipping, update
    let mut step = || {
        let batch =
            Tensor::randint_low(1, o.vocab, [o.batch, o.len + 1], (Kind::Int64, Device::Cpu));
        let t0 = Instant::now();
        let loss = train_loss(&mut model, &batch, None);
        let t1 = Instant::now();
        loss.backward();
        let t2 = Instant::now();
        opt.clip_grad_norm(1.0);
        let t3 = Instant::now();
        opt.update(1e-4);
        opt.zero_grad();
        let t4 = Instant::now();
        [t1 - t0, t2 - t1, t3 - t2, t4 - t3].map(|d| d.as_secs_f64())
    };
    step();
    let mut phases = [0f64; 4];
    for _ in 0..o.steps {
        for (p, t) in phases.iter_mut().zip(step()) {
            *p += t / o.steps.max(1) as f64;
        }
    }
    let secs: f64 = phases.iter().sum();
    let ms = phases.map(|p| p * 1e3);
    println!(
        "{{\"impl\":\"cadenza\",\"attention\":\"{}\",\"positional\":\"{}\",\"local_heads\":{},\"local_window\":{},\"local_position\":\"{}\",\"precision\":\"{}\",\"len\":{},\"batch\":{},\"steps\":{},\"threads\":{},\"secs_per_step\":{:.4},\"tokens_per_s\":{:.1},\"base_rss_mb\":{:.1},\"peak_rss_mb\":{:.1},\"forward_ms\":{:.1},\"backward_ms\":{:.1},\"clip_ms\":{:.1},\"update_ms\":{:.1}}}",
        o.attention,
        o.positional,
        o.local_heads,
        o.local_window,
        o.local_position,
        o.precision,
        o.len,
        o.batch,
        o.steps,
        tch::get_num_threads(),
        secs,
        (o.batch * o.len) as f64 / secs,
        base,
        vm_mb("VmHWM:"),
        ms[0],
        ms[1],
        ms[2],
        ms[3]
    );
}
