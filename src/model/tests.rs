//! Model-level tests: causality, recurrence == parallel form, chunk invariance, gradients,
//! freezing. All run on tiny models on CPU.

use tch::{nn, Device, Kind, Tensor};

use crate::model::rope::{apply_rope, apply_rope_libtorch, rope, rope_tables};
use crate::model::{AttentionKind, LocalPosition, ModelConfig, PositionalEncoding, Transformer};

const V: i64 = 50;

/// Named model variants covering every positional option and both attentions.
/// (A table, one variant after another, hence its length.)
fn variants() -> Vec<(&'static str, ModelConfig)> {
    let base = {
        let mut c = ModelConfig::preset("tiny", V).unwrap();
        c.chunk_size = 16;
        c
    };
    let with = |pos: &str| base.clone().with_positional(pos).unwrap();
    // SineSPE FAVOR+ heads beside 2 RoPE local heads over 6 tokens (the shipped kinds)
    let sine_rope = || {
        let mut c = with("spe-sine");
        c.local_heads = 2;
        c.local_window = 6;
        c.local_position = LocalPosition::Rope;
        c
    };
    let mut out = vec![
        ("spe-sine gated shared", with("spe-sine")),
        ("spe-conv gated shared", with("spe-conv")),
        ("ape", with("ape")),
        ("none", with("none")),
    ];
    let mut c = with("spe-sine");
    c.positional = PositionalEncoding::SpeSine {
        sines: 3,
        realizations: 8,
        gated: false,
        shared: false,
        freq_init: crate::model::config::FreqInit::Reference,
    };
    out.push(("spe-sine ungated per-layer", c));
    let mut c = with("spe-conv");
    c.positional = PositionalEncoding::SpeConv {
        kernel: 7,
        realizations: 8,
        gated: false,
        shared: false,
    };
    c.attention = AttentionKind::Favor {
        features: 32,
        antithetic: true,
        redraw_prob: 0.5,
    };
    out.push(("spe-conv ungated per-layer antithetic", c));
    let mut c = with("spe-sine");
    c.attention = AttentionKind::Softmax;
    out.push(("softmax spe-sine", c));
    let mut c = with("spe-conv");
    c.attention = AttentionKind::Softmax;
    out.push(("softmax spe-conv", c));
    let mut c = with("ape");
    c.attention = AttentionKind::Softmax;
    c.tie_embeddings = false;
    out.push(("softmax ape untied", c));
    let mut c = with("spe-sine");
    c.short_conv = 4;
    out.push(("spe-sine short conv 4", c));
    let mut c = with("ape");
    c.attention = AttentionKind::Softmax;
    c.short_conv = 2;
    out.push(("softmax ape short conv 2", c));
    let mut c = with("spe-sine");
    c.local_heads = 2;
    c.local_window = 5;
    c.short_conv = 3;
    out.push(("spe-sine 2 local heads window 5, short conv 3", c));
    let mut c = with("ape");
    c.local_heads = 4;
    c.local_window = 3;
    out.push(("ape all heads local window 3", c));
    out.push(("spe-sine 2 rope local heads window 6", sine_rope()));
    // the host step of the FAVOR+ heads with per-layer codes, an antithetic projection
    // and a gate per layer
    let mut c = with("spe-sine");
    c.positional = PositionalEncoding::SpeSine {
        sines: 3,
        realizations: 8,
        gated: true,
        shared: false,
        freq_init: crate::model::config::FreqInit::Spread,
    };
    c.attention = AttentionKind::Favor {
        features: 16,
        antithetic: true,
        redraw_prob: 0.0,
    };
    c.local_heads = 1;
    c.local_window = 4;
    c.local_position = LocalPosition::Rope;
    out.push(("spe-sine gated per-layer antithetic, 1 rope local head", c));
    // the FAVOR+ heads' write gate, in the host step (RoPE local heads, SineSPE) and in
    // libtorch's (ConvSPE)
    let mut c = sine_rope();
    c.favor_write_gate = true;
    out.push(("spe-sine write gate, 2 rope local heads window 6", c));
    let mut c = with("spe-conv");
    c.favor_write_gate = true;
    out.push(("spe-conv write gate", c));
    // the Taylor map in the linear heads (a libtorch step), with RoPE local heads
    let mut c = sine_rope();
    c.taylor_dim = Some(4);
    out.push(("spe-sine taylor map 4, 2 rope local heads window 6", c));
    let mut c = with("none");
    c.taylor_dim = Some(4);
    c.taylor_rope = true;
    c.favor_write_gate = true;
    out.push(("no position code, taylor map 4 with rope, write gate", c));
    // the host step's tied heads: the scaled legacy form (logits x E^T d^-1/2)
    let mut c = with("spe-sine");
    c.tie_embeddings = true;
    c.scaled_embeddings = true;
    out.push(("spe-sine tied scaled embeddings", c));
    let mut c = with("spe-conv");
    c.local_heads = 1;
    c.local_window = 4;
    c.local_position = LocalPosition::Rope;
    out.push(("spe-conv 1 rope local head window 4", c));
    let mut c = with("ape");
    c.local_heads = 2;
    c.local_window = 1;
    c.local_position = LocalPosition::Rope;
    out.push(("ape 2 rope local heads window 1", c));
    // musical RoPE: the host step (SineSPE) and the libtorch step (ConvSPE)
    let mut c = sine_rope();
    c.musical_rope = Some(musical(2, 2));
    out.push(("spe-sine 2 musical rope local heads window 6", c));
    let mut c = with("spe-conv");
    c.local_heads = 1;
    c.local_window = 9;
    c.local_position = LocalPosition::Rope;
    c.musical_rope = Some(musical(1, 3));
    out.push(("spe-conv 1 musical rope local head window 9", c));
    // SineSPE in musical time: shared and gated, and per layer, ungated, with the local
    // heads' RoPE on the token index
    let in_musical_time = |mut c: ModelConfig, heads: i64, window: i64, pairs: i64| {
        (c.local_heads, c.local_window) = (heads, window);
        c.local_position = LocalPosition::Rope;
        c.musical_rope = Some(musical(pairs, pairs));
        c.musical_spe = true;
        c
    };
    out.push((
        "spe-sine in musical time, 2 musical rope local heads window 6",
        in_musical_time(with("spe-sine"), 2, 6, 1),
    ));
    let per_layer = out
        .iter()
        .find(|(n, _)| *n == "spe-sine ungated per-layer")
        .expect("made above")
        .1
        .clone();
    out.push((
        "spe-sine per layer in musical time, 1 rope local head window 4",
        in_musical_time(per_layer, 1, 4, 0),
    ));
    // the SPE clock on a bar shorter than the grid's longest (positions 20)
    let mut c = in_musical_time(with("spe-sine"), 2, 6, 1);
    c.musical_spe_bar = Some(7);
    out.push((
        "spe-sine in musical time on a 7-step bar, 2 musical rope local heads window 6",
        c,
    ));
    // the bar embedding: the host step (SineSPE, RoPE local heads) and the libtorch step
    let mut c = sine_rope();
    c.bar_embedding = Some(4);
    out.push(("spe-sine 2 rope local heads, bar embedding 4", c));
    let mut c = with("spe-conv");
    c.bar_embedding = Some(2);
    out.push(("spe-conv bar embedding 2", c));
    out
}

/// Musical RoPE over ids 4..24 as the Position tokens (the test tokens hit them, and
/// BOS and Bar, often).
fn musical(bar_pairs: i64, position_pairs: i64) -> crate::model::MusicalRope {
    crate::model::MusicalRope {
        bar_pairs,
        position_pairs,
        position_first: 4,
        positions: 20,
    }
}

/// The variant of that name.
fn variant(name: &str) -> ModelConfig {
    variants()
        .into_iter()
        .find(|(n, _)| *n == name)
        .unwrap_or_else(|| panic!("no variant {name:?}"))
        .1
}

