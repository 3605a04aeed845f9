//! The `ringtrain` binary end to end: training lowers the loss, resume continues bit-identically, a kill
//! in the middle of a save leaves a whole checkpoint, and bad inputs give clear errors (not panics).

use ringtrain::model::checkpoint::{load_model, load_trainer_state, resolve_checkpoint_dir};
use ringtrain::model::ParamLayout;
use std::path::Path;
use std::process::{Command, Stdio};

mod common;
use common::ringtrain;
use std::time::Duration;

fn ok(args: &[&str]) -> String {
    let out = ringtrain(args);
    let stderr = String::from_utf8_lossy(&out.stderr).to_string();
    assert!(out.status.success(), "ringtrain {args:?} failed:\n{stderr}");
    stderr
}

/// Runs a command that must fail cleanly, with `needle` in its error (see [`common::fails_with_all`]).
fn fails_with(args: &[&str], needle: &str) {
    common::fails_with_all(args, &[needle]);
}

const SMALL: [&str; 12] = [
    "--model",
    "tiny",
    "--n-layer",
    "1",
    "--seq-len",
    "16",
    "--batch-size",
    "2",
    "--eval-every",
    "0",
    "--lr",
    "3e-3",
];

fn with<'a>(base: &[&'a str], extra: &[&'a str]) -> Vec<&'a str> {
    let mut v = vec!["train"];
    v.extend_from_slice(base);
    v.extend_from_slice(extra);
    v
}

#[test]
fn train_lowers_loss_and_writes_metrics_and_plot() {
    let dir = tempfile::tempdir().unwrap();
    let metrics = dir.path().join("m.jsonl");
    let png = dir.path().join("loss.png");
    let m = metrics.to_str().unwrap();
    ok(&with(&SMALL, &["--steps", "60", "--metrics", m]));
    let records = ringtrain::metrics::read_metrics(&metrics).unwrap();
    assert_eq!(records.len(), 60);
    let first = records[0].loss;
    let last = records.iter().rev().take(5).map(|r| r.loss).sum::<f64>() / 5.0;
    assert!(first > 5.0 && last < first - 1.5, "loss {first} -> {last}");
    assert_eq!(records[59].tokens, 60 * 2 * 16);
    ok(&["plot", m, "-o", png.to_str().unwrap()]);
    assert!(std::fs::read(&png).unwrap().starts_with(b"\x89PNG"));
}

fn params_and_state(dir: &Path) -> (Vec<f32>, Vec<f32>, Vec<f32>, u64) {
    let (cfg, params) = load_model(dir).unwrap();
    let state = load_trainer_state(dir, &ParamLayout::new(&cfg)).unwrap();
    (params, state.m, state.v, state.step)
}

#[test]
fn resume_continues_bit_identically() {
    // A constant schedule (with warmup) does not depend on --steps, so "train 5, then resume to 12" must
    // equal "train 12" bit for bit: parameters and both AdamW moments. (The cosine case, where the first leg
    // must already know the final step count, is covered at the library level in tests/resume.rs.)
    let dir = tempfile::tempdir().unwrap();
    let (full, part) = (dir.path().join("full"), dir.path().join("part"));
    let mut base: Vec<&str> = SMALL.to_vec();
    base.extend_from_slice(&[
        "--grad-accum",
        "2",
        "--warmup",
        "3",
        "--grad-clip",
        "0.5",
        "--lr-schedule",
        "constant",
    ]);
    ok(&with(&base, &["--steps", "12", "--save", full.to_str().unwrap()]));
    ok(&with(&base, &["--steps", "5", "--save", part.to_str().unwrap()]));
    assert_eq!(params_and_state(&part).3, 5);
    ok(&with(
        &base,
        &[
            "--steps",
            "12",
            "--resume",
            part.to_str().unwrap(),
            "--save",
            part.to_str().unwrap(),
        ],
    ));
    let (a, b) = (params_and_state(&full), params_and_state(&part));
    assert_eq!((a.3, b.3), (12, 12));
    assert!(a.0 == b.0, "parameters differ after resume");
    assert!(a.1 == b.1 && a.2 == b.2, "optimizer moments differ after resume");
}

#[test]
fn kill_during_saves_leaves_a_whole_checkpoint() {
    // Save after every step and SIGKILL the process at varying moments; each time the checkpoint (possibly
    // recovered from the interrupted swap) must load completely, model and trainer state.
    let dir = tempfile::tempdir().unwrap();
    let ckpt = dir.path().join("ckpt");
    let args = with(
        &SMALL,
        &[
            "--steps",
            "100000",
            "--save",
            ckpt.to_str().unwrap(),
            "--save-every",
            "1",
        ],
    );
    let mut last_step = 0;
    for (i, ms) in [0u64, 130, 210, 370, 450].iter().enumerate() {
        let mut child = Command::new(env!("CARGO_BIN_EXE_ringtrain"))
            .args(&args)
            .args(if i == 0 {
                vec![]
            } else {
                vec!["--resume", ckpt.to_str().unwrap()]
            })
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        if i == 0 {
            // However slow the machine, let the first run write one checkpoint before the kills start.
            let started = std::time::Instant::now();
            while resolve_checkpoint_dir(&ckpt).is_err() && started.elapsed() < Duration::from_secs(120) {
                std::thread::sleep(Duration::from_millis(20));
            }
        }
        std::thread::sleep(Duration::from_millis(*ms));
        child.kill().unwrap();
        child.wait().unwrap();
        let resolved = resolve_checkpoint_dir(&ckpt).expect("a whole checkpoint survives every kill");
        let (params, m, v, step) = params_and_state(&resolved);
        assert!(params.iter().all(|x| x.is_finite()) && m.len() == params.len() && v.len() == params.len());
        assert!(
            step >= last_step,
            "checkpoint went back from step {last_step} to {step}"
        );
        last_step = step;
    }
    assert!(last_step > 0, "no checkpoint was ever written");
}

#[test]
fn bad_inputs_give_clear_errors() {
    let dir = tempfile::tempdir().unwrap();
    let p = |name: &str| dir.path().join(name).to_str().unwrap().to_string();
    // A shard with the wrong magic.
    std::fs::write(p("bad.bin"), vec![0u8; 1024 + 20]).unwrap();
    fails_with(&with(&SMALL, &["--data", &p("bad.bin")]), "magic");
    // A truncated shard: header says 1000 tokens, the file holds 10.
    let mut header = vec![0u8; 1024];
    header[0..4].copy_from_slice(&20240520i32.to_le_bytes());
    header[4..8].copy_from_slice(&1i32.to_le_bytes());
    header[8..12].copy_from_slice(&1000i32.to_le_bytes());
    let mut truncated = header.clone();
    truncated.extend_from_slice(&[0u8; 20]);
    std::fs::write(p("short.bin"), truncated).unwrap();
    fails_with(&with(&SMALL, &["--data", &p("short.bin")]), "short.bin");
    // Invalid UTF-8 text.
    std::fs::write(p("bad.txt"), b"hello \xff\xfe world").unwrap();
    fails_with(&with(&SMALL, &["--data", &p("bad.txt")]), "UTF-8");
    // A checkpoint whose safetensors header is garbage.
    let ck = dir.path().join("ck");
    ok(&with(&SMALL, &["--steps", "1", "--save", ck.to_str().unwrap()]));
    std::fs::write(ck.join("model.safetensors"), b"\xff\xff\xff\xff\xff\xff\xff\x7fgarbage").unwrap();
    fails_with(
        &["sample", "--checkpoint", ck.to_str().unwrap(), "--tokens", "2"],
        "model.safetensors",
    );
    // config.json with shapes that disagree with the tensors.
    let ck2 = dir.path().join("ck2");
    ok(&with(&SMALL, &["--steps", "1", "--save", ck2.to_str().unwrap()]));
    let cfg = std::fs::read_to_string(ck2.join("config.json"))
        .unwrap()
        .replace("\"n_embd\": 64", "\"n_embd\": 32");
    std::fs::write(ck2.join("config.json"), cfg).unwrap();
    fails_with(
        &["eval", "--checkpoint", ck2.to_str().unwrap(), "--data", "synthetic"],
        "shape",
    );
    // Flags out of range.
    fails_with(&with(&SMALL, &["--seq-len", "65"]), "--seq-len");
    fails_with(&with(&SMALL[..10], &["--lr=-1"]), "--lr");
    // A negative number after a flag is its value, and the message is about the value.
    fails_with(
        &with(&SMALL[..10], &["--lr", "-1"]),
        "--lr -1 must be a positive number",
    );
    fails_with(&with(&SMALL, &["--steps", "-3"]), "invalid value '-3' for '--steps");
    fails_with(&with(&SMALL, &["--shuffle", "maybe"]), "--shuffle");
    fails_with(&["train", "--model", "huge"], "unknown model preset");
    fails_with(&with(&SMALL, &["--backend", "nope"]), "--backend");
    // TF32 is CUDA's: the CPU backend refuses it by name; an unknown precision lists the known ones.
    fails_with(
        &with(&SMALL, &["--backend", "cpu", "--matmul-precision", "tf32"]),
        "--matmul-precision tf32 needs the cuda backend: cpu",
    );
    fails_with(&with(&SMALL, &["--matmul-precision", "fp16"]), "expected fp32 or tf32");
    // A TOML config with an unknown key.
    std::fs::write(p("run.toml"), "batch-size = 2\nbogus-key = 1\n").unwrap();
    fails_with(&["train", "--config", &p("run.toml")], "bogus-key");
}

#[test]
fn toml_config_supplies_flags_and_flags_win() {
    let dir = tempfile::tempdir().unwrap();
    let toml = dir.path().join("run.toml");
    let metrics = dir.path().join("m.jsonl");
    std::fs::write(
        &toml,
        format!(
            "model = \"tiny\"\nn-layer = 1\nseq-len = 8\nbatch-size = 3\nsteps = 4\nmetrics = {:?}\neval-every = 0\n",
            metrics
        ),
    )
    .unwrap();
    ok(&["train", "--config", toml.to_str().unwrap(), "--steps", "2"]);
    let records = ringtrain::metrics::read_metrics(&metrics).unwrap();
    assert_eq!(records.len(), 2, "--steps on the command line overrides the file");
    assert_eq!(
        records[1].tokens,
        2 * 3 * 8,
        "batch-size and seq-len come from the file"
    );
}

/// `--loss-spike X` (here from the TOML file) warns, naming the step, whenever a loss exceeds X times the
/// running average of the earlier losses, and marks that step in the metrics; it changes nothing else, and
/// `--loss-spike 0` on the command line turns it off.
#[test]
fn a_loss_spike_is_logged_and_marked_in_the_metrics() {
    let dir = tempfile::tempdir().unwrap();
    let toml = dir.path().join("run.toml");
    std::fs::write(&toml, "loss-spike = 4\n").unwrap();
    let (spiky, quiet) = (dir.path().join("spiky.jsonl"), dir.path().join("quiet.jsonl"));
    // A learning rate of 1 without warmup throws the model off at its first update: the loss jumps.
    let mut base: Vec<&str> = SMALL[..10].to_vec();
    base.extend_from_slice(&[
        "--lr",
        "1",
        "--warmup",
        "0",
        "--lr-schedule",
        "constant",
        "--steps",
        "6",
    ]);
    base.extend_from_slice(&["--config", toml.to_str().unwrap()]);
    let stderr = ok(&with(&base, &["--metrics", spiky.to_str().unwrap()]));
    let records = ringtrain::metrics::read_metrics(&spiky).unwrap();
    // The reference is the moving average (weight 0.1 on the newest) of the losses before each step.
    let mut average: Option<f64> = None;
    let mut flagged = Vec::new();
    for r in &records {
        let warned = stderr.contains(&format!("warning: step {}: loss spike: loss {:.4}", r.step, r.loss));
        match average {
            Some(avg) if r.loss > 4.0 * avg => {
                let reference = r.loss_spike_reference.expect("a spike step is marked");
                assert!(
                    (reference - avg).abs() < 1e-9 * avg,
                    "step {}: {reference} vs {avg}",
                    r.step
                );
                assert!(warned, "step {} not logged:\n{stderr}", r.step);
                flagged.push(r.step);
            }
            _ => assert!(
                r.loss_spike_reference.is_none() && !warned,
                "step {}:\n{stderr}",
                r.step
            ),
        }
        average = Some(average.map_or(r.loss, |avg| avg + 0.1 * (r.loss - avg)));
    }
    assert!(!flagged.is_empty(), "no spike in {records:?}");
    assert!(stderr.contains("(--loss-spike 4)"), "{stderr}");
    // Off: no warning, no mark, and the same losses bit for bit.
    let stderr = ok(&with(
        &base,
        &["--loss-spike", "0", "--metrics", quiet.to_str().unwrap()],
    ));
    assert!(!stderr.contains("loss spike"), "{stderr}");
    let off = ringtrain::metrics::read_metrics(&quiet).unwrap();
    assert!(off.iter().all(|r| r.loss_spike_reference.is_none()));
    let losses = |rs: &[ringtrain::metrics::StepMetrics]| rs.iter().map(|r| r.loss.to_bits()).collect::<Vec<_>>();
    assert_eq!(losses(&off), losses(&records));
    // A factor that would flag ordinary noise is refused.
    fails_with(
        &with(&SMALL, &["--loss-spike", "1"]),
        "--loss-spike 1 must be a factor over 1",
    );
}

#[test]
fn sample_and_eval_run_on_a_checkpoint() {
    let dir = tempfile::tempdir().unwrap();
    let ck = dir.path().join("ck");
    ok(&with(&SMALL, &["--steps", "3", "--save", ck.to_str().unwrap()]));
    let out = ringtrain(&[
        "sample",
        "--checkpoint",
        ck.to_str().unwrap(),
        "--prompt",
        "Once",
        "--tokens",
        "20",
    ]);
    assert!(out.status.success());
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.starts_with("Once") && text.len() > 4);
    let out = ringtrain(&[
        "eval",
        "--checkpoint",
        ck.to_str().unwrap(),
        "--data",
        "synthetic",
        "--seq-len",
        "16",
    ]);
    assert!(out.status.success());
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert!(v["loss"].as_f64().unwrap() > 0.0);
}

