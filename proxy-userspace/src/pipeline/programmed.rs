//! What the maps carry now (a shadow kept in memory), and the operations that change them.
//!
//! The shadow is rebuilt from the pinned maps when the agent starts (adoption), then kept equal to
//! the maps by applying every operation to both. `diff` compares it with the desired state; ids
//! are derived from it, so no other allocator state exists to drift.

use std::sync::Arc;

use proxy_common::{
    AffinityMatchKey, Backend, RevNat, ServiceKey, ServiceValue,
    maglev::{Chunk, MaglevKey},
};

use crate::pipeline::{
    encode,
    fast_hash::{HashMap, HashSet},
    maglev::MaglevTable,
};

/// One write to one map. `diff` emits them in an order that keeps the datapath consistent at
/// every step: backends → rev-NAT → Maglev tables → slots → frontends; shrinking in reverse.
/// Affinity match entries (`AFFMATCH_V1`) leave first (a record naming a backend on its way out
/// of a frontend stops matching before anything else changes) and come with the slots.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum MapOp {
    DeleteAffinityMatch {
        key: AffinityMatchKey,
    },
    PutBackend {
        id: u32,
        backend: Backend,
    },
    PutRevNat {
        id: u32,
        rev_nat: RevNat,
    },
    PutService {
        key: ServiceKey,
        value: ServiceValue,
    },
    PutAffinityMatch {
        key: AffinityMatchKey,
    },
    DeleteService {
        key: ServiceKey,
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
        table: Arc<MaglevTable>,
    },
    /// Delete the `chunks` chunks of Maglev table `id`.
    DeleteMaglevTable {
        id: u32,
        chunks: u32,
    },
}

/// The maps' contents as last written (or read back at start-up).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Programmed {
    pub services: HashMap<ServiceKey, ServiceValue>,
    pub backends: HashMap<u32, Backend>,
    pub rev_nats: HashMap<u32, RevNat>,
    /// `AFFMATCH_V1`: (affinity frontend, backend id in its slots).
    pub affinity_matches: HashSet<AffinityMatchKey>,
    /// Maglev table id → what it holds.
    pub maglev: HashMap<u32, Arc<MaglevTable>>,
}

impl Programmed {
    /// Adoption of the Maglev tables read back from the maps (all [`MaglevTable::unknown`]): a
    /// table that a frontend names and that holds exactly what this agent builds for that
    /// frontend's slots at size `m` (`read` gives a chunk as the map holds it) becomes known — kept
    /// and shared as if this agent had written it. Any other stays unknown, so the next plan
    /// replaces it (another `m`, a table cut short by a crash). Each named table is read once.
    pub fn adopt_maglev(&mut self, m: u32, read: impl Fn(&MaglevKey) -> Option<Chunk>) {
        let mut checked: HashSet<u32> = HashSet::default();
        let mut known = Vec::new();
        for (key, v) in &self.services {
            if key.slot != 0 || v.maglev_table == 0 || !checked.insert(v.maglev_table) {
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
    pub fn apply(&mut self, op: &MapOp) {
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
    pub fn reserve_for(&mut self, ops: &[MapOp]) {
        let (mut services, mut backends, mut rev_nats) = (0, 0, 0);
        for op in ops {
            match op {
                MapOp::PutService { .. } => services += 1,
                MapOp::PutBackend { .. } => backends += 1,
                MapOp::PutRevNat { .. } => rev_nats += 1,
                _ => {}
            }
        }
        self.services.reserve(services);
        self.backends.reserve(backends);
        self.rev_nats.reserve(rev_nats);
    }

    /// The affinity match entries of frontend `key` (slot 0) whose backend a programmed slot of
    /// it names (those a plan keeps in step with the slots), sorted.
    pub fn affinity_matches_of(&self, key: &ServiceKey) -> Vec<AffinityMatchKey> {
        let count = self.services.get(key).map_or(0, |v| v.count);
        let mut out: Vec<AffinityMatchKey> = (1..=count)
            .filter_map(|s| self.services.get(&key.with_slot(s)))
            .map(|v| AffinityMatchKey {
                frontend: *key,
                backend_id: v.backend_id,
            })
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
        self.services.keys().filter(|k| k.slot == 0).count()
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
