//! The sim's network model: the ring's virtual time against the α-β(-γ) closed forms, with and without
//! sub-chunk pipelining; bucket overlap against a hand-built schedule; a 1024-rank gpt2 prediction.

use ringtrain::collective::ring::{run_local_with, Reduce, RingEngine, RingOp};
use ringtrain::collective::Wire;
use ringtrain::model::ModelConfig;
use ringtrain::trainer::{TrainOptions, UpdateMode};
use ringtrain_sim::netmodel::network::{Link, Network};
use ringtrain_sim::netmodel::predict_step;
use ringtrain_sim::netmodel::profile::{ComputeProfile, Segment};
use ringtrain_sim::netmodel::ring::{simulate, ModelSend, RingKind, RingShape};
use ringtrain_sim::netmodel::schedule::{predict, StepPlan};
use std::time::Instant;

fn uniform(alpha: f64, beta: f64, gamma: f64) -> Network {
    Network::uniform(
        "test",
        Link {
            latency_s: alpha,
            bandwidth_bytes_per_s: beta,
            cpu_s_per_byte: gamma,
        },
    )
}

fn close(got: f64, want: f64) -> bool {
    (got - want).abs() <= 1e-9 * want.abs().max(1e-12)
}

/// Without sub-chunking (one message per chunk) an all-reduce of S bytes takes
/// 2(N-1)·α + 2(N-1)/N·S·(1/β + γ) on every rank; reduce-scatter and all-gather take half.
#[test]
fn ring_time_matches_alpha_beta_gamma() {
    for n in [2usize, 3, 8, 64] {
        for (alpha, beta, gamma) in [
            (1e-3, 1.25e9, 0.0),
            (30e-3, 1.25e8, 0.0),
            (2e-6, 1.25e10, 1.1e-9),
            (0.0, 1e9, 0.0),
        ] {
            for elems in [n * 1000, n * 250_000] {
                let net = uniform(alpha, beta, gamma);
                let s = (elems * 4) as f64;
                let shape = |kind| RingShape {
                    kind,
                    elems,
                    elem_bytes: 4,
                    wire: Wire::F32,
                    sub_chunk: elems, // one sub-chunk per chunk
                };
                let per_hop = alpha + s / n as f64 * (1.0 / beta + gamma);
                let all_reduce = 2.0 * (n - 1) as f64 * per_hop;
                let expected = [
                    (RingKind::AllReduce, all_reduce),
                    (RingKind::ReduceScatter, all_reduce / 2.0),
                    (RingKind::AllGather, all_reduce / 2.0),
                ];
                for (kind, want) in expected {
                    let done = simulate(&net, &shape(kind), &vec![0.0; n]);
                    for (rank, got) in done.iter().enumerate() {
                        assert!(
                            close(*got, want),
                            "{kind:?} N={n} α={alpha} β={beta} γ={gamma} S={s}: rank {rank} {got} != {want}"
                        );
                    }
                }
            }
        }
    }
}

/// With m sub-chunks of s bytes per chunk (t = s/β + s·γ per message) and P phases:
/// T = max(P·m·t + α, (m-1)·t + P·(α + t)). Pipelining hides all but one α when the link is the
/// bottleneck, and all but one sub-chunk's transfer per phase when latency is.
#[test]
fn sub_chunk_pipelining_matches_the_pipelined_formula() {
    for n in [2usize, 4, 16] {
        for m in [1usize, 2, 8, 32] {
            for (alpha, beta, gamma) in [(1e-3, 1.25e9, 0.0), (50e-6, 1.25e9, 1e-9), (30e-3, 1.25e8, 0.0)] {
                let sub = 4096;
                let elems = n * m * sub;
                let net = uniform(alpha, beta, gamma);
                let t = (sub * 4) as f64 * (1.0 / beta + gamma);
                let shape = RingShape {
                    kind: RingKind::AllReduce,
                    elems,
                    elem_bytes: 4,
                    wire: Wire::F32,
                    sub_chunk: sub,
                };
                let p = 2.0 * (n - 1) as f64;
                let mf = m as f64;
                let want = (p * mf * t + alpha).max((mf - 1.0) * t + p * (alpha + t));
                let done = simulate(&net, &shape, &vec![0.0; n]);
                assert!(close(done[0], want), "N={n} m={m} α={alpha}: {} != {want}", done[0]);
                if m > 1 && alpha > (mf - 1.0) * t {
                    let unpipelined = p * (alpha + mf * t);
                    assert!(done[0] < unpipelined, "pipelining must beat whole-chunk messages");
                }
            }
        }
    }
}

