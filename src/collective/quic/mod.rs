//! QUIC transport (quinn + tokio) for the ring collectives.
//!
//! # Topology
//! Rank 0 hosts the rendezvous on `MASTER_ADDR:MASTER_PORT`. Every other rank connects to it from its own
//! endpoint and says [`Hello`] (protocol version, job id, rank, world size, config hash, and optionally the
//! address it should be dialled at); rank 0 refuses a mismatch with a message naming the field. Once all
//! ranks have joined, rank 0 sends every rank the ring of listen addresses and of certificate fingerprints
//! (see Identity below), and each rank opens a link to its right neighbour. A rank's listen address is the
//! one it advertised ([`QuicConfig::advertise_addr`]), else the address rank 0 saw its hello come from, which
//! is that rank's own endpoint when nothing (NAT, a relay) stands between them; rank 0 itself is reached at
//! the master address. The rendezvous connections stay
//! open as the control plane: aborts and deaths are reported to rank 0, which tells everyone else.
//!
//! # Authentication (TLS-exporter-bound HMAC)
//! Every endpoint presents a fresh self-signed certificate; the certificate proves no membership. Right
//! after the TLS 1.3 handshake, the connecting side sends `MAC(key, "C" || exporter)` and the accepting side
//! checks it before answering with `MAC(key, "S" || exporter)`, which the connecting side checks in turn.
//! `exporter` is 32 bytes of TLS keying material (RFC 5705/8446 exporter, label
//! `EXPORTER-ringtrain-auth-v1`), unique to this TLS session, so a token cannot be replayed on another
//! connection and a man in the middle (who necessarily runs two sessions with different exporters) cannot
//! relay it. `key = BLAKE3-derive_key(context, secret)` and `MAC` is keyed BLAKE3; comparison is constant
//! time. Nothing but the token is read from an unauthenticated peer, and its frame is bounded to 32 bytes.
//! There is no switch that turns this off.
//!
//! # Identity (certificate pinning)
//! The secret proves membership, not identity: any member could claim any rank. So every endpoint also
//! presents its certificate as the (mandatory) TLS client certificate, and rank 0 records the BLAKE3
//! fingerprint of the one each rank presented on its rendezvous connection. The welcome carries every
//! rank's fingerprint with its address (rank 0's own first; each rank checks that entry against its
//! control connection). Both ends of a ring link check the neighbour's certificate against its pin: the
//! dialling side refuses whoever answers at the address with another certificate (the ring cannot form
//! then), the accepting side refuses a peer hello from another certificate and keeps waiting for the real
//! neighbour. A second claim on a rank (at rendezvous, or any hello or peer hello after setup) is refused
//! naming the rank. Every refusal is logged once per address and cause (`listener::Refusals`). A member
//! can still claim a rank before the real one joins, and can still corrupt what it sends itself.
//!
//! The secret is [`QuicConfig::secret`], which the launcher reads from `RINGTRAIN_SECRET` or `--secret-file`
//! (`dist::load_secret`). Without one, binding a non-loopback address is refused; on loopback a fixed
//! well-known key is used (so any local user could join, as with torchrun's standalone mode; `ringtrain
//! launch` passes a random secret instead).
//!
//! # Failure handling
//! Connections send keep-alives and time out after `idle_timeout` (at most a third of `timeout`). Every
//! collective has a deadline (`timeout`). A rank whose collective fails for a local reason sends an abort to rank 0, which forwards it;
//! a connection that drops without a goodbye makes rank 0 report that rank dead to everyone. A rank that
//! loses its link to the left waits briefly for rank 0's verdict, so the error names the rank that really
//! died, and otherwise names the neighbour. Losing rank 0 names rank 0.
//!
//! # Layout
//! [`QuicCollective::connect`] runs setup as a sequence of steps, each owned by one submodule: bind the
//! socket and start the tuned endpoint (`endpoint`), accept authenticated connections (`auth`, `listener`),
//! rendezvous as rank 0 or as a joining rank (`rendezvous`, with the messages in `messages`), start the
//! control plane (`control`), and connect the ring links (`links`). Each collective then runs in `driver`;
//! `framing` reads and writes the frames on quinn's streams.

