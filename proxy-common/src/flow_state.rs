//! Flow state transitions (`ct_state::*`), one rule for the conntrack and SNAT entries: the
//! client's packets move a flow by [`after_client`], the backend's by [`after_backend`]. As in
//! netfilter, a connection is ESTABLISHED only after SYN, SYN-ACK (SYN_RECV) and the client's
//! ACK: a SYN followed by a bare ACK without an answer stays an opening flow (transitory
//! timeout), and cannot hold an entry or a SNAT port for the established timeout. An entry that
//! never sees the backend's packets (a flow straight to a pod, a SNAT `out` entry) moves by
//! [`after_client_one_way`], where the client's ACK after its SYN stands for the handshake. A FIN
//! from one side half-closes the flow (`FIN_ORIGINAL` / `FIN_REPLY`: the other side may still
//! send, for kube-proxy's `tcpCloseWaitTimeout`); a FIN from the other side too, or a RST, closes
//! it (`CLOSING`, the transitory timeout).
//!
//! SCTP flows use the same rule, their packet's chunks read as TCP flags by the datapath
//! ([`SctpChunks`]; netfilter's SCTP states, folded onto these): INIT → SYN (SYN_SENT =
//! COOKIE_WAIT), INIT_ACK → SYN-ACK (SYN_RECV, the cookie on its way), any later client chunk
//! (COOKIE_ECHO, DATA) → ESTABLISHED, SHUTDOWN and
//! SHUTDOWN_ACK → FIN (SHUTDOWN_SENT/RECD/ACK_SENT), ABORT and SHUTDOWN_COMPLETE → RST (CLOSED).
//! Their timeouts are SCTP's (see `timeouts`).

use crate::{ct_flags, ct_state};

/// TCP flag bits as on the wire (byte 13 of the TCP header).
mod tcp_bits {
    pub const FIN: u8 = 0x01;
    pub const SYN: u8 = 0x02;
    pub const RST: u8 = 0x04;
    pub const ACK: u8 = 0x10;
}

/// SCTP chunk types that move a flow's state (RFC 9260 section 3.2).
pub mod sctp_chunk {
    pub const DATA: u8 = 0;
    pub const INIT: u8 = 1;
    pub const INIT_ACK: u8 = 2;
    pub const HEARTBEAT: u8 = 4;
    pub const ABORT: u8 = 6;
    pub const SHUTDOWN: u8 = 7;
    pub const SHUTDOWN_ACK: u8 = 8;
    pub const COOKIE_ECHO: u8 = 10;
    pub const COOKIE_ACK: u8 = 11;
    pub const SHUTDOWN_COMPLETE: u8 = 14;
}

/// An SCTP chunk read as TCP flags, so that one state machine serves both: INIT starts an
/// association (SYN), INIT_ACK answers it (SYN+ACK), SHUTDOWN and SHUTDOWN_ACK close one side
/// each (FIN), ABORT and SHUTDOWN_COMPLETE end it (RST); anything else (DATA, SACK, COOKIE_ECHO,
/// HEARTBEAT…) is mid-association (ACK). A packet's chunks are folded by [`SctpChunks`].
#[inline(always)]
pub const fn sctp_chunk_flags(chunk_type: u8) -> u8 {
    use tcp_bits::*;
    match chunk_type {
        sctp_chunk::INIT => SYN,
        sctp_chunk::INIT_ACK => SYN | ACK,
        sctp_chunk::SHUTDOWN | sctp_chunk::SHUTDOWN_ACK => FIN | ACK,
        sctp_chunk::ABORT | sctp_chunk::SHUTDOWN_COMPLETE => RST | ACK,
        _ => ACK,
    }
}

/// Chunks after the first that the datapath reads for a packet's state (a bound for the
/// verifier; netfilter walks them all). A SHUTDOWN or ABORT bundled further back is missed, and
/// the flow then ends by its idle timeout.
pub const SCTP_BUNDLED_CHUNKS: usize = 3;

