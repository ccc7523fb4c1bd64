//! The local softmax heads: exact causal softmax attention of each query over the last
//! `window` positions, itself included ([`window_attention`], banded in blocks without a
//! cache, [`banded_attention`]), and their recurrent memory, the [`KvRing`].
//!
//! Invariants:
//! * A query at position p attends to the keys at p - window + 1 ..= p, whatever the pieces
//!   a sequence is cut into (a whole window, prefills of any length, single steps): the
//!   cache or ring holds exactly the positions the next query still sees.
//! * With `window` = [`UNBOUNDED`] the same code is the full causal softmax attention of the
//!   softmax reference model, whose cache then keeps every position.
//! * Softmax over a set of keys does not see their order: a generation step writes one ring
//!   slot in place and reads the others where they lie ([`ring_attention`]); the host step
//!   ([`host_ring_step`]) is the same math in f32, summed in another order.

use tch::{Device, Kind, Tensor};

use crate::model::{as_kind, cpu_f32, host};

/// The local heads of a layer: the first `heads` heads, each attending over the last
/// `window` positions. They own no parameters: their queries, keys and values are the
/// first heads of the layer's projection ([`crate::model::attention::Attention`]).
#[derive(Debug, Clone, Copy)]
pub struct LocalHeads {
    /// How many heads are local (the first ones of the layer).
    pub heads: i64,
    /// Positions each query sees, itself included.
    pub window: i64,
    /// Width of their queries and keys (the SPE realizations R when they share the
    /// filtered ones, the head width with RoPE).
    pub dk: i64,
}

impl LocalHeads {
    /// q (B, hl, L, dk), k (B, hl, L, dk), v (B, hl, L, Dv) -> (B, hl, L, Dv) in `kind`,
    /// computed in f32. With a `ring` (prefill and libtorch steps) the window's earlier
    /// positions come from it and it is advanced; without one the call is a whole window.
    pub fn forward(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        ring: Option<&mut KvRing>,
        kind: Kind,
    ) -> Tensor {
        let (q, k, v) = (
            as_kind(q, Kind::Float), // (B, hl, L, dk)
            as_kind(k, Kind::Float), // (B, hl, L, dk)
            as_kind(v, Kind::Float), // (B, hl, L, Dv)
        );
        let out = match ring {
            Some(ring) => ring_attention(&q, &k, &v, ring),
            None => window_attention(&q, &k, &v, self.window, None),
        }; // (B, hl, L, Dv)
        as_kind(&out, kind)
    }

    /// One generation step of RoPE local heads on the host ([`host_ring_step`]): `rows`
    /// is the layer's projection (B, 3 * d_model) for this position; returns
    /// (B, hl, 1, head_dim) f32.
    pub fn host_step(
        &self,
        rows: &[f32],
        batch: i64,
        d_model: i64,
        head_dim: i64,
        turns: &[Vec<(f32, f32)>],
        ring: &mut KvRing,
    ) -> Tensor {
        let out = host_ring_step(
            rows,
            batch as usize,
            self.heads as usize,
            d_model as usize,
            head_dim as usize,
            turns,
            ring,
        );
        Tensor::from_slice(&out).view([batch, self.heads, 1, head_dim])
    }
}

/// The window of full causal softmax attention: every earlier position.
pub(crate) const UNBOUNDED: i64 = i64::MAX;

/// Causal softmax attention of every query over the `window` most recent
/// positions, itself included: q (B, h, L, dk), k (B, h, L, dk), v (B, h, L, Dv)
/// -> (B, h, L, Dv). `cache` holds the keys and values of positions just
/// before the first query, oldest first (any number: those window or more
/// back are masked out), and is replaced by the last (at most window - 1)
/// positions, those the next call needs. Without a cache, a window that covers the
/// whole call is libtorch's fused causal attention, and a shorter one is
/// [`banded_attention`]; with one, queries go in blocks of `window`, each against
/// at most 2 window - 1 keys: O(L window) time and memory at any length.
/// With `window` = [`UNBOUNDED`] it is plain causal softmax attention, and the
/// cache keeps every position.
pub(crate) fn window_attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    window: i64,
    cache: Option<(&mut Tensor, &mut Tensor)>,
) -> Tensor {
    let l = q.size()[2];
    let dk = q.size()[3];
    let Some((ck, cv)) = cache else {
        return if l <= window {
            // The window covers every earlier position: plain causal softmax, which libtorch
            // fuses (no (L, L) mask or separate softmax kept for the backward pass).
            Tensor::scaled_dot_product_attention::<Tensor>(q, k, v, None, 0.0, true, None, false)
        } else {
            banded_attention(q, k, v, window, BAND_BLOCK)
        };
    };
    let (kp, vp) = (Tensor::cat(&[&*ck, k], 2), Tensor::cat(&[&*cv, v], 2));
    let c = kp.size()[2] - l; // cached positions before the first query
    let dev = q.device();
    let mut outs = Vec::new();
    let mut s = 0;
    while s < l {
        let n = window.min(l - s);
        let k0 = (c + s - (window - 1)).max(0);
        let kn = c + s + n - k0;
        let scores = q
            .narrow(2, s, n)
            .matmul(&kp.narrow(2, k0, kn).transpose(-1, -2))
            / (dk as f64).sqrt();
        // One query (a generation step) sees every key of its slice: no mask.
        let scores = if n == 1 {
            scores
        } else {
            scores.masked_fill(
                &outside_band(c + s, n, k0, kn, window, dev),
                f64::NEG_INFINITY,
            )
        };
        outs.push(scores.softmax(-1, None).matmul(&vp.narrow(2, k0, kn)));
        s += n;
    }
    let total = kp.size()[2];
    if window > total {
        // everything stays: the concatenation is already a fresh tensor
        *ck = kp;
        *cv = vp;
    } else {
        let keep = window - 1;
        *ck = kp.narrow(2, total - keep, keep).copy();
        *cv = vp.narrow(2, total - keep, keep).copy();
    }
    if outs.len() == 1 {
        outs.pop().expect("one block")
    } else {
        Tensor::cat(&outs, 2)
    }
}

