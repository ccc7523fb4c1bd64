//! The model's identities on one device, and that device against the CPU: what
//! `scripts/gpu-check.sh` runs on a GPU machine (`--device cuda`) and, as its dry run,
//! here (`--device cpu`, where the "against the CPU" rows compare the CPU with itself).
//!
//! ```text
//! cargo run --release --example device_check -- --device cuda [--presets tiny,small,base]
//! ```
//!
//! Checks, each one row of a markdown table (measured error, bound, verdict):
//! * FAVOR+ causal linear attention in chunks against its parallel form (one chunk the
//!   length of the sequence: the masked quadratic product), with and without a carried
//!   state;
//! * the recurrence (prefill, then one step per token) against the parallel form, f32
//!   and bf16 products, for each preset;
//! * the gated SPE filter of the model against its plain libtorch form;
//! * the parallel form on the device against the CPU with the same weights, and greedy
//!   generation of 64 tokens on both (the first disagreement, if any, must fall on a
//!   near tie of the CPU's two best logits).
//!
//! Exits with 1 when a check fails.

use anyhow::{bail, Result};
use cadenza::model::spe::{spe_filter_libtorch, spe_filter_with, GateFactors};
use cadenza::model::{favor, ModelConfig, Precision, Transformer};
use tch::{nn, Device, Kind, Tensor};

const VOCAB: i64 = 845;

struct Table {
    failed: usize,
}

impl Table {
    fn row(&mut self, check: &str, error: f64, bound: f64) {
        let ok = error <= bound;
        if !ok {
            self.failed += 1;
        }
        println!(
            "| {check} | {error:.2e} | {bound:.0e} | {} |",
            if ok { "pass" } else { "FAIL" }
        );
    }
}

fn rel(a: &Tensor, b: &Tensor) -> f64 {
    let a = a.to_device(Device::Cpu).to_kind(Kind::Double);
    let b = b.to_device(Device::Cpu).to_kind(Kind::Double);
    (&a - &b).abs().max().double_value(&[]) / b.abs().max().double_value(&[]).max(1e-30)
}

fn tokens(b: i64, l: i64, seed: i64, device: Device) -> Tensor {
    let v: Vec<i64> = (0..b * l)
        .map(|i| (i * 7919 + seed * 104_729 + (i * i) % 13) % VOCAB)
        .collect();
    Tensor::from_slice(&v).view([b, l]).to_device(device)
}

fn favor_chunks(t: &mut Table, device: Device) {
    tch::manual_seed(1);
    let (b, h, l, m, dv) = (2, 4, 300, 64, 32);
    let opts = (Kind::Float, device);
    let q = Tensor::rand([b, h, l, m], opts) + 0.05;
    let k = Tensor::rand([b, h, l, m], opts) + 0.05;
    let v = Tensor::randn([b, h, l, dv], opts);
    let (whole, s1, z1) = favor::causal_linear_attention_chunked(&q, &k, &v, l, None);
    for chunk in [16, 64, 100] {
        let (y, s, z) = favor::causal_linear_attention_chunked(&q, &k, &v, chunk, None);
        t.row(
            &format!("FAVOR+ chunks of {chunk} == parallel form (L {l})"),
            rel(&y, &whole).max(rel(&s, &s1)).max(rel(&z, &z1)),
            1e-4,
        );
    }
    // a state carried over a split at 120 gives the whole sequence
    let (y1, s, z) = favor::causal_linear_attention_chunked(
        &q.narrow(2, 0, 120),
        &k.narrow(2, 0, 120),
        &v.narrow(2, 0, 120),
        64,
        None,
    );
    let (y2, _, _) = favor::causal_linear_attention_chunked(
        &q.narrow(2, 120, l - 120),
        &k.narrow(2, 120, l - 120),
        &v.narrow(2, 120, l - 120),
        64,
        Some((&s, &z)),
    );
    t.row(
        "FAVOR+ with a carried state == parallel form",
        rel(&Tensor::cat(&[y1, y2], 2), &whole),
        1e-4,
    );
}

fn spe_filter(t: &mut Table, device: Device) {
    tch::manual_seed(2);
    let (b, l, h, d, r) = (2, 50, 4, 16, 32);
    let opts = (Kind::Float, device);
    let x = Tensor::randn([b, l, h, d], opts);
    let code = Tensor::randn([l, h, d, r], opts);
    let gate = GateFactors::new(
        &Tensor::randn([h, d], opts),
        &Tensor::randn([h, d, r], opts),
    );
    t.row(
        "gated SPE filter == its libtorch form",
        rel(
            &spe_filter_with(&x, &code, Some(&gate)),
            &spe_filter_libtorch(&x, &code, Some(&gate)),
        ),
        1e-5,
    );
}

