//! Incremental planning: only the frontends whose desired value changed, with the id indexes
//! kept up to date alongside the programmed shadow instead of rebuilt per plan.
//!
//! Pure. [`diff::plan`] stays the reference: [`Planner::plan`] gives the same operations, in the
//! same order, as `diff::plan` would for the same desired state and shadow (property-tested in
//! `diff`), by the same rules — endpoint → smallest programmed backend id, smallest free ids,
//! flags merged across the frontends sharing a backend, capacity counted at the plan's peak,
//! backends → rev-NAT → slots → frontends, shrinking in reverse, unreferenced entries last.
//! Where the shortcut could differ from the full plan it declines and the full plan runs:
//! the first plan, after a failed write, while a frontend is skipped for capacity, when the maps
//! hold leftovers (two backend ids for one endpoint, a shared rev-NAT id), when the changed
//! frontends do not all fit, when a new Maglev table does not fit, and when the maps hold two
//! Maglev tables of one content (an adopted leftover).
//!
//! Maglev tables are planned as `diff::plan` does, for the changed frontends only: a frontend
//! keeps its table while it holds what it needs, else takes the smallest programmed table of that
//! content (the index `table_ids`), else the one this plan writes, else a new one (smallest free
//! id); a table goes when the last frontend entry naming it does (`table_refs`). That equals the
//! full plan because after any applied plan every programmed Maglev frontend names a table of
//! exactly its backends and every table is named.

use std::{
    cmp::Reverse,
    collections::{BTreeMap, BTreeSet},
    net::Ipv4Addr,
    sync::Arc,
};

use proxy_common::{MAX_BACKENDS_PER_SERVICE, ServiceValue};

use crate::{
    pipeline::{
        diff::{self, Plan},
        encode,
        encode::{FamilyAbi, SlotKey as _},
        fast_hash::{HashMap, HashSet},
        maglev::MaglevTable,
        model::{DesiredFrontend, DesiredState, EndpointAddr, Family, Frontend},
        programmed::{Capacities, MapOp, Programmed, SharedIds},
        translate_cache::FrontendChange,
    },
    serving::metrics::SyncKind,
};

/// Free ids of one id space (1..=u32::MAX), as disjoint inclusive ranges keyed by their start.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FreeIds {
    ranges: BTreeMap<u32, u32>,
}

impl Default for FreeIds {
    fn default() -> Self {
        Self {
            ranges: BTreeMap::from([(1, u32::MAX)]),
        }
    }
}

impl FreeIds {
    /// `id` is now used (no-op if it already was, or is 0).
    pub fn take(&mut self, id: u32) {
        let Some((&start, &end)) = self.ranges.range(..=id).next_back() else {
            return;
        };
        if id == 0 || end < id {
            return;
        }
        self.ranges.remove(&start);
        if start < id {
            self.ranges.insert(start, id - 1);
        }
        if id < end {
            self.ranges.insert(id + 1, end);
        }
    }

    /// `id` is free again (no-op if it already was, or is 0).
    pub fn give(&mut self, id: u32) {
        if id == 0 || self.is_free(id) {
            return;
        }
        let (mut start, mut end) = (id, id);
        if let Some((&s, &e)) = self.ranges.range(..id).next_back()
            && e.checked_add(1) == Some(id)
        {
            self.ranges.remove(&s);
            start = s;
        }
        if let Some(next) = id.checked_add(1)
            && let Some(e) = self.ranges.remove(&next)
        {
            end = e;
        }
        self.ranges.insert(start, end);
    }

    pub fn is_free(&self, id: u32) -> bool {
        self.ranges
            .range(..=id)
            .next_back()
            .is_some_and(|(_, &end)| id <= end)
    }

    /// The free ids in increasing order (what [`crate::pipeline::ids::IdAllocator`] hands out).
    pub fn iter(&self) -> impl Iterator<Item = u32> + '_ {
        self.ranges.iter().flat_map(|(&s, &e)| s..=e)
    }
}

/// One endpoint as the maps and the desired state know it: one map entry for both sides
/// (two maps of 500,000 endpoints each were 36 MB at 50,000 Services). 12 bytes: at 500,000
/// endpoints the map has 2²⁰ slots, so each byte of an entry is 1 MiB.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
struct Endpoint {
    /// Programmed side: its smallest programmed backend id (0: none; a backend with id 0 is
    /// irregular).
    id: u32,
    /// Desired side: how many frontends use it (backends and retained lists), as local, as
    /// terminating, as not serving. The last three in 16, 8 and 8 bits; `local` is [`WIDE`] when
    /// they are kept in `Planner::wide_uses` instead (a local count past 65,534 or another past
    /// 254: exact, though few endpoints get there).
    frontends: u32,
    local: u16,
    terminating: u8,
    not_serving: u8,
}

/// [`Endpoint::local`]: the counts are in `Planner::wide_uses`.
const WIDE: u16 = u16::MAX;

impl Endpoint {
    /// Counts one more (`add`) or one fewer use as local, as terminating and/or as not serving
    /// (`which`).
    fn count_uses<A: Family>(
        &mut self,
        wide: &mut HashMap<EndpointAddr<A>, [u32; 3]>,
        ep: EndpointAddr<A>,
        which: [bool; 3],
        add: bool,
    ) {
        let step = |counts: &mut [u32; 3]| {
            for (n, _) in counts.iter_mut().zip(which).filter(|(_, w)| *w) {
                *n = if add { *n + 1 } else { n.saturating_sub(1) };
            }
        };
        if self.local == WIDE {
            step(wide.entry(ep).or_default());
            return;
        }
        let mut counts = [
            u32::from(self.local),
            u32::from(self.terminating),
            u32::from(self.not_serving),
        ];
        step(&mut counts);
        let [local, terminating, not_serving] = counts;
        match (
            u16::try_from(local).ok().filter(|n| *n < WIDE),
            u8::try_from(terminating).ok().filter(|n| *n < u8::MAX),
            u8::try_from(not_serving).ok().filter(|n| *n < u8::MAX),
        ) {
            (Some(local), Some(terminating), Some(not_serving)) => {
                (self.local, self.terminating, self.not_serving) =
                    (local, terminating, not_serving);
            }
            _ => {
                (self.local, self.terminating, self.not_serving) = (WIDE, 0, 0);
                wide.insert(ep, counts);
            }
        }
    }
}

/// Ids below this are counted in a vector (the allocators hand out the lowest free id, so ids
/// are dense: 4 bytes each instead of a hash map's ~10); larger ones (adopted from maps another
/// writer filled) in a map.
const DENSE_IDS: u32 = 1 << 22;

