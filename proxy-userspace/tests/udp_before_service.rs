//! Privileged: UDP flows that began before their Service could serve them. Clients that keep one
//! socket on one source port (statsd, syslog, QUIC) send every 200 ms to a destination a moment
//! before it is a Service frontend: a pod to a ClusterIP and to a NodePort, the external client
//! to the NodePort, on IPv4 and IPv6. Their datagrams were tracked as direct flows (and, for the
//! NodePort, recorded by the node's own conntrack when the stack answered them). Once the
//! Service and its endpoint are programmed, each client is answered by the endpoint within a
//! second, on the same source port, as with kube-proxy. Also: a Service that rejected first
//! (no endpoints) serves once its endpoint appears, and on a fresh node a client that was
//! already sending to a ClusterIP when the agent started is answered right after the first sync.
//!
//! Run by `sudo cargo xtask test` (KPE_PRIVILEGED=1, one test thread); skipped otherwise.
//! Everything lives in network namespaces the test creates; RAII guards remove them.

mod common_netns;

use std::{
    net::{IpAddr, Ipv4Addr, Ipv6Addr},
    thread,
    time::Duration,
};

use common_netns::Cluster;
use kube_proxy_ebpf::dataplane::clock::monotonic_ns;
use proxy_testenv::{
    CLUSTER_CIDR_DUAL, MultiNode, NODE_IPS, NODE_IPS6, PINGER_PERIOD, PingReply, TempDir, UDP_PORT,
    UdpPinger, ipv6_of, require_privileged,
};

const NODE_A: usize = 0;
const A_WEB: Ipv4Addr = Ipv4Addr::new(10, 244, 1, 11);
const A_CLIENT: Ipv4Addr = Ipv4Addr::new(10, 244, 1, 21);
/// Programmed from the start: the fresh-node case.
const VIP_FRESH: Ipv4Addr = Ipv4Addr::new(10, 96, 7, 30);
/// Exists without endpoints at first.
const VIP_EMPTY: Ipv4Addr = Ipv4Addr::new(10, 96, 7, 20);
/// Created while its clients send.
const VIP_LATE: Ipv4Addr = Ipv4Addr::new(10, 96, 7, 10);
const VIP_LATE6: &str = "fd00:10:96::710";
const NODE_PORT: u16 = 30_053;
/// How long each client sends (count × 200 ms).
const PINGS: u32 = 40;
/// The bound: answered within this long after the sync that programmed the Service.
const WITHIN: Duration = Duration::from_secs(1);

fn slice(name: &str, service: &str, family: &str, addr: &str) -> String {
    format!(
        r#"
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {{name: {name}, namespace: demo, labels: {{kubernetes.io/service-name: {service}}}}}
addressType: {family}
ports: [{{name: dns, port: {UDP_PORT}, protocol: UDP}}]
endpoints: [{{addresses: ["{addr}"], conditions: {{ready: true}}, nodeName: node-a}}]
"#
    )
}

fn cluster_ip_service(name: &str, vip: Ipv4Addr) -> String {
    format!(
        r#"
apiVersion: v1
kind: Service
metadata: {{name: {name}, namespace: demo}}
spec:
  clusterIP: {vip}
  ports: [{{name: dns, port: 53, protocol: UDP, targetPort: {UDP_PORT}}}]
"#
    )
}

fn late_service() -> String {
    let v6 = ipv6_of(A_WEB);
    format!(
        r#"
apiVersion: v1
kind: Service
metadata: {{name: late, namespace: demo}}
spec:
  type: NodePort
  clusterIP: {VIP_LATE}
  clusterIPs: [{VIP_LATE}, "{VIP_LATE6}"]
  ipFamilies: [IPv4, IPv6]
  ipFamilyPolicy: RequireDualStack
  ports: [{{name: dns, port: 53, protocol: UDP, targetPort: {UDP_PORT}, nodePort: {NODE_PORT}}}]
{}{}"#,
        format_args!("---{}", slice("late-4", "late", "IPv4", &A_WEB.to_string())),
        format_args!("---{}", slice("late-6", "late", "IPv6", &v6.to_string())),
    )
}

/// When a pinger was first answered by the endpoint (`a-web`), CLOCK_MONOTONIC ns.
fn first_answer(replies: &[PingReply]) -> Option<u64> {
    replies
        .iter()
        .find(|r| r.body.starts_with("a-web:"))
        .map(|r| r.at_ns)
}

