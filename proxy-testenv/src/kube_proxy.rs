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
//!
//! Also its iptables-mode rule set ([`iptables_ruleset`]), loaded with `iptables-restore`: what a
//! node kube-proxy ran on in that mode keeps until `kube-proxy --cleanup`.

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

/// kube-proxy's iptables-mode rules for `services`, as `iptables-restore --noflush` input (the
/// shape of upstream's `pkg/proxy/iptables`): in nat, `KUBE-SERVICES` jumped to from PREROUTING
/// and OUTPUT, `KUBE-NODEPORTS` from it for local destinations, a `KUBE-SVC-` chain per Service
/// port picking an endpoint with `statistic`, a `KUBE-SEP-` chain per endpoint marking hairpin
/// traffic and DNATing, a `KUBE-EXT-` chain per NodePort marking every external client (policy
/// Cluster), and masquerading of marked packets in `KUBE-POSTROUTING`; in filter,
/// `KUBE-FORWARD` accepting marked packets, the firewall and portal chains kube-proxy creates
/// (`REJECT` for a Service without endpoints) and its canary, which is in mangle and nat too.
/// `cluster_cidr`: clients outside it are masqueraded to ClusterIPs.
pub fn iptables_ruleset(services: &[KubeProxyService], cluster_cidr: &str) -> String {
    let mut nat_chains = String::from(
        "*nat\n\
         :KUBE-SERVICES - [0:0]\n\
         :KUBE-NODEPORTS - [0:0]\n\
         :KUBE-POSTROUTING - [0:0]\n\
         :KUBE-MARK-MASQ - [0:0]\n\
         :KUBE-PROXY-CANARY - [0:0]\n",
    );
    let mut nat_rules = String::from(
        "-A PREROUTING -m comment --comment \"kubernetes service portals\" -j KUBE-SERVICES\n\
         -A OUTPUT -m comment --comment \"kubernetes service portals\" -j KUBE-SERVICES\n\
         -A POSTROUTING -m comment --comment \"kubernetes postrouting rules\" -j KUBE-POSTROUTING\n\
         -A KUBE-MARK-MASQ -j MARK --or-mark 0x4000\n\
         -A KUBE-POSTROUTING -m mark ! --mark 0x4000/0x4000 -j RETURN\n\
         -A KUBE-POSTROUTING -j MARK --xor-mark 0x4000\n\
         -A KUBE-POSTROUTING -m comment --comment \"kubernetes service traffic requiring SNAT\" -j MASQUERADE --random-fully\n",
    );
    let mut filter_services = String::new();
    for s in services {
        let spn = format!("{}/{}:p{}", s.namespace, s.name, s.port);
        let hash = short_hash(&format!("{spn}{}", s.protocol), 16);
        let svc = format!("KUBE-SVC-{hash}");
        let proto = s.protocol;
        let _ = writeln!(nat_chains, ":{svc} - [0:0]");
        let _ = writeln!(
            nat_rules,
            "-A KUBE-SERVICES -d {}/32 -p {proto} -m comment --comment \"{spn} cluster IP\" -m {proto} --dport {} -j {svc}",
            s.cluster_ip, s.port
        );
        let _ = writeln!(
            nat_rules,
            "-A {svc} ! -s {cluster_cidr} -d {}/32 -p {proto} -m comment --comment \"{spn} cluster IP\" -m {proto} --dport {} -j KUBE-MARK-MASQ",
            s.cluster_ip, s.port
        );
        let n = s.endpoints.len();
        for (i, ep) in s.endpoints.iter().enumerate() {
            let to = format!("{ep}:{}", s.target_port);
            let sep = format!("KUBE-SEP-{}", short_hash(&format!("{spn}{proto}{to}"), 16));
            let _ = writeln!(nat_chains, ":{sep} - [0:0]");
            // Each endpoint but the last takes its share of what the ones before left.
            let statistic = if i + 1 < n {
                format!(
                    " -m statistic --mode random --probability {:.10}",
                    1.0 / (n - i) as f64
                )
            } else {
                String::new()
            };
            let _ = writeln!(
                nat_rules,
                "-A {svc} -m comment --comment \"{spn} -> {to}\"{statistic} -j {sep}"
            );
            let _ = writeln!(
                nat_rules,
                "-A {sep} -s {ep}/32 -m comment --comment \"{spn}\" -j KUBE-MARK-MASQ\n\
                 -A {sep} -p {proto} -m comment --comment \"{spn}\" -m {proto} -j DNAT --to-destination {to}"
            );
        }
        if n == 0 {
            let _ = writeln!(
                filter_services,
                "-A KUBE-SERVICES -d {}/32 -p {proto} -m comment --comment \"{spn} has no endpoints\" -m {proto} --dport {} -j REJECT --reject-with icmp-port-unreachable",
                s.cluster_ip, s.port
            );
        }
        if let Some(node_port) = s.node_port {
            let ext = format!("KUBE-EXT-{hash}");
            let _ = writeln!(nat_chains, ":{ext} - [0:0]");
            let _ = writeln!(
                nat_rules,
                "-A KUBE-NODEPORTS -p {proto} -m comment --comment \"{spn}\" -m {proto} --dport {node_port} -j {ext}\n\
                 -A {ext} -m comment --comment \"masquerade traffic for {spn} external destinations\" -j KUBE-MARK-MASQ\n\
                 -A {ext} -j {svc}"
            );
        }
    }
    nat_rules.push_str(
        "-A KUBE-SERVICES -m comment --comment \"kubernetes service nodeports; NOTE: this must be the last rule in this chain\" -m addrtype --dst-type LOCAL -j KUBE-NODEPORTS\n\
         COMMIT\n",
    );
    let filter = format!(
        "*filter\n\
         :KUBE-SERVICES - [0:0]\n\
         :KUBE-EXTERNAL-SERVICES - [0:0]\n\
         :KUBE-NODEPORTS - [0:0]\n\
         :KUBE-FORWARD - [0:0]\n\
         :KUBE-PROXY-FIREWALL - [0:0]\n\
         :KUBE-PROXY-CANARY - [0:0]\n\
         -A INPUT -m conntrack --ctstate NEW -m comment --comment \"kubernetes load balancer firewall\" -j KUBE-PROXY-FIREWALL\n\
         -A INPUT -m comment --comment \"kubernetes health check service ports\" -j KUBE-NODEPORTS\n\
         -A INPUT -m conntrack --ctstate NEW -m comment --comment \"kubernetes externally-visible service portals\" -j KUBE-EXTERNAL-SERVICES\n\
         -A FORWARD -m conntrack --ctstate NEW -m comment --comment \"kubernetes load balancer firewall\" -j KUBE-PROXY-FIREWALL\n\
         -A FORWARD -m comment --comment \"kubernetes forwarding rules\" -j KUBE-FORWARD\n\
         -A FORWARD -m conntrack --ctstate NEW -m comment --comment \"kubernetes service portals\" -j KUBE-SERVICES\n\
         -A FORWARD -m conntrack --ctstate NEW -m comment --comment \"kubernetes externally-visible service portals\" -j KUBE-EXTERNAL-SERVICES\n\
         -A OUTPUT -m conntrack --ctstate NEW -m comment --comment \"kubernetes load balancer firewall\" -j KUBE-PROXY-FIREWALL\n\
         -A OUTPUT -m conntrack --ctstate NEW -m comment --comment \"kubernetes service portals\" -j KUBE-SERVICES\n\
         -A KUBE-FORWARD -m conntrack --ctstate INVALID -j DROP\n\
         -A KUBE-FORWARD -m comment --comment \"kubernetes forwarding rules\" -m mark --mark 0x4000/0x4000 -j ACCEPT\n\
         -A KUBE-FORWARD -m comment --comment \"kubernetes forwarding conntrack rule\" -m conntrack --ctstate RELATED,ESTABLISHED -j ACCEPT\n\
         {filter_services}\
         COMMIT\n"
    );
    let mangle = "*mangle\n:KUBE-PROXY-CANARY - [0:0]\nCOMMIT\n";
    format!("{nat_chains}{nat_rules}{filter}{mangle}")
}

