//! The Kubernetes API source against an in-process fake API server
//! ([`proxy_testenv::FakeApiServer`]).
//!
//! Two tiers in one file:
//! - unprivileged (plain `cargo test`): the [`KubeSource`] reflectors alone, on a fake server on
//!   127.0.0.1 — initial list, watch, dropped connections, 410 Gone relists, outage;
//! - privileged (`sudo cargo xtask test`, KPE_PRIVILEGED=1): the real agent in a node namespace,
//!   configured by a kubeconfig pointing at the fake server listening on 127.0.0.1 *inside* the
//!   node namespace, with real traffic from the client pod; and `kube_scale_numbers`, which
//!   prints RSS, first-sync time and API→map latency at 10,000 Services (numbers, no asserts;
//!   `KPE_SCALE_SERVICES=N` for another scale).

mod common_kube;
mod common_netns;

use std::{
    collections::BTreeMap,
    net::Ipv4Addr,
    path::Path,
    thread,
    time::{Duration, Instant},
};

use aya::maps::{
    Map, MapData,
    lpm_trie::{Key, LpmTrie},
};
use common_kube::{
    BIN, Cond, Env, NODE, backend_ips, frontend_count, node, open_services, ready, rss_kib,
    scale_endpoints, scale_vip, service, service_cidr, slice, status_kib,
};
use kube_proxy_ebpf::{
    pipeline::translate::{self, NodeContext},
    sources::{
        Source,
        kube::{Connection, KubeSource},
    },
};
use proxy_common::{Backend, MAP_BACKENDS, MAP_SERVICE_CIDRS, backend_flags, service_cidr};
use proxy_testenv::{
    Agent, ConnectOutcome, FakeApiServer, PinDir, Topology,
    fake_apiserver::{Kind, wait_for},
    require_privileged,
};
use serde_json::{Value, json};

const WEB: Ipv4Addr = Ipv4Addr::new(10, 96, 0, 10);
const OTHER: Ipv4Addr = Ipv4Addr::new(10, 96, 0, 20);
const NEW: Ipv4Addr = Ipv4Addr::new(10, 96, 0, 30);

// ---------------------------------------------------------------------------------------------
// Unprivileged: the reflectors alone

/// The frontends translate makes of the source's current state: VIP → backend addresses.
fn frontends(source: &Source) -> BTreeMap<Ipv4Addr, Vec<Ipv4Addr>> {
    let state = source.state();
    let node = NodeContext {
        scheduler: Default::default(),
        node_name: NODE.into(),
        zone: state.zone,
    };
    translate::translate(&state.snapshot, &node)
        .desired
        .frontends
        .iter()
        .map(|(f, d)| (f.addr, d.backends.iter().map(|b| b.endpoint.addr).collect()))
        .collect()
}

async fn wait_frontends(
    source: &mut Source,
    what: &str,
    timeout: Duration,
    pred: impl Fn(&BTreeMap<Ipv4Addr, Vec<Ipv4Addr>>) -> bool,
) {
    let deadline = tokio::time::Instant::now() + timeout;
    loop {
        let now = frontends(source);
        if pred(&now) {
            return;
        }
        if tokio::time::timeout_at(deadline, source.changed())
            .await
            .is_err()
        {
            panic!(
                "timed out after {timeout:?} waiting for {what}; frontends now {:?}",
                frontends(source)
            );
        }
    }
}

