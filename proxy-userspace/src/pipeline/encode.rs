//! Host types ↔ map ABI. The only place that turns addresses/`u16`/`Protocol` into the
//! network-order byte arrays of `proxy_common` (and back, for adoption and `dump`), for both
//! families: [`FamilyAbi`] names each family's key and value types (`SERVICES_V1` /
//! `SERVICES6_V1` ...), and every function here is generic over it.

use std::{
    fmt,
    hash::Hash,
    net::{Ipv4Addr, Ipv6Addr},
};

use proxy_common::{
    AffinityMatchKey, Backend, ClusterCidrs, Ipv4Prefix, MAX_CLUSTER_CIDRS, RevNat, SCOPE_EXTERNAL,
    SCOPE_INTERNAL, SOURCE_RANGE_FRONTEND_BITS, ServiceKey, ServiceValue, SourceRangeKey,
    backend_flags,
    ipv6::{
        Affinity6MatchKey, Backend6, RevNat6, SOURCE_RANGE6_FRONTEND_BITS, Service6Key,
        SourceRange6Key,
    },
    service_flags,
};

use crate::pipeline::model::{
    DesiredBackend, DesiredFrontend, EndpointAddr, Family, Frontend, Protocol, Scope,
    ServicePortName,
};

/// A `SERVICES` key of either family: the frontend entry is slot 0, its backend slots 1..=n.
pub trait SlotKey:
    Copy + Eq + Ord + Hash + fmt::Debug + Default + Send + Sync + aya::Pod + 'static
{
    /// The family whose key this is.
    type Family: FamilyAbi<ServiceKey = Self>;
    fn slot(&self) -> u16;
    /// The same frontend, another slot.
    fn with_slot(self, slot: u16) -> Self;
}

/// A `BACKENDS` value of either family (so a decode finds the family from the value's type).
pub trait BackendValue: Copy + Eq + fmt::Debug + Send + Sync + aya::Pod + 'static {
    type Family: FamilyAbi<Backend = Self>;
}

/// A `REVNAT` value of either family.
pub trait RevNatValue: Copy + Eq + fmt::Debug + Send + Sync + aya::Pod + 'static {
    type Family: FamilyAbi<RevNat = Self>;
}

/// A family's map ABI: the key and value types of its `SERVICES`/`BACKENDS`/`REVNAT`/
/// `AFFMATCH`/`SRCRANGES` maps (IPv4: `SERVICES_V1` ...; IPv6: `SERVICES6_V1` ...), and how
/// host values are laid into them. `ServiceValue` (no address) is the same for both.
pub trait FamilyAbi: Family {
    type ServiceKey: SlotKey<Family = Self>;
    type Backend: BackendValue<Family = Self>;
    type RevNat: RevNatValue<Family = Self>;
    type AffinityMatchKey: Copy + Eq + Ord + Hash + fmt::Debug + Send + Sync + aya::Pod + 'static;
    type SourceRangeKey: Copy + Eq + Ord + fmt::Debug + Send + Sync + aya::Pod + 'static;
    /// The family's map names (`SERVICES_V1` / `SERVICES6_V1` ...).
    const MAP_SERVICES: &'static str;
    const MAP_BACKENDS: &'static str;
    const MAP_REVNAT: &'static str;
    const MAP_AFFINITY_MATCH: &'static str;
    const MAP_SOURCE_RANGES: &'static str;
    /// Bits of the source-range key naming the frontend (the source prefix comes after).
    const SOURCE_RANGE_FRONTEND_BITS: u32;
    /// A `SERVICES` key (`scope`: `SCOPE_*`).
    fn service_key(addr: Self, port: [u8; 2], proto: u8, scope: u8, slot: u16) -> Self::ServiceKey;
    /// (address, port, protocol, scope, slot) of a key.
    fn service_key_parts(key: &Self::ServiceKey) -> (Self, [u8; 2], u8, u8, u16);
    fn backend(addr: Self, port: [u8; 2], proto: u8, flags: u8) -> Self::Backend;
    /// (address, port, protocol, flags) of a `BACKENDS` value.
    fn backend_parts(b: &Self::Backend) -> (Self, [u8; 2], u8, u8);
    fn rev_nat(addr: Self, port: [u8; 2]) -> Self::RevNat;
    fn rev_nat_parts(r: &Self::RevNat) -> (Self, [u8; 2]);
    fn affinity_match(frontend: Self::ServiceKey, backend_id: u32) -> Self::AffinityMatchKey;
    /// The frontend (slot-0 key) an affinity match entry belongs to.
    fn affinity_match_frontend(k: &Self::AffinityMatchKey) -> Self::ServiceKey;
    fn affinity_match_backend(k: &Self::AffinityMatchKey) -> u32;
    fn source_range(addr: Self, port: [u8; 2], proto: u8, source: Self) -> Self::SourceRangeKey;
}

