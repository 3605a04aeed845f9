//! Control messages (JSON in `Kind::Control` frames). Rank 0 hosts the rendezvous; every other rank sends a
//! [`Hello`], and rank 0 answers [`Control::Welcome`] with the ring of listen addresses and certificate
//! fingerprints once all ranks have joined, or [`Control::Refused`] with a message naming the field that does not match. A ring link opens
//! with [`Control::PeerHello`], and a rank leaving cleanly tells rank 0 [`Control::Bye`].

use std::net::SocketAddr;

use serde::{Deserialize, Serialize};

/// What a rank says when it joins.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Hello {
    pub version: u16,
    pub job_id: u64,
    pub rank: usize,
    pub world: usize,
    pub config_hash: u64,
    /// Where the other ranks should dial this rank; `None`: where rank 0 sees this hello come from.
    pub advertise: Option<SocketAddr>,
    /// This rank's host and shared-memory endpoint; `None` when it uses QUIC on every link.
    pub local: Option<LocalEndpoint>,
    /// This rank's host identity ([`crate::collective::shm::host_identity`]), which groups ranks for the
    /// two-level ring; `None` when it could not be read.
    pub host: Option<String>,
    /// `--collective` as this rank was started with ("flat", "hierarchical", "auto").
    pub collective: String,
}

/// What ranks of one host need to link through shared memory: which host, which process, and where it
/// listens for segments ([`crate::collective::shm::handoff`]).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct LocalEndpoint {
    /// [`crate::collective::shm::host_identity`]: ranks with equal identities share a host.
    pub host: String,
    pub pid: u32,
    pub uid: u32,
    /// The abstract Unix socket name the rank listens on.
    pub socket: String,
    /// What a rank offering this rank a segment must show.
    pub nonce: [u8; 16],
}

/// Longest socket name accepted (an abstract Unix address holds at most 107 bytes after its NUL).
const MAX_SOCKET_NAME: usize = 107;

impl LocalEndpoint {
    /// Bounds on what a peer may put in one.
    pub fn check(&self) -> Result<(), String> {
        // The identity is `given:` and the user's, or the machine's with its namespace.
        if self.host.is_empty() || self.host.len() > 2 * crate::collective::shm::MAX_HOST_ID {
            return Err(format!("host identity of {} bytes", self.host.len()));
        }
        if self.socket.is_empty() || self.socket.len() > MAX_SOCKET_NAME {
            return Err(format!("shared-memory socket name of {} bytes", self.socket.len()));
        }
        Ok(())
    }
}

impl Hello {
    /// Checks a joining rank's hello against rank 0's own. The error names the first mismatching field.
    /// Whether a member asking to join a running elastic job (`self`, a hello of the job's first epoch)
    /// may: the same protocol version, job, configuration and collective as `host` (rank 0's hello of
    /// the running epoch, whose job id is `first_job`), and a member id below [`crate::elastic::MAX_MEMBER_ID`]:
    /// one of the first membership's ranks, or a new member's id past them. The world size it gives is not
    /// compared (see below).
    pub fn check_join(&self, host: &Hello, first_job: u64) -> Result<(), String> {
        let max = crate::elastic::MAX_MEMBER_ID as usize;
        if self.rank >= max {
            return Err(format!("join refused: member id {} is not below {max}", self.rank));
        }
        // The member id is checked above, and the world is not compared: the config hash holds the global
        // batch, which is what a member must share (a new one cannot know the world of the moment).
        let me = Hello {
            job_id: first_job,
            world: 2,
            ..host.clone()
        };
        let as_joiner = Hello {
            rank: 1,
            world: 2,
            ..self.clone()
        };
        as_joiner.check_against(&me).map_err(|e| format!("join refused: {e}"))
    }

