//! The command line: the flags (kube-proxy compatible where they mean the same thing), the
//! KubeProxyConfiguration file merged under them (`config`), and the offline subcommands `dump`,
//! `cleanup` and `mount-bpffs`.
//!
//! May call: `pipeline` (parsed address types, the model dump decodes into), `dataplane` (map
//! sizes, pins, the maps dump reads). Nothing calls `cli` but `agent` and `main`.

pub mod cleanup;
pub mod config;
pub mod dump;
pub mod duration;
pub mod kube_proxy;
pub mod mount_bpffs;

use std::{path::PathBuf, time::Duration};

use clap::{Parser, Subcommand, ValueEnum};
pub use duration::parse_duration;
use proxy_common::Scheduler;

#[derive(Debug, Parser)]
#[command(
    name = "kube-proxy-ebpf",
    version,
    about = "eBPF kube-proxy replacement"
)]
pub struct Cli {
    /// Log verbosity like kube-proxy's -v (0 = info, 1+ = debug, 3+ = trace); RUST_LOG overrides.
    #[arg(short = 'v', long = "v", global = true, default_value_t = 0)]
    pub verbosity: u8,
    #[command(subcommand)]
    pub command: Command,
}

impl Cli {
    /// The log filter: RUST_LOG (`rust_log`) if set, else the level of `-v`. Unless the filter
    /// names kube-client itself, its client's own lines are off (ERROR
    /// `kube_client::client::builder` per failed request, WARN `eof in poll` per broken watch:
    /// dozens per reflector while the API server is down): the agent reports an outage once
    /// itself, and every request error reaches it as a `Result`.
    pub fn log_filter(&self, rust_log: Option<&str>) -> String {
        let base = rust_log.unwrap_or(match self.verbosity {
            0 => "info",
            1 | 2 => "debug",
            _ => "trace",
        });
        let mut filter = if base.contains("kube_client") {
            base.to_owned()
        } else {
            format!("{base},kube_client::client=off")
        };
        // `--bpf-log`: the datapath's records pass at the level asked for, unless RUST_LOG says
        // otherwise for their target.
        if let Command::Run(run) = &self.command
            && let Some(directive) = run.bpf_log.filter_directive()
            && !base.contains(proxy_common::bpf_log::TARGET)
        {
            filter = format!("{filter},{directive}");
        }
        filter
    }
}

#[derive(Debug, Subcommand)]
#[expect(
    clippy::large_enum_variant,
    reason = "parsed once at start-up; boxing would only add noise"
)]
pub enum Command {
    /// Run the agent: program the datapath and keep it equal to the Services.
    Run(RunArgs),
    /// Print the datapath's state, decoded from the pinned maps (works while the agent runs).
    Dump(DumpArgs),
    /// Remove everything the agent installed (links, maps, pin directory) and exit.
    Cleanup(PinArgs),
    /// Mount a bpffs at DIR unless one is there already, and exit (the DaemonSet's privileged
    /// init step; needs CAP_SYS_ADMIN only when it mounts).
    MountBpffs(MountBpffsArgs),
}

#[derive(Debug, clap::Args)]
pub struct MountBpffsArgs {
    /// Where the bpffs goes (the host's /sys/fs/bpf, mounted into the init container).
    #[arg(default_value = "/sys/fs/bpf")]
    pub dir: PathBuf,
}

#[derive(Debug, clap::Args)]
pub struct PinArgs {
    /// bpffs directory holding the pinned maps and links.
    #[arg(long, env = "KPE_PIN_DIR", default_value = proxy_common::DEFAULT_PIN_DIR)]
    pub pin_dir: PathBuf,
}

