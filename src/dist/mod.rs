//! Joining a job: who am I and where is the master (flags, torchrun or Slurm variables), which cluster
//! secret and job id, and [`join`], the one function that turns them into a [`Collective`] for the binary,
//! the sim and the tests. The rendezvous itself and its messages live in [`crate::collective::quic`].

pub mod elastic;
pub mod env;
pub mod threads;

pub use env::{
    detect_launch, detect_network, generate_secret, load_secret, resolve_master, AdvertiseAddr, LaunchEnv, LaunchFlags,
    LaunchSource, NetworkEnv, ADVERTISE_ADDR_VAR, BIND_ADDR_VAR, HOST_ID_VAR, JOIN_ADDRS_VAR, LISTEN_PORT_VAR,
};
pub use threads::{thread_budget, ThreadBudget};

use crate::fault_plan::FaultPlan;
use std::net::{IpAddr, SocketAddr};
use std::time::Duration;

use anyhow::Context;

use crate::collective::mem::single_rank;
use crate::collective::quic::{QuicCollective, QuicConfig};
use crate::collective::shm::LinkTransport;
use crate::collective::{Collective, CollectiveChoice};

/// The environment variable holding the job id (a decimal number), which every rank of a job must share.
/// `ringtrain launch` sets it to a fresh random id.
pub const JOB_ID_VAR: &str = "RINGTRAIN_JOB_ID";

/// Set (to `1`) by `ringtrain launch --max-restarts` on a rank it restarts: the rank asks the running
/// elastic job to take it back ([`elastic::rejoin`]) instead of joining a first rendezvous.
pub const REJOIN_VAR: &str = "RINGTRAIN_ELASTIC_REJOIN";

/// Set to a member id by whoever starts a new rank for a running elastic job: the rank asks the job to take
/// it in as that member ([`elastic::rejoin`]). The job's first members are 0 to its first world size minus
/// one; a new member takes an id the job does not use, below [`elastic::MAX_MEMBER_ID`]. The rank is
/// started like one of the job's (`WORLD_SIZE` the job's first world size, the same flags).
pub const JOIN_AS_VAR: &str = "RINGTRAIN_ELASTIC_JOIN";

/// What [`join`] needs besides the launch environment.
#[derive(Clone, Debug)]
pub struct JoinOptions {
    /// Digest of what every rank must agree on (for training, `TrainOptions::job_hash`); ranks with
    /// different hashes are refused at rendezvous. It is also the job id when [`JOB_ID_VAR`] is not set.
    pub config_hash: u64,
    /// Cluster secret ([`load_secret`]); required unless the master is a loopback address.
    pub secret: Option<Vec<u8>>,
    /// Per-collective deadline, and how long the rendezvous waits for every rank to join.
    pub timeout: Duration,
    /// Faults to inject: the transport applies the message kinds that name this rank (the trainer the rest).
    pub faults: FaultPlan,
    /// Shared memory or QUIC between ranks of one host (`--transport`).
    pub transport: LinkTransport,
    /// The flat ring or the two-level one (`--collective`), resolved by rank 0 at rendezvous.
    pub collective: CollectiveChoice,
    /// The membership epoch this join forms (0 at the start; an elastic re-form counts up), which gives
    /// the ring its own job id ([`elastic::epoch_job_id`]).
    pub epoch: u64,
    /// An elastic job: a member asking to join waits at rank 0 until the running ranks admit it (the other
    /// ranks point it there), and a re-form's rendezvous ends with who is missing.
    pub elastic: bool,
}

/// The job id: the value of [`JOB_ID_VAR`] when it is set (`value`), else `config_hash`. A value that is not
/// a number is an error naming the variable.
pub fn job_id(value: Option<&str>, config_hash: u64) -> anyhow::Result<u64> {
    match value {
        Some(id) => id
            .trim()
            .parse()
            .with_context(|| format!("{JOB_ID_VAR}={id:?} is not a number")),
        None => Ok(config_hash),
    }
}

