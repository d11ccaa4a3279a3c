//! Map definitions, the load-time config global and the clock: the only module that calls the
//! `unsafe` map getters or dereferences map values.
//!
//! The statics' identifiers are the map names (aya takes them from the symbol), so they must equal
//! the `MAP_*` consts in proxy-common; the const asserts at the bottom keep them in step.

use aya_ebpf::{
    bindings::{BPF_ANY, BPF_NOEXIST},
    btf_maps::{
        Array, HashMap, LpmTrie, LruHashMap, PerCpuArray, PerCpuHashMap, ProgramArray,
        lpm_trie::Key,
    },
    helpers::bpf_ktime_get_ns,
    macros::btf_map,
    programs::TcContext,
};
use proxy_common::{
    AFFINITY_CAPACITY, AFFINITY_MATCH_CAPACITY, AffinityKey, AffinityMatchKey, AffinityValue,
    BACKENDS_CAPACITY, Backend, CONNTRACK_CAPACITY, COUNTER_COUNT, ClusterCidrs, CtKey, CtValue,
    DatapathConfig, FRAGMENTS_CAPACITY, FragKey, FragRecord, FragValue, LC_CAPACITY,
    MAGLEV_CAPACITY, MAP_AFFINITY, MAP_AFFINITY_MATCH, MAP_BACKENDS, MAP_CONNTRACK,
    MAP_FRAG_SCRATCH, MAP_FRAGMENTS, MAP_LC_ADJUST, MAP_LC_FLOWS, MAP_MAGLEV, MAP_NODE,
    MAP_REJECT_LIMIT, MAP_REVNAT, MAP_SEED, MAP_SERVICE_CIDRS, MAP_SERVICES, MAP_SNAT,
    MAP_SNAT_DEVICES, MAP_SOCK_PICK, MAP_SOCK_REVNAT, MAP_SOURCE_RANGES, MAP_STATS, MAP_TAP,
    MAX_CLUSTER_CIDRS, NodeInfo, PendingFlow, REVNAT_CAPACITY, RejectBucket, RevNat,
    SCOPE_EXTERNAL, SCOPE_INTERNAL, SERVICE_CIDRS_CAPACITY, SERVICES_CAPACITY, SNAT_CAPACITY,
    SNAT_DEVICES_CAPACITY, SOCK_PICK_CAPACITY, SOCK_REVNAT_CAPACITY, SOURCE_RANGE_FRONTEND_BITS,
    SOURCE_RANGES_CAPACITY, ServiceKey, ServiceValue, SnatDevice, SnatKey, SnatValue, SockLbConfig,
    SockPickKey, SockPickValue, SockRevKey, SockRevValue, SourceRangeKey, TAIL_CALL_NEW_FLOW,
    TAP_CAPACITY, TapKey,
    ipv6::{
        AFFINITY_MATCH6_CAPACITY, AFFINITY6_CAPACITY, Affinity6Key, Affinity6MatchKey,
        BACKENDS6_CAPACITY, Backend6, CLUSTER_CIDRS6_CAPACITY, CONNTRACK6_CAPACITY, Ct6Key,
        Ct6Value, FRAGMENTS6_CAPACITY, Frag6Key, Frag6Value, MAP_AFFINITY_MATCH6, MAP_AFFINITY6,
        MAP_BACKENDS6, MAP_CLUSTER_CIDRS6, MAP_CONNTRACK6, MAP_FRAGMENTS6, MAP_NODE6, MAP_REVNAT6,
        MAP_SERVICE_CIDRS6, MAP_SERVICES6, MAP_SNAT6, MAP_SOCK_REVNAT6, MAP_SOURCE_RANGES6,
        Node6Info, REVNAT6_CAPACITY, RevNat6, SERVICE_CIDRS6_CAPACITY, SERVICES6_CAPACITY,
        SNAT6_CAPACITY, SOCK_REVNAT6_CAPACITY, SOURCE_RANGE6_FRONTEND_BITS,
        SOURCE_RANGES6_CAPACITY, Service6Key, Snat6Key, Snat6Value, SockRev6Key, SourceRange6Key,
    },
    maglev::{self, Chunk, MaglevKey},
    presence::AgentPresence,
    service_flags,
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
static SNATDEV_V1: HashMap<u32, SnatDevice, { SNAT_DEVICES_CAPACITY as usize }> = HashMap::new();

#[btf_map]
static SRCRANGES_V1: LpmTrie<SourceRangeKey, u32, { SOURCE_RANGES_CAPACITY as usize }> =
    LpmTrie::new();

#[btf_map]
static SVCCIDRS_V1: LpmTrie<[u8; 4], u32, { SERVICE_CIDRS_CAPACITY as usize }> = LpmTrie::new();

#[btf_map]
static SOCKREV_V1: LruHashMap<SockRevKey, SockRevValue, { SOCK_REVNAT_CAPACITY as usize }> =
    LruHashMap::new();

/// Session affinity records (written by the datapath, read by `dump affinity`).
#[btf_map]
static AFFINITY_V1: LruHashMap<AffinityKey, AffinityValue, { AFFINITY_CAPACITY as usize }> =
    LruHashMap::new();

/// Backends each affinity frontend may send a recorded client to (written by the agent).
#[btf_map]
static AFFMATCH_V1: HashMap<AffinityMatchKey, u32, { AFFINITY_MATCH_CAPACITY as usize }> =
    HashMap::new();

/// Fragmented datagrams whose first fragment passed a hook: what its later fragments get.
#[btf_map]
static FRAGMENTS_V1: LruHashMap<FragKey, FragValue, { FRAGMENTS_CAPACITY as usize }> =
    LruHashMap::new();

/// Where a `FRAGMENTS_V1` entry is built before it is written (see `FragRecord`).
#[btf_map]
static FRAGSCRATCH: PerCpuArray<FragRecord, 1> = PerCpuArray::new();

#[btf_map]
static STATS_V1: PerCpuArray<u64, { COUNTER_COUNT as usize }> = PerCpuArray::new();

/// The new-flow and direct-flow programs (`TAIL_CALL_*`), filled by the agent after loading.
#[btf_map]
static TAILCALLS_V1: ProgramArray<{ proxy_common::TAIL_CALL_COUNT as usize }> = ProgramArray::new();

/// What `tc_ingress` hands to the new-flow program (one per CPU).
#[btf_map]
static PENDING: PerCpuArray<PendingFlow, 1> = PerCpuArray::new();

/// The program array index of the tail-called part `index` (`TAIL_CALL_*`) for the program
/// entry's L2 header length: L3 devices have their own variants.
#[inline(always)]
const fn tail_index(index: u32, l2_len: usize) -> u32 {
    if l2_len == crate::packet::NO_L2 {
        proxy_common::TAIL_CALL_L3 + index
    } else {
        index
    }
}

/// The program array index of IPv6 program `index` (`TAIL_CALL_*6`) for the entry's L2 length.
#[inline(always)]
const fn tail_index6(index: u32, l2_len: usize) -> u32 {
    if l2_len == crate::packet::NO_L2 {
        proxy_common::TAIL_CALL6_L3 + index
    } else {
        index
    }
}

/// Jump to an IPv6 program (`TAIL_CALL_INGRESS6`, `_EGRESS6`, `_REJECT6`) for the entry's L2
/// header length; returns only if it is not there.
#[inline(always)]
pub fn tail_call6(ctx: &TcContext, index: u32, l2_len: usize) {
    // SAFETY: as in `tail_call_new_flow`.
    unsafe { TAILCALLS_V1.tail_call(ctx, tail_index6(index, l2_len)) }
}

/// Jump to the new-flow program; returns only if it is not there.
#[inline(always)]
pub fn tail_call_new_flow(ctx: &TcContext, pending: &PendingFlow, l2_len: usize) {
    if let Some(ptr) = PENDING.get_ptr_mut(0) {
        // SAFETY: a per-CPU array slot, owned by this CPU while the program runs.
        unsafe { *ptr = *pending };
    }
    // SAFETY: the program array holds only our own tc program at this index (the agent writes
    // it); on failure the call returns and the caller drops the packet.
    unsafe { TAILCALLS_V1.tail_call(ctx, tail_index(TAIL_CALL_NEW_FLOW, l2_len)) }
}

/// Jump to another part of ingress (`TAIL_CALL_*`, for the entry's L2 header length); returns
/// only if it is not there.
#[inline(always)]
pub fn tail_call(ctx: &TcContext, index: u32, l2_len: usize) {
    // SAFETY: as in `tail_call_new_flow`.
    unsafe { TAILCALLS_V1.tail_call(ctx, tail_index(index, l2_len)) }
}

/// What the tail-calling `tc_ingress` left for this packet, in place (no copy on the stack).
#[inline(always)]
pub fn pending_flow() -> Option<&'static PendingFlow> {
    let ptr = PENDING.get_ptr(0)?;
    // SAFETY: a per-CPU array slot: preallocated, never freed, and only this CPU's program run
    // (which cannot be preempted) writes it; the reference is used within this run.
    Some(unsafe { &*ptr })
}
/// This CPU's budget of generated answers (ICMP errors, RSTs), `proxy_common::ratelimit`.
#[btf_map]
static REJECTRL_V1: PerCpuArray<RejectBucket, 1> = PerCpuArray::new();

