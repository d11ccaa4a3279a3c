//! cgroup socket hooks: Services for clients in the node's own network namespace (the host's
//! processes, hostNetwork pods). Their packets leave through the routing table without crossing a
//! tc ingress hook, so the translation happens once per socket instead, at connect() (and at each
//! sendmsg() of an unconnected UDP socket), like cilium's socket LB: the socket then talks to the
//! backend directly, with no per-packet NAT and no conntrack entry. getpeername() and recvmsg()
//! show the frontend again, through `SOCKREV_V1`. An unconnected UDP socket's datagrams to one
//! frontend keep one backend while it keeps sending ([`KeptBackend`]).
//!
//! Only sockets of the node's namespace are touched (netns cookie from the load-time
//! `SockLbConfig`): pods keep their tc path, so a flow is never translated twice, and a cgroup
//! that also holds processes of other namespaces is unaffected for them. The exception is a time
//! without agent (`proxy_common::presence`): a pod created then has no tc programs on its
//! interface until an agent attaches them, so while no agent runs pods' sockets are translated
//! here too (as the node's: the socket has no source address yet, so session affinity and
//! source hashing see the node's address, and loadBalancerSourceRanges the node's). Once the
//! datapath handed over to another proxy, no socket is translated.
//!
//! Frontend choice for the node as a client follows kube-proxy: the node's own traffic is
//! in-cluster traffic, so an externalTrafficPolicy Local frontend sends it to the Service's
//! cluster-wide endpoints (the `SCOPE_INTERNAL` entry) when the agent wrote one. A Service
//! without endpoints is refused with ECONNREFUSED (kube-proxy rejects with port unreachable,
//! which a TCP client sees as the same error). Where kube-proxy drops instead (an
//! internalTrafficPolicy Local ClusterIP with endpoints only on other nodes:
//! `DROP_WHEN_EMPTY`), connect()/sendmsg() fail at once with ETIMEDOUT, the error a dropped
//! SYN ends in, rather than hanging through the retries or leaking the packet to the VIP.

use aya_ebpf::{
    EbpfContext as _,
    helpers::{bpf_get_netns_cookie, bpf_get_prandom_u32, bpf_get_socket_cookie, bpf_set_retval},
    programs::SockAddrContext,
};
use proxy_common::{
    Counter, RevNat, ServiceKey, SockPickKey, SockPickValue, SockRevKey, SourceRangeKey,
    backend_flags, ct_state, ipv6::to_v4_mapped, proto, service_cidr, service_flags,
    timeouts::idle_expired,
};

use crate::{log, maps, pick, stats};

/// A cgroup sock_addr program's "go on" verdict (0 fails the syscall).
pub const ALLOW: i32 = 1;
const DENY: i32 = 0;
pub const ECONNREFUSED: i32 = 111;
pub const ETIMEDOUT: i32 = 110;

/// What a connect()/sendmsg() of the node's becomes: `Some` backend address and port to send to
/// instead, `None` to leave the address as it is, or the errno to fail the syscall with.
pub type Translated<A> = Result<Option<(A, [u8; 2])>, i32>;

/// The syscall a translating hook runs for.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum SockCall {
    /// connect(): the socket is translated once, for its lifetime.
    Connect,
    /// sendmsg() of an unconnected socket: each datagram names its destination again.
    Sendmsg,
}

/// The backend an unconnected UDP socket's datagrams to one frontend go to, kept in
/// `SOCKPICK_V1` while the socket keeps sending. netfilter keeps a UDP tuple on one backend until
/// the tuple has been idle for the UDP timeout, and an unconnected socket keeps its source port,
/// so through kube-proxy its datagrams to a Service stay on one backend (a resolver's queries,
/// a statsd client's metrics); a fresh pick per datagram would scatter them. Both families use
/// it (IPv4 addresses as v4-mapped).
pub struct KeptBackend {
    key: SockPickKey,
    now: u64,
}

impl KeptBackend {
    /// For a sendmsg() of a UDP socket to `frontend_addr:frontend_port`; `None` otherwise
    /// (connect() translates a socket once, TCP has no unconnected sends).
    #[inline(always)]
    pub fn for_call(
        ctx: &SockAddrContext,
        call: SockCall,
        proto: u8,
        frontend_addr: [u8; 16],
        frontend_port: [u8; 2],
    ) -> Option<Self> {
        if call != SockCall::Sendmsg || proto != proto::UDP {
            return None;
        }
        Some(Self {
            key: SockPickKey {
                // SAFETY: the helper reads the socket behind a valid sock_addr context.
                cookie: unsafe { bpf_get_socket_cookie(ctx.as_ptr()) },
                frontend_addr,
                frontend_port,
                proto,
                _pad: [0; 5],
            },
            now: maps::now_ns(),
        })
    }