#[test]
fn launch_trains_data_parallel_over_quic() {
    // Two processes with batch 2 each see the same global batch as one process with batch 4: the losses
    // agree up to float reassociation, and the checkpoint rank 0 writes carries world size 2.
    let dir = tempfile::tempdir().unwrap();
    let (dp, single) = (dir.path().join("dp.jsonl"), dir.path().join("single.jsonl"));
    let ck = dir.path().join("ck");
    let base = [
        "--model",
        "tiny",
        "--n-layer",
        "1",
        "--seq-len",
        "16",
        "--eval-every",
        "0",
        "--steps",
        "6",
    ];
    let mut launch = vec![
        "launch",
        "--nproc",
        "2",
        "--",
        "train",
        "--batch-size",
        "2",
        "--verify-every",
        "2",
    ];
    launch.extend_from_slice(&base);
    launch.extend_from_slice(&["--metrics", dp.to_str().unwrap(), "--save", ck.to_str().unwrap()]);
    ok(&launch);
    ok(&with(
        &base,
        &["--batch-size", "4", "--metrics", single.to_str().unwrap()],
    ));
    let (a, b) = (
        ringtrain::metrics::read_metrics(&dp).unwrap(),
        ringtrain::metrics::read_metrics(&single).unwrap(),
    );
    assert_eq!(a.len(), 6);
    for (x, y) in a.iter().zip(&b) {
        assert_eq!(x.world_size, 2);
        assert!(
            (x.loss - y.loss).abs() < 1e-4,
            "step {}: {} vs {}",
            x.step,
            x.loss,
            y.loss
        );
    }
    assert!(
        a[1].param_hash.is_some() && a[0].param_hash.is_none(),
        "verified every 2 steps"
    );
    // The exposed part of communication is part of it, by definition, in every record.
    for x in &a {
        assert!(x.comm_ms > 0.0, "step {}: {x:?}", x.step);
        assert!(x.exposed_comm_ms <= x.comm_ms, "step {}: {x:?}", x.step);
    }
    // Rank 1 writes its own file beside rank 0's: the same global values, its own timings.
    let rank1 = ringtrain::metrics::read_metrics(dir.path().join("dp.rank1.jsonl")).unwrap();
    assert_eq!(rank1.len(), a.len());
    for (x, y) in a.iter().zip(&rank1) {
        assert_eq!((x.rank, y.rank), (0, 1));
        assert_eq!(
            (x.step, x.loss.to_bits(), x.grad_norm.to_bits()),
            (y.step, y.loss.to_bits(), y.grad_norm.to_bits())
        );
        assert_eq!(x.param_hash, y.param_hash, "step {}", x.step);
        assert!(
            y.comm_ms > 0.0 && y.exposed_comm_ms <= y.comm_ms,
            "step {}: {y:?}",
            y.step
        );
    }
    let (cfg, _) = load_model(&ck).unwrap();
    let state = load_trainer_state(&ck, &ParamLayout::new(&cfg)).unwrap();
    assert_eq!((state.world_size, state.step), (2, 6));
}

