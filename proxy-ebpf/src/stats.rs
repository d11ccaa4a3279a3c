//! Per-CPU counters (`STATS_V1`), indexed by the shared [`Counter`] enum.

use proxy_common::Counter;

use crate::maps;

/// Add one to `counter` on this CPU.
#[inline(always)]
pub fn count(counter: Counter) {
    maps::stats_add(counter as u32, 1);
}