fn build(cfg: &ModelConfig, seed: i64) -> (nn::VarStore, Transformer) {
    tch::manual_seed(seed);
    let vs = nn::VarStore::new(Device::Cpu);
    let m = Transformer::new(&vs.root(), cfg).unwrap();
    // Short convolutions start as the identity, which would hide a wrong tail:
    // give every tap a weight.
    tch::no_grad(|| {
        for (name, mut t) in vs.variables() {
            // the bar embedding starts at zero, which would hide it too
            // (and a write gate at zero gives every token the same weight)
            if name.contains("qkv_conv")
                || name.contains("bar_embed")
                || name.contains("write_gate")
            {
                t.copy_(&(Tensor::randn_like(&t) * 0.5));
            }
        }
    });
    (vs, m)
}

fn tokens(b: i64, l: i64, seed: i64) -> Tensor {
    // deterministic without the global RNG
    let v: Vec<i64> = (0..b * l)
        .map(|i| (i * 7919 + seed * 104729 + (i * i) % 13) % V)
        .collect();
    Tensor::from_slice(&v).view([b, l])
}

fn rel(a: &Tensor, b: &Tensor) -> f64 {
    (a - b).abs().max().double_value(&[]) / b.abs().max().double_value(&[]).max(1e-30)
}

/// Copies into `to` every variable that `from` has under the same name, and returns the
/// names of the variables only `to` has, sorted. Tests compare two models on the same
/// weights this way, by name: reseeding libtorch's one global generator before each
/// construction does not work, since tests on other threads draw from it in between.
fn copy_shared(from: &nn::VarStore, to: &nn::VarStore) -> Vec<String> {
    let source = from.variables();
    let mut only_to = Vec::new();
    tch::no_grad(|| {
        for (name, mut t) in to.variables() {
            match source.get(&name) {
                Some(src) => {
                    t.copy_(src);
                }
                None => only_to.push(name),
            }
        }
    });
    only_to.sort();
    only_to
}

#[test]
fn causality_every_variant() {
    for (name, cfg) in variants() {
        let (_vs, m) = build(&cfg, 1);
        let t = 30;
        let a = tokens(2, 48, 1);
        let b = a.copy();
        b.narrow(1, t, 48 - t).copy_(&tokens(2, 48 - t, 9));
        for offset in [0, 333] {
            let la = m.forward_t(&a, offset, false);
            let lb = m.forward_t(&b, offset, false);
            let e = rel(&lb.narrow(1, 0, t), &la.narrow(1, 0, t));
            assert!(
                e < 1e-6,
                "{name} offset {offset}: past logits changed ({e})"
            );
            assert!(rel(&lb, &la) > 1e-3, "{name}: perturbation had no effect");
        }
    }
}

#[test]
fn recurrence_matches_parallel_every_variant() {
    for (name, cfg) in variants() {
        let (_vs, mut m) = build(&cfg, 2);
        m.freeze(123);
        let toks = tokens(2, 70, 2);
        for offset in [0, 1000] {
            let full = m.forward_t(&toks, offset, false);
            // prefill 40 then step 30
            let mut st = m.begin_at(2, offset);
            let pre = m.prefill(&toks.narrow(1, 0, 40), &mut st);
            assert!(
                rel(&pre, &full.narrow(1, 0, 40)) < 1e-4,
                "{name}: prefill differs"
            );
            for i in 40..70 {
                let lg = m.step(&toks.select(1, i), &mut st);
                let e = rel(&lg, &full.select(1, i));
                assert!(
                    e < 1e-4,
                    "{name} offset {offset}: step at {i} differs ({e})"
                );
            }
            assert_eq!(st.position, offset + 70);
            // uneven prefill pieces, then steps
            let mut st = m.begin_at(2, offset);
            let mut pos = 0;
            // (single positions between longer pieces: the local heads' rings wrap, and a
            // long piece then starts from a rotated ring)
            for piece in [7, 1, 1, 1, 20, 13] {
                let lg = m.prefill(&toks.narrow(1, pos, piece), &mut st);
                let e = rel(&lg, &full.narrow(1, pos, piece));
                assert!(
                    e < 1e-4,
                    "{name} offset {offset}: prefill piece at {pos} differs ({e})"
                );
                pos += piece;
            }
            for i in pos..70 {
                let lg = m.step(&toks.select(1, i), &mut st);
                assert!(
                    rel(&lg, &full.select(1, i)) < 1e-4,
                    "{name}: step after uneven prefill at {i}"
                );
            }
        }
    }
}

#[test]
fn host_steps_match_the_parallel_form_at_every_batch() {
    // the shipped shape's kind of model: RoPE local heads and gated SineSPE FAVOR+ heads;
    // batch 5 hands the step's products to libtorch, batch 0 has nothing to step
    let mut cfg = ModelConfig::preset("tiny", V).unwrap();
    cfg.local_heads = 2;
    cfg.local_window = 6;
    cfg.local_position = LocalPosition::Rope;
    let (_vs, mut m) = build(&cfg, 7);
    m.freeze(9);
    for batch in [1, 5] {
        let toks = tokens(batch, 30, 7);
        let full = m.forward_t(&toks, 0, false);
        let mut st = m.begin(batch);
        let _ = m.prefill(&toks.narrow(1, 0, 12), &mut st);
        for i in 12..30 {
            let e = rel(&m.step(&toks.select(1, i), &mut st), &full.select(1, i));
            assert!(e < 1e-4, "batch {batch}: step at {i} differs ({e})");
        }
    }
    let mut st = m.begin(0);
    let lg = m.step(&Tensor::zeros([0], (Kind::Int64, Device::Cpu)), &mut st);
    assert_eq!(lg.size(), [0, V]);
    assert_eq!(st.position, 1);
}

#[test]
fn recurrent_state_copy_and_select() {
    for (name, cfg) in variants() {
        if (name.contains("conv") && !name.contains("softmax")) || name.contains("local") {
            state_copy_and_select(&cfg);
        }
    }
}

fn state_copy_and_select(cfg: &ModelConfig) {
    let (_vs, mut m) = build(cfg, 3);
    m.freeze(4);
    let toks = tokens(3, 20, 3);
    let full = m.forward_t(&toks, 0, false);
    let mut st = m.begin(3);
    let _ = m.prefill(&toks.narrow(1, 0, 8), &mut st);
    // two steps: short windows have wrapped their rings by now
    let _ = m.step(&toks.select(1, 8), &mut st);
    let _ = m.step(&toks.select(1, 9), &mut st);
    let mut c = st.copy();
    let idx = Tensor::from_slice(&[2i64, 0]);
    let mut s2 = st.select(&idx);
    // the original moves on with other tokens: neither the copy nor the selection may see it
    let _ = m.step(&toks.select(1, 15), &mut st);
    let _ = m.step(&toks.select(1, 3), &mut st);
    let b = m.step(&toks.select(1, 10), &mut c);
    assert!(rel(&b, &full.select(1, 10)) < 1e-4);
    let d = m.step(&toks.select(1, 10).index_select(0, &idx), &mut s2);
    assert!(rel(&d, &full.select(1, 10).index_select(0, &idx)) < 1e-4);
}

