//! Privileged north-south tests: an external client on a "wire" reaches Services through two
//! nodes, each running the agent standalone with `--devices ext0` (see `proxy_testenv::MultiNode`):
//! NodePort, externalIPs and LoadBalancer IPs; externalTrafficPolicy Cluster (SNAT to the node for
//! a backend on the other node) and Local (client IP preserved, no answer on a node without local
//! endpoints, while pods, inside the cluster CIDR, reach the Service's other endpoints);
//! health-check node ports.
//!
//! Run by `sudo cargo xtask test` (sets KPE_PRIVILEGED=1, one test thread); skipped otherwise.
//! Everything lives in network namespaces the test creates; RAII guards remove them.

mod common_netns;

use std::{net::Ipv4Addr, time::Duration};

use common_netns::Cluster;
use proxy_common::{SNAT_NODE_PORT_MIN, SNAT_PORT_MIN};
use proxy_testenv::{
    CLUSTER_CIDR, ConnectOutcome, EXT_CLIENT_IP, EXT_DEVICE, L3_TUNNEL_DEVICE, L3_TUNNEL_IPS,
    MultiNode, NODE_IPS, NODE_NAMES, VXLAN_DEVICE, VXLAN_IPS, http_get_with_peer,
    require_privileged, udp_request_from,
};

/// Connected UDP socket: send one datagram, print "refused" if an ICMP port unreachable comes
/// back (ECONNREFUSED), "timeout" or "reply" otherwise.
const UDP_REFUSED_PY: &str = r#"
import socket, sys
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.settimeout(2)
s.connect((sys.argv[1], int(sys.argv[2])))
s.send(b"hello")
try:
    s.recv(100)
    print("reply")
except ConnectionRefusedError:
    print("refused")
except socket.timeout:
    print("timeout")
"#;
const NODE_A: usize = 0;
const NODE_B: usize = 1;
/// Backends: on node B only (eTP=Cluster via node A must SNAT), and one on each node.
const B_WEB: Ipv4Addr = Ipv4Addr::new(10, 244, 2, 11);
const B_LOCAL: Ipv4Addr = Ipv4Addr::new(10, 244, 2, 12);
/// A pod on node A, endpoint of no Service: an in-cluster client there.
const A_CLIENT: Ipv4Addr = Ipv4Addr::new(10, 244, 1, 21);
const EXTERNAL_IP: Ipv4Addr = Ipv4Addr::new(192, 168, 60, 10);
const LB_IP: Ipv4Addr = Ipv4Addr::new(192, 168, 70, 10);
const HC_PORT: u16 = 32_000;

/// Both nodes' agents (the shared two-node harness) with this suite's pods.
type Env = Cluster;

impl Env {
    /// Both nodes with backends on node B, `yaml` written, both agents synced and attached.
    fn start(yaml: &str) -> Self {
        Self::start_in(
            MultiNode::new().expect("creating the two-node topology"),
            yaml,
        )
    }

    /// As [`Env::start`] on `net`.
    fn start_in(mut net: MultiNode, yaml: &str) -> Self {
        net.add_backend(NODE_B, "b-web", B_WEB)
            .expect("backend b-web");
        net.add_backend(NODE_B, "b-loc", B_LOCAL)
            .expect("backend b-loc");
        net.add_backend(NODE_A, "a-cli", A_CLIENT)
            .expect("pod a-cli");
        Self::start_on(net, CLUSTER_CIDR, |m| {
            std::fs::write(m.path().join("services.yaml"), yaml).expect("writing manifests");
        })
    }

    fn get(&self, url: &str) -> proxy_testenv::HttpReply {
        self.net
            .http_get(url)
            .unwrap_or_else(|e| self.fail(&format!("GET {url}: {e:#}")))
    }

    /// One HTTP GET from a pod of node `i`: (body, the source address the backend saw).
    fn pod_get(&self, i: usize, pod: &str, url: &str) -> proxy_testenv::HttpReply {
        let pod = self
            .net
            .node(i)
            .pod(pod)
            .unwrap_or_else(|e| self.fail(&format!("{e:#}")));
        let out = pod
            .ns()
            .output(
                &[
                    "curl",
                    "-s",
                    "--max-time",
                    "3",
                    "-w",
                    "\x1e%{http_code}\x1e%header{x-client-addr}",
                    url,
                ],
                Duration::from_secs(10),
            )
            .unwrap_or_else(|e| self.fail(&format!("curl {url}: {e:#}")));
        let stdout = String::from_utf8_lossy(&out.stdout);
        let mut f = stdout.split('\x1e');
        let body = f.next().unwrap_or_default().trim().to_owned();
        let code = f.next().unwrap_or_default().parse().unwrap_or(0);
        let client_addr = f.next().unwrap_or_default().trim().to_owned();
        proxy_testenv::HttpReply {
            code,
            body,
            client_addr,
            weight: String::new(),
        }
    }

    /// A datapath counter of node `i` (`kube-proxy-ebpf dump stats`).
    fn counter(&self, i: usize, name: &str) -> u64 {
        self.agents[i]
            .counter(name)
            .unwrap_or_else(|e| self.fail(&format!("{e:#}")))
    }
}

/// A Service manifest plus its EndpointSlice with endpoints `(ip, node)`.
fn service(name: &str, spec: &str, status: &str, endpoints: &[(Ipv4Addr, &str)]) -> String {
    let mut y = format!(
        "apiVersion: v1\nkind: Service\nmetadata:\n  name: {name}\n  namespace: demo\nspec:\n{spec}\n"
    );
    if !status.is_empty() {
        y.push_str(&format!("status:\n{status}\n"));
    }
    y.push_str(&format!(
        "---\napiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata:\n  name: {name}-1\n  \
         namespace: demo\n  labels:\n    kubernetes.io/service-name: {name}\naddressType: IPv4\n\
         ports:\n  - name: http\n    port: 8080\n    protocol: TCP\n  - name: dns\n    port: 5353\n    \
         protocol: UDP\n  - name: closed\n    port: 5999\n    protocol: UDP\nendpoints:\n"
    ));
    for (ip, node) in endpoints {
        y.push_str(&format!(
            "  - addresses: [\"{ip}\"]\n    nodeName: {node}\n    conditions: {{ready: true, serving: true, terminating: false}}\n"
        ));
    }
    y.push_str("---\n");
    y
}

