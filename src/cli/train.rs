//! `ringtrain train` and `ringtrain bench step`: build the trainer from resolved flags and run the loop
//! with progress, metrics, evaluation and checkpoints.

use super::args::TrainArgs;
use super::backend::{open_backend, parse_backend, with_flag_hints};
use super::progress::{eprint_line, format_skip_line, format_spike_line, Progress};
use anyhow::{ensure, Context, Result};
use ringtrain::backend::factory::BackendChoice;
use ringtrain::backend::op_cost::OpFamily;
use ringtrain::backend::profiled::{FamilyTotals, Profile, Profiled};
use ringtrain::backend::{Backend, MatmulPrecision};
use ringtrain::collective::mem::single_rank;
use ringtrain::collective::shm::LinkTransport;
use ringtrain::collective::{Collective, TwoLevel};
use ringtrain::data::{load_splits, BatchPlan, BatchSplit, DataSplits};
use ringtrain::dist::elastic::{rejoin as rejoin_running, QuicRegroup};
use ringtrain::dist::{
    detect_launch, detect_network, join, load_secret, thread_budget, threads, JoinOptions, LaunchEnv, LaunchFlags,
    ThreadBudget,
};
use ringtrain::dist::{JOIN_AS_VAR, REJOIN_VAR};
use ringtrain::elastic::{MemberId, Membership, MAX_MEMBER_ID};
use ringtrain::fault_plan::{Fault, FaultPlan, INJECT_FAULT_VAR};
use ringtrain::metrics::{rank_metrics_path, set_aside_earlier_run, MetricsWriter, StepMetrics};
use ringtrain::trainer::{host_available, measured_peak, MemoryPlan, ModelSource, RunObserver, TrainOptions, Trainer};
use std::time::Duration;

/// Everything a run needs, resolved from flags, the TOML file and the launch environment.
struct RunSetup {
    source: ModelSource,
    data: DataSplits,
    opts: TrainOptions,
    /// Opened after everything else is resolved.
    backend: BackendChoice,
    /// `--matmul-precision`, set on the backend once it is open (a rank's own choice, as its backend is).
    matmul_precision: MatmulPrecision,
    metrics_path: Option<std::path::PathBuf>,
    launch: LaunchEnv,
    secret_file: Option<std::path::PathBuf>,
    timeout: Duration,
    /// `--transport`: shared memory or QUIC between ranks of this host.
    transport: LinkTransport,
    /// Digest of everything the ranks must agree on (model shape and batch layout), sent in the hello.
    job_hash: u64,
    /// This rank's compute threads, already installed.
    threads: ThreadBudget,
    /// The model's shape, and whether the run resumes: with the backend, what the memory plan is made of
    /// ([`check_memory_plan`]).
    model: ringtrain::model::ModelConfig,
    resume: bool,
    /// Injected faults ([`INJECT_FAULT_VAR`]; empty in a real run).
    faults: FaultPlan,
}

/// Default deadline of one collective: generous, since it also covers waiting for the slowest rank's
/// forward and backward.
const DEFAULT_TIMEOUT_SECS: f64 = 300.0;