// (One check per piece of the host step against its libtorch form, sharing one set of
// inputs: longer than the others for it.)
#[test]
fn host_step_pieces_match_their_libtorch_forms() {
    use crate::model::config::FreqInit;
    use crate::model::favor::{host_recurrent_step, recurrent_step, FavorFeatures};
    use crate::model::spe::{draw_xi, host_filter, spe_filter_with, GateFactors, SineSpe};
    tch::manual_seed(21);
    let f = (Kind::Float, Device::Cpu);
    let (h, d, k, r) = (2i64, 8i64, 3i64, 4i64);
    let host = crate::model::host_f32;
    let max_diff = |a: &[f32], b: &[f32]| {
        assert_eq!(a.len(), b.len());
        a.iter()
            .zip(b)
            .map(|(x, y)| (x - y).abs())
            .fold(0f32, f32::max)
    };
    let vs = nn::VarStore::new(Device::Cpu);
    let spe = SineSpe::new(&vs.root(), h, d, k, r, FreqInit::Spread);
    tch::no_grad(|| {
        spe.offsets
            .shallow_clone()
            .copy_(&Tensor::randn([h, d, k], f));
        spe.gains
            .shallow_clone()
            .copy_(&Tensor::randn([h, d, k], f));
    });
    let factors = spe.factors(&spe.draw_z());
    let hs = factors.host();
    let gate = GateFactors::new(
        &Tensor::randn([h, d], f),
        &draw_xi(h, d, r, Kind::Float, Device::Cpu),
    );
    let (a, xi_b) = gate.host();
    // a position far out, where the phases need their f64 cycles
    for pos in [0i64, 7, 123_457] {
        let (qbar, kbar) = tch::no_grad(|| spe.codes_from(&factors, pos, 1)); // (1, H, D, R)
        let (cq, ck) = (hs.code_at(pos, true), hs.code_at(pos, false));
        assert!(max_diff(&cq, &host(&qbar)) < 1e-5, "qbar at {pos}");
        assert!(max_diff(&ck, &host(&kbar)) < 1e-5, "kbar at {pos}");
        // the gated filter of one query (B = 1, L = 1)
        let x = Tensor::randn([1, 1, h, d], f);
        let want = host(&tch::no_grad(|| spe_filter_with(&x, &qbar, Some(&gate)))); // (1, H, 1, R)
        let xs = host(&x);
        for j in 0..h as usize {
            let (du, ru) = (d as usize, r as usize);
            let mut out = vec![0f32; ru];
            let gj = (&a[j * du..][..du], &xi_b[j * du * ru..][..du * ru]);
            host_filter(
                &xs[j * du..][..du],
                &cq[j * du * ru..][..du * ru],
                Some(gj),
                &mut out,
            );
            assert!(
                max_diff(&out, &want[j * ru..][..ru]) < 1e-5,
                "filter, head {j}"
            );
        }
    }
    // feature maps (plain and antithetic) and one recurrent step
    for antithetic in [false, true] {
        let feats = FavorFeatures::draw(16, r, antithetic, Device::Cpu);
        let hf = feats.host();
        let m = feats.num_features();
        for query in [true, false] {
            let x = Tensor::randn([r], f);
            let mut out = vec![0f32; m as usize];
            hf.phi(&host(&x), query, &mut out);
            // (relative: keys' features are not brought under 1, and the fused CPU map
            // folds the 1/sqrt(M) into its exponent)
            let want = host(&feats.features(&x, query));
            let top = want.iter().fold(1f32, |m, v| m.max(v.abs()));
            assert!(max_diff(&out, &want) < 1e-6 * top);
        }
        let (pq, pk) = (Tensor::rand([1, 1, m], f), Tensor::rand([1, 1, m], f));
        let v = Tensor::randn([1, 1, 5], f);
        let (s0, z0) = (Tensor::rand([1, 1, m, 5], f), Tensor::rand([1, 1, m], f));
        let (o, s1, z1) = recurrent_step(&pq, &pk, &v, &s0, &z0);
        let (mut s, mut z, mut out) = (host(&s0), host(&z0), vec![0f32; 5]);
        host_recurrent_step(&host(&pq), &host(&pk), &host(&v), &mut s, &mut z, &mut out);
        assert!(max_diff(&out, &host(&o)) < 1e-5);
        assert!(max_diff(&s, &host(&s1)) < 1e-6);
        assert!(max_diff(&z, &host(&z1)) < 1e-6);
    }
}

#[test]
fn banded_attention_matches_the_definition_and_its_gradients() {
    use super::local::banded_attention;
    tch::manual_seed(12);
    let f = (Kind::Float, Device::Cpu);
    let l = 23i64;
    let i = Tensor::arange(l, (Kind::Int64, Device::Cpu));
    let lag = i.unsqueeze(1) - i.unsqueeze(0);
    // windows shorter than, equal to and longer than the blocks; blocks that do and do
    // not divide L, one position, and one block for the whole call
    for (w, block) in [
        (5, 2),
        (5, 3),
        (5, 5),
        (5, 128),
        (9, 4),
        (1, 7),
        (2, 1),
        (22, 8),
        (7, 40),
    ] {
        let leaf = |d: i64| Tensor::randn([2, 3, l, d], f).set_requires_grad(true);
        let (q, k, v) = (leaf(4), leaf(4), leaf(6));
        let outside = lag.lt(0).logical_or(&lag.ge(w));
        let want = (q.matmul(&k.transpose(-1, -2)) / 2.0)
            .masked_fill(&outside, f64::NEG_INFINITY)
            .softmax(-1, None)
            .matmul(&v);
        let got = banded_attention(&q, &k, &v, w, block);
        assert_eq!(got.size(), want.size());
        assert!(rel(&got, &want) < 1e-5, "window {w}, block {block}");
        // the same gradients for a random loss weight
        let wt = Tensor::randn(want.size(), f);
        let grads = |out: &Tensor| {
            Tensor::run_backward(&[(out * &wt).sum(Kind::Float)], &[&q, &k, &v], false, false)
        };
        for (a, b) in grads(&got).iter().zip(grads(&want).iter()) {
            assert!(rel(a, b) < 1e-5, "gradient, window {w}, block {block}");
        }
    }
}

#[test]
fn window_attention_is_banded_softmax_in_any_pieces() {
    use super::local::{ring_attention, window_attention, KvRing, UNBOUNDED};
    tch::manual_seed(11);
    let f = (Kind::Float, Device::Cpu);
    let l = 23i64;
    let q = Tensor::randn([2, 3, l, 4], f);
    let k = Tensor::randn([2, 3, l, 4], f);
    let v = Tensor::randn([2, 3, l, 6], f);
    // a window of 5, and the unbounded one (plain causal softmax)
    for w in [5, UNBOUNDED] {
        // by definition: softmax over keys j with 0 <= i - j < w
        let i = Tensor::arange(l, (Kind::Int64, Device::Cpu));
        let lag = i.unsqueeze(1) - i.unsqueeze(0);
        let outside = lag.lt(0).logical_or(&lag.ge(w));
        let want = (q.matmul(&k.transpose(-1, -2)) / 2.0)
            .masked_fill(&outside, f64::NEG_INFINITY)
            .softmax(-1, None)
            .matmul(&v);
        let whole = window_attention(&q, &k, &v, w, None);
        assert!(rel(&whole, &want) < 1e-5, "window {w}");
        // the same through a cache, in uneven pieces
        let (mut ck, mut cv) = (
            Tensor::zeros([2, 3, 0, 4], f),
            Tensor::zeros([2, 3, 0, 6], f),
        );
        let mut pos = 0;
        for piece in [1, 7, 2, 1, 12] {
            let out = window_attention(
                &q.narrow(2, pos, piece),
                &k.narrow(2, pos, piece),
                &v.narrow(2, pos, piece),
                w,
                Some((&mut ck, &mut cv)),
            );
            assert!(
                rel(&out, &want.narrow(2, pos, piece)) < 1e-5,
                "window {w}, piece at {pos}"
            );
            pos += piece;
            assert_eq!(
                ck.size()[2],
                (w - 1).min(pos),
                "cache keeps w - 1 positions"
            );
            assert_eq!(cv.size()[2], ck.size()[2]);
        }
        if w == UNBOUNDED {
            continue;
        }
        // the same through a ring of w slots: single steps write in place, longer
        // pieces put the keys back in order; every step after the first w wraps
        let mut ring = KvRing::new(2, 3, w, 4, 6, f);
        let mut pos = 0;
        for piece in [1, 1, 3, 1, 1, 1, 1, 1, 1, 6, 1, 1, 1, 1, 1, 1] {
            let out = ring_attention(
                &q.narrow(2, pos, piece),
                &k.narrow(2, pos, piece),
                &v.narrow(2, pos, piece),
                &mut ring,
            );
            assert!(
                rel(&out, &want.narrow(2, pos, piece)) < 1e-5,
                "ring, piece at {pos}"
            );
            pos += piece;
            let (ok, ov) = ring.chronological();
            let held = ok.size()[2];
            assert!(held == w.min(pos) || (piece > 1 && held == (w - 1).min(pos)));
            assert!(
                rel(&ok, &k.narrow(2, pos - held, held)) < 1e-7,
                "oldest first"
            );
            assert!(rel(&ov, &v.narrow(2, pos - held, held)) < 1e-7);
        }
        assert_eq!(pos, l, "the pieces cover the sequence");
    }
}

