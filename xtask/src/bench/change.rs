//! `xtask-bench change-latency`: what one endpoint change costs at N Services.
//!
//! In process: the agent itself ([`Agent::start`] on a fresh pin dir, real maps, nothing
//! attached) synced to N Services × 10 endpoints, then K single-endpoint changes (an endpoint
//! added, removed or its ready condition flipped, in a random Service), each followed by the
//! change-triggered [`Agent::sync`]; each sync's parts are timed by the agent
//! ([`Agent::last_sync_parts`]). `--family ipv6|dual`: the Services are IPv6-only or dual-stack
//! (one IPv4 and one IPv6 slice each; a change hits either), and the agent runs on a thread
//! inside a node namespace the bench creates (its IPv6 address turns the IPv6 family on; still
//! nothing attached).

use std::{
    net::{Ipv4Addr, Ipv6Addr},
    sync::Arc,
    time::{Duration, Instant},
};

use anyhow::{Context as _, Result};
use k8s_openapi::api::{core::v1::Service, discovery::v1::EndpointSlice};
use kube_proxy_ebpf::{
    agent::{Agent, SyncParts},
    dataplane::bpffs::PinLayout,
    pipeline::translate::NodeContext,
    sources::{endpoints::SliceData, services::ServiceData, snapshot::Snapshot},
};
use proxy_common::{DatapathConfig, Scheduler, SockLbConfig};

use crate::{inproc, stats::percentile, workload};

/// xorshift64*: a reproducible change sequence.
pub struct Rng(pub u64);

impl Rng {
    pub fn below(&mut self, n: usize) -> usize {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        ((self.0.wrapping_mul(0x2545_f491_4f6c_dd1d) >> 32) % n as u64) as usize
    }
}

/// The Services' families in the in-process bench.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Family {
    Ipv4,
    Ipv6,
    Dual,
}

/// The IPv6 twin of a generated IPv4 address (fd00::/8, inside the bench's namespace only).
fn v6(a: Ipv4Addr) -> Ipv6Addr {
    Ipv6Addr::from((0xfd00_u128 << 112) | u128::from(u32::from(a)))
}

/// Service `i`'s endpoint `j` in the slice's address family.
fn endpoint_addr(i: usize, j: u32, ipv6: bool) -> String {
    let a = Ipv4Addr::from(u32::from(Ipv4Addr::new(10, 128, 0, 0)) + (i * 64) as u32 + j);
    if ipv6 {
        v6(a).to_string()
    } else {
        a.to_string()
    }
}

/// The generated Services as the API would hold them (every object with a resourceVersion).
pub struct Cluster {
    pub specs: Vec<workload::SvcSpec>,
    pub services: Vec<Service>,
    /// One slice per Service (dual-stack: its IPv4 slice, then its IPv6 one).
    pub slices: Vec<EndpointSlice>,
    family: Family,
    version: u64,
}

/// What one change did.
#[derive(Clone, Copy, Debug)]
pub enum Change {
    Added,
    Removed,
    ReadyFlipped,
}

