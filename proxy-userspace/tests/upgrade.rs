//! Privileged upgrade tests (issue 13, item 1): the previous release's agent
//! (`proxy_testenv::prev_release`, built from a pinned earlier commit) runs on both nodes of the
//! two-node topology with traffic flowing; each node is upgraded in place to this build (the old
//! agent SIGTERMed, the new one started on the same pins, as a DaemonSet rolls), then rolled back
//! the same way. Also the pin directory's layout marker: an older layout's maps migrated, a
//! newer one refused.
//!
//! Run by `sudo cargo xtask test` (sets KPE_PRIVILEGED=1, one test thread; its
//! `previous release (fixture)` step builds the fixture first); skipped otherwise. Everything
//! lives in network namespaces, pin dirs and manifest dirs the test creates; RAII guards remove
//! them (agents first) even when an assertion fails.

mod common_netns;

use std::{
    net::Ipv4Addr,
    path::{Path, PathBuf},
    sync::{
        Mutex,
        atomic::{AtomicBool, AtomicUsize, Ordering},
    },
    thread,
    time::{Duration, Instant},
};

use common_netns::BIN;
use kube_proxy_ebpf::dataplane::{
    bpffs::PinLayout,
    layout::{self, Marker, Migration, Migrator, Verdict},
};
use proxy_testenv::{
    Agent, CLUSTER_CIDR, EXT_DEVICE, ManifestDir, MultiNode, NODE_IPS, NODE_NAMES, PinDir, Proc,
    require_privileged,
};

const NODE_A: usize = 0;
const NODE_B: usize = 1;
/// Backends, on node B: every flow through node A crosses the wire (NodePort flows are SNATed).
const B_WEB: Ipv4Addr = Ipv4Addr::new(10, 244, 2, 11);
const B_TWO: Ipv4Addr = Ipv4Addr::new(10, 244, 2, 12);
/// The in-cluster client, on node A.
const A_CLI: Ipv4Addr = Ipv4Addr::new(10, 244, 1, 21);
const WEB: Ipv4Addr = Ipv4Addr::new(10, 96, 5, 10);
const WEB_NODEPORT: u16 = 30_080;
const STREAM: Ipv4Addr = Ipv4Addr::new(10, 96, 5, 20);
/// The stream through the ClusterIP (from a-cli) and the one through the NodePort (from the
/// external client), each to its own server in b-web.
const STREAM_CIP_PORT: u16 = 9000;
const STREAM_NP_PORT: u16 = 9001;
const STREAM_NODEPORT: u16 = 30_901;
const STICKY: Ipv4Addr = Ipv4Addr::new(10, 96, 5, 30);

/// How long an agent may take to its first sync here: two debug agents (the previous release's
/// and this one) start and swap on a 2-core machine that CI may share; a bound, never a figure.
const FIRST_SYNC_BOUND: Duration = Duration::from_secs(90);

/// web (NodePort, both backends), stream (its two ports, b-web only), sticky (ClientIP
/// affinity, both backends).
fn manifests_yaml() -> String {
    let slice = |name: &str, ports: &str, endpoints: &[Ipv4Addr]| {
        let mut y = format!(
            "---\napiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata:\n  name: {name}-1\n  \
             namespace: demo\n  labels:\n    kubernetes.io/service-name: {name}\naddressType: IPv4\n\
             ports:\n{ports}endpoints:\n"
        );
        for ip in endpoints {
            y.push_str(&format!(
                "  - addresses: [\"{ip}\"]\n    nodeName: {}\n    conditions: {{ready: true, serving: true, terminating: false}}\n",
                NODE_NAMES[NODE_B]
            ));
        }
        y
    };
    let http = "  - {name: http, port: 8080, protocol: TCP}\n";
    let mut y = format!(
        "apiVersion: v1\nkind: Service\nmetadata:\n  name: web\n  namespace: demo\nspec:\n  \
         type: NodePort\n  clusterIP: {WEB}\n  ports:\n  \
         - {{name: http, port: 80, targetPort: 8080, nodePort: {WEB_NODEPORT}, protocol: TCP}}\n"
    );
    y.push_str(&slice("web", http, &[B_WEB, B_TWO]));
    y.push_str(&format!(
        "---\napiVersion: v1\nkind: Service\nmetadata:\n  name: stream\n  namespace: demo\nspec:\n  \
         type: NodePort\n  clusterIP: {STREAM}\n  ports:\n  \
         - {{name: cip, port: {STREAM_CIP_PORT}, targetPort: {STREAM_CIP_PORT}, protocol: TCP}}\n  \
         - {{name: np, port: {STREAM_NP_PORT}, targetPort: {STREAM_NP_PORT}, nodePort: {STREAM_NODEPORT}, protocol: TCP}}\n"
    ));
    y.push_str(&slice(
        "stream",
        &format!(
            "  - {{name: cip, port: {STREAM_CIP_PORT}, protocol: TCP}}\n  - {{name: np, port: {STREAM_NP_PORT}, protocol: TCP}}\n"
        ),
        &[B_WEB],
    ));
    y.push_str(&format!(
        "---\napiVersion: v1\nkind: Service\nmetadata:\n  name: sticky\n  namespace: demo\nspec:\n  \
         clusterIP: {STICKY}\n  sessionAffinity: ClientIP\n  \
         sessionAffinityConfig: {{clientIP: {{timeoutSeconds: 600}}}}\n  ports:\n  \
         - {{name: http, port: 80, targetPort: 8080, protocol: TCP}}\n"
    ));
    y.push_str(&slice("sticky", http, &[B_WEB, B_TWO]));
    y
}

