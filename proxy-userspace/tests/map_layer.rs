//! Privileged: the map layer against real kernel maps (unpinned load). Batched writes must leave
//! exactly what the plan says, in any mix of puts and deletes, including deletes of keys that are
//! already gone. SNAT garbage collection must remove exactly the dead flows' entries. A pinned
//! stats array from an agent with fewer counters, or any pinned map of another shape, is replaced
//! at load; the flow hash seed is pinned and kept; an agent from before IPv6 has its IPv4 state
//! adopted.
//!
//! Run by `sudo cargo xtask test` (KPE_PRIVILEGED=1); skipped otherwise.

use std::{
    collections::{BTreeMap, BTreeSet},
    net::{Ipv4Addr, Ipv6Addr},
};

use kube_proxy_ebpf::{
    dataplane::{
        bpf_log::BpfLog,
        clock::monotonic_ns,
        loader,
        maps::{ServiceMaps, Snat},
        snat_gc::{self, Collected},
    },
    pipeline::{
        diff,
        encode::FamilyAbi,
        fast_hash::HashSet,
        model::{
            Balancing, DesiredBackend, DesiredFrontend, DesiredState, EndpointAddr, Family,
            Frontend, FrontendKind, Protocol, ServicePortName,
        },
        programmed::{Capacities, MapOp, Programmed, SharedIds},
    },
};
use proxy_common::{
    DatapathConfig, HAIRPIN_SNAT_ADDR, Scheduler, ServiceKey, ServiceValue, SnatKey, SnatValue,
    ct_state, proto,
};
use proxy_testenv::require_privileged;

/// Maps of 64 entries each: the loader tests only look at which maps are created or adopted.
fn tiny_map_sizes() -> kube_proxy_ebpf::dataplane::loader::MapSizes {
    kube_proxy_ebpf::dataplane::loader::MapSizes {
        services: 64,
        backends: 64,
        rev_nats: 64,
        affinity: 64,
        conntrack: 64,
        snat: 64,
        conntrack6: 64,
        services6: 64,
        backends6: 64,
        rev_nats6: 64,
        snat6: 64,
        affinity6: 64,
        sock_rev6: 64,
        fragments6: 64,
    }
}

fn state(services: u32, backends_each: u32, offset: u32) -> DesiredState {
    state_in(services, backends_each, offset, Ipv4Addr::from)
}

/// [`state`] in either family: `addr` makes an address of it from the IPv4 one's bits.
fn state_in<A: Family>(
    services: u32,
    backends_each: u32,
    offset: u32,
    addr: impl Fn(u32) -> A,
) -> DesiredState<A> {
    let mut frontends = BTreeMap::new();
    for s in 0..services {
        let frontend = Frontend::new(addr(0x0a60_0000 + s), 80, Protocol::Tcp);
        let backends = (0..backends_each)
            .map(|b| DesiredBackend {
                endpoint: EndpointAddr {
                    addr: addr(0x0af4_0000 + s * 16 + b + offset),
                    port: 8080,
                    protocol: Protocol::Tcp,
                },
                terminating: false,
                local: false,
                not_serving: false,
            })
            .collect();
        let service = ServicePortName {
            namespace: "ns".into(),
            name: format!("svc{s}"),
            port_name: String::new(),
        };
        frontends.insert(
            frontend,
            DesiredFrontend {
                // Every other Service with session affinity: AFFMATCH_V1 entries too.
                balancing: Balancing {
                    affinity_timeout_s: s.is_multiple_of(2).then_some(60),
                    ..Default::default()
                },
                service,
                kind: FrontendKind::ClusterIp,
                external_local: false,
                drop_when_empty: false,
                source_ranges: Vec::new(),
                backends,
                retained: vec![],
            }
            .into(),
        );
    }
    DesiredState { frontends }
}

/// Plans `desired` against `shadow`, applies with `apply_all`, and checks the kernel maps equal
/// the shadow afterwards.
fn sync(maps: &mut ServiceMaps, shadow: &mut Programmed, desired: &DesiredState) -> usize {
    let plan = diff::plan(desired, shadow, &Capacities::default());
    assert!(plan.skipped.is_empty(), "{:?}", plan.skipped);
    let (applied, err) = maps.apply_all(&plan.ops);
    assert!(
        err.is_none(),
        "apply_all failed after {applied} ops: {err:?}"
    );
    assert_eq!(applied, plan.ops.len());
    for op in &plan.ops {
        shadow.apply(op);
    }
    let read = maps.read_programmed().expect("reading maps back");
    assert_eq!(&read, shadow, "kernel maps differ from the shadow");
    plan.ops.len()
}

/// A restarted agent reads back round-robin frontends whose datapath-owned position moved
/// (`rr_next`) as it wrote them: its plan against what it adopts is empty, so it does not
/// rewrite (and reset) every rr frontend.
#[test]
fn adopted_round_robin_frontends_with_a_moved_position_are_no_difference() {
    require_privileged!();
    let mut ebpf = loader::load_unpinned(&DatapathConfig::DEFAULT).expect("load");
    let mut maps = ServiceMaps::from_ebpf(&mut ebpf).expect("maps");
    let mut desired = state(3, 3, 0);
    for f in desired.frontends.values_mut() {
        std::sync::Arc::make_mut(f).balancing.scheduler = Scheduler::RoundRobin;
    }
    let mut shadow = Programmed::default();
    sync(&mut maps, &mut shadow, &desired);
    // The datapath advances every frontend's position (new flows).
    let frontends: Vec<_> = shadow
        .services
        .iter()
        .filter(|(k, _)| k.slot == 0)
        .map(|(k, v)| (*k, v))
        .collect();
    assert_eq!(frontends.len(), 3);
    for (i, (key, value)) in frontends.iter().enumerate() {
        assert_eq!(value.scheduler, Scheduler::RoundRobin.code());
        let moved = ServiceValue {
            rr_next: 17 + i as u32,
            ..*value
        };
        maps.apply(&MapOp::PutService {
            key: *key,
            value: moved,
        })
        .expect("advance");
    }
    let adopted = maps.read_programmed().expect("read back");
    assert_eq!(
        adopted, shadow,
        "the position is not part of what the agent compares"
    );
    let plan = diff::plan(&desired, &adopted, &Capacities::default());
    assert!(plan.ops.is_empty(), "restart rewrites: {:?}", plan.ops);
}