#[test]
fn host_ring_step_is_rope_then_ring_attention() {
    use super::local::{host_ring_step, host_step_ok, ring_attention, KvRing};
    tch::manual_seed(12);
    let f = (Kind::Float, Device::Cpu);
    // 2 sequences; 3 heads of dim 8 in all, the first 2 local, window 5; 13 steps from
    // position 990 (the ring wraps after 5)
    let (b, h, hl, dim, w) = (2i64, 3i64, 2i64, 8i64, 5i64);
    let d = h * dim;
    let (mut fast, mut slow) = (
        KvRing::new(b, hl, w, dim, dim, f),
        KvRing::new(b, hl, w, dim, dim, f),
    );
    for step in 0..13 {
        let pos = 990 + step;
        let qkv = Tensor::randn([b, 3 * d], f);
        let heads = |part: i64| qkv.narrow(1, part * d, hl * dim).view([b, hl, 1, dim]);
        let want = ring_attention(
            &rope(&heads(0), pos),
            &rope(&heads(1), pos),
            &heads(2),
            &mut slow,
        );
        assert!(host_step_ok(&fast));
        let rows = Vec::<f32>::try_from(&qkv.view([-1])).unwrap();
        let got = host_ring_step(
            &rows,
            b as usize,
            hl as usize,
            d as usize,
            dim as usize,
            &[crate::model::rope::turn_of(
                None,
                dim,
                pos,
                crate::model::clock::ClockState::default(),
            )],
            &mut fast,
        );
        assert_eq!(got.len() as i64, b * hl * dim);
        let got = Tensor::from_slice(&got).view([b, hl, 1, dim]);
        assert!(rel(&got, &want) < 1e-5, "step {step}");
        assert_eq!((fast.len, fast.next), (slow.len, slow.next));
        let ((fk, fv), (sk, sv)) = (fast.chronological(), slow.chronological());
        assert!(
            rel(&fk, &sk) < 1e-6 && rel(&fv, &sv) < 1e-7,
            "ring at step {step}"
        );
    }
}

#[test]
fn local_heads_see_no_further_than_their_window() {
    // all heads local, no positions: a token outside every head's reach
    // (2 layers x (window - 1) back) leaves the logits unchanged
    let cfg = variant("ape all heads local window 3")
        .with_positional("none")
        .unwrap();
    let (_vs, m) = build(&cfg, 12);
    let _ = assert_reach_of_window_3(&m, &tokens(1, 20, 12));
}

/// With every head local over 3 tokens in 2 layers, changing token 5 of `a` (1, 20)
/// changes the logits up to position 9 and not at 10 (2 layers x 2 positions back).
/// Returns the logits of `a`.
fn assert_reach_of_window_3(m: &Transformer, a: &Tensor) -> Tensor {
    let b = a.copy();
    let _ = b.narrow(1, 5, 1).fill_(7);
    assert_ne!(a.int64_value(&[0, 5]), 7, "the token changes");
    let (la, lb) = (m.forward_t(a, 0, false), m.forward_t(&b, 0, false));
    assert!(rel(&la.select(1, 10), &lb.select(1, 10)) < 1e-7);
    assert!(rel(&la.select(1, 9), &lb.select(1, 9)) > 1e-4);
    la
}

/// RoPE against its definition: pair (x_j, x_{j+D/2}) at position p turns by the angle
/// p * ROPE_BASE^(-2j/D), the angle formed in f64 and its cosine and sine taken in f32.
#[test]
fn rope_turns_each_pair_by_its_angle() {
    tch::manual_seed(22);
    let (h, l, dim, start) = (2i64, 5i64, 8i64, 70_000i64);
    let x = Tensor::randn([1, h, l, dim], (Kind::Float, Device::Cpu));
    let got = rope(&x, start);
    let half = dim / 2;
    for hi in 0..h {
        for p in 0..l {
            for j in 0..half {
                let ang = (start + p) as f64
                    * (j as f64 * (-2.0 * crate::model::config::ROPE_BASE.ln() / dim as f64)).exp();
                let (c, s) = (ang.cos() as f32, ang.sin() as f32);
                let x1 = x.double_value(&[0, hi, p, j]) as f32;
                let x2 = x.double_value(&[0, hi, p, j + half]) as f32;
                let want = [x1 * c - x2 * s, x1 * s + x2 * c];
                let have = [
                    got.double_value(&[0, hi, p, j]) as f32,
                    got.double_value(&[0, hi, p, j + half]) as f32,
                ];
                // (to the last bits: the fused CPU kernel may fuse a product and a sum)
                let off = (have[0] - want[0]).abs().max((have[1] - want[1]).abs());
                assert!(
                    off < 1e-6,
                    "head {hi}, position {p}, pair {j}: {have:?} {want:?}"
                );
            }
        }
    }
}

/// The fused RoPE against its libtorch form, on a strided view (as the model's
/// queries are, cut from its projections): values and the gradient of x, which
/// reaches it through a transpose (an incoming gradient without unit stride).
#[test]
fn fused_rope_matches_the_libtorch_form() {
    tch::manual_seed(23);
    let (b, h, l, dim) = (2, 3, 7, 16);
    let x = Tensor::randn([b, l, h, dim], (Kind::Float, Device::Cpu)).set_requires_grad(true);
    let w = Tensor::randn([b, h, l, dim], (Kind::Float, Device::Cpu));
    let tables = rope_tables(40, l, dim, Device::Cpu);
    let run = |fused: bool| {
        let mut g = x.grad();
        if g.defined() {
            let _ = g.zero_();
        }
        let xv = x.permute([0, 2, 1, 3]);
        let out = if fused {
            apply_rope(&xv, &tables)
        } else {
            apply_rope_libtorch(&xv, &tables)
        };
        (out.transpose(2, 3) * w.transpose(2, 3))
            .sum(Kind::Float)
            .backward();
        (out.detach(), x.grad().copy())
    };
    let ((o1, g1), (o2, g2)) = (run(true), run(false));
    let off = |a: &Tensor, b: &Tensor| (a - b).abs().max().double_value(&[]);
    assert!(off(&o1, &o2) < 1e-6, "values off by {}", off(&o1, &o2));
    assert!(off(&g1, &g2) < 1e-6, "gradients off by {}", off(&g1, &g2));
}

#[test]
fn rope_dot_products_depend_on_the_lag_only() {
    tch::manual_seed(21);
    let (q, k) = (
        Tensor::randn([1, 1, 1, 8], (Kind::Float, Device::Cpu)),
        Tensor::randn([1, 1, 1, 8], (Kind::Float, Device::Cpu)),
    );
    let dot = |pq: i64, pk: i64| {
        (rope(&q, pq) * rope(&k, pk))
            .sum(Kind::Double)
            .double_value(&[])
    };
    // the same lag anywhere, also far past the training lengths
    for (a, b) in [(0, 5), (100, 105), (70_000, 70_005)] {
        assert!((dot(b, a) - dot(5, 0)).abs() < 1e-4, "lag 5 at {a}");
    }
    assert!(
        (dot(5, 0) - dot(6, 0)).abs() > 1e-3,
        "another lag, another logit"
    );
    // a rotation: norms kept, and position 0 is the identity
    let n = |x: &Tensor| x.norm().double_value(&[]);
    assert!((n(&rope(&q, 12_345)) - n(&q)).abs() < 1e-5);
    assert!(rel(&rope(&q, 0), &q) < 1e-7);
    // a window turned from its offset equals the same rows of a longer window
    let x = Tensor::randn([2, 3, 10, 8], (Kind::Float, Device::Cpu));
    let whole = rope(&x, 0);
    assert!(rel(&rope(&x.narrow(2, 4, 6), 4), &whole.narrow(2, 4, 6)) < 1e-7);
}

