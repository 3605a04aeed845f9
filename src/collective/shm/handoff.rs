//! Handing a link's segment from its sending rank to its receiving rank over a Unix socket.
//!
//! The receiving rank listens on an abstract Unix socket (Linux: it has no file, vanishes with the process,
//! and is private to the network namespace, so ranks on emulated hosts cannot reach each other's) whose
//! name, with a random nonce, the QUIC rendezvous has shown to the job's ranks over authenticated
//! connections. The sending rank connects, checks with `SO_PEERCRED` that the listener is the process
//! (pid, and uid) the rendezvous named, and sends an [`Offer`] with the segment's memfd and two eventfds.
//! The receiving rank checks the same of its caller, then the offer (job, rank, nonce, capacity), then the
//! descriptors (a sealed memfd of the announced size, two eventfds), and answers with an empty reason, or
//! with why it refused. The socket then stays open for the link's lifetime: its end-of-file tells either
//! side at once that the other process is gone.

use std::io::{IoSlice, IoSliceMut};
use std::mem::MaybeUninit;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::os::linux::net::SocketAddrExt;
use std::time::Duration;

use rustix::net::{
    RecvAncillaryBuffer, RecvAncillaryMessage, RecvFlags, SendAncillaryBuffer, SendAncillaryMessage, SendFlags,
};
use tokio::io::{AsyncReadExt, AsyncWriteExt, Interest};
use tokio::net::{UnixListener, UnixStream};

use super::segment::Segment;

/// Bytes of an offer.
const OFFER_BYTES: usize = 64;
const OFFER_MAGIC: [u8; 8] = *b"RTSHMOF1";
/// Longest refusal reason read back.
const MAX_REASON: usize = 1024;
/// Descriptors an offer carries: the memfd, the producer's "data ready" and the consumer's "space ready".
const OFFER_FDS: usize = 3;

/// What the rendezvous says about the other end of a link: the process that must be on it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Expected {
    pub job_id: u64,
    /// The rank at the other end.
    pub rank: usize,
    pub pid: u32,
    pub uid: u32,
}

/// The sending rank's offer, as it travels (64 bytes).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Offer {
    pub job_id: u64,
    /// The sending rank.
    pub rank: u32,
    /// The receiving rank's nonce, as the rendezvous gave it.
    pub nonce: [u8; 16],
    /// The ring's capacity in bytes.
    pub capacity: u64,
}

impl Offer {
    fn encode(&self) -> [u8; OFFER_BYTES] {
        let mut b = [0u8; OFFER_BYTES];
        b[..8].copy_from_slice(&OFFER_MAGIC);
        b[8..16].copy_from_slice(&self.job_id.to_le_bytes());
        b[16..20].copy_from_slice(&self.rank.to_le_bytes());
        b[24..40].copy_from_slice(&self.nonce);
        b[40..48].copy_from_slice(&self.capacity.to_le_bytes());
        b
    }

    fn decode(b: &[u8; OFFER_BYTES]) -> Result<Offer, String> {
        if b[..8] != OFFER_MAGIC {
            return Err("not a ringtrain shared-memory offer".into());
        }
        let u64_at = |i: usize| u64::from_le_bytes(b[i..i + 8].try_into().expect("8 bytes"));
        Ok(Offer {
            job_id: u64_at(8),
            rank: u32::from_le_bytes(b[16..20].try_into().expect("4 bytes")),
            nonce: b[24..40].try_into().expect("16 bytes"),
            capacity: u64_at(40),
        })
    }
}

/// One end of an attached link: its segment, the socket that stays open, and the two eventfds.
#[derive(Debug)]
pub struct Attached {
    pub segment: Segment,
    pub socket: UnixStream,
    /// Written by the producer when it has published bytes.
    pub data_ready: OwnedFd,
    /// Written by the consumer when it has freed space.
    pub space_ready: OwnedFd,
}

/// A receiving rank's listening socket.
pub struct ShmListener {
    listener: UnixListener,
    /// The abstract name (without the leading NUL).
    pub name: String,
    pub nonce: [u8; 16],
}

