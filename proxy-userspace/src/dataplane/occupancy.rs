//! Occupancy of every pinned map with a size limit: exported as
//! `kube_proxy_ebpf_map_entries{map}` / `kube_proxy_ebpf_map_capacity{map}`, and a warning when
//! a map crosses [`WARN_PERCENT`] of its capacity (logged once per crossing: the alarm re-arms
//! only after the map fell below [`REARM_PERCENT`]).
//!
//! The IPv6 family's maps (`SERVICES6_V1` ...) are labelled by their own names (`services6`,
//! `conntrack6` ...): per family, as the pinned maps are.
//!
//! Counts come from where they are cheap: SERVICES, BACKENDS, REVNAT and MAGLEV (chunks) from
//! the agent's shadow after each sync (the IPv6 ones from the IPv6 family's shadow after its
//! sync); CONNTRACK, CONNTRACK6 and SNAT from the garbage-collection pass that lists them anyway;
//! SRCRANGES, SOCKREV, SOCKPICK and AFFINITY (and their IPv6 twins, and SNAT6, which no pass lists) by
//! walking their keys in that same pass (every 30 s, bounded by their capacity). Capacities are the maps' real `max_entries`, so an adopted map of another size
//! shows what it really holds. `NODE_V1` and `STATS_V1` are arrays (always full) and left out.

use std::collections::BTreeSet;

use aya::{
    Pod,
    maps::{HashMap, LpmTrie, Map, MapData},
};
use proxy_common::{
    AffinityKey, AffinityValue, MAP_AFFINITY, MAP_BACKENDS, MAP_CONNTRACK, MAP_MAGLEV, MAP_REVNAT,
    MAP_SERVICES, MAP_SNAT, MAP_SOCK_PICK, MAP_SOCK_REVNAT, MAP_SOURCE_RANGES, SockPickKey,
    SockPickValue, SockRevKey, SockRevValue, SourceRangeKey,
    ipv6::{
        Affinity6Key, MAP_AFFINITY6, MAP_BACKENDS6, MAP_CONNTRACK6, MAP_REVNAT6, MAP_SERVICES6,
        MAP_SNAT6, MAP_SOCK_REVNAT6, MAP_SOURCE_RANGES6, RevNat6, SockRev6Key, SourceRange6Key,
    },
};
use tracing::{info, warn};

use crate::{
    dataplane::{bpffs::PinLayout, loader::MapSizes},
    serving::metrics::Metrics,
};

/// A map at or above this share of its capacity is reported.
pub const WARN_PERCENT: u64 = 90;
/// A reported map is reported again only after it fell below this share.
pub const REARM_PERCENT: u64 = 80;

/// What happens when a map is full.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    /// A hash map or trie the agent writes: further writes fail (Services are skipped).
    Programmed,
    /// An LRU map the datapath writes: the least recently used entries are evicted (live flows
    /// among them).
    Lru,
}

/// Every map with a size limit: (metric label, pinned name, kind).
pub const MAPS: [(&str, &str, Kind); 18] = [
    ("services", MAP_SERVICES, Kind::Programmed),
    ("maglev", MAP_MAGLEV, Kind::Programmed),
    ("backends", MAP_BACKENDS, Kind::Programmed),
    ("rev_nat", MAP_REVNAT, Kind::Programmed),
    ("source_ranges", MAP_SOURCE_RANGES, Kind::Programmed),
    ("conntrack", MAP_CONNTRACK, Kind::Lru),
    ("snat", MAP_SNAT, Kind::Lru),
    ("sock_rev", MAP_SOCK_REVNAT, Kind::Lru),
    ("sock_pick", MAP_SOCK_PICK, Kind::Lru),
    ("affinity", MAP_AFFINITY, Kind::Lru),
    ("services6", MAP_SERVICES6, Kind::Programmed),
    ("backends6", MAP_BACKENDS6, Kind::Programmed),
    ("rev_nat6", MAP_REVNAT6, Kind::Programmed),
    ("source_ranges6", MAP_SOURCE_RANGES6, Kind::Programmed),
    ("conntrack6", MAP_CONNTRACK6, Kind::Lru),
    ("snat6", MAP_SNAT6, Kind::Lru),
    ("sock_rev6", MAP_SOCK_REVNAT6, Kind::Lru),
    ("affinity6", MAP_AFFINITY6, Kind::Lru),
];

