//! Injected faults, described once: [`FaultPlan`] is what the sim's `--fault KIND=VALUE` flags, the
//! `RINGTRAIN_INJECT_FAULT` hook of a real process and the library API all build, and what the in-memory
//! transport, the QUIC transport and the trainer each consult for the kinds they apply. Every kind has one
//! documented outcome ([`FAULT_HELP`]). A plan is checked against the job ([`FaultPlan::validate`]) so that
//! a fault that could never fire is refused rather than ignored, and a transport that cannot apply a kind
//! refuses it, naming the one that can ([`FaultPlan::mem_only_kind`]).
//!
//! RANK counts from 0, STEP from 1, as in the logs and the metrics.

use std::fmt;
use std::time::Duration;

use anyhow::{bail, ensure, Context, Result};

/// The environment variable that arms a plan in a real process (`ringtrain train`): the same forms as the
/// sim's `--fault`, several separated by commas.
pub const INJECT_FAULT_VAR: &str = "RINGTRAIN_INJECT_FAULT";

/// Every kind, where it applies and its outcome (the sim's `--help`).
pub const FAULT_HELP: &str = "\
Inject a fault (repeatable, each kind at most once). RANK counts from 0, STEP from 1.
  delay=MS          [mem] every message arrives MS ms late: replicas bit-identical to a calm run
  reorder=SEED      [mem] independent messages arrive in a seeded random order: bit-identical
  split=SEED        [mem] f32 payloads arrive as byte pieces cut at seeded offsets (QUIC's form):
                    bit-identical
  slow=RANK:MS      [mem] RANK sleeps MS ms before handling each message: finishes, bit-identical
  duplicate=RANK:N  [quic] RANK sends its data message N (from 0) twice: the receiver refuses the
                    copy as a replay and the job fails naming RANK
  drop=RANK:N       [mem, quic] RANK dies after sending N messages (quic: its connections close
                    without goodbye): every rank fails with an error naming RANK, within --timeout
  kill=RANK:STEP    [mem, quic] RANK dies at the start of STEP, before sending anything of it: same
                    (with --elastic the others go on without it)
  join=STEP         [mem, --elastic] a new worker joins before STEP: the workers re-form with it, and it
                    takes the parameters, moments and step from them
  regroup=RANK:EPOCH
                    [train --elastic] RANK (its first rank) dies as it sets out for the rendezvous of
                    membership epoch EPOCH (from 1), a loss during a re-form: the others try again
                    without it, or without the new rank 0 when that is RANK
  compute=RANK:MS   [any] RANK computes MS ms longer per micro-batch (a slow worker): bit-identical
  speed=RANK:PCT[:STEP]
                    [any] from STEP (default 1) RANK computes at PCT% of its speed (1-100): each
                    micro-batch's compute is followed by a sleep that stretches it by 100/PCT; one per
                    rank. Bit-identical, except that --batch-split auto gives RANK less to do
  freeze=RANK:STEP:MS
                    [any] at the start of STEP, RANK stops computing and communicating for MS ms:
                    bit-identical when MS is under --timeout; past it the ranks waiting on RANK time
                    out and the job fails, never hangs (under quic RANK's keep-alives go on: it is
                    frozen, not dead)
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

/// The value a [`Fault::NonFinite`] writes into the gradient.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BadValue {
    Nan,
    /// +Inf.
    Inf,
}

impl BadValue {
    pub fn value(self) -> f32 {
        match self {
            BadValue::Nan => f32::NAN,
            BadValue::Inf => f32::INFINITY,
        }
    }
}

impl fmt::Display for BadValue {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            BadValue::Nan => "NaN",
            BadValue::Inf => "+Inf",
        })
    }
}

/// Which state of a rank a [`Fault::Flip`] corrupts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FlipTarget {
    Param,
    /// AdamW's first moment (`exp_avg`).
    Moment,
}

/// The bit a [`Fault::Flip`] flips: the top mantissa bit, so the value changes by up to half its magnitude
/// and stays finite with its sign (a flip of the exponent would turn into the non-finite fault's path).
pub const FLIP_BIT: u32 = 22;

