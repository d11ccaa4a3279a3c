//! The one ABI between the eBPF datapath (`proxy-ebpf`) and the agent (`proxy-userspace`).
//!
//! Rules: every map key/value is `#[repr(C)]`, `Copy`, made of integers and byte
//! arrays only, with explicit padding and a size assert, and derives `bytemuck::Pod`/`Zeroable`
//! (whose derive rejects implicit padding at compile time). Addresses and ports are network-order
//! byte arrays; only the agent's map layer converts them from `Ipv4Addr`/`u16`. Pure functions
//! used by both sides (flow hash, backend pick, checksums, idle timeouts) live here so the host
//! can test them.
//!
//! A key with hidden padding does not compile (here: 3 bytes after `proto`):
//! ```compile_fail,E0080
//! #[repr(C)]
//! #[derive(Clone, Copy, bytemuck::Pod, bytemuck::Zeroable)]
//! struct Key {
//!     addr: u32,
//!     proto: u8,
//! }
//! ```
//! while the same key with its padding spelled out does:
//! ```
//! #[repr(C)]
//! #[derive(Clone, Copy, bytemuck::Pod, bytemuck::Zeroable)]
//! struct Key {
//!     addr: u32,
//!     proto: u8,
//!     _pad: [u8; 3],
//! }
//! ```
#![cfg_attr(not(test), no_std)]

pub mod bpf_log;
pub mod crc32c;
pub mod csum;
pub mod flow_state;
pub mod hash;
pub mod ipv6;
pub mod lc;
pub mod maglev;
pub mod maps;
pub mod presence;
pub mod ratelimit;
pub mod sched;
pub mod stats;
pub mod timeouts;

use bytemuck::{Pod, Zeroable};
pub use maps::*;
pub use sched::Scheduler;
pub use stats::{COUNTER_COUNT, Counter};

/// Version of the map layout. It is part of every map name, so an agent with another layout never
/// adopts maps it cannot read; bump it whenever a key or value changes shape.
pub const LAYOUT_VERSION: u32 = 1;

/// Where the maps and links are pinned by default (a directory on bpffs).
pub const DEFAULT_PIN_DIR: &str = "/sys/fs/bpf/kube-proxy-ebpf";

/// IP protocol numbers as carried in keys.
pub mod proto {
    pub const ICMP: u8 = 1;
    pub const TCP: u8 = 6;
    pub const UDP: u8 = 17;
    pub const SCTP: u8 = 132;
}

/// Does a flow of `proto` SNATed on the node's address share the port space with the node's
/// sockets (`SNAT_NODE_PORT_MIN`: TCP and UDP, whose sockets the datapath can look up)?
#[inline(always)]
pub const fn shares_node_ports(p: u8) -> bool {
    p == proto::TCP || p == proto::UDP
}

