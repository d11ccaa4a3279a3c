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
//! Owns nothing but the list, its index by (namespace, name) and the change log. May call:
//! kube-runtime's event and `Lookup` types.

use std::sync::{Arc, Mutex, MutexGuard};

use kube::runtime::{reflector::Lookup, watcher};
use tokio::sync::watch;

use crate::{pipeline::fast_hash::HashMap, sources::snapshot::Changed};

/// An object's identity in a store: (namespace, name), as the kube-rs store keys objects of one
/// kind.
type Key = (Box<str>, Box<str>);

fn key_of<T: Lookup>(o: &T) -> Key {
    (
        o.namespace().as_deref().unwrap_or_default().into(),
        o.name().as_deref().unwrap_or_default().into(),
    )
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

impl<T: Lookup + PartialEq + Clone> Ordered<T> {
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
    pub fn state_and_changes(&mut self) -> (Arc<Vec<Arc<T>>>, Option<Vec<Changed<T>>>) {
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

impl<T: Lookup + PartialEq + Clone> Default for SharedOrdered<T> {
    fn default() -> Self {
        Self {
            inner: Mutex::new(Ordered::default()),
            ready: watch::Sender::new(false),
        }
    }
}

impl<T: Lookup + PartialEq + Clone> SharedOrdered<T> {
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
    pub fn state_and_changes(&self) -> (Arc<Vec<Arc<T>>>, Option<Vec<Changed<T>>>) {
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
    use crate::sources::services::ServiceData;

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
