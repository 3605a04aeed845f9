//! All-reduce benchmark in the style of nccl-tests: for each message size, the time of one all-reduce (mean
//! over `iters`, after warm-up, slowest rank), the algorithm bandwidth `algbw = bytes / time` and the bus
//! bandwidth `busbw = algbw × 2(N−1)/N`, which is what each link carries in a ring and is comparable across
//! world sizes.
//!
//! With a compact `--wire` the sizes and bandwidths stay those of the f32 buffer reduced (what a trainer
//! hands over), so a row compares directly with the f32 row of the same size.
//!
//! `ringtrain bench allreduce` spawns one process per rank, each calling [`run_rank`], and rank 0 prints
//! [`format_table`]. [`run_allreduce_bench`] does the same with threads in one process.

use std::time::{Duration, Instant};

use super::quic::{QuicCollective, QuicConfig};
use super::shm::LinkTransport;
use super::{Collective, CollectiveError, Wire};

/// One row of the table.
#[derive(Clone, Debug, PartialEq)]
pub struct BenchRow {
    /// Message size in bytes (f32 elements × 4).
    pub bytes: usize,
    /// Mean seconds per all-reduce on the slowest rank.
    pub secs: f64,
    /// bytes / secs, in GB/s (1e9).
    pub algbw: f64,
    /// algbw × 2(N−1)/N, in GB/s.
    pub busbw: f64,
}

/// Parses `1MiB,16MiB,64KiB,4096` (suffixes B, KiB, MiB, GiB, KB, MB, GB, K, M, G; case-insensitive).
pub fn parse_sizes(s: &str) -> Result<Vec<usize>, String> {
    s.split(',').map(|p| parse_size(p.trim())).collect()
}

fn parse_size(p: &str) -> Result<usize, String> {
    let lower = p.to_ascii_lowercase();
    let split = lower
        .find(|c: char| !c.is_ascii_digit() && c != '.')
        .unwrap_or(lower.len());
    let (num, unit) = lower.split_at(split);
    let n: f64 = num.parse().map_err(|_| format!("bad size {p:?}"))?;
    let mult: f64 = match unit.trim() {
        "" | "b" => 1.0,
        "k" | "kib" => 1024.0,
        "m" | "mib" => 1024.0 * 1024.0,
        "g" | "gib" => 1024.0 * 1024.0 * 1024.0,
        "kb" => 1e3,
        "mb" => 1e6,
        "gb" => 1e9,
        _ => return Err(format!("bad size unit in {p:?}")),
    };
    let bytes = (n * mult).round();
    if !(0.0..=(1u64 << 40) as f64).contains(&bytes) {
        return Err(format!("size {p:?} out of range"));
    }
    Ok(bytes as usize)
}

/// Benchmarks `all_reduce_mean` on an already joined collective. Every rank must call it with the same
/// arguments; every rank returns the same rows.
pub fn bench_collective(
    c: &mut dyn Collective,
    sizes: &[usize],
    iters: usize,
) -> Result<Vec<BenchRow>, CollectiveError> {
    let iters = iters.max(1);
    let warmup = 2.min(iters);
    let n = c.world();
    let mut rows = Vec::new();
    for &bytes in sizes {
        let mut buf: Vec<f32> = (0..bytes / 4).map(|i| (i % 251) as f32 + c.rank() as f32).collect();
        for _ in 0..warmup {
            c.all_reduce_mean(&mut buf)?;
        }
        let t0 = Instant::now();
        for _ in 0..iters {
            c.all_reduce_mean(&mut buf)?;
        }
        let mine = t0.elapsed().as_secs_f64() / iters as f64;
        // Slowest rank's time, identical on every rank.
        let all = c.gather_bytes(mine.to_le_bytes().to_vec())?;
        let secs = all
            .iter()
            .map(|b| f64::from_le_bytes(b.as_slice().try_into().expect("8 bytes")))
            .fold(0.0f64, f64::max);
        let real_bytes = (bytes / 4) * 4;
        let algbw = if secs > 0.0 {
            real_bytes as f64 / secs / 1e9
        } else {
            0.0
        };
        let busbw = if n > 1 {
            algbw * 2.0 * (n - 1) as f64 / n as f64
        } else {
            0.0
        };
        rows.push(BenchRow {
            bytes: real_bytes,
            secs,
            algbw,
            busbw,
        });
    }
    Ok(rows)
}

/// Runs one rank of the benchmark: joins the job `cfg` describes, benchmarks, leaves. Returns the rows and
/// what ran: where this rank's data went ([`path_name`] of [`QuicCollective::data_links`]) and, on a
/// two-level ring, its shape.
pub fn run_rank(
    mut cfg: QuicConfig,
    sizes: &[usize],
    iters: usize,
    wire: Wire,
) -> Result<(Vec<BenchRow>, String), CollectiveError> {
    cfg.timeout = Duration::from_secs(120);
    cfg.rendezvous_timeout = Duration::from_secs(60);
    let mut q = QuicCollective::connect(cfg)?;
    q.set_wire(wire);
    let rows = bench_collective(&mut q, sizes, iters)?;
    Ok((rows, what_ran(&q)))
}

