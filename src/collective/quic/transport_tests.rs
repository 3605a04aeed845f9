//! The QUIC transport's own tests, below `dist::join` (which the binary, the sim and the integration tests
//! use): collectives on 127.0.0.1, authentication, rendezvous refusals, dead peers, with the transport's
//! settings (sub-chunk, idle timeout, job id) set directly.

use crate::fault_plan::FaultPlan;
use std::net::{SocketAddr, UdpSocket};
use std::time::{Duration, Instant};

use crate::collective::quic::{QuicCollective, QuicConfig};
use crate::collective::shm::LinkTransport;
use crate::collective::{chunk_range, Collective, CollectiveError};

fn input(r: usize, len: usize) -> Vec<f32> {
    (0..len).map(|i| (((i * 31 + r * 17) % 23) as f32) - 11.0).collect()
}

fn cfg(rank: usize, world: usize, master: SocketAddr) -> QuicConfig {
    let mut c = QuicConfig::new(rank, world, master);
    c.job_id = 0xfeed;
    c.config_hash = 77;
    c.sub_chunk = 50;
    c.timeout = Duration::from_secs(10);
    c.rendezvous_timeout = Duration::from_secs(10);
    c.idle_timeout = Duration::from_secs(3);
    c.secret = Some(b"test secret".to_vec());
    c
}

/// Binds rank 0's socket first so the others know the port.
pub(super) fn master_socket() -> (UdpSocket, SocketAddr) {
    let s = UdpSocket::bind("127.0.0.1:0").unwrap();
    let a = s.local_addr().unwrap();
    (s, a)
}

/// Applies the faults of `plan` to `c`, then all-reduces `buf` three times; returns how that ended and how
/// long it took (the dead-rank tests).
pub(super) fn all_reduce_thrice(
    c: &mut QuicCollective,
    plan: &FaultPlan,
    mut buf: Vec<f32>,
) -> (Result<(), CollectiveError>, Duration) {
    c.inject_faults(plan).unwrap();
    let t = Instant::now();
    let r = (|| {
        for _ in 0..3 {
            c.all_reduce_mean(&mut buf)?;
        }
        Ok(())
    })();
    (r, t.elapsed())
}

