//! The kernel table: every WGSL entry point, grouped by op family (one `shaders/*.wgsl` file each, with
//! `common.wgsl` prepended), and the compute pipelines built from it once, at construction.
//!
//! A kernel's stem is its WGSL entry point and the Rust method that dispatches it; ops needing several
//! passes add suffixed kernels (`attention_backward_dq`, ...). Kernels with the same number of storage
//! bindings share one bind-group layout: binding 0 is the dispatch's slot of the uniform ring, bindings
//! `1..=n` the storage windows, in the order the WGSL declares them.

use super::binding;
use std::collections::HashMap;

/// Invocations per workgroup of every kernel (`WG` of common.wgsl).
pub(super) const WG: u32 = 256;

/// Prepended to every family's source.
pub(super) const COMMON: &str = include_str!("../../../shaders/common.wgsl");

/// One op family: (name, WGSL source, [(entry point, number of storage bindings)]).
pub(super) type Family = (&'static str, &'static str, &'static [(&'static str, u32)]);

pub(super) const FAMILIES: &[Family] = &[
    (
        "encoder",
        include_str!("../../../shaders/encoder.wgsl"),
        &[
            ("encoder_forward", 4),
            ("encoder_backward_wpe", 2),
            ("encoder_backward_wte", 4),
        ],
    ),
    (
        "layernorm",
        include_str!("../../../shaders/layernorm.wgsl"),
        &[
            ("layernorm_forward", 6),
            ("layernorm_backward", 7),
            ("layernorm_backward_params", 8),
            ("layernorm_forward_rows", 6),
            ("layernorm_backward_rows", 7),
            ("layernorm_backward_params_cols", 8),
        ],
    ),
    (
        "matmul",
        include_str!("../../../shaders/matmul.wgsl"),
        &[("matmul", 4), ("matmul_backward_bias", 2)],
    ),
    (
        "matmul4",
        concat!(
            include_str!("../../../shaders/matmul4_shared.wgsl"),
            include_str!("../../../shaders/matmul4.wgsl")
        ),
        &[("matmul4", 4)],
    ),
    (
        "matmul_tiled",
        include_str!("../../../shaders/matmul_tiled.wgsl"),
        &[
            ("matmul_tiled", 4),
            ("matmul_tiled_partial", 4),
            ("matmul_tiled_reduce", 4),
        ],
    ),
    (
        "attention",
        include_str!("../../../shaders/attention.wgsl"),
        &[
            ("attention_forward", 3),
            ("attention_backward_delta", 6),
            ("attention_backward_dq", 5),
            ("attention_backward_dk", 5),
            ("attention_backward_dv", 5),
        ],
    ),
    (
        "gelu",
        include_str!("../../../shaders/gelu.wgsl"),
        &[("gelu_forward", 2), ("gelu_backward", 3)],
    ),
    (
        "residual",
        include_str!("../../../shaders/residual.wgsl"),
        &[
            ("residual_forward", 3),
            ("add_inplace", 2),
            ("scale", 1),
            ("fill", 1),
            ("copy", 2),
        ],
    ),
    (
        "residual4",
        include_str!("../../../shaders/residual4.wgsl"),
        &[
            ("residual_forward4", 3),
            ("add_inplace4", 2),
            ("scale4", 1),
            ("fill4", 1),
            ("copy4", 2),
        ],
    ),
    (
        "crossentropy",
        include_str!("../../../shaders/crossentropy.wgsl"),
        &[
            ("crossentropy_forward", 3),
            ("crossentropy_backward", 3),
            ("crossentropy_forward_rows", 3),
            ("crossentropy_backward_rows", 3),
        ],
    ),
    ("adamw", include_str!("../../../shaders/adamw.wgsl"), &[("adamw", 5)]),
    (
        "reduce",
        include_str!("../../../shaders/reduce.wgsl"),
        &[("sum_squares", 2)],
    ),
];

/// One compiled entry point.
pub(super) struct Kernel {
    /// Its op family: which WGSL `Params` struct it reads (`params.rs`).
    pub(super) family: &'static str,
    pub(super) pipeline: wgpu::ComputePipeline,
    pub(super) layout: wgpu::BindGroupLayout,
    /// Storage bindings after the uniform slot.
    pub(super) bindings: u32,
}

/// Compiles every entry point of [`FAMILIES`], keyed by entry point. Errors surface through the caller's
/// validation error scope.
pub(super) fn compile(device: &wgpu::Device) -> HashMap<&'static str, Kernel> {
    let mut layouts: HashMap<u32, (wgpu::BindGroupLayout, wgpu::PipelineLayout)> = HashMap::new();
    let mut kernels = HashMap::new();
    for (family, src, entries) in FAMILIES {
        let source = format!("{COMMON}\n{src}");
        let module = device.create_shader_module(wgpu::ShaderModuleDescriptor {
            label: Some(family),
            source: wgpu::ShaderSource::Wgsl(source.into()),
        });
        for &(entry, bindings) in entries.iter() {
            let (bgl, pl) = layouts
                .entry(bindings)
                .or_insert_with(|| {
                    let mut e = vec![binding::uniform_ring_entry()];
                    e.extend((1..=bindings).map(binding::storage_entry));
                    let bgl = device.create_bind_group_layout(&wgpu::BindGroupLayoutDescriptor {
                        label: None,
                        entries: &e,
                    });
                    let pl = device.create_pipeline_layout(&wgpu::PipelineLayoutDescriptor {
                        label: None,
                        bind_group_layouts: &[Some(&bgl)],
                        immediate_size: 0,
                    });
                    (bgl, pl)
                })
                .clone();
            let pipeline = device.create_compute_pipeline(&wgpu::ComputePipelineDescriptor {
                label: Some(entry),
                layout: Some(&pl),
                module: &module,
                entry_point: Some(entry),
                // Every kernel writes its workgroup memory before reading it.
                compilation_options: wgpu::PipelineCompilationOptions {
                    zero_initialize_workgroup_memory: false,
                    ..Default::default()
                },
                cache: None,
            });
            kernels.insert(
                entry,
                Kernel {
                    family,
                    pipeline,
                    layout: bgl,
                    bindings,
                },
            );
        }
    }
    kernels
}