/// The links a rank's data took, on a two-level ring its shape, and a compact wire format: the title of
/// its table.
fn what_ran(q: &QuicCollective) -> String {
    let links = path_name(q.data_links());
    let shape = match q.layout() {
        Some(t) => format!("{links}, {t}"),
        None => links.to_string(),
    };
    match q.wire() {
        Wire::F32 => shape,
        wire => format!("{shape}, values sent as {wire}"),
    }
}

/// What a rank's links (`[from the left, to the right]`) say the table measured.
pub fn path_name(links: [&str; 2]) -> &'static str {
    match links {
        ["shm", "shm"] => "shared memory",
        ["quic", "quic"] => "QUIC (loopback)",
        ["none", "none"] => "no links (one rank)",
        _ => "shared memory and QUIC",
    }
}

fn human(bytes: usize) -> String {
    const U: [&str; 4] = ["B", "KiB", "MiB", "GiB"];
    let mut v = bytes as f64;
    let mut i = 0;
    while v >= 1024.0 && i + 1 < U.len() && (v / 1024.0).fract() == 0.0 {
        v /= 1024.0;
        i += 1;
    }
    format!("{v} {}", U[i])
}

/// The table rank 0 prints.
pub fn format_table(world: usize, transport: &str, rows: &[BenchRow]) -> String {
    let mut s = format!("# all-reduce (mean, f32), {world} ranks over {transport}; busbw = algbw x 2(N-1)/N\n");
    s.push_str(&format!(
        "{:>12} {:>12} {:>12} {:>12} {:>12}\n",
        "size", "count", "time(us)", "algbw(GB/s)", "busbw(GB/s)"
    ));
    for r in rows {
        s.push_str(&format!(
            "{:>12} {:>12} {:>12.1} {:>12.3} {:>12.3}\n",
            human(r.bytes),
            r.bytes / 4,
            r.secs * 1e6,
            r.algbw,
            r.busbw
        ));
    }
    s
}

/// Runs the whole benchmark in this process: `nproc` ranks as threads over QUIC on 127.0.0.1, authenticated
/// with `secret`. Returns the table.
pub fn run_allreduce_bench(
    nproc: usize,
    sizes: &[usize],
    iters: usize,
    secret: &[u8],
    transport: LinkTransport,
) -> anyhow::Result<String> {
    anyhow::ensure!(nproc >= 1, "--nproc must be at least 1");
    let sock = std::net::UdpSocket::bind("127.0.0.1:0")?;
    let master = sock.local_addr()?;
    let mut sock = Some(sock);
    type RankResult = Result<(Vec<BenchRow>, String), CollectiveError>;
    let results: Vec<RankResult> = std::thread::scope(|s| {
        let hs: Vec<_> = (0..nproc)
            .map(|rank| {
                let secret = secret.to_vec();
                let sock = if rank == 0 { sock.take() } else { None };
                s.spawn(move || {
                    let mut cfg = QuicConfig::new(rank, nproc, master);
                    cfg.secret = Some(secret);
                    cfg.timeout = Duration::from_secs(120);
                    cfg.rendezvous_timeout = Duration::from_secs(60);
                    cfg.transport = transport;
                    let mut q = match sock {
                        Some(sock) => QuicCollective::connect_with_socket(cfg, sock)?,
                        None => QuicCollective::connect(cfg)?,
                    };
                    Ok((bench_collective(&mut q, sizes, iters)?, what_ran(&q)))
                })
            })
            .collect();
        hs.into_iter()
            .map(|h| {
                h.join()
                    .unwrap_or_else(|_| Err(CollectiveError::Local("rank panicked".into())))
            })
            .collect()
    });
    let mut rows = None;
    for (rank, r) in results.into_iter().enumerate() {
        let r = r.map_err(|e| anyhow::anyhow!("rank {rank}: {e}"))?;
        rows.get_or_insert(r);
    }
    let (rows, what) = rows.unwrap_or_default();
    Ok(format_table(nproc, &what, &rows))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes() {
        assert_eq!(
            parse_sizes("1MiB,16MiB,4096,2k,1GB").unwrap(),
            vec![1 << 20, 16 << 20, 4096, 2048, 1_000_000_000]
        );
        assert!(parse_sizes("1XB").is_err());
        assert!(parse_sizes("").is_err());
        assert_eq!(human(1 << 20), "1 MiB");
        assert_eq!(human(1000), "1000 B");
    }
}