/// One injected fault.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Fault {
    /// Every message arrives this late (in-memory transport).
    Delay(Duration),
    /// Independent messages arrive in an order drawn from this seed (in-memory transport).
    Reorder(u64),
    /// f32 payloads arrive as byte pieces cut at offsets drawn from this seed (in-memory transport).
    Split(u64),
    /// `rank` sleeps this long before handling each message (in-memory transport).
    SlowMessages { rank: usize, delay: Duration },
    /// `rank` sends its data message number `msg` (0-based, over its lifetime) twice (QUIC).
    Duplicate { rank: usize, msg: usize },
    /// `rank` dies after sending `msgs` data messages.
    Drop { rank: usize, msgs: usize },
    /// `rank` dies at the start of `step`, before sending anything of it.
    Kill { rank: usize, step: u64 },
    /// A new worker joins an elastic run before `step` (the sim's).
    Join { step: u64 },
    /// `rank` (its first rank) dies as it sets out to re-form into membership `epoch` (QUIC processes).
    Regroup { rank: usize, epoch: u64 },
    /// `rank` computes this much longer per micro-batch.
    SlowCompute { rank: usize, delay: Duration },
    /// From `step` (1-based) `rank` computes at `percent`% of its speed.
    Speed { rank: usize, percent: u64, step: u64 },
    /// At the start of `step`, `rank` stops computing and communicating for `duration`.
    Freeze { rank: usize, step: u64, duration: Duration },
    /// One element of `rank`'s local gradient is made non-finite at `step`, before the sync.
    NonFinite { rank: usize, step: u64, value: BadValue },
    /// After `step`, bit [`FLIP_BIT`] of one element of `rank`'s state flips. `element` is flat-layout;
    /// `None`: the first element of the rank's shard.
    Flip {
        rank: usize,
        step: u64,
        target: FlipTarget,
        element: Option<usize>,
    },
}

