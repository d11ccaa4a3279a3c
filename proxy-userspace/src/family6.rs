//! The IPv6 family beside the agent's IPv4 one (upstream's second proxier behind its
//! meta-proxier): the IPv6 maps (`SERVICES6_V1` ...), their shadow, the node's IPv6 NodePort
//! addresses, its loadBalancerSourceRanges (`SRCRANGES6_V1`), its Service address space
//! (`SVCCIDRS6_V1`: the IPv6 Service CIDRs and ClusterIPs), its health-check node ports
//! (upstream's per-family ServiceHealthServer: on the IPv6 NodePort addresses, counting IPv6
//! endpoints), and one sync: the IPv6 family translated and planned, written, and every written
//! op told to the IPv4 planner so it never hands those ids out (one id space for backends and
//! Maglev tables: `LCFLOWS_V1` and `MAGLEV_V1` are shared; the IPv4 family's written ops are told
//! to the IPv6 planner the same way, [`Family6::ipv4_applied`]).
//!
//! Incremental as the IPv4 family: the translation ([`FamilyCache`]) follows the IPv4
//! translation cache's change list (the Services and slices that changed are translated again
//! for IPv6; all of them at a full update or when the node's context changed), and the
//! [`Planner`] plans the changed frontends against the shadow, so an IPv6 endpoint change costs
//! what it changes. It runs only on a node with an IPv6 address (upstream's dual-stack detection
//! goes by the node's IPs too), or while the IPv6 maps still hold entries to remove: an
//! IPv4-only node does no IPv6 work, and the cache holds nothing for IPv4-only Services.
//!
//! May call: `dataplane` (the maps, node addresses), `pipeline`, `serving` (the health-check
//! servers), `sources`.

use std::{net::Ipv6Addr, sync::Arc};

use tracing::{error, info, warn};

use crate::{
    dataplane::{
        self,
        interfaces::Patterns,
        maps::ServiceMaps,
        node_addrs::{self, NodeFamily as _},
        service_cidrs::{self, ServiceCidrs},
        source_ranges::{self, SourceRanges},
    },
    pipeline::{
        addresses::NodePortAddresses,
        fast_hash::HashSet,
        incremental::Planner,
        model::{DesiredFrontend, FrontendKind, Problem, Scope, SkippedFrontend},
        programmed::{Capacities, Programmed, SharedIds},
        translate::{HealthCheck, NodeContext},
        translate_cache::{ChangeList, FamilyCache, ServiceName, TranslateCache},
    },
    serving::{health::HealthState, healthcheck::HealthCheckServers, metrics::NoLocalEndpoints},
};

pub struct Family6 {
    maps: ServiceMaps<Ipv6Addr>,
    /// loadBalancerSourceRanges of the IPv6 LoadBalancer frontends (`SRCRANGES6_V1`).
    ranges: SourceRanges<Ipv6Addr>,
    /// `SVCCIDRS6_V1`, and the IPv6 Service CIDRs of `--service-cidr` and of the cluster's
    /// ServiceCIDR objects (both apply).
    service_cidrs: ServiceCidrs<Ipv6Addr>,
    service_cidr_flag: Vec<(Ipv6Addr, u8)>,
    service_cidr_api: Vec<(Ipv6Addr, u8)>,
    /// The Services of the last sync that have an IPv6 family (see [`Family6::wants_sync`]).
    ipv6_services: HashSet<ServiceName>,
    /// The IPv6 translation, per Service, following the IPv4 cache's change list.
    cache: FamilyCache<Ipv6Addr>,
    /// Plans the changed IPv6 frontends against `programmed`, the IPv4 family's ids avoided.
    planner: Planner<Ipv6Addr>,
    no_local: NoLocalEndpoints,
    /// A write failed: the next sync compares the source ranges and Service CIDRs in full.
    walk_external: bool,
    /// Something besides the Services changed (addresses, CIDRs, a failed write): sync next time.
    pending: bool,
    programmed: Programmed<Ipv6Addr>,
    capacities: Capacities,
    nodeport_cfg: NodePortAddresses,
    devices: Patterns,
    nodeport: Vec<Ipv6Addr>,
    /// `NODE6_V1`: the IPv6 address external flows to remote backends are SNATed to.
    node6: crate::dataplane::maps::Node6Map,
    /// What `node6` holds (written only when it changes; `::`: none, nothing SNATed).
    snat: Ipv6Addr,
    /// The node has a usable IPv6 address.
    enabled: bool,
    /// The IPv6 family's health-check node ports, and the checks they were last given.
    health_checks: HealthCheckServers<Ipv6Addr>,
    served_checks: Option<Vec<HealthCheck>>,
    /// The last sync's problems (bad IPv6 input, frontends that did not fit the IPv6 maps),
    /// reported by the agent with the IPv4 family's ([`Family6::problems`]).
    problems: Vec<Problem>,
    /// The last plan's skipped frontends (for the Events; their Problems are in `problems`).
    skipped: Vec<SkippedFrontend>,
}

