//! Test packets: a small builder (Ethernet + IPv4 (+options) + TCP/UDP with correct checksums)
//! and a parser for assertions on what the datapath wrote. Checksums come from `proxy_common::csum`,
//! the same arithmetic the agent and datapath are tested against.

#![allow(
    dead_code,
    reason = "each test binary uses a different part of the helpers"
)]

use std::net::{Ipv4Addr, Ipv6Addr};

use proxy_common::{csum, proto};

pub const ETH_HLEN: usize = 14;
pub const ETH_P_IP: u16 = 0x0800;
pub const ETH_P_ARP: u16 = 0x0806;
pub const ETH_P_IPV6: u16 = 0x86dd;

pub const CLIENT_MAC: [u8; 6] = [0x02, 0, 0, 0, 0, 0x01];
pub const HOST_MAC: [u8; 6] = [0x02, 0, 0, 0, 0, 0x02];

/// TCP flag bits.
pub mod tcp_flags {
    pub const FIN: u8 = 0x01;
    pub const SYN: u8 = 0x02;
    pub const RST: u8 = 0x04;
    pub const PSH: u8 = 0x08;
    pub const ACK: u8 = 0x10;
}

#[derive(Clone, Debug)]
pub enum L4 {
    Tcp {
        sport: u16,
        dport: u16,
        seq: u32,
        ack: u32,
        flags: u8,
    },
    /// `zero_csum`: send with checksum 0 ("no checksum").
    Udp {
        sport: u16,
        dport: u16,
        zero_csum: bool,
    },
}

/// The L4 header logic both families share; only the pseudo-header of the checksum differs.
impl L4 {
    pub fn tcp(sport: u16, dport: u16, flags: u8) -> Self {
        L4::Tcp {
            sport,
            dport,
            seq: 1000,
            ack: if flags & tcp_flags::ACK != 0 { 5000 } else { 0 },
            flags,
        }
    }

    pub fn udp(sport: u16, dport: u16) -> Self {
        L4::Udp {
            sport,
            dport,
            zero_csum: false,
        }
    }

    pub fn proto(&self) -> u8 {
        match self {
            L4::Tcp { .. } => proto::TCP,
            L4::Udp { .. } => proto::UDP,
        }
    }

    /// Ports swapped, TCP seq/ack swapped (the header of a reply).
    pub fn reversed(&self) -> Self {
        match *self {
            L4::Tcp {
                sport,
                dport,
                seq,
                ack,
                flags,
            } => L4::Tcp {
                sport: dport,
                dport: sport,
                seq: ack,
                ack: seq,
                flags,
            },
            L4::Udp {
                sport,
                dport,
                zero_csum,
            } => L4::Udp {
                sport: dport,
                dport: sport,
                zero_csum,
            },
        }
    }

    fn set_zero_udp_csum(&mut self) {
        if let L4::Udp { zero_csum, .. } = self {
            *zero_csum = true;
        }
    }

    /// The segment (header and `payload`) with its checksum: `l4_csum(proto, segment)` is the
    /// family's pseudo-header checksum; a computed UDP 0 is sent as 0xffff.
    fn segment(&self, payload: &[u8], l4_csum: impl Fn(u8, &[u8]) -> u16) -> Vec<u8> {
        let mut l4 = match *self {
            L4::Tcp {
                sport,
                dport,
                seq,
                ack,
                flags,
            } => {
                let mut h = Vec::with_capacity(20);
                h.extend_from_slice(&sport.to_be_bytes());
                h.extend_from_slice(&dport.to_be_bytes());
                h.extend_from_slice(&seq.to_be_bytes());
                h.extend_from_slice(&ack.to_be_bytes());
                h.extend_from_slice(&[0x50, flags, 0xfa, 0xf0, 0, 0, 0, 0]);
                h
            }
            L4::Udp { sport, dport, .. } => {
                let len = (8 + payload.len()) as u16;
                let mut h = Vec::with_capacity(8);
                h.extend_from_slice(&sport.to_be_bytes());
                h.extend_from_slice(&dport.to_be_bytes());
                h.extend_from_slice(&len.to_be_bytes());
                h.extend_from_slice(&[0, 0]);
                h
            }
        };
        l4.extend_from_slice(payload);
        match self {
            L4::Tcp { .. } => {
                let c = l4_csum(proto::TCP, &l4);
                l4[16..18].copy_from_slice(&c.to_be_bytes());
            }
            L4::Udp {
                zero_csum: false, ..
            } => {
                let c = match l4_csum(proto::UDP, &l4) {
                    0 => 0xffff,
                    c => c,
                };
                l4[6..8].copy_from_slice(&c.to_be_bytes());
            }
            L4::Udp {
                zero_csum: true, ..
            } => {}
        }
        l4
    }
}

