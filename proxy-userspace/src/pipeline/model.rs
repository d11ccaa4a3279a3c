//! The desired state: what the maps should carry, in host types (no byte order, no ids).
//! `translate` produces it from Services/EndpointSlices; `diff` turns it into map operations.

use std::{
    collections::BTreeMap,
    fmt,
    hash::Hash,
    net::{IpAddr, Ipv4Addr, Ipv6Addr},
    sync::Arc,
};

pub use proxy_common::Scheduler;

/// An address family as the pipeline sees it: its address type. Every desired-state type is
/// generic over it with IPv4 as the default, so the IPv4 pipeline is the code it always was
/// (monomorphised, no enum to match per address) and the IPv6 one is the same code over
/// [`Ipv6Addr`] — upstream's one proxier per family. Each family's frontends are built from its
/// own cluster IPs, external addresses and EndpointSlices only.
pub trait Family: Copy + Ord + Hash + fmt::Debug + fmt::Display + Send + Sync + 'static {
    /// Upstream's name (`spec.ipFamilies`, EndpointSlice `addressType`, the `ip_family` label).
    const NAME: &'static str;
    /// Address length in bits (the longest prefix).
    const BITS: u8;
    /// The address if it is of this family.
    fn of(addr: IpAddr) -> Option<Self>;
    /// The network of `self` with prefix length `len` (host bits cleared; `len` ≤ [`Self::BITS`]).
    fn network(self, len: u8) -> Self;
    /// 32 bits standing for the address in a Maglev permutation's identity (the address itself
    /// for IPv4; the four words folded for IPv6: only the table's balance depends on it).
    fn maglev_word(self) -> u32;
}

impl Family for Ipv4Addr {
    const NAME: &'static str = "IPv4";
    const BITS: u8 = 32;
    fn of(addr: IpAddr) -> Option<Self> {
        match addr {
            IpAddr::V4(a) => Some(a),
            IpAddr::V6(_) => None,
        }
    }
    fn network(self, len: u8) -> Self {
        let mask = u32::MAX.checked_shl(32 - u32::from(len)).unwrap_or(0);
        Ipv4Addr::from(u32::from(self) & mask)
    }
    fn maglev_word(self) -> u32 {
        u32::from(self)
    }
}

impl Family for Ipv6Addr {
    const NAME: &'static str = "IPv6";
    const BITS: u8 = 128;
    fn of(addr: IpAddr) -> Option<Self> {
        match addr {
            IpAddr::V6(a) => Some(a),
            IpAddr::V4(_) => None,
        }
    }
    fn network(self, len: u8) -> Self {
        let mask = u128::MAX.checked_shl(128 - u32::from(len)).unwrap_or(0);
        Ipv6Addr::from(u128::from(self) & mask)
    }
    fn maglev_word(self) -> u32 {
        let v = u128::from(self);
        // Rotations keep addresses that differ in one word apart from those differing in another.
        (0..4).fold(0u32, |acc, i| acc.rotate_left(7) ^ (v >> (32 * i)) as u32)
    }
}

/// L4 protocol of a Service port.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Protocol {
    Tcp,
    Udp,
    Sctp,
}

impl Protocol {
    /// IP protocol number as carried in map keys.
    pub const fn number(self) -> u8 {
        match self {
            Protocol::Tcp => proxy_common::proto::TCP,
            Protocol::Udp => proxy_common::proto::UDP,
            Protocol::Sctp => proxy_common::proto::SCTP,
        }
    }

    pub const fn from_number(n: u8) -> Option<Self> {
        match n {
            proxy_common::proto::TCP => Some(Protocol::Tcp),
            proxy_common::proto::UDP => Some(Protocol::Udp),
            proxy_common::proto::SCTP => Some(Protocol::Sctp),
            _ => None,
        }
    }
}

impl fmt::Display for Protocol {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Protocol::Tcp => "TCP",
            Protocol::Udp => "UDP",
            Protocol::Sctp => "SCTP",
        })
    }
}

/// Which clients a frontend entry serves (`ServiceKey::scope`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Scope {
    /// Every client (`SCOPE_EXTERNAL`); every frontend has this entry.
    #[default]
    AllClients,
    /// Clients inside the cluster (`SCOPE_INTERNAL`), only beside an external frontend with
    /// externalTrafficPolicy Local: the Service's cluster-wide endpoints, so pods and the node
    /// reach it even without a local endpoint (kube-proxy's short-circuit).
    InCluster,
}

/// Where clients send: a Service's ClusterIP, externalIP, LoadBalancer IP or node address, and
/// port; `scope` tells the in-cluster entry of an eTP=Local external frontend from the frontend.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Frontend<A: Family = Ipv4Addr> {
    pub addr: A,
    pub port: u16,
    pub protocol: Protocol,
    pub scope: Scope,
}

