//! Map keys, values, names and capacities.
//!
//! Shapes follow cilium's lb4 maps: a service is a set of entries in `SERVICES` keyed by
//! {vip, port, proto, scope, slot}; slot 0 is the frontend (how many backends, which rev-NAT id),
//! slots 1..=count name backend ids. The agent writes backends → slots → frontend, and shrinks in
//! the reverse order, so the datapath never follows a slot that does not exist.

use bytemuck::{Pod, Zeroable};

/// Map names carry the layout version (kernel map names are at most 15 bytes).
pub const MAP_SERVICES: &str = "SERVICES_V1";
pub const MAP_BACKENDS: &str = "BACKENDS_V1";
pub const MAP_REVNAT: &str = "REVNAT_V1";
pub const MAP_CONNTRACK: &str = "CONNTRACK_V1";
pub const MAP_STATS: &str = "STATS_V1";
pub const MAP_SNAT: &str = "SNAT_V1";
pub const MAP_NODE: &str = "NODE_V1";
pub const MAP_SOURCE_RANGES: &str = "SRCRANGES_V1";
pub const MAP_SOCK_REVNAT: &str = "SOCKREV_V1";
/// `SOCKPICK_V1` (LRU hash, [`SockPickKey`] → [`SockPickValue`]): the backend each unconnected
/// UDP socket of the node's was last sent to per frontend, both families.
pub const MAP_SOCK_PICK: &str = "SOCKPICK_V1";
/// `SEED_V1` (array, one `u32` at index 0): the node's flow hash seed, drawn at random by the
/// first agent and pinned so a restarted agent loads its programs with the same one. The datapath
/// reads the seed from `DatapathConfig::hash_seed` (no lookup per packet), never from this map.
pub const MAP_SEED: &str = "SEED_V1";
pub const MAP_SERVICE_CIDRS: &str = "SVCCIDRS_V1";
/// `FRONTGEN_V1` (array, one `u32` at index 0): the frontend generation, which the agent moves
/// on after every sync that adds a frontend (a ClusterIP, NodePort, externalIP or LB IP port)
/// or gives one its first endpoint. A direct flow (`ct_flags::DIRECT`) keeps in its
/// `CtValue::backend_id` the generation it was last checked at; a packet of it seen under
/// another generation looks its destination up once more, so a flow that began before its
/// destination was a Service frontend is translated from its next packet (a TCP connection
/// already established keeps going straight, as netfilter keeps its NAT decision).
pub const MAP_FRONTEND_GEN: &str = "FRONTGEN_V1";
/// `MAGLEV_V1` (hash without preallocation, `crate::maglev::MaglevKey` → `crate::maglev::Chunk`):
/// the Maglev lookup tables, only for the backend sets of frontends whose scheduler is `mh`.
pub const MAP_MAGLEV: &str = "MAGLEV_V1";
pub const MAP_SNAT_DEVICES: &str = "SNATDEV_V1";
pub const MAP_FRAGMENTS: &str = "FRAGMENTS_V1";
/// `AFFINITY_V1` (LRU hash): session affinity records, client → backend per Service port.
pub const MAP_AFFINITY: &str = "AFFINITY_V1";
/// `AFFMATCH_V1` (hash): which backends each affinity frontend may send a recorded client to.
pub const MAP_AFFINITY_MATCH: &str = "AFFMATCH_V1";
/// `LCFLOWS_V1` (array, index: backend id, value: `u64`): datapath-owned count of the translated
/// flows to each backend that are not over yet (`ct_flags::COUNTED`), for the least-connection
/// scheduler (`crate::lc`).
pub const MAP_LC_FLOWS: &str = "LCFLOWS_V1";
/// `LCADJ_V1` (array, index: backend id, value: `u64`): agent-owned correction of `LCFLOWS_V1`
/// for the flows whose end the datapath cannot see (idle expiry, LRU eviction): the effective
/// count is `LCFLOWS_V1[id] - LCADJ_V1[id]` (`crate::lc::effective`).
pub const MAP_LC_ADJUST: &str = "LCADJ_V1";
/// Datapath-internal scratch space (per-CPU, one [`FragRecord`]), not pinned: the agent never
/// reads it and a new program may start with a fresh one.
pub const MAP_FRAG_SCRATCH: &str = "FRAGSCRATCH";

/// The pin directory's layout marker: a two-entry `u32` array (`[0]` the layout of the pins,
/// `[1]` the oldest layout whose agents can use them) that the agent creates and pins beside the
/// maps. Not in the object (no program reads it) and not versioned in its name: every release
/// reads it before it adopts anything.
pub const MAP_LAYOUT: &str = "LAYOUT";
/// The layout of the pinned maps this release reads and writes: their names, types, keys and
/// values. Raise it (with a migration in the agent's `dataplane::layout`) when a pinned map's
/// key or value changes. Pins without a marker (releases before it) are layout 1.
pub const LAYOUT_VERSION: u32 = 1;
/// The oldest layout whose agents can run on pins of [`LAYOUT_VERSION`]: a layout that only adds
/// maps keeps it (an older agent ignores them), one that changes a map raises it to itself.
pub const LAYOUT_OLDEST_READER: u32 = 1;

