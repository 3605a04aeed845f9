//! QUIC transport (quinn + tokio) for the ring collectives.
//!
//! # Topology
//! Rank 0 hosts the rendezvous on `MASTER_ADDR:MASTER_PORT`. Every other rank connects to it from its own
//! endpoint and says [`Hello`] (protocol version, job id, rank, world size, config hash); rank 0 refuses a
//! mismatch with a message naming the field. Once all ranks have joined, rank 0 sends every rank the ring of
//! listen addresses (the address it saw each hello come from, which is that rank's own endpoint), and each
//! rank opens a link to its right neighbour. The rendezvous connections stay open as the control plane:
//! aborts and deaths are reported to rank 0, which tells everyone else.
//!
//! # Authentication (TLS-exporter-bound HMAC)
//! Every endpoint presents a fresh self-signed certificate; the certificate itself proves nothing. Right
//! after the TLS 1.3 handshake, the connecting side sends `MAC(key, "C" || exporter)` and the accepting side
//! checks it before answering with `MAC(key, "S" || exporter)`, which the connecting side checks in turn.
//! `exporter` is 32 bytes of TLS keying material (RFC 5705/8446 exporter, label
//! `EXPORTER-ringtrain-auth-v1`), unique to this TLS session, so a token cannot be replayed on another
//! connection and a man in the middle (who necessarily runs two sessions with different exporters) cannot
//! relay it. `key = BLAKE3-derive_key(context, secret)` and `MAC` is keyed BLAKE3; comparison is constant
//! time. Nothing but the token is read from an unauthenticated peer, and its frame is bounded to 32 bytes.
//! There is no switch that turns this off.
//!
//! The secret comes from `RINGTRAIN_SECRET` or `--secret-file` ([`crate::dist::load_secret`]). Without one,
//! binding a non-loopback address is refused; on loopback a fixed well-known key is used (so any local user
//! could join, as with torchrun's standalone mode; `ringtrain launch` passes a random secret instead).
//!
//! # Failure handling
//! Connections send keep-alives and time out after `idle_timeout`. Every collective has a deadline
//! (`timeout`). A rank whose collective fails for a local reason sends an abort to rank 0, which forwards it;
//! a connection that drops without a goodbye makes rank 0 report that rank dead to everyone. A rank that
//! loses its link to the left waits briefly for rank 0's verdict, so the error names the rank that really
//! died, and otherwise names the neighbour. Losing rank 0 names rank 0.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use quinn::{Connection, Endpoint, RecvStream, SendStream};
use tokio::sync::{mpsc, watch, Mutex};
use tokio::time::Instant;

use super::buffer_pool::{BufferPool, PooledLeF32};
use super::frame::{self, FrameError, Header, Kind, SequenceGuard, HEADER_LEN, PROTOCOL_VERSION};
use super::le_pieces::LePieces;
use super::rank_runtime::RankRuntime;
use super::ring::Engine;
use super::{Collective, CollectiveError, Result};
use crate::dist::{Control, Hello};

const ALPN: &[u8] = b"ringtrain/1";
const SERVER_NAME: &str = "ringtrain";
const EXPORTER_LABEL: &[u8] = b"EXPORTER-ringtrain-auth-v1";
const MAX_CONTROL: usize = 1 << 20;
const MAX_REASON: usize = 4096;
/// Largest byte-gather blob (hashes, scalars) accepted on a data link.
pub const MAX_GATHER_BLOB: usize = 1 << 20;
/// Idle message buffers a rank keeps for reuse (see [`BufferPool`]).
const POOL_MAX_BYTES: usize = 64 << 20;

/// Settings of one rank.
#[derive(Clone, Debug)]
pub struct QuicConfig {
    pub rank: usize,
    pub world: usize,
    /// Rendezvous address; rank 0 binds it.
    pub master: SocketAddr,
    /// Address other ranks bind (port 0 = ephemeral). Default: 127.0.0.1 when the master is loopback, else
    /// the unspecified address of the master's family.
    pub bind_ip: Option<IpAddr>,
    pub job_id: u64,
    pub config_hash: u64,
    /// Cluster secret; `None` is allowed on loopback only.
    pub secret: Option<Vec<u8>>,
    /// Per-collective deadline.
    pub timeout: Duration,
    /// How long rendezvous may take (all ranks must start within it).
    pub rendezvous_timeout: Duration,
    /// Connection idle timeout (keep-alives are sent at a third of it); capped at `timeout`.
    pub idle_timeout: Duration,
    /// Pipelining granularity in f32 elements.
    pub sub_chunk: usize,
    /// Fault injection for tests: crash (close everything without goodbye) after sending this many data
    /// messages.
    pub crash_after_msgs: Option<usize>,
    /// Fault injection for tests: send data message number `k` (0-based, over this rank's lifetime) twice.
    pub duplicate_msg: Option<usize>,
}

impl QuicConfig {
    pub fn new(rank: usize, world: usize, master: SocketAddr) -> Self {
        QuicConfig {
            rank,
            world,
            master,
            bind_ip: None,
            job_id: 0,
            config_hash: 0,
            secret: None,
            timeout: Duration::from_secs(300),
            rendezvous_timeout: Duration::from_secs(300),
            idle_timeout: Duration::from_secs(10),
            sub_chunk: super::ring::DEFAULT_SUB_CHUNK,
            crash_after_msgs: None,
            duplicate_msg: None,
        }
    }
}

fn local(msg: impl Into<String>) -> CollectiveError {
    CollectiveError::Local(msg.into())
}

// ---------------------------------------------------------------------------------------------------------
// Authentication

fn auth_key(secret: Option<&[u8]>) -> [u8; 32] {
    match secret {
        Some(s) => blake3::derive_key("ringtrain 2026-11 cluster secret v1", s),
        None => blake3::derive_key("ringtrain 2026-11 loopback without secret v1", b""),
    }
}

fn auth_token(key: &[u8; 32], conn: &Connection, role: u8) -> std::result::Result<blake3::Hash, String> {
    let mut ekm = [0u8; 32];
    conn.export_keying_material(&mut ekm, EXPORTER_LABEL, b"")
        .map_err(|_| "TLS exporter unavailable".to_string())?;
    let mut m = [0u8; 33];
    m[0] = role;
    m[1..].copy_from_slice(&ekm);
    Ok(blake3::keyed_hash(key, &m))
}

/// Accepts any certificate but checks the handshake signatures; identity comes from the exporter-bound MAC.
#[derive(Debug)]
struct ExporterBound(Arc<rustls::crypto::CryptoProvider>);

impl rustls::client::danger::ServerCertVerifier for ExporterBound {
    fn verify_server_cert(
        &self,
        _end_entity: &rustls::pki_types::CertificateDer<'_>,
        _intermediates: &[rustls::pki_types::CertificateDer<'_>],
        _server_name: &rustls::pki_types::ServerName<'_>,
        _ocsp: &[u8],
        _now: rustls::pki_types::UnixTime,
    ) -> std::result::Result<rustls::client::danger::ServerCertVerified, rustls::Error> {
        Ok(rustls::client::danger::ServerCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &rustls::pki_types::CertificateDer<'_>,
        dss: &rustls::DigitallySignedStruct,
    ) -> std::result::Result<rustls::client::danger::HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls12_signature(message, cert, dss, &self.0.signature_verification_algorithms)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &rustls::pki_types::CertificateDer<'_>,
        dss: &rustls::DigitallySignedStruct,
    ) -> std::result::Result<rustls::client::danger::HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(message, cert, dss, &self.0.signature_verification_algorithms)
    }

