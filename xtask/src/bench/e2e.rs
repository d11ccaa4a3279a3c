//! End to end through the namespace topology: short-connection rate and latency (handshake
//! included) and iperf3 throughput, through a ClusterIP and straight to the pods, for the agent
//! and for kube-proxy's iptables and nftables rule sets (each in its own node namespace, no
//! agent). Also the control-plane baselines: agent start → first sync and peak RSS, and
//! `iptables-restore` / `nft -f` times.
//!
//! Network safety: every namespace comes from proxy-testenv's guards (unique prefix, no route
//! out, removed on drop); rule sets are loaded only with `ip netns exec <node-ns>`; every load
//! loop is bounded in time and count; every process is a PID-owned guard.

use std::{
    net::{Ipv4Addr, SocketAddrV4},
    path::{Path, PathBuf},
    time::{Duration, Instant},
};

use anyhow::{Context as _, Result, bail, ensure};
use proxy_testenv::{Agent, Exec, ManifestDir, NetNs, PinDir, Proc, Topology};
use serde_json::{Value, json};

use super::{
    loadgen::LoadResult,
    workload::{self, SvcSpec},
};

/// The Service the load goes to (10 real backend pods :8080).
pub const HTTP_VIP: Ipv4Addr = Ipv4Addr::new(10, 96, 0, 10);
/// iperf3 Service (one endpoint: be1:5201).
pub const IPERF_VIP: Ipv4Addr = Ipv4Addr::new(10, 96, 0, 11);
const CLIENT_IP: Ipv4Addr = Ipv4Addr::new(10, 244, 255, 2);
const HTTP_PORT: u16 = 8080;
const IPERF_PORT: u16 = 5201;

/// The dataplane under test.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    Ebpf,
    Iptables,
    Nftables,
}

impl Mode {
    pub const ALL: [Mode; 3] = [Mode::Ebpf, Mode::Iptables, Mode::Nftables];

    pub fn name(self) -> &'static str {
        match self {
            Mode::Ebpf => "kube-proxy-ebpf",
            Mode::Iptables => "iptables",
            Mode::Nftables => "nftables",
        }
    }
}

#[derive(Clone, Debug)]
pub struct Config {
    /// The bench binary itself (its `serve` and `loadgen` subcommands run in the namespaces).
    pub bench_bin: PathBuf,
    pub agent_bin: PathBuf,
    pub backends: usize,
    pub concurrency: usize,
    pub duration_ms: u64,
    pub max_conns: u64,
    pub iperf_secs: u32,
    /// Bound on iptables-restore / nft -f / agent first sync.
    pub program_timeout: Duration,
}

/// One mode at one size.
#[derive(Clone, Debug)]
pub struct Run {
    pub mode: Mode,
    pub services: usize,
    /// How long programming took (agent start → first sync, or the restore command).
    pub program_ms: Option<f64>,
    /// Why the run was not measured (programming timed out or failed).
    pub skipped: Option<String>,
    pub direct: Option<LoadResult>,
    pub vip: Option<LoadResult>,
    pub iperf_direct_gbps: Option<f64>,
    pub iperf_vip_gbps: Option<f64>,
    /// The same short connections from a process of the node itself (host network): straight to
    /// the pods, and through the VIP (our socket hooks; netfilter's OUTPUT chain for the
    /// baselines).
    pub host_direct: Option<LoadResult>,
    pub host_vip: Option<LoadResult>,
}

impl Run {
    pub fn to_json(&self) -> Value {
        json!({
            "mode": self.mode.name(), "services": self.services, "program_ms": self.program_ms,
            "skipped": self.skipped,
            "direct": self.direct.as_ref().map(LoadResult::to_json),
            "vip": self.vip.as_ref().map(LoadResult::to_json),
            "iperf_direct_gbps": self.iperf_direct_gbps, "iperf_vip_gbps": self.iperf_vip_gbps,
            "host_direct": self.host_direct.as_ref().map(LoadResult::to_json),
            "host_vip": self.host_vip.as_ref().map(LoadResult::to_json),
        })
    }
}