fn model(
    preset: &str,
    device: Device,
    precision: Precision,
) -> Result<(nn::VarStore, Transformer)> {
    tch::manual_seed(7);
    let cfg = ModelConfig::preset(preset, VOCAB)?;
    let vs = nn::VarStore::new(device);
    let mut m = Transformer::new(&vs.root(), &cfg)?;
    m.freeze(123);
    m.set_precision(precision);
    Ok((vs, m))
}

fn recurrence(t: &mut Table, preset: &str, device: Device, precision: Precision) -> Result<()> {
    let (_vs, m) = model(preset, device, precision)?;
    let toks = tokens(2, 96, 2, device);
    let full = tch::no_grad(|| m.forward_t(&toks, 0, false));
    let mut st = m.begin(2);
    let pre = m.prefill(&toks.narrow(1, 0, 64), &mut st);
    let mut err = rel(&pre, &full.narrow(1, 0, 64));
    for i in 64..96 {
        let lg = m.step(&toks.select(1, i), &mut st);
        err = err.max(rel(&lg, &full.select(1, i)));
    }
    let bound = if precision == Precision::Bf16 {
        3e-2
    } else {
        1e-4
    };
    t.row(
        &format!("{preset} {precision}: recurrence == parallel form"),
        err,
        bound,
    );
    Ok(())
}

/// Greedy continuation of BOS by `n` tokens; the logits of every step.
fn greedy(m: &Transformer, n: usize, device: Device) -> (Vec<i64>, Vec<Tensor>) {
    let mut st = m.begin(1);
    let mut tok = Tensor::from_slice(&[cadenza::tokenizer::BOS_ID as i64]).to_device(device);
    let (mut out, mut logits) = (Vec::new(), Vec::new());
    for _ in 0..n {
        let lg = m
            .step(&tok, &mut st)
            .to_device(Device::Cpu)
            .to_kind(Kind::Float);
        let next = lg.argmax(-1, false);
        out.push(next.int64_value(&[0]));
        logits.push(lg);
        tok = next.to_device(device);
    }
    (out, logits)
}

fn against_cpu(t: &mut Table, preset: &str, device: Device) -> Result<()> {
    let (vs_dev, m_dev) = model(preset, device, Precision::F32)?;
    let (mut vs_cpu, m_cpu) = model(preset, Device::Cpu, Precision::F32)?;
    vs_cpu.copy(&vs_dev)?;
    let toks = tokens(2, 128, 3, Device::Cpu);
    let (a, b) = tch::no_grad(|| {
        (
            m_dev.forward_t(&toks.to_device(device), 0, false),
            m_cpu.forward_t(&toks, 0, false),
        )
    });
    t.row(
        &format!("{preset} f32: parallel form on {device:?} == CPU"),
        rel(&a, &b),
        1e-4,
    );
    let n = 64;
    let (gd, _) = greedy(&m_dev, n, device);
    let (gc, lc) = greedy(&m_cpu, n, Device::Cpu);
    let first = gd.iter().zip(&gc).position(|(x, y)| x != y);
    // 0 when every token agrees, else how far the CPU's two best logits were apart
    let gap = first.map_or(0.0, |i| {
        let (top, _) = lc[i].topk(2, -1, true, true);
        top.double_value(&[0, 0]) - top.double_value(&[0, 1])
    });
    println!(
        "| {preset}: greedy generation, {n} tokens on {device:?} and the CPU | {} of {n} agree | | |",
        first.unwrap_or(n)
    );
    t.row(
        &format!("{preset}: logit gap at the first disagreement (0: none)"),
        gap,
        1e-3,
    );
    Ok(())
}

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let mut device = Device::Cpu;
    let mut presets = vec!["tiny".to_string(), "small".to_string()];
    let mut it = args.iter();
    while let Some(a) = it.next() {
        match a.as_str() {
            "--device" => {
                device = match it.next().map(|s| s.as_str()) {
                    Some("cpu") => Device::Cpu,
                    Some("cuda") if tch::Cuda::is_available() => Device::Cuda(0),
                    Some("cuda") => bail!("--device cuda: libtorch sees no CUDA device"),
                    other => bail!("--device {other:?}: expected cpu or cuda"),
                }
            }
            "--presets" => {
                presets = it
                    .next()
                    .map(|s| s.split(',').map(String::from).collect())
                    .unwrap_or_default()
            }
            other => bail!("unknown argument {other:?} (--device cpu|cuda, --presets a,b)"),
        }
    }
    println!("| check on {device:?} | error | bound | |\n|---|---|---|---|");
    let mut t = Table { failed: 0 };
    favor_chunks(&mut t, device);
    spe_filter(&mut t, device);
    for p in &presets {
        recurrence(&mut t, p, device, Precision::F32)?;
        if device != Device::Cpu {
            recurrence(&mut t, p, device, Precision::Bf16)?;
        }
        against_cpu(&mut t, p, device)?;
    }
    if t.failed > 0 {
        eprintln!("device_check: {} checks failed", t.failed);
        std::process::exit(1);
    }
    Ok(())
}
