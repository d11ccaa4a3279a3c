//! Churn soak (issue 13, item 4): endpoint changes at a fixed rate across many Services through
//! the fake API server, with traffic running through some of those Services the whole time.
//!
//! Privileged (KPE_PRIVILEGED=1). The agent runs in the node namespace of the standard topology
//! ([`common_kube::Env`]), synced from [`proxy_testenv::FakeApiServer`]. `KPE_SOAK_SERVICES`
//! Services (default 200) carry EndpointSlices: three *hot* Services whose endpoints are the real
//! backend pods (be1..be3, HTTP on 8080), one plain, one with `sessionAffinity: ClientIP`, one
//! with the `mh` (Maglev) scheduler; the rest are *cold* Services with addresses no pod has,
//! some with affinity, some with Maglev. A connection open while its pod turns not ready in
//! every hot Service keeps working (the backend entry stays, flagged not serving, as kube-proxy
//! keeps such TCP flows); only a pod removed from every hot slice loses its entry. For `KPE_SOAK_SECS` seconds (default 40) the test applies
//! `KPE_SOAK_RATE` (default 20) changes per second — add an endpoint, remove one, flip one's
//! readiness (ready / not ready / terminating-serving) — chosen by a fixed-seed generator, a
//! quarter of them to the hot Services, which always keep at least one ready endpoint. All the
//! while the client pod sends HTTP requests through the hot ClusterIPs.
//!
//! At the end every changed slice is restored to its initial content, and once the agent has
//! synced the test checks:
//! - every request was answered by a backend pod, through the VIP (0 failures; each failure is
//!   printed);
//! - the agent's RSS (`VmRSS`), sampled each second after a warm-up, stayed flat: the steady
//!   level (the median of each minute, or of each quarter of a shorter run) within 10 %
//!   (highest/lowest), and no single sample (a sync's transient allocations) above the lowest
//!   level by more than 25 %;
//! - the entries of SERVICES_V1, BACKENDS_V1, REVNAT_V1, AFFMATCH_V1 and MAGLEV_V1, read from the
//!   pinned maps, are what the (restored) objects need and what they were before the churn: no
//!   leaked ids or entries.
//!
//! It prints the figures (`SOAK ...` lines). `cargo xtask soak` runs it in release with the long
//! settings (600 s, 1,000 Services).

mod common_kube;
mod common_netns;

use std::{
    collections::{BTreeMap, BTreeSet},
    net::Ipv4Addr,
    path::Path,
    sync::{
        Mutex,
        atomic::{AtomicBool, AtomicU64, Ordering},
    },
    thread,
    time::{Duration, Instant},
};

use aya::{
    Pod,
    maps::{HashMap as BpfHashMap, Map, MapData},
};
use common_kube::{Cond, Env, rss_kib, scale_vip, service, slice, status_kib};
use proxy_common::{
    AffinityMatchKey, Backend, MAP_AFFINITY_MATCH, MAP_BACKENDS, MAP_MAGLEV, MAP_REVNAT,
    MAP_SERVICES, RevNat, ServiceKey, ServiceValue,
    maglev::{Chunk, MaglevKey},
};
use proxy_testenv::{BACKENDS, http_url, require_privileged};
use serde_json::{Value, json};

/// The hot Services' ClusterIPs: plain, ClientIP affinity, Maglev.
const HOT: [Ipv4Addr; 3] = [
    Ipv4Addr::new(10, 96, 0, 10),
    Ipv4Addr::new(10, 96, 0, 11),
    Ipv4Addr::new(10, 96, 0, 12),
];
/// Requests per curl process of the traffic loop (each on its own connection).
const BATCH: usize = 10;
/// A cold Service holds at most this many endpoints (of the 16 addresses `cold_addr` gives it).
const COLD_MAX: usize = 6;
const COLD_INITIAL: usize = 3;

/// The run's settings, from the environment (the short form by default).
struct Settings {
    secs: u64,
    services: usize,
    rate: u64,
}

