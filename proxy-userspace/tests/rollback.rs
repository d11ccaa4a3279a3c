//! Privileged roll-back tests: a node going back to kube-proxy. Node A of the two-node topology
//! runs the agent from a fake API server (in its namespace) that serves deploy/daemonset.yaml's
//! DaemonSet, the Node, a ServiceCIDR and the Services; kube-proxy is its nftables rule set
//! (`proxy_testenv::kube_proxy`, upstream's shape) loaded into node A, and, where it must be
//! seen starting, a process binding its health port in node A's namespace.
//!
//! - The DaemonSet deleted and the agent stopped as its pod is (SIGTERM): the node is left clean
//!   (no programs, no pins) and kube-proxy's rules serve every Service, old and new, from pods
//!   and from outside; an endpoint kube-proxy drops gets no more traffic.
//! - A node opting out by label: the same clean-up.
//! - The agent gone without its clean-up (SIGKILL), then kube-proxy starts: the datapath hands
//!   new flows over to the stack (kube-proxy's rules serve them, old and new Services alike)
//!   while a TCP stream it translated before goes on, whole; a new agent takes the node back.
//! - A restart (SIGTERM with the DaemonSet in place): the datapath stays, the stream whole.
//!
//! Run by `sudo cargo xtask test` (sets KPE_PRIVILEGED=1, one test thread); skipped otherwise.
//! Everything lives in network namespaces, pin dirs and cgroups the test creates; RAII guards
//! remove them (agent first) even when an assertion fails.

mod common_netns;

use std::{
    collections::BTreeMap,
    net::Ipv4Addr,
    path::Path,
    thread,
    time::{Duration, Instant},
};

use common_netns::BIN;
use proxy_testenv::{
    Agent, ByteStream, CLUSTER_CIDR, EXT_DEVICE, FakeApiServer, MultiNode, NODE_IPS, NODE_NAMES,
    NetNs, PinDir, Proc, UDP_PORT, UdpPinger,
    fake_apiserver::Kind,
    kube_proxy::{self, KubeProxyService},
    require_privileged,
};
use serde_json::{Value, json};

const NODE_A: usize = 0;
const CLI: Ipv4Addr = Ipv4Addr::new(10, 244, 1, 21);
const WEB1: Ipv4Addr = Ipv4Addr::new(10, 244, 1, 11);
const WEB2: Ipv4Addr = Ipv4Addr::new(10, 244, 1, 12);
/// A Service the agent programs (NodePort, both backends).
const WEB: Ipv4Addr = Ipv4Addr::new(10, 96, 7, 10);
const WEB_NODEPORT: u16 = 30_080;
/// A Service created after the agent is gone: only kube-proxy ever knows it.
const NEW: Ipv4Addr = Ipv4Addr::new(10, 96, 7, 20);
const NEW_NODEPORT: u16 = 30_081;
/// The long stream's Service (port 9000 of WEB1).
const STREAM: Ipv4Addr = Ipv4Addr::new(10, 96, 7, 30);
const STREAM_PORT: u16 = 9000;
/// A NodePort Service whose stream an external client reads (port 9001 of WEB2).
const STREAM_EXT: Ipv4Addr = Ipv4Addr::new(10, 96, 7, 40);
const STREAM_EXT_PORT: u16 = 9001;
const STREAM_EXT_NODEPORT: u16 = 30_090;
/// A UDP Service (the backends' echo port, both backends).
const DNS: Ipv4Addr = Ipv4Addr::new(10, 96, 7, 53);
const DNS_PORT: u16 = 53;
const DS_NAMESPACE: &str = "kube-system";
const DS_NAME: &str = "kube-proxy-ebpf";
const OPT_OUT_LABEL: &str = "kube-proxy-ebpf.io/opt-out";

/// kube-proxy's health server as it starts: binds [::]:10256 (Go's dual-stack listener) and
/// serves nothing the test reads. Arg: ready file.
const KUBE_PROXY_HEALTHZ_PY: &str = r#"
import socket, sys, time
s = socket.socket(socket.AF_INET6, socket.SOCK_STREAM)
s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("::", 10256))
s.listen(16)
open(sys.argv[1], "w").write("ready\n")
time.sleep(300)
"#;

