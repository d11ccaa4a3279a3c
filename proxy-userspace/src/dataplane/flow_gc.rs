//! The flow-map garbage collection off the sync loop: one thread walks `CONNTRACK_V1` and
//! `CONNTRACK6_V1` (idle and dead flows out, least-connection counts reconciled over both
//! families' flows, which share the backend ids: `crate::dataplane::lc_counts`) and sweeps
//! `SNAT_V1` and `SNAT6_V1` (`crate::dataplane::snat_gc`). At 500,000 backends a walk reads 500,000 counts and
//! takes about half a second; on the loop it delayed every change that arrived meanwhile.
//!
//! The loop hands each walk a copy of the programmed backends and the time it was taken; walks
//! run one at a time in request order (requests queued behind a running walk are merged into
//! one, with the newest backends), so the last walk asked for writes last. While the walk runs,
//! the loop keeps syncing, so a backend id may change under it. Two rules keep that safe:
//! - an id whose backend changed after the walk's copy ([`Shared::note_changed`]) is left alone
//!   by that walk: no correction written for it, no flow to it judged by its backend (the next
//!   walk, with a newer copy, does both);
//! - a backend id freed from a least-connection frontend is reset by the loop itself at once
//!   ([`reset_freed`]: correction = its raw count, effective count 0), so a reused id never
//!   inherits the old backend's flow count, whether or not a walk is running; the walker forgets
//!   what it last wrote for that id.

use std::{
    collections::HashMap as StdHashMap,
    sync::{Arc, Mutex, MutexGuard, mpsc},
    thread::JoinHandle,
    time::{Duration, Instant},
};

use proxy_common::{
    CtKey, CtValue, DatapathConfig, ct_flags,
    ipv6::{Backend6, Ct6Key, Ct6Value},
    proto,
    timeouts::flow_idle_expired,
};
use tracing::warn;

use crate::dataplane::{
    clock::monotonic_ns,
    lc_counts::{self, Listing},
    maps::{Conntrack, Conntrack6, LcCounts, Snat, Snat6},
    snat_gc::{self, Collected},
};

/// The programmed backends by id, as the walk judges flows and counts.
pub type Backends = crate::pipeline::programmed::BackendEntries;

/// The programmed IPv6 backends by id (`BACKENDS6_V1`; ids from the same space as IPv4's).
pub type Backends6 = crate::pipeline::programmed::BackendEntries<Backend6>;

/// Pure: should the walk drop this conntrack entry? Idle past its timeout, or a UDP flow whose
/// backend is gone (or whose id now names another address).
pub fn flow_is_dead(
    key: &CtKey,
    value: &CtValue,
    now_ns: u64,
    config: &DatapathConfig,
    backends: &Backends,
) -> bool {
    if flow_idle_expired(
        value.created_ns,
        value.last_seen_ns,
        key.proto,
        value.state,
        value.flags,
        now_ns,
        config,
    ) {
        return true;
    }
    if value.flags & ct_flags::DIRECT != 0 {
        return false; // A flow straight to a pod: no backend to outlive.
    }
    let backend_alive = backends
        .get(&value.backend_id)
        .is_some_and(|b| b.addr == value.backend_addr && b.port == value.backend_port);
    key.proto == proto::UDP && !backend_alive
}

/// Pure: [`flow_is_dead`] for an IPv6 flow. `backends6` `None`: the agent does not program IPv6
/// backends (maps written by someone else), so no flow is judged by its backend, only by idle time.
pub fn flow_is_dead6(
    key: &Ct6Key,
    value: &Ct6Value,
    now_ns: u64,
    config: &DatapathConfig,
    backends6: Option<&Backends6>,
) -> bool {
    if flow_idle_expired(
        value.created_ns,
        value.last_seen_ns,
        key.proto,
        value.state,
        value.flags,
        now_ns,
        config,
    ) {
        return true;
    }
    if value.flags & ct_flags::DIRECT != 0 {
        return false;
    }
    key.proto == proto::UDP && !backend6_current(value, backends6)
}

/// Does the IPv6 flow's backend id still name the backend it was created with (`None`: not
/// known, taken as yes)?
fn backend6_current(value: &Ct6Value, backends6: Option<&Backends6>) -> bool {
    backends6.is_none_or(|b| {
        b.get(&value.backend_id)
            .is_some_and(|b| b.addr == value.backend_addr && b.port == value.backend_port)
    })
}

