//! IPv6 address/port rewrites with incremental checksum updates.
//!
//! IPv6 has no header checksum: an address change only moves the L4 checksum, whose
//! pseudo-header holds both 128-bit addresses. The difference of the old and new address is
//! summed once (`bpf_csum_diff`) and applied with `bpf_l4_csum_replace` in its "by difference"
//! mode with `BPF_F_PSEUDO_HDR` (which touches only the pseudo-header part for
//! CHECKSUM_PARTIAL), as cilium does.
//!
//! On a CHECKSUM_COMPLETE skb (`skb->csum` sums the packet, as NICs that checksum what they
//! receive deliver it) that helper also takes the checksum field's change out of `skb->csum`,
//! which is right for IPv4, whose header checksum absorbs the address change, and wrong by
//! exactly the address change for IPv6, where nothing does. The address is therefore stored
//! with `BPF_F_RECOMPUTE_CSUM`, which adds its change to `skb->csum` (Linux ≥ 6.16 offers
//! `BPF_F_IPV6` to skip the helper's adjustment instead; this works on every kernel). Left
//! wrong, the receiver reports "hw csum failure" and sums each packet again in software. UDP uses
//! `BPF_F_MARK_MANGLED_0` so a computed zero is written as 0xffff: 0 is no valid UDP checksum on
//! IPv6 (datagrams that arrive with 0 are never translated, `ipv6::packet`).
//!
//! SCTP has no pseudo-header: an address rewrite moves no checksum (the store keeps `skb->csum`
//! right with `BPF_F_RECOMPUTE_CSUM`), a port rewrite updates the CRC32c (`crate::sctp`, shared
//! with IPv4).

use aya_ebpf::{
    bindings::{BPF_F_MARK_MANGLED_0, BPF_F_PSEUDO_HDR, BPF_F_RECOMPUTE_CSUM},
    helpers::bpf_csum_diff,
    programs::TcContext,
};

use super::packet::Packet6;
use crate::{Drop, sctp};

/// One's-complement difference of two 16-byte addresses, for the checksum helpers.
#[inline(always)]
pub fn addr_diff(old: &[u8; 16], new: &[u8; 16]) -> Result<u64, Drop> {
    let mut from = words(old);
    let mut to = words(new);
    // SAFETY: both buffers are 16-byte stack arrays of u32, as the helper's sizes say; it only
    // reads them.
    let diff = unsafe { bpf_csum_diff(from.as_mut_ptr(), 16, to.as_mut_ptr(), 16, 0) };
    if diff < 0 {
        return Err(Drop::RewriteFailed);
    }
    Ok(diff as u32 as u64)
}

#[inline(always)]
fn words(a: &[u8; 16]) -> [u32; 4] {
    [
        u32::from_ne_bytes([a[0], a[1], a[2], a[3]]),
        u32::from_ne_bytes([a[4], a[5], a[6], a[7]]),
        u32::from_ne_bytes([a[8], a[9], a[10], a[11]]),
        u32::from_ne_bytes([a[12], a[13], a[14], a[15]]),
    ]
}

/// DNAT: destination → backend.
#[inline(always)]
pub fn dnat(ctx: &TcContext, p: &Packet6, addr: &[u8; 16], port: [u8; 2]) -> Result<(), Drop> {
    rewrite(
        ctx,
        p,
        p.daddr_off(),
        &p.daddr,
        addr,
        p.l4_off + 2,
        p.dport,
        port,
    )
}

/// Source rewrite: reverse NAT of a reply (source → frontend).
#[inline(always)]
pub fn snat(ctx: &TcContext, p: &Packet6, addr: &[u8; 16], port: [u8; 2]) -> Result<(), Drop> {
    rewrite(
        ctx,
        p,
        p.saddr_off(),
        &p.saddr,
        addr,
        p.l4_off,
        p.sport,
        port,
    )
}

/// Source port only (a flow moved away from a clashing reply tuple).
#[inline(always)]
pub fn source_port(ctx: &TcContext, p: &Packet6, port: [u8; 2]) -> Result<(), Drop> {
    rewrite_port(ctx, p, p.l4_off, p.sport, port)
}