/// deploy/daemonset.yaml's DaemonSet, as the API server would serve it.
fn daemonset() -> Value {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/daemonset.yaml");
    let text = std::fs::read_to_string(&path).expect("deploy/daemonset.yaml");
    let docs: Vec<Value> = serde_saphyr::from_multiple(&text).expect("YAML");
    let ds = docs
        .into_iter()
        .find(|d| d["kind"] == "DaemonSet" && d["metadata"]["name"] == DS_NAME)
        .expect("the agent's DaemonSet");
    assert_eq!(ds["metadata"]["namespace"], DS_NAMESPACE);
    ds
}

fn node(labels: Value) -> Value {
    json!({"apiVersion": "v1", "kind": "Node",
           "metadata": {"name": NODE_NAMES[NODE_A], "labels": labels}})
}

fn linux_node() -> Value {
    node(json!({"kubernetes.io/os": "linux", "topology.kubernetes.io/zone": "zone-a"}))
}

fn service(name: &str, ip: Ipv4Addr, port: u16, node_port: Option<u16>) -> Value {
    let mut port_spec =
        json!({"name": "http", "port": port, "protocol": "TCP", "targetPort": port});
    let mut spec = json!({"type": "ClusterIP", "clusterIP": ip.to_string(),
                          "clusterIPs": [ip.to_string()], "ports": []});
    if let Some(np) = node_port {
        port_spec["nodePort"] = json!(np);
        spec["type"] = json!("NodePort");
        spec["externalTrafficPolicy"] = json!("Cluster");
    }
    port_spec["targetPort"] = json!(if port == 80 { 8080 } else { port });
    spec["ports"] = json!([port_spec]);
    json!({"apiVersion": "v1", "kind": "Service",
           "metadata": {"name": name, "namespace": "demo"}, "spec": spec})
}

/// A Service or EndpointSlice of [`service`]/[`slice`] with UDP ports.
fn udp(mut object: Value) -> Value {
    let ports = if object["kind"] == "Service" {
        &mut object["spec"]["ports"]
    } else {
        &mut object["ports"]
    };
    for p in ports.as_array_mut().expect("ports") {
        p["protocol"] = json!("UDP");
    }
    object
}

fn slice(service: &str, port: u16, endpoints: &[Ipv4Addr]) -> Value {
    let eps: Vec<Value> = endpoints
        .iter()
        .map(|ip| {
            json!({"addresses": [ip.to_string()], "nodeName": NODE_NAMES[NODE_A],
                         "conditions": {"ready": true, "serving": true, "terminating": false}})
        })
        .collect();
    json!({"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice", "addressType": "IPv4",
           "metadata": {"name": format!("{service}-1"), "namespace": "demo",
                        "labels": {"kubernetes.io/service-name": service}},
           "endpoints": eps, "ports": [{"name": "http", "port": port, "protocol": "TCP"}]})
}

/// What kube-proxy programs for the Services, with `web`'s endpoints as given.
fn kube_proxy_services(web: &[Ipv4Addr]) -> Vec<KubeProxyService> {
    vec![
        KubeProxyService::tcp("demo", "web", WEB, 80)
            .node_port(WEB_NODEPORT)
            .target(8080, web),
        KubeProxyService::tcp("demo", "new", NEW, 80)
            .node_port(NEW_NODEPORT)
            .target(8080, &[WEB1]),
        KubeProxyService::tcp("demo", "stream", STREAM, STREAM_PORT).target(STREAM_PORT, &[WEB1]),
        KubeProxyService::tcp("demo", "stream-ext", STREAM_EXT, STREAM_EXT_PORT)
            .node_port(STREAM_EXT_NODEPORT)
            .target(STREAM_EXT_PORT, &[WEB2]),
        KubeProxyService {
            protocol: "udp",
            ..KubeProxyService::tcp("demo", "dns", DNS, DNS_PORT).target(UDP_PORT, &[WEB1, WEB2])
        },
    ]
}

/// Field order is drop order: agent, API server, pins, then the namespaces.
struct Env {
    agent: Agent,
    api: FakeApiServer,
    pins: PinDir,
    net: MultiNode,
}

