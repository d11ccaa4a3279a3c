//! Loads the embedded eBPF object. Maps are pinned by name under the pin directory: an existing
//! pin is adopted (same kernel map, contents kept), a missing one is created and pinned.

use aya::{Ebpf, EbpfLoader, programs::SchedClassifier};
use proxy_common::{
    ALL_MAPS, BACKENDS_CAPACITY, CONFIG_GLOBAL, CONNTRACK_CAPACITY, COUNTER_COUNT, DatapathConfig,
    MAP_BACKENDS, MAP_CONNTRACK, MAP_REVNAT, MAP_SERVICES, MAP_SNAT, MAP_STATS, MAP_TAIL_CALLS,
    PROG_TC_EGRESS, PROG_TC_INGRESS, REVNAT_CAPACITY, SERVICES_CAPACITY, SNAT_CAPACITY,
    SOCK_LB_GLOBAL, SockLbConfig, TAIL_CALLS,
};

use super::{Error, Result, bpffs::PinLayout};
use crate::{ebpf_object::EBPF_OBJECT, programmed::Capacities};

/// Map sizes used when the maps are first created (adopted maps keep their size: aya opens an
/// existing pin as it is). The agent derives the flow maps' from `conntrack.maxPerCore`
/// (`crate::sizing`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MapSizes {
    pub services: u32,
    pub backends: u32,
    pub rev_nats: u32,
    pub conntrack: u32,
    pub snat: u32,
}

impl Default for MapSizes {
    fn default() -> Self {
        Self {
            services: SERVICES_CAPACITY,
            backends: BACKENDS_CAPACITY,
            rev_nats: REVNAT_CAPACITY,
            conntrack: CONNTRACK_CAPACITY,
            snat: SNAT_CAPACITY,
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
/// program. Nothing is attached yet.
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
        .map_max_entries(MAP_CONNTRACK, sizes.conntrack)
        .map_max_entries(MAP_SNAT, sizes.snat);
    let mut ebpf = loader.load(EBPF_OBJECT)?;
    load_programs(&mut ebpf)?;
    Ok(ebpf)
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
    let tail_called = TAIL_CALLS.iter().map(|&(name, _)| name);
    for name in [PROG_TC_INGRESS, PROG_TC_EGRESS]
        .into_iter()
        .chain(tail_called)
    {
        program_mut(ebpf, name)?
            .load()
            .map_err(|source| Error::Program { name, source })?;
    }
    link_tail_calls(ebpf)?;
    for hook in super::sock_lb::SockHook::ALL {
        let name = hook.program();
        sock_program_mut(ebpf, name)?
            .load()
            .map_err(|source| Error::Program { name, source })?;
    }
    Ok(())
}

/// Puts the tail-called parts of ingress into this object's program array, where `tc_ingress`
/// and `tc_ingress_new` jump to them (until then packets that need them are dropped, counted as
/// `drop_tail_call`).
fn link_tail_calls(ebpf: &mut Ebpf) -> Result<()> {
    let mut fds = Vec::with_capacity(TAIL_CALLS.len());
    for (name, index) in TAIL_CALLS {
        let fd = program_mut(ebpf, name)?
            .fd()
            .map_err(|source| Error::Program { name, source })?
            .try_clone()
            .map_err(|source| Error::Io {
                what: format!("duplicating the fd of program {name}"),
                source,
            })?;
        fds.push((index, fd));
    }
    let map = ebpf.map_mut(MAP_TAIL_CALLS).ok_or(Error::Missing {
        what: "map",
        name: MAP_TAIL_CALLS,
    })?;
    let mut array = aya::maps::ProgramArray::try_from(map).map_err(|source| Error::Map {
        name: MAP_TAIL_CALLS,
        source,
    })?;
    for (index, fd) in &fds {
        array.set(*index, fd, 0).map_err(|source| Error::Map {
            name: MAP_TAIL_CALLS,
            source,
        })?;
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