fn cluster_policy_yaml() -> String {
    service(
        "np-cluster",
        "  type: NodePort\n  clusterIP: 10.96.1.10\n  externalIPs: [\"192.168.60.10\"]\n  ports:\n  \
         - {name: http, port: 80, targetPort: 8080, nodePort: 30080, protocol: TCP}\n  \
         - {name: dns, port: 53, targetPort: 5353, nodePort: 30053, protocol: UDP}\n  \
         - {name: closed, port: 54, targetPort: 5999, nodePort: 30054, protocol: UDP}",
        "",
        &[(B_WEB, NODE_NAMES[NODE_B])],
    )
}

/// A ClusterIP whose only endpoint is the pod `b-web` itself (hairpin).
fn hairpin_yaml() -> String {
    service(
        "hairpin",
        "  type: ClusterIP\n  clusterIP: 10.96.1.30\n  ports:\n  \
         - {name: http, port: 80, targetPort: 8080, protocol: TCP}",
        "",
        &[(B_WEB, NODE_NAMES[NODE_B])],
    )
}

fn local_policy_yaml() -> String {
    service(
        "lb-local",
        "  type: LoadBalancer\n  clusterIP: 10.96.1.20\n  externalTrafficPolicy: Local\n  \
         healthCheckNodePort: 32000\n  loadBalancerSourceRanges: [\"192.168.50.96/29\"]\n  ports:\n  \
         - {name: http, port: 80, targetPort: 8080, nodePort: 30081, protocol: TCP}",
        "  loadBalancer:\n    ingress:\n    - ip: 192.168.70.10",
        &[(B_LOCAL, NODE_NAMES[NODE_B])],
    )
}

/// A LoadBalancer Service whose source ranges exclude the external client.
fn denied_yaml() -> String {
    service(
        "lb-denied",
        "  type: LoadBalancer\n  clusterIP: 10.96.1.21\n  loadBalancerSourceRanges: [\"10.0.0.0/8\"]\n  \
         ports:\n  - {name: http, port: 80, targetPort: 8080, nodePort: 30082, protocol: TCP}",
        "  loadBalancer:\n    ingress:\n    - ip: 192.168.70.11",
        &[(B_LOCAL, NODE_NAMES[NODE_B])],
    )
}

/// The port the backend saw a SNATed flow come from, checked to be `via`'s and at least `min`:
/// `SNAT_NODE_PORT_MIN` on the node's address (the client's own port where free), the dedicated
/// `SNAT_PORT_MIN` on a tunnel device's.
fn snat_port(env: &Env, addr: &str, via: Ipv4Addr, min: u16) -> u16 {
    let (ip, port) = addr
        .split_once(':')
        .unwrap_or_else(|| env.fail(&format!("backend saw {addr:?}")));
    if ip != via.to_string() {
        env.fail(&format!(
            "backend saw the client as {addr}, expected node {via} (SNAT)"
        ));
    }
    let port: u16 = port.parse().unwrap_or(0);
    if port < min {
        env.fail(&format!("SNAT port {port} below {min}"));
    }
    port
}

/// Through node A's tunnel device to the backend on node B, as the overlay tests check it:
/// 5 HTTP requests from the external client to node A's NodePort (answered, SNATed to
/// `tunnel_a`), 3 UDP NodePort requests (answered from the NodePort), a UDP request to a closed
/// backend port (the ICMP error comes back: refused), a pod of node B to the NodePort on
/// `tunnel_a` (in through the tunnel's ingress, SNATed to it), and a pod of node A to the
/// ClusterIP (unSNATed). `what` names the round and device in failures.
fn traffic_through_node_a_tunnel(env: &Env, what: &str, tunnel_a: Ipv4Addr) {
    let a = NODE_IPS[NODE_A];
    let mut answered = Vec::new();
    let mut failures = Vec::new();
    for _ in 0..5 {
        match env.net.http_get(&format!("http://{a}:30080/")) {
            Ok(r) if r.code == 200 && r.body == "b-web" => answered.push(r),
            Ok(r) => failures.push(format!("{r:?}")),
            Err(e) => failures.push(format!("{e:#}")),
        }
    }
    eprintln!(
        "{what}: NodePort via node A: {} of 5 answered",
        answered.len()
    );
    if answered.len() != 5 {
        env.fail(&format!(
            "{what}: NodePort of node A: {} of 5 requests answered; failures: {failures:?}",
            answered.len()
        ));
    }
    for r in &answered {
        snat_port(env, &r.client_addr, tunnel_a, SNAT_PORT_MIN);
    }
    for i in 0..3 {
        let payload = format!("ping-{i}");
        let reply = env
            .net
            .udp_request(a, 30053, &payload)
            .unwrap_or_else(|e| env.fail(&format!("{what}: UDP NodePort via node A: {e:#}")));
        if reply.from.ip() != &a
            || reply.from.port() != 30053
            || reply.body != format!("b-web:{payload}")
        {
            env.fail(&format!("{what}: UDP NodePort via node A: {reply:?}"));
        }
    }
    let refused = env
        .net
        .client()
        .output(
            &["python3", "-c", UDP_REFUSED_PY, &a.to_string(), "30054"],
            Duration::from_secs(10),
        )
        .unwrap_or_else(|e| env.fail(&format!("UDP refused helper: {e:#}")));
    let said = String::from_utf8_lossy(&refused.stdout).trim().to_owned();
    if said != "refused" {
        env.fail(&format!(
            "{what}: UDP to a closed backend port via node A: {said:?}, expected refused"
        ));
    }
    let r = env.pod_get(NODE_B, "b-loc", &format!("http://{tunnel_a}:30080/"));
    if r.body != "b-web" {
        env.fail(&format!(
            "{what}: NodePort on node A's tunnel address from pod b-loc: {r:?}"
        ));
    }
    snat_port(env, &r.client_addr, tunnel_a, SNAT_PORT_MIN);
    let r = env.pod_get(NODE_A, "a-cli", "http://10.96.1.10/");
    if r.body != "b-web" || !r.client_addr.starts_with(&format!("{A_CLIENT}:")) {
        env.fail(&format!("{what}: ClusterIP from pod a-cli: {r:?}"));
    }
}

