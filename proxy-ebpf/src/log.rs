//! The opt-in datapath trace (`--bpf-log LEVEL`, off by default): aya-log records at a few
//! decision points, bridged into the agent's `tracing` under `proxy_common::bpf_log::TARGET`.
//! Counters say how often something happens; these lines say to which flow.
//!
//! No cost when off: every record is gated by [`BPF_LOG_LEVEL`], a `.rodata` global the agent
//! sets at load time. The loader freezes `.rodata`, so the verifier reads the level as a
//! constant and removes the calls above it as dead code: no ring-buffer write, no argument setup.
//!
//! Each record is written by a function of its own (`kpe_log_*`), called with its fields packed
//! into registers:
//! - stack: a record is built on the stack of the function that logs (aya-log's fields), and a
//!   BPF program's frames add up along its calls (512 bytes in all). In a callee the caller's
//!   frame stays as it was (tc_ingress_new 376 + 40 for its record), the record's only exists
//!   during the call.
//! - verifier: the callees are global functions (`#[no_mangle] extern "C"`, BTF linkage global,
//!   which aya keeps), checked once for any arguments instead of once per path that reaches a
//!   call: inlined or static, the new-flow record alone took tc_ingress_new past the verifier's
//!   million instructions. Their text is of constant length (one function per scheduler or
//!   refusal): copying a string of unknown length is a loop the verifier walks byte by byte.
//!   tc_ingress_new does not branch on the scheduler to pick one (that made the verifier track
//!   the scheduler through the whole program: 835,000 instructions instead of 185,000); the
//!   dispatch is in a global function too.
//!
//! Levels (`proxy_common::bpf_log`): warn for a flow dropped for want of resources, info for a
//! new flow refused, debug once per flow, trace per packet. The IPv6 programs write the same
//! records of one or two addresses (`*6`: refusals, untracked packets, socket rewrites,
//! affinity hits; see there for the others), their addresses passed through a per-CPU slot
//! (`maps::log6_addrs`, the only map this module uses).

use aya_log_ebpf::{debug, info, trace, warn};
use proxy_common::{
    bpf_log::{self, TARGET},
    proto,
    sched::code as sched,
};

use crate::maps;

/// The addresses of an IPv6 record, in this CPU's `LOG6` slot (`maps::log6_addrs`): written by
/// the program that logs, read by the record function it calls.
#[derive(Clone, Copy)]
pub struct Addrs6 {
    pub a: [u8; 16],
    pub b: [u8; 16],
}

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

/// The protocol of a translated packet (TCP or UDP), as the log shows it. Names of one length:
/// a string of unknown length costs the verifier a loop.
#[inline(always)]
fn proto_name(p: u8) -> &'static str {
    if p == proto::TCP { "tcp" } else { "udp" }
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
        // The scheduler is passed on, not branched on here: a branch would make the verifier
        // track its value through the whole new-flow program.
        kpe_log_new_flow(
            pack(client.0, client.1),
            pack(frontend.0, frontend.1),
            pack(backend.0, backend.1),
            u64::from(backend_id) | u64::from(scheduler) << 32 | u64::from(proto) << 40,
        );
    }
}

/// Hands a new flow's record to the function of its scheduler, where the scheduler's name is a
/// constant (a string of unknown length costs the verifier a loop). Global, like every record
/// function: the verifier checks each once, not at every call. The records are not written here
/// but one call deeper: their fields would make this frame, and the program's stack, larger.
#[unsafe(no_mangle)]
#[inline(never)]
pub extern "C" fn kpe_log_new_flow(client: u64, frontend: u64, backend: u64, meta: u64) -> i32 {
    match (meta >> 32) as u8 {
        sched::ROUND_ROBIN => kpe_log_new_flow_rr(client, frontend, backend, meta),
        sched::LEAST_CONNECTION => kpe_log_new_flow_lc(client, frontend, backend, meta),
        sched::SOURCE_HASH => kpe_log_new_flow_sh(client, frontend, backend, meta),
        sched::DESTINATION_HASH => kpe_log_new_flow_dh(client, frontend, backend, meta),
        sched::MAGLEV => kpe_log_new_flow_mh(client, frontend, backend, meta),
        _ => kpe_log_new_flow_random(client, frontend, backend, meta),
    }
}

