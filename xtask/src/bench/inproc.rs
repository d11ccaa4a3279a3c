//! In-process measurements on an unpinned load of the real eBPF object (no interface, no
//! traffic): the control plane (translate → plan → `ServiceMaps::apply`, the agent's pipeline)
//! and the datapath's cost per packet with BPF_PROG_TEST_RUN.

use std::{
    net::{Ipv4Addr, Ipv6Addr},
    time::{Duration, Instant},
};

use anyhow::{Context as _, Result, bail, ensure};
use aya::{
    Ebpf, EbpfLoader,
    programs::{SchedClassifier, TestRun, TestRunOptions},
};
use kube_proxy_ebpf::{
    dataplane::{
        ebpf_object::EBPF_OBJECT,
        loader::{self, MapSizes},
        maps::{ServiceMaps, Stats},
    },
    pipeline::{
        encode,
        incremental::Planner,
        model::{Frontend, Protocol},
        programmed::Programmed,
        translate::NodeContext,
        translate_cache::TranslateCache,
    },
};
use proxy_common::{
    CONFIG_GLOBAL, Counter, CtKey, CtValue, DatapathConfig, MAP_BACKENDS, MAP_CONNTRACK,
    MAP_REVNAT, MAP_SERVICES, PROG_TC_EGRESS, PROG_TC_INGRESS, Scheduler, ServiceValue,
    ipv6::{Backend6, MAP_BACKENDS6, MAP_SERVICES6, Service6Key},
    stats::PICK_COUNTERS,
};
use serde_json::{Value, json};

use super::{
    packet::{self, ACK, SYN},
    stats::{median, percentile},
    workload::{self, SvcSpec},
};

/// `TC_ACT_UNSPEC` (TCX_NEXT, -1): the datapath's pass verdict, so later programs on the hook run.
const TC_NEXT: u32 = u32::MAX;

/// Two Services that translate into each other (A:80 → B:81, B:81 → A:80): BPF_PROG_TEST_RUN's
/// `repeat` reruns the program on its own output, so every repetition is a real
/// established-flow DNAT (ingress) or reverse NAT (egress). Same trick as tests/datapath.rs.
const CYCLE_A: Ipv4Addr = Ipv4Addr::new(10, 96, 1, 1);
const CYCLE_B: Ipv4Addr = Ipv4Addr::new(10, 96, 1, 2);
const CLIENT: Ipv4Addr = Ipv4Addr::new(10, 244, 255, 2);
const NOT_A_SERVICE: Ipv4Addr = Ipv4Addr::new(10, 244, 255, 99);

/// One Service per scheduler (its annotation), 10 endpoints, for the per-scheduler new flows:
/// 10.96.2.1 + k → 10.244.254.(10k + 1..=10k + 10):9000 (never generated, see workload).
fn sched_service(k: usize, s: Scheduler) -> SvcSpec {
    let endpoints: Vec<Ipv4Addr> = (1..=workload::ENDPOINTS_PER_SERVICE as u8)
        .map(|j| Ipv4Addr::new(10, 244, 254, 10 * k as u8 + j))
        .collect();
    SvcSpec::new(
        &format!("sched-{}", s.name()),
        Ipv4Addr::new(10, 96, 2, 1 + k as u8),
        80,
        9000,
        &endpoints,
    )
    .with_scheduler(s.name())
}

/// A cycle pair (as `CYCLE_A`/`CYCLE_B`) per scheduler, for its established flows:
/// 10.96.3.(2k + 1):80 ↔ 10.96.3.(2k + 2):81.
fn sched_cycle(k: usize) -> (Ipv4Addr, Ipv4Addr) {
    (
        Ipv4Addr::new(10, 96, 3, 2 * k as u8 + 1),
        Ipv4Addr::new(10, 96, 3, 2 * k as u8 + 2),
    )
}

fn sched_specs() -> Vec<SvcSpec> {
    let mut v = Vec::new();
    for (k, s) in Scheduler::ALL.into_iter().enumerate() {
        let (a, b) = sched_cycle(k);
        v.push(sched_service(k, s));
        v.push(
            SvcSpec::new(&format!("sched-{}-a", s.name()), a, 80, 81, &[b])
                .with_scheduler(s.name()),
        );
        v.push(
            SvcSpec::new(&format!("sched-{}-b", s.name()), b, 81, 80, &[a])
                .with_scheduler(s.name()),
        );
    }
    v
}

