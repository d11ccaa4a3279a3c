//! `/metrics` on metricsBindAddress: upstream kube-proxy's `kubeproxy_*` metrics (same names and
//! types, so existing dashboards and alerts work) and this proxy's own `kube_proxy_ebpf_*`.
//!
//! - The sync loop reports through [`Metrics::sync_applied`] / [`Metrics::sync_failed`] and
//!   [`Metrics::queued`]; what changed between syncs comes from the translation cache's change
//!   list ([`ChangeList`], itself level-triggered: the sources' events are not needed, so both
//!   sources count alike), accumulated by [`ChangeTracker`] until a sync applies it.
//! - `kubeproxy_sync_proxy_rules_{service,endpoint}_changes_total` count Services and
//!   EndpointSlices added, changed or removed between applied syncs (upstream counts informer
//!   events, which is the same number when every event reaches a sync; slices without the
//!   `kubernetes.io/service-name` label are not counted, as upstream's slice cache skips them
//!   too). An object counts once however often it changed in between. The `_pending` gauges hold
//!   the changes a sync attempt found but could not apply yet; they are 0 after a good sync.
//! - `kubeproxy_network_programming_duration_seconds`: for each changed EndpointSlice carrying
//!   `endpoints.kubernetes.io/last-change-trigger-time` later than the agent's start (upstream
//!   ignores older ones too), the time from that trigger to the end of the sync that applied it.
//! - `kubeproxy_sync_{full,partial}_proxy_rules_duration_seconds` split the syncs by kind, as
//!   upstream's iptables mode does: full = every Service translated and every frontend planned
//!   (the first sync, every syncPeriod, after a failed write or when the incremental planner
//!   declines); partial = only what changed. `kubeproxy_sync_proxy_rules_duration_seconds`
//!   holds both.
//! - `kubeproxy_conntrack_reconciler_{sync_duration_seconds,deleted_entries_total}`: upstream's
//!   conntrack reconciler (stale UDP flows removed after a sync) is our conntrack garbage
//!   collection (every 30 s and after a sync that removed UDP backends): its duration, and the
//!   conntrack entries it removed (idle ones and flows to a gone UDP backend).
//! - The series upstream labels with `ip_family` carry `ip_family="IPv4"`: sync durations (all
//!   three), network programming, last (queued) timestamp, no-local-endpoints and the conntrack
//!   reconciler pair. On a node that programs IPv6 too (`crate::family6`), the IPv6 family adds
//!   `ip_family="IPv6"` series, created when first reported (an IPv4-only node shows none): the
//!   sync durations (its syncs are full ones) and last sync timestamp; network programming of
//!   the IPv6 EndpointSlices (addressType IPv6; the IPv4 series measures the others), observed
//!   when the IPv6 family's sync applied them; its no-local-endpoints; and the conntrack
//!   reconciler over `CONNTRACK6_V1` (one walk covers both families' conntrack maps, so both
//!   families' duration is that walk's; each family counts its own deleted entries).
//! - `/proxyMode` on the metrics port answers `ebpf` (upstream answers its mode, e.g.
//!   `nftables`; no upstream mode describes this datapath, and tools that branch on the answer
//!   should not take it for one of theirs).
//! - Datapath counters are read from the pinned STATS map at scrape time
//!   (`kube_proxy_ebpf_datapath_packets_total{counter=...}`); the `pick_*` ones are also served by
//!   scheduler name as `kube_proxy_ebpf_scheduler_picks_total{scheduler="rr"}`.
//! - The text is Prometheus' text format 0.0.4 (what upstream serves by default); a scraper that
//!   asks for OpenMetrics gets OpenMetrics.

use std::{
    collections::{HashMap, HashSet},
    fmt,
    sync::{Arc, Mutex, atomic::AtomicU64},
    time::{Duration, SystemTime},
};

use hyper::{StatusCode, header};
use prometheus_client::{
    collector::Collector,
    encoding::{DescriptorEncoder, EncodeMetric},
    metrics::{
        MetricType, TypedMetric,
        counter::{ConstCounter, Counter},
        family::{Family, MetricConstructor},
        gauge::Gauge,
        histogram::{Histogram, exponential_buckets},
    },
    registry::Registry,
};
use proxy_common::{Scheduler, stats::PICK_COUNTERS};
use tokio::net::TcpListener;
use tracing::debug;

use crate::{
    dataplane::{bpffs::PinLayout, maps::Stats},
    pipeline::{
        model::{
            DesiredFrontend, DesiredState, Frontend, FrontendConflict, FrontendKind, Scope,
            ServicePortName,
        },
        translate_cache::{ChangeList, FrontendChange, ServiceName, SliceName},
    },
    serving::http,
};

/// What `/proxyMode` answers.
pub const PROXY_MODE: &str = "ebpf";
/// The `ip_family` label value of the IPv4 family's series (the IPv6 family's are made when it
/// first reports, see the module doc).
pub const IP_FAMILY: &str = "IPv4";

type Labels = Vec<(&'static str, String)>;

fn ipv4() -> Labels {
    vec![("ip_family", IP_FAMILY.to_owned())]
}

/// Registers `family` and returns its `ip_family="IPv4"` series (a handle on the same metric).
fn ipv4_series<M, C>(r: &mut Registry, name: &str, help: &str, family: Family<Labels, M, C>) -> M
where
    M: EncodeMetric + TypedMetric + Clone + fmt::Debug + Send + Sync + 'static,
    C: MetricConstructor<M> + Clone + fmt::Debug + Send + Sync + 'static,
{
    family_series(r, name, help, family).0
}

/// [`ipv4_series`], and the family itself (for the `ip_family="IPv6"` series, made when first
/// used).
fn family_series<M, C>(
    r: &mut Registry,
    name: &str,
    help: &str,
    family: Family<Labels, M, C>,
) -> (M, Family<Labels, M, C>)
where
    M: EncodeMetric + TypedMetric + Clone + fmt::Debug + Send + Sync + 'static,
    C: MetricConstructor<M> + Clone + fmt::Debug + Send + Sync + 'static,
{
    let series = family.get_or_create(&ipv4()).clone();
    r.register(name, help, family.clone());
    (series, family)
}

fn ipv6() -> Labels {
    vec![("ip_family", "IPv6".to_owned())]
}

/// The families whose `ip_family="IPv6"` series the IPv6 family fills.
struct Ipv6Syncs {
    duration: HistogramFamily,
    full_duration: HistogramFamily,
    last_sync: Family<Labels, Gauge<f64, AtomicU64>>,
    network_programming: HistogramFamily,
    conntrack_reconciler_duration: HistogramFamily,
    conntrack_reconciler_deleted: Family<Labels, Counter>,
}

/// Which kind of sync was applied (see the module doc).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SyncKind {
    /// Every Service translated, every frontend planned.
    Full,
    /// Only the changed Services and frontends.
    Partial,
}

