//! Counter-based deterministic noise: every frozen random quantity of the model is a pure
//! function of (seed, tag, a, b), so a position's noise can be regenerated for any position
//! (no maximum length) and the parallel and recurrent forms see exactly the same numbers.

use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use rand_distr::{Distribution, StandardNormal};
use tch::{Device, Kind, Tensor};

/// Domain tags so that different frozen quantities never share a stream.
pub(crate) const TAG_SINE_Z: u64 = 1;
pub(crate) const TAG_GATE_XI: u64 = 2;
pub(crate) const TAG_FAVOR: u64 = 3;
pub(crate) const TAG_CONV_NOISE: u64 = 4;

/// A ChaCha8 generator keyed by (seed, tag, a, b).
pub(crate) fn keyed_rng(seed: u64, tag: u64, a: u64, b: i64) -> ChaCha8Rng {
    let mut key = [0u8; 32];
    key[0..8].copy_from_slice(&seed.to_le_bytes());
    key[8..16].copy_from_slice(&tag.to_le_bytes());
    key[16..24].copy_from_slice(&a.to_le_bytes());
    key[24..32].copy_from_slice(&b.to_le_bytes());
    ChaCha8Rng::from_seed(key)
}

/// `n` standard normals (f32) from the keyed stream.
pub(crate) fn keyed_normals(seed: u64, tag: u64, a: u64, b: i64, n: usize) -> Vec<f32> {
    let mut rng = keyed_rng(seed, tag, a, b);
    (0..n).map(|_| StandardNormal.sample(&mut rng)).collect()
}

/// Standard normal tensor of `shape` from the keyed stream, f32 on `device`.
pub(crate) fn keyed_randn(
    seed: u64,
    tag: u64,
    a: u64,
    b: i64,
    shape: &[i64],
    device: Device,
) -> Tensor {
    let n: i64 = shape.iter().product();
    let v = keyed_normals(seed, tag, a, b, n as usize);
    Tensor::from_slice(&v).reshape(shape).to_device(device)
}

/// White noise columns for positions `start .. start+len` of conv code `code`:
/// shape (len, rest...) with `per_position` = product of `rest`. Column p depends only on
/// (seed, code, p).
pub(crate) fn conv_noise_columns(
    seed: u64,
    code: u64,
    start: i64,
    len: i64,
    rest: &[i64],
    device: Device,
    kind: Kind,
) -> Tensor {
    let per: i64 = rest.iter().product();
    let mut v = Vec::with_capacity((len * per) as usize);
    for p in start..start + len {
        let mut rng = keyed_rng(seed, TAG_CONV_NOISE, code, p);
        v.extend((0..per).map(|_| -> f32 { StandardNormal.sample(&mut rng) }));
    }
    let mut shape = vec![len];
    shape.extend_from_slice(rest);
    Tensor::from_slice(&v)
        .reshape(shape.as_slice())
        .to_device(device)
        .to_kind(kind)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn conv_noise_column_depends_only_on_position() {
        let a = conv_noise_columns(7, 0, -3, 10, &[2, 3], Device::Cpu, Kind::Float);
        let b = conv_noise_columns(7, 0, 2, 4, &[2, 3], Device::Cpu, Kind::Float);
        assert_eq!(a.narrow(0, 5, 4), b);
        let c = conv_noise_columns(8, 0, 2, 4, &[2, 3], Device::Cpu, Kind::Float);
        assert_ne!(b, c);
        let d = conv_noise_columns(7, 1, 2, 4, &[2, 3], Device::Cpu, Kind::Float);
        assert_ne!(b, d);
    }
}