    /// The backend the socket's last datagram to this frontend went to, refreshed, if that was
    /// within the UDP timeout (unanswered: `udp_timeout_s`, netfilter's first timeout) and
    /// `current(id)` (the backend's address as v4-mapped, port, flags) still names it and lets
    /// a UDP flow keep it (a not-serving backend does not: as a conntrack entry's).
    #[inline(always)]
    pub fn kept(
        &self,
        current: impl FnOnce(u32) -> Option<([u8; 16], [u8; 2], u8)>,
    ) -> Option<u32> {
        let ptr = maps::sock_pick(&self.key)?;
        // SAFETY: a valid pointer into the LRU map; racing sendmsg()s of one socket write the
        // same fields, and a torn read is caught by the revalidation below.
        let v = unsafe { &mut *ptr };
        let cfg = maps::config_ref();
        if idle_expired(v.last_seen_ns, proto::UDP, ct_state::UDP, 0, self.now, cfg) {
            return None;
        }
        let (addr, port, flags) = current(v.backend_id)?;
        if addr != v.backend_addr
            || port != v.backend_port
            || !backend_flags::keeps_flow(flags, proto::UDP)
        {
            return None;
        }
        v.last_seen_ns = self.now;
        stats::count(Counter::SockBackendKept);
        Some(v.backend_id)
    }

    /// Records the backend this datagram was sent to (a failed write only means the next
    /// datagram is picked afresh).
    #[inline(always)]
    pub fn record(&self, backend_id: u32, addr: [u8; 16], port: [u8; 2]) {
        let _ = maps::sock_pick_insert(
            &self.key,
            &SockPickValue {
                last_seen_ns: self.now,
                backend_id,
                backend_port: port,
                _pad: [0; 2],
                backend_addr: addr,
            },
        );
    }
}

/// connect() and sendmsg(): a Service address becomes one of its backends.
#[inline(always)]
pub fn translate(ctx: &SockAddrContext, call: SockCall) -> i32 {
    let Some(client) = client_of(ctx) else {
        return ALLOW;
    };
    let (proto, addr, port) = user_addr(ctx);
    match translate4(ctx, call, proto, addr, port) {
        Ok(Some((addr, port))) => {
            set_user_addr(ctx, addr, port);
            client.count_translated();
        }
        Ok(None) => {}
        Err(errno) => return fail(errno),
    }
    ALLOW
}

/// bind() of the node's processes: another Service proxy binding its port while no agent runs
/// (kube-proxy reinstated after the agent was removed) hands the datapath over to it. Never
/// refuses the bind.
#[inline(always)]
pub fn bound(ctx: &SockAddrContext, port: [u8; 2]) -> i32 {
    let node = maps::sock_lb_config().netns_cookie;
    // SAFETY: the helper reads the netns of the socket behind a valid sock_addr context.
    if node == 0 || unsafe { bpf_get_netns_cookie(ctx.as_ptr()) } != node {
        return ALLOW;
    }
    if maps::hand_over_on_bind(u16::from_be_bytes(port), maps::now_ns()) {
        stats::count(Counter::HandOverBind);
    }
    ALLOW
}

/// bind4: see [`bound`].
#[inline(always)]
pub fn bind(ctx: &SockAddrContext) -> i32 {
    let (_, _, port) = user_addr(ctx);
    bound(ctx, port)
}

/// Whose socket a connect()/sendmsg() is, for the translation.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum SockClient {
    /// A process of the node's own namespace: always translated here (no tc hook on its path).
    Node,
    /// A pod's process while no agent runs: its interface may have no tc programs yet (created
    /// while the agent was away), so the socket is translated here instead, once.
    PodWithoutAgent,
}

impl SockClient {
    #[inline(always)]
    pub fn count_translated(self) {
        if self == SockClient::PodWithoutAgent {
            stats::count(Counter::SockPodTranslated);
        }
    }
}