fn sync_histogram() -> Histogram {
    // Our syncs take micro- to milliseconds: 100 µs .. 52 s (upstream: 1 ms .. 16 s).
    Histogram::new(exponential_buckets(0.0001, 2.0, 20))
}

fn network_programming_histogram() -> Histogram {
    // Upstream's buckets (0.25 s .. 5 min), with finer ones below 0.25 s in front.
    let buckets = [0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1]
        .into_iter()
        .chain([0.25, 0.5])
        .chain((1..=59).map(f64::from))
        .chain((0..12).map(|i| 60.0 + 5.0 * f64::from(i)))
        .chain((0..7).map(|i| 120.0 + 30.0 * f64::from(i)));
    Histogram::new(buckets)
}

fn conntrack_reconciler_histogram() -> Histogram {
    // A sweep of the conntrack map: 100 µs .. 52 s.
    Histogram::new(exponential_buckets(0.0001, 2.0, 20))
}

type HistogramFamily = Family<Labels, Histogram, fn() -> Histogram>;

/// Reads the datapath counters (summed over CPUs, indexed like `proxy_common::Counter::ALL`);
/// `None` when the map cannot be read (then the family is left out of the scrape).
pub type DatapathReader = Box<dyn Fn() -> Option<Vec<u64>> + Send + Sync>;

/// Every metric this proxy exports.
pub struct Metrics {
    registry: Registry,
    sync_duration: Histogram,
    sync_full_duration: Histogram,
    sync_partial_duration: Histogram,
    conntrack_reconciler_duration: Histogram,
    conntrack_reconciler_deleted: Counter,
    network_programming: Histogram,
    last_sync: Gauge<f64, AtomicU64>,
    last_queued: Gauge<f64, AtomicU64>,
    endpoint_changes: Counter,
    endpoint_changes_pending: Gauge,
    service_changes: Counter,
    service_changes_pending: Gauge,
    no_local_endpoints: Family<Labels, Gauge>,
    healthz: Family<Labels, Counter>,
    livez: Family<Labels, Counter>,
    map_entries: Family<Labels, Gauge>,
    map_capacity: Family<Labels, Gauge>,
    sync_problems: Gauge,
    frontend_conflicts: Family<Labels, Gauge>,
    ipv6_syncs: Ipv6Syncs,
}

impl fmt::Debug for Metrics {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Metrics").finish_non_exhaustive()
    }
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

struct DatapathCollector(DatapathReader);

impl fmt::Debug for DatapathCollector {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("DatapathCollector")
    }
}

impl Collector for DatapathCollector {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), fmt::Error> {
        let Some(values) = (self.0)() else {
            return Ok(());
        };
        let mut family = encoder.encode_descriptor(
            "kube_proxy_ebpf_datapath_packets",
            "Packets counted by the eBPF programs, by counter (drop reasons start with drop_), summed over CPUs.",
            None,
            MetricType::Counter,
        )?;
        for (counter, value) in proxy_common::Counter::ALL
            .iter()
            .zip(values.iter().copied())
        {
            let labels = [("counter", counter.name())];
            ConstCounter::new(value).encode(family.encode_family(&labels)?)?;
        }
        // The same `pick_*` counters by scheduler name (what a dashboard groups by).
        let mut picks = encoder.encode_descriptor(
            "kube_proxy_ebpf_scheduler_picks",
            "New flows whose backend the frontend's scheduler chose (tc and socket hooks), by scheduler, summed over CPUs.",
            None,
            MetricType::Counter,
        )?;
        for (scheduler, counter) in Scheduler::ALL.iter().zip(PICK_COUNTERS) {
            let Some(value) = values.get(counter as usize).copied() else {
                continue;
            };
            let labels = [("scheduler", scheduler.name())];
            ConstCounter::new(value).encode(picks.encode_family(&labels)?)?;
        }
        Ok(())
    }
}

fn seconds_since_epoch(t: SystemTime) -> f64 {
    t.duration_since(SystemTime::UNIX_EPOCH)
        .unwrap_or_default()
        .as_secs_f64()
}

impl Metrics {
    /// Metrics without datapath counters (tests, `dump`).
    pub fn new() -> Self {
        Self::build(None)
    }

    /// Metrics whose scrape also reads the datapath counters through `reader`.
    pub fn with_datapath(reader: DatapathReader) -> Self {
        Self::build(Some(reader))
    }