/// Joins the job described by `launch`: a one-rank group, which never communicates, when the world size is
/// 1, else the QUIC ring (rendezvous at the master) with the job id of [`job_id`] and the addresses of
/// [`detect_network`] read from the process environment. Blocks until every rank has joined.
pub fn join(launch: &LaunchEnv, opts: &JoinOptions) -> anyhow::Result<Box<dyn Collective>> {
    if launch.world_size == 1 {
        return Ok(single_rank());
    }
    let network = detect_network(|k| std::env::var(k).ok()).map_err(anyhow::Error::msg)?;
    if let Some(a) = &network.advertise {
        // The variable is the host's, shared by its ranks; a `NetworkEnv` given to `join_with` is one rank's.
        refuse_shared_advertised_port(launch, a)?;
    }
    join_with(launch, opts, &network)
}

/// [`join`] with this rank's bind and advertised addresses given rather than read from the environment.
pub fn join_with(launch: &LaunchEnv, opts: &JoinOptions, network: &NetworkEnv) -> anyhow::Result<Box<dyn Collective>> {
    join_ring(launch, opts, network, None)
}

/// [`join_with`] on a UDP socket this rank already bound (a rank that must know its port before the ring
/// forms, for example to open a relay or a port forward in front of it).
pub fn join_on(
    launch: &LaunchEnv,
    opts: &JoinOptions,
    network: &NetworkEnv,
    socket: std::net::UdpSocket,
) -> anyhow::Result<Box<dyn Collective>> {
    join_ring(launch, opts, network, Some(socket))
}

fn join_ring(
    launch: &LaunchEnv,
    opts: &JoinOptions,
    network: &NetworkEnv,
    socket: Option<std::net::UdpSocket>,
) -> anyhow::Result<Box<dyn Collective>> {
    if launch.world_size == 1 {
        return Ok(single_rank());
    }
    let cfg = quic_config(launch, opts, network)?;
    let master = cfg.master;
    let connected = match socket {
        Some(socket) => QuicCollective::connect_with_socket(cfg, socket),
        None => QuicCollective::connect(cfg),
    };
    let mut comm = connected.with_context(|| {
        let from = match network.bind_ip {
            Some(ip) => format!(" from {BIND_ADDR_VAR}={ip}"),
            None => String::new(),
        };
        format!(
            "rank {} of {}: joining the ring at {master}{from}",
            launch.rank, launch.world_size
        )
    })?;
    comm.inject_faults(&opts.faults)?;
    Ok(Box::new(comm))
}

/// The QUIC settings of this rank's join: the master resolved and checked, this rank's addresses, the
/// secret, timeouts, the epoch's job id and the elastic job's first epoch.
pub(crate) fn quic_config(launch: &LaunchEnv, opts: &JoinOptions, network: &NetworkEnv) -> anyhow::Result<QuicConfig> {
    let master = resolve_master(&launch.master_addr, launch.master_port).map_err(anyhow::Error::msg)?;
    refuse_unreachable_master(launch, master)?;
    let advertise = match &network.advertise {
        Some(a) => Some(a.resolve().map_err(anyhow::Error::msg)?),
        None => None,
    };
    refuse_unreachable_rank(launch, master, network.bind_ip, advertise)?;
    let mut cfg = QuicConfig::new(launch.rank, launch.world_size, master);
    cfg.bind_ip = network.bind_ip;
    cfg.advertise_addr = advertise;
    cfg.secret = opts.secret.clone();
    cfg.timeout = opts.timeout;
    cfg.rendezvous_timeout = opts.timeout;
    cfg.config_hash = opts.config_hash;
    let job = job_id(std::env::var(JOB_ID_VAR).ok().as_deref(), opts.config_hash)?;
    cfg.job_id = elastic::epoch_job_id(job, opts.epoch);
    cfg.elastic_first = opts.elastic.then_some(job);
    cfg.transport = opts.transport;
    cfg.collective = opts.collective;
    cfg.host_id = network.host_id.clone();
    cfg.listen_port = network.listen_port;
    Ok(cfg)
}

/// Why ranks on other hosts could not reach this one, or `None` when every rank runs here.
fn other_hosts(launch: &LaunchEnv) -> Option<String> {
    (launch.local_world_size < launch.world_size).then(|| {
        format!(
            "only {} of the {} ranks run here (LOCAL_WORLD_SIZE or Slurm)",
            launch.local_world_size, launch.world_size
        )
    })
}