/// A packet to build. Defaults: client MAC → host MAC, TTL 64, DF, no options, small payload.
#[derive(Clone, Debug)]
pub struct Pkt {
    pub src_mac: [u8; 6],
    pub dst_mac: [u8; 6],
    pub saddr: Ipv4Addr,
    pub daddr: Ipv4Addr,
    pub l4: L4,
    pub ip_options: Vec<u8>,
    /// Raw flags+fragment offset field.
    pub frag: u16,
    /// IPv4 identification field.
    pub ip_id: u16,
    pub ttl: u8,
    pub payload: Vec<u8>,
}

impl Pkt {
    pub fn tcp(saddr: Ipv4Addr, sport: u16, daddr: Ipv4Addr, dport: u16, flags: u8) -> Self {
        Self::new(saddr, daddr, L4::tcp(sport, dport, flags))
    }

    pub fn udp(saddr: Ipv4Addr, sport: u16, daddr: Ipv4Addr, dport: u16) -> Self {
        Self::new(saddr, daddr, L4::udp(sport, dport))
    }

    fn new(saddr: Ipv4Addr, daddr: Ipv4Addr, l4: L4) -> Self {
        Self {
            src_mac: CLIENT_MAC,
            dst_mac: HOST_MAC,
            saddr,
            daddr,
            l4,
            ip_options: Vec::new(),
            frag: 0x4000,
            ip_id: 0x1234,
            ttl: 64,
            payload: b"hello, service".to_vec(),
        }
    }

    pub fn options(mut self, options: &[u8]) -> Self {
        assert_eq!(
            options.len() % 4,
            0,
            "IPv4 options must be padded to 4 bytes"
        );
        self.ip_options = options.to_vec();
        self
    }

    pub fn frag(mut self, frag: u16) -> Self {
        self.frag = frag;
        self
    }

    pub fn ip_id(mut self, id: u16) -> Self {
        self.ip_id = id;
        self
    }

    pub fn payload(mut self, payload: &[u8]) -> Self {
        self.payload = payload.to_vec();
        self
    }

    pub fn zero_udp_csum(mut self) -> Self {
        self.l4.set_zero_udp_csum();
        self
    }

    pub fn seq_ack(mut self, seq_v: u32, ack_v: u32) -> Self {
        if let L4::Tcp { seq, ack, .. } = &mut self.l4 {
            *seq = seq_v;
            *ack = ack_v;
        }
        self
    }

    /// Swap the direction (for replies): addresses, ports and MACs.
    pub fn reversed(&self) -> Self {
        let mut r = self.clone();
        r.src_mac = self.dst_mac;
        r.dst_mac = self.src_mac;
        r.saddr = self.daddr;
        r.daddr = self.saddr;
        r.l4 = self.l4.reversed();
        r
    }

    pub fn proto(&self) -> u8 {
        self.l4.proto()
    }

    pub fn sport(&self) -> u16 {
        match self.l4 {
            L4::Tcp { sport, .. } | L4::Udp { sport, .. } => sport,
        }
    }

    pub fn dport(&self) -> u16 {
        match self.l4 {
            L4::Tcp { dport, .. } | L4::Udp { dport, .. } => dport,
        }
    }

