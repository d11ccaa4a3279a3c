//! Harness shared by the suites that drive the agent through the Kubernetes API (kube_api.rs,
//! churn_soak.rs): the API objects they serve from [`proxy_testenv::FakeApiServer`] (Service,
//! EndpointSlice, Node, ServiceCIDR), the privileged [`Env`] (topology, fake API server in the
//! node namespace, agent synced from it; its `Drop` removes them, agent first, even when an
//! assertion fails), reads of the pinned SERVICES map, and the agent's memory from /proc.
//! It may call proxy-testenv, proxy-common, aya and `super::common_netns` (the request loops);
//! nothing in the agent crate.

#![allow(
    dead_code,
    reason = "each test binary uses a different part of the helpers"
)]

pub mod deployed;

use std::{
    collections::BTreeMap,
    net::Ipv4Addr,
    path::Path,
    thread,
    time::{Duration, Instant},
};

use aya::maps::{HashMap as BpfHashMap, Map, MapData};
use proxy_common::{MAP_SERVICES, ServiceKey, ServiceValue, proto};
use proxy_testenv::{Agent, BACKENDS, FakeApiServer, PinDir, Topology};
use serde_json::{Value, json};

pub const BIN: &str = env!("CARGO_BIN_EXE_kube-proxy-ebpf");
pub const NODE: &str = "node-1";

// ---------------------------------------------------------------------------------------------
// Objects

pub fn service(name: &str, vip: Ipv4Addr, port: u16) -> Value {
    json!({"apiVersion": "v1", "kind": "Service",
           "metadata": {"name": name, "namespace": "demo",
                        "annotations": {"kubectl.kubernetes.io/last-applied-configuration": "{}"},
                        "managedFields": [{"manager": "kubectl", "operation": "Apply"}]},
           "spec": {"type": "ClusterIP", "clusterIP": vip.to_string(), "clusterIPs": [vip.to_string()],
                    "selector": {"app": name},
                    "ports": [{"name": "http", "port": port, "protocol": "TCP", "targetPort": 8080}]}})
}

/// Endpoint conditions.
#[derive(Clone, Copy)]
pub enum Cond {
    Ready,
    /// Terminating but still serving (the fallback when nothing is ready).
    TerminatingServing,
    /// Neither ready nor serving (a failing readiness probe): never chosen for a new flow; its
    /// established TCP flows go on.
    NotReady,
}

pub fn slice(service: &str, suffix: &str, endpoints: &[(Ipv4Addr, Cond)]) -> Value {
    let eps: Vec<Value> = endpoints
        .iter()
        .map(|(ip, c)| {
            let conditions = match c {
                Cond::Ready => json!({"ready": true, "serving": true, "terminating": false}),
                Cond::TerminatingServing => {
                    json!({"ready": false, "serving": true, "terminating": true})
                }
                Cond::NotReady => json!({"ready": false, "serving": false, "terminating": false}),
            };
            json!({"addresses": [ip.to_string()], "conditions": conditions, "nodeName": NODE,
                   "targetRef": {"kind": "Pod", "namespace": "demo", "name": format!("{service}-{ip}")}})
        })
        .collect();
    json!({"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice", "addressType": "IPv4",
           "metadata": {"name": format!("{service}-{suffix}"), "namespace": "demo",
                        "labels": {"kubernetes.io/service-name": service,
                                   "endpointslice.kubernetes.io/managed-by": "endpointslice-controller.k8s.io"}},
           "endpoints": eps,
           "ports": [{"name": "http", "port": 8080, "protocol": "TCP"}]})
}

pub fn node(zone: &str) -> Value {
    json!({"apiVersion": "v1", "kind": "Node",
           "metadata": {"name": NODE, "labels": {"topology.kubernetes.io/zone": zone}},
           "status": {"addresses": [{"type": "InternalIP", "address": "192.0.2.1"}]}})
}

pub fn service_cidr(name: &str, cidr: &str) -> Value {
    json!({"apiVersion": "networking.k8s.io/v1", "kind": "ServiceCIDR",
           "metadata": {"name": name}, "spec": {"cidrs": [cidr, "fd00:10:96::/112"]}})
}

pub fn ready(ips: &[Ipv4Addr]) -> Vec<(Ipv4Addr, Cond)> {
    ips.iter().map(|ip| (*ip, Cond::Ready)).collect()
}

