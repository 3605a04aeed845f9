//! A UDP socket for quinn that batches its reads while a bulk transfer streams in, as a NIC's interrupt
//! moderation does.
//!
//! quinn's own tokio socket asks the reactor to wake the rank's runtime as soon as a datagram is readable.
//! On a link slower than the CPU (1500-byte frames at 200 Mbit/s arrive every 60 µs), that wakes the
//! communication thread every few datagrams, and on a machine whose cores are all computing, every wake-up
//! preempts a compute thread: an interrupt, a context switch, and the kernels' caches refilled afterwards.
//! Measured on 2 emulated hosts at 200 Mbit/s, the compute thread used 21-56 ms more CPU per step beside the
//! communication than alone, against 24-27 ms used by the communication threads themselves (BENCHMARKS.md,
//! "Transport settings").
//!
//! This socket keeps the reactor's wake-up for a quiet socket: the first datagram after a pause is read at
//! once, so a small collective's latency is unchanged. But when a read burst has brought in at least
//! [`BULK_BYTES`] (data is streaming) while the rank's compute runs ([`ComputeBusy`], set by the trainer
//! during an overlapped backward), the socket leaves the reactor (an epoll registration wakes the thread
//! on every datagram, whether or not a task waits for it), sleeps `interval`, and then reads whatever
//! queued meanwhile in one go. The kernel's receive buffer holds the datagrams in between, and
//! acknowledgements leave at most one interval late, which the congestion controller sees as a longer
//! round trip. When a burst brings in less, or the rank is waiting for the data, the socket rejoins the
//! reactor: a pause then would only add latency (measured at 1 Gbit/s, where the step's tail got longer).
//!
//! The socket is registered for reading only. Registered for writing too (as tokio's own socket is), every
//! datagram the kernel finishes sending signals write space and wakes the thread; here a send that finds
//! the buffer full waits one interval and tries again.

use std::fmt;
use std::future::Future;
use std::io::{self, IoSliceMut};
use std::os::fd::{AsRawFd, RawFd};
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{ready, Context, Poll};
use std::time::Duration;

use quinn::udp::{RecvMeta, Transmit, UdpSocketState};
use quinn::{AsyncUdpSocket, UdpPoller};
use tokio::io::unix::AsyncFd;
use tokio::io::Interest;
use tokio::time::Sleep;

use crate::collective::ComputeBusy;

/// Bytes one read burst must bring in for the socket to count as streaming: two full-size datagrams at
/// Ethernet's MTU. Acknowledgements and a small collective's frames stay below it, so they are still read
/// the moment they arrive.
const BULK_BYTES: usize = 2 * 1400;

/// quinn's UDP socket on tokio, with batched reads while data streams in.
pub(super) struct CoalescingSocket {
    /// Declared before `socket`, so that a registration is dropped before the descriptor closes.
    reads: Mutex<ReadPacing>,
    /// Non-blocking.
    socket: std::net::UdpSocket,
    state: UdpSocketState,
    interval: Duration,
    /// Pauses are taken only while this is set: then the rank's compute is what a wake-up would interrupt,
    /// and otherwise the rank waits for the data.
    busy: ComputeBusy,
    /// The last send found the socket's buffer full.
    send_blocked: AtomicBool,
}

/// The socket's descriptor as the reactor sees it; the socket itself stays owned by [`CoalescingSocket`],
/// which outlives every registration.
struct SocketFd(RawFd);

impl AsRawFd for SocketFd {
    fn as_raw_fd(&self) -> RawFd {
        self.0
    }
}

/// What the reads since the socket last ran dry found, and how the next datagram is waited for.
#[derive(Default)]
struct ReadPacing {
    /// Bytes received since the socket last had nothing to read.
    burst_bytes: usize,
    /// While streaming: the pause before the socket is read again.
    pause: Option<Pin<Box<Sleep>>>,
    /// While quiet: the socket's registration with the reactor, for reading only.
    readable: Option<AsyncFd<SocketFd>>,
}

