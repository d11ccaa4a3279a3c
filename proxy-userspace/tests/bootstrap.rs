//! Privileged: the agent bootstraps a node it must program before any Service works. A node
//! namespace with no pins and no kube-proxy rules; the container environment the kubelet gives
//! (KUBERNETES_SERVICE_HOST/PORT naming the `kubernetes` Service's ClusterIP, a service account
//! directory).
//! - Started with deploy/daemonset.yaml's own arguments and deploy/configmap.yaml's
//!   configuration (kubeadm's kube-proxy kubeconfig, here naming the fake API server at its real
//!   address, 127.0.0.1 of the node), it lists, syncs and serves a ClusterIP: nothing went
//!   through the ClusterIP it could not translate yet.
//! - Started with in-cluster defaults (no kubeconfig), so with the ClusterIP as its API server,
//!   it says so in one line and in /healthz, which turns 503 once the initial lists are overdue.
//!
//! Run by `sudo cargo xtask test` (sets KPE_PRIVILEGED=1, one test thread); skipped otherwise.

mod common_kube;
mod common_netns;

use std::{
    net::Ipv4Addr,
    path::Path,
    thread,
    time::{Duration, Instant},
};

use common_kube::{
    BIN, NODE, backend_ips,
    deployed::{self, DEPLOYED_KUBECONFIG, KUBELET_ENV, kubeadm_kubeconfig, service_account},
    node, ready, service, slice,
};
use proxy_testenv::{Agent, FakeApiServer, PinDir, Topology, require_privileged};

const VIP: Ipv4Addr = Ipv4Addr::new(10, 96, 9, 10);

/// The agent container's arguments from deploy/daemonset.yaml, with the pod's values filled in
/// and the paths that are mounts in the pod pointed at `config`; the flags the test harness sets
/// itself (pins, cgroup) left out.
fn daemonset_args(config: &Path) -> Vec<String> {
    let ds = deployed::daemonset();
    let argv = deployed::container_argv(deployed::container(&ds, "kube-proxy-ebpf"), NODE);
    assert_eq!(argv.get(1).map(String::as_str), Some("run"), "{argv:?}");
    argv.into_iter()
        .skip(2)
        .filter(|a| !a.starts_with("--pin-dir") && !a.starts_with("--socket-lb-cgroup"))
        .map(|a| match a.strip_prefix("--config=") {
            Some(_) => format!("--config={}", config.display()),
            None => a,
        })
        .collect()
}

/// deploy/configmap.yaml's configuration, its kubeconfig path pointed at `kubeconfig`.
fn deployed_config(kubeconfig: &Path) -> String {
    deployed::deployed_config().replace(DEPLOYED_KUBECONFIG, &kubeconfig.to_string_lossy())
}

/// `GET http://127.0.0.1:10256/healthz` in the node: (status code, body).
fn healthz(topo: &Topology) -> (u16, String) {
    proxy_testenv::http_status(topo.node(), "http://127.0.0.1:10256/healthz")
        .expect("curl /healthz")
}

