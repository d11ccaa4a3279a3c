//! cgroup socket hooks for IPv6 sockets of the node's own namespace (connect6, sendmsg6,
//! recvmsg6, getpeername6): as `sock` does for IPv4, an IPv6 Service address (`SERVICES6_V1`)
//! becomes one of its backends (`BACKENDS6_V1`) once per socket, and `SOCKREV6_V1` shows the
//! frontend again.
//!
//! Dual-stack sockets: an IPv6 socket names an IPv4 peer by its v4-mapped address
//! (`::ffff:a.b.c.d`). Such an address is translated through the IPv4 maps (`sock::translate4`,
//! recorded in `SOCKREV_V1`) and the backend written back v4-mapped, so the socket stays an IPv6
//! one; getpeername()/recvmsg() map it back the same way. (A v4-mapped sendmsg() on an
//! unconnected UDP socket runs the kernel's sendmsg4 hook, not this one: `sock` handles it.)
//!
//! The same rules as for IPv4: only the node's namespace (netns cookie), the in-cluster entry of
//! an externalTrafficPolicy Local frontend, no endpoints refused (ECONNREFUSED) or failed as a
//! dropped SYN (ETIMEDOUT), a ClusterIP's other ports refused and the unallocated IPv6 Service
//! CIDR failed (`SVCCIDRS6_V1`), affinity and the frontend's scheduler (`ipv6::pick`).
//! The node as a client is its IPv6 address in `NODE6_V1` (the agent writes it; `::` before it
//! knows one), as `sock` uses the IPv4 node address: session affinity and source hashing see it,
//! and a LoadBalancer IP with loadBalancerSourceRanges lets the node through only if a range
//! holds it (`::` is in no range the agent writes but `::/0`).

use aya_ebpf::{
    EbpfContext as _,
    helpers::{bpf_get_prandom_u32, bpf_get_socket_cookie},
    programs::SockAddrContext,
};
use proxy_common::{
    Counter,
    ipv6::{RevNat6, Service6Key, SockRev6Key, SourceRange6Key, to_v4_mapped, v4_mapped},
    proto, service_flags,
};

use crate::{
    ipv6::pick::{self, NewFlow6},
    log, maps,
    sock::{self, ALLOW, ECONNREFUSED, KeptBackend, SockCall, Translated},
    stats,
};

/// connect6() and sendmsg6(): an IPv6 Service address (or a v4-mapped IPv4 one) becomes one of
/// its backends.
#[inline(always)]
pub fn translate(ctx: &SockAddrContext, call: SockCall) -> i32 {
    let Some(client) = sock::client_of(ctx) else {
        return ALLOW;
    };
    let (proto, addr, port) = user_addr6(ctx);
    let result = match v4_mapped(&addr) {
        Some(addr4) => sock::translate4(ctx, call, proto, addr4, port)
            .map(|to| to.map(|(addr, port)| (to_v4_mapped(addr), port))),
        None => translate6(ctx, call, proto, &addr, port),
    };
    match result {
        Ok(Some((addr, port))) => {
            set_user_addr6(ctx, &addr, port);
            client.count_translated();
        }
        Ok(None) => {}
        Err(errno) => return sock::fail(errno),
    }
    ALLOW
}

/// bind6(): see `sock::bound` (Go's listeners bind `[::]`, dual-stack).
#[inline(always)]
pub fn bind(ctx: &SockAddrContext) -> i32 {
    let (_, _, port) = user_addr6(ctx);
    sock::bound(ctx, port)
}

/// recvmsg6() and getpeername6(): a backend address the socket was sent to shows as the frontend.
#[inline(always)]
pub fn reverse(ctx: &SockAddrContext) -> i32 {
    let (proto, addr, port) = user_addr6(ctx);
    match v4_mapped(&addr) {
        Some(addr4) => {
            if let Some(frontend) = sock::reverse4(ctx, proto, addr4, port) {
                set_user_addr6(ctx, &to_v4_mapped(frontend.addr), frontend.port);
            }
        }
        None => {
            // Only translated sockets have entries (cookies are unique): no netns check.
            if let Some(frontend) = maps::sock_rev6(&rev_key6(ctx, proto, addr, port)) {
                set_user_addr6(ctx, &frontend.addr, frontend.port);
                stats::count(Counter::SockReverseTranslated);
            }
        }
    }
    ALLOW
}

/// The node's socket as a new IPv6 flow for `ipv6::pick`.
struct SockFlow6<'a> {
    /// The node's IPv6 address (see the module comment).
    client: [u8; 16],
    frontend_addr: &'a [u8; 16],
}

impl NewFlow6 for SockFlow6<'_> {
    #[inline(always)]
    fn client(&self) -> &[u8; 16] {
        &self.client
    }

    #[inline(always)]
    fn frontend_addr(&self) -> &[u8; 16] {
        self.frontend_addr
    }

    #[inline(always)]
    fn hash(&self, _seed: u32) -> u32 {
        // As for IPv4: a socket has no source port yet, each connect() draws its own.
        // SAFETY: bpf_get_prandom_u32 takes no arguments.
        unsafe { bpf_get_prandom_u32() }
    }
}