/// How hard to measure.
#[derive(Clone, Copy, Debug, Default)]
pub struct Effort {
    /// Single runs (distinct flows) for the new-flow figures.
    pub new_flows: u32,
    /// test_run calls for established/reply/no-service; each with `repeat`.
    pub calls: u32,
    pub repeat: u32,
    /// Endpoint-change repetitions.
    pub changes: u32,
}

/// Map sizes for `n` Services × 10 endpoints (+ the bench's extra Services), with slack.
pub fn sizes_for(n: usize) -> MapSizes {
    let n = n as u32 + 32;
    MapSizes {
        services: n * 11 + 1024,
        backends: n * 10 + 1024,
        rev_nats: n + 1024,
        affinity: proxy_common::AFFINITY_CAPACITY,
        conntrack: proxy_common::CONNTRACK_CAPACITY,
        snat: proxy_common::SNAT_CAPACITY,
        ..MapSizes::default()
    }
}

/// Like `loader::load_unpinned`, with map sizes (the bench needs maps for 100,000 Services).
fn load(sizes: &MapSizes) -> Result<Ebpf> {
    let mut loader = EbpfLoader::new();
    loader
        .override_global(CONFIG_GLOBAL, &DatapathConfig::DEFAULT, true)
        .map_max_entries(MAP_SERVICES, sizes.services)
        .map_max_entries(MAP_BACKENDS, sizes.backends)
        .map_max_entries(MAP_REVNAT, sizes.rev_nats)
        .map_max_entries(proxy_common::MAP_AFFINITY, sizes.affinity)
        .map_max_entries(proxy_common::MAP_AFFINITY_MATCH, sizes.services)
        .map_max_entries(proxy_common::MAP_LC_FLOWS, sizes.lc_entries())
        .map_max_entries(proxy_common::MAP_LC_ADJUST, sizes.lc_entries())
        .map_max_entries(MAP_CONNTRACK, sizes.conntrack);
    let mut ebpf = loader
        .load(EBPF_OBJECT)
        .context("loading the eBPF object (root needed)")?;
    loader::load_programs(&mut ebpf).context("verifying the programs")?;
    Ok(ebpf)
}

struct Loaded {
    ebpf: Ebpf,
    maps: ServiceMaps,
    stats: Stats,
    programmed: Programmed,
    planner: Planner,
    cache: TranslateCache,
    caps: kube_proxy_ebpf::pipeline::programmed::Capacities,
    node: NodeContext,
}

/// Durations of one full sync, by part.
#[derive(Clone, Copy, Debug, Default)]
pub struct SyncTimes {
    pub translate: Duration,
    pub plan: Duration,
    pub apply: Duration,
    pub ops: usize,
}

impl SyncTimes {
    pub fn total(&self) -> Duration {
        self.translate + self.plan + self.apply
    }

    fn to_json(self) -> Value {
        json!({
            "translate_ms": ms(self.translate), "plan_ms": ms(self.plan),
            "apply_ms": ms(self.apply), "total_ms": ms(self.total()), "ops": self.ops,
        })
    }
}

pub fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

impl Loaded {
    fn new(n: usize) -> Result<Self> {
        let sizes = sizes_for(n);
        let mut ebpf = load(&sizes)?;
        let maps = ServiceMaps::from_ebpf(&mut ebpf)?;
        let stats = Stats::from_ebpf(&mut ebpf)?;
        Ok(Self {
            ebpf,
            maps,
            stats,
            programmed: Programmed::default(),
            planner: Planner::new(&Programmed::default()),
            cache: TranslateCache::new(),
            caps: sizes.capacities(),
            node: NodeContext {
                node_name: "bench-node".into(),
                zone: None,
                scheduler: Scheduler::Random,
            },
        })
    }

