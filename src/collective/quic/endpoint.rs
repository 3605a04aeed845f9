//! This rank's UDP socket and quinn endpoint: which address to bind, the TLS configuration (one cipher suite,
//! a fresh self-signed certificate presented as server and as client certificate), and the transport tuning per link type (datagram size, MTU discovery,
//! congestion and flow-control windows, socket buffers).

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, UdpSocket};
use std::sync::Arc;
use std::time::Duration;

use quinn::Endpoint;
use rustls::crypto::CryptoProvider;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};

use super::auth::{fingerprint, ExporterBound, Fingerprint};
#[cfg(unix)]
use super::coalesce::CoalescingSocket;
use super::{local, QuicConfig};
use crate::collective::{ComputeBusy, Result};

const ALPN: &[u8] = b"ringtrain/1";
/// The name every certificate is issued for and every connection asks for (names prove nothing here: a
/// certificate is pinned by its fingerprint, see `auth`).
pub(super) const SERVER_NAME: &str = "ringtrain";

/// Binds this rank's UDP socket, unless one is given: rank 0 binds the master port, the others an ephemeral
/// one (on [`bind_addr`]'s address). A non-loopback address without a cluster secret is refused. Rank 0
/// bound to port 0 learns its master port here, and an advertised address without a port gets the bound one.
pub(super) fn bind_socket(cfg: &mut QuicConfig, socket: Option<UdpSocket>) -> Result<UdpSocket> {
    let bind = bind_addr(cfg);
    let master = cfg.master;
    let no_secret_refusal = |addr: SocketAddr| {
        // Name what the user gave (the master address), not only the wildcard this rank would listen on.
        let what = if addr == master {
            format!("refusing to listen on the master address {master} without a cluster secret")
        } else {
            format!("refusing to join the job at {master} without a cluster secret: this rank would listen on {addr}")
        };
        local(format!(
            "{what}, which is not a loopback address, so anyone who can reach it could join; set RINGTRAIN_SECRET \
             or --secret-file"
        ))
    };
    if cfg.secret.is_none() && socket.is_none() && !bind.ip().is_loopback() {
        return Err(no_secret_refusal(bind));
    }
    let socket = match socket {
        Some(s) => s,
        None => bind_now_or_soon(bind, cfg.re_forming())?,
    };
    let bind = socket.local_addr().map_err(|e| local(format!("socket address: {e}")))?;
    if cfg.rank == 0 && cfg.master.port() == 0 {
        cfg.master.set_port(bind.port());
    }
    if let Some(a) = cfg.advertise_addr.as_mut().filter(|a| a.port() == 0) {
        a.set_port(bind.port());
    }
    if cfg.secret.is_none() && !bind.ip().is_loopback() {
        return Err(no_secret_refusal(bind));
    }
    Ok(socket)
}

/// How long an elastic re-form retries binding its address while the last ring's endpoint, just dropped,
/// still holds it (rank 0 at the master address, a rank with a listen port at that port).
const REBIND_FOR: Duration = Duration::from_secs(5);

/// Binds `addr`; in a re-form (`retry`), again every 50 ms while it is in use, for up to [`REBIND_FOR`].
fn bind_now_or_soon(addr: SocketAddr, retry: bool) -> Result<UdpSocket> {
    let until = std::time::Instant::now() + REBIND_FOR;
    loop {
        match UdpSocket::bind(addr) {
            Ok(socket) => return Ok(socket),
            Err(e) if retry && e.kind() == std::io::ErrorKind::AddrInUse && std::time::Instant::now() < until => {
                std::thread::sleep(Duration::from_millis(50));
            }
            Err(e) => return Err(local(format!("cannot bind {addr}: {e}"))),
        }
    }
}

