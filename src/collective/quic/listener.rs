//! Incoming connections. Each one is authenticated and its first control message read (a rendezvous hello
//! on rank 0, a ring neighbour's peer hello on any rank) in its own task, before setup sees it; once setup
//! is over, a late hello is refused. Every refusal is logged once per address and cause ([`Refusals`]):
//! never once per connection or datagram, which an attacker could repeat at will.

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use quinn::{Connection, Endpoint, RecvStream, SendStream};
use tokio::sync::mpsc;

use super::auth::{self, AcceptFail};
use super::close_reason;
use super::framing::{control_frame, read_control};
use super::messages::{Control, Hello};
use super::rendezvous::RENDEZVOUS_CLOSED;

/// An authenticated incoming connection, after its first control message.
pub(super) struct Joined {
    pub(super) conn: Connection,
    pub(super) send: SendStream,
    pub(super) recv: RecvStream,
    pub(super) msg: Control,
}

/// The connections that have said their first message, in order of arrival.
pub(super) struct Listener {
    arrivals: mpsc::UnboundedReceiver<Joined>,
    /// Peer hellos that arrived during the rendezvous (from fast neighbours), kept for the ring stage.
    pub(super) early_peers: Vec<Joined>,
    /// Peers that failed authentication (see [`Refusals`]).
    pub(super) refusals: Refusals,
}

/// Why a peer was turned away.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Cause {
    /// The TLS handshake failed, or the peer left before authenticating: not a ringtrain peer, or
    /// garbage that looked enough like a QUIC handshake for quinn to start one.
    Handshake,
    /// The peer does not know the cluster secret.
    Secret,
    /// A member said what this rank cannot accept: a hello that does not match, a rank already taken, a
    /// rendezvous already closed.
    Refused,
    /// A member claimed a rank without presenting the certificate that rank presented at rendezvous.
    Certificate,
}

/// Peers turned away: each address is logged once per cause, and the rendezvous names the ones that
/// failed authentication when it times out (a rank started with another secret is the usual reason a rank
/// "did not join"). Bounded, so garbage from many addresses costs a fixed amount of memory and log.
#[derive(Clone, Default)]
pub(super) struct Refusals(Arc<Mutex<Vec<(SocketAddr, Cause)>>>);

/// Most addresses remembered (and logged) per cause.
const MAX_REFUSALS: usize = 16;

impl Refusals {
    /// Records a refused peer; logs it the first time its address is refused for this cause.
    pub(super) fn record(&self, addr: SocketAddr, cause: Cause, reason: &str) {
        let mut seen = self.0.lock().unwrap_or_else(|p| p.into_inner());
        // Bounded per cause, so that failed handshakes from many source ports (anyone can send those) cannot
        // crowd out the wrong-secret peers, which the rendezvous names as the likely missing ranks.
        let of_cause = seen.iter().filter(|(_, c)| *c == cause).count();
        if of_cause > MAX_REFUSALS || seen.contains(&(addr, cause)) {
            return;
        }
        if of_cause == MAX_REFUSALS {
            // One entry past the bound stands for "the rest", so this is said once too.
            seen.push((addr, cause));
            tracing::warn!("refused a connection from {addr}; further refusals of this kind are not logged");
            return;
        }
        seen.push((addr, cause));
        let hint = match cause {
            Cause::Secret => " (a rank started with another secret?)",
            _ => "",
        };
        tracing::warn!("refused a connection from {addr}: {reason}{hint}");
    }

    /// The addresses refused for not knowing the secret, in order of first refusal.
    pub(super) fn wrong_secret(&self) -> Vec<SocketAddr> {
        let seen = self.0.lock().unwrap_or_else(|p| p.into_inner());
        seen.iter()
            .filter(|(_, c)| *c == Cause::Secret)
            .map(|(a, _)| *a)
            .collect()
    }
}

impl Joined {
    /// Tells the peer why it is turned away (and logs that once per address, see [`Refusals`]), then
    /// closes its connection once the answer is through (or after 2 s).
    pub(super) fn refuse(self, job: u64, refusals: &Refusals, cause: Cause, reason: String) {
        refusals.record(self.conn.remote_address(), cause, &reason);
        self.answer_and_close(job, &Control::Refused { reason });
    }

    /// Sends `answer`, then closes the connection once it is through (or after 2 s).
    fn answer_and_close(mut self, job: u64, answer: &Control) {
        let bytes = control_frame(job, answer);
        tokio::spawn(async move {
            let _ = self.send.write_all(&bytes).await;
            let _ = self.send.finish();
            let _ = tokio::time::timeout(Duration::from_secs(2), self.send.stopped()).await;
            self.conn.close(3u32.into(), b"refused");
        });
    }
}

