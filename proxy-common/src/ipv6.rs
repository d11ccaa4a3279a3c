//! IPv6 map layouts: the IPv6 datapath has maps of its own (`SERVICES6_V1`, `BACKENDS6_V1`,
//! `REVNAT6_V1`, `CONNTRACK6_V1`, pinned with the others: `crate::ALL_MAPS`), like cilium's
//! lb6_* beside lb4_*.
//!
//! Why separate maps and not one key layout with 16-byte addresses for both families: the IPv4
//! keys stay as small as they are (a conntrack key of 16 bytes instead of 40: the LRU's memory
//! per flow and the per-packet key hash are unchanged for IPv4), the pinned IPv4 state needs no
//! migration when an agent with IPv6 support starts (its maps keep their shape), and each
//! family's frontends come from its own EndpointSlices anyway. Values that carry no address
//! (`ServiceValue`) are shared; backend and rev-NAT ids may share one id space with IPv4 (the
//! agent decides), the maps do not. Addresses and ports are network-order byte arrays, as in the
//! IPv4 layouts; every struct has explicit padding and a size assert.

use bytemuck::{Pod, Zeroable};

use crate::{SCOPE_EXTERNAL, hash};

pub const MAP_SERVICES6: &str = "SERVICES6_V1";
pub const MAP_BACKENDS6: &str = "BACKENDS6_V1";
pub const MAP_REVNAT6: &str = "REVNAT6_V1";
pub const MAP_CONNTRACK6: &str = "CONNTRACK6_V1";
/// `FRAGMENTS6_V1` (LRU hash, [`Frag6Key`] → `crate::FragValue`-like [`Frag6Value`]): what the
/// first fragment of an IPv6 datagram got at a hook, for its later fragments (as `FRAGMENTS_V1`).
pub const MAP_FRAGMENTS6: &str = "FRAGMENTS6_V1";
/// `SRCRANGES6_V1` (LPM trie, [`SourceRange6Key`] → u32, unused value 1): the IPv6
/// loadBalancerSourceRanges prefixes of LoadBalancer frontends (as `SRCRANGES_V1`).
pub const MAP_SOURCE_RANGES6: &str = "SRCRANGES6_V1";
/// `AFFINITY6_V1` (LRU hash, [`Affinity6Key`] → `crate::AffinityValue`): session affinity
/// records of IPv6 clients, as `AFFINITY_V1` (whose 8-byte key stays as it is).
pub const MAP_AFFINITY6: &str = "AFFINITY6_V1";
/// `AFFMATCH6_V1` (hash, [`Affinity6MatchKey`] → u32, unused value 1): the backends an IPv6
/// affinity frontend may send a recorded client to, as `AFFMATCH_V1`.
pub const MAP_AFFINITY_MATCH6: &str = "AFFMATCH6_V1";
/// `SVCCIDRS6_V1` (LPM trie, 16-byte address after the kernel's `u32` prefix length →
/// `crate::service_cidr::*`): the IPv6 Service address space, as `SVCCIDRS_V1` (the Service
/// CIDRs as `UNALLOCATED`, every allocated IPv6 ClusterIP as a /128 `CLUSTER_IP`).
pub const MAP_SERVICE_CIDRS6: &str = "SVCCIDRS6_V1";
/// `CLUSTERCIDRS6_V1` (LPM trie, 16-byte address after the kernel's `u32` prefix length → u32,
/// unused value 1): the cluster's IPv6 pod CIDRs, as `DatapathConfig::cluster_cidrs` for IPv4. A
/// client inside them reaches an externalTrafficPolicy Local frontend through its in-cluster
/// entry (`SCOPE_INTERNAL`, as on IPv4). A map and not a load-time global: the IPv4 config keeps
/// its layout, and the lookup is made only for new flows to eTP=Local frontends.
pub const MAP_CLUSTER_CIDRS6: &str = "CLUSTERCIDRS6_V1";
/// `SOCKREV6_V1` (LRU hash, [`SockRev6Key`] → [`RevNat6`]): the IPv6 frontend a socket of the
/// node's translated at connect()/sendmsg() asked for, shown again by getpeername()/recvmsg(), as
/// `SOCKREV_V1` (a v4-mapped address on an IPv6 socket is translated through the IPv4 maps and
/// recorded in `SOCKREV_V1`).
pub const MAP_SOCK_REVNAT6: &str = "SOCKREV6_V1";
/// `SNAT6_V1` (LRU hash, [`Snat6Key`] → [`Snat6Value`]): SNAT to the node of IPv6 flows, as
/// `SNAT_V1` (an `out` and an `in` entry per flow, the same ports `crate::SNAT_PORT_MIN`..=
/// `crate::SNAT_PORT_MAX`, the same idle rule for the agent's sweep).
pub const MAP_SNAT6: &str = "SNAT6_V1";
/// `NODE6_V1` (array, one [`Node6Info`] at index 0): the node's IPv6 SNAT address, written by the
/// agent. A map of its own: `crate::NodeInfo` keeps its layout.
pub const MAP_NODE6: &str = "NODE6_V1";