/// Reference counts by id (0: none).
#[derive(Clone, Debug, Default)]
struct RefCounts {
    dense: Vec<u32>,
    sparse: HashMap<u32, u32>,
}

impl RefCounts {
    fn get(&self, id: u32) -> u32 {
        if id < DENSE_IDS {
            self.dense.get(id as usize).copied().unwrap_or(0)
        } else {
            self.sparse.get(&id).copied().unwrap_or(0)
        }
    }

    fn incr(&mut self, id: u32) {
        if id < DENSE_IDS {
            let i = id as usize;
            if self.dense.len() <= i {
                self.dense.resize(i + 1, 0);
            }
            self.dense[i] += 1;
        } else {
            *self.sparse.entry(id).or_default() += 1;
        }
    }

    /// One reference fewer: the count left, `None` when there was none.
    fn decr(&mut self, id: u32) -> Option<u32> {
        if id < DENSE_IDS {
            let n = self.dense.get_mut(id as usize).filter(|n| **n > 0)?;
            *n -= 1;
            Some(*n)
        } else {
            let n = self.sparse.get_mut(&id)?;
            *n -= 1;
            let left = *n;
            if left == 0 {
                self.sparse.remove(&id);
            }
            Some(left)
        }
    }
}

/// Equal when every id has the same count (however long the vectors grew).
impl PartialEq for RefCounts {
    fn eq(&self, other: &Self) -> bool {
        let used = |v: &[u32]| v.len() - v.iter().rev().take_while(|n| **n == 0).count();
        let (a, b) = (&self.dense, &other.dense);
        a[..used(a)] == b[..used(b)] && self.sparse == other.sparse
    }
}

/// A changed frontend the plan carries: frontend, its slot-0 key, desired value, programmed
/// entry, rev-NAT id, backend ids of its slots.
type Accepted<'a, A> = (
    Frontend<A>,
    <A as FamilyAbi>::ServiceKey,
    &'a Arc<DesiredFrontend<A>>,
    Option<ServiceValue>,
    u32,
    Vec<u32>,
);

/// A Maglev table to write: id and content.
type TablePut<A> = (u32, Arc<MaglevTable<A>>);

/// Indexes over the programmed shadow and the desired state, and what changed since the last
/// plan.
#[derive(Debug)]
pub struct Planner<A: FamilyAbi = Ipv4Addr> {
    /// Endpoint → its smallest programmed backend id and how the desired frontends use it
    /// (an entry while either is there).
    endpoints: HashMap<EndpointAddr<A>, Endpoint>,
    /// The local, terminating and not-serving use counts of endpoints whose counts do not fit
    /// [`Endpoint`]'s fields.
    wide_uses: HashMap<EndpointAddr<A>, [u32; 3]>,
    /// Programmed backends that are not their endpoint's smallest id, or do not decode.
    irregular_backends: HashSet<u32>,
    /// Slots naming each backend id.
    slot_refs: RefCounts,
    /// Frontend entries naming each rev-NAT id.
    rev_nat_refs: RefCounts,
    free_backend_ids: FreeIds,
    free_rev_nat_ids: FreeIds,
    frontends: usize,
    /// Maglev table content → its smallest programmed id.
    table_ids: HashMap<Arc<MaglevTable<A>>, u32>,
    /// Programmed tables that are not their content's smallest id.
    irregular_tables: HashSet<u32>,
    /// Frontend entries naming each Maglev table id.
    table_refs: RefCounts,
    free_table_ids: FreeIds,
    /// `MAGLEV_V1` chunks the programmed tables take.
    table_chunks: u64,
    /// Frontends whose desired value changed since the last applied plan.
    pending: BTreeSet<Frontend<A>>,
    /// Endpoints those changes added or removed.
    touched: HashSet<EndpointAddr<A>>,
    /// The next plan must be a full one.
    needs_full: bool,
    /// Empty maps are being filled in groups (see [`Planner::begin_fill`]).
    filling: bool,
    /// The other family's ids in the spaces both share (backend and Maglev table ids): never
    /// handed out here, by the shortcut or the full plan ([`Planner::share_with`]).
    other: SharedIds,
    /// `other` is kept (see [`Planner::share_by_shadow`]).
    other_kept: bool,
}

impl<A: FamilyAbi> Planner<A> {
    /// Indexes for what `programmed` holds, with an empty desired state.
    pub fn new(programmed: &Programmed<A>) -> Self {
        let mut p = Self {
            endpoints: HashMap::default(),
            wide_uses: HashMap::default(),
            irregular_backends: HashSet::default(),
            slot_refs: RefCounts::default(),
            rev_nat_refs: RefCounts::default(),
            free_backend_ids: FreeIds::default(),
            free_rev_nat_ids: FreeIds::default(),
            frontends: 0,
            table_ids: HashMap::default(),
            irregular_tables: HashSet::default(),
            table_refs: RefCounts::default(),
            free_table_ids: FreeIds::default(),
            table_chunks: 0,
            pending: BTreeSet::new(),
            touched: HashSet::default(),
            needs_full: true,
            filling: false,
            other: SharedIds::default(),
            other_kept: true,
        };
        let mut empty = Programmed::<A>::default();
        let mut backends: Vec<_> = programmed.backends.iter().collect();
        backends.sort_by_key(|(id, _)| *id);
        let mut tables: Vec<_> = programmed.maglev.iter().collect();
        tables.sort_by_key(|(id, _)| **id);
        let ops = backends
            .into_iter()
            .map(|(id, &backend)| MapOp::PutBackend { id, backend })
            .chain(
                tables
                    .into_iter()
                    .map(|(&id, table)| MapOp::PutMaglevTable {
                        id,
                        table: table.clone(),
                    }),
            )
            .chain(
                programmed
                    .rev_nats
                    .iter()
                    .map(|(&id, &rev_nat)| MapOp::PutRevNat { id, rev_nat }),
            )
            .chain(
                programmed
                    .services
                    .iter()
                    .map(|(&key, value)| MapOp::PutService { key, value }),
            );
        for op in ops {
            p.observe(&empty, &op);
            empty.apply(&op);
        }
        p
    }

    /// Whether the indexes over the programmed maps equal `other`'s (tests: kept up to date
    /// versus rebuilt).
    pub fn same_indexes(&self, other: &Planner<A>) -> bool {
        self.endpoint_ids() == other.endpoint_ids()
            && self.irregular_backends == other.irregular_backends
            && self.slot_refs == other.slot_refs
            && self.rev_nat_refs == other.rev_nat_refs
            && self.free_backend_ids == other.free_backend_ids
            && self.free_rev_nat_ids == other.free_rev_nat_ids
            && self.frontends == other.frontends
            && self.table_ids == other.table_ids
            && self.irregular_tables == other.irregular_tables
            && self.table_refs == other.table_refs
            && self.free_table_ids == other.free_table_ids
            && self.table_chunks == other.table_chunks
    }

