//! NodePort new-connection rate through SNAT (issue 31): what kube-proxy's users hit when an
//! external client opens many short connections to a NodePort whose endpoint is on another node.
//!
//! Two nodes, a wire and an external client (`proxy_testenv::MultiNode`): the client opens short
//! HTTP connections (connect, one GET, read to EOF; the server closes first) to NodePort 30080 of
//! node A, whose only endpoint is the pod b-web (10.244.2.11:8080) on node B, with
//! externalTrafficPolicy Cluster: node A SNATs every connection to its own address toward that
//! one backend. The connections are paced at a fixed rate of new connections (`loadgen --rate`,
//! open loop), the same for every dataplane, each in a fresh topology:
//!
//! - ours: the agent on both nodes, as the north-south tests run it (`--devices ext0`); node A's
//!   datapath counters `snat_new`, `snat_port_kept`, `drop_snat_ports_exhausted` over the load;
//! - kube-proxy's iptables and nftables rule sets (`proxy_testenv::kube_proxy`: the NodePort's
//!   external chain marks every external client, `MASQUERADE --random-fully` in postrouting) on
//!   both nodes, no agent; node A's conntrack entries after the load and its `insert_failed`
//!   over the load.
//!
//! Network safety: every namespace comes from proxy-testenv's guards (unique prefix, no route
//! out, removed on drop, processes in them killed); rule sets load only inside the node
//! namespaces; the load is bounded in count and time (`--max-conns`, `--duration-ms`, the
//! command's own timeout); the server exits after `--max-seconds`.

use std::{
    net::{Ipv4Addr, SocketAddrV4},
    path::PathBuf,
    time::Duration,
};

use anyhow::{Context as _, Result, bail, ensure};
use kube_proxy_ebpf::dataplane::{
    bpffs::PinLayout,
    maps::{Conntrack, Snat},
};
use proxy_common::ct_dir;
use proxy_testenv::{
    Agent, CLUSTER_CIDR, EXT_DEVICE, ManifestDir, MultiNode, NODE_IPS, NODE_NAMES, NetNs, PinDir,
    Proc,
    kube_proxy::{self, KubeProxyService},
};
use serde_json::{Value, json};

use super::{e2e::Mode, loadgen::PacedResult};

const NODE_A: usize = 0;
const NODE_B: usize = 1;
/// The one endpoint, a pod of node B.
const B_WEB: Ipv4Addr = Ipv4Addr::new(10, 244, 2, 11);
const TARGET_PORT: u16 = 8080;
const CLUSTER_IP: Ipv4Addr = Ipv4Addr::new(10, 96, 1, 10);
const PORT: u16 = 80;
pub const NODE_PORT: u16 = 30080;
const NAMESPACE: &str = "bench";
const NAME: &str = "np-cluster";
/// Node A's datapath counters read around the load (ours).
pub const COUNTERS: [&str; 3] = ["snat_new", "snat_port_kept", "drop_snat_ports_exhausted"];

#[derive(Clone, Debug)]
pub struct Config {
    /// The bench binary (its `serve` and `loadgen` subcommands run in the namespaces).
    pub bench_bin: PathBuf,
    pub agent_bin: PathBuf,
    /// New connections a second.
    pub rate: u32,
    pub seconds: u32,
    /// Per connection: connect, and each read and write.
    pub timeout_ms: u64,
    /// Bound on the agents' first sync and attachment.
    pub agent_timeout: Duration,
}

/// One dataplane's run.
#[derive(Clone, Debug)]
pub struct Run {
    pub mode: Mode,
    pub rate: u32,
    pub seconds: u32,
    /// Why it was not measured (programming failed).
    pub skipped: Option<String>,
    pub load: Option<PacedResult>,
    /// Ours: node A's [`COUNTERS`] over the load, in that order (`None`: not in `dump stats`).
    pub counters: Vec<Option<u64>>,
    /// Flows node A tracks just after the load: the baselines' netfilter conntrack entries
    /// (`nf_conntrack_count`, one per flow); ours, its `CONNTRACK_V1` ORIGINAL entries (one per
    /// flow: the same measure of conntrack pressure for the same load).
    pub conntrack_entries: Option<u64>,
    /// Ours: node A's `CONNTRACK_V1` entries (ORIGINAL and REPLY) and `SNAT_V1` entries (`out`
    /// and `in`) just after the load.
    pub map_entries: Option<(u64, u64)>,
    /// Node A's conntrack `insert_failed` over the load (`/proc/net/stat/nf_conntrack`).
    pub conntrack_insert_failed: Option<u64>,
    /// The 1-minute load average after the load (other work on the machine shows here).
    pub loadavg_after: f64,
}