/// Destination port only (a reply put back to the client's own port).
#[inline(always)]
pub fn dest_port(ctx: &TcContext, p: &Packet6, port: [u8; 2]) -> Result<(), Drop> {
    rewrite_port(ctx, p, p.l4_off + 2, p.dport, port)
}

/// The L4 checksum flags of a rewrite: UDP's 0 is written as 0xffff.
#[inline(always)]
fn mangled(p: &Packet6) -> u64 {
    if p.is_tcp() {
        0
    } else {
        BPF_F_MARK_MANGLED_0 as u64
    }
}

#[inline(always)]
fn rewrite_port(
    ctx: &TcContext,
    p: &Packet6,
    port_off: usize,
    old_port: [u8; 2],
    new_port: [u8; 2],
) -> Result<(), Drop> {
    if old_port == new_port {
        return Ok(());
    }
    if p.is_sctp() {
        return sctp::rewrite_port(ctx, p.l4_off, p.sctp_len, port_off, old_port, new_port);
    }
    let from = u16::from_ne_bytes(old_port) as u64;
    let to = u16::from_ne_bytes(new_port) as u64;
    ctx.l4_csum_replace(p.l4_csum_off(), from, to, mangled(p) | 2)
        .map_err(|_| Drop::RewriteFailed)?;
    ctx.store(port_off, &new_port, 0)
        .map_err(|_| Drop::RewriteFailed)
}

#[expect(
    clippy::too_many_arguments,
    reason = "one address and one port, each old/new at an offset"
)]
#[inline(always)]
fn rewrite(
    ctx: &TcContext,
    p: &Packet6,
    addr_off: usize,
    old_addr: &[u8; 16],
    new_addr: &[u8; 16],
    port_off: usize,
    old_port: [u8; 2],
    new_port: [u8; 2],
) -> Result<(), Drop> {
    if old_addr != new_addr && p.is_sctp() {
        ctx.store(addr_off, new_addr, BPF_F_RECOMPUTE_CSUM as u64)
            .map_err(|_| Drop::RewriteFailed)?;
    } else if old_addr != new_addr {
        let diff = addr_diff(old_addr, new_addr)?;
        // Size 0: `diff` is a checksum difference, not a 2/4-byte value.
        ctx.l4_csum_replace(
            p.l4_csum_off(),
            0,
            diff,
            BPF_F_PSEUDO_HDR as u64 | mangled(p),
        )
        .map_err(|_| Drop::RewriteFailed)?;
        ctx.store(addr_off, new_addr, BPF_F_RECOMPUTE_CSUM as u64)
            .map_err(|_| Drop::RewriteFailed)?;
    }
    rewrite_port(ctx, p, port_off, old_port, new_port)
}

/// Replace a 16-byte address at `off` that an ICMPv6 checksum at `csum_off` covers: in the
/// pseudo-header (`pseudo`: the outer addresses; the store keeps `skb->csum` right, see the
/// module doc) or in the message (the quoted packet's: its change and the checksum's cancel).
#[inline(always)]
pub fn replace_icmp_covered_addr(
    ctx: &TcContext,
    off: usize,
    csum_off: usize,
    old: [u8; 16],
    new: [u8; 16],
    pseudo: bool,
) -> Result<(), Drop> {
    if old == new {
        return Ok(());
    }
    let diff = addr_diff(&old, &new)?;
    let (csum_flags, store_flags) = if pseudo {
        (BPF_F_PSEUDO_HDR as u64, BPF_F_RECOMPUTE_CSUM as u64)
    } else {
        (0, 0)
    };
    ctx.l4_csum_replace(csum_off, 0, diff, csum_flags)
        .map_err(|_| Drop::RewriteFailed)?;
    ctx.store(off, &new, store_flags)
        .map_err(|_| Drop::RewriteFailed)
}

/// Replace a 16-byte address that no checksum covers (a later fragment: no L4 header in it, and
/// the first fragment's checksum update covers the whole datagram); `skb->csum` follows it.
#[inline(always)]
pub fn replace_bare_addr(
    ctx: &TcContext,
    off: usize,
    old: [u8; 16],
    new: [u8; 16],
) -> Result<(), Drop> {
    if old == new {
        return Ok(());
    }
    ctx.store(off, &new, BPF_F_RECOMPUTE_CSUM as u64)
        .map_err(|_| Drop::RewriteFailed)
}
