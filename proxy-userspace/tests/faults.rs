//! Faults under load (issue 13, item 5). Privileged (KPE_PRIVILEGED=1); the agent runs in the
//! node namespace of the standard topology, synced from [`proxy_testenv::FakeApiServer`].
//!
//! - `api_server_outage_under_load`: the API server gone for `KPE_FAULT_OUTAGE_SECS` (default
//!   10 s; `cargo xtask soak --faults` runs 300 s) while a request loop runs through a ClusterIP
//!   the whole time: 0 failed requests; changes made during the outage (a Service deleted, one
//!   added, history compacted) reach the maps after it; the time to converge is printed.
//! - `sigkill_mid_first_sync_converges_and_never_shows_a_half_written_service`:
//!   `KPE_FAULT_SERVICES` Services (default 6,000; `cargo xtask soak --faults` runs 20,000);
//!   the agent is SIGKILLed while its first sync is writing them and restarted; a reader
//!   polling the pinned maps all the while never sees a frontend whose slots, backends or rev-NAT entry are not all there, and the maps end up
//!   holding exactly what the objects need.
//! - `map_full_programs_what_fits_reports_the_rest_and_retries_after_a_delete`: small
//!   `--map-entries-*`; the Services that fit carry traffic, the others are logged by name and
//!   map, counted in the problems metric and get one Warning Event each (`DataplaneLimit`);
//!   deleting one frees room and a skipped one is programmed.
//! - `removed_pins_are_repaired_and_an_unmounted_bpffs_fails_healthz`: the pins under a
//!   private bpffs removed, then the bpffs unmounted, under a running agent: traffic keeps
//!   flowing on the maps and links it holds open; removed pins are pinned again; an unmounted
//!   bpffs fails /healthz until it is mounted again; a restarted agent adopts the pins. Pins
//!   renamed over others (a map's, a link's) are put back to the agent's own objects (by kernel
//!   id); a writer that keeps replacing one fails /healthz until it stops. A recreated pin
//!   directory is locked again (a second agent waits on it); while another process holds its
//!   lock the agent pins nothing there and fails /healthz.
//! - `a_second_agent_on_the_same_pins_waits_for_the_first_and_cleanup_refuses_while_one_runs`:
//!   the pin directory's lock; the second agent adopts the pins once the first is SIGKILLed.
//!
//! Each prints `FAULT ...` lines with its figures.

mod common_kube;
mod common_netns;

use std::{
    collections::{BTreeMap, BTreeSet},
    net::Ipv4Addr,
    path::{Path, PathBuf},
    process::Command,
    sync::{
        Mutex,
        atomic::{AtomicBool, AtomicU64, Ordering},
    },
    thread,
    time::{Duration, Instant},
};

use aya::maps::{HashMap as BpfHashMap, Map, MapData};
use common_kube::{
    BIN, NODE, backend_ips, node, ready, scale_endpoints, scale_vip, service, slice,
};
use proxy_common::{
    Backend, MAP_BACKENDS, MAP_REVNAT, MAP_SERVICES, RevNat, ServiceKey, ServiceValue, proto,
};
use proxy_testenv::{
    Agent, BACKENDS, FakeApiServer, PinDir, TempDir, Topology, fake_apiserver::Kind, http_url,
    require_privileged,
};
use serde_json::Value;

const WEB: Ipv4Addr = Ipv4Addr::new(10, 96, 0, 10);
const OTHER: Ipv4Addr = Ipv4Addr::new(10, 96, 0, 11);
const NEW: Ipv4Addr = Ipv4Addr::new(10, 96, 0, 12);
/// Requests per curl process of the request loop (each on its own connection).
const BATCH: usize = 10;

fn env_u64(name: &str, default: u64, range: std::ops::RangeInclusive<u64>) -> u64 {
    let v = match std::env::var(name) {
        Ok(v) => v
            .parse()
            .unwrap_or_else(|_| panic!("{name}={v:?} is not a whole number")),
        Err(_) => default,
    };
    assert!(range.contains(&v), "{name}={v} out of {range:?}");
    v
}

// ---------------------------------------------------------------------------------------------
// Harness

/// A private bpffs mounted under a temporary directory (never the system one): the pin dir is
/// `<mount>/pins`. Drop unmounts it (the agent is gone by then) and removes the directory.
struct PrivateBpffs {
    mount: PathBuf,
    _tmp: TempDir,
}

impl PrivateBpffs {
    fn new(prefix: &str) -> Self {
        let tmp = TempDir::new(&format!("{prefix}-bpffs")).expect("temp dir");
        let mount = tmp.join("bpf");
        std::fs::create_dir(&mount).expect("mount point");
        let b = Self { mount, _tmp: tmp };
        b.mount();
        b
    }

    fn pin_dir(&self) -> PathBuf {
        self.mount.join("pins")
    }

    fn mount(&self) {
        run(Command::new("mount")
            .args(["-t", "bpf", "bpf"])
            .arg(&self.mount));
    }

    /// Lazy unmount (`umount -l`), as an operator's unmount under a process with open fds.
    fn unmount(&self) {
        run(Command::new("umount").arg("-l").arg(&self.mount));
    }

    fn mounted(&self) -> bool {
        proxy_testenv_is_bpffs(&self.mount)
    }
}

impl Drop for PrivateBpffs {
    fn drop(&mut self) {
        while self.mounted() {
            if !Command::new("umount")
                .arg("-l")
                .arg(&self.mount)
                .status()
                .is_ok_and(|s| s.success())
            {
                eprintln!("warning: could not unmount {}", self.mount.display());
                break;
            }
        }
    }
}

fn proxy_testenv_is_bpffs(path: &Path) -> bool {
    nix::sys::statfs::statfs(path)
        .is_ok_and(|st| st.filesystem_type() == nix::sys::statfs::BPF_FS_MAGIC)
}

/// The text without terminal colour codes (ESC [ ... m).
fn strip_ansi(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    let mut chars = s.chars();
    while let Some(c) = chars.next() {
        if c == '\x1b' {
            for c in chars.by_ref() {
                if c == 'm' {
                    break;
                }
            }
        } else {
            out.push(c);
        }
    }
    out
}

