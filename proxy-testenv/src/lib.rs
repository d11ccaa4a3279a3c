//! Test environments for kube-proxy-ebpf's privileged tests and `cargo xtask demo`.
//!
//! Everything here is an RAII guard: network namespaces ([`NetNs`]), child processes ([`Proc`]),
//! bpffs pin directories ([`PinDir`]), temporary directories ([`TempDir`]), cgroups for the
//! socket hooks ([`Cgroup`]), the one-node [`Topology`] and the [`Agent`]. `Drop` cleans up even when a test panics.
//!
//! Network safety: every namespace is created here with a unique prefix; the "node" is a
//! namespace too; nothing is created or attached in the root network namespace and no namespace
//! gets a route out of the machine (pods route to the node namespace, which has no default route).
//!
//! Dual stack: every pod, node and the external client also has an IPv6 address inside
//! fd00::/8 ([`ipv6_of`] its IPv4 one), routed like the IPv4 ones; the helpers have IPv6
//! variants (`udp6_*`, `tcp6_*`, [`http6_get_with_peer`], [`http_url`] for curl).

// `unsafe` only where std itself requires it (`cgroup`: `Command::pre_exec`).
#![deny(unsafe_code)]

mod agent;
mod bpffs;
#[allow(unsafe_code)]
mod cgroup;
pub mod fake_apiserver;
pub mod kube_proxy;
mod manifests;
mod multinode;
mod netns;
pub mod prev_release;
mod process;
mod stream;
mod tempdir;
mod topology;

use std::sync::atomic::{AtomicUsize, Ordering};

pub use agent::{Agent, AgentStatus, cli};
pub use bpffs::{BPFFS_ROOT, PinDir, ensure_bpffs, is_bpffs_mounted};
pub use cgroup::{Cgroup, InCgroup, SocketView, http_get_with_peer, http6_get_with_peer};
pub use fake_apiserver::FakeApiServer;
pub use manifests::{
    FamilyService, ManifestDir, Protocol, ServicePort, family_service_yaml, service_yaml,
};
pub use multinode::{
    CLUSTER_CIDR, CLUSTER_CIDR_DUAL, CLUSTER_CIDR6, EXT_CLIENT_IP, EXT_CLIENT_IP6, EXT_DEVICE,
    HttpReply, L3_TUNNEL_DEVICE, L3_TUNNEL_IPS, MultiNode, NODE_IPS, NODE_IPS6, NODE_NAMES,
    POD_CIDRS, POD_CIDRS6, SERVICE_CIDR6, VXLAN_DEVICE, VXLAN_IPS,
};
pub use netns::NetNs;
pub use process::{Proc, run_with_timeout};
pub use stream::{ByteStream, PINGER_PERIOD, PingReply, StreamSummary, UdpPinger};
pub use tempdir::TempDir;
pub use topology::{
    BACKENDS, BACKENDS6, CLIENT_IP, CLIENT_IP6, ConnectOutcome, CurlReply, Exec, GATEWAY, GATEWAY6,
    HTTP_PORT, IPERF_PORT, IperfRun, IperfSummary, NODE_LOCAL_IP6, Pod, Topology, UDP_PORT,
    UdpReply, UdpReply6, Uplink, http_status, http_url, ipv6_of, tcp_connect_from,
    tcp6_connect_from, udp_request_from, udp6_request_from,
};

/// The capability number (linux/capability.h) of a name the manifests use (`NET_ADMIN`, ...).
pub fn capability_bit(name: &str) -> u32 {
    match name {
        "NET_ADMIN" => 12,
        "PERFMON" => 38,
        "BPF" => 39,
        other => panic!("capability {other} is not one the tests know (add its number)"),
    }
}

/// Environment variable that `cargo xtask test` sets to run the privileged test targets.
pub const PRIVILEGED_ENV: &str = "KPE_PRIVILEGED";

/// True when privileged tests should run (`KPE_PRIVILEGED=1`, set by `cargo xtask test`).
pub fn privileged() -> bool {
    std::env::var_os(PRIVILEGED_ENV).is_some_and(|v| v == "1")
}

/// Returns early from a privileged test unless `KPE_PRIVILEGED=1`, printing why it skipped.
#[macro_export]
macro_rules! require_privileged {
    () => {
        if !$crate::privileged() {
            eprintln!(
                "skipped: privileged test; run `sudo cargo xtask test` (sets {}=1)",
                $crate::PRIVILEGED_ENV
            );
            return;
        }
    };
}

/// A name prefix unique to this process and call: `kpe<pid%10000>-<n>`.
pub fn unique_prefix() -> String {
    static NEXT: AtomicUsize = AtomicUsize::new(0);
    let n = NEXT.fetch_add(1, Ordering::Relaxed);
    format!("kpe{}-{n}", std::process::id() % 10_000)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prefixes_are_unique_and_short() {
        let a = unique_prefix();
        let b = unique_prefix();
        assert_ne!(a, b);
        assert!(a.starts_with("kpe"));
        assert!(a.len() <= 12, "{a}");
    }
}
