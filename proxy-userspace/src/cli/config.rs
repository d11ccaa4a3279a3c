//! `--config FILE`: upstream kube-proxy's `KubeProxyConfiguration`
//! (`kubeproxy.config.k8s.io/v1alpha1`), parsed, validated and merged under the flags.
//!
//! Pure apart from [`load`]. Rules, as upstream kube-proxy applies them:
//! - kube-proxy's own flags for settings the file holds are ignored when the file is given, as
//!   upstream (only `--hostname-override` and `--master` override it: [`FILE_DECIDES`]); this
//!   agent's own flags win over the file, and the file wins over flag defaults.
//! - Empty strings and zero durations in the file mean "default", as upstream's defaulting does
//!   (kubeadm writes `syncPeriod: 0s`, `udpTimeout: 0s`, `hostnameOverride: ""`).
//! - A bad value is an error naming the file and the field. An unknown field is a warning that
//!   says it is probably a typo; an upstream field this proxy does not implement is a warning
//!   when it is set to something other than its zero value (so a kubeadm ConfigMap is quiet).
//! - `mode` may be `""`, `iptables`, `nftables` or `ipvs`: syncPeriod/minSyncPeriod are read from
//!   that mode's block (`""` means `iptables`, upstream's default on Linux). The datapath is eBPF
//!   whatever the mode says.

use std::{
    collections::BTreeSet,
    net::IpAddr,
    path::{Path, PathBuf},
    str::FromStr,
    time::Duration,
};

use clap::parser::{ArgMatches, ValueSource};
use proxy_common::{Scheduler, sched::SCHEDULER_NAMES};
use serde_json::Value;

use crate::{
    cli::{DetectLocalMode, RunArgs, parse_duration},
    pipeline::addresses::{BindAddress, Cidr, HEALTHZ_PORT, METRICS_PORT, NodePortAddresses},
};

pub const API_VERSION: &str = "kubeproxy.config.k8s.io/v1alpha1";
pub const KIND: &str = "KubeProxyConfiguration";

/// Why a configuration file was rejected. Each message names the file and the field.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("{file}: cannot read: {source}")]
    Read {
        file: String,
        source: std::io::Error,
    },
    /// `message` ends with the line and column.
    #[error("{file}: not valid YAML: {message}")]
    Yaml { file: String, message: String },
    #[error("{file}: {field}: {reason}")]
    Field {
        file: String,
        field: String,
        reason: String,
    },
    #[error("{what}: {reason}")]
    Merged { what: String, reason: String },
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

/// The upstream proxy mode named in the file. Only decides which block's sync periods apply.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Mode {
    /// `""`: upstream's Linux default, iptables.
    #[default]
    Default,
    Iptables,
    Nftables,
    Ipvs,
}

impl Mode {
    /// The block holding this mode's syncPeriod/minSyncPeriod.
    pub fn block(self) -> &'static str {
        match self {
            Self::Default | Self::Iptables => "iptables",
            Self::Nftables => "nftables",
            Self::Ipvs => "ipvs",
        }
    }
}

/// How upstream tells traffic from local pods (masquerading, and the short-circuit of
/// externalTrafficPolicy Local frontends for in-cluster clients).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum DetectLocal {
    ClusterCidr,
    NodeCidr,
    BridgeInterface(String),
    InterfaceNamePrefix(String),
}

impl DetectLocal {
    /// The mode, without its interface setting.
    pub fn mode(&self) -> DetectLocalMode {
        match self {
            Self::ClusterCidr => DetectLocalMode::ClusterCidr,
            Self::NodeCidr => DetectLocalMode::NodeCidr,
            Self::BridgeInterface(_) => DetectLocalMode::BridgeInterface,
            Self::InterfaceNamePrefix(_) => DetectLocalMode::InterfaceNamePrefix,
        }
    }
}

/// The IPv6 prefixes of `cidrs` the datapath treats as in-cluster sources (`CLUSTERCIDRS6_V1`,
/// an LPM trie: no count limit), under the same mode rule as [`in_cluster_prefixes`].
pub fn in_cluster_prefixes6(
    mode: DetectLocalMode,
    cidrs: &[Cidr],
) -> Vec<(std::net::Ipv6Addr, u8)> {
    if mode != DetectLocalMode::ClusterCidr {
        return Vec::new();
    }
    (cidrs.iter())
        .filter_map(|c| match c.addr {
            IpAddr::V6(a) => Some((a, c.prefix_len)),
            IpAddr::V4(_) => None,
        })
        .collect()
}

/// The IPv4 prefixes the datapath treats as in-cluster sources, and what to tell the operator.
/// Upstream: detectLocalMode ClusterCIDR without a clusterCIDR detects nothing (no
/// short-circuit); this proxy implements only the ClusterCIDR mode, the others detect nothing.
pub fn in_cluster_prefixes(
    mode: DetectLocalMode,
    cidrs: &[Cidr],
) -> (Vec<(std::net::Ipv4Addr, u8)>, Vec<String>) {
    let mut messages = Vec::new();
    if mode != DetectLocalMode::ClusterCidr {
        messages.push(format!(
            "detectLocalMode {mode} is not implemented: no client counts as in-cluster, so pods \
             reach externalTrafficPolicy Local frontends like external clients (dropped on nodes \
             without a local endpoint); use ClusterCIDR with --cluster-cidr"
        ));
        return (Vec::new(), messages);
    }
    let v4: Vec<(std::net::Ipv4Addr, u8)> = cidrs
        .iter()
        .filter_map(|c| match c.addr {
            IpAddr::V4(a) => Some((a, c.prefix_len)),
            IpAddr::V6(_) => None,
        })
        .collect();
    if v4.len() > proxy_common::MAX_CLUSTER_CIDRS {
        messages.push(format!(
            "clusterCIDR: only the first {} IPv4 prefixes are used to tell in-cluster clients",
            proxy_common::MAX_CLUSTER_CIDRS
        ));
    }
    (
        v4.into_iter()
            .take(proxy_common::MAX_CLUSTER_CIDRS)
            .collect(),
        messages,
    )
}

/// What a KubeProxyConfiguration file sets. `None`/empty: not set (the flag or its default
/// applies).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct FileConfig {
    /// `conntrack.tcpBeLiberal` (netfilter's `nf_conntrack_tcp_be_liberal`).
    pub conntrack_tcp_be_liberal: Option<bool>,
    pub bind_address: Option<IpAddr>,
    pub healthz_bind_address: Option<BindAddress>,
    pub metrics_bind_address: Option<BindAddress>,
    pub hostname_override: Option<String>,
    pub kubeconfig: Option<PathBuf>,
    pub cluster_cidrs: Vec<Cidr>,
    pub node_port_addresses: Option<NodePortAddresses>,
    pub mode: Mode,
    pub sync_period: Option<Duration>,
    pub min_sync_period: Option<Duration>,
    /// Conntrack timeouts: `Some(0)` is kept (upstream: "leave the kernel's value").
    pub conntrack_udp_timeout: Option<Duration>,
    pub conntrack_udp_stream_timeout: Option<Duration>,
    pub conntrack_tcp_established_timeout: Option<Duration>,
    pub conntrack_tcp_close_wait_timeout: Option<Duration>,
    /// `conntrack.maxPerCore` / `conntrack.min`: the flow table's size (see [`crate::dataplane::sizing`]).
    pub conntrack_max_per_core: Option<u32>,
    pub conntrack_min: Option<u32>,
    pub detect_local: Option<DetectLocal>,
    /// `ipvs.scheduler`, read whatever the mode (users carry it over from IPVS mode).
    pub scheduler: Option<Scheduler>,
}

/// A parsed file and what to tell the operator about it.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Parsed {
    pub config: FileConfig,
    /// Unknown fields and ignored upstream settings, one sentence each, prefixed by the field.
    pub warnings: Vec<String>,
    /// Settings accepted but with a note on what they do here (mode, detectLocalMode, ...).
    pub notes: Vec<String>,
}

/// Reads and parses `path`.
pub fn load(path: &Path) -> Result<Parsed> {
    let file = path.display().to_string();
    let text = std::fs::read_to_string(path).map_err(|source| Error::Read {
        file: file.clone(),
        source,
    })?;
    parse(&file, &text)
}

