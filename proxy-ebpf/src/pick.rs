//! Backend choice for a new flow (tc new-flow program and the socket hooks): session affinity
//! first, then the frontend's scheduler. The choice functions themselves are pure, in
//! `proxy_common` (host-tested); this module only fetches what they need from the maps.

use proxy_common::{
    ServiceKey, ServiceValue,
    hash::{addr_hash, pick_slot},
    sched, service_flags,
};

use crate::{Drop, affinity, lc, maglev, maps, stats};

/// What the choice may look at of a new flow.
#[derive(Clone, Copy)]
pub struct FlowFacts {
    /// The client's address (network order): sh hashes it, affinity is keyed by it.
    pub client: [u8; 4],
    /// The frontend address the client sent to (network order): dh hashes it.
    pub frontend_addr: [u8; 4],
    /// The flow's hash (tc: the seeded 5-tuple hash, unseeded for a Maglev frontend, see
    /// `proxy_common::maglev::FLOW_SEED`; socket hooks: a random number).
    pub hash: u32,
}

/// The backend id for a new flow to `frontend` (found under `key`); `Ok(None)` when the frontend
/// has no backends (the caller rejects or drops), `Err(Drop::NoBackend)` when the chosen slot
/// vanished under a concurrent update.
#[inline(always)]
pub fn choose(
    key: &ServiceKey,
    frontend: &ServiceValue,
    flow: &FlowFacts,
) -> Result<Option<u32>, Drop> {
    if frontend.flags & service_flags::AFFINITY == 0 {
        return schedule(key, frontend, flow);
    }
    let now = maps::now_ns();
    if let Some(backend_id) = affinity::recorded(key, frontend, flow, now) {
        return Ok(Some(backend_id));
    }
    let choice = schedule(key, frontend, flow)?;
    if let Some(backend_id) = choice {
        affinity::record(frontend, flow, backend_id, now);
    }
    Ok(choice)
}

/// The frontend's scheduler's pick.
#[inline(always)]
fn schedule(
    key: &ServiceKey,
    frontend: &ServiceValue,
    flow: &FlowFacts,
) -> Result<Option<u32>, Drop> {
    let slot = match frontend.scheduler {
        sched::code::ROUND_ROBIN => match maps::rr_next(key) {
            Some(n) => sched::rr_slot(n, frontend.count),
            None => pick_slot(flow.hash, frontend.count), // The entry was just replaced.
        },
        sched::code::LEAST_CONNECTION => {
            // lc resolves its candidates' backend ids itself.
            let choice = lc::choose(key, frontend.count, flow.hash)?;
            if choice.is_some() {
                stats::count_pick(frontend.scheduler);
            }
            return Ok(choice);
        }
        sched::code::SOURCE_HASH => pick_slot(addr_hash(flow.client), frontend.count),
        sched::code::DESTINATION_HASH => pick_slot(addr_hash(flow.frontend_addr), frontend.count),
        sched::code::MAGLEV => maglev::slot(frontend, flow.hash),
        _ => pick_slot(flow.hash, frontend.count),
    };
    let Some(slot) = slot else {
        return Ok(None);
    };
    let slot = maps::service(&key.with_slot(slot)).ok_or(Drop::NoBackend)?;
    stats::count_pick(frontend.scheduler);
    Ok(Some(slot.backend_id))
}
