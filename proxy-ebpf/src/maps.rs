//! Map definitions, the load-time config global and the clock: the only module that calls the
//! `unsafe` map getters or dereferences map values.
//!
//! The statics' identifiers are the map names (aya takes them from the symbol), so they must equal
//! the `MAP_*` consts in proxy-common; the const asserts at the bottom keep them in step.

use aya_ebpf::{
    bindings::{BPF_ANY, BPF_NOEXIST},
    btf_maps::{Array, HashMap, LpmTrie, LruHashMap, PerCpuArray, lpm_trie::Key},
    helpers::bpf_ktime_get_ns,
    macros::btf_map,
};
use proxy_common::{
    BACKENDS_CAPACITY, Backend, CONNTRACK_CAPACITY, COUNTER_COUNT, ClusterCidrs, CtKey, CtValue,
    DatapathConfig, MAP_BACKENDS, MAP_CONNTRACK, MAP_NODE, MAP_REVNAT, MAP_SERVICE_CIDRS,
    MAP_SERVICES, MAP_SNAT, MAP_SOCK_REVNAT, MAP_SOURCE_RANGES, MAP_STATS, MAX_CLUSTER_CIDRS,
    NodeInfo, REVNAT_CAPACITY, RevNat, SCOPE_INTERNAL, SERVICE_CIDRS_CAPACITY, SERVICES_CAPACITY,
    SNAT_CAPACITY, SOCK_REVNAT_CAPACITY, SOURCE_RANGE_FRONTEND_BITS, SOURCE_RANGES_CAPACITY,
    ServiceKey, ServiceValue, SnatKey, SnatValue, SockLbConfig, SockRevKey, SockRevValue,
    SourceRangeKey, service_flags,
};

#[btf_map]
static SERVICES_V1: HashMap<ServiceKey, ServiceValue, { SERVICES_CAPACITY as usize }> =
    HashMap::new();

#[btf_map]
static BACKENDS_V1: HashMap<u32, Backend, { BACKENDS_CAPACITY as usize }> = HashMap::new();

/// Written by the agent; the datapath reverse-NATs from the frontend snapshot in the conntrack
/// entry, so this map is read only by later stages (ICMP error reverse NAT).
#[btf_map]
static REVNAT_V1: HashMap<u32, RevNat, { REVNAT_CAPACITY as usize }> = HashMap::new();

#[btf_map]
static CONNTRACK_V1: LruHashMap<CtKey, CtValue, { CONNTRACK_CAPACITY as usize }> =
    LruHashMap::new();

#[btf_map]
static SNAT_V1: LruHashMap<SnatKey, SnatValue, { SNAT_CAPACITY as usize }> = LruHashMap::new();

#[btf_map]
static NODE_V1: Array<NodeInfo, 1> = Array::new();

#[btf_map]
static SRCRANGES_V1: LpmTrie<SourceRangeKey, u32, { SOURCE_RANGES_CAPACITY as usize }> =
    LpmTrie::new();

#[btf_map]
static SVCCIDRS_V1: LpmTrie<[u8; 4], u32, { SERVICE_CIDRS_CAPACITY as usize }> = LpmTrie::new();

#[btf_map]
static SOCKREV_V1: LruHashMap<SockRevKey, SockRevValue, { SOCK_REVNAT_CAPACITY as usize }> =
    LruHashMap::new();

#[btf_map]
static STATS_V1: PerCpuArray<u64, { COUNTER_COUNT as usize }> = PerCpuArray::new();

/// Load-time configuration (`.rodata`), set by the agent with `EbpfLoader::set_global`.
#[unsafe(no_mangle)]
static CONFIG: DatapathConfig = DatapathConfig::DEFAULT;

/// The load-time configuration.
#[inline(always)]
pub fn config() -> DatapathConfig {
    // SAFETY: CONFIG is a plain, initialised, immutable static; the volatile read only stops the
    // compiler from folding the default, because the loader rewrites `.rodata` before loading.
    unsafe { core::ptr::read_volatile(&CONFIG) }
}

/// Load-time facts of the socket hooks (`.rodata`), set by the agent like `CONFIG`.
#[unsafe(no_mangle)]
static SOCK_LB: SockLbConfig = SockLbConfig { netns_cookie: 0 };

/// The socket hooks' load-time facts.
#[inline(always)]
pub fn sock_lb_config() -> SockLbConfig {
    // SAFETY: as in `config`.
    unsafe { core::ptr::read_volatile(&SOCK_LB) }
}

/// Is `addr` (a client) inside the cluster, i.e. in one of the configured cluster CIDRs?
#[inline(always)]
pub fn in_cluster(addr: [u8; 4]) -> bool {
    in_prefixes(&CONFIG.cluster_cidrs, addr)
}

