//! Loads the embedded eBPF object. Maps are pinned by name under the pin directory: an existing
//! pin is adopted (same kernel map, contents kept), a missing one is created and pinned.

use aya::{
    Ebpf, EbpfLoader,
    maps::Array,
    programs::{ProgramError, SchedClassifier},
};
use proxy_common::{
    ALL_MAPS, BACKENDS_CAPACITY, CONFIG_GLOBAL, CONNTRACK_CAPACITY, DatapathConfig, MAP_BACKENDS,
    MAP_CONNTRACK, MAP_LC_ADJUST, MAP_LC_FLOWS, MAP_REVNAT, MAP_SEED, MAP_SERVICES, MAP_SNAT,
    MAP_TAIL_CALLS, PROG_SOCK_CONNECT4, PROG_SOCK_GETPEERNAME4, PROG_SOCK_RECVMSG4,
    PROG_SOCK_SENDMSG4, REVNAT_CAPACITY, SERVICES_CAPACITY, SNAT_CAPACITY, SOCK_LB_GLOBAL,
    SockLbConfig, TAIL_CALLS, bpf_log::LOG_LEVEL_GLOBAL, ipv6,
};

use super::{
    Error, Result,
    bpf_log::BpfLog,
    bpffs::PinLayout,
    program_pins::{self, ProgramPins},
};
use crate::{dataplane::ebpf_object::EBPF_OBJECT, pipeline::programmed::Capacities};

/// Entries of each IPv6 hash and LRU map on a node without IPv6 (`dataplane::sizing`'s module
/// doc says why; defined here, beside [`MapSizes`], so the loader needs nothing of the sizing).
pub const MINIMAL_ENTRIES: u32 = 1;

/// Map sizes used when the maps are first created (adopted maps keep their size: aya opens an
/// existing pin as it is). The agent derives the flow maps' from `conntrack.maxPerCore`
/// (`crate::dataplane::sizing`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MapSizes {
    pub services: u32,
    pub backends: u32,
    pub rev_nats: u32,
    /// `AFFINITY_V1` (`--affinity-max-entries`). `AFFMATCH_V1` is sized like `SERVICES_V1`: it
    /// holds at most one entry per backend slot.
    pub affinity: u32,
    pub conntrack: u32,
    pub snat: u32,
    /// `CONNTRACK6_V1` (`--map-entries-conntrack6`, `crate::dataplane::sizing`).
    pub conntrack6: u32,
    /// The other IPv6 hash and LRU maps (`--map-entries-*6`; one entry each on a node without
    /// IPv6: `crate::dataplane::sizing`). `AFFMATCH6_V1` is sized like `SERVICES6_V1`.
    pub services6: u32,
    pub backends6: u32,
    pub rev_nats6: u32,
    pub snat6: u32,
    pub affinity6: u32,
    pub sock_rev6: u32,
    pub fragments6: u32,
}

impl Default for MapSizes {
    fn default() -> Self {
        Self {
            services: SERVICES_CAPACITY,
            backends: BACKENDS_CAPACITY,
            rev_nats: REVNAT_CAPACITY,
            affinity: proxy_common::AFFINITY_CAPACITY,
            conntrack: CONNTRACK_CAPACITY,
            snat: SNAT_CAPACITY,
            conntrack6: ipv6::CONNTRACK6_CAPACITY,
            services6: ipv6::SERVICES6_CAPACITY,
            backends6: ipv6::BACKENDS6_CAPACITY,
            rev_nats6: ipv6::REVNAT6_CAPACITY,
            snat6: ipv6::SNAT6_CAPACITY,
            affinity6: ipv6::AFFINITY6_CAPACITY,
            sock_rev6: ipv6::SOCK_REVNAT6_CAPACITY,
            fragments6: ipv6::FRAGMENTS6_CAPACITY,
        }
    }
}

impl MapSizes {
    /// Entries of the least-connection arrays: one per backend id (ids are the smallest free
    /// ≥ 1 of the one space both families share, so at most the BACKENDS and BACKENDS6 entries
    /// together), never below the object's (adoption requires an array at least that long).
    pub fn lc_entries(&self) -> u32 {
        (self.backends.max(BACKENDS_CAPACITY))
            .saturating_add(self.backends6)
            .saturating_add(1)
    }

    /// The size asked for the pinned map `name`, for the maps sized at load.
    pub fn wanted(&self, name: &str) -> Option<u32> {
        Some(match name {
            MAP_SERVICES | proxy_common::MAP_AFFINITY_MATCH => self.services,
            MAP_BACKENDS => self.backends,
            MAP_REVNAT => self.rev_nats,
            proxy_common::MAP_AFFINITY => self.affinity,
            MAP_CONNTRACK => self.conntrack,
            MAP_SNAT => self.snat,
            MAP_LC_FLOWS | MAP_LC_ADJUST => self.lc_entries(),
            _ => return self.wanted6(name),
        })
    }

