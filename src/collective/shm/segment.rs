//! One link's shared segment: a sealed memfd holding a header page and a single-producer, single-consumer
//! byte ring. The producer (the link's sending rank) creates it; the consumer attaches to the descriptor it
//! is handed and checks everything about it before mapping it, since the peer is another process.
//!
//! Layout (all counters little-endian `u64`, each on its own cache line):
//!
//! | offset | field    | written by |
//! |--------|----------|------------|
//! | 0      | magic    | creator    |
//! | 8      | capacity | creator    |
//! | 64     | head: bytes written since creation | producer |
//! | 128    | tail: bytes read since creation    | consumer |
//! | 4096   | the ring, `capacity` bytes (a power of two) | producer |
//!
//! Byte `i` of the stream lives at `4096 + i % capacity`. The producer writes bytes, then publishes `head`
//! (release); the consumer reads `head` (acquire), copies bytes out, then publishes `tail`. Each side treats
//! the other's counter as untrusted: a counter that runs backwards or past the capacity is a protocol error,
//! never an out-of-bounds access.

use std::collections::VecDeque;
use std::fs::File;
use std::os::fd::{AsFd, OwnedFd};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use memmap2::{MmapMut, MmapOptions};
use rustix::fs::{MemfdFlags, SealFlags};

/// First eight bytes of every segment.
const MAGIC: u64 = u64::from_le_bytes(*b"RTSHMv01");
/// The header page; the ring starts here.
pub const HEADER_BYTES: usize = 4096;
const CAPACITY_OFFSET: usize = 8;
const HEAD_OFFSET: usize = 64;
const TAIL_OFFSET: usize = 128;
pub use super::{DEFAULT_CAPACITY, MAX_CAPACITY, MIN_CAPACITY};
/// The seals a segment must carry: its size can neither shrink (a mapped page would vanish under the
/// consumer, which would fault) nor grow, and no seal can be removed.
const REQUIRED_SEALS: SealFlags = SealFlags::SHRINK.union(SealFlags::GROW).union(SealFlags::SEAL);

/// The peer broke the ring's rules; the link cannot be trusted any more.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("shared-memory ring corrupted: {0}")]
pub struct RingCorrupt(String);

/// A mapped segment.
pub struct Segment {
    /// `[HEADER_BYTES + capacity]` bytes: the header page, then the ring.
    map: MmapMut,
    capacity: usize,
    memfd: OwnedFd,
}

impl std::fmt::Debug for Segment {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Segment")
            .field("capacity", &self.capacity)
            .finish_non_exhaustive()
    }
}

impl Segment {
    /// A new segment whose ring holds `capacity` bytes (a power of two within the bounds), sealed at its
    /// size. A memfd lives only as long as a descriptor or a mapping of it, so a killed job leaves nothing.
    pub fn create(capacity: usize) -> std::io::Result<Segment> {
        check_capacity(capacity).map_err(std::io::Error::other)?;
        let memfd = rustix::fs::memfd_create("ringtrain-link", MemfdFlags::CLOEXEC | MemfdFlags::ALLOW_SEALING)?;
        rustix::fs::ftruncate(&memfd, (HEADER_BYTES + capacity) as u64)?;
        rustix::fs::fcntl_add_seals(&memfd, REQUIRED_SEALS)?;
        let mut seg = Segment::map(memfd, capacity)?;
        seg.map[..8].copy_from_slice(&MAGIC.to_le_bytes());
        seg.map[CAPACITY_OFFSET..CAPACITY_OFFSET + 8].copy_from_slice(&(capacity as u64).to_le_bytes());
        Ok(seg)
    }

