//! tc programs of kube-proxy-ebpf: ClusterIP DNAT with conntrack on ingress, reverse NAT on
//! egress; cgroup socket hooks for clients in the node's own namespace (`sock`). The entries only run the flow (`ingress`/`egress`), turn its result into one verdict
//! and count why; everything else lives in the modules below, one per stage.
#![no_std]
#![no_main]
// BPF atomics: the BPF target has no RMW atomics in core (`maps::fetch_add_u32`).
#![feature(core_intrinsics, asm_experimental_arch)]
#![allow(internal_features)]

mod affinity;
mod conntrack;
mod egress;
mod frag;
mod frontend_gen;
mod icmp;
mod ingress;
mod ipv6;
mod lc;
mod local_socket;
mod log;
mod maglev;
mod maps;
mod nat;
mod packet;
mod pick;
mod reject;
mod sctp;
mod snat;
mod sock;
mod sock6;
mod stats;
mod svc_cidr;
mod tap;

use aya_ebpf::{
    bindings::{TC_ACT_SHOT, TC_ACT_UNSPEC},
    macros::{cgroup_sock_addr, classifier},
    programs::{SockAddrContext, TcContext},
};
use packet::{ETH_HLEN, NO_L2};
use proxy_common::Counter;

/// What happens to a packet that was not dropped: the tc verdict and the counter naming the
/// outcome.
#[derive(Clone, Copy)]
pub(crate) struct Action {
    pub verdict: i32,
    pub counter: Counter,
}

impl Action {
    /// Hand the packet (rewritten or not) on: `TC_ACT_UNSPEC` is TCX_NEXT, so the programs and
    /// legacy clsact filters after ours on the same hook still run (TC_ACT_OK would end the
    /// chain); after the last one the kernel carries the packet on as with OK.
    pub(crate) const fn pass(counter: Counter) -> Self {
        Self {
            verdict: TC_ACT_UNSPEC,
            counter,
        }
    }

    /// The packet was turned into an answer and redirected (`bpf_redirect`'s return value).
    pub(crate) const fn redirect(verdict: i32, counter: Counter) -> Self {
        Self { verdict, counter }
    }
}

/// Why a packet is dropped. The only error type of the flows; every variant is one counter and
/// the verdict is always `TC_ACT_SHOT`.
#[derive(Clone, Copy)]
pub(crate) enum Drop {
    /// A later fragment of a datagram whose first fragment was dropped or answered, or an SCTP
    /// fragment to a Service (not translated: see `packet.rs`).
    Fragment,
    /// Truncated or inconsistent TCP/UDP/IPv4 header on a packet to a Service.
    Malformed,
    /// The conntrack entries could not be written.
    ConntrackFull,
    /// A new flow's reply tuple was taken by another flow between its check and its insert.
    ConntrackInsertFailed,
    /// A service slot named a backend that does not exist.
    NoBackend,
    /// The ICMP error or TCP RST could not be built.
    RejectFailed,
    /// An ICMP error or TCP RST was due, over this CPU's answer budget.
    RejectRateLimited,
    /// A checksum or store helper failed while rewriting.
    RewriteFailed,
    /// A Local traffic policy with endpoints on other nodes and none on this one.
    NoLocalEndpoints,
    /// No free SNAT port for the flow's backend.
    SnatPortsExhausted,
    /// A new flow to a LoadBalancer IP from outside its loadBalancerSourceRanges.
    SourceRange,
    /// A new flow's reply tuple clashed with a live flow's and no free source port was found.
    ReplyTupleExhausted,
    /// The new-flow program could not be tail-called.
    TailCall,
    /// A new flow to an unallocated address inside the Service CIDRs.
    UnallocatedServiceIp,
    /// A flow taken over from netfilter, while its netfilter entry is being deleted.
    TakeoverHandoff,
}

