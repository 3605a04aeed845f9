//! Launch settings: flags, then torchrun variables, then Slurm, then a single process.

use std::net::{IpAddr, SocketAddr, ToSocketAddrs};
use std::path::{Path, PathBuf};

/// torchrun's default rendezvous port.
pub const DEFAULT_MASTER_PORT: u16 = 29500;
/// The IP this rank binds (rank 0 with the master port, the others with an ephemeral one).
pub const BIND_ADDR_VAR: &str = "RINGTRAIN_BIND_ADDR";
/// Where the other ranks should dial this rank: `host:port`, or a host alone for the bound port.
pub const ADVERTISE_ADDR_VAR: &str = "RINGTRAIN_ADVERTISE_ADDR";
/// Names this rank's host: ranks with the same value link through shared memory (default: the machine id
/// and the network namespace).
pub const HOST_ID_VAR: &str = "RINGTRAIN_HOST_ID";
/// The UDP port a rank other than 0 binds (default: an ephemeral one). An elastic job's ranks bind it again at
/// every re-form, so a member asking to join can find them there ([`JOIN_ADDRS_VAR`]).
pub const LISTEN_PORT_VAR: &str = "RINGTRAIN_LISTEN_PORT";
/// Where a member asking to join a running elastic job may find its ranks, after the master address:
/// `host:port` entries separated by commas (the ranks' [`LISTEN_PORT_VAR`] addresses). Any running rank
/// points the member to the ring's rank 0, so one live entry is enough, also once rank 0 has left.
pub const JOIN_ADDRS_VAR: &str = "RINGTRAIN_JOIN_ADDRS";

/// Launch-related command-line flags (all optional).
#[derive(Clone, Debug, Default)]
pub struct LaunchFlags {
    pub rank: Option<usize>,
    pub world_size: Option<usize>,
    pub local_rank: Option<usize>,
    pub master_addr: Option<String>,
    pub master_port: Option<u16>,
}

/// Where the launch settings came from (the highest-priority source that supplied any of them).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LaunchSource {
    Flags,
    Torchrun,
    Slurm,
    Single,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LaunchEnv {
    pub rank: usize,
    pub world_size: usize,
    /// Picks the GPU on a multi-GPU host.
    pub local_rank: usize,
    /// Ranks on this host (torchrun's LOCAL_WORLD_SIZE, Slurm's tasks on this node; 1 when unknown): the
    /// host's cores are divided among them.
    pub local_world_size: usize,
    pub master_addr: String,
    pub master_port: u16,
    pub source: LaunchSource,
}

impl LaunchEnv {
    pub fn is_distributed(&self) -> bool {
        self.world_size > 1
    }
}

fn parse<T: std::str::FromStr>(name: &str, v: Option<String>) -> Result<Option<T>, String> {
    match v {
        None => Ok(None),
        Some(s) => s
            .trim()
            .parse()
            .map(Some)
            .map_err(|_| format!("environment variable {name}={s:?} is not valid")),
    }
}

/// First host of a Slurm node list such as `gpu[01-04,07],cpu5` (→ `gpu01`).
pub fn first_slurm_host(list: &str) -> Option<String> {
    let list = list.trim();
    if list.is_empty() {
        return None;
    }
    let end_plain = list.find(',').unwrap_or(list.len());
    match list.find('[') {
        Some(b) if b < end_plain => {
            let prefix = &list[..b];
            let rest = &list[b + 1..];
            let first: String = rest.chars().take_while(|c| c.is_ascii_alphanumeric()).collect();
            if first.is_empty() {
                None
            } else {
                Some(format!("{prefix}{first}"))
            }
        }
        _ => Some(list[..end_plain].to_string()),
    }
}

