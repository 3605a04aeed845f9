//! A link's two ends as async byte streams over the segment's ring: [`ShmSender::write_all`] and
//! [`ShmReceiver::read_exact`]. A side that finds the ring full (or empty) wakes its peer, then sleeps on its
//! own eventfd in the rank's reactor, never spinning: the compute threads fill the cores. While it sleeps
//! it also watches the link's socket, whose end-of-file means the peer process is gone.

use std::os::fd::OwnedFd;
use std::sync::Arc;

use tokio::io::unix::AsyncFd;
use tokio::net::UnixStream;

use super::handoff::Attached;
use super::segment::{Consumer, Producer};

/// What both ends share: the socket kept open, the eventfd this side wakes its peer with, and the one it
/// sleeps on.
struct Wakes {
    socket: UnixStream,
    wake_peer: Arc<OwnedFd>,
    wait: AsyncFd<OwnedFd>,
}

/// Wakes the peer sleeping on `fd`.
fn wake(fd: &OwnedFd) -> Result<(), String> {
    match rustix::io::write(fd, &1u64.to_ne_bytes()) {
        // A counter at its maximum wakes the peer as well as one more would.
        Ok(_) | Err(rustix::io::Errno::AGAIN) => Ok(()),
        Err(e) => Err(format!("waking the peer: {e}")),
    }
}

impl Wakes {
    fn new(socket: UnixStream, wake_peer: Arc<OwnedFd>, wait: OwnedFd) -> std::io::Result<Wakes> {
        // SAFETY: the `OwnedFd` owns its descriptor, which stays open, and the same, until the `AsyncFd`
        // that owns it is dropped.
        let wait = unsafe { AsyncFd::register_with_interest(wait, tokio::io::Interest::READABLE) }
            .map_err(std::io::Error::from)?;
        Ok(Wakes {
            socket,
            wake_peer,
            wait,
        })
    }

    fn wake_peer(&self) -> Result<(), String> {
        wake(&self.wake_peer)
    }

    /// Sleeps until the peer wakes this side, or fails when the peer's process is gone.
    async fn sleep(&self) -> Result<(), String> {
        loop {
            tokio::select! {
                r = self.wait.readable() => {
                    let mut guard = r.map_err(|e| e.to_string())?;
                    match rustix::io::read(self.wait.get_ref(), &mut [0u8; 8]) {
                        Ok(_) => return Ok(()),
                        Err(rustix::io::Errno::AGAIN) => guard.clear_ready(),
                        Err(e) => return Err(format!("reading the eventfd: {e}")),
                    }
                }
                r = self.socket.readable() => {
                    r.map_err(|e| e.to_string())?;
                    match self.socket.try_read(&mut [0u8; 1]) {
                        Ok(0) => return Err("the peer closed its shared-memory link (process gone)".into()),
                        Ok(_) => return Err("the peer wrote on the link's socket, which it must not".into()),
                        Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
                        Err(e) => return Err(format!("link socket: {e}")),
                    }
                }
            }
        }
    }
}

/// The sending end of a link.
pub struct ShmSender {
    ring: Producer,
    wakes: Wakes,
}

/// The receiving end of a link. Space it frees (bytes copied out, or lent bytes dropped) wakes the peer.
pub struct ShmReceiver {
    ring: Consumer,
    wakes: Wakes,
}

impl ShmSender {
    /// The sending end from what [`super::handoff::offer`] attached. Must run inside the rank's runtime.
    pub fn new(a: Attached) -> std::io::Result<ShmSender> {
        Ok(ShmSender {
            ring: Producer::new(a.segment),
            wakes: Wakes::new(a.socket, Arc::new(a.data_ready), a.space_ready)?,
        })
    }

    /// Writes every byte of `src`, waiting for space as needed; the peer is woken before this side sleeps,
    /// and [`ShmSender::flush`] wakes it at the end of a message.
    pub async fn write_all(&mut self, mut src: &[u8]) -> Result<(), String> {
        loop {
            let n = self.ring.try_write(src).map_err(|e| e.to_string())?;
            src = &src[n..];
            if src.is_empty() {
                return Ok(());
            }
            if n == 0 {
                self.wakes.wake_peer()?;
                self.wakes.sleep().await?;
            }
        }
    }

    /// Writes the pieces of one message and wakes the peer, only if the ring has room for all of them
    /// now; returns whether it did (nothing is written otherwise).
    pub fn try_write_whole(&mut self, pieces: &[&[u8]]) -> Result<bool, String> {
        let total: usize = pieces.iter().map(|p| p.len()).sum();
        if self.ring.free().map_err(|e| e.to_string())? < total {
            return Ok(false);
        }
        for piece in pieces {
            // Only this side fills the ring, so the room just seen is still there.
            let n = self.ring.try_write(piece).map_err(|e| e.to_string())?;
            debug_assert_eq!(n, piece.len());
        }
        self.flush()?;
        Ok(true)
    }

    /// Wakes the peer for what has been written.
    pub fn flush(&mut self) -> Result<(), String> {
        self.wakes.wake_peer()
    }

    /// Writes the pieces of one message in order, then wakes the peer.
    pub async fn write_all_chunks(&mut self, chunks: &[bytes::Bytes]) -> Result<(), String> {
        for c in chunks {
            self.write_all(c).await?;
        }
        self.flush()
    }
}

