//! The texture-fed vec4 matmuls (`shaders/matmul4t.wgsl` for `A @ B`, `matmul4t_nt.wgsl` for `A @ W^T`
//! and `matmul4t_tn.wgsl` for `X^T @ B`, W and X row-major), used on software adapters with 8-lane
//! subgroups only; one `TexMatmul` per kernel ([`Variant`]).
//!
//! llvmpipe compiles a storage-buffer load whose address differs between invocations into a loop over the
//! SIMD lanes with a branch and a scalar access per lane, and an image load into one load per lane, so on
//! lavapipe a matmul that reads A and B from textures runs faster; the lanes of a subgroup, which share
//! their rows of A, fetch 8 rows at once and broadcast them (bench/wgpu/RESULTS.md has the measurements).
//! The textures are bound as read-only storage textures: a sampled texture's fetch is addressed per lane
//! and per mip level by llvmpipe, which cost half the kernel's time; a storage texture has one level.
//! Each call copies the operands into pooled rgba32f textures first (O(m·k + k·n) against the O(m·k·n)
//! product). Hardware adapters keep the storage-buffer kernel: there the copies would only cost.

use crate::backend::wgpu::binding::{
    storage_entry, uniform_ring_entry, BindKey, BufferId, BufferIds, UniformRing, WindowKey,
};
use std::collections::HashMap;
use std::num::NonZeroU64;

/// Subgroup size the kernel is written for (its broadcasts name lanes 0..8).
pub(super) const SUBGROUP_SIZE: u32 = 8;

/// Output tile of one workgroup (TM / TN in matmul4t.wgsl).
pub(super) const TILE_M: usize = 256;
pub(super) const TILE_N: usize = 64;

/// `layout` of the bind-group cache keys of this kernel; the storage-only layouts use their binding count
/// (at most a handful), so keys can never collide.
const KEY_LAYOUT: u32 = 0x7e47;

/// Which operand each texture-fed kernel takes transposed; the kernels are built in this order.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Variant {
    /// `A @ B` (`matmul4t`).
    Plain = 0,
    /// `A @ W^T`, W row-major (`matmul4t_nt`): B's texture holds B^T.
    TransposedB = 1,
    /// `X^T @ B`, X row-major (`matmul4t_tn`): A's texture holds A^T.
    TransposedA = 2,
}

impl Variant {
    pub const ALL: [Variant; 3] = [Variant::Plain, Variant::TransposedB, Variant::TransposedA];

    pub fn entry(self) -> &'static str {
        match self {
            Variant::Plain => "matmul4t",
            Variant::TransposedB => "matmul4t_nt",
            Variant::TransposedA => "matmul4t_tn",
        }
    }

    pub fn source(self) -> &'static str {
        match self {
            Variant::Plain => include_str!("../../../../shaders/matmul4t.wgsl"),
            Variant::TransposedB => include_str!("../../../../shaders/matmul4t_nt.wgsl"),
            Variant::TransposedA => include_str!("../../../../shaders/matmul4t_tn.wgsl"),
        }
    }
}

/// Which operand a pooled texture holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(super) enum Operand {
    A,
    B,
}

struct PooledTexture {
    id: BufferId,
    texture: wgpu::Texture,
    view: wgpu::TextureView,
}

pub(super) struct TexMatmul {
    pub pipeline: wgpu::ComputePipeline,
    layout: wgpu::BindGroupLayout,
    /// By (operand, width in texels, height): a shape's textures are made once and refilled every call.
    textures: HashMap<(Operand, u32, u32), PooledTexture>,
    max_dim: u32,
}

/// One matrix operand as it sits in a buffer: `rows` rows of `cols` f32 (a multiple of 4) from byte
/// `offset`, `row_bytes` apart.
pub(super) struct Source<'a> {
    pub buffer: &'a wgpu::Buffer,
    pub offset: u64,
    pub row_bytes: u64,
    pub rows: usize,
    pub cols: usize,
}

impl TexMatmul {
    /// `source` is the WGSL of the kernel named `entry` (see [`Variant`]) with its shared snippets.
    pub fn new(device: &wgpu::Device, source: &str, entry: &'static str, max_dim: u32) -> Self {
        let texture = |binding| wgpu::BindGroupLayoutEntry {
            binding,
            visibility: wgpu::ShaderStages::COMPUTE,
            ty: wgpu::BindingType::StorageTexture {
                access: wgpu::StorageTextureAccess::ReadOnly,
                format: wgpu::TextureFormat::Rgba32Float,
                view_dimension: wgpu::TextureViewDimension::D2,
            },
            count: None,
        };
        let entries = [
            uniform_ring_entry(),
            storage_entry(1),
            texture(2),
            texture(3),
            storage_entry(4),
        ];
        let layout = device.create_bind_group_layout(&wgpu::BindGroupLayoutDescriptor {
            label: Some(entry),
            entries: &entries,
        });
        let pipeline_layout = device.create_pipeline_layout(&wgpu::PipelineLayoutDescriptor {
            label: None,
            bind_group_layouts: &[Some(&layout)],
            immediate_size: 0,
        });
        let module = device.create_shader_module(wgpu::ShaderModuleDescriptor {
            label: Some(entry),
            source: wgpu::ShaderSource::Wgsl(source.into()),
        });
        let pipeline = device.create_compute_pipeline(&wgpu::ComputePipelineDescriptor {
            label: Some(entry),
            layout: Some(&pipeline_layout),
            module: &module,
            entry_point: Some(entry),
            compilation_options: Default::default(),
            cache: None,
        });
        TexMatmul {
            pipeline,
            layout,
            textures: HashMap::new(),
            max_dim,
        }
    }

