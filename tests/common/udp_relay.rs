//! A UDP relay that puts a lossy, slow, reordering network between processes on loopback (for kernels
//! without `netem`).
//!
//! For each target endpoint `E_r` the relay opens a front socket `P_r`. A datagram that source `S` sends to
//! `P_r` leaves for `E_r` from a back socket `Q_{r,S}` of its own, opened the first time `S` is seen, so
//! that `E_r` answers to `Q_{r,S}`, and the relay sends that answer out of `P_r` to `S`. `S` therefore only
//! ever talks to `P_r`, and `E_r` sees one distinct peer per source. Every datagram in either direction is
//! dropped with probability `loss`, otherwise delivered after `delay` plus a uniform extra in
//! `0..jitter`, so datagrams sent closer together than `jitter` may arrive out of order.
//!
//! Each direction of each (front, source) pair draws its decisions from its own generator, seeded from the
//! relay's seed, the front, the order in which sources first appeared and the direction: the same seed and
//! the same datagrams give the same losses and delays.
//!
//! Threads: one per front socket, one per back socket and one delivery thread that sends each datagram when
//! it is due. Sockets poll with a short read timeout, so dropping the relay stops and joins them all.

use std::collections::{BinaryHeap, HashMap};
use std::io;
use std::net::{SocketAddr, UdpSocket};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// How often a blocked socket or the delivery thread looks at the stop flag.
const POLL: Duration = Duration::from_millis(20);
/// Larger than any UDP payload.
const MAX_DATAGRAM: usize = 65_536;
/// Socket buffers asked for, so that bursts wait in the relay's queues rather than overflow the kernel's.
const SOCKET_BUFFER: usize = 4 << 20;

/// What the relay does to every datagram, in each direction.
#[derive(Clone, Copy, Debug)]
pub struct LinkFaults {
    /// Probability that a datagram is dropped.
    pub loss: f64,
    /// Delay every delivered datagram gets.
    pub delay: Duration,
    /// Upper bound of the uniform extra delay on top of `delay` (which reorders datagrams).
    pub jitter: Duration,
    pub seed: u64,
}

impl LinkFaults {
    /// A poor wide-area path: 2% loss, 20 ms one way, up to 10 ms of jitter.
    pub fn wan(seed: u64) -> Self {
        LinkFaults {
            loss: 0.02,
            delay: Duration::from_millis(20),
            jitter: Duration::from_millis(10),
            seed,
        }
    }
}

/// Counters over every direction of the relay, and the first thing that went wrong inside it.
#[derive(Default)]
struct Counters {
    forwarded: AtomicU64,
    dropped: AtomicU64,
    failure: Mutex<Option<String>>,
}

/// A running relay; dropping it stops every thread.
pub struct UdpRelay {
    fronts: Vec<SocketAddr>,
    stop: Arc<AtomicBool>,
    counters: Arc<Counters>,
    delivery: Arc<DelayLine>,
    threads: Arc<Mutex<Vec<JoinHandle<()>>>>,
}

impl UdpRelay {
    /// Starts a relay with one front socket (on loopback) for each of `targets`.
    pub fn start(targets: &[SocketAddr], faults: LinkFaults) -> io::Result<Self> {
        let stop = Arc::new(AtomicBool::new(false));
        let counters = Arc::new(Counters::default());
        let delivery = Arc::new(DelayLine::default());
        let threads = Arc::new(Mutex::new(Vec::new()));
        let relay_threads = threads.clone();
        let mut fronts = Vec::with_capacity(targets.len());
        let delivery_thread = {
            let (delivery, stop) = (delivery.clone(), stop.clone());
            std::thread::Builder::new()
                .name("relay-delivery".into())
                .spawn(move || delivery.run(&stop))?
        };
        threads.lock().unwrap().push(delivery_thread);
        for (index, &target) in targets.iter().enumerate() {
            let front = Arc::new(bind_loopback(target)?);
            fronts.push(front.local_addr()?);
            let ctx = FrontCtx {
                index,
                target,
                front,
                faults,
                stop: stop.clone(),
                counters: counters.clone(),
                delivery: delivery.clone(),
                threads: relay_threads.clone(),
            };
            let handle = std::thread::Builder::new()
                .name(format!("relay-front-{index}"))
                .spawn(move || ctx.run())?;
            threads.lock().unwrap().push(handle);
        }
        Ok(UdpRelay {
            fronts,
            stop,
            counters,
            delivery,
            threads,
        })
    }

