//! How big the flow maps are: `CONNTRACK_V1` and `SNAT_V1` from kube-proxy's
//! `conntrack.maxPerCore` × CPUs with `conntrack.min` as the floor, like netfilter's
//! `nf_conntrack_max`.
//!
//! netfilter counts connections (one conntrack holds both directions); here a flow takes two
//! `CONNTRACK_V1` entries (ORIGINAL and REPLY) and, if SNATed, two `SNAT_V1` entries (out and
//! in). So maxPerCore counts flows, as upstream's does, and each map gets two entries per flow:
//! with upstream's defaults (32768 per core, min 131072) a node of up to 4 CPUs tracks 131072
//! flows in 262144 entries of each map, as many connections as netfilter would.
//!
//! Precedence, first match wins: `--map-entries-conntrack` / `--map-entries-snat` (or
//! `KPE_MAP_CONNTRACK` / `KPE_MAP_SNAT`) give a map's entries exactly; otherwise
//! `--conntrack-max-per-core` / `--conntrack-min` given on the command line, then the config
//! file's `conntrack.maxPerCore` / `conntrack.min`, then upstream's defaults. `maxPerCore: 0`
//! (upstream: "leave the kernel's limit") means the built-in 131072 flows here, and ignores
//! `min` as upstream does. Sizes apply when a map is created: a restarted agent adopts its
//! pinned maps with the size they have (see [`crate::dataplane::occupancy`], which warns about it).
//!
//! `CONNTRACK6_V1` (IPv6 flows) is not derived from maxPerCore: the kernel preallocates an LRU
//! map whether or not the cluster has IPv6 Services, and an IPv6 entry (40-byte key, 64-byte
//! value) costs about twice an IPv4 one, so sizing it like `CONNTRACK_V1` (262144 entries with
//! upstream's defaults) would take ≈ 39 MB on every IPv4-only node. It keeps the compiled-in
//! 65536 entries (32768 flows) unless `--map-entries-conntrack6` (`KPE_MAP_CONNTRACK6`) says
//! otherwise. (netfilter's limit counts both families' connections together.)
//!
//! The other IPv6 maps are sized like their IPv4 twins, each by its flag with a 6:
//! `--map-entries-services6` / `-backends6` / `-revnat6` / `-snat6`, `--affinity-max-entries6`
//! (`AFFMATCH6_V1` follows `SERVICES6_V1`, as `AFFMATCH_V1` follows `SERVICES_V1`); without
//! them, the compiled-in sizes of `proxy_common::ipv6`.
//!
//! **IPv4-only nodes** ([`Ipv6Maps`], `--ipv6-maps`): the kernel preallocates every hash and
//! LRU map at creation (the IPv6 ones ≈ 32 MB at their default sizes), whether or not a packet
//! ever uses them. `BPF_F_NO_PREALLOC` is no way out: LRU maps cannot have it, and for the plain
//! hash maps it would change the maps' flags, so pinned maps of the current agents would be
//! replaced (their entries lost) on upgrade. Instead, on a node with no IPv6 (`auto`: no usable
//! IPv6 address at start, no IPv6 prefix configured, no IPv6 map size given) every IPv6 hash and
//! LRU map is created with [`MINIMAL_ENTRIES`] entry: the programs need the maps to exist, not
//! to be large, and the agent's IPv6 family does no work there. LPM tries (source ranges,
//! Service and cluster CIDRs) are never preallocated and keep their sizes. A node that gains
//! IPv6 later needs an agent restart to size them (the family logs it; frontends that do not fit
//! a one-entry map are reported as for any full map): at that start the one-entry pinned maps
//! are replaced by sized ones (`loader::load_pinned`), losing at most one entry each.

use proxy_common::{
    CONNTRACK_CAPACITY,
    ipv6::{
        AFFINITY6_CAPACITY, BACKENDS6_CAPACITY, CONNTRACK6_CAPACITY, FRAGMENTS6_CAPACITY,
        REVNAT6_CAPACITY, SERVICES6_CAPACITY, SNAT6_CAPACITY, SOCK_REVNAT6_CAPACITY,
    },
};

