//! The opt-in datapath trace (`--bpf-log LEVEL`): the level the agent writes into the eBPF
//! object's `.rodata` before loading it. The numbers are aya-log's `Level` (error 1 … trace 5),
//! 0 is off. The global is read-only to the programs and frozen, so the verifier knows its value
//! and removes the log calls above it as dead code: with the level off the programs that run are
//! the ones without logging.

/// Name of the `u8` global holding the level in the eBPF object.
pub const LOG_LEVEL_GLOBAL: &str = "BPF_LOG_LEVEL";

/// No datapath log (the default).
pub const OFF: u8 = 0;
/// No datapath record is an error yet (a fault of the datapath itself would be one).
pub const ERROR: u8 = 1;
/// A new flow dropped for want of resources (no SNAT port).
pub const WARN: u8 = 2;
/// A new flow refused by policy or for want of endpoints (source range, reject, Local drop).
pub const INFO: u8 = 3;
/// Once per new flow: its translation (frontend → backend), an affinity hit, a socket-hook
/// rewrite, a flow's first reply.
pub const DEBUG: u8 = 4;
/// Per packet: every reverse-NATed reply, every egress packet without a conntrack entry.
pub const TRACE: u8 = 5;

/// The `log` target of every datapath record (filter it with `RUST_LOG`).
pub const TARGET: &str = "kube_proxy_ebpf::datapath";