/// The maps a walk reads and cleans (the pinned maps; a fake in tests).
pub trait FlowMaps: Send + 'static {
    fn conntrack_entries(&self) -> Vec<(CtKey, CtValue)>;
    /// Remove `key` if it still holds the flow `listed` was read from (see
    /// `Conntrack::remove_if_unchanged`); was it removed?
    fn remove_conntrack(&mut self, key: &CtKey, listed: &CtValue) -> bool;
    fn conntrack6_entries(&self) -> Vec<(Ct6Key, Ct6Value)>;
    /// As [`FlowMaps::remove_conntrack`], IPv6.
    fn remove_conntrack6(&mut self, key: &Ct6Key, listed: &Ct6Value) -> bool;
    /// Backend ids below this have a least-connection count.
    fn lc_ids(&self) -> u32;
    fn lc_active(&self, id: u32) -> u64;
    fn set_lc_adjust(&mut self, id: u32, value: u64) -> Result<(), crate::dataplane::Error>;
    fn collect_snat(&mut self, now_ns: u64, config: &DatapathConfig) -> Collected;
    fn collect_snat6(&mut self, now_ns: u64, config: &DatapathConfig) -> Collected;
}

/// The agent's pinned flow maps.
pub struct PinnedFlowMaps {
    pub conntrack: Conntrack,
    pub conntrack6: Conntrack6,
    pub snat: Snat,
    pub snat6: Snat6,
    pub lc: LcCounts,
}

impl FlowMaps for PinnedFlowMaps {
    fn conntrack_entries(&self) -> Vec<(CtKey, CtValue)> {
        self.conntrack.entries()
    }

    fn remove_conntrack(&mut self, key: &CtKey, listed: &CtValue) -> bool {
        self.conntrack.remove_if_unchanged(key, listed)
    }

    fn conntrack6_entries(&self) -> Vec<(Ct6Key, Ct6Value)> {
        self.conntrack6.entries()
    }

    fn remove_conntrack6(&mut self, key: &Ct6Key, listed: &Ct6Value) -> bool {
        self.conntrack6.remove_if_unchanged(key, listed)
    }

    fn lc_ids(&self) -> u32 {
        self.lc.ids()
    }

    fn lc_active(&self, id: u32) -> u64 {
        self.lc.active(id)
    }

    fn set_lc_adjust(&mut self, id: u32, value: u64) -> Result<(), crate::dataplane::Error> {
        self.lc.set_adjust(id, value)
    }

    fn collect_snat(&mut self, now_ns: u64, config: &DatapathConfig) -> Collected {
        snat_gc::collect(&mut self.snat, now_ns, config)
    }

    fn collect_snat6(&mut self, now_ns: u64, config: &DatapathConfig) -> Collected {
        snat_gc::collect(&mut self.snat6, now_ns, config)
    }
}

/// One walk asked for.
pub struct Walk {
    /// The programmed backends when the walk was asked for.
    pub backends: Backends,
    /// The programmed IPv6 backends then (`None`: the agent does not program them).
    pub backends6: Option<Backends6>,
    /// CLOCK_MONOTONIC when `backends` was copied.
    pub copied_ns: u64,
    /// Sweep SNAT (both families) too (the periodic pass).
    pub snat: bool,
}

/// What a walk did (reported on the loop: metrics, occupancy).
#[derive(Clone, Copy, Debug, Default)]
pub struct Walked {
    pub conntrack_listed: usize,
    pub conntrack_removed: usize,
    pub conntrack6_listed: usize,
    pub conntrack6_removed: usize,
    pub took: Duration,
    pub snat: Option<Collected>,
    /// `SNAT6_V1`'s sweep, with `snat`.
    pub snat6: Option<Collected>,
}

/// State shared by the loop and the walker (held for a few map writes at most).
#[derive(Debug, Default)]
pub struct Shared {
    /// Walks asked for and not finished.
    pending: usize,
    /// Backend ids changed while a walk was pending, with when (CLOCK_MONOTONIC).
    changed: StdHashMap<u32, u64>,
    /// Ids the loop reset (`reset_freed`) since the walker last looked.
    reset: Vec<u32>,
}

impl Shared {
    /// The loop applied ops that put or deleted these backend ids (recorded only while a walk is
    /// pending: otherwise every later walk copies the backends after the change).
    pub fn note_changed(&mut self, ids: impl IntoIterator<Item = u32>) {
        if self.pending == 0 {
            return;
        }
        let now = monotonic_ns();
        for id in ids {
            self.changed.insert(id, now);
        }
    }

    fn changed_since(&self, id: u32, ns: u64) -> bool {
        self.changed.get(&id).is_some_and(|&at| at >= ns)
    }
}