/// The two families' ABIs differ only in their types, map names and address length (the
/// types' fields are named alike): one body for both.
macro_rules! family_abi {
    ($family:ty, $key:ident, $backend:ident, $rev_nat:ident, $matched:ident, $range:ident,
     [$services:expr, $backends:expr, $rev_nats:expr, $matches:expr, $ranges:expr],
     $range_bits:expr) => {
        impl SlotKey for $key {
            type Family = $family;
            fn slot(&self) -> u16 {
                self.slot
            }
            fn with_slot(self, slot: u16) -> Self {
                $key::with_slot(self, slot)
            }
        }

        impl BackendValue for $backend {
            type Family = $family;
        }

        impl RevNatValue for $rev_nat {
            type Family = $family;
        }

        impl FamilyAbi for $family {
            type ServiceKey = $key;
            type Backend = $backend;
            type RevNat = $rev_nat;
            type AffinityMatchKey = $matched;
            type SourceRangeKey = $range;
            const MAP_SERVICES: &'static str = $services;
            const MAP_BACKENDS: &'static str = $backends;
            const MAP_REVNAT: &'static str = $rev_nats;
            const MAP_AFFINITY_MATCH: &'static str = $matches;
            const MAP_SOURCE_RANGES: &'static str = $ranges;
            const SOURCE_RANGE_FRONTEND_BITS: u32 = $range_bits;
            fn service_key(addr: Self, port: [u8; 2], proto: u8, scope: u8, slot: u16) -> $key {
                $key {
                    scope,
                    ..$key::new(addr.octets(), port, proto, slot)
                }
            }
            fn service_key_parts(k: &$key) -> (Self, [u8; 2], u8, u8, u16) {
                (Self::from(k.addr), k.port, k.proto, k.scope, k.slot)
            }
            fn backend(addr: Self, port: [u8; 2], proto: u8, flags: u8) -> $backend {
                $backend {
                    addr: addr.octets(),
                    port,
                    proto,
                    flags,
                }
            }
            fn backend_parts(b: &$backend) -> (Self, [u8; 2], u8, u8) {
                (Self::from(b.addr), b.port, b.proto, b.flags)
            }
            fn rev_nat(addr: Self, port: [u8; 2]) -> $rev_nat {
                $rev_nat {
                    addr: addr.octets(),
                    port,
                    _pad: [0; 2],
                }
            }
            fn rev_nat_parts(r: &$rev_nat) -> (Self, [u8; 2]) {
                (Self::from(r.addr), r.port)
            }
            fn affinity_match(frontend: $key, backend_id: u32) -> $matched {
                $matched {
                    frontend,
                    backend_id,
                }
            }
            fn affinity_match_frontend(k: &$matched) -> $key {
                k.frontend
            }
            fn affinity_match_backend(k: &$matched) -> u32 {
                k.backend_id
            }
            fn source_range(addr: Self, port: [u8; 2], proto: u8, source: Self) -> $range {
                $range {
                    frontend_addr: addr.octets(),
                    frontend_port: port,
                    proto,
                    _pad: 0,
                    source: source.octets(),
                }
            }
        }
    };
}

