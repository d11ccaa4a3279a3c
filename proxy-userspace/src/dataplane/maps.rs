//! The map layer: the only place that reads and writes the service maps from userspace. It
//! carries out `MapOp`s, reads the maps back into a `Programmed` shadow (adoption at start-up),
//! and reads conntrack and stats for `dump`, metrics and garbage collection. The service maps
//! are per family ([`ServiceMaps`] over IPv4's `SERVICES_V1` ... or IPv6's `SERVICES6_V1` ...),
//! with the one `MAGLEV_V1` shared.

use std::{
    net::{Ipv4Addr, Ipv6Addr},
    os::fd::AsFd as _,
    path::Path,
};

use aya::maps::{
    Array, HashMap, IterableMap as _, Map, MapData, PerCpuArray,
    lpm_trie::{Key as LpmKey, LpmTrie},
};
use proxy_common::{
    AffinityKey, AffinityValue, COUNTER_COUNT, CtKey, CtValue, FragKey, FragValue, MAP_AFFINITY,
    MAP_CONNTRACK, MAP_FRAGMENTS, MAP_LC_ADJUST, MAP_LC_FLOWS, MAP_MAGLEV, MAP_NODE, MAP_SNAT,
    MAP_SNAT_DEVICES, MAP_STATS, NodeInfo, ServiceValue, SnatDevice, SnatKey, SnatValue,
    ipv6::{self, MAP_CLUSTER_CIDRS6},
    maglev::{Chunk, MaglevKey},
};

use super::{Error, Result, batch, bpffs::PinLayout, lc_counts::Tracked};
use crate::pipeline::{
    encode::{FamilyAbi, SlotKey as _},
    maglev::MaglevTable,
    model::Family as _,
    programmed::{MapOp, Programmed},
};

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

/// One family's SERVICES, BACKENDS, REVNAT and AFFMATCH, and MAGLEV (shared by the families:
/// table ids come from one space).
pub struct ServiceMaps<A: FamilyAbi = Ipv4Addr> {
    services: HashMap<MapData, A::ServiceKey, ServiceValue>,
    backends: HashMap<MapData, u32, A::Backend>,
    rev_nats: HashMap<MapData, u32, A::RevNat>,
    affinity_matches: HashMap<MapData, A::AffinityMatchKey, u32>,
    maglev: HashMap<MapData, MaglevKey, Chunk>,
}

/// The value of every `AFFMATCH_V1` entry (only the key's presence matters).
const AFFINITY_MATCH_VALUE: u32 = 1;

/// A hash map of a family, taken from a loaded object (`ebpf`) or opened from its pin.
fn family_map<K: aya::Pod, V: aya::Pod>(
    ebpf: Option<&mut aya::Ebpf>,
    pins: Option<&PinLayout>,
    name: &'static str,
) -> Result<HashMap<MapData, K, V>> {
    let map = match (ebpf, pins) {
        (Some(ebpf), _) => take(ebpf, name)?,
        (None, Some(pins)) => Map::HashMap(open_pinned(pins, name)?),
        (None, None) => return Err(Error::Missing { what: "map", name }),
    };
    HashMap::try_from(map).map_err(map_err(name))
}

impl ServiceMaps {
    /// Takes the IPv4 maps out of a loaded object.
    pub fn from_ebpf(ebpf: &mut aya::Ebpf) -> Result<Self> {
        let maglev = family_map(Some(&mut *ebpf), None, MAP_MAGLEV)?;
        Self::family(Some(ebpf), None, maglev)
    }

    /// Opens the pinned IPv4 maps (for `dump`, while an agent may be running).
    pub fn open_pinned(pins: &PinLayout) -> Result<Self> {
        let maglev = family_map(None, Some(pins), MAP_MAGLEV)?;
        Self::family(None, Some(pins), maglev)
    }

    /// The IPv6 family's maps of the same object (taken from `ebpf`, else opened from
    /// `pins`), sharing this one's `MAGLEV_V1`.
    pub fn ipv6(
        &self,
        ebpf: Option<&mut aya::Ebpf>,
        pins: Option<&PinLayout>,
    ) -> Result<ServiceMaps<Ipv6Addr>> {
        let fd = (self.maglev.map().fd().as_fd().try_clone_to_owned()).map_err(|e| {
            map_err(MAP_MAGLEV)(aya::maps::MapError::SyscallError(aya::sys::SyscallError {
                call: "dup",
                io_error: e,
            }))
        })?;
        let maglev = HashMap::try_from(Map::HashMap(
            MapData::from_fd(fd).map_err(map_err(MAP_MAGLEV))?,
        ))
        .map_err(map_err(MAP_MAGLEV))?;
        ServiceMaps::family(ebpf, pins, maglev)
    }
}

