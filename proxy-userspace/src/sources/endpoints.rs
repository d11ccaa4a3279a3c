//! EndpointSlices → the endpoints of each Service port (upstream `endpointslicecache`).
//!
//! Slices are joined to their Service by the `kubernetes.io/service-name` label in the same
//! namespace. `IPv4` and `IPv6` slices are read, each feeding only its own family's frontends
//! ([`SliceIndex`] is per family, as upstream's per-family proxiers see only their slices); FQDN
//! is ignored (upstream too). A slice port matches a Service port by name and protocol; its port
//! number is where that slice's endpoints listen, which is how a named targetPort resolves per
//! endpoint.
//!
//! Sources keep each EndpointSlice as a [`SliceData`]: parsed once when it arrives, holding only
//! what translation and metrics read (an API `Endpoint` costs 352 bytes however much is pruned,
//! a parsed one about 50).

use std::{
    collections::BTreeSet,
    marker::PhantomData,
    net::{IpAddr, Ipv4Addr, Ipv6Addr},
    time::SystemTime,
};

use k8s_openapi::api::discovery::v1::{Endpoint, EndpointSlice};

use crate::{
    pipeline::{
        fast_hash::HashMap,
        model::{EndpointAddr, Family, Problem, Protocol},
    },
    sources::{
        names::{self, Name},
        object_version,
    },
};

/// Label naming the Service an EndpointSlice belongs to.
pub const LABEL_SERVICE_NAME: &str = "kubernetes.io/service-name";

/// An EndpointSlice's `addressType`, as far as it is read.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AddressType {
    Ipv4,
    Ipv6,
    /// FQDN or unknown: only the slice's identity is kept.
    Other,
}

impl AddressType {
    fn parse(raw: &str) -> Self {
        match raw {
            "IPv4" => AddressType::Ipv4,
            "IPv6" => AddressType::Ipv6,
            _ => AddressType::Other,
        }
    }
}

/// A family whose EndpointSlices are read: how its endpoint addresses are kept in a
/// [`SliceEndpoint`] (IPv4 in line; IPv6 as an index into the slice's out-of-line table, so an
/// IPv4 endpoint stays 16 bytes).
pub trait SliceFamily: Family {
    const ADDRESS_TYPE: AddressType;
    /// What [`SliceEndpoint::addr`] holds for `addr` (`v6` is the slice's IPv6 table).
    fn store(addr: Self, v6: &mut Vec<Ipv6Addr>) -> u32;
    /// The address an endpoint of `slice` holds (`None`: not of this family).
    fn load(slice: &SliceData, stored: u32) -> Option<Self>;
}

impl SliceFamily for Ipv4Addr {
    const ADDRESS_TYPE: AddressType = AddressType::Ipv4;
    fn store(addr: Self, _: &mut Vec<Ipv6Addr>) -> u32 {
        u32::from(addr)
    }
    fn load(slice: &SliceData, stored: u32) -> Option<Self> {
        (slice.address_type == AddressType::Ipv4).then(|| Ipv4Addr::from(stored))
    }
}

impl SliceFamily for Ipv6Addr {
    const ADDRESS_TYPE: AddressType = AddressType::Ipv6;
    fn store(addr: Self, v6: &mut Vec<Ipv6Addr>) -> u32 {
        v6.push(addr);
        index(v6.len() - 1)
    }
    fn load(slice: &SliceData, stored: u32) -> Option<Self> {
        if slice.address_type != AddressType::Ipv6 {
            return None;
        }
        slice.rare.as_ref()?.v6.get(stored as usize).copied()
    }
}
/// `Problem::source` for problems found in the snapshot (whichever source produced it).
pub const SNAPSHOT_SOURCE: &str = "snapshot";

/// One endpoint of one Service port, with what categorisation needs.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EndpointInfo<A: Family = Ipv4Addr> {
    pub endpoint: EndpointAddr<A>,
    /// `nodeName` equals this node's name.
    pub local: bool,
    /// `conditions.ready`, nil = true.
    pub ready: bool,
    /// `conditions.serving`, nil = the value of ready.
    pub serving: bool,
    /// `conditions.terminating`, nil = false.
    pub terminating: bool,
    /// `hints.forZones[].name`.
    pub zone_hints: BTreeSet<String>,
    /// `hints.forNodes` is set (PreferSameNode).
    pub has_node_hints: bool,
    /// `hints.forNodes[].name` names this node.
    pub hinted_for_node: bool,
}

