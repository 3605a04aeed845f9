//! Hostile peers on the QUIC transport (127.0.0.1 only): a second peer claiming a rank, a member without the
//! pinned certificate on either end of a ring link, replayed frames, garbage datagrams and failed handshakes
//! at every port. Each is refused, the job's result is unchanged (or, for a member corrupting its own ring
//! link, the collective fails naming it), and each refusal is logged once per address. These live inside
//! the library (`cargo test --lib collective::quic::hostile_tests`) because the rogue member they need
//! ([`super::test_support::Rogue`]) and the raw writes onto a ring link are not public API.

use std::io::Write;
use std::net::{SocketAddr, UdpSocket};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use super::test_support::Rogue;
use super::{Control, Hello, QuicCollective, QuicConfig};
use crate::collective::frame::{encode_msg, Header};
use crate::collective::ring::{Msg, Payload};
use crate::collective::{Collective, CollectiveError};

const JOB: u64 = 0xfeed;
const SECRET: &[u8] = b"hostile test secret";

fn input(r: usize, i: usize, len: usize) -> Vec<f32> {
    (0..len)
        .map(|k| (((k * 31 + r * 17 + i * 7) % 23) as f32) - 11.0)
        .collect()
}

/// The exact sum of `input` over `world` ranks (small integers: every order gives the same bits).
fn exact_sum(world: usize, i: usize, len: usize) -> Vec<f32> {
    (0..len)
        .map(|k| (0..world).map(|r| input(r, i, len)[k]).sum())
        .collect()
}

fn cfg(rank: usize, world: usize, master: SocketAddr) -> QuicConfig {
    let mut c = QuicConfig::new(rank, world, master);
    c.job_id = JOB;
    c.config_hash = 77;
    c.sub_chunk = 50;
    c.timeout = Duration::from_secs(10);
    c.rendezvous_timeout = Duration::from_secs(10);
    c.idle_timeout = Duration::from_secs(3);
    c.secret = Some(SECRET.to_vec());
    c
}

fn bound() -> (UdpSocket, SocketAddr) {
    let s = UdpSocket::bind("127.0.0.1:0").unwrap();
    let a = s.local_addr().unwrap();
    (s, a)
}

fn rogue() -> Rogue {
    Rogue::new(bound().0, SECRET).unwrap()
}

/// Every warning the transport logs in this test binary (all tests share it; each looks for its own
/// peers' addresses, which are unique ephemeral ports).
fn logs() -> &'static Mutex<Vec<u8>> {
    static LOGS: OnceLock<Arc<Mutex<Vec<u8>>>> = OnceLock::new();
    LOGS.get_or_init(|| {
        let buf = Arc::new(Mutex::new(Vec::new()));
        let sink = buf.clone();
        let subscriber = tracing_subscriber::fmt()
            .with_max_level(tracing::Level::WARN)
            .with_ansi(false)
            .with_writer(move || LogSink(sink.clone()))
            .finish();
        tracing::subscriber::set_global_default(subscriber).expect("no other subscriber in this binary");
        buf
    })
}

struct LogSink(Arc<Mutex<Vec<u8>>>);

