//! Flow idle timeouts: the one rule both the datapath (conntrack replacement, SNAT port reclaim)
//! and the agent's garbage collection (conntrack, SNAT) use to call a flow idle.

use crate::{DatapathConfig, ct_flags, ct_state, proto};

const NS_PER_S: u64 = 1_000_000_000;

/// SCTP idle timeouts, netfilter's defaults (`nf_conntrack_proto_sctp.c`, Linux ≥ 6.1; kube-proxy
/// configures none). The SCTP chunks are read as TCP flags (see `flow_state`), so the TCP states
/// stand for SCTP's: SYN_SENT and SYN_RECV for COOKIE_WAIT/COOKIE_ECHOED (INIT, INIT_ACK seen;
/// 3 s each in netfilter),
/// ESTABLISHED (210 s: a few missed 30 s heartbeats), FIN_* for SHUTDOWN_SENT/RECD/ACK_SENT
/// (3 s), CLOSING for CLOSED (ABORT or SHUTDOWN_COMPLETE, 10 s).
pub mod sctp {
    pub const OPENING_S: u32 = 3;
    pub const ESTABLISHED_S: u32 = 210;
    pub const SHUTDOWN_S: u32 = 3;
    pub const CLOSED_S: u32 = 10;
}

/// Idle timeout of a flow, by protocol, state and entry flags, like netfilter's:
/// - UDP (and anything but TCP): `udp_timeout_s` until the backend has answered, then
///   `udp_stream_timeout_s` (`ct_flags::SEEN_REPLY`; conntrack entries only once the flow is
///   also a stream by time, [`flow_idle_expired`]);
/// - TCP ESTABLISHED: `tcp_established_timeout_s`; half-closed (`FIN_ORIGINAL`/`FIN_REPLY`):
///   `tcp_close_wait_timeout_s`; opening (SYN_SENT, SYN_RECV, no state yet) or closed (CLOSING):
///   `tcp_transitory_timeout_s`;
/// - SCTP: the [`sctp`] constants by state.
#[inline(always)]
pub fn idle_timeout_ns(cfg: &DatapathConfig, proto: u8, state: u8, flags: u8) -> u64 {
    let seconds = if proto == proto::SCTP {
        sctp_timeout_s(state)
    } else if proto != proto::TCP {
        if flags & ct_flags::SEEN_REPLY != 0 {
            cfg.udp_stream_timeout_s
        } else {
            cfg.udp_timeout_s
        }
    } else if state == ct_state::ESTABLISHED {
        cfg.tcp_established_timeout_s
    } else if state == ct_state::FIN_ORIGINAL || state == ct_state::FIN_REPLY {
        cfg.tcp_close_wait_timeout_s
    } else {
        cfg.tcp_transitory_timeout_s
    };
    // u32::MAX seconds in ns is below u64::MAX: cannot overflow.
    seconds as u64 * NS_PER_S
}

#[inline(always)]
const fn sctp_timeout_s(state: u8) -> u32 {
    match state {
        ct_state::SYN_SENT | ct_state::SYN_RECV => sctp::OPENING_S,
        ct_state::ESTABLISHED => sctp::ESTABLISHED_S,
        ct_state::FIN_ORIGINAL | ct_state::FIN_REPLY => sctp::SHUTDOWN_S,
        _ => sctp::CLOSED_S,
    }
}

/// Has a flow last seen at `last_seen_ns` (CLOCK_MONOTONIC), in `state` with entry `flags`,
/// been idle for longer than its timeout at `now_ns`? A `last_seen_ns` in the future counts as
/// not idle.
#[inline(always)]
pub fn idle_expired(
    last_seen_ns: u64,
    proto: u8,
    state: u8,
    flags: u8,
    now_ns: u64,
    cfg: &DatapathConfig,
) -> bool {
    now_ns.saturating_sub(last_seen_ns) > idle_timeout_ns(cfg, proto, state, flags)
}

/// How long after it began a UDP flow must still be active, its backend having answered, for
/// netfilter to call it a stream (`udpStreamTimeout`): a request and its answer alone (a DNS
/// lookup) keep `udpTimeout` (`nf_conntrack_proto_udp.c`, `stream_ts`).
pub const UDP_STREAM_AFTER_NS: u64 = 2 * NS_PER_S;

/// [`idle_expired`] for a conntrack entry created at `created_ns`: a UDP flow counts as a stream
/// (its `SEEN_REPLY`) only once it was last active more than [`UDP_STREAM_AFTER_NS`] after it
/// began, as netfilter's. (SNAT entries keep no creation time and use [`idle_expired`]: an
/// answered UDP flow's SNAT port is held for `udp_stream_timeout_s`.)
#[inline(always)]
pub fn flow_idle_expired(
    created_ns: u64,
    last_seen_ns: u64,
    proto: u8,
    state: u8,
    flags: u8,
    now_ns: u64,
    cfg: &DatapathConfig,
) -> bool {
    let flags = if last_seen_ns.saturating_sub(created_ns) > UDP_STREAM_AFTER_NS {
        flags
    } else {
        flags & !ct_flags::SEEN_REPLY
    };
    idle_expired(last_seen_ns, proto, state, flags, now_ns, cfg)
}

