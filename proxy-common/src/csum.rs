//! Internet checksum arithmetic (RFC 1071 / RFC 1624), used by host tests to check the packets the
//! datapath writes, and by the datapath to build ICMP errors.

/// One's-complement sum of `data` (big-endian 16-bit words, odd byte padded), added to `initial`.
/// Returns the unfolded 32-bit accumulator.
pub fn sum(data: &[u8], initial: u32) -> u32 {
    let mut acc = initial as u64;
    let mut chunks = data.chunks_exact(2);
    for w in &mut chunks {
        acc += u16::from_be_bytes([w[0], w[1]]) as u64;
    }
    if let [last] = chunks.remainder() {
        acc += (*last as u64) << 8;
    }
    fold64(acc)
}

const fn fold64(mut acc: u64) -> u32 {
    while acc > 0xffff_ffff {
        acc = (acc & 0xffff_ffff) + (acc >> 32);
    }
    acc as u32
}

/// Fold a 32-bit accumulator into the final 16-bit checksum (complemented).
pub const fn fold(mut acc: u32) -> u16 {
    acc = (acc & 0xffff) + (acc >> 16);
    acc = (acc & 0xffff) + (acc >> 16);
    !(acc as u16)
}

/// Checksum of an IPv4 header (its checksum field must be zero, or the result is 0 when valid).
pub fn ipv4_header(header: &[u8]) -> u16 {
    fold(sum(header, 0))
}

/// TCP/UDP checksum over the pseudo-header and `segment` (the L4 header with its checksum field
/// zeroed, plus payload). A result of 0 over a segment with its checksum in place means valid.
pub fn l4(saddr: [u8; 4], daddr: [u8; 4], proto: u8, segment: &[u8]) -> u16 {
    let mut pseudo = [0u8; 12];
    pseudo[0..4].copy_from_slice(&saddr);
    pseudo[4..8].copy_from_slice(&daddr);
    pseudo[9] = proto;
    pseudo[10..12].copy_from_slice(&(segment.len() as u16).to_be_bytes());
    fold(sum(segment, sum(&pseudo, 0)))
}

/// TCP/UDP/ICMPv6 checksum over the IPv6 pseudo-header (RFC 8200 8.1) and `segment` (checksum
/// field zeroed, or in place: then 0 means valid).
pub fn l4_v6(saddr: [u8; 16], daddr: [u8; 16], next_header: u8, segment: &[u8]) -> u16 {
    let mut pseudo = [0u8; 40];
    pseudo[0..16].copy_from_slice(&saddr);
    pseudo[16..32].copy_from_slice(&daddr);
    pseudo[32..36].copy_from_slice(&(segment.len() as u32).to_be_bytes());
    pseudo[39] = next_header;
    fold(sum(segment, sum(&pseudo, 0)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ipv4_header_checksum_matches_rfc1071_example() {
        // A well-known header: 45 00 00 73 00 00 40 00 40 11 [b8 61] c0 a8 00 01 c0 a8 00 c7
        let mut h = [
            0x45, 0x00, 0x00, 0x73, 0x00, 0x00, 0x40, 0x00, 0x40, 0x11, 0x00, 0x00, 0xc0, 0xa8,
            0x00, 0x01, 0xc0, 0xa8, 0x00, 0xc7,
        ];
        assert_eq!(ipv4_header(&h), 0xb861);
        h[10..12].copy_from_slice(&0xb861u16.to_be_bytes());
        assert_eq!(ipv4_header(&h), 0, "a valid header sums to zero");
    }

    #[test]
    fn l4_checksum_validates_to_zero_with_the_field_in_place() {
        let saddr = [10, 0, 0, 1];
        let daddr = [10, 0, 0, 2];
        let mut udp = [
            0x30, 0x39, 0x00, 0x35, 0x00, 0x0b, 0x00, 0x00, b'a', b'b', b'c',
        ];
        let c = l4(saddr, daddr, 17, &udp);
        udp[6..8].copy_from_slice(&c.to_be_bytes());
        assert_eq!(l4(saddr, daddr, 17, &udp), 0);
    }

    #[test]
    fn ipv6_l4_checksum_validates_to_zero_with_the_field_in_place() {
        let mut saddr = [0u8; 16];
        saddr[0] = 0xfd;
        saddr[15] = 1;
        let mut daddr = saddr;
        daddr[15] = 2;
        let mut udp = [
            0x30, 0x39, 0x00, 0x35, 0x00, 0x0b, 0x00, 0x00, b'a', b'b', b'c',
        ];
        let c = l4_v6(saddr, daddr, 17, &udp);
        udp[6..8].copy_from_slice(&c.to_be_bytes());
        assert_eq!(l4_v6(saddr, daddr, 17, &udp), 0);
        assert_ne!(
            l4_v6(daddr, saddr, 6, &udp),
            0,
            "the next header is covered"
        );
    }
}
