//! How fast a 2-rank ring all-reduce (mean) of 64 MiB of f32 over QUIC could be if each rank drove
//! `quinn-proto` itself on one thread: received datagrams go to quinn-proto without a copy (recvfrom into a
//! shared buffer's unused capacity, split per datagram), and there is no async runtime.
//!
//! A measuring prototype, not a transport: two threads in one process on loopback, one uni stream per
//! direction carrying raw f32 (no frame headers, no authentication exchange, no failure handling), and the
//! same work per byte as ringtrain's engine (phase-0 copy, one-pass sum/divide/store, all-gather store).
//! It checks the result and exits non-zero if any element is wrong.
//!
//!     cargo run --release -- ITERS        (prints ms per all-reduce and busbw)
use bytes::{Bytes, BytesMut};
use quinn_proto as qp;
use std::collections::{HashMap, VecDeque};
use std::net::{SocketAddr, UdpSocket};
use std::sync::Arc;
use std::time::{Duration, Instant};

#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

const FLOATS: usize = 16 << 20; // 64 MiB
const HALF: usize = FLOATS / 2;
const SUB_BYTES: usize = 256 << 10;
const SLOT: usize = 65536;

#[derive(Debug)]
struct AnyCert(Arc<rustls::crypto::CryptoProvider>);
impl rustls::client::danger::ServerCertVerifier for AnyCert {
    fn verify_server_cert(
        &self,
        _: &rustls::pki_types::CertificateDer<'_>,
        _: &[rustls::pki_types::CertificateDer<'_>],
        _: &rustls::pki_types::ServerName<'_>,
        _: &[u8],
        _: rustls::pki_types::UnixTime,
    ) -> Result<rustls::client::danger::ServerCertVerified, rustls::Error> {
        Ok(rustls::client::danger::ServerCertVerified::assertion())
    }
    fn verify_tls12_signature(
        &self,
        m: &[u8],
        c: &rustls::pki_types::CertificateDer<'_>,
        d: &rustls::DigitallySignedStruct,
    ) -> Result<rustls::client::danger::HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls12_signature(m, c, d, &self.0.signature_verification_algorithms)
    }
    fn verify_tls13_signature(
        &self,
        m: &[u8],
        c: &rustls::pki_types::CertificateDer<'_>,
        d: &rustls::DigitallySignedStruct,
    ) -> Result<rustls::client::danger::HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(m, c, d, &self.0.signature_verification_algorithms)
    }
    fn supported_verify_schemes(&self) -> Vec<rustls::SignatureScheme> {
        self.0.signature_verification_algorithms.supported_schemes()
    }
}

fn configs(window: u32) -> (qp::EndpointConfig, qp::ServerConfig, qp::ClientConfig) {
    let provider = Arc::new(rustls::crypto::CryptoProvider {
        cipher_suites: vec![rustls::crypto::aws_lc_rs::cipher_suite::TLS13_AES_128_GCM_SHA256],
        ..rustls::crypto::aws_lc_rs::default_provider()
    });
    let cert = rcgen::generate_simple_self_signed(vec!["x".to_string()]).unwrap();
    let cert_der = rustls::pki_types::CertificateDer::from(cert.cert.der().to_vec());
    let key_der = rustls::pki_types::PrivateKeyDer::Pkcs8(cert.key_pair.serialize_der().into());
    let mut tc = qp::TransportConfig::default();
    let mut d = qp::MtuDiscoveryConfig::default();
    d.upper_bound(65000);
    let mut cubic = qp::congestion::CubicConfig::default();
    cubic.initial_window(1 << 20);
    tc.stream_receive_window(qp::VarInt::from_u32(window))
        .receive_window(qp::VarInt::from_u32(window))
        .send_window(64 << 20)
        .initial_mtu(16000)
        .min_mtu(16000)
        .mtu_discovery_config(Some(d))
        .enable_segmentation_offload(false)
        .congestion_controller_factory(Arc::new(cubic));
    let tc = Arc::new(tc);
    let mut s = rustls::ServerConfig::builder_with_provider(provider.clone())
        .with_protocol_versions(&[&rustls::version::TLS13])
        .unwrap()
        .with_no_client_auth()
        .with_single_cert(vec![cert_der], key_der)
        .unwrap();
    s.alpn_protocols = vec![b"p".to_vec()];
    let mut server =
        qp::ServerConfig::with_crypto(Arc::new(qp::crypto::rustls::QuicServerConfig::try_from(s).unwrap()));
    server.transport_config(tc.clone());
    let mut c = rustls::ClientConfig::builder_with_provider(provider.clone())
        .with_protocol_versions(&[&rustls::version::TLS13])
        .unwrap()
        .dangerous()
        .with_custom_certificate_verifier(Arc::new(AnyCert(provider)))
        .with_no_client_auth();
    c.alpn_protocols = vec![b"p".to_vec()];
    let mut client = qp::ClientConfig::new(Arc::new(qp::crypto::rustls::QuicClientConfig::try_from(c).unwrap()));
    client.transport_config(tc);
    let mut ep = qp::EndpointConfig::default();
    ep.max_udp_payload_size(65000).unwrap();
    (ep, server, client)
}