/// The node's flow hash seed, kept for the next agent (see `MAP_SEED`); the programs never read it.
#[btf_map]
static SEED_V1: Array<u32, 1> = Array::new();

/// The frontend generation (`MAP_FRONTEND_GEN`), written by the agent.
#[btf_map]
static FRONTGEN_V1: Array<u32, 1> = Array::new();

/// The frontend generation now (`MAP_FRONTEND_GEN`): 0 until an agent wrote one.
#[inline(always)]
pub fn frontend_generation() -> u32 {
    FRONTGEN_V1.get(0).copied().unwrap_or(0)
}

/// A conntrack value whose direct flows record the frontend generation they were checked at
/// (`ct_flags::DIRECT`: in `backend_id`, which a direct flow has no use for).
pub trait Checked: Stamped {
    /// Where the generation of the value at `ptr` is.
    ///
    /// # Safety
    /// As for `Stamped::stamp_fields`.
    unsafe fn checked_at_field(ptr: *mut Self) -> *mut u32;
}

impl Checked for CtValue {
    unsafe fn checked_at_field(ptr: *mut Self) -> *mut u32 {
        // SAFETY: as in `stamp_fields`.
        unsafe { &raw mut (*ptr).backend_id }
    }
}

impl Checked for Ct6Value {
    unsafe fn checked_at_field(ptr: *mut Self) -> *mut u32 {
        // SAFETY: as in `stamp_fields`.
        unsafe { &raw mut (*ptr).backend_id }
    }
}

impl<V: Checked> FlowEntry<V> {
    /// A direct flow was checked against frontend generation `generation`.
    #[inline(always)]
    pub fn set_checked_at(&self, generation: u32) {
        // SAFETY: as in `touch`: a single-field store; concurrent writers store the same value.
        unsafe { *V::checked_at_field(self.ptr) = generation };
    }
}

/// Least connection: per-backend active-flow counts (`proxy_common::lc`), datapath-owned.
#[btf_map]
static LCFLOWS_V1: Array<u64, { LC_CAPACITY as usize }> = Array::new();

/// Least connection: the agent's corrections of `LCFLOWS_V1` (read-only here).
#[btf_map]
static LCADJ_V1: Array<u64, { LC_CAPACITY as usize }> = Array::new();

/// The test-only tap's counts (`tc_tap`); empty in the agent, which never attaches the tap.
#[btf_map]
static TAP_V1: PerCpuHashMap<TapKey, u64, { TAP_CAPACITY as usize }> = PerCpuHashMap::new();

/// Maglev lookup tables (`proxy_common::maglev`): chunks allocated only for the tables that
/// exist (`BPF_F_NO_PREALLOC`).
#[btf_map]
static MAGLEV_V1: HashMap<
    MaglevKey,
    Chunk,
    { MAGLEV_CAPACITY as usize },
    { aya_ebpf::bindings::BPF_F_NO_PREALLOC as usize },
> = HashMap::new();

/// The slot at `index` (0..M) of Maglev table `table`; `None` when the chunk is missing (the
/// entry itself may be 0: empty).
#[inline(always)]
pub fn maglev_slot(table: u32, index: u32) -> Option<u16> {
    let (chunk, off) = maglev::split(index);
    // The compiler proves `off` < CHUNK_ENTRIES from the division and drops the bound check;
    // the verifier cannot follow that arithmetic, so hide the value and keep the check.
    // SAFETY: reading a local through a valid reference.
    let off = unsafe { core::ptr::read_volatile(&off) };
    let ptr = MAGLEV_V1.get_ptr(MaglevKey { table, chunk })?;
    // SAFETY: a pointer from a hash lookup points at a live value of the right type; one entry
    // is read at once, bounds-checked by `get`.
    unsafe { (*ptr).get(off).copied() }
}

/// The Maglev table size M of this load (only this field of the config is read).
#[inline(always)]
pub fn maglev_table_size() -> u32 {
    // SAFETY: as in `config`.
    unsafe { core::ptr::read_volatile(&CONFIG.maglev_table_size) }
}

/// Load-time configuration (`.rodata`), set by the agent with `EbpfLoader::set_global`.
#[unsafe(no_mangle)]
static CONFIG: DatapathConfig = DatapathConfig::DEFAULT;

/// The load-time configuration, by reference (no 60-byte copy on the 512-byte BPF stack).
#[inline(always)]
pub fn config_ref() -> &'static DatapathConfig {
    let ptr: *const DatapathConfig = &CONFIG;
    // SAFETY: reading a local through a valid pointer. The volatile read hides from the compiler
    // that the pointer is CONFIG's, so it cannot fold the default into the field reads (the loader
    // rewrites `.rodata` before loading); CONFIG itself is immutable and lives forever.
    unsafe { &*core::ptr::read_volatile(&ptr) }
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

