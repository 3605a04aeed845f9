//! The uniform parameters of each kernel: one `#[repr(C)]` struct per WGSL `struct Params`.
//!
//! Every op family's shader (`shaders/<family>.wgsl`) declares its own `struct Params` of `u32` and `f32`
//! fields, read by every entry point of that file. The Rust struct mirrors it field for field (same names,
//! types and order), so its bytes are what the shader reads; [`KernelParams::FAMILIES`] names the families
//! it serves, and a dispatch of a kernel with another family's struct panics. Each dispatch's slot of the
//! uniform ring is [`PARAMS_BYTES`] long: the struct's words first, zeros after (no shader reads past its
//! struct). A test checks each struct against the WGSL it mirrors.
//!
//! Offsets (`*_off`) are in elements from the start of the bound window (in vec4s for the vec4 kernels).

use super::binding::PARAMS_BYTES;
use bytemuck::{Pod, Zeroable};

/// A kernel's uniform parameters.
pub(super) trait KernelParams: Pod {
    /// The op families (`kernels::FAMILIES` names) whose WGSL `Params` struct this mirrors.
    const FAMILIES: &'static [&'static str];
    /// `(name, type)` of each field, in order, as the WGSL struct declares them.
    #[cfg(test)]
    const FIELDS: &'static [(&'static str, &'static str)];

    /// The words of one uniform slot: this struct's, then zeros.
    fn words(&self) -> [u32; PARAMS_WORDS] {
        const {
            assert!(
                size_of::<Self>() <= PARAMS_BYTES as usize,
                "kernel parameters exceed a uniform slot"
            )
        };
        let mut words = [0u32; PARAMS_WORDS];
        let bytes: &mut [u8] = bytemuck::cast_slice_mut(&mut words);
        bytes[..size_of::<Self>()].copy_from_slice(bytemuck::bytes_of(self));
        words
    }
}

/// Words of one uniform slot.
pub(super) const PARAMS_WORDS: usize = PARAMS_BYTES as usize / 4;

/// A size, count or offset as a parameter word. Panics past `u32::MAX`: no shape the backend accepts
/// reaches it, so that would be a bug.
pub(super) fn word(x: usize) -> u32 {
    u32::try_from(x).unwrap_or_else(|_| panic!("kernel parameter {x} does not fit in u32"))
}