impl Drop {
    const fn counter(self) -> Counter {
        match self {
            Drop::Fragment => Counter::DropFragment,
            Drop::Malformed => Counter::DropMalformed,
            Drop::ConntrackFull => Counter::DropConntrackFull,
            Drop::ConntrackInsertFailed => Counter::DropConntrackInsertFailed,
            Drop::NoBackend => Counter::DropNoBackend,
            Drop::RejectFailed => Counter::DropRejectFailed,
            Drop::RejectRateLimited => Counter::DropRejectRateLimited,
            Drop::RewriteFailed => Counter::DropRewriteFailed,
            Drop::NoLocalEndpoints => Counter::DropNoLocalEndpoints,
            Drop::SnatPortsExhausted => Counter::DropSnatPortsExhausted,
            Drop::SourceRange => Counter::DropSourceRange,
            Drop::ReplyTupleExhausted => Counter::DropReplyTupleExhausted,
            Drop::TailCall => Counter::DropTailCall,
            Drop::UnallocatedServiceIp => Counter::DropUnallocatedServiceIp,
            Drop::TakeoverHandoff => Counter::DropTakeoverHandoff,
        }
    }
}

/// The one place where a flow's result becomes a tc verdict.
#[inline(always)]
fn verdict(result: Result<Action, Drop>) -> i32 {
    match result {
        Ok(action) => {
            stats::count(action.counter);
            action.verdict
        }
        Err(drop) => {
            stats::count(drop.counter());
            TC_ACT_SHOT
        }
    }
}

/// Pod-facing host veths and node devices, before routing: DNAT to a backend.
#[classifier]
pub fn tc_ingress(ctx: TcContext) -> i32 {
    ingress(&ctx, ETH_HLEN)
}

/// `tc_ingress` for L3 devices (ipip/tunl0, gre, WireGuard): packets start at the IPv4 header.
#[classifier]
pub fn tc_ingress_l3(ctx: TcContext) -> i32 {
    ingress(&ctx, NO_L2)
}

#[inline(always)]
fn ingress(ctx: &TcContext, l2_len: usize) -> i32 {
    stats::count(Counter::IngressPackets);
    verdict(frag::first_done(
        ctx,
        l2_len,
        ingress::try_tc_ingress(ctx, l2_len),
    ))
}

/// The new-flow half of ingress (service lookup, pick, conntrack entries, DNAT), tail-called by
/// `tc_ingress`; never attached. A program of its own so that each half has the whole 512-byte
/// stack.
#[classifier]
pub fn tc_ingress_new(ctx: TcContext) -> i32 {
    // A first fragment's outcome is recorded by the program that ends its run.
    verdict(frag::first_done(
        &ctx,
        ETH_HLEN,
        ingress::try_new_flow(&ctx, ETH_HLEN),
    ))
}

/// `tc_ingress_new` for L3 devices, tail-called by `tc_ingress_l3`.
#[classifier]
pub fn tc_ingress_new_l3(ctx: TcContext) -> i32 {
    verdict(frag::first_done(
        &ctx,
        NO_L2,
        ingress::try_new_flow(&ctx, NO_L2),
    ))
}

/// A packet to no Service, tail-called by `tc_ingress_new`: tracked so that no translated flow
/// takes its reply tuple (and moved to another source port if one already holds it). Never
/// attached.
#[classifier]
pub fn tc_ingress_direct(ctx: TcContext) -> i32 {
    // A first fragment's outcome is recorded by the program that ends its run.
    verdict(frag::first_done(
        &ctx,
        ETH_HLEN,
        ingress::try_direct_flow(&ctx, ETH_HLEN),
    ))
}

/// `tc_ingress_direct` for L3 devices.
#[classifier]
pub fn tc_ingress_direct_l3(ctx: TcContext) -> i32 {
    verdict(frag::first_done(
        &ctx,
        NO_L2,
        ingress::try_direct_flow(&ctx, NO_L2),
    ))
}