    pub fn check_against(&self, host: &Hello) -> Result<(), String> {
        let r = self.rank;
        if self.version != host.version {
            return Err(format!(
                "protocol version mismatch: rank {r} speaks version {}, rank 0 speaks {}",
                self.version, host.version
            ));
        }
        if self.job_id != host.job_id {
            return Err(format!(
                "job id mismatch: rank {r} has job id {:#x}, rank 0 has {:#x}",
                self.job_id, host.job_id
            ));
        }
        if self.world != host.world {
            return Err(format!(
                "world size mismatch: rank {r} says world size {}, rank 0 says {}",
                self.world, host.world
            ));
        }
        if self.config_hash != host.config_hash {
            return Err(format!(
                "config hash mismatch: rank {r} has config hash {:#x}, rank 0 has {:#x}",
                self.config_hash, host.config_hash
            ));
        }
        if self.rank == 0 || self.rank >= host.world {
            return Err(format!(
                "rank {r} is not a valid joining rank for world size {}",
                host.world
            ));
        }
        if let Some(a) = self.advertise.filter(|a| a.ip().is_unspecified() || a.port() == 0) {
            return Err(format!("rank {r} advertises {a}, which no rank can dial"));
        }
        if let Some(Err(e)) = self.local.as_ref().map(LocalEndpoint::check) {
            return Err(format!("rank {r} sends a bad shared-memory endpoint: {e}"));
        }
        if let Some(h) = self
            .host
            .as_ref()
            .filter(|h| h.is_empty() || h.len() > 2 * crate::collective::shm::MAX_HOST_ID)
        {
            return Err(format!("rank {r} sends a host identity of {} bytes", h.len()));
        }
        if self.collective != host.collective {
            return Err(format!(
                "collective mismatch: rank {r} was started with --collective {:.20}, rank 0 with --collective {}",
                self.collective, host.collective
            ));
        }
        Ok(())
    }
}