/// The address this rank binds when it is not given a socket (see [`QuicConfig::bind_ip`] and
/// [`QuicConfig::listen_port`]).
fn bind_addr(cfg: &QuicConfig) -> SocketAddr {
    if cfg.rank == 0 {
        return SocketAddr::new(cfg.bind_ip.unwrap_or(cfg.master.ip()), cfg.master.port());
    }
    let ip = cfg.bind_ip.unwrap_or(match cfg.master.ip() {
        ip if ip.is_loopback() => ip,
        IpAddr::V4(_) => IpAddr::V4(Ipv4Addr::UNSPECIFIED),
        IpAddr::V6(_) => IpAddr::V6(Ipv6Addr::UNSPECIFIED),
    });
    SocketAddr::new(ip, cfg.listen_port.unwrap_or(0))
}

/// Transport tuning, chosen per link type and measured with `bench/allreduce/run.sh` (see BENCHMARKS.md).
///
/// On loopback, datagrams start at 16000 bytes (8000 on macOS; no 1200-byte start) and MTU discovery
/// raises them to 65000 once the handshake is done; the congestion window starts at 1 MiB. Large datagrams
/// are what pays here: quinn's default 1452-byte datagrams cost a syscall, a packet header and a kernel
/// buffer per 1.4 KiB.
/// Three limits shape the numbers:
/// - a long-header (handshake) packet encodes its length in a 2-byte varint, so it must stay under 16384
///   bytes; only short-header packets, sent after the handshake, can be larger, hence the discovery step;
/// - quinn's default initial window (14720 bytes) is below two such datagrams, so the first flight would
///   wait on the congestion controller forever; the window has to grow with the datagram size;
/// - the ceiling stays below IPv4's largest UDP payload (65507 bytes), so discovery's probes are sendable.
///
/// Against the 32000 used before, in alternating runs, the 65000-byte ceiling lowered the top of the range of
/// CPU per 64 MiB all-reduce (the ranges overlap) and raised the median busbw (BENCHMARKS.md, "Transport
/// settings"): half the datagrams, so half the per-packet work in quinn and the kernel.
///
/// Segmentation offload stays off: it gave no gain at any datagram size we measured, and without a cap on
/// the batch (quinn offers none) batches over 64 KiB are refused by the kernel.
/// Other links keep quinn's defaults (1200-byte start, MTU discovery, GSO), which are safe on any path,
/// except two. MTU discovery may climb to [`DISCOVERY_CEILING`] instead of quinn's bound of 1452 bytes
/// (and each endpoint announces that much to its peer, whose discovery would stop at 1472), so a
/// cluster network with 9000-byte jumbo frames carries 4.5 times fewer datagrams per byte; on a 1500-byte
/// path the larger probes are lost (the kernel refuses them) and the search settles where it would have.
/// And the congestion controller: BBR, which paces at the bottleneck rate it measures, instead of Cubic,
/// which grows its window until the sending host's queue overflows. On two emulated hosts at 200 Mbit/s
/// with a 1000-frame queue Cubic lost 9-18 datagrams per run and BBR none, at 14% less goodput (175 against
/// 150 ms of communication per step); at 1 Gbit/s neither lost any and BBR was as fast (BENCHMARKS.md).
#[derive(Clone, Copy, Debug)]
struct Tuning {
    /// UDP payload size used from the first packet (0 = quinn's default with MTU discovery).
    mtu: u16,
    /// Upper bound for MTU discovery once the handshake is done (with `mtu` 0: quinn's start and discovery
    /// up to this bound; 0 = quinn's own bound).
    mtu_ceiling: u16,
    /// Initial congestion window in bytes (0 = quinn's default).
    initial_window: u64,
    gso: bool,
    /// Requested UDP socket buffer sizes (the kernel caps them at rmem_max / wmem_max).
    sock_buf: usize,
    /// Size the flow-control windows from the receive buffer the kernel granted ([`flow_window_for`])
    /// instead of the fixed 16 MiB stream / 64 MiB connection windows.
    window_from_socket: bool,
    /// BBR instead of quinn's default Cubic: it paces at the measured bottleneck rate instead of growing
    /// the window until a queue overflows.
    bbr: bool,
    /// While the rank computes, read a streaming socket this often rather than per datagram
    /// (`coalesce.rs`, unix only); `None` reads each datagram as it arrives.
    recv_coalesce: Option<Duration>,
}

