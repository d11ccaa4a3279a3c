//! Privileged: health-check node ports on both families (issue 12), on the two-node topology
//! (`proxy_testenv::MultiNode`, the external client on the wire asks each node, as a load
//! balancer does). Like upstream's per-family ServiceHealthServers, the IPv4 port answers on the
//! IPv4 node address with the IPv4 family's local endpoints and the IPv6 port on the IPv6 node
//! address with the IPv6 family's: an IPv6-only externalTrafficPolicy Local LoadBalancer Service
//! gets a health check at all, and a dual-stack one reports each family's own count.
//!
//! Run by `sudo cargo xtask test` (sets KPE_PRIVILEGED=1, one test thread); skipped otherwise.
//! Everything lives in network namespaces the test creates; RAII guards remove them.

use std::{net::IpAddr, path::Path, time::Duration};

use proxy_testenv::{
    Agent, CLUSTER_CIDR_DUAL, EXT_DEVICE, HttpReply, ManifestDir, MultiNode, NODE_IPS, NODE_IPS6,
    NODE_NAMES, PinDir, http_url, require_privileged,
};

const BIN: &str = env!("CARGO_BIN_EXE_kube-proxy-ebpf");
const NODE_A: usize = 0;
const NODE_B: usize = 1;
/// The IPv6-only Service's health-check port, and the dual-stack one's.
const HC_SIX: u16 = 32_100;
const HC_DUAL: u16 = 32_200;

/// Field order is drop order: agents first, then pins, manifests, namespaces.
struct Env {
    agents: Vec<Agent>,
    _pins: Vec<PinDir>,
    _manifests: ManifestDir,
    net: MultiNode,
}