impl Fault {
    /// The kind's name, as written in a spec.
    pub fn kind(&self) -> &'static str {
        match self {
            Fault::Delay(_) => "delay",
            Fault::Reorder(_) => "reorder",
            Fault::Split(_) => "split",
            Fault::SlowMessages { .. } => "slow",
            Fault::Duplicate { .. } => "duplicate",
            Fault::Drop { .. } => "drop",
            Fault::Kill { .. } => "kill",
            Fault::Join { .. } => "join",
            Fault::Regroup { .. } => "regroup",
            Fault::SlowCompute { .. } => "compute",
            Fault::Speed { .. } => "speed",
            Fault::Freeze { .. } => "freeze",
            Fault::NonFinite {
                value: BadValue::Nan, ..
            } => "nan",
            Fault::NonFinite {
                value: BadValue::Inf, ..
            } => "inf",
            Fault::Flip { .. } => "flip",
        }
    }

    /// The rank it acts on, when it acts on one.
    pub fn rank(&self) -> Option<usize> {
        let mut copy = *self;
        copy.rank_mut().map(|r| *r)
    }

    /// Where the fault keeps the rank it acts on.
    fn rank_mut(&mut self) -> Option<&mut usize> {
        match self {
            Fault::Delay(_) | Fault::Reorder(_) | Fault::Split(_) | Fault::Join { .. } => None,
            Fault::SlowMessages { rank, .. }
            | Fault::Duplicate { rank, .. }
            | Fault::Drop { rank, .. }
            | Fault::Kill { rank, .. }
            | Fault::Regroup { rank, .. }
            | Fault::SlowCompute { rank, .. }
            | Fault::Speed { rank, .. }
            | Fault::Freeze { rank, .. }
            | Fault::NonFinite { rank, .. }
            | Fault::Flip { rank, .. } => Some(rank),
        }
    }

    /// The step it acts at, when it acts at one.
    pub fn step(&self) -> Option<u64> {
        match *self {
            Fault::Kill { step, .. }
            | Fault::Join { step }
            | Fault::Speed { step, .. }
            | Fault::Freeze { step, .. }
            | Fault::NonFinite { step, .. }
            | Fault::Flip { step, .. } => Some(step),
            _ => None,
        }
    }

    /// The same fault acting on `new_rank` instead (a fault that acts on no rank is unchanged).
    pub fn on_rank(mut self, new_rank: usize) -> Fault {
        if let Some(rank) = self.rank_mut() {
            *rank = new_rank;
        }
        self
    }

    /// Whether it acts on the ring's messages or on a rank's place in it, which a job of one rank has none of.
    pub fn acts_on_ring(&self) -> bool {
        matches!(
            self,
            Fault::Delay(_)
                | Fault::Reorder(_)
                | Fault::Split(_)
                | Fault::SlowMessages { .. }
                | Fault::Duplicate { .. }
                | Fault::Drop { .. }
                | Fault::Kill { .. }
                | Fault::Join { .. }
                | Fault::Regroup { .. }
        )
    }

    /// Whether only the in-memory transport can apply it.
    pub fn mem_only(&self) -> bool {
        matches!(
            self,
            Fault::Delay(_) | Fault::Reorder(_) | Fault::Split(_) | Fault::SlowMessages { .. } | Fault::Join { .. }
        )
    }

    /// Parses one `KIND=VALUE`; errors say the expected form.
    pub fn parse(spec: &str) -> Result<Fault> {
        let Some((kind, value)) = spec.trim().split_once('=') else {
            bail!("fault {spec:?}: expected KIND=VALUE");
        };
        let ms = |n: u64| Duration::from_millis(n);
        Ok(match kind {
            "delay" => Fault::Delay(ms(numbers::<1>(kind, value, "MS")?[0])),
            "reorder" => Fault::Reorder(numbers::<1>(kind, value, "SEED")?[0]),
            "split" => Fault::Split(numbers::<1>(kind, value, "SEED")?[0]),
            "slow" => {
                let [rank, delay] = numbers(kind, value, "RANK:MS")?;
                Fault::SlowMessages {
                    rank: rank as usize,
                    delay: ms(delay),
                }
            }
            "duplicate" => {
                let [rank, msg] = numbers(kind, value, "RANK:N")?;
                Fault::Duplicate {
                    rank: rank as usize,
                    msg: msg as usize,
                }
            }
            "drop" => {
                let [rank, msgs] = numbers(kind, value, "RANK:N")?;
                Fault::Drop {
                    rank: rank as usize,
                    msgs: msgs as usize,
                }
            }
            "kill" => {
                let [rank, step] = numbers(kind, value, "RANK:STEP")?;
                Fault::Kill {
                    rank: rank as usize,
                    step: from_one(kind, value, step)?,
                }
            }
            "regroup" => {
                let [rank, epoch] = numbers(kind, value, "RANK:EPOCH")?;
                ensure!(
                    epoch >= 1,
                    "fault {kind}={value}: EPOCH counts from 1 (epoch 0 is the job's start)"
                );
                Fault::Regroup {
                    rank: rank as usize,
                    epoch,
                }
            }
            "join" => Fault::Join {
                step: from_one(kind, value, numbers::<1>(kind, value, "STEP")?[0])?,
            },
            "compute" => {
                let [rank, delay] = numbers(kind, value, "RANK:MS")?;
                Fault::SlowCompute {
                    rank: rank as usize,
                    delay: ms(delay),
                }
            }
            "speed" => {
                let (rank, percent, step) = match value.matches(':').count() {
                    1 => {
                        let [rank, percent] = numbers(kind, value, "RANK:PCT[:STEP]")?;
                        (rank, percent, 1)
                    }
                    _ => {
                        let [rank, percent, step] = numbers(kind, value, "RANK:PCT[:STEP]")?;
                        (rank, percent, from_one(kind, value, step)?)
                    }
                };
                ensure!(
                    (1..=100).contains(&percent),
                    "fault {kind}={value}: the speed {percent}% is not between 1 and 100"
                );
                Fault::Speed {
                    rank: rank as usize,
                    percent,
                    step,
                }
            }
            "freeze" => {
                let [rank, step, duration] = numbers(kind, value, "RANK:STEP:MS")?;
                Fault::Freeze {
                    rank: rank as usize,
                    step: from_one(kind, value, step)?,
                    duration: ms(duration),
                }
            }
            "nan" | "inf" => {
                let [rank, step] = numbers(kind, value, "RANK:STEP")?;
                Fault::NonFinite {
                    rank: rank as usize,
                    step: from_one(kind, value, step)?,
                    value: if kind == "nan" { BadValue::Nan } else { BadValue::Inf },
                }
            }
            "flip" => parse_flip(value)?,
            // The environment hook's first form, kept for the scripts that use it.
            "nonfinite" => {
                let form = "expected nonfinite=RANK:STEP[:nan|inf]";
                let parts: Vec<&str> = value.split(':').collect();
                let (rank, step, bad) = match parts.as_slice() {
                    [rank, step] | [rank, step, "nan"] => (rank, step, BadValue::Nan),
                    [rank, step, "inf"] => (rank, step, BadValue::Inf),
                    [_, _, other] => bail!("fault {kind}={value}: value {other:?} is not nan or inf"),
                    _ => bail!("fault {kind}={value}: {form}"),
                };
                let [rank, step] = numbers(kind, &format!("{rank}:{step}"), "RANK:STEP")?;
                Fault::NonFinite {
                    rank: rank as usize,
                    step: from_one(kind, value, step)?,
                    value: bad,
                }
            }
            other => bail!(
                "unknown fault kind {other:?}: expected delay, reorder, split, slow, duplicate, drop, kill, \
                 join, compute, speed, freeze, nan, inf or flip"
            ),
        })
    }
}

