//! The Maglev (`mh`) arm of the backend choice: the flow's position in its frontend's table
//! (`proxy_common::maglev`), the slot written there. One lookup, no loop.

use proxy_common::{Counter, ServiceValue, hash::pick_slot, maglev};

use crate::{maps, stats};

/// The slot for a new flow with `hash` (tc: the unseeded 5-tuple hash, `maglev::FLOW_SEED`;
/// socket hooks: random) to a Maglev frontend. A missing table or chunk, or an entry beyond
/// the frontend's count (a table and count briefly out of step), falls back to the flow hash
/// pick, counted.
#[inline(always)]
pub fn slot(frontend: &ServiceValue, hash: u32) -> Option<u16> {
    if frontend.count == 0 {
        return None;
    }
    let m = maps::maglev_table_size();
    if frontend.maglev_table != 0 && m != 0 {
        let index = maglev::flow_index(hash, m);
        if let Some(slot) = maps::maglev_slot(frontend.maglev_table, index)
            && slot != 0
            && slot <= frontend.count
        {
            return Some(slot);
        }
    }
    stats::count(Counter::MaglevFallback);
    pick_slot(hash, frontend.count)
}