/// An EndpointSlice as the sources keep it: its identity, what metrics read, and its ports and
/// endpoints parsed (with the problems parsing found). Equal slices give equal values (the
/// translation cache compares a new `Arc` by value).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SliceData {
    /// Shared with every object of the namespace ([`names::namespace`]).
    pub namespace: Option<Name>,
    /// Shared with the translation cache and its change lists (which hold this `Arc`).
    pub name: Option<Name>,
    /// The `kubernetes.io/service-name` label.
    pub service_name: Option<Name>,
    pub resource_version: Option<Box<str>>,
    /// Identifies this version of the object (so a new resourceVersion is a change the translation
    /// cache lists, and the metrics count): a hash of the resourceVersion (and uid) when it has
    /// one, else of the whole object as JSON (manifests).
    pub fingerprint: u64,
    /// `endpoints.kubernetes.io/last-change-trigger-time`, when it parses.
    pub trigger_time: Option<SystemTime>,
    /// The slice lists at least one endpoint (parsed or not).
    pub has_endpoints: bool,
    /// `addressType`. FQDN (and unknown) slices keep only their identity (not parsed, not
    /// translated).
    pub address_type: AddressType,
    ports: Box<[SlicePort]>,
    endpoints: Box<[SliceEndpoint]>,
    /// The endpoints' node names, each once ([`SliceEndpoint::node`] indexes it).
    nodes: Box<[Box<str>]>,
    /// The endpoints' topology hints ([`SliceEndpoint::hints`] indexes it; most have none).
    hints: Box<[Hints]>,
    /// What most slices have none of: problems, IPv6 addresses (`None`: neither; boxed, so an
    /// IPv4 slice without problems pays 8 bytes for both).
    rare: Option<Box<Rare>>,
}

/// The out-of-line part of a [`SliceData`].
#[derive(Clone, Debug, Default, PartialEq, Eq)]
struct Rare {
    /// Why ports or endpoints were skipped, in slice order.
    problems: Box<[String]>,
    /// The endpoints' addresses of an IPv6 slice ([`SliceEndpoint::addr`] indexes it).
    v6: Box<[Ipv6Addr]>,
}

impl SliceData {
    /// Why ports or endpoints were skipped, in slice order.
    fn problems(&self) -> &[String] {
        self.rare.as_ref().map_or(&[], |r| &r.problems)
    }
}

impl From<&EndpointSlice> for SliceData {
    fn from(slice: &EndpointSlice) -> Self {
        let meta = &slice.metadata;
        let address_type = AddressType::parse(&slice.address_type);
        let mut problems = Vec::new();
        let parsed = match address_type {
            AddressType::Ipv4 => parse_slice::<Ipv4Addr>(slice, &mut problems),
            AddressType::Ipv6 => parse_slice::<Ipv6Addr>(slice, &mut problems),
            AddressType::Other => Parsed::default(),
        };
        let rare = (!problems.is_empty() || !parsed.v6.is_empty()).then(|| {
            Box::new(Rare {
                problems: problems.into(),
                v6: parsed.v6.into(),
            })
        });
        Self {
            namespace: meta.namespace.as_deref().map(names::namespace),
            name: meta.name.as_deref().map(Name::from),
            service_name: (meta.labels.as_ref())
                .and_then(|l| l.get(LABEL_SERVICE_NAME))
                .map(|s| Name::from(s.as_str())),
            resource_version: meta.resource_version.as_deref().map(Into::into),
            fingerprint: object_version::fingerprint(slice),
            trigger_time: object_version::trigger_time(meta),
            has_endpoints: slice.endpoints.as_ref().is_some_and(|e| !e.is_empty()),
            address_type,
            ports: parsed.ports.into(),
            endpoints: parsed.endpoints.into(),
            nodes: parsed.nodes.into(),
            hints: parsed.hints.into(),
            rare,
        }
    }
}