/// The SCTP common header's length; chunk offsets below count from its start.
const SCTP_COMMON_HLEN: usize = 12;

/// One SCTP packet's chunks folded into TCP flags, as netfilter's SCTP tracker reads them
/// (`do_basic_checks` and the per-chunk state walk of `nf_conntrack_proto_sctp.c`): a packet is
/// invalid (`None`; netfilter marks it INVALID and kube-proxy's rules drop it) when a chunk has
/// length 0, when INIT, INIT_ACK or SHUTDOWN_COMPLETE is bundled with any other chunk, or when
/// COOKIE_ECHO or COOKIE_ACK is not the first. Of the valid bundles an ABORT (or
/// SHUTDOWN_COMPLETE) anywhere ends the association (RST), else a SHUTDOWN or SHUTDOWN_ACK shuts
/// it down (FIN), else the first chunk decides: DATA + SHUTDOWN shuts down, SACK + ABORT aborts,
/// as netfilter's walk of the same chunks ends.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SctpChunks {
    flags: u8,
    /// The first chunk must be alone (INIT, INIT_ACK, SHUTDOWN_COMPLETE).
    alone: bool,
    /// Offset of the next chunk from the SCTP header's start.
    next: usize,
}

impl SctpChunks {
    /// The packet's first chunk, of `chunk_type` and `len` bytes (its length field).
    #[inline(always)]
    pub const fn first(chunk_type: u8, len: u16) -> Option<Self> {
        if len == 0 {
            return None;
        }
        Some(Self {
            flags: sctp_chunk_flags(chunk_type),
            alone: matches!(
                chunk_type,
                sctp_chunk::INIT | sctp_chunk::INIT_ACK | sctp_chunk::SHUTDOWN_COMPLETE
            ),
            next: SCTP_COMMON_HLEN + padded(len),
        })
    }

    /// One more chunk, of `chunk_type` and `len` bytes, at [`Self::next_offset`].
    #[inline(always)]
    pub const fn bundled(self, chunk_type: u8, len: u16) -> Option<Self> {
        use tcp_bits::*;
        let must_be_first = matches!(
            chunk_type,
            sctp_chunk::INIT
                | sctp_chunk::INIT_ACK
                | sctp_chunk::SHUTDOWN_COMPLETE
                | sctp_chunk::COOKIE_ECHO
                | sctp_chunk::COOKIE_ACK
        );
        if len == 0 || self.alone || must_be_first {
            return None;
        }
        let more = sctp_chunk_flags(chunk_type);
        let flags = if (self.flags | more) & RST != 0 {
            RST | ACK
        } else if more & FIN != 0 {
            FIN | ACK
        } else {
            self.flags
        };
        Some(Self {
            flags,
            alone: false,
            next: self.next + padded(len),
        })
    }

    /// Where the next chunk would start, from the SCTP header's start (beyond the packet: none).
    #[inline(always)]
    pub const fn next_offset(&self) -> usize {
        self.next
    }

    /// The packet's chunks as TCP flags.
    #[inline(always)]
    pub const fn flags(&self) -> u8 {
        self.flags
    }
}

/// A chunk's length field rounded up to the 4-byte boundary the next chunk starts at.
#[inline(always)]
const fn padded(len: u16) -> usize {
    (len as usize + 3) & !3
}

/// The [`Segment`] of TCP flags (or of an SCTP chunk's [`sctp_chunk_flags`]).
#[inline(always)]
pub const fn segment_of(flags: u8) -> Segment {
    Segment {
        syn: flags & tcp_bits::SYN != 0,
        ack: flags & tcp_bits::ACK != 0,
        fin: flags & tcp_bits::FIN != 0,
        rst: flags & tcp_bits::RST != 0,
    }
}

/// The flags of a TCP segment that move a flow's state.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Segment {
    pub syn: bool,
    pub ack: bool,
    pub fin: bool,
    pub rst: bool,
}