fn run(cmd: &mut Command) {
    let out = cmd.output().unwrap_or_else(|e| panic!("{cmd:?}: {e}"));
    assert!(
        out.status.success(),
        "{cmd:?}: {}: {}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
}

#[allow(dead_code, reason = "held for their Drop")]
enum Pins {
    Host(PinDir),
    Private(PrivateBpffs),
}

/// Field order is drop order: agent, API server, pins, namespaces.
struct Rig {
    agent: Agent,
    api: FakeApiServer,
    pins: Pins,
    pin_dir: PathBuf,
    topo: Topology,
}

impl Rig {
    /// Topology, fake API server with `objects`, agent (with `extra` flags) started on it; pins
    /// on the host bpffs, or (`private_bpffs`) on a bpffs of the test's own. Does not wait.
    fn start(objects: Vec<Value>, extra: &[&str], private_bpffs: bool) -> Self {
        proxy_testenv::ensure_bpffs().expect("bpffs at /sys/fs/bpf");
        let topo = Topology::new().expect("creating the topology");
        let api = FakeApiServer::start_in(Some(&topo.node().path())).expect("fake API server");
        api.apply(node("zone-a")).expect("node");
        api.apply_all(objects).expect("objects");
        let kubeconfig = api
            .write_kubeconfig(&topo.tmp().path().join("kubeconfig"))
            .expect("kubeconfig");
        let (pins, pin_dir) = if private_bpffs {
            let b = PrivateBpffs::new(topo.prefix());
            let dir = b.pin_dir();
            (Pins::Private(b), dir)
        } else {
            let p = PinDir::new(&format!("{}-pins", topo.prefix())).expect("pin dir");
            let dir = p.path().to_path_buf();
            (Pins::Host(p), dir)
        };
        let mut flags = vec!["--hostname-override", NODE];
        flags.extend_from_slice(extra);
        let agent = Agent::start_kube(
            Path::new(BIN),
            topo.node(),
            &kubeconfig,
            &flags,
            &pin_dir,
            topo.tmp().path(),
        )
        .expect("starting the agent");
        Self {
            agent,
            api,
            pins,
            pin_dir,
            topo,
        }
    }

    fn attached(mut self) -> Self {
        let ifs = self.topo.pod_interfaces();
        self.agent
            .wait_attached(&ifs)
            .unwrap_or_else(|e| panic!("{e:#}"));
        self
    }

    fn fail(&self, msg: &str) -> ! {
        self.agent.fail(msg)
    }

    fn check(&self, cond: bool, msg: impl FnOnce() -> String) {
        self.agent.check(cond, msg)
    }

    /// The agent's log so far (all its runs), without colour codes.
    fn log(&self) -> String {
        strip_ansi(&std::fs::read_to_string(self.agent.log_path()).unwrap_or_default())
    }

    /// `n` requests to http://vip/ from the client pod; all must be answered from the VIP.
    fn distribution(&self, vip: Ipv4Addr, n: usize) -> BTreeMap<String, usize> {
        common_netns::distribution(&self.topo, &self.agent, "client", vip.into(), 80, n)
    }

    /// `n` requests to http://vip/, each answered from the VIP by one of the backend pods
    /// (which ones is the random scheduler's choice).
    fn served(&self, vip: Ipv4Addr, n: usize, what: &str) {
        let c = self.distribution(vip, n);
        let pods: Vec<&str> = BACKENDS.iter().map(|(p, _)| *p).collect();
        self.check(
            c.values().sum::<usize>() == n && c.keys().all(|k| pods.contains(&k.as_str())),
            || format!("{what}: {n} requests to {vip} answered {c:?}"),
        );
    }

    /// The HTTP status of GET /healthz on the agent's default healthz address (node namespace).
    fn healthz(&self) -> String {
        let out = self
            .topo
            .node()
            .output(
                &[
                    "curl",
                    "-s",
                    "--max-time",
                    "3",
                    "-o",
                    "/dev/null",
                    "-w",
                    "%{http_code}",
                    "http://127.0.0.1:10256/healthz",
                ],
                Duration::from_secs(10),
            )
            .unwrap_or_else(|e| self.fail(&format!("GET /healthz: {e:#}")));
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    /// Starts a second agent on the same pins (its files under `name` in the temp dir) and
    /// waits until it logs that it waits for the pin directory's lock; returns it and a reader
    /// of its log.
    fn second_agent_waiting(&self, name: &str) -> (Agent, impl Fn() -> String + use<>) {
        let work = self.topo.tmp().path().join(name);
        std::fs::create_dir_all(&work).expect("second agent's work dir");
        let second = self
            .agent
            .start_second(&work)
            .expect("starting the second agent");
        let log_path = second.log_path().to_path_buf();
        let log = move || strip_ansi(&std::fs::read_to_string(&log_path).unwrap_or_default());
        self.wait(
            &format!("the second agent ({name}) waiting for the pin directory's lock"),
            Duration::from_secs(30),
            || log().contains("another kube-proxy-ebpf holds the pin directory"),
        );
        (second, log)
    }

    fn wait(&self, what: &str, timeout: Duration, mut cond: impl FnMut() -> bool) -> Duration {
        let started = Instant::now();
        while !cond() {
            if started.elapsed() > timeout {
                self.fail(&format!("{what}: not within {timeout:?}"));
            }
            thread::sleep(Duration::from_millis(20));
        }
        started.elapsed()
    }
}

// ---------------------------------------------------------------------------------------------
// Reading the pinned maps

fn open_hash<K: aya::Pod, V: aya::Pod>(
    pins: &Path,
    map: &str,
) -> Option<BpfHashMap<MapData, K, V>> {
    let data = MapData::from_pin(pins.join(map)).ok()?;
    BpfHashMap::try_from(Map::HashMap(data)).ok()
}

/// The three maps a Service's lookup goes through.
struct ServiceView {
    services: BpfHashMap<MapData, ServiceKey, ServiceValue>,
    backends: BpfHashMap<MapData, u32, Backend>,
    rev_nats: BpfHashMap<MapData, u32, RevNat>,
}

/// What a frontend leads the datapath to: its endpoints in slot order and its rev-NAT target.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Decoded {
    endpoints: Vec<([u8; 4], [u8; 2], u8)>,
    rev_nat: ([u8; 4], [u8; 2]),
}

impl ServiceView {
    fn open(pins: &Path) -> Option<Self> {
        Some(Self {
            services: open_hash(pins, MAP_SERVICES)?,
            backends: open_hash(pins, MAP_BACKENDS)?,
            rev_nats: open_hash(pins, MAP_REVNAT)?,
        })
    }

    fn frontend(&self, vip: Ipv4Addr, port: u16) -> Option<ServiceValue> {
        let key = ServiceKey::new(vip.octets(), port.to_be_bytes(), proto::TCP, 0);
        self.services.get(&key, 0).ok()
    }

    /// Follows frontend `key` as the datapath does, reading its entry first and then what it
    /// names (the agent writes those first). `Err` names what is missing or wrong.
    fn follow(&self, key: &ServiceKey) -> Result<Option<Decoded>, String> {
        let Ok(fe) = self.services.get(key, 0) else {
            return Ok(None);
        };
        let mut endpoints = Vec::with_capacity(usize::from(fe.count));
        for slot in 1..=fe.count {
            let slot_key = ServiceKey { slot, ..*key };
            let v = self
                .services
                .get(&slot_key, 0)
                .map_err(|e| format!("slot {slot} of {} missing: {e}", fe.count))?;
            let b = self
                .backends
                .get(&v.backend_id, 0)
                .map_err(|e| format!("slot {slot}'s backend {} missing: {e}", v.backend_id))?;
            endpoints.push((b.addr, b.port, b.proto));
        }
        let r = self
            .rev_nats
            .get(&fe.rev_nat_id, 0)
            .map_err(|e| format!("rev-NAT {} missing: {e}", fe.rev_nat_id))?;
        if (r.addr, r.port) != (key.addr, key.port) {
            return Err(format!(
                "rev-NAT {} names {:?}:{:?}, not the frontend",
                fe.rev_nat_id, r.addr, r.port
            ));
        }
        Ok(Some(Decoded {
            endpoints,
            rev_nat: (r.addr, r.port),
        }))
    }

    /// One pass over every frontend entry. Returns (frontends seen, half-written ones: key and
    /// what was wrong). A frontend whose entry changed while it was followed is read again (a
    /// consistent rewrite, not a half-written one).
    fn scan(&self) -> (usize, Vec<String>) {
        let keys: Vec<ServiceKey> = self
            .services
            .keys()
            .filter_map(Result::ok)
            .filter(|k| k.slot == 0)
            .collect();
        let mut bad = Vec::new();
        for key in &keys {
            let before = self.services.get(key, 0).ok();
            if let Err(e) = self.follow(key) {
                let after = self.services.get(key, 0).ok();
                if before.is_some() && before == after {
                    bad.push(format!(
                        "{:?}:{}: {e}",
                        key.addr,
                        u16::from_be_bytes(key.port)
                    ));
                }
            }
        }
        (keys.len(), bad)
    }

    fn counts(&self) -> (usize, usize, usize) {
        (
            self.services.keys().filter(Result::is_ok).count(),
            self.backends.keys().filter(Result::is_ok).count(),
            self.rev_nats.keys().filter(Result::is_ok).count(),
        )
    }
}

// ---------------------------------------------------------------------------------------------
// Request loop

#[derive(Default)]
struct Traffic {
    requests: AtomicU64,
    failures: AtomicU64,
    failed: Mutex<Vec<String>>,
}

impl Traffic {
    fn fail(&self, what: String) {
        self.failures.fetch_add(1, Ordering::Relaxed);
        let mut failed = self.failed.lock().expect("failure list");
        if failed.len() < 20 {
            failed.push(what);
        }
    }

    /// Requests through `vip` from the client pod until `stop` (at most `max_batches` curl
    /// runs of [`BATCH`]): each must be answered by a backend pod, from the VIP.
    fn run(&self, topo: &Topology, vip: Ipv4Addr, stop: &AtomicBool, max_batches: usize) {
        let names: Vec<&str> = BACKENDS.iter().map(|(n, _)| *n).collect();
        let url = http_url(vip, 80);
        for batch in 0..max_batches {
            if stop.load(Ordering::Relaxed) {
                return;
            }
            match topo.curl_many(&url, BATCH) {
                Ok(replies) => {
                    for (k, reply) in replies.into_iter().enumerate() {
                        self.requests.fetch_add(1, Ordering::Relaxed);
                        match reply {
                            Ok(r)
                                if names.contains(&r.body.as_str())
                                    && r.remote_ip == vip.to_string() => {}
                            Ok(r) => self.fail(format!(
                                "batch {batch} request {k}: answered {:?} from {}",
                                r.body, r.remote_ip
                            )),
                            Err(e) => self.fail(format!("batch {batch} request {k}: {e}")),
                        }
                    }
                }
                Err(e) => {
                    self.requests.fetch_add(BATCH as u64, Ordering::Relaxed);
                    for _ in 0..BATCH {
                        self.fail(format!("batch {batch}: curl: {e:#}"));
                    }
                }
            }
        }
    }

    fn figures(&self) -> (u64, u64, Vec<String>) {
        (
            self.requests.load(Ordering::Relaxed),
            self.failures.load(Ordering::Relaxed),
            self.failed.lock().expect("failure list").clone(),
        )
    }
}

// ---------------------------------------------------------------------------------------------
// 1. API server gone under load

#[test]
fn api_server_outage_under_load() {
    require_privileged!();
    let outage = Duration::from_secs(env_u64("KPE_FAULT_OUTAGE_SECS", 10, 1..=3_600));
    let ips = backend_ips();
    let mut rig = Rig::start(
        vec![
            service("web", WEB, 80),
            slice("web", "a", &ready(&ips)),
            service("other", OTHER, 80),
            slice("other", "a", &ready(&ips[..1])),
        ],
        &[],
        false,
    )
    .attached();
    let view = ServiceView::open(&rig.pin_dir).expect("pinned maps");
    rig.wait("other programmed", Duration::from_secs(10), || {
        view.frontend(OTHER, 80).is_some()
    });

    let stop = AtomicBool::new(false);
    let traffic = Traffic::default();
    let mut converged = Duration::ZERO;
    thread::scope(|scope| {
        let max_batches = usize::try_from(outage.as_secs() * 200 + 2_000).expect("batches");
        let (topo, stop_ref, traffic_ref) = (&rig.topo, &stop, &traffic);
        let runner = scope.spawn(move || traffic_ref.run(topo, WEB, stop_ref, max_batches));
        // Some requests before the outage.
        thread::sleep(Duration::from_secs(2));
        rig.api.stop();
        let down = Instant::now();
        // Changes the agent cannot see; history compacted, so it must relist to learn of them.
        rig.api.delete(Kind::Service, "demo", "other");
        rig.api.delete(Kind::EndpointSlice, "demo", "other-a");
        rig.api.apply(service("new", NEW, 80)).expect("new");
        rig.api
            .apply(slice("new", "a", &ready(&ips[1..2])))
            .expect("slice");
        rig.api.expire_watches();
        while down.elapsed() < outage {
            thread::sleep(Duration::from_millis(200));
            if !rig.agent.is_running() {
                stop.store(true, Ordering::Relaxed);
                rig.fail("agent exited during the outage");
            }
        }
        rig.check(view.frontend(NEW, 80).is_none(), || {
            "the new Service appeared while the API server was down?".into()
        });
        rig.check(view.frontend(OTHER, 80).is_some(), || {
            "the deleted Service went while the API server was down?".into()
        });
        rig.api.resume().expect("resume");
        let back = Instant::now();
        let deadline = back + Duration::from_secs(120);
        // Converged: the new Service with its endpoint (its slice may be relisted after the
        // Service, by another watch still in backoff; until then it rejects, as kube-proxy's
        // would) and the deleted one gone.
        while view.frontend(NEW, 80).is_none_or(|fe| fe.count != 1)
            || view.frontend(OTHER, 80).is_some()
        {
            if Instant::now() > deadline {
                stop.store(true, Ordering::Relaxed);
                rig.fail("the changes made during the outage did not reach the maps in 120 s");
            }
            thread::sleep(Duration::from_millis(5));
        }
        converged = back.elapsed();
        // Requests after the return too.
        thread::sleep(Duration::from_secs(2));
        stop.store(true, Ordering::Relaxed);
        runner.join().expect("request loop");
    });
    let (requests, failures, failed) = traffic.figures();
    eprintln!(
        "FAULT api-outage: outage {outage:?} under load: {requests} requests through {WEB}, \
         {failures} failed; after the server returned, the changes made during the outage \
         reached the maps in {converged:?}"
    );
    rig.check(failures == 0 && requests > 0, || {
        format!(
            "{failures} of {requests} requests failed; the first:\n{}",
            failed.join("\n")
        )
    });
    let c = rig.distribution(NEW, 5);
    rig.check(c.keys().map(String::as_str).eq(["be2"]), || {
        format!("new Service after the outage: {c:?}")
    });
}

// ---------------------------------------------------------------------------------------------
// 2. SIGKILL in the middle of a large first sync

fn scale_objects(n: usize) -> Vec<Value> {
    let mut objects = Vec::with_capacity(n * 2);
    for i in 0..n {
        let name = format!("svc-{i}");
        objects.push(service(&name, scale_vip(i), 80));
        objects.push(slice(&name, "a", &scale_endpoints(i, 1)));
    }
    objects
}

/// What the maps must hold for `scale_objects(n)`: every frontend with its one endpoint.
fn scale_expected(n: usize) -> BTreeMap<ServiceKey, Decoded> {
    (0..n)
        .map(|i| {
            let vip = scale_vip(i);
            let ep = scale_endpoints(i, 1)[0].0;
            let key = ServiceKey::new(vip.octets(), 80u16.to_be_bytes(), proto::TCP, 0);
            let d = Decoded {
                endpoints: vec![(ep.octets(), 8080u16.to_be_bytes(), proto::TCP)],
                rev_nat: (vip.octets(), 80u16.to_be_bytes()),
            };
            (key, d)
        })
        .collect()
}

#[test]
fn sigkill_mid_first_sync_converges_and_never_shows_a_half_written_service() {
    require_privileged!();
    let n = usize::try_from(env_u64("KPE_FAULT_SERVICES", 6_000, 100..=50_000)).expect("n");
    let started = Instant::now();
    let mut rig = Rig::start(scale_objects(n), &[], false);
    let expected = scale_expected(n);
    // Probes spread over the Services: all absent before the sync, all present after it.
    let probes: Vec<Ipv4Addr> = (0..64).map(|k| scale_vip(k * (n - 1) / 63)).collect();
    let stop = AtomicBool::new(false);
    let scans = AtomicU64::new(0);
    let busy_scans = AtomicU64::new(0);
    let max_seen = AtomicU64::new(0);
    let bad: Mutex<Vec<String>> = Mutex::new(Vec::new());
    let mut killed_at = None;
    thread::scope(|scope| {
        let (pin_dir, stop_ref, scans_ref, busy_ref, max_ref, bad_ref) =
            (&rig.pin_dir, &stop, &scans, &busy_scans, &max_seen, &bad);
        // The reader: scans the pinned maps as fast as it can until stopped (bounded).
        let reader = scope.spawn(move || {
            let deadline = Instant::now() + Duration::from_secs(600);
            let mut view = None;
            while !stop_ref.load(Ordering::Relaxed) && Instant::now() < deadline {
                let Some(v) = view.as_ref() else {
                    view = ServiceView::open(pin_dir);
                    thread::sleep(Duration::from_millis(1));
                    continue;
                };
                let (seen, wrong) = v.scan();
                scans_ref.fetch_add(1, Ordering::Relaxed);
                if seen > 0 {
                    busy_ref.fetch_add(1, Ordering::Relaxed);
                }
                max_ref.fetch_max(seen as u64, Ordering::Relaxed);
                if !wrong.is_empty() {
                    let mut b = bad_ref.lock().expect("bad list");
                    if b.len() < 20 {
                        b.extend(wrong.into_iter().take(20));
                    }
                }
            }
        });
        // The killer: SIGKILL once some probes' frontends are written and others not yet.
        let deadline = Instant::now() + Duration::from_secs(300);
        let mut view = None;
        loop {
            if Instant::now() > deadline {
                stop.store(true, Ordering::Relaxed);
                rig.fail("the first sync did not start writing within 300 s");
            }
            let Some(v) = view.as_ref() else {
                view = ServiceView::open(&rig.pin_dir);
                thread::sleep(Duration::from_millis(1));
                continue;
            };
            let present = probes
                .iter()
                .filter(|vip| v.frontend(**vip, 80).is_some())
                .count();
            if present > 0 && present < probes.len() {
                rig.agent.kill().expect("SIGKILL");
                killed_at = Some((started.elapsed(), present));
                break;
            }
            if present == probes.len() {
                stop.store(true, Ordering::Relaxed);
                rig.fail(
                    "the first sync wrote every probed Service before the test saw it half \
                     done: raise KPE_FAULT_SERVICES",
                );
            }
            thread::sleep(Duration::from_micros(200));
        }
        let (killed_after, present) = killed_at.expect("killed");
        let view = ServiceView::open(&rig.pin_dir).expect("pinned maps");
        let (svc, be, rn) = view.counts();
        eprintln!(
            "FAULT sigkill: {n} Services; SIGKILL {killed_after:?} after start with {present} of \
             {} probed frontends written; left pinned: {svc} SERVICES, {be} BACKENDS, {rn} \
             REVNAT entries",
            probes.len()
        );
        let restarted = Instant::now();
        rig.agent.restart().expect("restart");
        rig.agent
            .wait_status(Duration::from_secs(300), |s| s.frontends == n as u64)
            .unwrap_or_else(|e| panic!("{e:#}"));
        eprintln!(
            "FAULT sigkill: restarted agent synced {n} frontends in {:?}",
            restarted.elapsed()
        );
        // One more scan after convergence, then stop the reader.
        let s = scans.load(Ordering::Relaxed);
        let deadline = Instant::now() + Duration::from_secs(120);
        while scans.load(Ordering::Relaxed) < s + 2 && Instant::now() < deadline {
            thread::sleep(Duration::from_millis(10));
        }
        stop.store(true, Ordering::Relaxed);
        reader.join().expect("reader");
    });
    let bad = bad.into_inner().expect("bad list");
    eprintln!(
        "FAULT sigkill: the reader scanned the maps {} times ({} of them with frontends in \
         the map, up to {} in one scan), {} half-written frontends seen",
        scans.load(Ordering::Relaxed),
        busy_scans.load(Ordering::Relaxed),
        max_seen.load(Ordering::Relaxed),
        bad.len()
    );
    rig.check(bad.is_empty(), || {
        format!("half-written Services seen:\n{}", bad.join("\n"))
    });
    rig.check(busy_scans.load(Ordering::Relaxed) >= 2, || {
        "the reader did not scan the maps while they held frontends".into()
    });

    // Converged: exactly what a clean sync of these objects gives (ids aside), nothing more.
    let view = ServiceView::open(&rig.pin_dir).expect("pinned maps");
    let mut got = BTreeMap::new();
    let mut wrong = Vec::new();
    for key in expected.keys() {
        match view.follow(key) {
            Ok(Some(d)) => {
                got.insert(*key, d);
            }
            Ok(None) => wrong.push(format!("{:?} missing", key.addr)),
            Err(e) => wrong.push(format!("{:?}: {e}", key.addr)),
        }
    }
    let differ: Vec<String> = expected
        .iter()
        .filter(|(k, d)| got.get(*k).is_some_and(|g| g != *d))
        .take(5)
        .map(|(k, d)| format!("{:?}: {:?}, want {d:?}", k.addr, got[k]))
        .collect();
    let (svc, be, rn) = view.counts();
    let distinct: BTreeSet<_> = expected.values().map(|d| d.endpoints[0]).collect();
    eprintln!(
        "FAULT sigkill: after the restart the maps hold {svc} SERVICES, {be} BACKENDS, {rn} \
         REVNAT entries (want {}, {}, {n})",
        2 * n,
        distinct.len()
    );
    rig.check(wrong.is_empty() && differ.is_empty(), || {
        format!(
            "not converged: {} frontends missing or broken, e.g. {:?}; differing: {differ:?}",
            wrong.len(),
            &wrong[..wrong.len().min(5)]
        )
    });
    rig.check((svc, be, rn) == (2 * n, distinct.len(), n), || {
        "entries beyond what the objects need (leftovers of the killed sync)".into()
    });
}

// ---------------------------------------------------------------------------------------------
// 3. Map full

#[test]
fn map_full_programs_what_fits_reports_the_rest_and_retries_after_a_delete() {
    require_privileged!();
    // Six Services on the three pods: 4 SERVICES entries each (frontend + 3 slots). The map
    // takes 14: three fit, three do not.
    let ips = backend_ips();
    let vips: Vec<Ipv4Addr> = (0..6).map(|i| Ipv4Addr::new(10, 96, 1, 10 + i)).collect();
    let names: Vec<String> = (0..6).map(|i| format!("full-{i}")).collect();
    let mut objects = Vec::new();
    for (name, vip) in names.iter().zip(&vips) {
        objects.push(service(name, *vip, 80));
        objects.push(slice(name, "a", &ready(&ips)));
    }
    let rig = Rig::start(objects, &["--map-entries-services", "14"], false).attached();
    let view = ServiceView::open(&rig.pin_dir).expect("pinned maps");
    let programmed = |view: &ServiceView| -> Vec<usize> {
        (0..vips.len())
            .filter(|i| view.frontend(vips[*i], 80).is_some())
            .collect()
    };
    let now = programmed(&view);
    rig.check(now.len() == 3, || {
        format!("want 3 of 6 Services programmed in a SERVICES map of 14, got {now:?}")
    });
    for &i in &now {
        rig.served(vips[i], 9, &format!("{} through its VIP", names[i]));
    }
    let skipped: Vec<usize> = (0..vips.len()).filter(|i| !now.contains(i)).collect();
    let log = rig.log();
    for &i in &skipped {
        let named = log.lines().any(|l| {
            l.contains("skipped:")
                && l.contains(&format!("demo/{}", names[i]))
                && l.contains("SERVICES map full")
        });
        rig.check(named, || {
            format!(
                "no log line names the skipped Service {} and the SERVICES map",
                names[i]
            )
        });
    }
    let metrics = scrape_metrics(&rig);
    let problems = metric(&metrics, "kube_proxy_ebpf_sync_problems");
    rig.check(problems == Some(skipped.len() as f64), || {
        format!(
            "kube_proxy_ebpf_sync_problems {problems:?}, want {}",
            skipped.len()
        )
    });
    // One Warning Event on each skipped Service, naming the map; none on the others.
    let skipped_names: BTreeSet<&str> = skipped.iter().map(|i| names[*i].as_str()).collect();
    let limit_events = || -> Vec<(String, String)> {
        (rig.api.events().iter())
            .filter(|e| e.method == "POST" && e.body["reason"] == "DataplaneLimit")
            .map(|e| {
                let b = &e.body;
                let name = b["regarding"]["name"].as_str().unwrap_or_default();
                (
                    name.to_owned(),
                    b["note"].as_str().unwrap_or_default().to_owned(),
                )
            })
            .collect()
    };
    let events_took = rig.wait(
        "a DataplaneLimit Event on each skipped Service",
        Duration::from_secs(10),
        || limit_events().len() >= skipped.len(),
    );
    thread::sleep(Duration::from_millis(500));
    let events = limit_events();
    let regarding: BTreeSet<&str> = events.iter().map(|(n, _)| n.as_str()).collect();
    rig.check(
        events.len() == skipped.len() && regarding == skipped_names,
        || format!("want one DataplaneLimit Event on each of {skipped_names:?}, got {events:?}"),
    );
    rig.check(
        events.iter().all(|(n, note)| {
            note.contains(&format!("demo/{n}")) && note.contains("SERVICES map full")
        }),
        || format!("Event notes do not name the Service and the map: {events:?}"),
    );
    eprintln!(
        "FAULT map-full: SERVICES map of 14 entries, 6 Services of 4 entries: programmed {:?} \
         (each answered 9 of 9 requests), skipped {:?} (logged by name and map; \
         kube_proxy_ebpf_sync_problems {problems:?}; a DataplaneLimit Event on each, {events_took:?} \
         after the attach)",
        now.iter().map(|i| &names[*i]).collect::<Vec<_>>(),
        skipped.iter().map(|i| &names[*i]).collect::<Vec<_>>()
    );

    // A delete frees room: one skipped Service is programmed, without any other change.
    let gone = now[0];
    rig.api.delete(Kind::Service, "demo", &names[gone]);
    rig.api
        .delete(Kind::EndpointSlice, "demo", &format!("{}-a", names[gone]));
    let took = rig.wait(
        "a skipped Service programmed after a delete",
        Duration::from_secs(20),
        || {
            let p = programmed(&view);
            !p.contains(&gone) && p.len() == 3
        },
    );
    let after = programmed(&view);
    let newly: Vec<usize> = after
        .iter()
        .copied()
        .filter(|i| skipped.contains(i))
        .collect();
    for &i in &after {
        rig.served(vips[i], 9, &format!("{} after the delete", names[i]));
    }
    rig.check(limit_events().len() == skipped.len(), || {
        format!(
            "a new DataplaneLimit Event after the delete: {:?}",
            limit_events()
        )
    });
    eprintln!(
        "FAULT map-full: deleting {} let {:?} in {took:?} after the delete; programmed now {:?}",
        names[gone],
        newly.iter().map(|i| &names[*i]).collect::<Vec<_>>(),
        after.iter().map(|i| &names[*i]).collect::<Vec<_>>()
    );
}

fn scrape_metrics(rig: &Rig) -> String {
    let out = (rig.topo.node())
        .output(
            &["curl", "-sS", "--max-time", "3", common_netns::METRICS_URL],
            Duration::from_secs(10),
        )
        .unwrap_or_else(|e| rig.fail(&format!("scraping /metrics: {e:#}")));
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn metric(text: &str, name: &str) -> Option<f64> {
    text.lines().filter(|l| !l.starts_with('#')).find_map(|l| {
        let (k, v) = l.rsplit_once(' ')?;
        (k == name).then(|| v.parse().ok())?
    })
}

// ---------------------------------------------------------------------------------------------
// 4. Pins removed, bpffs unmounted

/// The files pinned in `dir` and its `links/` (relative names).
fn pinned_files(dir: &Path) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    for (sub, prefix) in [(dir.to_path_buf(), ""), (dir.join("links"), "links/")] {
        if let Ok(entries) = std::fs::read_dir(sub) {
            for e in entries.flatten() {
                if e.file_type().is_ok_and(|t| t.is_file()) {
                    out.insert(format!("{prefix}{}", e.file_name().to_string_lossy()));
                }
            }
        }
    }
    out
}

#[test]
fn removed_pins_are_repaired_and_an_unmounted_bpffs_fails_healthz() {
    require_privileged!();
    let ips = backend_ips();
    let mut rig = Rig::start(
        vec![service("web", WEB, 80), slice("web", "a", &ready(&ips))],
        &["--pin-check-period", "500ms"],
        true,
    )
    .attached();
    rig.served(WEB, 9, "web");
    rig.wait("/healthz 200", Duration::from_secs(10), || {
        rig.healthz() == "200"
    });
    let pinned = pinned_files(&rig.pin_dir);
    rig.check(pinned.iter().any(|p| p.starts_with("links/")), || {
        format!("no links pinned: {pinned:?}")
    });

    // (a) Every pin removed: traffic flows on what the agent holds; the pins come back.
    std::fs::remove_dir_all(&rig.pin_dir).expect("removing the pins");
    rig.served(WEB, 9, "web right after the pins went");
    let took = rig.wait("the pins pinned again", Duration::from_secs(10), || {
        pinned_files(&rig.pin_dir) == pinned
    });
    // The pins are back a moment before the agent logs that it put them back.
    rig.wait(
        "the log line for the repair",
        Duration::from_secs(5),
        || rig.log().contains("pins removed under the running agent"),
    );
    rig.served(WEB, 9, "web after the repair");
    rig.check(rig.healthz() == "200", || {
        "/healthz after the repair".into()
    });
    eprintln!(
        "FAULT pins-removed: {} pins removed; traffic intact (9 of 9 requests right after); \
         pinned again in {took:?}; /healthz 200",
        pinned.len()
    );
    replaced_pins_are_pinned_back(&rig, &pinned);
    recreated_pin_dir_is_locked_again(&rig, &pinned);
    // A restarted agent finds the repaired pins and adopts them.
    restart_and_check_adoption(&mut rig, "after the repair");

    // (b) The bpffs unmounted: nothing can be pinned; /healthz fails, traffic still flows.
    let Pins::Private(bpffs) = &rig.pins else {
        unreachable!("private bpffs")
    };
    let log_before = rig.log().len();
    bpffs.unmount();
    let took = rig.wait(
        "/healthz 503 after the unmount",
        Duration::from_secs(10),
        || rig.healthz() == "503",
    );
    rig.served(WEB, 9, "web with the bpffs unmounted");
    let log = rig.log();
    let lines: Vec<&str> = log[log_before..]
        .lines()
        .filter(|l| l.contains("is not on a bpffs any more"))
        .collect();
    rig.check(lines.len() == 1, || {
        format!("want one log line for the unmounted bpffs, got {lines:?}")
    });
    // Mounted again: everything pinned back, /healthz 200, and a restart adopts it.
    bpffs.mount();
    let back = rig.wait(
        "the pins back on the new bpffs",
        Duration::from_secs(10),
        || pinned_files(&rig.pin_dir) == pinned,
    );
    rig.wait("/healthz 200 again", Duration::from_secs(10), || {
        rig.healthz() == "200"
    });
    eprintln!(
        "FAULT bpffs-unmounted: /healthz 503 {took:?} after the unmount, traffic intact (9 of 9); \
         bpffs mounted again: {} pins back in {back:?}, /healthz 200",
        pinned.len()
    );
    restart_and_check_adoption(&mut rig, "after the remount");
}

/// The pin directory removed and recreated under the agent: the agent takes the lock on the new
/// directory before pinning back (so a second agent still waits); while another process holds
/// that lock it pins nothing there and fails /healthz.
fn recreated_pin_dir_is_locked_again(rig: &Rig, pinned: &BTreeSet<String>) {
    let log_before = rig.log().len();
    // Recreated by someone else, who holds its lock (as an agent started on it would).
    std::fs::remove_dir_all(&rig.pin_dir).expect("removing the pins");
    std::fs::create_dir(&rig.pin_dir).expect("recreating the pin directory");
    let holder = std::fs::File::open(&rig.pin_dir).expect("opening the new pin directory");
    holder.try_lock().expect("locking the new pin directory");
    let refused = rig.wait(
        "/healthz 503 with the recreated directory locked by another",
        Duration::from_secs(10),
        || rig.healthz() == "503",
    );
    rig.served(
        WEB,
        9,
        "web with the recreated pin directory locked by another",
    );
    let log = rig.log();
    rig.check(
        log[log_before..].contains("was recreated and another process holds its lock"),
        || {
            format!(
                "no log line naming the held lock:
{}",
                &log[log_before..]
            )
        },
    );
    let stray = pinned_files(&rig.pin_dir);
    rig.check(stray.is_empty(), || {
        format!("the agent pinned into a directory another process holds: {stray:?}")
    });
    drop(holder);
    let back = rig.wait(
        "the pins back once the other let go",
        Duration::from_secs(10),
        || pinned_files(&rig.pin_dir) == *pinned,
    );
    rig.wait("/healthz 200 again", Duration::from_secs(10), || {
        rig.healthz() == "200"
    });
    rig.check(rig.log()[log_before..].contains("locked again"), || {
        "no log line for taking the lock again".into()
    });

    // The agent holds the new directory's lock: a second agent waits and touches nothing.
    let ids = pinned_ids(&rig.pin_dir, pinned);
    let (mut second, second_log) = rig.second_agent_waiting("second-after-recreate");
    rig.check(
        second.is_running()
            && !second_log().contains("adopted pinned maps")
            && pinned_ids(&rig.pin_dir, pinned) == ids,
        || {
            format!(
                "the second agent did not wait on the recreated directory:\n{}",
                second_log()
            )
        },
    );
    second.stop().expect("stopping the second agent");
    eprintln!(
        "FAULT pin-dir-recreated: recreated and locked by another process: /healthz 503 after \
         {refused:?}, nothing pinned there, traffic intact (9 of 9); let go: the agent locked it \
         and pinned the {} pins back in {back:?}; a second agent then waited on it",
        pinned.len()
    );
}

/// The kernel ids of the objects pinned at `pins` (relative to `dir`; `links/...` are links,
/// the rest maps), read with bpftool.
fn pinned_ids(dir: &Path, pins: &BTreeSet<String>) -> BTreeMap<String, u64> {
    pins.iter()
        .filter_map(|rel| {
            let kind = if rel.starts_with("links/") {
                "link"
            } else {
                "map"
            };
            let out = Command::new("bpftool")
                .args(["-j", kind, "show", "pinned"])
                .arg(dir.join(rel))
                .output()
                .ok()?;
            let v: Value = serde_json::from_slice(&out.stdout).ok()?;
            Some((rel.clone(), v["id"].as_u64()?))
        })
        .collect()
}

/// `from` renamed over `to` (bpffs renames replace): `to` now holds `from`'s object and `from`
/// is gone. Skipped (false) while `from` is missing.
fn rename_pin_over(dir: &Path, from: &str, to: &str) -> bool {
    std::fs::rename(dir.join(from), dir.join(to)).is_ok()
}

/// (a2) A map pin and a link pin each renamed over another of its kind: the agent pins its own
/// objects back in both places (every pin holds the object it held before, by kernel id), logs
/// the stranger's id, and /healthz stays 200. Then a writer that keeps replacing a pin: /healthz
/// fails naming it while it goes on, and is 200 again once it stops, with every pin back.
fn replaced_pins_are_pinned_back(rig: &Rig, pinned: &BTreeSet<String>) {
    let dir = &rig.pin_dir;
    let ids = pinned_ids(dir, pinned);
    rig.check(ids.len() == pinned.len(), || {
        format!(
            "bpftool identified {} of {} pins: {ids:?}",
            ids.len(),
            pinned.len()
        )
    });
    let maps: Vec<&String> = pinned.iter().filter(|p| !p.starts_with("links/")).collect();
    let links: Vec<&String> = pinned.iter().filter(|p| p.starts_with("links/")).collect();
    rig.check(maps.len() >= 2 && links.len() >= 2, || {
        format!("want two maps and two links pinned: {pinned:?}")
    });
    let log_before = rig.log().len();
    for pair in [&maps, &links] {
        assert!(
            rename_pin_over(dir, pair[0], pair[1]),
            "renaming {} over {}",
            pair[0],
            pair[1]
        );
    }
    let watched: BTreeSet<String> = [maps[0], maps[1], links[0], links[1]]
        .into_iter()
        .cloned()
        .collect();
    let took = rig.wait(
        "the replaced pins pinned back",
        Duration::from_secs(10),
        || {
            pinned_ids(dir, &watched)
                .iter()
                .all(|(p, id)| ids[p] == *id)
                && pinned_ids(dir, &watched).len() == watched.len()
        },
    );
    rig.check(pinned_ids(dir, pinned) == ids, || {
        format!(
            "pins after the repair: {:?}, before: {ids:?}",
            pinned_ids(dir, pinned)
        )
    });
    // The pins are back a moment before the agent logs that it put them back.
    rig.wait(
        "the log lines for the replaced pins",
        Duration::from_secs(5),
        || {
            rig.log()[log_before..]
                .matches("pin replaced by another object")
                .count()
                >= 2
        },
    );
    let log = rig.log();
    let lines: Vec<&str> = log[log_before..]
        .lines()
        .filter(|l| l.contains("pin replaced by another object"))
        .collect();
    for (to, from) in [(maps[1], maps[0]), (links[1], links[0])] {
        let found = format!("id {}", ids[from.as_str()]);
        rig.check(
            lines
                .iter()
                .any(|l| l.contains(to.as_str()) && l.contains(&found)),
            || format!("no log line naming {to} and the stranger's {found}: {lines:?}"),
        );
    }
    rig.served(WEB, 9, "web after the replaced pins were put back");
    rig.check(rig.healthz() == "200", || {
        "/healthz after one replacement".into()
    });
    eprintln!(
        "FAULT pins-replaced: map {} and link {} renamed over {} and {}: pinned back in {took:?} \
         (every pin's kernel id as before), /healthz 200",
        maps[0], links[0], maps[1], links[1]
    );

    // A writer that keeps at it (every 100 ms, for at most 3 s): /healthz fails meanwhile. First
    // two check periods with nothing replaced, so the failure is the writer's doing.
    thread::sleep(Duration::from_secs(1));
    let stop = AtomicBool::new(false);
    let contested = thread::scope(|s| {
        let writer = s.spawn(|| {
            let started = Instant::now();
            let mut renames = 0;
            while !stop.load(Ordering::Relaxed) && started.elapsed() < Duration::from_secs(3) {
                renames += usize::from(rename_pin_over(dir, maps[0], maps[1]));
                thread::sleep(Duration::from_millis(100));
            }
            renames
        });
        let took = rig.wait(
            "/healthz 503 while a pin keeps being replaced",
            Duration::from_secs(3),
            || rig.healthz() == "503",
        );
        stop.store(true, Ordering::Relaxed);
        (took, writer.join().expect("writer"))
    });
    let (took_503, renames) = contested;
    let log = rig.log();
    rig.check(
        log.contains("replaced by other objects again since the last check"),
        || "no log line for the pin that keeps being replaced".into(),
    );
    let back = rig.wait(
        "/healthz 200 after the writer stopped",
        Duration::from_secs(10),
        || rig.healthz() == "200",
    );
    rig.wait(
        "every pin back after the writer stopped",
        Duration::from_secs(10),
        || pinned_ids(dir, pinned) == ids,
    );
    rig.served(WEB, 9, "web after the contested pin");
    eprintln!(
        "FAULT pins-contested: {renames} renames of {} over {} in 100 ms steps: /healthz 503 after \
         {took_503:?}; writer stopped: /healthz 200 after {back:?}, every pin back",
        maps[0], maps[1]
    );
}

// ---------------------------------------------------------------------------------------------
// 5. Two agents on one pin directory

#[test]
fn a_second_agent_on_the_same_pins_waits_for_the_first_and_cleanup_refuses_while_one_runs() {
    require_privileged!();
    let ips = backend_ips();
    let mut rig = Rig::start(
        vec![service("web", WEB, 80), slice("web", "a", &ready(&ips))],
        &[],
        false,
    )
    .attached();
    rig.served(WEB, 9, "web");
    let pinned = pinned_files(&rig.pin_dir);
    let ids = pinned_ids(&rig.pin_dir, &pinned);

    // The second agent waits, touching nothing.
    let (mut second, second_log) = rig.second_agent_waiting("second");
    thread::sleep(Duration::from_secs(1));
    rig.check(second.is_running(), || {
        format!("the second agent exited:\n{}", second_log())
    });
    rig.check(
        !second_log().contains("adopted pinned maps") && pinned_ids(&rig.pin_dir, &pinned) == ids,
        || {
            format!(
                "the second agent touched the pins while the first ran:\n{}",
                second_log()
            )
        },
    );
    rig.served(WEB, 9, "web with a second agent waiting");

    // cleanup refuses while an agent holds the lock, and leaves every pin.
    let pin = rig.pin_dir.to_string_lossy().into_owned();
    let out = rig
        .agent
        .cli(&["cleanup", "--pin-dir", &pin])
        .expect("running cleanup");
    let stderr = strip_ansi(&String::from_utf8_lossy(&out.stderr));
    rig.check(
        !out.status.success() && stderr.contains("an agent is running on the pin directory"),
        || format!("cleanup with an agent running: {}: {stderr}", out.status),
    );
    rig.check(pinned_ids(&rig.pin_dir, &pinned) == ids, || {
        "cleanup removed pins".into()
    });

    // The first dies: the second adopts the pins and serves.
    let killed = Instant::now();
    rig.agent.kill().expect("SIGKILL the first agent");
    second
        .wait_attached(&rig.topo.pod_interfaces())
        .unwrap_or_else(|e| panic!("{e:#}"));
    let took = killed.elapsed();
    let log = second_log();
    rig.check(
        log.contains("pin directory free")
            && log.contains("adopted pinned maps")
            && !log.contains("created new pinned maps"),
        || format!("the second agent did not adopt the first's pins:\n{log}"),
    );
    rig.served(WEB, 9, "web served by the second agent");
    eprintln!(
        "FAULT two-agents: the second waited without touching the {} pins, cleanup refused; \
         SIGKILL of the first: the second adopted the pins and attached {took:?} later",
        pinned.len()
    );
    second.stop().expect("stopping the second agent");
}

/// SIGKILL and restart: the new agent adopts the pinned maps (with the frontend) and links, and
/// traffic flows.
fn restart_and_check_adoption(rig: &mut Rig, when: &str) {
    let log_before = rig.log().len();
    rig.agent.kill().expect("SIGKILL");
    rig.served(WEB, 6, &format!("web with the agent dead {when}"));
    rig.agent.restart().expect("restart");
    let ifs = rig.topo.pod_interfaces();
    rig.agent
        .wait_attached(&ifs)
        .unwrap_or_else(|e| panic!("{e:#}"));
    let log = rig.log();
    let new = &log[log_before..];
    let adopted_maps = new
        .lines()
        .any(|l| l.contains("adopted pinned maps") && l.contains("frontends=1"));
    let adopted_links = new.lines().any(|l| l.contains("adopted pinned link"));
    rig.check(
        adopted_maps && adopted_links && !new.contains("created new pinned maps"),
        || format!("the restarted agent {when} did not adopt the pins:\n{new}"),
    );
    rig.served(WEB, 9, &format!("web after the restart {when}"));
}
