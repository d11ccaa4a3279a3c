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
//!
//! Dual stack: the wire is also fd00:192:168:50::/64 (node A ::10, node B ::11, the client ::100:
//! [`crate::ipv6_of`] the IPv4 addresses), and node i's pods are also fd00:10:244:(i+1)::/64,
//! routed over the wire to the other node's address (the VXLAN and L3 tunnel variants carry
//! IPv4 only; their IPv6 pod routes stay on the wire). The bridge floods multicast (no MLD
//! snooping), so neighbour discovery between the nodes and the client needs no querier.

use std::{
    net::{Ipv4Addr, Ipv6Addr},
    process::Command,
    time::Duration,
};

use anyhow::{Context as _, Result, bail, ensure};

use crate::{
    netns::{EXEC_TIMEOUT, NetNs},
    process::{Proc, describe, run_ok},
    topology::{
        ConnectOutcome, Topology, UdpReply, UdpReply6, ipv6_of, tcp_connect_from,
        tcp6_connect_from, udp_request_from, udp6_request_from,
    },
};

/// The external device of each node (the agent's `--devices`).
pub const EXT_DEVICE: &str = "ext0";
/// Node addresses on the wire, and the external client's.
pub const NODE_IPS: [Ipv4Addr; 2] = [
    Ipv4Addr::new(192, 168, 50, 10),
    Ipv4Addr::new(192, 168, 50, 11),
];
pub const EXT_CLIENT_IP: Ipv4Addr = Ipv4Addr::new(192, 168, 50, 100);
/// Node IPv6 addresses on the wire (fd00:192:168:50::10 and ::11), and the external client's
/// (fd00:192:168:50::100); the wire is a /64.
pub const NODE_IPS6: [Ipv6Addr; 2] = [ipv6_of(NODE_IPS[0]), ipv6_of(NODE_IPS[1])];
pub const EXT_CLIENT_IP6: Ipv6Addr = ipv6_of(EXT_CLIENT_IP);
/// Pod CIDR of node i is 10.244.(i+1).0/24.
pub const POD_CIDRS: [&str; 2] = ["10.244.1.0/24", "10.244.2.0/24"];
/// IPv6 pod CIDR of node i: fd00:10:244:(i+1)::/64.
pub const POD_CIDRS6: [&str; 2] = ["fd00:10:244:1::/64", "fd00:10:244:2::/64"];
/// The cluster CIDR both pod CIDRs come from (the agents' `--cluster-cidr`).
pub const CLUSTER_CIDR: &str = "10.244.0.0/16";
/// The IPv6 cluster CIDR both IPv6 pod CIDRs come from.
pub const CLUSTER_CIDR6: &str = "fd00:10:244::/56";
/// A dual-stack `--cluster-cidr` value (IPv4 first, comma-separated as upstream).
pub const CLUSTER_CIDR_DUAL: &str = "10.244.0.0/16,fd00:10:244::/56";
/// The IPv6 Service CIDR the examples allocate ClusterIPs from (fd00:10:96::/108, beside
/// IPv4's 10.96.0.0/12).
pub const SERVICE_CIDR6: &str = "fd00:10:96::/108";
/// Node names for `--hostname-override` and EndpointSlice `nodeName`.
pub const NODE_NAMES: [&str; 2] = ["node-a", "node-b"];
/// The overlay device of [`MultiNode::with_vxlan`] (flannel's `flannel.1`, Calico's
/// `vxlan.calico`): not matched by the agents' `--devices` or pod patterns.
pub const VXLAN_DEVICE: &str = "vxlan0";
/// The overlay device's address on node i, flannel-style: the pod CIDR's network address, /32.
pub const VXLAN_IPS: [Ipv4Addr; 2] = [Ipv4Addr::new(10, 244, 1, 0), Ipv4Addr::new(10, 244, 2, 0)];

