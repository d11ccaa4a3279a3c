//! Privileged: the agent (standalone, manifest source) programs dual-stack Services on both
//! families. Asserted on the pinned maps it writes: SERVICES6_V1 / BACKENDS6_V1 carry the IPv6
//! frontends (ClusterIP and the NodePort on the node's IPv6 address) with the IPv6 slices'
//! endpoints only, SERVICES_V1 / BACKENDS_V1 the IPv4 ones; a dual-stack Service with IPv4
//! slices only has an IPv6 frontend without backends (rejected, as upstream); both families'
//! backend ids are disjoint; a restarted agent adopts the IPv6 maps (nothing rewritten).
//!
//! Run by `sudo cargo xtask test` (KPE_PRIVILEGED=1); skipped otherwise. The node namespace
//! gets an IPv6 address (on its own loopback device).

use std::{collections::BTreeMap, path::Path, time::Duration};

use kube_proxy_ebpf::{
    dataplane::{bpffs::PinLayout, maps::ServiceMaps},
    pipeline::{encode, programmed::Programmed},
};
use proxy_testenv::{Agent, ManifestDir, PinDir, Topology, require_privileged};

const BIN: &str = env!("CARGO_BIN_EXE_kube-proxy-ebpf");

const DUAL: &str = r#"
apiVersion: v1
kind: Service
metadata: {name: dual, namespace: demo}
spec:
  type: NodePort
  clusterIP: 10.96.0.10
  clusterIPs: [10.96.0.10, "fd00:96::10"]
  ipFamilies: [IPv4, IPv6]
  ipFamilyPolicy: RequireDualStack
  ports: [{name: http, port: 80, targetPort: 8080, nodePort: 30080}]
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: dual-4, namespace: demo, labels: {kubernetes.io/service-name: dual}}
addressType: IPv4
ports: [{name: http, port: 8080, protocol: TCP}]
endpoints: [{addresses: [10.244.1.11]}, {addresses: [10.244.1.12]}]
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: dual-6, namespace: demo, labels: {kubernetes.io/service-name: dual}}
addressType: IPv6
ports: [{name: http, port: 8080, protocol: TCP}]
endpoints: [{addresses: ["fd00:244::11"]}]
---
apiVersion: v1
kind: Service
metadata: {name: only4, namespace: demo}
spec:
  clusterIP: 10.96.0.20
  clusterIPs: [10.96.0.20, "fd00:96::20"]
  ipFamilies: [IPv4, IPv6]
  ports: [{name: http, port: 80, targetPort: 8080}]
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: only4-4, namespace: demo, labels: {kubernetes.io/service-name: only4}}
addressType: IPv4
ports: [{name: http, port: 8080, protocol: TCP}]
endpoints: [{addresses: [10.244.1.21]}]
---
apiVersion: v1
kind: Service
metadata: {name: lb, namespace: demo}
spec:
  type: LoadBalancer
  clusterIP: "fd00:96::30"
  ipFamilies: [IPv6]
  loadBalancerSourceRanges: ["2001:db8:7::/48", 10.0.0.0/8]
  ports: [{name: http, port: 80, targetPort: 8080, nodePort: 30090}]
status:
  loadBalancer: {ingress: [{ip: "2001:db8:70::30"}]}
"#;

/// Frontend → (kind-free) "addr:port/proto" of its slots' backends, decoded from a shadow
/// read back from the pinned maps.
fn carried<A: encode::FamilyAbi>(p: &Programmed<A>) -> BTreeMap<String, Vec<String>> {
    p.services
        .frontends()
        .map(|(key, v)| {
            let (frontend, _) = encode::decode_service_key(key).expect("a key the agent writes");
            let backends = (1..=v.count)
                .map(|s| {
                    let slot = p
                        .services
                        .get(&encode::SlotKey::with_slot(*key, s))
                        .expect("slot");
                    let b = p.backends.get(&slot.backend_id).expect("backend");
                    encode::decode_endpoint(b).expect("endpoint").to_string()
                })
                .collect();
            (frontend.to_string(), backends)
        })
        .collect()
}