use crate::dataplane::loader::{MINIMAL_ENTRIES, MapSizes};

/// Upstream's `conntrack.maxPerCore` default.
pub const DEFAULT_MAX_PER_CORE: u32 = 32_768;
/// Upstream's `conntrack.min` default.
pub const DEFAULT_MIN: u32 = 131_072;
/// Flows when maxPerCore is 0 (the compiled-in conntrack size).
pub const BUILTIN_FLOWS: u32 = CONNTRACK_CAPACITY / ENTRIES_PER_FLOW;
/// Entries a flow takes in `CONNTRACK_V1` (ORIGINAL, REPLY) and, SNATed, in `SNAT_V1` (out, in).
pub const ENTRIES_PER_FLOW: u32 = 2;

/// Pure: the flows to track, upstream's `getConntrackMax`.
pub fn flows(max_per_core: u32, min: u32, cpus: u32) -> u32 {
    if max_per_core == 0 {
        return BUILTIN_FLOWS;
    }
    max_per_core.saturating_mul(cpus.max(1)).max(min)
}

/// `--ipv6-maps`: how the IPv6 maps are sized when created (see the module doc).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum Ipv6Maps {
    /// Sized when the node or the configuration has IPv6, one entry each otherwise.
    #[default]
    Auto,
    /// Always sized (a dual-stack node whose IPv6 address may come after the agent starts).
    Full,
    /// Always one entry each (the node never carries IPv6 Services).
    Minimal,
}

/// Pure: whether the IPv6 maps are sized (else [`MINIMAL_ENTRIES`] each).
pub fn ipv6_sized(mode: Ipv6Maps, configured: bool, node_has_ipv6: bool) -> bool {
    match mode {
        Ipv6Maps::Auto => configured || node_has_ipv6,
        Ipv6Maps::Full => true,
        Ipv6Maps::Minimal => false,
    }
}

/// Whether the node has a usable IPv6 address now (the IPv6 family's own rule:
/// `crate::family6`); a failed listing counts as yes (sized maps are the safe side).
pub fn node_has_ipv6() -> bool {
    use crate::dataplane::node_addrs::{self, NodeFamily as _};
    node_addrs::list6().map_or(true, |all| all.iter().any(|a| a.addr.usable()))
}

/// Where each flow map's size came from, for the start-up log.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Basis {
    /// `--map-entries-conntrack` / `--map-entries-snat`.
    Explicit,
    /// maxPerCore × CPUs (or the floor) flows, two entries each.
    Flows(u32),
}

/// The flow maps' sizes and where they came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FlowMaps {
    pub conntrack: u32,
    pub conntrack_basis: Basis,
    pub snat: u32,
    pub snat_basis: Basis,
    /// `CONNTRACK6_V1`: explicit, or the compiled-in size (see the module comment).
    pub conntrack6: u32,
}

/// What the merged settings (flags over the config file) ask of the maps' sizes; the flags
/// fill it (`cli::RunArgs::map_request`), so this module reads numbers, not arguments.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Requested {
    pub conntrack_max_per_core: u32,
    pub conntrack_min: u32,
    pub map_entries_conntrack: Option<u32>,
    pub map_entries_snat: Option<u32>,
    pub map_entries_conntrack6: Option<u32>,
    pub map_entries_services6: Option<u32>,
    pub map_entries_backends6: Option<u32>,
    pub map_entries_revnat6: Option<u32>,
    pub map_entries_snat6: Option<u32>,
    pub affinity_max_entries6: Option<u32>,
    pub ipv6_maps: Ipv6Maps,
    /// The configuration names IPv6 (`cli::RunArgs::ipv6_configured`).
    pub ipv6_configured: bool,
    pub map_entries_services: u32,
    pub map_entries_backends: u32,
    pub map_entries_revnat: u32,
    pub affinity_max_entries: u32,
}