/// All maps the agent pins and adopts.
pub const ALL_MAPS: [&str; 35] = [
    crate::MAP_TAIL_CALLS,
    MAP_SERVICES,
    MAP_BACKENDS,
    MAP_REVNAT,
    MAP_CONNTRACK,
    MAP_STATS,
    MAP_SNAT,
    MAP_NODE,
    MAP_SOURCE_RANGES,
    MAP_SOCK_REVNAT,
    MAP_SOCK_PICK,
    MAP_FRAGMENTS,
    MAP_SNAT_DEVICES,
    MAP_SEED,
    MAP_SERVICE_CIDRS,
    MAP_AFFINITY,
    MAP_AFFINITY_MATCH,
    MAP_LC_FLOWS,
    MAP_LC_ADJUST,
    MAP_MAGLEV,
    crate::ipv6::MAP_SERVICES6,
    crate::ipv6::MAP_BACKENDS6,
    crate::ipv6::MAP_REVNAT6,
    crate::ipv6::MAP_CONNTRACK6,
    crate::ipv6::MAP_FRAGMENTS6,
    crate::ipv6::MAP_SOURCE_RANGES6,
    crate::ipv6::MAP_AFFINITY6,
    crate::ipv6::MAP_AFFINITY_MATCH6,
    crate::ipv6::MAP_SERVICE_CIDRS6,
    crate::ipv6::MAP_CLUSTER_CIDRS6,
    crate::ipv6::MAP_SOCK_REVNAT6,
    crate::ipv6::MAP_SNAT6,
    crate::ipv6::MAP_NODE6,
    crate::presence::MAP_AGENT,
    MAP_FRONTEND_GEN,
];

/// Default capacities compiled into the object; the agent may resize at load time
/// (`EbpfLoader::map_max_entries`) before the maps are first created.
pub const SERVICES_CAPACITY: u32 = 262_144;
pub const BACKENDS_CAPACITY: u32 = 131_072;
pub const REVNAT_CAPACITY: u32 = 65_536;
pub const CONNTRACK_CAPACITY: u32 = 262_144;
/// Two entries per SNATed flow (out and in).
pub const SNAT_CAPACITY: u32 = 131_072;
/// loadBalancerSourceRanges prefixes, over all LoadBalancer frontends.
pub const SOURCE_RANGES_CAPACITY: u32 = 16_384;
/// Sockets of the node's own network namespace translated at connect()/sendmsg(): one entry per
/// (socket, backend), LRU-evicted (socket cookies are never reused, so old entries are inert).
pub const SOCK_REVNAT_CAPACITY: u32 = 131_072;
/// Unconnected UDP sockets of the node's own namespace and the frontends they send to, one
/// entry per pair, LRU-evicted (an evicted socket's next datagram is picked afresh).
pub const SOCK_PICK_CAPACITY: u32 = 32_768;
/// Fragmented datagrams in flight whose first fragment was seen (per hook), LRU-evicted: like
/// cilium's `CILIUM_IPV4_FRAG_MAP_MAX_ENTRIES`.
pub const FRAGMENTS_CAPACITY: u32 = 8_192;
/// Tunnel devices with their own SNAT source address (one entry per attached tunnel device).
pub const SNAT_DEVICES_CAPACITY: u32 = 256;
/// Service CIDR prefixes and allocated ClusterIPs (one /32 each); an LPM trie takes memory only
/// for the entries it holds.
pub const SERVICE_CIDRS_CAPACITY: u32 = 131_072;
/// Session affinity records (client, Service port), LRU-evicted: cilium's
/// `CILIUM_LB4_AFFINITY_MAP_MAX_ENTRIES` default. `--affinity-max-entries` at load time.
pub const AFFINITY_CAPACITY: u32 = 65_536;
/// Affinity match entries: at most one per backend slot of an affinity frontend, so the agent
/// sizes this map like `SERVICES_V1` (this is the compiled-in default, equal to it).
pub const AFFINITY_MATCH_CAPACITY: u32 = SERVICES_CAPACITY;
/// Entries of `LCFLOWS_V1` and `LCADJ_V1` compiled into the object: one per backend id (ids are
/// the smallest free ≥ 1, so they stay ≤ the BACKENDS capacity). The agent creates them with
/// `max(BACKENDS entries, BACKENDS_CAPACITY) + 1`.
pub const LC_CAPACITY: u32 = BACKENDS_CAPACITY + 1;
/// `MAGLEV_V1` chunks (`maglev::CHUNK_ENTRIES` entries each): 16,384 tables at the default M
/// (18 chunks), 2,152 at the largest. Without preallocation only the hash buckets (16 bytes per
/// entry of capacity, 4.5 MiB) are taken up front; each chunk present costs 2 KiB.
pub const MAGLEV_CAPACITY: u32 = 294_912;

