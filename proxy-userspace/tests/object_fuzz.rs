//! Unprivileged object fuzz (issue 13, item 3): seeded snapshots of good Services mixed with
//! hostile ones (1,000 ports, 10,000 endpoints in one slice, duplicate ports, huge names and
//! annotations, invalid IPs and ports, conflicting claims, orphan slices, and random mutations of
//! every field) go through the agent's own pipeline — `TranslateCache::update` and
//! `Planner::plan`, as `agent.rs` and the xtask bench call them — and through the manifest
//! loader as YAML text. Invariants: nothing panics; every good Service's frontend is in the
//! desired state with all its endpoints and is not skipped by the plan; every problem names a
//! hostile object (never a good one); every hostile object that cannot be programmed is named
//! by a problem; and what an object makes is bounded by its size (frontends by ports ×
//! addresses, backends by endpoints). A failure prints the seed.

use std::{collections::BTreeMap, net::Ipv4Addr};

use k8s_openapi::{
    api::{
        core::v1::{Service, ServicePort, ServiceSpec},
        discovery::v1::{Endpoint, EndpointConditions, EndpointPort, EndpointSlice},
    },
    apimachinery::pkg::{apis::meta::v1::ObjectMeta, util::intstr::IntOrString},
};
use kube_proxy_ebpf::{
    pipeline::{
        incremental::Planner,
        model::{Frontend, Protocol},
        programmed::{Capacities, Programmed},
        translate::NodeContext,
        translate_cache::TranslateCache,
    },
    sources::{manifests, snapshot::Snapshot},
};
use proxy_common::Scheduler;

const NS: &str = "fuzz";

/// Counts the bytes each thread holds (allocated minus freed on it), so a test can measure what
/// the pipeline keeps per object while other tests run on other threads.
struct Counting;

thread_local! {
    static LIVE: std::cell::Cell<isize> = const { std::cell::Cell::new(0) };
}

// SAFETY: forwards to the system allocator; the counter is a const-initialized thread-local
// Cell (no allocation, no reentrancy).
unsafe impl std::alloc::GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: std::alloc::Layout) -> *mut u8 {
        let _ = LIVE.try_with(|l| l.set(l.get() + layout.size() as isize));
        // SAFETY: the caller's layout contract is passed on unchanged.
        unsafe { std::alloc::System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: std::alloc::Layout) {
        let _ = LIVE.try_with(|l| l.set(l.get() - layout.size() as isize));
        // SAFETY: `ptr` came from `alloc` above with this layout.
        unsafe { std::alloc::System.dealloc(ptr, layout) }
    }
}

#[global_allocator]
static ALLOC: Counting = Counting;

fn live() -> isize {
    LIVE.with(|l| l.get())
}

/// xorshift64*: a deterministic stream per seed (no dependency, reproducible from the seed).
struct Rng(u64);

impl Rng {
    fn new(seed: u64) -> Self {
        Self(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
    fn pick<'a, T>(&mut self, v: &'a [T]) -> &'a T {
        &v[self.below(v.len() as u64) as usize]
    }
}

/// One Service port as written in the object.
#[derive(Clone)]
struct PortSpec {
    name: String,
    port: i32,
    target: IntOrString,
    protocol: String,
}

/// A Service and its slices, with what the test expects of it.
struct Obj {
    name: String,
    cluster_ip: String,
    external_ips: Vec<String>,
    ports: Vec<PortSpec>,
    annotations: BTreeMap<String, String>,
    /// Each slice: (name, addressType, endpoint addresses, slice ports (name, port, protocol),
    /// service-name label).
    slices: Vec<SliceSpec>,
    /// Good objects must be programmed in full and never blamed.
    good: bool,
    /// Hostile objects that cannot be programmed (as a whole or in part): a problem must name
    /// them.
    must_be_named: bool,
}

#[derive(Clone)]
struct SliceSpec {
    name: String,
    address_type: String,
    addresses: Vec<String>,
    ports: Vec<(String, i32, String)>,
    label: Option<String>,
}

