//! Load-balancing schedulers: the names users give (KubeProxyConfiguration `ipvs.scheduler`, the
//! `--scheduler` flag, the per-Service annotation) and the code a frontend entry carries
//! (`ServiceValue::scheduler`). Pure, shared by the agent and the datapath.

/// `ServiceValue::scheduler` codes.
pub mod code {
    /// A flow hash of the 5-tuple (the default).
    pub const RANDOM: u8 = 0;
    /// Round robin over the usable endpoints (an atomic per-frontend counter).
    pub const ROUND_ROBIN: u8 = 1;
    /// Least connection over per-backend active-flow counts.
    pub const LEAST_CONNECTION: u8 = 2;
    /// Source hashing: the client address alone picks the endpoint.
    pub const SOURCE_HASH: u8 = 3;
    /// Destination hashing (IPVS's meaning: the destination address, here the frontend's).
    pub const DESTINATION_HASH: u8 = 4;
    /// Maglev consistent hashing over a lookup table built by the agent.
    pub const MAGLEV: u8 = 5;
}

/// A scheduler as the agent reasons about it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Scheduler {
    #[default]
    Random,
    RoundRobin,
    LeastConnection,
    SourceHash,
    DestinationHash,
    Maglev,
}

impl Scheduler {
    pub const ALL: [Scheduler; 6] = [
        Scheduler::Random,
        Scheduler::RoundRobin,
        Scheduler::LeastConnection,
        Scheduler::SourceHash,
        Scheduler::DestinationHash,
        Scheduler::Maglev,
    ];

    /// The code a frontend entry carries.
    pub const fn code(self) -> u8 {
        match self {
            Scheduler::Random => code::RANDOM,
            Scheduler::RoundRobin => code::ROUND_ROBIN,
            Scheduler::LeastConnection => code::LEAST_CONNECTION,
            Scheduler::SourceHash => code::SOURCE_HASH,
            Scheduler::DestinationHash => code::DESTINATION_HASH,
            Scheduler::Maglev => code::MAGLEV,
        }
    }

    pub const fn from_code(code: u8) -> Option<Self> {
        Some(match code {
            code::RANDOM => Scheduler::Random,
            code::ROUND_ROBIN => Scheduler::RoundRobin,
            code::LEAST_CONNECTION => Scheduler::LeastConnection,
            code::SOURCE_HASH => Scheduler::SourceHash,
            code::DESTINATION_HASH => Scheduler::DestinationHash,
            code::MAGLEV => Scheduler::Maglev,
            _ => return None,
        })
    }

    /// The canonical name (dump, metrics label).
    pub const fn name(self) -> &'static str {
        match self {
            Scheduler::Random => "random",
            Scheduler::RoundRobin => "rr",
            Scheduler::LeastConnection => "lc",
            Scheduler::SourceHash => "sh",
            Scheduler::DestinationHash => "dh",
            Scheduler::Maglev => "mh",
        }
    }

    /// A scheduler from a user's name: ours and IPVS's. IPVS names without a meaning of their
    /// own here (every weight is 1, as kube-proxy sets them) map to the one they equal:
    /// `wrr` → `rr`; `wlc`, `sed`, `nq` → `lc`; `lblc`, `lblcr` → `sh`. `None` for an unknown
    /// name (the caller names the field or annotation in its error). An empty name is not a
    /// scheduler: callers treat it as "not set".
    pub fn parse(name: &str) -> Option<Self> {
        Some(match name {
            "random" => Scheduler::Random,
            "rr" | "wrr" | "round-robin" => Scheduler::RoundRobin,
            "lc" | "wlc" | "sed" | "nq" | "least-connection" => Scheduler::LeastConnection,
            "sh" | "lblc" | "lblcr" | "source-hash" => Scheduler::SourceHash,
            "dh" | "destination-hash" => Scheduler::DestinationHash,
            "mh" | "maglev" => Scheduler::Maglev,
            _ => return None,
        })
    }
}

/// The backend slot (1..=count) of the round-robin position `n` (the frontend's `rr_next` before
/// this flow's increment): slots in order 1, 2, …, count, 1, …; `None` without backends. A
/// wrapping counter shifts the cycle once every 2^32 flows when count does not divide 2^32.
#[inline(always)]
pub const fn rr_slot(n: u32, count: u16) -> Option<u16> {
    if count == 0 {
        return None;
    }
    Some((n % count as u32) as u16 + 1)
}

/// Names accepted by [`Scheduler::parse`], for error messages and docs.
pub const SCHEDULER_NAMES: &str =
    "random, rr (wrr), lc (wlc, sed, nq), sh (lblc, lblcr), dh, mh (maglev)";

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codes_round_trip_and_names_parse_to_themselves() {
        for s in Scheduler::ALL {
            assert_eq!(Scheduler::from_code(s.code()), Some(s));
            assert_eq!(Scheduler::parse(s.name()), Some(s));
        }
        assert_eq!(Scheduler::from_code(6), None);
    }

    #[test]
    fn rr_slots_cycle_in_order() {
        assert_eq!(rr_slot(0, 0), None);
        let slots: Vec<u16> = (0..7).map(|n| rr_slot(n, 3).unwrap()).collect();
        assert_eq!(slots, [1, 2, 3, 1, 2, 3, 1]);
        assert_eq!(rr_slot(u32::MAX, 1), Some(1));
        assert_eq!(rr_slot(u32::MAX, 3), Some(1), "2^32 - 1 = 0 mod 3");
        assert_eq!(rr_slot(12_345, 100), Some(46));
    }

    #[test]
    fn ipvs_names_without_a_meaning_here_map_to_their_equal() {
        assert_eq!(Scheduler::parse("wrr"), Some(Scheduler::RoundRobin));
        for n in ["wlc", "sed", "nq"] {
            assert_eq!(Scheduler::parse(n), Some(Scheduler::LeastConnection), "{n}");
        }
        for n in ["lblc", "lblcr"] {
            assert_eq!(Scheduler::parse(n), Some(Scheduler::SourceHash), "{n}");
        }
        assert_eq!(Scheduler::parse("maglev"), Some(Scheduler::Maglev));
        assert_eq!(Scheduler::parse(""), None);
        assert_eq!(Scheduler::parse("RR"), None);
        assert_eq!(Scheduler::parse("fo"), None);
    }
}
