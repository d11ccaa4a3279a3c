//! Packet access: the only module that dereferences packet memory (through the bounds-checked
//! [`ptr_at`]) or changes the packet's shape (tail, room, redirect).
//!
//! [`parse`] reads Ethernet + IPv4 + TCP/UDP/SCTP once into a [`Packet`] of copied values, with
//! offsets taken from the IHL. The L2 header length is the program entry's: [`ETH_HLEN`] on
//! Ethernet devices, [`NO_L2`] on L3 devices (ipip, gre, WireGuard: the data starts at the IPv4
//! header). Each entry passes a constant and everything is inlined into it, so every offset is
//! still a constant in the compiled program. The other modules rewrite through checksum/store helpers, which
//! invalidate packet pointers; none are kept, so every read here re-checks the bounds.
//!
//! Policy for odd packets (what [`parse`] reports):
//! - not IPv4 → [`Parsed::NotIpv4`];
//! - IPv4 options: parsed past (the L4 offset comes from IHL) and preserved;
//! - bad IPv4 header (version, IHL < 5, header beyond the data) → passed untouched: nothing can
//!   be trusted in it, and the kernel's `ip_rcv` drops it anyway;
//! - IP fragments (tc sees them as they are: nothing reassembles before tc ingress, and tc egress
//!   runs after the stack fragmented): the first fragment (MF set, offset 0) carries the TCP/UDP
//!   header and is a [`Packet`] like any other ([`first_fragment_id`] tells it apart). It is
//!   translated as usual — its L4 checksum is updated incrementally, which stays right for the
//!   reassembled datagram — and the hook then records what it did in `FRAGMENTS_V1` (LRU, bounded,
//!   keyed by {saddr, daddr, IP id, proto, hook} as the fragments arrive; see `frag.rs`). A later
//!   TCP/UDP fragment (offset ≠ 0) → [`Parsed::Fragment`]: it carries no ports, so it gets what
//!   the record says — the same IPv4 source and destination (IPv4 checksum only), passed, or
//!   dropped. A later fragment whose first fragment was not seen first at this hook (out of
//!   order, lost, evicted, older than 30 s) cannot be buffered here: it is passed untouched and
//!   counted (`fragment_unmatched`). Later fragments of other protocols are passed untouched;
//! - truncated TCP/UDP header, or IPv4 lengths that do not fit the packet, when at least the
//!   ports can be read → [`Parsed::Untranslatable`]: the caller drops it if it is addressed to a
//!   Service frontend and passes it otherwise;
//! - SCTP: the common header and the chunks' types (the first and up to three bundled ones,
//!   `crate::sctp::packet_flags`), read as TCP flags; an invalid bundle (INIT not alone, a
//!   zero-length chunk ...) → [`Parsed::Untranslatable`] as netfilter's INVALID. SCTP fragments are not translated
//!   (SCTP sizes its packets to the path MTU; a port rewrite's checksum update needs the whole
//!   packet's length, which a first fragment does not give): a first fragment is
//!   [`Parsed::Untranslatable`] (dropped if to a Service), later ones are passed untouched;
//! - protocols other than TCP, UDP and SCTP → passed untouched;
//! - IPv4 total length 0 on a GSO packet (BIG TCP) → the length is the skb's, translated as usual.

use core::mem::size_of;

use aya_ebpf::{
    EbpfContext,
    bindings::{__sk_buff, bpf_adj_room_mode::BPF_ADJ_ROOM_MAC},
    helpers::{bpf_redirect, bpf_skb_change_tail},
    programs::TcContext,
};
use proxy_common::{Counter, proto};

use crate::Drop;

