//! Two routed nodes, an external client and a "wire" between them, all network namespaces.
//!
//! ```text
//!   node A (ns) ── ext0 192.168.50.10/24 ─┐                    ┌─ pods 10.244.1.x (veth-*)
//!     pods 10.244.1.0/24, 10.244.2.0/24 via .11                │
//!                                          ├─ wire ns: br0 ─── client ns: eth0 192.168.50.100/24
//!   node B (ns) ── ext0 192.168.50.11/24 ─┘                    (routes only to 192.168.50.0/24
//!     pods 10.244.2.0/24, 10.244.1.0/24 via .10                 and to the test's VIP ranges)
//! ```
//! Each node is a [`Topology`] (routed pods with /32 routes and the 169.254.1.1 gateway); pod
//! CIDRs are routed node to node over the wire like a simple routed CNI. No namespace has a
//! default route; nothing is created in the root namespace. Drop removes the client and the wire
//! first, then the nodes (each with its pods).

use std::{net::Ipv4Addr, process::Command, time::Duration};

use anyhow::{Context as _, Result, bail, ensure};

use crate::{
    netns::{EXEC_TIMEOUT, NetNs},
    process::{describe, run_ok},
    topology::{ConnectOutcome, Topology, UdpReply, tcp_connect_from, udp_request_from},
};

/// The external device of each node (the agent's `--devices`).
pub const EXT_DEVICE: &str = "ext0";
/// Node addresses on the wire, and the external client's.
pub const NODE_IPS: [Ipv4Addr; 2] = [
    Ipv4Addr::new(192, 168, 50, 10),
    Ipv4Addr::new(192, 168, 50, 11),
];
pub const EXT_CLIENT_IP: Ipv4Addr = Ipv4Addr::new(192, 168, 50, 100);
/// Pod CIDR of node i is 10.244.(i+1).0/24.
pub const POD_CIDRS: [&str; 2] = ["10.244.1.0/24", "10.244.2.0/24"];
/// The cluster CIDR both pod CIDRs come from (the agents' `--cluster-cidr`).
pub const CLUSTER_CIDR: &str = "10.244.0.0/16";
/// Node names for `--hostname-override` and EndpointSlice `nodeName`.
pub const NODE_NAMES: [&str; 2] = ["node-a", "node-b"];
/// The overlay device of [`MultiNode::with_vxlan`] (flannel's `flannel.1`, Calico's
/// `vxlan.calico`): not matched by the agents' `--devices` or pod patterns.
pub const VXLAN_DEVICE: &str = "vxlan0";
/// The overlay device's address on node i, flannel-style: the pod CIDR's network address, /32.
pub const VXLAN_IPS: [Ipv4Addr; 2] = [Ipv4Addr::new(10, 244, 1, 0), Ipv4Addr::new(10, 244, 2, 0)];

/// An HTTP answer as the external client saw it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HttpReply {
    pub code: u16,
    /// Body, trimmed.
    pub body: String,
    /// The backend server's `X-Client-Addr` header: the source address it saw ("" if none).
    pub client_addr: String,
    /// `X-Load-Balancing-Endpoint-Weight` ("" if none).
    pub weight: String,
}

/// Two nodes + wire + external client. Field order is drop order.
#[derive(Debug)]
pub struct MultiNode {
    client: NetNs,
    wire: NetNs,
    nodes: [Topology; 2],
}

impl MultiNode {
    /// Both nodes (no pods yet), the wire and the client, addressed and routed.
    pub fn new() -> Result<Self> {
        let nodes = [Topology::bare()?, Topology::bare()?];
        let prefix = nodes[0].prefix().to_owned();
        let wire = NetNs::new(&format!("{prefix}-wire"))?;
        let client = NetNs::new(&format!("{prefix}-ext"))?;
        ip_n(wire.name(), &["link", "add", "br0", "type", "bridge"])?;
        ip_n(wire.name(), &["link", "set", "br0", "up"])?;
        for (i, node) in nodes.iter().enumerate() {
            let port = format!("n{i}");
            plug(&wire, &port, node.node(), EXT_DEVICE)?;
            let n = node.node();
            ip_n(
                n.name(),
                &[
                    "addr",
                    "add",
                    &format!("{}/24", NODE_IPS[i]),
                    "dev",
                    EXT_DEVICE,
                ],
            )?;
            ip_n(n.name(), &["link", "set", EXT_DEVICE, "up"])?;
            let other = 1 - i;
            ip_n(
                n.name(),
                &[
                    "route",
                    "add",
                    POD_CIDRS[other],
                    "via",
                    &NODE_IPS[other].to_string(),
                    "dev",
                    EXT_DEVICE,
                ],
            )?;
            // Strict reverse-path filtering, as on many hosts: the datapath must not need it off.
            n.sysctl("net.ipv4.conf.all.rp_filter", "1")?;
            n.sysctl(&format!("net.ipv4.conf.{EXT_DEVICE}.rp_filter"), "1")?;
            n.sysctl(&format!("net.ipv4.conf.{EXT_DEVICE}.send_redirects"), "0")?;
        }
        plug(&wire, "cl", &client, "eth0")?;
        ip_n(
            client.name(),
            &["addr", "add", &format!("{EXT_CLIENT_IP}/24"), "dev", "eth0"],
        )?;
        ip_n(client.name(), &["link", "set", "eth0", "up"])?;
        client.sysctl("net.ipv4.tcp_max_tw_buckets", "0")?;
        Ok(Self {
            client,
            wire,
            nodes,
        })
    }

