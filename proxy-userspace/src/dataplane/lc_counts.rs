//! Least connection: the agent's reconciliation of the per-backend active-flow counts
//! (`proxy_common::lc`), run in the conntrack walk.
//!
//! The datapath counts a flow up when it creates it and down when it sees it end (TCP close,
//! replacement, removal), once per flow (`ct_flags::COUNTED`). What it cannot see — a flow that
//! idles out without another packet, entries lost to LRU eviction, flows that ended while no
//! program ran them, a backend id reused for a new backend — the walk corrects: it counts the
//! live counted flows per backend (the truth) and writes `LCADJ_V1[id] = LCFLOWS_V1[id] − truth`
//! (agent-owned, so no update of the datapath's counter can be lost), making the effective
//! count `LCFLOWS_V1 − LCADJ_V1` the truth as of the walk.
//!
//! Race: the counts are read before the walk's clock reading and listing, and flows created
//! after that clock reading are left out of the truth (their increments are not in the counts
//! read). What remains is transient and bounded: a flow that ends during the walk before the
//! listing reaches it reads as one less, one whose creation straddles the count read as one more,
//! until the next walk, which recomputes every correction from scratch (nothing accumulates).

use std::collections::HashMap;

use proxy_common::{CtKey, CtValue, ct_dir, ct_flags, ct_state, lc};

use crate::pipeline::programmed::BackendEntries;

/// The flows the walk found per backend id.
#[derive(Debug, Default)]
pub struct Tally {
    created_by_ns: u64,
    counts: HashMap<u32, u64>,
    /// Flows seen only by their REPLY entry so far (their ORIGINAL entry may come later in the
    /// listing, or was evicted): the ORIGINAL key → backend id.
    reply_only: HashMap<CtKey, u32>,
}

impl Tally {
    /// A tally of the flows created no later than `created_by_ns` (CLOCK_MONOTONIC, read after
    /// the counts).
    pub fn new(created_by_ns: u64) -> Self {
        Self {
            created_by_ns,
            ..Self::default()
        }
    }

    /// One live conntrack entry (the caller leaves out the dead ones it removes). A flow counts
    /// once, by its ORIGINAL entry, or by its REPLY entry if the ORIGINAL one is gone (evicted:
    /// the datapath writes it again from the REPLY one, unit included); only for a backend that
    /// is still `backends[id]` with the address the flow was created with.
    pub fn add(&mut self, key: &CtKey, value: &CtValue, backends: &BackendEntries) {
        if value.flags & ct_flags::COUNTED == 0
            || value.flags & ct_flags::DIRECT != 0
            || value.created_ns > self.created_by_ns
        {
            return;
        }
        let current = backends
            .get(&value.backend_id)
            .is_some_and(|b| b.addr == value.backend_addr && b.port == value.backend_port);
        if !current {
            return;
        }
        if key.dir == ct_dir::ORIGINAL {
            self.reply_only.remove(key);
            *self.counts.entry(value.backend_id).or_default() += 1;
        } else if value.state != ct_state::CLOSING {
            let original = original_key_of(key, value);
            self.reply_only.insert(original, value.backend_id);
        }
    }

    /// The truth per backend id.
    pub fn finish(mut self, originals: &std::collections::HashSet<CtKey>) -> HashMap<u32, u64> {
        for (original, id) in std::mem::take(&mut self.reply_only) {
            if !originals.contains(&original) {
                *self.counts.entry(id).or_default() += 1;
            }
        }
        self.counts
    }
}

/// The ORIGINAL key of the flow whose REPLY key and value these are (as the datapath's
/// `conntrack::original_key_of`).
pub fn original_key_of(reply: &CtKey, v: &CtValue) -> CtKey {
    CtKey {
        saddr: reply.daddr,
        daddr: v.frontend_addr,
        sport: if v.flags & ct_flags::SPORT_NAT != 0 {
            v.nat_sport
        } else {
            reply.dport
        },
        dport: v.frontend_port,
        proto: reply.proto,
        dir: ct_dir::ORIGINAL,
        _pad: [0; 2],
    }
}