#[test]
fn batched_apply_leaves_exactly_the_plan_in_the_kernel_maps() {
    require_privileged!();
    let mut ebpf = loader::load_unpinned(&DatapathConfig::DEFAULT).expect("load");
    let mut maps = ServiceMaps::from_ebpf(&mut ebpf).expect("maps");
    let mut shadow = Programmed::default();

    // 1,000 × 10: the backend and slot runs are large enough to be written by two threads.
    let grown = sync(&mut maps, &mut shadow, &state(1_000, 10, 0));
    assert_eq!(
        grown,
        1_000 * 10 + 1_000 * 11 + 1_000 + 500 * 10,
        "backends + slots/frontends + rev-NATs + affinity matches"
    );
    assert_eq!(shadow.frontend_count(), 1_000);
    assert_eq!(shadow.affinity_matches.len(), 500 * 10);

    // Shrink and move: half the Services go, the rest get other backends (puts + deletes).
    sync(&mut maps, &mut shadow, &state(250, 4, 3));
    assert_eq!(shadow.frontend_count(), 250);
    assert_eq!(shadow.affinity_matches.len(), 125 * 4);
    assert_eq!(
        sync(&mut maps, &mut shadow, &state(250, 4, 3)),
        0,
        "idempotent"
    );

    // Deletes of keys already gone (another writer, a crash) are tolerated, and the batch still
    // removes the keys that exist.
    let present = ServiceKey::new([10, 96, 0, 1], 80u16.to_be_bytes(), 6, 0);
    let missing = ServiceKey::new([10, 96, 255, 255], 80u16.to_be_bytes(), 6, 0);
    assert!(shadow.services.contains_key(&present));
    let ops = [
        MapOp::DeleteService { key: missing },
        MapOp::DeleteService { key: present },
    ];
    let (applied, err) = maps.apply_all(&ops);
    assert!(err.is_none(), "{err:?}");
    assert_eq!(applied, 2);
    let read = maps.read_programmed().expect("read");
    assert!(
        !read.services.contains_key(&present),
        "present key was not deleted"
    );
}

/// `d` with every frontend on the Maglev scheduler.
fn with_maglev<A: Family>(mut d: DesiredState<A>) -> DesiredState<A> {
    for df in d.frontends.values_mut() {
        std::sync::Arc::make_mut(df).balancing.scheduler =
            kube_proxy_ebpf::pipeline::model::Scheduler::Maglev;
    }
    d
}

/// Plans `desired` at Maglev size `m` against `shadow`, applies, and checks that the maps read
/// back and adopted at `m` equal the shadow (every table known again, chunk for chunk).
fn sync_maglev(maps: &mut ServiceMaps, shadow: &mut Programmed, desired: &DesiredState, m: u32) {
    sync_family(
        maps,
        shadow,
        desired,
        m,
        &SharedIds::default(),
        &HashSet::default(),
    );
}

/// [`sync_maglev`] for one family of two: its new ids avoid `other`; the IPv4 family's read
/// leaves out `other_tables` (the IPv6 frontends' Maglev tables in the shared `MAGLEV_V1`).
fn sync_family<A: FamilyAbi>(
    maps: &mut ServiceMaps<A>,
    shadow: &mut Programmed<A>,
    desired: &DesiredState<A>,
    m: u32,
    other: &SharedIds,
    other_tables: &HashSet<u32>,
) {
    let caps = Capacities {
        maglev_table_size: m,
        ..Capacities::default()
    };
    let plan = diff::plan_sharing(desired, shadow, &caps, other);
    assert!(plan.skipped.is_empty(), "{:?}", plan.skipped);
    let (applied, err) = maps.apply_all(&plan.ops);
    assert!(err.is_none() && applied == plan.ops.len(), "{err:?}");
    for op in &plan.ops {
        shadow.apply(op);
    }
    let mut read = (maps.read_programmed_excluding(other_tables)).expect("reading maps back");
    assert!(
        read.maglev.values().all(|t| t.endpoints.is_empty()),
        "read back unknown"
    );
    maps.adopt_maglev(&mut read, m);
    assert_eq!(&read, shadow, "kernel maps differ from the shadow");
    assert!(
        diff::plan_sharing(desired, &read, &caps, other)
            .ops
            .is_empty(),
        "adopted: nothing to rewrite"
    );
}