    fn build(datapath: Option<DatapathReader>) -> Self {
        let mut r = Registry::default();
        let histograms = |make: fn() -> Histogram| HistogramFamily::new_with_constructor(make);
        let (sync_duration, duration6) = family_series(
            &mut r,
            "kubeproxy_sync_proxy_rules_duration_seconds",
            "SyncProxyRules latency in seconds (translate, plan and map update; full and partial syncs)",
            histograms(sync_histogram),
        );
        let (sync_full_duration, full_duration6) = family_series(
            &mut r,
            "kubeproxy_sync_full_proxy_rules_duration_seconds",
            "SyncProxyRules latency in seconds for full resyncs",
            histograms(sync_histogram),
        );
        let sync_partial_duration = ipv4_series(
            &mut r,
            "kubeproxy_sync_partial_proxy_rules_duration_seconds",
            "SyncProxyRules latency in seconds for partial resyncs",
            histograms(sync_histogram),
        );
        let (conntrack_reconciler_duration, reconciler_duration6) = family_series(
            &mut r,
            "kubeproxy_conntrack_reconciler_sync_duration_seconds",
            "ReconcileConntrackFlowsLatency latency in seconds (one conntrack garbage collection)",
            histograms(conntrack_reconciler_histogram),
        );
        let (conntrack_reconciler_deleted, reconciler_deleted6) = family_series(
            &mut r,
            "kubeproxy_conntrack_reconciler_deleted_entries",
            "Cumulative conntrack flows deleted by conntrack reconciler (garbage collection)",
            Family::<Labels, Counter>::default(),
        );
        let (network_programming, network_programming6) = family_series(
            &mut r,
            "kubeproxy_network_programming_duration_seconds",
            "In Cluster Network Programming Latency in seconds (EndpointSlice trigger time to the sync that applied it)",
            histograms(network_programming_histogram),
        );
        let (last_sync, last_sync6) = family_series(
            &mut r,
            "kubeproxy_sync_proxy_rules_last_timestamp_seconds",
            "The last time proxy rules were successfully synced",
            Family::<Labels, Gauge<f64, AtomicU64>>::default(),
        );
        let last_queued = ipv4_series(
            &mut r,
            "kubeproxy_sync_proxy_rules_last_queued_timestamp_seconds",
            "The last time a sync of proxy rules was queued",
            Family::<Labels, Gauge<f64, AtomicU64>>::default(),
        );
        let endpoint_changes = Counter::default();
        r.register(
            "kubeproxy_sync_proxy_rules_endpoint_changes",
            "Cumulative proxy rules EndpointSlice changes",
            endpoint_changes.clone(),
        );
        let endpoint_changes_pending = Gauge::default();
        r.register(
            "kubeproxy_sync_proxy_rules_endpoint_changes_pending",
            "Pending proxy rules EndpointSlice changes",
            endpoint_changes_pending.clone(),
        );
        let service_changes = Counter::default();
        r.register(
            "kubeproxy_sync_proxy_rules_service_changes",
            "Cumulative proxy rules Service changes",
            service_changes.clone(),
        );
        let service_changes_pending = Gauge::default();
        r.register(
            "kubeproxy_sync_proxy_rules_service_changes_pending",
            "Pending proxy rules Service changes",
            service_changes_pending.clone(),
        );
        let no_local_endpoints = Family::<Labels, Gauge>::default();
        r.register(
            "kubeproxy_sync_proxy_rules_no_local_endpoints_total",
            "Number of services with a Local traffic policy and no endpoints",
            no_local_endpoints.clone(),
        );
        let healthz = Family::<Labels, Counter>::default();
        r.register(
            "kubeproxy_proxy_healthz",
            "Cumulative proxy healthz HTTP status",
            healthz.clone(),
        );
        let livez = Family::<Labels, Counter>::default();
        r.register(
            "kubeproxy_proxy_livez",
            "Cumulative proxy livez HTTP status",
            livez.clone(),
        );
        let map_entries = Family::<Labels, Gauge>::default();
        r.register(
            "kube_proxy_ebpf_map_entries",
            "Entries in each BPF map (conntrack, snat: as of the last garbage collection)",
            map_entries.clone(),
        );
        let map_capacity = Family::<Labels, Gauge>::default();
        r.register(
            "kube_proxy_ebpf_map_capacity",
            "Maximum entries of each BPF map",
            map_capacity.clone(),
        );
        let sync_problems = Gauge::default();
        r.register(
            "kube_proxy_ebpf_sync_problems",
            "Objects (or parts of them) the last sync skipped: invalid input or maps full",
            sync_problems.clone(),
        );
        let frontend_conflicts = Family::<Labels, Gauge>::default();
        r.register(
            "kube_proxy_ebpf_frontend_conflicts",
            "Frontends not programmed for a Service because another Service holds them, by the \
             kind of the skipped frontend",
            frontend_conflicts.clone(),
        );
        for kind in FrontendKind::ALL {
            frontend_conflicts
                .get_or_create(&vec![("kind", kind.label().to_owned())])
                .set(0);
        }
        if let Some(reader) = datapath {
            r.register_collector(Box::new(DatapathCollector(reader)));
        }
        for policy in ["internal", "external"] {
            no_local_endpoints
                .get_or_create(&no_local_labels(policy))
                .set(0);
        }
        Self {
            registry: r,
            sync_duration,
            sync_full_duration,
            sync_partial_duration,
            conntrack_reconciler_duration,
            conntrack_reconciler_deleted,
            network_programming,
            last_sync,
            last_queued,
            endpoint_changes,
            endpoint_changes_pending,
            service_changes,
            service_changes_pending,
            no_local_endpoints,
            healthz,
            livez,
            map_entries,
            map_capacity,
            sync_problems,
            frontend_conflicts,
            ipv6_syncs: Ipv6Syncs {
                duration: duration6,
                full_duration: full_duration6,
                last_sync: last_sync6,
                network_programming: network_programming6,
                conntrack_reconciler_duration: reconciler_duration6,
                conntrack_reconciler_deleted: reconciler_deleted6,
            },
        }
    }

    /// A change is waiting for a sync.
    pub fn queued(&self, now: SystemTime) {
        self.last_queued.set(seconds_since_epoch(now));
    }

    /// A sync found `changes` but could not apply them (they stay pending).
    pub fn sync_failed(&self, changes: &Changes) {
        self.service_changes_pending.set(gauge(changes.services));
        self.endpoint_changes_pending
            .set(gauge(changes.endpoint_slices));
    }

    /// The IPv6 family's part of a sync (always a full one) took `took`, finishing at `now`.
    pub fn ipv6_sync_applied(&self, took: Duration, now: SystemTime) {
        let s = &self.ipv6_syncs;
        s.duration
            .get_or_create(&ipv6())
            .observe(took.as_secs_f64());
        s.full_duration
            .get_or_create(&ipv6())
            .observe(took.as_secs_f64());
        s.last_sync
            .get_or_create(&ipv6())
            .set(seconds_since_epoch(now));
    }

    /// A sync of `kind` took `took` and applied `changes`, finishing at `now`.
    pub fn sync_applied(&self, took: Duration, kind: SyncKind, changes: &Changes, now: SystemTime) {
        self.sync_duration.observe(took.as_secs_f64());
        match kind {
            SyncKind::Full => &self.sync_full_duration,
            SyncKind::Partial => &self.sync_partial_duration,
        }
        .observe(took.as_secs_f64());
        self.last_sync.set(seconds_since_epoch(now));
        self.service_changes.inc_by(changes.services);
        self.endpoint_changes.inc_by(changes.endpoint_slices);
        self.service_changes_pending.set(0);
        self.endpoint_changes_pending.set(0);
        self.observe_network_programming(&changes.trigger_times, now);
    }

    /// Records, for each EndpointSlice trigger time, its latency to `applied_at` (the end of the
    /// sync that carried it). For sources that know their own trigger times.
    pub fn observe_network_programming(
        &self,
        trigger_times: &[SystemTime],
        applied_at: SystemTime,
    ) {
        for t in trigger_times {
            if let Ok(d) = applied_at.duration_since(*t) {
                self.network_programming.observe(d.as_secs_f64());
            }
        }
    }

    /// The IPv6 family's sync that applied IPv6 EndpointSlices with these trigger times
    /// finished at `applied_at` (as [`Metrics::observe_network_programming`], `ip_family="IPv6"`).
    pub fn observe_network_programming6(
        &self,
        trigger_times: &[SystemTime],
        applied_at: SystemTime,
    ) {
        let series = || self.ipv6_syncs.network_programming.get_or_create(&ipv6());
        for t in trigger_times {
            if let Ok(d) = applied_at.duration_since(*t) {
                series().observe(d.as_secs_f64());
            }
        }
    }

    /// Service ports with a Local traffic policy, endpoints elsewhere and none on this node.
    pub fn set_no_local_endpoints(&self, internal: u64, external: u64) {
        self.set_no_local(IP_FAMILY, internal, external);
    }

