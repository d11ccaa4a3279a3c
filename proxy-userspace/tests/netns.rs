//! Privileged network-namespace tests: real traffic from a client pod through ClusterIPs
//! programmed by the agent running standalone in a node namespace.
//!
//! Run by `sudo cargo xtask test` (sets KPE_PRIVILEGED=1, one test thread); skipped otherwise.
//! Each test builds its own topology, pin dir and manifests; RAII guards remove them even when
//! an assertion fails. Nothing is created in the root network namespace.

use std::{
    collections::BTreeMap,
    net::Ipv4Addr,
    path::Path,
    sync::atomic::{AtomicBool, AtomicUsize, Ordering},
    thread,
    time::{Duration, Instant},
};

use proxy_testenv::{
    Agent, BACKENDS, ConnectOutcome, CurlReply, ManifestDir, PinDir, ServicePort, Topology,
    http_get_with_peer, require_privileged, tcp_connect_from, udp_request_from,
};

const WEB: Ipv4Addr = Ipv4Addr::new(10, 96, 0, 10);
const ECHO: Ipv4Addr = Ipv4Addr::new(10, 96, 0, 20);
const EMPTY: Ipv4Addr = Ipv4Addr::new(10, 96, 0, 30);
const BULK: Ipv4Addr = Ipv4Addr::new(10, 96, 0, 40);
const BIN: &str = env!("CARGO_BIN_EXE_kube-proxy-ebpf");

/// Field order is drop order: the agent dies first, then pins, manifests and namespaces go.
struct Env {
    agent: Agent,
    pins: PinDir,
    manifests: ManifestDir,
    topo: Topology,
}

impl Env {
    /// Topology + manifests written by `services` + agent synced and attached to all pods.
    fn start(services: impl FnOnce(&ManifestDir)) -> Self {
        Self::start_with(services, &[])
    }

    /// [`Env::start`] with `extra` agent flags.
    fn start_with(services: impl FnOnce(&ManifestDir), extra: &[&str]) -> Self {
        proxy_testenv::ensure_bpffs().expect("bpffs at /sys/fs/bpf");
        let topo = Topology::new().expect("creating the topology");
        let manifests = ManifestDir::new().expect("manifest dir");
        services(&manifests);
        let pins = PinDir::new(&format!("{}-pins", topo.prefix())).expect("pin dir");
        let mut args = vec!["--manifests".as_ref(), manifests.path().as_os_str()];
        args.extend(extra.iter().map(std::ffi::OsStr::new));
        let mut agent = Agent::start_with(
            Path::new(BIN),
            topo.node(),
            &args,
            pins.path(),
            topo.tmp().path(),
        )
        .expect("starting the agent");
        agent
            .wait_attached(&topo.pod_interfaces())
            .unwrap_or_else(|e| panic!("{e:#}"));
        Self {
            agent,
            pins,
            manifests,
            topo,
        }
    }

    /// Panics with the message and the agent's log tail.
    fn fail(&self, msg: &str) -> ! {
        self.agent.fail(msg)
    }

    fn check(&self, cond: bool, msg: impl FnOnce() -> String) {
        self.agent.check(cond, msg)
    }

    /// `n` requests to http://WEB/; every one must succeed from the VIP. Counts per backend.
    fn web_distribution(&self, n: usize) -> BTreeMap<String, usize> {
        let replies = self
            .topo
            .curl_many(&format!("http://{WEB}/"), n)
            .unwrap_or_else(|e| self.fail(&format!("curl_many: {e:#}")));
        let mut counts = BTreeMap::new();
        for (i, reply) in replies.into_iter().enumerate() {
            match reply {
                Ok(CurlReply { body, remote_ip }) => {
                    self.check(remote_ip == WEB.to_string(), || {
                        format!("request {i}: answered by {remote_ip}, not the VIP {WEB}")
                    });
                    *counts.entry(body).or_insert(0) += 1;
                }
                Err(e) => self.fail(&format!("request {i} of {n} to {WEB} failed: {e}")),
            }
        }
        counts
    }
}

fn web(manifests: &ManifestDir, backends: &[Ipv4Addr]) {
    manifests
        .write_service("demo", "web", WEB, &[ServicePort::tcp(80, 8080)], backends)
        .expect("writing demo/web");
}

