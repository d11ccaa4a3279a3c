//! kube-proxy-ebpf agent library: sources → translate (pure) → diff (pure) → apply (maps).
pub mod agent;
pub mod cleanup;
pub mod cli;
pub mod dataplane;
pub mod diff;
pub mod dump;
pub mod ebpf_object;
pub mod encode;
pub mod endpoints;
pub mod ids;
pub mod manifests;
pub mod model;
pub mod programmed;
pub mod snapshot;
pub mod status;
pub mod topology;
pub mod translate;