    /// One sync through the agent's pipeline (translation cache, incremental planner; `full`:
    /// everything translated and planned, as the agent's first and periodic syncs), timed by
    /// part.
    fn sync(
        &mut self,
        snap: &kube_proxy_ebpf::sources::snapshot::Snapshot,
        full: bool,
    ) -> Result<SyncTimes> {
        let t = Instant::now();
        let changes = self.cache.update(snap, &self.node, &[], full);
        self.planner.desired_changes(&changes, self.cache.desired());
        let translate = t.elapsed();
        let problems = self.cache.problems();
        ensure!(
            problems.is_empty(),
            "generated Services have problems: {:?}",
            problems.first()
        );
        let t = Instant::now();
        let plan = self
            .planner
            .plan(self.cache.desired(), &self.programmed, &self.caps, full);
        let plan_t = t.elapsed();
        ensure!(
            plan.skipped.is_empty(),
            "maps too small: {:?}",
            plan.skipped.first()
        );
        let t = Instant::now();
        // As the agent: same-kind runs of ops in batched map calls.
        let (applied, failure) = self.maps.apply_all(&plan.ops);
        self.programmed.reserve_for(&plan.ops[..applied]);
        for op in &plan.ops[..applied] {
            self.planner.observe(&self.programmed, op);
            self.programmed.apply(op);
        }
        if let Some(e) = failure {
            return Err(e.into());
        }
        self.planner.applied(&plan);
        Ok(SyncTimes {
            translate,
            plan: plan_t,
            apply: t.elapsed(),
            ops: plan.ops.len(),
        })
    }

    fn prog(&self, name: &str) -> Result<&SchedClassifier> {
        self.ebpf
            .program(name)
            .with_context(|| format!("no program {name}"))?
            .try_into()
            .with_context(|| format!("{name} is not a classifier"))
    }

    /// (verdict, mean ns per run as the kernel measured it).
    fn run(&self, prog: &str, frame: &[u8], repeat: u32) -> Result<(u32, u64)> {
        let mut out = vec![0u8; frame.len() + 256];
        let r = self
            .prog(prog)?
            .test_run(TestRunOptions {
                data_in: Some(frame),
                data_out: Some(&mut out),
                repeat,
                ..Default::default()
            })
            .with_context(|| format!("BPF_PROG_TEST_RUN of {prog}"))?;
        Ok((r.return_value, r.duration.as_nanos() as u64))
    }

    /// Empties CONNTRACK, so a measurement starts from the same table whatever ran before it.
    fn clear_conntrack(&mut self) -> Result<()> {
        let map = self.ebpf.map_mut(MAP_CONNTRACK).context("CONNTRACK map")?;
        let mut ct: aya::maps::HashMap<_, CtKey, CtValue> =
            aya::maps::HashMap::try_from(map).context("CONNTRACK type")?;
        let keys: Vec<CtKey> = ct.keys().filter_map(|k| k.ok()).collect();
        for k in &keys {
            // An entry gone meanwhile (LRU) is what we want anyway.
            let _ = ct.remove(k);
        }
        Ok(())
    }

    fn counter(&self, c: Counter) -> Result<u64> {
        let all = self.stats.read()?;
        let i = Counter::ALL
            .iter()
            .position(|x| *x == c)
            .context("counter index")?;
        Ok(all[i])
    }
}

/// Per-packet costs (ns, median) at one size.
#[derive(Clone, Copy, Debug, Default)]
pub struct PacketCosts {
    pub new_flow: f64,
    pub new_flow_p90: f64,
    pub new_flow_spread: f64,
    pub established: f64,
    pub reply: f64,
    pub no_service: f64,
    /// "not a Service" with one run per call: what the single-run method costs by itself.
    pub single_floor: f64,
    /// Per scheduler (`Scheduler::ALL` order): a Service of 10 endpoints with its annotation.
    pub schedulers: [SchedCosts; 6],
    /// The same kinds on IPv6 (one Service written straight into the IPv6 maps: the agent does
    /// not program IPv6 Services yet).
    pub ipv6: Ipv6Costs,
}

/// IPv6 per-packet costs (ns, median), measured as their IPv4 counterparts.
#[derive(Clone, Copy, Debug, Default)]
pub struct Ipv6Costs {
    pub new_flow: f64,
    pub established: f64,
    pub reply: f64,
    pub no_service: f64,
}

