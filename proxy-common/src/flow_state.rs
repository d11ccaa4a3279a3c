//! Flow state transitions (`ct_state::*`), one rule for the conntrack and SNAT entries: the
//! client's packets move a flow by [`after_client`], the backend's by [`after_backend`]. A FIN
//! from one side half-closes the flow (`FIN_ORIGINAL` / `FIN_REPLY`: the other side may still
//! send, for kube-proxy's `tcpCloseWaitTimeout`); a FIN from the other side too, or a RST, closes
//! it (`CLOSING`, the transitory timeout).
//!
//! SCTP flows use the same rule, their packet's first chunk read as TCP flags by the datapath
//! (netfilter's SCTP states, folded onto these): INIT → SYN (SYN_SENT = COOKIE_WAIT and
//! COOKIE_ECHOED), any later client chunk (COOKIE_ECHO, DATA) → ESTABLISHED, SHUTDOWN and
//! SHUTDOWN_ACK → FIN (SHUTDOWN_SENT/RECD/ACK_SENT), ABORT and SHUTDOWN_COMPLETE → RST (CLOSED).
//! Their timeouts are SCTP's (see `timeouts`).

use crate::ct_state;

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

/// An SCTP packet's first chunk read as TCP flags, so that one state machine serves both: INIT
/// starts an association (SYN), INIT_ACK answers it (SYN+ACK), SHUTDOWN and SHUTDOWN_ACK close
/// one side each (FIN), ABORT and SHUTDOWN_COMPLETE end it (RST); anything else (DATA, SACK,
/// COOKIE_ECHO, HEARTBEAT…) is mid-association (ACK). Only the first chunk is read: INIT,
/// INIT_ACK and SHUTDOWN_COMPLETE are never bundled (RFC 9260 6.10); an ABORT or SHUTDOWN
/// bundled behind other chunks is missed, and the flow then ends by its idle timeout.
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

/// The [`Segment`] of TCP flags (or of an SCTP chunk's [`sctp_chunk_flags`]).
#[inline(always)]
pub const fn segment_of(flags: u8) -> Segment {
    Segment {
        syn: flags & tcp_bits::SYN != 0,
        fin: flags & tcp_bits::FIN != 0,
        rst: flags & tcp_bits::RST != 0,
    }
}

/// The flags of a TCP segment that move a flow's state.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Segment {
    pub syn: bool,
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

/// State after a client packet (ORIGINAL direction); `tcp` is `None` for UDP.
#[inline(always)]
pub fn after_client(state: u8, tcp: Option<Segment>) -> u8 {
    let Some(seg) = tcp else {
        return ct_state::UDP;
    };
    if seg.rst {
        ct_state::CLOSING
    } else if seg.fin {
        fin(state, ct_state::FIN_ORIGINAL, ct_state::FIN_REPLY)
    } else if seg.syn {
        ct_state::SYN_SENT
    } else if state == ct_state::SYN_SENT || state == ct_state::UDP {
        // The handshake's ACK, or the first packet we see of a flow (state 0 = no state yet).
        ct_state::ESTABLISHED
    } else {
        state
    }
}

/// State after a backend packet (REPLY direction): only FIN and RST move it.
#[inline(always)]
pub fn after_backend(state: u8, tcp: Option<Segment>) -> u8 {
    match tcp {
        Some(seg) if seg.rst => ct_state::CLOSING,
        Some(seg) if seg.fin => fin(state, ct_state::FIN_REPLY, ct_state::FIN_ORIGINAL),
        _ => state,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ct_state::*;

    const ACK: Option<Segment> = Some(Segment {
        syn: false,
        fin: false,
        rst: false,
    });
    const SYN: Option<Segment> = Some(Segment {
        syn: true,
        fin: false,
        rst: false,
    });
    const FIN: Option<Segment> = Some(Segment {
        syn: false,
        fin: true,
        rst: false,
    });
    const RST: Option<Segment> = Some(Segment {
        syn: false,
        fin: false,
        rst: true,
    });

    #[test]
    fn a_normal_close_half_closes_then_closes_whoever_starts() {
        let s = after_client(UDP, SYN);
        assert_eq!(s, SYN_SENT);
        let s = after_backend(s, ACK);
        assert_eq!(s, SYN_SENT, "the SYN-ACK does not finish the handshake");
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
    fn sctp_associations_open_shut_down_and_abort_like_netfilter_s() {
        use super::sctp_chunk::*;
        let c = |s, chunk| after_client(s, Some(segment_of(sctp_chunk_flags(chunk))));
        let b = |s, chunk| after_backend(s, Some(segment_of(sctp_chunk_flags(chunk))));
        let s = c(UDP, INIT);
        assert_eq!(s, SYN_SENT, "INIT: COOKIE_WAIT");
        let s = b(s, INIT_ACK);
        assert_eq!(s, SYN_SENT, "INIT_ACK: still opening");
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
    fn rst_closes_syn_reopens_udp_has_no_state() {
        for s in [SYN_SENT, ESTABLISHED, FIN_ORIGINAL, FIN_REPLY] {
            assert_eq!(after_client(s, RST), CLOSING);
            assert_eq!(after_backend(s, RST), CLOSING);
            assert_eq!(after_client(s, SYN), SYN_SENT);
        }
        assert_eq!(after_client(ESTABLISHED, None), UDP);
        assert_eq!(after_backend(UDP, None), UDP);
        assert_eq!(after_client(UDP, ACK), ESTABLISHED, "mid-flow first packet");
    }
}