    /// Attaches to a segment a peer handed over, announced with `capacity`: checks the seals, the size, the
    /// magic and the capacity recorded in it before trusting any of it.
    pub fn attach(memfd: OwnedFd, capacity: usize) -> Result<Segment, String> {
        check_capacity(capacity)?;
        let seals = rustix::fs::fcntl_get_seals(&memfd).map_err(|e| format!("not a sealable memfd: {e}"))?;
        if !seals.contains(REQUIRED_SEALS) {
            return Err(format!("segment is not sealed against resizing (seals {seals:?})"));
        }
        let size = rustix::fs::fstat(&memfd).map_err(|e| format!("fstat: {e}"))?.st_size as u64;
        if size != (HEADER_BYTES + capacity) as u64 {
            return Err(format!(
                "segment holds {size} bytes, not the {} announced",
                HEADER_BYTES + capacity
            ));
        }
        let seg = Segment::map(memfd, capacity).map_err(|e| format!("mapping the segment: {e}"))?;
        // Copied out of the shared page before being compared.
        let mut header = [0u8; 16];
        header.copy_from_slice(&seg.map[..16]);
        let magic = u64::from_le_bytes(header[..8].try_into().expect("8 bytes"));
        let recorded = u64::from_le_bytes(header[8..].try_into().expect("8 bytes"));
        if magic != MAGIC {
            return Err("segment does not start with ringtrain's magic".into());
        }
        if recorded != capacity as u64 {
            return Err(format!(
                "segment records capacity {recorded}, not the {capacity} announced"
            ));
        }
        Ok(seg)
    }

    fn map(memfd: OwnedFd, capacity: usize) -> std::io::Result<Segment> {
        let file = File::from(memfd.try_clone()?);
        // SAFETY: the memfd is sealed against shrinking (checked by `attach`, set by `create` before this
        // call), so every page of the mapping stays backed for its lifetime. Its contents may change under
        // us (the peer writes the ring and its counter): the ring is only ever read through raw copies into
        // private memory and the counters through atomics, never through references that assume no writer.
        let map = unsafe { MmapOptions::new().len(HEADER_BYTES + capacity).map_mut(&file)? };
        Ok(Segment { map, capacity, memfd })
    }

    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// The descriptor to hand to the consumer.
    pub fn memfd(&self) -> std::os::fd::BorrowedFd<'_> {
        self.memfd.as_fd()
    }

    fn counter(&self, offset: usize) -> &AtomicU64 {
        // SAFETY: `offset` is 64 or 128, inside the mapping's first page, which is page-aligned, so the
        // address is 8-byte aligned; the mapping lives as long as `self`. Both processes touch the counter
        // only through atomics.
        unsafe { &*(self.map.as_ptr().add(offset) as *const AtomicU64) }
    }
}

fn check_capacity(capacity: usize) -> Result<(), String> {
    if !capacity.is_power_of_two() || !(MIN_CAPACITY..=MAX_CAPACITY).contains(&capacity) {
        return Err(format!(
            "ring capacity {capacity} is not a power of two within {MIN_CAPACITY}..={MAX_CAPACITY}"
        ));
    }
    Ok(())
}

/// The sending end of a segment's ring.
pub struct Producer {
    seg: Segment,
    /// Bytes written so far (our own copy of `head`).
    head: u64,
}

impl Producer {
    pub fn new(seg: Segment) -> Producer {
        Producer { head: 0, seg }
    }

    pub fn segment(&self) -> &Segment {
        &self.seg
    }

    /// Bytes the ring has room for now (the consumer may free more at any time).
    pub fn free(&self) -> Result<usize, RingCorrupt> {
        let cap = self.seg.capacity as u64;
        let tail = self.seg.counter(TAIL_OFFSET).load(Ordering::Acquire);
        let used = self.head.wrapping_sub(tail);
        if used > cap {
            return Err(RingCorrupt(format!(
                "the consumer reports {tail} bytes read, but {} were written",
                self.head
            )));
        }
        Ok((cap - used) as usize)
    }

    /// Copies as much of `src` as fits into the ring and publishes it; returns how many bytes that was
    /// (0 when the ring is full).
    pub fn try_write(&mut self, src: &[u8]) -> Result<usize, RingCorrupt> {
        let cap = self.seg.capacity as u64;
        let n = self.free()?.min(src.len());
        if n == 0 {
            return Ok(0);
        }
        let start = (self.head % cap) as usize;
        let first = n.min(self.seg.capacity - start);
        // SAFETY: `start + first <= capacity` and `n - first <= start`, so both copies stay inside the ring;
        // these bytes lie in the free part of the ring, which the consumer does not read until `head` says so.
        unsafe {
            let ring = self.seg.map.as_mut_ptr().add(HEADER_BYTES);
            std::ptr::copy_nonoverlapping(src.as_ptr(), ring.add(start), first);
            std::ptr::copy_nonoverlapping(src.as_ptr().add(first), ring, n - first);
        }
        self.head += n as u64;
        self.seg.counter(HEAD_OFFSET).store(self.head, Ordering::Release);
        Ok(n)
    }
}

