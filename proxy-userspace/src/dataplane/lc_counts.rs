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

use std::{
    collections::{HashMap, HashSet},
    hash::Hash,
};

use proxy_common::{
    CtKey, CtValue, ct_dir, ct_flags, ct_state,
    ipv6::{Ct6Key, Ct6Value},
    lc,
};

/// A conntrack entry of either family as the walk reads it (`CONNTRACK_V1`: [`CtValue`],
/// `CONNTRACK6_V1`: [`Ct6Value`]). Both families' flows count for the same backend ids
/// (`LCFLOWS_V1`/`LCADJ_V1` are shared), so one walk tallies both.
pub trait Tracked: Copy {
    type Key: Copy + Eq + Hash + std::fmt::Debug;
    /// `ct_dir::*` of the entry's key.
    fn dir(key: &Self::Key) -> u8;
    /// `proto::*` of the entry's key.
    fn proto(key: &Self::Key) -> u8;
    /// The ORIGINAL key of the flow whose REPLY key and value these are (as the datapath's
    /// `conntrack::original_key_of`).
    fn original_key_of(reply: &Self::Key, value: &Self) -> Self::Key;
    fn facts(&self) -> FlowFacts;
}

/// The family-neutral fields of a conntrack value.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FlowFacts {
    pub last_seen_ns: u64,
    pub created_ns: u64,
    pub backend_id: u32,
    pub state: u8,
    pub flags: u8,
}