/// The node's flow hash seed (only this field of the config is read).
#[inline(always)]
pub fn hash_seed() -> u32 {
    // SAFETY: as in `config`; only the seed is read.
    unsafe { core::ptr::read_volatile(&CONFIG.hash_seed) }
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
    let mut key = *key;
    let value = scoped_frontend(&mut key, |k, scope| k.scope = scope, service, in_cluster)?;
    Some((key, value))
}

/// [`frontend_for`] of either family, the key moved to the scope used in place (one key on the
/// stack): `set_scope` sets a key's scope, `lookup` reads the family's Services map.
#[inline(always)]
fn scoped_frontend<K>(
    key: &mut K,
    set_scope: impl Fn(&mut K, u8),
    lookup: impl Fn(&K) -> Option<ServiceValue>,
    in_cluster: impl FnOnce() -> bool,
) -> Option<ServiceValue> {
    let frontend = lookup(key)?;
    if frontend.flags & service_flags::EXTERNAL_LOCAL != 0 && in_cluster() {
        set_scope(key, SCOPE_INTERNAL);
        if let Some(value) = lookup(key) {
            return Some(value);
        }
        set_scope(key, SCOPE_EXTERNAL);
    }
    Some(frontend)
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

/// Take the next round-robin position of the frontend entry at `key` (slot 0): an atomic
/// fetch-and-add on its `rr_next`, so sequential new flows on any CPUs get consecutive
/// positions. `None` if the entry is gone.
#[inline(always)]
pub fn rr_next(key: &ServiceKey) -> Option<u32> {
    let ptr = SERVICES_V1.get_ptr_mut(key)?;
    // SAFETY: a live hash value (as in `service`); `rr_next` is a naturally aligned u32 that
    // only atomic operations write while the entry lives (the agent replaces the whole entry,
    // after which this update lands in the freed copy and is lost: harmless).
    Some(unsafe { fetch_add_u32(&raw mut (*ptr).rr_next, 1) })
}

/// A BPF atomic fetch-and-add on a u32 (`BPF_ATOMIC | BPF_W | BPF_FETCH`, kernel ≥ 5.12). In
/// assembly: the object is built for `--cpu generic`, where LLVM refuses to use the result of
/// an atomic add, and the BPF target has no `AtomicU32`.
///
/// # Safety
/// `ptr` must be a valid, 4-aligned pointer into map memory.
#[inline(always)]
unsafe fn fetch_add_u32(ptr: *mut u32, add: u32) -> u32 {
    let mut v = add as u64;
    // SAFETY: the caller guarantees `ptr`; the instruction reads and writes only `*ptr` and r1.
    unsafe {
        core::arch::asm!(
            "w1 = atomic_fetch_add((u32 *)(r2 + 0), w1)",
            inout("r1") v,
            in("r2") ptr,
            options(nostack),
        );
    }
    v as u32
}

/// The effective least-connection load of backend `id` (`proxy_common::lc::effective`); 0 for
/// an id outside the arrays.
#[inline(always)]
pub fn lc_load(id: u32) -> u64 {
    let Some(active) = LCFLOWS_V1.get_ptr(id) else {
        return 0;
    };
    // SAFETY: array slots are preallocated; plain aligned u64 reads (a concurrent atomic add
    // is seen before or after, never torn on a 64-bit load).
    let active = unsafe { core::ptr::read_volatile(active) };
    let adjust = match LCADJ_V1.get_ptr(id) {
        // SAFETY: as above.
        Some(adj) => unsafe { core::ptr::read_volatile(adj) },
        None => 0,
    };
    proxy_common::lc::effective(active, adjust)
}

/// Add `delta` (wrapping: `u64::MAX` is −1) to backend `id`'s active-flow count, atomically.
#[inline(always)]
pub fn lc_add(id: u32, delta: u64) {
    if let Some(ptr) = LCFLOWS_V1.get_ptr_mut(id) {
        // SAFETY: array slots are preallocated, 8-byte aligned, written only atomically (a BPF
        // atomic add: core has no RMW atomics on the BPF target).
        unsafe {
            core::intrinsics::atomic_xadd::<u64, u64, { core::intrinsics::AtomicOrdering::Relaxed }>(
                ptr, delta,
            )
        };
    }
}

/// A BPF atomic fetch-and-and on a u64 (`BPF_ATOMIC | BPF_DW | BPF_AND | BPF_FETCH`), in
/// assembly for the reason given at [`fetch_add_u32`].
///
/// # Safety
/// `ptr` must be a valid, 8-aligned pointer into map memory.
#[inline(always)]
unsafe fn fetch_and_u64(ptr: *mut u64, mask: u64) -> u64 {
    let mut v = mask;
    // SAFETY: as in `fetch_add_u32`.
    unsafe {
        core::arch::asm!(
            "r1 = atomic_fetch_and((u64 *)(r2 + 0), r1)",
            inout("r1") v,
            in("r2") ptr,
            options(nostack),
        );
    }
    v
}

/// A BPF compare-and-exchange on a u64 (`BPF_ATOMIC | BPF_DW | BPF_CMPXCHG`): stores `new`
/// at `ptr` if it holds `expected`; returns what it held (`expected` when the store happened).
/// In assembly for the reason given at [`fetch_add_u32`].
///
/// # Safety
/// `ptr` must be a valid, 8-aligned pointer into map memory.
#[inline(always)]
unsafe fn cmpxchg_u64(ptr: *mut u64, expected: u64, new: u64) -> u64 {
    let mut v = expected;
    // SAFETY: as in `fetch_add_u32`; the instruction reads and writes only `*ptr` and r0.
    unsafe {
        core::arch::asm!(
            "r0 = cmpxchg_64(r1 + 0, r0, r2)",
            inout("r0") v,
            in("r1") ptr,
            in("r2") new,
            options(nostack),
        );
    }
    v
}

/// A BPF atomic OR on a u64 (`BPF_ATOMIC | BPF_DW | BPF_OR`), in assembly for the reason
/// given at [`fetch_add_u32`].
///
/// # Safety
/// `ptr` must be a valid, 8-aligned pointer into map memory.
#[inline(always)]
unsafe fn atomic_or_u64(ptr: *mut u64, bits: u64) {
    // SAFETY: as in `fetch_add_u32`.
    unsafe {
        core::arch::asm!(
            "lock *(u64 *)(r2 + 0) |= r1",
            in("r1") bits,
            in("r2") ptr,
            options(nostack),
        );
    }
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

    /// Where the `flags` field (`ct_flags::*`) of the value at `ptr` is.
    ///
    /// # Safety
    /// As for `stamp_fields`.
    unsafe fn flags_field(ptr: *mut Self) -> *mut u8;

    /// Offset of the `flags` field in the value (atomic updates go through its aligned word).
    const FLAGS_OFFSET: usize;
}

impl Stamped for CtValue {
    unsafe fn stamp_fields(ptr: *mut Self) -> (*mut u64, *mut u8) {
        // SAFETY: the caller guarantees `ptr` is live; only field addresses are taken.
        unsafe { (&raw mut (*ptr).last_seen_ns, &raw mut (*ptr).state) }
    }

    unsafe fn flags_field(ptr: *mut Self) -> *mut u8 {
        // SAFETY: as in `stamp_fields`.
        unsafe { &raw mut (*ptr).flags }
    }

    const FLAGS_OFFSET: usize = core::mem::offset_of!(CtValue, flags);
}

impl Stamped for SnatValue {
    unsafe fn stamp_fields(ptr: *mut Self) -> (*mut u64, *mut u8) {
        // SAFETY: as for `CtValue`.
        unsafe { (&raw mut (*ptr).last_seen_ns, &raw mut (*ptr).state) }
    }

    unsafe fn flags_field(ptr: *mut Self) -> *mut u8 {
        // SAFETY: as for `CtValue`.
        unsafe { &raw mut (*ptr).flags }
    }

    const FLAGS_OFFSET: usize = core::mem::offset_of!(SnatValue, flags);
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

    /// The entry in place, for reading a few fields without a copy on the stack.
    #[inline(always)]
    pub fn peek(&self) -> &V {
        // SAFETY: as in `get`; the reference does not outlive the handle, which callers drop
        // before writing to the map.
        unsafe { &*self.ptr }
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

    /// Take the entry over from its idle holder: moves its last-seen time from `seen` (what the
    /// caller read when it judged the entry reclaimable) to `now_ns` in one atomic step. Exactly
    /// one of several CPUs reclaiming it at once gets `true`, and none does if the holder sent a
    /// packet meanwhile; the winner then writes the entry as its own.
    #[inline(always)]
    pub fn claim_idle(&self, seen: u64, now_ns: u64) -> bool {
        // SAFETY: as in `get`; the last-seen field is a naturally aligned u64 in map memory.
        unsafe {
            let (last_seen, _) = V::stamp_fields(self.ptr);
            cmpxchg_u64(last_seen, seen, now_ns) == seen
        }
    }

    /// Record a packet (as `touch`) and set the `flags` bits `set` (`ct_flags::*`).
    #[inline(always)]
    pub fn touch_flags(&self, now_ns: u64, state: u8, set: u8) {
        self.touch(now_ns, state);
        self.set_flags(set);
    }

    /// Set the `flags` bits `set` (`ct_flags::*`), leaving the others.
    #[inline(always)]
    pub fn set_flags(&self, set: u8) {
        // SAFETY: as in `touch`.
        if unsafe { *V::flags_field(self.ptr) } & set == set {
            return;
        }
        // An atomic OR (on the flags byte's aligned word, constant offsets as in
        // `take_counted`): a plain read-modify-write could bring back a bit another CPU just
        // cleared (`ct_flags::COUNTED`).
        let bits = (set as u64) << ((V::FLAGS_OFFSET & 7) * 8);
        // SAFETY: as in `get`; the word lies inside the value (8-aligned: the values hold u64
        // fields and map values are 8-aligned), and the OR leaves every other bit as it is.
        unsafe { atomic_or_u64(self.ptr.cast::<u8>().add(V::FLAGS_OFFSET & !7).cast(), bits) };
    }

    /// Are all the `flags` bits `bits` set?
    #[inline(always)]
    pub fn has_flags(&self, bits: u8) -> bool {
        // SAFETY: as in `get`; a one-byte read.
        unsafe { *V::flags_field(self.ptr) & bits == bits }
    }
}

impl FlowEntry<CtValue> {
    /// Clear `ct_flags::COUNTED` atomically; was it set? Exactly one caller over all CPUs gets
    /// `true` per setting of the bit (it then gives the flow's unit back, `lc_add`).
    #[inline(always)]
    pub fn take_counted(&self) -> bool {
        // BPF atomics are 32/64-bit: the flags byte is cleared through its aligned 64-bit word
        // (little-endian: byte k of the word is bits 8k..8k+8). Constant offsets: the verifier
        // allows no arithmetic on pointer bits.
        const FLAGS: usize = <CtValue as Stamped>::FLAGS_OFFSET;
        const BIT: u64 = (proxy_common::ct_flags::COUNTED as u64) << ((FLAGS & 7) * 8);
        // SAFETY: as in `get`; the word lies inside the value (8-aligned: the value holds u64
        // fields and map values are 8-aligned), and the AND leaves every other bit as it is.
        let old = unsafe { fetch_and_u64(self.ptr.cast::<u8>().add(FLAGS & !7).cast(), !BIT) };
        old & BIT != 0
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

/// Insert a conntrack entry only if its key is free (never overwrites another flow's entry).
#[inline(always)]
pub fn ct_insert_new(key: &CtKey, value: &CtValue) -> Result<(), i32> {
    CONNTRACK_V1.insert(key, value, BPF_NOEXIST as u64)
}

/// Remove a conntrack entry (absent is fine).
#[inline(always)]
pub fn ct_remove(key: &CtKey) {
    let _ = CONNTRACK_V1.remove(key);
}

/// Whether an agent runs and whether the datapath handed over (`proxy_common::presence`):
/// written by the agent and by the bind hooks.
#[btf_map]
static AGENT_V1: Array<AgentPresence, 1> = Array::new();

/// Have new flows been handed over to the node's stack (another proxy took over while no agent
/// ran)? Read only where a packet would start a translation.
#[inline(always)]
pub fn handed_over(now: u64) -> bool {
    let Some(ptr) = AGENT_V1.get_ptr(0) else {
        return false;
    };
    // SAFETY: array slots are preallocated; the pointer is valid for the map's life.
    unsafe { (*ptr).handed_over(now) }
}

/// Is an agent running on the datapath now (its heartbeat fresh)?
#[inline(always)]
pub fn agent_alive(now: u64) -> bool {
    let Some(ptr) = AGENT_V1.get_ptr(0) else {
        return false;
    };
    // SAFETY: as in `handed_over`.
    unsafe { (*ptr).agent_alive(now) }
}

/// A bind of `port` (host order) in the node's namespace: hands over when it is another proxy's
/// port while no agent runs. Returns whether this bind handed over.
#[inline(always)]
pub fn hand_over_on_bind(port: u16, now: u64) -> bool {
    let Some(ptr) = AGENT_V1.get_ptr_mut(0) else {
        return false;
    };
    // SAFETY: as in `handed_over`; one 32-byte value copied out and written back whole (two
    // binds racing both hand over, which is the same outcome).
    unsafe {
        match (*ptr).after_bind(port, now) {
            Some(next) => {
                *ptr = next;
                true
            }
            None => false,
        }
    }
}

/// A copy of the node facts (`NODE_V1[0]`).
#[inline(always)]
pub fn node() -> Option<NodeInfo> {
    let ptr = NODE_V1.get_ptr(0)?;
    // SAFETY: array slots are preallocated; the pointer is valid and the value copied at once.
    Some(unsafe { *ptr })
}

/// Is `addr` the node's SNAT address (`NODE_V1[0].snat_addr`, never 0.0.0.0)? Compared in place.
#[inline(always)]
pub fn is_node_snat_addr(addr: [u8; 4]) -> bool {
    match NODE_V1.get_ptr(0) {
        // SAFETY: array slots are preallocated; the pointer is valid.
        Some(ptr) => addr != [0; 4] && unsafe { (*ptr).snat_addr } == addr,
        None => false,
    }
}

/// The SNAT source address of flows leaving through interface `ifindex`, or
/// `snat::NO_DEVICE` if it has none of its own. A plain address, not an `Option`: LLVM may spill
/// a `None`'s undefined payload, which the verifier rejects (`!read_ok`).
#[inline(always)]
pub fn snat_device_addr(ifindex: u32) -> [u8; 4] {
    match SNATDEV_V1.get_ptr(ifindex) {
        // SAFETY: as in `service`: valid pointer, copied out immediately.
        Some(ptr) => unsafe { (*ptr).addr },
        None => crate::snat::NO_DEVICE,
    }
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

/// The backend of each unconnected UDP socket of the node's per frontend (`crate::sock`).
#[btf_map]
static SOCKPICK_V1: LruHashMap<SockPickKey, SockPickValue, { SOCK_PICK_CAPACITY as usize }> =
    LruHashMap::new();

/// The backend a socket's datagrams to a frontend went to, if recorded; writable in place (its
/// `last_seen_ns`).
#[inline(always)]
pub fn sock_pick(key: &SockPickKey) -> Option<*mut SockPickValue> {
    SOCKPICK_V1.get_ptr_mut(key)
}

/// Record the backend a socket's datagrams to a frontend go to (overwrites: the newest wins).
#[inline(always)]
pub fn sock_pick_insert(key: &SockPickKey, value: &SockPickValue) -> Result<(), i32> {
    SOCKPICK_V1.insert(key, value, BPF_ANY as u64)
}

/// IPv6 sockets translated to IPv6 backends (`crate::sock6`), as `SOCKREV_V1`.
#[btf_map]
static SOCKREV6_V1: LruHashMap<SockRev6Key, RevNat6, { SOCK_REVNAT6_CAPACITY as usize }> =
    LruHashMap::new();

/// [`sock_rev_insert`] for an IPv6 socket and backend.
#[inline(always)]
pub fn sock_rev6_insert(key: &SockRev6Key, value: &RevNat6) -> Result<(), i32> {
    SOCKREV6_V1.insert(key, value, BPF_ANY as u64)
}

/// [`sock_rev`] for an IPv6 socket and backend.
#[inline(always)]
pub fn sock_rev6(key: &SockRev6Key) -> Option<RevNat6> {
    let ptr = SOCKREV6_V1.get_ptr(key)?;
    // SAFETY: as in `service`: valid pointer, copied out immediately.
    Some(unsafe { *ptr })
}

/// A session affinity record found by a lookup, to read and to refresh in place.
pub struct AffinityRecord {
    ptr: *mut AffinityValue,
}

impl AffinityRecord {
    /// The recorded backend and its last use.
    #[inline(always)]
    pub fn get(&self) -> (u32, u64) {
        // SAFETY: `ptr` came from a successful lookup in this program run, and callers drop the
        // handle before writing to the map. Other CPUs may refresh `last_used_ns` meanwhile; a
        // torn or stale read of it only moves the expiry by that other flow's few nanoseconds.
        unsafe { ((*self.ptr).backend_id, (*self.ptr).last_used_ns) }
    }

    /// The client started a new flow to the recorded backend now.
    #[inline(always)]
    pub fn touch(&self, now_ns: u64) {
        // SAFETY: as in `get`; one 8-byte store, and concurrent writers store the same kind of
        // value (a recent timestamp), so a lost update costs nothing.
        unsafe { (*self.ptr).last_used_ns = now_ns }
    }
}

/// Look up a session affinity record.
#[inline(always)]
pub fn affinity(key: &AffinityKey) -> Option<AffinityRecord> {
    AFFINITY_V1
        .get_ptr_mut(key)
        .map(|ptr| AffinityRecord { ptr })
}

/// Record (or overwrite) a client's endpoint.
#[inline(always)]
pub fn affinity_insert(key: &AffinityKey, value: &AffinityValue) -> Result<(), i32> {
    AFFINITY_V1.insert(key, value, BPF_ANY as u64)
}

/// May a record naming `key.backend_id` be used for new flows of `key.frontend`?
#[inline(always)]
pub fn affinity_match(key: &AffinityMatchKey) -> bool {
    AFFMATCH_V1.get_ptr(key).is_some()
}

/// A copy of what the first fragment of a datagram got at a hook.
#[inline(always)]
pub fn fragment(key: &FragKey) -> Option<FragValue> {
    let ptr = FRAGMENTS_V1.get_ptr(key)?;
    // SAFETY: as in `service`: valid pointer, copied out immediately.
    Some(unsafe { *ptr })
}

/// This CPU's scratch record: a `FRAGMENTS_V1` entry built in map memory, off the stack.
pub struct FragScratch {
    ptr: *mut FragRecord,
}

/// This CPU's scratch record.
#[inline(always)]
pub fn frag_scratch() -> Option<FragScratch> {
    FRAGSCRATCH.get_ptr_mut(0).map(|ptr| FragScratch { ptr })
}

impl FragScratch {
    /// A copy of the record.
    #[inline(always)]
    pub fn get(&self) -> FragRecord {
        // SAFETY: per-CPU array slots are preallocated and owned by this CPU while the program
        // runs (as in `stats_add`), so nothing else reads or writes it meanwhile.
        unsafe { *self.ptr }
    }

    /// Set the key and value, and mark the record pending.
    #[inline(always)]
    pub fn set(&self, key: FragKey, value: FragValue) {
        // SAFETY: as in `get`.
        unsafe {
            (*self.ptr).key = key;
            (*self.ptr).value = value;
            (*self.ptr).pending = 1;
        }
    }

    /// Clear the pending mark.
    #[inline(always)]
    pub fn clear_pending(&self) {
        // SAFETY: as in `get`.
        unsafe { (*self.ptr).pending = 0 }
    }

    /// Set the value only.
    #[inline(always)]
    pub fn set_value(&self, value: FragValue) {
        // SAFETY: as in `get`.
        unsafe { (*self.ptr).value = value }
    }

    /// Write the record to `FRAGMENTS_V1` (overwriting: the IP id was reused), from the scratch
    /// memory itself.
    #[expect(
        clippy::needless_borrows_for_generic_args,
        reason = "by value, the key and value would be copied to the stack: the update must read them in place"
    )]
    #[inline(always)]
    pub fn commit(&self) -> Result<(), i32> {
        // SAFETY: as in `get`; the references into the slot live only during the update call.
        unsafe { FRAGMENTS_V1.insert(&(*self.ptr).key, &(*self.ptr).value, BPF_ANY as u64) }
    }
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

/// May this CPU generate one more answer now? Takes its cost from the CPU's bucket if so.
#[inline(always)]
pub fn reject_allowed(now_ns: u64) -> bool {
    let Some(ptr) = REJECTRL_V1.get_ptr_mut(0) else {
        return false;
    };
    // SAFETY: per-CPU array slot of this CPU, preallocated; no other program instance touches it
    // while this one runs (as in `stats_add`). Copied, updated and written back.
    unsafe {
        let mut bucket = *ptr;
        let allowed = proxy_common::ratelimit::take(&mut bucket, now_ns);
        *ptr = bucket;
        allowed
    }
}

/// One more packet seen by the tap for `key` on this CPU (dropped silently when the map is full).
#[inline(always)]
pub fn tap_count(key: &TapKey) {
    let bump = |ptr: *mut u64| {
        // SAFETY: a per-CPU hash value belongs to this CPU while the program runs (as in
        // `stats_add`); the pointer comes from a successful lookup.
        unsafe { *ptr = (*ptr).wrapping_add(1) }
    };
    if let Some(ptr) = TAP_V1.get_ptr_mut(key) {
        bump(ptr);
    } else if TAP_V1.insert(key, 1u64, BPF_NOEXIST as u64).is_err() {
        // Another CPU inserted the key first: count into its entry.
        if let Some(ptr) = TAP_V1.get_ptr_mut(key) {
            bump(ptr);
        }
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
const _: () = assert!(same(MAP_SOCK_PICK, "SOCKPICK_V1"));
const _: () = assert!(same(proxy_common::MAP_TAIL_CALLS, "TAILCALLS_V1"));
const _: () = assert!(same(MAP_FRAGMENTS, "FRAGMENTS_V1"));
const _: () = assert!(same(MAP_FRAG_SCRATCH, "FRAGSCRATCH"));
const _: () = assert!(same(MAP_SNAT_DEVICES, "SNATDEV_V1"));
const _: () = assert!(same(MAP_TAP, "TAP_V1"));
const _: () = assert!(same(MAP_SEED, "SEED_V1"));
const _: () = assert!(same(proxy_common::presence::MAP_AGENT, "AGENT_V1"));
const _: () = assert!(same(proxy_common::MAP_FRONTEND_GEN, "FRONTGEN_V1"));
const _: () = assert!(same(MAP_REJECT_LIMIT, "REJECTRL_V1"));
const _: () = assert!(same(MAP_SERVICE_CIDRS, "SVCCIDRS_V1"));
const _: () = assert!(same(MAP_AFFINITY, "AFFINITY_V1"));
const _: () = assert!(same(MAP_AFFINITY_MATCH, "AFFMATCH_V1"));
const _: () = assert!(same(MAP_LC_FLOWS, "LCFLOWS_V1"));
const _: () = assert!(same(MAP_LC_ADJUST, "LCADJ_V1"));
const _: () = assert!(same(MAP_MAGLEV, "MAGLEV_V1"));

// IPv6 (`crate::ipv6`): maps of their own, layouts in `proxy_common::ipv6`.

#[btf_map]
static SERVICES6_V1: HashMap<Service6Key, ServiceValue, { SERVICES6_CAPACITY as usize }> =
    HashMap::new();

#[btf_map]
static BACKENDS6_V1: HashMap<u32, Backend6, { BACKENDS6_CAPACITY as usize }> = HashMap::new();

/// Written by the agent, read by later stages (as `REVNAT_V1`).
#[btf_map]
static REVNAT6_V1: HashMap<u32, RevNat6, { REVNAT6_CAPACITY as usize }> = HashMap::new();

#[btf_map]
static CONNTRACK6_V1: LruHashMap<Ct6Key, Ct6Value, { CONNTRACK6_CAPACITY as usize }> =
    LruHashMap::new();

#[btf_map]
static FRAGMENTS6_V1: LruHashMap<Frag6Key, Frag6Value, { FRAGMENTS6_CAPACITY as usize }> =
    LruHashMap::new();

/// Where the IPv6 programs parse a packet (`ipv6::packet::Scratch6`, one per CPU), not pinned.
#[btf_map]
static SCRATCH6: PerCpuArray<crate::ipv6::packet::Scratch6, 1> = PerCpuArray::new();

/// This CPU's IPv6 parse scratch.
#[inline(always)]
pub fn scratch6() -> Option<&'static mut crate::ipv6::packet::Scratch6> {
    let ptr = SCRATCH6.get_ptr_mut(0)?;
    // SAFETY: a per-CPU array slot: preallocated, never freed, and only this CPU's program run
    // (which cannot be preempted) uses it; each run takes it once (`ipv6::packet::parse`).
    Some(unsafe { &mut *ptr })
}

/// Where an IPv6 fragment record is built before it is written (one per CPU, not pinned).
#[btf_map]
static FRAGREC6: PerCpuArray<crate::ipv6::frag::Frag6Record, 1> = PerCpuArray::new();

/// This CPU's IPv6 fragment record scratch (`ipv6::frag::first_done` only).
#[inline(always)]
pub fn frag6_record() -> Option<&'static mut crate::ipv6::frag::Frag6Record> {
    let ptr = FRAGREC6.get_ptr_mut(0)?;
    // SAFETY: as in `scratch6`; only `ipv6::frag::first_done` takes it, once per call.
    Some(unsafe { &mut *ptr })
}

/// Where a new IPv6 flow's conntrack value is built before it is written (one per CPU).
#[btf_map]
static CTNEW6: PerCpuArray<Ct6Value, 1> = PerCpuArray::new();

/// This CPU's new conntrack value scratch (`ipv6::conntrack::create` only).
#[inline(always)]
pub fn ct6_new_value() -> Option<&'static mut Ct6Value> {
    let ptr = CTNEW6.get_ptr_mut(0)?;
    // SAFETY: as in `scratch6`; only `ipv6::conntrack::create` takes it, once per call.
    Some(unsafe { &mut *ptr })
}

/// Where IPv6 SNAT port allocation builds its keys and values (one per CPU, not pinned).
#[btf_map]
static SNAT6SCRATCH: PerCpuArray<crate::ipv6::snat::Snat6Scratch, 1> = PerCpuArray::new();

/// This CPU's SNAT allocation scratch (`ipv6::snat` only).
#[inline(always)]
pub fn snat6_scratch() -> Option<&'static mut crate::ipv6::snat::Snat6Scratch> {
    let ptr = SNAT6SCRATCH.get_ptr_mut(0)?;
    // SAFETY: as in `scratch6`; `ipv6::snat` takes it once per allocation or check, and no
    // reference outlives the call that took it.
    Some(unsafe { &mut *ptr })
}

/// Where an IPv6 trace record's addresses go between the program that logs and the record
/// function (`log`): one per CPU, not pinned, used only when the trace is on.
#[btf_map]
static LOG6: PerCpuArray<crate::log::Addrs6, 1> = PerCpuArray::new();

#[inline(always)]
pub fn log6_addrs() -> Option<&'static mut crate::log::Addrs6> {
    let ptr = LOG6.get_ptr_mut(0)?;
    // SAFETY: as in `scratch6`: a per-CPU slot, a program run is not preempted on its CPU, and
    // `log` takes it once to write and once (in the record function it then calls) to read.
    Some(unsafe { &mut *ptr })
}

/// Where a new IPv6 flow's reply-tuple probe keeps its candidate keys (one per CPU, not pinned).
#[btf_map]
static CLASH6: PerCpuArray<crate::ipv6::conntrack::Clash6, 1> = PerCpuArray::new();

/// This CPU's reply-tuple probe scratch (`ipv6::conntrack` only).
#[inline(always)]
pub fn clash6() -> Option<&'static mut crate::ipv6::conntrack::Clash6> {
    let ptr = CLASH6.get_ptr_mut(0)?;
    // SAFETY: as in `scratch6`; `ipv6::conntrack` takes it once per probe or insert, and no
    // reference outlives the call that took it.
    Some(unsafe { &mut *ptr })
}

