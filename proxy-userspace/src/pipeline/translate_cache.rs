//! Incremental translation: the desired state kept between syncs, with only the Services whose
//! objects changed translated again.
//!
//! Pure (no IO). Each sync hands in the whole [`Snapshot`] (level-triggered: nothing depends on
//! watch events), and the cache finds what changed by comparing it with the previous one: an
//! object whose `Arc` is the same as last time is unchanged (the Kubernetes stores replace the
//! `Arc` of an object that changes); a new `Arc` is compared by value (the manifest source parses
//! every object again). A Service is translated again when the Service or one of its
//! EndpointSlices (the `kubernetes.io/service-name` label) changed, and every Service when the
//! node's context (name, zone, default scheduler, NodePort addresses) changed.
//!
//! Frontend claims between Services are settled per frontend by [`translate::resolve`], as in
//! [`translate::translate_for_node`]: every frontend a changed Service asks for (or asked for
//! before) is settled again between all the Services asking for it, so a frontend its winner
//! no longer wants goes to the next claimant at the same sync, and an older Service appearing
//! later takes it over. The result is equal to a full translation of the same snapshot (tested
//! below).
//!
//! The source may say what changed ([`TranslateCache::hint`]: the Kubernetes stores log it per
//! key), so that an update after one event looks at that object only; without a hint, and in a
//! full update, the snapshot is compared as above. A hint may also name Services to translate
//! again though nothing changed (the agent's periodic pass, a slice at a time).
//!
//! The cache is the agent's one change stream: besides the changed frontends [`TranslateCache::
//! update`] returns, [`TranslateCache::last_changes`] names the Services translated again, the
//! Service objects and EndpointSlices that changed (with the slices' trigger times) and whether a
//! health check changed, so metrics, the external maps and the health-check node ports follow
//! the change instead of walking the cluster.

use std::{
    collections::{BTreeMap, BTreeSet, hash_map::Entry as MapEntry},
    net::Ipv4Addr,
    sync::Arc,
    time::SystemTime,
};

use crate::{
    pipeline::{
        fast_hash::{HashMap, HashSet},
        model::{
            DesiredFrontend, DesiredState, Family, Frontend, FrontendConflict, Problem, Scope,
        },
        translate::{self, HealthCheck, NodeContext, ServiceTranslation},
    },
    sources::{
        endpoints::{SliceData, SliceFamily, SliceIndex},
        names::{self, Name},
        services::ServiceData,
        snapshot::{Changed, Changes, Snapshot},
    },
};

/// What the next [`TranslateCache::update`] is told besides its snapshot.
#[derive(Debug, Default)]
pub struct Hint {
    /// What changed since the previous update's snapshot, per kind where the source knows it
    /// (then that kind's snapshot is not compared place by place). Ignored by a full update.
    pub changes: Changes,
    /// Services to translate again whether or not they changed.
    pub refresh: Vec<ServiceName>,
}

/// A Service's namespace and name (also the key EndpointSlices join on): the `Arc`s of the
/// source's object, so the maps and change lists keyed by it hold no copy of the strings.
pub type ServiceName = (Name, Name);

/// A frontend whose desired value changed in an update, with the value it had before (`None`:
/// it did not exist). The new value is in [`TranslateCache::desired`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FrontendChange<A: Family = Ipv4Addr> {
    pub frontend: Frontend<A>,
    pub old: Option<Arc<DesiredFrontend<A>>>,
}

/// An EndpointSlice's Service and its own name (the slice's namespace is the Service's).
pub type SliceName = (ServiceName, Name);

/// What one [`TranslateCache::update`] changed besides the frontends it returns.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ChangeList {
    /// Every Service was translated again (a full update, or the node's context changed).
    pub all: bool,
    /// Service objects added, changed or removed.
    pub services: Vec<ServiceName>,
    /// EndpointSlices (of a Service) added, changed or removed, each with the trigger time of
    /// its new version (`None`: removed, or not annotated).
    pub slices: Vec<(SliceName, Option<SystemTime>)>,
    /// A Service's health check was added, changed or removed.
    pub health_checks: bool,
}

/// This cache is the IPv4 family's; the IPv6 family is programmed beside it
/// (`crate::family6`) on a node with IPv6. On a node without, a Service with an IPv6 cluster IP
/// is told once that its IPv6 half is not served.
fn ipv6_not_programmed(svc: &ServiceData) -> Option<Problem> {
    let v6: Vec<String> = (svc.cluster_ips.iter())
        .map(ToString::to_string)
        .filter(|ip| ip.parse::<std::net::Ipv6Addr>().is_ok())
        .collect();
    (!v6.is_empty()).then(|| Problem {
        source: crate::sources::endpoints::SNAPSHOT_SOURCE.to_owned(),
        object: format!("Service {}", svc.namespaced_name()),
        reason: format!(
            "IPv6 cluster IP(s) {} not programmed: this node has no IPv6 address",
            v6.join(", ")
        ),
    })
}

/// The translation of the last snapshot, kept per Service.
#[derive(Debug, Default)]
pub struct TranslateCache {
    node: Option<(NodeContext, Vec<Ipv4Addr>)>,
    /// The objects of the last snapshot.
    seen_services: Seen<ServiceData>,
    seen_slices: Seen<SliceData>,
    /// What is known of each Service name: its object, slices and translation (one map, so one
    /// key and one table slot per Service).
    entries: HashMap<ServiceName, ServiceEntry>,
    /// Services asking for each frontend (all-clients scope; usually one), with the index of
    /// its entry in the Service's translation.
    candidates: HashMap<Frontend, Claimants>,
    /// The frontends that more than one Service asks for, with the losing claims.
    conflicts: HashMap<Frontend, Vec<FrontendConflict>>,
    health_checks: BTreeMap<ServiceName, HealthCheck>,
    /// The Services with problems or notes in their translation or slices (so gathering the
    /// problems costs what there are, not what the cluster holds).
    troubled: BTreeSet<ServiceName>,
    desired: DesiredState,
    last_changes: ChangeList,
    /// Taken by the next update.
    hint: Hint,
    /// The IPv6 family is programmed beside this cache (no note about IPv6 cluster IPs).
    ipv6_programmed: bool,
}

impl TranslateCache {
    pub fn new() -> Self {
        Self::default()
    }

    /// The desired state of the last update.
    pub fn desired(&self) -> &DesiredState {
        &self.desired
    }

    /// What the last update changed (besides the frontends it returned).
    pub fn last_changes(&self) -> &ChangeList {
        &self.last_changes
    }

    /// Whether the Service `name` (as of the last update) has an IPv6 family.
    pub fn service_has_ipv6(&self, name: &ServiceName) -> bool {
        (self.entries.get(name))
            .and_then(|e| e.service.as_deref())
            .is_some_and(has_ipv6_family)
    }