    /// The same for the IPv6 family's Service ports (`ip_family="IPv6"`).
    pub fn set_no_local_endpoints6(&self, internal: u64, external: u64) {
        self.set_no_local("IPv6", internal, external);
    }

    fn set_no_local(&self, family: &str, internal: u64, external: u64) {
        for (policy, n) in [("internal", internal), ("external", external)] {
            self.no_local_endpoints
                .get_or_create(&family_no_local_labels(family, policy))
                .set(gauge(n));
        }
    }

    /// A conntrack garbage collection (upstream's conntrack reconciler) took `took` and removed
    /// `deleted` entries.
    pub fn conntrack_reconciled(&self, took: Duration, deleted: u64) {
        self.conntrack_reconciler_duration
            .observe(took.as_secs_f64());
        self.conntrack_reconciler_deleted.inc_by(deleted);
    }

    /// The same walk over `CONNTRACK6_V1` removed `deleted` IPv6 entries (`ip_family="IPv6"`).
    pub fn conntrack_reconciled6(&self, took: Duration, deleted: u64) {
        let s = &self.ipv6_syncs;
        (s.conntrack_reconciler_duration.get_or_create(&ipv6())).observe(took.as_secs_f64());
        (s.conntrack_reconciler_deleted.get_or_create(&ipv6())).inc_by(deleted);
    }

    pub fn set_map(&self, map: &str, entries: u64, capacity: u64) {
        let labels = vec![("map", map.to_owned())];
        self.map_entries.get_or_create(&labels).set(gauge(entries));
        self.map_capacity
            .get_or_create(&labels)
            .set(gauge(capacity));
    }

    pub fn set_map_entries(&self, map: &str, entries: u64) {
        self.map_entries
            .get_or_create(&vec![("map", map.to_owned())])
            .set(gauge(entries));
    }

    pub fn set_sync_problems(&self, n: usize) {
        self.sync_problems.set(gauge(n as u64));
    }

    /// The last sync's frontend conflicts (each is one skipped frontend of the losing Service).
    pub fn set_frontend_conflicts(&self, conflicts: &[FrontendConflict]) {
        for kind in FrontendKind::ALL {
            let n = conflicts.iter().filter(|c| c.loser_kind == kind).count();
            self.frontend_conflicts
                .get_or_create(&vec![("kind", kind.label().to_owned())])
                .set(gauge(n as u64));
        }
    }

    pub fn healthz_answered(&self, code: u16) {
        self.healthz
            .get_or_create(&vec![("code", code.to_string())])
            .inc();
    }

    pub fn livez_answered(&self, code: u16) {
        self.livez
            .get_or_create(&vec![("code", code.to_string())])
            .inc();
    }

    /// Prometheus text format 0.0.4.
    pub fn encode_text(&self) -> String {
        let mut out = String::new();
        // Writing to a String cannot fail.
        let _ = prometheus_client::encoding::prometheus_text::encode(&mut out, &self.registry);
        out
    }

    /// OpenMetrics text.
    pub fn encode_openmetrics(&self) -> String {
        let mut out = String::new();
        let _ = prometheus_client::encoding::text::encode(&mut out, &self.registry);
        out
    }
}

/// Reads the datapath counters from the pinned STATS map at scrape time (opened on first use,
/// reopened after an error, e.g. when `cleanup` removed the pins).
pub fn pinned_stats_reader(pins: PinLayout) -> DatapathReader {
    let stats: Mutex<Option<Stats>> = Mutex::new(None);
    Box::new(move || {
        let mut guard = stats.lock().unwrap_or_else(|e| e.into_inner());
        if guard.is_none() {
            match Stats::open_pinned(&pins) {
                Ok(s) => *guard = Some(s),
                Err(e) => {
                    debug!("datapath counters unavailable: {e}");
                    return None;
                }
            }
        }
        match guard.as_ref()?.read() {
            Ok(v) => Some(v),
            Err(e) => {
                debug!("reading datapath counters: {e}");
                *guard = None;
                None
            }
        }
    })
}

fn no_local_labels(policy: &str) -> Labels {
    family_no_local_labels(IP_FAMILY, policy)
}

fn family_no_local_labels(family: &str, policy: &str) -> Labels {
    vec![
        ("ip_family", family.to_owned()),
        ("traffic_policy", policy.to_owned()),
    ]
}

fn gauge(n: u64) -> i64 {
    i64::try_from(n).unwrap_or(i64::MAX)
}

/// Serves `/metrics` on `listener` until the task is dropped.
pub async fn serve_metrics(listener: TcpListener, metrics: Arc<Metrics>) {
    http::serve(listener, move |req| {
        match req.uri().path() {
            "/metrics" => {}
            "/proxyMode" => {
                return http::reply(
                    StatusCode::OK,
                    "text/plain; charset=utf-8",
                    PROXY_MODE.into(),
                );
            }
            _ => {
                return http::reply(
                    StatusCode::NOT_FOUND,
                    "text/plain",
                    "404 page not found\n".into(),
                );
            }
        }
        let openmetrics = req
            .headers()
            .get(header::ACCEPT)
            .and_then(|v| v.to_str().ok())
            .is_some_and(|v| v.contains("application/openmetrics-text"));
        if openmetrics {
            http::reply(
                StatusCode::OK,
                "application/openmetrics-text; version=1.0.0; charset=utf-8",
                metrics.encode_openmetrics(),
            )
        } else {
            http::reply(
                StatusCode::OK,
                prometheus_client::encoding::prometheus_text::CONTENT_TYPE,
                metrics.encode_text(),
            )
        }
    })
    .await;
}

/// What changed since the last applied sync (see [`ChangeTracker`]).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Changes {
    /// Services added, changed or removed.
    pub services: u64,
    /// EndpointSlices added, changed or removed.
    pub endpoint_slices: u64,
    /// Trigger times of the changed (not removed) slices, newer than the tracker's start: of the
    /// IPv4 family's (and FQDN) slices, and of the IPv6 ones (addressType IPv6).
    pub trigger_times: Vec<SystemTime>,
    pub trigger_times6: Vec<SystemTime>,
}

/// The Service and EndpointSlice changes of the syncs since the last applied one, from the
/// translation cache's change list ([`ChangeList`]): each object counts once however many
/// times it changed in between (a failed sync's changes stay pending). Costs what changed.
#[derive(Debug)]
pub struct ChangeTracker {
    started: SystemTime,
    services: HashSet<ServiceName>,
    /// Each changed slice with the trigger time of its latest version (`None`: removed), and
    /// whether it is an IPv6 slice.
    slices: HashMap<SliceName, (Option<SystemTime>, bool)>,
}