/// Each rank gets the host's cores divided by the ranks `launch` starts on it, unless `--threads` says
/// otherwise; a thread count of 0 is refused.
#[test]
fn launch_divides_the_cores_among_its_ranks() {
    let train = [
        "train",
        "--model",
        "tiny",
        "--n-layer",
        "1",
        "--seq-len",
        "8",
        "--batch-size",
        "1",
    ];
    let run = |extra: &[&str]| {
        let mut args = vec!["launch", "--nproc", "2", "--"];
        args.extend_from_slice(&train);
        args.extend_from_slice(&["--steps", "1", "--eval-every", "0"]);
        args.extend_from_slice(extra);
        let out = Command::new(env!("CARGO_BIN_EXE_ringtrain"))
            .args(&args)
            .env_remove("RAYON_NUM_THREADS")
            .output()
            .expect("run ringtrain");
        let stderr = String::from_utf8_lossy(&out.stderr).to_string();
        assert!(out.status.success(), "{args:?} failed:\n{stderr}");
        stderr
    };
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let each = (cores / 2).max(1);
    let plural = if each == 1 { "" } else { "s" };
    let want = format!("{each} compute thread{plural} ({cores} cores / 2 local rank(s))");
    let stderr = run(&[]);
    assert!(stderr.contains(&want), "expected {want:?} in\n{stderr}");
    let stderr = run(&["--threads", "3"]);
    assert!(stderr.contains("3 compute threads (--threads)"), "{stderr}");
    let mut zero = train.to_vec();
    zero.extend_from_slice(&["--threads", "0"]);
    fails_with(&zero, "--threads 0 must be between 1 and 1024");
}

