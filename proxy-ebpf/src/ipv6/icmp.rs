//! Reverse translation of ICMPv6 errors (destination unreachable, packet too big, time exceeded,
//! parameter problem) about translated flows, as for IPv4 (`crate::icmp`):
//!
//! - tc egress toward the client: an error about client → backend (from the backend, or a router
//!   on its path: Packet Too Big above all, so that PMTU discovery works through a VIP) is made to
//!   come from the frontend and to quote client → frontend.
//! - tc ingress: an error about a SNATed flow (`SNAT6_V1`), quoting node:port → backend from a
//!   remote backend, or frontend:port → pod from a pod that reached itself (hairpin), is sent on
//!   to the client and quotes client → backend; tc egress then does the step above.
//! - tc ingress from the client's side: an error about a reply as it left this node (quoting
//!   frontend:port → client: a router's Packet Too Big on the way back to the client) is sent on
//!   to the backend quoting the reply as the backend sent it (backend:port → client, or → the
//!   node's address and SNAT port), as on IPv4.
//!
//! Checksums: the ICMPv6 checksum covers the pseudo-header (outer addresses) and the whole
//! message (the quoted packet): each rewrite adjusts it by its difference, with
//! `BPF_F_PSEUDO_HDR` for the outer source. The quoted TCP/UDP checksum is left as it is (it may
//! be cut off, and receivers do not verify it). Neighbour discovery and other informational
//! messages never get here (`packet`).

use aya_ebpf::programs::TcContext;
use proxy_common::{Counter, ct_dir, ct_flags, ipv6::Ct6Key};

use super::{
    nat,
    packet::{self, Icmp6Error},
    snat::Snat6Scratch,
};
use crate::{Action, Drop, maps, nat::replace_quoted_port, snat::may_be_snat};

#[inline(always)]
pub fn reply(ctx: &TcContext, e: &Icmp6Error) -> Result<Action, Drop> {
    let Some(q) = packet::quoted_l4(ctx, e) else {
        return Ok(Action::pass(Counter::ReplyNotTracked));
    };
    // The quoted packet is client → backend: its flow's REPLY entry is backend → client.
    let key = Ct6Key {
        saddr: e.inner_daddr,
        daddr: e.inner_saddr,
        sport: q.dport,
        dport: q.sport,
        proto: q.proto,
        dir: ct_dir::REPLY,
        _pad: [0; 2],
    };
    let Some(entry) = maps::ct6_entry(&key) else {
        return Ok(Action::pass(Counter::ReplyNotTracked));
    };
    let ct = entry.get();
    let csum = e.icmp_csum_off();
    nat::replace_icmp_covered_addr(
        ctx,
        e.inner_daddr_off(),
        csum,
        e.inner_daddr,
        ct.frontend_addr,
        false,
    )?;
    replace_quoted_port(ctx, q.dport_off(), csum, q.dport, ct.frontend_port)?;
    if ct.flags & ct_flags::SPORT_NAT != 0 {
        // The flow left with another source port (reply-tuple clash): quote the client's own.
        replace_quoted_port(ctx, q.sport_off(), csum, q.sport, ct.nat_sport)?;
    }
    nat::replace_icmp_covered_addr(ctx, e.saddr_off(), csum, e.saddr, ct.frontend_addr, true)?;
    Ok(Action::pass(Counter::IcmpErrorTranslated))
}

/// Ingress: an error about a SNATed flow (quoting node:port → backend, or a hairpin flow's
/// frontend:port → pod), back to the client: the outer destination and the quoted source become
/// the client's.
///
/// Passes it (`NotService`) otherwise; `tc_ingress6` then tries [`toward_backend`] (a call of
/// its own, not from here: the two frames together would not fit the BPF stack beside
/// `tc_ingress6`'s).
///
/// A function of its own (a BPF-to-BPF call from `tc_ingress6`): inlined there, bpf-linker
/// 0.13 (LLVM 22) crashes in its post-RA pseudo instruction expansion of `tc_ingress6`.
#[inline(never)]
pub fn snat_reply(ctx: &TcContext, e: &Icmp6Error) -> Result<Action, Drop> {
    let Some(q) = packet::quoted_l4(ctx, e) else {
        return Ok(Action::pass(Counter::NotService));
    };
    if !may_be_snat(q.sport, || maps::is_node6_addr(&e.inner_saddr)) {
        return Ok(Action::pass(Counter::NotService));
    }
    // The quoted packet is node:port → backend: its `in` entry is backend → node:port. The
    // 40-byte key is built in the per-CPU SNAT scratch, not on `tc_ingress6`'s stack.
    let Some(s) = maps::snat6_scratch() else {
        return Ok(Action::pass(Counter::NotService));
    };
    let key = &mut s.in_key;
    set_reversed_quote(key, e, &q, ct_dir::REPLY);
    let Some(entry) = maps::snat6_entry(key) else {
        return Ok(Action::pass(Counter::NotService));
    };
    // The client's address and port only (the entry's other fields need no room on the stack).
    let (addr, port) = {
        let client = entry.peek();
        (client.addr, client.port)
    };
    let csum = e.icmp_csum_off();
    nat::replace_icmp_covered_addr(ctx, e.inner_saddr_off(), csum, e.inner_saddr, addr, false)?;
    replace_quoted_port(ctx, q.sport_off(), csum, q.sport, port)?;
    nat::replace_icmp_covered_addr(ctx, e.daddr_off(), csum, e.daddr, addr, true)?;
    Ok(Action::pass(Counter::IcmpErrorTranslated))
}

