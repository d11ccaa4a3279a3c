//! IPv6 answers built in place from the offending packet and sent back out of the interface it
//! came in on, from the frontend to the client, as for IPv4 (`crate::reject`, whose rules they
//! share: Ethernet devices only, rate limited per CPU):
//! - ICMPv6 destination unreachable, code 4 (port unreachable), for a new flow to a Service
//!   without endpoints (TCP and UDP, as upstream's `icmp6-port-unreachable` reject). It quotes
//!   the IPv6 header, its extension headers and the first 8 bytes of the TCP/UDP header: enough
//!   for the client's stack to find the socket (RFC 4443 allows less than the 1280-byte
//!   maximum); a header chain longer than [`QUOTE_MAX`] is dropped instead.
//! - TCP RST for a segment of a flow whose backend is gone.
//!
//! Checksums are computed in full (the packets are new), sums in native byte order as in
//! `crate::reject`.

use aya_ebpf::{bindings::BPF_F_RECOMPUTE_CSUM, programs::TcContext};
use proxy_common::proto;

use super::packet::{ICMPV6, ICMPV6_HLEN, IPV6_HLEN, Packet6};
use crate::{
    Drop, maps,
    packet::{self, ETH_HLEN, TCP_HLEN, read, tcp_flags},
};

const ICMPV6_DEST_UNREACH: u8 = 1;
const ICMPV6_PORT_UNREACH: u8 = 4;
const HOP_LIMIT: u8 = 64;
/// L4 bytes quoted (as for IPv4: the first 64 bits).
const QUOTED_L4: usize = 8;
/// Most bytes quoted: the IPv6 header, extension headers and 8 (or 20) bytes of L4 header.
pub const QUOTE_MAX: usize = 240;

#[inline(always)]
fn fold(acc: u64) -> u16 {
    let a = (acc & 0xffff_ffff) + (acc >> 32);
    let a = (a & 0xffff) + (a >> 16);
    let a = (a & 0xffff) + (a >> 16);
    let a = (a & 0xffff) + (a >> 16);
    !(a as u16)
}

#[inline(always)]
fn sum<const N: usize>(bytes: &[u8; N]) -> u64 {
    let mut acc = 0u64;
    let mut i = 0;
    while i + 1 < N {
        acc += u16::from_ne_bytes([bytes[i], bytes[i + 1]]) as u64;
        i += 2;
    }
    acc
}

/// Partial sum of the pseudo-header (RFC 8200 8.1) of a packet from `src` to `dst`.
#[inline(always)]
fn pseudo_sum(src: &[u8; 16], dst: &[u8; 16], len: u32, next: u8) -> u64 {
    let l = len.to_be_bytes();
    sum(src) + sum(dst) + sum(&[l[0], l[1], l[2], l[3], 0, 0, 0, next])
}

/// Partial sum of the first `len` bytes of the IPv6 packet (a multiple of 4, ≤ [`QUOTE_MAX`]).
#[inline(always)]
fn sum_quoted(ctx: &TcContext, len: usize) -> Option<u64> {
    let mut acc = 0u64;
    let mut i = 0;
    while i < QUOTE_MAX / 4 {
        let off = i * 4;
        if off >= len {
            break;
        }
        acc += u32::from_ne_bytes(read::<4>(ctx, ETH_HLEN + off)?) as u64;
        i += 1;
    }
    Some(acc)
}

#[inline(always)]
fn ipv6_header(payload_len: u16, next: u8, src: &[u8; 16], dst: &[u8; 16]) -> [u8; IPV6_HLEN] {
    let l = payload_len.to_be_bytes();
    let mut h = [0u8; IPV6_HLEN];
    h[0] = 0x60;
    h[4] = l[0];
    h[5] = l[1];
    h[6] = next;
    h[7] = HOP_LIMIT;
    let mut i = 0;
    while i < 16 {
        h[8 + i] = src[i];
        h[24 + i] = dst[i];
        i += 1;
    }
    h
}

#[inline(always)]
fn swapped_macs(m: [u8; 12]) -> [u8; 12] {
    [
        m[6], m[7], m[8], m[9], m[10], m[11], m[0], m[1], m[2], m[3], m[4], m[5],
    ]
}

#[inline(always)]
fn store<const N: usize>(ctx: &TcContext, offset: usize, bytes: &[u8; N]) -> Result<(), Drop> {
    ctx.store(offset, bytes, BPF_F_RECOMPUTE_CSUM as u64)
        .map_err(|_| Drop::RejectFailed)
}