/// One scheduler's costs (ns, median): a new flow to its Service (single runs, as `new_flow`)
/// and an established flow (repeated runs, as `established`).
#[derive(Clone, Copy, Debug, Default)]
pub struct SchedCosts {
    pub new_flow: f64,
    pub established: f64,
}

impl PacketCosts {
    pub fn get(&self, k: &str) -> f64 {
        match k {
            "new_flow" => self.new_flow,
            "new_flow_spread" => self.new_flow_spread,
            "established" => self.established,
            "reply" => self.reply,
            "no_service" => self.no_service,
            "single_floor" => self.single_floor,
            _ => f64::NAN,
        }
    }
}

pub const PACKET_KINDS: [(&str, &str); 6] = [
    ("new_flow", "new flow, one Service (SYN)"),
    ("new_flow_spread", "new flow, spread over all Services"),
    ("established", "established flow"),
    ("reply", "reply, reverse NAT (tc_egress)"),
    ("no_service", "not a Service"),
    (
        "single_floor",
        "not a Service, one run per call (floor of the new-flow method)",
    ),
];

/// Everything measured at one size.
#[derive(Clone, Debug, Default)]
pub struct SizeResult {
    pub services: usize,
    pub full_sync: SyncTimes,
    pub packets: Option<PacketCosts>,
    /// Endpoint change: median translate+plan+apply, and its parts.
    pub change: Option<(SyncTimes, Duration)>,
}

impl SizeResult {
    pub fn to_json(&self) -> Value {
        json!({
            "services": self.services,
            "endpoints_per_service": workload::ENDPOINTS_PER_SERVICE,
            "full_sync": self.full_sync.to_json(),
            "packets_ns": self.packets.map(|p| json!({
                "new_flow": p.new_flow, "new_flow_p90": p.new_flow_p90,
                "new_flow_spread": p.new_flow_spread, "established": p.established,
                "reply": p.reply, "no_service": p.no_service, "single_run_floor": p.single_floor,
                "ipv6": json!({
                    "new_flow": p.ipv6.new_flow, "established": p.ipv6.established,
                    "reply": p.ipv6.reply, "no_service": p.ipv6.no_service,
                }),
                "per_scheduler": Scheduler::ALL.iter().zip(p.schedulers).map(|(s, c)| (
                    s.name().to_owned(),
                    json!({"new_flow": c.new_flow, "established": c.established}),
                )).collect::<serde_json::Map<_, _>>(),
            })),
            "endpoint_change": self.change.map(|(parts, total)| json!({
                "median_ms": ms(total), "parts_of_median_run": parts.to_json(),
            })),
        })
    }
}

/// Loads maps for `n` generated Services (+2 cycle Services), fills them through the pipeline,
/// and measures what is asked.
pub fn measure(n: usize, packets: bool, change: bool, effort: Effort) -> Result<SizeResult> {
    let mut specs = workload::generated(n);
    specs.push(SvcSpec::new("cycle-a", CYCLE_A, 80, 81, &[CYCLE_B]));
    specs.push(SvcSpec::new("cycle-b", CYCLE_B, 81, 80, &[CYCLE_A]));
    specs.extend(sched_specs());
    let snap = workload::snapshot(&specs);
    let mut l = Loaded::new(n)?;
    let full_sync = l.sync(&snap, true)?;
    let mut result = SizeResult {
        services: n,
        full_sync,
        ..Default::default()
    };
    if packets {
        let mut costs = packet_costs(&l, &specs[..n], effort)?;
        costs.schedulers = scheduler_costs(&mut l, effort)?;
        costs.ipv6 = ipv6_costs(&mut l, effort)?;
        result.packets = Some(costs);
    }
    if change {
        result.change = Some(endpoint_change(&mut l, &specs, effort.changes)?);
    }
    Ok(result)
}

