//! `ringtrain launch --nproc N [--master-port P] -- train [flags]`: N local worker processes that find
//! each other over QUIC on loopback, like `torchrun --standalone`. Each child gets the torchrun variables
//! (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT), a fresh random cluster secret (unless
//! RINGTRAIN_SECRET is already set) and a job id. If one child fails, the others are told by the ring and
//! exit on their own; any still running after the grace period are killed, and a stopped one (SIGSTOP,
//! which leaves a SIGTERM pending forever) at once. With `--elastic` among the train flags the others go on
//! without the failed rank instead: launch lets them finish (still killing a stopped rank) and exits 0
//! when the job completed, that is when some rank finished it.

use super::progress::eprint_line;
use anyhow::{bail, ensure, Context, Result};
use ringtrain::dist::{generate_secret, JOB_ID_VAR, JOIN_ADDRS_VAR, LISTEN_PORT_VAR, REJOIN_VAR};
use ringtrain::fault_plan::INJECT_FAULT_VAR;
use std::process::{Child, Command, ExitStatus};
use std::time::{Duration, Instant};

/// Most local workers one launcher starts.
const MAX_NPROC: usize = 64;
/// How long the others may take to notice a failed rank before they are killed.
const GRACE: Duration = Duration::from_secs(30);

pub fn run_launch(nproc: usize, master_port: Option<u16>, max_restarts: usize, command: &[String]) -> Result<()> {
    ensure!(
        (1..=MAX_NPROC).contains(&nproc),
        "--nproc {nproc} must be between 1 and {MAX_NPROC}"
    );
    ensure!(
        matches!(command.first().map(String::as_str), Some("train")),
        "launch runs `train`: usage `ringtrain launch --nproc N -- train [flags]`"
    );
    for reserved in ["--rank", "--world-size", "--master-addr", "--master-port"] {
        ensure!(
            !command
                .iter()
                .any(|a| a == reserved || a.starts_with(&format!("{reserved}="))),
            "{reserved} is set by the launcher; remove it from the train flags"
        );
    }
    let port = match master_port {
        Some(p) => p,
        None => free_udp_port()?,
    };
    let secret = std::env::var("RINGTRAIN_SECRET").unwrap_or_else(|_| generate_secret());
    let job_id = rand::random::<u64>() >> 1;
    let elastic = elastic_flag(command);
    // An elastic job's ranks listen at ports chosen here for the whole job (rank 0 at the master port), so
    // that a restarted rank finds the running ones there, whichever of them is rank 0 by then.
    let listen_ports: Vec<u16> = match elastic {
        true => distinct_free_ports(port, nproc - 1)?,
        false => Vec::new(),
    };
    let join_addrs: Vec<String> = listen_ports.iter().map(|p| format!("127.0.0.1:{p}")).collect();
    let exe = std::env::current_exe().context("locating the ringtrain executable")?;
    let spawn = |rank: usize, rejoin: bool| -> Result<Child> {
        let mut cmd = Command::new(&exe);
        cmd.args(command)
            .env("RANK", rank.to_string())
            .env("WORLD_SIZE", nproc.to_string())
            .env("LOCAL_RANK", rank.to_string())
            .env("LOCAL_WORLD_SIZE", nproc.to_string())
            .env("MASTER_ADDR", "127.0.0.1")
            .env("MASTER_PORT", port.to_string())
            .env("RINGTRAIN_SECRET", &secret)
            .env(JOB_ID_VAR, job_id.to_string());
        if elastic {
            // A restarted rank looks for the others, not for the port it is about to listen at again.
            let others: Vec<&str> = join_addrs
                .iter()
                .enumerate()
                .filter(|&(r, _)| !(rejoin && r == rank))
                .map(|(_, a)| a.as_str())
                .collect();
            cmd.env(JOIN_ADDRS_VAR, others.join(","));
            if rank > 0 {
                cmd.env(LISTEN_PORT_VAR, listen_ports[rank].to_string());
            }
        }
        if rejoin {
            // A restarted rank rejoins as it is: the injected faults rehearsed the first failure.
            cmd.env(REJOIN_VAR, "1").env_remove(INJECT_FAULT_VAR);
        }
        cmd.spawn().with_context(|| format!("starting rank {rank}"))
    };
    let children = (0..nproc)
        .map(|rank| spawn(rank, false).map(Some))
        .collect::<Result<Vec<_>>>()?;
    ensure!(
        max_restarts == 0 || elastic,
        "--max-restarts restarts a rank into a running elastic job: add --elastic to the train flags"
    );
    match elastic {
        true => supervise_elastic(children, max_restarts, &spawn),
        false => supervise(children),
    }
}

/// Whether the train flags ask for `--elastic` (`--elastic`, `--elastic=true`, `--elastic true`).
fn elastic_flag(command: &[String]) -> bool {
    command.iter().enumerate().any(|(i, a)| match a.as_str() {
        "--elastic" => command.get(i + 1).is_none_or(|next| next != "false"),
        other => other == "--elastic=true",
    })
}

