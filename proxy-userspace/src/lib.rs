//! kube-proxy-ebpf agent library: sources → translate (pure) → diff (pure) → apply (maps).
pub mod ebpf_object;
pub mod model;
pub mod programmed;
pub mod snapshot;
pub mod manifests;
pub mod endpoints;
pub mod topology;
pub mod translate;
pub mod ids;
pub mod encode;
pub mod diff;