/// Locks `shared` (plain data: a panic while held leaves it usable).
pub fn lock(shared: &Mutex<Shared>) -> MutexGuard<'_, Shared> {
    shared.lock().unwrap_or_else(|e| e.into_inner())
}

/// On the loop, right after applying a plan that freed `ids` from a least-connection frontend:
/// each id's correction becomes its raw count (effective count 0), before a new backend can
/// take the id. Synchronous and O(ids).
pub fn reset_freed(lc: &mut LcCounts, shared: &Mutex<Shared>, ids: &[u32]) {
    if ids.is_empty() {
        return;
    }
    let mut shared = lock(shared);
    let counted = lc.ids();
    for &id in ids.iter().filter(|&&id| id < counted) {
        if let Err(e) = lc.set_adjust(id, lc.active(id)) {
            warn!("resetting the least-connection count of freed backend {id}: {e}");
        }
        shared.reset.push(id);
    }
    // A running walk must not write its older correction over this one.
    shared.note_changed(ids.iter().copied());
}

/// What the walker last wrote to `LCADJ_V1`, by backend id (`None`: not written, or reset
/// since). Most corrections are 0 (every flow of the backend ended as the datapath saw), so a
/// bit per id says "written", and the values live in pages of [`Written::PAGE`] ids, allocated
/// at the first non-zero value in them (an absent page reads 0). At 500,000 ids: 61 KiB while
/// every correction is 0, at most 4 MB plus the bits (a `Vec<Option<u64>>` was 8 MB).
#[derive(Debug, Default)]
struct Written {
    known: Vec<u64>,
    pages: Vec<Option<Box<[u64; Written::PAGE]>>>,
}

impl Written {
    const PAGE: usize = 512;

    fn get(&self, id: u32) -> Option<u64> {
        let id = id as usize;
        let known = self
            .known
            .get(id / 64)
            .is_some_and(|w| w & (1 << (id % 64)) != 0);
        known.then(|| match self.pages.get(id / Self::PAGE) {
            Some(Some(page)) => page[id % Self::PAGE],
            _ => 0,
        })
    }

    fn set(&mut self, id: u32, value: u64) {
        let id = id as usize;
        if self.known.len() <= id / 64 {
            self.known.resize(id / 64 + 1, 0);
        }
        self.known[id / 64] |= 1 << (id % 64);
        let page = id / Self::PAGE;
        if value == 0 && !matches!(self.pages.get(page), Some(Some(_))) {
            return;
        }
        if self.pages.len() <= page {
            self.pages.resize_with(page + 1, || None);
        }
        self.pages[page].get_or_insert_with(|| Box::new([0; Self::PAGE]))[id % Self::PAGE] = value;
    }

    fn forget(&mut self, id: u32) {
        let id = id as usize;
        if let Some(w) = self.known.get_mut(id / 64) {
            *w &= !(1 << (id % 64));
        }
    }
}

/// The walker thread's state.
struct Walker<M> {
    maps: M,
    config: DatapathConfig,
    shared: Arc<Mutex<Shared>>,
    /// The corrections last written to `LCADJ_V1` (written again only when they change), by id.
    lc_written: Written,
    /// The highest backend id reconciled (a freed id goes back to 0 at the next walk).
    lc_max_id: u32,
}