/// Upstream fields this proxy does not implement, per block ("" = top level). Set to anything
/// but their zero value, they draw a warning that they are ignored.
const UNSUPPORTED: &[(&str, &[&str])] = &[
    (
        "",
        &[
            "featureGates",
            "bindAddressHardFail",
            "enableProfiling",
            "showHiddenMetricsForVersion",
            "oomScoreAdj",
            "configSyncPeriod",
            "portRange",
            "udpIdleTimeout",
            "logging",
            "winkernel",
            "windowsRunAsService",
        ],
    ),
    (
        "clientConnection",
        &["acceptContentTypes", "contentType", "qps", "burst"],
    ),
    (
        "iptables",
        &["masqueradeAll", "masqueradeBit", "localhostNodePorts"],
    ),
    ("nftables", &["masqueradeAll", "masqueradeBit"]),
    (
        "ipvs",
        &[
            "excludeCIDRs",
            "strictARP",
            "tcpTimeout",
            "tcpFinTimeout",
            "udpTimeout",
        ],
    ),
];

fn unsupported(block: &str, field: &str) -> bool {
    UNSUPPORTED
        .iter()
        .any(|(b, fields)| *b == block && fields.contains(&field))
}

/// Null, false, 0, "", "0s", or a collection of such: what defaulting writes for "unset".
fn is_zero(v: &Value) -> bool {
    match v {
        Value::Null => true,
        Value::Bool(b) => !b,
        Value::Number(n) => n.as_f64() == Some(0.0),
        Value::String(s) => {
            s.is_empty() || parse_duration(s) == Ok(Duration::ZERO) || s.parse() == Ok(0.0)
        }
        Value::Array(s) => s.iter().all(is_zero),
        Value::Object(m) => m.values().all(is_zero),
    }
}

struct Walker<'a> {
    file: &'a str,
    out: Parsed,
}

impl Walker<'_> {
    fn err(&self, field: &str, reason: impl Into<String>) -> Error {
        Error::Field {
            file: self.file.to_owned(),
            field: field.to_owned(),
            reason: reason.into(),
        }
    }

    fn warn(&mut self, field: &str, what: &str) {
        self.out
            .warnings
            .push(format!("{}: {field}: {what}", self.file));
    }

    /// The string entries of a mapping (`null` reads as an empty mapping).
    fn mapping<'v>(&self, field: &str, v: &'v Value) -> Result<Vec<(String, &'v Value)>> {
        match v {
            Value::Null => Ok(Vec::new()),
            Value::Object(m) => Ok(m.iter().map(|(k, v)| (k.clone(), v)).collect()),
            _ => Err(self.err(field, "expected a mapping")),
        }
    }

    /// A string; `null` and `""` read as unset.
    fn string(&self, field: &str, v: &Value) -> Result<Option<String>> {
        match v {
            Value::Null => Ok(None),
            Value::String(s) if s.trim().is_empty() => Ok(None),
            Value::String(s) => Ok(Some(s.trim().to_owned())),
            _ => Err(self.err(field, format!("expected a string, found {}", show(v)))),
        }
    }

    /// A Go duration string; `null`, `""` and zero read as unset (upstream's defaulting).
    fn duration(&self, field: &str, v: &Value) -> Result<Option<Duration>> {
        Ok(self.duration_or_zero(field, v)?.filter(|d| !d.is_zero()))
    }

    /// A Go duration string; `null` and `""` read as unset, zero is kept.
    fn duration_or_zero(&self, field: &str, v: &Value) -> Result<Option<Duration>> {
        let Some(s) = self.string(field, v)? else {
            return Ok(None);
        };
        parse_duration(&s).map(Some).map_err(|e| self.err(field, e))
    }

    /// A boolean; `null` reads as unset.
    fn boolean(&self, field: &str, v: &Value) -> Result<Option<bool>> {
        match v {
            Value::Null => Ok(None),
            Value::Bool(b) => Ok(Some(*b)),
            _ => Err(self.err(field, format!("expected true or false, found {}", show(v)))),
        }
    }

    /// An int32 that must not be negative; `null` reads as unset.
    fn count(&self, field: &str, v: &Value) -> Result<Option<u32>> {
        match v {
            Value::Null => Ok(None),
            Value::Number(n) => n
                .as_u64()
                .and_then(|n| u32::try_from(n).ok())
                .filter(|n| i32::try_from(*n).is_ok())
                .map(Some)
                .ok_or_else(|| self.err(field, format!("{n} is not a count from 0 to 2147483647"))),
            _ => Err(self.err(field, format!("expected a number, found {}", show(v)))),
        }
    }

    fn string_list(&self, field: &str, v: &Value) -> Result<Vec<String>> {
        match v {
            Value::Null => Ok(Vec::new()),
            Value::Array(items) => items
                .iter()
                .enumerate()
                .map(|(i, item)| {
                    self.string(&format!("{field}[{i}]"), item)
                        .map(Option::unwrap_or_default)
                })
                .collect(),
            _ => Err(self.err(field, "expected a list of strings")),
        }
    }

    /// Warns about `key` in `block`: unknown (likely a typo) or an upstream setting ignored here.
    fn other(&mut self, block: &str, key: &str, v: &Value) {
        let field = if block.is_empty() {
            key.to_owned()
        } else {
            format!("{block}.{key}")
        };
        if unsupported(block, key) {
            if !is_zero(v) {
                self.warn(
                    &field,
                    &format!(
                        "set to {} but not supported by kube-proxy-ebpf; ignored",
                        show(v)
                    ),
                );
            }
        } else {
            self.warn(
                &field,
                "unknown field (not part of KubeProxyConfiguration v1alpha1; a typo?); ignored",
            );
        }
    }

    fn top(&mut self, root: &Value) -> Result<()> {
        let entries = self.mapping("(document)", root)?;
        let get = |name: &str| entries.iter().find(|(k, _)| k == name).map(|(_, v)| *v);
        let api_version = get("apiVersion").map(|v| self.string("apiVersion", v));
        match api_version.transpose()?.flatten() {
            Some(v) if v == API_VERSION => {}
            Some(v) => {
                return Err(self.err(
                    "apiVersion",
                    format!("{v:?} is not supported; use {API_VERSION}"),
                ));
            }
            None => return Err(self.err("apiVersion", format!("missing; use {API_VERSION}"))),
        }
        match get("kind")
            .map(|v| self.string("kind", v))
            .transpose()?
            .flatten()
        {
            Some(k) if k == KIND => {}
            other => {
                return Err(self.err("kind", format!("{other:?}: expected {KIND:?}")));
            }
        }
        // The mode first: it says which block's sync periods count.
        if let Some(v) = get("mode") {
            self.out.config.mode = match self.string("mode", v)?.as_deref() {
                None => Mode::Default,
                Some("iptables") => Mode::Iptables,
                Some("nftables") => Mode::Nftables,
                Some("ipvs") => Mode::Ipvs,
                Some(other) => {
                    return Err(self.err(
                        "mode",
                        format!(
                            "{other:?} is not a Linux proxy mode; use \"\", iptables, nftables or ipvs"
                        ),
                    ));
                }
            };
        }
        let mode = self.out.config.mode;
        self.out.notes.push(format!(
            "{}: mode: {:?} read as \"use the {} block's syncPeriod/minSyncPeriod\"; the datapath is eBPF in every mode",
            self.file,
            match mode {
                Mode::Default => "",
                m => m.block(),
            },
            mode.block()
        ));
        let mut detect_local_mode = None;
        let mut detect_local_block = Vec::new();
        for (key, v) in &entries {
            match key.as_str() {
                "apiVersion" | "kind" | "mode" => {}
                "bindAddress" => {
                    if let Some(s) = self.string(key, v)? {
                        let ip = IpAddr::from_str(&s)
                            .map_err(|_| self.err(key, format!("invalid IP address {s:?}")))?;
                        self.out.config.bind_address = Some(ip);
                    }
                }
                "healthzBindAddress" | "metricsBindAddress" => {
                    if let Some(s) = self.string(key, v)? {
                        let port = if key == "healthzBindAddress" {
                            HEALTHZ_PORT
                        } else {
                            METRICS_PORT
                        };
                        let b = BindAddress::parse(&s, port).map_err(|e| self.err(key, e))?;
                        let c = &mut self.out.config;
                        if key == "healthzBindAddress" {
                            c.healthz_bind_address = Some(b);
                        } else {
                            c.metrics_bind_address = Some(b);
                        }
                    }
                }
                "hostnameOverride" => self.out.config.hostname_override = self.string(key, v)?,
                "clusterCIDR" => {
                    let s = self.string(key, v)?.unwrap_or_default();
                    let cidrs = s
                        .split(',')
                        .filter(|s| !s.trim().is_empty())
                        .map(Cidr::from_str)
                        .collect::<Result<Vec<_>, _>>()
                        .map_err(|e| self.err(key, e))?;
                    self.out.config.cluster_cidrs = cidrs;
                }
                "nodePortAddresses" => {
                    let list = self.string_list(key, v)?;
                    let npa = NodePortAddresses::from_list(&list).map_err(|e| self.err(key, e))?;
                    self.out.config.node_port_addresses = Some(npa);
                }
                "detectLocalMode" => detect_local_mode = self.string(key, v)?,
                "detectLocal" => {
                    for (k, v) in self.mapping(key, v)? {
                        let field = format!("detectLocal.{k}");
                        match k.as_str() {
                            "bridgeInterface" | "interfaceNamePrefix" => {
                                if let Some(s) = self.string(&field, v)? {
                                    detect_local_block.push((k, s));
                                }
                            }
                            _ => self.other("detectLocal", &k, v),
                        }
                    }
                }
                "clientConnection" => {
                    for (k, v) in self.mapping(key, v)? {
                        if k == "kubeconfig" {
                            self.out.config.kubeconfig = self
                                .string("clientConnection.kubeconfig", v)?
                                .map(PathBuf::from);
                        } else {
                            self.other("clientConnection", &k, v);
                        }
                    }
                }
                "iptables" | "nftables" | "ipvs" => {
                    let ours = key == mode.block();
                    for (k, v) in self.mapping(key, v)? {
                        let field = format!("{key}.{k}");
                        match k.as_str() {
                            "syncPeriod" | "minSyncPeriod" => {
                                // Checked in every block (a typo is a typo), used from ours.
                                let d = self.duration(&field, v)?;
                                if ours {
                                    let c = &mut self.out.config;
                                    if k == "syncPeriod" {
                                        c.sync_period = d;
                                    } else {
                                        c.min_sync_period = d;
                                    }
                                }
                            }
                            // Honoured in every mode: users carry it over from IPVS mode.
                            "scheduler" if key == "ipvs" => {
                                if let Some(name) = self.string(&field, v)? {
                                    let sched = Scheduler::parse(&name).ok_or_else(|| {
                                        self.err(
                                            &field,
                                            format!(
                                                "unknown scheduler {name:?}: use one of {SCHEDULER_NAMES}"
                                            ),
                                        )
                                    })?;
                                    self.out.config.scheduler = Some(sched);
                                }
                            }
                            // Other modes' settings are ignored upstream too: stay quiet.
                            _ if !ours && unsupported(key, &k) => {}
                            _ => self.other(key, &k, v),
                        }
                    }
                }
                "conntrack" => {
                    for (k, v) in self.mapping(key, v)? {
                        let field = format!("conntrack.{k}");
                        match k.as_str() {
                            "udpTimeout"
                            | "udpStreamTimeout"
                            | "tcpEstablishedTimeout"
                            | "tcpCloseWaitTimeout" => {
                                let d = self.duration_or_zero(&field, v)?;
                                let c = &mut self.out.config;
                                *match k.as_str() {
                                    "udpTimeout" => &mut c.conntrack_udp_timeout,
                                    "udpStreamTimeout" => &mut c.conntrack_udp_stream_timeout,
                                    "tcpEstablishedTimeout" => {
                                        &mut c.conntrack_tcp_established_timeout
                                    }
                                    _ => &mut c.conntrack_tcp_close_wait_timeout,
                                } = d;
                            }
                            "maxPerCore" => {
                                self.out.config.conntrack_max_per_core = self.count(&field, v)?
                            }
                            "min" => self.out.config.conntrack_min = self.count(&field, v)?,
                            "tcpBeLiberal" => {
                                self.out.config.conntrack_tcp_be_liberal =
                                    self.boolean(&field, v)?;
                            }
                            _ => self.other("conntrack", &k, v),
                        }
                    }
                }
                _ => self.other("", key, v),
            }
        }
        self.out.config.detect_local = match detect_local_mode.as_deref() {
            None => None,
            Some("ClusterCIDR") => Some(DetectLocal::ClusterCidr),
            Some("NodeCIDR") => Some(DetectLocal::NodeCidr),
            Some(m @ ("BridgeInterface" | "InterfaceNamePrefix")) => {
                let (want, field) = if m == "BridgeInterface" {
                    ("bridgeInterface", "detectLocal.bridgeInterface")
                } else {
                    ("interfaceNamePrefix", "detectLocal.interfaceNamePrefix")
                };
                let Some((_, value)) = detect_local_block.iter().find(|(k, _)| k == want) else {
                    return Err(self.err(field, format!("required when detectLocalMode is {m}")));
                };
                Some(if m == "BridgeInterface" {
                    DetectLocal::BridgeInterface(value.clone())
                } else {
                    DetectLocal::InterfaceNamePrefix(value.clone())
                })
            }
            Some(other) => {
                return Err(self.err(
                    "detectLocalMode",
                    format!(
                        "{other:?}: use ClusterCIDR, NodeCIDR, BridgeInterface or InterfaceNamePrefix"
                    ),
                ));
            }
        };
        self.check()
    }

    /// Cross-field checks and notes on accepted settings that do not act here yet.
    fn check(&mut self) -> Result<()> {
        let c = &self.out.config;
        if let (Some(min), Some(sync)) = (c.min_sync_period, c.sync_period)
            && min > sync
        {
            let block = c.mode.block();
            return Err(self.err(
                &format!("{block}.minSyncPeriod"),
                format!("{min:?} is longer than {block}.syncPeriod {sync:?}"),
            ));
        }
        if c.detect_local == Some(DetectLocal::ClusterCidr) && c.cluster_cidrs.is_empty() {
            self.warn(
                "detectLocalMode",
                "ClusterCIDR without clusterCIDR: no traffic is detected as local (upstream does the same)",
            );
        }
        let c = &self.out.config;
        if c.detect_local.is_some() || !c.cluster_cidrs.is_empty() {
            self.out.notes.push(format!(
                "{}: detectLocalMode/clusterCIDR: tell in-cluster clients of externalTrafficPolicy Local frontends (ClusterCIDR mode only); ClusterIP traffic is never masqueraded here",
                self.file
            ));
        }
        if let Some(ip) = self.out.config.bind_address
            && ip.is_ipv6()
            && !ip.is_unspecified()
        {
            self.warn(
                "bindAddress",
                "an IPv6 address makes upstream IPv6-primary; kube-proxy-ebpf carries IPv4 only",
            );
        }
        Ok(())
    }
}

