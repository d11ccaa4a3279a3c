//! Privileged network-namespace tests: real traffic from a client pod through ClusterIPs
//! programmed by the agent running standalone in a node namespace.
//!
//! Run by `sudo cargo xtask test` (sets KPE_PRIVILEGED=1, one test thread); skipped otherwise.
//! Each test builds its own topology, pin dir and manifests; RAII guards remove them even when
//! an assertion fails. Nothing is created in the root network namespace.

mod common_netns;

use std::{
    collections::BTreeMap,
    fmt::Write as _,
    net::Ipv4Addr,
    path::Path,
    sync::atomic::{AtomicBool, AtomicUsize, Ordering},
    thread,
    time::{Duration, Instant},
};

use aya::{
    maps::PerCpuHashMap,
    programs::{
        LinkOrder, SchedClassifier, TcAttachType,
        tc::{NlOptions, TcAttachOptions},
    },
};
use common_netns::{BIN, Env};
use proxy_common::TapKey;
use proxy_testenv::{
    Agent, BACKENDS, ConnectOutcome, ManifestDir, PinDir, ServicePort, Topology,
    http_get_with_peer, require_privileged, tcp_connect_from, udp_request_from,
};

const WEB: Ipv4Addr = Ipv4Addr::new(10, 96, 0, 10);
const ECHO: Ipv4Addr = Ipv4Addr::new(10, 96, 0, 20);
const EMPTY: Ipv4Addr = Ipv4Addr::new(10, 96, 0, 30);
const BULK: Ipv4Addr = Ipv4Addr::new(10, 96, 0, 40);
const STREAM: Ipv4Addr = Ipv4Addr::new(10, 96, 0, 60);

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

    let counts = env.distribution(WEB, 80, 300);
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

    let udp = env.udp_echo_distribution(ECHO.into(), 53, 30);
    eprintln!("UDP distribution over 30 datagrams: {udp:?}");
    env.check(udp.len() == 3, || {
        format!("UDP reached {udp:?}, want all three backends")
    });
}

/// UDP datagrams larger than the MTU (1500 on every veth here) travel as three fragments each
/// way: 4,000-byte requests (echoed back as 4,000-byte replies) and small requests with
/// 4,000-byte replies, through a ClusterIP. Every one must be answered, from the VIP.
#[test]
fn udp_datagrams_larger_than_the_mtu_cross_a_clusterip_both_ways() {
    require_privileged!();
    let env = Env::start(echo);
    let client = env
        .topo
        .pod("client")
        .unwrap_or_else(|e| env.fail(&format!("{e:#}")));
    let mtu = client
        .ns()
        .exec(&["cat", "/sys/class/net/eth0/mtu"])
        .unwrap_or_else(|e| env.fail(&format!("reading the MTU: {e:#}")));
    env.check(mtu.trim() == "1500", || {
        format!("client MTU {mtu:?}, want 1500")
    });

    let big_request = "r".repeat(4000);
    let mut answered = [0; 2];
    for i in 0..5 {
        for (kind, payload, want_len) in [(0, big_request.as_str(), 4000), (1, "big:4000", 4000)] {
            match env.topo.udp_request(ECHO, 53, payload) {
                Ok(reply) => {
                    let (_, body) = reply.body.split_once(':').unwrap_or_default();
                    env.check(*reply.from.ip() == ECHO && reply.from.port() == 53, || {
                        format!(
                            "request {i}: reply from {} instead of {ECHO}:53",
                            reply.from
                        )
                    });
                    env.check(body.len() == want_len, || {
                        format!(
                            "request {i}: {}-byte reply body, want {want_len}",
                            body.len()
                        )
                    });
                    if kind == 0 {
                        env.check(body == big_request, || {
                            format!("request {i}: the echo differs from the request")
                        });
                    }
                    answered[kind] += 1;
                }
                Err(e) => eprintln!("{}-byte request {i}: {e:#}", payload.len()),
            }
        }
    }
    let counter = |name: &str| {
        env.agent
            .counter(name)
            .unwrap_or_else(|e| env.fail(&format!("{e:#}")))
    };
    let (translated, unmatched) = (
        counter("fragment_translated"),
        counter("fragment_unmatched"),
    );
    eprintln!(
        "4,000-byte requests answered: {}/5; small requests with 4,000-byte replies answered: {}/5; \
         fragment_translated={translated} fragment_unmatched={unmatched}",
        answered[0], answered[1]
    );
    env.check(answered == [5, 5], || {
        format!("answered {answered:?} of [5, 5] (fragment_unmatched={unmatched})")
    });
    // Two later fragments per big datagram, each translated once: 5 big requests (DNAT on
    // ingress) and 10 big replies (reverse NAT on egress).
    env.check(translated >= 30, || {
        format!("fragment_translated={translated}, want at least 30")
    });
    // The pinned records, as `dump fragments` shows them: the requests' DNAT at ingress.
    let pin = env.pins.path().to_string_lossy().into_owned();
    let dump = env
        .agent
        .cli(&["dump", "fragments", "--pin-dir", &pin])
        .unwrap_or_else(|e| env.fail(&format!("dump fragments: {e:#}")));
    let table = String::from_utf8_lossy(&dump.stdout);
    let client_ip = client.ip.to_string();
    env.check(
        table.lines().any(|l| {
            l.starts_with("ingress")
                && l.contains(&format!("{ECHO}"))
                && l.contains(&format!("as {client_ip} → 10.244.1.1"))
        }),
        || format!("dump fragments shows no DNATed request:\n{table}"),
    );
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
    let env = Env::start_with_flags(
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
    let counts = env.distribution(WEB, 80, 30);
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
    let counts = env.distribution(WEB, 80, 60);
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
    let counts = env.distribution(WEB, 80, 60);
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
    let adopted = "adopted=[Connect4, Sendmsg4, Recvmsg4, Getpeername4, Connect6, Sendmsg6, \
                   Recvmsg6, Getpeername6, Bind4, Bind6]";
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

/// Two ClusterIPs whose Services select the same single pod (be1): TCP 80 → 8080, UDP 53 → 5353.
const TWIN_A: Ipv4Addr = Ipv4Addr::new(10, 96, 0, 50);
const TWIN_B: Ipv4Addr = Ipv4Addr::new(10, 96, 0, 51);

/// Reply-tuple clashes, from the client pod, with fixed source ports (what the kernel's port
/// allocator does under load): prints one `case ok bad` line per case.
const CLASH_PY: &str = r#"
import socket, sys
a, b, pod = sys.argv[1], sys.argv[2], sys.argv[3]

def bound(kind, port):
    s = socket.socket(socket.AF_INET, kind)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("0.0.0.0", port))
    s.settimeout(3)
    return s

def get(s):
    s.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
    data = b""
    while True:
        chunk = s.recv(4096)
        if not chunk:
            break
        data += chunk
    return data.startswith(b"HTTP/1.1 200")

# 1. One UDP socket alternating between the two VIPs: every answer from the VIP asked.
u = bound(socket.SOCK_DGRAM, 45000)
ok = bad = 0
for i in range(40):
    dst = (a if i % 2 == 0 else b, 53)
    u.sendto(b"q%d" % i, dst)
    try:
        data, src = u.recvfrom(65535)
        if src == dst and data.endswith(b":q%d" % i):
            ok += 1
        else:
            bad += 1
    except socket.timeout:
        bad += 1
print("udp_two_vips", ok, bad)

# 2. Two TCP connections from one source port to the two VIPs, both open at once.
ok = bad = 0
for round in range(5):
    port = 46000 + round
    try:
        s1 = bound(socket.SOCK_STREAM, port); s1.connect((a, 80))
        s2 = bound(socket.SOCK_STREAM, port); s2.connect((b, 80))
        for s in (s1, s2):
            ok, bad = (ok + 1, bad) if get(s) else (ok, bad + 1)
    except OSError:
        bad += 1
print("tcp_two_vips", ok, bad)

# 3. A VIP connection and a connection straight to the pod from one source port, both open.
ok = bad = 0
for round in range(5):
    port = 47000 + round
    try:
        s1 = bound(socket.SOCK_STREAM, port); s1.connect((a, 80))
        s2 = bound(socket.SOCK_STREAM, port); s2.connect((pod, 8080))
        for s in (s2, s1):
            ok, bad = (ok + 1, bad) if get(s) else (ok, bad + 1)
    except OSError:
        bad += 1
print("tcp_vip_and_direct", ok, bad)

# 4. Short connections through a VIP, then straight to the pod from the same ports (the closed
#    VIP flows must not capture the pod's answers). 300 consecutive ports: the VIP flows hold a
#    block of reply tuples that the direct flows' clash probes must get out of.
for port in range(48000, 48300):
    s = bound(socket.SOCK_STREAM, port); s.connect((a, 80)); get(s); s.close()
ok = bad = 0
for port in range(48000, 48300):
    stage = "connect"
    try:
        s = bound(socket.SOCK_STREAM, port); s.connect((pod, 8080))
        stage = "request"
        if get(s):
            ok += 1
        else:
            bad += 1
            print("direct_after_vip: port", port, "wrong answer", file=sys.stderr)
        s.close()
    except OSError as e:
        bad += 1
        print("direct_after_vip: port", port, stage, repr(e), file=sys.stderr)
print("direct_after_vip", ok, bad)
"#;

#[test]
fn one_client_port_to_one_pod_through_two_vips_and_directly_keeps_every_reply_its_own() {
    require_privileged!();
    let be1 = BACKENDS[0].1;
    let env = Env::start(|m| {
        for (name, vip) in [("twin-a", TWIN_A), ("twin-b", TWIN_B)] {
            m.write_service(
                "demo",
                name,
                vip,
                &[ServicePort::tcp(80, 8080), ServicePort::udp(53, 5353)],
                &[be1],
            )
            .expect("writing a twin Service");
        }
    });
    let client = env.topo.pod("client").expect("client pod");
    let out = client
        .ns()
        .output(
            &[
                "python3",
                "-c",
                CLASH_PY,
                &TWIN_A.to_string(),
                &TWIN_B.to_string(),
                &be1.to_string(),
            ],
            Duration::from_secs(120),
        )
        .unwrap_or_else(|e| env.fail(&format!("clash client: {e:#}")));
    let stdout = String::from_utf8_lossy(&out.stdout);
    eprintln!("{stdout}{}", String::from_utf8_lossy(&out.stderr));
    let result = |case: &str| -> (u32, u32) {
        let line = stdout
            .lines()
            .find(|l| l.starts_with(case))
            .unwrap_or_else(|| env.fail(&format!("no result for {case}: {stdout}")));
        let mut f = line.split_whitespace().skip(1).map(|n| n.parse().unwrap());
        (f.next().unwrap(), f.next().unwrap())
    };
    if stdout
        .lines()
        .any(|l| l.split_whitespace().nth(2).is_some_and(|bad| bad != "0"))
    {
        let pins = env.agent.pin_dir().to_string_lossy().into_owned();
        for what in ["conntrack", "stats"] {
            if let Ok(out) = env.agent.cli(&["dump", what, "--pin-dir", &pins]) {
                eprintln!(
                    "--- dump {what} ---\n{}",
                    String::from_utf8_lossy(&out.stdout)
                );
            }
        }
    }
    for (case, want) in [
        ("udp_two_vips", 40),
        ("tcp_two_vips", 10),
        ("tcp_vip_and_direct", 10),
        ("direct_after_vip", 300),
    ] {
        let (ok, bad) = result(case);
        env.check(ok == want && bad == 0, || {
            format!("{case}: {ok} of {want} answered by the right peer, {bad} wrong or lost")
        });
    }
    let remapped = env
        .agent
        .counter("reply_tuple_remapped")
        .unwrap_or_else(|e| env.fail(&format!("reading counters: {e:#}")));
    env.check(remapped >= 10, || {
        format!("reply_tuple_remapped = {remapped}: the clashes were not resolved by a new port")
    });
}

/// The measured take-over (issue 9 item 6): a Service in namespace `a` (first by name) whose
/// externalIP is kube-dns's ClusterIP on 53/UDP. The ClusterIP must stay kube-dns's: every query
/// to it is answered by kube-dns's backend; the intruder keeps its own ClusterIP; the clash is
/// reported in the log and counted in /metrics.
#[test]
fn an_external_ip_cannot_take_another_service_s_cluster_ip() {
    require_privileged!();
    const DNS: Ipv4Addr = Ipv4Addr::new(10, 96, 0, 10);
    const INTRUDER: Ipv4Addr = Ipv4Addr::new(10, 96, 0, 77);
    let (be1, be2) = (BACKENDS[0].1, BACKENDS[1].1);
    let env = Env::start(|m| {
        m.write_service(
            "kube-system",
            "kube-dns",
            DNS,
            &[ServicePort::udp(53, 5353)],
            &[be1],
        )
        .expect("writing kube-system/kube-dns");
        let yaml = proxy_testenv::service_yaml(
            "a",
            "intruder",
            INTRUDER,
            &[ServicePort::udp(53, 5353)],
            &[be2],
        )
        .replacen(
            "spec:\n",
            &format!("spec:\n  externalIPs: [\"{DNS}\"]\n"),
            1,
        );
        std::fs::write(m.path().join("a-intruder.yaml"), yaml).expect("writing a/intruder");
    });

    for (vip, want) in [(DNS, BACKENDS[0].0), (INTRUDER, BACKENDS[1].0)] {
        for i in 0..5 {
            let payload = format!("q{i}");
            let reply = env
                .topo
                .udp_request(vip, 53, &payload)
                .unwrap_or_else(|e| env.fail(&format!("query {i} to {vip}:53: {e:#}")));
            env.check(*reply.from.ip() == vip && reply.from.port() == 53, || {
                format!("reply from {} instead of {vip}:53", reply.from)
            });
            let (backend, echoed) = reply.body.split_once(':').unwrap_or_default();
            env.check(backend == want && echoed == payload, || {
                format!(
                    "query {i} to {vip}:53 answered {:?}, want {want}",
                    reply.body
                )
            });
        }
    }

    let pin_dir = env.agent.pin_dir().to_string_lossy().into_owned();
    let dump = env
        .agent
        .cli(&["dump", "services", "--pin-dir", &pin_dir])
        .unwrap_or_else(|e| env.fail(&format!("dump services: {e:#}")));
    let dump = String::from_utf8_lossy(&dump.stdout).into_owned();
    let line = dump
        .lines()
        .find(|l| l.contains(&format!("{DNS}:53")))
        .unwrap_or_else(|| env.fail(&format!("{DNS}:53 not in dump services:\n{dump}")));
    env.check(
        line.contains(&be1.to_string()) && !line.contains(&be2.to_string()),
        || format!("dump services shows {line:?}, want kube-dns's backend {be1} only"),
    );

    let log = std::fs::read_to_string(env.agent.log_path()).unwrap_or_default();
    env.check(
        log.lines().any(|l| {
            l.contains("Service a/intruder")
                && l.contains(&format!("frontend {DNS}:53/UDP (externalIP"))
                && l.contains("kube-system/kube-dns")
        }),
        || "the clash is not reported in the agent's log".to_owned(),
    );
    let metrics = env.metrics();
    env.check(
        metrics
            .lines()
            .any(|l| l == "kube_proxy_ebpf_frontend_conflicts{kind=\"external_ip\"} 1"),
        || format!("conflict not counted in /metrics:\n{metrics}"),
    );
}

/// Sends a 251-periodic byte pattern to its one client for `seconds`, paced (16 KiB every 5 ms),
/// then closes; prints the bytes sent. Args: port, seconds, ready file.
const STREAM_SERVER_PY: &str = r#"
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
while time.monotonic() < end:
    conn.sendall(chunk)
    sent += len(chunk)
    time.sleep(0.005)
conn.shutdown(socket.SHUT_WR)
print("sent", sent, flush=True)
"#;

/// Receives the stream until EOF, checks every byte against the pattern and the longest gap
/// between two reads; prints one JSON line. Args: ip, port, recv timeout (s).
const STREAM_CLIENT_PY: &str = r#"
import json, socket, sys, time
s = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=5)
s.settimeout(float(sys.argv[3]))
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
print(json.dumps({"bytes": total, "max_gap_ms": int(gap * 1000), "mismatch": bad, "error": err, "eof": eof}))
"#;