/// The generated Services plus the two measured ones.
fn services(n: usize, backends: &[Ipv4Addr]) -> Vec<SvcSpec> {
    let mut specs = workload::generated(n);
    specs.push(SvcSpec::new("http", HTTP_VIP, 80, HTTP_PORT, backends));
    specs.push(SvcSpec::new(
        "iperf",
        IPERF_VIP,
        IPERF_PORT,
        IPERF_PORT,
        &backends[..1],
    ));
    specs
}

fn backend_ip(i: usize) -> Ipv4Addr {
    Ipv4Addr::new(10, 244, 255, 11 + i as u8)
}

/// A topology for one run: node, client, backends with the bench's HTTP server, iperf3 on be1.
struct Env {
    // Drop order: servers, then the topology (namespaces, temp dir).
    _servers: Vec<Proc>,
    topo: Topology,
    backends: Vec<Ipv4Addr>,
}

impl Env {
    fn new(cfg: &Config) -> Result<Self> {
        let mut topo = Topology::bare().context("creating the bench topology")?;
        topo.add_pod("client", CLIENT_IP)?;
        let mut servers = Vec::new();
        let mut backends = Vec::new();
        let bin = path_str(&cfg.bench_bin)?.to_owned();
        for i in 0..cfg.backends {
            let name = format!("be{}", i + 1);
            let ip = backend_ip(i);
            topo.add_pod(&name, ip)?;
            let ready = topo.tmp().join(&format!("{name}.ready"));
            let log = topo.tmp().join(&format!("{name}.log"));
            let proc = topo.pod(&name)?.ns().spawn(
                &[
                    &bin,
                    "serve",
                    "--port",
                    &HTTP_PORT.to_string(),
                    "--threads",
                    "4",
                    "--name",
                    &name,
                    "--ready",
                    path_str(&ready)?,
                ],
                Some(&log),
            )?;
            servers.push(proc);
            wait_until(Duration::from_secs(10), || Ok(ready.exists()))
                .with_context(|| format!("server in {name} did not start"))?;
            backends.push(ip);
        }
        topo.start_iperf3_server("be1")?;
        Ok(Self {
            _servers: servers,
            topo,
            backends,
        })
    }

    fn client(&self) -> Result<&NetNs> {
        Ok(self.topo.pod("client")?.ns())
    }

    fn port_range(&self, lo: u16, hi: u16) -> Result<()> {
        self.client()?
            .sysctl("net.ipv4.ip_local_port_range", &format!("{lo} {hi}"))
    }

    fn load(&self, cfg: &Config, targets: &[SocketAddrV4], duration_ms: u64) -> Result<LoadResult> {
        load_from(self.client()?, cfg, targets, duration_ms)
    }

    fn iperf(&self, ip: Ipv4Addr, secs: u32) -> Result<f64> {
        let s = self.topo.iperf3_client(ip, IPERF_PORT, secs)?.wait()?;
        ensure!(
            s.success,
            "iperf3 to {ip} failed: {}",
            s.error.unwrap_or_default()
        );
        Ok(s.bits_per_second / 1e9)
    }
}