/// Both families through the real maps: the IPv6 plan lands in SERVICES6_V1/BACKENDS6_V1/
/// REVNAT6_V1/AFFMATCH6_V1 as `Service6Key`s with 16-byte addresses, its Maglev tables in the
/// shared MAGLEV_V1 under ids IPv4 does not use (and backend ids likewise: LCFLOWS_V1 is
/// shared), each family reads back exactly its own entries (a restart adopts them: nothing to
/// rewrite), and removing IPv6 leaves IPv4 as it was.
#[test]
fn ipv6_maps_are_written_and_read_back_beside_ipv4() {
    require_privileged!();
    let mut ebpf = loader::load_unpinned(&DatapathConfig::DEFAULT).expect("load");
    let mut maps = ServiceMaps::from_ebpf(&mut ebpf).expect("maps");
    let mut maps6 = maps.ipv6(Some(&mut ebpf), None).expect("IPv6 maps");
    let v6 = |bits: u32| Ipv6Addr::from((0xfd00u128 << 112) | u128::from(bits));
    let d4 = with_maglev(state(6, 4, 0));
    let d6 = with_maglev(state_in(5, 3, 1, v6));
    let m = 509;
    let (mut p4, mut p6) = (Programmed::default(), Programmed::<Ipv6Addr>::default());
    let none = HashSet::default();
    sync_family(&mut maps, &mut p4, &d4, m, &p6.shared_ids(), &none);
    sync_family(&mut maps6, &mut p6, &d6, m, &p4.shared_ids(), &none);
    let tables6: HashSet<u32> = p6.maglev.keys().copied().collect();
    // IPv4's read leaves IPv6's tables out; then IPv4 changes with IPv6 programmed.
    sync_family(
        &mut maps,
        &mut p4,
        &with_maglev(state(6, 4, 2)),
        m,
        &p6.shared_ids(),
        &tables6,
    );
    let (ids4, ids6) = (p4.shared_ids(), p6.shared_ids());
    assert!(
        ids4.backends.is_disjoint(&ids6.backends),
        "{ids4:?} {ids6:?}"
    );
    assert!(ids4.maglev_tables.is_disjoint(&ids6.maglev_tables));
    assert_eq!(
        (p6.frontend_count(), p6.backends.len(), p6.maglev.len()),
        (5, 15, 5)
    );
    assert_eq!(
        p6.affinity_matches.len(),
        3 * 3,
        "svc0, svc2, svc4 have affinity"
    );

    // What the kernel's SERVICES6_V1 holds for the first frontend, byte for byte.
    let fe: [u8; 16] = v6(0x0a60_0000).octets();
    let key0 = proxy_common::ipv6::Service6Key::new(fe, 80u16.to_be_bytes(), proto::TCP, 0);
    let entries: BTreeMap<_, _> = maps6.services().into_iter().collect();
    let frontend = entries
        .get(&key0)
        .expect("the IPv6 frontend in SERVICES6_V1");
    assert_eq!(frontend.count, 3);
    assert!(ids6.maglev_tables.contains(&frontend.maglev_table));
    let slot1 = entries.get(&key0.with_slot(1)).expect("slot 1");
    let b = maps6.backend(slot1.backend_id).expect("in BACKENDS6_V1");
    assert_eq!(b.addr, v6(0x0af4_0000 + 1).octets());
    assert_eq!(b.port, 8080u16.to_be_bytes());
    assert!(
        maps.backend(slot1.backend_id).is_none(),
        "not in BACKENDS_V1"
    );

    // IPv6 goes: IPv4 is untouched, and its read sees no IPv6 table.
    sync_family(
        &mut maps6,
        &mut p6,
        &DesiredState::default(),
        m,
        &p4.shared_ids(),
        &none,
    );
    assert!(maps6.services().is_empty());
    let mut read4 = maps.read_programmed().expect("read");
    maps.adopt_maglev(&mut read4, m);
    assert_eq!(read4, p4);
}

/// Maglev tables through the real map: written chunk by chunk, read back and adopted (the
/// content checked against what the agent builds), rebuilt when M changes, deleted with their
/// frontends.
#[test]
fn maglev_tables_are_written_adopted_rebuilt_for_another_size_and_deleted() {
    require_privileged!();
    let mut ebpf = loader::load_unpinned(&DatapathConfig::DEFAULT).expect("load");
    let mut maps = ServiceMaps::from_ebpf(&mut ebpf).expect("maps");
    let mut shadow = Programmed::default();
    let d = with_maglev(state(20, 10, 0));
    let m = proxy_common::maglev::DEFAULT_TABLE_SIZE;
    sync_maglev(&mut maps, &mut shadow, &d, m);
    assert_eq!(shadow.maglev.len(), 20);
    let (id, table) = shadow.maglev.iter().next().expect("a table");
    let (key, chunk) = table.map_entries(*id)[17];
    assert_eq!(
        maps.maglev_chunk(&key),
        Some(chunk),
        "the last chunk as built"
    );

    // Restarted with another M: the read-back tables do not match, so all are replaced.
    let mut read = maps.read_programmed().expect("read");
    maps.adopt_maglev(&mut read, 509);
    assert!(read.maglev.values().all(|t| t.endpoints.is_empty()));
    shadow = read;
    sync_maglev(&mut maps, &mut shadow, &d, 509);
    assert!(
        shadow
            .maglev
            .values()
            .all(|t| t.size == 509 && t.chunks() == 1)
    );
    assert_eq!(shadow.maglev.len(), 20);
    assert_eq!(
        maps.read_programmed().expect("read").maglev.len(),
        20,
        "old tables deleted"
    );

    sync_maglev(&mut maps, &mut shadow, &DesiredState::default(), 509);
    assert!(maps.read_programmed().expect("read").maglev.is_empty());
}

const S: u64 = 1_000_000_000;
const NODE: [u8; 4] = [192, 168, 50, 10];
const BACKEND: [u8; 4] = [10, 244, 2, 20];

/// One flow's entries as the datapath writes them: `client`:`cport` → BACKEND:8080 leaves as
/// `node`:`nport`. Both last seen at `last_seen_ns`, in `state`.
struct Flow {
    out: (SnatKey, SnatValue),
    inn: (SnatKey, SnatValue),
}

impl Flow {
    fn new(
        client: [u8; 4],
        cport: u16,
        node: [u8; 4],
        nport: u16,
        proto: u8,
        state: u8,
        last_seen_ns: u64,
    ) -> Self {
        let [out, inn] = snat_gc::FlowAddrs {
            client: (client, cport),
            backend: (BACKEND, 8080),
            node: (node, nport),
            proto,
        }
        .entries(state, last_seen_ns);
        Self { out, inn }
    }

    fn tcp(cport: u16, nport: u16, state: u8, last_seen_ns: u64) -> Self {
        Self::new(
            [203, 0, 113, 7],
            cport,
            NODE,
            nport,
            proto::TCP,
            state,
            last_seen_ns,
        )
    }

    fn write(&self, snat: &mut Snat) {
        for (k, v) in [self.out, self.inn] {
            snat.insert(&k, &v).expect("write SNAT entry");
        }
    }

    fn keys(&self) -> [SnatKey; 2] {
        [self.out.0, self.inn.0]
    }
}