/// A new flow to a Service without endpoints, tail-called by `tc_ingress_new`: answered with
/// ICMP port unreachable. Never attached.
#[classifier]
pub fn tc_ingress_reject(ctx: TcContext) -> i32 {
    // A first fragment's outcome is recorded by the program that ends its run.
    verdict(frag::first_done(
        &ctx,
        ETH_HLEN,
        ingress::try_reject(&ctx, ETH_HLEN),
    ))
}

/// `tc_ingress_reject` for L3 devices: no answer is built there, the packet is dropped
/// (`reject.rs`).
#[classifier]
pub fn tc_ingress_reject_l3(ctx: TcContext) -> i32 {
    verdict(frag::first_done(
        &ctx,
        NO_L2,
        ingress::try_reject(&ctx, NO_L2),
    ))
}

/// Toward the client: reverse NAT of replies (backend → frontend); toward a remote backend: SNAT
/// of external flows to the node.
#[classifier]
pub fn tc_egress(ctx: TcContext) -> i32 {
    egress(&ctx, ETH_HLEN)
}

/// `tc_egress` for L3 devices (ipip/tunl0, gre, WireGuard).
#[classifier]
pub fn tc_egress_l3(ctx: TcContext) -> i32 {
    egress(&ctx, NO_L2)
}

#[inline(always)]
fn egress(ctx: &TcContext, l2_len: usize) -> i32 {
    stats::count(Counter::EgressPackets);
    verdict(frag::first_done(
        ctx,
        l2_len,
        egress::try_tc_egress(ctx, l2_len),
    ))
}

/// IPv6 on tc ingress, tail-called by `tc_ingress` (EtherType 0x86DD); never attached.
#[classifier]
pub fn tc_ingress6(ctx: TcContext) -> i32 {
    verdict(ipv6::try_ingress(&ctx, ETH_HLEN))
}

/// `tc_ingress6` for L3 devices, tail-called by `tc_ingress_l3` (version 6).
#[classifier]
pub fn tc_ingress6_l3(ctx: TcContext) -> i32 {
    verdict(ipv6::try_ingress(&ctx, NO_L2))
}

/// The IPv6 new-flow half, tail-called by `tc_ingress6`.
#[classifier]
pub fn tc_ingress6_new(ctx: TcContext) -> i32 {
    verdict(ipv6::try_new_flow(&ctx, ETH_HLEN))
}

/// `tc_ingress6_new` for L3 devices.
#[classifier]
pub fn tc_ingress6_new_l3(ctx: TcContext) -> i32 {
    verdict(ipv6::try_new_flow(&ctx, NO_L2))
}

/// IPv6 answers (ICMPv6 port unreachable, TCP RST), tail-called by `tc_ingress6`.
#[classifier]
pub fn tc_ingress6_reject(ctx: TcContext) -> i32 {
    verdict(ipv6::try_reject(&ctx, ETH_HLEN))
}

/// `tc_ingress6_reject` for L3 devices: no answer is built there, dropped (as for IPv4).
#[classifier]
pub fn tc_ingress6_reject_l3(ctx: TcContext) -> i32 {
    verdict(ipv6::try_reject(&ctx, NO_L2))
}

/// IPv6 on tc egress, tail-called by `tc_egress`.
#[classifier]
pub fn tc_egress6(ctx: TcContext) -> i32 {
    verdict(ipv6::try_egress(&ctx, ETH_HLEN))
}

/// `tc_egress6` for L3 devices, tail-called by `tc_egress_l3`.
#[classifier]
pub fn tc_egress6_l3(ctx: TcContext) -> i32 {
    verdict(ipv6::try_egress(&ctx, NO_L2))
}

/// IPv6 SNAT port allocation of a new external flow, tail-called by `tc_ingress6_new`.
#[classifier]
pub fn tc_ingress6_snat(ctx: TcContext) -> i32 {
    verdict(ipv6::try_new_snat(&ctx, ETH_HLEN))
}

/// `tc_ingress6_snat` for L3 devices.
#[classifier]
pub fn tc_ingress6_snat_l3(ctx: TcContext) -> i32 {
    verdict(ipv6::try_new_snat(&ctx, NO_L2))
}