/// Pure: the flow maps' sizes from the merged settings and the CPU count.
pub fn flow_maps(args: &Requested, cpus: u32) -> FlowMaps {
    let flows = flows(args.conntrack_max_per_core, args.conntrack_min, cpus);
    let derived = flows.saturating_mul(ENTRIES_PER_FLOW);
    let pick = |explicit: Option<u32>| match explicit {
        Some(n) => (n, Basis::Explicit),
        None => (derived, Basis::Flows(flows)),
    };
    let (conntrack, conntrack_basis) = pick(args.map_entries_conntrack);
    let (snat, snat_basis) = pick(args.map_entries_snat);
    FlowMaps {
        conntrack,
        conntrack_basis,
        snat,
        snat_basis,
        conntrack6: args.map_entries_conntrack6.unwrap_or(CONNTRACK6_CAPACITY),
    }
}

/// Pure: every map's size for a new agent; `node_has_ipv6` decides `--ipv6-maps auto`.
pub fn map_sizes(args: &Requested, cpus: u32, node_has_ipv6: bool) -> MapSizes {
    let f = flow_maps(args, cpus);
    let sized = ipv6_sized(args.ipv6_maps, args.ipv6_configured, node_has_ipv6);
    let v6 = |n: u32| if sized { n } else { MINIMAL_ENTRIES };
    MapSizes {
        services: args.map_entries_services,
        backends: args.map_entries_backends,
        rev_nats: args.map_entries_revnat,
        affinity: args.affinity_max_entries,
        conntrack: f.conntrack,
        snat: f.snat,
        conntrack6: v6(f.conntrack6),
        services6: v6(args.map_entries_services6.unwrap_or(SERVICES6_CAPACITY)),
        backends6: v6(args.map_entries_backends6.unwrap_or(BACKENDS6_CAPACITY)),
        rev_nats6: v6(args.map_entries_revnat6.unwrap_or(REVNAT6_CAPACITY)),
        snat6: v6(args.map_entries_snat6.unwrap_or(SNAT6_CAPACITY)),
        affinity6: v6(args.affinity_max_entries6.unwrap_or(AFFINITY6_CAPACITY)),
        sock_rev6: v6(SOCK_REVNAT6_CAPACITY),
        fragments6: v6(FRAGMENTS6_CAPACITY),
    }
}

/// The CPUs netfilter's table is scaled by: the machine's online CPUs (upstream reads the
/// topology from sysfs, not the process's affinity).
pub fn online_cpus() -> u32 {
    use nix::unistd::{SysconfVar, sysconf};
    sysconf(SysconfVar::_NPROCESSORS_ONLN)
        .ok()
        .flatten()
        .and_then(|n| u32::try_from(n).ok())
        .filter(|&n| n > 0)
        .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get() as u32))
}

#[cfg(test)]
mod tests {
    use clap::{CommandFactory as _, FromArgMatches as _};
    use proxy_common::SERVICES_CAPACITY;

    use super::*;
    use crate::cli::{Cli, Command, config};

    fn args(argv: &[&str], file: &str) -> Requested {
        let mut full = vec!["kube-proxy-ebpf", "run", "--manifests", "/m"];
        full.extend_from_slice(argv);
        let matches = Cli::command().try_get_matches_from(full).expect("flags");
        let explicit = config::explicit_args(matches.subcommand_matches("run").expect("run"));
        let Command::Run(mut args) = Cli::from_arg_matches(&matches).expect("cli").command else {
            panic!("not run")
        };
        let head = "apiVersion: kubeproxy.config.k8s.io/v1alpha1\nkind: KubeProxyConfiguration\n";
        let file = config::parse("c.yaml", &format!("{head}{file}")).expect("file");
        config::apply(&mut args, &file.config, &explicit).expect("apply");
        args.map_request()
    }

