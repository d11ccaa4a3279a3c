//! Flow idle timeouts: the one rule both the datapath (conntrack replacement, SNAT port reclaim)
//! and the agent's garbage collection (conntrack, SNAT) use to call a flow idle.

use crate::{DatapathConfig, ct_state, proto};

const NS_PER_S: u64 = 1_000_000_000;

/// Idle timeout of a flow, by protocol and state: TCP ESTABLISHED → established timeout, other
/// TCP states (opening, closing) → transitory timeout, UDP (and anything else) → UDP timeout.
#[inline(always)]
pub fn idle_timeout_ns(cfg: &DatapathConfig, proto: u8, state: u8) -> u64 {
    let seconds = if proto != proto::TCP {
        cfg.udp_timeout_s
    } else if state == ct_state::ESTABLISHED {
        cfg.tcp_established_timeout_s
    } else {
        cfg.tcp_transitory_timeout_s
    };
    // u32::MAX seconds in ns is below u64::MAX: cannot overflow.
    seconds as u64 * NS_PER_S
}

/// Has a flow last seen at `last_seen_ns` (CLOCK_MONOTONIC), in `state`, been idle for longer
/// than its timeout at `now_ns`? A `last_seen_ns` in the future counts as not idle.
#[inline(always)]
pub fn idle_expired(
    last_seen_ns: u64,
    proto: u8,
    state: u8,
    now_ns: u64,
    cfg: &DatapathConfig,
) -> bool {
    now_ns.saturating_sub(last_seen_ns) > idle_timeout_ns(cfg, proto, state)
}

#[cfg(test)]
mod tests {
    use super::*;

    const S: u64 = NS_PER_S;
    const CFG: DatapathConfig = DatapathConfig {
        tcp_established_timeout_s: 100,
        tcp_transitory_timeout_s: 10,
        udp_timeout_s: 5,
        ..DatapathConfig::DEFAULT
    };

    #[test]
    fn timeout_by_protocol_and_state() {
        let t = |p, s| idle_timeout_ns(&CFG, p, s);
        assert_eq!(t(proto::TCP, ct_state::ESTABLISHED), 100 * S);
        assert_eq!(t(proto::TCP, ct_state::SYN_SENT), 10 * S);
        assert_eq!(t(proto::TCP, ct_state::CLOSING), 10 * S);
        assert_eq!(
            t(proto::TCP, ct_state::UDP),
            10 * S,
            "TCP without state yet"
        );
        assert_eq!(t(proto::UDP, ct_state::UDP), 5 * S);
        assert_eq!(
            t(proto::UDP, ct_state::ESTABLISHED),
            5 * S,
            "UDP ignores state"
        );
    }

    #[test]
    fn expired_only_strictly_past_the_timeout() {
        let now = 1_000 * S;
        let e = |idle, p, s| idle_expired(now - idle, p, s, now, &CFG);
        assert!(!e(100 * S, proto::TCP, ct_state::ESTABLISHED), "exactly at");
        assert!(e(100 * S + 1, proto::TCP, ct_state::ESTABLISHED));
        assert!(!e(50 * S, proto::TCP, ct_state::ESTABLISHED));
        assert!(e(50 * S, proto::TCP, ct_state::SYN_SENT));
        assert!(!e(4 * S, proto::UDP, ct_state::UDP));
        assert!(e(6 * S, proto::UDP, ct_state::UDP));
        assert!(
            !idle_expired(now + S, proto::UDP, ct_state::UDP, now, &CFG),
            "last seen after now (clock read before a packet's touch)"
        );
        let max = DatapathConfig {
            udp_timeout_s: u32::MAX,
            ..CFG
        };
        assert_eq!(
            idle_timeout_ns(&max, proto::UDP, ct_state::UDP),
            u64::from(u32::MAX) * S,
            "the largest timeout does not overflow"
        );
        assert!(idle_expired(0, proto::UDP, ct_state::UDP, u64::MAX, &max));
    }
}