/// A value on one line (JSON), for messages.
fn show(v: &Value) -> String {
    v.to_string()
}

/// Parses a KubeProxyConfiguration document. `file` names it in messages.
pub fn parse(file: &str, text: &str) -> Result<Parsed> {
    // YAML 1.2 booleans (`yes` is a string, as with serde_yaml before); a repeated key is an
    // error (which of two values was meant?); no snippet in the one-line message.
    let options = serde_saphyr::options! {
        strict_booleans: true,
        with_snippet: false,
    };
    let root: Value =
        serde_saphyr::from_str_with_options(text, options).map_err(|e| Error::Yaml {
            file: file.to_owned(),
            // The user-facing wording (the default one suggests parser options to the caller).
            message: e.render_with_formatter(&serde_saphyr::UserMessageFormatter),
        })?;
    let mut w = Walker {
        file,
        out: Parsed::default(),
    };
    w.top(&root)?;
    Ok(w.out)
}

/// clap ids of the `run` arguments given explicitly (command line or environment variable).
pub fn explicit_args(matches: &ArgMatches) -> BTreeSet<String> {
    matches
        .ids()
        .filter(|id| {
            matches!(
                matches.value_source(id.as_str()),
                Some(ValueSource::CommandLine | ValueSource::EnvVariable)
            )
        })
        .map(|id| id.as_str().to_owned())
        .collect()
}

