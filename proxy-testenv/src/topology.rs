//! A one-node, routed-CNI (Calico-like) topology made of network namespaces.
//!
//! ```text
//!   client (10.244.1.2) ─┐                      ┌─ be1 (10.244.1.11) http :8080, udp :5353
//!                        ├─ veth-* ── node ns ──┼─ be2 (10.244.1.12)
//!                        │   (ip_forward, /32   └─ be3 (10.244.1.13)
//!                        │    routes, no default route)
//! ```
//! Each pod has `eth0` with `addr/32`, a link route to 169.254.1.1 and a default route via it
//! (into the node namespace, which itself has no default route: nothing leaves the machine).
//! The node answers ARP for 169.254.1.1 because that address is local to its loopback; the
//! host-side veths also have `proxy_arp=1` and `proxy_delay=0` like Calico's.
//!
//! Dual stack: every pod also has an IPv6 address, [`ipv6_of`] its IPv4 one (10.244.1.11 →
//! fd00:10:244:1::11, /128), and a default route via fe80::1, which every host-side veth holds
//! (Calico does the same with a fixed link-local). The node routes each pod's /128 to its veth and
//! forwards IPv6. Neighbour discovery is real (nothing is proxied); DAD is off in every namespace
//! ([`NetNs::new`]) so addresses are usable at once. The backend servers listen on both families.

use std::{
    collections::BTreeMap,
    net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, SocketAddrV4, SocketAddrV6},
    path::PathBuf,
    process::Command,
    thread,
    time::{Duration, Instant},
};

use anyhow::{Context as _, Result, bail, ensure};

use crate::{
    netns::{EXEC_TIMEOUT, NetNs},
    process::{Proc, describe, run_ok, tail},
    tempdir::TempDir,
    unique_prefix,
};

/// The node's gateway address as seen by pods (local on the node's loopback).
pub const GATEWAY: Ipv4Addr = Ipv4Addr::new(169, 254, 1, 1);
/// The node's own IPv6 address, on its loopback ([`ipv6_of`] [`GATEWAY`]: fd00:169:254:1::1):
/// the source of the node's processes' IPv6 connections to pods.
pub const NODE_LOCAL_IP6: Ipv6Addr = ipv6_of(GATEWAY);
/// The pods' IPv6 gateway: a link-local address every host-side veth holds.
pub const GATEWAY6: Ipv6Addr = Ipv6Addr::new(0xfe80, 0, 0, 0, 0, 0, 0, 1);
/// Client pod address.
pub const CLIENT_IP: Ipv4Addr = Ipv4Addr::new(10, 244, 1, 2);
/// Client pod IPv6 address (fd00:10:244:1::2).
pub const CLIENT_IP6: Ipv6Addr = ipv6_of(CLIENT_IP);
/// The three default backends.
pub const BACKENDS: [(&str, Ipv4Addr); 3] = [
    ("be1", Ipv4Addr::new(10, 244, 1, 11)),
    ("be2", Ipv4Addr::new(10, 244, 1, 12)),
    ("be3", Ipv4Addr::new(10, 244, 1, 13)),
];
/// The default backends' IPv6 addresses (fd00:10:244:1::11..13).
pub const BACKENDS6: [(&str, Ipv6Addr); 3] = [
    (BACKENDS[0].0, ipv6_of(BACKENDS[0].1)),
    (BACKENDS[1].0, ipv6_of(BACKENDS[1].1)),
    (BACKENDS[2].0, ipv6_of(BACKENDS[2].1)),
];
/// HTTP port of the backend servers.
pub const HTTP_PORT: u16 = 8080;
/// UDP echo port of the backend servers (`<pod name>:<payload>`; a payload `big:N` is answered
/// with N bytes `x` instead).
pub const UDP_PORT: u16 = 5353;
/// iperf3 server port.
pub const IPERF_PORT: u16 = 5201;

/// The IPv6 address the topology gives a namespace beside `v4`: `a.b.c.d` → `fd00:a:b:c::d`
/// with each decimal octet written as the hex group of the same digits (10.244.1.11 →
/// fd00:10:244:1::11), so the two read alike. Always inside fd00::/8 (unique local).
pub const fn ipv6_of(v4: Ipv4Addr) -> Ipv6Addr {
    const fn digits(n: u8) -> u16 {
        let n = n as u16;
        (n / 100) * 0x100 + (n / 10 % 10) * 0x10 + n % 10
    }
    let [a, b, c, d] = v4.octets();
    Ipv6Addr::new(0xfd00, digits(a), digits(b), digits(c), 0, 0, 0, digits(d))
}