family_abi!(
    Ipv4Addr,
    ServiceKey,
    Backend,
    RevNat,
    AffinityMatchKey,
    SourceRangeKey,
    [
        proxy_common::MAP_SERVICES,
        proxy_common::MAP_BACKENDS,
        proxy_common::MAP_REVNAT,
        proxy_common::MAP_AFFINITY_MATCH,
        proxy_common::MAP_SOURCE_RANGES
    ],
    SOURCE_RANGE_FRONTEND_BITS
);

family_abi!(
    Ipv6Addr,
    Service6Key,
    Backend6,
    RevNat6,
    Affinity6MatchKey,
    SourceRange6Key,
    [
        proxy_common::ipv6::MAP_SERVICES6,
        proxy_common::ipv6::MAP_BACKENDS6,
        proxy_common::ipv6::MAP_REVNAT6,
        proxy_common::ipv6::MAP_AFFINITY_MATCH6,
        proxy_common::ipv6::MAP_SOURCE_RANGES6
    ],
    SOURCE_RANGE6_FRONTEND_BITS
);

const fn scope_code(scope: Scope) -> u8 {
    match scope {
        Scope::AllClients => SCOPE_EXTERNAL,
        Scope::InCluster => SCOPE_INTERNAL,
    }
}

/// The `SERVICES` key of one slot of a frontend (slot 0 = the frontend entry).
pub fn service_key<A: FamilyAbi>(frontend: &Frontend<A>, slot: u16) -> A::ServiceKey {
    A::service_key(
        frontend.addr,
        frontend.port.to_be_bytes(),
        frontend.protocol.number(),
        scope_code(frontend.scope),
        slot,
    )
}

/// The frontend a `SERVICES` key belongs to; `None` for a protocol or scope this agent does not
/// write.
pub fn decode_service_key<K: SlotKey>(key: &K) -> Option<(Frontend<K::Family>, u16)> {
    let (addr, port, proto, scope, slot) = K::Family::service_key_parts(key);
    let scope = match scope {
        SCOPE_EXTERNAL => Scope::AllClients,
        SCOPE_INTERNAL => Scope::InCluster,
        _ => return None,
    };
    let frontend = Frontend {
        addr,
        port: u16::from_be_bytes(port),
        protocol: Protocol::from_number(proto)?,
        scope,
    };
    Some((frontend, slot))
}

/// The datapath's cluster CIDRs from (network, prefix length) pairs: host bits cleared, at most
/// `MAX_CLUSTER_CIDRS` (the rest are returned for the caller to report).
pub fn cluster_cidrs(cidrs: &[(Ipv4Addr, u8)]) -> (ClusterCidrs, &[(Ipv4Addr, u8)]) {
    let mut out = ClusterCidrs::NONE;
    let used = cidrs.len().min(MAX_CLUSTER_CIDRS);
    for (slot, (net, len)) in out.prefixes.iter_mut().zip(&cidrs[..used]) {
        let mask = u32::MAX.checked_shl(32 - u32::from(*len)).unwrap_or(0);
        *slot = Ipv4Prefix {
            addr: (u32::from(*net) & mask).to_be_bytes(),
            mask: mask.to_be_bytes(),
        };
    }
    out.count = used as u32;
    (out, &cidrs[used..])
}

/// `service_flags` bits of a frontend entry.
pub fn frontend_flags<A: Family>(frontend: &Frontend<A>, df: &DesiredFrontend<A>) -> u16 {
    let mut flags = 0;
    // An in-cluster entry (pods and the node reaching an eTP=Local external frontend) carries
    // in-cluster traffic: like upstream, which sends it to KUBE-SVC without masquerading, it is
    // treated as a ClusterIP (no SNAT to the node: the backend sees the pod).
    if df.kind.is_external() && frontend.scope == Scope::AllClients {
        flags |= service_flags::EXTERNAL;
        if df.external_local {
            flags |= service_flags::EXTERNAL_LOCAL;
        }
    }
    if !df.source_ranges.is_empty() {
        flags |= service_flags::SOURCE_RANGES;
    }
    if df.drop_when_empty && df.backends.is_empty() {
        flags |= service_flags::DROP_WHEN_EMPTY;
    }
    flags
}