impl Cluster {
    /// `n` generated Services of `family`, `endpoints` each.
    pub fn new(n: usize, endpoints: usize, family: Family) -> Self {
        let mut specs = workload::generated(n);
        for (i, s) in specs.iter_mut().enumerate() {
            let base = u32::from(Ipv4Addr::new(10, 128, 0, 0)) + (i * 64) as u32;
            s.endpoints = (0..endpoints as u32)
                .map(|j| Ipv4Addr::from(base + j))
                .collect();
        }
        let mut c = Self {
            services: Vec::new(),
            slices: Vec::new(),
            specs,
            family,
            version: 1,
        };
        for i in 0..c.specs.len() {
            let mut svc = workload::service(&c.specs[i]);
            svc.metadata.resource_version = Some(c.next_version());
            let vip = c.specs[i].vip;
            let spec = svc.spec.as_mut().expect("generated spec");
            match family {
                Family::Ipv4 => {}
                Family::Ipv6 => {
                    spec.cluster_ip = Some(v6(vip).to_string());
                    spec.cluster_ips = Some(vec![v6(vip).to_string()]);
                    spec.ip_families = Some(vec!["IPv6".into()]);
                }
                Family::Dual => {
                    spec.cluster_ips = Some(vec![vip.to_string(), v6(vip).to_string()]);
                    spec.ip_families = Some(vec!["IPv4".into(), "IPv6".into()]);
                    spec.ip_family_policy = Some("RequireDualStack".into());
                }
            }
            c.services.push(svc);
            let slice = workload::slice(&c.specs[i]);
            let mut slice6 = slice.clone();
            slice6.address_type = "IPv6".into();
            slice6.metadata.name = Some(format!("{}-slice6", c.specs[i].name));
            for e in slice6.endpoints.iter_mut().flatten() {
                for a in &mut e.addresses {
                    *a = v6(a.parse().expect("generated IPv4 endpoint")).to_string();
                }
            }
            let own = match family {
                Family::Ipv4 => vec![slice],
                Family::Ipv6 => vec![slice6],
                Family::Dual => vec![slice, slice6],
            };
            for mut slice in own {
                slice.metadata.resource_version = Some(c.next_version());
                c.slices.push(slice);
            }
        }
        c
    }

    /// The index in `slices` of a slice of Service `i` (dual-stack: either family's).
    pub fn slice_of(&self, rng: &mut Rng, i: usize) -> usize {
        match self.family {
            Family::Dual => 2 * i + rng.below(2),
            _ => i,
        }
    }

    fn next_version(&mut self) -> String {
        self.version += 1;
        self.version.to_string()
    }

    /// One endpoint of the slice at `s` in `slices` (see [`Cluster::slice_of`]) added (below 2
    /// endpoints less than at start, never above 60), removed, or its ready condition flipped.
    pub fn change(&mut self, rng: &mut Rng, s: usize) -> Change {
        let version = self.next_version();
        let i = if self.family == Family::Dual {
            s / 2
        } else {
            s
        };
        let slice = &mut self.slices[s];
        let ipv6 = slice.address_type == "IPv6";
        slice.metadata.resource_version = Some(version);
        let eps = slice.endpoints.get_or_insert_with(Vec::new);
        let kind = match rng.below(3) {
            0 if eps.len() < 60 => Change::Added,
            1 if eps.len() > 1 => Change::Removed,
            _ => Change::ReadyFlipped,
        };
        match kind {
            Change::Added => {
                let mut e = eps[0].clone();
                let used: Vec<String> = eps.iter().map(|e| e.addresses[0].clone()).collect();
                let free = (0..64u32)
                    .map(|j| endpoint_addr(i, j, ipv6))
                    .find(|a| !used.contains(a))
                    .expect("fewer than 64 endpoints");
                e.addresses = vec![free];
                if let Some(c) = e.conditions.as_mut() {
                    c.ready = Some(true);
                }
                eps.push(e);
            }
            Change::Removed => {
                eps.remove(rng.below(eps.len()));
            }
            Change::ReadyFlipped => {
                let j = rng.below(eps.len());
                let c = eps[j].conditions.get_or_insert_with(Default::default);
                c.ready = Some(!c.ready.unwrap_or(true));
            }
        }
        kind
    }

    pub fn snapshot(&self) -> Snapshot {
        Snapshot {
            services: Arc::new(
                (self.services.iter())
                    .map(|s| Arc::new(ServiceData::from(s)))
                    .collect(),
            ),
            endpoint_slices: Arc::new(
                (self.slices.iter())
                    .map(|s| Arc::new(SliceData::from(s)))
                    .collect(),
            ),
        }
    }
}

/// Per-part samples, µs.
#[derive(Default)]
struct Samples {
    total: Vec<f64>,
    /// This thread's CPU time in the sync (wall time less preemption on a busy machine).
    cpu: Vec<f64>,
    translate: Vec<f64>,
    plan: Vec<f64>,
    report: Vec<f64>,
    apply: Vec<f64>,
    after: Vec<f64>,
}