fn tcp(name: &str, port: i32, target: i32) -> PortSpec {
    PortSpec {
        name: name.into(),
        port,
        target: IntOrString::Int(target),
        protocol: "TCP".into(),
    }
}

fn good(i: usize, rng: &mut Rng) -> Obj {
    let name = format!("good-{i}");
    let ip = Ipv4Addr::from(u32::from(Ipv4Addr::new(10, 96, 10, 0)) + i as u32);
    let n = 1 + rng.below(5) as usize;
    let addresses: Vec<String> = (0..n)
        .map(|j| Ipv4Addr::new(10, 244, (i / 200) as u8, (i % 200) as u8 + j as u8).to_string())
        .collect();
    Obj {
        cluster_ip: ip.to_string(),
        external_ips: Vec::new(),
        ports: vec![tcp("http", 80, 8080)],
        annotations: BTreeMap::new(),
        slices: vec![SliceSpec {
            name: format!("{name}-abc"),
            address_type: "IPv4".into(),
            addresses,
            ports: vec![("http".into(), 8080, "TCP".into())],
            label: Some(name.clone()),
        }],
        name,
        good: true,
        must_be_named: false,
    }
}

/// A hostile Service base: a valid one at 10.96.200.0/24 that the cases then break.
fn hostile_base(name: String, i: usize) -> Obj {
    let ip = Ipv4Addr::from(u32::from(Ipv4Addr::new(10, 96, 200, 0)) + i as u32);
    Obj {
        cluster_ip: ip.to_string(),
        external_ips: Vec::new(),
        ports: vec![tcp("http", 80, 8080)],
        annotations: BTreeMap::new(),
        slices: vec![SliceSpec {
            name: format!("{name}-s"),
            address_type: "IPv4".into(),
            addresses: vec![Ipv4Addr::new(10, 245, 0, 1 + (i % 250) as u8).to_string()],
            ports: vec![("http".into(), 8080, "TCP".into())],
            label: Some(name.clone()),
        }],
        name,
        good: false,
        must_be_named: false,
    }
}