/// Ethernet devices only, and within this CPU's answer budget.
#[inline(always)]
fn may_answer(p: &Packet6) -> Result<(), Drop> {
    if p.l2_len != ETH_HLEN {
        return Err(Drop::RejectFailed);
    }
    if !maps::reject_allowed(maps::now_ns()) {
        return Err(Drop::RejectRateLimited);
    }
    Ok(())
}

/// Turn the packet into an ICMPv6 port unreachable from the frontend to the client.
#[inline(always)]
pub fn port_unreachable(ctx: &TcContext, p: &Packet6) -> Result<i32, Drop> {
    may_answer(p)?;
    let macs = packet::macs(ctx).ok_or(Drop::RejectFailed)?;
    let chain = p.l4_off - ETH_HLEN;
    let mut quoted = chain + QUOTED_L4;
    if quoted > QUOTE_MAX - (TCP_HLEN - QUOTED_L4) {
        return Err(Drop::RejectFailed);
    }
    if packet::set_len(ctx, ETH_HLEN + quoted).is_err() {
        // CHECKSUM_PARTIAL TCP cannot be cut inside its checksum field (as for IPv4).
        if !p.is_tcp() {
            return Err(Drop::RejectFailed);
        }
        quoted = chain + TCP_HLEN;
        packet::set_len(ctx, ETH_HLEN + quoted).map_err(|_| Drop::RejectFailed)?;
    }
    let quoted_sum = sum_quoted(ctx, quoted).ok_or(Drop::RejectFailed)?;
    packet::adjust_after_eth(ctx, (IPV6_HLEN + ICMPV6_HLEN) as i32)
        .map_err(|_| Drop::RejectFailed)?;
    let len = (ICMPV6_HLEN + quoted) as u16;
    let ip = ipv6_header(len, ICMPV6, &p.daddr, &p.saddr);
    let mut icmp = [ICMPV6_DEST_UNREACH, ICMPV6_PORT_UNREACH, 0, 0, 0, 0, 0, 0];
    let c = fold(pseudo_sum(&p.daddr, &p.saddr, len as u32, ICMPV6) + sum(&icmp) + quoted_sum)
        .to_ne_bytes();
    icmp[2] = c[0];
    icmp[3] = c[1];
    store(ctx, 0, &swapped_macs(macs))?;
    store(ctx, ETH_HLEN, &ip)?;
    store(ctx, ETH_HLEN + IPV6_HLEN, &icmp)?;
    Ok(packet::redirect_back(ctx))
}

/// Turn a TCP packet into a RST from the frontend to the client (RFC 9293 reset generation).
#[inline(always)]
pub fn tcp_reset(ctx: &TcContext, p: &Packet6) -> Result<i32, Drop> {
    may_answer(p)?;
    let macs = packet::macs(ctx).ok_or(Drop::RejectFailed)?;
    let (seq, ack, flags) = if p.tcp_flags & tcp_flags::ACK != 0 {
        (p.tcp_ack, [0; 4], tcp_flags::RST)
    } else {
        let mut len = p.tcp_payload_len;
        if p.tcp_flags & tcp_flags::SYN != 0 {
            len += 1;
        }
        if p.tcp_flags & tcp_flags::FIN != 0 {
            len += 1;
        }
        let ack = u32::from_be_bytes(p.tcp_seq)
            .wrapping_add(len)
            .to_be_bytes();
        ([0; 4], ack, tcp_flags::RST | tcp_flags::ACK)
    };
    // Keep the header chain and 20 bytes of TCP header, then drop the extension headers.
    let ext = p.l4_off - ETH_HLEN - IPV6_HLEN;
    packet::set_len(ctx, p.l4_off + TCP_HLEN).map_err(|_| Drop::RejectFailed)?;
    if ext != 0 {
        packet::adjust_after_eth(ctx, -(ext as i32)).map_err(|_| Drop::RejectFailed)?;
    }
    let ip = ipv6_header(TCP_HLEN as u16, proto::TCP, &p.daddr, &p.saddr);
    let mut tcp = [
        p.dport[0], p.dport[1], p.sport[0], p.sport[1], seq[0], seq[1], seq[2], seq[3], ack[0],
        ack[1], ack[2], ack[3], 0x50, flags, 0, 0, 0, 0, 0, 0,
    ];
    let c =
        fold(pseudo_sum(&p.daddr, &p.saddr, TCP_HLEN as u32, proto::TCP) + sum(&tcp)).to_ne_bytes();
    tcp[16] = c[0];
    tcp[17] = c[1];
    store(ctx, 0, &swapped_macs(macs))?;
    store(ctx, ETH_HLEN, &ip)?;
    store(ctx, ETH_HLEN + IPV6_HLEN, &tcp)?;
    Ok(packet::redirect_back(ctx))
}