impl Run {
    pub fn to_json(&self) -> Value {
        let counters: serde_json::Map<String, Value> = (COUNTERS.iter())
            .zip(&self.counters)
            .map(|(name, v)| ((*name).to_owned(), json!(v)))
            .collect();
        json!({
            "mode": self.mode.name(), "rate": self.rate, "seconds": self.seconds,
            "skipped": self.skipped,
            "load": self.load.as_ref().map(PacedResult::to_json),
            "node_a_counters": counters,
            "node_a_conntrack_entries_after": self.conntrack_entries,
            "node_a_map_entries_after": self.map_entries.map(|(ct, snat)| json!({"conntrack": ct, "snat": snat})),
            "node_a_conntrack_insert_failed": self.conntrack_insert_failed,
            "loadavg_after": self.loadavg_after,
        })
    }

    /// Node A's counter `name` over the load.
    pub fn counter(&self, name: &str) -> Option<u64> {
        let i = COUNTERS.iter().position(|c| *c == name)?;
        self.counters.get(i).copied().flatten()
    }
}

/// The Service and its EndpointSlice for the agents' manifest folder.
fn manifest() -> String {
    format!(
        "apiVersion: v1\nkind: Service\nmetadata:\n  name: {NAME}\n  namespace: {NAMESPACE}\n\
         spec:\n  type: NodePort\n  externalTrafficPolicy: Cluster\n  clusterIP: {CLUSTER_IP}\n  \
         clusterIPs: [\"{CLUSTER_IP}\"]\n  ports:\n  - {{name: http, port: {PORT}, \
         targetPort: {TARGET_PORT}, nodePort: {NODE_PORT}, protocol: TCP}}\n\
         ---\napiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata:\n  name: {NAME}-1\n  \
         namespace: {NAMESPACE}\n  labels:\n    kubernetes.io/service-name: {NAME}\n\
         addressType: IPv4\nports:\n  - name: http\n    port: {TARGET_PORT}\n    protocol: TCP\n\
         endpoints:\n  - addresses: [\"{B_WEB}\"]\n    nodeName: {node_b}\n    \
         conditions: {{ready: true, serving: true, terminating: false}}\n",
        node_b = NODE_NAMES[NODE_B]
    )
}

/// The same Service as kube-proxy programs it.
fn kube_proxy_service() -> KubeProxyService {
    KubeProxyService::tcp(NAMESPACE, NAME, CLUSTER_IP, PORT)
        .node_port(NODE_PORT)
        .target(TARGET_PORT, &[B_WEB])
}

/// The topology of one run. Field order is drop order: agents, pins, manifests, the server,
/// then the namespaces.
struct Env {
    agents: Vec<Agent>,
    _pins: Vec<PinDir>,
    _manifests: Option<ManifestDir>,
    _server: Proc,
    net: MultiNode,
}

