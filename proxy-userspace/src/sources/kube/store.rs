//! The Services and EndpointSlices as the agent reads them: a list kept up to date per watch event,
//! handed out as a shared pointer, so reading the state after one event costs one `Arc` clone,
//! not a copy of every object's pointer (100,000 of them at 50,000 Services, ~3 ms).
//!
//! The list is copy-on-write (`Arc<Vec<Arc<T>>>`): an event changes it in place unless a sync
//! still holds the last state read, in which case the first event after that read copies it once.
//! Its order is stable, which is what the translation cache's comparison by place relies on: a
//! changed object keeps its place, a new one is appended, a deleted one's place is taken by the
//! last object (two places differ). A relist is applied at its end (`InitDone`), as the kube-rs
//! store does, so a half-listed state is never visible; objects still there keep their place (and
//! their `Arc` when unchanged).
//!
//! Each store also keeps what changed since the agent last read it (per key: the object before
//! and the object now), so a sync after one event looks at one object instead of comparing
//! every place ([`Ordered::state_and_changes`]). A relist, or more changes than a comparison of
//! places would cost, make it "unknown" (the reader compares the whole list then).
//!
//! Owns nothing but the list, its index by (namespace, name) (the objects' own shared names) and the change log. May call:
//! kube-runtime's event and `Lookup` types.

use std::sync::{Arc, Mutex, MutexGuard};

use kube::runtime::{reflector::Lookup, watcher};
use tokio::sync::watch;

use crate::{
    pipeline::fast_hash::HashMap,
    sources::{
        endpoints::SliceData,
        names::{self, Name},
        services::ServiceData,
        snapshot::{Changed, Objects},
    },
};

/// An object's identity in a store: (namespace, name), as the kube-rs store keys objects of one
/// kind. The object's own shared strings: the index holds no copy of them.
type Key = (Name, Name);

/// An object kept in an [`Ordered`] store: its namespace and name as the [`Lookup`] gives them,
/// shared.
pub trait Keyed {
    fn namespace_and_name(&self) -> (&Option<Name>, &Option<Name>);
}

impl Keyed for ServiceData {
    fn namespace_and_name(&self) -> (&Option<Name>, &Option<Name>) {
        (&self.namespace, &self.name)
    }
}

impl Keyed for SliceData {
    fn namespace_and_name(&self) -> (&Option<Name>, &Option<Name>) {
        (&self.namespace, &self.name)
    }
}

/// (A missing namespace or name keys as "", as in the kube-rs store.)
fn key_of<T: Keyed>(o: &T) -> Key {
    let (namespace, name) = o.namespace_and_name();
    let or_empty = |n: &Option<Name>| n.clone().unwrap_or_else(|| names::namespace(""));
    (or_empty(namespace), or_empty(name))
}

/// The objects of one kind in a stable order, with an index by key (pure: no locks, no tasks).
#[derive(Debug)]
pub struct Ordered<T> {
    objects: Arc<Vec<Arc<T>>>,
    index: HashMap<Key, usize>,
    /// The relist being received (between `Init` and `InitDone`).
    relist: Option<Vec<T>>,
    /// Keys changed since the last [`Ordered::state_and_changes`], each with the object it held
    /// then (`None`: it did not exist); `None`: not known (the first list, a relist, or too many).
    log: Option<HashMap<Key, Option<Arc<T>>>>,
}

impl<T> Default for Ordered<T> {
    fn default() -> Self {
        Self {
            objects: Arc::default(),
            index: HashMap::default(),
            relist: None,
            log: None,
        }
    }
}

/// Changes logged beyond this many (plus an eighth of the objects), the reader is better off
/// comparing places.
const LOG_MAX: usize = 1_024;

impl<T: Lookup + Keyed + PartialEq + Clone> Ordered<T> {
    /// The objects now (shared; the list is not copied).
    pub fn state(&self) -> Arc<Vec<Arc<T>>> {
        self.objects.clone()
    }

    pub fn len(&self) -> usize {
        self.objects.len()
    }

    pub fn is_empty(&self) -> bool {
        self.objects.is_empty()
    }

