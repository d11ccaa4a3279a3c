//! IPv6 tc egress: reverse NAT of replies (backend → frontend) for flows in `CONNTRACK6_V1`, and
//! of ICMPv6 errors about them (`icmp`).

use aya_ebpf::programs::TcContext;
use proxy_common::{Counter, ct_flags, frag_hook};

use super::{
    conntrack, frag, icmp, nat,
    packet::{self, Packet6, Parsed6},
};
use crate::{Action, Drop, maps, stats};

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
        return Ok(Action::pass(Counter::ReplyNotTracked));
    };
    let ct = entry.get();
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
