//! SCTP rewrites. SCTP has no 16-bit checksum and no pseudo-header: its CRC32c covers the SCTP
//! packet only. An address rewrite therefore fixes only the IP header; a port rewrite updates
//! the CRC32c from the change (`proxy_common::crc32c::adjust`, O(1) in the packet length)
//! instead of recomputing it over the whole packet. The offsets are the caller's, so both
//! families use [`rewrite_port`]; the CRC32c is read with `bpf_skb_load_bytes`, which takes any
//! offset (the IPv6 L4 offset comes back from the per-CPU scratch, unbounded for a direct
//! packet read).
//!
//! A CRC32c field of 0 is left as it is: that is how an SCTP packet the node's stack leaves to
//! offload (CHECKSUM_PARTIAL, `csum_not_inet`: pods' SCTP over veth) carries it. The CRC is
//! computed once the packet reaches a device without SCTP CRC offload (vxlan, virtio, most
//! NICs), over the rewritten bytes; updating the placeholder would write a value that is neither
//! (netfilter leaves CHECKSUM_PARTIAL SCTP packets to the same computation). A real CRC32c of 0
//! (one packet in 2^32) is left unupdated and dropped by the receiver as a bad checksum, then
//! retransmitted like any loss.
//!
//! Stores use `BPF_F_RECOMPUTE_CSUM`: on a CHECKSUM_COMPLETE skb, `skb->csum` (a one's-complement
//! sum over the packet, which SCTP's CRC does not replace) follows the bytes that changed.

use aya_ebpf::{bindings::BPF_F_RECOMPUTE_CSUM, programs::TcContext};
use proxy_common::{
    crc32c,
    flow_state::{SCTP_BUNDLED_CHUNKS, SctpChunks},
};

use crate::{Drop, packet::SCTP_CSUM};

/// The CRC32c field of an SCTP packet whose CRC is left to offload (see the module docs).
const CRC_LEFT_TO_OFFLOAD: [u8; 4] = [0; 4];

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
    ctx.store(port_off, &new, BPF_F_RECOMPUTE_CSUM as u64)
        .map_err(|_| Drop::RewriteFailed)?;
    if field == CRC_LEFT_TO_OFFLOAD {
        return Ok(());
    }
    let field = crc32c::adjust(field, delta, sctp_len as u32);
    ctx.store(l4_off + SCTP_CSUM, &field, BPF_F_RECOMPUTE_CSUM as u64)
        .map_err(|_| Drop::RewriteFailed)
}

/// The TCP flags standing for the state of the SCTP packet of `l4_len` bytes at `l4_off`, whose
/// first chunk header is `first`: its bundled chunks walked (up to [`SCTP_BUNDLED_CHUNKS`] after
/// the first, read with `bpf_skb_load_bytes`), folded as netfilter does ([`SctpChunks`]).
/// `None`: an invalid bundle (netfilter's INVALID), dropped when to a Service.
#[inline(always)]
pub fn packet_flags(ctx: &TcContext, l4_off: usize, l4_len: usize, first: [u8; 4]) -> Option<u8> {
    let mut chunks = SctpChunks::first(first[0], u16::from_be_bytes([first[2], first[3]]))?;
    for _ in 0..SCTP_BUNDLED_CHUNKS {
        let off = chunks.next_offset();
        if off + 4 > l4_len {
            break;
        }
        let h: [u8; 4] = ctx.load(l4_off + off).ok()?;
        chunks = chunks.bundled(h[0], u16::from_be_bytes([h[2], h[3]]))?;
    }
    Some(chunks.flags())
}