fn setup(args: TrainArgs) -> Result<RunSetup> {
    let args = args.merged_with_file()?;
    let flags = LaunchFlags {
        rank: args.rank,
        world_size: args.world_size,
        local_rank: None,
        master_addr: args.master_addr.clone(),
        master_port: args.master_port,
    };
    let launch = detect_launch(&flags, |k| std::env::var(k).ok()).map_err(anyhow::Error::msg)?;
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let rayon_env = std::env::var("RAYON_NUM_THREADS").ok();
    let threads = thread_budget(args.threads, rayon_env.as_deref(), launch.local_world_size, cores)
        .map_err(anyhow::Error::msg)?;
    threads::install(threads).map_err(anyhow::Error::msg)?;
    let timeout_secs = args.timeout.unwrap_or(DEFAULT_TIMEOUT_SECS);
    ensure!(
        timeout_secs.is_finite() && timeout_secs > 0.0,
        "--timeout {timeout_secs} must be a positive number of seconds"
    );
    ensure!(
        args.init.is_none() || args.resume.is_none(),
        "--init and --resume both given: --resume already restores the parameters"
    );
    // A checkpoint is read here, once: its shape decides the options and the memory plan, and a damaged file
    // is refused before anything is opened or joined. (The seed only draws a fresh init's parameters.)
    let read = |source: ModelSource| -> Result<(ModelSource, ringtrain::model::ModelConfig)> {
        let read = source.read(0)?;
        let cfg = read.config.clone();
        Ok((ModelSource::Read(read), cfg))
    };
    let (source, model) = if let Some(dir) = &args.resume {
        read(ModelSource::Resume(dir.clone()))?
    } else if let Some(dir) = &args.init {
        read(ModelSource::Init(dir.clone()))?
    } else {
        let cfg = args.model_config()?;
        (ModelSource::Fresh(cfg.clone()), cfg)
    };
    let opts = args.resolve(&model, launch.world_size)?;
    let data_spec = args.data.clone().unwrap_or_else(|| "synthetic".into());
    let data = load_splits(&data_spec, args.val_data.as_deref(), args.tokenizer_kind()?)?;
    let backend = parse_backend(args.backend.as_deref())?;
    let matmul_precision: MatmulPrecision = args
        .matmul_precision
        .as_deref()
        .unwrap_or("fp32")
        .parse()
        .map_err(|e: String| anyhow::anyhow!("--matmul-precision: {e}"))?;
    let job_hash = opts.job_hash(&model, launch.world_size);
    let resume = source.is_resume();
    let faults = fault_plan_from_env(launch.world_size, opts.steps)?;
    if let Some(f) = faults.faults().iter().find(|f| matches!(f, Fault::Regroup { .. })) {
        anyhow::ensure!(
            opts.elastic.is_some(),
            "{INJECT_FAULT_VAR}: fault {f} acts on an elastic re-form, and this job has no --elastic"
        );
    }
    Ok(RunSetup {
        source,
        data,
        opts,
        backend,
        matmul_precision,
        metrics_path: args.metrics.clone(),
        launch,
        secret_file: args.secret_file.clone(),
        timeout: Duration::from_secs_f64(timeout_secs),
        transport: args.transport.unwrap_or_default(),
        job_hash,
        threads,
        model,
        resume,
        faults,
    })
}

/// The fault plan of [`INJECT_FAULT_VAR`] (empty when unset), checked against the job: a fault that could
/// never fire is refused ([`FaultPlan::validate`]).
fn fault_plan_from_env(world: usize, steps: u64) -> Result<FaultPlan> {
    let value = match std::env::var_os(INJECT_FAULT_VAR) {
        None => None,
        Some(v) => Some(
            v.into_string()
                .map_err(|_| anyhow::anyhow!("{INJECT_FAULT_VAR} is not valid UTF-8"))?,
        ),
    };
    let plan = FaultPlan::from_env_value(value.as_deref())?;
    plan.validate(world, steps)
        .with_context(|| format!("{INJECT_FAULT_VAR}={}", value.as_deref().unwrap_or_default()))?;
    Ok(plan)
}

/// Arms the plan of [`INJECT_FAULT_VAR`], if any, saying so loudly: a run with it is not a real run.
fn arm_faults<B: Backend>(trainer: &mut Trainer<B>, faults: &FaultPlan) {
    if faults.is_empty() {
        return;
    }
    eprint_line(&format!(
        "rank {}: WARNING: FAULT INJECTION ARMED ({INJECT_FAULT_VAR}={faults})",
        trainer.rank()
    ));
    trainer.arm_faults(faults.clone());
}

/// This rank's memory plan on the opened backend (whose attention decides a term), printed; refuses to go
/// on when it does not fit the backend's memory.
fn check_memory_plan(s: &RunSetup, be: &dyn Backend) -> Result<MemoryPlan> {
    let who = match s.launch.world_size {
        1 => String::new(),
        _ => format!("rank {}: ", s.launch.rank),
    };
    let plan = MemoryPlan::new(
        &s.model,
        &s.opts,
        (s.launch.world_size, s.launch.rank),
        s.resume,
        be.attention_saving(),
    );
    // Each line in one write: the ranks of a `launch` share its stderr.
    eprint_line(&format!("{who}{plan}"));
    plan.check(be.memory(), host_available())
        .map_err(|e| anyhow::anyhow!("{who}{e}"))?;
    Ok(plan)
}

