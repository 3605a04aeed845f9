//! A member asking to join a running elastic job: it dials rank 0 at the job's master address, says hello
//! as in the job's first epoch (its first rank, the first world size), and waits on that connection until
//! the running ranks admit it at a step boundary ([`Control::Admitted`]) or rank 0 refuses it.

use std::time::Duration;

use tokio::time::Instant;

use super::auth::{self, dial};
use super::endpoint;
use super::framing::{control_frame, read_control};
use super::messages::Control;
use super::rendezvous::{hello, RENDEZVOUS_CLOSED, RE_FORMING};
use super::{local, validate, QuicConfig};
use crate::collective::rank_runtime::RankRuntime;
use crate::collective::{ComputeBusy, Result};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, UdpSocket};

/// How long a member waits before asking again.
const RETRY: Duration = Duration::from_millis(200);

/// Where the running job takes the member in: the membership epoch, its rank and the members in rank order.
pub type Admission = (u64, usize, Vec<u32>);

/// Asks rank 0 at `cfg.master` to take in member `cfg.rank` of the job's first epoch (`cfg.job_id`,
/// `cfg.world`), waiting up to `cfg.timeout` for the admission.
pub fn ask_to_join(mut cfg: QuicConfig) -> Result<Admission> {
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
    rt.block_on(async {
        let (ep, _) = endpoint::start(socket, cfg.idle_timeout, &ComputeBusy::default()).map_err(local)?;
        let key = auth::auth_key(cfg.secret.as_deref());
        let deadline = Instant::now() + cfg.timeout;
        let (conn, answer) = loop {
            let (conn, mut send, mut recv) = match dial(&ep, cfg.master, &key).await {
                Ok(c) => c,
                Err(e) if Instant::now() + RETRY < deadline && !e.contains("authenticat") => {
                    tokio::time::sleep(RETRY).await;
                    continue;
                }
                Err(e) => return Err(local(format!("asking rank 0 at {} to join: {e}", cfg.master))),
            };
            send.write_all(&control_frame(cfg.job_id, &Control::Hello(hello(&cfg, None))))
                .await
                .map_err(|e| local(format!("asking to join: {e}")))?;
            let answer = loop {
                let reply = tokio::time::timeout_at(deadline, read_control(&mut recv, None))
                    .await
                    .map_err(|_| local(format!("rank 0 at {} did not admit this member in time", cfg.master)))?;
                let reply = match reply {
                    Ok(reply) => reply,
                    // Rank 0's ring closing under this request (a re-form): ask the next one.
                    Err(e) if e.contains("closed") => break Err(RE_FORMING.to_string()),
                    Err(e) => return Err(local(format!("asking rank 0 at {} to join: {e}", cfg.master))),
                };
                match reply {
                    Control::Waiting { note } => tracing::warn!("member {}: {note}", cfg.rank),
                    Control::Admitted {
                        epoch,
                        rank,
                        world,
                        members,
                    } if members.len() == world && rank < world => break Ok((epoch, rank, members)),
                    Control::Refused { reason } => break Err(reason),
                    other => break Err(format!("unexpected reply {other:?}")),
                }
            };
            match answer {
                // Rank 0 was re-forming: ask again once it runs.
                Err(reason)
                    if (reason == RE_FORMING || reason.starts_with(RENDEZVOUS_CLOSED))
                        && Instant::now() + RETRY < deadline =>
                {
                    conn.close(0u32.into(), b"again");
                    tokio::time::sleep(RETRY).await;
                }
                Err(reason) => break (conn, Err(local(format!("rank 0 refused the join: {reason}")))),
                Ok(admission) => break (conn, Ok(admission)),
            }
        };
        // Closed at once and the close sent (briefly waited for), so that rank 0, which holds the other end
        // until this member has read its answer, can go on.
        conn.close(0u32.into(), b"bye");
        let _ = tokio::time::timeout(Duration::from_millis(300), ep.wait_idle()).await;
        answer
    })
}