mod auth;
// Needs the reactor's raw-descriptor registration (unix only); other systems read per datagram.
#[cfg(unix)]
mod coalesce;
mod control;
mod driver;
mod endpoint;
mod framing;
#[cfg(test)]
mod hostile_tests;
mod join_request;
mod links;
mod listener;
mod messages;
mod rendezvous;
#[cfg(target_os = "linux")]
mod shm_links;
#[cfg(not(target_os = "linux"))]
#[path = "shm_links_unsupported.rs"]
mod shm_links;
#[cfg(all(test, target_os = "linux"))]
mod shm_tests;
#[cfg(test)]
mod test_support;
#[cfg(test)]
mod transport_tests;
#[cfg(all(test, target_os = "linux"))]
mod two_level_tests;

pub use join_request::{ask_to_join, Admission};
pub use messages::{Control, Hello};

use std::collections::BTreeMap;
use std::net::{IpAddr, SocketAddr, UdpSocket};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use quinn::{Endpoint, SendStream};
use tokio::sync::watch;
use tokio::time::Instant;

use super::buffer_pool::BufferPool;
use super::frame::{self, SequenceGuard};
use super::rank_runtime::RankRuntime;
use super::ring::{Engine, RingOp};
use super::shm::LinkTransport;
use super::two_level::{CollectiveChoice, SubRing, TwoLevel};
use super::{run_ring, Collective, CollectiveError, ComputeBusy, Result};
use crate::fault_plan::FaultPlan;
use control::ControlPlane;
use links::{DataLinks, LeftLink, RightLink, Ring};
use listener::{JoinDesk, Joins, Listener};
use shm_links::LocalSide;

/// Largest byte-gather blob (hashes, scalars) accepted on a data link.
pub const MAX_GATHER_BLOB: usize = 1 << 20;
/// Idle message buffers a rank keeps for reuse (see [`BufferPool`]).
const POOL_MAX_BYTES: usize = 64 << 20;

/// Settings of one rank.
#[derive(Clone, Debug)]
pub struct QuicConfig {
    pub rank: usize,
    pub world: usize,
    /// Rendezvous address: the others dial it, and rank 0 binds it (its port only, when `bind_ip` is set).
    pub master: SocketAddr,
    /// Address this rank binds: rank 0 with the master port, the others with an ephemeral one. Default: the
    /// master address for rank 0; for the others 127.0.0.1 when the master is loopback, else the unspecified
    /// address of the master's family.
    pub bind_ip: Option<IpAddr>,
    /// Address the other ranks should dial to reach this rank, sent in its [`Hello`], when it is not the one
    /// rank 0 sees the hello come from (NAT, a relay, a chosen interface). Port 0 means this rank's bound
    /// port. Not used on rank 0, which the others reach at `master`.
    pub advertise_addr: Option<SocketAddr>,
    pub job_id: u64,
    pub config_hash: u64,
    /// Cluster secret; `None` is allowed on loopback only.
    pub secret: Option<Vec<u8>>,
    /// Per-collective deadline.
    pub timeout: Duration,
    /// How long rendezvous may take (all ranks must start within it).
    pub rendezvous_timeout: Duration,
    /// Connection idle timeout (keep-alives are sent at a third of it); capped at a third of `timeout`, so
    /// that a frozen or vanished peer is found out, and named, well before any collective's deadline.
    pub idle_timeout: Duration,
    /// Pipelining granularity in f32 elements.
    pub sub_chunk: usize,
    /// Which links to ranks of this host go through shared memory ([`crate::collective::shm`]). `new` gives
    /// [`LinkTransport::Quic`]; the launcher sets `--transport` (default `auto`).
    pub transport: LinkTransport,
    /// Bytes of each shared-memory link's ring (a power of two within the segment's bounds); `new` gives
    /// [`crate::collective::shm::DEFAULT_CAPACITY`].
    pub shm_capacity: usize,
    /// `RINGTRAIN_HOST_ID`, when the user gives the host identity; else it is read off the machine.
    pub host_id: Option<String>,
    /// `--collective`: the flat ring or the two-level one ([`crate::collective::two_level`]); rank 0
    /// resolves it at rendezvous. `new` gives [`CollectiveChoice::Flat`].
    pub collective: CollectiveChoice,
    /// An elastic job: its first epoch's job id. Rank 0 then takes a late hello of that job as a member
    /// asking to join (parked until the running ranks admit it, [`Collective::pending_join`]) instead of
    /// refusing it, and the other ranks point such a member to rank 0.
    pub elastic_first: Option<u64>,
    /// The port a rank other than 0 binds (`None`: an ephemeral one).
    pub listen_port: Option<u16>,
}