    fn supported_verify_schemes(&self) -> Vec<rustls::SignatureScheme> {
        self.0.signature_verification_algorithms.supported_schemes()
    }
}

/// Transport tuning, chosen per link type and measured with `bench/allreduce/run.sh` (see BENCHMARKS.md).
///
/// On loopback, datagrams start at 16000 bytes (8000 on macOS; no 1200-byte start) and MTU discovery
/// raises them to 65000 once the handshake is done; the congestion window starts at 1 MiB. Large datagrams
/// are what pays here: quinn's default 1452-byte datagrams cost a syscall, a packet header and a kernel
/// buffer per 1.4 KiB.
/// Two limits shape the numbers:
/// - a long-header (handshake) packet encodes its length in a 2-byte varint, so it must stay under 16384
///   bytes; only short-header packets, sent after the handshake, can be larger, hence the discovery step;
/// - quinn's default initial window (14720 bytes) is below two such datagrams, so the first flight would
///   wait on the congestion controller forever; the window has to grow with the datagram size;
/// - the ceiling stays below IPv4's largest UDP payload (65507 bytes), so discovery's probes are sendable.
///
/// The 65000-byte ceiling took 5-20% less CPU per 64 MiB all-reduce than the 32000 used before, in
/// alternating runs (BENCHMARKS.md): half the datagrams, so half the per-packet work in quinn and the kernel.
///
/// Segmentation offload stays off: it gave no gain at any datagram size we measured, and without a cap on
/// the batch (quinn offers none) batches over 64 KiB are refused by the kernel.
/// Other links keep quinn's defaults (1200-byte start, MTU discovery, GSO), which are safe on any path.
#[derive(Clone, Copy, Debug)]
struct Tuning {
    /// UDP payload size used from the first packet (0 = quinn's default with MTU discovery).
    mtu: u16,
    /// Upper bound for MTU discovery once the handshake is done (0 = no discovery past `mtu`).
    mtu_ceiling: u16,
    /// Initial congestion window in bytes (0 = quinn's default).
    initial_window: u64,
    gso: bool,
    /// Requested UDP socket buffer sizes (the kernel caps them at rmem_max / wmem_max).
    sock_buf: usize,
    /// Size the flow-control windows from the receive buffer the kernel granted ([`flow_window_for`])
    /// instead of the fixed 16 MiB stream / 64 MiB connection windows.
    window_from_socket: bool,
}

/// First datagram size on loopback. macOS refuses UDP datagrams over `net.inet.udp.maxdgram` (9216 bytes
/// by default) and its loopback MTU is 16384, so it keeps the 8000 bytes used before; discovery may still
/// raise it where the system allows.
const LOOPBACK_START_MTU: u16 = if cfg!(target_os = "macos") { 8000 } else { 16000 };

impl Tuning {
    fn for_link(loopback: bool) -> Self {
        if loopback {
            Tuning {
                mtu: LOOPBACK_START_MTU,
                mtu_ceiling: 65000,
                initial_window: 1 << 20,
                gso: false,
                sock_buf: 4 << 20,
                window_from_socket: true,
            }
        } else {
            Tuning {
                mtu: 0,
                mtu_ceiling: 0,
                initial_window: 0,
                gso: true,
                sock_buf: 4 << 20,
                window_from_socket: false,
            }
        }
    }
}

/// Flow-control window (per stream and per connection) for a link whose receive socket buffer is reported
/// as `reported_rcvbuf` bytes. A sender may have a whole window in flight; when that exceeds what the
/// receiving socket can queue while its rank is off the CPU, the kernel drops datagrams (1-2% of them in
/// a 64 MiB all-reduce here with the 16 MiB window and 4 MiB buffers, 7-9% with Linux's default 208 KiB
/// `rmem_max`; BENCHMARKS.md), and every drop costs a retransmission and a congestion-window cut. The kernel charges each
/// queued datagram's full buffer size (payload plus a few percent of bookkeeping) against the limit it
/// reports (on Linux twice the size asked for), so three quarters of the reported size leaves room for the
/// bookkeeping and for the acknowledgements of the other direction. On loopback the round trip is tens of
/// microseconds, so even the smallest window here keeps the link busy (measured in BENCHMARKS.md).
fn flow_window_for(reported_rcvbuf: usize) -> u32 {
    (reported_rcvbuf / 4 * 3).clamp(128 << 10, 16 << 20) as u32
}

fn make_endpoint(socket: std::net::UdpSocket, idle: Duration, tuning: Tuning) -> std::result::Result<Endpoint, String> {
    // AES-128-GCM only: QUIC's mandatory suite, with 10 AES rounds instead of AES-256's 14 (packet
    // protection was 12-20% of a large all-reduce's CPU time in the profiles in BENCHMARKS.md). aws-lc-rs
    // rather than ring: its AVX-512 AES-GCM took about 30% less of the profile than ring's AVX2 code.
    let provider = Arc::new(rustls::crypto::CryptoProvider {
        cipher_suites: vec![rustls::crypto::aws_lc_rs::cipher_suite::TLS13_AES_128_GCM_SHA256],
        ..rustls::crypto::aws_lc_rs::default_provider()
    });
    let cert = rcgen::generate_simple_self_signed(vec![SERVER_NAME.to_string()]).map_err(|e| e.to_string())?;
    let cert_der = rustls::pki_types::CertificateDer::from(cert.cert.der().to_vec());
    let key_der = rustls::pki_types::PrivateKeyDer::Pkcs8(cert.key_pair.serialize_der().into());

    let mut granted_rcvbuf = None;
    if tuning.sock_buf > 0 {
        if let Ok(state) = quinn::udp::UdpSocketState::new((&socket).into()) {
            let _ = state.set_recv_buffer_size((&socket).into(), tuning.sock_buf);
            let _ = state.set_send_buffer_size((&socket).into(), tuning.sock_buf);
            granted_rcvbuf = state.recv_buffer_size((&socket).into()).ok();
        }
    }
    let (stream_window, conn_window) = match granted_rcvbuf {
        // One data stream per link: the connection window only needs to cover it.
        Some(b) if tuning.window_from_socket => (flow_window_for(b), flow_window_for(b)),
        _ => (16 << 20, 64 << 20),
    };
    let mut transport = quinn::TransportConfig::default();
    transport
        .max_idle_timeout(Some(quinn::IdleTimeout::try_from(idle).map_err(|e| e.to_string())?))
        .keep_alive_interval(Some(idle / 3))
        .stream_receive_window(quinn::VarInt::from_u32(stream_window))
        .receive_window(quinn::VarInt::from_u32(conn_window))
        .send_window(64 << 20)
        .enable_segmentation_offload(tuning.gso);
    if tuning.mtu > 0 {
        let discovery = (tuning.mtu_ceiling > tuning.mtu).then(|| {
            let mut d = quinn::MtuDiscoveryConfig::default();
            d.upper_bound(tuning.mtu_ceiling);
            d
        });
        transport
            .initial_mtu(tuning.mtu)
            .min_mtu(tuning.mtu)
            .mtu_discovery_config(discovery);
    }
    if tuning.initial_window > 0 {
        let mut cubic = quinn::congestion::CubicConfig::default();
        cubic.initial_window(tuning.initial_window);
        transport.congestion_controller_factory(Arc::new(cubic));
    }
    let transport = Arc::new(transport);
    let mut ep_cfg = quinn::EndpointConfig::default();
    if tuning.mtu > 0 {
        // What this endpoint accepts, announced to the peer: the discovery ceiling bounds its datagrams.
        ep_cfg
            .max_udp_payload_size(tuning.mtu.max(tuning.mtu_ceiling))
            .map_err(|e| e.to_string())?;
    }

    let mut server_tls = rustls::ServerConfig::builder_with_provider(provider.clone())
        .with_protocol_versions(&[&rustls::version::TLS13])
        .map_err(|e| e.to_string())?
        .with_no_client_auth()
        .with_single_cert(vec![cert_der], key_der)
        .map_err(|e| e.to_string())?;
    server_tls.alpn_protocols = vec![ALPN.to_vec()];
    let server_crypto = quinn::crypto::rustls::QuicServerConfig::try_from(server_tls).map_err(|e| e.to_string())?;
    let mut server = quinn::ServerConfig::with_crypto(Arc::new(server_crypto));
    server.transport_config(transport.clone());

    let mut client_tls = rustls::ClientConfig::builder_with_provider(provider.clone())
        .with_protocol_versions(&[&rustls::version::TLS13])
        .map_err(|e| e.to_string())?
        .dangerous()
        .with_custom_certificate_verifier(Arc::new(ExporterBound(provider)))
        .with_no_client_auth();
    client_tls.alpn_protocols = vec![ALPN.to_vec()];
    let client_crypto = quinn::crypto::rustls::QuicClientConfig::try_from(client_tls).map_err(|e| e.to_string())?;
    let mut client = quinn::ClientConfig::new(Arc::new(client_crypto));
    client.transport_config(transport);

    let runtime = quinn::default_runtime().ok_or("no async runtime for quinn")?;
    let mut ep = Endpoint::new(ep_cfg, Some(server), socket, runtime)
        .map_err(|e| format!("cannot start the QUIC endpoint: {e}"))?;
    ep.set_default_client_config(client);
    Ok(ep)
}

