//! IPv6 SNAT to the node (`SNAT6_V1`), as `crate::snat` for IPv4: external flows (NodePort,
//! externalIP, LoadBalancer frontends with eTP=Cluster) to a remote backend, and such flows from
//! outside the IPv6 cluster CIDRs to a local one, leave with the node's IPv6 address
//! (`NODE6_V1`) and a port of the SNAT range, so the backend's replies come back through this
//! node. Same split as IPv4: tc ingress allocates the port (new-flow program), tc egress rewrites
//! the forwarded packet's source, a reply on ingress gets its destination put back to the client
//! and tc egress toward the client then reverse-DNATs it like any reply.
//!
//! Which flows are masqueraded is decided by the family-neutral `crate::snat::external_needed`,
//! and hairpin flows (a pod sent to a Service and was picked as its own backend) too.
//!
//! A hairpin flow's source is the Service address the pod sent to (its frontend: ClusterIP,
//! NodePort address, ...), as Cilium's service loopback, not a fixed link-local address as on
//! IPv4: an IPv6 pod treats `fe80::/64` as on-link and would look for the address by neighbour
//! discovery on its own link, where nothing answers, instead of sending its reply to the node.
//! The frontend address is reached through the pod's default route (the pod has just sent to
//! it) and is never one of the pod's own addresses. kube-proxy masquerades hairpin flows to the
//! node's (or bridge's) address instead; that would make hairpin depend on the agent having
//! written `NODE6_V1` and share the node's SNAT ports with external flows. The `in` entry is
//! keyed on the frontend address: the pod's reply to it is put back to the pod as client on
//! ingress, before routing sees it. (The server side of the pod sees the Service address as
//! its peer, as with Cilium.)
//!
//! Ports as on IPv4 (`crate::snat`): a TCP or UDP flow on the node's address keeps its client's
//! port when the tuple is free, else walks the whole unprivileged range skipping ports a socket
//! of the node holds; a connection of the node's own that would clash with a live SNATed flow is
//! given another source port ([`node_connection`]). Hairpin flows walk the dedicated range.
//!
//! Not on IPv6 (yet): per-device source addresses (`SNATDEV_V1`): an external flow's source
//! is always the node's address.

use aya_ebpf::programs::TcContext;
use proxy_common::{
    Counter, SNAT_NODE_PORT_MIN, SNAT_PROBES, ct_dir, ct_flags, ct_state,
    ipv6::{Ct6Key, Snat6Key, Snat6Value, flow_hash6},
    shares_node_ports,
    timeouts::snat_port_reclaimable,
};

use super::{conntrack, packet::Packet6};
use crate::{
    Drop, local_socket,
    maps::{self, Snat6Entry},
    stats,
};

/// The keys and values of a port allocation (one per CPU, `maps::snat6_scratch`): 40-byte keys
/// and 32-byte values do not fit on the stack of the programs that allocate. `out` holds the
/// result (the node address and port a flow leaves with); `original`, `state` and `stale` are
/// what the new-flow program leaves for the ingress SNAT program it tail-calls. `hairpin`: the
/// source of a hairpin flow (its frontend address), set by the caller of [`allocate`].
#[derive(Clone, Copy)]
pub struct Snat6Scratch {
    pub out_key: Snat6Key,
    pub in_key: Snat6Key,
    pub client: Snat6Value,
    pub out: Snat6Value,
    /// The source address being allocated on (the node's, or `hairpin`).
    pub node: [u8; 16],
    pub hairpin: [u8; 16],
    pub original: Ct6Key,
    pub state: u8,
    pub stale: bool,
    /// Set by the new-flow program: the flow it is creating needs SNAT.
    pub masquerade: bool,
}

/// A flow after DNAT: client → backend.
pub struct Flow6<'a> {
    pub client: &'a [u8; 16],
    pub client_port: [u8; 2],
    pub backend: &'a [u8; 16],
    pub backend_port: [u8; 2],
    pub proto: u8,
}

impl<'a> Flow6<'a> {
    /// A hairpin flow: the client is its own backend.
    #[inline(always)]
    pub fn is_hairpin(&self) -> bool {
        self.client == self.backend
    }

    /// The forwarded packet as egress sees it (client → backend).
    #[inline(always)]
    pub fn of_forwarded(p: &'a Packet6) -> Self {
        Self {
            client: &p.saddr,
            client_port: p.sport,
            backend: &p.daddr,
            backend_port: p.dport,
            proto: p.proto,
        }
    }