impl fmt::Display for Fault {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let kind = self.kind();
        match *self {
            Fault::Delay(d) => write!(f, "{kind}={}", d.as_millis()),
            Fault::Reorder(seed) | Fault::Split(seed) => write!(f, "{kind}={seed}"),
            Fault::SlowMessages { rank, delay } | Fault::SlowCompute { rank, delay } => {
                write!(f, "{kind}={rank}:{}", delay.as_millis())
            }
            Fault::Duplicate { rank, msg: n } | Fault::Drop { rank, msgs: n } => write!(f, "{kind}={rank}:{n}"),
            Fault::Kill { rank, step } | Fault::NonFinite { rank, step, .. } => write!(f, "{kind}={rank}:{step}"),
            Fault::Join { step } => write!(f, "{kind}={step}"),
            Fault::Regroup { rank, epoch } => write!(f, "{kind}={rank}:{epoch}"),
            Fault::Freeze { rank, step, duration } => write!(f, "{kind}={rank}:{step}:{}", duration.as_millis()),
            Fault::Speed { rank, percent, step } => write!(f, "{kind}={rank}:{percent}:{step}"),
            Fault::Flip {
                rank,
                step,
                target,
                element,
            } => {
                let target = match target {
                    FlipTarget::Param => "param",
                    FlipTarget::Moment => "moment",
                };
                write!(f, "{kind}={rank}:{step}:{target}")?;
                match element {
                    Some(e) => write!(f, ":{e}"),
                    None => Ok(()),
                }
            }
        }
    }
}

fn numbers<const N: usize>(kind: &str, value: &str, form: &str) -> Result<[u64; N]> {
    let parts: Vec<&str> = value.split(':').collect();
    ensure!(parts.len() == N, "fault {kind}={value}: expected {kind}={form}");
    let mut out = [0; N];
    for (o, p) in out.iter_mut().zip(parts) {
        *o = p
            .parse()
            .with_context(|| format!("fault {kind}={value}: {p:?} is not a number (expected {kind}={form})"))?;
    }
    Ok(out)
}

fn from_one(kind: &str, value: &str, step: u64) -> Result<u64> {
    ensure!(step >= 1, "fault {kind}={value}: STEP counts from 1");
    Ok(step)
}

fn parse_flip(value: &str) -> Result<Fault> {
    let form = "flip=RANK:STEP:param|moment[:INDEX]";
    let parts: Vec<&str> = value.split(':').collect();
    ensure!(
        parts.len() == 3 || parts.len() == 4,
        "fault flip={value}: expected {form}"
    );
    let num = |p: &str, what: &str| -> Result<u64> {
        p.parse()
            .with_context(|| format!("fault flip={value}: {what} {p:?} is not a number (expected {form})"))
    };
    let target = match parts[2] {
        "param" => FlipTarget::Param,
        "moment" => FlipTarget::Moment,
        other => bail!("fault flip={value}: {other:?} is neither param nor moment (expected {form})"),
    };
    let element = match parts.get(3) {
        Some(p) => Some(num(p, "INDEX")? as usize),
        None => None,
    };
    Ok(Fault::Flip {
        rank: num(parts[0], "RANK")? as usize,
        step: from_one("flip", value, num(parts[1], "STEP")?)?,
        target,
        element,
    })
}