// ---------------------------------------------------------------------------------------------------------
// Frame I/O

#[derive(Debug)]
enum ReadFail {
    /// The stream or connection ended.
    Closed(String),
    /// The peer sent a frame the protocol forbids.
    Bad(FrameError),
}

impl std::fmt::Display for ReadFail {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ReadFail::Closed(s) => write!(f, "connection closed: {s}"),
            ReadFail::Bad(e) => write!(f, "bad frame: {e}"),
        }
    }
}

fn closed_reason(e: &quinn::ReadExactError) -> String {
    match e {
        quinn::ReadExactError::FinishedEarly(_) => "stream finished".into(),
        quinn::ReadExactError::ReadError(quinn::ReadError::ConnectionLost(c)) => c.to_string(),
        quinn::ReadExactError::ReadError(r) => r.to_string(),
    }
}

async fn read_frame(recv: &mut RecvStream, max_payload: usize) -> std::result::Result<(Header, Vec<u8>), ReadFail> {
    let mut hb = [0u8; HEADER_LEN];
    recv.read_exact(&mut hb)
        .await
        .map_err(|e| ReadFail::Closed(closed_reason(&e)))?;
    let h = Header::decode(&hb, max_payload).map_err(ReadFail::Bad)?;
    // `h.len` is bounded by `max_payload` here.
    let mut payload = vec![0u8; h.len as usize];
    recv.read_exact(&mut payload)
        .await
        .map_err(|e| ReadFail::Closed(closed_reason(&e)))?;
    Ok((h, payload))
}

/// The chunks of one data frame: the header, then the payload as its own buffer or buffers (no copy for
/// f32; an owned buffer's storage returns to `pool` once quinn is done with it).
fn data_frame_chunks(job: u64, step: u64, seq: u64, m: super::ring::Msg, pool: &Arc<BufferPool>) -> Vec<bytes::Bytes> {
    use super::ring::Payload;
    let (kind, payload) = match m.payload {
        Payload::F32(v) => (
            Kind::F32,
            vec![bytes::Bytes::from_owner(PooledLeF32::new(v, pool.clone()))],
        ),
        Payload::F32Le(p) => (Kind::F32, p.pieces),
        Payload::Bytes(v) => (Kind::Bytes, vec![bytes::Bytes::from(v)]),
    };
    let len: usize = payload.iter().map(|b| b.len()).sum();
    let h = Header {
        kind,
        job,
        step,
        seq,
        phase: m.phase,
        chunk: m.chunk,
        sub: m.sub,
        len: u32::try_from(len).expect("payload fits in u32"),
    };
    let mut hb = Vec::with_capacity(HEADER_LEN);
    h.encode(&mut hb);
    let mut chunks = Vec::with_capacity(1 + payload.len());
    chunks.push(bytes::Bytes::from(hb));
    chunks.extend(payload);
    chunks
}

/// Received stream data shorter than this is copied rather than kept as a slice of its datagram (a quarter
/// of the largest loopback datagram, so retained memory stays within 4x of the payload).
const MIN_ZERO_COPY_PIECE: usize = 16 << 10;

/// Data frames the left link's reader holds for the engine. Past that it stops reading, and QUIC flow
/// control holds the sender back, so a rank buffers at most this many sub-chunks (retained at most 4x, see
/// `MIN_ZERO_COPY_PIECE`) whatever its neighbour sends. The ring cannot deadlock on it: `drive` keeps
/// taking frames while its own writes wait.
const MAX_QUEUED_FRAMES: usize = 32;

/// Reads one data frame. A well-formed f32 payload is taken as the stream's own received pieces (no copy:
/// the engine sums or stores straight from them, see `le_pieces.rs`).
async fn read_data_frame(recv: &mut RecvStream, max_payload: usize) -> std::result::Result<LinkEvent, ReadFail> {
    let mut hb = [0u8; HEADER_LEN];
    recv.read_exact(&mut hb)
        .await
        .map_err(|e| ReadFail::Closed(closed_reason(&e)))?;
    let h = Header::decode(&hb, max_payload).map_err(ReadFail::Bad)?;
    // `h.len` is bounded by `max_payload` here.
    let len = h.len as usize;
    if h.kind == Kind::F32 && len % 4 == 0 {
        let mut pieces = Vec::new();
        // Small pieces are copied together: each piece keeps its whole datagram alive, so a peer sending
        // a few bytes per packet could otherwise pin up to 65 KB per byte sent (at most 4x here).
        let mut small = bytes::BytesMut::new();
        let mut left = len;
        while left > 0 {
            let chunk = recv
                .read_chunk(left, true)
                .await
                .map_err(|e| ReadFail::Closed(closed_reason(&quinn::ReadExactError::ReadError(e))))?;
            let chunk = chunk.ok_or_else(|| ReadFail::Closed("stream finished".into()))?;
            left -= chunk.bytes.len();
            if chunk.bytes.len() < MIN_ZERO_COPY_PIECE {
                small.extend_from_slice(&chunk.bytes);
            } else {
                if !small.is_empty() {
                    pieces.push(small.split().freeze());
                }
                pieces.push(chunk.bytes);
            }
        }
        if !small.is_empty() {
            pieces.push(small.freeze());
        }
        return Ok(LinkEvent::F32Le(h, pieces));
    }
    let mut payload = vec![0u8; len];
    recv.read_exact(&mut payload)
        .await
        .map_err(|e| ReadFail::Closed(closed_reason(&e)))?;
    Ok(LinkEvent::Frame(h, payload))
}