/// Whose socket this is, or `None` to leave it alone: the node's own sockets are translated,
/// pods' only while no agent runs (otherwise tc on their interfaces translates them, and a flow
/// is never translated twice); nothing once the datapath handed over to another proxy.
#[inline(always)]
pub fn client_of(ctx: &SockAddrContext) -> Option<SockClient> {
    let node = maps::sock_lb_config().netns_cookie;
    if node == 0 {
        return None;
    }
    let now = maps::now_ns();
    if maps::handed_over(now) {
        return None;
    }
    // SAFETY: the helper reads the netns of the socket behind a valid sock_addr context.
    if unsafe { bpf_get_netns_cookie(ctx.as_ptr()) } == node {
        return Some(SockClient::Node);
    }
    if maps::agent_alive(now) {
        return None;
    }
    Some(SockClient::PodWithoutAgent)
}

/// The IPv4 translation of a connect()/sendmsg() of the node's to `addr:port` (an IPv4 socket's
/// address, or the IPv4 address inside a v4-mapped one of an IPv6 socket: `sock6`); a backend's
/// frontend is recorded in `SOCKREV_V1`.
#[inline(always)]
pub fn translate4(
    ctx: &SockAddrContext,
    call: SockCall,
    proto: u8,
    addr: [u8; 4],
    port: [u8; 2],
) -> Translated<[u8; 4]> {
    if proto != proto::TCP && proto != proto::UDP {
        return Ok(None);
    }
    // The node's own traffic is in-cluster traffic.
    let Some((key, frontend)) = maps::frontend_for(&ServiceKey::new(addr, port, proto, 0), || true)
    else {
        return not_a_frontend(maps::service_cidr(addr));
    };
    if frontend.flags & service_flags::SOURCE_RANGES != 0 && !node_in_source_ranges(&key) {
        stats::count(Counter::DropSourceRange);
        return Err(ECONNREFUSED);
    }
    let sticky = KeptBackend::for_call(ctx, call, proto, to_v4_mapped(addr), port);
    let kept = sticky.as_ref().and_then(|s| {
        s.kept(|id| maps::backend(id).map(|b| (to_v4_mapped(b.addr), b.port, b.flags)))
    });
    let backend_id = match kept {
        Some(id) => id,
        None => {
            let facts = pick::FlowFacts {
                // The node as a client: its socket has no source address yet, so the node's
                // primary address (what a flow of the node's toward another node's NodePort
                // would come from) stands for all of the node's processes (session affinity,
                // sh); 0.0.0.0 before the agent knows it.
                client: maps::node().map_or([0; 4], |n| n.snat_addr),
                frontend_addr: addr,
                // SAFETY: bpf_get_prandom_u32 takes no arguments.
                hash: unsafe { bpf_get_prandom_u32() },
            };
            let Ok(choice) = pick::choose(&key, &frontend, &facts) else {
                stats::count(Counter::DropNoBackend);
                return Err(ECONNREFUSED);
            };
            let Some(backend_id) = choice else {
                return Err(no_endpoints(frontend.flags));
            };
            backend_id
        }
    };
    let Some(backend) = maps::backend(backend_id) else {
        stats::count(Counter::DropNoBackend);
        return Err(ECONNREFUSED);
    };
    if let (Some(s), None) = (&sticky, kept) {
        s.record(backend_id, to_v4_mapped(backend.addr), backend.port);
    }
    let rev = rev_key(ctx, proto, backend.addr, backend.port);
    let frontend_addr = RevNat {
        addr,
        port,
        _pad: [0; 2],
    };
    if maps::sock_rev_insert(&rev, &frontend_addr).is_err() {
        // The connection still works; only getpeername()/recvmsg() show the backend.
        stats::count(Counter::SockRevNatFailed);
    }
    stats::count(Counter::SockTranslated);
    log::socket(
        proto,
        (addr, port),
        (backend.addr, backend.port),
        backend_id,
    );
    Ok(Some((backend.addr, backend.port)))
}

/// An address that is no frontend, by what it is in the Service address space (`service_cidr::*`).
/// Like tc (and upstream's filter-output): a ClusterIP's other ports are refused, the
/// unallocated rest of the Service CIDRs fails as a dropped SYN would end, anything else is left
/// alone.
#[inline(always)]
pub fn not_a_frontend<A>(cidr: Option<u32>) -> Translated<A> {
    match cidr {
        Some(service_cidr::CLUSTER_IP) => {
            stats::count(Counter::ClusterIpPortRejected);
            Err(ECONNREFUSED)
        }
        Some(service_cidr::UNALLOCATED) => {
            stats::count(Counter::DropUnallocatedServiceIp);
            Err(ETIMEDOUT)
        }
        _ => Ok(None),
    }
}

