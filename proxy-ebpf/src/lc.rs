//! Least connection: the choice over the per-backend active-flow counts, and the counting
//! (`proxy_common::lc` has the pure rules and the why).
//!
//! Every translated flow the tc programs create is counted, whatever its frontend's scheduler,
//! so a Service switched to lc starts from the true counts. The node's own connections (socket
//! hooks) have no conntrack entry and no hook at their end: they are not counted (they still
//! choose by the counts).

use proxy_common::{ServiceKey, ct_flags, lc};

use crate::{Drop, maps};

/// The backend id of the least loaded of the new flow's candidates (`lc::candidate_slot`);
/// `Ok(None)` without backends.
#[inline(always)]
pub fn choose(key: &ServiceKey, count: u16, hash: u32) -> Result<Option<u32>, Drop> {
    least_loaded(count, hash, |slot| {
        maps::service(&key.with_slot(slot)).map(|s| s.backend_id)
    })
}

/// The candidate loop of either family: `backend_of(slot)` is the backend id in that slot of
/// the frontend's own map (`SERVICES_V1` or `SERVICES6_V1`), `None` if the slot is gone.
#[inline(always)]
pub fn least_loaded(
    count: u16,
    hash: u32,
    backend_of: impl Fn(u16) -> Option<u32>,
) -> Result<Option<u32>, Drop> {
    if count == 0 {
        return Ok(None);
    }
    let mut best = 0u32;
    let mut least = lc::Least::NONE;
    let n = lc::candidates(count);
    let mut i = 0u16;
    while i < lc::CANDIDATES && i < n {
        let slot = lc::candidate_slot(hash, i, count);
        if let Some(backend_id) = backend_of(slot) {
            let before = least.slot;
            least.offer(slot, maps::lc_load(backend_id));
            if least.slot != before {
                best = backend_id;
            }
        }
        i += 1;
    }
    if best == 0 {
        return Err(Drop::NoBackend); // Every candidate slot vanished under an update.
    }
    Ok(Some(best))
}

/// A new flow to `backend_id` takes a unit: its entries carry `ct_flags::COUNTED`.
#[inline(always)]
pub fn count(backend_id: u32) {
    maps::lc_add(backend_id, 1);
}

/// Give back the unit of the flow whose ORIGINAL entry this is, once (`COUNTED` cleared
/// atomically), when its end is seen.
#[inline(always)]
pub fn release(entry: &maps::CtEntry, backend_id: u32) {
    if entry.has_flags(ct_flags::COUNTED) && entry.take_counted() {
        maps::lc_add(backend_id, u64::MAX);
    }
}
