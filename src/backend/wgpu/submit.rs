//! Recording and submitting work: bind groups (through the cache of `binding.rs`), one compute pass per
//! dispatch, the command encoder and its submission, and reading results back.
//!
//! Ops are recorded into one command encoder and submitted in batches: on `download`, `sum_squares`,
//! `synchronize`, `begin_download` (so its copy can start), before an upload (so the upload lands after the
//! ops recorded before it), and every [`MAX_PENDING`](super::MAX_PENDING) dispatches. Only `download`,
//! `sum_squares` and the early read-backs (`readback.rs`) read back. Each
//! dispatch stages its parameters in the next slot of the uniform ring; the batch's slots are written with
//! one `write_buffer` just before its submit (wgpu runs it after the earlier submits, so the next batch
//! reuses the ring from slot 0).
//!
//! `wait` and `read_back` are the synchronisation points: after the work has run they return the first
//! device error recorded since the previous one (`device_errors.rs`).

use super::binding::{BindGroupStats, BindKey, UniformRing, WindowKey};
use super::kernels::{Kernel, WG};
use super::params::KernelParams;
use super::windows::Win;
use super::{ceil_div, BackendError, WgpuBackend};
use std::num::NonZeroU64;

/// A bind group of `layout`: the uniform ring's slot, then `wins` in binding order.
fn make_bind_group(
    device: &wgpu::Device,
    layout: &wgpu::BindGroupLayout,
    uniforms: &UniformRing,
    wins: &[Win],
) -> wgpu::BindGroup {
    let mut entries = vec![wgpu::BindGroupEntry {
        binding: 0,
        resource: uniforms.binding(),
    }];
    for (i, w) in wins.iter().enumerate() {
        entries.push(wgpu::BindGroupEntry {
            binding: i as u32 + 1,
            resource: wgpu::BindingResource::Buffer(wgpu::BufferBinding {
                buffer: &w.buffer,
                offset: w.start,
                size: NonZeroU64::new(w.size),
            }),
        });
    }
    device.create_bind_group(&wgpu::BindGroupDescriptor {
        label: None,
        layout,
        entries: &entries,
    })
}

/// The cache key of a bind group of the layout with `bindings` storage bindings over `wins`; `None` when a
/// window is over a temporary buffer (new every call, so an entry for it could never hit again).
fn bind_key(bindings: u32, wins: &[Win]) -> Option<BindKey> {
    let windows = wins.iter().map(window_key).collect::<Option<Vec<_>>>()?;
    Some(BindKey {
        layout: bindings,
        windows,
    })
}

/// The cache identity of a window; `None` for one over a temporary buffer.
pub(super) fn window_key(w: &Win) -> Option<WindowKey> {
    Some(WindowKey {
        buffer: w.id?,
        start: w.start,
        size: w.size,
    })
}

/// Records one dispatch of `pipeline` in its own compute pass.
pub(super) fn record_dispatch(
    encoder: &mut wgpu::CommandEncoder,
    pipeline: &wgpu::ComputePipeline,
    bind_group: &wgpu::BindGroup,
    uniform_offset: u32,
    groups: (u32, u32),
) {
    let mut pass = encoder.begin_compute_pass(&wgpu::ComputePassDescriptor {
        label: None,
        timestamp_writes: None,
    });
    pass.set_pipeline(pipeline);
    pass.set_bind_group(0, bind_group, &[uniform_offset]);
    pass.dispatch_workgroups(groups.0, groups.1, 1);
}

/// A byte range of a buffer: (buffer, offset, size), all in bytes.
pub(super) type Piece = (wgpu::Buffer, u64, u64);

/// `pieces`, concatenated, cut into staging rounds of at most `cap` bytes: each round's pieces and its size.
pub(super) fn rounds(pieces: &[Piece], cap: u64) -> Vec<(Vec<Piece>, u64)> {
    let mut out = Vec::new();
    let mut round: Vec<Piece> = Vec::new();
    let mut round_bytes = 0;
    for (src, offset, size) in pieces {
        let mut done = 0;
        while done < *size {
            let n = (size - done).min(cap - round_bytes);
            round.push((src.clone(), offset + done, n));
            round_bytes += n;
            done += n;
            if round_bytes == cap {
                out.push((std::mem::take(&mut round), round_bytes));
                round_bytes = 0;
            }
        }
    }
    if round_bytes > 0 {
        out.push((round, round_bytes));
    }
    out
}