#[derive(Debug, clap::Args)]
pub struct RunArgs {
    /// Standalone mode: a folder of Service/EndpointSlice manifests (YAML/JSON, multi-document),
    /// reloaded within a second of any change. Without it the Kubernetes API is watched.
    #[arg(long, env = "KPE_MANIFESTS", conflicts_with_all = ["kubeconfig", "master"])]
    pub manifests: Option<PathBuf>,
    /// Path to a kubeconfig file (default: KUBECONFIG, ~/.kube/config, then the in-cluster
    /// service account).
    #[arg(long)]
    pub kubeconfig: Option<PathBuf>,
    /// The API server's URL; overrides the one in the kubeconfig. Without a kubeconfig the
    /// pod's service account (token and CA) is used with it: the way to name the real API
    /// server in place of the `kubernetes` Service's ClusterIP, which this agent itself must
    /// translate.
    #[arg(long, env = "KPE_MASTER")]
    pub master: Option<String>,
    /// Where the pod's service account token, CA and namespace are mounted (in-cluster
    /// configuration).
    #[arg(long, env = "KPE_SERVICE_ACCOUNT_DIR", default_value = crate::sources::kube::bootstrap::SERVICE_ACCOUNT_DIR, hide = true)]
    pub service_account_dir: PathBuf,
    #[command(flatten)]
    pub pins: PinArgs,
    /// Pod-facing interfaces to attach to: `auto` (every veth or netkit device whose peer is in
    /// another network namespace, whatever the CNI names it; not the ports of a bond, nor of a
    /// bridge that is an external device) or comma-separated globs, which replace the
    /// detection. Interfaces created later are attached as they appear.
    #[arg(long, env = "KPE_POD_INTERFACES", default_value = "auto")]
    pub pod_interfaces: String,
    /// The node's external devices (NodePorts, externalIPs and LoadBalancer IPs arrive there;
    /// `primary` NodePort addresses and the SNAT address come from them): empty or `auto`
    /// (every device with a global address or a default route: physical NICs, bonds, VLANs;
    /// bridges, veths, Open vSwitch and dummy devices only with a default route; not loopback,
    /// tunnels or the ports of a bond or bridge), or comma-separated globs, which replace the
    /// detection.
    #[arg(long, env = "KPE_DEVICES", default_value = "auto")]
    pub devices: String,
    /// Tunnel devices carrying pod traffic between nodes (flannel.1, vxlan.calico, geneve, tunl0,
    /// wg0...): `auto` also attaches to every vxlan, geneve and gretap device and every L3 tunnel
    /// (ipip, gre, sit, ip6tnl, wireguard, TUN-mode tun) of the namespace, found by link kind as
    /// they appear, and SNATs forwarded external flows leaving through one to its own address;
    /// `none` attaches only to what --devices and --pod-interfaces name.
    #[arg(long, env = "KPE_TUNNEL_DEVICES", value_enum, default_value_t = TunnelDevices::Auto)]
    pub tunnel_devices: TunnelDevices,
    /// Name of this node (decides which endpoints are local).
    #[arg(long, env = "NODE_NAME")]
    pub hostname_override: Option<String>,
    /// Write a JSON status (syncs, frontends, backends, interfaces, problems) here after each sync.
    #[arg(long)]
    pub status_file: Option<PathBuf>,
    /// Shortest time between two syncs (an isolated change is applied at once).
    #[arg(long, value_parser = parse_duration, default_value = "1s")]
    pub min_sync_period: Duration,
    /// Longest time between two full syncs.
    #[arg(long, value_parser = parse_duration, default_value = "30s")]
    pub sync_period: Duration,
    /// How often the pins under --pin-dir are checked: a removed pin is pinned again from the
    /// maps and links the agent holds open; a pin directory no longer on a bpffs (unmounted)
    /// fails /healthz until it is back.
    #[arg(long, value_parser = parse_duration, default_value = "10s")]
    pub pin_check_period: Duration,
    /// Idle timeout of established TCP flows (kube-proxy's `--conntrack-tcp-timeout-established`,
    /// also accepted; 0 = the kernel's 5 days).
    #[arg(long, alias = "conntrack-tcp-timeout-established", value_parser = parse_duration, default_value = "24h")]
    pub conntrack_tcp_established_timeout: Duration,
    /// Idle timeout of half-closed TCP flows (a FIN from one side only; 0 = the kernel's 60 s).
    #[arg(long, value_parser = parse_duration, default_value = "1h")]
    pub conntrack_tcp_timeout_close_wait: Duration,
    /// Idle timeout of TCP flows being opened (SYN) or closed (FIN from both sides, or RST).
    #[arg(long, value_parser = parse_duration, default_value = "2m")]
    pub conntrack_tcp_transitory_timeout: Duration,
    /// Idle timeout of UDP flows the backend has not answered (one-shot datagrams; 0 = the
    /// kernel's 30 s).
    #[arg(long, value_parser = parse_duration, default_value = "30s")]
    pub conntrack_udp_timeout: Duration,
    /// Idle timeout of UDP flows once the backend has answered (0 = the kernel's 120 s).
    #[arg(long, value_parser = parse_duration, default_value = "2m")]
    pub conntrack_udp_timeout_stream: Duration,
    /// Capacity of the SERVICES map in entries (one per frontend plus one per backend slot),
    /// used when the maps are first created; adopted pinned maps keep their size.
    #[arg(long, env = "KPE_MAP_SERVICES", default_value_t = proxy_common::SERVICES_CAPACITY)]
    pub map_entries_services: u32,
    /// Capacity of the BACKENDS map (distinct endpoint address/port/protocol).
    #[arg(long, env = "KPE_MAP_BACKENDS", default_value_t = proxy_common::BACKENDS_CAPACITY)]
    pub map_entries_backends: u32,
    /// Capacity of the REVNAT map (frontends).
    #[arg(long, env = "KPE_MAP_REVNAT", default_value_t = proxy_common::REVNAT_CAPACITY)]
    pub map_entries_revnat: u32,
    /// Capacity of the session affinity map (AFFINITY_V1, LRU: one record per client and
    /// ClientIP-affinity Service port; the least recently used go first when it is full).
    #[arg(long, env = "KPE_AFFINITY_MAX_ENTRIES", default_value_t = proxy_common::AFFINITY_CAPACITY)]
    pub affinity_max_entries: u32,
    /// Entries M of every Maglev (`mh`) table, a prime: 251, 509, 1021, 2039, 4093, 8191,
    /// 16381, 32749, 65521 or 131071. Larger M balances more backends evenly (keep M ≥ 100 ×
    /// the backends of a Service); each table takes 2 KiB × ⌈M/960⌉ of kernel memory (36 KiB at
    /// the default). Changing it at a restart rebuilds every table.
    #[arg(long, value_parser = parse_maglev_table_size, default_value_t = proxy_common::maglev::DEFAULT_TABLE_SIZE)]
    pub maglev_table_size: u32,
    /// Flows tracked per CPU (kube-proxy's `conntrack.maxPerCore`): the CONNTRACK and SNAT maps
    /// are sized for max(this × CPUs, --conntrack-min) flows, two entries per flow each. 0 = the
    /// built-in 131072 flows.
    #[arg(long, default_value_t = crate::dataplane::sizing::DEFAULT_MAX_PER_CORE)]
    pub conntrack_max_per_core: u32,
    /// The least number of flows tracked, whatever the CPU count (kube-proxy's `conntrack.min`).
    #[arg(long, default_value_t = crate::dataplane::sizing::DEFAULT_MIN)]
    pub conntrack_min: u32,
    /// Capacity of the CONNTRACK LRU map in entries (two per flow), used when the map is first
    /// created; given, it wins over --conntrack-max-per-core/--conntrack-min.
    #[arg(long, env = "KPE_MAP_CONNTRACK")]
    pub map_entries_conntrack: Option<u32>,
    /// Capacity of the SNAT LRU map in entries (two per SNATed flow), used when the map is
    /// first created; given, it wins over --conntrack-max-per-core/--conntrack-min.
    #[arg(long, env = "KPE_MAP_SNAT")]
    pub map_entries_snat: Option<u32>,
    /// Capacity of the IPv6 CONNTRACK6 LRU map in entries (two per flow), used when the map is
    /// first created. Not derived from --conntrack-max-per-core: the map is preallocated
    /// (≈ 150 B an entry) whether or not the cluster has IPv6 Services, so it keeps the built-in
    /// 65536 entries unless given.
    #[arg(long, env = "KPE_MAP_CONNTRACK6")]
    pub map_entries_conntrack6: Option<u32>,
    /// Capacity of the SERVICES6 map (IPv6 frontends and their backend slots; default 32768),
    /// used when the map is first created, as --map-entries-services.
    #[arg(long, env = "KPE_MAP_SERVICES6")]
    pub map_entries_services6: Option<u32>,
    /// Capacity of the BACKENDS6 map (distinct IPv6 endpoints; default 32768).
    #[arg(long, env = "KPE_MAP_BACKENDS6")]
    pub map_entries_backends6: Option<u32>,
    /// Capacity of the REVNAT6 map (IPv6 frontends; default 8192).
    #[arg(long, env = "KPE_MAP_REVNAT6")]
    pub map_entries_revnat6: Option<u32>,
    /// Capacity of the SNAT6 LRU map (two entries per SNATed IPv6 flow; default 32768).
    #[arg(long, env = "KPE_MAP_SNAT6")]
    pub map_entries_snat6: Option<u32>,
    /// Capacity of the IPv6 session affinity map (AFFINITY6_V1, LRU; default 16384).
    #[arg(long, env = "KPE_AFFINITY_MAX_ENTRIES6")]
    pub affinity_max_entries6: Option<u32>,
    /// How the IPv6 maps are sized when they are created (every hash and LRU map is
    /// preallocated by the kernel, ≈ 32 MB for the IPv6 ones at their default sizes): `auto`
    /// sizes them (the --map-entries-*6 flags or their defaults) when the node has a usable
    /// IPv6 address at start, an IPv6 prefix is configured (--cluster-cidr, --service-cidr,
    /// --nodeport-addresses) or a --map-entries-*6 / --affinity-max-entries6 flag is given, and
    /// creates them with one entry each otherwise (an IPv4-only node; restart the agent once the
    /// node has IPv6: the one-entry maps are then replaced); `full` always sizes them; `minimal`
    /// never does.
    #[arg(long, env = "KPE_IPV6_MAPS", value_enum, default_value_t = crate::dataplane::sizing::Ipv6Maps::Auto)]
    pub ipv6_maps: crate::dataplane::sizing::Ipv6Maps,
    /// Remove everything the agent installed and exit (like kube-proxy --cleanup).
    #[arg(long)]
    pub cleanup: bool,
    /// Remove kube-proxy's rules from the node once the datapath is attached (its `KUBE-*`
    /// iptables chains, `table ip/ip6 kube-proxy`, `kube-ipvs0`, IPVS virtual servers), as
    /// `kube-proxy --cleanup` does; deploy/daemonset.yaml sets it. Without it they stay (and a
    /// log line says so): harmless to traffic the datapath translates, but stale.
    #[arg(long, env = "KPE_REMOVE_KUBE_PROXY_RULES")]
    pub remove_kube_proxy_rules: bool,
    /// This agent's DaemonSet, NAMESPACE/NAME (deploy/daemonset.yaml sets it). It tells an
    /// uninstall from a restart: stopped while the DaemonSet is deleted or being deleted, or
    /// while its pod template no longer selects this node (a node opting out by label), the
    /// agent removes its datapath (programs detached, pins removed); any other stop keeps it for
    /// the next agent. Without it every stop keeps the datapath.
    #[arg(long, env = "KPE_DAEMONSET", value_name = "NAMESPACE/NAME")]
    pub daemonset: Option<crate::sources::kube::uninstall::DaemonSetRef>,
    /// Hand new flows over to the node's stack (stop translating them with frozen maps) also
    /// once no agent has run for this long; 0 = never by time. Another Service proxy binding
    /// kube-proxy's ports (10256, 10249) while no agent runs hands over at once either way.
    #[arg(long, value_parser = parse_duration, default_value = "0s")]
    pub handover_after: Duration,
    /// A KubeProxyConfiguration file (kubeproxy.config.k8s.io/v1alpha1). Flags given explicitly
    /// override it; it overrides flag defaults.
    #[arg(long, env = "KPE_CONFIG")]
    pub config: Option<PathBuf>,
    /// IP:port for /healthz and /livez (empty: disabled).
    #[arg(long, value_parser = crate::pipeline::addresses::parse_healthz_bind_address, default_value = "0.0.0.0:10256")]
    pub healthz_bind_address: crate::pipeline::addresses::BindAddress,
    /// IP:port for /metrics (empty: disabled).
    #[arg(long, value_parser = crate::pipeline::addresses::parse_metrics_bind_address, default_value = "127.0.0.1:10249")]
    pub metrics_bind_address: crate::pipeline::addresses::BindAddress,
    /// Node addresses NodePorts answer on: comma-separated CIDRs, `primary`, or empty for all.
    #[arg(long, value_parser = crate::pipeline::addresses::parse_nodeport_addresses, default_value = "")]
    pub nodeport_addresses: crate::pipeline::addresses::NodePortAddresses,
    /// cgroup v2 directory whose processes reach Services from the node's own network namespace
    /// (cgroup socket hooks translate their connect()/sendmsg()): `auto` = the first cgroup2 mount
    /// (the host's root when the host's cgroup fs is mounted), a directory, or `none` (then the
    /// node's own processes cannot reach ClusterIPs or its NodePorts).
    #[arg(long, env = "KPE_SOCKET_LB_CGROUP", default_value = "auto")]
    pub socket_lb_cgroup: crate::dataplane::sock_lb::SockLbCgroup,
    /// The cluster's pod CIDRs, comma-separated (kube-proxy's clusterCIDR). With
    /// --detect-local-mode ClusterCIDR, clients inside them (and the node) reach
    /// externalTrafficPolicy Local NodePorts, externalIPs and LoadBalancer IPs through the
    /// Service's cluster-wide endpoints, like upstream's short-circuit. IPv4, at most 4.
    #[arg(long, value_delimiter = ',', value_parser = crate::pipeline::addresses::parse_cidr)]
    pub cluster_cidr: Vec<crate::pipeline::addresses::Cidr>,
    /// The Service CIDRs (comma-separated, both families): a new flow to an address inside them
    /// that no Service has is dropped, and to a ClusterIP on a port none of its Services has,
    /// rejected (kube-proxy nftables' behaviour). In Kubernetes mode the cluster's ServiceCIDR
    /// objects (networking.k8s.io/v1) are added to these.
    #[arg(long, value_delimiter = ',', value_parser = crate::pipeline::addresses::parse_cidr)]
    pub service_cidr: Vec<crate::pipeline::addresses::Cidr>,
    /// The node's load-balancing scheduler for Services without the
    /// `kube-proxy-ebpf.io/scheduler` annotation (KubeProxyConfiguration `ipvs.scheduler`):
    /// random (the flow hash), rr, lc, sh, dh, mh, or an IPVS alias (wrr, wlc, sed, nq, lblc,
    /// lblcr, maglev). Empty = random.
    #[arg(long, env = "KPE_SCHEDULER", value_name = "NAME", value_parser = parse_scheduler, default_value = "random")]
    pub scheduler: Scheduler,
    /// How in-cluster clients are told apart (kube-proxy's detectLocalMode). Only ClusterCIDR
    /// is implemented; with the others no client counts as in-cluster.
    #[arg(long, value_enum, default_value_t = DetectLocalMode::ClusterCidr)]
    pub detect_local_mode: DetectLocalMode,
    /// The datapath's own log (aya-log, off by default, free when off): off, error, warn (a new
    /// flow without SNAT port), info (new flows refused: source ranges, no endpoints), debug (each
    /// new flow's translation, affinity hits, socket-hook rewrites, first replies), trace (every
    /// reply). Logged under the target `kube_proxy_ebpf::datapath`, let through at this level
    /// unless RUST_LOG names that target itself.
    #[arg(long, env = "KPE_BPF_LOG", value_enum, ignore_case = true, value_name = "LEVEL", default_value_t = crate::dataplane::bpf_log::BpfLog::Off)]
    pub bpf_log: crate::dataplane::bpf_log::BpfLog,
    /// kube-proxy's flags that are not the agent's own (hidden; `kube_proxy`).
    #[command(flatten)]
    pub kube_proxy: kube_proxy::KubeProxyFlags,
}

