//! Address/port rewrites with incremental checksum updates.
//!
//! Order per field: fix the L4 checksum (the address is part of its pseudo-header:
//! `BPF_F_PSEUDO_HDR`), fix the IPv4 header checksum, then store the new bytes. UDP uses
//! `BPF_F_MARK_MANGLED_0`: a zero UDP checksum ("none") stays zero, and a computed zero is
//! written as 0xffff. The helpers also keep `skb->csum` right for CHECKSUM_COMPLETE and only
//! adjust the pseudo-header part for CHECKSUM_PARTIAL; no checksum is ever zeroed or recomputed.
//! The one change no checksum absorbs is a port rewrite of a UDP datagram without a checksum:
//! its store adds the change to `skb->csum` itself (`BPF_F_RECOMPUTE_CSUM`).
//! SCTP has no L4 checksum over the addresses: its port rewrites update the CRC32c (`sctp.rs`).

use aya_ebpf::{
    bindings::{BPF_F_MARK_MANGLED_0, BPF_F_PSEUDO_HDR, BPF_F_RECOMPUTE_CSUM},
    programs::TcContext,
};

use crate::{
    Drop,
    packet::{Packet, read},
    sctp,
};

/// DNAT: destination → backend.
#[inline(always)]
pub fn dnat(ctx: &TcContext, p: &Packet, addr: [u8; 4], port: [u8; 2]) -> Result<(), Drop> {
    rewrite(
        ctx,
        p,
        p.daddr_off(),
        p.daddr,
        addr,
        p.l4_off() + 2,
        p.dport,
        port,
    )
}

/// Source rewrite: reverse NAT of a reply (source → frontend), or SNAT of a forwarded external
/// flow (source → node address and port).
#[inline(always)]
pub fn snat_reply(ctx: &TcContext, p: &Packet, addr: [u8; 4], port: [u8; 2]) -> Result<(), Drop> {
    rewrite(
        ctx,
        p,
        p.saddr_off(),
        p.saddr,
        addr,
        p.l4_off(),
        p.sport,
        port,
    )
}

/// Source port only (a reply-tuple clash moved the flow to another port).
#[inline(always)]
pub fn source_port(ctx: &TcContext, p: &Packet, port: [u8; 2]) -> Result<(), Drop> {
    rewrite(
        ctx,
        p,
        p.saddr_off(),
        p.saddr,
        p.saddr,
        p.l4_off(),
        p.sport,
        port,
    )
}

/// Destination port only (a reply going back to the client's own port after a clash).
#[inline(always)]
pub fn dest_port(ctx: &TcContext, p: &Packet, port: [u8; 2]) -> Result<(), Drop> {
    rewrite(
        ctx,
        p,
        p.daddr_off(),
        p.daddr,
        p.daddr,
        p.l4_off() + 2,
        p.dport,
        port,
    )
}

#[expect(
    clippy::too_many_arguments,
    reason = "one address and one port, each old/new at an offset"
)]
#[inline(always)]
fn rewrite(
    ctx: &TcContext,
    p: &Packet,
    addr_off: usize,
    old_addr: [u8; 4],
    new_addr: [u8; 4],
    port_off: usize,
    old_port: [u8; 2],
    new_port: [u8; 2],
) -> Result<(), Drop> {
    if p.is_sctp() {
        return rewrite_sctp(
            ctx, p, addr_off, old_addr, new_addr, port_off, old_port, new_port,
        );
    }
    let csum_off = p.l4_csum_off();
    let mangled = if p.is_tcp() {
        0
    } else {
        BPF_F_MARK_MANGLED_0 as u64
    };
    if old_addr != new_addr {
        let from = u32::from_ne_bytes(old_addr) as u64;
        let to = u32::from_ne_bytes(new_addr) as u64;
        ctx.l4_csum_replace(csum_off, from, to, BPF_F_PSEUDO_HDR as u64 | mangled | 4)
            .map_err(|_| Drop::RewriteFailed)?;
        ctx.l3_csum_replace(p.ip_csum_off(), from, to, 4)
            .map_err(|_| Drop::RewriteFailed)?;
        ctx.store(addr_off, &new_addr, 0)
            .map_err(|_| Drop::RewriteFailed)?;
    }
    if old_port != new_port {
        let from = u16::from_ne_bytes(old_port) as u64;
        let to = u16::from_ne_bytes(new_port) as u64;
        ctx.l4_csum_replace(csum_off, from, to, mangled | 2)
            .map_err(|_| Drop::RewriteFailed)?;
        // A UDP checksum of 0 ("none") stayed 0: nothing absorbed the port's change.
        let unsummed = mangled != 0 && read::<2>(ctx, csum_off) == Some([0, 0]);
        let store_flags = if unsummed {
            BPF_F_RECOMPUTE_CSUM as u64
        } else {
            0
        };
        ctx.store(port_off, &new_port, store_flags)
            .map_err(|_| Drop::RewriteFailed)?;
    }
    Ok(())
}

/// [`rewrite`] for SCTP: the IPv4 header checksum for the address, the CRC32c for the port.
#[expect(
    clippy::too_many_arguments,
    reason = "one address and one port, each old/new at an offset"
)]
#[inline(always)]
fn rewrite_sctp(
    ctx: &TcContext,
    p: &Packet,
    addr_off: usize,
    old_addr: [u8; 4],
    new_addr: [u8; 4],
    port_off: usize,
    old_port: [u8; 2],
    new_port: [u8; 2],
) -> Result<(), Drop> {
    replace_ip_addr(ctx, addr_off, p.ip_csum_off(), old_addr, new_addr)?;
    if old_port != new_port {
        sctp::rewrite_port(ctx, p.l4_off(), p.sctp_len, port_off, old_port, new_port)?;
    }
    Ok(())
}

/// Replace 4 bytes at `off` (an IPv4 address in an IPv4 header) and fix the 16-bit checksum of
/// that header at `csum_off` (no pseudo-header involved: used for outer addresses of ICMP errors
/// and for the IPv4 header quoted inside them).
#[inline(always)]
pub fn replace_ip_addr(
    ctx: &TcContext,
    off: usize,
    csum_off: usize,
    old: [u8; 4],
    new: [u8; 4],
) -> Result<(), Drop> {
    if old == new {
        return Ok(());
    }
    let from = u32::from_ne_bytes(old) as u64;
    let to = u32::from_ne_bytes(new) as u64;
    ctx.l3_csum_replace(csum_off, from, to, 4)
        .map_err(|_| Drop::RewriteFailed)?;
    ctx.store(off, &new, 0).map_err(|_| Drop::RewriteFailed)
}

/// Replace a port quoted inside an ICMP error and fix the ICMP checksum at `icmp_csum_off`.
#[inline(always)]
pub fn replace_quoted_port(
    ctx: &TcContext,
    off: usize,
    icmp_csum_off: usize,
    old: [u8; 2],
    new: [u8; 2],
) -> Result<(), Drop> {
    if old == new {
        return Ok(());
    }
    let from = u16::from_ne_bytes(old) as u64;
    let to = u16::from_ne_bytes(new) as u64;
    ctx.l4_csum_replace(icmp_csum_off, from, to, 2)
        .map_err(|_| Drop::RewriteFailed)?;
    ctx.store(off, &new, 0).map_err(|_| Drop::RewriteFailed)
}