/// A copy of a `SERVICES6` entry.
#[inline(always)]
pub fn service6(key: &Service6Key) -> Option<ServiceValue> {
    let ptr = SERVICES6_V1.get_ptr(key)?;
    // SAFETY: as in `service`.
    Some(unsafe { *ptr })
}

/// `rr_next` for an IPv6 frontend entry (as [`rr_next`]).
#[inline(always)]
pub fn rr_next6(key: &Service6Key) -> Option<u32> {
    let ptr = SERVICES6_V1.get_ptr_mut(key)?;
    // SAFETY: as in `rr_next`.
    Some(unsafe { fetch_add_u32(&raw mut (*ptr).rr_next, 1) })
}

/// A copy of `BACKENDS6[id]`.
#[inline(always)]
pub fn backend6(id: u32) -> Option<Backend6> {
    let ptr = BACKENDS6_V1.get_ptr(id)?;
    // SAFETY: as in `service`.
    Some(unsafe { *ptr })
}

/// `BACKENDS6[id]` by reference (valid for the program run: map values are freed after an RCU
/// grace period; the agent replaces a backend's entry only after its flows' pick is moot).
#[inline(always)]
pub fn backend6_ref(id: u32) -> Option<&'static Backend6> {
    let ptr = BACKENDS6_V1.get_ptr(id)?;
    // SAFETY: a pointer from a hash lookup points at a live, aligned value of the right type
    // for the rest of this program run.
    Some(unsafe { &*ptr })
}

