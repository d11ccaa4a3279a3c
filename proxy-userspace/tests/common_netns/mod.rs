//! Harness shared by the network-namespace suites (netns.rs, netns6.rs, northsouth.rs, and the
//! suites written after their pattern): the agent running standalone on the standard one-node
//! topology ([`Env`]) or on each node of the two-node topology ([`Cluster`]), and the request
//! loops that count which backend answered a Service while checking every reply came from it.
//! Everything lives in namespaces, pin dirs and manifest dirs the test creates; the RAII guards
//! here remove them (agents first) even when an assertion fails.

#![allow(
    dead_code,
    reason = "each test binary uses a different part of the helpers"
)]

use std::{
    collections::BTreeMap,
    ffi::OsStr,
    net::{IpAddr, SocketAddr},
    path::Path,
    time::Duration,
};

use proxy_testenv::{
    Agent, CurlReply, EXT_DEVICE, ManifestDir, MultiNode, NODE_NAMES, NetNs, PinDir, Proc,
    Topology, http_url,
};

pub const BIN: &str = env!("CARGO_BIN_EXE_kube-proxy-ebpf");
/// The agent's metrics endpoint (its default `--metrics-bind-address`), in the node namespace.
pub const METRICS_URL: &str = "http://127.0.0.1:10249/metrics";

/// One agent on the standard topology. Field order is drop order: the agent dies first, then
/// pins, manifests and namespaces go.
pub struct Env {
    pub agent: Agent,
    pub pins: PinDir,
    pub manifests: ManifestDir,
    pub topo: Topology,
}

impl Env {
    /// Topology + manifests written by `services` + agent synced and attached to all pods.
    pub fn start(services: impl FnOnce(&ManifestDir)) -> Self {
        Self::start_with_flags(services, &[])
    }

    /// As [`Env::start`], with extra `run` flags.
    pub fn start_with_flags(services: impl FnOnce(&ManifestDir), flags: &[&str]) -> Self {
        let topo = Topology::new().expect("creating the topology");
        Self::start_on_with_flags(topo, services, flags)
    }

    /// As [`Env::start`] on a topology the test prepared (programs already on its interfaces).
    pub fn start_on(topo: Topology, services: impl FnOnce(&ManifestDir)) -> Self {
        Self::start_on_with_flags(topo, services, &[])
    }

    /// As [`Env::start_on`], with extra `run` flags.
    pub fn start_on_with_flags(
        topo: Topology,
        services: impl FnOnce(&ManifestDir),
        flags: &[&str],
    ) -> Self {
        proxy_testenv::ensure_bpffs().expect("bpffs at /sys/fs/bpf");
        let manifests = ManifestDir::new().expect("manifest dir");
        services(&manifests);
        let pins = PinDir::new(&format!("{}-pins", topo.prefix())).expect("pin dir");
        let mut args = vec!["--manifests".as_ref(), manifests.path().as_os_str()];
        args.extend(flags.iter().map(OsStr::new));
        let agent = start_agent(&topo, &args, &pins, topo.pod_interfaces(), "the agent");
        Self {
            agent,
            pins,
            manifests,
            topo,
        }
    }

    /// Panics with the message and the agent's log tail.
    pub fn fail(&self, msg: &str) -> ! {
        self.agent.fail(msg)
    }

    pub fn check(&self, cond: bool, msg: impl FnOnce() -> String) {
        self.agent.check(cond, msg)
    }