/// Resolves the launch settings: flags, then torchrun's RANK/WORLD_SIZE/LOCAL_RANK/MASTER_ADDR/MASTER_PORT,
/// then Slurm's SLURM_PROCID/SLURM_NTASKS/SLURM_LOCALID with the job's first node as master, else a single
/// process. `getenv` is `std::env::var(..).ok()` in production and a map in tests.
pub fn detect_launch(flags: &LaunchFlags, getenv: impl Fn(&str) -> Option<String>) -> Result<LaunchEnv, String> {
    let t_rank: Option<usize> = parse("RANK", getenv("RANK"))?;
    let t_world: Option<usize> = parse("WORLD_SIZE", getenv("WORLD_SIZE"))?;
    let t_local: Option<usize> = parse("LOCAL_RANK", getenv("LOCAL_RANK"))?;
    let t_port: Option<u16> = parse("MASTER_PORT", getenv("MASTER_PORT"))?;
    let t_addr = getenv("MASTER_ADDR");
    let s_rank: Option<usize> = parse("SLURM_PROCID", getenv("SLURM_PROCID"))?;
    let s_world: Option<usize> = parse("SLURM_NTASKS", getenv("SLURM_NTASKS"))?;
    let s_local: Option<usize> = parse("SLURM_LOCALID", getenv("SLURM_LOCALID"))?;
    let t_local_world: Option<usize> = parse("LOCAL_WORLD_SIZE", getenv("LOCAL_WORLD_SIZE"))?;
    let s_node: Option<usize> = parse("SLURM_NODEID", getenv("SLURM_NODEID"))?;
    let s_local_world = match getenv("SLURM_TASKS_PER_NODE") {
        Some(list) => Some(
            slurm_tasks_on_node(&list, s_node.unwrap_or(0))
                .ok_or_else(|| format!("environment variable SLURM_TASKS_PER_NODE={list:?} is not valid"))?,
        ),
        None => None,
    };
    let s_addr = getenv("SLURM_JOB_NODELIST")
        .or_else(|| getenv("SLURM_NODELIST"))
        .and_then(|l| first_slurm_host(&l));

    let source = if flags.rank.is_some() || flags.world_size.is_some() || flags.master_addr.is_some() {
        LaunchSource::Flags
    } else if t_rank.is_some() || t_world.is_some() {
        LaunchSource::Torchrun
    } else if s_rank.is_some() || s_world.is_some() {
        LaunchSource::Slurm
    } else {
        LaunchSource::Single
    };
    let world_size = flags.world_size.or(t_world).or(s_world).unwrap_or(1);
    let rank = flags.rank.or(t_rank).or(s_rank).unwrap_or(0);
    let local_rank = flags.local_rank.or(t_local).or(s_local).unwrap_or(0);
    let local_world_size = match source {
        LaunchSource::Slurm => s_local_world,
        _ => t_local_world,
    }
    .unwrap_or(1);
    let master_addr = flags
        .master_addr
        .clone()
        .or(t_addr)
        .or(s_addr)
        .unwrap_or_else(|| "127.0.0.1".to_string());
    let master_port = flags.master_port.or(t_port).unwrap_or(DEFAULT_MASTER_PORT);
    if world_size == 0 {
        return Err("world size must be at least 1".into());
    }
    if rank >= world_size {
        return Err(format!("rank {rank} is out of range for world size {world_size}"));
    }
    Ok(LaunchEnv {
        rank,
        world_size,
        local_rank,
        local_world_size,
        master_addr,
        master_port,
        source,
    })
}

/// The tasks on node `node` of a Slurm task list such as `2(x3),1` (nodes 0-2 run 2 tasks, node 3 runs 1).
/// `None` when the list is malformed or has no such node.
pub fn slurm_tasks_on_node(list: &str, node: usize) -> Option<usize> {
    let mut first_node = 0usize;
    for group in list.trim().split(',') {
        let (tasks, repeat) = match group.split_once("(x") {
            Some((tasks, rest)) => (tasks, rest.strip_suffix(')')?.parse::<usize>().ok()?),
            None => (group, 1),
        };
        let tasks: usize = tasks.parse().ok()?;
        if node < first_node.checked_add(repeat)? {
            return Some(tasks);
        }
        first_node += repeat;
    }
    None
}

/// The cluster secret: `--secret-file` first, then `RINGTRAIN_SECRET`; `None` when neither is set.
/// Trailing whitespace of the file is ignored; an empty secret is an error.
pub fn load_secret(
    secret_file: Option<&Path>,
    getenv: impl Fn(&str) -> Option<String>,
) -> Result<Option<Vec<u8>>, String> {
    let raw = match secret_file {
        Some(p) => {
            let bytes = std::fs::read(p).map_err(|e| format!("cannot read secret file {}: {e}", p.display()))?;
            let end = bytes
                .iter()
                .rposition(|b| !b.is_ascii_whitespace())
                .map_or(0, |i| i + 1);
            Some(bytes[..end].to_vec())
        }
        None => getenv("RINGTRAIN_SECRET").map(|s| s.into_bytes()),
    };
    match raw {
        Some(s) if s.is_empty() => Err("the cluster secret is empty".into()),
        other => Ok(other),
    }
}