fn us(d: Duration) -> f64 {
    d.as_secs_f64() * 1e6
}

impl Samples {
    fn push(&mut self, total: Duration, cpu: Duration, p: SyncParts) {
        self.total.push(us(total));
        self.cpu.push(us(cpu));
        self.translate.push(us(p.translate));
        self.plan.push(us(p.plan));
        self.report.push(us(p.report));
        self.apply.push(us(p.apply));
        self.after.push(us(p.after));
    }

    fn print(mut self) {
        // The slowest changes by index: a tail at the first changes after the full sync is a
        // cold path (page faults, a lazily built index), not noise.
        let mut by_index: Vec<(usize, f64, f64)> = (self.total.iter().zip(&self.translate))
            .enumerate()
            .map(|(i, (t, tr))| (i, *t, *tr))
            .collect();
        by_index.sort_by(|a, b| b.1.total_cmp(&a.1));
        let shown: Vec<String> = (by_index.iter().take(5))
            .map(|(i, t, tr)| format!("#{i} {t:.0} µs (translate {tr:.0})"))
            .collect();
        println!("slowest syncs: {}", shown.join(", "));
        for (name, v) in [
            ("Agent::sync", &mut self.total),
            ("  thread CPU", &mut self.cpu),
            ("  translate", &mut self.translate),
            ("  plan", &mut self.plan),
            ("  report", &mut self.report),
            ("  apply", &mut self.apply),
            ("  after-apply", &mut self.after),
        ] {
            println!(
                "{name:<14} p50 {:>9.1} µs  p99 {:>9.1} µs  max {:>9.1} µs",
                percentile(v, 0.5),
                percentile(v, 0.99),
                percentile(v, 1.0)
            );
        }
    }
}

/// CLOCK_THREAD_CPUTIME_ID.
fn thread_cpu() -> Duration {
    nix::time::clock_gettime(nix::time::ClockId::CLOCK_THREAD_CPUTIME_ID)
        .map(Duration::from)
        .unwrap_or_default()
}

/// Part (a): in process, every Service scheduled by `scheduler` (the node's default), of
/// `family` (IPv6 or dual-stack: on a thread inside a fresh node namespace with an IPv6
/// address, see the module doc).
pub fn in_process(
    services: usize,
    endpoints: usize,
    changes: usize,
    scheduler: Scheduler,
    family: Family,
) -> Result<()> {
    if family == Family::Ipv4 {
        return in_process_here(services, endpoints, changes, scheduler, family);
    }
    let topo = proxy_testenv::Topology::bare()?;
    let netns = topo.node().path();
    std::thread::scope(|s| {
        s.spawn(|| -> Result<()> {
            let ns = std::fs::File::open(&netns)
                .with_context(|| format!("opening {}", netns.display()))?;
            // Moves only this thread (and the threads it starts).
            nix::sched::setns(&ns, nix::sched::CloneFlags::CLONE_NEWNET)
                .with_context(|| format!("entering {}", netns.display()))?;
            in_process_here(services, endpoints, changes, scheduler, family)
        })
        .join()
        .map_err(|_| anyhow::anyhow!("bench thread panicked"))?
    })
}