    /// Number of frontend entries (slot 0) programmed.
    pub fn frontend_count(&self) -> usize {
        self.frontends
    }

    /// The translation cache's changes of one update, against the desired state after it.
    pub fn desired_changes(&mut self, changes: &[FrontendChange<A>], desired: &DesiredState<A>) {
        for c in changes {
            let new = desired.frontends.get(&c.frontend).map(|d| &**d);
            self.desired_changed(c.frontend, c.old.as_deref(), new);
        }
    }

    /// A frontend's desired value changed from `old` to `new` (as the desired state now says).
    pub fn desired_changed(
        &mut self,
        frontend: Frontend<A>,
        old: Option<&DesiredFrontend<A>>,
        new: Option<&DesiredFrontend<A>>,
    ) {
        self.pending.insert(frontend);
        for (df, add) in [(old, false), (new, true)] {
            for b in df
                .into_iter()
                .flat_map(|d| d.backends.iter().chain(&d.retained))
            {
                // Only an incremental plan reads it: a full one is due anyway (the first sync
                // would hold every endpoint here).
                if !self.needs_full {
                    self.touched.insert(b.endpoint);
                }
                let u = self.endpoints.entry(b.endpoint).or_default();
                u.frontends = if add {
                    u.frontends + 1
                } else {
                    u.frontends.saturating_sub(1)
                };
                if u.frontends == 0 {
                    // No frontend uses it: the desired side starts again from nothing.
                    if u.local == WIDE {
                        self.wide_uses.remove(&b.endpoint);
                    }
                    (u.local, u.terminating, u.not_serving) = (0, 0, 0);
                    if u.id == 0 {
                        self.endpoints.remove(&b.endpoint);
                    }
                } else if b.local || b.terminating || b.not_serving {
                    let which = [b.local, b.terminating, b.not_serving];
                    u.count_uses(&mut self.wide_uses, b.endpoint, which, add);
                }
            }
        }
    }

    /// Plan the changes since the last applied plan; the full [`diff::plan`] when `full` or
    /// when the shortcut declines (see the module doc).
    pub fn plan(
        &self,
        desired: &DesiredState<A>,
        programmed: &Programmed<A>,
        caps: &Capacities,
        full: bool,
    ) -> Plan<A> {
        self.plan_with_kind(desired, programmed, caps, full).0
    }

    /// [`Planner::plan`], and whether the full plan ran (`full`, or the shortcut declined).
    pub fn plan_with_kind(
        &self,
        desired: &DesiredState<A>,
        programmed: &Programmed<A>,
        caps: &Capacities,
        full: bool,
    ) -> (Plan<A>, SyncKind) {
        if !full && let Some(plan) = self.plan_changes(desired, programmed, caps) {
            return (plan, SyncKind::Partial);
        }
        let plan = diff::plan_sharing(desired, programmed, caps, &self.other);
        (plan, SyncKind::Full)
    }

    /// [`Planner::plan_with_kind`] for a planner sharing by [`Planner::share_by_shadow`]: a full
    /// plan avoids the ids `other` reads from the other family's shadow (only then: a full plan is
    /// rare, the other family's ids are not kept between them).
    pub fn plan_with_kind_reading(
        &self,
        desired: &DesiredState<A>,
        programmed: &Programmed<A>,
        caps: &Capacities,
        full: bool,
        other: impl FnOnce() -> SharedIds,
    ) -> (Plan<A>, SyncKind) {
        if !full && let Some(plan) = self.plan_changes(desired, programmed, caps) {
            return (plan, SyncKind::Partial);
        }
        let plan = diff::plan_sharing(desired, programmed, caps, &other());
        (plan, SyncKind::Full)
    }

    /// As [`Planner::share_with`], without keeping a copy of `other`: its ids only leave the free
    /// ids, and later ones follow [`Planner::other_applied`] there. For the IPv6 planner beside
    /// the IPv4 one, whose 500,000 backend ids at 50,000 Services would cost ~5 MB as a set; its
    /// full plans read them with [`Planner::plan_with_kind_reading`].
    pub fn share_by_shadow(&mut self, other: SharedIds) {
        self.share_with(other);
        self.other = SharedIds::default();
        self.other_kept = false;
    }

    /// The other family holds `other` (its maps as adopted at start-up): those ids are taken.
    pub fn share_with(&mut self, other: SharedIds) {
        for &id in &other.backends {
            self.free_backend_ids.take(id);
        }
        for &id in &other.maglev_tables {
            self.free_table_ids.take(id);
        }
        self.other = other;
    }

    /// The other family applied `op` (to its maps, `programmed` being this family's): its
    /// backend and Maglev table ids stay out of this family's free ids while it holds them.
    pub fn other_applied<B: FamilyAbi>(&mut self, programmed: &Programmed<A>, op: &MapOp<B>) {
        if !self.other_kept {
            // The other family held the id it deletes (never this one's): free it unless this
            // family uses it.
            match *op {
                MapOp::PutBackend { id, .. } => self.free_backend_ids.take(id),
                MapOp::DeleteBackend { id } if !self.backend_used(programmed, id) => {
                    self.free_backend_ids.give(id)
                }
                MapOp::PutMaglevTable { id, .. } => self.free_table_ids.take(id),
                MapOp::DeleteMaglevTable { id, .. }
                    if !programmed.maglev.contains_key(&id) && self.table_refs.get(id) == 0 =>
                {
                    self.free_table_ids.give(id)
                }
                _ => {}
            }
            return;
        }
        match *op {
            MapOp::PutBackend { id, .. } => {
                self.other.backends.insert(id);
                self.free_backend_ids.take(id);
            }
            MapOp::DeleteBackend { id }
                if self.other.backends.remove(&id) && !self.backend_used(programmed, id) =>
            {
                self.free_backend_ids.give(id);
            }
            MapOp::PutMaglevTable { id, .. } => {
                self.other.maglev_tables.insert(id);
                self.free_table_ids.take(id);
            }
            MapOp::DeleteMaglevTable { id, .. }
                if self.other.maglev_tables.remove(&id)
                    && !programmed.maglev.contains_key(&id)
                    && self.table_refs.get(id) == 0 =>
            {
                self.free_table_ids.give(id);
            }
            _ => {}
        }
    }

