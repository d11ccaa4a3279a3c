//! A minimal Ethernet + IPv4 + TCP frame builder with valid checksums, for BPF_PROG_TEST_RUN
//! (the full builder with options, UDP and a parser lives in proxy-userspace's tests).

use std::net::{Ipv4Addr, Ipv6Addr};

pub const SYN: u8 = 0x02;
pub const ACK: u8 = 0x10;

fn fold(mut sum: u32) -> u16 {
    while sum > 0xffff {
        sum = (sum & 0xffff) + (sum >> 16);
    }
    !(sum as u16)
}

fn sum16(data: &[u8]) -> u32 {
    data.chunks(2)
        .map(|c| u32::from(u16::from_be_bytes([c[0], *c.get(1).unwrap_or(&0)])))
        .sum()
}

/// One TCP segment in an Ethernet frame (client MAC → host MAC).
pub fn tcp(
    saddr: Ipv4Addr,
    sport: u16,
    daddr: Ipv4Addr,
    dport: u16,
    flags: u8,
    payload: &[u8],
) -> Vec<u8> {
    let mut tcp = Vec::with_capacity(20 + payload.len());
    tcp.extend(sport.to_be_bytes());
    tcp.extend(dport.to_be_bytes());
    tcp.extend(1000u32.to_be_bytes());
    tcp.extend(if flags & ACK != 0 { 5000u32 } else { 0 }.to_be_bytes());
    tcp.extend([5 << 4, flags]);
    tcp.extend(64_240u16.to_be_bytes());
    tcp.extend([0, 0, 0, 0]); // checksum, urgent pointer
    tcp.extend_from_slice(payload);
    let mut pseudo = Vec::with_capacity(12);
    pseudo.extend(saddr.octets());
    pseudo.extend(daddr.octets());
    pseudo.extend([0, 6]);
    pseudo.extend((tcp.len() as u16).to_be_bytes());
    let csum = fold(sum16(&pseudo) + sum16(&tcp));
    tcp[16..18].copy_from_slice(&csum.to_be_bytes());

    let mut ip = Vec::with_capacity(20);
    ip.extend([0x45, 0]);
    ip.extend(((20 + tcp.len()) as u16).to_be_bytes());
    ip.extend([0, 1, 0x40, 0, 64, 6, 0, 0]);
    ip.extend(saddr.octets());
    ip.extend(daddr.octets());
    let csum = fold(sum16(&ip));
    ip[10..12].copy_from_slice(&csum.to_be_bytes());

    let mut frame = Vec::with_capacity(14 + ip.len() + tcp.len());
    frame.extend([0x02, 0, 0, 0, 0, 0x02, 0x02, 0, 0, 0, 0, 0x01, 0x08, 0x00]);
    frame.extend(ip);
    frame.extend(tcp);
    frame
}

/// One TCP segment over IPv6 in an Ethernet frame (client MAC → host MAC).
pub fn tcp6(
    saddr: Ipv6Addr,
    sport: u16,
    daddr: Ipv6Addr,
    dport: u16,
    flags: u8,
    payload: &[u8],
) -> Vec<u8> {
    let mut tcp = Vec::with_capacity(20 + payload.len());
    tcp.extend(sport.to_be_bytes());
    tcp.extend(dport.to_be_bytes());
    tcp.extend(1000u32.to_be_bytes());
    tcp.extend(if flags & ACK != 0 { 5000u32 } else { 0 }.to_be_bytes());
    tcp.extend([5 << 4, flags]);
    tcp.extend(64_240u16.to_be_bytes());
    tcp.extend([0, 0, 0, 0]);
    tcp.extend_from_slice(payload);
    let mut pseudo = Vec::with_capacity(40);
    pseudo.extend(saddr.octets());
    pseudo.extend(daddr.octets());
    pseudo.extend((tcp.len() as u32).to_be_bytes());
    pseudo.extend([0, 0, 0, 6]);
    let csum = fold(sum16(&pseudo) + sum16(&tcp));
    tcp[16..18].copy_from_slice(&csum.to_be_bytes());

    let mut frame = Vec::with_capacity(14 + 40 + tcp.len());
    frame.extend([0x02, 0, 0, 0, 0, 0x02, 0x02, 0, 0, 0, 0, 0x01, 0x86, 0xdd]);
    frame.extend([0x60, 0, 0, 0]);
    frame.extend((tcp.len() as u16).to_be_bytes());
    frame.extend([6, 64]);
    frame.extend(saddr.octets());
    frame.extend(daddr.octets());
    frame.extend(tcp);
    frame
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn checksums_verify() {
        let f = tcp(
            Ipv4Addr::new(10, 244, 1, 2),
            40000,
            Ipv4Addr::new(10, 96, 0, 10),
            80,
            SYN,
            b"abc",
        );
        assert_eq!(fold(sum16(&f[14..34])), 0);
        let tcp = &f[34..];
        let mut pseudo = vec![10, 244, 1, 2, 10, 96, 0, 10, 0, 6];
        pseudo.extend((tcp.len() as u16).to_be_bytes());
        assert_eq!(fold(sum16(&pseudo) + sum16(tcp)), 0);
    }

    #[test]
    fn ipv6_checksum_verifies() {
        let (src, dst) = (
            Ipv6Addr::new(0xfd00, 0x244, 1, 0, 0, 0, 0, 2),
            Ipv6Addr::new(0xfd00, 0x96, 0, 0, 0, 0, 0, 0x10),
        );
        let f = tcp6(src, 40000, dst, 80, SYN, b"abc");
        assert_eq!(&f[12..14], &[0x86, 0xdd]);
        assert_eq!(
            proxy_common::csum::l4_v6(src.octets(), dst.octets(), 6, &f[54..]),
            0
        );
    }
}