    /// The objects now, and what changed since the last call (`None`: not known; compare the
    /// whole list). Each changed key appears once, with the object before and after (`None`:
    /// absent); a key changed back to the very object it held is left out.
    pub fn state_and_changes(&mut self) -> (Objects<T>, Option<Vec<Changed<T>>>) {
        let log = self.log.replace(HashMap::default());
        let changes = log.map(|log| {
            log.into_iter()
                .filter_map(|(key, before)| {
                    let after = self.index.get(&key).map(|&i| self.objects[i].clone());
                    let same = match (&before, &after) {
                        (Some(b), Some(a)) => Arc::ptr_eq(b, a),
                        (None, None) => true,
                        _ => false,
                    };
                    (!same).then_some(Changed { before, after })
                })
                .collect()
        });
        (self.state(), changes)
    }

    /// Logs that `key` is about to change (keeps the first object it held since the last read).
    fn log_change(&mut self, key: &Key) {
        let limit = LOG_MAX + self.objects.len() / 8;
        let Some(log) = &mut self.log else {
            return;
        };
        if !log.contains_key(key) {
            if log.len() >= limit {
                self.log = None;
                return;
            }
            let before = self.index.get(key).map(|&i| self.objects[i].clone());
            log.insert(key.clone(), before);
        }
    }

    /// Applies one watch event. Returns whether the visible list may have changed.
    pub fn apply(&mut self, event: watcher::Event<T>) -> bool {
        match event {
            watcher::Event::Apply(o) => self.upsert(o),
            watcher::Event::Delete(o) => self.delete(&key_of(&o)),
            watcher::Event::Init => {
                self.relist = Some(Vec::new());
                false
            }
            watcher::Event::InitApply(o) => {
                self.relist.get_or_insert_with(Vec::new).push(o);
                false
            }
            watcher::Event::InitDone => {
                let listed = self.relist.take().unwrap_or_default();
                self.replace_all(listed);
                true
            }
        }
    }

    fn upsert(&mut self, o: T) -> bool {
        let key = key_of(&o);
        match self.index.get(&key) {
            Some(&i) if *self.objects[i] == o => false,
            Some(&i) => {
                self.log_change(&key);
                Arc::make_mut(&mut self.objects)[i] = Arc::new(o);
                true
            }
            None => {
                self.log_change(&key);
                self.index.insert(key, self.objects.len());
                Arc::make_mut(&mut self.objects).push(Arc::new(o));
                true
            }
        }
    }

    fn delete(&mut self, key: &Key) -> bool {
        if !self.index.contains_key(key) {
            return false;
        }
        self.log_change(key);
        let Some(i) = self.index.remove(key) else {
            return false;
        };
        let objects = Arc::make_mut(&mut self.objects);
        objects.swap_remove(i);
        if let Some(moved) = objects.get(i) {
            self.index.insert(key_of(&**moved), i);
        }
        true
    }

    /// The end of a (re)list: `listed` becomes the content. Objects still listed keep their place
    /// (and their `Arc` when equal), new ones follow in list order; a key listed twice keeps its
    /// last value.
    fn replace_all(&mut self, listed: Vec<T>) {
        let mut by_key: HashMap<Key, T> =
            HashMap::with_capacity_and_hasher(listed.len(), Default::default());
        let mut order: Vec<Key> = Vec::with_capacity(listed.len());
        for o in listed {
            let key = key_of(&o);
            if by_key.insert(key.clone(), o).is_none() {
                order.push(key);
            }
        }
        let mut objects: Vec<Arc<T>> = Vec::with_capacity(by_key.len());
        for old in self.objects.iter() {
            if let Some(new) = by_key.remove(&key_of(&**old)) {
                objects.push(if **old == new {
                    old.clone()
                } else {
                    Arc::new(new)
                });
            }
        }
        for key in order {
            if let Some(new) = by_key.remove(&key) {
                objects.push(Arc::new(new));
            }
        }
        self.index = objects
            .iter()
            .enumerate()
            .map(|(i, o)| (key_of(&**o), i))
            .collect();
        self.objects = Arc::new(objects);
        // Not logged per key: the reader compares the lists.
        self.log = None;
    }
}

/// An [`Ordered`] shared between its reflector task (the writer) and the agent (the reader), with
/// "the first list is done".
#[derive(Debug)]
pub struct SharedOrdered<T> {
    inner: Mutex<Ordered<T>>,
    ready: watch::Sender<bool>,
}