/// `GET url` with curl from `ns` (2 s at most): (status code, body); code 0 when nothing answered.
pub fn http_status(ns: &NetNs, url: &str) -> Result<(u16, String)> {
    let out = ns.output(
        &[
            "curl",
            "-s",
            "--max-time",
            "2",
            "-w",
            "\x1e%{http_code}",
            url,
        ],
        Duration::from_secs(10),
    )?;
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    let (body, code) = text.rsplit_once('\x1e').unwrap_or((&text, "0"));
    Ok((code.parse().unwrap_or(0), body.to_owned()))
}

/// `http://<ip>:<port>/`, with the IPv6 address in brackets.
pub fn http_url(ip: impl Into<IpAddr>, port: u16) -> String {
    format!("http://{}/", SocketAddr::new(ip.into(), port))
}

// Both families: an IPv4 listener on 0.0.0.0 and an IPv6-only one on :: (so IPv4 clients keep
// their plain addresses in X-Client-Addr; IPv6 ones are written "[addr]:port").
const SERVER_PY: &str = r#"
import socket, socketserver, sys, threading
name, ready = sys.argv[1], sys.argv[2]

def show(a):
    return ("[%s]:%d" if ":" in a[0] else "%s:%d") % a[:2]

class Tcp(socketserver.ThreadingTCPServer):
    allow_reuse_address = True
    daemon_threads = True
    request_queue_size = 1024

class Http(socketserver.BaseRequestHandler):
    def handle(self):
        s = self.request
        s.settimeout(5)
        data = b""
        try:
            while b"\r\n\r\n" not in data and len(data) < 65536:
                chunk = s.recv(4096)
                if not chunk:
                    return
                data += chunk
            body = (name + "\n").encode()
            peer = show(self.client_address)
            head = "HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nX-Client-Addr: %s\r\nContent-Length: %d\r\nConnection: close\r\n\r\n" % (peer, len(body))
            s.sendall(head.encode() + body)
        except OSError:
            pass

class Udp(socketserver.ThreadingUDPServer):
    allow_reuse_address = True
    daemon_threads = True

class Echo(socketserver.BaseRequestHandler):
    def handle(self):
        data, sock = self.request
        if data.startswith(b"big:") and data[4:].isdigit():
            # "big:N": answer N bytes (a small request, a reply larger than the MTU).
            data = b"x" * min(int(data[4:]), 60000)
        sock.sendto(name.encode() + b":" + data, self.client_address)

class V6Only:
    address_family = socket.AF_INET6
    def server_bind(self):
        self.socket.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        super().server_bind()

class Tcp6(V6Only, Tcp):
    pass

class Udp6(V6Only, Udp):
    pass

tcp = Tcp(("0.0.0.0", 8080), Http)
udp = Udp(("0.0.0.0", 5353), Echo)
tcp6 = Tcp6(("::", 8080), Http)
udp6 = Udp6(("::", 5353), Echo)
for server in (udp, tcp6, udp6):
    threading.Thread(target=server.serve_forever, daemon=True).start()
with open(ready, "w") as f:
    f.write("ready\n")
tcp.serve_forever()
"#;

// The family follows the address (IPv6 when it has a colon); an IPv6 source prints "[addr]:port".
const UDP_CLIENT_PY: &str = r#"
import socket, sys
v6 = ":" in sys.argv[1]
s = socket.socket(socket.AF_INET6 if v6 else socket.AF_INET, socket.SOCK_DGRAM)
s.settimeout(2)
s.sendto(sys.argv[3].encode(), (sys.argv[1], int(sys.argv[2])))
data, addr = s.recvfrom(65535)
sys.stdout.write(("[%s]:%d\n" if v6 else "%s:%d\n") % addr[:2])
sys.stdout.write(data.decode(errors="replace"))
"#;

const CONNECT_PY: &str = r#"
import errno, socket, sys, time
s = socket.socket(socket.AF_INET6 if ":" in sys.argv[1] else socket.AF_INET)
s.settimeout(float(sys.argv[3]))
t = time.monotonic()
try:
    s.connect((sys.argv[1], int(sys.argv[2])))
    r = "connected"
except ConnectionRefusedError:
    r = "refused"
except socket.timeout:
    r = "timeout"
except OSError as e:
    r = "error:" + errno.errorcode.get(e.errno, str(e.errno))
print(r, int((time.monotonic() - t) * 1000))
"#;

