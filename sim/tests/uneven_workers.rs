//! Uneven workers in the sim: `Cluster::worker_speeds` slows workers through the `speed` fault, `auto` gives
//! the slow ones less, a recorded split history replays to the same bits without measuring, and the
//! network prediction times each worker's share at its speed.

use ringtrain::backend::factory::BackendChoice;
use ringtrain::trainer::UpdateMode;
use ringtrain_sim::cluster::Cluster;

#[test]
fn auto_gives_slow_workers_less_and_a_replay_reproduces_the_bits() -> anyhow::Result<()> {
    let cluster = || -> anyhow::Result<Cluster> {
        Cluster::new(3)
            .update(UpdateMode::Sharded)
            .batch(1)
            .batch_split(12, "auto")
    };
    // Workers 1 and 2 at a tenth of worker 0's speed.
    let run = cluster()?.worker_speeds(&[1.0, 0.1, 0.1])?.run(12)?;
    assert!(run.replicas_identical());
    assert!(run.max_loss_gap_to_single_worker() <= 1e-5);
    let history = run.split_history();
    assert_eq!(history.get(&1), Some(&vec![4, 4, 4]), "{history:?}");
    let last = history.values().last().unwrap();
    assert!(last[0] >= 8, "the fast worker has only {last:?}: {history:?}");

    // The same history, followed at full speed without measuring: the same bits at every step.
    let replay = cluster()?.replay_splits(history.clone()).run(12)?;
    for (a, b) in run.steps.iter().zip(&replay.steps) {
        assert_eq!(a.hashes, b.hashes, "step {}", a.step);
    }
    assert_eq!(replay.split_history(), history);
    // A history that does not split the global batch is refused.
    let bad = cluster()?.replay_splits([(1, vec![6, 6, 6])].into()).run(2);
    assert!(format!("{:#}", bad.unwrap_err()).contains("do not split a global batch of 12"));
    Ok(())
}

#[test]
fn the_prediction_times_each_share_at_its_worker_speed() -> anyhow::Result<()> {
    let predicted = |split: &str| -> anyhow::Result<f64> {
        let run = Cluster::new(3)
            .batch(2)
            .batch_split(12, split)?
            .worker_speeds(&[1.0, 0.5, 0.5])?
            .network("latency=1us,bandwidth=100Gbit")?
            .compute_ms(10.0, 20.0, 0.0)
            .run(1)?;
        Ok(run.steps[0].predicted.unwrap().step_s)
    };
    // Even: 4 sequences (2 micro-batches of 30 ms) at half speed: 120 ms. Auto: 6 + 3 + 3, so 90 ms on
    // every worker; communication on this fabric is well under a millisecond.
    let (even, auto) = (predicted("even")?, predicted("auto")?);
    assert!((even - 0.120).abs() < 0.002, "even {even}");
    assert!((auto - 0.090).abs() < 0.002, "auto {auto}");
    Ok(())
}

/// Mixed backends in one job split `auto`: a CPU rank and a wgpu rank, the wgpu one slowed, stay
/// bit-identical (sharded update) while the split moves.
#[test]
fn auto_with_mixed_backends_keeps_the_replicas_identical() -> anyhow::Result<()> {
    if !ringtrain::backend::testing::wgpu_available() {
        return Ok(());
    }
    let run = Cluster::new(2)
        .backends(&[BackendChoice::Cpu, BackendChoice::Wgpu])
        .update(UpdateMode::Sharded)
        .batch(1)
        .batch_split(8, "auto")?
        .worker_speeds(&[1.0, 0.1])?
        .run(10)?;
    assert!(run.replicas_identical());
    assert!(run.max_loss_gap_to_single_worker() <= 1e-4);
    let history = run.split_history();
    assert!(history.values().last().unwrap()[1] <= 3, "{history:?}");
    Ok(())
}