/// `SVCCIDRS_V1` (LPM trie; key data: an IPv4 address, network order) values: what a new flow
/// to an address that is no frontend (no `SERVICES` entry for its port) meets, like upstream
/// nftables' cluster-ips-check. The longest prefix wins, so a ClusterIP's /32 beats its CIDR.
pub mod service_cidr {
    /// Inside a Service CIDR (ServiceCIDR objects, `--service-cidr`) and no Service's: dropped.
    pub const UNALLOCATED: u32 = 1;
    /// An allocated ClusterIP (/32), on a port that is none of its Services': rejected.
    pub const CLUSTER_IP: u32 = 2;
}

/// Largest number of backends one frontend can have (slots are u16; kept well below to bound the
/// number of map entries one Service can take).
pub const MAX_BACKENDS_PER_SERVICE: u16 = 16_384;

/// Service key scope: which traffic a frontend entry serves.
///
/// `SCOPE_EXTERNAL`: every frontend has this entry, and it serves all traffic unless an
/// in-cluster entry takes over.
pub const SCOPE_EXTERNAL: u8 = 0;
/// `SCOPE_INTERNAL`: only for an external frontend (NodePort/externalIP/LoadBalancer IP) with
/// externalTrafficPolicy Local (`EXTERNAL_LOCAL`): the same address/port/protocol with the
/// Service's cluster-wide endpoints, used for clients inside the cluster (sources in the
/// clusterCIDR, the node itself) instead of the local-only entry. kube-proxy's "short-circuit"
/// (KUBE-EXT-*: pod and node traffic jumps to KUBE-SVC-*). It carries no `EXTERNAL` flag: like
/// upstream, which does not masquerade pod traffic there, it is handled like a ClusterIP (the
/// backend sees the pod; the node's own connections come from the node's address anyway).
pub const SCOPE_INTERNAL: u8 = 1;

#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Default, Pod, Zeroable)]
pub struct ServiceKey {
    /// Frontend address (network order).
    pub addr: [u8; 4],
    /// Frontend port (network order).
    pub port: [u8; 2],
    /// IP protocol (`proto::TCP`/`proto::UDP`).
    pub proto: u8,
    /// `SCOPE_*`.
    pub scope: u8,
    /// 0 = the frontend entry; 1..=count = backend slots.
    pub slot: u16,
    pub _pad: [u8; 2],
}
const _: () = assert!(core::mem::size_of::<ServiceKey>() == 12);

impl ServiceKey {
    pub const fn new(addr: [u8; 4], port: [u8; 2], proto: u8, slot: u16) -> Self {
        Self {
            addr,
            port,
            proto,
            scope: SCOPE_EXTERNAL,
            slot,
            _pad: [0; 2],
        }
    }

    /// The same frontend, another slot.
    pub const fn with_slot(self, slot: u16) -> Self {
        Self { slot, ..self }
    }
}

/// Service flags (`ServiceValue::flags`).
pub mod service_flags {
    /// Session affinity (ClientIP): new flows of a client go to the endpoint recorded for it under
    /// `ServiceValue::affinity_id` while it is usable here and its last use is within
    /// `ServiceValue::affinity_timeout_s`.
    pub const AFFINITY: u16 = 1 << 0;
    /// A NodePort, externalIP or LoadBalancer frontend: with externalTrafficPolicy Cluster, flows
    /// to a backend on another node are SNATed to the node's address (`NODE_V1`).
    pub const EXTERNAL: u16 = 1 << 1;
    /// externalTrafficPolicy Local: never SNAT (the backend sees the client).
    pub const EXTERNAL_LOCAL: u16 = 1 << 2;
    /// A LoadBalancer frontend with loadBalancerSourceRanges: new flows from sources outside
    /// its prefixes in `SRCRANGES_V1` are dropped.
    pub const SOURCE_RANGES: u16 = 1 << 3;
    /// No backends (`count == 0`) means drop, not reject: a Local traffic policy (internal for a
    /// ClusterIP, external for a NodePort/externalIP/LoadBalancer frontend) whose Service has
    /// usable endpoints on other nodes but none here (upstream's "drop" filter verdict; the load
    /// balancer's health check steers external clients away). Without it, `count == 0` means no
    /// usable endpoint anywhere and new flows are rejected (ICMP port unreachable), for every
    /// policy. The agent sets it only while the frontend has no backends.
    pub const DROP_WHEN_EMPTY: u16 = 1 << 4;
}

/// Value of a `SERVICES` entry. For slot 0 (frontend): everything but `backend_id` (0). For
/// slots ≥ 1: only `backend_id`.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default, Pod, Zeroable)]
pub struct ServiceValue {
    pub backend_id: u32,
    /// Number of backend slots (frontend entry only). 0 = no endpoints: the datapath rejects (or
    /// drops, with `service_flags::DROP_WHEN_EMPTY`).
    pub count: u16,
    pub flags: u16,
    pub rev_nat_id: u32,
    /// Session affinity timeout (seconds since the client's last new flow), with
    /// `service_flags::AFFINITY`.
    pub affinity_timeout_s: u32,
    /// Session affinity scope: one id per Service port, shared by all that port's frontends
    /// (ClusterIP, NodePort, externalIPs, LB IPs), as kube-proxy's per-endpoint records are.
    /// 0 without affinity.
    pub affinity_id: u32,
    /// Maglev lookup table of this frontend's backend set (`sched::code::MAGLEV`); 0 = none.
    pub maglev_table: u32,
    /// Round-robin position: datapath-owned (atomically incremented by each new flow of a
    /// `sched::code::ROUND_ROBIN` frontend). The agent writes 0 and ignores it when comparing.
    pub rr_next: u32,
    /// `sched::code::*`.
    pub scheduler: u8,
    pub _pad: [u8; 3],
}
const _: () = assert!(core::mem::size_of::<ServiceValue>() == 32);

