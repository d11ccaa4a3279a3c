//! Services as the sources keep them: each API `Service` converted on arrival into a
//! [`ServiceData`] holding only what translation, metrics and Events read (a k8s-openapi `Service`
//! is about 830 bytes before any string; this is a third of that), like
//! [`crate::sources::endpoints::SliceData`] for EndpointSlices.
//!
//! Nothing is interpreted here (no parsing, no problems): translate reads the raw values and
//! reports what is wrong with them, naming the Service, exactly as it did from the API object.

use std::{fmt, net::Ipv4Addr};

use k8s_openapi::{api::core::v1::Service, jiff::Timestamp};

use crate::sources::{
    names::{self, Name},
    object_version,
};

/// Label marking a Service as owned by another proxy.
pub const LABEL_SERVICE_PROXY_NAME: &str = "service.kubernetes.io/service-proxy-name";
/// Legacy annotation for loadBalancerSourceRanges (comma-separated), used when the field is empty.
pub const ANNOTATION_LB_SOURCE_RANGES: &str =
    "service.beta.kubernetes.io/load-balancer-source-ranges";
/// Annotation choosing the Service's load-balancing scheduler (a name
/// [`crate::pipeline::model::Scheduler::parse`] takes: ours or an IPVS alias); wins over the
/// node's `--scheduler` / `ipvs.scheduler`.
pub const ANNOTATION_SCHEDULER: &str = "kube-proxy-ebpf.io/scheduler";

/// A Service as the sources keep it. Equal Services give equal values (the translation cache
/// compares a new `Arc` by value).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ServiceData {
    /// Shared with every object of the namespace ([`names::namespace`]).
    pub namespace: Option<Name>,
    /// Shared with the translation cache and its change lists (which hold this `Arc`).
    pub name: Option<Name>,
    /// For the Events naming this Service.
    pub uid: Option<Box<str>>,
    pub resource_version: Option<Box<str>>,
    /// Identifies this version of the object (see [`object_version::fingerprint`]).
    pub fingerprint: u64,
    /// `metadata.creationTimestamp` (the older Service wins a contested frontend).
    pub created: Option<Timestamp>,
    /// The `service.kubernetes.io/service-proxy-name` label is set (another proxy's Service).
    pub other_proxy: bool,
    /// `spec.type`, as far as translation tells the types apart.
    pub type_: ServiceType,
    /// `spec.clusterIPs`, or `spec.clusterIP` when clusterIPs is absent or empty.
    pub cluster_ips: Box<[ClusterIp]>,
    /// `spec.ipFamilies` (which family each of `cluster_ips` is, primary first). One byte, in
    /// what was padding: an IPv4-only Service costs nothing more.
    pub ip_families: IpFamilies,
    /// `spec.externalTrafficPolicy` is `Local`.
    pub external_local: bool,
    /// `spec.internalTrafficPolicy` is `Local`.
    pub internal_local: bool,
    /// `spec.sessionAffinity` is `ClientIP`.
    pub client_ip_affinity: bool,
    pub ports: Box<[ServicePortData]>,
    /// What most Services leave unset (`None`: all of it), read through [`ServiceData::extra`].
    /// Boxed: it is a third of the struct, and there is one per Service.
    pub extra: Option<Box<ServiceExtra>>,
}

/// A cluster IP: an IPv4 address parsed (no string kept: most are), anything else as written
/// (IPv6, parsed by translate; `None`, empty, or a bad value translate reports). An IPv6 variant
/// would make every entry 24 bytes instead of 16.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ClusterIp {
    V4(Ipv4Addr),
    Other(Box<str>),
}

impl ClusterIp {
    fn new(raw: &str) -> Self {
        // An address that parses prints back as written (the parser takes only that form).
        match raw.parse() {
            Ok(addr) => ClusterIp::V4(addr),
            Err(_) => ClusterIp::Other(raw.into()),
        }
    }
}

impl fmt::Display for ClusterIp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ClusterIp::V4(addr) => addr.fmt(f),
            ClusterIp::Other(raw) => f.write_str(raw),
        }
    }
}

/// `spec.ipFamilies`: absent or empty (older API servers, manifests), one or two families in
/// order, or anything else (translate reports it).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum IpFamilies {
    #[default]
    Unset,
    V4,
    V6,
    /// Dual-stack, IPv4 primary.
    V4V6,
    /// Dual-stack, IPv6 primary.
    V6V4,
    /// An unknown family name, a family twice, or more than two.
    Invalid,
}