/// The faults of one run. `Default` injects nothing.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct FaultPlan {
    faults: Vec<Fault>,
}

impl FaultPlan {
    /// A plan of these faults; each kind at most once (a second would silently replace the first), `nan`
    /// and `inf` counting as one, `speed` once per rank.
    pub fn new(faults: Vec<Fault>) -> Result<FaultPlan> {
        let slot = |f: &Fault| match (f.kind(), f) {
            ("inf", _) => ("nan", None),
            ("speed", _) => ("speed", f.rank()),
            (kind, _) => (kind, None),
        };
        for (i, f) in faults.iter().enumerate() {
            ensure!(
                !faults[..i].iter().any(|g| slot(g) == slot(f)),
                "fault {}: given twice (each kind at most once, speed once per rank)",
                f.kind()
            );
        }
        Ok(FaultPlan { faults })
    }

    /// Parses `KIND=VALUE` specs, one fault each.
    pub fn parse(specs: &[impl AsRef<str>]) -> Result<FaultPlan> {
        FaultPlan::new(specs.iter().map(|s| Fault::parse(s.as_ref())).collect::<Result<_>>()?)
    }

    /// The plan of a re-formed group (elastic runs): a plan's ranks name the job's first members, so the
    /// faults of the members in `members` (in their new rank order) move to their new ranks and the faults
    /// of members no longer there are dropped; the faults on every message stay. A message count (`drop`,
    /// `duplicate`) starts again in the new group.
    pub fn for_members(&self, members: &[u32]) -> FaultPlan {
        let faults = self
            .faults
            .iter()
            .filter_map(|f| match f.rank() {
                None => Some(*f),
                Some(member) => members.iter().position(|&m| m as usize == member).map(|r| f.on_rank(r)),
            })
            .collect();
        FaultPlan { faults }
    }

    /// The plan [`INJECT_FAULT_VAR`] arms: none when unset; its specs separated by commas.
    pub fn from_env_value(value: Option<&str>) -> Result<FaultPlan> {
        let Some(value) = value else {
            return Ok(FaultPlan::default());
        };
        let specs: Vec<&str> = value.split(',').map(str::trim).filter(|s| !s.is_empty()).collect();
        ensure!(!specs.is_empty(), "{INJECT_FAULT_VAR} is set but names no fault");
        FaultPlan::parse(&specs).with_context(|| format!("{INJECT_FAULT_VAR}={value:?}"))
    }

    pub fn is_empty(&self) -> bool {
        self.faults.is_empty()
    }

    pub fn faults(&self) -> &[Fault] {
        &self.faults
    }

    /// Refuses a fault that could never fire in a job of `world` ranks and `steps` steps: a rank the job
    /// does not have, a step after the last, a fault on the ring in a job of one rank.
    pub fn validate(&self, world: usize, steps: u64) -> Result<()> {
        for f in &self.faults {
            ensure!(
                world > 1 || !f.acts_on_ring(),
                "fault {f} acts on the ring, and a job of one rank has none"
            );
            if let Some(rank) = f.rank() {
                ensure!(
                    rank < world,
                    "fault {f}: rank {rank} does not exist in a job of {world} rank(s)"
                );
            }
            if let Some(step) = f.step() {
                ensure!(
                    (1..=steps).contains(&step),
                    "fault {f}: step {step} is not among the run's steps 1..={steps}"
                );
            }
        }
        Ok(())
    }