/// The bench's load generator run by `exec` (a pod, or the node's own namespace).
fn load_from(
    exec: &impl Exec,
    cfg: &Config,
    targets: &[SocketAddrV4],
    duration_ms: u64,
) -> Result<LoadResult> {
    {
        let list = targets
            .iter()
            .map(ToString::to_string)
            .collect::<Vec<_>>()
            .join(",");
        let out = exec.output(
            &[
                path_str(&cfg.bench_bin)?,
                "loadgen",
                "--targets",
                &list,
                "--concurrency",
                &cfg.concurrency.to_string(),
                "--duration-ms",
                &duration_ms.to_string(),
                "--max-conns",
                &cfg.max_conns.to_string(),
            ],
            Duration::from_millis(duration_ms) + Duration::from_secs(30),
        )?;
        ensure!(
            out.status.success(),
            "loadgen failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let v: Value = serde_json::from_slice(&out.stdout).context("loadgen output")?;
        LoadResult::from_json(&v)
    }
}

/// Measures one mode at one size in a fresh topology.
pub fn run(cfg: &Config, mode: Mode, n: usize) -> Result<Run> {
    let env = Env::new(cfg)?;
    let specs = services(n, &env.backends);
    let mut out = Run {
        mode,
        services: n,
        program_ms: None,
        skipped: None,
        direct: None,
        vip: None,
        iperf_direct_gbps: None,
        iperf_vip_gbps: None,
        host_direct: None,
        host_vip: None,
    };
    // Guards that must outlive the measurement.
    let mut _agent: Option<(Agent, PinDir, ManifestDir)> = None;
    match mode {
        Mode::Ebpf => match start_agent(cfg, &env, &specs) {
            Ok((agent, pins, dir, took)) => {
                out.program_ms = Some(took);
                _agent = Some((agent, pins, dir));
            }
            Err(e) => out.skipped = Some(format!("{e:#}")),
        },
        Mode::Iptables | Mode::Nftables => {
            match program_netfilter(env.topo.node(), env.topo.tmp().path(), mode, &specs, cfg) {
                Ok(Programmed::Done(ms)) => out.program_ms = Some(ms),
                Ok(Programmed::TimedOut) => {
                    out.skipped = Some(format!(
                        "{} took more than {:?}",
                        restore_cmd(mode),
                        cfg.program_timeout
                    ));
                }
                Err(e) => out.skipped = Some(format!("{e:#}")),
            }
        }
    }
    if out.skipped.is_some() {
        return Ok(out);
    }
    let direct: Vec<SocketAddrV4> = env
        .backends
        .iter()
        .map(|ip| SocketAddrV4::new(*ip, HTTP_PORT))
        .collect();
    let vip = [SocketAddrV4::new(HTTP_VIP, 80)];
    // Smoke check: a few requests each way must work before timing anything.
    env.port_range(20_000, 20_999)?;
    let check = env.load(cfg, &vip, 500)?;
    ensure!(
        check.ok > 0 && check.errors == 0,
        "{} at {n}: requests through the VIP fail: {:?}",
        mode.name(),
        check.first_error
    );
    // Separate source-port ranges per run: a later run never reuses a 5-tuple an earlier run
    // left in a conntrack table (netfilter's or ours) over the other path.
    env.port_range(21_000, 39_999)?;
    out.direct = Some(env.load(cfg, &direct, cfg.duration_ms)?);
    env.port_range(40_000, 59_999)?;
    out.vip = Some(env.load(cfg, &vip, cfg.duration_ms)?);
    env.port_range(60_000, 61_999)?;
    out.iperf_direct_gbps = Some(env.iperf(env.backends[0], cfg.iperf_secs)?);
    env.port_range(62_000, 63_999)?;
    out.iperf_vip_gbps = Some(env.iperf(IPERF_VIP, cfg.iperf_secs)?);

    // From the node itself: our socket hooks translate only members of the agent's cgroup;
    // netfilter's OUTPUT chain translates every process of the node namespace.
    let node = env.topo.node();
    if mode != Mode::Ebpf {
        // OUTPUT-chain DNAT happens after the route lookup, so netfilter needs some route for the
        // Service range (a real node has its default route); the client pod's veth, inside the
        // test's namespaces, serves. Our socket hooks translate before any route lookup.
        node.exec(&["ip", "route", "add", "10.96.0.0/16", "dev", "veth-client"])?;
    }
    let port_range =
        |lo: u16, hi: u16| node.sysctl("net.ipv4.ip_local_port_range", &format!("{lo} {hi}"));
    let host_load = |targets: &[SocketAddrV4], ms: u64| match &_agent {
        Some((agent, ..)) => load_from(&agent.host(node), cfg, targets, ms),
        None => load_from(node, cfg, targets, ms),
    };
    port_range(20_000, 20_999)?;
    let check = host_load(&vip, 500)?;
    ensure!(
        check.ok > 0 && check.errors == 0,
        "{} at {n}: requests from the node through the VIP fail: {:?}",
        mode.name(),
        check.first_error
    );
    port_range(21_000, 39_999)?;
    out.host_direct = Some(host_load(&direct, cfg.duration_ms)?);
    port_range(40_000, 59_999)?;
    out.host_vip = Some(host_load(&vip, cfg.duration_ms)?);
    Ok(out)
}

fn start_agent(
    cfg: &Config,
    env: &Env,
    specs: &[SvcSpec],
) -> Result<(Agent, PinDir, ManifestDir, f64)> {
    let dir = ManifestDir::new()?;
    workload::write_manifests(dir.path(), specs)?;
    let pins = PinDir::new(&format!("{}-bench", env.topo.prefix()))?;
    let started = Instant::now();
    let mut agent = Agent::start(
        &cfg.agent_bin,
        env.topo.node(),
        dir.path(),
        pins.path(),
        env.topo.tmp().path(),
    )?;
    let status = agent.wait_synced(1, cfg.program_timeout)?;
    let took = started.elapsed().as_secs_f64() * 1e3;
    ensure!(
        status.frontends as usize == specs.len(),
        "agent programmed {} of {} frontends ({} problems); log:\n{}",
        status.frontends,
        specs.len(),
        status.problems,
        agent.log_tail()
    );
    let pods = env.backends.len() + 1;
    agent.wait_status(Duration::from_secs(20), |s| s.interfaces.len() >= pods)?;
    Ok((agent, pins, dir, took))
}

pub enum Programmed {
    Done(f64),
    TimedOut,
}

fn restore_cmd(mode: Mode) -> &'static str {
    match mode {
        Mode::Iptables => "iptables-restore",
        _ => "nft -f",
    }
}

