//! Rate limit of the answers the datapath generates (ICMP port unreachable, TCP RST): a token
//! bucket per CPU, kept as time credit so the datapath needs no division. Like Linux's own ICMP
//! limit (`icmp_msgs_per_sec` 1000, `icmp_msgs_burst` 50), a flood of packets to a Service
//! without endpoints (or of stray segments of reset flows) cannot be turned into a flood of
//! answers; over the limit the packet is dropped and counted (`drop_reject_rate_limited`).

use crate::RejectBucket;

/// Answers per second, per CPU.
pub const REJECT_RATE_PER_SEC: u64 = 1_000;
/// Answers a CPU may send at once after a quiet period.
pub const REJECT_BURST: u64 = 50;
/// Credit one answer costs.
pub const REJECT_COST_NS: u64 = 1_000_000_000 / REJECT_RATE_PER_SEC;
/// Most credit a bucket holds.
const MAX_CREDIT_NS: u64 = REJECT_BURST * REJECT_COST_NS;

/// Takes one answer's credit at `now_ns` if there is enough; false = over the limit. A clock
/// that goes backwards earns nothing.
#[inline(always)]
pub fn take(bucket: &mut RejectBucket, now_ns: u64) -> bool {
    let earned = if bucket.last_ns == 0 {
        MAX_CREDIT_NS
    } else {
        now_ns.saturating_sub(bucket.last_ns)
    };
    let credit = bucket.credit_ns.saturating_add(earned);
    bucket.credit_ns = if credit > MAX_CREDIT_NS {
        MAX_CREDIT_NS
    } else {
        credit
    };
    if now_ns > bucket.last_ns {
        bucket.last_ns = now_ns;
    }
    if bucket.credit_ns < REJECT_COST_NS {
        return false;
    }
    bucket.credit_ns -= REJECT_COST_NS;
    true
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_fresh_bucket_allows_the_burst_then_the_rate() {
        let mut b = RejectBucket::default();
        let t0 = 5_000_000_000;
        let allowed = (0..200).filter(|_| take(&mut b, t0)).count() as u64;
        assert_eq!(allowed, REJECT_BURST, "burst at one instant");
        assert!(!take(&mut b, t0 + REJECT_COST_NS - 1), "not yet earned");
        assert!(take(&mut b, t0 + REJECT_COST_NS), "one answer per cost");
        assert!(!take(&mut b, t0 + REJECT_COST_NS));
        // One second later: the rate's worth, capped at the burst.
        let t1 = t0 + 1_000_000_000;
        let allowed = (0..2000).filter(|_| take(&mut b, t1)).count() as u64;
        assert_eq!(allowed, REJECT_BURST.min(REJECT_RATE_PER_SEC));
        // A steady stream at twice the rate gets the rate.
        let mut b = RejectBucket::default();
        let mut allowed = 0;
        for i in 0..20_000u64 {
            if take(&mut b, t0 + i * REJECT_COST_NS / 2) {
                allowed += 1;
            }
        }
        assert!(
            (10_000..=10_000 + REJECT_BURST).contains(&allowed),
            "{allowed} of 20000 at twice the rate"
        );
    }

    #[test]
    fn a_clock_going_back_earns_nothing() {
        let mut b = RejectBucket::default();
        let t0 = 5_000_000_000;
        while take(&mut b, t0) {}
        assert!(!take(&mut b, t0 - 1_000_000_000));
        assert!(!take(&mut b, t0), "the last time is kept");
    }
}