/// A fresh random secret (hex) for a local launcher to hand to the processes it starts.
pub fn generate_secret() -> String {
    use rand::Rng;
    // The thread-local generator is a CSPRNG seeded from the operating system.
    let mut b = [0u8; 32];
    rand::rng().fill_bytes(&mut b);
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// Which address this rank listens on and which the others dial ([`BIND_ADDR_VAR`], [`ADVERTISE_ADDR_VAR`]);
/// both optional.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct NetworkEnv {
    pub bind_ip: Option<IpAddr>,
    pub advertise: Option<AdvertiseAddr>,
    /// [`HOST_ID_VAR`]: which ranks share a host, when the machine cannot tell (`None`: it can).
    pub host_id: Option<String>,
    /// [`LISTEN_PORT_VAR`]: the port a rank other than 0 binds (`None`: an ephemeral one).
    pub listen_port: Option<u16>,
    /// [`JOIN_ADDRS_VAR`]: where a joining member looks for the running job after the master address.
    pub join_addrs: Vec<SocketAddr>,
}

/// A host the other ranks should dial this rank at, and the port unless it is the one this rank binds.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AdvertiseAddr {
    /// An IP, or a host name resolved on this rank.
    pub host: String,
    pub port: Option<u16>,
}

impl AdvertiseAddr {
    /// Parses `ip`, `ip:port`, `[ipv6]:port`, `name` or `name:port`. The unspecified address and port 0
    /// cannot be dialled and are refused.
    pub fn parse(value: &str) -> Result<Self, String> {
        let v = value.trim();
        let bad = |why: &str| format!("environment variable {ADVERTISE_ADDR_VAR}={value:?} is not valid: {why}");
        let (host, port) = if let Ok(a) = v.parse::<SocketAddr>() {
            (a.ip().to_string(), Some(a.port()))
        } else if let Ok(ip) = v.parse::<IpAddr>() {
            (ip.to_string(), None)
        } else {
            let (name, port) = match v.split_once(':') {
                Some((name, port)) => {
                    let port = port
                        .parse::<u16>()
                        .map_err(|_| bad("expected host:port, an IP, or [IPv6]:port"))?;
                    (name, Some(port))
                }
                None => (v, None),
            };
            let name_chars = |c: char| c.is_ascii_alphanumeric() || c == '-' || c == '.';
            if name.is_empty() || !name.chars().all(name_chars) {
                return Err(bad("expected host:port, an IP, or [IPv6]:port"));
            }
            (name.to_string(), port)
        };
        if host.parse::<IpAddr>().is_ok_and(|ip| ip.is_unspecified()) {
            return Err(bad(
                "the unspecified address cannot be dialled; name an address of this host",
            ));
        }
        if port == Some(0) {
            return Err(bad(
                "port 0 cannot be dialled; give the port, or only the host for the bound port",
            ));
        }
        Ok(AdvertiseAddr { host, port })
    }

    /// The address to send in the hello (port 0: the port this rank binds, filled in once bound).
    pub fn resolve(&self) -> Result<SocketAddr, String> {
        let port = self.port.unwrap_or(0);
        if let Ok(ip) = self.host.parse::<IpAddr>() {
            return Ok(SocketAddr::new(ip, port));
        }
        resolve_host(&self.host, port).map_err(|e| format!("{ADVERTISE_ADDR_VAR}: {e}"))
    }
}

