//! Links and fabrics: what one ring hop costs in virtual time.
//!
//! A message of `s` bytes sent over a [`Link`] occupies its sender for `s / bandwidth + s · cpu_per_byte`
//! (serialisation on the wire plus the sender's CPU work per byte: on the reference machine the QUIC ring is
//! CPU-bound, see BENCHMARKS.md "All-reduce CPU cost") and arrives `latency` after it leaves. A [`Network`]
//! is one link kind for every hop, or two tiers: `hosts_of` consecutive ranks share a host joined by the
//! intra-host link, and hosts are joined by the inter-host link. The ring runs in rank order, so hop
//! `r → r+1` is intra-host exactly when both ranks are on the same host.
//!
//! `shared-cores=C` says the ranks do not each have a machine of their own: a machine of `C` cores holds
//! every rank of a host (`hosts-of`), or with one link kind every rank of the job, as when N ranks run on
//! one machine (`ringtrain launch`, or emulated hosts in network namespaces). Compute and the per-byte
//! CPU work then share those cores ([`super::schedule`] says how). That CPU work is γ per byte sent unless
//! `rank-cpu-per-byte` gives it apart: γ is what a send costs on the sender's path, while a rank's threads
//! together also receive, sum and run the kernel's share (measured as about twice γ on emulated hosts,
//! BENCHMARKS.md).

use anyhow::{bail, Context, Result};

/// One kind of hop.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Link {
    /// Seconds from a message leaving its sender to its arrival (α).
    pub latency_s: f64,
    /// Bytes per second on the wire (β).
    pub bandwidth_bytes_per_s: f64,
    /// Seconds of sender CPU per byte sent (γ), serial with the wire time.
    pub cpu_s_per_byte: f64,
}

impl Link {
    /// How long a message of `bytes` occupies its sender.
    pub fn occupancy_s(&self, bytes: f64) -> f64 {
        bytes / self.bandwidth_bytes_per_s + bytes * self.cpu_s_per_byte
    }
}

/// The fabric of a virtual cluster.
#[derive(Clone, Debug, PartialEq)]
pub struct Network {
    /// What the description was (a preset name or the spec), for reports.
    pub name: String,
    /// Between hosts, or every hop when `intra` is `None`.
    pub inter: Link,
    /// `(ranks per host, link inside a host)`.
    pub intra: Option<(usize, Link)>,
    /// Cores of the machine that holds a host's ranks (every rank, without tiers); `None`: each rank has
    /// cores of its own.
    pub shared_cores: Option<usize>,
    /// With `shared_cores`: CPU seconds a rank spends per byte it sends between hosts, on all its threads;
    /// `None`: γ. Hops inside a host are priced at their own link's CPU per byte.
    pub rank_cpu_s_per_byte: Option<f64>,
}

/// Gigabits per second in bytes per second.
const fn gbit(g: f64) -> f64 {
    g * 1e9 / 8.0
}

/// The named fabrics, as ringtrain crosses them: between hosts every byte goes through QUIC, whose measured
/// CPU cost per byte ([`QUIC_CPU_S_PER_BYTE`]) comes on top of the wire (ringtrain uses no RDMA or NVLink);
/// between ranks of one host through shared memory ([`SHM_CPU_S_PER_BYTE`]). Line rates are nominal, the
/// latencies typical one-way figures. Device-to-host copies of GPU ranks are not in the model yet.
pub const PRESETS: &[(&str, &str)] = &[
    (
        "shm",
        "ranks of one host over shared memory (measured CPU per byte and latency)",
    ),
    ("10gbe", "10 Gb/s Ethernet, 50 µs, QUIC's CPU per byte"),
    ("100gbe-quic", "100 Gb/s Ethernet, 20 µs, QUIC's CPU per byte"),
    (
        "ib-hdr100",
        "100 Gb/s InfiniBand HDR100 carrying UDP (IPoIB), 20 µs, QUIC's CPU per byte",
    ),
    ("wan", "1 Gb/s WAN, 30 ms, QUIC's CPU per byte"),
    (
        "dgx",
        "8 ranks per host over shared memory, hosts on 200 Gb/s InfiniBand (IPoIB, 20 µs) with QUIC's CPU per byte",
    ),
];