/// Sends a 251-periodic byte pattern to its one client, paced (16 KiB every 5 ms), until the
/// stop file exists (at most 180 s), then closes; prints the peer and the bytes sent. Args:
/// port, ready file, stop file.
const STREAM_SERVER_PY: &str = r#"
import os, socket, sys, time
port, ready, stop = int(sys.argv[1]), sys.argv[2], sys.argv[3]
ls = socket.socket()
ls.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
ls.bind(("0.0.0.0", port))
ls.listen(1)
open(ready, "w").write("ready\n")
conn, peer = ls.accept()
chunk = bytes(i % 251 for i in range(251 * 64))
sent, end = 0, time.monotonic() + 180
while time.monotonic() < end and not os.path.exists(stop):
    conn.sendall(chunk)
    sent += len(chunk)
    time.sleep(0.005)
conn.shutdown(socket.SHUT_WR)
conn.recv(1)
print("peer %s:%d sent %d" % (peer[0], peer[1], sent), flush=True)
"#;

/// Connects, prints its own address, receives until EOF checking every byte against the
/// pattern; prints one JSON line. Args: ip, port.
const STREAM_CLIENT_PY: &str = r#"
import json, socket, sys, time
s = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=5)
print("local %s:%d" % s.getsockname(), flush=True)
s.settimeout(10)
big = bytes(i % 251 for i in range(251 * 300))
total, gap, last, bad, err, eof = 0, 0.0, time.monotonic(), None, None, False
try:
    while True:
        data = s.recv(65536)
        now = time.monotonic()
        gap, last = max(gap, now - last), now
        if not data:
            eof = True
            break
        o = total % 251
        if bad is None and data != big[o:o + len(data)]:
            bad = total + next(j for j in range(len(data)) if data[j] != big[o + j])
        total += len(data)
except Exception as e:
    err = repr(e)
s.close()
print(json.dumps({"bytes": total, "max_gap_ms": int(gap * 1000), "mismatch": bad, "error": err, "eof": eof}), flush=True)
"#;

/// Both nodes running an agent binary of the test's choice on shared manifests. Field order is
/// drop order: agents first, then pins, manifests, namespaces. The agents are behind a lock so
/// the request loop's thread can share the topology while a node rolls.
struct Nodes {
    agents: Mutex<Vec<Agent>>,
    pins: Vec<PinDir>,
    _manifests: ManifestDir,
    net: MultiNode,
}

impl Nodes {
    fn start(bin: &Path) -> Self {
        proxy_testenv::ensure_bpffs().expect("bpffs at /sys/fs/bpf");
        let mut net = MultiNode::new().expect("creating the two-node topology");
        net.add_backend(NODE_B, "b-web", B_WEB).expect("b-web");
        net.add_backend(NODE_B, "b-two", B_TWO).expect("b-two");
        net.add_backend(NODE_A, "a-cli", A_CLI).expect("a-cli");
        let manifests = ManifestDir::new().expect("manifest dir");
        std::fs::write(manifests.path().join("services.yaml"), manifests_yaml())
            .expect("writing manifests");
        let mut agents = Vec::new();
        let mut pins = Vec::new();
        for (i, name) in NODE_NAMES.iter().enumerate() {
            let node = net.node(i);
            let pin = PinDir::new(&format!("{}-pins", node.prefix())).expect("pin dir");
            let args = net.agent_args(i, manifests.path(), CLUSTER_CIDR);
            let args: Vec<&std::ffi::OsStr> = args.iter().map(|a| a.as_os_str()).collect();
            let agent = Agent::start_with(bin, node.node(), &args, pin.path(), node.tmp().path())
                .unwrap_or_else(|e| panic!("starting the {name} agent ({}): {e:#}", bin.display()));
            agents.push(agent);
            pins.push(pin);
        }
        let nodes = Self {
            agents: Mutex::new(agents),
            pins,
            _manifests: manifests,
            net,
        };
        for (i, name) in NODE_NAMES.iter().enumerate() {
            let want = nodes.interfaces(i);
            let ready = nodes.agents()[i]
                .wait_attached_within(&want, FIRST_SYNC_BOUND)
                .map(|_| ());
            if let Err(e) = ready {
                nodes.fail(&format!("{name} agent: {e:#}"));
            }
        }
        nodes
    }