#[test]
fn rope_local_heads_skip_spe_and_keep_the_window() {
    // every head local with RoPE: SPE is off in all of them, and the reach is the
    // windows' (2 layers x (window - 1) back), as without positions
    let mut cfg = variant("spe-sine 2 rope local heads window 6");
    cfg.local_heads = cfg.n_heads;
    cfg.local_window = 3;
    let (_vs, m) = build(&cfg, 13);
    let a = tokens(1, 20, 13);
    let la = assert_reach_of_window_3(&m, &a);
    // RoPE sees lags, not absolute positions: the same tokens at another offset give
    // the same logits (SPE filters no head here, and there is no APE)
    let shifted = m.forward_t(&a, 1_000, false);
    assert!(rel(&la, &shifted) < 1e-5, "{}", rel(&la, &shifted));
    // and the recurrence with no head left for SPE gives the same logits
    let mut st = m.begin(1);
    let pre = m.prefill(&a.narrow(1, 0, 9), &mut st);
    assert!(rel(&pre, &la.narrow(1, 0, 9)) < 1e-4);
    for i in 9..20 {
        assert!(rel(&m.step(&a.select(1, i), &mut st), &la.select(1, i)) < 1e-4);
    }
    // the config refuses RoPE without local heads
    let mut bad = variant("spe-sine gated shared");
    bad.local_position = LocalPosition::Rope;
    assert!(bad.validate().is_err());
}

#[test]
fn short_conv_starts_as_identity_and_reaches_back_k_minus_1_tokens() {
    let cfg = variant("spe-sine short conv 4");
    let mut plain = cfg.clone();
    plain.short_conv = 0;
    // identity at initialization: the same logits as the model without it
    tch::manual_seed(9);
    let vs_a = nn::VarStore::new(Device::Cpu);
    let a = Transformer::new(&vs_a.root(), &plain).unwrap();
    let vs_b = nn::VarStore::new(Device::Cpu);
    let b = Transformer::new(&vs_b.root(), &cfg).unwrap();
    // the same weights (by name), the convolution's own only in b
    let extra = copy_shared(&vs_a, &vs_b);
    assert!(
        !extra.is_empty() && extra.iter().all(|n| n.contains("conv")),
        "{extra:?}"
    );
    let toks = tokens(1, 30, 9);
    let e = rel(&b.forward_t(&toks, 0, false), &a.forward_t(&toks, 0, false));
    assert!(e < 1e-6, "identity conv changes logits by {e}");
    // the convolution itself, by hand
    let x = Tensor::randn([2, 9, 6], (Kind::Float, Device::Cpu));
    let w = Tensor::randn([6, 4], (Kind::Float, Device::Cpu));
    let y = super::attention::short_conv(&x, &w, None);
    // by hand at t = 5: taps 0..3 weigh x[2], x[3], x[4], x[5]
    let mut want = Tensor::zeros([2, 6], (Kind::Float, Device::Cpu));
    for j in 0..4 {
        want += x.select(1, 2 + j) * w.select(1, j);
    }
    assert!(rel(&y.select(1, 5), &want) < 1e-6);
    // at t = 1 only x[0] and x[1] exist (zeros before the start)
    let want1 = x.select(1, 0) * w.select(1, 2) + x.select(1, 1) * w.select(1, 3);
    assert!(rel(&y.select(1, 1), &want1) < 1e-6);
}

#[test]
fn chunk_size_does_not_change_results() {
    for (name, cfg) in variants() {
        if cfg.attention == AttentionKind::Softmax {
            continue;
        }
        let (_vs, mut m) = build(&cfg, 5);
        let toks = tokens(2, 45, 5);
        let reference = m.forward_t(&toks, 17, false);
        for c in [1, 7, 64] {
            m.set_chunk_size(c);
            let e = rel(&m.forward_t(&toks, 17, false), &reference);
            assert!(e < 1e-5, "{name}: chunk {c} changes logits by {e}");
        }
    }
}

#[test]
fn spe_gradients_reach_every_spe_and_gate_parameter() {
    for (name, cfg) in variants() {
        if !cfg.positional.is_spe() {
            continue;
        }
        let (vs, m) = build(&cfg, 6);
        let toks = tokens(2, 40, 6);
        let logits = m.forward_t(&toks.narrow(1, 0, 39), 5, true);
        let loss = logits
            .reshape([-1, V])
            .cross_entropy_for_logits(&toks.narrow(1, 1, 39).reshape([-1]));
        loss.backward();
        let vars = vs.variables();
        let spe: Vec<_> = vars.iter().filter(|(k, _)| k.contains("spe")).collect();
        let gated = matches!(
            cfg.positional,
            PositionalEncoding::SpeSine { gated: true, .. }
                | PositionalEncoding::SpeConv { gated: true, .. }
        );
        let n_code = if matches!(cfg.positional, PositionalEncoding::SpeSine { .. }) {
            3
        } else {
            2
        };
        let shared = matches!(
            cfg.positional,
            PositionalEncoding::SpeSine { shared: true, .. }
                | PositionalEncoding::SpeConv { shared: true, .. }
        );
        let want = n_code * if shared { 1 } else { cfg.n_layers as usize }
            + if gated { cfg.n_layers as usize } else { 0 };
        assert_eq!(
            spe.len(),
            want,
            "{name}: SPE params {:?}",
            spe.iter().map(|p| p.0).collect::<Vec<_>>()
        );
        for (k, t) in spe {
            let g = t.grad();
            assert!(g.defined(), "{name}: {k} has no grad");
            let s = g.abs().sum(Kind::Double).double_value(&[]);
            assert!(
                s > 0.0 && s.is_finite(),
                "{name}: zero/non-finite grad for {k}: {s}"
            );
        }
    }
}

#[test]
fn parameter_names_allow_weight_decay_filters() {
    let mut cfg = ModelConfig::preset("tiny", V).unwrap();
    cfg.tie_embeddings = false;
    let (vs, _m) = build(&cfg, 7);
    let vars = vs.variables();
    assert!(vars.contains_key("tok_embed.weight"));
    assert!(vars.contains_key("layers.0.spe_gate") && vars.contains_key("spe.freqs"));
    for name in vars.keys() {
        let ok = name.contains("embed")
            || name.contains("norm")
            || name.ends_with("bias")
            || name.contains("spe")
            || name.ends_with("weight");
        assert!(ok, "unexpected parameter name {name}");
        if name.contains("norm") {
            assert!(name.ends_with("weight") || name.ends_with("bias"));
        }
    }
}

#[test]
fn freeze_is_deterministic_and_training_redraws_noise() {
    for (name, cfg) in variants().into_iter().take(2) {
        let (vs1, mut m) = build(&cfg, 8);
        let toks = tokens(1, 30, 8);
        m.freeze(5);
        let a = m.forward_t(&toks, 0, false);
        assert!(
            rel(&m.forward_t(&toks, 0, false), &a) == 0.0,
            "{name}: eval not deterministic"
        );
        m.freeze(6);
        let b = m.forward_t(&toks, 0, false);
        assert!(rel(&b, &a) > 1e-4, "{name}: seed has no effect");
        m.freeze(5);
        assert!(
            rel(&m.forward_t(&toks, 0, false), &a) == 0.0,
            "{name}: re-freeze differs"
        );
        // a fresh model built from the same weights and seed is the same function
        let mut vs2 = nn::VarStore::new(Device::Cpu);
        let mut m2 = Transformer::new(&vs2.root(), &cfg).unwrap();
        vs2.copy(&vs1).unwrap();
        m2.freeze(5);
        assert!(
            rel(&m2.forward_t(&toks, 0, false), &a) == 0.0,
            "{name}: not reproducible"
        );
        // training mode draws fresh SPE noise each call (dropout is 0 in tiny)
        let t1 = m.forward_t(&toks, 0, true);
        let t2 = m.forward_t(&toks, 0, true);
        assert!(rel(&t2, &t1) > 1e-5, "{name}: training noise not redrawn");
    }
}