impl ServiceValue {
    /// A frontend entry with `service_flags` bits.
    pub const fn frontend_with_flags(count: u16, rev_nat_id: u32, flags: u16) -> Self {
        Self {
            flags,
            ..Self::frontend(count, rev_nat_id)
        }
    }

    pub const fn frontend(count: u16, rev_nat_id: u32) -> Self {
        Self {
            backend_id: 0,
            count,
            flags: 0,
            rev_nat_id,
            affinity_timeout_s: 0,
            affinity_id: 0,
            maglev_table: 0,
            rr_next: 0,
            scheduler: crate::sched::code::RANDOM,
            _pad: [0; 3],
        }
    }

    pub const fn slot(backend_id: u32) -> Self {
        Self {
            backend_id,
            ..Self::frontend(0, 0)
        }
    }

    /// The same entry as the agent compares it: without the datapath-owned `rr_next`.
    pub const fn as_programmed(self) -> Self {
        Self { rr_next: 0, ..self }
    }
}

/// Backend flags (`Backend::flags`).
pub mod backend_flags {
    /// The endpoint is terminating (kept so established flows finish).
    pub const TERMINATING: u8 = 1 << 0;
    /// The endpoint runs on this node.
    pub const LOCAL: u8 = 1 << 1;
    /// The endpoint is still listed in an EndpointSlice of every Service that uses this id, but
    /// none of them serves it (not ready, and not serving-terminating): it is in no slot table,
    /// Maglev table or affinity match, so no new flow picks it; the entry stays so that its
    /// established TCP and SCTP flows go on, as netfilter keeps their conntrack entries, while
    /// its UDP flows are re-picked, as upstream clears UDP conntrack for non-serving endpoints
    /// ([`keeps_flow`]). Set only when no Service listing the endpoint serves it.
    pub const NOT_SERVING: u8 = 1 << 2;

    /// May a tracked flow of protocol `proto` (the backend's own) go on to a backend with
    /// `flags`? Yes unless the backend is [`NOT_SERVING`] and the flow is UDP. One flag test on
    /// the value the datapath already read to revalidate the flow.
    #[inline(always)]
    pub const fn keeps_flow(flags: u8, proto: u8) -> bool {
        flags & NOT_SERVING == 0 || proto != crate::proto::UDP
    }
}

/// `BACKENDS`: backend id (u32, ids start at 1; 0 = none) → where to send.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default, Pod, Zeroable)]
pub struct Backend {
    pub addr: [u8; 4],
    pub port: [u8; 2],
    pub proto: u8,
    pub flags: u8,
}
const _: () = assert!(core::mem::size_of::<Backend>() == 8);

/// `REVNAT`: rev-NAT id (u32, from 1) → the frontend a reply must appear to come from.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default, Pod, Zeroable)]
pub struct RevNat {
    pub addr: [u8; 4],
    pub port: [u8; 2],
    pub _pad: [u8; 2],
}
const _: () = assert!(core::mem::size_of::<RevNat>() == 8);

/// Conntrack direction (`CtKey::dir`).
pub mod ct_dir {
    /// Client → frontend, keyed as the packet arrives (before DNAT).
    pub const ORIGINAL: u8 = 0;
    /// Backend → client, keyed as the reply leaves (before reverse NAT).
    pub const REPLY: u8 = 1;
}

/// `CONNTRACK` (LRU hash) key: the full 5-tuple plus direction.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default, Pod, Zeroable)]
pub struct CtKey {
    pub saddr: [u8; 4],
    pub daddr: [u8; 4],
    pub sport: [u8; 2],
    pub dport: [u8; 2],
    pub proto: u8,
    pub dir: u8,
    pub _pad: [u8; 2],
}
const _: () = assert!(core::mem::size_of::<CtKey>() == 16);

/// TCP/UDP flow states (`CtValue::state`, `SnatValue::state`). Transitions:
/// [`crate::flow_state`].
pub mod ct_state {
    /// UDP flow (no states).
    pub const UDP: u8 = 0;
    /// TCP: the client's SYN seen, no answer yet.
    pub const SYN_SENT: u8 = 1;
    /// TCP: handshake finished (SYN, SYN-ACK, ACK; or a flow first seen mid-connection, which
    /// netfilter picks up as established too).
    pub const ESTABLISHED: u8 = 2;
    /// TCP: closed: a FIN seen from both sides, or a RST (transitory timeout).
    pub const CLOSING: u8 = 3;
    /// TCP: half-closed by the client (its FIN seen, none from the backend yet): the backend
    /// may still send (netfilter's FIN_WAIT/CLOSE_WAIT, kube-proxy's `tcpCloseWaitTimeout`).
    pub const FIN_ORIGINAL: u8 = 4;
    /// TCP: half-closed by the backend (its FIN seen, none from the client yet).
    pub const FIN_REPLY: u8 = 5;
    /// TCP: the backend answered the SYN with a SYN-ACK; the client's ACK not seen yet.
    pub const SYN_RECV: u8 = 6;
}