impl IpFamilies {
    fn parse(families: Option<&[String]>) -> Self {
        let families: Vec<&str> = families
            .iter()
            .flat_map(|f| f.iter())
            .map(|f| f.as_str())
            .collect();
        match families[..] {
            [] => IpFamilies::Unset,
            ["IPv4"] => IpFamilies::V4,
            ["IPv6"] => IpFamilies::V6,
            ["IPv4", "IPv6"] => IpFamilies::V4V6,
            ["IPv6", "IPv4"] => IpFamilies::V6V4,
            _ => IpFamilies::Invalid,
        }
    }

    /// The families in `spec.ipFamilies` order (empty when unset or invalid).
    pub fn names(self) -> &'static [&'static str] {
        match self {
            IpFamilies::Unset | IpFamilies::Invalid => &[],
            IpFamilies::V4 => &["IPv4"],
            IpFamilies::V6 => &["IPv6"],
            IpFamilies::V4V6 => &["IPv4", "IPv6"],
            IpFamilies::V6V4 => &["IPv6", "IPv4"],
        }
    }
}

/// `spec.ports[].protocol` (absent: TCP, as the API defaults it); anything unknown as written.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum PortProtocol {
    #[default]
    Tcp,
    Udp,
    Sctp,
    Other(Box<str>),
}

impl PortProtocol {
    fn new(raw: Option<&str>) -> Self {
        match raw {
            None | Some("TCP") => PortProtocol::Tcp,
            Some("UDP") => PortProtocol::Udp,
            Some("SCTP") => PortProtocol::Sctp,
            Some(other) => PortProtocol::Other(other.into()),
        }
    }
}

/// `spec.type`. Translation only tells these apart: a missing or unknown type is translated as a
/// ClusterIP Service, as it always was.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum ServiceType {
    #[default]
    ClusterIp,
    NodePort,
    LoadBalancer,
    ExternalName,
}

impl ServiceType {
    fn parse(type_: Option<&str>) -> Self {
        match type_ {
            Some("NodePort") => ServiceType::NodePort,
            Some("LoadBalancer") => ServiceType::LoadBalancer,
            Some("ExternalName") => ServiceType::ExternalName,
            _ => ServiceType::ClusterIp,
        }
    }
}

/// The parts of a Service that most leave unset, raw (translate reports bad values).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ServiceExtra {
    /// The scheduler annotation, as written.
    pub scheduler_annotation: Option<Box<str>>,
    /// The legacy loadBalancerSourceRanges annotation, as written.
    pub source_ranges_annotation: Option<Box<str>>,
    pub external_ips: Box<[Box<str>]>,
    pub load_balancer_source_ranges: Box<[Box<str>]>,
    pub health_check_node_port: Option<i32>,
    /// `spec.sessionAffinityConfig.clientIP.timeoutSeconds`.
    pub affinity_timeout_seconds: Option<i32>,
    /// `status.loadBalancer.ingress[].ip` of the entries whose ipMode is not `Proxy`.
    pub lb_ingress_ips: Box<[Box<str>]>,
}

static NO_EXTRA: std::sync::LazyLock<ServiceExtra> = std::sync::LazyLock::new(Default::default);

/// One `spec.ports[]` entry.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ServicePortData {
    pub name: Option<Box<str>>,
    pub protocol: PortProtocol,
    pub port: i32,
    pub node_port: Option<i32>,
}

fn boxed(s: &Option<String>) -> Option<Box<str>> {
    s.as_deref().map(Into::into)
}

fn all(v: &Option<Vec<String>>) -> Box<[Box<str>]> {
    v.iter().flatten().map(|s| s.as_str().into()).collect()
}