    /// Record an operation before it is applied to `programmed` (which still holds the value it
    /// replaces).
    pub fn observe(&mut self, programmed: &Programmed<A>, op: &MapOp<A>) {
        match *op {
            MapOp::PutBackend { id, backend } => {
                let was_used = self.backend_used(programmed, id);
                if let Some(old) = programmed.backends.get(&id) {
                    self.unregister_backend(programmed, id, encode::decode_endpoint(old));
                }
                self.register_backend(id, encode::decode_endpoint(&backend));
                if !was_used {
                    self.free_backend_ids.take(id);
                }
            }
            MapOp::DeleteBackend { id } => {
                if let Some(old) = programmed.backends.get(&id) {
                    self.unregister_backend(programmed, id, encode::decode_endpoint(old));
                    if self.slot_refs.get(id) == 0 {
                        self.free_backend_ids.give(id);
                    }
                }
            }
            MapOp::PutRevNat { id, .. } => {
                self.free_rev_nat_ids.take(id);
            }
            MapOp::DeleteRevNat { id } => {
                if programmed.rev_nats.contains_key(&id) && self.rev_nat_refs.get(id) == 0 {
                    self.free_rev_nat_ids.give(id);
                }
            }
            MapOp::PutService { key, value } => {
                if let Some(old) = programmed.services.get(&key) {
                    self.unref_service(programmed, &key, &old);
                }
                if key.slot() == 0 {
                    self.frontends += 1;
                    self.rev_nat_refs.incr(value.rev_nat_id);
                    self.free_rev_nat_ids.take(value.rev_nat_id);
                    if value.maglev_table != 0 {
                        self.table_refs.incr(value.maglev_table);
                        self.free_table_ids.take(value.maglev_table);
                    }
                } else {
                    self.slot_refs.incr(value.backend_id);
                    self.free_backend_ids.take(value.backend_id);
                }
            }
            MapOp::DeleteService { key } => {
                if let Some(old) = programmed.services.get(&key) {
                    self.unref_service(programmed, &key, &old);
                }
            }
            // No index over them: a plan reads them from the shadow, per frontend.
            MapOp::PutAffinityMatch { .. } | MapOp::DeleteAffinityMatch { .. } => {}
            MapOp::PutMaglevTable { id, ref table } => {
                if let Some(old) = programmed.maglev.get(&id) {
                    self.unregister_table(programmed, id, old);
                }
                self.register_table(id, table);
                self.free_table_ids.take(id);
            }
            MapOp::DeleteMaglevTable { id, .. } => {
                if let Some(old) = programmed.maglev.get(&id) {
                    self.unregister_table(programmed, id, old);
                    if self.table_refs.get(id) == 0 {
                        self.free_table_ids.give(id);
                    }
                }
            }
        }
    }

    /// The plan was applied in full.
    pub fn applied(&mut self, plan: &Plan<A>) {
        self.pending.clear();
        self.filling = false;
        // A full sync touches every endpoint: do not keep a table that size for the next one.
        if self.touched.capacity() > 4096 {
            self.touched = HashSet::default();
        } else {
            self.touched.clear();
        }
        // A skipped frontend is retried by the full plan, which alone knows what it left.
        self.needs_full = !plan.skipped.is_empty();
    }

    /// Writing a plan stopped part-way: the next plan is a full one.
    pub fn failed(&mut self) {
        self.needs_full = true;
        self.filling = false;
    }

    fn backend_used(&self, programmed: &Programmed<A>, id: u32) -> bool {
        programmed.backends.contains_key(&id) || self.slot_refs.get(id) > 0
    }

    fn unref_service(
        &mut self,
        programmed: &Programmed<A>,
        key: &A::ServiceKey,
        old: &ServiceValue,
    ) {
        if key.slot() == 0 {
            self.frontends = self.frontends.saturating_sub(1);
            let id = old.rev_nat_id;
            if self.rev_nat_refs.decr(id) == Some(0) && !programmed.rev_nats.contains_key(&id) {
                self.free_rev_nat_ids.give(id);
            }
            let table = old.maglev_table;
            if table != 0
                && self.table_refs.decr(table) == Some(0)
                && !programmed.maglev.contains_key(&table)
            {
                self.free_table_ids.give(table);
            }
        } else {
            let id = old.backend_id;
            if self.slot_refs.decr(id) == Some(0) && !programmed.backends.contains_key(&id) {
                self.free_backend_ids.give(id);
            }
        }
    }

    /// The endpoint's smallest programmed backend id.
    fn endpoint_id(&self, ep: &EndpointAddr<A>) -> Option<u32> {
        self.endpoints.get(ep).map(|e| e.id).filter(|id| *id != 0)
    }

    fn set_endpoint_id(&mut self, ep: EndpointAddr<A>, id: u32) {
        self.endpoints.entry(ep).or_default().id = id;
    }

    fn clear_endpoint_id(&mut self, ep: &EndpointAddr<A>) {
        if let Some(e) = self.endpoints.get_mut(ep) {
            e.id = 0;
            if e.frontends == 0 {
                self.endpoints.remove(ep);
            }
        }
    }

    /// How many desired frontends use the endpoint: `(all, as local, as terminating, as not
    /// serving)` (`None`: no frontend does).
    fn endpoint_use(&self, ep: &EndpointAddr<A>) -> Option<(u32, u32, u32, u32)> {
        let e = self.endpoints.get(ep).filter(|e| e.frontends > 0)?;
        let [local, terminating, not_serving] = match e.local {
            WIDE => self.wide_uses.get(ep).copied().unwrap_or_default(),
            _ => [
                u32::from(e.local),
                u32::from(e.terminating),
                u32::from(e.not_serving),
            ],
        };
        Some((e.frontends, local, terminating, not_serving))
    }

    /// Endpoint → smallest programmed backend id (tests: the programmed side alone).
    fn endpoint_ids(&self) -> HashMap<EndpointAddr<A>, u32> {
        (self.endpoints.iter())
            .filter(|(_, e)| e.id != 0)
            .map(|(ep, e)| (*ep, e.id))
            .collect()
    }

    fn register_backend(&mut self, id: u32, ep: Option<EndpointAddr<A>>) {
        let Some(ep) = ep.filter(|_| id != 0) else {
            self.irregular_backends.insert(id);
            return;
        };
        match self.endpoint_id(&ep) {
            None => self.set_endpoint_id(ep, id),
            Some(cur) if cur == id => {}
            Some(cur) if cur < id => {
                self.irregular_backends.insert(id);
            }
            Some(cur) => {
                self.irregular_backends.insert(cur);
                self.set_endpoint_id(ep, id);
            }
        }
    }

