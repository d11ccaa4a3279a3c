//! What the maps carry now (a shadow kept in memory), and the operations that change them.
//!
//! The shadow is rebuilt from the pinned maps when the agent starts (adoption), then kept equal to
//! the maps by applying every operation to both. `diff` compares it with the desired state; ids
//! are derived from it, so no other allocator state exists to drift.

use std::{net::Ipv4Addr, sync::Arc};

use proxy_common::{
    Backend, ServiceKey, ServiceValue,
    maglev::{Chunk, MaglevKey},
};

use crate::pipeline::{
    encode::{self, BackendValue, FamilyAbi, SlotKey},
    fast_hash::{HashMap, HashSet},
    maglev::MaglevTable,
};

/// One write to one map. `diff` emits them in an order that keeps the datapath consistent at
/// every step: backends → rev-NAT → Maglev tables → slots → frontends; shrinking in reverse.
/// Affinity match entries (`AFFMATCH_V1`) leave first (a record naming a backend on its way out
/// of a frontend stops matching before anything else changes) and come with the slots.
/// One family's maps (`A`: IPv4 writes `SERVICES_V1` ..., IPv6 `SERVICES6_V1` ...; Maglev
/// tables are in the one `MAGLEV_V1`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum MapOp<A: FamilyAbi = Ipv4Addr> {
    DeleteAffinityMatch {
        key: A::AffinityMatchKey,
    },
    PutBackend {
        id: u32,
        backend: A::Backend,
    },
    PutRevNat {
        id: u32,
        rev_nat: A::RevNat,
    },
    PutService {
        key: A::ServiceKey,
        value: ServiceValue,
    },
    PutAffinityMatch {
        key: A::AffinityMatchKey,
    },
    DeleteService {
        key: A::ServiceKey,
    },
    DeleteRevNat {
        id: u32,
    },
    DeleteBackend {
        id: u32,
    },
    /// Write every chunk of Maglev table `id` (built from its description by the map layer).
    PutMaglevTable {
        id: u32,
        table: Arc<MaglevTable<A>>,
    },
    /// Delete the `chunks` chunks of Maglev table `id`.
    DeleteMaglevTable {
        id: u32,
        chunks: u32,
    },
}

/// One family's maps' contents as last written (or read back at start-up).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Programmed<A: FamilyAbi = Ipv4Addr> {
    pub services: ServiceEntries<A::ServiceKey>,
    pub backends: BackendEntries<A::Backend>,
    pub rev_nats: HashMap<u32, A::RevNat>,
    /// `AFFMATCH_V1`: (affinity frontend, backend id in its slots).
    pub affinity_matches: HashSet<A::AffinityMatchKey>,
    /// Maglev table id → what it holds (this family's tables of the shared `MAGLEV_V1`).
    pub maglev: HashMap<u32, Arc<MaglevTable<A>>>,
}

impl<A: FamilyAbi> Default for Programmed<A> {
    fn default() -> Self {
        Self {
            services: ServiceEntries::default(),
            backends: BackendEntries::default(),
            rev_nats: HashMap::default(),
            affinity_matches: HashSet::default(),
            maglev: HashMap::default(),
        }
    }
}

/// Ids the other family's maps hold in the spaces both share: backend ids (least-connection
/// counts in `LCFLOWS_V1` are indexed by them) and Maglev table ids (one `MAGLEV_V1`). A plan
/// never hands these out.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SharedIds {
    pub backends: HashSet<u32>,
    pub maglev_tables: HashSet<u32>,
}

impl SharedIds {
    pub fn is_empty(&self) -> bool {
        self.backends.is_empty() && self.maglev_tables.is_empty()
    }
}

impl<A: FamilyAbi> Programmed<A> {
    /// The shared-space ids these maps hold or name (for the other family's plan).
    pub fn shared_ids(&self) -> SharedIds {
        let mut out = SharedIds::default();
        for (key, v) in &self.services {
            if key.slot() == 0 {
                out.maglev_tables.insert(v.maglev_table);
            } else {
                out.backends.insert(v.backend_id);
            }
        }
        out.backends.extend(self.backends.ids());
        out.maglev_tables.extend(self.maglev.keys().copied());
        out.backends.remove(&0);
        out.maglev_tables.remove(&0);
        out
    }

