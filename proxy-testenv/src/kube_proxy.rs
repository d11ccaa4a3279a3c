//! kube-proxy's nftables-mode rule set, generated for a handful of Services and loaded into a node
//! namespace with `nft`: what a node runs once kube-proxy is back (the roll-back tests), and the
//! baseline the benchmark compares against.
//!
//! The shape is upstream's (`pkg/proxy/nftables`, v1.36): `table ip kube-proxy` with the
//! `service-ips` verdict map (ClusterIP . protocol . port → the Service chain) consulted from the
//! nat prerouting and output hooks, `service-nodeports` (protocol . port → the Service's external
//! chain) for destinations local to the node, a per-Service chain that marks off-cluster clients
//! for masquerading and picks an endpoint with `numgen random mod N`, per-endpoint chains that
//! mark hairpin traffic and `dnat to` the endpoint, and masquerading of marked packets in
//! postrouting. Chain names carry a hash of the Service port's name like upstream's (FNV-1a here:
//! only the shape matters). The reject and filter parts are left out.

use std::{fmt::Write as _, net::Ipv4Addr};

use anyhow::{Context as _, Result, bail};

use crate::netns::NetNs;

/// One Service port as kube-proxy programs it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KubeProxyService {
    pub namespace: String,
    pub name: String,
    /// `tcp` or `udp`.
    pub protocol: &'static str,
    pub cluster_ip: Ipv4Addr,
    pub port: u16,
    /// With externalTrafficPolicy Cluster: external clients are masqueraded.
    pub node_port: Option<u16>,
    pub target_port: u16,
    pub endpoints: Vec<Ipv4Addr>,
}

impl KubeProxyService {
    /// A TCP ClusterIP Service port.
    pub fn tcp(namespace: &str, name: &str, cluster_ip: Ipv4Addr, port: u16) -> Self {
        Self {
            namespace: namespace.to_owned(),
            name: name.to_owned(),
            protocol: "tcp",
            cluster_ip,
            port,
            node_port: None,
            target_port: port,
            endpoints: Vec::new(),
        }
    }

    pub fn node_port(mut self, node_port: u16) -> Self {
        self.node_port = Some(node_port);
        self
    }

    pub fn target(mut self, target_port: u16, endpoints: &[Ipv4Addr]) -> Self {
        self.target_port = target_port;
        self.endpoints = endpoints.to_vec();
        self
    }

    fn port_name(&self) -> String {
        format!(
            "{}/{}/{}/p{}",
            self.namespace, self.name, self.protocol, self.port
        )
    }
}

