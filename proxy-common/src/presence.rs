//! Whether an agent is running on the pinned datapath, and whether the datapath has handed new
//! flows over to the node's own stack: `AGENT_V1`, one [`AgentPresence`] that the agent writes
//! and the programs read (and the bind hooks write, for the hand-over).
//!
//! The datapath outlives its agent on purpose (restarts, upgrades and API outages keep every
//! flow). Two things follow from knowing whether the agent is there:
//! - **Hand-over.** When another Service proxy starts on the node while no agent runs (kube-proxy
//!   reinstated after the agent was removed without its clean-up), the programs stop translating
//!   new flows with frozen maps and pass them to the stack, where that proxy's rules are. Flows
//!   already translated keep their translation until they end. The sign is the other proxy
//!   binding its health or metrics port ([`PROXY_PORTS`]) in the node's namespace, seen by a
//!   cgroup bind hook, so the hand-over needs no running agent. Optionally also after the
//!   agent has been gone longer than a bound ([`AgentPresence::handover_after_s`]).
//! - **Pods while the agent is away.** A pod's traffic is translated by the tc programs on its
//!   host-side interface, which only a running agent attaches. While no agent runs, the socket
//!   hooks translate the connect()/sendmsg() of pods' sockets too, so a pod created meanwhile
//!   reaches Services from its first packet.
//!
//! Times are CLOCK_MONOTONIC nanoseconds (`bpf_ktime_get_ns`), the agent's clock too.

use bytemuck::{Pod, Zeroable};

/// `AGENT_V1` (array, one [`AgentPresence`] at index 0).
pub const MAP_AGENT: &str = "AGENT_V1";

/// The ports whose bind by another process in the node's namespace, while no agent runs, hands
/// the datapath over: kube-proxy's default health (`healthzBindAddress`, 10256) and metrics
/// (`metricsBindAddress`, 10249) ports, which it binds at start, before its first sync.
pub const PROXY_PORTS: [u16; 2] = [10256, 10249];

/// How long a heartbeat vouches for the agent. The agent beats every [`HEARTBEAT_PERIOD_MS`]
/// from a thread of its own, so only a process that is gone (killed, crashed) misses it.
pub const ALIVE_FOR_MS: u32 = 1_000;
/// How often the agent writes its heartbeat.
pub const HEARTBEAT_PERIOD_MS: u32 = 200;

/// `AGENT_V1`'s value.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default, Pod, Zeroable)]
pub struct AgentPresence {
    /// The agent's last heartbeat; kept when it stops (how long it has been gone).
    pub heartbeat_ns: u64,
    /// When the datapath handed new flows over to the node's stack; 0: it has not.
    pub handed_over_ns: u64,
    /// 1 while an agent runs; 0 once it stopped on purpose (SIGTERM), or never ran.
    pub running: u32,
    /// How long a heartbeat vouches for the agent, ms ([`ALIVE_FOR_MS`]).
    pub alive_for_ms: u32,
    /// Hand over also once the agent has been gone this long (s, from its last heartbeat); 0:
    /// never by time.
    pub handover_after_s: u32,
    /// The port whose bind handed over (host order); 0: not by a bind.
    pub handed_over_port: u16,
    pub _pad: u16,
}
const _: () = assert!(core::mem::size_of::<AgentPresence>() == 32);

impl AgentPresence {
    /// Is an agent running on the datapath now?
    #[inline(always)]
    pub const fn agent_alive(&self, now_ns: u64) -> bool {
        self.running != 0
            && now_ns.saturating_sub(self.heartbeat_ns) < self.alive_for_ms as u64 * 1_000_000
    }

    /// Do new flows go to the node's stack instead of being translated? Once another proxy took
    /// over, or (`handover_after_s`) once no agent has run for that long.
    #[inline(always)]
    pub const fn handed_over(&self, now_ns: u64) -> bool {
        if self.handed_over_ns != 0 {
            return true;
        }
        self.handover_after_s != 0
            && !self.agent_alive(now_ns)
            && self.heartbeat_ns != 0
            && now_ns.saturating_sub(self.heartbeat_ns)
                >= self.handover_after_s as u64 * 1_000_000_000
    }

