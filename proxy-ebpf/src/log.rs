//! The opt-in datapath trace (`--bpf-log LEVEL`, off by default): aya-log records at a few
//! decision points, bridged into the agent's `tracing` under `proxy_common::bpf_log::TARGET`.
//! Counters say how often something happens; these lines say to which flow.
//!
//! No cost when off: every record is gated by [`BPF_LOG_LEVEL`], a `.rodata` global the agent
//! sets at load time. The loader freezes `.rodata`, so the verifier reads the level as a
//! constant and removes the calls above it as dead code: no ring-buffer write, no argument setup.
//!
//! Stack: a record is built on the stack of the function that logs (aya-log's fields), and a
//! BPF program's frames add up along its calls (512 bytes in all). So each record is written by
//! an `#[inline(never)]` function of its own, called with its fields packed into registers: the
//! caller's frame stays as it was, the record's frame only exists during the call, on top of it.
//!
//! Levels (`proxy_common::bpf_log`): warn for a flow dropped for want of resources, info for a
//! new flow refused, debug once per flow, trace per packet.

use aya_log_ebpf::{debug, info, trace, warn};
use proxy_common::{
    Scheduler,
    bpf_log::{self, TARGET},
    proto,
};

/// The level (`proxy_common::bpf_log`), 0 = off. Set by the agent with
/// `EbpfLoader::override_global(LOG_LEVEL_GLOBAL, ..)`; off in an object loaded any other way.
#[unsafe(no_mangle)]
static BPF_LOG_LEVEL: u8 = bpf_log::OFF;

/// Is the datapath trace on at `level` or finer?
#[inline(always)]
fn enabled(level: u8) -> bool {
    // SAFETY: a volatile read of an initialised, immutable static (as `maps::config_ref`: the
    // compiler must not fold the default, the loader rewrites `.rodata` before loading).
    unsafe { core::ptr::read_volatile(&BPF_LOG_LEVEL) >= level }
}

/// An address and port (network order) in one register: the address's bytes in the low half.
#[inline(always)]
fn pack(addr: [u8; 4], port: [u8; 2]) -> u64 {
    u64::from(u32::from_ne_bytes(addr)) | (u64::from(u16::from_be_bytes(port)) << 32)
}

/// The address of a [`pack`]ed endpoint, as aya-log's `{:i}` takes it.
#[inline(always)]
fn addr(e: u64) -> [u8; 4] {
    (e as u32).to_ne_bytes()
}

/// The port of a [`pack`]ed endpoint, host order.
#[inline(always)]
fn port(e: u64) -> u16 {
    (e >> 32) as u16
}

#[inline(always)]
fn proto_name(p: u8) -> &'static str {
    match p {
        proto::TCP => "tcp",
        proto::UDP => "udp",
        _ => "ip",
    }
}

/// Why a new flow was refused ([`refused`]).
#[derive(Clone, Copy)]
#[repr(u8)]
pub enum Refused {
    /// Outside the frontend's loadBalancerSourceRanges: dropped.
    SourceRange,
    /// A Local policy served only by other nodes: dropped.
    NoLocalEndpoints,
    /// A Service without endpoints: ICMP port unreachable.
    NoEndpoints,
    /// A port of a ClusterIP that none of its Services has: ICMP port unreachable.
    NoSuchPort,
    /// Mid-connection TCP whose backend is gone: reset.
    BackendGone,
}

/// A new flow went to a backend: once per flow, at debug.
#[inline(always)]
pub fn new_flow(
    proto: u8,
    client: ([u8; 4], [u8; 2]),
    frontend: ([u8; 4], [u8; 2]),
    backend: ([u8; 4], [u8; 2]),
    backend_id: u32,
    scheduler: u8,
) {
    if enabled(bpf_log::DEBUG) {
        let meta = u64::from(backend_id) | u64::from(scheduler) << 32 | u64::from(proto) << 40;
        new_flow_record(
            pack(client.0, client.1),
            pack(frontend.0, frontend.1),
            pack(backend.0, backend.1),
            meta,
        );
    }
}

#[inline(never)]
fn new_flow_record(client: u64, frontend: u64, backend: u64, meta: u64) {
    let scheduler = Scheduler::from_code((meta >> 32) as u8).map_or("?", Scheduler::name);
    debug!(
        (),
        target: TARGET,
        "new flow {} {:i}:{} -> {:i}:{}: backend {} {:i}:{} ({})",
        proto_name((meta >> 40) as u8),
        addr(client),
        port(client),
        addr(frontend),
        port(frontend),
        meta as u32,
        addr(backend),
        port(backend),
        scheduler
    );
}

/// A new flow was refused (dropped, rejected or reset): at info.
#[inline(always)]
pub fn refused(why: Refused, proto: u8, client: ([u8; 4], [u8; 2]), frontend: ([u8; 4], [u8; 2])) {
    if enabled(bpf_log::INFO) {
        refused_record(
            why as u8,
            proto,
            pack(client.0, client.1),
            pack(frontend.0, frontend.1),
        );
    }
}