/// [`in_process`] in the calling thread's network namespace.
fn in_process_here(
    services: usize,
    endpoints: usize,
    changes: usize,
    scheduler: Scheduler,
    family: Family,
) -> Result<()> {
    proxy_testenv::ensure_bpffs()?;
    let pin_dir =
        proxy_testenv::PinDir::new(&format!("kpe-change-latency-{}", std::process::id()))?;
    let pins = PinLayout::new(pin_dir.path());
    let node = NodeContext {
        node_name: "bench-node".into(),
        zone: None,
        scheduler,
    };
    let mut sizes = inproc::sizes_for(services * endpoints.div_ceil(10).max(1) * 2);
    if !matches!(family, Family::Ipv4) {
        // The IPv6 maps sized like the IPv4 ones (the compiled-in SERVICES6_V1 holds ~2,900
        // Services × 10 endpoints).
        sizes.services6 = sizes.services;
        sizes.backends6 = sizes.backends;
        sizes.rev_nats6 = sizes.rev_nats;
    }
    let mut agent = Agent::start(
        pins,
        DatapathConfig::DEFAULT,
        node,
        kube_proxy_ebpf::dataplane::devices::Choices::none(),
        sizes,
        SockLbConfig::default(),
        kube_proxy_ebpf::dataplane::bpf_log::BpfLog::Off,
    )
    .context("starting the agent's datapath (root needed)")?;
    let mut cluster = Cluster::new(services, endpoints, family);
    let mut snap = cluster.snapshot();
    let t = Instant::now();
    agent.sync(&snap, Vec::new(), true)?;
    println!(
        "first sync of {services} {family:?} Services × {endpoints} endpoints: {:.1} ms \
         ({} IPv6 frontends programmed)",
        t.elapsed().as_secs_f64() * 1e3,
        agent.ipv6_frontends()
    );
    if family != Family::Ipv4 {
        anyhow::ensure!(
            agent.ipv6_frontends() >= services,
            "the IPv6 family is not programmed"
        );
    }
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    let mut samples = Samples::default();
    let mut kinds = [0usize; 3];
    for _ in 0..changes {
        let i = rng.below(services);
        let s = cluster.slice_of(&mut rng, i);
        kinds[cluster.change(&mut rng, s) as usize] += 1;
        // As the Kubernetes store does: the changed object gets a new Arc, the others keep theirs.
        Arc::make_mut(&mut snap.endpoint_slices)[s] = Arc::new(SliceData::from(&cluster.slices[s]));
        agent.queued();
        let (t, cpu) = (Instant::now(), thread_cpu());
        agent.sync(&snap, Vec::new(), false)?;
        samples.push(
            t.elapsed(),
            thread_cpu().saturating_sub(cpu),
            agent.last_sync_parts(),
        );
    }
    println!(
        "{changes} changes ({} added, {} removed, {} ready flipped), change-triggered syncs:",
        kinds[0], kinds[1], kinds[2]
    );
    samples.print();
    // A full sync afterwards, for comparison.
    let t = Instant::now();
    agent.sync(&snap, Vec::new(), true)?;
    println!(
        "periodic full sync afterwards: {:.1} ms",
        t.elapsed().as_secs_f64() * 1e3
    );
    Ok(())
}

/// A Service's endpoints in the end-to-end run: address and readiness.
struct Endpoints {
    base: u32,
    eps: Vec<(Ipv4Addr, bool)>,
}

impl Endpoints {
    fn ready(&self) -> usize {
        self.eps.iter().filter(|(_, r)| *r).count()
    }

    /// A change that moves the frontend's backend count (so it can be seen in the map): a
    /// ready endpoint added or removed, or one's ready condition flipped; at least one stays
    /// ready.
    fn change(&mut self, rng: &mut Rng) -> Change {
        let ready = self.ready();
        match rng.below(3) {
            0 if self.eps.len() < 60 => {
                let used: Vec<Ipv4Addr> = self.eps.iter().map(|e| e.0).collect();
                let free = (0..64u32)
                    .map(|j| Ipv4Addr::from(self.base + j))
                    .find(|a| !used.contains(a))
                    .expect("fewer than 64 endpoints");
                self.eps.push((free, true));
                Change::Added
            }
            1 if ready > 1 => {
                let j = (self.eps.iter().position(|e| e.1)).expect("a ready endpoint");
                self.eps.remove(j);
                Change::Removed
            }
            _ => {
                let j = rng.below(self.eps.len());
                if self.eps[j].1 && ready == 1 {
                    // The last ready one stays: flip another, or add one.
                    if let Some(k) = self.eps.iter().position(|e| !e.1) {
                        self.eps[k].1 = true;
                    } else {
                        self.eps[j].1 = true;
                        self.eps.push((Ipv4Addr::from(self.base + 63), true));
                    }
                } else {
                    self.eps[j].1 = !self.eps[j].1;
                }
                Change::ReadyFlipped
            }
        }
    }
}