impl<A: FamilyAbi> ServiceMaps<A> {
    fn family(
        mut ebpf: Option<&mut aya::Ebpf>,
        pins: Option<&PinLayout>,
        maglev: HashMap<MapData, MaglevKey, Chunk>,
    ) -> Result<Self> {
        Ok(Self {
            services: family_map(ebpf.as_deref_mut(), pins, A::MAP_SERVICES)?,
            backends: family_map(ebpf.as_deref_mut(), pins, A::MAP_BACKENDS)?,
            rev_nats: family_map(ebpf.as_deref_mut(), pins, A::MAP_REVNAT)?,
            affinity_matches: family_map(ebpf, pins, A::MAP_AFFINITY_MATCH)?,
            maglev,
        })
    }

    /// Reads everything back. Entries that vanish while iterating are skipped. The families share
    /// `MAGLEV_V1`: IPv6 reads the tables its frontends name; IPv4 every other (leftovers
    /// named by no frontend included, so its plan deletes them) — see
    /// [`Self::read_programmed_excluding`].
    pub fn read_programmed(&self) -> Result<Programmed<A>> {
        self.read_programmed_excluding(&Default::default())
    }

    /// [`Self::read_programmed`], leaving out the Maglev tables in `other` (those the other
    /// family's frontends name).
    pub fn read_programmed_excluding(
        &self,
        other: &crate::pipeline::fast_hash::HashSet<u32>,
    ) -> Result<Programmed<A>> {
        let mut p = Programmed::default();
        for kv in self.services.iter() {
            let (k, v) = kv.map_err(map_err(A::MAP_SERVICES))?;
            // As the agent wrote it: the datapath's rr position is no difference to converge.
            p.services.insert(k, v.as_programmed());
        }
        for kv in self.backends.iter() {
            let (k, v) = kv.map_err(map_err(A::MAP_BACKENDS))?;
            p.backends.insert(k, v);
        }
        for kv in self.rev_nats.iter() {
            let (k, v) = kv.map_err(map_err(A::MAP_REVNAT))?;
            p.rev_nats.insert(k, v);
        }
        for k in self.affinity_matches.keys() {
            p.affinity_matches
                .insert(k.map_err(map_err(A::MAP_AFFINITY_MATCH))?);
        }
        // This family's tables: those its frontends name (the other family's are its own).
        let named: crate::pipeline::fast_hash::HashSet<u32> = (p.services.frontends())
            .map(|(_, v)| v.maglev_table)
            .collect();
        // Maglev tables: how many chunks each has; what they hold is checked by `adopt_maglev`.
        let mut chunks: crate::pipeline::fast_hash::HashMap<u32, u32> = Default::default();
        for k in self.maglev.keys() {
            let k = k.map_err(map_err(MAP_MAGLEV))?;
            let ours = if A::NAME == Ipv4Addr::NAME {
                !other.contains(&k.table)
            } else {
                named.contains(&k.table)
            };
            if !ours {
                continue;
            }
            let n = chunks.entry(k.table).or_default();
            *n = (*n).max(k.chunk + 1);
        }
        p.maglev = chunks
            .into_iter()
            .map(|(id, n)| (id, MaglevTable::unknown(n)))
            .collect();
        Ok(p)
    }

    /// Adoption of the Maglev tables read back by [`Self::read_programmed`]
    /// ([`Programmed::adopt_maglev`]).
    pub fn adopt_maglev(&self, p: &mut Programmed<A>, m: u32) {
        p.adopt_maglev(m, |k| self.maglev.get(k, 0).ok());
    }

    /// Kernel memory of `MAGLEV_V1` as the kernel accounts it (`memlock` in the map's fdinfo:
    /// for a map without preallocation, what its elements take now).
    pub fn maglev_memory(&self) -> Option<u64> {
        use std::os::fd::AsRawFd as _;
        let fd = self.maglev.map().fd().as_fd().as_raw_fd();
        let info = std::fs::read_to_string(format!("/proc/self/fdinfo/{fd}")).ok()?;
        info.lines()
            .find_map(|l| l.strip_prefix("memlock:"))
            .and_then(|v| v.trim().parse().ok())
    }

    /// One chunk of a Maglev table; `None` when it is missing.
    pub fn maglev_chunk(&self, key: &MaglevKey) -> Option<Chunk> {
        self.maglev.get(key, 0).ok()
    }