/// Is `addr` in one of a load-time prefix list's prefixes? Read one field at a time, so the list
/// is never copied to the (512-byte) stack, wherever it is inlined.
#[inline(always)]
fn in_prefixes(list: &'static ClusterCidrs, addr: [u8; 4]) -> bool {
    // SAFETY: as in `config`: a field of the initialised, immutable CONFIG static.
    let count = unsafe { core::ptr::read_volatile(&list.count) } as usize;
    let mut i = 0;
    while i < MAX_CLUSTER_CIDRS && i < count {
        if let Some(prefix) = list.prefixes.get(i) {
            // SAFETY: as above.
            if unsafe { core::ptr::read_volatile(prefix) }.contains(addr) {
                return true;
            }
        }
        i += 1;
    }
    false
}

/// The frontend entry (slot-0 key and value) a new flow to `key` (slot 0, `SCOPE_EXTERNAL`) uses.
/// For an externalTrafficPolicy Local frontend and a client inside the cluster (`in_cluster`,
/// asked only then) that is its `SCOPE_INTERNAL` entry with the Service's cluster-wide endpoints
/// (kube-proxy's short-circuit), when the agent wrote one; otherwise the entry at `key`.
#[inline(always)]
pub fn frontend_for(
    key: &ServiceKey,
    in_cluster: impl FnOnce() -> bool,
) -> Option<(ServiceKey, ServiceValue)> {
    let frontend = service(key)?;
    if frontend.flags & service_flags::EXTERNAL_LOCAL != 0 && in_cluster() {
        let internal = ServiceKey {
            scope: SCOPE_INTERNAL,
            ..*key
        };
        if let Some(value) = service(&internal) {
            return Some((internal, value));
        }
    }
    Some((*key, frontend))
}

/// CLOCK_MONOTONIC in nanoseconds (the clock of `CtValue::last_seen_ns`).
#[inline(always)]
pub fn now_ns() -> u64 {
    // SAFETY: bpf_ktime_get_ns takes no arguments and has no side effects.
    unsafe { bpf_ktime_get_ns() }
}

/// A copy of a `SERVICES` entry (frontend for slot 0, backend slot otherwise).
#[inline(always)]
pub fn service(key: &ServiceKey) -> Option<ServiceValue> {
    let ptr = SERVICES_V1.get_ptr(key)?;
    // SAFETY: a non-null pointer from a hash lookup points at a live value of the right type; it is
    // copied out at once, before any insert/remove on this map could recycle the slot.
    Some(unsafe { *ptr })
}

/// A copy of `BACKENDS[id]`.
#[inline(always)]
pub fn backend(id: u32) -> Option<Backend> {
    let ptr = BACKENDS_V1.get_ptr(id)?;
    // SAFETY: as in `service`: valid pointer, copied out immediately.
    Some(unsafe { *ptr })
}

/// A value refreshed in place by every packet of its flow: a last-seen time and a state.
pub trait Stamped: Copy {
    /// Where the two fields of the value at `ptr` are.
    ///
    /// # Safety
    /// `ptr` must point at a live value (from a map lookup in this program run).
    unsafe fn stamp_fields(ptr: *mut Self) -> (*mut u64, *mut u8);
}

impl Stamped for CtValue {
    unsafe fn stamp_fields(ptr: *mut Self) -> (*mut u64, *mut u8) {
        // SAFETY: the caller guarantees `ptr` is live; only field addresses are taken.
        unsafe { (&raw mut (*ptr).last_seen_ns, &raw mut (*ptr).state) }
    }
}

impl Stamped for SnatValue {
    unsafe fn stamp_fields(ptr: *mut Self) -> (*mut u64, *mut u8) {
        // SAFETY: as for `CtValue`.
        unsafe { (&raw mut (*ptr).last_seen_ns, &raw mut (*ptr).state) }
    }
}

/// A conntrack or SNAT entry found by a lookup, to read and to refresh in place.
pub struct FlowEntry<V> {
    ptr: *mut V,
}

pub type CtEntry = FlowEntry<CtValue>;
pub type SnatEntry = FlowEntry<SnatValue>;

impl<V: Stamped> FlowEntry<V> {
    /// A copy of the entry.
    #[inline(always)]
    pub fn get(&self) -> V {
        // SAFETY: `ptr` came from a successful lookup in this program run and nothing has been
        // inserted into or removed from its map since (callers drop the handle before writing).
        // Other CPUs may update last_seen/state concurrently; a torn read of those is harmless.
        unsafe { *self.ptr }
    }

    /// Record a packet: last-seen time and state.
    #[inline(always)]
    pub fn touch(&self, now_ns: u64, state: u8) {
        // SAFETY: as in `get`. Single-field stores; concurrent writers store the same kind of
        // value (a recent timestamp, a state), so a lost update costs nothing.
        unsafe {
            let (last_seen, current) = V::stamp_fields(self.ptr);
            *last_seen = now_ns;
            if *current != state {
                *current = state;
            }
        }
    }
}