impl RunArgs {
    /// Every setting at its default (what `run` alone parses to; `KPE_*` variables apply).
    pub fn defaults() -> Self {
        match Cli::try_parse_from(["kube-proxy-ebpf", "run"]).map(|c| c.command) {
            Ok(Command::Run(args)) => args,
            other => unreachable!("`run` alone always parses: {other:?}"),
        }
    }

    /// Whether the configuration names IPv6 (for `--ipv6-maps auto`): an IPv6 prefix in
    /// --cluster-cidr, --service-cidr or --nodeport-addresses, or an IPv6 map size given.
    pub fn ipv6_configured(&self) -> bool {
        use crate::pipeline::addresses::NodePortAddresses;
        let v6 = |c: &crate::pipeline::addresses::Cidr| c.addr.is_ipv6();
        let nodeport = match &self.nodeport_addresses {
            NodePortAddresses::Cidrs(cidrs) => cidrs.iter().any(v6),
            NodePortAddresses::All | NodePortAddresses::Primary => false,
        };
        nodeport
            || self.cluster_cidr.iter().any(v6)
            || self.service_cidr.iter().any(v6)
            || [
                self.map_entries_conntrack6,
                self.map_entries_services6,
                self.map_entries_backends6,
                self.map_entries_revnat6,
                self.map_entries_snat6,
                self.affinity_max_entries6,
            ]
            .iter()
            .any(Option::is_some)
    }