#[test]
fn external_traffic_policy_cluster_snats_external_clients_to_the_node() {
    require_privileged!();
    let env = Env::start(&(cluster_policy_yaml() + &hairpin_yaml()));
    let [a, b] = NODE_IPS;

    // NodePort on node A, backend on node B: SNAT to node A, replies back through A.
    for _ in 0..3 {
        let r = env.get(&format!("http://{a}:30080/"));
        if r.code != 200 || r.body != "b-web" {
            env.fail(&format!("NodePort via node A: {r:?}"));
        }
        snat_port(&env, &r.client_addr, a, SNAT_NODE_PORT_MIN);
    }

    // The same NodePort on node B: the backend is local there, and the client is still
    // masqueraded to node B (kube-proxy masquerades all external eTP=Cluster traffic).
    let r = env.get(&format!("http://{b}:30080/"));
    if r.code != 200 || r.body != "b-web" {
        env.fail(&format!("NodePort via node B (local backend): {r:?}"));
    }
    snat_port(&env, &r.client_addr, b, SNAT_NODE_PORT_MIN);

    // externalIPs, routed to node A by the client's router: same SNAT path.
    env.net
        .route_via_node("192.168.60.0/24", NODE_A)
        .expect("route to the external IP");
    let r = env.get(&format!("http://{EXTERNAL_IP}/"));
    if r.body != "b-web" {
        env.fail(&format!("externalIP via node A: {r:?}"));
    }
    snat_port(&env, &r.client_addr, a, SNAT_NODE_PORT_MIN);

    // UDP NodePort on node A: the reply comes from the NodePort.
    for i in 0..3 {
        let payload = format!("ping-{i}");
        let reply = env
            .net
            .udp_request(a, 30053, &payload)
            .unwrap_or_else(|e| env.fail(&format!("UDP NodePort via node A: {e:#}")));
        if reply.from.ip() != &a || reply.from.port() != 30053 {
            env.fail(&format!(
                "UDP reply from {}, expected {a}:30053",
                reply.from
            ));
        }
        if reply.body != format!("b-web:{payload}") {
            env.fail(&format!("UDP reply body {:?}", reply.body));
        }
    }
    // NodePort from a pod (inside --cluster-cidr): on its own node (local backend, no SNAT: the
    // pod keeps its address) and on the other node (remote backend: SNAT to node A, the reply
    // crosses both nodes back to the pod).
    let from_pod = |url: &str| env.pod_get(NODE_B, "b-loc", url);
    let r = from_pod(&format!("http://{b}:30080/"));
    if r.body != "b-web" || !r.client_addr.starts_with("10.244.2.12:") {
        env.fail(&format!("NodePort of its own node from pod b-loc: {r:?}"));
    }
    let r = from_pod(&format!("http://{a}:30080/"));
    if r.body != "b-web" {
        env.fail(&format!("NodePort of node A from pod b-loc: {r:?}"));
    }
    snat_port(&env, &r.client_addr, a, SNAT_NODE_PORT_MIN);

    // Hairpin: b-web reaches a Service whose only endpoint is itself.
    let r = env.pod_get(NODE_B, "b-web", "http://10.96.1.30/");
    if r.body != "b-web" || !r.client_addr.starts_with("169.254.0.1:") {
        env.fail(&format!(
            "hairpin: {r:?}, expected b-web seeing itself as 169.254.0.1"
        ));
    }

    // UDP to a port nobody listens on at the backend (on node B): its ICMP port unreachable is
    // translated back through node A's SNAT and NodePort, so the client's socket sees "refused".
    let refused = env
        .net
        .client()
        .output(
            &["python3", "-c", UDP_REFUSED_PY, &a.to_string(), "30054"],
            Duration::from_secs(10),
        )
        .unwrap_or_else(|e| env.fail(&format!("UDP refused helper: {e:#}")));
    let said = String::from_utf8_lossy(&refused.stdout).trim().to_owned();
    if said != "refused" {
        env.fail(&format!(
            "UDP to a closed backend port via node A: {said:?}, expected the ICMP error to reach the client (stderr {})",
            String::from_utf8_lossy(&refused.stderr)
        ));
    }
    if env.counter(NODE_A, "icmp_error_translated") < 2 {
        env.fail("node A did not count the ICMP error translations (ingress + egress)");
    }

    // A new address on node A: the agent sees the netlink event and serves NodePorts on it.
    let added = Ipv4Addr::new(192, 168, 50, 20);
    env.net
        .node(NODE_A)
        .node()
        .exec(&[
            "ip",
            "addr",
            "add",
            &format!("{added}/24"),
            "dev",
            EXT_DEVICE,
        ])
        .unwrap_or_else(|e| env.fail(&format!("adding {added}: {e:#}")));
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    loop {
        match env.net.http_get(&format!("http://{added}:30080/")) {
            Ok(r) if r.body == "b-web" => break,
            other if std::time::Instant::now() >= deadline => env.fail(&format!(
                "NodePort on the new address {added} not served within 5 s: {other:?}"
            )),
            _ => std::thread::sleep(Duration::from_millis(100)),
        }
    }

    // `dump snat` shows the flows' node ports.
    let pin_dir = env.agents[NODE_A].pin_dir().to_string_lossy().into_owned();
    let dump = env.agents[NODE_A]
        .cli(&["dump", "snat", "--pin-dir", &pin_dir])
        .unwrap_or_else(|e| env.fail(&format!("dump snat: {e:#}")));
    let table = String::from_utf8_lossy(&dump.stdout);
    if !table.contains(&format!("src → {a}:")) {
        env.fail(&format!("dump snat lists no SNATed flow:\n{table}"));
    }

    let snat = env.counter(NODE_A, "snat_new");
    if snat < 5 {
        env.fail(&format!(
            "node A counted {snat} SNATed flows, expected >= 5"
        ));
    }
}
/// Pod traffic between the nodes crosses a VXLAN device (flannel-style `vxlan0`, see
/// `MultiNode::with_vxlan`) that `--devices` does not name: the agent attaches to it because it is
/// a tunnel, and a NodePort flow forwarded from node A to the backend on node B is SNATed where
/// it leaves, to `vxlan0`'s address (MASQUERADE's choice), so the backend's replies come back
/// through the tunnel (strict rp_filter on every device) and are translated back to the client.
#[test]
fn external_traffic_policy_cluster_snats_flows_leaving_through_a_vxlan_overlay() {
    require_privileged!();
    let env = Env::start_in(
        MultiNode::with_vxlan().expect("creating the two-node topology with a vxlan overlay"),
        &cluster_policy_yaml(),
    );
    let mut agent_a_status = None;
    for i in [NODE_A, NODE_B] {
        let status = env.agents[i].status().ok().flatten();
        if !status
            .as_ref()
            .is_some_and(|s| s.interfaces.iter().any(|n| n == VXLAN_DEVICE))
        {
            eprintln!(
                "node {i}: {VXLAN_DEVICE} not attached (interfaces {:?})",
                status.as_ref().map(|s| &s.interfaces)
            );
        }
        if i == NODE_A {
            agent_a_status = status;
        }
    }

    // External client → NodePort of node A (no endpoints there) → backend on node B; UDP and the
    // backend's ICMP error the same way. A pod of node B to the NodePort on node A's vxlan0
    // address (a NodePort address: all of them answer by default): in through node A's vxlan0
    // ingress, forwarded back to node B over the tunnel; the reply, un-SNATed on vxlan0 ingress,
    // leaves through vxlan0 again, where egress reverse-translates it to the NodePort. (Node A's
    // ext0 address is not used here: the request would arrive on ext0 from a pod address routed
    // over vxlan0, which strict rp_filter drops before any program matters; flannel masquerades
    // such pod traffic on the client node.) A pod of node A reaches the ClusterIP's backend on
    // node B over the tunnel, unSNATed.
    traffic_through_node_a_tunnel(&env, "over vxlan0", VXLAN_IPS[NODE_A]);
    let interfaces = agent_a_status.map(|s| s.interfaces).unwrap_or_default();
    if !interfaces.iter().any(|n| n == VXLAN_DEVICE) {
        env.fail(&format!(
            "node A's agent is not attached to {VXLAN_DEVICE}: {interfaces:?}"
        ));
    }
    // Every forwarded flow moved its node port to vxlan0's address once (5+1 TCP, 3+1 UDP).
    let moved = env.counter(NODE_A, "snat_device_source");
    if moved < 10 {
        env.fail(&format!(
            "node A moved {moved} flows to {VXLAN_DEVICE}'s address, expected >= 10"
        ));
    }
}