/// IPv6 SNAT of a forwarded external flow to the node, tail-called by `tc_egress6`.
#[classifier]
pub fn tc_egress6_snat(ctx: TcContext) -> i32 {
    verdict(ipv6::try_egress_snat(&ctx, ETH_HLEN))
}

/// `tc_egress6_snat` for L3 devices.
#[classifier]
pub fn tc_egress6_snat_l3(ctx: TcContext) -> i32 {
    verdict(ipv6::try_egress_snat(&ctx, NO_L2))
}

/// Test-only, never attached by the agent: counts the TCP/UDP packets it sees (`tap`) and hands
/// every packet on with TCX_NEXT. The chaining tests attach it before and after our programs.
#[classifier]
pub fn tc_tap(ctx: TcContext) -> i32 {
    tap::count(&ctx);
    TC_ACT_UNSPEC
}

/// connect() of a socket in the node's own namespace: a Service address becomes a backend.
#[cgroup_sock_addr(connect4)]
pub fn sock_connect4(ctx: SockAddrContext) -> i32 {
    sock::translate(&ctx, sock::SockCall::Connect)
}

/// sendmsg() of an unconnected UDP socket in the node's namespace: as connect(), each datagram
/// kept on the backend the socket's earlier ones to that frontend went to.
#[cgroup_sock_addr(sendmsg4)]
pub fn sock_sendmsg4(ctx: SockAddrContext) -> i32 {
    sock::translate(&ctx, sock::SockCall::Sendmsg)
}

/// recvmsg() on a translated UDP socket: the datagram's source shows as the Service.
#[cgroup_sock_addr(recvmsg4)]
pub fn sock_recvmsg4(ctx: SockAddrContext) -> i32 {
    sock::reverse(&ctx)
}

/// getpeername() on a translated socket: the peer shows as the Service.
#[cgroup_sock_addr(getpeername4)]
pub fn sock_getpeername4(ctx: SockAddrContext) -> i32 {
    sock::reverse(&ctx)
}

/// connect() of an IPv6 socket in the node's namespace: an IPv6 Service address (or a v4-mapped
/// IPv4 one) becomes a backend.
#[cgroup_sock_addr(connect6)]
pub fn sock_connect6(ctx: SockAddrContext) -> i32 {
    sock6::translate(&ctx, sock::SockCall::Connect)
}

/// sendmsg() of an unconnected IPv6 UDP socket in the node's namespace: as `sock_sendmsg4`.
#[cgroup_sock_addr(sendmsg6)]
pub fn sock_sendmsg6(ctx: SockAddrContext) -> i32 {
    sock6::translate(&ctx, sock::SockCall::Sendmsg)
}

/// recvmsg() on a translated IPv6 UDP socket: the datagram's source shows as the Service.
#[cgroup_sock_addr(recvmsg6)]
pub fn sock_recvmsg6(ctx: SockAddrContext) -> i32 {
    sock6::reverse(&ctx)
}

/// getpeername() on a translated IPv6 socket: the peer shows as the Service.
#[cgroup_sock_addr(getpeername6)]
pub fn sock_getpeername6(ctx: SockAddrContext) -> i32 {
    sock6::reverse(&ctx)
}

/// bind() in the node's namespace: another Service proxy taking its port while no agent runs
/// hands the datapath over (`proxy_common::presence`).
#[cgroup_sock_addr(bind4)]
pub fn sock_bind4(ctx: SockAddrContext) -> i32 {
    sock::bind(&ctx)
}

/// bind() of an IPv6 (or dual-stack) socket: as `sock_bind4`.
#[cgroup_sock_addr(bind6)]
pub fn sock_bind6(ctx: SockAddrContext) -> i32 {
    sock6::bind(&ctx)
}

#[cfg(not(test))]
#[panic_handler]
fn panic(_info: &core::panic::PanicInfo) -> ! {
    loop {}
}