/// One datagram from each of `n` distinct source ports (first..first+n), spread over `seconds`.
/// Args: ip, port, first source port, n, seconds.
const UDP_FLOOD_PY: &str = r#"
import socket, sys, time
ip, port, first, n, seconds = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), float(sys.argv[5])
for i in range(n):
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("0.0.0.0", first + i))
    s.sendto(b"one-shot %d" % i, (ip, port))
    s.close()
    time.sleep(seconds / n)
print("sent", n)
"#;

/// Conntrack under pressure: with CONNTRACK and SNAT sized to 1,024 entries (512 flows) by
/// `--conntrack-max-per-core 1 --conntrack-min 512` (kube-proxy's maxPerCore × CPUs, floor min,
/// two entries per flow), a long TCP stream through a ClusterIP keeps flowing, every byte intact and without a stall,
/// while twice the map's capacity of one-shot UDP flows (2,048 datagrams from distinct source
/// ports) passes through a UDP ClusterIP, so the LRU evicts entries all along.
#[test]
fn a_long_tcp_stream_keeps_flowing_while_twice_the_conntrack_capacity_of_udp_flows_passes() {
    require_privileged!();
    const CAPACITY: u32 = 1_024;
    const STREAM_PORT: u16 = 9000;
    const STREAM_SECONDS: u32 = 8;
    const UDP_FLOWS: u32 = 2 * CAPACITY;
    let min_flows = (CAPACITY / 2).to_string();
    let env = Env::start_with_flags(
        |m| {
            echo(m);
            m.write_service(
                "demo",
                "stream",
                STREAM,
                &[ServicePort::tcp(STREAM_PORT, STREAM_PORT)],
                &[BACKENDS[0].1],
            )
            .expect("writing demo/stream");
        },
        // max(1 × CPUs, 512) = 512 flows on any machine of up to 512 CPUs.
        &[
            "--conntrack-max-per-core",
            "1",
            "--conntrack-min",
            &min_flows,
        ],
    );
    for map in [proxy_common::MAP_CONNTRACK, proxy_common::MAP_SNAT] {
        let show = std::process::Command::new("bpftool")
            .args(["-j", "map", "show", "pinned"])
            .arg(env.pins.path().join(map))
            .output()
            .expect("bpftool map show");
        let info: serde_json::Value = serde_json::from_slice(&show.stdout)
            .unwrap_or_else(|e| env.fail(&format!("bpftool output: {e}: {show:?}")));
        env.check(info["max_entries"] == u64::from(CAPACITY), || {
            format!("{map} was not sized to 2 entries × 512 flows: {info}")
        });
    }

    let tmp = env.topo.tmp();
    let (server_py, client_py, flood_py) = (
        tmp.join("stream_server.py"),
        tmp.join("stream_client.py"),
        tmp.join("udp_flood.py"),
    );
    for (path, text) in [
        (&server_py, STREAM_SERVER_PY),
        (&client_py, STREAM_CLIENT_PY),
        (&flood_py, UDP_FLOOD_PY),
    ] {
        std::fs::write(path, text).expect("writing a helper script");
    }
    let ready = tmp.join("stream.ready");
    let server_log = tmp.join("stream-server.log");
    let path = |p: &Path| p.to_str().expect("utf-8 path").to_owned();
    let be1 = env.topo.pod(BACKENDS[0].0).expect("be1");
    let _server = be1
        .ns()
        .spawn(
            &[
                "python3",
                &path(&server_py),
                &STREAM_PORT.to_string(),
                &STREAM_SECONDS.to_string(),
                &path(&ready),
            ],
            Some(&server_log),
        )
        .expect("stream server");
    let deadline = Instant::now() + Duration::from_secs(10);
    while !ready.exists() {
        env.check(Instant::now() < deadline, || {
            "the stream server did not start within 10 s".to_owned()
        });
        thread::sleep(Duration::from_millis(20));
    }
    let new_flows_before = env.agent.counter("new_flow").unwrap_or(0);

    let client = env.topo.pod("client").expect("client pod").ns();
    let (stream, flood) = thread::scope(|s| {
        let stream = s.spawn(|| {
            client.output(
                &[
                    "python3",
                    &path(&client_py),
                    &STREAM.to_string(),
                    &STREAM_PORT.to_string(),
                    "5",
                ],
                Duration::from_secs(u64::from(STREAM_SECONDS) + 20),
            )
        });
        // The flood starts once the stream runs and ends before it does.
        thread::sleep(Duration::from_millis(1000));
        let flood = client.output(
            &[
                "python3",
                &path(&flood_py),
                &ECHO.to_string(),
                "53",
                "20000",
                &UDP_FLOWS.to_string(),
                "4",
            ],
            Duration::from_secs(30),
        );
        (stream.join().expect("stream thread"), flood)
    });
    let flood = flood.unwrap_or_else(|e| env.fail(&format!("UDP flood: {e:#}")));
    env.check(flood.status.success(), || {
        format!(
            "UDP flood failed: {}",
            String::from_utf8_lossy(&flood.stderr)
        )
    });
    let stream = stream.unwrap_or_else(|e| env.fail(&format!("stream client: {e:#}")));
    let report: serde_json::Value = serde_json::from_slice(&stream.stdout).unwrap_or_else(|e| {
        env.fail(&format!(
            "stream client printed no report ({e}): {} {}",
            String::from_utf8_lossy(&stream.stdout),
            String::from_utf8_lossy(&stream.stderr)
        ))
    });
    let sent: u64 = std::fs::read_to_string(&server_log)
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix("sent ")?.trim().parse().ok())
        .unwrap_or(0);
    let new_flows = env.agent.counter("new_flow").unwrap_or(0) - new_flows_before;
    eprintln!(
        "stream: {report} (server sent {sent} bytes); {new_flows} new flows through a conntrack map of {CAPACITY} entries"
    );
    env.check(new_flows >= u64::from(UDP_FLOWS), || {
        format!("only {new_flows} new flows: the UDP flood did not reach the datapath")
    });
    env.check(
        report["error"].is_null() && report["eof"] == true && report["mismatch"].is_null(),
        || format!("the TCP stream broke under conntrack pressure: {report}"),
    );
    env.check(sent > 0 && report["bytes"] == sent, || {
        format!(
            "the client received {} of the {sent} bytes sent",
            report["bytes"]
        )
    });
    // A broken translation shows as TCP retransmission timeouts (≥ 1 s, doubling).
    env.check(
        report["max_gap_ms"].as_u64().unwrap_or(u64::MAX) < 3_000,
        || format!("the TCP stream stalled under conntrack pressure: {report}"),
    );
    // Every sized map's occupancy is exported with its real capacity.
    let metrics = env.metrics();
    for (map, capacity) in [
        ("services", None),
        ("backends", None),
        ("rev_nat", None),
        ("maglev", None),
        ("source_ranges", None),
        ("conntrack", Some(CAPACITY)),
        ("snat", Some(CAPACITY)),
        ("sock_rev", None),
        ("affinity", Some(proxy_common::AFFINITY_CAPACITY)),
    ] {
        let value = |series: &str| {
            metrics.lines().find_map(|l| {
                l.strip_prefix(&format!("{series}{{map=\"{map}\"}} "))?
                    .trim()
                    .parse::<f64>()
                    .ok()
            })
        };
        let cap = value("kube_proxy_ebpf_map_capacity");
        env.check(
            cap.is_some_and(|c| c > 0.0) && value("kube_proxy_ebpf_map_entries").is_some(),
            || format!("no occupancy metrics for {map}:\n{metrics}"),
        );
        if let Some(want) = capacity {
            env.check(cap == Some(f64::from(want)), || {
                format!("{map} capacity {cap:?}, want {want}")
            });
        }
    }
}