#[inline(never)]
fn refused_record(why: u8, proto: u8, client: u64, frontend: u64) {
    let why = match why {
        x if x == Refused::SourceRange as u8 => "outside loadBalancerSourceRanges: dropped",
        x if x == Refused::NoLocalEndpoints as u8 => "no local endpoints: dropped",
        x if x == Refused::NoEndpoints as u8 => "no endpoints: rejected",
        x if x == Refused::NoSuchPort as u8 => "no Service on this port: rejected",
        _ => "backend gone: reset",
    };
    info!(
        (),
        target: TARGET,
        "{} {:i}:{} -> {:i}:{}: {}",
        proto_name(proto),
        addr(client),
        port(client),
        addr(frontend),
        port(frontend),
        why
    );
}

/// A new flow got no SNAT port toward its backend and was dropped: at warn.
#[inline(always)]
pub fn snat_failed(
    client: ([u8; 4], [u8; 2]),
    frontend: ([u8; 4], [u8; 2]),
    backend: ([u8; 4], [u8; 2]),
) {
    if enabled(bpf_log::WARN) {
        snat_failed_record(
            pack(client.0, client.1),
            pack(frontend.0, frontend.1),
            pack(backend.0, backend.1),
        );
    }
}

#[inline(never)]
fn snat_failed_record(client: u64, frontend: u64, backend: u64) {
    warn!(
        (),
        target: TARGET,
        "{:i}:{} -> {:i}:{}: no SNAT port toward backend {:i}:{}: dropped",
        addr(client),
        port(client),
        addr(frontend),
        port(frontend),
        addr(backend),
        port(backend)
    );
}

/// A reply was reverse-NATed (source shown as the frontend): the flow's first at debug, every
/// one at trace.
#[inline(always)]
pub fn reply(
    first: bool,
    backend: ([u8; 4], [u8; 2]),
    client: ([u8; 4], [u8; 2]),
    frontend: ([u8; 4], [u8; 2]),
) {
    if enabled(if first {
        bpf_log::DEBUG
    } else {
        bpf_log::TRACE
    }) {
        reply_record(
            first,
            pack(backend.0, backend.1),
            pack(client.0, client.1),
            pack(frontend.0, frontend.1),
        );
    }
}

#[inline(never)]
fn reply_record(first: bool, backend: u64, client: u64, frontend: u64) {
    let what = if first { "first reply" } else { "reply" };
    if first {
        debug!(
            (),
            target: TARGET,
            "{} {:i}:{} -> {:i}:{}: from {:i}:{}",
            what,
            addr(backend),
            port(backend),
            addr(client),
            port(client),
            addr(frontend),
            port(frontend)
        );
    } else {
        trace!(
            (),
            target: TARGET,
            "{} {:i}:{} -> {:i}:{}: from {:i}:{}",
            what,
            addr(backend),
            port(backend),
            addr(client),
            port(client),
            addr(frontend),
            port(frontend)
        );
    }
}

/// An egress packet without a conntrack entry (not a reply of a translated flow, nor SNATed):
/// passed untouched. Per packet, at trace.
#[inline(always)]
pub fn untracked(proto: u8, source: ([u8; 4], [u8; 2]), dest: ([u8; 4], [u8; 2])) {
    if enabled(bpf_log::TRACE) {
        untracked_record(proto, pack(source.0, source.1), pack(dest.0, dest.1));
    }
}

#[inline(never)]
fn untracked_record(proto: u8, source: u64, dest: u64) {
    trace!(
        (),
        target: TARGET,
        "no conntrack entry: {} {:i}:{} -> {:i}:{}: passed",
        proto_name(proto),
        addr(source),
        port(source),
        addr(dest),
        port(dest)
    );
}

/// A socket hook sent a connect()/sendmsg() of the node's to a backend: at debug.
#[inline(always)]
pub fn socket(proto: u8, frontend: ([u8; 4], [u8; 2]), backend: ([u8; 4], [u8; 2]), id: u32) {
    if enabled(bpf_log::DEBUG) {
        socket_record(
            u64::from(id) | u64::from(proto) << 32,
            pack(frontend.0, frontend.1),
            pack(backend.0, backend.1),
        );
    }
}

#[inline(never)]
fn socket_record(meta: u64, frontend: u64, backend: u64) {
    debug!(
        (),
        target: TARGET,
        "socket {} -> {:i}:{}: backend {} {:i}:{}",
        proto_name((meta >> 32) as u8),
        addr(frontend),
        port(frontend),
        meta as u32,
        addr(backend),
        port(backend)
    );
}

/// Session affinity kept a client on its recorded backend: at debug.
#[inline(always)]
pub fn affinity_hit(client: [u8; 4], backend_id: u32) {
    if enabled(bpf_log::DEBUG) {
        affinity_record(u64::from(u32::from_ne_bytes(client)), backend_id);
    }
}

#[inline(never)]
fn affinity_record(client: u64, backend_id: u32) {
    debug!(
        (),
        target: TARGET,
        "affinity: client {:i} keeps backend {}",
        addr(client),
        backend_id
    );
}