/// Where a short client command runs: a namespace, or a namespace and a cgroup
/// ([`crate::InCgroup`]: the node's own processes as the socket hooks see them).
pub trait Exec {
    /// Runs `args` to completion (killed after `timeout`); any exit status is returned.
    fn output(&self, args: &[&str], timeout: Duration) -> Result<std::process::Output>;
}

impl Exec for NetNs {
    fn output(&self, args: &[&str], timeout: Duration) -> Result<std::process::Output> {
        NetNs::output(self, args, timeout)
    }
}

/// One UDP datagram (`sendto`, unconnected) and the reply within 2 s; the reply's source as
/// `recvfrom` reported it.
pub fn udp_request_from(
    ns: &impl Exec,
    ip: Ipv4Addr,
    port: u16,
    payload: &str,
) -> Result<UdpReply> {
    let (from, body) = udp_exchange(ns, ip.into(), port, payload)?;
    match from {
        SocketAddr::V4(from) => Ok(UdpReply { from, body }),
        SocketAddr::V6(from) => bail!("IPv4 request to {ip}:{port} answered from {from}"),
    }
}

/// [`udp_request_from`] over IPv6.
pub fn udp6_request_from(
    ns: &impl Exec,
    ip: Ipv6Addr,
    port: u16,
    payload: &str,
) -> Result<UdpReply6> {
    let (from, body) = udp_exchange(ns, ip.into(), port, payload)?;
    match from {
        SocketAddr::V6(from) => Ok(UdpReply6 { from, body }),
        SocketAddr::V4(from) => bail!("IPv6 request to [{ip}]:{port} answered from {from}"),
    }
}

fn udp_exchange(
    ns: &impl Exec,
    ip: IpAddr,
    port: u16,
    payload: &str,
) -> Result<(SocketAddr, String)> {
    let to = SocketAddr::new(ip, port);
    let out = ns.output(
        &[
            "python3",
            "-c",
            UDP_CLIENT_PY,
            &ip.to_string(),
            &port.to_string(),
            payload,
        ],
        Duration::from_secs(10),
    )?;
    if !out.status.success() {
        bail!(
            "no UDP reply from {to}: {}",
            String::from_utf8_lossy(&out.stderr)
                .lines()
                .last()
                .unwrap_or_default()
        );
    }
    let stdout = String::from_utf8_lossy(&out.stdout);
    let (from, body) = stdout
        .split_once('\n')
        .context("UDP client printed no source")?;
    let from = from
        .parse()
        .with_context(|| format!("bad source {from:?}"))?;
    Ok((from, body.to_owned()))
}

/// One TCP connect: the outcome and how long it took.
pub fn tcp_connect_from(
    ns: &impl Exec,
    ip: Ipv4Addr,
    port: u16,
    timeout: Duration,
) -> Result<(ConnectOutcome, Duration)> {
    tcp_connect_any(ns, ip.into(), port, timeout)
}

/// [`tcp_connect_from`] over IPv6.
pub fn tcp6_connect_from(
    ns: &impl Exec,
    ip: Ipv6Addr,
    port: u16,
    timeout: Duration,
) -> Result<(ConnectOutcome, Duration)> {
    tcp_connect_any(ns, ip.into(), port, timeout)
}

fn tcp_connect_any(
    ns: &impl Exec,
    ip: IpAddr,
    port: u16,
    timeout: Duration,
) -> Result<(ConnectOutcome, Duration)> {
    let secs = format!("{:.3}", timeout.as_secs_f64());
    let out = ns.output(
        &[
            "python3",
            "-c",
            CONNECT_PY,
            &ip.to_string(),
            &port.to_string(),
            &secs,
        ],
        timeout + Duration::from_secs(10),
    )?;
    let stdout = String::from_utf8_lossy(&out.stdout);
    let (outcome, ms) = stdout.trim().split_once(' ').with_context(|| {
        format!(
            "connect helper printed {stdout:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        )
    })?;
    let elapsed = Duration::from_millis(ms.parse().context("connect helper: elapsed")?);
    let outcome = match outcome {
        "connected" => ConnectOutcome::Connected,
        "refused" => ConnectOutcome::Refused,
        "timeout" => ConnectOutcome::TimedOut,
        other => ConnectOutcome::Error(other.trim_start_matches("error:").to_owned()),
    };
    Ok((outcome, elapsed))
}

/// A pod: a namespace with `eth0`, its host-side veth in the node namespace, and servers.
#[derive(Debug)]
pub struct Pod {
    pub name: String,
    pub ip: Ipv4Addr,
    /// The pod's IPv6 address, [`ipv6_of`] `ip`.
    pub ip6: Ipv6Addr,
    /// Host-side interface in the node namespace: `veth-<name>`.
    pub host_if: String,
    // Drop order: servers before the namespace.
    servers: Vec<Proc>,
    ns: NetNs,
}

impl Pod {
    pub fn ns(&self) -> &NetNs {
        &self.ns
    }
}

/// Reply to one HTTP request made with curl.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CurlReply {
    /// Response body, trimmed (the backend's pod name).
    pub body: String,
    /// curl's `%{remote_ip}`: the address the client connected to.
    pub remote_ip: String,
}