/// Records copies of `pieces`, concatenated, into `staging` from its start.
pub(super) fn record_copies(encoder: &mut wgpu::CommandEncoder, pieces: &[Piece], staging: &wgpu::Buffer) {
    let mut at = 0;
    for (src, offset, size) in pieces {
        encoder.copy_buffer_to_buffer(src, *offset, staging, at, *size);
        at += size;
    }
}

impl WgpuBackend {
    /// The command encoder recording the current batch.
    pub(super) fn encoder(&mut self) -> &mut wgpu::CommandEncoder {
        let device = &self.ctx.device;
        self.encoder
            .get_or_insert_with(|| device.create_command_encoder(&wgpu::CommandEncoderDescriptor { label: None }))
    }

    /// Workgroup grid for `groups` workgroups, folded into 2-D past the per-dimension limit.
    pub(super) fn grid(&self, groups: usize) -> (u32, u32) {
        let max = self.max_groups as usize;
        let x = groups.clamp(1, max);
        let y = ceil_div(groups.max(1), x);
        assert!(y <= max, "dispatch of {groups} workgroups is too large");
        (x as u32, y as u32)
    }

    pub(super) fn grid1d(&self, n: usize) -> (u32, u32) {
        self.grid(ceil_div(n, WG as usize))
    }

    /// Records one dispatch of `kernel` over `wins` (in binding order) with `params`, which must be its
    /// family's parameter struct.
    pub(super) fn dispatch<P: KernelParams>(&mut self, kernel: &str, wins: &[Win], params: &P, groups: (u32, u32)) {
        let Kernel { bindings, family, .. } = self.kernels[kernel];
        assert_eq!(wins.len() as u32, bindings, "kernel {kernel} binds {bindings} buffers");
        assert!(
            P::FAMILIES.contains(&family),
            "kernel {kernel} reads the {family} parameters, not {}",
            std::any::type_name::<P>()
        );
        let uniform_offset = self.uniforms.push(&params.words());
        let bind_group = self.bind_group(kernel, wins);
        let device = &self.ctx.device;
        let encoder = self
            .encoder
            .get_or_insert_with(|| device.create_command_encoder(&wgpu::CommandEncoderDescriptor { label: None }));
        record_dispatch(
            encoder,
            &self.kernels[kernel].pipeline,
            &bind_group,
            uniform_offset,
            groups,
        );
        self.finish_dispatch(wins);
    }

    /// After a dispatch: writes straddling windows back to their segments, and submits when the uniform ring
    /// is full.
    pub(super) fn finish_dispatch(&mut self, wins: &[Win]) {
        let encoder = self.encoder.as_mut().expect("a dispatch was just recorded");
        for w in wins {
            if let Some((buf, first, end)) = w.scatter {
                let a = self.bufs[buf].as_ref().expect("a bound allocation is live");
                for (s, local, at, n) in a.parts(first, end) {
                    let seg = &a.segs[s].buffer;
                    encoder.copy_buffer_to_buffer(&w.buffer, at as u64 * 4, seg, local as u64 * 4, n as u64 * 4);
                }
            }
        }
        if self.uniforms.is_full() {
            self.flush();
        }
    }

    /// The bind group of `kernel` over `wins`: from the cache, unless a window is over a temporary buffer.
    fn bind_group(&mut self, kernel: &str, wins: &[Win]) -> wgpu::BindGroup {
        let kernel = &self.kernels[kernel];
        let make = || make_bind_group(&self.ctx.device, &kernel.layout, &self.uniforms, wins);
        self.bind_groups.get_or_make(bind_key(kernel.bindings, wins), make)
    }

    /// Bind groups made so far: cache hits, cached misses, and uncached ones (temporary buffers).
    pub fn bind_group_stats(&self) -> BindGroupStats {
        self.bind_groups.stats()
    }