/// Puts the file's settings into `args` wherever the flag was not given explicitly, then checks
/// the result. `explicit` holds clap argument ids (field names), see [`explicit_args`].
pub fn apply(args: &mut RunArgs, file: &FileConfig, explicit: &BTreeSet<String>) -> Result<()> {
    let from_file = |id: &str| !explicit.contains(id);
    fn set<T: Clone>(take: bool, dst: &mut T, src: &Option<T>) {
        if take && let Some(v) = src {
            *dst = v.clone();
        }
    }
    set(
        from_file("healthz_bind_address"),
        &mut args.healthz_bind_address,
        &file.healthz_bind_address,
    );
    set(
        from_file("metrics_bind_address"),
        &mut args.metrics_bind_address,
        &file.metrics_bind_address,
    );
    set(
        from_file("nodeport_addresses"),
        &mut args.nodeport_addresses,
        &file.node_port_addresses,
    );
    set(
        from_file("sync_period"),
        &mut args.sync_period,
        &file.sync_period,
    );
    set(
        from_file("min_sync_period"),
        &mut args.min_sync_period,
        &file.min_sync_period,
    );
    set(
        from_file("conntrack_udp_timeout"),
        &mut args.conntrack_udp_timeout,
        &file.conntrack_udp_timeout,
    );
    set(
        from_file("conntrack_tcp_established_timeout"),
        &mut args.conntrack_tcp_established_timeout,
        &file.conntrack_tcp_established_timeout,
    );
    set(
        from_file("conntrack_udp_timeout_stream"),
        &mut args.conntrack_udp_timeout_stream,
        &file.conntrack_udp_stream_timeout,
    );
    set(
        from_file("conntrack_tcp_timeout_close_wait"),
        &mut args.conntrack_tcp_timeout_close_wait,
        &file.conntrack_tcp_close_wait_timeout,
    );
    set(
        from_file("conntrack_max_per_core"),
        &mut args.conntrack_max_per_core,
        &file.conntrack_max_per_core,
    );
    set(
        from_file("conntrack_min"),
        &mut args.conntrack_min,
        &file.conntrack_min,
    );
    set(from_file("scheduler"), &mut args.scheduler, &file.scheduler);
    if file.conntrack_tcp_be_liberal.is_some() {
        args.kube_proxy.conntrack_tcp_be_liberal = file.conntrack_tcp_be_liberal;
    }
    if from_file("cluster_cidr") && !file.cluster_cidrs.is_empty() {
        args.cluster_cidr.clone_from(&file.cluster_cidrs);
    }
    if from_file("detect_local_mode")
        && let Some(d) = &file.detect_local
    {
        args.detect_local_mode = d.mode();
    }
    if from_file("hostname_override") && file.hostname_override.is_some() {
        args.hostname_override.clone_from(&file.hostname_override);
    }
    // clientConnection.kubeconfig; ignored in standalone mode (--manifests), where no API is read.
    if from_file("kubeconfig") && args.manifests.is_none() && file.kubeconfig.is_some() {
        args.kubeconfig.clone_from(&file.kubeconfig);
    }
    validate(args)
}

/// kube-proxy's flags (clap ids) for settings its configuration file holds: with `--config`
/// the file decides them, as with kube-proxy, and these flags are ignored.
pub const FILE_DECIDES: [&str; 12] = [
    "kubeconfig",
    "healthz_bind_address",
    "metrics_bind_address",
    "nodeport_addresses",
    "cluster_cidr",
    "detect_local_mode",
    "conntrack_max_per_core",
    "conntrack_min",
    "conntrack_tcp_established_timeout",
    "conntrack_tcp_timeout_close_wait",
    "conntrack_udp_timeout",
    "conntrack_udp_timeout_stream",
];

/// With `--config`: kube-proxy's flags for settings of the file are ignored, as with
/// kube-proxy (only `--hostname-override` and `--master` override the file): each one given is
/// put back to its default (the file then sets it, or the default stands) and named in a warning.
/// Returns `explicit` without them. The agent's own flags keep winning over the file.
pub fn file_decides(args: &mut RunArgs, explicit: &BTreeSet<String>) -> BTreeSet<String> {
    let given: Vec<&str> = FILE_DECIDES
        .into_iter()
        .filter(|id| explicit.contains(*id))
        .collect();
    if !given.is_empty() {
        let d = RunArgs::defaults();
        for id in &given {
            tracing::warn!(
                "--{} ignored: with --config the configuration file decides, as with kube-proxy \
                 (only --hostname-override and --master override it)",
                id.replace('_', "-")
            );
            match *id {
                "kubeconfig" => args.kubeconfig.clone_from(&d.kubeconfig),
                "healthz_bind_address" => args.healthz_bind_address = d.healthz_bind_address,
                "metrics_bind_address" => args.metrics_bind_address = d.metrics_bind_address,
                "nodeport_addresses" => args.nodeport_addresses.clone_from(&d.nodeport_addresses),
                "cluster_cidr" => args.cluster_cidr.clone_from(&d.cluster_cidr),
                "detect_local_mode" => args.detect_local_mode = d.detect_local_mode,
                "conntrack_max_per_core" => args.conntrack_max_per_core = d.conntrack_max_per_core,
                "conntrack_min" => args.conntrack_min = d.conntrack_min,
                "conntrack_tcp_established_timeout" => {
                    args.conntrack_tcp_established_timeout = d.conntrack_tcp_established_timeout;
                }
                "conntrack_tcp_timeout_close_wait" => {
                    args.conntrack_tcp_timeout_close_wait = d.conntrack_tcp_timeout_close_wait;
                }
                "conntrack_udp_timeout" => args.conntrack_udp_timeout = d.conntrack_udp_timeout,
                "conntrack_udp_timeout_stream" => {
                    args.conntrack_udp_timeout_stream = d.conntrack_udp_timeout_stream;
                }
                _ => {}
            }
        }
    }
    let compat = std::mem::take(&mut args.kube_proxy);
    let had_compat = compat.proxy_mode.is_some()
        || compat.sync_periods() != (None, None)
        || compat.ipvs_scheduler.is_some()
        || compat.healthz_port.is_some()
        || compat.metrics_port.is_some();
    if had_compat {
        tracing::warn!(
            "kube-proxy's --proxy-mode, --iptables-*/--ipvs-* sync periods and scheduler and \
             --healthz-port/--metrics-port ignored: with --config the configuration file decides"
        );
    }
    // What stays the node's business whatever the file says.
    args.kube_proxy.oom_score_adj = compat.oom_score_adj;
    args.kube_proxy.conntrack_tcp_be_liberal = compat.conntrack_tcp_be_liberal;
    args.kube_proxy.init_only = compat.init_only;
    explicit
        .iter()
        .filter(|id| !FILE_DECIDES.contains(&id.as_str()))
        .cloned()
        .collect()
}

/// Without `--config`: kube-proxy's own flags with their kube-proxy meaning (the sync periods
/// of `--proxy-mode`, `--ipvs-scheduler`, `--healthz-port`, `--metrics-port`), each under the
/// agent's equivalent flag when that one was given too.
pub fn apply_kube_proxy_flags(args: &mut RunArgs, explicit: &BTreeSet<String>) -> Result<()> {
    let k = args.kube_proxy.clone();
    let (period, min) = k.sync_periods();
    if let Some(p) = period.filter(|_| !explicit.contains("sync_period")) {
        args.sync_period = p;
    }
    if let Some(p) = min.filter(|_| !explicit.contains("min_sync_period")) {
        args.min_sync_period = p;
    }
    if let Some(name) = k.ipvs_scheduler.filter(|_| !explicit.contains("scheduler")) {
        args.scheduler = crate::cli::parse_scheduler(&name).map_err(|reason| Error::Merged {
            what: "--ipvs-scheduler".into(),
            reason,
        })?;
    }
    let with_port = |b: &mut BindAddress, port: Option<u16>| {
        if let (Some(addr), Some(port)) = (b.0.as_mut(), port) {
            addr.set_port(port);
        }
    };
    if !explicit.contains("healthz_bind_address") {
        with_port(&mut args.healthz_bind_address, k.healthz_port);
    }
    if !explicit.contains("metrics_bind_address") {
        with_port(&mut args.metrics_bind_address, k.metrics_port);
    }
    Ok(())
}

/// For `run`: kube-proxy's flags warned about or put to use, `--config` read if given (its
/// warnings and notes logged) and merged as kube-proxy merges it, the result checked and the
/// effective settings logged.
pub fn resolve(args: &mut RunArgs, explicit: &BTreeSet<String>) -> Result<()> {
    for w in args.kube_proxy.ignored() {
        tracing::warn!("{w}");
    }
    if let Some(path) = args.config.clone() {
        let explicit = file_decides(args, explicit);
        let parsed = load(path.as_path())?;
        for w in &parsed.warnings {
            tracing::warn!("{w}");
        }
        for n in &parsed.notes {
            tracing::info!("{n}");
        }
        apply(args, &parsed.config, &explicit)?;
    } else {
        apply_kube_proxy_flags(args, explicit)?;
        validate(args)?;
    }
    // kube-proxy's normalisation of the node name.
    if let Some(name) = &mut args.hostname_override {
        *name = name.trim().to_lowercase();
    }
    let timeouts = conntrack_timeouts(args);
    tracing::info!(
        healthz = %args.healthz_bind_address,
        metrics = %args.metrics_bind_address,
        nodeport_addresses = %args.nodeport_addresses,
        sync_period = ?args.sync_period,
        min_sync_period = ?args.min_sync_period,
        udp_timeout = ?timeouts.udp,
        udp_stream_timeout = ?timeouts.udp_stream,
        tcp_established_timeout = ?timeouts.tcp_established,
        tcp_close_wait_timeout = ?timeouts.tcp_close_wait,
        conntrack_max_per_core = args.conntrack_max_per_core,
        conntrack_min = args.conntrack_min,
        cluster_cidr = ?args.cluster_cidr.iter().map(ToString::to_string).collect::<Vec<_>>(),
        detect_local_mode = %args.detect_local_mode,
        scheduler = args.scheduler.name(),
        "settings"
    );
    Ok(())
}

