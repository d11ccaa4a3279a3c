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
//! Ports are allocated per (node address, backend address/port, protocol), like MASQUERADE: a
//! TCP or UDP flow on the node's address keeps its client's port when that tuple is free, else
//! a bounded walk from a flow-hash start over the whole unprivileged range; other flows (hairpin,
//! a tunnel device's address, SCTP, ICMP) walk the dedicated `SNAT_PORT_MIN..`. A port is claimed
//! by writing its `in` key with `BPF_NOEXIST` (atomic across CPUs), or taken over from a flow that
//! netfilter would let go of (`timeouts::snat_port_reclaimable`: idle, closed, or an unanswered
//! SYN). Both entries live in an LRU map, refreshed by the flow's packets.
//!
//! The node's own sockets share those ports. A port a socket of the node holds toward the same
//! backend (or listens on) is skipped (`local_socket`); a connection the node opens later whose
//! tuple a live SNATed flow holds gets its source port remapped here ([`egress`]), as netfilter's
//! NAT remaps a clashing local connection, so neither is cut.

use aya_ebpf::programs::TcContext;
use proxy_common::{
    Backend, Counter, HAIRPIN_SNAT_ADDR, SNAT_NODE_PORT_MIN, SNAT_PORT_MIN, SNAT_PROBES,
    ServiceValue, SnatKey, SnatValue, backend_flags, ct_dir, ct_flags, ct_state,
    hash::{SnatPorts, flow_hash},
    service_flags, shares_node_ports,
    timeouts::snat_port_reclaimable,
};

use crate::{
    Drop, conntrack, local_socket,
    maps::{self, SnatEntry},
    packet::{self, Packet},
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

/// Can this packet be a reply to a SNATed flow (to a SNAT port of its destination address)?
#[inline(always)]
pub fn may_be_reply(p: &Packet) -> bool {
    may_be_snat(p.dport, || maps::is_node_snat_addr(p.daddr))
}

/// Can `port` (network order) of an address be a SNAT port (both families)? One of the dedicated
/// range on any SNAT source, or an unprivileged port of the node's own address (`on_node_addr`,
/// asked only then).
#[inline(always)]
pub fn may_be_snat(port: [u8; 2], on_node_addr: impl FnOnce() -> bool) -> bool {
    let port = u16::from_be_bytes(port);
    port >= SNAT_PORT_MIN || (port >= SNAT_NODE_PORT_MIN && on_node_addr())
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

/// The ports a flow tries (see `SnatPorts`) and whether they are shared with the node's sockets
/// (each then looked up before it is claimed), both families. `on_node_addr`: the flow is SNATed
/// to the node's own address.
#[inline(always)]
pub fn port_walk(
    hash: u32,
    proto: u8,
    client_port: [u8; 2],
    on_node_addr: bool,
) -> (SnatPorts, bool) {
    (
        SnatPorts::new(hash, proto, u16::from_be_bytes(client_port), on_node_addr),
        on_node_addr && shares_node_ports(proto),
    )
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
pub fn allocate(
    ctx: &TcContext,
    f: &Flow,
    state: u8,
    now: u64,
    device: [u8; 4],
) -> Result<Option<SnatValue>, Drop> {
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
    let (ports, shared) = port_walk(
        hash,
        f.proto,
        f.client_port,
        source != HAIRPIN_SNAT_ADDR && device == NO_DEVICE,
    );
    let mut i = 0;
    while i < SNAT_PROBES {
        let port = ports.port(i).to_be_bytes();
        if shared && local_socket::owns_v4(ctx, f.proto, source, port, f.backend, f.backend_port) {
            stats::count(Counter::SnatPortLocalSocket);
            i += 1;
            continue;
        }
        let in_key = f.in_key(source, port);
        let claimed = maps::snat_claim(&in_key, &client).is_ok()
            || match maps::snat_entry(&in_key) {
                // An idle holder's port: taken over by one CPU only (`claim_idle`), then
                // written as this flow's.
                Some(taken) => {
                    let old = taken.get();
                    snat_port_reclaimable(old.last_seen_ns, f.proto, old.state, old.flags, now, cfg)
                        && taken.claim_idle(old.last_seen_ns, now)
                        && maps::snat_insert(&in_key, &client).is_ok()
                }
                // Evicted between the claim and the lookup: claim it again.
                None => maps::snat_claim(&in_key, &client).is_ok(),
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
            if ports.kept(i) {
                stats::count(Counter::SnatPortKept);
            }
            return Ok(Some(out));
        }
        i += 1;
    }
    Err(Drop::SnatPortsExhausted)
}

/// Egress: the source address and port a packet that is no reply leaves with, if it is SNATed:
/// a forwarded packet whose flow has an `out` entry (its entries refreshed, and re-allocated if
/// its port was reclaimed after a long silence, or if it leaves through a tunnel device whose own
/// address it does not have yet), or the first packet of a connection of the node's own whose
/// tuple a live SNATed flow holds (given another port, see the module docs). `Ok(None)`: the
/// packet leaves as it is.
#[inline(always)]
pub fn egress(ctx: &TcContext, p: &Packet, now: u64) -> Result<Option<SnatValue>, Drop> {
    let f = Flow::of_forwarded(p);
    let (state, device) = match maps::snat_entry(&f.out_key()) {
        Some(out) => {
            let v = out.get();
            // The `out` entry sees only the client's packets.
            let state = conntrack::next_state_one_way(p, v.state);
            let device = maps::snat_device_addr(packet::ifindex(ctx));
            if (device == NO_DEVICE || device == v.addr)
                && let Some(own) = f.own_in_entry(&v)
            {
                // The `in` entry carries the flow (it also saw the backend's FIN): move its own
                // state.
                own.touch(now, conntrack::next_state(p, own.get().state));
                out.touch(now, state);
                return Ok(Some(v));
            }
            (state, device)
        }
        None => {
            if !node_connection_clashes(p, now) {
                return Ok(None);
            }
            stats::count(Counter::SnatNodeConnectionRemapped);
            (conntrack::next_state(p, ct_state::UDP), NO_DEVICE)
        }
    };
    allocate(ctx, &f, state, now, device)
}

/// Is `p` the first packet of a connection of the node's own (from its SNAT address) whose tuple
/// a live SNATed flow holds? A holder netfilter would let go of (closed, idle, an unanswered SYN)
/// gives the tuple up to the node's connection instead.
#[inline(always)]
fn node_connection_clashes(p: &Packet, now: u64) -> bool {
    if !shares_node_ports(p.proto)
        || !p.may_open_flow()
        || u16::from_be_bytes(p.sport) < SNAT_NODE_PORT_MIN
        || !maps::is_node_snat_addr(p.saddr)
    {
        return false;
    }
    let in_key = Flow::of_forwarded(p).in_key(p.saddr, p.sport);
    let Some(holder) = maps::snat_entry(&in_key) else {
        return false;
    };
    let v = holder.get();
    if v.addr == p.saddr && v.port == p.sport {
        return false;
    }
    if snat_port_reclaimable(
        v.last_seen_ns,
        p.proto,
        v.state,
        v.flags,
        now,
        maps::config_ref(),
    ) {
        maps::snat_remove(&in_key);
        return false;
    }
    true
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