/// Reply to one UDP datagram.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct UdpReply {
    /// Source address of the reply as the client saw it.
    pub from: SocketAddrV4,
    /// `<pod name>:<payload>` from the echo server.
    pub body: String,
}

/// Reply to one UDP datagram over IPv6.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct UdpReply6 {
    /// Source address of the reply as the client saw it.
    pub from: SocketAddrV6,
    /// `<pod name>:<payload>` from the echo server.
    pub body: String,
}

/// How a TCP connect attempt ended.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ConnectOutcome {
    Connected,
    Refused,
    TimedOut,
    /// Another errno (EHOSTUNREACH, ENETUNREACH, ...).
    Error(String),
}

/// The namespaces behind a node's uplink ([`Topology::add_uplink`]); drop them before the
/// topology.
#[derive(Debug)]
pub struct Uplink {
    /// The external client, on `up-a`.
    pub ext: NetNs,
    /// A second port's peer that sends nothing.
    pub idle: NetNs,
}

/// One-node topology. Drop removes pods, then the node namespace, then the temp dir.
#[derive(Debug)]
pub struct Topology {
    prefix: String,
    pods: BTreeMap<String, Pod>,
    node: NetNs,
    tmp: TempDir,
}

impl Topology {
    /// The standard topology: node, `client` and backends be1..be3 serving HTTP and UDP.
    pub fn new() -> Result<Self> {
        let mut topo = Self::bare()?;
        topo.add_pod("client", CLIENT_IP)?;
        for (name, ip) in BACKENDS {
            topo.add_backend(name, ip)?;
        }
        Ok(topo)
    }

    /// Only the node namespace; add pods with [`Topology::add_pod`]/[`Topology::add_backend`].
    pub fn bare() -> Result<Self> {
        let prefix = unique_prefix();
        let tmp = TempDir::new(&prefix)?;
        std::fs::write(tmp.join("server.py"), SERVER_PY)?;
        let node = NetNs::new(&format!("{prefix}-node"))?;
        node.sysctl("net.ipv4.ip_forward", "1")?;
        node.sysctl("net.ipv4.conf.all.send_redirects", "0")?;
        node.sysctl("net.ipv4.conf.default.send_redirects", "0")?;
        node.sysctl("net.ipv6.conf.all.forwarding", "1")?;
        node.exec(&["ip", "addr", "add", &format!("{GATEWAY}/32"), "dev", "lo"])?;
        node.exec(&[
            "ip",
            "-6",
            "addr",
            "add",
            &format!("{NODE_LOCAL_IP6}/128"),
            "dev",
            "lo",
        ])?;
        Ok(Self {
            prefix,
            pods: BTreeMap::new(),
            node,
            tmp,
        })
    }

    /// Unique prefix of every namespace of this topology.
    pub fn prefix(&self) -> &str {
        &self.prefix
    }

    pub fn node(&self) -> &NetNs {
        &self.node
    }

    /// A scratch directory removed with the topology (logs, status files).
    pub fn tmp(&self) -> &TempDir {
        &self.tmp
    }

    pub fn pod(&self, name: &str) -> Result<&Pod> {
        self.pods
            .get(name)
            .with_context(|| format!("no pod {name} in the topology"))
    }

    /// The pods' host-side interfaces (what the agent attaches to with `--pod-interfaces veth-*`).
    pub fn pod_interfaces(&self) -> Vec<String> {
        self.pods().map(|p| p.host_if.clone()).collect()
    }

    pub fn pods(&self) -> impl Iterator<Item = &Pod> {
        self.pods.values()
    }

