//! Early read-backs: `begin_download` queues a copy on the copy stream, ordered after the compute work
//! recorded so far by an event, into pinned host memory, so that a finished gradient bucket travels while
//! backward goes on. Tickets name them; pinned buffers are pooled, since pinning memory is slow.

use super::super::BackendError;
use super::api::check;
use cudarc::driver::sys as cu;
use std::collections::HashMap;

/// Pinned buffers kept for reuse beyond the ones in flight: enough for every bucket of a step (GPT-2's
/// 124M parameters are 20 buckets of the default 25 MiB), so a steady run pins nothing after its first step.
const POOLED: usize = 64;

/// Page-locked host memory the GPU copies into directly.
pub(super) struct Pinned {
    ptr: *mut f32,
    /// Capacity in floats.
    cap: usize,
}

impl Pinned {
    /// `cap` floats of pinned memory (the context must be current).
    pub(super) fn new(cap: usize) -> Result<Self, BackendError> {
        let mut ptr: *mut std::ffi::c_void = std::ptr::null_mut();
        // SAFETY: the context is current (callers bind it); `ptr` is a valid out-pointer.
        check(
            unsafe { cu::cuMemHostAlloc(&mut ptr, cap.max(1) * 4, 0) },
            "pinning host memory for a read-back",
        )?;
        Ok(Pinned {
            ptr: ptr as *mut f32,
            cap,
        })
    }
}

impl Pinned {
    /// The first float.
    pub(super) fn ptr(&self) -> *mut f32 {
        self.ptr
    }

    /// Releases the memory (no copy may target it any more).
    pub(super) fn release(self) {
        // SAFETY: allocated by `cuMemHostAlloc` and released once (this takes `self`).
        unsafe { cu::cuMemFreeHost(self.ptr as *mut _) };
    }
}

/// One copy in flight.
struct InFlight {
    pinned: Pinned,
    len: usize,
    /// Recorded on the copy stream after the copy.
    done: cu::CUevent,
}

#[derive(Default)]
pub(super) struct Readbacks {
    in_flight: HashMap<u64, InFlight>,
    pool: Vec<Pinned>,
    next_ticket: u64,
}

/// An event without timing (cheaper to record and wait on).
pub(super) fn new_event() -> Result<cu::CUevent, BackendError> {
    let mut event: cu::CUevent = std::ptr::null_mut();
    // SAFETY: the context is current; valid out-pointer.
    check(
        unsafe { cu::cuEventCreate(&mut event, cu::CUevent_flags::CU_EVENT_DISABLE_TIMING as u32) },
        "creating a CUDA event",
    )?;
    Ok(event)
}

impl Readbacks {
    /// Queues the copy of `len` floats at `src` on `copy`, after the work recorded on `compute` so far; returns
    /// its ticket.
    pub(super) fn begin(
        &mut self,
        compute: cu::CUstream,
        copy: cu::CUstream,
        src: cu::CUdeviceptr,
        len: usize,
    ) -> Result<u64, BackendError> {
        let ready = new_event()?;
        let done = match new_event() {
            Ok(done) => done,
            Err(e) => {
                // SAFETY: created above and used by nothing.
                unsafe { cu::cuEventDestroy_v2(ready) };
                return Err(e);
            }
        };
        let pinned = match self.pool.iter().position(|p| p.cap >= len) {
            Some(i) => self.pool.swap_remove(i),
            None => match Pinned::new(len) {
                Ok(pinned) => pinned,
                Err(e) => {
                    // SAFETY: created above and used by nothing.
                    unsafe {
                        cu::cuEventDestroy_v2(ready);
                        cu::cuEventDestroy_v2(done);
                    }
                    return Err(e);
                }
            },
        };
        // SAFETY: both streams and events belong to the current context; `pinned` holds `len` floats and
        // stays alive (in `in_flight`) until the copy is waited for; `src` holds `len` floats (the caller
        // checked the view). The `ready` event may be destroyed once the copy stream waits on it.
        let queued = unsafe {
            check(cu::cuEventRecord(ready, compute), "ordering a read-back")
                .and_then(|()| check(cu::cuStreamWaitEvent(copy, ready, 0), "ordering a read-back"))
                .and_then(|()| {
                    check(
                        cu::cuMemcpyDtoHAsync_v2(pinned.ptr as *mut _, src, len * 4, copy),
                        "starting a read-back",
                    )
                })
                .and_then(|()| check(cu::cuEventRecord(done, copy), "ordering a read-back"))
        };
        // SAFETY: `ready` was created above and is no longer needed by the host (the wait is queued).
        unsafe { cu::cuEventDestroy_v2(ready) };
        if let Err(e) = queued {
            // SAFETY: created above, not waited on by anything queued.
            unsafe { cu::cuEventDestroy_v2(done) };
            self.pool.push(pinned);
            return Err(e);
        }
        let ticket = self.next_ticket;
        self.next_ticket += 1;
        self.in_flight.insert(ticket, InFlight { pinned, len, done });
        Ok(ticket)
    }