/// What one IPv6 sync did.
#[derive(Debug, Default)]
pub struct Synced {
    pub ops: usize,
    pub frontends: usize,
    /// The IPv6 family's health checks (served on the IPv6 NodePort addresses).
    pub health_checks: Vec<HealthCheck>,
    /// Its Service ports with a Local policy and no local endpoints (internal, external), as
    /// `crate::serving::metrics::no_local_endpoints`.
    pub no_local_endpoints: (u64, u64),
}

impl Family6 {
    /// Takes the IPv6 maps out of the loaded object and reads back what they carry (adoption,
    /// as for IPv4), Maglev tables at size `m`. `proxy`: the agent's health, reported by the
    /// health-check node ports.
    pub fn start(
        ebpf: &mut aya::Ebpf,
        maps4: &ServiceMaps,
        capacities4: &Capacities,
        proxy: std::sync::Arc<HealthState>,
    ) -> dataplane::Result<Self> {
        let maps = maps4.ipv6(Some(ebpf), None)?;
        let mut programmed = maps.read_programmed()?;
        maps.adopt_maglev(&mut programmed, capacities4.maglev_table_size);
        let capacities = Capacities {
            maglev_chunks: capacities4.maglev_chunks,
            ..maps.capacities().unwrap_or_else(|_| {
                Capacities::ipv6(capacities4.maglev_chunks, capacities4.maglev_table_size)
            })
        };
        let capacities = Capacities {
            maglev_table_size: capacities4.maglev_table_size,
            ..capacities
        };
        let ranges = SourceRanges::from_ebpf(ebpf)?;
        let service_cidrs = ServiceCidrs::from_ebpf(ebpf)?;
        let node6 = crate::dataplane::maps::Node6Map::from_ebpf(ebpf)?;
        let mut out = Self {
            node6,
            // Unknown: the first refresh writes (an adopted map may hold a stale address).
            snat: Ipv6Addr::from_bits(1),
            maps,
            ranges,
            service_cidrs,
            service_cidr_flag: Vec::new(),
            service_cidr_api: Vec::new(),
            ipv6_services: HashSet::default(),
            cache: FamilyCache::default(),
            planner: Planner::new(&programmed),
            no_local: NoLocalEndpoints::default(),
            walk_external: false,
            pending: true,
            programmed,
            capacities,
            nodeport_cfg: NodePortAddresses::default(),
            devices: Patterns::default(),
            nodeport: Vec::new(),
            enabled: false,
            health_checks: HealthCheckServers::new(proxy),
            served_checks: None,
            problems: Vec::new(),
            skipped: Vec::new(),
        };
        out.refresh();
        Ok(out)
    }

    /// The external devices, as for IPv4 ([`crate::dataplane::node_addrs::External::set_devices`]).
    pub fn set_devices(&mut self, devices: Patterns) -> bool {
        if devices == self.devices {
            return false;
        }
        self.devices = devices;
        self.refresh()
    }

    /// `--nodeport-addresses` and `--devices`, as for IPv4 (CIDRs and `primary` per family).
    pub fn configure(&mut self, nodeport: NodePortAddresses, devices: Patterns) {
        self.nodeport_cfg = nodeport;
        self.devices = devices;
        self.pending = true;
        self.refresh();
    }