    /// The node's uplink, found by the agent's `--devices auto`: a bridge `br-up` holding
    /// `node_ip`/24 and the node's default route (via `ext_ip`), with two veth ports, `up-a` to a
    /// new external client namespace (`ext_ip`) and `up-b` to a second, idle one. The client's
    /// namespace routes nowhere else, so the default route leads nowhere outside the test.
    pub fn add_uplink(&self, node_ip: Ipv4Addr, ext_ip: Ipv4Addr) -> Result<Uplink> {
        let node = &self.node;
        let ext = NetNs::new(&format!("{}-ext", self.prefix))?;
        let idle = NetNs::new(&format!("{}-idle", self.prefix))?;
        node.exec(&["ip", "link", "add", "br-up", "type", "bridge"])?;
        for (port, peer) in [("up-a", &ext), ("up-b", &idle)] {
            node.exec(&[
                "ip",
                "link",
                "add",
                port,
                "type",
                "veth",
                "peer",
                "name",
                "eth0",
                "netns",
                peer.name(),
            ])?;
            node.exec(&["ip", "link", "set", port, "master", "br-up"])?;
            node.exec(&["ip", "link", "set", port, "up"])?;
            peer.exec(&["ip", "link", "set", "eth0", "up"])?;
        }
        node.exec(&[
            "ip",
            "addr",
            "add",
            &format!("{node_ip}/24"),
            "dev",
            "br-up",
        ])?;
        node.exec(&["ip", "link", "set", "br-up", "up"])?;
        node.exec(&[
            "ip",
            "route",
            "add",
            "default",
            "via",
            &ext_ip.to_string(),
            "dev",
            "br-up",
        ])?;
        ext.exec(&["ip", "addr", "add", &format!("{ext_ip}/24"), "dev", "eth0"])?;
        ext.sysctl("net.ipv4.tcp_max_tw_buckets", "0")?;
        Ok(Uplink { ext, idle })
    }

    /// Creates a pod namespace wired to the node (no servers).
    pub fn add_pod(&mut self, name: &str, ip: Ipv4Addr) -> Result<&Pod> {
        self.add_pod_on(name, ip, &format!("veth-{name}"))
    }

    /// [`Topology::add_pod`] with the host side of its veth named `host_if` (as another CNI
    /// names it: `eni0abc`, `azv12`, `cali1234`).
    pub fn add_pod_on(&mut self, name: &str, ip: Ipv4Addr, host_if: &str) -> Result<&Pod> {
        let host_if = host_if.to_owned();
        ensure!(
            host_if.len() <= 15,
            "pod name {name} too long for interface {host_if}"
        );
        ensure!(!self.pods.contains_key(name), "pod {name} exists already");
        let ns = NetNs::new(&format!("{}-{name}", self.prefix))?;
        let node = self.node.name();
        let pod = ns.name();
        ip_n(
            node,
            &[
                "link", "add", &host_if, "type", "veth", "peer", "name", "eth0", "netns", pod,
            ],
        )?;
        ip_n(pod, &["addr", "add", &format!("{ip}/32"), "dev", "eth0"])?;
        ip_n(pod, &["link", "set", "eth0", "up"])?;
        ip_n(
            pod,
            &[
                "route",
                "add",
                &GATEWAY.to_string(),
                "dev",
                "eth0",
                "scope",
                "link",
            ],
        )?;
        ip_n(
            pod,
            &[
                "route",
                "add",
                "default",
                "via",
                &GATEWAY.to_string(),
                "dev",
                "eth0",
            ],
        )?;
        let ip6 = ipv6_of(ip);
        ip_n(
            pod,
            &[
                "-6",
                "addr",
                "add",
                &format!("{ip6}/128"),
                "dev",
                "eth0",
                "nodad",
            ],
        )?;
        ip_n(
            pod,
            &[
                "-6",
                "route",
                "add",
                "default",
                "via",
                &GATEWAY6.to_string(),
                "dev",
                "eth0",
            ],
        )?;
        ns.sysctl("net.ipv4.tcp_max_tw_buckets", "0")?;
        ns.exec(&["ethtool", "-K", "eth0", "tx", "off", "rx", "off"])?;
        self.node
            .sysctl(&format!("net.ipv4.conf.{host_if}.proxy_arp"), "1")?;
        self.node
            .sysctl(&format!("net.ipv4.neigh.{host_if}.proxy_delay"), "0")?;
        self.node
            .sysctl(&format!("net.ipv4.conf.{host_if}.send_redirects"), "0")?;
        self.node
            .exec(&["ethtool", "-K", &host_if, "tx", "off", "rx", "off"])?;
        ip_n(
            node,
            &[
                "-6",
                "addr",
                "add",
                &format!("{GATEWAY6}/64"),
                "dev",
                &host_if,
                "nodad",
            ],
        )?;
        ip_n(node, &["link", "set", &host_if, "up"])?;
        ip_n(
            node,
            &["route", "add", &format!("{ip}/32"), "dev", &host_if],
        )?;
        ip_n(
            node,
            &["-6", "route", "add", &format!("{ip6}/128"), "dev", &host_if],
        )?;
        let pod = Pod {
            name: name.to_owned(),
            ip,
            ip6,
            host_if,
            servers: Vec::new(),
            ns,
        };
        Ok(self.pods.entry(name.to_owned()).or_insert(pod))
    }

