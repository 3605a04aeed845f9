//! The sim's `--fault KIND=VALUE` kinds: faults inside one process, each with one documented outcome, each
//! applied to the transport chosen or refused naming the transports that support it (never ignored).
//!
//! Network faults ([`Faults`]) act in the transport; trainer faults ([`TrainerFaults`]) act on one rank's
//! gradient or state and do not depend on the transport.

use anyhow::{bail, ensure, Context, Result};
use ringtrain::collective::mem::Faults;
use ringtrain::model::{ModelConfig, ParamLayout};
use ringtrain::trainer::buckets::BucketPlan;
pub use ringtrain::trainer::fault_injection::{flip_offset, BitFlip, FlipTarget, FLIP_BIT};
use ringtrain::trainer::fault_injection::{BadValue, NonFiniteFault};
use ringtrain::trainer::TrainOptions;
use std::time::Duration;

/// `--fault` in `--help`: every kind, the transports it applies to, and its outcome.
pub const FAULT_HELP: &str = "\
Inject a fault (repeatable, each kind at most once). RANK counts from 0, STEP from 1.
  delay=MS          [mem] every message arrives MS ms late: replicas bit-identical to a calm run
  reorder=SEED      [mem] independent messages arrive in a seeded random order: bit-identical
  slow=RANK:MS      [mem] RANK sleeps MS ms before handling each message: finishes, bit-identical
  drop=RANK:N       [mem, quic] RANK dies after sending N messages (quic: its connections close
                    without goodbye): every rank fails with an error naming RANK, within --timeout
  kill=RANK:STEP    [mem, quic] RANK dies at the start of STEP, before sending anything of it: same
  nan=RANK:STEP     [any] one element of RANK's local gradient is NaN at STEP, before the sync:
  inf=RANK:STEP     [any] (or +Inf) every rank skips STEP (--on-nonfinite skip) or stops there (abort)
  flip=RANK:STEP:param|moment[:INDEX]
                    [any] after STEP, bit 22 of element INDEX (flat layout; default: the first element
                    of RANK's shard) of RANK's parameters or first AdamW moment flips. replicated: the
                    replica check names RANK at the next step. sharded: a parameter outside RANK's shard
                    is overwritten by the next all-gather (replicas identical again); one inside it, or
                    a moment, fails RANK's shard checksum at the next step, naming RANK (the checksum is
                    on with --verify-every, which the sim sets to 1)
Under --transport quic the mem-only kinds are refused, never ignored.";

/// Faults on one rank's gradient or state, applied whatever the transport.
#[derive(Clone, Debug, Default)]
pub struct TrainerFaults {
    pub nonfinite: Option<NonFiniteFault>,
    pub flip: Option<BitFlip>,
}

fn numbers<const N: usize>(kind: &str, value: &str, form: &str) -> Result<[u64; N]> {
    let parts: Vec<&str> = value.split(':').collect();
    ensure!(parts.len() == N, "--fault {kind}={value}: expected {kind}={form}");
    let mut out = [0; N];
    for (o, p) in out.iter_mut().zip(parts) {
        *o = p
            .parse()
            .with_context(|| format!("--fault {kind}={value}: {p:?} is not a number (expected {kind}={form})"))?;
    }
    Ok(out)
}

fn parse_flip(value: &str) -> Result<BitFlip> {
    let form = "flip=RANK:STEP:param|moment[:INDEX]";
    let parts: Vec<&str> = value.split(':').collect();
    ensure!(
        parts.len() == 3 || parts.len() == 4,
        "--fault flip={value}: expected {form}"
    );
    let num = |p: &str, what: &str| -> Result<u64> {
        p.parse()
            .with_context(|| format!("--fault flip={value}: {what} {p:?} is not a number (expected {form})"))
    };
    let target = match parts[2] {
        "param" => FlipTarget::Param,
        "moment" => FlipTarget::Moment,
        other => bail!("--fault flip={value}: {other:?} is neither param nor moment (expected {form})"),
    };
    let element = match parts.get(3) {
        Some(p) => Some(num(p, "INDEX")? as usize),
        None => None,
    };
    Ok(BitFlip {
        rank: num(parts[0], "RANK")? as usize,
        step: num(parts[1], "STEP")?,
        target,
        element,
    })
}