/// How this process joins: the ring it belongs to (a one-rank stand-in for a single process, QUIC
/// otherwise); with `--elastic` over several ranks, also what re-forms it after a loss; and for a rank
/// restarted to rejoin a running job (`launch --max-restarts`) or started to join it as a new member, the
/// membership that admitted it.
struct Connection {
    comm: Box<dyn Collective>,
    regroup: Option<QuicRegroup>,
    admitted: Option<Membership>,
    /// This process's member id: its first rank, or the id it joined as.
    member: MemberId,
}

/// The member this process asks a running elastic job to take in, if it is one: its own first rank when
/// restarted ([`REJOIN_VAR`]), or a new member's id ([`JOIN_AS_VAR`]).
fn joining_as(launch: &LaunchEnv) -> Result<Option<MemberId>> {
    let rejoin = std::env::var(REJOIN_VAR).is_ok_and(|v| v == "1");
    let Ok(value) = std::env::var(JOIN_AS_VAR) else {
        return Ok(rejoin.then_some(launch.rank as MemberId));
    };
    ensure!(
        !rejoin,
        "{REJOIN_VAR} and {JOIN_AS_VAR} are both set: a process rejoins or joins anew, not both"
    );
    let id: MemberId = value
        .trim()
        .parse()
        .ok()
        .filter(|&id| id < MAX_MEMBER_ID)
        .with_context(|| format!("{JOIN_AS_VAR}={value:?} is not a member id (a number below {MAX_MEMBER_ID})"))?;
    Ok(Some(id))
}

fn connect(s: &RunSetup) -> Result<Connection> {
    // A member joining a running job may be started without WORLD_SIZE (it needs the job's global batch).
    let joining = joining_as(&s.launch)?;
    let secret = match (s.launch.world_size, joining) {
        (1, None) => None,
        _ => load_secret(s.secret_file.as_deref(), |k| std::env::var(k).ok()).map_err(anyhow::Error::msg)?,
    };
    let elastic = s.opts.elastic.filter(|_| s.launch.world_size > 1 || joining.is_some());
    let opts = JoinOptions {
        config_hash: s.job_hash,
        secret,
        timeout: s.timeout,
        faults: s.faults.clone(),
        transport: s.transport,
        collective: s.opts.ring_to_form(),
        epoch: 0,
        elastic: elastic.is_some(),
    };
    if s.opts.ring_to_form() != s.opts.collective && s.launch.rank == 0 && s.launch.world_size > 1 {
        eprint_line(
            "--collective auto: the flat ring (an elastic run of the sharded update keeps its buddy mirrors there)",
        );
    }
    let member = joining.unwrap_or(s.launch.rank as MemberId);
    let Some(rules) = elastic else {
        ensure!(
            joining.is_none(),
            "{REJOIN_VAR} or {JOIN_AS_VAR} is set, but only an --elastic job takes members in"
        );
        return Ok(Connection {
            comm: join(&s.launch, &opts)?,
            regroup: None,
            admitted: None,
            member,
        });
    };
    let network = detect_network(|k| std::env::var(k).ok()).map_err(anyhow::Error::msg)?;
    if let Some(member) = joining {
        let (comm, membership, regroup) = rejoin_running(member, &s.launch, &opts, &network, rules)?;
        return Ok(Connection {
            comm,
            regroup: Some(regroup),
            admitted: Some(membership),
            member,
        });
    }
    let comm = join(&s.launch, &opts)?;
    let regroup = QuicRegroup::new(&s.launch, &opts, &network, rules, &*comm)?;
    Ok(Connection {
        comm,
        regroup: Some(regroup),
        admitted: None,
        member,
    })
}