    /// The map sizes these settings ask for, for [`crate::dataplane::sizing`] to turn into entries.
    pub fn map_request(&self) -> crate::dataplane::sizing::Requested {
        crate::dataplane::sizing::Requested {
            conntrack_max_per_core: self.conntrack_max_per_core,
            conntrack_min: self.conntrack_min,
            map_entries_conntrack: self.map_entries_conntrack,
            map_entries_snat: self.map_entries_snat,
            map_entries_conntrack6: self.map_entries_conntrack6,
            map_entries_services6: self.map_entries_services6,
            map_entries_backends6: self.map_entries_backends6,
            map_entries_revnat6: self.map_entries_revnat6,
            map_entries_snat6: self.map_entries_snat6,
            affinity_max_entries6: self.affinity_max_entries6,
            ipv6_maps: self.ipv6_maps,
            ipv6_configured: self.ipv6_configured(),
            map_entries_services: self.map_entries_services,
            map_entries_backends: self.map_entries_backends,
            map_entries_revnat: self.map_entries_revnat,
            affinity_max_entries: self.affinity_max_entries,
        }
    }
}

/// `--tunnel-devices`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, ValueEnum)]
pub enum TunnelDevices {
    /// Attach to every tunnel device: Ethernet-framed (vxlan, geneve, gretap) and L3 (ipip, gre,
    /// wireguard, TUN-mode tun).
    #[default]
    Auto,
    /// Attach only to the interfaces the patterns name.
    None,
}

