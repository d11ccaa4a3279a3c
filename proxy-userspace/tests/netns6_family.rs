//! Privileged: the IPv6 family's north-south state beside the IPv4 one (issue 12).
//!
//! - Health-check node ports on both families, on the two-node topology
//!   (`proxy_testenv::MultiNode`, the external client on the wire asks each node, as a load
//!   balancer does). Like upstream's per-family ServiceHealthServers, the IPv4 port answers on
//!   the IPv4 node address with the IPv4 family's local endpoints and the IPv6 port on the IPv6
//!   node address with the IPv6 family's: an IPv6-only externalTrafficPolicy Local LoadBalancer
//!   Service gets a health check at all, and a dual-stack one reports each family's own count.
//! - IPv6 node addresses followed like IPv4's: a NodePort on an IPv6 address added to a node is
//!   served without waiting for a full sync (the address event, then every sync, lists them).
//! - The IPv6 Service address space (`SVCCIDRS6_V1`) from `--service-cidr`, on the one-node
//!   topology: a ClusterIP's other ports refused, the unallocated rest dropped, as on IPv4;
//!   and from the IPv6 CIDRs of ServiceCIDR objects (the fake API server), following the API.
//! - /metrics of an agent programming IPv6: the IPv6 maps' occupancy (`map="services6"` ...)
//!   and the IPv6 family's `ip_family="IPv6"` series.
//!
//! Run by `sudo cargo xtask test` (sets KPE_PRIVILEGED=1, one test thread); skipped otherwise.
//! Everything lives in network namespaces the test creates; RAII guards remove them.

use std::{
    collections::BTreeMap,
    net::{IpAddr, Ipv4Addr, Ipv6Addr},
    path::Path,
    time::Duration,
};

use aya::maps::{
    Map, MapData,
    lpm_trie::{Key, LpmTrie},
};
use proxy_common::{ipv6::MAP_SERVICE_CIDRS6, service_cidr};
use proxy_testenv::{
    BACKENDS, BACKENDS6, CLUSTER_CIDR_DUAL, ConnectOutcome, EXT_DEVICE, FakeApiServer,
    FamilyService, HttpReply, ManifestDir, MultiNode, NODE_IPS, NODE_IPS6, NODE_NAMES, PinDir,
    ServicePort, Topology,
    fake_apiserver::{Kind, wait_for},
    family_service_yaml, http_url, require_privileged, tcp6_connect_from,
};
use serde_json::json;

mod common_netns;
use common_netns::{Cluster, start_agent};

const NODE_A: usize = 0;
const NODE_B: usize = 1;
/// The IPv6-only Service's health-check port, and the dual-stack one's.
const HC_SIX: u16 = 32_100;
const HC_DUAL: u16 = 32_200;

/// Both nodes, `backends` (node, pod name, IPv4 address; the pods are dual-stack), `yaml`
/// written, both agents synced and attached.
fn start(backends: &[(usize, &str, Ipv4Addr)], yaml: &str) -> Cluster {
    let mut net = MultiNode::new().expect("creating the two-node topology");
    for &(i, name, ip) in backends {
        net.add_backend(i, name, ip).expect("backend");
    }
    Cluster::start_on(net, CLUSTER_CIDR_DUAL, |manifests| {
        std::fs::write(manifests.path().join("services.yaml"), yaml).expect("writing manifests")
    })
}

