//! `cargo xtask demo`: the agent standalone on deploy/examples in a two-node topology of network
//! namespaces ([`MultiNode`]: node-a with the client and backend pods, node-b with none, a wire and
//! an external client), with traffic through each example Service: ClusterIPs from the client pod,
//! and `demo/web`'s NodePort from the external client through both nodes, then the same over IPv6
//! (`ipv6`: the dual-stack examples' IPv6 frontends, on a line of their own and only failing the
//! demo when that stage is strict). Needs root. Everything it creates is an RAII guard
//! (namespaces, processes, pin dirs), removed on exit or failure.

mod ipv6;

use std::{collections::BTreeMap, net::Ipv4Addr, path::Path, time::Duration};

use anyhow::{Context as _, Result, bail};
use proxy_testenv::{
    Agent, BACKENDS, CLIENT_IP, ConnectOutcome, EXT_CLIENT_IP, EXT_DEVICE, MultiNode, NODE_IPS,
    NODE_NAMES, PinDir,
};

use crate::util::{is_root, workspace_root};

const WEB: Ipv4Addr = Ipv4Addr::new(10, 96, 0, 10);
const ECHO: Ipv4Addr = Ipv4Addr::new(10, 96, 0, 20);
const EMPTY: Ipv4Addr = Ipv4Addr::new(10, 96, 0, 30);
const BULK: Ipv4Addr = Ipv4Addr::new(10, 96, 0, 40);
/// demo/web's `nodePort` in deploy/examples/services.yaml.
const WEB_NODE_PORT: u16 = 30080;
const HTTP_REQUESTS: usize = 300;
const UDP_REQUESTS: usize = 30;
/// node-a holds the client and every backend pod; node-b has no pods.
const NODE_A: usize = 0;
const NODE_B: usize = 1;

/// Answers per backend: (HTTP over the ClusterIP, UDP, NodePort, from a node's own process).
type Answered = BTreeMap<String, (usize, usize, usize, usize)>;

