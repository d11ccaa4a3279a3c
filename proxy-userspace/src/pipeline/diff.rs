//! Desired state × programmed maps → ordered map operations. Pure and deterministic.
//!
//! Ids are derived from what is programmed: an endpoint keeps its backend id, a frontend keeps
//! its rev-NAT id; new ones are the smallest free ids ([`crate::pipeline::ids`]). The operations come in
//! phases so that the datapath, reading the maps between any two of them, never follows a
//! frontend to a slot that does not exist or a slot to a backend that does not exist:
//!
//! 0. `DeleteAffinityMatch` of affinity match entries no frontend keeps (a backend leaving an
//!    affinity frontend, or the frontend losing affinity or going): first, so a client's record
//!    naming that backend is a miss from then on, whatever the slots still say;
//! 1. `PutBackend` (new or changed), `PutRevNat` (new or changed), `PutMaglevTable` (new);
//! 2. `PutService` for backend slots 1..=n that are new or changed; then `PutAffinityMatch` for
//!    the new match entries of affinity frontends (their backends exist by now);
//! 3. `PutService` for frontend entries (slot 0) that are new or changed; `DeleteService` of the
//!    frontend entry of removed frontends;
//! 4. `DeleteService` of slots beyond the new count, and of every slot of removed frontends;
//! 5. `DeleteRevNat`, `DeleteBackend` and `DeleteMaglevTable` of entries nothing refers to any
//!    more.
//!
//! Maglev tables ([`crate::pipeline::maglev`]) are shared by every frontend with the same backend set (a
//! ClusterIP and its eTP=Cluster NodePorts) and never rewritten in place: a changed backend set
//! gets another table, complete before the frontend entry switches to it (so a flow meets the
//! old table with the old count or the new one with the new count), and the old table goes
//! once nothing points to it. A frontend keeps its table while it holds what it needs; else it
//! takes the smallest programmed table that does, else the one this plan writes for that set,
//! else a new one (smallest free id).
//!
//! Capacity is checked against the peak the maps reach during the plan (entries are added before
//! old ones are removed). A frontend that does not fit is skipped and reported; if it was already
//! programmed it is left exactly as it is. Space freed by this plan's removals is used on the next
//! sync.

use std::{cmp::Reverse, net::Ipv4Addr, sync::Arc};

use proxy_common::{MAX_BACKENDS_PER_SERVICE, ServiceValue};

use crate::pipeline::{
    encode::{self, FamilyAbi, SlotKey},
    fast_hash::{HashMap, HashSet},
    ids::IdAllocator,
    maglev::MaglevTable,
    model::{DesiredFrontend, DesiredState, EndpointAddr, Family, Frontend, Scheduler},
    programmed::{Capacities, MapOp, Programmed, SharedIds},
};

/// What to write, in order, and which frontends could not be carried.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Plan<A: FamilyAbi = Ipv4Addr> {
    pub ops: Vec<MapOp<A>>,
    /// Frontends not (re)programmed, sorted, with the reason.
    pub skipped: Vec<(Frontend<A>, String)>,
}

impl<A: FamilyAbi> Default for Plan<A> {
    fn default() -> Self {
        Self {
            ops: Vec::new(),
            skipped: Vec::new(),
        }
    }
}

/// Compute the operations that make `programmed` carry `desired`, within `caps` (one family;
/// no other family's ids to avoid).
pub fn plan<A: FamilyAbi>(
    desired: &DesiredState<A>,
    programmed: &Programmed<A>,
    caps: &Capacities,
) -> Plan<A> {
    plan_sharing(desired, programmed, caps, &SharedIds::default())
}

/// [`plan`] for one family of two: new backend and Maglev table ids avoid `other` (the other
/// family's, [`Programmed::shared_ids`]).
pub fn plan_sharing<A: FamilyAbi>(
    desired: &DesiredState<A>,
    programmed: &Programmed<A>,
    caps: &Capacities,
    other: &SharedIds,
) -> Plan<A> {
    let mut admission = Admission::new(programmed, caps, other);
    // Already-programmed frontends first: they keep their place when maps are nearly full.
    let (existing, fresh): (Vec<_>, Vec<_>) = desired.frontends.iter().partition(|(fe, _)| {
        programmed
            .services
            .contains_key(&encode::service_key(fe, 0))
    });
    for (fe, df) in existing.into_iter().chain(fresh) {
        admission.admit(*fe, df);
    }
    let Admission {
        mut accepted,
        kept,
        mut skipped,
        backend_ids,
        ..
    } = admission;
    accepted.sort_by_key(|a| a.frontend);
    let maglev_puts = assign_maglev_tables(&mut accepted, programmed, caps, other, &mut skipped);
    skipped.sort();

    // Room for the most ops the phases below can write (every entry put, every programmed entry
    // deleted), so the vector never doubles: at 50,000 Services a doubling held ~100 MB at once.
    // Untouched capacity costs address space, not memory.
    let most = accepted
        .iter()
        .map(|a| 2 + 2 * a.slot_ids.len() + a.df.backends.len() + a.df.retained.len())
        .sum::<usize>()
        + programmed.services.len()
        + programmed.affinity_matches.len()
        + programmed.backends.len()
        + programmed.rev_nats.len();
    let mut ops = Vec::with_capacity(most);

    // Phase 0: affinity match entries nothing wants (a kept frontend keeps its own).
    let wanted_matches: HashSet<A::AffinityMatchKey> = accepted
        .iter()
        .flat_map(|a| encode::affinity_matches(&a.key, a.df, &a.slot_ids))
        .collect();
    let kept_frontends: HashSet<A::ServiceKey> = kept.iter().map(|k| k.key).collect();
    let mut dead_matches: Vec<A::AffinityMatchKey> = programmed
        .affinity_matches
        .iter()
        .filter(|k| {
            !wanted_matches.contains(k) && !kept_frontends.contains(&A::affinity_match_frontend(k))
        })
        .copied()
        .collect();
    dead_matches.sort_unstable();
    ops.extend(
        dead_matches
            .into_iter()
            .map(|key| MapOp::DeleteAffinityMatch { key }),
    );
    let mut referenced_backends: HashSet<u32> = HashSet::default();
    let mut referenced_rev_nats: HashSet<u32> = HashSet::default();
    let mut referenced_tables: HashSet<u32> = accepted.iter().map(|a| a.maglev_table).collect();

    // Phase 1: backends (flags merged across the frontends sharing them), then rev-NAT entries.
    let mut backends: HashMap<u32, A::Backend> = HashMap::default();
    for a in &accepted {
        for b in a.df.backends.iter().chain(&a.df.retained) {
            let Some(&id) = backend_ids.get(&b.endpoint) else {
                continue;
            };
            referenced_backends.insert(id);
            let value = encode::backend(b);
            backends
                .entry(id)
                .and_modify(|v| *v = merge_flags(*v, value))
                .or_insert(value);
        }
    }
    let mut puts: Vec<_> = backends
        .into_iter()
        .filter(|(id, v)| programmed.backends.get(id) != Some(v))
        .collect();
    puts.sort_by_key(|(id, _)| *id);
    ops.extend(
        puts.into_iter()
            .map(|(id, backend)| MapOp::PutBackend { id, backend }),
    );

    let mut rev_nats: Vec<(u32, A::RevNat)> = accepted
        .iter()
        .map(|a| (a.rev_nat_id, encode::rev_nat(&a.frontend)))
        .collect();
    rev_nats.sort_by_key(|(id, _)| *id);
    rev_nats.dedup_by_key(|(id, _)| *id);
    for (id, rev_nat) in rev_nats {
        referenced_rev_nats.insert(id);
        if programmed.rev_nats.get(&id) != Some(&rev_nat) {
            ops.push(MapOp::PutRevNat { id, rev_nat });
        }
    }

    ops.extend(
        maglev_puts
            .into_iter()
            .map(|(id, table)| MapOp::PutMaglevTable { id, table }),
    );

    // Phase 2: backend slots.
    let put_if_changed = |ops: &mut Vec<MapOp<A>>, key: A::ServiceKey, value: ServiceValue| {
        if programmed.services.get(&key) != Some(value) {
            ops.push(MapOp::PutService { key, value });
        }
    };
    for a in &accepted {
        for (slot, id) in (1..).zip(&a.slot_ids) {
            put_if_changed(&mut ops, a.key.with_slot(slot), ServiceValue::slot(*id));
        }
    }
    let mut new_matches: Vec<A::AffinityMatchKey> = wanted_matches
        .into_iter()
        .filter(|k| !programmed.affinity_matches.contains(k))
        .collect();
    new_matches.sort_unstable();
    ops.extend(
        new_matches
            .into_iter()
            .map(|key| MapOp::PutAffinityMatch { key }),
    );

    // Phase 3: frontend entries.
    for a in &accepted {
        put_if_changed(
            &mut ops,
            a.key,
            encode::frontend_value(
                &a.frontend,
                a.df,
                a.count(),
                a.rev_nat_id,
                encode::FrontendRefs {
                    maglev_table: a.maglev_table,
                    ..encode::frontend_refs(a.df)
                },
            ),
        );
    }
    let counts: HashMap<A::ServiceKey, u16> = accepted.iter().map(|a| (a.key, a.count())).collect();
    let mut removed_frontends = Vec::new();
    let mut removed_slots = Vec::new();
    for (key, value) in &programmed.services {
        let frontend = key.with_slot(0);
        if let Some(&count) = counts.get(&frontend) {
            if key.slot() > count {
                removed_slots.push(*key);
            }
        } else if kept_frontends.contains(&frontend) {
            // Left as programmed: what it points to must stay.
            if key.slot() == 0 {
                referenced_rev_nats.insert(value.rev_nat_id);
                referenced_tables.insert(value.maglev_table);
            } else {
                referenced_backends.insert(value.backend_id);
            }
        } else if key.slot() == 0 {
            removed_frontends.push(*key);
        } else {
            removed_slots.push(*key);
        }
    }
    removed_frontends.sort();
    ops.extend(
        removed_frontends
            .into_iter()
            .map(|key| MapOp::DeleteService { key }),
    );

    // Phase 4: slots nothing counts any more, highest first per frontend.
    removed_slots.sort_by_key(|k| (k.with_slot(0), Reverse(k.slot())));
    ops.extend(
        removed_slots
            .into_iter()
            .map(|key| MapOp::DeleteService { key }),
    );

    // Phase 5: rev-NAT entries and backends nothing refers to.
    for k in &kept {
        // A kept frontend's endpoints that are programmed stay (its retained ones included).
        let endpoints = k.df.backends.iter().chain(&k.df.retained);
        referenced_backends.extend(endpoints.filter_map(|b| backend_ids.get(&b.endpoint)));
    }
    let mut dead_rev_nats: Vec<u32> = programmed
        .rev_nats
        .keys()
        .copied()
        .filter(|id| !referenced_rev_nats.contains(id))
        .collect();
    dead_rev_nats.sort_unstable();
    ops.extend(
        dead_rev_nats
            .into_iter()
            .map(|id| MapOp::DeleteRevNat { id }),
    );
    let mut dead_backends: Vec<u32> = programmed
        .backends
        .ids()
        .filter(|id| !referenced_backends.contains(id))
        .collect();
    dead_backends.sort_unstable();
    ops.extend(
        dead_backends
            .into_iter()
            .map(|id| MapOp::DeleteBackend { id }),
    );
    let mut dead_tables: Vec<(u32, u32)> = programmed
        .maglev
        .iter()
        .filter(|(id, _)| !referenced_tables.contains(id))
        .map(|(id, t)| (*id, t.chunks()))
        .collect();
    dead_tables.sort_unstable();
    ops.extend(
        dead_tables
            .into_iter()
            .map(|(id, chunks)| MapOp::DeleteMaglevTable { id, chunks }),
    );

    Plan { ops, skipped }
}