/// First datagram size on loopback. macOS refuses UDP datagrams over `net.inet.udp.maxdgram` (9216 bytes
/// by default) and its loopback MTU is 16384, so it keeps the 8000 bytes used before; discovery may still
/// raise it where the system allows.
const LOOPBACK_START_MTU: u16 = if cfg!(target_os = "macos") { 8000 } else { 16000 };

/// MTU discovery's ceiling off loopback. QUIC pays for every datagram (a syscall share, a packet header, a
/// kernel buffer, quinn's packet assembly), so fewer, larger ones cost less: at 200 Mbit/s, 9000-byte frames
/// nearly halved what 2 emulated hosts added to a step (BENCHMARKS.md, "Overlapped gradient sync"), so jumbo
/// frames should be used where the path has them. Segmentation offload stays on there, and quinn hands the
/// kernel up to 10 datagrams per send, which it refuses past 64 KiB: so not a full jumbo payload (8952
/// bytes), but 6500, which keeps every batch sendable.
const DISCOVERY_CEILING: u16 = 6500;

/// Read interval of a streaming link while the rank computes, off loopback. Tokio's timers tick in
/// milliseconds, so this is the shortest pause there is; on a 200 Mbit/s link it gathers several
/// Ethernet-size datagrams per read (how many was not measured).
const RECV_COALESCE: Duration = Duration::from_millis(1);

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
                bbr: false,
                recv_coalesce: None,
            }
        } else {
            Tuning {
                mtu: 0,
                mtu_ceiling: DISCOVERY_CEILING,
                initial_window: 0,
                gso: true,
                sock_buf: 4 << 20,
                window_from_socket: false,
                bbr: true,
                recv_coalesce: Some(RECV_COALESCE),
            }
        }
    }
}

/// Flow-control window (per stream and per connection) for a link whose receive socket buffer is reported
/// as `reported_rcvbuf` bytes. A sender may have a whole window in flight; when that exceeds what the
/// receiving socket can queue while its rank is off the CPU, the kernel drops datagrams (per 10-iteration
/// 64 MiB run at N=2 here: 473-1039, 1-2%, with the 16 MiB window and 4 MiB buffers, 3298-3898 with
/// Linux's default 208 KiB `rmem_max`, none with this window: BENCHMARKS.md, "Transport settings"),
/// and every drop costs a retransmission and a congestion-window cut. The kernel charges each queued
/// datagram's full buffer size (payload plus a few percent of bookkeeping) against the limit it reports (on
/// Linux twice the size asked for), so three quarters of the reported size leaves room for the bookkeeping
/// and for the acknowledgements of the other direction. On loopback the round trip is tens of microseconds,
/// so a small window keeps the link busy: the one a 208 KiB `rmem_max` gives left busbw within noise of the
/// fixed 16 MiB window (same section).
fn flow_window_for(reported_rcvbuf: usize) -> u32 {
    (reported_rcvbuf / 4 * 3).clamp(128 << 10, 16 << 20) as u32
}

/// Starts the QUIC endpoint on `socket` (server and client side), tuned for loopback when the socket is
/// bound to a loopback address. Returns it with the fingerprint of the certificate it presents, as server
/// and as client alike.
/// `busy` is the rank's [`ComputeBusy`] flag, which the socket reads.
pub(super) fn start(
    socket: UdpSocket,
    idle: Duration,
    busy: &ComputeBusy,
) -> std::result::Result<(Endpoint, Fingerprint), String> {
    let loopback = socket.local_addr().map(|a| a.ip().is_loopback()).unwrap_or(false);
    make_endpoint(socket, idle, Tuning::for_link(loopback), busy)
}

/// A fresh self-signed certificate and its key: an endpoint's identity for its lifetime.
struct Identity {
    cert: CertificateDer<'static>,
    key: PrivateKeyDer<'static>,
}

impl Identity {
    fn fresh() -> std::result::Result<Self, String> {
        let cert = rcgen::generate_simple_self_signed(vec![SERVER_NAME.to_string()]).map_err(|e| e.to_string())?;
        Ok(Identity {
            cert: CertificateDer::from(cert.cert.der().to_vec()),
            key: PrivateKeyDer::Pkcs8(cert.signing_key.serialize_der().into()),
        })
    }