/// The L3 tunnel device of [`MultiNode::with_l3_tunnel`] (a TUN-mode device, like wireguard-go's
/// `wg0` or Calico's `tunl0` in what the programs see: bare IPv4 packets, no Ethernet header).
pub const L3_TUNNEL_DEVICE: &str = "tun0";
/// The L3 tunnel device's address on node i (Calico-style: an address of the node's pod CIDR).
pub const L3_TUNNEL_IPS: [Ipv4Addr; 2] =
    [Ipv4Addr::new(10, 244, 1, 1), Ipv4Addr::new(10, 244, 2, 1)];
/// UDP port the tunnel relays exchange packets on (between the nodes' `ext0` addresses).
const L3_TUNNEL_PORT: &str = "4790";
/// MTU of the L3 tunnel device (1500 on the wire minus the relay's IPv4 + UDP headers, rounded).
const L3_TUNNEL_MTU: &str = "1400";
/// The relay behind each node's TUN device: every packet the node routes into the device goes
/// to the other node's relay in one UDP datagram (over `ext0`, between the node addresses) and
/// is written into that node's device, which receives it as from a point-to-point link. A
/// userspace L3 tunnel, like wireguard-go without the cryptography. Bounded by its process guard.
const TUN_RELAY_PY: &str = r#"
import fcntl, os, select, socket, struct, sys
name, local, remote, port = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
TUNSETIFF, IFF_TUN, IFF_NO_PI = 0x400454ca, 0x0001, 0x1000
tun = os.open("/dev/net/tun", os.O_RDWR)
fcntl.ioctl(tun, TUNSETIFF, struct.pack("16sH", name.encode(), IFF_TUN | IFF_NO_PI))
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.bind((local, port))
while True:
    r, _, _ = select.select([tun, s], [], [])
    if tun in r:
        s.sendto(os.read(tun, 65535), (remote, port))
    if s in r:
        os.write(tun, s.recv(65535))
