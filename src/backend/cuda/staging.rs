//! Uploads through pinned memory. An asynchronous copy from ordinary (pageable) host memory may, by the
//! driver's own documentation, wait for the stream or not; to keep uploads asynchronous and the caller's
//! buffer free to reuse at once, each upload is copied into a ring of pinned slots and sent from there.
//! A slot is reused only after the event recorded behind its last copy has passed.

use super::super::BackendError;
use super::api::check;
use super::gpu::Addr;
use super::readback::{new_event, Pinned};
use cudarc::driver::sys as cu;

/// Bytes one slot holds: a larger upload goes through several.
const SLOT_BYTES: usize = 16 << 20;
/// Slots in the ring (allocated as first needed): 128 MiB of pinned memory at most.
const SLOTS: usize = 8;

struct Slot {
    pinned: Pinned,
    /// Recorded on the compute stream after the slot's last copy; `None` before its first.
    copied: Option<cu::CUevent>,
}

#[derive(Default)]
pub(super) struct Staging {
    slots: Vec<Slot>,
    next: usize,
}

impl Staging {
    /// Queues the copy of `src` to `dst` on `compute`; `src` may change once this returns.
    pub(super) fn upload(&mut self, compute: cu::CUstream, dst: Addr, src: &[u8]) -> Result<(), BackendError> {
        for (i, piece) in src.chunks(SLOT_BYTES).enumerate() {
            let slot = self.slot()?;
            if let Some(copied) = slot.copied {
                // SAFETY: the event is live; waiting for it means the slot's previous copy has been read.
                check(unsafe { cu::cuEventSynchronize(copied) }, "waiting for an upload slot")?;
            }
            let event = match slot.copied {
                Some(event) => event,
                None => {
                    let event = new_event()?;
                    slot.copied = Some(event);
                    event
                }
            };
            // SAFETY: the slot holds SLOT_BYTES (>= piece.len()) of pinned memory no copy reads any more (the
            // wait above); `dst + offset` holds the piece (the ops check views against their buffers); the
            // event and stream belong to the current context.
            unsafe {
                std::ptr::copy_nonoverlapping(piece.as_ptr(), slot.pinned.ptr() as *mut u8, piece.len());
                let offset = (i * SLOT_BYTES) as u64;
                check(
                    cu::cuMemcpyHtoDAsync_v2(dst + offset, slot.pinned.ptr() as *const _, piece.len(), compute),
                    "copying to the GPU",
                )?;
                check(cu::cuEventRecord(event, compute), "ordering an upload")?;
            }
        }
        Ok(())
    }

    /// The next slot of the ring, allocated on first use.
    fn slot(&mut self) -> Result<&mut Slot, BackendError> {
        let index = self.next;
        self.next = (self.next + 1) % SLOTS;
        if index == self.slots.len() {
            self.slots.push(Slot {
                pinned: Pinned::new(SLOT_BYTES / 4)?,
                copied: None,
            });
        }
        Ok(&mut self.slots[index])
    }

    /// Frees the slots (the compute stream has finished).
    pub(super) fn release(&mut self) {
        for slot in self.slots.drain(..) {
            if let Some(event) = slot.copied {
                // SAFETY: the stream finished, so nothing waits on the event.
                unsafe { cu::cuEventDestroy_v2(event) };
            }
            slot.pinned.release();
        }
    }
}
