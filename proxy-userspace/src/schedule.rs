//! When the agent's loop syncs (pure: no clock reads, no IO; the loop passes `now`).
//!
//! kube-proxy's BoundedFrequencyRunner: a change syncs at once unless the last change sync was
//! less than `min_sync_period` ago (then when that has passed, with all changes since
//! coalesced), and every Service is derived again from the source at least every
//! `sync_period`.
//!
//! That periodic pass must not hold up a change: at 50,000 Services a full sync takes about a
//! second, and a change arriving meanwhile waited for all of it. Where the source is cheap to
//! read again (the Kubernetes stores), the pass goes in slices of [`SLICE`] Services, each an
//! incremental sync that translates its slice again (bounded: about a millisecond), and a change
//! waiting to sync always goes before the next slice. Changes that never stop (always one
//! waiting) cannot starve the pass: once it is overdue (`sync_period` since it started), its
//! slices go between the change syncs as well. The manifest folder is parsed again at every
//! read, so there the pass stays one full sync, run when no change is waiting.

use std::time::{Duration, Instant};

/// Services translated again per slice of the periodic pass.
pub const SLICE: usize = 128;

/// What the loop does next.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Step {
    /// Sync what changed; `full`: translate and plan everything (the manifest folder's pass).
    Sync { full: bool },
    /// Sync what changed and translate the Services at places `from..from + SLICE` again.
    Slice { from: usize },
    /// Nothing until this instant (or a change).
    Wait(Instant),
}

/// The periodic pass in progress.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Pass {
    started: Instant,
    next: usize,
}

/// The loop's sync timing state.
#[derive(Debug)]
pub struct Schedule {
    min_sync_period: Duration,
    sync_period: Duration,
    /// The pass goes in slices (the source is cheap to read).
    sliced: bool,
    /// A change is waiting for a sync.
    dirty: bool,
    /// A change sync may run from then (`min_sync_period` after the last one, or a retry delay).
    next_allowed: Instant,
    /// When the last periodic pass started (or the first full sync ran).
    last_full: Instant,
    pass: Option<Pass>,
}

impl Schedule {
    /// After the first full sync at `now`.
    pub fn new(
        now: Instant,
        min_sync_period: Duration,
        sync_period: Duration,
        sliced: bool,
    ) -> Self {
        Self {
            min_sync_period,
            sync_period,
            sliced,
            dirty: false,
            next_allowed: now + min_sync_period,
            last_full: now,
            pass: None,
        }
    }

    /// A source reported a change.
    pub fn changed(&mut self) {
        self.dirty = true;
    }

    pub fn dirty(&self) -> bool {
        self.dirty
    }

    /// Whether a periodic pass is in progress.
    pub fn passing(&self) -> bool {
        self.pass.is_some()
    }

    /// What to do at `now`. Starts a periodic pass when one is due.
    pub fn next(&mut self, now: Instant) -> Step {
        let full_due = now >= self.last_full + self.sync_period;
        if self.dirty && now >= self.next_allowed {
            // The manifest folder's pass rides on a change sync when changes keep coming.
            return Step::Sync {
                full: !self.sliced && full_due,
            };
        }
        if self.pass.is_none() && full_due && !self.dirty {
            if !self.sliced {
                return Step::Sync { full: true };
            }
            self.pass = Some(Pass {
                started: now,
                next: 0,
            });
        }
        if let Some(pass) = self.pass {
            let overdue = now >= pass.started + self.sync_period;
            if !self.dirty || overdue {
                return Step::Slice { from: pass.next };
            }
        }
        let until = if self.dirty {
            self.next_allowed
        } else {
            self.last_full + self.sync_period
        };
        Step::Wait(until)
    }

    /// A [`Step::Sync`] ended at `now`; `ok`: it applied (else it is retried after `retry`).
    pub fn synced(&mut self, now: Instant, full: bool, ok: bool, retry: Duration) {
        if ok {
            self.dirty = false;
            self.next_allowed = now + self.min_sync_period;
            if full {
                self.last_full = now;
            }
        } else {
            self.dirty = true;
            self.next_allowed = now + retry;
        }
    }