/// Defines the record function `$name` of a new flow whose frontend's scheduler is `$sched`.
macro_rules! new_flow_record {
    ($name:ident, $sched:literal) => {
        #[unsafe(no_mangle)]
        #[inline(never)]
        pub extern "C" fn $name(client: u64, frontend: u64, backend: u64, meta: u64) -> i32 {
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
                $sched
            );
            0
        }
    };
}

new_flow_record!(kpe_log_new_flow_random, "random");
new_flow_record!(kpe_log_new_flow_rr, "rr");
new_flow_record!(kpe_log_new_flow_lc, "lc");
new_flow_record!(kpe_log_new_flow_sh, "sh");
new_flow_record!(kpe_log_new_flow_dh, "dh");
new_flow_record!(kpe_log_new_flow_mh, "mh");

/// A new flow was refused (dropped, rejected or reset): at info.
#[inline(always)]
pub fn refused(why: Refused, proto: u8, client: ([u8; 4], [u8; 2]), frontend: ([u8; 4], [u8; 2])) {
    if enabled(bpf_log::INFO) {
        let (c, f) = (pack(client.0, client.1), pack(frontend.0, frontend.1));
        // `why` is a constant at every call site: one record function each, its text constant.
        match why {
            Refused::SourceRange => kpe_log_refused_source_range(proto, c, f),
            Refused::NoLocalEndpoints => kpe_log_refused_no_local_endpoints(proto, c, f),
            Refused::NoEndpoints => kpe_log_refused_no_endpoints(proto, c, f),
            Refused::NoSuchPort => kpe_log_refused_no_such_port(proto, c, f),
            Refused::BackendGone => kpe_log_refused_backend_gone(proto, c, f),
        };
    }
}

/// Defines the record function `$name` of a new flow refused for reason `$why`.
macro_rules! refused_record {
    ($name:ident, $why:literal) => {
        #[unsafe(no_mangle)]
        #[inline(never)]
        pub extern "C" fn $name(proto: u8, client: u64, frontend: u64) -> i32 {
            info!(
                (),
                target: TARGET,
                "{} {:i}:{} -> {:i}:{}: {}",
                proto_name(proto),
                addr(client),
                port(client),
                addr(frontend),
                port(frontend),
                $why
            );
            0
        }
    };
}

refused_record!(
    kpe_log_refused_source_range,
    "outside loadBalancerSourceRanges: dropped"
);
refused_record!(
    kpe_log_refused_no_local_endpoints,
    "no local endpoints: dropped"
);
refused_record!(kpe_log_refused_no_endpoints, "no endpoints: rejected");
refused_record!(
    kpe_log_refused_no_such_port,
    "no Service on this port: rejected"
);
refused_record!(kpe_log_refused_backend_gone, "backend gone: reset");

/// A new flow got no SNAT port toward its backend and was dropped: at warn.
#[inline(always)]
pub fn snat_failed(
    client: ([u8; 4], [u8; 2]),
    frontend: ([u8; 4], [u8; 2]),
    backend: ([u8; 4], [u8; 2]),
) {
    if enabled(bpf_log::WARN) {
        kpe_log_snat_failed(
            pack(client.0, client.1),
            pack(frontend.0, frontend.1),
            pack(backend.0, backend.1),
        );
    }
}

#[unsafe(no_mangle)]
#[inline(never)]
pub extern "C" fn kpe_log_snat_failed(client: u64, frontend: u64, backend: u64) -> i32 {
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
    0
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
    if first && enabled(bpf_log::DEBUG) {
        kpe_log_first_reply(
            pack(backend.0, backend.1),
            pack(client.0, client.1),
            pack(frontend.0, frontend.1),
        );
    } else if enabled(bpf_log::TRACE) {
        kpe_log_reply(
            pack(backend.0, backend.1),
            pack(client.0, client.1),
            pack(frontend.0, frontend.1),
        );
    }
}

#[unsafe(no_mangle)]
#[inline(never)]
pub extern "C" fn kpe_log_first_reply(backend: u64, client: u64, frontend: u64) -> i32 {
    debug!(
        (),
        target: TARGET,
        "first reply {:i}:{} -> {:i}:{}: from {:i}:{}",
        addr(backend),
        port(backend),
        addr(client),
        port(client),
        addr(frontend),
        port(frontend)
    );
    0
}