impl<A: Family> Frontend<A> {
    /// The frontend every client uses.
    pub const fn new(addr: A, port: u16, protocol: Protocol) -> Self {
        Self {
            addr,
            port,
            protocol,
            scope: Scope::AllClients,
        }
    }

    /// The same address, port and protocol for in-cluster clients.
    pub const fn in_cluster(self) -> Self {
        Self {
            scope: Scope::InCluster,
            ..self
        }
    }

    /// The same address, port and protocol for every client: what Services claim (an in-cluster
    /// entry belongs to whoever holds this one).
    pub const fn all_clients(self) -> Self {
        Self {
            scope: Scope::AllClients,
            ..self
        }
    }
}

impl<A: Family> fmt::Display for Frontend<A> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}:{}/{}", self.addr, self.port, self.protocol)?;
        match self.scope {
            Scope::AllClients => Ok(()),
            Scope::InCluster => f.write_str(" (in-cluster)"),
        }
    }
}

/// An endpoint address as the datapath sends to it. Its identity (addr, port, protocol) is what
/// a backend id stands for.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct EndpointAddr<A: Family = Ipv4Addr> {
    pub addr: A,
    pub port: u16,
    pub protocol: Protocol,
}

impl<A: Family> fmt::Display for EndpointAddr<A> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}:{}/{}", self.addr, self.port, self.protocol)
    }
}

/// One backend of a frontend, with the conditions the datapath keeps as flags.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct DesiredBackend<A: Family = Ipv4Addr> {
    pub endpoint: EndpointAddr<A>,
    /// The endpoint is terminating (selected only through the terminating fallback, or retained).
    pub terminating: bool,
    /// The endpoint's nodeName is this node.
    pub local: bool,
    /// Retained only: the endpoint is not serving (not ready, and not serving-terminating), so
    /// its UDP flows are re-picked while TCP and SCTP ones go on
    /// (`backend_flags::NOT_SERVING`). Never set on a backend that receives new flows.
    pub not_serving: bool,
}

/// A frontend a plan could not program as desired (a map full, too many backends), with its
/// Service port: what the problem is reported as, and (Kubernetes mode) an Event on the Service.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct SkippedFrontend {
    pub service: ServicePortName,
    /// The frontend, as shown (`10.96.0.10:80/TCP`).
    pub frontend: String,
    pub reason: String,
}

impl SkippedFrontend {
    /// The skipped frontends of a plan (`plan.skipped`), each with the Service port `desired`
    /// wants it for.
    pub fn of_plan<A: Family>(
        skipped: &[(Frontend<A>, String)],
        desired: &DesiredState<A>,
    ) -> Vec<Self> {
        skipped
            .iter()
            .filter_map(|(frontend, reason)| {
                Some(Self {
                    service: desired.frontends.get(frontend)?.service.clone(),
                    frontend: frontend.to_string(),
                    reason: reason.clone(),
                })
            })
            .collect()
    }
}

/// Which Service port a frontend belongs to (for messages, dumps and metrics).
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ServicePortName {
    pub namespace: String,
    pub name: String,
    /// The Service port's name ("" when the port is unnamed).
    pub port_name: String,
}

impl fmt::Display for ServicePortName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.port_name.is_empty() {
            write!(f, "{}/{}", self.namespace, self.name)
        } else {
            write!(f, "{}/{}:{}", self.namespace, self.name, self.port_name)
        }
    }
}

/// Which address of a Service a frontend is.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum FrontendKind {
    /// spec.clusterIP(s): cluster-internal traffic.
    #[default]
    ClusterIp,
    /// spec.ports[].nodePort on one of the node's NodePort addresses.
    NodePort,
    /// spec.externalIPs.
    ExternalIp,
    /// status.loadBalancer.ingress[].ip (ipMode VIP).
    LoadBalancer,
}

impl fmt::Display for FrontendKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            FrontendKind::ClusterIp => "clusterIP",
            FrontendKind::NodePort => "nodePort",
            FrontendKind::ExternalIp => "externalIP",
            FrontendKind::LoadBalancer => "loadBalancer IP",
        })
    }
}

impl FrontendKind {
    pub const ALL: [FrontendKind; 4] = [
        FrontendKind::ClusterIp,
        FrontendKind::NodePort,
        FrontendKind::ExternalIp,
        FrontendKind::LoadBalancer,
    ];