    /// [`MapSizes::wanted`] of the IPv6 maps sized at load (the ones shrunk on a node without
    /// IPv6).
    pub fn wanted6(&self, name: &str) -> Option<u32> {
        Some(match name {
            ipv6::MAP_SERVICES6 | ipv6::MAP_AFFINITY_MATCH6 => self.services6,
            ipv6::MAP_BACKENDS6 => self.backends6,
            ipv6::MAP_REVNAT6 => self.rev_nats6,
            ipv6::MAP_CONNTRACK6 => self.conntrack6,
            ipv6::MAP_SNAT6 => self.snat6,
            ipv6::MAP_AFFINITY6 => self.affinity6,
            ipv6::MAP_SOCK_REVNAT6 => self.sock_rev6,
            ipv6::MAP_FRAGMENTS6 => self.fragments6,
            _ => return None,
        })
    }

    /// Whether the IPv6 maps are the one-entry ones of a node without IPv6.
    pub fn ipv6_minimal(&self) -> bool {
        self.services6 <= MINIMAL_ENTRIES
    }

    pub fn capacities(&self) -> Capacities {
        Capacities {
            services: self.services,
            backends: self.backends,
            rev_nats: self.rev_nats,
            ..Default::default()
        }
    }
}

/// Everything the object is loaded with: kept by the agent to open it again for the program
/// groups it loads later ([`load_later`]).
#[derive(Clone, Debug)]
pub struct LoadParams {
    pub pins: PinLayout,
    pub config: DatapathConfig,
    pub sizes: MapSizes,
    pub sock_lb: SockLbConfig,
    /// The datapath trace's level (its ring buffer is the object's own, never pinned:
    /// `super::bpf_log`).
    pub bpf_log: BpfLog,
}

/// Loads the object with its maps pinned (or adopted) under `params.pins`, and loads
/// (verifies) the programs `needs` calls for ([`ProgramGroup`]); the IPv6 tail-call slots are
/// emptied when it does not call for IPv6. Nothing is attached yet. `config.hash_seed` (from
/// [`node_seed`]) is recorded in the pinned `SEED_V1` for the next agent. Programs an earlier
/// agent loaded from the same object, globals and maps are taken from their pins
/// (`super::program_pins`); returns where this load's programs are pinned, for the next agent
/// and for [`load_later`]. With the trace on nothing is pinned and every program is loaded now.
pub fn load_pinned(
    params: &LoadParams,
    needs: Needs,
) -> Result<(Ebpf, Option<ProgramPins>, Loaded)> {
    let LoadParams {
        pins,
        config,
        sizes,
        sock_lb,
        bpf_log,
    } = params;
    pins.create()?;
    replace_mismatched_pins(pins, sizes)?;
    let mut ebpf = open_object(params)?;
    let program_pins = (*bpf_log == BpfLog::Off)
        .then(|| -> Result<ProgramPins> {
            let map_ids = ALL_MAPS
                .iter()
                .map(|&name| {
                    aya::maps::MapData::from_pin(pins.map(name))
                        .and_then(|m| m.info())
                        .map(|info| info.id())
                        .map_err(|source| Error::Map { name, source })
                })
                .collect::<Result<Vec<u32>>>()?;
            let globals = [
                bytemuck::bytes_of(config),
                bytemuck::bytes_of(sock_lb),
                &[bpf_log.code()][..],
            ];
            Ok(ProgramPins::new(
                pins,
                program_pins::fingerprint(EBPF_OBJECT, &globals, &map_ids),
            ))
        })
        .transpose()?;
    let needs = if program_pins.is_some() {
        needs
    } else {
        Needs::ALL
    };
    let loaded = load_needed(&mut ebpf, needs, program_pins.as_ref())?;
    if let Some(p) = &program_pins {
        p.remove_others();
    }
    if !needs.ipv6 {
        clear_tail_calls(&mut ebpf, &[ProgramGroup::Ipv6, ProgramGroup::Ipv6L3])?;
    }
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
    Ok((ebpf, program_pins, loaded))
}