    /// Bind groups held by the cache now.
    pub fn cached_bind_groups(&self) -> usize {
        self.bind_groups.len()
    }

    /// Submits the recorded work (without waiting); the submission, when there was work to submit.
    pub(super) fn flush(&mut self) -> Option<wgpu::SubmissionIndex> {
        if let Some(ix) = &mut self.embed_index {
            ix.read_by_pending = false;
        }
        let enc = self.encoder.take()?;
        // Lands before the commands of this submit, which read it.
        self.uniforms.upload(&self.ctx.queue);
        Some(self.ctx.queue.submit([enc.finish()]))
    }

    /// Submits the recorded work, waits for it, then returns the first device error recorded since the
    /// last synchronisation point.
    pub(super) fn wait(&mut self) -> Result<(), BackendError> {
        self.flush();
        self.poll()?;
        self.check_device_errors()
    }

    /// The first device error recorded since the last synchronisation point (`device_errors.rs`).
    pub(super) fn check_device_errors(&self) -> Result<(), BackendError> {
        self.errors.take()
    }

    /// Waits for everything submitted.
    fn poll(&self) -> Result<(), BackendError> {
        self.poll_device(wgpu::PollType::wait_indefinitely())
    }

    /// `device.poll(how)`: waits as `how` says and runs the callbacks of the work that has finished.
    pub(super) fn poll_device(&self, how: wgpu::PollType) -> Result<(), BackendError> {
        match self.ctx.device.poll(how) {
            Ok(_) => Ok(()),
            Err(e) => Err(self.failure(BackendError::Driver(format!("waiting for the device: {e}")))),
        }
    }

    /// `error`, unless a recorded device error (a lost device, say) explains it: that one.
    pub(super) fn failure(&self, error: BackendError) -> BackendError {
        self.check_device_errors().err().unwrap_or(error)
    }

    /// Copies the byte ranges `pieces`, concatenated, back to the host once the work recorded so far has
    /// run; then returns the first device error recorded, if any, instead.
    pub(super) fn read_back(&mut self, pieces: &[Piece]) -> Result<Vec<u8>, BackendError> {
        self.flush();
        let total: u64 = pieces.iter().map(|p| p.2).sum();
        let mut out = Vec::with_capacity(total as usize);
        for (round, bytes) in rounds(pieces, self.staging_cap) {
            self.read_round(&round, bytes, &mut out)?;
        }
        self.check_device_errors()?;
        Ok(out)
    }

    /// One staging round of [`read_back`](Self::read_back): appends `bytes` bytes to `out`.
    fn read_round(&mut self, pieces: &[Piece], bytes: u64, out: &mut Vec<u8>) -> Result<(), BackendError> {
        let device = &self.ctx.device;
        // The step's reads are the same every step: their staging buffers come back from the pool.
        let size = bytes.max(4);
        let staging = self.readbacks.take(size).unwrap_or_else(|| {
            device.create_buffer(&wgpu::BufferDescriptor {
                label: Some("readback"),
                size,
                usage: wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::COPY_DST,
                mapped_at_creation: false,
            })
        });
        let mut enc = device.create_command_encoder(&wgpu::CommandEncoderDescriptor { label: None });
        record_copies(&mut enc, pieces, &staging);
        self.ctx.queue.submit([enc.finish()]);
        let (tx, rx) = std::sync::mpsc::channel();
        staging.map_async(wgpu::MapMode::Read, .., move |r| {
            let _ = tx.send(r);
        });
        self.poll()?;
        let mapped = match rx.recv() {
            Ok(Ok(())) => staging.get_mapped_range(..).map_err(|e| format!("{e:?}")),
            Ok(Err(e)) => Err(e.to_string()),
            Err(_) => Err("the device never answered".to_string()),
        };
        let mapped =
            mapped.map_err(|e| self.failure(BackendError::Driver(format!("mapping a read-back buffer: {e}"))))?;
        out.extend_from_slice(&mapped[..bytes as usize]);
        drop(mapped);
        staging.unmap();
        self.readbacks.give(staging);
        Ok(())
    }
}