/// demo/echo: UDP 53 → every backend's echo server on 5353.
fn echo(manifests: &ManifestDir) {
    manifests
        .write_service(
            "demo",
            "echo",
            ECHO,
            &[ServicePort::udp(53, 5353)],
            &all_backends(),
        )
        .expect("writing demo/echo");
}

fn all_backends() -> Vec<Ipv4Addr> {
    BACKENDS.iter().map(|(_, ip)| *ip).collect()
}

#[test]
fn clusterip_tcp_and_udp_reach_all_backends_from_the_vip() {
    require_privileged!();
    let env = Env::start(|m| {
        web(m, &all_backends());
        echo(m);
    });

    let counts = env.web_distribution(300);
    eprintln!("HTTP distribution over 300 requests: {counts:?}");
    for (name, _) in BACKENDS {
        let got = counts.get(name).copied().unwrap_or(0);
        env.check(got >= 30, || {
            format!("{name} got {got} of 300 requests: {counts:?}")
        });
    }
    env.check(counts.len() == 3, || {
        format!("unexpected answers: {counts:?}")
    });

    let mut udp: BTreeMap<String, usize> = BTreeMap::new();
    for i in 0..30 {
        let payload = format!("ping{i}");
        let reply = env
            .topo
            .udp_request(ECHO, 53, &payload)
            .unwrap_or_else(|e| env.fail(&format!("UDP request {i} to {ECHO}:53: {e:#}")));
        env.check(*reply.from.ip() == ECHO && reply.from.port() == 53, || {
            format!("UDP reply from {} instead of {ECHO}:53", reply.from)
        });
        let (backend, echoed) = reply.body.split_once(':').unwrap_or_default();
        env.check(echoed == payload, || {
            format!("UDP echo {:?} for {payload}", reply.body)
        });
        *udp.entry(backend.to_owned()).or_insert(0) += 1;
    }
    eprintln!("UDP distribution over 30 datagrams: {udp:?}");
    env.check(udp.len() == 3, || {
        format!("UDP reached {udp:?}, want all three backends")
    });
}

#[test]
fn service_without_endpoints_refuses_quickly() {
    require_privileged!();
    let env = Env::start(|m| {
        web(m, &all_backends());
        m.write_service("demo", "empty", EMPTY, &[ServicePort::tcp(80, 8080)], &[])
            .expect("writing demo/empty");
    });
    let (outcome, elapsed) = env
        .topo
        .tcp_connect(EMPTY, 80, Duration::from_secs(3))
        .unwrap_or_else(|e| env.fail(&format!("connect helper: {e:#}")));
    eprintln!("connect to {EMPTY}:80: {outcome:?} after {elapsed:?}");
    env.check(outcome == ConnectOutcome::Refused && elapsed < Duration::from_secs(1), || {
        format!("connect to a Service without endpoints: {outcome:?} after {elapsed:?}, want refused within 1 s")
    });
    // The neighbour Service still works.
    let reply = env
        .topo
        .curl(&format!("http://{WEB}/"))
        .unwrap_or_else(|e| env.fail(&format!("{e:#}")));
    env.check(reply.remote_ip == WEB.to_string(), || format!("{reply:?}"));
}

