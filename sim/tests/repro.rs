//! Bit-reproducibility: the same seed and options give the same losses, the same parameter bits and the
//! same predicted times run to run; another seed gives other bits (so the comparison can fail); the
//! in-memory ring and QUIC on loopback give bit-identical parameters for the same run, in both update
//! modes.

use ringtrain::backend::factory::BackendChoice;
use ringtrain::backend::testing::wgpu_available;
use ringtrain::model::ModelConfig;
use ringtrain::trainer::UpdateMode;
use ringtrain_sim::{Cluster, ClusterRun, Transport};

fn cluster(workers: usize, update: UpdateMode, seed: u64) -> Cluster {
    let model = ModelConfig {
        n_layer: 1,
        ..ModelConfig::tiny()
    };
    Cluster::new(workers)
        .model(model)
        .batch(2)
        .seq_len(16)
        .update(update)
        .seed(seed)
}

/// Every rank's fingerprint at every step.
fn hashes(run: &ClusterRun) -> Vec<Vec<String>> {
    run.steps.iter().map(|s| s.hashes.clone()).collect()
}

#[test]
fn same_seed_and_flags_give_the_same_bits_and_predicted_times() -> anyhow::Result<()> {
    let timed = || -> anyhow::Result<Cluster> {
        Ok(cluster(3, UpdateMode::Sharded, 7)
            .grad_accum(2)
            .network("100gbe-quic")?
            .compute_ms(3.0, 6.0, 1.0))
    };
    let first = timed()?.run(3)?;
    let second = timed()?.run(3)?;
    // Whole records: losses, hashes, skips, the single worker's loss and the prediction, to the bit.
    assert_eq!(first.steps, second.steps);
    assert!(first.steps.iter().all(|s| s.predicted.is_some()));
    let other_seed = cluster(3, UpdateMode::Sharded, 8).grad_accum(2).run(3)?;
    assert_ne!(
        first.final_hash(),
        other_seed.final_hash(),
        "another seed must change the bits"
    );
    Ok(())
}

#[test]
fn mem_and_quic_give_bit_identical_parameters() -> anyhow::Result<()> {
    for update in [UpdateMode::Sharded, UpdateMode::Replicated] {
        let mem = cluster(3, update, 11).transport(Transport::Mem).run(3)?;
        let quic = cluster(3, update, 11).transport(Transport::Quic).run(3)?;
        assert!(mem.replicas_identical() && quic.replicas_identical(), "{update:?}");
        assert_eq!(hashes(&mem), hashes(&quic), "{update:?}: mem and quic differ");
        assert_eq!(mem.steps, quic.steps, "{update:?}: losses differ");
    }
    Ok(())
}

#[test]
fn mixed_backends_rerun_to_the_same_bits() -> anyhow::Result<()> {
    if !wgpu_available() {
        return Ok(());
    }
    let mixed = || cluster(2, UpdateMode::Sharded, 5).backends(&[BackendChoice::Cpu, BackendChoice::Wgpu]);
    let first = mixed().run(2)?;
    let second = mixed().run(2)?;
    assert!(first.replicas_identical());
    assert_eq!(first.steps, second.steps);
    Ok(())
}