impl ChangeTracker {
    /// `started`: trigger times before this are not measured (they predate this agent).
    pub fn new(started: SystemTime) -> Self {
        Self {
            started,
            services: HashSet::new(),
            slices: HashMap::new(),
        }
    }

    /// One update's changes (applied or not yet), every slice taken as the IPv4 family's.
    pub fn add(&mut self, list: &ChangeList) {
        self.add_classified(list, |_| false);
    }

    /// [`ChangeTracker::add`], `is_ipv6` telling the IPv6 slices (addressType IPv6) apart (only
    /// asked about slices with a trigger time).
    pub fn add_classified(&mut self, list: &ChangeList, is_ipv6: impl Fn(&SliceName) -> bool) {
        self.services.extend(list.services.iter().cloned());
        for (slice, trigger) in &list.slices {
            let ipv6 = trigger.is_some() && is_ipv6(slice);
            self.slices.insert(slice.clone(), (*trigger, ipv6));
        }
    }

    /// What changed since the last commit.
    pub fn pending(&self) -> Changes {
        let times = |ipv6: bool| {
            let mut v: Vec<SystemTime> = (self.slices.values())
                .filter(|(_, six)| *six == ipv6)
                .filter_map(|(t, _)| *t)
                .filter(|t| *t > self.started)
                .collect();
            v.sort();
            v
        };
        Changes {
            services: self.services.len() as u64,
            endpoint_slices: self.slices.len() as u64,
            trigger_times: times(false),
            trigger_times6: times(true),
        }
    }

    /// The sync that carried the pending changes succeeded.
    pub fn commit(&mut self) {
        self.services.clear();
        self.slices.clear();
    }
}

/// Whether a frontend counts for `no_local_endpoints`, and for which policy (0 internal, 1
/// external).
fn no_local_policy<A: crate::pipeline::model::Family>(
    fe: &Frontend<A>,
    df: &DesiredFrontend<A>,
) -> Option<usize> {
    (df.drop_when_empty && fe.scope == Scope::AllClients)
        .then(|| usize::from(df.kind.is_external()))
}

/// [`no_local_endpoints`] kept up to date by the changed frontends: per Service port and
/// policy, how many of its frontends count.
#[derive(Debug, Default)]
pub struct NoLocalEndpoints {
    ports: HashMap<ServicePortName, [u32; 2]>,
    counts: [u64; 2],
}

impl NoLocalEndpoints {
    /// The frontends of one update changed (`desired`: their new values).
    pub fn update<A: crate::pipeline::model::Family>(
        &mut self,
        changes: &[FrontendChange<A>],
        desired: &DesiredState<A>,
    ) {
        for c in changes {
            if let Some(old) = &c.old {
                self.count(&c.frontend, old, false);
            }
            if let Some(new) = desired.frontends.get(&c.frontend) {
                self.count(&c.frontend, new, true);
            }
        }
    }

    /// Counted again from the whole desired state (full syncs).
    pub fn rebuild<A: crate::pipeline::model::Family>(&mut self, desired: &DesiredState<A>) {
        *self = Self::default();
        for (fe, df) in &desired.frontends {
            self.count(fe, df, true);
        }
    }

    fn count<A: crate::pipeline::model::Family>(
        &mut self,
        fe: &Frontend<A>,
        df: &DesiredFrontend<A>,
        add: bool,
    ) {
        let Some(policy) = no_local_policy(fe, df) else {
            return;
        };
        if add {
            let n = self.ports.entry(df.service.clone()).or_default();
            n[policy] += 1;
            if n[policy] == 1 {
                self.counts[policy] += 1;
            }
        } else if let Some(n) = self.ports.get_mut(&df.service) {
            n[policy] = n[policy].saturating_sub(1);
            if n[policy] == 0 {
                self.counts[policy] = self.counts[policy].saturating_sub(1);
            }
            if *n == [0, 0] {
                self.ports.remove(&df.service);
            }
        }
    }

    /// (internal, external), as [`no_local_endpoints`].
    pub fn counts(&self) -> (u64, u64) {
        (self.counts[0], self.counts[1])
    }
}

/// Upstream's `sync_proxy_rules_no_local_endpoints_total{traffic_policy}`: Service ports with a
/// Local traffic policy that have usable endpoints somewhere but none this node can use, so
/// their frontends drop new flows (`drop_when_empty`). `internal`: iTP=Local, seen on the
/// ClusterIP frontends; `external`: eTP=Local, seen on the NodePort/externalIP/LoadBalancer
/// frontends. Each Service port counts once per policy however many addresses it has.
pub fn no_local_endpoints<A: crate::pipeline::model::Family>(
    desired: &DesiredState<A>,
) -> (u64, u64) {
    let mut ports = [HashSet::new(), HashSet::new()];
    for (fe, df) in &desired.frontends {
        if let Some(policy) = no_local_policy(fe, df) {
            ports[policy].insert(&df.service);
        }
    }
    (ports[0].len() as u64, ports[1].len() as u64)
}

#[cfg(test)]
mod tests {
    use k8s_openapi::api::core::v1::Service;
    use serde_json::json;

    use super::*;
    use crate::{
        pipeline::{
            translate::{self, NodeContext},
            translate_cache::TranslateCache,
        },
        serving::http::test_http::get as http_get,
        sources::{
            endpoints::SliceData,
            object_version::{ANNOTATION_TRIGGER_TIME, system_time},
            snapshot::Snapshot,
        },
    };

    fn service(name: &str, ip: &str, itp: Option<&str>, rv: Option<&str>) -> Service {
        serde_json::from_value(json!({
            "metadata": {"namespace": "default", "name": name, "resourceVersion": rv},
            "spec": {"clusterIP": ip, "internalTrafficPolicy": itp,
                     "ports": [{"name": "http", "port": 80, "protocol": "TCP", "targetPort": 8080}]}
        }))
        .expect("service")
    }

    fn slice(
        name: &str,
        svc: &str,
        node: &str,
        trigger: Option<&str>,
    ) -> k8s_openapi::api::discovery::v1::EndpointSlice {
        serde_json::from_value(json!({
            "metadata": {"namespace": "default", "name": name,
                         "labels": {"kubernetes.io/service-name": svc},
                         "annotations": trigger.map(|t| json!({ANNOTATION_TRIGGER_TIME: t}))},
            "addressType": "IPv4",
            "endpoints": [{"addresses": ["10.244.1.5"], "nodeName": node,
                           "conditions": {"ready": true}}],
            "ports": [{"name": "http", "port": 8080, "protocol": "TCP"}]
        }))
        .expect("slice")
    }

    fn at(rfc3339: &str) -> SystemTime {
        system_time(rfc3339.parse().expect("timestamp")).expect("after 1970")
    }

