//! The one ABI between the eBPF datapath (`proxy-ebpf`) and the agent (`proxy-userspace`).
//!
//! Rules (see STYLE.md): every map key/value is `#[repr(C)]`, `Copy`, made of integers and byte
//! arrays only, with explicit padding and a size assert. Addresses and ports are network-order
//! byte arrays; only the agent's map layer converts them from `Ipv4Addr`/`u16`. Pure functions
//! used by both sides (flow hash, backend pick, checksums, idle timeouts) live here so the host
//! can test them.
#![cfg_attr(not(test), no_std)]

pub mod csum;
pub mod hash;
pub mod maps;
pub mod stats;
pub mod timeouts;

pub use maps::*;
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
}

/// Program names (the `#[classifier]` function names in proxy-ebpf).
pub const PROG_TC_INGRESS: &str = "tc_ingress";
pub const PROG_TC_EGRESS: &str = "tc_egress";
/// The cgroup socket hooks (`#[cgroup_sock_addr]` function names) that translate Services for
/// sockets of the node's own network namespace.
pub const PROG_SOCK_CONNECT4: &str = "sock_connect4";
pub const PROG_SOCK_SENDMSG4: &str = "sock_sendmsg4";
pub const PROG_SOCK_RECVMSG4: &str = "sock_recvmsg4";
pub const PROG_SOCK_GETPEERNAME4: &str = "sock_getpeername4";

/// Load-time facts for the cgroup socket hooks (a global, like [`DatapathConfig`]).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
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
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DatapathConfig {
    /// Idle timeout of an established TCP flow, seconds.
    pub tcp_established_timeout_s: u32,
    /// Idle timeout of a TCP flow that is opening or closing (SYN seen, FIN/RST seen), seconds.
    pub tcp_transitory_timeout_s: u32,
    /// Idle timeout of a UDP flow, seconds.
    pub udp_timeout_s: u32,
    /// Feature switches, `config_flags::*`.
    pub flags: u32,
}
const _: () = assert!(core::mem::size_of::<DatapathConfig>() == 16);

/// Name of the global holding [`DatapathConfig`] in the eBPF object.
pub const CONFIG_GLOBAL: &str = "CONFIG";

impl DatapathConfig {
    /// Defaults: TCP established 24 h (kube-proxy's `conntrack.tcpEstablishedTimeout`), TCP
    /// opening/closing 2 min, UDP 2 min (the kernel's assured-stream UDP timeout).
    pub const DEFAULT: Self = Self {
        tcp_established_timeout_s: 86_400,
        tcp_transitory_timeout_s: 120,
        udp_timeout_s: 120,
        flags: 0,
    };
}

impl Default for DatapathConfig {
    fn default() -> Self {
        Self::DEFAULT
    }
}

#[cfg(feature = "user")]
mod pod {
    // SAFETY: every type below is #[repr(C)], Copy, built only from integers and byte arrays with
    // explicit padding (size asserts next to each definition), so any bit pattern is valid.
    unsafe impl aya::Pod for crate::ServiceKey {}
    unsafe impl aya::Pod for crate::ServiceValue {}
    unsafe impl aya::Pod for crate::Backend {}
    unsafe impl aya::Pod for crate::RevNat {}
    unsafe impl aya::Pod for crate::CtKey {}
    unsafe impl aya::Pod for crate::CtValue {}
    unsafe impl aya::Pod for crate::DatapathConfig {}
    unsafe impl aya::Pod for crate::SnatValue {}
    unsafe impl aya::Pod for crate::NodeInfo {}
    unsafe impl aya::Pod for crate::SourceRangeKey {}
    unsafe impl aya::Pod for crate::SockRevKey {}
    unsafe impl aya::Pod for crate::SockLbConfig {}
}
