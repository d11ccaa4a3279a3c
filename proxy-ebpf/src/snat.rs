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
//! Also like MASQUERADE, the source is the address of the device the flow leaves by when that is
//! a tunnel device with an address of its own (`SNATDEV_V1`, written by the agent for the tunnel
//! devices it attaches to: flannel.1, vxlan.calico, ...): the backend then answers through the
//! tunnel, where strict reverse-path filtering expects packets from the remote pod CIDR. Ingress
//! runs before routing, so it allocates on the node's SNAT address; the first packet out through
//! such a device moves the flow's port to the device's address (the node port is given back).
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
    SnatKey, SnatValue, backend_flags, ct_dir, ct_flags,
    hash::{PortProbe, flow_hash},
    service_flags,
};

use crate::{
    Drop, conntrack,
    maps::{self, SnatEntry},
    packet::Packet,
    stats,
};

/// Does a new flow from this client to this frontend's backend need SNAT? External flows with
/// eTP=Cluster: to a remote backend always; to a local one when the client is outside the
/// cluster CIDRs (kube-proxy masquerades every flow to such a frontend; pods keep their address
/// here, the backend can answer them directly). And hairpin flows (the client is the backend).
#[inline(always)]
pub fn needed(client: [u8; 4], frontend: &ServiceValue, backend: &Backend) -> bool {
    external_needed(frontend, backend.flags, || maps::in_cluster(client)) || client == backend.addr
}

/// The family-neutral part of [`needed`] (IPv6 too): an external eTP=Cluster frontend's flow to
/// a remote backend, or to a local one from a client outside the cluster CIDRs.
#[inline(always)]
pub fn external_needed(
    frontend: &ServiceValue,
    backend_bits: u8,
    client_in_cluster: impl FnOnce() -> bool,
) -> bool {
    frontend.flags & service_flags::EXTERNAL != 0
        && frontend.flags & service_flags::EXTERNAL_LOCAL == 0
        && (backend_bits & backend_flags::LOCAL == 0 || !client_in_cluster())
}

/// Can this packet be a reply to a SNATed flow (destination port in the SNAT range)?
#[inline(always)]
pub fn may_be_reply(p: &Packet) -> bool {
    is_snat_port(p.dport)
}

/// Is `port` (network order) in the SNAT range (both families)?
#[inline(always)]
pub fn is_snat_port(port: [u8; 2]) -> bool {
    u16::from_be_bytes(port) >= SNAT_PORT_MIN
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

/// `device` of a flow leaving by no device with its own SNAT address (or seen at ingress).
pub const NO_DEVICE: [u8; 4] = [0; 4];

/// The source address a flow is SNATed to: the hairpin address when the client is its own
/// backend, else `device` (the address of the tunnel device it leaves by, when that device has
/// one), else the node's SNAT address (`None` while the agent has not written one).
#[inline(always)]
fn source_addr(f: &Flow, device: [u8; 4]) -> Option<[u8; 4]> {
    if f.client == f.backend {
        return Some(HAIRPIN_SNAT_ADDR);
    }
    if device != NO_DEVICE {
        return Some(device);
    }
    match maps::node() {
        Some(n) if n.snat_addr != [0; 4] => Some(n.snat_addr),
        _ => None,
    }
}

/// Give a flow a source address and port (reusing its entries if they are still its own and on
/// that address; a port it holds on another address is given back). `device`: the SNAT address
/// of the device the flow leaves by (egress), [`NO_DEVICE`] for the node's (ingress, or a device without
/// its own). `Ok(None)`: the node has no SNAT address yet (counted; the flow goes out unSNATed).
#[inline(always)]
pub fn allocate(f: &Flow, state: u8, now: u64, device: [u8; 4]) -> Result<Option<SnatValue>, Drop> {
    let Some(source) = source_addr(f, device) else {
        stats::count(Counter::SnatNoNodeAddr);
        return Ok(None);
    };
    let out_key = f.out_key();
    let mut moved = false;
    if let Some(out) = maps::snat_entry(&out_key) {
        let v = out.get();
        if let Some(own) = f.own_in_entry(&v) {
            if v.addr == source {
                own.touch(now, state);
                out.touch(now, state);
                return Ok(Some(v));
            }
            // Its port on another address (ingress allocates on the node's address before
            // routing picks a tunnel device): free it for other flows.
            maps::snat_remove(&f.in_key(v.addr, v.port));
            moved = device != NO_DEVICE;
        }
    }
    let cfg = maps::config_ref();
    let client = SnatValue {
        last_seen_ns: now,
        addr: f.client,
        port: f.client_port,
        state,
        flags: 0,
    };
    let hash = flow_hash(
        maps::hash_seed(),
        f.client,
        f.backend,
        f.client_port,
        f.backend_port,
        f.proto,
    );
    let probe = PortProbe::new(hash, SNAT_PORT_MIN, SNAT_PORT_MAX);
    let mut i = 0;
    while i < SNAT_PROBES {
        let port = probe.port(i).to_be_bytes();
        let in_key = f.in_key(source, port);
        let claimed = maps::snat_claim(&in_key, &client).is_ok()
            || match maps::snat_entry(&in_key) {
                Some(taken) => {
                    let old = taken.get();
                    conntrack::idle_expired(
                        old.last_seen_ns,
                        f.proto,
                        old.state,
                        old.flags,
                        now,
                        cfg,
                    ) && maps::snat_insert(&in_key, &client).is_ok()
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
            } else if moved {
                Counter::SnatDeviceSource
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
/// entries refreshed (and re-allocated if its port was reclaimed after a long silence, or if it
/// leaves through a tunnel device whose own address `device` it does not have yet).
#[inline(always)]
pub fn forwarded(
    p: &Packet,
    out: SnatEntry,
    now: u64,
    device: [u8; 4],
) -> Result<Option<SnatValue>, Drop> {
    let v = out.get();
    let state = conntrack::next_state(p, v.state);
    let f = Flow::of_forwarded(p);
    if (device == NO_DEVICE || device == v.addr)
        && let Some(own) = f.own_in_entry(&v)
    {
        // The `in` entry carries the flow (it also saw the backend's FIN): move its own state.
        own.touch(now, conntrack::next_state(p, own.get().state));
        out.touch(now, state);
        return Ok(Some(v));
    }
    allocate(&f, state, now, device)
}

/// Ingress: a remote backend's reply to a SNATed flow passes through its `in` entry: refreshed,
/// moved by the backend's FIN/RST, and marked `SEEN_REPLY` (with the flow's `out` entry, on the
/// first reply only: one more lookup per flow).
#[inline(always)]
pub fn reply_passed(p: &Packet, inn: &SnatEntry, client: &SnatValue, now: u64) {
    let first = !inn.has_flags(ct_flags::SEEN_REPLY);
    inn.touch_flags(
        now,
        conntrack::next_reply_state(p, client.state),
        ct_flags::SEEN_REPLY,
    );
    if first {
        let f = Flow {
            client: client.addr,
            client_port: client.port,
            backend: p.saddr,
            backend_port: p.sport,
            proto: p.proto,
        };
        if let Some(out) = maps::snat_entry(&f.out_key()) {
            out.set_flags(ct_flags::SEEN_REPLY);
        }
    }
}