/// `CONNTRACK` value. ORIGINAL entries: `backend_*` is where the flow is sent, `frontend_*` the
/// VIP:port the client used. REPLY entries: the same pair, used to rewrite the reply's source.
/// `backend_id` + the backend address snapshot let the datapath revalidate: if `BACKENDS[id]` is
/// gone or now names another address, the flow is stale.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default, Pod, Zeroable)]
pub struct CtValue {
    /// `bpf_ktime_get_ns()` (CLOCK_MONOTONIC) of the last packet.
    pub last_seen_ns: u64,
    /// When the entry was created (CLOCK_MONOTONIC ns).
    pub created_ns: u64,
    pub backend_id: u32,
    pub rev_nat_id: u32,
    pub frontend_addr: [u8; 4],
    pub backend_addr: [u8; 4],
    pub frontend_port: [u8; 2],
    pub backend_port: [u8; 2],
    /// `ct_state::*`.
    pub state: u8,
    /// `ct_flags::*`.
    pub flags: u8,
    /// With `ct_flags::SPORT_NAT` (a reply-tuple clash resolved by a new source port): in the
    /// ORIGINAL entry, the source port the client's packets leave with (= the REPLY key's
    /// destination port); in the REPLY entry, the client's own port, which replies go back to.
    /// Zero otherwise.
    pub nat_sport: [u8; 2],
}
const _: () = assert!(core::mem::size_of::<CtValue>() == 40);

/// Conntrack entry flags (`CtValue::flags`).
pub mod ct_flags {
    /// The backend has answered at least once (UDP: with activity more than 2 s after the flow
    /// began, a stream, with netfilter's `udpStreamTimeout` instead of `udpTimeout`:
    /// `timeouts::flow_idle_expired`; a SNAT entry, without a start time, at once).
    pub const SEEN_REPLY: u8 = 1 << 0;
    /// The flow's source port is translated too (`CtValue::nat_sport`): a reply-tuple clash was
    /// resolved like netfilter does, by giving the new flow another source port.
    pub const SPORT_NAT: u8 = 1 << 1;
    /// A flow straight to an address that is no Service frontend (a pod reached directly): no
    /// address translation. Tracked only as an ORIGINAL entry (`frontend_* == backend_*`,
    /// `backend_id` the frontend generation it was checked at: `MAP_FRONTEND_GEN`), so that no translated flow is given its reply tuple; with `SPORT_NAT`
    /// (it started while a translated flow held its reply tuple) it has a REPLY entry too.
    pub const DIRECT: u8 = 1 << 2;
    /// The flow holds one unit of its backend's `LCFLOWS_V1` count: set when a translated flow
    /// is created (on both entries), cleared on the ORIGINAL entry (atomically, with the unit
    /// given back) when the datapath sees the flow end (TCP close, replacement, removal). The
    /// REPLY entry's copy only carries it over when an evicted ORIGINAL entry is written again.
    pub const COUNTED: u8 = 1 << 3;
    /// A REPLY entry kept after its flow ended and a new connection reopened the flow's ORIGINAL
    /// tuple (a SYN on a closing flow) and was sent elsewhere: it translates nothing and only
    /// holds the reply tuple until it idles out as a closing flow, because the old backend may
    /// still hold that connection in TIME_WAIT (Linux: 60 s). Another flow given the tuple now,
    /// with its own ISN and timestamp offset (the client derives them from the frontend address),
    /// would meet that TIME_WAIT socket: its SYN PAWS-rejected, the connection delayed or lost.
    pub const RETIRED: u8 = 1 << 4;
    /// A flow taken over from netfilter's NAT (kube-proxy's rules) that netfilter still
    /// translates with its own conntrack entry: its client packets (and, on a SNAT `in` entry,
    /// its replies arriving on ingress) pass untouched and only keep the entries fresh. Replies
    /// that reach tc egress untranslated (netfilter's entry is gone) are translated as usual.
    pub const NETFILTER: u8 = 1 << 5;
    /// A taken-over flow moving from netfilter to the datapath while the agent deletes
    /// netfilter's entry: the packets `NETFILTER` would pass are dropped for those microseconds
    /// (netfilter must not see them without its entry, or rules still there would start the
    /// flow anew).
    pub const HANDOFF: u8 = 1 << 6;
}