    /// The agent's Prometheus metrics, scraped from the node namespace.
    pub fn metrics(&self) -> String {
        let out = (self.topo.node())
            .output(
                &["curl", "-sS", "--max-time", "3", METRICS_URL],
                Duration::from_secs(10),
            )
            .unwrap_or_else(|e| self.fail(&format!("scraping /metrics: {e:#}")));
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    /// `n` HTTP requests from the client pod to `vip`:`port`; see [`Env::distribution_from`].
    pub fn distribution(
        &self,
        vip: impl Into<IpAddr>,
        port: u16,
        n: usize,
    ) -> BTreeMap<String, usize> {
        self.distribution_from("client", vip, port, n)
    }

    /// `n` HTTP requests from `pod` to `vip`:`port`; see [`distribution`].
    pub fn distribution_from(
        &self,
        pod: &str,
        vip: impl Into<IpAddr>,
        port: u16,
        n: usize,
    ) -> BTreeMap<String, usize> {
        distribution(&self.topo, &self.agent, pod, vip.into(), port, n)
    }

    /// `n` UDP datagrams `ping<i>` from the client pod to `vip`:`port` (a Service on the
    /// backends' echo servers); every one must be echoed back, from `vip`:`port`. Counts per
    /// backend (the echo is `<pod name>:<payload>`).
    pub fn udp_echo_distribution(
        &self,
        vip: IpAddr,
        port: u16,
        n: usize,
    ) -> BTreeMap<String, usize> {
        let mut counts = BTreeMap::new();
        for i in 0..n {
            let payload = format!("ping{i}");
            let reply = match vip {
                IpAddr::V4(ip) => (self.topo.udp_request(ip, port, &payload))
                    .map(|r| (SocketAddr::V4(r.from), r.body)),
                IpAddr::V6(ip) => (self.topo.udp6_request(ip, port, &payload))
                    .map(|r| (SocketAddr::V6(r.from), r.body)),
            };
            let to = SocketAddr::new(vip, port);
            let (from, body) =
                reply.unwrap_or_else(|e| self.fail(&format!("UDP request {i} to {to}: {e:#}")));
            self.check(from.ip() == vip && from.port() == port, || {
                format!("UDP reply from {from} instead of {to}")
            });
            let (backend, echoed) = body.split_once(':').unwrap_or_default();
            self.check(echoed == payload, || {
                format!("UDP echo {body:?} for {payload}")
            });
            *counts.entry(backend.to_owned()).or_insert(0) += 1;
        }
        counts
    }
}

/// `n` HTTP requests (one TCP connection each) from `pod` of `topo` to `vip`:`port`; every one
/// must be answered, from the VIP (a failure shows `agent`'s log). Counts per backend (the reply
/// body is its pod name).
pub fn distribution(
    topo: &Topology,
    agent: &Agent,
    pod: &str,
    vip: IpAddr,
    port: u16,
    n: usize,
) -> BTreeMap<String, usize> {
    let url = http_url(vip, port);
    let replies = topo
        .curl_many_from(pod, &url, n)
        .unwrap_or_else(|e| agent.fail(&format!("curl_many from {pod} to {url}: {e:#}")));
    let mut counts = BTreeMap::new();
    for (i, reply) in replies.into_iter().enumerate() {
        match reply {
            Ok(CurlReply { body, remote_ip }) => {
                agent.check(remote_ip == vip.to_string(), || {
                    format!("{pod} request {i}: answered by {remote_ip}, not the VIP {vip}")
                });
                *counts.entry(body).or_insert(0) += 1;
            }
            Err(e) => agent.fail(&format!("{pod} request {i} of {n} to {url} failed: {e}")),
        }
    }
    counts
}

/// The agent in `topo`'s node namespace with `args`, pinning under `pins` (its status and log
/// in `topo`'s temporary dir), once it has attached to `interfaces`; `what` names it in a panic.
pub fn start_agent(
    topo: &Topology,
    args: &[&OsStr],
    pins: &PinDir,
    interfaces: Vec<String>,
    what: &str,
) -> Agent {
    let mut agent = Agent::start_with(
        Path::new(BIN),
        topo.node(),
        args,
        pins.path(),
        topo.tmp().path(),
    )
    .unwrap_or_else(|e| panic!("starting {what}: {e:#}"));
    agent
        .wait_attached(&interfaces)
        .unwrap_or_else(|e| panic!("{what}: {e:#}"));
    agent
}

/// One agent on each node of the two-node topology, all on the same manifests. Field order is
/// drop order: agents first, then pins, manifests, namespaces.
pub struct Cluster {
    pub agents: Vec<Agent>,
    _pins: Vec<PinDir>,
    _manifests: ManifestDir,
    pub net: MultiNode,
}

impl Cluster {
    /// `services` written, then on each node of `net` (its pods already added) an agent with
    /// `--devices ext0 --hostname-override <node> --cluster-cidr <cluster_cidr>`, synced and
    /// attached to its pods and ext0.
    pub fn start_on(
        net: MultiNode,
        cluster_cidr: &str,
        services: impl FnOnce(&ManifestDir),
    ) -> Self {
        proxy_testenv::ensure_bpffs().expect("bpffs at /sys/fs/bpf");
        let manifests = ManifestDir::new().expect("manifest dir");
        services(&manifests);
        let mut agents = Vec::new();
        let mut pins = Vec::new();
        for (i, name) in NODE_NAMES.iter().enumerate() {
            let node = net.node(i);
            let pin = PinDir::new(&format!("{}-pins", node.prefix())).expect("pin dir");
            let args = net.agent_args(i, manifests.path(), cluster_cidr);
            let args: Vec<&std::ffi::OsStr> = args.iter().map(|a| a.as_os_str()).collect();
            let mut want = node.pod_interfaces();
            want.push(EXT_DEVICE.to_owned());
            let agent = start_agent(node, &args, &pin, want, name);
            agents.push(agent);
            pins.push(pin);
        }
        Self {
            agents,
            _pins: pins,
            _manifests: manifests,
            net,
        }
    }

    /// The manifest folder both agents read.
    pub fn manifests(&self) -> &ManifestDir {
        &self._manifests
    }

    /// [`Cluster::fail`] unless `cond`.
    pub fn check(&self, cond: bool, msg: impl FnOnce() -> String) {
        if !cond {
            self.fail(&msg());
        }
    }