fn packet_costs(l: &Loaded, generated: &[SvcSpec], e: Effort) -> Result<PacketCosts> {
    let target = generated.first().context("at least one Service")?;
    // (a) new flows to one Service: a distinct 5-tuple per run.
    let mut new_flow = Vec::with_capacity(e.new_flows as usize);
    for k in 0..e.new_flows {
        let (saddr, sport) = client_for(k, 0);
        let f = packet::tcp(saddr, sport, target.vip, target.port, SYN, &[]);
        let (verdict, ns) = l.run(PROG_TC_INGRESS, &f, 1)?;
        ensure!(verdict == TC_NEXT, "new flow: verdict {verdict}");
        new_flow.push(ns as f64);
    }
    // (a') new flows spread over all Services (cache misses of a big map).
    let mut spread = Vec::with_capacity(e.new_flows as usize);
    let mut x: u64 = 0x2545_f491_4f6c_dd1d;
    for k in 0..e.new_flows {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        let s = &generated[(x % generated.len() as u64) as usize];
        let (saddr, sport) = client_for(k, 1);
        let f = packet::tcp(saddr, sport, s.vip, s.port, SYN, &[]);
        let (verdict, ns) = l.run(PROG_TC_INGRESS, &f, 1)?;
        ensure!(verdict == TC_NEXT, "new flow (spread): verdict {verdict}");
        spread.push(ns as f64);
    }
    let new_flow_p90 = percentile(&mut new_flow.clone(), 0.9);

    // (b) established: the A↔B cycle; first packets create the two flows.
    let payload = [0u8; 64];
    let to_a = packet::tcp(CLIENT, 50_000, CYCLE_A, 80, ACK, &payload);
    let to_b = packet::tcp(CLIENT, 50_000, CYCLE_B, 81, ACK, &payload);
    for f in [&to_a, &to_b] {
        let (verdict, _) = l.run(PROG_TC_INGRESS, f, 1)?;
        ensure!(verdict == TC_NEXT, "cycle setup: verdict {verdict}");
    }
    let before = l.counter(Counter::EstablishedFlow)?;
    let established = repeated(l, PROG_TC_INGRESS, &to_a, e)?;
    let took = l.counter(Counter::EstablishedFlow)? - before;
    if took != u64::from(e.calls) * u64::from(e.repeat) {
        bail!(
            "established: {took} of {} runs took the established path",
            e.calls * e.repeat
        );
    }
    // (c) replies: B:81 → client matches flow A's REPLY entry, and so on around the cycle.
    let reply = packet::tcp(CYCLE_B, 81, CLIENT, 50_000, ACK, &payload);
    let before = l.counter(Counter::ReplyTranslated)?;
    let reply_ns = repeated(l, PROG_TC_EGRESS, &reply, e)?;
    let took = l.counter(Counter::ReplyTranslated)? - before;
    if took != u64::from(e.calls) * u64::from(e.repeat) {
        bail!(
            "reply: {took} of {} runs were reverse-NATed",
            e.calls * e.repeat
        );
    }
    // (d) not a Service.
    let other = packet::tcp(CLIENT, 50_001, NOT_A_SERVICE, 8080, ACK, &payload);
    let no_service = repeated(l, PROG_TC_INGRESS, &other, e)?;
    let mut single = Vec::with_capacity(e.new_flows as usize);
    for _ in 0..e.new_flows {
        let (verdict, ns) = l.run(PROG_TC_INGRESS, &other, 1)?;
        ensure!(verdict == TC_NEXT, "not a Service: verdict {verdict}");
        single.push(ns as f64);
    }

    Ok(PacketCosts {
        new_flow: median(&mut new_flow),
        new_flow_p90,
        new_flow_spread: median(&mut spread),
        established,
        reply: reply_ns,
        no_service,
        single_floor: median(&mut single),
        // Measured by `scheduler_costs` and `ipv6_costs`.
        schedulers: Default::default(),
        ipv6: Default::default(),
    })
}