#[test]
fn snat_gc_removes_dead_flows_both_entries_and_keeps_live_ones() {
    require_privileged!();
    let cfg = DatapathConfig {
        tcp_established_timeout_s: 100,
        tcp_transitory_timeout_s: 10,
        udp_timeout_s: 5,
        ..DatapathConfig::DEFAULT
    };
    let mut ebpf = loader::load_unpinned(&cfg).expect("load");
    let mut snat = Snat::from_ebpf(&mut ebpf).expect("SNAT map");
    // The GC's clock, set 10,000 s past the real CLOCK_MONOTONIC (the clock the datapath
    // writes), so "1,000 s ago" exists on a machine that booted a minute ago.
    let now = monotonic_ns() + 10_000 * S;
    let ago = |s: u64| now - s * S;

    let stale = Flow::tcp(40_001, 61_001, ct_state::ESTABLISHED, ago(200));
    let live = Flow::tcp(40_002, 61_002, ct_state::ESTABLISHED, ago(50));
    let stale_udp = Flow::new(
        [203, 0, 113, 8],
        5000,
        NODE,
        61_003,
        proto::UDP,
        ct_state::UDP,
        ago(6),
    );
    let stale_hairpin = Flow::new(
        BACKEND,
        33_000,
        HAIRPIN_SNAT_ADDR,
        61_004,
        proto::TCP,
        ct_state::SYN_SENT,
        ago(11),
    );
    // Only the backend still sends: its replies refresh `in` only, the flow lives.
    let mut reply_only = Flow::tcp(40_005, 61_005, ct_state::ESTABLISHED, ago(1_000));
    reply_only.inn.1.last_seen_ns = ago(1);
    // A silent flow whose node port the datapath reclaimed for a new flow to the same backend:
    // its `out` entry goes, the new flow's `in` entry stays.
    let silent = Flow::tcp(40_006, 61_006, ct_state::ESTABLISHED, ago(500));
    let reclaimer = Flow::tcp(40_007, 61_006, ct_state::SYN_SENT, ago(1));
    for f in [
        &stale,
        &live,
        &stale_udp,
        &stale_hairpin,
        &reply_only,
        &silent,
        &reclaimer,
    ] {
        f.write(&mut snat);
    }
    assert_eq!(
        snat.entries().len(),
        13,
        "the reclaimer overwrote the silent flow's in entry"
    );

    let done = snat_gc::collect(&mut snat, now, &cfg);

    let left: BTreeSet<_> = snat
        .entries()
        .into_iter()
        .map(|(k, _)| (k.dir, k.saddr, k.sport, k.daddr, k.dport, k.proto))
        .collect();
    let want: BTreeSet<_> = [&live, &reply_only, &reclaimer]
        .into_iter()
        .flat_map(Flow::keys)
        .map(|k| (k.dir, k.saddr, k.sport, k.daddr, k.dport, k.proto))
        .collect();
    assert_eq!(left, want, "exactly the live flows' entries are left");
    assert_eq!(
        done,
        Collected {
            flows: 3,
            orphans: 1,
            removed: 7,
            remaining: 6,
        }
    );
    for (k, v) in [live.out, live.inn] {
        assert_eq!(snat.get(&k), Some(v), "a live entry is left as it was");
    }

    // A second pass finds nothing.
    let again = snat_gc::collect(&mut snat, now, &cfg);
    assert_eq!(
        again,
        Collected {
            remaining: 6,
            ..Collected::default()
        }
    );
}

/// The agent's load of the object with its pins under `pins`, every program loaded.
fn load_pinned(
    pins: &kube_proxy_ebpf::dataplane::bpffs::PinLayout,
    config: &DatapathConfig,
    sizes: &kube_proxy_ebpf::dataplane::loader::MapSizes,
    sock_lb: &proxy_common::SockLbConfig,
    bpf_log: BpfLog,
) -> kube_proxy_ebpf::dataplane::Result<aya::Ebpf> {
    let params = loader::LoadParams {
        pins: pins.clone(),
        config: *config,
        sizes: *sizes,
        sock_lb: *sock_lb,
        bpf_log,
    };
    loader::load_pinned(&params, loader::Needs::ALL).map(|(ebpf, _, _)| ebpf)
}

/// The agent's load of the object with its pins under `pins`, default sizes and settings.
fn load_pinned_default(pins: &kube_proxy_ebpf::dataplane::bpffs::PinLayout) -> aya::Ebpf {
    use kube_proxy_ebpf::dataplane::loader::MapSizes;
    let sock = proxy_common::SockLbConfig::default();
    load_pinned(
        pins,
        &DatapathConfig::DEFAULT,
        &MapSizes::default(),
        &sock,
        BpfLog::Off,
    )
    .expect("load with the pins")
}

/// An agent with more datapath counters than the one that pinned the maps replaces the pinned
/// STATS array (adopting it would silently drop the new counters); the other maps are adopted.
#[test]
fn a_pinned_stats_array_with_fewer_counters_is_replaced() {
    require_privileged!();
    use kube_proxy_ebpf::dataplane::{bpffs::PinLayout, ebpf_object::EBPF_OBJECT};
    use proxy_common::{COUNTER_COUNT, MAP_SERVICES, MAP_STATS};

    proxy_testenv::ensure_bpffs().expect("bpffs");
    let dir = proxy_testenv::PinDir::new(&format!("{}-stats", proxy_testenv::unique_prefix()))
        .expect("pin dir");
    let pins = PinLayout::new(dir.path());
    pins.create().expect("pin directories");
    let max_entries = |name: &str| {
        aya::maps::MapData::from_pin(pins.map(name))
            .expect("pinned map")
            .info()
            .expect("map info")
            .max_entries()
    };
    // An "older agent": its STATS array has 10 counters.
    let mut old = aya::EbpfLoader::new();
    old.map_pin_path(MAP_STATS, pins.map(MAP_STATS))
        .map_pin_path(MAP_SERVICES, pins.map(MAP_SERVICES))
        .map_max_entries(MAP_STATS, 10);
    drop(old.load(EBPF_OBJECT).expect("old load"));
    assert_eq!(max_entries(MAP_STATS), 10);
    let services_id = aya::maps::MapData::from_pin(pins.map(MAP_SERVICES))
        .and_then(|m| m.info())
        .expect("services")
        .id();

    let ebpf = load_pinned_default(&pins);
    assert_eq!(max_entries(MAP_STATS), COUNTER_COUNT);
    let adopted = aya::maps::MapData::from_pin(pins.map(MAP_SERVICES))
        .and_then(|m| m.info())
        .expect("services")
        .id();
    assert_eq!(adopted, services_id, "SERVICES_V1 is adopted, not replaced");
    drop(ebpf);
}

