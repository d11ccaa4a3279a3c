//! Conntrack: keys, idle timeouts, TCP state and the ORIGINAL/REPLY entry pair.
//!
//! Every translated flow has two entries in `CONNTRACK_V1`: ORIGINAL, keyed as the client's
//! packets arrive (client → frontend), and REPLY, keyed as the backend's replies leave
//! (backend → client). Ingress looks up ORIGINAL, egress REPLY; each refreshes (and, if LRU
//! evicted it, writes again) the other, so a live flow survives the loss of either entry.
//!
//! Reply tuples are unique, as netfilter keeps them: a new flow whose REPLY key is held by
//! another live flow (one client port reaching the same backend through two frontends, or
//! through a frontend and directly) is given another source port (`ct_flags::SPORT_NAT`), and
//! its replies are put back to the client's own port. Flows straight to a pod are tracked as
//! `ct_flags::DIRECT` ORIGINAL entries so that a later translated flow sees their tuple as taken.
//! A flow only ever removes entries that are its own.

/// Has a flow been idle past its timeout? One rule in proxy-common, shared with the agent's
/// conntrack and SNAT garbage collection.
pub use proxy_common::timeouts::flow_idle_expired;
use proxy_common::{
    Backend, CLASH_PORT_MAX, CLASH_PORT_MIN, CLASH_PROBES, Counter, CtKey, CtValue, DatapathConfig,
    ServiceKey, backend_flags, ct_dir, ct_flags, ct_state,
    flow_state::{self, Segment},
    hash::{PortProbe, flow_hash},
    proto,
};