/// `sock::translate4` for an IPv6 frontend.
#[inline(always)]
fn translate6(
    ctx: &SockAddrContext,
    call: SockCall,
    proto: u8,
    addr: &[u8; 16],
    port: [u8; 2],
) -> Translated<[u8; 16]> {
    if proto != proto::TCP && proto != proto::UDP {
        return Ok(None);
    }
    // The node's own traffic is in-cluster traffic: an externalTrafficPolicy Local frontend's
    // `SCOPE_INTERNAL` entry when the agent wrote one.
    let mut key = Service6Key::new(*addr, port, proto, 0);
    let Some(frontend) = maps::frontend6_for(&mut key, || true) else {
        return sock::not_a_frontend(maps::service_cidr6(addr));
    };
    // The node as a client: its socket has no source address yet, so the node's IPv6 address
    // (what a flow of the node's toward another node's NodePort would come from) stands for all
    // of the node's processes, as on IPv4.
    let node = maps::node6_addr();
    if frontend.flags & service_flags::SOURCE_RANGES != 0
        && !maps::source_in_range6(SourceRange6Key {
            frontend_addr: key.addr,
            frontend_port: key.port,
            proto: key.proto,
            _pad: 0,
            source: node,
        })
    {
        stats::count(Counter::DropSourceRange);
        return Err(ECONNREFUSED);
    }
    let sticky = KeptBackend::for_call(ctx, call, proto, *addr, port);
    let kept = sticky
        .as_ref()
        .and_then(|s| s.kept(|id| maps::backend6_ref(id).map(|b| (b.addr, b.port, b.flags))));
    let backend_id = match kept {
        Some(id) => id,
        None => {
            let flow = SockFlow6 {
                client: node,
                frontend_addr: addr,
            };
            let Ok(choice) = pick::choose(&key, &frontend, &flow) else {
                stats::count(Counter::DropNoBackend);
                return Err(ECONNREFUSED);
            };
            let Some(backend_id) = choice else {
                return Err(sock::no_endpoints(frontend.flags));
            };
            backend_id
        }
    };
    let Some(backend) = maps::backend6_ref(backend_id) else {
        stats::count(Counter::DropNoBackend);
        return Err(ECONNREFUSED);
    };
    if let (Some(s), None) = (&sticky, kept) {
        s.record(backend_id, backend.addr, backend.port);
    }
    let rev = rev_key6(ctx, proto, backend.addr, backend.port);
    let shown = RevNat6 {
        addr: *addr,
        port,
        _pad: [0; 2],
    };
    if maps::sock_rev6_insert(&rev, &shown).is_err() {
        // The connection still works; only getpeername()/recvmsg() show the backend.
        stats::count(Counter::SockRevNatFailed);
    }
    stats::count(Counter::SockTranslated);
    log::socket6(
        proto,
        (addr, port),
        (&backend.addr, backend.port),
        backend_id,
    );
    Ok(Some((backend.addr, backend.port)))
}

/// This socket and an IPv6 backend it was sent to (the `SOCKREV6_V1` key).
#[inline(always)]
fn rev_key6(ctx: &SockAddrContext, proto: u8, addr: [u8; 16], port: [u8; 2]) -> SockRev6Key {
    SockRev6Key {
        // SAFETY: the helper reads the socket behind a valid sock_addr context.
        cookie: unsafe { bpf_get_socket_cookie(ctx.as_ptr()) },
        backend_addr: addr,
        backend_port: port,
        proto,
        _pad: [0; 5],
    }
}

/// The socket's protocol and the IPv6 address the syscall names (`user_ip6` holds sin6_addr as
/// loaded from memory, four words whose bytes are the address in network order).
#[inline(always)]
fn user_addr6(ctx: &SockAddrContext) -> (u8, [u8; 16], [u8; 2]) {
    // SAFETY: the kernel hands a valid `bpf_sock_addr`; the verifier admits these 4-byte reads
    // in every IPv6 sock_addr hook (volatile: one load per word, never merged). `[u32; 4]` and
    // `[u8; 16]` have the same size and any bit pattern is valid for both.
    unsafe {
        let sa = ctx.sock_addr;
        let ip6 = (&raw const (*sa).user_ip6).cast::<u32>();
        let words = [
            core::ptr::read_volatile(ip6),
            core::ptr::read_volatile(ip6.add(1)),
            core::ptr::read_volatile(ip6.add(2)),
            core::ptr::read_volatile(ip6.add(3)),
        ];
        let addr = core::mem::transmute::<[u32; 4], [u8; 16]>(words);
        let port = (*sa).user_port as u16;
        ((*sa).protocol as u8, addr, port.to_ne_bytes())
    }
}

/// Rewrites the IPv6 address the syscall names (connect/sendmsg: where to; recvmsg/getpeername:
/// what the application is told).
#[inline(always)]
fn set_user_addr6(ctx: &SockAddrContext, addr: &[u8; 16], port: [u8; 2]) {
    // SAFETY: the four IPv6 hooks may write user_ip6 (4-byte stores, volatile so that they are
    // not merged) and user_port; the transmute is as in `user_addr6`.
    unsafe {
        let words = core::mem::transmute::<[u8; 16], [u32; 4]>(*addr);
        let sa = ctx.sock_addr;
        let ip6 = (&raw mut (*sa).user_ip6).cast::<u32>();
        core::ptr::write_volatile(ip6, words[0]);
        core::ptr::write_volatile(ip6.add(1), words[1]);
        core::ptr::write_volatile(ip6.add(2), words[2]);
        core::ptr::write_volatile(ip6.add(3), words[3]);
        (*sa).user_port = u32::from(u16::from_ne_bytes(port));
    }
}