/// A master name that resolves to a loopback address on this host (Debian's `/etc/hosts` maps the host's
/// own name to 127.0.1.1) while ranks run on other hosts: rank 0 would listen where no other host can
/// reach it, and they would retry until the timeout. Refused with what to do instead. An address given as
/// an IP, or `localhost`, says what it means and is taken as it is.
fn refuse_unreachable_master(launch: &LaunchEnv, master: SocketAddr) -> anyhow::Result<()> {
    let host = launch.master_addr.trim();
    let named = host.parse::<IpAddr>().is_err() && !host.eq_ignore_ascii_case("localhost");
    match other_hosts(launch) {
        Some(elsewhere) if named && master.ip().is_loopback() => anyhow::bail!(
            "MASTER_ADDR {host} resolves to {} on this host, a loopback address, but {elsewhere}: ranks on other \
             hosts could not reach rank 0. Set MASTER_ADDR to an address of rank 0's host that the others can \
             reach (for one host, 127.0.0.1)",
            master.ip()
        ),
        _ => Ok(()),
    }
}

/// This rank's own addresses ([`BIND_ADDR_VAR`], [`ADVERTISE_ADDR_VAR`]) that could not work: a bind address
/// of another family than the master's (only IPv6's unspecified address takes both), or, when ranks on
/// other hosts take part, a loopback bind or advertised address, which they could not reach.
fn refuse_unreachable_rank(
    launch: &LaunchEnv,
    master: SocketAddr,
    bind_ip: Option<IpAddr>,
    advertise: Option<SocketAddr>,
) -> anyhow::Result<()> {
    if let Some(ip) = bind_ip {
        let dual_stack = ip.is_ipv6() && ip.is_unspecified();
        if ip.is_ipv4() != master.is_ipv4() && !dual_stack {
            anyhow::bail!(
                "{BIND_ADDR_VAR}={ip} and the master address {master} are of different IP families: a socket on \
                 {ip} cannot reach the master. Bind an address of the master's family"
            );
        }
    }
    let Some(elsewhere) = other_hosts(launch) else {
        return Ok(());
    };
    if let Some(ip) = bind_ip.filter(|ip| ip.is_loopback()) {
        anyhow::bail!(
            "{BIND_ADDR_VAR}={ip} is a loopback address, but {elsewhere}: ranks on other hosts could not reach \
             this rank. Bind an address of an interface they can reach, or 0.0.0.0 for all"
        );
    }
    if let Some(a) = advertise.filter(|a| a.ip().is_loopback()) {
        anyhow::bail!(
            "{ADVERTISE_ADDR_VAR} names {}, a loopback address, but {elsewhere}: ranks on other hosts could not \
             reach this rank there. Advertise an address of this host that they can reach",
            a.ip()
        );
    }
    Ok(())
}

