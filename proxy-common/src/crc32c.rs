//! CRC32c (Castagnoli, RFC 9260 appendix A), the SCTP checksum, and its incremental update.
//!
//! The SCTP checksum covers the SCTP packet only (common header + chunks, checksum field as
//! zero), not the IP addresses: an address-only NAT keeps it valid, a port rewrite does not.
//! Recomputing it would read the whole packet per translated packet; instead the datapath
//! updates it from the change alone, using the linearity of CRCs: for two messages of one
//! length, `crc(A) ^ crc(B) = raw(A ^ B)`, where `raw` is the CRC without initial value and
//! final XOR. `A ^ B` is zero but for the changed 4-byte word `d` at `off`, so
//! `raw(A ^ B) = d(x) · x^(8·(len − off)) mod P`: one GF(2) multiply of `d` by a power of x
//! taken from two 256-entry tables (the distance's low and high byte), i.e. two multiplies of
//! 32 steps each, whatever the packet length ([`adjust`]).
//!
//! Bit order: CRC32c is reflected; a 32-bit value holds the coefficient of x^0 in its top bit
//! and of x^31 in bit 0, and a message word read little-endian is its polynomial in that order.
//! SCTP carries the CRC little-endian (`field == crc.to_le_bytes()`, as Linux writes it).

/// The CRC32c polynomial, reflected.
const POLY: u32 = 0x82f6_3b78;
/// x^0 (the polynomial 1) in the reflected order.
const ONE: u32 = 1 << 31;
/// x^8.
const X8: u32 = ONE >> 8;

/// `a · b mod P` (reflected order), branch-free: 32 steps of shift and masked XOR.
#[inline(always)]
pub const fn multiply(a: u32, mut b: u32) -> u32 {
    let mut product = 0u32;
    let mut i = 0;
    while i < 32 {
        // Coefficient of x^i in `a` (bit 31 − i) selects `b · x^i`.
        product ^= b & 0u32.wrapping_sub((a >> (31 - i)) & 1);
        b = (b >> 1) ^ (POLY & 0u32.wrapping_sub(b & 1));
        i += 1;
    }
    product
}

const fn powers(step: u32) -> [u32; 256] {
    let mut t = [0u32; 256];
    t[0] = ONE;
    let mut k = 1;
    while k < 256 {
        t[k] = multiply(t[k - 1], step);
        k += 1;
    }
    t
}

/// `X8K_LOW[k] = x^(8·k) mod P`.
static X8K_LOW: [u32; 256] = powers(X8);
/// `X8K_HIGH[k] = x^(8·256·k) mod P`.
static X8K_HIGH: [u32; 256] = powers(multiply(powers(X8)[255], X8));

/// `x^(8·bytes) mod P` for `bytes` < 65,536 (higher bits are ignored: an SCTP packet in IPv4 is
/// shorter; an IPv6 jumbogram is not carried).
#[inline(always)]
pub fn x_pow_8n(bytes: u32) -> u32 {
    let low = X8K_LOW.get((bytes & 0xff) as usize).copied().unwrap_or(ONE);
    let high = X8K_HIGH
        .get(((bytes >> 8) & 0xff) as usize)
        .copied()
        .unwrap_or(ONE);
    multiply(low, high)
}

/// The SCTP checksum field (`field`, as the packet holds it) after the 4-byte word at `off`
/// changed by `delta` (old XOR new bytes), in an SCTP packet of `len` bytes; `distance` is
/// `len − off` (4 ≤ distance < 65,536).
#[inline(always)]
pub fn adjust(field: [u8; 4], delta: [u8; 4], distance: u32) -> [u8; 4] {
    let change = multiply(u32::from_le_bytes(delta), x_pow_8n(distance));
    (u32::from_le_bytes(field) ^ change).to_le_bytes()
}

/// The checksum field after the source and/or destination port (the first word of the SCTP
/// common header) changed from `old` to `new`, in an SCTP packet of `len` bytes.
#[inline(always)]
pub fn adjust_ports(field: [u8; 4], old: [u8; 4], new: [u8; 4], len: u32) -> [u8; 4] {
    let delta = [
        old[0] ^ new[0],
        old[1] ^ new[1],
        old[2] ^ new[2],
        old[3] ^ new[3],
    ];
    adjust(field, delta, len)
}

const fn byte_table() -> [u32; 256] {
    let mut t = [0u32; 256];
    let mut n = 0;
    while n < 256 {
        let mut c = n as u32;
        let mut k = 0;
        while k < 8 {
            c = (c >> 1) ^ (POLY & 0u32.wrapping_sub(c & 1));
            k += 1;
        }
        t[n] = c;
        n += 1;
    }
    t
}