fn control_frame(job: u64, c: &Control) -> Vec<u8> {
    let payload = serde_json::to_vec(c).expect("control messages serialize");
    let h = Header {
        kind: Kind::Control,
        job,
        step: 0,
        seq: 0,
        phase: 0,
        chunk: 0,
        sub: 0,
        len: 0,
    };
    frame::encode_frame(h, &payload)
}

/// Abort notice: `chunk` = the rank blamed, `sub` = 1 when it is dead rather than aborting.
fn abort_frame(job: u64, rank: usize, dead: bool, reason: &str) -> Vec<u8> {
    let mut r = reason.as_bytes();
    if r.len() > MAX_REASON {
        r = &r[..MAX_REASON];
    }
    let h = Header {
        kind: Kind::Abort,
        job,
        step: 0,
        seq: 0,
        phase: 0,
        chunk: rank as u32,
        sub: dead as u32,
        len: 0,
    };
    frame::encode_frame(h, r)
}

fn parse_abort(h: &Header, payload: &[u8]) -> CollectiveError {
    let reason = String::from_utf8_lossy(payload).into_owned();
    let rank = h.chunk as usize;
    if h.sub == 1 {
        CollectiveError::PeerDead { rank, reason }
    } else {
        CollectiveError::Aborted { rank, reason }
    }
}

async fn read_control(recv: &mut RecvStream, job: Option<u64>) -> std::result::Result<Control, String> {
    let (h, p) = read_frame(recv, MAX_CONTROL).await.map_err(|e| e.to_string())?;
    if h.kind != Kind::Control {
        return Err(format!("expected a control frame, got {:?}", h.kind));
    }
    if let Some(j) = job {
        if h.job != j {
            return Err(format!(
                "job id mismatch: frame for job {:#x}, this job is {j:#x}",
                h.job
            ));
        }
    }
    serde_json::from_slice(&p).map_err(|e| format!("malformed control message: {e}"))
}

/// Connects to `addr` and runs the client side of the authentication exchange.
async fn dial(
    ep: &Endpoint,
    addr: SocketAddr,
    key: &[u8; 32],
) -> std::result::Result<(Connection, SendStream, RecvStream), String> {
    let conn = ep
        .connect(addr, SERVER_NAME)
        .map_err(|e| format!("cannot connect to {addr}: {e}"))?
        .await
        .map_err(|e| format!("cannot connect to {addr}: {e}"))?;
    let (mut send, mut recv) = conn
        .open_bi()
        .await
        .map_err(|e| format!("cannot open stream to {addr}: {e}"))?;
    let tok = auth_token(key, &conn, b'C')?;
    send.write_all(&auth_frame(&tok))
        .await
        .map_err(|e| format!("send to {addr}: {e}"))?;
    let (h, p) = read_frame(&mut recv, 32).await.map_err(|e| match e {
        ReadFail::Closed(s) => format!("authentication with {addr} failed (wrong cluster secret?): {s}"),
        ReadFail::Bad(b) => format!("authentication with {addr} failed: {b}"),
    })?;
    let want = auth_token(key, &conn, b'S')?;
    if !is_auth_token(&h, &p, &want) {
        conn.close(1u32.into(), b"authentication failed");
        return Err(format!(
            "{addr} failed to authenticate (it does not know the cluster secret)"
        ));
    }
    Ok((conn, send, recv))
}

/// The frame that carries one side's authentication token.
fn auth_frame(token: &blake3::Hash) -> Vec<u8> {
    let h = Header {
        kind: Kind::Auth,
        job: 0,
        step: 0,
        seq: 0,
        phase: 0,
        chunk: 0,
        sub: 0,
        len: 0,
    };
    frame::encode_frame(h, token.as_bytes())
}

/// Whether a received frame is an authentication frame holding exactly `want` (compared in constant time
/// by `blake3::Hash`'s `PartialEq`).
fn is_auth_token(h: &Header, payload: &[u8], want: &blake3::Hash) -> bool {
    h.kind == Kind::Auth && <[u8; 32]>::try_from(payload).is_ok_and(|bytes| blake3::Hash::from_bytes(bytes) == *want)
}

/// An authenticated incoming connection, after its first control message.
struct Joined {
    conn: Connection,
    send: SendStream,
    recv: RecvStream,
    msg: Control,
}

async fn serve_incoming(incoming: quinn::Incoming, key: [u8; 32], tx: mpsc::UnboundedSender<Joined>) {
    let work = async {
        let conn = incoming.await.map_err(|e| e.to_string())?;
        let (mut send, mut recv) = conn.accept_bi().await.map_err(|e| e.to_string())?;
        let res = read_frame(&mut recv, 32).await;
        let ok = match &res {
            Ok((h, p)) => is_auth_token(h, p, &auth_token(&key, &conn, b'C')?),
            Err(_) => false,
        };
        if !ok {
            conn.close(1u32.into(), b"authentication failed: wrong cluster secret");
            return Err("authentication failed".to_string());
        }
        let tok = auth_token(&key, &conn, b'S')?;
        send.write_all(&auth_frame(&tok)).await.map_err(|e| e.to_string())?;
        let msg = match read_control(&mut recv, None).await {
            Ok(m) => m,
            Err(e) => {
                // E.g. another protocol version: say why in the close reason, the one thing any version reads.
                let reason = format!("refused: {e}");
                conn.close(4u32.into(), &reason.as_bytes()[..reason.len().min(512)]);
                return Err(e);
            }
        };
        Ok::<_, String>(Joined { conn, send, recv, msg })
    };
    if let Ok(Ok(j)) = tokio::time::timeout(Duration::from_secs(30), work).await {
        let _ = tx.send(j);
    }
}

// ---------------------------------------------------------------------------------------------------------
// Shared state

struct Shared {
    /// First fatal error reported by the control plane or a link.
    poison: watch::Sender<Option<CollectiveError>>,
    /// Set when this rank is leaving: losses seen after this are expected.
    closing: AtomicBool,
    /// Set when this rank crashes on purpose (tests): its own connections drop, nobody else's fault.
    crashed: AtomicBool,
    /// Message buffers recycled between the sending side and the left link's reader.
    pool: Arc<BufferPool>,
}