/// Parses `--fault` values; a kind given twice is refused (the second would silently replace the first).
pub fn parse_faults(specs: &[String]) -> Result<(Faults, TrainerFaults)> {
    let (mut net, mut trainer) = (Faults::default(), TrainerFaults::default());
    let mut seen = Vec::new();
    for spec in specs {
        let Some((kind, value)) = spec.split_once('=') else {
            bail!("--fault {spec:?}: expected KIND=VALUE (see --help)")
        };
        // nan and inf arm the same hook.
        let slot = if kind == "inf" { "nan" } else { kind };
        ensure!(
            !seen.contains(&slot),
            "--fault {kind}: given twice (each kind at most once)"
        );
        seen.push(slot);
        match kind {
            "delay" => net.delay = Some(Duration::from_millis(numbers::<1>(kind, value, "MS")?[0])),
            "reorder" => net.reorder_seed = Some(numbers::<1>(kind, value, "SEED")?[0]),
            "slow" => {
                let [rank, ms] = numbers(kind, value, "RANK:MS")?;
                net.slow_rank = Some((rank as usize, Duration::from_millis(ms)));
            }
            "drop" => {
                let [rank, after] = numbers(kind, value, "RANK:N")?;
                net.die_after = Some((rank as usize, after as usize));
            }
            "kill" => {
                let [rank, step] = numbers(kind, value, "RANK:STEP")?;
                ensure!(step >= 1, "--fault kill={value}: STEP counts from 1");
                net.die_at_step = Some((rank as usize, step - 1));
            }
            "nan" | "inf" => {
                let [rank, step] = numbers(kind, value, "RANK:STEP")?;
                let value = if kind == "nan" { BadValue::Nan } else { BadValue::Inf };
                trainer.nonfinite = Some(NonFiniteFault {
                    rank: rank as usize,
                    step,
                    value,
                });
            }
            "flip" => trainer.flip = Some(parse_flip(value)?),
            other => {
                bail!("unknown --fault kind {other:?}: expected delay, reorder, slow, drop, kill, nan, inf or flip")
            }
        }
    }
    Ok((net, trainer))
}

/// How one rank crashes under QUIC (`drop`, `kill`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct QuicCrash {
    pub rank: usize,
    pub after_msgs: Option<usize>,
    /// 0-based step.
    pub at_step: Option<u64>,
}

/// The network faults QUIC applies: one rank's crash. Faults only the in-memory transport can inject are
/// refused, naming the transport that supports them.
pub fn quic_crash(net: &Faults) -> Result<Option<QuicCrash>> {
    let mem_only = [
        ("delay", net.delay.is_some()),
        ("reorder", net.reorder_seed.is_some()),
        ("slow", net.slow_rank.is_some()),
        ("split", net.split_seed.is_some()),
    ];
    if let Some((kind, _)) = mem_only.iter().find(|(_, on)| *on) {
        bail!(
            "--fault {kind} is supported by --transport mem only (QUIC's streams deliver in order on their own \
             schedule); with --transport quic only drop, kill, nan, inf and flip apply"
        );
    }
    match (net.die_after, net.die_at_step) {
        (Some((a, _)), Some((b, _))) if a != b => {
            bail!("--fault drop and kill name different ranks ({a} and {b}): under quic one rank may crash")
        }
        (None, None) => Ok(None),
        (after, at) => {
            let rank = after.map(|(r, _)| r).or(at.map(|(r, _)| r)).expect("one is set");
            Ok(Some(QuicCrash {
                rank,
                after_msgs: after.map(|(_, n)| n),
                at_step: at.map(|(_, s)| s),
            }))
        }
    }
}