/// Source ports a flow may be moved to when its reply tuple clashes (netfilter's range for
/// ports ≥ 1024).
pub const CLASH_PORT_MIN: u16 = 1_024;
pub const CLASH_PORT_MAX: u16 = 65_535;
/// How many ports a clashing flow tries before it is dropped (`drop_reply_tuple_exhausted`).
pub const CLASH_PROBES: u32 = 16;

/// SNAT source ports of TCP and UDP flows on the node's own address: the client's port when the
/// translated tuple is free, else a walk over `SNAT_NODE_PORT_MIN..=SNAT_PORT_MAX` (as
/// MASQUERADE: the whole unprivileged range). The node's sockets share these ports: a port a
/// local socket holds toward the backend (or listens on) is skipped, and a later connection of
/// the node that would clash with a live SNATed flow has its own source port remapped.
pub const SNAT_NODE_PORT_MIN: u16 = 1_024;
/// SNAT source ports of everything else (hairpin flows, a tunnel device's address, SCTP and
/// ICMP): above Linux's default ephemeral range 32768-60999, where no socket lookup is needed.
pub const SNAT_PORT_MIN: u16 = 61_000;
pub const SNAT_PORT_MAX: u16 = 65_535;
/// How long an unanswered TCP SYN holds its SNAT port against a new flow (netfilter holds the
/// tuple of a SYN_SENT flow 120 s; a SYN flood to a NodePort would then exhaust the ports).
pub const SNAT_UNANSWERED_SYN_HOLD_S: u64 = 5;
/// Source of hairpin flows (a pod sent to a Service and was picked as its own backend): the pod
/// cannot accept a packet from its own address, so such flows are SNATed to this link-local
/// address (pods reach it through their default route to the node).
pub const HAIRPIN_SNAT_ADDR: [u8; 4] = [169, 254, 0, 1];
/// How many ports a new flow tries before it is dropped (`drop_snat_ports_exhausted`).
pub const SNAT_PROBES: u32 = 32;

/// `SNAT_V1` (LRU hash) key: a `CtKey`-shaped tuple.
/// - `ct_dir::ORIGINAL` ("out"): the forwarded packet after DNAT, client → backend, as tc egress
///   sees it; the value is the node address and port it leaves with.
/// - `ct_dir::REPLY` ("in"): the backend's reply, backend → node address:port, as tc ingress sees
///   it; the value is the client address and port it goes back to. Its key is what port
///   allocation must keep unique: (node addr, port, proto, backend addr/port).
pub type SnatKey = CtKey;

/// `SNAT_V1` value.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default, Pod, Zeroable)]
pub struct SnatValue {
    /// CLOCK_MONOTONIC ns of the last packet through this entry.
    pub last_seen_ns: u64,
    /// Translated address/port (out: node address/port; in: client address/port).
    pub addr: [u8; 4],
    pub port: [u8; 2],
    /// `ct_state::*` (CLOSING after a FIN/RST: expires on the transitory timeout).
    pub state: u8,
    /// `ct_flags::SEEN_REPLY` once the backend has answered (the `in` entry and the `out` entry
    /// get it with the first reply); other bits unused.
    pub flags: u8,
}
const _: () = assert!(core::mem::size_of::<SnatValue>() == 16);

/// `NODE_V1` (array, one entry at index 0): dynamic facts about the node, written by the agent.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default, Pod, Zeroable)]
pub struct NodeInfo {
    /// Source address for SNATed flows (0.0.0.0 = none known: such flows go out unSNATed and are
    /// counted as `snat_no_node_addr`).
    pub snat_addr: [u8; 4],
    pub flags: u32,
}
const _: () = assert!(core::mem::size_of::<NodeInfo>() == 8);

/// `SNATDEV_V1` (hash, key: ifindex as `u32`) value: the source address of SNATed flows that leave
/// through this device, like MASQUERADE's choice of the outgoing device's address. The agent
/// writes one entry per attached tunnel device that has an IPv4 address (flannel.1,
/// vxlan.calico, ...): the backend's replies then come back through the tunnel, which strict
/// reverse-path filtering requires. Devices without an entry use `NodeInfo::snat_addr`.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default, Pod, Zeroable)]
pub struct SnatDevice {
    pub addr: [u8; 4],
}
const _: () = assert!(core::mem::size_of::<SnatDevice>() == 4);

/// Bits of [`SourceRangeKey`] that name the frontend (matched exactly); the source prefix length
/// is added to them to make the LPM prefix length.
pub const SOURCE_RANGE_FRONTEND_BITS: u32 = 64;

/// `SRCRANGES_V1` (LPM trie) key data, after the kernel's `u32` prefix length: the frontend
/// (exact) then the client's source address (prefix). An entry allows its prefix for its
/// frontend; the value is unused (1). Lookups use prefix length 96.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Default, Pod, Zeroable)]
pub struct SourceRangeKey {
    pub frontend_addr: [u8; 4],
    pub frontend_port: [u8; 2],
    pub proto: u8,
    pub _pad: u8,
    pub source: [u8; 4],
}
const _: () = assert!(core::mem::size_of::<SourceRangeKey>() == 12);