impl Shared {
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

enum LinkEvent {
    Frame(Header, Vec<u8>),
    /// A data frame of kind F32: its payload as received, `h.len` bytes in all (a multiple of 4).
    F32Le(Header, Vec<bytes::Bytes>),
    Closed(String),
    Bad(FrameError),
}

/// Why a link event ended the collective.
enum EventError {
    /// A protocol violation or a local failure: the collective fails with it.
    Fatal(CollectiveError),
    /// The left link broke, for this reason; who is to blame is still to be found out.
    LinkLost(String),
}

/// Feeds one event of the left link (`None`: its reader stopped) to `engine`, after checking the frame's
/// tags and size.
fn apply_event(
    ev: Option<LinkEvent>,
    engine: &mut dyn Engine,
    guard: &mut SequenceGuard,
    pool: &Arc<BufferPool>,
    left_rank: usize,
) -> std::result::Result<(), EventError> {
    let proto = |msg: String| EventError::Fatal(CollectiveError::Protocol { rank: left_rank, msg });
    // Tags first, then the size this engine can take (the reader read `len` bytes for either kind).
    let mut check = |h: &Header, len: usize| {
        guard.check(h).map_err(|e| proto(e.to_string()))?;
        let max = engine.max_payload_bytes();
        if len > max {
            return Err(proto(format!("payload of {len} bytes exceeds the {max} expected")));
        }
        Ok(())
    };
    match ev.unwrap_or(LinkEvent::Closed("reader stopped".into())) {
        LinkEvent::Frame(h, payload) => {
            check(&h, payload.len())?;
            let msg = frame::decode_msg(&h, &payload).map_err(|e| proto(e.to_string()))?;
            engine.handle(msg).map_err(|e| proto(e.to_string()))
        }
        LinkEvent::F32Le(h, pieces) => {
            check(&h, h.len as usize)?;
            let msg = super::ring::Msg {
                phase: h.phase,
                chunk: h.chunk,
                sub: h.sub,
                payload: super::ring::Payload::F32Le(LePieces {
                    pieces,
                    pool: Some(pool.clone()),
                }),
            };
            engine.handle(msg).map_err(|e| proto(e.to_string()))
        }
        LinkEvent::Bad(e) => Err(proto(e.to_string())),
        LinkEvent::Closed(reason) => Err(EventError::LinkLost(reason)),
    }
}

/// One control stream from rank 0 to a joined rank.
struct ClientSlot {
    send: Mutex<SendStream>,
    said_bye: AtomicBool,
}

enum ControlPlane {
    Host {
        clients: Arc<Vec<Option<Arc<ClientSlot>>>>,
        live: Arc<AtomicUsize>,
    },
    Client {
        send: Arc<Mutex<SendStream>>,
    },
    Alone,
}

/// One rank of a QUIC ring.
pub struct QuicCollective {
    rt: Option<RankRuntime>,
    cfg: QuicConfig,
    endpoint: Endpoint,
    shared: Arc<Shared>,
    poison_rx: watch::Receiver<Option<CollectiveError>>,
    right: Option<(Connection, SendStream)>,
    left: Option<(Connection, mpsc::Receiver<LinkEvent>)>,
    control: ControlPlane,
    guard: SequenceGuard,
    seq: u64,
    step: u64,
    sent_msgs: usize,
    crashed: bool,
    failed: Option<CollectiveError>,
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
    pub fn connect_with_socket(cfg: QuicConfig, socket: std::net::UdpSocket) -> Result<Self> {
        Self::connect_inner(cfg, Some(socket))
    }

    fn connect_inner(mut cfg: QuicConfig, socket: Option<std::net::UdpSocket>) -> Result<Self> {
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
        cfg.idle_timeout = cfg.idle_timeout.min(cfg.timeout).max(Duration::from_millis(300));
        let bind = if cfg.rank == 0 {
            cfg.master
        } else {
            let ip = cfg.bind_ip.unwrap_or(match cfg.master.ip() {
                ip if ip.is_loopback() => ip,
                IpAddr::V4(_) => IpAddr::V4(Ipv4Addr::UNSPECIFIED),
                IpAddr::V6(_) => IpAddr::V6(Ipv6Addr::UNSPECIFIED),
            });
            SocketAddr::new(ip, 0)
        };
        let no_secret_refusal = |addr: SocketAddr| {
            local(format!(
                "refusing to bind non-loopback address {addr} without a cluster secret: set RINGTRAIN_SECRET or \
                 --secret-file"
            ))
        };
        if cfg.secret.is_none() && socket.is_none() && !bind.ip().is_loopback() {
            return Err(no_secret_refusal(bind));
        }
        let socket = match socket {
            Some(s) => s,
            None => std::net::UdpSocket::bind(bind).map_err(|e| local(format!("cannot bind {bind}: {e}")))?,
        };
        let bind = socket.local_addr().map_err(|e| local(format!("socket address: {e}")))?;
        if cfg.rank == 0 && cfg.master.port() == 0 {
            cfg.master = bind;
        }
        if cfg.secret.is_none() && !bind.ip().is_loopback() {
            return Err(no_secret_refusal(bind));
        }
        let rt = RankRuntime::new(format!("ringtrain-quic-{}", cfg.rank))
            .map_err(|e| local(format!("cannot start the async runtime: {e}")))?;
        let (poison, poison_rx) = watch::channel(None);
        let shared = Arc::new(Shared {
            poison,
            closing: AtomicBool::new(false),
            crashed: AtomicBool::new(false),
            pool: BufferPool::new(POOL_MAX_BYTES),
        });
        let setup = rt.block_on(setup(&cfg, socket, shared.clone()));
        let s = match setup {
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
            right: s.right,
            left: s.left,
            control: s.control,
            seq: 0,
            step: 0,
            sent_msgs: 0,
            crashed: false,
            failed: ring_error.clone(),
            _keep: s.keep,
        };
        match ring_error {
            // Dropping says goodbye: rank 0 stays up until the others have heard why.
            Some(e) => Err(e),
            None => Ok(q),
        }
    }

    /// This rank's endpoint address.
    pub fn local_addr(&self) -> Option<SocketAddr> {
        self.endpoint.local_addr().ok()
    }

    fn rt(&self) -> &RankRuntime {
        self.rt.as_ref().expect("runtime present until drop")
    }

    fn crash(&mut self) {
        self.crashed = true;
        self.shared.crashed.store(true, Ordering::SeqCst);
        self.shared.closing.store(true, Ordering::SeqCst);
        self.endpoint.close(2u32.into(), b"crashed");
    }

    fn current_poison(&self) -> Option<CollectiveError> {
        self.poison_rx.borrow().clone()
    }

