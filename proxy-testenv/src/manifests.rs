//! A folder of Service + EndpointSlice manifests for the agent's standalone mode.

use std::{
    fmt::{self, Write as _},
    net::{IpAddr, Ipv4Addr},
    path::{Path, PathBuf},
};

use anyhow::{Context as _, Result};

use crate::tempdir::TempDir;

/// L4 protocol of a Service port.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Protocol {
    Tcp,
    Udp,
    Sctp,
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

/// One Service port and the port its endpoints listen on.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ServicePort {
    /// Port name; may be empty when the Service has a single port.
    pub name: String,
    pub port: u16,
    pub target_port: u16,
    pub protocol: Protocol,
}

impl ServicePort {
    pub fn tcp(port: u16, target_port: u16) -> Self {
        Self {
            name: String::new(),
            port,
            target_port,
            protocol: Protocol::Tcp,
        }
    }

    pub fn udp(port: u16, target_port: u16) -> Self {
        Self {
            name: String::new(),
            port,
            target_port,
            protocol: Protocol::Udp,
        }
    }

    pub fn sctp(port: u16, target_port: u16) -> Self {
        Self {
            name: String::new(),
            port,
            target_port,
            protocol: Protocol::Sctp,
        }
    }

    /// The same port with a name (needed when a Service has several ports).
    pub fn named(mut self, name: &str) -> Self {
        self.name = name.to_owned();
        self
    }
}

/// A temporary manifests folder. Each Service lives in `<ns>-<name>.yaml` (Service and its
/// EndpointSlice, two documents), written atomically (staged next door, then renamed).
#[derive(Debug)]
pub struct ManifestDir {
    root: TempDir,
    dir: PathBuf,
    staging: PathBuf,
}

impl ManifestDir {
    pub fn new() -> Result<Self> {
        let root = TempDir::new("kpe-manifests")?;
        let dir = root.join("manifests");
        let staging = root.join("staging");
        std::fs::create_dir(&dir)?;
        std::fs::create_dir(&staging)?;
        Ok(Self { root, dir, staging })
    }

    /// The folder to pass as `--manifests`.
    pub fn path(&self) -> &Path {
        &self.dir
    }

    /// Writes (or replaces) a ClusterIP Service with ready endpoints at `endpoints`.
    pub fn write_service(
        &self,
        namespace: &str,
        name: &str,
        cluster_ip: Ipv4Addr,
        ports: &[ServicePort],
        endpoints: &[Ipv4Addr],
    ) -> Result<PathBuf> {
        self.write_service_annotated(namespace, name, cluster_ip, ports, endpoints, &[])
    }

    /// [`ManifestDir::write_service`] with Service annotations (key, value).
    pub fn write_service_annotated(
        &self,
        namespace: &str,
        name: &str,
        cluster_ip: Ipv4Addr,
        ports: &[ServicePort],
        endpoints: &[Ipv4Addr],
        annotations: &[(&str, &str)],
    ) -> Result<PathBuf> {
        let yaml =
            service_yaml_annotated(namespace, name, cluster_ip, ports, endpoints, annotations);
        self.write_yaml(namespace, name, &yaml)
    }

    /// Writes (or replaces) a Service of one or both families ([`family_service_yaml`]).
    pub fn write_family_service(&self, svc: &FamilyService<'_>) -> Result<PathBuf> {
        self.write_yaml(svc.namespace, svc.name, &family_service_yaml(svc))
    }

    /// Writes (or replaces) `<namespace>-<name>.yaml` with `yaml`, atomically.
    pub fn write_yaml(&self, namespace: &str, name: &str, yaml: &str) -> Result<PathBuf> {
        let file = format!("{namespace}-{name}.yaml");
        let staged = self.staging.join(&file);
        let target = self.dir.join(&file);
        std::fs::write(&staged, yaml).with_context(|| format!("writing {}", staged.display()))?;
        std::fs::rename(&staged, &target)
            .with_context(|| format!("renaming into {}", target.display()))?;
        Ok(target)
    }

