//! A rendezvous that explains itself within seconds, seen as a user sees it: real `ringtrain train`
//! processes, default logging (no `RUST_LOG`), and a `--timeout` far longer than the test waits. Before,
//! the healthy ranks said nothing until the rendezvous timed out, and rank 0's refusals were only visible
//! with `RUST_LOG` set.

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

/// Longer than any wait below: every message checked here must come long before the timeout.
const TIMEOUT_S: &str = "60";
/// How long a message may take to appear (the rendezvous speaks after 3 s of waiting).
const WITHIN: Duration = Duration::from_secs(10);

/// A UDP port that was free a moment ago.
fn free_port() -> u16 {
    std::net::UdpSocket::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// A training rank of a `world`-rank job at `port`, with `secret`, its stderr piped.
fn rank(r: usize, world: usize, port: u16, secret: &str) -> Child {
    Command::new(env!("CARGO_BIN_EXE_ringtrain"))
        .args([
            "train",
            "--model",
            "tiny",
            "--backend",
            "cpu",
            "--steps",
            "3",
            "--threads",
            "1",
        ])
        .args(["--batch-size", "2", "--seq-len", "16", "--timeout", TIMEOUT_S])
        .args(["--rank", &r.to_string(), "--world-size", &world.to_string()])
        .args(["--master-addr", "127.0.0.1", "--master-port", &port.to_string()])
        .env("RINGTRAIN_SECRET", secret)
        .env_remove("RUST_LOG")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("starting ringtrain train")
}

/// The lines of a child's stderr, as they come.
fn lines_of(child: &mut Child) -> mpsc::Receiver<String> {
    let (tx, rx) = mpsc::channel();
    let stderr = child.stderr.take().unwrap();
    std::thread::spawn(move || {
        for line in BufReader::new(stderr).lines().map_while(Result::ok) {
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    rx
}

/// Waits up to [`WITHIN`] for a line holding every one of `parts`; returns it, or every line seen.
fn wait_for(rx: &mpsc::Receiver<String>, parts: &[&str]) -> Result<String, Vec<String>> {
    let end = Instant::now() + WITHIN;
    let mut seen = Vec::new();
    while let Some(left) = end.checked_duration_since(Instant::now()) {
        match rx.recv_timeout(left) {
            Ok(line) if parts.iter().all(|p| line.contains(p)) => return Ok(line),
            Ok(line) => seen.push(line),
            Err(_) => break,
        }
    }
    Err(seen)
}

/// Ends the children this test started.
fn stop(children: &mut [Child]) {
    for c in children.iter_mut() {
        let _ = c.kill();
        let _ = c.wait();
    }
}

#[test]
fn every_healthy_rank_hears_of_a_peer_with_another_secret_within_seconds() {
    let port = free_port();
    let mut rank0 = rank(0, 3, port, "the job's secret");
    let mut rank1 = rank(1, 3, port, "the job's secret");
    let (log0, log1) = (lines_of(&mut rank0), lines_of(&mut rank1));
    std::thread::sleep(Duration::from_millis(500));
    let started = Instant::now();
    let mut stranger = rank(2, 3, port, "another secret");
    let stranger_status = stranger.wait().unwrap();
    let stranger_err = std::io::read_to_string(stranger.stderr.take().unwrap()).unwrap();
    let said0 = wait_for(&log0, &["refused a connection from 127.0.0.1:", "another secret"]);
    let said1 = wait_for(&log1, &["rank 1: rendezvous:", "ranks [2]", "failed authentication"]);
    let heard = started.elapsed();
    stop(&mut [rank0, rank1]);
    assert!(!stranger_status.success(), "{stranger_err}");
    assert!(stranger_err.contains("authentication"), "{stranger_err}");
    let said0 = said0.unwrap_or_else(|seen| panic!("rank 0 never logged the refusal: {seen:#?}"));
    let said1 = said1.unwrap_or_else(|seen| panic!("rank 1 never heard why: {seen:#?}"));
    eprintln!("rank 0: {said0}\nrank 1: {said1}\nboth within {heard:?} of the stranger's start");
    assert!(said1.contains("127.0.0.1:"), "names the address: {said1}");
}

#[test]
fn a_rank_whose_master_does_not_answer_says_so_within_seconds() {
    let port = free_port();
    let mut lonely = rank(1, 2, port, "the job's secret");
    let log = lines_of(&mut lonely);
    let started = Instant::now();
    let said = wait_for(&log, &["rank 1: rendezvous: rank 0 at 127.0.0.1:", "has not answered"]);
    let heard = started.elapsed();
    stop(&mut [lonely]);
    let said = said.unwrap_or_else(|seen| panic!("rank 1 said nothing of rank 0: {seen:#?}"));
    eprintln!("{said}\nwithin {heard:?}");
}