/// Loads, after the start, the groups `needs` calls for that `ebpf` lacks, into `ebpf`. A
/// group pinned already is taken from its pins. The others are loaded from a fresh copy of the
/// object, opened with the same parameters (the same pinned maps), and moved over through
/// their pins: `ebpf` itself can no longer load a program, since its relocations name map fds
/// that may have been closed (and reused) since the start.
pub fn load_later(
    params: &LoadParams,
    ebpf: &mut Ebpf,
    needs: Needs,
    pins: &ProgramPins,
) -> Result<Loaded> {
    let missing: Vec<ProgramGroup> = (needs.groups().into_iter())
        .filter(|&g| !group_loaded(ebpf, g))
        .collect();
    let mut loaded = Loaded::default();
    let unpinned: Vec<ProgramGroup> = (missing.iter().copied())
        .filter(|g| !pins.has_all(g.programs()))
        .collect();
    if !unpinned.is_empty() {
        let mut fresh = open_object(params)?;
        loaded = load_groups(&mut fresh, &unpinned, Some(pins))?;
    }
    for &group in &missing {
        for &name in group.programs() {
            let program = ebpf.program_mut(name).ok_or(Error::Missing {
                what: "program",
                name,
            })?;
            pins.take(name, program)?;
        }
        if !unpinned.contains(&group) {
            loaded.taken.push(group);
        }
    }
    set_tail_calls(ebpf, &missing)?;
    Ok(loaded)
}

/// The object opened with its maps pinned (or adopted) under `params.pins`; no program loaded.
fn open_object(params: &LoadParams) -> Result<Ebpf> {
    let paths: Vec<(&'static str, std::path::PathBuf)> =
        ALL_MAPS.iter().map(|&m| (m, params.pins.map(m))).collect();
    let log_level = params.bpf_log.code();
    let mut loader = EbpfLoader::new();
    loader
        .override_global(CONFIG_GLOBAL, &params.config, true)
        .override_global(SOCK_LB_GLOBAL, &params.sock_lb, true)
        .override_global(LOG_LEVEL_GLOBAL, &log_level, true);
    for (name, path) in &paths {
        loader.map_pin_path(name, path.as_path());
    }
    for name in SIZED_MAPS {
        if let Some(entries) = params.sizes.wanted(name) {
            loader.map_max_entries(name, entries);
        }
    }
    Ok(loader.load(EBPF_OBJECT)?)
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

/// The maps whose entries [`MapSizes`] gives at creation ([`MapSizes::wanted`]).
pub const SIZED_MAPS: [&str; 18] = [
    MAP_SERVICES,
    MAP_BACKENDS,
    MAP_REVNAT,
    proxy_common::MAP_AFFINITY,
    proxy_common::MAP_AFFINITY_MATCH,
    MAP_CONNTRACK,
    MAP_SNAT,
    MAP_LC_FLOWS,
    MAP_LC_ADJUST,
    ipv6::MAP_SERVICES6,
    ipv6::MAP_BACKENDS6,
    ipv6::MAP_REVNAT6,
    ipv6::MAP_AFFINITY_MATCH6,
    ipv6::MAP_CONNTRACK6,
    ipv6::MAP_SNAT6,
    ipv6::MAP_AFFINITY6,
    ipv6::MAP_SOCK_REVNAT6,
    ipv6::MAP_FRAGMENTS6,
];

/// What a map must be for the datapath to use it: kernel map type, key and value sizes, flags and
/// entries.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MapShape {
    pub map_type: u32,
    pub key_size: u32,
    pub value_size: u32,
    pub max_entries: u32,
    pub flags: u32,
}

impl std::fmt::Display for MapShape {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "type {} key {} B value {} B {} entries flags {:#x}",
            self.map_type, self.key_size, self.value_size, self.max_entries, self.flags
        )
    }
}

const BPF_MAP_TYPE_ARRAY: u32 = aya_obj::generated::bpf_map_type::BPF_MAP_TYPE_ARRAY as u32;
const BPF_MAP_TYPE_PERCPU_ARRAY: u32 =
    aya_obj::generated::bpf_map_type::BPF_MAP_TYPE_PERCPU_ARRAY as u32;
const BPF_MAP_TYPE_PROG_ARRAY: u32 =
    aya_obj::generated::bpf_map_type::BPF_MAP_TYPE_PROG_ARRAY as u32;

/// Pure: why a pinned map shaped `pinned` cannot be adopted where the object declares `want`, or
/// `None` to adopt it. Type, key size, value size and flags must be equal. Entries: hash maps
/// keep the size they were created with (`--map-entries-*` applies to new maps only); an array
/// is indexed by the datapath, so it needs at least the object's entries (a STATS array from an
/// agent with fewer counters would silently drop the new ones; a program array from an agent
/// without the L3-device programs has no slots for them).
pub fn pin_mismatch(want: &MapShape, pinned: &MapShape) -> Option<&'static str> {
    if pinned.map_type != want.map_type {
        Some("map type")
    } else if pinned.key_size != want.key_size {
        Some("key size")
    } else if pinned.value_size != want.value_size {
        Some("value size")
    } else if pinned.flags != want.flags {
        Some("flags")
    } else if matches!(
        want.map_type,
        BPF_MAP_TYPE_ARRAY | BPF_MAP_TYPE_PERCPU_ARRAY | BPF_MAP_TYPE_PROG_ARRAY
    ) && pinned.max_entries < want.max_entries
    {
        Some("fewer entries")
    } else {
        None
    }
}