/// The `--config` file as the agent started with it: kube-proxy exits when its configuration
/// file changes, so that the pod restarts with the new ConfigMap; the agent does the same (the
/// datapath stays, as on any restart).
#[derive(Debug)]
pub struct FileWatch {
    path: PathBuf,
    content: Option<Vec<u8>>,
}

/// How often the `--config` file is read again.
pub const FILE_WATCH_PERIOD: Duration = Duration::from_secs(2);

impl FileWatch {
    pub fn new(path: PathBuf) -> Self {
        let content = std::fs::read(&path).ok();
        Self { path, content }
    }

    /// Whether the file's content differs from the start's (a file that cannot be read for a
    /// moment, as during a ConfigMap's swap, is not a change).
    pub fn changed(&self) -> bool {
        match std::fs::read(&self.path) {
            Ok(now) => self.content.as_deref() != Some(now.as_slice()),
            Err(_) => false,
        }
    }

    pub fn path(&self) -> &Path {
        &self.path
    }
}

/// The kernel's own conntrack timeouts, which kube-proxy leaves in place when a
/// `KubeProxyConfiguration.conntrack` timeout is 0 (this proxy then uses them, as netfilter
/// would): `nf_conntrack_tcp_timeout_established`, `_tcp_timeout_close_wait`, `_udp_timeout`,
/// `_udp_timeout_stream`.
pub const KERNEL_TCP_ESTABLISHED: Duration = Duration::from_secs(5 * 86_400);
pub const KERNEL_TCP_CLOSE_WAIT: Duration = Duration::from_secs(60);
pub const KERNEL_UDP: Duration = Duration::from_secs(30);
pub const KERNEL_UDP_STREAM: Duration = Duration::from_secs(120);

/// The conntrack timeouts in effect.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ConntrackTimeouts {
    pub tcp_established: Duration,
    pub tcp_close_wait: Duration,
    pub udp: Duration,
    pub udp_stream: Duration,
}

/// Pure: the timeouts of the merged settings, 0 meaning "the kernel's value" like upstream.
pub fn conntrack_timeouts(args: &RunArgs) -> ConntrackTimeouts {
    let or = |d: Duration, kernel: Duration| if d.is_zero() { kernel } else { d };
    ConntrackTimeouts {
        tcp_established: or(
            args.conntrack_tcp_established_timeout,
            KERNEL_TCP_ESTABLISHED,
        ),
        tcp_close_wait: or(args.conntrack_tcp_timeout_close_wait, KERNEL_TCP_CLOSE_WAIT),
        udp: or(args.conntrack_udp_timeout, KERNEL_UDP),
        udp_stream: or(args.conntrack_udp_timeout_stream, KERNEL_UDP_STREAM),
    }
}

