//! Object names as the sources keep them: shared strings, so the translation cache, its change
//! lists and the metrics hold a pointer to the object's own name instead of a copy (a name was
//! copied into about six maps per Service), and one string per namespace for all its objects.
//!
//! Pure apart from the process-wide namespace table. Calls nothing else in the crate.

use std::sync::{Arc, Mutex};

use crate::pipeline::fast_hash::HashSet;

/// A namespace or object name (`Arc<str>`: cloned by reference count).
pub type Name = Arc<str>;

/// The namespaces in use, each once, and the table size at which it is next pruned.
static NAMESPACES: Mutex<Option<(HashSet<Name>, usize)>> = Mutex::new(None);

/// The shared copy of namespace `ns` (a cluster has a few namespaces and thousands of objects in
/// each). Namespaces no object holds any more are dropped once the table has doubled since the
/// last pruning, so a cluster creating and deleting namespaces does not grow it without bound.
pub fn namespace(ns: &str) -> Name {
    let mut table = NAMESPACES.lock().unwrap_or_else(|e| e.into_inner());
    let (set, prune_at) = table.get_or_insert_with(|| (HashSet::default(), 64));
    if let Some(name) = set.get(ns) {
        return name.clone();
    }
    if set.len() >= *prune_at {
        set.retain(|n| Arc::strong_count(n) > 1);
        *prune_at = (set.len() * 2).max(64);
    }
    let name = Name::from(ns);
    set.insert(name.clone());
    name
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_namespace_is_shared_and_unused_ones_are_dropped() {
        let a = namespace("names-test-a");
        assert!(Arc::ptr_eq(&a, &namespace("names-test-a")));
        // Many namespaces nobody holds: the table is pruned as it grows, `a` stays.
        for i in 0..1_000 {
            drop(namespace(&format!("names-test-gone-{i}")));
        }
        let len = NAMESPACES
            .lock()
            .expect("table")
            .as_ref()
            .map_or(0, |(set, _)| set.len());
        assert!(len < 500, "{len} namespaces kept");
        assert!(Arc::ptr_eq(&a, &namespace("names-test-a")));
    }
}