/// How many IPv6 extension headers the datapath walks before the L4 header (cilium's
/// `IPV6_MAX_HEADERS` is 4): hop-by-hop, routing, destination options, fragment and AH are
/// walked; a longer chain, ESP or an unknown header ends the walk (`stats::Counter::Ipv6ExtUnparsed`).
pub const MAX_EXT_HEADERS: usize = 6;

/// Compiled-in capacities (the agent may resize at load time, as for IPv4; of the IPv6 maps it
/// sizes only `CONNTRACK6_V1`, by `--map-entries-conntrack6`). Smaller than IPv4's: the kernel
/// preallocates hash and LRU maps whether or not the cluster has IPv6 Services (≈ 150 B per
/// CONNTRACK6 entry: 10 MB here, ≈ 17 MB for all the IPv6 maps together), and most clusters
/// carry fewer IPv6 Services.
pub const SERVICES6_CAPACITY: u32 = 32_768;
pub const BACKENDS6_CAPACITY: u32 = 32_768;
pub const REVNAT6_CAPACITY: u32 = 8_192;
pub const CONNTRACK6_CAPACITY: u32 = 65_536;
pub const FRAGMENTS6_CAPACITY: u32 = 8_192;
pub const SOURCE_RANGES6_CAPACITY: u32 = 16_384;
pub const AFFINITY6_CAPACITY: u32 = 16_384;
/// One /128 per IPv6 ClusterIP plus the CIDRs (LPM tries are not preallocated).
pub const SERVICE_CIDRS6_CAPACITY: u32 = 32_768;
/// The IPv6 cluster CIDRs (`--cluster-cidr` has a few; LPM tries are not preallocated).
pub const CLUSTER_CIDRS6_CAPACITY: u32 = 64;
/// At most one per backend slot of an affinity frontend (as for IPv4).
pub const AFFINITY_MATCH6_CAPACITY: u32 = SERVICES6_CAPACITY;
/// Sockets of the node's translated to IPv6 backends: one entry per (socket, backend),
/// LRU-evicted (half of IPv4's `SOCK_REVNAT_CAPACITY`, like the other IPv6 maps: ≈ 100 B each).
pub const SOCK_REVNAT6_CAPACITY: u32 = 65_536;
/// Two entries per SNATed IPv6 flow (out and in).
pub const SNAT6_CAPACITY: u32 = 32_768;

/// `SERVICES6_V1` key: as `crate::ServiceKey` with a 16-byte address. The value is
/// `crate::ServiceValue` (it holds no address).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Default, Pod, Zeroable)]
pub struct Service6Key {
    /// Frontend address (network order).
    pub addr: [u8; 16],
    /// Frontend port (network order).
    pub port: [u8; 2],
    /// `proto::TCP`/`proto::UDP`/`proto::SCTP`.
    pub proto: u8,
    /// `SCOPE_*`: `SCOPE_INTERNAL` is the in-cluster entry of an eTP=Local frontend (its
    /// cluster-wide endpoints, for clients in `CLUSTERCIDRS6_V1`), as for IPv4.
    pub scope: u8,
    /// 0 = the frontend entry; 1..=count = backend slots.
    pub slot: u16,
    pub _pad: [u8; 2],
}
const _: () = assert!(core::mem::size_of::<Service6Key>() == 24);