"#;

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
    /// The L3 tunnel's relays ([`MultiNode::with_l3_tunnel`]), killed first.
    relays: Vec<Proc>,
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
        ip_n(
            wire.name(),
            &[
                "link",
                "add",
                "br0",
                "type",
                "bridge",
                "mcast_snooping",
                "0",
            ],
        )?;
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
            ip_n(
                n.name(),
                &[
                    "-6",
                    "addr",
                    "add",
                    &format!("{}/64", NODE_IPS6[i]),
                    "dev",
                    EXT_DEVICE,
                    "nodad",
                ],
            )?;
            ip_n(n.name(), &["link", "set", EXT_DEVICE, "up"])?;
            let other = 1 - i;
            ip_n(
                n.name(),
                &[
                    "-6",
                    "route",
                    "add",
                    POD_CIDRS6[other],
                    "via",
                    &NODE_IPS6[other].to_string(),
                    "dev",
                    EXT_DEVICE,
                ],
            )?;
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
        ip_n(
            client.name(),
            &[
                "-6",
                "addr",
                "add",
                &format!("{EXT_CLIENT_IP6}/64"),
                "dev",
                "eth0",
                "nodad",
            ],
        )?;
        ip_n(client.name(), &["link", "set", "eth0", "up"])?;
        client.sysctl("net.ipv4.tcp_max_tw_buckets", "0")?;
        Ok(Self {
            relays: Vec::new(),
            client,
            wire,
            nodes,
        })
    }

    /// Like [`MultiNode::new`], but pod traffic between the nodes is carried by an L3 tunnel
    /// device (`tun0`: no Ethernet header, as Calico's IPIP `tunl0` or WireGuard; this kernel
    /// has neither ipip nor wireguard, so it is a TUN device with a UDP relay between the node
    /// addresses, like wireguard-go). `tun0` holds an address of the node's pod CIDR (/32) and
    /// the other node's pod CIDR is routed into it. Strict rp_filter on `tun0` too.
    pub fn with_l3_tunnel() -> Result<Self> {
        let mut net = Self::new()?;
        for i in 0..2 {
            let n = net.nodes[i].node();
            let other = 1 - i;
            ip_n(
                n.name(),
                &["tuntap", "add", "dev", L3_TUNNEL_DEVICE, "mode", "tun"],
            )?;
            let relay = n.spawn(
                &[
                    "python3",
                    "-c",
                    TUN_RELAY_PY,
                    L3_TUNNEL_DEVICE,
                    &NODE_IPS[i].to_string(),
                    &NODE_IPS[other].to_string(),
                    L3_TUNNEL_PORT,
                ],
                None,
            )?;
            net.relays.push(relay);
            let n = net.nodes[i].node();
            ip_n(
                n.name(),
                &["link", "set", L3_TUNNEL_DEVICE, "mtu", L3_TUNNEL_MTU, "up"],
            )?;
            ip_n(
                n.name(),
                &[
                    "addr",
                    "add",
                    &format!("{}/32", L3_TUNNEL_IPS[i]),
                    "dev",
                    L3_TUNNEL_DEVICE,
                ],
            )?;
            ip_n(
                n.name(),
                &[
                    "route",
                    "replace",
                    POD_CIDRS[other],
                    "dev",
                    L3_TUNNEL_DEVICE,
                ],
            )?;
            n.sysctl(&format!("net.ipv4.conf.{L3_TUNNEL_DEVICE}.rp_filter"), "1")?;
        }
        // The device has carrier once its relay holds it open (bounded wait).
        for i in 0..2 {
            let n = net.nodes[i].node();
            let mut up = false;
            for _ in 0..100 {
                let link = n.exec(&["ip", "link", "show", L3_TUNNEL_DEVICE])?;
                if !link.contains("NO-CARRIER") {
                    up = true;
                    break;
                }
                std::thread::sleep(Duration::from_millis(50));
            }
            ensure!(
                up,
                "node {i}: {L3_TUNNEL_DEVICE} has no carrier: its relay did not attach"
            );
        }
        Ok(net)
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

    /// The source and node flags node `i`'s agent runs with on a manifest folder: the
    /// manifests, the wire as its external device, its node name and `cluster_cidr`.
    pub fn agent_args(
        &self,
        i: usize,
        manifests: &std::path::Path,
        cluster_cidr: &str,
    ) -> Vec<std::ffi::OsString> {
        [
            "--manifests".as_ref(),
            manifests.as_os_str(),
            "--devices".as_ref(),
            EXT_DEVICE.as_ref(),
            "--hostname-override".as_ref(),
            NODE_NAMES[i].as_ref(),
            "--cluster-cidr".as_ref(),
            cluster_cidr.as_ref(),
        ]
        .map(std::ffi::OsStr::to_os_string)
        .to_vec()
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

    /// [`MultiNode::route_via_node`] for an IPv6 CIDR (via the node's IPv6 address).
    pub fn route6_via_node(&self, cidr: &str, i: usize) -> Result<()> {
        ip_n(
            self.client.name(),
            &[
                "-6",
                "route",
                "replace",
                cidr,
                "via",
                &NODE_IPS6[i].to_string(),
                "dev",
                "eth0",
            ],
        )
    }

    /// One HTTP GET from the external client (`curl --max-time 3`); an IPv6 URL has the
    /// address in brackets ([`crate::http_url`]), and an IPv6 `client_addr` reads `"[addr]:port"`.
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

    /// [`MultiNode::udp_request`] over IPv6.
    pub fn udp6_request(&self, ip: Ipv6Addr, port: u16, payload: &str) -> Result<UdpReply6> {
        udp6_request_from(&self.client, ip, port, payload)
    }

    /// [`MultiNode::tcp_connect`] over IPv6.
    pub fn tcp6_connect(
        &self,
        ip: Ipv6Addr,
        port: u16,
        timeout: Duration,
    ) -> Result<(ConnectOutcome, Duration)> {
        tcp6_connect_from(&self.client, ip, port, timeout)
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