/// Refuses a fault that could never fire: a rank the run does not have, a step after the last, a flipped
/// element outside the model or a moment the rank does not keep.
pub fn validate(
    net: &Faults,
    trainer: &TrainerFaults,
    workers: usize,
    model: &ModelConfig,
    opts: &TrainOptions,
) -> Result<()> {
    let rank_ok = |kind: &str, rank: usize| {
        ensure!(
            rank < workers,
            "--fault {kind}: rank {rank} does not exist with --workers {workers}"
        );
        Ok(())
    };
    let step_ok = |kind: &str, step: u64| {
        ensure!(
            (1..=opts.steps).contains(&step),
            "--fault {kind}: step {step} is not among the run's steps 1..={}",
            opts.steps
        );
        Ok(())
    };
    if let Some((r, _)) = net.slow_rank {
        rank_ok("slow", r)?;
    }
    if let Some((r, _)) = net.die_after {
        rank_ok("drop", r)?;
    }
    if let Some((r, s)) = net.die_at_step {
        rank_ok("kill", r)?;
        step_ok("kill", s + 1)?;
    }
    if let Some(f) = trainer.nonfinite {
        rank_ok("nan/inf", f.rank)?;
        step_ok("nan/inf", f.step)?;
    }
    if let Some(f) = trainer.flip {
        rank_ok("flip", f.rank)?;
        step_ok("flip", f.step)?;
        let layout = ParamLayout::new(model);
        let owned = BucketPlan::new(&layout, opts.bucket_elems).owned(opts.update, workers, f.rank);
        flip_offset(&f, layout.total, &owned)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(specs: &[&str]) -> Result<(Faults, TrainerFaults)> {
        parse_faults(&specs.iter().map(|s| s.to_string()).collect::<Vec<_>>())
    }

    #[test]
    fn parses_every_kind() {
        let (net, tr) = parse(&[
            "delay=2",
            "reorder=7",
            "slow=1:3",
            "drop=2:20",
            "kill=1:4",
            "inf=0:2",
            "flip=1:3:moment:17",
        ])
        .unwrap();
        assert_eq!(net.delay, Some(Duration::from_millis(2)));
        assert_eq!(
            (net.reorder_seed, net.die_after, net.die_at_step),
            (Some(7), Some((2, 20)), Some((1, 3)))
        );
        assert_eq!(net.slow_rank, Some((1, Duration::from_millis(3))));
        assert_eq!(
            tr.nonfinite.map(|f| (f.rank, f.step, f.value)),
            Some((0, 2, BadValue::Inf))
        );
        assert_eq!(
            tr.flip,
            Some(BitFlip {
                rank: 1,
                step: 3,
                target: FlipTarget::Moment,
                element: Some(17)
            })
        );
        assert_eq!(parse(&["flip=0:1:param"]).unwrap().1.flip.unwrap().element, None);
    }

    #[test]
    fn bad_specs_say_what_was_expected() {
        for (spec, says) in [
            ("delay", "KIND=VALUE"),
            ("jitter=3", "unknown --fault kind"),
            ("slow=1", "RANK:MS"),
            ("drop=a:3", "not a number"),
            ("kill=1:0", "counts from 1"),
            ("nan=1:2:3", "RANK:STEP"),
            ("flip=1:2", "param|moment"),
            ("flip=1:2:grad", "neither param nor moment"),
            ("flip=1:2:param:x", "INDEX"),
        ] {
            let err = format!("{:#}", parse(&[spec]).unwrap_err());
            assert!(err.contains(says), "{spec}: {err}");
        }
        let err = parse(&["nan=1:2", "inf=0:3"]).unwrap_err().to_string();
        assert!(err.contains("given twice"), "{err}");
    }

    #[test]
    fn quic_refuses_what_only_mem_injects_and_takes_the_crashes() {
        let (net, _) = parse(&["reorder=3"]).unwrap();
        let err = quic_crash(&net).unwrap_err().to_string();
        assert!(err.contains("--transport mem only"), "{err}");
        let (net, _) = parse(&["drop=1:20"]).unwrap();
        let crash = |rank, after_msgs, at_step| QuicCrash {
            rank,
            after_msgs,
            at_step,
        };
        assert_eq!(quic_crash(&net).unwrap(), Some(crash(1, Some(20), None)));
        let (net, _) = parse(&["kill=2:3"]).unwrap();
        assert_eq!(quic_crash(&net).unwrap(), Some(crash(2, None, Some(2))));
        assert_eq!(quic_crash(&Faults::default()).unwrap(), None);
    }

    #[test]
    fn faults_that_could_never_fire_are_refused() {
        let model = ModelConfig::tiny();
        let opts = TrainOptions {
            update: ringtrain::trainer::UpdateMode::Sharded,
            ..TrainOptions::for_model(&model).with_steps(4)
        };
        let check = |specs: &[&str]| {
            let (net, tr) = parse(specs).unwrap();
            validate(&net, &tr, 3, &model, &opts).map_err(|e| e.to_string())
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