    /// Creates a backend pod running the HTTP (:8080) and UDP echo (:5353) server.
    pub fn add_backend(&mut self, name: &str, ip: Ipv4Addr) -> Result<&Pod> {
        self.add_pod(name, ip)?;
        let script = self.tmp.join("server.py");
        let ready = self.tmp.join(&format!("{name}.ready"));
        let log = self.tmp.join(&format!("{name}.log"));
        let _ = std::fs::remove_file(&ready);
        let pod = self.pods.get_mut(name).context("pod just added")?;
        let args = ["python3", path_str(&script)?, name, path_str(&ready)?];
        let mut server = pod.ns.spawn(&args, Some(&log))?;
        wait_for(Duration::from_secs(10), || {
            if let Some(status) = server.try_wait()? {
                bail!(
                    "server in {name} exited ({}): {}",
                    describe(status),
                    tail(&log, 2000)
                );
            }
            Ok(ready.exists())
        })
        .with_context(|| format!("starting the servers in pod {name}"))?;
        pod.servers.push(server);
        Ok(pod)
    }

    /// Deletes a pod (its servers, namespace and veth pair).
    pub fn remove_pod(&mut self, name: &str) -> Result<()> {
        let pod = self
            .pods
            .remove(name)
            .with_context(|| format!("no pod {name}"))?;
        drop(pod);
        Ok(())
    }

    /// Starts `iperf3 -s -p 5201` in a pod and waits until it listens.
    pub fn start_iperf3_server(&mut self, name: &str) -> Result<()> {
        let log = self.tmp.join(&format!("{name}-iperf3.log"));
        let pod = self
            .pods
            .get_mut(name)
            .with_context(|| format!("no pod {name}"))?;
        let port = IPERF_PORT.to_string();
        let mut server = pod.ns.spawn(&["iperf3", "-s", "-p", &port], Some(&log))?;
        let filter = format!("sport = :{IPERF_PORT}");
        let ns = &pod.ns;
        wait_for(Duration::from_secs(10), || {
            if let Some(status) = server.try_wait()? {
                bail!(
                    "iperf3 -s in {name} exited ({}): {}",
                    describe(status),
                    tail(&log, 2000)
                );
            }
            Ok(!ns.exec(&["ss", "-Hltn", &filter])?.trim().is_empty())
        })
        .with_context(|| format!("starting iperf3 in pod {name}"))?;
        pod.servers.push(server);
        Ok(())
    }

    fn client(&self) -> Result<&Pod> {
        self.pod("client")
    }

    /// One HTTP GET from the client pod (`curl -s --max-time 3`); an IPv6 URL has the address
    /// in brackets ([`http_url`]).
    pub fn curl(&self, url: &str) -> Result<CurlReply> {
        let mut replies = self.curl_many(url, 1)?;
        replies
            .pop()
            .context("curl printed nothing")?
            .map_err(anyhow::Error::msg)
    }

    /// `n` sequential HTTP GETs from the client pod in one curl process (each on its own TCP
    /// connection: the servers close). One entry per request: the reply or curl's error.
    pub fn curl_many(&self, url: &str, n: usize) -> Result<Vec<Result<CurlReply, String>>> {
        self.curl_many_from("client", url, n)
    }

    /// [`Topology::curl_many`] from the pod `pod` (e.g. a second client added with
    /// [`Topology::add_pod`]).
    pub fn curl_many_from(
        &self,
        pod: &str,
        url: &str,
        n: usize,
    ) -> Result<Vec<Result<CurlReply, String>>> {
        ensure!(
            (1..=10_000).contains(&n),
            "curl_many: n={n} out of 1..=10000"
        );
        let mut args = vec![
            "curl",
            "-s",
            "--max-time",
            "3",
            "-H",
            "Connection: close",
            "-w",
            "\x1e%{remote_ip}\x1e%{http_code}\x1e%{exitcode}\x1e%{errormsg}\x1e%{local_port}\x1d",
        ];
        args.extend(std::iter::repeat_n(url, n));
        let timeout = Duration::from_secs(10) + Duration::from_secs(4) * n as u32;
        let out = self.pod(pod)?.ns.output(&args, timeout)?;
        let stdout = String::from_utf8_lossy(&out.stdout);
        let replies: Vec<_> = stdout
            .split('\x1d')
            .filter(|r| !r.is_empty())
            .map(parse_curl_record)
            .collect();
        ensure!(
            replies.len() == n,
            "curl printed {} records for {n} requests ({}): {}",
            replies.len(),
            describe(out.status),
            String::from_utf8_lossy(&out.stderr)
        );
        Ok(replies)
    }

