//! One ring collective in virtual time, every rank and every message.
//!
//! The model follows the engine of `ringtrain::collective::ring`: the buffer is cut into N chunks
//! (`chunk_range`), each chunk into sub-chunks of at most `sub_chunk` elements, and a collective runs
//! `P` phases (`N-1` for reduce-scatter and all-gather, `2(N-1)` for all-reduce). In phase `p` rank `r`
//! sends one chunk to `r+1`; sub-chunk `j` of it may leave once sub-chunk `j` of the previous phase has
//! arrived from `r-1` (it is the same chunk travelling on), so sub-chunks pipeline through the phases.
//!
//! Costs (see [`super::network::Link`]): a message occupies its sender for `size/β + size·γ` and arrives
//! `α` later. A rank's sends leave one at a time, phase by phase and sub-chunk by sub-chunk, as the
//! engine's `poll_transmit` hands them out and the QUIC transport carries them on its one data stream per
//! link; a rank is done when its own last send has left and its last receive has arrived. No other flow
//! shares the link: the ring sends one flow per hop and `CommThread` runs one collective at a time.
//!
//! With uniform links, equal chunks of `m` sub-chunks of `s` bytes, `t = s/β + s·γ` and equal start
//! times, this gives `T = max(P·m·t + α, (m-1)·t + P·(α + t))`: bandwidth-bound when `α ≤ (m-1)·t`
//! (the link never idles), latency-bound otherwise (each phase waits for the first sub-chunk to cross).
//! With `m = 1` both are `P·(α + t)`, i.e. `2(N-1)·α + 2(N-1)/N·S·(1/β + γ)` for an all-reduce of `S`
//! bytes. The tests check these forms; the simulation itself also covers uneven chunks, two-tier
//! fabrics and ranks that start at different times.
//!
//! Cost: `P · N · m` steps per collective; `m ≤ S/(N·sub_chunk) + 1`, so it is at most about
//! `2·N² + 2·S/sub_chunk`: 2 M steps for N = 1024.

use super::network::{Link, Network};
use ringtrain::collective::{chunk_range, CollectiveChoice, Wire};

/// Which collective.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RingKind {
    ReduceScatter,
    AllGather,
    AllReduce,
}

/// One collective over a buffer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RingShape {
    pub kind: RingKind,
    /// Elements in the whole buffer.
    pub elems: usize,
    /// Bytes per element (4 for f32 gradients).
    pub elem_bytes: usize,
    /// The format a reduce-scatter or all-reduce sends its values in (`--wire`); a gather sends
    /// `elem_bytes` per element.
    pub wire: Wire,
    /// Largest sub-chunk in elements (the transport's `sub_chunk`).
    pub sub_chunk: usize,
}

impl RingShape {
    /// How many phases the collective has; in each, every rank sends one chunk.
    pub fn phases(&self, world: usize) -> usize {
        match self.kind {
            RingKind::ReduceScatter | RingKind::AllGather => world - 1,
            RingKind::AllReduce => 2 * (world - 1),
        }
    }

    /// The chunk rank `rank` sends in phase `phase` (the engine's module doc): reduce-scatter phase `p`
    /// sends `r-1-p`, all-gather phase `q` sends `r-q`.
    fn chunk_sent(&self, world: usize, rank: usize, phase: usize) -> usize {
        let reduce_phases = match self.kind {
            RingKind::ReduceScatter | RingKind::AllReduce => world - 1,
            RingKind::AllGather => 0,
        };
        let back = if phase < reduce_phases {
            1 + phase
        } else {
            phase - reduce_phases
        };
        (rank + world * 2 - back % world) % world
    }

    /// Bytes of sub-chunk `sub` of chunk `chunk`.
    fn sub_bytes(&self, world: usize, chunk: usize, sub: usize) -> f64 {
        let len = chunk_range(self.elems, world, chunk).len();
        let sub_len = (len - sub * self.sub_chunk).min(self.sub_chunk);
        self.bytes_of(sub_len)
    }

