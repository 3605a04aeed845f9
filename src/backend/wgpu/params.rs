//! The uniform parameters of a dispatch.

/// Uniform parameters: up to 16 scalar words, in the order of the kernel's `Params` struct.
#[derive(Clone, Default)]
pub(super) struct Params(Vec<u32>);

impl Params {
    pub(super) fn u(mut self, x: impl TryInto<u32>) -> Self {
        self.0.push(
            x.try_into()
                .unwrap_or_else(|_| panic!("kernel parameter does not fit in u32")),
        );
        self
    }
    pub(super) fn f(mut self, x: f32) -> Self {
        self.0.push(x.to_bits());
        self
    }
    /// The 16 words of a uniform slot, zero-padded.
    pub(super) fn words(&self, kernel: &str) -> [u32; 16] {
        assert!(self.0.len() <= 16, "kernel {kernel}: too many parameters");
        let mut words = [0; 16];
        words[..self.0.len()].copy_from_slice(&self.0);
        words
    }
}