#[test]
fn logits_shape_and_ape_values() {
    let cfg = ModelConfig::preset("tiny", V)
        .unwrap()
        .with_positional("ape")
        .unwrap();
    let (_vs, m) = build(&cfg, 9);
    let lg = m.forward_t(&tokens(3, 11, 1), 4000, false);
    assert_eq!(lg.size(), [3, 11, V]);
    assert_eq!(lg.kind(), Kind::Float);
    let pe = crate::model::embed::sinusoidal_ape(5, 2, 6, Device::Cpu);
    let want = [
        5f64.sin(),
        5f64.cos(),
        (5.0 / 10000f64.powf(2.0 / 6.0)).sin(),
    ];
    for (j, w) in want.iter().enumerate() {
        assert!((pe.double_value(&[0, j as i64]) - w).abs() < 1e-6);
    }
}

#[test]
#[should_panic(expected = "frozen seed")]
fn stale_state_after_refreeze_is_rejected() {
    let cfg = ModelConfig::preset("tiny", V)
        .unwrap()
        .with_positional("spe-conv")
        .unwrap();
    let (_vs, mut m) = build(&cfg, 10);
    let mut st = m.begin(1);
    m.freeze(99);
    let _ = m.step(&Tensor::from_slice(&[1i64]), &mut st);
}

/// A FAVOR+ layer with RoPE local heads and a short convolution, no SPE (its noise is the
/// stack's), with its frozen projection.
fn sublayer_config() -> (ModelConfig, crate::model::favor::FavorFeatures) {
    let mut c = ModelConfig::preset("tiny", V)
        .unwrap()
        .with_positional("none")
        .unwrap();
    c.chunk_size = 8;
    c.local_heads = 1;
    c.local_window = 4;
    c.local_position = LocalPosition::Rope;
    c.short_conv = 3;
    let AttentionKind::Favor {
        features,
        antithetic,
        ..
    } = c.attention
    else {
        panic!("the tiny preset uses FAVOR+")
    };
    let feats = crate::model::favor::FavorFeatures::seeded(
        3,
        0,
        features,
        c.qk_dim(),
        antithetic,
        Device::Cpu,
    );
    (c, feats)
}

#[test]
fn attention_step_over_a_sequence_is_its_forward() {
    use crate::model::attention::{Attention, LayerNoise, Positions};
    let (cfg, feats) = sublayer_config();
    tch::manual_seed(11);
    let vs = nn::VarStore::new(Device::Cpu);
    let att = Attention::new(&cfg, &vs.root(), None);
    tch::no_grad(|| {
        let w = att.conv.as_ref().expect("short conv");
        w.shallow_clone().copy_(&(Tensor::randn_like(w) * 0.5));
    });
    let noise = LayerNoise {
        code: None,
        gate: None,
        features: Some(&feats),
    };
    let (b, l, offset) = (2, 11, 7);
    let x = Tensor::randn([b, l, cfg.d_model], (Kind::Float, Device::Cpu));
    let whole = tch::no_grad(|| att.forward(&x, &noise, &Positions::new(offset, false), None));
    assert_eq!(whole.size(), [b, l, cfg.d_model]);
    // libtorch steps, host ring steps, and a prefill then steps: the same outputs
    for (ring_on_host, prefix) in [(false, 0), (true, 0), (false, 5)] {
        let mut st = att.begin(b);
        let mut outs = vec![];
        if prefix > 0 {
            let pos = Positions::new(offset, false);
            outs.push(tch::no_grad(|| {
                att.forward(&x.narrow(1, 0, prefix), &noise, &pos, Some(&mut st))
            }));
        }
        for p in prefix..l {
            let pos = Positions::new(offset + p, ring_on_host);
            outs.push(tch::no_grad(|| {
                att.step(&x.narrow(1, p, 1), &noise, &pos, &mut st)
            }));
        }
        let e = rel(&Tensor::cat(&outs, 1), &whole);
        assert!(
            e < 1e-5,
            "step (host ring {ring_on_host}, prefix {prefix}) differs from forward: {e}"
        );
    }
    // causal: changing the last position changes no earlier output
    let y = x.copy();
    let _ = y.narrow(1, l - 1, 1).fill_(3.0);
    let other = tch::no_grad(|| att.forward(&y, &noise, &Positions::new(offset, false), None));
    assert!(rel(&other.narrow(1, 0, l - 1), &whole.narrow(1, 0, l - 1)) == 0.0);
    assert!(rel(&other.narrow(1, l - 1, 1), &whole.narrow(1, l - 1, 1)) > 1e-3);
}

#[test]
fn favor_heads_step_over_a_sequence_is_their_forward() {
    use crate::model::favor_heads::{FavorHeads, FeatureMap};
    let (cfg, feats) = sublayer_config();
    let heads = FavorHeads {
        chunk: 4,
        features: feats.num_features(),
    };
    tch::manual_seed(12);
    let (b, h, l, d) = (2, 3, 9, cfg.qk_dim());
    let f = (Kind::Float, Device::Cpu);
    let (q, k, v) = (
        Tensor::randn([b, h, l, d], f),
        Tensor::randn([b, h, l, d], f),
        Tensor::randn([b, h, l, 5], f),
    );
    // (with write gates, which every form must weigh alike)
    let g = Tensor::rand([b, h, l], f);
    let map = FeatureMap::Favor(&feats);
    let whole = heads.forward(&q, &k, &v, Some(&g), map, None);
    let m = feats.num_features();
    let (mut s, mut z) = (Tensor::zeros([b, h, m, 5], f), Tensor::zeros([b, h, m], f));
    let outs: Vec<Tensor> = (0..l)
        .map(|p| {
            let at = |t: &Tensor| t.narrow(2, p, 1);
            heads.step(
                &at(&q),
                &at(&k),
                &at(&v),
                Some(&at(&g)),
                map,
                &mut s,
                &mut z,
            )
        })
        .collect();
    let e = rel(&Tensor::cat(&outs, 2), &whole);
    assert!(e < 1e-5, "FAVOR+ step differs from forward: {e}");
    // and a state carried from a first piece continues it
    let (mut s2, mut z2) = (Tensor::zeros([b, h, m, 5], f), Tensor::zeros([b, h, m], f));
    let first = heads.forward(
        &q.narrow(2, 0, 4),
        &k.narrow(2, 0, 4),
        &v.narrow(2, 0, 4),
        Some(&g.narrow(2, 0, 4)),
        map,
        Some((&mut s2, &mut z2)),
    );
    let rest = heads.forward(
        &q.narrow(2, 4, l - 4),
        &k.narrow(2, 4, l - 4),
        &v.narrow(2, 4, l - 4),
        Some(&g.narrow(2, 4, l - 4)),
        map,
        Some((&mut s2, &mut z2)),
    );
    assert!(rel(&Tensor::cat(&[first, rest], 2), &whole) < 1e-5);
    assert!(rel(&s2, &s) < 1e-5 && rel(&z2, &z) < 1e-5);
}