/// kube-proxy's detectLocalMode values.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, ValueEnum)]
pub enum DetectLocalMode {
    /// Sources inside --cluster-cidr (upstream's default).
    #[default]
    #[value(name = "ClusterCIDR")]
    ClusterCidr,
    /// Sources inside the Node's spec.podCIDRs (not implemented here).
    #[value(name = "NodeCIDR")]
    NodeCidr,
    /// Packets arriving on the pod bridge (not implemented here).
    #[value(name = "BridgeInterface")]
    BridgeInterface,
    /// Packets arriving on interfaces with a name prefix (not implemented here).
    #[value(name = "InterfaceNamePrefix")]
    InterfaceNamePrefix,
}

impl std::fmt::Display for DetectLocalMode {
    /// Upstream's spelling (`ClusterCIDR`, ...).
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.to_possible_value() {
            Some(v) => f.write_str(v.get_name()),
            None => write!(f, "{self:?}"),
        }
    }
}

#[derive(Debug, clap::Args)]
pub struct DumpArgs {
    /// What to print.
    #[arg(value_enum)]
    pub what: DumpWhat,
    #[command(flatten)]
    pub pins: PinArgs,
}

#[derive(Clone, Copy, Debug, ValueEnum)]
pub enum DumpWhat {
    Services,
    Backends,
    Conntrack,
    Stats,
    /// SNAT entries of external (NodePort/externalIP/LB, eTP=Cluster) and hairpin flows.
    Snat,
    /// Fragmented datagrams whose first fragment passed a hook, and what their later fragments
    /// get.
    Fragments,
    /// Session affinity records: client → endpoint per Service port, idle time, live or expired.
    Affinity,
    /// Maglev (`mh`) tables: the frontends naming each, and each backend's share of entries.
    Maglev,
}