    /// The Services (as of the last update) that have an IPv6 family.
    pub fn ipv6_service_names(&self) -> impl Iterator<Item = ServiceName> + '_ {
        (self.entries.iter())
            .filter(|(_, e)| e.service.as_deref().is_some_and(has_ipv6_family))
            .map(|(name, _)| name.clone())
    }

    /// Whether a slice of the last update is of addressType IPv6 (the metrics tell the IPv6
    /// family's network programming apart by it).
    pub fn is_ipv6_slice(&self, (service, slice): &SliceName) -> bool {
        (self.entries.get(service))
            .and_then(|e| e.slices.get(slice))
            .is_some_and(|s| s.address_type == crate::sources::endpoints::AddressType::Ipv6)
    }

    /// Problems of the last update (as [`translate::Translation::problems`], in another order).
    pub fn problems(&self) -> Vec<Problem> {
        let troubled = || self.troubled.iter().filter_map(|n| self.entries.get(n));
        let slices = troubled().flat_map(|e| &e.slice_problems);
        let services = troubled()
            .filter_map(|e| e.translation.as_ref())
            .flat_map(|t| t.problems());
        let conflicts = self
            .conflicts
            .values()
            .flatten()
            .map(translate::conflict_problem);
        slices.chain(services).cloned().chain(conflicts).collect()
    }

    /// Frontend conflicts of the last update, sorted (as [`translate::Translation::conflicts`]).
    pub fn conflicts(&self) -> Vec<FrontendConflict> {
        let mut v: Vec<FrontendConflict> = self.conflicts.values().flatten().cloned().collect();
        v.sort();
        v
    }

    /// Notes of the last update (as [`translate::Translation::notes`], in another order).
    pub fn notes(&self) -> Vec<Problem> {
        (self.troubled.iter())
            .filter_map(|n| self.entries.get(n)?.translation.as_ref())
            .flat_map(|t| t.notes().iter().cloned())
            .collect()
    }

    /// Health-check node ports, sorted by port (as [`translate::Translation::health_checks`]).
    pub fn health_checks(&self) -> Vec<HealthCheck> {
        let mut v: Vec<HealthCheck> = self.health_checks.values().cloned().collect();
        v.sort_by_key(|h| h.port);
        v
    }

    /// Frees the last update's change list (keeps only whether it was full). A full update's
    /// list names every Service and EndpointSlice (250,000 strings at 50,000 Services): freed
    /// by the next update, it cost the first change after a full sync ~15 ms.
    pub fn release_change_list(&mut self) {
        self.last_changes = ChangeList {
            all: self.last_changes.all,
            ..ChangeList::default()
        };
    }

    /// The source tells what changed from now on (the Kubernetes stores): the copy of the last
    /// snapshot kept for comparing places is dropped now (100,000 `Arc`s at 50,000 Services,
    /// 2-6 ms), at the end of a full sync, instead of by the first change's hinted update.
    pub fn expect_hints(&mut self) {
        self.seen_services.forget();
        self.seen_slices.forget();
    }

    /// Whether the IPv6 family is programmed beside this cache; a change translates every
    /// Service again at the next update (the notes follow it).
    pub fn set_ipv6_programmed(&mut self, on: bool) {
        if self.ipv6_programmed != on {
            self.ipv6_programmed = on;
            self.node = None;
        }
    }

    /// Tells the next [`TranslateCache::update`] what changed (see [`Hint`]). The changes must
    /// be relative to the snapshot of the update before it.
    pub fn hint(&mut self, hint: Hint) {
        self.hint = hint;
    }

    /// Bring the desired state up to `snapshot`. `everything`: translate every Service again
    /// (the periodic full sync). Returns the frontends whose desired value changed, sorted.
    pub fn update(
        &mut self,
        snapshot: &Snapshot,
        node: &NodeContext,
        nodeport_addrs: &[Ipv4Addr],
        everything: bool,
    ) -> Vec<FrontendChange> {
        self.last_changes = ChangeList::default();
        let mut hint = std::mem::take(&mut self.hint);
        if everything {
            hint.changes = Changes::default();
        }
        let mut dirty = self.changed_services(snapshot, hint.changes);
        dirty.extend(hint.refresh);
        let context = (node.clone(), nodeport_addrs.to_vec());
        let all = everything || self.node.as_ref() != Some(&context);
        self.last_changes.all = all;
        if all {
            dirty.reserve(self.entries.len().saturating_sub(dirty.len()));
            for name in self.entries.keys() {
                if !dirty.contains(name) {
                    dirty.insert(name.clone());
                }
            }
            self.node = Some(context);
        }
        if dirty.is_empty() {
            return Vec::new();
        }
        // Translate the changed Services again (pure; two threads when there are many).
        let dirty: Vec<ServiceName> = dirty.into_iter().collect();
        let translated = self.translate_each(&dirty, node, nodeport_addrs);
        // Every frontend a changed Service asks for, or asked for before, is settled again.
        let mut contested: Vec<Frontend> = Vec::new();
        for (name, (problems, mut new)) in dirty.iter().zip(translated) {
            // Kept once, in `health_checks` (not in the translation too).
            let hc = new.as_mut().and_then(|t| t.take_health_check());
            let old_hc = match hc.clone() {
                Some(hc) => self.health_checks.insert(name.clone(), hc),
                None => self.health_checks.remove(name),
            };
            self.last_changes.health_checks |= old_hc != hc;
            let entry = self.entries.entry(name.clone()).or_default();
            entry.slice_problems = problems.into();
            let old = std::mem::replace(&mut entry.translation, new);
            let troubled = !entry.slice_problems.is_empty()
                || (entry.translation.as_ref()).is_some_and(|t| t.remarks.is_some());
            if troubled {
                self.troubled.insert(name.clone());
            } else {
                self.troubled.remove(name);
            }
            for claim in old.iter().flat_map(|t| t.claims()) {
                contested.push(claim.frontend);
                if let Some(c) = self.candidates.get_mut(&claim.frontend)
                    && c.remove(name)
                {
                    self.candidates.remove(&claim.frontend);
                }
            }
            let Some(t) = entry.translation.as_ref() else {
                if entry.is_empty() {
                    self.entries.remove(name);
                }
                continue;
            };
            for (i, (f, _)) in t.frontends.iter().enumerate() {
                if t.claim_at(i).is_some() {
                    contested.push(*f);
                    let claim = (name.clone(), index(i));
                    match self.candidates.entry(*f) {
                        MapEntry::Occupied(mut o) => o.get_mut().push(claim),
                        MapEntry::Vacant(v) => {
                            v.insert(Claimants::One(claim));
                        }
                    }
                }
            }
        }
        // The lists of a full pass are as long as the cluster: no room past their length.
        self.last_changes.services.shrink_to_fit();
        self.last_changes.slices.shrink_to_fit();
        // (A full pass re-translates every Service, so every frontend is settled again.) Sorted,
        // so the changes come out sorted.
        contested.sort_unstable();
        contested.dedup();
        self.settle(&contested)
    }

    /// Each Service's slice problems and translation, in `names` order. A first sync's thousands
    /// of Services are split over two threads (each Service's translation is independent).
    fn translate_each(
        &self,
        names: &[ServiceName],
        node: &NodeContext,
        nodeport_addrs: &[Ipv4Addr],
    ) -> Vec<(Vec<Problem>, Option<ServiceTranslation>)> {
        const PARALLEL_MIN: usize = 2_048;
        let one = |name: &ServiceName| {
            let mut problems = Vec::new();
            let entry = self.entries.get(name);
            let index = SliceIndex::new(
                entry.into_iter().flat_map(|e| e.slices.values()),
                &node.node_name,
                &mut problems,
            );
            let service = entry.and_then(|e| e.service.as_ref());
            let mut translation = service
                .and_then(|svc| translate::translate_service(svc, &index, node, nodeport_addrs));
            let note = service.filter(|_| !self.ipv6_programmed);
            if let Some(note) = note.and_then(|svc| ipv6_not_programmed(svc)) {
                let t = translation.get_or_insert_with(Default::default);
                let remarks = t.remarks.get_or_insert_with(Default::default);
                remarks.notes.push(note);
            }
            (problems, translation)
        };
        if names.len() < PARALLEL_MIN {
            return names.iter().map(one).collect();
        }
        let (first, second) = names.split_at(names.len() / 2);
        std::thread::scope(|s| {
            let second = s.spawn(|| second.iter().map(one).collect::<Vec<_>>());
            let mut out: Vec<_> = first.iter().map(one).collect();
            out.extend(
                second
                    .join()
                    .unwrap_or_else(|panic| std::panic::resume_unwind(panic)),
            );
            out
        })
    }

    /// Services whose Service object or EndpointSlices differ from the last snapshot (as
    /// `known` says, or found by comparing places).
    fn changed_services(&mut self, snapshot: &Snapshot, known: Changes) -> HashSet<ServiceName> {
        let mut dirty = HashSet::default();

        // Fresh objects replace what their name held; a gone object's name is removed only if
        // no fresh object took it. Order does not matter here (hash sets, no sorting). A kind
        // whose changes came as a hint drops its `Seen` (no longer the last snapshot); the next
        // comparison then goes by key. Both kinds are split before either is applied.
        let (fresh, gone) = match known.services {
            Some(c) => {
                self.seen_services.forget();
                split_changed(c)
            }
            None if self.seen_services.stale => {
                let split = self.compare_services(&snapshot.services);
                self.seen_services.remember(&snapshot.services);
                split
            }
            None => self.seen_services.split(&snapshot.services),
        };
        let (fresh_slices, gone_slices) = match known.endpoint_slices {
            Some(c) => {
                self.seen_slices.forget();
                split_changed(c)
            }
            None if self.seen_slices.stale => {
                let split = self.compare_slices(&snapshot.endpoint_slices);
                self.seen_slices.remember(&snapshot.endpoint_slices);
                split
            }
            None => self.seen_slices.split(&snapshot.endpoint_slices),
        };
        let fresh: HashMap<ServiceName, Arc<ServiceData>> = fresh
            .into_iter()
            .filter_map(|s| Some((service_name(&s)?, s)))
            .collect();
        let changes = &mut self.last_changes;
        // (An entry left empty is removed once its translation is gone, in `update`.)
        for name in gone.iter().filter_map(|s| service_name(s)) {
            if fresh.contains_key(&name) {
                continue;
            }
            if let Some(e) = self.entries.get_mut(&name)
                && e.service.take().is_some()
            {
                changes.services.push(name.clone());
                dirty.insert(name);
            }
        }
        for (name, new) in fresh {
            let entry = self.entries.entry(name.clone()).or_default();
            if replaced(entry.service.replace(new.clone()), &new) {
                changes.services.push(name.clone());
                dirty.insert(name);
            }
        }

        let (fresh, gone) = (fresh_slices, gone_slices);
        let fresh: HashMap<SliceName, Arc<SliceData>> = fresh
            .into_iter()
            .filter_map(|s| Some((slice_key(&s)?, s)))
            .collect();
        for key in gone.iter().filter_map(|s| slice_key(s)) {
            if fresh.contains_key(&key) {
                continue;
            }
            let (service, slice) = key;
            let Some(entry) = self.entries.get_mut(&service) else {
                continue;
            };
            if entry.slices.remove(&slice).is_some() {
                changes.slices.push(((service.clone(), slice), None));
                dirty.insert(service);
            }
        }
        for ((service, slice), new) in fresh {
            let entry = self.entries.entry(service.clone()).or_default();
            if replaced(entry.slices.insert(slice.clone(), new.clone()), &new) {
                changes
                    .slices
                    .push(((service.clone(), slice), new.trigger_time));
                dirty.insert(service);
            }
        }
        dirty
    }

    /// `now` against the Services the cache holds, by name (as [`Seen::split`] splits it): O(n)
    /// hash lookups, for a snapshot after hints (a relist, or more changes than the log keeps).
    fn compare_services(
        &self,
        now: &[Arc<ServiceData>],
    ) -> (Vec<Arc<ServiceData>>, Vec<Arc<ServiceData>>) {
        let mut names: HashSet<ServiceName> =
            HashSet::with_capacity_and_hasher(now.len(), Default::default());
        let mut fresh = Vec::new();
        for svc in now {
            let Some(name) = service_name(svc) else {
                continue;
            };
            let held = (self.entries.get(&name)).and_then(|e| e.service.as_ref());
            if held.is_none_or(|held| !Arc::ptr_eq(held, svc)) {
                fresh.push(svc.clone());
            }
            names.insert(name);
        }
        let gone = (self.entries.iter())
            .filter(|(name, _)| !names.contains(*name))
            .filter_map(|(_, e)| e.service.clone())
            .collect();
        (fresh, gone)
    }

    /// [`TranslateCache::compare_services`] for the EndpointSlices, by (Service, slice name).
    fn compare_slices(&self, now: &[Arc<SliceData>]) -> (Vec<Arc<SliceData>>, Vec<Arc<SliceData>>) {
        let mut keys: HashSet<SliceName> =
            HashSet::with_capacity_and_hasher(now.len(), Default::default());
        let mut fresh = Vec::new();
        for slice in now {
            let Some((service, name)) = slice_key(slice) else {
                continue;
            };
            let held = (self.entries.get(&service))
                .and_then(|e| e.slices.get(&name))
                .is_some_and(|held| Arc::ptr_eq(held, slice));
            if !held {
                fresh.push(slice.clone());
            }
            keys.insert((service, name));
        }
        let mut gone = Vec::new();
        for (service, entry) in &self.entries {
            for (name, slice) in &entry.slices.0 {
                if !keys.contains(&(service.clone(), name.clone())) {
                    gone.push(slice.clone());
                }
            }
        }
        (fresh, gone)
    }

    /// Settle each of `frontends` (all-clients scope) again between the Services asking for it,
    /// and record which entries changed.
    fn settle(&mut self, frontends: &[Frontend]) -> Vec<FrontendChange> {
        let mut changes = Vec::new();
        let mut claims: Vec<translate::Claim<'_>> = Vec::new();
        for &frontend in frontends {
            claims.clear();
            claims.extend(
                (self.candidates.get(&frontend))
                    .into_iter()
                    .flatten()
                    .filter_map(|(name, i)| {
                        let t = self.entries.get(name)?.translation.as_ref()?;
                        t.claim_at(*i as usize)
                    }),
            );
            // [all clients, in-cluster]
            let mut new: [Option<Arc<DesiredFrontend>>; 2] = [None, None];
            self.conflicts.remove(&frontend);
            if let Some((winner, conflicts)) = translate::resolve(&claims) {
                for (f, df) in claims[winner].entries {
                    new[usize::from(f.scope == Scope::InCluster)] = Some(df.clone());
                }
                if !conflicts.is_empty() {
                    self.conflicts.insert(frontend, conflicts);
                }
            }
            for (f, new) in [frontend, frontend.in_cluster()].into_iter().zip(new) {
                let old = match new {
                    Some(df) => self.desired.frontends.insert(f, df),
                    None => self.desired.frontends.remove(&f),
                };
                if old.as_ref() != self.desired.frontends.get(&f) {
                    changes.push(FrontendChange { frontend: f, old });
                }
            }
        }
        changes
    }
}

