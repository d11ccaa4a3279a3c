//! EndpointSlices → the endpoints of each Service port (upstream `endpointslicecache`).
//!
//! Slices are joined to their Service by the `kubernetes.io/service-name` label in the same
//! namespace. Only `IPv4` slices are read (IPv6 is not carried by the datapath yet, FQDN is
//! ignored upstream too). A slice port matches a Service port by name and protocol; its port
//! number is where that slice's endpoints listen, which is how a named targetPort resolves per
//! endpoint.

use std::{collections::BTreeSet, net::Ipv4Addr};

use k8s_openapi::api::discovery::v1::{Endpoint, EndpointSlice};

use crate::{
    fast_hash::HashMap,
    model::{EndpointAddr, Problem, Protocol},
};

/// Label naming the Service an EndpointSlice belongs to.
pub const LABEL_SERVICE_NAME: &str = "kubernetes.io/service-name";
/// The only address type read.
const ADDRESS_TYPE_IPV4: &str = "IPv4";
/// `Problem::source` for problems found in the snapshot (whichever source produced it).
pub const SNAPSHOT_SOURCE: &str = "snapshot";

/// One endpoint of one Service port, with what categorisation needs.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EndpointInfo {
    pub endpoint: EndpointAddr,
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
}

/// A slice port that can carry traffic.
#[derive(Clone, Debug)]
struct SlicePort {
    name: String,
    protocol: Protocol,
    port: u16,
}

/// An endpoint whose address parsed; the port comes from the slice port.
#[derive(Clone, Debug)]
struct SliceEndpoint {
    addr: Ipv4Addr,
    local: bool,
    ready: bool,
    serving: bool,
    terminating: bool,
    zone_hints: BTreeSet<String>,
}

#[derive(Clone, Debug)]
struct ParsedSlice {
    ports: Vec<SlicePort>,
    endpoints: Vec<SliceEndpoint>,
}

/// The snapshot's IPv4 EndpointSlices, parsed once and grouped by Service.
#[derive(Clone, Debug, Default)]
pub struct SliceIndex {
    /// (namespace, service name) → slices, sorted by slice name (upstream's merge order).
    by_service: HashMap<(String, String), Vec<(String, ParsedSlice)>>,
}

impl SliceIndex {
    /// Parse and group `slices`. Bad endpoint addresses and ports are reported in `problems` (once
    /// per slice) and skipped.
    pub fn new<'a>(
        slices: impl IntoIterator<Item = &'a EndpointSlice>,
        node_name: &str,
        problems: &mut Vec<Problem>,
    ) -> Self {
        let mut by_service: HashMap<_, Vec<_>> = HashMap::default();
        for slice in slices {
            if slice.address_type != ADDRESS_TYPE_IPV4 {
                continue;
            }
            let meta = &slice.metadata;
            let service = meta.labels.as_ref().and_then(|l| l.get(LABEL_SERVICE_NAME));
            let (Some(service), Some(name)) = (service, meta.name.as_ref()) else {
                continue; // not managed for a Service: upstream ignores it too
            };
            let namespace = meta
                .namespace
                .clone()
                .unwrap_or_else(|| "default".to_owned());
            let object = format!("EndpointSlice {namespace}/{name}");
            let parsed = parse_slice(slice, node_name, &object, problems);
            by_service
                .entry((namespace, service.clone()))
                .or_default()
                .push((name.clone(), parsed));
        }
        for slices in by_service.values_mut() {
            slices.sort_by(|a, b| a.0.cmp(&b.0));
        }
        Self { by_service }
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
    ) -> Vec<EndpointInfo> {
        let Some(slices) = self
            .by_service
            .get(&(namespace.to_owned(), service.to_owned()))
        else {
            return Vec::new();
        };
        let mut out: HashMap<EndpointAddr, EndpointInfo> = HashMap::default();
        for (_, slice) in slices {
            let Some(port) = slice
                .ports
                .iter()
                .find(|p| p.name == port_name && p.protocol == protocol)
            else {
                continue;
            };
            for ep in &slice.endpoints {
                let endpoint = EndpointAddr {
                    addr: ep.addr,
                    port: port.port,
                    protocol,
                };
                let info = EndpointInfo {
                    endpoint,
                    local: ep.local,
                    ready: ep.ready,
                    serving: ep.serving,
                    terminating: ep.terminating,
                    zone_hints: ep.zone_hints.clone(),
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

fn parse_slice(
    slice: &EndpointSlice,
    node_name: &str,
    object: &str,
    problems: &mut Vec<Problem>,
) -> ParsedSlice {
    let mut problem = |reason: String| {
        problems.push(Problem {
            source: SNAPSHOT_SOURCE.to_owned(),
            object: object.to_owned(),
            reason,
        })
    };
    let mut ports = Vec::new();
    for p in slice.ports.iter().flatten() {
        let name = p.name.clone().unwrap_or_default();
        let protocol = match p.protocol.as_deref() {
            None | Some("TCP") => Protocol::Tcp,
            Some("UDP") => Protocol::Udp,
            // SCTP (and anything else) is not carried; the Service side reports SCTP ports.
            Some(_) => continue,
        };
        // A nil port means "all ports" in the API; kube-proxy cannot use it either.
        let Some(port) = p.port else { continue };
        match u16::try_from(port) {
            Ok(port) if port != 0 => ports.push(SlicePort {
                name,
                protocol,
                port,
            }),
            _ => problem(format!(
                "port {name:?} has invalid number {port}; port skipped"
            )),
        }
    }
    let mut endpoints = Vec::new();
    for ep in slice.endpoints.iter().flatten() {
        // Upstream uses the first address only (the API allows exactly one for IPv4 slices).
        let Some(addr) = ep.addresses.first() else {
            continue;
        };
        match addr.parse::<Ipv4Addr>() {
            Ok(addr) => endpoints.push(slice_endpoint(ep, addr, node_name)),
            Err(_) => problem(format!(
                "endpoint address {addr:?} is not an IPv4 address; endpoint skipped"
            )),
        }
    }
    ParsedSlice { ports, endpoints }
}

fn slice_endpoint(ep: &Endpoint, addr: Ipv4Addr, node_name: &str) -> SliceEndpoint {
    let c = ep.conditions.as_ref();
    let ready = c.and_then(|c| c.ready).unwrap_or(true);
    SliceEndpoint {
        addr,
        local: !node_name.is_empty() && ep.node_name.as_deref() == Some(node_name),
        ready,
        serving: c.and_then(|c| c.serving).unwrap_or(ready),
        terminating: c.and_then(|c| c.terminating).unwrap_or(false),
        zone_hints: ep
            .hints
            .as_ref()
            .and_then(|h| h.for_zones.as_ref())
            .map(|z| z.iter().map(|z| z.name.clone()).collect())
            .unwrap_or_default(),
    }
}
