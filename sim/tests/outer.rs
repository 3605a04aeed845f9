//! `--sync outer` in the sim: the workers part between outer steps and agree after every one, under both
//! update modes, and the harness and the trainers check it there.

use ringtrain::trainer::{OuterOptions, UpdateMode};
use ringtrain_sim::cluster::Cluster;

#[test]
fn workers_agree_after_every_outer_step_under_both_update_modes() {
    let outer = OuterOptions {
        every: 3,
        lr: 0.7,
        momentum: 0.9,
        overlap: false,
    };
    let mut finals = Vec::new();
    for update in [UpdateMode::Sharded, UpdateMode::Replicated] {
        let run = Cluster::new(4).update(update).outer_sync(outer).run(9).unwrap();
        assert!(run.replicas_identical(), "{update:?}: {:?}", run.first_divergence());
        // Between outer steps each worker's parameters are its own.
        let step = |s: u64| -> Vec<String> {
            run.report
                .ranks
                .iter()
                .map(|r| r.at(s).unwrap().1.to_string())
                .collect()
        };
        assert!(step(2).windows(2).any(|w| w[0] != w[1]), "{update:?}");
        assert!(step(3).windows(2).all(|w| w[0] == w[1]), "{update:?}");
        finals.push(run.final_hash().to_string());
    }
    assert_eq!(finals[0], finals[1]);
}

/// `--outer-overlap on`: the harness compares the shared parameters at the outer steps, where each worker's
/// device holds its own (the shared ones plus its last round); they agree, and at the end so do the devices.
#[test]
fn overlapped_workers_agree_on_the_shared_parameters_after_every_outer_step() {
    let outer = OuterOptions {
        every: 3,
        lr: 0.7,
        momentum: 0.9,
        overlap: true,
    };
    for update in [UpdateMode::Sharded, UpdateMode::Replicated] {
        let run = Cluster::new(3).update(update).outer_sync(outer).run(9).unwrap();
        assert!(run.replicas_identical(), "{update:?}: {:?}", run.first_divergence());
        let at = |s: u64| -> (Vec<&str>, Vec<&str>) {
            let ranks = &run.report.ranks;
            let device = ranks.iter().map(|r| r.at(s).unwrap().1).collect();
            (device, ranks.iter().map(|r| r.shared_at(s).unwrap()).collect())
        };
        let (device, shared) = at(6);
        assert!(device.windows(2).any(|w| w[0] != w[1]), "{update:?}");
        assert!(shared.windows(2).all(|w| w[0] == w[1]), "{update:?}");
        let (device, shared) = at(9);
        assert!(
            device.windows(2).all(|w| w[0] == w[1]) && device == shared,
            "{update:?}"
        );
    }
}
