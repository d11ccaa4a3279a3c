//! loadBalancerSourceRanges in `SRCRANGES_V1` (an LPM trie keyed by frontend + source prefix),
//! and the IPv6 family's in `SRCRANGES6_V1` (the same code over [`FamilyAbi`]).
//!
//! The entries depend only on the desired frontends (no ids), so they are reconciled here as a
//! set, next to the diff's ordered plan: the wanted set is pure ([`wanted`]); the map layer adds
//! what is missing, then removes what is no longer wanted. The shadow is read back from the
//! pinned map at start-up, like the service maps. Between full syncs [`WantedRanges`] follows
//! the changed frontends and only the entries it marks are written
//! ([`SourceRanges::sync_changed`]).

use std::{
    collections::{BTreeMap, BTreeSet},
    net::Ipv4Addr,
};

use aya::maps::{
    MapData,
    lpm_trie::{Key, LpmTrie},
};
use tracing::error;

use crate::{
    dataplane,
    pipeline::{
        encode::{self, FamilyAbi},
        model::DesiredState,
        translate_cache::FrontendChange,
    },
};

/// One entry: (LPM prefix length, key data).
pub type Entry<A = Ipv4Addr> = (u32, <A as FamilyAbi>::SourceRangeKey);

/// Pure: every entry the desired state needs.
pub fn wanted<A: FamilyAbi>(desired: &DesiredState<A>) -> BTreeSet<Entry<A>> {
    desired
        .frontends
        .iter()
        .flat_map(|(fe, df)| encode::source_range_keys(fe, df))
        .collect()
}

/// [`wanted`] kept up to date by the changed frontends, and the entries that may differ from
/// the map.
#[derive(Debug, Default)]
pub struct WantedRanges {
    /// Frontends asking for each entry (the two scopes of one address share it).
    counts: BTreeMap<Entry, u32>,
    changed: BTreeSet<Entry>,
}

impl WantedRanges {
    /// The frontends of one update changed (`desired`: their new values).
    pub fn update(&mut self, changes: &[FrontendChange], desired: &DesiredState) {
        for c in changes {
            for e in (c.old.iter()).flat_map(|old| encode::source_range_keys(&c.frontend, old)) {
                if let Some(n) = self.counts.get_mut(&e) {
                    *n -= 1;
                    if *n == 0 {
                        self.counts.remove(&e);
                        self.changed.insert(e);
                    }
                }
            }
            let new = desired.frontends.get(&c.frontend);
            for e in new
                .iter()
                .flat_map(|df| encode::source_range_keys(&c.frontend, df))
            {
                let n = self.counts.entry(e).or_default();
                *n += 1;
                if *n == 1 {
                    self.changed.insert(e);
                }
            }
        }
    }

    /// Counted again from the whole desired state (full syncs).
    pub fn rebuild(&mut self, desired: &DesiredState) {
        self.counts.clear();
        for (fe, df) in &desired.frontends {
            for e in encode::source_range_keys(fe, df) {
                *self.counts.entry(e).or_default() += 1;
            }
        }
    }

    /// Every wanted entry, as [`wanted`] of the desired state these counts follow.
    pub fn entries(&self) -> BTreeSet<Entry> {
        self.counts.keys().copied().collect()
    }
}

/// One family's map and what it carries.
pub struct SourceRanges<A: FamilyAbi = Ipv4Addr> {
    map: LpmTrie<MapData, A::SourceRangeKey, u32>,
    programmed: BTreeSet<Entry<A>>,
}

impl<A: FamilyAbi> SourceRanges<A> {
    /// Takes the map out of a loaded object and reads back what it carries.
    pub fn from_ebpf(ebpf: &mut aya::Ebpf) -> dataplane::Result<Self> {
        let name = A::MAP_SOURCE_RANGES;
        let map = ebpf
            .take_map(name)
            .ok_or(dataplane::Error::Missing { what: "map", name })?;
        let map: LpmTrie<MapData, A::SourceRangeKey, u32> =
            LpmTrie::try_from(map).map_err(|source| dataplane::Error::Map { name, source })?;
        let programmed = map
            .keys()
            .filter_map(Result::ok)
            .map(|k| (k.prefix_len(), k.data()))
            .collect();
        Ok(Self { map, programmed })
    }