/// Where the test-only tap (`tc_tap`) sits on a hook.
#[derive(Clone, Copy, Debug)]
enum TapPlace {
    /// A TCX program in front of every other one.
    TcxFirst,
    /// A TCX program behind every other one.
    TcxLast,
    /// A legacy clsact filter (cls_bpf, direct action): runs after all TCX programs.
    Legacy,
}

/// One attached copy of the tap: its own object (own `TAP_V1`), detached on drop.
struct Tap {
    ebpf: aya::Ebpf,
    what: String,
}

impl Tap {
    /// Loads a fresh copy of the object (every other map shrunk to one entry: only the tap runs)
    /// and attaches its `tc_tap` to `ifname` in `node`, from a thread that entered the namespace.
    fn attach(
        node: &proxy_testenv::NetNs,
        ifname: &str,
        hook: TcAttachType,
        place: TapPlace,
    ) -> Self {
        let what = format!("tap {place:?} on {ifname} {hook:?}");
        let ns_path = node.path();
        let ifname = ifname.to_owned();
        let attached = thread::scope(|scope| {
            scope
                .spawn(|| -> Result<aya::Ebpf, String> {
                    let ns = std::fs::File::open(&ns_path).map_err(|e| e.to_string())?;
                    // Moves only this scoped thread.
                    nix::sched::setns(&ns, nix::sched::CloneFlags::CLONE_NEWNET)
                        .map_err(|e| format!("setns: {e}"))?;
                    let mut loader = aya::EbpfLoader::new();
                    for map in proxy_common::ALL_MAPS {
                        loader.map_max_entries(map, 1);
                    }
                    let mut ebpf = loader
                        .load(kube_proxy_ebpf::dataplane::ebpf_object::EBPF_OBJECT)
                        .map_err(|e| format!("loading the object: {e}"))?;
                    let prog: &mut SchedClassifier = ebpf
                        .program_mut(proxy_common::PROG_TC_TAP)
                        .ok_or("no tc_tap program")?
                        .try_into()
                        .map_err(|e| format!("{e}"))?;
                    prog.load().map_err(|e| format!("loading tc_tap: {e}"))?;
                    let options = match place {
                        TapPlace::TcxFirst => TcAttachOptions::TcxOrder(LinkOrder::first()),
                        TapPlace::TcxLast => TcAttachOptions::TcxOrder(LinkOrder::last()),
                        TapPlace::Legacy => {
                            // EEXIST when the other direction created it already.
                            let _ = aya::programs::tc::qdisc_add_clsact(&ifname);
                            TcAttachOptions::Netlink(NlOptions::default())
                        }
                    };
                    prog.attach_with_options(&ifname, hook, options)
                        .map_err(|e| format!("attaching: {e}"))?;
                    Ok(ebpf)
                })
                .join()
                .expect("tap attach thread panicked")
        });
        let ebpf = attached.unwrap_or_else(|e| panic!("{what}: {e}"));
        Self { ebpf, what }
    }

    /// Packets seen so far, per 5-tuple (summed over CPUs).
    fn counts(&self) -> BTreeMap<TapKey, u64> {
        let map: PerCpuHashMap<_, TapKey, u64> = PerCpuHashMap::try_from(
            self.ebpf
                .map(proxy_common::MAP_TAP)
                .unwrap_or_else(|| panic!("{}: no TAP_V1 map", self.what)),
        )
        .unwrap_or_else(|e| panic!("{}: {e}", self.what));
        map.iter()
            .map(|entry| {
                let (key, values) = entry.unwrap_or_else(|e| panic!("{}: {e}", self.what));
                (key, values.iter().sum())
            })
            .collect()
    }
}

/// An endpoint pattern: an address (`None` = any) and a port (0 = any).
type Endpoint = (Option<Ipv4Addr>, u16);

/// TCP packets `from` → `to` a tap saw.
fn tcp_packets(tap: &Tap, from: Endpoint, to: Endpoint) -> u64 {
    let matches = |addr: [u8; 4], port: [u8; 2], (a, p): Endpoint| {
        a.is_none_or(|a| a.octets() == addr) && (p == 0 || port == p.to_be_bytes())
    };
    tap.counts()
        .into_iter()
        .filter(|(k, _)| {
            k.proto == 6 && matches(k.saddr, k.sport, from) && matches(k.daddr, k.dport, to)
        })
        .map(|(_, n)| n)
        .sum()
}

/// The six copies of the tap on the client's host veth.
struct ChainTaps {
    front_in: Tap,
    front_out: Tap,
    earlier_in: Tap,
    earlier_out: Tap,
    legacy_in: Tap,
    legacy_out: Tap,
}