impl<M: FlowMaps> Walker<M> {
    /// Removes idle-expired flows and UDP flows whose backend is gone, reconciles the
    /// least-connection counts of every id up to the highest programmed (or reconciled before).
    fn walk(&mut self, walk: &Walk) -> Walked {
        let started = Instant::now();
        for id in std::mem::take(&mut lock(&self.shared).reset) {
            self.lc_written.forget(id);
        }
        let programmed_max = walk
            .backends
            .ids()
            .chain(walk.backends6.iter().flat_map(|b| b.ids()))
            .max()
            .unwrap_or(0);
        let max_id = programmed_max
            .max(self.lc_max_id)
            .min(self.maps.lc_ids().saturating_sub(1));
        let (config, backends, backends6, shared, copied) = (
            &self.config,
            &walk.backends,
            walk.backends6.as_ref(),
            &self.shared,
            walk.copied_ns,
        );
        // Judged by its backend only if the copy still says what the id holds.
        let judged = |created_ns: u64, backend_id: u32| {
            created_ns <= copied && !lock(shared).changed_since(backend_id, copied)
        };
        let maps = &self.maps;
        let v4 = Listing::ipv4(
            || maps.conntrack_entries(),
            |key, value, now| {
                if flow_idle_expired(
                    value.created_ns,
                    value.last_seen_ns,
                    key.proto,
                    value.state,
                    value.flags,
                    now,
                    config,
                ) {
                    return true;
                }
                judged(value.created_ns, value.backend_id)
                    && flow_is_dead(key, value, now, config, backends)
            },
            backends,
        );
        let v6 = Listing::<Ct6Value> {
            list: Box::new(|| maps.conntrack6_entries()),
            dead: Box::new(|key, value, now| {
                // Idle expiry first (`flow_is_dead6` with no backends judges nothing else).
                flow_is_dead6(key, value, now, config, None)
                    || (judged(value.created_ns, value.backend_id)
                        && flow_is_dead6(key, value, now, config, backends6))
            }),
            current: Box::new(|v| backend6_current(v, backends6)),
        };
        let done = lc_counts::reconcile(1..=max_id, |id| maps.lc_active(id), monotonic_ns, v4, v6);
        // Only entries still as listed: the datapath may have reused a key meanwhile.
        let removed = done
            .dead
            .iter()
            .filter(|(key, listed)| self.maps.remove_conntrack(key, listed))
            .count();
        let removed6 = done
            .dead6
            .iter()
            .filter(|(key, listed)| self.maps.remove_conntrack6(key, listed))
            .count();
        for chunk in done.corrections.chunks(1024) {
            let shared = lock(&self.shared);
            for &(id, adjust) in chunk {
                if shared.changed_since(id, copied) || self.lc_written.get(id) == Some(adjust) {
                    continue;
                }
                match self.maps.set_lc_adjust(id, adjust) {
                    Ok(()) => self.lc_written.set(id, adjust),
                    Err(e) => {
                        warn!("writing the least-connection correction of backend {id}: {e}")
                    }
                }
            }
        }
        self.lc_max_id = programmed_max;
        let now = monotonic_ns();
        let snat = walk.snat.then(|| self.maps.collect_snat(now, &self.config));
        let snat6 = walk
            .snat
            .then(|| self.maps.collect_snat6(now, &self.config));
        Walked {
            conntrack_listed: done.total,
            conntrack_removed: removed,
            conntrack6_listed: done.total6,
            conntrack6_removed: removed6,
            took: started.elapsed(),
            snat,
            snat6,
        }
    }
}

/// The loop's handle on the walker thread.
pub struct FlowGc {
    requests: Option<mpsc::Sender<Walk>>,
    walked: tokio::sync::mpsc::UnboundedReceiver<Walked>,
    shared: Arc<Mutex<Shared>>,
    thread: Option<JoinHandle<()>>,
}

impl FlowGc {
    /// Starts the walker thread over `maps`.
    pub fn start(maps: impl FlowMaps, config: DatapathConfig) -> std::io::Result<Self> {
        let shared = Arc::new(Mutex::new(Shared::default()));
        let (requests, rx) = mpsc::channel::<Walk>();
        let (tx, walked) = tokio::sync::mpsc::unbounded_channel();
        let mut walker = Walker {
            maps,
            config,
            shared: shared.clone(),
            lc_written: Written::default(),
            lc_max_id: 0,
        };
        let thread = std::thread::Builder::new()
            .name("flow-gc".into())
            .spawn(move || {
                while let Ok(mut walk) = rx.recv() {
                    // Walks asked for meanwhile: one walk with the newest backends does for all.
                    let mut merged = 1;
                    while let Ok(next) = rx.try_recv() {
                        let snat = walk.snat || next.snat;
                        walk = Walk { snat, ..next };
                        merged += 1;
                    }
                    let done = walker.walk(&walk);
                    {
                        let mut shared = lock(&walker.shared);
                        shared.pending -= merged;
                        if shared.pending == 0 {
                            shared.changed.clear();
                        }
                    }
                    if tx.send(done).is_err() {
                        break;
                    }
                }
            })?;
        Ok(Self {
            requests: Some(requests),
            walked,
            shared,
            thread: Some(thread),
        })
    }

    /// Asks for a walk over `backends` (copied by the caller just now), with no IPv6 backends
    /// known (see [`Walk::backends6`]). Returns at once.
    pub fn request(&self, backends: Backends, snat: bool) {
        self.request_dual(backends, None, snat);
    }

    /// [`FlowGc::request`] with the programmed IPv6 backends too.
    pub fn request_dual(&self, backends: Backends, backends6: Option<Backends6>, snat: bool) {
        let walk = Walk {
            backends,
            backends6,
            copied_ns: monotonic_ns(),
            snat,
        };
        let Some(requests) = &self.requests else {
            return;
        };
        lock(&self.shared).pending += 1;
        if requests.send(walk).is_err() {
            lock(&self.shared).pending -= 1;
            warn!("the flow garbage collection thread has stopped; conntrack is left to its LRU");
        }
    }