impl ShmListener {
    /// Listens on a fresh abstract name for `rank` of `job_id`.
    pub fn bind(job_id: u64, rank: usize) -> std::io::Result<ShmListener> {
        let nonce: [u8; 16] = rand::random();
        let tag: u64 = rand::random();
        let name = format!("ringtrain/{job_id:016x}/{rank}/{tag:016x}");
        let addr = std::os::unix::net::SocketAddr::from_abstract_name(name.as_bytes())?;
        let std_listener = std::os::unix::net::UnixListener::bind_addr(&addr)?;
        std_listener.set_nonblocking(true)?;
        Ok(ShmListener {
            listener: UnixListener::from_std(std_listener)?,
            name,
            nonce,
        })
    }

    /// Accepts callers until one of `from` offers a valid segment, which is returned with the rank that
    /// offered it; each caller turned away is told why and the reason is returned to `refused`.
    pub async fn accept(
        &self,
        from: &[Expected],
        mut refused: impl FnMut(String),
    ) -> std::io::Result<(usize, Attached)> {
        loop {
            let (socket, _) = self.listener.accept().await?;
            match take_offer(socket, from, &self.nonce).await {
                Ok(attached) => return Ok(attached),
                Err(reason) => refused(reason),
            }
        }
    }
}

/// Checks one caller and its offer; answers it either way.
async fn take_offer(mut socket: UnixStream, from: &[Expected], nonce: &[u8; 16]) -> Result<(usize, Attached), String> {
    let outcome = async {
        let candidates = check_peer(&socket, from)?;
        let (offer, fds) = tokio::time::timeout(Duration::from_secs(10), recv_offer(&socket))
            .await
            .map_err(|_| "no offer within 10 s".to_string())??;
        let Some(who) = candidates
            .iter()
            .find(|e| offer.job_id == e.job_id && offer.rank as usize == e.rank)
        else {
            let ranks: Vec<usize> = candidates.iter().map(|e| e.rank).collect();
            let job = candidates.first().map_or(0, |e| e.job_id);
            return Err(format!(
                "offer from rank {} of job {:#x}, expected rank {} of job {job:#x}",
                offer.rank,
                offer.job_id,
                list(&ranks)
            ));
        };
        if offer.nonce != *nonce {
            return Err("offer carries the wrong nonce".into());
        }
        let [memfd, data_ready, space_ready] = fds;
        for fd in [&data_ready, &space_ready] {
            check_eventfd(fd.as_fd())?;
        }
        let capacity = usize::try_from(offer.capacity).map_err(|_| "capacity out of range".to_string())?;
        let segment = Segment::attach(memfd, capacity)?;
        Ok((who.rank, segment, data_ready, space_ready))
    }
    .await;
    let reason = match &outcome {
        Ok(_) => String::new(),
        Err(e) => e.clone(),
    };
    let mut reply = (reason.len() as u32).to_le_bytes().to_vec();
    reply.extend_from_slice(reason.as_bytes());
    let answered = socket.write_all(&reply).await;
    let (rank, segment, data_ready, space_ready) = outcome?;
    answered.map_err(|e| format!("answering the offer: {e}"))?;
    Ok((
        rank,
        Attached {
            segment,
            socket,
            data_ready,
            space_ready,
        },
    ))
}

/// "3", or "one of 1, 3" for several.
fn list(ranks: &[usize]) -> String {
    match ranks {
        [one] => one.to_string(),
        many => format!(
            "one of {}",
            many.iter().map(|r| r.to_string()).collect::<Vec<_>>().join(", ")
        ),
    }
}