/// The errno for a frontend without a backend to choose (counted).
#[inline(always)]
pub fn no_endpoints(frontend_flags: u16) -> i32 {
    if frontend_flags & service_flags::DROP_WHEN_EMPTY != 0 {
        // Where tc drops (a Local policy served only by other nodes), the socket fails as a
        // dropped SYN would end, without the minutes of retries.
        stats::count(Counter::DropNoLocalEndpoints);
        return ETIMEDOUT;
    }
    stats::count(Counter::SockNoEndpointsRefused);
    ECONNREFUSED
}

/// getpeername() and recvmsg(): a backend address the socket was sent to shows as the frontend.
#[inline(always)]
pub fn reverse(ctx: &SockAddrContext) -> i32 {
    let (proto, addr, port) = user_addr(ctx);
    if let Some(frontend) = reverse4(ctx, proto, addr, port) {
        set_user_addr(ctx, frontend.addr, frontend.port);
    }
    ALLOW
}

/// The frontend an IPv4 backend address shows as on this socket (counted), if it was translated.
#[inline(always)]
pub fn reverse4(ctx: &SockAddrContext, proto: u8, addr: [u8; 4], port: [u8; 2]) -> Option<RevNat> {
    // Only translated sockets have entries (cookies are unique), so no netns check is needed.
    let frontend = maps::sock_rev(&rev_key(ctx, proto, addr, port))?;
    stats::count(Counter::SockReverseTranslated);
    Some(frontend)
}

/// This socket and a backend it was sent to (the `SOCKREV_V1` key).
#[inline(always)]
fn rev_key(ctx: &SockAddrContext, proto: u8, addr: [u8; 4], port: [u8; 2]) -> SockRevKey {
    SockRevKey {
        // SAFETY: the helper reads the socket behind a valid sock_addr context.
        cookie: unsafe { bpf_get_socket_cookie(ctx.as_ptr()) },
        backend_addr: addr,
        backend_port: port,
        proto,
        _pad: 0,
    }
}

/// The socket's protocol and the address the syscall names (`user_ip4`/`user_port` hold
/// sin_addr/sin_port as loaded from memory: network-order bytes).
#[inline(always)]
fn user_addr(ctx: &SockAddrContext) -> (u8, [u8; 4], [u8; 2]) {
    // SAFETY: the kernel hands a valid `bpf_sock_addr`; the verifier admits these 4-byte reads
    // in every sock_addr hook.
    let (protocol, ip4, port) = unsafe {
        let sa = &*ctx.sock_addr;
        (sa.protocol, sa.user_ip4, sa.user_port)
    };
    (
        protocol as u8,
        ip4.to_ne_bytes(),
        (port as u16).to_ne_bytes(),
    )
}

/// Rewrites the address the syscall names (connect/sendmsg: where to; recvmsg/getpeername: what
/// the application is told).
#[inline(always)]
fn set_user_addr(ctx: &SockAddrContext, addr: [u8; 4], port: [u8; 2]) {
    // SAFETY: the four hooks may write user_ip4/user_port (4-byte stores).
    unsafe {
        let sa = &mut *ctx.sock_addr;
        sa.user_ip4 = u32::from_ne_bytes(addr);
        sa.user_port = u32::from(u16::from_ne_bytes(port));
    }
}

/// loadBalancerSourceRanges for the node as a client: allowed when a range holds the node's
/// address (kube-proxy likewise lets the node through only if its IP is in a range).
#[inline(always)]
fn node_in_source_ranges(key: &ServiceKey) -> bool {
    let Some(node) = maps::node() else {
        return false;
    };
    maps::source_in_range(SourceRangeKey {
        frontend_addr: key.addr,
        frontend_port: key.port,
        proto: key.proto,
        _pad: 0,
        source: node.snat_addr,
    })
}

/// Fail the connect()/sendmsg() with `errno` (a bare DENY would be EPERM).
#[inline(always)]
pub fn fail(errno: i32) -> i32 {
    // SAFETY: bpf_set_retval only sets the syscall's return value (allowed in connect4/sendmsg4).
    unsafe { bpf_set_retval(-errno) };
    DENY
}
