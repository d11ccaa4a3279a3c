//! SNAT to the node for external traffic (NodePort, externalIP, LoadBalancer frontends with
//! externalTrafficPolicy Cluster) sent to a backend on another node, so that the backend's replies
//! come back through this node and can be reverse-translated; and, like kube-proxy's masquerade,
//! for such traffic from outside the cluster CIDRs to a local backend too.
//!
//! Like netfilter's MASQUERADE it sits after routing: tc ingress DNATs (conntrack) and allocates
//! the node port, tc egress rewrites the forwarded packet's source to the node; a reply arriving on
//! ingress gets its destination put back to the client, and tc egress toward the client then does
//! the usual reverse DNAT. Neither rewrite makes the kernel see one of its own addresses as a
//! source on input (which it drops as martian).
//!
//! Hairpin flows (a pod sent to a Service and was picked as its own backend) take the same path
//! with the link-local `HAIRPIN_SNAT_ADDR` as source: the pod could not accept a packet from its
//! own address, and answers the link-local address through its default route to the node.
//!
//! Ports are allocated per (node address, backend address/port, protocol): a bounded probe from a
//! flow-hash start claims a free `in` key with `BPF_NOEXIST` (atomic across CPUs), or reclaims one
//! whose flow has been idle past its conntrack timeout. Both entries live in an LRU map, refreshed
//! by the flow's packets.

use proxy_common::{
    Backend, Counter, HAIRPIN_SNAT_ADDR, SNAT_PORT_MAX, SNAT_PORT_MIN, SNAT_PROBES, ServiceValue,
    SnatKey, SnatValue, backend_flags, ct_dir, ct_state, hash::flow_hash, service_flags,
};

use crate::{
    Drop, conntrack,
    maps::{self, SnatEntry},
    packet::Packet,
    stats,
};

const PORT_RANGE: u32 = (SNAT_PORT_MAX - SNAT_PORT_MIN) as u32 + 1;

/// Does a new flow from this client to this frontend's backend need SNAT? External flows with
/// eTP=Cluster: to a remote backend always; to a local one when the client is outside the
/// cluster CIDRs (kube-proxy masquerades every flow to such a frontend; pods keep their address
/// here, the backend can answer them directly). And hairpin flows (the client is the backend).
#[inline(always)]
pub fn needed(client: [u8; 4], frontend: &ServiceValue, backend: &Backend) -> bool {
    (frontend.flags & service_flags::EXTERNAL != 0
        && frontend.flags & service_flags::EXTERNAL_LOCAL == 0
        && (backend.flags & backend_flags::LOCAL == 0 || !maps::in_cluster(client)))
        || client == backend.addr
}

/// Can this packet be a reply to a SNATed flow (destination port in the SNAT range)?
#[inline(always)]
pub fn may_be_reply(p: &Packet) -> bool {
    u16::from_be_bytes(p.dport) >= SNAT_PORT_MIN
}

/// A flow after DNAT: client → backend.
pub struct Flow {
    pub client: [u8; 4],
    pub client_port: [u8; 2],
    pub backend: [u8; 4],
    pub backend_port: [u8; 2],
    pub proto: u8,
}

impl Flow {
    /// The forwarded packet as egress sees it (client → backend).
    #[inline(always)]
    pub fn of_forwarded(p: &Packet) -> Self {
        Self {
            client: p.saddr,
            client_port: p.sport,
            backend: p.daddr,
            backend_port: p.dport,
            proto: p.proto,
        }
    }

    #[inline(always)]
    fn out_key(&self) -> SnatKey {
        SnatKey {
            saddr: self.client,
            daddr: self.backend,
            sport: self.client_port,
            dport: self.backend_port,
            proto: self.proto,
            dir: ct_dir::ORIGINAL,
            _pad: [0; 2],
        }
    }

    #[inline(always)]
    fn in_key(&self, node: [u8; 4], port: [u8; 2]) -> SnatKey {
        SnatKey {
            saddr: self.backend,
            daddr: node,
            sport: self.backend_port,
            dport: port,
            proto: self.proto,
            dir: ct_dir::REPLY,
            _pad: [0; 2],
        }
    }

    /// The `in` entry of `out`, if it still belongs to this flow (not reclaimed by another).
    #[inline(always)]
    fn own_in_entry(&self, out: &SnatValue) -> Option<SnatEntry> {
        let entry = maps::snat_entry(&self.in_key(out.addr, out.port))?;
        let v = entry.get();
        (v.addr == self.client && v.port == self.client_port).then_some(entry)
    }
}

