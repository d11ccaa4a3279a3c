//! The agent: wires the manifest source, the pure pipeline (translate → plan) and the dataplane
//! edge (maps, links) into one sync loop.
//!
//! Start-up: adopt the pinned maps and rebuild the shadow from them, read the
//! source, sync, and only then attach (or atomically replace the programs of) the interfaces.
//! Shutdown leaves maps and links pinned so traffic keeps flowing until the next agent adopts them.

use std::{
    collections::BTreeSet,
    ops::Not as _,
    path::PathBuf,
    time::{Duration, Instant},
};

use aya::Ebpf;
use proxy_common::{CtKey, CtValue, DatapathConfig, SockLbConfig, proto};
use tokio::signal::unix::{SignalKind, signal};
use tracing::{debug, error, info, warn};

use crate::{
    cli::RunArgs,
    dataplane::{
        self,
        attach::Attacher,
        bpffs::PinLayout,
        flow_gc::{FlowGc, PinnedFlowMaps, Walked},
        interfaces::{self, Patterns},
        links,
        loader::{self, MapSizes},
        maps::{Conntrack, LcCounts, ServiceMaps, Snat},
        netlink, sock_lb,
    },
    pipeline::{
        diff::Plan,
        encode::FamilyAbi,
        incremental::Planner,
        model::{Problem, SkippedFrontend},
        opened::OpenedFrontends,
        programmed::{Capacities, MapOp, Programmed},
        translate::NodeContext,
        translate_cache::TranslateCache,
    },
    serving::status::{self, Status},
    sources::{
        ManifestSource, Source,
        kube::{
            Connection, KubeSource,
            events::{ConflictEvents, EventSink, SkipEvents},
        },
        snapshot::Snapshot,
    },
};

/// How often idle conntrack and SNAT entries are swept (the LRU also evicts under pressure), on
/// the flow garbage collection thread (`crate::dataplane::flow_gc`).
const CONNTRACK_GC_PERIOD: Duration = Duration::from_secs(30);
/// How often the wait for the sources' initial lists is logged.
const READY_LOG_INTERVAL: Duration = Duration::from_secs(10);
/// Retry delay after a failed sync.
const SYNC_RETRY: Duration = Duration::from_secs(1);

/// Why a sync stopped early.
#[derive(Debug, thiserror::Error)]
#[error("applying {op:?} failed: {source}")]
pub struct ApplyError {
    op: MapOp,
    source: Box<dataplane::Error>,
}

/// The node's long-lived datapath state.
pub struct Agent {
    ebpf: Ebpf,
    maps: ServiceMaps,
    /// The conntrack and SNAT walks, on their own thread (`crate::dataplane::flow_gc`).
    flow_gc: FlowGc,
    /// The frontend generation and the kernel conntrack purge after frontends open.
    fresh_frontends: crate::dataplane::frontend_gen::FreshFrontends,
    /// Least-connection counts: the loop resets a freed backend id's count at once
    /// (`flow_gc::reset_freed`); the walks reconcile the rest.
    lc: LcCounts,
    programmed: Programmed,
    /// Indexes over `programmed` and what changed since the last plan (every op applied to
    /// `programmed` goes through it first).
    planner: Planner,
    /// The desired state, translated again only for the Services that changed.
    cache: TranslateCache,
    attacher: Attacher,
    pins: PinLayout,
    capacities: Capacities,
    node: NodeContext,
    /// How pod-facing and external interfaces are chosen (detected, or globs).
    choices: crate::dataplane::devices::Choices,
    /// The interfaces chosen last, for the log (logged when they change).
    chosen: crate::dataplane::devices::Selection,
    /// The external devices changed what the node's addresses select: a sync is due.
    devices_changed: bool,
    /// `--tunnel-devices auto`: attach to tunnel devices found by link kind too.
    tunnel_devices: bool,
    /// Tunnel devices already named in the log (once each).
    reported_tunnels: BTreeSet<String>,
    status: Status,
    status_file: Option<PathBuf>,
    reported: BTreeSet<String>,
    /// Kubernetes mode: Events on Services that lose a frontend, one per conflict appearance.
    events: Option<EventSink>,
    conflict_events: ConflictEvents,
    skip_events: SkipEvents,
    /// The IPv4 plan's skipped frontends, as of the last sync that planned.
    skipped: Vec<SkippedFrontend>,
    /// Telemetry: /metrics and /healthz state, and what changed between applied syncs.
    metrics: std::sync::Arc<crate::serving::metrics::Metrics>,
    health: std::sync::Arc<crate::serving::health::HealthState>,
    /// Service and EndpointSlice changes not yet carried by an applied sync (metrics).
    changes: crate::serving::metrics::ChangeTracker,
    /// When `changes` started measuring (trigger times before it predate this agent).
    changes_since: std::time::SystemTime,
    /// `kubeproxy_sync_proxy_rules_no_local_endpoints_total`, kept by the changed frontends.
    no_local: crate::serving::metrics::NoLocalEndpoints,
    /// A health check changed since the servers were last updated.
    health_checks_changed: bool,
    /// Node addresses (NodePorts, SNAT) and health-check node ports.
    external: crate::dataplane::node_addrs::External,
    /// Map occupancy (metrics, and a warning before a map is full).
    occupancy: crate::dataplane::occupancy::Occupancy,
    /// How long each part of the last sync took (the debug log, `xtask-bench change-latency`).
    last_parts: SyncParts,
    /// A flow walk finished since the start (the first is logged at info).
    walked_once: bool,
    /// The IPv6 family's maps, shadow and sync (no work on a node without IPv6).
    family6: crate::family6::Family6,
    /// The pinned maps' layout and what is left of a migration (`dataplane::layout`).
    layout: crate::dataplane::layout::Migrator,
    /// Every pinned map and link held open, pinned again if removed (`dataplane::pin_keeper`).
    keeper: crate::dataplane::pin_keeper::PinKeeper,
    /// The pins' problem last reported (logged once, /healthz fails while it lasts).
    pins_problem: Option<String>,
    /// The last sync skipped frontends for room and freed some: the loop syncs again at once.
    retry_skipped: bool,
    /// The maps were adopted from an earlier agent (they carry its Services from the start).
    adopted: bool,
    /// The program groups loaded so far (`dataplane::loader::ProgramGroup`).
    needs: loader::Needs,
    /// Where the loaded programs are pinned for the next agent (none with the trace on: then
    /// every program is loaded at start).
    program_pins: Option<crate::dataplane::program_pins::ProgramPins>,
    /// What the object was loaded with, to load more of its programs later.
    load_params: loader::LoadParams,
}

/// The parts of one [`Agent::sync`], timed.
#[derive(Clone, Copy, Debug, Default)]
pub struct SyncParts {
    /// Source of truth to desired state: the translation cache's update, problems gathered.
    pub translate: Duration,
    /// The plan (incremental or full).
    pub plan: Duration,
    /// Problems and conflicts logged, reported as Events and metrics.
    pub report: Duration,
    /// Map writes, shadow and planner indexes updated.
    pub apply: Duration,
    /// After the writes: external addresses and health-check node ports, metrics, status.
    pub after: Duration,
}