impl QuicConfig {
    pub fn new(rank: usize, world: usize, master: SocketAddr) -> Self {
        QuicConfig {
            rank,
            world,
            master,
            bind_ip: None,
            advertise_addr: None,
            job_id: 0,
            config_hash: 0,
            secret: None,
            timeout: Duration::from_secs(300),
            rendezvous_timeout: Duration::from_secs(300),
            idle_timeout: Duration::from_secs(10),
            sub_chunk: super::ring::DEFAULT_SUB_CHUNK,
            transport: LinkTransport::Quic,
            shm_capacity: crate::collective::shm::DEFAULT_CAPACITY,
            host_id: None,
            collective: CollectiveChoice::Flat,
            elastic_first: None,
            listen_port: None,
        }
    }

    /// Whether this join re-forms a running elastic job (an epoch after the first): its rendezvous then
    /// ends with a verdict on who is missing instead of failing the job.
    pub(crate) fn re_forming(&self) -> bool {
        self.elastic_first.is_some_and(|first| first != self.job_id)
    }
}

/// QUIC application close codes, as a peer reads them: a goodbye after a clean run, and a goodbye after a
/// failure, whose reason names the failure.
const CLOSE_BYE: u32 = 0;
const CLOSE_FAILED: u32 = 6;
/// Longest close reason sent: a close frame must fit in one datagram.
const MAX_CLOSE_REASON: usize = 512;

/// `reason` cut to [`MAX_CLOSE_REASON`] bytes at a character boundary.
fn close_reason(reason: &str) -> Vec<u8> {
    let mut end = reason.len().min(MAX_CLOSE_REASON);
    while !reason.is_char_boundary(end) {
        end -= 1;
    }
    reason.as_bytes()[..end].to_vec()
}

fn local(msg: impl Into<String>) -> CollectiveError {
    CollectiveError::Local(msg.into())
}

/// State shared by a rank's collective loop and its background tasks (control plane, link readers).
struct Shared {
    /// First fatal error reported by the control plane or a link.
    poison: watch::Sender<Option<CollectiveError>>,
    /// Set when this rank is leaving: losses seen after this are expected.
    closing: AtomicBool,
    /// Set when this rank crashes on purpose (tests): its own connections drop, nobody else's fault.
    crashed: AtomicBool,
    /// Message buffers recycled between the sending side and the left link's reader.
    pool: Arc<BufferPool>,
    /// Whether the rank computes while its collectives run (read by the endpoint's socket).
    compute_busy: ComputeBusy,
}

impl Shared {
    /// A link failed with `fallback`: gives the control plane until `until` to deliver its verdict (rank 0's
    /// relay of the abort or death that made the link fail) and returns that verdict, else `fallback`. A link
    /// usually breaks because its peer left after hearing of a failure elsewhere, and the peer's goodbye can
    /// overtake rank 0's notice of the cause; the cause is what every rank must report.
    async fn verdict_or(&self, fallback: CollectiveError, until: Instant) -> CollectiveError {
        let mut rx = self.poison.subscribe();
        let verdict = tokio::time::timeout_at(until, rx.wait_for(|p| p.is_some())).await;
        match verdict {
            Ok(Ok(p)) => p.clone().unwrap_or(fallback),
            _ => fallback,
        }
    }