/// One more family's translation (the IPv6 family beside this cache's IPv4 one), kept per
/// Service from the objects a [`TranslateCache`] holds and following its change list: after a
/// change only the changed Services are translated again for that family, and their frontends
/// settled again between their claimants, as [`TranslateCache::update`] does. The result equals
/// [`translate::translate_one_family`] of the same snapshot (tested below).
///
/// Holds nothing for a Service without a translation or a slice problem of that family (an
/// IPv4-only cluster: only the empty tables), so the memory follows that family's Services.
#[derive(Debug)]
pub struct FamilyCache<A: Family> {
    /// The node context of the last update; another one translates every Service again.
    context: Option<(NodeContext, Vec<A>)>,
    entries: HashMap<ServiceName, FamilyEntry<A>>,
    candidates: HashMap<Frontend<A>, Claimants>,
    conflicts: HashMap<Frontend<A>, Vec<FrontendConflict<A>>>,
    health_checks: BTreeMap<ServiceName, HealthCheck>,
    troubled: BTreeSet<ServiceName>,
    desired: DesiredState<A>,
}

/// A Service's part of a [`FamilyCache`]: its slice problems and translation for that family.
#[derive(Debug)]
struct FamilyEntry<A: Family> {
    slice_problems: Box<[Problem]>,
    translation: Option<ServiceTranslation<A>>,
}

impl<A: Family> Default for FamilyCache<A> {
    fn default() -> Self {
        Self {
            context: None,
            entries: HashMap::default(),
            candidates: HashMap::default(),
            conflicts: HashMap::default(),
            health_checks: BTreeMap::new(),
            troubled: BTreeSet::new(),
            desired: DesiredState::default(),
        }
    }
}

impl<A: SliceFamily> FamilyCache<A> {
    /// The desired state of the last update.
    pub fn desired(&self) -> &DesiredState<A> {
        &self.desired
    }

    /// Whether the Service has a translation or problems of this family (as of the last
    /// update).
    pub fn holds(&self, name: &ServiceName) -> bool {
        self.entries.contains_key(name)
    }

    /// Forgets everything (the family is not programmed): the frontends it held, as changes to
    /// nothing. The next update translates every Service.
    pub fn clear(&mut self) -> Vec<FrontendChange<A>> {
        let old = std::mem::take(self);
        (old.desired.frontends.into_iter())
            .map(|(frontend, df)| FrontendChange {
                frontend,
                old: Some(df),
            })
            .collect()
    }

    /// Brings the translation up to `source` (updated for the same snapshot just before):
    /// the Services its last change list names, or every Service when `full`, when that list
    /// was a full one, or when the node's context changed. Returns the frontends whose
    /// desired value changed (sorted) and whether every Service was translated again.
    pub fn update(
        &mut self,
        source: &TranslateCache,
        node: &NodeContext,
        nodeport_addrs: &[A],
        full: bool,
    ) -> (Vec<FrontendChange<A>>, bool) {
        let changes = source.last_changes();
        let context = (node.clone(), nodeport_addrs.to_vec());
        let all = full || changes.all || self.context.as_ref() != Some(&context);
        let mut dirty: HashSet<ServiceName> = HashSet::default();
        if all {
            dirty.extend(source.entries.keys().cloned());
            dirty.extend(self.entries.keys().cloned());
            self.context = Some(context);
        } else {
            dirty.extend(changes.services.iter().cloned());
            dirty.extend(
                changes
                    .slices
                    .iter()
                    .map(|((service, _), _)| service.clone()),
            );
        }
        let mut contested: Vec<Frontend<A>> = Vec::new();
        for name in dirty {
            let input = source.entries.get(&name);
            let mut problems = Vec::new();
            let slices: SliceIndex<'_, A> = SliceIndex::new(
                input.into_iter().flat_map(|e| e.slices.values()),
                &node.node_name,
                &mut problems,
            );
            let mut new = (input.and_then(|e| e.service.as_deref()))
                .and_then(|svc| translate::translate_service(svc, &slices, node, nodeport_addrs));
            let hc = new.as_mut().and_then(|t| t.take_health_check());
            match hc {
                Some(hc) => self.health_checks.insert(name.clone(), hc),
                None => self.health_checks.remove(&name),
            };
            let troubled =
                !problems.is_empty() || (new.as_ref()).is_some_and(|t| t.remarks.is_some());
            if troubled {
                self.troubled.insert(name.clone());
            } else {
                self.troubled.remove(&name);
            }
            let old = if new.is_none() && problems.is_empty() {
                self.entries.remove(&name).and_then(|e| e.translation)
            } else {
                let entry = self.entries.entry(name.clone()).or_insert(FamilyEntry {
                    slice_problems: Box::new([]),
                    translation: None,
                });
                entry.slice_problems = problems.into();
                std::mem::replace(&mut entry.translation, new)
            };
            for claim in old.iter().flat_map(|t| t.claims()) {
                contested.push(claim.frontend);
                if let Some(c) = self.candidates.get_mut(&claim.frontend)
                    && c.remove(&name)
                {
                    self.candidates.remove(&claim.frontend);
                }
            }
            let Some(t) = self.entries.get(&name).and_then(|e| e.translation.as_ref()) else {
                continue;
            };
            for (i, (f, _)) in t.frontends.iter().enumerate() {
                if t.claim_at(i).is_some() {
                    contested.push(*f);
                    let claim = (name.clone(), index(i));
                    match self.candidates.entry(*f) {
                        MapEntry::Occupied(mut o) => o.get_mut().push(claim),
                        MapEntry::Vacant(v) => {
                            v.insert(Claimants::One(claim));
                        }
                    }
                }
            }
        }
        contested.sort_unstable();
        contested.dedup();
        (self.settle(&contested), all)
    }

    /// [`TranslateCache::settle`] for this family.
    fn settle(&mut self, frontends: &[Frontend<A>]) -> Vec<FrontendChange<A>> {
        let mut changes = Vec::new();
        let mut claims: Vec<translate::Claim<'_, A>> = Vec::new();
        for &frontend in frontends {
            claims.clear();
            claims.extend(
                (self.candidates.get(&frontend))
                    .into_iter()
                    .flatten()
                    .filter_map(|(name, i)| {
                        let t = self.entries.get(name)?.translation.as_ref()?;
                        t.claim_at(*i as usize)
                    }),
            );
            // [all clients, in-cluster]
            let mut new: [Option<Arc<DesiredFrontend<A>>>; 2] = [None, None];
            self.conflicts.remove(&frontend);
            if let Some((winner, conflicts)) = translate::resolve(&claims) {
                for (f, df) in claims[winner].entries {
                    new[usize::from(f.scope == Scope::InCluster)] = Some(df.clone());
                }
                if !conflicts.is_empty() {
                    self.conflicts.insert(frontend, conflicts);
                }
            }
            for (f, new) in [frontend, frontend.in_cluster()].into_iter().zip(new) {
                let old = match new {
                    Some(df) => self.desired.frontends.insert(f, df),
                    None => self.desired.frontends.remove(&f),
                };
                if old.as_ref() != self.desired.frontends.get(&f) {
                    changes.push(FrontendChange { frontend: f, old });
                }
            }
        }
        changes
    }

    /// Problems of the last update (as [`translate::OneFamily::problems`], in another order).
    pub fn problems(&self) -> Vec<Problem> {
        let troubled = || self.troubled.iter().filter_map(|n| self.entries.get(n));
        let slices = troubled().flat_map(|e| &e.slice_problems[..]);
        let services = troubled()
            .filter_map(|e| e.translation.as_ref())
            .flat_map(|t| t.problems());
        let conflicts = (self.conflicts.values())
            .flatten()
            .map(translate::conflict_problem);
        slices.chain(services).cloned().chain(conflicts).collect()
    }

    /// Health-check node ports, sorted by port (as [`translate::OneFamily::health_checks`]).
    pub fn health_checks(&self) -> Vec<HealthCheck> {
        let mut v: Vec<HealthCheck> = self.health_checks.values().cloned().collect();
        v.sort_by_key(|h| h.port);
        v
    }
}