impl Agent {
    /// Loads the programs with adopted (or new) pinned maps and reads back what they carry.
    /// `bpf_log`: the datapath trace's level, fixed at load (`dataplane::bpf_log`).
    pub fn start(
        pins: PinLayout,
        config: DatapathConfig,
        node: NodeContext,
        choices: crate::dataplane::devices::Choices,
        sizes: MapSizes,
        sock_lb: SockLbConfig,
        bpf_log: crate::dataplane::bpf_log::BpfLog,
    ) -> anyhow::Result<Self> {
        let metrics = telemetry_for(&pins);
        let changes_since = std::time::SystemTime::now();
        // An agent ran before if its Services are pinned (an older one pinned no SEED_V1).
        let adopting = pins.map(proxy_common::MAP_SERVICES).exists();
        // Pins of a layout this agent cannot use are refused here, before anything is adopted.
        let layout = crate::dataplane::layout::Migrator::for_this_release(&pins)?;
        let config = DatapathConfig {
            hash_seed: loader::node_seed(&pins)?,
            ..config
        };
        // The IPv4 Ethernet programs now; IPv6 too where the node has it (sized IPv6 maps);
        // the L3-device programs and the socket hooks once something uses them (`Agent::need`).
        let needs = loader::Needs {
            ipv6: !sizes.ipv6_minimal(),
            ..loader::Needs::default()
        };
        let loading = Instant::now();
        let load_params = loader::LoadParams {
            pins: pins.clone(),
            config,
            sizes,
            sock_lb,
            bpf_log,
        };
        let (mut ebpf, program_pins, loaded) = loader::load_pinned(&load_params, needs)?;
        info!(
            took_ms = loading.elapsed().as_millis() as u64,
            verified = ?loaded.verified,
            taken_from_pins = ?loaded.taken,
            "programs loaded"
        );
        let migrated = layout.after_load()?;
        if layout.pending() > 0 {
            info!(
                verdict = ?layout.verdict(),
                migrations = layout.pending(),
                entries = migrated,
                "pinned maps of an older layout: entries copied into the new maps, the rest follows the program swap"
            );
        } else if let crate::dataplane::layout::Verdict::AdoptNewer { pins: marker } =
            layout.verdict()
        {
            info!(
                pins_layout = marker.layout,
                this_layout = proxy_common::LAYOUT_VERSION,
                "pinned maps of a newer layout this agent can use (it only added maps): adopted, its marker kept"
            );
        }
        let occupancy =
            crate::dataplane::occupancy::Occupancy::open(&pins, &sizes, adopting, &metrics);
        let maps = ServiceMaps::from_ebpf(&mut ebpf)?;
        // Adopted maps keep the size they were created with: plan against what they hold.
        let capacities = Capacities {
            maglev_table_size: config.maglev_table_size,
            ..maps.capacities().unwrap_or_else(|_| sizes.capacities())
        };
        let conntrack = Conntrack::from_ebpf(&mut ebpf)?;
        let conntrack6 = crate::dataplane::maps::Conntrack6::from_ebpf(&mut ebpf)?;
        let snat = Snat::from_ebpf(&mut ebpf)?;
        let snat6 = crate::dataplane::maps::Snat6::from_ebpf(&mut ebpf)?;
        let lc = LcCounts::from_ebpf(&mut ebpf)?;
        let fresh_frontends = crate::dataplane::frontend_gen::FreshFrontends::from_ebpf(&mut ebpf)?;
        let loop_lc = LcCounts::open_pinned(&pins)?;
        let health: std::sync::Arc<crate::serving::health::HealthState> = Default::default();
        let external = crate::dataplane::node_addrs::External::new(&mut ebpf, health.clone())?;
        let mut family6 =
            crate::family6::Family6::start(&mut ebpf, &maps, &capacities, health.clone())?;
        // The IPv6 frontends' Maglev tables are theirs (one MAGLEV_V1).
        let mut programmed = maps.read_programmed_excluding(&family6.maglev_tables())?;
        maps.adopt_maglev(&mut programmed, config.maglev_table_size);
        let mut planner = Planner::new(&programmed);
        planner.share_with(family6.shared_ids());
        family6.share_with(programmed.shared_ids());
        if adopting {
            info!(
                pin_dir = %pins.dir.display(),
                frontends = programmed.frontend_count(),
                backends = programmed.backends.len(),
                flows = conntrack.entries().len(),
                "adopted pinned maps; converging by diff, nothing flushed"
            );
        } else {
            info!(pin_dir = %pins.dir.display(), "created new pinned maps");
        }
        let mut keeper = crate::dataplane::pin_keeper::PinKeeper::new(pins.clone());
        keeper.hold_new(false);
        let flow_gc = FlowGc::start(
            PinnedFlowMaps {
                conntrack,
                conntrack6,
                snat,
                snat6,
                lc,
            },
            config,
        )?;
        Ok(Self {
            ebpf,
            maps,
            flow_gc,
            fresh_frontends,
            lc: loop_lc,
            planner,
            cache: TranslateCache::new(),
            programmed,
            attacher: Attacher::new(pins.clone()),
            pins,
            capacities,
            node,
            choices,
            chosen: Default::default(),
            devices_changed: false,
            tunnel_devices: true,
            reported_tunnels: BTreeSet::new(),
            status: Status::default(),
            status_file: None,
            reported: BTreeSet::new(),
            events: None,
            conflict_events: ConflictEvents::default(),
            skip_events: SkipEvents::default(),
            skipped: Vec::new(),
            metrics,
            health,
            changes: crate::serving::metrics::ChangeTracker::new(changes_since),
            changes_since,
            no_local: Default::default(),
            health_checks_changed: true,
            external,
            occupancy,
            last_parts: SyncParts::default(),
            walked_once: false,
            family6,
            layout,
            keeper,
            pins_problem: None,
            retry_skipped: false,
            adopted: adopting,
            needs,
            program_pins,
            load_params,
        })
    }

    /// Loads the programs `more` calls for that are not loaded yet (an L3 device to attach to,
    /// IPv6 to serve). A failure is logged: what needs them then fails on its own (an attach
    /// reports it) and the next call tries again.
    fn need(&mut self, more: loader::Needs) {
        let needs = self.needs.with(more);
        let Some(pins) = self.program_pins.as_ref() else {
            // Everything was loaded at start.
            return;
        };
        if needs == self.needs {
            return;
        }
        let started = Instant::now();
        match loader::load_later(&self.load_params, &mut self.ebpf, needs, pins) {
            Ok(loaded) => {
                self.needs = needs;
                info!(
                    took_ms = started.elapsed().as_millis() as u64,
                    verified = ?loaded.verified,
                    taken_from_pins = ?loaded.taken,
                    "programs loaded"
                );
            }
            Err(e) => error!("loading the programs {more:?} calls for: {e}"),
        }
    }

    /// Removes this node's datapath (the agent is being uninstalled): every link detached, every
    /// pin removed, under the pin directory's lock the agent holds. Flows lose their translation.
    pub fn uninstall(self) -> anyhow::Result<()> {
        let Self {
            pins, keeper, ebpf, ..
        } = self;
        let result = crate::cli::cleanup::remove_datapath(&pins);
        // The held maps and links, and then the lock, go only now: nothing pins them back.
        drop(ebpf);
        drop(keeper);
        result
    }

    /// One sync: translate the Services that changed, plan the frontends that changed against
    /// the shadow, apply in order. `full`: translate every Service and plan every frontend (the
    /// periodic level-triggered pass; it gives the same result). Stops at the first failed
    /// write: the plan's order keeps every prefix consistent.
    pub fn sync(
        &mut self,
        snapshot: &Snapshot,
        mut problems: Vec<Problem>,
        full: bool,
    ) -> Result<(), ApplyError> {
        let started = Instant::now();
        self.external.refresh();
        self.cache.set_ipv6_programmed(self.family6.active());
        let changes = self
            .cache
            .update(snapshot, &self.node, self.external.nodeport_addrs(), full);
        let desired = self.cache.desired();
        // The one change stream: everything after the plan follows the cache's change list.
        self.planner.desired_changes(&changes, desired);
        self.external.desired_changes(&changes, desired, full);
        if full {
            self.no_local.rebuild(desired);
        } else {
            self.no_local.update(&changes, desired);
        }
        let listed = self.cache.last_changes();
        let cache = &self.cache;
        (self.changes).add_classified(listed, |slice| cache.is_ipv6_slice(slice));
        self.health_checks_changed |= listed.health_checks || full;
        problems.extend(self.cache.problems());
        let mut parts = SyncParts {
            translate: started.elapsed(),
            ..SyncParts::default()
        };
        let mut lap = Instant::now();
        // Empty maps (a node's first sync) are filled a group of frontends at a time: planned,
        // written and recorded before the next group is planned, so the first sync never holds
        // the op vector and the plan's indexes for every Service at once (the agent's peak).
        // What a group cannot carry (it does not fit) is left to the full plan below.
        let mut filled = Filled::default();
        // Frontends the plans open: flows recorded toward them before go once written.
        let mut opened = OpenedFrontends::default();
        if full && self.planner.begin_fill(desired, &mut self.programmed) {
            let fill = Instant::now();
            while let Some(group) = self.planner.plan_fill_group(
                desired,
                &self.programmed,
                &self.capacities,
                FILL_GROUP,
            ) {
                filled.ops += group.ops.len();
                filled.walk_conntrack |= walks_conntrack_after(&group.ops, &self.programmed);
                opened.add(&group.ops, &self.programmed);
                self.backends_changed(&group.ops);
                if let Err(e) = apply_recorded(
                    &mut self.maps,
                    &mut self.planner,
                    &mut self.programmed,
                    &mut self.family6,
                    group.ops,
                ) {
                    self.fresh_frontends.opened(&opened);
                    self.sync_failed();
                    return Err(e);
                }
                if !self.planner.fill_group_applied(FILL_GROUP) {
                    filled.complete = true;
                    break;
                }
            }
            filled.took = fill.elapsed();
        }
        let (plan, kind) = if filled.complete {
            // The groups carried it all: the full plan would find nothing to write.
            (Plan::default(), crate::serving::metrics::SyncKind::Full)
        } else {
            self.planner
                .plan_with_kind(desired, &self.programmed, &self.capacities, full)
        };
        parts.plan = lap.elapsed().saturating_sub(filled.took);
        lap = Instant::now();
        // Complete: a skipped frontend makes every plan full until it fits.
        self.skipped = SkippedFrontend::of_plan(&plan.skipped, desired);
        for (frontend, reason) in &plan.skipped {
            problems.push(Problem {
                source: "dataplane".into(),
                object: format!("frontend {frontend}"),
                reason: reason.clone(),
            });
        }
        // The IPv6 family's problems are reported with these, as of its last sync (updated
        // below once it synced: an IPv6 frontend that does not fit is reported like an IPv4 one).
        let ipv4_problems = problems.len();
        problems.extend_from_slice(self.family6.problems());
        self.report_problems(&problems);
        self.report_conflicts(snapshot);
        parts.report = lap.elapsed();
        lap = Instant::now();
        // UDP flows to a removed backend are removed at once (kube-proxy's UDP conntrack
        // cleanup: a walk is asked for right after the apply); TCP ones are answered with a RST
        // by the datapath. A backend id freed from a least-connection frontend has its count
        // reset at once, on this thread (a freed id is reused by the next new endpoint, which
        // must not inherit the old one's flow count), and a walk is asked for too. The rest
        // (idle flows) is the periodic walk's: a TCP-only change elsewhere does not walk.
        let mut walk_conntrack_now =
            filled.walk_conntrack || walks_conntrack_after(&plan.ops, &self.programmed);
        let freed_lc_ids = freed_least_connection_ids(&plan.ops, &self.programmed);
        let op_count = filled.ops + plan.ops.len();
        // Frontends skipped for room while this plan frees some (its removals come after its
        // additions, so the room is only there afterwards): sync again at once rather than at
        // the next change or periodic pass.
        self.retry_skipped = !plan.skipped.is_empty() && plan.ops.iter().any(frees_room);
        let Plan { ops, skipped } = plan;
        // Before the apply, so a walk running meanwhile leaves these ids alone either way.
        self.backends_changed(&ops);
        opened.add(&ops, &self.programmed);
        if let Err(e) = apply_recorded(
            &mut self.maps,
            &mut self.planner,
            &mut self.programmed,
            &mut self.family6,
            ops,
        ) {
            self.fresh_frontends.opened(&opened);
            self.sync_failed();
            return Err(e);
        }
        self.planner.applied(&Plan {
            skipped,
            ..Plan::default()
        });
        let (ops6, freed_lc_ids6, walk6) = self.sync_ipv6(&mut opened);
        self.fresh_frontends.opened(&opened);
        if problems[ipv4_problems..] != *self.family6.problems() {
            problems.truncate(ipv4_problems);
            problems.extend_from_slice(self.family6.problems());
            self.report_problems(&problems);
        }
        walk_conntrack_now |= walk6;
        self.report_skipped(snapshot);
        parts.apply = lap.elapsed() + filled.took;
        lap = Instant::now();
        crate::dataplane::flow_gc::reset_freed(&mut self.lc, self.flow_gc.shared(), &freed_lc_ids);
        crate::dataplane::flow_gc::reset_freed(&mut self.lc, self.flow_gc.shared(), &freed_lc_ids6);
        if walk_conntrack_now {
            self.gc_conntrack();
        }
        let checks = (std::mem::take(&mut self.health_checks_changed)
            || !self.external.health_checks_settled())
        .then(|| self.cache.health_checks());
        self.external.apply(checks.as_deref());
        self.status.syncs += 1;
        self.status.frontends = self.planner.frontend_count();
        self.status.backends = self.programmed.backends.len();
        self.status.problems = problems.len();
        self.sync_applied(started.elapsed(), kind, &problems);
        let level_changed = op_count + ops6 > 0;
        if level_changed {
            info!(
                ops = op_count,
                full,
                changed_frontends = changes.len(),
                frontends = self.status.frontends,
                backends = self.status.backends,
                took_us = started.elapsed().as_micros() as u64,
                "synced"
            );
        } else {
            debug!(
                took_us = started.elapsed().as_micros() as u64,
                "synced, nothing to change"
            );
        }
        self.write_status();
        parts.after = lap.elapsed();
        self.last_parts = parts;
        if full {
            // Freed here, not by the next (change) sync: see `release_change_list`.
            self.cache.release_change_list();
            // Committed (empty), but its sets keep the capacity of a full sync's change list
            // (every Service and slice name: 6 MB at 50,000 Services); a new one holds none.
            self.changes = crate::serving::metrics::ChangeTracker::new(self.changes_since);
            crate::dataplane::sys::release_free_heap();
        }
        Ok(())
    }

