//! Privileged: the map layer against real kernel maps (unpinned load). Batched writes must leave
//! exactly what the plan says, in any mix of puts and deletes, including deletes of keys that are
//! already gone. SNAT garbage collection must remove exactly the dead flows' entries. A pinned
//! stats array from an agent with fewer counters is replaced at load.
//!
//! Run by `sudo cargo xtask test` (KPE_PRIVILEGED=1); skipped otherwise.

use std::{
    collections::{BTreeMap, BTreeSet},
    net::Ipv4Addr,
};

use kube_proxy_ebpf::{
    dataplane::{
        clock::monotonic_ns,
        loader,
        maps::{ServiceMaps, Snat},
    },
    diff,
    model::{
        DesiredBackend, DesiredFrontend, DesiredState, EndpointAddr, Frontend, FrontendKind,
        Protocol, ServicePortName,
    },
    programmed::{Capacities, MapOp, Programmed},
    snat_gc::{self, Collected},
};
use proxy_common::{
    DatapathConfig, HAIRPIN_SNAT_ADDR, ServiceKey, SnatKey, SnatValue, ct_state, proto,
};
use proxy_testenv::require_privileged;

fn state(services: u32, backends_each: u32, offset: u32) -> DesiredState {
    let mut frontends = BTreeMap::new();
    for s in 0..services {
        let frontend = Frontend::new(Ipv4Addr::from(0x0a60_0000 + s), 80, Protocol::Tcp);
        let backends = (0..backends_each)
            .map(|b| DesiredBackend {
                endpoint: EndpointAddr {
                    addr: Ipv4Addr::from(0x0af4_0000 + s * 16 + b + offset),
                    port: 8080,
                    protocol: Protocol::Tcp,
                },
                terminating: false,
                local: false,
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
        1_000 * 10 + 1_000 * 11 + 1_000,
        "backends + slots/frontends + rev-NATs"
    );
    assert_eq!(shadow.frontend_count(), 1_000);

    // Shrink and move: half the Services go, the rest get other backends (puts + deletes).
    sync(&mut maps, &mut shadow, &state(250, 4, 3));
    assert_eq!(shadow.frontend_count(), 250);
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

/// An agent with more datapath counters than the one that pinned the maps replaces the pinned
/// STATS array (adopting it would silently drop the new counters); the other maps are adopted.
#[test]
fn a_pinned_stats_array_with_fewer_counters_is_replaced() {
    require_privileged!();
    use kube_proxy_ebpf::{
        dataplane::{bpffs::PinLayout, loader::MapSizes},
        ebpf_object::EBPF_OBJECT,
    };
    use proxy_common::{COUNTER_COUNT, MAP_SERVICES, MAP_STATS, SockLbConfig};

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

    let ebpf = loader::load_pinned(
        &pins,
        &DatapathConfig::DEFAULT,
        &MapSizes::default(),
        &SockLbConfig::default(),
    )
    .expect("load");
    assert_eq!(max_entries(MAP_STATS), COUNTER_COUNT);
    let adopted = aya::maps::MapData::from_pin(pins.map(MAP_SERVICES))
        .and_then(|m| m.info())
        .expect("services")
        .id();
    assert_eq!(adopted, services_id, "SERVICES_V1 is adopted, not replaced");
    drop(ebpf);
}
