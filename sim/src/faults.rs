//! The sim's `--fault KIND=VALUE`: the library's [`FaultPlan`] (every kind, its grammar and its outcome are
//! there and in [`FAULT_HELP`]), checked against the virtual cluster before it runs. Each kind is applied by
//! the transport or the trainer that owns it, or refused naming the transport that can apply it, never
//! ignored.

use anyhow::{bail, ensure, Result};
use ringtrain::fault_plan::Fault;
pub use ringtrain::fault_plan::{FaultPlan, FAULT_HELP};
use ringtrain::model::{ModelConfig, ParamLayout};
use ringtrain::trainer::buckets::BucketPlan;
use ringtrain::trainer::fault_injection::flip_offset;
use ringtrain::trainer::TrainOptions;

use crate::Transport;

/// Parses `--fault` values into a plan (each kind at most once).
pub fn parse_faults(specs: &[String]) -> Result<FaultPlan> {
    FaultPlan::parse(specs).map_err(|e| anyhow::anyhow!("--{e:#}"))
}

/// Refuses a fault that could never fire (a rank the run does not have, a step after the last, a flipped
/// element outside the model or a moment the rank does not keep) or that `transport` cannot apply.
pub fn validate(
    plan: &FaultPlan,
    transport: Transport,
    workers: usize,
    model: &ModelConfig,
    opts: &TrainOptions,
) -> Result<()> {
    // A planned joiner is member `workers`: faults may name it.
    let members = workers + usize::from(plan.join_before().is_some());
    plan.validate(members, opts.steps)
        .map_err(|e| anyhow::anyhow!("--{e:#}"))?;
    for f in plan.faults() {
        if let Fault::Flip {
            rank, target, element, ..
        } = *f
        {
            let layout = ParamLayout::new(model);
            let owned = BucketPlan::new(&layout, opts.bucket_elems)
                .owned(opts.update, &ringtrain::collective::Owner::flat(workers, rank));
            flip_offset(rank, target, element, layout.total, &owned).map_err(|e| anyhow::anyhow!("--fault {e:#}"))?;
        }
    }
    if let Some(f) = plan.faults().iter().find(|f| matches!(f, Fault::Regroup { .. })) {
        bail!(
            "--fault {f} acts on the rendezvous of a real process's re-form (train --elastic over QUIC); the sim's \
             workers re-form through an in-process board (a worker lost during a re-form: kill or drop)"
        );
    }
    if let Some(step) = plan.join_before() {
        ensure!(
            opts.elastic.is_some(),
            "--fault join={step} adds a worker to a running job, which needs --elastic"
        );
        ensure!(
            step >= 2,
            "--fault join={step}: a worker joining before step 1 is a bigger start (--workers)"
        );
    }
    match transport {
        Transport::Quic | Transport::Shm => {
            if let Some(kind) = plan.mem_only_kind() {
                bail!(
                    "--fault {kind} is supported by --transport mem only (QUIC's streams deliver in order on their \
                     own schedule); with --transport quic only duplicate, drop, kill, compute, freeze, nan, inf \
                     and flip apply"
                );
            }
        }
        Transport::Mem => {
            let duplicate = plan.faults().iter().any(|f| matches!(f, Fault::Duplicate { .. }));
            ensure!(
                !duplicate,
                "--fault duplicate is supported by --transport quic only (its replay check refuses the copy; the \
                 in-memory ring has none to exercise)"
            );
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(specs: &[&str]) -> Result<FaultPlan> {
        parse_faults(&specs.iter().map(|s| s.to_string()).collect::<Vec<_>>())
    }

    #[test]
    fn parses_every_kind_and_names_the_flag() {
        let plan = parse(&["delay=2", "reorder=7", "slow=1:3", "drop=2:20", "kill=1:3", "nan=0:2"]).unwrap();
        assert_eq!(plan.faults().len(), 6);
        let err = format!("{:#}", parse(&["kill=1"]).unwrap_err());
        assert!(err.contains("--fault kill=1: expected kill=RANK:STEP"), "{err}");
        let err = format!("{:#}", parse(&["nan=0:1", "inf=1:2"]).unwrap_err());
        assert!(err.contains("--fault inf: given twice"), "{err}");
    }

    #[test]
    fn each_transport_refuses_what_it_cannot_apply() {
        let model = ModelConfig::tiny();
        let opts = TrainOptions::for_model(&model).with_steps(4);
        let check = |specs: &[&str], transport| {
            validate(&parse(specs).unwrap(), transport, 3, &model, &opts).map_err(|e| format!("{e:#}"))
        };
        assert!(check(&["reorder=3"], Transport::Quic)
            .unwrap_err()
            .contains("--transport mem only"));
        assert!(check(&["duplicate=1:3"], Transport::Mem)
            .unwrap_err()
            .contains("--transport quic only"));
        for transport in [Transport::Mem, Transport::Quic] {
            assert!(check(&["regroup=1:1"], transport)
                .unwrap_err()
                .contains("train --elastic"));
        }
        assert!(check(
            &["drop=1:20", "kill=2:3", "compute=0:5", "freeze=1:2:50"],
            Transport::Quic
        )
        .is_ok());
        assert!(check(&["drop=1:20", "kill=2:3", "slow=0:1", "split=4"], Transport::Mem).is_ok());
    }

    #[test]
    fn faults_that_could_never_fire_are_refused() {
        let model = ModelConfig::tiny();
        let opts = TrainOptions {
            update: ringtrain::trainer::UpdateMode::Sharded,
            ..TrainOptions::for_model(&model).with_steps(4)
        };
        let check = |specs: &[&str]| {
            validate(&parse(specs).unwrap(), Transport::Mem, 3, &model, &opts).map_err(|e| format!("{e:#}"))
        };
        assert!(check(&["kill=3:2"]).unwrap_err().contains("rank 3 does not exist"));
        assert!(check(&["nan=0:5"]).unwrap_err().contains("not among the run's steps"));
        assert!(check(&["flip=0:1:param:999999999"])
            .unwrap_err()
            .contains("outside the model"));
        // Sharded, rank 1 keeps no moment of element 0 (the first chunk of the first bucket is rank 0's).
        assert!(check(&["flip=1:1:moment:0"]).unwrap_err().contains("keeps no moment"));
        assert!(check(&["flip=1:1:moment", "kill=2:4", "inf=2:1"]).is_ok());
    }
}
