//! Reverse translation of ICMPv6 errors (destination unreachable, packet too big, time exceeded,
//! parameter problem) about translated flows, on tc egress toward the client: an error about
//! client → backend (from the backend, or a router on its path: Packet Too Big above all, so
//! that PMTU discovery works through a VIP) is made to come from the frontend and to quote
//! client → frontend, as for IPv4 (`crate::icmp`).
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
};
use crate::{Action, Drop, maps, nat::replace_quoted_port};

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