/// Declares a parameter struct: `#[repr(C)]`, `Pod`, its fields public to the backend, and its
/// [`KernelParams`] impl.
macro_rules! kernel_params {
    (
        $(#[$doc:meta])*
        $name:ident for [$($family:literal),+] {
            $($(#[$field_doc:meta])* $field:ident: $ty:ident,)+
        }
    ) => {
        $(#[$doc])*
        #[repr(C)]
        #[derive(Clone, Copy, Debug, Default, PartialEq, Pod, Zeroable)]
        pub(super) struct $name {
            $($(#[$field_doc])* pub(super) $field: $ty,)+
        }

        impl KernelParams for $name {
            const FAMILIES: &'static [&'static str] = &[$($family),+];
            #[cfg(test)]
            const FIELDS: &'static [(&'static str, &'static str)] = &[$((stringify!($field), stringify!($ty))),+];
        }
    };
}

kernel_params! {
    /// `encoder.wgsl`.
    EncoderParams for ["encoder"] {
        /// Forward: b*t rows; wpe backward: b; wte backward: the number of distinct tokens.
        n: u32,
        t: u32,
        c: u32,
        dst_off: u32,
        src0_off: u32,
        src1_off: u32,
        idx_off: u32,
        /// First vocabulary row held by the bound wte window.
        v0: u32,
        /// One past the last one.
        v1: u32,
    }
}

kernel_params! {
    /// `layernorm.wgsl`, forward and backward.
    LayerNormParams for ["layernorm"] {
        n: u32,
        c: u32,
        /// out (forward) or dinp (backward).
        out_off: u32,
        mean_off: u32,
        rstd_off: u32,
        inp_off: u32,
        w_off: u32,
        /// bias (forward) or dbias (backward).
        b_off: u32,
        dout_off: u32,
        dw_off: u32,
    }
}

kernel_params! {
    /// `matmul.wgsl` (strided, and the bias gradient), and `matmul4_shared.wgsl`, shared by the vec4 kernel
    /// and the texture-fed ones, whose A and B offsets and row strides count vec4s (and the texture-fed
    /// kernels do not read them).
    MatmulParams for ["matmul", "matmul4"] {
        m: u32,
        n: u32,
        k: u32,
        c_off: u32,
        c_rs: u32,
        a_off: u32,
        a_rs: u32,
        a_cs: u32,
        b_off: u32,
        b_rs: u32,
        b_cs: u32,
        bias_off: u32,
        /// Bit 0: accumulate into C; bit 1: add the bias.
        flags: u32,
    }
}

impl TiledMatmulParams {
    /// `strided`'s operands and `flags`, unsplit (k_split = k, one slice).
    pub fn unsplit(strided: MatmulParams, flags: u32) -> Self {
        let MatmulParams {
            m,
            n,
            k,
            c_off,
            c_rs,
            a_off,
            a_rs,
            a_cs,
            b_off,
            b_rs,
            b_cs,
            bias_off,
            flags: _,
        } = strided;
        TiledMatmulParams {
            m,
            n,
            k,
            c_off,
            c_rs,
            a_off,
            a_rs,
            a_cs,
            b_off,
            b_rs,
            b_cs,
            bias_off,
            flags,
            k_split: k,
            splits: 1,
        }
    }
}

kernel_params! {
    /// `matmul_tiled.wgsl`: [`MatmulParams`] and the split-K range.
    TiledMatmulParams for ["matmul_tiled"] {
        m: u32,
        n: u32,
        k: u32,
        c_off: u32,
        c_rs: u32,
        a_off: u32,
        a_rs: u32,
        a_cs: u32,
        b_off: u32,
        b_rs: u32,
        b_cs: u32,
        bias_off: u32,
        /// Bit 0: accumulate into C; bit 1: add the bias; bit 2: A's k stride is 1; bit 3: B's n stride is 1.
        flags: u32,
        k_split: u32,
        splits: u32,
    }
}

kernel_params! {
    /// `attention.wgsl`, forward and backward.
    AttentionParams for ["attention"] {
        b: u32,
        t: u32,
        c: u32,
        nh: u32,
        /// out (forward) or dqkv (backward).
        out_off: u32,
        lse_off: u32,
        qkv_off: u32,
        delta_off: u32,
        dout_off: u32,
        /// The forward's out, read by backward's row dot products.
        fout_off: u32,
    }
}

kernel_params! {
    /// `gelu.wgsl`.
    GeluParams for ["gelu"] {
        n: u32,
        out_off: u32,
        inp_off: u32,
        dout_off: u32,
    }
}

kernel_params! {
    /// `residual.wgsl` and `residual4.wgsl` (whose `n` and offsets count vec4s).
    ResidualParams for ["residual", "residual4"] {
        n: u32,
        dst_off: u32,
        a_off: u32,
        b_off: u32,
        /// The scalar of `scale` and `fill`.
        s: f32,
    }
}

kernel_params! {
    /// `crossentropy.wgsl`, forward and backward.
    CrossEntropyParams for ["crossentropy"] {
        n: u32,
        v: u32,
        /// losses (forward); unused by the in-place backward.
        out_off: u32,
        logits_off: u32,
        tgt_off: u32,
        dloss: f32,
    }
}

kernel_params! {
    /// `adamw.wgsl`: the [`AdamWStep`](crate::backend::AdamWStep) scalars after the views' offsets.
    AdamWParams for ["adamw"] {
        n: u32,
        p_off: u32,
        g_off: u32,
        m_off: u32,
        v_off: u32,
        lr: f32,
        beta1: f32,
        beta2: f32,
        eps: f32,
        weight_decay: f32,
        step_size: f32,
        bc2_sqrt: f32,
        grad_scale: f32,
        base: u32,
        runs_off: u32,
        n_bounds: u32,
        runs_given: u32,
    }
}

kernel_params! {
    /// `reduce.wgsl` (`sum_squares`).
    ReduceParams for ["reduce"] {
        n: u32,
        x_off: u32,
        /// First block written: the index of this range's first block among the whole view's.
        out_off: u32,
    }
}

#[cfg(test)]
mod tests {
    use super::super::kernels::FAMILIES;
    use super::*;

    /// `(name, type)` of each field of the `struct Params` in `source`, in order.
    fn wgsl_fields(source: &str) -> Vec<(String, String)> {
        let start = source.find("struct Params {").expect("a Params struct") + "struct Params {".len();
        let body = &source[start..start + source[start..].find('}').expect("closing brace")];
        body.lines()
            .map(|line| line.split("//").next().unwrap().trim().trim_end_matches(','))
            .filter(|line| !line.is_empty())
            .map(|line| {
                let (name, ty) = line.split_once(':').expect("name: type");
                (name.trim().to_string(), ty.trim().to_string())
            })
            .collect()
    }

    fn check<P: KernelParams>() {
        let rust: Vec<(String, String)> = P::FIELDS.iter().map(|(n, t)| (n.to_string(), t.to_string())).collect();
        assert_eq!(
            size_of::<P>(),
            4 * rust.len(),
            "{}: padding",
            std::any::type_name::<P>()
        );
        assert!(size_of::<P>() <= PARAMS_BYTES as usize);
        for family in P::FAMILIES {
            let (_, source, _) = FAMILIES
                .iter()
                .find(|(name, _, _)| name == family)
                .unwrap_or_else(|| panic!("no family {family}"));
            assert_eq!(
                rust,
                wgsl_fields(source),
                "{} vs {family}.wgsl",
                std::any::type_name::<P>()
            );
        }
    }

    /// Every family has a struct, and each struct is its WGSL struct field for field.
    #[test]
    fn structs_mirror_the_wgsl_params() {
        check::<EncoderParams>();
        check::<LayerNormParams>();
        check::<MatmulParams>();
        check::<TiledMatmulParams>();
        check::<AttentionParams>();
        check::<GeluParams>();
        check::<ResidualParams>();
        check::<CrossEntropyParams>();
        check::<AdamWParams>();
        check::<ReduceParams>();
        let covered: Vec<&str> = [
            EncoderParams::FAMILIES,
            LayerNormParams::FAMILIES,
            MatmulParams::FAMILIES,
            TiledMatmulParams::FAMILIES,
            AttentionParams::FAMILIES,
            GeluParams::FAMILIES,
            ResidualParams::FAMILIES,
            CrossEntropyParams::FAMILIES,
            AdamWParams::FAMILIES,
            ReduceParams::FAMILIES,
        ]
        .concat();
        for (family, _, _) in FAMILIES {
            assert_eq!(covered.iter().filter(|f| *f == family).count(), 1, "{family}");
        }
    }

    /// The slot holds the fields in declaration order, f32 as its bits, zeros after.
    #[test]
    fn words_are_the_fields_in_order() {
        let p = ResidualParams {
            n: 7,
            dst_off: 1,
            a_off: 2,
            b_off: 3,
            s: -0.37,
        };
        let mut want = [0u32; PARAMS_WORDS];
        want[..5].copy_from_slice(&[7, 1, 2, 3, (-0.37f32).to_bits()]);
        assert_eq!(p.words(), want);
    }
}
