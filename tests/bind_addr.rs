//! Choosing the bind address: a rank 0 told by `RINGTRAIN_BIND_ADDR` to listen on 0.0.0.0 forms a 2-rank
//! job with `MASTER_ADDR=127.0.0.1`, through the same launch-environment path as `ringtrain train`. On
//! Linux rank 1 dials it at 127.0.0.2, which reaches only a socket bound to all addresses, so a rank 0 that
//! ignored the variable (and bound 127.0.0.1) would never hear from it.
//! The last test joins through `dist::join` itself, from a launch environment.

use std::collections::HashMap;
use std::net::UdpSocket;
use std::time::Duration;

use ringtrain::collective::Collective;
use ringtrain::dist::{
    detect_launch, detect_network, join, join_with, JoinOptions, LaunchEnv, LaunchFlags, LaunchSource,
};

/// An address other than 127.0.0.1 that still reaches this host's wildcard sockets (Linux routes all of
/// 127.0.0.0/8 to loopback; other systems only 127.0.0.1).
const OTHER_LOOPBACK: &str = if cfg!(target_os = "linux") {
    "127.0.0.2"
} else {
    "127.0.0.1"
};

fn vars(pairs: &[(&str, String)]) -> impl Fn(&str) -> Option<String> {
    let m: HashMap<String, String> = pairs.iter().map(|(k, v)| (k.to_string(), v.clone())).collect();
    move |k| m.get(k).cloned()
}

