//! Privileged: the operational surface a kube-proxy DaemonSet spec already uses. The agent
//! started with kube-proxy's own command line (flags it honours, flags it only warns about, a
//! `--config` file with kube-proxy's precedence) in the one-node topology, from a fake API server:
//! - it syncs and serves a ClusterIP, and says once per ignored flag why;
//! - /healthz answers over IPv6 too (the 0.0.0.0 listener is dual-stack, like Go's);
//! - the nf_conntrack settings kube-proxy writes are in the node's namespace, and
//!   `--init-only` writes them and exits;
//! - the Node deleted makes /healthz 503 with `nodeEligible: false`;
//! - the configuration file changed makes the agent exit (the pod restarts with it), datapath
//!   kept.
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

use common_kube::{BIN, NODE, backend_ips, node, ready, service, slice};
use proxy_testenv::{
    Agent, FakeApiServer, PinDir, Topology, fake_apiserver::Kind, kube_proxy, require_privileged,
};

const VIP: Ipv4Addr = Ipv4Addr::new(10, 96, 11, 10);

fn config(kubeconfig: &Path, close_wait: &str) -> String {
    format!(
        "apiVersion: kubeproxy.config.k8s.io/v1alpha1\nkind: KubeProxyConfiguration\nmode: ipvs\n\
         clientConnection:\n  kubeconfig: {}\nconntrack:\n  tcpEstablishedTimeout: 24h\n  \
         tcpCloseWaitTimeout: {close_wait}\n",
        kubeconfig.display()
    )
}

fn sysctl(topo: &Topology, name: &str) -> String {
    let path = format!("/proc/sys/net/netfilter/{name}");
    topo.node()
        .exec(&["cat", &path])
        .unwrap_or_else(|e| panic!("{path}: {e:#}"))
        .trim()
        .to_owned()
}

/// `GET http://<host>:10256/healthz` in the node: (status code, body).
fn healthz(topo: &Topology, host: &str) -> (u16, String) {
    proxy_testenv::http_status(topo.node(), &format!("http://{host}:10256/healthz"))
        .expect("curl /healthz")
}