/// The objects of the last snapshot, in its order. The `Arc`s are held, so an address is never
/// reused by another object while it is here.
///
/// The stores list their objects in a stable order (a changed object keeps its place), so the
/// comparison is a walk over two arrays of pointers, and only the places that differ are looked
/// at further: a change costs a pass over pointers, not a hash lookup per object.
/// After an update told what changed (a hint), `last` no longer is the last snapshot: it is
/// dropped, and the next comparison goes by key against what the cache holds
/// ([`TranslateCache::compare_services`]), then remembers that snapshot again.
#[derive(Debug)]
struct Seen<K> {
    last: Vec<Arc<K>>,
    /// `last` is not the last snapshot (changes came as a hint since).
    stale: bool,
}

impl<K> Default for Seen<K> {
    fn default() -> Self {
        Self {
            last: Vec::new(),
            stale: false,
        }
    }
}

impl<K> Seen<K> {
    /// Changes came as a hint: `last` is no longer the last snapshot.
    fn forget(&mut self) {
        if !self.stale {
            self.last = Vec::new();
            self.stale = true;
        }
    }

    /// `now` is the last snapshot (after comparing it by key).
    fn remember(&mut self, now: &[Arc<K>]) {
        self.last = now.to_vec();
        self.stale = false;
    }

    /// Split `now` (distinct objects, as every source lists them) into objects not seen last
    /// time (new or changed) and objects that left (changed or removed), and remember `now`.
    /// No allocation when nothing changed.
    fn split(&mut self, now: &[Arc<K>]) -> (Vec<Arc<K>>, Vec<Arc<K>>) {
        let common = now.len().min(self.last.len());
        let mut differ: Vec<usize> = (0..common)
            .filter(|&i| !Arc::ptr_eq(&now[i], &self.last[i]))
            .collect();
        if differ.is_empty() && now.len() == self.last.len() {
            return (Vec::new(), Vec::new());
        }
        // Objects at places that differ (and past the shorter list) are new, moved or gone.
        let now_side = differ.iter().map(|&i| &now[i]).chain(&now[common..]);
        let last_side = differ
            .iter()
            .map(|&i| &self.last[i])
            .chain(&self.last[common..]);
        let addr = |o: &Arc<K>| Arc::as_ptr(o) as usize;
        let before: HashSet<usize> = last_side.clone().map(addr).collect();
        let after: HashSet<usize> = now_side.clone().map(addr).collect();
        let fresh: Vec<Arc<K>> = now_side
            .filter(|o| !before.contains(&addr(o)))
            .cloned()
            .collect();
        let gone: Vec<Arc<K>> = last_side
            .filter(|o| !after.contains(&addr(o)))
            .cloned()
            .collect();
        // In place: a list that grew or shrank by one costs its changed places, not a copy.
        for i in differ.drain(..) {
            self.last[i] = now[i].clone();
        }
        self.last.truncate(common);
        self.last.extend_from_slice(&now[common..]);
        (fresh, gone)
    }
}

/// Known changes as [`Seen::split`] gives them: objects new or changed, objects gone or changed.
fn split_changed<K>(changes: Vec<Changed<K>>) -> (Vec<Arc<K>>, Vec<Arc<K>>) {
    let mut fresh = Vec::with_capacity(changes.len());
    let mut gone = Vec::with_capacity(changes.len());
    for c in changes {
        fresh.extend(c.after);
        gone.extend(c.before);
    }
    (fresh, gone)
}

/// Did inserting `new` change what the key held (`old`: what the insert returned)? The same `Arc`
/// is unchanged; another one is compared by value (the manifest source parses objects anew).
/// What the cache knows of one Service name. Removed when it holds nothing.
#[derive(Debug, Default)]
struct ServiceEntry {
    /// The Service object (`None`: no Service of that name, only slices naming it).
    service: Option<Arc<ServiceData>>,
    /// The EndpointSlices naming the Service.
    slices: SliceGroup,
    /// Problems found in those slices.
    slice_problems: Box<[Problem]>,
    /// The translation of a handled Service (its health check is kept in
    /// [`TranslateCache::health_checks`] instead).
    translation: Option<ServiceTranslation>,
}

impl ServiceEntry {
    fn is_empty(&self) -> bool {
        self.service.is_none()
            && self.slices.is_empty()
            && self.slice_problems.is_empty()
            && self.translation.is_none()
    }
}

/// The Services claiming one frontend, each with the index of the frontend's entry in its
/// translation: nearly always one, kept inline (no allocation per frontend).
#[derive(Debug)]
enum Claimants {
    One((ServiceName, u32)),
    Many(Vec<(ServiceName, u32)>),
}

impl Claimants {
    fn push(&mut self, claim: (ServiceName, u32)) {
        match self {
            Claimants::One(first) => {
                let first = first.clone();
                *self = Claimants::Many(vec![first, claim]);
            }
            Claimants::Many(v) => v.push(claim),
        }
    }

    /// Drops `name`'s claim; true when none is left.
    fn remove(&mut self, name: &ServiceName) -> bool {
        let left = match self {
            Claimants::One((n, _)) => return n == name,
            Claimants::Many(v) => {
                v.retain(|(n, _)| n != name);
                v
            }
        };
        match left.as_slice() {
            [] => true,
            [only] => {
                let only = only.clone();
                *self = Claimants::One(only);
                false
            }
            _ => false,
        }
    }
}

impl<'a> IntoIterator for &'a Claimants {
    type Item = &'a (ServiceName, u32);
    type IntoIter = std::slice::Iter<'a, (ServiceName, u32)>;

    fn into_iter(self) -> Self::IntoIter {
        match self {
            Claimants::One(c) => std::slice::from_ref(c).iter(),
            Claimants::Many(v) => v.iter(),
        }
    }
}

/// A frontend's index in a Service's translation, as kept in [`Claimants`] (a Service has far
/// fewer than 2³² frontends).
fn index(i: usize) -> u32 {
    u32::try_from(i).unwrap_or(u32::MAX)
}

/// One Service's slices by name, sorted: a Service has one or a few, so a boxed slice (a B-tree's
/// smallest node is 11 entries wide, ~370 bytes for the usual single slice).
#[derive(Debug, Default)]
struct SliceGroup(Box<[(Name, Arc<SliceData>)]>);