impl Settings {
    fn from_env() -> Self {
        let var = |name: &str, default: u64| -> u64 {
            match std::env::var(name) {
                Ok(v) => v
                    .parse()
                    .unwrap_or_else(|_| panic!("{name}={v:?} is not a whole number")),
                Err(_) => default,
            }
        };
        let s = Self {
            secs: var("KPE_SOAK_SECS", 40),
            services: usize::try_from(var("KPE_SOAK_SERVICES", 200)).expect("services"),
            rate: var("KPE_SOAK_RATE", 20),
        };
        assert!(
            (1..=3_600).contains(&s.secs),
            "KPE_SOAK_SECS={} out of 1..=3600",
            s.secs
        );
        assert!(
            (HOT.len() + 1..=20_000).contains(&s.services),
            "KPE_SOAK_SERVICES={} out of {}..=20000",
            s.services,
            HOT.len() + 1
        );
        assert!(
            (1..=1_000).contains(&s.rate),
            "KPE_SOAK_RATE={} out of 1..=1000",
            s.rate
        );
        s
    }
}

/// xorshift64*: a fixed-seed sequence, so a failing run can be replayed change for change.
struct Rng(u64);

impl Rng {
    fn below(&mut self, n: usize) -> usize {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        (self.0.wrapping_mul(0x2545_F491_4F6C_DD1D) >> 33) as usize % n.max(1)
    }
}

/// What kind of Service `i` is: the hot ones first, then cold ones, every 7th with affinity and
/// every 5th with Maglev.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Flavour {
    Plain,
    Affinity,
    Maglev,
}

fn flavour(i: usize) -> Flavour {
    match i {
        1 => Flavour::Affinity,
        2 => Flavour::Maglev,
        _ if i < HOT.len() => Flavour::Plain,
        _ if i.is_multiple_of(7) => Flavour::Affinity,
        _ if i.is_multiple_of(5) => Flavour::Maglev,
        _ => Flavour::Plain,
    }
}

fn is_hot(i: usize) -> bool {
    i < HOT.len()
}

fn name(i: usize) -> String {
    if is_hot(i) {
        format!("hot-{i}")
    } else {
        format!("svc-{i}")
    }
}

fn vip(i: usize) -> Ipv4Addr {
    if is_hot(i) { HOT[i] } else { scale_vip(i) }
}

/// The `j`th (0..16) address of cold Service `i`: no pod has it.
fn cold_addr(i: usize, j: usize) -> Ipv4Addr {
    let base = u32::from(Ipv4Addr::new(10, 128, 0, 0)) + u32::try_from(i * 16 + j).expect("index");
    Ipv4Addr::from(base)
}

fn service_object(i: usize) -> Value {
    let mut svc = service(&name(i), vip(i), 80);
    match flavour(i) {
        Flavour::Plain => {}
        Flavour::Affinity => svc["spec"]["sessionAffinity"] = json!("ClientIP"),
        Flavour::Maglev => {
            svc["metadata"]["annotations"]["kube-proxy-ebpf.io/scheduler"] = json!("mh");
        }
    }
    svc
}

/// Every Service's initial endpoints: the three pods for the hot ones, three addresses of their
/// own for the cold ones; all ready.
fn initial_endpoints(services: usize) -> Vec<Vec<(Ipv4Addr, Cond)>> {
    (0..services)
        .map(|i| {
            if is_hot(i) {
                BACKENDS.iter().map(|(_, ip)| (*ip, Cond::Ready)).collect()
            } else {
                (0..COLD_INITIAL)
                    .map(|j| (cold_addr(i, j), Cond::Ready))
                    .collect()
            }
        })
        .collect()
}

const CONDS: [Cond; 3] = [Cond::Ready, Cond::NotReady, Cond::TerminatingServing];

fn ready_count(eps: &[(Ipv4Addr, Cond)]) -> usize {
    eps.iter().filter(|(_, c)| matches!(c, Cond::Ready)).count()
}

