//! The two-level ring over QUIC and shared memory: every rank ends with the same bits, the sums are right,
//! the ownership map tiles the buffer, the layout is rank 0's, and a dead rank is named.

use std::net::SocketAddr;
use std::time::Duration;

use super::transport_tests::{all_reduce_thrice, master_socket, run_ranks};
use crate::collective::quic::QuicConfig;
use crate::collective::shm::LinkTransport;
use crate::collective::{Collective, CollectiveChoice, CollectiveError};
use crate::fault_plan::FaultPlan;

fn input(r: usize, len: usize) -> Vec<f32> {
    (0..len)
        .map(|i| ((i * 37 + r * 11) % 29) as f32 * 0.37 - 5.1 + r as f32 * 1e-3)
        .collect()
}

fn cfg(rank: usize, world: usize, master: SocketAddr, host: &str, collective: CollectiveChoice) -> QuicConfig {
    let mut c = QuicConfig::new(rank, world, master);
    c.job_id = 0x2e7e1;
    c.config_hash = 5;
    c.sub_chunk = 777;
    c.timeout = Duration::from_secs(15);
    c.rendezvous_timeout = Duration::from_secs(15);
    c.idle_timeout = Duration::from_secs(3);
    c.secret = Some(b"two-level test secret".to_vec());
    c.transport = LinkTransport::Auto;
    c.host_id = Some(host.to_string());
    c.collective = collective;
    c
}

/// What one rank produced: all-reduce mean and sum, reduce-scatter (its owned range and values), the
/// all-gather of the reduce-scatter's result, and a broadcast.
#[derive(Debug, PartialEq)]
struct Outcome {
    two_level: bool,
    mean: Vec<u32>,
    sum: Vec<f32>,
    owned: std::ops::Range<usize>,
    scattered: Vec<u32>,
    gathered: Vec<u32>,
    broadcast: Vec<u32>,
}

fn exercise(c: &mut dyn Collective, len: usize) -> Outcome {
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    let mut m = input(c.rank(), len);
    c.all_reduce_mean(&mut m).unwrap();
    let mut s = input(c.rank(), len);
    c.all_reduce_sum(&mut s).unwrap();
    let mut rs = input(c.rank(), len);
    let owned = c.reduce_scatter_mean(&mut rs).unwrap();
    let scattered = bits(&rs[owned.clone()]);
    // ZeRO-1's pattern: each rank keeps its owned range, then the ranges are gathered.
    let mut g = vec![f32::NAN; len];
    g[owned.clone()].copy_from_slice(&rs[owned.clone()]);
    c.all_gather(&mut g).unwrap();
    let mut b = input(c.rank(), 33);
    c.broadcast(&mut b, 1).unwrap();
    Outcome {
        two_level: c.two_level().is_some(),
        mean: bits(&m),
        sum: s,
        owned,
        scattered,
        gathered: bits(&g),
        broadcast: bits(&b),
    }
}

fn run(hosts: &[&str], collective: CollectiveChoice, len: usize) -> Vec<Result<Outcome, CollectiveError>> {
    let (sock, master) = master_socket();
    let world = hosts.len();
    let cfgs = (0..world)
        .map(|r| cfg(r, world, master, hosts[r], collective))
        .collect();
    run_ranks(cfgs, sock, |q| exercise(q, len))
}