// The reflector store keys objects by kind, name and namespace (no `ObjectMeta` here).
lookup_from_fields!(SliceData, kind: "EndpointSlice", group: "discovery.k8s.io", plural: "endpointslices", uid: |_| None); // pruned before it gets here

/// A slice port that can carry traffic.
#[derive(Clone, Debug, PartialEq, Eq)]
struct SlicePort {
    name: String,
    protocol: Protocol,
    port: u16,
}

/// An endpoint whose address parsed; the port comes from the slice port. 16 bytes (half a
/// million of them at 50,000 Services): the node name and the hints are indexes into the slice's
/// tables.
#[derive(Clone, Debug, PartialEq, Eq)]
struct SliceEndpoint {
    /// The address ([`SliceFamily::store`]): an IPv4 address's bits, or an index into the
    /// slice's IPv6 table.
    addr: u32,
    /// `nodeName`: an index into [`SliceData::nodes`] ([`NONE`]: not set); compared with this
    /// node's name at translation.
    node: u32,
    /// `hints`: an index into [`SliceData::hints`] ([`NONE`]: neither zone nor node hints, as
    /// for most endpoints).
    hints: u32,
    /// `conditions` ([`READY`], [`SERVING`], [`TERMINATING`]).
    conditions: u8,
}

/// No entry in the slice's table.
const NONE: u32 = u32::MAX;
const READY: u8 = 1;
const SERVING: u8 = 2;
const TERMINATING: u8 = 4;

/// An endpoint's topology hints.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Hints {
    /// `hints.forZones[].name`.
    zones: BTreeSet<String>,
    /// `hints.forNodes[].name` (empty: no node hints).
    nodes: Box<[String]>,
}

/// The snapshot's EndpointSlices of one family grouped by Service.
#[derive(Clone, Debug)]
pub struct SliceIndex<'a, A: SliceFamily = Ipv4Addr> {
    /// (namespace, service name) → slices, sorted by slice name (upstream's merge order).
    by_service: HashMap<(&'a str, &'a str), Vec<(&'a str, &'a SliceData)>>,
    node_name: &'a str,
    family: PhantomData<A>,
}

impl<A: SliceFamily> Default for SliceIndex<'_, A> {
    fn default() -> Self {
        Self {
            by_service: HashMap::default(),
            node_name: "",
            family: PhantomData,
        }
    }
}

impl<'a, A: SliceFamily> SliceIndex<'a, A> {
    /// Group the slices of family `A` among `slices`. Bad endpoint addresses and ports are
    /// reported in `problems` (once per slice) and skipped.
    pub fn new(
        slices: impl IntoIterator<Item = &'a SliceData>,
        node_name: &'a str,
        problems: &mut Vec<Problem>,
    ) -> Self {
        let mut by_service: HashMap<_, Vec<_>> = HashMap::default();
        for slice in slices {
            if slice.address_type != A::ADDRESS_TYPE {
                continue;
            }
            let (Some(service), Some(name)) = (&slice.service_name, &slice.name) else {
                continue; // not managed for a Service: upstream ignores it too
            };
            let namespace = slice.namespace.as_deref().unwrap_or("default");
            if !slice.problems().is_empty() {
                let object = format!("EndpointSlice {namespace}/{name}");
                problems.extend(slice.problems().iter().map(|reason| Problem {
                    source: SNAPSHOT_SOURCE.to_owned(),
                    object: object.clone(),
                    reason: reason.clone(),
                }));
            }
            by_service
                .entry((namespace, &**service))
                .or_default()
                .push((&**name, slice));
        }
        for slices in by_service.values_mut() {
            slices.sort_by(|a, b| a.0.cmp(b.0));
        }
        Self {
            by_service,
            node_name,
            family: PhantomData,
        }
    }