impl ChainTaps {
    /// What each saw (cumulative): requests to the VIP / to a backend, replies from a backend /
    /// from the VIP.
    fn seen(&self) -> [(&'static str, u64); 12] {
        let vip = (Some(WEB), 80);
        let backend = (None, 8080);
        let client = (Some(proxy_testenv::CLIENT_IP), 0);
        [
            (
                "ingress, in front, to the VIP",
                tcp_packets(&self.front_in, client, vip),
            ),
            (
                "ingress, in front, to a backend",
                tcp_packets(&self.front_in, client, backend),
            ),
            (
                "ingress, earlier TCX program, to the VIP",
                tcp_packets(&self.earlier_in, client, vip),
            ),
            (
                "ingress, earlier TCX program, to a backend",
                tcp_packets(&self.earlier_in, client, backend),
            ),
            (
                "ingress, legacy filter, to the VIP",
                tcp_packets(&self.legacy_in, client, vip),
            ),
            (
                "ingress, legacy filter, to a backend",
                tcp_packets(&self.legacy_in, client, backend),
            ),
            (
                "egress, in front, from a backend",
                tcp_packets(&self.front_out, backend, client),
            ),
            (
                "egress, in front, from the VIP",
                tcp_packets(&self.front_out, vip, client),
            ),
            (
                "egress, earlier TCX program, from a backend",
                tcp_packets(&self.earlier_out, backend, client),
            ),
            (
                "egress, earlier TCX program, from the VIP",
                tcp_packets(&self.earlier_out, vip, client),
            ),
            (
                "egress, legacy filter, from a backend",
                tcp_packets(&self.legacy_out, backend, client),
            ),
            (
                "egress, legacy filter, from the VIP",
                tcp_packets(&self.legacy_out, vip, client),
            ),
        ]
    }

    /// 20 requests through the VIP (all answered from it), then: every program saw every packet,
    /// untranslated in front of ours, translated behind; and at least `min_requests` requests.
    fn check(&self, env: &Env, when: &str, min_requests: u64) -> u64 {
        let counts = env.distribution(WEB, 80, 20);
        eprintln!("{when}: 20 requests through {WEB}: {counts:?}");
        let want = |t: &[(&str, u64); 12]| {
            let (requests, replies) = (t[0].1, t[6].1);
            [
                requests, 0, 0, requests, 0, requests, replies, 0, 0, replies, 0, replies,
            ]
        };
        // The last ACKs of a connection can trail curl's exit by a moment: wait (bounded) until
        // the observers agree before judging.
        let deadline = Instant::now() + Duration::from_secs(3);
        let mut seen = self.seen();
        while seen.map(|(_, n)| n) != want(&seen) && Instant::now() < deadline {
            thread::sleep(Duration::from_millis(100));
            seen = self.seen();
        }
        eprintln!("{when}: packets seen by the other programs: {seen:#?}");
        let (requests, replies) = (seen[0].1, seen[6].1);
        env.check(requests >= min_requests && replies >= 20 * 2, || {
            format!(
                "{when}: the program in front saw {requests} request and {replies} reply packets"
            )
        });
        env.check(seen.map(|(_, n)| n) == want(&seen), || {
            format!("{when}: every program on the hooks must see every packet, translated behind ours (want {:?}): {seen:#?}", want(&seen))
        });
        requests
    }
}

/// Another program on the same hook (a CNI's, a policy agent's, a legacy tc filter such as the
/// bandwidth plugin's) keeps working beside ours: on the client's host veth, a TCX program that
/// was there before the agent (appended, as Cilium attaches), a legacy clsact filter, and a TCX
/// program put in front of ours after the agent started. Both hooks: ingress (requests, DNATed)
/// and egress (replies, reverse-NATed). Every one of them sees every packet of the Service
/// traffic — the ones in front untranslated, the ones behind translated — and the requests are
/// still answered from the VIP; the same after an agent restart (the adopted links keep their
/// place). Fails if our programs ended the chain (TC_ACT_OK), were appended behind the earlier
/// program (it would see the VIP), or went back to the head on restart.
#[test]
fn programs_before_and_after_ours_on_the_same_hook_see_every_packet() {
    require_privileged!();
    proxy_testenv::ensure_bpffs().expect("bpffs at /sys/fs/bpf");
    let topo = Topology::new().expect("creating the topology");
    let client_if = topo.pod("client").expect("client pod").host_if.clone();
    let tap = |ns: &proxy_testenv::NetNs, hook, place| Tap::attach(ns, &client_if, hook, place);
    let earlier_in = tap(topo.node(), TcAttachType::Ingress, TapPlace::TcxLast);
    let earlier_out = tap(topo.node(), TcAttachType::Egress, TapPlace::TcxLast);
    let legacy_in = tap(topo.node(), TcAttachType::Ingress, TapPlace::Legacy);
    let legacy_out = tap(topo.node(), TcAttachType::Egress, TapPlace::Legacy);
    let mut env = Env::start_on(topo, |m| web(m, &all_backends()));
    let taps = ChainTaps {
        front_in: tap(env.topo.node(), TcAttachType::Ingress, TapPlace::TcxFirst),
        front_out: tap(env.topo.node(), TcAttachType::Egress, TapPlace::TcxFirst),
        earlier_in,
        earlier_out,
        legacy_in,
        legacy_out,
    };
    let requests = taps.check(&env, "first agent", 20 * 3);

    env.agent
        .restart()
        .unwrap_or_else(|e| env.fail(&format!("restart: {e:#}")));
    env.agent
        .wait_attached(&env.topo.pod_interfaces())
        .unwrap_or_else(|e| panic!("{e:#}"));
    taps.check(&env, "restarted agent", requests + 20 * 3);
    drop(taps);
}

/// A node whose ephemeral port range overlaps the dedicated SNAT ports (61000–65535, used on
/// tunnel devices' own addresses) starts, with a warning naming the sysctl and both ranges.
#[test]
fn an_ephemeral_port_range_overlapping_the_dedicated_snat_ports_starts_with_a_warning() {
    require_privileged!();
    proxy_testenv::ensure_bpffs().expect("bpffs at /sys/fs/bpf");
    let topo = Topology::bare().expect("node namespace");
    topo.node()
        .sysctl("net.ipv4.ip_local_port_range", "32768 65535")
        .expect("widening the port range");
    let manifests = ManifestDir::new().expect("manifest dir");
    let pins = PinDir::new(&format!("{}-pins", topo.prefix())).expect("pin dir");
    // A temporary directory for the agent's log and status file.
    let work = ManifestDir::new().expect("work dir");
    let mut agent = Agent::start(
        Path::new(BIN),
        topo.node(),
        manifests.path(),
        pins.path(),
        work.path(),
    )
    .expect("agent");
    agent
        .wait_log(
            &[
                "net.ipv4.ip_local_port_range is 32768-65535",
                "61000-65535",
                "tunnel devices",
            ],
            Duration::from_secs(20),
        )
        .unwrap_or_else(|e| panic!("{e:#}"));
    agent
        .wait_log(&["ready"], Duration::from_secs(30))
        .unwrap_or_else(|e| panic!("{e:#}"));
}

/// demo/web with `sessionAffinity` (`None`, or `ClientIP` with an optional timeout) as a
/// NodePort (30080 on the node's addresses; here 169.254.1.1, the pods' gateway) over all three
/// backends.
fn sticky_web(manifests: &ManifestDir, affinity: Option<Option<u32>>) {
    let affinity = match affinity {
        None => "  sessionAffinity: None\n".to_owned(),
        Some(None) => "  sessionAffinity: ClientIP\n".to_owned(),
        Some(Some(t)) => format!(
            "  sessionAffinity: ClientIP\n  sessionAffinityConfig:\n    clientIP:\n      \
             timeoutSeconds: {t}\n"
        ),
    };
    let yaml = proxy_testenv::service_yaml(
        "demo",
        "web",
        WEB,
        &[ServicePort::tcp(80, 8080)],
        &all_backends(),
    )
    .replacen(
        "  type: ClusterIP\n",
        &format!("  type: NodePort\n{affinity}"),
        1,
    )
    .replacen(
        "targetPort: 8080\n",
        "targetPort: 8080\n      nodePort: 30080\n",
        1,
    );
    // Staged then renamed, as ManifestDir::write_service does (the agent never reads half a file).
    let staged = manifests.root().join("demo-web.yaml.new");
    std::fs::write(&staged, yaml).expect("writing demo/web");
    std::fs::rename(&staged, manifests.path().join("demo-web.yaml")).expect("renaming demo/web");
}

/// `n` HTTP GETs from `ns` (source address `src` if given) in one curl process: the answering
/// backend of each (empty for a failed request).
fn curl_bodies(
    ns: &proxy_testenv::NetNs,
    src: Option<Ipv4Addr>,
    url: &str,
    n: usize,
) -> Vec<String> {
    let src = src.map(|a| a.to_string());
    let mut args = vec!["curl", "-s", "--max-time", "3", "-H", "Connection: close"];
    if let Some(src) = &src {
        args.extend(["--interface", src.as_str()]);
    }
    args.extend(["-w", "\x1d"]);
    args.extend(std::iter::repeat_n(url, n));
    let out = ns
        .output(&args, Duration::from_secs(10 + 4 * n as u64))
        .expect("running curl");
    String::from_utf8_lossy(&out.stdout)
        .split('\x1d')
        .take(n)
        .map(|b| b.trim().to_owned())
        .collect()
}

/// Polls `dump` (≤ 5 s) until `done` holds of its table.
fn wait_for_dump(
    env: &Env,
    dump: &dyn Fn(&Env) -> String,
    what: &str,
    done: impl Fn(&str) -> bool,
) {
    let start = Instant::now();
    loop {
        let table = dump(env);
        if done(&table) {
            return;
        }
        if start.elapsed() > Duration::from_secs(5) {
            env.fail(&format!(
                "{what}: not in dump affinity within 5 s:\n{table}"
            ));
        }
        thread::sleep(Duration::from_millis(50));
    }
}

/// demo/web as `web` writes it, with its scheduler chosen by the `kube-proxy-ebpf.io/scheduler`
/// annotation.
fn web_scheduled(manifests: &ManifestDir, backends: &[Ipv4Addr], scheduler: &str) {
    manifests
        .write_service_annotated(
            "demo",
            "web",
            WEB,
            &[ServicePort::tcp(80, 8080)],
            backends,
            &[("kube-proxy-ebpf.io/scheduler", scheduler)],
        )
        .expect("writing demo/web");
}

/// rr with real connections: 9 curls from a pod go to the three backends in a fixed cycle, and
/// the node's own processes (socket hooks) continue the same cycle (one position per frontend).
#[test]
fn round_robin_cycles_over_the_backends_for_pods_and_node_processes() {
    require_privileged!();
    let env = Env::start(|m| web_scheduled(m, &all_backends(), "rr"));
    env.wait_scheduler(WEB, "rr");
    let mut bodies = Vec::new();
    for i in 0..9 {
        let reply = env
            .topo
            .curl(&format!("http://{WEB}/"))
            .unwrap_or_else(|e| env.fail(&format!("curl {i}: {e:#}")));
        bodies.push(reply.body);
    }
    for i in 0..3 {
        let view = http_get_with_peer(&env.agent.host(env.topo.node()), WEB, 80)
            .unwrap_or_else(|e| env.fail(&format!("node process {i}: {e:#}")));
        env.check(view.peer == format!("{WEB}:80"), || format!("{view:?}"));
        bodies.push(view.body);
    }
    let cycle = &bodies[..3];
    let distinct: std::collections::BTreeSet<_> = cycle.iter().collect();
    env.check(distinct.len() == 3, || format!("first three: {bodies:?}"));
    for (i, b) in bodies.iter().enumerate() {
        env.check(*b == cycle[i % 3], || {
            format!("request {i} breaks the cycle: {bodies:?}")
        });
    }
}

/// The `FLOWS` column of `dump backends` (the least-connection counts), by backend address.
fn lc_flows(env: &Env) -> BTreeMap<Ipv4Addr, u64> {
    let pin_dir = env.pins.path().to_string_lossy().into_owned();
    let out = env
        .agent
        .cli(&["dump", "backends", "--pin-dir", &pin_dir])
        .unwrap_or_else(|e| env.fail(&format!("dump backends: {e:#}")));
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .skip(1)
        .filter_map(|l| {
            // FAMILY ID ADDRESS PROTO FLOWS FLAGS
            let f: Vec<&str> = l.split_whitespace().collect();
            let addr = f.get(2)?.split(':').next()?.parse().ok()?;
            Some((addr, f.get(4)?.parse().ok()?))
        })
        .collect()
}

/// Waits (≤ 5 s) until `dump backends` shows `want`; the last reading.
fn wait_lc_flows(
    env: &Env,
    want: impl Fn(&BTreeMap<Ipv4Addr, u64>) -> bool,
) -> BTreeMap<Ipv4Addr, u64> {
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let got = lc_flows(env);
        if want(&got) || Instant::now() > deadline {
            return got;
        }
        thread::sleep(Duration::from_millis(50));
    }
}

