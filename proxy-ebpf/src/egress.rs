//! tc egress: reverse NAT of replies (backend → frontend) for flows in conntrack.

use aya_ebpf::programs::TcContext;
use proxy_common::{Counter, ct_flags, ct_state, frag_hook};

use crate::{
    Action, Drop, conntrack, frag, icmp, maps, nat,
    packet::{self, Parsed},
    snat, stats,
};

#[inline(always)]
pub fn try_tc_egress(ctx: &TcContext) -> Result<Action, Drop> {
    let p = match packet::parse(ctx) {
        Parsed::Packet(p) => p,
        Parsed::Fragment(f) => return frag::later(ctx, &f, frag_hook::EGRESS),
        Parsed::NotIpv4 => return Ok(Action::pass(Counter::NotIpv4)),
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
        // Not a reply: maybe an external flow forwarded to a remote backend, to SNAT.
        let Some(out) = maps::snat_entry(&snat::out_key_of_forwarded(&p)) else {
            return Ok(Action::pass(Counter::ReplyNotTracked));
        };
        let Some(node) = snat::forwarded(&p, out, now)? else {
            return Ok(Action::pass(Counter::ReplyNotTracked));
        };
        nat::snat_reply(ctx, &p, node.addr, node.port)?;
        return Ok(Action::pass(Counter::SnatTranslated));
    };
    let ct = entry.get();
    let state = conntrack::next_reply_state(&p, ct.state);
    entry.touch(now, state);
    // The flow is idle only when neither direction sends: refresh the ORIGINAL entry too, and
    // carry a FIN/RST from the backend over to it; write it again if LRU evicted it, so the
    // client's next packet keeps this backend.
    let reply_key = conntrack::reply_key(&p);
    let original_key = conntrack::original_key_of(&reply_key, &ct);
    match maps::ct_entry(&original_key) {
        Some(original) => {
            let orig_state = if state == ct_state::CLOSING {
                ct_state::CLOSING
            } else {
                original.get().state
            };
            original.touch(now, orig_state);
        }
        None => {
            let mut value = conntrack::original_value_of(p.dport, &ct);
            value.last_seen_ns = now;
            value.state = state;
            if maps::ct_insert_new(&original_key, &value).is_ok() {
                stats::count(Counter::ConntrackRestored);
            }
        }
    }
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