    fn register_table(&mut self, id: u32, table: &Arc<MaglevTable<A>>) {
        self.table_chunks += u64::from(table.chunks());
        match self.table_ids.get(table).copied() {
            None => {
                self.table_ids.insert(table.clone(), id);
            }
            Some(cur) if cur == id => {}
            Some(cur) if cur < id => {
                self.irregular_tables.insert(id);
            }
            Some(cur) => {
                self.irregular_tables.insert(cur);
                self.table_ids.insert(table.clone(), id);
            }
        }
    }

    /// Table `id` (holding `table`, still in `programmed`) goes or is replaced.
    fn unregister_table(
        &mut self,
        programmed: &Programmed<A>,
        id: u32,
        table: &Arc<MaglevTable<A>>,
    ) {
        self.table_chunks = self.table_chunks.saturating_sub(u64::from(table.chunks()));
        if self.irregular_tables.remove(&id) {
            return;
        }
        if self.table_ids.get(table) != Some(&id) {
            return;
        }
        self.table_ids.remove(table);
        // Another table of the same content (a leftover) becomes the content's id.
        let next = self
            .irregular_tables
            .iter()
            .copied()
            .filter(|other| programmed.maglev.get(other).is_some_and(|t| t == table))
            .min();
        if let Some(next) = next {
            self.irregular_tables.remove(&next);
            self.table_ids
                .insert(programmed.maglev[&next].clone(), next);
        }
    }

    fn unregister_backend(
        &mut self,
        programmed: &Programmed<A>,
        id: u32,
        ep: Option<EndpointAddr<A>>,
    ) {
        if self.irregular_backends.remove(&id) {
            return;
        }
        let Some(ep) = ep else { return };
        if self.endpoint_id(&ep) != Some(id) {
            return;
        }
        self.clear_endpoint_id(&ep);
        // Another id for the same endpoint (a leftover) becomes the endpoint's id.
        let next = self
            .irregular_backends
            .iter()
            .copied()
            .filter(|other| {
                *other != 0
                    && programmed
                        .backends
                        .get(other)
                        .and_then(encode::decode_endpoint)
                        == Some(ep)
            })
            .min();
        if let Some(next) = next {
            self.irregular_backends.remove(&next);
            self.set_endpoint_id(ep, next);
        }
    }