/// The receiving end of a segment's ring. Bytes are either copied out ([`Consumer::try_read`]) or lent in
/// place ([`Consumer::try_lend`]); either way their space returns to the producer only when every byte
/// before them has been given back too, so `tail` only ever moves forward over finished bytes.
pub struct Consumer {
    releases: Arc<Releases>,
    /// Bytes handed out so far, copied or lent.
    read: u64,
}

/// The ranges handed out and not yet given back, in order, and what to do when `tail` moves.
struct Releases {
    seg: Segment,
    state: Mutex<ReleaseState>,
    /// Called after `tail` has moved (wakes a producer waiting for space).
    on_release: Box<dyn Fn() + Send + Sync>,
}

#[derive(Default)]
struct ReleaseState {
    tail: u64,
    /// `(end, given back)` of every range handed out past `tail`, in order; entry 0 is number `first`.
    pending: VecDeque<(u64, bool)>,
    first: u64,
}

impl Releases {
    /// Records the range ending at `end` as handed out; returns its number.
    fn hand_out(&self, end: u64) -> u64 {
        let mut st = self.lock();
        st.pending.push_back((end, false));
        st.first + st.pending.len() as u64 - 1
    }

    /// Gives range `number` back; moves `tail` over every leading range given back.
    fn give_back(&self, number: u64) {
        let moved = {
            let mut st = self.lock();
            let i = (number - st.first) as usize;
            st.pending[i].1 = true;
            let mut moved = false;
            while let Some(&(end, true)) = st.pending.front() {
                st.tail = end;
                st.pending.pop_front();
                st.first += 1;
                moved = true;
            }
            if moved {
                self.seg.counter(TAIL_OFFSET).store(st.tail, Ordering::Release);
            }
            moved
        };
        if moved {
            (self.on_release)();
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, ReleaseState> {
        // The state is a list of numbers, consistent after every statement: a panic elsewhere cannot
        // leave it half-updated.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// Bytes of the ring lent in place; their space is given back when this is dropped.
pub struct Lent {
    releases: Arc<Releases>,
    number: u64,
    /// `[len]` bytes inside the ring of `releases.seg`.
    ptr: *const u8,
    len: usize,
}

// SAFETY: `Lent` only reads its range of a mapping that `releases` keeps alive; the producer does not write
// the range until it has been given back (on drop), and giving back is synchronised by the mutex.
unsafe impl Send for Lent {}
// SAFETY: as above; `as_ref` only reads.
unsafe impl Sync for Lent {}

impl AsRef<[u8]> for Lent {
    fn as_ref(&self) -> &[u8] {
        // SAFETY: `ptr..ptr + len` lies inside the ring (checked by `try_lend`), the mapping lives as long as
        // `releases`, and the producer leaves these bytes alone until this `Lent` gives them back. A peer
        // that broke that rule could change them under us, which cannot make a `u8` invalid; the bytes are
        // f32 payload values, read as such and never trusted as lengths or offsets.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }
}

impl Drop for Lent {
    fn drop(&mut self) {
        self.releases.give_back(self.number);
    }
}

impl Consumer {
    /// The receiving end; `on_release` runs whenever freed space returns to the producer.
    pub fn new(seg: Segment, on_release: impl Fn() + Send + Sync + 'static) -> Consumer {
        Consumer {
            releases: Arc::new(Releases {
                seg,
                state: Mutex::new(ReleaseState::default()),
                on_release: Box::new(on_release),
            }),
            read: 0,
        }
    }

    /// Published bytes not yet handed out, checked against the capacity.
    fn available(&self) -> Result<usize, RingCorrupt> {
        let seg = &self.releases.seg;
        let head = seg.counter(HEAD_OFFSET).load(Ordering::Acquire);
        let avail = head.wrapping_sub(self.read);
        if avail > seg.capacity as u64 {
            return Err(RingCorrupt(format!(
                "the producer reports {head} bytes written, but {} were read and the ring holds {}",
                self.read, seg.capacity
            )));
        }
        Ok(avail as usize)
    }

    /// Bytes handed out whose space has not returned to the producer yet (lent, or behind lent bytes).
    pub fn outstanding(&self) -> usize {
        (self.read - self.releases.lock().tail) as usize
    }

    pub fn capacity(&self) -> usize {
        self.releases.seg.capacity
    }

    /// Whether nothing published is left to hand out.
    pub fn is_empty(&self) -> bool {
        matches!(self.available(), Ok(0))
    }

    /// Copies up to `dst.len()` published bytes out of the ring into `dst` and gives their space back;
    /// returns how many (0 when nothing new has been published).
    pub fn try_read(&mut self, dst: &mut [u8]) -> Result<usize, RingCorrupt> {
        let n = self.available()?.min(dst.len());
        if n == 0 {
            return Ok(0);
        }
        let seg = &self.releases.seg;
        let start = (self.read % seg.capacity as u64) as usize;
        let first = n.min(seg.capacity - start);
        // SAFETY: both copies stay inside the ring (`start + first <= capacity`, `n - first <= start`) and
        // inside `dst`; the bytes are plain `u8`, valid whatever a misbehaving peer writes into them
        // meanwhile, and are validated only after they have been copied into our own memory.
        unsafe {
            let ring = seg.map.as_ptr().add(HEADER_BYTES);
            std::ptr::copy_nonoverlapping(ring.add(start), dst.as_mut_ptr(), first);
            std::ptr::copy_nonoverlapping(ring, dst.as_mut_ptr().add(first), n - first);
        }
        self.read += n as u64;
        let number = self.releases.hand_out(self.read);
        self.releases.give_back(number);
        Ok(n)
    }

    /// Lends up to `max` published bytes in place, as far as the end of the ring; `None` when nothing new
    /// has been published.
    pub fn try_lend(&mut self, max: usize) -> Result<Option<Lent>, RingCorrupt> {
        let seg = &self.releases.seg;
        let start = (self.read % seg.capacity as u64) as usize;
        let n = self.available()?.min(max).min(seg.capacity - start);
        if n == 0 {
            return Ok(None);
        }
        self.read += n as u64;
        let number = self.releases.hand_out(self.read);
        Ok(Some(Lent {
            releases: self.releases.clone(),
            number,
            // Inside the ring: `start + n <= capacity`.
            ptr: seg.map.as_ptr().wrapping_add(HEADER_BYTES + start),
            len: n,
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pair(capacity: usize) -> (Producer, Consumer) {
        let seg = Segment::create(capacity).unwrap();
        let fd = seg.memfd().try_clone_to_owned().unwrap();
        let peer = Segment::attach(fd, capacity).unwrap();
        (Producer::new(seg), Consumer::new(peer, || {}))
    }

    #[test]
    fn bytes_cross_the_ring_in_order_across_the_wrap() {
        let (mut p, mut c) = pair(MIN_CAPACITY);
        let stream: Vec<u8> = (0..5 * MIN_CAPACITY + 123).map(|i| (i * 7 % 251) as u8).collect();
        let mut got = Vec::new();
        let mut sent = 0;
        let mut buf = vec![0u8; 10_000];
        while got.len() < stream.len() {
            // Uneven pieces, so that writes and reads straddle the end of the ring.
            let end = (sent + 40_000).min(stream.len());
            sent += p.try_write(&stream[sent..end]).unwrap();
            let n = c.try_read(&mut buf).unwrap();
            got.extend_from_slice(&buf[..n]);
        }
        assert_eq!(got, stream);
    }

    #[test]
    fn a_full_ring_takes_nothing_and_an_empty_one_gives_nothing() {
        let (mut p, mut c) = pair(MIN_CAPACITY);
        assert_eq!(c.try_read(&mut [0u8; 16]).unwrap(), 0);
        assert_eq!(p.try_write(&vec![1u8; MIN_CAPACITY + 5]).unwrap(), MIN_CAPACITY);
        assert_eq!(p.try_write(&[1u8; 5]).unwrap(), 0);
        assert_eq!(c.try_read(&mut [0u8; 3]).unwrap(), 3);
        assert_eq!(p.try_write(&[1u8; 5]).unwrap(), 3);
    }

    #[test]
    fn lent_bytes_hold_their_space_until_every_earlier_byte_is_given_back() {
        let (mut p, mut c) = pair(MIN_CAPACITY);
        let data: Vec<u8> = (0..MIN_CAPACITY).map(|i| (i % 241) as u8).collect();
        assert_eq!(p.try_write(&data).unwrap(), MIN_CAPACITY);
        let a = c.try_lend(1000).unwrap().unwrap();
        let b = c.try_lend(3000).unwrap().unwrap();
        assert_eq!(a.as_ref(), &data[..1000]);
        assert_eq!(b.as_ref(), &data[1000..4000]);
        // Giving back the later range frees nothing while the earlier one is out.
        drop(b);
        assert_eq!(p.try_write(&[7u8; 10]).unwrap(), 0);
        drop(a);
        assert_eq!(p.try_write(&[7u8; 5000]).unwrap(), 4000);
        // A copy after lent bytes waits for them too.
        let d = c.try_lend(100).unwrap().unwrap();
        assert_eq!(c.try_read(&mut [0u8; 100]).unwrap(), 100);
        assert_eq!(p.try_write(&[7u8; 10]).unwrap(), 0);
        drop(d);
        assert_eq!(p.try_write(&[7u8; 500]).unwrap(), 200);
    }

    #[test]
    fn a_lend_stops_at_the_end_of_the_ring() {
        let (mut p, mut c) = pair(MIN_CAPACITY);
        p.try_write(&vec![1u8; MIN_CAPACITY - 10]).unwrap();
        assert_eq!(
            c.try_read(&mut vec![0u8; MIN_CAPACITY - 10]).unwrap(),
            MIN_CAPACITY - 10
        );
        p.try_write(&[2u8; 30]).unwrap();
        assert_eq!(c.try_lend(100).unwrap().unwrap().as_ref(), &[2u8; 10]);
        assert_eq!(c.try_lend(100).unwrap().unwrap().as_ref(), &[2u8; 20]);
        assert!(c.try_lend(100).unwrap().is_none());
    }

    #[test]
    fn a_peer_counter_out_of_range_is_refused_not_followed() {
        let (mut p, mut c) = pair(MIN_CAPACITY);
        // A producer claiming more bytes than the ring holds.
        c.releases
            .seg
            .counter(HEAD_OFFSET)
            .store(MIN_CAPACITY as u64 + 1, Ordering::Release);
        assert!(c.try_read(&mut [0u8; 8]).is_err());
        // A consumer claiming to have read bytes never written.
        p.seg.counter(TAIL_OFFSET).store(5, Ordering::Release);
        assert!(p.try_write(&[0u8; 8]).is_err());
    }

    #[test]
    fn attach_checks_size_capacity_and_seals() {
        let seg = Segment::create(MIN_CAPACITY).unwrap();
        let fd = || seg.memfd().try_clone_to_owned().unwrap();
        assert!(Segment::attach(fd(), 2 * MIN_CAPACITY).unwrap_err().contains("bytes"));
        assert!(Segment::attach(fd(), MIN_CAPACITY + 1)
            .unwrap_err()
            .contains("power of two"));
        // An unsealed memfd could be shrunk under the consumer's mapping.
        let loose = rustix::fs::memfd_create("loose", MemfdFlags::CLOEXEC | MemfdFlags::ALLOW_SEALING).unwrap();
        rustix::fs::ftruncate(&loose, (HEADER_BYTES + MIN_CAPACITY) as u64).unwrap();
        assert!(Segment::attach(loose, MIN_CAPACITY).unwrap_err().contains("sealed"));
        // Sealed and sized, but not a ringtrain segment.
        let blank = rustix::fs::memfd_create("blank", MemfdFlags::CLOEXEC | MemfdFlags::ALLOW_SEALING).unwrap();
        rustix::fs::ftruncate(&blank, (HEADER_BYTES + MIN_CAPACITY) as u64).unwrap();
        rustix::fs::fcntl_add_seals(&blank, REQUIRED_SEALS).unwrap();
        assert!(Segment::attach(blank, MIN_CAPACITY).unwrap_err().contains("magic"));
    }
}