/// A run whose memory plan cannot fit (terabytes of activations) is refused at start, with the plan's
/// largest term named, instead of failing on an allocation.
#[test]
fn a_run_that_cannot_fit_is_refused_at_start() {
    let args = [
        "train",
        "--model",
        "gpt2",
        "--batch-size",
        "4096",
        "--seq-len",
        "1024",
        "--steps",
        "1",
    ];
    fails_with(&args, "the largest term is activations");
    let out = ringtrain(&args);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("memory plan: parameters 474.7 MiB"), "{stderr}");
}

/// `bench step --profile`: one row per op family on stderr, and in the JSON line per step the counts the
/// model's shapes give (tiny, one block: 6 FLOPs per matmul weight and 2 per bias for each token).
#[test]
fn bench_step_profiles_every_op_family() {
    let mut args = vec![
        "bench",
        "step",
        "--steps",
        "2",
        "--warmup-steps",
        "1",
        "--profile",
        "--backend",
        "cpu",
    ];
    args.extend_from_slice(&SMALL);
    let out = ringtrain(&args);
    let (stdout, stderr) = (
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
    );
    assert!(out.status.success(), "{stderr}");
    for family in [
        "matmul",
        "attention",
        "layer norm",
        "gelu",
        "cross-entropy",
        "embedding",
        "adamw",
        "all ops",
    ] {
        assert!(
            stderr.lines().any(|l| l.starts_with(family)),
            "no {family} row in\n{stderr}"
        );
    }
    let line: serde_json::Value = serde_json::from_str(stdout.trim()).unwrap();
    let matmul = &line["profile"][0];
    assert_eq!(matmul["family"], "matmul");
    let cfg = ringtrain::model::ModelConfig {
        n_layer: 1,
        ..ringtrain::model::ModelConfig::tiny()
    };
    let (c, v) = (cfg.n_embd as f64, cfg.vocab_size as f64);
    let tokens = 2.0 * 16.0;
    let want = tokens * (6.0 * (12.0 * c * c + v * c) + 2.0 * 9.0 * c);
    assert_eq!(matmul["flops"].as_f64().unwrap(), want, "{line}");
    assert!(matmul["ms"].as_f64().unwrap() > 0.0, "{line}");
}