    /// Whether an operand can be copied into a texture: rows a multiple of 256 bytes apart (the copy's row
    /// alignment), a 16-byte aligned start, and both texture dimensions within the adapter's limit.
    pub fn fits(&self, s: &Source) -> bool {
        s.row_bytes % wgpu::COPY_BYTES_PER_ROW_ALIGNMENT as u64 == 0
            && s.offset % 16 == 0
            && s.cols % 4 == 0
            && s.cols > 0
            && s.rows > 0
            && (s.cols / 4) as u64 <= self.max_dim as u64
            && s.rows as u64 <= self.max_dim as u64
    }

    /// Records the copy of `s` into the pooled texture for (`op`, its shape) and returns the texture's id
    /// and view.
    pub fn fill(
        &mut self,
        device: &wgpu::Device,
        ids: &mut BufferIds,
        encoder: &mut wgpu::CommandEncoder,
        op: Operand,
        s: &Source,
    ) -> (BufferId, wgpu::TextureView) {
        let (w, h) = ((s.cols / 4) as u32, s.rows as u32);
        let extent = wgpu::Extent3d {
            width: w,
            height: h,
            depth_or_array_layers: 1,
        };
        let pooled = self.textures.entry((op, w, h)).or_insert_with(|| {
            let texture = device.create_texture(&wgpu::TextureDescriptor {
                label: Some("matmul4t operand"),
                size: extent,
                mip_level_count: 1,
                sample_count: 1,
                dimension: wgpu::TextureDimension::D2,
                format: wgpu::TextureFormat::Rgba32Float,
                usage: wgpu::TextureUsages::STORAGE_BINDING | wgpu::TextureUsages::COPY_DST,
                view_formats: &[],
            });
            let view = texture.create_view(&wgpu::TextureViewDescriptor::default());
            PooledTexture {
                id: ids.next(),
                texture,
                view,
            }
        });
        encoder.copy_buffer_to_texture(
            wgpu::TexelCopyBufferInfo {
                buffer: s.buffer,
                layout: wgpu::TexelCopyBufferLayout {
                    offset: s.offset,
                    bytes_per_row: Some(s.row_bytes as u32),
                    rows_per_image: Some(h),
                },
            },
            wgpu::TexelCopyTextureInfo {
                texture: &pooled.texture,
                mip_level: 0,
                origin: wgpu::Origin3d::ZERO,
                aspect: wgpu::TextureAspect::All,
            },
            extent,
        );
        (pooled.id, pooled.view.clone())
    }

    /// Cache key of a bind group over the C window, the textures of ids `a` and `b` and the bias window
    /// (`None` when C or bias is over a temporary buffer).
    pub fn key(c: Option<WindowKey>, a: BufferId, b: BufferId, bias: Option<WindowKey>) -> Option<BindKey> {
        let whole = |id| WindowKey {
            buffer: id,
            start: 0,
            size: 0,
        };
        Some(BindKey {
            layout: KEY_LAYOUT,
            windows: vec![c?, whole(a), whole(b), bias?],
        })
    }

    /// A bind group over `c` and `bias` (buffer, start, size) and the texture views `a` and `b`.
    pub fn bind_group(
        &self,
        device: &wgpu::Device,
        uniforms: &UniformRing,
        c: (&wgpu::Buffer, u64, u64),
        a: &wgpu::TextureView,
        b: &wgpu::TextureView,
        bias: (&wgpu::Buffer, u64, u64),
    ) -> wgpu::BindGroup {
        fn buffer<'a>((buffer, offset, size): (&'a wgpu::Buffer, u64, u64)) -> wgpu::BindingResource<'a> {
            wgpu::BindingResource::Buffer(wgpu::BufferBinding {
                buffer,
                offset,
                size: NonZeroU64::new(size),
            })
        }
        device.create_bind_group(&wgpu::BindGroupDescriptor {
            label: Some("matmul4t"),
            layout: &self.layout,
            entries: &[
                wgpu::BindGroupEntry {
                    binding: 0,
                    resource: uniforms.binding(),
                },
                wgpu::BindGroupEntry {
                    binding: 1,
                    resource: buffer(c),
                },
                wgpu::BindGroupEntry {
                    binding: 2,
                    resource: wgpu::BindingResource::TextureView(a),
                },
                wgpu::BindGroupEntry {
                    binding: 3,
                    resource: wgpu::BindingResource::TextureView(b),
                },
                wgpu::BindGroupEntry {
                    binding: 4,
                    resource: buffer(bias),
                },
            ],
        })
    }
}