/// Pure: whether the pinned IPv6 map `name` of `pinned_entries` is the one-entry map of a node
/// that had no IPv6 when it was created (`crate::dataplane::sizing`), while this agent sizes
/// it: it is replaced rather than adopted (adopted maps keep their size), losing at most one
/// entry. Any other size is adopted as it is, as for every hash map.
pub fn minimal_outgrown(name: &str, pinned_entries: u32, sizes: &MapSizes) -> bool {
    pinned_entries <= MINIMAL_ENTRIES && sizes.wanted6(name).is_some_and(|w| w > MINIMAL_ENTRIES)
}

/// The shapes the embedded object declares for the pinned maps.
fn object_shapes() -> Result<Vec<(&'static str, MapShape)>> {
    let obj = aya_obj::Object::parse(EBPF_OBJECT).map_err(|e| Error::Io {
        what: "parsing the embedded eBPF object".into(),
        source: std::io::Error::other(e.to_string()),
    })?;
    ALL_MAPS
        .iter()
        .map(|&name| {
            let m = obj
                .maps
                .get(name)
                .ok_or(Error::Missing { what: "map", name })?;
            Ok((
                name,
                MapShape {
                    map_type: m.map_type(),
                    key_size: m.key_size(),
                    value_size: m.value_size(),
                    max_entries: m.max_entries(),
                    flags: m.map_flags(),
                },
            ))
        })
        .collect()
}

/// A pinned map another layout left under one of our names (an older agent whose ABI changed
/// without a new `_V` name, another tool, a corrupted upgrade) is unpinned, so the load creates
/// one this datapath can use, instead of adopting a map the programs would misread. Logged with
/// both shapes; its entries are lost (the old programs keep it until their links get the new
/// ones). The same rule replaces a STATS array from an agent with fewer counters, and the
/// one-entry IPv6 maps of a node without IPv6 when this agent sizes them
/// ([`minimal_outgrown`]).
fn replace_mismatched_pins(pins: &PinLayout, sizes: &MapSizes) -> Result<()> {
    for (name, want) in object_shapes()? {
        let path = pins.map(name);
        let Ok(info) = aya::maps::MapData::from_pin(&path).and_then(|m| m.info()) else {
            continue;
        };
        let pinned = MapShape {
            map_type: info.map_type().map_or(u32::MAX, |t| t as u32),
            key_size: info.key_size(),
            value_size: info.value_size(),
            max_entries: info.max_entries(),
            flags: info.map_flags(),
        };
        let why = pin_mismatch(&want, &pinned).or_else(|| {
            minimal_outgrown(name, pinned.max_entries, sizes)
                .then_some("entries (a one-entry IPv6 map of a node that had no IPv6)")
        });
        let Some(why) = why else {
            continue;
        };
        tracing::warn!(
            map = name,
            path = %path.display(),
            "pinned map differs in {why} ({pinned}; this agent needs {want}): replacing it, its entries are lost"
        );
        std::fs::remove_file(&path).map_err(|source| Error::Io {
            what: format!("unpinning the mismatched {}", path.display()),
            source,
        })?;
    }
    Ok(())
}

/// Loads the object without pins (fresh private maps): for tests and benchmarks.
pub fn load_unpinned(config: &DatapathConfig) -> Result<Ebpf> {
    load_unpinned_logging(config, BpfLog::Off)
}

/// [`load_unpinned`] with the datapath trace at `bpf_log` (the verifier then checks the log
/// calls too).
pub fn load_unpinned_logging(config: &DatapathConfig, bpf_log: BpfLog) -> Result<Ebpf> {
    let mut ebpf = EbpfLoader::new()
        .override_global(CONFIG_GLOBAL, config, true)
        .override_global(LOG_LEVEL_GLOBAL, &bpf_log.code(), true)
        .load(EBPF_OBJECT)?;
    load_programs(&mut ebpf)?;
    Ok(ebpf)
}

/// The object's cgroup socket programs (the [`ProgramGroup::Sock`] group); `sock_lb` attaches
/// them (its `SockHook::program` names one each, which its tests check against this list).
pub const SOCK_PROGRAMS: [&str; 10] = [
    PROG_SOCK_CONNECT4,
    PROG_SOCK_SENDMSG4,
    PROG_SOCK_RECVMSG4,
    PROG_SOCK_GETPEERNAME4,
    proxy_common::PROG_SOCK_CONNECT6,
    proxy_common::PROG_SOCK_SENDMSG6,
    proxy_common::PROG_SOCK_RECVMSG6,
    proxy_common::PROG_SOCK_GETPEERNAME6,
    proxy_common::PROG_SOCK_BIND4,
    proxy_common::PROG_SOCK_BIND6,
];