/// The `in` key of a packet arriving on ingress (backend → node address:port).
#[inline(always)]
pub fn in_key_of_reply(p: &Packet) -> SnatKey {
    SnatKey {
        saddr: p.saddr,
        daddr: p.daddr,
        sport: p.sport,
        dport: p.dport,
        proto: p.proto,
        dir: ct_dir::REPLY,
        _pad: [0; 2],
    }
}

/// The `out` key of a packet leaving on egress (client → backend).
#[inline(always)]
pub fn out_key_of_forwarded(p: &Packet) -> SnatKey {
    Flow::of_forwarded(p).out_key()
}

/// The source address a flow is SNATed to: the hairpin address when the client is its own
/// backend, else the node's SNAT address (`None` while the agent has not written one).
#[inline(always)]
fn source_addr(f: &Flow) -> Option<[u8; 4]> {
    if f.client == f.backend {
        return Some(HAIRPIN_SNAT_ADDR);
    }
    match maps::node() {
        Some(n) if n.snat_addr != [0; 4] => Some(n.snat_addr),
        _ => None,
    }
}

/// Give a flow a source address and port (reusing its entries if they are still its own).
/// `Ok(None)`: the node has no SNAT address yet (counted; the flow goes out unSNATed).
#[inline(always)]
pub fn allocate(f: &Flow, state: u8, now: u64) -> Result<Option<SnatValue>, Drop> {
    let Some(source) = source_addr(f) else {
        stats::count(Counter::SnatNoNodeAddr);
        return Ok(None);
    };
    let out_key = f.out_key();
    if let Some(out) = maps::snat_entry(&out_key) {
        let v = out.get();
        if v.addr == source
            && let Some(own) = f.own_in_entry(&v)
        {
            own.touch(now, state);
            out.touch(now, state);
            return Ok(Some(v));
        }
    }
    let cfg = maps::config();
    let client = SnatValue {
        last_seen_ns: now,
        addr: f.client,
        port: f.client_port,
        state,
        _pad: 0,
    };
    let hash = flow_hash(f.client, f.backend, f.client_port, f.backend_port, f.proto);
    let start = ((hash as u64 * PORT_RANGE as u64) >> 32) as u32;
    let mut i = 0;
    while i < SNAT_PROBES {
        let mut off = start + i;
        if off >= PORT_RANGE {
            off -= PORT_RANGE;
        }
        let port = ((SNAT_PORT_MIN as u32 + off) as u16).to_be_bytes();
        let in_key = f.in_key(source, port);
        let claimed = maps::snat_claim(&in_key, &client).is_ok()
            || match maps::snat_entry(&in_key) {
                Some(taken) => {
                    let old = taken.get();
                    conntrack::idle_expired(old.last_seen_ns, f.proto, old.state, now, &cfg)
                        && maps::snat_insert(&in_key, &client).is_ok()
                }
                // Evicted between the claim and the lookup: take it.
                None => maps::snat_insert(&in_key, &client).is_ok(),
            };
        if claimed {
            let out = SnatValue {
                addr: source,
                port,
                ..client
            };
            if maps::snat_insert(&out_key, &out).is_err() {
                maps::snat_remove(&in_key);
                return Err(Drop::ConntrackFull);
            }
            stats::count(if source == HAIRPIN_SNAT_ADDR {
                Counter::HairpinSnat
            } else {
                Counter::SnatNew
            });
            return Ok(Some(out));
        }
        i += 1;
    }
    Err(Drop::SnatPortsExhausted)
}

/// Egress: the node address and port of a forwarded packet whose flow has an `out` entry, its
/// entries refreshed (and re-allocated if its port was reclaimed after a long silence).
#[inline(always)]
pub fn forwarded(p: &Packet, out: SnatEntry, now: u64) -> Result<Option<SnatValue>, Drop> {
    let v = out.get();
    let state = conntrack::next_state(p, v.state);
    let f = Flow::of_forwarded(p);
    if let Some(own) = f.own_in_entry(&v) {
        let in_state = if own.get().state == ct_state::CLOSING {
            ct_state::CLOSING
        } else {
            state
        };
        own.touch(now, in_state);
        out.touch(now, state);
        return Ok(Some(v));
    }
    allocate(&f, state, now)
}