pub fn run_train(args: TrainArgs) -> Result<()> {
    let s = setup(args)?;
    let (mut be, selection) = open_backend(s.backend, s.launch.local_rank)?;
    be.set_matmul_precision(s.matmul_precision)?;
    check_memory_plan(&s, &*be)?;
    let resuming = s.source.is_resume();
    let Connection {
        comm,
        mut regroup,
        admitted,
        member,
    } = connect(&s)?;
    let links = format!("{}{}", links_note(comm.ring_links()), layout_note(comm.two_level()));
    let is_rank0 = s.launch.rank == 0 && admitted.is_none();
    let mut trainer = match admitted {
        // Alone first, with the job's global batch; the running ranks then hand over their state.
        Some(membership) => {
            let opts = TrainOptions {
                global_batch: Some(s.opts.global_batch_for(s.launch.world_size)),
                grad_accum: 1,
                ..s.opts
            };
            let mut trainer = Trainer::new(be, s.source, s.data, opts, single_rank()).map_err(with_flag_hints)?;
            arm_faults(&mut trainer, &s.faults);
            let step = trainer.join_running(comm, membership)?;
            eprint_line(&format!(
                "member {member}: rejoined the running job at step {step} as rank {} of {}",
                trainer.rank(),
                trainer.world()
            ));
            trainer
        }
        None => {
            let mut trainer = Trainer::new(be, s.source, s.data, s.opts, comm).map_err(with_flag_hints)?;
            arm_faults(&mut trainer, &s.faults);
            trainer
        }
    };
    let mut observer = CliObserver {
        progress: match is_rank0 {
            true => Progress::new(trainer.options().steps, trainer.step()),
            false => Progress::hidden(),
        },
        metrics_path: s.metrics_path.map(|p| rank_metrics_path(&p, member as usize)),
        resuming,
        metrics: None,
        is_rank0,
        backend_reason: format!("{}; {}", selection.reason, s.threads),
        links,
        comm: CommTotals::default(),
    };
    let last = match &mut regroup {
        Some(regroup) => trainer.run_elastic(&mut observer, regroup),
        None => trainer.run(&mut observer),
    }
    .map_err(with_flag_hints)?;
    observer.progress.finish();
    if let (Some(m), true) = (last, is_rank0) {
        let val = m.val_loss.map(|v| format!(", val loss {v:.4}")).unwrap_or_default();
        eprint_line(&format!(
            "done: step {}, loss {:.4}{val}, {:.0} tokens/s{}{}",
            m.step,
            m.loss,
            m.tokens_per_s,
            observer.comm.summary(
                trainer.world(),
                trainer.param_count(),
                trainer.options().sync.outer().is_some() || trainer.options().wire.is_compact()
            ),
            shares_note(trainer.batch_plan(), &trainer.options().batch_split)
        ));
    }
    Ok(())
}

/// ` (shares 6+2)` for uneven shares of the global batch, ` (split auto, shares 6+6)` for automatic ones,
/// nothing for equal ones.
fn shares_note(plan: &BatchPlan, split: &BatchSplit) -> String {
    let shares: Vec<String> = plan.shares.iter().map(|n| n.to_string()).collect();
    match (plan.equal, split) {
        (Some(_), _) => String::new(),
        (None, BatchSplit::Auto) => format!(" (split auto, shares {})", shares.join("+")),
        (None, _) => format!(" (shares {})", shares.join("+")),
    }
}

/// Opens this rank's metrics file: a resumed run appends; a fresh one first moves an earlier run's records
/// aside, and says where.
fn open_metrics(path: &std::path::Path, resuming: bool) -> Result<MetricsWriter> {
    if !resuming {
        if let Some(aside) = set_aside_earlier_run(path)? {
            eprint_line(&format!(
                "metrics: {} held an earlier run's records; moved them to {}",
                path.display(),
                aside.display()
            ));
        }
    }
    MetricsWriter::open(path, resuming)
}