impl SliceGroup {
    fn insert(&mut self, name: Name, slice: Arc<SliceData>) -> Option<Arc<SliceData>> {
        match self.0.binary_search_by(|(n, _)| (**n).cmp(&*name)) {
            Ok(i) => Some(std::mem::replace(&mut self.0[i].1, slice)),
            Err(i) => {
                let mut v = std::mem::take(&mut self.0).into_vec();
                v.insert(i, (name, slice));
                self.0 = v.into_boxed_slice();
                None
            }
        }
    }

    fn get(&self, name: &str) -> Option<&Arc<SliceData>> {
        let i = self.0.binary_search_by(|(n, _)| (**n).cmp(name)).ok()?;
        Some(&self.0[i].1)
    }

    fn remove(&mut self, name: &str) -> Option<Arc<SliceData>> {
        let i = self.0.binary_search_by(|(n, _)| (**n).cmp(name)).ok()?;
        let mut v = std::mem::take(&mut self.0).into_vec();
        let (_, slice) = v.remove(i);
        self.0 = v.into_boxed_slice();
        Some(slice)
    }

    fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    fn values(&self) -> impl Iterator<Item = &SliceData> {
        self.0.iter().map(|(_, s)| &**s)
    }
}

fn replaced<K: PartialEq>(old: Option<Arc<K>>, new: &Arc<K>) -> bool {
    old.is_none_or(|old| !Arc::ptr_eq(&old, new) && *old != **new)
}

/// A Service's key in the cache (namespace `default` when unset).
/// Whether the Service may have IPv6 frontends: `spec.ipFamilies` names IPv6, or a cluster IP
/// is an IPv6 address (upstream's per-family proxier skips a Service without a cluster IP of
/// its family). Conservative: the IPv6 family's sync decides the rest.
pub fn has_ipv6_family(svc: &ServiceData) -> bool {
    use crate::sources::services::{ClusterIp, IpFamilies};
    matches!(
        svc.ip_families,
        IpFamilies::V6 | IpFamilies::V4V6 | IpFamilies::V6V4
    ) || (svc.cluster_ips.iter())
        .any(|ip| matches!(ip, ClusterIp::Other(raw) if raw.parse::<std::net::Ipv6Addr>().is_ok()))
}

pub fn service_name(svc: &ServiceData) -> Option<ServiceName> {
    let name = svc.name.clone()?;
    Some((namespace_of(&svc.namespace), name))
}

/// The Service a slice belongs to and the slice's name; `None` for slices not managed for a
/// Service (translate ignores them too).
fn slice_key(slice: &SliceData) -> Option<SliceName> {
    let service = slice.service_name.clone()?;
    let name = slice.name.clone()?;
    Some(((namespace_of(&slice.namespace), service), name))
}

fn namespace_of(namespace: &Option<Name>) -> Name {
    namespace
        .clone()
        .unwrap_or_else(|| names::namespace("default"))
}

#[cfg(test)]
mod tests {
    use k8s_openapi::api::{core::v1::Service, discovery::v1::EndpointSlice};
    use serde_json::{Value, json};

    use super::*;
    use crate::pipeline::model::FrontendKind;

    /// The IPv6 family skips changes among Services without an IPv6 family; which ones have one.
    #[test]
    fn a_service_has_an_ipv6_family_by_its_families_or_cluster_ips() {
        let svc = |spec: Value| -> ServiceData {
            let s: Service = serde_json::from_value(
                json!({"metadata": {"namespace": "demo", "name": "web"}, "spec": spec}),
            )
            .expect("service");
            ServiceData::from(&s)
        };
        let ports = json!([{"port": 80}]);
        for (spec, want) in [
            (json!({"clusterIP": "10.96.0.1", "ports": ports}), false),
            (json!({"clusterIP": "None", "ports": ports}), false),
            (json!({"clusterIP": "not-an-ip", "ports": ports}), false),
            (json!({"clusterIP": "fd00:10:96::1", "ports": ports}), true),
            (
                json!({"clusterIPs": ["10.96.0.1", "fd00:10:96::1"], "ports": ports}),
                true,
            ),
            (
                json!({"clusterIP": "None", "ipFamilies": ["IPv4", "IPv6"], "ports": ports}),
                true,
            ),
            (
                json!({"clusterIP": "10.96.0.1", "ipFamilies": ["IPv4"], "ports": ports}),
                false,
            ),
        ] {
            assert_eq!(has_ipv6_family(&svc(spec.clone())), want, "{spec}");
        }
    }

    /// xorshift64*: deterministic "random" snapshots without a dependency.
    struct Rng(u64);

    impl Rng {
        fn below(&mut self, n: u32) -> u32 {
            self.0 ^= self.0 >> 12;
            self.0 ^= self.0 << 25;
            self.0 ^= self.0 >> 27;
            ((self.0.wrapping_mul(0x2545_f491_4f6c_dd1d) >> 32) % u64::from(n)) as u32
        }
    }

    /// A Service drawn from a small space, so that frontends collide across Services.
    fn random_service(rng: &mut Rng, i: u32) -> Service {
        let ip = match rng.below(10) {
            0 => "not-an-ip".to_owned(),
            1 => "None".to_owned(),
            _ => format!("10.96.0.{}", rng.below(6) + 1),
        };
        let mut ports = vec![json!({"name": "http", "port": 80 + rng.below(2), "protocol": "TCP"})];
        if rng.below(3) == 0 {
            // A nodePort 53 on the node address clashes with externalIP 192.168.1.1's port 53.
            let node_port = if rng.below(3) == 0 { 53 } else { 30053 };
            ports
                .push(json!({"name": "dns", "port": 53, "protocol": "UDP", "nodePort": node_port}));
        }
        let mut spec = json!({"clusterIP": ip, "ports": ports});
        if rng.below(4) == 0 {
            spec["type"] = json!("NodePort");
        }
        if rng.below(4) == 0 {
            // Other Services' externalIPs, ClusterIPs, or a node address.
            let ip = match rng.below(4) {
                0 => format!("10.96.0.{}", rng.below(6) + 1),
                1 => "192.168.1.1".to_owned(),
                _ => format!("192.0.2.{}", rng.below(3) + 1),
            };
            spec["externalIPs"] = json!([ip]);
        }
        if rng.below(4) == 0 {
            spec["internalTrafficPolicy"] = json!("Local");
        }
        if rng.below(5) == 0 {
            spec["type"] = json!("LoadBalancer");
            spec["externalTrafficPolicy"] = json!("Local");
            spec["healthCheckNodePort"] = json!(32000 + rng.below(3));
        }
        let mut metadata = json!({"name": format!("svc-{i}"), "namespace": if i.is_multiple_of(3) { "a" } else { "b" }});
        // Few distinct ages, so ties (and Services without one) are common.
        if rng.below(4) != 0 {
            metadata["creationTimestamp"] =
                json!(format!("2026-01-0{}T00:00:00Z", rng.below(3) + 1));
        }
        serde_json::from_value(json!({"metadata": metadata, "spec": spec}))
            .expect("Service fixture")
    }

    fn random_slice(rng: &mut Rng, i: u32, part: u32) -> SliceData {
        SliceData::from(&random_api_slice(rng, i, part))
    }

    fn random_api_slice(rng: &mut Rng, i: u32, part: u32) -> EndpointSlice {
        let endpoints: Vec<Value> = (0..rng.below(4))
            .map(|_| {
                let addr = if rng.below(12) == 0 {
                    "bad".to_owned()
                } else {
                    format!("10.244.0.{}", rng.below(8) + 1)
                };
                json!({"addresses": [addr],
                       "nodeName": if rng.below(2) == 0 { "node-a" } else { "node-b" },
                       "conditions": {"ready": rng.below(3) != 0, "serving": true,
                                      "terminating": rng.below(3) == 0},
                       "hints": {"forZones": [{"name": if rng.below(2) == 0 { "zone-a" } else { "zone-b" }}]}})
            })
            .collect();
        serde_json::from_value(json!({
            "metadata": {"name": format!("svc-{i}-{part}"),
                         "namespace": if i.is_multiple_of(3) { "a" } else { "b" },
                         "labels": {"kubernetes.io/service-name": format!("svc-{i}")}},
            "addressType": "IPv4",
            "ports": [{"name": "http", "port": 8080 + rng.below(2), "protocol": "TCP"},
                      {"name": "dns", "port": 5353, "protocol": "UDP"}],
            "endpoints": endpoints,
        }))
        .expect("EndpointSlice fixture")
    }

    /// [`random_service`], sometimes a LoadBalancer with an ingress address (shared between
    /// Services) and loadBalancerSourceRanges.
    fn random_lb_service(rng: &mut Rng, i: u32) -> Service {
        let mut svc = random_service(rng, i);
        if rng.below(3) == 0 {
            let spec = svc.spec.get_or_insert_with(Default::default);
            spec.type_ = Some("LoadBalancer".into());
            let ranges = ["10.0.0.0/8", "192.0.2.0/24", "bad"];
            spec.load_balancer_source_ranges = Some(
                (0..=rng.below(2))
                    .map(|_| ranges[rng.below(3) as usize].to_owned())
                    .collect(),
            );
            svc.status = serde_json::from_value(json!({"loadBalancer": {"ingress": [
                {"ip": format!("192.168.70.{}", rng.below(3) + 1)}]}}))
            .ok();
        }
        svc
    }