    /// The state shared with the walker (the loop records backend changes in it).
    pub fn shared(&self) -> &Mutex<Shared> {
        &self.shared
    }

    /// Resolves with the next finished walk. Cancel-safe.
    pub async fn walked(&mut self) -> Option<Walked> {
        self.walked.recv().await
    }
}

impl Drop for FlowGc {
    fn drop(&mut self) {
        // The walker ends after its current walk.
        self.requests = None;
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use proxy_common::{Backend, ct_dir, ct_state, ipv6::Backend6};

    use super::*;

    /// Flow maps in memory; `entries()` waits for a go from the test (a walk held mid-way).
    struct Fake {
        conntrack: Vec<(CtKey, CtValue)>,
        conntrack6: Vec<(Ct6Key, Ct6Value)>,
        flows: Vec<u64>,
        adjust: Arc<Mutex<Vec<u64>>>,
        listing: Arc<Mutex<mpsc::Receiver<()>>>,
        started: mpsc::Sender<()>,
    }

    /// The test's side of a [`Fake`]: `go` lets one held listing proceed, `started` says a walk
    /// began listing, `adjust` is what the walks wrote to `LCADJ_V1`.
    type Held = (mpsc::Sender<()>, mpsc::Receiver<()>, Arc<Mutex<Vec<u64>>>);

    impl Fake {
        /// A fake with these flows and `LCFLOWS_V1` counts (`flows[id]`), and the test's side of
        /// it.
        fn held(
            conntrack: Vec<(CtKey, CtValue)>,
            conntrack6: Vec<(Ct6Key, Ct6Value)>,
            flows: Vec<u64>,
        ) -> (Self, Held) {
            let (go, listing) = mpsc::channel();
            let (started, started_rx) = mpsc::channel();
            let adjust = Arc::new(Mutex::new(vec![0u64; flows.len()]));
            let fake = Fake {
                conntrack,
                conntrack6,
                flows,
                adjust: adjust.clone(),
                listing: Arc::new(Mutex::new(listing)),
                started,
            };
            (fake, (go, started_rx, adjust))
        }
    }

    impl FlowMaps for Fake {
        fn conntrack_entries(&self) -> Vec<(CtKey, CtValue)> {
            let _ = self.started.send(());
            let _ = self.listing.lock().expect("listing").recv();
            self.conntrack.clone()
        }

        fn remove_conntrack(&mut self, key: &CtKey, listed: &CtValue) -> bool {
            let before = self.conntrack.len();
            self.conntrack.retain(|(k, v)| k != key || v != listed);
            self.conntrack.len() < before
        }

        fn conntrack6_entries(&self) -> Vec<(Ct6Key, Ct6Value)> {
            self.conntrack6.clone()
        }

        fn remove_conntrack6(&mut self, key: &Ct6Key, listed: &Ct6Value) -> bool {
            let before = self.conntrack6.len();
            self.conntrack6.retain(|(k, v)| k != key || v != listed);
            self.conntrack6.len() < before
        }

        fn lc_ids(&self) -> u32 {
            self.flows.len() as u32
        }

        fn lc_active(&self, id: u32) -> u64 {
            self.flows[id as usize]
        }

        fn set_lc_adjust(&mut self, id: u32, value: u64) -> Result<(), crate::dataplane::Error> {
            self.adjust.lock().expect("adjust")[id as usize] = value;
            Ok(())
        }

        fn collect_snat(&mut self, _: u64, _: &DatapathConfig) -> Collected {
            Collected::default()
        }

        fn collect_snat6(&mut self, _: u64, _: &DatapathConfig) -> Collected {
            Collected::default()
        }
    }

    fn backend(last: u8) -> Backend {
        Backend {
            addr: [10, 244, 0, last],
            port: 80u16.to_be_bytes(),
            proto: proto::TCP,
            flags: 0,
        }
    }

    /// A counted flow to backend 1 at `backend(addr)`, created long ago and still fresh.
    fn counted_flow(port: u16, addr: u8) -> (CtKey, CtValue) {
        let now = monotonic_ns();
        let key = CtKey {
            saddr: [10, 244, 9, 9],
            daddr: [10, 96, 0, 1],
            sport: port.to_be_bytes(),
            dport: 80u16.to_be_bytes(),
            proto: proto::TCP,
            dir: ct_dir::ORIGINAL,
            _pad: [0; 2],
        };
        let value = CtValue {
            last_seen_ns: now,
            created_ns: 1,
            backend_id: 1,
            backend_addr: backend(addr).addr,
            backend_port: backend(addr).port,
            state: ct_state::ESTABLISHED,
            flags: ct_flags::COUNTED,
            ..Default::default()
        };
        (key, value)
    }

    /// A walk held in its listing does not hold the loop: the loop asks for another walk, frees
    /// backend id 1 of a least-connection frontend (reset at once) and gives the id to a new
    /// backend meanwhile. The held walk, whose copy still says id 1 is the old backend with three
    /// live flows, must not write its correction over the reset; the walk asked for after the
    /// change writes last, from the new copy (the old backend's flows no longer count).
    #[test]
    fn a_walk_in_flight_never_writes_a_stale_correction_over_a_freed_and_reused_id() {
        // The datapath counted the old backend's three flows on id 1.
        let (fake, (go, started_rx, adjust)) = Fake::held(
            (1..=3).map(|p| counted_flow(p, 11)).collect(),
            Vec::new(),
            vec![0, 3, 0, 0],
        );
        let mut gc = FlowGc::start(fake, DatapathConfig::DEFAULT).expect("thread");
        let old: Backends = [(1, backend(11))].into_iter().collect();
        gc.request(old, true);
        started_rx.recv().expect("the walk lists");
        // The walk is now waiting in its listing. The loop frees id 1 (the reset, as on the
        // loop: the pinned LcCounts is stood in for by the shared writes below) and reuses it.
        {
            let mut shared = lock(gc.shared());
            shared.reset.push(1);
            adjust.lock().expect("adjust")[1] = 3;
            shared.note_changed([1]);
        }
        let new: Backends = [(1, backend(12))].into_iter().collect();
        gc.request(new, false);
        go.send(()).expect("first listing");
        let rt = tokio::runtime::Builder::new_current_thread()
            .build()
            .expect("runtime");
        let first = rt.block_on(gc.walked()).expect("first walk");
        assert_eq!(first.conntrack_listed, 3);
        assert!(first.snat.is_some(), "the periodic walk sweeps SNAT");
        assert_eq!(
            adjust.lock().expect("adjust")[1],
            3,
            "the held walk left the reset id alone (it would have written 0: three live flows)"
        );
        go.send(()).expect("second listing");
        let second = rt.block_on(gc.walked()).expect("second walk");
        assert_eq!(second.conntrack_listed, 3);
        assert_eq!(
            adjust.lock().expect("adjust")[1],
            3,
            "the new walk: the old backend's flows do not count for the new one"
        );
        assert_eq!(lock(gc.shared()).pending, 0);
        assert!(lock(gc.shared()).changed.is_empty(), "cleared when idle");
    }

    /// Requests queued behind a running walk make one walk, with the newest backends.
    #[test]
    fn walks_asked_for_during_a_walk_are_merged_into_one() {
        let (fake, (go, started_rx, adjust)) =
            Fake::held(vec![counted_flow(1, 11)], Vec::new(), vec![0, 1, 0, 0]);
        let mut gc = FlowGc::start(fake, DatapathConfig::DEFAULT).expect("thread");
        let with = |addr| -> Backends { [(1, backend(addr))].into_iter().collect() };
        gc.request(with(11), false);
        started_rx.recv().expect("the walk lists");
        for _ in 0..3 {
            gc.request(with(12), false);
        }
        // Only the one walk lists twice: held, then one merged walk.
        go.send(()).expect("go");
        go.send(()).expect("go");
        let rt = tokio::runtime::Builder::new_current_thread()
            .build()
            .expect("runtime");
        rt.block_on(gc.walked()).expect("first");
        rt.block_on(gc.walked()).expect("merged");
        assert_eq!(lock(gc.shared()).pending, 0, "four requests, two walks");
        // The merged walk judged by the newest copy: the flow is to the old address, so it does
        // not count; the correction makes the effective count 0.
        assert_eq!(adjust.lock().expect("adjust")[1], 1);
    }

    fn backend6(last: u8) -> Backend6 {
        let mut addr = [0u8; 16];
        addr[0] = 0xfd;
        addr[15] = last;
        Backend6 {
            addr,
            port: 53u16.to_be_bytes(),
            proto: proto::UDP,
            flags: 0,
        }
    }

    /// An IPv6 UDP flow (ORIGINAL entry) from client port `port` to backend `id` at
    /// `backend6(addr)`, last seen `idle_s` ago.
    fn flow6(port: u16, id: u32, addr: u8, idle_s: u64, flags: u8) -> (Ct6Key, Ct6Value) {
        let now = monotonic_ns();
        let key = Ct6Key {
            saddr: [0xfd, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0x99],
            daddr: [0xfd, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0x10],
            sport: port.to_be_bytes(),
            dport: 53u16.to_be_bytes(),
            proto: proto::UDP,
            dir: ct_dir::ORIGINAL,
            _pad: [0; 2],
        };
        let value = Ct6Value {
            last_seen_ns: now.saturating_sub(idle_s * 1_000_000_000),
            created_ns: 1,
            backend_id: id,
            backend_addr: backend6(addr).addr,
            backend_port: backend6(addr).port,
            state: ct_state::ESTABLISHED,
            flags,
            ..Default::default()
        };
        (key, value)
    }

    /// The walk cleans `CONNTRACK6_V1` as `CONNTRACK_V1`: idle flows out, UDP flows whose IPv6
    /// backend is gone (or whose id names another address now) out when the IPv6 backends are
    /// known, kept when they are not; and the least-connection truth of an id counts its IPv6
    /// flows (ids are shared with IPv4).
    #[test]
    fn the_walk_cleans_ipv6_flows_and_counts_them_for_least_connection() {
        let c = ct_flags::COUNTED;
        let live = flow6(1, 5, 55, 0, c);
        let idle = flow6(2, 5, 55, 3_600, c);
        let gone = flow6(3, 6, 66, 0, c);
        let moved = flow6(4, 5, 77, 0, c);
        // The datapath counted all four on ids 5 and 6.
        let (fake, (go, started_rx, adjust)) = Fake::held(
            Vec::new(),
            vec![live, idle, gone, moved],
            vec![0, 0, 0, 0, 0, 3, 1, 0],
        );
        let mut gc = FlowGc::start(fake, DatapathConfig::DEFAULT).expect("thread");
        let rt = tokio::runtime::Builder::new_current_thread()
            .build()
            .expect("runtime");
        // An IPv4 backend with id 7: the walk reconciles ids 1..=7.
        let ipv4: Backends = [(7, backend(11))].into_iter().collect();
        // IPv6 backends not known: only the idle flow goes; the counts keep the live flows.
        gc.request(ipv4.clone(), false);
        started_rx.recv().expect("lists");
        go.send(()).expect("go");
        let first = rt.block_on(gc.walked()).expect("walk");
        assert_eq!((first.conntrack6_listed, first.conntrack6_removed), (4, 1));
        // Id 5's truth is its two live flows (`live`, `moved`: no address to tell), id 6's one.
        assert_eq!(adjust.lock().expect("adjust")[5], 3 - 2);
        assert_eq!(adjust.lock().expect("adjust")[6], 0);
        // Known: backend 6 is gone and id 5 names backend6(55): `gone` and `moved` go too, and
        // only `live` counts for id 5.
        let backends6: Backends6 = [(5, backend6(55))].into_iter().collect();
        gc.request_dual(ipv4, Some(backends6), false);
        started_rx.recv().expect("lists");
        go.send(()).expect("go");
        let second = rt.block_on(gc.walked()).expect("walk");
        assert_eq!(
            (second.conntrack6_listed, second.conntrack6_removed),
            (3, 2)
        );
        assert_eq!(adjust.lock().expect("adjust")[5], 3 - 1);
        assert_eq!(adjust.lock().expect("adjust")[6], 1);
    }

    #[test]
    fn written_corrections_read_back_what_was_set_and_forgotten() {
        // Against the plain `Vec<Option<u64>>` it replaced, over ids in three pages and values
        // that are mostly 0 (a small xorshift: reproducible).
        let mut written = Written::default();
        let mut model: Vec<Option<u64>> = vec![None; 3 * Written::PAGE];
        let mut x = 0x9e37_79b9_7f4a_7c15u64;
        for _ in 0..20_000 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let id = (x % model.len() as u64) as u32;
            match (x >> 32) % 8 {
                0 => {
                    written.forget(id);
                    model[id as usize] = None;
                }
                1 => {
                    let v = [1, u64::MAX, x >> 40][(x >> 20) as usize % 3];
                    written.set(id, v);
                    model[id as usize] = Some(v);
                }
                _ => {
                    written.set(id, 0);
                    model[id as usize] = Some(0);
                }
            }
        }
        for (id, want) in model.iter().enumerate() {
            assert_eq!(written.get(id as u32), *want, "id {id}");
        }
        assert_eq!(written.get(u32::MAX), None, "beyond every id set");
    }