/// Counts a map's keys, at most the bound given.
type KeyCounter = Box<dyn Fn(usize) -> usize + Send + Sync>;

/// A [`KeyCounter`] of a pinned (LRU) hash map.
fn hash_keys<K: Pod + Send + Sync, V: Pod + Send + Sync>(
    data: MapData,
    lru: bool,
) -> Option<KeyCounter> {
    let map = if lru {
        Map::LruHashMap(data)
    } else {
        Map::HashMap(data)
    };
    let map: HashMap<MapData, K, V> = HashMap::try_from(map).ok()?;
    Some(Box::new(move |bound| map.keys().take(bound).count()))
}

/// A [`KeyCounter`] of a pinned LPM trie.
fn trie_keys<K: Pod + Send + Sync>(data: MapData) -> Option<KeyCounter> {
    let map: LpmTrie<MapData, K, u32> = LpmTrie::try_from(Map::LpmTrie(data)).ok()?;
    Some(Box::new(move |bound| map.keys().take(bound).count()))
}

/// A threshold crossing worth one log line.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Crossing {
    /// At or above `WARN_PERCENT` (and not reported since it was last below `REARM_PERCENT`).
    Filling,
    /// Back below `REARM_PERCENT` after a `Filling`.
    Relieved,
}

/// Pure: which maps are currently reported as filling.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Alarms {
    raised: BTreeSet<&'static str>,
}

impl Alarms {
    /// A new count for `map`: the crossing to log, if any.
    pub fn observe(&mut self, map: &'static str, entries: u64, capacity: u64) -> Option<Crossing> {
        if capacity == 0 {
            return None;
        }
        // Percent with integers: entries * 100 >= WARN * capacity (u128: no overflow).
        let at = |percent: u64| u128::from(entries) * 100 >= u128::from(percent * capacity);
        if at(WARN_PERCENT) {
            self.raised.insert(map).then_some(Crossing::Filling)
        } else if !at(REARM_PERCENT) && self.raised.remove(map) {
            Some(Crossing::Relieved)
        } else {
            None
        }
    }
}