/// Two-tier fabric (hosts of `g` ranks in ring order, no sub-chunking): each rank's last receive ends a
/// chain through the N-1 hops before it, so the chain's sum is a lower bound (a rank whose slow send has
/// not left yet delays the next phase, so it is not exact); the same ring with every hop inter-host is an
/// upper bound, and the fast hops must make a real difference.
#[test]
fn two_tier_ring_lies_between_its_chain_and_the_all_slow_ring() {
    let (n, g) = (8usize, 4usize);
    let inter = Link {
        latency_s: 1e-3,
        bandwidth_bytes_per_s: 1.25e8,
        cpu_s_per_byte: 0.0,
    };
    let intra = Link {
        latency_s: 1e-6,
        bandwidth_bytes_per_s: 1e10,
        cpu_s_per_byte: 0.0,
    };
    let net = Network {
        name: "two tiers".into(),
        inter,
        intra: Some((g, intra)),
        shared_cores: None,
        rank_cpu_s_per_byte: None,
    };
    let elems = n * 10_000;
    let chunk = (elems / n * 4) as f64;
    let shape = RingShape {
        kind: RingKind::AllGather,
        elems,
        elem_bytes: 4,
        wire: Wire::F32,
        sub_chunk: elems,
    };
    let done = simulate(&net, &shape, &vec![0.0; n]);
    let all_slow = simulate(&Network::uniform("slow", inter), &shape, &vec![0.0; n]);
    let hop = |l: &Link| l.latency_s + l.occupancy_s(chunk);
    for (rank, got) in done.iter().enumerate() {
        // The chain into `rank` uses every hop except the one leaving `rank`.
        let chain = 2.0 * hop(&inter) + 6.0 * hop(&intra) - hop(&net.hop(rank, n));
        assert!(*got >= chain * (1.0 - 1e-12), "rank {rank}: {got} < chain {chain}");
        assert!(
            *got < 0.7 * all_slow[rank],
            "rank {rank}: {got} vs all slow {}",
            all_slow[rank]
        );
    }
}

fn flat_profile(forward: f64, backward_segments: &[(usize, f64)], update: f64) -> ComputeProfile {
    ComputeProfile {
        forward: vec![Segment {
            bound: usize::MAX,
            seconds: forward,
        }],
        backward: backward_segments
            .iter()
            .map(|&(bound, seconds)| Segment { bound, seconds })
            .collect(),
        update_s: update,
        source: "hand-built".into(),
    }
}

/// Replicated, two buckets: the exposed time is what communication runs past the end of backward.
#[test]
fn exposed_time_is_the_communication_tail_after_backward() {
    let n = 4;
    let alpha = 1e-3;
    let beta = 4e6; // 4 MB/s: a 1 MB bucket all-reduce takes 6·(α + 0.25 MB/β) = 6·63.5 ms = 381 ms
    let net = uniform(alpha, beta, 0.0);
    let ar = |elems: usize| 6.0 * (alpha + (elems * 4 / n) as f64 / beta);
    let bucket = 250_000; // 1 MB
                          // One message per chunk (sub-chunk = bucket), so the closed form holds.
    let plan = StepPlan::equal(
        vec![bucket..2 * bucket, 0..bucket],
        UpdateMode::Replicated,
        n,
        1,
        bucket,
        100,
    );
    let scalars = 3.0 * (alpha + 16.0 / beta);
    for (first_ready, tail) in [(0.1, 0.6), (0.1, 0.05), (0.9, 0.05)] {
        // Backward: bucket 0 (the end of the layout) is final after `first_ready`, bucket 1 `tail` later.
        let profile = flat_profile(0.2, &[(bucket, first_ready), (0, tail)], 0.0);
        let p = predict(&net, &plan, &profile);
        let backward_end = first_ready + tail;
        let comm_end = (first_ready + ar(bucket)).max(backward_end) + ar(bucket);
        let want_exposed = (comm_end - backward_end).max(0.0) + scalars;
        assert!(
            close(p.exposed_s, want_exposed),
            "ready {first_ready}, tail {tail}: exposed {} != {want_exposed}",
            p.exposed_s
        );
        assert!(close(p.step_s, 0.2 + backward_end + want_exposed));
        assert!(close(p.comm_s, 2.0 * ar(bucket) + scalars));
        assert!(close(p.tokens_per_s, 400.0 / p.step_s));
    }
}

