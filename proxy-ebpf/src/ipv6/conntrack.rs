//! IPv6 conntrack (`CONNTRACK6_V1`): the ORIGINAL/REPLY entry pair of each translated flow, as
//! for IPv4 (`crate::conntrack`), with the same state machine and idle timeouts (shared, pure, in
//! proxy-common). Each direction refreshes (and, if LRU evicted it, writes again) the other.
//!
//! Not carried yet on IPv6: reply-tuple clash resolution by source port (a new flow whose REPLY
//! key a live flow of another frontend holds is dropped, `drop_reply_tuple_exhausted`),
//! tracking of flows straight to pods, and the least-connection flow counts.

use proxy_common::{
    Counter, ct_dir, ct_flags, ct_state,
    flow_state::{self, Segment},
    ipv6::{Backend6, Ct6Key, Ct6Value},
    timeouts::idle_expired,
};

use super::packet::Packet6;
use crate::{
    Drop,
    maps::{self, Ct6Entry},
    packet::tcp_flags,
    stats,
};

/// The ORIGINAL key of the packet as it arrived (ingress).
#[inline(always)]
pub fn original_key(p: &Packet6) -> Ct6Key {
    Ct6Key {
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
pub fn reply_key(p: &Packet6) -> Ct6Key {
    Ct6Key {
        dir: ct_dir::REPLY,
        ..original_key(p)
    }
}

/// The REPLY key of the flow whose ORIGINAL key and value these are.
#[inline(always)]
pub fn reply_key_of(original: &Ct6Key, ct: &Ct6Value) -> Ct6Key {
    Ct6Key {
        saddr: ct.backend_addr,
        daddr: original.saddr,
        sport: ct.backend_port,
        dport: original.sport,
        proto: original.proto,
        dir: ct_dir::REPLY,
        _pad: [0; 2],
    }
}

/// The ORIGINAL key of the flow whose REPLY key and value these are.
#[inline(always)]
pub fn original_key_of(reply: &Ct6Key, ct: &Ct6Value) -> Ct6Key {
    Ct6Key {
        saddr: reply.daddr,
        daddr: ct.frontend_addr,
        sport: reply.dport,
        dport: ct.frontend_port,
        proto: reply.proto,
        dir: ct_dir::ORIGINAL,
        _pad: [0; 2],
    }
}

#[inline(always)]
pub fn expired(ct: &Ct6Value, proto: u8, now_ns: u64) -> bool {
    idle_expired(
        ct.last_seen_ns,
        proto,
        ct.state,
        ct.flags,
        now_ns,
        maps::config_ref(),
    )
}

#[inline(always)]
fn segment(p: &Packet6) -> Option<Segment> {
    p.is_tcp().then_some(Segment {
        syn: p.tcp_flags & tcp_flags::SYN != 0,
        fin: p.tcp_flags & tcp_flags::FIN != 0,
        rst: p.tcp_flags & tcp_flags::RST != 0,
    })
}

/// Does the backend the entry names still exist with the address it was created with?
#[inline(always)]
pub fn backend_valid(ct: &Ct6Value) -> bool {
    match maps::backend6(ct.backend_id) {
        Some(b) => b.addr == ct.backend_addr && b.port == ct.backend_port,
        None => false,
    }
}

/// log2 of the window (≈1.07 s) within which a busy flow refreshes its REPLY entry once (as
/// `crate::conntrack::reply_check_due`).
const REPLY_CHECK_SHIFT: u32 = 30;

/// A client packet of a tracked flow passes (ingress): ORIGINAL refreshed and moved by the
/// packet; REPLY too when the state changes and once per ≈1 s window (written again if evicted).
#[inline(always)]
pub fn client_passed(p: &Packet6, original: &Ct6Key, entry: &Ct6Entry, ct: &Ct6Value, now: u64) {
    let (was, last_seen) = (ct.state, ct.last_seen_ns);
    let state = flow_state::after_client(was, segment(p));
    entry.touch(now, state);
    if state == was && (now ^ last_seen) >> REPLY_CHECK_SHIFT == 0 {
        return;
    }
    let key = reply_key_of(original, ct);
    match maps::ct6_entry(&key) {
        Some(reply) => reply.touch(now, state),
        None => {
            // The ORIGINAL entry, just stamped, is the REPLY entry's value too.
            if maps::ct6_insert_new(&key, entry.peek()).is_ok() {
                stats::count(Counter::ConntrackRestored);
            }
        }
    }
}

/// A backend packet of a tracked flow passes (egress): both entries refreshed with the flow's
/// new state and marked `SEEN_REPLY`; an evicted ORIGINAL entry is written again.
#[inline(always)]
pub fn reply_passed(p: &Packet6, reply: &Ct6Entry, reply_ct: &Ct6Value, now: u64) {
    let original_key = original_key_of(&reply_key(p), reply_ct);
    match maps::ct6_entry(&original_key) {
        Some(o) => {
            let state = flow_state::after_backend(o.get().state, segment(p));
            reply.touch_flags(now, state, ct_flags::SEEN_REPLY);
            o.touch_flags(now, state, ct_flags::SEEN_REPLY);
        }
        None => {
            let state = flow_state::after_backend(reply_ct.state, segment(p));
            reply.touch_flags(now, state, ct_flags::SEEN_REPLY);
            let value = Ct6Value {
                last_seen_ns: now,
                state,
                flags: reply_ct.flags | ct_flags::SEEN_REPLY,
                ..*reply_ct
            };
            if maps::ct6_insert_new(&original_key, &value).is_ok() {
                stats::count(Counter::ConntrackRestored);
            }
        }
    }
}

/// Is this REPLY entry the one of the flow with this ORIGINAL key?
#[inline(always)]
fn owns_reply(original: &Ct6Key, reply: &Ct6Value) -> bool {
    reply.frontend_addr == original.daddr && reply.frontend_port == original.dport
}

/// A new flow's translation.
pub struct NewFlow6<'a> {
    pub original: &'a Ct6Key,
    pub backend_id: u32,
    pub backend: &'a Backend6,
    pub rev_nat_id: u32,
    pub now_ns: u64,
}

/// Write both entries of a new flow (replacing `replaced`, an expired or stale pair of the same
/// ORIGINAL key). The REPLY key must be free, ours, or held by an idle-expired flow. The value
/// is built in per-CPU map memory (`maps::ct6_new_value`), not on the stack.
#[inline(always)]
pub fn create(p: &Packet6, flow: &NewFlow6<'_>, replaced: Option<Sent>) -> Result<(), Drop> {
    if let Some(old) = replaced {
        remove(flow.original, old);
    }
    let value = maps::ct6_new_value().ok_or(Drop::ConntrackFull)?;
    value.last_seen_ns = flow.now_ns;
    value.created_ns = flow.now_ns;
    value.backend_id = flow.backend_id;
    value.rev_nat_id = flow.rev_nat_id;
    value.frontend_addr = p.daddr;
    value.backend_addr = flow.backend.addr;
    value.frontend_port = p.dport;
    value.backend_port = flow.backend.port;
    value.state = flow_state::after_client(ct_state::UDP, segment(p));
    value.flags = 0;
    value.nat_sport = [0; 2];
    let reply = reply_key_of(flow.original, value);
    if let Some(held) = maps::ct6_entry(&reply) {
        let held = held.peek();
        if !owns_reply(flow.original, held) && !expired(held, p.proto, flow.now_ns) {
            return Err(Drop::ReplyTupleExhausted);
        }
    }
    maps::ct6_insert(flow.original, value).map_err(|_| Drop::ConntrackFull)?;
    if maps::ct6_insert(&reply, value).is_err() {
        maps::ct6_remove(flow.original);
        return Err(Drop::ConntrackFull);
    }
    Ok(())
}

/// Where a flow's packets went: what its REPLY key is made of besides the ORIGINAL key.
#[derive(Clone, Copy)]
pub struct Sent {
    pub backend_addr: [u8; 16],
    pub backend_port: [u8; 2],
}

impl Sent {
    #[inline(always)]
    pub fn of(ct: &Ct6Value) -> Self {
        Self {
            backend_addr: ct.backend_addr,
            backend_port: ct.backend_port,
        }
    }
}

/// Forget a flow: its ORIGINAL entry, and its REPLY entry if that is still its own.
#[inline(always)]
pub fn remove(original: &Ct6Key, sent: Sent) {
    maps::ct6_remove(original);
    let reply = Ct6Key {
        saddr: sent.backend_addr,
        daddr: original.saddr,
        sport: sent.backend_port,
        dport: original.sport,
        proto: original.proto,
        dir: ct_dir::REPLY,
        _pad: [0; 2],
    };
    if let Some(entry) = maps::ct6_entry(&reply)
        && owns_reply(original, entry.peek())
    {
        maps::ct6_remove(&reply);
    }
}
