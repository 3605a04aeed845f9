//! `ringtrain bench allreduce --nproc N [--size 1MiB,16MiB,64MiB] [--iters K] [--transport auto|shm|quic]`:
//! N local processes that all-reduce over shared memory or QUIC on loopback; rank 0 prints an nccl-tests
//! style table (size, time, algbw, busbw) titled with the links that ran.
//!
//! The launcher re-runs this same command in each child with `RINGTRAIN_BENCH_RANK` set; a child with that
//! variable is a rank, not a launcher.

use super::launch::{free_udp_port, supervise};
use anyhow::{ensure, Context, Result};
use ringtrain::collective::bench::{format_table, parse_sizes, path_name, run_rank};
use ringtrain::collective::shm::LinkTransport;
use ringtrain::dist::generate_secret;
use std::net::SocketAddr;
use std::process::Command;

const RANK_VAR: &str = "RINGTRAIN_BENCH_RANK";
const MAX_BENCH_BYTES: usize = 4 << 30;

pub fn run_bench_allreduce(nproc: usize, sizes: &str, iters: usize, transport: LinkTransport) -> Result<()> {
    ensure!((1..=64).contains(&nproc), "--nproc {nproc} must be between 1 and 64");
    ensure!(
        (1..=100_000).contains(&iters),
        "--iters {iters} must be between 1 and 100000"
    );
    let parsed = parse_sizes(sizes).map_err(anyhow::Error::msg)?;
    ensure!(
        parsed.iter().all(|&b| b % 4 == 0 && b <= MAX_BENCH_BYTES),
        "--size: every size must be a multiple of 4 bytes (f32) and at most 4 GiB"
    );
    if let Ok(rank) = std::env::var(RANK_VAR) {
        return run_as_rank(rank.parse().context("bad rank")?, nproc, &parsed, iters, transport);
    }
    let port = free_udp_port()?;
    let secret = generate_secret();
    let exe = std::env::current_exe()?;
    let mut children = Vec::with_capacity(nproc);
    for rank in 0..nproc {
        let child = Command::new(&exe)
            .args(["bench", "allreduce", "--nproc", &nproc.to_string(), "--size", sizes])
            .args(["--iters", &iters.to_string(), "--transport", &transport.to_string()])
            .env(RANK_VAR, rank.to_string())
            .env("MASTER_PORT", port.to_string())
            .env("RINGTRAIN_SECRET", &secret)
            .spawn()
            .with_context(|| format!("starting rank {rank}"))?;
        children.push(Some(child));
    }
    supervise(children)
}

fn run_as_rank(rank: usize, nproc: usize, sizes: &[usize], iters: usize, transport: LinkTransport) -> Result<()> {
    let port: u16 = std::env::var("MASTER_PORT").context("MASTER_PORT not set")?.parse()?;
    let secret = std::env::var("RINGTRAIN_SECRET").ok().map(String::into_bytes);
    let master = SocketAddr::from(([127, 0, 0, 1], port));
    let (rows, links) = run_rank(rank, nproc, master, secret, sizes, iters, transport)
        .map_err(|e| anyhow::anyhow!("rank {rank}: {e}"))?;
    if rank == 0 {
        let path = format!("{}, one process per rank", path_name(links));
        print!("{}", format_table(nproc, &path, &rows));
    }
    Ok(())
}