impl Env {
    fn start(yaml: &str) -> Self {
        proxy_testenv::ensure_bpffs().expect("bpffs at /sys/fs/bpf");
        let net = MultiNode::new().expect("creating the two-node topology");
        let manifests = ManifestDir::new().expect("manifest dir");
        std::fs::write(manifests.path().join("services.yaml"), yaml).expect("writing manifests");
        let mut agents = Vec::new();
        let mut pins = Vec::new();
        for i in [NODE_A, NODE_B] {
            let node = net.node(i);
            let pin = PinDir::new(&format!("{}-pins", node.prefix())).expect("pin dir");
            let args = [
                "--manifests".as_ref(),
                manifests.path().as_os_str(),
                "--devices".as_ref(),
                EXT_DEVICE.as_ref(),
                "--hostname-override".as_ref(),
                NODE_NAMES[i].as_ref(),
                "--cluster-cidr".as_ref(),
                CLUSTER_CIDR_DUAL.as_ref(),
            ];
            let mut agent = Agent::start_with(
                Path::new(BIN),
                node.node(),
                &args,
                pin.path(),
                node.tmp().path(),
            )
            .expect("starting the agent");
            let mut want = node.pod_interfaces();
            want.push(EXT_DEVICE.to_owned());
            agent
                .wait_attached(&want)
                .unwrap_or_else(|e| panic!("node {i}: {e:#}"));
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

    fn fail(&self, msg: &str) -> ! {
        panic!(
            "{msg}\n--- node A agent log (tail) ---\n{}\n--- node B agent log (tail) ---\n{}",
            self.agents[NODE_A].log_tail(),
            self.agents[NODE_B].log_tail()
        )
    }

    /// The health check at `addr:port` from the external client. The server is bound by the
    /// first sync (before the agent attaches), so one try normally does; a few more (bounded)
    /// cover a bind the agent retries at its next sync.
    fn health(&self, addr: IpAddr, port: u16) -> (HttpReply, serde_json::Value) {
        let url = http_url(addr, port);
        let mut last = None;
        for _ in 0..10 {
            match self.net.http_get(&url) {
                Ok(r) => {
                    let body = serde_json::from_str(&r.body).unwrap_or_else(|e| {
                        self.fail(&format!("GET {url}: body {:?}: {e}", r.body))
                    });
                    return (r, body);
                }
                Err(e) => last = Some(e),
            }
            std::thread::sleep(Duration::from_millis(300));
        }
        self.fail(&format!("GET {url}: {:#}", last.expect("tried"))) // 10 failures
    }

    /// Asserts the answer of node `i`'s health check at `addr:port`.
    fn expect(&self, i: usize, addr: IpAddr, port: u16, service: &str, local: usize) {
        let (r, body) = self.health(addr, port);
        let code = if local > 0 { 200 } else { 503 };
        let want = serde_json::json!({"service": {"namespace": "demo", "name": service},
                                      "localEndpoints": local, "serviceProxyHealthy": true});
        if r.code != code || r.weight != local.to_string() || body != want {
            self.fail(&format!(
                "node {i} health check {}: {r:?}, want {code} weight {local} body {want}",
                http_url(addr, port)
            ));
        }
    }
}

/// A LoadBalancer Service (eTP=Local) on `cluster_ips` plus one EndpointSlice per family with
/// ready endpoints `(ip, node)`.
fn lb_local(name: &str, cluster_ips: &[&str], hc: u16, endpoints: &[(&str, &str)]) -> String {
    let families: Vec<&str> = (cluster_ips.iter())
        .map(|ip| if ip.contains(':') { "IPv6" } else { "IPv4" })
        .collect();
    let policy = if cluster_ips.len() > 1 {
        "RequireDualStack"
    } else {
        "SingleStack"
    };
    let mut y = format!(
        "apiVersion: v1\nkind: Service\nmetadata:\n  name: {name}\n  namespace: demo\nspec:\n  \
         type: LoadBalancer\n  clusterIP: \"{}\"\n  clusterIPs: {cluster_ips:?}\n  ipFamilies: \
         {families:?}\n  ipFamilyPolicy: {policy}\n  externalTrafficPolicy: Local\n  \
         healthCheckNodePort: {hc}\n  ports:\n  - {{name: http, port: 80, targetPort: 8080, \
         nodePort: {}, protocol: TCP}}\n",
        cluster_ips[0],
        hc - 2000,
    );
    for family in ["IPv4", "IPv6"] {
        let eps: Vec<&(&str, &str)> = (endpoints.iter())
            .filter(|(ip, _)| ip.contains(':') == (family == "IPv6"))
            .collect();
        if eps.is_empty() {
            continue;
        }
        y.push_str(&format!(
            "---\napiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata:\n  name: \
             {name}-{family}\n  namespace: demo\n  labels:\n    kubernetes.io/service-name: \
             {name}\naddressType: {family}\nports:\n  - name: http\n    port: 8080\n    \
             protocol: TCP\nendpoints:\n"
        ));
        for (ip, node) in eps {
            y.push_str(&format!(
                "  - addresses: [\"{ip}\"]\n    nodeName: {node}\n    conditions: {{ready: true, \
                 serving: true, terminating: false}}\n"
            ));
        }
    }
    y.push_str("---\n");
    y
}

#[test]
fn health_check_node_ports_answer_per_family_with_that_familys_local_endpoints() {
    require_privileged!();
    let [a, b] = NODE_NAMES;
    let yaml = lb_local(
        "six",
        &["fd00:10:96::100"],
        HC_SIX,
        &[
            ("fd00:10:244:2::21", b),
            ("fd00:10:244:2::22", b),
            ("fd00:10:244:1::21", "elsewhere"),
        ],
    ) + &lb_local(
        "dual",
        &["10.96.1.200", "fd00:10:96::200"],
        HC_DUAL,
        // IPv4: one endpoint on node A; IPv6: one on node B.
        &[("10.244.1.31", a), ("fd00:10:244:2::31", b)],
    );
    let env = Env::start(&yaml);
    let [a4, b4] = NODE_IPS.map(IpAddr::from);
    let [a6, b6] = NODE_IPS6.map(IpAddr::from);

    // IPv6-only: served over IPv6, node B's two IPv6 endpoints (the third is on no node of
    // these), node A has none.
    env.expect(NODE_B, b6, HC_SIX, "six", 2);
    env.expect(NODE_A, a6, HC_SIX, "six", 0);
    // ... and not on the IPv4 node addresses (an IPv6-only Service has no IPv4 family).
    if let Ok(r) = env.net.http_get(&http_url(b4, HC_SIX)) {
        env.fail(&format!("IPv6-only Service's health check on IPv4: {r:?}"));
    }

    // Dual-stack: each family counts its own endpoints on its own addresses.
    env.expect(NODE_A, a4, HC_DUAL, "dual", 1);
    env.expect(NODE_A, a6, HC_DUAL, "dual", 0);
    env.expect(NODE_B, b4, HC_DUAL, "dual", 0);
    env.expect(NODE_B, b6, HC_DUAL, "dual", 1);
}