#[test]
fn the_agent_programs_both_families_of_a_dual_stack_service() {
    require_privileged!();
    proxy_testenv::ensure_bpffs().expect("bpffs at /sys/fs/bpf");
    let topo = Topology::new().expect("creating the topology");
    // The node's IPv6 address (NodePorts answer on it), inside the node namespace.
    topo.node()
        .exec(&["ip", "-6", "addr", "add", "fd00:50::10/128", "dev", "lo"])
        .expect("node IPv6 address");
    let manifests = ManifestDir::new().expect("manifest dir");
    std::fs::write(manifests.path().join("dual.yaml"), DUAL).expect("writing the manifests");
    let pins = PinDir::new(&format!("{}-pins", topo.prefix())).expect("pin dir");
    let args = ["--manifests".as_ref(), manifests.path().as_os_str()];
    let mut agent = Agent::start_with(
        Path::new(BIN),
        topo.node(),
        &args,
        pins.path(),
        topo.tmp().path(),
    )
    .expect("starting the agent");
    if let Err(e) = agent.wait_synced(1, Duration::from_secs(30)) {
        agent.fail(&format!("{e:#}"));
    }

    let layout = PinLayout::new(pins.path());
    let read = || {
        let maps = ServiceMaps::open_pinned(&layout).expect("pinned IPv4 maps");
        let maps6 = maps.ipv6(None, Some(&layout)).expect("pinned IPv6 maps");
        (
            maps.read_programmed().expect("read IPv4"),
            maps6.read_programmed().expect("read IPv6"),
        )
    };
    let (p4, p6) = read();
    let list = |v: &[&str]| v.iter().map(|s| s.to_string()).collect::<Vec<_>>();
    let want6 = BTreeMap::from([
        (
            "fd00:50::10:30080/TCP".to_owned(),
            list(&["fd00:244::11:8080/TCP"]),
        ),
        (
            "fd00:96::10:80/TCP".to_owned(),
            list(&["fd00:244::11:8080/TCP"]),
        ),
        ("fd00:96::20:80/TCP".to_owned(), list(&[])),
        ("fd00:50::10:30090/TCP".to_owned(), list(&[])),
        ("fd00:96::30:80/TCP".to_owned(), list(&[])),
        ("2001:db8:70::30:80/TCP".to_owned(), list(&[])),
    ]);
    let all6 = carried(&p6);
    // NodePorts answer on every IPv6 address of the node (the topology may give it others):
    // each with the Service's IPv6 backends; the one the test added is compared below.
    let node_port = |k: &str| k.ends_with(":30080/TCP") || k.ends_with(":30090/TCP");
    for (k, backends) in all6.iter().filter(|(k, _)| node_port(k)) {
        let twin = if k.ends_with(":30080/TCP") {
            "fd00:50::10:30080/TCP"
        } else {
            "fd00:50::10:30090/TCP"
        };
        agent.check(want6.get(twin) == Some(backends), || {
            format!("{k}: {backends:?}")
        });
    }
    let got6: BTreeMap<String, Vec<String>> = (all6.into_iter())
        .filter(|(k, _)| !node_port(k) || k.starts_with("fd00:50::10:"))
        .collect();
    agent.check(got6 == want6, || {
        format!("SERVICES6_V1 carries {got6:#?}, want {want6:#?}")
    });
    let got4 = carried(&p4);
    agent.check(
        got4.get("10.96.0.10:80/TCP")
            == Some(&list(&["10.244.1.11:8080/TCP", "10.244.1.12:8080/TCP"]))
            && got4.get("10.96.0.20:80/TCP") == Some(&list(&["10.244.1.21:8080/TCP"]))
            && !got4.keys().any(|k| k.starts_with("fd00")),
        || format!("SERVICES_V1 carries {got4:#?}"),
    );
    let (ids4, ids6) = (p4.shared_ids(), p6.shared_ids());
    agent.check(ids4.backends.is_disjoint(&ids6.backends), || {
        format!("backend ids in both families: {ids4:?} {ids6:?}")
    });
    // The NodePort frontend is an external one on IPv6 too.
    let np = (p6.services.frontends())
        .find(|(k, _)| encode::decode_service_key(*k).is_some_and(|(f, _)| f.port == 30080))
        .map(|(_, v)| v);
    agent.check(
        np.is_some_and(|v| v.flags & proxy_common::service_flags::EXTERNAL != 0),
        || format!("IPv6 NodePort frontend {np:?}"),
    );

    // The IPv6 LoadBalancer IP's source range is in SRCRANGES6_V1 (the IPv4 one is not IPv6's).
    let trie = aya::maps::MapData::from_pin(layout.map(proxy_common::ipv6::MAP_SOURCE_RANGES6))
        .expect("pinned SRCRANGES6_V1");
    let trie: aya::maps::LpmTrie<_, proxy_common::ipv6::SourceRange6Key, u32> =
        aya::maps::LpmTrie::try_from(aya::maps::Map::LpmTrie(trie)).expect("an LPM trie");
    let ranges: Vec<(u32, [u8; 16], [u8; 16])> = (trie.keys())
        .filter_map(Result::ok)
        .map(|k| (k.prefix_len(), k.data().frontend_addr, k.data().source))
        .collect();
    let lb: std::net::Ipv6Addr = "2001:db8:70::30".parse().unwrap();
    let source: std::net::Ipv6Addr = "2001:db8:7::".parse().unwrap();
    agent.check(
        ranges
            == [(
                proxy_common::ipv6::SOURCE_RANGE6_FRONTEND_BITS + 48,
                lb.octets(),
                source.octets(),
            )],
        || format!("SRCRANGES6_V1 holds {ranges:?}"),
    );

    // A restart adopts both families as they are: the maps read back the same.
    agent.restart().expect("restarting the agent");
    if let Err(e) = agent.wait_synced(1, Duration::from_secs(30)) {
        agent.fail(&format!("{e:#}"));
    }
    let (q4, q6) = read();
    agent.check(q6 == p6 && q4 == p4, || {
        "the restarted agent rewrote the maps".to_owned()
    });
    agent.stop().expect("stopping the agent");
}