    /// Everything after the plan follows the change list: the metrics' change counts and
    /// no-local-endpoints, the source ranges, the ClusterIP /32s and the health checks, kept
    /// incrementally over random change sequences (full updates among them), equal each time
    /// to what a full recompute of the same snapshot gives.
    #[test]
    fn consumers_of_the_change_list_equal_a_full_recompute_over_random_changes() {
        use crate::{
            dataplane::{service_cidrs, source_ranges},
            serving::metrics::{self, ChangeTracker},
        };
        let cidrs = [
            (Ipv4Addr::new(10, 96, 0, 0), 12),
            (Ipv4Addr::new(10, 96, 0, 3), 32),
        ];
        for seed in 1..=40u64 {
            let mut rng = Rng(seed.wrapping_mul(0x2545_f491_4f6c_dd1d));
            let mut services: BTreeMap<u32, Arc<ServiceData>> = BTreeMap::new();
            let mut slices: BTreeMap<(u32, u32), Arc<SliceData>> = BTreeMap::new();
            let node = NodeContext {
                scheduler: Default::default(),
                node_name: "node-a".into(),
                zone: Some("zone-a".into()),
            };
            let addrs = [Ipv4Addr::new(192, 168, 1, 1)];
            let mut cache = TranslateCache::new();
            let mut no_local = metrics::NoLocalEndpoints::default();
            let mut ranges = source_ranges::WantedRanges::default();
            let mut ips = service_cidrs::ClusterIps::default();
            let mut tracker = ChangeTracker::new(std::time::SystemTime::UNIX_EPOCH);
            let mut prev = Snapshot::default();
            let mut prev_checks = Vec::new();
            let mut seen_ranges = 0;
            for step in 0..40 {
                for _ in 0..=rng.below(4) {
                    let i = rng.below(10);
                    match rng.below(6) {
                        0 => {
                            services.remove(&i);
                        }
                        1 | 2 => {
                            services.insert(
                                i,
                                Arc::new(ServiceData::from(&random_lb_service(&mut rng, i))),
                            );
                        }
                        3 => {
                            slices.remove(&(i, rng.below(2)));
                        }
                        _ => {
                            let part = rng.below(2);
                            slices.insert((i, part), Arc::new(random_slice(&mut rng, i, part)));
                        }
                    }
                }
                let snapshot = Snapshot {
                    services: Arc::new(services.values().cloned().collect()),
                    endpoint_slices: Arc::new(slices.values().cloned().collect()),
                };
                let full = step == 0 || rng.below(8) == 0;
                let changes = cache.update(&snapshot, &node, &addrs, full);
                let desired = cache.desired();
                if full {
                    no_local.rebuild(desired);
                    ranges.rebuild(desired);
                    ips.rebuild(desired);
                } else {
                    no_local.update(&changes, desired);
                    ranges.update(&changes, desired);
                    ips.update(&changes, desired);
                }
                let at = format!("seed {seed} step {step} full {full}");
                assert_eq!(
                    no_local.counts(),
                    metrics::no_local_endpoints(desired),
                    "{at}"
                );
                assert_eq!(ranges.entries(), source_ranges::wanted(desired), "{at}");
                assert_eq!(
                    ips.entries(&cidrs),
                    service_cidrs::wanted(desired, &cidrs),
                    "{at}"
                );
                seen_ranges += usize::from(!ranges.entries().is_empty());
                // The change list names exactly the objects that differ from the last snapshot.
                let list = cache.last_changes();
                assert_eq!(list.all, full, "{at}");
                let checks = cache.health_checks();
                assert_eq!(list.health_checks, checks != prev_checks, "{at}");
                type Versions = BTreeSet<(ServiceName, String)>;
                let names = |objs: Vec<Option<(ServiceName, String)>>| -> Versions {
                    objs.into_iter().flatten().collect()
                };
                let diff = |before: &Versions, after: &Versions| -> BTreeSet<ServiceName> {
                    before
                        .symmetric_difference(after)
                        .map(|(k, _)| k.clone())
                        .collect()
                };
                let versions = |s: &Snapshot| {
                    let services = names(
                        (s.services.iter())
                            .map(|o| Some((service_name(o)?, format!("{o:?}"))))
                            .collect(),
                    );
                    let slices = names(
                        (s.endpoint_slices.iter())
                            .map(|o| {
                                let (svc, name) = slice_key(o)?;
                                let joined = format!("{}/{name}", svc.1);
                                Some(((svc.0, Name::from(joined)), format!("{o:?}")))
                            })
                            .collect(),
                    );
                    (services, slices)
                };
                let (before, after) = (versions(&prev), versions(&snapshot));
                let listed: BTreeSet<ServiceName> = list.services.iter().cloned().collect();
                assert_eq!(listed, diff(&before.0, &after.0), "{at}: Services");
                let listed: BTreeSet<ServiceName> = (list.slices.iter())
                    .map(|(((ns, svc), name), _)| (ns.clone(), Name::from(format!("{svc}/{name}"))))
                    .collect();
                assert_eq!(listed, diff(&before.1, &after.1), "{at}: slices");
                tracker.add(list);
                let pending = tracker.pending();
                assert_eq!(
                    (pending.services, pending.endpoint_slices),
                    (list.services.len() as u64, list.slices.len() as u64),
                    "{at}"
                );
                tracker.commit();
                prev = snapshot;
                prev_checks = checks;
            }
            assert!(seen_ranges > 0, "seed {seed}: some source ranges");
        }
    }

    /// [`Seen::split`] by places equals the set difference by identity, whether the list keeps
    /// its order (replaced in place), grows, shrinks or is shuffled.
    #[test]
    fn seen_split_finds_new_and_gone_objects_by_identity() {
        let mut rng = Rng(7);
        let mut seen = Seen::<u32>::default();
        let mut now: Vec<Arc<u32>> = Vec::new();
        let mut next = 0u32;
        for step in 0..400 {
            let before: Vec<Arc<u32>> = now.clone();
            match rng.below(5) {
                0 if !now.is_empty() => {
                    now.remove(rng.below(now.len() as u32) as usize);
                }
                1 => {
                    let at = rng.below(now.len() as u32 + 1) as usize;
                    now.insert(at, Arc::new(next));
                    next += 1;
                }
                2 if now.len() > 1 => {
                    let (a, b) = (rng.below(now.len() as u32), rng.below(now.len() as u32));
                    now.swap(a as usize, b as usize);
                }
                3 => {}
                _ if !now.is_empty() => {
                    let at = rng.below(now.len() as u32) as usize;
                    now[at] = Arc::new(next);
                    next += 1;
                }
                _ => {}
            }
            let (fresh, gone) = seen.split(&now);
            let ids = |v: &[Arc<u32>]| -> BTreeSet<u32> { v.iter().map(|o| **o).collect() };
            let (b, n) = (ids(&before), ids(&now));
            assert_eq!(ids(&fresh), &n - &b, "step {step}");
            assert_eq!(ids(&gone), &b - &n, "step {step}");
            assert_eq!(
                (fresh.len(), gone.len()),
                ((&n - &b).len(), (&b - &n).len())
            );
        }
    }

    fn sorted(mut v: Vec<Problem>) -> Vec<String> {
        let mut s: Vec<String> = v.drain(..).map(|p| p.to_string()).collect();
        s.sort();
        s
    }

    #[test]
    fn cache_equals_full_translation_over_random_changes() {
        for seed in 1..=40u64 {
            let mut rng = Rng(seed.wrapping_mul(0x9e37_79b9_7f4a_7c15));
            let mut services: BTreeMap<u32, Arc<ServiceData>> = BTreeMap::new();
            let mut slices: BTreeMap<(u32, u32), Arc<SliceData>> = BTreeMap::new();
            let mut node = NodeContext {
                scheduler: Default::default(),
                node_name: "node-a".into(),
                zone: Some("zone-a".into()),
            };
            let mut addrs = vec![Ipv4Addr::new(192, 168, 1, 1)];
            let mut cache = TranslateCache::new();
            let mut prev = DesiredState::default();
            let mut contended = 0;
            for step in 0..40 {
                contended += usize::from(!cache.conflicts().is_empty());
                for _ in 0..=rng.below(4) {
                    let i = rng.below(10);
                    match rng.below(7) {
                        0 => {
                            services.remove(&i);
                        }
                        1 | 2 => {
                            services.insert(
                                i,
                                Arc::new(ServiceData::from(random_service(&mut rng, i))),
                            );
                        }
                        3 => {
                            slices.remove(&(i, rng.below(2)));
                        }
                        4 => {
                            // A new Arc holding an equal object (the manifest source).
                            if let Some(s) = services.get(&i) {
                                let copy = Arc::new((**s).clone());
                                services.insert(i, copy);
                            }
                        }
                        _ => {
                            let part = rng.below(2);
                            slices.insert((i, part), Arc::new(random_slice(&mut rng, i, part)));
                        }
                    }
                }
                if rng.below(10) == 0 {
                    node.zone = Some(
                        if rng.below(2) == 0 {
                            "zone-a"
                        } else {
                            "zone-b"
                        }
                        .into(),
                    );
                }
                if rng.below(10) == 0 {
                    addrs = vec![Ipv4Addr::new(192, 168, 1, 1 + rng.below(2) as u8)];
                }
                let snapshot = Snapshot {
                    services: Arc::new(services.values().cloned().collect()),
                    endpoint_slices: Arc::new(slices.values().cloned().collect()),
                };
                let want = translate::translate_for_node(&snapshot, &node, &addrs);
                let changes = cache.update(&snapshot, &node, &addrs, rng.below(10) == 0);
                let at = format!("seed {seed} step {step}");
                assert_eq!(cache.desired(), &want.desired, "{at}");
                assert_eq!(sorted(cache.problems()), sorted(want.problems), "{at}");
                assert_eq!(sorted(cache.notes()), sorted(want.notes), "{at}");
                assert_eq!(cache.health_checks(), want.health_checks, "{at}");
                assert_eq!(cache.conflicts(), want.conflicts, "{at}");
                // The reported changes are exactly the frontends that differ, with their old
                // values.
                let mut expected: Vec<FrontendChange> = prev
                    .frontends
                    .keys()
                    .chain(want.desired.frontends.keys())
                    .collect::<std::collections::BTreeSet<_>>()
                    .into_iter()
                    .filter(|f| prev.frontends.get(f) != want.desired.frontends.get(f))
                    .map(|f| FrontendChange {
                        frontend: *f,
                        old: prev.frontends.get(f).cloned(),
                    })
                    .collect();
                expected.sort_by_key(|c| c.frontend);
                assert_eq!(changes, expected, "{at}");
                prev = want.desired;
            }
            assert!(contended > 0, "seed {seed}: frontends contended");
        }
    }

