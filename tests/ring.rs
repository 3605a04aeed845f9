//! Ring collectives over the in-memory transport, with seeded reordering, delays and faults.

use std::time::{Duration, Instant};

use ringtrain::collective::mem::{run_cluster, MemOptions};
use ringtrain::collective::{chunk_range, Collective, CollectiveError};
use ringtrain::fault_plan::{Fault, FaultPlan};

const LENS: [usize; 8] = [0, 1, 2, 7, 13, 97, 1000, 4099];

/// Integer-valued input of rank `r`: sums stay exact in f32.
fn input(r: usize, len: usize) -> Vec<f32> {
    (0..len).map(|i| (((i * 31 + r * 17) % 23) as f32) - 11.0).collect()
}

fn exact_sum(world: usize, len: usize) -> Vec<f32> {
    (0..len)
        .map(|i| (0..world).map(|r| input(r, 1 + i)[i] as f64).sum::<f64>() as f32)
        .collect()
}

/// Seeded reordering, plus `faults`.
fn opts_with(seed: u64, sub_chunk: usize, faults: &[Fault]) -> MemOptions {
    let mut all = vec![Fault::Reorder(seed)];
    all.extend_from_slice(faults);
    MemOptions {
        deadline: Duration::from_secs(20),
        sub_chunk,
        faults: FaultPlan::new(all).unwrap(),
    }
}

fn opts(seed: u64, sub_chunk: usize) -> MemOptions {
    opts_with(seed, sub_chunk, &[])
}

#[test]
fn all_reduce_exact_and_identical_all_sizes() {
    for world in 1..=8 {
        let o = opts_with(world as u64, 5, &[Fault::Delay(Duration::from_micros(20))]);
        let results = run_cluster(world, o, |c| {
            let mut out = Vec::new();
            for &len in &LENS {
                let mut sum = input(c.rank(), len);
                c.all_reduce_sum(&mut sum).unwrap();
                let mut mean = input(c.rank(), len);
                c.all_reduce_mean(&mut mean).unwrap();
                out.push((sum, mean));
            }
            out
        });
        for (li, &len) in LENS.iter().enumerate() {
            let want = exact_sum(world, len);
            let (sum0, mean0) = &results[0][li];
            assert_eq!(sum0, &want, "world {world} len {len}");
            if world.is_power_of_two() {
                let want_mean: Vec<f32> = want.iter().map(|x| x / world as f32).collect();
                assert_eq!(mean0, &want_mean, "mean world {world} len {len}");
            }
            for res in results.iter().skip(1) {
                let (s, m) = &res[li];
                assert_eq!(
                    s.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
                    sum0.iter().map(|x| x.to_bits()).collect::<Vec<_>>()
                );
                assert_eq!(
                    m.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
                    mean0.iter().map(|x| x.to_bits()).collect::<Vec<_>>()
                );
            }
        }
    }
}

#[test]
fn all_reduce_from_split_byte_pieces_is_exact_and_identical() {
    // The form QUIC delivers: each f32 payload in little-endian pieces that cut values apart.
    for world in 1..=8 {
        let o = opts_with(world as u64 + 100, 5, &[Fault::Split(world as u64)]);
        let results = run_cluster(world, o, |c| {
            let mut out = Vec::new();
            for &len in &LENS {
                let mut sum = input(c.rank(), len);
                c.all_reduce_sum(&mut sum).unwrap();
                let mut bcast = input(c.rank(), len);
                c.broadcast(&mut bcast, c.world() - 1).unwrap();
                out.push((sum, bcast));
            }
            out
        });
        for (li, &len) in LENS.iter().enumerate() {
            let want = exact_sum(world, len);
            for (r, res) in results.iter().enumerate() {
                assert_eq!(res[li].0, want, "world {world} len {len} rank {r}");
                assert_eq!(
                    res[li].1,
                    input(world - 1, len),
                    "broadcast, world {world} len {len} rank {r}"
                );
            }
        }
    }
}

#[test]
fn bits_independent_of_schedule_and_sub_chunk() {
    // Non-integer data: the fixed reduction order must give the same bits for any seed, delay or sub-chunk.
    let data = |r: usize, len: usize| -> Vec<f32> {
        (0..len)
            .map(|i| ((i as f32 + 0.1) * (r as f32 + 1.3)).sin() * 1e3)
            .collect()
    };
    let len = 1000;
    let mut reference: Option<Vec<u32>> = None;
    for (seed, sub, delay) in [(1u64, 7usize, 0u64), (2, 64, 50), (3, 1000, 0), (4, 3, 20)] {
        // Half of the runs receive their payloads as split byte pieces, as over QUIC.
        let mut faults = vec![Fault::Delay(Duration::from_micros(delay))];
        faults.extend((seed % 2 == 0).then_some(Fault::Split(seed)));
        let o = opts_with(seed, sub, &faults);
        let res = run_cluster(5, o, |c| {
            let mut b = data(c.rank(), len);
            c.all_reduce_mean(&mut b).unwrap();
            b.iter().map(|x| x.to_bits()).collect::<Vec<_>>()
        });
        for r in &res {
            assert_eq!(r, &res[0]);
        }
        match &reference {
            None => reference = Some(res[0].clone()),
            Some(want) => assert_eq!(&res[0], want, "seed {seed} sub {sub}"),
        }
    }
}