/// internalTrafficPolicy Local with endpoints only on other nodes: upstream drops (not rejects)
/// traffic to the ClusterIP. A pod's SYN is dropped by tc (its connect times out); a node
/// process's connect() fails at once with ETIMEDOUT in the socket hook.
#[test]
fn itp_local_served_only_elsewhere_is_dropped_not_refused() {
    require_privileged!();
    const ITP: Ipv4Addr = Ipv4Addr::new(10, 96, 0, 50);
    let env = Env::start(|m| {
        web(m, &all_backends());
        // be1 is a real server here, but its slice names another node: not usable locally.
        let yaml = format!(
            "apiVersion: v1\nkind: Service\nmetadata:\n  name: itp\n  namespace: demo\n\
             spec:\n  clusterIP: {ITP}\n  internalTrafficPolicy: Local\n  ports:\n  \
             - port: 80\n    targetPort: 8080\n---\napiVersion: discovery.k8s.io/v1\n\
             kind: EndpointSlice\nmetadata:\n  name: itp-1\n  namespace: demo\n  labels:\n    \
             kubernetes.io/service-name: itp\naddressType: IPv4\nports:\n  - name: \"\"\n    \
             port: 8080\n    protocol: TCP\nendpoints:\n  - addresses: [\"{}\"]\n    \
             nodeName: some-other-node\n    conditions:\n      ready: true\n",
            BACKENDS[0].1
        );
        std::fs::write(m.path().join("demo-itp.yaml"), yaml).expect("writing demo/itp");
    });
    let (outcome, elapsed) = env
        .topo
        .tcp_connect(ITP, 80, Duration::from_secs(2))
        .unwrap_or_else(|e| env.fail(&format!("connect helper: {e:#}")));
    eprintln!("pod connect to {ITP}:80: {outcome:?} after {elapsed:?}");
    env.check(outcome == ConnectOutcome::TimedOut, || {
        format!("pod connect to an iTP=Local ClusterIP served elsewhere: {outcome:?}, want a timeout (SYN dropped)")
    });
    let host = env.agent.host(env.topo.node());
    let (outcome, elapsed) = tcp_connect_from(&host, ITP, 80, Duration::from_secs(3))
        .unwrap_or_else(|e| env.fail(&format!("connect helper: {e:#}")));
    eprintln!("host connect to {ITP}:80: {outcome:?} after {elapsed:?}");
    env.check(outcome == ConnectOutcome::TimedOut && elapsed < Duration::from_secs(1), || {
        format!("host connect: {outcome:?} after {elapsed:?}, want ETIMEDOUT at once from the socket hook")
    });
    let dropped = env
        .agent
        .counter("drop_no_local_endpoints")
        .unwrap_or_else(|e| env.fail(&format!("{e:#}")));
    env.check(dropped >= 2, || {
        format!("drop_no_local_endpoints = {dropped}, want ≥ 2 (pod SYN(s) and the host connect)")
    });
}

/// `--service-cidr`: like kube-proxy's nftables mode, a ClusterIP's other ports are refused and
/// the unallocated rest of the Service CIDR is dropped (not routed on), for pods (tc) and the
/// node's own processes (socket hooks).
#[test]
fn service_cidr_rejects_other_ports_of_cluster_ips_and_drops_unallocated_addresses() {
    require_privileged!();
    const UNALLOCATED: Ipv4Addr = Ipv4Addr::new(10, 96, 0, 77);
    let env = Env::start_with(
        |m| web(m, &all_backends()),
        &["--service-cidr", "10.96.0.0/16"],
    );
    let host = env.agent.host(env.topo.node());
    let timeout = Duration::from_secs(2);
    let connect = |who: &str, ip: Ipv4Addr, port: u16| {
        let r = if who == "pod" {
            env.topo.tcp_connect(ip, port, timeout)
        } else {
            tcp_connect_from(&host, ip, port, timeout)
        };
        let (outcome, elapsed) = r.unwrap_or_else(|e| env.fail(&format!("connect helper: {e:#}")));
        eprintln!("{who} connect to {ip}:{port}: {outcome:?} after {elapsed:?}");
        (outcome, elapsed)
    };
    for who in ["pod", "host"] {
        let (outcome, elapsed) = connect(who, WEB, 81);
        env.check(outcome == ConnectOutcome::Refused && elapsed < Duration::from_secs(1), || {
            format!("{who} → ClusterIP {WEB}:81 (no such Service port): {outcome:?} after {elapsed:?}, want refused at once")
        });
        let (outcome, _) = connect(who, UNALLOCATED, 80);
        env.check(outcome == ConnectOutcome::TimedOut, || {
            format!("{who} → unallocated {UNALLOCATED}:80: {outcome:?}, want a timeout (dropped)")
        });
    }
    let reply = env
        .topo
        .curl(&format!("http://{WEB}/"))
        .unwrap_or_else(|e| env.fail(&format!("the Service port itself: {e:#}")));
    env.check(reply.remote_ip == WEB.to_string(), || format!("{reply:?}"));
    let counter = |name: &str| {
        env.agent
            .counter(name)
            .unwrap_or_else(|e| env.fail(&format!("{e:#}")))
    };
    let (rejected, dropped) = (
        counter("cluster_ip_port_rejected"),
        counter("drop_unallocated_service_ip"),
    );
    env.check(rejected >= 2 && dropped >= 2, || {
        format!("cluster_ip_port_rejected={rejected} drop_unallocated_service_ip={dropped}, want ≥ 2 each")
    });
}