/// kube-proxy's short hash for chain names (upstream: SHA-256 → base32; FNV-1a → base32 here).
pub fn short_hash(s: &str, len: usize) -> String {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in s.bytes() {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    const ALPHABET: &[u8; 32] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZ234567";
    let mut out = String::with_capacity(len);
    let mut x = h;
    for i in 0..len {
        if i == 12 {
            x = h.rotate_left(29) ^ 0x9e37_79b9_7f4a_7c15;
        }
        out.push(ALPHABET[(x & 31) as usize] as char);
        x >>= 5;
    }
    out
}

/// The `table ip kube-proxy` for `services`, as `nft -f` input that first removes an earlier one
/// (kube-proxy's full resync). `cluster_cidr`: clients outside it are masqueraded to ClusterIPs.
pub fn nft_ruleset(services: &[KubeProxyService], cluster_cidr: &str) -> String {
    let mut out = String::from(
        "add table ip kube-proxy { comment \"rules for kube-proxy\" ; }\n\
         delete table ip kube-proxy\n\
         add table ip kube-proxy { comment \"rules for kube-proxy\" ; }\n\
         add chain ip kube-proxy mark-for-masquerade\n\
         add rule ip kube-proxy mark-for-masquerade mark set mark or 0x4000\n\
         add chain ip kube-proxy masquerading\n\
         add rule ip kube-proxy masquerading mark and 0x4000 == 0 return\n\
         add rule ip kube-proxy masquerading mark set mark xor 0x4000\n\
         add rule ip kube-proxy masquerading masquerade fully-random\n\
         add chain ip kube-proxy services\n\
         add chain ip kube-proxy nat-prerouting { type nat hook prerouting priority -100 ; }\n\
         add rule ip kube-proxy nat-prerouting jump services\n\
         add chain ip kube-proxy nat-output { type nat hook output priority -100 ; }\n\
         add rule ip kube-proxy nat-output jump services\n\
         add chain ip kube-proxy nat-postrouting { type nat hook postrouting priority 100 ; }\n\
         add rule ip kube-proxy nat-postrouting jump masquerading\n\
         add map ip kube-proxy service-ips { type ipv4_addr . inet_proto . inet_service : verdict ; comment \"ClusterIP, ExternalIP and LoadBalancer IP traffic\" ; }\n\
         add map ip kube-proxy service-nodeports { type inet_proto . inet_service : verdict ; comment \"NodePort traffic\" ; }\n\
         add rule ip kube-proxy services ip daddr . meta l4proto . th dport vmap @service-ips\n\
         add rule ip kube-proxy services fib daddr type local ip daddr != 127.0.0.0/8 meta l4proto . th dport vmap @service-nodeports\n",
    );
    for s in services {
        let spn = s.port_name();
        let hash = short_hash(&spn, 8);
        let chain = format!("service-{hash}-{spn}");
        let _ = writeln!(out, "add chain ip kube-proxy {chain}");
        let _ = writeln!(
            out,
            "add rule ip kube-proxy {chain} ip daddr {} {} dport {} ip saddr != {cluster_cidr} jump mark-for-masquerade",
            s.cluster_ip, s.protocol, s.port
        );
        let mut vmap = Vec::with_capacity(s.endpoints.len());
        for (i, ep) in s.endpoints.iter().enumerate() {
            let epn = format!("{spn}__{ep}/{}", s.target_port);
            let ep_chain = format!("endpoint-{}-{epn}", short_hash(&epn, 8));
            let _ = writeln!(out, "add chain ip kube-proxy {ep_chain}");
            let _ = writeln!(
                out,
                "add rule ip kube-proxy {ep_chain} ip saddr {ep} jump mark-for-masquerade"
            );
            let _ = writeln!(
                out,
                "add rule ip kube-proxy {ep_chain} meta l4proto {} dnat to {ep}:{}",
                s.protocol, s.target_port
            );
            vmap.push(format!("{i} : goto {ep_chain}"));
        }
        if !vmap.is_empty() {
            let _ = writeln!(
                out,
                "add rule ip kube-proxy {chain} numgen random mod {} vmap {{ {} }}",
                vmap.len(),
                vmap.join(" , ")
            );
        }
        let _ = writeln!(
            out,
            "add element ip kube-proxy service-ips {{ {} . {} . {} : goto {chain} }}",
            s.cluster_ip, s.protocol, s.port
        );
        if let Some(node_port) = s.node_port {
            // externalTrafficPolicy Cluster: every external client is masqueraded.
            let ext = format!("external-{hash}-{spn}");
            let _ = writeln!(out, "add chain ip kube-proxy {ext}");
            let _ = writeln!(out, "add rule ip kube-proxy {ext} jump mark-for-masquerade");
            let _ = writeln!(out, "add rule ip kube-proxy {ext} goto {chain}");
            let _ = writeln!(
                out,
                "add element ip kube-proxy service-nodeports {{ {} . {node_port} : goto {ext} }}",
                s.protocol
            );
        }
    }
    out
}

/// Loads `ruleset` (from [`nft_ruleset`]) into `node`'s netfilter: what kube-proxy's sync does.
pub fn install(node: &NetNs, ruleset: &str, work_dir: &std::path::Path) -> Result<()> {
    let file = work_dir.join(format!("kube-proxy-{}.nft", crate::unique_prefix()));
    std::fs::write(&file, ruleset).with_context(|| format!("writing {}", file.display()))?;
    let path = file.to_str().context("non-UTF-8 path")?;
    let out = node.output(&["nft", "-f", path], crate::netns::EXEC_TIMEOUT)?;
    let _ = std::fs::remove_file(&file);
    if !out.status.success() {
        bail!(
            "nft -f (kube-proxy's rules) in {}: {}",
            node.name(),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    Ok(())
}

/// Removes kube-proxy's table from `node` (kube-proxy --cleanup's nftables part).
pub fn remove(node: &NetNs) -> Result<()> {
    let out = node.output(
        &["nft", "delete", "table", "ip", "kube-proxy"],
        crate::netns::EXEC_TIMEOUT,
    )?;
    if !out.status.success() && !String::from_utf8_lossy(&out.stderr).contains("No such file") {
        bail!(
            "nft delete table ip kube-proxy in {}: {}",
            node.name(),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_nodeport_service_gets_its_external_chain_and_every_endpoint() {
        let web = KubeProxyService::tcp("demo", "web", Ipv4Addr::new(10, 96, 0, 10), 80)
            .node_port(30080)
            .target(
                8080,
                &[Ipv4Addr::new(10, 244, 1, 11), Ipv4Addr::new(10, 244, 1, 12)],
            );
        let text = nft_ruleset(&[web], "10.244.0.0/16");
        assert_eq!(text.matches("dnat to 10.244.1.1").count(), 2, "{text}");
        assert!(text.contains("numgen random mod 2 vmap"), "{text}");
        assert!(
            text.contains("service-nodeports { tcp . 30080 : goto external-"),
            "{text}"
        );
        assert!(
            text.contains("service-ips { 10.96.0.10 . tcp . 80 : goto service-"),
            "{text}"
        );
        assert!(text.starts_with("add table ip kube-proxy"));
    }
}
