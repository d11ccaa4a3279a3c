//! The node's nf_conntrack settings that kube-proxy writes at start (its `conntrack` block):
//! netfilter keeps tracking the node's traffic that is not a Service's, and what users and the
//! e2e suite (`KubeProxy should set TCP CLOSE_WAIT timeout`) read there must be what kube-proxy
//! would have set.
//!
//! - `nf_conntrack_max` = max(maxPerCore × CPUs, min) when that is more than the node has, and
//!   the module's `hashsize` to a quarter of it when smaller (upstream never shrinks either).
//!   Both are the host's alone: they are written only where `nf_conntrack_max` is writable,
//!   i.e. in the host's network namespace, never from a namespace of a test.
//! - `nf_conntrack_tcp_timeout_established`, `_close_wait`, `_udp_timeout`,
//!   `_udp_timeout_stream`: when the setting is not 0 (0 leaves the kernel's value, as upstream).
//! - `nf_conntrack_tcp_be_liberal` = 1 when asked (`--conntrack-tcp-be-liberal`,
//!   `conntrack.tcpBeLiberal`).
//!
//! A value already in place is not written again. The agent's container has a read-only
//! /proc/sys, so the DaemonSet's privileged init container writes them
//! (`kube-proxy-ebpf --init-only`, kube-proxy's own flag for this); the agent checks them again
//! at start and names any that differ. Which values is pure ([`wanted`]); the files are the IO
//! edge.

use std::{path::PathBuf, time::Duration};

/// `/proc/sys/net/netfilter`, for this process's network namespace.
const SYSCTL_DIR: &str = "/proc/sys/net/netfilter";
const HASHSIZE: &str = "/sys/module/nf_conntrack/parameters/hashsize";

/// What kube-proxy's `conntrack` block asks of netfilter.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Conntrack {
    /// maxPerCore × CPUs, floor min; 0 = leave it.
    pub max: u64,
    pub tcp_established: Duration,
    pub tcp_close_wait: Duration,
    pub udp: Duration,
    pub udp_stream: Duration,
    pub tcp_be_liberal: bool,
}

/// How a setting is compared with what is there.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Rule {
    /// Written unless equal.
    Exact,
    /// Written only to raise it.
    AtLeast,
}

/// One value for one file.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Setting {
    pub path: PathBuf,
    pub value: u64,
    pub rule: Rule,
}

/// Pure: the settings `c` asks for (see the module doc), in upstream's order.
pub fn wanted(c: &Conntrack) -> Vec<Setting> {
    let sysctl = |name: &str, value: u64, rule| Setting {
        path: PathBuf::from(SYSCTL_DIR).join(name),
        value,
        rule,
    };
    let mut out = Vec::new();
    if c.max > 0 {
        out.push(sysctl("nf_conntrack_max", c.max, Rule::AtLeast));
        out.push(Setting {
            path: PathBuf::from(HASHSIZE),
            value: (c.max / 4).max(1),
            rule: Rule::AtLeast,
        });
    }
    for (name, d) in [
        ("nf_conntrack_tcp_timeout_established", c.tcp_established),
        ("nf_conntrack_tcp_timeout_close_wait", c.tcp_close_wait),
        ("nf_conntrack_udp_timeout", c.udp),
        ("nf_conntrack_udp_timeout_stream", c.udp_stream),
    ] {
        if !d.is_zero() {
            out.push(sysctl(name, d.as_secs(), Rule::Exact));
        }
    }
    if c.tcp_be_liberal {
        out.push(sysctl("nf_conntrack_tcp_be_liberal", 1, Rule::Exact));
    }
    out
}

/// What [`apply`] did with each setting.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Report {
    pub written: Vec<(PathBuf, u64)>,
    pub in_place: usize,
    /// Not written: the host's alone (this is a child network namespace).
    pub host_only: usize,
    pub failed: Vec<(PathBuf, String)>,
}

/// Writes the settings that are not in place yet.
pub fn apply(settings: &[Setting]) -> Report {
    let mut report = Report::default();
    let max = PathBuf::from(SYSCTL_DIR).join("nf_conntrack_max");
    // nf_conntrack_max is read-only outside the host's namespace; the hashsize is the module's.
    let in_host_netns = std::fs::OpenOptions::new().write(true).open(&max).is_ok();
    for s in settings {
        if (s.path == max || s.path.starts_with("/sys/module")) && !in_host_netns {
            report.host_only += 1;
            continue;
        }
        let current = std::fs::read_to_string(&s.path)
            .ok()
            .and_then(|t| t.trim().parse::<u64>().ok());
        let in_place = match (s.rule, current) {
            (Rule::Exact, Some(c)) => c == s.value,
            (Rule::AtLeast, Some(c)) => c >= s.value,
            (_, None) => false,
        };
        if in_place {
            report.in_place += 1;
            continue;
        }
        match std::fs::write(&s.path, format!("{}\n", s.value)) {
            Ok(()) => report.written.push((s.path.clone(), s.value)),
            Err(e) => report.failed.push((s.path.clone(), e.to_string())),
        }
    }
    report
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn upstream_s_settings_zero_leaves_the_kernel_s() {
        let c = Conntrack {
            max: 131_072,
            tcp_established: Duration::from_secs(86_400),
            tcp_close_wait: Duration::from_secs(3_600),
            udp: Duration::ZERO,
            udp_stream: Duration::from_secs(120),
            tcp_be_liberal: true,
        };
        let got: Vec<(String, u64, Rule)> = wanted(&c)
            .into_iter()
            .map(|s| (s.path.display().to_string(), s.value, s.rule))
            .collect();
        let n = |x: &str| format!("{SYSCTL_DIR}/{x}");
        assert_eq!(
            got,
            vec![
                (n("nf_conntrack_max"), 131_072, Rule::AtLeast),
                (HASHSIZE.into(), 32_768, Rule::AtLeast),
                (
                    n("nf_conntrack_tcp_timeout_established"),
                    86_400,
                    Rule::Exact
                ),
                (n("nf_conntrack_tcp_timeout_close_wait"), 3_600, Rule::Exact),
                (n("nf_conntrack_udp_timeout_stream"), 120, Rule::Exact),
                (n("nf_conntrack_tcp_be_liberal"), 1, Rule::Exact),
            ]
        );
        assert!(wanted(&Conntrack::default()).is_empty());
    }

    #[test]
    fn values_in_place_are_left_others_written_missing_files_fail() {
        let dir = std::env::temp_dir().join(format!("kpe-nfct-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("dir");
        let file = |n: &str, v: &str| {
            let p = dir.join(n);
            std::fs::write(&p, v).expect("write");
            p
        };
        let same = file("same", "60\n");
        let raise = file("raise", "10\n");
        let bigger = file("bigger", "500\n");
        let settings = [
            Setting {
                path: same,
                value: 60,
                rule: Rule::Exact,
            },
            Setting {
                path: raise.clone(),
                value: 100,
                rule: Rule::AtLeast,
            },
            Setting {
                path: bigger,
                value: 100,
                rule: Rule::AtLeast,
            },
            Setting {
                path: dir.join("sub/missing"),
                value: 1,
                rule: Rule::Exact,
            },
        ];
        let r = apply(&settings);
        assert_eq!(r.written, vec![(raise.clone(), 100)]);
        assert_eq!(r.in_place, 2);
        assert_eq!(r.failed.len(), 1);
        assert_eq!(std::fs::read_to_string(&raise).expect("read"), "100\n");
        std::fs::remove_dir_all(&dir).expect("cleanup");
    }
}