    #[inline(always)]
    fn set_out_key(&self, key: &mut Snat6Key) {
        key.saddr = *self.client;
        key.daddr = *self.backend;
        key.sport = self.client_port;
        key.dport = self.backend_port;
        key.proto = self.proto;
        key.dir = ct_dir::ORIGINAL;
        key._pad = [0; 2];
    }

    /// The `in` key for node address `node` and port `port`.
    #[inline(always)]
    fn set_in_key(&self, key: &mut Snat6Key, node: &[u8; 16], port: [u8; 2]) {
        key.saddr = *self.backend;
        key.daddr = *node;
        key.sport = self.backend_port;
        key.dport = port;
        key.proto = self.proto;
        key.dir = ct_dir::REPLY;
        key._pad = [0; 2];
    }

    /// The `in` entry of the `out` value in `s.out` (its key left in `s.in_key`), if it still
    /// belongs to this flow (not reclaimed by another).
    #[inline(always)]
    fn own_in_entry(&self, s: &mut Snat6Scratch) -> Option<Snat6Entry> {
        let (addr, port) = (s.out.addr, s.out.port);
        self.set_in_key(&mut s.in_key, &addr, port);
        let entry = maps::snat6_entry(&s.in_key)?;
        let v = entry.peek();
        (v.addr == *self.client && v.port == self.client_port).then_some(entry)
    }
}

/// The `in` key of a packet arriving on ingress (backend → node address:port).
#[inline(always)]
pub fn in_key_of_reply(p: &Packet6) -> Snat6Key {
    // The packet's own tuple as seen, tagged REPLY: what `conntrack::reply_key` builds.
    conntrack::reply_key(p)
}

/// The `out` entry of a packet leaving on egress (client → backend), its key in `s.out_key`.
#[inline(always)]
pub fn out_entry_of_forwarded(p: &Packet6, s: &mut Snat6Scratch) -> Option<Snat6Entry> {
    Flow6::of_forwarded(p).set_out_key(&mut s.out_key);
    maps::snat6_entry(&s.out_key)
}

/// Give a flow the node's address (a hairpin flow: `s.hairpin`) and a port (reusing its entries
/// if they are still its own): `Ok(true)` with them in `s.out`; `Ok(false)`: the node has no
/// IPv6 SNAT address yet (counted; the flow goes out unSNATed).
#[inline(always)]
pub fn allocate(
    ctx: &TcContext,
    f: &Flow6,
    s: &mut Snat6Scratch,
    state: u8,
    now: u64,
) -> Result<bool, Drop> {
    s.node = if f.is_hairpin() {
        s.hairpin
    } else {
        maps::node6_addr()
    };
    if s.node == [0; 16] {
        stats::count(Counter::SnatNoNodeAddr);
        return Ok(false);
    }
    f.set_out_key(&mut s.out_key);
    if let Some(out) = maps::snat6_entry(&s.out_key) {
        s.out = out.get();
        if let Some(own) = f.own_in_entry(s) {
            if s.out.addr == s.node {
                own.touch(now, state);
                out.touch(now, state);
                return Ok(true);
            }
            // Its port on an old node address (or frontend): free it for other flows.
            maps::snat6_remove(&s.in_key);
        }
    }
    let cfg = maps::config_ref();
    s.client = Snat6Value {
        last_seen_ns: now,
        addr: *f.client,
        port: f.client_port,
        state,
        flags: 0,
        _pad: [0; 4],
    };
    let hash = flow_hash6(
        maps::hash_seed(),
        *f.client,
        *f.backend,
        f.client_port,
        f.backend_port,
        f.proto,
    );
    let (ports, shared) = crate::snat::port_walk(hash, f.proto, f.client_port, !f.is_hairpin());
    let node = s.node;
    f.set_in_key(&mut s.in_key, &node, [0; 2]);
    let mut i = 0;
    while i < SNAT_PROBES {
        let port = ports.port(i).to_be_bytes();
        if shared && local_socket::owns_v6(ctx, f.proto, &node, port, f.backend, f.backend_port) {
            stats::count(Counter::SnatPortLocalSocket);
            i += 1;
            continue;
        }
        s.in_key.dport = port;
        let claimed = maps::snat6_claim(&s.in_key, &s.client).is_ok()
            || match maps::snat6_entry(&s.in_key) {
                // An idle holder's port: taken over by one CPU only, as on IPv4.
                Some(taken) => {
                    let old = taken.peek();
                    let seen = old.last_seen_ns;
                    snat_port_reclaimable(seen, f.proto, old.state, old.flags, now, cfg)
                        && taken.claim_idle(seen, now)
                        && maps::snat6_insert(&s.in_key, &s.client).is_ok()
                }
                // Evicted between the claim and the lookup: claim it again.
                None => maps::snat6_claim(&s.in_key, &s.client).is_ok(),
            };
        if claimed {
            s.out = s.client;
            s.out.addr = node;
            s.out.port = port;
            if maps::snat6_insert(&s.out_key, &s.out).is_err() {
                maps::snat6_remove(&s.in_key);
                return Err(Drop::ConntrackFull);
            }
            stats::count(if f.is_hairpin() {
                Counter::HairpinSnat
            } else {
                Counter::SnatNew
            });
            if ports.kept(i) {
                stats::count(Counter::SnatPortKept);
            }
            return Ok(true);
        }
        i += 1;
    }
    Err(Drop::SnatPortsExhausted)
}