/// The Maglev table of every accepted Maglev frontend with backends (see the module doc), and
/// the new tables to write, by id. A frontend whose new table does not fit `MAGLEV_V1` gets none
/// (the datapath picks by flow hash) and is reported.
fn assign_maglev_tables<A: FamilyAbi>(
    accepted: &mut [Accepted<'_, A>],
    programmed: &Programmed<A>,
    caps: &Capacities,
    other: &SharedIds,
    skipped: &mut Vec<(Frontend<A>, String)>,
) -> Vec<(u32, Arc<MaglevTable<A>>)> {
    let mut puts = Vec::new();
    if !accepted.iter().any(|a| wants_maglev(a.df)) {
        return puts;
    }
    let mut programmed_ids: HashMap<&MaglevTable<A>, u32> = HashMap::default();
    for (id, t) in &programmed.maglev {
        programmed_ids
            .entry(&**t)
            .and_modify(|cur| *cur = (*cur).min(*id))
            .or_insert(*id);
    }
    let used = programmed.maglev.keys().copied().chain(
        programmed
            .services
            .iter()
            .filter(|(k, _)| k.slot() == 0)
            .map(|(_, v)| v.maglev_table),
    );
    let mut alloc = IdAllocator::new(used.chain(other.maglev_tables.iter().copied()));
    let mut planned: HashMap<Arc<MaglevTable<A>>, u32> = HashMap::default();
    let mut chunks = programmed.maglev_chunks();
    for a in accepted.iter_mut() {
        if !wants_maglev(a.df) || a.slot_ids.is_empty() {
            continue;
        }
        let want = maglev_table(a.df, caps.maglev_table_size);
        let current = programmed
            .services
            .get(&a.key)
            .map(|v| v.maglev_table)
            .filter(|id| programmed.maglev.get(id).is_some_and(|t| **t == *want));
        let found = current
            .or_else(|| programmed_ids.get(&*want).copied())
            .or_else(|| planned.get(&want).copied());
        a.maglev_table = match found {
            Some(id) => id,
            None if chunks + u64::from(want.chunks()) > u64::from(caps.maglev_chunks) => {
                skipped.push((
                    a.frontend,
                    format!(
                        "{}: MAGLEV map full ({chunks} of {} chunks in use); programmed without \
                         a Maglev table (flow-hash picks)",
                        a.df.service, caps.maglev_chunks
                    ),
                ));
                0
            }
            None => {
                let Some(id) = alloc.allocate() else { continue };
                chunks += u64::from(want.chunks());
                planned.insert(want.clone(), id);
                puts.push((id, want));
                id
            }
        };
    }
    puts
}

/// Does the frontend's scheduler use a Maglev table?
pub fn wants_maglev<A: Family>(df: &DesiredFrontend<A>) -> bool {
    df.balancing.scheduler == Scheduler::Maglev
}

/// The Maglev table a frontend needs: its backends in slot order.
pub fn maglev_table<A: Family>(df: &DesiredFrontend<A>, size: u32) -> Arc<MaglevTable<A>> {
    MaglevTable::new(size, df.backends.iter().map(|b| b.endpoint).collect())
}

/// One backend id may serve several frontends whose EndpointSlices disagree for a moment: it is
/// local if any says so, terminating only if all say so (a backend some Service still selects as
/// ready must not look terminating to it), not serving only if all say so (a backend one Service
/// still serves keeps its UDP flows, whichever Service they came through).
pub fn merge_flags<B: encode::BackendValue>(a: B, b: B) -> B {
    use proxy_common::backend_flags::{LOCAL, NOT_SERVING, TERMINATING};
    let (fa, fb) = (encode::flags_of(&a), encode::flags_of(&b));
    let flags = ((fa | fb) & LOCAL) | (fa & fb & (TERMINATING | NOT_SERVING));
    encode::with_backend_flags(&a, flags)
}

/// A frontend that will be written.
struct Accepted<'a, A: FamilyAbi> {
    frontend: Frontend<A>,
    /// Slot-0 key.
    key: A::ServiceKey,
    df: &'a DesiredFrontend<A>,
    rev_nat_id: u32,
    /// Backend id per slot (slot i+1 = index i).
    slot_ids: Vec<u32>,
    /// Maglev table (0 = none).
    maglev_table: u32,
}

impl<A: FamilyAbi> Accepted<'_, A> {
    fn count(&self) -> u16 {
        // Admission bounds the length by MAX_BACKENDS_PER_SERVICE.
        u16::try_from(self.slot_ids.len()).unwrap_or(u16::MAX)
    }
}

/// A programmed frontend whose update did not fit: left untouched.
struct Kept<'a, A: FamilyAbi> {
    key: A::ServiceKey,
    df: &'a DesiredFrontend<A>,
}

/// Decides, frontend by frontend, what fits and which ids it uses.
struct Admission<'a, A: FamilyAbi> {
    programmed: &'a Programmed<A>,
    caps: &'a Capacities,
    /// Entries the maps hold at their peak during the plan, so far.
    used_services: u64,
    used_backends: u64,
    used_rev_nats: u64,
    /// Endpoint → backend id: programmed ones (smallest id per endpoint), then new ones.
    backend_ids: HashMap<EndpointAddr<A>, u32>,
    backend_alloc: IdAllocator,
    rev_nat_alloc: IdAllocator,
    /// Rev-NAT ids claimed by accepted frontends, with the value each needs.
    rev_nat_claims: HashMap<u32, A::RevNat>,
    accepted: Vec<Accepted<'a, A>>,
    kept: Vec<Kept<'a, A>>,
    skipped: Vec<(Frontend<A>, String)>,
}

impl<'a, A: FamilyAbi> Admission<'a, A> {
    fn new(programmed: &'a Programmed<A>, caps: &'a Capacities, other: &SharedIds) -> Self {
        let mut backend_ids: HashMap<EndpointAddr<A>, u32> = HashMap::default();
        for (id, b) in programmed.backends.iter() {
            if let Some(ep) = encode::decode_endpoint(b) {
                backend_ids
                    .entry(ep)
                    .and_modify(|cur| *cur = (*cur).min(id))
                    .or_insert(id);
            }
        }
        // Ids a programmed entry still names are not free, even if their target is missing.
        let slot_ids = programmed.services.iter().filter(|(k, _)| k.slot() > 0);
        let used_backend_ids = (programmed.backends.ids())
            .chain(slot_ids.map(|(_, v)| v.backend_id))
            .chain(other.backends.iter().copied());
        let frontend_entries = programmed.services.iter().filter(|(k, _)| k.slot() == 0);
        let used_rev_nat_ids = programmed
            .rev_nats
            .keys()
            .copied()
            .chain(frontend_entries.map(|(_, v)| v.rev_nat_id));
        Self {
            programmed,
            caps,
            used_services: programmed.services.len() as u64,
            used_backends: programmed.backends.len() as u64,
            used_rev_nats: programmed.rev_nats.len() as u64,
            backend_ids,
            backend_alloc: IdAllocator::new(used_backend_ids),
            rev_nat_alloc: IdAllocator::new(used_rev_nat_ids),
            rev_nat_claims: HashMap::default(),
            accepted: Vec::new(),
            kept: Vec::new(),
            skipped: Vec::new(),
        }
    }

    fn admit(&mut self, frontend: Frontend<A>, df: &'a DesiredFrontend<A>) {
        let key = encode::service_key(&frontend, 0);
        let programmed_entry = self.programmed.services.get(&key);
        match self.try_admit(frontend, key, programmed_entry, df) {
            Ok(()) => {}
            Err(reason) if programmed_entry.is_some() => {
                self.skipped
                    .push((frontend, format!("{reason}; kept as programmed")));
                self.kept.push(Kept { key, df });
            }
            Err(reason) => self
                .skipped
                .push((frontend, format!("{reason}; not programmed"))),
        }
    }