/// External client → NodePort of node A (no endpoints there) → backend on node B through an L3
/// tunnel device (`tun0`: bare IPv4 packets, as Calico's IPIP `tunl0` or WireGuard), which the
/// agent attaches by default with the `_l3` programs: SNATed to `tun0`'s address on the way out,
/// the replies un-SNATed as they come back through it. TCP, UDP, the backend's ICMP error, a pod
/// of node B to the NodePort on node A's tunnel address (a new flow on the L3 ingress), and the
/// same again after node A's agent restarted (its pinned `tun0` links adopted with the L3
/// programs).
#[test]
fn external_traffic_policy_cluster_snats_flows_leaving_through_an_l3_tunnel() {
    require_privileged!();
    let mut env = Env::start_in(
        MultiNode::with_l3_tunnel().expect("creating the two-node topology with an L3 tunnel"),
        &cluster_policy_yaml(),
    );
    for i in [NODE_A, NODE_B] {
        if let Err(e) = env.agents[i].wait_attached(&[L3_TUNNEL_DEVICE.to_owned()]) {
            env.fail(&format!("node {i}: {L3_TUNNEL_DEVICE} not attached: {e:#}"));
        }
    }
    let tunnel_a = L3_TUNNEL_IPS[NODE_A];
    for round in ["first agent", "restarted agent"] {
        traffic_through_node_a_tunnel(&env, &format!("{round}, over tun0"), tunnel_a);
        let moved = env.counter(NODE_A, "snat_device_source");
        eprintln!("{round}: node A moved {moved} flows to {L3_TUNNEL_DEVICE}'s address");
        if round == "first agent" {
            // Every forwarded flow moved its node port to tun0's address once (5+1 TCP, 3+1 UDP).
            if moved < 10 {
                env.fail(&format!(
                    "node A moved {moved} flows to {L3_TUNNEL_DEVICE}'s address, expected >= 10"
                ));
            }
            env.agents[NODE_A]
                .restart()
                .unwrap_or_else(|e| env.fail(&format!("restarting node A's agent: {e:#}")));
            if let Err(e) = env.agents[NODE_A].wait_attached(&[
                L3_TUNNEL_DEVICE.to_owned(),
                proxy_testenv::EXT_DEVICE.to_owned(),
            ]) {
                env.fail(&format!("restarted agent of node A: {e:#}"));
            }
        }
    }
}

/// UDP datagrams larger than the MTU (1500 on the wire and every veth) through a NodePort, as
/// three fragments each way: via node A (backend on node B: SNAT on the way out, the reply's
/// fragments un-SNATed on node A's ingress, then reverse-translated toward the client) and via
/// node B (local backend). 4,000-byte requests echoed back, and small requests with 4,000-byte
/// replies; every one must be answered from the NodePort.
#[test]
fn udp_datagrams_larger_than_the_mtu_cross_a_nodeport_both_ways() {
    require_privileged!();
    let env = Env::start(&cluster_policy_yaml());
    let [a, b] = NODE_IPS;
    let big_request = "r".repeat(4000);
    let mut failed = Vec::new();
    for (node, ip) in [("A (SNAT)", a), ("B (local backend)", b)] {
        let mut answered = [0; 2];
        for i in 0..5 {
            for (kind, payload) in [(0, big_request.as_str()), (1, "big:4000")] {
                match env.net.udp_request(ip, 30053, payload) {
                    Ok(reply) => {
                        let want_body = if kind == 0 {
                            format!("b-web:{big_request}")
                        } else {
                            format!("b-web:{}", "x".repeat(4000))
                        };
                        if reply.from.ip() != &ip || reply.from.port() != 30053 {
                            env.fail(&format!(
                                "node {node}, request {i}: reply from {}, want {ip}:30053",
                                reply.from
                            ));
                        }
                        if reply.body != want_body {
                            env.fail(&format!(
                                "node {node}, request {i}: {}-byte reply body differs",
                                reply.body.len()
                            ));
                        }
                        answered[kind] += 1;
                    }
                    Err(e) => eprintln!("node {node}: {}-byte request {i}: {e:#}", payload.len()),
                }
            }
        }
        eprintln!(
            "NodePort via node {node}: 4,000-byte requests answered {}/5, small requests with \
             4,000-byte replies answered {}/5",
            answered[0], answered[1]
        );
        if answered != [5, 5] {
            failed.push(format!("node {node}: {answered:?} of [5, 5]"));
        }
    }
    let (translated, unmatched) = (
        env.counter(NODE_A, "fragment_translated"),
        env.counter(NODE_A, "fragment_unmatched"),
    );
    eprintln!("node A: fragment_translated={translated} fragment_unmatched={unmatched}");
    if !failed.is_empty() {
        env.fail(&format!(
            "unanswered: {failed:?} (node A fragment_unmatched={unmatched})"
        ));
    }
    // Node A translates each big datagram at two hooks (DNAT + SNAT out, un-SNAT + reverse NAT
    // back), two later fragments each: 5 big requests and 10 big replies.
    if translated < 60 {
        env.fail(&format!(
            "node A fragment_translated={translated}, want at least 60"
        ));
    }
}

