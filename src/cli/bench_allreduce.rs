//! `ringtrain bench allreduce --nproc N [--size 1MiB,16MiB,64MiB] [--iters K] [--transport auto|shm|quic]
//! [--collective flat|hierarchical|auto] [--hosts H] [--wire f32|bf16|int8]`: N local processes that all-reduce over shared memory
//! or QUIC on loopback (spread over H emulated hosts); rank 0 prints an nccl-tests style table (size, time,
//! algbw, busbw) titled with the links and the ring that ran.
//!
//! The launcher re-runs this same command in each child with `RINGTRAIN_BENCH_RANK` set; a child with that
//! variable is a rank, not a launcher.

use super::launch::{free_udp_port, supervise};
use anyhow::{ensure, Context, Result};
use ringtrain::collective::bench::{format_table, parse_sizes, run_rank};
use ringtrain::collective::quic::QuicConfig;
use ringtrain::collective::shm::LinkTransport;
use ringtrain::collective::{CollectiveChoice, Wire};
use ringtrain::dist::env::HOST_ID_VAR;
use ringtrain::dist::generate_secret;
use std::net::{IpAddr, SocketAddr};
use std::process::Command;

const RANK_VAR: &str = "RINGTRAIN_BENCH_RANK";
const MAX_BENCH_BYTES: usize = 4 << 30;

/// The benchmark's flags.
pub struct BenchAllreduce {
    pub nproc: usize,
    /// Comma-separated sizes (`--size`).
    pub sizes: String,
    pub iters: usize,
    pub transport: LinkTransport,
    pub collective: CollectiveChoice,
    /// Emulated hosts the processes are spread over (`--hosts`).
    pub hosts: usize,
    /// What the reduced values travel in (`--wire`).
    pub wire: Wire,
}

pub fn run_bench_allreduce(b: &BenchAllreduce) -> Result<()> {
    let nproc = b.nproc;
    ensure!((1..=64).contains(&nproc), "--nproc {nproc} must be between 1 and 64");
    ensure!(
        (1..=100_000).contains(&b.iters),
        "--iters {} must be between 1 and 100000",
        b.iters
    );
    ensure!(
        (1..=nproc).contains(&b.hosts),
        "--hosts {} must be between 1 and --nproc ({nproc})",
        b.hosts
    );
    let parsed = parse_sizes(&b.sizes).map_err(anyhow::Error::msg)?;
    ensure!(
        parsed.iter().all(|&b| b % 4 == 0 && b <= MAX_BENCH_BYTES),
        "--size: every size must be a multiple of 4 bytes (f32) and at most 4 GiB"
    );
    if let Ok(rank) = std::env::var(RANK_VAR) {
        return run_as_rank(rank.parse().context("bad rank")?, b, &parsed);
    }
    let port = free_udp_port()?;
    let secret = generate_secret();
    let exe = std::env::current_exe()?;
    let mut children = Vec::with_capacity(nproc);
    for rank in 0..nproc {
        let mut child = Command::new(&exe);
        child
            .args(["bench", "allreduce", "--nproc", &nproc.to_string(), "--size", &b.sizes])
            .args(["--iters", &b.iters.to_string(), "--transport", &b.transport.to_string()])
            .args(["--collective", b.collective.as_str(), "--wire", b.wire.as_str()])
            .env(RANK_VAR, rank.to_string())
            .env("MASTER_PORT", port.to_string())
            .env("RINGTRAIN_SECRET", &secret);
        if b.hosts > 1 {
            // Contiguous blocks of ranks, one identity each: the ranks of a block link through shared
            // memory, the blocks through QUIC.
            child.env(HOST_ID_VAR, format!("bench-host-{}", rank * b.hosts / nproc));
        }
        children.push(Some(child.spawn().with_context(|| format!("starting rank {rank}"))?));
    }
    supervise(children)
}

/// One rank, started by the launcher above or by hand: `MASTER_ADDR` (default 127.0.0.1) and `MASTER_PORT`
/// say where rank 0 is, `RINGTRAIN_SECRET` the secret, `RINGTRAIN_HOST_ID` the host.
fn run_as_rank(rank: usize, b: &BenchAllreduce, sizes: &[usize]) -> Result<()> {
    let port: u16 = std::env::var("MASTER_PORT").context("MASTER_PORT not set")?.parse()?;
    let ip: IpAddr = match std::env::var("MASTER_ADDR") {
        Ok(a) => a
            .parse()
            .with_context(|| format!("MASTER_ADDR={a:?} is not an IP address"))?,
        Err(_) => IpAddr::from([127, 0, 0, 1]),
    };
    let mut cfg = QuicConfig::new(rank, b.nproc, SocketAddr::new(ip, port));
    cfg.secret = std::env::var("RINGTRAIN_SECRET").ok().map(String::into_bytes);
    cfg.transport = b.transport;
    cfg.collective = b.collective;
    cfg.host_id = std::env::var(HOST_ID_VAR).ok();
    let (rows, what) = run_rank(cfg, sizes, b.iters, b.wire).map_err(|e| anyhow::anyhow!("rank {rank}: {e}"))?;
    if rank == 0 {
        let path = format!("{what}, one process per rank");
        print!("{}", format_table(b.nproc, &path, &rows));
    }
    Ok(())
}