/// The fixed hostile cases of the issue, then `random` mutated ones.
fn hostile(rng: &mut Rng, random: usize, good_ips: &[String]) -> Vec<Obj> {
    let mut out = Vec::new();
    let mut next = 0usize;
    let mut base = |what: &str| {
        next += 1;
        hostile_base(format!("hostile-{what}-{next}"), next)
    };

    // 1,000 ports on one Service, each with its slice port.
    let mut o = base("ports");
    o.ports = (0..1000)
        .map(|p| tcp(&format!("p{p}"), 1000 + p, 20000 + p))
        .collect();
    o.slices[0].ports = (0..1000)
        .map(|p| (format!("p{p}"), 20000 + p, "TCP".to_owned()))
        .collect();
    out.push(o);

    // 10,000 endpoints in one slice.
    let mut o = base("endpoints");
    o.slices[0].addresses = (0..10_000u32)
        .map(|j| Ipv4Addr::from(u32::from(Ipv4Addr::new(10, 246, 0, 0)) + j).to_string())
        .collect();
    out.push(o);

    // The same port twice (same and different names).
    let mut o = base("dupports");
    o.ports = vec![tcp("a", 80, 8080), tcp("a", 80, 8080), tcp("b", 80, 8081)];
    out.push(o);

    // Huge name and annotations.
    let mut o = base("huge");
    o.name = format!("hostile-huge-{}", "x".repeat(100_000));
    o.slices[0].label = Some(o.name.clone());
    o.annotations = (0..100)
        .map(|k| (format!("fuzz/{k}-{}", "k".repeat(1000)), "v".repeat(10_000)))
        .collect();
    out.push(o);

    // Invalid addresses.
    for bad in [
        "10.96.300.1",
        "not-an-ip",
        "",
        "fd00::1",
        "10.96.0.1/24",
        "0x0a600001",
    ] {
        let mut o = base("clusterip");
        o.cluster_ip = bad.into();
        // "" is headless (skipped silently, like upstream); fd00::1 is a valid IPv6 Service.
        o.must_be_named = !matches!(bad, "" | "fd00::1");
        out.push(o);
    }
    let mut o = base("epaddr");
    o.slices[0].addresses = vec![
        "999.1.1.1".into(),
        "".into(),
        "fe80::1".into(),
        "10.245.9.9".into(),
    ];
    out.push(o);
    let mut o = base("exip");
    o.external_ips = vec!["999.0.0.1".into(), "x".into()];
    o.must_be_named = true;
    out.push(o);

    // Bad ports and protocols.
    for (port, proto) in [(0, "TCP"), (70000, "TCP"), (-1, "UDP"), (80, "BOGUS")] {
        let mut o = base("port");
        o.ports = vec![PortSpec {
            name: "p".into(),
            port,
            target: IntOrString::Int(8080),
            protocol: proto.into(),
        }];
        o.must_be_named = true;
        out.push(o);
    }
    let mut o = base("targetname");
    o.ports[0].target = IntOrString::String("no-such-port".into());
    out.push(o);
    let mut o = base("sched");
    o.annotations.insert(
        kube_proxy_ebpf::pipeline::translate::ANNOTATION_SCHEDULER.into(),
        "bogus".into(),
    );
    o.must_be_named = true;
    out.push(o);

    // Conflicting claims: two hostile Services on one ClusterIP:port, and an externalIP that is
    // a good Service's ClusterIP (the ClusterIP keeps it).
    let a = base("conflict-a");
    let mut b = base("conflict-b");
    b.cluster_ip = a.cluster_ip.clone();
    b.must_be_named = true;
    out.push(a);
    out.push(b);
    let mut o = base("steal");
    o.external_ips = vec![good_ips[0].clone()];
    o.must_be_named = true;
    out.push(o);

    // Slices of no Service, without a label, of an unknown address type.
    let mut o = base("orphan");
    o.slices[0].label = Some("nobody-has-this-name".into());
    out.push(o);
    let mut o = base("nolabel");
    o.slices[0].label = None;
    out.push(o);
    let mut o = base("addrtype");
    o.slices[0].address_type = "Bogus".into();
    out.push(o);

    // Random mutations of every field.
    let ips = [
        "10.96.201.7",
        "10.96.201.7",
        "256.1.1.1",
        "",
        "None",
        "fd00::5",
        "10.96.201.8",
    ];
    let ports = [80, 80, 0, 65535, 65536, -5, i32::MAX, i32::MIN];
    let protos = ["TCP", "UDP", "SCTP", "tcp", "", "ICMP"];
    let addrs = ["10.245.1.1", "10.245.1.1", "1.2.3", "::1", "", "10.245.1.2"];
    let types = ["IPv4", "IPv4", "IPv6", "FQDN", ""];
    for _ in 0..random {
        let mut o = base("random");
        o.cluster_ip = rng.pick(&ips).to_string();
        let n_ports = rng.below(4) as usize;
        o.ports = (0..n_ports)
            .map(|k| PortSpec {
                name: if rng.below(3) == 0 {
                    String::new()
                } else {
                    format!("p{}", rng.below(3) + k as u64)
                },
                port: *rng.pick(&ports),
                target: if rng.below(4) == 0 {
                    IntOrString::String(format!("p{}", rng.below(3)))
                } else {
                    IntOrString::Int(*rng.pick(&ports))
                },
                protocol: rng.pick(&protos).to_string(),
            })
            .collect();
        for s in &mut o.slices {
            s.address_type = rng.pick(&types).to_string();
            s.addresses = (0..rng.below(6))
                .map(|_| rng.pick(&addrs).to_string())
                .collect();
            s.ports = (0..rng.below(3))
                .map(|k| {
                    (
                        format!("p{k}"),
                        *rng.pick(&ports),
                        rng.pick(&protos).to_string(),
                    )
                })
                .collect();
        }
        if rng.below(3) == 0 {
            o.external_ips = vec![rng.pick(&ips).to_string()];
        }
        out.push(o);
    }
    out
}