/// Look up a conntrack entry.
#[inline(always)]
pub fn ct_entry(key: &CtKey) -> Option<CtEntry> {
    CONNTRACK_V1.get_ptr_mut(key).map(|ptr| FlowEntry { ptr })
}

/// Insert or overwrite a conntrack entry.
#[inline(always)]
pub fn ct_insert(key: &CtKey, value: &CtValue) -> Result<(), i32> {
    CONNTRACK_V1.insert(key, value, BPF_ANY as u64)
}

/// Remove a conntrack entry (absent is fine).
#[inline(always)]
pub fn ct_remove(key: &CtKey) {
    let _ = CONNTRACK_V1.remove(key);
}

/// A copy of the node facts (`NODE_V1[0]`).
#[inline(always)]
pub fn node() -> Option<NodeInfo> {
    let ptr = NODE_V1.get_ptr(0)?;
    // SAFETY: array slots are preallocated; the pointer is valid and the value copied at once.
    Some(unsafe { *ptr })
}

/// What `addr` is in the Service address space (`service_cidr::*`), if anything.
#[inline(always)]
pub fn service_cidr(addr: [u8; 4]) -> Option<u32> {
    let key = Key {
        prefix_len: 32,
        data: addr,
    };
    SVCCIDRS_V1.get(&key).copied()
}

/// Is the source of `key` inside one of its frontend's loadBalancerSourceRanges?
#[inline(always)]
pub fn source_in_range(key: SourceRangeKey) -> bool {
    let key = Key {
        prefix_len: SOURCE_RANGE_FRONTEND_BITS + 32,
        data: key,
    };
    SRCRANGES_V1.get(&key).is_some()
}

/// Look up a SNAT entry.
#[inline(always)]
pub fn snat_entry(key: &SnatKey) -> Option<SnatEntry> {
    SNAT_V1.get_ptr_mut(key).map(|ptr| FlowEntry { ptr })
}

/// Insert a SNAT entry only if the key is free (the atomic claim of a port).
#[inline(always)]
pub fn snat_claim(key: &SnatKey, value: &SnatValue) -> Result<(), i32> {
    SNAT_V1.insert(key, value, BPF_NOEXIST as u64)
}

/// Insert or overwrite a SNAT entry.
#[inline(always)]
pub fn snat_insert(key: &SnatKey, value: &SnatValue) -> Result<(), i32> {
    SNAT_V1.insert(key, value, BPF_ANY as u64)
}

/// Remove a SNAT entry (absent is fine).
#[inline(always)]
pub fn snat_remove(key: &SnatKey) {
    let _ = SNAT_V1.remove(key);
}

/// Remember which frontend a translated socket asked for (overwrites: the newest wins).
#[inline(always)]
pub fn sock_rev_insert(key: &SockRevKey, value: &SockRevValue) -> Result<(), i32> {
    SOCKREV_V1.insert(key, value, BPF_ANY as u64)
}

/// The frontend a translated socket asked for, if it is one.
#[inline(always)]
pub fn sock_rev(key: &SockRevKey) -> Option<SockRevValue> {
    let ptr = SOCKREV_V1.get_ptr(key)?;
    // SAFETY: as in `service`: valid pointer, copied out immediately.
    Some(unsafe { *ptr })
}

/// Add `n` to this CPU's counter `index` (out-of-range indices are ignored).
#[inline(always)]
pub fn stats_add(index: u32, n: u64) {
    if let Some(ptr) = STATS_V1.get_ptr_mut(index) {
        // SAFETY: per-CPU array slots are preallocated and owned by this CPU while the program
        // runs (no preemption inside a BPF program), so the plain read-modify-write cannot race.
        unsafe { *ptr = (*ptr).wrapping_add(n) }
    }
}

const fn same(a: &str, b: &str) -> bool {
    let (a, b) = (a.as_bytes(), b.as_bytes());
    if a.len() != b.len() {
        return false;
    }
    let mut i = 0;
    while i < a.len() {
        if a[i] != b[i] {
            return false;
        }
        i += 1;
    }
    true
}

// The statics above are named by hand; a renamed const in proxy-common must fail the build here.
const _: () = assert!(same(MAP_SERVICES, "SERVICES_V1"));
const _: () = assert!(same(MAP_BACKENDS, "BACKENDS_V1"));
const _: () = assert!(same(MAP_REVNAT, "REVNAT_V1"));
const _: () = assert!(same(MAP_CONNTRACK, "CONNTRACK_V1"));
const _: () = assert!(same(MAP_STATS, "STATS_V1"));
const _: () = assert!(same(MAP_SNAT, "SNAT_V1"));
const _: () = assert!(same(MAP_NODE, "NODE_V1"));
const _: () = assert!(same(MAP_SOURCE_RANGES, "SRCRANGES_V1"));
const _: () = assert!(same(MAP_SOCK_REVNAT, "SOCKREV_V1"));
const _: () = assert!(same(MAP_SERVICE_CIDRS, "SVCCIDRS_V1"));
