//! Compact wire formats (`--wire bf16|int8`): ring sums sent rounded are identical on every rank, within
//! the error bound `collective::wire` states of the exact sum, transport-independent (the same bits over
//! the in-memory ring with split and reordered messages, and over QUIC), smaller on the wire by the
//! formats' ratios; and a training run with them keeps its replicas bit-identical.

mod common;

use std::net::UdpSocket;
use std::time::Duration;

use ringtrain::backend::factory::{self, BackendChoice};
use ringtrain::collective::mem::{mem_cluster, run_cluster, MemOptions};
use ringtrain::collective::quic::{QuicCollective, QuicConfig};
use ringtrain::collective::ring::run_local;
use ringtrain::collective::wire::INT8_BLOCK;
use ringtrain::collective::{chunk_range, Collective, Reduce, RingEngine, RingOp, Wire};
use ringtrain::data::{load_splits, TokenizerKind};
use ringtrain::fault_plan::{Fault, FaultPlan};
use ringtrain::model::ModelConfig;
use ringtrain::trainer::{ModelSource, OuterOptions, SyncMode, TrainOptions, Trainer, UpdateMode};

const COMPACT: [Wire; 2] = [Wire::Bf16, Wire::Int8];

/// Rank `r`'s input: values of mixed signs over several orders of magnitude, not exact in bf16, with a
/// block of zeros (an int8 block with a zero scale) and blocks whose scales differ by 10^4.
fn input(r: usize, len: usize) -> Vec<f32> {
    (0..len)
        .map(|i| {
            let x = (((i * 7919 + r * 104_729) % 1013) as f32 - 506.0) / 97.0;
            let magnitude = [1e-3f32, 1.0, 10.0, 0.0][(i / INT8_BLOCK) % 4];
            x * magnitude * (1.0 + r as f32 / 3.0)
        })
        .collect()
}

/// The error bound `collective::wire` states for an `n`-rank sum, per element: `n * 2^-8 * S` (bf16),
/// `n * max_block(S) / 254` (int8), where `S = sum_i |x_i|`; a mean divides it by `n`. The factor 1.01
/// covers the f32 additions and the scale's own rounding.
fn bound(wire: Wire, inputs: &[Vec<f32>], mean: bool) -> Vec<f64> {
    let len = inputs[0].len();
    let n = inputs.len() as f64;
    let abs_sum: Vec<f64> = (0..len)
        .map(|i| inputs.iter().map(|x| x[i].abs() as f64).sum())
        .collect();
    let per_value: Vec<f64> = match wire {
        Wire::F32 => vec![0.0; len],
        Wire::Bf16 => abs_sum.iter().map(|s| n * s / 256.0).collect(),
        // Blocks start at each sub-chunk's first value; a bound over any 2 neighbouring blocks covers
        // every alignment.
        Wire::Int8 => (0..len)
            .map(|i| {
                let window = i.saturating_sub(INT8_BLOCK)..(i + INT8_BLOCK).min(len);
                n * abs_sum[window].iter().fold(0f64, |m, &s| m.max(s)) / 254.0
            })
            .collect(),
    };
    per_value
        .into_iter()
        .zip(&abs_sum)
        .map(|(b, s)| 1.01 * b / if mean { n } else { 1.0 } + 1e-6 * s)
        .collect()
}

fn exact(inputs: &[Vec<f32>], mean: bool) -> Vec<f64> {
    let n = inputs.len() as f64;
    (0..inputs[0].len())
        .map(|i| inputs.iter().map(|x| x[i] as f64).sum::<f64>() / if mean { n } else { 1.0 })
        .collect()
}