/// Loads `ruleset` (from [`iptables_ruleset`]) into `node` with `iptables-restore --noflush`
/// (the selected backend): what kube-proxy's iptables-mode sync does.
pub fn install_iptables(node: &NetNs, ruleset: &str, work_dir: &std::path::Path) -> Result<()> {
    let file = work_dir.join(format!("kube-proxy-{}.iptables", crate::unique_prefix()));
    std::fs::write(&file, ruleset).with_context(|| format!("writing {}", file.display()))?;
    let path = file.to_str().context("non-UTF-8 path")?;
    let out = node.output(
        &["iptables-restore", "--noflush", path],
        crate::netns::EXEC_TIMEOUT,
    )?;
    let _ = std::fs::remove_file(&file);
    if !out.status.success() {
        bail!(
            "iptables-restore --noflush (kube-proxy's rules) in {}: {}",
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

    #[test]
    fn the_iptables_rules_have_upstream_s_chains_and_jumps() {
        let web = KubeProxyService::tcp("demo", "web", Ipv4Addr::new(10, 96, 0, 10), 80)
            .node_port(30080)
            .target(
                8080,
                &[
                    Ipv4Addr::new(10, 244, 1, 11),
                    Ipv4Addr::new(10, 244, 1, 12),
                    Ipv4Addr::new(10, 244, 1, 13),
                ],
            );
        let idle = KubeProxyService::tcp("demo", "idle", Ipv4Addr::new(10, 96, 0, 11), 80);
        let text = iptables_ruleset(&[web, idle], "10.244.0.0/16");
        let nat = &text[..text.find("*filter").expect("filter table")];
        assert!(nat.starts_with("*nat\n"), "{text}");
        for jump in [
            "-A PREROUTING -m comment --comment \"kubernetes service portals\" -j KUBE-SERVICES\n",
            "-A OUTPUT -m comment --comment \"kubernetes service portals\" -j KUBE-SERVICES\n",
            "-m addrtype --dst-type LOCAL -j KUBE-NODEPORTS\nCOMMIT\n",
            "-A KUBE-MARK-MASQ -j MARK --or-mark 0x4000\n",
            "-j MASQUERADE --random-fully\n",
        ] {
            assert!(nat.contains(jump), "no {jump:?} in\n{text}");
        }
        // Three endpoints: 1/3, then 1/2 of the rest, then the last one unconditionally.
        assert!(
            nat.contains("--probability 0.3333333333 -j KUBE-SEP-"),
            "{text}"
        );
        assert!(
            nat.contains("--probability 0.5000000000 -j KUBE-SEP-"),
            "{text}"
        );
        assert_eq!(nat.matches("-m statistic").count(), 2, "{text}");
        assert_eq!(
            nat.matches("-j DNAT --to-destination 10.244.1.1").count(),
            3
        );
        assert_eq!(nat.matches("\n:KUBE-SEP-").count(), 3);
        assert_eq!(nat.matches("\n:KUBE-SVC-").count(), 2);
        assert_eq!(nat.matches("\n:KUBE-EXT-").count(), 1);
        assert!(nat.contains("--dport 30080 -j KUBE-EXT-"), "{text}");
        assert!(
            nat.contains("! -s 10.244.0.0/16 -d 10.96.0.10/32"),
            "{text}"
        );
        // Every chain a rule jumps to is declared (or is a target or built-in).
        for line in text.lines().filter(|l| l.starts_with("-A ")) {
            let target = line.rsplit(" -j ").next().unwrap_or_default();
            let target = target.split_whitespace().next().unwrap_or_default();
            if target.starts_with("KUBE-") {
                assert!(text.contains(&format!("\n:{target} - [0:0]\n")), "{line}");
            }
        }
        let filter = &text[text.find("*filter").expect("filter")..];
        assert!(filter.contains(
            "-A FORWARD -m comment --comment \"kubernetes forwarding rules\" -j KUBE-FORWARD\n"
        ));
        assert!(filter.contains("-m mark --mark 0x4000/0x4000 -j ACCEPT\n"));
        assert!(
            filter.contains("\"demo/idle:p80 has no endpoints\""),
            "{text}"
        );
        assert!(filter.contains(":KUBE-PROXY-CANARY - [0:0]\n"));
        assert!(text.ends_with("*mangle\n:KUBE-PROXY-CANARY - [0:0]\nCOMMIT\n"));
        assert_eq!(text.matches("COMMIT\n").count(), 3);
    }
}
