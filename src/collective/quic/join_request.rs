//! A member asking to join a running elastic job: it dials the job's master address (then the other places
//! it was given, following a running rank's pointer to rank 0), says hello as in the job's first epoch (its
//! first rank, the first world size), and waits on that connection until the running ranks admit it at a
//! step boundary ([`Control::Admitted`]) or rank 0 refuses it.

use std::time::Duration;

use tokio::time::Instant;

use super::auth::{self, dial};
use super::endpoint;
use super::framing::{control_frame, read_control};
use super::messages::{Control, Hello};
use super::rendezvous::{hello, RENDEZVOUS_CLOSED, RE_FORMING};
use super::{local, validate, QuicConfig};
use crate::collective::rank_runtime::RankRuntime;
use crate::collective::{ComputeBusy, Result};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, UdpSocket};

/// How long a member waits before asking again.
const RETRY: Duration = Duration::from_millis(200);
/// How long a member waits for one of several places to answer before it tries the next (a running rank
/// answers a handshake within round trips; a dead address never does).
const PLACE_PATIENCE: Duration = Duration::from_millis(1500);

/// Where the running job takes the member in: the membership epoch, its rank and the members in rank order.
pub type Admission = (u64, usize, Vec<u32>);

/// Asks the running job to take in member `cfg.rank` of its first epoch (`cfg.job_id`, `cfg.world`), looking
/// for it at `cfg.master`, then at each of `elsewhere` in turn (round and round): rank 0 parks the request
/// until the running ranks admit it at a step boundary, another running rank points to rank 0
/// ([`Control::Redirect`]), and an address where nobody answers is passed over. Gives up after twice
/// `cfg.timeout` (the running ranks may first have to notice a loss and re-form). Returns the admission and
/// the address of the rank 0 that admitted it, where the new epoch's rendezvous opens.
pub fn ask_to_join(mut cfg: QuicConfig, member: u32, elsewhere: &[SocketAddr]) -> Result<(Admission, SocketAddr)> {
    validate(&mut cfg)?;
    // An ephemeral port on loopback for a loopback master, else any address of the master's family: this
    // connection only asks (the member's own endpoint comes with the new epoch's rendezvous).
    let ip = match cfg.master.ip() {
        ip if ip.is_loopback() => ip,
        IpAddr::V4(_) => IpAddr::V4(Ipv4Addr::UNSPECIFIED),
        IpAddr::V6(_) => IpAddr::V6(Ipv6Addr::UNSPECIFIED),
    };
    let socket = UdpSocket::bind(SocketAddr::new(ip, 0)).map_err(|e| local(format!("binding to ask to join: {e}")))?;
    let rt = RankRuntime::new(format!("ringtrain-join-{}", cfg.rank))
        .map_err(|e| local(format!("cannot start the async runtime: {e}")))?;
    let mut places: Vec<SocketAddr> = vec![cfg.master];
    places.extend(elsewhere.iter().filter(|a| **a != cfg.master));
    rt.block_on(async {
        let (ep, _) = endpoint::start(socket, cfg.idle_timeout, &ComputeBusy::default()).map_err(local)?;
        let key = auth::auth_key(cfg.secret.as_deref());
        let deadline = Instant::now() + 2 * cfg.timeout;
        let mut next_place = 0;
        let mut at = places[0];
        let mut tried = Vec::new();
        let (conn, answer) = loop {
            // With other places to try, an address that does not answer at once is passed over for now.
            let patience = match places.len() {
                1 => deadline,
                _ => deadline.min(Instant::now() + PLACE_PATIENCE),
            };
            let dialled = tokio::time::timeout_at(patience, dial(&ep, at, &key))
                .await
                .unwrap_or_else(|_| Err("no answer".to_string()));
            let (conn, mut send, mut recv) = match dialled {
                Ok(c) => c,
                Err(e) if Instant::now() + RETRY < deadline && !e.contains("authenticat") => {
                    tracing::debug!("member {}: nobody answered at {at}: {e}", cfg.rank);
                    tried.push(format!("{at}: {e}"));
                    next_place = (next_place + 1) % places.len();
                    at = places[next_place];
                    tokio::time::sleep(RETRY).await;
                    continue;
                }
                Err(e) => {
                    tried.push(format!("{at}: {e}"));
                    return Err(local(format!(
                        "asking the running job to take in member {}: {}",
                        cfg.rank,
                        last_tries(&tried)
                    )));
                }
            };
            // The hello names the member, which for a new one is past the first world's ranks.
            let asking = Hello {
                rank: member as usize,
                ..hello(&cfg, None)
            };
            send.write_all(&control_frame(cfg.job_id, &Control::Hello(asking)))
                .await
                .map_err(|e| local(format!("asking to join: {e}")))?;
            let answer = loop {
                let reply = tokio::time::timeout_at(deadline, read_control(&mut recv, None))
                    .await
                    .map_err(|_| local(format!("rank 0 at {at} did not admit this member in time")))?;
                let reply = match reply {
                    Ok(reply) => reply,
                    // Rank 0's ring closing under this request (a re-form): ask the next one.
                    Err(e) if e.contains("closed") => break Answer::AskAgain,
                    Err(e) => return Err(local(format!("asking rank 0 at {at} to join: {e}"))),
                };
                match reply {
                    Control::Waiting { note } => tracing::warn!("member {}: {note}", cfg.rank),
                    Control::Admitted {
                        epoch,
                        rank,
                        world,
                        members,
                    } if members.len() == world && rank < world => break Answer::Admitted((epoch, rank, members)),
                    Control::Redirect { to } => break Answer::Redirect(to),
                    Control::Refused { reason } if reason == RE_FORMING || reason.starts_with(RENDEZVOUS_CLOSED) => {
                        break Answer::AskAgain
                    }
                    Control::Refused { reason } => break Answer::Refused(reason),
                    other => break Answer::Refused(format!("unexpected reply {other:?}")),
                }
            };
            match answer {
                // Rank 0 was re-forming: ask again once it runs.
                Answer::AskAgain if Instant::now() + RETRY < deadline => {
                    conn.close(0u32.into(), b"again");
                    tokio::time::sleep(RETRY).await;
                }
                Answer::Redirect(to) if Instant::now() + RETRY < deadline => {
                    tracing::warn!("member {}: {at} says rank 0 of the running job is at {to}", cfg.rank);
                    conn.close(0u32.into(), b"again");
                    at = to;
                }
                Answer::AskAgain | Answer::Redirect(_) => {
                    break (
                        conn,
                        Err(local(format!("rank 0 at {at} did not admit this member in time"))),
                    )
                }
                Answer::Refused(reason) => {
                    break (conn, Err(local(format!("rank 0 at {at} refused the join: {reason}"))))
                }
                Answer::Admitted(admission) => break (conn, Ok((admission, at))),
            }
        };
        // Closed at once and the close sent (briefly waited for), so that rank 0, which holds the other end
        // until this member has read its answer, can go on.
        conn.close(0u32.into(), b"bye");
        let _ = tokio::time::timeout(Duration::from_millis(300), ep.wait_idle()).await;
        answer
    })
}

/// What a running rank answered a member asking to join.
enum Answer {
    Admitted(Admission),
    /// Rank 0 of the running ring is elsewhere.
    Redirect(SocketAddr),
    /// Rank 0 is re-forming its ring.
    AskAgain,
    Refused(String),
}

/// The last few places that did not answer, for the error.
fn last_tries(tried: &[String]) -> String {
    let from = tried.len().saturating_sub(4);
    format!("nobody answered: {}", tried[from..].join("; "))
}