impl Stamped for Ct6Value {
    unsafe fn stamp_fields(ptr: *mut Self) -> (*mut u64, *mut u8) {
        // SAFETY: as for `CtValue`.
        unsafe { (&raw mut (*ptr).last_seen_ns, &raw mut (*ptr).state) }
    }

    unsafe fn flags_field(ptr: *mut Self) -> *mut u8 {
        // SAFETY: as for `CtValue`.
        unsafe { &raw mut (*ptr).flags }
    }

    const FLAGS_OFFSET: usize = core::mem::offset_of!(Ct6Value, flags);
}

pub type Ct6Entry = FlowEntry<Ct6Value>;

/// Look up an IPv6 conntrack entry.
#[inline(always)]
pub fn ct6_entry(key: &Ct6Key) -> Option<Ct6Entry> {
    CONNTRACK6_V1.get_ptr_mut(key).map(|ptr| FlowEntry { ptr })
}

/// Insert or overwrite an IPv6 conntrack entry.
#[inline(always)]
pub fn ct6_insert(key: &Ct6Key, value: &Ct6Value) -> Result<(), i32> {
    CONNTRACK6_V1.insert(key, value, BPF_ANY as u64)
}

/// Insert an IPv6 conntrack entry only if its key is free.
#[inline(always)]
pub fn ct6_insert_new(key: &Ct6Key, value: &Ct6Value) -> Result<(), i32> {
    CONNTRACK6_V1.insert(key, value, BPF_NOEXIST as u64)
}