    pub fn bytes(&self) -> Vec<u8> {
        let (saddr, daddr) = (self.saddr.octets(), self.daddr.octets());
        let l4 = self
            .l4
            .segment(&self.payload, |p, seg| csum::l4(saddr, daddr, p, seg));
        let ihl = 20 + self.ip_options.len();
        let tot_len = (ihl + l4.len()) as u16;
        let mut ip = vec![(4 << 4) | (ihl / 4) as u8, 0];
        ip.extend_from_slice(&tot_len.to_be_bytes());
        ip.extend_from_slice(&self.ip_id.to_be_bytes());
        ip.extend_from_slice(&self.frag.to_be_bytes());
        ip.extend_from_slice(&[self.ttl, self.proto(), 0, 0]);
        ip.extend_from_slice(&saddr);
        ip.extend_from_slice(&daddr);
        ip.extend_from_slice(&self.ip_options);
        let c = csum::ipv4_header(&ip);
        ip[10..12].copy_from_slice(&c.to_be_bytes());

        let mut frame = eth(self.dst_mac, self.src_mac, ETH_P_IP);
        frame.extend_from_slice(&ip);
        frame.extend_from_slice(&l4);
        frame
    }

    /// The packet as an L3 device (ipip, gre, WireGuard) carries it: the same bytes without the
    /// Ethernet header.
    pub fn l3_bytes(&self) -> Vec<u8> {
        self.bytes()[ETH_HLEN..].to_vec()
    }
}

/// Splits an Ethernet + IPv4 frame into fragments carrying `chunk` bytes of the IPv4 payload
/// each (a multiple of 8; the last one the rest), as `ip_fragment` does: the first fragment holds
/// the L4 header, every fragment has MF set but the last, DF clear, and its own header checksum.
pub fn fragments(frame: &[u8], chunk: usize) -> Vec<Vec<u8>> {
    assert!(
        chunk > 0 && chunk.is_multiple_of(8),
        "fragment size {chunk} not a multiple of 8"
    );
    let ihl = ((frame[ETH_HLEN] & 0x0f) as usize) * 4;
    let header = &frame[ETH_HLEN..ETH_HLEN + ihl];
    let payload = &frame[ETH_HLEN + ihl..];
    payload
        .chunks(chunk)
        .enumerate()
        .map(|(i, part)| {
            let last = (i + 1) * chunk >= payload.len();
            let mut ip = header.to_vec();
            ip[2..4].copy_from_slice(&((ihl + part.len()) as u16).to_be_bytes());
            let field = ((i * chunk / 8) as u16) | if last { 0 } else { 0x2000 };
            ip[6..8].copy_from_slice(&field.to_be_bytes());
            ip[10..12].copy_from_slice(&[0, 0]);
            let c = csum::ipv4_header(&ip);
            ip[10..12].copy_from_slice(&c.to_be_bytes());
            let mut f = frame[..ETH_HLEN].to_vec();
            f.extend_from_slice(&ip);
            f.extend_from_slice(part);
            f
        })
        .collect()
}

/// Reassembles fragments (given in offset order) into one frame, the first fragment's Ethernet
/// and IPv4 header with the fragment field cleared, as the receiver's stack would see the
/// datagram.
pub fn reassemble(frags: &[Vec<u8>]) -> Vec<u8> {
    let first = &frags[0];
    let ihl = ((first[ETH_HLEN] & 0x0f) as usize) * 4;
    let mut payload = Vec::new();
    for f in frags {
        let fihl = ((f[ETH_HLEN] & 0x0f) as usize) * 4;
        let field = u16::from_be_bytes([f[ETH_HLEN + 6], f[ETH_HLEN + 7]]);
        assert_eq!(
            ((field & 0x1fff) as usize) * 8,
            payload.len(),
            "fragments out of order or with a gap"
        );
        payload.extend_from_slice(&f[ETH_HLEN + fihl..]);
    }
    let mut ip = first[ETH_HLEN..ETH_HLEN + ihl].to_vec();
    ip[2..4].copy_from_slice(&((ihl + payload.len()) as u16).to_be_bytes());
    ip[6..8].copy_from_slice(&[0, 0]);
    ip[10..12].copy_from_slice(&[0, 0]);
    let c = csum::ipv4_header(&ip);
    ip[10..12].copy_from_slice(&c.to_be_bytes());
    let mut frame = first[..ETH_HLEN].to_vec();
    frame.extend_from_slice(&ip);
    frame.extend_from_slice(&payload);
    frame
}