    fn fingerprint(&self) -> Fingerprint {
        fingerprint(&self.cert)
    }
}

// `busy` only reaches the batching socket, which needs unix.
#[cfg_attr(not(unix), allow(unused_variables))]
fn make_endpoint(
    socket: UdpSocket,
    idle: Duration,
    tuning: Tuning,
    busy: &ComputeBusy,
) -> std::result::Result<(Endpoint, Fingerprint), String> {
    let provider = crypto_provider();
    let id = Identity::fresh()?;
    let granted_rcvbuf = size_socket_buffers(&socket, tuning);
    let transport = Arc::new(transport_config(idle, tuning, granted_rcvbuf)?);
    let ep_cfg = endpoint_config(tuning)?;
    let server = server_config(provider.clone(), &id, transport.clone())?;
    let client = client_config(provider, &id, transport)?;

    let runtime = quinn::default_runtime().ok_or("no async runtime for quinn")?;
    let started = match tuning.recv_coalesce {
        #[cfg(unix)]
        Some(interval) => CoalescingSocket::new(socket, interval, busy.clone())
            .and_then(|socket| Endpoint::new_with_abstract_socket(ep_cfg, Some(server), Arc::new(socket), runtime)),
        _ => Endpoint::new(ep_cfg, Some(server), socket, runtime),
    };
    let mut ep = started.map_err(|e| format!("cannot start the QUIC endpoint: {e}"))?;
    ep.set_default_client_config(client);
    Ok((ep, id.fingerprint()))
}

/// Tests only: makes `ep` present a new certificate to the connections it accepts from now on, as an
/// endpoint that took over a rank's address would. Returns the new certificate's fingerprint.
#[cfg(test)]
pub(super) fn present_another_certificate(ep: &Endpoint, idle: Duration) -> std::result::Result<Fingerprint, String> {
    let id = Identity::fresh()?;
    let transport = Arc::new(transport_config(idle, Tuning::for_link(true), None)?);
    ep.set_server_config(Some(server_config(crypto_provider(), &id, transport)?));
    Ok(id.fingerprint())
}

/// AES-128-GCM only: QUIC's mandatory suite, with 10 AES rounds instead of AES-256's 14 (packet protection
/// was 12-19% of the samples in profiles of a 64 MiB all-reduce). aws-lc-rs rather than ring: its AES-GCM
/// took about 30% less of the busy time than ring's (BENCHMARKS.md, "Transport settings").
fn crypto_provider() -> Arc<CryptoProvider> {
    Arc::new(CryptoProvider {
        cipher_suites: vec![rustls::crypto::aws_lc_rs::cipher_suite::TLS13_AES_128_GCM_SHA256],
        ..rustls::crypto::aws_lc_rs::default_provider()
    })
}

/// Asks for `tuning.sock_buf` bytes of socket buffer in each direction; returns the receive buffer size the
/// kernel reports, if it could be read.
fn size_socket_buffers(socket: &UdpSocket, tuning: Tuning) -> Option<usize> {
    if tuning.sock_buf == 0 {
        return None;
    }
    let state = quinn::udp::UdpSocketState::new(socket.into()).ok()?;
    let _ = state.set_recv_buffer_size(socket.into(), tuning.sock_buf);
    let _ = state.set_send_buffer_size(socket.into(), tuning.sock_buf);
    state.recv_buffer_size(socket.into()).ok()
}

/// Keep-alives, flow-control windows, datagram sizes and the initial congestion window of every connection.
fn transport_config(
    idle: Duration,
    tuning: Tuning,
    granted_rcvbuf: Option<usize>,
) -> std::result::Result<quinn::TransportConfig, String> {
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
    } else if tuning.mtu_ceiling > 0 {
        let mut discovery = quinn::MtuDiscoveryConfig::default();
        discovery.upper_bound(tuning.mtu_ceiling);
        transport.mtu_discovery_config(Some(discovery));
    }
    if tuning.initial_window > 0 {
        let mut cubic = quinn::congestion::CubicConfig::default();
        cubic.initial_window(tuning.initial_window);
        transport.congestion_controller_factory(Arc::new(cubic));
    } else if tuning.bbr {
        transport.congestion_controller_factory(Arc::new(quinn::congestion::BbrConfig::default()));
    }
    Ok(transport)
}

