//! Training across a lossy, slow network: a 3-rank QUIC job whose every datagram crosses a UDP relay that
//! drops 2% of them and delays the rest by 20-30 ms (reordering them) ends with parameters bit-identical to
//! the same job over the in-memory ring, and the slowdown is printed. The relay itself is checked first:
//! loss, delay, reordering and both directions as configured.
//!
//! Release timings: `cargo test --release --test lossy_link -- --nocapture`.

mod common;

use std::net::{SocketAddr, UdpSocket};
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};

use common::udp_relay::{LinkFaults, UdpRelay};
use ringtrain::backend::factory::{self, BackendChoice};
use ringtrain::backend::Backend;
use ringtrain::collective::mem::{mem_cluster, MemOptions};
use ringtrain::collective::Collective;
use ringtrain::data::{load_splits, TokenizerKind};
use ringtrain::dist::{join_on, AdvertiseAddr, JoinOptions, LaunchEnv, LaunchSource, NetworkEnv};
use ringtrain::fault_plan::FaultPlan;
use ringtrain::metrics::StepMetrics;
use ringtrain::model::ModelConfig;
use ringtrain::trainer::{ModelSource, RunObserver, TrainOptions, Trainer, UpdateMode};

const WORLD: usize = 3;

/// Held by each test for its whole run: both measure time, so neither runs beside the other.
static ALONE: Mutex<()> = Mutex::new(());

fn alone() -> MutexGuard<'static, ()> {
    // A test that failed while holding it leaves it poisoned; the next one may still run.
    ALONE.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// Per-step losses and parameter fingerprints of one rank.
#[derive(Debug, PartialEq)]
struct RankRun {
    losses: Vec<f64>,
    hashes: Vec<String>,
}

/// A job's runs, by rank, and how long it took: all of it (setup and goodbye included), and its steps
/// alone on rank 0.
struct Job {
    runs: Vec<RankRun>,
    wall: Duration,
    steps_wall: Duration,
}

impl Job {
    fn of(ranks: Vec<(RankRun, Duration)>, wall: Duration) -> Job {
        let steps_wall = ranks[0].1;
        Job {
            runs: ranks.into_iter().map(|r| r.0).collect(),
            wall,
            steps_wall,
        }
    }
}

/// Trains `options.steps` steps of `model` on the CPU backend over `comm`; also returns how long the
/// steps took.
fn train_rank(comm: Box<dyn Collective>, model: &ModelConfig, options: &TrainOptions) -> (RankRun, Duration) {
    let rank = comm.rank();
    let (be, _) = factory::open(BackendChoice::Cpu, 0).unwrap();
    let data = load_splits("synthetic", None, TokenizerKind::Byte).unwrap();
    let source = ModelSource::Fresh(model.clone());
    let mut t: Trainer<Box<dyn Backend>> =
        Trainer::new(be, source, data, options.clone(), comm).unwrap_or_else(|e| panic!("rank {rank}: {e:#}"));
    let mut run = RankRun {
        losses: Vec::new(),
        hashes: Vec::new(),
    };
    let start = Instant::now();
    t.run(&mut run)
        .unwrap_or_else(|e| panic!("rank {rank}, step {}: {e:#}", t.step() + 1));
    (run, start.elapsed())
}

impl<B: Backend> RunObserver<B> for RankRun {
    fn step(&mut self, t: &mut Trainer<B>, m: &StepMetrics) -> anyhow::Result<()> {
        self.losses.push(m.loss);
        self.hashes.push(t.param_hash()?);
        Ok(())
    }
}

