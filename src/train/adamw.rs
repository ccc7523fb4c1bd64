//! AdamW over plain tensors. tch's optimizers cannot save their state, and a
//! resumed run must continue with the same moments, so this one is ours.

use std::collections::HashMap;
use std::path::Path;

use anyhow::{bail, Context, Result};
use tch::{Kind, Tensor};

/// Whether a parameter gets weight decay: not norms, biases, embeddings, or
/// the SPE and gate parameters.
pub fn decays(name: &str) -> bool {
    !(name.contains("norm")
        || name.ends_with("bias")
        || name.contains("embed")
        || name.contains("spe")
        || name.contains("gate"))
}

pub struct AdamW {
    /// (name, parameter, first moment, second moment), sorted by name.
    params: Vec<(String, Tensor, Tensor, Tensor)>,
    pub step: u64,
    pub beta1: f64,
    pub beta2: f64,
    pub eps: f64,
    pub weight_decay: f64,
}

impl AdamW {
    pub fn new(
        vars: HashMap<String, Tensor>,
        beta1: f64,
        beta2: f64,
        eps: f64,
        weight_decay: f64,
    ) -> AdamW {
        let mut params: Vec<_> = vars
            .into_iter()
            .filter(|(_, t)| t.requires_grad())
            .map(|(n, t)| {
                let m = t.zeros_like().to_kind(Kind::Float);
                let v = t.zeros_like().to_kind(Kind::Float);
                (n, t, m, v)
            })
            .collect();
        params.sort_by(|a, b| a.0.cmp(&b.0));
        AdamW {
            params,
            step: 0,
            beta1,
            beta2,
            eps,
            weight_decay,
        }
    }

    pub fn zero_grad(&mut self) {
        for (_, p, _, _) in &mut self.params {
            p.zero_grad();
        }
    }

    /// Global gradient norm; scales gradients down to `max_norm` when above
    /// it (0 = no clipping). Returns the norm before clipping.
    pub fn clip_grad_norm(&mut self, max_norm: f64) -> f64 {
        tch::no_grad(|| {
            let sq: Vec<Tensor> = self
                .params
                .iter()
                .filter_map(|(_, p, _, _)| {
                    let g = p.grad();
                    g.defined()
                        .then(|| g.to_kind(Kind::Float).square().sum(Kind::Float))
                })
                .collect();
            if sq.is_empty() {
                return 0.0;
            }
            let norm = Tensor::stack(&sq, 0)
                .sum(Kind::Float)
                .sqrt()
                .double_value(&[]);
            if max_norm > 0.0 && norm > max_norm {
                let scale = max_norm / (norm + 1e-6);
                for (_, p, _, _) in &self.params {
                    let mut g = p.grad();
                    if g.defined() {
                        let _ = g.g_mul_scalar_(scale);
                    }
                }
            }
            norm
        })
    }

    /// One update with learning rate `lr`.
    pub fn update(&mut self, lr: f64) {
        self.step += 1;
        let t = self.step as i32;
        let bc1 = 1.0 - self.beta1.powi(t);
        let bc2 = 1.0 - self.beta2.powi(t);
        tch::no_grad(|| {
            for (name, p, m, v) in &mut self.params {
                let g = p.grad();
                if !g.defined() {
                    continue;
                }
                let g = g.to_kind(Kind::Float);
                let _ = m
                    .g_mul_scalar_(self.beta1)
                    .g_add_(&(&g * (1.0 - self.beta1)));
                let _ = v
                    .g_mul_scalar_(self.beta2)
                    .g_add_(&(g.square() * (1.0 - self.beta2)));
                if self.weight_decay > 0.0 && decays(name) {
                    let _ = p.g_mul_scalar_(1.0 - lr * self.weight_decay);
                }
                let denom = (&*v / bc2).sqrt() + self.eps;
                let update = (&*m / bc1) / denom * lr;
                let _ = p.g_sub_(&update.to_kind(p.kind()));
            }
        });
    }

    /// Saves the moments and the step count (safetensors).
    pub fn save(&self, path: &Path) -> Result<()> {
        let mut named: Vec<(String, Tensor)> = Vec::with_capacity(self.params.len() * 2 + 1);
        for (n, _, m, v) in &self.params {
            named.push((format!("m.{n}"), m.shallow_clone()));
            named.push((format!("v.{n}"), v.shallow_clone()));
        }
        named.push(("step".into(), Tensor::from_slice(&[self.step as i64])));
        Tensor::write_safetensors(&named, path)
            .with_context(|| format!("cannot write optimizer state {}", path.display()))
    }

    pub fn load(&mut self, path: &Path) -> Result<()> {
        let named: HashMap<String, Tensor> = Tensor::read_safetensors(path)
            .with_context(|| format!("cannot read optimizer state {}", path.display()))?
            .into_iter()
            .collect();
        tch::no_grad(|| -> Result<()> {
            for (n, p, m, v) in &mut self.params {
                for (prefix, dst) in [("m", &mut *m), ("v", &mut *v)] {
                    let key = format!("{prefix}.{n}");
                    let src = named.get(&key).with_context(|| {
                        format!("{}: no {key} (optimizer of another model?)", path.display())
                    })?;
                    if src.size() != p.size() {
                        bail!(
                            "{}: {key} has shape {:?}, the model's is {:?}",
                            path.display(),
                            src.size(),
                            p.size()
                        );
                    }
                    dst.copy_(&src.to_device(dst.device()));
                }
            }
            Ok(())
        })?;
        self.step = named
            .get("step")
            .map(|t| t.int64_value(&[0]) as u64)
            .with_context(|| format!("{}: no step", path.display()))?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn minimizes_a_quadratic_and_skips_decay_where_asked() {
        let x = Tensor::from_slice(&[3.0f32, -2.0]).set_requires_grad(true);
        let mut vars = HashMap::new();
        vars.insert("w".to_string(), x.shallow_clone());
        let mut opt = AdamW::new(vars, 0.9, 0.99, 1e-8, 0.0);
        for _ in 0..300 {
            opt.zero_grad();
            let loss = x.square().sum(Kind::Float);
            loss.backward();
            opt.clip_grad_norm(1.0);
            opt.update(0.05);
        }
        assert!(x.abs().max().double_value(&[]) < 0.05);
        assert!(decays("blocks.0.attn.q.weight"));
        assert!(!decays("blocks.0.norm1.weight"));
        assert!(!decays("token_embed.weight"));
        assert!(!decays("spe.freqs"));
        assert!(!decays("blocks.1.gate"));
        assert!(!decays("head.bias"));
    }

    #[test]
    fn state_round_trips() {
        let dir = tempfile::tempdir().unwrap();
        let x = Tensor::from_slice(&[1.0f32, 2.0]).set_requires_grad(true);
        let mut vars = HashMap::new();
        vars.insert("w".to_string(), x.shallow_clone());
        let mut a = AdamW::new(vars, 0.9, 0.99, 1e-8, 0.1);
        a.zero_grad();
        x.square().sum(Kind::Float).backward();
        a.update(0.1);
        a.save(&dir.path().join("o.safetensors")).unwrap();
        let mut vars = HashMap::new();
        vars.insert("w".to_string(), x.shallow_clone());
        let mut b = AdamW::new(vars, 0.9, 0.99, 1e-8, 0.1);
        b.load(&dir.path().join("o.safetensors")).unwrap();
        assert_eq!(b.step, 1);
        assert!(b.params[0].2.allclose(&a.params[0].2, 0.0, 0.0, false));
        assert!(b.params[0].3.allclose(&a.params[0].3, 0.0, 0.0, false));
    }
}