/// Program names (the `#[classifier]` function names in proxy-ebpf).
pub const PROG_TC_INGRESS: &str = "tc_ingress";
pub const PROG_TC_EGRESS: &str = "tc_egress";
/// The same programs for L3 devices (ipip/tunl0, gre, WireGuard): their packets start at the
/// IPv4 header (no Ethernet header). Attached to L3 tunnel devices instead of the two above.
pub const PROG_TC_INGRESS_L3: &str = "tc_ingress_l3";
pub const PROG_TC_EGRESS_L3: &str = "tc_egress_l3";
/// The new-flow half of tc ingress, tail-called from `tc_ingress` (a program of its own so each
/// half has the whole 512-byte BPF stack). Never attached.
pub const PROG_TC_INGRESS_NEW: &str = "tc_ingress_new";
/// Name of the program array holding the tail-called parts of ingress. Pinned like the other
/// maps: the kernel empties a program array when its last user-space reference goes, which would
/// stop new flows once the agent exits; a restarted agent writes its own programs into it.
pub const MAP_TAIL_CALLS: &str = "TAILCALLS_V1";
/// Index of `PROG_TC_INGRESS_NEW` in `MAP_TAIL_CALLS`.
pub const TAIL_CALL_NEW_FLOW: u32 = 0;
/// The direct-flow part of ingress (a packet to no Service), tail-called from the new-flow
/// program. Never attached.
pub const PROG_TC_INGRESS_DIRECT: &str = "tc_ingress_direct";
/// Index of `PROG_TC_INGRESS_DIRECT` in `MAP_TAIL_CALLS`.
pub const TAIL_CALL_DIRECT_FLOW: u32 = 1;
/// The reject part of ingress (ICMP port unreachable for a Service without endpoints),
/// tail-called from the new-flow program. Never attached.
pub const PROG_TC_INGRESS_REJECT: &str = "tc_ingress_reject";
/// Index of `PROG_TC_INGRESS_REJECT` in `MAP_TAIL_CALLS`.
pub const TAIL_CALL_REJECT: u32 = 2;
/// The L3-device variants of the three tail-called programs (`tc_ingress_l3` jumps to them)
/// sit at `TAIL_CALL_L3 + ` the index of their Ethernet counterpart.
pub const PROG_TC_INGRESS_NEW_L3: &str = "tc_ingress_new_l3";
pub const PROG_TC_INGRESS_DIRECT_L3: &str = "tc_ingress_direct_l3";
pub const PROG_TC_INGRESS_REJECT_L3: &str = "tc_ingress_reject_l3";
/// Offset of the L3-device tail-called programs in `MAP_TAIL_CALLS`.
pub const TAIL_CALL_L3: u32 = 3;
/// The IPv6 datapath (`proxy-ebpf`'s `ipv6` module): `tc_ingress`/`tc_egress` (and their L3
/// variants) tail-call these for an IPv6 packet, so the IPv4 programs keep their code and stack,
/// and IPv4 packets never pay for IPv6. Never attached. Without them (program array not filled)
/// IPv6 packets pass untouched.
pub const PROG_TC_INGRESS6: &str = "tc_ingress6";
pub const PROG_TC_EGRESS6: &str = "tc_egress6";
pub const PROG_TC_INGRESS6_L3: &str = "tc_ingress6_l3";
pub const PROG_TC_EGRESS6_L3: &str = "tc_egress6_l3";
/// The IPv6 reject program (ICMPv6 port unreachable, TCP RST), tail-called by `tc_ingress6`.
pub const PROG_TC_INGRESS6_REJECT: &str = "tc_ingress6_reject";
pub const PROG_TC_INGRESS6_REJECT_L3: &str = "tc_ingress6_reject_l3";
/// The IPv6 new-flow program (service lookup, pick, conntrack entries), tail-called by
/// `tc_ingress6` when a packet has no usable conntrack entry: each half has its own stack.
pub const PROG_TC_INGRESS6_NEW: &str = "tc_ingress6_new";
pub const PROG_TC_INGRESS6_NEW_L3: &str = "tc_ingress6_new_l3";
/// The IPv6 egress SNAT program (a forwarded external flow's source to the node), tail-called
/// by `tc_egress6` for a packet with a `SNAT6_V1` out entry: its own stack.
pub const PROG_TC_EGRESS6_SNAT: &str = "tc_egress6_snat";
pub const PROG_TC_EGRESS6_SNAT_L3: &str = "tc_egress6_snat_l3";
/// The IPv6 ingress SNAT program (the node port of a new flow that needs SNAT), tail-called by
/// `tc_ingress6_new` after DNAT: its own stack.
pub const PROG_TC_INGRESS6_SNAT: &str = "tc_ingress6_snat";
pub const PROG_TC_INGRESS6_SNAT_L3: &str = "tc_ingress6_snat_l3";
/// Indices of the IPv6 programs in `MAP_TAIL_CALLS` (the L3 variants at `+ TAIL_CALL6_L3`).
pub const TAIL_CALL_INGRESS6: u32 = 6;
pub const TAIL_CALL_EGRESS6: u32 = 7;
pub const TAIL_CALL_REJECT6: u32 = 8;
pub const TAIL_CALL_NEW6: u32 = 9;
pub const TAIL_CALL_SNAT6: u32 = 10;
pub const TAIL_CALL_SNAT6_NEW: u32 = 11;
pub const TAIL_CALL6_L3: u32 = 6;
/// Entries of `MAP_TAIL_CALLS`.
pub const TAIL_CALL_COUNT: u32 = 18;
/// The tail-called programs with their `MAP_TAIL_CALLS` index.
pub const TAIL_CALLS: [(&str, u32); 18] = [
    (PROG_TC_INGRESS6, TAIL_CALL_INGRESS6),
    (PROG_TC_EGRESS6, TAIL_CALL_EGRESS6),
    (PROG_TC_INGRESS6_REJECT, TAIL_CALL_REJECT6),
    (PROG_TC_INGRESS6_NEW, TAIL_CALL_NEW6),
    (PROG_TC_EGRESS6_SNAT, TAIL_CALL_SNAT6),
    (PROG_TC_INGRESS6_SNAT, TAIL_CALL_SNAT6_NEW),
    (PROG_TC_INGRESS6_L3, TAIL_CALL6_L3 + TAIL_CALL_INGRESS6),
    (PROG_TC_EGRESS6_L3, TAIL_CALL6_L3 + TAIL_CALL_EGRESS6),
    (
        PROG_TC_INGRESS6_REJECT_L3,
        TAIL_CALL6_L3 + TAIL_CALL_REJECT6,
    ),
    (PROG_TC_INGRESS6_NEW_L3, TAIL_CALL6_L3 + TAIL_CALL_NEW6),
    (PROG_TC_EGRESS6_SNAT_L3, TAIL_CALL6_L3 + TAIL_CALL_SNAT6),
    (
        PROG_TC_INGRESS6_SNAT_L3,
        TAIL_CALL6_L3 + TAIL_CALL_SNAT6_NEW,
    ),
    (PROG_TC_INGRESS_NEW, TAIL_CALL_NEW_FLOW),
    (PROG_TC_INGRESS_DIRECT, TAIL_CALL_DIRECT_FLOW),
    (PROG_TC_INGRESS_REJECT, TAIL_CALL_REJECT),
    (PROG_TC_INGRESS_NEW_L3, TAIL_CALL_L3 + TAIL_CALL_NEW_FLOW),
    (
        PROG_TC_INGRESS_DIRECT_L3,
        TAIL_CALL_L3 + TAIL_CALL_DIRECT_FLOW,
    ),
    (PROG_TC_INGRESS_REJECT_L3, TAIL_CALL_L3 + TAIL_CALL_REJECT),
];
/// The cgroup socket hooks (`#[cgroup_sock_addr]` function names) that translate Services for
/// sockets of the node's own network namespace.
pub const PROG_SOCK_CONNECT4: &str = "sock_connect4";
pub const PROG_SOCK_SENDMSG4: &str = "sock_sendmsg4";
pub const PROG_SOCK_RECVMSG4: &str = "sock_recvmsg4";
pub const PROG_SOCK_GETPEERNAME4: &str = "sock_getpeername4";
/// The IPv6 socket hooks (IPv6 Services, and IPv4 ones through v4-mapped addresses).
pub const PROG_SOCK_CONNECT6: &str = "sock_connect6";
pub const PROG_SOCK_SENDMSG6: &str = "sock_sendmsg6";
pub const PROG_SOCK_RECVMSG6: &str = "sock_recvmsg6";
pub const PROG_SOCK_GETPEERNAME6: &str = "sock_getpeername6";
/// The bind hooks: another Service proxy binding its port while no agent runs hands the datapath
/// over (`presence`).
pub const PROG_SOCK_BIND4: &str = "sock_bind4";
pub const PROG_SOCK_BIND6: &str = "sock_bind6";
/// Test-only classifier: counts the TCP/UDP packets it sees by 5-tuple (`TAP_V1`) and hands them
/// on (TCX_NEXT). The agent never loads or attaches it; the chaining tests attach it before and
/// after the agent's programs to show that both see every packet.
pub const PROG_TC_TAP: &str = "tc_tap";