impl Env {
    /// Node A with a client pod and two backends, the fake API server, the agent synced.
    fn start() -> Self {
        Self::start_after(&[], |_| ()).0
    }

    /// [`Env::start`], with `before` run on the node (kube-proxy's rules, flows through them)
    /// before the agent starts with `extra` arguments.
    fn start_after<T>(extra: &[&str], before: impl FnOnce(&MultiNode) -> T) -> (Self, T) {
        proxy_testenv::ensure_bpffs().expect("bpffs at /sys/fs/bpf");
        let mut net = MultiNode::new().expect("the two-node topology");
        net.add_backend(NODE_A, "a-web1", WEB1).expect("a-web1");
        net.add_backend(NODE_A, "a-web2", WEB2).expect("a-web2");
        net.add_backend(NODE_A, "a-cli", CLI).expect("a-cli");
        let topo = net.node(NODE_A);
        let api = FakeApiServer::start_in(Some(&topo.node().path())).expect("fake API server");
        api.apply_all([
            linux_node(),
            daemonset(),
            json!({"apiVersion": "networking.k8s.io/v1", "kind": "ServiceCIDR",
                   "metadata": {"name": "kubernetes"}, "spec": {"cidrs": ["10.96.0.0/16"]}}),
            service("web", WEB, 80, Some(WEB_NODEPORT)),
            slice("web", 8080, &[WEB1, WEB2]),
            service("stream", STREAM, STREAM_PORT, None),
            slice("stream", STREAM_PORT, &[WEB1]),
            service(
                "stream-ext",
                STREAM_EXT,
                STREAM_EXT_PORT,
                Some(STREAM_EXT_NODEPORT),
            ),
            slice("stream-ext", STREAM_EXT_PORT, &[WEB2]),
            udp(service("dns", DNS, DNS_PORT, None)),
            udp(slice("dns", UDP_PORT, &[WEB1, WEB2])),
        ])
        .expect("objects");
        let before = before(&net);
        let topo = net.node(NODE_A);
        let kubeconfig = api
            .write_kubeconfig(&topo.tmp().path().join("kubeconfig"))
            .expect("kubeconfig");
        let pins = PinDir::new(&format!("{}-pins", topo.prefix())).expect("pin dir");
        let daemonset = format!("{DS_NAMESPACE}/{DS_NAME}");
        let mut args = vec![
            "--hostname-override",
            NODE_NAMES[NODE_A],
            "--devices",
            EXT_DEVICE,
            "--cluster-cidr",
            CLUSTER_CIDR,
            "--daemonset",
            &daemonset,
        ];
        args.extend(extra);
        let mut agent = Agent::start_kube(
            Path::new(BIN),
            topo.node(),
            &kubeconfig,
            &args,
            pins.path(),
            topo.tmp().path(),
        )
        .expect("starting the agent");
        let mut want = topo.pod_interfaces();
        want.push(EXT_DEVICE.to_owned());
        agent
            .wait_attached(&want)
            .unwrap_or_else(|e| panic!("{e:#}"));
        // The socket and bind hooks are attached after the interfaces.
        agent
            .wait_log(&["agent: ready"], Duration::from_secs(30))
            .unwrap_or_else(|e| panic!("{e:#}"));
        let env = Self {
            agent,
            api,
            pins,
            net,
        };
        // Served by the agent to begin with.
        env.expect_backends("the agent", WEB, &["a-web1", "a-web2"]);
        env.ext_backends("the agent", WEB_NODEPORT, 6);
        (env, before)
    }

    fn node(&self) -> &NetNs {
        self.net.node(NODE_A).node()
    }

    fn fail(&self, msg: &str) -> ! {
        self.agent.fail(msg)
    }

    fn check(&self, cond: bool, msg: impl FnOnce() -> String) {
        self.agent.check(cond, msg)
    }