    /// The address to send to in order to reach `targets[index]` through the relay.
    pub fn front(&self, index: usize) -> SocketAddr {
        self.fronts[index]
    }

    /// Datagrams delivered or queued for delivery so far, both directions.
    pub fn forwarded(&self) -> u64 {
        self.counters.forwarded.load(Ordering::Relaxed)
    }

    /// Datagrams dropped on purpose so far, both directions.
    pub fn dropped(&self) -> u64 {
        self.counters.dropped.load(Ordering::Relaxed)
    }

    /// Whether the relay has worked as asked so far (a source it could not open a back socket for has
    /// had its datagrams discarded, and that is an error of the relay, not of what it carries).
    pub fn health(&self) -> Result<(), String> {
        match &*self.counters.failure.lock().unwrap() {
            Some(e) => Err(e.clone()),
            None => Ok(()),
        }
    }
}

impl Drop for UdpRelay {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        self.delivery.wake.notify_all();
        // Front threads may still add back threads until they have stopped, so drain until none is left.
        loop {
            let handles: Vec<_> = std::mem::take(&mut *self.threads.lock().unwrap());
            if handles.is_empty() {
                break;
            }
            for h in handles {
                let _ = h.join();
            }
        }
    }
}

/// A loopback socket of `like`'s family, with large buffers and a short read timeout.
fn bind_loopback(like: SocketAddr) -> io::Result<UdpSocket> {
    let any_port: SocketAddr = if like.is_ipv4() { "127.0.0.1:0" } else { "[::1]:0" }.parse().unwrap();
    let socket = UdpSocket::bind(any_port)?;
    socket.set_read_timeout(Some(POLL))?;
    if let Ok(state) = quinn::udp::UdpSocketState::new((&socket).into()) {
        // Best effort: the kernel caps them at rmem_max / wmem_max.
        let _ = state.set_recv_buffer_size((&socket).into(), SOCKET_BUFFER);
        let _ = state.set_send_buffer_size((&socket).into(), SOCKET_BUFFER);
    }
    Ok(socket)
}

/// True for errors that only mean "nothing arrived within the read timeout".
fn timed_out(e: &io::Error) -> bool {
    matches!(e.kind(), io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut)
}

/// One front socket `P_r`: forwards what sources send to the target through one back socket per source.
struct FrontCtx {
    index: usize,
    target: SocketAddr,
    front: Arc<UdpSocket>,
    faults: LinkFaults,
    stop: Arc<AtomicBool>,
    counters: Arc<Counters>,
    delivery: Arc<DelayLine>,
    threads: Arc<Mutex<Vec<JoinHandle<()>>>>,
}

impl FrontCtx {
    fn run(self) {
        // Per source: its back socket and the generator of the source → target direction.
        let mut backs: HashMap<SocketAddr, (Arc<UdpSocket>, Faults)> = HashMap::new();
        let mut buf = vec![0u8; MAX_DATAGRAM];
        while !self.stop.load(Ordering::SeqCst) {
            let (len, source) = match self.front.recv_from(&mut buf) {
                Ok(got) => got,
                Err(e) if timed_out(&e) => continue,
                // Loopback reports an earlier send's ICMP "port unreachable" here; the socket is still fine.
                Err(_) => continue,
            };
            if !backs.contains_key(&source) {
                match self.open_back(source, backs.len()) {
                    Ok(entry) => {
                        backs.insert(source, entry);
                    }
                    Err(e) => {
                        let mut failure = self.counters.failure.lock().unwrap();
                        failure.get_or_insert(format!("relay front {}: cannot open a back socket: {e}", self.index));
                        continue;
                    }
                }
            }
            let (back, faults) = backs.get_mut(&source).expect("inserted above");
            if let Some(due) = faults.decide(&self.counters) {
                self.delivery.push(due, back.clone(), self.target, buf[..len].to_vec());
            }
        }
    }

    /// Opens `Q_{r,source}` and starts the thread that relays the target's answers back to `source`.
    /// Returns the socket and the generator of the source → target direction.
    fn open_back(&self, source: SocketAddr, ordinal: usize) -> io::Result<(Arc<UdpSocket>, Faults)> {
        let back = Arc::new(bind_loopback(self.target)?);
        let link = (self.index as u64) << 32 | (ordinal as u64) << 1;
        let answers = BackCtx {
            back: back.clone(),
            front: self.front.clone(),
            target: self.target,
            source,
            faults: Faults::new(self.faults, link | 1),
            stop: self.stop.clone(),
            counters: self.counters.clone(),
            delivery: self.delivery.clone(),
        };
        let handle = std::thread::Builder::new()
            .name(format!("relay-back-{}-{ordinal}", self.index))
            .spawn(move || answers.run())?;
        self.threads.lock().unwrap().push(handle);
        Ok((back, Faults::new(self.faults, link)))
    }
}