    /// The first kind only the in-memory transport applies, if any (QUIC refuses the plan then).
    pub fn mem_only_kind(&self) -> Option<&'static str> {
        self.faults.iter().find(|f| f.mem_only()).map(Fault::kind)
    }

    /// The step a `join` fault adds a worker before, if the plan has one.
    pub fn join_before(&self) -> Option<u64> {
        self.faults.iter().find_map(|f| match *f {
            Fault::Join { step } => Some(step),
            _ => None,
        })
    }

    fn find<T>(&self, pick: impl Fn(&Fault) -> Option<T>) -> Option<T> {
        self.faults.iter().find_map(pick)
    }

    /// Every message's delay (in-memory transport).
    pub fn message_delay(&self) -> Option<Duration> {
        self.find(|f| match *f {
            Fault::Delay(d) => Some(d),
            _ => None,
        })
    }

    pub fn reorder_seed(&self) -> Option<u64> {
        self.find(|f| match *f {
            Fault::Reorder(seed) => Some(seed),
            _ => None,
        })
    }

    pub fn split_seed(&self) -> Option<u64> {
        self.find(|f| match *f {
            Fault::Split(seed) => Some(seed),
            _ => None,
        })
    }

    /// How long `rank` sleeps before handling each message.
    pub fn message_handling_delay(&self, rank: usize) -> Option<Duration> {
        self.find(|f| match *f {
            Fault::SlowMessages { rank: r, delay } if r == rank => Some(delay),
            _ => None,
        })
    }

    /// The data message `rank` sends twice.
    pub fn duplicated_message(&self, rank: usize) -> Option<usize> {
        self.find(|f| match *f {
            Fault::Duplicate { rank: r, msg } if r == rank => Some(msg),
            _ => None,
        })
    }

    /// After how many sent messages `rank` dies.
    pub fn dies_after_messages(&self, rank: usize) -> Option<usize> {
        self.find(|f| match *f {
            Fault::Drop { rank: r, msgs } if r == rank => Some(msgs),
            _ => None,
        })
    }

    /// The 0-based step at whose start `rank` dies (transports count steps from 0).
    pub fn dies_at_step_index(&self, rank: usize) -> Option<u64> {
        self.find(|f| match *f {
            Fault::Kill { rank: r, step } if r == rank => Some(step - 1),
            _ => None,
        })
    }

    /// Whether member `member` (its first rank) dies as it sets out to re-form into membership `epoch`.
    pub fn dies_entering_epoch(&self, member: usize, epoch: u64) -> bool {
        self.faults
            .iter()
            .any(|f| matches!(*f, Fault::Regroup { rank, epoch: e } if rank == member && e == epoch))
    }

    /// How much longer `rank` computes per micro-batch.
    pub fn compute_delay(&self, rank: usize) -> Option<Duration> {
        self.find(|f| match *f {
            Fault::SlowCompute { rank: r, delay } if r == rank => Some(delay),
            _ => None,
        })
    }

    /// The speed, in percent, `rank` computes at in `step` (1-based), when slowed.
    pub fn speed_at(&self, rank: usize, step: u64) -> Option<u64> {
        self.faults.iter().find_map(|f| match *f {
            Fault::Speed {
                rank: r,
                percent,
                step: from,
            } if r == rank && step >= from && percent < 100 => Some(percent),
            _ => None,
        })
    }

    /// How long `rank` freezes at the start of `step` (1-based).
    pub fn freeze_at(&self, rank: usize, step: u64) -> Option<Duration> {
        self.find(|f| match *f {
            Fault::Freeze {
                rank: r,
                step: s,
                duration,
            } if r == rank && s == step => Some(duration),
            _ => None,
        })
    }

    /// The value written into `rank`'s gradient at `step` (1-based).
    pub fn nonfinite_at(&self, rank: usize, step: u64) -> Option<BadValue> {
        self.find(|f| match *f {
            Fault::NonFinite {
                rank: r,
                step: s,
                value,
            } if r == rank && s == step => Some(value),
            _ => None,
        })
    }

    /// The flip of `rank`'s state due after `step` (1-based).
    pub fn flip_after(&self, rank: usize, step: u64) -> Option<(FlipTarget, Option<usize>)> {
        self.find(|f| match *f {
            Fault::Flip {
                rank: r,
                step: s,
                target,
                element,
            } if r == rank && s == step => Some((target, element)),
            _ => None,
        })
    }
}