    #[test]
    fn zero_corrections_take_no_value_page() {
        let mut written = Written::default();
        for id in 0..500_000 {
            written.set(id, 0);
        }
        assert!(written.pages.iter().all(Option::is_none));
        assert_eq!(written.get(499_999), Some(0));
        written.set(700, 5);
        assert_eq!(written.pages.iter().filter(|p| p.is_some()).count(), 1);
        assert_eq!((written.get(700), written.get(701)), (Some(5), Some(0)));
        written.set(700, 0);
        assert_eq!(
            written.get(700),
            Some(0),
            "a page once allocated keeps the 0 too"
        );
    }

    /// Flow maps with SNAT entries only (both families, in memory).
    struct SnatMaps {
        snat: StdHashMap<proxy_common::SnatKey, proxy_common::SnatValue>,
        snat6: StdHashMap<proxy_common::ipv6::Snat6Key, proxy_common::ipv6::Snat6Value>,
    }

    impl FlowMaps for SnatMaps {
        fn conntrack_entries(&self) -> Vec<(CtKey, CtValue)> {
            Vec::new()
        }

        fn remove_conntrack(&mut self, _: &CtKey, _: &CtValue) -> bool {
            false
        }

        fn conntrack6_entries(&self) -> Vec<(Ct6Key, Ct6Value)> {
            Vec::new()
        }