/// What a `train` run shows and writes: rank 0's progress, every rank's metrics file and skip warnings.
struct CliObserver {
    progress: Progress,
    /// This rank's `--metrics` file ([`rank_metrics_path`]), opened once the run has started (nothing is
    /// written for a run refused at its start), appended to when resuming.
    metrics_path: Option<std::path::PathBuf>,
    resuming: bool,
    metrics: Option<MetricsWriter>,
    is_rank0: bool,
    /// Why this backend, and the thread budget, for the start line.
    backend_reason: String,
    /// Rank 0's ring links, for the start line ([`links_note`]).
    links: String,
    comm: CommTotals,
}

/// ` (ring data over shm)`, ` (ring data over quic)`, or both directions when they differ; nothing for a
/// single process.
fn links_note(links: Option<[&str; 2]>) -> String {
    match links {
        Some([left, right]) if left == right => format!(" (ring data over {left})"),
        Some([left, right]) => format!(" (ring data from the left over {left}, to the right over {right})"),
        None => String::new(),
    }
}

/// `, two-level ring (2 hosts x 2 ranks)` when the job runs one; nothing on the flat ring.
fn layout_note(two_level: Option<&TwoLevel>) -> String {
    match two_level {
        Some(t) => format!(", {t}"),
        None => String::new(),
    }
}

impl<B: Backend> RunObserver<B> for CliObserver {
    fn started(&mut self, trainer: &Trainer<B>) -> Result<()> {
        if let Some(path) = &self.metrics_path {
            self.metrics = Some(open_metrics(path, self.resuming)?);
        }
        let (opts, cfg, plan) = (trainer.options(), trainer.model_config(), trainer.batch_plan());
        let shares = shares_note(plan, &opts.batch_split);
        self.progress.message(&format!(
            "ringtrain: {} params ({} layers, {} wide), backend {} [{}], {} rank(s){}, {} update, global batch {}{shares} x {} tokens, {} steps from step {}",
            trainer.param_count(),
            cfg.n_layer,
            cfg.n_embd,
            trainer.backend_name(),
            self.backend_reason,
            trainer.world(),
            self.links,
            opts.update.as_str(),
            plan.global,
            opts.seq_len,
            opts.steps,
            trainer.step()
        ));
        if trainer.step() >= opts.steps {
            self.progress.message(&format!(
                "already at step {} of {}: nothing to train",
                trainer.step(),
                opts.steps
            ));
        }
        Ok(())
    }

    fn step(&mut self, trainer: &mut Trainer<B>, m: &StepMetrics) -> Result<()> {
        self.comm.add(m);
        // Every rank says it skipped (each decides on its own, from the same reduced values); the loss is
        // global, so rank 0 alone reports a spike.
        if m.skipped {
            self.progress.warn(&format_skip_line(m, trainer.rank()));
        }
        if let Some(line) = format_spike_line(m, trainer.options().loss_spike) {
            self.progress.message(&line);
        }
        if let Some(v) = m.val_loss {
            self.progress.message(&format!("step {}: val loss {v:.4}", m.step));
        }
        if let Some(w) = self.metrics.as_mut() {
            w.write(m)?;
        }
        self.progress.update(m);
        Ok(())
    }

    fn saved(&mut self, step: u64, dir: &std::path::Path) {
        if self.is_rank0 {
            self.progress
                .message(&format!("step {step}: saved checkpoint {}", dir.display()));
        }
    }
}

/// Communication over a run, for the summary line.
#[derive(Default)]
struct CommTotals {
    steps: u64,
    step_ms: f64,
    comm_ms: f64,
    exposed_ms: f64,
    sent_bytes: u64,
}

impl CommTotals {
    fn add(&mut self, m: &StepMetrics) {
        self.steps += 1;
        self.step_ms += m.step_ms;
        self.comm_ms += m.comm_ms;
        self.exposed_ms += m.exposed_comm_ms;
        self.sent_bytes += m.sent_bytes;
    }