    /// How long a rank whose link broke waits for the control plane's verdict: long enough for rank 0's
    /// relay, and, when rank 0 itself died and its close may never arrive, for the keep-alive idle timeout
    /// that reveals it.
    fn verdict_grace(idle_timeout: Duration) -> Duration {
        Duration::from_millis(1500).max(idle_timeout + Duration::from_millis(500))
    }

    fn poison(&self, e: CollectiveError) {
        if self.closing.load(Ordering::SeqCst) {
            return;
        }
        self.poison.send_if_modified(|p| {
            if p.is_none() {
                *p = Some(e);
                true
            } else {
                false
            }
        });
    }
}

/// The faults of a [`FaultPlan`] this rank's transport applies.
#[derive(Clone, Copy, Debug, Default)]
struct InjectedFaults {
    /// Crash after sending this many data messages.
    crash_after_msgs: Option<usize>,
    /// Crash when the step (0-based, [`Collective::set_step`]) reaches this one, before sending anything of
    /// it.
    crash_at_step: Option<u64>,
    /// Send data message number `k` (0-based, over this rank's lifetime) twice.
    duplicate_msg: Option<usize>,
}

/// One rank of a QUIC ring.
pub struct QuicCollective {
    rt: Option<RankRuntime>,
    cfg: QuicConfig,
    endpoint: Endpoint,
    shared: Arc<Shared>,
    poison_rx: watch::Receiver<Option<CollectiveError>>,
    /// Links to the ranks this one sends to, and from those it receives from, on any of its rings.
    rights: BTreeMap<usize, RightLink>,
    lefts: BTreeMap<usize, LeftLink>,
    /// This rank's place in the two-level layout rank 0 chose, or `None` for the flat ring.
    two_level: Option<TwoLevel>,
    /// What reducing collectives send their values in ([`Collective::set_wire`]).
    wire: crate::collective::Wire,
    control: ControlPlane,
    guard: SequenceGuard,
    seq: u64,
    step: u64,
    sent_msgs: usize,
    /// Bytes of data frames sent so far (headers included).
    sent_bytes: crate::collective::SentBytes,
    /// The message kinds of the run's [`FaultPlan`] that name this rank ([`QuicCollective::inject_faults`]).
    faults: InjectedFaults,
    crashed: bool,
    failed: Option<CollectiveError>,
    /// Where each rank listens: an elastic re-form dials the new rank 0 there.
    ring_addrs: Vec<SocketAddr>,
    /// Rank 0 of an elastic job: a member waiting to join.
    joins: Option<JoinDesk>,
    _keep: Vec<SendStream>,
}

impl QuicCollective {
    /// Joins the job: rendezvous through rank 0, then links to the ring neighbours. Blocks until every rank
    /// has joined or `rendezvous_timeout` passes.
    pub fn connect(cfg: QuicConfig) -> Result<Self> {
        Self::connect_inner(cfg, None)
    }

    /// Like [`connect`](Self::connect), on an already bound UDP socket (rank 0 can bind port 0 first and
    /// tell the others the port, without a race).
    pub fn connect_with_socket(cfg: QuicConfig, socket: UdpSocket) -> Result<Self> {
        Self::connect_inner(cfg, Some(socket))
    }