struct Side {
    rank: usize,
    sock: UdpSocket,
    st: quinn_udp::UdpSocketState,
    ep: qp::Endpoint,
    conns: HashMap<qp::ConnectionHandle, qp::Connection>,
    right: Option<qp::ConnectionHandle>,
    left: Option<qp::ConnectionHandle>,
    send_sid: Option<qp::StreamId>,
    recv_sid: Option<qp::StreamId>,
    arena: BytesMut,
    tx: Vec<u8>,
    // Ring state for the current all-reduce.
    own: Vec<f32>,
    queue: VecDeque<Bytes>,
    ag: VecDeque<Bytes>,
    next_copy: usize, // phase-0 bytes copied so far
    received: usize,  // bytes of this all-reduce received so far
    carry: Vec<u8>,
    out: Vec<u8>,
    sent: usize,
}

impl Side {
    fn send_raw(&self, dest: SocketAddr, data: &[u8]) {
        let t = quinn_udp::Transmit {
            destination: dest,
            ecn: None,
            contents: data,
            segment_size: None,
            src_ip: None,
        };
        loop {
            match self.st.send((&self.sock).into(), &t) {
                Ok(()) => return,
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                    wait_fd(&self.sock, libc::POLLOUT, 10);
                }
                Err(e) => panic!("send: {e}"),
            }
        }
    }

    /// Receives one datagram straight into the arena's unused capacity: the kernel writes the bytes and only
    /// those are marked initialised, so nothing is zeroed or copied in user space. The arena is split per
    /// datagram; quinn-proto keeps the pieces it needs, and the allocation is freed when they are dropped.
    fn recv_one(&mut self) -> std::io::Result<(BytesMut, SocketAddr)> {
        use std::os::fd::AsRawFd;
        if self.arena.capacity() - self.arena.len() < SLOT {
            self.arena = BytesMut::with_capacity(64 * SLOT);
        }
        let spare = self.arena.spare_capacity_mut();
        // SAFETY: all-zero bytes are a valid sockaddr_storage.
        let mut addr: libc::sockaddr_storage = unsafe { std::mem::zeroed() };
        let mut addr_len = std::mem::size_of::<libc::sockaddr_storage>() as libc::socklen_t;
        // SAFETY: the buffer pointer and length describe the arena's spare capacity, which the kernel may
        // write; the address buffer is a sockaddr_storage with its size.
        let n = unsafe {
            libc::recvfrom(
                self.sock.as_raw_fd(),
                spare.as_mut_ptr().cast(),
                SLOT,
                0,
                (&mut addr as *mut libc::sockaddr_storage).cast(),
                &mut addr_len,
            )
        };
        if n < 0 {
            return Err(std::io::Error::last_os_error());
        }
        // SAFETY: the kernel initialised the first `n` bytes of the spare capacity.
        unsafe { self.arena.set_len(n as usize) };
        let from = match addr.ss_family as i32 {
            libc::AF_INET => {
                // SAFETY: the family says this is a sockaddr_in.
                let a = unsafe { *(&addr as *const libc::sockaddr_storage).cast::<libc::sockaddr_in>() };
                SocketAddr::from((u32::from_be(a.sin_addr.s_addr).to_be_bytes(), u16::from_be(a.sin_port)))
            }
            f => panic!("unexpected address family {f}"),
        };
        Ok((self.arena.split(), from))
    }

    fn recv_all(&mut self, now: Instant) -> bool {
        let mut any = false;
        let mut resp = Vec::new();
        loop {
            let (d, from) = match self.recv_one() {
                Ok(x) => x,
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => return any,
                Err(e) => panic!("recv: {e}"),
            };
            any = true;
            match self.ep.handle(now, from, None, None, d, &mut resp) {
                Some(qp::DatagramEvent::ConnectionEvent(ch, ev)) => {
                    if let Some(c) = self.conns.get_mut(&ch) {
                        c.handle_event(ev)
                    }
                }
                Some(qp::DatagramEvent::NewConnection(inc)) => {
                    let mut b = Vec::new();
                    let (ch, c) = self.ep.accept(inc, now, &mut b, None).expect("accept");
                    self.conns.insert(ch, c);
                    self.left = Some(ch);
                }
                Some(qp::DatagramEvent::Response(t)) => {
                    let d = resp[..t.size].to_vec();
                    self.send_raw(t.destination, &d);
                }
                None => {}
            }
            resp.clear();
        }
    }

    fn service(&mut self, now: Instant) -> Option<Instant> {
        let mut next: Option<Instant> = None;
        let handles: Vec<_> = self.conns.keys().copied().collect();
        for ch in handles {
            let c = self.conns.get_mut(&ch).unwrap();
            if c.poll_timeout().is_some_and(|t| t <= now) {
                c.handle_timeout(now);
            }
            while let Some(ev) = c.poll_endpoint_events() {
                if let Some(cev) = self.ep.handle_event(ch, ev) {
                    c.handle_event(cev);
                }
            }
            while let Some(ev) = c.poll() {
                match ev {
                    qp::Event::Connected if Some(ch) == self.right => {
                        self.send_sid = c.streams().open(qp::Dir::Uni);
                    }
                    qp::Event::Stream(qp::StreamEvent::Opened { dir: qp::Dir::Uni }) => {
                        self.recv_sid = c.streams().accept(qp::Dir::Uni);
                    }
                    qp::Event::ConnectionLost { reason } => panic!("rank {} lost: {reason}", self.rank),
                    _ => {}
                }
            }
            loop {
                self.tx.clear();
                match c.poll_transmit(now, 1, &mut self.tx) {
                    Some(t) => {
                        let tr = quinn_udp::Transmit {
                            destination: t.destination,
                            ecn: None,
                            contents: &self.tx[..t.size],
                            segment_size: None,
                            src_ip: None,
                        };
                        loop {
                            match self.st.send((&self.sock).into(), &tr) {
                                Ok(()) => break,
                                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                                    wait_fd(&self.sock, libc::POLLOUT, 10)
                                }
                                Err(e) => panic!("send: {e}"),
                            }
                        }
                    }
                    None => break,
                }
            }
            if let Some(t) = c.poll_timeout() {
                next = Some(next.map_or(t, |n: Instant| n.min(t)));
            }
        }
        next
    }

    /// Moves application data: phase-0 copies and sends, received bytes summed or stored. Returns progress.
    fn app(&mut self) -> bool {
        let mut progress = false;
        let send_chunk = 1 - self.rank;
        // Send side.
        if let (Some(r), Some(sid)) = (self.right, self.send_sid) {
            let c = self.conns.get_mut(&r).unwrap();
            loop {
                if self.queue.is_empty() && self.next_copy == HALF * 4 {
                    if let Some(b) = self.ag.pop_front() {
                        self.queue.push_back(b);
                    }
                }
                if self.queue.is_empty() && self.next_copy < HALF * 4 {
                    let start = send_chunk * HALF + self.next_copy / 4;
                    let n = (SUB_BYTES / 4).min(HALF - self.next_copy / 4);
                    let src = &self.own[start..start + n];
                    // SAFETY: f32 has no padding; reading its bytes is fine (little-endian host).
                    let v: Vec<u8> = unsafe { std::slice::from_raw_parts(src.as_ptr() as *const u8, n * 4) }.to_vec();
                    self.next_copy += n * 4;
                    self.queue.push_back(Bytes::from(v));
                }
                let Some(front) = self.queue.front_mut() else { break };
                let mut one = [std::mem::take(front)];
                match c.send_stream(sid).write_chunks(&mut one) {
                    Ok(w) => {
                        self.sent += w.bytes;
                        progress |= w.bytes > 0;
                        if one[0].is_empty() {
                            self.queue.pop_front();
                        } else {
                            *self.queue.front_mut().unwrap() = std::mem::take(&mut one[0]);
                            break;
                        }
                    }
                    Err(qp::WriteError::Blocked) => {
                        *self.queue.front_mut().unwrap() = std::mem::take(&mut one[0]);
                        break;
                    }
                    Err(e) => panic!("write: {e}"),
                }
            }
        }
        // Receive side.
        if let (Some(l), Some(sid)) = (self.left, self.recv_sid) {
            let c = self.conns.get_mut(&l).unwrap();
            let mut rs = c.recv_stream(sid);
            let mut chunks = match rs.read(true) {
                Ok(ch) => ch,
                Err(_) => return progress,
            };
            let total = FLOATS * 4;
            while self.received < total {
                let chunk = match chunks.next(total - self.received) {
                    Ok(Some(ch)) => ch,
                    _ => break,
                };
                progress = true;
                let mut bytes: &[u8] = &chunk.bytes;
                // Carry a value split between pieces.
                let carried = self.carry.len();
                let mut joined = Vec::new();
                if carried > 0 {
                    joined.extend_from_slice(&self.carry);
                    joined.extend_from_slice(bytes);
                    self.carry.clear();
                    bytes = &joined;
                }
                let whole = bytes.len() / 4 * 4;
                let base_val = (self.received - carried) / 4;
                let vals = &bytes[..whole];
                // Split the run at the phase boundary and process each part with tight loops.
                let nvals = whole / 4;
                let split = HALF.saturating_sub(base_val).min(nvals);
                let (p0, p1) = vals.split_at(split * 4);
                if !p0.is_empty() {
                    let own = &mut self.own[self.rank * HALF + base_val..self.rank * HALF + base_val + split];
                    let start = self.out.len();
                    self.out.resize(start + p0.len(), 0);
                    let out = &mut self.out[start..];
                    for ((o, c), d) in out.chunks_exact_mut(4).zip(p0.chunks_exact(4)).zip(own.iter_mut()) {
                        let v = (f32::from_le_bytes([c[0], c[1], c[2], c[3]]) + *d) / 2.0;
                        *d = v;
                        o.copy_from_slice(&v.to_le_bytes());
                    }
                    while self.out.len() >= SUB_BYTES {
                        let rest = self.out.split_off(SUB_BYTES);
                        self.ag.push_back(Bytes::from(std::mem::replace(&mut self.out, rest)));
                    }
                    if base_val + split == HALF && !self.out.is_empty() {
                        self.ag.push_back(Bytes::from(std::mem::take(&mut self.out)));
                    }
                }
                if !p1.is_empty() {
                    let at = send_chunk * HALF + base_val + split - HALF;
                    let dst = &mut self.own[at..at + p1.len() / 4];
                    for (d, c) in dst.iter_mut().zip(p1.chunks_exact(4)) {
                        *d = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
                    }
                }
                self.carry.extend_from_slice(&bytes[whole..]);
                self.received += chunk.bytes.len();
            }
            let _ = chunks.finalize();
        }
        progress
    }
}

