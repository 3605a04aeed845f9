//! The virtual cluster: replicas stay bit-identical at every step for world sizes 1–4, both update modes,
//! gradient accumulation and a perturbed in-memory network; the loss equals one worker's on the same global
//! batch up to float reassociation (tolerance 1e-5 absolute; measured ~3e-8); a dropped worker makes every
//! other rank fail with an error naming it instead of hanging.

use ringtrain::backend::factory::BackendChoice;
use ringtrain::backend::testing::wgpu_available;
use ringtrain::fault_plan::FaultPlan;
use ringtrain::model::ModelConfig;
use ringtrain::trainer::{TrainOptions, UpdateMode};
use ringtrain_sim::{run, SimConfig, Transport};
use std::time::Duration;

fn config(workers: usize, update: UpdateMode, grad_accum: usize, faults: FaultPlan) -> SimConfig {
    let model = ModelConfig {
        n_layer: 1,
        ..ModelConfig::tiny()
    };
    let options = TrainOptions {
        batch_size: 2,
        seq_len: 16,
        grad_accum,
        update,
        eval_every: 0,
        verify_every: 1,
        ..TrainOptions::for_model(&model).with_steps(4)
    };
    SimConfig {
        workers,
        backends: vec![BackendChoice::Cpu],
        model,
        options,
        transport: Transport::Mem,
        faults,
        deadline: Duration::from_secs(20),
        split_replay: None,
    }
}

#[test]
fn replicas_identical_and_loss_matches_single_worker() {
    for workers in 1..=4 {
        for update in [UpdateMode::Sharded, UpdateMode::Replicated] {
            for grad_accum in [1, 2] {
                let report = run(&config(workers, update, grad_accum, FaultPlan::default())).unwrap();
                assert_eq!(
                    report.first_divergence(),
                    None,
                    "{workers} workers, {update:?}, K={grad_accum}"
                );
                let gap = report.max_loss_gap();
                assert!(
                    gap < 1e-5,
                    "{workers} workers, {update:?}, K={grad_accum}: loss gap {gap}"
                );
                assert_eq!(report.ranks[0].losses.len(), 4);
            }
        }
    }
}

#[test]
fn perturbed_network_changes_nothing() {
    let calm = run(&config(3, UpdateMode::Sharded, 1, FaultPlan::default())).unwrap();
    let faults = FaultPlan::parse(&["delay=1", "reorder=42"]).unwrap();
    let noisy = run(&config(3, UpdateMode::Sharded, 1, faults)).unwrap();
    assert_eq!(
        calm.ranks, noisy.ranks,
        "delays and reordering must not change a single bit"
    );
}

#[test]
fn dropped_worker_is_named() {
    let faults = FaultPlan::parse(&["drop=1:5"]).unwrap();
    let err = run(&config(3, UpdateMode::Sharded, 1, faults)).unwrap_err();
    let msg = format!("{err:#}");
    assert!(msg.contains("rank 1"), "error should name rank 1: {msg}");
}

#[test]
fn quic_transport_keeps_replicas_identical() {
    let mut cfg = config(3, UpdateMode::Sharded, 1, FaultPlan::default());
    cfg.transport = Transport::Quic;
    let report = run(&cfg).unwrap();
    assert_eq!(report.first_divergence(), None);
    assert!(report.max_loss_gap() < 1e-5);
}

#[test]
fn shared_memory_links_give_the_bits_of_the_in_memory_ring() {
    for workers in [1, 2, 4] {
        for update in [UpdateMode::Sharded, UpdateMode::Replicated] {
            for overlap in [true, false] {
                let mut cfg = config(workers, update, 1, FaultPlan::default());
                cfg.options.overlap = overlap;
                let mem = run(&cfg).unwrap();
                cfg.transport = Transport::Shm;
                let shm = run(&cfg).unwrap();
                assert_eq!(shm.first_divergence(), None);
                assert_eq!(
                    shm.ranks, mem.ranks,
                    "{workers} workers, {update:?}, overlap {overlap}: shared memory changed a bit"
                );
            }
        }
    }
}

#[test]
fn mixed_cpu_and_wgpu_ranks_stay_bit_identical_with_sharded_update() {
    if !wgpu_available() {
        return;
    }
    let mut cfg = config(2, UpdateMode::Sharded, 1, FaultPlan::default());
    cfg.backends = vec![BackendChoice::Cpu, BackendChoice::Wgpu];
    let report = run(&cfg).unwrap();
    assert_eq!(
        report.first_divergence(),
        None,
        "the sharded update copies each owner's bits"
    );
    assert!(report.max_loss_gap() < 1e-4, "loss gap {}", report.max_loss_gap());
}