impl Write for LogSink {
    fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(b);
        Ok(b.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// The refusal lines logged about `addr` so far.
fn refusals_of(addr: SocketAddr) -> Vec<String> {
    let text = String::from_utf8_lossy(&logs().lock().unwrap()).into_owned();
    let needle = format!("refused a connection from {addr}");
    text.lines()
        .filter(|l| l.contains(&needle))
        .map(str::to_string)
        .collect()
}

/// Waits (up to 5 s) until `addr` has been refused `n` times in the log; returns those lines.
fn wait_for_refusals(addr: SocketAddr, n: usize) -> Vec<String> {
    let t0 = Instant::now();
    while refusals_of(addr).len() < n && t0.elapsed() < Duration::from_secs(5) {
        std::thread::sleep(Duration::from_millis(20));
    }
    // A little longer, so that a second (flooding) line would show up too.
    std::thread::sleep(Duration::from_millis(300));
    refusals_of(addr)
}

fn refused_reason(answer: Result<Control, String>) -> String {
    match answer {
        Ok(Control::Refused { reason }) => reason,
        other => panic!("expected a refusal, got {other:?}"),
    }
}

fn sum_once(c: &mut QuicCollective, i: usize) -> Result<Vec<f32>, CollectiveError> {
    c.set_step(i as u64);
    let mut b = input(c.rank(), i, 997);
    c.all_reduce_sum(&mut b)?;
    Ok(b)
}

/// A second peer (holding the secret) claims rank 1, which is already taken: at rendezvous, and after setup
/// both to rank 0 and as rank 2's left neighbour. Each claim is refused naming the rank, each rank logs the
/// rogue's address once however often it tries, and the job's sums are exact.
#[test]
fn a_second_claim_on_a_taken_rank_is_refused() {
    logs();
    let world = 3;
    let (sock0, master) = bound();
    let (sock2, addr2) = bound();
    let rogue = rogue();
    let wait = Duration::from_secs(5);
    let hello = |rank| {
        Control::Hello(Hello {
            version: crate::collective::frame::PROTOCOL_VERSION,
            job_id: JOB,
            rank,
            world,
            config_hash: 77,
            advertise: None,
            local: None,
            host: None,
            collective: "flat".into(),
        })
    };
    let sums: Vec<Vec<Vec<f32>>> = std::thread::scope(|s| {
        let run = |c: &mut QuicCollective| (0..2).map(|i| sum_once(c, i).unwrap()).collect::<Vec<_>>();
        let rogue = &rogue;
        let c0 = cfg(0, world, master);
        let h0 = s.spawn(move || run(&mut QuicCollective::connect_with_socket(c0, sock0).unwrap()));
        let c1 = cfg(1, world, master);
        let h1 = s.spawn(move || run(&mut QuicCollective::connect(c1).unwrap()));
        // Rank 1 has joined by now; rank 2 has not, so the rendezvous is still open.
        std::thread::sleep(Duration::from_millis(1000));
        for _ in 0..2 {
            let reason = refused_reason(rogue.say(master, JOB, &hello(1), wait));
            assert!(reason.contains("rank 1 has already joined"), "{reason}");
        }
        let c2 = cfg(2, world, master);
        let (formed, ring_formed) = std::sync::mpsc::channel();
        let (claimed, claims_done) = std::sync::mpsc::channel::<()>();
        let h2 = s.spawn(move || {
            let mut q = QuicCollective::connect_with_socket(c2, sock2).unwrap();
            let first = sum_once(&mut q, 0).unwrap();
            // After setup (a collective has run, so every rank's ring is formed): the claims come now.
            formed.send(()).unwrap();
            // Bounded, so that a failed assertion below ends the test instead of hanging it.
            let _ = claims_done.recv_timeout(Duration::from_secs(20));
            vec![first, sum_once(&mut q, 1).unwrap()]
        });
        ring_formed.recv().unwrap();
        for _ in 0..2 {
            let reason = refused_reason(rogue.say(master, JOB, &hello(1), wait));
            assert!(reason.contains("rank 1 has already joined"), "{reason}");
            let peer = Control::PeerHello {
                job_id: JOB,
                rank: 1,
                shm: false,
            };
            let reason = refused_reason(rogue.say(addr2, JOB, &peer, wait));
            assert!(reason.contains("rank 1"), "{reason}");
        }
        claimed.send(()).unwrap();
        [h0, h1, h2].map(|h| h.join().unwrap()).to_vec()
    });
    for (r, s) in sums.iter().enumerate() {
        for (i, got) in s.iter().enumerate() {
            assert_eq!(got, &exact_sum(world, i, 997), "rank {r} collective {i}");
        }
    }
    // Rank 0 refused it four times and rank 2 twice, on separate connections: each logs it once.
    let lines = wait_for_refusals(rogue.local_addr(), 2);
    assert_eq!(lines.len(), 2, "{lines:#?}");
}

/// A member with the secret but not rank 1's certificate calls rank 2 as its left neighbour, before rank 1
/// does: rank 2 refuses it (naming the rank and the certificate), logs it once, and takes the real rank 1.
#[test]
fn a_ring_link_from_another_certificate_is_refused_and_the_real_neighbour_gets_in() {
    logs();
    let world = 3;
    let (sock0, master) = bound();
    let (sock2, addr2) = bound();
    let rogue = rogue();
    let sums: Vec<Vec<f32>> = std::thread::scope(|s| {
        let run = |c: &mut QuicCollective| sum_once(c, 0).unwrap();
        let c0 = cfg(0, world, master);
        let h0 = s.spawn(move || run(&mut QuicCollective::connect_with_socket(c0, sock0).unwrap()));
        let c2 = cfg(2, world, master);
        let h2 = s.spawn(move || run(&mut QuicCollective::connect_with_socket(c2, sock2).unwrap()));
        // Rank 2 takes peer hellos only once the ring is known, so the rogue's two wait in its queue ahead
        // of rank 1's, which can only come after rank 1 has joined.
        let rogue = &rogue;
        let claims: Vec<_> = (0..2)
            .map(|_| {
                s.spawn(move || {
                    let peer = Control::PeerHello {
                        job_id: JOB,
                        rank: 1,
                        shm: false,
                    };
                    rogue.say(addr2, JOB, &peer, Duration::from_secs(8))
                })
            })
            .collect();
        std::thread::sleep(Duration::from_millis(800));
        let c1 = cfg(1, world, master);
        let h1 = s.spawn(move || run(&mut QuicCollective::connect(c1).unwrap()));
        for c in claims {
            let reason = refused_reason(c.join().unwrap());
            assert!(
                reason.contains("certificate other than the one rank 1 presented at rendezvous"),
                "{reason}"
            );
        }
        [h0, h1, h2].map(|h| h.join().unwrap()).to_vec()
    });
    for s in &sums {
        assert_eq!(s, &exact_sum(world, 0, 997));
    }
    let lines = wait_for_refusals(rogue.local_addr(), 1);
    assert_eq!(lines.len(), 1, "{lines:#?}");
    assert!(lines[0].contains("rank 1"), "{lines:#?}");
}

/// A member joins as rank 2, then another certificate answers at the address it joined from (as if another
/// endpoint had taken the port over): rank 1, dialling its right neighbour there, refuses the link and says
/// why, rather than sending rank 2's data to it.
#[test]
fn a_right_neighbour_answering_with_another_certificate_is_refused() {
    logs();
    let world = 3;
    let (sock0, master) = bound();
    let (sock_r, rogue_addr) = bound();
    let mut rogue = Rogue::new(sock_r, SECRET).unwrap();
    let (e0, e1) = std::thread::scope(|s| {
        let mut c0 = cfg(0, world, master);
        // Rank 0 waits for rank 2's ring link, which never comes; the rogue leaving ends that wait.
        c0.rendezvous_timeout = Duration::from_secs(8);
        let h0 = s.spawn(move || QuicCollective::connect_with_socket(c0, sock0).err());
        let c1 = cfg(1, world, master);
        let h1 = s.spawn(move || QuicCollective::connect(c1).err());
        // Rank 0 sees the rogue's client certificate at rendezvous; rank 1 meets its new server certificate.
        rogue.present_another_certificate().unwrap();
        let ring = rogue.join(&cfg(2, world, master)).unwrap();
        assert_eq!(
            ring[2], rogue_addr,
            "rank 0 hands out the address the rogue joined from"
        );
        let e1 = h1.join().unwrap();
        drop(rogue);
        (h0.join().unwrap(), e1)
    });
    let e1 = e1.expect("rank 1 must refuse the link").to_string();
    assert!(e1.contains("right neighbour rank 2"), "{e1}");
    assert!(
        e1.contains("certificate other than the one rank 2 presented at rendezvous"),
        "{e1}"
    );
    // Rank 1 tells rank 0 why its ring could not form, so rank 0 fails with that cause rather than a
    // closed link or its rendezvous deadline.
    let e0 = e0.expect("rank 0 cannot form the ring either");
    assert_eq!(e0.peer(), Some(1), "{e0}");
    assert!(
        e0.to_string()
            .contains("certificate other than the one rank 2 presented"),
        "{e0}"
    );
    let lines = wait_for_refusals(rogue_addr, 1);
    assert_eq!(lines.len(), 1, "{lines:#?}");
}

/// Rank 1 (holding the secret) writes onto its ring link a data frame tagged as one of collective #0 after
/// that collective is over: rank 2 refuses it as a protocol error naming rank 1, and no rank's collective
/// #1 completes with it in the sum.
#[test]
fn a_frame_replayed_from_an_earlier_collective_is_refused() {
    let e = replay_on_ring(|len| {
        let m = Msg {
            phase: 0,
            chunk: 0,
            sub: 0,
            payload: Payload::F32(input(1, 0, len)),
        };
        encode_msg(JOB, 0, 0, &m)
    });
    assert!(e.contains("collective #0 while running #1"), "{e}");
}

/// As above, with a frame of another job (same step and collective number as the current one).
#[test]
fn a_frame_from_another_job_is_refused() {
    let e = replay_on_ring(|len| {
        let m = Msg {
            phase: 0,
            chunk: 0,
            sub: 0,
            payload: Payload::F32(input(1, 1, len)),
        };
        encode_msg(0xbad, 1, 1, &m)
    });
    assert!(e.contains("frame for job 0xbad, this job is 0xfeed"), "{e}");
}

/// Runs collective #0, has rank 1 write `frame(sub_chunk)` to rank 2, runs collective #1 and returns rank
/// 2's error after checking that it blames rank 1, that no rank completes #1, and that every sum a rank
/// did complete is exact. (A rank still finishing #0 when rank 2's abort arrives fails #0 instead.)
fn replay_on_ring(frame: impl Fn(usize) -> Vec<u8> + Sync) -> String {
    let world = 3;
    let (sock0, master) = bound();
    let t0 = Instant::now();
    // Per rank, the outcome of each collective it ran, stopping at the first failure.
    let outcomes: Vec<Vec<Result<Vec<f32>, CollectiveError>>> = std::thread::scope(|s| {
        let hs: Vec<_> = (0..world)
            .map(|r| {
                let c = cfg(r, world, master);
                let sock = (r == 0).then(|| sock0.try_clone().unwrap());
                let frame = &frame;
                s.spawn(move || {
                    let sub_chunk = c.sub_chunk;
                    let mut q = match sock {
                        Some(sock) => QuicCollective::connect_with_socket(c, sock).unwrap(),
                        None => QuicCollective::connect(c).unwrap(),
                    };
                    let first = sum_once(&mut q, 0);
                    if first.is_err() {
                        return vec![first];
                    }
                    if q.rank() == 1 {
                        let bytes = frame(sub_chunk);
                        // The header really is a data frame's (the guard, not the decoder, must refuse it).
                        Header::decode(&bytes, usize::MAX).unwrap();
                        q.send_raw_to_right(&bytes).unwrap();
                    }
                    vec![first, sum_once(&mut q, 1)]
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    drop(sock0);
    assert!(t0.elapsed() < Duration::from_secs(8), "took {:?}", t0.elapsed());
    for (r, outs) in outcomes.iter().enumerate() {
        for (i, out) in outs.iter().enumerate() {
            if let Ok(sum) = out {
                assert_eq!(sum, &exact_sum(world, i, 997), "rank {r} collective #{i}");
            }
        }
        assert!(outs.last().is_some_and(|o| o.is_err()), "rank {r} must fail: {outs:?}");
    }
    // Rank 2 finished #0 before the frame was written, and found it in #1.
    assert_eq!(outcomes[2].len(), 2);
    match &outcomes[2][1] {
        Err(CollectiveError::Protocol { rank: 1, msg }) => msg.clone(),
        other => panic!("rank 2 must name rank 1 as breaking the protocol: {other:?}"),
    }
}

/// Datagrams of every shape quinn might meet (random bytes, QUIC Initial and short-header packets with
/// random contents, unknown versions), handshakes that fail (a TLS client that trusts nothing, a member
/// with another secret) at rank 0's master port and every rank's endpoint while the job runs: every sum
/// keeps the bits of a run without them, and each sender whose garbage got as far as a handshake is logged
/// once per rank, however many times it tried.
#[test]
fn garbage_at_every_port_leaves_the_result_unchanged() {
    logs();
    let world = 3;
    let clean = run_job(world, |_| {});
    let stranger = bound().0;
    let stranger_addr = stranger.local_addr().unwrap();
    let wrong_secret = Rogue::new(bound().0, b"another secret").unwrap();
    let datagrams_from = bound().0;
    let noisy = run_job(world, |ports| {
        garbage_datagrams(&datagrams_from, ports, 600);
        failed_handshakes(&stranger, ports);
        for &p in ports {
            for _ in 0..2 {
                let hello = Control::PeerHello {
                    job_id: JOB,
                    rank: 1,
                    shm: false,
                };
                let e = wrong_secret.say(p, JOB, &hello, Duration::from_secs(3)).unwrap_err();
                assert!(e.contains("authentication"), "{e}");
            }
        }
        garbage_datagrams(&datagrams_from, ports, 600);
    });
    assert_eq!(noisy.len(), clean.len());
    for (i, (a, b)) in clean.iter().zip(&noisy).enumerate() {
        let bits = |v: &Vec<f32>| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(a), bits(b), "collective {i}");
    }
    // Two failed handshakes and two failed authentications per port, and hundreds of Initial-shaped
    // datagrams, for each of which quinn 0.11 starts a handshake that fails when the packet does not
    // decrypt: one line per rank for each sender.
    for addr in [
        stranger_addr,
        wrong_secret.local_addr(),
        datagrams_from.local_addr().unwrap(),
    ] {
        let lines = wait_for_refusals(addr, world);
        assert_eq!(lines.len(), world, "{addr}: {lines:#?}");
    }
}

/// Runs a world of `world` ranks that sum in a loop while `hostile` runs against their ports (rank 0's
/// master port first), until it is done; returns rank 0's sums, after checking that all ranks agree.
fn run_job(world: usize, hostile: impl FnOnce(&[SocketAddr])) -> Vec<Vec<f32>> {
    let (sock0, master) = bound();
    let socks: Vec<UdpSocket> = (1..world).map(|_| bound().0).collect();
    let mut ports = vec![master];
    ports.extend(socks.iter().map(|s| s.local_addr().unwrap()));
    let done = AtomicBool::new(false);
    const ROUNDS: usize = 6;
    let res: Vec<Vec<Vec<f32>>> = std::thread::scope(|s| {
        let done = &done;
        let hs: Vec<_> = std::iter::once(sock0)
            .chain(socks)
            .enumerate()
            .map(|(r, sock)| {
                let c = cfg(r, world, master);
                s.spawn(move || {
                    let mut q = QuicCollective::connect_with_socket(c, sock).unwrap();
                    let mut sums = Vec::new();
                    // At least ROUNDS collectives, and on until the hostile side is done; rank 0 decides
                    // for everyone through the collective itself, so all ranks run the same number.
                    for i in 0.. {
                        sums.push(sum_once(&mut q, i % ROUNDS).unwrap());
                        let mut stop = [(q.rank() == 0 && i + 1 >= ROUNDS && done.load(Ordering::SeqCst)) as u8 as f64];
                        q.all_reduce_scalars(&mut stop).unwrap();
                        if stop[0] > 0.0 {
                            break;
                        }
                    }
                    sums
                })
            })
            .collect();
        hostile(&ports);
        done.store(true, Ordering::SeqCst);
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for r in 1..world {
        assert_eq!(res[r], res[0], "rank {r} disagrees with rank 0");
    }
    // Compare by round: the hostile run may run more collectives than the clean one.
    res[0].iter().take(ROUNDS).cloned().collect()
}

/// `n` datagrams to each port, cycling through the shapes described at the test.
fn garbage_datagrams(from: &UdpSocket, ports: &[SocketAddr], n: usize) {
    let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
    let mut next = move || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x
    };
    for k in 0..n {
        for &p in ports {
            let len = 1 + (next() % 1400) as usize;
            let mut d: Vec<u8> = (0..len.max(1200)).map(|_| next() as u8).collect();
            match k % 4 {
                // Random bytes, any length.
                0 => d.truncate(len),
                // A QUIC v1 Initial header (random connection ids) over random, unauthenticatable contents.
                1 => {
                    d[0] = 0xc3;
                    d[1..5].copy_from_slice(&1u32.to_be_bytes());
                    d[5] = 8;
                    d[14] = 8;
                    d[23] = 0;
                    d[24..26].copy_from_slice(&(0x4000u16 | 1100).to_be_bytes());
                }
                // A short-header packet for a connection nobody has.
                2 => d[0] = 0x40 | (d[0] & 0x3f),
                // A long header with an unknown version (quinn answers with version negotiation).
                _ => {
                    d[0] |= 0x80;
                    d[1..5].copy_from_slice(&0x1a2a_3a4au32.to_be_bytes());
                    d[5] = 8;
                    d[14] = 8;
                }
            }
            let _ = from.send_to(&d, p);
        }
    }
}

/// Two QUIC handshakes per port from `sock` by a client that trusts no certificate and has none to show:
/// quinn starts each (they are well-formed), and each fails.
fn failed_handshakes(sock: &UdpSocket, ports: &[SocketAddr]) {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        // Trusts one certificate of its own making, which no rank presents.
        let mut roots = rustls::RootCertStore::empty();
        let own = rcgen::generate_simple_self_signed(vec!["elsewhere".to_string()]).unwrap();
        roots.add(own.cert.der().clone()).unwrap();
        let roots = Arc::new(roots);
        let client = quinn::ClientConfig::with_root_certificates(roots).unwrap();
        let mut ep = quinn::Endpoint::client("127.0.0.1:0".parse().unwrap()).unwrap();
        ep.rebind(sock.try_clone().unwrap()).unwrap();
        ep.set_default_client_config(client);
        for &p in ports {
            for _ in 0..2 {
                let attempt = ep.connect(p, "ringtrain").unwrap();
                let r = tokio::time::timeout(Duration::from_secs(3), attempt).await;
                assert!(matches!(r, Ok(Err(_))), "the handshake must fail");
            }
        }
        ep.close(0u32.into(), b"");
    });
}