/// `SOCKREV_V1` (LRU hash) key: a socket of the node's own network namespace that the cgroup
/// socket hooks translated, and the backend it was sent to. getpeername()/recvmsg() on that socket
/// look it up to show the frontend instead of the backend.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default, Pod, Zeroable)]
pub struct SockRevKey {
    /// `bpf_get_socket_cookie()`: unique per socket for the kernel's lifetime.
    pub cookie: u64,
    pub backend_addr: [u8; 4],
    pub backend_port: [u8; 2],
    pub proto: u8,
    pub _pad: u8,
}
const _: () = assert!(core::mem::size_of::<SockRevKey>() == 16);

/// `SOCKREV_V1` value: the frontend the application asked for.
pub type SockRevValue = RevNat;

/// `SOCKPICK_V1` key: an unconnected UDP socket of the node's own namespace
/// (`bpf_get_socket_cookie()`) and a frontend it sends to, either family (IPv4 as its
/// v4-mapped IPv6 address).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default, Pod, Zeroable)]
pub struct SockPickKey {
    pub cookie: u64,
    pub frontend_addr: [u8; 16],
    pub frontend_port: [u8; 2],
    pub proto: u8,
    pub _pad: [u8; 5],
}
const _: () = assert!(core::mem::size_of::<SockPickKey>() == 32);

/// `SOCKPICK_V1` value: the backend the socket's datagrams to that frontend go to while it
/// keeps sending, as netfilter keeps one backend per UDP tuple (a socket keeps its source port)
/// until the tuple idles out. The address snapshot revalidates the id, as a conntrack entry's.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default, Pod, Zeroable)]
pub struct SockPickValue {
    /// CLOCK_MONOTONIC ns of the socket's last datagram to the frontend.
    pub last_seen_ns: u64,
    pub backend_id: u32,
    pub backend_port: [u8; 2],
    pub _pad: [u8; 2],
    /// The backend's address (IPv4 as v4-mapped).
    pub backend_addr: [u8; 16],
}
const _: () = assert!(core::mem::size_of::<SockPickValue>() == 32);

/// Per-CPU scratch handed from `tc_ingress` to the new-flow program it tail-calls (same CPU, same
/// packet: nothing runs in between): the conntrack entry the new flow replaces, if any.
/// Never pinned, never read by the agent.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default, Pod, Zeroable)]
pub struct PendingFlow {
    /// The replaced entry (meaningful when `has_old` is 1).
    pub old: CtValue,
    /// 1 if `old` is set.
    pub has_old: u8,
    /// Why the flow is new although it had an entry (`ingress::Replacing` as u8).
    pub replacing: u8,
    pub _pad: [u8; 6],
}
const _: () = assert!(core::mem::size_of::<PendingFlow>() == 48);
/// Which tc hook saw a fragment (`FragKey::hook`). A datagram crosses an ingress and an egress
/// hook of the node with the same addresses at both (a reply is not translated where it enters),
/// so each hook records what it did under its own key.
pub mod frag_hook {
    pub const INGRESS: u8 = 0;
    pub const EGRESS: u8 = 1;
}

/// `FRAGMENTS_V1` (LRU hash) key: one fragmented datagram as its fragments arrive at a hook
/// (before translation) — the IPv4 reassembly key {saddr, daddr, id, proto} plus the hook.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default, Pod, Zeroable)]
pub struct FragKey {
    pub saddr: [u8; 4],
    pub daddr: [u8; 4],
    /// IPv4 identification field (network order).
    pub id: [u8; 2],
    /// `proto::TCP`/`proto::UDP`.
    pub proto: u8,
    /// `frag_hook::*`.
    pub hook: u8,
}
const _: () = assert!(core::mem::size_of::<FragKey>() == 12);

/// What the first fragment of a datagram got, and so what its later fragments get
/// (`FragValue::action`).
pub mod frag_action {
    /// Passed untouched (not a Service, not a tracked reply): later fragments pass too.
    pub const PASS: u8 = 0;
    /// Translated: later fragments get the same IPv4 source and destination.
    pub const TRANSLATE: u8 = 1;
    /// Dropped, or answered in its place (ICMP error, RST): later fragments are dropped.
    pub const DROP: u8 = 2;
}

/// How long after its first fragment a datagram's later fragments are matched: the kernel's
/// reassembly timeout (`net.ipv4.ipfrag_time`, 30 s), so a recycled IP id cannot inherit an old
/// datagram's translation through an entry LRU has not evicted yet.
pub const FRAGMENT_TIMEOUT_NS: u64 = 30_000_000_000;

/// `FRAGMENTS_V1` value: the first fragment's outcome, written when it passed the hook.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default, Pod, Zeroable)]
pub struct FragValue {
    /// CLOCK_MONOTONIC ns when the first fragment passed.
    pub created_ns: u64,
    /// IPv4 source and destination the first fragment left the hook with.
    pub saddr: [u8; 4],
    pub daddr: [u8; 4],
    /// `frag_action::*`.
    pub action: u8,
    pub _pad: [u8; 7],
}
const _: () = assert!(core::mem::size_of::<FragValue>() == 24);

