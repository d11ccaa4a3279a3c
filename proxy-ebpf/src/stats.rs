//! Per-CPU counters (`STATS_V1`), indexed by the shared [`Counter`] enum.

use proxy_common::Counter;

use crate::maps;

/// Add one to `counter` on this CPU.
#[inline(always)]
pub fn count(counter: Counter) {
    maps::stats_add(counter as u32, 1);
}

/// Count one pick by the scheduler with code `scheduler` (`Counter::Pick*`: one index per code,
/// no branch per scheduler).
#[inline(always)]
pub fn count_pick(scheduler: u8) {
    maps::stats_add(proxy_common::stats::pick_counter_index(scheduler), 1);
}
