//! What a dispatch binds, built once: the bind-group cache and the ring of uniform parameter slots.
//!
//! A bind group depends only on its layout and on the storage windows it binds; the uniform parameters
//! live in one [`UniformRing`] bound at a dynamic offset, so they are not part of the key. A training step
//! repeats the same windows every step (with step-dependent AdamW scalars), so from step 2 on its
//! dispatches find their bind groups here.

use std::collections::HashMap;
use std::num::NonZeroU64;

/// Identity of a buffer the backend keeps, assigned from a counter when the buffer is created and never
/// reused, so a key naming it can never match a later buffer (a pointer or a `Vec` index could).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(super) struct BufferId(u64);

/// Hands out [`BufferId`]s.
#[derive(Default)]
pub(super) struct BufferIds(u64);

impl BufferIds {
    pub(super) fn next(&mut self) -> BufferId {
        self.0 += 1;
        BufferId(self.0)
    }
}

/// A bound range of a buffer: `size` bytes from byte `start`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(super) struct WindowKey {
    pub(super) buffer: BufferId,
    pub(super) start: u64,
    pub(super) size: u64,
}

/// Everything a bind group depends on: the layout (one per number of storage bindings, shared by the
/// kernels with that many) and each storage window in binding order.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub(super) struct BindKey {
    pub(super) layout: u32,
    pub(super) windows: Vec<WindowKey>,
}

/// Bind groups made so far, for tests and diagnostics.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct BindGroupStats {
    /// Dispatches that found their bind group in the cache.
    pub hits: u64,
    /// Bind groups created and cached.
    pub misses: u64,
    /// Bind groups created for one dispatch only: a window over a temporary buffer (a gathered view that
    /// straddles segments, the embedding backward's per-call index).
    pub uncached: u64,
}

/// Bind groups past this many are dropped all at once (a training step needs a few hundred; shapes that
/// keep changing must not grow the cache without bound).
pub(super) const MAX_CACHED_BIND_GROUPS: usize = 4096;

pub(super) struct BindGroupCache {
    groups: HashMap<BindKey, wgpu::BindGroup>,
    capacity: usize,
    stats: BindGroupStats,
}

impl BindGroupCache {
    pub(super) fn new(capacity: usize) -> Self {
        BindGroupCache {
            groups: HashMap::new(),
            capacity,
            stats: BindGroupStats::default(),
        }
    }

    /// The bind group of `key`, made by `make` on a miss; with no key (a window over a temporary buffer,
    /// which could never hit again) made outside the cache and counted as uncached.
    pub(super) fn get_or_make(
        &mut self,
        key: Option<BindKey>,
        make: impl FnOnce() -> wgpu::BindGroup,
    ) -> wgpu::BindGroup {
        let Some(key) = key else {
            self.stats.uncached += 1;
            return make();
        };
        if let Some(group) = self.groups.get(&key) {
            self.stats.hits += 1;
            return group.clone();
        }
        self.stats.misses += 1;
        if self.groups.len() >= self.capacity {
            // Dropping a bind group that recorded work still uses is safe: wgpu keeps it alive until then.
            self.groups.clear();
        }
        let group = make();
        self.groups.insert(key, group.clone());
        group
    }

    /// Drops every entry binding `buffer`, which is being freed: its entries could never hit again (ids are
    /// not reused) but would keep the buffer's memory alive.
    pub(super) fn forget(&mut self, buffer: BufferId) {
        self.groups
            .retain(|key, _| key.windows.iter().all(|w| w.buffer != buffer));
    }

    pub(super) fn stats(&self) -> BindGroupStats {
        self.stats
    }

    pub(super) fn len(&self) -> usize {
        self.groups.len()
    }

    #[cfg(test)]
    pub(super) fn set_capacity(&mut self, capacity: usize) {
        self.capacity = capacity;
    }

    #[cfg(test)]
    pub(super) fn binds(&self, buffer: BufferId) -> bool {
        self.groups
            .keys()
            .any(|key| key.windows.iter().any(|w| w.buffer == buffer))
    }
}