/// Waits for every child of an elastic job: a failed rank leaves it, the others go on. A stopped rank is
/// killed once another has exited (the survivors went on without it, or finished). Succeeds when some rank
/// completed the job.
fn supervise_elastic(
    mut children: Vec<Option<Child>>,
    max_restarts: usize,
    spawn: &dyn Fn(usize, bool) -> Result<Child>,
) -> Result<()> {
    let mut failures: Vec<(usize, ExitStatus)> = Vec::new();
    let mut restarts = vec![0; children.len()];
    let mut completed = 0;
    while children.iter().any(Option::is_some) {
        for (rank, slot) in children.iter_mut().enumerate() {
            let Some(child) = slot else { continue };
            if let Some(status) = child.try_wait().with_context(|| format!("waiting for rank {rank}"))? {
                *slot = None;
                if status.success() {
                    completed += 1;
                    continue;
                }
                eprint_line(&format!("launch: rank {rank} left the elastic job ({status})"));
                failures.push((rank, status));
                // Back into the running job, while it runs.
                if completed == 0 && restarts[rank] < max_restarts {
                    restarts[rank] += 1;
                    eprint_line(&format!(
                        "launch: restarting rank {rank} to rejoin the job (restart {} of {max_restarts})",
                        restarts[rank]
                    ));
                    *slot = Some(spawn(rank, true)?);
                }
            }
        }
        // Once any rank has exited, a stopped one has been (or will be) gone on without: it cannot finish.
        if completed > 0 || !failures.is_empty() {
            kill_stopped(&mut children, &mut failures)?;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let list: Vec<String> = failures.iter().map(|(r, s)| format!("rank {r} ({s})")).collect();
    ensure!(
        completed > 0,
        "no rank completed the elastic job; {} failed: {}",
        failures.len(),
        list.join(", ")
    );
    if !failures.is_empty() {
        eprint_line(&format!(
            "launch: the elastic job completed on {completed} rank(s); failed on the way: {}",
            list.join(", ")
        ));
    }
    Ok(())
}

/// Kills every stopped child (SIGSTOP or a debugger), which cannot notice anything, recording it as failed.
fn kill_stopped(children: &mut [Option<Child>], failures: &mut Vec<(usize, ExitStatus)>) -> Result<()> {
    for (rank, slot) in children.iter_mut().enumerate() {
        if slot.as_ref().is_some_and(|child| is_stopped(child.id())) {
            let mut child = slot.take().expect("checked above");
            eprint_line(&format!(
                "launch: rank {rank} is stopped (SIGSTOP or a debugger); killing it"
            ));
            let _ = child.kill();
            let status = child.wait().with_context(|| format!("waiting for rank {rank}"))?;
            failures.push((rank, status));
        }
    }
    Ok(())
}

/// Waits for every child; after the first failure, gives the rest `GRACE` to stop, then kills them.
pub(crate) fn supervise(mut children: Vec<Option<Child>>) -> Result<()> {
    let mut failures: Vec<(usize, ExitStatus)> = Vec::new();
    let mut first_failure: Option<Instant> = None;
    while children.iter().any(Option::is_some) {
        for (rank, slot) in children.iter_mut().enumerate() {
            let Some(child) = slot else { continue };
            if let Some(status) = child.try_wait().with_context(|| format!("waiting for rank {rank}"))? {
                if !status.success() {
                    failures.push((rank, status));
                    first_failure.get_or_insert_with(Instant::now);
                }
                *slot = None;
            }
        }
        if first_failure.is_some() {
            // A stopped rank cannot notice anything; the others have already named it.
            kill_stopped(&mut children, &mut failures)?;
        }
        if first_failure.is_some_and(|t| t.elapsed() > GRACE) {
            for (rank, slot) in children.iter_mut().enumerate() {
                if let Some(mut child) = slot.take() {
                    eprint_line(&format!(
                        "launch: rank {rank} still running {GRACE:?} after a failure; killing it"
                    ));
                    let _ = child.kill();
                    let _ = child.wait();
                }
            }
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    if failures.is_empty() {
        return Ok(());
    }
    let list: Vec<String> = failures.iter().map(|(r, s)| format!("rank {r} ({s})")).collect();
    bail!("{} of the workers failed: {}", failures.len(), list.join(", "))
}

/// Whether process `pid` is stopped by a signal or traced (Linux `/proc`; elsewhere never).
fn is_stopped(pid: u32) -> bool {
    let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
        return false;
    };
    // The state follows the command name, which is in parentheses and may itself contain them.
    let state = stat
        .rsplit_once(')')
        .and_then(|(_, rest)| rest.split_whitespace().next());
    matches!(state, Some("T" | "t"))
}

/// A UDP port that was free a moment ago on loopback (the rendezvous binds it right after).
/// `first`, then `more` other free UDP ports on loopback, all different: each is held until all are found.
fn distinct_free_ports(first: u16, more: usize) -> Result<Vec<u16>> {
    let mut held = Vec::with_capacity(more);
    let mut ports = vec![first];
    while held.len() < more {
        let socket = std::net::UdpSocket::bind("127.0.0.1:0").context("finding free ports for the ranks")?;
        let port = socket.local_addr()?.port();
        if !ports.contains(&port) {
            ports.push(port);
            held.push(socket);
        }
    }
    Ok(ports)
}

pub(crate) fn free_udp_port() -> Result<u16> {
    let socket = std::net::UdpSocket::bind("127.0.0.1:0").context("finding a free port for the rendezvous")?;
    Ok(socket.local_addr()?.port())
}