impl From<&Service> for ServiceData {
    fn from(svc: &Service) -> Self {
        let meta = &svc.metadata;
        let annotation = |key: &str| {
            meta.annotations
                .as_ref()
                .and_then(|a| a.get(key))
                .map(|v| v.as_str().into())
        };
        let mut out = Self {
            namespace: meta.namespace.as_deref().map(names::namespace),
            name: meta.name.as_deref().map(Name::from),
            uid: boxed(&meta.uid),
            resource_version: boxed(&meta.resource_version),
            fingerprint: object_version::fingerprint(svc),
            created: meta.creation_timestamp.as_ref().map(|t| t.0),
            other_proxy: meta
                .labels
                .as_ref()
                .is_some_and(|l| l.contains_key(LABEL_SERVICE_PROXY_NAME)),
            ..Self::default()
        };
        let mut extra = ServiceExtra {
            scheduler_annotation: annotation(ANNOTATION_SCHEDULER),
            source_ranges_annotation: annotation(ANNOTATION_LB_SOURCE_RANGES),
            lb_ingress_ips: (svc.status.iter())
                .flat_map(|s| s.load_balancer.iter())
                .flat_map(|lb| lb.ingress.iter().flatten())
                .filter(|i| i.ip_mode.as_deref() != Some("Proxy"))
                .filter_map(|i| i.ip.as_deref().map(Into::into))
                .collect(),
            ..ServiceExtra::default()
        };
        if let Some(spec) = &svc.spec {
            out.type_ = ServiceType::parse(spec.type_.as_deref());
            out.cluster_ips = match &spec.cluster_ips {
                Some(ips) if !ips.is_empty() => ips.iter().map(|ip| ClusterIp::new(ip)).collect(),
                _ => spec
                    .cluster_ip
                    .iter()
                    .map(|ip| ClusterIp::new(ip))
                    .collect(),
            };
            out.ip_families = IpFamilies::parse(spec.ip_families.as_deref());
            out.external_local = spec.external_traffic_policy.as_deref() == Some("Local");
            out.internal_local = spec.internal_traffic_policy.as_deref() == Some("Local");
            out.client_ip_affinity = spec.session_affinity.as_deref() == Some("ClientIP");
            extra.external_ips = all(&spec.external_ips);
            extra.load_balancer_source_ranges = all(&spec.load_balancer_source_ranges);
            extra.health_check_node_port = spec.health_check_node_port;
            extra.affinity_timeout_seconds = (spec.session_affinity_config.as_ref())
                .and_then(|c| c.client_ip.as_ref())
                .and_then(|c| c.timeout_seconds);
            out.ports = (spec.ports.iter().flatten())
                .map(|p| ServicePortData {
                    name: boxed(&p.name),
                    protocol: PortProtocol::new(p.protocol.as_deref()),
                    port: p.port,
                    node_port: p.node_port,
                })
                .collect();
        }
        if extra != ServiceExtra::default() {
            out.extra = Some(Box::new(extra));
        }
        out
    }
}

impl From<Service> for ServiceData {
    fn from(svc: Service) -> Self {
        Self::from(&svc)
    }
}

impl ServiceData {
    /// What most Services leave unset (all empty when it is).
    pub fn extra(&self) -> &ServiceExtra {
        self.extra.as_deref().unwrap_or(&NO_EXTRA)
    }

    /// `namespace/name` for messages (`default` and `?` where missing).
    pub fn namespaced_name(&self) -> String {
        format!(
            "{}/{}",
            self.namespace.as_deref().unwrap_or("default"),
            self.name.as_deref().unwrap_or("?")
        )
    }
}