/// Writes the rule set for `mode` and loads it inside `node` (never the root namespace).
pub fn program_netfilter(
    node: &NetNs,
    work: &Path,
    mode: Mode,
    specs: &[SvcSpec],
    cfg: &Config,
) -> Result<Programmed> {
    let (file, text) = match mode {
        Mode::Iptables => (
            work.join("rules.iptables"),
            workload::iptables_restore(specs),
        ),
        Mode::Nftables => (work.join("rules.nft"), workload::nft_ruleset(specs)),
        Mode::Ebpf => bail!("not a netfilter mode"),
    };
    std::fs::write(&file, text).with_context(|| format!("writing {}", file.display()))?;
    let f = path_str(&file)?;
    let args: Vec<&str> = match mode {
        Mode::Iptables => vec!["iptables-restore", f],
        _ => vec!["nft", "-f", f],
    };
    let started = Instant::now();
    let out = match node.output(&args, cfg.program_timeout) {
        Ok(out) => out,
        Err(e) if started.elapsed() >= cfg.program_timeout => {
            eprintln!("  {} timed out: {e:#}", restore_cmd(mode));
            return Ok(Programmed::TimedOut);
        }
        Err(e) => return Err(e),
    };
    let took = started.elapsed().as_secs_f64() * 1e3;
    ensure!(
        out.status.success(),
        "{} in {} failed: {}",
        restore_cmd(mode),
        node.name(),
        String::from_utf8_lossy(&out.stderr)
            .lines()
            .take(5)
            .collect::<Vec<_>>()
            .join("\n")
    );
    Ok(Programmed::Done(took))
}