    /// `n` requests from the client pod to `vip:80`: the backends that answered, each counted;
    /// any failure fails the test, named with `when`.
    fn pod_backends(&self, when: &str, vip: Ipv4Addr, n: usize) -> BTreeMap<String, usize> {
        let url = format!("http://{vip}/");
        let replies = self
            .net
            .node(NODE_A)
            .curl_many_from("a-cli", &url, n)
            .unwrap_or_else(|e| self.fail(&format!("{when}: curl {url}: {e:#}")));
        let mut counts = BTreeMap::new();
        for (i, r) in replies.into_iter().enumerate() {
            match r {
                Ok(r) => *counts.entry(r.body).or_insert(0) += 1,
                Err(e) => self.fail(&format!("{when}: request {i} to {url} from a pod: {e}")),
            }
        }
        counts
    }

    /// Requests from a pod to `vip` reach both of `want` (and nothing else).
    fn expect_backends(&self, when: &str, vip: Ipv4Addr, want: &[&str]) {
        let counts = self.pod_backends(when, vip, 20);
        let got: Vec<&str> = counts.keys().map(String::as_str).collect();
        self.check(got == want, || {
            format!("{when}: {vip} answered by {counts:?}, want {want:?}")
        });
    }

    /// `n` requests from the external client to node A's `node_port`: the backends that
    /// answered.
    fn ext_backends(&self, when: &str, node_port: u16, n: usize) -> BTreeMap<String, usize> {
        let url = format!("http://{}:{node_port}/", NODE_IPS[NODE_A]);
        let mut counts = BTreeMap::new();
        for i in 0..n {
            match self.net.http_get(&url) {
                Ok(r) if r.code == 200 => *counts.entry(r.body).or_insert(0) += 1,
                Ok(r) => self.fail(&format!("{when}: external request {i} to {url}: {r:?}")),
                Err(e) => self.fail(&format!("{when}: external request {i} to {url}: {e:#}")),
            }
        }
        counts
    }

    /// kube-proxy's rules, with `web`'s endpoints as given, loaded into node A.
    fn kube_proxy_rules(&self, web: &[Ipv4Addr]) {
        let rules = kube_proxy::nft_ruleset(&kube_proxy_services(web), CLUSTER_CIDR);
        kube_proxy::install(self.node(), &rules, self.net.node(NODE_A).tmp().path())
            .unwrap_or_else(|e| self.fail(&format!("{e:#}")));
    }

    /// kube-proxy serves every Service from pods and from outside: the new one, and the old one
    /// on its endpoints only (after `web2` left, not even from a long-lived client's flows).
    fn kube_proxy_serves(&self, when: &str) {
        self.kube_proxy_rules(&[WEB1, WEB2]);
        let new = self.pod_backends(when, NEW, 6);
        self.check(new.keys().eq(["a-web1"]), || {
            format!("{when}: the new Service's ClusterIP answered by {new:?}")
        });
        let new_ext = self.ext_backends(when, NEW_NODEPORT, 4);
        self.check(new_ext.keys().eq(["a-web1"]), || {
            format!("{when}: the new Service's NodePort answered by {new_ext:?}")
        });
        self.expect_backends(when, WEB, &["a-web1", "a-web2"]);
        // kube-proxy drops an endpoint: it gets no more traffic, from pods or from outside.
        self.kube_proxy_rules(&[WEB1]);
        let web = self.pod_backends(when, WEB, 20);
        self.check(web.keys().eq(["a-web1"]), || {
            format!("{when}: after kube-proxy dropped a-web2, the ClusterIP reached {web:?}")
        });
        let web_ext = self.ext_backends(when, WEB_NODEPORT, 8);
        self.check(web_ext.keys().eq(["a-web1"]), || {
            format!("{when}: after kube-proxy dropped a-web2, the NodePort reached {web_ext:?}")
        });
    }

    /// Programs of ours still attached in node A (`bpftool net show` lines naming them) and on
    /// the agent's cgroup.
    fn our_programs(&self) -> Vec<String> {
        let out = self
            .node()
            .output(&["bpftool", "net", "show"], Duration::from_secs(10))
            .expect("bpftool net show");
        let mut found: Vec<String> = String::from_utf8_lossy(&out.stdout)
            .lines()
            .filter(|l| l.contains("tc_ingress") || l.contains("tc_egress"))
            .map(str::to_owned)
            .collect();
        let cgroup = self.agent.cgroup_path().to_string_lossy().into_owned();
        let out = std::process::Command::new("bpftool")
            .args(["cgroup", "show", &cgroup])
            .output()
            .expect("bpftool cgroup show");
        found.extend(
            String::from_utf8_lossy(&out.stdout)
                .lines()
                .filter(|l| l.contains("sock_"))
                .map(str::to_owned),
        );
        found
    }