/// L2 header length on Ethernet devices.
pub const ETH_HLEN: usize = 14;
/// L2 header length on L3 devices (the packet starts at the IPv4 header).
pub const NO_L2: usize = 0;
const ETH_P_IP: [u8; 2] = [0x08, 0x00];
const ETH_P_IPV6: [u8; 2] = [0x86, 0xdd];
pub const IPV4_HLEN: usize = 20;
const IPV4_MAX_HLEN: usize = 60;
pub const TCP_HLEN: usize = 20;
pub const UDP_HLEN: usize = 8;
/// SCTP common header (ports, verification tag, CRC32c) and the first chunk's header.
pub const SCTP_HLEN: usize = 12;
const SCTP_CHUNK_HLEN: usize = 4;
/// Offset of the CRC32c in the SCTP common header.
pub const SCTP_CSUM: usize = 8;
/// Offsets of the IPv4 header checksum, source and destination inside the IPv4 header.
const IP_CSUM: usize = 10;
const IP_SADDR: usize = 12;
const IP_DADDR: usize = 16;
/// Enough linear data for the largest IPv4 header and a TCP header without options (after an
/// Ethernet header; 14 bytes more than needed on an L3 device, which is harmless).
const PULL_LEN: u32 = (ETH_HLEN + IPV4_MAX_HLEN + TCP_HLEN) as u32;
const IP_MF: u16 = 0x2000;
const IP_OFFSET_MASK: u16 = 0x1fff;

/// TCP flag bits (byte 13 of the header).
pub mod tcp_flags {
    pub const FIN: u8 = 0x01;
    pub const SYN: u8 = 0x02;
    pub const RST: u8 = 0x04;
    pub const ACK: u8 = 0x10;
}

/// The offsets of the (outer) IPv4 header's fields in a parsed type with an `l2_len` field: one
/// definition for [`Packet`], [`IcmpError`] and [`Fragment`].
macro_rules! ip_header_offsets {
    ($t:ty) => {
        impl $t {
            /// Offset of the IPv4 header checksum.
            #[inline(always)]
            pub const fn ip_csum_off(&self) -> usize {
                self.l2_len + IP_CSUM
            }

            /// Offset of the IPv4 source address.
            #[inline(always)]
            pub const fn saddr_off(&self) -> usize {
                self.l2_len + IP_SADDR
            }

            /// Offset of the IPv4 destination address.
            #[inline(always)]
            pub const fn daddr_off(&self) -> usize {
                self.l2_len + IP_DADDR
            }
        }
    };
}

/// A TCP, UDP or SCTP over IPv4 packet, parsed once. Addresses and ports in network order.
#[derive(Clone, Copy)]
pub struct Packet {
    /// L2 header length: [`ETH_HLEN`] or [`NO_L2`] (a constant of the program entry).
    pub l2_len: usize,
    /// IPv4 header length in bytes (20..=60).
    pub ip_hlen: usize,
    pub saddr: [u8; 4],
    pub daddr: [u8; 4],
    /// `proto::TCP`, `proto::UDP` or `proto::SCTP`.
    pub proto: u8,
    pub sport: [u8; 2],
    pub dport: [u8; 2],
    /// TCP flags (0 for UDP; for SCTP, its chunks as TCP flags: `crate::sctp::packet_flags`).
    pub tcp_flags: u8,
    /// TCP sequence and acknowledgement numbers (zero for UDP), for building a RST.
    pub tcp_seq: [u8; 4],
    pub tcp_ack: [u8; 4],
    /// TCP payload length from the IPv4 total length (0 for UDP); beyond 64 KiB for BIG TCP.
    pub tcp_payload_len: u32,
    /// SCTP packet length (common header + chunks: what its CRC32c covers); 0 for TCP/UDP.
    pub sctp_len: u16,
}

ip_header_offsets!(Packet);

impl Packet {
    /// Offset of the TCP/UDP header.
    #[inline(always)]
    pub const fn l4_off(&self) -> usize {
        self.l2_len + self.ip_hlen
    }

    /// Offset of the TCP/UDP checksum field (SCTP has none: see `sctp.rs`).
    #[inline(always)]
    pub const fn l4_csum_off(&self) -> usize {
        self.l4_off() + if self.proto == proto::TCP { 16 } else { 6 }
    }