impl ShmReceiver {
    /// The receiving end from what [`super::handoff::ShmListener::accept`] attached. Must run inside the
    /// rank's runtime.
    pub fn new(a: Attached) -> std::io::Result<ShmReceiver> {
        let space_ready = Arc::new(a.space_ready);
        let waker = space_ready.clone();
        // A failed wake leaves the producer to its own timeout; the link's socket reports why it failed.
        let ring = Consumer::new(a.segment, move || {
            let _ = wake(&waker);
        });
        Ok(ShmReceiver {
            ring,
            wakes: Wakes::new(a.socket, space_ready, a.data_ready)?,
        })
    }

    /// Fills `dst` with a copy of the next bytes, waiting for the peer as needed.
    pub async fn read_exact(&mut self, dst: &mut [u8]) -> Result<(), String> {
        let mut filled = 0;
        while filled < dst.len() {
            let n = self.ring.try_read(&mut dst[filled..]).map_err(|e| e.to_string())?;
            filled += n;
            if n == 0 && filled < dst.len() {
                self.wait().await?;
            }
        }
        Ok(())
    }

    /// The next `len` bytes lent in place, as one piece, or two where they wrap around the ring; their
    /// space returns to the peer when the pieces are dropped. While half the ring is already out, they are
    /// copied instead: whoever holds lent bytes (a ring engine forwarding them to a neighbour that is itself
    /// waiting) must never hold the whole ring, or the peer could wait for space that only its own progress
    /// would free.
    pub async fn read_lent(&mut self, len: usize) -> Result<Vec<bytes::Bytes>, String> {
        if self.ring.outstanding() + len > self.ring.capacity() / 2 {
            let mut copy = vec![0u8; len];
            self.read_exact(&mut copy).await?;
            return Ok(vec![bytes::Bytes::from(copy)]);
        }
        let mut pieces = Vec::with_capacity(2);
        let mut left = len;
        while left > 0 {
            match self.ring.try_lend(left).map_err(|e| e.to_string())? {
                Some(lent) => {
                    left -= lent.as_ref().len();
                    pieces.push(bytes::Bytes::from_owner(lent));
                }
                None => self.wait().await?,
            }
        }
        Ok(pieces)
    }

    /// Sleeps until the peer publishes more. What a peer wrote before it left is still in the ring: the
    /// error comes only once that is drained.
    async fn wait(&mut self) -> Result<(), String> {
        match self.wakes.sleep().await {
            Err(gone) if self.ring.is_empty() => Err(gone),
            _ => Ok(()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::handoff::{offer, Expected, ShmListener};
    use super::super::segment::MIN_CAPACITY;
    use super::*;

    async fn link() -> (ShmSender, ShmReceiver) {
        let me = |rank| Expected {
            job_id: 1,
            rank,
            pid: std::process::id(),
            uid: rustix::process::getuid().as_raw(),
        };
        let l = ShmListener::bind(1, 1).unwrap();
        let (from, to) = (me(0), me(1));
        let (a, o) = tokio::join!(
            l.accept(std::slice::from_ref(&from), |r| panic!("{r}")),
            offer(&l.name, &to, 0, l.nonce, MIN_CAPACITY)
        );
        (
            ShmSender::new(o.unwrap()).unwrap(),
            ShmReceiver::new(a.unwrap().1).unwrap(),
        )
    }

    #[tokio::test(flavor = "current_thread")]
    async fn a_stream_larger_than_the_ring_arrives_whole_while_both_sides_sleep_and_wake() {
        let (mut tx, mut rx) = link().await;
        let data: Vec<u8> = (0..7 * MIN_CAPACITY + 11).map(|i| (i % 253) as u8).collect();
        let want = data.clone();
        let writer = async move {
            for piece in data.chunks(50_000) {
                tx.write_all(piece).await.unwrap();
            }
            tx.flush().unwrap();
            tx
        };
        let reader = async move {
            let mut got = vec![0u8; want.len()];
            for piece in got.chunks_mut(30_001) {
                rx.read_exact(piece).await.unwrap();
            }
            assert_eq!(got, want);
        };
        tokio::join!(writer, reader);
    }

    #[tokio::test(flavor = "current_thread")]
    async fn a_whole_message_is_written_only_when_it_fits() {
        let (mut tx, mut rx) = link().await;
        let big = vec![7u8; MIN_CAPACITY - 8];
        assert!(tx.try_write_whole(&[b"head", &big]).unwrap());
        assert!(
            !tx.try_write_whole(&[b"0123", b"45678"]).unwrap(),
            "9 bytes do not fit in the 4 left"
        );
        assert!(tx.try_write_whole(&[b"tail"]).unwrap(), "4 bytes do");
        let mut got = vec![0u8; MIN_CAPACITY];
        rx.read_exact(&mut got).await.unwrap();
        assert_eq!((&got[..4], &got[MIN_CAPACITY - 4..]), (&b"head"[..], &b"tail"[..]));
        assert!(got[4..MIN_CAPACITY - 4].iter().all(|&b| b == 7));
    }

    #[tokio::test(flavor = "current_thread")]
    async fn a_dropped_peer_is_reported_not_waited_for() {
        let (tx, mut rx) = link().await;
        drop(tx);
        let e = tokio::time::timeout(std::time::Duration::from_secs(5), rx.read_exact(&mut [0u8; 4]))
            .await
            .expect("end-of-file seen at once")
            .unwrap_err();
        assert!(e.contains("process gone"), "{e}");
    }
}