/// Sharded: the parameter gathers issued after the update overlap the next forward, which waits only for
/// what it reads.
#[test]
fn sharded_gathers_overlap_the_next_forward() {
    let n = 2;
    let net = uniform(0.0, 1e6, 0.0);
    let bucket = 250_000; // 1 MB: reduce-scatter or all-gather over 2 ranks = 0.5 s
    let plan = StepPlan::equal(
        vec![bucket..2 * bucket, 0..bucket],
        UpdateMode::Sharded,
        n,
        1,
        bucket,
        1,
    );
    // Forward reads bucket 1 (0..bucket) first for 2 s, then bucket 0: gathers of 0.5 s each hide fully.
    let mut profile = flat_profile(0.0, &[(bucket, 3.0), (0, 3.0)], 0.0);
    profile.forward = vec![
        Segment {
            bound: bucket,
            seconds: 2.0,
        },
        Segment {
            bound: 2 * bucket,
            seconds: 2.0,
        },
    ];
    let p = predict(&net, &plan, &profile);
    let scalars = 16.0 / 1e6;
    // Exposed: the last bucket's reduce-scatter after backward, the scalars, and the first gather that
    // forward waits for at its start.
    let want = 0.5 + scalars + 0.5;
    assert!(close(p.exposed_s, want), "exposed {} != {want}", p.exposed_s);
}

/// Shared cores: R ranks on C < R cores compute R/C times slower, and a step is never shorter than the
/// machine's CPU work over its cores; with a core per rank and no CPU per byte nothing changes.
#[test]
fn shared_cores_slow_compute_and_bound_the_step() {
    let bucket = 250_000; // 1 MB
    let plan = |world| {
        StepPlan::equal(
            vec![bucket..2 * bucket, 0..bucket],
            UpdateMode::Replicated,
            world,
            1,
            bucket,
            1,
        )
    };
    let profile = flat_profile(0.2, &[(bucket, 0.3), (0, 0.3)], 0.1);
    let compute = 0.2 + 0.6 + 0.1;
    let with_cores = |mut net: Network, cores| {
        net.shared_cores = Some(cores);
        net
    };
    // A fast link without CPU cost: 4 ranks on 2 cores take twice the compute, on 4 cores what they take
    // with cores of their own.
    let fast = uniform(0.0, 1e12, 0.0);
    let own = predict(&fast, &plan(4), &profile);
    let halved = predict(&with_cores(fast.clone(), 2), &plan(4), &profile);
    let enough = predict(&with_cores(fast.clone(), 4), &plan(4), &profile);
    assert!(close(halved.compute_s, 2.0 * compute), "compute {}", halved.compute_s);
    // The link's few microseconds are not stretched: only the compute doubles.
    assert!(
        close(halved.step_s, own.step_s + compute),
        "{} vs {} + {compute}",
        halved.step_s,
        own.step_s
    );
    assert_eq!(enough.step_s, own.step_s);
    assert!(close(halved.cpu_floor_s, 2.0 * compute));
    // CPU per byte on a fast link: 2 ranks with a core each still share them with the communication.
    // Replicated at N = 2, each rank sends 2(N-1)/N of the 2 MB gradient and (N-1)/N of the 32-byte gather of
    // the scalars (two f64 per rank).
    let gamma = 1e-7;
    let costly = uniform(0.0, 1e12, gamma);
    let sent = 2_000_000.0 + 16.0;
    let bound = predict(&with_cores(costly.clone(), 2), &plan(2), &profile);
    assert!(
        close(bound.cpu_floor_s, compute + gamma * sent),
        "floor {}",
        bound.cpu_floor_s
    );
    assert!(bound.step_s >= bound.cpu_floor_s - 1e-12);
    let unbound = predict(&costly, &plan(2), &profile);
    assert!(bound.step_s > unbound.step_s);
    // The bound lengthens compute, as the trainer would measure it, not the exposed communication.
    assert!(
        close(bound.exposed_s, unbound.exposed_s),
        "{} vs {}",
        bound.exposed_s,
        unbound.exposed_s
    );
    assert!(close(bound.compute_s + bound.exposed_s, bound.step_s));
    // A rank's CPU per byte given apart from the sender's γ: only the bound moves.
    let mut apart = with_cores(costly.clone(), 2);
    apart.rank_cpu_s_per_byte = Some(3.0 * gamma);
    let apart = predict(&apart, &plan(2), &profile);
    assert!(
        close(apart.cpu_floor_s, compute + 3.0 * gamma * sent),
        "floor {}",
        apart.cpu_floor_s
    );
    assert!(close(apart.comm_s, bound.comm_s));
}