    /// Stops the agent with SIGTERM (as the kubelet stops a pod) and returns how long it took.
    fn stop_agent(&mut self) -> Duration {
        let started = Instant::now();
        let status = self
            .agent
            .stop()
            .unwrap_or_else(|e| self.fail(&format!("stopping the agent: {e:#}")));
        let took = started.elapsed();
        self.check(status.success(), || {
            format!("the agent exited with {status}")
        });
        took
    }

    /// The stop removed the datapath: no pins, no programs of ours, the log saying so.
    fn expect_clean(&self, took: Duration, what: &str) {
        let log = self.agent.log_tail();
        self.check(log.contains("uninstalled"), || {
            format!("{what}: the agent did not uninstall")
        });
        self.check(!self.pins.path().exists(), || {
            format!("{what}: the pin directory is still there")
        });
        let left = self.our_programs();
        self.check(left.is_empty(), || {
            format!("{what}: programs still attached: {left:?}")
        });
        eprintln!("{what}: node clean {} ms after SIGTERM", took.as_millis());
    }

    fn counter(&self, name: &str) -> u64 {
        self.agent
            .counter(name)
            .unwrap_or_else(|e| self.fail(&format!("{e:#}")))
    }

    /// A stream from the client pod through the stream Service to a-web1.
    fn stream(&self) -> ByteStream {
        let topo = self.net.node(NODE_A);
        ByteStream::start(
            topo.tmp().path(),
            "cip",
            topo.pod("a-web1").expect("a-web1").ns(),
            STREAM_PORT,
            topo.pod("a-cli").expect("a-cli").ns(),
            STREAM.into(),
            STREAM_PORT,
        )
        .unwrap_or_else(|e| self.fail(&format!("{e:#}")))
    }

    /// kube-proxy starting: a process of the node binds its health port.
    fn kube_proxy_healthz(&self) -> Proc {
        let tmp = self.net.node(NODE_A).tmp().path().to_path_buf();
        let ready = tmp.join("kube-proxy-healthz.ready");
        let cmd = self.agent.host_command(
            self.node(),
            &[
                "python3",
                "-c",
                KUBE_PROXY_HEALTHZ_PY,
                &ready.to_string_lossy(),
            ],
        );
        let proc = Proc::spawn(cmd, Some(&tmp.join("kube-proxy-healthz.log")))
            .unwrap_or_else(|e| self.fail(&format!("{e:#}")));
        let deadline = Instant::now() + Duration::from_secs(10);
        while !ready.exists() {
            self.check(Instant::now() < deadline, || {
                "kube-proxy's health port was not bound within 10 s".into()
            });
            thread::sleep(Duration::from_millis(20));
        }
        proc
    }
}

impl Drop for Env {
    fn drop(&mut self) {
        let _ = kube_proxy::remove(self.node());
    }
}

#[test]
fn deleting_the_daemonset_leaves_a_node_kube_proxy_serves_alone() {
    require_privileged!();
    let mut env = Env::start();
    // `kubectl delete ds`: the API server drops the DaemonSet, then its pods are stopped.
    assert!(env.api.delete(Kind::DaemonSet, DS_NAMESPACE, DS_NAME));
    let took = env.stop_agent();
    env.expect_clean(took, "DaemonSet deleted");
    env.kube_proxy_serves("kube-proxy after the uninstall");
}

#[test]
fn a_node_opting_out_by_label_is_cleaned_like_an_uninstall() {
    require_privileged!();
    let mut env = Env::start();
    let mut labels = linux_node()["metadata"]["labels"].clone();
    labels[OPT_OUT_LABEL] = json!("true");
    env.api.apply(node(labels)).expect("label the node");
    // The Node's new label reaches the agent's store through its watch.
    thread::sleep(Duration::from_millis(500));
    let took = env.stop_agent();
    env.expect_clean(took, "node opted out");
    env.kube_proxy_serves("kube-proxy after the opt-out");
}