#[test]
fn kube_proxy_s_command_line_and_config_run_as_they_are() {
    require_privileged!();
    proxy_testenv::ensure_bpffs().expect("bpffs");
    let topo = Topology::new().expect("topology");
    // kube-proxy was here: its nat chains (which load nf_conntrack) stay behind.
    kube_proxy::install(
        topo.node(),
        &kube_proxy::nft_ruleset(&[], "10.244.0.0/16"),
        topo.tmp().path(),
    )
    .expect("kube-proxy's table");
    let api = FakeApiServer::start_in(Some(&topo.node().path())).expect("fake API server");
    api.apply_all([
        node("zone-a"),
        service("web", VIP, 80),
        slice("web", "1", &ready(&backend_ips())),
    ])
    .expect("objects");
    let tmp = topo.tmp().path();
    let kubeconfig = api
        .write_kubeconfig(&tmp.join("kubeconfig"))
        .expect("kubeconfig");
    let config_file = tmp.join("config.conf");
    std::fs::write(&config_file, config(&kubeconfig, "1h")).expect("config");
    let config_arg = format!("--config={}", config_file.display());
    let hostname = format!("--hostname-override= {} ", NODE.to_uppercase());
    // As a kube-proxy DaemonSet's args carry them.
    let line = [
        config_arg.as_str(),
        hostname.as_str(),
        "--proxy-mode=ipvs",
        "--ipvs-scheduler=rr",
        "--masquerade-all",
        "--feature-gates=SomeGate=true",
        "--oom-score-adj=-999",
        "--kube-api-qps=20",
        "--kube-api-burst",
        "30",
        "--cluster-cidr=100.64.0.0/10",
        "--v=2",
    ];
    let args: Vec<&std::ffi::OsStr> = line.iter().map(|a| a.as_ref()).collect();
    let pins = PinDir::new(&format!("{}-pins", topo.prefix())).expect("pins");
    let mut agent =
        Agent::start_with(Path::new(BIN), topo.node(), &args, pins.path(), tmp).expect("agent");
    agent
        .wait_attached(&topo.pod_interfaces())
        .unwrap_or_else(|e| panic!("{e:#}"));
    let replies = topo
        .curl_many(&format!("http://{VIP}/"), 4)
        .unwrap_or_else(|e| agent.fail(&format!("{e:#}")));
    agent.check(replies.iter().all(|r| r.is_ok()), || format!("{replies:?}"));
    let log = std::fs::read_to_string(agent.log_path()).expect("agent log");
    for said in [
        "--masquerade-all accepted and ignored",
        "--feature-gates accepted and ignored",
        "--kube-api-qps/--kube-api-burst accepted and ignored",
        "--cluster-cidr ignored: with --config the configuration file decides",
        "--proxy-mode, --iptables-*/--ipvs-* sync periods and scheduler",
        // Adjusted, or (root without CAP_SYS_RESOURCE, as here and in the DaemonSet) said why not.
        "oom",
        "node=node-1",
    ] {
        agent.check(log.to_lowercase().contains(&said.to_lowercase()), || {
            format!("the log does not say {said:?}")
        });
    }
    agent.check(
        sysctl(&topo, "nf_conntrack_tcp_timeout_established") == "86400"
            && sysctl(&topo, "nf_conntrack_tcp_timeout_close_wait") == "3600",
        || "kube-proxy's nf_conntrack timeouts are not in the node's namespace".into(),
    );

    // /healthz on both families, then the Node gone.
    for host in ["127.0.0.1", "[::1]"] {
        let (code, body) = healthz(&topo, host);
        agent.check(code == 200 && body.contains("\"IPv4\""), || {
            format!("/healthz over {host}: {code} {body}")
        });
    }
    assert!(api.delete(Kind::Node, "", NODE));
    let deadline = Instant::now() + Duration::from_secs(10);
    let (code, body) = loop {
        let (code, body) = healthz(&topo, "127.0.0.1");
        if code == 503 || Instant::now() > deadline {
            break (code, body);
        }
        thread::sleep(Duration::from_millis(100));
    };
    agent.check(
        code == 503 && body.contains("\"nodeEligible\":false"),
        || format!("/healthz with the Node deleted: {code} {body}"),
    );
    api.apply(node("zone-a")).expect("node back");

    // The ConfigMap changes: the agent exits for the pod to restart with it; pins stay.
    std::fs::write(&config_file, config(&kubeconfig, "2h")).expect("config changed");
    let deadline = Instant::now() + Duration::from_secs(15);
    while agent.is_running() && Instant::now() < deadline {
        thread::sleep(Duration::from_millis(100));
    }
    let running = agent.is_running();
    agent.check(!running, || {
        "the agent kept running with a changed configuration file".into()
    });
    let status = agent.stop().expect("exit status");
    agent.check(!status.success() && pins.exists(), || {
        format!("exit {status}, pins kept: {}", pins.exists())
    });
    let log = std::fs::read_to_string(agent.log_path()).expect("agent log");
    agent.check(
        log.contains("the configuration file changed: exiting"),
        || "no log line about the changed file".into(),
    );

    // The init container's step: writes the settings and exits.
    let out = proxy_testenv::cli(
        Path::new(BIN),
        &topo.node().path(),
        &["--init-only", &config_arg],
    )
    .expect("--init-only");
    agent.check(out.status.success(), || {
        format!("--init-only: {}", String::from_utf8_lossy(&out.stderr))
    });
    agent.check(
        sysctl(&topo, "nf_conntrack_tcp_timeout_close_wait") == "7200",
        || "--init-only did not write the new close-wait timeout".into(),
    );
}