/// One backend answered every request (and each is a backend): its name.
fn one_backend(env: &Env, what: &str, bodies: &[String]) -> String {
    let first = bodies.first().cloned().unwrap_or_default();
    env.check(
        BACKENDS.iter().any(|(n, _)| *n == first) && bodies.iter().all(|b| *b == first),
        || format!("{what}: answered by {bodies:?}, want one backend throughout"),
    );
    first
}

#[test]
fn session_affinity_keeps_each_client_on_one_backend_through_every_frontend_until_it_times_out() {
    require_privileged!();
    // Extra client addresses on the client pod (10 clients in all), routed back to it.
    let extra: Vec<Ipv4Addr> = (0..9).map(|i| Ipv4Addr::new(10, 244, 1, 100 + i)).collect();
    let topo = Topology::new().expect("topology");
    for a in &extra {
        let pod = topo.pod("client").unwrap();
        pod.ns()
            .exec(&["ip", "addr", "add", &format!("{a}/32"), "dev", "eth0"])
            .expect("client address");
        topo.node()
            .exec(&[
                "ip",
                "route",
                "add",
                &format!("{a}/32"),
                "dev",
                "veth-client",
            ])
            .expect("route to the client address");
    }
    let mut env = Env::start_on(topo, |m| sticky_web(m, Some(None)));
    let client = env.topo.pod("client").unwrap().ns();
    let cluster_ip = format!("http://{WEB}/");
    let node_port = format!("http://{}:30080/", proxy_testenv::GATEWAY);

    // One client: 30 requests to the ClusterIP, then 30 through the NodePort: one backend.
    let first = one_backend(
        &env,
        "ClusterIP",
        &curl_bodies(client, None, &cluster_ip, 30),
    );
    let through_np = one_backend(&env, "NodePort", &curl_bodies(client, None, &node_port, 30));
    env.check(through_np == first, || {
        format!("through the NodePort {through_np}, through the ClusterIP {first}: one scope")
    });

    // The node's own processes (socket hooks): one backend too.
    let host = env.agent.host(env.topo.node());
    let from_node: Vec<String> = (0..15)
        .map(|i| {
            http_get_with_peer(&host, WEB, 80)
                .unwrap_or_else(|e| env.fail(&format!("node request {i}: {e:#}")))
                .body
                .trim()
                .to_owned()
        })
        .collect();
    one_backend(&env, "node processes", &from_node);

    // Ten clients: each sticky, and not all on one backend.
    let mut per_client = BTreeMap::new();
    for a in &extra {
        let got = one_backend(
            &env,
            &format!("client {a}"),
            &curl_bodies(client, Some(*a), &cluster_ip, 6),
        );
        per_client.insert(*a, got);
    }
    per_client.insert(proxy_testenv::CLIENT_IP, first.clone());
    let spread: std::collections::BTreeSet<_> = per_client.values().collect();
    eprintln!("clients → backends: {per_client:?}");
    env.check(spread.len() >= 2, || {
        format!("ten clients all on one backend: {per_client:?}")
    });
    let pin_dir = env.agent.pin_dir().to_string_lossy().into_owned();
    let dump = |env: &Env| {
        let out = env
            .agent
            .cli(&["dump", "affinity", "--pin-dir", &pin_dir])
            .unwrap_or_else(|e| env.fail(&format!("dump affinity: {e:#}")));
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    let table = dump(&env);
    let live = table.lines().filter(|l| l.contains(" live ")).count();
    env.check(live >= 11, || {
        format!("dump affinity should list 10 clients and the node, live:\n{table}")
    });

    let counter = |env: &Env, name: &str| {
        env.agent
            .counter(name)
            .unwrap_or_else(|e| env.fail(&format!("{e:#}")))
    };

    // An agent restart keeps the records (pinned) and the match entries (adopted, the scope ids
    // unchanged): each client's next flow is a hit, to its backend.
    let restarted = env
        .agent
        .restart()
        .and_then(|()| env.agent.wait_synced(1, Duration::from_secs(30)));
    if let Err(e) = restarted {
        env.fail(&format!("restarting the agent: {e:#}"));
    }
    let (hits, misses) = (
        counter(&env, "affinity_hit"),
        counter(&env, "affinity_miss"),
    );
    let client = env.topo.pod("client").unwrap().ns();
    for a in &extra {
        let got = one_backend(
            &env,
            &format!("client {a} after the restart"),
            &curl_bodies(client, Some(*a), &cluster_ip, 1),
        );
        env.check(got == per_client[a], || {
            format!(
                "client {a}: {got} after the restart, {} before",
                per_client[a]
            )
        });
    }
    let (hits2, misses2) = (
        counter(&env, "affinity_hit"),
        counter(&env, "affinity_miss"),
    );
    env.check(hits2 - hits == 9 && misses2 == misses, || {
        format!(
            "after the restart: {} hits, {} misses; want 9, 0",
            hits2 - hits,
            misses2 - misses
        )
    });

    // A 2 s timeout (applies to the next new flows, once the frontend entry has it).
    sticky_web(&env.manifests, Some(Some(2)));
    wait_for_dump(&env, &dump, "the 2 s timeout", |t| {
        t.lines()
            .skip(1)
            .all(|l| l.split_whitespace().nth(6) == Some("2"))
    });
    // Within it (a round, then another at once): hits; past it, every record has expired and
    // each client's next flow is a fresh pick (a miss) that renews its record.
    for a in &extra {
        curl_bodies(client, Some(*a), &cluster_ip, 1);
    }
    let (hits, misses) = (
        counter(&env, "affinity_hit"),
        counter(&env, "affinity_miss"),
    );
    for a in &extra {
        curl_bodies(client, Some(*a), &cluster_ip, 1);
    }
    let (hits2, misses2) = (
        counter(&env, "affinity_hit"),
        counter(&env, "affinity_miss"),
    );
    env.check(hits2 - hits == 9 && misses2 == misses, || {
        format!(
            "within the timeout: {} hits, {} misses; want 9, 0",
            hits2 - hits,
            misses2 - misses
        )
    });
    thread::sleep(Duration::from_millis(3_100));
    let table = dump(&env);
    let expired = table.lines().filter(|l| l.contains(" expired ")).count();
    env.check(expired >= 9, || {
        format!("records past the timeout:\n{table}")
    });
    for a in &extra {
        curl_bodies(client, Some(*a), &cluster_ip, 1);
    }
    let (hits3, misses3) = (
        counter(&env, "affinity_hit"),
        counter(&env, "affinity_miss"),
    );
    env.check(misses3 - misses2 == 9 && hits3 == hits2, || {
        format!(
            "past the timeout: {} misses, {} hits; want 9 fresh picks, 0 hits",
            misses3 - misses2,
            hits3 - hits2
        )
    });
    let table = dump(&env);
    env.check(
        extra.iter().all(|a| {
            table
                .lines()
                .any(|l| l.contains(&format!(" {a} ")) && l.contains(" live "))
        }),
        || format!("renewed records should be live again:\n{table}"),
    );

    // Affinity off: the records are left to age out (no frontend uses their scope), and the
    // next flows spread again.
    sticky_web(&env.manifests, None);
    wait_for_dump(&env, &dump, "affinity off", |t| {
        t.lines().skip(1).all(|l| l.contains(" stale "))
    });
    let bodies = curl_bodies(client, None, &cluster_ip, 30);
    let spread: std::collections::BTreeSet<_> = bodies.iter().collect();
    env.check(
        spread.len() >= 2 && bodies.iter().all(|b| BACKENDS.iter().any(|(n, _)| n == b)),
        || format!("affinity off: {bodies:?}, want at least two backends"),
    );
}

/// The per-scheduler Services: one ClusterIP per scheduler (10.96.0.80 + k), all three
/// backends, chosen by the `kube-proxy-ebpf.io/scheduler` annotation.
fn sched_vip(k: usize) -> Ipv4Addr {
    Ipv4Addr::new(10, 96, 0, 80 + k as u8)
}

fn sched_service(manifests: &ManifestDir, k: usize, annotation: &str) {
    manifests
        .write_service_annotated(
            "demo",
            &format!("sched-{k}"),
            sched_vip(k),
            &[ServicePort::tcp(80, 8080)],
            &all_backends(),
            &[("kube-proxy-ebpf.io/scheduler", annotation)],
        )
        .expect("writing a scheduler Service");
}

/// The second client pod of the scheduler test.
const CLIENT2: (&str, Ipv4Addr) = ("client2", Ipv4Addr::new(10, 244, 1, 3));

impl Env {
    /// `dump services`' SCHED column for the frontend `vip`:80.
    fn dump_scheduler(&self, vip: Ipv4Addr) -> Option<String> {
        let pin = self.pins.path().to_string_lossy().into_owned();
        let out = self
            .agent
            .cli(&["dump", "services", "--pin-dir", &pin])
            .unwrap_or_else(|e| self.fail(&format!("dump services: {e:#}")));
        let text = String::from_utf8_lossy(&out.stdout).into_owned();
        let header: Vec<&str> = text.lines().next()?.split_whitespace().collect();
        let col = header.iter().position(|h| *h == "SCHED")?;
        let row = text
            .lines()
            .find(|l| l.starts_with(&format!("IPv4   {vip}:80 ")))?;
        row.split_whitespace().nth(col).map(str::to_owned)
    }

    /// Waits (≤ 5 s) until `dump services` shows `want` as `vip`'s scheduler.
    fn wait_scheduler(&self, vip: Ipv4Addr, want: &str) {
        let start = Instant::now();
        loop {
            let got = self.dump_scheduler(vip);
            if got.as_deref() == Some(want) {
                return;
            }
            self.check(start.elapsed() < Duration::from_secs(5), || {
                format!("{vip}:80 shows scheduler {got:?} in `dump services`, want {want}")
            });
            thread::sleep(Duration::from_millis(100));
        }
    }
}

/// Requests per backend for each scheduler, chosen per Service by the annotation: 30 requests
/// (one TCP connection each) from each of two clients to a 3-backend ClusterIP per scheduler.
/// Prints the table; asserts the annotation took effect (`dump services`, one pick counted per
/// connection under its scheduler's counter), that `random` spreads, that `sh` keeps each client
/// on one backend and that `dh` sends everything to one backend (one destination address). Then
/// the `random` Service's annotation changes to `dh` alone and its frontend follows.
#[test]
fn requests_per_backend_for_each_scheduler_annotation() {
    require_privileged!();
    const PER_CLIENT: usize = 30;
    proxy_testenv::ensure_bpffs().expect("bpffs at /sys/fs/bpf");
    let mut topo = Topology::new().expect("creating the topology");
    topo.add_pod(CLIENT2.0, CLIENT2.1).expect("second client");
    let schedulers = proxy_common::Scheduler::ALL;
    let env = Env::start_on(topo, |m| {
        for (k, s) in schedulers.iter().enumerate() {
            sched_service(m, k, s.name());
        }
    });
    let clients = ["client", CLIENT2.0];
    let mut table = String::from("scheduler | be1 | be2 | be3 | per client\n");
    let mut results = BTreeMap::new();
    for (k, s) in schedulers.iter().enumerate() {
        let vip = sched_vip(k);
        env.wait_scheduler(vip, s.name());
        let counter = proxy_common::stats::PICK_COUNTERS[k].name();
        let picks_before = env.agent.counter(counter).expect("pick counter");
        let per_client: Vec<BTreeMap<String, usize>> = clients
            .iter()
            .map(|c| env.distribution_from(c, vip, 80, PER_CLIENT))
            .collect();
        let picks = env.agent.counter(counter).expect("pick counter") - picks_before;
        env.check(picks == (PER_CLIENT * clients.len()) as u64, || {
            format!(
                "{}: {picks} picks counted in {counter} for {} connections",
                s.name(),
                PER_CLIENT * clients.len()
            )
        });
        let mut total: BTreeMap<String, usize> = BTreeMap::new();
        for m in &per_client {
            for (b, n) in m {
                *total.entry(b.clone()).or_default() += n;
            }
        }
        let n = |b: &str| total.get(b).copied().unwrap_or(0);
        let _ = writeln!(
            table,
            "{:<9} | {:>3} | {:>3} | {:>3} | {per_client:?}",
            s.name(),
            n("be1"),
            n("be2"),
            n("be3"),
        );
        results.insert(*s, (total, per_client));
    }
    eprintln!("requests per backend ({PER_CLIENT} from each of {clients:?}):\n{table}");
    use proxy_common::Scheduler::{
        DestinationHash, LeastConnection, Maglev, Random, RoundRobin, SourceHash,
    };
    // Sequential new flows to one frontend: rr gives each backend exactly its third.
    let (rr, _) = &results[&RoundRobin];
    env.check(
        rr.len() == 3 && rr.values().all(|&n| n == 2 * PER_CLIENT / 3),
        || format!("rr is not an exact cycle:\n{table}"),
    );
    // Every connection closed before the next began: all counts equal, so lc spreads like its
    // candidates' hash start; Maglev spreads the flows' 5-tuples over its table.
    for s in [LeastConnection, Maglev] {
        env.check(results[&s].0.len() >= 2, || {
            format!("{} did not spread:\n{table}", s.name())
        });
    }
    let (random, _) = &results[&Random];
    env.check(random.len() >= 2, || {
        format!("random did not spread:\n{table}")
    });
    let (_, sh) = &results[&SourceHash];
    env.check(sh.iter().all(|m| m.len() == 1), || {
        format!("sh sent one client to several backends:\n{table}")
    });
    let (dh, _) = &results[&DestinationHash];
    env.check(dh.len() == 1, || {
        format!("dh used several backends:\n{table}")
    });

    // The annotation alone changes: the frontend follows within the manifest reload.
    let k = schedulers
        .iter()
        .position(|s| *s == Random)
        .expect("random");
    sched_service(&env.manifests, k, "dh");
    env.wait_scheduler(sched_vip(k), "dh");
    let mut after: BTreeMap<String, usize> = BTreeMap::new();
    for c in clients {
        for (b, n) in env.distribution_from(c, sched_vip(k), 80, PER_CLIENT) {
            *after.entry(b).or_default() += n;
        }
    }
    eprintln!("random → dh by annotation: {after:?}");
    env.check(after.len() == 1, || {
        format!("after switching to dh: {after:?}")
    });
}

/// Least connection with real connections: two long-lived connections held open land on two
/// backends (each new flow goes to a least loaded one), then 10 curls are all answered by the
/// third, idle backend; the counts (`dump backends`) follow the connections, back to zero once
/// every one of them closed.
#[test]
fn least_connection_sends_new_connections_to_the_backend_without_long_ones() {
    require_privileged!();
    let env = Env::start(|m| web_scheduled(m, &all_backends(), "lc"));
    env.wait_scheduler(WEB, "lc");
    let idle = |c: &BTreeMap<Ipv4Addr, u64>| c.len() == 3 && c.values().all(|&n| n == 0);
    let start = wait_lc_flows(&env, idle);
    env.check(idle(&start), || {
        format!("counts before any flow: {start:?}")
    });
    let client = env.topo.pod("client").expect("client pod");
    let hold = format!(
        "import socket,time; s=socket.create_connection(('{WEB}',80),timeout=5); print('ok',flush=True); time.sleep(20)"
    );
    let mut holders = Vec::new();
    let mut held = BTreeMap::new();
    for i in 1..=2u64 {
        holders.push(
            client
                .ns()
                .spawn(&["python3", "-c", &hold], None)
                .unwrap_or_else(|e| env.fail(&format!("holder {i}: {e:#}"))),
        );
        held = wait_lc_flows(&env, |c| c.values().sum::<u64>() == i);
        env.check(held.values().sum::<u64>() == i, || {
            format!("{i} held connections, counts {held:?}")
        });
    }
    env.check(held.values().filter(|&&n| n == 1).count() == 2, || {
        format!("the two held connections share a backend: {held:?}")
    });
    let (&spare, _) = held
        .iter()
        .find(|(_, n)| **n == 0)
        .expect("an idle backend");
    let spare_name = BACKENDS
        .iter()
        .find(|(_, ip)| *ip == spare)
        .expect("backend")
        .0;
    for i in 0..10 {
        let reply = env
            .topo
            .curl(&format!("http://{WEB}/"))
            .unwrap_or_else(|e| env.fail(&format!("curl {i}: {e:#}")));
        env.check(reply.body == spare_name, || {
            format!(
                "curl {i} answered by {} while {spare_name} was idle ({held:?})",
                reply.body
            )
        });
        // The closed connection gave its unit back.
        let after = wait_lc_flows(&env, |c| c == &held);
        env.check(after == held, || {
            format!("after curl {i}: {after:?}, want {held:?}")
        });
    }
    drop(holders); // Killed: their connections end with a FIN.
    let end = wait_lc_flows(&env, idle);
    env.check(idle(&end), || {
        format!("counts after every connection closed: {end:?}")
    });
}

const MAGLEV: Ipv4Addr = Ipv4Addr::new(10, 96, 0, 70);

/// One UDP request per source port `first..first + n` to ip:port, from one client, each
/// retried up to 3 times; prints `port name` per answered port (the echo server answers
/// `name:payload`). Stops after 60 s whatever is left.
const MAGLEV_FLOWS_PY: &str = r#"
import socket, sys, time
ip, port, first, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
start = time.monotonic()
for p in range(first, first + n):
    if time.monotonic() - start > 60:
        break
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("0.0.0.0", p))
    s.settimeout(0.5)
    for attempt in range(3):
        s.sendto(b"mh%d" % p, (ip, port))
        try:
            data, _ = s.recvfrom(2048)
            print(p, data.split(b":")[0].decode(), flush=True)
            break
        except socket.timeout:
            pass
    s.close()