impl CoalescingSocket {
    /// Wraps `socket` (set non-blocking here).
    pub(super) fn new(socket: std::net::UdpSocket, interval: Duration, busy: ComputeBusy) -> io::Result<Self> {
        let state = UdpSocketState::new((&socket).into())?;
        socket.set_nonblocking(true)?;
        Ok(CoalescingSocket {
            reads: Mutex::new(ReadPacing::default()),
            socket,
            state,
            interval,
            busy,
            send_blocked: AtomicBool::new(false),
        })
    }

    /// Registers the socket with the rank's reactor, for reading only.
    fn register_readable(&self) -> io::Result<AsyncFd<SocketFd>> {
        let fd = SocketFd(self.socket.as_raw_fd());
        // SAFETY: the descriptor is `self.socket`'s, open until `self` drops, and every registration lives in
        // `self.reads`, which drops first (field order); `SocketFd` always returns that same descriptor.
        unsafe { AsyncFd::register_with_interest(fd, Interest::READABLE) }.map_err(|e| e.into_parts().1)
    }

    /// One non-blocking read straight from the socket, counted into the burst; `None` when it is dry.
    fn read_now(
        &self,
        burst_bytes: &mut usize,
        bufs: &mut [IoSliceMut<'_>],
        meta: &mut [RecvMeta],
    ) -> Option<io::Result<usize>> {
        match self.state.recv((&self.socket).into(), bufs, meta) {
            Ok(n) => {
                *burst_bytes += meta[..n].iter().map(|m| m.len).sum::<usize>();
                Some(Ok(n))
            }
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => None,
            Err(e) => Some(Err(e)),
        }
    }
}

impl fmt::Debug for CoalescingSocket {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CoalescingSocket")
            .field("local_addr", &self.socket.local_addr().ok())
            .field("interval", &self.interval)
            .finish()
    }
}

impl AsyncUdpSocket for CoalescingSocket {
    fn create_io_poller(self: Arc<Self>) -> Pin<Box<dyn UdpPoller>> {
        Box::pin(WritablePoller {
            socket: self,
            pause: None,
        })
    }

    fn try_send(&self, transmit: &Transmit<'_>) -> io::Result<()> {
        let sent = self.state.send((&self.socket).into(), transmit);
        if matches!(&sent, Err(e) if e.kind() == io::ErrorKind::WouldBlock) {
            self.send_blocked.store(true, Ordering::Relaxed);
        }
        sent
    }

    fn poll_recv(
        &self,
        cx: &mut Context<'_>,
        bufs: &mut [IoSliceMut<'_>],
        meta: &mut [RecvMeta],
    ) -> Poll<io::Result<usize>> {
        // Only the endpoint driver reads; the lock is never contended, and its state stays valid if a
        // holder panicked.
        let mut pacing = self.reads.lock().unwrap_or_else(|p| p.into_inner());
        let pacing = &mut *pacing;
        if let Some(pause) = pacing.pause.as_mut() {
            ready!(pause.as_mut().poll(cx));
            pacing.pause = None;
        }
        loop {
            if let Some(read) = self.read_now(&mut pacing.burst_bytes, bufs, meta) {
                return Poll::Ready(read);
            }
            // The socket is dry.
            let streaming = std::mem::take(&mut pacing.burst_bytes) >= BULK_BYTES;
            if streaming && self.busy.is_set() {
                // Streaming: no wake-ups per datagram until the pause is over.
                pacing.readable = None;
                let mut pause = Box::pin(tokio::time::sleep(self.interval));
                if pause.as_mut().poll(cx).is_pending() {
                    pacing.pause = Some(pause);
                    return Poll::Pending;
                }
                continue;
            }
            // Quiet: the next datagram wakes this task. A fresh registration reports data already queued.
            let readable = match &mut pacing.readable {
                Some(readable) => readable,
                empty => empty.insert(self.register_readable()?),
            };
            let mut seen = ready!(readable.poll_read_ready(cx))?;
            match self.read_now(&mut pacing.burst_bytes, bufs, meta) {
                Some(read) => return Poll::Ready(read),
                // Stale readiness: forget it, so that the next poll waits for a datagram.
                None => seen.clear_ready(),
            }
        }
    }

    fn local_addr(&self) -> io::Result<std::net::SocketAddr> {
        self.socket.local_addr()
    }

    fn may_fragment(&self) -> bool {
        self.state.may_fragment()
    }

    fn max_transmit_segments(&self) -> usize {
        self.state.max_gso_segments()
    }

    fn max_receive_segments(&self) -> usize {
        self.state.gro_segments()
    }
}

/// quinn asks before every send; ready at once unless the last send found the socket's buffer full, and
/// then one interval later.
struct WritablePoller {
    socket: Arc<CoalescingSocket>,
    pause: Option<Pin<Box<Sleep>>>,
}

impl fmt::Debug for WritablePoller {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("WritablePoller").finish_non_exhaustive()
    }
}

