//! Early read-backs (`begin_download`, `download_ready`, `finish_download`): the gradient sync reads a
//! finished bucket while backward goes on.
//!
//! - **Ordering.** `begin_download` records the copy of the view into staging buffers in the current
//!   encoder, after every op recorded so far, and submits that batch at once so the copy can start. Ops
//!   recorded later go into later submits (and an upload submits what is recorded before writing), so the
//!   copy sees exactly the values at `begin_download`, whatever runs after it.
//! - **No waiting.** `begin_download` only submits and calls `map_async`; `download_ready` polls without
//!   blocking; `finish_download` waits, only when the map callbacks have not fired yet, for the submit
//!   holding the copy (not for the work recorded after it). `finish_download` is a synchronisation point
//!   like `download`: it returns the first device error recorded since the last one.
//! - **Staging.** A view gets one MAP_READ staging buffer per 256 MiB (less where `max_buffer_size` says
//!   so), so a larger view gets several, under one ticket. Finished ones are unmapped into a pool keyed by
//!   size: the buckets of a training step are the same every step, so after the first step none is created.
//!   A plain `download` (the loss, a norm) takes its staging buffers from the same pool and gives them back.
//! - **Unfinished read-backs.** A dropped [`Download`] cannot tell the backend. Each `synchronize` reclaims
//!   the read-backs begun before the previous `synchronize` (their staging buffers go back to the pool) and
//!   frees the pooled buffers that no read-back used since then. So the staging held is at most what two
//!   synchronisation intervals used, and a read-back must be finished before the second `synchronize`
//!   after its begin (the trainer synchronizes once per step); finishing a reclaimed one is an error. For
//!   callers that never synchronize, at most [`MAX_IN_FLIGHT`] read-backs are kept: beyond, the oldest is
//!   reclaimed.

use super::submit::{record_copies, rounds};
use super::{Backend, BackendError, Download, View, WgpuBackend};
use crate::backend::error::ensure_view;
use anyhow::Result;
use std::collections::HashMap;
use std::sync::{Arc, OnceLock};

/// Unfinished read-backs kept at most, whatever the synchronisation: far more than the buckets of a step.
pub(super) const MAX_IN_FLIGHT: usize = 1024;

/// What a staging buffer's map callback reported: `Ok` once mapped; unset until it fires.
type MapOutcome = Arc<OnceLock<Result<(), String>>>;

/// One staging buffer of a read-back.
struct Staged {
    /// `[size / 4]` f32: consecutive elements of the view. MAP_READ | COPY_DST.
    buffer: wgpu::Buffer,
    mapped: MapOutcome,
}

/// A read-back in flight.
struct Pending {
    /// In the order of the view's elements.
    staged: Vec<Staged>,
    /// The submit holding the copies: all `finish_download` has to wait for.
    submission: wgpu::SubmissionIndex,
    /// The synchronisation interval it began in.
    interval: u64,
    /// Elements of the view.
    len: usize,
}

impl Pending {
    /// Whether every map callback has fired (so finishing does not wait).
    fn landed(&self) -> bool {
        self.staged.iter().all(|s| s.mapped.get().is_some())
    }
}

/// An unmapped staging buffer waiting for reuse, and the interval it was last returned in.
struct Idle {
    buffer: wgpu::Buffer,
    interval: u64,
}

/// The read-backs in flight, by ticket, and the pool of staging buffers.
#[derive(Default)]
pub(super) struct Readbacks {
    next_ticket: u64,
    /// The current synchronisation interval: `synchronize` calls so far.
    interval: u64,
    pending: HashMap<u64, Pending>,
    /// Unmapped staging buffers by size in bytes.
    pool: HashMap<u64, Vec<Idle>>,
}

impl Readbacks {
    /// Files a read-back begun now under a new ticket, reclaiming the oldest one past [`MAX_IN_FLIGHT`].
    fn insert(&mut self, staged: Vec<Staged>, submission: wgpu::SubmissionIndex, len: usize) -> u64 {
        if self.pending.len() >= MAX_IN_FLIGHT {
            let oldest = *self.pending.keys().min().expect("not empty");
            self.reclaim(oldest);
        }
        let ticket = self.next_ticket;
        self.next_ticket += 1;
        let interval = self.interval;
        let pending = Pending {
            staged,
            submission,
            interval,
            len,
        };
        self.pending.insert(ticket, pending);
        ticket
    }

    /// A pooled staging buffer of exactly `bytes` bytes.
    pub(super) fn take(&mut self, bytes: u64) -> Option<wgpu::Buffer> {
        self.pool.get_mut(&bytes)?.pop().map(|idle| idle.buffer)
    }

    /// Puts an unmapped staging buffer into the pool.
    pub(super) fn give(&mut self, buffer: wgpu::Buffer) {
        let idle = Idle {
            interval: self.interval,
            buffer,
        };
        self.pool.entry(idle.buffer.size()).or_default().push(idle);
    }

    /// Unmaps `s` into the pool. One whose map failed, or is still pending (it could not be mapped again),
    /// is dropped instead.
    fn recycle(&mut self, s: Staged) {
        if matches!(s.mapped.get(), Some(Ok(()))) {
            s.buffer.unmap();
            self.give(s.buffer);
        }
    }

    /// Forgets read-back `ticket`, unfinished; its staging buffers go back to the pool where mapped.
    fn reclaim(&mut self, ticket: u64) {
        if let Some(pending) = self.pending.remove(&ticket) {
            for s in pending.staged {
                self.recycle(s);
            }
        }
    }