    /// The endpoints of Service `namespace/service`'s port named `port_name` ("" = unnamed) with
    /// `protocol`, deduplicated across slices (the first slice by name wins, unless a later copy
    /// is local — as upstream), sorted by address.
    pub fn endpoints(
        &self,
        namespace: &str,
        service: &str,
        port_name: &str,
        protocol: Protocol,
    ) -> Vec<EndpointInfo<A>> {
        let Some(slices) = self.by_service.get(&(namespace, service)) else {
            return Vec::new();
        };
        let node_name = self.node_name;
        let mut out: HashMap<EndpointAddr<A>, EndpointInfo<A>> = HashMap::default();
        for (_, slice) in slices {
            let Some(port) = slice
                .ports
                .iter()
                .find(|p| p.name == port_name && p.protocol == protocol)
            else {
                continue;
            };
            for ep in &slice.endpoints {
                let Some(addr) = A::load(slice, ep.addr) else {
                    continue;
                };
                let endpoint = EndpointAddr {
                    addr,
                    port: port.port,
                    protocol,
                };
                let hints = slice.hints.get(ep.hints as usize);
                let local = !node_name.is_empty()
                    && slice
                        .nodes
                        .get(ep.node as usize)
                        .is_some_and(|n| **n == *node_name);
                let info = EndpointInfo {
                    endpoint,
                    local,
                    ready: ep.conditions & READY != 0,
                    serving: ep.conditions & SERVING != 0,
                    terminating: ep.conditions & TERMINATING != 0,
                    zone_hints: hints.map_or_else(BTreeSet::new, |h| h.zones.clone()),
                    has_node_hints: hints.is_some_and(|h| !h.nodes.is_empty()),
                    hinted_for_node: !node_name.is_empty()
                        && hints.is_some_and(|h| h.nodes.iter().any(|n| n == node_name)),
                };
                match out.get(&endpoint) {
                    Some(_) if !info.local => {}
                    _ => {
                        out.insert(endpoint, info);
                    }
                }
            }
        }
        let mut v: Vec<_> = out.into_values().collect();
        v.sort_by_key(|e| e.endpoint);
        v
    }
}

/// A slice's ports and endpoints as parsed, with the endpoints' node names and hints.
#[derive(Default)]
struct Parsed {
    ports: Vec<SlicePort>,
    endpoints: Vec<SliceEndpoint>,
    nodes: Vec<Box<str>>,
    hints: Vec<Hints>,
    /// An IPv6 slice's addresses.
    v6: Vec<Ipv6Addr>,
}

fn parse_slice<A: SliceFamily>(slice: &EndpointSlice, problems: &mut Vec<String>) -> Parsed {
    let mut out = Parsed::default();
    for p in slice.ports.iter().flatten() {
        let name = p.name.clone().unwrap_or_default();
        let protocol = match p.protocol.as_deref() {
            None | Some("TCP") => Protocol::Tcp,
            Some("UDP") => Protocol::Udp,
            Some("SCTP") => Protocol::Sctp,
            // Anything else is not carried; the Service side reports unknown protocols.
            Some(_) => continue,
        };
        // A nil port means "all ports" in the API; kube-proxy cannot use it either.
        let Some(port) = p.port else { continue };
        match u16::try_from(port) {
            Ok(port) if port != 0 => out.ports.push(SlicePort {
                name,
                protocol,
                port,
            }),
            _ => problems.push(format!(
                "port {name:?} has invalid number {port}; port skipped"
            )),
        }
    }
    // Node name → its index in `out.nodes`.
    let mut nodes: HashMap<&str, u32> = HashMap::default();
    for ep in slice.endpoints.iter().flatten() {
        // Upstream uses the first address only (the API allows exactly one).
        let Some(raw) = ep.addresses.first() else {
            continue;
        };
        let Some(addr) = raw.parse::<IpAddr>().ok().and_then(A::of) else {
            problems.push(format!(
                "endpoint address {raw:?} is not an {} address; endpoint skipped",
                A::NAME
            ));
            continue;
        };
        let addr = A::store(addr, &mut out.v6);
        let node = ep.node_name.as_deref().map_or(NONE, |n| {
            *nodes.entry(n).or_insert_with(|| {
                out.nodes.push(n.into());
                index(out.nodes.len() - 1)
            })
        });
        let hints = hints(ep).map_or(NONE, |h| {
            out.hints.push(h);
            index(out.hints.len() - 1)
        });
        out.endpoints.push(SliceEndpoint {
            addr,
            node,
            hints,
            conditions: conditions(ep),
        });
    }
    out
}

