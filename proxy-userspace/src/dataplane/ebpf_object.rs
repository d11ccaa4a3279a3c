//! The eBPF object built by build.rs (aya-build) and embedded in the binary.

/// Bytes of the proxy-ebpf ELF object, aligned for aya's parser.
pub static EBPF_OBJECT: &[u8] =
    aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/proxy-ebpf"));