/// Remove an IPv6 conntrack entry (absent is fine).
#[inline(always)]
pub fn ct6_remove(key: &Ct6Key) {
    let _ = CONNTRACK6_V1.remove(key);
}

#[btf_map]
static SRCRANGES6_V1: LpmTrie<SourceRange6Key, u32, { SOURCE_RANGES6_CAPACITY as usize }> =
    LpmTrie::new();

/// Is the source of a new IPv6 flow inside one of its LoadBalancer frontend's source ranges?
#[inline(always)]
pub fn source_in_range6(key: SourceRange6Key) -> bool {
    let key = Key {
        prefix_len: SOURCE_RANGE6_FRONTEND_BITS + 128,
        data: key,
    };
    SRCRANGES6_V1.get(&key).is_some()
}

#[btf_map]
static AFFINITY6_V1: LruHashMap<Affinity6Key, AffinityValue, { AFFINITY6_CAPACITY as usize }> =
    LruHashMap::new();

#[btf_map]
static AFFMATCH6_V1: HashMap<Affinity6MatchKey, u32, { AFFINITY_MATCH6_CAPACITY as usize }> =
    HashMap::new();

/// The frontend entry a new IPv6 flow to `key` (slot 0, `SCOPE_EXTERNAL`) uses, as
/// [`frontend_for`] (an eTP=Local frontend's in-cluster entry for clients in the cluster CIDRs,
/// `in_cluster`); `key` is left at the scope of the entry returned.
#[inline(always)]
pub fn frontend6_for(
    key: &mut Service6Key,
    in_cluster: impl FnOnce() -> bool,
) -> Option<ServiceValue> {
    scoped_frontend(key, |k, scope| k.scope = scope, service6, in_cluster)
}