    /// Like [`MultiNode::new`], but pod traffic between the nodes is carried by a VXLAN device
    /// (`vxlan0`, VNI 42, UDP 4789 over `ext0`, point to point), as flannel's vxlan backend does:
    /// `vxlan0` holds the pod CIDR's network address (/32) and the other node's pod CIDR is routed
    /// `via` the other end's address `onlink`. Strict rp_filter on `vxlan0` too.
    pub fn with_vxlan() -> Result<Self> {
        let net = Self::new()?;
        for (i, node) in net.nodes.iter().enumerate() {
            let n = node.node().name();
            let other = 1 - i;
            ip_n(
                n,
                &[
                    "link",
                    "add",
                    VXLAN_DEVICE,
                    "type",
                    "vxlan",
                    "id",
                    "42",
                    "local",
                    &NODE_IPS[i].to_string(),
                    "remote",
                    &NODE_IPS[other].to_string(),
                    "dstport",
                    "4789",
                    "dev",
                    EXT_DEVICE,
                ],
            )?;
            ip_n(
                n,
                &[
                    "addr",
                    "add",
                    &format!("{}/32", VXLAN_IPS[i]),
                    "dev",
                    VXLAN_DEVICE,
                ],
            )?;
            ip_n(n, &["link", "set", VXLAN_DEVICE, "up"])?;
            ip_n(
                n,
                &[
                    "route",
                    "replace",
                    POD_CIDRS[other],
                    "via",
                    &VXLAN_IPS[other].to_string(),
                    "dev",
                    VXLAN_DEVICE,
                    "onlink",
                ],
            )?;
            node.node()
                .sysctl(&format!("net.ipv4.conf.{VXLAN_DEVICE}.rp_filter"), "1")?;
        }
        Ok(net)
    }

    /// Node 0 (A) or 1 (B).
    pub fn node(&self, i: usize) -> &Topology {
        &self.nodes[i]
    }

    pub fn node_mut(&mut self, i: usize) -> &mut Topology {
        &mut self.nodes[i]
    }

    /// The external client's namespace.
    pub fn client(&self) -> &NetNs {
        &self.client
    }

    /// The wire's namespace (the bridge).
    pub fn wire(&self) -> &NetNs {
        &self.wire
    }

    /// Adds a backend pod (HTTP :8080, UDP echo :5353) on node `i`, routed from the other node.
    pub fn add_backend(&mut self, i: usize, name: &str, ip: Ipv4Addr) -> Result<()> {
        ensure!(
            ip.octets()[..3] == [10, 244, i as u8 + 1],
            "{ip} is not in node {i}'s pod CIDR {}",
            POD_CIDRS[i]
        );
        self.nodes[i].add_backend(name, ip)?;
        Ok(())
    }

    /// Routes `cidr` from the client through node `i` (how a router or load balancer in front of
    /// the nodes would send external IPs / LoadBalancer IPs).
    pub fn route_via_node(&self, cidr: &str, i: usize) -> Result<()> {
        ip_n(
            self.client.name(),
            &[
                "route",
                "replace",
                cidr,
                "via",
                &NODE_IPS[i].to_string(),
                "dev",
                "eth0",
            ],
        )
    }

    /// One HTTP GET from the external client (`curl --max-time 3`).
    pub fn http_get(&self, url: &str) -> Result<HttpReply> {
        let out = self.client.output(
            &[
                "curl",
                "-s",
                "--max-time",
                "3",
                "-H",
                "Connection: close",
                "-w",
                "\x1e%{http_code}\x1e%header{x-client-addr}\x1e%header{x-load-balancing-endpoint-weight}\x1e%{exitcode}\x1e%{errormsg}",
                url,
            ],
            Duration::from_secs(10),
        )?;
        let stdout = String::from_utf8_lossy(&out.stdout);
        let mut f = stdout.split('\x1e');
        let body = f.next().unwrap_or_default().trim().to_owned();
        let code = f.next().unwrap_or_default();
        let client_addr = f.next().unwrap_or_default().trim().to_owned();
        let weight = f.next().unwrap_or_default().trim().to_owned();
        let exit = f.next().unwrap_or_default();
        let msg = f.next().unwrap_or_default();
        if exit != "0" {
            bail!("curl {url}: exit {exit} ({}): {msg}", describe(out.status));
        }
        Ok(HttpReply {
            code: code
                .parse()
                .with_context(|| format!("HTTP code {code:?}"))?,
            body,
            client_addr,
            weight,
        })
    }

    /// One UDP datagram from the external client; the reply within 2 s.
    pub fn udp_request(&self, ip: Ipv4Addr, port: u16, payload: &str) -> Result<UdpReply> {
        udp_request_from(&self.client, ip, port, payload)
    }

    /// One TCP connect from the external client: outcome and time taken.
    pub fn tcp_connect(
        &self,
        ip: Ipv4Addr,
        port: u16,
        timeout: Duration,
    ) -> Result<(ConnectOutcome, Duration)> {
        tcp_connect_from(&self.client, ip, port, timeout)
    }
}

/// A veth pair: `port` on the wire's bridge, `ifname` in `peer`.
fn plug(wire: &NetNs, port: &str, peer: &NetNs, ifname: &str) -> Result<()> {
    ip_n(
        wire.name(),
        &[
            "link",
            "add",
            port,
            "type",
            "veth",
            "peer",
            "name",
            ifname,
            "netns",
            peer.name(),
        ],
    )?;
    ip_n(wire.name(), &["link", "set", port, "master", "br0"])?;
    ip_n(wire.name(), &["link", "set", port, "up"])?;
    peer.exec(&["ethtool", "-K", ifname, "tx", "off", "rx", "off"])?;
    Ok(())
}

fn ip_n(ns: &str, args: &[&str]) -> Result<()> {
    let mut cmd = Command::new("ip");
    cmd.args(["-n", ns]).args(args);
    run_ok(cmd, EXEC_TIMEOUT)?;
    Ok(())
}
