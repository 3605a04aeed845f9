//! Launch settings: flags, then torchrun variables, then Slurm, then a single process.

use std::net::{SocketAddr, ToSocketAddrs};
use std::path::{Path, PathBuf};

/// torchrun's default rendezvous port.
pub const DEFAULT_MASTER_PORT: u16 = 29500;

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

/// Resolves `host:port`, preferring IPv4.
pub fn resolve_master(host: &str, port: u16) -> Result<SocketAddr, String> {
    let addrs: Vec<SocketAddr> = (host, port)
        .to_socket_addrs()
        .map_err(|e| format!("cannot resolve master address {host}:{port}: {e}"))?
        .collect();
    addrs
        .iter()
        .find(|a| a.is_ipv4())
        .or(addrs.first())
        .copied()
        .ok_or_else(|| format!("master address {host}:{port} resolves to nothing"))
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
