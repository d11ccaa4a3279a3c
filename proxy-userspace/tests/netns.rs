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

use aya::{
    maps::PerCpuHashMap,
    programs::{
        LinkOrder, SchedClassifier, TcAttachType,
        tc::{NlOptions, TcAttachOptions},
    },
};
use proxy_common::TapKey;
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
        proxy_testenv::ensure_bpffs().expect("bpffs at /sys/fs/bpf");
        Self::start_on(Topology::new().expect("creating the topology"), services)
    }

    /// As [`Env::start`] on a topology the test prepared (programs already on its interfaces).
    fn start_on(topo: Topology, services: impl FnOnce(&ManifestDir)) -> Self {
        let manifests = ManifestDir::new().expect("manifest dir");
        services(&manifests);
        let pins = PinDir::new(&format!("{}-pins", topo.prefix())).expect("pin dir");
        let mut agent = Agent::start(
            Path::new(BIN),
            topo.node(),
            manifests.path(),
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
                    // SAFETY: setns(2) on a valid fd; moves only this scoped thread.
                    if unsafe {
                        libc::setns(std::os::fd::AsRawFd::as_raw_fd(&ns), libc::CLONE_NEWNET)
                    } != 0
                    {
                        return Err(std::io::Error::last_os_error().to_string());
                    }
                    let mut loader = aya::EbpfLoader::new();
                    for map in proxy_common::ALL_MAPS {
                        loader.map_max_entries(map, 1);
                    }
                    let mut ebpf = loader
                        .load(kube_proxy_ebpf::ebpf_object::EBPF_OBJECT)
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
        let counts = env.web_distribution(20);
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

/// A node whose ephemeral port range overlaps the SNAT ports (61000–65535) is refused at start,
/// with an error naming the sysctl and both ranges; the default range (32768–60999) starts.
#[test]
fn an_ephemeral_port_range_overlapping_the_snat_ports_refuses_to_start() {
    require_privileged!();
    proxy_testenv::ensure_bpffs().expect("bpffs at /sys/fs/bpf");
    let topo = Topology::bare().expect("node namespace");
    topo.node()
        .sysctl("net.ipv4.ip_local_port_range", "32768 65535")
        .expect("widening the port range");
    let manifests = ManifestDir::new().expect("manifest dir");
    let pins = PinDir::new(&format!("{}-pins", topo.prefix())).expect("pin dir");
    let mut cmd = topo.node().nsenter(&[BIN, "run"]);
    cmd.arg("--manifests")
        .arg(manifests.path())
        .arg("--pin-dir")
        .arg(pins.path())
        .args(["--socket-lb-cgroup", "none"]);
    let out = proxy_testenv::run_with_timeout(cmd, Duration::from_secs(20)).expect("agent run");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "the agent started: {stderr}");
    for part in ["net.ipv4.ip_local_port_range", "32768-65535", "61000-65535"] {
        assert!(stderr.contains(part), "error lacks {part:?}: {stderr}");
    }
    assert!(
        !pins.path().join(proxy_common::MAP_SERVICES).exists(),
        "nothing may be loaded before the check"
    );
}