impl fmt::Display for FaultPlan {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let specs: Vec<String> = self.faults.iter().map(Fault::to_string).collect();
        f.write_str(&specs.join(","))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_kind_parses_and_prints_back() {
        let specs = [
            "delay=2",
            "reorder=7",
            "split=9",
            "slow=1:3",
            "duplicate=1:4",
            "drop=2:20",
            "kill=1:3",
            "regroup=2:1",
            "compute=0:15",
            "speed=0:50:3",
            "speed=2:25:1",
            "freeze=1:2:500",
            "nan=0:2",
            "flip=1:2:moment:5",
        ];
        let plan = FaultPlan::parse(&specs).unwrap();
        assert_eq!(plan.to_string(), specs.join(","));
        assert_eq!(plan.message_delay(), Some(Duration::from_millis(2)));
        assert_eq!(plan.dies_at_step_index(1), Some(2));
        assert_eq!(plan.dies_after_messages(2), Some(20));
        assert!(plan.dies_entering_epoch(2, 1) && !plan.dies_entering_epoch(2, 2) && !plan.dies_entering_epoch(1, 1));
        assert_eq!(plan.duplicated_message(1), Some(4));
        assert_eq!(plan.compute_delay(0), Some(Duration::from_millis(15)));
        assert_eq!(
            (plan.speed_at(0, 2), plan.speed_at(0, 3), plan.speed_at(2, 1)),
            (None, Some(50), Some(25))
        );
        assert!(FaultPlan::parse(&["speed=1:0"]).is_err());
        assert!(FaultPlan::parse(&["speed=1:101"]).is_err());
        assert!(FaultPlan::parse(&["speed=1:50", "speed=1:60"]).is_err());
        assert_eq!(FaultPlan::parse(&["speed=1:50"]).unwrap().speed_at(1, 1), Some(50));
        assert_eq!(plan.freeze_at(1, 2), Some(Duration::from_millis(500)));
        assert_eq!(plan.freeze_at(1, 3), None);
        assert_eq!(plan.nonfinite_at(0, 2), Some(BadValue::Nan));
        assert_eq!(plan.flip_after(1, 2), Some((FlipTarget::Moment, Some(5))));
        assert_eq!(plan.mem_only_kind(), Some("delay"));
        assert_eq!(
            FaultPlan::from_env_value(Some(" inf=1:3 , drop=0:7 "))
                .unwrap()
                .to_string(),
            "inf=1:3,drop=0:7"
        );
        assert!(FaultPlan::from_env_value(None).unwrap().is_empty());
        // The environment hook's first form.
        let old = FaultPlan::from_env_value(Some("nonfinite=2:7:inf")).unwrap();
        assert_eq!(old.nonfinite_at(2, 7), Some(BadValue::Inf));
    }

    #[test]
    fn bad_specs_say_the_expected_form() {
        for (bad, needle) in [
            ("nan", "expected KIND=VALUE"),
            ("kill=1", "expected kill=RANK:STEP"),
            ("kill=1:0", "STEP counts from 1"),
            ("regroup=1:0", "EPOCH counts from 1"),
            ("slow=x:3", "\"x\" is not a number"),
            ("flip=1:2:weights", "neither param nor moment"),
            ("melt=1", "unknown fault kind"),
            ("freeze=1:2", "expected freeze=RANK:STEP:MS"),
            ("nonfinite=1", "expected nonfinite=RANK:STEP[:nan|inf]"),
            ("nonfinite=1:3:zero", "is not nan or inf"),
        ] {
            let err = format!("{:#}", Fault::parse(bad).unwrap_err());
            assert!(err.contains(needle), "{bad}: {err}");
        }
        let twice = FaultPlan::parse(&["nan=0:1", "inf=1:2"]).unwrap_err().to_string();
        assert!(twice.contains("given twice"), "{twice}");
        let env = format!("{:#}", FaultPlan::from_env_value(Some("nan=0")).unwrap_err());
        assert!(env.contains(INJECT_FAULT_VAR), "{env}");
    }

    #[test]
    fn a_fault_that_could_never_fire_is_refused() {
        let plan = FaultPlan::parse(&["kill=3:2"]).unwrap();
        assert!(plan.validate(4, 5).is_ok());
        let err = plan.validate(3, 5).unwrap_err().to_string();
        assert!(err.contains("rank 3 does not exist"), "{err}");
        let err = FaultPlan::parse(&["nan=0:6"])
            .unwrap()
            .validate(2, 5)
            .unwrap_err()
            .to_string();
        assert!(err.contains("not among the run's steps 1..=5"), "{err}");
        let err = FaultPlan::parse(&["kill=0:2"])
            .unwrap()
            .validate(1, 5)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("acts on the ring, and a job of one rank has none"),
            "{err}"
        );
        assert!(FaultPlan::parse(&["nan=0:2", "compute=0:5"])
            .unwrap()
            .validate(1, 5)
            .is_ok());
    }
}