#[test]
fn reduce_scatter_then_all_gather_matches_all_reduce() {
    for world in [1, 2, 3, 5, 8] {
        for &len in &[0usize, 1, 7, 97, 4099] {
            let res = run_cluster(world, opts(7, 11), |c| {
                let mut b = input(c.rank(), len);
                let mine = c.reduce_scatter_mean(&mut b).unwrap();
                assert_eq!(mine, chunk_range(len, c.world(), c.rank()));
                let owned = b[mine.clone()].to_vec();
                c.all_gather(&mut b).unwrap();
                let mut a = input(c.rank(), len);
                c.all_reduce_mean(&mut a).unwrap();
                (owned, b, a)
            });
            for (r, (owned, gathered, reduced)) in res.iter().enumerate() {
                assert_eq!(gathered, reduced, "world {world} len {len} rank {r}");
                assert_eq!(&reduced[chunk_range(len, world, r)], owned.as_slice());
            }
        }
    }
}

#[test]
fn broadcast_scalars_and_hashes() {
    for world in [1, 2, 3, 4, 7] {
        let res = run_cluster(world, opts(11, 4), |c| {
            let root = c.world() - 1;
            let mut p = input(c.rank(), 13);
            c.broadcast(&mut p, root).unwrap();
            let mut s = [c.rank() as f64, 1.0, 0.5];
            c.all_reduce_scalars(&mut s).unwrap();
            let h = c.gather_hashes([c.rank() as u8; 32]).unwrap();
            let mut m = [
                c.rank() as f64,
                -(c.rank() as f64),
                if c.rank() == 0 { f64::NAN } else { 1.0 },
            ];
            c.all_reduce_scalars_max(&mut m).unwrap();
            assert_eq!(m[0], (c.world() - 1) as f64);
            assert_eq!(m[1], 0.0);
            assert!(m[2].is_nan());
            (p, s, h)
        });
        let n = world as f64;
        for (p, s, h) in &res {
            assert_eq!(p, &input(world - 1, 13));
            assert_eq!(s, &[n * (n - 1.0) / 2.0, n, 0.5 * n]);
            assert_eq!(h, &(0..world).map(|r| [r as u8; 32]).collect::<Vec<_>>());
        }
    }
    assert_eq!(
        ringtrain::collective::diverged_ranks(&[[1; 32], [1; 32], [2; 32]]),
        vec![2]
    );
}

#[test]
fn slow_peer_still_correct() {
    let slow = Fault::SlowMessages {
        rank: 2,
        delay: Duration::from_millis(2),
    };
    let o = opts_with(3, 50, &[slow]);
    let res = run_cluster(4, o, |c| {
        let mut b = input(c.rank(), 1000);
        c.all_reduce_sum(&mut b).unwrap();
        b
    });
    for b in &res {
        assert_eq!(b, &exact_sum(4, 1000));
    }
}

#[test]
fn dropped_peer_is_named_within_deadline() {
    for (world, dead, after) in [(2, 1, 0), (3, 1, 2), (4, 0, 5), (5, 3, 1), (8, 6, 3)] {
        let mut o = opts_with(
            5,
            10,
            &[Fault::Drop {
                rank: dead,
                msgs: after,
            }],
        );
        o.deadline = Duration::from_secs(3);
        let t0 = Instant::now();
        let res = run_cluster(world, o, |c| {
            // Several collectives, so the death lands mid-way through one of them.
            let mut b = input(c.rank(), 97);
            for _ in 0..3 {
                c.all_reduce_mean(&mut b)?;
            }
            Ok::<_, CollectiveError>(())
        });
        assert!(t0.elapsed() < Duration::from_secs(3), "took {:?}", t0.elapsed());
        for (r, out) in res.iter().enumerate() {
            let e = out.as_ref().expect_err("every rank must fail");
            if r != dead {
                assert_eq!(e.peer(), Some(dead), "world {world} rank {r}: {e}");
                assert!(e.to_string().contains(&format!("rank {dead}")), "{e}");
            }
        }
    }
}

#[test]
fn abort_is_seen_by_everyone() {
    let res = run_cluster(3, opts(1, 8), |c| {
        if c.rank() == 1 {
            c.abort("out of memory");
            return Err(CollectiveError::Local("aborted".into()));
        }
        let mut b = vec![1.0f32; 10];
        c.all_reduce_mean(&mut b)
    });
    for r in [0, 2] {
        let e = res[r].as_ref().unwrap_err();
        assert_eq!(e.peer(), Some(1), "{e}");
        assert!(e.to_string().contains("out of memory"));
    }
}

#[test]
fn timeout_names_left_neighbour() {
    // Rank 2 never joins the collective (but stays alive): its right neighbour times out naming it.
    let mut o = opts(1, 8);
    o.deadline = Duration::from_millis(300);
    let res = run_cluster(3, o, |c| {
        if c.rank() == 2 {
            std::thread::sleep(Duration::from_millis(600));
            return Ok(());
        }
        let mut b = vec![1.0f32; 10];
        c.all_reduce_mean(&mut b)
    });
    let e = res[0].as_ref().unwrap_err();
    assert!(matches!(e, CollectiveError::Timeout { waiting_on: 2, .. }), "{e}");
}