    fn try_admit(
        &mut self,
        frontend: Frontend<A>,
        key: A::ServiceKey,
        programmed_entry: Option<ServiceValue>,
        df: &'a DesiredFrontend<A>,
    ) -> Result<(), String> {
        let service = &df.service;
        let count = u16::try_from(df.backends.len())
            .ok()
            .filter(|n| *n <= MAX_BACKENDS_PER_SERVICE)
            .ok_or_else(|| {
                format!(
                    "{service} has {} backends, more than the {MAX_BACKENDS_PER_SERVICE} one \
                     frontend can carry",
                    df.backends.len()
                )
            })?;

        // New entries this frontend adds to each map.
        let services = &self.programmed.services;
        let new_services = u64::from(programmed_entry.is_none())
            + (1..=count)
                .filter(|s| !services.contains_key(&key.with_slot(*s)))
                .count() as u64;
        let mut missing: Vec<EndpointAddr<A>> = df
            .backends
            .iter()
            .chain(&df.retained)
            .map(|b| b.endpoint)
            .filter(|ep| !self.backend_ids.contains_key(ep))
            .collect();
        missing.sort();
        missing.dedup();
        let rev_nat = encode::rev_nat(&frontend);
        let reuse_rev_nat = programmed_entry.map(|v| v.rev_nat_id).filter(|&id| {
            id != 0
                && self
                    .rev_nat_claims
                    .get(&id)
                    .is_none_or(|claimed| *claimed == rev_nat)
        });
        let new_rev_nats =
            u64::from(reuse_rev_nat.is_none_or(|id| !self.programmed.rev_nats.contains_key(&id)));

        // Named as the family's map (`SERVICES` / `SERVICES6` ..., the layout version left out).
        let full = |map: &str, used: u64, new: u64, cap: u32| {
            (used + new > u64::from(cap)).then(|| {
                let map = map.trim_end_matches("_V1");
                format!(
                    "{service}: {map} map full (needs {new} more entries, {used} of {cap} in use)"
                )
            })
        };
        if let Some(reason) = full(
            A::MAP_SERVICES,
            self.used_services,
            new_services,
            self.caps.services,
        )
        .or_else(|| {
            full(
                A::MAP_BACKENDS,
                self.used_backends,
                missing.len() as u64,
                self.caps.backends,
            )
        })
        .or_else(|| {
            full(
                A::MAP_REVNAT,
                self.used_rev_nats,
                new_rev_nats,
                self.caps.rev_nats,
            )
        }) {
            return Err(reason);
        }

        let rev_nat_id = match reuse_rev_nat {
            Some(id) => id,
            None => self.rev_nat_alloc.allocate().ok_or("no free rev-NAT id")?,
        };
        for ep in &missing {
            let id = self.backend_alloc.allocate().ok_or("no free backend id")?;
            self.backend_ids.insert(*ep, id);
        }
        self.used_services += new_services;
        self.used_backends += missing.len() as u64;
        self.used_rev_nats += new_rev_nats;
        self.rev_nat_claims.insert(rev_nat_id, rev_nat);
        let slot_ids = df
            .backends
            .iter()
            .filter_map(|b| self.backend_ids.get(&b.endpoint).copied())
            .collect();
        self.accepted.push(Accepted {
            frontend,
            key,
            df,
            rev_nat_id,
            slot_ids,
            maglev_table: 0,
        });
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use std::{collections::BTreeMap, net::Ipv4Addr, sync::Arc};

    use proxy_common::{AffinityMatchKey, ServiceKey, backend_flags};

    use super::*;
    use crate::pipeline::model::{DesiredBackend, Protocol, ServicePortName};

    fn fe(i: u32) -> Frontend {
        let [_, _, a, b] = i.to_be_bytes();
        Frontend::new(Ipv4Addr::new(10, 96, a, b), 80, Protocol::Tcp)
    }

    fn be(i: u32) -> DesiredBackend {
        let [_, _, a, b] = i.to_be_bytes();
        DesiredBackend {
            endpoint: EndpointAddr {
                addr: Ipv4Addr::new(10, 244, a, b),
                port: 8080,
                protocol: Protocol::Tcp,
            },
            terminating: false,
            local: false,
            not_serving: false,
        }
    }

    fn term(i: u32) -> DesiredBackend {
        DesiredBackend {
            terminating: true,
            ..be(i)
        }
    }

    /// A retained backend that is not ready (and not serving).
    fn not_serving(i: u32) -> DesiredBackend {
        DesiredBackend {
            not_serving: true,
            ..be(i)
        }
    }

    fn dfe(
        i: u32,
        mut backends: Vec<DesiredBackend>,
        mut retained: Vec<DesiredBackend>,
    ) -> DesiredFrontend {
        backends.sort();
        retained.sort();
        let service = ServicePortName {
            namespace: "ns".into(),
            name: format!("svc-{i}"),
            port_name: String::new(),
        };
        DesiredFrontend {
            balancing: Default::default(),
            service,
            kind: crate::pipeline::model::FrontendKind::ClusterIp,
            external_local: false,
            drop_when_empty: false,
            source_ranges: Vec::new(),
            backends,
            retained,
        }
    }

    /// An external frontend's desired value (NodePort; `external_local`: eTP=Local).
    fn node_port(
        i: u32,
        backends: Vec<DesiredBackend>,
        retained: Vec<DesiredBackend>,
        external_local: bool,
    ) -> DesiredFrontend {
        DesiredFrontend {
            kind: crate::pipeline::model::FrontendKind::NodePort,
            external_local,
            ..dfe(i, backends, retained)
        }
    }

    /// Frontend i → its selected backend numbers.
    fn state(frontends: &[(u32, &[u32])]) -> DesiredState {
        let frontends = frontends
            .iter()
            .map(|(i, bs)| {
                let df = dfe(*i, bs.iter().map(|b| be(*b)).collect(), vec![]);
                (fe(*i), Arc::new(df))
            })
            .collect();
        DesiredState { frontends }
    }

    const CAPS: Capacities = Capacities {
        services: 1 << 20,
        backends: 1 << 20,
        rev_nats: 1 << 20,
        maglev_chunks: 1 << 20,
        // The smallest M keeps the tests fast; the size does not change the planning.
        maglev_table_size: 251,
    };

    /// What the datapath can reach must exist: every slot of every frontend, every backend a
    /// slot names, every rev-NAT a frontend names. Checked after every single op.
    fn assert_consistent<A: FamilyAbi>(p: &Programmed<A>, after: &MapOp<A>) {
        // An affinity match names an existing backend (one its frontend selects before or after
        // the plan: slots are rewritten one by one, so mid-plan it may sit in none of them; the
        // match set is exact once a plan is through, see `sync`).
        for m in &p.affinity_matches {
            assert!(
                p.backends.contains_key(&A::affinity_match_backend(m)),
                "match {m:?} without its backend after {after:?}"
            );
        }
        for (key, v) in p.services.iter().filter(|(k, _)| k.slot() == 0) {
            assert_ne!(v.rev_nat_id, 0);
            assert!(
                p.rev_nats.contains_key(&v.rev_nat_id),
                "rev-NAT {} missing after {after:?}",
                v.rev_nat_id
            );
            if v.maglev_table != 0 {
                // Written whole before the frontend names it, kept until no frontend does; a
                // changed backend set switches table and count in one write.
                let t = p.maglev.get(&v.maglev_table);
                let t = t.unwrap_or_else(|| panic!("table of {key:?} missing after {after:?}"));
                assert_eq!(t.endpoints.len(), usize::from(v.count), "after {after:?}");
            }
            for slot in 1..=v.count {
                let s = p.services.get(&key.with_slot(slot));
                let s =
                    s.unwrap_or_else(|| panic!("slot {slot} of {key:?} missing after {after:?}"));
                assert!(
                    p.backends.contains_key(&s.backend_id),
                    "backend {} missing after {after:?}",
                    s.backend_id
                );
            }
        }
    }

    fn apply_checked<A: FamilyAbi>(p: &mut Programmed<A>, ops: &[MapOp<A>]) {
        for op in ops {
            p.apply(op);
            assert_consistent(p, op);
        }
    }

    /// Decode what the maps make the datapath do: frontend → selected endpoints in slot order,
    /// plus every programmed backend.
    fn carried<A: FamilyAbi>(p: &Programmed<A>) -> BTreeMap<Frontend<A>, Vec<DesiredBackend<A>>> {
        let mut out = BTreeMap::new();
        for (key, v) in p.services.iter().filter(|(k, _)| k.slot() == 0) {
            let (frontend, _) = encode::decode_service_key(key).expect("our key");
            let rev = p.rev_nats.get(&v.rev_nat_id).expect("rev-NAT");
            assert_eq!(encode::decode_rev_nat(rev), (frontend.addr, frontend.port));
            let backends: Vec<DesiredBackend<A>> = (1..=v.count)
                .map(|s| {
                    let id = p.services.get(&key.with_slot(s)).expect("slot").backend_id;
                    encode::decode_backend(p.backends.get(&id).expect("backend")).expect("decodes")
                })
                .collect();
            if v.scheduler == proxy_common::sched::code::MAGLEV && v.count > 0 {
                // The table holds exactly the frontend's slots.
                let t = p.maglev.get(&v.maglev_table).expect("Maglev table");
                let slots: Vec<EndpointAddr<A>> = backends.iter().map(|b| b.endpoint).collect();
                assert_eq!(t.endpoints, slots, "{frontend}");
            } else {
                assert_eq!(v.maglev_table, 0, "{frontend}: a table without Maglev");
            }
            out.insert(frontend, backends);
        }
        // No table without a frontend.
        let named: HashSet<u32> = p.services.values().map(|v| v.maglev_table).collect();
        assert!(p.maglev.keys().all(|id| named.contains(id)), "orphan table");
        out
    }

    /// Plan, apply op by op (checking consistency), check the result carries `d` and that a
    /// second plan is empty.
    fn sync<A: FamilyAbi>(d: &DesiredState<A>, p: &mut Programmed<A>) -> Plan<A> {
        sync_sharing(d, p, &SharedIds::default())
    }

    /// [`sync`] for one family of two (`other`: the other family's ids).
    fn sync_sharing<A: FamilyAbi>(
        d: &DesiredState<A>,
        p: &mut Programmed<A>,
        other: &SharedIds,
    ) -> Plan<A> {
        let plan = plan_sharing(d, p, &CAPS, other);
        assert_eq!(plan.skipped, []);
        apply_checked(p, &plan.ops);
        let want: BTreeMap<_, _> = d
            .frontends
            .iter()
            .map(|(f, df)| (*f, df.backends.clone()))
            .collect();
        assert_eq!(carried(p), want);
        for df in d.frontends.values() {
            for r in &df.retained {
                let kept = p
                    .backends
                    .values()
                    .any(|b| encode::decode_endpoint(b) == Some(r.endpoint));
                assert!(kept, "retained {} not programmed", r.endpoint);
            }
        }
        // Affinity match entries: exactly every backend slot of every affinity frontend.
        let mut want_matches: HashSet<A::AffinityMatchKey> = HashSet::default();
        for (f, df) in &d.frontends {
            let k = encode::service_key(f, 0);
            let count = p.services.get(&k).unwrap().count;
            let ids: Vec<u32> = (1..=count)
                .map(|s| p.services.get(&k.with_slot(s)).unwrap().backend_id)
                .collect();
            want_matches.extend(encode::affinity_matches(&k, df, &ids));
            let v = p.services.get(&k).unwrap();
            match df.balancing.affinity_timeout_s {
                Some(t) => {
                    assert_eq!(v.flags & proxy_common::service_flags::AFFINITY, 1 << 0);
                    assert_eq!(v.affinity_timeout_s, t);
                    assert_eq!(v.affinity_id, encode::affinity_id(&df.service));
                }
                None => assert_eq!((v.affinity_timeout_s, v.affinity_id), (0, 0)),
            }
        }
        assert_eq!(p.affinity_matches, want_matches);
        let again = super::plan_sharing(d, p, &CAPS, other);
        assert_eq!(again.ops, [], "plan must be idempotent");
        plan
    }

    /// This node ("node-a", no zone) with the default scheduler.
    fn node_a() -> crate::pipeline::translate::NodeContext {
        crate::pipeline::translate::NodeContext {
            scheduler: Default::default(),
            node_name: "node-a".into(),
            zone: None,
        }
    }

    #[test]
    fn affinity_matches_come_with_the_slots_and_leave_before_anything_else() {
        let with_affinity = |d: &mut DesiredState, f: u32, timeout: Option<u32>| {
            Arc::make_mut(d.frontends.get_mut(&fe(f)).unwrap())
                .balancing
                .affinity_timeout_s = timeout;
        };
        let matched = |f: u32, id: u32| AffinityMatchKey {
            frontend: key(f, 0),
            backend_id: id,
        };
        let mut p = Programmed::default();
        let mut d = state(&[(1, &[1, 2]), (2, &[2])]);
        with_affinity(&mut d, 1, Some(30));
        let first = sync(&d, &mut p);
        let pos = |ops: &[MapOp], op: &MapOp| ops.iter().position(|o| o == op).unwrap();
        let m1 = pos(&first.ops, &MapOp::PutAffinityMatch { key: matched(1, 1) });
        let m2 = pos(&first.ops, &MapOp::PutAffinityMatch { key: matched(1, 2) });
        let frontend = first
            .ops
            .iter()
            .position(|o| matches!(o, MapOp::PutService { key: k, .. } if *k == key(1, 0)))
            .unwrap();
        let slot = pos(&first.ops, &put_slot(1, 2, 2));
        assert!(slot < m1 && m1 < m2 && m2 < frontend, "{:?}", first.ops);
        assert_eq!(p.affinity_matches.len(), 2, "only frontend 1 has affinity");
        let id = p.services.get(&key(1, 0)).unwrap().affinity_id;
        assert_ne!(id, 0);

        // Backend 1 leaves: its match goes first of all; the scope id stays.
        let mut d2 = state(&[(1, &[2]), (2, &[2])]);
        with_affinity(&mut d2, 1, Some(30));
        let shrink = sync(&d2, &mut p);
        assert_eq!(
            shrink.ops[0],
            MapOp::DeleteAffinityMatch { key: matched(1, 1) }
        );
        assert_eq!(p.services.get(&key(1, 0)).unwrap().affinity_id, id);

        // A new timeout is a frontend write only; switching affinity off removes the matches.
        with_affinity(&mut d2, 1, Some(5));
        let retimed = sync(&d2, &mut p);
        assert_eq!(retimed.ops.len(), 1, "{:?}", retimed.ops);
        with_affinity(&mut d2, 1, None);
        let off = sync(&d2, &mut p);
        assert_eq!(
            off.ops[0],
            MapOp::DeleteAffinityMatch { key: matched(1, 2) }
        );
        assert!(p.affinity_matches.is_empty());
        sync(&DesiredState::default(), &mut p);
        assert_eq!(p, Programmed::default());
    }

    fn key(f: u32, slot: u16) -> ServiceKey {
        encode::service_key(&fe(f), slot)
    }

    fn put_backend(id: u32, b: u32) -> MapOp {
        MapOp::PutBackend {
            id,
            backend: encode::backend(&be(b)),
        }
    }

    fn put_slot(f: u32, slot: u16, id: u32) -> MapOp {
        MapOp::PutService {
            key: key(f, slot),
            value: ServiceValue::slot(id),
        }
    }

    fn put_frontend(f: u32, count: u16, rev: u32) -> MapOp {
        MapOp::PutService {
            key: key(f, 0),
            value: ServiceValue::frontend(count, rev),
        }
    }

    #[test]
    fn order_new_frontend_backends_then_slots_then_frontend() {
        let mut p = Programmed::default();
        let plan = sync(&state(&[(1, &[1, 2])]), &mut p);
        assert_eq!(
            plan.ops,
            [
                put_backend(1, 1),
                put_backend(2, 2),
                MapOp::PutRevNat {
                    id: 1,
                    rev_nat: encode::rev_nat(&fe(1))
                },
                put_slot(1, 1, 1),
                put_slot(1, 2, 2),
                put_frontend(1, 2, 1),
            ]
        );
    }

    #[test]
    fn order_reverse_on_shrink_frontend_then_slots_high_first_then_backends() {
        let mut p = Programmed::default();
        sync(&state(&[(1, &[1, 2, 3])]), &mut p);
        let plan = sync(&state(&[(1, &[2])]), &mut p);
        assert_eq!(
            plan.ops,
            [
                put_slot(1, 1, 2),
                put_frontend(1, 1, 1),
                MapOp::DeleteService { key: key(1, 3) },
                MapOp::DeleteService { key: key(1, 2) },
                MapOp::DeleteBackend { id: 1 },
                MapOp::DeleteBackend { id: 3 },
            ]
        );
    }

    #[test]
    fn order_grow_writes_new_backend_and_slot_before_count() {
        let mut p = Programmed::default();
        sync(&state(&[(1, &[1])]), &mut p);
        let plan = sync(&state(&[(1, &[1, 2])]), &mut p);
        assert_eq!(
            plan.ops,
            [put_backend(2, 2), put_slot(1, 2, 2), put_frontend(1, 2, 1)]
        );
    }

    #[test]
    fn order_removal_frontend_then_slots_then_rev_nat_and_backends() {
        let mut p = Programmed::default();
        sync(&state(&[(1, &[1, 2]), (2, &[2])]), &mut p);
        let plan = sync(&state(&[(2, &[2])]), &mut p);
        assert_eq!(
            plan.ops,
            [
                MapOp::DeleteService { key: key(1, 0) },
                MapOp::DeleteService { key: key(1, 2) },
                MapOp::DeleteService { key: key(1, 1) },
                MapOp::DeleteRevNat { id: 1 },
                MapOp::DeleteBackend { id: 1 },
            ]
        );
    }

    #[test]
    fn id_reuse_flag_change_is_a_put_with_the_same_id() {
        let mut p = Programmed::default();
        sync(&state(&[(1, &[1, 2])]), &mut p);
        let mut d = state(&[(1, &[1, 2])]);
        let df = Arc::make_mut(d.frontends.get_mut(&fe(1)).expect("fe"));
        df.backends[1].terminating = true;
        df.backends[1].local = true;
        let plan = sync(&d, &mut p);
        let mut changed = encode::backend(&be(2));
        changed.flags = backend_flags::TERMINATING | backend_flags::LOCAL;
        assert_eq!(
            plan.ops,
            [MapOp::PutBackend {
                id: 2,
                backend: changed
            }]
        );
    }

    #[test]
    fn id_allocation_smallest_free_and_not_reused_within_one_plan() {
        let mut p = Programmed::default();
        sync(&state(&[(1, &[1, 2, 3])]), &mut p); // ids 1, 2, 3
        // Backend 2 leaves while 4 arrives: id 2 is still in the map during this plan.
        sync(&state(&[(1, &[1, 3, 4])]), &mut p);
        assert_eq!(
            p.backends.ids().collect::<std::collections::BTreeSet<_>>(),
            [1, 3, 4].into()
        );
        // Now id 2 is free and the smallest.
        let plan = sync(&state(&[(1, &[1, 3, 4, 5])]), &mut p);
        assert_eq!(plan.ops[0], put_backend(2, 5));
    }

    #[test]
    fn id_reuse_rev_nat_from_slot0_and_smallest_free_for_new_frontends() {
        let mut p = Programmed::default();
        sync(&state(&[(1, &[]), (2, &[]), (3, &[])]), &mut p); // rev-NAT 1, 2, 3
        sync(&state(&[(1, &[]), (3, &[1])]), &mut p);
        assert_eq!(
            p.services.get(&key(3, 0)).unwrap().rev_nat_id,
            3,
            "kept across a backend change"
        );
        let plan = sync(&state(&[(1, &[]), (3, &[1]), (4, &[])]), &mut p);
        assert_eq!(
            plan.ops[0],
            MapOp::PutRevNat {
                id: 2,
                rev_nat: encode::rev_nat(&fe(4))
            }
        );
    }

    #[test]
    fn backends_shared_across_frontends_get_one_id() {
        let mut p = Programmed::default();
        sync(
            &state(&[(1, &[1, 2]), (2, &[2, 3]), (3, &[1, 2, 3])]),
            &mut p,
        );
        assert_eq!(p.backends.len(), 3);
    }

    #[test]
    fn shared_backend_flags_merge_local_any_terminating_all() {
        let mut d = state(&[(1, &[1]), (2, &[1])]);
        Arc::make_mut(d.frontends.get_mut(&fe(1)).expect("fe")).backends[0].terminating = true;
        Arc::make_mut(d.frontends.get_mut(&fe(2)).expect("fe")).backends[0].local = true;
        let plan = plan(&d, &Programmed::default(), &CAPS);
        let MapOp::PutBackend { backend, .. } = plan.ops[0] else {
            panic!("{:?}", plan.ops)
        };
        assert_eq!(backend.flags, backend_flags::LOCAL);
    }

    #[test]
    fn retained_backends_are_programmed_but_get_no_slot() {
        let mut p = Programmed::default();
        sync(&state(&[(1, &[1, 2])]), &mut p);
        let mut d = state(&[(1, &[1])]);
        d.frontends
            .insert(fe(1), dfe(1, vec![be(1)], vec![term(2)]).into());
        let plan = sync(&d, &mut p);
        let mut flagged = encode::backend(&be(2));
        flagged.flags = backend_flags::TERMINATING;
        assert_eq!(
            plan.ops,
            [
                MapOp::PutBackend {
                    id: 2,
                    backend: flagged
                },
                put_frontend(1, 1, 1),
                MapOp::DeleteService { key: key(1, 2) },
            ]
        );
        // Once it is gone from the slices, it goes from the maps.
        let plan = sync(&state(&[(1, &[1])]), &mut p);
        assert_eq!(plan.ops, [MapOp::DeleteBackend { id: 2 }]);
    }

    /// A backend that turns not ready keeps its id and entry, flagged NOT_SERVING, but loses its
    /// slot, its affinity match and its place in the Maglev table; it goes only when it leaves
    /// the slices, and the id is then free again (nothing leaks).
    #[test]
    fn not_ready_backend_keeps_its_entry_flagged_without_slot_match_or_maglev_place() {
        let with = |retained: Vec<DesiredBackend>, backends: &[u32]| {
            let mut df = dfe(1, backends.iter().map(|b| be(*b)).collect(), retained);
            df.balancing.affinity_timeout_s = Some(30);
            df.balancing.scheduler = Scheduler::Maglev;
            let mut d = DesiredState::default();
            d.frontends.insert(fe(1), Arc::new(df));
            d
        };
        let mut p = Programmed::default();
        sync(&with(vec![], &[1, 2, 3]), &mut p);
        let baseline = p.clone();
        let id_of = |p: &Programmed, b: u32| {
            p.backends
                .iter()
                .find(|(_, v)| encode::decode_endpoint(*v) == Some(be(b).endpoint))
                .map(|(id, _)| id)
                .expect("backend programmed")
        };
        let id2 = id_of(&p, 2);
        sync(&with(vec![not_serving(2)], &[1, 3]), &mut p);
        assert_eq!(id_of(&p, 2), id2, "same id while it is listed");
        let mut flagged = encode::backend(&be(2));
        flagged.flags = backend_flags::NOT_SERVING;
        assert_eq!(p.backends.get(&id2), Some(&flagged));
        let slots: Vec<u32> = (1..=p.services.get(&key(1, 0)).unwrap().count)
            .map(|s| p.services.get(&key(1, s)).unwrap().backend_id)
            .collect();
        assert!(!slots.contains(&id2), "slots {slots:?}");
        assert!(
            !p.affinity_matches
                .iter()
                .any(|m| m.backend_id == id2 && m.frontend == key(1, 0)),
            "no affinity match for a not-serving backend"
        );
        let table = table_of(&p, 1);
        let entries = p.maglev.get(&table).expect("table");
        assert_eq!(
            entries.endpoints,
            [be(1).endpoint, be(3).endpoint],
            "not in the Maglev table"
        );
        // Ready again: back in its slot with its flags cleared; gone from the slices: deleted.
        sync(&with(vec![], &[1, 2, 3]), &mut p);
        assert_eq!(p.backends.get(&id2), Some(&encode::backend(&be(2))));
        sync(&with(vec![not_serving(2)], &[1, 3]), &mut p);
        let plan = sync(&with(vec![], &[1, 3]), &mut p);
        assert!(plan.ops.contains(&MapOp::DeleteBackend { id: id2 }));
        assert_eq!(p.backends.len(), 2);
        // Occupancy after the churn is the baseline's again (no leaked ids or entries).
        sync(&with(vec![], &[1, 2, 3]), &mut p);
        assert_eq!(p.backends.len(), baseline.backends.len());
        assert_eq!(p.services.len(), baseline.services.len());
        assert_eq!(p.affinity_matches.len(), baseline.affinity_matches.len());
    }

    #[test]
    fn shared_backend_not_serving_only_when_no_frontend_serves_it() {
        let mut d = DesiredState::default();
        d.frontends
            .insert(fe(1), dfe(1, vec![be(1)], vec![]).into());
        d.frontends
            .insert(fe(2), dfe(2, vec![be(2)], vec![not_serving(1)]).into());
        let mut p = Programmed::default();
        sync(&d, &mut p);
        assert!(
            p.backends.values().all(|b| b.flags == 0),
            "frontend 1 serves it: {:?}",
            p.backends
        );
        d.frontends
            .insert(fe(1), dfe(1, vec![], vec![not_serving(1)]).into());
        sync(&d, &mut p);
        let flags: Vec<u8> = p.backends.values().map(|b| b.flags).collect();
        assert!(flags.contains(&backend_flags::NOT_SERVING), "{flags:?}");
        assert_eq!(p.backends.len(), 2);
    }

    fn maglev_dfe(i: u32, bs: &[u32]) -> DesiredFrontend {
        let mut df = dfe(i, bs.iter().map(|b| be(*b)).collect(), vec![]);
        df.balancing.scheduler = Scheduler::Maglev;
        df
    }

    fn table_of(p: &Programmed, f: u32) -> u32 {
        p.services.get(&key(f, 0)).unwrap().maglev_table
    }

    fn position(ops: &[MapOp], what: impl Fn(&MapOp) -> bool) -> usize {
        ops.iter().position(what).expect("op in plan")
    }

    #[test]
    fn maglev_tables_are_shared_by_backend_set_written_first_and_replaced_on_change() {
        // A ClusterIP and its NodePort (same backends) share a table; an eTP=Local-like frontend
        // with another set has its own; a random frontend none.
        let node_port = |bs: &[u32]| {
            Arc::new(DesiredFrontend {
                kind: crate::pipeline::model::FrontendKind::NodePort,
                ..maglev_dfe(1, bs)
            })
        };
        let mut d = DesiredState::default();
        d.frontends.insert(fe(1), maglev_dfe(1, &[1, 2, 3]).into());
        d.frontends.insert(fe(2), node_port(&[1, 2, 3]));
        d.frontends.insert(fe(3), maglev_dfe(3, &[1]).into());
        d.frontends
            .insert(fe(4), dfe(4, vec![be(1), be(2)], vec![]).into());
        let mut p = Programmed::default();
        let plan = sync(&d, &mut p);
        let tables: Vec<_> = plan
            .ops
            .iter()
            .filter_map(|op| match op {
                MapOp::PutMaglevTable { id, table } => Some((*id, table.endpoints.len())),
                _ => None,
            })
            .collect();
        assert_eq!(tables, [(1, 3), (2, 1)]);
        let last_table = plan
            .ops
            .iter()
            .rposition(|op| matches!(op, MapOp::PutMaglevTable { .. }))
            .unwrap();
        assert!(last_table < position(&plan.ops, |op| matches!(op, MapOp::PutService { .. })));
        assert_eq!(
            [1, 2, 3, 4].map(|f| table_of(&p, f)),
            [1, 1, 2, 0],
            "shared, own, none"
        );

        // A backend leaves the ClusterIP only: it gets a new table; the NodePort keeps its own.
        d.frontends.insert(fe(1), maglev_dfe(1, &[1, 2]).into());
        let plan = sync(&d, &mut p);
        assert_eq!((table_of(&p, 1), table_of(&p, 2)), (3, 1));
        assert!(
            position(&plan.ops, |op| matches!(
                op,
                MapOp::PutMaglevTable { id: 3, .. }
            )) < position(
                &plan.ops,
                |op| matches!(op, MapOp::PutService { key: k, .. } if *k == key(1, 0))
            )
        );
        assert!(
            !plan
                .ops
                .iter()
                .any(|op| matches!(op, MapOp::DeleteMaglevTable { .. }))
        );

        // The NodePort follows: it takes the ClusterIP's table (nothing new is built) and its
        // old table goes after the frontend moved off it.
        d.frontends.insert(fe(2), node_port(&[1, 2]));
        let plan = sync(&d, &mut p);
        assert_eq!(table_of(&p, 2), 3);
        assert!(
            !plan
                .ops
                .iter()
                .any(|op| matches!(op, MapOp::PutMaglevTable { .. }))
        );
        assert!(
            position(
                &plan.ops,
                |op| matches!(op, MapOp::PutService { key: k, .. } if *k == key(2, 0))
            ) < position(&plan.ops, |op| *op
                == MapOp::DeleteMaglevTable { id: 1, chunks: 1 })
        );

        // Unchanged: nothing to write, ids stable. Maglev off: the table goes.
        assert_eq!(plan_ops(&d, &p), []);
        let mut d2 = d.clone();
        d2.frontends
            .insert(fe(3), dfe(3, vec![be(1)], vec![]).into());
        let plan = sync(&d2, &mut p);
        assert_eq!(
            plan.ops.last(),
            Some(&MapOp::DeleteMaglevTable { id: 2, chunks: 1 })
        );
        assert_eq!(table_of(&p, 3), 0);
        sync(&DesiredState::default(), &mut p);
        assert!(p.maglev.is_empty());
    }

    fn plan_ops(d: &DesiredState, p: &Programmed) -> Vec<MapOp> {
        plan(d, p, &CAPS).ops
    }

    /// Tell `planner` what changed from `prev` to `d`, plan incrementally (`None`: it
    /// declined), and check the plan equals the full one; apply it op by op (checked).
    fn incremental_step(
        planner: &mut crate::pipeline::incremental::Planner,
        prev: &DesiredState,
        d: &DesiredState,
        p: &mut Programmed,
        caps: &Capacities,
    ) -> Option<Plan> {
        let keys: std::collections::BTreeSet<Frontend> = prev
            .frontends
            .keys()
            .chain(d.frontends.keys())
            .copied()
            .collect();
        for f in keys {
            let (old, new) = (prev.frontends.get(&f), d.frontends.get(&f));
            if old != new {
                planner.desired_changed(f, old.map(|d| &**d), new.map(|d| &**d));
            }
        }
        let inc = planner.plan_changes(d, p, caps);
        let plan = inc
            .clone()
            .unwrap_or_else(|| planner.plan(d, p, caps, true));
        if let Some(inc) = &inc {
            assert_eq!(*inc, self::plan(d, p, caps));
        }
        for op in &plan.ops {
            planner.observe(p, op);
            p.apply(op);
            assert_consistent(p, op);
        }
        planner.applied(&plan);
        inc
    }

    #[test]
    fn incremental_maglev_tables_shared_written_first_deleted_last_without_the_full_plan() {
        use crate::pipeline::incremental::Planner;
        let node_port = |bs: &[u32]| {
            Arc::new(DesiredFrontend {
                kind: crate::pipeline::model::FrontendKind::NodePort,
                ..maglev_dfe(1, bs)
            })
        };
        let mut p = Programmed::default();
        let mut planner = Planner::new(&p);
        let mut prev = DesiredState::default();
        let mut d = DesiredState::default();
        d.frontends.insert(fe(1), maglev_dfe(1, &[1, 2, 3]).into());
        d.frontends.insert(fe(3), maglev_dfe(3, &[1]).into());
        // The first plan is the full one.
        assert!(incremental_step(&mut planner, &prev, &d, &mut p, &CAPS).is_none());
        assert_eq!([1, 3].map(|f| table_of(&p, f)), [1, 2]);
        prev = d.clone();

        // A new NodePort with the ClusterIP's set shares its table: nothing built.
        d.frontends.insert(fe(2), node_port(&[1, 2, 3]));
        let plan = incremental_step(&mut planner, &prev, &d, &mut p, &CAPS).expect("incremental");
        assert_eq!(table_of(&p, 2), 1);
        assert!(!plan.ops.iter().any(|op| matches!(
            op,
            MapOp::PutMaglevTable { .. } | MapOp::DeleteMaglevTable { .. }
        )));
        prev = d.clone();

        // A backend leaves the ClusterIP: a new table (smallest free id), before its entry.
        d.frontends.insert(fe(1), maglev_dfe(1, &[1, 2]).into());
        let plan = incremental_step(&mut planner, &prev, &d, &mut p, &CAPS).expect("incremental");
        assert_eq!((table_of(&p, 1), table_of(&p, 2)), (3, 1));
        assert!(
            position(&plan.ops, |op| matches!(
                op,
                MapOp::PutMaglevTable { id: 3, .. }
            )) < position(&plan.ops, |op| {
                matches!(op, MapOp::PutService { key: k, .. } if *k == key(1, 0))
            })
        );
        assert!(
            !plan
                .ops
                .iter()
                .any(|op| matches!(op, MapOp::DeleteMaglevTable { .. }))
        );
        prev = d.clone();

        // The NodePort follows: it takes table 3; table 1 goes, after the entry moved off it.
        d.frontends.insert(fe(2), node_port(&[1, 2]));
        let plan = incremental_step(&mut planner, &prev, &d, &mut p, &CAPS).expect("incremental");
        assert_eq!(table_of(&p, 2), 3);
        assert_eq!(
            plan.ops.last(),
            Some(&MapOp::DeleteMaglevTable { id: 1, chunks: 1 })
        );
        prev = d.clone();

        // Scheduler switched away from Maglev, and a Maglev Service removed: their tables go,
        // and the freed id is the next one handed out.
        d.frontends
            .insert(fe(3), dfe(3, vec![be(1)], vec![]).into());
        let plan = incremental_step(&mut planner, &prev, &d, &mut p, &CAPS).expect("incremental");
        assert_eq!(
            plan.ops.last(),
            Some(&MapOp::DeleteMaglevTable { id: 2, chunks: 1 })
        );
        prev = d.clone();
        d.frontends.insert(fe(4), maglev_dfe(4, &[4]).into());
        incremental_step(&mut planner, &prev, &d, &mut p, &CAPS).expect("incremental");
        assert_eq!(table_of(&p, 4), 1);
        prev = d.clone();

        // A new table that does not fit the MAGLEV map: the full plan runs (and reports it).
        let full_map = Capacities {
            maglev_chunks: 2,
            ..CAPS
        };
        d.frontends.insert(fe(5), maglev_dfe(5, &[5]).into());
        assert!(incremental_step(&mut planner, &prev, &d, &mut p, &full_map).is_none());
        assert_eq!(table_of(&p, 5), 0);

        // Two more programmed tables of table 1's content, one named by fe 4 (as adopted from
        // another writer): declined; the full plan keeps fe 4 on its table and deletes the
        // copies nothing names.
        let mut adopted = p.clone();
        let t = adopted.maglev[&table_of(&p, 4)].clone();
        adopted.maglev.insert(9, t.clone());
        let mut v = adopted.services.get(&key(4, 0)).unwrap();
        v.maglev_table = 9;
        adopted.services.insert(key(4, 0), v);
        adopted.maglev.insert(10, t);
        let mut planner = Planner::new(&adopted);
        planner.applied(&Plan::default());
        assert!(planner.plan_changes(&d, &adopted, &CAPS).is_none());
        let plan = planner.plan(&d, &adopted, &CAPS, true);
        assert!(
            plan.ops
                .contains(&MapOp::DeleteMaglevTable { id: 1, chunks: 1 })
        );
        assert!(
            plan.ops
                .contains(&MapOp::DeleteMaglevTable { id: 10, chunks: 1 })
        );
    }

    #[test]
    fn maglev_tables_survive_a_restart_when_adopted_and_are_rebuilt_when_m_changed() {
        let d = state(&[(1, &[1, 2, 3]), (2, &[4, 5])]);
        let mut d = d.clone();
        for df in d.frontends.values_mut() {
            Arc::make_mut(df).balancing.scheduler = Scheduler::Maglev;
        }
        let mut p = Programmed::default();
        sync(&d, &mut p);
        // What the maps hold, and the shadow a restarted agent reads back (content unknown).
        let chunks: HashMap<_, _> = p
            .maglev
            .iter()
            .flat_map(|(id, t)| t.map_entries(*id))
            .collect();
        let read_back = |p: &Programmed| Programmed {
            maglev: p
                .maglev
                .iter()
                .map(|(id, t)| (*id, MaglevTable::unknown(t.chunks())))
                .collect(),
            ..p.clone()
        };
        let mut adopted = read_back(&p);
        adopted.adopt_maglev(CAPS.maglev_table_size, |k| chunks.get(k).copied());
        assert_eq!(adopted, p, "the same tables, known again");
        assert_eq!(plan_ops(&d, &adopted), [], "nothing rewritten");

        // Restarted with another M: the content does not match; new tables, old ones deleted.
        let mut other = read_back(&p);
        other.adopt_maglev(509, |k| chunks.get(k).copied());
        let caps = Capacities {
            maglev_table_size: 509,
            ..CAPS
        };
        let plan = plan(&d, &other, &caps);
        let puts = plan
            .ops
            .iter()
            .filter(|op| matches!(op, MapOp::PutMaglevTable { table, .. } if table.size == 509))
            .count();
        let deletes = plan
            .ops
            .iter()
            .filter(|op| matches!(op, MapOp::DeleteMaglevTable { .. }))
            .count();
        assert_eq!((puts, deletes), (2, 2));
    }

    #[test]
    fn maglev_map_full_programs_the_frontend_without_a_table_and_reports_it() {
        let caps = Capacities {
            maglev_chunks: 1,
            ..CAPS
        };
        let mut d = DesiredState::default();
        d.frontends.insert(fe(1), maglev_dfe(1, &[1, 2]).into());
        d.frontends.insert(fe(2), maglev_dfe(2, &[3]).into());
        let plan = plan(&d, &Programmed::default(), &caps);
        let mut p = Programmed::default();
        apply_checked(&mut p, &plan.ops);
        assert_eq!((table_of(&p, 1), table_of(&p, 2)), (1, 0));
        assert_eq!(
            p.services.get(&key(2, 0)).unwrap().scheduler,
            proxy_common::sched::code::MAGLEV
        );
        assert_eq!(plan.skipped.len(), 1);
        assert_eq!(plan.skipped[0].0, fe(2));
        assert!(
            plan.skipped[0].1.contains("MAGLEV map full"),
            "{}",
            plan.skipped[0].1
        );
    }

    #[test]
    fn empty_frontend_is_programmed_with_count_zero() {
        let mut p = Programmed::default();
        let plan = sync(&state(&[(1, &[])]), &mut p);
        assert_eq!(plan.ops.last(), Some(&put_frontend(1, 0, 1)));
    }

    #[test]
    fn idempotent_unchanged_state_writes_nothing() {
        let d = state(&[(1, &[1, 2, 3]), (2, &[3, 4]), (3, &[])]);
        let mut p = Programmed::default();
        sync(&d, &mut p);
        assert_eq!(plan(&d, &p, &CAPS), Plan::default());
    }

    /// xorshift64*: deterministic "random" states without a dependency.
    struct Rng(u64);

    impl Rng {
        fn below(&mut self, n: u32) -> u32 {
            self.0 ^= self.0 >> 12;
            self.0 ^= self.0 << 25;
            self.0 ^= self.0 >> 27;
            ((self.0.wrapping_mul(0x2545_f491_4f6c_dd1d) >> 32) % u64::from(n)) as u32
        }
    }

    fn random_state(rng: &mut Rng) -> DesiredState {
        let mut frontends = BTreeMap::new();
        for f in 0..rng.below(12) {
            if rng.below(3) == 0 {
                continue;
            }
            let mut backends = Vec::new();
            let mut retained = Vec::new();
            for b in 0..16 {
                match rng.below(8) {
                    0 | 1 => backends.push(DesiredBackend {
                        local: rng.below(2) == 0,
                        ..be(b)
                    }),
                    2 => retained.push(term(b)),
                    3 => retained.push(not_serving(b)),
                    _ => {}
                }
            }
            let mut fr = fe(f);
            if rng.below(4) == 0 {
                fr.protocol = Protocol::Udp;
            }
            let scheduler = if rng.below(3) == 0 {
                Scheduler::Maglev
            } else {
                Scheduler::Random
            };
            let maglev = |mut df: DesiredFrontend| {
                df.balancing.scheduler = scheduler;
                Arc::new(df)
            };
            if rng.below(3) == 0 {
                // An eTP=Local NodePort: local backends outside, all of them for in-cluster
                // clients (the in-cluster entry).
                let local: Vec<DesiredBackend> =
                    backends.iter().copied().filter(|b| b.local).collect();
                frontends.insert(
                    fr.in_cluster(),
                    maglev(node_port(f, backends, vec![], false)),
                );
                frontends.insert(fr, maglev(node_port(f, local, retained, true)));
            } else {
                frontends.insert(fr, maglev(dfe(f, backends, retained)));
            }
        }
        // Shared backends must agree on flags for the round trip to be exact.
        let mut flags: HashMap<EndpointAddr, (bool, bool, bool)> = HashMap::default();
        for df in frontends.values_mut() {
            let df = Arc::make_mut(df);
            if rng.below(3) == 0 {
                df.balancing.affinity_timeout_s = Some(1 + rng.below(100));
            }
            for b in df.backends.iter_mut().chain(df.retained.iter_mut()) {
                let (t, l, n) =
                    *(flags.entry(b.endpoint)).or_insert((b.terminating, b.local, b.not_serving));
                b.terminating = t;
                b.local = l;
                b.not_serving = n;
            }
            df.backends.sort();
            df.retained.sort();
        }
        DesiredState { frontends }
    }

    /// The IPv6 twin of an IPv4 state: every address a.b.c.d becomes fd00::a.b.c.d (same
    /// ports, flags, policies), so the random IPv4 states drive the IPv6 plan too.
    fn to_v6(d: &DesiredState) -> DesiredState<std::net::Ipv6Addr> {
        let v6 =
            |a: Ipv4Addr| std::net::Ipv6Addr::from((0xfd00u128 << 112) | u128::from(u32::from(a)));
        let backend = |b: &DesiredBackend| DesiredBackend {
            endpoint: EndpointAddr {
                addr: v6(b.endpoint.addr),
                port: b.endpoint.port,
                protocol: b.endpoint.protocol,
            },
            terminating: b.terminating,
            local: b.local,
            not_serving: b.not_serving,
        };
        let frontends = (d.frontends.iter())
            .map(|(f, df)| {
                let fe6 = Frontend {
                    addr: v6(f.addr),
                    port: f.port,
                    protocol: f.protocol,
                    scope: f.scope,
                };
                let df6 = DesiredFrontend {
                    service: df.service.clone(),
                    kind: df.kind,
                    balancing: df.balancing,
                    external_local: df.external_local,
                    drop_when_empty: df.drop_when_empty,
                    source_ranges: (df.source_ranges.iter())
                        .map(|(a, l)| (v6(*a), l + 96))
                        .collect(),
                    backends: df.backends.iter().map(backend).collect(),
                    retained: df.retained.iter().map(backend).collect(),
                };
                (fe6, Arc::new(df6))
            })
            .collect();
        DesiredState { frontends }
    }

    /// IPv6 is planned by the same code over `SERVICES6_V1` keys (16-byte addresses); both
    /// families' backend and Maglev table ids come from one space (LCFLOWS_V1 and MAGLEV_V1 are
    /// shared): whatever the two families go through, no id is held by both, each family's
    /// maps stay consistent op by op, carry its desired state, and a second plan is empty.
    #[test]
    fn ipv6_plans_share_the_id_spaces_with_ipv4_over_random_transitions() {
        for seed in 1..=25u64 {
            let mut rng = Rng(seed.wrapping_mul(0x9e37_79b9_7f4a_7c15));
            let mut p4 = Programmed::default();
            let mut p6: Programmed<std::net::Ipv6Addr> = Programmed::default();
            for step in 0..20 {
                let d4 = random_state(&mut rng);
                let d6 = to_v6(&random_state(&mut rng));
                // Alternate which family plans first.
                if step % 2 == 0 {
                    sync_sharing(&d4, &mut p4, &p6.shared_ids());
                    sync_sharing(&d6, &mut p6, &p4.shared_ids());
                } else {
                    sync_sharing(&d6, &mut p6, &p4.shared_ids());
                    sync_sharing(&d4, &mut p4, &p6.shared_ids());
                }
                let (ids4, ids6) = (p4.shared_ids(), p6.shared_ids());
                assert!(
                    ids4.backends.is_disjoint(&ids6.backends),
                    "seed {seed} step {step}: backend ids in both families"
                );
                assert!(
                    ids4.maglev_tables.is_disjoint(&ids6.maglev_tables),
                    "seed {seed} step {step}: Maglev tables in both families"
                );
            }
            sync(&DesiredState::default(), &mut p6);
            assert_eq!(p6, Programmed::default(), "seed {seed}");
        }
    }

    /// What an IPv6 plan writes: `Service6Key`/`Backend6`/`RevNat6` with the 16-byte addresses
    /// in network order, ids after the IPv4 family's.
    #[test]
    fn ipv6_plan_writes_ipv6_entries_with_ids_after_ipv4s() {
        let mut p4 = Programmed::default();
        sync(&state(&[(1, &[1, 2]), (2, &[3])]), &mut p4);
        let d6 = to_v6(&state(&[(1, &[1, 4])]));
        let mut p6 = Programmed::default();
        let plan = sync_sharing(&d6, &mut p6, &p4.shared_ids());
        let fe6: std::net::Ipv6Addr = "fd00::a60:1".parse().unwrap();
        let be = |last: u8| {
            let mut a = [0u8; 16];
            a[..2].copy_from_slice(&[0xfd, 0]);
            a[12..].copy_from_slice(&[10, 244, 0, last]);
            a
        };
        // Backend `id` at [fd00::10.244.0.`last`]:8080/TCP.
        let put_backend = |id, last| MapOp::PutBackend {
            id,
            backend: proxy_common::ipv6::Backend6 {
                addr: be(last),
                port: 8080u16.to_be_bytes(),
                proto: 6,
                flags: 0,
            },
        };
        let key0 = proxy_common::ipv6::Service6Key::new(fe6.octets(), 80u16.to_be_bytes(), 6, 0);
        assert_eq!(
            plan.ops,
            [
                put_backend(4, 1),
                put_backend(5, 4),
                MapOp::PutRevNat {
                    id: 1,
                    rev_nat: proxy_common::ipv6::RevNat6 {
                        addr: fe6.octets(),
                        port: 80u16.to_be_bytes(),
                        _pad: [0; 2]
                    }
                },
                MapOp::PutService {
                    key: key0.with_slot(1),
                    value: ServiceValue::slot(4)
                },
                MapOp::PutService {
                    key: key0.with_slot(2),
                    value: ServiceValue::slot(5)
                },
                MapOp::PutService {
                    key: key0,
                    value: ServiceValue::frontend(2, 1)
                },
            ],
            "backend ids 1-3 are IPv4's; rev-NAT ids are per family (REVNAT6_V1)"
        );
    }

    #[test]
    fn idempotent_and_consistent_over_random_transitions() {
        for seed in 1..=40u64 {
            let mut rng = Rng(seed.wrapping_mul(0x9e37_79b9_7f4a_7c15));
            let mut p = Programmed::default();
            for _ in 0..25 {
                let d = random_state(&mut rng);
                sync(&d, &mut p);
            }
            sync(&DesiredState::default(), &mut p);
            assert_eq!(
                p,
                Programmed::default(),
                "everything removed at the end (seed {seed})"
            );
        }
    }

    #[test]
    fn capacity_new_frontend_that_does_not_fit_is_skipped_others_programmed() {
        let caps = Capacities {
            services: 5,
            ..CAPS
        };
        let d = state(&[(1, &[1, 2]), (2, &[1, 2]), (3, &[])]);
        let plan = plan(&d, &Programmed::default(), &caps);
        assert_eq!(plan.skipped.len(), 1, "{:?}", plan.skipped);
        assert_eq!(plan.skipped[0].0, fe(2));
        assert!(
            plan.skipped[0].1.contains("SERVICES map full"),
            "{}",
            plan.skipped[0].1
        );
        let mut p = Programmed::default();
        apply_checked(&mut p, &plan.ops);
        assert_eq!(
            carried(&p).keys().copied().collect::<Vec<_>>(),
            [fe(1), fe(3)]
        );
    }

    #[test]
    fn capacity_programmed_frontend_that_cannot_grow_is_kept_as_programmed() {
        let mut p = Programmed::default();
        sync(&state(&[(1, &[1])]), &mut p);
        let caps = Capacities {
            backends: 2,
            ..CAPS
        };
        let plan = plan(&state(&[(1, &[1, 2, 3])]), &p, &caps);
        assert_eq!(plan.ops, []);
        assert_eq!(plan.skipped.len(), 1);
        assert!(
            plan.skipped[0].1.contains("BACKENDS map full")
                && plan.skipped[0].1.ends_with("kept as programmed")
        );
    }

    #[test]
    fn capacity_rev_nat_map_full_skips_new_frontend() {
        let caps = Capacities {
            rev_nats: 1,
            ..CAPS
        };
        let plan = plan(&state(&[(1, &[]), (2, &[])]), &Programmed::default(), &caps);
        assert_eq!(
            plan.skipped.iter().map(|s| s.0).collect::<Vec<_>>(),
            [fe(2)]
        );
        assert!(plan.skipped[0].1.contains("REVNAT map full"));
    }

    #[test]
    fn capacity_counts_the_peak_and_converges_on_the_next_sync() {
        // A swap at a full map: the new frontend waits until the old one's entries are gone.
        let caps = Capacities {
            services: 2,
            backends: 1,
            rev_nats: 1,
            ..CAPS
        };
        let mut p = Programmed::default();
        let setup = plan(&state(&[(1, &[1])]), &p, &caps);
        apply_checked(&mut p, &setup.ops);
        let d = state(&[(2, &[2])]);
        let first = plan(&d, &p, &caps);
        assert_eq!(first.skipped.len(), 1);
        apply_checked(&mut p, &first.ops);
        assert_eq!(p, Programmed::default());
        let second = plan(&d, &p, &caps);
        assert_eq!(second.skipped, []);
        apply_checked(&mut p, &second.ops);
        assert_eq!(carried(&p).keys().copied().collect::<Vec<_>>(), [fe(2)]);
    }

    #[test]
    fn capacity_more_than_max_backends_per_service_is_skipped() {
        let n = u32::from(MAX_BACKENDS_PER_SERVICE) + 1;
        let backends: Vec<u32> = (0..n).collect();
        let plan = plan(
            &state(&[(1, &backends), (2, &[1])]),
            &Programmed::default(),
            &CAPS,
        );
        assert_eq!(plan.skipped.len(), 1);
        assert_eq!(plan.skipped[0].0, fe(1));
        assert!(
            plan.skipped[0].1.contains("more than the 16384"),
            "{}",
            plan.skipped[0].1
        );
        assert_eq!(
            plan.ops.len(),
            4,
            "only frontend 2: backend, rev-NAT, slot, frontend"
        );
    }

    #[test]
    fn one_service_change_among_10000_touches_only_that_service() {
        let n = 10_000;
        let mut d = DesiredState::default();
        for f in 0..n {
            d.frontends
                .insert(fe(f), dfe(f, vec![be(2 * f), be(2 * f + 1)], vec![]).into());
        }
        let mut p = Programmed::default();
        for op in &plan(&d, &p, &CAPS).ops {
            p.apply(op);
        }
        assert_eq!(plan(&d, &p, &CAPS).ops, []);
        // Service 4321 loses one endpoint and gains another.
        let f = 4321;
        d.frontends
            .insert(fe(f), dfe(f, vec![be(2 * f), be(3 * n)], vec![]).into());
        let plan = plan(&d, &p, &CAPS);
        let old_id = p
            .backends
            .iter()
            .find(|(_, b)| encode::decode_endpoint(*b) == Some(be(2 * f + 1).endpoint))
            .map(|(id, _)| id)
            .expect("old backend programmed");
        let new_id = 2 * n + 1; // ids 1..=2n are taken
        let mut new_backend = encode::backend(&be(3 * n));
        new_backend.flags = 0;
        assert_eq!(
            plan.ops,
            [
                MapOp::PutBackend {
                    id: new_id,
                    backend: new_backend
                },
                put_slot(f, 2, new_id),
                MapOp::DeleteBackend { id: old_id },
            ]
        );
    }

    #[test]
    fn leftovers_orphan_slots_and_duplicate_backend_ids_are_cleaned() {
        let mut p = Programmed::default();
        sync(&state(&[(1, &[1])]), &mut p);
        // A crash mid-plan can leave slots without a frontend entry; adoption can find two ids
        // for one endpoint.
        p.apply(&put_slot(9, 1, 1));
        p.apply(&put_slot(9, 2, 7));
        p.apply(&put_backend(7, 1));
        let plan = sync(&state(&[(1, &[1])]), &mut p);
        assert_eq!(
            plan.ops,
            [
                MapOp::DeleteService { key: key(9, 2) },
                MapOp::DeleteService { key: key(9, 1) },
                MapOp::DeleteBackend { id: 7 },
            ]
        );
    }

    /// A few frontends of `prev` change: endpoints come and go, flags flip, frontends are
    /// added and removed.
    fn mutate(prev: &DesiredState, rng: &mut Rng) -> DesiredState {
        let mut d = prev.clone();
        for _ in 0..=rng.below(3) {
            let f = rng.below(14);
            let mut fr = fe(f);
            if rng.below(4) == 0 {
                fr.protocol = Protocol::Udp;
            }
            // eTP=Local changes: the in-cluster entry of a frontend comes, goes or changes on
            // its own (the frontend itself changes in other steps).
            let in_cluster = rng.below(4) == 0;
            if in_cluster {
                fr = fr.in_cluster();
            }
            match rng.below(6) {
                0 => {
                    d.frontends.remove(&fr);
                }
                1 if !d.frontends.is_empty() => {
                    // Takes another frontend's backend set (and scheduler): two Maglev frontends
                    // of one set share a table.
                    let n = rng.below(d.frontends.len() as u32) as usize;
                    let other = d.frontends.values().nth(n).expect("n < len").clone();
                    let df = d
                        .frontends
                        .entry(fr)
                        .or_insert_with(|| dfe(f, vec![], vec![]).into());
                    let df = Arc::make_mut(df);
                    df.backends = other.backends.clone();
                    df.retained = other.retained.clone();
                    df.balancing.scheduler = other.balancing.scheduler;
                }
                _ => {
                    let df = d.frontends.entry(fr).or_insert_with(|| {
                        if in_cluster {
                            node_port(f, vec![], vec![], false).into()
                        } else {
                            dfe(f, vec![], vec![]).into()
                        }
                    });
                    let df = Arc::make_mut(df);
                    if rng.below(4) == 0 {
                        // Affinity switched on or off, or its timeout changed.
                        df.balancing.affinity_timeout_s = match rng.below(3) {
                            0 => None,
                            n => Some(n * 10),
                        };
                    }
                    // A scheduler change alone (the annotation) must reprogram the entry.
                    if rng.below(6) == 0 {
                        let all = crate::pipeline::model::Scheduler::ALL;
                        df.balancing.scheduler = all[rng.below(all.len() as u32) as usize];
                    }
                    if rng.below(6) == 0 {
                        // The Service's scheduler changes (to or from Maglev).
                        df.balancing.scheduler = match df.balancing.scheduler {
                            Scheduler::Maglev => Scheduler::Random,
                            _ => Scheduler::Maglev,
                        };
                    }
                    let b = rng.below(20);
                    let backend = DesiredBackend {
                        local: rng.below(2) == 0,
                        terminating: rng.below(4) == 0,
                        ..be(b)
                    };
                    let present =
                        |v: &Vec<DesiredBackend>| v.iter().any(|x| x.endpoint == backend.endpoint);
                    if present(&df.backends) || present(&df.retained) {
                        df.backends.retain(|x| x.endpoint != backend.endpoint);
                        df.retained.retain(|x| x.endpoint != backend.endpoint);
                        if rng.below(2) == 0 {
                            df.backends.push(backend); // same endpoint, other flags
                        }
                    } else if rng.below(4) == 0 {
                        df.retained.push(DesiredBackend {
                            terminating: true,
                            ..backend
                        });
                    } else {
                        df.backends.push(backend);
                    }
                    df.backends.sort();
                    df.retained.sort();
                }
            }
        }
        d
    }

    #[test]
    fn incremental_plan_equals_full_plan_over_random_transitions() {
        use crate::pipeline::incremental::Planner;
        let small = Capacities {
            services: 40,
            backends: 14,
            rev_nats: 7,
            // Three tables of M = 251 (one chunk each): Maglev frontends beyond go without.
            maglev_chunks: 3,
            ..CAPS
        };
        let mut incremental = 0;
        let mut steps = 0;
        // Incremental plans that wrote a Maglev table, deleted one, and after which two
        // frontends share one.
        let (mut table_puts, mut table_deletes, mut shared) = (0, 0, 0);
        for seed in 1..=80u64 {
            let mut rng = Rng(seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ 0xa5a5);
            let caps = if seed.is_multiple_of(4) { small } else { CAPS };
            let mut full_p = Programmed::default();
            let mut inc_p = Programmed::default();
            let mut planner = Planner::new(&inc_p);
            let mut prev = DesiredState::default();
            for step in 0..40 {
                let d = match rng.below(8) {
                    0 => random_state(&mut rng),
                    1 => DesiredState::default(),
                    _ => mutate(&prev, &mut rng),
                };
                let keys: std::collections::BTreeSet<Frontend> = prev
                    .frontends
                    .keys()
                    .chain(d.frontends.keys())
                    .copied()
                    .collect();
                for f in keys {
                    let (old, new) = (prev.frontends.get(&f), d.frontends.get(&f));
                    if old != new {
                        planner.desired_changed(f, old.map(|d| &**d), new.map(|d| &**d));
                    }
                }
                let full = plan(&d, &full_p, &caps);
                if let Some(inc) = planner.plan_changes(&d, &inc_p, &caps) {
                    incremental += 1;
                    assert_eq!(inc, full, "seed {seed} step {step}");
                    let has = |f: fn(&MapOp) -> bool| inc.ops.iter().any(f);
                    table_puts += usize::from(has(|op| matches!(op, MapOp::PutMaglevTable { .. })));
                    table_deletes +=
                        usize::from(has(|op| matches!(op, MapOp::DeleteMaglevTable { .. })));
                    let mut after = inc_p.clone();
                    inc.ops.iter().for_each(|op| after.apply(op));
                    let mut named: Vec<u32> = (after.services.iter())
                        .filter(|(k, v)| k.slot == 0 && v.maglev_table != 0)
                        .map(|(_, v)| v.maglev_table)
                        .collect();
                    named.sort_unstable();
                    shared += usize::from(named.windows(2).any(|w| w[0] == w[1]));
                }
                let inc = planner.plan(&d, &inc_p, &caps, false);
                assert_eq!(inc, full, "seed {seed} step {step}");
                apply_checked(&mut full_p, &full.ops);
                for op in &inc.ops {
                    planner.observe(&inc_p, op);
                    inc_p.apply(op);
                    assert_consistent(&inc_p, op);
                }
                planner.applied(&inc);
                assert_eq!(inc_p, full_p, "seed {seed} step {step}");
                assert_eq!(planner.frontend_count(), inc_p.frontend_count());
                // The indexes kept up to date equal indexes rebuilt from the maps.
                let rebuilt = Planner::new(&inc_p);
                assert!(planner.same_indexes(&rebuilt), "seed {seed} step {step}");
                prev = d;
                steps += 1;
            }
        }
        assert!(
            incremental * 2 > steps,
            "the incremental path ran in only {incremental} of {steps} steps"
        );
        assert!(
            table_puts > 100 && table_deletes > 100 && shared > 100,
            "Maglev tables in incremental plans: {table_puts} with a put, {table_deletes} with a \
             delete, {shared} leaving a shared table"
        );
    }

    /// Empty maps filled a group at a time (`Planner::plan_fill_group`, as the agent's first sync
    /// does) end exactly where the one full plan ends — same entries, same ids, same frontends
    /// skipped — consistent after every op; a group that does not fit leaves the rest to the full
    /// plan; the indexes equal rebuilt ones and the next incremental plan equals the full plan.
    #[test]
    fn filling_empty_maps_in_groups_equals_the_full_plan() {
        use crate::pipeline::incremental::Planner;
        let small = Capacities {
            services: 40,
            backends: 14,
            rev_nats: 7,
            maglev_chunks: 3,
            ..CAPS
        };
        let (mut complete_fills, mut declined_fills, mut multi_group) = (0, 0, 0);
        for seed in 1..=300u64 {
            let mut rng = Rng(seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ 0x5a5a);
            let caps = if seed.is_multiple_of(3) { small } else { CAPS };
            let d = random_state(&mut rng);
            let full = plan(&d, &Programmed::default(), &caps);
            let mut full_p = Programmed::default();
            apply_checked(&mut full_p, &full.ops);

            let mut p = Programmed::default();
            let mut planner = Planner::new(&p);
            for (f, df) in &d.frontends {
                planner.desired_changed(*f, None, Some(df));
            }
            assert!(planner.begin_fill(&d, &mut p), "seed {seed}");
            let group = 1 + rng.below(4) as usize;
            let (mut complete, mut groups) = (false, 0);
            while let Some(g) = planner.plan_fill_group(&d, &p, &caps, group) {
                groups += 1;
                for op in &g.ops {
                    planner.observe(&p, op);
                    p.apply(op);
                    assert_consistent(&p, op);
                }
                if !planner.fill_group_applied(group) {
                    complete = true;
                    break;
                }
            }
            multi_group += usize::from(groups > 1);
            let rest = if complete || d.frontends.is_empty() {
                complete_fills += 1;
                assert_eq!(
                    plan(&d, &p, &caps).ops,
                    [],
                    "seed {seed}: the fill left work"
                );
                Plan::default()
            } else {
                declined_fills += 1;
                planner.plan(&d, &p, &caps, true)
            };
            for op in &rest.ops {
                planner.observe(&p, op);
                p.apply(op);
                assert_consistent(&p, op);
            }
            planner.applied(&rest);
            assert_eq!(p, full_p, "seed {seed}");
            assert_eq!(rest.skipped, full.skipped, "seed {seed}");
            assert!(planner.same_indexes(&Planner::new(&p)), "seed {seed}");

            // Carries on incrementally from there as from the full plan.
            let d2 = mutate(&d, &mut rng);
            let keys: std::collections::BTreeSet<Frontend> = d
                .frontends
                .keys()
                .chain(d2.frontends.keys())
                .copied()
                .collect();
            for f in keys {
                let (old, new) = (d.frontends.get(&f), d2.frontends.get(&f));
                if old != new {
                    planner.desired_changed(f, old.map(|d| &**d), new.map(|d| &**d));
                }
            }
            assert_eq!(
                planner.plan(&d2, &p, &caps, false),
                plan(&d2, &p, &caps),
                "seed {seed}: after the fill"
            );
        }
        assert!(
            complete_fills > 100 && declined_fills > 10 && multi_group > 100,
            "{complete_fills} complete fills, {declined_fills} declined, {multi_group} with \
             several groups"
        );
    }

    #[test]
    fn a_scheduler_annotation_change_alone_reprograms_every_frontend_incrementally() {
        use k8s_openapi::api::{core::v1::Service, discovery::v1::EndpointSlice};
        use proxy_common::sched::code;
        use serde_json::json;

        use crate::{
            pipeline::{
                incremental::Planner, translate::ANNOTATION_SCHEDULER,
                translate_cache::TranslateCache,
            },
            sources::snapshot::Snapshot,
        };

        let node_addr = Ipv4Addr::new(192, 168, 50, 10);
        let node = node_a();
        let slice: EndpointSlice = serde_json::from_value(json!({
            "metadata": {"name": "web-1", "namespace": "demo",
                         "labels": {"kubernetes.io/service-name": "web"}},
            "addressType": "IPv4",
            "ports": [{"name": "http", "port": 8080, "protocol": "TCP"}],
            "endpoints": [{"addresses": ["10.244.1.11"], "conditions": {"ready": true}},
                          {"addresses": ["10.244.1.12"], "conditions": {"ready": true}}],
        }))
        .expect("slice");
        let snapshot = |annotation: Option<&str>| {
            let mut meta = json!({"name": "web", "namespace": "demo"});
            if let Some(a) = annotation {
                meta["annotations"] = json!({ANNOTATION_SCHEDULER: a});
            }
            let svc: Service = serde_json::from_value(json!({
                "metadata": meta,
                "spec": {"type": "NodePort", "clusterIP": "10.96.0.10",
                         "ports": [{"name": "http", "port": 80, "nodePort": 30080}]},
            }))
            .expect("service");
            Snapshot::new(vec![svc], vec![slice.clone()])
        };
        let mut cache = TranslateCache::new();
        let mut planner = Planner::new(&Programmed::default());
        let mut p = Programmed::default();
        let codes = |p: &Programmed| -> Vec<u8> {
            (p.services.iter())
                .filter(|(k, _)| k.slot == 0)
                .map(|(_, v)| v.scheduler)
                .collect()
        };
        for (step, (annotation, want)) in [
            (None, code::RANDOM),
            (Some("rr"), code::ROUND_ROBIN),
            (Some("maglev"), code::MAGLEV),
            (Some("bogus"), code::RANDOM),
            (Some("dh"), code::DESTINATION_HASH),
            (None, code::RANDOM),
        ]
        .into_iter()
        .enumerate()
        {
            let changes = cache.update(&snapshot(annotation), &node, &[node_addr], false);
            planner.desired_changes(&changes, cache.desired());
            // Every change of the annotation alone, to or from Maglev included, the incremental
            // planner takes.
            let plan = if step == 0 {
                planner.plan(cache.desired(), &p, &CAPS, true)
            } else {
                match planner.plan_changes(cache.desired(), &p, &CAPS) {
                    Some(plan) => {
                        assert_eq!(plan, plan_full(cache.desired(), &p), "step {step}");
                        plan
                    }
                    None => panic!("step {step}: the incremental planner declined"),
                }
            };
            for op in &plan.ops {
                planner.observe(&p, op);
                p.apply(op);
            }
            planner.applied(&plan);
            assert_eq!(
                codes(&p),
                [want, want],
                "step {step} ({annotation:?}): {:?}",
                plan.ops
            );
            assert_eq!(
                cache.problems().len(),
                usize::from(annotation == Some("bogus")),
                "step {step}"
            );
        }
    }

    fn plan_full(d: &DesiredState, p: &Programmed) -> Plan {
        plan(d, p, &CAPS)
    }

    #[test]
    fn etp_local_programs_in_cluster_entries_and_switching_to_cluster_removes_them() {
        use k8s_openapi::api::{core::v1::Service, discovery::v1::EndpointSlice};
        use proxy_common::{SCOPE_INTERNAL, service_flags};
        use serde_json::json;

        use crate::{pipeline::translate::translate_for_node, sources::snapshot::Snapshot};

        let node_addr = Ipv4Addr::new(192, 168, 50, 10);
        let node = node_a();
        let slice: EndpointSlice = serde_json::from_value(json!({
            "metadata": {"name": "web-1", "namespace": "demo",
                         "labels": {"kubernetes.io/service-name": "web"}},
            "addressType": "IPv4",
            "ports": [{"name": "http", "port": 8080, "protocol": "TCP"}],
            "endpoints": [
                {"addresses": ["10.244.1.11"], "nodeName": "node-a", "conditions": {"ready": true}},
                {"addresses": ["10.244.2.11"], "nodeName": "node-b", "conditions": {"ready": true}},
            ],
        }))
        .expect("slice");
        let desired = |etp: &str| {
            let svc: Service = serde_json::from_value(json!({
                "metadata": {"name": "web", "namespace": "demo"},
                "spec": {"type": "NodePort", "clusterIP": "10.96.0.10",
                         "externalTrafficPolicy": etp,
                         "ports": [{"name": "http", "port": 80, "nodePort": 30080}]},
            }))
            .expect("service");
            let snapshot = Snapshot::new(vec![svc], vec![slice.clone()]);
            translate_for_node(&snapshot, &node, &[node_addr]).desired
        };
        let ep = |a: u8, b: u8, local: bool| DesiredBackend {
            endpoint: EndpointAddr {
                addr: Ipv4Addr::new(10, 244, a, b),
                port: 8080,
                protocol: Protocol::Tcp,
            },
            terminating: false,
            local,
            not_serving: false,
        };
        let both = vec![ep(1, 11, true), ep(2, 11, false)];
        let np = Frontend::new(node_addr, 30080, Protocol::Tcp);
        let (outer_key, inner_key) = (
            encode::service_key(&np, 0),
            encode::service_key(&np.in_cluster(), 0),
        );

        let mut p = Programmed::default();
        sync(&desired("Local"), &mut p);
        let carried_now = carried(&p);
        assert_eq!(carried_now[&np], [ep(1, 11, true)], "outside: local only");
        assert_eq!(
            carried_now[&np.in_cluster()],
            both,
            "in-cluster: every endpoint"
        );
        let (outer, inner) = (
            p.services.get(&outer_key).unwrap(),
            p.services.get(&inner_key).unwrap(),
        );
        assert_eq!(
            outer.flags,
            service_flags::EXTERNAL | service_flags::EXTERNAL_LOCAL
        );
        assert_eq!(inner.flags, 0, "in-cluster: no SNAT, like a ClusterIP");
        assert_ne!(outer.rev_nat_id, inner.rev_nat_id, "its own rev-NAT entry");
        assert_eq!(p.rev_nats[&inner.rev_nat_id], encode::rev_nat(&np));
        assert_eq!(
            p.frontend_count(),
            3,
            "ClusterIP, NodePort, its in-cluster entry"
        );

        let plan = sync(&desired("Cluster"), &mut p);
        assert!(
            !p.services.keys().any(|k| k.scope == SCOPE_INTERNAL),
            "eTP=Cluster has no in-cluster entry: {:?}",
            plan.ops
        );
        assert!(plan.ops.contains(&MapOp::DeleteService { key: inner_key }));
        assert!(plan.ops.contains(&MapOp::DeleteRevNat {
            id: inner.rev_nat_id
        }));
        assert_eq!(carried(&p)[&np], both);
        assert_eq!(
            p.services.get(&outer_key).unwrap().flags,
            service_flags::EXTERNAL
        );
        assert_eq!(p.frontend_count(), 2);
    }
}