pub fn run() -> Result<()> {
    if !is_root() {
        bail!("cargo xtask demo needs root (eBPF load, network namespaces); run it with sudo");
    }
    crate::setup::run(false)?;
    let bin = crate::build_ebpf::run()?;
    proxy_testenv::ensure_bpffs()?;

    let manifests = manifests()?;
    eprintln!("\n==> topology");
    let mut net = MultiNode::new().context("creating the demo topology")?;
    net.node_mut(NODE_A).add_pod("client", CLIENT_IP)?;
    for (name, ip) in BACKENDS {
        net.add_backend(NODE_A, name, ip)?;
    }
    net.node_mut(NODE_A).start_iperf3_server("be1")?;
    let (a, b) = (net.node(NODE_A).prefix(), net.node(NODE_B).prefix());
    eprintln!(
        "node-a {a}-node ({} on {EXT_DEVICE}): pods {a}-{{client,be1,be2,be3}}, client \
         {CLIENT_IP}, backends 10.244.1.11-13\nnode-b {b}-node ({} on {EXT_DEVICE}): no pods\n\
         external client {a}-ext ({EXT_CLIENT_IP}) on the wire {a}-wire",
        NODE_IPS[NODE_A], NODE_IPS[NODE_B]
    );
    let pins = [NODE_A, NODE_B]
        .map(|i| PinDir::new(&format!("{}-demo", net.node(i).prefix())))
        .into_iter()
        .collect::<Result<Vec<_>>>()?;
    let mut agents = Vec::new();
    for i in [NODE_A, NODE_B] {
        agents.push(start_agent(&bin, &net, i, &manifests, pins[i].path())?);
    }
    let topo = net.node(NODE_A);

    let mut answered = Answered::new();
    let mut failed = 0usize;
    let mut requests = 0usize;

    eprintln!("\n==> {HTTP_REQUESTS} HTTP requests to http://{WEB}/ (demo/web)");
    for reply in topo.curl_many(&format!("http://{WEB}/"), HTTP_REQUESTS)? {
        requests += 1;
        match reply {
            Ok(r) if r.remote_ip == WEB.to_string() => answered.entry(r.body).or_default().0 += 1,
            Ok(r) => {
                failed += 1;
                eprintln!("reply from {} instead of the VIP {WEB}", r.remote_ip);
            }
            Err(e) => {
                failed += 1;
                eprintln!("request failed: {e}");
            }
        }
    }

    eprintln!("\n==> {UDP_REQUESTS} UDP datagrams to {ECHO}:53 (demo/echo)");
    for i in 0..UDP_REQUESTS {
        requests += 1;
        match topo.udp_request(ECHO, 53, &format!("ping{i}")) {
            Ok(r) if *r.from.ip() == ECHO && r.from.port() == 53 => {
                let backend = r.body.split(':').next().unwrap_or_default().to_owned();
                answered.entry(backend).or_default().1 += 1;
            }
            Ok(r) => {
                failed += 1;
                eprintln!("UDP reply from {} instead of {ECHO}:53", r.from);
            }
            Err(e) => {
                failed += 1;
                eprintln!("UDP request failed: {e:#}");
            }
        }
    }

    eprintln!(
        "\n==> NodePort {WEB_NODE_PORT} (demo/web) from the external client {EXT_CLIENT_IP}, \
         through each node"
    );
    for i in [NODE_A, NODE_B] {
        requests += 1;
        match nodeport_request(&net, i) {
            Ok(backend) => answered.entry(backend).or_default().2 += 1,
            Err(e) => {
                failed += 1;
                println!("nodeport via {}: FAILED: {e:#}", NODE_NAMES[i]);
            }
        }
    }

    eprintln!(
        "\n==> a process of node-b itself (host network: cgroup socket hooks, no tc hook on its \
         way out) to demo/web's ClusterIP and its NodePorts"
    );
    let host_b = agents[NODE_B].host(net.node(NODE_B).node());
    for (ip, port) in [
        (WEB, 80),
        (NODE_IPS[NODE_B], WEB_NODE_PORT),
        (NODE_IPS[NODE_A], WEB_NODE_PORT),
    ] {
        requests += 1;
        match proxy_testenv::http_get_with_peer(&host_b, ip, port) {
            Ok(v) if v.peer == format!("{ip}:{port}") => {
                println!(
                    "host: node-b process → {ip}:{port} → answered by {} (HTTP 200); \
                     getpeername() = {}, backend saw {}",
                    v.body, v.peer, v.client_addr
                );
                answered.entry(v.body).or_default().3 += 1;
            }
            Ok(v) => {
                failed += 1;
                println!("host: node-b process → {ip}:{port}: FAILED: peer {v:?}");
            }
            Err(e) => {
                failed += 1;
                println!("host: node-b process → {ip}:{port}: FAILED: {e:#}");
            }
        }
    }

    let strictness = ipv6::strictness(agents[NODE_A].pin_dir());
    eprintln!(
        "\n==> IPv6 ({}: {})",
        if strictness.strict {
            "strict"
        } else {
            "not strict"
        },
        strictness.why
    );
    let v6 = ipv6::run(&net, NODE_A, &host_b, strictness.strict);

    eprintln!("\n==> TCP connect to {EMPTY}:80 (demo/empty, no endpoints)");
    let (outcome, elapsed) = topo.tcp_connect(EMPTY, 80, Duration::from_secs(3))?;
    let verdict = match &outcome {
        ConnectOutcome::Refused => "refused (as kube-proxy does)".to_owned(),
        other => format!("{other:?} (expected: refused)"),
    };
    println!(
        "demo/empty {EMPTY}:80: {verdict} after {} ms",
        elapsed.as_millis()
    );

    eprintln!("\n==> iperf3 2 s through {BULK}:5201 (demo/bulk)");
    match topo.iperf3_client(BULK, 5201, 2).and_then(|run| run.wait()) {
        Ok(s) if s.success => println!(
            "demo/bulk {BULK}:5201: {:.2} Gbit/s over {:.1} s, {} retransmits",
            s.bits_per_second / 1e9,
            s.seconds,
            s.retransmits
        ),
        Ok(s) => println!("demo/bulk {BULK}:5201: iperf3 failed: {s:?}"),
        Err(e) => println!("demo/bulk {BULK}:5201: iperf3 failed: {e:#}"),
    }

    println!("\nper-backend distribution:");
    println!(
        "  {:<8} {:>15} {:>8} {:>6} {:>9} {:>5}",
        "backend", "address", "http", "udp", "nodeport", "host"
    );
    for (name, ip) in BACKENDS {
        let (http, udp, np, host) = answered.get(name).copied().unwrap_or_default();
        println!("  {name:<8} {ip:>15} {http:>8} {udp:>6} {np:>9} {host:>5}");
    }
    for (name, (http, udp, np, host)) in answered
        .iter()
        .filter(|(n, _)| !BACKENDS.iter().any(|(b, _)| b == n))
    {
        println!(
            "  {name:<8} {:>15} {http:>8} {udp:>6} {np:>9} {host:>5}",
            "?"
        );
    }

    let agent = &agents[NODE_A];
    let pin = agent.pin_dir().to_string_lossy().into_owned();
    println!("\nkube-proxy-ebpf dump services --pin-dir {pin} (node-a):");
    match agent.cli(&["dump", "services", "--pin-dir", &pin]) {
        Ok(out) => {
            print!("{}", String::from_utf8_lossy(&out.stdout));
            if !out.status.success() {
                println!(
                    "(dump failed: {})",
                    String::from_utf8_lossy(&out.stderr).trim()
                );
            }
        }
        Err(e) => println!("(dump failed: {e:#})"),
    }

    let backends = answered.len();
    if failed > 0 || (strictness.strict && v6.failed > 0) {
        for (agent, node) in agents.iter().zip(NODE_NAMES) {
            eprintln!("--- {node} agent log (tail) ---\n{}", agent.log_tail());
        }
    }
    for agent in &mut agents {
        agent.stop().context("stopping the agent")?;
        // Remove links and maps before the namespaces go (the guards would also do it).
        let pin = agent.pin_dir().to_string_lossy().into_owned();
        let cleanup = agent.cli(&["cleanup", "--pin-dir", &pin])?;
        if !cleanup.status.success() {
            eprintln!(
                "cleanup: {}",
                String::from_utf8_lossy(&cleanup.stderr).trim()
            );
        }
    }
    println!(
        "ipv6: {} requests, {} failed, backends {:?} ({}: {})",
        v6.requests,
        v6.failed,
        v6.answered,
        if strictness.strict {
            "strict"
        } else {
            "not strict, not counted"
        },
        strictness.why
    );
    println!("demo: {requests} requests, {backends} backends answered, {failed} failed");
    if failed > 0 || backends < 3 {
        bail!("demo failed: {failed} failed requests, {backends} backends answered (want 0 and 3)");
    }
    if strictness.strict && (v6.failed > 0 || v6.answered.len() < 3) {
        bail!(
            "demo failed over IPv6: {} failed requests, {} backends answered (want 0 and 3; \
             strict: {})",
            v6.failed,
            v6.answered.len(),
            strictness.why
        );
    }
    Ok(())
}

