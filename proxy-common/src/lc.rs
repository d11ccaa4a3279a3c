//! Least connection (`sched::code::LEAST_CONNECTION`): pure parts shared by the datapath (the
//! choice) and the agent (the reconciliation of the counts, `dump`).
//!
//! Counts: `LCFLOWS_V1[backend id]` is the datapath's count of translated flows to the backend
//! that it has not seen end (+1 when a flow is created, −1 when it sees the flow close or
//! replaces its entry; `ct_flags::COUNTED` makes each flow give its unit back once). Flows that
//! end unseen (idle expiry without a packet, LRU eviction of both entries) are corrected by the
//! agent in `LCADJ_V1`, recomputed from scratch on every conntrack walk: [`effective`].
//!
//! Choice: power of d choices with [`CANDIDATES`] = 4 consecutive slots from a flow-hash start,
//! the least loaded wins, ties going to the earliest candidate ([`Least`]). Exact least
//! connection needs a scan over every backend, which the datapath may not do (O(1) per packet,
//! no loops over backends); four candidates are exact for frontends of up to four endpoints and,
//! beyond, keep the maximum load within a small additive term of the mean (the
//! power-of-d-choices result), at a bounded cost of 4 × 3 map lookups per new flow.

/// Candidates looked at per new flow.
pub const CANDIDATES: u16 = 4;

/// The effective active-flow count of a backend: the datapath's count minus the agent's
/// correction, both free-running `u64`s (wrapping), never below 0 (a transient undercount while
/// a correction is in flight reads as idle, not as a huge number).
#[inline(always)]
pub const fn effective(active: u64, adjust: u64) -> u64 {
    let n = active.wrapping_sub(adjust) as i64;
    if n < 0 { 0 } else { n as u64 }
}

/// The correction that makes `active` read as `truth` (see [`effective`]).
#[inline(always)]
pub const fn adjustment(active: u64, truth: u64) -> u64 {
    active.wrapping_sub(truth)
}

/// How many candidates a frontend with `count` backends has.
#[inline(always)]
pub const fn candidates(count: u16) -> u16 {
    if count < CANDIDATES {
        count
    } else {
        CANDIDATES
    }
}

/// Candidate `i` (0-based) of a new flow whose hash is `hash`, as a backend slot (1..=count):
/// consecutive slots from where the hash falls, wrapping. `count` must be > 0.
#[inline(always)]
pub const fn candidate_slot(hash: u32, i: u16, count: u16) -> u16 {
    let start = ((hash as u64 * count as u64) >> 32) as u32;
    ((start + i as u32) % count as u32) as u16 + 1
}

/// The running minimum over the candidates, offered in order: a later candidate wins only with
/// a strictly smaller load, so ties go to the earliest one.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Least {
    pub slot: u16,
    pub load: u64,
}

impl Least {
    pub const NONE: Least = Least {
        slot: 0,
        load: u64::MAX,
    };

    #[inline(always)]
    pub fn offer(&mut self, slot: u16, load: u64) {
        if self.slot == 0 || load < self.load {
            self.slot = slot;
            self.load = load;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The slot the datapath picks for `hash` over `loads` (load of slot i+1 at index i).
    fn pick(hash: u32, loads: &[u64]) -> u16 {
        let count = loads.len() as u16;
        let mut least = Least::NONE;
        for i in 0..candidates(count) {
            let slot = candidate_slot(hash, i, count);
            least.offer(slot, loads[slot as usize - 1]);
        }
        least.slot
    }

    #[test]
    fn effective_count_is_active_minus_adjust_never_negative() {
        assert_eq!(effective(5, 0), 5);
        assert_eq!(effective(5, 3), 2);
        assert_eq!(
            effective(3, 5),
            0,
            "a correction ahead of the count reads as idle"
        );
        // Free-running counters across the wrap.
        assert_eq!(effective(2, u64::MAX), 3);
        for (active, truth) in [(0u64, 0u64), (10, 4), (4, 10), (u64::MAX, 1), (1, 0)] {
            assert_eq!(effective(active, adjustment(active, truth)), truth);
        }
        // A datapath that went below zero (a decrement before its increment landed).
        assert_eq!(effective(0u64.wrapping_sub(1), 0), 0);
    }

    #[test]
    fn small_frontends_are_exact_least_connection() {
        for count in 1..=CANDIDATES as usize {
            for idle in 0..count {
                let loads: Vec<u64> = (0..count).map(|i| if i == idle { 0 } else { 7 }).collect();
                for hash in [0u32, 1, 0x4000_0000, 0x8000_0000, 0xffff_ffff, 0x1234_5678] {
                    assert_eq!(
                        pick(hash, &loads),
                        idle as u16 + 1,
                        "{count} {idle} {hash:#x}"
                    );
                }
            }
        }
    }

    #[test]
    fn ties_go_to_the_first_candidate_from_the_hash_start() {
        let loads = [3, 1, 1, 1];
        // Start at slot 3 (hash in the third quarter): 3 and 4 and 2 tie at 1, 3 comes first.
        assert_eq!(pick(0x8000_0000, &loads), 3);
        assert_eq!(pick(0xc000_0000, &loads), 4);
        assert_eq!(pick(0, &loads), 2, "start at 1 (load 3), then 2");
        let equal = [5u64; 3];
        for (hash, slot) in [(0u32, 1u16), (0x6000_0000, 2), (0xffff_ffff, 3)] {
            assert_eq!(pick(hash, &equal), slot, "equal loads: the start itself");
        }
    }

    #[test]
    fn candidates_are_consecutive_distinct_and_wrap() {
        let count = 10u16;
        for hash in [0u32, 0x7fff_ffff, 0xffff_ffff] {
            let slots: Vec<u16> = (0..candidates(count))
                .map(|i| candidate_slot(hash, i, count))
                .collect();
            assert_eq!(slots.len(), 4);
            for w in slots.windows(2) {
                assert_eq!(w[1], w[0] % count + 1, "{slots:?}");
            }
            assert!(slots.iter().all(|&s| (1..=count).contains(&s)));
        }
        assert_eq!(
            (0..4)
                .map(|i| candidate_slot(u32::MAX, i, 10))
                .collect::<Vec<_>>(),
            [10, 1, 2, 3]
        );
    }

    #[test]
    fn large_frontends_pick_among_four_and_avoid_the_loaded() {
        // 100 backends, backend 1..=50 loaded: a flow whose window holds an idle one never picks
        // a loaded one; the picks spread over the idle half.
        let loads: Vec<u64> = (0..100).map(|i| if i < 50 { 9 } else { 0 }).collect();
        let mut picked = std::collections::BTreeSet::new();
        for k in 0..1_000u32 {
            let hash = k.wrapping_mul(0x9e37_79b9);
            let slot = pick(hash, &loads);
            let start = candidate_slot(hash, 0, 100);
            let window: Vec<u16> = (0..4).map(|i| candidate_slot(hash, i, 100)).collect();
            if window.iter().any(|&s| s > 50) {
                assert!(
                    slot > 50,
                    "hash {hash:#x} start {start}: picked loaded {slot}"
                );
            } else {
                assert_eq!(slot, start);
            }
            picked.insert(slot);
        }
        assert!(picked.iter().filter(|&&s| s > 50).count() == 50);
    }
}
