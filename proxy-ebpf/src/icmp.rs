//! Reverse translation of ICMP errors (port unreachable, fragmentation needed, time exceeded)
//! about translated flows, like netfilter's related-ICMP NAT: the quoted packet is rewritten too,
//! so the client's stack matches the error to its socket.
//!
//! - tc egress toward the client: an error about client → backend (from the backend or a router
//!   on its path) is made to come from the frontend and to quote client → frontend.
//! - tc ingress from a remote backend: an error about node:port → backend (a SNATed flow) is
//!   sent on to the client and quotes client → backend; tc egress then does the step above.
//!
//! Checksums: each rewritten address is paired with its IPv4 header checksum (outer, or the quoted
//! one), so the ICMP checksum, which covers the quoted header, needs no change for them; a quoted
//! port change is applied to the ICMP checksum. The quoted TCP/UDP checksum is left as it is (it
//! may be cut off, and receivers do not verify it).

use aya_ebpf::programs::TcContext;
use proxy_common::{Counter, CtKey, SnatKey, ct_dir, ct_flags};

use crate::{Action, Drop, maps, nat, packet::IcmpError};

/// Egress: an error about a DNATed flow, on its way to the client.
#[inline(always)]
pub fn reply(ctx: &TcContext, e: &IcmpError) -> Result<Action, Drop> {
    // The quoted packet is client → backend: its REPLY entry is backend → client.
    let key = CtKey {
        saddr: e.inner_daddr,
        daddr: e.inner_saddr,
        sport: e.inner_dport,
        dport: e.inner_sport,
        proto: e.inner_proto,
        dir: ct_dir::REPLY,
        _pad: [0; 2],
    };
    let Some(entry) = maps::ct_entry(&key) else {
        return Ok(Action::pass(Counter::ReplyNotTracked));
    };
    let ct = entry.get();
    nat::replace_ip_addr(
        ctx,
        e.inner_daddr_off(),
        e.inner_csum_off(),
        e.inner_daddr,
        ct.frontend_addr,
    )?;
    nat::replace_quoted_port(
        ctx,
        e.inner_dport_off(),
        e.icmp_csum_off(),
        e.inner_dport,
        ct.frontend_port,
    )?;
    if ct.flags & ct_flags::SPORT_NAT != 0 {
        // The flow left with another source port (reply-tuple clash): quote the client's own.
        nat::replace_quoted_port(
            ctx,
            e.inner_sport_off(),
            e.icmp_csum_off(),
            e.inner_sport,
            ct.nat_sport,
        )?;
    }
    nat::replace_ip_addr(
        ctx,
        e.saddr_off(),
        e.ip_csum_off(),
        e.saddr,
        ct.frontend_addr,
    )?;
    Ok(Action::pass(Counter::IcmpErrorTranslated))
}

/// Ingress: an error about a SNATed flow (quoting node:port → backend), back to the client.
#[inline(always)]
pub fn snat_reply(ctx: &TcContext, e: &IcmpError) -> Result<Action, Drop> {
    if !crate::snat::may_be_snat(e.inner_sport, || maps::is_node_snat_addr(e.inner_saddr)) {
        return Ok(Action::pass(Counter::NotService));
    }
    let key = SnatKey {
        saddr: e.inner_daddr,
        daddr: e.inner_saddr,
        sport: e.inner_dport,
        dport: e.inner_sport,
        proto: e.inner_proto,
        dir: ct_dir::REPLY,
        _pad: [0; 2],
    };
    let Some(entry) = maps::snat_entry(&key) else {
        return Ok(Action::pass(Counter::NotService));
    };
    let client = entry.get();
    nat::replace_ip_addr(
        ctx,
        e.inner_saddr_off(),
        e.inner_csum_off(),
        e.inner_saddr,
        client.addr,
    )?;
    nat::replace_quoted_port(
        ctx,
        e.inner_sport_off(),
        e.icmp_csum_off(),
        e.inner_sport,
        client.port,
    )?;
    nat::replace_ip_addr(ctx, e.daddr_off(), e.ip_csum_off(), e.daddr, client.addr)?;
    Ok(Action::pass(Counter::IcmpErrorTranslated))
}
