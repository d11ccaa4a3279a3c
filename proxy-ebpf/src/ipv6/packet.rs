//! IPv6 packet parsing: the IPv6 header, a bounded walk over its extension headers, and the
//! TCP/UDP/SCTP or ICMPv6 header behind them, read once into copied values (through
//! `crate::packet::read`, which checks the bounds).
//!
//! Policy (what [`parse`] reports):
//! - extension headers: hop-by-hop (0), routing (43), destination options (60), fragment (44)
//!   and AH (51) are walked, at most `ipv6::MAX_EXT_HEADERS` of them, and kept as they are (the
//!   L4 offset is where the walk ends). A longer chain, ESP (50), or a header cut off by the end
//!   of the data → [`Parsed6::Pass`] with `Ipv6ExtUnparsed`: the ports cannot be read, so whether
//!   the packet is for a Service cannot be known; it is passed untouched (and a VIP is no
//!   address of the node's, so nothing answers it). No next header (59) and protocols other than
//!   TCP/UDP/SCTP/ICMPv6 → passed untouched (`NotService`);
//! - SCTP: the common header and the chunks' types read as TCP flags
//!   (`crate::sctp::packet_flags`, invalid bundles malformed), as for IPv4 (`crate::packet`); a first
//!   fragment (more fragments follow) → [`Parsed6::Untranslatable`] with `Drop::Fragment` (a
//!   port rewrite's CRC32c update needs the whole SCTP packet; SCTP sizes its packets to the
//!   path MTU), its later fragments pass untouched;
//! - fragments (fragment header): the first fragment (offset 0) carries the L4 header and is a
//!   [`Packet6`] with `frag_id` set (translated as usual, its outcome recorded in
//!   `FRAGMENTS6_V1`, `ipv6::frag`); a later one → [`Parsed6::Fragment`];
//! - truncated TCP/UDP header or an IPv6 payload length beyond the packet, when the ports can be
//!   read → [`Parsed6::Untranslatable`] (dropped if to a Service); a UDP checksum of 0, which
//!   IPv6 does not allow (RFC 8200 8.1; the receiver drops it), is untranslatable too: nothing
//!   in the incremental update could make it valid;
//! - ICMPv6 destination unreachable, packet too big, time exceeded and parameter problem (types
//!   1–4) quoting TCP/UDP/SCTP right after the quoted IPv6 header → [`Parsed6::IcmpError`]; every
//!   other ICMPv6 message (echo, neighbour discovery and router advertisements, 133–137) passes
//!   untouched;
//! - payload length 0 on a GSO packet (IPv6 BIG TCP) → the length is the skb's.

use aya_ebpf::programs::TcContext;
use proxy_common::{Counter, ipv6::MAX_EXT_HEADERS, proto};

use crate::{
    Drop, maps,
    packet::{self, ETH_HLEN, SCTP_HLEN, TCP_HLEN, UDP_HLEN, read, tcp_flags},
};

pub const IPV6_HLEN: usize = 40;
pub const ICMPV6: u8 = 58;
/// Offsets inside the IPv6 header.
const SADDR: usize = 8;
const DADDR: usize = 24;
/// Extension header numbers.
const HOP_BY_HOP: u8 = 0;
const ROUTING: u8 = 43;
const FRAGMENT: u8 = 44;
const ESP: u8 = 50;
const AH: u8 = 51;
const DEST_OPTS: u8 = 60;
/// Fragment header: offset bits of its 16-bit field (the low 3 bits are flags), and the M flag.
const FRAG_OFFSET_MASK: u16 = 0xfff8;
const FRAG_MORE: u16 = 1;
/// The SCTP common header and the first chunk's header (type, flags, length).
const SCTP_MIN_LEN: usize = SCTP_HLEN + 4;
/// ICMPv6 error types (RFC 4443): destination unreachable, packet too big, time exceeded,
/// parameter problem.
const ICMPV6_ERROR_MAX: u8 = 4;
pub const ICMPV6_HLEN: usize = 8;
/// The largest ICMPv6 header offset [`parse`] finds: Ethernet, the IPv6 header and
/// `MAX_EXT_HEADERS` extension headers of at most 2048 bytes each.
const ICMP_OFF_MAX: usize = 14 + IPV6_HLEN + MAX_EXT_HEADERS * 2048;
/// Enough for the Ethernet and IPv6 headers, a few extension headers and a TCP header.
const PULL_LEN: u32 = (ETH_HLEN + IPV6_HLEN + 64 + TCP_HLEN) as u32;