    #[test]
    fn flows_are_max_per_core_times_cpus_with_min_as_the_floor() {
        assert_eq!(
            flows(32_768, 131_072, 2),
            131_072,
            "the floor on a small node"
        );
        assert_eq!(flows(32_768, 131_072, 4), 131_072);
        assert_eq!(flows(32_768, 131_072, 8), 262_144, "scaled past the floor");
        assert_eq!(flows(1_000, 0, 3), 3_000, "no floor");
        assert_eq!(flows(1_000, 0, 0), 1_000, "at least one CPU");
        assert_eq!(
            flows(0, 1_000_000, 64),
            BUILTIN_FLOWS,
            "0: built-in, min ignored"
        );
        assert_eq!(flows(u32::MAX, 0, 64), u32::MAX, "saturates");
    }

    #[test]
    fn both_flow_maps_get_two_entries_per_flow() {
        let f = flow_maps(&args(&[], ""), 2);
        assert_eq!(
            (f.conntrack, f.snat),
            (262_144, 262_144),
            "upstream's defaults on 2 CPUs: 131072 flows"
        );
        assert_eq!(f.conntrack_basis, Basis::Flows(131_072));
        let f = flow_maps(&args(&[], ""), 16);
        assert_eq!(
            (f.conntrack, f.snat),
            (1_048_576, 1_048_576),
            "16 × 32768 flows"
        );
        assert_eq!(
            flow_maps(&args(&[], ""), 1).conntrack,
            CONNTRACK_CAPACITY,
            "the default equals the compiled-in size"
        );
    }

    #[test]
    fn explicit_map_sizes_win_then_flags_then_the_file() {
        let file = "conntrack:\n  maxPerCore: 1000\n  min: 500\n";
        let f = flow_maps(&args(&[], file), 2);
        assert_eq!(
            (f.conntrack, f.snat),
            (4_000, 4_000),
            "the file: 2 × 1000 flows"
        );
        let f = flow_maps(&args(&["--conntrack-max-per-core", "3000"], file), 2);
        assert_eq!(f.conntrack, 12_000, "the flag beats the file");
        let f = flow_maps(&args(&["--conntrack-min", "10000"], file), 2);
        assert_eq!(
            f.conntrack, 20_000,
            "the file's maxPerCore, the flag's floor"
        );
        let f = flow_maps(
            &args(
                &[
                    "--map-entries-conntrack",
                    "1024",
                    "--conntrack-max-per-core",
                    "3000",
                ],
                file,
            ),
            2,
        );
        assert_eq!(
            (f.conntrack, f.conntrack_basis, f.snat, f.snat_basis),
            (1_024, Basis::Explicit, 12_000, Basis::Flows(6_000)),
            "an explicit map size wins for its map only"
        );
        let f = flow_maps(&args(&["--map-entries-snat", "2048"], ""), 2);
        assert_eq!((f.conntrack, f.snat), (262_144, 2_048));
        let f = flow_maps(&args(&[], "conntrack:\n  maxPerCore: 0\n"), 64);
        assert_eq!(f.conntrack, CONNTRACK_CAPACITY, "maxPerCore 0: built-in");
        let sizes = map_sizes(&args(&["--map-entries-conntrack", "1024"], ""), 2, true);
        assert_eq!((sizes.conntrack, sizes.snat), (1_024, 262_144));
        assert_eq!(sizes.services, SERVICES_CAPACITY);
    }

    #[test]
    fn the_ipv6_conntrack_keeps_its_compiled_in_size_unless_given() {
        let f = flow_maps(&args(&["--conntrack-max-per-core", "100000"], ""), 16);
        assert_eq!(
            f.conntrack6, CONNTRACK6_CAPACITY,
            "not scaled with the IPv4 flows"
        );
        let sizes = map_sizes(&args(&["--map-entries-conntrack6", "300000"], ""), 2, false);
        assert_eq!((sizes.conntrack6, sizes.conntrack), (300_000, 262_144));
        assert_eq!(
            map_sizes(&args(&[], ""), 2, true).conntrack6,
            crate::dataplane::loader::MapSizes::default().conntrack6
        );
    }