/// An advertised address with a port while several ranks run on this host: launchers hand every local rank
/// the same environment, so they would all advertise one port, and the others would dial the wrong rank.
fn refuse_shared_advertised_port(launch: &LaunchEnv, advertise: &AdvertiseAddr) -> anyhow::Result<()> {
    match advertise.port {
        Some(port) if launch.local_world_size > 1 => anyhow::bail!(
            "{ADVERTISE_ADDR_VAR} names port {port}, but {} ranks run on this host and would all advertise it; \
             give only the host, and each rank advertises the port it binds",
            launch.local_world_size
        ),
        _ => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn launch(master_addr: &str, local_world_size: usize) -> LaunchEnv {
        LaunchEnv {
            rank: 0,
            world_size: 3,
            local_rank: 0,
            local_world_size,
            master_addr: master_addr.into(),
            master_port: 29500,
            source: LaunchSource::Torchrun,
        }
    }

    #[test]
    fn a_host_name_resolving_to_loopback_is_refused_when_other_hosts_take_part() {
        let loopback: SocketAddr = "127.0.1.1:29500".parse().unwrap();
        let err = refuse_unreachable_master(&launch("trainer-0", 1), loopback)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("MASTER_ADDR trainer-0") && err.contains("127.0.1.1") && !err.contains("  "),
            "{err}"
        );
        // All ranks on this host, an IP given as such, or localhost: taken as they are.
        assert!(refuse_unreachable_master(&launch("trainer-0", 3), loopback).is_ok());
        assert!(refuse_unreachable_master(&launch("127.0.1.1", 1), loopback).is_ok());
        assert!(refuse_unreachable_master(&launch("localhost", 1), loopback).is_ok());
        let remote: SocketAddr = "10.0.0.5:29500".parse().unwrap();
        assert!(refuse_unreachable_master(&launch("trainer-0", 1), remote).is_ok());
    }

    #[test]
    fn a_loopback_bind_or_advertised_address_is_refused_when_other_hosts_take_part() {
        let master: SocketAddr = "10.0.0.5:29500".parse().unwrap();
        let ip = |s: &str| Some(s.parse::<IpAddr>().unwrap());
        let addr = |s: &str| Some(s.parse::<SocketAddr>().unwrap());
        let err = refuse_unreachable_rank(&launch("10.0.0.5", 1), master, ip("127.0.0.1"), None)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("RINGTRAIN_BIND_ADDR=127.0.0.1") && err.contains("only 1 of the 3 ranks"),
            "{err}"
        );
        let err = refuse_unreachable_rank(&launch("10.0.0.5", 1), master, None, addr("127.0.0.1:4000"))
            .unwrap_err()
            .to_string();
        assert!(err.contains("RINGTRAIN_ADVERTISE_ADDR names 127.0.0.1"), "{err}");
        // Reachable addresses, or every rank on this host: fine.
        assert!(refuse_unreachable_rank(&launch("10.0.0.5", 1), master, ip("0.0.0.0"), None).is_ok());
        assert!(refuse_unreachable_rank(&launch("10.0.0.5", 1), master, ip("10.0.0.7"), addr("10.0.0.7:0")).is_ok());
        assert!(refuse_unreachable_rank(&launch("10.0.0.5", 3), master, ip("127.0.0.1"), addr("127.0.0.1:0")).is_ok());
    }

    #[test]
    fn an_advertised_port_is_refused_when_several_ranks_share_the_host() {
        let with_port = AdvertiseAddr::parse("10.0.0.7:4000").unwrap();
        let host_only = AdvertiseAddr::parse("10.0.0.7").unwrap();
        let err = refuse_shared_advertised_port(&launch("10.0.0.5", 2), &with_port)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("RINGTRAIN_ADVERTISE_ADDR names port 4000") && err.contains("2 ranks"),
            "{err}"
        );
        assert!(refuse_shared_advertised_port(&launch("10.0.0.5", 1), &with_port).is_ok());
        assert!(refuse_shared_advertised_port(&launch("10.0.0.5", 2), &host_only).is_ok());
    }

    #[test]
    fn a_bind_address_of_another_family_than_the_master_is_refused() {
        let v4: SocketAddr = "10.0.0.5:29500".parse().unwrap();
        let v6: SocketAddr = "[fd00::5]:29500".parse().unwrap();
        let ip = |s: &str| Some(s.parse::<IpAddr>().unwrap());
        let err = refuse_unreachable_rank(&launch("fd00::5", 3), v6, ip("0.0.0.0"), None)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("RINGTRAIN_BIND_ADDR=0.0.0.0") && err.contains("different IP families"),
            "{err}"
        );
        assert!(refuse_unreachable_rank(&launch("10.0.0.5", 3), v4, ip("fd00::7"), None).is_err());
        // IPv6's unspecified address listens on both families.
        assert!(refuse_unreachable_rank(&launch("10.0.0.5", 3), v4, ip("::"), None).is_ok());
        assert!(refuse_unreachable_rank(&launch("fd00::5", 3), v6, ip("fd00::7"), None).is_ok());
    }

    #[test]
    fn job_id_is_the_variable_or_the_config_hash() {
        assert_eq!(job_id(None, 77).unwrap(), 77);
        assert_eq!(job_id(Some(" 12345\n"), 77).unwrap(), 12345);
        let err = format!("{:#}", job_id(Some("my-job"), 77).unwrap_err());
        assert!(err.contains("RINGTRAIN_JOB_ID") && err.contains("my-job"), "{err}");
    }
}
