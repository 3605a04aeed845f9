//! Slurm for real: `scripts/slurm/check.sh` starts a private single-node Slurm cluster and checks that
//! `srun -n 3 ringtrain train ...` trains one job to completion, and that a rank killed under `srun` ends the
//! job non-zero with the survivors naming it. This test runs that script with the binary under test.
//!
//! It needs root (slurmd starts the ranks) and Debian's `slurm-wlm` and `munge`, which the script installs
//! with apt-get where they are missing. Without root it skips with a notice, except under `CI=true`, where CI
//! runs as root and a skip would hide the check.

use std::path::Path;
use std::process::Command;
use std::time::Instant;

fn is_root() -> bool {
    // `Uid:` lists the real, effective, saved and filesystem uids; slurmd needs the effective one to be 0.
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("Uid:"))
                .and_then(|ids| ids.split_whitespace().nth(1).map(|e| e == "0"))
        })
        .unwrap_or(false)
}

#[test]
fn srun_trains_three_ranks_and_a_killed_rank_fails_the_job() {
    let in_ci = std::env::var("CI").is_ok_and(|v| v == "true");
    if !is_root() {
        assert!(!in_ci, "CI=true but not root: the Slurm check needs root");
        eprintln!("SKIP srun_trains_three_ranks_and_a_killed_rank_fails_the_job: needs root (slurmd starts the ranks)");
        return;
    }
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("scripts/slurm/check.sh");
    let started = Instant::now();
    let out = Command::new("bash")
        .arg(&script)
        .arg("20")
        .env("RINGTRAIN_BIN", env!("CARGO_BIN_EXE_ringtrain"))
        .output()
        .expect("running scripts/slurm/check.sh");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    eprintln!("{stdout}{stderr}");
    eprintln!("slurm check took {:.1} s", started.elapsed().as_secs_f64());
    assert!(out.status.success(), "scripts/slurm/check.sh failed: {}", out.status);
    assert!(
        stdout.contains("ok: srun -n 3 trained one job"),
        "no completed 3-rank job reported"
    );
    assert!(
        stdout.contains("a survivor named rank 2"),
        "the killed rank was not named"
    );
}
