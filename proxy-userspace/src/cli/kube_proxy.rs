//! kube-proxy's own command line, accepted as it is: a DaemonSet spec carried over from
//! kube-proxy (its `command:` and `args:`) runs without edits. Every kube-proxy flag parses;
//! those with a meaning here are honoured with kube-proxy's meaning, the others draw one
//! warning each naming why, and none stops the agent. `kube-proxy-ebpf --config FILE` without a
//! subcommand runs like `kube-proxy --config FILE` ([`with_default_subcommand`]).
//!
//! The flags kube-proxy shares with this agent under the same name (`--kubeconfig`,
//! `--hostname-override`, `--cluster-cidr`, `--conntrack-*`, ...) are the agent's own
//! (`RunArgs`); this module holds the rest. As with kube-proxy, `--config` makes the
//! configuration file decide: kube-proxy's flags are then ignored (with a warning), except
//! `--hostname-override` and `--master` (`config::resolve`).

use std::{ffi::OsString, time::Duration};

use super::duration::parse_duration;

/// Subcommands of the agent; a command line naming none of them is `run`'s.
const SUBCOMMANDS: [&str; 5] = ["run", "dump", "cleanup", "mount-bpffs", "help"];

/// `argv` with `run` inserted after the program name when it names no subcommand (and is not a
/// bare `--help`/`--version`): `kube-proxy-ebpf --config f` is `kube-proxy-ebpf run --config f`.
pub fn with_default_subcommand(argv: Vec<OsString>) -> Vec<OsString> {
    let named = argv
        .iter()
        .skip(1)
        .any(|a| a.to_str().is_some_and(|a| SUBCOMMANDS.contains(&a)));
    let info_only = argv.len() == 2
        && argv[1]
            .to_str()
            .is_some_and(|a| ["-h", "--help", "-V", "--version"].contains(&a));
    if named || info_only || argv.len() < 2 {
        return argv;
    }
    let mut out = argv;
    out.insert(1, "run".into());
    out
}

/// kube-proxy's flags that are not also the agent's, hidden from `--help` (see the module doc).
/// Bool flags take `--flag`, `--flag=true` or `--flag=false`, like Go's pflag.
#[derive(Clone, Debug, Default, clap::Args)]
pub struct KubeProxyFlags {
    /// `iptables`, `ipvs`, `nftables` (or `kernelspace`): the datapath is eBPF whatever it says;
    /// it picks which of the `--iptables-*`/`--ipvs-*` sync periods apply.
    #[arg(long, hide = true)]
    pub proxy_mode: Option<String>,
    #[arg(long, hide = true, value_parser = parse_duration)]
    pub iptables_sync_period: Option<Duration>,
    #[arg(long, hide = true, value_parser = parse_duration)]
    pub iptables_min_sync_period: Option<Duration>,
    #[arg(long, hide = true, value_parser = parse_duration)]
    pub ipvs_sync_period: Option<Duration>,
    #[arg(long, hide = true, value_parser = parse_duration)]
    pub ipvs_min_sync_period: Option<Duration>,
    /// The scheduler (`--scheduler`), as IPVS mode's.
    #[arg(long, hide = true)]
    pub ipvs_scheduler: Option<String>,
    /// Port of `--healthz-bind-address` (kube-proxy's older spelling).
    #[arg(long, hide = true)]
    pub healthz_port: Option<u16>,
    /// Port of `--metrics-bind-address`.
    #[arg(long, hide = true)]
    pub metrics_port: Option<u16>,
    /// Written to /proc/self/oom_score_adj at start (kube-proxy's default is -999).
    #[arg(long, hide = true, allow_hyphen_values = true)]
    pub oom_score_adj: Option<i32>,
    /// Sets nf_conntrack's `tcp_be_liberal` (with the other nf_conntrack settings).
    #[arg(long, hide = true, num_args = 0..=1, default_missing_value = "true", require_equals = true)]
    pub conntrack_tcp_be_liberal: Option<bool>,