// The reflector store keys objects by kind, name and namespace (no `ObjectMeta` here).
lookup_from_fields!(ServiceData, kind: "Service", group: "", plural: "services", uid: |s| s.uid.as_deref());

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn service(v: serde_json::Value) -> ServiceData {
        ServiceData::from(serde_json::from_value::<Service>(v).expect("Service fixture"))
    }

    /// What translate reads survives the conversion, raw (translate reports bad values).
    #[test]
    fn keeps_what_translate_reads_raw() {
        let svc = service(json!({
            "metadata": {"name": "web", "namespace": "demo", "uid": "u-1",
                "resourceVersion": "7", "creationTimestamp": "2026-01-01T00:00:00Z",
                "labels": {"app": "web"},
                "annotations": {ANNOTATION_SCHEDULER: " mh ", "other": "x"}},
            "spec": {"type": "LoadBalancer", "clusterIP": "10.96.0.1", "clusterIPs": [],
                "externalIPs": ["192.0.2.1", "not-an-ip"], "selector": {"app": "web"},
                "externalTrafficPolicy": "Local", "healthCheckNodePort": 30000,
                "sessionAffinity": "ClientIP",
                "sessionAffinityConfig": {"clientIP": {"timeoutSeconds": 0}},
                "ports": [{"name": "http", "port": 80, "nodePort": 30080, "protocol": "SCTP"}]},
            "status": {"loadBalancer": {"ingress": [{"ip": "192.0.2.9", "ipMode": "VIP"},
                {"ip": "192.0.2.10", "ipMode": "Proxy"}, {"hostname": "lb.example"}]}},
        }));
        let strs = |v: &[Box<str>]| v.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        assert_eq!(svc.namespaced_name(), "demo/web");
        assert_eq!(svc.uid.as_deref(), Some("u-1"));
        assert!(svc.created.is_some());
        assert!(!svc.other_proxy);
        assert_eq!(
            svc.extra().scheduler_annotation.as_deref(),
            Some(" mh "),
            "untrimmed"
        );
        assert_eq!(
            &*svc.cluster_ips,
            [ClusterIp::V4(Ipv4Addr::new(10, 96, 0, 1))],
            "empty clusterIPs: clusterIP"
        );
        assert_eq!(strs(&svc.extra().external_ips), ["192.0.2.1", "not-an-ip"]);
        assert_eq!(
            strs(&svc.extra().lb_ingress_ips),
            ["192.0.2.9"],
            "ipMode Proxy left out"
        );
        assert_eq!(
            svc.extra().affinity_timeout_seconds,
            Some(0),
            "kept for translate to refuse"
        );
        assert_eq!(
            &*svc.ports,
            [ServicePortData {
                name: Some("http".into()),
                protocol: PortProtocol::Sctp,
                port: 80,
                node_port: Some(30080),
            }]
        );
        assert_eq!(svc.extra().health_check_node_port, Some(30000));
        assert_eq!(svc.type_, ServiceType::LoadBalancer);
        assert!(svc.external_local && !svc.internal_local && svc.client_ip_affinity);
    }

    /// A dual-stack Service keeps both cluster IPs in order with its families, and its IPv6
    /// externalIPs, LoadBalancer IPs and source ranges raw (translate builds each family's
    /// frontends from them); the families cost no byte beside IPv4's fields.
    #[test]
    fn keeps_both_families_of_a_dual_stack_service() {
        let svc = service(json!({
            "metadata": {"name": "web", "namespace": "demo"},
            "spec": {"type": "LoadBalancer", "clusterIP": "fd00:96::a",
                "clusterIPs": ["fd00:96::a", "10.96.0.10"], "ipFamilies": ["IPv6", "IPv4"],
                "ipFamilyPolicy": "RequireDualStack",
                "externalIPs": ["2001:db8::1", "192.0.2.1"],
                "loadBalancerSourceRanges": ["2001:db8:1::/48", "10.0.0.0/8"],
                "ports": [{"port": 80}]},
            "status": {"loadBalancer": {"ingress": [{"ip": "2001:db8::9"}]}},
        }));
        assert_eq!(
            &*svc.cluster_ips,
            [
                ClusterIp::Other("fd00:96::a".into()),
                ClusterIp::V4(Ipv4Addr::new(10, 96, 0, 10))
            ]
        );
        assert_eq!(svc.ip_families, IpFamilies::V6V4);
        assert_eq!(svc.ip_families.names(), ["IPv6", "IPv4"]);
        let strs = |v: &[Box<str>]| v.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        assert_eq!(
            strs(&svc.extra().external_ips),
            ["2001:db8::1", "192.0.2.1"]
        );
        assert_eq!(strs(&svc.extra().lb_ingress_ips), ["2001:db8::9"]);
        assert_eq!(
            strs(&svc.extra().load_balancer_source_ranges),
            ["2001:db8:1::/48", "10.0.0.0/8"]
        );
        let families = |v: serde_json::Value| {
            service(json!({"metadata": {"name": "a"}, "spec": {"ipFamilies": v}})).ip_families
        };
        assert_eq!(families(json!(["IPv4"])), IpFamilies::V4);
        assert_eq!(families(json!(["IPv4", "IPv6"])), IpFamilies::V4V6);
        assert_eq!(families(json!([])), IpFamilies::Unset);
        assert_eq!(families(json!(["IPv4", "IPv4"])), IpFamilies::Invalid);
        assert_eq!(families(json!(["IPv5"])), IpFamilies::Invalid);
        assert_eq!(std::mem::size_of::<ServiceData>(), SERVICE_DATA_SIZE);
    }

    /// `ServiceData`'s size, as before `ip_families` (measured on main: the byte went into
    /// padding; one per Service, 50,000 of them in the memory target of issue 11).
    const SERVICE_DATA_SIZE: usize = 144;

    /// A new resourceVersion is a new version even when nothing translate reads changed (the
    /// translation cache and metrics compare fingerprints).
    #[test]
    fn the_fingerprint_follows_the_object_version() {
        let at = |rv: &str| {
            service(
                json!({"metadata": {"name": "a", "namespace": "n", "resourceVersion": rv},
                "spec": {"clusterIP": "10.96.0.1"}}),
            )
        };
        assert_eq!(at("1"), at("1"));
        assert_ne!(at("1").fingerprint, at("2").fingerprint);
        assert_ne!(at("1"), at("2"));
    }
}