    /// Whether read-back `ticket` has arrived; an unknown ticket is an error.
    pub(super) fn ready(&self, ticket: u64) -> Result<bool, BackendError> {
        let copy = self.get(ticket)?;
        // SAFETY: the event is live while the ticket is in flight.
        match unsafe { cu::cuEventQuery(copy.done) } {
            cu::CUresult::CUDA_ERROR_NOT_READY => Ok(false),
            status => check(status, "asking after a read-back").map(|()| true),
        }
    }

    /// Waits for read-back `ticket` and moves its values into `host` (resized to the copy's length).
    pub(super) fn finish(&mut self, ticket: u64, host: &mut Vec<f32>) -> Result<(), BackendError> {
        self.get(ticket)?;
        let copy = self.in_flight.remove(&ticket).expect("checked above");
        // SAFETY: the event is live; waiting makes the pinned buffer's `len` floats valid to read.
        let waited = check(unsafe { cu::cuEventSynchronize(copy.done) }, "waiting for a read-back");
        if waited.is_ok() {
            // SAFETY: the copy into the first `len` floats of the pinned buffer completed.
            let values = unsafe { std::slice::from_raw_parts(copy.pinned.ptr, copy.len) };
            host.clear();
            host.extend_from_slice(values);
        }
        // SAFETY: nothing queued uses the event any more.
        unsafe { cu::cuEventDestroy_v2(copy.done) };
        self.recycle(copy.pinned);
        waited
    }

    fn get(&self, ticket: u64) -> Result<&InFlight, BackendError> {
        self.in_flight
            .get(&ticket)
            .ok_or_else(|| BackendError::InvalidView(format!("cuda: read-back #{ticket} is not in flight")))
    }

    fn recycle(&mut self, pinned: Pinned) {
        if self.pool.len() < POOLED {
            self.pool.push(pinned);
        } else {
            pinned.release();
        }
    }

    /// Makes `compute` wait for every copy queued on `copy` so far (before freeing memory they read).
    pub(super) fn order_before(&self, copy: cu::CUstream, compute: cu::CUstream) -> Result<(), BackendError> {
        if self.in_flight.is_empty() {
            return Ok(());
        }
        let event = new_event()?;
        // SAFETY: both streams and the event belong to the current context; the event may be destroyed once
        // the wait is queued.
        let result = unsafe {
            check(cu::cuEventRecord(event, copy), "ordering a free after read-backs").and_then(|()| {
                check(
                    cu::cuStreamWaitEvent(compute, event, 0),
                    "ordering a free after read-backs",
                )
            })
        };
        // SAFETY: created above; the wait is queued.
        unsafe { cu::cuEventDestroy_v2(event) };
        result
    }

    /// Frees every pinned buffer and event (the streams have finished).
    pub(super) fn release(&mut self) {
        for (_, copy) in self.in_flight.drain() {
            // SAFETY: the streams finished, so nothing waits on the event any more.
            unsafe { cu::cuEventDestroy_v2(copy.done) };
            copy.pinned.release();
        }
        for pinned in self.pool.drain(..) {
            pinned.release();
        }
    }
}
