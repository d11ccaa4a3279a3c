//! Answers built in place from the offending packet and sent back out of the interface it came
//! in on: ICMP port unreachable (Service without endpoints) and TCP RST (flow whose backend is
//! gone). Both swap the MACs and the addresses, so the client sees them come from the frontend.
//! On an L3 device (ipip/tunl0, gre, WireGuard: no MACs) no answer is built and the packet is
//! dropped (`Drop::RejectFailed`): sending back out of an NBMA tunnel such as tunl0 needs a route
//! to the peer that a redirect from ingress does not have, and a Service-addressed packet that
//! still needs an answer rarely arrives through a tunnel (pods' flows are translated on their own
//! node).
//! Both are rate-limited per CPU (`proxy_common::ratelimit`): over the budget the packet is
//! dropped instead (`Drop::RejectRateLimited`).
//!
//! Checksums are computed in full here (the packets are new), over values copied to the stack or
//! summed from the packet before its shape changes; sums are in native byte order throughout and
//! stored with `to_ne_bytes`, which the one's-complement sum allows.

use aya_ebpf::{bindings::BPF_F_RECOMPUTE_CSUM, programs::TcContext};
use proxy_common::proto;

use crate::{
    Drop, maps,
    packet::{self, ETH_HLEN, IPV4_HLEN, Packet, TCP_HLEN, tcp_flags},
};

const ICMP_HLEN: usize = 8;
const ICMP_DEST_UNREACH: u8 = 3;
const ICMP_PORT_UNREACH: u8 = 3;
/// TOS of ICMP errors, as Linux sends them (precedence "internetwork control").
const ICMP_TOS: u8 = 0xc0;
const TTL: u8 = 64;
/// L4 bytes quoted in an ICMP error (RFC 792: the IP header and the first 64 bits).
const QUOTED_L4: usize = 8;

/// Fold a partial sum into a 16-bit one's-complement checksum.
#[inline(always)]
fn fold(acc: u64) -> u16 {
    let a = (acc & 0xffff_ffff) + (acc >> 32);
    let a = (a & 0xffff) + (a >> 16);
    let a = (a & 0xffff) + (a >> 16);
    let a = (a & 0xffff) + (a >> 16);
    !(a as u16)
}

/// Partial sum of a stack buffer of even length, native byte order.
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

/// A 20-byte IPv4 header without options, checksum filled in.
#[inline(always)]
fn ipv4_header(
    tos: u8,
    tot_len: u16,
    proto: u8,
    saddr: [u8; 4],
    daddr: [u8; 4],
) -> [u8; IPV4_HLEN] {
    let len = tot_len.to_be_bytes();
    let mut h = [
        0x45, tos, len[0], len[1], 0, 0, 0x40, 0, TTL, proto, 0, 0, saddr[0], saddr[1], saddr[2],
        saddr[3], daddr[0], daddr[1], daddr[2], daddr[3],
    ];
    let c = fold(sum(&h)).to_ne_bytes();
    h[10] = c[0];
    h[11] = c[1];
    h
}

/// Ethernet source/destination swapped (the EtherType stays IPv4).
#[inline(always)]
fn swapped_macs(macs: [u8; 12]) -> [u8; 12] {
    [
        macs[6], macs[7], macs[8], macs[9], macs[10], macs[11], macs[0], macs[1], macs[2], macs[3],
        macs[4], macs[5],
    ]
}

#[inline(always)]
fn store<const N: usize>(ctx: &TcContext, offset: usize, bytes: &[u8; N]) -> Result<(), Drop> {
    ctx.store(offset, bytes, BPF_F_RECOMPUTE_CSUM as u64)
        .map_err(|_| Drop::RejectFailed)
}

/// Answers are built on Ethernet devices only (module docs).
#[inline(always)]
fn ethernet(p: &Packet) -> Result<(), Drop> {
    if p.l2_len == ETH_HLEN {
        Ok(())
    } else {
        Err(Drop::RejectFailed)
    }
}

/// One more generated answer fits this CPU's budget (taken now), else the packet is dropped.
#[inline(always)]
fn within_budget() -> Result<(), Drop> {
    if maps::reject_allowed(maps::now_ns()) {
        Ok(())
    } else {
        Err(Drop::RejectRateLimited)
    }
}