#[test]
fn bench_allreduce_prints_an_nccl_tests_table() {
    let out = ringtrain(&[
        "bench",
        "allreduce",
        "--nproc",
        "3",
        "--size",
        "4KiB,64KiB",
        "--iters",
        "2",
    ]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(stdout.contains("busbw"), "{stdout}");
    let rows: Vec<&str> = stdout.lines().filter(|l| l.contains("KiB")).collect();
    assert_eq!(rows.len(), 2, "{stdout}");
    fails_with(&["bench", "allreduce", "--nproc", "2", "--size", "3B"], "multiple of 4");
    // Every rank process gets the wire format, and the title says what ran.
    let out = ringtrain(&[
        "bench",
        "allreduce",
        "--nproc",
        "2",
        "--size",
        "64KiB",
        "--iters",
        "1",
        "--wire",
        "int8",
    ]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(stdout.contains("values sent as int8"), "{stdout}");
    fails_with(
        &["bench", "allreduce", "--nproc", "2", "--wire", "fp8"],
        "possible values: f32, bf16, int8",
    );
}

/// Backend errors reach the user with the flag that avoids them: a shape past llvmpipe's loop budget names
/// --batch-size (the library's wording names only the quantities), and CUDA names what is missing.
#[test]
fn backend_errors_name_the_flags_that_avoid_them() {
    if !cfg!(feature = "cuda") {
        common::fails_with_all(
            &with(&SMALL, &["--backend", "cuda"]),
            &["--backend cuda", "cuda backend", "`cuda` cargo feature"],
        );
    }
    let adapters = ringtrain::backend::wgpu::list_adapters();
    let software = adapters.iter().any(|a| a.is_software && a.unsupported.is_none());
    let found = if software {
        Ok(())
    } else {
        Err(anyhow::anyhow!("no software adapter with a loop budget"))
    };
    if ringtrain::backend::testing::open_or_skip(ringtrain::backend::testing::Device::Wgpu, found).is_none() {
        return;
    }
    // 1024 sequences of 64 tokens: 65536 tokens per rank, one past what a software adapter's loops reach.
    let args = [
        "train",
        "--model",
        "tiny",
        "--n-layer",
        "1",
        "--seq-len",
        "64",
        "--batch-size",
        "1024",
        "--steps",
        "1",
        "--eval-every",
        "0",
        "--backend",
        "wgpu",
    ];
    fails_with(&args, "--batch-size");
    fails_with(&args, "65535");
}

/// A `--save` path that cannot take a checkpoint is refused before the first step (here a file stands where
/// a directory must go, and a directory holds a file that is not a checkpoint's), in one process and on rank
/// 0 of a launched job; nothing is trained and nothing is written.
#[test]
fn a_save_path_that_cannot_take_a_checkpoint_is_refused_before_training() {
    let dir = tempfile::tempdir().unwrap();
    let afile = dir.path().join("afile");
    std::fs::write(&afile, b"not a directory").unwrap();
    let metrics = dir.path().join("m.jsonl");
    let under_file = afile.join("sub");
    let args = with(
        &SMALL,
        &[
            "--steps",
            "500",
            "--save",
            under_file.to_str().unwrap(),
            "--metrics",
            metrics.to_str().unwrap(),
        ],
    );
    common::fails_with_all(&args, &["--save", "was not started", "afile"]);
    assert!(!metrics.exists(), "no step ran, so no metrics were written");
    let notes = dir.path().join("notes");
    std::fs::create_dir(&notes).unwrap();
    std::fs::write(notes.join("todo.txt"), b"mine").unwrap();
    fails_with(
        &with(&SMALL, &["--steps", "500", "--save", notes.to_str().unwrap()]),
        "it is not empty and is not a checkpoint",
    );
    assert_eq!(std::fs::read(notes.join("todo.txt")).unwrap(), b"mine");
    let mut launch = vec!["launch", "--nproc", "2", "--"];
    launch.extend(with(
        &SMALL,
        &["--steps", "500", "--save", under_file.to_str().unwrap()],
    ));
    common::fails_with_all(&launch, &["--save", "was not started"]);
    assert_eq!(std::fs::read(&afile).unwrap(), b"not a directory");
}

/// A save that fails in the middle of a run stops it with an error naming the step and the checkpoint that
/// is still whole; that checkpoint loads, and the file that made the save fail is untouched.
#[test]
fn a_save_that_fails_mid_run_stops_the_run_and_keeps_the_last_checkpoint() {
    let dir = tempfile::tempdir().unwrap();
    let ck = dir.path().join("ck");
    let child = Command::new(env!("CARGO_BIN_EXE_ringtrain"))
        .args(with(
            &SMALL,
            &["--steps", "100000", "--save-every", "1", "--save", ck.to_str().unwrap()],
        ))
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // Once the first checkpoint is in place, put a file there that no checkpoint holds: every later save
    // refuses to replace the directory.
    let started = std::time::Instant::now();
    while !ck.join("trainer_state.safetensors").is_file() {
        assert!(started.elapsed() < Duration::from_secs(120), "no checkpoint appeared");
        std::thread::sleep(Duration::from_millis(5));
    }
    // A save in progress renames the directory away and its replacement in: between the two renames the
    // path is briefly absent, so the write is retried then.
    while let Err(e) = std::fs::write(ck.join("notes.txt"), b"mine") {
        assert!(
            e.kind() == std::io::ErrorKind::NotFound && started.elapsed() < Duration::from_secs(120),
            "{e}"
        );
        std::thread::sleep(Duration::from_millis(1));
    }
    let out = child.wait_with_output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{stderr}");
    assert!(!stderr.contains("panicked"), "{stderr}");
    for needle in [
        "saving the checkpoint to",
        "failed, so the run stops",
        "there is whole",
        "--resume",
        "notes.txt",
    ] {
        assert!(stderr.contains(needle), "missing {needle:?} in:\n{stderr}");
    }
    let (params, _, _, step) = params_and_state(&ck);
    assert!(step >= 1 && !params.is_empty());
    assert!(
        stderr.contains(&format!("the checkpoint of step {step} there is whole")),
        "{stderr}"
    );
    assert_eq!(std::fs::read(ck.join("notes.txt")).unwrap(), b"mine");
}

/// `eval --data DIR` scores the `_val_` shards of an llm.c-style directory (as `train --data DIR` validates
/// on them) and says on stderr which files it read; stdout keeps its one JSON line.
#[test]
fn eval_of_a_shard_directory_reads_its_val_shards() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    std::fs::create_dir(&data).unwrap();
    // The training shard repeats one pattern; the validation shard is different text.
    let train: Vec<u32> = b"abcabcabc ".iter().cycle().take(4000).map(|&b| u32::from(b)).collect();
    let val: Vec<u32> = b"the quick brown fox jumps. "
        .iter()
        .cycle()
        .take(2000)
        .map(|&b| u32::from(b))
        .collect();
    ringtrain::data::write_shard(&data.join("byte_train_000001.bin"), &train).unwrap();
    ringtrain::data::write_shard(&data.join("byte_val_000000.bin"), &val).unwrap();
    let ck = dir.path().join("ck");
    ok(&with(&SMALL, &["--steps", "2", "--save", ck.to_str().unwrap()]));
    let eval = |spec: &Path| {
        let out = ringtrain(&[
            "eval",
            "--checkpoint",
            ck.to_str().unwrap(),
            "--data",
            spec.to_str().unwrap(),
            "--seq-len",
            "16",
        ]);
        let stderr = String::from_utf8_lossy(&out.stderr).to_string();
        assert!(out.status.success(), "{stderr}");
        let stdout = String::from_utf8_lossy(&out.stdout).to_string();
        assert_eq!(stdout.lines().count(), 1, "{stdout}");
        let v: serde_json::Value = serde_json::from_str(&stdout).unwrap();
        (v["loss"].as_f64().unwrap(), stderr)
    };
    let (of_dir, said) = eval(&data);
    assert!(
        said.contains("the _val_ shards of") && said.contains("byte_val_000000.bin"),
        "{said}"
    );
    assert!(!said.contains("byte_train_000001.bin"), "{said}");
    let (of_val, _) = eval(&data.join("byte_val_000000.bin"));
    let (of_train, _) = eval(&data.join("byte_train_000001.bin"));
    assert_eq!(of_dir.to_bits(), of_val.to_bits());
    assert_ne!(of_dir.to_bits(), of_train.to_bits());
}

/// Shards of GPT-2 tokens trained with the byte tokenizer: the error names the flag that fits them.
#[test]
fn out_of_range_tokens_name_the_tokenizer_flag() {
    let dir = tempfile::tempdir().unwrap();
    let shard = dir.path().join("gpt2_train_000001.bin");
    let tokens: Vec<u32> = (0..2000u32).map(|i| (i * 7919) % 50257).collect();
    ringtrain::data::write_shard(&shard, &tokens).unwrap();
    common::fails_with_all(
        &with(&SMALL, &["--data", shard.to_str().unwrap(), "--steps", "1"]),
        &["out of range for a vocabulary of 256", "--tokenizer gpt2"],
    );
}

/// A fresh run does not overwrite an earlier run's metrics: they move to `FILE.1` (then `.2`), and the run
/// says so; a resumed run appends.
#[test]
fn an_earlier_runs_metrics_are_kept() {
    let dir = tempfile::tempdir().unwrap();
    let metrics = dir.path().join("m.jsonl");
    let ck = dir.path().join("ck");
    let m = metrics.to_str().unwrap();
    ok(&with(
        &SMALL,
        &["--steps", "3", "--metrics", m, "--save", ck.to_str().unwrap()],
    ));
    let stderr = ok(&with(&SMALL, &["--steps", "2", "--metrics", m]));
    let aside = dir.path().join("m.jsonl.1");
    assert!(
        stderr.contains("moved them to") && stderr.contains("m.jsonl.1"),
        "{stderr}"
    );
    assert_eq!(ringtrain::metrics::read_metrics(&aside).unwrap().len(), 3);
    assert_eq!(ringtrain::metrics::read_metrics(&metrics).unwrap().len(), 2);
    // Resuming the first run appends to the file named.
    std::fs::rename(&aside, &metrics).unwrap();
    ok(&with(
        &SMALL,
        &["--steps", "5", "--metrics", m, "--resume", ck.to_str().unwrap()],
    ));
    let steps: Vec<u64> = ringtrain::metrics::read_metrics(&metrics)
        .unwrap()
        .iter()
        .map(|r| r.step)
        .collect();
    assert_eq!(steps, vec![1, 2, 3, 4, 5]);
}

/// `--sync outer` from the command line: two processes over QUIC, outer records on the outer steps only,
/// no bytes sent on inner steps, the summary's saving against every-step sync; and its flags' errors.
#[test]
fn launch_trains_with_periodic_outer_synchronisation() {
    let dir = tempfile::tempdir().unwrap();
    let metrics = dir.path().join("m.jsonl");
    let mut args = vec!["launch", "--nproc", "2", "--", "train"];
    args.extend_from_slice(&SMALL);
    args.extend_from_slice(&[
        "--steps",
        "6",
        "--sync",
        "outer",
        "--outer-every",
        "3",
        "--verify-every",
        "3",
    ]);
    args.extend_from_slice(&["--metrics", metrics.to_str().unwrap()]);
    let stderr = ok(&args);
    assert!(stderr.contains("x less than every-step sync at f32"), "{stderr}");
    for path in [metrics.clone(), dir.path().join("m.rank1.jsonl")] {
        let m = ringtrain::metrics::read_metrics(&path).unwrap();
        assert_eq!(m.len(), 6);
        for x in &m {
            let outer = x.step % 3 == 0;
            assert_eq!(x.outer.is_some(), outer, "step {}", x.step);
            assert_eq!(x.param_hash.is_some(), outer, "step {}", x.step);
            assert_eq!(x.sent_bytes == 0, !outer, "step {}: {} bytes", x.step, x.sent_bytes);
        }
    }
    fails_with(&with(&SMALL, &["--outer-every", "3"]), "apply to --sync outer only");
    fails_with(
        &with(&SMALL, &["--sync", "outer", "--outer-every", "4", "--steps", "6"]),
        "--steps 6 is not a multiple of --outer-every 4",
    );
    fails_with(&with(&SMALL, &["--sync", "sometimes"]), "expected every-step or outer");
    fails_with(
        &with(&SMALL, &["--sync", "outer", "--outer-lr", "0", "--steps", "50"]),
        "--outer-lr 0 must be a positive number",
    );
    fails_with(&with(&SMALL, &["--outer-overlap", "on"]), "apply to --sync outer only");
    fails_with(
        &with(
            &SMALL,
            &["--sync", "outer", "--outer-overlap", "later", "--steps", "50"],
        ),
        "--outer-overlap \"later\": expected on or off",
    );
}