/// `iptables-restore` / `nft -f` time for `n` Services in a fresh namespace (no pods).
pub fn restore_time(cfg: &Config, mode: Mode, n: usize) -> Result<Programmed> {
    let topo = Topology::bare()?;
    let specs = workload::generated(n);
    program_netfilter(topo.node(), topo.tmp().path(), mode, &specs, cfg)
}

/// How long after "ready" the footprint waits for the first flow walk's end before it reads the
/// agent's memory again (`settled_*`).
const SETTLE: Duration = Duration::from_secs(30);

/// The real agent binary on a manifest folder of `n` Services in a bare node namespace: time
/// from start to its first sync (status file), peak RSS (VmHWM) then, and what it programmed;
/// RSS and VmHWM again after the first flow walk (within [`SETTLE`]).
pub fn agent_footprint(cfg: &Config, n: usize) -> Result<Value> {
    let topo = Topology::bare()?;
    let specs = workload::generated(n);
    let dir = ManifestDir::new()?;
    workload::write_manifests(dir.path(), &specs)?;
    let pins = PinDir::new(&format!("{}-rss", topo.prefix()))?;
    let args = manifest_folder_args(&dir, n);
    let args: Vec<&std::ffi::OsStr> = args.iter().map(|a| a.as_os_str()).collect();
    let started = Instant::now();
    let mut agent = Agent::start_with(
        &cfg.agent_bin,
        topo.node(),
        &args,
        pins.path(),
        topo.tmp().path(),
    )?;
    let status = agent.wait_synced(1, cfg.program_timeout)?;
    let first_sync_ms = started.elapsed().as_secs_f64() * 1e3;
    // The status file is written before the first full sync hands its freed heap back
    // (malloc_trim) and the agent attaches: read the footprint once it logged "ready", so runs
    // compare the same settled state rather than racing the trim (bounded: 10 s).
    let settle = Instant::now();
    while !agent.log_tail().contains(" ready ") && settle.elapsed() < Duration::from_secs(10) {
        std::thread::sleep(Duration::from_millis(20));
    }
    let pid = topo
        .node()
        .pids()
        .into_iter()
        .find(|pid| {
            std::fs::read_to_string(format!("/proc/{pid}/comm"))
                .is_ok_and(|c| c.trim().starts_with("kube-proxy-ebp"))
        })
        .context("agent process not found in the node namespace")?;
    let (rss, hwm) = rss_and_hwm_kib(pid)?;
    // Steady state: the first conntrack walk starts at "ready" (at 500,000 backends it reads
    // and writes as many least-connection counts and keeps what it wrote): read again once the
    // agent logged its end (bounded). This is the figure that stays between syncs.
    let settle = Instant::now();
    while !agent.log_tail().contains(" first flow walk done ") && settle.elapsed() < SETTLE {
        std::thread::sleep(Duration::from_millis(20));
    }
    let walked = agent.log_tail().contains(" first flow walk done ");
    let (settled_rss, settled_hwm) = rss_and_hwm_kib(pid)?;
    // Heap and stacks vs the binary's mapped pages (file-backed, counted in VmRSS too).
    let (settled_anon, settled_file) = (status_kib(pid, "RssAnon:")?, status_kib(pid, "RssFile:")?);
    // Kernel memory of the pinned maps (not in the RSS): all of them, and the IPv6 ones.
    let (maps_memlock, maps6_memlock) = pinned_memlock(pins.path());
    // The agent logs its RSS at each start-up stage (where the footprint comes from), and each
    // sync (how many ran before the readings).
    std::thread::sleep(Duration::from_millis(200));
    for line in agent
        .log_tail()
        .lines()
        .filter(|l| (l.contains("rss_mib") || l.contains(" synced ")) && !l.contains("DEBUG"))
    {
        eprintln!(
            "  agent: {}",
            line.split_once("  INFO ").map_or(line, |(_, l)| l)
        );
    }
    drop(agent);
    Ok(json!({
        "services": n,
        "start_to_first_sync_ms": first_sync_ms,
        "vm_hwm_mib": hwm as f64 / 1024.0,
        "vm_rss_mib": rss as f64 / 1024.0,
        "settled_vm_rss_mib": settled_rss as f64 / 1024.0,
        "settled_vm_hwm_mib": settled_hwm as f64 / 1024.0,
        "settled_rss_anon_mib": settled_anon as f64 / 1024.0,
        "settled_rss_file_mib": settled_file as f64 / 1024.0,
        "settled_after_first_walk": walked,
        "maps_memlock_mib": maps_memlock as f64 / (1024.0 * 1024.0),
        "ipv6_maps_memlock_mib": maps6_memlock as f64 / (1024.0 * 1024.0),
        "frontends_programmed": status.frontends,
        "backends_programmed": status.backends,
        "problems": status.problems,
    }))
}