/// A scheduler name (ours or an IPVS alias, [`Scheduler::parse`]); empty or blank = the
/// default (`random`).
pub fn parse_scheduler(s: &str) -> Result<Scheduler, String> {
    let name = s.trim();
    if name.is_empty() {
        return Ok(Scheduler::default());
    }
    Scheduler::parse(name).ok_or_else(|| {
        format!(
            "unknown scheduler {name:?}: use one of {}",
            proxy_common::sched::SCHEDULER_NAMES
        )
    })
}

/// `--maglev-table-size`: one of `proxy_common::maglev::TABLE_SIZES`.
pub fn parse_maglev_table_size(s: &str) -> Result<u32, String> {
    let sizes = proxy_common::maglev::TABLE_SIZES;
    s.trim()
        .parse::<u32>()
        .ok()
        .filter(|m| proxy_common::maglev::valid_size(*m))
        .ok_or_else(|| format!("invalid Maglev table size {s:?}: use one of the primes {sizes:?}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_parse_like_go() {
        assert_eq!(parse_duration("1s"), Ok(Duration::from_secs(1)));
        assert_eq!(parse_duration("500ms"), Ok(Duration::from_millis(500)));
        assert_eq!(parse_duration("1h30m"), Ok(Duration::from_secs(5400)));
        assert_eq!(parse_duration("24h"), Ok(Duration::from_secs(86_400)));
        assert!(parse_duration("").is_err());
        assert!(parse_duration("10").is_err());
        assert!(parse_duration("5 parsecs").is_err());
    }

    #[test]
    fn log_filter_silences_kube_client_request_errors_unless_asked_for() {
        let cli =
            |v: &str| Cli::try_parse_from(["kube-proxy-ebpf", "-v", v, "cleanup"]).expect("parse");
        let off = "kube_client::client=off";
        assert_eq!(cli("0").log_filter(None), format!("info,{off}"));
        assert_eq!(cli("2").log_filter(None), format!("debug,{off}"));
        assert_eq!(cli("4").log_filter(None), format!("trace,{off}"));
        assert_eq!(cli("0").log_filter(Some("warn")), format!("warn,{off}"));
        assert_eq!(
            cli("0").log_filter(Some("info,kube_client=debug")),
            "info,kube_client=debug"
        );
    }

    #[test]
    fn bpf_log_is_off_by_default_and_opens_the_filter_for_the_datapath_target() {
        use crate::dataplane::bpf_log::BpfLog;
        let run = |extra: &[&str]| {
            let mut args = vec!["kube-proxy-ebpf", "run", "--manifests", "/m"];
            args.extend_from_slice(extra);
            Cli::try_parse_from(args)
        };
        let level = |cli: &Cli| match &cli.command {
            Command::Run(r) => r.bpf_log,
            _ => panic!("not run"),
        };
        let off = "kube_client::client=off";
        let default = run(&[]).expect("parse");
        assert_eq!(level(&default), BpfLog::Off);
        assert_eq!(
            default.log_filter(None),
            format!("info,{off}"),
            "no directive when off"
        );
        for (name, want) in [
            ("off", BpfLog::Off),
            ("error", BpfLog::Error),
            ("warn", BpfLog::Warn),
            ("info", BpfLog::Info),
            ("debug", BpfLog::Debug),
            ("trace", BpfLog::Trace),
        ] {
            assert_eq!(level(&run(&["--bpf-log", name]).expect(name)), want);
        }
        assert_eq!(
            level(&run(&["--bpf-log", "DEBUG"]).expect("case")),
            BpfLog::Debug
        );
        assert!(run(&["--bpf-log", "verbose"]).is_err());
        let debug = run(&["--bpf-log", "debug"]).expect("parse");
        assert_eq!(
            debug.log_filter(None),
            format!("info,{off},kube_proxy_ebpf::datapath=debug")
        );
        assert_eq!(
            debug.log_filter(Some("warn")),
            format!("warn,{off},kube_proxy_ebpf::datapath=debug"),
            "the flag is explicit: RUST_LOG's base level does not hide the records"
        );
        assert_eq!(
            debug.log_filter(Some("info,kube_proxy_ebpf::datapath=info")),
            format!("info,kube_proxy_ebpf::datapath=info,{off}"),
            "RUST_LOG naming the target wins"
        );
    }

    #[test]
    fn cli_parses_run_flags() {
        let cli = Cli::try_parse_from([
            "kube-proxy-ebpf",
            "run",
            "--manifests",
            "/m",
            "--pin-dir",
            "/sys/fs/bpf/x",
            "--pod-interfaces",
            "veth-*",
            "--min-sync-period",
            "100ms",
            "--map-entries-services",
            "1100000",
        ])
        .expect("parse");
        let Command::Run(run) = cli.command else {
            panic!("not run")
        };
        assert_eq!(run.min_sync_period, Duration::from_millis(100));
        assert_eq!(run.map_entries_services, 1_100_000);
        assert_eq!(run.map_entries_backends, proxy_common::BACKENDS_CAPACITY);
        assert_eq!(run.pins.pin_dir, PathBuf::from("/sys/fs/bpf/x"));
        assert!(run.cluster_cidr.is_empty());
        assert_eq!(run.detect_local_mode, DetectLocalMode::ClusterCidr);
        assert_eq!(
            run.tunnel_devices,
            TunnelDevices::Auto,
            "tunnels by default"
        );
        let cli = Cli::try_parse_from([
            "kube-proxy-ebpf",
            "run",
            "--manifests",
            "/m",
            "--tunnel-devices",
            "none",
        ])
        .expect("parse");
        let Command::Run(run) = cli.command else {
            panic!("not run")
        };
        assert_eq!(run.tunnel_devices, TunnelDevices::None);
    }

    #[test]
    fn scheduler_flag_takes_names_and_ipvs_aliases_and_rejects_others() {
        let run = |extra: &[&str]| {
            let mut argv = vec!["kube-proxy-ebpf", "run", "--manifests", "/m"];
            argv.extend(extra);
            Cli::try_parse_from(argv).map(|cli| match cli.command {
                Command::Run(run) => run.scheduler,
                _ => panic!("not run"),
            })
        };
        assert_eq!(run(&[]).expect("default"), Scheduler::Random);
        assert_eq!(
            run(&["--scheduler", "rr"]).expect("rr"),
            Scheduler::RoundRobin
        );
        assert_eq!(
            run(&["--scheduler", "wlc"]).expect("wlc"),
            Scheduler::LeastConnection
        );
        assert_eq!(
            run(&["--scheduler", "maglev"]).expect("maglev"),
            Scheduler::Maglev
        );
        assert_eq!(
            run(&["--scheduler", " dh "]).expect("dh"),
            Scheduler::DestinationHash
        );
        assert_eq!(run(&["--scheduler", ""]).expect("empty"), Scheduler::Random);
        let err = run(&["--scheduler", "fastest"])
            .expect_err("unknown")
            .to_string();
        assert!(
            err.contains("--scheduler")
                && err.contains("\"fastest\"")
                && err.contains("mh (maglev)"),
            "{err}"
        );
    }

    #[test]
    fn cluster_cidr_is_a_comma_separated_list_like_upstream() {
        let cli = Cli::try_parse_from([
            "kube-proxy-ebpf",
            "run",
            "--manifests",
            "/m",
            "--cluster-cidr",
            "10.244.0.0/16,100.64.0.0/10",
            "--detect-local-mode",
            "NodeCIDR",
        ])
        .expect("parse");
        let Command::Run(run) = cli.command else {
            panic!("not run")
        };
        let cidrs: Vec<String> = run.cluster_cidr.iter().map(ToString::to_string).collect();
        assert_eq!(cidrs, ["10.244.0.0/16", "100.64.0.0/10"]);
        assert_eq!(run.detect_local_mode, DetectLocalMode::NodeCidr);
        assert!(
            Cli::try_parse_from(["kube-proxy-ebpf", "run", "--cluster-cidr", "10.244.0.0"])
                .is_err()
        );
    }
}