/// Ids a frontend entry refers to beside its rev-NAT id, allocated by the planner.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct FrontendRefs {
    /// Session affinity scope of the frontend's Service port (0 = no affinity).
    pub affinity_id: u32,
    /// Maglev table of the frontend's backend set (0 = none).
    pub maglev_table: u32,
}

/// The `SERVICES` frontend entry (slot 0) of a frontend with `count` backend slots.
pub fn frontend_value<A: Family>(
    frontend: &Frontend<A>,
    df: &DesiredFrontend<A>,
    count: u16,
    rev_nat_id: u32,
    refs: FrontendRefs,
) -> ServiceValue {
    let mut flags = frontend_flags(frontend, df);
    let mut value = ServiceValue::frontend(count, rev_nat_id);
    if let Some(timeout) = df.balancing.affinity_timeout_s {
        flags |= service_flags::AFFINITY;
        value.affinity_timeout_s = timeout;
        value.affinity_id = refs.affinity_id;
    }
    value.flags = flags;
    value.scheduler = df.balancing.scheduler.code();
    value.maglev_table = refs.maglev_table;
    value
}

/// The session affinity scope of a Service port (`ServiceValue::affinity_id`): a hash of its
/// name, never 0. Like kube-proxy's iptables `recent` lists (named by a hash of the Service port
/// and endpoint), it is the same on every sync, after agent restarts and on every node, with no
/// allocator state; a Service deleted and created again under the same name finds its old
/// records, as upstream does, but only those naming a backend still in its slots (`AFFMATCH_V1`).
/// Two Service ports whose names collide (a 1% chance that any pair does among 10,000 affinity
/// Service ports) share a client's record only where both select its backend; otherwise a
/// record of one is a miss for the other (each new flow of the client may then re-pick).
pub fn affinity_id(service: &ServicePortName) -> u32 {
    // FNV-1a (64-bit) over the three names, NUL-separated, folded to 32 bits.
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for part in [&service.namespace, &service.name, &service.port_name] {
        for b in part.bytes().chain([0]) {
            h ^= u64::from(b);
            h = h.wrapping_mul(0x0000_0100_0000_01b3);
        }
    }
    let folded = (h ^ (h >> 32)) as u32;
    folded.max(1)
}

/// The ids a frontend entry of `df` refers to that depend on it alone (the affinity scope).
pub fn frontend_refs<A: Family>(df: &DesiredFrontend<A>) -> FrontendRefs {
    FrontendRefs {
        affinity_id: df
            .balancing
            .affinity_timeout_s
            .map_or(0, |_| affinity_id(&df.service)),
        maglev_table: 0,
    }
}

/// The `AFFMATCH_V1` entries of a frontend (slot-0 key `key`) with backend slots `slot_ids`:
/// every backend of an affinity frontend, none otherwise; sorted.
pub fn affinity_matches<A: FamilyAbi>(
    key: &A::ServiceKey,
    df: &DesiredFrontend<A>,
    slot_ids: &[u32],
) -> Vec<A::AffinityMatchKey> {
    if df.balancing.affinity_timeout_s.is_none() {
        return Vec::new();
    }
    let mut out: Vec<A::AffinityMatchKey> = slot_ids
        .iter()
        .map(|&backend_id| A::affinity_match(*key, backend_id))
        .collect();
    out.sort();
    out.dedup();
    out
}

/// The `SRCRANGES_V1` entries (LPM prefix length, key data) allowing a frontend's source ranges.
pub fn source_range_keys<A: FamilyAbi>(
    frontend: &Frontend<A>,
    df: &DesiredFrontend<A>,
) -> Vec<(u32, A::SourceRangeKey)> {
    df.source_ranges
        .iter()
        .map(|(net, len)| {
            (
                A::SOURCE_RANGE_FRONTEND_BITS + u32::from(*len),
                A::source_range(
                    frontend.addr,
                    frontend.port.to_be_bytes(),
                    frontend.protocol.number(),
                    *net,
                ),
            )
        })
        .collect()
}