    /// What a bind of `port` (host order) in the node's namespace at `now_ns` makes of this
    /// state: `Some` the handed-over state when it is another proxy's port bound while no agent
    /// runs (and the datapath has not handed over yet), `None` to leave it.
    #[inline(always)]
    pub const fn after_bind(&self, port: u16, now_ns: u64) -> Option<Self> {
        if self.handed_over_ns != 0 || self.agent_alive(now_ns) || !is_proxy_port(port) {
            return None;
        }
        let mut next = *self;
        // 0 means "not handed over": a clock that reads 0 still counts as handed over.
        next.handed_over_ns = if now_ns == 0 { 1 } else { now_ns };
        next.handed_over_port = port;
        Some(next)
    }
}

/// Is `port` (host order) one of [`PROXY_PORTS`]?
#[inline(always)]
pub const fn is_proxy_port(port: u16) -> bool {
    port == PROXY_PORTS[0] || port == PROXY_PORTS[1]
}

#[cfg(test)]
mod tests {
    use super::*;

    const S: u64 = 1_000_000_000;

    fn running(at: u64) -> AgentPresence {
        AgentPresence {
            heartbeat_ns: at,
            running: 1,
            alive_for_ms: ALIVE_FOR_MS,
            ..AgentPresence::default()
        }
    }

    #[test]
    fn a_heartbeat_vouches_for_the_agent_until_it_is_too_old_or_the_agent_stopped() {
        let p = running(100 * S);
        assert!(p.agent_alive(100 * S));
        assert!(p.agent_alive(100 * S + 999_000_000));
        assert!(
            !p.agent_alive(101 * S),
            "a missed second: killed or crashed"
        );
        let stopped = AgentPresence { running: 0, ..p };
        assert!(
            !stopped.agent_alive(100 * S),
            "stopped on purpose: gone at once"
        );
        assert!(!AgentPresence::default().agent_alive(0), "never ran");
        assert!(
            p.agent_alive(50 * S),
            "a clock behind the heartbeat is not an absence"
        );
    }

    #[test]
    fn another_proxy_binding_its_port_hands_over_only_while_no_agent_runs() {
        let p = running(100 * S);
        assert_eq!(p.after_bind(10256, 100 * S), None, "our own agent's bind");
        let gone = AgentPresence { running: 0, ..p };
        let after = gone
            .after_bind(10256, 130 * S)
            .expect("kube-proxy's healthz");
        assert!(after.handed_over(130 * S));
        assert_eq!(after.handed_over_port, 10256);
        assert_eq!(after.handed_over_ns, 130 * S);
        assert_eq!(
            after.after_bind(10249, 131 * S),
            None,
            "the first hand-over is kept"
        );
        assert!(
            gone.after_bind(10249, 130 * S).is_some(),
            "its metrics port"
        );
        assert_eq!(gone.after_bind(8080, 130 * S), None, "any other port");
        assert!(!gone.handed_over(10_000 * S), "no time bound by default");
        let at_zero = AgentPresence::default().after_bind(10256, 0).unwrap();
        assert!(at_zero.handed_over(0));
    }

    #[test]
    fn the_optional_time_bound_counts_from_the_last_heartbeat() {
        let p = AgentPresence {
            handover_after_s: 600,
            ..running(100 * S)
        };
        assert!(!p.handed_over(100 * S));
        assert!(!p.handed_over(699 * S));
        assert!(
            p.handed_over(700 * S),
            "killed (its running flag left set): timed from its last heartbeat too"
        );
        let gone = AgentPresence { running: 0, ..p };
        assert!(!gone.handed_over(699 * S));
        assert!(gone.handed_over(700 * S));
        let never = AgentPresence {
            handover_after_s: 600,
            ..AgentPresence::default()
        };
        assert!(
            !never.handed_over(10_000 * S),
            "no heartbeat ever: nothing to time"
        );
    }
}