    /// Sends one UDP datagram from the client pod and waits up to 2 s for the reply.
    pub fn udp_request(&self, ip: Ipv4Addr, port: u16, payload: &str) -> Result<UdpReply> {
        udp_request_from(&self.client()?.ns, ip, port, payload)
    }

    /// [`Topology::udp_request`] over IPv6.
    pub fn udp6_request(&self, ip: Ipv6Addr, port: u16, payload: &str) -> Result<UdpReply6> {
        udp6_request_from(&self.client()?.ns, ip, port, payload)
    }

    /// [`Topology::tcp_connect`] over IPv6.
    pub fn tcp6_connect(
        &self,
        ip: Ipv6Addr,
        port: u16,
        timeout: Duration,
    ) -> Result<(ConnectOutcome, Duration)> {
        tcp6_connect_from(&self.client()?.ns, ip, port, timeout)
    }

    /// [`Topology::tcp_connect_refused`] over IPv6 (RST or ICMPv6 port unreachable within 1 s).
    pub fn tcp6_connect_refused(&self, ip: Ipv6Addr, port: u16) -> bool {
        matches!(
            self.tcp6_connect(ip, port, Duration::from_secs(2)),
            Ok((ConnectOutcome::Refused, elapsed)) if elapsed < Duration::from_secs(1)
        )
    }

    /// One TCP connect from the client pod; the outcome and how long it took.
    pub fn tcp_connect(
        &self,
        ip: Ipv4Addr,
        port: u16,
        timeout: Duration,
    ) -> Result<(ConnectOutcome, Duration)> {
        tcp_connect_from(&self.client()?.ns, ip, port, timeout)
    }

    /// True when a TCP connect from the client is refused within 1 s (RST or ICMP port
    /// unreachable), not timed out.
    pub fn tcp_connect_refused(&self, ip: Ipv4Addr, port: u16) -> bool {
        matches!(
            self.tcp_connect(ip, port, Duration::from_secs(2)),
            Ok((ConnectOutcome::Refused, elapsed)) if elapsed < Duration::from_secs(1)
        )
    }

    /// Starts `iperf3 -c ip -p port -t seconds -J` in the client pod, in the background.
    pub fn iperf3_client(&self, ip: Ipv4Addr, port: u16, seconds: u32) -> Result<IperfRun> {
        ensure!(
            (1..=60).contains(&seconds),
            "iperf3 duration {seconds}s out of 1..=60"
        );
        let output = self.tmp.join(&format!("iperf3-client-{ip}-{port}.json"));
        let _ = std::fs::remove_file(&output);
        let args = [
            "iperf3",
            "-c",
            &ip.to_string(),
            "-p",
            &port.to_string(),
            "-t",
            &seconds.to_string(),
            "-J",
            "--connect-timeout",
            "3000",
        ];
        let proc = self.client()?.ns.spawn(&args, Some(&output))?;
        Ok(IperfRun {
            proc,
            output,
            seconds,
        })
    }
}

/// A running iperf3 client.
#[derive(Debug)]
pub struct IperfRun {
    proc: Proc,
    output: PathBuf,
    seconds: u32,
}

/// What an iperf3 client run reported.
#[derive(Clone, Debug, PartialEq)]
pub struct IperfSummary {
    /// Whether iperf3 exited 0.
    pub success: bool,
    /// `end.sum_received.seconds`.
    pub seconds: f64,
    /// `end.sum_received.bits_per_second`.
    pub bits_per_second: f64,
    /// `end.sum_sent.retransmits`.
    pub retransmits: u64,
    /// iperf3's `error` field, if any.
    pub error: Option<String>,
}

impl IperfRun {
    /// Waits for the client (at most its duration + 15 s) and parses its JSON report.
    pub fn wait(mut self) -> Result<IperfSummary> {
        let limit = Duration::from_secs(u64::from(self.seconds) + 15);
        let status = self.proc.wait_or_kill(limit)?;
        let text = std::fs::read_to_string(&self.output)
            .with_context(|| format!("reading {}", self.output.display()))?;
        let mut summary = parse_iperf3_json(&text)
            .with_context(|| format!("iperf3 exited ({}) with output: {text}", describe(status)))?;
        summary.success = status.success() && summary.error.is_none();
        Ok(summary)
    }
}

