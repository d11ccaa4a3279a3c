//! kube-proxy-ebpf agent library: sources → translate (pure) → diff (pure) → apply (maps).
// `unsafe` only in the modules that allow it: the syscalls no maintained crate wraps.
#![deny(unsafe_code)]
pub mod addresses;
pub mod agent;
pub mod cleanup;
pub mod cli;
pub mod config;
pub mod dataplane;
pub mod diff;
pub mod dump;
pub mod ebpf_object;
pub mod encode;
pub mod endpoints;
pub mod fast_hash;
pub mod health;
pub mod healthcheck;
pub mod http;
pub mod ids;
pub mod incremental;
pub mod kube;
pub mod lc_counts;
pub mod maglev;
pub mod manifests;
pub mod metrics;
pub mod model;
pub mod node_addrs;
pub mod object_version;
pub mod occupancy;
pub mod port_range;
pub mod programmed;
pub mod service_cidrs;
pub mod sizing;
pub mod snapshot;
pub mod snat_gc;
pub mod source;
pub mod source_ranges;
pub mod status;
#[allow(unsafe_code)]
pub mod sys;
pub mod topology;
pub mod translate;
pub mod translate_cache;