/// [`Tracked`] for one family's conntrack value: the IPv4 and IPv6 keys and values have the
/// same fields (only the address widths differ), so one body serves both.
macro_rules! tracked {
    ($value:ident, $key:ident) => {
        impl Tracked for $value {
            type Key = $key;

            fn dir(key: &$key) -> u8 {
                key.dir
            }

            fn proto(key: &$key) -> u8 {
                key.proto
            }

            fn original_key_of(reply: &$key, v: &Self) -> $key {
                $key {
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

            fn facts(&self) -> FlowFacts {
                FlowFacts {
                    last_seen_ns: self.last_seen_ns,
                    created_ns: self.created_ns,
                    backend_id: self.backend_id,
                    state: self.state,
                    flags: self.flags,
                }
            }
        }
    };
}

tracked!(CtValue, CtKey);
tracked!(Ct6Value, Ct6Key);

/// The flows the walk found per backend id, in one family's listing.
#[derive(Debug)]
pub struct Tally<K> {
    created_by_ns: u64,
    counts: HashMap<u32, u64>,
    /// Flows seen only by their REPLY entry so far (their ORIGINAL entry may come later in the
    /// listing, or was evicted): the ORIGINAL key → backend id.
    reply_only: HashMap<K, u32>,
}

impl<K: Copy + Eq + Hash> Tally<K> {
    /// A tally of the flows created no later than `created_by_ns` (CLOCK_MONOTONIC, read after
    /// the counts).
    pub fn new(created_by_ns: u64) -> Self {
        Self {
            created_by_ns,
            counts: HashMap::new(),
            reply_only: HashMap::new(),
        }
    }

    /// One live conntrack entry (the caller leaves out the dead ones it removes). A flow counts
    /// once, by its ORIGINAL entry, or by its REPLY entry if the ORIGINAL one is gone (evicted:
    /// the datapath writes it again from the REPLY one, unit included); only if `current`: its
    /// backend id still names the backend the flow was created with.
    pub fn add<V: Tracked<Key = K>>(&mut self, key: &K, value: &V, current: bool) {
        let f = value.facts();
        if f.flags & ct_flags::COUNTED == 0
            || f.flags & ct_flags::DIRECT != 0
            || f.created_ns > self.created_by_ns
            || !current
        {
            return;
        }
        if V::dir(key) == ct_dir::ORIGINAL {
            self.reply_only.remove(key);
            *self.counts.entry(f.backend_id).or_default() += 1;
        } else if f.state != ct_state::CLOSING {
            self.reply_only
                .insert(V::original_key_of(key, value), f.backend_id);
        }
    }

    /// The truth per backend id.
    pub fn finish(mut self, originals: &HashSet<K>) -> HashMap<u32, u64> {
        for (original, id) in std::mem::take(&mut self.reply_only) {
            if !originals.contains(&original) {
                *self.counts.entry(id).or_default() += 1;
            }
        }
        self.counts
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

/// Lists one family's conntrack entries.
pub type ListFn<'a, V> = Box<dyn FnOnce() -> Vec<(<V as Tracked>::Key, V)> + 'a>;
/// Says whether an entry is dead at the walk's clock reading.
pub type DeadFn<'a, V> = Box<dyn FnMut(&<V as Tracked>::Key, &V, u64) -> bool + 'a>;

/// One family's conntrack map as [`reconcile`] reads it.
pub struct Listing<'a, V: Tracked> {
    /// The entries (called once, after the clock).
    pub list: ListFn<'a, V>,
    /// Which entries the caller removes (they do not count), at the walk's clock reading.
    pub dead: DeadFn<'a, V>,
    /// Does the flow's backend id still name the backend it was created with?
    pub current: Box<dyn Fn(&V) -> bool + 'a>,
}

impl<'a> Listing<'a, CtValue> {
    /// The IPv4 listing: a flow is current while `backends[id]` (the programmed backends) has
    /// the address it was created with.
    pub fn ipv4(
        list: impl FnOnce() -> Vec<(CtKey, CtValue)> + 'a,
        dead: impl FnMut(&CtKey, &CtValue, u64) -> bool + 'a,
        backends: &'a crate::pipeline::programmed::BackendEntries,
    ) -> Self {
        Self {
            list: Box::new(list),
            dead: Box::new(dead),
            current: Box::new(|v| {
                backends
                    .get(&v.backend_id)
                    .is_some_and(|b| b.addr == v.backend_addr && b.port == v.backend_port)
            }),
        }
    }
}

impl<'a, V: Tracked + 'a> Listing<'a, V> {
    /// No entries (a family whose map the caller does not read).
    pub fn none() -> Self {
        Self {
            list: Box::new(Vec::new),
            dead: Box::new(|_, _, _| false),
            current: Box::new(|_| true),
        }
    }
}

impl<V: Tracked> Listing<'_, V> {
    /// Lists, sorts out the dead entries and adds the live ones to the truth.
    fn tally(self, now: u64, truth: &mut HashMap<u32, u64>) -> (Vec<(V::Key, V)>, usize) {
        let Listing {
            list,
            mut dead,
            current,
        } = self;
        let entries = list();
        let total = entries.len();
        let mut tally = Tally::new(now);
        let mut originals = HashSet::new();
        let mut dead_keys = Vec::new();
        for (key, value) in entries {
            if dead(&key, &value, now) {
                dead_keys.push((key, value));
                continue;
            }
            if V::dir(&key) == ct_dir::ORIGINAL {
                originals.insert(key);
            }
            tally.add(&key, &value, current(&value));
        }
        for (id, n) in tally.finish(&originals) {
            *truth.entry(id).or_default() += n;
        }
        (dead_keys, total)
    }
}

/// One reconciliation over the conntrack listings of both families: `active` reads
/// `LCFLOWS_V1[id]` (called first, for every id in `ids`, and again after the listings), `now`
/// the clock (called after the first reads), then each family's listing. Returns the
/// corrections to write to `LCADJ_V1` (none for an id whose count moved during the walk) and
/// each family's dead entries.
pub fn reconcile(
    ids: impl IntoIterator<Item = u32>,
    active: impl Fn(u32) -> u64,
    now: impl FnOnce() -> u64,
    v4: Listing<'_, CtValue>,
    v6: Listing<'_, Ct6Value>,
) -> Reconciled {
    let counts: Vec<(u32, u64)> = ids.into_iter().map(|id| (id, active(id))).collect();
    let now = now();
    let mut truth = HashMap::new();
    let (dead, total) = v4.tally(now, &mut truth);
    let (dead6, total6) = v6.tally(now, &mut truth);
    // A count that moved while the walk listed (a flow of that backend began or ended meanwhile)
    // is not comparable with the truth found: leave that id's correction as it is, for the next
    // walk (otherwise a flow straddling the first read stays miscounted for a whole period).
    let counts: Vec<(u32, u64)> = counts
        .into_iter()
        .filter(|&(id, n)| active(id) == n)
        .collect();
    Reconciled {
        corrections: corrections(&counts, &truth),
        dead,
        total,
        dead6,
        total6,
    }
}

/// What [`reconcile`] found.
#[derive(Debug)]
pub struct Reconciled {
    /// `(backend id, LCADJ_V1 value)`.
    pub corrections: Vec<(u32, u64)>,
    /// `CONNTRACK_V1` entries to remove, with the values they were judged by.
    pub dead: Vec<(CtKey, CtValue)>,
    /// `CONNTRACK_V1` entries listed.
    pub total: usize,
    /// `CONNTRACK6_V1` entries to remove, with the values they were judged by.
    pub dead6: Vec<(Ct6Key, Ct6Value)>,
    /// `CONNTRACK6_V1` entries listed.
    pub total6: usize,
}

#[cfg(test)]
mod tests {
    use proxy_common::{Backend, ipv6::Backend6};

    use super::*;
    use crate::pipeline::programmed::BackendEntries;

    /// The IPv4 listing of `entries`, judged against `backends()`.
    fn v4<'a>(
        entries: Vec<(CtKey, CtValue)>,
        dead: impl FnMut(&CtKey, &CtValue, u64) -> bool + 'a,
    ) -> Listing<'a, CtValue> {
        // Leaked: a test's few backends, for the listing's lifetime.
        Listing::ipv4(move || entries, dead, Box::leak(Box::new(backends())))
    }

    /// The IPv6 listing of `entries`, judged against `backends6()`.
    fn v6<'a>(entries: Vec<(Ct6Key, Ct6Value)>) -> Listing<'a, Ct6Value> {
        let backends = backends6();
        Listing {
            list: Box::new(move || entries),
            dead: Box::new(|_, v, _| v.state == ct_state::CLOSING && v.last_seen_ns == 0),
            current: Box::new(move |v| {
                backends
                    .get(&v.backend_id)
                    .is_some_and(|b| b.addr == v.backend_addr && b.port == v.backend_port)
            }),
        }
    }

    /// IPv6 backends 4 and 5 (one id space with the IPv4 backends 1-3).
    fn backends6() -> HashMap<u32, Backend6> {
        [4u32, 5]
            .into_iter()
            .map(|id| {
                let b = Backend6 {
                    addr: addr6(id as u8),
                    port: 80u16.to_be_bytes(),
                    proto: 6,
                    flags: 0,
                };
                (id, b)
            })
            .collect()
    }

    fn addr6(last: u8) -> [u8; 16] {
        let mut a = [0u8; 16];
        a[0] = 0xfd;
        a[15] = last;
        a
    }

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

    /// The ORIGINAL and REPLY entries of a flow from client `client`:`port` to `frontend`:80,
    /// served by backend `id` at `backend`:80, either family (the keys and values of both have
    /// the same fields). Checks the REPLY entry leads back to the ORIGINAL one.
    macro_rules! flow_entries {
        ($key:ident, $value:ident, $client:expr, $frontend:expr, $backend:expr,
         $port:expr, $id:expr, $flags:expr, $created:expr) => {{
            let value = $value {
                last_seen_ns: $created,
                created_ns: $created,
                backend_id: $id,
                rev_nat_id: 1,
                frontend_addr: $frontend,
                backend_addr: $backend,
                frontend_port: 80u16.to_be_bytes(),
                backend_port: 80u16.to_be_bytes(),
                state: ct_state::ESTABLISHED,
                flags: $flags,
                nat_sport: [0; 2],
            };
            let original = $key {
                saddr: $client,
                daddr: value.frontend_addr,
                sport: $port.to_be_bytes(),
                dport: 80u16.to_be_bytes(),
                proto: 6,
                dir: ct_dir::ORIGINAL,
                _pad: [0; 2],
            };
            let reply = $key {
                saddr: value.backend_addr,
                daddr: original.saddr,
                sport: value.backend_port,
                dport: original.sport,
                proto: 6,
                dir: ct_dir::REPLY,
                _pad: [0; 2],
            };
            assert_eq!($value::original_key_of(&reply, &value), original);
            [(original, value), (reply, value)]
        }};
    }

    /// The ORIGINAL and REPLY entries of a flow from client port `port` to backend `id`, over
    /// IPv6.
    fn flow6(port: u16, id: u32, flags: u8, created: u64) -> [(Ct6Key, Ct6Value); 2] {
        let (client, frontend) = (addr6(0x99), addr6(0x10));
        flow_entries!(
            Ct6Key,
            Ct6Value,
            client,
            frontend,
            addr6(id as u8),
            port,
            id,
            flags,
            created
        )
    }

    /// The ORIGINAL and REPLY entries of a flow from client port `port` to backend `id`.
    fn flow(port: u16, id: u32, flags: u8, created: u64) -> [(CtKey, CtValue); 2] {
        let (client, frontend) = ([10, 244, 0, 1], [10, 96, 0, 1]);
        flow_entries!(
            CtKey,
            CtValue,
            client,
            frontend,
            [10, 0, 0, id as u8],
            port,
            id,
            flags,
            created
        )
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
            v4(entries, |_, _, _| false),
            Listing::none(),
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
        run_both(entries, Vec::new(), active)
    }

    /// Effective counts of ids 1..=active.len() after a walk over both families' entries.
    fn run_both(
        entries: Vec<(CtKey, CtValue)>,
        entries6: Vec<(Ct6Key, Ct6Value)>,
        active: &[u64],
    ) -> HashMap<u32, u64> {
        let r = reconcile(
            1..=active.len() as u32,
            |id| active[id as usize - 1],
            || 1_000,
            v4(entries, |_, v, _| {
                v.state == ct_state::CLOSING && v.last_seen_ns == 0
            }),
            v6(entries6),
        );
        r.corrections
            .into_iter()
            .map(|(id, adj)| (id, lc::effective(active[id as usize - 1], adj)))
            .collect()
    }

    /// IPv6 flows count for their backend ids like IPv4 ones (the counts are shared by id): an
    /// id's truth is the sum over both maps, and without the IPv6 listing the correction would
    /// zero the IPv6 backends' live flows.
    #[test]
    fn ipv6_flows_count_for_their_backend_ids_with_the_ipv4_ones() {
        let c = ct_flags::COUNTED;
        let mut entries6 = Vec::new();
        entries6.extend(flow6(1, 4, c, 10));
        entries6.extend(flow6(2, 4, c, 10));
        // Evicted ORIGINAL: counted by its REPLY entry.
        entries6.push(flow6(3, 5, c, 10)[1]);
        // REPLY before ORIGINAL: once.
        let [o, r] = flow6(4, 5, c, 10);
        entries6.push(r);
        entries6.push(o);
        // Not counted: no flag, created after the counts were read, a backend id that now names
        // another address, and a dead (closed and gone) entry.
        entries6.extend(flow6(5, 5, 0, 10));
        entries6.extend(flow6(6, 5, c, 2_000));
        let mut moved = flow6(7, 4, c, 10);
        for (_, v) in &mut moved {
            v.backend_addr = addr6(0x77);
        }
        entries6.extend(moved);
        let mut closed = flow6(8, 4, c, 10);
        for (_, v) in &mut closed {
            v.state = ct_state::CLOSING;
            v.last_seen_ns = 0;
        }
        entries6.extend(closed);
        let entries = flow(1, 1, c, 10).to_vec();
        // The datapath's counts (ids 1-5) include flows that ended unseen.
        let got = run_both(entries, entries6, &[3, 0, 0, 9, 4]);
        assert_eq!(got, HashMap::from([(1, 1), (2, 0), (3, 0), (4, 2), (5, 2)]));
    }

    #[test]
    fn the_walk_returns_each_family_s_dead_entries() {
        let mut closed = flow6(1, 4, ct_flags::COUNTED, 10);
        for (_, v) in &mut closed {
            v.state = ct_state::CLOSING;
            v.last_seen_ns = 0;
        }
        let r = reconcile(
            1..=5,
            |_| 0,
            || 1_000,
            v4(flow(1, 1, 0, 10).to_vec(), |k, _, _| k.dir == ct_dir::REPLY),
            v6(closed.to_vec()),
        );
        assert_eq!((r.total, r.total6), (2, 2));
        assert_eq!(r.dead, vec![flow(1, 1, 0, 10)[1]]);
        assert_eq!(r.dead6, vec![closed[0], closed[1]]);
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