use crate::{
    Drop, frontend_gen, lc,
    maps::{self, CtEntry},
    packet::Packet,
    stats,
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

/// The REPLY key a flow from `client` (its ORIGINAL key) to a backend has when the client's
/// packets leave with source port `client_port`.
#[inline(always)]
fn reply_key_with(
    client: &CtKey,
    backend_addr: [u8; 4],
    backend_port: [u8; 2],
    client_port: [u8; 2],
) -> CtKey {
    CtKey {
        saddr: backend_addr,
        daddr: client.saddr,
        sport: backend_port,
        dport: client_port,
        proto: client.proto,
        dir: ct_dir::REPLY,
        _pad: [0; 2],
    }
}

/// The source port the client's packets of a flow leave with (`ct` an ORIGINAL value).
#[inline(always)]
pub fn translated_sport(original: &CtKey, ct: &CtValue) -> [u8; 2] {
    if ct.flags & ct_flags::SPORT_NAT != 0 {
        ct.nat_sport
    } else {
        original.sport
    }
}

/// The REPLY key of the flow whose ORIGINAL key and value these are.
#[inline(always)]
pub fn reply_key_of(original: &CtKey, ct: &CtValue) -> CtKey {
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
pub fn client_port_of_reply(reply_dport: [u8; 2], ct: &CtValue) -> [u8; 2] {
    if ct.flags & ct_flags::SPORT_NAT != 0 {
        ct.nat_sport
    } else {
        reply_dport
    }
}

/// The ORIGINAL key of the flow whose REPLY key and value these are.
#[inline(always)]
pub fn original_key_of(reply: &CtKey, ct: &CtValue) -> CtKey {
    CtKey {
        saddr: reply.daddr,
        daddr: ct.frontend_addr,
        sport: client_port_of_reply(reply.dport, ct),
        dport: ct.frontend_port,
        proto: reply.proto,
        dir: ct_dir::ORIGINAL,
        _pad: [0; 2],
    }
}

/// The ORIGINAL value of a flow from its REPLY value and the reply tuple's destination port (the
/// two differ only in `nat_sport`).
#[inline(always)]
pub fn original_value_of(reply_dport: [u8; 2], ct: &CtValue) -> CtValue {
    let mut v = *ct;
    if ct.flags & ct_flags::SPORT_NAT != 0 {
        v.nat_sport = reply_dport;
    }
    v
}

/// Is this REPLY entry (`reply_dport`: its key's destination port, the port the flow left with)
/// the one of the flow with this ORIGINAL key? Same frontend and the same client port: a REPLY
/// entry of another client port's flow to the same frontend (its own port, or moved after a
/// clash) is not ours, even where our probe reaches its key.
#[inline(always)]
fn owns_reply(original: &CtKey, reply_dport: [u8; 2], held: &CtValue) -> bool {
    held.frontend_addr == original.daddr
        && held.frontend_port == original.dport
        && client_port_of_reply(reply_dport, held) == original.sport
}

/// Has the entry been idle for longer than its timeout (`timeouts::flow_idle_expired`)?
#[inline(always)]
pub fn expired(ct: &CtValue, proto: u8, now_ns: u64, cfg: &DatapathConfig) -> bool {
    flow_idle_expired(
        ct.created_ns,
        ct.last_seen_ns,
        proto,
        ct.state,
        ct.flags,
        now_ns,
        cfg,
    )
}

/// The TCP flags (SCTP: its first chunk as TCP flags) of a packet that move its flow's state
/// (`None` for UDP).
#[inline(always)]
fn segment(p: &Packet) -> Option<Segment> {
    (p.proto != proto::UDP).then_some(flow_state::segment_of(p.tcp_flags))
}

/// State of a flow after a client packet (ORIGINAL direction), for an entry whose flow's
/// backend packets are seen too.
#[inline(always)]
pub fn next_state(p: &Packet, state: u8) -> u8 {
    flow_state::after_client(state, segment(p))
}

/// [`next_state`] for an entry that never sees the backend's packets (a plain direct flow, a
/// SNAT `out` entry): `flow_state::after_client_one_way`.
#[inline(always)]
pub fn next_state_one_way(p: &Packet, state: u8) -> u8 {
    flow_state::after_client_one_way(state, segment(p))
}

/// A flow straight to a pod without a REPLY entry: its replies pass untracked.
#[inline(always)]
fn plain_direct(ct: &CtValue) -> bool {
    ct.flags & ct_flags::DIRECT != 0 && ct.flags & ct_flags::SPORT_NAT == 0
}

/// State of a flow after a backend packet (REPLY direction): only FIN/RST change it.
#[inline(always)]
pub fn next_reply_state(p: &Packet, state: u8) -> u8 {
    flow_state::after_backend(state, segment(p))
}

/// A client packet of a tracked flow passes (ingress): its ORIGINAL entry (`entry`, keyed
/// `original`) is refreshed and moved by the packet; the REPLY entry too when the state changes
/// (a RST or the client's FIN must reach it: the backend may never send again to carry it over)
/// and once per ≈1 s window (see [`reply_check_due`]), written again if LRU evicted it.
#[inline(always)]
pub fn client_passed(p: &Packet, original: &CtKey, entry: &CtEntry, ct: &CtValue, now: u64) {
    let state = if plain_direct(ct) {
        next_state_one_way(p, ct.state)
    } else {
        next_state(p, ct.state)
    };
    entry.touch(now, state);
    if state == ct_state::CLOSING {
        lc::release(entry, ct.backend_id); // A RST or the second FIN: the flow is over.
    }
    if reply_check_due(ct, now, state) {
        refresh_reply(original, ct, now, state);
    }
}

/// A backend packet of a tracked flow passes (egress): both entries are refreshed with the
/// flow's new state (the ORIGINAL entry's, which also saw the client's FIN, moved by this
/// packet) and marked `SEEN_REPLY` (a UDP flow is a stream from now on). An ORIGINAL entry that
/// LRU evicted is written again (only if its key is free), so the client's next packet keeps
/// this backend.
#[inline(always)]
pub fn reply_passed(p: &Packet, reply: &CtEntry, reply_ct: &CtValue, now: u64) {
    let original_key = original_key_of(&reply_key(p), reply_ct);
    match maps::ct_entry(&original_key) {
        Some(o) if !sent_to(o.peek(), p.saddr, p.sport) => {
            // The key holds another flow now (this one's ORIGINAL entry was evicted and the
            // client opened a new flow on the tuple to another backend): only this flow's REPLY
            // entry moves, never that flow's state or least-connection unit.
            reply.touch_flags(
                now,
                next_reply_state(p, reply_ct.state),
                ct_flags::SEEN_REPLY,
            );
        }
        Some(o) => {
            let state = next_reply_state(p, o.get().state);
            reply.touch_flags(now, state, ct_flags::SEEN_REPLY);
            o.touch_flags(now, state, ct_flags::SEEN_REPLY);
            if state == ct_state::CLOSING {
                lc::release(&o, reply_ct.backend_id);
            }
        }
        None => {
            let state = next_reply_state(p, reply_ct.state);
            reply.touch_flags(now, state, ct_flags::SEEN_REPLY);
            let mut value = original_value_of(p.dport, reply_ct);
            value.last_seen_ns = now;
            value.state = state;
            value.flags |= ct_flags::SEEN_REPLY;
            if state == ct_state::CLOSING {
                // Its unit was given back when it closed (or is lost with it: the agent's
                // reconciliation counts only live flows).
                value.flags &= !ct_flags::COUNTED;
            }
            if maps::ct_insert_new(&original_key, &value).is_ok() {
                stats::count(Counter::ConntrackRestored);
            }
        }
    }
}

/// Was the flow of ORIGINAL value `ct` sent to `addr`:`port` (the source of a reply)?
#[inline(always)]
fn sent_to(ct: &CtValue, addr: [u8; 4], port: [u8; 2]) -> bool {
    ct.backend_addr == addr && ct.backend_port == port
}

/// Does the backend the entry names still exist with the address it was created with, and may
/// the flow keep it? A `NOT_SERVING` backend keeps its TCP and SCTP flows, not its UDP ones
/// (`backend_flags::keeps_flow`): those are chosen again.
#[inline(always)]
pub fn backend_valid(ct: &CtValue) -> bool {
    match maps::backend(ct.backend_id) {
        Some(b) => {
            b.addr == ct.backend_addr
                && b.port == ct.backend_port
                && backend_flags::keeps_flow(b.flags, b.proto)
        }
        None => false,
    }
}

/// log2 of the window (≈1.07 s) within which a busy flow's REPLY entry is checked once.
const REPLY_CHECK_SHIFT: u32 = 30;

/// Should this packet of a known flow check (and refresh) its REPLY entry? When its state
/// changes (a FIN/RST reaches the REPLY entry too), and on its first packet in each ≈1 s
/// window: an evicted REPLY entry is back within a second of traffic, while a busy flow's packets
/// mostly skip the lookup (the established path stays one conntrack lookup).
#[inline(always)]
pub fn reply_check_due(ct: &CtValue, now_ns: u64, state: u8) -> bool {
    state != ct.state || (now_ns ^ ct.last_seen_ns) >> REPLY_CHECK_SHIFT != 0
}

/// Ingress, a packet of a known flow: refresh its REPLY entry too (so LRU keeps both while
/// either side sends), and write it again if it was evicted. An entry another flow wrote at the
/// key meanwhile (the tuple looked free once ours was evicted) is left as it is.
#[inline(always)]
pub fn refresh_reply(original: &CtKey, ct: &CtValue, now_ns: u64, state: u8) {
    if plain_direct(ct) {
        return; // A plain direct flow has no REPLY entry.
    }
    let key = reply_key_of(original, ct);
    match maps::ct_entry(&key) {
        // Only our own: after an eviction another flow may have taken the tuple.
        Some(reply) if owns_reply(original, key.dport, reply.peek()) => reply.touch(now_ns, state),
        Some(_) => {}
        None => {
            let mut value = *ct;
            if ct.flags & ct_flags::SPORT_NAT != 0 {
                value.nat_sport = original.sport;
            }
            value.last_seen_ns = now_ns;
            value.state = state;
            // Only if the tuple is still free: never overwrite another flow's entry.
            if maps::ct_insert_new(&key, &value).is_ok() {
                stats::count(Counter::ConntrackRestored);
            }
        }
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

/// Is the reply tuple `reply` (for a flow to `backend` from the ORIGINAL key's client, leaving
/// with source port `reply.dport`) held by another live flow? An entry of an idle-expired flow
/// is removed (with its ORIGINAL entry) and does not count.
#[inline(always)]
fn reply_tuple_taken(original: &CtKey, reply: &CtKey, now: u64) -> bool {
    let cfg = maps::config_ref();
    if let Some(entry) = maps::ct_entry(reply) {
        let held = entry.peek();
        if owns_reply(original, reply.dport, held) {
            return false; // Our own entry from an earlier pick: overwritten.
        }
        let held_live = !expired(held, reply.proto, now, cfg);
        if held.flags & ct_flags::RETIRED != 0 {
            // Held for the old backend's TIME_WAIT; its ORIGINAL key is another flow's now.
            if held_live {
                return true;
            }
        } else {
            let other = original_key_of(reply, held);
            let other_live = match maps::ct_entry(&other) {
                Some(o) => !expired(o.peek(), reply.proto, now, cfg),
                None => false,
            };
            if other_live || held_live {
                return true;
            }
            // Both entries idle: that flow is over, its tuple free again.
            forget_original(&other);
        }
        maps::ct_remove(reply);
        stats::count(Counter::ReplyTupleReclaimed);
    }
    // A direct flow from the same client port to the backend holds the tuple too.
    let direct = CtKey {
        saddr: original.saddr,
        daddr: reply.saddr,
        sport: reply.dport,
        dport: reply.sport,
        proto: original.proto,
        dir: ct_dir::ORIGINAL,
        _pad: [0; 2],
    };
    if direct == *original {
        return false; // The flow itself (a direct flow being tracked).
    }
    match maps::ct_entry(&direct) {
        Some(d) => {
            let d = d.peek();
            d.flags & ct_flags::DIRECT != 0
                && d.flags & ct_flags::SPORT_NAT == 0
                && !expired(d, original.proto, now, cfg)
        }
        None => false,
    }
}

/// `choose_sport`: keep the client's own port.
const KEEP_SPORT: u32 = 0;
/// `choose_sport`: every probed port is taken.
const NO_SPORT: u32 = 1 << 16;

/// The source port a new flow's packets leave with: [`KEEP_SPORT`] for the client's own, a port
/// (host order) if the reply tuple clashed and a bounded probe from a flow-hash start found a free
/// one, [`NO_SPORT`] if none.
#[inline(always)]
fn choose_sport(original: &CtKey, backend: &Backend, now: u64) -> u32 {
    let mut candidate = reply_key_with(original, backend.addr, backend.port, original.sport);
    if !reply_tuple_taken(original, &candidate, now) {
        return KEEP_SPORT;
    }
    let hash = flow_hash(
        maps::hash_seed(),
        original.saddr,
        original.daddr,
        original.sport,
        original.dport,
        original.proto,
    );
    let probe = PortProbe::new(hash, CLASH_PORT_MIN, CLASH_PORT_MAX);
    let mut i = 0;
    while i < CLASH_PROBES {
        let port = probe.port(i) as u32;
        candidate.dport = (port as u16).to_be_bytes();
        if candidate.dport != original.sport && !reply_tuple_taken(original, &candidate, now) {
            return port;
        }
        i += 1;
    }
    NO_SPORT
}

/// [`choose_sport`] as the flags and `nat_sport` of a new entry.
#[inline(always)]
fn clash_resolution(original: &CtKey, backend: &Backend, now: u64) -> Result<(u8, [u8; 2]), Drop> {
    match choose_sport(original, backend, now) {
        KEEP_SPORT => Ok((0, [0; 2])),
        NO_SPORT => Err(Drop::ReplyTupleExhausted),
        port => {
            stats::count(Counter::ReplyTupleRemapped);
            Ok((ct_flags::SPORT_NAT, (port as u16).to_be_bytes()))
        }
    }
}

/// Write both entries of a new flow (replacing an expired or stale pair of the same ORIGINAL
/// key), with a source port that keeps its reply tuple unique. Returns the ORIGINAL value (its
/// `translated_sport` is what the packet must leave with), or the one another CPU created for
/// the same flow meanwhile (see [`insert_pair`]).
#[inline(always)]
pub fn create(p: &Packet, flow: &NewFlow<'_>, replaced: Option<&CtValue>) -> Result<Written, Drop> {
    if let Some(old) = replaced {
        if old.state == ct_state::CLOSING && p.is_tcp() {
            retire(flow.original, old);
        } else {
            remove(flow.original, old);
        }
    }
    let (flags, nat_sport) = clash_resolution(flow.original, flow.backend, flow.now_ns)?;
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
        flags: flags | ct_flags::COUNTED,
        nat_sport,
    };
    lc::count(flow.backend_id);
    match insert_pair(flow.original, value) {
        Ok(Written::Ours(value)) => Ok(Written::Ours(value)),
        // Not this packet's flow to count: its pick went unused.
        created => {
            maps::lc_add(flow.backend_id, u64::MAX);
            created
        }
    }
}

/// The ORIGINAL value a new flow goes on with.
pub enum Written {
    /// The entries this packet wrote.
    Ours(CtValue),
    /// The same flow's entry another CPU wrote between this packet's lookup and its insert (the
    /// flow's first packets on two receive queues): this packet follows that flow's translation.
    Theirs(CtValue),
}

/// Write a flow's ORIGINAL and REPLY entries, each only where its key is free, so that two CPUs
/// never both create one flow nor two flows share a reply tuple: an ORIGINAL key taken meanwhile
/// is the same flow, created on another CPU ([`Written::Theirs`]); a REPLY key another flow took
/// since [`reply_tuple_taken`] looked is netfilter's insert clash, and the packet is dropped
/// (`drop_conntrack_insert_failed`; a retransmission picks again). A REPLY entry of this flow's
/// own earlier pick is overwritten.
#[inline(always)]
fn insert_pair(original: &CtKey, mut value: CtValue) -> Result<Written, Drop> {
    let reply = reply_key_of(original, &value);
    if maps::ct_insert_new(original, &value).is_err() {
        return match maps::ct_entry(original) {
            Some(theirs) => {
                stats::count(Counter::ConntrackInsertRaced);
                Ok(Written::Theirs(theirs.get()))
            }
            None => Err(Drop::ConntrackFull),
        };
    }
    let sport = value.nat_sport;
    if value.flags & ct_flags::SPORT_NAT != 0 {
        value.nat_sport = original.sport;
    }
    if maps::ct_insert_new(&reply, &value).is_err() {
        let written = match maps::ct_entry(&reply) {
            Some(held) if owns_reply(original, reply.dport, held.peek()) => {
                maps::ct_insert(&reply, &value).map_err(|_| Drop::ConntrackFull)
            }
            Some(_) => Err(Drop::ConntrackInsertFailed),
            None => Err(Drop::ConntrackFull),
        };
        if let Err(drop) = written {
            maps::ct_remove(original);
            return Err(drop);
        }
    }
    value.nat_sport = sport;
    Ok(Written::Ours(value))
}

/// A packet straight to an address that is no Service frontend, on ingress: track the flow so
/// that no translated flow takes its reply tuple, and, if a live translated flow already holds
/// it, move this flow to another source port. `Some(port)`: rewrite the source port to it.
#[inline(always)]
pub fn direct_flow(p: &Packet, key: &CtKey, now: u64) -> Result<Option<[u8; 2]>, Drop> {
    if p.is_tcp() && !p.is_syn() {
        // Only a connection's first packet starts tracking (mid-stream packets of flows that
        // began before the agent, or without a SYN we saw, stay untracked). The caller checks
        // this already; kept here so the rule lives with the function.
        return Ok(None);
    }
    if !p.is_tcp() && maps::ct_entry(&reply_key(p)).is_some() {
        // A UDP reply of a translated flow from a remote backend, on its way to the client.
        return Ok(None);
    }
    let Some(checked_at) = frontend_gen::for_new_direct(|| {
        maps::service(&ServiceKey::new(p.daddr, p.dport, p.proto, 0)).is_some()
    }) else {
        return Ok(None);
    };
    let itself = Backend {
        addr: p.daddr,
        port: p.dport,
        proto: p.proto,
        flags: 0,
    };
    let (flags, nat_sport) = clash_resolution(key, &itself, now)?;
    let value = CtValue {
        last_seen_ns: now,
        created_ns: now,
        backend_id: checked_at,
        rev_nat_id: 0,
        frontend_addr: p.daddr,
        backend_addr: p.daddr,
        frontend_port: p.dport,
        backend_port: p.dport,
        state: next_state(p, ct_state::UDP),
        flags: ct_flags::DIRECT | flags,
        nat_sport,
    };
    if flags != 0 {
        let (Written::Ours(written) | Written::Theirs(written)) = insert_pair(key, value)?;
        return Ok((written.flags & ct_flags::SPORT_NAT != 0).then_some(written.nat_sport));
    }
    // Losing the marker (map full) only loses clash protection for this flow: pass it on.
    let _ = maps::ct_insert(key, &value);
    Ok(None)
}

/// Forget a flow: its ORIGINAL entry, and its REPLY entry if that is still its own.
#[inline(always)]
pub fn remove(original: &CtKey, ct: &CtValue) {
    forget(original, ct, false);
}

/// Forget a closed TCP flow whose ORIGINAL tuple a new connection reopens: its ORIGINAL entry
/// goes, its REPLY entry stays as a `ct_flags::RETIRED` holder of the reply tuple until it idles
/// out (see there). A new flow that picks the same backend and port overwrites it: the same
/// four-tuple at the backend, with the client's next ISN, which TIME_WAIT accepts.
#[inline(always)]
fn retire(original: &CtKey, ct: &CtValue) {
    forget(original, ct, true);
}

/// [`remove`] (`retire_reply` false) or [`retire`] (true).
#[inline(always)]
fn forget(original: &CtKey, ct: &CtValue, retire_reply: bool) {
    forget_original(original);
    if ct.flags & ct_flags::DIRECT != 0 && ct.flags & ct_flags::SPORT_NAT == 0 {
        return;
    }
    let reply = reply_key_of(original, ct);
    if let Some(entry) = maps::ct_entry(&reply)
        && owns_reply(original, reply.dport, entry.peek())
    {
        if retire_reply {
            // In place: its last-seen time (the flow's end) keeps timing it out.
            entry.set_flags(ct_flags::RETIRED);
        } else {
            maps::ct_remove(&reply);
        }
    }
}

/// Remove an ORIGINAL entry, giving back its flow's least-connection unit if it still holds it.
#[inline(always)]
fn forget_original(original: &CtKey) {
    if let Some(entry) = maps::ct_entry(original) {
        let backend_id = entry.peek().backend_id;
        lc::release(&entry, backend_id);
    }
    maps::ct_remove(original);
}