"#;

/// demo/maglev: UDP 53 → `endpoints`' echo servers, scheduler `mh` by annotation.
fn maglev_service(manifests: &ManifestDir, endpoints: &[Ipv4Addr]) {
    let yaml = proxy_testenv::service_yaml(
        "demo",
        "maglev",
        MAGLEV,
        &[ServicePort::udp(53, 5353)],
        endpoints,
    );
    let yaml = yaml.replacen(
        "  namespace: demo\n",
        "  namespace: demo\n  annotations:\n    kube-proxy-ebpf.io/scheduler: mh\n",
        1,
    );
    assert!(yaml.contains("scheduler: mh"), "annotation placed");
    let staged = manifests.root().join("demo-maglev.yaml");
    std::fs::write(&staged, yaml).expect("writing demo/maglev");
    std::fs::rename(&staged, manifests.path().join("demo-maglev.yaml")).expect("renaming");
}

/// Maglev keeps flows where they were when one of N backends goes: five UDP echo backends
/// behind an `mh` Service, 1,000 UDP flows from one client (distinct source ports) each answered
/// by a backend that names itself; be5 leaves the EndpointSlice; after the flows' conntrack
/// entries expired (UDP timeouts of 1 s), the same 1,000 5-tuples are new flows again and the
/// new table places them: flows of the four remaining backends stay (the table's mapping of the
/// same 5-tuples; a few at most move), and be5's spread over the four.
#[test]
fn maglev_moves_only_the_gone_backend_s_flows_when_one_of_five_goes() {
    require_privileged!();
    const FLOWS: u16 = 1_000;
    proxy_testenv::ensure_bpffs().expect("bpffs at /sys/fs/bpf");
    let mut topo = Topology::new().expect("creating the topology");
    let extra = [
        ("be4", Ipv4Addr::new(10, 244, 1, 14)),
        ("be5", Ipv4Addr::new(10, 244, 1, 15)),
    ];
    for (name, ip) in extra {
        topo.add_backend(name, ip).expect("adding a backend pod");
    }
    let mut five = all_backends();
    five.extend(extra.iter().map(|(_, ip)| *ip));
    let mut env = Env::start_on_with_flags(
        topo,
        |m| maglev_service(m, &five),
        &[
            "--conntrack-udp-timeout",
            "1s",
            "--conntrack-udp-timeout-stream",
            "1s",
        ],
    );
    let script = env.topo.tmp().join("maglev_flows.py");
    std::fs::write(&script, MAGLEV_FLOWS_PY).expect("writing the flow script");
    let flows = |env: &Env| -> BTreeMap<u16, String> {
        let client = env.topo.pod("client").expect("client pod").ns();
        let out = client
            .output(
                &[
                    "python3",
                    script.to_str().expect("utf-8 path"),
                    &MAGLEV.to_string(),
                    "53",
                    "20000",
                    &FLOWS.to_string(),
                ],
                Duration::from_secs(90),
            )
            .unwrap_or_else(|e| env.fail(&format!("flow script: {e:#}")));
        let text = String::from_utf8_lossy(&out.stdout);
        let got: BTreeMap<u16, String> = text
            .lines()
            .filter_map(|l| {
                let (p, name) = l.split_once(' ')?;
                Some((p.parse().ok()?, name.to_owned()))
            })
            .collect();
        env.check(got.len() == usize::from(FLOWS), || {
            format!("{} of {FLOWS} flows answered: {:?}", got.len(), out)
        });
        got
    };
    let per_backend = |m: &BTreeMap<u16, String>| {
        let mut c: BTreeMap<String, usize> = BTreeMap::new();
        for name in m.values() {
            *c.entry(name.clone()).or_default() += 1;
        }
        c
    };

    let before = flows(&env);
    let spread = per_backend(&before);
    eprintln!("Maglev over five backends, 1,000 flows: {spread:?}");
    env.check(
        spread.len() == 5 && spread.values().all(|n| (120..=280).contains(n)),
        || format!("five backends should share 1,000 flows about evenly: {spread:?}"),
    );

    // `dump maglev` shows the one table, whole, with five backends' shares.
    let pin = env.pins.path().to_str().expect("utf-8 pin dir").to_owned();
    let dump = env
        .agent
        .cli(&["dump", "maglev", "--pin-dir", &pin])
        .unwrap_or_else(|e| env.fail(&format!("dump maglev: {e:#}")));
    let dump = String::from_utf8_lossy(&dump.stdout);
    env.check(
        dump.starts_with(&format!(
            "table 1: 16381 entries (chunks of 960), frontends: {MAGLEV}:53/UDP\n"
        )) && dump
            .lines()
            .filter(|l| l.contains(" entries  10.244.1."))
            .count()
            == 5,
        || format!("dump maglev:\n{dump}"),
    );

    // be5 goes; wait until the agent carries four backends, then for the entries to expire.
    maglev_service(&env.manifests, &five[..4]);
    env.agent
        .wait_status(Duration::from_secs(10), |s| s.backends == 4)
        .unwrap_or_else(|e| env.fail(&format!("be5 not removed: {e:#}")));
    thread::sleep(Duration::from_millis(2_500));

    let after = flows(&env);
    let (mut stayed, mut moved, mut from_be5) = (0, 0, BTreeMap::<String, usize>::new());
    for (port, was) in &before {
        let now = &after[port];
        env.check(now != "be5", || format!("port {port} still reached be5"));
        if was == "be5" {
            *from_be5.entry(now.clone()).or_default() += 1;
        } else if now == was {
            stayed += 1;
        } else {
            moved += 1;
        }
    }
    eprintln!(
        "after be5 left: {stayed} flows of the other four stayed, {moved} moved; be5's {} went to \
         {from_be5:?}",
        spread["be5"]
    );
    // Maglev's bound: the survivors keep nearly all their flows (the model moves ~0.3 % of
    // their table entries for N=5); a hash over the count would move ~4/5 × 1/5 of them.
    env.check(moved * 20 < stayed, || {
        format!(
            "{moved} of {} flows of surviving backends moved",
            stayed + moved
        )
    });
    env.check(
        from_be5.len() == 4 && from_be5.values().all(|n| n * 10 >= spread["be5"]),
        || format!("be5's flows should spread over the four others: {from_be5:?}"),
    );
}