/// Load-time facts for the cgroup socket hooks (a global, like [`DatapathConfig`]).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default, Pod, Zeroable)]
pub struct SockLbConfig {
    /// Network namespace cookie (`SO_NETNS_COOKIE`) of the node's namespace: sockets of any other
    /// namespace (pods, whose traffic tc translates) are left alone. 0 = translate nothing.
    pub netns_cookie: u64,
}
const _: () = assert!(core::mem::size_of::<SockLbConfig>() == 8);

/// Name of the global holding [`SockLbConfig`] in the eBPF object.
pub const SOCK_LB_GLOBAL: &str = "SOCK_LB";

/// The datapath's load-time configuration: a global (`.rodata`) set by the agent with
/// `EbpfLoader::set_global(CONFIG_GLOBAL, ...)`, so the packet path reads it without a map lookup.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Pod, Zeroable)]
pub struct DatapathConfig {
    /// Idle timeout of an established TCP flow, seconds.
    pub tcp_established_timeout_s: u32,
    /// Idle timeout of a TCP flow that is opening (SYN seen) or closed (FIN from both sides, or
    /// RST), seconds.
    pub tcp_transitory_timeout_s: u32,
    /// Idle timeout of a UDP flow the backend has not answered yet (netfilter's `udpTimeout`:
    /// one-shot datagrams), seconds.
    pub udp_timeout_s: u32,
    /// Feature switches, `config_flags::*`.
    pub flags: u32,
    /// Sources that are "in the cluster" (kube-proxy's detectLocalMode ClusterCIDR): they reach
    /// an externalTrafficPolicy Local frontend through its `SCOPE_INTERNAL` entry.
    pub cluster_cidrs: ClusterCidrs,
    /// Idle timeout of a UDP flow once the backend has answered (netfilter's
    /// `udpStreamTimeout`), seconds; `udp_timeout_s` applies before that.
    pub udp_stream_timeout_s: u32,
    /// Seed of the flow hash: random per node (set at load), so no outsider can steer flows.
    pub hash_seed: u32,
    /// Idle timeout of a half-closed TCP flow (a FIN from one side only: the other may still
    /// send), seconds: kube-proxy's `tcpCloseWaitTimeout`.
    pub tcp_close_wait_timeout_s: u32,
    /// Entries of every Maglev table (`maglev::TABLE_SIZES`, `--maglev-table-size`): the agent
    /// builds the tables with it, the datapath places flows in them with it. Changing it at a
    /// restart rebuilds every table.
    pub maglev_table_size: u32,
}
const _: () = assert!(core::mem::size_of::<DatapathConfig>() == 68);