/// A 10-endpoint IPv6 Service and an IPv6 cycle pair, written straight into the IPv6 maps
/// (fd00::/8; ids of their own map), then the IPv4 kinds: new flows (single runs), established,
/// reply, not a Service (repeated runs).
fn ipv6_costs(l: &mut Loaded, e: Effort) -> Result<Ipv6Costs> {
    let v6 = |x: u16, y: u16| Ipv6Addr::new(0xfd00, 0x96, 0, 0, 0, 0, x, y);
    let (vip, a, b) = (v6(0, 0x10), v6(1, 1), v6(1, 2));
    let client = Ipv6Addr::new(0xfd00, 0x244, 0xff, 0, 0, 0, 0, 2);
    let backend = |addr: Ipv6Addr, port: u16| Backend6 {
        addr: addr.octets(),
        port: port.to_be_bytes(),
        proto: 6,
        flags: 0,
    };
    {
        let mut backends: aya::maps::HashMap<_, u32, Backend6> =
            aya::maps::HashMap::try_from(l.ebpf.map_mut(MAP_BACKENDS6).context("BACKENDS6")?)?;
        for i in 1..=10u16 {
            backends.insert(
                u32::from(i),
                backend(Ipv6Addr::new(0xfd00, 0x244, 0xfe, 0, 0, 0, 0, i), 9000),
                0,
            )?;
        }
        backends.insert(100, backend(b, 81), 0)?;
        backends.insert(101, backend(a, 80), 0)?;
    }
    let mut services: aya::maps::HashMap<_, Service6Key, ServiceValue> =
        aya::maps::HashMap::try_from(l.ebpf.map_mut(MAP_SERVICES6).context("SERVICES6")?)?;
    let key = |addr: Ipv6Addr, port: u16| Service6Key::new(addr.octets(), port.to_be_bytes(), 6, 0);
    for i in 1..=10u16 {
        services.insert(
            key(vip, 80).with_slot(i),
            ServiceValue::slot(u32::from(i)),
            0,
        )?;
    }
    services.insert(key(vip, 80), ServiceValue::frontend(10, 1), 0)?;
    for (addr, port, id, rev) in [(a, 80, 100, 2), (b, 81, 101, 3)] {
        services.insert(key(addr, port).with_slot(1), ServiceValue::slot(id), 0)?;
        services.insert(key(addr, port), ServiceValue::frontend(1, rev), 0)?;
    }
    let mut new_flow = Vec::with_capacity(e.new_flows as usize);
    for k in 0..e.new_flows {
        let (_, sport) = client_for(k, 2);
        let src = Ipv6Addr::new(0xfd00, 0x244, 0xfd, 0, 0, 0, (k / 60_000) as u16, 1);
        let f = packet::tcp6(src, sport, vip, 80, SYN, &[]);
        let (verdict, ns) = l.run(PROG_TC_INGRESS, &f, 1)?;
        ensure!(verdict == TC_NEXT, "IPv6 new flow: verdict {verdict}");
        new_flow.push(ns as f64);
    }
    let payload = [0u8; 64];
    let to_a = packet::tcp6(client, 50_000, a, 80, ACK, &payload);
    let to_b = packet::tcp6(client, 50_000, b, 81, ACK, &payload);
    for f in [&to_a, &to_b] {
        let (verdict, _) = l.run(PROG_TC_INGRESS, f, 1)?;
        ensure!(verdict == TC_NEXT, "IPv6 cycle setup: verdict {verdict}");
    }
    let expect_all = |l: &Loaded, c: Counter, before: u64, what: &str| -> Result<()> {
        let took = l.counter(c)? - before;
        ensure!(
            took == u64::from(e.calls) * u64::from(e.repeat),
            "IPv6 {what}: {took} of {} runs took the path",
            e.calls * e.repeat
        );
        Ok(())
    };
    let before = l.counter(Counter::EstablishedFlow)?;
    let established = repeated(l, PROG_TC_INGRESS, &to_a, e)?;
    expect_all(l, Counter::EstablishedFlow, before, "established")?;
    let reply_frame = packet::tcp6(b, 81, client, 50_000, ACK, &payload);
    let before = l.counter(Counter::ReplyTranslated)?;
    let reply = repeated(l, PROG_TC_EGRESS, &reply_frame, e)?;
    expect_all(l, Counter::ReplyTranslated, before, "reply")?;
    let other = packet::tcp6(client, 50_001, v6(0xff, 0x99), 8080, ACK, &payload);
    let no_service = repeated(l, PROG_TC_INGRESS, &other, e)?;
    Ok(Ipv6Costs {
        new_flow: median(&mut new_flow),
        established,
        reply,
        no_service,
    })
}