    #[inline(always)]
    pub const fn has_ip_options(&self) -> bool {
        self.ip_hlen > IPV4_HLEN
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

    /// Could this packet start a flow: a UDP datagram, a TCP SYN or an SCTP INIT (not a
    /// segment of a connection under way)?
    #[inline(always)]
    pub const fn may_open_flow(&self) -> bool {
        (!self.is_tcp() && !self.is_sctp()) || self.is_syn()
    }
}

/// ICMP header length (type, code, checksum, 4 bytes rest-of-header).
pub const ICMP_HLEN: usize = 8;
const ICMP_DEST_UNREACH: u8 = 3;
const ICMP_TIME_EXCEEDED: u8 = 11;

/// An ICMP error (destination unreachable, time exceeded) quoting a TCP/UDP/SCTP packet. Addresses and
/// ports in network order; offsets are frame offsets.
#[derive(Clone, Copy)]
pub struct IcmpError {
    /// L2 header length (as [`Packet::l2_len`]).
    pub l2_len: usize,
    pub saddr: [u8; 4],
    pub daddr: [u8; 4],
    /// Offset of the quoted IPv4 header.
    pub inner_off: usize,
    pub inner_hlen: usize,
    pub inner_saddr: [u8; 4],
    pub inner_daddr: [u8; 4],
    pub inner_proto: u8,
    pub inner_sport: [u8; 2],
    pub inner_dport: [u8; 2],
}

ip_header_offsets!(IcmpError);

impl IcmpError {
    /// Offset of the ICMP checksum.
    #[inline(always)]
    pub const fn icmp_csum_off(&self) -> usize {
        self.inner_off - ICMP_HLEN + 2
    }

    /// Offset of the quoted IPv4 header's checksum.
    #[inline(always)]
    pub const fn inner_csum_off(&self) -> usize {
        self.inner_off + 10
    }

    #[inline(always)]
    pub const fn inner_saddr_off(&self) -> usize {
        self.inner_off + 12
    }

    #[inline(always)]
    pub const fn inner_daddr_off(&self) -> usize {
        self.inner_off + 16
    }

    #[inline(always)]
    pub const fn inner_sport_off(&self) -> usize {
        self.inner_off + self.inner_hlen
    }

