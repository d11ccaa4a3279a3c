//! tc egress: reverse NAT of replies (backend → frontend) for flows in conntrack.

use aya_ebpf::programs::TcContext;
use proxy_common::{Counter, TAIL_CALL_EGRESS6, ct_flags, frag_hook};

use crate::{
    Action, Drop, conntrack, frag, icmp, log, maps, nat,
    packet::{self, Parsed},
    snat, stats,
};

#[inline(always)]
pub fn try_tc_egress(ctx: &TcContext, l2_len: usize) -> Result<Action, Drop> {
    let p = match packet::parse(ctx, l2_len) {
        Parsed::Packet(p) => p,
        Parsed::Fragment(f) => return frag::later(ctx, &f, frag_hook::EGRESS),
        Parsed::NotIpv4 => return Ok(Action::pass(Counter::NotIpv4)),
        Parsed::Ipv6 => {
            maps::tail_call6(ctx, TAIL_CALL_EGRESS6, l2_len);
            return Ok(Action::pass(Counter::NotIpv4));
        }
        Parsed::IcmpError(e) => return icmp::reply(ctx, &e),
        Parsed::Pass(Counter::NotService) => return Ok(Action::pass(Counter::ReplyNotTracked)),
        Parsed::Pass(counter) => return Ok(Action::pass(counter)),
        Parsed::Untranslatable { .. } => return Ok(Action::pass(Counter::MalformedPassed)),
    };
    frag::first_seen(ctx, &p, frag_hook::EGRESS);
    if p.has_ip_options() {
        stats::count(Counter::IpOptions);
    }
    let now = maps::now_ns();
    let Some(entry) = maps::ct_entry(&conntrack::reply_key(&p)) else {
        // Not a reply: maybe an external flow forwarded to a remote backend, to SNAT (or a
        // connection of the node's own that would clash with one).
        let Some(node) = snat::egress(ctx, &p, now)? else {
            log::untracked(p.proto, (p.saddr, p.sport), (p.daddr, p.dport));
            return Ok(Action::pass(Counter::ReplyNotTracked));
        };
        nat::snat_reply(ctx, &p, node.addr, node.port)?;
        return Ok(Action::pass(Counter::SnatTranslated));
    };
    let ct = entry.get();
    if ct.flags & ct_flags::RETIRED != 0 {
        // A closed flow's reply tuple, only held (see `ct_flags::RETIRED`): like netfilter after
        // the flow's entry is gone, the packet passes as it is.
        return Ok(Action::pass(Counter::ReplyNotTracked));
    }
    if ct.flags & ct_flags::DIRECT == 0 {
        log::reply(
            ct.flags & ct_flags::SEEN_REPLY == 0,
            (p.saddr, p.sport),
            (p.daddr, p.dport),
            (ct.frontend_addr, ct.frontend_port),
        );
    }
    // The flow is idle only when neither direction sends: refresh the ORIGINAL entry too (or
    // write it again if it was evicted), carry a FIN/RST from the backend over to it, and mark
    // both as answered.
    conntrack::reply_passed(&p, &entry, &ct, now);
    nat::snat_reply(ctx, &p, ct.frontend_addr, ct.frontend_port)?;
    if ct.flags & ct_flags::SPORT_NAT != 0 {
        nat::dest_port(ctx, &p, ct.nat_sport)?;
    }
    Ok(Action::pass(if ct.flags & ct_flags::DIRECT != 0 {
        Counter::DirectFlow
    } else {
        Counter::ReplyTranslated
    }))
}