/// Processes of the node's own namespace (host network) have no tc hook on their way out: the
/// cgroup socket hooks translate at connect()/sendmsg(), and getpeername()/recvfrom() show the
/// Service. Only members of the agent's cgroup are translated.
#[test]
fn node_processes_reach_clusterips_through_the_socket_hooks() {
    require_privileged!();
    let env = Env::start(|m| {
        web(m, &all_backends());
        echo(m);
        m.write_service("demo", "empty", EMPTY, &[ServicePort::tcp(80, 8080)], &[])
            .expect("writing demo/empty");
    });
    let host = env.agent.host(env.topo.node());

    let mut tcp: BTreeMap<String, usize> = BTreeMap::new();
    for i in 0..30 {
        let view = http_get_with_peer(&host, WEB, 80)
            .unwrap_or_else(|e| env.fail(&format!("host HTTP request {i} to {WEB}:80: {e:#}")));
        env.check(view.peer == format!("{WEB}:80"), || {
            format!(
                "getpeername() on the host's socket said {}, want {WEB}:80",
                view.peer
            )
        });
        env.check(
            !view.client_addr.is_empty() && !view.client_addr.starts_with("10.96."),
            || format!("backend saw client {:?}", view.client_addr),
        );
        *tcp.entry(view.body).or_insert(0) += 1;
    }
    eprintln!("host TCP distribution over 30 connections: {tcp:?}");
    env.check(
        tcp.len() >= 2 && tcp.keys().all(|b| BACKENDS.iter().any(|(n, _)| n == b)),
        || format!("host connections reached {tcp:?}, want at least two of the backends"),
    );

    let mut udp: BTreeMap<String, usize> = BTreeMap::new();
    for i in 0..15 {
        let payload = format!("host{i}");
        let reply = udp_request_from(&host, ECHO, 53, &payload)
            .unwrap_or_else(|e| env.fail(&format!("host UDP request {i} to {ECHO}:53: {e:#}")));
        env.check(*reply.from.ip() == ECHO && reply.from.port() == 53, || {
            format!(
                "recvfrom() on the host's socket said {}, want {ECHO}:53",
                reply.from
            )
        });
        let (backend, echoed) = reply.body.split_once(':').unwrap_or_default();
        env.check(echoed == payload, || format!("UDP echo {:?}", reply.body));
        *udp.entry(backend.to_owned()).or_insert(0) += 1;
    }
    eprintln!("host UDP distribution over 15 datagrams: {udp:?}");

    let (outcome, elapsed) = tcp_connect_from(&host, EMPTY, 80, Duration::from_secs(3))
        .unwrap_or_else(|e| env.fail(&format!("connect helper: {e:#}")));
    env.check(outcome == ConnectOutcome::Refused && elapsed < Duration::from_secs(1), || {
        format!("host connect to a Service without endpoints: {outcome:?} after {elapsed:?}, want refused within 1 s")
    });

    // The same namespace outside the agent's cgroup is not translated (the node has no route
    // to the Service range): the hooks stay inside the cgroup they were given.
    let (outcome, _) = tcp_connect_from(env.topo.node(), WEB, 80, Duration::from_secs(1))
        .unwrap_or_else(|e| env.fail(&format!("connect helper: {e:#}")));
    env.check(outcome != ConnectOutcome::Connected, || {
        "a node process outside the agent's cgroup reached the ClusterIP".to_owned()
    });

    let counter = |name: &str| {
        env.agent
            .counter(name)
            .unwrap_or_else(|e| env.fail(&format!("{e:#}")))
    };
    let (translated, reversed, refused) = (
        counter("sock_translated"),
        counter("sock_reverse_translated"),
        counter("sock_no_endpoints_refused"),
    );
    eprintln!(
        "sock_translated={translated} sock_reverse_translated={reversed} sock_no_endpoints_refused={refused}"
    );
    env.check(translated >= 45 && reversed >= 45 && refused >= 1, || {
        format!("socket hook counters {translated}/{reversed}/{refused}, want ≥45/≥45/≥1")
    });
}