    /// Whether the last sync skipped frontends for room while freeing some (then another sync
    /// may carry them); cleared by reading.
    pub fn take_retry_skipped(&mut self) -> bool {
        std::mem::take(&mut self.retry_skipped)
    }

    /// IPv6 frontend entries programmed (benches: the IPv6 family is on).
    pub fn ipv6_frontends(&self) -> usize {
        self.family6.frontend_count()
    }

    /// How long each part of the last applied sync took.
    pub fn last_sync_parts(&self) -> SyncParts {
        self.last_parts
    }

    /// Reads the source's current state and syncs it (the node's zone included); `full` as in
    /// [`Agent::sync`].
    pub fn sync_from(&mut self, source: &Source, full: bool) -> Result<(), ApplyError> {
        self.sync_from_refreshing(source, full, 0..0).map(|_| ())
    }

    /// [`Agent::sync_from`], translating again the Services at places `refresh` of the source's
    /// list whether or not they changed (a slice of the periodic pass, see [`FullPass`]).
    /// Returns whether `refresh` reached the end of the list.
    pub fn sync_from_refreshing(
        &mut self,
        source: &Source,
        full: bool,
        refresh: std::ops::Range<usize>,
    ) -> Result<bool, ApplyError> {
        let started = Instant::now();
        let state = source.state();
        let read_us = started.elapsed().as_micros() as u64;
        let services = &state.snapshot.services;
        let end = refresh.end.min(services.len());
        let refresh = (services[refresh.start.min(end)..end].iter())
            .filter_map(|s| crate::pipeline::translate_cache::service_name(s))
            .collect();
        let reached_end = end == services.len();
        self.cache.hint(crate::pipeline::translate_cache::Hint {
            changes: state.changes,
            refresh,
        });
        if state.zone != self.node.zone {
            info!(zone = ?state.zone, "node zone changed");
            self.node.zone = state.zone;
        }
        self.health.set_node_eligible(state.node_eligible);
        self.health.set_ipv6(self.family6.active());
        self.external.set_api_service_cidrs(state.service_cidrs);
        self.family6.set_api_service_cidrs(state.service_cidrs6);
        debug!(read_us, rss_mib = rss_mib(), "source state read");
        self.sync(&state.snapshot, state.problems, full)?;
        if full && source.cheap_to_read() {
            // The Kubernetes stores say what changed: see `TranslateCache::expect_hints`.
            self.cache.expect_hints();
        }
        Ok(reached_end)
    }

    /// Logs problems not reported before (one line each, not one per sync).
    fn report_problems(&mut self, problems: &[Problem]) {
        let now: BTreeSet<String> = problems.iter().map(ToString::to_string).collect();
        for p in now.difference(&self.reported) {
            error!("skipped: {p}");
        }
        self.reported = now;
    }

    /// Frontend conflicts: the metric, and an Event on each Service that newly lost a frontend
    /// (Kubernetes mode; the Problem is logged by [`Agent::report_problems`]).
    fn report_conflicts(&mut self, snapshot: &Snapshot) {
        let conflicts = self.cache.conflicts();
        self.metrics.set_frontend_conflicts(&conflicts);
        let appeared = self.conflict_events.appeared(&conflicts, snapshot);
        if let Some(sink) = &self.events {
            sink.send(appeared);
        }
    }

    /// Frontends the plans skipped (both families): an Event on each Service that newly has one
    /// (Kubernetes mode; the Problem is logged by [`Agent::report_problems`]).
    fn report_skipped(&mut self, snapshot: &Snapshot) {
        let Some(sink) = &self.events else { return };
        let mut skipped = self.skipped.clone();
        skipped.extend_from_slice(self.family6.skipped());
        sink.send(self.skip_events.appeared(&skipped, snapshot));
    }

    /// Attaches to every matching interface and (`--tunnel-devices auto`) every tunnel device,
    /// new ones included; releases gone ones. Devices without an Ethernet header (ipip, gre,
    /// WireGuard) get the `_l3` programs.
    pub fn reconcile_interfaces(&mut self) {
        self.reconcile_interfaces_as(false);
    }

    /// Whether the last interface scans changed the node's selected addresses (cleared by
    /// reading): the caller schedules a sync.
    pub fn take_devices_changed(&mut self) -> bool {
        std::mem::take(&mut self.devices_changed)
    }

    /// Takes netfilter's Service flows over (kube-proxy's, on a node it ran on), step 1: written
    /// as netfilter's, before the programs attach (`dataplane::takeover`).
    pub fn take_over_flows(&self) -> Option<crate::dataplane::takeover::Takeover> {
        let node_snat = [self.external.snat_addr().map(std::net::IpAddr::V4)]
            .into_iter()
            .chain([self.family6.snat_addr().map(std::net::IpAddr::V6)])
            .flatten()
            .collect();
        crate::dataplane::takeover::Takeover::before_attach(
            &self.pins,
            &self.programmed,
            self.family6.programmed(),
            node_snat,
        )
        .inspect_err(|e| warn!("netfilter's Service flows are not taken over: {e:#}"))
        .ok()
    }

    /// Step 2 and 3 of [`Agent::take_over_flows`], once the programs are attached.
    pub fn finish_takeover(
        &self,
        mut takeover: crate::dataplane::takeover::Takeover,
    ) -> crate::dataplane::takeover::Report {
        if let Err(e) = takeover.after_attach(&self.programmed, self.family6.programmed()) {
            warn!("reading netfilter's flows again after the attach: {e:#}");
        }
        takeover.hand_over()
    }

    /// Before the first sync on adopted maps: attaches to the wanted interfaces that have no
    /// programs yet (a pod created while no agent ran gets its Services from the maps as they
    /// are), leaving pinned links with the program they run until the first sync.
    pub fn attach_new_interfaces(&mut self) {
        self.reconcile_interfaces_as(true);
    }