/// A TCP, UDP or SCTP over IPv6 packet, parsed once. Addresses and ports in network order; offsets are
/// frame offsets. Lives in the per-CPU scratch ([`Scratch6`]), never on the stack.
#[derive(Clone, Copy)]
pub struct Packet6 {
    /// `packet::ETH_HLEN` or `packet::NO_L2` (a constant of the program entry).
    pub l2_len: usize,
    /// Offset of the TCP/UDP header (after the extension headers).
    pub l4_off: usize,
    pub saddr: [u8; 16],
    pub daddr: [u8; 16],
    pub proto: u8,
    pub sport: [u8; 2],
    pub dport: [u8; 2],
    /// TCP flags (0 for UDP; for SCTP, its chunks as TCP flags: `crate::sctp::packet_flags`).
    pub tcp_flags: u8,
    pub tcp_seq: [u8; 4],
    pub tcp_ack: [u8; 4],
    pub tcp_payload_len: u32,
    /// SCTP packet length (common header + chunks: what its CRC32c covers); 0 for TCP/UDP.
    pub sctp_len: u16,
    /// Extension headers were walked before the L4 header.
    pub has_ext: bool,
    /// The first fragment of a datagram (fragment header with offset 0): `frag` names it.
    pub is_first_fragment: bool,
    pub frag: FragId,
}

/// What names a fragmented datagram besides its addresses: the fragment header's identification
/// and next header (the same in all its fragments).
#[derive(Clone, Copy)]
pub struct FragId {
    pub id: [u8; 4],
    pub nexthdr: u8,
}

/// Where [`parse`] puts what it read: one per CPU (`maps::scratch6`), so that the parsed headers
/// (about 200 bytes) take none of the programs' 512-byte stack. A program run parses once, and
/// only the variant [`parse`] returned is meaningful.
#[derive(Clone, Copy)]
pub struct Scratch6 {
    pub pkt: Packet6,
    pub icmp: Icmp6Error,
    pub frag: Fragment6,
}

impl Packet6 {
    #[inline(always)]
    pub const fn saddr_off(&self) -> usize {
        self.l2_len + SADDR
    }

    #[inline(always)]
    pub const fn daddr_off(&self) -> usize {
        self.l2_len + DADDR
    }

    #[inline(always)]
    pub const fn l4_csum_off(&self) -> usize {
        self.l4_off + if self.proto == proto::TCP { 16 } else { 6 }
    }

    #[inline(always)]
    pub const fn is_tcp(&self) -> bool {
        self.proto == proto::TCP
    }

    #[inline(always)]
    pub const fn is_sctp(&self) -> bool {
        self.proto == proto::SCTP
    }

    /// A TCP SYN without ACK, or an SCTP INIT: the first packet of a connection (UDP has no
    /// flags: never).
    #[inline(always)]
    pub const fn is_syn(&self) -> bool {
        self.tcp_flags & (tcp_flags::SYN | tcp_flags::ACK) == tcp_flags::SYN
    }

    /// Could this packet start a flow: a UDP datagram, a TCP SYN or an SCTP INIT?
    #[inline(always)]
    pub const fn may_open_flow(&self) -> bool {
        (!self.is_tcp() && !self.is_sctp()) || self.is_syn()
    }
}

/// An ICMPv6 error quoting a TCP/UDP over IPv6 packet.
#[derive(Clone, Copy)]
pub struct Icmp6Error {
    pub l2_len: usize,
    pub saddr: [u8; 16],
    pub daddr: [u8; 16],
    /// Offset of the ICMPv6 header.
    pub icmp_off: usize,
    pub inner_saddr: [u8; 16],
    pub inner_daddr: [u8; 16],
    /// The quoted IPv6 header's next header.
    pub inner_next: u8,
}

impl Icmp6Error {
    /// Whether `len` bytes at `off` lie inside the outer IPv6 packet (its payload length): the
    /// ICMPv6 checksum covers only those, bytes after them are a trailer the stack cuts off. Read
    /// with `bpf_skb_load_bytes` (scalars only: a packet-pointer read here made LLVM emit a
    /// pointer mask the verifier refuses).
    #[inline(always)]
    pub fn inside(&self, ctx: &TcContext, off: usize, len: usize) -> bool {
        match ctx.load::<[u8; 2]>(self.l2_len + 4) {
            Ok(plen) => off + len <= self.l2_len + IPV6_HLEN + u16::from_be_bytes(plen) as usize,
            Err(_) => false,
        }
    }
}