#[test]
fn kube_proxy_starting_where_the_agent_died_takes_new_flows_and_old_ones_go_on() {
    require_privileged!();
    let mut env = Env::start();
    let stream = env.stream();
    // Gone without its clean-up: killed (its DaemonSet still there), never coming back.
    env.agent.kill().expect("SIGKILL");
    thread::sleep(Duration::from_millis(1_500));
    // Frozen, but serving: the datapath survives its agent.
    env.expect_backends("no agent, no kube-proxy", WEB, &["a-web1", "a-web2"]);
    let before = env.counter("handed_over");
    let healthz = env.kube_proxy_healthz();
    env.check(env.counter("hand_over_bind") == 1, || {
        "kube-proxy's bind of its health port did not hand the datapath over".into()
    });
    env.kube_proxy_serves("kube-proxy after the agent died");
    let handed = env.counter("handed_over") - before;
    env.check(handed > 0, || {
        "no packet of a new flow was handed to the stack".into()
    });
    let summary = stream
        .finish(Duration::from_secs(20))
        .unwrap_or_else(|e| env.fail(&format!("{e:#}")));
    env.check(summary.whole(), || {
        format!("the stream translated before the hand-over broke: {summary:?}")
    });
    eprintln!(
        "hand-over: {handed} packets of new flows to the stack; the stream: {} bytes whole, longest gap {} ms",
        summary.bytes, summary.max_gap_ms
    );
    drop(healthz);
    // A new agent takes the node back (an install over a running kube-proxy).
    kube_proxy::remove(env.node()).expect("kube-proxy's rules gone");
    env.agent.restart().expect("restart");
    env.agent
        .wait_synced(1, Duration::from_secs(60))
        .unwrap_or_else(|e| panic!("{e:#}"));
    env.check(
        env.agent
            .log_tail()
            .contains("the node's Service proxy again"),
        || "the new agent did not say it took the node back".into(),
    );
    env.expect_backends("the agent back", WEB, &["a-web1", "a-web2"]);
}

#[test]
fn a_restart_keeps_the_datapath_and_the_stream() {
    require_privileged!();
    let mut env = Env::start();
    let stream = env.stream();
    env.stop_agent();
    env.check(env.agent.log_tail().contains("stay pinned"), || {
        "a SIGTERM with the DaemonSet in place did not keep the datapath".into()
    });
    env.check(
        env.pins.path().exists() && !env.our_programs().is_empty(),
        || "the datapath is gone after a restart's SIGTERM".into(),
    );
    env.expect_backends("between two agents", WEB, &["a-web1", "a-web2"]);
    env.agent.restart().expect("restart");
    env.agent
        .wait_synced(1, Duration::from_secs(60))
        .unwrap_or_else(|e| panic!("{e:#}"));
    let summary = stream
        .finish(Duration::from_secs(20))
        .unwrap_or_else(|e| env.fail(&format!("{e:#}")));
    env.check(summary.whole(), || {
        format!("the stream broke across the restart: {summary:?}")
    });
    eprintln!(
        "restart: the stream {} bytes whole, longest gap {} ms",
        summary.bytes, summary.max_gap_ms
    );
}

/// iptables-mode kube-proxy's chains (for an address the test never sends to) beside the
/// kubelet's `KUBE-FIREWALL`, for `iptables-nft-restore --noflush`.
const IPTABLES_LEFTOVERS: &str = "*nat
:KUBE-SERVICES - [0:0]
:KUBE-SVC-TAKEOVERTEST - [0:0]
:KUBE-SEP-TAKEOVERTEST - [0:0]
:KUBE-MARK-MASQ - [0:0]
-A PREROUTING -m comment --comment \"kubernetes service portals\" -j KUBE-SERVICES
-A OUTPUT -m comment --comment \"kubernetes service portals\" -j KUBE-SERVICES
-A KUBE-SERVICES -d 10.96.99.99/32 -p tcp --dport 80 -j KUBE-SVC-TAKEOVERTEST
-A KUBE-SVC-TAKEOVERTEST -j KUBE-SEP-TAKEOVERTEST
-A KUBE-SEP-TAKEOVERTEST -p tcp -j DNAT --to-destination 10.244.1.11:8080
-A KUBE-MARK-MASQ -j MARK --set-xmark 0x4000/0x4000
COMMIT
*filter
:KUBE-FIREWALL - [0:0]
:KUBE-FORWARD - [0:0]
-A INPUT -j KUBE-FIREWALL
-A FORWARD -m comment --comment \"kubernetes forwarding rules\" -j KUBE-FORWARD
-A KUBE-FIREWALL ! -s 127.0.0.0/8 -d 127.0.0.0/8 -j DROP
COMMIT
";