    /// A label value for metrics (no spaces).
    pub const fn label(self) -> &'static str {
        match self {
            FrontendKind::ClusterIp => "cluster_ip",
            FrontendKind::NodePort => "node_port",
            FrontendKind::ExternalIp => "external_ip",
            FrontendKind::LoadBalancer => "load_balancer",
        }
    }

    /// NodePort, externalIP and LoadBalancer frontends carry external traffic
    /// (externalTrafficPolicy applies).
    pub const fn is_external(self) -> bool {
        !matches!(self, FrontendKind::ClusterIp)
    }
}

/// How a frontend chooses a backend for a new flow: the Service's scheduler (annotation, else
/// the node's) and its session affinity.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct Balancing {
    pub scheduler: Scheduler,
    /// `sessionAffinity: ClientIP`: `sessionAffinityConfig.clientIP.timeoutSeconds`; `None` =
    /// no affinity.
    pub affinity_timeout_s: Option<u32>,
}

/// What one frontend should do.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DesiredFrontend<A: Family = Ipv4Addr> {
    pub service: ServicePortName,
    pub kind: FrontendKind,
    /// Scheduler and session affinity (the same for all frontends of a Service port).
    pub balancing: Balancing,
    /// An external frontend with externalTrafficPolicy Local: backends are this node's only,
    /// never SNATed, and none means drop. False for its in-cluster entry ([`Scope::InCluster`]),
    /// which carries the cluster-wide endpoints like a ClusterIP (no SNAT).
    pub external_local: bool,
    /// No backends here, but the Service has usable endpoints on other nodes: a Local traffic
    /// policy (internal for a ClusterIP, external for an external frontend) leaves this node
    /// none, so new flows are dropped rather than rejected (upstream's verdicts;
    /// `service_flags::DROP_WHEN_EMPTY`). False whenever `backends` is non-empty.
    pub drop_when_empty: bool,
    /// loadBalancerSourceRanges of a LoadBalancer frontend of this family (network, prefix
    /// length), sorted; empty = any source.
    pub source_ranges: Vec<(A, u8)>,
    /// Backends that receive new flows, sorted and without duplicates. Empty = reject new flows
    /// (drop them with `drop_when_empty`).
    pub backends: Vec<DesiredBackend<A>>,
    /// Backends that receive no new flows but must stay in BACKENDS so established flows to them
    /// finish: endpoints still listed in the Service's slices but not selected, either serving
    /// and terminating, or not ready (`not_serving` when not serving either). Sorted, disjoint
    /// from `backends`.
    pub retained: Vec<DesiredBackend<A>>,
}

/// Everything one family's maps should carry.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DesiredState<A: Family = Ipv4Addr> {
    /// Shared with the translation cache's per-Service results (one copy of each frontend).
    pub frontends: BTreeMap<Frontend<A>, Arc<DesiredFrontend<A>>>,
}

impl<A: Family> Default for DesiredState<A> {
    fn default() -> Self {
        Self {
            frontends: BTreeMap::new(),
        }
    }
}

/// Two Services ask for one frontend (address, port, protocol): `winner` holds it, `loser` goes
/// without it; the loser's other frontends are programmed. Reported as a [`Problem`], a metric
/// and (Kubernetes) an Event on the loser.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct FrontendConflict<A: Family = Ipv4Addr> {
    /// The contested frontend (scope [`Scope::AllClients`]; its in-cluster entry goes along).
    pub frontend: Frontend<A>,
    pub loser: ServicePortName,
    pub loser_kind: FrontendKind,
    pub winner: ServicePortName,
    pub winner_kind: FrontendKind,
    /// Why the winner won.
    pub rule: ClaimRule,
}

/// Which rule settled a [`FrontendConflict`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum ClaimRule {
    /// A ClusterIP beats every other kind of frontend (the allocator keeps ClusterIPs unique, so
    /// an externalIP, LoadBalancer IP or NodePort equal to one is the intruder).
    ClusterIpFirst,
    /// The Service with the older `metadata.creationTimestamp` wins.
    Older,
    /// Same creationTimestamp (or none, as in manifests): the first by namespace/name wins.
    NameOrder,
}

impl fmt::Display for ClaimRule {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            ClaimRule::ClusterIpFirst => "a clusterIP always wins",
            ClaimRule::Older => "the older Service (creationTimestamp) wins",
            ClaimRule::NameOrder => {
                "same creationTimestamp (or none): the first by namespace/name wins"
            }
        })
    }
}

/// A problem with one input object: reported (log, later Events/metrics) and skipped; every other
/// object is still programmed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Problem {
    /// Where the object came from (a manifest file path, or "api").
    pub source: String,
    /// `Kind namespace/name` (or a document index when the name is unknown).
    pub object: String,
    pub reason: String,
}

impl fmt::Display for Problem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}: {}", self.source, self.object, self.reason)
    }
}
