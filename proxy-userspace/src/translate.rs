//! Snapshot → desired state: which frontends exist and which backends each one sends to.
//!
//! Pure. Follows upstream kube-proxy's Service handling (see KUBE-PROXY-BEHAVIOUR.md): skipped
//! Service kinds, frontends per Service port × ClusterIP, endpoints joined from EndpointSlices
//! ([`crate::endpoints`]) and categorised ([`crate::topology`]). A bad object is reported as a
//! [`Problem`] and skipped; everything else is still programmed.

use std::{collections::btree_map::Entry, net::IpAddr};

use k8s_openapi::api::core::v1::Service;

use crate::{
    endpoints::{SNAPSHOT_SOURCE, SliceIndex},
    model::{DesiredFrontend, DesiredState, Frontend, Problem, Protocol, ServicePortName},
    snapshot::Snapshot,
    topology::{self, Policy},
};

/// Label marking a Service as owned by another proxy.
pub const LABEL_SERVICE_PROXY_NAME: &str = "service.kubernetes.io/service-proxy-name";
/// Annotation enabling topology-aware routing (value `Auto`).
pub const ANNOTATION_TOPOLOGY_MODE: &str = "service.kubernetes.io/topology-mode";
/// The annotation's pre-1.27 name, still honoured upstream.
pub const ANNOTATION_TOPOLOGY_AWARE_HINTS: &str = "service.kubernetes.io/topology-aware-hints";

/// Facts about the node this agent runs on.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct NodeContext {
    /// The Node object's name (endpoints with this `nodeName` are local).
    pub node_name: String,
    /// The node's `topology.kubernetes.io/zone` label, for zone hints.
    pub zone: Option<String>,
}

/// What `translate` made of a snapshot.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Translation {
    pub desired: DesiredState,
    /// Invalid or unsupported objects (or parts of them) that were skipped.
    pub problems: Vec<Problem>,
    /// Deliberate, expected skips worth telling the user once (e.g. the IPv6 half of a
    /// dual-stack Service): not errors.
    pub notes: Vec<Problem>,
}

/// Why (part of) a Service is not programmed.
#[derive(Debug, thiserror::Error)]
enum ServiceError {
    #[error("clusterIP {0:?} is not an IP address; Service skipped")]
    BadClusterIp(String),
    #[error("port {name:?} has invalid number {port} (must be 1-65535); Service skipped")]
    BadPort { name: String, port: i32 },
    #[error("port {name:?} has unknown protocol {protocol:?}; Service skipped")]
    BadProtocol { name: String, protocol: String },
    #[error("port {name:?} uses SCTP, which the datapath does not carry; port skipped")]
    Sctp { name: String },
    #[error("port {port}/{protocol} is listed twice; Service skipped")]
    DuplicatePort { port: u16, protocol: Protocol },
    #[error("frontend {frontend} is already used by Service {owner}; Service skipped")]
    FrontendTaken { frontend: Frontend, owner: String },
}

/// Turn a snapshot into the desired state for this node.
pub fn translate(snapshot: &Snapshot, node: &NodeContext) -> Translation {
    let mut out = Translation::default();
    let slices = SliceIndex::new(
        &snapshot.endpoint_slices,
        &node.node_name,
        &mut out.problems,
    );
    // Sorted so that when two Services claim one frontend, the same one wins whatever order the
    // source listed them in.
    let mut services: Vec<&Service> = snapshot.services.iter().collect();
    services.sort_by_key(|s| (&s.metadata.namespace, &s.metadata.name));
    for svc in services {
        let object = format!("Service {}", namespaced_name(svc));
        let report = |list: &mut Vec<Problem>, reason: String| {
            list.push(Problem {
                source: SNAPSHOT_SOURCE.to_owned(),
                object: object.clone(),
                reason,
            })
        };
        if !handled(svc) {
            continue;
        }
        let frontends = match service_frontends(svc, &slices, node) {
            Ok(f) => f,
            Err(e) => {
                report(&mut out.problems, e.to_string());
                continue;
            }
        };
        for e in frontends.port_problems {
            report(&mut out.problems, e.to_string());
        }
        if let Some(note) = frontends.note {
            report(&mut out.notes, note);
        }
        if let Err(e) = claim(&mut out.desired, frontends.frontends) {
            report(&mut out.problems, e.to_string());
        }
    }
    out
}

/// Insert all of one Service's frontends, or none if any is already taken.
fn claim(
    desired: &mut DesiredState,
    frontends: Vec<(Frontend, DesiredFrontend)>,
) -> Result<(), ServiceError> {
    for (frontend, _) in &frontends {
        if let Some(owner) = desired.frontends.get(frontend) {
            let owner = format!("{}/{}", owner.service.namespace, owner.service.name);
            return Err(ServiceError::FrontendTaken {
                frontend: *frontend,
                owner,
            });
        }
    }
    for (frontend, df) in frontends {
        if let Entry::Vacant(v) = desired.frontends.entry(frontend) {
            v.insert(df);
        }
    }
    Ok(())
}