    fn agents(&self) -> std::sync::MutexGuard<'_, Vec<Agent>> {
        self.agents.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn interfaces(&self, i: usize) -> Vec<String> {
        let mut want = self.net.node(i).pod_interfaces();
        want.push(EXT_DEVICE.to_owned());
        want
    }

    /// Node `i` rolls to `bin`: the running agent gets SIGTERM, then `bin` starts on the same
    /// pins, flags and cgroup, and is waited for (synced, attached). Returns how long it took.
    fn roll(&self, i: usize, bin: &Path) -> Duration {
        let started = Instant::now();
        let want = self.interfaces(i);
        let result = (|| -> anyhow::Result<()> {
            let mut agents = self.agents();
            let status = agents[i].stop()?;
            anyhow::ensure!(
                status.success(),
                "the old agent exited with {status} on SIGTERM"
            );
            agents[i].restart_as(bin)?;
            agents[i].wait_attached_within(&want, FIRST_SYNC_BOUND)?;
            Ok(())
        })();
        if let Err(e) = result {
            self.fail(&format!(
                "rolling {} to {}: {e:#}",
                NODE_NAMES[i],
                bin.display()
            ));
        }
        started.elapsed()
    }

    /// `kube-proxy-ebpf dump <what>` of node `i`'s pins, by the binary its agent runs now.
    fn dump(&self, i: usize, what: &str) -> String {
        let pin = self.pins[i].path().to_string_lossy().into_owned();
        let (out, bin) = {
            let agents = self.agents();
            (
                agents[i].cli(&["dump", what, "--pin-dir", &pin]),
                agents[i].bin().to_path_buf(),
            )
        };
        let out = out.unwrap_or_else(|e| self.fail(&format!("dump {what}: {e:#}")));
        if !out.status.success() {
            self.fail(&format!(
                "dump {what} ({}) failed: {}",
                bin.display(),
                String::from_utf8_lossy(&out.stderr)
            ));
        }
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    /// One HTTP GET from a-cli (node A): the answering backend's name.
    fn pod_get(&self, url: &str) -> Result<String, String> {
        let replies = (self.net.node(NODE_A))
            .curl_many_from("a-cli", url, 1)
            .map_err(|e| format!("{e:#}"))?;
        match replies.into_iter().next() {
            Some(Ok(r)) => Ok(r.body),
            Some(Err(e)) => Err(e),
            None => Err("no reply record".into()),
        }
    }

    fn fail(&self, msg: &str) -> ! {
        let mut text = msg.to_owned();
        for (i, (name, agent)) in NODE_NAMES.iter().zip(self.agents().iter()).enumerate() {
            // The datapath's non-zero counters say which drop or miss a failed request met.
            let pin = self.pins[i].path().to_string_lossy().into_owned();
            let stats = match agent.cli(&["dump", "stats", "--pin-dir", &pin]) {
                Ok(out) => String::from_utf8_lossy(&out.stdout)
                    .lines()
                    .filter(|l| !l.trim_end().ends_with(" 0"))
                    .collect::<Vec<_>>()
                    .join("\n"),
                Err(e) => format!("dump stats: {e:#}"),
            };
            text.push_str(&format!(
                "\n--- {name} counters ({}) ---\n{stats}\n--- {name} agent log (tail) ---\n{}",
                agent.bin().display(),
                agent.log_tail()
            ));
        }
        panic!("{text}")
    }

    fn check(&self, cond: bool, msg: impl FnOnce() -> String) {
        if !cond {
            self.fail(&msg());
        }
    }
}

/// The previous release's agent binary: built (or cached) by the fixture; a clone without its
/// commit fails here, never skips.
fn previous_release() -> PathBuf {
    let workspace =
        proxy_testenv::prev_release::workspace_of(Path::new(env!("CARGO_MANIFEST_DIR")));
    let prev = proxy_testenv::prev_release::previous_release(&workspace)
        .unwrap_or_else(|e| panic!("the previous release's agent (fixture): {e:#}"));
    if let Some(took) = prev.built_in {
        eprintln!(
            "UPGRADE fixture: built {} in {:.1} s",
            prev.commit,
            took.as_secs_f64()
        );
    }
    prev.bin
}

/// The `dump conntrack` row (its SRC, DST, NAT columns) of the ORIGINAL direction of the flow
/// from `src`; `None` without one.
fn original_row(table: &str, src: &str, dst: &str) -> Option<String> {
    table.lines().find_map(|l| {
        let f: Vec<&str> = l.split_whitespace().collect();
        (f.get(1) == Some(&"orig") && f.contains(&src) && f.contains(&dst)).then(|| {
            // FAMILY DIR PROTO SRC DST NAT... STATE IDLE: everything but the idle seconds.
            f[..f.len().saturating_sub(1)].join(" ")
        })
    })
}

/// A stream client's output: the address it connected from, then its JSON summary.
fn stream_local(log: &Path) -> Option<String> {
    let text = std::fs::read_to_string(log).ok()?;
    text.lines()
        .find_map(|l| l.strip_prefix("local ").map(str::to_owned))
}

fn stream_summary(log: &Path) -> Option<serde_json::Value> {
    let text = std::fs::read_to_string(log).ok()?;
    text.lines()
        .find_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
}

/// Requests of one phase of the loop: answered, and the failures.
#[derive(Default)]
struct Tally {
    ok: usize,
    failed: Vec<String>,
}

const PHASES: [&str; 5] = ["old", "upgrade", "new", "rollback", "old again"];

/// The previous release on both nodes with two long TCP streams (a-cli → ClusterIP, external
/// client → node A's NodePort, SNATed to the backend on node B) and a request loop (a-cli → a
/// ClusterIP, the external client → a NodePort) running; each node rolls to this build, then back
/// to the previous release. Asserts: no failed request in any phase, both streams whole on their
/// one connection, `dump conntrack` of the new agent showing the streams' flows as the old agent
/// created them (same translation), a ClientIP affinity client kept on its backend with its
/// affinity entry, and the pins marked with this layout.
#[test]
fn upgrade_to_this_build_and_roll_back_with_traffic_flowing() {
    require_privileged!();
    let prev_bin = previous_release();
    let new_bin = PathBuf::from(BIN);
    let nodes = Nodes::start(&prev_bin);
    let tmp = nodes.net.node(NODE_B).tmp().path().to_path_buf();
    let (server_py, client_py) = (tmp.join("stream_server.py"), tmp.join("stream_client.py"));
    std::fs::write(&server_py, STREAM_SERVER_PY).expect("server script");
    std::fs::write(&client_py, STREAM_CLIENT_PY).expect("client script");
    let stop_file = tmp.join("streams.stop");
    let path = |p: &Path| p.to_str().expect("utf-8 path").to_owned();

    // The affinity client's backend under the old agent.
    let sticky_url = format!("http://{STICKY}/");
    let sticky = |nodes: &Nodes, when: &str| -> String {
        let answers: Vec<String> = (0..4)
            .map(|_| {
                nodes
                    .pod_get(&sticky_url)
                    .unwrap_or_else(|e| nodes.fail(&format!("{when}: sticky request: {e}")))
            })
            .collect();
        nodes.check(answers.iter().all(|a| *a == answers[0]), || {
            format!("{when}: the ClientIP affinity client moved between backends: {answers:?}")
        });
        answers[0].clone()
    };
    let sticky_backend = sticky(&nodes, "old agent");

    // The two streams: servers in b-web, clients in a-cli and the external client.
    let b_web = nodes.net.node(NODE_B).pod("b-web").expect("b-web").ns();
    let mut servers: Vec<(Proc, PathBuf)> = Vec::new();
    for port in [STREAM_CIP_PORT, STREAM_NP_PORT] {
        let ready = tmp.join(format!("stream-{port}.ready"));
        let log = tmp.join(format!("stream-server-{port}.log"));
        let proc = b_web
            .spawn(
                &[
                    "python3",
                    &path(&server_py),
                    &port.to_string(),
                    &path(&ready),
                    &path(&stop_file),
                ],
                Some(&log),
            )
            .expect("stream server");
        let deadline = Instant::now() + Duration::from_secs(10);
        while !ready.exists() {
            nodes.check(Instant::now() < deadline, || {
                format!("the stream server on {port} did not start within 10 s")
            });
            thread::sleep(Duration::from_millis(20));
        }
        servers.push((proc, log));
    }
    let node_a = NODE_IPS[NODE_A];
    let a_cli = nodes.net.node(NODE_A).pod("a-cli").expect("a-cli").ns();
    let mut clients: Vec<(&str, Proc, PathBuf, String)> = Vec::new();
    for (what, ns, ip, port) in [
        ("ClusterIP", a_cli, STREAM, STREAM_CIP_PORT),
        ("NodePort", nodes.net.client(), node_a, STREAM_NODEPORT),
    ] {
        let log = tmp.join(format!("stream-client-{port}.log"));
        let proc = ns
            .spawn(
                &[
                    "python3",
                    &path(&client_py),
                    &ip.to_string(),
                    &port.to_string(),
                ],
                Some(&log),
            )
            .expect("stream client");
        let deadline = Instant::now() + Duration::from_secs(10);
        let local = loop {
            if let Some(local) = stream_local(&log) {
                break local;
            }
            nodes.check(Instant::now() < deadline, || {
                format!(
                    "the {what} stream did not connect within 10 s: {}",
                    std::fs::read_to_string(&log).unwrap_or_default()
                )
            });
            thread::sleep(Duration::from_millis(20));
        };
        clients.push((what, proc, log, format!("{local} {ip}:{port}")));
    }
    // (source, destination) of each stream as node A's conntrack keys it.
    let flows: Vec<(String, String, &str)> = clients
        .iter()
        .map(|(what, _, _, pair)| {
            let (src, dst) = pair.split_once(' ').expect("pair");
            (src.to_owned(), dst.to_owned(), *what)
        })
        .collect();
    thread::sleep(Duration::from_millis(500));
    let old_table = nodes.dump(NODE_A, "conntrack");
    let old_rows: Vec<String> = flows
        .iter()
        .map(|(src, dst, what)| {
            original_row(&old_table, src, dst).unwrap_or_else(|| {
                nodes.fail(&format!(
                    "the old agent's conntrack has no {what} stream flow {src} → {dst}:\n{old_table}"
                ))
            })
        })
        .collect();
    let old_snat = nodes.dump(NODE_A, "snat");
    let np_client = &flows[1].0;
    nodes.check(old_snat.contains(np_client.as_str()), || {
        format!("the old agent's SNAT table has no entry for {np_client}:\n{old_snat}")
    });

    // The request loop, counted per phase; bounded: stops when told or after 180 s.
    let phase = AtomicUsize::new(0);
    let stop = AtomicBool::new(false);
    let tallies: [Mutex<Tally>; 5] = Default::default();
    let web_cip = format!("http://{WEB}/");
    let web_np = format!("http://{node_a}:{WEB_NODEPORT}/");
    let mut swaps: Vec<(usize, &str, Duration)> = Vec::new();
    let mut after_upgrade: Option<(String, String, String, Option<Marker>)> = None;
    let mut after_rollback: Option<String> = None;
    let mut phase_at: Vec<(&str, f64)> = Vec::new();
    thread::scope(|s| {
        let nodes = &nodes;
        let (phase, stop, tallies) = (&phase, &stop, &tallies);
        let (web_cip, web_np) = (&web_cip, &web_np);
        let loop_began = Instant::now();
        s.spawn(move || {
            let until = Instant::now() + Duration::from_secs(180);
            while !stop.load(Ordering::Relaxed) && Instant::now() < until {
                let p = phase.load(Ordering::Relaxed);
                let began = Instant::now();
                let pod = nodes.pod_get(web_cip);
                let ext = nodes.net.http_get(web_np);
                let mut t = tallies[p].lock().expect("tally");
                for (what, r) in [
                    ("ClusterIP", pod),
                    (
                        "NodePort",
                        ext.map(|r| r.body).map_err(|e| format!("{e:#}")),
                    ),
                ] {
                    match r {
                        Ok(body) if body == "b-web" || body == "b-two" => t.ok += 1,
                        Ok(body) => t.failed.push(format!("{what}: answered {body:?}")),
                        Err(e) => t.failed.push(format!(
                            "{what} (sent {:.2} s into the loop): {e}",
                            began.duration_since(loop_began).as_secs_f64()
                        )),
                    }
                }
            }
        });
        let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            thread::sleep(Duration::from_secs(1));
            phase.store(1, Ordering::Relaxed);
            phase_at.push((PHASES[1], loop_began.elapsed().as_secs_f64()));
            for i in [NODE_A, NODE_B] {
                swaps.push((i, "upgrade", nodes.roll(i, &new_bin)));
            }
            phase.store(2, Ordering::Relaxed);
            phase_at.push((PHASES[2], loop_began.elapsed().as_secs_f64()));
            thread::sleep(Duration::from_millis(500));
            let table = nodes.dump(NODE_A, "conntrack");
            let snat = nodes.dump(NODE_A, "snat");
            let affinity = nodes.dump(NODE_A, "affinity");
            let marker = layout::read_marker(&PinLayout::new(nodes.pins[NODE_A].path()))
                .unwrap_or_else(|e| nodes.fail(&format!("reading the layout marker: {e}")));
            after_upgrade = Some((table, snat, affinity, marker));
            thread::sleep(Duration::from_millis(500));
            phase.store(3, Ordering::Relaxed);
            phase_at.push((PHASES[3], loop_began.elapsed().as_secs_f64()));
            for i in [NODE_A, NODE_B] {
                swaps.push((i, "rollback", nodes.roll(i, &prev_bin)));
            }
            phase.store(4, Ordering::Relaxed);
            phase_at.push((PHASES[4], loop_began.elapsed().as_secs_f64()));
            after_rollback = Some(nodes.dump(NODE_A, "conntrack"));
            thread::sleep(Duration::from_secs(1));
        }));
        stop.store(true, Ordering::Relaxed);
        if let Err(panic) = result {
            std::panic::resume_unwind(panic);
        }
    });

    // The streams end: every byte the servers sent must have arrived, on the one connection.
    std::fs::write(&stop_file, "stop\n").expect("stop file");
    let mut stream_bytes = Vec::new();
    for ((what, mut client, log, _), (mut server, server_log)) in clients.into_iter().zip(servers) {
        let done = client
            .wait_timeout(Duration::from_secs(30))
            .expect("waiting for a stream client");
        nodes.check(done.is_some(), || {
            format!("the {what} stream client did not finish")
        });
        let _ = server.wait_timeout(Duration::from_secs(10));
        let summary = stream_summary(&log).unwrap_or_else(|| {
            nodes.fail(&format!("no {what} stream summary in {}", log.display()))
        });
        let server_said = std::fs::read_to_string(&server_log).unwrap_or_default();
        let sent: Option<u64> = server_said
            .split_whitespace()
            .skip_while(|w| *w != "sent")
            .nth(1)
            .and_then(|n| n.parse().ok());
        let got = summary["bytes"].as_u64();
        eprintln!(
            "UPGRADE stream {what}: {got:?} bytes received of {sent:?} sent, longest gap {} ms, {summary}",
            summary["max_gap_ms"]
        );
        nodes.check(
            summary["error"].is_null()
                && summary["mismatch"].is_null()
                && summary["eof"] == true
                && sent.is_some()
                && got == sent,
            || format!("the {what} stream broke: {summary} (server: {server_said:?})"),
        );
        if what == "ClusterIP" {
            // One connection end to end: the server's one accepted peer is the client's socket
            // (a pod client is not SNATed).
            let local = stream_local(&log).unwrap_or_default();
            nodes.check(server_said.contains(&format!("peer {local} ")), || {
                format!("the ClusterIP stream's server saw {server_said:?}, the client was {local}")
            });
        }
        stream_bytes.push((what, got.unwrap_or(0)));
    }

    for (i, when, took) in &swaps {
        eprintln!(
            "UPGRADE swap {when} {}: {:.2} s (SIGTERM to attached)",
            NODE_NAMES[*i],
            took.as_secs_f64()
        );
    }
    let mut failures = Vec::new();
    for (name, tally) in PHASES.iter().zip(&tallies) {
        let t = tally.lock().expect("tally");
        eprintln!(
            "UPGRADE requests {name}: {} ok, {} failed",
            t.ok,
            t.failed.len()
        );
        if !t.failed.is_empty() || t.ok == 0 {
            failures.push(format!("{name}: {} ok, failed {:?}", t.ok, t.failed));
        }
    }
    nodes.check(failures.is_empty(), || {
        format!(
            "requests across the swaps: {failures:?} (phases began, s into the loop: {phase_at:?})"
        )
    });

    // The new agent's conntrack shows the flows the old one created, translated as before.
    let (table, snat, affinity, marker) = after_upgrade.expect("the upgrade ran");
    for ((src, dst, what), old_row) in flows.iter().zip(&old_rows) {
        let row = original_row(&table, src, dst);
        eprintln!("UPGRADE flow {what} in the new agent's dump conntrack: {row:?}");
        nodes.check(row.as_deref() == Some(old_row.as_str()), || {
            format!(
                "the {what} stream flow {src} → {dst}: the old agent's row {old_row:?}, the new agent's {row:?}:\n{table}"
            )
        });
    }
    let snat_rows = |table: &str| -> Vec<String> {
        (table.lines())
            .filter(|l| l.contains(np_client.as_str()))
            .map(|l| {
                let f: Vec<&str> = l.split_whitespace().collect();
                f[..f.len().saturating_sub(1)].join(" ")
            })
            .collect()
    };
    eprintln!(
        "UPGRADE SNAT entries of the NodePort stream in the new agent's dump snat: {:?}",
        snat_rows(&snat)
    );
    nodes.check(
        !snat_rows(&snat).is_empty() && snat_rows(&snat) == snat_rows(&old_snat),
        || {
            format!(
                "the NodePort stream's SNAT entries: old agent {:?}, new agent {:?}",
                snat_rows(&old_snat),
                snat_rows(&snat)
            )
        },
    );
    // Rolled back: the previous release reads the same flows from the pins the new one used.
    let back = after_rollback.expect("the rollback ran");
    for ((src, dst, what), old_row) in flows.iter().zip(&old_rows) {
        nodes.check(
            original_row(&back, src, dst).as_deref() == Some(old_row.as_str()),
            || format!("after the rollback, the {what} stream flow {src} → {dst}:\n{back}"),
        );
    }
    let client_entry = affinity.lines().find(|l| l.contains(&A_CLI.to_string()));
    eprintln!("UPGRADE affinity entry in the new agent's dump: {client_entry:?}");
    nodes.check(client_entry.is_some(), || {
        format!("the new agent's affinity table lost {A_CLI}:\n{affinity}")
    });
    nodes.check(
        marker
            == Some(Marker {
                layout: proxy_common::LAYOUT_VERSION,
                oldest_reader: proxy_common::LAYOUT_OLDEST_READER,
            }),
        || format!("the new agent's layout marker: {marker:?}"),
    );
    let after = sticky(&nodes, "after the rollback");
    nodes.check(after == sticky_backend, || {
        format!(
            "the affinity client was on {sticky_backend}, after the upgrade and rollback on {after}"
        )
    });
    eprintln!(
        "UPGRADE summary: streams {stream_bytes:?}, flows kept {}, affinity kept on {sticky_backend}",
        flows.len()
    );
}

