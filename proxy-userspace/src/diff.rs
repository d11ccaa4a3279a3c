//! Desired state × programmed maps → ordered map operations. Pure and deterministic.
//!
//! Ids are derived from what is programmed: an endpoint keeps its backend id, a frontend keeps
//! its rev-NAT id; new ones are the smallest free ids ([`crate::ids`]). The operations come in
//! phases so that the datapath, reading the maps between any two of them, never follows a
//! frontend to a slot that does not exist or a slot to a backend that does not exist:
//!
//! 1. `PutBackend` (new or changed), `PutRevNat` (new or changed);
//! 2. `PutService` for backend slots 1..=n that are new or changed;
//! 3. `PutService` for frontend entries (slot 0) that are new or changed; `DeleteService` of the
//!    frontend entry of removed frontends;
//! 4. `DeleteService` of slots beyond the new count, and of every slot of removed frontends;
//! 5. `DeleteRevNat` and `DeleteBackend` of entries nothing refers to any more.
//!
//! Capacity is checked against the peak the maps reach during the plan (entries are added before
//! old ones are removed). A frontend that does not fit is skipped and reported; if it was already
//! programmed it is left exactly as it is. Space freed by this plan's removals is used on the next
//! sync.

use std::{
    cmp::Reverse,
    collections::{HashMap, HashSet},
};

use proxy_common::{Backend, MAX_BACKENDS_PER_SERVICE, RevNat, ServiceKey, ServiceValue};

use crate::{
    encode,
    ids::IdAllocator,
    model::{DesiredFrontend, DesiredState, EndpointAddr, Frontend},
    programmed::{Capacities, MapOp, Programmed},
};

/// What to write, in order, and which frontends could not be carried.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Plan {
    pub ops: Vec<MapOp>,
    /// Frontends not (re)programmed, sorted, with the reason.
    pub skipped: Vec<(Frontend, String)>,
}

/// Compute the operations that make `programmed` carry `desired`, within `caps`.
pub fn plan(desired: &DesiredState, programmed: &Programmed, caps: &Capacities) -> Plan {
    let mut admission = Admission::new(programmed, caps);
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
    skipped.sort();

    let mut ops = Vec::new();
    let mut referenced_backends: HashSet<u32> = HashSet::new();
    let mut referenced_rev_nats: HashSet<u32> = HashSet::new();

    // Phase 1: backends (flags merged across the frontends sharing them), then rev-NAT entries.
    let mut backends: HashMap<u32, Backend> = HashMap::new();
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

    let mut rev_nats: Vec<(u32, RevNat)> = accepted
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

    // Phase 2: backend slots.
    let put_if_changed = |ops: &mut Vec<MapOp>, key: ServiceKey, value: ServiceValue| {
        if programmed.services.get(&key) != Some(&value) {
            ops.push(MapOp::PutService { key, value });
        }
    };
    for a in &accepted {
        for (slot, id) in (1..).zip(&a.slot_ids) {
            put_if_changed(&mut ops, a.key.with_slot(slot), ServiceValue::slot(*id));
        }
    }

    // Phase 3: frontend entries.
    for a in &accepted {
        put_if_changed(
            &mut ops,
            a.key,
            ServiceValue::frontend(a.count(), a.rev_nat_id),
        );
    }
    let counts: HashMap<ServiceKey, u16> = accepted.iter().map(|a| (a.key, a.count())).collect();
    let kept_keys: HashSet<ServiceKey> = kept.iter().map(|k| k.key).collect();
    let mut removed_frontends = Vec::new();
    let mut removed_slots = Vec::new();
    for (key, value) in &programmed.services {
        let frontend = key.with_slot(0);
        if let Some(&count) = counts.get(&frontend) {
            if key.slot > count {
                removed_slots.push(*key);
            }
        } else if kept_keys.contains(&frontend) {
            // Left as programmed: what it points to must stay.
            if key.slot == 0 {
                referenced_rev_nats.insert(value.rev_nat_id);
            } else {
                referenced_backends.insert(value.backend_id);
            }
        } else if key.slot == 0 {
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
    removed_slots.sort_by_key(|k| (k.with_slot(0), Reverse(k.slot)));
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
        .keys()
        .copied()
        .filter(|id| !referenced_backends.contains(id))
        .collect();
    dead_backends.sort_unstable();
    ops.extend(
        dead_backends
            .into_iter()
            .map(|id| MapOp::DeleteBackend { id }),
    );

    Plan { ops, skipped }
}

/// One backend id may serve several frontends whose EndpointSlices disagree for a moment: it is
/// local if any says so, terminating only if all say so (a backend some Service still selects as
/// ready must not look terminating to it).
fn merge_flags(a: Backend, b: Backend) -> Backend {
    use proxy_common::backend_flags::{LOCAL, TERMINATING};
    let flags = ((a.flags | b.flags) & LOCAL) | (a.flags & b.flags & TERMINATING);
    Backend { flags, ..a }
}

/// A frontend that will be written.
struct Accepted<'a> {
    frontend: Frontend,
    /// Slot-0 key.
    key: ServiceKey,
    df: &'a DesiredFrontend,
    rev_nat_id: u32,
    /// Backend id per slot (slot i+1 = index i).
    slot_ids: Vec<u32>,
}

impl Accepted<'_> {
    fn count(&self) -> u16 {
        // Admission bounds the length by MAX_BACKENDS_PER_SERVICE.
        u16::try_from(self.slot_ids.len()).unwrap_or(u16::MAX)
    }
}