/// `FRAGSCRATCH` value: a `FRAGMENTS_V1` entry being written, built in per-CPU map memory rather
/// than on the 512-byte BPF stack, which tc ingress has nearly used up.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default, Pod, Zeroable)]
pub struct FragRecord {
    pub key: FragKey,
    /// 1 from the first fragment's record to its update in the same program run, else 0.
    pub pending: u8,
    pub _pad: [u8; 3],
    pub value: FragValue,
}
const _: () = assert!(core::mem::size_of::<FragRecord>() == 40);
/// Name of the test-only tap's map (see [`crate::PROG_TC_TAP`]). Not pinned, not in
/// [`ALL_MAPS`]: the agent never attaches the tap, so its copy stays empty.
pub const MAP_TAP: &str = "TAP_V1";
/// Distinct 5-tuples one tap counts (the chaining tests send a few flows).
pub const TAP_CAPACITY: u32 = 256;

/// `TAP_V1` (per-CPU hash, value `u64` packets) key: the 5-tuple of a TCP/UDP packet as the tap
/// saw it, network order.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Default, Pod, Zeroable)]
pub struct TapKey {
    pub saddr: [u8; 4],
    pub daddr: [u8; 4],
    pub sport: [u8; 2],
    pub dport: [u8; 2],
    pub proto: u8,
    pub _pad: [u8; 3],
}
const _: () = assert!(core::mem::size_of::<TapKey>() == 16);

/// Name of the per-CPU token buckets limiting the ICMP errors and TCP RSTs the datapath generates
/// (not pinned: a restart starts with full buckets).
pub const MAP_REJECT_LIMIT: &str = "REJECTRL_V1";

/// `REJECTRL_V1` (per-CPU array, one entry) value: one CPU's token bucket, kept as credit in
/// nanoseconds (see `ratelimit`).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default, Pod, Zeroable)]
pub struct RejectBucket {
    /// Earned and unspent time, capped at the burst.
    pub credit_ns: u64,
    /// CLOCK_MONOTONIC of the last update (0 = never: the bucket starts full).
    pub last_ns: u64,
}
const _: () = assert!(core::mem::size_of::<RejectBucket>() == 16);

/// `AFFINITY_V1` (LRU hash) key: one client of one Service port with session affinity
/// (`ServiceValue::affinity_id`, shared by all that port's frontends, like kube-proxy's records).
/// Node processes (socket hooks) are keyed by the node's address (`NodeInfo::snat_addr`).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Default, Pod, Zeroable)]
pub struct AffinityKey {
    pub affinity_id: u32,
    /// Client address (network order).
    pub client: [u8; 4],
}
const _: () = assert!(core::mem::size_of::<AffinityKey>() == 8);

/// `AFFINITY_V1` value: the client's endpoint and when it last started a flow to it. Like
/// kube-proxy (iptables `recent --set` on each new connection), only new flows refresh it.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default, Pod, Zeroable)]
pub struct AffinityValue {
    pub backend_id: u32,
    pub _pad: u32,
    /// CLOCK_MONOTONIC ns of the client's last new flow (the clock of `CtValue::last_seen_ns`).
    pub last_used_ns: u64,
}
const _: () = assert!(core::mem::size_of::<AffinityValue>() == 16);

/// `AFFMATCH_V1` (hash, value `u32` 1) key: backend `backend_id` is in the slots of the frontend
/// `frontend` (slot-0 key) with session affinity, so a record naming it may be used for new flows
/// of that frontend (cilium's `LB4_AFFINITY_MATCH_MAP`: an O(1) "still usable here" check). The
/// agent writes the entries before the frontend entry that needs them and removes them before the
/// backend leaves the slots.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Default, Pod, Zeroable)]
pub struct AffinityMatchKey {
    pub frontend: ServiceKey,
    pub backend_id: u32,
}
const _: () = assert!(core::mem::size_of::<AffinityMatchKey>() == 16);

/// Is an affinity record last used at `last_used_ns` still valid at `now_ns` for a frontend with
/// `timeout_s`? Within the timeout inclusive (kube-proxy's `recent --seconds`); a record from
/// the future (another CPU stamped it after this program read the clock) is valid.
pub const fn affinity_live(last_used_ns: u64, now_ns: u64, timeout_s: u32) -> bool {
    now_ns.saturating_sub(last_used_ns) <= timeout_s as u64 * 1_000_000_000
}

#[cfg(test)]
mod affinity_tests {
    use super::*;

    #[test]
    fn affinity_is_live_up_to_the_timeout_inclusive() {
        let s = 1_000_000_000u64;
        assert!(affinity_live(100 * s, 100 * s, 10));
        assert!(affinity_live(100 * s, 110 * s, 10));
        assert!(!affinity_live(100 * s, 110 * s + 1, 10));
        assert!(
            affinity_live(100 * s, 90 * s, 10),
            "stamped after our clock read"
        );
        // The largest timeout (86400 s) does not overflow.
        assert!(affinity_live(0, 86_400 * s, 86_400));
        assert!(!affinity_live(0, 86_400 * s + 1, 86_400));
    }
}