/// Starts the agent on node `i` (`--devices ext0 --hostname-override node-a|node-b`) and waits
/// until it has synced and attached to the node's pods and its external device.
fn start_agent(
    bin: &Path,
    net: &MultiNode,
    i: usize,
    manifests: &Path,
    pin_dir: &Path,
) -> Result<Agent> {
    let node = net.node(i);
    let name = NODE_NAMES[i];
    eprintln!(
        "\n==> agent on {name} (--manifests {})",
        manifests.display()
    );
    let args = [
        "--manifests".as_ref(),
        manifests.as_os_str(),
        "--devices".as_ref(),
        EXT_DEVICE.as_ref(),
        "--hostname-override".as_ref(),
        name.as_ref(),
        "--cluster-cidr".as_ref(),
        proxy_testenv::CLUSTER_CIDR.as_ref(),
    ];
    let mut agent = Agent::start_with(bin, node.node(), &args, pin_dir, node.tmp().path())?;
    // Interfaces are attached after the first sync: wait for the pods' veths and ext0.
    let mut want = node.pod_interfaces();
    want.push(EXT_DEVICE.to_owned());
    let status = agent
        .wait_attached(&want)
        .with_context(|| format!("agent on {name}; log tail:\n{}", agent.log_tail()))?;
    eprintln!(
        "agent synced: {} frontends, {} backends, {} problems",
        status.frontends, status.backends, status.problems
    );
    eprintln!("attached to {:?}", status.interfaces);
    Ok(agent)
}

/// One HTTP GET from the external client to demo/web's NodePort on node `i`; prints it and
/// returns the backend that answered. demo/web is externalTrafficPolicy Cluster, so like
/// kube-proxy each node masquerades the external client to its own address: node-a (which has
/// the endpoints) as well as node-b (which forwards to node-a).
fn nodeport_request(net: &MultiNode, i: usize) -> Result<String> {
    let node_ip = NODE_IPS[i];
    let url = format!("http://{node_ip}:{WEB_NODE_PORT}/");
    let r = net.http_get(&url)?;
    if r.code != 200 || !BACKENDS.iter().any(|(name, _)| *name == r.body) {
        bail!(
            "GET {url}: HTTP {} from {:?}, expected 200 from be1-3",
            r.code,
            r.body
        );
    }
    let seen = r.client_addr.split_once(':').map_or("", |(ip, _)| ip);
    let (want, why) = if i == NODE_A {
        (
            node_ip,
            "eTP=Cluster: SNAT to node-a, though the endpoint is local",
        )
    } else {
        (node_ip, "SNAT to node-b: endpoints on node-a only")
    };
    if seen != want.to_string() {
        bail!(
            "GET {url}: {} saw the client as {:?}, expected {want} ({why})",
            r.body,
            r.client_addr
        );
    }
    let on = if i == NODE_A { "" } else { " on node-a" };
    println!(
        "nodeport: external client {EXT_CLIENT_IP} → {node_ip}:{WEB_NODE_PORT} ({}) → answered by \
         {}{on} (HTTP {}); backend saw {} ({why})",
        NODE_NAMES[i], r.body, r.code, r.client_addr
    );
    Ok(r.body)
}

/// deploy/examples, which the demo runs on (demo/web's NodePort included).
fn manifests() -> Result<std::path::PathBuf> {
    let examples = workspace_root().join("deploy/examples");
    if !has_yaml(&examples) {
        bail!(
            "{} has no manifests: the demo runs the agent on them",
            examples.display()
        );
    }
    Ok(examples)
}

fn has_yaml(dir: &Path) -> bool {
    std::fs::read_dir(dir).is_ok_and(|entries| {
        entries.flatten().any(|e| {
            let name = e.file_name();
            let name = name.to_string_lossy();
            name.ends_with(".yaml") || name.ends_with(".yml")
        })
    })
}
