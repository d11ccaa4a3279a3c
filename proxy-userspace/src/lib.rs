//! kube-proxy-ebpf agent library: sources → translate (pure) → diff (pure) → apply (maps).
pub mod ebpf_object;
pub mod model;
pub mod programmed;