/// The lines of the agent's current run (after the last `--- starting` marker of its log) that
/// come from the datapath trace (`--bpf-log`).
fn datapath_log_lines(agent: &Agent) -> Vec<String> {
    let log = std::fs::read_to_string(agent.log_path()).unwrap_or_default();
    let run = log.rsplit("--- starting").next().unwrap_or_default();
    // The fmt layer prints a record's target before its message.
    let target = format!(" {}: ", proxy_common::bpf_log::TARGET);
    run.lines()
        .filter(|l| l.contains(&target))
        .map(str::to_owned)
        .collect()
}

/// `--bpf-log debug`: the datapath's records reach the agent's log through tracing, one line per
/// new flow naming the client, the ClusterIP and the backend that answered; the first reply is
/// logged too. Restarted without the flag (pins adopted, the old programs' ring buffer gone with
/// them), the agent logs no datapath line and still translates; with the flag again, the lines
/// come back from the new programs.
#[test]
fn bpf_log_debug_names_the_backend_of_each_new_flow_and_is_silent_without_the_flag() {
    require_privileged!();
    const N: usize = 4;
    let mut env = Env::start_with_flags(|m| web(m, &all_backends()), &["--bpf-log", "debug"]);
    let manifests = env.manifests.path().as_os_str().to_owned();
    let with_flag: [&std::ffi::OsStr; 4] = [
        "--manifests".as_ref(),
        &manifests,
        "--bpf-log".as_ref(),
        "debug".as_ref(),
    ];
    // The pods that answered, in request order (each request is a connection of its own).
    let answered = |env: &Env| -> Vec<Ipv4Addr> {
        let replies = env
            .topo
            .curl_many(&format!("http://{WEB}/"), N)
            .unwrap_or_else(|e| env.fail(&format!("curl_many: {e:#}")));
        replies
            .into_iter()
            .map(|r| {
                let r = r.unwrap_or_else(|e| env.fail(&format!("request to {WEB}: {e}")));
                BACKENDS
                    .iter()
                    .find(|(name, _)| *name == r.body)
                    .unwrap_or_else(|| env.fail(&format!("answer from unknown pod {r:?}")))
                    .1
            })
            .collect()
    };
    // The new-flow lines of this run once there are `n` (the logger task drains the ring
    // buffer asynchronously): the backend address each names, in order.
    let new_flows = |env: &Env, n: usize| -> (Vec<Ipv4Addr>, Vec<String>) {
        let deadline = Instant::now() + Duration::from_secs(5);
        loop {
            let lines = datapath_log_lines(&env.agent);
            let flows: Vec<Ipv4Addr> = lines
                .iter()
                .filter_map(|l| {
                    let rest =
                        l.split_once(&format!("new flow tcp {}:", proxy_testenv::CLIENT_IP))?;
                    let (_, rest) = rest.1.split_once(&format!(" -> {WEB}:80: backend "))?;
                    let (_id, rest) = rest.split_once(' ')?;
                    let (addr, rest) = rest.split_once(':')?;
                    rest.starts_with("8080 (random)")
                        .then(|| addr.parse().ok())?
                })
                .collect();
            if flows.len() >= n || Instant::now() >= deadline {
                return (flows, lines);
            }
            thread::sleep(Duration::from_millis(50));
        }
    };

    let backends = answered(&env);
    let (flows, lines) = new_flows(&env, N);
    eprintln!("datapath log:\n{}", lines.join("\n"));
    env.check(flows == backends, || {
        format!(
            "new-flow lines name backends {flows:?}, the requests were answered by {backends:?}; datapath lines:\n{}",
            lines.join("\n")
        )
    });
    env.check(lines.iter().all(|l| l.contains("DEBUG")), || {
        format!(
            "debug records only at --bpf-log debug:\n{}",
            lines.join("\n")
        )
    });
    env.check(
        lines.iter().any(|l| {
            l.contains("first reply ")
                && l.contains(&format!(" -> {}:", proxy_testenv::CLIENT_IP))
                && l.contains(&format!(": from {WEB}:80"))
        }),
        || format!("no first-reply line:\n{}", lines.join("\n")),
    );
    // A process of the node's own: the socket hook's rewrite of its connect().
    let view = http_get_with_peer(&env.agent.host(env.topo.node()), WEB, 80)
        .unwrap_or_else(|e| env.fail(&format!("node process to {WEB}:80: {e:#}")));
    let be = BACKENDS
        .iter()
        .find(|(name, _)| *name == view.body)
        .unwrap_or_else(|| env.fail(&format!("answer from unknown pod {view:?}")))
        .1;
    let want = format!("socket tcp -> {WEB}:80: backend ");
    let deadline = Instant::now() + Duration::from_secs(5);
    let socket_line = loop {
        let line = datapath_log_lines(&env.agent)
            .into_iter()
            .find(|l| l.contains(&want));
        if line.is_some() || Instant::now() >= deadline {
            break line;
        }
        thread::sleep(Duration::from_millis(50));
    };
    env.check(
        socket_line
            .as_deref()
            .is_some_and(|l| l.ends_with(&format!(" {be}:8080"))),
        || format!("socket-hook line {socket_line:?}, want `{want}<id> {be}:8080`"),
    );

    // Without the flag: no logger, and the programs have their log calls removed.
    env.agent
        .restart_with(&with_flag[..2])
        .unwrap_or_else(|e| env.fail(&format!("restart without --bpf-log: {e:#}")));
    env.agent
        .wait_attached(&env.topo.pod_interfaces())
        .unwrap_or_else(|e| env.fail(&format!("{e:#}")));
    let backends = answered(&env);
    env.check(backends.len() == N, || format!("{backends:?}"));
    thread::sleep(Duration::from_millis(300));
    let lines = datapath_log_lines(&env.agent);
    env.check(lines.is_empty(), || {
        format!("datapath lines without --bpf-log:\n{}", lines.join("\n"))
    });

    // With the flag again: the new programs' records, through the new agent's ring buffer.
    env.agent
        .restart_with(&with_flag)
        .unwrap_or_else(|e| env.fail(&format!("restart with --bpf-log: {e:#}")));
    env.agent
        .wait_attached(&env.topo.pod_interfaces())
        .unwrap_or_else(|e| env.fail(&format!("{e:#}")));
    let backends = answered(&env);
    let (flows, lines) = new_flows(&env, N);
    env.check(flows == backends, || {
        format!(
            "after the restarts: new-flow lines name {flows:?}, answered by {backends:?}:\n{}",
            lines.join("\n")
        )
    });
}