    /// Carries out one operation. Deleting an entry that is already gone is not an error.
    pub fn apply(&mut self, op: &MapOp<A>) -> Result<()> {
        let ignore_missing = |r: Result<(), aya::maps::MapError>, name| match r {
            Err(aya::maps::MapError::KeyNotFound) => Ok(()),
            Err(aya::maps::MapError::SyscallError(e))
                if e.io_error.kind() == std::io::ErrorKind::NotFound =>
            {
                Ok(())
            }
            r => r.map_err(map_err(name)),
        };
        match op {
            MapOp::PutBackend { id, backend } => self
                .backends
                .insert(id, backend, 0)
                .map_err(map_err(A::MAP_BACKENDS)),
            MapOp::PutRevNat { id, rev_nat } => self
                .rev_nats
                .insert(id, rev_nat, 0)
                .map_err(map_err(A::MAP_REVNAT)),
            MapOp::PutService { key, value } => self
                .services
                .insert(key, value, 0)
                .map_err(map_err(A::MAP_SERVICES)),
            MapOp::DeleteService { key } => {
                ignore_missing(self.services.remove(key), A::MAP_SERVICES)
            }
            MapOp::DeleteRevNat { id } => ignore_missing(self.rev_nats.remove(id), A::MAP_REVNAT),
            MapOp::DeleteBackend { id } => {
                ignore_missing(self.backends.remove(id), A::MAP_BACKENDS)
            }
            MapOp::PutAffinityMatch { key } => self
                .affinity_matches
                .insert(key, AFFINITY_MATCH_VALUE, 0)
                .map_err(map_err(A::MAP_AFFINITY_MATCH)),
            MapOp::DeleteAffinityMatch { key } => {
                ignore_missing(self.affinity_matches.remove(key), A::MAP_AFFINITY_MATCH)
            }
            MapOp::PutMaglevTable { id, table } => {
                // One batch call per table; chunk by chunk only to name a failure.
                let (k, v): (Vec<MaglevKey>, Vec<Chunk>) =
                    table.map_entries(*id).into_iter().unzip();
                if batch::update(self.maglev.map().fd().as_fd(), &k, &v)
                    .error
                    .is_none()
                {
                    return Ok(());
                }
                for (k, v) in k.iter().zip(&v) {
                    self.maglev.insert(k, v, 0).map_err(map_err(MAP_MAGLEV))?;
                }
                Ok(())
            }
            MapOp::DeleteMaglevTable { id, chunks } => {
                for chunk in 0..*chunks {
                    let key = MaglevKey { table: *id, chunk };
                    ignore_missing(self.maglev.remove(&key), MAP_MAGLEV)?;
                }
                Ok(())
            }
        }
    }

    /// Every affinity match entry (for `dump affinity`: which frontends an id serves).
    pub fn affinity_matches(&self) -> Vec<A::AffinityMatchKey> {
        self.affinity_matches
            .keys()
            .filter_map(|k| k.ok())
            .collect()
    }

    /// Every frontend entry and slot (for `dump affinity`).
    pub fn services(&self) -> Vec<(A::ServiceKey, ServiceValue)> {
        self.services.iter().filter_map(|kv| kv.ok()).collect()
    }

    /// The maps' real capacities (max_entries), which for adopted maps may differ from the flags.
    pub fn capacities(&self) -> Result<crate::pipeline::programmed::Capacities> {
        let max = |m: &MapData, name| m.info().map(|i| i.max_entries()).map_err(map_err(name));
        Ok(crate::pipeline::programmed::Capacities {
            services: max(self.services.map(), A::MAP_SERVICES)?,
            backends: max(self.backends.map(), A::MAP_BACKENDS)?,
            rev_nats: max(self.rev_nats.map(), A::MAP_REVNAT)?,
            maglev_chunks: max(self.maglev.map(), MAP_MAGLEV)?,
            ..Default::default()
        })
    }

    /// Carries out `ops` in order, batching each run of same-kind writes into one syscall
    /// (the plan's phases keep same-kind writes together, and order within a run does not
    /// matter). Returns how many ops took effect, and the error that stopped the rest.
    pub fn apply_all(&mut self, ops: &[MapOp<A>]) -> (usize, Option<Error>) {
        let mut done = 0;
        while done < ops.len() {
            let run = run_len(&ops[done..]);
            let (n, err) = self.apply_run(&ops[done..done + run]);
            done += n;
            if let Some(e) = err {
                return (done, Some(e));
            }
        }
        (done, None)
    }