pub fn eth(dst: [u8; 6], src: [u8; 6], ethertype: u16) -> Vec<u8> {
    let mut f = Vec::with_capacity(64);
    f.extend_from_slice(&dst);
    f.extend_from_slice(&src);
    f.extend_from_slice(&ethertype.to_be_bytes());
    f
}

/// An ARP request frame (who-has 10.96.0.10).
pub fn arp_frame() -> Vec<u8> {
    let mut f = eth([0xff; 6], CLIENT_MAC, ETH_P_ARP);
    f.extend_from_slice(&[0, 1, 8, 0, 6, 4, 0, 1]);
    f.extend_from_slice(&CLIENT_MAC);
    f.extend_from_slice(&[10, 244, 1, 2]);
    f.extend_from_slice(&[0; 6]);
    f.extend_from_slice(&[10, 96, 0, 10]);
    f
}

/// An IPv6 UDP frame (the datapath is IPv4-only and must pass it untouched).
pub fn ipv6_frame() -> Vec<u8> {
    let mut f = eth(HOST_MAC, CLIENT_MAC, ETH_P_IPV6);
    f.extend_from_slice(&[0x60, 0, 0, 0, 0, 8, 17, 64]);
    f.extend_from_slice(&[0xfd, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1]);
    f.extend_from_slice(&[0xfd, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 2]);
    f.extend_from_slice(&[0x30, 0x39, 0, 53, 0, 8, 0, 0]);
    f
}

/// What the datapath produced, decoded (panics with a message on anything that is not a
/// well-formed Ethernet/IPv4 frame).
#[derive(Debug, Clone)]
pub struct Decoded {
    pub dst_mac: [u8; 6],
    pub src_mac: [u8; 6],
    pub ihl: usize,
    pub tos: u8,
    pub tot_len: usize,
    pub frag: u16,
    pub ttl: u8,
    pub proto: u8,
    pub saddr: Ipv4Addr,
    pub daddr: Ipv4Addr,
    pub ip_header: Vec<u8>,
    /// From the L4 header to the end of the IPv4 packet.
    pub l4: Vec<u8>,
}

impl Decoded {
    /// Parses a bare IPv4 packet (as an L3 device carries it), behind a made-up Ethernet header.
    pub fn parse_l3(packet: &[u8]) -> Self {
        let mut frame = eth(HOST_MAC, CLIENT_MAC, ETH_P_IP);
        frame.extend_from_slice(packet);
        Self::parse(&frame)
    }

    pub fn parse(frame: &[u8]) -> Self {
        assert!(
            frame.len() >= ETH_HLEN + 20,
            "frame too short for Ethernet+IPv4: {} bytes",
            frame.len()
        );
        let ethertype = u16::from_be_bytes([frame[12], frame[13]]);
        assert_eq!(ethertype, ETH_P_IP, "EtherType is not IPv4");
        let ip = &frame[ETH_HLEN..];
        assert_eq!(ip[0] >> 4, 4, "IP version");
        let ihl = ((ip[0] & 0x0f) as usize) * 4;
        let tot_len = u16::from_be_bytes([ip[2], ip[3]]) as usize;
        assert!(
            ihl >= 20 && tot_len >= ihl && tot_len <= ip.len(),
            "IPv4 lengths: ihl {ihl} tot_len {tot_len} available {}",
            ip.len()
        );
        Self {
            dst_mac: frame[0..6].try_into().unwrap(),
            src_mac: frame[6..12].try_into().unwrap(),
            ihl,
            tos: ip[1],
            tot_len,
            frag: u16::from_be_bytes([ip[6], ip[7]]),
            ttl: ip[8],
            proto: ip[9],
            saddr: Ipv4Addr::new(ip[12], ip[13], ip[14], ip[15]),
            daddr: Ipv4Addr::new(ip[16], ip[17], ip[18], ip[19]),
            ip_header: ip[..ihl].to_vec(),
            l4: ip[ihl..tot_len].to_vec(),
        }
    }