    fn reconcile_interfaces_as(&mut self, missing_only: bool) {
        let links = match links::dump() {
            Ok(l) => l,
            Err(e) => {
                error!("listing interfaces (RTM_GETLINK) failed: {e}; interfaces unchanged");
                return;
            }
        };
        let addressed = crate::dataplane::node_addrs::addressed_interfaces().unwrap_or_else(|e| {
            error!(
                "listing the node's addresses failed: {e}; external devices by default route only"
            );
            Default::default()
        });
        let default_routes = links::default_route_devices().unwrap_or_else(|e| {
            error!("listing default routes (RTM_GETROUTE) failed: {e}; external devices by address only");
            Default::default()
        });
        let facts = crate::dataplane::devices::Facts {
            links: &links,
            addressed: &addressed,
            default_routes: &default_routes,
        };
        let chosen =
            crate::dataplane::devices::select(&facts, &self.choices.pods, &self.choices.external);
        if chosen != self.chosen {
            info!(
                pods = chosen.pods.len(),
                external = ?chosen.external.iter().map(|i| &i.name).collect::<Vec<_>>(),
                pod_interfaces = %self.choices.pods,
                devices = %self.choices.external,
                "interfaces chosen"
            );
            let names = || Patterns::exact(chosen.external.iter().map(|i| i.name.clone()));
            // The external devices' addresses are the `primary` NodePort and SNAT addresses: a
            // change calls for a sync.
            self.devices_changed |= self.external.set_devices(names());
            self.devices_changed |= self.family6.set_devices(names());
            self.chosen = chosen.clone();
        }
        let mut wanted = chosen.all();
        let tunnels = self.tunnels(&links);
        for t in &tunnels {
            if !wanted.iter().any(|i| i.index == t.index) {
                wanted.push(t.clone());
            }
        }
        let l3 = links::l3_devices(&links);
        if wanted.iter().any(|i| l3.contains(&i.index)) {
            self.need(loader::Needs {
                l3: true,
                ..loader::Needs::default()
            });
        }
        let before = self.attacher.pin_names();
        let report = if missing_only {
            self.attacher.attach_missing(&mut self.ebpf, &wanted, &l3)
        } else {
            self.attacher.reconcile(&mut self.ebpf, &wanted, &l3)
        };
        // Links this agent let go of are not kept attached by a held fd; new ones are held.
        let after = self.attacher.pin_names();
        // A link attached anew where one was pinned (a failed adoption) replaced that pin
        // itself: held anew, not taken for a stranger.
        let released: Vec<String> = (before.difference(&after).cloned())
            .chain(report.released.iter().map(|l| l.pin_name()))
            .chain(report.attached.iter().map(|l| l.pin_name()))
            .collect();
        self.keeper.forget(released.iter().map(String::as_str));
        self.keeper.hold_new(true);
        let attached = self.attacher.interfaces();
        self.external.set_tunnels(
            tunnels
                .into_iter()
                .filter(|t| attached.contains(&t.name))
                .collect(),
        );
        for l in &report.attached {
            info!(interface = %l.ifname, hook = %l.hook, "attached");
        }
        for l in &report.adopted {
            info!(interface = %l.ifname, hook = %l.hook, "adopted pinned link, program replaced atomically");
        }
        for l in &report.released {
            info!(interface = %l.ifname, hook = %l.hook, "released link of a gone interface");
        }
        for (l, e) in &report.failed {
            error!(interface = %l.ifname, hook = %l.hook, "attach failed: {e}");
        }
        let interfaces: Vec<String> = self.attacher.interfaces().into_iter().collect();
        if interfaces != self.status.interfaces {
            self.status.interfaces = interfaces;
            self.write_status();
        }
    }

    /// The tunnel devices to attach to (`--tunnel-devices auto`), by link kind: Ethernet-framed
    /// (vxlan, geneve, gretap) and L3 ones (ipip, gre, wireguard), each named once in the log.
    fn tunnels(&mut self, links: &[links::Link]) -> Vec<interfaces::Interface> {
        if !self.tunnel_devices {
            return Vec::new();
        }
        let mut out = Vec::new();
        for t in links::tunnels(links) {
            if self.reported_tunnels.insert(t.interface.name.clone()) {
                info!(interface = %t.interface.name, kind = %t.kind, l3 = !t.ethernet, "tunnel device found");
            }
            out.push(t.interface);
        }
        out
    }

    /// Attaches the socket hooks to `cgroup` (adopting pinned links), or releases them (`None`).
    pub fn attach_socket_lb(&mut self, cgroup: Option<&std::path::Path>) -> anyhow::Result<()> {
        let report = sock_lb::reconcile(&mut self.ebpf, &self.pins, cgroup);
        // The cgroup links it released (detached, unpinned) or replaced are not held any more;
        // new ones are.
        self.keeper.forget_changed("cgroup_");
        self.keeper.hold_new(true);
        let report = report?;
        if report.released > 0 {
            info!(
                links = report.released,
                "released socket hooks of another cgroup"
            );
        }
        if let Some(cgroup) = cgroup {
            info!(
                cgroup = %cgroup.display(),
                attached = ?report.attached,
                adopted = ?report.adopted,
                "socket hooks: Services reachable from the node's own processes"
            );
        }
        Ok(())
    }

    /// Asks the flow garbage collection thread for a conntrack walk over the backends as
    /// programmed now (`crate::dataplane::flow_gc`): idle-expired flows out, and UDP flows whose
    /// backend is gone (like kube-proxy's UDP conntrack cleanup, so DNS clients do not keep
    /// sending to a deleted pod); TCP flows to a gone backend are answered with a RST by the
    /// datapath on their next packet. The same walk reconciles the least-connection counts.
    /// Returns at once (the copy of the backends is the loop's cost, a few ms at 500,000).
    pub fn gc_conntrack(&mut self) {
        self.flow_gc
            .request_dual(self.programmed.backends.clone(), self.backends6(), false);
    }

    /// The IPv6 backends for a flow walk: `None` (not judged) while the IPv6 family is off.
    fn backends6(&self) -> Option<crate::dataplane::flow_gc::Backends6> {
        self.family6
            .active()
            .then(|| self.family6.backends().clone())
    }

    /// The periodic pass: a conntrack walk and a SNAT sweep on the flow garbage collection
    /// thread, and the occupancy sample of the maps no other pass lists.
    pub fn gc_flows(&mut self) {
        (self.flow_gc).request_dual(self.programmed.backends.clone(), self.backends6(), true);
        self.sample_maps();
    }

    /// Records that these ops put or deleted backends (a walk running meanwhile leaves those
    /// ids alone).
    fn backends_changed(&self, ops: &[MapOp]) {
        crate::dataplane::flow_gc::lock(self.flow_gc.shared())
            .note_changed(changed_backend_ids(ops));
    }

    /// Resolves with the next finished flow walk (see [`Agent::walked`]).
    pub async fn next_walk(&mut self) -> Option<Walked> {
        self.flow_gc.walked().await
    }

    /// Reports a finished walk: metrics, occupancy, a debug line.
    pub fn walked(&mut self, done: Walked) {
        let removed = done.conntrack_removed;
        if removed > 0 {
            debug!(removed, "conntrack garbage collected");
        }
        if std::mem::replace(&mut self.walked_once, true) {
            debug!(
                took_us = done.took.as_micros() as u64,
                flows = done.conntrack_listed,
                "flow walk done"
            );
        } else {
            // Once at info: the memory after it is the steady state (`xtask-bench footprint`).
            info!(
                took_us = done.took.as_micros() as u64,
                flows = done.conntrack_listed,
                rss_mib = rss_mib(),
                "first flow walk done"
            );
        }
        self.occupancy.report(
            &self.metrics,
            "conntrack",
            (done.conntrack_listed - removed) as u64,
        );
        self.metrics.conntrack_reconciled(done.took, removed as u64);
        if self.family6.active() {
            let removed6 = done.conntrack6_removed;
            let left6 = done.conntrack6_listed.saturating_sub(removed6);
            self.occupancy
                .report(&self.metrics, "conntrack6", left6 as u64);
            (self.metrics).conntrack_reconciled6(done.took, removed6 as u64);
        }
        for (map, snat) in [("snat", done.snat), ("snat6", done.snat6)] {
            let Some(snat) = snat else { continue };
            if snat.removed > 0 {
                debug!(
                    map,
                    removed = snat.removed,
                    flows = snat.flows,
                    orphans = snat.orphans,
                    "SNAT garbage collected"
                );
            }
            self.occupancy
                .report(&self.metrics, map, snat.remaining as u64);
        }
    }

    /// The periodic pin check (`dataplane::pin_keeper`): missing pins are pinned again from the
    /// held fds (a warning); pins that cannot be put back are logged once and fail /healthz
    /// until they can.
    pub fn check_pins(&mut self) {
        use crate::dataplane::pin_keeper::PinCheck;
        match self.keeper.check() {
            PinCheck::Intact => {
                if self.pins_problem.take().is_some() {
                    info!(pin_dir = %self.pins.dir.display(), "pins in place again");
                }
            }
            PinCheck::Repaired { missing, replaced } => {
                if !missing.is_empty() {
                    let shown: Vec<String> = missing
                        .iter()
                        .take(8)
                        .map(|p| p.display().to_string())
                        .collect();
                    warn!(
                        pin_dir = %self.pins.dir.display(),
                        repaired = missing.len(),
                        held = self.keeper.held(),
                        first = %shown.join(","),
                        "pins removed under the running agent: pinned again from the maps and links it holds open"
                    );
                }
                for r in &replaced {
                    warn!(
                        pin = %self.pins.dir.join(&r.pin).display(),
                        found = %r.found,
                        ours = %r.ours,
                        "pin replaced by another object under the running agent: this agent's object pinned back in its place"
                    );
                }
                self.pins_problem = None;
            }
            PinCheck::Lost(why) => {
                if self.pins_problem.as_deref() != Some(why.as_str()) {
                    error!("{why}; /healthz fails until the pins are back");
                }
                self.pins_problem = Some(why);
            }
        }
        self.health.set_pins_problem(self.pins_problem.clone());
    }

    /// Counts the maps no other pass lists (source ranges, socket reverse NAT) for the
    /// occupancy metrics; bounded by their capacity. Run with the garbage collection.
    pub fn sample_maps(&mut self) {
        self.occupancy.sample(&self.metrics);
    }

    fn write_status(&self) {
        if let Some(path) = &self.status_file
            && let Err(e) = status::write(path, &self.status)
        {
            warn!("writing status file {}: {e}", path.display());
        }
    }
}

/// Telemetry (metrics.rs, health.rs): what the sync loop reports.
impl Agent {
    /// The metrics this agent updates (served by [`Agent::serve_telemetry`]).
    pub fn metrics(&self) -> std::sync::Arc<crate::serving::metrics::Metrics> {
        self.metrics.clone()
    }