#[test]
fn embeddings_code_depends_on_the_position_only_and_the_tied_head_is_x_e_t() {
    use crate::model::embed::Embeddings;
    use crate::model::head::OutputHead;
    let cfg = ModelConfig::preset("tiny", V)
        .unwrap()
        .with_positional("ape")
        .unwrap();
    tch::manual_seed(13);
    let vs = nn::VarStore::new(Device::Cpu);
    let embed = Embeddings::new(&cfg, &vs.root());
    let toks = tokens(2, 12, 4);
    let whole = embed.forward(&toks, 100, None);
    let tail = embed.forward(&toks.narrow(1, 5, 7), 105, None);
    assert!(rel(&tail, &whole.narrow(1, 5, 7)) == 0.0);
    // the code is there: the same tokens elsewhere embed differently
    assert!(rel(&embed.forward(&toks, 0, None), &whole) > 1e-2);
    let mut tied = cfg.clone();
    tied.tie_embeddings = true;
    tied.scaled_embeddings = false;
    let head = OutputHead::new(&tied, &vs.root().sub("tied"), &embed.weight);
    let x = Tensor::randn([2, 3, cfg.d_model], (Kind::Float, Device::Cpu));
    let logits = head.forward(&x);
    assert_eq!(logits.size(), [2, 3, V]);
    let expect = x.apply(&head.norm).matmul(&embed.weight.tr());
    assert!(rel(&logits, &expect) == 0.0);
}

/// The logits of every variant in bf16 stay close to f32's (a few bf16 roundings of each
/// product apart), train with gradients on the f32 weights, and keep the recurrence: a
/// bf16 model's steps (on the host for the shipped kind of model, with bf16 weights and
/// f32 activations) give the logits of its bf16 parallel form.
#[test]
fn bf16_products_stay_close_to_f32_and_keep_the_recurrence() {
    use crate::model::Precision;
    for (name, cfg) in variants() {
        let (vs, mut m) = build(&cfg, 11);
        m.freeze(5);
        let toks = tokens(2, 40, 11);
        let f32_logits = m.forward_t(&toks, 0, false);
        assert_eq!(m.set_precision(Precision::Bf16).precision, Precision::Bf16);
        let bf = m.forward_t(&toks, 0, false);
        assert_eq!(bf.kind(), Kind::Float, "{name}");
        let e = rel(&bf, &f32_logits);
        assert!(e < 0.05, "{name}: bf16 logits {e} away from f32");
        assert!(e > 1e-6, "{name}: bf16 changed nothing ({e})");
        // a training step's gradients reach the f32 weights, finite
        let loss = m
            .forward_train(&toks, 0)
            .view([-1, V])
            .cross_entropy_for_logits(&toks.view([-1]));
        loss.backward();
        for (n, t) in vs.variables() {
            assert_eq!(t.kind(), Kind::Float, "{name}: {n} is no longer f32");
            if t.requires_grad() && t.grad().defined() {
                let g = t.grad();
                assert!(
                    g.isfinite().all().int64_value(&[]) == 1,
                    "{name}: {n} has a non-finite gradient"
                );
            }
        }
        // the recurrence in bf16
        let mut st = m.begin(2);
        let pre = m.prefill(&toks.narrow(1, 0, 25), &mut st);
        // The 25-row prefill and the 40-row pass may sum a product in a different order:
        // libtorch's bf16 kernels (AVX512-BF16, AMX) and its f32 ones (whose result is
        // rounded to bf16 where those are missing) both block their sums by the number
        // of rows on some CPUs (an AVX-512 Xeon gave 1.3e-3 here, an AVX2 EPYC < 1e-4),
        // and a product near a rounding boundary then lands on the neighbouring bf16
        // value: a bf16 rounding apart, as the steps below, never a wrong state (which
        // moves the logits by their own size).
        let e = rel(&pre, &bf.narrow(1, 0, 25));
        assert!(
            e < 0.03,
            "{name}: bf16 prefill {e} away from the parallel form"
        );
        for i in 25..40 {
            let e = rel(&m.step(&toks.select(1, i), &mut st), &bf.select(1, i));
            // the host step keeps its activations in f32 where the parallel form rounds
            // them: a bf16 rounding apart, not more
            assert!(e < 0.03, "{name}: bf16 step at {i} differs ({e})");
        }
        assert_eq!(m.set_precision(Precision::F32).precision, Precision::F32);
        assert!(
            rel(&m.forward_t(&toks, 0, false), &f32_logits) < 1e-6,
            "{name}: back to f32"
        );
    }
}

#[test]
fn musical_rope_without_musical_pairs_is_plain_rope() {
    // every pair on the token index: the per-sequence tables through libtorch give the
    // fused kernel's logits
    let mut plain = variant("spe-sine 2 rope local heads window 6");
    let (vs_plain, mut a) = build(&plain, 11);
    plain.musical_rope = Some(musical(0, 0));
    let (mut vs_m, mut b) = build(&plain, 11);
    vs_m.copy(&vs_plain).unwrap();
    a.freeze(5);
    b.freeze(5);
    let toks = tokens(2, 40, 4);
    for offset in [0, 777] {
        let (la, lb) = (
            a.forward_t(&toks, offset, false),
            b.forward_t(&toks, offset, false),
        );
        assert!(rel(&lb, &la) < 1e-6, "offset {offset}: {}", rel(&lb, &la));
    }
}

#[test]
fn musical_rope_reads_each_sequence_clock() {
    let cfg = variant("spe-sine 2 musical rope local heads window 6");
    let (_vs, mut m) = build(&cfg, 12);
    m.freeze(6);
    let toks = tokens(3, 36, 5);
    let all = m.forward_t(&toks, 0, false);
    for r in 0..3 {
        let one = m.forward_t(&toks.narrow(0, r, 1), 0, false);
        assert!(rel(&one, &all.narrow(0, r, 1)) < 1e-5, "row {r}");
    }
    // moving one Position token (id 4 + p) of the past moves later logits, though the
    // token lags stay the same: the heads see the clock
    let at = (0..36)
        .find(|&i| (4..24).contains(&toks.int64_value(&[0, i])) && i > 2 && i < 20)
        .expect("a Position token early in row 0");
    let moved = toks.narrow(0, 0, 1).copy();
    let id = moved.int64_value(&[0, at]);
    let _ = moved.get(0).get(at).fill_(4 + (id - 4 + 7) % 20);
    let (before, after) = (
        m.forward_t(&toks.narrow(0, 0, 1), 0, false),
        m.forward_t(&moved, 0, false),
    );
    assert!(
        rel(
            &before.narrow(1, at + 1, 36 - at - 1),
            &after.narrow(1, at + 1, 36 - at - 1)
        ) > 1e-4
    );
    assert!(
        rel(&before.narrow(1, 0, at), &after.narrow(1, 0, at)) < 1e-6,
        "causal"
    );
}

/// Two models of configs `a` and `b` (which must hold the same variables) with the
/// weights of `a` in both and the same frozen noise and features, with their stores.
fn twins(a: &ModelConfig, b: &ModelConfig) -> ([nn::VarStore; 2], Transformer, Transformer) {
    let [(ma, vs), (mb, mut vs_b)] = [a, b].map(|cfg| {
        let (vs, mut m) = build(cfg, 13);
        m.freeze(7);
        (m, vs)
    });
    vs_b.copy(&vs).unwrap();
    ([vs, vs_b], ma, mb)
}

#[test]
fn spe_in_musical_time_reads_each_sequence_clock() {
    for name in [
        "spe-sine in musical time, 2 musical rope local heads window 6",
        "spe-sine per layer in musical time, 1 rope local head window 4",
        "spe-sine in musical time on a 7-step bar, 2 musical rope local heads window 6",
    ] {
        let mut plain = variant(name);
        plain.musical_spe_bar = None;
        plain.musical_spe = false;
        // the same weights and noise, with SPE in musical time and on the token index
        let (_vs, m, p) = twins(&variant(name), &plain);
        let toks = tokens(3, 36, 6);
        let all = m.forward_t(&toks, 0, false);
        // every row at its own clock: alone, it gives the same logits
        for r in 0..3 {
            let one = m.forward_t(&toks.narrow(0, r, 1), 0, false);
            assert!(rel(&one, &all.narrow(0, r, 1)) < 1e-5, "{name}: row {r}");
        }
        // on the token index the logits differ: the FAVOR+ heads' codes stand at the
        // clock's positions
        let other = p.forward_t(&toks, 0, false);
        assert!(rel(&other, &all) > 1e-4, "{name}: {}", rel(&other, &all));
        // nor does the offset of a call move them: the SPE positions come from the clock,
        // and the local heads' RoPE is relative (with SPE on the token index the frozen
        // codes of positions 500.. differ from those of 0..)
        let later = m.forward_t(&toks, 500, false);
        assert!(rel(&later, &all) < 1e-5, "{name}: {}", rel(&later, &all));
        let plain_later = p.forward_t(&toks, 500, false);
        assert!(rel(&plain_later, &other) > 1e-4, "{name}");
    }
    // the bar the SPE clock counts changes the lags, so the logits
    let name = "spe-sine in musical time, 2 musical rope local heads window 6";
    let mut short = variant(name);
    short.musical_spe_bar = Some(7);
    let (_vs, a, b) = twins(&variant(name), &short);
    let toks = tokens(3, 36, 6);
    let d = rel(&a.forward_t(&toks, 0, false), &b.forward_t(&toks, 0, false));
    assert!(d > 1e-4, "{d}");
}