    // Accepted, and warned about: what each is and why it does nothing here is in `ignored`.
    #[arg(long, hide = true, num_args = 0..=1, default_missing_value = "true", require_equals = true)]
    pub masquerade_all: Option<bool>,
    #[arg(long, hide = true)]
    pub bind_address: Option<String>,
    #[arg(long, hide = true, num_args = 0..=1, default_missing_value = "true", require_equals = true)]
    pub bind_address_hard_fail: Option<bool>,
    #[arg(long, hide = true)]
    pub feature_gates: Option<String>,
    #[arg(long, hide = true)]
    pub kube_api_qps: Option<f64>,
    #[arg(long, hide = true)]
    pub kube_api_burst: Option<i64>,
    #[arg(long, hide = true)]
    pub kube_api_content_type: Option<String>,
    #[arg(long, hide = true, num_args = 0..=1, default_missing_value = "true", require_equals = true)]
    pub profiling: Option<bool>,
    #[arg(long, hide = true)]
    pub pod_bridge_interface: Option<String>,
    #[arg(long, hide = true)]
    pub pod_interface_name_prefix: Option<String>,
    #[arg(long, hide = true)]
    pub config_sync_period: Option<String>,
    /// Writes the node's settings that need privileges (nf_conntrack's) and exits, as
    /// kube-proxy's `--init-only` (the DaemonSet's privileged init container runs it).
    #[arg(long, hide = true, num_args = 0..=1, default_missing_value = "true", require_equals = true)]
    pub init_only: Option<bool>,
    #[arg(long, hide = true)]
    pub write_config_to: Option<String>,
    #[arg(long, hide = true)]
    pub proxy_port_range: Option<String>,
    #[arg(long, hide = true)]
    pub iptables_masquerade_bit: Option<i64>,
    #[arg(long, hide = true, num_args = 0..=1, default_missing_value = "true", require_equals = true)]
    pub iptables_localhost_nodeports: Option<bool>,
    #[arg(long, hide = true)]
    pub ipvs_exclude_cidrs: Option<String>,
    #[arg(long, hide = true, num_args = 0..=1, default_missing_value = "true", require_equals = true)]
    pub ipvs_strict_arp: Option<bool>,
    #[arg(long, hide = true)]
    pub ipvs_tcp_timeout: Option<String>,
    #[arg(long, hide = true)]
    pub ipvs_tcpfin_timeout: Option<String>,
    #[arg(long, hide = true)]
    pub ipvs_udp_timeout: Option<String>,
    #[arg(long, hide = true)]
    pub show_hidden_metrics_for_version: Option<String>,
    #[arg(long, hide = true)]
    pub logging_format: Option<String>,
    #[arg(long, hide = true)]
    pub log_flush_frequency: Option<String>,
    #[arg(long, hide = true)]
    pub vmodule: Option<String>,
    #[arg(long = "log_dir", hide = true)]
    pub log_dir: Option<String>,
    #[arg(long = "log_file", hide = true)]
    pub log_file: Option<String>,
    #[arg(long = "log_file_max_size", hide = true)]
    pub log_file_max_size: Option<String>,
    #[arg(long, hide = true, num_args = 0..=1, default_missing_value = "true", require_equals = true)]
    pub logtostderr: Option<bool>,
    #[arg(long, hide = true, num_args = 0..=1, default_missing_value = "true", require_equals = true)]
    pub alsologtostderr: Option<bool>,
    #[arg(long, hide = true)]
    pub stderrthreshold: Option<String>,
    #[arg(long = "skip_headers", hide = true, num_args = 0..=1, default_missing_value = "true", require_equals = true)]
    pub skip_headers: Option<bool>,
    #[arg(long = "skip_log_headers", hide = true, num_args = 0..=1, default_missing_value = "true", require_equals = true)]
    pub skip_log_headers: Option<bool>,
    #[arg(long = "add_dir_header", hide = true, num_args = 0..=1, default_missing_value = "true", require_equals = true)]
    pub add_dir_header: Option<bool>,
    #[arg(long = "one_output", hide = true, num_args = 0..=1, default_missing_value = "true", require_equals = true)]
    pub one_output: Option<bool>,
    #[arg(long = "log_backtrace_at", hide = true)]
    pub log_backtrace_at: Option<String>,
}

