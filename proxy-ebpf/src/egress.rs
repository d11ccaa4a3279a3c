//! tc egress: reverse NAT of replies (backend → frontend) for flows in conntrack.

use aya_ebpf::programs::TcContext;
use proxy_common::{Counter, ct_state};

use crate::{
    Action, Drop, conntrack, icmp, maps, nat,
    packet::{self, Parsed},
    snat, stats,
};

#[inline(always)]
pub fn try_tc_egress(ctx: &TcContext) -> Result<Action, Drop> {
    let p = match packet::parse(ctx) {
        Parsed::Packet(p) => p,
        Parsed::NotIpv4 => return Ok(Action::pass(Counter::NotIpv4)),
        Parsed::IcmpError(e) => return icmp::reply(ctx, &e),
        Parsed::Pass(Counter::NotService) => return Ok(Action::pass(Counter::ReplyNotTracked)),
        Parsed::Pass(counter) => return Ok(Action::pass(counter)),
        // A fragmented reply cannot be translated consistently (the later fragments carry no
        // ports and keep the backend's address); it is passed as it is.
        Parsed::Untranslatable {
            reason: Drop::Fragment,
            ..
        } => return Ok(Action::pass(Counter::FragmentPassed)),
        Parsed::Untranslatable { .. } => return Ok(Action::pass(Counter::MalformedPassed)),
    };
    if p.has_ip_options() {
        stats::count(Counter::IpOptions);
    }
    let now = maps::now_ns();
    let Some(entry) = maps::ct_entry(&conntrack::reply_key(&p)) else {
        // Not a reply: maybe an external flow forwarded to a remote backend, to SNAT.
        let Some(out) = maps::snat_entry(&snat::out_key_of_forwarded(&p)) else {
            return Ok(Action::pass(Counter::ReplyNotTracked));
        };
        let device = maps::snat_device_addr(packet::ifindex(ctx));
        let Some(node) = snat::forwarded(&p, out, now, device)? else {
            return Ok(Action::pass(Counter::ReplyNotTracked));
        };
        nat::snat_reply(ctx, &p, node.addr, node.port)?;
        return Ok(Action::pass(Counter::SnatTranslated));
    };
    let ct = entry.get();
    let state = conntrack::next_reply_state(&p, ct.state);
    entry.touch(now, state);
    // The flow is idle only when neither direction sends: refresh the ORIGINAL entry too, and
    // carry a FIN/RST from the backend over to it.
    if let Some(original) = maps::ct_entry(&conntrack::original_key_of_reply(&p, &ct)) {
        let orig_state = if state == ct_state::CLOSING {
            ct_state::CLOSING
        } else {
            original.get().state
        };
        original.touch(now, orig_state);
    }
    nat::snat_reply(ctx, &p, ct.frontend_addr, ct.frontend_port)?;
    Ok(Action::pass(Counter::ReplyTranslated))
}