/// Queries per block of [`banded_attention`] (at most the window). A block of
/// `BAND_BLOCK` queries computes `BAND_BLOCK * ceil((window - 1) / BAND_BLOCK) + BAND_BLOCK`
/// scores per query where `window` are needed: at window 512, 768 (blocks of 128: 640;
/// of 512: 1,024). With each block one fused attention call, fewer, larger calls won:
/// alternated on the training step at window 512, blocks of 256 against 128 were +4.3 to
/// +5.6% at L = 16,384 (batch 2) and +1.6 to +1.8% at 2,048 (batch 8), and blocks of 512
/// 4-6% slower than 256. (Before the fused calls, blocks of 128 had won: 9% off at 2,048
/// against blocks of `window` sliced with `narrow`.)
pub(crate) const BAND_BLOCK: i64 = 256;

/// [`window_attention`] without a cache and with a window shorter than the call: the
/// queries in blocks of `c = min(block, window)` positions, each block against its own keys
/// and those of the `ceil((window - 1) / c)` blocks before it, masked to the band.
/// The blocks are `split` off q, k and v (views, whose backward is one concatenation):
/// slicing each block's keys out of the whole sequence with `narrow` instead would
/// give every block a backward that zero-fills a gradient of the whole sequence, O(L^2 / c)
/// work in all, which made the step 7% slower at L = 16,384.
pub(crate) fn banded_attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    window: i64,
    block: i64,
) -> Tensor {
    let dev = q.device();
    let c = block.min(window).max(1);
    let back = ((window - 1 + c - 1) / c) as usize; // earlier key blocks a query block reaches
    let (qs, ks, vs) = (q.split(c, 2), k.split(c, 2), v.split(c, 2));
    // every whole block past the first `back` sees the same band: one mask for all
    let mut shared: Option<Tensor> = None;
    let outs: Vec<Tensor> = (0..qs.len())
        .map(|j| {
            let j0 = j.saturating_sub(back);
            let (keys, vals) = (Tensor::cat(&ks[j0..=j], 2), Tensor::cat(&vs[j0..=j], 2));
            let (n, kn) = (qs[j].size()[2], keys.size()[2]);
            let band = || inside_band(j as i64 * c, n, j0 as i64 * c, kn, window, dev);
            let mask = if j >= back && n == c {
                shared.get_or_insert_with(band).shallow_clone()
            } else {
                band()
            };
            // libtorch's fused attention (scale 1/sqrt(dk)) with the band as its mask: no
            // (n, kn) scores kept for the backward pass
            Tensor::scaled_dot_product_attention::<Tensor>(
                &qs[j],
                &keys,
                &vals,
                Some(mask),
                0.0,
                false,
                None,
                false,
            )
        })
        .collect();
    Tensor::cat(&outs, 2)
}

/// The (n, kn) mask of the scores inside the window (true where a query attends), for
/// queries at positions first_q.. and keys at first_k..: 0 <= lag < window.
fn inside_band(first_q: i64, n: i64, first_k: i64, kn: i64, window: i64, dev: Device) -> Tensor {
    outside_band(first_q, n, first_k, kn, window, dev).logical_not()
}