#[test]
fn udp_clients_that_sent_before_their_service_are_answered_once_it_is_programmed() {
    require_privileged!();
    let dir = TempDir::new("udp-before-svc").expect("temp dir");
    let mut net = MultiNode::new().expect("creating the two-node topology");
    net.add_backend(NODE_A, "a-web", A_WEB)
        .expect("backend a-web");
    net.add_backend(NODE_A, "a-cli", A_CLIENT)
        .expect("pod a-cli");
    // Node A's own conntrack on (any rule that uses it turns it on in a namespace), so the
    // datagrams its stack answers before the NodePort exists are recorded there.
    let node_a = net.node(NODE_A).node();
    for rule in [
        "add table inet kpe-test",
        "add chain inet kpe-test input { type filter hook input priority 0; }",
        "add rule inet kpe-test input ct state new counter",
    ] {
        let mut args = vec!["nft"];
        args.extend(rule.split(' '));
        node_a.exec(&args).expect("nft rule using conntrack");
    }
    // A fresh node: the client sends before any agent ran (no pins, nothing attached).
    let fresh = UdpPinger::start(
        net.node(NODE_A).pod("a-cli").expect("a-cli").ns(),
        dir.path(),
        "fresh",
        VIP_FRESH.into(),
        53,
        41_000,
        PINGS,
    )
    .expect("pinger");
    thread::sleep(Duration::from_millis(600));
    let mut env = Cluster::start_on(net, CLUSTER_CIDR_DUAL, |m| {
        let yaml = format!(
            "{}---{}---{}",
            cluster_ip_service("fresh", VIP_FRESH),
            slice("fresh-4", "fresh", "IPv4", &A_WEB.to_string()),
            cluster_ip_service("empty", VIP_EMPTY),
        );
        std::fs::write(m.path().join("first.yaml"), yaml).expect("writing manifests");
    });
    let first_synced = monotonic_ns();
    let pod = env.net.node(NODE_A).pod("a-cli").expect("a-cli").ns();
    let ext = env.net.client();

    // Clients of a Service that does not exist yet, and of one without endpoints.
    let late: Vec<(&str, &proxy_testenv::NetNs, IpAddr, u16, u16)> = vec![
        ("pod-clusterip", pod, VIP_LATE.into(), 53, 41_001),
        (
            "pod-nodeport",
            pod,
            NODE_IPS[NODE_A].into(),
            NODE_PORT,
            41_002,
        ),
        (
            "ext-nodeport",
            ext,
            NODE_IPS[NODE_A].into(),
            NODE_PORT,
            41_003,
        ),
        (
            "pod-clusterip6",
            pod,
            VIP_LATE6.parse::<Ipv6Addr>().unwrap().into(),
            53,
            41_004,
        ),
        (
            "ext-nodeport6",
            ext,
            NODE_IPS6[NODE_A].into(),
            NODE_PORT,
            41_005,
        ),
        ("pod-empty", pod, VIP_EMPTY.into(), 53, 41_006),
    ];
    let pingers: Vec<(&str, UdpPinger)> = late
        .iter()
        .map(|&(name, ns, dst, port, sport)| {
            let p = UdpPinger::start(ns, dir.path(), name, dst, port, sport, PINGS)
                .unwrap_or_else(|e| env.fail(&format!("pinger {name}: {e:#}")));
            (name, p)
        })
        .collect();
    // Long enough for each to be tracked (and for the NodePort ones answered by the stack).
    thread::sleep(PINGER_PERIOD * 10);
    for (name, p) in &pingers {
        let early: Vec<_> = p
            .replies()
            .into_iter()
            .filter(|r| r.body.starts_with("a-web:"))
            .collect();
        env.check(early.is_empty(), || {
            format!("{name} was answered before its Service existed: {early:?}")
        });
    }
    let direct_before = env.agents[NODE_A].counter("direct_flow").unwrap_or(0);

    let syncs_before = env.agents[NODE_A]
        .status()
        .ok()
        .flatten()
        .map_or(0, |s| s.syncs);
    let m = env.manifests();
    std::fs::write(m.path().join("late.yaml"), late_service()).expect("writing manifests");
    std::fs::write(
        m.path().join("empty-slice.yaml"),
        slice("empty-4", "empty", "IPv4", &A_WEB.to_string()),
    )
    .expect("writing manifests");
    // The agent's status is written after the sync's map writes.
    let synced = wait_synced_after(&env, syncs_before);

    let fresh_replies = fresh.finish(Duration::from_secs(20));
    let mut figures = Vec::new();
    match first_answer(&fresh_replies) {
        Some(at) => {
            let after = at.saturating_sub(first_synced);
            figures.push(format!("fresh: answered at most {after_ms} ms after the agent was up", after_ms = after / 1_000_000));
            env.check(at <= first_synced + WITHIN.as_nanos() as u64, || {
                format!("fresh node: first answer {} ms after the agent was up", after / 1_000_000)
            });
        }
        None => env.fail(&format!(
            "fresh node: the client already sending to {VIP_FRESH} was never answered: {fresh_replies:?}"
        )),
    }
    for (name, p) in pingers {
        let replies = p.finish(Duration::from_secs(20));
        let Some(at) = first_answer(&replies) else {
            env.fail(&format!(
                "{name}: never answered after its Service was programmed ({} replies: {replies:?})",
                replies.len()
            ))
        };
        let after_ms = at.saturating_sub(synced) / 1_000_000;
        figures.push(format!("{name}: {after_ms} ms"));
        env.check(at <= synced + WITHIN.as_nanos() as u64, || {
            format!("{name}: first answered {after_ms} ms after the sync")
        });
    }
    // The node's own conntrack entries toward the NodePort (recorded when its stack answered
    // the early datagrams) were deleted once the NodePort served, as kube-proxy does.
    if let Err(e) = env.agents[NODE_A].wait_log(
        &["deleted the kernel's UDP conntrack entries toward frontends that opened"],
        Duration::from_secs(5),
    ) {
        env.fail(&format!(
            "node A's conntrack entries toward the NodePort: {e:#}"
        ));
    }
    let became = env.agents[NODE_A]
        .counter("direct_became_frontend")
        .unwrap_or(0);
    eprintln!(
        "udp before service: direct flows before {direct_before}, re-decided {became}; first answers after the sync: {}",
        figures.join(", ")
    );
    env.check(became >= 1, || {
        "no direct flow was re-decided: the clients' flows were never tracked as direct".into()
    });
}

/// Waits until node A's agent finished a sync after `before` syncs, returning when (monotonic ns).
fn wait_synced_after(env: &Cluster, before: u64) -> u64 {
    let started = std::time::Instant::now();
    loop {
        let syncs = env.agents[NODE_A]
            .status()
            .ok()
            .flatten()
            .map_or(0, |s| s.syncs);
        if syncs > before {
            return monotonic_ns();
        }
        if started.elapsed() > Duration::from_secs(10) {
            env.fail("node A's agent did not sync the new Service within 10 s");
        }
        thread::sleep(Duration::from_millis(5));
    }
}