    /// Writes the entries changed since the last call (additions first; a failed one is kept
    /// for the next call), as [`SourceRanges::sync`] would for the whole set.
    pub fn sync_changed(&mut self, wanted: &mut WantedRanges)
    where
        A: FamilyAbi<SourceRangeKey = proxy_common::SourceRangeKey>,
    {
        let changed = std::mem::take(&mut wanted.changed);
        let (add, remove): (Vec<Entry<A>>, Vec<Entry<A>>) = changed
            .into_iter()
            .partition(|e| wanted.counts.contains_key(e));
        for (len, data) in add {
            if self.programmed.contains(&(len, data)) {
                continue;
            }
            match self.map.insert(&Key::new(len, data), 1, 0) {
                Ok(()) => {
                    self.programmed.insert((len, data));
                }
                Err(e) => {
                    error!("loadBalancerSourceRanges entry {data:?}/{len}: {e}");
                    wanted.changed.insert((len, data));
                }
            }
        }
        for (len, data) in remove {
            if !self.programmed.contains(&(len, data)) {
                continue;
            }
            match self.map.remove(&Key::new(len, data)) {
                Ok(()) | Err(aya::maps::MapError::KeyNotFound) => {
                    self.programmed.remove(&(len, data));
                }
                Err(e) => {
                    error!("removing loadBalancerSourceRanges entry {data:?}/{len}: {e}");
                    wanted.changed.insert((len, data));
                }
            }
        }
    }

    /// Makes the map carry exactly what `wanted` counts (a full sync); entries whose write
    /// failed are left marked for the next [`SourceRanges::sync_changed`].
    pub fn sync_all(&mut self, wanted: &mut WantedRanges)
    where
        A: FamilyAbi<SourceRangeKey = proxy_common::SourceRangeKey>,
    {
        let want = wanted.entries();
        let _all_written = self.sync(&want);
        wanted.changed = want
            .symmetric_difference(&self.programmed)
            .copied()
            .collect();
    }

    /// Makes the map carry exactly `want` (additions first). Failed writes are logged; false
    /// when one failed (the caller calls again at its next sync: what was written is not
    /// written twice).
    pub fn sync(&mut self, want: &BTreeSet<Entry<A>>) -> bool {
        let add: Vec<Entry<A>> = want.difference(&self.programmed).copied().collect();
        let remove: Vec<Entry<A>> = self.programmed.difference(want).copied().collect();
        let mut written = true;
        for (len, data) in add {
            match self.map.insert(&Key::new(len, data), 1, 0) {
                Ok(()) => {
                    self.programmed.insert((len, data));
                }
                Err(e) => {
                    written = false;
                    error!("loadBalancerSourceRanges entry {data:?}/{len}: {e}");
                }
            }
        }
        for (len, data) in remove {
            match self.map.remove(&Key::new(len, data)) {
                Ok(()) | Err(aya::maps::MapError::KeyNotFound) => {
                    self.programmed.remove(&(len, data));
                }
                Err(e) => {
                    written = false;
                    error!("removing loadBalancerSourceRanges entry {data:?}/{len}: {e}");
                }
            }
        }
        written
    }

    /// What the map carries (as written by this agent or read back at start-up).
    pub fn programmed(&self) -> &BTreeSet<Entry<A>> {
        &self.programmed
    }
}

#[cfg(test)]
mod tests {
    use proxy_common::SourceRangeKey;

    use super::*;
    use crate::pipeline::model::{
        DesiredFrontend, Frontend, FrontendKind, Protocol, ServicePortName,
    };

    #[test]
    fn wanted_entries_follow_the_frontends_ranges() {
        let mut desired = DesiredState::default();
        let fe = Frontend::new(Ipv4Addr::new(192, 168, 70, 10), 80, Protocol::Tcp);
        desired.frontends.insert(
            fe,
            DesiredFrontend {
                balancing: Default::default(),
                service: ServicePortName {
                    namespace: "demo".into(),
                    name: "lb".into(),
                    port_name: String::new(),
                },
                kind: FrontendKind::LoadBalancer,
                external_local: false,
                drop_when_empty: false,
                source_ranges: vec![(Ipv4Addr::new(10, 0, 0, 0), 8)],
                backends: vec![],
                retained: vec![],
            }
            .into(),
        );
        let w = wanted(&desired);
        assert_eq!(
            w.into_iter().collect::<Vec<_>>(),
            vec![(
                72,
                SourceRangeKey {
                    frontend_addr: [192, 168, 70, 10],
                    frontend_port: [0, 80],
                    proto: 6,
                    _pad: 0,
                    source: [10, 0, 0, 0],
                }
            )]
        );
    }
}