    /// One run of same-kind ops. On a batch error, finishes the run one op at a time so a
    /// missing key on delete is tolerated and a real failure names its op.
    fn apply_run(&mut self, run: &[MapOp<A>]) -> (usize, Option<Error>) {
        // A run holds one variant only (see `run_len`), so each arm's pattern matches every op.
        macro_rules! puts {
            ($map:expr, $pat:pat => $kv:expr) => {{
                let (k, v): (Vec<_>, Vec<_>) = run
                    .iter()
                    .filter_map(|op| match *op {
                        $pat => Some($kv),
                        _ => None,
                    })
                    .unzip();
                batch::update_parallel($map.map().fd().as_fd(), &k, &v)
            }};
        }
        macro_rules! deletes {
            ($map:expr, $pat:pat => $k:expr) => {{
                let k: Vec<_> = run
                    .iter()
                    .filter_map(|op| match *op {
                        $pat => Some($k),
                        _ => None,
                    })
                    .collect();
                batch::delete($map.map().fd().as_fd(), &k)
            }};
        }
        let outcome = match run[0] {
            MapOp::PutBackend { .. } => {
                puts!(self.backends, MapOp::PutBackend { id, backend } => (id, backend))
            }
            MapOp::PutRevNat { .. } => {
                puts!(self.rev_nats, MapOp::PutRevNat { id, rev_nat } => (id, rev_nat))
            }
            MapOp::PutService { .. } => self.put_services(run),
            MapOp::DeleteService { .. } => {
                deletes!(self.services, MapOp::DeleteService { key } => key)
            }
            MapOp::DeleteRevNat { .. } => deletes!(self.rev_nats, MapOp::DeleteRevNat { id } => id),
            MapOp::DeleteBackend { .. } => {
                deletes!(self.backends, MapOp::DeleteBackend { id } => id)
            }
            MapOp::PutAffinityMatch { .. } => {
                puts!(self.affinity_matches, MapOp::PutAffinityMatch { key } => (key, AFFINITY_MATCH_VALUE))
            }
            MapOp::DeleteAffinityMatch { .. } => {
                deletes!(self.affinity_matches, MapOp::DeleteAffinityMatch { key } => key)
            }
            MapOp::PutMaglevTable { .. } => return self.put_maglev_tables(run),
            MapOp::DeleteMaglevTable { .. } => return self.apply_singly(run),
        };
        if outcome.error.is_none() {
            return (run.len(), None);
        }
        // Finish the rest singly: tolerates missing keys, pinpoints a real failure.
        let mut done = outcome.done.min(run.len());
        for op in &run[done..] {
            if let Err(e) = self.apply(op) {
                return (done, Some(e));
            }
            done += 1;
        }
        (done, None)
    }

    /// A run of Maglev table writes. Building a table (~0.3 ms at M = 16381) costs more than
    /// writing it, so a first sync's thousands are built on all CPUs, a bounded group at a time
    /// (the built chunks of a group are held at once), and written in order, one batch call each.
    fn put_maglev_tables(&mut self, run: &[MapOp<A>]) -> (usize, Option<Error>) {
        const GROUP: usize = 256;
        let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
        let mut done = 0;
        for group in run.chunks(GROUP) {
            let per = group.len().div_ceil(threads);
            let built: Vec<Vec<(MaglevKey, Chunk)>> = std::thread::scope(|s| {
                let parts: Vec<_> = group
                    .chunks(per)
                    .map(|part| {
                        s.spawn(move || {
                            part.iter()
                                .map(|op| match op {
                                    MapOp::PutMaglevTable { id, table } => table.map_entries(*id),
                                    _ => Vec::new(),
                                })
                                .collect::<Vec<_>>()
                        })
                    })
                    .collect();
                parts
                    .into_iter()
                    .flat_map(|h| h.join().unwrap_or_default())
                    .collect()
            });
            for (op, entries) in group.iter().zip(&built) {
                let (k, v): (Vec<MaglevKey>, Vec<Chunk>) = entries.iter().copied().unzip();
                let written = built.len() == group.len()
                    && batch::update(self.maglev.map().fd().as_fd(), &k, &v)
                        .error
                        .is_none();
                if !written && let Err(e) = self.apply(op) {
                    return (done, Some(e));
                }
                done += 1;
            }
        }
        (done, None)
    }

    /// Ops one at a time (a Maglev table op is already a run of chunk writes).
    fn apply_singly(&mut self, run: &[MapOp<A>]) -> (usize, Option<Error>) {
        for (done, op) in run.iter().enumerate() {
            if let Err(e) = self.apply(op) {
                return (done, Some(e));
            }
        }
        (run.len(), None)
    }

    /// A run of SERVICES writes. A full plan writes every slot (phase 2) before every frontend
    /// (phase 3); then each part is written in parallel, slots first, so no frontend is ever
    /// visible before its slots. Any other shape is written in order by one batch call.
    fn put_services(&self, run: &[MapOp<A>]) -> batch::BatchOutcome {
        let (k, v): (Vec<A::ServiceKey>, Vec<ServiceValue>) = run
            .iter()
            .filter_map(|op| match *op {
                MapOp::PutService { key, value } => Some((key, value)),
                _ => None,
            })
            .unzip();
        let fd = self.services.map().fd().as_fd();
        let slots = k.iter().take_while(|key| key.slot() != 0).count();
        if !k[slots..].iter().all(|key| key.slot() == 0) {
            return batch::update(fd, &k, &v);
        }
        let first = batch::update_parallel(fd, &k[..slots], &v[..slots]);
        if first.error.is_some() {
            return first;
        }
        let second = batch::update_parallel(fd, &k[slots..], &v[slots..]);
        batch::BatchOutcome {
            done: slots + second.done,
            error: second.error,
        }
    }

