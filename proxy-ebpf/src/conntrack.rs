//! Conntrack: keys, idle timeouts, TCP state and the ORIGINAL/REPLY entry pair.
//!
//! Every translated flow has two entries in `CONNTRACK_V1` with the same value:
//! ORIGINAL, keyed as the client's packets arrive (client → frontend), and REPLY, keyed as the
//! backend's replies leave (backend → client). Ingress looks up ORIGINAL, egress REPLY.

/// Has a flow been idle past its timeout? One rule in proxy-common, shared with the agent's
/// conntrack and SNAT garbage collection.
pub use proxy_common::timeouts::idle_expired;
use proxy_common::{
    Backend, CtKey, CtValue, DatapathConfig, ct_dir, ct_flags, ct_state,
    flow_state::{self, Segment},
};

use crate::{
    Drop,
    maps::{self, CtEntry},
    packet::{Packet, tcp_flags},
};

/// The ORIGINAL key of the packet as it arrived.
#[inline(always)]
pub fn original_key(p: &Packet) -> CtKey {
    CtKey {
        saddr: p.saddr,
        daddr: p.daddr,
        sport: p.sport,
        dport: p.dport,
        proto: p.proto,
        dir: ct_dir::ORIGINAL,
        _pad: [0; 2],
    }
}

/// The REPLY key of the packet as it leaves (egress).
#[inline(always)]
pub fn reply_key(p: &Packet) -> CtKey {
    CtKey {
        dir: ct_dir::REPLY,
        ..original_key(p)
    }
}

/// The REPLY key of a flow from its client and backend.
#[inline(always)]
fn reply_key_of(client: &CtKey, backend_addr: [u8; 4], backend_port: [u8; 2]) -> CtKey {
    CtKey {
        saddr: backend_addr,
        daddr: client.saddr,
        sport: backend_port,
        dport: client.sport,
        proto: client.proto,
        dir: ct_dir::REPLY,
        _pad: [0; 2],
    }
}

/// The ORIGINAL key of the flow a reply belongs to: client = the reply's destination, frontend
/// from the entry.
#[inline(always)]
pub fn original_key_of_reply(p: &Packet, ct: &CtValue) -> CtKey {
    CtKey {
        saddr: p.daddr,
        daddr: ct.frontend_addr,
        sport: p.dport,
        dport: ct.frontend_port,
        proto: p.proto,
        dir: ct_dir::ORIGINAL,
        _pad: [0; 2],
    }
}

/// Has the entry been idle for longer than its timeout?
#[inline(always)]
pub fn expired(ct: &CtValue, proto: u8, now_ns: u64, cfg: &DatapathConfig) -> bool {
    idle_expired(ct.last_seen_ns, proto, ct.state, ct.flags, now_ns, cfg)
}

/// The TCP flags of a packet that move its flow's state (`None` for UDP).
#[inline(always)]
fn segment(p: &Packet) -> Option<Segment> {
    p.is_tcp().then_some(Segment {
        syn: p.tcp_flags & tcp_flags::SYN != 0,
        fin: p.tcp_flags & tcp_flags::FIN != 0,
        rst: p.tcp_flags & tcp_flags::RST != 0,
    })
}

/// State of a flow after a client packet (ORIGINAL direction).
#[inline(always)]
pub fn next_state(p: &Packet, state: u8) -> u8 {
    flow_state::after_client(state, segment(p))
}

/// State of a flow after a backend packet (REPLY direction): only FIN/RST change it.
#[inline(always)]
pub fn next_reply_state(p: &Packet, state: u8) -> u8 {
    flow_state::after_backend(state, segment(p))
}

/// A client packet of a tracked flow passes (ingress): its ORIGINAL entry (`entry`, keyed
/// `original`) is refreshed and moved by the packet. When the packet closes the flow (a RST, or
/// the client's FIN after the backend's) the REPLY entry is closed too, since the backend may
/// never send again to carry the state over (one more lookup, on that packet only).
#[inline(always)]
pub fn client_passed(p: &Packet, original: &CtKey, entry: &CtEntry, ct: &CtValue, now: u64) {
    let state = next_state(p, ct.state);
    entry.touch(now, state);
    if state == ct_state::CLOSING
        && ct.state != ct_state::CLOSING
        && let Some(reply) =
            maps::ct_entry(&reply_key_of(original, ct.backend_addr, ct.backend_port))
    {
        reply.touch(now, ct_state::CLOSING);
    }
}

/// A backend packet of a tracked flow passes (egress): both entries are refreshed with the
/// flow's new state (the ORIGINAL entry's, which also saw the client's FIN, moved by this
/// packet) and marked `SEEN_REPLY` (a UDP flow is a stream from now on). `original` is the
/// flow's ORIGINAL entry if it is still there.
#[inline(always)]
pub fn reply_passed(
    p: &Packet,
    reply: &CtEntry,
    reply_ct: &CtValue,
    original: Option<CtEntry>,
    now: u64,
) {
    let base = match &original {
        Some(o) => o.get().state,
        None => reply_ct.state,
    };
    let state = next_reply_state(p, base);
    reply.touch_flags(now, state, ct_flags::SEEN_REPLY);
    if let Some(o) = original {
        o.touch_flags(now, state, ct_flags::SEEN_REPLY);
    }
}

/// Does the backend the entry names still exist with the address it was created with?
#[inline(always)]
pub fn backend_valid(ct: &CtValue) -> bool {
    match maps::backend(ct.backend_id) {
        Some(b) => b.addr == ct.backend_addr && b.port == ct.backend_port,
        None => false,
    }
}

/// A new flow's translation.
pub struct NewFlow<'a> {
    pub original: &'a CtKey,
    pub backend_id: u32,
    pub backend: &'a Backend,
    pub rev_nat_id: u32,
    pub now_ns: u64,
}

/// Write both entries of a new flow (overwriting an expired or stale pair), and drop the REPLY
/// entry of the replaced flow if it pointed elsewhere.
#[inline(always)]
pub fn create(p: &Packet, flow: &NewFlow<'_>, replaced: Option<&CtValue>) -> Result<(), Drop> {
    let value = CtValue {
        last_seen_ns: flow.now_ns,
        created_ns: flow.now_ns,
        backend_id: flow.backend_id,
        rev_nat_id: flow.rev_nat_id,
        frontend_addr: p.daddr,
        backend_addr: flow.backend.addr,
        frontend_port: p.dport,
        backend_port: flow.backend.port,
        state: next_state(p, ct_state::UDP),
        flags: 0,
        nat_sport: [0; 2],
    };
    if let Some(old) = replaced
        && (old.backend_addr != flow.backend.addr || old.backend_port != flow.backend.port)
    {
        maps::ct_remove(&reply_key_of(
            flow.original,
            old.backend_addr,
            old.backend_port,
        ));
    }
    let reply = reply_key_of(flow.original, flow.backend.addr, flow.backend.port);
    maps::ct_insert(flow.original, &value).map_err(|_| Drop::ConntrackFull)?;
    if maps::ct_insert(&reply, &value).is_err() {
        maps::ct_remove(flow.original);
        return Err(Drop::ConntrackFull);
    }
    Ok(())
}

/// Forget a flow (both entries).
#[inline(always)]
pub fn remove(original: &CtKey, ct: &CtValue) {
    maps::ct_remove(original);
    maps::ct_remove(&reply_key_of(original, ct.backend_addr, ct.backend_port));
}