    /// The health state; the Kubernetes source sets node eligibility on it.
    pub fn health(&self) -> std::sync::Arc<crate::serving::health::HealthState> {
        self.health.clone()
    }

    /// A source reported a change that waits for the next sync (health clock, queued timestamp).
    pub fn queued(&mut self) {
        let now = std::time::SystemTime::now();
        self.health.queued_at(now);
        self.metrics.queued(now);
    }

    /// Starts /healthz, /livez and /metrics on the agent's runtime (each bind retries in the
    /// background while the port is taken; the datapath does not wait for them).
    pub fn serve_telemetry(&self, args: &RunArgs) {
        self.health.set_timeout(2 * args.sync_period);
        if let Some(addr) = args.healthz_bind_address.0 {
            let (health, metrics) = (self.health(), self.metrics());
            tokio::spawn(async move {
                let l = crate::serving::http::bind_with_retry("healthz", addr).await;
                crate::serving::health::serve_health(l, health, metrics).await;
            });
        }
        if let Some(addr) = args.metrics_bind_address.0 {
            let metrics = self.metrics();
            tokio::spawn(async move {
                let l = crate::serving::http::bind_with_retry("metrics", addr).await;
                crate::serving::metrics::serve_metrics(l, metrics).await;
            });
        }
    }

    /// The IPv6 family's part of a sync ([`crate::family6`]): ops written. Its problems are
    /// logged here (each once); a failed write is logged and retried by the next sync.
    /// Also returns the least-connection ids it freed and whether its writes call for a
    /// conntrack walk (as [`freed_least_connection_ids`] and [`walks_conntrack_after`] on IPv4).
    fn sync_ipv6(&mut self, opened: &mut OpenedFrontends) -> (usize, Vec<u32>, bool) {
        // Every sync, as the IPv4 family's `external.refresh()`.
        self.family6.refresh();
        if self.family6.active() {
            self.need(loader::Needs {
                ipv6: true,
                ..loader::Needs::default()
            });
        }
        if !self.family6.active()
            || !(self.family6).wants_sync(self.cache.last_changes(), &self.cache)
        {
            return (0, Vec::new(), false);
        }
        let started = Instant::now();
        let (mut freed, mut walk) = (Vec::new(), false);
        let flow_gc = &self.flow_gc;
        let before_apply = |ops: &[MapOp<std::net::Ipv6Addr>], programmed6: &Programmed<_>| {
            freed = freed_least_connection_ids(ops, programmed6);
            walk = walks_conntrack_after(ops, programmed6);
            opened.add(ops, programmed6);
            // Before the apply, so a walk running meanwhile leaves these ids alone.
            crate::dataplane::flow_gc::lock(flow_gc.shared())
                .note_changed(changed_backend_ids(ops));
        };
        let synced = (self.family6).sync(
            &self.cache,
            &self.node,
            &self.programmed,
            &mut self.planner,
            before_apply,
        );
        let ops = match synced {
            Ok(synced) => {
                let now = std::time::SystemTime::now();
                (self.metrics).ipv6_sync_applied(started.elapsed(), now);
                let trigger_times6 = self.changes.pending().trigger_times6;
                (self.metrics).observe_network_programming6(&trigger_times6, now);
                let (internal, external) = synced.no_local_endpoints;
                self.metrics.set_no_local_endpoints6(internal, external);
                for (map, n) in self.family6.occupancy() {
                    self.occupancy.report(&self.metrics, map, n);
                }
                if synced.ops > 0 {
                    info!(
                        ops = synced.ops,
                        frontends = synced.frontends,
                        "IPv6 maps updated"
                    );
                } else {
                    debug!(
                        took_us = started.elapsed().as_micros() as u64,
                        "IPv6 family synced, nothing to change"
                    );
                }
                synced.ops
            }
            Err(e) => {
                error!("writing the IPv6 maps failed: {e}; retried at the next sync");
                0
            }
        };
        (ops, freed, walk)
    }

    fn sync_failed(&mut self) {
        self.metrics.sync_failed(&self.changes.pending());
        // A failed sync is a change still waiting: /healthz turns 503 if it keeps failing.
        self.health.queued();
    }

    fn sync_applied(
        &mut self,
        took: Duration,
        kind: crate::serving::metrics::SyncKind,
        problems: &[Problem],
    ) {
        let now = std::time::SystemTime::now();
        self.metrics
            .sync_applied(took, kind, &self.changes.pending(), now);
        self.changes.commit();
        let (internal, external) = self.no_local.counts();
        self.metrics.set_no_local_endpoints(internal, external);
        self.metrics.set_sync_problems(problems.len());
        let p = &self.programmed;
        for (map, n) in [
            ("services", p.services.len()),
            ("backends", p.backends.len()),
            ("rev_nat", p.rev_nats.len()),
            ("maglev", p.maglev_chunks() as usize),
        ] {
            self.occupancy.report(&self.metrics, map, n as u64);
        }
        self.health.updated_at(now);
    }
}

/// Frontends per group when empty maps are filled (see [`Agent::sync`]): ~22,000 ops of a few
/// MB, large enough that the map writes stay batched.
const FILL_GROUP: usize = 2048;

/// What the fill groups of one sync wrote.
#[derive(Default)]
struct Filled {
    /// Every frontend was carried by a group (no full plan needed).
    complete: bool,
    ops: usize,
    walk_conntrack: bool,
    took: Duration,
}

/// Writes `ops` in order and records the ones the maps took in the planner and the shadow (and
/// tells the IPv6 family, which shares the backend and Maglev table ids); on a failed write,
/// the planner plans in full next time and the failed op is reported.
fn apply_recorded(
    maps: &mut ServiceMaps,
    planner: &mut Planner,
    programmed: &mut Programmed,
    family6: &mut crate::family6::Family6,
    mut ops: Vec<MapOp>,
) -> Result<(), ApplyError> {
    let (applied, failure) = maps.apply_all(&ops);
    let failed_op = failure.is_some().then(|| ops[applied].clone());
    programmed.reserve_for(&ops[..applied]);
    ops.truncate(applied);
    for op in &ops {
        family6.ipv4_applied(op);
    }
    record_applied(planner, programmed, ops);
    match (failure, failed_op) {
        (Some(source), Some(op)) => {
            planner.failed();
            Err(ApplyError {
                op,
                source: Box::new(source),
            })
        }
        _ => Ok(()),
    }
}

/// Records the ops the maps took, in order, in the planner and the shadow, giving the op
/// vector's memory back as it goes: a full plan's ops (a million at 50,000 Services when the
/// maps are not filled in groups) would otherwise be held while the shadow fills. The vector is
/// reversed in place and consumed from its end; every `RELEASE_EVERY` ops it is shrunk (for a
/// vector this large the allocator returns the tail pages at once).
fn record_applied(planner: &mut Planner, programmed: &mut Programmed, mut ops: Vec<MapOp>) {
    const RELEASE_EVERY: usize = 1 << 16;
    ops.reverse();
    while let Some(op) = ops.pop() {
        planner.observe(programmed, &op);
        programmed.apply(&op);
        if ops.len().is_multiple_of(RELEASE_EVERY) && ops.capacity() - ops.len() >= RELEASE_EVERY {
            ops.shrink_to_fit();
        }
    }
}

/// The metrics; map capacities are filled in by [`crate::dataplane::occupancy::Occupancy::open`].
fn telemetry_for(pins: &PinLayout) -> std::sync::Arc<crate::serving::metrics::Metrics> {
    std::sync::Arc::new(crate::serving::metrics::Metrics::with_datapath(
        crate::serving::metrics::pinned_stats_reader(pins.clone()),
    ))
}

/// This process's resident memory in MiB (`VmRSS`), for the start-up log; 0 if unreadable.
fn rss_mib() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            let line = s.lines().find(|l| l.starts_with("VmRSS:"))?;
            line.split_whitespace().nth(1)?.parse::<u64>().ok()
        })
        .map_or(0, |kib| kib / 1024)
}

/// Pure: does applying `ops` to `programmed` remove a UDP backend (then the conntrack walk runs
/// right after the sync)?
/// Whether the conntrack walk runs right after applying `ops` (see [`Agent::sync`]): a removed
/// backend that is UDP, or any removed backend when a least-connection frontend is rewritten.
pub fn walks_conntrack_after<A: FamilyAbi>(ops: &[MapOp<A>], programmed: &Programmed<A>) -> bool {
    let mut removed = false;
    let mut lc_rewritten = false;
    for op in ops {
        match op {
            MapOp::DeleteBackend { id } => {
                if (programmed.backends.get(id))
                    .is_some_and(|b| A::backend_parts(b).2 == proto::UDP)
                {
                    return true;
                }
                removed |= programmed.backends.contains_key(id);
            }
            MapOp::PutService { value, .. } => {
                lc_rewritten |= value.scheduler == proxy_common::sched::code::LEAST_CONNECTION;
            }
            _ => {}
        }
    }
    removed && lc_rewritten
}

/// Pure: does `op` remove an entry (room for a frontend a plan skipped)?
fn frees_room<A: FamilyAbi>(op: &MapOp<A>) -> bool {
    matches!(
        op,
        MapOp::DeleteService { .. }
            | MapOp::DeleteBackend { .. }
            | MapOp::DeleteRevNat { .. }
            | MapOp::DeleteMaglevTable { .. }
            | MapOp::DeleteAffinityMatch { .. }
    )
}

/// Pure: the backend ids `ops` put or delete.
fn changed_backend_ids<A: FamilyAbi>(ops: &[MapOp<A>]) -> impl Iterator<Item = u32> + '_ {
    ops.iter().filter_map(|op| match op {
        MapOp::PutBackend { id, .. } | MapOp::DeleteBackend { id } => Some(*id),
        _ => None,
    })
}