    pub fn sport(&self) -> u16 {
        u16::from_be_bytes([self.l4[0], self.l4[1]])
    }

    pub fn dport(&self) -> u16 {
        u16::from_be_bytes([self.l4[2], self.l4[3]])
    }

    pub fn tcp_flags(&self) -> u8 {
        self.l4[13]
    }

    pub fn tcp_seq(&self) -> u32 {
        u32::from_be_bytes(self.l4[4..8].try_into().unwrap())
    }

    pub fn tcp_ack(&self) -> u32 {
        u32::from_be_bytes(self.l4[8..12].try_into().unwrap())
    }

    pub fn l4_csum_field(&self) -> u16 {
        let off = if self.proto == proto::TCP { 16 } else { 6 };
        u16::from_be_bytes([self.l4[off], self.l4[off + 1]])
    }

    /// The IPv4 header checksum verifies.
    pub fn ip_csum_ok(&self) -> bool {
        csum::ipv4_header(&self.ip_header) == 0
    }

    /// The TCP/UDP/ICMP checksum verifies (a UDP checksum of 0 means "none" and is reported as
    /// valid; check `l4_csum_field` to tell the two apart).
    pub fn l4_csum_ok(&self) -> bool {
        match self.proto {
            proto::ICMP => csum::fold(csum::sum(&self.l4, 0)) == 0,
            proto::UDP if self.l4_csum_field() == 0 => true,
            p => csum::l4(self.saddr.octets(), self.daddr.octets(), p, &self.l4) == 0,
        }
    }
}

/// An IPv6 extension header to put between the IPv6 header and the L4 header: its number and
/// its bytes after the 2-byte (next header, length) prefix; `2 + body.len()` must be a multiple
/// of 8 (the fragment header: 6 bytes of body, its length byte is reserved).
#[derive(Clone, Debug)]
pub struct Ext6 {
    pub kind: u8,
    pub body: Vec<u8>,
}

pub mod ext6 {
    pub const HOP_BY_HOP: u8 = 0;
    pub const ROUTING: u8 = 43;
    pub const FRAGMENT: u8 = 44;
    pub const ESP: u8 = 50;
    pub const DEST_OPTS: u8 = 60;
}

impl Ext6 {
    /// Hop-by-hop or destination options of `2 + pad` bytes (PadN).
    pub fn options(kind: u8, len: usize) -> Self {
        assert!(len >= 8 && len.is_multiple_of(8));
        let mut body = vec![1, (len - 4) as u8];
        body.resize(len - 2, 0);
        Self { kind, body }
    }

    /// A fragment header: offset in 8-byte units, more-fragments flag, identification.
    pub fn fragment(offset_units: u16, more: bool, id: u32) -> Self {
        let field = (offset_units << 3) | more as u16;
        let mut body = field.to_be_bytes().to_vec();
        body.extend_from_slice(&id.to_be_bytes());
        Self {
            kind: ext6::FRAGMENT,
            body,
        }
    }
}

/// An IPv6 packet to build: Ethernet + IPv6 + extension headers + TCP/UDP, checksums right.
#[derive(Clone, Debug)]
pub struct Pkt6 {
    pub src_mac: [u8; 6],
    pub dst_mac: [u8; 6],
    pub saddr: Ipv6Addr,
    pub daddr: Ipv6Addr,
    pub l4: L4,
    pub ext: Vec<Ext6>,
    pub hop_limit: u8,
    pub payload: Vec<u8>,
}

