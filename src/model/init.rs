//! GPT-2 initialisation from a seed, bit-identical on every machine: ChaCha8 for the bits and a pure-Rust
//! libm Box–Muller for the normals (the platform's libm may round differently, `libm` the crate does not).

use super::layout::ParamLayout;
use super::ModelConfig;
use rand_chacha::rand_core::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

/// Standard deviation of every weight except the residual output projections.
pub const INIT_STD: f64 = 0.02;

/// A portable stream of standard normal samples.
pub struct NormalStream {
    rng: ChaCha8Rng,
    spare: Option<f64>,
}

impl NormalStream {
    pub fn new(seed: u64) -> Self {
        NormalStream {
            rng: ChaCha8Rng::seed_from_u64(seed),
            spare: None,
        }
    }

    /// A uniform double in (0, 1]: 53 random bits, never 0 so that `ln` is finite.
    fn uniform(&mut self) -> f64 {
        ((self.rng.next_u64() >> 11) + 1) as f64 * (1.0 / (1u64 << 53) as f64)
    }

    pub fn next_normal(&mut self) -> f64 {
        if let Some(z) = self.spare.take() {
            return z;
        }
        let (u1, u2) = (self.uniform(), self.uniform());
        let radius = libm::sqrt(-2.0 * libm::log(u1));
        let angle = 2.0 * std::f64::consts::PI * u2;
        self.spare = Some(radius * libm::sin(angle));
        radius * libm::cos(angle)
    }
}

/// GPT-2 init (as Hugging Face's `_init_weights`): weights N(0, 0.02), the residual output projections
/// (`c_proj.weight`) N(0, 0.02 / sqrt(2 * n_layer)), biases 0, layer-norm weight 1 and bias 0.
pub fn init_params(cfg: &ModelConfig, layout: &ParamLayout, seed: u64) -> Vec<f32> {
    let mut params = vec![0f32; layout.total];
    let mut normals = NormalStream::new(seed);
    let proj_std = INIT_STD / libm::sqrt(2.0 * cfg.n_layer as f64);
    for spec in &layout.specs {
        let dst = &mut params[spec.offset..spec.offset + spec.len];
        if spec.name.contains(".ln_") || spec.name.starts_with("ln_f") {
            if spec.name.ends_with(".weight") {
                dst.fill(1.0);
            }
        } else if spec.shape.len() >= 2 {
            let std = if spec.name.ends_with("c_proj.weight") {
                proj_std
            } else {
                INIT_STD
            };
            for x in dst.iter_mut() {
                *x = (normals.next_normal() * std) as f32;
            }
        }
    }
    params
}