    /// At a `synchronize`, after its wait: reclaims the read-backs begun before the previous one and frees
    /// the pooled buffers unused since then (see the module doc).
    pub(super) fn end_interval(&mut self) {
        let now = self.interval;
        let stale: Vec<u64> = self
            .pending
            .iter()
            .filter(|(_, p)| p.interval < now)
            .map(|(&ticket, _)| ticket)
            .collect();
        for ticket in stale {
            self.reclaim(ticket);
        }
        for idle in self.pool.values_mut() {
            idle.retain(|i| i.interval >= now);
        }
        self.pool.retain(|_, idle| !idle.is_empty());
        self.interval += 1;
    }

    /// Read-backs begun and not yet finished or reclaimed.
    #[cfg(test)]
    pub(super) fn in_flight(&self) -> usize {
        self.pending.len()
    }

    /// Staging buffers in the pool.
    #[cfg(test)]
    pub(super) fn pooled(&self) -> usize {
        self.pool.values().map(Vec::len).sum()
    }
}

/// Starts mapping `buffer` (after the submit that writes it); its callback records the outcome.
fn map_for_read(buffer: wgpu::Buffer) -> Staged {
    let mapped = MapOutcome::default();
    let report = mapped.clone();
    buffer.map_async(wgpu::MapMode::Read, .., move |r| {
        let _ = report.set(r.map_err(|e| e.to_string()));
    });
    Staged { buffer, mapped }
}

/// Copies the mapped staging buffers, in order, into `host` as little-endian f32.
fn copy_out(staged: &[Staged], host: &mut [f32]) -> Result<(), String> {
    let mut at = 0;
    for s in staged {
        match s.mapped.get() {
            Some(Ok(())) => {}
            Some(Err(e)) => return Err(e.clone()),
            None => return Err("the device never answered".to_string()),
        }
        let bytes = s.buffer.get_mapped_range(..).map_err(|e| format!("{e:?}"))?;
        let n = bytes.len() / 4;
        let dst = host.get_mut(at..at + n).ok_or("staging larger than the view")?;
        for (d, b) in dst.iter_mut().zip(bytes.chunks_exact(4)) {
            *d = f32::from_le_bytes(b.try_into().expect("chunks of 4 bytes"));
        }
        at += n;
    }
    Ok(())
}

impl WgpuBackend {
    /// [`Backend::begin_download`]: records and submits the copy of `src` into staging buffers, starts
    /// mapping them, and returns at once.
    pub(super) fn begin_read(&mut self, src: View, mut host: Vec<f32>) -> Result<Download> {
        ensure_view!(
            src.end() <= self.allocation(src.buf).len,
            "download view {src:?} out of bounds"
        );
        host.resize(src.len, 0.0);
        if src.len == 0 {
            // Nothing to copy: done at once, like `download` (which returns the errors recorded so far).
            self.read_tensor(src, &mut host)?;
            return Ok(Download::Ready(host));
        }
        let rounds = rounds(&self.pieces(src), self.staging_cap);
        let staging = rounds
            .iter()
            .map(|(_, bytes)| self.staging_buffer(*bytes))
            .collect::<Result<Vec<_>, _>>()?;
        let encoder = self.encoder();
        for ((pieces, _), buffer) in rounds.iter().zip(&staging) {
            record_copies(encoder, pieces, buffer);
        }
        let submission = self.flush().expect("the copies were just recorded");
        // Only after the submit: a submit may not use a buffer with a map pending.
        let staged = staging.into_iter().map(map_for_read).collect();
        let ticket = self.readbacks.insert(staged, submission, src.len);
        Ok(Download::InFlight { ticket, host })
    }

    /// [`Backend::download_ready`]: whether finishing `download` would not wait. Never blocks.
    pub(super) fn read_ready(&mut self, download: &Download) -> Result<bool, BackendError> {
        let ticket = match download {
            Download::Ready(_) => return Ok(true),
            Download::InFlight { ticket, .. } => *ticket,
        };
        if !self.readbacks.pending.contains_key(&ticket) {
            return Err(self.unknown_ticket(ticket));
        }
        // Runs the callbacks of whatever the device has finished.
        self.poll_device(wgpu::PollType::Poll)?;
        Ok(self.readbacks.pending[&ticket].landed())
    }

    /// [`Backend::finish_download`]: waits for the copy if needed, then returns its values, or the first
    /// device error recorded since the last synchronisation point.
    pub(super) fn finish_read(&mut self, download: Download) -> Result<Vec<f32>, BackendError> {
        let (ticket, mut host) = match download {
            Download::Ready(host) => return Ok(host),
            Download::InFlight { ticket, host } => (ticket, host),
        };
        let Some(pending) = self.readbacks.pending.remove(&ticket) else {
            return Err(self.unknown_ticket(ticket));
        };
        if !pending.landed() {
            self.poll_device(wgpu::PollType::Wait {
                submission_index: Some(pending.submission.clone()),
                timeout: None,
            })?;
        }
        host.resize(pending.len, 0.0);
        let copied = copy_out(&pending.staged, &mut host);
        for s in pending.staged {
            self.readbacks.recycle(s);
        }
        self.check_device_errors()?;
        copied.map_err(|e| self.failure(BackendError::Driver(format!("mapping a read-back buffer: {e}"))))?;
        Ok(host)
    }

    /// A staging buffer of `bytes` bytes: a pooled one of that size, else a new one.
    fn staging_buffer(&mut self, bytes: u64) -> Result<wgpu::Buffer, BackendError> {
        if let Some(buffer) = self.readbacks.take(bytes) {
            return Ok(buffer);
        }
        let usage = wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::COPY_DST;
        self.create_buffer("a read-back staging buffer", bytes, usage)
    }

    fn unknown_ticket(&self, ticket: u64) -> BackendError {
        BackendError::InvalidView(format!(
            "{}: read-back #{ticket} is not in flight: not begun by this backend, finished already, or \
             reclaimed by the second synchronize after its begin",
            self.name()
        ))
    }
}
