//! Privileged: the agent needs no capability beyond the ones deploy/daemonset.yaml grants it
//! (CAP_BPF, CAP_NET_ADMIN, CAP_PERFMON), and `cleanup` none beyond the ones
//! deploy/cleanup-daemonset.yaml grants (CAP_BPF, CAP_NET_ADMIN). The lists are read from the
//! manifests; the processes run as uid 0 with exactly those capabilities as their bounding,
//! permitted and effective sets (`setpriv`, with no_new_privs), which is what a container with
//! `runAsUser: 0`, `capabilities: {drop: [ALL], add: [...]}` and
//! `allowPrivilegeEscalation: false` gets. Seccomp is not reproduced here (see the "Least
//! privilege" part of docs/replacing-kube-proxy.md for the runtime profiles).
//!
//! Run by `sudo cargo xtask test` (KPE_PRIVILEGED=1, one test thread); skipped otherwise. Each
//! test builds its own topology, pin dir and manifests in namespaces it creates; RAII guards
//! remove them even when an assertion fails.

mod common_netns;

use std::{
    net::Ipv4Addr,
    os::unix::fs::PermissionsExt as _,
    path::{Path, PathBuf},
    time::Duration,
};

use common_netns::{BIN, METRICS_URL, distribution};
use proxy_testenv::{
    Agent, BACKENDS, ManifestDir, PinDir, ServicePort, Topology, cli, require_privileged,
};
use serde_json::Value;

const WEB: Ipv4Addr = Ipv4Addr::new(10, 96, 0, 10);

/// `capabilities.add` of container `container` in the DaemonSet of deploy/`file`.
fn manifest_caps(file: &str, container: &str) -> Vec<String> {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../deploy")
        .join(file);
    let text = std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("reading {}: {e}", path.display()));
    let docs: Vec<Value> = serde_saphyr::from_multiple(&text)
        .unwrap_or_else(|e| panic!("{}: not YAML: {e}", path.display()));
    let pod = &docs
        .iter()
        .find(|d| d["kind"] == "DaemonSet")
        .unwrap_or_else(|| panic!("{file}: no DaemonSet"))["spec"]["template"]["spec"];
    let all = ["initContainers", "containers"]
        .iter()
        .filter_map(|k| pod[*k].as_array())
        .flatten();
    let c = all
        .clone()
        .find(|c| c["name"] == container)
        .unwrap_or_else(|| panic!("{file}: no container {container}"));
    let add = c["securityContext"]["capabilities"]["add"]
        .as_array()
        .unwrap_or_else(|| panic!("{file} {container}: no capabilities.add"));
    add.iter()
        .map(|v| v.as_str().expect("capability name").to_owned())
        .collect()
}

/// An executable in `dir` that runs the agent binary with its arguments, as uid 0 holding only
/// `caps` (bounding set; root's permitted and effective sets follow it across exec), no
/// inheritable or ambient capabilities and no_new_privs. `exec` all the way: the wrapper's PID
/// is the agent's.
fn reduced(dir: &Path, name: &str, caps: &[String]) -> PathBuf {
    let set: String = caps
        .iter()
        .map(|c| format!(",+{}", c.to_lowercase()))
        .collect();
    let script = format!(
        "#!/bin/sh\nexec setpriv --no-new-privs --inh-caps=-all --bounding-set=-all{set} -- {BIN} \"$@\"\n"
    );
    let path = dir.join(name);
    std::fs::write(&path, script).expect("writing the setpriv wrapper");
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).expect("chmod");
    path
}

/// The capability mask `caps` stand for.
fn mask(caps: &[String]) -> u64 {
    caps.iter()
        .fold(0, |m, c| m | 1 << proxy_testenv::capability_bit(c))
}

/// The `Cap*` lines of /proc/`pid`/status as (name, mask).
fn proc_caps(pid: u32) -> Vec<(String, u64)> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("proc status");
    status
        .lines()
        .filter_map(|l| {
            let (k, v) = l.split_once(':')?;
            k.starts_with("Cap").then(|| {
                (
                    k.to_owned(),
                    u64::from_str_radix(v.trim(), 16).expect("hex"),
                )
            })
        })
        .collect()
}

fn web(manifests: &ManifestDir) {
    let backends: Vec<Ipv4Addr> = BACKENDS.iter().map(|(_, ip)| *ip).collect();
    manifests
        .write_service("demo", "web", WEB, &[ServicePort::tcp(80, 8080)], &backends)
        .expect("writing demo/web");
}

struct Setup {
    agent: Agent,
    pins: PinDir,
    _manifests: ManifestDir,
    topo: Topology,
}

/// The standard topology, demo/web, and the agent started through `wrapper` (not yet synced).
fn start(caps: &[String]) -> Setup {
    proxy_testenv::ensure_bpffs().expect("bpffs at /sys/fs/bpf");
    let topo = Topology::new().expect("creating the topology");
    let manifests = ManifestDir::new().expect("manifest dir");
    web(&manifests);
    let pins = PinDir::new(&format!("{}-pins", topo.prefix())).expect("pin dir");
    let wrapper = reduced(topo.tmp().path(), "agent-reduced", caps);
    let args = ["--manifests".as_ref(), manifests.path().as_os_str()];
    let agent = Agent::start_with(&wrapper, topo.node(), &args, pins.path(), topo.tmp().path())
        .unwrap_or_else(|e| panic!("starting the agent: {e:#}"));
    Setup {
        agent,
        pins,
        _manifests: manifests,
        topo,
    }
}