/// The kernel's account (`memlock` in the fd's fdinfo) of every pinned map under `pin_dir`, and
/// of the IPv6 ones among them, in bytes (a map that cannot be opened counts 0).
fn pinned_memlock(pin_dir: &Path) -> (u64, u64) {
    use std::os::fd::{AsFd as _, AsRawFd as _};
    let pins = kube_proxy_ebpf::dataplane::bpffs::PinLayout::new(pin_dir);
    let memlock = |name: &str| -> u64 {
        let Ok(map) = aya::maps::MapData::from_pin(pins.map(name)) else {
            return 0;
        };
        let fd = map.fd().as_fd().as_raw_fd();
        (std::fs::read_to_string(format!("/proc/self/fdinfo/{fd}")).ok())
            .and_then(|info| {
                (info.lines())
                    .find_map(|l| l.strip_prefix("memlock:"))
                    .and_then(|v| v.trim().parse().ok())
            })
            .unwrap_or(0)
    };
    let all: Vec<(&str, u64)> = (proxy_common::ALL_MAPS.iter())
        .map(|&name| (name, memlock(name)))
        .collect();
    let total = all.iter().map(|(_, b)| b).sum();
    let six = (all.iter())
        .filter(|(name, _)| name.contains('6'))
        .map(|(_, b)| b)
        .sum();
    (total, six)
}

/// A process's `(VmRSS, VmHWM)` in KiB.
fn rss_and_hwm_kib(pid: i32) -> Result<(u64, u64)> {
    Ok((status_kib(pid, "VmRSS:")?, status_kib(pid, "VmHWM:")?))
}

/// One `key: N kB` line of a process's `/proc/PID/status`, in KiB.
fn status_kib(pid: i32, key: &str) -> Result<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
    (status.lines().find(|l| l.starts_with(key)))
        .and_then(|l| l.split_whitespace().nth(1)?.parse().ok())
        .with_context(|| format!("no {key} in /proc/{pid}/status"))
}

fn path_str(p: &Path) -> Result<&str> {
    p.to_str()
        .with_context(|| format!("non-UTF-8 path {}", p.display()))
}

fn wait_until(timeout: Duration, mut ready: impl FnMut() -> Result<bool>) -> Result<()> {
    let deadline = Instant::now() + timeout;
    while !ready()? {
        if Instant::now() >= deadline {
            bail!("not ready within {timeout:?}");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    Ok(())
}

/// The agent's arguments for a manifest folder of `n` generated Services, with maps sized for
/// them (the defaults hold about 24,000 Services × 10 endpoints).
fn manifest_folder_args(dir: &ManifestDir, n: usize) -> Vec<std::ffi::OsString> {
    let sizes = super::inproc::sizes_for(n);
    let mut args = vec!["--manifests".into(), dir.path().as_os_str().to_owned()];
    for (flag, entries) in [
        ("--map-entries-services", sizes.services),
        ("--map-entries-backends", sizes.backends),
        ("--map-entries-revnat", sizes.rev_nats),
    ] {
        args.extend([flag.into(), entries.to_string().into()]);
    }
    args
}

/// How the agent starts in [`cold_start`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Start {
    /// No pins, a node without IPv6 (its global IPv6 addresses removed): a new or rebooted
    /// node, the IPv6 programs not loaded.
    FreshIpv4,
    /// No pins, a node with IPv6: both families' programs verified.
    FreshDualStack,
    /// The pins the fresh IPv4 start left (a restart, an upgrade to the same build): the
    /// programs are taken from their pins.
    Restart,
}

impl Start {
    pub const ALL: [Start; 3] = [Start::FreshIpv4, Start::FreshDualStack, Start::Restart];

    pub fn name(self) -> &'static str {
        match self {
            Start::FreshIpv4 => "fresh_ipv4",
            Start::FreshDualStack => "fresh_dual_stack",
            Start::Restart => "restart",
        }
    }
}