/// The object's programs in the groups a node loads as it needs them. Loading is the verifier's
/// work, almost all of an agent's start-up (the IPv6 and L3-device programs are most of it), so
/// a node loads the IPv4 Ethernet programs (and the socket hooks) at start, the IPv6 ones too
/// where the node has IPv6, and the rest only once something uses them: an L3 device to attach
/// to, IPv6 appearing on the node. A tail call into a
/// group that is not loaded finds an empty slot: the IPv4 programs then pass an IPv6 packet
/// untouched, as on a kernel without the IPv6 datapath.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum ProgramGroup {
    /// IPv4 on Ethernet-framed devices: the entry programs and their tail-called parts.
    Ethernet,
    /// IPv4 on L3 devices (no Ethernet header: ipip, gre, WireGuard).
    L3,
    /// IPv6 on Ethernet-framed devices (tail-called by the IPv4 entry programs).
    Ipv6,
    /// IPv6 on L3 devices.
    Ipv6L3,
    /// The cgroup socket hooks.
    Sock,
}

impl ProgramGroup {
    pub const ALL: [ProgramGroup; 5] = [
        ProgramGroup::Ethernet,
        ProgramGroup::L3,
        ProgramGroup::Ipv6,
        ProgramGroup::Ipv6L3,
        ProgramGroup::Sock,
    ];

    pub fn programs(self) -> &'static [&'static str] {
        use proxy_common::*;
        match self {
            ProgramGroup::Ethernet => &[
                PROG_TC_INGRESS,
                PROG_TC_EGRESS,
                PROG_TC_INGRESS_NEW,
                PROG_TC_INGRESS_DIRECT,
                PROG_TC_INGRESS_REJECT,
            ],
            ProgramGroup::L3 => &[
                PROG_TC_INGRESS_L3,
                PROG_TC_EGRESS_L3,
                PROG_TC_INGRESS_NEW_L3,
                PROG_TC_INGRESS_DIRECT_L3,
                PROG_TC_INGRESS_REJECT_L3,
            ],
            ProgramGroup::Ipv6 => &[
                PROG_TC_INGRESS6,
                PROG_TC_EGRESS6,
                PROG_TC_INGRESS6_REJECT,
                PROG_TC_INGRESS6_NEW,
                PROG_TC_EGRESS6_SNAT,
                PROG_TC_INGRESS6_SNAT,
            ],
            ProgramGroup::Ipv6L3 => &[
                PROG_TC_INGRESS6_L3,
                PROG_TC_EGRESS6_L3,
                PROG_TC_INGRESS6_REJECT_L3,
                PROG_TC_INGRESS6_NEW_L3,
                PROG_TC_EGRESS6_SNAT_L3,
                PROG_TC_INGRESS6_SNAT_L3,
            ],
            ProgramGroup::Sock => &SOCK_PROGRAMS,
        }
    }

    /// The tail-call slots this group's programs fill.
    fn tail_calls(self) -> impl Iterator<Item = (&'static str, u32)> {
        TAIL_CALLS
            .into_iter()
            .filter(move |(name, _)| self.programs().contains(name))
    }
}

/// What a node's datapath runs: the IPv4 Ethernet programs always, the rest as needed
/// ([`ProgramGroup`]). Needs only grow: a loaded program stays loaded.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Needs {
    pub ipv6: bool,
    pub l3: bool,
}

impl Needs {
    /// Everything (tests and benchmarks).
    pub const ALL: Needs = Needs {
        ipv6: true,
        l3: true,
    };

    /// Pure: the groups these needs load (the socket hooks always: they verify in
    /// microseconds).
    pub fn groups(self) -> Vec<ProgramGroup> {
        let mut groups = vec![ProgramGroup::Ethernet, ProgramGroup::Sock];
        if self.l3 {
            groups.push(ProgramGroup::L3);
        }
        if self.ipv6 {
            groups.push(ProgramGroup::Ipv6);
        }
        if self.ipv6 && self.l3 {
            groups.push(ProgramGroup::Ipv6L3);
        }
        groups
    }

    /// These needs and `other`'s.
    pub fn with(self, other: Needs) -> Needs {
        Needs {
            ipv6: self.ipv6 || other.ipv6,
            l3: self.l3 || other.l3,
        }
    }
}