    /// `, communication 12.3 ms/step, 3.1 ms/step of it exposed (4% of the step), sent 1.2 MB/step`; empty
    /// for one rank. The exposed part is the time the step waited within its collectives, so it never
    /// exceeds them. With `saving` (`--sync outer`, or a compact `--wire`) it adds what every-step sync
    /// would have sent at f32 (a ring all-reduce of the `params` floats: 2 (N − 1) / N × 4 bytes each per
    /// step, frame headers left out).
    fn summary(&self, world: usize, params: usize, saving: bool) -> String {
        if world < 2 || self.steps == 0 {
            return String::new();
        }
        let steps = self.steps as f64;
        let of_step = if self.step_ms > 0.0 {
            100.0 * self.exposed_ms / self.step_ms
        } else {
            0.0
        };
        let sent = self.sent_bytes as f64 / steps;
        let every_step = 2.0 * (world - 1) as f64 / world as f64 * 4.0 * params as f64;
        let saved = match saving && sent > 0.0 {
            true => format!(
                " ({:.1}x less than every-step sync at f32, {})",
                every_step / sent,
                format_bytes(every_step)
            ),
            false => String::new(),
        };
        format!(
            ", communication {:.1} ms/step, {:.1} ms/step of it exposed ({of_step:.0}% of the step), sent {}/step{saved}",
            self.comm_ms / steps,
            self.exposed_ms / steps,
            format_bytes(sent)
        )
    }
}

/// Bytes as `812 B`, `12.3 kB`, `4.5 MB` or `1.20 GB` (decimal units, as link speeds are quoted).
fn format_bytes(bytes: f64) -> String {
    match bytes {
        b if b >= 1e9 => format!("{:.2} GB", b / 1e9),
        b if b >= 1e6 => format!("{:.1} MB", b / 1e6),
        b if b >= 1e3 => format!("{:.1} kB", b / 1e3),
        b => format!("{b:.0} B"),
    }
}

/// `ringtrain bench step`: warm-up steps, then timed steps; ms/step, tokens/s and model GFLOP/s, and with
/// `profile` each op family's time, FLOPs and bytes over the timed steps.
pub fn run_bench_step(mut args: TrainArgs, warmup: u64, profile: bool) -> Result<()> {
    let timed = args.steps.unwrap_or(10).max(1);
    args.steps = Some(timed + warmup);
    args.eval_every = Some(0);
    args.save = None;
    let s = setup(args)?;
    let (mut be, _) = open_backend(s.backend, s.launch.local_rank)?;
    be.set_matmul_precision(s.matmul_precision)?;
    let plan_peak = check_memory_plan(&s, &*be)?.peak();
    let (be, profiled): (Box<dyn Backend>, _) = match profile {
        true => {
            let (p, handle) = Profiled::new(be);
            (Box::new(p), Some(handle))
        }
        false => (be, None),
    };
    ensure!(
        s.opts.elastic.is_none(),
        "bench step times steps, not recoveries: --elastic applies to train"
    );
    let comm = connect(&s)?.comm;
    let mut trainer = Trainer::new(be, s.source, s.data, s.opts, comm).map_err(with_flag_hints)?;
    arm_faults(&mut trainer, &s.faults);
    // The losses of the first and last steps: a step-1 loss far from ln(vocab) means the model computes wrong.
    let mut first_loss = None;
    for _ in 0..warmup {
        let loss = trainer.train_step()?.loss;
        first_loss.get_or_insert(loss);
    }
    if let Some(p) = &profiled {
        p.lock().expect("profile lock").families.clear();
    }
    let started = std::time::Instant::now();
    let mut comm = CommTotals::default();
    let mut last_loss = f64::NAN;
    for _ in 0..timed {
        let step = trainer.train_step()?;
        comm.add(&step);
        last_loss = step.loss;
        first_loss.get_or_insert(step.loss);
    }
    let secs = started.elapsed().as_secs_f64();
    let tokens = trainer.tokens_per_step() as f64 * timed as f64;
    // Forward + backward = 3x the forward FLOPs.
    let flops = 3.0 * trainer.flops_per_token() * tokens;
    let profile_rows = profiled.map(|p| {
        let p = p.lock().expect("profile lock").clone();
        eprint!("{}", profile_table(&p, timed, secs));
        profile_json(&p, timed)
    });
    let line = serde_json::json!({
        "impl": "ringtrain",
        "backend": trainer.backend_name(),
        "params": trainer.param_count(),
        "batch": trainer.options().batch_size * trainer.options().grad_accum,
        "seq": trainer.options().seq_len,
        "steps": timed,
        "ms_per_step": secs * 1e3 / timed as f64,
        "tokens_per_s": tokens / secs,
        "gflops": flops / secs / 1e9,
        "comm_ms": comm.comm_ms / timed as f64,
        "exposed_comm_ms": comm.exposed_ms / timed as f64,
        "world_size": trainer.world(),
        "plan_peak_bytes": plan_peak,
        "measured_peak_bytes": measured_peak(),
        "first_loss": first_loss,
        "last_loss": last_loss,
        "profile": profile_rows,
    });
    println!("{line}");
    Ok(())
}