/// The scale: 1024 ranks of gpt2 in a few seconds (given compute, so no model runs here).
#[test]
fn gpt2_on_1024_workers_predicts_quickly() {
    let model = ModelConfig::gpt2();
    let options = TrainOptions {
        batch_size: 4,
        seq_len: 64,
        update: UpdateMode::Sharded,
        ..TrainOptions::for_model(&model)
    };
    let profile = ComputeProfile::given(&model, 1.0, 2.0, 0.3).unwrap();
    let started = Instant::now();
    let net = Network::parse("10gbe").unwrap();
    let big = predict_step(
        &model,
        &options,
        1024,
        &net,
        &profile,
        ringtrain::collective::ring::DEFAULT_SUB_CHUNK,
    )
    .unwrap();
    let took = started.elapsed();
    assert!(took.as_secs() < 60, "took {took:?}");
    let small = predict_step(
        &model,
        &options,
        8,
        &net,
        &profile,
        ringtrain::collective::ring::DEFAULT_SUB_CHUNK,
    )
    .unwrap();
    // More ranks: the same compute, more tokens, at least as much latency.
    assert!(big.step_s >= small.step_s);
    assert!(big.tokens_per_s > 100.0 * small.tokens_per_s);
    assert!(big.compute_s > 3.0 && big.exposed_s > 0.0);
}

/// `shared-cores` on the command line: four ranks on two cores report the slowed compute and the bound.
#[test]
fn timing_only_command_reports_shared_cores() {
    let run = |network: &str| {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_ringtrain-sim"))
            .args([
                "--timing-only",
                "--workers",
                "4",
                "--model",
                "tiny",
                "--network",
                network,
            ])
            .args(["--compute-ms", "forward=10,backward=20,update=2"])
            .output()
            .unwrap();
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    let step = |stdout: &str| -> f64 {
        let line = stdout.lines().find(|l| l.starts_with("predicted step")).unwrap();
        let ms = line.split("| step ").nth(1).unwrap().split(" ms").next().unwrap();
        ms.parse().unwrap()
    };
    let own = run("latency=10us,bandwidth=10Gbit");
    let shared = run("latency=10us,bandwidth=10Gbit,shared-cores=2,rank-cpu-per-byte=1ns");
    assert!(!own.contains("shared cores"), "{own}");
    let line = shared
        .lines()
        .find(|l| l.starts_with("shared cores"))
        .expect("a shared-cores line");
    assert!(
        line.contains("4 ranks per machine of 2 cores") && line.contains("compute slowed 2.00x"),
        "{line}"
    );
    // 32 ms of compute per rank, twice as long on half a core each: the step grows by at least 30 ms.
    assert!(step(&shared) > step(&own) + 30.0, "{own}\n{shared}");
}

#[test]
fn bad_inputs_are_errors() {
    let model = ModelConfig::tiny();
    let options = TrainOptions::for_model(&model);
    let profile = ComputeProfile::given(&model, 0.01, 0.02, 0.0).unwrap();
    let net = Network::parse("wan").unwrap();
    assert!(predict_step(&model, &options, 0, &net, &profile, 1024).is_err());
    assert!(predict_step(&model, &options, 100_000, &net, &profile, 1024).is_err());
    assert!(predict_step(&model, &options, 4, &net, &profile, 0).is_err());
}

/// The acceptance command, with given compute so that no model runs: it prints its prediction
/// well within 5 minutes, and the flags' errors are named.
#[test]
fn timing_only_command_prints_a_prediction_for_1024_workers() {
    let bin = env!("CARGO_BIN_EXE_ringtrain-sim");
    let started = Instant::now();
    let out = std::process::Command::new(bin)
        .args([
            "--timing-only",
            "--workers",
            "1024",
            "--model",
            "gpt2",
            "--network",
            "wan",
        ])
        .args(["--compute-ms", "forward=20,backward=40,update=3", "--bucket-mb", "50"])
        .output()
        .unwrap();
    let took = started.elapsed();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{stdout}{}", String::from_utf8_lossy(&out.stderr));
    let line = stdout
        .lines()
        .find(|l| l.starts_with("predicted step"))
        .expect("a prediction line");
    for field in [
        "workers 1024",
        "compute",
        "communication",
        "exposed communication",
        "step",
        "tokens/s",
    ] {
        assert!(line.contains(field), "{field} missing: {line}");
    }
    assert!(took.as_secs() < 60, "took {took:?}");
    for (args, says) in [
        (vec!["--timing-only"], "needs --network"),
        (vec!["--network", "wan"], "only apply with --timing-only"),
        (vec!["--bucket-mb", "5"], "only apply with --timing-only"),
        (
            vec!["--timing-only", "--network", "token-ring"],
            "unknown network preset",
        ),
        (
            vec!["--timing-only", "--network", "wan", "--compute-ms", "forward=1"],
            "both required",
        ),
        (
            vec![
                "--timing-only",
                "--network",
                "wan",
                "--compute-ms",
                "forward=1,backward=x",
            ],
            "not a number",
        ),
        (
            vec!["--timing-only", "--network", "wan", "--bucket-mb", "0"],
            "positive",
        ),
    ] {
        let out = std::process::Command::new(bin).args(&args).output().unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success() && stderr.contains(says), "{args:?}: {stderr}");
    }
}