    /// Backend by id (for conntrack garbage collection).
    pub fn backend(&self, id: u32) -> Option<A::Backend> {
        self.backends.get(&id, 0).ok()
    }
}

/// Remove a conntrack entry only if it still holds the flow `listed` was read from (same
/// creation and last-seen times): between a walk's listing and its removal the datapath may have
/// given the key to a new flow (a reopened tuple, a reused reply tuple) or seen a packet of this
/// one, and a blind removal would drop a live flow's entry. Was it removed? (A packet in the
/// microseconds between this read and the removal is the window left.)
fn remove_flow_if_unchanged<K: aya::Pod, V: aya::Pod + Tracked>(
    map: &mut HashMap<MapData, K, V>,
    key: &K,
    listed: &V,
) -> bool {
    let stamps = |v: &V| {
        let f = v.facts();
        (f.created_ns, f.last_seen_ns)
    };
    match map.get(key, 0) {
        Ok(now) if stamps(&now) == stamps(listed) => map.remove(key).is_ok(),
        _ => false,
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

    /// Remove `key` only if it still holds the flow `listed` was read from: see
    /// [`remove_flow_if_unchanged`]. Was it removed?
    pub fn remove_if_unchanged(&mut self, key: &CtKey, listed: &CtValue) -> bool {
        remove_flow_if_unchanged(&mut self.map, key, listed)
    }
}

/// `CONNTRACK6_V1` (LRU): the IPv6 flows, walked with the IPv4 ones (`flow_gc`), read for
/// `dump conntrack`. (Paths spelled out: the IPv6 map wrappers live beside the IPv4 ones.)
pub struct Conntrack6 {
    map: HashMap<MapData, ipv6::Ct6Key, ipv6::Ct6Value>,
}

impl Conntrack6 {
    pub fn from_ebpf(ebpf: &mut aya::Ebpf) -> Result<Self> {
        Ok(Self {
            map: HashMap::try_from(take(ebpf, ipv6::MAP_CONNTRACK6)?)
                .map_err(map_err(ipv6::MAP_CONNTRACK6))?,
        })
    }

    pub fn open_pinned(pins: &PinLayout) -> Result<Self> {
        Ok(Self {
            map: HashMap::try_from(Map::LruHashMap(open_pinned(pins, ipv6::MAP_CONNTRACK6)?))
                .map_err(map_err(ipv6::MAP_CONNTRACK6))?,
        })
    }

    /// All entries (a racing LRU eviction just drops an entry from the listing).
    pub fn entries(&self) -> Vec<(ipv6::Ct6Key, ipv6::Ct6Value)> {
        self.map.iter().filter_map(Result::ok).collect()
    }

    pub fn remove(&mut self, key: &ipv6::Ct6Key) {
        let _ = self.map.remove(key);
    }

    /// Remove `key` only if it still holds the flow `listed` was read from: see
    /// [`remove_flow_if_unchanged`]. Was it removed?
    pub fn remove_if_unchanged(&mut self, key: &ipv6::Ct6Key, listed: &ipv6::Ct6Value) -> bool {
        remove_flow_if_unchanged(&mut self.map, key, listed)
    }
}

/// What `dump` shows of the IPv6 Services: `SERVICES6_V1`, `BACKENDS6_V1` and `AFFINITY6_V1`,
/// read whole (the agent's IPv6 programming has its own writer).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Ipv6Tables {
    pub services: std::collections::BTreeMap<ipv6::Service6Key, ServiceValue>,
    pub backends: std::collections::BTreeMap<u32, ipv6::Backend6>,
    pub affinity: Vec<(ipv6::Affinity6Key, AffinityValue)>,
}

