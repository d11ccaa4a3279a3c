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