    /// Bytes that `n` elements take in one message (an int8 sub-chunk carries its blocks' scales).
    pub fn bytes_of(&self, n: usize) -> f64 {
        match self.kind {
            RingKind::ReduceScatter | RingKind::AllReduce if self.wire.is_compact() => self.wire.encoded_len(n) as f64,
            _ => (n * self.elem_bytes) as f64,
        }
    }

    fn subs(&self, world: usize, chunk: usize) -> usize {
        chunk_range(self.elems, world, chunk)
            .len()
            .div_ceil(self.sub_chunk.max(1))
    }
}

/// One message of a rank in the model's schedule.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ModelSend {
    pub phase: usize,
    pub chunk: usize,
    pub sub: usize,
    pub bytes: usize,
}

impl RingShape {
    /// Rank `rank`'s messages in the order its link carries them, phase by phase and sub-chunk by
    /// sub-chunk: the schedule [`simulate`] times. `sim/tests/netmodel.rs` checks it against the messages
    /// the real engine (`ringtrain::collective::ring::RingEngine`) hands out.
    pub fn sends(&self, world: usize, rank: usize) -> Vec<ModelSend> {
        if world <= 1 || self.elems == 0 {
            return Vec::new();
        }
        let mut out = Vec::new();
        for phase in 0..self.phases(world) {
            let chunk = self.chunk_sent(world, rank, phase);
            for sub in 0..self.subs(world, chunk) {
                out.push(ModelSend {
                    phase,
                    chunk,
                    sub,
                    bytes: self.sub_bytes(world, chunk, sub) as usize,
                });
            }
        }
        out
    }
}

/// Runs `shape` over the ring of `start.len()` ranks, rank `r`'s communication thread beginning it at
/// `start[r]` seconds; returns when each rank is done with it.
pub fn simulate(net: &Network, shape: &RingShape, start: &[f64]) -> Vec<f64> {
    let world = start.len();
    if world <= 1 || shape.elems == 0 {
        return start.to_vec();
    }
    let hops: Vec<Link> = (0..world).map(|r| net.hop(r, world)).collect();
    let max_subs = chunk_range(shape.elems, world, 0)
        .len()
        .div_ceil(shape.sub_chunk.max(1));
    // [world, max_subs]: when each rank's send of each sub-chunk in the previous / this phase left.
    let mut sent_prev = vec![0.0f64; world * max_subs];
    let mut sent_now = vec![0.0f64; world * max_subs];
    let mut link_free = start.to_vec();
    let phases = shape.phases(world);
    for phase in 0..phases {
        for rank in 0..world {
            let left = (rank + world - 1) % world;
            let chunk = shape.chunk_sent(world, rank, phase);
            for sub in 0..shape.subs(world, chunk) {
                let ready = if phase == 0 {
                    start[rank]
                } else {
                    sent_prev[left * max_subs + sub] + hops[left].latency_s
                };
                let leaves = ready.max(link_free[rank]) + hops[rank].occupancy_s(shape.sub_bytes(world, chunk, sub));
                link_free[rank] = leaves;
                sent_now[rank * max_subs + sub] = leaves;
            }
        }
        std::mem::swap(&mut sent_prev, &mut sent_now);
    }
    // The last phase's sends: rank r receives what r-1 sent.
    (0..world)
        .map(|rank| {
            let left = (rank + world - 1) % world;
            let chunk = shape.chunk_sent(world, left, phases - 1);
            let last_arrival = (0..shape.subs(world, chunk))
                .map(|sub| sent_prev[left * max_subs + sub] + hops[left].latency_s)
                .fold(start[rank], f64::max);
            last_arrival.max(link_free[rank])
        })
        .collect()
}

/// How a job's collectives are arranged: one ring through every rank, or the trainer's two-level ring over
/// hosts of `per_host` consecutive ranks (`ringtrain::collective::two_level`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Layout {
    Flat,
    TwoLevel { per_host: usize },
}