fn api_service(i: usize, vip: Ipv4Addr) -> serde_json::Value {
    serde_json::json!({"apiVersion": "v1", "kind": "Service",
        "metadata": {"name": format!("svc-{i}"), "namespace": workload::NAMESPACE},
        "spec": {"type": "ClusterIP", "clusterIP": vip.to_string(), "clusterIPs": [vip.to_string()],
                 "ports": [{"name": "http", "port": 80, "protocol": "TCP", "targetPort": 8080}]}})
}

fn api_slice(i: usize, eps: &Endpoints) -> serde_json::Value {
    let endpoints: Vec<serde_json::Value> = (eps.eps.iter())
        .map(|(ip, ready)| {
            serde_json::json!({"addresses": [ip.to_string()], "nodeName": "bench-node",
                "conditions": {"ready": ready, "serving": ready, "terminating": false}})
        })
        .collect();
    serde_json::json!({"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
        "addressType": "IPv4",
        "metadata": {"name": format!("svc-{i}-a"), "namespace": workload::NAMESPACE,
                     "labels": {"kubernetes.io/service-name": format!("svc-{i}")}},
        "endpoints": endpoints,
        "ports": [{"name": "http", "port": 8080, "protocol": "TCP"}]})
}

/// Part (b): the release agent binary with the Kubernetes source against the fake API server,
/// both in a fresh node namespace; K slice updates, each timed from just before the server
/// stores it (and emits the watch event) to the frontend's new backend count being visible in
/// the pinned SERVICES map (polled every 100 µs, at most 10 s per change).
pub fn end_to_end(
    services: usize,
    endpoints: usize,
    changes: usize,
    agent_bin: &std::path::Path,
    sync_period: Option<&str>,
) -> Result<()> {
    use aya::maps::{HashMap as BpfHashMap, Map, MapData};
    use proxy_common::{MAP_SERVICES, ServiceKey, ServiceValue, proto};
    use proxy_testenv::{Agent as AgentProc, FakeApiServer, PinDir, Topology};

    proxy_testenv::ensure_bpffs()?;
    let topo = Topology::bare()?;
    let api = FakeApiServer::start_in(Some(&topo.node().path()))?;
    api.apply(serde_json::json!({"apiVersion": "v1", "kind": "Node",
        "metadata": {"name": "bench-node"},
        "status": {"addresses": [{"type": "InternalIP", "address": "192.0.2.1"}]}}))?;
    let specs = workload::generated(services);
    let mut eps: Vec<Endpoints> = (0..services)
        .map(|i| {
            let base = u32::from(Ipv4Addr::new(10, 128, 0, 0)) + (i * 64) as u32;
            Endpoints {
                base,
                eps: (0..endpoints as u32)
                    .map(|j| (Ipv4Addr::from(base + j), true))
                    .collect(),
            }
        })
        .collect();
    let t = Instant::now();
    for (i, s) in specs.iter().enumerate() {
        api.apply(api_service(i, s.vip))?;
        api.apply(api_slice(i, &eps[i]))?;
    }
    println!(
        "fake API server: {services} Services × {endpoints} endpoints stored in {:.1} s",
        t.elapsed().as_secs_f64()
    );
    let kubeconfig = api.write_kubeconfig(&topo.tmp().path().join("kubeconfig"))?;
    let pins = PinDir::new(&format!("{}-pins", topo.prefix()))?;
    let started = Instant::now();
    // Maps sized for the Services (the defaults hold about 24,000 × 10 endpoints).
    let sizes = inproc::sizes_for(services * endpoints.div_ceil(10).max(1) * 2);
    let sizes = [
        sizes.services.to_string(),
        sizes.backends.to_string(),
        sizes.rev_nats.to_string(),
    ];
    let mut flags = vec![
        "--hostname-override",
        "bench-node",
        "--min-sync-period",
        "0s",
        "--map-entries-services",
        &sizes[0],
        "--map-entries-backends",
        &sizes[1],
        "--map-entries-revnat",
        &sizes[2],
    ];
    if let Some(period) = sync_period {
        flags.extend(["--sync-period", period]);
    }
    let mut agent = AgentProc::start_kube(
        agent_bin,
        topo.node(),
        &kubeconfig,
        &flags,
        pins.path(),
        topo.tmp().path(),
    )?;
    let status = agent.wait_synced(1, Duration::from_secs(300))?;
    println!(
        "agent: first sync after {:.1} s ({} frontends, {} backends)",
        started.elapsed().as_secs_f64(),
        status.frontends,
        status.backends
    );
    let data = MapData::from_pin(pins.path().join(MAP_SERVICES)).context("pinned SERVICES")?;
    let map: BpfHashMap<MapData, ServiceKey, ServiceValue> =
        BpfHashMap::try_from(Map::HashMap(data))?;
    let count = |vip: Ipv4Addr| {
        let key = ServiceKey::new(vip.octets(), 80u16.to_be_bytes(), proto::TCP, 0);
        map.get(&key, 0).ok().map(|v| usize::from(v.count))
    };
    // Every frontend programmed before the clock starts.
    let deadline = Instant::now() + Duration::from_secs(60);
    while count(specs[services - 1].vip) != Some(endpoints) {
        anyhow::ensure!(Instant::now() < deadline, "last Service not programmed");
        std::thread::sleep(Duration::from_millis(10));
    }
    // Steady state: past the attach and start-up work that follows the first sync.
    std::thread::sleep(Duration::from_secs(2));
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    let mut latencies = Vec::with_capacity(changes);
    let mut latencies_in_order: Vec<f64> = Vec::with_capacity(changes);
    let mut slowest: Vec<(f64, usize, f64)> = Vec::new();
    let mut kinds = [0usize; 3];
    // Each change's wall clock: written, seen in the map (against the agent log's timestamps).
    let mut walls: Vec<(std::time::SystemTime, std::time::SystemTime)> = Vec::new();
    for n in 0..changes {
        let i = rng.below(services);
        kinds[eps[i].change(&mut rng) as usize] += 1;
        let want = eps[i].ready();
        let body = api_slice(i, &eps[i]);
        let t0 = Instant::now();
        let t0_wall = std::time::SystemTime::now();
        api.apply(body)?;
        loop {
            if count(specs[i].vip) == Some(want) {
                walls.push((t0_wall, std::time::SystemTime::now()));
                latencies.push(us(t0.elapsed()));
                latencies_in_order.push(us(t0.elapsed()));
                slowest.push((us(t0.elapsed()), n, started.elapsed().as_secs_f64()));
                break;
            }
            anyhow::ensure!(
                t0.elapsed() < Duration::from_secs(10),
                "change {n} (svc-{i}: {want} ready) not in the map within 10 s\n{}",
                agent.log_tail()
            );
            std::thread::sleep(Duration::from_micros(100));
        }
        // Apart, so each change is its own sync (not coalesced with the next).
        std::thread::sleep(Duration::from_millis(20));
    }
    println!(
        "{changes} slice updates ({} added, {} removed, {} ready flipped), API event → SERVICES map:",
        kinds[0], kinds[1], kinds[2]
    );
    println!(
        "API → map      p50 {:>9.1} µs  p99 {:>9.1} µs  max {:>9.1} µs",
        percentile(&mut latencies, 0.5),
        percentile(&mut latencies, 0.99),
        percentile(&mut latencies, 1.0)
    );
    slowest.sort_by(|a, b| b.0.total_cmp(&a.0));
    let shown: Vec<String> = (slowest.iter().take(5))
        .map(|(l, n, at)| format!("#{n} {:.1} ms at agent t+{at:.1} s", l / 1e3))
        .collect();
    println!("slowest: {}", shown.join(", "));
    // Where the agent's time went, from its log (`read_us` needs RUST_LOG=info,kube_proxy_ebpf::agent=debug).
    let raw = std::fs::read_to_string(agent.log_path()).unwrap_or_default();
    let kept = std::env::temp_dir().join("kpe-change-latency-agent.log");
    if std::fs::write(&kept, &raw).is_ok() {
        println!("agent log kept at {}", kept.display());
    }
    // Without terminal colour codes (ESC [ ... m).
    let mut log = String::with_capacity(raw.len());
    let mut chars = raw.chars();
    while let Some(c) = chars.next() {
        if c == '\x1b' {
            chars.by_ref().find(|&c| c == 'm');
        } else {
            log.push(c);
        }
    }
    let field = |l: &str, key: &str| -> Option<f64> {
        let n = l.split_whitespace().find_map(|w| w.strip_prefix(key))?;
        n.trim_matches(|c: char| !c.is_ascii_digit()).parse().ok()
    };
    // Change syncs (they change the maps: the info "synced" line with ops=), in order: the
    // last `changes` of them carried the bench's changes, one each (changes are apart).
    let change_syncs: Vec<f64> = (log.lines())
        .filter(|l| l.contains(" synced") && l.contains("ops="))
        .filter_map(|l| field(l, "took_us="))
        .collect();
    if change_syncs.len() > changes {
        let agent_us = &change_syncs[change_syncs.len() - changes..];
        // Per change: the end-to-end time less the agent's own sync (watch delivery, the
        // loop's wake-up, preemption, the bench's 100 µs poll).
        let mut outside: Vec<f64> = (latencies_in_order.iter().zip(agent_us))
            .map(|(e2e, own)| e2e - own)
            .collect();
        let mut own = agent_us.to_vec();
        println!(
            "per change: agent sync p50 {:.0} µs, p99 {:.0} µs, max {:.0} µs; outside the sync p50 {:.0} µs, p99 {:.0} µs, max {:.0} µs",
            percentile(&mut own, 0.5),
            percentile(&mut own, 0.99),
            percentile(&mut own, 1.0),
            percentile(&mut outside, 0.5),
            percentile(&mut outside, 0.99),
            percentile(&mut outside, 1.0),
        );
        let shown: Vec<String> = (slowest.iter().take(5))
            .map(|(l, n, _)| {
                format!(
                    "#{n} {:.1} ms (agent sync {:.1} ms)",
                    l / 1e3,
                    agent_us[*n] / 1e3
                )
            })
            .collect();
        println!("slowest, with the agent's own sync: {}", shown.join(", "));
    }
    // With RUST_LOG=info,kube_proxy_ebpf::agent=debug,kube_proxy_ebpf::sources::kube=trace:
    // each slow change split by the agent log's timestamps.
    let stages = log_stages(&log);
    if !stages.stored.is_empty() {
        let shown: Vec<String> = (slowest.iter().take(8))
            .filter_map(|&(_, n, _)| {
                let (t0, seen) = walls[n];
                let split = stages.split(secs_of_day(t0), secs_of_day(seen))?;
                Some(format!(
                    "#{n} {:.2} ms = watch delivery {:.2} + loop wake-up {:.2} + agent sync {:.2} + bench poll {:.2}",
                    split.iter().sum::<f64>() * 1e3,
                    split[0] * 1e3,
                    split[1] * 1e3,
                    split[2] * 1e3,
                    split[3] * 1e3
                ))
            })
            .collect();
        println!(
            "slowest, split by the agent log (API write → slice stored → sync starts → synced → seen):\n  {}",
            shown.join("\n  ")
        );
    }
    for key in ["read_us=", "took_us="] {
        let mut v: Vec<f64> = (log.lines())
            .filter(|l| key != "took_us=" || l.contains("ops="))
            .filter_map(|l| field(l, key))
            .collect();
        if !v.is_empty() {
            println!(
                "agent log {key:<9} {} syncs: p50 {:.0} µs, p99 {:.0} µs, max {:.0} µs",
                v.len(),
                percentile(&mut v, 0.5),
                percentile(&mut v, 0.99),
                percentile(&mut v, 1.0)
            );
        }
    }
    drop(agent);
    drop(pins);
    Ok(())
}