/// CRC32c and raw SCTP helpers shared by the two scripts below (this kernel has no SCTP sockets:
/// CONFIG_IP_SCTP is off, so both ends speak SCTP over raw IP sockets, protocol 132).
const SCTP_PY_COMMON: &str = r#"
import socket, struct, sys, time
T = []
for n in range(256):
    c = n
    for _ in range(8):
        c = (c >> 1) ^ (0x82F63B78 if c & 1 else 0)
    T.append(c)
def crc(b):
    c = 0xffffffff
    for x in b:
        c = (c >> 8) ^ T[(c ^ x) & 0xff]
    return c ^ 0xffffffff
def field(s):
    return struct.pack('<I', crc(s[:8] + b'\0' * 4 + s[12:]))
def with_crc(s):
    return s[:8] + field(s) + s[12:]
def sctp_of(pkt):
    return pkt[(pkt[0] & 15) * 4:]
"#;

/// Backend: waits for an INIT to `me`:`port` (after DNAT), checks its CRC32c, answers an
/// INIT_ACK carrying the INIT's initiate tag, prints what it saw.
const SCTP_SERVER_PY: &str = r#"
me, port = sys.argv[1], int(sys.argv[2])
s = socket.socket(socket.AF_INET, socket.SOCK_RAW, 132)
s.settimeout(20)
while True:
    pkt, (src, _) = s.recvfrom(65535)
    dst = socket.inet_ntoa(pkt[16:20])
    sctp = sctp_of(pkt)
    sport, dport = struct.unpack('!HH', sctp[:4])
    if dst != me or dport != port or sctp[12] != 1:
        continue
    if sctp[8:12] != field(sctp):
        sys.exit('INIT with a bad CRC32c')
    value = b'\x55\x66\x77\x88' + struct.pack('!IHHI', 65535, 1, 1, 1) + b'\x00\x07\x00\x08cook'
    chunk = struct.pack('!BBH', 2, 0, 4 + len(value)) + value
    out = struct.pack('!HH', dport, sport) + sctp[16:20] + b'\0' * 4 + chunk
    s.sendto(with_crc(out), (src, 0))
    print(f'INIT {src}:{sport} -> {dst}:{dport} crc ok', flush=True)
    break
"#;

/// Client: sends an INIT (retransmitted every 0.5 s, as SCTP does) to `vip`:`port` from
/// `sport`, prints the INIT_ACK's source, verification tag and CRC32c verdict.
const SCTP_CLIENT_PY: &str = r#"
vip, port, sport = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
s = socket.socket(socket.AF_INET, socket.SOCK_RAW, 132)
s.settimeout(0.5)
value = b'\x11\x22\x33\x44' + struct.pack('!IHHI', 65535, 1, 1, 1000)
chunk = struct.pack('!BBH', 1, 0, 4 + len(value)) + value
init = with_crc(struct.pack('!HHI', sport, port, 0) + b'\0' * 4 + chunk)
deadline = time.time() + 10
while time.time() < deadline:
    s.sendto(init, (vip, 0))
    try:
        while True:
            pkt, (src, _) = s.recvfrom(65535)
            sctp = sctp_of(pkt)
            psport, pdport, vtag = struct.unpack('!HHI', sctp[:8])
            if pdport != sport:
                continue
            ok = 'ok' if sctp[8:12] == field(sctp) else 'bad'
            print(f'{src}:{psport} chunk {sctp[12]} vtag {vtag:#x} crc {ok}')
            sys.exit(0)
    except socket.timeout:
        pass
sys.exit('no answer to the INIT')
"#;

/// An SCTP association's first exchange through a ClusterIP whose target port differs: the
/// backend receives the INIT at its own address and port with a valid CRC32c, and the client
/// gets the INIT_ACK from VIP:port with a valid CRC32c (DNAT and reverse NAT, both CRC updates).
#[test]
fn sctp_init_through_a_clusterip_is_answered_from_the_vip() {
    require_privileged!();
    const SIG: Ipv4Addr = Ipv4Addr::new(10, 96, 0, 70);
    let (be_name, be_ip) = BACKENDS[0];
    let env = Env::start(|m| {
        m.write_service(
            "demo",
            "sig",
            SIG,
            &[ServicePort::sctp(3868, 3869)],
            &[be_ip],
        )
        .expect("writing demo/sig");
    });
    let backend = env
        .topo
        .pod(be_name)
        .unwrap_or_else(|e| env.fail(&format!("{e:#}")));
    let log = env.topo.tmp().path().join("sctp-server.log");
    let server = format!("{SCTP_PY_COMMON}{SCTP_SERVER_PY}");
    let mut server = backend
        .ns()
        .spawn(
            &["python3", "-c", &server, &be_ip.to_string(), "3869"],
            Some(&log),
        )
        .unwrap_or_else(|e| env.fail(&format!("starting the SCTP server: {e:#}")));
    let client = env
        .topo
        .pod("client")
        .unwrap_or_else(|e| env.fail(&format!("{e:#}")));
    let script = format!("{SCTP_PY_COMMON}{SCTP_CLIENT_PY}");
    let out = client
        .ns()
        .output(
            &["python3", "-c", &script, &SIG.to_string(), "3868", "40000"],
            Duration::from_secs(20),
        )
        .unwrap_or_else(|e| env.fail(&format!("SCTP client: {e:#}")));
    let status = server
        .wait_timeout(Duration::from_secs(5))
        .unwrap_or_else(|e| env.fail(&format!("SCTP server: {e:#}")));
    let seen = server.log_tail(2000);
    env.check(status.is_some_and(|s| s.success()), || {
        format!("SCTP server failed ({status:?}): {seen}")
    });
    env.check(
        seen.contains(&format!(
            "INIT {}:40000 -> {be_ip}:3869 crc ok",
            proxy_testenv::CLIENT_IP
        )),
        || format!("backend saw {seen:?}"),
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    env.check(out.status.success(), || {
        format!(
            "SCTP client failed: {stdout} {}",
            String::from_utf8_lossy(&out.stderr)
        )
    });
    env.check(
        stdout.trim() == format!("{SIG}:3868 chunk 2 vtag 0x11223344 crc ok"),
        || format!("client got {stdout:?}"),
    );
}