/// Bytes of one dispatch's uniform parameters: 20 words, room for the largest `Params` struct of the kernels
/// (AdamW's 17). Slots are rounded up to the adapter's offset alignment (256 bytes on most), so this costs
/// no ring memory there.
pub(super) const PARAMS_BYTES: u64 = 80;

/// One uniform buffer with a slot per dispatch of the batch being recorded. Each dispatch stages its
/// parameters in the next slot and binds the buffer at that slot's dynamic offset; the batch's slots are
/// written with one `write_buffer` just before the batch is submitted, which wgpu orders after every earlier
/// submission, so the ring is reused from slot 0 by the next batch.
pub(super) struct UniformRing {
    buffer: wgpu::Buffer,
    /// Bytes between slots: [`PARAMS_BYTES`] rounded up to `min_uniform_buffer_offset_alignment`.
    stride: u64,
    slots: usize,
    staged: Vec<u8>,
}

impl UniformRing {
    pub(super) fn new(device: &wgpu::Device, offset_alignment: u64, slots: usize) -> Self {
        let stride = PARAMS_BYTES.next_multiple_of(offset_alignment.max(1));
        let buffer = device.create_buffer(&wgpu::BufferDescriptor {
            label: Some("uniform parameters"),
            size: stride * slots as u64,
            usage: wgpu::BufferUsages::UNIFORM | wgpu::BufferUsages::COPY_DST,
            mapped_at_creation: false,
        });
        UniformRing {
            buffer,
            stride,
            slots,
            staged: Vec::with_capacity((stride as usize) * slots),
        }
    }

    /// The binding every bind group makes of the ring: one slot, placed by the dynamic offset.
    pub(super) fn binding(&self) -> wgpu::BindingResource<'_> {
        wgpu::BindingResource::Buffer(wgpu::BufferBinding {
            buffer: &self.buffer,
            offset: 0,
            size: NonZeroU64::new(PARAMS_BYTES),
        })
    }

    /// Stages `words` in the next free slot and returns that slot's dynamic offset.
    pub(super) fn push(&mut self, words: &[u32; PARAMS_BYTES as usize / 4]) -> u32 {
        assert!(!self.is_full(), "uniform ring full: the batch must be submitted first");
        let offset = self.staged.len();
        self.staged.extend_from_slice(bytemuck::cast_slice(&words[..]));
        self.staged.resize(offset + self.stride as usize, 0);
        offset as u32
    }

    pub(super) fn used(&self) -> usize {
        self.staged.len() / self.stride as usize
    }

    pub(super) fn is_full(&self) -> bool {
        self.used() >= self.slots
    }

    /// Writes the staged slots; call just before submitting the batch that reads them.
    pub(super) fn upload(&mut self, queue: &wgpu::Queue) {
        if !self.staged.is_empty() {
            queue.write_buffer(&self.buffer, 0, &self.staged);
            self.staged.clear();
        }
    }
}

/// Layout entry 0 of every kernel: the dispatch's slot of the uniform ring, bound at a dynamic offset.
pub(super) fn uniform_ring_entry() -> wgpu::BindGroupLayoutEntry {
    wgpu::BindGroupLayoutEntry {
        binding: 0,
        visibility: wgpu::ShaderStages::COMPUTE,
        ty: wgpu::BindingType::Buffer {
            ty: wgpu::BufferBindingType::Uniform,
            has_dynamic_offset: true,
            min_binding_size: None,
        },
        count: None,
    }
}

/// A read-write storage buffer at `binding`.
pub(super) fn storage_entry(binding: u32) -> wgpu::BindGroupLayoutEntry {
    wgpu::BindGroupLayoutEntry {
        binding,
        visibility: wgpu::ShaderStages::COMPUTE,
        ty: wgpu::BindingType::Buffer {
            ty: wgpu::BufferBindingType::Storage { read_only: false },
            has_dynamic_offset: false,
            min_binding_size: None,
        },
        count: None,
    }
}