/// The flow maps are created with the sizes asked for (`sizing`: maxPerCore × CPUs, or the
/// explicit flags); a restarted agent asking for other sizes adopts the pinned maps as they are
/// (same kernel maps, entries kept), and the occupancy metrics report their real capacity.
#[test]
fn pinned_flow_maps_of_another_size_are_adopted_as_they_are() {
    require_privileged!();
    use kube_proxy_ebpf::{
        dataplane::{bpffs::PinLayout, loader::MapSizes, occupancy::Occupancy},
        serving::metrics::Metrics,
    };
    use proxy_common::{MAP_CONNTRACK, MAP_SNAT, SockLbConfig};

    proxy_testenv::ensure_bpffs().expect("bpffs");
    let dir = proxy_testenv::PinDir::new(&format!("{}-sizes", proxy_testenv::unique_prefix()))
        .expect("pin dir");
    let pins = PinLayout::new(dir.path());
    let info = |name: &str| {
        aya::maps::MapData::from_pin(pins.map(name))
            .and_then(|m| m.info())
            .expect("pinned map info")
    };
    let first = MapSizes {
        conntrack: 1_024,
        snat: 2_048,
        conntrack6: 512,
        ..MapSizes::default()
    };
    let load = |sizes: &MapSizes| {
        load_pinned(
            &pins,
            &DatapathConfig::DEFAULT,
            sizes,
            &SockLbConfig::default(),
            BpfLog::Off,
        )
        .expect("load")
    };
    let ebpf = load(&first);
    assert_eq!(info(MAP_CONNTRACK).max_entries(), 1_024);
    assert_eq!(info(MAP_SNAT).max_entries(), 2_048);
    assert_eq!(info(proxy_common::ipv6::MAP_CONNTRACK6).max_entries(), 512);
    let ids = (info(MAP_CONNTRACK).id(), info(MAP_SNAT).id());
    drop(ebpf);

    let second = MapSizes {
        conntrack: 4_096,
        snat: 4_096,
        ..MapSizes::default()
    };
    let ebpf = load(&second);
    assert_eq!(
        (info(MAP_CONNTRACK).id(), info(MAP_SNAT).id()),
        ids,
        "the same kernel maps are adopted"
    );
    assert_eq!(info(MAP_CONNTRACK).max_entries(), 1_024, "with their size");
    let metrics = Metrics::new();
    let occupancy = Occupancy::open(&pins, &second, true, &metrics);
    assert_eq!(occupancy.capacity("conntrack"), Some(1_024));
    assert_eq!(occupancy.capacity("snat"), Some(2_048));
    let text = metrics.encode_text();
    assert!(
        text.contains("kube_proxy_ebpf_map_capacity{map=\"conntrack\"} 1024"),
        "{text}"
    );
    drop(ebpf);
}