    /// One sync's worth: the cache brought up to `snap`, its change list into the tracker.
    fn sync(cache: &mut TranslateCache, t: &mut ChangeTracker, snap: &Snapshot) {
        cache.update(snap, &NodeContext::default(), &[], false);
        t.add(cache.last_changes());
    }

    #[test]
    fn changes_are_counted_between_applied_syncs() {
        let start = at("2025-01-01T00:00:00Z");
        let mut t = ChangeTracker::new(start);
        let mut cache = TranslateCache::new();
        let mut snap = Snapshot::new(
            vec![
                service("a", "10.96.0.1", None, None),
                service("b", "10.96.0.2", None, Some("7")),
            ],
            vec![
                slice("a-1", "a", "n1", Some("2024-12-31T23:00:00Z")),
                slice("b-1", "b", "n1", Some("2025-01-01T00:00:01Z")),
            ],
        );
        sync(&mut cache, &mut t, &snap);
        let c = t.pending();
        assert_eq!(
            (c.services, c.endpoint_slices),
            (2, 2),
            "first sync: all new"
        );
        assert_eq!(c.trigger_times.len(), 1, "a-1's trigger predates the start");
        // Not committed (the sync failed): the same changes are still pending, counted once.
        sync(&mut cache, &mut t, &snap);
        let c = t.pending();
        assert_eq!((c.services, c.endpoint_slices), (2, 2));
        t.commit();
        sync(&mut cache, &mut t, &snap);
        let c = t.pending();
        assert_eq!(
            (c.services, c.endpoint_slices, c.trigger_times.len()),
            (0, 0, 0),
            "nothing changed since the commit"
        );
        // b bumps its resourceVersion, a-1 changes content, b-1 is removed.
        Arc::make_mut(&mut snap.services)[1] =
            Arc::new(service("b", "10.96.0.2", None, Some("8")).into());
        Arc::make_mut(&mut snap.endpoint_slices)[0] = Arc::new(SliceData::from(&slice(
            "a-1",
            "a",
            "n2",
            Some("2025-01-01T00:00:05Z"),
        )));
        Arc::make_mut(&mut snap.endpoint_slices).pop();
        sync(&mut cache, &mut t, &snap);
        let c = t.pending();
        assert_eq!((c.services, c.endpoint_slices), (1, 2));
        assert_eq!(c.trigger_times, vec![at("2025-01-01T00:00:05Z")]);
        // The same Arcs again (a Kubernetes store's unchanged objects): nothing new.
        t.commit();
        sync(&mut cache, &mut t, &snap);
        assert_eq!(t.pending(), Changes::default());
        // A manifest reload parses every object anew: equal objects are no change.
        let reparsed = Snapshot {
            services: Arc::new(
                (snap.services.iter())
                    .map(|s| Arc::new((**s).clone()))
                    .collect(),
            ),
            endpoint_slices: Arc::new(
                (snap.endpoint_slices.iter())
                    .map(|s| Arc::new((**s).clone()))
                    .collect(),
            ),
        };
        sync(&mut cache, &mut t, &reparsed);
        assert_eq!(t.pending(), Changes::default());
    }

    /// An externalTrafficPolicy Local NodePort Service (ClusterIP `ip`, nodePort `np`).
    fn etp_local(name: &str, ip: &str, np: i32) -> Service {
        serde_json::from_value(json!({
            "metadata": {"namespace": "default", "name": name},
            "spec": {"type": "NodePort", "clusterIP": ip, "externalTrafficPolicy": "Local",
                     "ports": [{"name": "http", "port": 80, "protocol": "TCP",
                                "targetPort": 8080, "nodePort": np}]}
        }))
        .expect("service")
    }

    #[test]
    fn no_local_endpoints_counts_local_policy_ports_served_elsewhere() {
        let snap = Snapshot::new(
            vec![
                service("local-elsewhere", "10.96.0.1", Some("Local"), None),
                service("local-here", "10.96.0.2", Some("Local"), None),
                service("local-none", "10.96.0.3", Some("Local"), None),
                service("cluster", "10.96.0.4", None, None),
                etp_local("ext-elsewhere", "10.96.0.5", 30001),
                etp_local("ext-elsewhere-2", "10.96.0.6", 30002),
                etp_local("ext-here", "10.96.0.7", 30003),
                etp_local("ext-none", "10.96.0.8", 30004),
            ],
            vec![
                slice("e-1", "local-elsewhere", "other", None),
                slice("h-1", "local-here", "me", None),
                slice("c-1", "cluster", "other", None),
                slice("x-1", "ext-elsewhere", "other", None),
                slice("x-2", "ext-elsewhere-2", "other", None),
                slice("x-3", "ext-here", "me", None),
            ],
        );
        let node = NodeContext {
            scheduler: Default::default(),
            node_name: "me".into(),
            zone: None,
        };
        // Two node addresses: a Service port counts once, not once per NodePort frontend.
        let addrs = [
            std::net::Ipv4Addr::new(192, 168, 50, 10),
            std::net::Ipv4Addr::new(10, 0, 0, 5),
        ];
        let desired = translate::translate_for_node(&snap, &node, &addrs).desired;
        assert_eq!(no_local_endpoints(&desired), (1, 2));
    }

    /// Value of the sample line `name{labels}` (exact match of the part before the value).
    fn sample(text: &str, series: &str) -> Option<f64> {
        text.lines()
            .filter(|l| !l.starts_with('#'))
            .find_map(|l| l.rsplit_once(' ').filter(|(s, _)| *s == series))
            .and_then(|(_, v)| v.parse().ok())
    }

