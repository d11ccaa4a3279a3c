//! Privileged: pods born while the agent is away reach Services. The one-node topology with the
//! agent synced from a fake API server (`common_kube::Env`); then the agent is killed (a crash
//! loop, an upgrade) and pods are created with no agent to attach their interfaces:
//! - while no agent runs, a pod's process (in the cgroup the socket hooks cover, as every pod's
//!   is on a node: the hooks sit on the host's cgroup root) reaches a ClusterIP through the
//!   pinned socket hooks, which translate pods' sockets only while no agent runs;
//! - an agent started against an unreachable API server attaches the new pods' interfaces from
//!   the pinned state before any list, and a pod created while it waits for the API is attached
//!   as it appears: their traffic is translated by tc (the clients here run outside the hooked
//!   cgroup), with no sync having happened.
//!
//! Run by `sudo cargo xtask test` (sets KPE_PRIVILEGED=1, one test thread); skipped otherwise.

mod common_kube;
mod common_netns;

use std::{
    net::Ipv4Addr,
    thread,
    time::{Duration, Instant},
};

use common_kube::{Env, backend_ips, ready, service, slice};
use proxy_testenv::{http_get_with_peer, require_privileged};

const VIP: Ipv4Addr = Ipv4Addr::new(10, 96, 8, 10);
const LATE1: Ipv4Addr = Ipv4Addr::new(10, 244, 1, 31);
const LATE2: Ipv4Addr = Ipv4Addr::new(10, 244, 1, 32);
/// Longer than a heartbeat vouches for a killed agent (`proxy_common::presence::ALIVE_FOR_MS`).
const AFTER_HEARTBEAT: Duration = Duration::from_millis(1_300);

/// `n` requests from `pod` (outside the hooked cgroup: only tc can translate them) all answered
/// by a backend of the Service.
fn answered_by_tc(env: &Env, pod: &str, n: usize) {
    let url = format!("http://{VIP}/");
    let replies = env
        .topo
        .curl_many_from(pod, &url, n)
        .unwrap_or_else(|e| env.fail(&format!("curl from {pod}: {e:#}")));
    for (i, r) in replies.iter().enumerate() {
        match r {
            Ok(r) => env.check(r.body.starts_with("be"), || {
                format!("{pod}: request {i} answered by {:?}", r.body)
            }),
            Err(e) => env.fail(&format!("{pod}: request {i} to {url}: {e}")),
        }
    }
}

#[test]
fn pods_created_while_no_agent_runs_reach_services() {
    require_privileged!();
    let mut env = Env::start(vec![
        service("web", VIP, 80),
        slice("web", "1", &ready(&backend_ips())),
    ]);
    env.wait_frontend(VIP, Some(3), Duration::from_secs(10));
    // The socket hooks are attached after the interfaces: wait for the whole start.
    env.agent
        .wait_log(&["agent: ready"], Duration::from_secs(30))
        .unwrap_or_else(|e| panic!("{e:#}"));

    // Killed: nothing attaches the interfaces of pods created from now on.
    env.agent.kill().expect("SIGKILL");
    thread::sleep(AFTER_HEARTBEAT);
    env.topo.add_pod("late1", LATE1).expect("pod late1");
    let late1 = env.topo.pod("late1").expect("late1").ns();
    let view = http_get_with_peer(&env.agent.host(late1), VIP, 80)
        .unwrap_or_else(|e| env.fail(&format!("late1 (no agent) to the ClusterIP: {e:#}")));
    env.check(view.body.starts_with("be"), || {
        format!("late1 was answered by {view:?}")
    });
    env.check(view.peer == format!("{VIP}:80"), || {
        format!(
            "late1's socket shows its peer as {}, not the Service",
            view.peer
        )
    });
    let translated = env.agent.counter("sock_pod_translated").expect("counter");
    env.check(translated >= 1, || {
        "late1's connect() was not translated by the socket hooks".into()
    });

    // Started again while the API server is unreachable: the pinned state carries the Services.
    env.api.stop();
    let started = Instant::now();
    env.agent.restart().expect("restart");
    let attached = |iface: &str| format!("interface={iface}");
    let first = env
        .agent
        .wait_log(
            &[" attached", &attached("veth-late1")],
            Duration::from_secs(30),
        )
        .unwrap_or_else(|e| panic!("{e:#}"));
    env.topo.add_pod("late2", LATE2).expect("pod late2");
    let late2 = env
        .agent
        .wait_log(
            &[" attached", &attached("veth-late2")],
            Duration::from_secs(10),
        )
        .unwrap_or_else(|e| panic!("{e:#}"));
    answered_by_tc(&env, "late1", 6);
    answered_by_tc(&env, "late2", 6);
    let syncs = env.agent.status().ok().flatten().map_or(0, |s| s.syncs);
    env.check(syncs == 0, || {
        format!("the agent synced {syncs} times although the API server was unreachable")
    });
    eprintln!(
        "no agent: late1 reached the Service through the socket hooks ({translated} sockets); \
         agent against an unreachable API: late1 attached {} ms after its start, late2 {} ms \
         after its creation, both answered by tc before any sync ({} s in all)",
        first.as_millis(),
        late2.as_millis(),
        started.elapsed().as_secs()
    );
}
