//! IPv6 conntrack (`CONNTRACK6_V1`): the ORIGINAL/REPLY entry pair of each translated flow, as
//! for IPv4 (`crate::conntrack`), with the same state machine and idle timeouts (shared, pure, in
//! proxy-common). Each direction refreshes (and, if LRU evicted it, writes again) the other.
//!
//! Reply tuples are unique, as for IPv4: a new flow whose REPLY key another live flow holds (one
//! client port reaching the same backend through two frontends, or through a frontend and
//! directly) is given another source port (`ct_flags::SPORT_NAT`, a bounded probe from a
//! flow-hash start), and its replies are put back to the client's own port. Flows straight to a
//! pod are tracked as `ct_flags::DIRECT` ORIGINAL entries so that a later translated flow sees
//! their tuple as taken. A flow only ever removes entries that are its own. The candidate keys
//! of the probe live in per-CPU map memory (`maps::clash6`), not on the new-flow stack.
//!
//! Least connection: every translated flow takes a unit of its backend's count (`LCFLOWS_V1`,
//! shared with IPv4 by backend id, `ct_flags::COUNTED` on its entries) and gives it back once
//! when its end is seen or its entries are replaced, as `crate::lc`.

use proxy_common::{
    CLASH_PORT_MAX, CLASH_PORT_MIN, CLASH_PROBES, Counter, backend_flags, ct_dir, ct_flags,
    ct_state,
    flow_state::{self, Segment},
    hash::PortProbe,
    ipv6::{Ct6Key, Ct6Value, flow_hash6},
    proto,
    timeouts::flow_idle_expired,
};