/// Seconds of CPU per byte sent by a rank of the QUIC ring on the reference 2-core machine: BENCHMARKS.md
/// "All-reduce CPU cost" measures 145–154 ms of CPU over both ranks for one 64 MiB all-reduce at N=2, in
/// which each rank sends (and receives) 64 MiB: about 75 ms / 67.1 MB ≈ 1.1 ns per byte, receive side and
/// sum included.
pub const QUIC_CPU_S_PER_BYTE: f64 = 1.1e-9;

/// Seconds of CPU per byte sent by a rank of the ring over shared memory, on all its threads (its send,
/// the receive and sum, the kernel's share): BENCHMARKS.md "All-reduce CPU cost" measures 80.4–85.4 ms of
/// CPU over four ranks for one 64 MiB all-reduce at N=4 (0.20–0.21 ns per byte a rank sends, the cores
/// full) and 22.8–33.7 ms over two at N=2 (0.17–0.25 ns, start-up noise included).
pub const SHM_CPU_S_PER_BYTE: f64 = 0.21e-9;

/// One hop over shared memory: the 4 KiB all-reduce's median over its hops, 56.8 µs over 2 hops at N=2 and
/// 216.5 µs over 6 at N=4 (BENCHMARKS.md "Over shared memory"), between the two: a sleeping rank's
/// wake-up, mostly.
pub const SHM_LATENCY_S: f64 = 32e-6;

/// The wire term of a shared-memory hop: none to speak of (the copy is the CPU term), but the model needs a
/// finite rate; at 1 TB/s it adds 1 ns per KB.
const SHM_BANDWIDTH_BYTES_PER_S: f64 = 1e12;

/// A hop over shared memory.
pub const SHM_LINK: Link = Link {
    latency_s: SHM_LATENCY_S,
    bandwidth_bytes_per_s: SHM_BANDWIDTH_BYTES_PER_S,
    cpu_s_per_byte: SHM_CPU_S_PER_BYTE,
};

impl Network {
    /// A uniform fabric.
    pub fn uniform(name: &str, link: Link) -> Self {
        Network {
            name: name.to_string(),
            inter: link,
            intra: None,
            shared_cores: None,
            rank_cpu_s_per_byte: None,
        }
    }

    /// A named fabric (see [`PRESETS`]).
    ///
    /// Sources: Ethernet and InfiniBand line rates are the IEEE 802.3ae (10GBASE) / 802.3ba (100GBASE) and
    /// InfiniBand Trade Association HDR figures; the latencies are the order of magnitude vendors quote for
    /// a switched hop with kernel UDP (tens of µs). The CPU terms and the shared-memory hop are this
    /// project's measurements (the constants above). The WAN figure is the example link. NCCL on a
    /// DGX would reach far more (nccl-tests publishes NVLink bus bandwidths in the hundreds of GB/s), but
    /// that is not the path ringtrain takes.
    pub fn preset(name: &str) -> Result<Self> {
        let link = |lat_us: f64, gbps: f64, cpu: f64| Link {
            latency_s: lat_us * 1e-6,
            bandwidth_bytes_per_s: gbit(gbps),
            cpu_s_per_byte: cpu,
        };
        Ok(match name {
            "shm" => Self::uniform(name, SHM_LINK),
            "10gbe" => Self::uniform(name, link(50.0, 10.0, QUIC_CPU_S_PER_BYTE)),
            "100gbe-quic" => Self::uniform(name, link(20.0, 100.0, QUIC_CPU_S_PER_BYTE)),
            "ib-hdr100" => Self::uniform(name, link(20.0, 100.0, QUIC_CPU_S_PER_BYTE)),
            "wan" => Self::uniform(name, link(30_000.0, 1.0, QUIC_CPU_S_PER_BYTE)),
            "dgx" => Network {
                name: name.to_string(),
                inter: link(20.0, 200.0, QUIC_CPU_S_PER_BYTE),
                intra: Some((8, SHM_LINK)),
                shared_cores: None,
                rank_cpu_s_per_byte: None,
            },
            other => bail!(
                "unknown network preset {other:?}: expected one of {}, or latency=..,bandwidth=..[,cpu-per-byte=..][,hosts-of=..,intra-latency=..,intra-bandwidth=..[,intra-cpu-per-byte=..]][,shared-cores=..[,rank-cpu-per-byte=..]]",
                PRESETS.iter().map(|(n, _)| *n).collect::<Vec<_>>().join(", ")
            ),
        })
    }