/// The datagrams the takeover test's pinger sends (one per 200 ms: 16 s).
const PINGS: u32 = 80;

#[test]
fn taking_over_from_kube_proxy_keeps_every_live_connection() {
    require_privileged!();
    take_over(None);
}

/// As above, with kube-proxy's masquerade ports in the datapath's dedicated SNAT range, so that
/// the NodePort stream is moved to the datapath too (upstream's rule picks any port on the
/// address toward the backend; the datapath recognises those only on the node's SNAT address).
#[test]
fn taking_over_moves_a_masqueraded_connection_to_the_datapath() {
    require_privileged!();
    take_over(Some(
        "meta l4proto { tcp, udp } masquerade to :61000-65535 fully-random",
    ));
}

/// kube-proxy serves the node; a stream from a pod through a ClusterIP, one from outside through
/// a NodePort (masqueraded: `masquerade` replaces upstream's rule if given), and a UDP exchange
/// through a ClusterIP run through its rules when the agent starts; all go on, whole, and
/// kube-proxy's rules are gone.
fn take_over(masquerade: Option<&str>) {
    let (env, (cip, np, pinger)) =
        Env::start_after(&["--remove-kube-proxy-rules"], |net: &MultiNode| {
            let topo = net.node(NODE_A);
            let tmp = topo.tmp().path();
            let mut rules =
                kube_proxy::nft_ruleset(&kube_proxy_services(&[WEB1, WEB2]), CLUSTER_CIDR);
            if let Some(m) = masquerade {
                rules = rules.replace("masquerade fully-random", m);
            }
            kube_proxy::install(topo.node(), &rules, tmp).expect("kube-proxy's rules");
            // What an iptables-mode kube-proxy would have left too (for a Service address no
            // flow here uses), and the kubelet's own chain, which must stay.
            let file = tmp.join("iptables-leftovers");
            std::fs::write(&file, IPTABLES_LEFTOVERS).expect("writing the rules");
            let restore = topo
                .node()
                .output(
                    &["iptables-nft-restore", "--noflush", &file.to_string_lossy()],
                    Duration::from_secs(10),
                )
                .expect("iptables-nft-restore");
            assert!(
                restore.status.success(),
                "iptables-nft-restore: {restore:?}"
            );
            let pod = |name: &str| topo.pod(name).expect(name).ns();
            let cip = ByteStream::start(
                tmp,
                "takeover-cip",
                pod("a-web1"),
                STREAM_PORT,
                pod("a-cli"),
                STREAM.into(),
                STREAM_PORT,
            )
            .expect("the ClusterIP stream through kube-proxy");
            let np = ByteStream::start(
                tmp,
                "takeover-np",
                pod("a-web2"),
                STREAM_EXT_PORT,
                net.client(),
                NODE_IPS[NODE_A].into(),
                STREAM_EXT_NODEPORT,
            )
            .expect("the NodePort stream through kube-proxy");
            let pinger = UdpPinger::start(
                pod("a-cli"),
                tmp,
                "takeover-dns",
                DNS.into(),
                DNS_PORT,
                40_053,
                PINGS,
            )
            .expect("the UDP pinger");
            let deadline = Instant::now() + Duration::from_secs(5);
            while pinger.replies().len() < 3 {
                assert!(
                    Instant::now() < deadline,
                    "kube-proxy's rules did not answer the UDP pinger"
                );
                thread::sleep(Duration::from_millis(50));
            }
            (cip, np, pinger)
        });
    let log = env.agent.log_tail();
    let took = log
        .lines()
        .find(|l| l.contains("took over netfilter's Service flows"))
        .unwrap_or_else(|| env.fail("the agent did not report taking over netfilter's flows"))
        .to_owned();
    let field = |name: &str| -> u64 {
        took.split_whitespace()
            .find_map(|w| w.strip_prefix(&format!("{name}=")))
            .and_then(|v| v.parse().ok())
            .unwrap_or_else(|| env.fail(&format!("no {name}= in {took:?}")))
    };
    let (imported, moved, left) = (
        field("imported"),
        field("moved"),
        field("left_to_netfilter"),
    );
    // The two streams and the UDP flow. The masqueraded NodePort stream moves when the
    // datapath would recognise its replies: a port of the dedicated range, or any unprivileged
    // one on the node's SNAT address (netfilter masquerades to an address it picks toward the
    // local backend, here not the SNAT address, so upstream's rule leaves it netfilter's).
    let all_moved = masquerade.is_some();
    env.check(
        imported == 3 && moved + left == 3 && moved >= 2 && (moved == 3 || !all_moved),
        || format!("taken over: {took}"),
    );
    // kube-proxy's rules go once the datapath is attached (on a thread of their own).
    let deadline = Instant::now() + Duration::from_secs(10);
    while !env.agent.log_tail().contains("removed kube-proxy's rules") {
        env.check(Instant::now() < deadline, || {
            "the agent did not remove kube-proxy's rules".into()
        });
        thread::sleep(Duration::from_millis(50));
    }
    let listed = |args: &[&str]| {
        String::from_utf8_lossy(
            &env.node()
                .output(args, Duration::from_secs(10))
                .expect("listing netfilter's rules")
                .stdout,
        )
        .into_owned()
    };
    // While netfilter still translates a connection its table stays, emptied: netfilter applies
    // NAT only while a NAT chain is registered.
    let table = listed(&["nft", "list", "table", "ip", "kube-proxy"]);
    env.check(
        if left == 0 {
            table.is_empty()
        } else {
            table.contains("type nat hook") && ["dnat to", "jump ", "vmap", "fully-random"]
                    .iter()
                    .all(|rule| !table.contains(rule))
        },
        || format!("kube-proxy's nftables table after the takeover ({left} left to netfilter):\n{table}"),
    );
    let saved = listed(&["iptables-nft-save"]);
    env.check(
        !saved.contains("KUBE-SERVICES")
            && !saved.contains("KUBE-SVC-")
            && saved.contains(":KUBE-FIREWALL")
            && saved.contains("-A INPUT -j KUBE-FIREWALL"),
        || format!("iptables after the takeover:\n{saved}"),
    );
    // New flows are the agent's, with kube-proxy's rules gone.
    env.expect_backends("after the takeover", WEB, &["a-web1", "a-web2"]);
    thread::sleep(Duration::from_secs(2));
    let mut gaps = Vec::new();
    for (what, stream) in [("ClusterIP", cip), ("NodePort", np)] {
        let summary = stream
            .finish(Duration::from_secs(20))
            .unwrap_or_else(|e| env.fail(&format!("{e:#}")));
        env.check(summary.whole(), || {
            format!("the {what} stream broke across the takeover: {summary:?}")
        });
        gaps.push(format!(
            "{what} stream {} bytes whole, longest gap {} ms",
            summary.bytes, summary.max_gap_ms
        ));
    }
    let replies = pinger.finish(Duration::from_secs(30));
    let backends: BTreeMap<&str, usize> = replies.iter().fold(BTreeMap::new(), |mut m, r| {
        *m.entry(r.body.split(':').next().unwrap_or("")).or_default() += 1;
        m
    });
    env.check(
        replies.len() == PINGS as usize && backends.len() == 1,
        || {
            format!(
                "the UDP flow: {} of {PINGS} answered, by {backends:?}",
                replies.len()
            )
        },
    );
    eprintln!(
        "takeover: {took}; {}; UDP {}/{PINGS} answered by one backend; netfilter_flow {}",
        gaps.join("; "),
        replies.len(),
        env.counter("netfilter_flow")
    );
}