/// A FIN from one side: half-closed, or closed if the other side has sent its FIN already.
#[inline(always)]
fn fin(state: u8, own: u8, other: u8) -> u8 {
    if state == other || state == ct_state::CLOSING {
        ct_state::CLOSING
    } else {
        own
    }
}

/// State after a client packet (ORIGINAL direction) of a flow whose backend packets move it
/// too ([`after_backend`]); `tcp` is `None` for UDP.
#[inline(always)]
pub fn after_client(state: u8, tcp: Option<Segment>) -> u8 {
    client_moves(state, tcp, Sight::BothWays)
}

/// [`after_client`] for an entry that never sees the backend's packets: the client's ACK after
/// its SYN finishes the handshake as far as it can tell, and the client's FIN closes the flow
/// (the backend's FIN, which would close a half-closed flow, never reaches the entry: it would
/// otherwise hold the close-wait timeout after every connection). While the backend still
/// sends, the client's ACKs keep the entry fresh.
#[inline(always)]
pub fn after_client_one_way(state: u8, tcp: Option<Segment>) -> u8 {
    client_moves(state, tcp, Sight::OneWay)
}

/// Which of a flow's packets move an entry.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Sight {
    /// The client's and the backend's.
    BothWays,
    /// The client's only.
    OneWay,
}

/// A client packet's move. Its ACK establishes the flow once the handshake waits only for it
/// (SYN_RECV; SYN_SENT when the answer cannot be seen) or from no state yet (a flow first seen
/// mid-connection, which netfilter's loose pickup takes as established).
#[inline(always)]
fn client_moves(state: u8, tcp: Option<Segment>, sight: Sight) -> u8 {
    let Some(seg) = tcp else {
        return ct_state::UDP;
    };
    let answered = match sight {
        Sight::BothWays => ct_state::SYN_RECV,
        Sight::OneWay => ct_state::SYN_SENT,
    };
    if seg.rst || (seg.fin && sight == Sight::OneWay) {
        ct_state::CLOSING
    } else if seg.fin {
        fin(state, ct_state::FIN_ORIGINAL, ct_state::FIN_REPLY)
    } else if seg.syn {
        ct_state::SYN_SENT
    } else if state == answered || state == ct_state::UDP {
        ct_state::ESTABLISHED
    } else {
        state
    }
}