/// Reads [`BIND_ADDR_VAR`] and [`ADVERTISE_ADDR_VAR`]; an invalid value is an error naming the variable.
pub fn detect_network(getenv: impl Fn(&str) -> Option<String>) -> Result<NetworkEnv, String> {
    let bind_ip = match getenv(BIND_ADDR_VAR) {
        None => None,
        Some(v) => Some(v.trim().parse::<IpAddr>().map_err(|_| {
            format!(
                "environment variable {BIND_ADDR_VAR}={v:?} is not an IP address (give the address of the \
                 interface to listen on, or 0.0.0.0 for all)"
            )
        })?),
    };
    let advertise = getenv(ADVERTISE_ADDR_VAR)
        .map(|v| AdvertiseAddr::parse(&v))
        .transpose()?;
    let host_id = getenv(HOST_ID_VAR)
        .map(|v| {
            crate::collective::shm::check_host_id(&v)
                .map(|()| v.clone())
                .map_err(|e| format!("environment variable {HOST_ID_VAR}: {e}"))
        })
        .transpose()?;
    let listen_port = match getenv(LISTEN_PORT_VAR) {
        None => None,
        Some(v) => match v.trim().parse::<u16>() {
            Ok(port) if port > 0 => Some(port),
            _ => {
                return Err(format!(
                    "environment variable {LISTEN_PORT_VAR}={v:?} is not a port (1-65535)"
                ))
            }
        },
    };
    let join_addrs = match getenv(JOIN_ADDRS_VAR) {
        None => Vec::new(),
        Some(v) => parse_join_addrs(&v)?,
    };
    Ok(NetworkEnv {
        bind_ip,
        advertise,
        host_id,
        listen_port,
        join_addrs,
    })
}

/// The `host:port` entries of [`JOIN_ADDRS_VAR`], each resolved; at most [`MAX_JOIN_ADDRS`].
fn parse_join_addrs(value: &str) -> Result<Vec<SocketAddr>, String> {
    let bad = |why: String| format!("environment variable {JOIN_ADDRS_VAR}={value:?} is not valid: {why}");
    let entries: Vec<&str> = value.split(',').map(str::trim).filter(|e| !e.is_empty()).collect();
    if entries.len() > MAX_JOIN_ADDRS {
        return Err(bad(format!("{} entries, at most {MAX_JOIN_ADDRS}", entries.len())));
    }
    entries
        .iter()
        .map(|entry| {
            let (host, port) = entry
                .rsplit_once(':')
                .ok_or_else(|| bad(format!("{entry:?} is not host:port")))?;
            let host = host.trim_start_matches('[').trim_end_matches(']');
            let port = match port.parse::<u16>() {
                Ok(p) if p > 0 => p,
                _ => return Err(bad(format!("{entry:?} has no port to dial"))),
            };
            resolve_host(host, port).map_err(bad)
        })
        .collect()
}

/// Most entries [`JOIN_ADDRS_VAR`] may list.
pub const MAX_JOIN_ADDRS: usize = 1024;

/// Resolves `host:port`, preferring IPv4.
pub fn resolve_master(host: &str, port: u16) -> Result<SocketAddr, String> {
    resolve_host(host, port).map_err(|e| format!("master address {e}"))
}

/// Resolves `host:port`, preferring IPv4; the error starts with `host:port`.
fn resolve_host(host: &str, port: u16) -> Result<SocketAddr, String> {
    let addrs: Vec<SocketAddr> = (host, port)
        .to_socket_addrs()
        .map_err(|e| format!("{host}:{port} cannot be resolved: {e}"))?
        .collect();
    addrs
        .iter()
        .find(|a| a.is_ipv4())
        .or(addrs.first())
        .copied()
        .ok_or_else(|| format!("{host}:{port} resolves to nothing"))
}

