//! The map layer: the only place that reads and writes the service maps from userspace. It
//! carries out `MapOp`s, reads the maps back into a `Programmed` shadow (adoption at start-up),
//! and reads conntrack and stats for `dump`, metrics and garbage collection.

use std::path::Path;

use aya::maps::{Array, HashMap, Map, MapData, PerCpuArray};
use proxy_common::{
    Backend, COUNTER_COUNT, CtKey, CtValue, MAP_BACKENDS, MAP_CONNTRACK, MAP_NODE, MAP_REVNAT,
    MAP_SERVICES, MAP_STATS, NodeInfo, RevNat, ServiceKey, ServiceValue,
};

use super::{Error, Result, bpffs::PinLayout};
use crate::programmed::{MapOp, Programmed};

fn map_err(name: &'static str) -> impl Fn(aya::maps::MapError) -> Error {
    move |source| Error::Map { name, source }
}

fn open_pinned(pins: &PinLayout, name: &'static str) -> Result<MapData> {
    MapData::from_pin(pins.map(name)).map_err(map_err(name))
}

fn take(ebpf: &mut aya::Ebpf, name: &'static str) -> Result<Map> {
    ebpf.take_map(name)
        .ok_or(Error::Missing { what: "map", name })
}

/// SERVICES, BACKENDS and REVNAT.
pub struct ServiceMaps {
    services: HashMap<MapData, ServiceKey, ServiceValue>,
    backends: HashMap<MapData, u32, Backend>,
    rev_nats: HashMap<MapData, u32, RevNat>,
}

impl ServiceMaps {
    /// Takes the maps out of a loaded object.
    pub fn from_ebpf(ebpf: &mut aya::Ebpf) -> Result<Self> {
        Ok(Self {
            services: HashMap::try_from(take(ebpf, MAP_SERVICES)?)
                .map_err(map_err(MAP_SERVICES))?,
            backends: HashMap::try_from(take(ebpf, MAP_BACKENDS)?)
                .map_err(map_err(MAP_BACKENDS))?,
            rev_nats: HashMap::try_from(take(ebpf, MAP_REVNAT)?).map_err(map_err(MAP_REVNAT))?,
        })
    }

    /// Opens the pinned maps (for `dump`, while an agent may be running).
    pub fn open_pinned(pins: &PinLayout) -> Result<Self> {
        Ok(Self {
            services: HashMap::try_from(Map::HashMap(open_pinned(pins, MAP_SERVICES)?))
                .map_err(map_err(MAP_SERVICES))?,
            backends: HashMap::try_from(Map::HashMap(open_pinned(pins, MAP_BACKENDS)?))
                .map_err(map_err(MAP_BACKENDS))?,
            rev_nats: HashMap::try_from(Map::HashMap(open_pinned(pins, MAP_REVNAT)?))
                .map_err(map_err(MAP_REVNAT))?,
        })
    }

    /// Reads everything back. Entries that vanish while iterating are skipped.
    pub fn read_programmed(&self) -> Result<Programmed> {
        let mut p = Programmed::default();
        for kv in self.services.iter() {
            let (k, v) = kv.map_err(map_err(MAP_SERVICES))?;
            p.services.insert(k, v);
        }
        for kv in self.backends.iter() {
            let (k, v) = kv.map_err(map_err(MAP_BACKENDS))?;
            p.backends.insert(k, v);
        }
        for kv in self.rev_nats.iter() {
            let (k, v) = kv.map_err(map_err(MAP_REVNAT))?;
            p.rev_nats.insert(k, v);
        }
        Ok(p)
    }

