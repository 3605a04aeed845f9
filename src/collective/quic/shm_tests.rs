//! Ring links through shared memory: the same bits as QUIC and the in-memory transport, links chosen by host
//! identity, a dead local rank named, and `--transport shm` refused where it cannot hold.

use std::net::SocketAddr;
use std::time::Duration;

use super::transport_tests::{all_reduce_thrice, master_socket, run_ranks};

use crate::collective::mem::{run_cluster, MemOptions};
use crate::collective::quic::QuicConfig;
use crate::collective::shm::LinkTransport;
use crate::collective::Collective;
use crate::fault_plan::FaultPlan;

fn input(r: usize, len: usize) -> Vec<f32> {
    (0..len).map(|i| ((i * 37 + r * 11) % 29) as f32 * 0.37 - 5.1).collect()
}

fn cfg(rank: usize, world: usize, master: SocketAddr, transport: LinkTransport) -> QuicConfig {
    let mut c = QuicConfig::new(rank, world, master);
    c.job_id = 0x5eed;
    c.config_hash = 3;
    // Small sub-chunks and a ring smaller than one collective's traffic, so links wrap and wait for space,
    // and messages sent from the caller's buffer sometimes find no room and take the copying path.
    c.sub_chunk = 999;
    c.shm_capacity = crate::collective::shm::MIN_CAPACITY;
    c.timeout = Duration::from_secs(10);
    c.rendezvous_timeout = Duration::from_secs(10);
    c.idle_timeout = Duration::from_secs(3);
    c.secret = Some(b"shm test secret".to_vec());
    c.transport = transport;
    c
}

/// Every collective the trainer uses, over lengths that leave some ranks empty chunks and others wrap the
/// ring; returns the bits each produced.
fn exercise(c: &mut dyn Collective) -> Vec<Vec<u32>> {
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    let mut out = Vec::new();
    for (step, len) in [0usize, 1, 5, 1000, 70_001].into_iter().enumerate() {
        c.set_step(step as u64);
        let mut m = input(c.rank(), len);
        c.all_reduce_mean(&mut m).unwrap();
        out.push(bits(&m));
        let mut s = input(c.rank(), len);
        c.all_reduce_sum(&mut s).unwrap();
        out.push(bits(&s));
        let mut rs = input(c.rank(), len);
        let mine = c.reduce_scatter_sum(&mut rs).unwrap();
        out.push(bits(&rs[mine]));
        let mut g = input(c.rank(), len);
        c.all_gather(&mut g).unwrap();
        out.push(bits(&g));
    }
    let mut b = input(c.rank(), 77);
    c.broadcast(&mut b, c.world() - 1).unwrap();
    out.push(bits(&b));
    let mut sc = [c.rank() as f64 + 0.25, -1.0];
    c.all_reduce_scalars(&mut sc).unwrap();
    out.push(
        sc.iter()
            .map(|x| x.to_bits() as u32 ^ (x.to_bits() >> 32) as u32)
            .collect(),
    );
    out
}

