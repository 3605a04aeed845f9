//! Ring links between ranks of one host through shared memory (Linux).
//!
//! The QUIC transport stays the control plane (rendezvous, verdicts, aborts) and every rank still opens its
//! QUIC ring links; a link whose two ranks share a host also gets a shared segment, and its data then goes
//! through the segment instead of through the encrypted QUIC stream. The frames are the same bytes, so the
//! choice never changes what the engine computes.
//!
//! - [`segment`]: the sealed memfd and its single-producer, single-consumer byte ring.
//! - [`handoff`]: the memfd and eventfds handed over an abstract Unix socket, with both processes checked.
//! - [`link`]: the two ends as async byte streams, sleeping on eventfds and watching the socket for the
//!   peer's death.
//! - [`host_identity`]: what says that two ranks share a host.
//!
//! What this promises, beside QUIC's: the segment and the socket are reachable only by processes of the same
//! user in the same network namespace that the rendezvous named (pid and uid checked both ways with
//! `SO_PEERCRED`, and a nonce shown only over authenticated connections). A process of the same user can
//! still read or write the segment through `/proc/<pid>/fd` or ptrace either rank, as it could read the
//! rank's memory, keys included, on the QUIC path; the bytes are not encrypted in the segment.

#[cfg(target_os = "linux")]
pub mod handoff;
#[cfg(target_os = "linux")]
pub mod link;
#[cfg(target_os = "linux")]
pub mod segment;

/// Bounds on a link ring's capacity in bytes, which the consumer checks before mapping a peer's segment.
pub const MIN_CAPACITY: usize = 64 << 10;
pub const MAX_CAPACITY: usize = 256 << 20;
/// A link's ring by default: 16 sub-chunks of 64 Ki f32 in flight.
pub const DEFAULT_CAPACITY: usize = 16 << 20;

/// Longest host identity accepted from a peer or from `RINGTRAIN_HOST_ID`.
pub const MAX_HOST_ID: usize = 256;

/// Which transport a rank's ring links to ranks of its own host use.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default, clap::ValueEnum, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum LinkTransport {
    /// Shared memory where both ranks share a host and it attaches; QUIC otherwise, with a line saying why.
    #[default]
    Auto,
    /// Shared memory on every link between ranks of one host; a link that cannot attach fails the start.
    Shm,
    /// QUIC on every link.
    Quic,
}

impl std::fmt::Display for LinkTransport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            LinkTransport::Auto => "auto",
            LinkTransport::Shm => "shm",
            LinkTransport::Quic => "quic",
        })
    }
}

/// This process's host identity: `RINGTRAIN_HOST_ID` when the user gives one (`given`), else the machine
/// identity together with the network namespace. Emulated hosts in network namespaces share the machine
/// id and `/dev/shm`, and must still count as separate hosts; two ranks in one namespace of one machine
/// share a host.
pub fn host_identity(given: Option<&str>) -> Result<String, String> {
    if let Some(id) = given {
        check_host_id(id).map_err(|e| format!("RINGTRAIN_HOST_ID: {e}"))?;
        return Ok(format!("given:{id}"));
    }
    let machine = [
        "/etc/machine-id",
        "/var/lib/dbus/machine-id",
        "/proc/sys/kernel/random/boot_id",
    ]
    .iter()
    .find_map(|p| {
        std::fs::read_to_string(p)
            .ok()
            .map(|s| s.trim().to_string())
            .filter(|s| !s.is_empty())
    })
    .ok_or("no machine id (/etc/machine-id) or boot id to tell hosts apart; set RINGTRAIN_HOST_ID")?;
    let netns = std::fs::read_link("/proc/self/ns/net")
        .map_err(|e| format!("reading /proc/self/ns/net: {e}; set RINGTRAIN_HOST_ID"))?;
    let id = format!("{machine}/{}", netns.display());
    check_host_id(&id)?;
    Ok(id)
}

/// A host identity is printable ASCII, 1 to [`MAX_HOST_ID`] bytes.
pub fn check_host_id(id: &str) -> Result<(), String> {
    if id.is_empty() || id.len() > MAX_HOST_ID || !id.bytes().all(|b| b.is_ascii_graphic()) {
        return Err(format!(
            "host identity {id:?} must be 1 to {MAX_HOST_ID} printable ASCII characters without spaces"
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_host_identity_names_the_network_namespace_or_what_the_user_gave() {
        let id = host_identity(None).unwrap();
        let ns = std::fs::read_link("/proc/self/ns/net").unwrap();
        assert!(id.ends_with(&ns.display().to_string()), "{id}");
        assert_eq!(host_identity(Some("node-7")).unwrap(), "given:node-7");
        for bad in ["", "two words", &"x".repeat(MAX_HOST_ID + 1)] {
            assert!(host_identity(Some(bad)).unwrap_err().contains("RINGTRAIN_HOST_ID"));
        }
    }
}
