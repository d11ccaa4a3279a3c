//! The Services a bench run programs, and the same set in every form it is fed to: a
//! [`Snapshot`] (in-process pipeline), a manifest folder (the agent binary), an iptables-restore
//! file (kube-proxy iptables mode) and an nft file (kube-proxy nftables mode).
//!
//! Generated Service `i`: ClusterIP 10.96.4.0 + i, port 80/TCP, 10 endpoints. Endpoint addresses
//! come from 10.244.0.1–10.244.234.96 (6,000 Services × 10 per block) and each block of 6,000
//! Services uses its own target port (8080 + block), so every endpoint (addr, port) is unique, as
//! pods are in a real cluster. Real pods of the end-to-end topology live in 10.244.255.0/24, never
//! generated.

use std::{collections::BTreeMap, fmt::Write as _, net::Ipv4Addr, path::Path};

use anyhow::{Context as _, Result};
use k8s_openapi::{
    api::{
        core::v1::{Service, ServicePort, ServiceSpec},
        discovery::v1::{Endpoint, EndpointConditions, EndpointPort, EndpointSlice},
    },
    apimachinery::pkg::{apis::meta::v1::ObjectMeta, util::intstr::IntOrString},
};
use kube_proxy_ebpf::sources::{endpoints::SliceData, snapshot::Snapshot};
use proxy_testenv::kube_proxy::{self, KubeProxyService};

pub const NAMESPACE: &str = "bench";
pub const ENDPOINTS_PER_SERVICE: usize = 10;
const BLOCK: usize = 6_000;
/// Pod CIDR as kube-proxy's `--cluster-cidr` (masquerade rules exempt it).
pub const CLUSTER_CIDR: &str = "10.244.0.0/16";

/// One single-port TCP ClusterIP Service and its ready endpoints.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SvcSpec {
    pub name: String,
    pub vip: Ipv4Addr,
    pub port: u16,
    pub target_port: u16,
    pub endpoints: Vec<Ipv4Addr>,
    /// The `kube-proxy-ebpf.io/scheduler` annotation (in-process snapshot only; `None`: the
    /// node's scheduler).
    pub scheduler: Option<&'static str>,
}

impl SvcSpec {
    pub fn new(name: &str, vip: Ipv4Addr, port: u16, target_port: u16, eps: &[Ipv4Addr]) -> Self {
        Self {
            name: name.to_owned(),
            vip,
            port,
            target_port,
            endpoints: eps.to_vec(),
            scheduler: None,
        }
    }

    /// The same Service with the scheduler annotation.
    pub fn with_scheduler(mut self, name: &'static str) -> Self {
        self.scheduler = Some(name);
        self
    }
}

/// `n` generated Services, 10 endpoints each.
pub fn generated(n: usize) -> Vec<SvcSpec> {
    (0..n)
        .map(|i| {
            let vip = Ipv4Addr::from(u32::from(Ipv4Addr::new(10, 96, 4, 0)) + i as u32);
            let block = i / BLOCK;
            let base = u32::from(Ipv4Addr::new(10, 244, 0, 1)) + ((i % BLOCK) * 10) as u32;
            let endpoints = (0..ENDPOINTS_PER_SERVICE as u32)
                .map(|j| Ipv4Addr::from(base + j))
                .collect();
            SvcSpec {
                name: format!("svc-{i}"),
                vip,
                port: 80,
                target_port: 8080 + block as u16,
                endpoints,
                scheduler: None,
            }
        })
        .collect()
}

/// The Services as a source snapshot (what translate reads; slices converted as the sources do).
pub fn snapshot(specs: &[SvcSpec]) -> Snapshot {
    let mut snap = Snapshot::default();
    for s in specs {
        std::sync::Arc::make_mut(&mut snap.services).push(std::sync::Arc::new(service(s).into()));
        std::sync::Arc::make_mut(&mut snap.endpoint_slices)
            .push(std::sync::Arc::new(SliceData::from(&slice(s))));
    }
    snap
}

pub fn service(s: &SvcSpec) -> Service {
    Service {
        metadata: ObjectMeta {
            name: Some(s.name.clone()),
            namespace: Some(NAMESPACE.to_owned()),
            annotations: s.scheduler.map(|name| {
                BTreeMap::from([(
                    kube_proxy_ebpf::pipeline::translate::ANNOTATION_SCHEDULER.to_owned(),
                    name.to_owned(),
                )])
            }),
            ..Default::default()
        },
        spec: Some(ServiceSpec {
            type_: Some("ClusterIP".to_owned()),
            cluster_ip: Some(s.vip.to_string()),
            cluster_ips: Some(vec![s.vip.to_string()]),
            ports: Some(vec![ServicePort {
                port: i32::from(s.port),
                target_port: Some(IntOrString::Int(i32::from(s.target_port))),
                protocol: Some("TCP".to_owned()),
                ..Default::default()
            }]),
            ..Default::default()
        }),
        ..Default::default()
    }
}