/// Every message each rank's real ring engine hands out, in order, run to completion in one thread with
/// FIFO delivery (`collective::ring::run_local_with`): (phase, chunk, sub, bytes) per rank.
fn engine_sends(op: RingOp, world: usize, elems: usize, sub_chunk: usize, wire: Wire) -> Vec<Vec<ModelSend>> {
    let mut bufs: Vec<Vec<f32>> = (0..world).map(|r| vec![r as f32; elems]).collect();
    let mut engines: Vec<RingEngine> = bufs
        .iter_mut()
        .enumerate()
        .map(|(r, b)| RingEngine::new(op, r, world, b, sub_chunk).unwrap().with_wire(wire))
        .collect();
    let mut sent = vec![Vec::new(); world];
    run_local_with(&mut engines, |r, m| {
        sent[r].push(ModelSend {
            phase: m.phase as usize,
            chunk: m.chunk as usize,
            sub: m.sub as usize,
            bytes: m.payload.len_bytes(),
        })
    })
    .unwrap();
    sent
}

/// The model times the messages the real engine sends: for every collective kind, world size, uneven
/// chunks and sub-chunk size, each rank's messages (phase, chunk, sub-chunk, bytes) in order are the
/// model's schedule.
#[test]
fn the_model_times_the_messages_the_real_ring_sends() {
    let kinds = [
        (RingKind::AllReduce, RingOp::AllReduce(Reduce::Mean)),
        (RingKind::ReduceScatter, RingOp::ReduceScatter(Reduce::Mean)),
        (RingKind::AllGather, RingOp::AllGather),
    ];
    for (kind, op) in kinds {
        for world in 2..=5 {
            for (elems, sub_chunk) in [(1usize, 1usize), (10, 3), (97, 8), (1000, 1000), (4099, 64), (300, 200)] {
                for wire in [Wire::F32, Wire::Bf16, Wire::Int8] {
                    let shape = RingShape {
                        kind,
                        elems,
                        elem_bytes: 4,
                        wire,
                        sub_chunk,
                    };
                    let engine = engine_sends(op, world, elems, sub_chunk, wire);
                    for (rank, got) in engine.iter().enumerate() {
                        assert_eq!(
                            *got,
                            shape.sends(world, rank),
                            "{kind:?} in {wire}, {world} ranks, {elems} elements in sub-chunks of {sub_chunk}: \
                             rank {rank}"
                        );
                    }
                }
            }
        }
    }
}