/// Most cluster CIDRs the datapath checks (kube-proxy takes one per IP family; IPv4 only here).
pub const MAX_CLUSTER_CIDRS: usize = 4;

/// An IPv4 prefix as the datapath matches it: network-order address (host bits clear) and mask.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default, Pod, Zeroable)]
pub struct Ipv4Prefix {
    pub addr: [u8; 4],
    pub mask: [u8; 4],
}
const _: () = assert!(core::mem::size_of::<Ipv4Prefix>() == 8);

impl Ipv4Prefix {
    /// Is `addr` (network order) inside the prefix?
    #[inline(always)]
    pub fn contains(&self, addr: [u8; 4]) -> bool {
        // Byte-wise AND and compare: the same in either byte order, so no swap is needed.
        u32::from_ne_bytes(addr) & u32::from_ne_bytes(self.mask) == u32::from_ne_bytes(self.addr)
    }
}

/// The configured cluster CIDRs; `count == 0` means no source is detected as in-cluster (also
/// kube-proxy's behaviour for detectLocalMode ClusterCIDR without a clusterCIDR).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default, Pod, Zeroable)]
pub struct ClusterCidrs {
    /// How many of `prefixes` are set (at most `MAX_CLUSTER_CIDRS`).
    pub count: u32,
    pub prefixes: [Ipv4Prefix; MAX_CLUSTER_CIDRS],
}
const _: () = assert!(core::mem::size_of::<ClusterCidrs>() == 36);

impl ClusterCidrs {
    /// No cluster CIDR: nothing is in-cluster.
    pub const NONE: Self = Self {
        count: 0,
        prefixes: [Ipv4Prefix {
            addr: [0; 4],
            mask: [0; 4],
        }; MAX_CLUSTER_CIDRS],
    };

    /// Is `addr` (network order) inside one of the prefixes? Bounded by `MAX_CLUSTER_CIDRS`.
    #[inline(always)]
    pub fn contains(&self, addr: [u8; 4]) -> bool {
        self.prefixes
            .iter()
            .take(self.count as usize)
            .any(|p| p.contains(addr))
    }
}

/// Name of the global holding [`DatapathConfig`] in the eBPF object.
pub const CONFIG_GLOBAL: &str = "CONFIG";

impl DatapathConfig {
    /// Defaults, kube-proxy's (`KubeProxyConfiguration.conntrack`) where it sets one, else the
    /// kernel's: TCP established 24 h, half-closed 1 h (`tcpCloseWaitTimeout`), opening/closed
    /// 2 min (netfilter's SYN_SENT and TIME_WAIT); UDP 30 s until the backend answers, 2 min
    /// after (the kernel's `nf_conntrack_udp_timeout` / `_stream`, which kube-proxy leaves).
    pub const DEFAULT: Self = Self {
        tcp_established_timeout_s: 86_400,
        tcp_transitory_timeout_s: 120,
        udp_timeout_s: 30,
        flags: 0,
        cluster_cidrs: ClusterCidrs::NONE,
        udp_stream_timeout_s: 120,
        hash_seed: 0,
        tcp_close_wait_timeout_s: 3_600,
        maglev_table_size: maglev::DEFAULT_TABLE_SIZE,
    };
}