/// Control messages (JSON in `Kind::Control` frames).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Control {
    /// Joining rank → rank 0.
    Hello(Hello),
    /// Rank 0 → every rank: listen address of every rank (advertised, else observed), in rank order (entry 0
    /// is the master address), and the fingerprint of the certificate each rank presented at rendezvous (BLAKE3 of its DER), which
    /// its ring links are pinned to.
    Welcome {
        addrs: Vec<SocketAddr>,
        certs: Vec<[u8; 32]>,
        /// Every rank's host and shared-memory endpoint, as its hello gave them (rank 0's own first).
        locals: Vec<Option<LocalEndpoint>>,
        /// The two-level ring rank 0 resolved `--collective` to: each rank's host label, in rank order
        /// ([`crate::collective::two_level`]); `None`: the flat ring.
        two_level: Option<Vec<usize>>,
    },
    /// Any rank → a peer it turns away (a hello that does not match, a rank already taken, a certificate
    /// other than the pinned one), naming why.
    Refused { reason: String },
    /// Rank 0 → the ranks that have joined, while others are still missing: who is missing and any peer
    /// that failed authentication meanwhile, so every rank can say what it is waiting for long before the
    /// rendezvous times out.
    Waiting { note: String },
    /// Ring link opener → its right neighbour; `shm`: the link's data goes through the shared segment the
    /// opener has already attached, else through this QUIC stream.
    PeerHello { job_id: u64, rank: usize, shm: bool },
    /// A rank leaving cleanly after its last collective → rank 0.
    Bye,
    /// Rank 0 of an elastic job → a member that asked to join (with a hello of the job's first epoch): the
    /// running ranks take it in now, as rank `rank` of `world` in membership `epoch` (`members` in rank
    /// order); it joins that epoch's rendezvous at rank 0's address (protocol version 5).
    Admitted {
        epoch: u64,
        rank: usize,
        world: usize,
        members: Vec<u32>,
    },
    /// Rank 0 of an elastic re-form → the ranks that joined its rendezvous, when others did not join before
    /// its deadline: the ring of this membership will not form, and `missing` (ranks of it) are left out of
    /// the next attempt (protocol version 7).
    Unformed { missing: Vec<usize> },
    /// A running rank other than 0 of an elastic job → a member asking it to join: rank 0 of the running
    /// ring listens at `to` (protocol version 7).
    Redirect { to: SocketAddr },
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mismatches_name_the_field() {
        let host = Hello {
            version: 1,
            job_id: 7,
            rank: 0,
            world: 4,
            config_hash: 9,
            advertise: None,
            local: None,
            host: Some("m/net:[1]".into()),
            collective: "auto".into(),
        };
        let ok = Hello {
            rank: 2,
            ..host.clone()
        };
        assert!(ok.check_against(&host).is_ok());
        let e = Hello {
            job_id: 8,
            ..ok.clone()
        }
        .check_against(&host)
        .unwrap_err();
        assert!(e.contains("job id"), "{e}");
        let e = Hello { world: 3, ..ok.clone() }.check_against(&host).unwrap_err();
        assert!(e.contains("world size"), "{e}");
        let e = Hello {
            config_hash: 1,
            ..ok.clone()
        }
        .check_against(&host)
        .unwrap_err();
        assert!(e.contains("config hash"), "{e}");
        let e = Hello {
            version: 2,
            ..ok.clone()
        }
        .check_against(&host)
        .unwrap_err();
        assert!(e.contains("protocol version"), "{e}");
        let e = Hello { rank: 4, ..ok.clone() }.check_against(&host).unwrap_err();
        assert!(e.contains("rank 4"), "{e}");
        // Joins of a running elastic job (rank 0's hello of epoch 3, the first epoch's job 7): a first rank,
        // 0 included, or a new member's id past them, below the bound; whatever world size the member gives.
        let running = Hello {
            job_id: 99,
            world: 2,
            ..host.clone()
        };
        for (member, world) in [(0, 4), (3, 4), (4, 1), (1000, 9)] {
            let asking = Hello {
                rank: member,
                world,
                ..host.clone()
            };
            assert!(asking.check_join(&running, 7).is_ok(), "member {member}");
        }
        let too_large = Hello {
            rank: crate::elastic::MAX_MEMBER_ID as usize,
            ..host.clone()
        };
        assert!(too_large.check_join(&running, 7).unwrap_err().contains("is not below"));
        let other_config = Hello {
            rank: 5,
            config_hash: 10,
            ..host.clone()
        };
        assert!(other_config
            .check_join(&running, 7)
            .unwrap_err()
            .contains("config hash mismatch"));
        let e = Hello {
            collective: "flat".into(),
            ..ok.clone()
        }
        .check_against(&host)
        .unwrap_err();
        assert!(
            e.contains("--collective flat") && e.contains("--collective auto"),
            "{e}"
        );
        let e = Hello {
            host: Some("h".repeat(100_000)),
            ..ok.clone()
        }
        .check_against(&host)
        .unwrap_err();
        assert!(e.contains("host identity of 100000 bytes"), "{e}");
        let advertising = |a: &str| Hello {
            advertise: Some(a.parse().unwrap()),
            ..ok.clone()
        };
        assert!(advertising("10.0.0.7:4000").check_against(&host).is_ok());
        for bad in ["0.0.0.0:4000", "10.0.0.7:0"] {
            let e = advertising(bad).check_against(&host).unwrap_err();
            assert!(e.contains("advertises") && e.contains(bad), "{e}");
        }
        let endpoint = LocalEndpoint {
            host: "m/net:[1]".into(),
            pid: 10,
            uid: 0,
            socket: "ringtrain/x".into(),
            nonce: [0; 16],
        };
        let with_local = |l: LocalEndpoint| Hello {
            local: Some(l),
            ..ok.clone()
        };
        assert!(with_local(endpoint.clone()).check_against(&host).is_ok());
        let long_socket = LocalEndpoint {
            socket: "s".repeat(200),
            ..endpoint.clone()
        };
        let e = with_local(long_socket).check_against(&host).unwrap_err();
        assert!(e.contains("socket name"), "{e}");
        let e = with_local(LocalEndpoint {
            host: String::new(),
            ..endpoint
        })
        .check_against(&host)
        .unwrap_err();
        assert!(e.contains("host identity"), "{e}");
    }
}