/// State after a backend packet (REPLY direction): its SYN-ACK answers an opening flow
/// (SYN_RECV); otherwise only FIN and RST move it.
#[inline(always)]
pub fn after_backend(state: u8, tcp: Option<Segment>) -> u8 {
    match tcp {
        Some(seg) if seg.rst => ct_state::CLOSING,
        Some(seg) if seg.fin => fin(state, ct_state::FIN_REPLY, ct_state::FIN_ORIGINAL),
        Some(seg) if seg.syn && seg.ack && state == ct_state::SYN_SENT => ct_state::SYN_RECV,
        _ => state,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ct_state::*;

    const fn seg(flags: u8) -> Option<Segment> {
        Some(segment_of(flags))
    }
    const ACK: Option<Segment> = seg(tcp_bits::ACK);
    const SYN: Option<Segment> = seg(tcp_bits::SYN);
    const SYN_ACK: Option<Segment> = seg(tcp_bits::SYN | tcp_bits::ACK);
    const FIN: Option<Segment> = seg(tcp_bits::FIN | tcp_bits::ACK);
    const RST: Option<Segment> = seg(tcp_bits::RST);

    #[test]
    fn a_normal_close_half_closes_then_closes_whoever_starts() {
        let s = after_client(UDP, SYN);
        assert_eq!(s, SYN_SENT);
        let s = after_backend(s, SYN_ACK);
        assert_eq!(s, SYN_RECV, "the SYN-ACK does not finish the handshake");
        assert_eq!(after_backend(s, SYN_ACK), SYN_RECV, "SYN-ACK retransmit");
        let s = after_client(s, ACK);
        assert_eq!(s, ESTABLISHED);
        // The client closes first.
        let half = after_client(s, FIN);
        assert_eq!(half, FIN_ORIGINAL);
        assert_eq!(
            after_backend(half, ACK),
            FIN_ORIGINAL,
            "backend still sends"
        );
        assert_eq!(after_client(half, ACK), FIN_ORIGINAL);
        assert_eq!(after_client(half, FIN), FIN_ORIGINAL, "FIN retransmit");
        assert_eq!(after_backend(half, FIN), CLOSING);
        // The backend closes first.
        let half = after_backend(s, FIN);
        assert_eq!(half, FIN_REPLY);
        assert_eq!(after_client(half, ACK), FIN_REPLY, "client still sends");
        assert_eq!(after_backend(half, FIN), FIN_REPLY);
        assert_eq!(after_client(half, FIN), CLOSING);
        // Closed stays closed, whoever sends.
        for seg in [ACK, FIN] {
            assert_eq!(after_client(CLOSING, seg), CLOSING);
            assert_eq!(after_backend(CLOSING, seg), CLOSING);
        }
    }

    #[test]
    fn bundled_sctp_chunks_fold_like_netfilter_s_walk() {
        use super::{SctpChunks, sctp_chunk::*, tcp_bits::*};
        let fold = |chunks: &[(u8, u16)]| {
            let (&(t, len), rest) = chunks.split_first().unwrap();
            let mut c = SctpChunks::first(t, len)?;
            for &(t, len) in rest {
                c = c.bundled(t, len)?;
            }
            Some(c.flags())
        };
        assert_eq!(fold(&[(DATA, 20)]), Some(ACK));
        assert_eq!(fold(&[(DATA, 20), (SHUTDOWN, 8)]), Some(FIN | ACK));
        assert_eq!(fold(&[(3 /* SACK */, 16), (ABORT, 4)]), Some(RST | ACK));
        assert_eq!(fold(&[(SHUTDOWN, 8), (ABORT, 4)]), Some(RST | ACK));
        assert_eq!(fold(&[(ABORT, 4), (DATA, 20)]), Some(RST | ACK));
        assert_eq!(fold(&[(COOKIE_ECHO, 36), (DATA, 20)]), Some(ACK));
        assert_eq!(fold(&[(INIT, 20)]), Some(SYN));
        // Invalid bundles (netfilter's do_basic_checks).
        assert_eq!(fold(&[(INIT, 20), (DATA, 20)]), None, "INIT not alone");
        assert_eq!(fold(&[(DATA, 20), (INIT, 20)]), None);
        assert_eq!(fold(&[(INIT_ACK, 20), (DATA, 20)]), None);
        assert_eq!(fold(&[(DATA, 20), (SHUTDOWN_COMPLETE, 4)]), None);
        assert_eq!(
            fold(&[(DATA, 20), (COOKIE_ECHO, 36)]),
            None,
            "COOKIE_ECHO not first"
        );
        assert_eq!(fold(&[(DATA, 20), (COOKIE_ACK, 4)]), None);
        assert_eq!(fold(&[(DATA, 0)]), None, "zero length");
        assert_eq!(fold(&[(DATA, 20), (SHUTDOWN, 0)]), None);
        // Offsets: 12-byte header, lengths padded to 4.
        let c = SctpChunks::first(DATA, 17).unwrap();
        assert_eq!(c.next_offset(), 12 + 20);
        assert_eq!(c.bundled(DATA, 4).unwrap().next_offset(), 12 + 20 + 4);
    }

    #[test]
    fn sctp_associations_open_shut_down_and_abort_like_netfilter_s() {
        use super::sctp_chunk::*;
        let c = |s, chunk| after_client(s, Some(segment_of(sctp_chunk_flags(chunk))));
        let b = |s, chunk| after_backend(s, Some(segment_of(sctp_chunk_flags(chunk))));
        let s = c(UDP, INIT);
        assert_eq!(s, SYN_SENT, "INIT: COOKIE_WAIT");
        let s = b(s, INIT_ACK);
        assert_eq!(s, SYN_RECV, "INIT_ACK: answered, still opening");
        let s = c(s, COOKIE_ECHO);
        assert_eq!(s, ESTABLISHED);
        for chunk in [DATA, HEARTBEAT, COOKIE_ACK] {
            assert_eq!(c(s, chunk), ESTABLISHED);
            assert_eq!(b(s, chunk), ESTABLISHED);
        }
        let half = c(s, SHUTDOWN);
        assert_eq!(half, FIN_ORIGINAL, "SHUTDOWN_SENT");
        assert_eq!(b(half, DATA), FIN_ORIGINAL, "the backend still sends");
        let closed = b(half, SHUTDOWN_ACK);
        assert_eq!(closed, CLOSING);
        assert_eq!(c(closed, SHUTDOWN_COMPLETE), CLOSING);
        assert_eq!(b(s, SHUTDOWN), FIN_REPLY, "the backend shuts down first");
        for s in [SYN_SENT, ESTABLISHED, FIN_ORIGINAL, FIN_REPLY] {
            assert_eq!(c(s, ABORT), CLOSING);
            assert_eq!(b(s, ABORT), CLOSING);
            assert_eq!(c(s, INIT), SYN_SENT, "a new INIT restarts");
        }
    }

    #[test]
    fn only_an_answered_syn_is_established_by_the_client_s_ack() {
        let s = after_client(UDP, SYN);
        assert_eq!(
            after_client(s, ACK),
            SYN_SENT,
            "SYN then a bare ACK: no answer seen"
        );
        assert_eq!(
            after_backend(s, ACK),
            SYN_SENT,
            "an ACK without SYN is no answer"
        );
        assert_eq!(
            after_backend(ESTABLISHED, SYN_ACK),
            ESTABLISHED,
            "a late SYN-ACK does not reopen"
        );
        assert_eq!(after_client(SYN_RECV, SYN), SYN_SENT, "SYN retransmit");
        assert_eq!(after_client(SYN_RECV, RST), CLOSING);
        // Entries that never see the backend: the client's ACK stands for the handshake.
        assert_eq!(after_client_one_way(s, ACK), ESTABLISHED);
        assert_eq!(after_client_one_way(UDP, SYN), SYN_SENT);
        assert_eq!(
            after_client_one_way(ESTABLISHED, FIN),
            CLOSING,
            "the client's FIN closes what cannot see the backend's"
        );
        assert_eq!(after_client_one_way(CLOSING, ACK), CLOSING);
        // Picked up mid-connection: established at once, as netfilter's loose pickup.
        assert_eq!(after_client(UDP, ACK), ESTABLISHED);
    }

    #[test]
    fn rst_closes_syn_reopens_udp_has_no_state() {
        for s in [SYN_SENT, SYN_RECV, ESTABLISHED, FIN_ORIGINAL, FIN_REPLY] {
            assert_eq!(after_client(s, RST), CLOSING);
            assert_eq!(after_backend(s, RST), CLOSING);
            assert_eq!(after_client(s, SYN), SYN_SENT);
        }
        assert_eq!(after_client(ESTABLISHED, None), UDP);
        assert_eq!(after_backend(UDP, None), UDP);
        assert_eq!(after_client(UDP, ACK), ESTABLISHED, "mid-flow first packet");
    }
}

/// Who translates a flow taken over from netfilter, by its entry's flags (`ct_flags::NETFILTER`,
/// `ct_flags::HANDOFF`, on its ORIGINAL conntrack entry and its SNAT `in` entry).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TakenOver {
    /// netfilter still does: the packet passes untouched.
    Netfilter,
    /// netfilter's entry is being deleted: the packet is dropped.
    Handoff,
}

/// `None` for a flow the datapath translates itself (every flow it started).
#[inline(always)]
pub const fn taken_over(flags: u8) -> Option<TakenOver> {
    if flags & ct_flags::HANDOFF != 0 {
        Some(TakenOver::Handoff)
    } else if flags & ct_flags::NETFILTER != 0 {
        Some(TakenOver::Netfilter)
    } else {
        None
    }
}