    /// Panics with the message and every node's agent log tail.
    pub fn fail(&self, msg: &str) -> ! {
        let mut text = msg.to_owned();
        for (name, agent) in NODE_NAMES.iter().zip(&self.agents) {
            text.push_str(&format!(
                "\n--- {name} agent log (tail) ---\n{}",
                agent.log_tail()
            ));
        }
        panic!("{text}")
    }
}

/// An HTTP server answering every request on port 8081 (IPv4 and IPv6: one dual-stack socket)
/// with 1 MiB of body; it exits after 120 s at the latest.
const BIG_SERVER_PY: &str = r#"
import socket, sys, threading
s = socket.socket(socket.AF_INET6)
s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("::", 8081))
s.listen(16)
open(sys.argv[1], "w").close()
body = b"x" * (1 << 20)
def serve(c):
    try:
        c.settimeout(20)
        data = b""
        while b"\r\n\r\n" not in data:
            chunk = c.recv(4096)
            if not chunk:
                return
            data += chunk
        c.sendall(b"HTTP/1.0 200 OK\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
    except OSError:
        pass
    finally:
        c.close()
threading.Timer(120, lambda: __import__("os")._exit(0)).start()
while True:
    c, _ = s.accept()
    threading.Thread(target=serve, args=(c,), daemon=True).start()
"#;

/// Starts the 1 MiB server ([`BIG_SERVER_PY`], port 8081, both families) in `ns` and waits
/// (at most 10 s) until it listens; `work` holds its ready file.
pub fn big_download_server(ns: &NetNs, work: &Path) -> anyhow::Result<Proc> {
    let ready = work.join(format!("{}.big-ready", ns.name()));
    let server = ns.spawn(
        &["python3", "-c", BIG_SERVER_PY, &ready.to_string_lossy()],
        None,
    )?;
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while !ready.exists() {
        anyhow::ensure!(
            std::time::Instant::now() < deadline,
            "the 1 MiB server in {} did not start",
            ns.name()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    Ok(server)
}

/// The far client's networks behind the external client: 192.168.90.0/24 and
/// fd00:192:168:90::/64, the router (the external client's namespace) at .1 / ::1.
pub const FAR_NET: &str = "192.168.90.0/24";
pub const FAR_NET6: &str = "fd00:192:168:90::/64";
pub const FAR_CLIENT: &str = "192.168.90.2";
pub const FAR_CLIENT6: &str = "fd00:192:168:90::2";

/// A client namespace behind `router` (the external client's namespace, which forwards for it,
/// both families), on a link whose router side has MTU 1400 while the client's side has the
/// usual 1500: its MSS asks for full-size segments, which the router cannot forward, so a
/// download to it depends on path MTU discovery. The far client reaches the two-node
/// topology's wire; the caller routes the nodes' replies to [`FAR_NET`]/[`FAR_NET6`] via the
/// router.
pub fn far_client_behind(router: &NetNs) -> anyhow::Result<NetNs> {
    let far = NetNs::new(&format!("{}-far", proxy_testenv::unique_prefix()))?;
    let mut link = vec!["ip", "link", "add", "eth1", "mtu", "1400", "type", "veth"];
    link.extend(["peer", "name", "eth0", "netns", far.name()]);
    router.exec(&link)?;
    router.exec(&["ip", "addr", "add", "192.168.90.1/24", "dev", "eth1"])?;
    router.exec(&[
        "ip",
        "-6",
        "addr",
        "add",
        "fd00:192:168:90::1/64",
        "dev",
        "eth1",
    ])?;
    router.exec(&["ip", "link", "set", "eth1", "up"])?;
    router.sysctl("net.ipv4.ip_forward", "1")?;
    router.sysctl("net.ipv6.conf.all.forwarding", "1")?;
    let far_addr = format!("{FAR_CLIENT}/24");
    let far_addr6 = format!("{FAR_CLIENT6}/64");
    far.exec(&["ip", "addr", "add", &far_addr, "dev", "eth0"])?;
    far.exec(&[
        "ip", "-6", "addr", "add", &far_addr6, "dev", "eth0", "nodad",
    ])?;
    far.exec(&["ip", "link", "set", "eth0", "up"])?;
    far.exec(&["ip", "link", "set", "lo", "up"])?;
    // The two-node topology's wire (nodes and the external client).
    far.exec(&[
        "ip",
        "route",
        "add",
        "192.168.50.0/24",
        "via",
        "192.168.90.1",
    ])?;
    let wire6 = "fd00:192:168:50::/64";
    far.exec(&[
        "ip",
        "-6",
        "route",
        "add",
        wire6,
        "via",
        "fd00:192:168:90::1",
    ])?;
    Ok(far)
}

/// Downloads 1 MiB from `url` in `far` (curl, 10 s at most); the number of bytes received,
/// with curl's exit code and error for the failure message.
pub fn big_download(far: &NetNs, url: &str) -> anyhow::Result<(u64, String)> {
    let out = far.output(
        &[
            "curl",
            "-g",
            "-s",
            "-o",
            "/dev/null",
            "--max-time",
            "10",
            "-w",
            "%{size_download} %{exitcode} %{errormsg}",
            url,
        ],
        Duration::from_secs(20),
    )?;
    let shown = String::from_utf8_lossy(&out.stdout).trim().to_owned();
    let bytes = shown.split(' ').next().unwrap_or_default().parse()?;
    Ok((bytes, shown))
}