impl Listener {
    /// Accepts every connection to `endpoint` from now on.
    pub(super) fn start(endpoint: &Endpoint, key: [u8; 32]) -> Self {
        let (tx, arrivals) = mpsc::unbounded_channel::<Joined>();
        let ep = endpoint.clone();
        let refusals = Refusals::default();
        let record = refusals.clone();
        tokio::spawn(async move {
            while let Some(inc) = ep.accept().await {
                tokio::spawn(serve_incoming(inc, key, tx.clone(), record.clone()));
            }
        });
        Listener {
            arrivals,
            early_peers: Vec::new(),
            refusals,
        }
    }

    /// The next connection to arrive; `None` once the accept loop has stopped.
    pub(super) async fn next(&mut self) -> Option<Joined> {
        self.arrivals.recv().await
    }

    /// After setup: late connections (a second peer claiming a rank, a retry) keep being answered with a
    /// refusal that names the rank they claim. Early peers that were never taken are closed. In an elastic
    /// job a hello of the job's first epoch is a member asking to join (`joins`): on rank 0 it waits at the
    /// desk to be admitted, on the other ranks it is sent to rank 0.
    pub(super) fn refuse_late(self, job: u64, joins: Option<Joins>) {
        let Listener {
            mut arrivals,
            early_peers,
            refusals,
        } = self;
        drop(early_peers);
        tokio::spawn(async move {
            while let Some(j) = arrivals.recv().await {
                let reason = match (&j.msg, &joins) {
                    (Control::Hello(h), Some(Joins::Redirect { first_job, to })) if h.job_id == *first_job => {
                        j.answer_and_close(job, &Control::Redirect { to: *to });
                        continue;
                    }
                    (Control::Hello(h), Some(Joins::Desk(desk))) if h.job_id == desk.first_job => {
                        match desk.park(j).await {
                            Ok(()) => continue,
                            Err((j, reason)) => {
                                j.refuse(job, &refusals, Cause::Refused, reason);
                                continue;
                            }
                        }
                    }
                    (Control::Hello(h), _) => format!("{RENDEZVOUS_CLOSED}: rank {} has already joined", h.rank),
                    (Control::PeerHello { rank, .. }, _) => {
                        format!("the ring is formed: rank {rank}'s link is already connected")
                    }
                    (other, _) => format!("unexpected {other:?} after setup"),
                };
                j.refuse(job, &refusals, Cause::Refused, reason);
            }
        });
    }
}

/// How a running rank of an elastic job answers a member asking to join.
#[derive(Clone)]
pub(super) enum Joins {
    /// Rank 0: the member waits at its desk.
    Desk(JoinDesk),
    /// The other ranks: the member is sent to rank 0, which listens at `to`.
    Redirect { first_job: u64, to: SocketAddr },
}

/// Rank 0 of an elastic job: where one member asking to join waits (its connection kept open) until the
/// running ranks admit it at a step boundary.
#[derive(Clone)]
pub(super) struct JoinDesk {
    /// Rank 0's own hello for the running epoch, which a join must match (but for job id and world).
    host: Hello,
    pub(super) first_job: u64,
    waiting: Arc<Mutex<Option<(u32, Joined)>>>,
}

impl JoinDesk {
    pub(super) fn new(host: Hello, first_job: u64) -> Self {
        JoinDesk {
            host,
            first_job,
            waiting: Arc::default(),
        }
    }

    /// The member waiting to join, if any.
    pub(super) fn waiting(&self) -> Option<u32> {
        self.waiting
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .as_ref()
            .map(|(m, _)| *m)
    }

    /// Keeps a join request, or gives it back with the reason it is refused.
    async fn park(&self, mut j: Joined) -> std::result::Result<(), (Joined, String)> {
        let Control::Hello(h) = &j.msg else {
            return Err((j, "not a hello".into()));
        };
        if let Err(reason) = h.check_join(&self.host, self.first_job) {
            return Err((j, reason));
        }
        let member = h.rank as u32;
        if let Some(other) = self.waiting() {
            return Err((j, format!("member {other} is already waiting to join; try again later")));
        }
        let note = format!("rank 0: member {member} asks to join; it is admitted at the next step boundary");
        tracing::warn!("{note}");
        let frame = control_frame(self.first_job, &Control::Waiting { note });
        // The note is small: the stream's credit takes it at once.
        let _ = tokio::time::timeout(Duration::from_secs(2), j.send.write_all(&frame)).await;
        *self.waiting.lock().unwrap_or_else(|e| e.into_inner()) = Some((member, j));
        Ok(())
    }