impl Service6Key {
    pub const fn new(addr: [u8; 16], port: [u8; 2], proto: u8, slot: u16) -> Self {
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

/// `BACKENDS6_V1`: backend id (u32, from 1) → where to send.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default, Pod, Zeroable)]
pub struct Backend6 {
    pub addr: [u8; 16],
    pub port: [u8; 2],
    pub proto: u8,
    /// `crate::backend_flags`.
    pub flags: u8,
}
const _: () = assert!(core::mem::size_of::<Backend6>() == 20);

/// `REVNAT6_V1`: rev-NAT id (u32, from 1) → the frontend a reply must appear to come from.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default, Pod, Zeroable)]
pub struct RevNat6 {
    pub addr: [u8; 16],
    pub port: [u8; 2],
    pub _pad: [u8; 2],
}
const _: () = assert!(core::mem::size_of::<RevNat6>() == 20);

/// `CONNTRACK6_V1` (LRU hash) key: the 5-tuple plus direction (`crate::ct_dir`), as `CtKey`.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default, Pod, Zeroable)]
pub struct Ct6Key {
    pub saddr: [u8; 16],
    pub daddr: [u8; 16],
    pub sport: [u8; 2],
    pub dport: [u8; 2],
    pub proto: u8,
    pub dir: u8,
    pub _pad: [u8; 2],
}
const _: () = assert!(core::mem::size_of::<Ct6Key>() == 40);

/// `CONNTRACK6_V1` value: the fields of `CtValue` with 16-byte addresses, in the same meaning
/// (`crate::ct_state`, `crate::ct_flags`; ORIGINAL and REPLY entries as for IPv4).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default, Pod, Zeroable)]
pub struct Ct6Value {
    /// `bpf_ktime_get_ns()` (CLOCK_MONOTONIC) of the last packet.
    pub last_seen_ns: u64,
    pub created_ns: u64,
    pub backend_id: u32,
    pub rev_nat_id: u32,
    pub frontend_addr: [u8; 16],
    pub backend_addr: [u8; 16],
    pub frontend_port: [u8; 2],
    pub backend_port: [u8; 2],
    pub state: u8,
    pub flags: u8,
    /// As `CtValue::nat_sport` (unused until IPv6 clash resolution exists: always zero).
    pub nat_sport: [u8; 2],
}
const _: () = assert!(core::mem::size_of::<Ct6Value>() == 64);

/// `SNAT6_V1` key: a `Ct6Key`-shaped tuple, in the meaning of `crate::SnatKey` (`ORIGINAL`:
/// the forwarded packet client → backend as tc egress sees it; `REPLY`: backend → node
/// address:port as tc ingress sees it).
pub type Snat6Key = Ct6Key;

/// `SNAT6_V1` value: `crate::SnatValue` with a 16-byte address.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default, Pod, Zeroable)]
pub struct Snat6Value {
    /// CLOCK_MONOTONIC ns of the last packet through this entry.
    pub last_seen_ns: u64,
    /// Translated address/port (out: node address/port; in: client address/port).
    pub addr: [u8; 16],
    pub port: [u8; 2],
    /// `crate::ct_state::*`.
    pub state: u8,
    /// `crate::ct_flags::SEEN_REPLY` once the backend has answered; other bits unused.
    pub flags: u8,
    pub _pad: [u8; 4],
}
const _: () = assert!(core::mem::size_of::<Snat6Value>() == 32);

/// `NODE6_V1` value: the source address of SNATed IPv6 flows (`::` = none known: such flows go
/// out unSNATed and are counted as `snat_no_node_addr`, as on IPv4).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default, Pod, Zeroable)]
pub struct Node6Info {
    pub snat_addr: [u8; 16],
}
const _: () = assert!(core::mem::size_of::<Node6Info>() == 16);

/// `SOCKREV6_V1` key: a socket (`bpf_get_socket_cookie()`) and the IPv6 backend it was sent to,
/// as `crate::SockRevKey`.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default, Pod, Zeroable)]
pub struct SockRev6Key {
    pub cookie: u64,
    pub backend_addr: [u8; 16],
    pub backend_port: [u8; 2],
    pub proto: u8,
    pub _pad: [u8; 5],
}
const _: () = assert!(core::mem::size_of::<SockRev6Key>() == 32);

/// The IPv4 address of a v4-mapped IPv6 address (`::ffff:a.b.c.d`), as an IPv6 socket of a
/// dual-stack node names an IPv4 peer.
#[inline(always)]
pub const fn v4_mapped(a: &[u8; 16]) -> Option<[u8; 4]> {
    let mut i = 0;
    while i < 10 {
        if a[i] != 0 {
            return None;
        }
        i += 1;
    }
    if a[10] != 0xff || a[11] != 0xff {
        return None;
    }
    Some([a[12], a[13], a[14], a[15]])
}

/// `::ffff:a.b.c.d`.
#[inline(always)]
pub const fn to_v4_mapped(a: [u8; 4]) -> [u8; 16] {
    [
        0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff, a[0], a[1], a[2], a[3],
    ]
}

/// `AFFINITY6_V1` key: one IPv6 client of one Service port with session affinity (the port's
/// `ServiceValue::affinity_id`, shared with its IPv4 frontends' records: the id names the port).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default, Pod, Zeroable)]
pub struct Affinity6Key {
    pub affinity_id: u32,
    pub client: [u8; 16],
}
const _: () = assert!(core::mem::size_of::<Affinity6Key>() == 20);

/// `AFFMATCH6_V1` key: an IPv6 affinity frontend (slot 0) and a backend id it may use.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Default, Pod, Zeroable)]
pub struct Affinity6MatchKey {
    pub frontend: Service6Key,
    pub backend_id: u32,
}
const _: () = assert!(core::mem::size_of::<Affinity6MatchKey>() == 28);

/// Bits of [`SourceRange6Key`] that name the frontend (matched exactly); the source prefix
/// length is added to them to make the LPM prefix length.
pub const SOURCE_RANGE6_FRONTEND_BITS: u32 = 160;

/// `SRCRANGES6_V1` key data (after the kernel's `u32` prefix length): the frontend (exact), then
/// the client's source address (prefix). Lookups use prefix length 288.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Default, Pod, Zeroable)]
pub struct SourceRange6Key {
    pub frontend_addr: [u8; 16],
    pub frontend_port: [u8; 2],
    pub proto: u8,
    pub _pad: u8,
    pub source: [u8; 16],
}
const _: () = assert!(core::mem::size_of::<SourceRange6Key>() == 36);
const _: () = assert!(SOURCE_RANGE6_FRONTEND_BITS as usize == 20 * 8);

/// `FRAGMENTS6_V1` key: the IPv6 reassembly key {saddr, daddr, 32-bit fragment id} plus the
/// L4 protocol and the hook (`crate::frag_hook`), as the fragments arrive.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default, Pod, Zeroable)]
pub struct Frag6Key {
    pub saddr: [u8; 16],
    pub daddr: [u8; 16],
    /// Identification of the fragment header (network order).
    pub id: [u8; 4],
    pub proto: u8,
    pub hook: u8,
    pub _pad: [u8; 2],
}
const _: () = assert!(core::mem::size_of::<Frag6Key>() == 40);

/// `FRAGMENTS6_V1` value: the first fragment's outcome (`crate::frag_action`) and the addresses
/// it left the hook with.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default, Pod, Zeroable)]
pub struct Frag6Value {
    /// CLOCK_MONOTONIC ns when the first fragment passed (matched for `FRAGMENT_TIMEOUT_NS`).
    pub created_ns: u64,
    pub saddr: [u8; 16],
    pub daddr: [u8; 16],
    pub action: u8,
    pub _pad: [u8; 7],
}
const _: () = assert!(core::mem::size_of::<Frag6Value>() == 48);

/// An IPv6 address folded to 32 bits (XOR of its four words), so the IPv4 hashes serve both
/// families: the fold keeps every bit of the address in play, and the seeded mix after it does
/// the spreading.
#[inline(always)]
pub const fn fold_addr(a: [u8; 16]) -> [u8; 4] {
    [
        a[0] ^ a[4] ^ a[8] ^ a[12],
        a[1] ^ a[5] ^ a[9] ^ a[13],
        a[2] ^ a[6] ^ a[10] ^ a[14],
        a[3] ^ a[7] ^ a[11] ^ a[15],
    ]
}

/// `hash::flow_hash` of an IPv6 5-tuple (addresses folded).
#[inline(always)]
pub const fn flow_hash6(
    seed: u32,
    saddr: [u8; 16],
    daddr: [u8; 16],
    sport: [u8; 2],
    dport: [u8; 2],
    proto: u8,
) -> u32 {
    hash::flow_hash(
        seed,
        fold_addr(saddr),
        fold_addr(daddr),
        sport,
        dport,
        proto,
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn v4_mapped_addresses_round_trip_and_nothing_else_is_one() {
        let mapped = to_v4_mapped([10, 96, 0, 10]);
        assert_eq!(
            mapped,
            "::ffff:10.96.0.10"
                .parse::<core::net::Ipv6Addr>()
                .unwrap()
                .octets()
        );
        assert_eq!(v4_mapped(&mapped), Some([10, 96, 0, 10]));
        let mut compat = mapped;
        compat[11] = 0; // ::a.b.c.d (v4-compatible, deprecated) is not mapped.
        assert_eq!(v4_mapped(&compat), None);
        let mut other = mapped;
        other[0] = 0xfd;
        assert_eq!(v4_mapped(&other), None);
    }

    #[test]
    fn folded_addresses_tell_flows_apart() {
        let a = [0xfd, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1];
        let mut b = a;
        b[15] = 2;
        assert_ne!(fold_addr(a), fold_addr(b));
        assert_ne!(
            flow_hash6(7, a, b, [0, 1], [0, 80], 6),
            flow_hash6(7, b, a, [0, 1], [0, 80], 6)
        );
    }
}