/// Pure: the corrections (`LCADJ_V1` values) that make each backend's count read as its truth,
/// from the counts read before the walk (`(id, LCFLOWS_V1[id])`; an id without truth has no
/// live flow).
pub fn corrections(active: &[(u32, u64)], truth: &HashMap<u32, u64>) -> Vec<(u32, u64)> {
    active
        .iter()
        .map(|&(id, n)| (id, lc::adjustment(n, truth.get(&id).copied().unwrap_or(0))))
        .collect()
}

/// One reconciliation over a conntrack listing: `active` reads `LCFLOWS_V1[id]` (called first,
/// for every id in `ids`, and again after the listing), `now` the clock (called after the first
/// reads), `list` the entries (after that), and `dead` says which entries the caller removes
/// (they do not count). Returns the corrections to write to `LCADJ_V1` (none for an id whose
/// count moved during the walk) and the dead entries.
pub fn reconcile(
    ids: impl IntoIterator<Item = u32>,
    active: impl Fn(u32) -> u64,
    now: impl FnOnce() -> u64,
    list: impl FnOnce() -> Vec<(CtKey, CtValue)>,
    mut dead: impl FnMut(&CtKey, &CtValue, u64) -> bool,
    backends: &BackendEntries,
) -> Reconciled {
    let counts: Vec<(u32, u64)> = ids.into_iter().map(|id| (id, active(id))).collect();
    let now = now();
    let entries = list();
    let total = entries.len();
    let mut tally = Tally::new(now);
    let mut originals = std::collections::HashSet::new();
    let mut dead_keys = Vec::new();
    for (key, value) in entries {
        if dead(&key, &value, now) {
            dead_keys.push(key);
            continue;
        }
        if key.dir == ct_dir::ORIGINAL {
            originals.insert(key);
        }
        tally.add(&key, &value, backends);
    }
    let truth = tally.finish(&originals);
    // A count that moved while the walk listed (a flow of that backend began or ended meanwhile)
    // is not comparable with the truth found: leave that id's correction as it is, for the next
    // walk (otherwise a flow straddling the first read stays miscounted for a whole period).
    let counts: Vec<(u32, u64)> = counts
        .into_iter()
        .filter(|&(id, n)| active(id) == n)
        .collect();
    Reconciled {
        corrections: corrections(&counts, &truth),
        dead: dead_keys,
        total,
    }
}

/// What [`reconcile`] found.
#[derive(Debug)]
pub struct Reconciled {
    /// `(backend id, LCADJ_V1 value)`.
    pub corrections: Vec<(u32, u64)>,
    /// Entries to remove.
    pub dead: Vec<CtKey>,
    /// Entries listed.
    pub total: usize,
}

#[cfg(test)]
mod tests {
    use proxy_common::Backend;

    use super::*;

    fn backends() -> BackendEntries {
        [1u32, 2, 3]
            .into_iter()
            .map(|id| {
                let b = Backend {
                    addr: [10, 0, 0, id as u8],
                    port: 80u16.to_be_bytes(),
                    proto: 6,
                    flags: 0,
                };
                (id, b)
            })
            .collect()
    }

    /// The ORIGINAL and REPLY entries of a flow from client port `port` to backend `id`.
    fn flow(port: u16, id: u32, flags: u8, created: u64) -> [(CtKey, CtValue); 2] {
        let value = CtValue {
            last_seen_ns: created,
            created_ns: created,
            backend_id: id,
            rev_nat_id: 1,
            frontend_addr: [10, 96, 0, 1],
            backend_addr: [10, 0, 0, id as u8],
            frontend_port: 80u16.to_be_bytes(),
            backend_port: 80u16.to_be_bytes(),
            state: ct_state::ESTABLISHED,
            flags,
            nat_sport: [0; 2],
        };
        let original = CtKey {
            saddr: [10, 244, 0, 1],
            daddr: [10, 96, 0, 1],
            sport: port.to_be_bytes(),
            dport: 80u16.to_be_bytes(),
            proto: 6,
            dir: ct_dir::ORIGINAL,
            _pad: [0; 2],
        };
        let reply = CtKey {
            saddr: value.backend_addr,
            daddr: original.saddr,
            sport: value.backend_port,
            dport: original.sport,
            proto: 6,
            dir: ct_dir::REPLY,
            _pad: [0; 2],
        };
        assert_eq!(original_key_of(&reply, &value), original);
        [(original, value), (reply, value)]
    }