    /// Removes a Service written by [`ManifestDir::write_service`].
    pub fn remove_service(&self, namespace: &str, name: &str) -> Result<()> {
        let target = self.dir.join(format!("{namespace}-{name}.yaml"));
        std::fs::remove_file(&target).with_context(|| format!("removing {}", target.display()))
    }

    /// The temp root (manifests/ and staging/ live in it); also a good place for logs.
    pub fn root(&self) -> &Path {
        self.root.path()
    }
}

/// The two YAML documents for a Service and its EndpointSlice.
pub fn service_yaml(
    namespace: &str,
    name: &str,
    cluster_ip: Ipv4Addr,
    ports: &[ServicePort],
    endpoints: &[Ipv4Addr],
) -> String {
    service_yaml_annotated(namespace, name, cluster_ip, ports, endpoints, &[])
}

/// [`service_yaml`] with Service annotations (values quoted as JSON strings).
pub fn service_yaml_annotated(
    namespace: &str,
    name: &str,
    cluster_ip: Ipv4Addr,
    ports: &[ServicePort],
    endpoints: &[Ipv4Addr],
    annotations: &[(&str, &str)],
) -> String {
    let mut y = String::new();
    let _ = write!(
        y,
        "apiVersion: v1\nkind: Service\nmetadata:\n  name: {name}\n  namespace: {namespace}\n"
    );
    if !annotations.is_empty() {
        y.push_str("  annotations:\n");
        for (k, v) in annotations {
            let _ = writeln!(y, "    {k}: {v:?}");
        }
    }
    let _ = write!(
        y,
        "spec:\n  type: ClusterIP\n  clusterIP: {cluster_ip}\n  clusterIPs: [\"{cluster_ip}\"]\n  ports:\n"
    );
    service_ports(&mut y, ports, &[]);
    let _ = write!(
        y,
        "---\napiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata:\n  name: {name}-slice\n  \
         namespace: {namespace}\n  labels:\n    kubernetes.io/service-name: {name}\naddressType: IPv4\n"
    );
    slice_ports(&mut y, ports);
    if endpoints.is_empty() {
        y.push_str("endpoints: []\n");
    } else {
        y.push_str("endpoints:\n");
        for ip in endpoints {
            let _ = writeln!(
                y,
                "  - addresses: [\"{ip}\"]\n    conditions:\n      ready: true\n      serving: true\n      \
                 terminating: false"
            );
        }
    }
    y
}

/// The items of a Service's `ports:` (a `nodePort` for each of `node_ports`, in order).
fn service_ports(y: &mut String, ports: &[ServicePort], node_ports: &[u16]) {
    for (i, p) in ports.iter().enumerate() {
        let _ = write!(y, "    - ");
        if !p.name.is_empty() {
            let _ = write!(y, "name: {}\n      ", p.name);
        }
        let _ = writeln!(
            y,
            "port: {}\n      targetPort: {}\n      protocol: {}",
            p.port, p.target_port, p.protocol
        );
        if let Some(np) = node_ports.get(i) {
            let _ = writeln!(y, "      nodePort: {np}");
        }
    }
}

/// An EndpointSlice's `ports:` (the target ports, named as the Service's).
fn slice_ports(y: &mut String, ports: &[ServicePort]) {
    if ports.is_empty() {
        y.push_str("ports: []\n");
        return;
    }
    y.push_str("ports:\n");
    for p in ports {
        let _ = writeln!(
            y,
            "  - name: \"{}\"\n    port: {}\n    protocol: {}",
            p.name, p.target_port, p.protocol
        );
    }
}

/// A Service of one family or both (`clusterIPs` in `cluster_ips` order, which is also
/// `ipFamilies`' order: the first is the primary), with one EndpointSlice per family it has
/// (`<name>-v4`/`<name>-v6`, addressType IPv4/IPv6) holding that family's `endpoints` — empty
/// when there are none, as the EndpointSlice controller writes it.
#[derive(Clone, Debug)]
pub struct FamilyService<'a> {
    pub namespace: &'a str,
    pub name: &'a str,
    pub cluster_ips: &'a [IpAddr],
    pub ports: &'a [ServicePort],
    /// A `nodePort` per port (same order): a NodePort Service; empty: ClusterIP.
    pub node_ports: &'a [u16],
    /// Ready endpoints of either family.
    pub endpoints: &'a [IpAddr],
}