impl Layout {
    /// What the trainer's rank 0 would resolve `choice` to for `world` ranks on `net`: the two-level ring
    /// needs a two-tier fabric with at least 2 ranks per host and at least 2 whole hosts.
    pub fn resolve(choice: CollectiveChoice, net: &Network, world: usize) -> Result<Layout, String> {
        let fits = match net.intra {
            Some((per_host, _)) if per_host < 2 => Err(format!("hosts of {per_host} rank")),
            Some((per_host, _)) if !world.is_multiple_of(per_host) => {
                Err(format!("{world} ranks do not fill hosts of {per_host}"))
            }
            Some((per_host, _)) if world / per_host < 2 => Err(format!("all {world} ranks share one host")),
            Some((per_host, _)) => Ok(Layout::TwoLevel { per_host }),
            None => Err("the network has one tier (no hosts-of)".to_string()),
        };
        match (choice, fits) {
            (CollectiveChoice::Flat, _) | (CollectiveChoice::Auto, Err(_)) => Ok(Layout::Flat),
            (_, Ok(layout)) => Ok(layout),
            (CollectiveChoice::Hierarchical, Err(why)) => Err(format!(
                "--collective hierarchical needs several hosts of equal size: {why}"
            )),
        }
    }

    /// CPU seconds the mean rank of the first machine spends sending its part of `shape` on `world` ranks
    /// (even chunks), each hop at [`Network::rank_cpu_per_byte`]'s price: on the flat ring over a two-tier
    /// fabric a host's ranks differ (those at its edge send between hosts), and the machine's cores pay
    /// for all of them; on two levels the host rings' bytes at the intra-host link's price and the cross
    /// ring's at the inter-host link's.
    pub fn send_cpu_s(&self, shape: &RingShape, world: usize, net: &Network) -> f64 {
        let bytes = shape.bytes_of(shape.elems);
        let ring = |n: usize, bytes: f64| shape.phases(n) as f64 * bytes / n as f64;
        match *self {
            Layout::Flat => {
                let per_machine = net.ranks_per_machine(world).max(1);
                let price: f64 = (0..per_machine).map(|r| net.rank_cpu_per_byte(r, world)).sum();
                ring(world, bytes) * price / per_machine as f64
            }
            Layout::TwoLevel { per_host } => {
                let hosts = world / per_host;
                let intra = net.intra.map_or(net.inter, |(_, link)| link);
                let (intra_price, inter_price) = (
                    net.link_cpu_per_byte(intra, true),
                    net.link_cpu_per_byte(net.inter, false),
                );
                // An all-reduce's host reduce-scatter and all-gather together send what a host all-reduce does;
                // only the cross ring sends in a compact wire format.
                let host_bytes = (shape.elems * shape.elem_bytes) as f64;
                ring(per_host, host_bytes) * intra_price + ring(hosts, bytes / per_host as f64) * inter_price
            }
        }
    }
}

/// Runs `shape` over `start.len()` ranks arranged as `layout`; returns when each rank is done with it.
pub fn simulate_layout(net: &Network, layout: Layout, shape: &RingShape, start: &[f64]) -> Vec<f64> {
    match layout {
        Layout::Flat => simulate(net, shape, start),
        Layout::TwoLevel { per_host } => simulate_two_level(net, per_host, shape, start),
    }
}

