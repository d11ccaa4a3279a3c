//! Loads the embedded eBPF object. Maps are pinned by name under the pin directory: an existing
//! pin is adopted (same kernel map, contents kept), a missing one is created and pinned.

use aya::{Ebpf, EbpfLoader, maps::Array, programs::SchedClassifier};
use proxy_common::{
    ALL_MAPS, BACKENDS_CAPACITY, CONFIG_GLOBAL, CONNTRACK_CAPACITY, COUNTER_COUNT, DatapathConfig,
    MAP_BACKENDS, MAP_CONNTRACK, MAP_REVNAT, MAP_SEED, MAP_SERVICES, MAP_STATS, PROG_TC_EGRESS,
    PROG_TC_INGRESS, REVNAT_CAPACITY, SERVICES_CAPACITY, SOCK_LB_GLOBAL, SockLbConfig,
};

use super::{Error, Result, bpffs::PinLayout};
use crate::{ebpf_object::EBPF_OBJECT, programmed::Capacities};

/// Map sizes used when the maps are first created (adopted maps keep their size).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MapSizes {
    pub services: u32,
    pub backends: u32,
    pub rev_nats: u32,
    pub conntrack: u32,
}

impl Default for MapSizes {
    fn default() -> Self {
        Self {
            services: SERVICES_CAPACITY,
            backends: BACKENDS_CAPACITY,
            rev_nats: REVNAT_CAPACITY,
            conntrack: CONNTRACK_CAPACITY,
        }
    }
}

impl MapSizes {
    pub fn capacities(&self) -> Capacities {
        Capacities {
            services: self.services,
            backends: self.backends,
            rev_nats: self.rev_nats,
        }
    }
}