/// Turn the packet into an ICMP port unreachable from the frontend to the client, quoting the
/// original IPv4 header (with options) and the first 8 bytes of its TCP/UDP header.
#[inline(always)]
pub fn icmp_port_unreachable(ctx: &TcContext, p: &Packet) -> Result<i32, Drop> {
    ethernet(p)?;
    within_budget()?;
    let macs = packet::macs(ctx).ok_or(Drop::RejectFailed)?;
    let mut quoted = p.ip_hlen + QUOTED_L4;
    if packet::set_len(ctx, ETH_HLEN + quoted).is_err() {
        // A CHECKSUM_PARTIAL TCP packet (from a local socket) cannot be cut inside its checksum
        // field; quote its whole basic header instead (RFC 1812 allows quoting more).
        if !p.is_tcp() {
            return Err(Drop::RejectFailed);
        }
        quoted = p.ip_hlen + TCP_HLEN;
        packet::set_len(ctx, ETH_HLEN + quoted).map_err(|_| Drop::RejectFailed)?;
    }
    let quoted_sum = packet::sum_l3_prefix(ctx, ETH_HLEN, quoted).ok_or(Drop::RejectFailed)?;
    packet::adjust_after_eth(ctx, (IPV4_HLEN + ICMP_HLEN) as i32)
        .map_err(|_| Drop::RejectFailed)?;

    let ip = ipv4_header(
        ICMP_TOS,
        (IPV4_HLEN + ICMP_HLEN + quoted) as u16,
        proto::ICMP,
        p.daddr,
        p.saddr,
    );
    let mut icmp = [ICMP_DEST_UNREACH, ICMP_PORT_UNREACH, 0, 0, 0, 0, 0, 0];
    let c = fold(sum(&icmp) + quoted_sum).to_ne_bytes();
    icmp[2] = c[0];
    icmp[3] = c[1];
    store(ctx, 0, &swapped_macs(macs))?;
    store(ctx, ETH_HLEN, &ip)?;
    store(ctx, ETH_HLEN + IPV4_HLEN, &icmp)?;
    Ok(packet::redirect_back(ctx))
}

/// Turn a TCP packet into a RST from the frontend to the client (RFC 793 reset generation).
#[inline(always)]
pub fn tcp_reset(ctx: &TcContext, p: &Packet) -> Result<i32, Drop> {
    ethernet(p)?;
    within_budget()?;
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
    // Keep the IPv4 header and 20 bytes of TCP header, then drop the IPv4 options.
    packet::set_len(ctx, ETH_HLEN + p.ip_hlen + TCP_HLEN).map_err(|_| Drop::RejectFailed)?;
    if p.has_ip_options() {
        packet::adjust_after_eth(ctx, IPV4_HLEN as i32 - p.ip_hlen as i32)
            .map_err(|_| Drop::RejectFailed)?;
    }
    let ip = ipv4_header(
        0,
        (IPV4_HLEN + TCP_HLEN) as u16,
        proto::TCP,
        p.daddr,
        p.saddr,
    );
    let mut tcp = [
        p.dport[0], p.dport[1], p.sport[0], p.sport[1], seq[0], seq[1], seq[2], seq[3], ack[0],
        ack[1], ack[2], ack[3], 0x50, flags, 0, 0, 0, 0, 0, 0,
    ];
    let pseudo = [
        p.daddr[0],
        p.daddr[1],
        p.daddr[2],
        p.daddr[3],
        p.saddr[0],
        p.saddr[1],
        p.saddr[2],
        p.saddr[3],
        0,
        proto::TCP,
        0,
        TCP_HLEN as u8,
    ];
    let c = fold(sum(&pseudo) + sum(&tcp)).to_ne_bytes();
    tcp[16] = c[0];
    tcp[17] = c[1];
    store(ctx, 0, &swapped_macs(macs))?;
    store(ctx, ETH_HLEN, &ip)?;
    store(ctx, ETH_HLEN + IPV4_HLEN, &tcp)?;
    Ok(packet::redirect_back(ctx))
}