/// Pure: which backend ids applying `ops` to `programmed` frees from a least-connection
/// frontend rewritten by them (their counts are reset at once, `flow_gc::reset_freed`).
pub fn freed_least_connection_ids<A: FamilyAbi>(
    ops: &[MapOp<A>],
    programmed: &Programmed<A>,
) -> Vec<u32> {
    let lc_rewritten = ops.iter().any(|op| {
        matches!(op, MapOp::PutService { value, .. }
            if value.scheduler == proxy_common::sched::code::LEAST_CONNECTION)
    });
    if !lc_rewritten {
        return Vec::new();
    }
    (ops.iter())
        .filter_map(|op| match op {
            MapOp::DeleteBackend { id } if programmed.backends.contains_key(id) => Some(*id),
            _ => None,
        })
        .collect()
}

/// Pure: should the agent drop this conntrack entry? (`crate::dataplane::flow_gc::flow_is_dead`
/// against the programmed backends.)
pub fn flow_is_dead(
    key: &CtKey,
    value: &CtValue,
    now_ns: u64,
    config: &DatapathConfig,
    programmed: &Programmed,
) -> bool {
    crate::dataplane::flow_gc::flow_is_dead(key, value, now_ns, config, &programmed.backends)
}

fn node_name(args: &RunArgs) -> String {
    if let Some(n) = &args.hostname_override {
        return n.clone();
    }
    match nix::unistd::gethostname() {
        Ok(name) => name.to_string_lossy().to_lowercase(),
        Err(_) => "localhost".into(),
    }
}

fn datapath_config(args: &RunArgs) -> DatapathConfig {
    let secs = |d: Duration| u32::try_from(d.as_secs()).unwrap_or(u32::MAX);
    let (prefixes, messages) =
        crate::cli::config::in_cluster_prefixes(args.detect_local_mode, &args.cluster_cidr);
    for m in &messages {
        warn!("{m}");
    }
    if prefixes.is_empty() {
        info!(
            "no cluster CIDR: pods reach externalTrafficPolicy Local frontends like external clients"
        );
    }
    let t = crate::cli::config::conntrack_timeouts(args);
    DatapathConfig {
        tcp_established_timeout_s: secs(t.tcp_established),
        tcp_close_wait_timeout_s: secs(t.tcp_close_wait),
        tcp_transitory_timeout_s: secs(args.conntrack_tcp_transitory_timeout),
        udp_timeout_s: secs(t.udp),
        udp_stream_timeout_s: secs(t.udp_stream),
        flags: 0,
        cluster_cidrs: crate::pipeline::encode::cluster_cidrs(&prefixes).0,
        maglev_table_size: args.maglev_table_size,
        ..DatapathConfig::DEFAULT
    }
}