/// Seconds since midnight UTC (the agent log's timestamps are UTC).
fn secs_of_day(t: std::time::SystemTime) -> f64 {
    let d = t.duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
    (d.as_secs() % 86_400) as f64 + f64::from(d.subsec_nanos()) / 1e9
}

/// The agent log's timestamps (seconds of the day) of the stages a change goes through.
#[derive(Debug, Default)]
struct LogStages {
    /// An EndpointSlice watch event stored (trace level).
    stored: Vec<f64>,
    /// A sync began reading the source (debug level).
    read: Vec<f64>,
    /// A sync that changed the maps ended.
    synced: Vec<f64>,
}

fn log_stages(log: &str) -> LogStages {
    let mut s = LogStages::default();
    for line in log.lines() {
        // "2026-12-01T20:30:57.442037Z ..."
        let Some(ts) = (line.get(11..26)).and_then(|t| {
            let (h, rest) = t.split_once(':')?;
            let (m, sec) = rest.split_once(':')?;
            Some(
                h.parse::<f64>().ok()? * 3600.0
                    + m.parse::<f64>().ok()? * 60.0
                    + sec.parse::<f64>().ok()?,
            )
        }) else {
            continue;
        };
        if line.contains("watch event stored") && line.contains("EndpointSlice") {
            s.stored.push(ts);
        } else if line.contains("source state read") {
            s.read.push(ts);
        } else if line.contains(" synced ") && line.contains("ops=") {
            s.synced.push(ts);
        }
    }
    s
}