impl Ipv6Tables {
    /// Reads the pinned IPv6 maps (maps pinned by an agent without them: empty tables).
    pub fn read_pinned(pins: &PinLayout) -> Result<Self> {
        if !pins.map(ipv6::MAP_SERVICES6).exists() {
            return Ok(Self::default());
        }
        let services: HashMap<MapData, ipv6::Service6Key, ServiceValue> =
            HashMap::try_from(Map::HashMap(open_pinned(pins, ipv6::MAP_SERVICES6)?))
                .map_err(map_err(ipv6::MAP_SERVICES6))?;
        let backends: HashMap<MapData, u32, ipv6::Backend6> =
            HashMap::try_from(Map::HashMap(open_pinned(pins, ipv6::MAP_BACKENDS6)?))
                .map_err(map_err(ipv6::MAP_BACKENDS6))?;
        let affinity: HashMap<MapData, ipv6::Affinity6Key, AffinityValue> =
            HashMap::try_from(Map::LruHashMap(open_pinned(pins, ipv6::MAP_AFFINITY6)?))
                .map_err(map_err(ipv6::MAP_AFFINITY6))?;
        Ok(Self {
            services: services.iter().filter_map(Result::ok).collect(),
            backends: backends.iter().filter_map(Result::ok).collect(),
            affinity: affinity.iter().filter_map(Result::ok).collect(),
        })
    }
}

/// `SNAT_V1` (LRU): read for `dump snat`, swept by the agent's SNAT garbage collection.
pub struct Snat {
    map: HashMap<MapData, SnatKey, SnatValue>,
}

impl Snat {
    pub fn from_ebpf(ebpf: &mut aya::Ebpf) -> Result<Self> {
        Ok(Self {
            map: HashMap::try_from(take(ebpf, MAP_SNAT)?).map_err(map_err(MAP_SNAT))?,
        })
    }

    pub fn open_pinned(pins: &PinLayout) -> Result<Self> {
        Ok(Self {
            map: HashMap::try_from(Map::LruHashMap(open_pinned(pins, MAP_SNAT)?))
                .map_err(map_err(MAP_SNAT))?,
        })
    }

    /// All entries (a racing LRU eviction just drops an entry from the listing).
    pub fn entries(&self) -> Vec<(SnatKey, SnatValue)> {
        self.map.iter().filter_map(Result::ok).collect()
    }

    /// One entry as it is now (`None` if gone).
    pub fn get(&self, key: &SnatKey) -> Option<SnatValue> {
        self.map.get(key, 0).ok()
    }

    /// Writes one entry (tests and tools; the datapath allocates SNAT entries itself).
    pub fn insert(&mut self, key: &SnatKey, value: &SnatValue) -> Result<()> {
        self.map.insert(key, value, 0).map_err(map_err(MAP_SNAT))
    }

    /// Removes one entry (already gone is fine).
    pub fn remove(&mut self, key: &SnatKey) {
        let _ = self.map.remove(key);
    }
}

/// `SNAT6_V1` (LRU): the IPv6 SNAT entries, swept by the agent's SNAT garbage collection as
/// `SNAT_V1`.
pub struct Snat6 {
    map: HashMap<MapData, ipv6::Snat6Key, ipv6::Snat6Value>,
}

impl Snat6 {
    pub fn from_ebpf(ebpf: &mut aya::Ebpf) -> Result<Self> {
        Ok(Self {
            map: HashMap::try_from(take(ebpf, ipv6::MAP_SNAT6)?)
                .map_err(map_err(ipv6::MAP_SNAT6))?,
        })
    }

    /// All entries (a racing LRU eviction just drops an entry from the listing).
    pub fn entries(&self) -> Vec<(ipv6::Snat6Key, ipv6::Snat6Value)> {
        self.map.iter().filter_map(Result::ok).collect()
    }

    /// One entry as it is now (`None` if gone).
    pub fn get(&self, key: &ipv6::Snat6Key) -> Option<ipv6::Snat6Value> {
        self.map.get(key, 0).ok()
    }

    /// Writes one entry (tests and tools; the datapath allocates SNAT entries itself).
    pub fn insert(&mut self, key: &ipv6::Snat6Key, value: &ipv6::Snat6Value) -> Result<()> {
        self.map
            .insert(key, value, 0)
            .map_err(map_err(ipv6::MAP_SNAT6))
    }

    /// Removes one entry (already gone is fine).
    pub fn remove(&mut self, key: &ipv6::Snat6Key) {
        let _ = self.map.remove(key);
    }
}

/// `AFFINITY_V1` (LRU): session affinity records, read for `dump affinity` (the datapath
/// alone writes them; tests seed records).
pub struct Affinity {
    map: HashMap<MapData, AffinityKey, AffinityValue>,
}

impl Affinity {
    pub fn from_ebpf(ebpf: &mut aya::Ebpf) -> Result<Self> {
        Ok(Self {
            map: HashMap::try_from(take(ebpf, MAP_AFFINITY)?).map_err(map_err(MAP_AFFINITY))?,
        })
    }

    pub fn open_pinned(pins: &PinLayout) -> Result<Self> {
        Ok(Self {
            map: HashMap::try_from(Map::LruHashMap(open_pinned(pins, MAP_AFFINITY)?))
                .map_err(map_err(MAP_AFFINITY))?,
        })
    }