/// `kube-proxy-ebpf run`.
pub async fn run(args: RunArgs) -> anyhow::Result<()> {
    let pins = PinLayout::new(&args.pins.pin_dir);
    if args.cleanup {
        return crate::cli::cleanup::cleanup(&pins);
    }
    let init_only = args.kube_proxy.init_only == Some(true);
    let node_settings = write_nf_conntrack(&args, init_only);
    if init_only {
        return node_settings;
    }
    if let Err(e) = crate::dataplane::port_range::check_node() {
        warn!("{e}");
    }
    if let Some(adj) = args.kube_proxy.oom_score_adj {
        // kube-proxy's --oom-score-adj: lowering the score needs CAP_SYS_RESOURCE, which the
        // DaemonSet does not grant (its priority class already shields it).
        match std::fs::write("/proc/self/oom_score_adj", adj.to_string()) {
            Ok(()) => info!(oom_score_adj = adj, "OOM score adjusted"),
            Err(e) => {
                warn!("--oom-score-adj {adj}: writing /proc/self/oom_score_adj: {e}; left as it is")
            }
        }
    }
    let node = NodeContext {
        node_name: node_name(&args),
        zone: None,
        // --scheduler, else KubeProxyConfiguration ipvs.scheduler (merged by config::resolve).
        scheduler: args.scheduler,
    };
    let choices = crate::dataplane::devices::Choices {
        pods: crate::dataplane::devices::Choice::parse(&args.pod_interfaces),
        external: crate::dataplane::devices::Choice::parse(&args.devices),
    };
    let patterns_str = format!(
        "pods {}, external devices {}",
        choices.pods, choices.external
    );
    let source_name = match &args.manifests {
        Some(dir) => format!("manifests {}", dir.display()),
        None => "kubernetes api".to_owned(),
    };
    info!(node = %node.node_name, source = %source_name, interfaces = %patterns_str, "starting");

    let mut sigterm = signal(SignalKind::terminate())?;
    let mut sigint = signal(SignalKind::interrupt())?;
    let mut events = None;
    let mut api_url = None;
    let mut source = match &args.manifests {
        Some(dir) => Source::Manifests(ManifestSource::new(dir.clone())),
        None => {
            let connection = Connection {
                kubeconfig: args.kubeconfig.clone(),
                master: args.master.clone(),
                service_account_dir: args.service_account_dir.clone(),
            };
            let (client, url) = connection.client().await?;
            info!(api_server = %url, "Kubernetes API");
            api_url = Some(url);
            events = Some(EventSink::start(client.clone(), &node.node_name));
            Source::Kube(KubeSource::start(
                client,
                &node.node_name,
                args.daemonset.clone(),
            ))
        }
    };
    let cpus = crate::dataplane::sizing::online_cpus();
    let node_has_ipv6 = crate::dataplane::sizing::node_has_ipv6();
    let sizes = crate::dataplane::sizing::map_sizes(&args.map_request(), cpus, node_has_ipv6);
    if sizes.ipv6_minimal() {
        info!(
            mode = ?args.ipv6_maps,
            node_has_ipv6,
            "IPv6 maps created with one entry each (no IPv6 address or IPv6 configuration on \
             this node; restart the agent once it has IPv6, or pass --ipv6-maps full)"
        );
    } else {
        info!(
            mode = ?args.ipv6_maps,
            services6 = sizes.services6,
            backends6 = sizes.backends6,
            rev_nat6 = sizes.rev_nats6,
            conntrack6 = sizes.conntrack6,
            snat6 = sizes.snat6,
            affinity6 = sizes.affinity6,
            "IPv6 map sizes (used when the maps are created)"
        );
    }
    let flow_maps = crate::dataplane::sizing::flow_maps(&args.map_request(), cpus);
    info!(
        cpus,
        max_per_core = args.conntrack_max_per_core,
        min = args.conntrack_min,
        conntrack_entries = flow_maps.conntrack,
        conntrack_from = ?flow_maps.conntrack_basis,
        snat_entries = flow_maps.snat,
        snat_from = ?flow_maps.snat_basis,
        "flow map sizes (two entries per flow; used when the maps are created)"
    );
    let sock_cgroup = args.socket_lb_cgroup.resolve()?;
    let sock_lb = match &sock_cgroup {
        None => SockLbConfig::default(),
        Some(_) => SockLbConfig {
            netns_cookie: dataplane::sys::own_netns_cookie()
                .map_err(|e| anyhow::anyhow!("reading this network namespace's cookie (SO_NETNS_COOKIE, Linux 5.14+): {e}; pass --socket-lb-cgroup none to run without socket hooks"))?,
        },
    };
    // One agent per pin directory: wait for any other to exit before touching the pins.
    pins.create()?;
    let pin_lock = {
        use crate::dataplane::pin_lock::{PinDirLock, held_message};
        let waiting = Instant::now();
        let mut warned: Option<Instant> = None;
        loop {
            if let Some(lock) = PinDirLock::try_acquire(&pins)? {
                if warned.is_some() {
                    info!(waited_s = waiting.elapsed().as_secs(), pin_dir = %pins.dir.display(), "pin directory free: the other agent exited");
                }
                break lock;
            }
            if warned.is_none_or(|at| at.elapsed() >= READY_LOG_INTERVAL) {
                warn!(
                    waited_s = waiting.elapsed().as_secs(),
                    "{}",
                    held_message(&pins)
                );
                warned = Some(Instant::now());
            }
            tokio::select! {
                _ = sigterm.recv() => return Ok(()),
                _ = sigint.recv() => return Ok(()),
                () = tokio::time::sleep(Duration::from_millis(100)) => {}
            }
        }
    };
    let mut agent = Agent::start(
        pins,
        datapath_config(&args),
        node,
        choices.clone(),
        sizes,
        sock_lb,
        args.bpf_log,
    )?;
    // Held for the agent's life, and taken again on a recreated pin directory.
    agent.keeper.keep_lock(pin_lock);
    crate::dataplane::bpf_log::spawn_logger(&mut agent.ebpf, args.bpf_log)?;
    // IPv6 pods inside --cluster-cidr are in-cluster clients of eTP=Local frontends (the IPv4
    // prefixes are in the datapath config).
    let cidrs6 =
        crate::cli::config::in_cluster_prefixes6(args.detect_local_mode, &args.cluster_cidr);
    crate::dataplane::maps::ClusterCidrs6Map::from_ebpf(&mut agent.ebpf)?
        .sync(&cidrs6)
        .map_err(|e| anyhow::anyhow!("writing the IPv6 cluster CIDRs: {e}"))?;
    agent.status_file = args.status_file.clone();
    agent.events = events;
    agent.tunnel_devices = args.tunnel_devices == crate::cli::TunnelDevices::Auto;
    info!(rss_mib = rss_mib(), "datapath loaded");
    // The external devices until the first interface scan names them: the globs given, if any.
    let devices = match &choices.external {
        crate::dataplane::devices::Choice::Globs(p) => p.clone(),
        crate::dataplane::devices::Choice::Auto => Patterns::default(),
    };
    agent
        .external
        .configure(args.nodeport_addresses.clone(), devices.clone());
    agent
        .family6
        .configure(args.nodeport_addresses.clone(), devices);
    agent
        .external
        .set_service_cidrs(crate::pipeline::addresses::ipv4_prefixes(
            &args.service_cidr,
        ));
    (agent.family6).set_service_cidrs(crate::dataplane::service_cidrs::prefixes(
        &args.service_cidr,
    ));
    // Adopted maps already carry the Services: interfaces that have no programs yet (pods
    // created while no agent ran) get them now, before any list, and as they appear while the
    // lists are awaited; the running programs are replaced only after the first sync.
    let mut links = netlink::watch_links()?;
    if agent.adopted {
        agent.attach_new_interfaces();
    }
    // From here the datapath knows an agent runs (before the health port is bound: that bind is
    // ours, not another proxy's).
    let heartbeat = start_heartbeat(&mut agent, &args)?;
    agent.serve_telemetry(&args);

    if let Some(url) = &api_url {
        let address = check_api_address(&agent, url, &args);
        let why = match address {
            Some(advice) => advice,
            None => format!("waiting for the API server at {url}"),
        };
        agent
            .health
            .waiting_for_lists(std::time::SystemTime::now(), why);
    }

    // The sources' initial lists, then a sync, then attach: programs only ever see maps that
    // already carry the current state, and an empty store is never programmed over a live one.
    let waiting = Instant::now();
    loop {
        tokio::select! {
            () = source.wait_ready() => break,
            _ = sigterm.recv() => return stop(agent, &source, heartbeat).await,
            _ = sigint.recv() => return stop(agent, &source, heartbeat).await,
            Some(()) = links.recv(), if agent.adopted => agent.attach_new_interfaces(),
            () = tokio::time::sleep(READY_LOG_INTERVAL) => {
                warn!(waited_s = waiting.elapsed().as_secs(), "still waiting for the initial lists of Services, EndpointSlices and the Node; dataplane unchanged");
            }
        }
    }
    info!(
        took_ms = waiting.elapsed().as_millis() as u64,
        rss_mib = rss_mib(),
        "initial state complete"
    );
    // Wake-ups from the initial lists are covered by this first sync: drop them (before reading
    // the state, so a change after this point still wakes the loop).
    let _ = futures::FutureExt::now_or_never(source.changed());
    let first_ok = match agent.sync_from(&source, true) {
        Ok(()) => true,
        Err(e) => {
            error!("initial sync: {e}; retrying");
            false
        }
    };
    // Flows netfilter translates for Services (kube-proxy ran here) carry on across the attach.
    let takeover = agent.take_over_flows();
    agent.reconcile_interfaces();
    if let Err(e) = agent.attach_socket_lb(sock_cgroup.as_deref()) {
        error!("socket hooks: {e:#}; the node's own processes cannot reach Services");
    }
    // Connections netfilter keeps translating need its NAT hooks, which go with the last NAT
    // chain of the namespace: kube-proxy's are then emptied, not deleted.
    let netfilter_keeps = takeover
        .map(|t| agent.finish_takeover(t).netfilter_keeps())
        .unwrap_or(0);
    // Off the start-up path (the tools take a while): the datapath is attached already.
    let remove = args.remove_kube_proxy_rules;
    let _ = std::thread::Builder::new()
        .name("kube-proxy-rules".into())
        .spawn(move || kube_proxy_leftovers(remove, netfilter_keeps));
    // The new programs are attached: a layout migration copies what the old ones created
    // since the load, then retires the old maps.
    if agent.layout.pending() > 0 {
        let retiring = agent.layout.retiring();
        agent.keeper.forget_maps(retiring.iter().copied());
        match agent.layout.after_attach() {
            Ok(entries) => info!(entries, "map layout migration finished"),
            Err(e) => error!("finishing the map layout migration: {e}; the next start retries it"),
        }
    }
    info!(rss_mib = rss_mib(), "ready");

    let mut gc = tokio::time::interval(CONNTRACK_GC_PERIOD);
    let mut pin_check =
        tokio::time::interval(args.pin_check_period.max(Duration::from_millis(100)));
    pin_check.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    // The first tick is at once: the first walk runs now (on its own thread).
    let mut schedule = crate::schedule::Schedule::new(
        Instant::now(),
        args.min_sync_period,
        args.sync_period,
        source.cheap_to_read(),
    );
    if !first_ok || agent.take_devices_changed() {
        schedule.changed();
    }
    let mut pass_started: Option<Instant> = None;
    let config_watch = args.config.clone().map(crate::cli::config::FileWatch::new);
    let mut config_check = tokio::time::interval(crate::cli::config::FILE_WATCH_PERIOD);
    config_check.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        let step = schedule.next(Instant::now());
        let wait_until = match step {
            crate::schedule::Step::Wait(t) => t,
            _ => Instant::now(),
        };
        let work = matches!(step, crate::schedule::Step::Wait(_)).not();
        tokio::select! {
            // Changes first (and the short events), then the work: a slice of the periodic pass
            // never goes before a change that is already there.
            biased;
            _ = sigterm.recv() => break,
            _ = sigint.recv() => break,
            () = source.changed() => {
                schedule.changed();
                agent.queued();
            }
            Some(()) = links.recv() => {
                agent.reconcile_interfaces();
                // An address event: NodePort frontends and the SNAT address follow (each
                // family's; both listed).
                if agent.external.refresh() | agent.family6.refresh() | agent.take_devices_changed() {
                    schedule.changed();
                }
            }
            Some(done) = agent.next_walk() => agent.walked(done),
            _ = gc.tick() => agent.gc_flows(),
            _ = pin_check.tick() => agent.check_pins(),
            _ = config_check.tick(), if config_watch.is_some() => {
                if let Some(watch) = config_watch.as_ref().filter(|w| w.changed()) {
                    error!(
                        file = %watch.path().display(),
                        "the configuration file changed: exiting so that the pod restarts with it, as kube-proxy does (the datapath stays)"
                    );
                    stop(agent, &source, heartbeat).await?;
                    anyhow::bail!("the configuration file {} changed", watch.path().display());
                }
            }
            () = std::future::ready(()), if work => match step {
                crate::schedule::Step::Sync { full } => {
                    let result = agent.sync_from(&source, full);
                    if let Err(e) = &result {
                        error!("sync failed: {e}; retrying in {SYNC_RETRY:?}");
                    }
                    schedule.synced(Instant::now(), full, result.is_ok(), SYNC_RETRY);
                    if agent.take_retry_skipped() {
                        schedule.changed();
                    }
                }
                crate::schedule::Step::Slice { from } => {
                    let started = *pass_started.get_or_insert_with(Instant::now);
                    let range = from..from + crate::schedule::SLICE;
                    let result = agent.sync_from_refreshing(&source, false, range);
                    if let Err(e) = &result {
                        error!("sync failed: {e}; retrying in {SYNC_RETRY:?}");
                    }
                    let end = result.as_ref().is_ok_and(|end| *end);
                    schedule.sliced(Instant::now(), result.is_ok(), end, SYNC_RETRY);
                    if !schedule.passing() {
                        pass_started = None;
                        debug!(
                            took_ms = started.elapsed().as_millis() as u64,
                            "periodic pass done: every Service translated again"
                        );
                    }
                }
                crate::schedule::Step::Wait(_) => {}
            },
            () = tokio::time::sleep_until(wait_until.into()), if !work => {}
        }
        if work {
            // The reflectors run on this runtime too: let them deliver the watch events that
            // arrived during this step, so a change goes before the next slice (without this a
            // pass of back-to-back slices held every change until its end).
            tokio::task::yield_now().await;
        }
    }
    stop(agent, &source, heartbeat).await
}

/// Says so (one log line, and a reason in /healthz) when the API server at `url` is reached
/// through an address this agent's own datapath translates (`sources::kube::bootstrap`);
/// returns the advice then.
/// kube-proxy's rules on the node, once the programs are attached: removed with
/// `--remove-kube-proxy-rules`, else named in a warning.
fn kube_proxy_leftovers(remove: bool, netfilter_keeps: usize) {
    use crate::dataplane::kube_proxy_rules;
    let found = match kube_proxy_rules::find() {
        Ok(found) if found.is_empty() => return,
        Ok(found) => found,
        Err(e) => return warn!("looking for kube-proxy's rules: {e:#}"),
    };
    if !remove {
        return warn!(
            "kube-proxy's rules remain: {}; harmless to the traffic this datapath translates, but stale (--remove-kube-proxy-rules or `kube-proxy --cleanup` removes them)",
            found.summary()
        );
    }
    match kube_proxy_rules::remove(&found, netfilter_keeps) {
        Ok(removed) => info!("removed kube-proxy's rules: {}", removed.summary()),
        Err(e) => warn!("kube-proxy's rules remain: {}: {e:#}", found.summary()),
    }
}

fn check_api_address(agent: &Agent, url: &http::Uri, args: &RunArgs) -> Option<String> {
    use crate::sources::kube::bootstrap::{self, Translated};
    let host = url.host()?;
    let port = url
        .port_u16()
        .unwrap_or(if url.scheme_str() == Some("http") {
            80
        } else {
            443
        });
    let pinned = |addr: std::net::SocketAddr| match addr.ip() {
        std::net::IpAddr::V4(ip) => {
            agent
                .programmed
                .services
                .contains_key(&proxy_common::ServiceKey::new(
                    ip.octets(),
                    addr.port().to_be_bytes(),
                    proto::TCP,
                    0,
                ))
        }
        std::net::IpAddr::V6(_) => false,
    };
    let env = |k: &str| std::env::var(k).ok();
    let known = Translated {
        master_service: bootstrap::kubelet_master_service(env),
        service_cidrs: &args.service_cidr,
        pinned_frontend: &pinned,
    };
    let advice = bootstrap::advice(&bootstrap::translated_here(host, port, &known)?);
    error!("{advice}");
    agent.health.set_api_address_problem(Some(advice.clone()));
    Some(advice)
}