pub fn slice(s: &SvcSpec) -> EndpointSlice {
    EndpointSlice {
        metadata: ObjectMeta {
            name: Some(format!("{}-slice", s.name)),
            namespace: Some(NAMESPACE.to_owned()),
            labels: Some(BTreeMap::from([(
                "kubernetes.io/service-name".to_owned(),
                s.name.clone(),
            )])),
            ..Default::default()
        },
        address_type: "IPv4".to_owned(),
        ports: Some(vec![EndpointPort {
            name: Some(String::new()),
            port: Some(i32::from(s.target_port)),
            protocol: Some("TCP".to_owned()),
            ..Default::default()
        }]),
        endpoints: Some(
            s.endpoints
                .iter()
                .map(|ip| Endpoint {
                    addresses: vec![ip.to_string()],
                    conditions: Some(EndpointConditions {
                        ready: Some(true),
                        serving: Some(true),
                        terminating: Some(false),
                    }),
                    ..Default::default()
                })
                .collect(),
        ),
    }
}

/// Writes the Services as multi-document YAML files of 1,000 Services each into `dir`.
pub fn write_manifests(dir: &Path, specs: &[SvcSpec]) -> Result<()> {
    for (n, chunk) in specs.chunks(1_000).enumerate() {
        let mut y = String::with_capacity(chunk.len() * 1_200);
        for s in chunk {
            let _ = write!(
                y,
                "---\napiVersion: v1\nkind: Service\nmetadata:\n  name: {name}\n  namespace: {NAMESPACE}\n\
                 spec:\n  type: ClusterIP\n  clusterIP: {vip}\n  clusterIPs: [\"{vip}\"]\n  ports:\n    \
                 - port: {port}\n      targetPort: {tp}\n      protocol: TCP\n\
                 ---\napiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata:\n  name: {name}-slice\n  \
                 namespace: {NAMESPACE}\n  labels:\n    kubernetes.io/service-name: {name}\naddressType: IPv4\n\
                 ports:\n  - name: \"\"\n    port: {tp}\n    protocol: TCP\nendpoints:\n",
                name = s.name,
                vip = s.vip,
                port = s.port,
                tp = s.target_port,
            );
            for ip in &s.endpoints {
                let _ = writeln!(
                    y,
                    "  - addresses: [\"{ip}\"]\n    conditions: {{ready: true, serving: true, terminating: false}}"
                );
            }
        }
        let path = dir.join(format!("services-{n:04}.yaml"));
        std::fs::write(&path, y).with_context(|| format!("writing {}", path.display()))?;
    }
    Ok(())
}

/// The rules kube-proxy's iptables mode writes for these Services, from the one generator the
/// roll-back tests use too (`proxy_testenv::kube_proxy`). For `iptables-restore`.
pub fn iptables_restore(specs: &[SvcSpec]) -> String {
    kube_proxy::iptables_ruleset(&kube_proxy_services(specs), CLUSTER_CIDR)
}

/// These Services as kube-proxy programs them.
fn kube_proxy_services(specs: &[SvcSpec]) -> Vec<KubeProxyService> {
    specs
        .iter()
        .map(|s| {
            KubeProxyService::tcp(NAMESPACE, &s.name, s.vip, s.port)
                .target(s.target_port, &s.endpoints)
        })
        .collect()
}

/// The `table ip kube-proxy` kube-proxy's nftables mode writes for these Services (ClusterIP
/// part), from the one generator the roll-back tests use too (`proxy_testenv::kube_proxy`). For
/// `nft -f`.
pub fn nft_ruleset(specs: &[SvcSpec]) -> String {
    kube_proxy::nft_ruleset(&kube_proxy_services(specs), CLUSTER_CIDR)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn endpoints_are_unique_and_avoid_the_real_pods() {
        let specs = generated(20_000);
        let mut seen = std::collections::HashSet::new();
        for s in &specs {
            assert_eq!(s.endpoints.len(), ENDPOINTS_PER_SERVICE);
            for ep in &s.endpoints {
                assert!(seen.insert((*ep, s.target_port)), "{ep}:{}", s.target_port);
                assert_eq!(ep.octets()[..2], [10, 244]);
                assert!(ep.octets()[2] < 255);
            }
        }
    }

    #[test]
    fn iptables_probabilities_follow_kube_proxy() {
        let text = iptables_restore(&generated(1));
        assert!(text.contains("--probability 0.1000000000 "));
        assert!(text.contains("--probability 0.5000000000 "));
        assert_eq!(text.matches("-j DNAT").count(), 10);
        assert!(text.ends_with("COMMIT\n"));
    }
}