    /// A preset name, or `latency=30ms,bandwidth=1Gbit[,cpu-per-byte=0.9ns][,hosts-of=8,intra-latency=2us,
    /// intra-bandwidth=100Gbit[,intra-cpu-per-byte=0.2ns]][,shared-cores=2[,rank-cpu-per-byte=8ns]]`
    /// (`intra-cpu-per-byte` defaults to `cpu-per-byte`). Times take `s`, `ms`, `us` or
    /// `ns`; bandwidths `Gbit`, `Mbit`, `GB` or `MB` (per second).
    pub fn parse(spec: &str) -> Result<Self> {
        if !spec.contains('=') {
            return Self::preset(spec.trim());
        }
        let (mut latency, mut bandwidth, mut cpu) = (None, None, 0.0);
        let (mut hosts_of, mut intra_latency, mut intra_bandwidth) = (None, None, None);
        let mut intra_cpu = None;
        let (mut shared_cores, mut rank_cpu) = (None, None);
        for field in spec.split(',') {
            let Some((key, value)) = field.split_once('=') else {
                bail!("--network {spec:?}: field {field:?} is not KEY=VALUE")
            };
            let (key, value) = (key.trim(), value.trim());
            let what = || format!("--network {key}={value}");
            match key {
                "latency" => latency = Some(seconds(value).with_context(what)?),
                "bandwidth" => bandwidth = Some(bytes_per_s(value).with_context(what)?),
                "cpu-per-byte" => cpu = seconds(value).with_context(what)?,
                "hosts-of" => {
                    hosts_of = Some(positive_count(value, "a host holds at least one rank").with_context(what)?)
                }
                "intra-latency" => intra_latency = Some(seconds(value).with_context(what)?),
                "intra-bandwidth" => intra_bandwidth = Some(bytes_per_s(value).with_context(what)?),
                "intra-cpu-per-byte" => intra_cpu = Some(seconds(value).with_context(what)?),
                "shared-cores" => {
                    shared_cores = Some(positive_count(value, "a machine has at least one core").with_context(what)?)
                }
                "rank-cpu-per-byte" => rank_cpu = Some(seconds(value).with_context(what)?),
                other => bail!(
                    "--network: unknown field {other:?} (expected latency, bandwidth, cpu-per-byte, hosts-of, intra-latency, intra-bandwidth, intra-cpu-per-byte, shared-cores, rank-cpu-per-byte)"
                ),
            }
        }
        if intra_cpu.is_some() && hosts_of.is_none() {
            bail!("--network {spec:?}: intra-cpu-per-byte only applies with hosts-of");
        }
        if rank_cpu.is_some() && shared_cores.is_none() {
            bail!("--network {spec:?}: rank-cpu-per-byte only applies with shared-cores");
        }
        let (Some(latency_s), Some(bandwidth_bytes_per_s)) = (latency, bandwidth) else {
            bail!("--network {spec:?}: latency= and bandwidth= are both required")
        };
        let inter = Link {
            latency_s,
            bandwidth_bytes_per_s,
            cpu_s_per_byte: cpu,
        };
        let intra = match (hosts_of, intra_latency, intra_bandwidth) {
            (None, None, None) => None,
            (Some(n), Some(latency_s), Some(bandwidth_bytes_per_s)) => Some((
                n,
                Link {
                    latency_s,
                    bandwidth_bytes_per_s,
                    cpu_s_per_byte: intra_cpu.unwrap_or(cpu),
                },
            )),
            _ => bail!("--network {spec:?}: hosts-of, intra-latency and intra-bandwidth go together"),
        };
        Ok(Network {
            name: spec.to_string(),
            inter,
            intra,
            shared_cores,
            rank_cpu_s_per_byte: rank_cpu,
        })
    }

    /// CPU seconds a rank spends per byte it sends over hop `rank → rank+1`, charged to shared cores. A hop
    /// between hosts costs `rank-cpu-per-byte` when given (a QUIC rank's threads together), else its γ; a
    /// hop inside a host costs its link's CPU per byte, which for shared memory is already measured over
    /// all of a rank's threads (BENCHMARKS.md "All-reduce CPU cost").
    pub fn rank_cpu_per_byte(&self, rank: usize, world: usize) -> f64 {
        self.link_cpu_per_byte(self.hop(rank, world), self.hop_is_intra(rank, world))
    }