    /// Checks the settings, binds the socket, starts the rank's runtime and runs [`setup`] on it.
    fn connect_inner(mut cfg: QuicConfig, socket: Option<UdpSocket>) -> Result<Self> {
        validate(&mut cfg)?;
        let socket = endpoint::bind_socket(&mut cfg, socket)?;
        let rt = RankRuntime::new(format!("ringtrain-quic-{}", cfg.rank))
            .map_err(|e| local(format!("cannot start the async runtime: {e}")))?;
        let (poison, poison_rx) = watch::channel(None);
        let shared = Arc::new(Shared {
            poison,
            closing: AtomicBool::new(false),
            crashed: AtomicBool::new(false),
            pool: BufferPool::new(POOL_MAX_BYTES),
            compute_busy: ComputeBusy::default(),
        });
        let s = match rt.block_on(setup(&cfg, socket, shared.clone())) {
            Ok(s) => s,
            Err(e) => {
                drop(rt);
                return Err(e);
            }
        };
        let ring_error = s.ring_error;
        let q = QuicCollective {
            rt: Some(rt),
            guard: SequenceGuard::new(cfg.job_id),
            cfg,
            endpoint: s.endpoint,
            shared,
            poison_rx,
            rights: s.links.rights,
            lefts: s.links.lefts,
            two_level: s.two_level,
            wire: Default::default(),
            control: s.control,
            seq: 0,
            step: 0,
            sent_msgs: 0,
            sent_bytes: Default::default(),
            faults: InjectedFaults::default(),
            crashed: false,
            failed: ring_error.clone(),
            ring_addrs: s.addrs,
            joins: s.joins,
            _keep: s.links.keep,
        };
        match ring_error {
            // Tell everyone why this rank cannot go on (unless the control plane told it), then drop, which
            // says goodbye: rank 0 stays up until the others have heard why.
            Some(e) => {
                let mut q = q;
                q.report_failure(&e);
                Err(e)
            }
            None => Ok(q),
        }
    }

    /// Reports a failure this rank found itself to rank 0, which relays it to everyone, so that they fail
    /// now with its cause rather than at their own deadline or with a link error. A failure the control
    /// plane delivered is everyone's already.
    fn report_failure(&mut self, e: &CollectiveError) {
        if self.crashed || self.current_poison().as_ref() == Some(e) {
            return;
        }
        let me = self.cfg.rank;
        let (rank, dead, reason) = match e {
            CollectiveError::PeerDead { rank, reason } => {
                (*rank, true, format!("rank {me} lost its link to it: {reason}"))
            }
            other => (me, false, other.to_string()),
        };
        let rt = self.rt.take().expect("runtime present until drop");
        rt.block_on(self.control.send_abort(self.cfg.job_id, rank, dead, &reason));
        self.rt = Some(rt);
    }

    /// Applies the message kinds of `plan` that name this rank: `drop` (crash after N data messages), `kill`
    /// (crash at the start of a step) and `duplicate` (send one data message twice). A crash closes
    /// everything without a goodbye, as a killed process would. Kinds only the in-memory transport applies
    /// are refused, naming it; the trainer applies the rest of the plan.
    pub fn inject_faults(&mut self, plan: &FaultPlan) -> Result<()> {
        if let Some(kind) = plan.mem_only_kind() {
            return Err(local(format!(
                "fault {kind} is applied by the in-memory transport only (QUIC's streams deliver in order on \
                 their own schedule)"
            )));
        }
        let rank = self.cfg.rank;
        self.faults = InjectedFaults {
            crash_after_msgs: plan.dies_after_messages(rank),
            crash_at_step: plan.dies_at_step_index(rank),
            duplicate_msg: plan.duplicated_message(rank),
        };
        Ok(())
    }

    /// This rank's endpoint address.
    pub fn local_addr(&self) -> Option<SocketAddr> {
        self.endpoint.local_addr().ok()
    }

    /// Tests only: writes `bytes` unchanged onto the link to the right neighbour, between collectives, as a
    /// member holding the secret could (a replayed or forged frame).
    #[cfg(test)]
    fn send_raw_to_right(&mut self, bytes: &[u8]) -> Result<()> {
        let rt = self.rt.take().expect("runtime present until drop");
        let res = rt.block_on(async {
            let right = (self.cfg.rank + 1) % self.cfg.world;
            let send = &mut self
                .rights
                .get_mut(&right)
                .ok_or_else(|| local("no right neighbour link"))?
                .data;
            send.write_all_chunks(&mut [bytes::Bytes::copy_from_slice(bytes)])
                .await
                .map_err(|e| local(format!("raw write to the right neighbour: {e}")))
        });
        self.rt = Some(rt);
        res
    }

    fn rt(&self) -> &RankRuntime {
        self.rt.as_ref().expect("runtime present until drop")
    }