    #[test]
    fn ipv6_maps_take_their_flags_and_shrink_to_one_entry_on_a_node_without_ipv6() {
        let flags = [
            "--map-entries-services6",
            "400000",
            "--map-entries-backends6",
            "300000",
            "--map-entries-revnat6",
            "50000",
            "--map-entries-snat6",
            "70000",
            "--affinity-max-entries6",
            "9000",
        ];
        let s = map_sizes(&args(&flags, ""), 2, false);
        assert_eq!(
            (s.services6, s.backends6, s.rev_nats6, s.snat6, s.affinity6),
            (400_000, 300_000, 50_000, 70_000, 9_000),
            "given sizes apply (and count as IPv6 configured, even without an IPv6 address)"
        );
        assert_eq!(
            (s.conntrack6, s.sock_rev6, s.fragments6),
            (
                CONNTRACK6_CAPACITY,
                SOCK_REVNAT6_CAPACITY,
                FRAGMENTS6_CAPACITY
            )
        );
        assert_eq!(
            (s.services, s.backends),
            (SERVICES_CAPACITY, proxy_common::BACKENDS_CAPACITY),
            "the IPv4 maps keep theirs"
        );
        let with_v6 = map_sizes(&args(&[], ""), 2, true);
        assert_eq!(
            (with_v6.services6, with_v6.backends6, with_v6.rev_nats6),
            (SERVICES6_CAPACITY, BACKENDS6_CAPACITY, REVNAT6_CAPACITY),
            "a node with IPv6: the compiled-in sizes"
        );
        let v4_only = map_sizes(&args(&[], ""), 2, false);
        let six = [
            v4_only.services6,
            v4_only.backends6,
            v4_only.rev_nats6,
            v4_only.conntrack6,
            v4_only.snat6,
            v4_only.affinity6,
            v4_only.sock_rev6,
            v4_only.fragments6,
        ];
        assert_eq!(six, [MINIMAL_ENTRIES; 8], "an IPv4-only node: {v4_only:?}");
        assert_eq!(
            (v4_only.services, v4_only.conntrack),
            (with_v6.services, with_v6.conntrack)
        );
        for (argv, file) in [
            (
                &["--cluster-cidr", "10.244.0.0/16,fd00:10:244::/56"][..],
                "",
            ),
            (&["--service-cidr", "fd00:96::/112"][..], ""),
            (&["--nodeport-addresses", "fd00:50::/64"][..], ""),
            (&["--ipv6-maps", "full"][..], ""),
            (&[][..], "clusterCIDR: 10.244.0.0/16,fd00:10:244::/56\n"),
        ] {
            assert_eq!(
                map_sizes(&args(argv, file), 2, false).services6,
                SERVICES6_CAPACITY,
                "{argv:?} {file:?}: sized without an IPv6 address"
            );
        }
        for argv in [
            &["--cluster-cidr", "10.244.0.0/16"][..],
            &["--nodeport-addresses", "192.168.0.0/16"][..],
            &["--nodeport-addresses", "primary"][..],
        ] {
            assert_eq!(
                map_sizes(&args(argv, ""), 2, false).services6,
                MINIMAL_ENTRIES,
                "{argv:?}: IPv4 only"
            );
        }
        let minimal = map_sizes(&args(&["--ipv6-maps", "minimal"], ""), 2, true);
        assert_eq!(
            (minimal.services6, minimal.conntrack6),
            (MINIMAL_ENTRIES, MINIMAL_ENTRIES),
            "minimal whatever the node"
        );
    }

    #[test]
    fn online_cpus_is_at_least_one() {
        assert!(online_cpus() >= 1);
    }
}