fn parse_iperf3_json(text: &str) -> Result<IperfSummary> {
    let v: serde_json::Value = serde_json::from_str(text).context("iperf3 JSON")?;
    let recv = &v["end"]["sum_received"];
    Ok(IperfSummary {
        success: false,
        seconds: recv["seconds"].as_f64().unwrap_or(0.0),
        bits_per_second: recv["bits_per_second"].as_f64().unwrap_or(0.0),
        retransmits: v["end"]["sum_sent"]["retransmits"].as_u64().unwrap_or(0),
        error: v["error"].as_str().map(str::to_owned),
    })
}

fn parse_curl_record(record: &str) -> Result<CurlReply, String> {
    let mut fields = record.split('\x1e');
    let body = fields.next().unwrap_or_default().trim().to_owned();
    let remote_ip = fields.next().unwrap_or_default().to_owned();
    let code = fields.next().unwrap_or_default();
    let exit = fields.next().unwrap_or_default();
    let msg = fields.next().unwrap_or_default();
    let local_port = fields.next().unwrap_or_default();
    if exit != "0" || code != "200" {
        // The client port names the flow in a capture or a conntrack dump.
        return Err(format!(
            "curl exit {exit}, HTTP {code}, from local port {local_port}: {msg}"
        ));
    }
    Ok(CurlReply { body, remote_ip })
}

/// `ip -n <ns> args...` with a bound.
fn ip_n(ns: &str, args: &[&str]) -> Result<()> {
    let mut cmd = Command::new("ip");
    cmd.args(["-n", ns]).args(args);
    run_ok(cmd, EXEC_TIMEOUT)?;
    Ok(())
}

fn path_str(path: &std::path::Path) -> Result<&str> {
    path.to_str()
        .with_context(|| format!("non-UTF-8 path {}", path.display()))
}

/// Polls `ready` every 20 ms until it returns true, fails after `timeout`.
pub(crate) fn wait_for(timeout: Duration, mut ready: impl FnMut() -> Result<bool>) -> Result<()> {
    let deadline = Instant::now() + timeout;
    loop {
        if ready()? {
            return Ok(());
        }
        if Instant::now() >= deadline {
            bail!("not ready within {timeout:?}");
        }
        thread::sleep(Duration::from_millis(20));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn curl_records() {
        assert_eq!(
            parse_curl_record("be1\n\x1e10.96.0.10\x1e200\x1e0\x1e"),
            Ok(CurlReply {
                body: "be1".into(),
                remote_ip: "10.96.0.10".into()
            })
        );
        let err = parse_curl_record("\x1e10.96.0.10\x1e000\x1e7\x1eFailed to connect\x1e41234")
            .unwrap_err();
        assert!(err.contains("exit 7"), "{err}");
        assert!(err.contains("local port 41234"), "{err}");
    }

    #[test]
    fn iperf3_report() {
        let s = parse_iperf3_json(
            r#"{"end":{"sum_received":{"seconds":8.01,"bits_per_second":1.5e10},"sum_sent":{"retransmits":3}}}"#,
        )
        .expect("parses");
        assert_eq!(s.seconds, 8.01);
        assert_eq!(s.retransmits, 3);
        assert_eq!(s.error, None);
    }

    #[test]
    fn ipv6_addresses_read_like_the_ipv4_ones() {
        assert_eq!(
            ipv6_of(Ipv4Addr::new(10, 244, 1, 11)).to_string(),
            "fd00:10:244:1::11"
        );
        assert_eq!(CLIENT_IP6.to_string(), "fd00:10:244:1::2");
        assert_eq!(
            ipv6_of(Ipv4Addr::new(192, 168, 50, 100)).to_string(),
            "fd00:192:168:50::100"
        );
        assert_eq!(
            ipv6_of(Ipv4Addr::new(255, 0, 9, 255)).to_string(),
            "fd00:255:0:9::255"
        );
        assert_eq!(BACKENDS6[2], ("be3", "fd00:10:244:1::13".parse().unwrap()));
        assert_eq!(
            http_url(BACKENDS6[0].1, 8080),
            "http://[fd00:10:244:1::11]:8080/"
        );
        assert_eq!(http_url(CLIENT_IP, 80), "http://10.244.1.2:80/");
    }
}