    /// What [`Network::rank_cpu_per_byte`] charges per byte sent over `link`, inside a host or not.
    pub fn link_cpu_per_byte(&self, link: Link, intra: bool) -> f64 {
        match self.rank_cpu_s_per_byte {
            Some(rank_cpu) if !intra => rank_cpu,
            _ => link.cpu_s_per_byte,
        }
    }

    /// Whether hop `rank → rank+1 mod world` stays inside a host of a two-tier fabric.
    pub fn hop_is_intra(&self, rank: usize, world: usize) -> bool {
        matches!(self.intra, Some((per_host, _)) if rank / per_host == ((rank + 1) % world) / per_host)
    }

    /// How many of `world` ranks share one machine's cores (with `shared-cores`).
    pub fn ranks_per_machine(&self, world: usize) -> usize {
        match self.intra {
            Some((per_host, _)) => per_host.min(world),
            None => world,
        }
    }

    /// How many times longer compute takes when `world` ranks share the machine's cores: ranks per
    /// machine over cores, at least 1 (1 without `shared-cores`).
    pub fn compute_slowdown(&self, world: usize) -> f64 {
        self.shared_cores
            .map_or(1.0, |c| (self.ranks_per_machine(world) as f64 / c as f64).max(1.0))
    }

    /// The link of hop `rank → rank+1 mod world`.
    pub fn hop(&self, rank: usize, world: usize) -> Link {
        match self.intra {
            Some((_, intra)) if self.hop_is_intra(rank, world) => intra,
            _ => self.inter,
        }
    }
}

/// A whole number of at least one; `zero_means` says why 0 is refused.
fn positive_count(value: &str, zero_means: &str) -> Result<usize> {
    let n: usize = value
        .parse()
        .with_context(|| format!("{value:?} is not a whole number"))?;
    if n == 0 {
        bail!("{zero_means}");
    }
    Ok(n)
}

/// Splits `"30ms"` into `(30.0, "ms")`.
fn number_and_unit(value: &str) -> Result<(f64, &str)> {
    let split = value
        .find(|c: char| !(c.is_ascii_digit() || c == '.' || c == 'e' || c == '-' || c == '+'))
        .unwrap_or(value.len());
    let (num, unit) = value.split_at(split);
    let x: f64 = num
        .parse()
        .with_context(|| format!("{value:?} does not start with a number"))?;
    if !(x.is_finite() && x >= 0.0) {
        bail!("{value:?} must be a finite, non-negative number");
    }
    Ok((x, unit.trim()))
}

fn seconds(value: &str) -> Result<f64> {
    let (x, unit) = number_and_unit(value)?;
    let scale = match unit {
        "s" => 1.0,
        "ms" => 1e-3,
        "us" | "µs" => 1e-6,
        "ns" => 1e-9,
        _ => bail!("{value:?}: a time needs a unit: s, ms, us or ns"),
    };
    Ok(x * scale)
}