fn service(o: &Obj) -> Service {
    Service {
        metadata: ObjectMeta {
            name: Some(o.name.clone()),
            namespace: Some(NS.into()),
            annotations: (!o.annotations.is_empty()).then(|| o.annotations.clone()),
            ..Default::default()
        },
        spec: Some(ServiceSpec {
            type_: Some("ClusterIP".into()),
            cluster_ip: Some(o.cluster_ip.clone()),
            cluster_ips: Some(vec![o.cluster_ip.clone()]),
            external_ips: (!o.external_ips.is_empty()).then(|| o.external_ips.clone()),
            ports: Some(
                o.ports
                    .iter()
                    .map(|p| ServicePort {
                        name: Some(p.name.clone()),
                        port: p.port,
                        target_port: Some(p.target.clone()),
                        protocol: Some(p.protocol.clone()),
                        ..Default::default()
                    })
                    .collect(),
            ),
            ..Default::default()
        }),
        ..Default::default()
    }
}

fn slice(s: &SliceSpec) -> EndpointSlice {
    EndpointSlice {
        metadata: ObjectMeta {
            name: Some(s.name.clone()),
            namespace: Some(NS.into()),
            labels: s
                .label
                .as_ref()
                .map(|l| BTreeMap::from([("kubernetes.io/service-name".to_owned(), l.clone())])),
            ..Default::default()
        },
        address_type: s.address_type.clone(),
        ports: Some(
            s.ports
                .iter()
                .map(|(name, port, protocol)| EndpointPort {
                    name: Some(name.clone()),
                    port: Some(*port),
                    protocol: Some(protocol.clone()),
                    ..Default::default()
                })
                .collect(),
        ),
        endpoints: Some(
            s.addresses
                .iter()
                .map(|a| Endpoint {
                    addresses: vec![a.clone()],
                    conditions: Some(EndpointConditions {
                        ready: Some(true),
                        serving: Some(true),
                        terminating: Some(false),
                    }),
                    ..Default::default()
                })
                .collect(),
        ),
    }
}

fn node() -> NodeContext {
    NodeContext {
        node_name: "fuzz-node".into(),
        zone: None,
        scheduler: Scheduler::Random,
    }
}

/// Good and hostile objects in a seeded order.
fn objects(seed: u64, goods: usize, random: usize) -> Vec<Obj> {
    let mut rng = Rng::new(seed);
    let mut all: Vec<Obj> = (0..goods).map(|i| good(i, &mut rng)).collect();
    let good_ips: Vec<String> = all.iter().map(|o| o.cluster_ip.clone()).collect();
    all.extend(hostile(&mut rng, random, &good_ips));
    // Fisher-Yates: hostile objects anywhere in the lists.
    for i in (1..all.len()).rev() {
        all.swap(i, rng.below(i as u64 + 1) as usize);
    }
    all
}

/// The problem's object names `o` (`Kind fuzz/name`; a huge name may be cut).
fn names(problem_object: &str, o: &Obj) -> bool {
    let want = format!("{NS}/{}", o.name);
    let cut = &want[..want.len().min(200)];
    problem_object.contains(cut) || o.slices.iter().any(|s| problem_object.contains(&s.name))
}