    #[test]
    fn a_count_that_moves_during_the_walk_is_left_for_the_next_walk() {
        // Backend 2's flow began after the counts were read but before the clock: the listing
        // sees it (truth 1) while the count read says 0. Its second read (1) differs, so no
        // correction is written for it; backends 1 and 3 are corrected as usual.
        let reads = std::cell::Cell::new(0u32);
        let entries: Vec<_> = flow(40000, 2, ct_flags::COUNTED, 500).into_iter().collect();
        let r = reconcile(
            1..=3,
            |id| {
                if id == 2 {
                    reads.set(reads.get() + 1);
                    u64::from(reads.get() > 1)
                } else {
                    0
                }
            },
            || 1_000,
            || entries,
            |_, _, _| false,
            &backends(),
        );
        let ids: Vec<u32> = r.corrections.iter().map(|&(id, _)| id).collect();
        assert_eq!(ids, vec![1, 3]);
        assert_eq!(
            reads.get(),
            2,
            "backend 2's count read before and after the listing"
        );
    }

    fn run(entries: Vec<(CtKey, CtValue)>, active: &[u64]) -> HashMap<u32, u64> {
        let r = reconcile(
            1..=3,
            |id| active[id as usize - 1],
            || 1_000,
            || entries,
            |_, v, _| v.state == ct_state::CLOSING && v.last_seen_ns == 0,
            &backends(),
        );
        r.corrections
            .into_iter()
            .map(|(id, adj)| (id, lc::effective(active[id as usize - 1], adj)))
            .collect()
    }

    #[test]
    fn effective_counts_become_the_live_counted_flows() {
        let c = ct_flags::COUNTED;
        let mut entries = Vec::new();
        entries.extend(flow(1, 1, c, 10));
        entries.extend(flow(2, 1, c, 10));
        entries.extend(flow(3, 2, c, 10));
        // An evicted ORIGINAL entry: the flow counts by its REPLY entry.
        entries.push(flow(4, 2, c, 10)[1]);
        // Not counted: no flag (closed, unit given back), created after the counts were read,
        // to a backend id now naming another address.
        entries.extend(flow(5, 3, 0, 10));
        entries.extend(flow(6, 3, c, 2_000));
        let mut moved = flow(7, 3, c, 10);
        for (_, v) in &mut moved {
            v.backend_addr = [10, 9, 9, 9];
        }
        entries.extend(moved);
        // REPLY before ORIGINAL in the listing: counted once.
        let [o, r] = flow(8, 3, c, 10);
        entries.push(r);
        entries.push(o);
        // The datapath's counts include flows that expired unseen and were evicted.
        let got = run(entries, &[7, 5, 9]);
        assert_eq!(got, HashMap::from([(1, 2), (2, 2), (3, 1)]));
    }

    #[test]
    fn a_walk_with_nothing_live_zeroes_every_count_and_nothing_accumulates() {
        assert_eq!(
            run(Vec::new(), &[3, 0, u64::MAX]),
            HashMap::from([(1, 0), (2, 0), (3, 0)])
        );
        // Two walks over the same state give the same correction (overwritten, not added).
        let entries = || flow(1, 1, ct_flags::COUNTED, 10).to_vec();
        assert_eq!(run(entries(), &[4, 0, 0])[&1], 1);
        assert_eq!(run(entries(), &[4, 0, 0])[&1], 1);
    }
}