    async fn drive(&mut self, engine: &mut dyn Engine) -> Result<()> {
        let n = self.cfg.world;
        let rank = self.cfg.rank;
        let (left_rank, right_rank) = ((rank + n - 1) % n, (rank + 1) % n);
        let deadline = Instant::now() + self.cfg.timeout;
        let secs = self.cfg.timeout.as_secs_f64();
        let seq = self.seq;
        self.guard.begin(seq, self.step);
        let mut poison_rx = self.poison_rx.clone();
        loop {
            if let Some(e) = self.current_poison() {
                return Err(e);
            }
            while let Some(m) = engine.poll_transmit() {
                if let Some(k) = self.cfg.crash_after_msgs {
                    if self.sent_msgs >= k {
                        self.crash();
                        return Err(local(format!("rank {rank}: injected crash after {k} messages")));
                    }
                }
                let mut chunks = data_frame_chunks(self.cfg.job_id, self.step, seq, m, &self.shared.pool);
                if self.cfg.duplicate_msg == Some(self.sent_msgs) {
                    chunks.extend_from_within(..);
                }
                self.sent_msgs += 1;
                // While the write waits for flow-control credit, keep taking what the left neighbour sends:
                // it may itself be waiting on us, and the reader's queue is bounded.
                let lost = {
                    let (_, send) = self.right.as_mut().ok_or_else(|| local("no right neighbour link"))?;
                    let (_, rx) = self.left.as_mut().ok_or_else(|| local("no left neighbour link"))?;
                    let (guard, pool) = (&mut self.guard, &self.shared.pool);
                    let mut write = std::pin::pin!(send.write_all_chunks(&mut chunks));
                    loop {
                        tokio::select! {
                            r = &mut write => match r {
                                Ok(()) => break None,
                                Err(e) => break Some((right_rank, e.to_string())),
                            },
                            ev = rx.recv(), if engine.wants_input() => {
                                match apply_event(ev, engine, guard, pool, left_rank) {
                                    Ok(()) => {}
                                    Err(EventError::Fatal(e)) => return Err(e),
                                    Err(EventError::LinkLost(reason)) => break Some((left_rank, reason)),
                                }
                            }
                            _ = tokio::time::sleep_until(deadline) =>
                                return Err(CollectiveError::Timeout { seq, waiting_on: right_rank, secs }),
                            _ = poison_rx.changed() =>
                                break Some((right_rank, "control plane reported a failure".to_string())),
                        }
                    }
                };
                if let Some((peer, reason)) = lost {
                    return Err(self.blame(peer, &reason, deadline).await);
                }
            }
            if engine.is_done() {
                return Ok(());
            }
            let (_, rx) = self.left.as_mut().ok_or_else(|| local("no left neighbour link"))?;
            let ev = tokio::select! {
                ev = rx.recv() => ev,
                _ = tokio::time::sleep_until(deadline) =>
                    return Err(CollectiveError::Timeout { seq, waiting_on: left_rank, secs }),
                r = poison_rx.changed() => {
                    if let Some(e) = self.current_poison() { return Err(e); }
                    if r.is_err() { return Err(local("control plane stopped")); }
                    continue;
                }
            };
            match apply_event(ev, engine, &mut self.guard, &self.shared.pool, left_rank) {
                Ok(()) => {}
                Err(EventError::Fatal(e)) => return Err(e),
                Err(EventError::LinkLost(reason)) => return Err(self.blame(left_rank, &reason, deadline).await),
            }
        }
    }

    /// A link broke: give rank 0's verdict time to arrive, so the error names the rank that really died
    /// (the neighbour may just have left after seeing the failure first). If rank 0 itself died, its close
    /// may never arrive and only the keep-alive idle timeout reveals it, so the wait covers that timeout.
    /// Otherwise blame the neighbour.
    async fn blame(&self, peer: usize, reason: &str, deadline: Instant) -> CollectiveError {
        let fallback = CollectiveError::PeerDead {
            rank: peer,
            reason: format!("link lost: {reason}"),
        };
        let wait = Duration::from_millis(1500).max(self.cfg.idle_timeout + Duration::from_millis(500));
        let grace = (Instant::now() + wait).min(deadline);
        let mut poison_rx = self.poison_rx.clone();
        loop {
            if let Some(e) = self.current_poison() {
                return e;
            }
            tokio::select! {
                r = poison_rx.changed() => if r.is_err() { return fallback },
                _ = tokio::time::sleep_until(grace) => return fallback,
            }
        }
    }

    async fn send_abort(&self, rank: usize, dead: bool, reason: &str) {
        let bytes = abort_frame(self.cfg.job_id, rank, dead, reason);
        match &self.control {
            ControlPlane::Client { send } => {
                let _ = tokio::time::timeout(Duration::from_secs(1), async {
                    send.lock().await.write_all(&bytes).await
                })
                .await;
            }
            ControlPlane::Host { clients, .. } => broadcast_control(clients, &bytes, None).await,
            ControlPlane::Alone => {}
        }
    }