fn run_seed(seed: u64) {
    let objs = objects(seed, 200, 60);
    let services: Vec<Service> = objs.iter().map(service).collect();
    let slices: Vec<EndpointSlice> = objs
        .iter()
        .flat_map(|o| o.slices.iter().map(slice))
        .collect();
    let snapshot = Snapshot::new(services, slices);

    let mut cache = TranslateCache::new();
    let changes = cache.update(&snapshot, &node(), &[], true);
    let mut planner = Planner::new(&Programmed::default());
    planner.desired_changes(&changes, cache.desired());
    let plan = planner.plan(
        cache.desired(),
        &Programmed::default(),
        &Capacities::default(),
        true,
    );
    let problems = cache.problems();

    // Every problem names a hostile object, never a good one.
    for p in &problems {
        let blamed: Vec<&Obj> = objs.iter().filter(|o| names(&p.object, o)).collect();
        assert!(
            !blamed.is_empty(),
            "seed {seed}: problem names no object of the snapshot: {}",
            p.object.chars().take(300).collect::<String>()
        );
        assert!(
            !blamed
                .iter()
                .any(|o| o.good && p.object.ends_with(&format!("/{}", o.name))),
            "seed {seed}: a good Service is blamed: {p}"
        );
    }
    // Every hostile object that cannot be (fully) programmed is named.
    for o in objs.iter().filter(|o| o.must_be_named) {
        assert!(
            problems.iter().any(|p| names(&p.object, o)),
            "seed {seed}: no problem names {}: problems {:?}",
            o.name.chars().take(60).collect::<String>(),
            problems.iter().map(|p| p.to_string()).collect::<Vec<_>>()
        );
    }
    // Every good Service is programmed with all its endpoints, and the plan skips none.
    let desired = cache.desired();
    for o in objs.iter().filter(|o| o.good) {
        let ip: Ipv4Addr = o.cluster_ip.parse().expect("good ClusterIP");
        let f = Frontend::new(ip, 80, Protocol::Tcp);
        let d = desired
            .frontends
            .get(&f)
            .unwrap_or_else(|| panic!("seed {seed}: {} ({f:?}) not desired", o.name));
        assert_eq!(
            d.service.name, o.name,
            "seed {seed}: {f:?} owned by another"
        );
        assert_eq!(
            d.backends.len(),
            o.slices[0].addresses.len(),
            "seed {seed}: {} backends",
            o.name
        );
        assert!(
            !plan.skipped.iter().any(|(s, _)| s.addr == ip),
            "seed {seed}: the plan skips {}",
            o.name
        );
    }
    assert!(!plan.ops.is_empty(), "seed {seed}: empty plan");
    // Hostile but valid objects are programmed in full too: 1,000 ports, 10,000 endpoints, a
    // huge name with huge annotations.
    let of = |prefix: &str| -> Vec<_> {
        desired
            .frontends
            .values()
            .filter(|d| d.service.name.starts_with(prefix))
            .collect()
    };
    assert_eq!(of("hostile-ports-").len(), 1000, "seed {seed}: 1,000 ports");
    let big = of("hostile-endpoints-");
    assert_eq!(big.len(), 1, "seed {seed}");
    assert_eq!(
        big[0].backends.len(),
        10_000,
        "seed {seed}: 10,000 endpoints"
    );
    assert_eq!(
        of("hostile-huge-").len(),
        1,
        "seed {seed}: the huge Service"
    );
    for prefix in ["hostile-ports-", "hostile-endpoints-", "hostile-huge-"] {
        let skipped: Vec<_> = plan
            .skipped
            .iter()
            .filter(|(f, _)| {
                of(prefix).iter().any(|d| {
                    desired
                        .frontends
                        .get(f)
                        .is_some_and(|x| x.service == d.service)
                })
            })
            .collect();
        assert!(
            skipped.is_empty(),
            "seed {seed}: the plan skips {prefix}: {:?}",
            skipped.first()
        );
    }
    // What each object makes is bounded by its size.
    for o in &objs {
        let made: Vec<_> = desired
            .frontends
            .values()
            .filter(|d| d.service.namespace == NS && d.service.name == o.name)
            .collect();
        let addrs = 1 + o.external_ips.len();
        assert!(
            made.len() <= 2 * o.ports.len() * addrs,
            "seed {seed}: {} makes {} frontends from {} ports",
            o.name.chars().take(60).collect::<String>(),
            made.len(),
            o.ports.len()
        );
        let endpoints: usize = o.slices.iter().map(|s| s.addresses.len()).sum();
        for d in made {
            assert!(
                d.backends.len() + d.retained.len() <= endpoints,
                "seed {seed}: {} has {} backends from {endpoints} endpoints",
                o.name.chars().take(60).collect::<String>(),
                d.backends.len() + d.retained.len()
            );
        }
    }
    // Problems are bounded too: at most a few per object and port, each of bounded length.
    let ports: usize = objs.iter().map(|o| o.ports.len() + 4).sum();
    assert!(
        problems.len() <= 4 * ports,
        "seed {seed}: {} problems",
        problems.len()
    );
}