/// Loads the object with its maps pinned (or adopted) under `pins`, and loads (verifies) every
/// program. Nothing is attached yet. `config.hash_seed` (from [`node_seed`]) is recorded in the
/// pinned `SEED_V1` for the next agent.
pub fn load_pinned(
    pins: &PinLayout,
    config: &DatapathConfig,
    sizes: &MapSizes,
    sock_lb: &SockLbConfig,
) -> Result<Ebpf> {
    pins.create()?;
    replace_outgrown_stats(pins);
    let paths: Vec<(&'static str, std::path::PathBuf)> =
        ALL_MAPS.iter().map(|&m| (m, pins.map(m))).collect();
    let mut loader = EbpfLoader::new();
    loader
        .override_global(CONFIG_GLOBAL, config, true)
        .override_global(SOCK_LB_GLOBAL, sock_lb, true);
    for (name, path) in &paths {
        loader.map_pin_path(name, path.as_path());
    }
    loader
        .map_max_entries(MAP_SERVICES, sizes.services)
        .map_max_entries(MAP_BACKENDS, sizes.backends)
        .map_max_entries(MAP_REVNAT, sizes.rev_nats)
        .map_max_entries(MAP_CONNTRACK, sizes.conntrack);
    let mut ebpf = loader.load(EBPF_OBJECT)?;
    load_programs(&mut ebpf)?;
    let map_err = |source| Error::Map {
        name: MAP_SEED,
        source,
    };
    let mut seed: Array<_, u32> =
        Array::try_from(ebpf.map_mut(MAP_SEED).ok_or(Error::Missing {
            what: "map",
            name: MAP_SEED,
        })?)
        .map_err(map_err)?;
    seed.set(0, config.hash_seed, 0).map_err(map_err)?;
    Ok(ebpf)
}

/// The node's flow hash seed: the one an earlier agent pinned in `SEED_V1`, else a fresh random
/// nonzero one (which [`load_pinned`] then pins). Kept across restarts rather than drawn anew:
/// conntrack keeps every flow's backend anyway, but a flow whose entry was evicted (LRU) is
/// hashed again, and the same seed sends it where it went before while the backend set is
/// unchanged. Per node, not per cluster: nodes pick
/// independently already (their backend slots are their own).
pub fn node_seed(pins: &PinLayout) -> Result<u32> {
    if let Some(seed) = pinned_seed(pins) {
        return Ok(seed);
    }
    let io_err = |source| Error::Io {
        what: "reading /dev/urandom for the flow hash seed".into(),
        source,
    };
    let mut bytes = [0u8; 4];
    std::fs::File::open("/dev/urandom")
        .and_then(|mut f| std::io::Read::read_exact(&mut f, &mut bytes))
        .map_err(io_err)?;
    // 0 is the unseeded default (tests); one value in 2^32 is not worth a second draw.
    Ok(u32::from_ne_bytes(bytes).max(1))
}

/// The seed in a pinned `SEED_V1`, when there is one holding a nonzero seed.
fn pinned_seed(pins: &PinLayout) -> Option<u32> {
    let data = aya::maps::MapData::from_pin(pins.map(MAP_SEED)).ok()?;
    let map: Array<_, u32> = Array::try_from(aya::maps::Map::Array(data)).ok()?;
    map.get(&0, 0).ok().filter(|&s| s != 0)
}

/// A pinned STATS array from an older agent with fewer counters than this one is unpinned, so
/// the load creates one with room for every counter (the adopted one would silently drop the new
/// counters). Counters restart from zero then; nothing else is affected (the old programs keep
/// their map until their links get the new programs).
fn replace_outgrown_stats(pins: &PinLayout) {
    let path = pins.map(MAP_STATS);
    let Ok(map) = aya::maps::MapData::from_pin(&path) else {
        return;
    };
    let Ok(entries) = map.info().map(|i| i.max_entries()) else {
        return;
    };
    if entries < COUNTER_COUNT {
        tracing::info!(
            pinned = entries,
            counters = COUNTER_COUNT,
            "pinned {MAP_STATS} has fewer counters than this agent: replacing it (counters restart)"
        );
        if let Err(e) = std::fs::remove_file(&path) {
            tracing::warn!(path = %path.display(), "cannot unpin the old stats map: {e}");
        }
    }
}

/// Loads the object without pins (fresh private maps): for tests and benchmarks.
pub fn load_unpinned(config: &DatapathConfig) -> Result<Ebpf> {
    let mut ebpf = EbpfLoader::new()
        .override_global(CONFIG_GLOBAL, config, true)
        .load(EBPF_OBJECT)?;
    load_programs(&mut ebpf)?;
    Ok(ebpf)
}

/// Loads (verifies) the tc programs and the socket hooks of an opened object. The socket hooks
/// stay inert (netns cookie 0) unless `SOCK_LB_GLOBAL` was set before loading.
pub fn load_programs(ebpf: &mut Ebpf) -> Result<()> {
    for name in [PROG_TC_INGRESS, PROG_TC_EGRESS] {
        program_mut(ebpf, name)?
            .load()
            .map_err(|source| Error::Program { name, source })?;
    }
    for hook in super::sock_lb::SockHook::ALL {
        let name = hook.program();
        sock_program_mut(ebpf, name)?
            .load()
            .map_err(|source| Error::Program { name, source })?;
    }
    Ok(())
}

/// One of our tc programs.
pub fn program_mut<'a>(ebpf: &'a mut Ebpf, name: &'static str) -> Result<&'a mut SchedClassifier> {
    typed_program_mut(ebpf, name)
}

/// One of our cgroup socket hooks.
pub fn sock_program_mut<'a>(
    ebpf: &'a mut Ebpf,
    name: &'static str,
) -> Result<&'a mut aya::programs::CgroupSockAddr> {
    typed_program_mut(ebpf, name)
}

fn typed_program_mut<'a, P>(ebpf: &'a mut Ebpf, name: &'static str) -> Result<&'a mut P>
where
    &'a mut P: TryFrom<&'a mut aya::programs::Program, Error = aya::programs::ProgramError>,
{
    let prog = ebpf.program_mut(name).ok_or(Error::Missing {
        what: "program",
        name,
    })?;
    prog.try_into()
        .map_err(|source| Error::Program { name, source })
}