/// The IPv6 maps are created with the sizes asked for (`--map-entries-*6`, `AFFMATCH6_V1` like
/// `SERVICES6_V1`, the least-connection arrays covering both families' ids); on a node without
/// IPv6 (`loader::MINIMAL_ENTRIES`) every IPv6 hash and LRU map has one entry and the kernel's
/// account of them (memlock) is a small part of the sized ones'; a restarted agent that sizes
/// them replaces those one-entry pins (the IPv4 maps adopted as they are), and a restart asking
/// for one entry again adopts the sized maps with their entries.
#[test]
fn ipv6_maps_get_their_sizes_and_one_entry_each_on_a_node_without_ipv6() {
    require_privileged!();
    use std::os::fd::{AsFd as _, AsRawFd as _};

    use kube_proxy_ebpf::dataplane::{bpffs::PinLayout, loader::MapSizes};
    use proxy_common::{MAP_LC_FLOWS, MAP_SERVICES, SockLbConfig, ipv6};

    proxy_testenv::ensure_bpffs().expect("bpffs");
    let dir = proxy_testenv::PinDir::new(&format!("{}-sizes6", proxy_testenv::unique_prefix()))
        .expect("pin dir");
    let pins = PinLayout::new(dir.path());
    let data = |name: &str| aya::maps::MapData::from_pin(pins.map(name)).expect("pinned map");
    let info = |name: &str| data(name).info().expect("map info");
    // The kernel's own account of a map's memory (`memlock` in its fd's fdinfo).
    let memlock = |name: &str| -> u64 {
        let map = data(name);
        let fdinfo = std::fs::read_to_string(format!(
            "/proc/self/fdinfo/{}",
            map.fd().as_fd().as_raw_fd()
        ))
        .expect("fdinfo");
        (fdinfo.lines())
            .find_map(|l| l.strip_prefix("memlock:"))
            .and_then(|v| v.trim().parse().ok())
            .expect("memlock line")
    };
    let load = |sizes: &MapSizes| {
        load_pinned(
            &pins,
            &DatapathConfig::DEFAULT,
            sizes,
            &SockLbConfig::default(),
            BpfLog::Off,
        )
        .expect("load")
    };
    let six = [
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

    // A node without IPv6: one entry each.
    let m = kube_proxy_ebpf::dataplane::loader::MINIMAL_ENTRIES;
    let minimal = MapSizes {
        services6: m,
        backends6: m,
        rev_nats6: m,
        conntrack6: m,
        snat6: m,
        affinity6: m,
        sock_rev6: m,
        fragments6: m,
        ..MapSizes::default()
    };
    let ebpf = load(&minimal);
    for name in six {
        assert_eq!(info(name).max_entries(), m, "{name}");
    }
    assert_eq!(
        info(MAP_LC_FLOWS).max_entries(),
        minimal.lc_entries(),
        "one least-connection slot per id of both families"
    );
    let services4 = info(MAP_SERVICES).id();
    let ids6: Vec<u32> = six.iter().map(|n| info(n).id()).collect();
    let minimal_bytes: u64 = six.iter().map(|n| memlock(n)).sum();
    drop(ebpf);

    // The node has IPv6 now: sized (the pins of one entry replaced, IPv4's adopted).
    let sized = MapSizes {
        services6: 3_000,
        backends6: 2_000,
        rev_nats6: 300,
        conntrack6: 4_096,
        snat6: 1_024,
        affinity6: 512,
        ..MapSizes::default()
    };
    let ebpf = load(&sized);
    let want = [
        (ipv6::MAP_SERVICES6, 3_000),
        (ipv6::MAP_BACKENDS6, 2_000),
        (ipv6::MAP_REVNAT6, 300),
        (ipv6::MAP_AFFINITY_MATCH6, 3_000),
        (ipv6::MAP_CONNTRACK6, 4_096),
        (ipv6::MAP_SNAT6, 1_024),
        (ipv6::MAP_AFFINITY6, 512),
        (ipv6::MAP_SOCK_REVNAT6, ipv6::SOCK_REVNAT6_CAPACITY),
        (ipv6::MAP_FRAGMENTS6, ipv6::FRAGMENTS6_CAPACITY),
    ];
    for (name, entries) in want {
        assert_eq!(info(name).max_entries(), entries, "{name}");
    }
    assert_eq!(info(MAP_SERVICES).id(), services4, "SERVICES_V1 adopted");
    for (name, old) in six.iter().zip(&ids6) {
        assert_ne!(info(name).id(), *old, "{name}: the one-entry map replaced");
    }
    let sized_bytes: u64 = six.iter().map(|n| memlock(n)).sum();
    eprintln!("IPv6 maps' memlock: {minimal_bytes} B with one entry each, {sized_bytes} B sized");
    assert!(
        minimal_bytes * 20 < sized_bytes,
        "one-entry maps {minimal_bytes} B vs sized {sized_bytes} B"
    );
    // An entry written by this agent is kept by a restart asking for one entry again.
    let key = ipv6::Service6Key::new([0xfd; 16], 80u16.to_be_bytes(), proto::TCP, 0);
    {
        let mut services6: aya::maps::HashMap<_, ipv6::Service6Key, ServiceValue> =
            aya::maps::HashMap::try_from(aya::maps::Map::HashMap(data(ipv6::MAP_SERVICES6)))
                .expect("hash map");
        services6
            .insert(key, ServiceValue::default(), 0)
            .expect("insert");
    }
    let sized_ids: Vec<u32> = six.iter().map(|n| info(n).id()).collect();
    drop(ebpf);
    let ebpf = load(&minimal);
    let adopted: Vec<u32> = six.iter().map(|n| info(n).id()).collect();
    assert_eq!(adopted, sized_ids, "sized maps adopted as they are");
    assert_eq!(info(ipv6::MAP_SERVICES6).max_entries(), 3_000);
    let services6: aya::maps::HashMap<_, ipv6::Service6Key, ServiceValue> =
        aya::maps::HashMap::try_from(aya::maps::Map::HashMap(data(ipv6::MAP_SERVICES6)))
            .expect("hash map");
    assert!(services6.get(&key, 0).is_ok(), "the entry kept");
    drop(ebpf);
}

/// A failed IPv6 source-range or Service CIDR write is reported to the caller (the IPv6 family
/// then syncs again at the next sync, as the IPv4 family retries its marked entries), and a
/// later call writes what is still missing: on tries of one entry, `{a, b}` writes `a` and
/// fails `b`; asking for `{b}` then fails `b` again (added before `a` is removed) and removes
/// `a`; the next call writes `b`.
#[test]
fn a_failed_ipv6_source_range_or_service_cidr_write_is_reported_and_written_by_a_later_sync() {
    require_privileged!();
    use kube_proxy_ebpf::dataplane::{
        ebpf_object::EBPF_OBJECT, service_cidrs::ServiceCidrs, source_ranges::SourceRanges,
    };
    use proxy_common::ipv6::{MAP_SERVICE_CIDRS6, MAP_SOURCE_RANGES6, SourceRange6Key};

    let mut ebpf = aya::EbpfLoader::new()
        .map_max_entries(MAP_SOURCE_RANGES6, 1)
        .map_max_entries(MAP_SERVICE_CIDRS6, 1)
        .load(EBPF_OBJECT)
        .expect("load");
    let mut ranges = SourceRanges::<Ipv6Addr>::from_ebpf(&mut ebpf).expect("SRCRANGES6_V1");
    let range = |last: u8| {
        let mut source = [0x20, 0x01, 0x0d, 0xb8, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0];
        source[4] = last;
        let key = SourceRange6Key {
            frontend_addr: [0xfd; 16],
            frontend_port: 80u16.to_be_bytes(),
            proto: proto::TCP,
            _pad: 0,
            source,
        };
        (proxy_common::ipv6::SOURCE_RANGE6_FRONTEND_BITS + 48, key)
    };
    let (a, b) = (range(1), range(2));
    assert!(!ranges.sync(&BTreeSet::from([a, b])), "b does not fit");
    assert_eq!(ranges.programmed(), &BTreeSet::from([a]));
    assert!(!ranges.sync(&BTreeSet::from([b])), "b still does not fit");
    assert!(ranges.programmed().is_empty(), "a removed");
    assert!(
        ranges.sync(&BTreeSet::from([b])),
        "written by the next call"
    );
    assert_eq!(ranges.programmed(), &BTreeSet::from([b]));

    let mut cidrs = ServiceCidrs::<Ipv6Addr>::from_ebpf(&mut ebpf).expect("SVCCIDRS6_V1");
    let net = |last: u8| {
        let mut o = [0xfd, 0, 0, 0x96, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0];
        o[15] = last;
        (128u32, o)
    };
    let kind = proxy_common::service_cidr::CLUSTER_IP;
    let want = |keys: &[(u32, [u8; 16])]| -> BTreeMap<(u32, [u8; 16]), u32> {
        keys.iter().map(|k| (*k, kind)).collect()
    };
    assert!(
        !cidrs.sync(&want(&[net(1), net(2)])),
        "the second does not fit"
    );
    assert_eq!(cidrs.programmed().len(), 1);
    let written = *cidrs.programmed().keys().next().expect("one");
    let other = if written == net(1) { net(2) } else { net(1) };
    assert!(
        !cidrs.sync(&want(&[other])),
        "still full: the stale one goes after"
    );
    assert!(cidrs.sync(&want(&[other])), "written by the next call");
    assert_eq!(cidrs.programmed(), &want(&[other]));
}

/// The flow hash seed is random per node and kept across agent restarts: the first load draws a
/// nonzero seed and pins it in `SEED_V1`, a restarted agent (same pin dir) gets the same seed, and
/// another node (another pin dir) gets another one.
#[test]
fn the_flow_hash_seed_is_random_per_node_and_kept_across_restarts() {
    require_privileged!();
    use kube_proxy_ebpf::dataplane::bpffs::PinLayout;
    use proxy_common::{MAP_SEED, SockLbConfig};

    proxy_testenv::ensure_bpffs().expect("bpffs");
    let prefix = proxy_testenv::unique_prefix();
    let node = |name: &str| {
        let dir = proxy_testenv::PinDir::new(&format!("{prefix}-{name}")).expect("pin dir");
        let pins = PinLayout::new(dir.path());
        (dir, pins)
    };
    let start = |pins: &PinLayout| {
        let seed = loader::node_seed(pins).expect("seed");
        let config = DatapathConfig {
            hash_seed: seed,
            ..DatapathConfig::DEFAULT
        };
        let sizes = tiny_map_sizes();
        drop(
            load_pinned(pins, &config, &sizes, &SockLbConfig::default(), BpfLog::Off)
                .expect("load"),
        );
        seed
    };
    let pinned = |pins: &PinLayout| -> u32 {
        let data = aya::maps::MapData::from_pin(pins.map(MAP_SEED)).expect("pinned SEED_V1");
        let map: aya::maps::Array<_, u32> =
            aya::maps::Array::try_from(aya::maps::Map::Array(data)).expect("array");
        map.get(&0, 0).expect("seed entry")
    };
    let (_a_dir, a) = node("seed-a");
    let (_b_dir, b) = node("seed-b");
    let first = start(&a);
    assert_ne!(first, 0, "the seed is drawn, not the default 0");
    assert_eq!(pinned(&a), first, "the seed is pinned for the next agent");
    assert_eq!(start(&a), first, "a restarted agent keeps the node's seed");
    let other = start(&b);
    assert_ne!(other, first, "another node draws its own seed");
    assert_eq!(pinned(&b), other);
}

/// A pinned map under one of our names but of another shape (another type, key or value size:
/// another layout, another tool) is replaced at load, with a map of the object's shape; the
/// well-shaped pins are adopted (same kernel map).
#[test]
fn a_pinned_map_of_another_shape_is_replaced_not_adopted() {
    require_privileged!();
    use kube_proxy_ebpf::dataplane::bpffs::PinLayout;
    use proxy_common::{MAP_BACKENDS, MAP_SERVICES, SockLbConfig};

    proxy_testenv::ensure_bpffs().expect("bpffs");
    let dir = proxy_testenv::PinDir::new(&format!("{}-shape", proxy_testenv::unique_prefix()))
        .expect("pin dir");
    let pins = PinLayout::new(dir.path());
    let sizes = tiny_map_sizes();
    let load = || {
        drop(
            load_pinned(
                &pins,
                &DatapathConfig::DEFAULT,
                &sizes,
                &SockLbConfig::default(),
                BpfLog::Off,
            )
            .expect("load"),
        )
    };
    let info = |name: &str| {
        aya::maps::MapData::from_pin(pins.map(name))
            .and_then(|m| m.info())
            .unwrap_or_else(|e| panic!("{name}: {e}"))
    };
    load();
    let ids = |skip: &[&str]| -> Vec<(&str, u32)> {
        proxy_common::ALL_MAPS
            .iter()
            .filter(|n| !skip.contains(n))
            .map(|&n| (n, info(n).id()))
            .collect()
    };
    let others = ids(&[MAP_SERVICES, MAP_BACKENDS]);
    load();
    assert_eq!(
        ids(&[MAP_SERVICES, MAP_BACKENDS]),
        others,
        "a restart adopts every well-shaped pin"
    );
    // Same names, other shapes: SERVICES with an 8-byte key, BACKENDS an array.
    for (name, spec) in [
        (
            MAP_SERVICES,
            ["hash", "key", "8", "value", "16", "entries", "64"],
        ),
        (
            MAP_BACKENDS,
            ["array", "key", "4", "value", "8", "entries", "64"],
        ),
    ] {
        let path = pins.map(name);
        std::fs::remove_file(&path).expect("unpin");
        let out = std::process::Command::new("bpftool")
            .args(["map", "create"])
            .arg(&path)
            .arg("type")
            .args(spec)
            .args(["name", name])
            .output()
            .expect("bpftool");
        assert!(
            out.status.success(),
            "bpftool map create {name}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let wrong_services = info(MAP_SERVICES).id();
    assert_eq!(info(MAP_SERVICES).key_size(), 8);

    load();
    let services = info(MAP_SERVICES);
    assert_ne!(
        services.id(),
        wrong_services,
        "the 8-byte-key SERVICES_V1 was adopted"
    );
    assert_eq!((services.key_size(), services.value_size()), (12, 32));
    assert_eq!(
        info(MAP_BACKENDS).map_type().expect("type"),
        aya::maps::MapType::Hash,
        "the array BACKENDS_V1 was adopted"
    );
    assert_eq!(
        ids(&[MAP_SERVICES, MAP_BACKENDS]),
        others,
        "the well-shaped pins are adopted, not replaced"
    );
}

/// Upgrade from the last agent before IPv6 (56a459a^1): its pins are the 19 IPv4 maps of that
/// release, with a 6-entry tail-call array and 56 counters. The IPv6 work kept every IPv4 map's
/// shape (separate maps per family, docs/architecture.md, "ABI"), so an upgraded agent adopts those maps with
/// their state (a live flow's conntrack entries, a Service, a client's affinity record: the same
/// kernel maps, entries as they were), replaces only the two program-side arrays that grew (the
/// tail calls, the counters: no flow state in them) and creates the IPv6 maps beside them.
#[test]
fn a_pre_ipv6_agents_pins_are_adopted_with_their_ipv4_flow_state() {
    require_privileged!();
    use aya::maps::{HashMap, Map, MapData};
    use kube_proxy_ebpf::dataplane::{bpffs::PinLayout, ebpf_object::EBPF_OBJECT};
    use proxy_common::{
        AffinityKey, AffinityValue, COUNTER_COUNT, CtKey, CtValue, MAP_AFFINITY, MAP_CONNTRACK,
        MAP_SERVICES, MAP_STATS, MAP_TAIL_CALLS, TAIL_CALL_COUNT, ct_dir, maps::ALL_MAPS,
    };

    /// The pre-IPv6 release's pinned set (its `ALL_MAPS`) and the two sizes that differ now.
    const PRE_IPV6_MAPS: usize = 19;
    const PRE_IPV6_TAIL_CALLS: u32 = 6;
    const PRE_IPV6_COUNTERS: u32 = 56;
    let old_maps = &ALL_MAPS[..PRE_IPV6_MAPS];
    assert!(
        old_maps
            .iter()
            .all(|m| m.ends_with("_V1") && !m.contains('6')),
        "ALL_MAPS keeps the pre-IPv6 maps first: {old_maps:?}"
    );

    proxy_testenv::ensure_bpffs().expect("bpffs");
    let dir = proxy_testenv::PinDir::new(&format!("{}-pre6", proxy_testenv::unique_prefix()))
        .expect("pin dir");
    let pins = PinLayout::new(dir.path());
    pins.create().expect("pin directories");
    let info = |name: &str| {
        MapData::from_pin(pins.map(name))
            .and_then(|m| m.info())
            .unwrap_or_else(|e| panic!("pinned {name}: {e}"))
    };
    // Opens a pinned hash map (CONNTRACK and AFFINITY are LRU hashes) as `HashMap<K, V>`.
    fn open<K: aya::Pod, V: aya::Pod>(pins: &PinLayout, name: &str) -> HashMap<MapData, K, V> {
        let data = MapData::from_pin(pins.map(name)).expect(name);
        let map = match data.info().expect(name).map_type() {
            Ok(aya::maps::MapType::LruHash) => Map::LruHashMap(data),
            _ => Map::HashMap(data),
        };
        HashMap::try_from(map).expect(name)
    }
    let mut old = aya::EbpfLoader::new();
    for &m in old_maps {
        old.map_pin_path(m, pins.map(m));
    }
    old.map_max_entries(MAP_TAIL_CALLS, PRE_IPV6_TAIL_CALLS)
        .map_max_entries(MAP_STATS, PRE_IPV6_COUNTERS);
    drop(old.load(EBPF_OBJECT).expect("the older agent's load"));
    assert!(
        !pins.map(proxy_common::ipv6::MAP_CONNTRACK6).exists(),
        "the older agent pinned no IPv6 maps"
    );

    // Its state: a flow (both conntrack entries), a Service, an affinity record.
    let original = CtKey {
        saddr: [10, 244, 1, 2],
        daddr: [10, 96, 0, 10],
        sport: 40_000u16.to_be_bytes(),
        dport: 80u16.to_be_bytes(),
        proto: proto::TCP,
        dir: ct_dir::ORIGINAL,
        _pad: [0; 2],
    };
    let reply = CtKey {
        saddr: [10, 244, 2, 7],
        daddr: [10, 244, 1, 2],
        sport: 8080u16.to_be_bytes(),
        dport: 40_000u16.to_be_bytes(),
        dir: ct_dir::REPLY,
        ..original
    };
    let flow = CtValue {
        last_seen_ns: 123_456_789,
        created_ns: 100_000_000,
        backend_id: 7,
        rev_nat_id: 3,
        frontend_addr: [10, 96, 0, 10],
        backend_addr: [10, 244, 2, 7],
        frontend_port: 80u16.to_be_bytes(),
        backend_port: 8080u16.to_be_bytes(),
        state: ct_state::ESTABLISHED,
        ..CtValue::default()
    };
    let service = ServiceKey::new([10, 96, 0, 10], 80u16.to_be_bytes(), proto::TCP, 0);
    let service_value = ServiceValue {
        count: 1,
        rev_nat_id: 3,
        ..ServiceValue::default()
    };
    let client = AffinityKey {
        affinity_id: 5,
        client: [10, 244, 1, 2],
    };
    let record = AffinityValue {
        backend_id: 7,
        _pad: 0,
        last_used_ns: 123_000_000,
    };
    {
        let mut ct: HashMap<_, CtKey, CtValue> = open(&pins, MAP_CONNTRACK);
        ct.insert(original, flow, 0).expect("original entry");
        ct.insert(reply, flow, 0).expect("reply entry");
        let mut svc: HashMap<_, ServiceKey, ServiceValue> = open(&pins, MAP_SERVICES);
        svc.insert(service, service_value, 0).expect("service");
        let mut aff: HashMap<_, AffinityKey, AffinityValue> = open(&pins, MAP_AFFINITY);
        aff.insert(client, record, 0).expect("affinity");
    }
    let ids: Vec<(&str, u32)> = (old_maps.iter()).map(|&m| (m, info(m).id())).collect();

    let ebpf = load_pinned_default(&pins);
    for (m, id) in &ids {
        let replaced = [MAP_TAIL_CALLS, MAP_STATS].contains(m);
        assert_eq!(
            info(m).id() == *id,
            !replaced,
            "{m}: {}",
            if replaced {
                "must be replaced (it grew)"
            } else {
                "must be adopted, not replaced"
            }
        );
    }
    assert_eq!(info(MAP_TAIL_CALLS).max_entries(), TAIL_CALL_COUNT);
    assert_eq!(info(MAP_STATS).max_entries(), COUNTER_COUNT);
    for m in &ALL_MAPS[PRE_IPV6_MAPS..] {
        assert!(
            pins.map(m).exists(),
            "{m}: the IPv6 map is created and pinned"
        );
    }
    let ct: HashMap<_, CtKey, CtValue> = open(&pins, MAP_CONNTRACK);
    assert_eq!(
        ct.get(&original, 0).ok(),
        Some(flow),
        "the flow's ORIGINAL entry kept"
    );
    assert_eq!(ct.get(&reply, 0).ok(), Some(flow), "its REPLY entry kept");
    let svc: HashMap<_, ServiceKey, ServiceValue> = open(&pins, MAP_SERVICES);
    assert_eq!(svc.get(&service, 0).ok(), Some(service_value));
    let aff: HashMap<_, AffinityKey, AffinityValue> = open(&pins, MAP_AFFINITY);
    assert_eq!(aff.get(&client, 0).ok(), Some(record));
    drop(ebpf);
}
