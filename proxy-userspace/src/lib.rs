//! kube-proxy-ebpf agent library, by stage: `sources` (what the cluster says) → `pipeline`
//! (pure: translate, plan) → `dataplane` (the kernel: maps, programs, links, GC), with `serving`
//! (health, metrics) beside it, `cli` (flags, config file, dump, cleanup) on top, and `agent`
//! the one place that wires them together, on the timing of `schedule` (pure).
// `unsafe` only in the modules that allow it: the syscalls no maintained crate wraps.
#![deny(unsafe_code)]
pub mod agent;
pub mod cli;
pub mod dataplane;
pub mod family6;
pub mod pipeline;
pub mod schedule;
pub mod serving;
pub mod sources;