/// One change to Service `i`'s endpoints `eps` (add, remove or flip readiness); a hot Service
/// keeps at least one ready endpoint. Returns what it did, for the figures.
fn churn(i: usize, eps: &mut Vec<(Ipv4Addr, Cond)>, rng: &mut Rng) -> &'static str {
    let pool: Vec<Ipv4Addr> = if is_hot(i) {
        BACKENDS.iter().map(|(_, ip)| *ip).collect()
    } else {
        (0..16).map(|j| cold_addr(i, j)).collect()
    };
    let max = if is_hot(i) { pool.len() } else { COLD_MAX };
    for _ in 0..8 {
        match rng.below(3) {
            0 if eps.len() < max => {
                let free: Vec<_> = pool
                    .iter()
                    .filter(|a| !eps.iter().any(|(e, _)| e == *a))
                    .collect();
                let addr = *free[rng.below(free.len())];
                let cond = CONDS[rng.below(CONDS.len())];
                eps.push((addr, cond));
                return "add";
            }
            1 if eps.len() > 1 => {
                let k = rng.below(eps.len());
                let removed = eps.remove(k);
                if is_hot(i) && ready_count(eps) == 0 {
                    eps.insert(k, removed);
                    continue;
                }
                return "remove";
            }
            2 => {
                let k = rng.below(eps.len());
                let was = eps[k].1;
                eps[k].1 = CONDS[rng.below(CONDS.len())];
                if is_hot(i) && ready_count(eps) == 0 {
                    eps[k].1 = was;
                    continue;
                }
                return "flip";
            }
            _ => {}
        }
    }
    // Nothing allowed in 8 draws (rare): make one endpoint ready, always allowed.
    let k = rng.below(eps.len());
    eps[k].1 = Cond::Ready;
    "flip"
}

// ---------------------------------------------------------------------------------------------
// Map occupancy

/// Entry counts of the maps the Services' objects fill, read from the pinned maps.
type Occupancy = BTreeMap<&'static str, usize>;

fn entries<K: Pod, V: Pod>(pins: &Path, map: &str) -> usize {
    let data = MapData::from_pin(pins.join(map))
        .unwrap_or_else(|e| panic!("opening the pinned {map}: {e}"));
    let map_h: BpfHashMap<MapData, K, V> = BpfHashMap::try_from(Map::HashMap(data))
        .unwrap_or_else(|e| panic!("{map} is not a hash map: {e}"));
    map_h.keys().filter(Result::is_ok).count()
}

fn occupancy(pins: &Path) -> Occupancy {
    BTreeMap::from([
        (
            MAP_SERVICES,
            entries::<ServiceKey, ServiceValue>(pins, MAP_SERVICES),
        ),
        (MAP_BACKENDS, entries::<u32, Backend>(pins, MAP_BACKENDS)),
        (MAP_REVNAT, entries::<u32, RevNat>(pins, MAP_REVNAT)),
        (
            MAP_AFFINITY_MATCH,
            entries::<AffinityMatchKey, u32>(pins, MAP_AFFINITY_MATCH),
        ),
        (MAP_MAGLEV, entries::<MaglevKey, Chunk>(pins, MAP_MAGLEV)),
    ])
}

/// What all-ready `endpoints` need in the maps (MAGLEV_V1 left out: its table size is the
/// agent's choice; the baseline comparison covers it): a frontend entry plus a slot per endpoint
/// (SERVICES), one backend id per distinct endpoint (BACKENDS), a rev-NAT id per frontend, an
/// affinity match per (affinity frontend, endpoint).
fn needed(endpoints: &[Vec<(Ipv4Addr, Cond)>]) -> Occupancy {
    assert!(
        endpoints
            .iter()
            .flatten()
            .all(|(_, c)| matches!(c, Cond::Ready)),
        "the model counts all-ready objects only"
    );
    let distinct: BTreeSet<Ipv4Addr> = endpoints.iter().flatten().map(|(a, _)| *a).collect();
    let affinity: usize = endpoints
        .iter()
        .enumerate()
        .filter(|(i, _)| flavour(*i) == Flavour::Affinity)
        .map(|(_, e)| e.len())
        .sum();
    BTreeMap::from([
        (
            MAP_SERVICES,
            endpoints.iter().map(|e| 1 + e.len()).sum::<usize>(),
        ),
        (MAP_BACKENDS, distinct.len()),
        (MAP_REVNAT, endpoints.len()),
        (MAP_AFFINITY_MATCH, affinity),
    ])
}

