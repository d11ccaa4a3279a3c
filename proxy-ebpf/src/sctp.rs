//! SCTP rewrites. SCTP has no 16-bit checksum and no pseudo-header: its CRC32c covers the SCTP
//! packet only. An address rewrite therefore fixes only the IP header; a port rewrite updates
//! the CRC32c from the change (`proxy_common::crc32c::adjust`, O(1) in the packet length)
//! instead of recomputing it over the whole packet. The offsets are the caller's, so both
//! families use [`rewrite_port`]; the CRC32c is read with `bpf_skb_load_bytes`, which takes any
//! offset (the IPv6 L4 offset comes back from the per-CPU scratch, unbounded for a direct
//! packet read).
//!
//! Stores use `BPF_F_RECOMPUTE_CSUM`: on a CHECKSUM_COMPLETE skb, `skb->csum` (a one's-complement
//! sum over the packet, which SCTP's CRC does not replace) follows the bytes that changed.

use aya_ebpf::{bindings::BPF_F_RECOMPUTE_CSUM, programs::TcContext};
use proxy_common::crc32c;

use crate::{Drop, packet::SCTP_CSUM};

/// Replace the port at `port_off` (the SCTP source port at `l4_off`, or the destination port at
/// `l4_off + 2`) and update the CRC32c of the SCTP packet of `sctp_len` bytes at `l4_off`.
#[inline(always)]
pub fn rewrite_port(
    ctx: &TcContext,
    l4_off: usize,
    sctp_len: u16,
    port_off: usize,
    old: [u8; 2],
    new: [u8; 2],
) -> Result<(), Drop> {
    let field: [u8; 4] = ctx
        .load(l4_off + SCTP_CSUM)
        .map_err(|_| Drop::RewriteFailed)?;
    let d = [old[0] ^ new[0], old[1] ^ new[1]];
    // The changed half of the first word (source port | destination port).
    let delta = if port_off == l4_off {
        [d[0], d[1], 0, 0]
    } else {
        [0, 0, d[0], d[1]]
    };
    let field = crc32c::adjust(field, delta, sctp_len as u32);
    ctx.store(port_off, &new, BPF_F_RECOMPUTE_CSUM as u64)
        .map_err(|_| Drop::RewriteFailed)?;
    ctx.store(l4_off + SCTP_CSUM, &field, BPF_F_RECOMPUTE_CSUM as u64)
        .map_err(|_| Drop::RewriteFailed)
}