    /// Thousands of Services are translated on two threads: the result must not depend on it
    /// (the fixtures share a few addresses, so most Services lose their claims, in name order).
    #[test]
    fn a_large_first_sync_equals_the_full_translation() {
        let mut rng = Rng(99);
        let n = 3_000;
        let snapshot = Snapshot {
            services: Arc::new(
                (0..n)
                    .map(|i| Arc::new(ServiceData::from(random_service(&mut rng, i))))
                    .collect(),
            ),
            endpoint_slices: Arc::new(
                (0..n)
                    .flat_map(|i| [0, 1].map(|part| (i, part)))
                    .map(|(i, part)| Arc::new(random_slice(&mut rng, i, part)))
                    .collect(),
            ),
        };
        let node = NodeContext {
            scheduler: Default::default(),
            node_name: "node-a".into(),
            zone: Some("zone-a".into()),
        };
        let addrs = [Ipv4Addr::new(192, 168, 1, 1)];
        let want = translate::translate_for_node(&snapshot, &node, &addrs);
        let mut cache = TranslateCache::new();
        let changes = cache.update(&snapshot, &node, &addrs, true);
        assert!(want.problems.len() > 1_000, "claims contended");
        assert_eq!(cache.desired(), &want.desired);
        assert_eq!(sorted(cache.problems()), sorted(want.problems));
        assert_eq!(changes.len(), want.desired.frontends.len());
    }

    #[test]
    fn only_the_changed_service_is_translated_again() {
        let mut rng = Rng(7);
        let services: Vec<Arc<ServiceData>> = (0..50)
            .map(|i| {
                let mut s = random_service(&mut rng, i);
                s.spec.as_mut().expect("spec").cluster_ip = Some(format!("10.97.0.{}", i + 1));
                Arc::new(ServiceData::from(s))
            })
            .collect();
        let api_slices: Vec<EndpointSlice> =
            (0..50).map(|i| random_api_slice(&mut rng, i, 0)).collect();
        let mut snapshot = Snapshot {
            services: Arc::new(services),
            endpoint_slices: Arc::new(
                (api_slices.iter())
                    .map(|s| Arc::new(SliceData::from(s)))
                    .collect(),
            ),
        };
        let node = NodeContext::default();
        let mut cache = TranslateCache::new();
        cache.update(&snapshot, &node, &[], false);
        assert_eq!(
            cache.update(&snapshot, &node, &[], false),
            [],
            "nothing changed"
        );
        let mut changed = api_slices[7].clone();
        changed.endpoints = Some(Vec::new());
        Arc::make_mut(&mut snapshot.endpoint_slices)[7] = Arc::new(SliceData::from(&changed));
        let changes = cache.update(&snapshot, &node, &[], false);
        assert!(
            changes.iter().all(|c| cache
                .desired()
                .frontends
                .get(&c.frontend)
                .is_some_and(|d| d.service.name == "svc-7")),
            "{changes:?}"
        );
        assert!(
            cache
                .desired()
                .frontends
                .values()
                .any(|d| d.kind == FrontendKind::ClusterIp)
        );
    }

    fn named(namespace: &str, name: &str, created: &str, spec: Value) -> Arc<ServiceData> {
        let svc: Service = serde_json::from_value(json!({
            "metadata": {"name": name, "namespace": namespace, "creationTimestamp": created},
            "spec": spec,
        }))
        .expect("Service fixture");
        Arc::new(ServiceData::from(svc))
    }

    fn holder(cache: &TranslateCache, frontend: Frontend) -> Option<String> {
        let df = cache.desired().frontends.get(&frontend)?;
        Some(format!("{}/{}", df.service.namespace, df.service.name))
    }

    /// The winner of a frontend goes away: the loser's frontend (skipped until then) is
    /// programmed at that sync; an older Service appearing later takes it over. Each step equals
    /// the full translation.
    #[test]
    fn a_skipped_frontend_follows_the_winner_incrementally() {
        let ext = Frontend::new(
            Ipv4Addr::new(192, 0, 2, 1),
            80,
            crate::pipeline::model::Protocol::Tcp,
        );
        let spec = |cluster_ip: &str| {
            json!({"clusterIP": cluster_ip, "externalIPs": ["192.0.2.1"],
                   "ports": [{"name": "http", "port": 80}]})
        };
        let old = named("b", "old", "2026-01-01T00:00:00Z", spec("10.96.0.1"));
        let new = named("a", "new", "2026-02-01T00:00:00Z", spec("10.96.0.2"));
        let oldest = named("c", "oldest", "2025-01-01T00:00:00Z", spec("10.96.0.3"));
        let node = NodeContext::default();
        let mut cache = TranslateCache::new();
        let mut step = |services: Vec<Arc<ServiceData>>| {
            let snapshot = Snapshot {
                services: Arc::new(services),
                endpoint_slices: Arc::default(),
            };
            let changes = cache.update(&snapshot, &node, &[], false);
            let want = translate::translate_for_node(&snapshot, &node, &[]);
            assert_eq!(cache.desired(), &want.desired);
            assert_eq!(cache.conflicts(), want.conflicts);
            assert_eq!(sorted(cache.problems()), sorted(want.problems));
            (holder(&cache, ext), changes, cache.conflicts().len())
        };
        let (h, _, conflicts) = step(vec![new.clone(), old.clone()]);
        assert_eq!(h.as_deref(), Some("b/old"), "older wins against name order");
        assert_eq!(conflicts, 1);
        let (h, changes, conflicts) = step(vec![new.clone()]);
        assert_eq!(
            h.as_deref(),
            Some("a/new"),
            "the winner deleted: the loser takes it"
        );
        assert_eq!(conflicts, 0);
        assert!(
            changes
                .iter()
                .any(|c| c.frontend == ext
                    && c.old.as_ref().is_some_and(|o| o.service.name == "old")),
            "{changes:?}"
        );
        let (h, changes, conflicts) = step(vec![new.clone(), oldest.clone()]);
        assert_eq!(
            h.as_deref(),
            Some("c/oldest"),
            "an older Service takes it over"
        );
        assert_eq!(conflicts, 1);
        assert!(changes.iter().any(|c| c.frontend == ext), "{changes:?}");
        // The loser changes (its endpoints or spec): the frontend stays with the winner.
        let mut changed = (*new).clone();
        changed.resource_version = Some("2".into());
        changed.fingerprint ^= 1;
        let (h, changes, _) = step(vec![Arc::new(changed), oldest]);
        assert_eq!(h.as_deref(), Some("c/oldest"));
        assert!(changes.iter().all(|c| c.frontend != ext), "{changes:?}");
        // The loser's ClusterIP stayed programmed throughout.
        let cip = Frontend::new(
            Ipv4Addr::new(10, 96, 0, 2),
            80,
            crate::pipeline::model::Protocol::Tcp,
        );
        assert_eq!(holder(&cache, cip).as_deref(), Some("a/new"));
    }