impl Env {
    /// Both nodes and the client, b-web on node B with the bench's HTTP server.
    fn new(cfg: &Config) -> Result<Self> {
        let mut net = MultiNode::new().context("creating the two-node topology")?;
        let node_b = net.node_mut(NODE_B);
        node_b.add_pod("b-web", B_WEB)?;
        let ready = node_b.tmp().join("b-web.ready");
        let log = node_b.tmp().join("b-web.log");
        let server = node_b.pod("b-web")?.ns().spawn(
            &[
                path_str(&cfg.bench_bin)?,
                "serve",
                "--port",
                &TARGET_PORT.to_string(),
                "--threads",
                "8",
                "--name",
                "b-web",
                "--ready",
                path_str(&ready)?,
                "--max-seconds",
                "1800",
            ],
            Some(&log),
        )?;
        for _ in 0..500 {
            if ready.exists() {
                break;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        ensure!(ready.exists(), "the server in b-web did not start");
        Ok(Self {
            agents: Vec::new(),
            _pins: Vec::new(),
            _manifests: None,
            _server: server,
            net,
        })
    }

    fn node(&self, i: usize) -> &NetNs {
        self.net.node(i).node()
    }

    /// Ours: the agent on both nodes as the north-south tests run it, attached to ext0 and the
    /// pods.
    fn start_agents(&mut self, cfg: &Config) -> Result<()> {
        let manifests = ManifestDir::new()?;
        std::fs::write(manifests.path().join("services.yaml"), manifest())?;
        for i in 0..NODE_NAMES.len() {
            let topo = self.net.node(i);
            let pins = PinDir::new(&format!("{}-snat", topo.prefix()))?;
            let args = self.net.agent_args(i, manifests.path(), CLUSTER_CIDR);
            let args: Vec<&std::ffi::OsStr> = args.iter().map(|a| a.as_os_str()).collect();
            let agent = Agent::start_with(
                &cfg.agent_bin,
                topo.node(),
                &args,
                pins.path(),
                topo.tmp().path(),
            )?;
            self.agents.push(agent);
            self._pins.push(pins);
        }
        self._manifests = Some(manifests);
        for (i, agent) in self.agents.iter_mut().enumerate() {
            let mut want = self.net.node(i).pod_interfaces();
            want.push(EXT_DEVICE.to_owned());
            agent
                .wait_attached_within(&want, cfg.agent_timeout)
                .with_context(|| format!("the agent on {}", NODE_NAMES[i]))?;
        }
        Ok(())
    }

    /// A baseline: kube-proxy's rule set for the Service on both nodes (what each node's
    /// kube-proxy programs), no agent.
    fn install_rules(&self, mode: Mode) -> Result<()> {
        let svc = [kube_proxy_service()];
        for i in [NODE_A, NODE_B] {
            let (node, work) = (self.node(i), self.net.node(i).tmp().path());
            match mode {
                Mode::Iptables => kube_proxy::install_iptables(
                    node,
                    &kube_proxy::iptables_ruleset(&svc, CLUSTER_CIDR),
                    work,
                )?,
                Mode::Nftables => {
                    kube_proxy::install(node, &kube_proxy::nft_ruleset(&svc, CLUSTER_CIDR), work)?
                }
                Mode::Ebpf => bail!("not a netfilter mode"),
            }
        }
        Ok(())
    }

    /// Node A's [`COUNTERS`] (ours; none for the baselines).
    fn counters(&self) -> Vec<Option<u64>> {
        (COUNTERS.iter())
            .map(|name| self.agents.first()?.counter(name).ok())
            .collect()
    }

    /// Ours: node A's tracked flows (`CONNTRACK_V1` ORIGINAL entries), and its `CONNTRACK_V1`
    /// and `SNAT_V1` entries, read from the pinned maps.
    fn our_entries(&self) -> Result<(u64, (u64, u64))> {
        let pins = PinLayout::new(self._pins.first().context("no agent on node A")?.path());
        let ct = Conntrack::open_pinned(&pins)?.entries();
        let snat = Snat::open_pinned(&pins)?.entries();
        let flows = ct.iter().filter(|(k, _)| k.dir == ct_dir::ORIGINAL).count();
        Ok((flows as u64, (ct.len() as u64, snat.len() as u64)))
    }

    /// The paced load from the external client to node A's NodePort.
    fn load(&self, cfg: &Config, rate: u32, seconds: f64) -> Result<PacedResult> {
        let target = SocketAddrV4::new(NODE_IPS[NODE_A], NODE_PORT);
        let duration_ms = (seconds * 1e3) as u64;
        let max_conns = (f64::from(rate) * seconds).ceil() as u64;
        let out = self.net.client().output(
            &[
                path_str(&cfg.bench_bin)?,
                "loadgen",
                "--targets",
                &target.to_string(),
                "--rate",
                &rate.to_string(),
                "--duration-ms",
                &duration_ms.to_string(),
                "--max-conns",
                &max_conns.to_string(),
                "--timeout-ms",
                &cfg.timeout_ms.to_string(),
            ],
            // Killed (its process group) if it overruns its own bounds.
            Duration::from_millis(duration_ms + 2 * cfg.timeout_ms) + Duration::from_secs(30),
        )?;
        ensure!(
            out.status.success(),
            "paced loadgen failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let v: Value = serde_json::from_slice(&out.stdout).context("paced loadgen output")?;
        PacedResult::from_json(&v)
    }
}

/// Node A's netfilter conntrack: entries now, and `insert_failed` summed over CPUs (`None` when
/// conntrack is not there).
fn conntrack(node: &NetNs) -> (Option<u64>, Option<u64>) {
    let entries = (node
        .exec(&["cat", "/proc/sys/net/netfilter/nf_conntrack_count"])
        .ok())
    .and_then(|s| s.trim().parse().ok());
    let insert_failed = (node.exec(&["cat", "/proc/net/stat/nf_conntrack"]).ok())
        .and_then(|text| stat_column(&text, "insert_failed"));
    (entries, insert_failed)
}

/// Column `name` of `/proc/net/stat/nf_conntrack` (a header, then one row of hex per CPU),
/// summed.
fn stat_column(text: &str, name: &str) -> Option<u64> {
    let mut lines = text.lines();
    let col = lines.next()?.split_whitespace().position(|c| c == name)?;
    lines
        .map(|l| {
            let field = l.split_whitespace().nth(col)?;
            u64::from_str_radix(field, 16).ok()
        })
        .sum()
}

/// One dataplane at `cfg.rate` for `cfg.seconds`, in a fresh topology.
pub fn run(cfg: &Config, mode: Mode) -> Result<Run> {
    let mut env = Env::new(cfg)?;
    let mut out = Run {
        mode,
        rate: cfg.rate,
        seconds: cfg.seconds,
        skipped: None,
        load: None,
        counters: vec![None; COUNTERS.len()],
        conntrack_entries: None,
        conntrack_insert_failed: None,
        map_entries: None,
        loadavg_after: f64::NAN,
    };
    let programmed = match mode {
        Mode::Ebpf => env.start_agents(cfg),
        Mode::Iptables | Mode::Nftables => env.install_rules(mode),
    };
    if let Err(e) = programmed {
        out.skipped = Some(format!("{e:#}"));
        return Ok(out);
    }
    // The path works before the load: a few connections at a low rate, all answered.
    let check = env.load(cfg, 20, 0.5)?;
    ensure!(
        check.answered == check.planned && check.planned > 0,
        "{}: NodePort {NODE_PORT} of node A does not answer before the load: {} of {} answered, \
         first error {:?}",
        mode.name(),
        check.answered,
        check.planned,
        check.first_error
    );
    let before = env.counters();
    let (_, failed_before) = conntrack(env.node(NODE_A));
    let load = env.load(cfg, cfg.rate, f64::from(cfg.seconds))?;
    let (mut entries, failed_after) = conntrack(env.node(NODE_A));
    if mode == Mode::Ebpf {
        let (flows, map_entries) = env.our_entries()?;
        entries = Some(flows);
        out.map_entries = Some(map_entries);
    }
    out.counters = (before.iter().zip(env.counters()))
        .map(|(b, a)| Some(a?.saturating_sub((*b)?)))
        .collect();
    out.conntrack_entries = entries;
    out.conntrack_insert_failed = failed_after
        .zip(failed_before)
        .map(|(a, b)| a.saturating_sub(b));
    out.loadavg_after = super::report::loadavg();
    out.load = Some(load);
    Ok(out)
}

fn path_str(p: &std::path::Path) -> Result<&str> {
    p.to_str()
        .with_context(|| format!("non-UTF-8 path {}", p.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn conntrack_stat_columns_are_summed_over_cpus() {
        let text = "entries  clashres found new invalid ignore delete chainlength insert \
                    insert_failed drop\n\
                    00000010  00000000 00000000 00000000 00000000 00000000 00000000 00000000 \
                    00000000 0000000a 00000000\n\
                    00000010  00000000 00000000 00000000 00000000 00000000 00000000 00000000 \
                    00000000 00000001 00000000\n";
        assert_eq!(stat_column(text, "insert_failed"), Some(11));
        assert_eq!(stat_column(text, "early_drop"), None);
    }

    #[test]
    fn the_baselines_masquerade_the_node_port() {
        let svc = [kube_proxy_service()];
        let nft = kube_proxy::nft_ruleset(&svc, CLUSTER_CIDR);
        assert!(nft.contains("service-nodeports { tcp . 30080 : goto external-"));
        assert!(nft.contains("masquerade fully-random"));
        let ipt = kube_proxy::iptables_ruleset(&svc, CLUSTER_CIDR);
        assert!(ipt.contains("--dport 30080 -j KUBE-EXT-"));
        assert!(ipt.contains("-j MASQUERADE --random-fully"));
    }
}