    #[inline(always)]
    pub const fn inner_dport_off(&self) -> usize {
        self.inner_off + self.inner_hlen + 2
    }
}

/// A later fragment (offset ≠ 0) of a TCP/UDP datagram: no L4 header, only the IPv4 fields that
/// name its datagram. Addresses in network order.
#[derive(Clone, Copy)]
pub struct Fragment {
    /// L2 header length (as [`Packet::l2_len`]).
    pub l2_len: usize,
    pub saddr: [u8; 4],
    pub daddr: [u8; 4],
    pub id: [u8; 2],
    pub proto: u8,
}

ip_header_offsets!(Fragment);

/// What [`parse`] found.
pub enum Parsed {
    /// An ICMP error quoting a TCP/UDP packet (candidate for reverse translation).
    IcmpError(IcmpError),
    /// Not IPv4 (ARP, runt frames).
    NotIpv4,
    /// IPv6 (EtherType 0x86DD, or version 6 on an L3 device): for the IPv6 programs (`ipv6`).
    Ipv6,
    /// IPv4 that is passed untouched; the counter says why.
    Pass(Counter),
    /// TCP/UDP that cannot be translated but whose destination was read: dropped with `reason`
    /// if it is addressed to a Service, passed otherwise.
    Untranslatable {
        daddr: [u8; 4],
        dport: [u8; 2],
        proto: u8,
        reason: Drop,
    },
    /// A translatable TCP/UDP packet (possibly the first fragment of a datagram).
    Packet(Packet),
    /// A later fragment of a TCP/UDP datagram.
    Fragment(Fragment),
}

/// A pointer to a `T` at `offset` in the packet, if the whole `T` lies inside the linear data.
#[inline(always)]
pub(crate) fn ptr_at<T>(ctx: &TcContext, offset: usize) -> Option<*const T> {
    let start = ctx.data();
    let end = ctx.data_end();
    if start + offset + size_of::<T>() > end {
        return None;
    }
    Some((start + offset) as *const T)
}

/// Copy a byte array (alignment 1) out of the packet.
#[inline(always)]
pub(crate) fn read<const N: usize>(ctx: &TcContext, offset: usize) -> Option<[u8; N]> {
    let ptr = ptr_at::<[u8; N]>(ctx, offset)?;
    // SAFETY: `ptr_at` checked that the N bytes lie between data and data_end; [u8; N] has
    // alignment 1 and every bit pattern is valid.
    Some(unsafe { *ptr })
}

/// Make the headers readable with direct access when the skb is non-linear (no-op otherwise).
#[inline(always)]
fn pull_headers(ctx: &TcContext) {
    let want = if ctx.len() < PULL_LEN {
        ctx.len()
    } else {
        PULL_LEN
    };
    if ctx.data() + (want as usize) > ctx.data_end() {
        // A failed pull leaves the data as it was; the bounds checks below then see a short packet.
        let _ = ctx.pull_data(want);
    }
}

/// Parse Ethernet (`l2_len` [`ETH_HLEN`]) or nothing (`l2_len` [`NO_L2`], an L3 device) + IPv4
/// + TCP/UDP once (see the module docs for the policy on odd packets).
#[inline(always)]
pub fn parse(ctx: &TcContext, l2_len: usize) -> Parsed {
    pull_headers(ctx);
    if l2_len == ETH_HLEN {
        let Some(ethertype) = read::<2>(ctx, 12) else {
            return Parsed::NotIpv4;
        };
        if ethertype != ETH_P_IP {
            return if ethertype == ETH_P_IPV6 {
                Parsed::Ipv6
            } else {
                Parsed::NotIpv4
            };
        }
    }
    let Some(ip) = read::<IPV4_HLEN>(ctx, l2_len) else {
        return Parsed::Pass(Counter::MalformedPassed);
    };
    if l2_len == NO_L2 && ip[0] >> 4 != 4 {
        // No EtherType on an L3 device (WireGuard and gre carry IPv6 too): the version nibble.
        return if ip[0] >> 4 == 6 {
            Parsed::Ipv6
        } else {
            Parsed::NotIpv4
        };
    }
    let ip_hlen = ((ip[0] & 0x0f) as usize) * 4;
    if ip[0] >> 4 != 4 || ip_hlen < IPV4_HLEN {
        return Parsed::Pass(Counter::MalformedPassed);
    }
    let frag = u16::from_be_bytes([ip[6], ip[7]]);
    let proto = ip[9];
    let saddr = [ip[12], ip[13], ip[14], ip[15]];
    let daddr = [ip[16], ip[17], ip[18], ip[19]];
    if frag & IP_OFFSET_MASK != 0 {
        if proto != proto::TCP && proto != proto::UDP {
            return Parsed::Pass(Counter::FragmentPassed);
        }
        return Parsed::Fragment(Fragment {
            l2_len,
            saddr,
            daddr,
            id: [ip[4], ip[5]],
            proto,
        });
    }
    let l4_off = l2_len + ip_hlen;
    if proto == proto::ICMP {
        // The quote must lie inside the IP packet (bytes after it, such as a trailer, are not
        // covered by the ICMP checksum and are cut off by the stack).
        let ip_end = l2_len + u16::from_be_bytes([ip[2], ip[3]]) as usize;
        return parse_icmp_error(ctx, l2_len, l4_off, ip_end, saddr, daddr);
    }
    if proto != proto::TCP && proto != proto::UDP && proto != proto::SCTP {
        return Parsed::Pass(Counter::NotService);
    }
    // The ports are the first 4 bytes of TCP, UDP and SCTP; without them nothing can be matched.
    let Some(ports) = read::<4>(ctx, l4_off) else {
        return Parsed::Pass(Counter::MalformedPassed);
    };
    let sport = [ports[0], ports[1]];
    let dport = [ports[2], ports[3]];
    let untranslatable = |reason| Parsed::Untranslatable {
        daddr,
        dport,
        proto,
        reason,
    };

    let l3_len = (ctx.len() as usize).saturating_sub(l2_len);
    let tot_len = ip_total_len(ctx, &ip, l3_len);
    if tot_len < ip_hlen || tot_len > l3_len {
        return untranslatable(Drop::Malformed);
    }
    let l4_len = tot_len - ip_hlen;
    let mut packet = Packet {
        l2_len,
        ip_hlen,
        saddr,
        daddr,
        proto,
        sport,
        dport,
        tcp_flags: 0,
        tcp_seq: [0; 4],
        tcp_ack: [0; 4],
        tcp_payload_len: 0,
        sctp_len: 0,
    };
    if proto == proto::TCP {
        let Some(tcp) = read::<TCP_HLEN>(ctx, l4_off) else {
            return untranslatable(Drop::Malformed);
        };
        let doff = ((tcp[12] >> 4) as usize) * 4;
        if doff < TCP_HLEN || doff > l4_len {
            return untranslatable(Drop::Malformed);
        }
        packet.tcp_seq = [tcp[4], tcp[5], tcp[6], tcp[7]];
        packet.tcp_ack = [tcp[8], tcp[9], tcp[10], tcp[11]];
        packet.tcp_flags = tcp[13];
        packet.tcp_payload_len = (l4_len - doff) as u32;
    } else if proto == proto::SCTP {
        if frag & IP_MF != 0 {
            return untranslatable(Drop::Fragment);
        }
        let Some(sctp) = read::<{ SCTP_HLEN + SCTP_CHUNK_HLEN }>(ctx, l4_off) else {
            return untranslatable(Drop::Malformed);
        };
        if l4_len < SCTP_HLEN + SCTP_CHUNK_HLEN || l4_len > u16::MAX as usize {
            return untranslatable(Drop::Malformed);
        }
        let first = [sctp[12], sctp[13], sctp[14], sctp[15]];
        let Some(flags) = crate::sctp::packet_flags(ctx, l4_off, l4_len, first) else {
            return untranslatable(Drop::Malformed);
        };
        packet.tcp_flags = flags;
        packet.sctp_len = l4_len as u16;
    } else if l4_len < UDP_HLEN || read::<UDP_HLEN>(ctx, l4_off).is_none() {
        return untranslatable(Drop::Malformed);
    }
    Parsed::Packet(packet)
}

/// The IPv4 total length. A GSO packet with total length 0 is IPv4 BIG TCP (Linux ≥ 6.3, GSO/GRO
/// beyond 64 KiB, where the 16-bit field cannot hold the length): its length is the skb's, `l3_len`.
#[inline(always)]
fn ip_total_len(ctx: &TcContext, ip: &[u8; IPV4_HLEN], l3_len: usize) -> usize {
    let tot_len = u16::from_be_bytes([ip[2], ip[3]]) as usize;
    // SAFETY: reading `gso_size` from the program's own, valid `__sk_buff` context.
    if tot_len == 0 && unsafe { (*skb(ctx)).gso_size } != 0 {
        return l3_len;
    }
    tot_len
}

/// An ICMP destination-unreachable or time-exceeded message quoting TCP/UDP/SCTP over IPv4 (at least
/// the ports); anything else is passed untouched.
#[inline(always)]
fn parse_icmp_error(
    ctx: &TcContext,
    l2_len: usize,
    l4_off: usize,
    ip_end: usize,
    saddr: [u8; 4],
    daddr: [u8; 4],
) -> Parsed {
    let not_error = Parsed::Pass(Counter::NotService);
    let Some(icmp) = read::<4>(ctx, l4_off) else {
        return not_error;
    };
    if icmp[0] != ICMP_DEST_UNREACH && icmp[0] != ICMP_TIME_EXCEEDED {
        return not_error;
    }
    let inner_off = l4_off + ICMP_HLEN;
    let Some(inner) = read::<IPV4_HLEN>(ctx, inner_off) else {
        return not_error;
    };
    let inner_hlen = ((inner[0] & 0x0f) as usize) * 4;
    let inner_proto = inner[9];
    if inner[0] >> 4 != 4
        || inner_hlen < IPV4_HLEN
        || (inner_proto != proto::TCP && inner_proto != proto::UDP && inner_proto != proto::SCTP)
    {
        return not_error;
    }
    let Some(ports) = read::<4>(ctx, inner_off + inner_hlen) else {
        return not_error;
    };
    if inner_off + inner_hlen + 4 > ip_end {
        return not_error;
    }
    Parsed::IcmpError(IcmpError {
        l2_len,
        saddr,
        daddr,
        inner_off,
        inner_hlen,
        inner_saddr: [inner[12], inner[13], inner[14], inner[15]],
        inner_daddr: [inner[16], inner[17], inner[18], inner[19]],
        inner_proto,
        inner_sport: [ports[0], ports[1]],
        inner_dport: [ports[2], ports[3]],
    })
}

/// The IPv4 identification field if the packet is the first fragment of a datagram (MF set,
/// offset 0), read from the packet as it is now (`l2_len` as in [`parse`]).
#[inline(always)]
pub fn first_fragment_id(ctx: &TcContext, l2_len: usize) -> Option<[u8; 2]> {
    let f = read::<4>(ctx, l2_len + 4)?;
    let frag = u16::from_be_bytes([f[2], f[3]]);
    (frag & IP_MF != 0 && frag & IP_OFFSET_MASK == 0).then_some([f[0], f[1]])
}

/// The IPv4 source and destination addresses as the packet holds them now (after rewrites).
#[inline(always)]
pub fn ip_addrs(ctx: &TcContext, l2_len: usize) -> Option<([u8; 4], [u8; 4])> {
    let a = read::<8>(ctx, l2_len + IP_SADDR)?;
    Some(([a[0], a[1], a[2], a[3]], [a[4], a[5], a[6], a[7]]))
}

/// The source and destination MAC addresses (bytes 0..12 of the frame).
#[inline(always)]
pub fn macs(ctx: &TcContext) -> Option<[u8; 12]> {
    read::<12>(ctx, 0)
}

/// One's-complement partial sum (unfolded, native byte order) of `len` bytes of the IPv4 packet,
/// from the start of its header; `len` must be a multiple of 4 and at most 80.
#[inline(always)]
pub fn sum_l3_prefix(ctx: &TcContext, l2_len: usize, len: usize) -> Option<u64> {
    const MAX_WORDS: usize = 20;
    let mut acc = 0u64;
    let mut i = 0;
    while i < MAX_WORDS {
        let off = i * 4;
        if off >= len {
            break;
        }
        acc += u32::from_ne_bytes(read::<4>(ctx, l2_len + off)?) as u64;
        i += 1;
    }
    Some(acc)
}

/// Is the packet a GSO aggregate (BIG TCP: a length field of 0 means the skb's length)?
#[inline(always)]
pub fn is_gso(ctx: &TcContext) -> bool {
    // SAFETY: reading `gso_size` from the program's own, valid `__sk_buff` context.
    unsafe { (*skb(ctx)).gso_size != 0 }
}

/// Make the first `len` bytes readable with direct access (no-op when they already are, or when
/// the packet is shorter: then as much as there is).
#[inline(always)]
pub fn pull(ctx: &TcContext, len: u32) {
    let want = if ctx.len() < len { ctx.len() } else { len };
    if ctx.data() + (want as usize) > ctx.data_end() {
        let _ = ctx.pull_data(want);
    }
}

#[inline(always)]
fn skb(ctx: &TcContext) -> *mut __sk_buff {
    ctx.as_ptr().cast()
}

/// Cut (or extend) the frame to `len` bytes.
#[inline(always)]
pub fn set_len(ctx: &TcContext, len: usize) -> Result<(), i64> {
    // SAFETY: the skb pointer is the program's context; the helper validates `len` and flags.
    let ret = unsafe { bpf_skb_change_tail(skb(ctx), len as u32, 0) };
    if ret == 0 { Ok(()) } else { Err(ret) }
}

/// Insert (`diff > 0`) or remove (`diff < 0`) bytes right after the Ethernet header.
#[inline(always)]
pub fn adjust_after_eth(ctx: &TcContext, diff: i32) -> Result<(), i64> {
    ctx.adjust_room(diff, BPF_ADJ_ROOM_MAC, 0)
}

/// The interface the program runs on (ingress: arrived on; egress: leaves by).
#[inline(always)]
pub fn ifindex(ctx: &TcContext) -> u32 {
    // SAFETY: reading `ifindex` from the program's own, valid `__sk_buff` context.
    unsafe { (*skb(ctx)).ifindex }
}

/// Send the packet back out of the interface it arrived on.
#[inline(always)]
pub fn redirect_back(ctx: &TcContext) -> i32 {
    // SAFETY: reading `ifindex` from the program's own, valid `__sk_buff` context.
    let ifindex = unsafe { (*skb(ctx)).ifindex };
    // SAFETY: bpf_redirect only records the target; it returns TC_ACT_REDIRECT (or TC_ACT_SHOT
    // for invalid flags).
    unsafe { bpf_redirect(ifindex, 0) as i32 }
}