/// The (n, kn) mask of the scores that fall outside the window, for queries at positions
/// first_q.. and keys at first_k..: the lag of key t behind query i must be 0 <= lag < window.
fn outside_band(first_q: i64, n: i64, first_k: i64, kn: i64, window: i64, dev: Device) -> Tensor {
    let qi = Tensor::arange_start(first_q, first_q + n, (Kind::Int64, dev)).unsqueeze(1);
    let kt = Tensor::arange_start(first_k, first_k + kn, (Kind::Int64, dev)).unsqueeze(0);
    let lag = qi - kt;
    lag.lt(0).logical_or(&lag.ge(window))
}

/// The keys and values a local head still sees, for a batch that steps together: `k`
/// (B, H, C, dk) and `v` (B, H, C, Dv), f32, whose C slots grow (doubling) up to `window`
/// as positions arrive, so a huge window costs only what it holds. Slots 0..len hold the
/// last `len` <= window positions: in order while len < window; once the window is full,
/// rotated, `next` being the slot the next position overwrites (its oldest). Softmax over
/// a set of keys does not see their order: a step writes one slot in place and reads the
/// others where they lie, instead of concatenating and copying the window every token.
#[derive(Debug)]
pub struct KvRing {
    pub k: Tensor,
    pub v: Tensor,
    pub window: i64,
    pub len: i64,
    pub next: i64,
}

/// Slots a new [`KvRing`] starts with (fewer when the window is smaller).
const RING_START: i64 = 64;

impl KvRing {
    /// An empty ring for a window of `window` positions.
    pub fn new(
        batch: i64,
        heads: i64,
        window: i64,
        dk: i64,
        dv: i64,
        opts: (Kind, Device),
    ) -> Self {
        let c = window.min(RING_START);
        KvRing {
            k: Tensor::zeros([batch, heads, c, dk], opts),
            v: Tensor::zeros([batch, heads, c, dv], opts),
            window,
            len: 0,
            next: 0,
        }
    }

    fn capacity(&self) -> i64 {
        self.k.size()[2]
    }

    /// Room for at least `n` slots (n <= window), keeping slots 0..len; only before the
    /// window is full, while the slots are in order.
    fn reserve(&mut self, n: i64) {
        let c = self.capacity();
        if n <= c {
            return;
        }
        let mut c2 = c.max(1);
        while c2 < n {
            c2 *= 2;
        }
        let c2 = c2.min(self.window);
        let grow = |t: &Tensor| {
            let mut size = t.size();
            size[2] = c2 - c;
            Tensor::cat(
                &[t, &Tensor::zeros(size.as_slice(), (t.kind(), t.device()))],
                2,
            )
        };
        self.k = grow(&self.k);
        self.v = grow(&self.v);
    }

    /// The same ring with `f` applied to its tensors (copies, batch rows).
    pub fn map(&self, f: impl Fn(&Tensor) -> Tensor) -> KvRing {
        KvRing {
            k: f(&self.k),
            v: f(&self.v),
            window: self.window,
            len: self.len,
            next: self.next,
        }
    }

    /// The held keys and values, oldest first: (B, H, len, d).
    pub fn chronological(&self) -> (Tensor, Tensor) {
        let (w, n) = (self.window, self.next);
        let order = |t: &Tensor| {
            if self.len < w {
                t.narrow(2, 0, self.len)
            } else {
                Tensor::cat(&[t.narrow(2, n, w - n), t.narrow(2, 0, n)], 2)
            }
        };
        (order(&self.k), order(&self.v))
    }

    /// Takes the slot of one more position, a free one or the oldest, and counts the
    /// position as held; the caller writes its key and value there.
    fn take_slot(&mut self) -> i64 {
        if self.len < self.window {
            self.reserve(self.len + 1);
            self.next = self.len;
        }
        let slot = self.next;
        self.len = (self.len + 1).min(self.window);
        self.next = (self.next + 1) % self.window;
        slot
    }

    /// Writes one position (B, H, 1, d) into a free slot, or over the oldest one.
    fn push(&mut self, k: &Tensor, v: &Tensor) {
        let slot = self.take_slot();
        self.k.narrow(2, slot, 1).copy_(k);
        self.v.narrow(2, slot, 1).copy_(v);
    }

    /// Replaces the content by `k`, `v` (B, H, n, d), oldest first, n < window.
    fn refill(&mut self, k: &Tensor, v: &Tensor) {
        let n = k.size()[2];
        self.reserve(n);
        self.k.narrow(2, 0, n).copy_(k);
        self.v.narrow(2, 0, n).copy_(v);
        self.len = n;
        self.next = n;
    }
}