/// The maps' capacities, the alarms, and handles on the maps only this module counts.
pub struct Occupancy {
    capacities: Vec<(&'static str, u32)>,
    alarms: Alarms,
    /// The maps [`Occupancy::sample`] walks, by metric label (those that could be opened).
    walked: Vec<(&'static str, KeyCounter)>,
}

/// The real `max_entries` of a pinned map.
fn pinned_capacity(pins: &PinLayout, name: &str) -> Option<u32> {
    MapData::from_pin(pins.map(name))
        .ok()?
        .info()
        .ok()
        .map(|i| i.max_entries())
}

impl Occupancy {
    /// Reads the pinned maps' capacities into `metrics`, and warns about adopted maps whose size
    /// differs from what the settings ask for (aya adopts a pin as it is).
    pub fn open(pins: &PinLayout, sizes: &MapSizes, adopted: bool, metrics: &Metrics) -> Self {
        let wanted = |name: &str| sizes.wanted(name);
        let mut capacities = Vec::new();
        for (label, name, _) in MAPS {
            let Some(capacity) = pinned_capacity(pins, name) else {
                warn!(
                    map = name,
                    "cannot read the pinned map's size; no occupancy metric"
                );
                continue;
            };
            if adopted
                && let Some(want) = wanted(name)
                && want != capacity
            {
                warn!(
                    map = name,
                    pinned = capacity,
                    configured = want,
                    "adopted the pinned map with its own size (its entries kept); the configured \
                     size applies only to a new map: run `kube-proxy-ebpf cleanup` (drops every \
                     flow) and start again to resize"
                );
            }
            metrics.set_map(label, 0, capacity.into());
            capacities.push((label, capacity));
        }
        let open = |name| MapData::from_pin(pins.map(name)).ok();
        let walked: [(&'static str, Option<KeyCounter>); 7] = [
            (
                "source_ranges",
                open(MAP_SOURCE_RANGES).and_then(trie_keys::<SourceRangeKey>),
            ),
            (
                "sock_rev",
                open(MAP_SOCK_REVNAT).and_then(|m| hash_keys::<SockRevKey, SockRevValue>(m, true)),
            ),
            (
                "sock_pick",
                open(MAP_SOCK_PICK).and_then(|m| hash_keys::<SockPickKey, SockPickValue>(m, true)),
            ),
            (
                "affinity",
                open(MAP_AFFINITY).and_then(|m| hash_keys::<AffinityKey, AffinityValue>(m, true)),
            ),
            (
                "source_ranges6",
                open(MAP_SOURCE_RANGES6).and_then(trie_keys::<SourceRange6Key>),
            ),
            (
                "sock_rev6",
                open(MAP_SOCK_REVNAT6).and_then(|m| hash_keys::<SockRev6Key, RevNat6>(m, true)),
            ),
            (
                "affinity6",
                open(MAP_AFFINITY6).and_then(|m| hash_keys::<Affinity6Key, AffinityValue>(m, true)),
            ),
        ];
        Self {
            capacities,
            alarms: Alarms::default(),
            walked: (walked.into_iter())
                .filter_map(|(label, c)| Some((label, c?)))
                .collect(),
        }
    }

    /// The capacity of the map with metric label `label`.
    pub fn capacity(&self, label: &str) -> Option<u32> {
        self.capacities
            .iter()
            .find(|(l, _)| *l == label)
            .map(|(_, c)| *c)
    }

    /// Records a count: the metric, and a log line when it crosses a threshold.
    pub fn report(&mut self, metrics: &Metrics, label: &'static str, entries: u64) {
        metrics.set_map_entries(label, entries);
        let Some(capacity) = self.capacity(label) else {
            return;
        };
        let (name, kind) = MAPS
            .iter()
            .find(|(l, ..)| *l == label)
            .map_or(("?", Kind::Programmed), |(_, n, k)| (*n, *k));
        match self.alarms.observe(label, entries, capacity.into()) {
            Some(Crossing::Filling) => warn!(
                map = name,
                entries,
                capacity,
                "map is {}% full: {}",
                u128::from(entries) * 100 / u128::from(capacity),
                match kind {
                    Kind::Programmed =>
                        "frontends or ranges that do not fit are skipped (raise --map-entries-*)",
                    Kind::Lru =>
                        "when full the kernel evicts its least recently used entries, live flows \
                         (or affinity records) among them (raise conntrack.maxPerCore / \
                         conntrack.min, --map-entries-* or --affinity-max-entries)",
                }
            ),
            Some(Crossing::Relieved) => info!(
                map = name,
                entries, capacity, "map back below {REARM_PERCENT}% of its capacity"
            ),
            None => {}
        }
    }

    /// Counts the maps no other pass lists (SRCRANGES, SOCKREV, SOCKPICK, AFFINITY and their IPv6 twins;
    /// the SNAT maps are counted by their sweep), bounded by their capacity.
    pub fn sample(&mut self, metrics: &Metrics) {
        let counts: Vec<(&'static str, usize)> = (self.walked.iter())
            .map(|(label, count)| (*label, count(self.capacity(label).unwrap_or(0) as usize)))
            .collect();
        for (label, n) in counts {
            self.report(metrics, label, n as u64);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_filling_map_is_reported_once_per_crossing() {
        let mut a = Alarms::default();
        assert_eq!(a.observe("conntrack", 899, 1_000), None, "89.9 %");
        assert_eq!(
            a.observe("conntrack", 900, 1_000),
            Some(Crossing::Filling),
            "90 %"
        );
        assert_eq!(
            a.observe("conntrack", 1_000, 1_000),
            None,
            "still full: quiet"
        );
        assert_eq!(a.observe("conntrack", 850, 1_000), None, "between: quiet");
        assert_eq!(a.observe("conntrack", 950, 1_000), None, "not re-armed yet");
        assert_eq!(
            a.observe("snat", 950, 1_000),
            Some(Crossing::Filling),
            "maps are independent"
        );
        assert_eq!(
            a.observe("conntrack", 799, 1_000),
            Some(Crossing::Relieved),
            "below 80 %"
        );
        assert_eq!(a.observe("conntrack", 700, 1_000), None);
        assert_eq!(
            a.observe("conntrack", 905, 1_000),
            Some(Crossing::Filling),
            "re-armed: reported again"
        );
        assert_eq!(a.observe("services", 10, 0), None, "no capacity known");
        assert_eq!(
            a.observe("backends", u64::MAX, u64::MAX / 100 + 1),
            Some(Crossing::Filling),
            "no overflow"
        );
    }
}