/// The YAML documents of a [`FamilyService`]: the Service, then its slices (IPv4 first).
/// `ipFamilyPolicy` is SingleStack for one cluster IP, RequireDualStack for two.
pub fn family_service_yaml(svc: &FamilyService<'_>) -> String {
    let FamilyService {
        namespace,
        name,
        cluster_ips,
        ports,
        node_ports,
        endpoints,
    } = svc;
    let family = |ip: &IpAddr| if ip.is_ipv4() { "IPv4" } else { "IPv6" };
    let quoted = |items: Vec<String>| {
        items
            .iter()
            .map(|i| format!("\"{i}\""))
            .collect::<Vec<_>>()
            .join(", ")
    };
    let kind = if node_ports.is_empty() {
        "ClusterIP"
    } else {
        "NodePort"
    };
    let policy = if cluster_ips.len() > 1 {
        "RequireDualStack"
    } else {
        "SingleStack"
    };
    let mut y = String::new();
    let _ = write!(
        y,
        "apiVersion: v1\nkind: Service\nmetadata:\n  name: {name}\n  namespace: {namespace}\n\
         spec:\n  type: {kind}\n  ipFamilyPolicy: {policy}\n  ipFamilies: [{}]\n",
        quoted(cluster_ips.iter().map(|ip| family(ip).to_owned()).collect())
    );
    if let Some(first) = cluster_ips.first() {
        let _ = writeln!(y, "  clusterIP: \"{first}\"");
    }
    let _ = writeln!(
        y,
        "  clusterIPs: [{}]",
        quoted(cluster_ips.iter().map(IpAddr::to_string).collect())
    );
    y.push_str("  ports:\n");
    service_ports(&mut y, ports, node_ports);
    let mut families: Vec<&str> = cluster_ips.iter().map(family).collect();
    families.sort();
    families.dedup();
    for fam in families {
        let suffix = if fam == "IPv4" { "v4" } else { "v6" };
        let _ = write!(
            y,
            "---\napiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata:\n  name: \
             {name}-{suffix}\n  namespace: {namespace}\n  labels:\n    \
             kubernetes.io/service-name: {name}\naddressType: {fam}\n"
        );
        slice_ports(&mut y, ports);
        let mine: Vec<&IpAddr> = endpoints.iter().filter(|ip| family(ip) == fam).collect();
        if mine.is_empty() {
            y.push_str("endpoints: []\n");
            continue;
        }
        y.push_str("endpoints:\n");
        for ip in mine {
            let _ = writeln!(
                y,
                "  - addresses: [\"{ip}\"]\n    conditions: {{ready: true, serving: true, \
                 terminating: false}}"
            );
        }
    }
    y
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn service_yaml_has_both_documents() {
        let y = service_yaml(
            "demo",
            "web",
            Ipv4Addr::new(10, 96, 0, 10),
            &[ServicePort::tcp(80, 8080)],
            &[Ipv4Addr::new(10, 244, 1, 11), Ipv4Addr::new(10, 244, 1, 12)],
        );
        let expected = "\
apiVersion: v1
kind: Service
metadata:
  name: web
  namespace: demo
spec:
  type: ClusterIP
  clusterIP: 10.96.0.10
  clusterIPs: [\"10.96.0.10\"]
  ports:
    - port: 80
      targetPort: 8080
      protocol: TCP
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata:
  name: web-slice
  namespace: demo
  labels:
    kubernetes.io/service-name: web
addressType: IPv4
ports:
  - name: \"\"
    port: 8080
    protocol: TCP
endpoints:
  - addresses: [\"10.244.1.11\"]
    conditions:
      ready: true
      serving: true
      terminating: false
  - addresses: [\"10.244.1.12\"]
    conditions:
      ready: true
      serving: true
      terminating: false
";
        assert_eq!(y, expected);
    }

    #[test]
    fn named_ports_and_no_endpoints() {
        let y = service_yaml(
            "demo",
            "empty",
            Ipv4Addr::new(10, 96, 0, 30),
            &[ServicePort::udp(53, 5353).named("dns")],
            &[],
        );
        assert!(y.contains(
            "    - name: dns\n      port: 53\n      targetPort: 5353\n      protocol: UDP\n"
        ));
        assert!(y.contains("  - name: \"dns\"\n    port: 5353\n    protocol: UDP\n"));
        assert!(y.ends_with("endpoints: []\n"));
    }

    #[test]
    fn write_and_remove() {
        let dir = ManifestDir::new().expect("temp dir");
        let path = dir
            .write_service(
                "a",
                "b",
                Ipv4Addr::new(10, 96, 0, 1),
                &[ServicePort::tcp(1, 2)],
                &[],
            )
            .expect("write");
        assert!(path.starts_with(dir.path()));
        assert_eq!(std::fs::read_dir(dir.path()).expect("read").count(), 1);
        dir.remove_service("a", "b").expect("remove");
        assert_eq!(std::fs::read_dir(dir.path()).expect("read").count(), 0);
    }

    #[test]
    fn family_service_has_a_slice_per_family() {
        let ips: [IpAddr; 2] = [
            "10.96.0.10".parse().unwrap(),
            "fd00:10:96::10".parse().unwrap(),
        ];
        let eps: [IpAddr; 3] = [
            "fd00:10:244:1::11".parse().unwrap(),
            "10.244.1.11".parse().unwrap(),
            "fd00:10:244:1::12".parse().unwrap(),
        ];
        let y = family_service_yaml(&FamilyService {
            namespace: "demo",
            name: "web",
            cluster_ips: &ips,
            ports: &[ServicePort::tcp(80, 8080).named("http")],
            node_ports: &[30080],
            endpoints: &eps,
        });
        let expected = "\
apiVersion: v1
kind: Service
metadata:
  name: web
  namespace: demo
spec:
  type: NodePort
  ipFamilyPolicy: RequireDualStack
  ipFamilies: [\"IPv4\", \"IPv6\"]
  clusterIP: \"10.96.0.10\"
  clusterIPs: [\"10.96.0.10\", \"fd00:10:96::10\"]
  ports:
    - name: http
      port: 80
      targetPort: 8080
      protocol: TCP
      nodePort: 30080
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata:
  name: web-v4
  namespace: demo
  labels:
    kubernetes.io/service-name: web
addressType: IPv4
ports:
  - name: \"http\"
    port: 8080
    protocol: TCP
endpoints:
  - addresses: [\"10.244.1.11\"]
    conditions: {ready: true, serving: true, terminating: false}
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata:
  name: web-v6
  namespace: demo
  labels:
    kubernetes.io/service-name: web
addressType: IPv6
ports:
  - name: \"http\"
    port: 8080
    protocol: TCP
endpoints:
  - addresses: [\"fd00:10:244:1::11\"]
    conditions: {ready: true, serving: true, terminating: false}
  - addresses: [\"fd00:10:244:1::12\"]
    conditions: {ready: true, serving: true, terminating: false}
";
        assert_eq!(y, expected);
        // IPv6 only, and a family without endpoints gets an empty slice.
        let v6: [IpAddr; 1] = ["fd00:10:96::20".parse().unwrap()];
        let y = family_service_yaml(&FamilyService {
            namespace: "demo",
            name: "only6",
            cluster_ips: &v6,
            ports: &[ServicePort::udp(53, 5353)],
            node_ports: &[],
            endpoints: &eps[1..2],
        });
        assert!(
            y.contains(
                "  type: ClusterIP\n  ipFamilyPolicy: SingleStack\n  ipFamilies: [\"IPv6\"]\n"
            ),
            "{y}"
        );
        assert!(y.contains("addressType: IPv6\n"), "{y}");
        assert!(!y.contains("addressType: IPv4"), "{y}");
        assert!(y.ends_with("endpoints: []\n"), "{y}");
    }
}
