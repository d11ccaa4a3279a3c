//! The hash maps of the control plane's hot paths (translation cache, planner, shadow, ids) with
//! foldhash instead of std's SipHash: the same std `HashMap`/`HashSet`, a faster hasher that is
//! still seeded per process (keys come from API objects). Build them with `default()` or
//! `with_capacity_and_hasher(n, Default::default())`.

pub type HashMap<K, V> = std::collections::HashMap<K, V, foldhash::fast::RandomState>;
pub type HashSet<T> = std::collections::HashSet<T, foldhash::fast::RandomState>;