    /// The IPv6 Service CIDRs of `--service-cidr`.
    pub fn set_service_cidrs(&mut self, cidrs: Vec<(Ipv6Addr, u8)>) {
        self.pending |= node_addrs::set_cidrs(&mut self.service_cidr_flag, cidrs, "--service-cidr");
    }

    /// The IPv6 Service CIDRs of the cluster's ServiceCIDR objects (read at each sync).
    pub fn set_api_service_cidrs(&mut self, cidrs: Vec<(Ipv6Addr, u8)>) {
        self.pending |=
            node_addrs::set_cidrs(&mut self.service_cidr_api, cidrs, "ServiceCIDR objects");
    }

    /// Lists the node's IPv6 addresses again (at every sync, and on each address event, as the
    /// IPv4 family's: one getifaddrs); true when the NodePort addresses or whether the node has
    /// IPv6 changed (a sync is due).
    pub fn refresh(&mut self) -> bool {
        match node_addrs::list6() {
            Ok(all) => {
                let enabled = all.iter().any(|a| a.addr.usable());
                let selected = node_addrs::select(&all, &self.nodeport_cfg, &self.devices);
                self.write_snat(selected.snat.unwrap_or(Ipv6Addr::UNSPECIFIED));
                let changed = enabled != self.enabled || selected.nodeport != self.nodeport;
                if changed {
                    info!(nodeport = ?selected.nodeport, enabled, "node IPv6 addresses");
                }
                if enabled && !self.enabled && self.minimal_maps() {
                    warn!(
                        services6 = self.capacities.services,
                        "the node has IPv6 now, but the IPv6 maps were created with one entry each \
                         (no IPv6 when they were created, `--ipv6-maps auto`): IPv6 frontends \
                         that do not fit are reported; restart the agent to size the maps (or \
                         run it with --ipv6-maps full)"
                    );
                }
                self.enabled = enabled;
                self.nodeport = selected.nodeport;
                self.pending |= changed;
                changed
            }
            Err(e) => {
                error!("listing the node's IPv6 addresses failed: {e}; keeping the previous ones");
                false
            }
        }
    }

    /// Writes the node's IPv6 SNAT source (the IPv4 rule: a NodePort address on a `--devices`
    /// device first) into `NODE6_V1` when it changed.
    fn write_snat(&mut self, addr: Ipv6Addr) {
        if addr == self.snat {
            return;
        }
        match self.node6.set(addr) {
            Ok(()) => {
                info!(snat = %addr, "IPv6 SNAT source of external flows to remote backends");
                self.snat = addr;
            }
            Err(e) => error!(
                "writing the node's IPv6 SNAT address failed: {e}; retried at the next refresh"
            ),
        }
    }

    /// The Maglev tables the IPv6 frontends name (the IPv4 family's read leaves them out).
    /// What the IPv6 maps carry now.
    /// The node's IPv6 SNAT address as written for the datapath (`None`: none).
    pub fn snat_addr(&self) -> Option<Ipv6Addr> {
        (!self.snat.is_unspecified() && self.snat != Ipv6Addr::from_bits(1)).then_some(self.snat)
    }

    pub fn programmed(&self) -> &Programmed<Ipv6Addr> {
        &self.programmed
    }

    pub fn maglev_tables(&self) -> HashSet<u32> {
        self.programmed.maglev.keys().copied().collect()
    }

    /// The ids the IPv6 maps hold in the shared spaces.
    pub fn shared_ids(&self) -> SharedIds {
        self.programmed.shared_ids()
    }

    /// The IPv4 maps hold `ids` (as adopted at start-up): the IPv6 planner never hands them out.
    pub fn share_with(&mut self, ids: SharedIds) {
        self.planner.share_by_shadow(ids);
    }

    /// The IPv4 family applied `op`: its backend and Maglev table ids stay out of the IPv6
    /// planner's free ids while it holds them (one id space, see the module doc).
    pub fn ipv4_applied(&mut self, op: &crate::pipeline::programmed::MapOp) {
        self.planner.other_applied(&self.programmed, op);
    }