/// Whether this proxy programs the Service at all (upstream skips these silently).
fn handled(svc: &Service) -> bool {
    let Some(spec) = &svc.spec else { return false };
    let external_name = spec.type_.as_deref() == Some("ExternalName");
    let other_proxy = svc
        .metadata
        .labels
        .as_ref()
        .is_some_and(|l| l.contains_key(LABEL_SERVICE_PROXY_NAME));
    let headless = cluster_ip_strings(svc)
        .first()
        .is_none_or(|ip| ip.is_empty() || *ip == "None");
    !(external_name || other_proxy || headless)
}

/// spec.clusterIPs, or spec.clusterIP when clusterIPs is absent.
fn cluster_ip_strings(svc: &Service) -> Vec<&str> {
    let Some(spec) = &svc.spec else {
        return Vec::new();
    };
    match &spec.cluster_ips {
        Some(ips) if !ips.is_empty() => ips.iter().map(String::as_str).collect(),
        _ => spec.cluster_ip.as_deref().into_iter().collect(),
    }
}

struct ServiceFrontends {
    frontends: Vec<(Frontend, DesiredFrontend)>,
    /// Ports skipped without skipping the Service (SCTP).
    port_problems: Vec<ServiceError>,
    /// IPv6 cluster IPs left out.
    note: Option<String>,
}

fn service_frontends(
    svc: &Service,
    slices: &SliceIndex,
    node: &NodeContext,
) -> Result<ServiceFrontends, ServiceError> {
    let namespace = svc.metadata.namespace.as_deref().unwrap_or("default");
    let name = svc.metadata.name.as_deref().unwrap_or_default();
    let mut addrs = Vec::new();
    let mut ipv6 = Vec::new();
    for ip in cluster_ip_strings(svc) {
        match ip.parse::<IpAddr>() {
            Ok(IpAddr::V4(a)) => addrs.push(a),
            Ok(IpAddr::V6(_)) => ipv6.push(ip),
            Err(_) => return Err(ServiceError::BadClusterIp(ip.to_owned())),
        }
    }
    let note = (!ipv6.is_empty()).then(|| {
        format!(
            "IPv6 cluster IP(s) {} not programmed: the datapath is IPv4-only",
            ipv6.join(", ")
        )
    });

    let policy = policy(svc);
    let mut port_problems = Vec::new();
    let mut frontends = Vec::new();
    let mut seen_ports = Vec::new();
    for sp in svc.spec.iter().flat_map(|s| s.ports.iter().flatten()) {
        let port_name = sp.name.clone().unwrap_or_default();
        let protocol = match sp.protocol.as_deref() {
            None | Some("TCP") => Protocol::Tcp,
            Some("UDP") => Protocol::Udp,
            Some("SCTP") => {
                port_problems.push(ServiceError::Sctp { name: port_name });
                continue;
            }
            Some(other) => {
                let protocol = other.to_owned();
                return Err(ServiceError::BadProtocol {
                    name: port_name,
                    protocol,
                });
            }
        };
        let port = match u16::try_from(sp.port) {
            Ok(p) if p != 0 => p,
            _ => {
                return Err(ServiceError::BadPort {
                    name: port_name,
                    port: sp.port,
                });
            }
        };
        if seen_ports.contains(&(port, protocol)) {
            return Err(ServiceError::DuplicatePort { port, protocol });
        }
        seen_ports.push((port, protocol));

        let endpoints = slices.endpoints(namespace, name, &port_name, protocol);
        let chosen = topology::categorize(&endpoints, policy, node.zone.as_deref());
        let service = ServicePortName {
            namespace: namespace.to_owned(),
            name: name.to_owned(),
            port_name,
        };
        for addr in &addrs {
            let frontend = Frontend {
                addr: *addr,
                port,
                protocol,
            };
            let df = DesiredFrontend {
                service: service.clone(),
                backends: chosen.selected.clone(),
                retained: chosen.retained.clone(),
            };
            frontends.push((frontend, df));
        }
    }
    Ok(ServiceFrontends {
        frontends,
        port_problems,
        note,
    })
}

/// The Service's endpoint-selection policy for ClusterIP traffic.
fn policy(svc: &Service) -> Policy {
    let spec = svc.spec.as_ref();
    let local_only = spec.and_then(|s| s.internal_traffic_policy.as_deref()) == Some("Local");
    let distribution = spec.and_then(|s| s.traffic_distribution.as_deref());
    let annotations = svc.metadata.annotations.as_ref();
    let auto = |key: &str| {
        annotations
            .and_then(|a| a.get(key))
            .is_some_and(|v| v == "Auto" || v == "auto")
    };
    // PreferSameNode also carries zone hints; its node hints are not used yet.
    let topology_aware = matches!(
        distribution,
        Some("PreferClose" | "PreferSameZone" | "PreferSameNode")
    ) || auto(ANNOTATION_TOPOLOGY_MODE)
        || auto(ANNOTATION_TOPOLOGY_AWARE_HINTS);
    Policy {
        local_only,
        topology_aware,
    }
}

fn namespaced_name(svc: &Service) -> String {
    format!(
        "{}/{}",
        svc.metadata.namespace.as_deref().unwrap_or("default"),
        svc.metadata.name.as_deref().unwrap_or("?")
    )
}