impl Icmp6Error {
    #[inline(always)]
    pub const fn saddr_off(&self) -> usize {
        self.l2_len + SADDR
    }

    #[inline(always)]
    pub const fn daddr_off(&self) -> usize {
        self.l2_len + DADDR
    }

    #[inline(always)]
    pub const fn icmp_csum_off(&self) -> usize {
        self.icmp_off + 2
    }

    #[inline(always)]
    const fn inner_off(&self) -> usize {
        self.icmp_off + ICMPV6_HLEN
    }

    #[inline(always)]
    pub const fn inner_saddr_off(&self) -> usize {
        self.inner_off() + SADDR
    }

    #[inline(always)]
    pub const fn inner_daddr_off(&self) -> usize {
        self.inner_off() + DADDR
    }
}

/// A later fragment (offset ≠ 0) of an IPv6 datagram.
#[derive(Clone, Copy)]
pub struct Fragment6 {
    pub l2_len: usize,
    pub saddr: [u8; 16],
    pub daddr: [u8; 16],
    pub frag: FragId,
}

impl Fragment6 {
    #[inline(always)]
    pub const fn saddr_off(&self) -> usize {
        self.l2_len + SADDR
    }

    #[inline(always)]
    pub const fn daddr_off(&self) -> usize {
        self.l2_len + DADDR
    }
}