    /// Fault injection: closes everything without a goodbye.
    fn crash(&mut self) {
        self.crashed = true;
        self.shared.crashed.store(true, Ordering::SeqCst);
        self.shared.closing.store(true, Ordering::SeqCst);
        self.endpoint.close(2u32.into(), b"crashed");
        // Shared-memory links close their sockets, as a dead process's would.
        self.rights.clear();
        for task in self.lefts.values_mut().filter_map(|l| l.shm_reader.take()) {
            task.abort();
        }
    }

    /// Where this rank's flat-ring data goes: `[from the left, to the right]`, each "shm", "quic", or "none"
    /// in a world of one.
    pub fn data_links(&self) -> [&'static str; 2] {
        let (rank, n) = (self.cfg.rank, self.cfg.world);
        let left = match self.lefts.get(&((rank + n - 1) % n)) {
            Some(l) if l.shm_reader.is_some() => "shm",
            Some(_) => "quic",
            None => "none",
        };
        [
            left,
            self.rights.get(&((rank + 1) % n)).map_or("none", |r| r.data.kind()),
        ]
    }

    /// This rank's place in the two-level layout rank 0 chose, or `None` for the flat ring.
    pub fn layout(&self) -> Option<&TwoLevel> {
        self.two_level.as_ref()
    }

    fn current_poison(&self) -> Option<CollectiveError> {
        self.poison_rx.borrow().clone()
    }

    /// Leaves the job: flushes the right link, leaves the control plane, closes the endpoint.
    async fn goodbye(&mut self) {
        let wait = self.cfg.timeout.min(Duration::from_secs(10));
        let failed = self.failed.is_some();
        // Make sure the right neighbour has everything we sent (pointless after a failure).
        // A shared segment needs no flush: the neighbour's mapping keeps what was written.
        let mut flushed = Vec::new();
        for right in self.rights.values_mut() {
            if let links::RightData::Quic(send) = &mut right.data {
                let _ = send.finish();
                flushed.push(send);
            }
        }
        if !failed {
            let stopped = futures_util::future::join_all(flushed.into_iter().map(|send| send.stopped()));
            let _ = tokio::time::timeout(wait, stopped).await;
        }
        // Even after a failure, flush the control stream (it carries our abort report) before closing.
        let control_wait = if failed { wait.min(Duration::from_secs(2)) } else { wait };
        self.shared.closing.store(true, Ordering::SeqCst);
        self.control.leave(self.cfg.job_id, wait, control_wait).await;
        // After a failure the close carries its cause, so that a peer still dialling this rank reads why it
        // left rather than a plain goodbye.
        match &self.failed {
            None => self.endpoint.close(CLOSE_BYE.into(), b"bye"),
            Some(e) => self
                .endpoint
                .close(CLOSE_FAILED.into(), &close_reason(&format!("left after: {e}"))),
        }
        let _ = tokio::time::timeout(Duration::from_millis(200), self.endpoint.wait_idle()).await;
    }
}

/// Refuses settings no ring can run with, and caps the idle timeout at a third of the collective deadline.
fn validate(cfg: &mut QuicConfig) -> Result<()> {
    if cfg.world == 0 || cfg.rank >= cfg.world {
        return Err(local(format!(
            "rank {} is out of range for world size {}",
            cfg.rank, cfg.world
        )));
    }
    if cfg.sub_chunk == 0 || cfg.sub_chunk * 4 > frame::ABSOLUTE_MAX_PAYLOAD {
        return Err(local(format!(
            "sub_chunk {} out of range (1..={} elements)",
            cfg.sub_chunk,
            frame::ABSOLUTE_MAX_PAYLOAD / 4
        )));
    }
    if cfg.secret.as_ref().is_some_and(|s| s.is_empty()) {
        return Err(local("the cluster secret is empty"));
    }
    if let Some(a) = cfg.advertise_addr.filter(|a| a.ip().is_unspecified()) {
        return Err(local(format!(
            "cannot advertise {a}: the unspecified address is not one the other ranks can dial"
        )));
    }
    // A peer that stops answering (SIGSTOP, a hung host) is then declared dead by every link to it, rank 0's
    // control link included, which tells everyone whom to blame before the collectives waiting on it (and
    // on the ranks waiting on it) time out and name a healthy neighbour instead.
    cfg.idle_timeout = cfg.idle_timeout.min(cfg.timeout / 3).max(Duration::from_millis(300));
    Ok(())
}