/// A table index as kept in a [`SliceEndpoint`] (a slice holds far fewer than 2³² endpoints).
fn index(i: usize) -> u32 {
    u32::try_from(i).unwrap_or(NONE)
}

/// `conditions` as flags: ready (nil = true), serving (nil = ready), terminating (nil = false).
fn conditions(ep: &Endpoint) -> u8 {
    let c = ep.conditions.as_ref();
    let ready = c.and_then(|c| c.ready).unwrap_or(true);
    let serving = c.and_then(|c| c.serving).unwrap_or(ready);
    let terminating = c.and_then(|c| c.terminating).unwrap_or(false);
    let flag = |set: bool, flag: u8| if set { flag } else { 0 };
    flag(ready, READY) | flag(serving, SERVING) | flag(terminating, TERMINATING)
}

fn hints(ep: &Endpoint) -> Option<Hints> {
    let h = ep.hints.as_ref()?;
    let hints = Hints {
        zones: (h.for_zones.iter().flatten())
            .map(|z| z.name.clone())
            .collect(),
        nodes: (h.for_nodes.iter().flatten())
            .map(|n| n.name.clone())
            .collect(),
    };
    (!hints.zones.is_empty() || !hints.nodes.is_empty()).then_some(hints)
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn api_slice(address_type: &str) -> EndpointSlice {
        serde_json::from_value(json!({
            "metadata": {"name": "web-1", "namespace": "demo", "resourceVersion": "9",
                         "labels": {"kubernetes.io/service-name": "web"},
                         "annotations": {"endpoints.kubernetes.io/last-change-trigger-time":
                                         "2026-01-01T00:00:00Z"}},
            "addressType": address_type,
            "ports": [{"name": "http", "port": 8080, "protocol": "TCP"},
                      {"name": "big", "port": 70000, "protocol": "TCP"}],
            "endpoints": [
                {"addresses": ["10.0.0.1"], "nodeName": "n1", "conditions": {"ready": false}},
                {"addresses": ["bad"], "nodeName": "n1"},
                {"addresses": ["10.0.0.2"], "nodeName": "n1",
                 "hints": {"forZones": [{"name": "a"}]}},
            ],
        }))
        .expect("slice")
    }

    #[test]
    fn a_slice_is_kept_parsed_with_its_identity_and_problems() {
        let s = SliceData::from(&api_slice("IPv4"));
        assert_eq!(
            (s.namespace.as_deref(), s.name.as_deref()),
            (Some("demo"), Some("web-1"))
        );
        assert_eq!(s.service_name.as_deref(), Some("web"));
        assert_eq!(s.resource_version.as_deref(), Some("9"));
        assert!(s.trigger_time.is_some() && s.has_endpoints);
        assert_eq!(s.address_type, AddressType::Ipv4);
        assert_eq!(s.ports.len(), 1);
        assert_eq!(s.endpoints.len(), 2);
        let (a, b) = (&s.endpoints[0], &s.endpoints[1]);
        assert_eq!((a.conditions, b.conditions), (0, READY | SERVING));
        assert_eq!((a.node, b.node), (0, 0), "one node name per slice");
        assert_eq!(&*s.nodes, ["n1".into()]);
        assert_eq!((a.hints, b.hints), (NONE, 0));
        assert_eq!(s.hints[0].zones, BTreeSet::from(["a".to_owned()]));
        assert_eq!(
            s.problems(),
            [
                "port \"big\" has invalid number 70000; port skipped",
                "endpoint address \"bad\" is not an IPv4 address; endpoint skipped",
            ]
        );

        // Problems are reported (with the slice's name) and `local` decided per node at
        // translation.
        let mut problems = Vec::new();
        let index: SliceIndex<'_> = SliceIndex::new([&s], "n1", &mut problems);
        assert_eq!(problems.len(), 2);
        assert_eq!(problems[0].object, "EndpointSlice demo/web-1");
        let eps = index.endpoints("demo", "web", "http", Protocol::Tcp);
        assert_eq!(eps.len(), 2);
        assert!(eps.iter().all(|e| e.local));
        let index: SliceIndex<'_> = SliceIndex::new([&s], "n2", &mut problems);
        let eps = index.endpoints("demo", "web", "http", Protocol::Tcp);
        assert!(eps.iter().all(|e| !e.local));
    }

    /// An IPv6 slice is parsed like an IPv4 one (its addresses out of line) and feeds only the
    /// IPv6 index; an IPv4 address in it is reported, as an IPv6 one in an IPv4 slice.
    #[test]
    fn ipv6_slices_feed_the_ipv6_index_only() {
        let v6: EndpointSlice = serde_json::from_value(json!({
            "metadata": {"name": "web-6", "namespace": "demo",
                         "labels": {"kubernetes.io/service-name": "web"}},
            "addressType": "IPv6",
            "ports": [{"name": "http", "port": 8080, "protocol": "TCP"}],
            "endpoints": [
                {"addresses": ["fd00:244::2"], "nodeName": "n1"},
                {"addresses": ["10.0.0.1"], "nodeName": "n1"},
                {"addresses": ["fd00:244::1"], "nodeName": "n2",
                 "conditions": {"ready": false, "serving": true, "terminating": true}},
            ],
        }))
        .expect("slice");
        let s6 = SliceData::from(&v6);
        let s4 = SliceData::from(&api_slice("IPv4"));
        assert_eq!(s6.address_type, AddressType::Ipv6);
        assert_eq!(
            s6.problems(),
            ["endpoint address \"10.0.0.1\" is not an IPv6 address; endpoint skipped"]
        );
        let mut problems = Vec::new();
        let index6: SliceIndex<'_, Ipv6Addr> = SliceIndex::new([&s6, &s4], "n1", &mut problems);
        assert_eq!(
            problems.len(),
            1,
            "only the IPv6 slice's problem: {problems:?}"
        );
        let eps = index6.endpoints("demo", "web", "http", Protocol::Tcp);
        let addrs: Vec<Ipv6Addr> = eps.iter().map(|e| e.endpoint.addr).collect();
        assert_eq!(
            addrs,
            [
                "fd00:244::1".parse::<Ipv6Addr>().unwrap(),
                "fd00:244::2".parse().unwrap()
            ]
        );
        assert!(!eps[0].local && eps[0].terminating && eps[0].serving && !eps[0].ready);
        assert!(eps[1].local && eps[1].ready);
        assert!(eps.iter().all(|e| e.endpoint.port == 8080));
        // The IPv4 index never sees the IPv6 slice.
        let index4: SliceIndex<'_> = SliceIndex::new([&s6, &s4], "n1", &mut Vec::new());
        let eps4 = index4.endpoints("demo", "web", "http", Protocol::Tcp);
        assert_eq!(eps4.len(), 2);
        assert!(eps4.iter().all(|e| e.endpoint.addr.octets()[0] == 10));
        // An IPv4 slice without problems keeps nothing out of line.
        let clean = SliceData::from(
            &serde_json::from_value::<EndpointSlice>(json!({
                "metadata": {"name": "c"}, "addressType": "IPv4",
                "endpoints": [{"addresses": ["10.0.0.1"]}]}))
            .expect("slice"),
        );
        assert!(clean.rare.is_none());
        // One per slice (50,000+ in issue 11's memory target): 176 bytes before the IPv6 table
        // (the problems now share the out-of-line box with it).
        assert_eq!(std::mem::size_of::<SliceData>(), 168);
    }

    #[test]
    fn other_address_types_keep_only_their_identity() {
        let s = SliceData::from(&api_slice("FQDN"));
        assert_eq!(s.service_name.as_deref(), Some("web"));
        assert!(s.address_type == AddressType::Other && s.has_endpoints);
        assert!(s.ports.is_empty() && s.endpoints.is_empty() && s.problems().is_empty());
        let mut problems = Vec::new();
        let index: SliceIndex<'_> = SliceIndex::new([&s], "n1", &mut problems);
        assert!(problems.is_empty());
        assert!(
            index
                .endpoints("demo", "web", "http", Protocol::Tcp)
                .is_empty()
        );
        assert_ne!(s, SliceData::from(&api_slice("IPv4")));
    }
}