/// Checks that hold whatever the settings came from.
pub fn validate(args: &RunArgs) -> Result<()> {
    if args.sync_period.is_zero() {
        return Err(Error::Merged {
            what: "syncPeriod (--sync-period)".into(),
            reason: "must be greater than 0".into(),
        });
    }
    if args.min_sync_period > args.sync_period {
        return Err(Error::Merged {
            what: "minSyncPeriod (--min-sync-period)".into(),
            reason: format!(
                "{:?} is longer than syncPeriod {:?}",
                args.min_sync_period, args.sync_period
            ),
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::net::Ipv4Addr;

    use clap::{CommandFactory as _, FromArgMatches as _};

    use super::*;
    use crate::cli::{Cli, Command};

    #[test]
    fn dual_stack_cluster_cidr_gives_each_family_its_prefixes() {
        let cidrs: Vec<Cidr> = ["10.244.0.0/16", "fd00:10:244::/56"]
            .iter()
            .map(|c| crate::pipeline::addresses::parse_cidr(c).expect("cidr"))
            .collect();
        let (v4, _) = in_cluster_prefixes(DetectLocalMode::ClusterCidr, &cidrs);
        assert_eq!(v4, [(Ipv4Addr::new(10, 244, 0, 0), 16)]);
        assert_eq!(
            in_cluster_prefixes6(DetectLocalMode::ClusterCidr, &cidrs),
            [("fd00:10:244::".parse().expect("v6"), 56)]
        );
        assert!(in_cluster_prefixes6(DetectLocalMode::NodeCidr, &cidrs).is_empty());
    }

    const ANY_V4: IpAddr = IpAddr::V4(Ipv4Addr::UNSPECIFIED);
    const HEAD: &str =
        "apiVersion: kubeproxy.config.k8s.io/v1alpha1\nkind: KubeProxyConfiguration\n";

    fn parse_ok(body: &str) -> Parsed {
        parse("config.yaml", &format!("{HEAD}{body}"))
            .unwrap_or_else(|e| panic!("{body:?} should parse: {e}"))
    }

    fn parse_err(body: &str) -> String {
        match parse("config.yaml", &format!("{HEAD}{body}")) {
            Ok(p) => panic!("{body:?} should be rejected, parsed as {p:?}"),
            Err(e) => e.to_string(),
        }
    }

    fn secs(s: u64) -> Option<Duration> {
        Some(Duration::from_secs(s))
    }

    #[test]
    fn supported_fields_are_read() {
        struct Case {
            body: &'static str,
            check: fn(&FileConfig) -> bool,
        }
        let cases = [
            Case {
                body: "bindAddress: 0.0.0.0",
                check: |c| c.bind_address == Some(ANY_V4),
            },
            Case {
                body: "healthzBindAddress: 0.0.0.0:10256",
                check: |c| {
                    c.healthz_bind_address
                        == Some(BindAddress(Some("0.0.0.0:10256".parse().unwrap())))
                },
            },
            Case {
                body: "metricsBindAddress: 127.0.0.1",
                check: |c| {
                    c.metrics_bind_address
                        == Some(BindAddress(Some("127.0.0.1:10249".parse().unwrap())))
                },
            },
            Case {
                body: "metricsBindAddress: \"[::1]:9999\"",
                check: |c| {
                    c.metrics_bind_address == Some(BindAddress(Some("[::1]:9999".parse().unwrap())))
                },
            },
            Case {
                body: "hostnameOverride: node-a",
                check: |c| c.hostname_override.as_deref() == Some("node-a"),
            },
            Case {
                body: "hostnameOverride: \"\"",
                check: |c| c.hostname_override.is_none(),
            },
            Case {
                body: "clientConnection:\n  kubeconfig: /var/lib/kube-proxy/kubeconfig.conf",
                check: |c| {
                    c.kubeconfig.as_deref()
                        == Some(Path::new("/var/lib/kube-proxy/kubeconfig.conf"))
                },
            },
            Case {
                body: "clusterCIDR: 10.244.0.0/16,fd00:10:244::/56",
                check: |c| c.cluster_cidrs.len() == 2,
            },
            Case {
                body: "nodePortAddresses: [primary]",
                check: |c| c.node_port_addresses == Some(NodePortAddresses::Primary),
            },
            Case {
                body: "nodePortAddresses: []",
                check: |c| c.node_port_addresses == Some(NodePortAddresses::All),
            },
            Case {
                body: "nodePortAddresses: [10.0.0.0/8, 192.168.0.0/16]",
                check: |c| matches!(&c.node_port_addresses, Some(NodePortAddresses::Cidrs(v)) if v.len() == 2),
            },
            Case {
                body: "iptables:\n  syncPeriod: 10s\n  minSyncPeriod: 500ms",
                check: |c| {
                    c.sync_period == secs(10)
                        && c.min_sync_period == Some(Duration::from_millis(500))
                },
            },
            Case {
                body: "mode: nftables\nnftables:\n  syncPeriod: 1h0m0s\niptables:\n  syncPeriod: 5s",
                check: |c| c.mode == Mode::Nftables && c.sync_period == secs(3600),
            },
            Case {
                body: "mode: \"\"\nnftables:\n  syncPeriod: 7s\niptables:\n  syncPeriod: 5s",
                check: |c| c.mode == Mode::Default && c.sync_period == secs(5),
            },
            Case {
                body: "mode: ipvs\nipvs:\n  syncPeriod: 9s\n  scheduler: \"\"",
                check: |c| {
                    c.mode == Mode::Ipvs && c.sync_period == secs(9) && c.scheduler.is_none()
                },
            },
            Case {
                body: "mode: ipvs\nipvs:\n  scheduler: wlc",
                check: |c| c.scheduler == Some(Scheduler::LeastConnection),
            },
            // Honoured in any mode (carried over from an IPVS configuration).
            Case {
                body: "mode: nftables\nipvs:\n  scheduler: \" mh \"",
                check: |c| c.scheduler == Some(Scheduler::Maglev),
            },
            Case {
                body: "iptables:\n  syncPeriod: 0s\n  minSyncPeriod: 0s",
                check: |c| c.sync_period.is_none() && c.min_sync_period.is_none(),
            },
            Case {
                body: "conntrack:\n  udpTimeout: 30s\n  tcpEstablishedTimeout: 2h",
                check: |c| {
                    c.conntrack_udp_timeout == secs(30)
                        && c.conntrack_tcp_established_timeout == secs(7200)
                },
            },
            Case {
                body: "conntrack:\n  udpStreamTimeout: 3m\n  tcpCloseWaitTimeout: 10m\n  maxPerCore: 65536\n  min: 1000",
                check: |c| {
                    c.conntrack_udp_stream_timeout == secs(180)
                        && c.conntrack_tcp_close_wait_timeout == secs(600)
                        && c.conntrack_max_per_core == Some(65_536)
                        && c.conntrack_min == Some(1_000)
                },
            },
            Case {
                body: "conntrack:\n  udpTimeout: 0s\n  tcpEstablishedTimeout: 0s\n  maxPerCore: null",
                check: |c| {
                    c.conntrack_udp_timeout == Some(Duration::ZERO)
                        && c.conntrack_tcp_established_timeout == Some(Duration::ZERO)
                        && c.conntrack_max_per_core.is_none()
                },
            },
            Case {
                body: "detectLocalMode: ClusterCIDR\nclusterCIDR: 10.244.0.0/16",
                check: |c| c.detect_local == Some(DetectLocal::ClusterCidr),
            },
            Case {
                body: "detectLocalMode: InterfaceNamePrefix\ndetectLocal:\n  interfaceNamePrefix: veth",
                check: |c| c.detect_local == Some(DetectLocal::InterfaceNamePrefix("veth".into())),
            },
        ];
        for case in cases {
            let p = parse_ok(case.body);
            assert!((case.check)(&p.config), "{:?} → {:?}", case.body, p.config);
            assert!(
                p.warnings.is_empty(),
                "{:?} warned {:?}",
                case.body,
                p.warnings
            );
        }
    }

    #[test]
    fn bad_values_name_the_file_and_field() {
        let cases = [
            (
                "conntrack:\n  udpTimeout: 5 parsecs",
                "config.yaml: conntrack.udpTimeout: invalid duration \"5 parsecs\"",
            ),
            (
                "conntrack:\n  tcpEstablishedTimeout: 3600",
                "config.yaml: conntrack.tcpEstablishedTimeout: expected a string, found 3600",
            ),
            (
                "iptables:\n  syncPeriod: soon",
                "config.yaml: iptables.syncPeriod: invalid duration",
            ),
            (
                "nftables:\n  minSyncPeriod: 1x",
                "config.yaml: nftables.minSyncPeriod: invalid duration",
            ),
            (
                "iptables:\n  syncPeriod: 1s\n  minSyncPeriod: 5s",
                "config.yaml: iptables.minSyncPeriod: 5s is longer than iptables.syncPeriod 1s",
            ),
            (
                "healthzBindAddress: localhost:http",
                "config.yaml: healthzBindAddress: invalid bind address",
            ),
            (
                "bindAddress: 0.0.0.0:80",
                "config.yaml: bindAddress: invalid IP address",
            ),
            (
                "clusterCIDR: 10.244.0.0",
                "config.yaml: clusterCIDR: invalid CIDR \"10.244.0.0\"",
            ),
            (
                "nodePortAddresses: [10.0.0.0/33]",
                "config.yaml: nodePortAddresses: invalid CIDR",
            ),
            (
                "nodePortAddresses: [primary, 10.0.0.0/8]",
                "config.yaml: nodePortAddresses: ",
            ),
            (
                "nodePortAddresses: 10.0.0.0/8",
                "config.yaml: nodePortAddresses: expected a list",
            ),
            ("mode: kernelspace", "config.yaml: mode: \"kernelspace\""),
            (
                "ipvs:\n  scheduler: fastest",
                "config.yaml: ipvs.scheduler: unknown scheduler \"fastest\": use one of random, rr (wrr)",
            ),
            (
                "mode: ipvs\nipvs:\n  scheduler: 3",
                "config.yaml: ipvs.scheduler: expected a string",
            ),
            ("mode: ebpf", "config.yaml: mode: \"ebpf\""),
            (
                "detectLocalMode: Magic",
                "config.yaml: detectLocalMode: \"Magic\"",
            ),
            (
                "detectLocalMode: BridgeInterface",
                "config.yaml: detectLocal.bridgeInterface: required",
            ),
            ("conntrack: 5", "config.yaml: conntrack: expected a mapping"),
            (
                "conntrack:\n  maxPerCore: -1",
                "config.yaml: conntrack.maxPerCore: -1 is not a count",
            ),
            (
                "conntrack:\n  min: \"lots\"",
                "config.yaml: conntrack.min: expected a number",
            ),
        ];
        for (body, want) in cases {
            let got = parse_err(body);
            assert!(
                got.starts_with(want),
                "{body:?}: got {got:?}, want {want:?}…"
            );
        }
    }

    #[test]
    fn header_is_checked() {
        let e = parse("c.yaml", "kind: KubeProxyConfiguration\n")
            .unwrap_err()
            .to_string();
        assert!(e.starts_with("c.yaml: apiVersion: missing"), "{e}");
        let e = parse(
            "c.yaml",
            "apiVersion: kubeproxy.config.k8s.io/v1beta9\nkind: KubeProxyConfiguration\n",
        )
        .unwrap_err()
        .to_string();
        assert!(
            e.starts_with("c.yaml: apiVersion: \"kubeproxy.config.k8s.io/v1beta9\""),
            "{e}"
        );
        let e = parse(
            "c.yaml",
            "apiVersion: kubeproxy.config.k8s.io/v1alpha1\nkind: KubeletConfiguration\n",
        )
        .unwrap_err()
        .to_string();
        assert!(e.starts_with("c.yaml: kind:"), "{e}");
        let e = parse("c.yaml", "a: [").unwrap_err().to_string();
        assert!(e.starts_with("c.yaml: not valid YAML"), "{e}");
        // Syntax errors and repeated keys name the line and column.
        let e = parse("c.yaml", &format!("{HEAD}mode: \"\nclusterCIDR: x\n"))
            .unwrap_err()
            .to_string();
        assert_eq!(
            e,
            "c.yaml: not valid YAML: unclosed quote at line 3, column 7"
        );
        let e = parse("c.yaml", &format!("{HEAD}mode: ''\nmode: ''\n"))
            .unwrap_err()
            .to_string();
        assert_eq!(
            e,
            "c.yaml: not valid YAML: duplicate mapping key `mode` is not allowed here at line 4, \
             column 1"
        );
        // YAML 1.2 booleans: `yes` is the string "yes" (a bool would read "found true").
        let e = parse("c.yaml", &format!("{HEAD}mode: yes\n"))
            .unwrap_err()
            .to_string();
        assert!(e.starts_with("c.yaml: mode: \"yes\""), "{e}");
        // JSON is YAML.
        parse(
            "c.json",
            r#"{"apiVersion":"kubeproxy.config.k8s.io/v1alpha1","kind":"KubeProxyConfiguration"}"#,
        )
        .expect("json");
    }

    #[test]
    fn unknown_and_unsupported_fields_warn() {
        let cases: &[(&str, &[&str])] = &[
            (
                "healthzBindAdress: 0.0.0.0:1",
                &["config.yaml: healthzBindAdress: unknown field"],
            ),
            (
                "conntrack:\n  udpTimeot: 1s",
                &["config.yaml: conntrack.udpTimeot: unknown field"],
            ),
            (
                "iptables:\n  masqueradeAll: true",
                &["config.yaml: iptables.masqueradeAll: set to true but not supported"],
            ),
            (
                "featureGates:\n  Foo: true",
                &["config.yaml: featureGates: set to"],
            ),
            ("conntrack:\n  tcpBeLiberal: true", &[]),
            ("conntrack:\n  maxPerCore: 65536\n  min: 0", &[]),
            // Another mode's block: ignored upstream too, so quiet (its scheduler is read); but
            // typos still warn.
            ("ipvs:\n  scheduler: rr\n  strictARP: true", &[]),
            (
                "ipvs:\n  shceduler: rr",
                &["config.yaml: ipvs.shceduler: unknown field"],
            ),
            (
                "detectLocalMode: ClusterCIDR",
                &["config.yaml: detectLocalMode: ClusterCIDR without clusterCIDR"],
            ),
            (
                "bindAddress: \"fd00::1\"",
                &["config.yaml: bindAddress: an IPv6 address"],
            ),
        ];
        for (body, want) in cases {
            let p = parse_ok(body);
            assert_eq!(p.warnings.len(), want.len(), "{body:?}: {:?}", p.warnings);
            for (got, want) in p.warnings.iter().zip(want.iter()) {
                assert!(
                    got.starts_with(want),
                    "{body:?}: got {got:?}, want {want:?}…"
                );
            }
        }
    }

    /// What kubeadm writes into the kube-proxy ConfigMap (v1.33): quiet, every zero value unset.
    #[test]
    fn kubeadm_default_config_is_quiet() {
        let body = r#"
bindAddress: 0.0.0.0
bindAddressHardFail: false
clientConnection:
  acceptContentTypes: ""
  burst: 0
  contentType: ""
  kubeconfig: /var/lib/kube-proxy/kubeconfig.conf
  qps: 0
clusterCIDR: 10.244.0.0/16
configSyncPeriod: 0s
conntrack:
  maxPerCore: null
  min: null
  tcpBeLiberal: false
  tcpCloseWaitTimeout: null
  tcpEstablishedTimeout: null
  udpStreamTimeout: 0s
  udpTimeout: 0s
detectLocal:
  bridgeInterface: ""
  interfaceNamePrefix: ""
detectLocalMode: ""
enableProfiling: false
healthzBindAddress: ""
hostnameOverride: ""
ipvs:
  excludeCIDRs: null
  minSyncPeriod: 0s
  scheduler: ""
  strictARP: false
  syncPeriod: 0s
  tcpFinTimeout: 0s
  tcpTimeout: 0s
  udpTimeout: 0s
iptables:
  localhostNodePorts: null
  masqueradeAll: false
  masqueradeBit: null
  minSyncPeriod: 0s
  syncPeriod: 0s
logging:
  flushFrequency: 0
  options:
    json:
      infoBufferSize: "0"
    text:
      infoBufferSize: "0"
  verbosity: 0
metricsBindAddress: ""
mode: ""
nftables:
  masqueradeAll: false
  masqueradeBit: null
  minSyncPeriod: 0s
  syncPeriod: 0s
nodePortAddresses: null
oomScoreAdj: null
portRange: ""
showHiddenMetricsForVersion: ""
winkernel:
  enableDSR: false
  forwardHealthCheckVip: false
  networkName: ""
  rootHnsEndpointName: ""
  sourceVip: ""
"#;
        let p = parse_ok(body);
        assert!(p.warnings.is_empty(), "{:?}", p.warnings);
        assert_eq!(
            p.config.kubeconfig.as_deref(),
            Some(Path::new("/var/lib/kube-proxy/kubeconfig.conf"))
        );
        assert_eq!(p.config.sync_period, None);
        assert_eq!(p.config.healthz_bind_address, None);
        assert_eq!(p.config.node_port_addresses, Some(NodePortAddresses::All));
    }

    fn run_args(argv: &[&str]) -> (RunArgs, BTreeSet<String>) {
        let mut full = vec!["--manifests", "/m"];
        full.extend_from_slice(argv);
        run_args_kube(&full)
    }

    fn run_args_kube(argv: &[&str]) -> (RunArgs, BTreeSet<String>) {
        let mut full = vec!["kube-proxy-ebpf", "run"];
        full.extend_from_slice(argv);
        let matches = Cli::command()
            .try_get_matches_from(full)
            .expect("flags parse");
        let explicit = explicit_args(matches.subcommand_matches("run").expect("run"));
        let Command::Run(args) = Cli::from_arg_matches(&matches).expect("cli").command else {
            panic!("not run")
        };
        (args, explicit)
    }

    #[test]
    fn explicit_flags_override_the_file_defaults_do_not() {
        let file = parse_ok(
            "healthzBindAddress: 127.0.0.1:1\nmetricsBindAddress: 127.0.0.1:2\n\
             hostnameOverride: from-file\nnodePortAddresses: [primary]\n\
             iptables:\n  syncPeriod: 20s\n  minSyncPeriod: 2s\n\
             conntrack:\n  udpTimeout: 7s\n  tcpEstablishedTimeout: 1h\n\
             clientConnection:\n  kubeconfig: /file/kubeconfig\n",
        )
        .config;

        // Kubernetes mode, nothing else on the command line: the file wins over every default.
        let (mut args, explicit) = run_args_kube(&[]);
        apply(&mut args, &file, &explicit).expect("apply");
        assert_eq!(
            args.kubeconfig.as_deref(),
            Some(Path::new("/file/kubeconfig"))
        );
        let (mut args, explicit) = run_args_kube(&["--kubeconfig", "/flag/kubeconfig"]);
        apply(&mut args, &file, &explicit).expect("apply");
        assert_eq!(
            args.kubeconfig.as_deref(),
            Some(Path::new("/flag/kubeconfig"))
        );

        // Standalone mode, nothing else on the command line.
        let (mut args, explicit) = run_args(&[]);
        apply(&mut args, &file, &explicit).expect("apply");
        assert_eq!(args.healthz_bind_address.to_string(), "127.0.0.1:1");
        assert_eq!(args.metrics_bind_address.to_string(), "127.0.0.1:2");
        assert_eq!(args.hostname_override.as_deref(), Some("from-file"));
        assert_eq!(args.kubeconfig, None, "no API in standalone mode");
        assert_eq!(args.nodeport_addresses, NodePortAddresses::Primary);
        assert_eq!(args.sync_period, Duration::from_secs(20));
        assert_eq!(args.min_sync_period, Duration::from_secs(2));
        assert_eq!(args.conntrack_udp_timeout, Duration::from_secs(7));
        assert_eq!(
            args.conntrack_tcp_established_timeout,
            Duration::from_secs(3600)
        );

        // Flags given: they win, including a flag given with its default value and "" (disable).
        let (mut args, explicit) = run_args(&[
            "--healthz-bind-address",
            "0.0.0.0:10256",
            "--metrics-bind-address",
            "",
            "--hostname-override",
            "from-flag",
            "--nodeport-addresses",
            "10.0.0.0/8,192.168.0.0/16",
            "--sync-period",
            "40s",
            "--conntrack-udp-timeout",
            "9s",
        ]);
        apply(&mut args, &file, &explicit).expect("apply");
        assert_eq!(args.healthz_bind_address.to_string(), "0.0.0.0:10256");
        assert_eq!(args.metrics_bind_address, BindAddress(None));
        assert_eq!(args.hostname_override.as_deref(), Some("from-flag"));
        assert_eq!(
            args.nodeport_addresses.to_string(),
            "10.0.0.0/8,192.168.0.0/16"
        );
        assert_eq!(args.sync_period, Duration::from_secs(40));
        assert_eq!(
            args.min_sync_period,
            Duration::from_secs(2),
            "from the file"
        );
        assert_eq!(args.conntrack_udp_timeout, Duration::from_secs(9));
    }

    #[test]
    fn a_changed_config_file_is_seen_a_vanished_one_is_not() {
        let dir = std::env::temp_dir().join(format!("kpe-cfgwatch-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("dir");
        let file = dir.join("config.yaml");
        std::fs::write(&file, "mode: nftables\n").expect("write");
        let watch = FileWatch::new(file.clone());
        assert!(!watch.changed());
        std::fs::remove_file(&file).expect("rm");
        assert!(!watch.changed(), "gone for a moment (a ConfigMap swap)");
        std::fs::write(&file, "mode: ipvs\n").expect("write");
        assert!(watch.changed());
        std::fs::remove_dir_all(&dir).expect("cleanup");
    }

    #[test]
    fn with_config_kube_proxy_s_flags_yield_to_the_file_but_hostname_override() {
        let file = parse_ok(
            "healthzBindAddress: 127.0.0.1:1\nhostnameOverride: from-file\n\
             clientConnection:\n  kubeconfig: /file/kubeconfig\n",
        )
        .config;
        let (mut args, explicit) = run_args_kube(&[
            "--kubeconfig",
            "/flag/kubeconfig",
            "--metrics-bind-address",
            "",
            "--cluster-cidr",
            "100.64.0.0/10",
            "--hostname-override",
            "from-flag",
            "--sync-period",
            "40s",
            "--iptables-sync-period",
            "50s",
            "--healthz-port",
            "1234",
        ]);
        let explicit = file_decides(&mut args, &explicit);
        apply(&mut args, &file, &explicit).expect("apply");
        assert_eq!(
            args.kubeconfig.as_deref(),
            Some(Path::new("/file/kubeconfig")),
            "the file's"
        );
        assert_eq!(args.healthz_bind_address.to_string(), "127.0.0.1:1");
        assert_eq!(
            args.metrics_bind_address.to_string(),
            "127.0.0.1:10249",
            "the flag ignored, the file silent: the default"
        );
        assert!(args.cluster_cidr.is_empty(), "ignored flag, default");
        assert_eq!(args.hostname_override.as_deref(), Some("from-flag"));
        assert_eq!(
            args.sync_period,
            Duration::from_secs(40),
            "the agent's own flag still wins"
        );

        // Without --config kube-proxy's flags mean what they mean to kube-proxy.
        let (mut args, explicit) = run_args(&[
            "--iptables-sync-period",
            "50s",
            "--iptables-min-sync-period",
            "5s",
            "--ipvs-scheduler",
            "sh",
            "--healthz-port",
            "1234",
        ]);
        apply_kube_proxy_flags(&mut args, &explicit).expect("kube-proxy flags");
        assert_eq!(args.sync_period, Duration::from_secs(50));
        assert_eq!(args.min_sync_period, Duration::from_secs(5));
        assert_eq!(args.scheduler, Scheduler::SourceHash);
        assert_eq!(args.healthz_bind_address.to_string(), "0.0.0.0:1234");
        let (mut args, explicit) =
            run_args(&["--proxy-mode", "ipvs", "--iptables-sync-period", "50s"]);
        apply_kube_proxy_flags(&mut args, &explicit).expect("kube-proxy flags");
        assert_eq!(args.sync_period, Duration::from_secs(30), "not ipvs mode's");
    }

    #[test]
    fn scheduler_flag_wins_over_ipvs_scheduler_which_wins_over_the_default() {
        let file = parse_ok("ipvs:\n  scheduler: sh\n").config;
        let (mut args, explicit) = run_args(&[]);
        assert_eq!(args.scheduler, Scheduler::Random, "the default");
        apply(&mut args, &file, &explicit).expect("apply");
        assert_eq!(args.scheduler, Scheduler::SourceHash, "from the file");
        let (mut args, explicit) = run_args(&["--scheduler", "random"]);
        apply(&mut args, &file, &explicit).expect("apply");
        assert_eq!(
            args.scheduler,
            Scheduler::Random,
            "the flag, even at its default"
        );
        let unset = parse_ok("ipvs:\n  scheduler: \"\"\n").config;
        let (mut args, explicit) = run_args(&["--scheduler", "maglev"]);
        apply(&mut args, &unset, &explicit).expect("apply");
        assert_eq!(args.scheduler, Scheduler::Maglev);
    }

    #[test]
    fn conntrack_timeouts_default_to_upstream_and_zero_means_the_kernel_s() {
        let (args, _) = run_args(&[]);
        assert_eq!(
            conntrack_timeouts(&args),
            ConntrackTimeouts {
                tcp_established: Duration::from_secs(86_400),
                tcp_close_wait: Duration::from_secs(3_600),
                udp: Duration::from_secs(30),
                udp_stream: Duration::from_secs(120),
            },
            "upstream's defaults (24h, 1h) and the kernel's UDP timeouts (30 s, 120 s)"
        );
        let zeros = parse_ok(
            "conntrack:\n  udpTimeout: 0s\n  udpStreamTimeout: 0s\n  \
             tcpEstablishedTimeout: 0s\n  tcpCloseWaitTimeout: 0s\n",
        )
        .config;
        let (mut args, explicit) = run_args(&[]);
        apply(&mut args, &zeros, &explicit).expect("apply");
        assert_eq!(
            conntrack_timeouts(&args),
            ConntrackTimeouts {
                tcp_established: KERNEL_TCP_ESTABLISHED,
                tcp_close_wait: KERNEL_TCP_CLOSE_WAIT,
                udp: KERNEL_UDP,
                udp_stream: KERNEL_UDP_STREAM,
            },
            "0 leaves the kernel's value, as upstream"
        );
        let set = parse_ok(
            "conntrack:\n  udpTimeout: 10s\n  udpStreamTimeout: 5m\n  tcpCloseWaitTimeout: 20m\n",
        )
        .config;
        let (mut args, explicit) = run_args(&[
            "--conntrack-udp-timeout-stream",
            "7m",
            "--conntrack-tcp-timeout-established",
            "2h",
        ]);
        apply(&mut args, &set, &explicit).expect("apply");
        let t = conntrack_timeouts(&args);
        assert_eq!(t.udp, Duration::from_secs(10), "from the file");
        assert_eq!(t.udp_stream, Duration::from_secs(420), "the flag wins");
        assert_eq!(t.tcp_close_wait, Duration::from_secs(1_200));
        assert_eq!(
            t.tcp_established,
            Duration::from_secs(7_200),
            "kube-proxy's flag name is accepted"
        );
    }

    #[test]
    fn merged_settings_are_validated() {
        let file = parse_ok("iptables:\n  minSyncPeriod: 50s\n").config;
        let (mut args, explicit) = run_args(&[]);
        let e = apply(&mut args, &file, &explicit).unwrap_err().to_string();
        assert!(
            e.starts_with("minSyncPeriod (--min-sync-period): 50s is longer"),
            "{e}"
        );
    }

    #[test]
    fn flag_defaults_match_upstream() {
        let (args, explicit) = run_args(&[]);
        assert!(explicit.contains("manifests"));
        assert!(!explicit.contains("healthz_bind_address"));
        assert_eq!(args.healthz_bind_address.to_string(), "0.0.0.0:10256");
        assert_eq!(args.metrics_bind_address.to_string(), "127.0.0.1:10249");
        assert_eq!(args.nodeport_addresses, NodePortAddresses::All);
    }

    #[test]
    fn flag_values_are_checked() {
        for (flag, value) in [
            ("--healthz-bind-address", "nowhere"),
            ("--metrics-bind-address", "1.2.3.4:99999"),
            ("--nodeport-addresses", "primary,10.0.0.0/8"),
            ("--nodeport-addresses", "10.0.0.1"),
        ] {
            let r = Cli::command().try_get_matches_from([
                "kube-proxy-ebpf",
                "run",
                "--manifests",
                "/m",
                flag,
                value,
            ]);
            assert!(r.is_err(), "{flag} {value} accepted");
        }
    }

    #[test]
    fn cluster_cidr_and_detect_local_mode_come_from_the_file_unless_flagged() {
        let file =
            parse_ok("clusterCIDR: 10.244.0.0/16,fd00:10:244::/56\ndetectLocalMode: ClusterCIDR\n")
                .config;
        let (mut args, explicit) = run_args(&[]);
        apply(&mut args, &file, &explicit).expect("apply");
        let (v4, messages) = in_cluster_prefixes(args.detect_local_mode, &args.cluster_cidr);
        assert_eq!(
            v4,
            [(std::net::Ipv4Addr::new(10, 244, 0, 0), 16)],
            "IPv6 left out"
        );
        assert!(messages.is_empty(), "{messages:?}");

        let (mut args, explicit) = run_args(&["--cluster-cidr", "100.64.0.0/10"]);
        apply(&mut args, &file, &explicit).expect("apply");
        let (v4, _) = in_cluster_prefixes(args.detect_local_mode, &args.cluster_cidr);
        assert_eq!(
            v4,
            [(std::net::Ipv4Addr::new(100, 64, 0, 0), 10)],
            "the flag wins"
        );

        let other = parse_ok(
            "clusterCIDR: 10.244.0.0/16\ndetectLocalMode: InterfaceNamePrefix\n\
             detectLocal:\n  interfaceNamePrefix: veth\n",
        )
        .config;
        let (mut args, explicit) = run_args(&[]);
        apply(&mut args, &other, &explicit).expect("apply");
        assert_eq!(args.detect_local_mode, DetectLocalMode::InterfaceNamePrefix);
        let (v4, messages) = in_cluster_prefixes(args.detect_local_mode, &args.cluster_cidr);
        assert!(v4.is_empty(), "only ClusterCIDR is implemented");
        assert!(
            messages[0].starts_with("detectLocalMode InterfaceNamePrefix is not implemented"),
            "{messages:?}"
        );
    }

    #[test]
    fn cluster_cidr_mode_without_cidrs_detects_nothing_like_upstream() {
        let (args, _) = run_args(&[]);
        assert_eq!(args.detect_local_mode, DetectLocalMode::ClusterCidr);
        assert_eq!(
            in_cluster_prefixes(args.detect_local_mode, &args.cluster_cidr),
            (vec![], vec![])
        );
        let many: Vec<Cidr> = (0..6)
            .map(|i| format!("10.{i}.0.0/16").parse().unwrap())
            .collect();
        let (v4, messages) = in_cluster_prefixes(DetectLocalMode::ClusterCidr, &many);
        assert_eq!(v4.len(), proxy_common::MAX_CLUSTER_CIDRS);
        assert_eq!(messages.len(), 1, "{messages:?}");
    }
}