/// A programmed frontend whose update did not fit: left untouched.
struct Kept<'a> {
    key: ServiceKey,
    df: &'a DesiredFrontend,
}

/// Decides, frontend by frontend, what fits and which ids it uses.
struct Admission<'a> {
    programmed: &'a Programmed,
    caps: &'a Capacities,
    /// Entries the maps hold at their peak during the plan, so far.
    used_services: u64,
    used_backends: u64,
    used_rev_nats: u64,
    /// Endpoint → backend id: programmed ones (smallest id per endpoint), then new ones.
    backend_ids: HashMap<EndpointAddr, u32>,
    backend_alloc: IdAllocator,
    rev_nat_alloc: IdAllocator,
    /// Rev-NAT ids claimed by accepted frontends, with the value each needs.
    rev_nat_claims: HashMap<u32, RevNat>,
    accepted: Vec<Accepted<'a>>,
    kept: Vec<Kept<'a>>,
    skipped: Vec<(Frontend, String)>,
}

impl<'a> Admission<'a> {
    fn new(programmed: &'a Programmed, caps: &'a Capacities) -> Self {
        let mut backend_ids: HashMap<EndpointAddr, u32> = HashMap::new();
        for (&id, b) in &programmed.backends {
            if let Some(ep) = encode::decode_endpoint(b) {
                backend_ids
                    .entry(ep)
                    .and_modify(|cur| *cur = (*cur).min(id))
                    .or_insert(id);
            }
        }
        // Ids a programmed entry still names are not free, even if their target is missing.
        let slot_ids = programmed.services.iter().filter(|(k, _)| k.slot > 0);
        let used_backend_ids = programmed
            .backends
            .keys()
            .copied()
            .chain(slot_ids.map(|(_, v)| v.backend_id));
        let frontend_entries = programmed.services.iter().filter(|(k, _)| k.slot == 0);
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
            rev_nat_claims: HashMap::new(),
            accepted: Vec::new(),
            kept: Vec::new(),
            skipped: Vec::new(),
        }
    }

    fn admit(&mut self, frontend: Frontend, df: &'a DesiredFrontend) {
        let key = encode::service_key(&frontend, 0);
        let programmed_entry = self.programmed.services.get(&key).copied();
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
        frontend: Frontend,
        key: ServiceKey,
        programmed_entry: Option<ServiceValue>,
        df: &'a DesiredFrontend,
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
        let mut missing: Vec<EndpointAddr> = df
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

        let full = |map: &str, used: u64, new: u64, cap: u32| {
            (used + new > u64::from(cap)).then(|| {
                format!(
                    "{service}: {map} map full (needs {new} more entries, {used} of {cap} in use)"
                )
            })
        };
        if let Some(reason) = full(
            "SERVICES",
            self.used_services,
            new_services,
            self.caps.services,
        )
        .or_else(|| {
            full(
                "BACKENDS",
                self.used_backends,
                missing.len() as u64,
                self.caps.backends,
            )
        })
        .or_else(|| {
            full(
                "REVNAT",
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
        });
        Ok(())
    }
}