#[btf_map]
static CLUSTERCIDRS6_V1: LpmTrie<[u8; 16], u32, { CLUSTER_CIDRS6_CAPACITY as usize }> =
    LpmTrie::new();

/// Is the IPv6 `addr` inside the cluster's IPv6 pod CIDRs (as [`in_cluster`])?
#[inline(always)]
pub fn in_cluster6(addr: &[u8; 16]) -> bool {
    let key = Key {
        prefix_len: 128,
        data: *addr,
    };
    CLUSTERCIDRS6_V1.get(&key).is_some()
}

#[btf_map]
static SVCCIDRS6_V1: LpmTrie<[u8; 16], u32, { SERVICE_CIDRS6_CAPACITY as usize }> = LpmTrie::new();

/// What the IPv6 `addr` is in the Service address space (`service_cidr::*`), if anything.
#[inline(always)]
pub fn service_cidr6(addr: &[u8; 16]) -> Option<u32> {
    let key = Key {
        prefix_len: 128,
        data: *addr,
    };
    SVCCIDRS6_V1.get(&key).copied()
}

/// An IPv6 client's session affinity record (as [`affinity`]).
#[inline(always)]
pub fn affinity6(key: &Affinity6Key) -> Option<AffinityRecord> {
    AFFINITY6_V1
        .get_ptr_mut(key)
        .map(|ptr| AffinityRecord { ptr })
}