    /// Adoption of the Maglev tables read back from the maps (all [`MaglevTable::unknown`]): a
    /// table that a frontend names and that holds exactly what this agent builds for that
    /// frontend's slots at size `m` (`read` gives a chunk as the map holds it) becomes known — kept
    /// and shared as if this agent had written it. Any other stays unknown, so the next plan
    /// replaces it (another `m`, a table cut short by a crash). Each named table is read once.
    pub fn adopt_maglev(&mut self, m: u32, read: impl Fn(&MaglevKey) -> Option<Chunk>) {
        let mut checked: HashSet<u32> = HashSet::default();
        let mut known = Vec::new();
        for (key, v) in &self.services {
            if key.slot() != 0 || v.maglev_table == 0 || !checked.insert(v.maglev_table) {
                continue;
            }
            let Some(have) = self.maglev.get(&v.maglev_table) else {
                continue;
            };
            let endpoints: Option<Vec<_>> = (1..=v.count)
                .map(|s| {
                    let slot = self.services.get(&key.with_slot(s))?;
                    encode::decode_endpoint(self.backends.get(&slot.backend_id)?)
                })
                .collect();
            let Some(endpoints) = endpoints else { continue };
            let want = MaglevTable::new(m, endpoints);
            if want.chunks() != have.chunks() {
                continue;
            }
            let same = want
                .map_entries(v.maglev_table)
                .iter()
                .all(|(k, chunk)| read(k).as_ref() == Some(chunk));
            if same {
                known.push((v.maglev_table, want));
            }
        }
        self.maglev.extend(known);
    }

    /// Record an operation the map layer has carried out.
    pub fn apply(&mut self, op: &MapOp<A>) {
        match *op {
            MapOp::PutBackend { id, backend } => {
                self.backends.insert(id, backend);
            }
            MapOp::PutRevNat { id, rev_nat } => {
                self.rev_nats.insert(id, rev_nat);
            }
            MapOp::PutService { key, value } => {
                self.services.insert(key, value);
            }
            MapOp::DeleteService { key } => {
                self.services.remove(&key);
            }
            MapOp::DeleteRevNat { id } => {
                self.rev_nats.remove(&id);
            }
            MapOp::DeleteBackend { id } => {
                self.backends.remove(&id);
            }
            MapOp::PutAffinityMatch { key } => {
                self.affinity_matches.insert(key);
            }
            MapOp::DeleteAffinityMatch { key } => {
                self.affinity_matches.remove(&key);
            }
            MapOp::PutMaglevTable { id, ref table } => {
                self.maglev.insert(id, table.clone());
            }
            MapOp::DeleteMaglevTable { id, .. } => {
                self.maglev.remove(&id);
            }
        }
    }

    /// Makes room for the entries `ops` puts, before they are applied one by one: a first sync's
    /// hundreds of thousands of puts then never grow a table by doubling (which held the old and
    /// the new table at once).
    pub fn reserve_for(&mut self, ops: &[MapOp<A>]) {
        let (mut services, mut slots, mut backends, mut rev_nats) = (0, 0, 0, 0);
        for op in ops {
            match op {
                MapOp::PutService { key, value } => {
                    services += 1;
                    slots += usize::from(ServiceEntries::compact(key, value));
                }
                MapOp::PutBackend { .. } => backends += 1,
                MapOp::PutRevNat { .. } => rev_nats += 1,
                _ => {}
            }
        }
        self.services.reserve(services, slots);
        self.backends.reserve(backends);
        self.rev_nats.reserve(rev_nats);
    }

    /// The affinity match entries of frontend `key` (slot 0) whose backend a programmed slot of
    /// it names (those a plan keeps in step with the slots), sorted.
    pub fn affinity_matches_of(&self, key: &A::ServiceKey) -> Vec<A::AffinityMatchKey> {
        let count = self.services.get(key).map_or(0, |v| v.count);
        let mut out: Vec<A::AffinityMatchKey> = (1..=count)
            .filter_map(|s| self.services.get(&key.with_slot(s)))
            .map(|v| A::affinity_match(*key, v.backend_id))
            .filter(|k| self.affinity_matches.contains(k))
            .collect();
        out.sort();
        out.dedup();
        out
    }