pub fn backend_ips() -> Vec<Ipv4Addr> {
    BACKENDS.iter().map(|(_, ip)| *ip).collect()
}

// ---------------------------------------------------------------------------------------------
// Privileged: the agent in the node namespace, synced from the fake API server

/// The count of the frontend `vip:port/TCP` in the pinned SERVICES map (None: absent).
pub fn frontend_count(
    services: &BpfHashMap<MapData, ServiceKey, ServiceValue>,
    vip: Ipv4Addr,
    port: u16,
) -> Option<u16> {
    let key = ServiceKey::new(vip.octets(), port.to_be_bytes(), proto::TCP, 0);
    services.get(&key, 0).ok().map(|v| v.count)
}

pub fn open_services(pin_dir: &Path) -> BpfHashMap<MapData, ServiceKey, ServiceValue> {
    let data = MapData::from_pin(pin_dir.join(MAP_SERVICES)).expect("pinned SERVICES map");
    BpfHashMap::try_from(Map::HashMap(data)).expect("SERVICES is a hash map")
}

/// Field order is drop order: agent, then API server, pins, namespaces.
pub struct Env {
    pub agent: Agent,
    pub api: FakeApiServer,
    pub pins: PinDir,
    pub topo: Topology,
}

impl Env {
    /// Topology, fake API server in the node namespace with `objects`, agent synced from it and
    /// attached to every pod.
    pub fn start(objects: Vec<Value>) -> Self {
        proxy_testenv::ensure_bpffs().expect("bpffs at /sys/fs/bpf");
        let topo = Topology::new().expect("creating the topology");
        let api = FakeApiServer::start_in(Some(&topo.node().path())).expect("fake API server");
        api.apply(node("zone-a")).expect("node");
        api.apply_all(objects).expect("objects");
        let kubeconfig = api
            .write_kubeconfig(&topo.tmp().path().join("kubeconfig"))
            .expect("kubeconfig");
        let pins = PinDir::new(&format!("{}-pins", topo.prefix())).expect("pin dir");
        let mut agent = Agent::start_kube(
            Path::new(BIN),
            topo.node(),
            &kubeconfig,
            &["--hostname-override", NODE],
            pins.path(),
            topo.tmp().path(),
        )
        .expect("starting the agent");
        agent
            .wait_attached(&topo.pod_interfaces())
            .unwrap_or_else(|e| panic!("{e:#}"));
        Self {
            agent,
            api,
            pins,
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

    /// Waits until the pinned map's frontend `vip:80` has `count` slots (None: absent).
    pub fn wait_frontend(&self, vip: Ipv4Addr, count: Option<u16>, timeout: Duration) -> Duration {
        let services = open_services(self.pins.path());
        let started = Instant::now();
        loop {
            let now = frontend_count(&services, vip, 80);
            if now == count {
                return started.elapsed();
            }
            if started.elapsed() > timeout {
                self.fail(&format!(
                    "frontend {vip}:80 has {now:?} slots after {timeout:?}, want {count:?}"
                ));
            }
            thread::sleep(Duration::from_millis(5));
        }
    }

    /// `n` requests to http://vip/; all must succeed from the VIP. Counts per backend name.
    pub fn distribution(&self, vip: Ipv4Addr, n: usize) -> BTreeMap<String, usize> {
        super::common_netns::distribution(&self.topo, &self.agent, "client", vip.into(), 80, n)
    }

    pub fn names(counts: &BTreeMap<String, usize>) -> Vec<&str> {
        counts.keys().map(String::as_str).collect()
    }
}

// ---------------------------------------------------------------------------------------------
// Memory and scale fixtures

pub fn rss_kib(pid: u32) -> u64 {
    status_kib(pid, "VmRSS:")
}

/// A `/proc/PID/status` field in KiB (0 when unreadable).
pub fn status_kib(pid: u32, key: &str) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix(key))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap_or(0)
}

pub fn scale_vip(i: usize) -> Ipv4Addr {
    let i = u32::try_from(i).expect("index");
    Ipv4Addr::from(u32::from(Ipv4Addr::new(10, 100, 0, 0)) + i)
}

pub fn scale_endpoints(i: usize, n: usize) -> Vec<(Ipv4Addr, Cond)> {
    let base = u32::from(Ipv4Addr::new(10, 128, 0, 0)) + u32::try_from(i * 16).expect("index");
    (0..n)
        .map(|j| (Ipv4Addr::from(base + j as u32), Cond::Ready))
        .collect()
}