fn bytes_per_s(value: &str) -> Result<f64> {
    let (x, unit) = number_and_unit(value)?;
    let scale = match unit {
        "Gbit" | "Gbps" => 1e9 / 8.0,
        "Mbit" | "Mbps" => 1e6 / 8.0,
        "GB" => 1e9,
        "MB" => 1e6,
        _ => bail!("{value:?}: a bandwidth needs a unit: Gbit, Mbit, GB or MB (per second)"),
    };
    if x == 0.0 {
        bail!("{value:?}: bandwidth must be positive");
    }
    Ok(x * scale)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_preset_parses_and_spec_units_convert() {
        for (name, _) in PRESETS {
            assert_eq!(&Network::parse(name).unwrap().name, name);
        }
        let n = Network::parse("latency=30ms,bandwidth=1Gbit,cpu-per-byte=0.5ns").unwrap();
        assert!((n.inter.latency_s - 0.03).abs() < 1e-12);
        assert!((n.inter.bandwidth_bytes_per_s - 1.25e8).abs() < 1e-3);
        assert!((n.inter.cpu_s_per_byte - 0.5e-9).abs() < 1e-18);
        assert_eq!(n.intra, None);
        assert_eq!(n.shared_cores, None);
        let n = Network::parse("latency=1ms,bandwidth=1Gbit,shared-cores=2").unwrap();
        assert_eq!((n.shared_cores, n.ranks_per_machine(3)), (Some(2), 3));
        assert_eq!((n.compute_slowdown(3), n.compute_slowdown(2)), (1.5, 1.0));
        assert_eq!(n.rank_cpu_per_byte(0, 3), n.inter.cpu_s_per_byte);
        let n = Network::parse("latency=1ms,bandwidth=1Gbit,cpu-per-byte=1ns,shared-cores=2,rank-cpu-per-byte=3ns")
            .unwrap();
        assert!((n.rank_cpu_per_byte(0, 3) - 3e-9).abs() < 1e-18);
    }

    #[test]
    fn tiers_put_consecutive_ranks_on_a_host() {
        let n =
            Network::parse("latency=1ms,bandwidth=1Gbit,hosts-of=4,intra-latency=1us,intra-bandwidth=10GB").unwrap();
        let intra = n.intra.unwrap().1;
        assert_eq!(n.hop(0, 8), intra);
        assert_eq!(n.hop(3, 8), n.inter, "3 → 4 leaves host 0");
        assert_eq!(n.hop(7, 8), n.inter, "7 → 0 wraps to host 0");
        assert_eq!(n.hop(3, 4), intra, "one host: the wrap stays inside");
        assert_eq!((n.ranks_per_machine(8), n.ranks_per_machine(2)), (4, 2));
    }

    #[test]
    fn a_rank_pays_its_own_hops_cpu_rank_cpu_per_byte_prices_only_hops_between_hosts() {
        let n = Network::parse(
            "latency=50us,bandwidth=1Gbit,cpu-per-byte=4ns,hosts-of=2,intra-latency=30us,intra-bandwidth=1000GB,\
             intra-cpu-per-byte=0.25ns,shared-cores=1,rank-cpu-per-byte=9ns",
        )
        .unwrap();
        assert!(
            (n.rank_cpu_per_byte(0, 4) - 0.25e-9).abs() < 1e-18,
            "0 → 1 stays in host 0"
        );
        assert!((n.rank_cpu_per_byte(1, 4) - 9e-9).abs() < 1e-18, "1 → 2 leaves it");
        assert!(
            (n.rank_cpu_per_byte(3, 4) - 9e-9).abs() < 1e-18,
            "3 → 0 wraps to host 0"
        );
        // Host 0's machine pays for both its ranks: one sends inside the host, the other between hosts.
        let elems = 1 << 20;
        let shape = super::super::ring::RingShape {
            kind: super::super::ring::RingKind::AllReduce,
            elems,
            elem_bytes: 4,
            wire: ringtrain::collective::Wire::F32,
            sub_chunk: 1 << 14,
        };
        let sent_per_rank = 2.0 * 3.0 / 4.0 * (elems * 4) as f64;
        let flat = super::super::ring::Layout::Flat.send_cpu_s(&shape, 4, &n);
        assert!((flat - sent_per_rank * (0.25e-9 + 9e-9) / 2.0).abs() < 1e-12, "{flat}");
    }

    #[test]
    fn bad_specs_are_named() {
        for (spec, says) in [
            ("infiniband", "unknown network preset"),
            ("latency=1ms", "both required"),
            ("latency=1,bandwidth=1Gbit", "needs a unit"),
            ("latency=1ms,bandwidth=0Gbit", "positive"),
            ("latency=1ms,bandwidth=1Gbit,hosts-of=8", "go together"),
            ("latency=1ms,bandwidth=1Gbit,jitter=2ms", "unknown field"),
            ("latency=-1ms,bandwidth=1Gbit", "non-negative"),
            ("latency=1ms,bandwidth=1Gbit,shared-cores=0", "at least one core"),
            ("latency=1ms,bandwidth=1Gbit,shared-cores=1.5", "shared-cores=1.5"),
            (
                "latency=1ms,bandwidth=1Gbit,rank-cpu-per-byte=2ns",
                "only applies with shared-cores",
            ),
        ] {
            let err = format!("{:#}", Network::parse(spec).unwrap_err());
            assert!(err.contains(says), "{spec}: {err}");
        }
    }
}