    /// `MAGLEV_V1` chunks the tables take.
    pub fn maglev_chunks(&self) -> u64 {
        self.maglev.values().map(|t| u64::from(t.chunks())).sum()
    }

    /// Number of frontends (slot-0 entries).
    pub fn frontend_count(&self) -> usize {
        self.services.frontends().count()
    }
}

/// `SERVICES` as the shadow holds it: a map from key to value whose slot entries (slot > 0,
/// a plain [`ServiceValue::slot`]: only the backend id set — all but a few of a large cluster's
/// entries) are kept as the backend id alone (16 instead of 44 bytes an entry); every other entry
/// (frontends, and any slot value another writer left) is kept whole. A key is in one of the two.
/// Values are returned by copy.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ServiceEntries<K: SlotKey = ServiceKey> {
    whole: HashMap<K, ServiceValue>,
    slots: HashMap<K, u32>,
}

impl<K: SlotKey> ServiceEntries<K> {
    fn compact(key: &K, value: &ServiceValue) -> bool {
        key.slot() > 0 && *value == ServiceValue::slot(value.backend_id)
    }

    pub fn get(&self, key: &K) -> Option<ServiceValue> {
        if key.slot() > 0
            && let Some(&id) = self.slots.get(key)
        {
            return Some(ServiceValue::slot(id));
        }
        self.whole.get(key).copied()
    }

    pub fn contains_key(&self, key: &K) -> bool {
        (key.slot() > 0 && self.slots.contains_key(key)) || self.whole.contains_key(key)
    }

    /// Sets `key` to `value`; the value it had.
    pub fn insert(&mut self, key: K, value: ServiceValue) -> Option<ServiceValue> {
        let old = self.remove(&key);
        if Self::compact(&key, &value) {
            self.slots.insert(key, value.backend_id);
        } else {
            self.whole.insert(key, value);
        }
        old
    }

    pub fn remove(&mut self, key: &K) -> Option<ServiceValue> {
        if key.slot() > 0
            && let Some(id) = self.slots.remove(key)
        {
            return Some(ServiceValue::slot(id));
        }
        self.whole.remove(key)
    }

    pub fn len(&self) -> usize {
        self.whole.len() + self.slots.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Room for `n` more entries, `slots` of them slot entries.
    pub fn reserve(&mut self, n: usize, slots: usize) {
        self.slots.reserve(slots);
        self.whole.reserve(n.saturating_sub(slots));
    }

    /// Every entry, in no particular order.
    pub fn iter(&self) -> impl Iterator<Item = (&K, ServiceValue)> + '_ {
        (self.whole.iter().map(|(k, v)| (k, *v))).chain(
            self.slots
                .iter()
                .map(|(k, &id)| (k, ServiceValue::slot(id))),
        )
    }

    /// The frontend entries (slot 0), without walking the slots.
    pub fn frontends(&self) -> impl Iterator<Item = (&K, ServiceValue)> + '_ {
        (self.whole.iter())
            .filter(|(k, _)| k.slot() == 0)
            .map(|(k, v)| (k, *v))
    }

    pub fn keys(&self) -> impl Iterator<Item = &K> + '_ {
        self.whole.keys().chain(self.slots.keys())
    }

    pub fn values(&self) -> impl Iterator<Item = ServiceValue> + '_ {
        self.iter().map(|(_, v)| v)
    }
}