    /// Turns the waiting `member` away with `reason`.
    pub(super) async fn refuse(&self, job: u64, member: u32, reason: &str) {
        let taken = {
            let mut waiting = self.waiting.lock().unwrap_or_else(|e| e.into_inner());
            match waiting.as_ref() {
                Some((m, _)) if *m == member => waiting.take(),
                _ => None,
            }
        };
        let Some((_, mut j)) = taken else { return };
        tracing::warn!("rank 0: refused member {member}'s join: {reason}");
        let frame = control_frame(
            job,
            &Control::Refused {
                reason: reason.to_string(),
            },
        );
        // The connection stays up until the member has read why (or 2 s), as for any refusal.
        tokio::spawn(async move {
            let _ = tokio::time::timeout(Duration::from_secs(2), j.send.write_all(&frame)).await;
            let _ = j.send.finish();
            let _ = tokio::time::timeout(Duration::from_secs(2), j.send.stopped()).await;
            j.conn.close(3u32.into(), b"refused");
        });
    }

    /// Tells the waiting `member` that it is admitted into `epoch` with `members`.
    pub(super) async fn admit(
        &self,
        job: u64,
        member: u32,
        epoch: u64,
        members: &[u32],
    ) -> crate::collective::Result<()> {
        let taken = {
            let mut waiting = self.waiting.lock().unwrap_or_else(|e| e.into_inner());
            match waiting.as_ref() {
                Some((m, _)) if *m == member => waiting.take(),
                _ => None,
            }
        };
        let Some((_, mut j)) = taken else { return Ok(()) };
        let rank = members.iter().position(|&m| m == member).unwrap_or(members.len());
        let admitted = Control::Admitted {
            epoch,
            rank,
            world: members.len(),
            members: members.to_vec(),
        };
        let frame = control_frame(job, &admitted);
        let _ = tokio::time::timeout(Duration::from_secs(5), j.send.write_all(&frame)).await;
        let _ = j.send.finish();
        let _ = tokio::time::timeout(Duration::from_secs(2), j.send.stopped()).await;
        Ok(())
    }
}

/// Authenticates one incoming connection and reads its first control message; gives up after 30 s.
async fn serve_incoming(
    incoming: quinn::Incoming,
    key: [u8; 32],
    tx: mpsc::UnboundedSender<Joined>,
    refusals: Refusals,
) {
    let addr = incoming.remote_address();
    let work = async {
        let (conn, send, mut recv) = auth::accept(incoming, &key).await.map_err(|e| {
            let cause = match e {
                AcceptFail::Handshake(_) => Some(Cause::Handshake),
                AcceptFail::Secret => Some(Cause::Secret),
                AcceptFail::Local(_) => None,
            };
            if let Some(cause) = cause {
                refusals.record(addr, cause, &e.to_string());
            }
            e.to_string()
        })?;
        let msg = match read_control(&mut recv, None).await {
            Ok(m) => m,
            Err(e) => {
                // E.g. another protocol version: say why in the close reason, the one thing any version reads.
                let reason = format!("refused: {e}");
                conn.close(4u32.into(), &close_reason(&reason));
                return Err(e);
            }
        };
        Ok::<_, String>(Joined { conn, send, recv, msg })
    };
    if let Ok(Ok(j)) = tokio::time::timeout(Duration::from_secs(30), work).await {
        let _ = tx.send(j);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn remembered(r: &Refusals) -> Vec<(SocketAddr, Cause)> {
        r.0.lock().unwrap().clone()
    }

    /// Once per (address, cause), and a fixed amount of state however many addresses misbehave.
    #[test]
    fn refusals_are_remembered_once_and_bounded() {
        let r = Refusals::default();
        let a: SocketAddr = "127.0.0.1:1000".parse().unwrap();
        for _ in 0..3 {
            r.record(a, Cause::Secret, "x");
            r.record(a, Cause::Handshake, "x");
        }
        assert_eq!(remembered(&r), vec![(a, Cause::Secret), (a, Cause::Handshake)]);
        assert_eq!(r.wrong_secret(), vec![a]);
        for port in 2000..2100 {
            r.record(SocketAddr::new(a.ip(), port), Cause::Handshake, "x");
        }
        // Per cause: the bound, plus the one entry that says the rest are not logged.
        let handshakes = |r: &Refusals| remembered(r).iter().filter(|(_, c)| *c == Cause::Handshake).count();
        assert_eq!(handshakes(&r), MAX_REFUSALS + 1);
        // A flood of failed handshakes does not hide a later peer with the wrong secret.
        let late: SocketAddr = "127.0.0.1:3000".parse().unwrap();
        r.record(late, Cause::Secret, "x");
        assert_eq!(r.wrong_secret(), vec![a, late]);
        for port in 4000..4100 {
            r.record(SocketAddr::new(a.ip(), port), Cause::Secret, "x");
        }
        assert_eq!(r.wrong_secret().len(), MAX_REFUSALS + 1);
        assert_eq!(handshakes(&r), MAX_REFUSALS + 1);
    }
}