/// The agent binary on a manifest folder of `n` Services in a bare node namespace, from its
/// start to its first sync (status file): a fresh node (IPv4 only, then with IPv6), and a
/// restart on the pins the fresh start left; beside them kube-proxy's rule-set load times for
/// the same Services (`iptables-restore`, `nft -f`, where installed).
pub fn cold_start(cfg: &Config, n: usize, rounds: usize) -> Result<Value> {
    let ipv4_only = Topology::bare()?;
    ipv4_only
        .node()
        .exec(&["ip", "-6", "addr", "flush", "scope", "global"])?;
    let dual_stack = Topology::bare()?;
    let specs = workload::generated(n);
    let dir = ManifestDir::new()?;
    workload::write_manifests(dir.path(), &specs)?;
    let args = manifest_folder_args(&dir, n);
    let args: Vec<&std::ffi::OsStr> = args.iter().map(|a| a.as_os_str()).collect();
    let mut times: std::collections::BTreeMap<&str, Vec<f64>> = Default::default();
    for round in 0..rounds {
        for (topo, starts) in [
            (&ipv4_only, &[Start::FreshIpv4, Start::Restart][..]),
            (&dual_stack, &[Start::FreshDualStack][..]),
        ] {
            let pins = PinDir::new(&format!("{}-cold{round}", topo.prefix()))?;
            for &start in starts {
                let started = Instant::now();
                let mut agent = Agent::start_with(
                    &cfg.agent_bin,
                    topo.node(),
                    &args,
                    pins.path(),
                    topo.tmp().path(),
                )?;
                agent.wait_synced(1, cfg.program_timeout)?;
                let ms = started.elapsed().as_secs_f64() * 1e3;
                if let Some(line) = agent
                    .log_tail()
                    .lines()
                    .rfind(|l| l.contains("programs loaded"))
                {
                    eprintln!(
                        "  {}: {ms:.0} ms; {}",
                        start.name(),
                        line.split_once("  INFO ").map_or(line, |(_, l)| l)
                    );
                }
                times.entry(start.name()).or_default().push(ms);
                // Stopped as a crash would (SIGKILL): the pins stay for the restart.
                drop(agent);
            }
        }
    }
    let median = |v: &[f64]| {
        let mut v = v.to_vec();
        v.sort_by(f64::total_cmp);
        v.get(v.len() / 2).copied()
    };
    let mut out = json!({ "services": n, "rounds": rounds });
    for start in Start::ALL {
        out[format!("{}_ms", start.name())] =
            json!(times.get(start.name()).and_then(|v| median(v)));
        out[format!("{}_all_ms", start.name())] = json!(times.get(start.name()));
    }
    for mode in [Mode::Iptables, Mode::Nftables] {
        let tool = if mode == Mode::Iptables {
            "iptables-restore"
        } else {
            "nft"
        };
        if !super::which(tool) {
            continue;
        }
        let key = format!("{}_ms", mode.name());
        out[key] = match restore_time(cfg, mode, n)? {
            Programmed::Done(ms) => json!(ms),
            Programmed::TimedOut => Value::Null,
        };
    }
    Ok(out)
}