#[test]
fn the_daemonset_as_deployed_reaches_its_api_server_at_its_real_address() {
    require_privileged!();
    proxy_testenv::ensure_bpffs().expect("bpffs");
    let topo = Topology::new().expect("topology");
    let api = FakeApiServer::start_in(Some(&topo.node().path())).expect("fake API server");
    api.apply_all([
        node("zone-a"),
        service("web", VIP, 80),
        slice("web", "1", &ready(&backend_ips())),
    ])
    .expect("objects");
    let tmp = topo.tmp().path();
    let sa = service_account(tmp);
    let kubeconfig = tmp.join("kubeconfig.conf");
    std::fs::write(&kubeconfig, kubeadm_kubeconfig(&api.url(), &sa)).expect("kubeconfig");
    let config = tmp.join("config.yaml");
    std::fs::write(&config, deployed_config(&kubeconfig)).expect("config");
    let args = daemonset_args(&config);
    let args: Vec<&std::ffi::OsStr> = args.iter().map(|a| a.as_ref()).collect();
    let mut env: Vec<(&str, &str)> = KUBELET_ENV.to_vec();
    let sa_dir = sa.to_string_lossy().into_owned();
    env.push(("KPE_SERVICE_ACCOUNT_DIR", &sa_dir));
    let pins = PinDir::new(&format!("{}-pins", topo.prefix())).expect("pin dir");
    let started = Instant::now();
    let mut agent =
        Agent::start_with_env(Path::new(BIN), topo.node(), &args, &env, pins.path(), tmp)
            .expect("agent");
    agent
        .wait_attached(&topo.pod_interfaces())
        .unwrap_or_else(|e| panic!("{e:#}"));
    let synced = started.elapsed();
    let replies = topo
        .curl_many(&format!("http://{VIP}/"), 6)
        .unwrap_or_else(|e| agent.fail(&format!("{e:#}")));
    for (i, r) in replies.iter().enumerate() {
        agent.check(r.as_ref().is_ok_and(|r| r.body.starts_with("be")), || {
            format!("request {i} through the ClusterIP: {r:?}")
        });
    }
    let log = agent.log_tail();
    agent.check(!log.contains("must translate that address itself"), || {
        "the real endpoint was taken for a translated one".into()
    });
    agent.check(
        log.contains(&format!("api_server={}", api.url().trim_end_matches('/'))),
        || "the agent did not use the kubeconfig's server".into(),
    );
    let (code, body) = healthz(&topo);
    agent.check(code == 200 && !body.contains("apiServerAddress"), || {
        format!("/healthz {code}: {body}")
    });
    eprintln!(
        "bootstrap: the DaemonSet's arguments, no pins: synced and attached {} ms after start",
        synced.as_millis()
    );
}

#[test]
fn in_cluster_defaults_through_the_clusterip_are_named_and_fail_healthz() {
    require_privileged!();
    proxy_testenv::ensure_bpffs().expect("bpffs");
    let topo = Topology::new().expect("topology");
    let tmp = topo.tmp().path();
    let sa = service_account(tmp);
    let sa_dir = sa.to_string_lossy().into_owned();
    let mut env: Vec<(&str, &str)> = KUBELET_ENV.to_vec();
    env.push(("KPE_SERVICE_ACCOUNT_DIR", &sa_dir));
    let args = ["--hostname-override", NODE, "--sync-period", "2s"];
    let args: Vec<&std::ffi::OsStr> = args.iter().map(|a| a.as_ref()).collect();
    let pins = PinDir::new(&format!("{}-pins", topo.prefix())).expect("pin dir");
    let started = Instant::now();
    let agent = Agent::start_with_env(Path::new(BIN), topo.node(), &args, &env, pins.path(), tmp)
        .expect("agent");
    let deadline = Instant::now() + Duration::from_secs(60);
    let (code, body) = loop {
        let (code, body) = healthz(&topo);
        if code == 503 {
            break (code, body);
        }
        agent.check(Instant::now() < deadline, || {
            format!("/healthz still {code} 60 s after start: {body}")
        });
        thread::sleep(Duration::from_millis(200));
    };
    let unhealthy_after = started.elapsed();
    agent.check(
        body.contains("\"initialListsMissing\"")
            && body.contains("\"apiServerAddress\"")
            && body.contains("10.96.0.1:443"),
        || format!("/healthz {code} without the reasons: {body}"),
    );
    let log = agent.log_tail();
    let lines: Vec<&str> = log
        .lines()
        .filter(|l| l.contains("must translate that address itself"))
        .collect();
    agent.check(
        lines.len() == 1 && lines[0].contains("`kubernetes` Service's ClusterIP"),
        || format!("want one clear line naming the ClusterIP, got {lines:?}"),
    );
    eprintln!(
        "bootstrap: in-cluster defaults through the ClusterIP: named at start, /healthz 503 after {} ms",
        unhealthy_after.as_millis()
    );
}
