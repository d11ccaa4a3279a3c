//! Session affinity (ClientIP) for a new flow, before the scheduler: the client's recorded
//! endpoint for the frontend's Service port (`AFFINITY_V1`, keyed by `affinity_id` and client
//! address) while it is usable for this frontend (`AFFMATCH_V1`) and its last use is within the
//! frontend's timeout (`proxy_common::affinity_live`); otherwise the scheduler's pick, which
//! becomes the record. Only new flows look at or refresh records (kube-proxy's `recent` set is
//! updated by new connections only), so the established path is untouched.

use proxy_common::{
    AffinityKey, AffinityMatchKey, AffinityValue, Counter, ServiceKey, ServiceValue, affinity_live,
};

use crate::{log, maps, pick::FlowFacts, stats};

/// The client's recorded endpoint for a new flow of an affinity frontend (`key`, `frontend`),
/// if it may be used: its last use refreshed. `None`: the caller asks the scheduler and
/// [`record`]s its pick.
#[inline(always)]
pub fn recorded(
    key: &ServiceKey,
    frontend: &ServiceValue,
    flow: &FlowFacts,
    now: u64,
) -> Option<u32> {
    let record = maps::affinity(&AffinityKey {
        affinity_id: frontend.affinity_id,
        client: flow.client,
    })?;
    let (backend_id, last_used_ns) = record.get();
    if !affinity_live(last_used_ns, now, frontend.affinity_timeout_s)
        || !maps::affinity_match(&AffinityMatchKey {
            frontend: *key,
            backend_id,
        })
    {
        return None;
    }
    record.touch(now);
    stats::count(Counter::AffinityHit);
    log::affinity_hit(flow.client, backend_id);
    Some(backend_id)
}

/// The scheduler picked `backend_id` for a client without a usable record: it is the new record.
#[inline(always)]
pub fn record(frontend: &ServiceValue, flow: &FlowFacts, backend_id: u32, now: u64) {
    let key = AffinityKey {
        affinity_id: frontend.affinity_id,
        client: flow.client,
    };
    let value = AffinityValue {
        backend_id,
        _pad: 0,
        last_used_ns: now,
    };
    // A full LRU evicts an old record; a failed write only costs this client its stickiness.
    let _ = maps::affinity_insert(&key, &value);
    stats::count(Counter::AffinityMiss);
}