    #[tokio::test]
    async fn scrape_over_tcp_on_loopback() {
        let counters = proxy_common::Counter::ALL.len();
        let metrics = Arc::new(Metrics::with_datapath(Box::new(move || {
            Some((0..counters as u64).map(|i| i * 10).collect())
        })));
        let now = at("2025-06-01T12:00:00Z");
        metrics.queued(now - Duration::from_millis(300));
        let changes = Changes {
            services: 3,
            endpoint_slices: 5,
            trigger_times: vec![now - Duration::from_millis(40)],
            trigger_times6: Vec::new(),
        };
        metrics.sync_failed(&changes);
        let pending = metrics.encode_text();
        assert_eq!(
            sample(
                &pending,
                "kubeproxy_sync_proxy_rules_endpoint_changes_pending"
            ),
            Some(5.0)
        );
        metrics.sync_applied(Duration::from_micros(700), SyncKind::Full, &changes, now);
        metrics.sync_applied(
            Duration::from_micros(150),
            SyncKind::Partial,
            &Changes::default(),
            now,
        );
        metrics.sync_applied(
            Duration::from_micros(160),
            SyncKind::Partial,
            &Changes::default(),
            now,
        );
        metrics.conntrack_reconciled(Duration::from_micros(300), 7);
        metrics.conntrack_reconciled(Duration::from_micros(200), 0);
        metrics.set_no_local_endpoints(2, 3);
        metrics.set_map("services", 12, 262_144);
        metrics.set_sync_problems(1);
        metrics.healthz_answered(200);
        metrics.livez_answered(503);

        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("addr");
        let server = tokio::spawn(serve_metrics(listener, metrics.clone()));
        let (code, head, text) = http_get(addr, "/metrics", "*/*").await;
        assert_eq!(code, 200, "{head}");
        assert!(head.contains("text/plain; version=0.0.4"), "{head}");
        let expect = [
            (
                "kubeproxy_sync_proxy_rules_duration_seconds_count{ip_family=\"IPv4\"}",
                3.0,
            ),
            (
                "kubeproxy_sync_proxy_rules_duration_seconds_bucket{ip_family=\"IPv4\",le=\"0.0008\"}",
                3.0,
            ),
            (
                "kubeproxy_sync_proxy_rules_duration_seconds_bucket{ip_family=\"IPv4\",le=\"0.0004\"}",
                2.0,
            ),
            (
                "kubeproxy_sync_full_proxy_rules_duration_seconds_count{ip_family=\"IPv4\"}",
                1.0,
            ),
            (
                "kubeproxy_sync_full_proxy_rules_duration_seconds_bucket{ip_family=\"IPv4\",le=\"0.0004\"}",
                0.0,
            ),
            (
                "kubeproxy_sync_partial_proxy_rules_duration_seconds_count{ip_family=\"IPv4\"}",
                2.0,
            ),
            (
                "kubeproxy_sync_partial_proxy_rules_duration_seconds_bucket{ip_family=\"IPv4\",le=\"0.0002\"}",
                2.0,
            ),
            (
                "kubeproxy_conntrack_reconciler_sync_duration_seconds_count{ip_family=\"IPv4\"}",
                2.0,
            ),
            (
                "kubeproxy_conntrack_reconciler_deleted_entries_total{ip_family=\"IPv4\"}",
                7.0,
            ),
            (
                "kubeproxy_network_programming_duration_seconds_count{ip_family=\"IPv4\"}",
                1.0,
            ),
            (
                "kubeproxy_network_programming_duration_seconds_bucket{ip_family=\"IPv4\",le=\"0.05\"}",
                1.0,
            ),
            (
                "kubeproxy_network_programming_duration_seconds_bucket{ip_family=\"IPv4\",le=\"0.025\"}",
                0.0,
            ),
            (
                "kubeproxy_sync_proxy_rules_last_timestamp_seconds{ip_family=\"IPv4\"}",
                1_748_779_200.0,
            ),
            (
                "kubeproxy_sync_proxy_rules_last_queued_timestamp_seconds{ip_family=\"IPv4\"}",
                1_748_779_199.7,
            ),
            ("kubeproxy_sync_proxy_rules_endpoint_changes_total", 5.0),
            ("kubeproxy_sync_proxy_rules_endpoint_changes_pending", 0.0),
            ("kubeproxy_sync_proxy_rules_service_changes_total", 3.0),
            ("kubeproxy_sync_proxy_rules_service_changes_pending", 0.0),
            (
                "kubeproxy_sync_proxy_rules_no_local_endpoints_total{ip_family=\"IPv4\",traffic_policy=\"internal\"}",
                2.0,
            ),
            (
                "kubeproxy_sync_proxy_rules_no_local_endpoints_total{ip_family=\"IPv4\",traffic_policy=\"external\"}",
                3.0,
            ),
            ("kubeproxy_proxy_healthz_total{code=\"200\"}", 1.0),
            ("kubeproxy_proxy_livez_total{code=\"503\"}", 1.0),
            ("kube_proxy_ebpf_map_entries{map=\"services\"}", 12.0),
            ("kube_proxy_ebpf_map_capacity{map=\"services\"}", 262_144.0),
            ("kube_proxy_ebpf_sync_problems", 1.0),
            (
                "kube_proxy_ebpf_datapath_packets_total{counter=\"ingress_packets\"}",
                0.0,
            ),
            (
                "kube_proxy_ebpf_datapath_packets_total{counter=\"new_flow\"}",
                40.0,
            ),
            (
                "kube_proxy_ebpf_datapath_packets_total{counter=\"pick_round_robin\"}",
                proxy_common::Counter::PickRoundRobin as u32 as f64 * 10.0,
            ),
            (
                "kube_proxy_ebpf_scheduler_picks_total{scheduler=\"random\"}",
                proxy_common::Counter::PickRandom as u32 as f64 * 10.0,
            ),
            (
                "kube_proxy_ebpf_scheduler_picks_total{scheduler=\"mh\"}",
                proxy_common::Counter::PickMaglev as u32 as f64 * 10.0,
            ),
        ];
        for (series, want) in expect {
            assert_eq!(sample(&text, series), Some(want), "{series} in\n{text}");
        }
        for family in [
            "# TYPE kubeproxy_sync_proxy_rules_duration_seconds histogram",
            "# TYPE kubeproxy_sync_full_proxy_rules_duration_seconds histogram",
            "# TYPE kubeproxy_sync_partial_proxy_rules_duration_seconds histogram",
            "# TYPE kubeproxy_conntrack_reconciler_sync_duration_seconds histogram",
            "# TYPE kubeproxy_conntrack_reconciler_deleted_entries_total counter",
            "# TYPE kubeproxy_sync_proxy_rules_endpoint_changes_total counter",
            "# TYPE kubeproxy_sync_proxy_rules_no_local_endpoints_total gauge",
            "# TYPE kube_proxy_ebpf_datapath_packets_total counter",
            "# TYPE kube_proxy_ebpf_scheduler_picks_total counter",
        ] {
            assert!(text.lines().any(|l| l == family), "{family} in\n{text}");
        }
        let (code, head, om) = http_get(addr, "/metrics", "application/openmetrics-text").await;
        assert_eq!(code, 200);
        assert!(head.contains("application/openmetrics-text"), "{head}");
        assert!(om.trim_end().ends_with("# EOF"), "{om}");
        assert_eq!(http_get(addr, "/other", "*/*").await.0, 404);
        let (code, head, mode) = http_get(addr, "/proxyMode", "*/*").await;
        assert_eq!((code, mode.as_str()), (200, "ebpf"), "{head}");
        assert!(head.contains("text/plain"), "{head}");
        server.abort();
    }