    async fn goodbye(&mut self) {
        let wait = self.cfg.timeout.min(Duration::from_secs(10));
        let failed = self.failed.is_some();
        // 1. Make sure the right neighbour has everything we sent (pointless after a failure).
        if let Some((_, send)) = self.right.as_mut() {
            let _ = send.finish();
            if !failed {
                let _ = tokio::time::timeout(wait, send.stopped()).await;
            }
        }
        // Even after a failure, flush the control stream (it carries our abort report) before closing.
        let control_wait = if failed { wait.min(Duration::from_secs(2)) } else { wait };
        self.shared.closing.store(true, Ordering::SeqCst);
        match &self.control {
            ControlPlane::Client { send } => {
                let bytes = control_frame(self.cfg.job_id, &Control::Bye);
                let mut s = send.lock().await;
                if s.write_all(&bytes).await.is_ok() {
                    let _ = s.finish();
                    let _ = tokio::time::timeout(control_wait, s.stopped()).await;
                }
            }
            ControlPlane::Host { live, .. } => {
                // 2. Rank 0 keeps the control plane up until everyone else has left (after a failure too:
                //    the others may not have heard of it yet).
                let until = Instant::now() + wait;
                while live.load(Ordering::SeqCst) > 0 && Instant::now() < until {
                    tokio::time::sleep(Duration::from_millis(10)).await;
                }
            }
            ControlPlane::Alone => {}
        }
        self.endpoint.close(0u32.into(), b"bye");
        let _ = tokio::time::timeout(Duration::from_millis(200), self.endpoint.wait_idle()).await;
    }
}

async fn broadcast_control(clients: &[Option<Arc<ClientSlot>>], bytes: &[u8], except: Option<usize>) {
    for (r, c) in clients.iter().enumerate() {
        if Some(r) == except {
            continue;
        }
        if let Some(c) = c {
            let _ = tokio::time::timeout(Duration::from_secs(1), async {
                c.send.lock().await.write_all(bytes).await
            })
            .await;
        }
    }
}

struct Setup {
    endpoint: Endpoint,
    right: Option<(Connection, SendStream)>,
    left: Option<(Connection, mpsc::Receiver<LinkEvent>)>,
    control: ControlPlane,
    keep: Vec<SendStream>,
    ring_error: Option<CollectiveError>,
}

async fn setup(cfg: &QuicConfig, socket: std::net::UdpSocket, shared: Arc<Shared>) -> Result<Setup> {
    let key = auth_key(cfg.secret.as_deref());
    let loopback = socket.local_addr().map(|a| a.ip().is_loopback()).unwrap_or(false);
    let endpoint = make_endpoint(socket, cfg.idle_timeout, Tuning::for_link(loopback)).map_err(local)?;
    let (joined_tx, mut joined_rx) = mpsc::unbounded_channel::<Joined>();
    {
        let ep = endpoint.clone();
        tokio::spawn(async move {
            while let Some(inc) = ep.accept().await {
                tokio::spawn(serve_incoming(inc, key, joined_tx.clone()));
            }
        });
    }
    let deadline = Instant::now() + cfg.rendezvous_timeout;
    let me = Hello {
        version: PROTOCOL_VERSION,
        job_id: cfg.job_id,
        rank: cfg.rank,
        world: cfg.world,
        config_hash: cfg.config_hash,
    };
    let n = cfg.world;
    // Peer hellos that arrive during the rendezvous (from fast neighbours) are kept for the ring stage.
    let mut early_peers: Vec<Joined> = Vec::new();

    let (addrs, control) = if n == 1 {
        (vec![cfg.master], ControlPlane::Alone)
    } else if cfg.rank == 0 {
        let mut slots: Vec<Option<Joined>> = (0..n).map(|_| None).collect();
        let mut joined = 0;
        while joined < n - 1 {
            let j = tokio::select! {
                j = joined_rx.recv() => j.ok_or_else(|| local("rendezvous listener stopped"))?,
                _ = tokio::time::sleep_until(deadline) => {
                    let missing: Vec<usize> = (1..n).filter(|&r| slots[r].is_none()).collect();
                    return Err(local(format!("rendezvous timed out after {:?}: ranks {missing:?} did not join",
                        cfg.rendezvous_timeout)));
                }
            };
            let hello = match &j.msg {
                Control::Hello(h) => h.clone(),
                Control::PeerHello { .. } => {
                    early_peers.push(j);
                    continue;
                }
                _ => continue,
            };
            let verdict = hello.check_against(&me).and_then(|_| {
                if slots[hello.rank].is_some() {
                    Err(format!("rank {} has already joined", hello.rank))
                } else {
                    Ok(())
                }
            });
            match verdict {
                Ok(()) => {
                    slots[hello.rank] = Some(j);
                    joined += 1;
                }
                Err(reason) => {
                    tracing::warn!("rendezvous refused a rank: {reason}");
                    let mut j = j;
                    let bytes = control_frame(cfg.job_id, &Control::Refused { reason });
                    tokio::spawn(async move {
                        let _ = j.send.write_all(&bytes).await;
                        let _ = j.send.finish();
                        let _ = tokio::time::timeout(Duration::from_secs(2), j.send.stopped()).await;
                        j.conn.close(3u32.into(), b"refused");
                    });
                }
            }
        }
        let mut addrs = vec![cfg.master];
        for s in slots.iter().skip(1) {
            addrs.push(s.as_ref().expect("all joined").conn.remote_address());
        }
        let welcome = control_frame(cfg.job_id, &Control::Welcome { addrs: addrs.clone() });
        let live = Arc::new(AtomicUsize::new(n - 1));
        let mut client_slots: Vec<Option<Arc<ClientSlot>>> = vec![None];
        let mut readers = Vec::new();
        for s in slots.into_iter().skip(1) {
            let mut j = s.expect("all joined");
            j.send
                .write_all(&welcome)
                .await
                .map_err(|e| local(format!("rendezvous: {e}")))?;
            let slot = Arc::new(ClientSlot {
                send: Mutex::new(j.send),
                said_bye: AtomicBool::new(false),
            });
            client_slots.push(Some(slot.clone()));
            readers.push((j.recv, j.conn, slot));
        }
        let clients = Arc::new(client_slots);
        for (r, (mut recv, conn, slot)) in readers.into_iter().enumerate() {
            let rank = r + 1;
            let (clients, shared, live, job) = (clients.clone(), shared.clone(), live.clone(), cfg.job_id);
            tokio::spawn(async move {
                let _conn = conn;
                loop {
                    match read_frame(&mut recv, MAX_CONTROL).await {
                        Ok((h, p)) if h.kind == Kind::Abort => {
                            // Rank `rank` aborts, or reports another rank dead (`chunk` names it).
                            let reason = String::from_utf8_lossy(&p).into_owned();
                            let (blamed, dead) = if (h.chunk as usize) < n {
                                (h.chunk as usize, h.sub == 1)
                            } else {
                                (rank, false)
                            };
                            let e = if dead {
                                CollectiveError::PeerDead {
                                    rank: blamed,
                                    reason: reason.clone(),
                                }
                            } else {
                                CollectiveError::Aborted {
                                    rank: blamed,
                                    reason: reason.clone(),
                                }
                            };
                            shared.poison(e);
                            let frame = abort_frame(job, blamed, dead, &reason);
                            broadcast_control(&clients, &frame, Some(rank)).await;
                        }
                        Ok((h, p)) if h.kind == Kind::Control => {
                            if let Ok(Control::Bye) = serde_json::from_slice::<Control>(&p) {
                                slot.said_bye.store(true, Ordering::SeqCst);
                            }
                        }
                        Ok(_) => {}
                        Err(e) => {
                            // A host that crashed (fault injection) closed this connection itself: that says
                            // nothing about the rank on the other end, so it must not be reported dead.
                            if !slot.said_bye.load(Ordering::SeqCst) && !shared.crashed.load(Ordering::SeqCst) {
                                let reason = format!("lost its connection to rank 0: {e}");
                                shared.poison(CollectiveError::PeerDead {
                                    rank,
                                    reason: reason.clone(),
                                });
                                broadcast_control(&clients, &abort_frame(job, rank, true, &reason), Some(rank)).await;
                            }
                            break;
                        }
                    }
                }
                live.fetch_sub(1, Ordering::SeqCst);
            });
        }
        (addrs, ControlPlane::Host { clients, live })
    } else {
        let (conn, mut send, mut recv) = loop {
            let attempt = tokio::time::timeout_at(deadline, dial(&endpoint, cfg.master, &key)).await;
            match attempt {
                Err(_) => return Err(local(format!("rendezvous with rank 0 at {} timed out", cfg.master))),
                Ok(Ok(c)) => break c,
                Ok(Err(e)) if e.contains("authentication") || e.contains("authenticate") => {
                    return Err(local(format!("rendezvous with rank 0: {e}")))
                }
                Ok(Err(e)) => {
                    tracing::debug!("rendezvous attempt failed, retrying: {e}");
                    if Instant::now() + Duration::from_millis(200) >= deadline {
                        return Err(local(format!("rendezvous with rank 0 at {} failed: {e}", cfg.master)));
                    }
                    tokio::time::sleep(Duration::from_millis(200)).await;
                }
            }
        };
        send.write_all(&control_frame(cfg.job_id, &Control::Hello(me.clone())))
            .await
            .map_err(|e| local(format!("rendezvous: {e}")))?;
        let reply = tokio::time::timeout_at(deadline, read_control(&mut recv, None))
            .await
            .map_err(|_| local("rendezvous timed out waiting for the other ranks"))?
            .map_err(|e| local(format!("rendezvous with rank 0: {e}")))?;
        let addrs = match reply {
            Control::Welcome { addrs } if addrs.len() == n => addrs,
            Control::Welcome { addrs } => {
                return Err(local(format!(
                    "rendezvous: rank 0 sent {} addresses for world size {n}",
                    addrs.len()
                )))
            }
            Control::Refused { reason } => return Err(local(format!("rendezvous refused by rank 0: {reason}"))),
            other => return Err(local(format!("rendezvous: unexpected reply {other:?}"))),
        };
        let shared2 = shared.clone();
        tokio::spawn(async move {
            let _conn = conn;
            loop {
                match read_frame(&mut recv, MAX_CONTROL).await {
                    Ok((h, p)) if h.kind == Kind::Abort => shared2.poison(parse_abort(&h, &p)),
                    Ok(_) => {}
                    Err(e) => {
                        shared2.poison(CollectiveError::PeerDead {
                            rank: 0,
                            reason: format!("lost the connection to rank 0 (rendezvous host): {e}"),
                        });
                        break;
                    }
                }
            }
        });
        (
            addrs,
            ControlPlane::Client {
                send: Arc::new(Mutex::new(send)),
            },
        )
    };

    // Ring links. A failure here is returned inside `Setup`, so the control plane can still say goodbye.
    let ring = async {
        let (mut right, mut left, mut keep) = (None, None, Vec::new());
        if n > 1 {
            let rank = cfg.rank;
            let left_rank = (rank + n - 1) % n;
            let right_rank = (rank + 1) % n;
            let right_addr = if right_rank == 0 { cfg.master } else { addrs[right_rank] };
            let open_right = async {
                let (conn, mut send, recv) = tokio::time::timeout_at(deadline, dial(&endpoint, right_addr, &key))
                    .await
                    .map_err(|_| local(format!("connecting to right neighbour rank {right_rank} timed out")))?
                    .map_err(|e| local(format!("connecting to right neighbour rank {right_rank}: {e}")))?;
                send.write_all(&control_frame(
                    cfg.job_id,
                    &Control::PeerHello {
                        job_id: cfg.job_id,
                        rank,
                    },
                ))
                .await
                .map_err(|e| CollectiveError::PeerDead {
                    rank: right_rank,
                    reason: e.to_string(),
                })?;
                drop(recv);
                Ok::<_, CollectiveError>((conn, send))
            };
            let accept_left = async {
                loop {
                    let j = match early_peers.pop() {
                        Some(j) => j,
                        None => tokio::select! {
                            j = joined_rx.recv() => j.ok_or_else(|| local("listener stopped"))?,
                            _ = tokio::time::sleep_until(deadline) =>
                                return Err(local(format!("left neighbour rank {left_rank} did not connect in time"))),
                        },
                    };
                    match j.msg {
                        Control::PeerHello { job_id, rank: r } if job_id == cfg.job_id && r == left_rank => {
                            return Ok::<_, CollectiveError>((j.conn, j.send, j.recv))
                        }
                        Control::Hello(_) => {
                            let mut j = j;
                            let bytes = control_frame(
                                cfg.job_id,
                                &Control::Refused {
                                    reason: "the rendezvous is closed (all ranks have joined)".into(),
                                },
                            );
                            tokio::spawn(async move {
                                let _ = j.send.write_all(&bytes).await;
                                let _ = j.send.finish();
                                tokio::time::sleep(Duration::from_millis(500)).await;
                            });
                        }
                        _ => j.conn.close(3u32.into(), b"unexpected peer"),
                    }
                }
            };
            // A rank that dies while the ring forms is reported by rank 0: stop waiting then.
            let mut prx = shared.poison.subscribe();
            let (r, l) = tokio::select! {
                rl = async { tokio::join!(open_right, accept_left) } => rl,
                p = prx.wait_for(|p| p.is_some()) => {
                    return Err(p.ok().and_then(|p| p.clone()).unwrap_or_else(|| local("control plane failed")));
                }
            };
            right = Some(r?);
            let (conn, send, mut recv) = l?;
            keep.push(send);
            let (tx, rx) = mpsc::channel(MAX_QUEUED_FRAMES);
            let max = (cfg.sub_chunk * 4).max(MAX_GATHER_BLOB);
            tokio::spawn(async move {
                loop {
                    match read_data_frame(&mut recv, max).await {
                        Ok(ev) => {
                            if tx.send(ev).await.is_err() {
                                break;
                            }
                        }
                        Err(ReadFail::Closed(s)) => {
                            let _ = tx.send(LinkEvent::Closed(s)).await;
                            break;
                        }
                        Err(ReadFail::Bad(e)) => {
                            let _ = tx.send(LinkEvent::Bad(e)).await;
                            break;
                        }
                    }
                }
            });
            left = Some((conn, rx));
        }
        Ok::<_, CollectiveError>((right, left, keep))
    };
    let (right, left, keep, ring_error) = match ring.await {
        Ok((r, l, k)) => (r, l, k, None),
        Err(e) => (None, None, Vec::new(), Some(e)),
    };
    // Late connections after setup (a refused impostor, a retry) keep being answered.
    tokio::spawn(async move {
        while let Some(mut j) = joined_rx.recv().await {
            if matches!(j.msg, Control::Hello(_)) {
                let bytes = control_frame(
                    0,
                    &Control::Refused {
                        reason: "the rendezvous is closed".into(),
                    },
                );
                let _ = j.send.write_all(&bytes).await;
                let _ = j.send.finish();
            }
        }
    });
    Ok(Setup {
        endpoint,
        right,
        left,
        control,
        keep,
        ring_error,
    })
}

impl Collective for QuicCollective {
    fn rank(&self) -> usize {
        self.cfg.rank
    }