    /// The Maglev table of each accepted frontend (0: none) and the new tables to write, as
    /// `diff::assign_maglev_tables` gives them; `None` where a new table does not fit (the full
    /// plan reports that) or no id is left.
    fn assign_tables(
        &self,
        accepted: &[Accepted<'_, A>],
        programmed: &Programmed<A>,
        caps: &Capacities,
    ) -> Option<(Vec<u32>, Vec<TablePut<A>>)> {
        let mut tables = Vec::with_capacity(accepted.len());
        let mut puts: Vec<TablePut<A>> = Vec::new();
        let mut planned: HashMap<Arc<MaglevTable<A>>, u32> = HashMap::default();
        let mut alloc = self.free_table_ids.iter();
        let mut chunks = self.table_chunks;
        for (_, _, df, entry, _, slot_ids) in accepted {
            if !diff::wants_maglev(df) || slot_ids.is_empty() {
                tables.push(0);
                continue;
            }
            let want = diff::maglev_table(df, caps.maglev_table_size);
            let current = entry
                .map(|v| v.maglev_table)
                .filter(|id| programmed.maglev.get(id).is_some_and(|t| **t == *want));
            let found = current
                .or_else(|| self.table_ids.get(&want).copied())
                .or_else(|| planned.get(&want).copied());
            let id = match found {
                Some(id) => id,
                None => {
                    chunks += u64::from(want.chunks());
                    if chunks > u64::from(caps.maglev_chunks) {
                        return None;
                    }
                    let id = alloc.next()?;
                    planned.insert(want.clone(), id);
                    puts.push((id, want));
                    id
                }
            };
            tables.push(id);
        }
        Some((tables, puts))
    }

    /// The plan for the pending frontends only, or `None` where it could differ from
    /// [`diff::plan`] (then [`Planner::plan`] runs the full one).
    pub fn plan_changes(
        &self,
        desired: &DesiredState<A>,
        programmed: &Programmed<A>,
        caps: &Capacities,
    ) -> Option<Plan<A>> {
        if self.needs_full || self.irregular() {
            return None;
        }
        self.plan_for(&self.pending, &self.touched, desired, programmed, caps)
    }

    fn irregular(&self) -> bool {
        !self.irregular_backends.is_empty() || !self.irregular_tables.is_empty()
    }

    /// Starts filling empty maps in groups ([`Planner::plan_fill_group`]) instead of one full
    /// plan: only for the full plan onto a shadow that holds nothing, where the full plan is
    /// every pending frontend's incremental plan (no entry to remove, no leftover). Whether it
    /// started.
    /// `programmed` gets room for the whole fill at once (no table grows by doubling, which
    /// holds the old and the new table together).
    pub fn begin_fill(
        &mut self,
        desired: &DesiredState<A>,
        programmed: &mut Programmed<A>,
    ) -> bool {
        self.filling = self.needs_full
            && !self.irregular()
            && programmed.services.is_empty()
            && programmed.backends.is_empty()
            && programmed.rev_nats.is_empty()
            && programmed.affinity_matches.is_empty()
            && programmed.maglev.is_empty();
        if self.filling {
            let slots: usize = desired.frontends.values().map(|d| d.backends.len()).sum();
            let frontends = desired.frontends.len();
            programmed.services.reserve(frontends + slots, slots);
            programmed.backends.reserve(self.endpoints.len());
            programmed.rev_nats.reserve(frontends);
        }
        self.filling
    }

    /// While filling: the plan for the next (at most `frontends`) pending frontends, in order,
    /// with their backends (flags merged over the whole desired state); to be applied and
    /// confirmed with [`Planner::fill_group_applied`] before the next. The groups' plans together
    /// carry what the one full plan would (same ids: the same admission order and smallest free
    /// ids; property-tested in `diff`), but the op vector and the plan's indexes never exist for
    /// the whole state at once (at 50,000 Services they were the agent's peak). `None`: not
    /// filling, nothing left, or a group declined (it does not fit, a Maglev table does not fit):
    /// then the full plan carries the rest.
    pub fn plan_fill_group(
        &self,
        desired: &DesiredState<A>,
        programmed: &Programmed<A>,
        caps: &Capacities,
        frontends: usize,
    ) -> Option<Plan<A>> {
        if !self.filling || self.pending.is_empty() {
            return None;
        }
        let group = || self.pending.iter().take(frontends.max(1));
        let mut touched: Vec<EndpointAddr<A>> = group()
            .filter_map(|fe| desired.frontends.get(fe))
            .flat_map(|df| df.backends.iter().chain(&df.retained))
            .map(|b| b.endpoint)
            .collect();
        touched.sort_unstable();
        touched.dedup();
        self.plan_for(group(), &touched, desired, programmed, caps)
    }

    /// The group [`Planner::plan_fill_group`] gave (`frontends` as passed there) was applied in
    /// full; whether frontends are left to fill.
    pub fn fill_group_applied(&mut self, frontends: usize) -> bool {
        for _ in 0..frontends.max(1) {
            self.pending.pop_first();
        }
        if self.pending.is_empty() {
            self.filling = false;
            self.needs_full = false;
            self.touched = HashSet::default();
        }
        self.filling
    }

    /// The plan for `frontends` (all pending, or one fill group) whose changes touched the
    /// endpoints `touched`, or `None` where it could differ from [`diff::plan`].
    fn plan_for<'f>(
        &self,
        frontends: impl IntoIterator<Item = &'f Frontend<A>>,
        touched: impl IntoIterator<Item = &'f EndpointAddr<A>>,
        desired: &DesiredState<A>,
        programmed: &Programmed<A>,
        caps: &Capacities,
    ) -> Option<Plan<A>> {
        // Admission, as diff::plan: programmed frontends first, then new ones, in order.
        let mut existing = Vec::new();
        let mut fresh = Vec::new();
        let mut removed = Vec::new();
        for fe in frontends {
            let key = encode::service_key(fe, 0);
            let entry = programmed.services.get(&key);
            match (desired.frontends.get(fe), entry) {
                (Some(df), Some(v)) => existing.push((*fe, key, df, Some(v))),
                (Some(df), None) => fresh.push((*fe, key, df, None)),
                (None, Some(v)) => removed.push((key, v)),
                (None, None) => {}
            }
        }
        let mut used_services = programmed.services.len() as u64;
        let mut used_backends = programmed.backends.len() as u64;
        let mut used_rev_nats = programmed.rev_nats.len() as u64;
        let mut new_backend_ids: HashMap<EndpointAddr<A>, u32> = HashMap::default();
        let mut backend_alloc = self.free_backend_ids.iter();
        let mut rev_nat_alloc = self.free_rev_nat_ids.iter();
        let mut accepted: Vec<Accepted<'_, A>> = Vec::new();
        for (fe, key, df, entry) in existing.into_iter().chain(fresh) {
            let count = u16::try_from(df.backends.len())
                .ok()
                .filter(|n| *n <= MAX_BACKENDS_PER_SERVICE)?;
            let new_services = u64::from(entry.is_none())
                + (1..=count)
                    .filter(|s| !programmed.services.contains_key(&key.with_slot(*s)))
                    .count() as u64;
            let mut missing: Vec<EndpointAddr<A>> = df
                .backends
                .iter()
                .chain(&df.retained)
                .map(|b| b.endpoint)
                .filter(|ep| self.endpoint_id(ep).is_none() && !new_backend_ids.contains_key(ep))
                .collect();
            missing.sort();
            missing.dedup();
            let reuse = entry.map(|v| v.rev_nat_id).filter(|id| *id != 0);
            if let Some(id) = reuse
                && self.rev_nat_refs.get(id) != 1
            {
                return None; // shared by several frontend entries: a leftover
            }
            let new_rev_nats =
                u64::from(reuse.is_none_or(|id| !programmed.rev_nats.contains_key(&id)));
            if used_services + new_services > u64::from(caps.services)
                || used_backends + missing.len() as u64 > u64::from(caps.backends)
                || used_rev_nats + new_rev_nats > u64::from(caps.rev_nats)
            {
                return None;
            }
            let rev_nat_id = match reuse {
                Some(id) => id,
                None => rev_nat_alloc.next()?,
            };
            for ep in missing.iter() {
                new_backend_ids.insert(*ep, backend_alloc.next()?);
            }
            used_services += new_services;
            used_backends += missing.len() as u64;
            used_rev_nats += new_rev_nats;
            let id_of = |ep: &EndpointAddr<A>| {
                (self.endpoint_id(ep)).or_else(|| new_backend_ids.get(ep).copied())
            };
            let slot_ids: Vec<u32> = df
                .backends
                .iter()
                .filter_map(|b| id_of(&b.endpoint))
                .collect();
            accepted.push((fe, key, df, entry, rev_nat_id, slot_ids));
        }
        accepted.sort_by_key(|a| a.0);
        let (tables, table_puts) = self.assign_tables(&accepted, programmed, caps)?;
        let id_of = |ep: &EndpointAddr<A>| {
            (self.endpoint_id(ep)).or_else(|| new_backend_ids.get(ep).copied())
        };

        let mut ops = Vec::new();
        // Phase 0: affinity match entries of the changed frontends that go. Other frontends'
        // are as the last plan left them: exactly their wanted ones.
        let mut dead_matches: Vec<A::AffinityMatchKey> = Vec::new();
        let mut new_matches: Vec<A::AffinityMatchKey> = Vec::new();
        for (_, key, df, _, _, slot_ids) in &accepted {
            let wanted = encode::affinity_matches(key, df, slot_ids);
            let have = programmed.affinity_matches_of(key);
            dead_matches.extend(have.iter().filter(|k| wanted.binary_search(k).is_err()));
            new_matches.extend(
                wanted
                    .iter()
                    .filter(|k| !programmed.affinity_matches.contains(k)),
            );
        }
        for (key, _) in &removed {
            dead_matches.extend(programmed.affinity_matches_of(key));
        }
        dead_matches.sort_unstable();
        new_matches.sort_unstable();
        ops.extend(
            dead_matches
                .into_iter()
                .map(|key| MapOp::DeleteAffinityMatch { key }),
        );
        // Phase 1: backends the changes touched, with flags merged over every frontend using
        // them; then rev-NAT entries.
        let mut puts = Vec::new();
        let mut dead_backends = Vec::new();
        for ep in touched {
            match self.endpoint_use(ep) {
                Some((frontends, local, terminating, not_serving)) => {
                    let id = id_of(ep)?;
                    let backend = A::backend(
                        ep.addr,
                        ep.port.to_be_bytes(),
                        ep.protocol.number(),
                        encode::backend_flags(
                            terminating == frontends,
                            local > 0,
                            not_serving == frontends,
                        ),
                    );
                    if programmed.backends.get(&id) != Some(&backend) {
                        puts.push((id, backend));
                    }
                }
                None => {
                    if let Some(id) = self.endpoint_id(ep) {
                        dead_backends.push(id);
                    }
                }
            }
        }
        puts.sort_by_key(|(id, _)| *id);
        ops.extend(
            puts.into_iter()
                .map(|(id, backend)| MapOp::PutBackend { id, backend }),
        );
        let mut rev_nats: Vec<(u32, A::RevNat)> = accepted
            .iter()
            .map(|a| (a.4, encode::rev_nat(&a.0)))
            .collect();
        rev_nats.sort_by_key(|(id, _)| *id);
        rev_nats.dedup_by_key(|(id, _)| *id);
        let claimed: HashSet<u32> = rev_nats.iter().map(|(id, _)| *id).collect();
        for (id, rev_nat) in rev_nats {
            if programmed.rev_nats.get(&id) != Some(&rev_nat) {
                ops.push(MapOp::PutRevNat { id, rev_nat });
            }
        }
        // New Maglev tables: whole before any frontend entry names them.
        ops.extend(
            table_puts
                .into_iter()
                .map(|(id, table)| MapOp::PutMaglevTable { id, table }),
        );

        // Phase 2: backend slots.
        let put_if_changed = |ops: &mut Vec<MapOp<A>>, key: A::ServiceKey, value: ServiceValue| {
            if programmed.services.get(&key) != Some(value) {
                ops.push(MapOp::PutService { key, value });
            }
        };
        for (_, key, _, _, _, slot_ids) in &accepted {
            for (slot, id) in (1..).zip(slot_ids) {
                put_if_changed(&mut ops, key.with_slot(slot), ServiceValue::slot(*id));
            }
        }
        ops.extend(
            new_matches
                .into_iter()
                .map(|key| MapOp::PutAffinityMatch { key }),
        );

        // Phase 3: frontend entries; removed frontends.
        let mut removed_slots = Vec::new();
        let mut dead_rev_nats = Vec::new();
        // Frontend entries naming each Maglev table, after this plan minus before (tables whose
        // count drops to 0 go last).
        let mut table_delta: HashMap<u32, i64> = HashMap::default();
        for ((fe, key, df, entry, rev_nat_id, slot_ids), &table) in accepted.iter().zip(&tables) {
            let count = u16::try_from(slot_ids.len()).unwrap_or(u16::MAX);
            let refs = encode::FrontendRefs {
                maglev_table: table,
                ..encode::frontend_refs(df)
            };
            put_if_changed(
                &mut ops,
                *key,
                encode::frontend_value(fe, df, count, *rev_nat_id, refs),
            );
            let old = entry.map_or(0, |v| v.maglev_table);
            if old != table {
                *table_delta.entry(old).or_default() -= 1;
                *table_delta.entry(table).or_default() += 1;
            }
            if let Some(v) = entry {
                removed_slots.extend(
                    (count + 1..=v.count)
                        .map(|s| key.with_slot(s))
                        .filter(|k| programmed.services.contains_key(k)),
                );
                if v.rev_nat_id != *rev_nat_id {
                    dead_rev_nats.push(v.rev_nat_id);
                }
            }
        }
        removed.sort_by_key(|(key, _)| *key);
        for (key, v) in &removed {
            ops.push(MapOp::DeleteService { key: *key });
            removed_slots.extend(
                (1..=v.count)
                    .map(|s| key.with_slot(s))
                    .filter(|k| programmed.services.contains_key(k)),
            );
            if self.rev_nat_refs.get(v.rev_nat_id) != 1 {
                return None;
            }
            dead_rev_nats.push(v.rev_nat_id);
            *table_delta.entry(v.maglev_table).or_default() -= 1;
        }

        // Phase 4: slots beyond the new counts, highest first per frontend.
        removed_slots.sort_by_key(|k| (k.with_slot(0), Reverse(k.slot())));
        ops.extend(
            removed_slots
                .into_iter()
                .map(|key| MapOp::DeleteService { key }),
        );

        // Phase 5: rev-NAT entries and backends nothing refers to.
        dead_rev_nats.retain(|id| !claimed.contains(id) && programmed.rev_nats.contains_key(id));
        dead_rev_nats.sort_unstable();
        dead_rev_nats.dedup();
        ops.extend(
            dead_rev_nats
                .into_iter()
                .map(|id| MapOp::DeleteRevNat { id }),
        );
        dead_backends.sort_unstable();
        ops.extend(
            dead_backends
                .into_iter()
                .map(|id| MapOp::DeleteBackend { id }),
        );
        let mut dead_tables: Vec<(u32, u32)> = table_delta
            .into_iter()
            .filter(|&(id, delta)| id != 0 && i64::from(self.table_refs.get(id)) + delta == 0)
            .filter_map(|(id, _)| Some((id, programmed.maglev.get(&id)?.chunks())))
            .collect();
        dead_tables.sort_unstable();
        ops.extend(
            dead_tables
                .into_iter()
                .map(|(id, chunks)| MapOp::DeleteMaglevTable { id, chunks }),
        );
        Some(Plan {
            ops,
            skipped: Vec::new(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The local, terminating and not-serving counts are exact past their 16 and 8 bits (moved
    /// to `wide_uses` and back to nothing when the last frontend goes), and give the same flags.
    #[test]
    fn use_counts_past_16_bits_stay_exact() {
        use std::net::Ipv4Addr;

        use crate::pipeline::model::{DesiredBackend, Protocol, ServicePortName};
        let ep = EndpointAddr {
            addr: Ipv4Addr::new(10, 244, 0, 1),
            port: 8080,
            protocol: Protocol::Tcp,
        };
        let df = |local: bool, terminating: bool, not_serving: bool| DesiredFrontend {
            service: ServicePortName {
                namespace: "ns".into(),
                name: "s".into(),
                port_name: String::new(),
            },
            kind: Default::default(),
            balancing: Default::default(),
            external_local: false,
            drop_when_empty: false,
            source_ranges: Vec::new(),
            backends: vec![DesiredBackend {
                endpoint: ep,
                terminating,
                local,
                not_serving,
            }],
            retained: Vec::new(),
        };
        let frontend = |i: u32| Frontend::new(Ipv4Addr::from(0x0a60_0000 + i), 80, Protocol::Tcp);
        let mut planner = Planner::new(&Programmed::default());
        // 70,000 frontends: every one local, every other one terminating, every fourth one not
        // serving.
        let n = 70_000u32;
        let each = |i: u32| df(true, i.is_multiple_of(2), i.is_multiple_of(4));
        for i in 0..n {
            planner.desired_changed(frontend(i), None, Some(&each(i)));
        }
        assert_eq!(planner.endpoint_use(&ep), Some((n, n, n / 2, n / 4)));
        assert_eq!(planner.wide_uses.len(), 1);
        // All but one go (the last one terminating and not serving): back under 16 bits, still
        // exact.
        for i in 0..n - 4 {
            planner.desired_changed(frontend(i), Some(&each(i)), None);
        }
        for i in n - 3..n {
            planner.desired_changed(frontend(i), Some(&each(i)), None);
        }
        assert_eq!(planner.endpoint_use(&ep), Some((1, 1, 1, 1)));
        planner.desired_changed(frontend(n - 4), Some(&each(n - 4)), None);
        assert_eq!(planner.endpoint_use(&ep), None);
        assert!(planner.wide_uses.is_empty() && planner.endpoints.is_empty());
        // 300 not-serving uses and nothing local: past 8 bits, to `wide_uses`, exact.
        for i in 0..300 {
            planner.desired_changed(frontend(i), None, Some(&df(false, false, true)));
        }
        assert_eq!(planner.endpoint_use(&ep), Some((300, 0, 0, 300)));
        assert_eq!(planner.wide_uses.len(), 1);
        for i in 0..300 {
            planner.desired_changed(frontend(i), Some(&df(false, false, true)), None);
        }
        assert!(planner.wide_uses.is_empty() && planner.endpoints.is_empty());
        // Small counts stay in the entry.
        planner.desired_changed(frontend(0), None, Some(&df(false, true, true)));
        planner.desired_changed(frontend(1), None, Some(&df(true, false, false)));
        assert_eq!(planner.endpoint_use(&ep), Some((2, 1, 1, 1)));
        assert!(planner.wide_uses.is_empty());
        assert_eq!(std::mem::size_of::<Endpoint>(), 12);
    }

    /// With IPv6 holding backend and Maglev table ids, the IPv4 planner hands out neither, in
    /// its shortcut or its full plan, and has them back once IPv6 lets them go.
    #[test]
    fn ids_the_other_family_holds_are_never_handed_out() {
        use std::net::{Ipv4Addr, Ipv6Addr};

        use crate::pipeline::model::{DesiredBackend, Protocol, Scheduler, ServicePortName};
        let frontend = |i: u8| Frontend::new(Ipv4Addr::new(10, 96, 0, i), 80, Protocol::Tcp);
        let df = |i: u8, backends: &[u8]| {
            Arc::new(DesiredFrontend {
                service: ServicePortName {
                    namespace: "ns".into(),
                    name: format!("s{i}"),
                    port_name: String::new(),
                },
                kind: Default::default(),
                balancing: crate::pipeline::model::Balancing {
                    scheduler: Scheduler::Maglev,
                    affinity_timeout_s: None,
                },
                external_local: false,
                drop_when_empty: false,
                source_ranges: Vec::new(),
                backends: (backends.iter())
                    .map(|b| DesiredBackend {
                        endpoint: EndpointAddr {
                            addr: Ipv4Addr::new(10, 244, 0, *b),
                            port: 8080,
                            protocol: Protocol::Tcp,
                        },
                        terminating: false,
                        local: false,
                        not_serving: false,
                    })
                    .collect(),
                retained: Vec::new(),
            })
        };
        let caps = Capacities {
            maglev_table_size: 251,
            ..Capacities::default()
        };
        let ipv6_put = |id: u32| MapOp::<Ipv6Addr>::PutBackend {
            id,
            backend: proxy_common::ipv6::Backend6::default(),
        };
        let ipv6_table = |id: u32| MapOp::<Ipv6Addr>::PutMaglevTable {
            id,
            table: MaglevTable::new(251, Vec::new()),
        };
        let mut p = Programmed::default();
        let mut planner = Planner::new(&p);
        planner.share_with(SharedIds {
            backends: [1, 3].into_iter().collect(),
            maglev_tables: [1].into_iter().collect(),
        });
        planner.other_applied(&p, &ipv6_put(4));
        planner.other_applied(&p, &ipv6_table(2));
        let apply = |planner: &mut Planner, p: &mut Programmed, plan: &Plan| {
            for op in &plan.ops {
                planner.observe(p, op);
                p.apply(op);
            }
            planner.applied(plan);
        };
        // First plan (full).
        let mut d = DesiredState::default();
        d.frontends.insert(frontend(1), df(1, &[1, 2, 3]));
        let changes = [FrontendChange {
            frontend: frontend(1),
            old: None,
        }];
        planner.desired_changes(&changes, &d);
        let (plan, kind) = planner.plan_with_kind(&d, &p, &caps, false);
        assert_eq!(kind, SyncKind::Full);
        apply(&mut planner, &mut p, &plan);
        let ids: BTreeSet<u32> = p.backends.ids().collect();
        assert_eq!(ids, BTreeSet::from([2, 5, 6]), "1, 3, 4 are IPv6's");
        assert_eq!(p.maglev.keys().copied().collect::<Vec<_>>(), [3]);
        // A change (the shortcut): a new frontend with a new backend and table.
        planner.other_applied(&p, &MapOp::<Ipv6Addr>::DeleteBackend { id: 3 });
        planner.other_applied(&p, &ipv6_put(7));
        let old = d.frontends.get(&frontend(2)).cloned();
        d.frontends.insert(frontend(2), df(2, &[9]));
        let changes = [FrontendChange {
            frontend: frontend(2),
            old,
        }];
        planner.desired_changes(&changes, &d);
        let (plan, kind) = planner.plan_with_kind(&d, &p, &caps, false);
        assert_eq!(kind, SyncKind::Partial);
        assert_eq!(
            plan,
            diff::plan_sharing(&d, &p, &caps, &planner.other),
            "the shortcut equals the full plan"
        );
        apply(&mut planner, &mut p, &plan);
        let ids: BTreeSet<u32> = p.backends.ids().collect();
        assert_eq!(
            ids,
            BTreeSet::from([2, 3, 5, 6]),
            "3 is free again, 7 is not"
        );
        assert_eq!(p.maglev.len(), 2);
        assert!(!p.maglev.contains_key(&1) && !p.maglev.contains_key(&2));
    }

    #[test]
    fn free_ids_smallest_first_split_and_merge() {
        let mut f = FreeIds::default();
        for id in [1, 2, 3, 5] {
            f.take(id);
        }
        assert_eq!(f.iter().take(3).collect::<Vec<_>>(), [4, 6, 7]);
        f.give(2);
        assert_eq!(f.iter().take(3).collect::<Vec<_>>(), [2, 4, 6]);
        f.give(3);
        f.give(1);
        f.give(5);
        assert_eq!(f, FreeIds::default(), "ranges merge back into one");
        f.take(u32::MAX);
        assert!(!f.is_free(u32::MAX) && f.is_free(u32::MAX - 1));
        f.give(u32::MAX);
        assert_eq!(f, FreeIds::default());
        f.take(0);
        f.give(0);
        assert_eq!(f, FreeIds::default(), "0 is never an id");
    }
}