    #[test]
    fn frontend_conflicts_are_counted_by_the_skipped_frontends_kind() {
        let metrics = Metrics::new();
        let translation = translate::translate(
            &Snapshot::new(
                vec![
                    service("dns", "10.96.0.10", None, None),
                    serde_json::from_value(serde_json::json!({
                        "metadata": {"name": "intruder", "namespace": "a"},
                        "spec": {"clusterIP": "10.96.0.11", "externalIPs": ["10.96.0.10"],
                                 "ports": [{"name": "http", "port": 80}]}
                    }))
                    .expect("Service"),
                ],
                vec![],
            ),
            &NodeContext::default(),
        );
        metrics.set_frontend_conflicts(&translation.conflicts);
        let text = metrics.encode_text();
        for (kind, want) in [
            ("external_ip", 1.0),
            ("cluster_ip", 0.0),
            ("node_port", 0.0),
        ] {
            let series = format!("kube_proxy_ebpf_frontend_conflicts{{kind=\"{kind}\"}}");
            assert_eq!(sample(&text, &series), Some(want), "{series} in\n{text}");
        }
        metrics.set_frontend_conflicts(&[]);
        let series = "kube_proxy_ebpf_frontend_conflicts{kind=\"external_ip\"}";
        assert_eq!(sample(&metrics.encode_text(), series), Some(0.0));
    }

    /// An IPv4-only node shows no `ip_family="IPv6"` series; the IPv6 family's syncs add them
    /// beside the IPv4 ones (which they leave alone).
    #[test]
    fn ipv6_syncs_get_their_own_ip_family_series() {
        let m = Metrics::new();
        m.sync_applied(
            Duration::from_micros(300),
            SyncKind::Partial,
            &Changes::default(),
            SystemTime::now(),
        );
        assert!(!m.encode_text().contains("ip_family=\"IPv6\""));
        m.ipv6_sync_applied(Duration::from_micros(700), SystemTime::now());
        m.ipv6_sync_applied(Duration::from_micros(900), SystemTime::now());
        let text = m.encode_text();
        let value = |series: &str| {
            text.lines()
                .find_map(|l| l.strip_prefix(series)?.trim().parse::<f64>().ok())
                .unwrap_or_else(|| panic!("{series} not in:\n{text}"))
        };
        assert_eq!(
            value("kubeproxy_sync_proxy_rules_duration_seconds_count{ip_family=\"IPv6\"}"),
            2.0
        );
        assert_eq!(
            value("kubeproxy_sync_full_proxy_rules_duration_seconds_count{ip_family=\"IPv6\"}"),
            2.0
        );
        assert_eq!(
            value("kubeproxy_sync_proxy_rules_duration_seconds_count{ip_family=\"IPv4\"}"),
            1.0,
            "IPv4's series unchanged"
        );
        assert!(
            value("kubeproxy_sync_proxy_rules_last_timestamp_seconds{ip_family=\"IPv6\"}") > 0.0
        );
        assert!(!text.contains(
            "kubeproxy_sync_partial_proxy_rules_duration_seconds_count{ip_family=\"IPv6\"}"
        ));
    }

    /// The IPv6 family's series (`ip_family="IPv6"`, none before it reports): network
    /// programming of the IPv6 slices only (the IPv4 series keeps the IPv4 ones), its
    /// no-local-endpoints and its conntrack reconciler.
    #[test]
    fn ipv6_family_metrics_carry_their_own_ip_family_series() {
        let start = at("2025-01-01T00:00:00Z");
        let mut t = ChangeTracker::new(start);
        let mut cache = TranslateCache::new();
        let six: k8s_openapi::api::discovery::v1::EndpointSlice = serde_json::from_value(json!({
            "metadata": {"namespace": "default", "name": "d-6",
                         "labels": {"kubernetes.io/service-name": "d"},
                         "annotations": {ANNOTATION_TRIGGER_TIME: "2025-01-01T00:00:10Z"}},
            "addressType": "IPv6",
            "endpoints": [{"addresses": ["fd00:10:244:1::5"], "nodeName": "node-a",
                           "conditions": {"ready": true}}],
            "ports": [{"name": "http", "port": 8080, "protocol": "TCP"}]
        }))
        .expect("slice");
        let snap = Snapshot::new(
            vec![service("d", "10.96.0.3", None, None)],
            vec![
                slice("d-4", "d", "node-a", Some("2025-01-01T00:00:05Z")),
                six,
            ],
        );
        cache.update(&snap, &NodeContext::default(), &[], false);
        t.add_classified(cache.last_changes(), |s| cache.is_ipv6_slice(s));
        let pending = t.pending();
        assert_eq!(pending.trigger_times, [at("2025-01-01T00:00:05Z")]);
        assert_eq!(pending.trigger_times6, [at("2025-01-01T00:00:10Z")]);

        let m = Metrics::new();
        let applied = at("2025-01-01T00:00:12Z");
        m.sync_applied(Duration::from_millis(1), SyncKind::Full, &pending, applied);
        m.conntrack_reconciled(Duration::from_millis(3), 4);
        assert!(!m.encode_text().contains("ip_family=\"IPv6\""));
        m.observe_network_programming6(&pending.trigger_times6, applied);
        m.set_no_local_endpoints6(1, 2);
        m.conntrack_reconciled6(Duration::from_millis(3), 5);
        let text = m.encode_text();
        let value = |series: &str| {
            sample(&text, series).unwrap_or_else(|| panic!("{series} not in:\n{text}"))
        };
        let programming = "kubeproxy_network_programming_duration_seconds";
        assert_eq!(
            value(&format!("{programming}_sum{{ip_family=\"IPv4\"}}")),
            7.0
        );
        assert_eq!(
            value(&format!("{programming}_count{{ip_family=\"IPv4\"}}")),
            1.0
        );
        assert_eq!(
            value(&format!("{programming}_sum{{ip_family=\"IPv6\"}}")),
            2.0
        );
        assert_eq!(
            value(&format!("{programming}_count{{ip_family=\"IPv6\"}}")),
            1.0
        );
        let no_local = "kubeproxy_sync_proxy_rules_no_local_endpoints_total";
        for (family, policy, n) in [
            ("IPv4", "internal", 0.0),
            ("IPv4", "external", 0.0),
            ("IPv6", "internal", 1.0),
            ("IPv6", "external", 2.0),
        ] {
            assert_eq!(
                value(&format!(
                    "{no_local}{{ip_family=\"{family}\",traffic_policy=\"{policy}\"}}"
                )),
                n
            );
        }
        let deleted = "kubeproxy_conntrack_reconciler_deleted_entries_total";
        assert_eq!(value(&format!("{deleted}{{ip_family=\"IPv4\"}}")), 4.0);
        assert_eq!(value(&format!("{deleted}{{ip_family=\"IPv6\"}}")), 5.0);
        assert_eq!(
            value("kubeproxy_conntrack_reconciler_sync_duration_seconds_count{ip_family=\"IPv6\"}"),
            1.0
        );
    }
}