/// `--ipv6-maps auto` on a node without IPv6: every IPv6 hash and LRU map is created with one
/// entry (nothing preallocated for a family the node does not carry) and the IPv4 family is
/// programmed as always. The node then gets an IPv6 address: the IPv6 family starts on the
/// one-entry maps, and what does not fit is reported like a full IPv4 map (status `problems`,
/// a `skipped: ... SERVICES6 map full` line). A restart sizes the maps (the one-entry pins
/// replaced) and programs every IPv6 frontend.
#[test]
fn an_ipv4_only_node_gets_one_entry_ipv6_maps_and_a_restart_with_ipv6_sizes_them() {
    require_privileged!();
    use proxy_common::ipv6;
    proxy_testenv::ensure_bpffs().expect("bpffs at /sys/fs/bpf");
    let topo = Topology::new().expect("creating the topology");
    // An IPv4-only node: the topology's IPv6 node address removed (link-local ones stay).
    topo.node()
        .exec(&["ip", "-6", "addr", "flush", "scope", "global"])
        .expect("removing the node's IPv6 addresses");
    let manifests = ManifestDir::new().expect("manifest dir");
    std::fs::write(manifests.path().join("dual.yaml"), DUAL).expect("writing the manifests");
    let pins = PinDir::new(&format!("{}-pins", topo.prefix())).expect("pin dir");
    let args = ["--manifests".as_ref(), manifests.path().as_os_str()];
    let mut agent = Agent::start_with(
        Path::new(BIN),
        topo.node(),
        &args,
        pins.path(),
        topo.tmp().path(),
    )
    .expect("starting the agent");
    let first = agent
        .wait_synced(1, Duration::from_secs(30))
        .unwrap_or_else(|e| agent.fail(&format!("{e:#}")));
    let layout = PinLayout::new(pins.path());
    let entries = |name: &str| {
        aya::maps::MapData::from_pin(layout.map(name))
            .and_then(|m| m.info())
            .map(|i| i.max_entries())
            .expect("pinned map info")
    };
    let six = [
        ipv6::MAP_SERVICES6,
        ipv6::MAP_BACKENDS6,
        ipv6::MAP_REVNAT6,
        ipv6::MAP_AFFINITY_MATCH6,
        ipv6::MAP_CONNTRACK6,
        ipv6::MAP_SNAT6,
        ipv6::MAP_AFFINITY6,
        ipv6::MAP_SOCK_REVNAT6,
        ipv6::MAP_FRAGMENTS6,
    ];
    let sizes: Vec<(&str, u32)> = six.iter().map(|n| (*n, entries(n))).collect();
    agent.check(sizes.iter().all(|(_, n)| *n == 1), || {
        format!("a node without IPv6: IPv6 maps {sizes:?}, want one entry each")
    });
    let read = || {
        let maps = ServiceMaps::open_pinned(&layout).expect("pinned IPv4 maps");
        let maps6 = maps.ipv6(None, Some(&layout)).expect("pinned IPv6 maps");
        (
            carried(&maps.read_programmed().expect("read IPv4")),
            carried(&maps6.read_programmed().expect("read IPv6")),
        )
    };
    let (got4, got6) = read();
    agent.check(
        got4.get("10.96.0.10:80/TCP").map(Vec::len) == Some(2) && got6.is_empty(),
        || format!("IPv4 {got4:#?}, IPv6 {got6:#?}"),
    );
    agent.check(first.problems == 0, || format!("status {first:?}"));

    // IPv6 arrives: the family runs on the one-entry maps and reports what does not fit.
    topo.node()
        .exec(&["ip", "-6", "addr", "add", "fd00:50::10/128", "dev", "lo"])
        .expect("node IPv6 address");
    if let Err(e) = agent.wait_status(Duration::from_secs(30), |s| s.problems > 0) {
        agent.fail(&format!(
            "no problem reported for the full IPv6 maps: {e:#}"
        ));
    }
    // The whole log (the agent's, in the work directory given to `Agent::start_with`).
    let log = std::fs::read_to_string(topo.tmp().path().join("agent.log")).expect("agent log");
    agent.check(
        log.contains("skipped: ") && log.contains("SERVICES6 map full"),
        || "no `SERVICES6 map full` line".to_owned(),
    );
    agent.check(
        log.contains("the IPv6 maps were created with one entry each"),
        || "no warning about the one-entry IPv6 maps".to_owned(),
    );
    // The IPv6 programs: not loaded at start (IPv6 passed untouched), loaded once it came.
    let loads: Vec<&str> = (log.lines())
        .filter(|l| l.contains("programs loaded"))
        .collect();
    agent.check(
        loads.len() == 2 && !loads[0].contains("Ipv6") && loads[1].contains("verified=[Ipv6]"),
        || format!("program loads: {loads:#?}"),
    );

    // A restart sizes them (new maps: the programs are verified again) and programs every IPv6
    // frontend.
    agent.restart().expect("restarting the agent");
    let status = agent
        .wait_synced(1, Duration::from_secs(30))
        .unwrap_or_else(|e| agent.fail(&format!("{e:#}")));
    let sizes: Vec<(&str, u32)> = six.iter().map(|n| (*n, entries(n))).collect();
    agent.check(
        sizes.iter().all(|(_, n)| *n > 1)
            && entries(ipv6::MAP_SERVICES6) == ipv6::SERVICES6_CAPACITY,
        || format!("after a restart with IPv6: {sizes:?}"),
    );
    let (got4, got6) = read();
    agent.check(
        got6.get("fd00:96::10:80/TCP") == Some(&vec!["fd00:244::11:8080/TCP".to_owned()])
            && got6.get("fd00:50::10:30080/TCP") == Some(&vec!["fd00:244::11:8080/TCP".to_owned()])
            && got4.get("10.96.0.10:80/TCP").map(Vec::len) == Some(2),
        || format!("IPv4 {got4:#?}, IPv6 {got6:#?}"),
    );
    agent.check(status.problems == 0, || format!("status {status:?}"));
    agent.stop().expect("stopping the agent");
}