#[test]
fn the_agent_needs_only_the_daemonset_capabilities_and_cleanup_only_its_own() {
    require_privileged!();
    let caps = manifest_caps("daemonset.yaml", "kube-proxy-ebpf");
    let Setup {
        mut agent,
        pins,
        _manifests,
        topo,
    } = start(&caps);
    agent
        .wait_attached(&topo.pod_interfaces())
        .unwrap_or_else(|e| panic!("with only {caps:?}: {e:#}"));

    // The process really holds those capabilities and nothing else.
    let pid = agent.pid().expect("agent pid");
    let want = mask(&caps);
    for (name, got) in proc_caps(pid) {
        let expected = match name.as_str() {
            "CapInh" | "CapAmb" => 0,
            _ => want,
        };
        agent.check(got == expected, || {
            format!("agent {name} = {got:016x}, want {expected:016x} ({caps:?})")
        });
    }

    // It programmed the Service: real connections reach every backend through the ClusterIP.
    let counts = distribution(&topo, &agent, "client", WEB.into(), 80, 30);
    agent.check(
        counts.len() == BACKENDS.len() && counts.values().sum::<usize>() == 30,
        || format!("30 requests to {WEB}:80 answered by {counts:?}"),
    );
    // The pinned maps read back with the same capabilities (`dump services`).
    let pin = pins.path().to_string_lossy().into_owned();
    let out = agent
        .cli(&["dump", "services", "--pin-dir", &pin])
        .unwrap_or_else(|e| agent.fail(&format!("dump services: {e:#}")));
    let table = String::from_utf8_lossy(&out.stdout);
    agent.check(
        out.status.success() && table.contains(&format!("{WEB}:80")),
        || format!("dump services ({}):\n{table}", out.status),
    );
    // /metrics (loopback, in the node namespace) reads the per-CPU STATS map.
    let metrics = topo
        .node()
        .output(
            &["curl", "-sS", "--max-time", "3", METRICS_URL],
            Duration::from_secs(10),
        )
        .unwrap_or_else(|e| agent.fail(&format!("scraping /metrics: {e:#}")));
    let metrics = String::from_utf8_lossy(&metrics.stdout);
    let counted = metrics.lines().any(|l| {
        l.starts_with("kube_proxy_ebpf_datapath_packets_total{")
            && l.rsplit(' ').next().and_then(|v| v.parse::<f64>().ok()) > Some(0.0)
    });
    agent.check(counted, || {
        format!("no datapath packet counter above 0 in /metrics:\n{metrics}")
    });

    // A restart adopts the pinned maps and links with the same capabilities.
    agent.restart().expect("restarting the agent");
    agent
        .wait_attached(&topo.pod_interfaces())
        .unwrap_or_else(|e| panic!("restart with only {caps:?}: {e:#}"));
    let counts = distribution(&topo, &agent, "client", WEB.into(), 80, 10);
    agent.check(counts.values().sum::<usize>() == 10, || {
        format!("after the restart: {counts:?}")
    });
    agent.stop().expect("stopping the agent");

    // `cleanup` with the cleanup DaemonSet's capabilities removes pins and links.
    let cleanup_caps = manifest_caps("cleanup-daemonset.yaml", "cleanup");
    let wrapper = reduced(topo.tmp().path(), "cleanup-reduced", &cleanup_caps);
    let out = cli(
        &wrapper,
        &topo.node().path(),
        &["cleanup", "--pin-dir", &pin],
    )
    .unwrap_or_else(|e| agent.fail(&format!("running cleanup: {e:#}")));
    agent.check(out.status.success(), || {
        format!(
            "cleanup with only {cleanup_caps:?} failed ({}): {}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        )
    });
    agent.check(!pins.exists(), || {
        format!("{pin} still exists after cleanup with {cleanup_caps:?}")
    });
    let after = topo.curl(&format!("http://{WEB}/"));
    agent.check(after.is_err(), || {
        format!("the VIP still answers after cleanup: {after:?}")
    });
}

/// The capability set above is not loose: without CAP_PERFMON the kernel refuses the programs
/// (the verifier's pointer checks for unprivileged loaders), and the agent stops with an error
/// naming the program instead of running half-attached.
#[test]
fn without_perfmon_the_agent_stops_with_the_load_error() {
    require_privileged!();
    let caps: Vec<String> = manifest_caps("daemonset.yaml", "kube-proxy-ebpf")
        .into_iter()
        .filter(|c| c != "PERFMON")
        .collect();
    let Setup {
        mut agent,
        pins: _pins,
        _manifests,
        topo: _topo,
    } = start(&caps);
    let err = match agent.wait_synced(1, Duration::from_secs(30)) {
        Ok(status) => agent.fail(&format!("synced with only {caps:?}: {status:?}")),
        Err(e) => format!("{e:#}"),
    };
    agent.check(err.contains("agent exited"), || {
        format!("with only {caps:?} the agent did not exit: {err}")
    });
    let log = std::fs::read_to_string(agent.log_path()).expect("agent log");
    let named = log.lines().find(|l| l.contains("tc_ingress"));
    agent.check(
        named.is_some() && log.contains("BPF_PROG_LOAD") && log.contains("Permission denied"),
        || {
            let errors: Vec<&str> = log.lines().filter(|l| l.contains("rror")).collect();
            format!("the exit does not name the refused program load: {errors:#?}")
        },
    );
    eprintln!("without PERFMON: {}", named.unwrap_or_default());
}
