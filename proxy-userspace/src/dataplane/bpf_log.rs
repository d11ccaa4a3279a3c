//! The opt-in datapath trace (`run --bpf-log LEVEL`, off by default): the level written into the
//! eBPF object before it is loaded (`proxy_common::bpf_log`), and the task that carries the
//! programs' aya-log records into this process's `tracing` (target `kube_proxy_ebpf::datapath`).
//!
//! Owns: the level type and its mapping, the logger task. Calls: aya/aya-log and tokio only.
//!
//! Off costs nothing: the level is a frozen `.rodata` global, so the verifier removes every log
//! call of the programs, no logger is created and the ring buffer stays empty. The ring buffer
//! (`AYA_LOGS`) is never pinned: each load has its own, read by that agent's task; the pinned maps
//! adopted across restarts are unaffected.

use aya::Ebpf;
use aya_log::EbpfLogger;
use proxy_common::bpf_log;
use tokio::io::{Interest, unix::AsyncFd};

use super::{Error, Result};

/// `--bpf-log`: how much the datapath logs (aya-log levels).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, clap::ValueEnum)]
pub enum BpfLog {
    /// Nothing (the default): the log calls are removed at load.
    #[default]
    Off,
    /// Faults of the datapath itself (none logged yet).
    Error,
    /// Flows dropped for want of resources (SNAT ports).
    Warn,
    /// New flows refused: outside loadBalancerSourceRanges, no (local) endpoints, a reset to a
    /// gone backend.
    Info,
    /// Once per flow: its translation (client → frontend → backend, scheduler), affinity hits,
    /// socket-hook rewrites, the first reply.
    Debug,
    /// Per packet: every reverse-NATed reply and every egress packet without conntrack entry.
    /// Costly under load; for a few flows.
    Trace,
}

impl BpfLog {
    /// The value of the object's `BPF_LOG_LEVEL` global.
    pub const fn code(self) -> u8 {
        match self {
            BpfLog::Off => bpf_log::OFF,
            BpfLog::Error => bpf_log::ERROR,
            BpfLog::Warn => bpf_log::WARN,
            BpfLog::Info => bpf_log::INFO,
            BpfLog::Debug => bpf_log::DEBUG,
            BpfLog::Trace => bpf_log::TRACE,
        }
    }

    /// The `tracing` filter directive that lets the datapath's records through at this level
    /// (the agent's own default filter is `info`); `None` when off.
    pub fn filter_directive(self) -> Option<String> {
        let level = match self {
            BpfLog::Off => return None,
            BpfLog::Error => "error",
            BpfLog::Warn => "warn",
            BpfLog::Info => "info",
            BpfLog::Debug => "debug",
            BpfLog::Trace => "trace",
        };
        Some(format!("{}={level}", bpf_log::TARGET))
    }
}

/// Starts the task that forwards the datapath's records of `ebpf` (loaded with `level`) to
/// `tracing`, on the current tokio runtime; nothing when off. It takes the ring buffer out of
/// `ebpf` and owns it; the programs keep their own reference, so the task may end at any time.
pub fn spawn_logger(ebpf: &mut Ebpf, level: BpfLog) -> Result<()> {
    if level == BpfLog::Off {
        return Ok(());
    }
    let logger = EbpfLogger::init(ebpf)?;
    // SAFETY: the fd is the ring buffer's, owned by `logger`, which the AsyncFd owns in turn:
    // it stays open and the same for the AsyncFd's whole life.
    let mut ready = unsafe { AsyncFd::register_with_interest(logger, Interest::READABLE) }
        .map_err(|e| Error::Io {
            what: "watching the datapath log's ring buffer".into(),
            source: e.into_parts().1,
        })?;
    tracing::info!(
        level = ?level,
        log_target = bpf_log::TARGET,
        "datapath trace on (--bpf-log)"
    );
    tokio::spawn(async move {
        loop {
            let mut guard = match ready.readable_mut().await {
                Ok(guard) => guard,
                Err(e) => {
                    tracing::warn!(
                        "datapath log: waiting on the ring buffer failed: {e}; no more datapath records"
                    );
                    return;
                }
            };
            // Every record written so far; the next readiness brings the rest.
            guard.get_inner_mut().flush();
            guard.clear_ready();
            // One drain at a time: a burst (trace under load) does not hold up the sync loop.
            tokio::task::yield_now().await;
        }
    });
    Ok(())
}

#[cfg(test)]
mod tests {
    use clap::ValueEnum as _;

    use super::*;

    #[test]
    fn levels_map_to_aya_log_numbers_and_filter_directives() {
        let all: Vec<(BpfLog, u8, Option<&str>)> = vec![
            (BpfLog::Off, 0, None),
            (BpfLog::Error, 1, Some("kube_proxy_ebpf::datapath=error")),
            (BpfLog::Warn, 2, Some("kube_proxy_ebpf::datapath=warn")),
            (BpfLog::Info, 3, Some("kube_proxy_ebpf::datapath=info")),
            (BpfLog::Debug, 4, Some("kube_proxy_ebpf::datapath=debug")),
            (BpfLog::Trace, 5, Some("kube_proxy_ebpf::datapath=trace")),
        ];
        assert_eq!(all.len(), BpfLog::value_variants().len());
        for (level, code, directive) in all {
            assert_eq!(level.code(), code, "{level:?}");
            assert_eq!(level.filter_directive().as_deref(), directive, "{level:?}");
        }
        // aya-log's own numbering, which the eBPF side's records carry.
        assert_eq!(BpfLog::Error.code(), aya_log::Level::Error as u8);
        assert_eq!(BpfLog::Trace.code(), aya_log::Level::Trace as u8);
    }

    #[test]
    fn the_log_ring_is_in_the_object_and_never_pinned() {
        let obj =
            aya_obj::Object::parse(crate::dataplane::ebpf_object::EBPF_OBJECT).expect("parse");
        assert!(obj.maps.contains_key("AYA_LOGS"), "aya-log's ring buffer");
        assert!(
            !proxy_common::ALL_MAPS.contains(&"AYA_LOGS"),
            "a pinned ring would be adopted by the next agent, whose task reads its own"
        );
    }
}