impl<T: Lookup + Keyed + PartialEq + Clone> Default for SharedOrdered<T> {
    fn default() -> Self {
        Self {
            inner: Mutex::new(Ordered::default()),
            ready: watch::Sender::new(false),
        }
    }
}

impl<T: Lookup + Keyed + PartialEq + Clone> SharedOrdered<T> {
    fn lock(&self) -> MutexGuard<'_, Ordered<T>> {
        // A panic while applying an event leaves at worst a stale list; keep serving it.
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub fn apply(&self, event: watcher::Event<T>) -> bool {
        let done = matches!(event, watcher::Event::InitDone);
        let changed = self.lock().apply(event);
        if done {
            self.ready.send_replace(true);
        }
        changed
    }

    pub fn state(&self) -> Arc<Vec<Arc<T>>> {
        self.lock().state()
    }

    /// See [`Ordered::state_and_changes`] (one reader: the agent's sync).
    pub fn state_and_changes(&self) -> (Objects<T>, Option<Vec<Changed<T>>>) {
        self.lock().state_and_changes()
    }

    pub fn len(&self) -> usize {
        self.lock().len()
    }

    pub fn is_empty(&self) -> bool {
        self.lock().is_empty()
    }

    /// Resolves once the first list is done.
    pub async fn wait_until_ready(&self) {
        let mut rx = self.ready.subscribe();
        let _ = rx.wait_for(|ready| *ready).await;
    }
}

#[cfg(test)]
mod tests {
    use k8s_openapi::api::core::v1::Service;
    use kube::runtime::reflector;
    use serde_json::json;

    use super::*;

    struct Rng(u64);

    impl Rng {
        fn below(&mut self, n: u64) -> u64 {
            self.0 ^= self.0 << 13;
            self.0 ^= self.0 >> 7;
            self.0 ^= self.0 << 17;
            self.0 % n
        }
    }

    fn service(ns: u64, name: u64, version: u64) -> ServiceData {
        let svc: Service = serde_json::from_value(json!({
            "metadata": {
                "namespace": format!("ns-{ns}"),
                "name": format!("svc-{name}"),
                "resourceVersion": version.to_string(),
            },
            "spec": {"clusterIP": format!("10.96.{ns}.{name}")},
        }))
        .expect("Service");
        ServiceData::from(&svc)
    }

    /// The content by key, sorted (the kube-rs store has no order).
    fn content(objects: &[Arc<ServiceData>]) -> Vec<(Key, ServiceData)> {
        let mut v: Vec<(Key, ServiceData)> = objects
            .iter()
            .map(|o| (key_of(&**o), (**o).clone()))
            .collect();
        v.sort_by(|a, b| a.0.cmp(&b.0));
        v
    }

    fn check_index(store: &Ordered<ServiceData>) {
        assert_eq!(store.index.len(), store.objects.len(), "one key per object");
        for (i, o) in store.objects.iter().enumerate() {
            assert_eq!(store.index.get(&key_of(&**o)), Some(&i), "index of {i}");
        }
    }