/// An error about a translated flow's reply, quoting frontend:port → client: on to the backend,
/// quoting backend:port → the client as the backend knows it (its own address and port, the
/// source port a reply-tuple clash gave it, or the node's address and SNAT port). The 40-byte
/// keys and the addresses are kept in the per-CPU SNAT scratch: `out_key` ends up as the flow
/// after DNAT (client → backend), `out` as the peer the backend knows. Functions of their own,
/// as [`snat_reply`] (the same bpf-linker crash, inlined).
#[inline(never)]
pub fn toward_backend(ctx: &TcContext, e: &Icmp6Error) -> Result<Action, Drop> {
    let Some(q) = packet::quoted_l4(ctx, e) else {
        return Ok(Action::pass(Counter::NotService));
    };
    let q = &q;
    let Some(s) = maps::snat6_scratch() else {
        return Ok(Action::pass(Counter::NotService));
    };
    // The quoted packet is frontend → client: its flow's ORIGINAL entry is client → frontend.
    let key = &mut s.original;
    set_reversed_quote(key, e, q, ct_dir::ORIGINAL);
    let Some(entry) = maps::ct6_entry(key) else {
        return Ok(Action::pass(Counter::NotService));
    };
    let ct = entry.peek();
    if ct.flags & (ct_flags::DIRECT | ct_flags::NETFILTER) != 0 {
        // Not translated here: the error is already about the packet as the backend sent it.
        return Ok(Action::pass(Counter::NotService));
    }
    let out = &mut s.out_key;
    out.saddr = e.inner_daddr;
    out.daddr = ct.backend_addr;
    out.sport = if ct.flags & ct_flags::SPORT_NAT != 0 {
        ct.nat_sport
    } else {
        q.dport
    };
    out.dport = ct.backend_port;
    out.proto = q.proto;
    out.dir = ct_dir::ORIGINAL;
    out._pad = [0; 2];
    match maps::snat6_entry(out) {
        Some(v) => s.out = *v.peek(),
        None => {
            s.out.addr = e.inner_daddr;
            s.out.port = s.out_key.sport;
        }
    }
    rewrite_toward_backend(ctx, e, q, s)
}

#[inline(always)]
fn rewrite_toward_backend(
    ctx: &TcContext,
    e: &Icmp6Error,
    q: &packet::Quoted,
    s: &Snat6Scratch,
) -> Result<Action, Drop> {
    let csum = e.icmp_csum_off();
    let backend = &s.out_key.daddr;
    nat::replace_icmp_covered_addr(
        ctx,
        e.inner_saddr_off(),
        csum,
        e.inner_saddr,
        *backend,
        false,
    )?;
    replace_quoted_port(ctx, q.sport_off(), csum, q.sport, s.out_key.dport)?;
    nat::replace_icmp_covered_addr(
        ctx,
        e.inner_daddr_off(),
        csum,
        e.inner_daddr,
        s.out.addr,
        false,
    )?;
    replace_quoted_port(ctx, q.dport_off(), csum, q.dport, s.out.port)?;
    nat::replace_icmp_covered_addr(ctx, e.daddr_off(), csum, e.daddr, *backend, true)?;
    Ok(Action::pass(Counter::IcmpErrorTranslated))
}

/// Writes into `key` the quoted packet's other direction (its source and destination swapped),
/// tagged `dir`: conntrack and SNAT keys alike (the 40-byte key lives in the per-CPU scratch).
#[inline(always)]
fn set_reversed_quote(key: &mut Ct6Key, e: &Icmp6Error, q: &packet::Quoted, dir: u8) {
    key.saddr = e.inner_daddr;
    key.daddr = e.inner_saddr;
    key.sport = q.dport;
    key.dport = q.sport;
    key.proto = q.proto;
    key.dir = dir;
    key._pad = [0; 2];
}