/// What setup leaves for the collective loop.
struct Setup {
    endpoint: Endpoint,
    /// Rank 0 of an elastic job: where a member asking to join waits.
    joins: Option<JoinDesk>,
    /// Where each rank of the ring listens (rank 0 at the master address).
    addrs: Vec<SocketAddr>,
    links: DataLinks,
    two_level: Option<TwoLevel>,
    control: ControlPlane,
    /// Why the ring links could not be connected, if they could not: the control plane is up by then, so the
    /// rank can still say goodbye before failing.
    ring_error: Option<CollectiveError>,
}

/// Connects a bound rank to the job: start the endpoint and accept connections, rendezvous (as rank 0 or
/// as a joining rank), start the control plane, connect the ring links, then keep refusing late arrivals.
async fn setup(cfg: &QuicConfig, socket: UdpSocket, shared: Arc<Shared>) -> Result<Setup> {
    let key = auth::auth_key(cfg.secret.as_deref());
    let (endpoint, own_cert) = endpoint::start(socket, cfg.idle_timeout, &shared.compute_busy).map_err(local)?;
    let mut listener = Listener::start(&endpoint, key);
    let deadline = Instant::now() + cfg.rendezvous_timeout;
    let local_side = LocalSide::prepare(cfg)?;
    let own_local = local_side.endpoint.clone();
    let (ring, control) = if cfg.world == 1 {
        let ring = Ring {
            addrs: vec![cfg.master],
            certs: vec![own_cert],
            locals: vec![own_local],
            two_level: None,
        };
        (ring, ControlPlane::Alone)
    } else if cfg.rank == 0 {
        let (ring, joined) = rendezvous::host(cfg, &mut listener, own_cert, own_local, deadline).await?;
        (ring, ControlPlane::start_host(cfg.job_id, cfg.world, joined, &shared))
    } else {
        let (ring, host) = rendezvous::join(cfg, &endpoint, &key, own_local, deadline).await?;
        (ring, ControlPlane::start_client(host, &shared))
    };
    let shm = local_side.listener.as_ref();
    let two_level = match &ring.two_level {
        // Its length was checked against the world when the welcome was read.
        Some(labels) => Some(TwoLevel::new(labels, cfg.rank).map_err(|e| {
            local(format!(
                "rendezvous: rank 0 sent a two-level layout that cannot run: {e}"
            ))
        })?),
        None => None,
    };
    if let Some(t) = &two_level {
        tracing::info!(
            "rank {}: two-level ring: host ring {:?}, cross ring {:?}",
            cfg.rank,
            t.host,
            t.cross
        );
    }
    let connected = links::connect(
        cfg,
        &endpoint,
        &key,
        &ring,
        two_level.as_ref(),
        &mut listener,
        shm,
        &shared,
        deadline,
    )
    .await;
    let (links, ring_error) = match connected {
        Ok(links) => (links, None),
        Err(e) => (DataLinks::default(), Some(e)),
    };
    let joins = match (cfg.elastic_first, cfg.rank) {
        (Some(first_job), 0) => Some(JoinDesk::new(rendezvous::hello(cfg, None), first_job)),
        _ => None,
    };
    let answer_joins = match (&joins, cfg.elastic_first) {
        (Some(desk), _) => Some(Joins::Desk(desk.clone())),
        (None, Some(first_job)) => Some(Joins::Redirect {
            first_job,
            to: ring.addrs[0],
        }),
        (None, None) => None,
    };
    listener.refuse_late(cfg.job_id, answer_joins);
    Ok(Setup {
        endpoint,
        joins: joins.clone(),
        addrs: ring.addrs.clone(),
        links,
        two_level,
        control,
        ring_error,
    })
}

impl Collective for QuicCollective {
    fn rank(&self) -> usize {
        self.cfg.rank
    }