#[test]
fn external_traffic_policy_local_keeps_the_client_ip_and_health_checks_steer() {
    require_privileged!();
    let env = Env::start(&(local_policy_yaml() + &denied_yaml()));
    let [a, b] = NODE_IPS;

    // Node B has the endpoint: the backend sees the real client.
    let r = env.get(&format!("http://{b}:30081/"));
    if r.body != "b-loc" || !r.client_addr.starts_with(&format!("{EXT_CLIENT_IP}:")) {
        env.fail(&format!(
            "eTP=Local via node B must keep the client IP: {r:?}"
        ));
    }

    // Node A has none: no answer at all (dropped, not refused), and counted.
    let (outcome, took) = env
        .net
        .tcp_connect(a, 30081, Duration::from_secs(2))
        .unwrap_or_else(|e| env.fail(&format!("connect helper: {e:#}")));
    if outcome != ConnectOutcome::TimedOut {
        env.fail(&format!(
            "eTP=Local via node A without local endpoints: {outcome:?} after {took:?}, expected a timeout"
        ));
    }
    let dropped = env.counter(NODE_A, "drop_no_local_endpoints");
    if dropped == 0 {
        env.fail("node A did not count the dropped SYNs");
    }

    // A pod on node A is inside the cluster CIDR: like upstream's short-circuit it reaches the
    // Service's endpoint on node B through the same NodePort, with its own address (upstream
    // does not masquerade pod traffic on this path).
    let r = env.pod_get(NODE_A, "a-cli", &format!("http://{a}:30081/"));
    if r.code != 200 || r.body != "b-loc" || !r.client_addr.starts_with(&format!("{A_CLIENT}:")) {
        env.fail(&format!(
            "eTP=Local NodePort of node A from its pod a-cli (endpoint only on node B): {r:?}"
        ));
    }
    // The external client still gets no answer there.
    let (outcome, _) = env
        .net
        .tcp_connect(a, 30081, Duration::from_secs(2))
        .unwrap_or_else(|e| env.fail(&format!("connect helper: {e:#}")));
    if outcome != ConnectOutcome::TimedOut {
        env.fail(&format!(
            "eTP=Local via node A from outside after the pod's request: {outcome:?}, expected a timeout"
        ));
    }
    // `dump services` shows the in-cluster entry beside the NodePort.
    let pin_dir = env.agents[NODE_A].pin_dir().to_string_lossy().into_owned();
    let dump = env.agents[NODE_A]
        .cli(&["dump", "services", "--pin-dir", &pin_dir])
        .unwrap_or_else(|e| env.fail(&format!("dump services: {e:#}")));
    let table = String::from_utf8_lossy(&dump.stdout);
    let row = format!("IPv4   {a}:30081 (in-cluster)");
    if !table
        .lines()
        .any(|l| l.starts_with(&row) && l.contains(&B_LOCAL.to_string()))
    {
        env.fail(&format!(
            "dump services has no row {row:?} → {B_LOCAL}:\n{table}"
        ));
    }

    // Health-check node port: 503 on A, 200 with weight 1 on B.
    let hc_a = env.get(&format!("http://{a}:{HC_PORT}/"));
    if hc_a.code != 503 || hc_a.weight != "0" {
        env.fail(&format!("health check on node A: {hc_a:?}"));
    }
    let hc_b = env.get(&format!("http://{b}:{HC_PORT}/"));
    if hc_b.code != 200 || hc_b.weight != "1" {
        env.fail(&format!("health check on node B: {hc_b:?}"));
    }
    let body: serde_json::Value = serde_json::from_str(&hc_b.body)
        .unwrap_or_else(|e| env.fail(&format!("health check body {:?}: {e}", hc_b.body)));
    assert_eq!(
        body,
        serde_json::json!({"service": {"namespace": "demo", "name": "lb-local"},
                           "localEndpoints": 1, "serviceProxyHealthy": true})
    );

    // The LoadBalancer IP, sent to the healthy node: served, client IP preserved.
    env.net
        .route_via_node("192.168.70.0/24", NODE_B)
        .expect("route to the LB IP");
    let r = env.get(&format!("http://{LB_IP}/"));
    if r.body != "b-loc" || !r.client_addr.starts_with(&format!("{EXT_CLIENT_IP}:")) {
        env.fail(&format!("LoadBalancer IP via node B: {r:?}"));
    }

    // loadBalancerSourceRanges: the client (192.168.50.100) is inside lb-local's
    // 192.168.50.96/29 (served above) and outside lb-denied's 10.0.0.0/8: no answer, counted.
    let denied = Ipv4Addr::new(192, 168, 70, 11);
    let (outcome, took) = env
        .net
        .tcp_connect(denied, 80, Duration::from_secs(2))
        .unwrap_or_else(|e| env.fail(&format!("connect helper: {e:#}")));
    if outcome != ConnectOutcome::TimedOut {
        env.fail(&format!(
            "LB IP outside loadBalancerSourceRanges: {outcome:?} after {took:?}, expected a timeout"
        ));
    }
    if env.counter(NODE_B, "drop_source_range") == 0 {
        env.fail("node B did not count the source-range drops");
    }
    // Its NodePort is not filtered (like upstream, ranges apply to the LoadBalancer IP).
    let r = env.get(&format!("http://{b}:30082/"));
    if r.body != "b-loc" {
        env.fail(&format!("NodePort of lb-denied: {r:?}"));
    }
}