    /// Carries out one operation. Deleting an entry that is already gone is not an error.
    pub fn apply(&mut self, op: &MapOp) -> Result<()> {
        let ignore_missing = |r: Result<(), aya::maps::MapError>, name| match r {
            Err(aya::maps::MapError::KeyNotFound) => Ok(()),
            r => r.map_err(map_err(name)),
        };
        match op {
            MapOp::PutBackend { id, backend } => self
                .backends
                .insert(id, backend, 0)
                .map_err(map_err(MAP_BACKENDS)),
            MapOp::PutRevNat { id, rev_nat } => self
                .rev_nats
                .insert(id, rev_nat, 0)
                .map_err(map_err(MAP_REVNAT)),
            MapOp::PutService { key, value } => self
                .services
                .insert(key, value, 0)
                .map_err(map_err(MAP_SERVICES)),
            MapOp::DeleteService { key } => ignore_missing(self.services.remove(key), MAP_SERVICES),
            MapOp::DeleteRevNat { id } => ignore_missing(self.rev_nats.remove(id), MAP_REVNAT),
            MapOp::DeleteBackend { id } => ignore_missing(self.backends.remove(id), MAP_BACKENDS),
        }
    }

    /// Backend by id (for conntrack garbage collection).
    pub fn backend(&self, id: u32) -> Option<Backend> {
        self.backends.get(&id, 0).ok()
    }
}

/// The conntrack LRU map.
pub struct Conntrack {
    map: HashMap<MapData, CtKey, CtValue>,
}

impl Conntrack {
    pub fn from_ebpf(ebpf: &mut aya::Ebpf) -> Result<Self> {
        Ok(Self {
            map: HashMap::try_from(take(ebpf, MAP_CONNTRACK)?).map_err(map_err(MAP_CONNTRACK))?,
        })
    }

    pub fn open_pinned(pins: &PinLayout) -> Result<Self> {
        Ok(Self {
            map: HashMap::try_from(Map::LruHashMap(open_pinned(pins, MAP_CONNTRACK)?))
                .map_err(map_err(MAP_CONNTRACK))?,
        })
    }

    /// All entries (a racing LRU eviction just drops an entry from the listing).
    pub fn entries(&self) -> Vec<(CtKey, CtValue)> {
        self.map.iter().filter_map(Result::ok).collect()
    }

    pub fn remove(&mut self, key: &CtKey) {
        let _ = self.map.remove(key);
    }
}

/// `NODE_V1`: the node facts the datapath reads (the SNAT address).
pub struct NodeMap {
    map: Array<MapData, NodeInfo>,
}

impl NodeMap {
    pub fn from_ebpf(ebpf: &mut aya::Ebpf) -> Result<Self> {
        Ok(Self {
            map: Array::try_from(take(ebpf, MAP_NODE)?).map_err(map_err(MAP_NODE))?,
        })
    }

    pub fn write(&mut self, info: &NodeInfo) -> Result<()> {
        self.map.set(0, info, 0).map_err(map_err(MAP_NODE))
    }
}

/// The per-CPU stats array, summed over CPUs.
pub struct Stats {
    map: PerCpuArray<MapData, u64>,
}

impl Stats {
    pub fn from_ebpf(ebpf: &mut aya::Ebpf) -> Result<Self> {
        Ok(Self {
            map: PerCpuArray::try_from(take(ebpf, MAP_STATS)?).map_err(map_err(MAP_STATS))?,
        })
    }

    pub fn open_pinned(pins: &PinLayout) -> Result<Self> {
        Ok(Self {
            map: PerCpuArray::try_from(Map::PerCpuArray(open_pinned(pins, MAP_STATS)?))
                .map_err(map_err(MAP_STATS))?,
        })
    }

    /// Counter values indexed like `proxy_common::Counter::ALL`.
    pub fn read(&self) -> Result<Vec<u64>> {
        (0..COUNTER_COUNT)
            .map(|i| {
                let per_cpu = self.map.get(&i, 0).map_err(map_err(MAP_STATS))?;
                Ok(per_cpu.iter().sum())
            })
            .collect()
    }
}

/// Removes every pinned map file (the kernel frees a map once no program or fd holds it).
pub fn unpin_all(pins: &PinLayout) -> std::io::Result<()> {
    for name in proxy_common::ALL_MAPS {
        remove_if_exists(&pins.map(name))?;
    }
    Ok(())
}

pub(crate) fn remove_if_exists(path: &Path) -> std::io::Result<()> {
    match std::fs::remove_file(path) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        r => r,
    }
}