    fn sent_bytes(&self) -> crate::collective::SentBytes {
        self.sent_bytes.clone()
    }

    fn ring_addrs(&self) -> Option<Vec<SocketAddr>> {
        Some(self.ring_addrs.clone())
    }

    fn pending_join(&self) -> Option<u32> {
        self.joins.as_ref()?.waiting()
    }

    fn refuse_join(&mut self, member: u32, reason: &str) -> Result<()> {
        let Some(desk) = &self.joins else { return Ok(()) };
        let rt = self.rt.as_ref().ok_or_else(|| local("the runtime is gone"))?;
        rt.block_on(desk.refuse(self.cfg.job_id, member, reason));
        Ok(())
    }

    fn admit_join(&mut self, member: u32, epoch: u64, members: &[u32]) -> Result<()> {
        let Some(desk) = &self.joins else { return Ok(()) };
        let rt = self.rt.as_ref().ok_or_else(|| local("the runtime is gone"))?;
        rt.block_on(desk.admit(self.cfg.job_id, member, epoch, members))
    }

    fn world(&self) -> usize {
        self.cfg.world
    }

    fn wire(&self) -> crate::collective::Wire {
        self.wire
    }

    fn set_wire(&mut self, wire: crate::collective::Wire) {
        self.wire = wire;
    }

    /// In sub-chunks of `QuicConfig::sub_chunk` (one frame each); the driver hands the engine the pool that
    /// sent payloads return their storage to.
    fn run_f32(&mut self, op: RingOp, buf: &mut [f32]) -> Result<()> {
        let sub_chunk = self.cfg.sub_chunk;
        run_ring(self, op, buf, sub_chunk)
    }

    fn compute_busy(&self) -> Option<ComputeBusy> {
        Some(self.shared.compute_busy.clone())
    }

    fn ring_links(&self) -> Option<[&'static str; 2]> {
        Some(self.data_links())
    }

    fn set_step(&mut self, step: u64) {
        self.step = step;
        if self.faults.crash_at_step == Some(step) && !self.crashed {
            self.crash();
            self.failed = Some(local(format!(
                "rank {}: injected crash at step {}",
                self.cfg.rank,
                step + 1
            )));
        }
    }

    fn two_level(&self) -> Option<&TwoLevel> {
        self.two_level.as_ref()
    }

    fn run_engine(&mut self, engine: &mut dyn Engine) -> Result<()> {
        self.run_engine_on(SubRing::All, engine)
    }

    fn run_engine_on(&mut self, ring: SubRing, engine: &mut dyn Engine) -> Result<()> {
        if let Some(e) = &self.failed {
            return Err(e.clone());
        }
        let (left, right) = match ring {
            SubRing::All => {
                let (rank, n) = (self.cfg.rank, self.cfg.world);
                ((rank + n - 1) % n, (rank + 1) % n)
            }
            sub => {
                let (members, pos) = self
                    .two_level
                    .as_ref()
                    .and_then(|t| t.ring(sub))
                    .ok_or_else(|| local(format!("this job runs the flat ring: it has no {sub:?} ring")))?;
                let m = members.len();
                (members[(pos + m - 1) % m], members[(pos + 1) % m])
            }
        };
        let rt = self.rt.take().expect("runtime present until drop");
        let res = rt.block_on(self.drive(engine, left, right));
        self.rt = Some(rt);
        self.seq += 1;
        if let Err(e) = &res {
            self.report_failure(e);
            self.failed = Some(e.clone());
        }
        res
    }

    fn abort(&mut self, reason: &str) {
        if self.crashed {
            return;
        }
        let rank = self.cfg.rank;
        self.rt()
            .block_on(self.control.send_abort(self.cfg.job_id, rank, false, reason));
        if self.failed.is_none() {
            self.failed = Some(local(format!("this rank aborted: {reason}")));
        }
    }
}

impl Drop for QuicCollective {
    fn drop(&mut self) {
        if let Some(rt) = self.rt.take() {
            if !self.crashed {
                rt.block_on(self.goodbye());
            }
            drop(rt);
        }
    }
}