#[test]
fn a_zero_bar_embedding_changes_nothing_and_a_trained_one_reads_the_bars() {
    let with = variant("spe-sine 2 rope local heads, bar embedding 4");
    let mut without = with.clone();
    without.bar_embedding = None;
    // as made (zeros): the same logits as the model without the table
    // (the same weights copied over by name)
    let vs_a = nn::VarStore::new(Device::Cpu);
    let mut a = Transformer::new(&vs_a.root(), &with).unwrap();
    let vs_b = nn::VarStore::new(Device::Cpu);
    let mut b = Transformer::new(&vs_b.root(), &without).unwrap();
    assert!(copy_shared(&vs_a, &vs_b).is_empty());
    let weights = vs_a.variables();
    assert_eq!(
        weights["bar_embed.weight"].abs().max().double_value(&[]),
        0.0
    );
    a.freeze(3);
    b.freeze(3);
    let toks = tokens(2, 30, 6);
    assert_eq!(vs_a.variables().len(), vs_b.variables().len() + 1);
    let same = rel(&a.forward_t(&toks, 0, false), &b.forward_t(&toks, 0, false));
    assert!(same == 0.0, "{same}");
    // with weights: a Bar token (id 3) put in place of another token after a BOS (id 1)
    // moves the logits of the tokens after it, not those before
    let (_vs, mut m) = build(&with, 22);
    m.freeze(4);
    let row = toks.narrow(0, 0, 1).copy();
    let _ = row.get(0).get(3).fill_(1);
    let ids = Vec::<i64>::try_from(&row.view([-1])).unwrap();
    let bos = 3;
    let at = (bos + 1..30)
        .find(|&i| ids[i] != 1 && ids[i] != 3)
        .expect("a token to turn into a Bar");
    let moved = row.copy();
    let _ = moved.get(0).get(at as i64).fill_(3);
    let (before, after) = (m.forward_t(&row, 0, false), m.forward_t(&moved, 0, false));
    let at = at as i64;
    assert!(
        rel(&before.narrow(1, 0, at), &after.narrow(1, 0, at)) < 1e-6,
        "causal"
    );
    assert!(
        rel(
            &before.narrow(1, at, 30 - at),
            &after.narrow(1, at, 30 - at)
        ) > 1e-4
    );
}

#[test]
fn bar_rows_before_the_first_bos_are_the_unknown_row() {
    // a window with no BOS: every token takes row N, so the Bar tokens in it do not move
    // the embedding of the tokens after them (only the attention sees them)
    let cfg = variant("spe-conv bar embedding 2");
    let (vs, m) = build(&cfg, 23);
    let bar = vs
        .variables()
        .remove("bar_embed.weight")
        .expect("the bar table");
    assert_eq!(bar.size(), [3, cfg.d_model]);
    let toks = Tensor::from_slice(&[7i64, 3, 9, 3, 11]).view([1, 5]);
    let mut st = m.begin(1);
    let _ = m.prefill(&toks, &mut st);
    assert_eq!(st.bars, [crate::model::clock::BarIndex(None)]);
    let _ = m.prefill(&Tensor::from_slice(&[1i64, 3, 3, 3]).view([1, 4]), &mut st);
    assert_eq!(st.bars, [crate::model::clock::BarIndex(Some(3))]);
    // the state's index survives copies and row selections
    assert_eq!(st.copy().bars, st.bars);
    let two = st.select(&Tensor::from_slice(&[0i64, 0]));
    assert_eq!(two.bars.len(), 2);
}

#[test]
fn a_known_bar_index_is_the_state_with_that_index() {
    // forward_from(window, bars = [k]) == the prefill of a state whose next token is at
    // the window's offset and whose bar index is k; "not known" (forward_t) differs
    for name in [
        "spe-sine 2 rope local heads, bar embedding 4",
        "spe-conv bar embedding 2",
    ] {
        let cfg = variant(name);
        let (_vs, mut m) = build(&cfg, 24);
        m.freeze(5);
        // no BOS (id 1) in the window: the index comes from outside only
        let ids: Vec<i64> = [3i64, 7, 9, 3, 11, 3, 8, 10, 3, 12]
            .iter()
            .copied()
            .chain([3i64, 7, 9, 3, 11, 3, 8, 10, 3, 12])
            .collect();
        let toks = Tensor::from_slice(&ids).view([2, 10]);
        let offset = 17;
        let known = m.forward_from(&toks, offset, false, Some(&[0, 2]));
        let mut st = m.begin_at(2, offset);
        st.bars = vec![
            crate::model::clock::BarIndex(Some(0)),
            crate::model::clock::BarIndex(Some(2)),
        ];
        let stepped = m.prefill(&toks, &mut st);
        assert!(
            rel(&known, &stepped) < 1e-4,
            "{name}: {}",
            rel(&known, &stepped)
        );
        let unknown = m.forward_t(&toks, offset, false);
        assert!(rel(&known, &unknown) > 1e-4, "{name}");
        // the two rows differ only by their index (bars 1 and 3 after the first Bar,
        // one row for both in a table of 2)
        let rows = known.narrow(0, 0, 1).copy() - known.narrow(0, 1, 1);
        let differ = rows.abs().max().double_value(&[]) > 1e-5;
        assert_eq!(differ, cfg.bar_embedding > Some(2), "{name}");
    }
}

#[test]
fn a_new_write_gate_changes_nothing_and_a_trained_one_does() {
    // zero weights make every gate 1/2, which the read's normalisation cancels; the gate
    // draws nothing at initialisation, so the rest of the model is the same
    let mut plain = variant("spe-sine write gate, 2 rope local heads window 6");
    plain.favor_write_gate = false;
    let mut gated = plain.clone();
    gated.favor_write_gate = true;
    tch::manual_seed(11);
    let vs_a = nn::VarStore::new(Device::Cpu);
    let mut a = Transformer::new(&vs_a.root(), &plain).unwrap();
    let vs_b = nn::VarStore::new(Device::Cpu);
    let mut b = Transformer::new(&vs_b.root(), &gated).unwrap();
    // the same weights by name, the gate's own only in the gated model
    let extra = copy_shared(&vs_a, &vs_b);
    assert!(
        !extra.is_empty() && extra.iter().all(|n| n.contains("write_gate")),
        "{extra:?}"
    );
    a.freeze(5);
    b.freeze(5);
    let toks = tokens(2, 40, 4);
    let (la, lb) = (a.forward_t(&toks, 0, false), b.forward_t(&toks, 0, false));
    assert!(rel(&lb, &la) < 1e-5, "{}", rel(&lb, &la));
    // gates that differ by token do change the outputs
    tch::no_grad(|| {
        for (name, mut t) in vs_b.variables() {
            if name.contains("write_gate.weight") {
                t.copy_(&(Tensor::randn_like(&t) * 0.5));
            }
        }
    });
    let lc = b.forward_t(&toks, 0, false);
    assert!(rel(&lc, &la) > 1e-3, "{}", rel(&lc, &la));
}
