//! CLOCK_MONOTONIC, the clock `bpf_ktime_get_ns()` reads, for conntrack ages.

use nix::time::{ClockId, clock_gettime};

/// Nanoseconds on CLOCK_MONOTONIC.
pub fn monotonic_ns() -> u64 {
    // CLOCK_MONOTONIC cannot fail on Linux (the clock exists, the out-parameter is nix's own).
    let ts = clock_gettime(ClockId::CLOCK_MONOTONIC).expect("CLOCK_MONOTONIC");
    (ts.tv_sec() as u64)
        .saturating_mul(1_000_000_000)
        .saturating_add(ts.tv_nsec() as u64)
}