impl LogStages {
    /// A change written at `t0` and seen at `seen`: [API write → stored, stored → sync starts,
    /// sync, synced → seen] in seconds, from the first of each stage after the one before.
    fn split(&self, t0: f64, seen: f64) -> Option<[f64; 4]> {
        let after = |v: &[f64], t: f64| v.iter().copied().find(|&x| x >= t && x <= seen);
        let stored = after(&self.stored, t0)?;
        let read = after(&self.read, stored)?;
        let synced = after(&self.synced, read)?;
        Some([stored - t0, read - stored, synced - read, seen - synced])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_change_is_split_by_the_first_of_each_stage_after_the_one_before() {
        let log = "\
2026-12-01T10:00:00.000100Z TRACE kube_proxy_ebpf::sources::kube: watch event stored kind=Service
2026-12-01T10:00:00.000500Z TRACE kube_proxy_ebpf::sources::kube: watch event stored kind=EndpointSlice
2026-12-01T10:00:00.000700Z DEBUG kube_proxy_ebpf::agent: source state read read_us=5
2026-12-01T10:00:00.000900Z  INFO kube_proxy_ebpf::agent: synced ops=2 full=false
2026-12-01T10:00:00.002000Z TRACE kube_proxy_ebpf::sources::kube: watch event stored kind=EndpointSlice
";
        let stages = log_stages(log);
        assert_eq!(
            (stages.stored.len(), stages.read.len(), stages.synced.len()),
            (2, 1, 1)
        );
        let split = stages.split(36_000.0, 36_000.001_1).expect("split");
        let want = [0.0005, 0.0002, 0.0002, 0.0002];
        for (got, want) in split.iter().zip(want) {
            assert!((got - want).abs() < 1e-9, "{split:?}");
        }
        assert!(
            stages.split(36_000.001_5, 36_000.003).is_none(),
            "no sync after the second event"
        );
    }
}