impl<'a, K: SlotKey> IntoIterator for &'a ServiceEntries<K> {
    type Item = (&'a K, ServiceValue);
    type IntoIter = Box<dyn Iterator<Item = (&'a K, ServiceValue)> + 'a>;
    fn into_iter(self) -> Self::IntoIter {
        Box::new(self.iter())
    }
}

impl<K: SlotKey> FromIterator<(K, ServiceValue)> for ServiceEntries<K> {
    fn from_iter<I: IntoIterator<Item = (K, ServiceValue)>>(iter: I) -> Self {
        let mut out = Self::default();
        out.extend(iter);
        out
    }
}

impl<K: SlotKey> Extend<(K, ServiceValue)> for ServiceEntries<K> {
    fn extend<I: IntoIterator<Item = (K, ServiceValue)>>(&mut self, iter: I) {
        for (k, v) in iter {
            self.insert(k, v);
        }
    }
}

/// Ids below this are kept in a vector by id (the agent hands out the smallest free ids, so
/// they are dense from 1: 9 bytes an entry instead of a hash map's 13 at ~50 % load); larger
/// ones (from maps another writer filled) in a map.
const DENSE_BACKEND_IDS: u32 = 1 << 21;

/// `BACKENDS` as the shadow holds it: backend id → value, as a vector by id (see
/// [`DENSE_BACKEND_IDS`]). Same contents, same equality as a map from id to value.
#[derive(Clone, Debug)]
pub struct BackendEntries<B: BackendValue = Backend> {
    dense: Vec<Option<B>>,
    sparse: HashMap<u32, B>,
    len: usize,
}

impl<B: BackendValue> Default for BackendEntries<B> {
    fn default() -> Self {
        Self {
            dense: Vec::new(),
            sparse: HashMap::default(),
            len: 0,
        }
    }
}

impl<B: BackendValue> BackendEntries<B> {
    pub fn get(&self, id: &u32) -> Option<&B> {
        if *id < DENSE_BACKEND_IDS {
            self.dense.get(*id as usize)?.as_ref()
        } else {
            self.sparse.get(id)
        }
    }

    pub fn contains_key(&self, id: &u32) -> bool {
        self.get(id).is_some()
    }

    /// Sets backend `id`; the value it had.
    pub fn insert(&mut self, id: u32, backend: B) -> Option<B> {
        let old = if id < DENSE_BACKEND_IDS {
            let i = id as usize;
            if self.dense.len() <= i {
                self.dense.resize(i + 1, None);
            }
            self.dense[i].replace(backend)
        } else {
            self.sparse.insert(id, backend)
        };
        self.len += usize::from(old.is_none());
        old
    }

    pub fn remove(&mut self, id: &u32) -> Option<B> {
        let old = if *id < DENSE_BACKEND_IDS {
            self.dense.get_mut(*id as usize)?.take()
        } else {
            self.sparse.remove(id)
        };
        self.len -= usize::from(old.is_some());
        // Ids are handed out from the smallest: the vector's tail empties only when the
        // programmed set shrinks, so give the empty tail back then.
        while self.dense.last().is_some_and(Option::is_none) {
            self.dense.pop();
        }
        old
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Room for `n` more backends (ids are dense from 1: about `n` more ids; index 0 is id 0),
    /// and a quarter more when it grows: an exact fit would be copied whole (4.5 MB at 500,000
    /// backends, ms) by the next sync that adds one endpoint. Capacity never written is address
    /// space, not memory.
    pub fn reserve(&mut self, n: usize) {
        let want = (self.len + n + 1).min(DENSE_BACKEND_IDS as usize);
        if want > self.dense.capacity() {
            let roomy = (want + want / 4).min(DENSE_BACKEND_IDS as usize);
            self.dense.reserve_exact(roomy - self.dense.len());
        }
    }

    /// Every backend by id, in no particular order.
    pub fn iter(&self) -> impl Iterator<Item = (u32, &B)> + '_ {
        let dense = (0u32..).zip(&self.dense);
        (dense.filter_map(|(id, b)| Some((id, b.as_ref()?))))
            .chain(self.sparse.iter().map(|(id, b)| (*id, b)))
    }

    pub fn ids(&self) -> impl Iterator<Item = u32> + '_ {
        self.iter().map(|(id, _)| id)
    }

    pub fn values(&self) -> impl Iterator<Item = &B> + '_ {
        self.iter().map(|(_, b)| b)
    }
}

/// Equal when they hold the same backends (however long the vectors grew).
impl<B: BackendValue> PartialEq for BackendEntries<B> {
    fn eq(&self, other: &Self) -> bool {
        self.len == other.len && self.iter().all(|(id, b)| other.get(&id) == Some(b))
    }
}

impl<B: BackendValue> Eq for BackendEntries<B> {}

impl<B: BackendValue> FromIterator<(u32, B)> for BackendEntries<B> {
    fn from_iter<I: IntoIterator<Item = (u32, B)>>(iter: I) -> Self {
        let mut out = Self::default();
        for (id, b) in iter {
            out.insert(id, b);
        }
        out
    }
}

impl<B: BackendValue> std::ops::Index<&u32> for BackendEntries<B> {
    type Output = B;
    fn index(&self, id: &u32) -> &B {
        self.get(id).expect("no such backend")
    }
}

