//! Reverse translation of ICMP errors (port unreachable, fragmentation needed, time exceeded)
//! about translated flows, like netfilter's related-ICMP NAT: the quoted packet is rewritten too,
//! so the client's stack matches the error to its socket.
//!
//! - tc egress toward the client: an error about client → backend (from the backend or a router
//!   on its path) is made to come from the frontend and to quote client → frontend.
//! - tc ingress from a remote backend: an error about node:port → backend (a SNATed flow) is
//!   sent on to the client and quotes client → backend; tc egress then does the step above.
//! - tc ingress from the client's side: an error about a reply as it left this node (quoting
//!   frontend:port → client: a router's Fragmentation Needed on the way back to the client, the
//!   client's port unreachable) is sent on to the backend and quotes the reply as the backend
//!   sent it (backend:port → client, or → the node's SNAT address and port), so the backend
//!   lowers its path MTU (netfilter: RELATED). Without it large responses through a NodePort or
//!   VIP stall behind a smaller-MTU hop.
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
    let key = reversed_quote(e, ct_dir::REPLY);
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

/// Ingress: an error about a SNATed flow's packet to its backend ([`snat_reply`]) or about a
/// reply on its way to a client ([`toward_backend`]); anything else passes.
#[inline(always)]
pub fn ingress(ctx: &TcContext, e: &IcmpError) -> Result<Action, Drop> {
    if crate::snat::may_be_snat(e.inner_sport, || maps::is_node_snat_addr(e.inner_saddr))
        && let Some(done) = snat_reply(ctx, e)
    {
        return done;
    }
    toward_backend(ctx, e)
}

/// An error about a translated flow's reply, quoting frontend:port → client: on to the backend,
/// quoting backend:port → the client as the backend knows it (its own address and port, the
/// source port a reply-tuple clash gave it, or the node's SNAT address and port).
#[inline(always)]
fn toward_backend(ctx: &TcContext, e: &IcmpError) -> Result<Action, Drop> {
    // The quoted packet is frontend → client: its flow's ORIGINAL entry is client → frontend.
    let key = reversed_quote(e, ct_dir::ORIGINAL);
    let Some(entry) = maps::ct_entry(&key) else {
        return Ok(Action::pass(Counter::NotService));
    };
    let ct = entry.get();
    if ct.flags & (ct_flags::DIRECT | ct_flags::NETFILTER) != 0 {
        // Not translated here: the error is already about the packet as the backend sent it.
        return Ok(Action::pass(Counter::NotService));
    }
    let client_port = if ct.flags & ct_flags::SPORT_NAT != 0 {
        ct.nat_sport
    } else {
        e.inner_dport
    };
    let out_key = SnatKey {
        saddr: e.inner_daddr,
        daddr: ct.backend_addr,
        sport: client_port,
        dport: ct.backend_port,
        proto: e.inner_proto,
        dir: ct_dir::ORIGINAL,
        _pad: [0; 2],
    };
    let (peer, peer_port) = match maps::snat_entry(&out_key) {
        Some(out) => {
            let v = out.get();
            (v.addr, v.port)
        }
        None => (e.inner_daddr, client_port),
    };
    let csum = e.icmp_csum_off();
    nat::replace_ip_addr(
        ctx,
        e.inner_saddr_off(),
        e.inner_csum_off(),
        e.inner_saddr,
        ct.backend_addr,
    )?;
    nat::replace_quoted_port(
        ctx,
        e.inner_sport_off(),
        csum,
        e.inner_sport,
        ct.backend_port,
    )?;
    nat::replace_ip_addr(
        ctx,
        e.inner_daddr_off(),
        e.inner_csum_off(),
        e.inner_daddr,
        peer,
    )?;
    nat::replace_quoted_port(ctx, e.inner_dport_off(), csum, e.inner_dport, peer_port)?;
    nat::replace_ip_addr(
        ctx,
        e.daddr_off(),
        e.ip_csum_off(),
        e.daddr,
        ct.backend_addr,
    )?;
    Ok(Action::pass(Counter::IcmpErrorTranslated))
}

/// An error about a SNATed flow (quoting node:port → backend), back to the client. `None`: no
/// SNATed flow holds that port.
#[inline(always)]
fn snat_reply(ctx: &TcContext, e: &IcmpError) -> Option<Result<Action, Drop>> {
    let key = reversed_quote(e, ct_dir::REPLY);
    let entry = maps::snat_entry(&key)?;
    let client = entry.get();
    Some(snat_reply_to(ctx, e, &client))
}

#[inline(always)]
fn snat_reply_to(
    ctx: &TcContext,
    e: &IcmpError,
    client: &proxy_common::SnatValue,
) -> Result<Action, Drop> {
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

/// The key of the quoted packet's other direction (its source and destination swapped), tagged
/// `dir`: conntrack and SNAT keys alike.
#[inline(always)]
fn reversed_quote(e: &IcmpError, dir: u8) -> CtKey {
    CtKey {
        saddr: e.inner_daddr,
        daddr: e.inner_saddr,
        sport: e.inner_dport,
        dport: e.inner_sport,
        proto: e.inner_proto,
        dir,
        _pad: [0; 2],
    }
}