#[test]
fn two_hosts_of_two_ranks_end_with_identical_bits_and_the_right_sums() {
    // Contiguous and interleaved hosts; lengths with empty, odd and multi-message chunks.
    for hosts in [["a", "a", "b", "b"], ["a", "b", "a", "b"]] {
        for len in [0usize, 3, 1001, 20_000] {
            let res: Vec<Outcome> = run(&hosts, CollectiveChoice::Hierarchical, len)
                .into_iter()
                .map(|r| r.unwrap())
                .collect();
            let world = hosts.len();
            let want: Vec<f64> = (0..len)
                .map(|i| (0..world).map(|r| input(r, len)[i] as f64).sum())
                .collect();
            let mut covered = vec![0; len];
            for (r, o) in res.iter().enumerate() {
                assert!(o.two_level, "{hosts:?}: rank {r} runs the two-level ring");
                assert_eq!(o.mean, res[0].mean, "{hosts:?} len {len}: rank {r}'s mean differs");
                assert_eq!(o.sum, res[0].sum, "{hosts:?} len {len}: rank {r}'s sum differs");
                assert_eq!(
                    o.gathered, res[0].mean,
                    "{hosts:?} len {len}: scatter + gather is the mean"
                );
                assert_eq!(o.broadcast, res[0].broadcast);
                assert_eq!(o.scattered, res[0].mean[o.owned.clone()]);
                for i in o.owned.clone() {
                    covered[i] += 1;
                }
            }
            assert!(covered.iter().all(|&c| c == 1), "owned ranges tile the buffer once");
            for (i, w) in want.iter().enumerate() {
                let got = res[0].sum[i] as f64;
                assert!(
                    (got - w).abs() <= 1e-5 * w.abs().max(1.0),
                    "len {len} [{i}]: {got} vs {w}"
                );
                let mean = f32::from_bits(res[0].mean[i]) as f64;
                assert!((mean - w / world as f64).abs() <= 1e-5 * w.abs().max(1.0));
            }
        }
    }
}

#[test]
fn auto_takes_two_levels_only_for_equal_hosts_and_forced_two_levels_are_refused_otherwise() {
    let two_by_two = run(&["a", "a", "b", "b"], CollectiveChoice::Auto, 50);
    assert!(two_by_two.iter().all(|r| r.as_ref().unwrap().two_level));
    // Two of three and one: auto runs the flat ring, with the flat ring's bits.
    let uneven = run(&["a", "a", "b"], CollectiveChoice::Auto, 50);
    let flat = run(&["a", "a", "b"], CollectiveChoice::Flat, 50);
    for (u, f) in uneven.iter().zip(&flat) {
        let (u, f) = (u.as_ref().unwrap(), f.as_ref().unwrap());
        assert!(!u.two_level && !f.two_level);
        assert_eq!(u.mean, f.mean);
    }
    for r in run(&["a", "a", "b"], CollectiveChoice::Hierarchical, 50) {
        let e = r.expect_err("no two-level ring fits").to_string();
        assert!(e.contains("--collective hierarchical") && e.contains("unequal"), "{e}");
    }
    for r in run(&["a", "a", "a", "a"], CollectiveChoice::Hierarchical, 50) {
        let e = r.expect_err("one host").to_string();
        assert!(e.contains("one host"), "{e}");
    }
}

#[test]
fn ranks_started_with_another_collective_are_refused_naming_it() {
    let (sock, master) = master_socket();
    let cfgs = (0..2)
        .map(|r| {
            let choice = if r == 0 {
                CollectiveChoice::Flat
            } else {
                CollectiveChoice::Auto
            };
            let mut c = cfg(r, 2, master, "a", choice);
            c.rendezvous_timeout = Duration::from_secs(4);
            c
        })
        .collect();
    let res = run_ranks(cfgs, sock, |_| ());
    let e = res[1].as_ref().expect_err("refused").to_string();
    assert!(e.contains("collective mismatch"), "{e}");
}

#[test]
fn a_dead_rank_of_a_two_level_ring_is_named_within_the_deadline() {
    let hosts = ["a", "a", "b", "b"];
    for dead in [1usize, 2] {
        let (sock, master) = master_socket();
        let deadline = Duration::from_secs(6);
        let cfgs = (0..4)
            .map(|r| {
                let mut c = cfg(r, 4, master, hosts[r], CollectiveChoice::Hierarchical);
                c.timeout = deadline;
                c.idle_timeout = Duration::from_secs(2);
                c
            })
            .collect();
        let plan = FaultPlan::parse(&[format!("drop={dead}:20")]).unwrap();
        let res = run_ranks(cfgs, sock, |c| all_reduce_thrice(c, &plan, input(c.rank(), 40_000)));
        for (r, out) in res.into_iter().enumerate() {
            // A rank still forming its links when the dead one went is told of the death by rank 0.
            let (e, took) = match out {
                Ok((out, took)) => (out.expect_err("every rank fails"), took),
                Err(e) => (e, Duration::ZERO),
            };
            assert!(took < deadline, "rank {r} took {took:?}");
            if r != dead {
                assert_eq!(e.peer(), Some(dead), "rank {dead} dead, rank {r}: {e}");
            }
        }
    }
}
