//! The IO edge towards the kernel: loading the eBPF object with pinned maps, the map layer that
//! carries out `MapOp`s, attaching programs to interfaces (TCX links, pinned and adopted across
//! restarts), the netlink watch for interfaces that appear later, the node's addresses, the
//! LPM tries reconciled as sets (source ranges, Service CIDRs), map sizing and occupancy, and
//! the garbage collection of conntrack, SNAT and least-connection counts.
//!
//! May call: `pipeline` (the map operations, model and encoding it carries out), `serving`
//! (health state, metrics and health-check servers it reports into). Never `sources` or `cli`.

pub mod attach;
#[allow(unsafe_code)]
pub mod batch;
#[allow(unsafe_code)]
pub mod bpf_log;
pub mod bpffs;
pub mod clock;
#[allow(unsafe_code)]
pub mod ct_netlink;
pub mod devices;
pub mod ebpf_object;
pub mod flow_gc;
pub mod frontend_gen;
pub mod interfaces;
pub mod kube_proxy_rules;
pub mod layout;
pub mod lc_counts;
#[allow(unsafe_code)]
pub mod link_sys;
pub mod links;
pub mod loader;
pub mod maps;
pub mod netlink;
pub mod nf_conntrack;
pub mod node_addrs;
pub mod occupancy;
pub mod pin_keeper;
pub mod pin_lock;
pub mod port_range;
pub mod presence;
pub mod program_pins;
pub mod service_cidrs;
pub mod sizing;
pub mod snat_gc;
pub mod sock_hooks;
pub mod sock_lb;
pub mod source_ranges;
#[allow(unsafe_code)]
pub mod sys;
pub mod takeover;

use std::{io, path::PathBuf};

/// Errors at the kernel boundary. Each says what failed and on what, so the operator can act.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error(
        "{path} is not on a bpffs: mount it with `mount -t bpf bpf /sys/fs/bpf` (a DaemonSet mounts the host's /sys/fs/bpf)"
    )]
    NotBpffs { path: PathBuf },
    #[error("cannot create pin directory {path}: {source}")]
    PinDir { path: PathBuf, source: io::Error },
    #[error("loading the eBPF object failed: {0}")]
    Load(#[from] aya::EbpfError),
    #[error("eBPF program {name}: {source}")]
    Program {
        name: &'static str,
        source: aya::programs::ProgramError,
    },
    #[error("the eBPF object has no {what} named {name}")]
    Missing {
        what: &'static str,
        name: &'static str,
    },
    #[error("map {name}: {source}")]
    Map {
        name: &'static str,
        source: aya::maps::MapError,
    },
    #[error("attaching {program} to {interface}: {source}")]
    Attach {
        interface: String,
        program: &'static str,
        source: aya::programs::ProgramError,
    },
    #[error("pinning link {path}: {source}")]
    PinLink {
        path: PathBuf,
        source: aya::pin::PinError,
    },
    #[error("link {path}: {source}")]
    Link {
        path: PathBuf,
        source: aya::programs::links::LinkError,
    },
    #[error("{what}: {source}")]
    Io { what: String, source: io::Error },
    #[error(
        "the pinned maps under {dir} are of map layout {found} (usable by agents of layout \
         {oldest_reader} and later), and this agent knows layouts up to {known}: a newer release \
         pinned them. Run that release, or remove its pins with `kube-proxy-ebpf cleanup \
         --pin-dir {dir}` (every flow is dropped; the Services are programmed again from the \
         source) and start this one"
    )]
    NewerLayout {
        dir: PathBuf,
        found: u32,
        oldest_reader: u32,
        known: u32,
    },
    #[error("map layout: {what}")]
    Layout { what: String },
    #[error("the datapath log (--bpf-log): {0}")]
    BpfLog(#[from] aya_log::Error),
}

pub type Result<T, E = Error> = std::result::Result<T, E>;