/// Loads (verifies) every program of an opened object and fills the tail-call slots. The
/// socket hooks stay inert (netns cookie 0) unless `SOCK_LB_GLOBAL` was set before loading.
pub fn load_programs(ebpf: &mut Ebpf) -> Result<()> {
    load_needed(ebpf, Needs::ALL, None).map(drop)
}

/// What [`load_needed`] did.
#[derive(Debug, Default)]
pub struct Loaded {
    /// Groups verified by this agent.
    pub verified: Vec<ProgramGroup>,
    /// Groups taken from an earlier agent's pins (the same programs, not verified again).
    pub taken: Vec<ProgramGroup>,
}

/// Loads the programs of the groups `needs` names that are not loaded yet, verifying them on
/// every CPU at once (the kernel verifies privileged loads in parallel), then puts their
/// tail-called parts into the program array. With `pins`, a group whose programs are all pinned
/// there is taken from the pins instead, and the programs verified here are pinned there
/// (`super::program_pins`).
pub fn load_needed(ebpf: &mut Ebpf, needs: Needs, pins: Option<&ProgramPins>) -> Result<Loaded> {
    let groups: Vec<ProgramGroup> = (needs.groups().into_iter())
        .filter(|&g| !group_loaded(ebpf, g))
        .collect();
    load_groups(ebpf, &groups, pins)
}

