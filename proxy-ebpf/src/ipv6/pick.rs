//! Backend choice for a new IPv6 flow: session affinity (ClientIP, `AFFINITY6_V1` /
//! `AFFMATCH6_V1`) first, then the frontend's scheduler, as for IPv4 (`crate::pick`). Every
//! IPv4 scheduler: random (the seeded flow hash), round robin, source/destination hashing (of the
//! folded address), least connection (`LCFLOWS_V1`/`LCADJ_V1` are indexed by backend id and
//! shared with IPv4: the agent gives both families' backends ids from one space) and Maglev (its
//! tables hold slots, shared by both families).

use proxy_common::{
    AffinityValue, Counter, ServiceValue, affinity_live,
    hash::{addr_hash, pick_slot},
    ipv6::{Affinity6Key, Affinity6MatchKey, Service6Key, flow_hash6, fold_addr},
    maglev, sched, service_flags,
};

use super::packet::Packet6;
use crate::{Drop, lc as lc_pick, log, maglev as maglev_pick, maps, stats};

/// What the choice may look at of a new IPv6 flow: a parsed packet on tc, the connect()/sendmsg()
/// of a socket of the node's in `crate::sock6` (monomorphised: the tc code is as before).
pub trait NewFlow6 {
    /// The client's address (sh hashes it, affinity is keyed by it).
    fn client(&self) -> &[u8; 16];
    /// The frontend address the client sent to (dh hashes it).
    fn frontend_addr(&self) -> &[u8; 16];
    /// The flow's hash with `seed` (a socket's is random and ignores it).
    fn hash(&self, seed: u32) -> u32;
}

impl NewFlow6 for Packet6 {
    #[inline(always)]
    fn client(&self) -> &[u8; 16] {
        &self.saddr
    }

    #[inline(always)]
    fn frontend_addr(&self) -> &[u8; 16] {
        &self.daddr
    }

    #[inline(always)]
    fn hash(&self, seed: u32) -> u32 {
        flow_hash6(
            seed, self.saddr, self.daddr, self.sport, self.dport, self.proto,
        )
    }
}

/// The backend id for a new flow to `frontend` (found under `key`); `Ok(None)` without
/// backends, `Err(Drop::NoBackend)` when the chosen slot vanished under an update.
#[inline(always)]
pub fn choose(
    key: &Service6Key,
    frontend: &ServiceValue,
    p: &impl NewFlow6,
) -> Result<Option<u32>, Drop> {
    if frontend.flags & service_flags::AFFINITY == 0 {
        return schedule(key, frontend, p);
    }
    let now = maps::now_ns();
    let record_key = Affinity6Key {
        affinity_id: frontend.affinity_id,
        client: *p.client(),
    };
    if let Some(record) = maps::affinity6(&record_key) {
        let (backend_id, last_used_ns) = record.get();
        if affinity_live(last_used_ns, now, frontend.affinity_timeout_s)
            && maps::affinity6_match(&Affinity6MatchKey {
                frontend: *key,
                backend_id,
            })
        {
            // Only new flows look at or refresh records (as kube-proxy's `recent` set).
            record.touch(now);
            stats::count(Counter::AffinityHit);
            log::affinity_hit6(p.client(), backend_id);
            return Ok(Some(backend_id));
        }
    }
    let choice = schedule(key, frontend, p)?;
    if let Some(backend_id) = choice {
        let value = AffinityValue {
            backend_id,
            _pad: 0,
            last_used_ns: now,
        };
        // A full LRU evicts an old record; a failed write only costs this client its stickiness.
        let _ = maps::affinity6_insert(&record_key, &value);
        stats::count(Counter::AffinityMiss);
    }
    Ok(choice)
}

/// The frontend's scheduler's pick.
#[inline(always)]
fn schedule(
    key: &Service6Key,
    frontend: &ServiceValue,
    p: &impl NewFlow6,
) -> Result<Option<u32>, Drop> {
    let seed = if frontend.scheduler == sched::code::MAGLEV {
        maglev::FLOW_SEED
    } else {
        maps::hash_seed()
    };
    let hash = p.hash(seed);
    let slot = match frontend.scheduler {
        sched::code::ROUND_ROBIN => match maps::rr_next6(key) {
            Some(n) => sched::rr_slot(n, frontend.count),
            None => pick_slot(hash, frontend.count), // The entry was just replaced.
        },
        sched::code::LEAST_CONNECTION => {
            // lc resolves its candidates' backend ids itself.
            let choice = lc_pick::least_loaded(frontend.count, hash, |slot| {
                maps::service6(&key.with_slot(slot)).map(|s| s.backend_id)
            })?;
            if choice.is_some() {
                stats::count_pick(sched::code::LEAST_CONNECTION);
            }
            return Ok(choice);
        }
        sched::code::SOURCE_HASH => pick_slot(addr_hash(fold_addr(*p.client())), frontend.count),
        sched::code::DESTINATION_HASH => {
            pick_slot(addr_hash(fold_addr(*p.frontend_addr())), frontend.count)
        }
        sched::code::MAGLEV => maglev_pick::slot(frontend, hash),
        _ => pick_slot(hash, frontend.count),
    };
    let Some(slot) = slot else {
        return Ok(None);
    };
    let slot = maps::service6(&key.with_slot(slot)).ok_or(Drop::NoBackend)?;
    stats::count_pick(frontend.scheduler);
    Ok(Some(slot.backend_id))
}