    /// Every record (entries that vanish while iterating are skipped).
    pub fn entries(&self) -> Vec<(AffinityKey, AffinityValue)> {
        self.map.iter().filter_map(|kv| kv.ok()).collect()
    }

    pub fn get(&self, key: &AffinityKey) -> Option<AffinityValue> {
        self.map.get(key, 0).ok()
    }

    pub fn insert(&mut self, key: &AffinityKey, value: &AffinityValue) -> Result<()> {
        self.map
            .insert(key, value, 0)
            .map_err(map_err(MAP_AFFINITY))
    }
}

/// `FRAGMENTS_V1` (LRU): read for `dump fragments` (the datapath alone writes it).
pub struct Fragments {
    map: HashMap<MapData, FragKey, FragValue>,
}

impl Fragments {
    pub fn open_pinned(pins: &PinLayout) -> Result<Self> {
        Ok(Self {
            map: HashMap::try_from(Map::LruHashMap(open_pinned(pins, MAP_FRAGMENTS)?))
                .map_err(map_err(MAP_FRAGMENTS))?,
        })
    }

    /// All entries (a racing LRU eviction just drops an entry from the listing).
    pub fn entries(&self) -> Vec<(FragKey, FragValue)> {
        self.map.iter().filter_map(Result::ok).collect()
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

/// `NODE6_V1`: the node's IPv6 SNAT address (`::` clears it: IPv6 flows that need SNAT then go
/// out unSNATed, counted as `snat_no_node_addr`).
pub struct Node6Map {
    map: Array<MapData, ipv6::Node6Info>,
}

impl Node6Map {
    pub fn from_ebpf(ebpf: &mut aya::Ebpf) -> Result<Self> {
        let name = ipv6::MAP_NODE6;
        Ok(Self {
            map: Array::try_from(take(ebpf, name)?).map_err(map_err(name))?,
        })
    }

    pub fn set(&mut self, addr: std::net::Ipv6Addr) -> Result<()> {
        let info = ipv6::Node6Info {
            snat_addr: addr.octets(),
        };
        self.map.set(0, info, 0).map_err(map_err(ipv6::MAP_NODE6))
    }
}

/// `CLUSTERCIDRS6_V1`: the cluster's IPv6 pod CIDRs, for the in-cluster entries of eTP=Local
/// frontends on IPv6 (what `DatapathConfig::cluster_cidrs` is for IPv4).
pub struct ClusterCidrs6Map {
    map: LpmTrie<MapData, [u8; 16], u32>,
}

impl ClusterCidrs6Map {
    pub fn from_ebpf(ebpf: &mut aya::Ebpf) -> Result<Self> {
        Ok(Self {
            map: LpmTrie::try_from(take(ebpf, MAP_CLUSTER_CIDRS6)?)
                .map_err(map_err(MAP_CLUSTER_CIDRS6))?,
        })
    }

    pub fn open_pinned(pins: &PinLayout) -> Result<Self> {
        Ok(Self {
            map: LpmTrie::try_from(Map::LpmTrie(open_pinned(pins, MAP_CLUSTER_CIDRS6)?))
                .map_err(map_err(MAP_CLUSTER_CIDRS6))?,
        })
    }

    /// Makes the map hold exactly `cidrs` (network address, prefix length): writes the missing
    /// ones, then removes the others. A prefix longer than 128 bits is refused before anything
    /// is written.
    pub fn sync(&mut self, cidrs: &[(std::net::Ipv6Addr, u8)]) -> Result<()> {
        if let Some((addr, len)) = cidrs.iter().find(|(_, len)| *len > 128) {
            return Err(Error::Io {
                what: format!("{MAP_CLUSTER_CIDRS6}: cluster CIDR {addr}/{len}"),
                source: std::io::Error::new(
                    std::io::ErrorKind::InvalidInput,
                    "an IPv6 prefix is at most 128 bits long",
                ),
            });
        }
        let wanted: std::collections::BTreeSet<(u32, [u8; 16])> = cidrs
            .iter()
            .map(|(addr, len)| {
                let bits =
                    u128::from(*addr) & (!0u128).checked_shl(128 - u32::from(*len)).unwrap_or(0);
                (u32::from(*len), bits.to_be_bytes())
            })
            .collect();
        for (len, data) in &wanted {
            self.map
                .insert(&LpmKey::new(*len, *data), 1, 0)
                .map_err(map_err(MAP_CLUSTER_CIDRS6))?;
        }
        let stale: Vec<LpmKey<[u8; 16]>> = self
            .map
            .keys()
            .filter_map(std::result::Result::ok)
            .filter(|k| !wanted.contains(&(k.prefix_len(), k.data())))
            .collect();
        for k in stale {
            self.map.remove(&k).map_err(map_err(MAP_CLUSTER_CIDRS6))?;
        }
        Ok(())
    }
}

/// `SNATDEV_V1`: ifindex → SNAT source address of flows leaving through that (tunnel) device.
pub struct SnatDeviceMap {
    map: HashMap<MapData, u32, SnatDevice>,
}

impl SnatDeviceMap {
    pub fn from_ebpf(ebpf: &mut aya::Ebpf) -> Result<Self> {
        Ok(Self {
            map: HashMap::try_from(take(ebpf, MAP_SNAT_DEVICES)?)
                .map_err(map_err(MAP_SNAT_DEVICES))?,
        })
    }

    /// Makes the map equal to `wanted` (ifindex → address): writes new and changed entries, then
    /// removes the others (an adopted map may hold entries of devices that are gone).
    pub fn sync(&mut self, wanted: &std::collections::BTreeMap<u32, [u8; 4]>) -> Result<()> {
        for (ifindex, addr) in wanted {
            let value = SnatDevice { addr: *addr };
            if self.map.get(ifindex, 0).ok() != Some(value) {
                self.map
                    .insert(ifindex, value, 0)
                    .map_err(map_err(MAP_SNAT_DEVICES))?;
            }
        }
        let stale: Vec<u32> = self
            .map
            .keys()
            .filter_map(std::result::Result::ok)
            .filter(|k| !wanted.contains_key(k))
            .collect();
        for k in stale {
            self.map.remove(&k).map_err(map_err(MAP_SNAT_DEVICES))?;
        }
        Ok(())
    }
}

/// The least-connection counts: `LCFLOWS_V1` (datapath-owned, read here) and `LCADJ_V1` (the
/// agent's corrections), see `crate::dataplane::lc_counts`.
pub struct LcCounts {
    flows: Array<MapData, u64>,
    adjust: Array<MapData, u64>,
}

impl LcCounts {
    pub fn from_ebpf(ebpf: &mut aya::Ebpf) -> Result<Self> {
        Ok(Self {
            flows: Array::try_from(take(ebpf, MAP_LC_FLOWS)?).map_err(map_err(MAP_LC_FLOWS))?,
            adjust: Array::try_from(take(ebpf, MAP_LC_ADJUST)?).map_err(map_err(MAP_LC_ADJUST))?,
        })
    }

    pub fn open_pinned(pins: &PinLayout) -> Result<Self> {
        Ok(Self {
            flows: Array::try_from(Map::Array(open_pinned(pins, MAP_LC_FLOWS)?))
                .map_err(map_err(MAP_LC_FLOWS))?,
            adjust: Array::try_from(Map::Array(open_pinned(pins, MAP_LC_ADJUST)?))
                .map_err(map_err(MAP_LC_ADJUST))?,
        })
    }

    /// Entries of the arrays: backend ids below this are counted.
    pub fn ids(&self) -> u32 {
        self.flows.len().min(self.adjust.len())
    }

    /// The datapath's raw count of backend `id` (0 outside the array).
    pub fn active(&self, id: u32) -> u64 {
        self.flows.get(&id, 0).unwrap_or(0)
    }

    /// The agent's correction of backend `id`.
    pub fn adjust(&self, id: u32) -> u64 {
        self.adjust.get(&id, 0).unwrap_or(0)
    }

    pub fn set_adjust(&mut self, id: u32, value: u64) -> Result<()> {
        self.adjust
            .set(id, value, 0)
            .map_err(map_err(MAP_LC_ADJUST))
    }

    /// The effective count of backend `id` (`proxy_common::lc::effective`).
    pub fn effective(&self, id: u32) -> u64 {
        proxy_common::lc::effective(self.active(id), self.adjust(id))
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

/// Removes every pinned map file and the layout marker (the kernel frees a map once no program or fd holds it).
pub fn unpin_all(pins: &PinLayout) -> std::io::Result<()> {
    for name in proxy_common::ALL_MAPS {
        remove_if_exists(&pins.map(name))?;
    }
    // The layout marker last: pins without it read as layout 1.
    remove_if_exists(&pins.map(proxy_common::MAP_LAYOUT))
}

pub(crate) fn remove_if_exists(path: &Path) -> std::io::Result<()> {
    match std::fs::remove_file(path) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        r => r,
    }
}

/// Length of the leading run of ops of the same kind (same map, same put/delete).
fn run_len<A: FamilyAbi>(ops: &[MapOp<A>]) -> usize {
    let kind = std::mem::discriminant(&ops[0]);
    ops.iter()
        .take_while(|op| std::mem::discriminant(*op) == kind)
        .count()
}