fn over_quic(
    world: usize,
    transport: LinkTransport,
    host: impl Fn(usize) -> Option<String>,
) -> Vec<(Vec<Vec<u32>>, [&'static str; 2])> {
    let (sock, master) = master_socket();
    let cfgs = (0..world)
        .map(|r| {
            let mut c = cfg(r, world, master, transport);
            c.host_id = host(r);
            c
        })
        .collect();
    run_ranks(cfgs, sock, |q| (exercise(q), q.data_links()))
        .into_iter()
        .map(|r| r.unwrap())
        .collect()
}

#[test]
fn a_ring_over_shared_memory_gives_the_bits_of_quic_and_of_the_in_memory_transport() {
    for world in 1..=4usize {
        let mem = run_cluster(
            world,
            MemOptions {
                sub_chunk: 999,
                ..MemOptions::default()
            },
            |c| exercise(c),
        );
        let shm = over_quic(world, LinkTransport::Shm, |_| None);
        let quic = over_quic(world, LinkTransport::Quic, |_| None);
        let auto = over_quic(world, LinkTransport::Auto, |_| None);
        for r in 0..world {
            let want = if world == 1 { ["none", "none"] } else { ["shm", "shm"] };
            assert_eq!(shm[r].1, want, "world {world} rank {r}");
            assert_eq!(
                auto[r].1, want,
                "world {world} rank {r}: auto takes shared memory on one host"
            );
            if world > 1 {
                assert_eq!(quic[r].1, ["quic", "quic"]);
            }
            assert!(
                shm[r].0 == mem[r],
                "world {world} rank {r}: shared memory differs from in-memory"
            );
            assert!(
                quic[r].0 == mem[r],
                "world {world} rank {r}: QUIC differs from in-memory"
            );
            assert!(auto[r].0 == mem[r], "world {world} rank {r}");
            // All-reduced buffers (every fourth entry, from the first) are the same on every rank.
            for i in (0..shm[r].0.len() - 2).step_by(4) {
                assert!(
                    shm[r].0[i] == shm[0].0[i],
                    "world {world}: rank {r} differs from rank 0"
                );
            }
        }
    }
}

#[test]
fn links_between_hosts_stay_quic_and_links_within_one_use_shared_memory() {
    // Uneven groups: ranks 0-2 on host a, rank 3 on host b.
    let host = |r: usize| Some(if r < 3 { "a" } else { "b" }.to_string());
    let res = over_quic(4, LinkTransport::Auto, host);
    let links: Vec<_> = res.iter().map(|r| r.1).collect();
    assert_eq!(
        links,
        [["quic", "shm"], ["shm", "shm"], ["shm", "quic"], ["quic", "quic"]],
        "[from the left, to the right] per rank"
    );
    let quic = over_quic(4, LinkTransport::Quic, |_| None);
    for r in 0..4 {
        assert!(res[r].0 == quic[r].0, "rank {r}: mixed links change the bits");
    }
}

#[test]
fn forced_shared_memory_without_a_neighbour_on_the_host_is_refused_naming_why() {
    let (sock, master) = master_socket();
    let cfgs = (0..2)
        .map(|r| {
            let mut c = cfg(r, 2, master, LinkTransport::Shm);
            c.host_id = Some(format!("host-{r}"));
            c
        })
        .collect();
    for r in run_ranks(cfgs, sock, |_| ()) {
        let e = r.expect_err("no link can use shared memory").to_string();
        assert!(e.contains("--transport shm") && e.contains("shares its host"), "{e}");
    }
}

#[test]
fn a_dead_local_rank_is_named_by_the_others_within_the_deadline() {
    for (world, dead) in [(3usize, 1usize), (2, 0)] {
        let (sock, master) = master_socket();
        let deadline = Duration::from_secs(6);
        let cfgs = (0..world)
            .map(|r| {
                let mut c = cfg(r, world, master, LinkTransport::Shm);
                c.timeout = deadline;
                c.idle_timeout = Duration::from_secs(2);
                c
            })
            .collect();
        let plan = FaultPlan::parse(&[format!("drop={dead}:30")]).unwrap();
        let res = run_ranks(cfgs, sock, |c| {
            let (r, took) = all_reduce_thrice(c, &plan, input(c.rank(), 40_000));
            (r, took, c.data_links())
        });
        for (r, out) in res.into_iter().enumerate() {
            let (out, took, links) = out.expect("the ring formed");
            assert_eq!(links[1], if r == dead { "none" } else { "shm" });
            let e = out.expect_err("every rank fails");
            assert!(took < deadline, "rank {r} took {took:?}");
            if r != dead {
                assert_eq!(e.peer(), Some(dead), "world {world} rank {r}: {e}");
            }
        }
    }
}

#[test]
fn collectives_many_times_larger_than_the_segment_complete_on_every_world_size() {
    // The last case mixes links: two hosts of two ranks, so gathers go from shared memory to QUIC and back.
    for (world, two_hosts) in [(2usize, false), (3, false), (4, false), (4, true)] {
        let (sock, master) = master_socket();
        let cfgs = (0..world)
            .map(|r| {
                let mut c = cfg(r, world, master, LinkTransport::Auto);
                c.sub_chunk = crate::collective::ring::DEFAULT_SUB_CHUNK;
                c.timeout = Duration::from_secs(30);
                c.host_id = two_hosts.then(|| format!("host-{}", r / 2));
                c
            })
            .collect();
        let len = 12 << 20;
        let res = run_ranks(cfgs, sock, |c| {
            let mut b = input(c.rank(), len);
            c.all_reduce_sum(&mut b).unwrap();
            let mut g = input(c.rank(), len);
            c.all_gather(&mut g).unwrap();
            (b[..16].to_vec(), b[len - 16..].to_vec())
        });
        let first = res[0].as_ref().unwrap().clone();
        for r in res {
            assert_eq!(r.unwrap(), first, "world {world}");
        }
    }
}