/// The node's own processes (host network) reach its NodePorts and ClusterIPs through the socket
/// hooks: connect() goes straight to the backend (on the other node here), getpeername() and
/// recvfrom() show the Service. An externalTrafficPolicy Local NodePort is in-cluster traffic
/// for the node itself, so it reaches the Service's endpoints on other nodes too (kube-proxy).
#[test]
fn node_processes_reach_their_own_nodeports_and_clusterips() {
    require_privileged!();
    let env = Env::start(&(cluster_policy_yaml() + &local_policy_yaml()));
    let host_a = env.agents[NODE_A].host(env.net.node(NODE_A).node());
    let [a, _] = NODE_IPS;

    for (ip, port, what) in [
        (a, 30080, "NodePort on node A's own address"),
        (Ipv4Addr::new(10, 96, 1, 10), 80, "ClusterIP"),
        (EXTERNAL_IP, 80, "externalIP"),
    ] {
        let view = http_get_with_peer(&host_a, ip, port)
            .unwrap_or_else(|e| env.fail(&format!("{what} from node A's host: {e:#}")));
        if view.body != "b-web" || view.peer != format!("{ip}:{port}") {
            env.fail(&format!("{what} from node A's host: {view:?}"));
        }
        // Straight from node A's address to the backend on node B: no SNAT port involved.
        if !view.client_addr.starts_with(&format!("{a}:")) {
            env.fail(&format!(
                "{what}: backend saw {:?}, want node A",
                view.client_addr
            ));
        }
    }

    let reply = udp_request_from(&host_a, a, 30053, "host-ping")
        .unwrap_or_else(|e| env.fail(&format!("UDP NodePort from node A's host: {e:#}")));
    if reply.from.ip() != &a || reply.from.port() != 30053 || reply.body != "b-web:host-ping" {
        env.fail(&format!("UDP NodePort from node A's host: {reply:?}"));
    }

    // eTP=Local, no endpoint on node A: external clients get nothing (tested above), the node
    // itself is served by the endpoint on node B.
    let view = http_get_with_peer(&host_a, a, 30081)
        .unwrap_or_else(|e| env.fail(&format!("eTP=Local NodePort from node A's host: {e:#}")));
    if view.body != "b-loc" || view.peer != format!("{a}:30081") {
        env.fail(&format!("eTP=Local NodePort from node A's host: {view:?}"));
    }
    if env.counter(NODE_A, "sock_translated") < 5 {
        env.fail("node A did not count the socket translations");
    }
}

/// Paced load of short HTTP connections: `total` connections launched at `rate` a second by the
/// monotonic clock (overdue ones launched at once; none after `limit` s), non-blocking sockets in
/// one epoll loop so slow or dropped connections never stall the pacing. Each one: connect, a
/// minimal HTTP/1.0 GET, the client's FIN right after it (the client closes first, so the
/// TIME_WAIT is the client's, counted by its kernel as TCPTimeWaitOverflow under the wire
/// client's tcp_max_tw_buckets=0), read until EOF, close; answered when the reply is `200` with
/// body "b-web", failed after `timeout` s. Prints one JSON summary (first_failure_at_s: launch
/// time of the earliest failed connection). Args: ip, port, rate, total, limit (s), timeout (s).
const NODEPORT_LOAD_PY: &str = r#"
import collections, errno, json, resource, selectors, socket, sys, time
ip, port, rate, total = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), int(sys.argv[4])
limit, timeout = float(sys.argv[5]), float(sys.argv[6])
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, min(hard, 8192)), hard))
REQUEST = b"GET / HTTP/1.0\r\nHost: %s:%d\r\n\r\n" % (ip.encode(), port)

def tw_overflows():
    try:
        rows = [l.split() for l in open("/proc/net/netstat") if l.startswith("TcpExt:")]
        return int(dict(zip(rows[0], rows[1])).get("TCPTimeWaitOverflow", 0))
    except (OSError, IndexError, ValueError):
        return -1

class Conn:
    __slots__ = ("sock", "started", "data", "done", "sent")

sel = selectors.DefaultSelector()
pending = collections.deque()  # (deadline, conn) in launch order, so by deadline
open_conns, answered, latencies = 0, 0, []
failed = collections.Counter()
first_failure, max_lag = None, 0.0
tw_before = tw_overflows()
t0 = time.monotonic()
stop = t0 + limit

def finish(c, kind=None):
    global open_conns, answered, first_failure
    c.done = True
    open_conns -= 1
    try:
        sel.unregister(c.sock)
    except (KeyError, ValueError):
        pass
    c.sock.close()
    if kind is None:
        answered += 1
        latencies.append(time.monotonic() - c.started)
    else:
        failed[kind] += 1
        at = c.started - t0
        if first_failure is None or at < first_failure:
            first_failure = at

def launch(now):
    global open_conns
    c = Conn()
    c.started, c.data, c.done, c.sent = now, b"", False, False
    c.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    c.sock.setblocking(False)
    open_conns += 1
    err = c.sock.connect_ex((ip, port))
    if err not in (0, errno.EINPROGRESS):
        return finish(c, "connect:" + errno.errorcode.get(err, str(err)))
    sel.register(c.sock, selectors.EVENT_WRITE, c)
    pending.append((now + timeout, c))

def ready(c):
    if not c.sent:
        err = c.sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
        if err:
            return finish(c, "connect:" + errno.errorcode.get(err, str(err)))
        try:
            c.sock.sendall(REQUEST)
            c.sock.shutdown(socket.SHUT_WR)
        except OSError as e:
            return finish(c, "send:" + errno.errorcode.get(e.errno, str(e.errno)))
        c.sent = True
        sel.modify(c.sock, selectors.EVENT_READ, c)
        return
    try:
        chunk = c.sock.recv(65536)
    except BlockingIOError:
        return
    except OSError as e:
        return finish(c, "recv:" + errno.errorcode.get(e.errno, str(e.errno)))
    if chunk:
        c.data += chunk
        return
    head, _, body = c.data.partition(b"\r\n\r\n")
    finish(c, None if head.startswith(b"HTTP/1.1 200 ") and body == b"b-web\n" else "bad-reply")

launched = 0
while True:
    now = time.monotonic()
    while launched < total and now < stop and now >= t0 + launched / rate:
        max_lag = max(max_lag, now - (t0 + launched / rate))
        launch(now)
        launched += 1
    while pending and (pending[0][1].done or pending[0][0] <= now):
        _, c = pending.popleft()
        if not c.done:
            finish(c, "timeout")
    if (launched >= total or now >= stop) and open_conns == 0:
        break
    wake = pending[0][0] if pending else now + 1
    if launched < total and now < stop:
        wake = min(wake, t0 + launched / rate, stop)
    for key, _ in sel.select(max(0.0, wake - time.monotonic())):
        if not key.data.done:
            ready(key.data)