/// One back socket `Q_{r,S}`: relays what the target answers out of the front socket to source `S`.
struct BackCtx {
    back: Arc<UdpSocket>,
    front: Arc<UdpSocket>,
    target: SocketAddr,
    source: SocketAddr,
    faults: Faults,
    stop: Arc<AtomicBool>,
    counters: Arc<Counters>,
    delivery: Arc<DelayLine>,
}

impl BackCtx {
    fn run(mut self) {
        let mut buf = vec![0u8; MAX_DATAGRAM];
        while !self.stop.load(Ordering::SeqCst) {
            let (len, from) = match self.back.recv_from(&mut buf) {
                Ok(got) => got,
                Err(e) if timed_out(&e) => continue,
                Err(_) => continue,
            };
            // Only the target knows this socket; anything else is not part of the link.
            if from != self.target {
                continue;
            }
            if let Some(due) = self.faults.decide(&self.counters) {
                self.delivery
                    .push(due, self.front.clone(), self.source, buf[..len].to_vec());
            }
        }
    }
}

/// The loss and delay decisions of one direction: a seeded splitmix64 generator.
struct Faults {
    cfg: LinkFaults,
    state: u64,
}

impl Faults {
    fn new(cfg: LinkFaults, link: u64) -> Self {
        let mut f = Faults {
            cfg,
            state: cfg.seed ^ link.wrapping_mul(0x9e37_79b9_7f4a_7c15),
        };
        f.next_u64();
        f
    }

    fn next_u64(&mut self) -> u64 {
        self.state = self.state.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.state;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in [0, 1).
    fn unit(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }

    /// When the next datagram of this direction is due, or `None` when it is dropped.
    fn decide(&mut self, counters: &Counters) -> Option<Instant> {
        if self.unit() < self.cfg.loss {
            counters.dropped.fetch_add(1, Ordering::Relaxed);
            return None;
        }
        counters.forwarded.fetch_add(1, Ordering::Relaxed);
        let extra = self.cfg.jitter.mul_f64(self.unit());
        Some(Instant::now() + self.cfg.delay + extra)
    }
}

/// A datagram waiting for its delivery time.
struct Pending {
    due: Instant,
    /// Arrival order, so that datagrams due at the same instant leave in the order they came.
    order: u64,
    from: Arc<UdpSocket>,
    to: SocketAddr,
    data: Vec<u8>,
}

impl PartialEq for Pending {
    fn eq(&self, other: &Self) -> bool {
        (self.due, self.order) == (other.due, other.order)
    }
}
impl Eq for Pending {}
impl PartialOrd for Pending {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}
impl Ord for Pending {
    /// Reversed, so that the max-heap pops the earliest datagram first.
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        (other.due, other.order).cmp(&(self.due, self.order))
    }
}

/// Datagrams in flight, sent by one thread when due.
#[derive(Default)]
struct DelayLine {
    queue: Mutex<(BinaryHeap<Pending>, u64)>,
    wake: Condvar,
}

impl DelayLine {
    fn push(&self, due: Instant, from: Arc<UdpSocket>, to: SocketAddr, data: Vec<u8>) {
        let mut q = self.queue.lock().unwrap();
        let order = q.1;
        q.1 += 1;
        q.0.push(Pending {
            due,
            order,
            from,
            to,
            data,
        });
        self.wake.notify_one();
    }

    /// Sends every datagram when it is due, until `stop` is set; what is still queued then is dropped.
    fn run(&self, stop: &AtomicBool) {
        let mut q = self.queue.lock().unwrap();
        while !stop.load(Ordering::SeqCst) {
            let now = Instant::now();
            match q.0.peek().map(|p| p.due) {
                Some(due) if due <= now => {
                    let p = q.0.pop().expect("peeked");
                    drop(q);
                    // A full or refused destination loses the datagram, as a real network would.
                    let _ = p.from.send_to(&p.data, p.to);
                    q = self.queue.lock().unwrap();
                }
                next => {
                    let wait = next.map_or(POLL, |due| (due - now).min(POLL));
                    q = self.wake.wait_timeout(q, wait).unwrap().0;
                }
            }
        }
    }
}