impl Pkt6 {
    pub fn tcp(saddr: Ipv6Addr, sport: u16, daddr: Ipv6Addr, dport: u16, flags: u8) -> Self {
        Self::new(saddr, daddr, L4::tcp(sport, dport, flags))
    }

    pub fn udp(saddr: Ipv6Addr, sport: u16, daddr: Ipv6Addr, dport: u16) -> Self {
        Self::new(saddr, daddr, L4::udp(sport, dport))
    }

    fn new(saddr: Ipv6Addr, daddr: Ipv6Addr, l4: L4) -> Self {
        Self {
            src_mac: CLIENT_MAC,
            dst_mac: HOST_MAC,
            saddr,
            daddr,
            l4,
            ext: Vec::new(),
            hop_limit: 64,
            payload: b"hello, service".to_vec(),
        }
    }

    pub fn ext(mut self, ext: Ext6) -> Self {
        self.ext.push(ext);
        self
    }

    pub fn payload(mut self, payload: &[u8]) -> Self {
        self.payload = payload.to_vec();
        self
    }

    pub fn zero_udp_csum(mut self) -> Self {
        self.l4.set_zero_udp_csum();
        self
    }

    /// Swap the direction (replies): addresses, ports, MACs, TCP seq/ack.
    pub fn reversed(&self) -> Self {
        let mut r = self.clone();
        r.src_mac = self.dst_mac;
        r.dst_mac = self.src_mac;
        r.saddr = self.daddr;
        r.daddr = self.saddr;
        r.l4 = self.l4.reversed();
        r
    }

    pub fn proto(&self) -> u8 {
        self.l4.proto()
    }

    /// The L4 segment (header with its checksum, and payload).
    pub fn segment(&self) -> Vec<u8> {
        let (s, d) = (self.saddr.octets(), self.daddr.octets());
        self.l4
            .segment(&self.payload, |p, seg| csum::l4_v6(s, d, p, seg))
    }

    pub fn bytes(&self) -> Vec<u8> {
        let segment = self.segment();
        ipv6_packet(
            self.dst_mac,
            self.src_mac,
            self.saddr,
            self.daddr,
            self.hop_limit,
            &self.ext,
            self.proto(),
            &segment,
        )
    }

    pub fn l3_bytes(&self) -> Vec<u8> {
        self.bytes()[ETH_HLEN..].to_vec()
    }
}

/// Ethernet + IPv6 header + `ext` (chained) + `upper` as next header `proto`.
#[expect(
    clippy::too_many_arguments,
    reason = "every header field of a test frame"
)]
pub fn ipv6_packet(
    dst_mac: [u8; 6],
    src_mac: [u8; 6],
    saddr: Ipv6Addr,
    daddr: Ipv6Addr,
    hop_limit: u8,
    ext: &[Ext6],
    proto: u8,
    upper: &[u8],
) -> Vec<u8> {
    let mut chain = Vec::new();
    for (i, e) in ext.iter().enumerate() {
        let next = ext.get(i + 1).map_or(proto, |n| n.kind);
        let len_byte = if e.kind == ext6::FRAGMENT {
            0
        } else {
            assert!(
                (2 + e.body.len()).is_multiple_of(8),
                "extension header length"
            );
            ((2 + e.body.len()) / 8 - 1) as u8
        };
        chain.push(next);
        chain.push(len_byte);
        chain.extend_from_slice(&e.body);
    }
    let first = ext.first().map_or(proto, |e| e.kind);
    let payload_len = (chain.len() + upper.len()) as u16;
    let mut f = eth(dst_mac, src_mac, ETH_P_IPV6);
    f.extend_from_slice(&[0x60, 0, 0, 0]);
    f.extend_from_slice(&payload_len.to_be_bytes());
    f.extend_from_slice(&[first, hop_limit]);
    f.extend_from_slice(&saddr.octets());
    f.extend_from_slice(&daddr.octets());
    f.extend_from_slice(&chain);
    f.extend_from_slice(upper);
    f
}