fn endpoint_config(tuning: Tuning) -> std::result::Result<quinn::EndpointConfig, String> {
    let mut ep_cfg = quinn::EndpointConfig::default();
    if tuning.mtu > 0 || tuning.mtu_ceiling > 0 {
        // What this endpoint accepts, announced to the peer, whose discovery stops there (quinn's own
        // default is 1472 bytes, a 1500-byte Ethernet frame's IPv4 payload).
        ep_cfg
            .max_udp_payload_size(tuning.mtu.max(tuning.mtu_ceiling))
            .map_err(|e| e.to_string())?;
    }
    Ok(ep_cfg)
}

/// TLS 1.3 with this endpoint's certificate; the client must present one too (any, see [`ExporterBound`]),
/// so that the ring links can be pinned to it.
fn server_config(
    provider: Arc<CryptoProvider>,
    id: &Identity,
    transport: Arc<quinn::TransportConfig>,
) -> std::result::Result<quinn::ServerConfig, String> {
    let mut server_tls = rustls::ServerConfig::builder_with_provider(provider.clone())
        .with_protocol_versions(&[&rustls::version::TLS13])
        .map_err(|e| e.to_string())?
        .with_client_cert_verifier(Arc::new(ExporterBound(provider)))
        .with_single_cert(vec![id.cert.clone()], id.key.clone_key())
        .map_err(|e| e.to_string())?;
    server_tls.alpn_protocols = vec![ALPN.to_vec()];
    let server_crypto = quinn::crypto::rustls::QuicServerConfig::try_from(server_tls).map_err(|e| e.to_string())?;
    let mut server = quinn::ServerConfig::with_crypto(Arc::new(server_crypto));
    server.transport_config(transport);
    Ok(server)
}

/// TLS 1.3 accepting any server certificate ([`ExporterBound`]), presenting this endpoint's own.
fn client_config(
    provider: Arc<CryptoProvider>,
    id: &Identity,
    transport: Arc<quinn::TransportConfig>,
) -> std::result::Result<quinn::ClientConfig, String> {
    let mut client_tls = rustls::ClientConfig::builder_with_provider(provider.clone())
        .with_protocol_versions(&[&rustls::version::TLS13])
        .map_err(|e| e.to_string())?
        .dangerous()
        .with_custom_certificate_verifier(Arc::new(ExporterBound(provider)))
        .with_client_auth_cert(vec![id.cert.clone()], id.key.clone_key())
        .map_err(|e| e.to_string())?;
    client_tls.alpn_protocols = vec![ALPN.to_vec()];
    let client_crypto = quinn::crypto::rustls::QuicClientConfig::try_from(client_tls).map_err(|e| e.to_string())?;
    let mut client = quinn::ClientConfig::new(Arc::new(client_crypto));
    client.transport_config(transport);
    Ok(client)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Largest packet a QUIC long header can describe (its length field is a 2-byte varint).
    const MAX_LONG_HEADER_PACKET: u16 = (1 << 14) - 1;

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

    /// [`DISCOVERY_CEILING`]'s limits: quinn's `MAX_TRANSMIT_SEGMENTS` (10) datagrams of the largest
    /// discovered size must fit one UDP send, and the ceiling must lie above quinn's own (1452 bytes).
    #[test]
    fn segmentation_batches_fit_the_kernel_limit() {
        let t = Tuning::for_link(false);
        assert!(t.gso);
        assert!(10 * t.mtu_ceiling as usize <= 65507, "{t:?}");
        assert!(t.mtu_ceiling > 1452, "{t:?}");
    }

    /// The limits in [`Tuning`]'s comment: a handshake packet must fit a long header, and the first
    /// congestion window must hold several of the largest datagrams, or the first flight never leaves.
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