/// The two-level schedule: a ring per host over the intra-host link, then a ring per local index over the
/// inter-host link for its host chunk, then the host rings again. The `per_host` cross rings of a host run
/// at once and share its network link, so each gets `1 / per_host` of its bandwidth; latency and the CPU
/// per byte are each rank's own.
fn simulate_two_level(net: &Network, per_host: usize, shape: &RingShape, start: &[f64]) -> Vec<f64> {
    let world = start.len();
    let hosts = world / per_host;
    let intra = net.intra.map_or(net.inter, |(_, link)| link);
    let host_net = Network::uniform("host ring", intra);
    let cross_net = Network::uniform(
        "cross ring",
        Link {
            bandwidth_bytes_per_s: net.inter.bandwidth_bytes_per_s / per_host as f64,
            ..net.inter
        },
    );
    let mut t = start.to_vec();
    // One level: the rings of `members(g)` for every group g, each over `elems(g)` elements; only the cross
    // rings send in a compact wire format, as `collective::two_level` does.
    let mut level = |net: &Network,
                     wire: Wire,
                     kind: RingKind,
                     groups: usize,
                     members: &dyn Fn(usize) -> Vec<usize>,
                     elems: &dyn Fn(usize) -> usize| {
        for g in 0..groups {
            let ranks = members(g);
            let begin: Vec<f64> = ranks.iter().map(|&r| t[r]).collect();
            let sub = RingShape {
                kind,
                elems: elems(g),
                wire,
                ..*shape
            };
            for (r, done) in ranks.iter().zip(simulate(net, &sub, &begin)) {
                t[*r] = done;
            }
        }
    };
    let host = |h: usize| (h * per_host..(h + 1) * per_host).collect::<Vec<_>>();
    let cross = |l: usize| (0..hosts).map(|h| h * per_host + l).collect::<Vec<_>>();
    let whole = |_: usize| shape.elems;
    let part = |l: usize| chunk_range(shape.elems, per_host, l).len();
    match shape.kind {
        RingKind::AllReduce => {
            level(&host_net, Wire::F32, RingKind::ReduceScatter, hosts, &host, &whole);
            level(&cross_net, shape.wire, RingKind::AllReduce, per_host, &cross, &part);
            level(&host_net, Wire::F32, RingKind::AllGather, hosts, &host, &whole);
        }
        RingKind::ReduceScatter => {
            level(&host_net, Wire::F32, RingKind::ReduceScatter, hosts, &host, &whole);
            level(&cross_net, shape.wire, RingKind::ReduceScatter, per_host, &cross, &part);
        }
        RingKind::AllGather => {
            level(&cross_net, shape.wire, RingKind::AllGather, per_host, &cross, &part);
            level(&host_net, Wire::F32, RingKind::AllGather, hosts, &host, &whole);
        }
    }
    t
}

#[cfg(test)]
mod tests {
    use super::*;

    fn link(latency_s: f64, bandwidth: f64) -> Network {
        Network::uniform(
            "test",
            Link {
                latency_s,
                bandwidth_bytes_per_s: bandwidth,
                cpu_s_per_byte: 0.0,
            },
        )
    }

    #[test]
    fn chunks_follow_the_engine_order() {
        let shape = RingShape {
            kind: RingKind::AllReduce,
            elems: 12,
            elem_bytes: 4,
            wire: Wire::F32,
            sub_chunk: 1,
        };
        // Reduce-scatter ends with rank r holding chunk r: its last reduce phase received chunk r.
        for r in 0..4 {
            assert_eq!(shape.chunk_sent(4, (r + 3) % 4, 2), r);
            // The first all-gather phase sends the own chunk.
            assert_eq!(shape.chunk_sent(4, r, 3), r);
        }
    }

    #[test]
    fn a_late_rank_delays_everyone() {
        let net = link(1e-3, 1e9);
        let shape = RingShape {
            kind: RingKind::AllReduce,
            elems: 1 << 20,
            elem_bytes: 4,
            wire: Wire::F32,
            sub_chunk: 1 << 16,
        };
        let on_time = simulate(&net, &shape, &[0.0; 4]);
        let late = simulate(&net, &shape, &[0.0, 0.0, 0.5, 0.0]);
        for r in 0..4 {
            assert!(late[r] > on_time[r] + 0.4, "rank {r}: {} vs {}", late[r], on_time[r]);
        }
    }
}