/// Runs `f` on every rank (configs from `cfgs`), each in its own thread.
pub(super) fn run_ranks<T: Send>(
    cfgs: Vec<QuicConfig>,
    sock0: UdpSocket,
    f: impl Fn(&mut QuicCollective) -> T + Sync,
) -> Vec<Result<T, CollectiveError>> {
    let mut sock0 = Some(sock0);
    std::thread::scope(|s| {
        let hs: Vec<_> = cfgs
            .into_iter()
            .map(|c| {
                let sock = if c.rank == 0 { sock0.take() } else { None };
                let f = &f;
                s.spawn(move || {
                    let mut q = match sock {
                        Some(sock) => QuicCollective::connect_with_socket(c, sock)?,
                        None => QuicCollective::connect(c)?,
                    };
                    Ok(f(&mut q))
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

#[test]
fn quic_collectives_exact_and_identical() {
    for world in [3usize, 4] {
        let (sock, master) = master_socket();
        let cfgs = (0..world).map(|r| cfg(r, world, master)).collect();
        let lens = [0usize, 1, 7, 97, 4099];
        let res = run_ranks(cfgs, sock, |c| {
            let mut out = Vec::new();
            for &len in &lens {
                c.set_step(len as u64);
                let mut b = input(c.rank(), len);
                c.all_reduce_sum(&mut b).unwrap();
                let mut rs = input(c.rank(), len);
                let mine = c.reduce_scatter_mean(&mut rs).unwrap();
                assert_eq!(mine, chunk_range(len, c.world(), c.rank()));
                c.all_gather(&mut rs).unwrap();
                let mut m = input(c.rank(), len);
                c.all_reduce_mean(&mut m).unwrap();
                assert_eq!(rs, m);
                out.push((b, m));
            }
            let mut p = input(c.rank(), 33);
            c.broadcast(&mut p, 1).unwrap();
            let mut s = [c.rank() as f64, 1.0];
            c.all_reduce_scalars(&mut s).unwrap();
            let h = c.gather_hashes([c.rank() as u8; 32]).unwrap();
            (out, p, s, h)
        });
        let res: Vec<_> = res.into_iter().map(|r| r.unwrap()).collect();
        let n = world as f64;
        for (li, &len) in lens.iter().enumerate() {
            let want: Vec<f32> = (0..len)
                .map(|i| (0..world).map(|r| input(r, len)[i] as f64).sum::<f64>() as f32)
                .collect();
            for (r, (out, _, _, _)) in res.iter().enumerate() {
                assert_eq!(out[li].0, want, "world {world} len {len} rank {r}");
                let bits = |v: &Vec<f32>| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                assert_eq!(bits(&out[li].1), bits(&res[0].0[li].1));
                if world == 4 {
                    assert_eq!(out[li].1, want.iter().map(|x| x / 4.0).collect::<Vec<_>>());
                }
            }
        }
        for (_, p, s, h) in &res {
            assert_eq!(p, &input(1, 33));
            assert_eq!(s, &[n * (n - 1.0) / 2.0, n]);
            assert_eq!(h, &(0..world).map(|r| [r as u8; 32]).collect::<Vec<_>>());
        }
    }
}

/// Rank 0 starts, then an impostor (with `bad` applied to its config) tries to join and must be refused with
/// an error containing `expect`; then the real ranks join and must still work.
fn impostor_refused(world: usize, bad: impl Fn(&mut QuicConfig), expect: &str) {
    let (sock, master) = master_socket();
    let mut imp = cfg(1, world, master);
    bad(&mut imp);
    imp.rendezvous_timeout = Duration::from_secs(5);
    let work = |c: &mut QuicCollective| {
        let mut b = input(c.rank(), 97);
        c.all_reduce_sum(&mut b).unwrap();
        b
    };
    std::thread::scope(|s| {
        let c0 = cfg(0, world, master);
        let h0 = s.spawn(move || work(&mut QuicCollective::connect_with_socket(c0, sock).unwrap()));
        let e = QuicCollective::connect(imp).err().expect("impostor must be refused");
        assert!(e.to_string().contains(expect), "expected {expect:?} in: {e}");
        let hs: Vec<_> = (1..world)
            .map(|r| {
                let c = cfg(r, world, master);
                s.spawn(move || work(&mut QuicCollective::connect(c).unwrap()))
            })
            .collect();
        let want = h0.join().unwrap();
        for h in hs {
            assert_eq!(h.join().unwrap(), want);
        }
    });
}

#[test]
fn wrong_secret_refused() {
    impostor_refused(3, |c| c.secret = Some(b"guess".to_vec()), "authentication");
}

#[test]
fn missing_secret_refused() {
    impostor_refused(3, |c| c.secret = None, "authentication");
}

#[test]
fn wrong_job_id_refused() {
    impostor_refused(3, |c| c.job_id = 1, "job id mismatch");
}

#[test]
fn wrong_world_size_refused() {
    impostor_refused(3, |c| c.world = 4, "world size mismatch");
}

#[test]
fn wrong_config_hash_refused() {
    impostor_refused(3, |c| c.config_hash = 1, "config hash mismatch");
}

#[test]
fn non_loopback_without_secret_refused() {
    let mut c = QuicConfig::new(0, 2, "0.0.0.0:0".parse().unwrap());
    c.secret = None;
    let e = QuicCollective::connect(c).err().expect("must refuse");
    assert!(e.to_string().contains("without a cluster secret"), "{e}");
    let mut c = QuicConfig::new(1, 2, "127.0.0.1:9".parse().unwrap());
    c.bind_ip = Some("0.0.0.0".parse().unwrap());
    let e = QuicCollective::connect(c).err().expect("must refuse");
    assert!(e.to_string().contains("without a cluster secret"), "{e}");
    // The message names the master address the user gave, not only the wildcard.
    assert!(e.to_string().contains("127.0.0.1:9"), "{e}");
}

#[test]
fn loopback_without_secret_works() {
    let (sock, master) = master_socket();
    let cfgs = (0..3)
        .map(|r| {
            let mut c = cfg(r, 3, master);
            c.secret = None;
            c
        })
        .collect();
    let res = run_ranks(cfgs, sock, |c| {
        let mut b = vec![c.rank() as f32; 10];
        c.all_reduce_sum(&mut b).unwrap();
        b
    });
    for r in res {
        assert_eq!(r.unwrap(), vec![3.0; 10]);
    }
}

#[test]
fn dead_rank_is_named_within_deadline() {
    for (world, dead) in [(4usize, 2usize), (3, 0)] {
        let (sock, master) = master_socket();
        let deadline = Duration::from_secs(6);
        let cfgs = (0..world)
            .map(|r| {
                let mut c = cfg(r, world, master);
                c.timeout = deadline;
                c.idle_timeout = Duration::from_secs(2);
                c
            })
            .collect();
        let plan = FaultPlan::parse(&[format!("drop={dead}:30")]).unwrap();
        let t0 = Instant::now();
        let res = run_ranks(cfgs, sock, |c| {
            let (r, took) = all_reduce_thrice(c, &plan, input(c.rank(), 4099));
            eprintln!("rank {} after {took:?}: {r:?}", c.rank());
            (r, took)
        });
        eprintln!("all ranks gone after {:?}", t0.elapsed());
        for (r, out) in res.into_iter().enumerate() {
            // A rank may also fail while the ring is still forming, if the crash comes that early.
            let e = match out {
                Ok((out, took)) => {
                    assert!(took < deadline, "rank {r} took {took:?}");
                    out.expect_err("every rank must fail")
                }
                Err(e) => e,
            };
            if r != dead {
                assert_eq!(e.peer(), Some(dead), "world {world} rank {r}: {e}");
                assert!(e.to_string().contains(&format!("rank {dead}")), "{e}");
            }
        }
    }
}

#[test]
fn abort_reaches_everyone() {
    let (sock, master) = master_socket();
    let cfgs = (0..3).map(|r| cfg(r, 3, master)).collect();
    let res = run_ranks(cfgs, sock, |c| {
        if c.rank() == 2 {
            c.abort("disk full");
            return Err(CollectiveError::Local("aborted".into()));
        }
        std::thread::sleep(Duration::from_millis(200));
        let mut b = vec![1.0f32; 1000];
        c.all_reduce_mean(&mut b)
    });
    for r in [0, 1] {
        // The abort may arrive while the ring is still forming (connect fails) or during the collective.
        let e = match &res[r] {
            Ok(out) => out.as_ref().unwrap_err(),
            Err(e) => e,
        };
        assert_eq!(e.peer(), Some(2), "{e}");
        assert!(e.to_string().contains("disk full"), "{e}");
    }
}

#[test]
fn allreduce_bench_table() {
    let t = crate::collective::bench::run_allreduce_bench(3, &[4096, 1 << 20], 3, b"bench secret", LinkTransport::Quic)
        .unwrap();
    eprintln!("{t}");
    let lines: Vec<&str> = t.lines().collect();
    assert_eq!(lines.len(), 4, "{t}");
    assert!(lines[1].contains("busbw"));
    assert!(lines[2].trim_start().starts_with("4 KiB"), "{t}");
    assert!(lines[3].trim_start().starts_with("1 MiB"), "{t}");
}

/// Manual throughput check: `cargo test --release --lib transport_tests::allreduce_bench_large -- --ignored
/// --nocapture`.
#[test]
#[ignore]
fn allreduce_bench_large() {
    for n in [2, 4] {
        let t = crate::collective::bench::run_allreduce_bench(
            n,
            &[1 << 20, 16 << 20, 64 << 20],
            5,
            b"bench secret",
            LinkTransport::Quic,
        )
        .unwrap();
        eprintln!("{t}");
    }
}

#[test]
fn duplicated_frame_is_a_protocol_error() {
    let (sock, master) = master_socket();
    let cfgs = (0..3).map(|r| cfg(r, 3, master)).collect();
    let plan = FaultPlan::parse(&["duplicate=1:3"]).unwrap();
    let t0 = Instant::now();
    let res = run_ranks(cfgs, sock, |c| {
        c.inject_faults(&plan).unwrap();
        let mut b = input(c.rank(), 1000);
        c.all_reduce_mean(&mut b)
    });
    assert!(t0.elapsed() < Duration::from_secs(8), "took {:?}", t0.elapsed());
    // A rank may hear of the failure while its own ring links are still forming (then `connect` fails).
    let errs: Vec<CollectiveError> = res.into_iter().map(|r| r.and_then(|o| o).unwrap_err()).collect();
    // Rank 2 receives from rank 1 and names it; the others hear of it through rank 0.
    assert!(
        matches!(&errs[2], CollectiveError::Protocol { rank: 1, msg } if msg.contains("duplicate")),
        "{}",
        errs[2]
    );
    for e in &errs[..2] {
        assert!(e.to_string().contains("duplicate"), "{e}");
    }
}

/// A phase's worth of frames far beyond what the reader queues and the flow-control window admits: each
/// rank must keep taking its left neighbour's frames while its own writes wait, or the ring stalls (both
/// ranks blocked writing, neither reading).
#[test]
fn all_reduce_larger_than_reader_queue_and_window() {
    let world = 2;
    let len = 5 << 20; // 20 MiB per rank: a 10 MiB chunk per phase, over the 6 MiB window a 4 MiB buffer gives
    let (sock0, master) = master_socket();
    let cfgs = (0..world)
        .map(|r| {
            let mut c = cfg(r, world, master);
            c.sub_chunk = 4096; // 16 KiB frames: 640 per phase against a queue of 32
            c
        })
        .collect();
    let res = run_ranks(cfgs, sock0, |c| {
        let mut b = input(c.rank(), len);
        c.all_reduce_sum(&mut b).unwrap();
        b
    });
    let (a, b) = (input(0, len), input(1, len));
    let want: Vec<f32> = a.iter().zip(&b).map(|(x, y)| x + y).collect();
    for r in res {
        assert!(r.unwrap() == want, "sum differs");
    }
}

/// Between collectives nobody calls into the transport (the trainer computes), yet keep-alives and
/// acknowledgements must still flow: ranks that pause for several idle timeouts, one rank much longer than
/// the others, still complete the next collectives.
#[test]
fn links_survive_pauses_longer_than_the_idle_timeout() {
    let world = 3;
    let (sock, master) = master_socket();
    let cfgs = (0..world)
        .map(|r| {
            let mut c = cfg(r, world, master);
            // Long enough that a loaded CI machine does not starve the keep-alives past it.
            c.idle_timeout = Duration::from_millis(1000);
            c
        })
        .collect();
    let res = run_ranks(cfgs, sock, |c| {
        let mut sums = Vec::new();
        for round in 0..2u64 {
            // Rank 1 pauses longest, so the others wait for it inside the collective meanwhile.
            let pause = if c.rank() == 1 { 3500 } else { 2500 };
            std::thread::sleep(Duration::from_millis(pause));
            c.set_step(round);
            let mut b = input(c.rank(), 1000);
            c.all_reduce_sum(&mut b).map_err(|e| e.to_string())?;
            sums.push(b);
        }
        Ok::<_, String>(sums)
    });
    let want: Vec<f32> = (0..1000).map(|i| (0..world).map(|r| input(r, 1000)[i]).sum()).collect();
    for (r, res) in res.into_iter().enumerate() {
        let sums = res
            .unwrap_or_else(|e| panic!("rank {r}: {e}"))
            .unwrap_or_else(|e| panic!("rank {r}: {e}"));
        for s in sums {
            assert_eq!(s, want, "rank {r}");
        }
    }
}

#[test]
fn a_rank_with_another_secret_is_named_when_the_rendezvous_times_out() {
    let (sock, master) = master_socket();
    let mut healthy: Vec<QuicConfig> = (0..2).map(|r| cfg(r, 3, master)).collect();
    for c in &mut healthy {
        c.rendezvous_timeout = Duration::from_secs(3);
    }
    let mut stranger = cfg(2, 3, master);
    stranger.secret = Some(b"another secret".to_vec());
    let started = Instant::now();
    let errors: Vec<String> = std::thread::scope(|s| {
        let c0 = healthy.remove(0);
        let h0 = s.spawn(move || {
            QuicCollective::connect_with_socket(c0, sock)
                .err()
                .map(|e| e.to_string())
        });
        std::thread::sleep(Duration::from_millis(200));
        let c1 = healthy.remove(0);
        let h1 = s.spawn(move || QuicCollective::connect(c1).err().map(|e| e.to_string()));
        let own = QuicCollective::connect(stranger)
            .err()
            .expect("the stranger is refused")
            .to_string();
        assert!(own.contains("authentication"), "{own}");
        assert!(
            started.elapsed() < Duration::from_secs(2),
            "the stranger learns at once"
        );
        [h0, h1]
            .map(|h| h.join().unwrap().expect("the job cannot start"))
            .to_vec()
    });
    assert!(started.elapsed() < Duration::from_secs(8), "{:?}", started.elapsed());
    for e in &errors {
        assert!(e.contains("did not join") && e.contains("failed authentication"), "{e}");
        assert!(e.contains("127.0.0.1:"), "names the address: {e}");
    }
}