impl UdpPoller for WritablePoller {
    fn poll_writable(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        if !this.socket.send_blocked.load(Ordering::Relaxed) {
            return Poll::Ready(Ok(()));
        }
        let interval = this.socket.interval;
        let pause = this.pause.get_or_insert_with(|| Box::pin(tokio::time::sleep(interval)));
        ready!(pause.as_mut().poll(cx));
        this.pause = None;
        this.socket.send_blocked.store(false, Ordering::Relaxed);
        Poll::Ready(Ok(()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::UdpSocket;
    use std::time::Instant;

    /// A pause this long cannot be missed by a test, and a read without one never takes it.
    const INTERVAL: Duration = Duration::from_secs(2);

    fn pair(busy: &ComputeBusy) -> (CoalescingSocket, UdpSocket) {
        let receiver = UdpSocket::bind("127.0.0.1:0").unwrap();
        let sender = UdpSocket::bind("127.0.0.1:0").unwrap();
        sender.connect(receiver.local_addr().unwrap()).unwrap();
        (CoalescingSocket::new(receiver, INTERVAL, busy.clone()).unwrap(), sender)
    }

    /// Bytes of one read (one datagram, or several that the kernel coalesced).
    async fn read(socket: &CoalescingSocket) -> usize {
        let mut buf = vec![0u8; 1 << 16];
        let mut meta = [RecvMeta::default()];
        std::future::poll_fn(|cx| socket.poll_recv(cx, &mut [IoSliceMut::new(&mut buf)], &mut meta))
            .await
            .unwrap();
        meta[0].len
    }

    /// Sends `count` datagrams of `len` bytes and reads them all.
    async fn stream(socket: &CoalescingSocket, sender: &UdpSocket, count: usize, len: usize) {
        for _ in 0..count {
            sender.send(&vec![7u8; len]).unwrap();
        }
        let mut got = 0;
        while got < count * len {
            got += read(socket).await;
        }
    }

    /// How long the next read takes when a datagram arrives 50 ms after it starts.
    async fn next_read_time(socket: &CoalescingSocket, sender: &UdpSocket) -> Duration {
        let late = sender.try_clone().unwrap();
        let send = tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(50)).await;
            late.send(b"late").unwrap();
        });
        let started = Instant::now();
        assert_eq!(read(socket).await, 4);
        send.await.unwrap();
        started.elapsed()
    }

    /// How long a read takes after a burst of `count` datagrams of `len` bytes, with the rank computing
    /// (`busy`) or waiting.
    async fn read_time_after_burst(busy: bool, count: usize, len: usize) -> Duration {
        let flag = ComputeBusy::default();
        let (socket, sender) = pair(&flag);
        flag.set(busy);
        stream(&socket, &sender, count, len).await;
        next_read_time(&socket, &sender).await
    }

    #[tokio::test]
    async fn a_streaming_socket_pauses_while_the_rank_computes() {
        let took = read_time_after_burst(true, 3, 1400).await;
        assert!(
            took >= INTERVAL,
            "read after a streaming burst took {took:?}, expected a pause of {INTERVAL:?}"
        );
    }

    #[tokio::test]
    async fn a_streaming_socket_reads_at_once_while_the_rank_waits() {
        let took = read_time_after_burst(false, 3, 1400).await;
        assert!(took < INTERVAL, "read while waiting took {took:?}: it paused");
    }

    #[tokio::test]
    async fn small_datagrams_are_read_at_once_while_the_rank_computes() {
        // Acknowledgements and small collectives: under BULK_BYTES per burst.
        let took = read_time_after_burst(true, 2, 100).await;
        assert!(took < INTERVAL, "read after a small burst took {took:?}: it paused");
    }
}