/// The per-family table `bench step --profile` prints: per step, each family's calls, time and share of
/// the step, its FLOPs and bytes (counts by `backend::op_cost`'s conventions) and the rates they give.
fn profile_table(p: &Profile, steps: u64, step_secs: f64) -> String {
    let per = |x: f64| x / steps as f64;
    let mut s = format!(
        "# per-op profile over {steps} step(s), per step (FLOPs and bytes are counts: backend/op_cost.rs; \
         one synchronisation after each op)\n{:<14} {:>7} {:>10} {:>7} {:>10} {:>9} {:>9} {:>8}\n",
        "op family", "calls", "ms", "step %", "GFLOP", "GB", "GFLOP/s", "GB/s"
    );
    let rows = OpFamily::ALL.iter().map(|&f| (f.name(), p.get(f)));
    let total = FamilyTotals {
        calls: p.families.values().map(|t| t.calls).sum(),
        flops: p.families.values().map(|t| t.flops).sum(),
        bytes: p.families.values().map(|t| t.bytes).sum(),
        seconds: p.seconds(),
    };
    for (name, t) in rows.chain(std::iter::once(("all ops", total))) {
        let rate = |x: f64| if t.seconds > 0.0 { x / t.seconds / 1e9 } else { 0.0 };
        s.push_str(&format!(
            "{name:<14} {:>7.0} {:>10.2} {:>7.1} {:>10.3} {:>9.3} {:>9.1} {:>8.2}\n",
            per(t.calls as f64),
            per(t.seconds) * 1e3,
            100.0 * t.seconds / step_secs.max(f64::MIN_POSITIVE),
            per(t.flops) / 1e9,
            per(t.bytes) / 1e9,
            rate(t.flops),
            rate(t.bytes),
        ));
    }
    s
}

/// The profile's rows for the JSON line, per step.
fn profile_json(p: &Profile, steps: u64) -> serde_json::Value {
    let per = |x: f64| x / steps as f64;
    OpFamily::ALL
        .iter()
        .map(|&f| {
            let t = p.get(f);
            serde_json::json!({
                "family": f.name(),
                "calls": per(t.calls as f64),
                "ms": per(t.seconds) * 1e3,
                "flops": per(t.flops),
                "bytes": per(t.bytes),
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::CommTotals;

    #[test]
    fn the_summary_gives_communication_the_exposed_part_and_the_bytes_sent() {
        // Two steps of 10 ms, with 4 ms of collectives of which the step waited 2.5 ms, 3 MB sent.
        let totals = CommTotals {
            steps: 2,
            step_ms: 20.0,
            comm_ms: 8.0,
            exposed_ms: 5.0,
            sent_bytes: 3_000_000,
        };
        assert_eq!(
            totals.summary(2, 1_000_000, false),
            ", communication 4.0 ms/step, 2.5 ms/step of it exposed (25% of the step), sent 1.5 MB/step"
        );
        // Every-step sync over 2 ranks sends 4 bytes per parameter per step: 4 MB against 1.5.
        assert!(totals
            .summary(2, 1_000_000, true)
            .ends_with("sent 1.5 MB/step (2.7x less than every-step sync at f32, 4.0 MB)"));
        assert_eq!(totals.summary(1, 1_000_000, false), "");
    }
}