impl Cluster {
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
    let env = start(&[], &yaml);
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

/// A new IPv6 address on node A: the agent sees the address event and serves the NodePort on
/// it (no full sync comes in these seconds: the periodic pass is minutes away), as the IPv4
/// path does in northsouth.rs.
#[test]
fn a_nodeport_answers_on_a_newly_added_node_ipv6_address() {
    require_privileged!();
    const WEB_NODE_PORT: u16 = 30080;
    let mut endpoints: Vec<IpAddr> = BACKENDS.iter().map(|(_, ip)| (*ip).into()).collect();
    endpoints.extend(BACKENDS6.iter().map(|(_, ip)| IpAddr::from(*ip)));
    let yaml = family_service_yaml(&FamilyService {
        namespace: "demo",
        name: "web",
        cluster_ips: &[
            "10.96.0.10".parse().unwrap(),
            "fd00:10:96::10".parse().unwrap(),
        ],
        ports: &[ServicePort::tcp(80, 8080)],
        node_ports: &[WEB_NODE_PORT],
        endpoints: &endpoints,
    });
    let backends: Vec<(usize, &str, Ipv4Addr)> =
        BACKENDS.iter().map(|&(n, ip)| (NODE_A, n, ip)).collect();
    let env = start(&backends, &yaml);
    let get = |addr: IpAddr| env.net.http_get(&http_url(addr, WEB_NODE_PORT));
    // Served on the node's IPv6 address from the start.
    let first = get(NODE_IPS6[NODE_A].into());
    if !first
        .as_ref()
        .is_ok_and(|r| BACKENDS.iter().any(|(n, _)| *n == r.body))
    {
        env.fail(&format!("IPv6 NodePort of node A: {first:?}"));
    }
    let added = Ipv6Addr::new(0xfd00, 0x192, 0x168, 0x50, 0, 0, 0, 0x20);
    env.net
        .node(NODE_A)
        .node()
        .exec(&[
            "ip",
            "-6",
            "addr",
            "add",
            &format!("{added}/64"),
            "dev",
            EXT_DEVICE,
            "nodad",
        ])
        .unwrap_or_else(|e| env.fail(&format!("adding {added}: {e:#}")));
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    loop {
        match get(added.into()) {
            Ok(r) if BACKENDS.iter().any(|(n, _)| *n == r.body) => break,
            other if std::time::Instant::now() >= deadline => env.fail(&format!(
                "NodePort on the new address {added} not served within 5 s: {other:?}"
            )),
            _ => std::thread::sleep(Duration::from_millis(100)),
        }
    }
}

/// The pinned `SVCCIDRS6_V1` entries: (prefix length, address) → `service_cidr::*`.
fn service_cidr6_entries(pin_dir: &Path) -> BTreeMap<(u32, Ipv6Addr), u32> {
    let data = MapData::from_pin(pin_dir.join(MAP_SERVICE_CIDRS6)).expect("pinned SVCCIDRS6 map");
    let map: LpmTrie<MapData, [u8; 16], u32> =
        LpmTrie::try_from(Map::LpmTrie(data)).expect("SVCCIDRS6 is an LPM trie");
    map.iter()
        .filter_map(Result::ok)
        .map(|(k, v): (Key<[u8; 16]>, u32)| ((k.prefix_len(), Ipv6Addr::from(k.data())), v))
        .collect()
}

/// `--service-cidr` with an IPv6 CIDR: `SVCCIDRS6_V1` holds it and the IPv6 ClusterIP (not the
/// IPv4 CIDR), and like kube-proxy's nftables mode a new flow to the IPv6 ClusterIP's other
/// port is refused, one to the unallocated rest of the IPv6 Service CIDR dropped, for pods (tc)
/// and the node's own processes (connect6), as the IPv4 test in netns.rs checks for IPv4.
#[test]
fn ipv6_service_cidr_rejects_other_ports_of_cluster_ips_and_drops_unallocated_addresses() {
    require_privileged!();
    const WEB: Ipv6Addr = Ipv6Addr::new(0xfd00, 0x10, 0x96, 0, 0, 0, 0, 0x10);
    const UNALLOCATED: Ipv6Addr = Ipv6Addr::new(0xfd00, 0x10, 0x96, 0, 0, 0, 0, 0x77);
    proxy_testenv::ensure_bpffs().expect("bpffs at /sys/fs/bpf");
    let topo = Topology::new().expect("creating the topology");
    let manifests = ManifestDir::new().expect("manifest dir");
    let endpoints: Vec<IpAddr> = BACKENDS6.iter().map(|(_, ip)| (*ip).into()).collect();
    manifests
        .write_family_service(&FamilyService {
            namespace: "demo",
            name: "web",
            cluster_ips: &[WEB.into()],
            ports: &[ServicePort::tcp(80, 8080)],
            node_ports: &[],
            endpoints: &endpoints,
        })
        .expect("writing demo/web");
    let pins = PinDir::new(&format!("{}-pins", topo.prefix())).expect("pin dir");
    let args = [
        "--manifests".as_ref(),
        manifests.path().as_os_str(),
        "--service-cidr".as_ref(),
        "10.96.0.0/16,fd00:10:96::/112".as_ref(),
    ];
    let agent = start_agent(&topo, &args, &pins, topo.pod_interfaces(), "the agent");

    let entries = service_cidr6_entries(pins.path());
    let want = BTreeMap::from([
        (
            (112, Ipv6Addr::new(0xfd00, 0x10, 0x96, 0, 0, 0, 0, 0)),
            service_cidr::UNALLOCATED,
        ),
        ((128, WEB), service_cidr::CLUSTER_IP),
    ]);
    agent.check(entries == want, || {
        format!("SVCCIDRS6_V1 holds {entries:?}, want {want:?}")
    });

    let host = agent.host(topo.node());
    let connect = |who: &str, ip: Ipv6Addr, port: u16, timeout: Duration| {
        let r = if who == "pod" {
            topo.tcp6_connect(ip, port, timeout)
        } else {
            tcp6_connect_from(&host, ip, port, timeout)
        };
        let (outcome, elapsed) =
            r.unwrap_or_else(|e| agent.fail(&format!("connect helper: {e:#}")));
        eprintln!("{who} connect to [{ip}]:{port}: {outcome:?} after {elapsed:?}");
        (outcome, elapsed)
    };
    // A pod's refusal comes with its first SYN retransmission (the ICMPv6 error of the first
    // SYN meets the socket locked in connect(): see netns6.rs's dual-stack reject test), the
    // node's own connect6 is refused at once.
    for (who, within) in [("pod", 2), ("host", 1)] {
        let within = Duration::from_secs(within);
        let (outcome, elapsed) = connect(who, WEB, 81, Duration::from_secs(3));
        agent.check(
            outcome == ConnectOutcome::Refused && elapsed < within,
            || {
                format!(
                    "{who} → ClusterIP [{WEB}]:81 (no such Service port): {outcome:?} after \
                 {elapsed:?}, want refused within {within:?}"
                )
            },
        );
        let (outcome, _) = connect(who, UNALLOCATED, 80, Duration::from_secs(2));
        agent.check(outcome == ConnectOutcome::TimedOut, || {
            format!("{who} → unallocated [{UNALLOCATED}]:80: {outcome:?}, want a timeout (dropped)")
        });
    }
    // The Service port itself still answers.
    let (outcome, _) = connect("pod", WEB, 80, Duration::from_secs(2));
    agent.check(outcome == ConnectOutcome::Connected, || {
        format!("pod → [{WEB}]:80: {outcome:?}")
    });
    let counter = |name: &str| {
        agent
            .counter(name)
            .unwrap_or_else(|e| agent.fail(&format!("{e:#}")))
    };
    let (rejected, dropped) = (
        counter("cluster_ip_port_rejected"),
        counter("drop_unallocated_service_ip"),
    );
    agent.check(rejected >= 2 && dropped >= 2, || {
        format!("cluster_ip_port_rejected={rejected} drop_unallocated_service_ip={dropped}, want ≥ 2 each")
    });

    // /metrics: the IPv6 maps as the IPv6 shadow holds them (three backends, one reverse NAT
    // entry for the one port), each with its capacity; the IPv6 family's own series.
    let scraped = topo
        .node()
        .output(
            &[
                "curl",
                "-sS",
                "--max-time",
                "3",
                "http://127.0.0.1:10249/metrics",
            ],
            Duration::from_secs(5),
        )
        .unwrap_or_else(|e| agent.fail(&format!("scraping /metrics: {e:#}")));
    let text = String::from_utf8_lossy(&scraped.stdout).into_owned();
    let value = |series: &str| -> f64 {
        text.lines()
            .filter(|l| !l.starts_with('#'))
            .find_map(|l| l.rsplit_once(' ').filter(|(s, _)| *s == series))
            .and_then(|(_, v)| v.parse().ok())
            .unwrap_or_else(|| agent.fail(&format!("no {series} in /metrics:\n{text}")))
    };
    agent.check(
        value("kube_proxy_ebpf_map_entries{map=\"backends6\"}") == 3.0
            && value("kube_proxy_ebpf_map_entries{map=\"rev_nat6\"}") == 1.0,
        || format!("IPv6 map occupancy:\n{text}"),
    );
    for map in [
        "services6",
        "backends6",
        "rev_nat6",
        "conntrack6",
        "snat6",
        "sock_rev6",
    ] {
        let capacity = value(&format!("kube_proxy_ebpf_map_capacity{{map=\"{map}\"}}"));
        agent.check(capacity > 0.0, || format!("{map} capacity {capacity}"));
    }
    for series in [
        "kubeproxy_sync_proxy_rules_no_local_endpoints_total{ip_family=\"IPv6\",traffic_policy=\"internal\"}",
        "kubeproxy_sync_proxy_rules_no_local_endpoints_total{ip_family=\"IPv6\",traffic_policy=\"external\"}",
    ] {
        agent.check(value(series) == 0.0, || format!("{series}:\n{text}"));
    }
}

/// ServiceCIDR objects (networking.k8s.io/v1): their IPv6 CIDRs go into `SVCCIDRS6_V1` (their
/// IPv4 ones into `SVCCIDRS_V1`, checked by kube_api.rs), beside `--service-cidr`'s, and leave
/// it when the object is deleted; the IPv6 ClusterIP's entry stays.
#[test]
fn ipv6_cidrs_of_service_cidr_objects_follow_the_api() {
    require_privileged!();
    const WEB: Ipv6Addr = Ipv6Addr::new(0xfd00, 0x10, 0x96, 0, 0, 0, 0, 0x10);
    const NET: Ipv6Addr = Ipv6Addr::new(0xfd00, 0x10, 0x96, 0, 0, 0, 0, 0);
    const FLAG: Ipv6Addr = Ipv6Addr::new(0xfd00, 0x20, 0, 0, 0, 0, 0, 0);
    proxy_testenv::ensure_bpffs().expect("bpffs at /sys/fs/bpf");
    let topo = Topology::new().expect("creating the topology");
    let api = FakeApiServer::start_in(Some(&topo.node().path())).expect("fake API server");
    api.apply(json!({"apiVersion": "v1", "kind": "Node", "metadata": {"name": "node-a"}}))
        .expect("node");
    let backend = BACKENDS6[0].1.to_string();
    api.apply_all(vec![
        json!({"apiVersion": "v1", "kind": "Service",
               "metadata": {"name": "web", "namespace": "demo", "uid": "web-uid"},
               "spec": {"type": "ClusterIP", "clusterIP": WEB.to_string(),
                        "clusterIPs": [WEB.to_string()], "ipFamilies": ["IPv6"],
                        "ports": [{"name": "http", "port": 80, "targetPort": 8080,
                                   "protocol": "TCP"}]}}),
        json!({"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
               "metadata": {"name": "web-6", "namespace": "demo",
                            "labels": {"kubernetes.io/service-name": "web"}},
               "addressType": "IPv6",
               "ports": [{"name": "http", "port": 8080, "protocol": "TCP"}],
               "endpoints": [{"addresses": [backend], "conditions": {"ready": true}}]}),
        json!({"apiVersion": "networking.k8s.io/v1", "kind": "ServiceCIDR",
               "metadata": {"name": "kubernetes"},
               "spec": {"cidrs": ["10.96.0.0/16", "fd00:10:96::/112"]}}),
    ])
    .expect("objects");
    let kubeconfig = api
        .write_kubeconfig(&topo.tmp().path().join("kubeconfig"))
        .expect("kubeconfig");
    let pins = PinDir::new(&format!("{}-pins", topo.prefix())).expect("pin dir");
    let args = [
        "--kubeconfig".as_ref(),
        kubeconfig.as_os_str(),
        "--hostname-override".as_ref(),
        "node-a".as_ref(),
        "--service-cidr".as_ref(),
        "fd00:20::/64".as_ref(),
    ];
    let agent = start_agent(&topo, &args, &pins, topo.pod_interfaces(), "the agent");
    let want = |api_cidr: bool| {
        let mut m = BTreeMap::from([
            ((64, FLAG), service_cidr::UNALLOCATED),
            ((128, WEB), service_cidr::CLUSTER_IP),
        ]);
        if api_cidr {
            m.insert((112, NET), service_cidr::UNALLOCATED);
        }
        m
    };
    let wait = |api_cidr: bool| {
        let ok = wait_for(Duration::from_secs(10), "SVCCIDRS6_V1", || {
            service_cidr6_entries(pins.path()) == want(api_cidr)
        });
        if ok.is_err() {
            agent.fail(&format!(
                "SVCCIDRS6_V1 holds {:?}, want {:?}",
                service_cidr6_entries(pins.path()),
                want(api_cidr)
            ));
        }
    };
    wait(true);
    assert!(api.delete(Kind::ServiceCidr, "", "kubernetes"));
    wait(false);
}