#[test]
fn endpoint_removal_and_addition_take_effect_within_a_second() {
    require_privileged!();
    let mut env = Env::start(|m| web(m, &all_backends()));
    let counts = env.web_distribution(30);
    env.check(counts.len() == 3, || {
        format!("before the change: {counts:?}")
    });

    // Remove be3: measure when it stops getting new connections.
    let be3 = BACKENDS[2].0;
    web(&env.manifests, &all_backends()[..2]);
    let changed = Instant::now();
    let mut last_be3: Option<Duration> = None;
    let mut streak = 0;
    while streak < 30 {
        env.check(changed.elapsed() < Duration::from_secs(10), || {
            format!("be3 still answered {last_be3:?} after the removal; no 30-request streak without it within 10 s")
        });
        let reply = env
            .topo
            .curl(&format!("http://{WEB}/"))
            .unwrap_or_else(|e| env.fail(&format!("request during the removal failed: {e:#}")));
        if reply.body == be3 {
            last_be3 = Some(changed.elapsed());
            streak = 0;
        } else {
            streak += 1;
        }
    }
    let converged = last_be3.unwrap_or_default();
    eprintln!("removal: last connection to be3 at {converged:?} after the manifest change");
    env.check(converged < Duration::from_secs(1), || {
        format!("be3 still got new connections {converged:?} after its removal (want < 1 s)")
    });
    let counts = env.web_distribution(60);
    env.check(!counts.contains_key(be3) && counts.len() == 2, || {
        format!("after removing be3: {counts:?}")
    });

    // Add a new pod be4 (its veth appears after the agent started) and put it in the Service.
    let be4 = Ipv4Addr::new(10, 244, 1, 14);
    env.topo.add_backend("be4", be4).expect("adding pod be4");
    env.agent
        .wait_status(Duration::from_secs(5), |s| {
            s.interfaces.iter().any(|i| i == "veth-be4")
        })
        .unwrap_or_else(|e| panic!("agent did not attach to the new veth-be4: {e:#}"));
    web(&env.manifests, &[BACKENDS[0].1, BACKENDS[1].1, be4]);
    let changed = Instant::now();
    let mut first_be4 = None;
    while first_be4.is_none() {
        env.check(changed.elapsed() < Duration::from_secs(10), || {
            "be4 got no connection within 10 s of being added".to_owned()
        });
        let reply = env
            .topo
            .curl(&format!("http://{WEB}/"))
            .unwrap_or_else(|e| env.fail(&format!("request during the addition failed: {e:#}")));
        if reply.body == "be4" {
            first_be4 = Some(changed.elapsed());
        }
    }
    eprintln!("addition: first connection to be4 at {first_be4:?} after the manifest change");
    let counts = env.web_distribution(60);
    env.check(
        counts.contains_key("be4") && !counts.contains_key(be3),
        || format!("after adding be4: {counts:?}"),
    );
}