impl Default for DatapathConfig {
    fn default() -> Self {
        Self::DEFAULT
    }
}

/// `aya::Pod` for the map keys/values, for the agent's side. Each type must be `bytemuck::Pod`
/// (derived, so its layout has no implicit padding and every field is plain data), which this
/// macro checks at compile time before it implements the aya marker.
#[cfg(feature = "user")]
mod pod {
    macro_rules! aya_pod {
        ($($t:ty),+ $(,)?) => {$(
            const _: () = {
                const fn is_bytemuck_pod<T: bytemuck::Pod>() {}
                is_bytemuck_pod::<$t>();
            };
            // SAFETY: aya::Pod asks for a `Copy` type that may be read from and written to as
            // plain bytes (any bit pattern valid, no padding or pointers): `bytemuck::Pod`, checked
            // just above, proves exactly that (its derive rejects padding and non-Pod fields).
            unsafe impl aya::Pod for $t {}
        )+};
    }

    aya_pod!(
        crate::ServiceKey,
        crate::ServiceValue,
        crate::Backend,
        crate::RevNat,
        crate::CtKey,
        crate::CtValue,
        crate::DatapathConfig,
        crate::SnatValue,
        crate::NodeInfo,
        crate::presence::AgentPresence,
        crate::SnatDevice,
        crate::AffinityKey,
        crate::AffinityValue,
        crate::AffinityMatchKey,
        crate::SourceRangeKey,
        crate::SockRevKey,
        crate::SockPickKey,
        crate::SockPickValue,
        crate::SockLbConfig,
        crate::FragKey,
        crate::FragValue,
        crate::TapKey,
        crate::RejectBucket,
        crate::maglev::MaglevKey,
        crate::ipv6::Service6Key,
        crate::ipv6::Backend6,
        crate::ipv6::RevNat6,
        crate::ipv6::Ct6Key,
        crate::ipv6::Ct6Value,
        crate::ipv6::Frag6Key,
        crate::ipv6::Frag6Value,
        crate::ipv6::SourceRange6Key,
        crate::ipv6::Affinity6Key,
        crate::ipv6::Affinity6MatchKey,
        crate::ipv6::SockRev6Key,
        crate::ipv6::Snat6Value,
        crate::ipv6::Node6Info,
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    fn prefix(addr: [u8; 4], len: u32) -> Ipv4Prefix {
        let mask = u32::MAX.checked_shl(32 - len).unwrap_or(0).to_be_bytes();
        Ipv4Prefix { addr, mask }
    }

    #[test]
    fn not_serving_backends_keep_tcp_and_sctp_flows_only() {
        use backend_flags::{LOCAL, NOT_SERVING, TERMINATING, keeps_flow};
        for p in [proto::TCP, proto::UDP, proto::SCTP] {
            assert!(keeps_flow(0, p));
            assert!(keeps_flow(TERMINATING | LOCAL, p));
        }
        assert!(keeps_flow(NOT_SERVING, proto::TCP));
        assert!(keeps_flow(NOT_SERVING | TERMINATING, proto::SCTP));
        assert!(!keeps_flow(NOT_SERVING, proto::UDP));
        assert!(!keeps_flow(NOT_SERVING | LOCAL, proto::UDP));
    }

    #[test]
    fn cluster_cidrs_match_sources_inside_their_prefixes_only() {
        let mut c = ClusterCidrs::NONE;
        assert!(
            !c.contains([10, 244, 1, 5]),
            "no CIDR: nothing is in-cluster"
        );
        c.prefixes[0] = prefix([10, 244, 0, 0], 16);
        c.prefixes[1] = prefix([100, 64, 8, 0], 22);
        assert!(!c.contains([10, 244, 1, 5]), "count 0 ignores set prefixes");
        c.count = 2;
        for (addr, inside) in [
            ([10, 244, 1, 5], true),
            ([10, 244, 255, 255], true),
            ([10, 245, 0, 1], false),
            ([100, 64, 11, 200], true),
            ([100, 64, 12, 1], false),
            ([192, 168, 50, 100], false),
        ] {
            assert_eq!(c.contains(addr), inside, "{addr:?}");
        }
        c.prefixes[2] = prefix([0, 0, 0, 0], 0);
        c.count = 3;
        assert!(c.contains([192, 168, 50, 100]), "/0 matches everything");
        c.count = u32::MAX;
        assert!(
            c.contains([8, 8, 8, 8]),
            "a count above the array is bounded, not a panic"
        );
    }
}