/// The sending rank: connects to the receiving rank's listener `name`, checks it is `to`, and hands over
/// a new segment of `capacity` bytes with `nonce`. Returns the attached sending end, or why not.
pub async fn offer(
    name: &str,
    to: &Expected,
    rank: usize,
    nonce: [u8; 16],
    capacity: usize,
) -> Result<Attached, String> {
    let addr = std::os::unix::net::SocketAddr::from_abstract_name(name.as_bytes()).map_err(|e| e.to_string())?;
    let std_socket = std::os::unix::net::UnixStream::connect_addr(&addr).map_err(|e| format!("connecting: {e}"))?;
    std_socket.set_nonblocking(true).map_err(|e| e.to_string())?;
    let mut socket = UnixStream::from_std(std_socket).map_err(|e| e.to_string())?;
    check_peer(&socket, std::slice::from_ref(to))?;
    let segment = Segment::create(capacity).map_err(|e| format!("creating a {capacity}-byte memfd: {e}"))?;
    let flags = rustix::event::EventfdFlags::CLOEXEC | rustix::event::EventfdFlags::NONBLOCK;
    let data_ready = rustix::event::eventfd(0, flags).map_err(|e| format!("eventfd: {e}"))?;
    let space_ready = rustix::event::eventfd(0, flags).map_err(|e| format!("eventfd: {e}"))?;
    let msg = Offer {
        job_id: to.job_id,
        rank: rank as u32,
        nonce,
        capacity: capacity as u64,
    }
    .encode();
    let fds = [segment.memfd(), data_ready.as_fd(), space_ready.as_fd()];
    send_offer(&socket, &msg, &fds)
        .await
        .map_err(|e| format!("sending the offer: {e}"))?;
    let mut len = [0u8; 4];
    socket
        .read_exact(&mut len)
        .await
        .map_err(|e| format!("reading the answer: {e}"))?;
    let len = (u32::from_le_bytes(len) as usize).min(MAX_REASON);
    if len > 0 {
        let mut reason = vec![0u8; len];
        socket
            .read_exact(&mut reason)
            .await
            .map_err(|e| format!("reading the refusal: {e}"))?;
        return Err(format!("refused: {}", String::from_utf8_lossy(&reason)));
    }
    Ok(Attached {
        segment,
        socket,
        data_ready,
        space_ready,
    })
}

/// The process at the other end of `socket` must be one the rendezvous named, run by our own user: the
/// ones of `expected` it may be (ranks of one process share a pid).
fn check_peer<'e>(socket: &UnixStream, expected: &'e [Expected]) -> Result<Vec<&'e Expected>, String> {
    let cred = rustix::net::sockopt::socket_peercred(socket).map_err(|e| format!("SO_PEERCRED: {e}"))?;
    let (pid, uid) = (cred.pid.as_raw_nonzero().get() as u32, cred.uid.as_raw());
    let own_uid = rustix::process::getuid().as_raw();
    let ranks: Vec<usize> = expected.iter().map(|e| e.rank).collect();
    if uid != own_uid || expected.iter().all(|e| e.uid != uid) {
        let uids: Vec<String> = expected.iter().map(|e| e.uid.to_string()).collect();
        return Err(format!(
            "the process at the other end runs as uid {uid}; rank {} runs as uid {}",
            list(&ranks),
            uids.join(", ")
        ));
    }
    let matching: Vec<&Expected> = expected.iter().filter(|e| e.pid == pid && e.uid == uid).collect();
    if matching.is_empty() {
        let pids: Vec<String> = expected.iter().map(|e| e.pid.to_string()).collect();
        return Err(format!(
            "the process at the other end is pid {pid}; rank {} is pid {} (another pid namespace?)",
            list(&ranks),
            pids.join(", ")
        ));
    }
    Ok(matching)
}

async fn send_offer(socket: &UnixStream, msg: &[u8; OFFER_BYTES], fds: &[BorrowedFd<'_>]) -> std::io::Result<()> {
    socket
        .async_io(Interest::WRITABLE, || {
            let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(OFFER_FDS))];
            let mut control = SendAncillaryBuffer::new(&mut space);
            if !control.push(SendAncillaryMessage::ScmRights(fds)) {
                return Err(std::io::Error::other("ancillary buffer too small"));
            }
            let sent = rustix::net::sendmsg(socket, &[IoSlice::new(msg)], &mut control, SendFlags::NOSIGNAL)?;
            if sent != OFFER_BYTES {
                return Err(std::io::Error::other(format!("sent {sent} of {OFFER_BYTES} bytes")));
            }
            Ok(())
        })
        .await
}