/// The synthetic older layout of [`a_synthetic_older_layout_is_migrated_into_the_new_maps`]:
/// layout 0 kept `u32 → u64` in `UPGTEST_V0`; layout 1 keeps `u32 → [u64; 2]` (a field added,
/// 7 for migrated entries) in `UPGTEST_V1`. Key 0 is invalid in layout 1: dropped.
const TEST_OLD: &str = "UPGTEST_V0";
const TEST_NEW: &str = "UPGTEST_V1";

fn copy_test_v0(pins: &PinLayout) -> kube_proxy_ebpf::dataplane::Result<usize> {
    layout::copy_hash::<u32, u64, u32, [u64; 2]>(pins, TEST_OLD, TEST_NEW, |k, v| {
        (*k != 0).then_some((*k, [*v, 7]))
    })
    .map(|c| c.copied)
}

const TEST_MIGRATIONS: [Migration; 1] = [Migration {
    from: 0,
    what: "UPGTEST values grow from 8 to 16 bytes",
    copy: copy_test_v0,
    retired: &[TEST_OLD],
}];

fn bpftool_create(path: &Path, name: &str, value_size: u32) {
    let out = std::process::Command::new("bpftool")
        .args(["map", "create"])
        .arg(path)
        .args(["type", "hash", "key", "4", "value"])
        .arg(value_size.to_string())
        .args(["entries", "64", "name", name])
        .output()
        .expect("bpftool");
    assert!(
        out.status.success(),
        "bpftool map create {name}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

fn pinned_hash<K: aya::Pod, V: aya::Pod>(
    pins: &PinLayout,
    name: &str,
) -> aya::maps::HashMap<aya::maps::MapData, K, V> {
    let data = aya::maps::MapData::from_pin(pins.map(name)).expect(name);
    aya::maps::HashMap::try_from(aya::maps::Map::HashMap(data)).expect(name)
}

/// The migration framework on pins of a synthetic layout 0 (marked 0): the bulk copy after the
/// load converts every entry (never over one the new programs already wrote), the entries the
/// old programs create until the swap are copied after it, then the old map is unpinned and the
/// marker says layout 1; a second agent finds nothing left to migrate.
#[test]
fn a_synthetic_older_layout_is_migrated_into_the_new_maps() {
    require_privileged!();
    proxy_testenv::ensure_bpffs().expect("bpffs");
    let dir = PinDir::new(&format!("{}-layout0", proxy_testenv::unique_prefix())).expect("pin dir");
    let pins = PinLayout::new(dir.path());
    pins.create().expect("pin directories");
    bpftool_create(&pins.map(TEST_OLD), TEST_OLD, 8);
    {
        let mut old: aya::maps::HashMap<_, u32, u64> = pinned_hash(&pins, TEST_OLD);
        for k in 0..=10u32 {
            old.insert(k, u64::from(k) * 100, 0).expect("old entry");
        }
    }
    layout::write_marker(
        &pins,
        Marker {
            layout: 0,
            oldest_reader: 0,
        },
    )
    .expect("marker 0");
    let this = Marker {
        layout: 1,
        oldest_reader: 1,
    };
    let mut migrator = Migrator::prepare(&pins, &TEST_MIGRATIONS, this).expect("prepare");
    assert_eq!(migrator.verdict(), Verdict::Adopt { from: 0 });
    assert_eq!(migrator.pending(), 1);

    // The load creates the new map; the new programs may write into it before the copy.
    bpftool_create(&pins.map(TEST_NEW), TEST_NEW, 16);
    pinned_hash::<u32, [u64; 2]>(&pins, TEST_NEW)
        .insert(5, [555, 5], 0)
        .expect("an entry of the new programs");
    assert_eq!(migrator.after_load().expect("bulk copy"), 9);
    assert_eq!(
        layout::read_marker(&pins).expect("marker"),
        Some(Marker {
            layout: 0,
            oldest_reader: 0
        }),
        "marked only once the migration is done"
    );
    // Until the swap the old programs keep writing the old map.
    pinned_hash::<u32, u64>(&pins, TEST_OLD)
        .insert(11, 1100, 0)
        .expect("a late entry");
    assert_eq!(migrator.after_attach().expect("catch-up copy"), 1);
    assert!(
        !pins.map(TEST_OLD).exists(),
        "the old layout's map is retired"
    );
    assert_eq!(layout::read_marker(&pins).expect("marker"), Some(this));
    let new: aya::maps::HashMap<_, u32, [u64; 2]> = pinned_hash(&pins, TEST_NEW);
    let mut entries: Vec<(u32, [u64; 2])> = new.iter().map(|e| e.expect("entry")).collect();
    entries.sort();
    let want: Vec<(u32, [u64; 2])> = (1..=11u32)
        .map(|k| {
            let v = if k == 5 {
                [555, 5]
            } else {
                [u64::from(k) * 100, 7]
            };
            (k, v)
        })
        .collect();
    assert_eq!(entries, want);
    let again = Migrator::prepare(&pins, &TEST_MIGRATIONS, this).expect("prepare again");
    assert_eq!(
        (again.verdict(), again.pending()),
        (Verdict::Adopt { from: 1 }, 0)
    );
}

/// Pins marked with a layout newer than this agent's (and not readable by it): `run` refuses
/// before touching them, naming the layout and the way out; `cleanup` (the way out) removes
/// them, marker included. The agent runs in a namespace of its own, with nothing to attach to.
#[test]
fn pins_of_a_newer_layout_are_refused_with_the_way_out() {
    require_privileged!();
    proxy_testenv::ensure_bpffs().expect("bpffs");
    let prefix = proxy_testenv::unique_prefix();
    let dir = PinDir::new(&format!("{prefix}-newer")).expect("pin dir");
    let pins = PinLayout::new(dir.path());
    pins.create().expect("pin directories");
    let newer = proxy_common::LAYOUT_VERSION + 1;
    layout::write_marker(
        &pins,
        Marker {
            layout: newer,
            oldest_reader: newer,
        },
    )
    .expect("marker");
    let ns = proxy_testenv::NetNs::new(&format!("{prefix}-node")).expect("namespace");
    let manifests = ManifestDir::new().expect("manifests");
    let pin = dir.path().to_string_lossy().into_owned();
    let out = proxy_testenv::cli(
        Path::new(BIN),
        &ns.path(),
        &[
            "run",
            "--manifests",
            &manifests.path().to_string_lossy(),
            "--pin-dir",
            &pin,
            "--socket-lb-cgroup",
            "none",
        ],
    )
    .expect("running the agent");
    let said = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    eprintln!("the agent said: {said}");
    assert!(!out.status.success(), "the agent ran on newer pins: {said}");
    for part in [
        format!("map layout {newer}"),
        format!("up to {}", proxy_common::LAYOUT_VERSION),
        format!("kube-proxy-ebpf cleanup --pin-dir {pin}"),
    ] {
        assert!(said.contains(&part), "{part:?} not in the refusal: {said}");
    }
    let left: Vec<String> = std::fs::read_dir(dir.path())
        .expect("pin dir")
        .map(|e| e.expect("entry").file_name().to_string_lossy().into_owned())
        .collect();
    let mut left = left;
    left.sort();
    assert_eq!(
        left,
        ["LAYOUT", "links"],
        "the refusing agent pinned nothing"
    );
    let cleanup = proxy_testenv::cli(Path::new(BIN), &ns.path(), &["cleanup", "--pin-dir", &pin])
        .expect("cleanup");
    assert!(
        cleanup.status.success(),
        "cleanup: {}",
        String::from_utf8_lossy(&cleanup.stderr)
    );
    assert!(!dir.path().exists(), "cleanup left {pin}");
}
