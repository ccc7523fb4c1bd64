//! Rotary position embedding (RoPE, Su et al. 2021) for the local softmax heads with
//! `local_position = "rope"`.
//!
//! Invariants: the pair (x_j, x_{j+D/2}) of position p turns by p * ROPE_BASE^(-2j/D);
//! angles are formed in f64 (positions run past 2^24), the turned rows are f32. The fused
//! CPU kernel (`rope.cpp`) and the libtorch form give the same floats.

use tch::{Device, Kind, Tensor};

use crate::model::clock::{self, ClockState};
use crate::model::config::{MusicalRope, ROPE_BASE};
use crate::model::ffi::unit_last_stride;
use crate::model::{as_kind, cpu_f32};

/// Rotary position embedding of `x` (B, H, L, D), D even, at absolute positions
/// start..start+L: the pair (x_j, x_{j+D/2}) of position p turns by the angle
/// p * ROPE_BASE^(-2j/D). A turned query at p and a turned key at p' then have the dot
/// product of the plain ones with the pair rotations of p - p' between them, so
/// softmax logits depend on the lag only, and a state that caches turned keys can be
/// continued at any offset.
pub fn rope(x: &Tensor, start: i64) -> Tensor {
    let (l, dim) = (x.size()[2], x.size()[3]);
    apply_rope(x, &rope_tables(start, l, dim, x.device()))
}

/// The RoPE tables of positions start..start+len, each (len, dim) f32, in the form
/// [`apply_rope`] uses them: `[cos, cos]` and `[-sin, sin]` of the angles of the dim/2
/// pairs; angles are formed in f64 (positions run past 2^24).
pub(crate) fn rope_tables(start: i64, len: i64, dim: i64, dev: Device) -> (Tensor, Tensor) {
    let w = Tensor::from_slice(&rope_frequencies(dim)).to_device(dev);
    let pos = Tensor::arange_start(start, start + len, (Kind::Double, dev)).unsqueeze(1);
    let ang = pos * w.unsqueeze(0);
    let (cos, sin) = (ang.cos(), ang.sin());
    (
        Tensor::cat(&[&cos, &cos], 1).to_kind(Kind::Float),
        Tensor::cat(&[-&sin, sin], 1).to_kind(Kind::Float),
    )
}

/// The angle per position of each pair j < dim/2, ROPE_BASE^(-2j/dim), in f64.
pub(crate) fn rope_frequencies(dim: i64) -> Vec<f64> {
    (0..dim / 2)
        .map(|j| (j as f64 * (-2.0 * ROPE_BASE.ln() / dim as f64)).exp())
        .collect()
}

/// [`rope`] with precomputed [`rope_tables`]; the result is f32.
///
/// With x = [x1, x2] (the halves of the last axis), the turned pairs are
/// [x1 cos - x2 sin, x1 sin + x2 cos] = x [cos, cos] + [x2, x1] [-sin, sin]: two
/// products and a sum over the whole width, where the halves took four products, two
/// sums and a concatenation over rows of half the width. Both give the same floats
/// (`a + (-b)` is `a - b`, and sums commute).
///
/// On the CPU in f32 both ways are one pass over the rows (`src/model/rope.cpp`),
/// elsewhere [`apply_rope_libtorch`].
pub(crate) fn apply_rope(x: &Tensor, tables: &(Tensor, Tensor)) -> Tensor {
    let (cos, sin) = tables;
    if !(cpu_f32(x) && cpu_f32(cos) && cpu_f32(sin)) {
        return apply_rope_libtorch(x, tables);
    }
    let x = unit_last_stride(x);
    // SAFETY: live tensor handles; the result is a new tensor or null.
    unsafe {
        crate::model::ffi::owned_result(
            crate::model::ffi::cadenza_rope(x.as_ptr(), cos.as_ptr(), sin.as_ptr()),
            "fused RoPE",
        )
    }
}

/// [`apply_rope`] in libtorch calls (any device and kind).
pub(crate) fn apply_rope_libtorch(x: &Tensor, (cos, sin): &(Tensor, Tensor)) -> Tensor {
    let half = x.size()[3] / 2;
    let x = as_kind(x, Kind::Float);
    &x * cos + x.roll([half], [3]) * sin
}

/// The RoPE tables of a call whose tokens stand at musical coordinates `coords` (one row
/// per sequence, token `start + i` at `coords[b][i]`; see [`crate::model::clock`]): each
/// pair turned by its axis's coordinate ([`MusicalRope::frequencies`]). Returns
/// `[cos, cos]` and `[-sin, sin]`, each (B, 1, L, dim) f32, for [`apply_rope_libtorch`].
pub(crate) fn musical_rope_tables(
    coords: &[Vec<ClockState>],
    start: i64,
    dim: i64,
    m: &MusicalRope,
    dev: Device,
) -> (Tensor, Tensor) {
    let freqs = m.frequencies(dim);
    let (b, l) = (
        coords.len() as i64,
        coords.first().map_or(0, Vec::len) as i64,
    );
    let ang: Vec<f64> = coords
        .iter()
        .flat_map(|row| {
            let freqs = &freqs;
            row.iter()
                .enumerate()
                .flat_map(move |(i, &at)| clock::angles(freqs, start + i as i64, at))
        })
        .collect();
    let ang = Tensor::from_slice(&ang)
        .view([b, 1, l, dim / 2])
        .to_device(dev);
    let (cos, sin) = (ang.cos(), ang.sin());
    (
        Tensor::cat(&[&cos, &cos], 3).to_kind(Kind::Float),
        Tensor::cat(&[-&sin, sin], 3).to_kind(Kind::Float),
    )
}

/// (cos, sin) of every pair's angle for one token, in f32 from f64 angles, as
/// [`rope_tables`] or [`musical_rope_tables`] form them: the turn of a generation step.
pub(crate) fn turn_of(
    musical: Option<&MusicalRope>,
    dim: i64,
    token: i64,
    at: ClockState,
) -> Vec<(f32, f32)> {
    let cs = |a: f64| (a.cos() as f32, a.sin() as f32);
    match musical {
        Some(m) => clock::angles(&m.frequencies(dim), token, at)
            .map(cs)
            .collect(),
        None => rope_frequencies(dim)
            .iter()
            .map(|w| cs(token as f64 * w))
            .collect(),
    }
}