    /// A [`Step::Slice`] ended at `now`; `reached_end`: it was the last slice of the list. A slice
    /// syncs the changes waiting too; it does not count towards `min_sync_period` (it is bounded
    /// work, not a change sync). A failed slice ends the pass (it starts again from the first
    /// slice when due, at once) and is retried as a failed sync.
    pub fn sliced(&mut self, now: Instant, ok: bool, reached_end: bool, retry: Duration) {
        let Some(pass) = &mut self.pass else {
            return;
        };
        if !ok {
            self.pass = None;
            self.synced(now, false, false, retry);
            return;
        }
        self.dirty = false;
        if reached_end {
            self.last_full = pass.started;
            self.pass = None;
        } else {
            pass.next += SLICE;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIN: Duration = Duration::from_secs(1);
    const PERIOD: Duration = Duration::from_secs(30);
    const RETRY: Duration = Duration::from_secs(1);

    fn at(t0: Instant, ms: u64) -> Instant {
        t0 + Duration::from_millis(ms)
    }

    /// A change arriving while the periodic pass is under way is synced before the next slice
    /// (the pass waits, then goes on where it was), and one arriving within min_sync_period of the
    /// last change sync waits for it, while the pass goes on meanwhile.
    #[test]
    fn a_change_goes_before_the_next_slice_of_the_periodic_pass() {
        let t0 = Instant::now();
        let mut s = Schedule::new(t0, MIN, PERIOD, true);
        assert_eq!(s.next(at(t0, 10)), Step::Wait(t0 + PERIOD));
        let t = t0 + PERIOD;
        assert_eq!(s.next(t), Step::Slice { from: 0 });
        s.sliced(t, true, false, RETRY);
        assert_eq!(s.next(t), Step::Slice { from: SLICE });
        // A change arrives between two slices: it syncs first.
        s.changed();
        assert_eq!(s.next(t), Step::Sync { full: false });
        s.synced(t, false, true, RETRY);
        assert_eq!(s.next(t), Step::Slice { from: SLICE }, "the pass resumes");
        // Another change within min_sync_period: it waits, and the pass does not go on
        // without it (a slice would sync it early).
        s.changed();
        assert_eq!(s.next(t + MIN / 2), Step::Wait(t + MIN));
        assert_eq!(s.next(t + MIN), Step::Sync { full: false });
        s.synced(t + MIN, false, true, RETRY);
        s.sliced(t, true, false, RETRY);
        s.sliced(t, true, true, RETRY);
        assert!(!s.passing(), "done");
        assert_eq!(
            s.next(t + MIN),
            Step::Wait(t + PERIOD),
            "next pass a period after this one started"
        );
    }

    /// Changes that never stop do not starve the pass: once overdue, its slices go between
    /// the change syncs.
    #[test]
    fn an_overdue_pass_goes_on_between_change_syncs() {
        let t0 = Instant::now();
        let mut s = Schedule::new(t0, MIN, PERIOD, true);
        let t = t0 + PERIOD;
        assert_eq!(s.next(t), Step::Slice { from: 0 });
        s.sliced(t, true, false, RETRY);
        s.changed();
        s.synced(t, false, true, RETRY);
        s.changed();
        assert_eq!(s.next(t + MIN / 2), Step::Wait(t + MIN), "not overdue yet");
        let late = t + PERIOD;
        assert_eq!(s.next(late), Step::Sync { full: false }, "the change first");
        s.synced(late, false, true, RETRY);
        s.changed();
        assert_eq!(
            s.next(late),
            Step::Slice { from: SLICE },
            "overdue: a slice while the change waits"
        );
    }

    /// A failed slice ends the pass and is retried after the retry delay; the pass then starts
    /// again from its first slice.
    #[test]
    fn a_failed_slice_is_retried_later_and_the_pass_starts_again() {
        let t0 = Instant::now();
        let mut s = Schedule::new(t0, MIN, PERIOD, true);
        let t = t0 + PERIOD;
        assert_eq!(s.next(t), Step::Slice { from: 0 });
        s.sliced(t, true, false, RETRY);
        assert_eq!(s.next(t), Step::Slice { from: SLICE });
        s.sliced(t, false, false, RETRY);
        assert!(!s.passing());
        assert_eq!(s.next(t), Step::Wait(t + RETRY));
        assert_eq!(s.next(t + RETRY), Step::Sync { full: false });
        s.synced(t + RETRY, false, true, RETRY);
        assert_eq!(s.next(t + RETRY), Step::Slice { from: 0 });
    }

    /// The manifest folder: the pass is one full sync, when no change waits, or riding on a
    /// change sync once due; a failed sync is retried after the retry delay.
    #[test]
    fn unsliced_sources_run_one_full_sync_per_period() {
        let t0 = Instant::now();
        let mut s = Schedule::new(t0, MIN, PERIOD, false);
        let t = t0 + PERIOD;
        assert_eq!(s.next(t), Step::Sync { full: true });
        s.synced(t, true, true, RETRY);
        assert_eq!(s.next(t), Step::Wait(t + PERIOD));
        s.changed();
        assert_eq!(s.next(t + MIN), Step::Sync { full: false });
        s.synced(t + MIN, false, false, RETRY);
        assert_eq!(
            s.next(t + MIN),
            Step::Wait(t + MIN + RETRY),
            "retried later"
        );
        s.changed();
        assert_eq!(
            s.next(t + PERIOD),
            Step::Sync { full: true },
            "due: the change sync is full"
        );
    }
}