latencies.sort()
ms = lambda s: int(s * 1000)
print(json.dumps({
    "attempted": launched,
    "answered": answered,
    "failed": sum(failed.values()),
    "failures": dict(failed),
    "first_failure_at_s": None if first_failure is None else round(first_failure, 2),
    "max_latency_ms": ms(latencies[-1]) if latencies else None,
    "p99_latency_ms": ms(latencies[(len(latencies) - 1) * 99 // 100]) if latencies else None,
    "max_launch_lag_ms": ms(max_lag),
    "elapsed_s": round(time.monotonic() - t0, 2),
    "client_time_waits": tw_overflows() - tw_before,
}), flush=True)
"#;

/// An external client opens short HTTP connections to the NodePort of node A, which has no
/// endpoints (eTP=Cluster: every flow SNATed to node A toward b-web on node B), at a steady 150
/// a second for 60 s: all 9,000 answered. Each flow takes a node port from the SNAT range for
/// (node A, b-web:8080, TCP); the range must serve the rate however long a closed flow's port
/// is held (the client closes first and keeps the TIME_WAIT).
#[test]
fn a_nodeport_takes_150_new_snated_connections_a_second_for_a_minute() {
    require_privileged!();
    const RATE: u32 = 150;
    const SECONDS: u32 = 60;
    const CONNECTIONS: u32 = RATE * SECONDS;
    /// The generator stops launching after this, whatever it reached.
    const LIMIT_SECONDS: u32 = 75;
    const CONNECT_TIMEOUT_SECONDS: u32 = 3;
    let env = Env::start(&cluster_policy_yaml());
    let a = NODE_IPS[NODE_A];

    // The path works before the load: answered by b-web, SNATed to node A.
    let r = env.get(&format!("http://{a}:30080/"));
    if r.code != 200 || r.body != "b-web" {
        env.fail(&format!("NodePort via node A before the load: {r:?}"));
    }
    snat_port(&env, &r.client_addr, a, SNAT_NODE_PORT_MIN);
    let snat_new_before = env.counter(NODE_A, "snat_new");
    let exhausted_before = env.counter(NODE_A, "drop_snat_ports_exhausted");

    let started = std::time::Instant::now();
    let out = env
        .net
        .client()
        .output(
            &[
                "python3",
                "-c",
                NODEPORT_LOAD_PY,
                &a.to_string(),
                "30080",
                &RATE.to_string(),
                &CONNECTIONS.to_string(),
                &LIMIT_SECONDS.to_string(),
                &CONNECT_TIMEOUT_SECONDS.to_string(),
            ],
            // Killed (its process group) if it overruns its own bound.
            Duration::from_secs(u64::from(LIMIT_SECONDS + CONNECT_TIMEOUT_SECONDS) + 30),
        )
        .unwrap_or_else(|e| env.fail(&format!("load generator: {e:#}")));
    let took = started.elapsed();
    let summary: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
        env.fail(&format!(
            "the load generator printed no summary ({e}): {} {}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        ))
    });
    let snat_new = env
        .counter(NODE_A, "snat_new")
        .saturating_sub(snat_new_before);
    let exhausted = env
        .counter(NODE_A, "drop_snat_ports_exhausted")
        .saturating_sub(exhausted_before);
    let (attempted, answered) = (
        summary["attempted"].as_u64().unwrap_or(0),
        summary["answered"].as_u64().unwrap_or(0),
    );
    eprintln!(
        "nodeport snat load: {answered}/{attempted} answered at {RATE}/s, p99 {} ms, \
         snat_new {snat_new}, drop_snat_ports_exhausted {exhausted} ({took:.1?}; {summary})",
        summary["p99_latency_ms"]
    );
    if attempted != u64::from(CONNECTIONS) || answered != attempted {
        let pin_dir = env.agents[NODE_A].pin_dir().to_string_lossy().into_owned();
        let stats = env.agents[NODE_A]
            .cli(&["dump", "stats", "--pin-dir", &pin_dir])
            .map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
            .unwrap_or_else(|e| format!("dump stats: {e:#}"));
        env.fail(&format!(
            "{answered} of {attempted} connections answered ({CONNECTIONS} wanted at {RATE}/s \
             for {SECONDS} s): {summary}; node A during the load: snat_new {snat_new}, \
             drop_snat_ports_exhausted {exhausted}\n--- node A dump stats ---\n{stats}"
        ));
    }
}

/// External client: connect from source port `sport`, send the start of an HTTP request, wait
/// `hold` s with the connection open (the server waits for the end of the headers), finish the
/// request and print the whole reply. Args: ip, port, sport, hold (s).
const HELD_REQUEST_PY: &str = r#"
import socket, sys, time
ip, port, sport, hold = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("", sport))
s.settimeout(10)
s.connect((ip, port))
s.sendall(b"GET / HTTP/1.0\r\nHost: x\r\n")
time.sleep(hold)
s.sendall(b"\r\n")
data = b""
while True:
    chunk = s.recv(4096)
    if not chunk:
        break
    data += chunk
sys.stdout.write(data.decode(errors="replace"))
"#;

/// The SNAT port a flow keeps is its client's own, which the node's own connections may pick
/// too: node A's ephemeral range narrowed to one port, an external client holds a NodePort
/// connection from that port (SNATed to node A, port kept, toward b-web on node B) while a
/// process of node A connects to b-web straight from that same port. netfilter remaps the
/// node's clashing connection; so must the datapath: both get their own answers.
#[test]
fn a_node_connection_on_the_port_a_snated_flow_kept_is_remapped_and_both_are_answered() {
    require_privileged!();
    const PORT: u16 = 45_000;
    let env = Env::start(&cluster_policy_yaml());
    let a = NODE_IPS[NODE_A];
    let node_a = env.net.node(NODE_A).node();
    node_a
        .sysctl("net.ipv4.ip_local_port_range", &format!("{PORT} {PORT}"))
        .unwrap_or_else(|e| env.fail(&format!("narrowing node A's port range: {e:#}")));
    let remapped_before = env.counter(NODE_A, "snat_node_connection_remapped");

    let (held, node_reply) = std::thread::scope(|s| {
        let held = s.spawn(|| {
            env.net.client().output(
                &[
                    "python3",
                    "-c",
                    HELD_REQUEST_PY,
                    &a.to_string(),
                    "30080",
                    &PORT.to_string(),
                    "3",
                ],
                Duration::from_secs(20),
            )
        });
        // The held connection is up (SNATed, port kept) before the node connects.
        std::thread::sleep(Duration::from_millis(1500));
        let node_reply = node_a.output(
            &[
                "curl",
                "-s",
                "--max-time",
                "3",
                "-w",
                "\x1e%header{x-client-addr}",
                &format!("http://{B_WEB}:8080/"),
            ],
            Duration::from_secs(10),
        );
        (held.join().expect("client thread"), node_reply)
    });
    let held = held.unwrap_or_else(|e| env.fail(&format!("held NodePort request: {e:#}")));
    let held = String::from_utf8_lossy(&held.stdout).into_owned();
    let node_reply = node_reply.unwrap_or_else(|e| env.fail(&format!("curl from node A: {e:#}")));
    let node_reply = String::from_utf8_lossy(&node_reply.stdout).into_owned();
    let remapped = env
        .counter(NODE_A, "snat_node_connection_remapped")
        .saturating_sub(remapped_before);
    eprintln!(
        "node connection clash: held reply {held:?}, node's reply {node_reply:?}, remapped {remapped}"
    );
    if !held.contains("b-web") || !held.contains(&format!("X-Client-Addr: {a}:{PORT}")) {
        env.fail(&format!(
            "the held NodePort connection (SNATed to node A, its port {PORT} kept): {held:?}"
        ));
    }
    let (body, seen) = node_reply.split_once('\x1e').unwrap_or_default();
    let seen_port = seen
        .strip_prefix(&format!("{a}:"))
        .and_then(|p| p.trim().parse::<u16>().ok());
    if body.trim() != "b-web" || seen_port.is_none_or(|p| p == PORT) {
        env.fail(&format!(
            "node A's own connection from port {PORT} to b-web: {node_reply:?} (want b-web, \
             seen from node A on another port)"
        ));
    }
    if remapped == 0 {
        env.fail("node A counted no remapped node connection");
    }
}

/// Two NodePorts on node A toward the 1 MiB server: eTP=Cluster with the backend on node B
/// (SNATed), eTP=Local with the backend on node A.
fn big_download_yaml() -> String {
    let one = |name: &str,
               cluster_ip: &str,
               node_port: u16,
               policy: &str,
               ip: Ipv4Addr,
               node: &str| {
        format!(
            "apiVersion: v1\nkind: Service\nmetadata:\n  name: {name}\n  namespace: demo\nspec:\n  \
             type: NodePort\n  clusterIP: {cluster_ip}\n  externalTrafficPolicy: {policy}\n  ports:\n  \
             - {{name: big, port: 81, targetPort: 8081, nodePort: {node_port}, protocol: TCP}}\n\
             ---\napiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata:\n  \
             name: {name}-1\n  namespace: demo\n  labels:\n    kubernetes.io/service-name: {name}\n\
             addressType: IPv4\nports:\n  - name: big\n    port: 8081\n    protocol: TCP\n\
             endpoints:\n  - addresses: [\"{ip}\"]\n    nodeName: {node}\n    \
             conditions: {{ready: true, serving: true, terminating: false}}\n---\n"
        )
    };
    one(
        "big-cluster",
        "10.96.1.90",
        30090,
        "Cluster",
        B_WEB,
        NODE_NAMES[NODE_B],
    ) + &one(
        "big-local",
        "10.96.1.91",
        30091,
        "Local",
        A_CLIENT,
        NODE_NAMES[NODE_A],
    )
}

/// Path MTU discovery through a NodePort: a client behind a router whose link toward it has MTU
/// 1400 downloads 1 MiB. The backend's full-size segments meet the smaller hop; the router's
/// Fragmentation Needed quotes the reply as it left node A (node A:NodePort → client) and must
/// reach the backend quoting the reply as the backend sent it, or the download stalls (the
/// load-balancer PMTU black hole). Both with the backend on the other node (SNATed) and on
/// node A (eTP=Local, client address kept).
#[test]
fn a_download_through_a_nodeport_finds_the_path_mtu_behind_a_smaller_hop() {
    require_privileged!();
    let env = Env::start(&big_download_yaml());
    let a = NODE_IPS[NODE_A];
    let work = proxy_testenv::ManifestDir::new().expect("work dir");
    let mut servers = Vec::new();
    for (node, pod) in [(NODE_B, "b-web"), (NODE_A, "a-cli")] {
        let ns = env.net.node(node).pod(pod).expect("pod").ns();
        servers.push(
            common_netns::big_download_server(ns, work.path())
                .unwrap_or_else(|e| env.fail(&format!("1 MiB server in {pod}: {e:#}"))),
        );
    }
    let far = common_netns::far_client_behind(env.net.client())
        .unwrap_or_else(|e| env.fail(&format!("far client: {e:#}")));
    let router = EXT_CLIENT_IP.to_string();
    env.net
        .node(NODE_A)
        .node()
        .exec(&["ip", "route", "add", common_netns::FAR_NET, "via", &router])
        .unwrap_or_else(|e| env.fail(&format!("route to the far client: {e:#}")));
    let translated_before = env.counter(NODE_A, "icmp_error_translated");
    for (port, what) in [
        (30090, "eTP=Cluster, backend on node B (SNATed)"),
        (30091, "eTP=Local, backend on node A"),
    ] {
        let (got, shown) = common_netns::big_download(&far, &format!("http://{a}:{port}/"))
            .unwrap_or_else(|e| env.fail(&format!("curl {what}: {e:#}")));
        eprintln!("PMTU through a NodePort ({what}): {shown} (bytes of 1048576, curl exit)");
        if got != 1 << 20 {
            env.fail(&format!(
                "1 MiB through NodePort {port} ({what}) from behind an MTU-1400 hop: {shown:?} \
                 (bytes, curl's exit and error; the backend never learned the path MTU?)"
            ));
        }
    }
    if env.counter(NODE_A, "icmp_error_translated") == translated_before {
        env.fail("node A translated no ICMP error toward a backend");
    }
    drop(servers);
}