/// Receives one offer and exactly its three descriptors (any other number is refused, and every
/// descriptor received is closed).
async fn recv_offer(socket: &UnixStream) -> Result<(Offer, [OwnedFd; OFFER_FDS]), String> {
    let mut buf = [0u8; OFFER_BYTES];
    // Room for more descriptors than expected, so that extra ones arrive (and are closed) instead of
    // being cut off silently.
    let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(2 * OFFER_FDS))];
    let (bytes, fds) = socket
        .async_io(Interest::READABLE, || {
            let mut control = RecvAncillaryBuffer::new(&mut space);
            let got = rustix::net::recvmsg(
                socket,
                &mut [IoSliceMut::new(&mut buf)],
                &mut control,
                RecvFlags::CMSG_CLOEXEC,
            )?;
            let mut fds = Vec::new();
            for msg in control.drain() {
                if let RecvAncillaryMessage::ScmRights(rights) = msg {
                    fds.extend(rights);
                }
            }
            Ok((got.bytes, fds))
        })
        .await
        .map_err(|e| format!("receiving the offer: {e}"))?;
    if bytes != OFFER_BYTES {
        return Err(format!("offer of {bytes} bytes, expected {OFFER_BYTES}"));
    }
    let fds: [OwnedFd; OFFER_FDS] = fds
        .try_into()
        .map_err(|fds: Vec<OwnedFd>| format!("offer carries {} descriptors, expected {OFFER_FDS}", fds.len()))?;
    Ok((Offer::decode(&buf)?, fds))
}

/// An eventfd, which the link only ever reads and writes 8-byte counters on, and set non-blocking.
fn check_eventfd(fd: BorrowedFd<'_>) -> Result<(), String> {
    use std::os::fd::AsRawFd;
    let target = std::fs::read_link(format!("/proc/self/fd/{}", fd.as_raw_fd())).map_err(|e| e.to_string())?;
    if target.as_os_str() != "anon_inode:[eventfd]" {
        return Err(format!("expected an eventfd, got {}", target.display()));
    }
    rustix::io::ioctl_fionbio(fd, true).map_err(|e| e.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn me(rank: usize) -> Expected {
        Expected {
            job_id: 0xabc,
            rank,
            pid: std::process::id(),
            uid: rustix::process::getuid().as_raw(),
        }
    }

    #[tokio::test(flavor = "current_thread")]
    async fn a_valid_offer_attaches_both_ends_to_one_segment() {
        let l = ShmListener::bind(0xabc, 1).unwrap();
        let nonce = l.nonce;
        let (from, to) = (me(0), me(1));
        let (accepted, offered) = tokio::join!(
            l.accept(std::slice::from_ref(&from), |r| panic!("refused: {r}")),
            offer(&l.name, &to, 0, nonce, super::super::segment::MIN_CAPACITY)
        );
        let ((rank, a), o) = (accepted.unwrap(), offered.unwrap());
        assert_eq!(rank, 0);
        let mut p = super::super::segment::Producer::new(o.segment);
        let mut c = super::super::segment::Consumer::new(a.segment, || {});
        assert_eq!(p.try_write(b"hello").unwrap(), 5);
        let mut got = [0u8; 5];
        assert_eq!(c.try_read(&mut got).unwrap(), 5);
        assert_eq!(&got, b"hello");
    }

    #[tokio::test(flavor = "current_thread")]
    async fn a_wrong_nonce_rank_or_pid_is_refused_with_the_reason() {
        let l = ShmListener::bind(0xabc, 1).unwrap();
        let good = l.nonce;
        let cases: [(Expected, [u8; 16], &str); 3] = [
            (me(1), [0u8; 16], "nonce"),
            (me(1), good, "expected rank 0"),
            (Expected { pid: 1, ..me(1) }, good, "pid"),
        ];
        for (i, (to, nonce, want)) in cases.into_iter().enumerate() {
            // Case 1 offers as rank 2; the listener expects rank 0.
            let rank = if i == 1 { 2 } else { 0 };
            let expected_from = me(0);
            let mut reasons = Vec::new();
            let accept = tokio::time::timeout(
                Duration::from_millis(500),
                l.accept(std::slice::from_ref(&expected_from), |r| reasons.push(r)),
            );
            let (accepted, offered) = tokio::join!(accept, offer(&l.name, &to, rank, nonce, 1 << 16));
            assert!(accepted.is_err(), "case {i} attached");
            let e = offered.unwrap_err();
            // A wrong pid is caught by the offering side itself, before anything is sent.
            assert!(e.contains(want), "case {i}: {e}");
            if i < 2 {
                assert!(reasons.iter().any(|r| r.contains(want)), "case {i}: {reasons:?}");
            }
        }
    }
}