static BYTE_TABLE: [u32; 256] = byte_table();

/// CRC32c of `data` (initial value and final XOR 0xffffffff), byte-table driven. Host tests use
/// it to check what the datapath wrote; it reads the whole packet, so the datapath does not.
pub fn checksum(data: &[u8]) -> u32 {
    let mut crc = !0u32;
    for b in data {
        crc = (crc >> 8) ^ BYTE_TABLE[((crc ^ *b as u32) & 0xff) as usize];
    }
    !crc
}

/// The checksum field an SCTP packet (`sctp`: common header + chunks) should carry: CRC32c
/// over it with the field (bytes 8..12) as zero, little-endian.
pub fn sctp_field(sctp: &[u8]) -> [u8; 4] {
    let mut crc = !0u32;
    for (i, b) in sctp.iter().enumerate() {
        let b = if (8..12).contains(&i) { 0 } else { *b };
        crc = (crc >> 8) ^ BYTE_TABLE[((crc ^ b as u32) & 0xff) as usize];
    }
    (!crc).to_le_bytes()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn checksum_matches_the_standard_check_value_and_rfc_3720_vectors() {
        assert_eq!(checksum(b"123456789"), 0xe306_9283);
        assert_eq!(checksum(&[0u8; 32]), 0x8a91_36aa);
        assert_eq!(checksum(&[0xffu8; 32]), 0x62a8_ab43);
        let inc: Vec<u8> = (0u8..32).collect();
        assert_eq!(checksum(&inc), 0x46dd_794e);
    }

    #[test]
    fn powers_of_x_agree_with_repeated_multiplication() {
        let mut p = ONE;
        for n in 0..2000u32 {
            assert_eq!(x_pow_8n(n), p, "x^(8·{n})");
            p = multiply(p, X8);
        }
        assert_eq!(multiply(ONE, 0x1234_5678), 0x1234_5678, "1 is neutral");
        assert_eq!(
            multiply(0x1234_5678, 0x9abc_def0),
            multiply(0x9abc_def0, 0x1234_5678)
        );
    }

    /// A deterministic byte stream (xorshift), for packets of many lengths.
    fn bytes(seed: u32, len: usize) -> Vec<u8> {
        let mut x = seed | 1;
        (0..len)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 17;
                x ^= x << 5;
                x as u8
            })
            .collect()
    }

    #[test]
    fn adjusted_field_equals_the_recomputed_one_for_any_change_and_length() {
        for (seed, len) in [
            (1, 12),
            (2, 16),
            (3, 57),
            (4, 256),
            (5, 1480),
            (6, 9000),
            (7, 65515),
        ] {
            let mut pkt = bytes(seed, len);
            let field = sctp_field(&pkt);
            pkt[8..12].copy_from_slice(&field);
            for off in [0usize, 4, 12, len / 2, len - 4] {
                if off + 4 > len || (off < 12 && off + 4 > 8) {
                    continue; // past the end, or over the checksum field itself
                }
                let old: [u8; 4] = pkt[off..off + 4].try_into().unwrap();
                let new = [old[0] ^ 0x5a, old[1], old[2] ^ 0x01, old[3] ^ 0xff];
                let mut changed = pkt.clone();
                changed[off..off + 4].copy_from_slice(&new);
                let delta = [old[0] ^ new[0], 0, old[2] ^ new[2], old[3] ^ new[3]];
                let field = adjust(pkt[8..12].try_into().unwrap(), delta, (len - off) as u32);
                assert_eq!(field, sctp_field(&changed), "len {len}, word at {off}");
            }
        }
    }

    #[test]
    fn port_rewrites_keep_the_checksum_valid() {
        let mut pkt = bytes(9, 100);
        let field = sctp_field(&pkt);
        pkt[8..12].copy_from_slice(&field);
        let old: [u8; 4] = pkt[0..4].try_into().unwrap();
        for new in [
            [0x0b, 0xb8, old[2], old[3]],
            [old[0], old[1], 0x1f, 0x90],
            [1, 2, 3, 4],
            old,
        ] {
            let field = adjust_ports(pkt[8..12].try_into().unwrap(), old, new, 100);
            let mut changed = pkt.clone();
            changed[0..4].copy_from_slice(&new);
            changed[8..12].copy_from_slice(&field);
            assert_eq!(sctp_field(&changed), field);
        }
    }
}