/// May a new flow take the SNAT port of an existing one (its `in` entry last seen at
/// `last_seen_ns`, in `state` with `flags`)? When its flow is idle past its timeout, as before;
/// and like netfilter's NAT, a TCP flow that has closed (a new SYN reuses a TIME_WAIT/CLOSE
/// tuple), or whose SYN has gone unanswered for `SNAT_UNANSWERED_SYN_HOLD_S`.
#[inline(always)]
pub fn snat_port_reclaimable(
    last_seen_ns: u64,
    proto: u8,
    state: u8,
    flags: u8,
    now_ns: u64,
    cfg: &DatapathConfig,
) -> bool {
    if idle_expired(last_seen_ns, proto, state, flags, now_ns, cfg) {
        return true;
    }
    if proto != proto::TCP {
        return false;
    }
    state == ct_state::CLOSING
        || (flags & ct_flags::SEEN_REPLY == 0
            && (state == ct_state::SYN_SENT || state == ct_state::UDP)
            && now_ns.saturating_sub(last_seen_ns) > crate::SNAT_UNANSWERED_SYN_HOLD_S * NS_PER_S)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_answered_udp_flow_is_a_stream_only_if_active_two_seconds_after_it_began() {
        let cfg = CFG;
        let replied = ct_flags::SEEN_REPLY;
        let exp = |created, last, now| {
            flow_idle_expired(created, last, proto::UDP, ct_state::UDP, replied, now, &cfg)
        };
        // A request and its answer within a second: udp_timeout (5 s here), not the stream's.
        assert!(!exp(100 * S, 101 * S, 105 * S));
        assert!(exp(100 * S, 101 * S, 107 * S));
        // Still active 3 s after it began: a stream (20 s).
        assert!(!exp(100 * S, 103 * S, 120 * S));
        assert!(exp(100 * S, 103 * S, 124 * S));
        // Unanswered: udp_timeout however long it went on.
        assert!(flow_idle_expired(
            100 * S,
            110 * S,
            proto::UDP,
            ct_state::UDP,
            0,
            116 * S,
            &cfg
        ));
        // TCP ignores it.
        assert!(!flow_idle_expired(
            100 * S,
            100 * S,
            proto::TCP,
            ct_state::ESTABLISHED,
            replied,
            150 * S,
            &cfg
        ));
    }

    const S: u64 = NS_PER_S;
    const CFG: DatapathConfig = DatapathConfig {
        tcp_established_timeout_s: 100,
        tcp_transitory_timeout_s: 10,
        tcp_close_wait_timeout_s: 50,
        udp_timeout_s: 5,
        udp_stream_timeout_s: 20,
        ..DatapathConfig::DEFAULT
    };
    const NONE: u8 = 0;
    const REPLIED: u8 = ct_flags::SEEN_REPLY;

    #[test]
    fn timeout_by_protocol_state_and_flags() {
        let t = |p, s, f| idle_timeout_ns(&CFG, p, s, f);
        assert_eq!(t(proto::TCP, ct_state::ESTABLISHED, NONE), 100 * S);
        assert_eq!(
            t(proto::TCP, ct_state::ESTABLISHED, REPLIED),
            100 * S,
            "TCP ignores SEEN_REPLY"
        );
        assert_eq!(t(proto::TCP, ct_state::SYN_SENT, NONE), 10 * S);
        assert_eq!(t(proto::TCP, ct_state::CLOSING, NONE), 10 * S);
        assert_eq!(t(proto::TCP, ct_state::FIN_ORIGINAL, NONE), 50 * S);
        assert_eq!(t(proto::TCP, ct_state::FIN_REPLY, REPLIED), 50 * S);
        assert_eq!(
            t(proto::TCP, ct_state::UDP, NONE),
            10 * S,
            "TCP without state yet"
        );
        assert_eq!(t(proto::UDP, ct_state::UDP, NONE), 5 * S, "one-shot UDP");
        assert_eq!(t(proto::UDP, ct_state::UDP, REPLIED), 20 * S, "UDP stream");
        assert_eq!(
            t(proto::UDP, ct_state::ESTABLISHED, NONE),
            5 * S,
            "UDP ignores state"
        );
        assert_eq!(
            t(proto::UDP, ct_state::UDP, REPLIED | ct_flags::SPORT_NAT),
            20 * S,
            "other flags do not matter"
        );
        assert_eq!(
            t(proto::ICMP, ct_state::UDP, REPLIED),
            20 * S,
            "anything but TCP is UDP-like"
        );
    }

    #[test]
    fn the_defaults_are_kube_proxy_s_and_the_kernel_s() {
        let d = DatapathConfig::DEFAULT;
        let t = |p, s, f| idle_timeout_ns(&d, p, s, f) / S;
        assert_eq!(t(proto::UDP, ct_state::UDP, NONE), 30, "nf udp_timeout");
        assert_eq!(t(proto::UDP, ct_state::UDP, REPLIED), 120, "nf stream");
        assert_eq!(t(proto::TCP, ct_state::ESTABLISHED, NONE), 86_400);
        assert_eq!(t(proto::TCP, ct_state::FIN_REPLY, NONE), 3_600);
        assert_eq!(t(proto::TCP, ct_state::CLOSING, NONE), 120);
    }

    #[test]
    fn sctp_timeouts_are_netfilter_s_by_state_whatever_the_config() {
        for cfg in [CFG, DatapathConfig::DEFAULT] {
            let t = |s, f| idle_timeout_ns(&cfg, proto::SCTP, s, f) / S;
            assert_eq!(t(ct_state::SYN_SENT, NONE), 3, "COOKIE_WAIT/ECHOED");
            assert_eq!(t(ct_state::ESTABLISHED, NONE), 210);
            assert_eq!(t(ct_state::ESTABLISHED, REPLIED), 210, "SEEN_REPLY ignored");
            assert_eq!(t(ct_state::FIN_ORIGINAL, NONE), 3, "SHUTDOWN_SENT");
            assert_eq!(t(ct_state::FIN_REPLY, NONE), 3, "SHUTDOWN_RECD");
            assert_eq!(t(ct_state::CLOSING, NONE), 10, "CLOSED");
            assert_eq!(t(ct_state::UDP, NONE), 10, "no state yet");
        }
    }

    #[test]
    fn expired_only_strictly_past_the_timeout() {
        let now = 1_000 * S;
        let e = |idle, p, s, f| idle_expired(now - idle, p, s, f, now, &CFG);
        assert!(!e(100 * S, proto::TCP, ct_state::ESTABLISHED, NONE), "at");
        assert!(e(100 * S + 1, proto::TCP, ct_state::ESTABLISHED, NONE));
        assert!(!e(50 * S, proto::TCP, ct_state::ESTABLISHED, NONE));
        assert!(e(50 * S, proto::TCP, ct_state::SYN_SENT, NONE));
        assert!(!e(50 * S, proto::TCP, ct_state::FIN_ORIGINAL, NONE));
        assert!(e(51 * S, proto::TCP, ct_state::FIN_ORIGINAL, NONE));
        assert!(!e(4 * S, proto::UDP, ct_state::UDP, NONE));
        assert!(
            e(6 * S, proto::UDP, ct_state::UDP, NONE),
            "one-shot: 6 s of 5"
        );
        assert!(
            !e(6 * S, proto::UDP, ct_state::UDP, REPLIED),
            "stream: 6 s of 20"
        );
        assert!(e(21 * S, proto::UDP, ct_state::UDP, REPLIED));
        assert!(
            !idle_expired(now + S, proto::UDP, ct_state::UDP, NONE, now, &CFG),
            "last seen after now (clock read before a packet's touch)"
        );
        let max = DatapathConfig {
            udp_timeout_s: u32::MAX,
            ..CFG
        };
        assert_eq!(
            idle_timeout_ns(&max, proto::UDP, ct_state::UDP, NONE),
            u64::from(u32::MAX) * S,
            "the largest timeout does not overflow"
        );
        assert!(idle_expired(
            0,
            proto::UDP,
            ct_state::UDP,
            NONE,
            u64::MAX,
            &max
        ));
    }

    #[test]
    fn a_snat_port_is_reclaimed_after_a_close_an_unanswered_syn_or_idleness() {
        let now = 1_000 * S;
        let r = |proto, state, flags, idle_s: u64| {
            snat_port_reclaimable(now - idle_s * S, proto, state, flags, now, &CFG)
        };
        assert!(
            r(proto::TCP, ct_state::CLOSING, REPLIED, 0),
            "closed: a new SYN reuses it"
        );
        assert!(!r(proto::TCP, ct_state::ESTABLISHED, REPLIED, 99));
        assert!(r(proto::TCP, ct_state::ESTABLISHED, REPLIED, 101), "idle");
        assert!(
            !r(proto::TCP, ct_state::FIN_ORIGINAL, REPLIED, 6),
            "half-closed holds"
        );
        let hold = crate::SNAT_UNANSWERED_SYN_HOLD_S;
        assert!(
            !r(proto::TCP, ct_state::SYN_SENT, NONE, hold),
            "a fresh SYN holds"
        );
        assert!(
            r(proto::TCP, ct_state::SYN_SENT, NONE, hold + 1),
            "unanswered SYN"
        );
        assert!(
            !r(proto::TCP, ct_state::SYN_SENT, REPLIED, hold + 1),
            "an answered SYN holds for the transitory timeout"
        );
        assert!(
            !r(proto::UDP, ct_state::UDP, NONE, 5),
            "UDP only by its timeout"
        );
        assert!(r(proto::UDP, ct_state::UDP, NONE, 6));
        assert!(
            !r(proto::SCTP, ct_state::CLOSING, REPLIED, 0),
            "SCTP only by its timeout"
        );
    }
}