    fn world(&self) -> usize {
        self.cfg.world
    }

    fn sub_chunk(&self) -> usize {
        self.cfg.sub_chunk
    }

    fn set_step(&mut self, step: u64) {
        self.step = step;
    }

    fn run_engine(&mut self, engine: &mut dyn Engine) -> Result<()> {
        if let Some(e) = &self.failed {
            return Err(e.clone());
        }
        let rt = self.rt.take().expect("runtime present until drop");
        let res = rt.block_on(self.drive(engine));
        self.rt = Some(rt);
        self.seq += 1;
        if let Err(e) = &res {
            // Tell everyone what this rank found (unless it came from the control plane already), so they fail
            // now rather than at their own deadline.
            if !self.crashed && self.current_poison().as_ref() != Some(e) {
                let me = self.cfg.rank;
                let (rank, dead, reason) = match e {
                    CollectiveError::PeerDead { rank, reason } => {
                        (*rank, true, format!("rank {me} lost its link to it: {reason}"))
                    }
                    other => (me, false, other.to_string()),
                };
                let rt = self.rt.take().expect("runtime");
                rt.block_on(self.send_abort(rank, dead, &reason));
                self.rt = Some(rt);
            }
            self.failed = Some(e.clone());
        }
        res
    }

    fn abort(&mut self, reason: &str) {
        if self.crashed {
            return;
        }
        let rank = self.cfg.rank;
        self.rt().block_on(self.send_abort(rank, false, reason));
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

#[cfg(test)]
mod tests {
    use super::*;

    /// Largest packet a QUIC long header can describe (its length field is a 2-byte varint).
    const MAX_LONG_HEADER_PACKET: u16 = (1 << 14) - 1;

    /// The limits in [`Tuning`]'s comment: a handshake packet must fit a long header, and the first
    /// congestion window must hold several of the largest datagrams, or the first flight never leaves.
    #[test]
    fn flow_window_fits_the_granted_receive_buffer() {
        // Linux's default rmem_max (208 KiB) and the 4 MiB the loopback tuning asks for, both reported doubled.
        assert_eq!(flow_window_for(2 * 212_992), 319_488);
        assert_eq!(flow_window_for(2 * (4 << 20)), 6 << 20);
        // Never below a couple of the largest datagrams, never above the fixed window of other links.
        let largest = Tuning::for_link(true).mtu_ceiling as u32;
        assert!(flow_window_for(0) >= 2 * largest);
        assert_eq!(flow_window_for(usize::MAX), 16 << 20);
    }

    #[test]
    fn loopback_tuning_respects_quic_packet_limits() {
        for loopback in [true, false] {
            let t = Tuning::for_link(loopback);
            assert!(t.mtu <= MAX_LONG_HEADER_PACKET, "{t:?}");
            if t.mtu > 0 {
                assert!(t.mtu >= 1200, "QUIC requires at least 1200-byte datagrams: {t:?}");
                let largest = t.mtu.max(t.mtu_ceiling) as u64;
                assert!(t.initial_window >= 4 * largest, "{t:?}");
                assert!(largest <= 65507, "past IPv4's largest UDP payload: {t:?}");
            }
        }
    }
}