    /// [`random_lb_service`] in the IPv6 family, dual-stack, or left IPv4-only: cluster IPs
    /// fd00:10:96::n beside (or instead of) 10.96.0.n, externalIPs and ingress addresses moved
    /// to IPv6 too (shared between Services, so frontends collide), IPv6 source ranges.
    fn random_service6(rng: &mut Rng, i: u32) -> Service {
        let mut svc = random_lb_service(rng, i);
        let spec = svc.spec.get_or_insert_with(Default::default);
        let v6 = |ip: &str| match ip.parse::<Ipv4Addr>() {
            Ok(a) => format!("fd00:{:x}::{:x}", a.octets()[0], a.octets()[3]),
            Err(_) => ip.to_owned(),
        };
        let ip4 = spec.cluster_ip.clone().unwrap_or_default();
        let ip6 = v6(&ip4);
        let valid = ip4.parse::<Ipv4Addr>().is_ok();
        match rng.below(4) {
            0 => {} // IPv4 only
            1 => {
                spec.cluster_ip = Some(ip6.clone());
                spec.cluster_ips = Some(vec![ip6]);
                spec.ip_families = Some(vec!["IPv6".into()]);
            }
            2 if valid => {
                spec.cluster_ips = Some(vec![ip4, ip6]);
                spec.ip_families = Some(vec!["IPv4".into(), "IPv6".into()]);
            }
            _ if valid => {
                spec.cluster_ip = Some(ip6.clone());
                spec.cluster_ips = Some(vec![ip6, ip4]);
                spec.ip_families = Some(vec!["IPv6".into(), "IPv4".into()]);
            }
            _ => {}
        }
        if let Some(ips) = spec.external_ips.as_mut() {
            *ips = ips.iter().map(|ip| v6(ip)).collect();
        }
        if let Some(ranges) = spec.load_balancer_source_ranges.as_mut()
            && rng.below(2) == 0
        {
            *ranges = vec!["fd00:1::/32".into()];
        }
        if let Some(status) = svc.status.as_mut()
            && let Some(lb) = status.load_balancer.as_mut()
        {
            for ingress in lb.ingress.iter_mut().flatten() {
                ingress.ip = ingress.ip.as_deref().map(v6);
            }
        }
        svc
    }

    /// [`random_slice`], of addressType IPv6 (endpoints fd00:244::n) two times in three.
    fn random_slice6(rng: &mut Rng, i: u32, part: u32) -> SliceData {
        let mut slice = random_api_slice(rng, i, part);
        if rng.below(3) != 0 {
            slice.address_type = "IPv6".into();
            for ep in slice.endpoints.iter_mut().flatten() {
                for addr in &mut ep.addresses {
                    if let Ok(a) = addr.parse::<Ipv4Addr>() {
                        *addr = format!("fd00:244::{:x}", a.octets()[3]);
                    }
                }
            }
        }
        SliceData::from(&slice)
    }

    /// The IPv6 family's incremental path over random IPv6, dual-stack and IPv4-only changes
    /// (full updates and node context changes among them): the [`FamilyCache`] equals the full
    /// IPv6 translation of each snapshot (desired state, problems, health checks, the changes it
    /// reports), and the IPv6 [`crate::pipeline::incremental::Planner`] fed those changes,
    /// with IPv4 holding ids in the shared spaces, leaves the shadow equal to the full plan's
    /// and never hands out an IPv4 id.
    #[test]
    fn ipv6_family_cache_and_planner_equal_the_full_path_over_random_changes() {
        use std::net::Ipv6Addr;

        use crate::pipeline::{
            diff,
            incremental::Planner,
            model::Scheduler,
            programmed::{Capacities, MapOp, Programmed, SharedIds},
        };
        let caps = Capacities {
            maglev_table_size: 251,
            ..Capacities::ipv6(1 << 16, 251)
        };
        let (mut partial, mut contended, mut maglev) = (0, 0, 0);
        for seed in 1..=40u64 {
            let mut rng = Rng(seed.wrapping_mul(0x9e37_79b9_7f4a_7c15));
            let mut services: BTreeMap<u32, Arc<ServiceData>> = BTreeMap::new();
            let mut slices: BTreeMap<(u32, u32), Arc<SliceData>> = BTreeMap::new();
            let mut node = NodeContext {
                scheduler: Default::default(),
                node_name: "node-a".into(),
                zone: Some("zone-a".into()),
            };
            let addrs4 = vec![Ipv4Addr::new(192, 168, 1, 1)];
            let mut addrs6 = vec!["fd00:192::1".parse::<Ipv6Addr>().expect("addr")];
            let mut cache4 = TranslateCache::new();
            cache4.set_ipv6_programmed(true);
            let mut cache6 = FamilyCache::<Ipv6Addr>::default();
            let mut prev = DesiredState::<Ipv6Addr>::default();
            // The incremental shadow and the full plan's, from the same empty maps.
            let mut p = Programmed::<Ipv6Addr>::default();
            let mut p_full = Programmed::<Ipv6Addr>::default();
            let mut planner = Planner::<Ipv6Addr>::new(&p);
            // IPv4 holds backend ids 1, 3 and Maglev table 2, and later takes and frees more.
            let mut ipv4 = SharedIds {
                backends: [1, 3].into_iter().collect(),
                maglev_tables: [2].into_iter().collect(),
            };
            // As Family6: IPv4's ids not kept, read from its shadow at a full plan.
            planner.share_by_shadow(ipv4.clone());
            for step in 0..40 {
                for _ in 0..=rng.below(4) {
                    let i = rng.below(10);
                    match rng.below(7) {
                        0 => {
                            services.remove(&i);
                        }
                        1 | 2 => {
                            let svc = random_service6(&mut rng, i);
                            services.insert(i, Arc::new(ServiceData::from(svc)));
                        }
                        3 => {
                            slices.remove(&(i, rng.below(2)));
                        }
                        4 => {
                            if let Some(s) = services.get(&i) {
                                let copy = Arc::new((**s).clone());
                                services.insert(i, copy);
                            }
                        }
                        _ => {
                            let part = rng.below(2);
                            slices.insert((i, part), Arc::new(random_slice6(&mut rng, i, part)));
                        }
                    }
                }
                if rng.below(10) == 0 {
                    node.zone = Some(["zone-a", "zone-b"][rng.below(2) as usize].into());
                }
                if rng.below(10) == 0 {
                    node.scheduler = [Scheduler::Random, Scheduler::Maglev][rng.below(2) as usize];
                }
                if rng.below(10) == 0 {
                    addrs6 = vec![
                        format!("fd00:192::{}", 1 + rng.below(2))
                            .parse()
                            .expect("addr"),
                    ];
                }
                // IPv4 takes a backend id or frees one of its own.
                let id = 1 + rng.below(12);
                let op: MapOp = if ipv4.backends.contains(&id) {
                    ipv4.backends.remove(&id);
                    MapOp::DeleteBackend { id }
                } else if !p.backends.contains_key(&id) {
                    ipv4.backends.insert(id);
                    MapOp::PutBackend {
                        id,
                        backend: Default::default(),
                    }
                } else {
                    MapOp::DeleteRevNat { id: 0 }
                };
                planner.other_applied(&p, &op);
                let snapshot = Snapshot {
                    services: Arc::new(services.values().cloned().collect()),
                    endpoint_slices: Arc::new(slices.values().cloned().collect()),
                };
                let full = rng.below(10) == 0;
                cache4.update(&snapshot, &node, &addrs4, full);
                let (changes, all) = cache6.update(&cache4, &node, &addrs6, full);
                let want = translate::translate_one_family::<Ipv6Addr>(&snapshot, &node, &addrs6);
                let at = format!("seed {seed} step {step}");
                assert_eq!(cache6.desired(), &want.desired, "{at}");
                contended += usize::from(!cache6.conflicts.is_empty());
                assert_eq!(sorted(cache6.problems()), sorted(want.problems), "{at}");
                assert_eq!(cache6.health_checks(), want.health_checks, "{at}");
                let mut expected: Vec<FrontendChange<Ipv6Addr>> = (prev.frontends.keys())
                    .chain(want.desired.frontends.keys())
                    .collect::<BTreeSet<_>>()
                    .into_iter()
                    .filter(|f| prev.frontends.get(f) != want.desired.frontends.get(f))
                    .map(|f| FrontendChange {
                        frontend: *f,
                        old: prev.frontends.get(f).cloned(),
                    })
                    .collect();
                expected.sort_by_key(|c| c.frontend);
                assert_eq!(changes, expected, "{at}");
                prev = want.desired.clone();

                planner.desired_changes(&changes, cache6.desired());
                let (plan, kind) =
                    planner
                        .plan_with_kind_reading(cache6.desired(), &p, &caps, all, || ipv4.clone());
                partial += usize::from(kind == crate::serving::metrics::SyncKind::Partial);
                for op in &plan.ops {
                    planner.observe(&p, op);
                    p.apply(op);
                }
                planner.applied(&plan);
                for op in diff::plan_sharing(&want.desired, &p_full, &caps, &ipv4).ops {
                    p_full.apply(&op);
                }
                assert_eq!(p, p_full, "{at}: the shadow equals the full plan's");
                maglev += usize::from(!p.maglev.is_empty());
                for id in &ipv4.backends {
                    assert!(!p.backends.contains_key(id), "{at}: IPv4's backend id {id}");
                }
                for id in &ipv4.maglev_tables {
                    assert!(!p.maglev.contains_key(id), "{at}: IPv4's table id {id}");
                }
            }
        }
        assert!(partial > 400, "most plans were incremental ({partial})");
        assert!(contended > 100 && maglev > 100, "{contended} {maglev}");
    }
}