fn wait_fd(s: &UdpSocket, events: i16, ms: i32) {
    use std::os::fd::AsRawFd;
    let mut p = libc::pollfd {
        fd: s.as_raw_fd(),
        events,
        revents: 0,
    };
    // SAFETY: one valid pollfd.
    unsafe { libc::poll(&mut p, 1, ms) };
}

fn main() {
    let iters: usize = std::env::args().nth(1).and_then(|a| a.parse().ok()).unwrap_or(10);
    let socks: Vec<UdpSocket> = (0..2).map(|_| UdpSocket::bind("127.0.0.1:0").unwrap()).collect();
    let addrs: Vec<SocketAddr> = socks.iter().map(|s| s.local_addr().unwrap()).collect();
    let done = Arc::new([
        std::sync::atomic::AtomicUsize::new(0),
        std::sync::atomic::AtomicUsize::new(0),
    ]);
    let hs: Vec<_> = socks
        .into_iter()
        .enumerate()
        .map(|(rank, sock)| {
            let addrs = addrs.clone();
            let done = done.clone();
            std::thread::spawn(move || {
                sock.set_nonblocking(true).unwrap();
                let st = quinn_udp::UdpSocketState::new((&sock).into()).unwrap();
                // `recv_one` reads one datagram per call and no control messages: turn off the receive
                // coalescing quinn-udp enables.
                {
                    use std::os::fd::AsRawFd;
                    let off: libc::c_int = 0;
                    // SAFETY: a valid socket and an int option value with its size.
                    unsafe {
                        libc::setsockopt(
                            sock.as_raw_fd(),
                            libc::SOL_UDP,
                            libc::UDP_GRO,
                            (&off as *const libc::c_int).cast(),
                            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
                        )
                    };
                }
                let _ = st.set_recv_buffer_size((&sock).into(), 4 << 20);
                let _ = st.set_send_buffer_size((&sock).into(), 4 << 20);
                let granted = st.recv_buffer_size((&sock).into()).unwrap();
                let window = (granted / 4 * 3).clamp(128 << 10, 16 << 20) as u32;
                let (epc, server, client) = configs(window);
                let mut ep = qp::Endpoint::new(Arc::new(epc), Some(Arc::new(server)), true, None);
                let now = Instant::now();
                let (ch, c) = ep.connect(now, client, addrs[1 - rank], "x").unwrap();
                let mut conns = HashMap::new();
                conns.insert(ch, c);
                let own: Vec<f32> = (0..FLOATS).map(|i| (i % 7 + rank) as f32).collect();
                let mut s = Side {
                    rank,
                    sock,
                    st,
                    ep,
                    conns,
                    right: Some(ch),
                    left: None,
                    send_sid: None,
                    recv_sid: None,
                    arena: BytesMut::new(),
                    tx: Vec::with_capacity(65536),
                    own,
                    queue: VecDeque::new(),
                    ag: VecDeque::new(),
                    next_copy: 0,
                    received: 0,
                    carry: Vec::new(),
                    out: Vec::new(),
                    sent: 0,
                };
                let mut times = Vec::new();
                use std::sync::atomic::Ordering::SeqCst;
                let mut t0 = Instant::now();
                let mut it = 0;
                let mut my_done = false;
                loop {
                    let now = Instant::now();
                    let a = s.recv_all(now);
                    let b = s.app();
                    let next = s.service(now);
                    if !my_done
                        && s.received == FLOATS * 4
                        && s.sent == FLOATS * 4
                        && s.queue.is_empty()
                        && s.ag.is_empty()
                    {
                        my_done = true;
                        done[rank].fetch_add(1, SeqCst);
                    }
                    // The next all-reduce starts once both ranks finished this one (like back-to-back calls).
                    if my_done && done[1 - rank].load(SeqCst) > it {
                        let dt = t0.elapsed();
                        if it >= 2 {
                            times.push(dt);
                        }
                        it += 1;
                        if it == iters + 2 {
                            break;
                        }
                        t0 = Instant::now();
                        s.next_copy = 0;
                        s.received = 0;
                        s.sent = 0;
                        my_done = false;
                        continue;
                    }
                    if !a && !b {
                        let ms = next.map_or(1, |t| {
                            t.saturating_duration_since(Instant::now()).as_millis().min(1) as i32
                        });
                        if std::env::var_os("SPIN").is_none() {
                            wait_fd(&s.sock, libc::POLLIN, ms);
                        }
                    }
                }
                // Keep serving the peer until it is done too.
                let until = Instant::now() + Duration::from_secs(2);
                while Instant::now() < until {
                    let now = Instant::now();
                    s.recv_all(now);
                    s.service(now);
                    wait_fd(&s.sock, libc::POLLIN, 1);
                }
                let mean = times.iter().sum::<Duration>() / times.len() as u32;
                // Ranks hold i % 7 + rank, so every mean is i % 7 + 0.5, exactly.
                let bad = s
                    .own
                    .iter()
                    .enumerate()
                    .filter(|(i, &x)| x != (i % 7) as f32 + 0.5)
                    .count();
                (rank, mean, bad)
            })
        })
        .collect();
    let mut wrong = 0;
    for h in hs {
        let (rank, mean, bad) = h.join().unwrap();
        let bytes = (FLOATS * 4) as f64;
        println!(
            "rank {rank}: {:.1} ms per all-reduce, busbw {:.3} GB/s, {bad} wrong elements",
            mean.as_secs_f64() * 1e3,
            bytes / mean.as_secs_f64() / 1e9
        );
        wrong += bad;
    }
    if wrong > 0 {
        std::process::exit(1);
    }
}