/// Convenience for callers holding a path flag.
pub fn secret_from_env(secret_file: Option<&PathBuf>) -> Result<Option<Vec<u8>>, String> {
    load_secret(secret_file.map(|p| p.as_path()), |k| std::env::var(k).ok())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn env(pairs: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
        let m: HashMap<String, String> = pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        move |k| m.get(k).cloned()
    }

    #[test]
    fn precedence() {
        let single = detect_launch(&LaunchFlags::default(), env(&[])).unwrap();
        assert_eq!(
            (single.rank, single.world_size, single.source),
            (0, 1, LaunchSource::Single)
        );
        let t = detect_launch(
            &LaunchFlags::default(),
            env(&[
                ("RANK", "2"),
                ("WORLD_SIZE", "4"),
                ("LOCAL_RANK", "1"),
                ("MASTER_ADDR", "h0"),
                ("MASTER_PORT", "1234"),
            ]),
        )
        .unwrap();
        assert_eq!(
            (
                t.rank,
                t.world_size,
                t.local_rank,
                t.master_addr.as_str(),
                t.master_port
            ),
            (2, 4, 1, "h0", 1234)
        );
        assert_eq!(t.source, LaunchSource::Torchrun);
        let s = detect_launch(
            &LaunchFlags::default(),
            env(&[
                ("SLURM_PROCID", "3"),
                ("SLURM_NTASKS", "8"),
                ("SLURM_LOCALID", "3"),
                ("SLURM_JOB_NODELIST", "gpu[07-09],x"),
            ]),
        )
        .unwrap();
        assert_eq!(
            (s.rank, s.world_size, s.master_addr.as_str(), s.source),
            (3, 8, "gpu07", LaunchSource::Slurm)
        );
        let f = detect_launch(
            &LaunchFlags {
                rank: Some(1),
                world_size: Some(2),
                ..Default::default()
            },
            env(&[("RANK", "2"), ("WORLD_SIZE", "4")]),
        )
        .unwrap();
        assert_eq!((f.rank, f.world_size, f.source), (1, 2, LaunchSource::Flags));
        assert!(detect_launch(&LaunchFlags::default(), env(&[("RANK", "4"), ("WORLD_SIZE", "4")])).is_err());
        assert!(detect_launch(&LaunchFlags::default(), env(&[("RANK", "x")])).is_err());
    }

    #[test]
    fn local_world_size() {
        let t = detect_launch(
            &LaunchFlags::default(),
            env(&[("RANK", "0"), ("WORLD_SIZE", "4"), ("LOCAL_WORLD_SIZE", "2")]),
        )
        .unwrap();
        assert_eq!(t.local_world_size, 2);
        let s = detect_launch(
            &LaunchFlags::default(),
            env(&[
                ("SLURM_PROCID", "5"),
                ("SLURM_NTASKS", "7"),
                ("SLURM_NODEID", "3"),
                ("SLURM_TASKS_PER_NODE", "2(x3),1"),
            ]),
        )
        .unwrap();
        assert_eq!(s.local_world_size, 1);
        assert_eq!(
            detect_launch(&LaunchFlags::default(), env(&[]))
                .unwrap()
                .local_world_size,
            1
        );
        let bad = detect_launch(
            &LaunchFlags::default(),
            env(&[
                ("SLURM_PROCID", "0"),
                ("SLURM_NTASKS", "2"),
                ("SLURM_TASKS_PER_NODE", "2(x"),
            ]),
        );
        assert!(bad.unwrap_err().contains("SLURM_TASKS_PER_NODE"));
    }

    #[test]
    fn slurm_task_lists() {
        assert_eq!(slurm_tasks_on_node("4", 0), Some(4));
        assert_eq!(slurm_tasks_on_node("2(x3),1", 2), Some(2));
        assert_eq!(slurm_tasks_on_node("2(x3),1", 3), Some(1));
        assert_eq!(slurm_tasks_on_node("2(x3),1", 4), None);
        assert_eq!(slurm_tasks_on_node("x", 0), None);
        assert_eq!(slurm_tasks_on_node("1(x18446744073709551615),1", 5), Some(1));
    }

    #[test]
    fn slurm_hosts() {
        assert_eq!(first_slurm_host("node7").as_deref(), Some("node7"));
        assert_eq!(first_slurm_host("a,b").as_deref(), Some("a"));
        assert_eq!(first_slurm_host("n[001-004]").as_deref(), Some("n001"));
        assert_eq!(first_slurm_host("").as_deref(), None);
    }

    #[test]
    fn network_variables() {
        assert_eq!(detect_network(env(&[])).unwrap(), NetworkEnv::default());
        let n = detect_network(env(&[
            ("RINGTRAIN_BIND_ADDR", " 0.0.0.0 "),
            ("RINGTRAIN_ADVERTISE_ADDR", "203.0.113.9:4000"),
        ]))
        .unwrap();
        assert_eq!(n.bind_ip, Some("0.0.0.0".parse().unwrap()));
        assert_eq!(
            n.advertise.unwrap().resolve().unwrap(),
            "203.0.113.9:4000".parse().unwrap()
        );
        let v6 = detect_network(env(&[("RINGTRAIN_BIND_ADDR", "::")])).unwrap();
        assert_eq!(v6.bind_ip, Some("::".parse().unwrap()));
        for bad in ["eth0", "10.0.0.1:29500", ""] {
            let e = detect_network(env(&[("RINGTRAIN_BIND_ADDR", bad)])).unwrap_err();
            assert!(
                e.contains("RINGTRAIN_BIND_ADDR") && e.contains("not an IP address"),
                "{e}"
            );
        }
    }

    #[test]
    fn listen_port_and_join_addresses() {
        let n = detect_network(env(&[
            ("RINGTRAIN_LISTEN_PORT", " 29601 "),
            ("RINGTRAIN_JOIN_ADDRS", "127.0.0.1:29500, [::1]:29601,,localhost:29602"),
        ]))
        .unwrap();
        assert_eq!(n.listen_port, Some(29601));
        let want: Vec<SocketAddr> = ["127.0.0.1:29500", "[::1]:29601", "127.0.0.1:29602"]
            .iter()
            .map(|a| a.parse().unwrap())
            .collect();
        assert_eq!(n.join_addrs, want);
        for bad in ["0", "65536", "x", ""] {
            let e = detect_network(env(&[("RINGTRAIN_LISTEN_PORT", bad)])).unwrap_err();
            assert!(e.contains("RINGTRAIN_LISTEN_PORT") && e.contains("not a port"), "{e}");
        }
        for (bad, why) in [
            ("10.0.0.1", "not host:port"),
            ("10.0.0.1:0", "no port"),
            ("10.0.0.1:x", "no port"),
        ] {
            let e = detect_network(env(&[("RINGTRAIN_JOIN_ADDRS", bad)])).unwrap_err();
            assert!(e.contains("RINGTRAIN_JOIN_ADDRS") && e.contains(why), "{bad}: {e}");
        }
        let many = vec!["127.0.0.1:1"; MAX_JOIN_ADDRS + 1].join(",");
        let e = detect_network(env(&[("RINGTRAIN_JOIN_ADDRS", &many)])).unwrap_err();
        assert!(e.contains("at most"), "{e}");
    }

    #[test]
    fn advertised_addresses() {
        let parsed = |v: &str| AdvertiseAddr::parse(v).map(|a| (a.host, a.port));
        let some = |h: &str, p: Option<u16>| Ok((h.to_string(), p));
        assert_eq!(parsed("10.0.0.5"), some("10.0.0.5", None));
        assert_eq!(parsed("10.0.0.5:4000"), some("10.0.0.5", Some(4000)));
        assert_eq!(parsed("[fe80::1]:4000"), some("fe80::1", Some(4000)));
        assert_eq!(parsed("fe80::1"), some("fe80::1", None));
        assert_eq!(parsed("node-7.cluster:4000"), some("node-7.cluster", Some(4000)));
        assert_eq!(parsed("node7"), some("node7", None));
        // Only the host: the bound port is filled in once the socket is bound.
        assert_eq!(
            AdvertiseAddr::parse("10.0.0.5").unwrap().resolve().unwrap(),
            "10.0.0.5:0".parse().unwrap()
        );
        assert_eq!(
            AdvertiseAddr::parse("localhost:4000")
                .unwrap()
                .resolve()
                .unwrap()
                .port(),
            4000
        );
        for (bad, why) in [
            ("", "expected host:port"),
            ("node7:http", "expected host:port"),
            ("a:1:2", "expected host:port"),
            ("node 7", "expected host:port"),
            ("0.0.0.0:4000", "unspecified"),
            ("::", "unspecified"),
            ("10.0.0.5:0", "port 0"),
        ] {
            let e = AdvertiseAddr::parse(bad).unwrap_err();
            assert!(
                e.contains("RINGTRAIN_ADVERTISE_ADDR") && e.contains(why),
                "{bad:?}: {e}"
            );
        }
        let e = detect_network(env(&[("RINGTRAIN_ADVERTISE_ADDR", "x:y")])).unwrap_err();
        assert!(e.contains("RINGTRAIN_ADVERTISE_ADDR=\"x:y\""), "{e}");
    }

    #[test]
    fn secrets() {
        assert_eq!(load_secret(None, env(&[])).unwrap(), None);
        assert_eq!(
            load_secret(None, env(&[("RINGTRAIN_SECRET", "abc")])).unwrap(),
            Some(b"abc".to_vec())
        );
        assert!(load_secret(None, env(&[("RINGTRAIN_SECRET", "")])).is_err());
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("s");
        std::fs::write(&p, "xyz\n").unwrap();
        assert_eq!(
            load_secret(Some(&p), env(&[("RINGTRAIN_SECRET", "abc")])).unwrap(),
            Some(b"xyz".to_vec())
        );
        assert_eq!(generate_secret().len(), 64);
    }
}