#[unsafe(no_mangle)]
#[inline(never)]
pub extern "C" fn kpe_log_reply(backend: u64, client: u64, frontend: u64) -> i32 {
    trace!(
        (),
        target: TARGET,
        "reply {:i}:{} -> {:i}:{}: from {:i}:{}",
        addr(backend),
        port(backend),
        addr(client),
        port(client),
        addr(frontend),
        port(frontend)
    );
    0
}

/// An egress packet without a conntrack entry (not a reply of a translated flow, nor SNATed):
/// passed untouched. Per packet, at trace.
#[inline(always)]
pub fn untracked(proto: u8, source: ([u8; 4], [u8; 2]), dest: ([u8; 4], [u8; 2])) {
    if enabled(bpf_log::TRACE) {
        kpe_log_untracked(proto, pack(source.0, source.1), pack(dest.0, dest.1));
    }
}

#[unsafe(no_mangle)]
#[inline(never)]
pub extern "C" fn kpe_log_untracked(proto: u8, source: u64, dest: u64) -> i32 {
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
    0
}

/// A socket hook sent a connect()/sendmsg() of the node's to a backend: at debug.
#[inline(always)]
pub fn socket(proto: u8, frontend: ([u8; 4], [u8; 2]), backend: ([u8; 4], [u8; 2]), id: u32) {
    if enabled(bpf_log::DEBUG) {
        kpe_log_socket(
            u64::from(id) | u64::from(proto) << 32,
            pack(frontend.0, frontend.1),
            pack(backend.0, backend.1),
        );
    }
}

#[unsafe(no_mangle)]
#[inline(never)]
pub extern "C" fn kpe_log_socket(meta: u64, frontend: u64, backend: u64) -> i32 {
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
    0
}

/// Session affinity kept a client on its recorded backend: at debug.
#[inline(always)]
pub fn affinity_hit(client: [u8; 4], backend_id: u32) {
    if enabled(bpf_log::DEBUG) {
        kpe_log_affinity(u64::from(u32::from_ne_bytes(client)), backend_id);
    }
}

#[unsafe(no_mangle)]
#[inline(never)]
pub extern "C" fn kpe_log_affinity(client: u64, backend_id: u32) -> i32 {
    debug!(
        (),
        target: TARGET,
        "affinity: client {:i} keeps backend {}",
        addr(client),
        backend_id
    );
    0
}

// IPv6 records: the records of one or two addresses, at the same levels, the addresses in
// brackets. A 16-byte address does not fit in a register, and the IPv6 programs' stacks have
// little room left: the caller writes the addresses into the per-CPU `LOG6` slot (map memory,
// no stack) and passes ports and ids in registers; the record function reads the slot. Both
// only under the level check. Not on IPv6: the records of three addresses (new flow, reply,
// SNAT failure): aya-log copies each argument to the record function's stack, 72 bytes for
// three 16-byte addresses, and tc_ingress6_new and tc_egress6 (448) or tc_ingress6_snat (464)
// leave 64 or 48 of the 512 (the verifier refused tc_egress6 at 528).

/// Two ports (network order) in one register, the first in the low bits.
#[inline(always)]
fn ports2(a: [u8; 2], b: [u8; 2]) -> u64 {
    u64::from(u16::from_be_bytes(a)) | u64::from(u16::from_be_bytes(b)) << 16
}

/// Port `i` (0, 1) of a [`ports2`] register, host order.
#[inline(always)]
fn port_of(ports: u64, i: u32) -> u16 {
    (ports >> (16 * i)) as u16
}

/// Writes one or two addresses into this CPU's `LOG6` slot; false if there is none.
#[inline(always)]
fn addrs6(a: &[u8; 16], b: Option<&[u8; 16]>) -> bool {
    match maps::log6_addrs() {
        Some(slot) => {
            slot.a = *a;
            if let Some(b) = b {
                slot.b = *b;
            }
            true
        }
        None => false,
    }
}

/// A new IPv6 flow was refused (dropped, rejected or reset): at info.
#[inline(always)]
pub fn refused6(
    why: Refused,
    proto: u8,
    client: (&[u8; 16], [u8; 2]),
    frontend: (&[u8; 16], [u8; 2]),
) {
    if enabled(bpf_log::INFO) && addrs6(client.0, Some(frontend.0)) {
        let ports = ports2(client.1, frontend.1);
        match why {
            Refused::SourceRange => kpe_log6_refused_source_range(proto, ports),
            Refused::NoLocalEndpoints => kpe_log6_refused_no_local_endpoints(proto, ports),
            Refused::NoEndpoints => kpe_log6_refused_no_endpoints(proto, ports),
            Refused::NoSuchPort => kpe_log6_refused_no_such_port(proto, ports),
            Refused::BackendGone => kpe_log6_refused_backend_gone(proto, ports),
        };
    }
}