/// `backend_flags` bits for a backend's conditions.
pub fn backend_flags(terminating: bool, local: bool, not_serving: bool) -> u8 {
    let mut flags = 0;
    if terminating {
        flags |= backend_flags::TERMINATING;
    }
    if local {
        flags |= backend_flags::LOCAL;
    }
    if not_serving {
        flags |= backend_flags::NOT_SERVING;
    }
    flags
}

/// The `BACKENDS` value for a backend.
pub fn backend<A: FamilyAbi>(b: &DesiredBackend<A>) -> A::Backend {
    A::backend(
        b.endpoint.addr,
        b.endpoint.port.to_be_bytes(),
        b.endpoint.protocol.number(),
        backend_flags(b.terminating, b.local, b.not_serving),
    )
}

/// The endpoint a `BACKENDS` value names (identity only, flags ignored).
pub fn decode_endpoint<B: BackendValue>(b: &B) -> Option<EndpointAddr<B::Family>> {
    let (addr, port, proto, _) = B::Family::backend_parts(b);
    Some(EndpointAddr {
        addr,
        port: u16::from_be_bytes(port),
        protocol: Protocol::from_number(proto)?,
    })
}

/// A `BACKENDS` value back in host types; `None` for an unknown protocol.
pub fn decode_backend<B: BackendValue>(b: &B) -> Option<DesiredBackend<B::Family>> {
    let flags = B::Family::backend_parts(b).3;
    Some(DesiredBackend {
        endpoint: decode_endpoint(b)?,
        terminating: flags & backend_flags::TERMINATING != 0,
        local: flags & backend_flags::LOCAL != 0,
        not_serving: flags & backend_flags::NOT_SERVING != 0,
    })
}

/// A `BACKENDS` value with other flags.
pub fn with_backend_flags<B: BackendValue>(b: &B, flags: u8) -> B {
    let (addr, port, proto, _) = B::Family::backend_parts(b);
    B::Family::backend(addr, port, proto, flags)
}

/// A `BACKENDS` value's flags.
pub fn flags_of<B: BackendValue>(b: &B) -> u8 {
    B::Family::backend_parts(b).3
}

/// The `REVNAT` value for a frontend: the source a reply must appear to come from.
pub fn rev_nat<A: FamilyAbi>(frontend: &Frontend<A>) -> A::RevNat {
    A::rev_nat(frontend.addr, frontend.port.to_be_bytes())
}

/// A `REVNAT` value back in host types.
pub fn decode_rev_nat<R: RevNatValue>(r: &R) -> (R::Family, u16) {
    let (addr, port) = R::Family::rev_nat_parts(r);
    (addr, u16::from_be_bytes(port))
}

#[cfg(test)]
mod tests {
    use super::*;

    const FE: Frontend = Frontend::new(Ipv4Addr::new(10, 96, 0, 10), 0x1f90, Protocol::Tcp);

    #[test]
    fn service_key_is_network_order() {
        let key = service_key(&FE, 3);
        assert_eq!(key.addr, [10, 96, 0, 10]);
        assert_eq!(key.port, [0x1f, 0x90]);
        assert_eq!(key.proto, 6);
        assert_eq!(key.scope, SCOPE_EXTERNAL);
        assert_eq!(key.slot, 3);
        assert_eq!(key._pad, [0; 2]);
    }

    #[test]
    fn service_key_round_trip() {
        for protocol in [Protocol::Tcp, Protocol::Udp, Protocol::Sctp] {
            let fe = Frontend { protocol, ..FE };
            let key = service_key(&fe, 7);
            assert_eq!(key.proto, protocol.number());
            assert_eq!(decode_service_key(&key), Some((fe, 7)));
        }
        assert_eq!(
            service_key(
                &Frontend {
                    protocol: Protocol::Sctp,
                    ..FE
                },
                0
            )
            .proto,
            132
        );
        let mut key = service_key(&FE, 0);
        key.proto = 1;
        assert_eq!(decode_service_key(&key), None, "ICMP is not ours");
    }