#[test]
fn agent_restart_keeps_a_long_transfer_and_requests_alive() {
    require_privileged!();
    let mut env = Env::start(|m| {
        web(m, &all_backends());
        m.write_service(
            "demo",
            "bulk",
            BULK,
            &[ServicePort::tcp(5201, 5201)],
            &[BACKENDS[0].1],
        )
        .expect("writing demo/bulk");
    });
    env.topo
        .start_iperf3_server("be1")
        .expect("iperf3 server in be1");
    let transfer = env
        .topo
        .iperf3_client(BULK, 5201, 8)
        .expect("starting iperf3 -c");
    thread::sleep(Duration::from_millis(1500));

    let stop = AtomicBool::new(false);
    let ok = AtomicUsize::new(0);
    let failures = std::sync::Mutex::new(Vec::new());
    let restart = thread::scope(|s| {
        let topo = &env.topo;
        s.spawn(|| {
            // Bounded: stops when told or after 30 s.
            let until = Instant::now() + Duration::from_secs(30);
            while !stop.load(Ordering::Relaxed) && Instant::now() < until {
                match topo.curl(&format!("http://{WEB}/")) {
                    Ok(r) if r.remote_ip == WEB.to_string() => {
                        ok.fetch_add(1, Ordering::Relaxed);
                    }
                    Ok(r) => failures.lock().expect("lock").push(format!("{r:?}")),
                    Err(e) => failures.lock().expect("lock").push(format!("{e:#}")),
                }
            }
        });
        let result = (|| -> anyhow::Result<Duration> {
            let t = Instant::now();
            let status = env.agent.stop()?;
            eprintln!("agent stopped by SIGTERM: {status}");
            thread::sleep(Duration::from_millis(1000)); // traffic with no agent at all
            env.agent.restart()?;
            env.agent.wait_synced(1, Duration::from_secs(30))?;
            Ok(t.elapsed())
        })();
        thread::sleep(Duration::from_millis(500));
        stop.store(true, Ordering::Relaxed);
        result
    });
    let restart = restart.unwrap_or_else(|e| env.fail(&format!("restarting the agent: {e:#}")));
    let summary = transfer
        .wait()
        .unwrap_or_else(|e| env.fail(&format!("iperf3 client: {e:#}")));
    let failures = failures.into_inner().expect("lock");
    let ok = ok.into_inner();
    eprintln!(
        "restart took {restart:?}; iperf3 {:.1} s at {:.2} Gbit/s ({} retransmits); {ok} requests ok, {} failed",
        summary.seconds,
        summary.bits_per_second / 1e9,
        summary.retransmits,
        failures.len()
    );
    env.check(summary.success && summary.seconds >= 7.5, || {
        format!("the transfer broke across the restart: {summary:?}")
    });
    env.check(failures.is_empty() && ok > 0, || {
        format!("requests during the restart: {ok} ok, failures {failures:?}")
    });
    // The restarted agent swapped its programs into the pinned cgroup links, and they translate.
    let adopted = "adopted=[Connect4, Sendmsg4, Recvmsg4, Getpeername4]";
    let deadline = Instant::now() + Duration::from_secs(5);
    while !env.agent.log_tail().contains(adopted) && Instant::now() < deadline {
        thread::sleep(Duration::from_millis(50));
    }
    env.check(env.agent.log_tail().contains(adopted), || {
        format!("no `{adopted}` in the restarted agent's log")
    });
    let view = http_get_with_peer(&env.agent.host(env.topo.node()), WEB, 80)
        .unwrap_or_else(|e| env.fail(&format!("node process after the restart: {e:#}")));
    env.check(view.peer == format!("{WEB}:80"), || format!("{view:?}"));
}

#[test]
fn cleanup_removes_pins_and_detaches() {
    require_privileged!();
    let mut env = Env::start(|m| web(m, &all_backends()));
    env.topo
        .curl(&format!("http://{WEB}/"))
        .unwrap_or_else(|e| env.fail(&format!("{e:#}")));
    env.check(env.pins.exists(), || "the agent pinned nothing".to_owned());
    env.agent.stop().expect("stopping the agent");

    // Still forwarding from pins with no agent running, for pods and the node's own processes.
    env.topo
        .curl(&format!("http://{WEB}/"))
        .unwrap_or_else(|e| env.fail(&format!("no forwarding after SIGTERM: {e:#}")));
    let host = env.agent.host(env.topo.node());
    http_get_with_peer(&host, WEB, 80).unwrap_or_else(|e| {
        env.fail(&format!(
            "node process: no translation after SIGTERM: {e:#}"
        ))
    });

    let pin = env.pins.path().to_string_lossy().into_owned();
    let out = env
        .agent
        .cli(&["cleanup", "--pin-dir", &pin])
        .expect("running cleanup");
    env.check(out.status.success(), || {
        format!(
            "cleanup failed ({}): {}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        )
    });
    env.check(!env.pins.exists(), || {
        format!("{pin} still exists after cleanup")
    });
    // cleanup detaches each link explicitly (BPF_LINK_DETACH) before it returns: the very next
    // request to the VIP must fail.
    let after = env.topo.curl(&format!("http://{WEB}/"));
    env.check(after.is_err(), || {
        let links = std::process::Command::new("bpftool")
            .args(["link", "show"])
            .output()
            .map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
            .unwrap_or_default();
        format!("the VIP still answers right after cleanup: {after:?}\nbpftool link show:\n{links}")
    });
    // The socket hooks are gone too: the node's process is no longer translated.
    let (outcome, _) = tcp_connect_from(&host, WEB, 80, Duration::from_secs(1))
        .unwrap_or_else(|e| env.fail(&format!("connect helper: {e:#}")));
    env.check(outcome != ConnectOutcome::Connected, || {
        "a node process still reaches the ClusterIP after cleanup".to_owned()
    });
    // Pods still reach each other directly: cleanup detached without breaking the veths.
    let direct = env.topo.curl(&format!("http://{}:8080/", BACKENDS[0].1));
    env.check(direct.is_ok(), || {
        format!("direct pod traffic broken after cleanup: {direct:?}")
    });
}