#[test]
fn hostile_objects_never_panic_never_blame_good_ones_and_stay_bounded() {
    for seed in 0..8 {
        if let Err(e) = std::panic::catch_unwind(|| run_seed(seed)) {
            let msg = e
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| e.downcast_ref::<&str>().map(|s| s.to_string()))
                .unwrap_or_default();
            panic!(
                "seed {seed}: {}",
                msg.chars().take(4000).collect::<String>()
            );
        }
    }
}

/// YAML text through the manifest loader: hostile documents next to good ones in one folder.
#[test]
fn hostile_manifests_are_skipped_with_a_named_problem_and_the_rest_loads() {
    let dir = std::env::temp_dir().join(format!("kpe-object-fuzz-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("temp dir");
    struct Gone(std::path::PathBuf);
    impl Drop for Gone {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }
    let _gone = Gone(dir.clone());

    let mut rng = Rng::new(7);
    let goods: Vec<Obj> = (0..20).map(|i| good(i, &mut rng)).collect();
    let mut good_text = String::new();
    for o in &goods {
        good_text.push_str("---\n");
        good_text.push_str(&serde_json::to_string(&service(o)).expect("json"));
        good_text.push_str("\n---\n");
        let mut v = serde_json::to_value(slice(&o.slices[0])).expect("json");
        v["apiVersion"] = "discovery.k8s.io/v1".into();
        v["kind"] = "EndpointSlice".into();
        good_text.push_str(&v.to_string());
        good_text.push('\n');
    }
    // serde_json's Service has no apiVersion/kind: add them as the loader dispatches on them.
    let good_text = good_text.replace(
        "{\"metadata\":{\"name\":\"good-",
        "{\"apiVersion\":\"v1\",\"kind\":\"Service\",\"metadata\":{\"name\":\"good-",
    );
    std::fs::write(dir.join("a-good.yaml"), &good_text).expect("write");

    let huge = "y".repeat(300_000);
    let hostile_docs = [
        ("b-notyaml.yaml", "{{{{ not: [yaml".to_owned()),
        (
            "c-wrongtype.yaml",
            "apiVersion: v1\nkind: Service\nmetadata:\n  name: hostile-types\n  namespace: fuzz\nspec:\n  ports: \"eighty\"\n".to_owned(),
        ),
        (
            "d-hugename.yaml",
            format!("apiVersion: v1\nkind: Service\nmetadata:\n  name: hostile-{huge}\n  namespace: fuzz\nspec:\n  clusterIP: 10.96.250.1\n  ports:\n  - port: 80\n"),
        ),
        (
            "e-deep.yaml",
            format!("apiVersion: v1\nkind: Service\nmetadata:\n  name: hostile-deep\n  namespace: fuzz\n  annotations:\n    a: {}{}\n", "[".repeat(2000), "]".repeat(2000)),
        ),
        (
            "f-unknown.yaml",
            "apiVersion: v1\nkind: Pod\nmetadata:\n  name: hostile-pod\n".to_owned(),
        ),
        (
            "g-noname.yaml",
            "apiVersion: v1\nkind: Service\nspec:\n  clusterIP: 10.96.250.2\n".to_owned(),
        ),
        ("h-binary.yaml", String::from_utf8_lossy(&[0xff, 0xfe, 0, 1, 2, b'\n']).into_owned()),
        (
            "i-badip.yaml",
            "apiVersion: v1\nkind: Service\nmetadata:\n  name: hostile-badip\n  namespace: fuzz\nspec:\n  clusterIP: 10.96.999.1\n  ports:\n  - port: 80\n".to_owned(),
        ),
    ];
    for (file, text) in &hostile_docs {
        std::fs::write(dir.join(file), text).expect("write");
    }

    let load = std::panic::catch_unwind(|| manifests::load_dir(&dir)).expect("load_dir panicked");
    // Every good object loaded.
    let loaded: Vec<String> = load
        .snapshot
        .services
        .iter()
        .filter_map(|s| s.name.as_deref().map(str::to_owned))
        .collect();
    for o in &goods {
        assert!(
            loaded.contains(&o.name),
            "{} not loaded: {loaded:?}",
            o.name
        );
    }
    assert!(
        load.snapshot.endpoint_slices.len() >= goods.len(),
        "slices loaded: {}",
        load.snapshot.endpoint_slices.len()
    );
    // No problem is about the good file; the unreadable documents are named by file.
    for p in &load.problems {
        assert!(!p.source.ends_with("a-good.yaml"), "good file blamed: {p}");
        assert!(
            p.reason.len() < 10_000,
            "unbounded reason: {} bytes",
            p.reason.len()
        );
    }
    for file in [
        "b-notyaml.yaml",
        "c-wrongtype.yaml",
        "f-unknown.yaml",
        "h-binary.yaml",
    ] {
        assert!(
            load.problems.iter().any(|p| p.source.ends_with(file)),
            "no problem for {file}: {:?}",
            load.problems
                .iter()
                .map(|p| p.to_string())
                .collect::<Vec<_>>()
        );
    }
    // And what loaded translates without blaming a good Service.
    let mut cache = TranslateCache::new();
    cache.update(&load.snapshot, &node(), &[], true);
    for p in cache.problems() {
        assert!(
            !goods
                .iter()
                .any(|o| p.object.ends_with(&format!("/{}", o.name))),
            "good Service blamed after loading: {p}"
        );
    }
    for o in &goods {
        let ip: Ipv4Addr = o.cluster_ip.parse().expect("ip");
        assert!(
            cache
                .desired()
                .frontends
                .contains_key(&Frontend::new(ip, 80, Protocol::Tcp)),
            "{} not desired after loading",
            o.name
        );
    }
}

/// What the sources and the translation keep of one object is bounded by what the pipeline
/// needs of it, not by the object's size: a Service with 1 MiB of annotations (none this proxy
/// reads) costs about what a plain one does, plus its name; a slice costs a bounded amount per
/// endpoint.
#[test]
fn retained_memory_per_object_is_bounded() {
    let mut rng = Rng::new(3);
    let goods: Vec<Obj> = (0..50).map(|i| good(i, &mut rng)).collect();
    // Bytes held after converting `objs` and translating them (inputs dropped first).
    let retained = |objs: &[&Obj]| -> isize {
        let before = live();
        let services: Vec<Service> = objs.iter().map(|o| service(o)).collect();
        let slices: Vec<EndpointSlice> = objs
            .iter()
            .flat_map(|o| o.slices.iter().map(slice))
            .collect();
        // Snapshot::new converts and drops the API objects.
        let snapshot = Snapshot::new(services, slices);
        let mut cache = TranslateCache::new();
        cache.update(&snapshot, &node(), &[], true);
        cache.release_change_list();
        let held = live() - before;
        drop((snapshot, cache));
        held
    };
    let base: Vec<&Obj> = goods.iter().collect();
    let plain = retained(&base);

    let mut huge = hostile_base("hostile-annotated".into(), 1);
    huge.annotations = (0..100)
        .map(|k| (format!("fuzz/{k}-{}", "k".repeat(1000)), "v".repeat(10_000)))
        .collect();
    let annotation_bytes: usize = huge
        .annotations
        .iter()
        .map(|(k, v)| k.len() + v.len())
        .sum();
    let mut with = base.clone();
    with.push(&huge);
    let annotated = retained(&with) - plain;
    eprintln!(
        "50 Services: {plain} B; one more with {annotation_bytes} B of annotations: +{annotated} B"
    );
    assert!(
        annotated < 64 * 1024,
        "a Service with {annotation_bytes} B of annotations keeps {annotated} B"
    );

    let mut big = hostile_base("hostile-big".into(), 2);
    big.slices[0].addresses = (0..10_000u32)
        .map(|j| Ipv4Addr::from(u32::from(Ipv4Addr::new(10, 246, 0, 0)) + j).to_string())
        .collect();
    let mut with = base.clone();
    with.push(&big);
    let per_endpoint = (retained(&with) - plain) / 10_000;
    eprintln!("one slice of 10,000 endpoints: {per_endpoint} B per endpoint");
    assert!(
        per_endpoint < 512,
        "{per_endpoint} B kept per endpoint of a 10,000-endpoint slice"
    );
}