/// Map capacities the plan must respect (entries), and the Maglev table size it builds with.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Capacities {
    pub services: u32,
    pub backends: u32,
    pub rev_nats: u32,
    /// `MAGLEV_V1` chunks.
    pub maglev_chunks: u32,
    /// M of every Maglev table (`DatapathConfig::maglev_table_size`).
    pub maglev_table_size: u32,
}

impl Capacities {
    /// The IPv6 maps' capacities (`SERVICES6_V1` ...; Maglev tables share `MAGLEV_V1`).
    pub fn ipv6(maglev_chunks: u32, maglev_table_size: u32) -> Self {
        use proxy_common::ipv6;
        Self {
            services: ipv6::SERVICES6_CAPACITY,
            backends: ipv6::BACKENDS6_CAPACITY,
            rev_nats: ipv6::REVNAT6_CAPACITY,
            maglev_chunks,
            maglev_table_size,
        }
    }
}

impl Default for Capacities {
    fn default() -> Self {
        Self {
            services: proxy_common::SERVICES_CAPACITY,
            backends: proxy_common::BACKENDS_CAPACITY,
            rev_nats: proxy_common::REVNAT_CAPACITY,
            maglev_chunks: proxy_common::MAGLEV_CAPACITY,
            maglev_table_size: proxy_common::maglev::DEFAULT_TABLE_SIZE,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(slot: u16) -> ServiceKey {
        ServiceKey::new(
            [10, 0, 0, 1],
            80u16.to_be_bytes(),
            proxy_common::proto::TCP,
            slot,
        )
    }

    /// Whatever the representation, the entries behave as one map from key to value: plain slots
    /// (kept as the backend id) and any other value (kept whole) read back exactly, a key
    /// rewritten from one kind to the other is in one place only, and equal contents compare
    /// equal whichever order they were written in.
    #[test]
    fn service_entries_are_one_map() {
        let frontend = ServiceValue::frontend(2, 7);
        let odd_slot = ServiceValue {
            rev_nat_id: 9,
            ..ServiceValue::slot(5)
        };
        let mut a = ServiceEntries::default();
        assert_eq!(a.insert(key(0), frontend), None);
        assert_eq!(a.insert(key(1), ServiceValue::slot(4)), None);
        assert_eq!(a.insert(key(2), odd_slot), None);
        assert_eq!(a.len(), 3);
        assert_eq!(a.get(&key(0)), Some(frontend));
        assert_eq!(a.get(&key(1)), Some(ServiceValue::slot(4)));
        assert_eq!(a.get(&key(2)), Some(odd_slot));
        assert_eq!(a.get(&key(3)), None);
        assert!(a.contains_key(&key(2)) && !a.contains_key(&key(3)));
        assert_eq!(a.frontends().collect::<Vec<_>>(), vec![(&key(0), frontend)]);

        // Plain → odd → plain: one entry each time, the last value read back.
        assert_eq!(a.insert(key(1), odd_slot), Some(ServiceValue::slot(4)));
        assert_eq!((a.len(), a.get(&key(1))), (3, Some(odd_slot)));
        assert_eq!(a.insert(key(1), ServiceValue::slot(6)), Some(odd_slot));
        assert_eq!((a.len(), a.get(&key(1))), (3, Some(ServiceValue::slot(6))));
        // A slot-0 entry that looks like a plain slot stays a frontend.
        let mut b = a.clone();
        b.insert(key(0), ServiceValue::slot(3));
        assert_eq!(b.frontends().count(), 1);

        let mut iterated: Vec<_> = a.iter().map(|(k, v)| (*k, v)).collect();
        iterated.sort_by_key(|(k, _)| k.slot);
        assert_eq!(
            iterated,
            vec![
                (key(0), frontend),
                (key(1), ServiceValue::slot(6)),
                (key(2), odd_slot)
            ]
        );
        let reversed: ServiceEntries = iterated.iter().rev().copied().collect();
        assert_eq!(reversed, a);

        assert_eq!(a.remove(&key(1)), Some(ServiceValue::slot(6)));
        assert_eq!(a.remove(&key(2)), Some(odd_slot));
        assert_eq!(a.remove(&key(2)), None);
        assert_eq!(a.len(), 1);
        assert_ne!(reversed, a);
    }
}