#[test]
fn presets_price_ringtrains_own_path_not_nvlink() {
    use ringtrain_sim::netmodel::network::{QUIC_CPU_S_PER_BYTE, SHM_CPU_S_PER_BYTE};
    use ringtrain_sim::netmodel::predict_all_reduce;
    let dgx = Network::parse("dgx").unwrap();
    // Ranks 0 → 1 share a host (shared memory); rank 7 → 8 crosses to the next host (QUIC).
    assert_eq!(dgx.hop(0, 16).cpu_s_per_byte, SHM_CPU_S_PER_BYTE);
    assert_eq!(dgx.hop(7, 16).cpu_s_per_byte, QUIC_CPU_S_PER_BYTE);
    for name in ["10gbe", "ib-hdr100", "100gbe-quic", "wan"] {
        assert_eq!(
            Network::parse(name).unwrap().inter.cpu_s_per_byte,
            QUIC_CPU_S_PER_BYTE,
            "{name}"
        );
    }
    // gpt2's gradient (124,439,808 f32) all-reduced by the 8 ranks of one node: each rank sends
    // 2 × 7/8 of 498 MB through shared memory, at least 183 ms of copying at the measured cost.
    let secs = predict_all_reduce(
        &dgx,
        ringtrain_sim::netmodel::Layout::Flat,
        8,
        124_439_808,
        ringtrain::collective::ring::DEFAULT_SUB_CHUNK,
        Wire::F32,
    );
    assert!(secs > 0.15, "dgx all-reduce of gpt2 predicted in {:.1} ms", secs * 1e3);
    let with_intra = Network::parse(
        "latency=20us,bandwidth=10Gbit,cpu-per-byte=1ns,hosts-of=2,intra-latency=1us,intra-bandwidth=100GB,\
         intra-cpu-per-byte=0.2ns",
    )
    .unwrap();
    assert!((with_intra.hop(0, 4).cpu_s_per_byte - 0.2e-9).abs() < 1e-15);
    assert!((with_intra.hop(1, 4).cpu_s_per_byte - 1e-9).abs() < 1e-15);
    assert!(Network::parse("latency=1us,bandwidth=1GB,intra-cpu-per-byte=1ns").is_err());
}

#[test]
fn the_two_level_ring_spares_the_network_as_its_byte_count_says() {
    use ringtrain::collective::ring::DEFAULT_SUB_CHUNK;
    use ringtrain::collective::CollectiveChoice;
    use ringtrain_sim::netmodel::{predict_all_reduce, Layout};
    // 2 hosts of 4 ranks; the hosts' link is 1000x slower than shared memory, with no CPU cost, so the
    // network's bytes decide: 2(N-1)/N = 1.75 of the buffer through one link on the flat ring, 2(H-1)/H = 1
    // through each host's link (shared by its 4 cross rings) on two levels.
    let net = Network::parse(
        "latency=1us,bandwidth=1Gbit,hosts-of=4,intra-latency=1us,intra-bandwidth=1000Gbit,intra-cpu-per-byte=0ns",
    )
    .unwrap();
    let two = Layout::resolve(CollectiveChoice::Auto, &net, 8).unwrap();
    assert_eq!(two, Layout::TwoLevel { per_host: 4 });
    let elems = 16 << 20;
    let flat_s = predict_all_reduce(&net, Layout::Flat, 8, elems, DEFAULT_SUB_CHUNK, Wire::F32);
    let two_s = predict_all_reduce(&net, two, 8, elems, DEFAULT_SUB_CHUNK, Wire::F32);
    let wire_s = (elems * 4) as f64 / 125e6;
    assert!(
        (flat_s / wire_s - 1.75).abs() < 0.05,
        "flat {flat_s} s, wire {wire_s} s"
    );
    assert!(
        (two_s / wire_s - 1.0).abs() < 0.05,
        "two-level {two_s} s, wire {wire_s} s"
    );
    // A compact wire format shrinks what crosses the network by its ratio: on two levels only the cross
    // ring rounds, and the host rings (1000x faster here) keep f32.
    for (wire, ratio) in [(Wire::Bf16, 0.5), (Wire::Int8, 68.0 / 256.0)] {
        let flat = predict_all_reduce(&net, Layout::Flat, 8, elems, DEFAULT_SUB_CHUNK, wire);
        let two = predict_all_reduce(&net, two, 8, elems, DEFAULT_SUB_CHUNK, wire);
        assert!(
            (flat / flat_s - ratio).abs() < 0.02,
            "{wire} flat: {flat} s against f32's {flat_s} s"
        );
        assert!(
            (two / two_s - ratio).abs() < 0.02,
            "{wire} two-level: {two} s against f32's {two_s} s"
        );
    }
    // What rank 0 of the trainer would refuse, the model refuses; auto falls back to the flat ring.
    for (net, world) in [
        (net.clone(), 4),
        (net.clone(), 6),
        (Network::preset("10gbe").unwrap(), 8),
    ] {
        assert_eq!(
            Layout::resolve(CollectiveChoice::Auto, &net, world).unwrap(),
            Layout::Flat
        );
        let e = Layout::resolve(CollectiveChoice::Hierarchical, &net, world).unwrap_err();
        assert!(e.contains("--collective hierarchical"), "{e}");
    }
}
