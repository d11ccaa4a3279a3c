//! IPv6 tc egress: reverse NAT of replies (backend → frontend) for flows in `CONNTRACK6_V1`, and
//! of ICMPv6 errors about them (`icmp`); SNAT to the node of forwarded external flows (`snat`).

use aya_ebpf::programs::TcContext;
use proxy_common::{Counter, TAIL_CALL_SNAT6, ct_flags, frag_hook};

use super::{
    conntrack, frag, icmp, nat,
    packet::{self, Packet6, Parsed6},
    snat,
};
use crate::{Action, Drop, log, maps, stats};

#[inline(always)]
pub fn try_egress(ctx: &TcContext, l2_len: usize) -> Result<Action, Drop> {
    let p = match packet::parse(ctx, l2_len) {
        Parsed6::Packet(p) => p,
        Parsed6::Fragment(f) => return frag::later(ctx, f, frag_hook::EGRESS),
        Parsed6::IcmpError(e) => return icmp::reply(ctx, e),
        Parsed6::Pass(Counter::NotService) => return Ok(Action::pass(Counter::ReplyNotTracked)),
        Parsed6::Pass(counter) => return Ok(Action::pass(counter)),
        Parsed6::Untranslatable { .. } => return Ok(Action::pass(Counter::MalformedPassed)),
    };
    if p.has_ext {
        stats::count(Counter::Ipv6ExtHeaders);
    }
    let result = reply(ctx, p);
    frag::first_done(ctx, l2_len, p, frag_hook::EGRESS, &result);
    result
}

#[inline(always)]
fn reply(ctx: &TcContext, p: &Packet6) -> Result<Action, Drop> {
    let Some(entry) = maps::ct6_entry(&conntrack::reply_key(p)) else {
        return forwarded(ctx, p);
    };
    let ct = entry.get();
    if ct.flags & ct_flags::RETIRED != 0 {
        // A closed flow's reply tuple, only held (see `ct_flags::RETIRED`): passes as it is.
        return Ok(Action::pass(Counter::ReplyNotTracked));
    }
    conntrack::reply_passed(p, &entry, &ct, maps::now_ns());
    nat::snat(ctx, p, &ct.frontend_addr, ct.frontend_port)?;
    if ct.flags & ct_flags::SPORT_NAT != 0 {
        // The flow left with another source port (reply-tuple clash): back to the client's own.
        nat::dest_port(ctx, p, ct.nat_sport)?;
    }
    Ok(Action::pass(if ct.flags & ct_flags::DIRECT != 0 {
        Counter::DirectFlow
    } else {
        Counter::ReplyTranslated
    }))
}

/// Not a reply: maybe an external flow forwarded to a remote backend, to SNAT to the node in
/// the SNAT program (its own stack: the port allocation does not fit beside this one's).
///
/// The `out` lookup (a 40-byte key hashed) is skipped when no entry can be used: an entry is
/// written for a hairpin flow (the forwarded packet goes from a pod to itself) or on the
/// node's IPv6 address. With `::` in `NODE6_V1` (none, or the address left the node) flows
/// SNATed on a former address go out with their own source, as netfilter drops the
/// masquerade of flows whose address left the device; once an address is written again they
/// are SNATed again on the address they had (their entries stay until the sweep or the LRU
/// takes them).
#[inline(always)]
fn forwarded(ctx: &TcContext, p: &Packet6) -> Result<Action, Drop> {
    if p.saddr != p.daddr && maps::node6_unset() {
        log::untracked6(p.proto, (&p.saddr, p.sport), (&p.daddr, p.dport));
        return Ok(Action::pass(Counter::ReplyNotTracked));
    }
    let Some(s) = maps::snat6_scratch() else {
        return Ok(Action::pass(Counter::ReplyNotTracked));
    };
    if snat::out_entry_of_forwarded(p, s).is_none() && !snat::may_be_node_connection(p) {
        log::untracked6(p.proto, (&p.saddr, p.sport), (&p.daddr, p.dport));
        return Ok(Action::pass(Counter::ReplyNotTracked));
    }
    maps::tail_call6(ctx, TAIL_CALL_SNAT6, p.l2_len);
    Err(Drop::TailCall)
}

/// The SNAT program, tail-called by `tc_egress6`: parses again, rewrites the source of a
/// forwarded flow with an `out` entry to the node's address and port (allocated again if its
/// port was reclaimed after a long silence).
#[inline(always)]
pub fn try_egress_snat(ctx: &TcContext, l2_len: usize) -> Result<Action, Drop> {
    let Parsed6::Packet(p) = packet::parse(ctx, l2_len) else {
        return Err(Drop::TailCall);
    };
    let result = masquerade(ctx, p);
    frag::first_done(ctx, l2_len, p, frag_hook::EGRESS, &result);
    result
}

#[inline(always)]
fn masquerade(ctx: &TcContext, p: &Packet6) -> Result<Action, Drop> {
    let s = maps::snat6_scratch().ok_or(Drop::TailCall)?;
    let now = maps::now_ns();
    let snated = match snat::out_entry_of_forwarded(p, s) {
        Some(out) => snat::forwarded(ctx, p, out, s, now)?,
        None => snat::node_connection(ctx, p, s, now)?,
    };
    if !snated {
        return Ok(Action::pass(Counter::ReplyNotTracked));
    }
    nat::snat(ctx, p, &s.out.addr, s.out.port)?;
    Ok(Action::pass(Counter::SnatTranslated))
}