use super::packet::Packet6;
use crate::{
    Drop,
    maps::{self, Ct6Entry},
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

/// The REPLY key a flow from `client` (its ORIGINAL key) to a backend has when the client's
/// packets leave with source port `client_port`.
#[inline(always)]
fn reply_key_with(
    client: &Ct6Key,
    backend_addr: [u8; 16],
    backend_port: [u8; 2],
    client_port: [u8; 2],
) -> Ct6Key {
    Ct6Key {
        saddr: backend_addr,
        daddr: client.saddr,
        sport: backend_port,
        dport: client_port,
        proto: client.proto,
        dir: ct_dir::REPLY,
        _pad: [0; 2],
    }
}

/// [`reply_key_with`] written in place (into map memory).
#[inline(always)]
fn set_reply_key(
    key: &mut Ct6Key,
    client: &Ct6Key,
    backend_addr: [u8; 16],
    backend_port: [u8; 2],
    client_port: [u8; 2],
) {
    key.saddr = backend_addr;
    key.daddr = client.saddr;
    key.sport = backend_port;
    key.dport = client_port;
    key.proto = client.proto;
    key.dir = ct_dir::REPLY;
    key._pad = [0; 2];
}

/// Is a REPLY entry of this packet's tuple there (a UDP reply of a translated flow from a
/// remote backend, on its way to the client)? The key is built in map memory.
#[inline(always)]
pub fn reply_tracked(p: &Packet6) -> bool {
    let Some(s) = maps::clash6() else {
        return false;
    };
    s.candidate.saddr = p.saddr;
    s.candidate.daddr = p.daddr;
    s.candidate.sport = p.sport;
    s.candidate.dport = p.dport;
    s.candidate.proto = p.proto;
    s.candidate.dir = ct_dir::REPLY;
    s.candidate._pad = [0; 2];
    maps::ct6_entry(&s.candidate).is_some()
}

/// The source port the client's packets of a flow leave with (`ct` an ORIGINAL value).
#[inline(always)]
pub fn translated_sport(original: &Ct6Key, ct: &Ct6Value) -> [u8; 2] {
    if ct.flags & ct_flags::SPORT_NAT != 0 {
        ct.nat_sport
    } else {
        original.sport
    }
}

/// The REPLY key of the flow whose ORIGINAL key and value these are.
#[inline(always)]
pub fn reply_key_of(original: &Ct6Key, ct: &Ct6Value) -> Ct6Key {
    reply_key_with(
        original,
        ct.backend_addr,
        ct.backend_port,
        translated_sport(original, ct),
    )
}

/// The client's own port of a reply (`ct` the REPLY value): the reply's destination port, or the
/// port a clash moved the flow away from.
#[inline(always)]
fn client_port_of_reply(reply_dport: [u8; 2], ct: &Ct6Value) -> [u8; 2] {
    if ct.flags & ct_flags::SPORT_NAT != 0 {
        ct.nat_sport
    } else {
        reply_dport
    }
}

/// The ORIGINAL key of the flow whose REPLY key and value these are.
#[inline(always)]
pub fn original_key_of(reply: &Ct6Key, ct: &Ct6Value) -> Ct6Key {
    Ct6Key {
        saddr: reply.daddr,
        daddr: ct.frontend_addr,
        sport: client_port_of_reply(reply.dport, ct),
        dport: ct.frontend_port,
        proto: reply.proto,
        dir: ct_dir::ORIGINAL,
        _pad: [0; 2],
    }
}

/// Is this a plain direct flow (straight to a pod, its own port): no REPLY entry.
#[inline(always)]
fn plain_direct(ct: &Ct6Value) -> bool {
    ct.flags & ct_flags::DIRECT != 0 && ct.flags & ct_flags::SPORT_NAT == 0
}

#[inline(always)]
pub fn expired(ct: &Ct6Value, proto: u8, now_ns: u64) -> bool {
    flow_idle_expired(
        ct.created_ns,
        ct.last_seen_ns,
        proto,
        ct.state,
        ct.flags,
        now_ns,
        maps::config_ref(),
    )
}

/// The TCP flags (SCTP: its first chunk as TCP flags) of a packet that move its flow's state
/// (`None` for UDP).
#[inline(always)]
fn segment(p: &Packet6) -> Option<Segment> {
    (p.proto != proto::UDP).then_some(flow_state::segment_of(p.tcp_flags))
}

/// State of a flow after a client packet (as `crate::conntrack::next_state`).
#[inline(always)]
pub fn next_state(p: &Packet6, state: u8) -> u8 {
    flow_state::after_client(state, segment(p))
}

/// As `crate::conntrack::next_state_one_way`.
#[inline(always)]
pub fn next_state_one_way(p: &Packet6, state: u8) -> u8 {
    flow_state::after_client_one_way(state, segment(p))
}

/// State of a flow after a backend packet (as `crate::conntrack::next_reply_state`).
#[inline(always)]
pub fn next_reply_state(p: &Packet6, state: u8) -> u8 {
    flow_state::after_backend(state, segment(p))
}

/// Does the backend the entry names still exist with the address it was created with, and may
/// the flow keep it (as `crate::conntrack::backend_valid`: a `NOT_SERVING` backend keeps TCP and
/// SCTP flows, not UDP ones)?
#[inline(always)]
pub fn backend_valid(ct: &Ct6Value) -> bool {
    match maps::backend6(ct.backend_id) {
        Some(b) => {
            b.addr == ct.backend_addr
                && b.port == ct.backend_port
                && backend_flags::keeps_flow(b.flags, b.proto)
        }
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
    let state = if plain_direct(ct) {
        next_state_one_way(p, was)
    } else {
        next_state(p, was)
    };
    entry.touch(now, state);
    if state == ct_state::CLOSING {
        release(entry, ct.backend_id); // A RST or the second FIN: the flow is over.
    }
    if (state == was && (now ^ last_seen) >> REPLY_CHECK_SHIFT == 0) || plain_direct(ct) {
        return;
    }
    let key = reply_key_of(original, ct);
    match maps::ct6_entry(&key) {
        // Only our own: after an eviction another flow may have taken the tuple.
        Some(reply) if owns_reply(original, key.dport, reply.peek()) => reply.touch(now, state),
        Some(_) => {}
        None => {
            // The ORIGINAL entry, just stamped, is the REPLY entry's value too (with the
            // client's own port in `nat_sport` after a clash), built in per-CPU memory.
            let Some(value) = maps::ct6_new_value() else {
                return;
            };
            *value = *entry.peek();
            if value.flags & ct_flags::SPORT_NAT != 0 {
                value.nat_sport = original.sport;
            }
            // Only if the tuple is still free: never overwrite another flow's entry.
            if maps::ct6_insert_new(&key, value).is_ok() {
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
        Some(o) if !sent_to(o.peek(), &p.saddr, p.sport) => {
            // Another flow's entry now, as on IPv4: only this flow's REPLY entry moves.
            let state = flow_state::after_backend(reply_ct.state, segment(p));
            reply.touch_flags(now, state, ct_flags::SEEN_REPLY);
        }
        Some(o) => {
            let state = flow_state::after_backend(o.get().state, segment(p));
            reply.touch_flags(now, state, ct_flags::SEEN_REPLY);
            o.touch_flags(now, state, ct_flags::SEEN_REPLY);
            if state == ct_state::CLOSING {
                release(&o, reply_ct.backend_id);
            }
        }
        None => {
            let state = flow_state::after_backend(reply_ct.state, segment(p));
            reply.touch_flags(now, state, ct_flags::SEEN_REPLY);
            let mut value = Ct6Value {
                last_seen_ns: now,
                state,
                flags: reply_ct.flags | ct_flags::SEEN_REPLY,
                ..*reply_ct
            };
            if reply_ct.flags & ct_flags::SPORT_NAT != 0 {
                value.nat_sport = p.dport; // The ORIGINAL value names the port it leaves with.
            }
            if state == ct_state::CLOSING {
                // Its unit was given back when it closed (or is lost with it: the agent's
                // reconciliation counts only live flows).
                value.flags &= !ct_flags::COUNTED;
            }
            if maps::ct6_insert_new(&original_key, &value).is_ok() {
                stats::count(Counter::ConntrackRestored);
            }
        }
    }
}

/// Was the flow of ORIGINAL value `ct` sent to `addr`:`port` (the source of a reply)?
#[inline(always)]
fn sent_to(ct: &Ct6Value, addr: &[u8; 16], port: [u8; 2]) -> bool {
    ct.backend_addr == *addr && ct.backend_port == port
}

/// Is this REPLY entry (`reply_dport`: its key's destination port, the port the flow left with)
/// the one of the flow with this ORIGINAL key? Same frontend and the same client port: a REPLY
/// entry of another client port's flow to the same frontend (its own port, or moved after a
/// clash) is not ours, even where our probe reaches its key.
#[inline(always)]
fn owns_reply(original: &Ct6Key, reply_dport: [u8; 2], held: &Ct6Value) -> bool {
    held.frontend_addr == original.daddr
        && held.frontend_port == original.dport
        && client_port_of_reply(reply_dport, held) == original.sport
}

/// A new flow's translation. `direct`: a flow straight to a pod (no Service), the backend the pod
/// itself and `backend_id` the frontend generation it was checked at (`crate::frontend_gen`). The backend's address and port by reference (into map memory: a
/// copy of the byte arrays would be kept in registers, spilled, on a nearly full stack).
pub struct NewFlow6<'a> {
    pub original: &'a Ct6Key,
    pub backend_id: u32,
    pub backend_addr: &'a [u8; 16],
    pub backend_port: &'a [u8; 2],
    pub rev_nat_id: u32,
    pub now_ns: u64,
    pub direct: bool,
}

/// The reply-tuple probe's keys (one per CPU, `maps::clash6`): the candidate REPLY key, the
/// ORIGINAL key of the flow holding it, and the direct flow that would hold it.
#[derive(Clone, Copy)]
pub struct Clash6 {
    pub candidate: Ct6Key,
    pub other: Ct6Key,
    pub direct: Ct6Key,
}

/// Is the reply tuple `s.candidate` (for a flow from the ORIGINAL key's client, leaving with
/// source port `s.candidate.dport`) held by another live flow? An entry pair of an idle-expired
/// flow is removed and does not count.
#[inline(always)]
fn reply_tuple_taken(original: &Ct6Key, s: &mut Clash6, now: u64) -> bool {
    if let Some(entry) = maps::ct6_entry(&s.candidate) {
        let held = entry.peek();
        if owns_reply(original, s.candidate.dport, held) {
            return false; // Our own entry from an earlier pick: overwritten.
        }
        let held_live = !expired(held, original.proto, now);
        if held.flags & ct_flags::RETIRED != 0 {
            // Held for the old backend's TIME_WAIT; its ORIGINAL key is another flow's now.
            if held_live {
                return true;
            }
        } else {
            // Field by field: the keys stay in map memory (the new-flow stack is nearly full).
            s.other.saddr = s.candidate.daddr;
            s.other.daddr = held.frontend_addr;
            s.other.sport = client_port_of_reply(s.candidate.dport, held);
            s.other.dport = held.frontend_port;
            s.other.proto = original.proto;
            s.other.dir = ct_dir::ORIGINAL;
            s.other._pad = [0; 2];
            let other_live = match maps::ct6_entry(&s.other) {
                Some(o) => !expired(o.peek(), original.proto, now),
                None => false,
            };
            if held_live || other_live {
                return true;
            }
            // Both entries idle: that flow is over, its tuple free again.
            forget_original(&s.other);
        }
        maps::ct6_remove(&s.candidate);
        stats::count(Counter::ReplyTupleReclaimed);
    }
    // A direct flow from the same client port to the backend holds the tuple too.
    s.direct.saddr = original.saddr;
    s.direct.daddr = s.candidate.saddr;
    s.direct.sport = s.candidate.dport;
    s.direct.dport = s.candidate.sport;
    s.direct.proto = original.proto;
    s.direct.dir = ct_dir::ORIGINAL;
    s.direct._pad = [0; 2];
    if s.direct == *original {
        return false; // The flow itself (a direct flow being tracked).
    }
    match maps::ct6_entry(&s.direct) {
        Some(d) => plain_direct(d.peek()) && !expired(d.peek(), original.proto, now),
        None => false,
    }
}

/// `choose_sport`: keep the client's own port.
const KEEP_SPORT: u32 = 0;
/// `choose_sport`: every probed port is taken.
const NO_SPORT: u32 = 1 << 16;

/// The source port a new flow's packets leave with, as `crate::conntrack::choose_sport`:
/// [`KEEP_SPORT`], a port (host order) found by a bounded probe from a flow-hash start after a
/// clash, or [`NO_SPORT`].
#[inline(always)]
fn choose_sport(
    original: &Ct6Key,
    backend_addr: &[u8; 16],
    backend_port: &[u8; 2],
    now: u64,
) -> u32 {
    let Some(s) = maps::clash6() else {
        return NO_SPORT;
    };
    let hash = flow_hash6(
        maps::hash_seed(),
        original.saddr,
        original.daddr,
        original.sport,
        original.dport,
        original.proto,
    );
    // Computed here, once: left to the compiler, the hash's 32 address bytes (byte arrays are
    // read a byte at a time) are loaded early and spilled across the probe loop, which alone
    // takes the new-flow program past its 512-byte stack.
    // SAFETY: reading a local through a valid reference.
    let hash = unsafe { core::ptr::read_volatile(&hash) };
    set_reply_key(
        &mut s.candidate,
        original,
        *backend_addr,
        *backend_port,
        original.sport,
    );
    let probe = PortProbe::new(hash, CLASH_PORT_MIN, CLASH_PORT_MAX);
    // Round 0 tries the client's own port, the others the probe's: one copy of the check (the
    // new-flow program's stack has no room for two).
    let mut i = 0;
    while i <= CLASH_PROBES {
        let port = if i == 0 {
            KEEP_SPORT
        } else {
            probe.port(i - 1) as u32
        };
        if i != 0 {
            s.candidate.dport = (port as u16).to_be_bytes();
        }
        if (i == 0 || s.candidate.dport != original.sport) && !reply_tuple_taken(original, s, now) {
            return port;
        }
        i += 1;
    }
    NO_SPORT
}

/// Write a new flow's entries (replacing `replaced`, an expired or stale pair of the same
/// ORIGINAL key) with a source port that keeps its reply tuple unique: both entries for a
/// translated flow or a moved direct flow, the ORIGINAL marker only for a plain direct one.
/// The value is built in per-CPU map memory (`maps::ct6_new_value`), not on the stack; it holds
/// the flow's ORIGINAL value afterwards, the one another CPU created for the same flow meanwhile
/// included (see [`insert_pair`]).
#[inline(always)]
pub fn create(p: &Packet6, flow: &NewFlow6<'_>, replaced: Option<Sent>) -> Result<Created6, Drop> {
    if let Some(old) = replaced {
        if old.closed && p.is_tcp() {
            retire(flow.original, old);
        } else {
            remove(flow.original, old);
        }
    }
    let (flags, nat_sport) = match choose_sport(
        flow.original,
        flow.backend_addr,
        flow.backend_port,
        flow.now_ns,
    ) {
        KEEP_SPORT => (0, [0; 2]),
        NO_SPORT => return Err(Drop::ReplyTupleExhausted),
        port => {
            stats::count(Counter::ReplyTupleRemapped);
            (ct_flags::SPORT_NAT, (port as u16).to_be_bytes())
        }
    };
    let value = maps::ct6_new_value().ok_or(Drop::ConntrackFull)?;
    value.last_seen_ns = flow.now_ns;
    value.created_ns = flow.now_ns;
    value.backend_id = flow.backend_id;
    value.rev_nat_id = flow.rev_nat_id;
    value.frontend_addr = p.daddr;
    value.backend_addr = *flow.backend_addr;
    value.frontend_port = p.dport;
    value.backend_port = *flow.backend_port;
    value.state = flow_state::after_client(ct_state::UDP, segment(p));
    value.flags = flags
        | if flow.direct {
            ct_flags::DIRECT
        } else {
            ct_flags::COUNTED
        };
    value.nat_sport = nat_sport;
    if plain_direct(value) {
        // Losing the marker (map full) only loses clash protection for this flow: pass it on.
        let _ = maps::ct6_insert(flow.original, value);
        return Ok(Created6 {
            sport: None,
            theirs: false,
        });
    }
    if !flow.direct {
        maps::lc_add(flow.backend_id, 1);
    }
    let created = insert_pair(flow, value, flags);
    if !matches!(created, Ok(false)) && !flow.direct {
        // Not this packet's flow to count: its pick went unused.
        maps::lc_add(flow.backend_id, u64::MAX);
    }
    let theirs = created?;
    Ok(Created6 {
        sport: if theirs {
            (value.flags & ct_flags::SPORT_NAT != 0).then_some(value.nat_sport)
        } else {
            (flags != 0).then_some(nat_sport)
        },
        theirs,
    })
}

/// A new flow as [`create`] wrote it.
pub struct Created6 {
    /// The source port the packet must leave with when a clash moved it (`None`: its own).
    pub sport: Option<[u8; 2]>,
    /// The flow was created on another CPU meanwhile: this packet follows that translation,
    /// whose ORIGINAL value is in `maps::ct6_new_value`.
    pub theirs: bool,
}

/// Write a new flow's ORIGINAL and REPLY entries (`value`: the ORIGINAL value, in map memory),
/// each only where its key is free, as the IPv4 `insert_pair`: `Ok(true)` when the ORIGINAL key
/// was taken meanwhile by the same flow on another CPU (its value then copied into `value`); a
/// REPLY key another flow took since [`reply_tuple_taken`] looked drops the packet.
#[inline(always)]
fn insert_pair(flow: &NewFlow6<'_>, value: &mut Ct6Value, flags: u8) -> Result<bool, Drop> {
    let s = maps::clash6().ok_or(Drop::ConntrackFull)?;
    set_reply_key(
        &mut s.candidate,
        flow.original,
        value.backend_addr,
        value.backend_port,
        translated_sport(flow.original, value),
    );
    if maps::ct6_insert_new(flow.original, value).is_err() {
        return match maps::ct6_entry(flow.original) {
            Some(theirs) => {
                *value = theirs.get();
                stats::count(Counter::ConntrackInsertRaced);
                Ok(true)
            }
            None => Err(Drop::ConntrackFull),
        };
    }
    if flags != 0 {
        value.nat_sport = flow.original.sport; // The REPLY value names the client's own port.
    }
    if maps::ct6_insert_new(&s.candidate, value).is_err() {
        let written = match maps::ct6_entry(&s.candidate) {
            Some(held) if owns_reply(flow.original, s.candidate.dport, held.peek()) => {
                maps::ct6_insert(&s.candidate, value).map_err(|_| Drop::ConntrackFull)
            }
            Some(_) => Err(Drop::ConntrackInsertFailed),
            None => Err(Drop::ConntrackFull),
        };
        if let Err(drop) = written {
            maps::ct6_remove(flow.original);
            return Err(drop);
        }
    }
    Ok(false)
}

/// Where a flow's packets went: what its REPLY key is made of besides the ORIGINAL key.
#[derive(Clone, Copy)]
pub struct Sent {
    pub backend_addr: [u8; 16],
    pub backend_port: [u8; 2],
    /// The source port they left with.
    pub sport: [u8; 2],
    /// A REPLY entry exists (all but plain direct flows).
    pub has_reply: bool,
    /// The flow had closed (`ct_state::CLOSING`).
    pub closed: bool,
}

impl Sent {
    #[inline(always)]
    pub fn of(original: &Ct6Key, ct: &Ct6Value) -> Self {
        Self {
            backend_addr: ct.backend_addr,
            backend_port: ct.backend_port,
            sport: translated_sport(original, ct),
            has_reply: !plain_direct(ct),
            closed: ct.state == ct_state::CLOSING,
        }
    }
}

/// Forget a flow: its ORIGINAL entry, and its REPLY entry if that is still its own.
#[inline(always)]
pub fn remove(original: &Ct6Key, sent: Sent) {
    forget(original, sent, false);
}

/// Forget a closed TCP flow whose ORIGINAL tuple a new connection reopens, as
/// `crate::conntrack::retire`: its REPLY entry stays as a `ct_flags::RETIRED` holder of the
/// reply tuple until it idles out.
#[inline(always)]
fn retire(original: &Ct6Key, sent: Sent) {
    forget(original, sent, true);
}

/// [`remove`] (`retire_reply` false) or [`retire`] (true).
#[inline(always)]
fn forget(original: &Ct6Key, sent: Sent, retire_reply: bool) {
    forget_original(original);
    if !sent.has_reply {
        return;
    }
    let reply = reply_key_with(original, sent.backend_addr, sent.backend_port, sent.sport);
    if let Some(entry) = maps::ct6_entry(&reply)
        && owns_reply(original, reply.dport, entry.peek())
    {
        if retire_reply {
            entry.set_flags(ct_flags::RETIRED);
        } else {
            maps::ct6_remove(&reply);
        }
    }
}

/// Remove an ORIGINAL entry, giving back its flow's least-connection unit if it still holds it.
#[inline(always)]
fn forget_original(original: &Ct6Key) {
    if let Some(entry) = maps::ct6_entry(original) {
        let backend_id = entry.peek().backend_id;
        release(&entry, backend_id);
    }
    maps::ct6_remove(original);
}

/// Give back the unit of the flow whose ORIGINAL entry this is, once (`COUNTED` cleared
/// atomically).
#[inline(always)]
fn release(entry: &Ct6Entry, backend_id: u32) {
    if entry.has_flags(ct_flags::COUNTED) && entry.take_counted() {
        maps::lc_add(backend_id, u64::MAX);
    }
}