/// Defines the IPv6 record function `$name` of a new flow refused for reason `$why`.
macro_rules! refused6_record {
    ($name:ident, $why:literal) => {
        #[unsafe(no_mangle)]
        #[inline(never)]
        pub extern "C" fn $name(proto: u8, ports: u64) -> i32 {
            let Some(a) = maps::log6_addrs() else {
                return 0;
            };
            info!(
                (),
                target: TARGET,
                "{} [{:i}]:{} -> [{:i}]:{}: {}",
                proto_name(proto),
                a.a,
                port_of(ports, 0),
                a.b,
                port_of(ports, 1),
                $why
            );
            0
        }
    };
}

refused6_record!(
    kpe_log6_refused_source_range,
    "outside loadBalancerSourceRanges: dropped"
);
refused6_record!(
    kpe_log6_refused_no_local_endpoints,
    "no local endpoints: dropped"
);
refused6_record!(kpe_log6_refused_no_endpoints, "no endpoints: rejected");
refused6_record!(
    kpe_log6_refused_no_such_port,
    "no Service on this port: rejected"
);
refused6_record!(kpe_log6_refused_backend_gone, "backend gone: reset");

/// An IPv6 egress packet without a conntrack entry: passed untouched. Per packet, at trace.
#[inline(always)]
pub fn untracked6(proto: u8, source: (&[u8; 16], [u8; 2]), dest: (&[u8; 16], [u8; 2])) {
    if enabled(bpf_log::TRACE) && addrs6(source.0, Some(dest.0)) {
        kpe_log6_untracked(proto, ports2(source.1, dest.1));
    }
}

#[unsafe(no_mangle)]
#[inline(never)]
pub extern "C" fn kpe_log6_untracked(proto: u8, ports: u64) -> i32 {
    let Some(a) = maps::log6_addrs() else {
        return 0;
    };
    trace!(
        (),
        target: TARGET,
        "no conntrack entry: {} [{:i}]:{} -> [{:i}]:{}: passed",
        proto_name(proto),
        a.a,
        port_of(ports, 0),
        a.b,
        port_of(ports, 1)
    );
    0
}

/// An IPv6 socket hook sent a connect()/sendmsg() of the node's to a backend: at debug.
#[inline(always)]
pub fn socket6(proto: u8, frontend: (&[u8; 16], [u8; 2]), backend: (&[u8; 16], [u8; 2]), id: u32) {
    if enabled(bpf_log::DEBUG) && addrs6(frontend.0, Some(backend.0)) {
        kpe_log6_socket(
            u64::from(id) | u64::from(proto) << 32,
            ports2(frontend.1, backend.1),
        );
    }
}

#[unsafe(no_mangle)]
#[inline(never)]
pub extern "C" fn kpe_log6_socket(meta: u64, ports: u64) -> i32 {
    let Some(a) = maps::log6_addrs() else {
        return 0;
    };
    debug!(
        (),
        target: TARGET,
        "socket {} -> [{:i}]:{}: backend {} [{:i}]:{}",
        proto_name((meta >> 32) as u8),
        a.a,
        port_of(ports, 0),
        meta as u32,
        a.b,
        port_of(ports, 1)
    );
    0
}

/// Session affinity kept an IPv6 client on its recorded backend: at debug.
#[inline(always)]
pub fn affinity_hit6(client: &[u8; 16], backend_id: u32) {
    if enabled(bpf_log::DEBUG) && addrs6(client, None) {
        kpe_log6_affinity(backend_id);
    }
}

#[unsafe(no_mangle)]
#[inline(never)]
pub extern "C" fn kpe_log6_affinity(backend_id: u32) -> i32 {
    let Some(a) = maps::log6_addrs() else {
        return 0;
    };
    debug!(
        (),
        target: TARGET,
        "affinity: client {:i} keeps backend {}",
        a.a,
        backend_id
    );
    0
}