impl KubeProxyFlags {
    /// The given flags that do nothing here, each with why (one warning each).
    pub fn ignored(&self) -> Vec<String> {
        let mut out = Vec::new();
        let mut say = |given: bool, flag: &str, why: &str| {
            if given {
                out.push(format!(
                    "kube-proxy flag --{flag} accepted and ignored: {why}"
                ));
            }
        };
        let masq = self.masquerade_all == Some(true);
        say(
            masq,
            "masquerade-all",
            "not implemented yet: only off-cluster clients and eTP=Cluster external traffic are masqueraded",
        );
        say(
            self.bind_address.is_some() || self.bind_address_hard_fail.is_some(),
            "bind-address",
            "upstream reads it only for the node's primary IP family; this agent serves both families",
        );
        say(
            self.feature_gates.is_some(),
            "feature-gates",
            "the behaviours it would switch are this agent's defaults or not implemented",
        );
        say(
            self.kube_api_qps.is_some() || self.kube_api_burst.is_some(),
            "kube-api-qps/--kube-api-burst",
            "the agent only lists and watches; there is no client-side rate limit to set",
        );
        say(
            self.kube_api_content_type.is_some(),
            "kube-api-content-type",
            "the agent speaks JSON",
        );
        say(
            self.profiling == Some(true),
            "profiling",
            "no pprof endpoint",
        );
        say(
            self.pod_bridge_interface.is_some() || self.pod_interface_name_prefix.is_some(),
            "pod-bridge-interface/--pod-interface-name-prefix",
            "detectLocalMode BridgeInterface and InterfaceNamePrefix are not implemented (ClusterCIDR is)",
        );
        say(
            self.config_sync_period.is_some(),
            "config-sync-period",
            "the watches never resync; the periodic full sync is --sync-period",
        );
        say(
            self.write_config_to.is_some(),
            "write-config-to",
            "not implemented; the agent runs",
        );
        say(
            self.proxy_port_range.is_some(),
            "proxy-port-range",
            "the userspace proxier it served is gone",
        );
        say(
            self.iptables_masquerade_bit.is_some() || self.iptables_localhost_nodeports.is_some(),
            "iptables-masquerade-bit/--iptables-localhost-nodeports",
            "no iptables rules are written (NodePorts are not served on localhost, like nftables mode)",
        );
        say(
            self.ipvs_exclude_cidrs.is_some()
                || self.ipvs_strict_arp.is_some()
                || self.ipvs_tcp_timeout.is_some()
                || self.ipvs_tcpfin_timeout.is_some()
                || self.ipvs_udp_timeout.is_some(),
            "ipvs-*",
            "no IPVS virtual servers exist (the conntrack timeouts are --conntrack-*)",
        );
        say(
            self.show_hidden_metrics_for_version.is_some(),
            "show-hidden-metrics-for-version",
            "no metric is hidden",
        );
        say(
            self.logging_format.as_deref().is_some_and(|f| f != "text"),
            "logging-format",
            "the log is text (RUST_LOG and -v set its level)",
        );
        say(
            self.log_flush_frequency.is_some()
                || self.vmodule.is_some()
                || self.log_dir.is_some()
                || self.log_file.is_some()
                || self.log_file_max_size.is_some()
                || self.logtostderr.is_some()
                || self.alsologtostderr.is_some()
                || self.stderrthreshold.is_some()
                || self.skip_headers.is_some()
                || self.skip_log_headers.is_some()
                || self.add_dir_header.is_some()
                || self.one_output.is_some()
                || self.log_backtrace_at.is_some(),
            "log_* (klog)",
            "the log goes to stderr (RUST_LOG and -v set its level)",
        );
        out
    }

    /// The sync periods the `--iptables-*`/`--ipvs-*` flags of the `--proxy-mode` set
    /// (iptables when none is given: upstream's Linux default), `(period, minimum)`.
    pub fn sync_periods(&self) -> (Option<Duration>, Option<Duration>) {
        match self.proxy_mode.as_deref().map(str::trim) {
            Some("ipvs") => (self.ipvs_sync_period, self.ipvs_min_sync_period),
            Some("nftables") => (None, None),
            _ => (self.iptables_sync_period, self.iptables_min_sync_period),
        }
    }
}