/// kube-proxy's nf_conntrack settings (`dataplane::nf_conntrack`): written where not in place.
/// The agent's own container cannot write them (read-only /proc/sys): there a difference is
/// named once; `--init-only` (the privileged init container) fails on one.
fn write_nf_conntrack(args: &RunArgs, init_only: bool) -> anyhow::Result<()> {
    use crate::dataplane::nf_conntrack::{self, Conntrack};
    let cpus = u64::from(crate::dataplane::sizing::online_cpus());
    let max = match u64::from(args.conntrack_max_per_core) {
        0 => 0,
        per_core => (per_core * cpus).max(u64::from(args.conntrack_min)),
    };
    let wanted = nf_conntrack::wanted(&Conntrack {
        max,
        tcp_established: args.conntrack_tcp_established_timeout,
        tcp_close_wait: args.conntrack_tcp_timeout_close_wait,
        udp: args.conntrack_udp_timeout,
        udp_stream: args.conntrack_udp_timeout_stream,
        tcp_be_liberal: args.kube_proxy.conntrack_tcp_be_liberal == Some(true),
    });
    let report = nf_conntrack::apply(&wanted);
    for (path, value) in &report.written {
        info!(setting = %path.display(), value, "nf_conntrack setting written");
    }
    if report.failed.is_empty() {
        if init_only {
            info!(
                written = report.written.len(),
                in_place = report.in_place,
                host_only = report.host_only,
                "--init-only: node settings done"
            );
        }
        return Ok(());
    }
    let failed: Vec<String> = (report.failed.iter())
        .map(|(path, e)| format!("{}: {e}", path.display()))
        .collect();
    if init_only {
        anyhow::bail!(
            "--init-only: nf_conntrack settings not written: {}",
            failed.join("; ")
        );
    }
    warn!(
        "nf_conntrack settings not in place and not writable from here (the DaemonSet's \
         privileged init container writes them with --init-only): {}",
        failed.join("; ")
    );
    Ok(())
}

/// Starts the heartbeat in `AGENT_V1` (`dataplane::presence`), taking the datapath back if it had
/// handed over to another proxy while no agent ran.
fn start_heartbeat(
    agent: &mut Agent,
    args: &RunArgs,
) -> anyhow::Result<crate::dataplane::presence::Heartbeat> {
    use crate::dataplane::presence::{AgentMap, Heartbeat};
    let handover_after = (!args.handover_after.is_zero()).then_some(args.handover_after);
    let (heartbeat, found) =
        Heartbeat::start(AgentMap::from_ebpf(&mut agent.ebpf)?, handover_after)?;
    if let Some(h) = found {
        warn!(
            ago_s = h.ago.as_secs(),
            port = h.port,
            "the datapath had handed new flows over to the node's stack (another proxy bound port \
             {} while no agent ran); this agent is the node's Service proxy again: stop the other \
             one (kube-proxy) or remove this agent",
            h.port
        );
    }
    Ok(heartbeat)
}

/// The agent stops (SIGTERM, SIGINT): the datapath stays for the next agent, unless this is an
/// uninstall (`sources::kube::uninstall`), which removes it.
async fn stop(
    agent: Agent,
    source: &Source,
    heartbeat: crate::dataplane::presence::Heartbeat,
) -> anyhow::Result<()> {
    use crate::sources::kube::uninstall::Stop;
    let verdict = match source {
        Source::Kube(k) => k.stop_kind().await,
        Source::Manifests(_) => Stop::Keep("standalone: a stop keeps the datapath".into()),
    };
    heartbeat.stop();
    match verdict {
        Stop::Keep(why) => {
            info!(%why, "stopping; maps and links stay pinned so traffic keeps flowing");
            Ok(())
        }
        Stop::Uninstall(why) => {
            warn!(%why, "uninstalling: removing the datapath from this node");
            agent.uninstall()?;
            info!("uninstalled: programs detached, maps and links unpinned");
            Ok(())
        }
    }
}

#[cfg(test)]
mod tests {
    use proxy_common::{Backend, ct_dir, ct_state};

    use super::*;

    fn flow(proto: u8, state: u8, backend_id: u32, last_seen_ns: u64) -> (CtKey, CtValue) {
        let key = CtKey {
            saddr: [10, 244, 1, 2],
            daddr: [10, 96, 0, 10],
            sport: [0x9c, 0x40],
            dport: [0, 80],
            proto,
            dir: ct_dir::ORIGINAL,
            _pad: [0; 2],
        };
        let value = CtValue {
            last_seen_ns,
            backend_id,
            backend_addr: [10, 244, 1, 11],
            backend_port: [0x1f, 0x90],
            state,
            ..Default::default()
        };
        (key, value)
    }

    fn programmed_with_backend_1() -> Programmed {
        let mut p = Programmed::default();
        p.backends.insert(
            1,
            Backend {
                addr: [10, 244, 1, 11],
                port: [0x1f, 0x90],
                proto: proto::TCP,
                flags: 0,
            },
        );
        p
    }

    #[test]
    fn idle_flows_expire_by_state_timeout() {
        let cfg = DatapathConfig {
            tcp_established_timeout_s: 100,
            tcp_transitory_timeout_s: 10,
            udp_timeout_s: 5,
            flags: 0,
            ..DatapathConfig::DEFAULT
        };
        let p = programmed_with_backend_1();
        let s = 1_000_000_000u64;
        let now = 1_000 * s;
        let (k, v) = flow(proto::TCP, ct_state::ESTABLISHED, 1, now - 50 * s);
        assert!(
            !flow_is_dead(&k, &v, now, &cfg, &p),
            "established, 50 s idle of 100"
        );
        let (k, v) = flow(proto::TCP, ct_state::SYN_SENT, 1, now - 50 * s);
        assert!(
            flow_is_dead(&k, &v, now, &cfg, &p),
            "opening, 50 s idle of 10"
        );
        let (k, v) = flow(proto::UDP, ct_state::UDP, 1, now - 4 * s);
        assert!(!flow_is_dead(&k, &v, now, &cfg, &p), "udp, 4 s idle of 5");
        let (k, v) = flow(proto::UDP, ct_state::UDP, 1, now - 6 * s);
        assert!(flow_is_dead(&k, &v, now, &cfg, &p), "udp, 6 s idle of 5");
        // Answered UDP flows hold the stream timeout (the datapath's one rule).
        let (k, mut v) = flow(proto::UDP, ct_state::UDP, 1, now - 6 * s);
        v.flags = proxy_common::ct_flags::SEEN_REPLY;
        assert!(
            !flow_is_dead(&k, &v, now, &cfg, &p),
            "udp stream, 6 s idle of 120"
        );
        let (k, v) = flow(proto::TCP, ct_state::FIN_REPLY, 1, now - 50 * s);
        assert!(
            !flow_is_dead(&k, &v, now, &cfg, &p),
            "half-closed, 50 s idle of 3600"
        );
    }

    #[test]
    fn removing_a_udp_backend_or_one_of_a_least_connection_frontend_walks_conntrack_at_once() {
        let mut p = programmed_with_backend_1();
        p.backends.insert(
            2,
            Backend {
                addr: [10, 244, 1, 12],
                port: [0, 53],
                proto: proto::UDP,
                flags: 0,
            },
        );
        let delete = |id| MapOp::DeleteBackend { id };
        assert!(!walks_conntrack_after(&[delete(1)], &p), "TCP backend");
        assert!(walks_conntrack_after(&[delete(1), delete(2)], &p));
        assert!(!walks_conntrack_after(&[delete(3)], &p), "not programmed");
        assert!(!walks_conntrack_after(&[], &p));
        // A TCP backend removed from a least-connection frontend: its id's count is corrected
        // before the id is reused.
        let lc_frontend = |scheduler| MapOp::PutService {
            key: proxy_common::ServiceKey::default(),
            value: proxy_common::ServiceValue {
                scheduler,
                ..Default::default()
            },
        };
        let lc = proxy_common::sched::code::LEAST_CONNECTION;
        assert!(walks_conntrack_after(&[delete(1), lc_frontend(lc)], &p));
        assert!(!walks_conntrack_after(
            &[delete(1), lc_frontend(proxy_common::sched::code::RANDOM)],
            &p
        ));
        assert!(
            !walks_conntrack_after(&[lc_frontend(lc)], &p),
            "nothing removed"
        );
    }

    #[test]
    fn udp_flows_to_a_removed_backend_are_dropped_tcp_flows_are_left_to_the_datapath() {
        let cfg = DatapathConfig::DEFAULT;
        let p = programmed_with_backend_1();
        let now = 10_000_000_000u64;
        let (k, v) = flow(proto::UDP, ct_state::UDP, 2, now);
        assert!(
            flow_is_dead(&k, &v, now, &cfg, &p),
            "backend 2 does not exist"
        );
        let (k, mut v) = flow(proto::UDP, ct_state::UDP, 1, now);
        assert!(!flow_is_dead(&k, &v, now, &cfg, &p));
        v.backend_addr = [10, 244, 1, 99];
        assert!(
            flow_is_dead(&k, &v, now, &cfg, &p),
            "id 1 now names another address"
        );
        let (k, v) = flow(proto::TCP, ct_state::ESTABLISHED, 2, now);
        assert!(!flow_is_dead(&k, &v, now, &cfg, &p));
    }
}