/// An ICMPv6 message (type, code, 4 bytes of rest of header, body) from `saddr` to `daddr`, its
/// checksum right.
pub fn icmp6_frame(
    saddr: Ipv6Addr,
    daddr: Ipv6Addr,
    kind: u8,
    code: u8,
    rest: [u8; 4],
    body: &[u8],
) -> Vec<u8> {
    let mut m = vec![kind, code, 0, 0];
    m.extend_from_slice(&rest);
    m.extend_from_slice(body);
    let c = csum::l4_v6(saddr.octets(), daddr.octets(), ICMPV6, &m);
    m[2..4].copy_from_slice(&c.to_be_bytes());
    ipv6_packet(HOST_MAC, CLIENT_MAC, saddr, daddr, 64, &[], ICMPV6, &m)
}

pub const ICMPV6: u8 = 58;

/// What the datapath produced as IPv6, decoded: the extension headers walked (0, 43, 44, 60).
#[derive(Debug, Clone)]
pub struct Decoded6 {
    pub dst_mac: [u8; 6],
    pub src_mac: [u8; 6],
    pub hop_limit: u8,
    pub saddr: Ipv6Addr,
    pub daddr: Ipv6Addr,
    /// The L4 protocol (after the extension headers).
    pub proto: u8,
    /// From the L4 header to the end of the IPv6 payload.
    pub l4: Vec<u8>,
}

impl Decoded6 {
    pub fn parse(frame: &[u8]) -> Self {
        assert!(frame.len() >= ETH_HLEN + 40, "frame too short for IPv6");
        assert_eq!(
            u16::from_be_bytes([frame[12], frame[13]]),
            ETH_P_IPV6,
            "EtherType is not IPv6"
        );
        let ip = &frame[ETH_HLEN..];
        assert_eq!(ip[0] >> 4, 6, "IP version");
        let payload_len = u16::from_be_bytes([ip[4], ip[5]]) as usize;
        assert!(
            40 + payload_len <= ip.len(),
            "IPv6 payload length beyond the frame"
        );
        let (mut next, mut off) = (ip[6], 40);
        while matches!(next, 0 | 43 | 44 | 60) {
            let len = if next == 44 {
                8
            } else {
                (ip[off + 1] as usize + 1) * 8
            };
            next = ip[off];
            off += len;
        }
        Self {
            dst_mac: frame[0..6].try_into().unwrap(),
            src_mac: frame[6..12].try_into().unwrap(),
            hop_limit: ip[7],
            saddr: Ipv6Addr::from(<[u8; 16]>::try_from(&ip[8..24]).unwrap()),
            daddr: Ipv6Addr::from(<[u8; 16]>::try_from(&ip[24..40]).unwrap()),
            proto: next,
            l4: ip[off..40 + payload_len].to_vec(),
        }
    }

    pub fn sport(&self) -> u16 {
        u16::from_be_bytes([self.l4[0], self.l4[1]])
    }

    pub fn dport(&self) -> u16 {
        u16::from_be_bytes([self.l4[2], self.l4[3]])
    }

    pub fn l4_csum_field(&self) -> u16 {
        let off = match self.proto {
            proto::TCP => 16,
            proto::UDP => 6,
            _ => 2,
        };
        u16::from_be_bytes([self.l4[off], self.l4[off + 1]])
    }

    /// The TCP/UDP/ICMPv6 checksum verifies over the pseudo-header (0 is never valid on IPv6).
    pub fn l4_csum_ok(&self) -> bool {
        if self.proto == proto::UDP && self.l4_csum_field() == 0 {
            return false;
        }
        csum::l4_v6(
            self.saddr.octets(),
            self.daddr.octets(),
            self.proto,
            &self.l4,
        ) == 0
    }
}