#[cfg(test)]
mod tests {
    use clap::Parser as _;

    use super::*;
    use crate::cli::{Cli, Command};

    fn argv(s: &[&str]) -> Vec<OsString> {
        s.iter().map(OsString::from).collect()
    }

    #[test]
    fn no_subcommand_is_run() {
        assert_eq!(
            with_default_subcommand(argv(&["kpe", "--config", "f"])),
            argv(&["kpe", "run", "--config", "f"])
        );
        assert_eq!(
            with_default_subcommand(argv(&["kpe", "-v", "2", "run"])),
            argv(&["kpe", "-v", "2", "run"])
        );
        assert_eq!(
            with_default_subcommand(argv(&["kpe", "dump", "services"])),
            argv(&["kpe", "dump", "services"])
        );
        assert_eq!(
            with_default_subcommand(argv(&["kpe", "--help"])),
            argv(&["kpe", "--help"])
        );
        assert_eq!(with_default_subcommand(argv(&["kpe"])), argv(&["kpe"]));
    }

    /// Every subcommand the CLI declares is one `with_default_subcommand` leaves alone.
    #[test]
    fn every_subcommand_is_known_as_one() {
        use clap::CommandFactory as _;
        for sub in Cli::command().get_subcommands() {
            assert!(SUBCOMMANDS.contains(&sub.get_name()), "{}", sub.get_name());
        }
        let line = with_default_subcommand(argv(&["kpe", "mount-bpffs", "/sys/fs/bpf"]));
        let cli = Cli::try_parse_from(line).expect("mount-bpffs parses");
        assert!(
            matches!(cli.command, Command::MountBpffs(ref a) if a.dir == std::path::Path::new("/sys/fs/bpf"))
        );
    }

    /// A kubeadm kube-proxy DaemonSet's command line, and more of kube-proxy's flags.
    #[test]
    fn kube_proxy_s_command_line_parses_and_says_what_it_ignores() {
        let line = [
            "/usr/local/bin/kube-proxy",
            "--config=/var/lib/kube-proxy/config.conf",
            "--hostname-override=node-1",
            "--proxy-mode=ipvs",
            "--ipvs-scheduler=lc",
            "--ipvs-sync-period=20s",
            "--ipvs-min-sync-period",
            "2s",
            "--masquerade-all",
            "--bind-address=0.0.0.0",
            "--feature-gates=SomeGate=true",
            "--oom-score-adj=-999",
            "--kube-api-qps=20",
            "--kube-api-burst",
            "30",
            "--profiling=false",
            "--healthz-port=10257",
            "--metrics-port=10250",
            "--pod-interface-name-prefix=veth",
            "--conntrack-tcp-be-liberal",
            "--logging-format=json",
            "--alsologtostderr",
            "--log_file=/tmp/x",
            "-v=4",
        ];
        let cli = Cli::try_parse_from(with_default_subcommand(argv(&line)))
            .unwrap_or_else(|e| panic!("{e}"));
        let Command::Run(run) = cli.command else {
            panic!("run")
        };
        assert_eq!(cli.verbosity, 4);
        let k = &run.kube_proxy;
        assert_eq!(
            k.sync_periods(),
            (Some(Duration::from_secs(20)), Some(Duration::from_secs(2)))
        );
        assert_eq!(k.ipvs_scheduler.as_deref(), Some("lc"));
        assert_eq!(k.oom_score_adj, Some(-999));
        assert_eq!((k.healthz_port, k.metrics_port), (Some(10257), Some(10250)));
        assert_eq!(k.conntrack_tcp_be_liberal, Some(true));
        let ignored = k.ignored();
        for flag in [
            "--masquerade-all",
            "--bind-address",
            "--feature-gates",
            "--kube-api-qps",
            "--pod-bridge-interface",
            "--logging-format",
            "--log_* (klog)",
        ] {
            assert!(
                ignored.iter().any(|w| w.contains(flag)),
                "{flag} not named in {ignored:?}"
            );
        }
        assert!(
            !ignored.iter().any(|w| w.contains("--profiling")),
            "--profiling=false asks for nothing"
        );
    }
}
