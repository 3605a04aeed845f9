//! Two emulated hosts for real: `bench/hosts/check.sh` puts each rank in its own network namespace, joined
//! by a bridge with every link shaped by `tbf`, trains `tiny` data-parallel across them and on loopback with
//! `ringtrain launch`, and requires the per-step losses and gradient norms to be bit-identical. It runs twice:
//! on Ethernet's 1500-byte MTU, and on 9000-byte jumbo frames, where it also requires host 0's frames to
//! average more than a standard Ethernet frame (QUIC's MTU discovery found the larger path).
//!
//! Then `bench/hosts/two_level.sh` puts two ranks in each of the two namespaces and requires that they form
//! the two-level ring grouped by namespace, keep their replicas bit-identical every step (`--verify-every 1`)
//! and train like one worker on the global batch within 1e-5.
//!
//! Last, `bench/hosts/elastic.sh` runs `train --elastic` across 3 namespaces and kills one rank with SIGKILL
//! (the two others must finish), then splits 4 ranks on 2 namespaces by taking a switch port down (neither
//! side may go on).
//!
//! It needs root with the right to create network namespaces (a container has it only with `--privileged`
//! or `--cap-add SYS_ADMIN --cap-add NET_ADMIN`) and iproute2 (`ip`, `tc`). Without either it skips with a
//! notice, except under `CI=true`, where CI runs as root and a skip would hide the check. Both runs use the
//! same namespace names, so they run one after the other in this one test.

mod common;

use common::{is_root, run_repo_script};

#[test]
fn two_emulated_hosts_match_loopback_on_standard_and_jumbo_frames_and_run_the_two_level_ring() {
    let in_ci = std::env::var("CI").is_ok_and(|v| v == "true");
    if !is_root() {
        assert!(!in_ci, "CI=true but not root: the emulated hosts need root");
        eprintln!(
            "SKIP two_emulated_hosts_match_loopback_on_standard_and_jumbo_frames_and_run_the_two_level_ring: needs root (network namespaces)"
        );
        return;
    }
    for mtu in ["1500", "9000"] {
        let out = run_repo_script("bench/hosts/check.sh", &["6", "1gbit"], &[("HOSTS_MTU", mtu)]);
        let stdout = String::from_utf8_lossy(&out.stdout);
        let stderr = String::from_utf8_lossy(&out.stderr);
        let unable = ["cannot create network namespace", "needs iproute2"];
        if !in_ci && unable.iter().any(|why| stderr.contains(why)) {
            eprintln!(
                "SKIP two_emulated_hosts_match_loopback_on_standard_and_jumbo_frames_and_run_the_two_level_ring: {}",
                stderr.trim()
            );
            return;
        }
        assert!(
            out.status.success(),
            "bench/hosts/check.sh with MTU {mtu} failed: {}",
            out.status
        );
        assert!(
            stdout.contains("OK: 6 steps bit-identical on loopback and on 2 emulated hosts"),
            "MTU {mtu}: no bit-identical result reported"
        );
        assert!(
            stdout.contains(&format!("over a {mtu}-byte MTU")),
            "MTU {mtu}: the frame sizes were not reported"
        );
    }
    let out = run_repo_script("bench/hosts/two_level.sh", &["6", "1gbit", "1", "tiny"], &[]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "bench/hosts/two_level.sh failed: {}: {}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        stdout.contains("OK: the two-level ring grouped the ranks by namespace"),
        "two_level.sh reported no result: {stdout}"
    );
    // Elastic jobs across hosts: a rank SIGKILLed on one of 3 hosts is survived; a 2 + 2 partition lets
    // neither side go on.
    let out = run_repo_script("bench/hosts/elastic.sh", &["150", "1gbit", "20"], &[]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "bench/hosts/elastic.sh failed: {}", out.status);
    assert!(stdout.contains("OK: the 2 survivors re-formed"), "{stdout}");
    assert!(
        stdout.contains("OK: neither side of the 2 + 2 partition went on"),
        "{stdout}"
    );
}