        fn remove_conntrack6(&mut self, _: &Ct6Key, _: &Ct6Value) -> bool {
            false
        }

        fn lc_ids(&self) -> u32 {
            0
        }

        fn lc_active(&self, _: u32) -> u64 {
            0
        }

        fn set_lc_adjust(&mut self, _: u32, _: u64) -> Result<(), crate::dataplane::Error> {
            Ok(())
        }

        fn collect_snat(&mut self, now_ns: u64, config: &DatapathConfig) -> Collected {
            snat_gc::collect(&mut self.snat, now_ns, config)
        }

        fn collect_snat6(&mut self, now_ns: u64, config: &DatapathConfig) -> Collected {
            snat_gc::collect(&mut self.snat6, now_ns, config)
        }
    }

    /// The periodic walk sweeps `SNAT6_V1` beside `SNAT_V1` and reports each (the numbers the
    /// loop's occupancy and metrics take); a walk without SNAT touches neither.
    #[test]
    fn the_periodic_walk_sweeps_both_families_snat_maps_and_reports_each() {
        use proxy_common::ipv6::{Snat6Key, Snat6Value};
        let config = DatapathConfig {
            udp_timeout_s: 1,
            udp_stream_timeout_s: 1,
            ..DatapathConfig::DEFAULT
        };
        let now = monotonic_ns();
        // UDP flows through the node: one dead (10 s idle), one live (just seen).
        let flow6 = |cport: u16, last_seen_ns: u64| {
            let value = |addr: [u8; 16], port: u16| Snat6Value {
                last_seen_ns,
                addr,
                port: port.to_be_bytes(),
                state: ct_state::UDP,
                ..Snat6Value::default()
            };
            let out_key = Snat6Key {
                saddr: [0xfd, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 0],
                daddr: [0xfd, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0x20],
                sport: cport.to_be_bytes(),
                dport: 53u16.to_be_bytes(),
                proto: proto::UDP,
                dir: ct_dir::ORIGINAL,
                _pad: [0; 2],
            };
            let out = value(
                [0xfd, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0x10],
                61_000 + cport,
            );
            let in_key = snat_gc::in_key_of_out(&out_key, &out);
            [(out_key, out), (in_key, value(out_key.saddr, cport))]
        };
        let ten_s_ago = now.saturating_sub(10_000_000_000);
        let maps = SnatMaps {
            snat: StdHashMap::new(),
            snat6: flow6(1, ten_s_ago)
                .into_iter()
                .chain(flow6(2, now))
                .collect(),
        };
        let mut gc = FlowGc::start(maps, config).expect("thread");
        let rt = tokio::runtime::Builder::new_current_thread()
            .build()
            .expect("runtime");
        gc.request(Backends::default(), false);
        let quiet = rt.block_on(gc.walked()).expect("walk");
        assert_eq!((quiet.snat, quiet.snat6), (None, None));
        gc.request(Backends::default(), true);
        let walked = rt.block_on(gc.walked()).expect("walk");
        assert_eq!(walked.snat, Some(Collected::default()), "IPv4: empty");
        assert_eq!(
            walked.snat6,
            Some(Collected {
                flows: 1,
                orphans: 0,
                removed: 2,
                remaining: 2,
            }),
            "IPv6: the dead flow's two entries out, the live one's two left"
        );
    }
}