/// Egress: the node address and port (`s.out`) of a forwarded packet whose flow has the `out`
/// entry `out` (key in `s.out_key`), its entries refreshed (re-allocated if its port was
/// reclaimed after a long silence; a hairpin flow on the frontend address it had). `Ok(false)`:
/// no node address (the packet goes unSNATed).
#[inline(always)]
pub fn forwarded(
    ctx: &TcContext,
    p: &Packet6,
    out: Snat6Entry,
    s: &mut Snat6Scratch,
    now: u64,
) -> Result<bool, Drop> {
    s.out = out.get();
    s.hairpin = s.out.addr;
    // The `out` entry sees only the client's packets.
    let state = conntrack::next_state_one_way(p, s.out.state);
    let f = Flow6::of_forwarded(p);
    if let Some(own) = f.own_in_entry(s) {
        own.touch(now, conntrack::next_state(p, own.peek().state));
        out.touch(now, state);
        return Ok(true);
    }
    allocate(ctx, &f, s, state, now)
}

/// Could `p` be the first packet of a connection of the node's own that clashes with a SNATed
/// flow (`tc_egress6` tail-calls the SNAT program for it; [`node_connection`] decides)?
#[inline(always)]
pub fn may_be_node_connection(p: &Packet6) -> bool {
    shares_node_ports(p.proto)
        && p.may_open_flow()
        && u16::from_be_bytes(p.sport) >= SNAT_NODE_PORT_MIN
        && maps::is_node6_addr(&p.saddr)
}

/// The first packet of a connection of the node's own (no `out` entry) whose tuple a live
/// SNATed flow holds: given another source port in `s.out` (`Ok(true)`), as on IPv4. A holder
/// netfilter would let go of gives the tuple up instead (`Ok(false)`: the packet leaves as it
/// is).
#[inline(always)]
pub fn node_connection(
    ctx: &TcContext,
    p: &Packet6,
    s: &mut Snat6Scratch,
    now: u64,
) -> Result<bool, Drop> {
    if !may_be_node_connection(p) {
        return Ok(false);
    }
    let f = Flow6::of_forwarded(p);
    f.set_in_key(&mut s.in_key, &p.saddr, p.sport);
    let Some(holder) = maps::snat6_entry(&s.in_key) else {
        return Ok(false);
    };
    let v = holder.peek();
    if v.addr == p.saddr && v.port == p.sport {
        return Ok(false);
    }
    if snat_port_reclaimable(
        v.last_seen_ns,
        p.proto,
        v.state,
        v.flags,
        now,
        maps::config_ref(),
    ) {
        maps::snat6_remove(&s.in_key);
        return Ok(false);
    }
    stats::count(Counter::SnatNodeConnectionRemapped);
    allocate(ctx, &f, s, conntrack::next_state(p, ct_state::UDP), now)
}

/// Ingress: a remote backend's reply to a SNATed flow passes through its `in` entry (refreshed,
/// moved by the backend's FIN/RST, `SEEN_REPLY` on it and, the first time, on the `out` entry).
#[inline(always)]
pub fn reply_passed(p: &Packet6, inn: &Snat6Entry, client: &Snat6Value, now: u64) {
    let first = !inn.has_flags(ct_flags::SEEN_REPLY);
    inn.touch_flags(
        now,
        conntrack::next_reply_state(p, client.state),
        ct_flags::SEEN_REPLY,
    );
    if first {
        let f = Flow6 {
            client: &client.addr,
            client_port: client.port,
            backend: &p.saddr,
            backend_port: p.sport,
            proto: p.proto,
        };
        if let Some(s) = maps::snat6_scratch() {
            f.set_out_key(&mut s.out_key);
            if let Some(out) = maps::snat6_entry(&s.out_key) {
                out.set_flags(ct_flags::SEEN_REPLY);
            }
        }
    }
}