/// Runs `op` with `wire` on `world` engines in one thread: every rank's buffer afterwards.
fn local(op: RingOp, wire: Wire, world: usize, len: usize, sub_chunk: usize) -> Vec<Vec<f32>> {
    let mut bufs: Vec<Vec<f32>> = (0..world).map(|r| input(r, len)).collect();
    let mut engines: Vec<RingEngine> = bufs
        .iter_mut()
        .enumerate()
        .map(|(r, b)| RingEngine::new(op, r, world, b, sub_chunk).unwrap().with_wire(wire))
        .collect();
    run_local(&mut engines).unwrap();
    drop(engines);
    bufs
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

#[test]
fn compact_sums_are_identical_on_every_rank_and_within_the_stated_bound() {
    for wire in COMPACT {
        for world in 1..=6 {
            for (len, sub_chunk) in [(0, 5), (1, 5), (65, 5), (1000, 64), (4099, 1 << 16), (777, 100)] {
                let inputs: Vec<Vec<f32>> = (0..world).map(|r| input(r, len)).collect();
                for reduce in [Reduce::Sum, Reduce::Mean] {
                    let mean = reduce == Reduce::Mean;
                    let what = format!("{wire} world {world} len {len} sub {sub_chunk} {reduce:?}");
                    let all = local(RingOp::AllReduce(reduce), wire, world, len, sub_chunk);
                    for other in &all[1..] {
                        assert_eq!(bits(other), bits(&all[0]), "{what}: ranks differ");
                    }
                    let (want, slack) = (exact(&inputs, mean), bound(wire, &inputs, mean));
                    for i in 0..len {
                        let err = (all[0][i] as f64 - want[i]).abs();
                        assert!(err <= slack[i], "{what}: element {i} off by {err:e} > {:e}", slack[i]);
                    }
                    // The reduce-scatter's owner holds the same f32 sum before the all-reduce rounds it for
                    // the gather: rounding it gives the all-reduce's bits.
                    let scattered = local(RingOp::ReduceScatter(reduce), wire, world, len, sub_chunk);
                    for (r, buf) in scattered.iter().enumerate() {
                        let owned = chunk_range(len, world, r);
                        let mut rounded = buf[owned.clone()].to_vec();
                        if world > 1 {
                            for sub in rounded.chunks_mut(sub_chunk) {
                                wire.round_in_place(sub);
                            }
                        }
                        assert_eq!(bits(&rounded), bits(&all[0][owned]), "{what}: rank {r}'s chunk");
                    }
                }
            }
        }
    }
}

#[test]
fn gathers_and_broadcasts_stay_f32_whatever_the_wire() {
    for op in [RingOp::AllGather, RingOp::Broadcast { root: 1 }] {
        assert_eq!(
            local(op, Wire::Int8, 3, 300, 7),
            local(op, Wire::F32, 3, 300, 7),
            "{op:?} is exact"
        );
    }
}

/// Every rank's all-reduce sum over the in-memory ring with reordered, split and delayed messages.
fn over_mem(wire: Wire, world: usize, len: usize) -> (Vec<Vec<f32>>, u64) {
    let faults = FaultPlan::new(vec![
        Fault::Reorder(world as u64),
        Fault::Split(7),
        Fault::Delay(Duration::from_micros(10)),
    ])
    .unwrap();
    let opts = MemOptions {
        deadline: Duration::from_secs(20),
        sub_chunk: 100,
        faults,
    };
    let out = run_cluster(world, opts, |c| {
        c.set_wire(wire);
        let mut buf = input(c.rank(), len);
        c.all_reduce_mean(&mut buf).unwrap();
        (buf, c.sent_bytes().get())
    });
    let sent = out.iter().map(|(_, s)| s).sum();
    (out.into_iter().map(|(b, _)| b).collect(), sent)
}

#[test]
fn the_transport_does_not_change_the_bits_and_compact_formats_send_less() {
    let (world, len) = (4, 5000);
    let (_, f32_sent) = over_mem(Wire::F32, world, len);
    for wire in COMPACT {
        let (got, sent) = over_mem(wire, world, len);
        let want = local(RingOp::AllReduce(Reduce::Mean), wire, world, len, 100);
        for (r, buf) in got.iter().enumerate() {
            assert_eq!(bits(buf), bits(&want[r]), "{wire}: rank {r} over the in-memory ring");
        }
        // The in-memory ring counts payload bytes only.
        match wire {
            Wire::Bf16 => assert_eq!(2 * sent, f32_sent, "bf16 halves the bytes"),
            _ => assert!(10 * sent < 3 * f32_sent, "int8: {sent} bytes against f32's {f32_sent}"),
        }
    }
}

#[test]
fn quic_ranks_end_with_the_bits_of_the_reference_ring() {
    let (world, len) = (3, 70_000);
    for wire in COMPACT {
        let sock = UdpSocket::bind("127.0.0.1:0").unwrap();
        let master = sock.local_addr().unwrap();
        let mut sock = Some(sock);
        let results: Vec<(Vec<f32>, Vec<f32>, u64)> = std::thread::scope(|s| {
            let handles: Vec<_> = (0..world)
                .map(|rank| {
                    let sock = if rank == 0 { sock.take() } else { None };
                    s.spawn(move || {
                        let mut cfg = QuicConfig::new(rank, world, master);
                        cfg.secret = Some(b"wire format test".to_vec());
                        cfg.timeout = Duration::from_secs(60);
                        cfg.rendezvous_timeout = Duration::from_secs(60);
                        let mut q = match sock {
                            Some(sock) => QuicCollective::connect_with_socket(cfg, sock),
                            None => QuicCollective::connect(cfg),
                        }
                        .unwrap();
                        let mut exact = input(rank, len);
                        q.all_reduce_sum(&mut exact).unwrap();
                        let f32_sent = q.sent_bytes().get();
                        q.set_wire(wire);
                        let mut buf = input(rank, len);
                        q.all_reduce_sum(&mut buf).unwrap();
                        (buf, exact, q.sent_bytes().get() - f32_sent)
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        let sub_chunk = QuicConfig::new(0, world, "127.0.0.1:1".parse().unwrap()).sub_chunk;
        let want = local(RingOp::AllReduce(Reduce::Sum), wire, world, len, sub_chunk);
        let f32_ring = local(RingOp::AllReduce(Reduce::Sum), Wire::F32, world, len, sub_chunk);
        for (r, (got, exact, _)) in results.iter().enumerate() {
            assert_eq!(bits(got), bits(&want[r]), "{wire}: rank {r} over QUIC");
            assert_eq!(bits(exact), bits(&f32_ring[r]), "f32: rank {r} over QUIC");
        }
        // Every frame has a 48-byte header; the payloads shrink by the format's ratio.
        let f32_payload = (2 * (world - 1) * len * 4 / world) as u64;
        for (r, (_, _, sent)) in results.iter().enumerate() {
            let ratio = *sent as f64 / f32_payload as f64;
            let (lo, hi) = match wire {
                Wire::Bf16 => (0.49, 0.51),
                _ => (0.25, 0.28),
            };
            assert!(
                lo < ratio && ratio < hi,
                "{wire}: rank {r} sent {sent} bytes, {ratio:.3} of f32"
            );
        }
    }
}

/// `world` in-memory ranks train `opts` to its last step: per rank and step, the loss, the bytes sent and
/// the replica's fingerprint.
fn train_ranks(world: usize, opts: &TrainOptions) -> Vec<Vec<(f32, u64, String)>> {
    std::thread::scope(|s| {
        let handles: Vec<_> = mem_cluster(world, MemOptions::default())
            .into_iter()
            .map(|comm| {
                s.spawn(move || {
                    let data = load_splits("synthetic", None, TokenizerKind::Byte).unwrap();
                    let (be, _) = factory::open(BackendChoice::Cpu, 0).unwrap();
                    let source = ModelSource::Fresh(ModelConfig::tiny());
                    let mut t = Trainer::new(be, source, data, opts.clone(), Box::new(comm)).unwrap();
                    let mut out = Vec::new();
                    while t.step() < opts.steps {
                        let m = t.train_step().unwrap();
                        out.push((m.loss as f32, m.sent_bytes, t.param_hash().unwrap()));
                    }
                    out
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

fn train(world: usize, wire: Wire, update: UpdateMode) -> Vec<Vec<(f32, u64, String)>> {
    let opts = TrainOptions {
        update,
        wire,
        ..common::tiny_options(4)
    };
    train_ranks(world, &opts)
}

#[test]
fn training_with_a_compact_wire_keeps_replicas_identical_and_sends_less() {
    for update in [UpdateMode::Replicated, UpdateMode::Sharded] {
        let plain = train(3, Wire::F32, update);
        for wire in COMPACT {
            let ranks = train(3, wire, update);
            for (step, ((loss, sent, hash), (f32_loss, f32_sent, _))) in ranks[0].iter().zip(&plain[0]).enumerate() {
                for other in &ranks[1..] {
                    assert_eq!(&other[step].2, hash, "{wire} {update:?} step {step}: replicas differ");
                }
                assert!(
                    (loss - f32_loss).abs() <= 2e-3 * f32_loss.abs(),
                    "{wire} {update:?} step {step}: loss {loss} against f32's {f32_loss}"
                );
                if update == UpdateMode::Replicated {
                    let ratio = *sent as f64 / *f32_sent as f64;
                    let hi = if wire == Wire::Bf16 { 0.51 } else { 0.28 };
                    assert!(ratio < hi, "{wire} step {step}: sent {sent} against f32's {f32_sent}");
                }
            }
            // The sharded update's parameter all-gather stays f32 and overlaps the next step's forward, so
            // a step's count depends on when it was read: compare whole runs.
            let total = |run: &[(f32, u64, String)]| run.iter().map(|s| s.1).sum::<u64>();
            assert!(
                total(&ranks[0]) < total(&plain[0]),
                "{wire} {update:?}: sent more than f32"
            );
            assert_ne!(
                ranks[0].last().unwrap().2,
                plain[0].last().unwrap().2,
                "{wire} rounds something"
            );
        }
    }
}

/// `--sync outer` reduces its pseudo-gradients in the compact format: the ranks hold the same bits after
/// every outer step.
#[test]
fn outer_steps_in_a_compact_format_end_with_identical_replicas() {
    let opts = TrainOptions {
        update: UpdateMode::Replicated,
        sync: SyncMode::Outer(OuterOptions {
            every: 2,
            lr: 0.7,
            momentum: 0.9,
            overlap: false,
        }),
        wire: Wire::Int8,
        ..common::tiny_options(4)
    };
    let ranks: Vec<Vec<String>> = train_ranks(3, &opts)
        .into_iter()
        .map(|steps| steps.into_iter().map(|(_, _, hash)| hash).collect())
        .collect();
    for outer_step in [1, 3] {
        assert!(
            ranks.iter().all(|r| r[outer_step] == ranks[0][outer_step]),
            "after step {}",
            outer_step + 1
        );
    }
    assert_ne!(ranks[0][0], ranks[1][0], "between outer steps the ranks differ");
}

#[test]
fn the_wire_format_is_in_the_job_hash_and_named_on_the_command_line() {
    let model = ModelConfig::tiny();
    let base = common::tiny_options(4);
    let hashes: Vec<u64> = [Wire::F32, Wire::Bf16, Wire::Int8]
        .into_iter()
        .map(|wire| TrainOptions { wire, ..base.clone() }.job_hash(&model, 2))
        .collect();
    assert!(hashes[0] != hashes[1] && hashes[1] != hashes[2] && hashes[0] != hashes[2]);
    common::fails_with_all(
        &["train", "--model", "tiny", "--steps", "1", "--wire", "fp8"],
        &["--wire", "fp8", "f32, bf16, int8"],
    );
}