/// Per scheduler: new flows to its 10-endpoint Service (half as many as `new_flow`), each
/// scheduler starting from an empty conntrack table, then established packets around its cycle
/// pair.
/// Checks that the frontends carry the scheduler's code and that each new flow counted one pick
/// of that scheduler.
fn scheduler_costs(l: &mut Loaded, e: Effort) -> Result<[SchedCosts; 6]> {
    let mut out = [SchedCosts::default(); 6];
    let payload = [0u8; 64];
    let flows = (e.new_flows / 2).max(100);
    for (k, s) in Scheduler::ALL.into_iter().enumerate() {
        let target = sched_service(k, s);
        let (a, b) = sched_cycle(k);
        for (vip, port) in [(target.vip, 80), (a, 80), (b, 81)] {
            let key = encode::service_key(&Frontend::new(vip, port, Protocol::Tcp), 0);
            let code = l.programmed.services.get(&key).map(|v| v.scheduler);
            ensure!(
                code == Some(s.code()),
                "{vip}:{port} carries scheduler code {code:?}, want {} ({})",
                s.code(),
                s.name()
            );
        }
        // Every scheduler's new flows meet the same (empty) conntrack table, not the ones the
        // schedulers before it left.
        l.clear_conntrack()?;
        let pick = PICK_COUNTERS[k];
        let before = l.counter(pick)?;
        let mut new_flow = Vec::with_capacity(flows as usize);
        for i in 0..flows {
            let (saddr, sport) = client_for(i, 2);
            let f = packet::tcp(saddr, sport, target.vip, target.port, SYN, &[]);
            let (verdict, ns) = l.run(PROG_TC_INGRESS, &f, 1)?;
            ensure!(
                verdict == TC_NEXT,
                "new flow ({}): verdict {verdict}",
                s.name()
            );
            new_flow.push(ns as f64);
        }
        let picked = l.counter(pick)? - before;
        ensure!(
            picked == u64::from(flows),
            "{}: {picked} of {flows} new flows counted {}",
            s.name(),
            pick.name()
        );
        let sport = 50_010 + k as u16;
        let to_a = packet::tcp(CLIENT, sport, a, 80, ACK, &payload);
        let to_b = packet::tcp(CLIENT, sport, b, 81, ACK, &payload);
        for f in [&to_a, &to_b] {
            let (verdict, _) = l.run(PROG_TC_INGRESS, f, 1)?;
            ensure!(
                verdict == TC_NEXT,
                "cycle setup ({}): verdict {verdict}",
                s.name()
            );
        }
        let before = l.counter(Counter::EstablishedFlow)?;
        let established = repeated(l, PROG_TC_INGRESS, &to_a, e)?;
        let took = l.counter(Counter::EstablishedFlow)? - before;
        ensure!(
            took == u64::from(e.calls) * u64::from(e.repeat),
            "established ({}): {took} of {} runs took the established path",
            s.name(),
            e.calls * e.repeat
        );
        out[k] = SchedCosts {
            new_flow: median(&mut new_flow),
            established,
        };
    }
    Ok(out)
}

/// Median over `calls` test runs of the mean ns per repetition.
fn repeated(l: &Loaded, prog: &str, frame: &[u8], e: Effort) -> Result<f64> {
    let mut v = Vec::with_capacity(e.calls as usize);
    for _ in 0..e.calls {
        let (verdict, ns) = l.run(prog, frame, e.repeat)?;
        ensure!(verdict == TC_NEXT, "{prog}: verdict {verdict}");
        v.push(ns as f64);
    }
    Ok(median(&mut v))
}

/// A distinct client (address, port) per run `k`; `lane` keeps the two new-flow sets apart.
fn client_for(k: u32, lane: u8) -> (Ipv4Addr, u16) {
    let addr = Ipv4Addr::new(10, 244, 250 + lane, (k / 60_000) as u8 + 1);
    (addr, 1024 + (k % 60_000) as u16)
}