/// [`load_needed`] of exactly `groups`, on an object that has loaded none of their programs.
fn load_groups(
    ebpf: &mut Ebpf,
    groups: &[ProgramGroup],
    pins: Option<&ProgramPins>,
) -> Result<Loaded> {
    let mut loaded = Loaded::default();
    if groups.is_empty() {
        return Ok(loaded);
    }
    for &g in groups {
        if pins.is_some_and(|p| p.has_all(g.programs())) {
            loaded.taken.push(g);
        } else {
            loaded.verified.push(g);
        }
    }
    if let Some(&missing) =
        (groups.iter().flat_map(|g| g.programs())).find(|&&n| ebpf.program(n).is_none())
    {
        return Err(Error::Missing {
            what: "program",
            name: missing,
        });
    }
    let mut queue: Vec<(&'static str, &mut aya::programs::Program)> = Vec::new();
    let mut to_pin: Vec<&'static str> = Vec::new();
    for (name, program) in ebpf.programs_mut() {
        let Some(group) = groups.iter().find(|g| g.programs().contains(&name)) else {
            continue;
        };
        let name = *(group.programs().iter())
            .find(|&&n| n == name)
            .expect("found above");
        if loaded.taken.contains(group) {
            pins.expect("taken from pins").take(name, program)?;
        } else {
            if pins.is_some() {
                to_pin.push(name);
            }
            queue.push((name, program));
        }
    }
    // The costliest to verify last in the queue (taken first), so the CPUs end together.
    queue.sort_by_key(|(name, _)| verify_cost_rank(name));
    verify_in_parallel(queue)?;
    if let Some(pins) = pins {
        for name in to_pin {
            let program = ebpf.program_mut(name).ok_or(Error::Missing {
                what: "program",
                name,
            })?;
            pins.pin(name, program)?;
        }
    }
    set_tail_calls(ebpf, groups)?;
    Ok(loaded)
}

/// Puts the tail-called programs of `groups` (loaded) into the program array.
fn set_tail_calls(ebpf: &mut Ebpf, groups: &[ProgramGroup]) -> Result<()> {
    let slots = (groups.iter().flat_map(|g| g.tail_calls()))
        .map(|(name, index)| Ok((index, program_fd(ebpf, name)?)))
        .collect::<Result<Vec<_>>>()?;
    let mut array = program_array(ebpf)?;
    for (index, fd) in &slots {
        array.set(*index, fd, 0).map_err(|source| Error::Map {
            name: MAP_TAIL_CALLS,
            source,
        })?;
    }
    Ok(())
}

/// Empties the tail-call slots of `groups` (an earlier agent's programs there, for a part of
/// the datapath this one does not run: packets that would jump there pass untouched instead).
pub fn clear_tail_calls(ebpf: &mut Ebpf, groups: &[ProgramGroup]) -> Result<()> {
    let mut array = program_array(ebpf)?;
    for group in groups {
        for (_, index) in group.tail_calls() {
            match array.clear_index(&index) {
                Ok(()) => {}
                // Already empty.
                Err(aya::maps::MapError::SyscallError(e))
                    if e.io_error.raw_os_error() == Some(2) => {}
                Err(source) => {
                    return Err(Error::Map {
                        name: MAP_TAIL_CALLS,
                        source,
                    });
                }
            }
        }
    }
    Ok(())
}

/// Whether every program of `group` is loaded.
pub fn group_loaded(ebpf: &Ebpf, group: ProgramGroup) -> bool {
    group
        .programs()
        .iter()
        .all(|&name| ebpf.program(name).is_some_and(|p| p.fd().is_ok()))
}

/// Pure: the order of the verify queue, cheapest first. The new-flow programs are the largest
/// by far, then the direct and SNAT parts; the rest are small.
fn verify_cost_rank(name: &str) -> u8 {
    if name.contains("_new") {
        3
    } else if name.contains("_direct") || name.contains("_snat") {
        2
    } else if name.starts_with("tc_") {
        1
    } else {
        0
    }
}

/// Loads the queued programs on up to one thread per CPU, each taking the next from the end of
/// the queue.
fn verify_in_parallel(queue: Vec<(&'static str, &mut aya::programs::Program)>) -> Result<()> {
    let threads = std::thread::available_parallelism()
        .map_or(1, |n| n.get())
        .min(queue.len())
        .max(1);
    let queue = std::sync::Mutex::new(queue);
    let next = || queue.lock().unwrap_or_else(|e| e.into_inner()).pop();
    std::thread::scope(|scope| {
        let workers: Vec<_> = (0..threads)
            .map(|_| {
                scope.spawn(|| -> Result<()> {
                    while let Some((name, program)) = next() {
                        load_one(program).map_err(|source| Error::Program { name, source })?;
                    }
                    Ok(())
                })
            })
            .collect();
        workers
            .into_iter()
            .map(|w| w.join().unwrap_or_else(|p| std::panic::resume_unwind(p)))
            .collect::<Result<Vec<()>>>()
            .map(drop)
    })
}

fn load_one(program: &mut aya::programs::Program) -> std::result::Result<(), ProgramError> {
    use aya::programs::Program;
    match program {
        Program::SchedClassifier(p) => p.load(),
        Program::CgroupSockAddr(p) => p.load(),
        _ => Err(ProgramError::UnexpectedProgramType),
    }
}

fn program_array(ebpf: &mut Ebpf) -> Result<aya::maps::ProgramArray<&mut aya::maps::MapData>> {
    let map = ebpf.map_mut(MAP_TAIL_CALLS).ok_or(Error::Missing {
        what: "map",
        name: MAP_TAIL_CALLS,
    })?;
    aya::maps::ProgramArray::try_from(map).map_err(|source| Error::Map {
        name: MAP_TAIL_CALLS,
        source,
    })
}

/// A duplicate of a loaded program's fd (the program array borrows the object mutably).
fn program_fd(ebpf: &Ebpf, name: &'static str) -> Result<aya::programs::ProgramFd> {
    let program = ebpf.program(name).ok_or(Error::Missing {
        what: "program",
        name,
    })?;
    program
        .fd()
        .map_err(|source| Error::Program { name, source })?
        .try_clone()
        .map_err(|source| Error::Io {
            what: format!("duplicating the fd of program {name}"),
            source,
        })
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

#[cfg(test)]
mod tests {
    use super::*;

    const HASH: u32 = aya_obj::generated::bpf_map_type::BPF_MAP_TYPE_HASH as u32;

    fn shape(map_type: u32, max_entries: u32) -> MapShape {
        MapShape {
            map_type,
            key_size: 12,
            value_size: 16,
            max_entries,
            flags: 0,
        }
    }

    #[test]
    fn pinned_maps_are_adopted_only_with_the_same_shape() {
        let want = shape(HASH, 1024);
        assert_eq!(pin_mismatch(&want, &want), None);
        assert_eq!(
            pin_mismatch(&want, &shape(HASH, 10)),
            None,
            "hash maps keep their size"
        );
        for (pinned, why) in [
            (shape(BPF_MAP_TYPE_ARRAY, 1024), "map type"),
            (
                MapShape {
                    key_size: 8,
                    ..want
                },
                "key size",
            ),
            (
                MapShape {
                    value_size: 8,
                    ..want
                },
                "value size",
            ),
            (MapShape { flags: 1, ..want }, "flags"),
        ] {
            assert_eq!(pin_mismatch(&want, &pinned), Some(why), "{pinned}");
        }
        let stats = shape(BPF_MAP_TYPE_PERCPU_ARRAY, 34);
        assert_eq!(
            pin_mismatch(&stats, &shape(BPF_MAP_TYPE_PERCPU_ARRAY, 10)),
            Some("fewer entries")
        );
        assert_eq!(
            pin_mismatch(&stats, &shape(BPF_MAP_TYPE_PERCPU_ARRAY, 40)),
            None,
            "an array with more entries serves"
        );
        let tail_calls = shape(BPF_MAP_TYPE_PROG_ARRAY, proxy_common::TAIL_CALL_COUNT);
        assert_eq!(
            pin_mismatch(&tail_calls, &shape(BPF_MAP_TYPE_PROG_ARRAY, 3)),
            Some("fewer entries"),
            "a program array without slots for the L3-device programs is replaced"
        );
    }

    #[test]
    fn only_a_one_entry_ipv6_map_is_replaced_for_its_size() {
        let sized = MapSizes::default();
        let minimal = MapSizes {
            services6: 1,
            backends6: 1,
            conntrack6: 1,
            ..MapSizes::default()
        };
        assert!(minimal_outgrown(ipv6::MAP_SERVICES6, 1, &sized));
        assert!(minimal_outgrown(ipv6::MAP_CONNTRACK6, 1, &sized));
        assert!(minimal_outgrown(ipv6::MAP_AFFINITY_MATCH6, 1, &sized));
        assert!(
            !minimal_outgrown(ipv6::MAP_SERVICES6, 1, &minimal),
            "still minimal: adopted"
        );
        assert!(
            !minimal_outgrown(ipv6::MAP_SERVICES6, 4_096, &sized),
            "another size: adopted as it is"
        );
        assert!(
            !minimal_outgrown(ipv6::MAP_SERVICES6, 4_096, &minimal),
            "a sized map is kept on a node that lost IPv6"
        );
        assert!(
            !minimal_outgrown(MAP_SERVICES, 1, &sized),
            "IPv4 maps keep the hash-map rule"
        );
        assert!(
            !minimal_outgrown(ipv6::MAP_NODE6, 1, &sized),
            "an array of one"
        );
    }

    #[test]
    fn every_sized_map_is_pinned_and_has_a_wanted_size() {
        let sizes = MapSizes::default();
        for name in SIZED_MAPS {
            assert!(ALL_MAPS.contains(&name), "{name}");
            assert!(sizes.wanted(name).is_some(), "{name}");
        }
        assert_eq!(
            sizes.lc_entries(),
            BACKENDS_CAPACITY + ipv6::BACKENDS6_CAPACITY + 1,
            "one least-connection slot per id of both families"
        );
    }

    #[test]
    fn every_program_of_the_object_is_in_exactly_one_group() {
        let obj = aya_obj::Object::parse(EBPF_OBJECT).expect("object");
        // The tap is the tests' own, attached by them.
        let mut names: Vec<&str> = (obj.programs.keys().map(String::as_str))
            .filter(|&n| n != proxy_common::PROG_TC_TAP)
            .collect();
        names.sort_unstable();
        let mut grouped: Vec<&str> = ProgramGroup::ALL
            .iter()
            .flat_map(|g| g.programs().iter().copied())
            .collect();
        grouped.sort_unstable();
        assert_eq!(
            grouped, names,
            "each program once, and no other but the tap"
        );
        let tail_called: usize = ProgramGroup::ALL
            .iter()
            .map(|g| g.tail_calls().count())
            .sum();
        assert_eq!(
            tail_called,
            TAIL_CALLS.len(),
            "every tail-called program has a group"
        );
    }

    #[test]
    fn a_node_loads_ipv4_on_ethernet_and_what_it_needs() {
        use ProgramGroup::*;
        assert_eq!(Needs::default().groups(), [Ethernet, Sock]);
        let l3 = Needs {
            l3: true,
            ..Needs::default()
        };
        let ipv6 = Needs {
            ipv6: true,
            ..Needs::default()
        };
        assert_eq!(l3.groups(), [Ethernet, Sock, L3]);
        assert_eq!(ipv6.groups(), [Ethernet, Sock, Ipv6]);
        assert_eq!(
            l3.with(ipv6).groups(),
            [Ethernet, Sock, L3, Ipv6, Ipv6L3],
            "IPv6 on L3 devices once both are needed, whichever came first"
        );
        let mut all = Needs::ALL.groups();
        all.sort();
        assert_eq!(all, ProgramGroup::ALL);
    }

    #[test]
    fn the_largest_programs_are_verified_first() {
        let mut queue = [
            "sock_bind4",
            "tc_ingress",
            "tc_ingress6_new",
            "tc_egress6_snat",
            "tc_ingress_new",
        ];
        queue.sort_by_key(|n| verify_cost_rank(n));
        assert_eq!(queue[0], "sock_bind4");
        assert!(queue[3..].iter().all(|n| n.contains("_new")), "{queue:?}");
    }

    #[test]
    fn the_object_declares_every_pinned_map() {
        let shapes = object_shapes().expect("shapes");
        assert_eq!(shapes.len(), ALL_MAPS.len());
        let services = shapes.iter().find(|(n, _)| *n == MAP_SERVICES).unwrap().1;
        assert_eq!(
            (services.map_type, services.key_size, services.value_size),
            (HASH, 12, 32)
        );
    }
}