// ---------------------------------------------------------------------------------------------
// Traffic

#[derive(Default)]
struct Traffic {
    requests: AtomicU64,
    failures: AtomicU64,
    /// The first failures, described (the rest are only counted).
    failed: Mutex<Vec<String>>,
}

impl Traffic {
    fn fail(&self, what: String) {
        self.failures.fetch_add(1, Ordering::Relaxed);
        let mut failed = self.failed.lock().expect("failure list");
        if failed.len() < 20 {
            failed.push(what);
        }
    }
}

/// Requests through the hot ClusterIPs from the client pod until `stop` (at most `max_batches`
/// curl runs): each must be answered by a backend pod, from the VIP.
fn run_traffic(env: &Env, stop: &AtomicBool, traffic: &Traffic, max_batches: usize) {
    let names: Vec<&str> = BACKENDS.iter().map(|(n, _)| *n).collect();
    for batch in 0..max_batches {
        if stop.load(Ordering::Relaxed) {
            return;
        }
        let vip = HOT[batch % HOT.len()];
        let url = http_url(vip, 80);
        match env.topo.curl_many(&url, BATCH) {
            Ok(replies) => {
                for (k, reply) in replies.into_iter().enumerate() {
                    traffic.requests.fetch_add(1, Ordering::Relaxed);
                    match reply {
                        Ok(r)
                            if names.contains(&r.body.as_str())
                                && r.remote_ip == vip.to_string() => {}
                        Ok(r) => traffic.fail(format!(
                            "batch {batch} request {k} to {url}: answered {:?} from {}",
                            r.body, r.remote_ip
                        )),
                        Err(e) => traffic.fail(format!("batch {batch} request {k} to {url}: {e}")),
                    }
                }
            }
            Err(e) => {
                traffic.requests.fetch_add(BATCH as u64, Ordering::Relaxed);
                for _ in 0..BATCH {
                    traffic.fail(format!("batch {batch} to {url}: curl: {e:#}"));
                }
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------

#[test]
fn endpoint_churn_keeps_traffic_memory_and_maps_steady() {
    require_privileged!();
    let settings = Settings::from_env();
    let initial = initial_endpoints(settings.services);
    let mut objects = Vec::with_capacity(settings.services * 2);
    for (i, eps) in initial.iter().enumerate() {
        objects.push(service_object(i));
        objects.push(slice(&name(i), "a", eps));
    }
    let t = Instant::now();
    let mut env = Env::start(objects);
    let frontends = settings.services as u64;
    let status = env
        .agent
        .wait_status(Duration::from_secs(120), |s| s.frontends == frontends)
        .unwrap_or_else(|e| panic!("{e:#}"));
    eprintln!(
        "SOAK setup: {} Services ({} hot), agent synced {} frontends / {} backends in {:?}",
        settings.services,
        HOT.len(),
        status.frontends,
        status.backends,
        t.elapsed()
    );
    let pins = env.pins.path().to_path_buf();
    let want = needed(&initial);
    let baseline = wait_occupancy(&env, &pins, &want, &initial);
    env.check(baseline[MAP_MAGLEV] > 0, || {
        format!("the Maglev Services fill MAGLEV_V1: {baseline:?}")
    });
    eprintln!("SOAK occupancy before churn: {baseline:?}");
    let pid = env.agent.pid().expect("agent pid");
    let rss_start = rss_kib(pid);

    let total = settings.secs * settings.rate;
    let interval = Duration::from_secs(1) / u32::try_from(settings.rate).expect("rate");
    let warm_up = Duration::from_secs((settings.secs / 5).clamp(5, 60));
    let stop = AtomicBool::new(false);
    let traffic = Traffic::default();
    let mut current = initial.clone();
    let mut changed = BTreeSet::new();
    let mut kinds: BTreeMap<&str, u64> = BTreeMap::new();
    let mut rss: Vec<u64> = Vec::new();
    let mut rng = Rng(0x9E37_79B9_7F4A_7C15);
    let churn_started = Instant::now();
    thread::scope(|scope| {
        // Bounded: one batch of BATCH requests takes at least a few ms.
        let max_batches = usize::try_from(settings.secs * 200 + 1_000).expect("batches");
        let (env, stop, traffic) = (&env, &stop, &traffic);
        let runner = scope.spawn(move || run_traffic(env, stop, traffic, max_batches));
        let mut next_sample = churn_started + warm_up;
        for k in 0..total {
            let due = churn_started + interval * u32::try_from(k).expect("change index");
            if let Some(wait) = due.checked_duration_since(Instant::now()) {
                thread::sleep(wait);
            }
            let i = if rng.below(4) == 0 {
                rng.below(HOT.len())
            } else {
                HOT.len() + rng.below(settings.services - HOT.len())
            };
            let kind = churn(i, &mut current[i], &mut rng);
            *kinds.entry(kind).or_default() += 1;
            changed.insert(i);
            env.api
                .apply(slice(&name(i), "a", &current[i]))
                .unwrap_or_else(|e| {
                    env.fail(&format!("applying change {k} to {}: {e:#}", name(i)))
                });
            if Instant::now() >= next_sample {
                rss.push(rss_kib(pid));
                next_sample += Duration::from_secs(1);
            }
        }
        let churn_took = churn_started.elapsed();
        // Restore every changed slice; the traffic keeps running until the agent has synced.
        for &i in &changed {
            env.api
                .apply(slice(&name(i), "a", &initial[i]))
                .unwrap_or_else(|e| env.fail(&format!("restoring {}: {e:#}", name(i))));
        }
        rss.push(rss_kib(pid));
        eprintln!(
            "SOAK churn: {total} endpoint changes ({kinds:?}) to {} Services in {churn_took:?} \
             ({:.1}/s), then {} slices restored",
            changed.len(),
            total as f64 / churn_took.as_secs_f64(),
            changed.len()
        );
        stop.store(true, Ordering::Relaxed);
        runner.join().expect("traffic thread");
    });

    let after = wait_occupancy(&env, &pins, &want, &initial);
    let status = env.agent.status().ok().flatten().unwrap_or_default();
    let requests = traffic.requests.load(Ordering::Relaxed);
    let failures = traffic.failures.load(Ordering::Relaxed);
    let (min, max) = (
        rss.iter().copied().min().unwrap_or(0),
        rss.iter().copied().max().unwrap_or(0),
    );
    let levels = steady_levels(&rss);
    let (level_min, level_max) = (
        levels.iter().copied().min().unwrap_or(0),
        levels.iter().copied().max().unwrap_or(0),
    );
    eprintln!(
        "SOAK traffic: {requests} requests through {} hot ClusterIPs, {failures} failed",
        HOT.len()
    );
    eprintln!(
        "SOAK agent RSS: {:.1} MiB before churn; after a {warm_up:?} warm-up, {} samples: \
         min {:.1} MiB, max {:.1} MiB ({:+.1} %); VmHWM {:.1} MiB; {} syncs",
        rss_start as f64 / 1024.0,
        rss.len(),
        min as f64 / 1024.0,
        max as f64 / 1024.0,
        (max as f64 / min.max(1) as f64 - 1.0) * 100.0,
        status_kib(pid, "VmHWM:") as f64 / 1024.0,
        status.syncs
    );
    // Every 30th sample (about 30 s apart) and the last (right after the restore burst): a
    // plateau and a steady climb look different here, which the min/max above cannot tell.
    let timeline: Vec<String> = (rss.iter().enumerate())
        .filter(|(i, _)| i % 30 == 0 || *i + 1 == rss.len())
        .map(|(_, kib)| format!("{:.1}", *kib as f64 / 1024.0))
        .collect();
    eprintln!(
        "SOAK agent RSS timeline (MiB, every 30 s, last after the restore): {}",
        timeline.join(" ")
    );
    eprintln!(
        "SOAK agent RSS steady level (median of each {} samples, MiB): {} ({:+.1} % highest over \
         lowest)",
        level_window(rss.len()),
        (levels.iter())
            .map(|kib| format!("{:.1}", *kib as f64 / 1024.0))
            .collect::<Vec<_>>()
            .join(" "),
        (level_max as f64 / level_min.max(1) as f64 - 1.0) * 100.0,
    );
    eprintln!("SOAK occupancy after churn: {after:?} (before {baseline:?}, needed {want:?})");
    eprintln!(
        "SOAK datapath counters (non-zero): {}",
        datapath_counters(&env)
    );
    for pod in std::iter::once("client").chain(BACKENDS.iter().map(|(n, _)| *n)) {
        eprintln!(
            "SOAK {pod} TCP counters (non-zero): {}",
            tcp_counters(&env, pod)
        );
    }

    let failed = traffic.failed.lock().expect("failure list").clone();
    env.check(failures == 0 && requests > 0, || {
        format!(
            "{failures} of {requests} requests failed; the first:\n{}",
            failed.join("\n")
        )
    });
    env.check(!levels.is_empty() && level_max * 10 <= level_min * 11, || {
        format!(
            "agent RSS steady level not flat within 10 %: levels (KiB) {levels:?}, samples {rss:?}"
        )
    });
    env.check(max * 4 <= level_min * 5, || {
        format!(
            "an agent RSS sample {max} KiB is more than 25 % above the lowest steady level \
             {level_min} KiB: samples {rss:?}"
        )
    });
    env.check(after == baseline, || {
        format!("map occupancy after churn {after:?} differs from before {baseline:?}")
    });
}

/// Samples per steady-level window: a minute of 1 s samples, or a quarter of a shorter run
/// (at least 5).
fn level_window(samples: usize) -> usize {
    if samples >= 4 * 60 {
        60
    } else {
        (samples / 4).max(5)
    }
}

/// The agent's steady RSS: the median of each window of samples (a last window shorter than
/// half a window joins the one before). A median ignores the few samples that land inside a
/// sync's transient allocations, which a leak does not: it moves every window's median.
fn steady_levels(samples: &[u64]) -> Vec<u64> {
    let window = level_window(samples.len());
    let mut chunks: Vec<&[u64]> = samples.chunks(window).collect();
    if chunks.len() > 1 && chunks.last().is_some_and(|c| c.len() * 2 < window) {
        let n = chunks.len();
        let start = (n - 2) * window;
        chunks.truncate(n - 2);
        chunks.push(&samples[start..]);
    }
    chunks
        .into_iter()
        .map(|chunk| {
            let mut sorted = chunk.to_vec();
            sorted.sort_unstable();
            sorted[sorted.len() / 2]
        })
        .collect()
}

#[test]
fn steady_levels_are_window_medians_that_ignore_spikes_and_follow_a_climb() {
    // 600 samples: a flat 100 with a spike every 30 s: ten levels of 100.
    let spiky: Vec<u64> = (0..600)
        .map(|i| if i % 30 == 0 { 140 } else { 100 })
        .collect();
    assert_eq!(steady_levels(&spiky), vec![100; 10]);
    // A leak climbing 1 per sample shows in the levels.
    let climb: Vec<u64> = (0..600).map(|i| 100 + i).collect();
    let levels = steady_levels(&climb);
    assert_eq!(levels.len(), 10);
    assert!(levels[9] > levels[0] + 500, "{levels:?}");
    // A short run: quarters; a short tail joins the last window.
    assert_eq!(level_window(32), 8);
    assert_eq!(steady_levels(&[1; 34]).len(), 4);
    assert_eq!(steady_levels(&[1; 3]), vec![1]);
    assert!(steady_levels(&[]).is_empty());
}

/// Waits (bounded) until the pinned maps hold what `want` says (the maps it names) and the agent
/// has synced twice more with nothing left to do; returns the full occupancy. Fails with both.
fn wait_occupancy(
    env: &Env,
    pins: &Path,
    want: &Occupancy,
    objects: &[Vec<(Ipv4Addr, Cond)>],
) -> Occupancy {
    let matches = |o: &Occupancy| want.iter().all(|(m, n)| o.get(m) == Some(n));
    let deadline = Instant::now() + Duration::from_secs(120);
    let mut now = occupancy(pins);
    while !matches(&now) {
        if Instant::now() > deadline {
            env.fail(&format!(
                "the pinned maps hold {now:?}; {} Services' objects need {want:?}",
                objects.len()
            ));
        }
        thread::sleep(Duration::from_millis(100));
        now = occupancy(pins);
    }
    // The MAGLEV count has no model: read it again after one more sync (or 5 s without one:
    // the agent syncs only on changes).
    let syncs = env.agent.status().ok().flatten().unwrap_or_default().syncs;
    let deadline = Instant::now() + Duration::from_secs(5);
    while env.agent.status().ok().flatten().unwrap_or_default().syncs < syncs + 1 {
        if Instant::now() > deadline {
            break;
        }
        thread::sleep(Duration::from_millis(50));
    }
    occupancy(pins)
}

/// The datapath's non-zero counters (`dump stats` of the agent's pins), `name=value` joined: what
/// the flows of the run went through (new, established, remapped, dropped and why).
fn datapath_counters(env: &Env) -> String {
    let pins = env.pins.path().to_string_lossy().into_owned();
    match env.agent.cli(&["dump", "stats", "--pin-dir", &pins]) {
        Ok(out) => String::from_utf8_lossy(&out.stdout)
            .lines()
            .skip(1)
            .filter_map(|l| {
                let mut f = l.split_whitespace();
                let (name, value) = (f.next()?, f.next()?);
                (value != "0").then(|| format!("{name}={value}"))
            })
            .collect::<Vec<_>>()
            .join(" "),
        Err(e) => format!("(dump stats failed: {e:#})"),
    }
}

/// A pod's non-zero TCP counters that tell a lost or refused connection attempt (its namespace's
/// `/proc/net/snmp` and `/proc/net/netstat`): SYN retransmits, PAWS and TIME_WAIT rejects, resets.
fn tcp_counters(env: &Env, pod: &str) -> String {
    const WANTED: [&str; 17] = [
        "TcpActiveOpens",
        "TcpPassiveOpens",
        "TcpAttemptFails",
        "TcpEstabResets",
        "TcpRetransSegs",
        "TcpOutRsts",
        "TcpExtTCPSynRetrans",
        "TcpExtPAWSEstab",
        "TcpExtPAWSEstabRejected",
        "TcpExtPAWSTimewait",
        "TcpExtPAWSActive",
        "TcpExtTWKilled",
        "TcpExtTCPACKSkippedTimeWait",
        "TcpExtTW",
        "TcpExtTWRecycled",
        "TcpExtTCPTimeouts",
        "TcpExtListenDrops",
    ];
    let out = env.topo.pod(pod).and_then(|p| {
        p.ns().output(
            &["cat", "/proc/net/snmp", "/proc/net/netstat"],
            std::time::Duration::from_secs(10),
        )
    });
    let text = match out {
        Ok(out) => String::from_utf8_lossy(&out.stdout).into_owned(),
        Err(e) => return format!("(reading /proc/net failed: {e:#})"),
    };
    // Each table is a header line `Prefix: names…` followed by `Prefix: values…`.
    let lines: Vec<&str> = text.lines().collect();
    let mut found = Vec::new();
    for pair in lines.chunks(2) {
        let [names, values] = pair else { continue };
        let (Some((prefix, names)), Some((_, values))) =
            (names.split_once(':'), values.split_once(':'))
        else {
            continue;
        };
        for (name, value) in names.split_whitespace().zip(values.split_whitespace()) {
            let full = format!("{prefix}{name}");
            if WANTED.contains(&full.as_str()) && value != "0" {
                found.push(format!("{full}={value}"));
            }
        }
    }
    found.join(" ")
}
