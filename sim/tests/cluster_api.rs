//! The example of `ringtrain_sim::Cluster` in `docs/sim-and-ci.md` (section "Testing your training setup
//! in CI"), kept verbatim below and checked against the guide, plus the builder's errors, faults and
//! predictions.

use ringtrain::backend::factory::BackendChoice;
use ringtrain::trainer::UpdateMode;
use ringtrain_sim::{Cluster, Transport};

#[test]
fn four_workers_train_like_one() -> anyhow::Result<()> {
    let run = Cluster::new(4)
        .backends(&[BackendChoice::Cpu])
        .update(UpdateMode::Sharded)
        .overlap(true)
        .batch(2)
        .seq_len(16)
        .transport(Transport::Mem)
        .fault("reorder=7")? // messages arrive in a seeded random order
        .network("10gbe")? // predict each step's time on 10 Gb/s Ethernet
        .compute_ms(2.0, 4.0, 0.5) // forward, backward, update per micro-batch
        .seed(1)
        .run(4)?;
    assert!(
        run.replicas_identical(),
        "first divergence: {:?}",
        run.first_divergence()
    );
    assert!(run.max_loss_gap_to_single_worker() < 1e-5);
    for step in &run.steps {
        assert!(!step.skipped);
        let predicted = step.predicted.expect("a network was given");
        assert!(predicted.exposed_s < 0.01, "step {}: {predicted:?}", step.step);
    }
    Ok(())
}

use ringtrain::model::ModelConfig;
use ringtrain_sim::netmodel::StepPrediction;

/// The guide's example must be this file's, character for character (imports and test included).
#[test]
fn guide_example_is_this_file() {
    let guide = include_str!("../../docs/sim-and-ci.md");
    let section = guide
        .split("## Testing your training setup in CI\n")
        .nth(1)
        .expect("docs/sim-and-ci.md has the section \"Testing your training setup in CI\"");
    let example = section
        .split("```rust\n")
        .nth(1)
        .and_then(|s| s.split("```\n").next())
        .expect("the section has a ```rust example");
    let this_file = include_str!("cluster_api.rs");
    assert!(
        this_file.contains(example),
        "docs/sim-and-ci.md's example differs from sim/tests/cluster_api.rs: copy one onto the other"
    );
}

fn small() -> Cluster {
    let model = ModelConfig {
        n_layer: 1,
        ..ModelConfig::tiny()
    };
    Cluster::new(3).model(model).batch(2).seq_len(16)
}

#[test]
fn bad_faults_and_networks_are_errors() {
    let err = |r: anyhow::Result<Cluster>| format!("{:#}", r.expect_err("should be refused"));
    assert!(err(small().fault("nan=one:2")).contains("not a number"));
    assert!(err(small().fault("nan=1:2").and_then(|c| c.fault("inf=0:1"))).contains("given twice"));
    assert!(err(small().fault("melt=1")).contains("melt"));
    assert!(err(small().network("token-ring")).contains("unknown network preset"));
    assert!(err(small().network("latency=1ms")).contains("bandwidth"));
    // Parsed, but does not fit this cluster: refused by run.
    let run_err = |c: Cluster| format!("{:#}", c.run(2).expect_err("should be refused"));
    assert!(run_err(small().fault("nan=5:1").unwrap()).contains("rank 5"));
    assert!(run_err(small().fault("nan=1:9").unwrap()).contains("step 9"));
    assert!(run_err(small().fault("delay=1").unwrap().transport(Transport::Quic)).contains("delay"));
    assert!(run_err(small().backends(&[])).contains("at least one backend"));
    assert!(format!("{:#}", small().run(0).unwrap_err()).contains("at least one step"));
    assert!(format!("{:#}", Cluster::new(0).run(1).unwrap_err()).contains("between 1 and 64"));
}

#[test]
fn nan_fault_skips_the_step_on_every_rank_and_keeps_replicas_identical() -> anyhow::Result<()> {
    let run = small().fault("nan=1:2")?.run(3)?;
    assert!(run.replicas_identical());
    let skipped: Vec<u64> = run.steps.iter().filter(|s| s.skipped).map(|s| s.step).collect();
    assert_eq!(skipped, [2]);
    // Step 2 kept the parameters of step 1; the single worker (no fault) did not skip.
    assert_eq!(run.steps[1].hashes, run.steps[0].hashes);
    assert!((run.steps[0].losses[0] - run.steps[0].single_worker_loss).abs() < 1e-5);
    for step in &run.steps {
        assert_eq!(step.losses.len(), 3);
        assert_eq!(step.hashes.len(), 3);
        assert_eq!(step.predicted, None, "no network was given");
    }
    Ok(())
}

#[test]
fn prediction_follows_the_fabric_and_the_overlap() -> anyhow::Result<()> {
    let predicted = |c: Cluster| -> anyhow::Result<StepPrediction> {
        let run = c.compute_ms(2.0, 4.0, 0.5).run(1)?;
        Ok(run.steps[0].predicted.expect("a network was given"))
    };
    let fast = predicted(small().network("ib-hdr100")?)?;
    let wan = predicted(small().network("wan")?)?;
    // Bandwidth-bound, with buckets small enough to travel while backward runs.
    let slow =
        || -> anyhow::Result<Cluster> { Ok(small().network("latency=1us,bandwidth=20Mbit")?.bucket_elems(4096)) };
    let slow_on = predicted(slow()?)?;
    let slow_off = predicted(slow()?.overlap(false))?;
    let alone = predicted(Cluster::new(1).network("wan")?)?;
    // Given compute: 2 + 4 ms per micro-batch, plus a third of the 0.5 ms update (sharded over 3 ranks).
    assert!((fast.compute_s - (6.0 + 0.5 / 3.0) / 1e3).abs() < 1e-9, "{fast:?}");
    assert!(
        wan.step_s > fast.step_s + 0.03,
        "a 30 ms link shows in the step: {wan:?} vs {fast:?}"
    );
    assert!(
        slow_off.exposed_s > slow_on.exposed_s + 1e-3,
        "overlap off hides nothing: {slow_off:?} vs {slow_on:?}"
    );
    assert!(
        (slow_off.comm_s - slow_on.comm_s).abs() < 1e-9,
        "the same bytes either way"
    );
    assert_eq!(alone.comm_s, 0.0, "one worker does not communicate: {alone:?}");
    assert!(alone.exposed_s < 1e-12, "{alone:?}");
    Ok(())
}

#[test]
fn without_given_compute_the_prediction_measures_rank_0s_backend() -> anyhow::Result<()> {
    let run = small().network("10gbe")?.run(2)?;
    let first = run.steps[0].predicted.expect("a network was given");
    assert!(first.compute_s > 0.0 && first.step_s >= first.compute_s, "{first:?}");
    assert!(
        run.steps.iter().all(|s| s.predicted == Some(first)),
        "one steady-state prediction per run"
    );
    Ok(())
}

#[test]
fn identity_guarantee_follows_the_design() {
    use BackendChoice::{Cpu, Wgpu};
    let c = |n: usize, b: &[BackendChoice], u: UpdateMode| Cluster::new(n).backends(b).update(u);
    assert!(c(3, &[Cpu, Wgpu], UpdateMode::Sharded).identity_guaranteed());
    assert!(c(3, &[Wgpu], UpdateMode::Replicated).identity_guaranteed());
    assert!(!c(3, &[Cpu, Wgpu], UpdateMode::Replicated).identity_guaranteed());
    // One worker uses only the first backend of the cycle.
    assert!(c(1, &[Cpu, Wgpu], UpdateMode::Replicated).identity_guaranteed());
}