/// [`window_attention`] with the window kept in `ring`: a single query (a generation
/// step) writes its key into the ring and attends over the ring as it lies; longer pieces
/// go through [`window_attention`] on the keys put back in order, and refill the ring.
pub(crate) fn ring_attention(q: &Tensor, k: &Tensor, v: &Tensor, ring: &mut KvRing) -> Tensor {
    if q.size()[2] == 1 {
        ring.push(k, v);
        let dk = q.size()[3];
        let (rk, rv) = (ring.k.narrow(2, 0, ring.len), ring.v.narrow(2, 0, ring.len));
        return (q.matmul(&rk.transpose(-1, -2)) / (dk as f64).sqrt())
            .softmax(-1, None)
            .matmul(&rv);
    }
    let (mut ck, mut cv) = ring.chronological();
    let out = window_attention(q, k, v, ring.window, Some((&mut ck, &mut cv)));
    ring.refill(&ck, &cv);
    out
}

/// A generation step of RoPE local heads done on the host, in one pass, instead of some
/// thirty small libtorch calls per layer (turning q and k, writing the ring, two matmuls,
/// softmax), which at batch 1 cost more than their arithmetic: the same math as
/// [`rope`] then [`ring_attention`], in f32 (angles formed in f64), summed in another
/// order. `qkv` is the layer's projection for this position, (B, 3 * H_all * D) rows on
/// the host, whose heads 0..hl (of each third) are the local ones; returns their outputs
/// (B, hl, D). Only for a CPU ring of contiguous f32 tensors: see [`host_step_ok`].
pub(crate) fn host_ring_step(
    qkv: &[f32],
    batch: usize,
    hl: usize,
    d_model: usize,
    dim: usize,
    turns: &[Vec<(f32, f32)>],
    ring: &mut KvRing,
) -> Vec<f32> {
    assert!(
        host_step_ok(ring)
            && ring.k.size() == [batch as i64, hl as i64, ring.capacity(), dim as i64],
        "host_ring_step: a ring of another shape, kind or device"
    );
    let slot = ring.take_slot() as usize;
    if batch == 0 {
        // (an empty tensor's data pointer may be null)
        return vec![];
    }
    let held = ring.len as usize;
    let cap = ring.capacity() as usize;
    let half = dim / 2;
    assert!(
        turns.len() == 1 || turns.len() == batch,
        "host_ring_step: one list of turns, or one per sequence"
    );
    let rotate = |turn: &[(f32, f32)], x: &[f32], out: &mut [f32]| {
        for (j, &(c, s)) in turn.iter().enumerate() {
            let (x1, x2) = (x[j], x[j + half]);
            out[j] = x1 * c - x2 * s;
            out[j + half] = x1 * s + x2 * c;
        }
    };
    let scale = (dim as f32).sqrt();
    // SAFETY: host_step_ok: both are contiguous f32 CPU tensors of (B, hl, cap, dim)
    // elements, owned by this ring (no other Rust reference to their storage lives
    // while these slices do), and distinct tensors.
    let (kb, vb) = unsafe {
        (
            std::slice::from_raw_parts_mut(ring.k.data_ptr() as *mut f32, batch * hl * cap * dim),
            std::slice::from_raw_parts_mut(ring.v.data_ptr() as *mut f32, batch * hl * cap * dim),
        )
    };
    let mut out = vec![0f32; batch * hl * dim];
    let (mut q, mut scores) = (vec![0f32; dim], vec![0f32; held]);
    for b in 0..batch {
        let row = &qkv[b * 3 * d_model..(b + 1) * 3 * d_model];
        let turn = &turns[if turns.len() == 1 { 0 } else { b }];
        for h in 0..hl {
            let at = |part: usize| &row[part * d_model + h * dim..part * d_model + (h + 1) * dim];
            let base = (b * hl + h) * cap * dim;
            rotate(turn, at(0), &mut q);
            rotate(
                turn,
                at(1),
                &mut kb[base + slot * dim..base + (slot + 1) * dim],
            );
            vb[base + slot * dim..base + (slot + 1) * dim].copy_from_slice(at(2));
            let keys = &kb[base..base + held * dim];
            for (sc, key) in scores.iter_mut().zip(keys.chunks_exact(dim)) {
                *sc = host::dot(&q, key) / scale;
            }
            let max = scores.iter().fold(f32::NEG_INFINITY, |m, &x| m.max(x));
            let mut sum = 0f32;
            for sc in scores.iter_mut() {
                *sc = (*sc - max).exp();
                sum += *sc;
            }
            let o = &mut out[(b * hl + h) * dim..(b * hl + h + 1) * dim];
            for (&p, val) in scores
                .iter()
                .zip(vb[base..base + held * dim].chunks_exact(dim))
            {
                let p = p / sum;
                for (oi, &vi) in o.iter_mut().zip(val) {
                    *oi += p * vi;
                }
            }
        }
    }
    out
}

/// Whether [`host_ring_step`] may work on `ring`'s storage in place.
pub(crate) fn host_step_ok(ring: &KvRing) -> bool {
    [&ring.k, &ring.v]
        .iter()
        .all(|t| cpu_f32(t) && t.is_contiguous())
        && ring.k.size() == ring.v.size()
}