/// The job over the in-memory ring.
fn train_in_memory(model: &ModelConfig, options: &TrainOptions) -> Job {
    let start = Instant::now();
    let ranks = std::thread::scope(|s| {
        let handles: Vec<_> = mem_cluster(WORLD, MemOptions::default())
            .into_iter()
            .map(|comm| s.spawn(move || train_rank(Box::new(comm), model, options)))
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    Job::of(ranks, start.elapsed())
}

/// The job over QUIC with every datagram crossing `faults`' relay, and how long it took (rendezvous and
/// goodbye included). Every rank binds its endpoint first; the relay then opens a front for each, and the
/// ranks are told to dial the fronts: rank 0's is the master address, the others advertise theirs.
fn train_through_relay(model: &ModelConfig, options: &TrainOptions, faults: LinkFaults) -> Job {
    let sockets: Vec<UdpSocket> = (0..WORLD).map(|_| UdpSocket::bind("127.0.0.1:0").unwrap()).collect();
    let endpoints: Vec<SocketAddr> = sockets.iter().map(|s| s.local_addr().unwrap()).collect();
    let relay = UdpRelay::start(&endpoints, faults).unwrap();
    let start = Instant::now();
    let ranks = std::thread::scope(|s| {
        let handles: Vec<_> = sockets
            .into_iter()
            .enumerate()
            .map(|(rank, socket)| {
                let master = relay.front(0);
                let launch = LaunchEnv {
                    rank,
                    world_size: WORLD,
                    local_rank: rank,
                    local_world_size: WORLD,
                    master_addr: master.ip().to_string(),
                    master_port: master.port(),
                    source: LaunchSource::Flags,
                };
                let opts = JoinOptions {
                    config_hash: options.job_hash(model, WORLD),
                    secret: Some(b"lossy link test".to_vec()),
                    timeout: Duration::from_secs(60),
                    faults: FaultPlan::default(),
                    // The relay or the addresses under test are QUIC's; shared memory would bypass them.
                    transport: ringtrain::collective::shm::LinkTransport::Quic,
                    collective: Default::default(),
                    epoch: 0,
                    elastic: false,
                };
                // Each rank advertises its own front of the relay, whose port differs from the one it binds.
                let front = relay.front(rank);
                let network = NetworkEnv {
                    bind_ip: None,
                    advertise: (rank > 0).then(|| AdvertiseAddr {
                        host: front.ip().to_string(),
                        port: Some(front.port()),
                    }),
                    host_id: None,
                    ..Default::default()
                };
                s.spawn(move || {
                    let comm = join_on(&launch, &opts, &network, socket)
                        .unwrap_or_else(|e| panic!("rank {rank}: joining through the relay: {e:#}"));
                    train_rank(comm, model, options)
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let wall = start.elapsed();
    relay.health().unwrap();
    // Traffic really crossed the relay, and some of it was lost on the way.
    assert!(relay.forwarded() > 100, "{} datagrams forwarded", relay.forwarded());
    assert!(relay.dropped() > 0, "the relay dropped nothing");
    eprintln!(
        "  relay: {} datagrams forwarded, {} dropped",
        relay.forwarded(),
        relay.dropped()
    );
    Job::of(ranks, wall)
}

fn options(model: &ModelConfig, update: UpdateMode) -> TrainOptions {
    TrainOptions {
        batch_size: 2,
        seq_len: 32,
        update,
        eval_every: 0,
        // Several buckets, so that every step runs several collectives.
        bucket_elems: 20_000,
        ..TrainOptions::for_model(model).with_steps(3)
    }
}

#[test]
fn training_across_a_lossy_delaying_link_matches_the_in_memory_run() {
    let _alone = alone();
    let model = ModelConfig::tiny();
    for (seed, update) in [(1, UpdateMode::Sharded), (2, UpdateMode::Replicated)] {
        let opts = options(&model, update);
        let mem = train_in_memory(&model, &opts);
        let quic = train_through_relay(&model, &opts, LinkFaults::wan(seed));
        let what = update.as_str();
        assert_eq!(mem.runs[0].hashes.len(), 3, "{what}");
        for (rank, run) in quic.runs.iter().enumerate() {
            assert_eq!(
                run, &mem.runs[rank],
                "{what}: rank {rank} over the relay differs from the in-memory run"
            );
        }
        let ratio = |a: Duration, b: Duration| a.as_secs_f64() / b.as_secs_f64();
        eprintln!(
            "{what}: {WORLD} ranks, {} steps: in memory {:.2?} (steps {:.2?}), QUIC through the relay {:.2?} \
             (steps {:.2?}): {:.1}x overall, {:.1}x per step",
            opts.steps,
            mem.wall,
            mem.steps_wall,
            quic.wall,
            quic.steps_wall,
            ratio(quic.wall, mem.wall),
            ratio(quic.steps_wall, mem.steps_wall)
        );
    }
}

/// What the far end of the relay saw of the numbered datagrams sent to it.
struct Arrivals {
    /// Datagram numbers in arrival order.
    order: Vec<u32>,
    /// One-way delay of each, in arrival order.
    delays: Vec<Duration>,
}

#[test]
fn the_relay_loses_delays_and_reorders_as_configured() {
    let _alone = alone();
    const SENT: u32 = 2000;
    let faults = LinkFaults::wan(7);
    let target = UdpSocket::bind("127.0.0.1:0").unwrap();
    let source = UdpSocket::bind("127.0.0.1:0").unwrap();
    for s in [&target, &source] {
        s.set_read_timeout(Some(Duration::from_millis(500))).unwrap();
    }
    let relay = UdpRelay::start(&[target.local_addr().unwrap()], faults).unwrap();
    let front = relay.front(0);
    let epoch = Instant::now();
    let (arrivals, echoes) = std::thread::scope(|s| {
        // The target answers every datagram to whoever relayed it, which sends it back to the source.
        let far_end = s.spawn(|| {
            let mut seen = Arrivals {
                order: Vec::new(),
                delays: Vec::new(),
            };
            let mut buf = [0u8; 64];
            while let Ok((len, from)) = target.recv_from(&mut buf) {
                assert_eq!(len, 12);
                let sent_at = Duration::from_nanos(u64::from_le_bytes(buf[4..12].try_into().unwrap()));
                seen.delays.push(epoch.elapsed() - sent_at);
                seen.order.push(u32::from_le_bytes(buf[..4].try_into().unwrap()));
                target.send_to(&buf[..len], from).unwrap();
            }
            seen
        });
        let near_end = s.spawn(|| {
            let mut echoes = 0u32;
            let mut buf = [0u8; 64];
            while let Ok((_, from)) = source.recv_from(&mut buf) {
                assert_eq!(from, front, "answers come back from the front socket");
                echoes += 1;
            }
            echoes
        });
        // Two datagrams per millisecond: closer together than the jitter, so some must swap places.
        for i in 0..SENT {
            let mut datagram = [0u8; 12];
            datagram[..4].copy_from_slice(&i.to_le_bytes());
            datagram[4..].copy_from_slice(&(epoch.elapsed().as_nanos() as u64).to_le_bytes());
            source.send_to(&datagram, front).unwrap();
            if i % 2 == 1 {
                std::thread::sleep(Duration::from_millis(1));
            }
        }
        (far_end.join().unwrap(), near_end.join().unwrap())
    });
    relay.health().unwrap();

    let arrived = arrivals.order.len() as u32;
    let mut unique = arrivals.order.clone();
    unique.sort_unstable();
    unique.dedup();
    assert_eq!(unique.len() as u32, arrived, "a datagram arrived twice");
    assert!(unique.iter().all(|&i| i < SENT));
    // 2% of 2000 is 40 (standard deviation 6.3) in each direction.
    let lost = SENT - arrived;
    assert!((20..=70).contains(&lost), "{lost} of {SENT} lost on the way out");
    let lost_back = arrived - echoes;
    assert!(
        (15..=70).contains(&lost_back),
        "{lost_back} of {arrived} lost on the way back"
    );
    assert_eq!(
        relay.dropped(),
        u64::from(SENT - echoes),
        "only the relay lost datagrams"
    );

    let mut delays = arrivals.delays.clone();
    delays.sort_unstable();
    let ms = |d: Duration| d.as_secs_f64() * 1e3;
    let (min, median, p95) = (
        ms(delays[0]),
        ms(delays[delays.len() / 2]),
        ms(delays[delays.len() * 95 / 100]),
    );
    assert!(min >= 20.0, "delay {min:.1} ms below the configured 20 ms");
    // 20 ms plus a uniform 0-10 ms: median 25, 95th percentile 29.5, plus scheduling (generous: CI hosts are
    // busy). The spread is the jitter's.
    assert!((22.0..=40.0).contains(&median), "median delay {median:.1} ms");
    assert!(p95 <= 100.0, "95th percentile delay {p95:.1} ms");
    assert!(p95 - min >= 6.0, "delays spread over only {:.1} ms", p95 - min);
    let overtaken = arrivals.order.windows(2).filter(|w| w[1] < w[0]).count();
    assert!(overtaken > 50, "only {overtaken} datagrams overtaken");
    eprintln!(
        "relay self-test: lost {lost} + {lost_back} of {SENT}, delay min {min:.1} / median {median:.1} / p95 {p95:.1} \
         ms, {overtaken} reorderings"
    );

    // Dropping the relay stops it promptly, and nothing crosses it afterwards.
    let stopping = Instant::now();
    drop(relay);
    assert!(stopping.elapsed() < Duration::from_secs(2), "{:?}", stopping.elapsed());
    source.send_to(&[0u8; 12], front).unwrap();
    let mut buf = [0u8; 64];
    assert!(
        target.recv_from(&mut buf).is_err(),
        "a datagram crossed a stopped relay"
    );
}