    /// Whether the IPv6 maps are the one-entry ones of a node without IPv6
    /// (`crate::dataplane::sizing`).
    pub fn minimal_maps(&self) -> bool {
        self.capacities.services <= crate::dataplane::loader::MINIMAL_ENTRIES
    }

    /// The problems of the last IPv6 sync (none while the family is off).
    pub fn problems(&self) -> &[Problem] {
        if self.active() { &self.problems } else { &[] }
    }

    /// The frontends the last IPv6 plan skipped (none while the family is off).
    pub fn skipped(&self) -> &[SkippedFrontend] {
        if self.active() { &self.skipped } else { &[] }
    }

    /// Whether a sync has IPv6 work: the node has IPv6, or the maps hold entries to remove.
    pub fn active(&self) -> bool {
        self.enabled || !self.programmed.services.is_empty()
    }

    /// The IPv6 backends as programmed (the flow walks judge `CONNTRACK6_V1` by them).
    pub fn backends(
        &self,
    ) -> &crate::pipeline::programmed::BackendEntries<proxy_common::ipv6::Backend6> {
        &self.programmed.backends
    }

    pub fn frontend_count(&self) -> usize {
        self.programmed.frontend_count()
    }

    /// Entries of the IPv6 maps the shadow counts, by occupancy label.
    pub fn occupancy(&self) -> [(&'static str, u64); 3] {
        let p = &self.programmed;
        [
            ("services6", p.services.len() as u64),
            ("backends6", p.backends.len() as u64),
            ("rev_nat6", p.rev_nats.len() as u64),
        ]
    }

    /// Whether this sync has IPv6 work: a full update, a change besides the Services
    /// (`pending`), a health-check server to start again, or a changed Service (or slice of
    /// one) that has an IPv6 family now or had one at the last sync. A change among IPv4-only
    /// Services costs the IPv6 family nothing.
    pub fn wants_sync(&self, changes: &ChangeList, cache: &TranslateCache) -> bool {
        let touches = |name: &ServiceName| {
            self.ipv6_services.contains(name)
                || cache.service_has_ipv6(name)
                || self.cache.holds(name)
        };
        self.pending
            || changes.all
            || !self.health_checks.settled(&self.nodeport)
            || changes.services.iter().any(touches)
            || (changes.slices.iter())
                .any(|(slice, _)| touches(&slice.0) || cache.is_ipv6_slice(slice))
    }

    /// One IPv6 sync (see the module doc): `cache4`, the IPv4 translation cache just updated
    /// (its objects and change list), `programmed4`/`planner4`, the IPv4 family's shadow and
    /// planner. Stops at the first failed write (the plan's order keeps every prefix
    /// consistent); the next sync plans in full.
    pub fn sync(
        &mut self,
        cache4: &TranslateCache,
        node: &NodeContext,
        programmed4: &Programmed,
        planner4: &mut Planner,
        before_apply: impl FnOnce(
            &[crate::pipeline::programmed::MapOp<Ipv6Addr>],
            &Programmed<Ipv6Addr>,
        ),
    ) -> Result<Synced, dataplane::Error> {
        // Set again below unless every write lands.
        let was_pending = std::mem::replace(&mut self.pending, true);
        let (changes, all) = if self.enabled {
            self.cache.update(cache4, node, &self.nodeport, false)
        } else {
            (self.cache.clear(), true)
        };
        self.track_ipv6_services(cache4, all);
        let desired = self.cache.desired();
        self.planner.desired_changes(&changes, desired);
        let (plan, _) = (self.planner).plan_with_kind_reading(
            desired,
            &self.programmed,
            &self.capacities,
            all,
            || programmed4.shared_ids(),
        );
        if all {
            self.no_local.rebuild(desired);
        } else {
            self.no_local.update(&changes, desired);
        }
        self.problems = if self.enabled {
            self.cache.problems()
        } else {
            Vec::new()
        };
        self.skipped = SkippedFrontend::of_plan(&plan.skipped, desired);
        (self.problems).extend(plan.skipped.iter().map(|(frontend, reason)| Problem {
            source: "dataplane".into(),
            object: format!("frontend {frontend}"),
            reason: reason.clone(),
        }));
        let mut out = Synced {
            no_local_endpoints: self.no_local.counts(),
            ..Synced::default()
        };
        before_apply(&plan.ops, &self.programmed);
        let (applied, failure) = self.maps.apply_all(&plan.ops);
        for op in &plan.ops[..applied] {
            planner4.other_applied(programmed4, op);
            self.planner.observe(&self.programmed, op);
            self.programmed.apply(op);
        }
        out.ops = applied;
        out.frontends = self.programmed.frontend_count();
        if let Some(e) = failure {
            self.planner.failed();
            self.walk_external = true;
            return Err(e);
        }
        self.planner.applied(&plan);
        // The source ranges of the frontends now written (entries added, then removed), and
        // the ClusterIPs now written and the Service CIDRs (new flows to no frontend there are
        // rejected or dropped, as on IPv4): both are walks over the desired state, so only
        // when a changed frontend has a source range or a ClusterIP entry (an endpoint change
        // has neither), a full update, or the CIDRs or addresses changed.
        let walk = std::mem::take(&mut self.walk_external)
            || all
            || was_pending
            || changes.iter().any(|c| {
                let new = self.cache.desired().frontends.get(&c.frontend);
                let ranges = |df: Option<&Arc<DesiredFrontend<Ipv6Addr>>>| {
                    df.is_some_and(|df| !df.source_ranges.is_empty())
                };
                let cluster_ip = |df: Option<&Arc<DesiredFrontend<Ipv6Addr>>>| {
                    df.is_some_and(|df| {
                        df.kind == FrontendKind::ClusterIp && c.frontend.scope == Scope::AllClients
                    })
                };
                ranges(c.old.as_ref())
                    || ranges(new)
                    || cluster_ip(c.old.as_ref()) != cluster_ip(new)
            });
        // A write that failed here is retried by the next sync (as IPv4's): it walks again.
        let mut written = true;
        if walk {
            let desired = self.cache.desired();
            written &= self.ranges.sync(&source_ranges::wanted(desired));
            let cidrs: Vec<(Ipv6Addr, u8)> = (self.service_cidr_flag.iter())
                .chain(&self.service_cidr_api)
                .copied()
                .collect();
            written &= (self.service_cidrs).sync(&service_cidrs::wanted(desired, &cidrs));
        }
        self.walk_external = !written;
        let health_checks = if self.enabled {
            self.cache.health_checks()
        } else {
            Vec::new()
        };
        self.serve_health_checks(&health_checks);
        out.health_checks = health_checks;
        self.pending = !written;
        Ok(out)
    }

    /// The Services with an IPv6 family, as of this sync: every Service at a full update, else
    /// the changed ones looked at again.
    fn track_ipv6_services(&mut self, cache4: &TranslateCache, all: bool) {
        let changes = cache4.last_changes();
        if all {
            self.ipv6_services = cache4.ipv6_service_names().collect();
            return;
        }
        let changed = (changes.services.iter()).chain(changes.slices.iter().map(|(s, _)| &s.0));
        for name in changed {
            if cache4.service_has_ipv6(name) {
                self.ipv6_services.insert(name.clone());
            } else {
                self.ipv6_services.remove(name);
            }
        }
    }

    /// The health-check servers to `checks` on the IPv6 NodePort addresses, when the checks
    /// changed or a server needs starting again (as the IPv4 family's, see
    /// [`HealthCheckServers::settled`]).
    fn serve_health_checks(&mut self, checks: &[HealthCheck]) {
        let changed = self.served_checks.as_deref() != Some(checks);
        if changed || !self.health_checks.settled(&self.nodeport) {
            self.health_checks.update(checks, &self.nodeport);
            self.served_checks = Some(checks.to_vec());
        }
    }

    /// The health-check node ports served on IPv6.
    pub fn health_check_ports(&self) -> Vec<u16> {
        self.health_checks.ports()
    }
}