/// Forms a `world`-rank job whose rank 0 binds `bind` (via `RINGTRAIN_BIND_ADDR`) with
/// `MASTER_ADDR=127.0.0.1`, the others dialling it at [`OTHER_LOOPBACK`]; returns every rank's sum.
fn job_with_rank_0_bound_to(bind: &str, wildcard: &str, world: usize) -> Vec<Vec<f32>> {
    // A port free on every address (rank 0 binds it on the wildcard).
    let port = UdpSocket::bind(wildcard).unwrap().local_addr().unwrap().port();
    let opts = JoinOptions {
        config_hash: 11,
        // Listening beyond loopback requires a secret.
        secret: Some(b"bind address test".to_vec()),
        timeout: Duration::from_secs(15),
        faults: Default::default(),
        transport: ringtrain::collective::shm::LinkTransport::Quic,
        collective: Default::default(),
        epoch: 0,
        elastic: false,
    };
    std::thread::scope(|s| {
        let handles: Vec<_> = (0..world)
            .map(|rank| {
                let opts = &opts;
                s.spawn(move || {
                    let master = if rank == 0 { "127.0.0.1" } else { OTHER_LOOPBACK };
                    let mut env = vec![
                        ("RANK", rank.to_string()),
                        ("WORLD_SIZE", world.to_string()),
                        ("LOCAL_WORLD_SIZE", world.to_string()),
                        ("MASTER_ADDR", master.to_string()),
                        ("MASTER_PORT", port.to_string()),
                    ];
                    if rank == 0 {
                        env.push(("RINGTRAIN_BIND_ADDR", bind.to_string()));
                    }
                    let getenv = vars(&env);
                    let launch = detect_launch(&LaunchFlags::default(), &getenv).unwrap();
                    let network = detect_network(&getenv).unwrap();
                    assert_eq!(network.bind_ip.is_some(), rank == 0);
                    let mut comm: Box<dyn Collective> =
                        join_with(&launch, opts, &network).unwrap_or_else(|e| panic!("rank {rank}: {e:#}"));
                    let mut b = vec![rank as f32 + 1.0; 5];
                    comm.all_reduce_sum(&mut b).unwrap();
                    b
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

#[test]
fn rank_0_bound_to_all_addresses_forms_a_job_with_a_loopback_master() {
    assert_eq!(
        job_with_rank_0_bound_to("0.0.0.0", "0.0.0.0:0", 2),
        vec![vec![3.0; 5]; 2]
    );
}

/// A rank 0 bound to `::` is dual-stack and sees its IPv4 peers as `::ffff:a.b.c.d`; the ring it hands out
/// must hold their IPv4 form, or the middle ranks (IPv4 sockets) cannot dial their right neighbours.
#[test]
fn rank_0_bound_to_all_ipv6_addresses_hands_out_ipv4_peers_as_ipv4() {
    if UdpSocket::bind("[::]:0").is_err() {
        eprintln!("SKIP rank_0_bound_to_all_ipv6_addresses_hands_out_ipv4_peers_as_ipv4: no IPv6 on this host");
        return;
    }
    assert_eq!(job_with_rank_0_bound_to("::", "[::]:0", 3), vec![vec![6.0; 5]; 3]);
}

#[test]
fn an_invalid_bind_address_is_refused_naming_the_variable() {
    let e = detect_network(vars(&[("RINGTRAIN_BIND_ADDR", "eth0".to_string())])).unwrap_err();
    assert!(e.contains("RINGTRAIN_BIND_ADDR=\"eth0\""), "{e}");
    // A loopback bind while another host takes part is refused before anything is bound.
    let getenv = vars(&[
        ("RANK", "1".to_string()),
        ("WORLD_SIZE", "2".to_string()),
        ("LOCAL_WORLD_SIZE", "1".to_string()),
        ("MASTER_ADDR", "127.0.0.1".to_string()),
        ("MASTER_PORT", "9".to_string()),
        ("RINGTRAIN_BIND_ADDR", "127.0.0.1".to_string()),
    ]);
    let launch = detect_launch(&LaunchFlags::default(), &getenv).unwrap();
    let network = detect_network(&getenv).unwrap();
    let opts = JoinOptions {
        config_hash: 1,
        secret: None,
        timeout: Duration::from_secs(2),
        faults: Default::default(),
        transport: ringtrain::collective::shm::LinkTransport::Quic,
        collective: Default::default(),
        epoch: 0,
        elastic: false,
    };
    let e = format!("{:#}", join_with(&launch, &opts, &network).err().unwrap());
    assert!(e.contains("RINGTRAIN_BIND_ADDR=127.0.0.1 is a loopback address"), "{e}");
}

/// `dist::join` from a launch environment: world size 1 needs no network, world size 2 forms a ring.
#[test]
fn join_from_launch_env() {
    // The job id is RINGTRAIN_JOB_ID when set, else the config hash: the same for both ranks either way.
    let opts = JoinOptions {
        config_hash: 5,
        secret: None,
        timeout: Duration::from_secs(10),
        faults: Default::default(),
        transport: ringtrain::collective::shm::LinkTransport::Quic,
        collective: Default::default(),
        epoch: 0,
        elastic: false,
    };
    // World size 1: no network at all.
    let solo = LaunchEnv {
        rank: 0,
        world_size: 1,
        local_rank: 0,
        local_world_size: 1,
        master_addr: "127.0.0.1".into(),
        master_port: 1,
        source: LaunchSource::Single,
    };
    let mut c = join(&solo, &opts).unwrap();
    let mut b = vec![3.0f32; 5];
    c.all_reduce_mean(&mut b).unwrap();
    assert_eq!(b, vec![3.0; 5]);
    // World size 2 through the environment path, on a port picked here.
    let port = UdpSocket::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let res: Vec<Vec<f32>> = std::thread::scope(|s| {
        let hs: Vec<_> = (0..2)
            .map(|rank| {
                let opts = opts.clone();
                s.spawn(move || {
                    let env = LaunchEnv {
                        rank,
                        world_size: 2,
                        local_rank: rank,
                        local_world_size: 1,
                        master_addr: "localhost".into(),
                        master_port: port,
                        source: LaunchSource::Flags,
                    };
                    let mut c: Box<dyn Collective> = join(&env, &opts).unwrap();
                    let mut b = vec![rank as f32; 7];
                    c.all_reduce_sum(&mut b).unwrap();
                    b
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    assert_eq!(res, vec![vec![1.0; 7], vec![1.0; 7]]);
}