    #[test]
    fn in_cluster_frontend_is_the_same_key_with_the_internal_scope() {
        let fe = FE.in_cluster();
        let key = service_key(&fe, 2);
        assert_eq!(key.scope, SCOPE_INTERNAL);
        assert_eq!(
            ServiceKey {
                scope: SCOPE_EXTERNAL,
                ..key
            },
            service_key(&FE, 2)
        );
        assert_eq!(decode_service_key(&key), Some((fe, 2)));
        let mut key = service_key(&FE, 0);
        key.scope = 7;
        assert_eq!(decode_service_key(&key), None, "unknown scope is not ours");
    }

    #[test]
    fn cluster_cidrs_are_masked_network_order_and_bounded() {
        let many: Vec<(Ipv4Addr, u8)> = (0..6)
            .map(|i| (Ipv4Addr::new(10, 244 + i, 3, 4), 16))
            .collect();
        let (c, rest) = cluster_cidrs(&many);
        assert_eq!(c.count, 4);
        assert_eq!(rest, &many[4..]);
        assert_eq!(
            c.prefixes[0],
            Ipv4Prefix {
                addr: [10, 244, 0, 0],
                mask: [255, 255, 0, 0]
            }
        );
        assert!(c.contains([10, 247, 9, 9]));
        assert!(
            !c.contains([10, 248, 9, 9]),
            "the fifth prefix was left out"
        );
        let everything = [(Ipv4Addr::new(1, 2, 3, 4), 0)];
        let (c, rest) = cluster_cidrs(&everything);
        assert_eq!((c.count, c.prefixes[0].mask, rest.len()), (1, [0; 4], 0));
        assert_eq!(cluster_cidrs(&[]).0, ClusterCidrs::NONE);
    }

    #[test]
    fn backend_round_trip_with_flags() {
        for bits in 0..8u8 {
            let (terminating, local, not_serving) = (bits & 1 != 0, bits & 2 != 0, bits & 4 != 0);
            let b = DesiredBackend {
                endpoint: EndpointAddr {
                    addr: Ipv4Addr::new(10, 244, 1, 11),
                    port: 8080,
                    protocol: Protocol::Udp,
                },
                terminating,
                local,
                not_serving,
            };
            let raw = backend(&b);
            assert_eq!(raw.port, 8080u16.to_be_bytes());
            assert_eq!(raw.proto, 17);
            // The flag bits are the ABI's (the datapath tests them).
            assert_eq!(
                raw.flags,
                (u8::from(terminating) * backend_flags::TERMINATING)
                    | (u8::from(local) * backend_flags::LOCAL)
                    | (u8::from(not_serving) * backend_flags::NOT_SERVING)
            );
            assert_eq!(decode_backend(&raw), Some(b));
        }
    }

    #[test]
    fn affinity_id_is_per_service_port_stable_and_never_zero() {
        let spn = |ns: &str, name: &str, port: &str| ServicePortName {
            namespace: ns.into(),
            name: name.into(),
            port_name: port.into(),
        };
        let a = affinity_id(&spn("demo", "web", "http"));
        assert_eq!(a, affinity_id(&spn("demo", "web", "http")), "stable");
        assert_ne!(a, 0);
        // The separators keep "ab/c" and "a/bc" apart.
        assert_ne!(a, affinity_id(&spn("demo", "web", "https")));
        assert_ne!(a, affinity_id(&spn("demo", "webh", "ttp")));
        assert_ne!(a, affinity_id(&spn("other", "web", "http")));
        let distinct: std::collections::HashSet<u32> = (0..10_000)
            .map(|i| affinity_id(&spn("ns", &format!("svc-{i}"), "")))
            .collect();
        assert!(distinct.len() >= 9_998, "{} distinct", distinct.len());
    }

    #[test]
    fn rev_nat_round_trip() {
        let raw = rev_nat(&FE);
        assert_eq!(raw._pad, [0; 2]);
        assert_eq!(decode_rev_nat(&raw), (FE.addr, FE.port));
    }
}