/// One endpoint of one Service changes address, `reps` times (alternating between two
/// addresses); each time a change-triggered sync of the whole snapshot (the cache translates
/// the changed Service, the planner plans its frontends). Median total.
fn endpoint_change(l: &mut Loaded, specs: &[SvcSpec], reps: u32) -> Result<(SyncTimes, Duration)> {
    let mut snap = workload::snapshot(specs);
    let idx = specs.len() / 2;
    let mut runs = Vec::new();
    for r in 0..reps.max(1) {
        let mut s = specs[idx].clone();
        s.endpoints[0] = if r % 2 == 0 {
            Ipv4Addr::new(10, 244, 255, 200)
        } else {
            specs[idx].endpoints[0]
        };
        std::sync::Arc::make_mut(&mut snap.endpoint_slices)[idx] = std::sync::Arc::new(
            kube_proxy_ebpf::sources::endpoints::SliceData::from(&workload::slice(&s)),
        );
        let t = l.sync(&snap, false)?;
        ensure!(
            (1..=2 * workload::ENDPOINTS_PER_SERVICE + 8).contains(&t.ops),
            "an endpoint change made {} map operations",
            t.ops
        );
        runs.push(t);
    }
    runs.sort_by_key(SyncTimes::total);
    let mid = runs[runs.len() / 2];
    Ok((mid, mid.total()))
}

/// Kernel memory of the Maglev tables of `services` Maglev Services × 10 endpoints at the
/// default M, written through the planner and the map layer into an unpinned load: the
/// allocation (2 KiB per chunk), the kernel's own account (`memlock`), and the time to build
/// and write them.
pub fn maglev_memory(services: usize) -> Result<Value> {
    use kube_proxy_ebpf::pipeline::{
        diff,
        model::{
            DesiredBackend, DesiredFrontend, DesiredState, EndpointAddr, Frontend, FrontendKind,
            Protocol, Scheduler, ServicePortName,
        },
        programmed::Capacities,
    };
    let m = proxy_common::maglev::DEFAULT_TABLE_SIZE;
    let mut desired = DesiredState::default();
    for s in 0..services as u32 {
        let backends = (0..10)
            .map(|b| DesiredBackend {
                endpoint: EndpointAddr {
                    addr: Ipv4Addr::from(0x0a80_0000 + s * 16 + b),
                    port: 8080,
                    protocol: Protocol::Tcp,
                },
                terminating: false,
                local: false,
                not_serving: false,
            })
            .collect();
        let df = DesiredFrontend {
            balancing: kube_proxy_ebpf::pipeline::model::Balancing {
                scheduler: Scheduler::Maglev,
                affinity_timeout_s: None,
            },
            service: ServicePortName {
                namespace: "bench".into(),
                name: format!("mh{s}"),
                port_name: String::new(),
            },
            kind: FrontendKind::ClusterIp,
            external_local: false,
            drop_when_empty: false,
            source_ranges: Vec::new(),
            backends,
            retained: Vec::new(),
        };
        let fe = Frontend::new(Ipv4Addr::from(0x0a60_0000 + s), 80, Protocol::Tcp);
        desired.frontends.insert(fe, df.into());
    }
    let mut ebpf = loader::load_unpinned(&DatapathConfig::DEFAULT)?;
    let mut maps = ServiceMaps::from_ebpf(&mut ebpf)?;
    let empty = maps.maglev_memory().unwrap_or(0);
    let started = Instant::now();
    let plan = diff::plan(&desired, &Programmed::default(), &Capacities::default());
    ensure!(plan.skipped.is_empty(), "skipped: {:?}", &plan.skipped[..1]);
    let planned = started.elapsed();
    // Building the tables alone (the map layer builds them again as it writes them).
    let building = Instant::now();
    for op in &plan.ops {
        if let kube_proxy_ebpf::pipeline::programmed::MapOp::PutMaglevTable { table, .. } = op {
            std::hint::black_box(table.entries());
        }
    }
    let build = building.elapsed();
    let started = Instant::now() - planned;
    let (done, err) = maps.apply_all(&plan.ops);
    if let Some(e) = err {
        bail!("applying op {done}: {e}");
    }
    let took = started.elapsed();
    let memlock = maps.maglev_memory().unwrap_or(0).saturating_sub(empty);
    let allocated = kube_proxy_ebpf::pipeline::maglev::kernel_bytes(services as u64, m);
    Ok(json!({
        "services": services,
        "endpoints_per_service": 10,
        "table_size": m,
        "chunks_per_table": proxy_common::maglev::chunks(m),
        "allocated_bytes": allocated,
        "kernel_memlock_bytes": memlock,
        "plan_and_write_ms": ms(took),
        "plan_ms": ms(planned),
        "build_tables_ms": ms(build),
    }))
}