async fn client_for(server: &FakeApiServer) -> kube::Client {
    let dir =
        std::env::temp_dir().join(format!("kpe-kube-{}-{}", std::process::id(), server.port()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let kubeconfig = server
        .write_kubeconfig(&dir.join("kubeconfig"))
        .expect("kubeconfig");
    let client = Connection {
        kubeconfig: Some(kubeconfig),
        ..Connection::default()
    }
    .client()
    .await
    .expect("client")
    .0;
    // Read when the client was built: nothing is left behind.
    let _ = std::fs::remove_dir_all(&dir);
    client
}

async fn connect(server: &FakeApiServer) -> Source {
    let client = client_for(server).await;
    let source = Source::Kube(KubeSource::start(client, NODE, None));
    tokio::time::timeout(Duration::from_secs(10), source.wait_ready())
        .await
        .expect("initial lists within 10 s");
    source
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reflectors_list_watch_filter_and_prune() {
    let server = FakeApiServer::start().expect("fake API server");
    server.apply(node("zone-a")).expect("node");
    server.apply(service("web", WEB, 80)).expect("svc");
    server
        .apply(slice("web", "a", &ready(&backend_ips()[..1])))
        .expect("slice");
    // Filtered server-side by kube-proxy's label selector: never seen by the agent.
    let mut other_proxy = service("other", OTHER, 80);
    other_proxy["metadata"]["labels"] = json!({"service.kubernetes.io/service-proxy-name": "x"});
    server.apply(other_proxy).expect("other");
    // Another node's Node: filtered by the field selector.
    let mut other_node = node("zone-b");
    other_node["metadata"]["name"] = json!("node-2");
    server.apply(other_node).expect("node-2");

    let mut source = connect(&server).await;
    let state = source.state();
    assert_eq!(
        state.zone.as_deref(),
        Some("zone-a"),
        "zone from this node's label"
    );
    assert_eq!(
        state.snapshot.services.len(),
        1,
        "only demo/web passes the selector"
    );
    let svc = &state.snapshot.services[0];
    // The store keeps the compact form (`ServiceData`): managedFields, the last-applied
    // annotation and the selector have no place in it.
    assert_eq!(
        (svc.namespace.as_deref(), svc.name.as_deref()),
        (Some("demo"), Some("web"))
    );
    assert_eq!(
        frontends(&source),
        BTreeMap::from([(WEB, vec![backend_ips()[0]])])
    );
    let requests = server.requests();
    assert!(
        requests.iter().any(|r| r.contains("labelSelector=%21service.kubernetes.io%2Fservice-proxy-name%2C%21service.kubernetes.io%2Fheadless")
            || r.contains("labelSelector=!service.kubernetes.io/service-proxy-name,!service.kubernetes.io/headless")),
        "Services listed with kube-proxy's selector: {requests:?}"
    );

    // Watch: scale up, then a new Service.
    server
        .apply(slice("web", "a", &ready(&backend_ips())))
        .expect("scale");
    server.apply(service("new", NEW, 80)).expect("new");
    server
        .apply(slice("new", "a", &ready(&backend_ips()[1..2])))
        .expect("new slice");
    wait_frontends(
        &mut source,
        "scale-up and new Service",
        Duration::from_secs(5),
        |f| f.get(&WEB).is_some_and(|b| b.len() == 3) && f.contains_key(&NEW),
    )
    .await;
    // The zone follows the Node's label.
    server.apply(node("zone-c")).expect("relabel");
    let deadline = Instant::now() + Duration::from_secs(5);
    while source.state().zone.as_deref() != Some("zone-c") {
        assert!(Instant::now() < deadline, "zone label change not seen");
        let _ = tokio::time::timeout(Duration::from_millis(100), source.changed()).await;
    }
}

/// Two Services claiming one frontend, as the API server holds them: `web` (ClusterIP WEB, the
/// newer) and `intruder` (older, externalIPs [WEB]); both with a uid and a creationTimestamp.
fn clashing_services() -> Vec<Value> {
    let mut web = service("web", WEB, 80);
    web["metadata"]["uid"] = json!("uid-web");
    web["metadata"]["creationTimestamp"] = json!("2026-06-01T00:00:00Z");
    let mut intruder = service("intruder", OTHER, 80);
    intruder["metadata"]["uid"] = json!("uid-intruder");
    intruder["metadata"]["creationTimestamp"] = json!("2026-01-01T00:00:00Z");
    intruder["spec"]["externalIPs"] = json!([WEB.to_string()]);
    vec![web, intruder]
}

/// Checks the Event the agent (or the sink) created about `clashing_services`' conflict.
fn check_conflict_event(e: &proxy_testenv::fake_apiserver::RecordedEvent) -> Result<(), String> {
    let b = &e.body;
    let fields = [
        (e.method.as_str(), "POST"),
        (e.namespace.as_str(), "demo"),
        (b["type"].as_str().unwrap_or_default(), "Warning"),
        (b["reason"].as_str().unwrap_or_default(), "FrontendConflict"),
        (b["action"].as_str().unwrap_or_default(), "SkipFrontend"),
        (
            b["reportingController"].as_str().unwrap_or_default(),
            "kube-proxy-ebpf",
        ),
        (b["reportingInstance"].as_str().unwrap_or_default(), NODE),
        (
            b["regarding"]["kind"].as_str().unwrap_or_default(),
            "Service",
        ),
        (
            b["regarding"]["name"].as_str().unwrap_or_default(),
            "intruder",
        ),
        (
            b["regarding"]["uid"].as_str().unwrap_or_default(),
            "uid-intruder",
        ),
        (b["related"]["name"].as_str().unwrap_or_default(), "web"),
        (b["related"]["uid"].as_str().unwrap_or_default(), "uid-web"),
    ];
    for (got, want) in fields {
        if got != want {
            return Err(format!("{got:?} instead of {want:?} in {b:#}"));
        }
    }
    let note = b["note"].as_str().unwrap_or_default();
    if !note.contains(&format!("frontend {WEB}:80/TCP (externalIP")) || !note.contains("clusterIP")
    {
        return Err(format!("note {note:?}"));
    }
    Ok(())
}

/// The Event path without the datapath: the reflectors keep the Services' creationTimestamp and
/// uid, the translation finds the conflict, and kube-rs's Recorder creates one Event on the
/// losing Service (the fake server records it); nothing new while the conflict lasts.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_frontend_conflict_becomes_one_event_on_the_losing_service() {
    use kube_proxy_ebpf::sources::kube::events::{ConflictEvents, EventSink};

    let server = FakeApiServer::start().expect("fake API server");
    server.apply(node("zone-a")).expect("node");
    server.apply_all(clashing_services()).expect("services");
    let source = connect(&server).await;
    let sink = EventSink::start(client_for(&server).await, NODE);
    let mut published = ConflictEvents::default();
    for _ in 0..3 {
        let state = source.state();
        let t = translate::translate(&state.snapshot, &NodeContext::default());
        assert_eq!(t.conflicts.len(), 1, "{:?}", t.conflicts);
        assert_eq!(t.conflicts[0].loser.name, "intruder");
        assert_eq!(
            t.desired
                .frontends
                .values()
                .filter(|d| d.service.name == "web")
                .count(),
            1,
            "WEB:80 stays web's ClusterIP"
        );
        sink.send(published.appeared(&t.conflicts, &state.snapshot));
    }
    let deadline = Instant::now() + Duration::from_secs(5);
    while server.events().is_empty() {
        assert!(Instant::now() < deadline, "no Event within 5 s");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // Give a second (wrong) Event time to arrive before counting.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let events = server.events();
    assert_eq!(events.len(), 1, "{events:#?}");
    check_conflict_event(&events[0]).unwrap_or_else(|e| panic!("{e}"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropped_watches_resume_and_410_gone_relists_converging_deletions() {
    let server = FakeApiServer::start().expect("fake API server");
    server.apply(service("web", WEB, 80)).expect("svc");
    server
        .apply(slice("web", "a", &ready(&backend_ips())))
        .expect("slice");
    server.apply(service("other", OTHER, 80)).expect("other");
    let mut source = connect(&server).await;
    assert_eq!(frontends(&source).len(), 2);
    let lists_before = server.list_count(Kind::Service);

    // Connections dropped mid-stream: the watch resumes from its resourceVersion (no relist).
    server.drop_connections();
    server
        .apply(slice("web", "a", &ready(&backend_ips()[..1])))
        .expect("scale down");
    wait_frontends(
        &mut source,
        "change after a dropped watch",
        Duration::from_secs(10),
        |f| f.get(&WEB).is_some_and(|b| b.len() == 1),
    )
    .await;
    assert_eq!(
        server.list_count(Kind::Service),
        lists_before,
        "a dropped watch resumes without relisting"
    );

    // History compacted + 410 Gone on the open watches: the reflectors relist. A deletion that
    // happened "in the gap" is only visible through the relist (no DELETED event reaches us).
    server.delete(Kind::Service, "demo", "other");
    server.expire_watches();
    wait_frontends(
        &mut source,
        "relist after 410",
        Duration::from_secs(10),
        |f| !f.contains_key(&OTHER),
    )
    .await;
    wait_for(Duration::from_secs(5), "a relist of Services", || {
        server.list_count(Kind::Service) > lists_before
    })
    .expect("relist");
    assert_eq!(frontends(&source).get(&WEB).map(Vec::len), Some(1));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unreachable_api_server_leaves_the_stores_as_they_were() {
    let mut server = FakeApiServer::start().expect("fake API server");
    server.apply(service("web", WEB, 80)).expect("svc");
    server
        .apply(slice("web", "a", &ready(&backend_ips())))
        .expect("slice");
    let mut source = connect(&server).await;
    let before = frontends(&source);
    server.stop();
    // Changes in the server's store while it is down.
    server.delete(Kind::Service, "demo", "web");
    server.apply(service("new", NEW, 80)).expect("new");
    server
        .apply(slice("new", "a", &ready(&backend_ips()[..1])))
        .expect("slice");
    server.expire_watches();
    // A few failed reconnects: the stores keep what they had.
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert_eq!(
        frontends(&source),
        before,
        "stores unchanged during the outage"
    );
    server.resume().expect("resume");
    // Reconnect within the watcher's backoff (0.8 s doubling, jittered).
    wait_frontends(
        &mut source,
        "convergence after the outage",
        Duration::from_secs(30),
        |f| !f.contains_key(&WEB) && f.contains_key(&NEW),
    )
    .await;
}

// ---------------------------------------------------------------------------------------------
// Privileged: the agent, real traffic ([`common_kube::Env`])

#[test]
fn service_created_through_the_api_carries_traffic_and_follows_scaling() {
    require_privileged!();
    let env = Env::start(vec![]);
    let s = env.agent.status().ok().flatten().unwrap_or_default();
    env.check(s.frontends == 0, || {
        format!("nothing to program yet: {s:?}")
    });

    let ips = backend_ips();
    env.api.apply(service("web", WEB, 80)).expect("svc");
    env.api
        .apply(slice("web", "a", &ready(&ips[..1])))
        .expect("slice");
    let took = env.wait_frontend(WEB, Some(1), Duration::from_secs(5));
    eprintln!("Service created through the API: in the map after {took:?}");
    let c = env.distribution(WEB, 10);
    env.check(Env::names(&c) == ["be1"], || format!("1 endpoint: {c:?}"));

    // 1 → 3: two more endpoints, in a second slice (several slices per Service).
    env.api
        .apply(slice("web", "b", &ready(&ips[1..])))
        .expect("slice b");
    let took = env.wait_frontend(WEB, Some(3), Duration::from_secs(5));
    eprintln!("scaled 1 → 3: in the map after {took:?}");
    let c = env.distribution(WEB, 60);
    env.check(Env::names(&c) == ["be1", "be2", "be3"], || {
        format!("3 endpoints: {c:?}")
    });

    // 3 → 1: slice b deleted.
    env.api.delete(Kind::EndpointSlice, "demo", "web-b");
    let took = env.wait_frontend(WEB, Some(1), Duration::from_secs(5));
    eprintln!("scaled 3 → 1: in the map after {took:?}");
    let c = env.distribution(WEB, 20);
    env.check(Env::names(&c) == ["be1"], || {
        format!("back to 1 endpoint: {c:?}")
    });

    // Service deleted: its frontend goes.
    env.api.delete(Kind::Service, "demo", "web");
    env.wait_frontend(WEB, None, Duration::from_secs(5));
}

#[test]
fn terminating_endpoints_serve_only_when_nothing_is_ready() {
    require_privileged!();
    let ips = backend_ips();
    let env = Env::start(vec![
        service("web", WEB, 80),
        slice(
            "web",
            "a",
            &[
                (ips[0], Cond::TerminatingServing),
                (ips[1], Cond::TerminatingServing),
            ],
        ),
    ]);
    env.wait_frontend(WEB, Some(2), Duration::from_secs(5));
    let c = env.distribution(WEB, 40);
    env.check(Env::names(&c) == ["be1", "be2"], || {
        format!("only terminating+serving endpoints left: they serve: {c:?}")
    });

    // A ready endpoint appears: only it gets new connections.
    env.api
        .apply(slice(
            "web",
            "a",
            &[
                (ips[0], Cond::TerminatingServing),
                (ips[1], Cond::TerminatingServing),
                (ips[2], Cond::Ready),
            ],
        ))
        .expect("slice");
    env.wait_frontend(WEB, Some(1), Duration::from_secs(5));
    let c = env.distribution(WEB, 20);
    env.check(Env::names(&c) == ["be3"], || {
        format!("a ready endpoint present: only it: {c:?}")
    });
}

// ---------------------------------------------------------------------------------------------
// Readiness: an endpoint that turns not ready keeps its established TCP connections

/// demo/flap's ClusterIP: HTTP 80 → 8080, two streams (9000, 9001) and UDP echo 53 → 5353.
const FLAP: Ipv4Addr = Ipv4Addr::new(10, 96, 0, 70);

fn flap_service() -> Value {
    let mut svc = service("flap", FLAP, 80);
    svc["spec"]["ports"] = json!([
        {"name": "http", "port": 80, "protocol": "TCP", "targetPort": 8080},
        {"name": "stream-a", "port": 9000, "protocol": "TCP", "targetPort": 9000},
        {"name": "stream-b", "port": 9001, "protocol": "TCP", "targetPort": 9001},
        {"name": "dns", "port": 53, "protocol": "UDP", "targetPort": 5353},
    ]);
    svc
}

fn flap_slice(endpoints: &[(Ipv4Addr, Cond)]) -> Value {
    let mut s = slice("flap", "a", endpoints);
    s["ports"] = json!([
        {"name": "http", "port": 8080, "protocol": "TCP"},
        {"name": "stream-a", "port": 9000, "protocol": "TCP"},
        {"name": "stream-b", "port": 9001, "protocol": "TCP"},
        {"name": "dns", "port": 5353, "protocol": "UDP"},
    ]);
    s
}

/// Sends a 251-periodic byte pattern to its one client for `seconds`, paced (16 KiB every
/// 5 ms), then closes; prints the bytes sent. Args: port, seconds, ready file.
const FLAP_STREAM_SERVER_PY: &str = r#"
import socket, sys, time
port, seconds, ready = int(sys.argv[1]), float(sys.argv[2]), sys.argv[3]
ls = socket.socket()
ls.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
ls.bind(("0.0.0.0", port))
ls.listen(1)
open(ready, "w").write("ready\n")
conn, _ = ls.accept()
chunk = bytes(i % 251 for i in range(251 * 64))
sent, end = 0, time.monotonic() + seconds
try:
    while time.monotonic() < end:
        conn.sendall(chunk)
        sent += len(chunk)
        print("sent", sent, flush=True)
        time.sleep(0.005)
    conn.shutdown(socket.SHUT_WR)
except OSError as e:
    print("error", repr(e), flush=True)
print("done", sent, flush=True)
"#;

/// Receives the stream until EOF or an error, checking every byte against the pattern; prints
/// one JSON line. Args: ip, port, recv timeout (s).
const FLAP_STREAM_CLIENT_PY: &str = r#"
import json, socket, sys
s = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=5)
s.settimeout(float(sys.argv[3]))
big = bytes(i % 251 for i in range(251 * 300))
total, bad, err, eof = 0, None, None, False
try:
    while True:
        data = s.recv(65536)
        if not data:
            eof = True
            break
        o = total % 251
        if bad is None and data != big[o:o + len(data)]:
            bad = total + next(j for j in range(len(data)) if data[j] != big[o + j])
        total += len(data)
except Exception as e:
    err = repr(e)
print(json.dumps({"bytes": total, "mismatch": bad, "error": err, "eof": eof}))
"#;

/// One UDP socket (one 5-tuple) sending `n` datagrams `gap` seconds apart, each answered within
/// 1 s or recorded as lost; prints a JSON list of [source, body] (null: lost). Args: ip, port,
/// n, gap.
const FLAP_UDP_FLOW_PY: &str = r#"
import json, socket, sys, time
ip, port, n, gap = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.settimeout(1)
out = []
for i in range(n):
    s.sendto(b"u%d" % i, (ip, port))
    try:
        data, addr = s.recvfrom(65535)
        out.append(["%s:%d" % addr[:2], data.decode(errors="replace")])
    except socket.timeout:
        out.append(None)
    time.sleep(gap)
print(json.dumps(out))
"#;

/// The pinned BACKENDS_V1 entries for `addr` (port, proto, flags).
fn backend_entries(pin_dir: &Path, addr: Ipv4Addr) -> Vec<(u16, u8, u8)> {
    let data = MapData::from_pin(pin_dir.join(MAP_BACKENDS)).expect("pinned BACKENDS map");
    let map: aya::maps::HashMap<MapData, u32, Backend> =
        aya::maps::HashMap::try_from(Map::HashMap(data)).expect("BACKENDS is a hash map");
    let mut out: Vec<(u16, u8, u8)> = map
        .iter()
        .filter_map(Result::ok)
        .filter(|(_, b)| b.addr == addr.octets())
        .map(|(_, b)| (u16::from_be_bytes(b.port), b.proto, b.flags))
        .collect();
    out.sort();
    out
}

/// A pod whose readiness probe fails keeps its open TCP connections, as with kube-proxy: a long
/// transfer through the ClusterIP to pod X (be1) completes with every byte after X turns not
/// ready, new requests never reach X, and a UDP flow to X moves to another backend (upstream
/// clears UDP conntrack for endpoints no longer serving). Once X leaves the EndpointSlice its
/// backend entry goes and its other open connection is reset (the datapath answers the client's
/// next segment with a RST).
#[test]
fn a_not_ready_endpoint_keeps_its_tcp_connections_until_it_leaves_the_slice() {
    require_privileged!();
    let ips = backend_ips();
    let (x, others) = (ips[0], &ips[1..]);
    let env = Env::start(vec![flap_service(), flap_slice(&[(x, Cond::Ready)])]);
    env.wait_frontend(FLAP, Some(1), Duration::from_secs(10));

    let tmp = env.topo.tmp().path().to_path_buf();
    let script = |name: &str, text: &str| {
        let path = tmp.join(name);
        std::fs::write(&path, text).expect("writing a helper script");
        path.to_str().expect("utf-8 path").to_owned()
    };
    let server_py = script("flap_server.py", FLAP_STREAM_SERVER_PY);
    let client_py = script("flap_client.py", FLAP_STREAM_CLIENT_PY);
    let udp_py = script("flap_udp.py", FLAP_UDP_FLOW_PY);
    let be1 = env
        .topo
        .pod("be1")
        .unwrap_or_else(|e| env.fail(&format!("{e:#}")));
    // Stream A lasts 6 s (it ends while X is not ready); stream B 40 s (X leaves the slice
    // before it ends).
    let mut servers = Vec::new();
    let mut logs = Vec::new();
    for (port, secs) in [(9000u16, 6u32), (9001, 40)] {
        let ready = tmp.join(format!("flap-{port}.ready"));
        let log = tmp.join(format!("flap-{port}.log"));
        let server = be1
            .ns()
            .spawn(
                &[
                    "python3",
                    &server_py,
                    &port.to_string(),
                    &secs.to_string(),
                    ready.to_str().expect("utf-8 path"),
                ],
                Some(&log),
            )
            .unwrap_or_else(|e| env.fail(&format!("stream server {port}: {e:#}")));
        wait_for(Duration::from_secs(10), "the stream server", || {
            ready.exists()
        })
        .unwrap_or_else(|e| env.fail(&format!("stream server {port}: {e:#}")));
        servers.push(server);
        logs.push(log);
    }
    let sent = |log: &Path| -> (u64, bool) {
        let text = std::fs::read_to_string(log).unwrap_or_default();
        let n = (text.lines())
            .rev()
            .find_map(|l| l.strip_prefix("sent ")?.trim().parse().ok())
            .unwrap_or(0);
        (n, text.lines().any(|l| l.starts_with("done ")))
    };
    let client = env.topo.pod("client").expect("client pod").ns();
    let resets_before = env.agent.counter("stale_backend_reset").unwrap_or(0);
    let report = |out: anyhow::Result<std::process::Output>, what: &str| -> Value {
        let out = out.unwrap_or_else(|e| env.fail(&format!("{what}: {e:#}")));
        serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
            env.fail(&format!(
                "{what} printed no report ({e}): {} {}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            ))
        })
    };
    let vip = FLAP.to_string();
    let (a, b, udp) = thread::scope(|s| {
        let stream = |port: &'static str, limit: u64| {
            let (vip, client_py) = (&vip, &client_py);
            s.spawn(move || {
                client.output(
                    &["python3", client_py, vip, port, "5"],
                    Duration::from_secs(limit),
                )
            })
        };
        let a = stream("9000", 30);
        let b = stream("9001", 60);
        let udp = s.spawn(|| {
            client.output(
                &["python3", &udp_py, &vip, "53", "60", "0.1"],
                Duration::from_secs(30),
            )
        });
        // Both streams and the UDP flow run to X; then X turns not ready and two ready
        // endpoints appear.
        thread::sleep(Duration::from_millis(1500));
        let flows_to_x = env.agent.counter("established_flow").unwrap_or(0);
        env.check(flows_to_x > 0, || "no established flow yet".to_owned());
        let mut eps = vec![(x, Cond::NotReady)];
        eps.extend(others.iter().map(|ip| (*ip, Cond::Ready)));
        env.api.apply(flap_slice(&eps)).expect("X not ready");
        env.wait_frontend(FLAP, Some(2), Duration::from_secs(10));
        let entries = backend_entries(env.pins.path(), x);
        env.check(
            [9000, 9001, 8080, 5353].iter().all(|port| {
                entries
                    .iter()
                    .any(|(p, _, f)| p == port && f & backend_flags::NOT_SERVING != 0)
            }),
            || format!("X's backend entries stay, flagged not serving: {entries:?}"),
        );
        // New requests never reach X.
        let c = env.distribution(FLAP, 40);
        env.check(!c.is_empty() && !c.contains_key("be1"), || {
            format!("new requests after X turned not ready: {c:?}")
        });
        let a = report(a.join().expect("stream A thread"), "stream A");
        let udp = report(udp.join().expect("UDP thread"), "UDP flow");
        // X leaves the slice: its entries go, stream B (still open) is reset.
        env.api
            .apply(flap_slice(&eps[1..]))
            .expect("X removed from the slice");
        let deadline = Instant::now() + Duration::from_secs(10);
        while !backend_entries(env.pins.path(), x).is_empty() {
            env.check(Instant::now() < deadline, || {
                "X's backend entries are still there 10 s after it left the slice".to_owned()
            });
            thread::sleep(Duration::from_millis(20));
        }
        let b = report(b.join().expect("stream B thread"), "stream B");
        (a, b, udp)
    });
    let (sent_a, done_a) = sent(&logs[0]);
    let (sent_b, _) = sent(&logs[1]);
    eprintln!(
        "stream A: {a} (server sent {sent_a}, done {done_a}); stream B: {b} (server sent {sent_b})"
    );
    eprintln!("UDP flow: {udp}");
    env.check(
        a["error"].is_null() && a["eof"] == true && a["mismatch"].is_null(),
        || format!("the transfer to X broke when X turned not ready: {a}"),
    );
    env.check(done_a && sent_a > 0 && a["bytes"] == sent_a, || {
        format!(
            "the client received {} of the {sent_a} bytes sent",
            a["bytes"]
        )
    });

    // The UDP flow: X's answers first, then only the others', every datagram answered from
    // the VIP.
    let replies = udp.as_array().cloned().unwrap_or_default();
    let from_x = |r: &Value| r[1].as_str().is_some_and(|b| b.starts_with("be1:"));
    env.check(
        replies.len() == 60 && replies.iter().all(|r| r[0] == format!("{FLAP}:53")),
        || format!("every datagram answered from {FLAP}:53: {udp}"),
    );
    let moved = replies.iter().position(|r| !from_x(r));
    env.check(
        from_x(&replies[0]) && moved.is_some_and(|m| replies[m..].iter().all(|r| !from_x(r))),
        || format!("the UDP flow moved from X to another backend, once: {udp}"),
    );

    // Stream B: reset once X left the slice (before its server finished).
    let resets = env.agent.counter("stale_backend_reset").unwrap_or(0) - resets_before;
    env.check(
        b["error"]
            .as_str()
            .is_some_and(|e| e.contains("ConnectionResetError"))
            && b["eof"] == false
            && b["mismatch"].is_null()
            && resets > 0,
        || format!("stream B: {b}; {resets} resets counted"),
    );
    drop(servers);
}

#[test]
fn malformed_objects_are_reported_and_the_rest_keep_working() {
    require_privileged!();
    let ips = backend_ips();
    let mut bad_ip = service("bad-ip", OTHER, 80);
    bad_ip["spec"]["clusterIP"] = json!("10.96.0.999");
    bad_ip["spec"]["clusterIPs"] = json!(["10.96.0.999"]);
    let mut port_zero = service("port-zero", NEW, 80);
    port_zero["spec"]["ports"][0]["port"] = json!(0);
    let mut no_ports = service("no-ports", Ipv4Addr::new(10, 96, 0, 40), 80);
    no_ports["spec"]
        .as_object_mut()
        .expect("spec")
        .remove("ports");
    let mut no_spec = service("no-spec", Ipv4Addr::new(10, 96, 0, 50), 80);
    no_spec.as_object_mut().expect("svc").remove("spec");
    let mut bad_slice = slice("web", "bad", &ready(&ips[1..2]));
    bad_slice["endpoints"][0]["addresses"] = json!(["not-an-ip"]);
    bad_slice["ports"][0]["port"] = json!(70000);
    let env = Env::start(vec![
        service("web", WEB, 80),
        slice("web", "a", &ready(&ips[..1])),
        bad_ip,
        port_zero,
        no_ports,
        no_spec,
        bad_slice,
    ]);
    env.wait_frontend(WEB, Some(1), Duration::from_secs(5));
    let status = env.agent.status().ok().flatten().unwrap_or_default();
    env.check(status.frontends == 1 && status.problems >= 3, || {
        format!("want 1 frontend and ≥3 problems reported: {status:?}")
    });
    let log = std::fs::read_to_string(env.agent.log_path()).unwrap_or_default();
    for name in ["demo/bad-ip", "demo/port-zero", "demo/web-bad"] {
        env.check(log.contains(name), || {
            format!("{name} not reported in the log")
        });
    }
    let c = env.distribution(WEB, 10);
    env.check(Env::names(&c) == ["be1"], || {
        format!("the valid Service works: {c:?}")
    });

    // Fixing a bad object makes it work; the good one is untouched.
    let mut fixed = service("port-zero", NEW, 80);
    fixed["spec"]["ports"][0]["port"] = json!(80);
    env.api.apply(fixed).expect("fix");
    env.api
        .apply(slice("port-zero", "a", &ready(&ips[2..])))
        .expect("slice");
    env.wait_frontend(NEW, Some(1), Duration::from_secs(5));
    let c = env.distribution(NEW, 5);
    env.check(Env::names(&c) == ["be3"], || {
        format!("fixed Service: {c:?}")
    });
}

/// A Service whose externalIP is another Service's ClusterIP (and is older, and first by name)
/// does not get that ClusterIP's traffic; the loser gets one Warning Event (not one per sync),
/// keeps its own ClusterIP, and takes the frontend when the winner is deleted; when the winner
/// comes back it takes the frontend back and the conflict is published again.
#[test]
fn a_service_cannot_take_another_s_cluster_ip_and_gets_one_event() {
    require_privileged!();
    let ips = backend_ips();
    let mut objects = clashing_services();
    objects.push(slice("web", "a", &ready(&ips[..1])));
    objects.push(slice("intruder", "a", &ready(&ips[1..2])));
    let mut env = Env::start(objects);
    env.wait_frontend(WEB, Some(1), Duration::from_secs(5));
    let c = env.distribution(WEB, 10);
    env.check(Env::names(&c) == ["be1"], || {
        format!("the ClusterIP stays web's: {c:?}")
    });
    let c = env.distribution(OTHER, 5);
    env.check(Env::names(&c) == ["be2"], || {
        format!("the intruder keeps its own ClusterIP: {c:?}")
    });
    wait_for(Duration::from_secs(5), "the conflict's Event", || {
        !env.api.events().is_empty()
    })
    .unwrap_or_else(|e| env.fail(&format!("{e:#}")));
    let first = env.api.events();
    check_conflict_event(&first[0]).unwrap_or_else(|e| env.fail(&e));

    // More syncs while the conflict lasts: no further Event.
    let syncs = env.agent.status().ok().flatten().unwrap_or_default().syncs;
    env.api
        .apply(slice("web", "b", &ready(&ips[2..])))
        .expect("slice b");
    env.wait_frontend(WEB, Some(2), Duration::from_secs(5));
    env.agent
        .wait_synced(syncs + 1, Duration::from_secs(5))
        .unwrap_or_else(|e| env.fail(&format!("{e:#}")));
    thread::sleep(Duration::from_millis(300));
    let events = env.api.events();
    env.check(events.len() == 1, || {
        format!("one Event per conflict, not per sync: {events:#?}")
    });

    // The winner deleted: the intruder's externalIP frontend is programmed at the next sync.
    env.api.delete(Kind::Service, "demo", "web");
    env.wait_frontend(WEB, Some(1), Duration::from_secs(5));
    let c = env.distribution(WEB, 10);
    env.check(Env::names(&c) == ["be2"], || {
        format!("the externalIP frontend after the winner left: {c:?}")
    });

    // The winner back: it takes its ClusterIP back; the conflict appears again and is
    // published again (kube-rs's Recorder sends it as a series update of the first Event).
    env.api.apply(clashing_services().remove(0)).expect("web");
    env.wait_frontend(WEB, Some(2), Duration::from_secs(5));
    let c = env.distribution(WEB, 20);
    env.check(Env::names(&c) == ["be1", "be3"], || {
        format!("web's ClusterIP again: {c:?}")
    });
    wait_for(Duration::from_secs(5), "the second Event", || {
        env.api.events().len() >= 2
    })
    .unwrap_or_else(|e| env.fail(&format!("{e:#}")));
    let events = env.api.events();
    env.check(events.len() == 2 && events[1].method == "PATCH", || {
        format!("the reappeared conflict: {events:#?}")
    });
}

#[test]
fn api_outage_keeps_traffic_flowing_and_changes_apply_after_it() {
    require_privileged!();
    let ips = backend_ips();
    let mut env = Env::start(vec![
        service("web", WEB, 80),
        slice("web", "a", &ready(&ips)),
        service("other", OTHER, 80),
        slice("other", "a", &ready(&ips[..1])),
    ]);
    env.wait_frontend(OTHER, Some(1), Duration::from_secs(5));
    let log_before = agent_log(&env.agent);
    env.api.stop();
    let down = Instant::now();
    // Changes made in the server's store while the agent cannot see them; history compacted
    // so the agent must relist (and learn of the deletion only from the relist).
    env.api.delete(Kind::Service, "demo", "other");
    env.api.delete(Kind::EndpointSlice, "demo", "other-a");
    env.api.apply(service("new", NEW, 80)).expect("new");
    env.api
        .apply(slice("new", "a", &ready(&ips[1..2])))
        .expect("slice");
    env.api.expire_watches();

    let mut rounds = 0;
    while down.elapsed() < Duration::from_secs(30) {
        let c = env.distribution(WEB, 6);
        env.check(!c.is_empty(), || "no answers during the outage".into());
        let c = env.distribution(OTHER, 2);
        env.check(Env::names(&c) == ["be1"], || {
            format!("other during the outage: {c:?}")
        });
        rounds += 1;
        thread::sleep(Duration::from_secs(3));
    }
    let running = env.agent.is_running();
    env.check(running, || "agent exited during the outage".into());
    let services = open_services(env.pins.path());
    env.check(frontend_count(&services, NEW, 80).is_none(), || {
        "the new Service appeared while the API server was down?".into()
    });
    eprintln!("outage: {rounds} rounds of requests during 30 s, all answered");

    env.api.resume().expect("resume");
    let back = Instant::now();
    env.wait_frontend(NEW, Some(1), Duration::from_secs(60));
    env.wait_frontend(OTHER, None, Duration::from_secs(5));
    eprintln!("API server back: converged after {:?}", back.elapsed());
    let c = env.distribution(NEW, 5);
    env.check(Env::names(&c) == ["be2"], || format!("new Service: {c:?}"));
    let c = env.distribution(WEB, 30);
    env.check(c.len() == 3, || format!("web after the outage: {c:?}"));

    // Like kube-proxy, which logs nothing at its default level through such an outage: the
    // outage once when it starts, its end once when every watch is back, no line per retry.
    let log = agent_log(&env.agent);
    let during = log.get(log_before.len()..).unwrap_or_default();
    let warnings: Vec<&str> = during
        .lines()
        .filter(|l| l.contains(" WARN ") || l.contains(" ERROR "))
        .collect();
    let outage: Vec<&str> = during
        .lines()
        .filter(|l| l.contains("API server unreachable"))
        .collect();
    let recovered: Vec<&str> = during
        .lines()
        .filter(|l| l.contains("API server reachable again"))
        .collect();
    eprintln!(
        "log during the outage and after: {} WARN/ERROR lines, {} outage, {} recovery",
        warnings.len(),
        outage.len(),
        recovered.len()
    );
    env.check(
        warnings.len() == 1 && outage.len() == 1 && recovered.len() == 1,
        || {
            format!(
                "want exactly one warning (the outage) and one recovery line, got:\n{}",
                during
                    .lines()
                    .filter(|l| !l.contains(" DEBUG ") && !l.contains(" TRACE "))
                    .collect::<Vec<_>>()
                    .join("\n")
            )
        },
    );
}

/// The agent's log so far, without colour codes.
fn agent_log(agent: &Agent) -> String {
    strip_ansi(&std::fs::read_to_string(agent.log_path()).unwrap_or_default())
}

/// The pinned `SVCCIDRS_V1` entries: (prefix length, address) → `service_cidr::*`.
fn service_cidr_entries(pin_dir: &Path) -> BTreeMap<(u32, [u8; 4]), u32> {
    let data = MapData::from_pin(pin_dir.join(MAP_SERVICE_CIDRS)).expect("pinned SVCCIDRS map");
    let map: LpmTrie<MapData, [u8; 4], u32> =
        LpmTrie::try_from(Map::LpmTrie(data)).expect("SVCCIDRS is an LPM trie");
    map.iter()
        .filter_map(Result::ok)
        .map(|(k, v): (Key<[u8; 4]>, u32)| ((k.prefix_len(), k.data()), v))
        .collect()
}

/// ServiceCIDR objects (networking.k8s.io/v1) are watched: their IPv4 CIDRs guard the Service
/// address space like `--service-cidr` (unallocated addresses dropped), and follow the API.
#[test]
fn service_cidr_objects_are_watched_and_unallocated_addresses_dropped() {
    require_privileged!();
    let ips = backend_ips();
    let env = Env::start(vec![
        service("web", WEB, 80),
        slice("web", "a", &ready(&ips)),
        service_cidr("kubernetes", "10.96.0.0/16"),
    ]);
    let want = |cidr: bool| {
        let mut m = BTreeMap::from([((32, WEB.octets()), service_cidr::CLUSTER_IP)]);
        if cidr {
            m.insert((16, [10, 96, 0, 0]), service_cidr::UNALLOCATED);
        }
        m
    };
    let wait = |cidr: bool| {
        let started = Instant::now();
        loop {
            let now = service_cidr_entries(env.pins.path());
            if now == want(cidr) {
                return;
            }
            if started.elapsed() > Duration::from_secs(10) {
                env.fail(&format!("SVCCIDRS_V1 holds {now:?}, want {:?}", want(cidr)));
            }
            thread::sleep(Duration::from_millis(20));
        }
    };
    wait(true);
    let (outcome, _) = env
        .topo
        .tcp_connect(Ipv4Addr::new(10, 96, 0, 77), 80, Duration::from_secs(2))
        .unwrap_or_else(|e| env.fail(&format!("connect helper: {e:#}")));
    env.check(outcome == ConnectOutcome::TimedOut, || {
        format!("connect to an unallocated address of the ServiceCIDR: {outcome:?}, want dropped")
    });
    let c = env.distribution(WEB, 6);
    env.check(!c.is_empty(), || "web through its ClusterIP".into());
    env.api.delete(Kind::ServiceCidr, "", "kubernetes");
    wait(false);
}

/// An API server without the ServiceCIDR API (Kubernetes < 1.33): the other reflectors work,
/// and the ServiceCIDR one asks once and stops (no retry loop, no warning per retry).
#[tokio::test]
async fn service_cidr_api_not_served_is_asked_once_and_left_alone() {
    let server = FakeApiServer::start().expect("fake API server");
    server.unserve(Kind::ServiceCidr);
    server.apply(node("zone-a")).expect("node");
    server.apply(service("web", WEB, 80)).expect("svc");
    server
        .apply(slice("web", "a", &ready(&backend_ips()[..1])))
        .expect("slice");
    let source = connect(&server).await;
    assert_eq!(
        frontends(&source),
        BTreeMap::from([(WEB, vec![backend_ips()[0]])])
    );
    // Longer than the reflectors' whole backoff ladder (0.5 + 1 + 2 s).
    tokio::time::sleep(Duration::from_secs(4)).await;
    let asked = server
        .requests()
        .iter()
        .filter(|r| r.contains(Kind::ServiceCidr.path()))
        .count();
    assert_eq!(asked, 1, "ServiceCIDR requests: {:?}", server.requests());
    assert!(source.state().service_cidrs.is_empty());
}

// ---------------------------------------------------------------------------------------------
// Numbers (printed, not asserted)

/// The log without terminal colour codes (ESC [ ... m).
fn strip_ansi(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    let mut chars = s.chars();
    while let Some(c) = chars.next() {
        if c == '\x1b' {
            for c in chars.by_ref() {
                if c == 'm' {
                    break;
                }
            }
        } else {
            out.push(c);
        }
    }
    out
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    let idx = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[idx.min(sorted.len() - 1)]
}

#[test]
fn kube_scale_numbers() {
    require_privileged!();
    // The real numbers need an optimised agent: `cargo test --release`. A debug build (what
    // `cargo xtask test` runs) only checks the measurement works, at a tenth of the scale.
    let release = !cfg!(debug_assertions);
    let (mut services_n, changes_n) = if release { (10_000, 100) } else { (1_000, 20) };
    // `KPE_SCALE_SERVICES=50000`: another scale (the maps are then sized for it).
    if let Some(n) = std::env::var("KPE_SCALE_SERVICES")
        .ok()
        .and_then(|v| v.parse().ok())
    {
        services_n = n;
    }
    const ENDPOINTS: usize = 10;
    if !release {
        eprintln!(
            "NUMBERS note: debug build, reduced scale; run with --release for the real numbers"
        );
    }
    proxy_testenv::ensure_bpffs().expect("bpffs");
    let topo = Topology::bare().expect("node namespace");
    let api = FakeApiServer::start_in(Some(&topo.node().path())).expect("fake API server");
    api.apply(node("zone-a")).expect("node");
    let t = Instant::now();
    for i in 0..services_n {
        let name = format!("svc-{i}");
        api.apply(service(&name, scale_vip(i), 80)).expect("svc");
        api.apply(slice(&name, "a", &scale_endpoints(i, ENDPOINTS)))
            .expect("slice");
    }
    eprintln!(
        "fixture: {services_n} Services × {ENDPOINTS} endpoints in the fake API server in {:?}",
        t.elapsed()
    );
    let kubeconfig = api
        .write_kubeconfig(&topo.tmp().path().join("kubeconfig"))
        .expect("kubeconfig");
    let pins = PinDir::new(&format!("{}-pins", topo.prefix())).expect("pin dir");
    let started = Instant::now();
    // Room for every Service × ENDPOINTS with headroom (the defaults hold ~24,000 × 10).
    let sizes = [
        (
            "--map-entries-services",
            services_n * (ENDPOINTS + 1) * 11 / 10,
        ),
        ("--map-entries-backends", services_n * ENDPOINTS * 11 / 10),
        ("--map-entries-revnat", services_n * 11 / 10),
    ]
    .map(|(flag, n)| [flag.to_owned(), n.max(65_536).to_string()]);
    let mut args = vec!["--hostname-override", NODE, "--min-sync-period", "0s"];
    if services_n > 20_000 {
        args.extend(sizes.iter().flatten().map(String::as_str));
    }
    let mut agent = Agent::start_kube(
        Path::new(BIN),
        topo.node(),
        &kubeconfig,
        &args,
        pins.path(),
        topo.tmp().path(),
    )
    .expect("agent");
    let status = agent
        .wait_synced(1, Duration::from_secs(120))
        .unwrap_or_else(|e| panic!("{e:#}"));
    let first = started.elapsed();
    let log = strip_ansi(&std::fs::read_to_string(agent.log_path()).unwrap_or_default());
    let field = |line_has: &str, key: &str| -> String {
        log.lines()
            .find(|l| l.contains(line_has))
            .and_then(|l| l.split_whitespace().find_map(|w| w.strip_prefix(key)))
            .unwrap_or("?")
            .to_owned()
    };
    let list_ms = field("initial state complete", "took_ms=");
    let sync_us = field(" synced", "took_us=");
    let pid = agent.pid().expect("pid");
    thread::sleep(Duration::from_secs(1));
    let rss = rss_kib(pid);
    eprintln!(
        "NUMBERS first sync: {} frontends, {} backends; agent start → status written {first:?} \
         (initial lists {list_ms} ms, sync itself {sync_us} µs)",
        status.frontends, status.backends
    );
    eprintln!(
        "NUMBERS agent RSS after the first sync: {:.1} MiB (VmHWM {:.1} MiB)",
        rss as f64 / 1024.0,
        status_kib(pid, "VmHWM:") as f64 / 1024.0
    );

    // API change → map: add an 11th endpoint to one Service (or take it away), note the time
    // just before the server emits the event, poll the pinned SERVICES map for the new count.
    let services = open_services(pins.path());
    let mut latencies = Vec::with_capacity(changes_n);
    for n in 0..changes_n {
        let i = (n * 97) % services_n;
        let name = format!("svc-{i}");
        let was = frontend_count(&services, scale_vip(i), 80).unwrap_or(0);
        let want = if was as usize == ENDPOINTS {
            ENDPOINTS + 1
        } else {
            ENDPOINTS
        };
        let body = slice(&name, "a", &scale_endpoints(i, want));
        let t0 = Instant::now();
        api.apply(body).expect("change");
        loop {
            if frontend_count(&services, scale_vip(i), 80) == Some(want as u16) {
                latencies.push(t0.elapsed());
                break;
            }
            assert!(
                t0.elapsed() < Duration::from_secs(10),
                "change {n} not in the map within 10 s\n{}",
                agent.log_tail()
            );
            thread::sleep(Duration::from_micros(200));
        }
        thread::sleep(Duration::from_millis(50));
    }
    latencies.sort();
    eprintln!(
        "NUMBERS API event → map over {changes_n} endpoint changes at {services_n} Services: p50 {:?}, p90 {:?}, p99 {:?}, max {:?} (--min-sync-period 0s)",
        percentile(&latencies, 0.5),
        percentile(&latencies, 0.9),
        percentile(&latencies, 0.99),
        latencies[latencies.len() - 1]
    );
    eprintln!(
        "NUMBERS agent RSS after the changes: {:.1} MiB",
        rss_kib(pid) as f64 / 1024.0
    );
    // Where the time goes, from the agent's log (read_us needs RUST_LOG=...agent=debug).
    let log = strip_ansi(&std::fs::read_to_string(agent.log_path()).unwrap_or_default());
    let values = |key: &str| -> Vec<u64> {
        let mut v: Vec<u64> = log
            .lines()
            .filter_map(|l| l.split_whitespace().find_map(|w| w.strip_prefix(key)))
            .filter_map(|n| n.parse().ok())
            .collect();
        v.sort_unstable();
        v
    };
    let median = |v: &[u64]| v.get(v.len() / 2).copied();
    let (read, took) = (values("read_us="), values("took_us="));
    eprintln!(
        "NUMBERS per sync (median of {} syncs): source state read {:?} µs, translate+diff+apply {:?} µs",
        took.len(),
        median(&read),
        median(&took)
    );
    drop(agent);
}

/// Where a sync's time goes at 10,000 Services × 10 endpoints, in-process (no kernel): copying
/// the stores into a snapshot, translate, plan. `cargo test --release --test kube_api --
/// --ignored pipeline_cost --nocapture`.
#[test]
#[ignore = "numbers; run in release"]
fn pipeline_cost_at_10000_services() {
    use k8s_openapi::api::{core::v1::Service, discovery::v1::EndpointSlice};
    use kube_proxy_ebpf::{
        pipeline::{
            diff, incremental::Planner, programmed::Programmed, translate_cache::TranslateCache,
        },
        sources::{endpoints::SliceData, services::ServiceData},
    };
    const SERVICES: usize = 10_000;
    let services: Vec<Service> = (0..SERVICES)
        .map(|i| {
            let mut s: Service =
                serde_json::from_value(service(&format!("svc-{i}"), scale_vip(i), 80))
                    .expect("svc");
            kube_proxy_ebpf::sources::kube::prune::service(&mut s);
            s
        })
        .collect();
    let slices: Vec<EndpointSlice> = (0..SERVICES)
        .map(|i| {
            let mut s: EndpointSlice =
                serde_json::from_value(slice(&format!("svc-{i}"), "a", &scale_endpoints(i, 10)))
                    .expect("slice");
            kube_proxy_ebpf::sources::kube::prune::endpoint_slice(&mut s);
            s
        })
        .collect();
    let arcs: (
        kube_proxy_ebpf::sources::snapshot::Objects<ServiceData>,
        kube_proxy_ebpf::sources::snapshot::Objects<SliceData>,
    ) = (
        std::sync::Arc::new(
            (services.iter())
                .map(|s| std::sync::Arc::new(ServiceData::from(s)))
                .collect(),
        ),
        std::sync::Arc::new(
            (slices.iter())
                .map(|s| std::sync::Arc::new(SliceData::from(s)))
                .collect(),
        ),
    );
    let node = NodeContext {
        scheduler: Default::default(),
        node_name: NODE.into(),
        zone: None,
    };
    let caps = kube_proxy_ebpf::dataplane::loader::MapSizes::default().capacities();
    let mut programmed = Programmed::default();
    for round in 0..3 {
        let t = Instant::now();
        let snapshot = kube_proxy_ebpf::sources::snapshot::Snapshot {
            services: arcs.0.clone(),
            endpoint_slices: arcs.1.clone(),
        };
        let copy = t.elapsed();
        let t = Instant::now();
        let tr = translate::translate(&snapshot, &node);
        let translate_t = t.elapsed();
        let t = Instant::now();
        let plan = diff::plan(&tr.desired, &programmed, &caps);
        let plan_t = t.elapsed();
        let t = Instant::now();
        for op in &plan.ops {
            programmed.apply(op);
        }
        let apply_t = t.elapsed();
        eprintln!(
            "NUMBERS full round {round}: snapshot (shared objects) {copy:?}, translate {translate_t:?}, plan {plan_t:?} ({} ops), shadow apply {apply_t:?}",
            plan.ops.len()
        );
    }

    // The agent's path: the translation cache and the incremental planner, first a full pass,
    // then one endpoint change at a time.
    let mut programmed = Programmed::default();
    let mut planner = Planner::new(&programmed);
    let mut cache = TranslateCache::new();
    let mut snapshot = kube_proxy_ebpf::sources::snapshot::Snapshot {
        services: arcs.0.clone(),
        endpoint_slices: arcs.1.clone(),
    };
    let mut sync = |snapshot: &kube_proxy_ebpf::sources::snapshot::Snapshot, full: bool| {
        let t = Instant::now();
        let changes = cache.update(snapshot, &node, &[], full);
        planner.desired_changes(&changes, cache.desired());
        let translate_t = t.elapsed();
        let t = Instant::now();
        let plan = planner.plan(cache.desired(), &programmed, &caps, full);
        let plan_t = t.elapsed();
        let t = Instant::now();
        for op in &plan.ops {
            planner.observe(&programmed, op);
            programmed.apply(op);
        }
        planner.applied(&plan);
        (translate_t, plan_t, t.elapsed(), plan.ops.len())
    };
    let (tr, pl, ap, ops) = sync(&snapshot, true);
    eprintln!(
        "NUMBERS incremental path, first (full) sync: translate {tr:?}, plan {pl:?} ({ops} ops), shadow apply {ap:?}"
    );
    let mut totals = Vec::new();
    for n in 0..20 {
        let i = (n * 97) % SERVICES;
        let want = if n % 2 == 0 { 11 } else { 10 };
        let mut s: EndpointSlice =
            serde_json::from_value(slice(&format!("svc-{i}"), "a", &scale_endpoints(i, want)))
                .expect("slice");
        kube_proxy_ebpf::sources::kube::prune::endpoint_slice(&mut s);
        std::sync::Arc::make_mut(&mut snapshot.endpoint_slices)[i] =
            std::sync::Arc::new(SliceData::from(&s));
        let t = Instant::now();
        let shared = kube_proxy_ebpf::sources::snapshot::Snapshot {
            services: snapshot.services.clone(),
            endpoint_slices: snapshot.endpoint_slices.clone(),
        };
        let copy = t.elapsed();
        let (tr, pl, ap, ops) = sync(&shared, false);
        totals.push(copy + tr + pl + ap);
        if n < 3 {
            eprintln!(
                "NUMBERS incremental endpoint change {n}: snapshot {copy:?}, translate {tr:?}, plan {pl:?} ({ops} ops), shadow apply {ap:?}"
            );
        }
    }
    totals.sort();
    eprintln!(
        "NUMBERS incremental endpoint change, median of {}: {:?}",
        totals.len(),
        totals[totals.len() / 2]
    );
    let (tr, pl, ap, ops) = sync(&snapshot, true);
    eprintln!(
        "NUMBERS incremental path, periodic full pass: translate {tr:?}, plan {pl:?} ({ops} ops, must be 0), shadow apply {ap:?}"
    );
    assert_eq!(ops, 0, "the full pass finds nothing left to do");
}