    /// Over random applies, updates, deletes and relists (some with duplicates), the ordered store
    /// holds what the kube-rs store holds after the same events; an update keeps every place, a
    /// delete moves at most one object, a relist keeps the unchanged `Arc`s, and nothing of a relist
    /// shows before its end.
    #[test]
    fn equals_the_kube_store_over_random_events() {
        for seed in 1..=40u64 {
            let mut rng = Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1);
            let (reader, mut writer) = reflector::store::<ServiceData>();
            let mut ordered = Ordered::<ServiceData>::default();
            let mut version = 0u64;
            let mut apply = |ordered: &mut Ordered<ServiceData>, e: watcher::Event<ServiceData>| {
                writer.apply_watcher_event(&e);
                ordered.apply(e)
            };
            for step in 0..300 {
                version += 1;
                let before = ordered.state();
                let (ns, name) = (rng.below(3), rng.below(20));
                match rng.below(10) {
                    0..=4 => {
                        // Apply: new, changed, or the same value again.
                        let v = if rng.below(4) == 0 { 0 } else { version };
                        let existed = ordered.index.contains_key(&key_of(&service(ns, name, 0)));
                        let changed =
                            apply(&mut ordered, watcher::Event::Apply(service(ns, name, v)));
                        let after = ordered.state();
                        if existed {
                            assert_eq!(after.len(), before.len());
                            let differ = (0..after.len())
                                .filter(|&i| !Arc::ptr_eq(&after[i], &before[i]))
                                .count();
                            assert_eq!(differ, usize::from(changed), "seed {seed} step {step}");
                        } else {
                            assert!(changed);
                            assert_eq!(after.len(), before.len() + 1);
                            assert!((0..before.len()).all(|i| Arc::ptr_eq(&after[i], &before[i])));
                        }
                    }
                    5..=7 => {
                        apply(&mut ordered, watcher::Event::Delete(service(ns, name, 0)));
                        let after = ordered.state();
                        let differ = (0..after.len())
                            .filter(|&i| !Arc::ptr_eq(&after[i], &before[i]))
                            .count();
                        assert!(
                            differ <= 1,
                            "seed {seed} step {step}: {differ} places moved"
                        );
                    }
                    _ => {
                        // A relist: some of the objects again (some changed), some new ones.
                        assert!(!apply(&mut ordered, watcher::Event::Init));
                        let mut listed = Vec::new();
                        for o in before.iter() {
                            match rng.below(4) {
                                0 => {}
                                1 => listed.push(service_like(o, version)),
                                _ => listed.push((**o).clone()),
                            }
                        }
                        for _ in 0..rng.below(5) {
                            listed.push(service(rng.below(3), rng.below(20), version));
                        }
                        for o in listed {
                            assert!(!apply(&mut ordered, watcher::Event::InitApply(o)));
                            assert!(
                                Arc::ptr_eq(&ordered.state(), &before),
                                "no half-listed state"
                            );
                        }
                        assert!(apply(&mut ordered, watcher::Event::InitDone));
                        let after = ordered.state();
                        for o in before.iter() {
                            if let Some(n) = after.iter().find(|n| key_of(&***n) == key_of(&**o))
                                && **n == **o
                            {
                                assert!(Arc::ptr_eq(n, o), "an unchanged object keeps its Arc");
                            }
                        }
                    }
                }
                check_index(&ordered);
                assert_eq!(
                    content(&ordered.state()),
                    content(&reader.state()),
                    "seed {seed} step {step}"
                );
            }
        }
    }

    /// `o` with a new resourceVersion.
    fn service_like(o: &ServiceData, version: u64) -> ServiceData {
        let ns: u64 = o.namespace.as_deref().unwrap_or_default()[3..]
            .parse()
            .expect("ns");
        let name: u64 = o.name.as_deref().unwrap_or_default()[4..]
            .parse()
            .expect("name");
        service(ns, name, version)
    }

    /// A Service `svc-{i}` in namespace `ns-{i % 2}` (a ClusterIP shared by some, so that
    /// frontends collide) with port 80 or 81.
    fn api_service(rng: &mut Rng, i: u64) -> ServiceData {
        let svc: Service = serde_json::from_value(json!({
            "metadata": {"namespace": format!("ns-{}", i % 2), "name": format!("svc-{i}"),
                         "creationTimestamp": format!("2026-01-01T00:00:{:02}Z", rng.below(60))},
            "spec": {"clusterIP": format!("10.96.0.{}", rng.below(8) + 1),
                     "ports": [{"name": "http", "port": 80 + rng.below(2), "protocol": "TCP"}]},
        }))
        .expect("Service");
        ServiceData::from(&svc)
    }

    /// Slice `part` of a Service (sometimes labelled for another Service: a slice may move).
    fn api_slice(rng: &mut Rng, i: u64, part: u64) -> SliceData {
        let owner = if rng.below(8) == 0 { rng.below(12) } else { i };
        let endpoints: Vec<serde_json::Value> = (0..rng.below(4))
            .map(|_| {
                json!({"addresses": [format!("10.244.0.{}", rng.below(8) + 1)], "nodeName": "node-a",
                       "conditions": {"ready": rng.below(3) != 0}})
            })
            .collect();
        let slice: k8s_openapi::api::discovery::v1::EndpointSlice = serde_json::from_value(json!({
            "metadata": {"namespace": format!("ns-{}", i % 2), "name": format!("svc-{i}-{part}"),
                         "labels": {"kubernetes.io/service-name": format!("svc-{owner}")}},
            "addressType": "IPv4",
            "ports": [{"name": "http", "port": 8080, "protocol": "TCP"}],
            "endpoints": endpoints,
        }))
        .expect("EndpointSlice");
        SliceData::from(&slice)
    }

    /// The translation cache told what the stores logged gives what comparing the snapshots gives:
    /// the same frontend changes, change list and desired state after every batch of random
    /// events (applies, changes, deletes, slices moving between Services, relists, and batches
    /// large enough to overflow the log), and the same after full updates in between.
    #[test]
    fn logged_changes_translate_like_comparing_the_snapshots() {
        use crate::{
            pipeline::{
                translate::NodeContext,
                translate_cache::{Hint, TranslateCache},
            },
            sources::snapshot::{Changes, Snapshot},
        };
        let node = NodeContext {
            node_name: "node-a".into(),
            zone: None,
            scheduler: Default::default(),
        };
        let sorted = |c: &crate::pipeline::translate_cache::ChangeList| {
            let mut c = c.clone();
            c.services.sort();
            c.slices.sort();
            c
        };
        for seed in 1..=12u64 {
            let mut rng = Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1);
            let mut services = Ordered::<ServiceData>::default();
            let mut slices = Ordered::<SliceData>::default();
            services.apply(watcher::Event::Init);
            services.apply(watcher::Event::InitDone);
            slices.apply(watcher::Event::Init);
            slices.apply(watcher::Event::InitDone);
            let (mut logged, mut compared) = (TranslateCache::new(), TranslateCache::new());
            for step in 0..150 {
                let batch = match rng.below(20) {
                    0 => 1_200, // past the log's bound
                    n => n % 4,
                };
                for _ in 0..batch {
                    let i = rng.below(12);
                    match rng.below(10) {
                        0..=2 => {
                            services.apply(watcher::Event::Apply(api_service(&mut rng, i)));
                        }
                        3 => {
                            services.apply(watcher::Event::Delete(api_service(&mut rng, i)));
                        }
                        4..=7 => {
                            let part = rng.below(2);
                            slices.apply(watcher::Event::Apply(api_slice(&mut rng, i, part)));
                        }
                        8 => {
                            let part = rng.below(2);
                            slices.apply(watcher::Event::Delete(api_slice(&mut rng, i, part)));
                        }
                        _ => {
                            // A relist of the slices: most of them again, some changed.
                            slices.apply(watcher::Event::Init);
                            for o in slices.state().iter() {
                                if rng.below(5) != 0 {
                                    slices.apply(watcher::Event::InitApply((**o).clone()));
                                }
                            }
                            let part = rng.below(2);
                            let owner = rng.below(12);
                            let new = api_slice(&mut rng, owner, part);
                            slices.apply(watcher::Event::InitApply(new));
                            slices.apply(watcher::Event::InitDone);
                        }
                    }
                }
                let (svc_state, svc_log) = services.state_and_changes();
                let (slice_state, slice_log) = slices.state_and_changes();
                let snapshot = Snapshot {
                    services: svc_state,
                    endpoint_slices: slice_state,
                };
                let full = rng.below(25) == 0;
                logged.hint(Hint {
                    changes: Changes {
                        services: svc_log,
                        endpoint_slices: slice_log,
                    },
                    refresh: Vec::new(),
                });
                let a = logged.update(&snapshot, &node, &[], full);
                let b = compared.update(&snapshot, &node, &[], full);
                assert_eq!(a, b, "seed {seed} step {step}: frontend changes");
                assert_eq!(
                    sorted(logged.last_changes()),
                    sorted(compared.last_changes()),
                    "seed {seed} step {step}: change list"
                );
                assert_eq!(
                    logged.desired(),
                    compared.desired(),
                    "seed {seed} step {step}"
                );
            }
        }
    }

    #[tokio::test]
    async fn ready_after_the_first_list() {
        let store = Arc::new(SharedOrdered::<ServiceData>::default());
        store.apply(watcher::Event::Init);
        store.apply(watcher::Event::InitApply(service(0, 1, 1)));
        assert!(store.is_empty(), "not visible before the list's end");
        let waiter = tokio::spawn({
            let store = store.clone();
            async move { store.wait_until_ready().await }
        });
        tokio::task::yield_now().await;
        assert!(!waiter.is_finished());
        store.apply(watcher::Event::InitDone);
        tokio::time::timeout(std::time::Duration::from_secs(5), waiter)
            .await
            .expect("ready")
            .expect("task");
        assert_eq!(store.len(), 1);
    }
}