/// Write an IPv6 client's session affinity record.
#[inline(always)]
pub fn affinity6_insert(key: &Affinity6Key, value: &AffinityValue) -> Result<(), i32> {
    AFFINITY6_V1.insert(key, value, BPF_ANY as u64)
}

/// May a record naming `key.backend_id` be used for new flows of the IPv6 `key.frontend`?
#[inline(always)]
pub fn affinity6_match(key: &Affinity6MatchKey) -> bool {
    AFFMATCH6_V1.get_ptr(key).is_some()
}

impl FlowEntry<Ct6Value> {
    /// As `FlowEntry<CtValue>::take_counted`, for an IPv6 entry.
    #[inline(always)]
    pub fn take_counted(&self) -> bool {
        const FLAGS: usize = <Ct6Value as Stamped>::FLAGS_OFFSET;
        const BIT: u64 = (proxy_common::ct_flags::COUNTED as u64) << ((FLAGS & 7) * 8);
        // SAFETY: as for `CtValue`: the flags byte's aligned word lies inside the value (which
        // holds u64 fields; map values are 8-aligned), the AND leaves every other bit as it is.
        let old = unsafe { fetch_and_u64(self.ptr.cast::<u8>().add(FLAGS & !7).cast(), !BIT) };
        old & BIT != 0
    }
}

/// A copy of an IPv6 fragment record.
#[inline(always)]
pub fn fragment6(key: &Frag6Key) -> Option<Frag6Value> {
    let ptr = FRAGMENTS6_V1.get_ptr(key)?;
    // SAFETY: as in `service`.
    Some(unsafe { *ptr })
}

/// Write an IPv6 fragment record.
#[inline(always)]
pub fn fragment6_insert(key: &Frag6Key, value: &Frag6Value) -> Result<(), i32> {
    FRAGMENTS6_V1.insert(key, value, BPF_ANY as u64)
}

const _: () = assert!(same(MAP_SERVICES6, "SERVICES6_V1"));
const _: () = assert!(same(MAP_BACKENDS6, "BACKENDS6_V1"));
const _: () = assert!(same(MAP_REVNAT6, "REVNAT6_V1"));
const _: () = assert!(same(MAP_CONNTRACK6, "CONNTRACK6_V1"));
const _: () = assert!(same(MAP_FRAGMENTS6, "FRAGMENTS6_V1"));
const _: () = assert!(same(MAP_SOURCE_RANGES6, "SRCRANGES6_V1"));
const _: () = assert!(same(MAP_AFFINITY6, "AFFINITY6_V1"));
const _: () = assert!(same(MAP_AFFINITY_MATCH6, "AFFMATCH6_V1"));
const _: () = assert!(same(MAP_SERVICE_CIDRS6, "SVCCIDRS6_V1"));
const _: () = assert!(same(MAP_CLUSTER_CIDRS6, "CLUSTERCIDRS6_V1"));
const _: () = assert!(same(MAP_SOCK_REVNAT6, "SOCKREV6_V1"));
const _: () = assert!(same(MAP_SNAT6, "SNAT6_V1"));
const _: () = assert!(same(MAP_NODE6, "NODE6_V1"));

#[btf_map]
static SNAT6_V1: LruHashMap<Snat6Key, Snat6Value, { SNAT6_CAPACITY as usize }> = LruHashMap::new();

#[btf_map]
static NODE6_V1: Array<Node6Info, 1> = Array::new();

impl Stamped for Snat6Value {
    unsafe fn stamp_fields(ptr: *mut Self) -> (*mut u64, *mut u8) {
        // SAFETY: as for `CtValue`.
        unsafe { (&raw mut (*ptr).last_seen_ns, &raw mut (*ptr).state) }
    }

    unsafe fn flags_field(ptr: *mut Self) -> *mut u8 {
        // SAFETY: as for `CtValue`.
        unsafe { &raw mut (*ptr).flags }
    }

    const FLAGS_OFFSET: usize = core::mem::offset_of!(Snat6Value, flags);
}

pub type Snat6Entry = FlowEntry<Snat6Value>;

/// The node's IPv6 SNAT address (`::` while the agent has written none).
#[inline(always)]
pub fn node6_addr() -> [u8; 16] {
    match NODE6_V1.get_ptr(0) {
        // SAFETY: array slots are preallocated; the pointer is valid and the value copied at once.
        Some(ptr) => unsafe { (*ptr).snat_addr },
        None => [0; 16],
    }
}

/// Is `addr` the node's IPv6 SNAT address (never `::`)? Compared in place.
#[inline(always)]
pub fn is_node6_addr(addr: &[u8; 16]) -> bool {
    match NODE6_V1.get_ptr(0) {
        // SAFETY: as in `node6_addr`.
        Some(ptr) => *addr != [0; 16] && unsafe { (*ptr).snat_addr == *addr },
        None => false,
    }
}

/// Has the agent written no IPv6 SNAT address (`::`)? Compared in place (nothing copied to the
/// stack).
#[inline(always)]
pub fn node6_unset() -> bool {
    match NODE6_V1.get_ptr(0) {
        // SAFETY: as in `node6_addr`.
        Some(ptr) => unsafe { (*ptr).snat_addr == [0; 16] },
        None => true,
    }
}

/// Look up an IPv6 SNAT entry.
#[inline(always)]
pub fn snat6_entry(key: &Snat6Key) -> Option<Snat6Entry> {
    SNAT6_V1.get_ptr_mut(key).map(|ptr| FlowEntry { ptr })
}

/// Insert an IPv6 SNAT entry only if the key is free (the atomic claim of a port).
#[inline(always)]
pub fn snat6_claim(key: &Snat6Key, value: &Snat6Value) -> Result<(), i32> {
    SNAT6_V1.insert(key, value, BPF_NOEXIST as u64)
}

/// Insert or overwrite an IPv6 SNAT entry.
#[inline(always)]
pub fn snat6_insert(key: &Snat6Key, value: &Snat6Value) -> Result<(), i32> {
    SNAT6_V1.insert(key, value, BPF_ANY as u64)
}

/// Remove an IPv6 SNAT entry (absent is fine).
#[inline(always)]
pub fn snat6_remove(key: &Snat6Key) {
    let _ = SNAT6_V1.remove(key);
}