/// What [`parse`] found (the parsed headers themselves are in the per-CPU scratch).
pub enum Parsed6 {
    Packet(&'static Packet6),
    IcmpError(&'static Icmp6Error),
    Fragment(&'static Fragment6),
    /// Passed untouched; the counter says why.
    Pass(Counter),
    /// TCP/UDP/SCTP that cannot be translated (its `daddr`, `dport` and `proto` are set): dropped
    /// with `reason` if to a Service.
    Untranslatable {
        to: &'static Packet6,
        reason: Drop,
    },
}

/// Where the extension header walk ended.
struct Walk {
    /// The header after the last extension header.
    nexthdr: u8,
    /// Its offset.
    off: usize,
    has_ext: bool,
    /// The fragment header's field (offset and flags) and datagram, if there was one.
    frag: Option<(u16, FragId)>,
}

/// Walk the extension headers from the IPv6 header's next header (bounded: module docs).
#[inline(always)]
fn walk(ctx: &TcContext, l2_len: usize, first: u8) -> Result<Walk, Counter> {
    let mut w = Walk {
        nexthdr: first,
        off: l2_len + IPV6_HLEN,
        has_ext: false,
        frag: None,
    };
    let mut i = 0;
    while i <= MAX_EXT_HEADERS {
        let len = match w.nexthdr {
            HOP_BY_HOP | ROUTING | DEST_OPTS | AH => {
                let h = read::<2>(ctx, w.off).ok_or(Counter::Ipv6ExtUnparsed)?;
                let len = if w.nexthdr == AH {
                    (h[1] as usize + 2) * 4
                } else {
                    (h[1] as usize + 1) * 8
                };
                w.nexthdr = h[0];
                len
            }
            FRAGMENT => {
                let h = read::<8>(ctx, w.off).ok_or(Counter::Ipv6ExtUnparsed)?;
                let id = FragId {
                    id: [h[4], h[5], h[6], h[7]],
                    nexthdr: h[0],
                };
                w.frag = Some((u16::from_be_bytes([h[2], h[3]]), id));
                w.nexthdr = h[0];
                8
            }
            ESP => return Err(Counter::Ipv6ExtUnparsed),
            _ => return Ok(w), // TCP, UDP, ICMPv6, or another protocol.
        };
        w.off += len;
        w.has_ext = true;
        i += 1;
    }
    Err(Counter::Ipv6ExtUnparsed)
}

/// Parse an IPv6 packet (after `l2_len` bytes of L2 header); see the module docs for the policy.
#[inline(always)]
pub fn parse(ctx: &TcContext, l2_len: usize) -> Parsed6 {
    packet::pull(ctx, PULL_LEN);
    let Some(s) = maps::scratch6() else {
        return Parsed6::Pass(Counter::MalformedPassed);
    };
    let Some(head) = read::<8>(ctx, l2_len) else {
        return Parsed6::Pass(Counter::MalformedPassed);
    };
    if head[0] >> 4 != 6 {
        return Parsed6::Pass(Counter::MalformedPassed);
    }
    let p = &mut s.pkt;
    p.l2_len = l2_len;
    match (
        read::<16>(ctx, l2_len + SADDR),
        read::<16>(ctx, l2_len + DADDR),
    ) {
        (Some(src), Some(dst)) => {
            p.saddr = src;
            p.daddr = dst;
        }
        _ => return Parsed6::Pass(Counter::MalformedPassed),
    }
    let w = match walk(ctx, l2_len, head[6]) {
        Ok(w) => w,
        Err(counter) => return Parsed6::Pass(counter),
    };
    p.is_first_fragment = false;
    // A plain bool rather than matching `w.frag` again below: LLVM may read an `Option`'s
    // payload on the `None` path, which the verifier rejects.
    let mut more_fragments = false;
    if let Some((field, frag)) = w.frag {
        if field & FRAG_OFFSET_MASK != 0 {
            if frag.nexthdr != proto::TCP && frag.nexthdr != proto::UDP {
                return Parsed6::Pass(Counter::FragmentPassed);
            }
            let f = &mut s.frag;
            f.l2_len = l2_len;
            f.saddr = s.pkt.saddr;
            f.daddr = s.pkt.daddr;
            f.frag = frag;
            let s: &'static Scratch6 = s;
            return Parsed6::Fragment(&s.frag);
        }
        p.is_first_fragment = true;
        p.frag = frag;
        more_fragments = field & FRAG_MORE != 0;
    }
    let proto = w.nexthdr;
    let l4_off = w.off;
    if proto == ICMPV6 {
        return parse_icmp_error(ctx, s, l4_off);
    }
    if proto != proto::TCP && proto != proto::UDP && proto != proto::SCTP {
        return Parsed6::Pass(Counter::NotService);
    }
    let Some(ports) = read::<4>(ctx, l4_off) else {
        return Parsed6::Pass(Counter::MalformedPassed);
    };
    p.l4_off = l4_off;
    p.proto = proto;
    p.sport = [ports[0], ports[1]];
    p.dport = [ports[2], ports[3]];
    p.has_ext = w.has_ext;
    p.tcp_flags = 0;
    p.tcp_seq = [0; 4];
    p.tcp_ack = [0; 4];
    p.tcp_payload_len = 0;
    p.sctp_len = 0;
    // The end of the IPv6 packet: payload length, or the skb's for IPv6 BIG TCP.
    let frame_len = ctx.len() as usize;
    let payload_len = u16::from_be_bytes([head[4], head[5]]) as usize;
    let end = if payload_len == 0 && packet::is_gso(ctx) {
        frame_len
    } else {
        l2_len + IPV6_HLEN + payload_len
    };
    let mut reason = Drop::Malformed;
    let malformed = if end > frame_len || end < l4_off {
        true
    } else if proto == proto::SCTP {
        let l4_len = end - l4_off;
        if more_fragments {
            reason = Drop::Fragment;
            true
        } else {
            match read::<SCTP_MIN_LEN>(ctx, l4_off) {
                Some(sctp) if (SCTP_MIN_LEN..=u16::MAX as usize).contains(&l4_len) => {
                    let first = [sctp[12], sctp[13], sctp[14], sctp[15]];
                    match crate::sctp::packet_flags(ctx, l4_off, l4_len, first) {
                        Some(flags) => {
                            p.tcp_flags = flags;
                            p.sctp_len = l4_len as u16;
                            false
                        }
                        None => true,
                    }
                }
                _ => true,
            }
        }
    } else if proto == proto::TCP {
        let l4_len = end - l4_off;
        match read::<TCP_HLEN>(ctx, l4_off) {
            Some(tcp) => {
                let doff = ((tcp[12] >> 4) as usize) * 4;
                if doff < TCP_HLEN || doff > l4_len {
                    true
                } else {
                    p.tcp_seq = [tcp[4], tcp[5], tcp[6], tcp[7]];
                    p.tcp_ack = [tcp[8], tcp[9], tcp[10], tcp[11]];
                    p.tcp_flags = tcp[13];
                    p.tcp_payload_len = (l4_len - doff) as u32;
                    false
                }
            }
            None => true,
        }
    } else {
        match read::<UDP_HLEN>(ctx, l4_off) {
            Some(udp) => end - l4_off < UDP_HLEN || (udp[6] == 0 && udp[7] == 0),
            None => true,
        }
    };
    let s: &'static Scratch6 = s;
    if malformed {
        return Parsed6::Untranslatable { to: &s.pkt, reason };
    }
    Parsed6::Packet(&s.pkt)
}

/// An ICMPv6 error (types 1–4) quoting an IPv6 packet; anything else passes untouched. The
/// quoted L4 header is found by [`quoted_l4`], on egress only (a second extension header walk in
/// every program's parse would take the verifier past its complexity limit).
#[inline(always)]
fn parse_icmp_error(ctx: &TcContext, s: &'static mut Scratch6, icmp_off: usize) -> Parsed6 {
    let not_error = Parsed6::Pass(Counter::NotService);
    let Some(icmp) = read::<4>(ctx, icmp_off) else {
        return not_error;
    };
    if icmp[0] == 0 || icmp[0] > ICMPV6_ERROR_MAX {
        return not_error;
    }
    let inner_off = icmp_off + ICMPV6_HLEN;
    let Some(head) = read::<8>(ctx, inner_off) else {
        return not_error;
    };
    if head[0] >> 4 != 6 {
        return not_error;
    }
    let (Some(src), Some(dst)) = (
        read::<16>(ctx, inner_off + SADDR),
        read::<16>(ctx, inner_off + DADDR),
    ) else {
        return not_error;
    };
    let e = &mut s.icmp;
    e.l2_len = s.pkt.l2_len;
    e.saddr = s.pkt.saddr;
    e.daddr = s.pkt.daddr;
    e.icmp_off = icmp_off;
    e.inner_saddr = src;
    e.inner_daddr = dst;
    e.inner_next = head[6];
    // The quoted header must lie inside the outer packet (fuzz: a Packet Too Big whose payload
    // length ended inside its quote had addresses rewritten beyond the checksummed bytes).
    if !e.inside(ctx, inner_off, IPV6_HLEN) {
        return not_error;
    }
    let s: &'static Scratch6 = s;
    Parsed6::IcmpError(&s.icmp)
}

/// The quoted TCP/UDP/SCTP header of an ICMPv6 error.
#[derive(Clone, Copy)]
pub struct Quoted {
    pub proto: u8,
    pub sport: [u8; 2],
    pub dport: [u8; 2],
    /// Offset of the quoted TCP/UDP header.
    pub l4_off: usize,
}

impl Quoted {
    #[inline(always)]
    pub const fn sport_off(&self) -> usize {
        self.l4_off
    }

    #[inline(always)]
    pub const fn dport_off(&self) -> usize {
        self.l4_off + 2
    }
}

/// The TCP/UDP/SCTP header the error quotes, after the quoted packet's extension headers (walked
/// under the same bound as a packet's own); `None` for another protocol, a chain that is cut off
/// or too long, or a quoted later fragment (no ports in it).
#[inline(always)]
pub fn quoted_l4(ctx: &TcContext, e: &Icmp6Error) -> Option<Quoted> {
    // Read back from the per-CPU scratch (`icmp::snat_reply` and `icmp::toward_backend` are functions of their own), the
    // offset is any number to the verifier: bounded here by what `parse` can produce (an
    // Ethernet header, the IPv6 header and its longest extension header chain).
    let icmp_off = e.icmp_off;
    if icmp_off > ICMP_OFF_MAX {
        return None;
    }
    let inner_off = icmp_off + ICMPV6_HLEN;
    let w = walk(ctx, inner_off, e.inner_next).ok()?;
    if (w.nexthdr != proto::TCP && w.nexthdr != proto::UDP && w.nexthdr != proto::SCTP)
        || matches!(w.frag, Some((field, _)) if field & FRAG_OFFSET_MASK != 0)
    {
        return None;
    }
    if !e.inside(ctx, w.off, 4) {
        return None;
    }
    let ports = read::<4>(ctx, w.off)?;
    Some(Quoted {
        proto: w.nexthdr,
        sport: [ports[0], ports[1]],
        dport: [ports[2], ports[3]],
        l4_off: w.off,
    })
}

/// The IPv6 source and destination as the packet holds them now (after rewrites).
#[inline(always)]
pub fn addrs(ctx: &TcContext, l2_len: usize) -> Option<([u8; 16], [u8; 16])> {
    let a = read::<32>(ctx, l2_len + SADDR)?;
    let mut s = [0u8; 16];
    let mut d = [0u8; 16];
    s.copy_from_slice(&a[..16]);
    d.copy_from_slice(&a[16..]);
    Some((s, d))
}
