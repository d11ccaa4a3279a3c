//! kube-proxy's leftovers on a node this datapath takes over, and their removal: what
//! `kube-proxy --cleanup` removes, for every mode kube-proxy may have run in here.
//!
//! - iptables mode: its chains in the nat, filter and mangle tables ([`KUBE_PROXY_CHAINS`],
//!   [`KUBE_PROXY_CHAIN_PREFIXES`]) and the rules of the built-in chains that jump to them, for
//!   IPv4 and IPv6 and for each iptables backend present (the selected one, `-legacy` and
//!   `-nft`: kube-proxy may have used either).
//! - nftables mode: `table ip kube-proxy` and `table ip6 kube-proxy` (emptied instead, NAT
//!   hooks and conntrack kept, while netfilter still translates connections: see [`remove`]).
//! - IPVS mode: the `kube-ipvs0` device holding the Service addresses, the IPVS virtual servers
//!   (`ipvsadm -C`) and kube-proxy's ipsets.
//!
//! Left behind, they keep translating what the datapath does not (a packet to a ClusterIP from
//! a namespace the programs do not cover), answer for addresses on `kube-ipvs0`, and cost every
//! packet a walk through stale chains. Chains are recognised by name, from an allow list: the
//! kubelet's `KUBE-` chains ([`KEPT_CHAINS`]) and every other program's chains (DOCKER, cali-,
//! CNI-, kube-router's KUBE-ROUTER-, KUBE-POD-FW-, ...) stay.
//!
//! Reading `iptables-save` and `nft list tables` output and writing the `iptables-restore
//! --noflush` input is pure ([`plan`], [`nft_kube_proxy_tables`]); [`find`] and [`remove`] run
//! the tools in this thread's network namespace.

use std::{
    collections::BTreeSet,
    fmt,
    io::{self, Write as _},
    os::unix::fs::PermissionsExt as _,
    path::{Path, PathBuf},
    process::{Command, ExitStatus, Stdio},
    thread,
    time::{Duration, Instant},
};

use anyhow::{Context as _, Result, anyhow, bail};
use netlink_packet_core::{
    ErrorBuffer, NLM_F_ACK, NLM_F_REQUEST, NLMSG_ERROR, NetlinkBuffer, NetlinkHeader,
    NetlinkMessage, NetlinkPayload,
};
use netlink_packet_route::{RouteNetlinkMessage, link::LinkMessage};
use tracing::{debug, info, warn};

/// The tables kube-proxy writes to.
pub const TABLES: [&str; 3] = ["nat", "filter", "mangle"];

/// The built-in chains kube-proxy jumps to its chains from.
pub const BUILTIN_CHAINS: [&str; 5] = ["PREROUTING", "INPUT", "FORWARD", "OUTPUT", "POSTROUTING"];

/// kube-proxy's chains by name, in whichever of [`TABLES`] they are.
pub const KUBE_PROXY_CHAINS: [&str; 13] = [
    // iptables mode.
    "KUBE-SERVICES",
    "KUBE-EXTERNAL-SERVICES",
    "KUBE-NODEPORTS",
    "KUBE-POSTROUTING",
    "KUBE-MARK-MASQ",
    "KUBE-FORWARD",
    "KUBE-PROXY-FIREWALL",
    // Both modes: kube-proxy's monitor of its own tables being flushed.
    "KUBE-PROXY-CANARY",
    // IPVS mode.
    "KUBE-NODE-PORT",
    "KUBE-LOAD-BALANCER",
    "KUBE-SOURCE-RANGES-FIREWALL",
    "KUBE-IPVS-FILTER",
    "KUBE-IPVS-OUT-FILTER",
];

/// Prefixes of kube-proxy's per-Service and per-endpoint chains (iptables mode): Service
/// (`SVC`, `SVL` for Local traffic policy), endpoint (`SEP`), load-balancer source ranges
/// (`FW`), external traffic (`EXT`) and the older releases' Local policy chains (`XLB`).
pub const KUBE_PROXY_CHAIN_PREFIXES: [&str; 6] = [
    "KUBE-SVC-",
    "KUBE-SVL-",
    "KUBE-SEP-",
    "KUBE-FW-",
    "KUBE-EXT-",
    "KUBE-XLB-",
];

/// `KUBE-` chains left alone on purpose: not kube-proxy's, and `kube-proxy --cleanup` leaves
/// them too.
pub const KEPT_CHAINS: [&str; 4] = [
    // The kubelet's (filter, jumped from INPUT and OUTPUT): drops martian packets to 127/8.
    "KUBE-FIREWALL",
    // The kubelet's (mangle, nat, filter): tells it when the tables were flushed.
    "KUBE-KUBELET-CANARY",
    // The kubelet's (mangle): tells containers which iptables backend the node uses.
    "KUBE-IPTABLES-HINT",
    // The kubelet's in releases before its iptables ownership cleanup; never kube-proxy's to
    // remove.
    "KUBE-MARK-DROP",
];

/// kube-proxy's dummy device in IPVS mode, holding every Service address.
pub const IPVS_LINK: &str = "kube-ipvs0";

/// Prefix of kube-proxy's ipsets (IPVS mode: `KUBE-CLUSTER-IP`, `KUBE-NODE-PORT-TCP`, ...).
pub const IPSET_PREFIX: &str = "KUBE-";

/// ipsets with [`IPSET_PREFIX`] that are not kube-proxy's: kube-router's network policy sets.
pub const KEPT_IPSET_PREFIXES: [&str; 2] = ["KUBE-SRC-", "KUBE-DST-"];

/// Bound on each tool run (`iptables-save` of a large node takes seconds).
const COMMAND_TIMEOUT: Duration = Duration::from_secs(60);

/// Where the tools are looked for when `PATH` is unset.
const DEFAULT_PATH: &str = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";

/// Pure: whether `chain` is kube-proxy's (by name; see the module doc).
pub fn is_kube_proxy_chain(chain: &str) -> bool {
    !KEPT_CHAINS.contains(&chain)
        && (KUBE_PROXY_CHAINS.contains(&chain)
            || KUBE_PROXY_CHAIN_PREFIXES
                .iter()
                .any(|p| chain.starts_with(p)))
}

/// Pure: whether the ipset `name` is kube-proxy's.
pub fn is_kube_proxy_ipset(name: &str) -> bool {
    name.starts_with(IPSET_PREFIX) && !KEPT_IPSET_PREFIXES.iter().any(|p| name.starts_with(p))
}

/// What to remove from one table.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct TablePlan {
    pub table: String,
    /// Rules of built-in chains that jump to kube-proxy's chains: (chain, rule spec as saved).
    pub jumps: Vec<(String, String)>,
    /// kube-proxy's chains: flushed, then deleted.
    pub chains: BTreeSet<String>,
    /// kube-proxy's chains that a chain staying (another program's) jumps to: flushed only, as
    /// deleting them would fail the whole restore.
    pub referenced: BTreeSet<String>,
}

impl TablePlan {
    pub fn is_empty(&self) -> bool {
        self.jumps.is_empty() && self.chains.is_empty() && self.referenced.is_empty()
    }
}

/// What to remove from one backend and family (`iptables-save` output): per table.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Plan {
    pub tables: Vec<TablePlan>,
}

impl Plan {
    pub fn is_empty(&self) -> bool {
        self.tables.iter().all(TablePlan::is_empty)
    }

    /// kube-proxy's chains found, over every table.
    pub fn chain_count(&self) -> usize {
        self.tables
            .iter()
            .map(|t| t.chains.len() + t.referenced.len())
            .sum()
    }

    /// The tables holding something of kube-proxy's.
    pub fn table_names(&self) -> Vec<&str> {
        self.tables
            .iter()
            .filter(|t| !t.is_empty())
            .map(|t| t.table.as_str())
            .collect()
    }

    /// The `iptables-restore --noflush` input: per table, the jumps deleted, then every
    /// kube-proxy chain flushed, then deleted (flushing first drops the jumps between them).
    pub fn restore_input(&self) -> String {
        let mut out = String::new();
        for t in self.tables.iter().filter(|t| !t.is_empty()) {
            out.push('*');
            out.push_str(&t.table);
            out.push('\n');
            for (chain, spec) in &t.jumps {
                out.push_str(&format!("-D {chain} {spec}\n"));
            }
            for chain in t.chains.iter().chain(&t.referenced) {
                out.push_str(&format!("-F {chain}\n"));
            }
            for chain in &t.chains {
                out.push_str(&format!("-X {chain}\n"));
            }
            out.push_str("COMMIT\n");
        }
        out
    }
}

/// One table of `iptables-save` output.
#[derive(Default)]
struct SavedTable {
    name: String,
    chains: Vec<String>,
    /// (chain, rule spec).
    rules: Vec<(String, String)>,
}

/// Pure: the tables of `iptables-save` output (comments and counters skipped).
fn parse_save(save: &str) -> Vec<SavedTable> {
    let mut tables: Vec<SavedTable> = Vec::new();
    for line in save.lines().map(str::trim) {
        // `iptables-save -c` puts the counters first.
        let line = match line.strip_prefix('[') {
            Some(rest) => rest.split_once("] ").map_or(line, |(_, l)| l.trim_start()),
            None => line,
        };
        if let Some(name) = line.strip_prefix('*') {
            tables.push(SavedTable {
                name: name.trim().to_owned(),
                ..SavedTable::default()
            });
            continue;
        }
        let Some(table) = tables.last_mut() else {
            continue;
        };
        if let Some(decl) = line.strip_prefix(':') {
            if let Some(chain) = decl.split_whitespace().next() {
                table.chains.push(chain.to_owned());
            }
        } else if let Some(rule) = line.strip_prefix("-A ") {
            let rule = rule.trim_start();
            if let Some((chain, spec)) = rule.split_once(char::is_whitespace) {
                table.rules.push((chain.to_owned(), spec.trim().to_owned()));
            }
        }
    }
    tables
}

/// Pure: the words of a rule spec as iptables reads them (double quotes group, `\` escapes
/// inside them).
fn words(spec: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut cur = String::new();
    let mut in_word = false;
    let mut quoted = false;
    let mut chars = spec.chars();
    while let Some(c) = chars.next() {
        match c {
            '"' => {
                quoted = !quoted;
                in_word = true;
            }
            '\\' if quoted => {
                if let Some(next) = chars.next() {
                    cur.push(next);
                }
            }
            c if c.is_whitespace() && !quoted => {
                if in_word {
                    out.push(std::mem::take(&mut cur));
                    in_word = false;
                }
            }
            c => {
                cur.push(c);
                in_word = true;
            }
        }
    }
    if in_word {
        out.push(cur);
    }
    out
}

/// Pure: the chain a rule spec jumps or goes to (`-j`, `-g`), if any.
fn jump_target(spec: &str) -> Option<String> {
    let words = words(spec);
    words
        .iter()
        .position(|w| matches!(w.as_str(), "-j" | "--jump" | "-g" | "--goto"))
        .and_then(|i| words.get(i + 1).cloned())
}

/// Pure: what to remove, from `iptables-save` (or `ip6tables-save`) output of one backend.
pub fn plan(save: &str) -> Plan {
    let mut plan = Plan::default();
    for saved in parse_save(save) {
        if !TABLES.contains(&saved.name.as_str()) {
            continue;
        }
        let mut t = TablePlan {
            table: saved.name.clone(),
            ..TablePlan::default()
        };
        let ours: BTreeSet<String> = saved
            .chains
            .iter()
            .filter(|c| is_kube_proxy_chain(c))
            .cloned()
            .collect();
        for (chain, spec) in &saved.rules {
            let Some(target) = jump_target(spec).filter(|target| ours.contains(target)) else {
                continue;
            };
            if BUILTIN_CHAINS.contains(&chain.as_str()) {
                t.jumps.push((chain.clone(), spec.clone()));
            } else if !ours.contains(chain) {
                t.referenced.insert(target);
            }
        }
        t.chains = ours.difference(&t.referenced).cloned().collect();
        if !t.is_empty() {
            plan.tables.push(t);
        }
    }
    plan
}

/// An nftables table: family (`ip`, `ip6`) and name.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct NftTable {
    pub family: String,
    pub name: String,
}

impl fmt::Display for NftTable {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "table {} {}", self.family, self.name)
    }
}

/// Pure: kube-proxy's tables (nftables mode) in `nft list tables` output.
pub fn nft_kube_proxy_tables(list: &str) -> Vec<NftTable> {
    list.lines()
        .filter_map(|line| {
            let mut w = line.split_whitespace();
            match (w.next(), w.next(), w.next(), w.next()) {
                (Some("table"), Some(family @ ("ip" | "ip6")), Some("kube-proxy"), None) => {
                    Some(NftTable {
                        family: family.to_owned(),
                        name: "kube-proxy".to_owned(),
                    })
                }
                _ => None,
            }
        })
        .collect()
}

/// The chain [`nft_emptying`] leaves in kube-proxy's emptied tables: one rule whose `ct`
/// expression keeps conntrack running in the namespace.
pub const CONNTRACK_USER_CHAIN: &str = "conntrack-user";

/// Pure: the `nft -f` input that empties kube-proxy's `table` (`listing`: its `nft list table`
/// output, `None` when it does not exist) and keeps what connections netfilter still translates
/// need. NAT of an established connection needs a NAT chain registered (kube-proxy's stay,
/// flushed; in iptables mode the nat table's built-in chains do) and conntrack running, which the
/// kernel stops in a namespace once no rule uses it: kube-proxy's rules were often the last, so
/// the same transaction adds a rule that does, in a chain of the table's own. A later start with
/// none of those connections left deletes the table.
pub fn nft_emptying(table: &NftTable, listing: Option<&str>) -> String {
    let (family, name) = (&table.family, &table.name);
    let mut input = format!("add table {family} {name}\n");
    for line in listing.unwrap_or_default().lines() {
        let mut w = line.split_whitespace();
        if let (Some("chain"), Some(chain), Some("{")) = (w.next(), w.next(), w.next()) {
            input += &format!("flush chain {family} {name} {chain}\n");
        }
    }
    input += &format!(
        "add chain {family} {name} {CONNTRACK_USER_CHAIN}\n\
         add rule {family} {name} {CONNTRACK_USER_CHAIN} ct state established,related counter \
         comment \"keeps conntrack on for connections netfilter still translates\"\n"
    );
    input
}

/// Empties kube-proxy's `table` (created when missing) in one transaction: see [`nft_emptying`].
fn empty_nft_table(nft: &Path, table: &NftTable, exists: bool) -> Result<String> {
    let listing = if exists {
        Some(run(
            nft,
            &["list", "table", &table.family, &table.name],
            None,
        )?)
    } else {
        None
    };
    run(
        nft,
        &["-f", "-"],
        Some(&nft_emptying(table, listing.as_deref())),
    )
}

/// Pure: the number of virtual servers in `ipvsadm -Ln` output.
pub fn ipvs_virtual_servers(list: &str) -> usize {
    list.lines()
        .filter(|l| {
            let first = l.split_whitespace().next().unwrap_or_default();
            !l.starts_with(char::is_whitespace) && matches!(first, "TCP" | "UDP" | "SCTP" | "FWM")
        })
        .count()
}

/// Pure: the backend an `iptables-save --version` line names (`nf_tables`, `legacy`).
fn backend_mode(version: &str) -> Option<String> {
    let open = version.rfind('(')?;
    let close = version[open..].find(')')? + open;
    Some(version[open + 1..close].to_owned())
}

/// IPv4 or IPv6 iptables.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Family {
    V4,
    V6,
}

impl Family {
    fn tool(self) -> &'static str {
        match self {
            Self::V4 => "iptables",
            Self::V6 => "ip6tables",
        }
    }
}

/// One iptables backend of one family, by its tools.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Backend {
    pub family: Family,
    /// `iptables-nft-save`, `ip6tables-legacy-save`, ... (a path).
    pub save: PathBuf,
    pub restore: PathBuf,
    /// `nf_tables`, `legacy`, as the tool's version says.
    pub mode: String,
}

impl fmt::Display for Backend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} ({})", self.family.tool(), self.mode)
    }
}

/// kube-proxy's iptables chains in one backend.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct IptablesLeftovers {
    pub backend: Backend,
    pub plan: Plan,
}

/// kube-proxy's leftovers in this network namespace.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Leftovers {
    pub iptables: Vec<IptablesLeftovers>,
    pub nft_tables: Vec<NftTable>,
    /// [`IPVS_LINK`] exists.
    pub ipvs_link: bool,
    /// IPVS virtual servers; `None` when not looked at (no sign of IPVS mode, or no ipvsadm).
    pub ipvs_virtual_servers: Option<usize>,
    pub ipsets: Vec<String>,
    /// iptables backends whose rules could not be read (the legacy one without CAP_NET_RAW):
    /// reported, never removed.
    pub unreadable: Vec<String>,
}

impl Leftovers {
    pub fn is_empty(&self) -> bool {
        self.unreadable.is_empty()
            && self.iptables.is_empty()
            && self.nft_tables.is_empty()
            && !self.ipvs_link
            && self.ipvs_virtual_servers.unwrap_or(0) == 0
            && self.ipsets.is_empty()
    }

    /// One line for the log: `iptables (nf_tables): 37 KUBE- chains in nat, filter; nftables:
    /// table ip kube-proxy; kube-ipvs0`.
    pub fn summary(&self) -> String {
        self.to_string()
    }
}

impl fmt::Display for Leftovers {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut parts = Vec::new();
        for ipt in &self.iptables {
            parts.push(format!(
                "{}: {} KUBE- chains in {}",
                ipt.backend,
                ipt.plan.chain_count(),
                ipt.plan.table_names().join(", ")
            ));
        }
        if !self.nft_tables.is_empty() {
            let tables: Vec<String> = self.nft_tables.iter().map(ToString::to_string).collect();
            parts.push(format!("nftables: {}", tables.join(", ")));
        }
        if self.ipvs_link {
            parts.push(IPVS_LINK.to_owned());
        }
        if let Some(n) = self.ipvs_virtual_servers.filter(|n| *n > 0) {
            parts.push(format!("{n} IPVS virtual servers"));
        }
        if !self.ipsets.is_empty() {
            parts.push(format!("{} KUBE- ipsets", self.ipsets.len()));
        }
        for u in &self.unreadable {
            parts.push(format!("not readable: {u}"));
        }
        if parts.is_empty() {
            f.write_str("nothing")
        } else {
            f.write_str(&parts.join("; "))
        }
    }
}

/// What [`remove`] removed (same shape as what [`find`] found).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Removed {
    pub removed: Leftovers,
    /// kube-proxy's nftables tables emptied instead (their chains and hooks kept): connections
    /// netfilter still translates need its NAT hooks.
    pub emptied: Vec<NftTable>,
}

impl Removed {
    pub fn summary(&self) -> String {
        self.to_string()
    }
}

impl fmt::Display for Removed {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.removed.fmt(f)?;
        if !self.emptied.is_empty() {
            let tables: Vec<String> = self.emptied.iter().map(ToString::to_string).collect();
            write!(
                f,
                "; emptied, kept for the connections netfilter still translates: {}",
                tables.join(", ")
            )?;
        }
        Ok(())
    }
}

/// kube-proxy's leftovers in this thread's network namespace. Tools that are not installed
/// are skipped (their part is not looked at).
pub fn find() -> Result<Leftovers> {
    let mut found = Leftovers::default();
    for family in [Family::V4, Family::V6] {
        for backend in backends(family) {
            let save = match run(&backend.save, &[], None) {
                Ok(save) => save,
                Err(e) => {
                    found.unreadable.push(format!("{backend}: {e:#}"));
                    continue;
                }
            };
            let plan = plan(&save);
            debug!(backend = %backend, chains = plan.chain_count(), "kube-proxy's iptables chains");
            if !plan.is_empty() {
                found.iptables.push(IptablesLeftovers { backend, plan });
            }
        }
    }
    if let Some(nft) = which("nft") {
        found.nft_tables = nft_kube_proxy_tables(&run(&nft, &["list", "tables"], None)?);
    }
    found.ipvs_link = ipvs_link()?.is_some();
    if let Some(ipset) = which("ipset") {
        found.ipsets = run(&ipset, &["list", "-n"], None)?
            .lines()
            .map(str::trim)
            .filter(|n| is_kube_proxy_ipset(n))
            .map(String::from)
            .collect();
    }
    // kube-proxy's IPVS mode ran here: its virtual servers are looked for (not otherwise: they
    // may be another program's).
    if found.ipvs_link || !found.ipsets.is_empty() {
        match which("ipvsadm") {
            Some(ipvsadm) => {
                let list = run(&ipvsadm, &["-Ln"], None)?;
                found.ipvs_virtual_servers = Some(ipvs_virtual_servers(&list));
            }
            None => info!(
                "{IPVS_LINK} or kube-proxy's ipsets exist but ipvsadm is not installed: IPVS \
                 virtual servers could not be checked"
            ),
        }
    }
    Ok(found)
}

/// Removes `found` (from [`find`]): the iptables parts read again just before (what changed
/// since is taken into account), then the nftables tables, the IPVS virtual servers,
/// [`IPVS_LINK`] and the ipsets (last: iptables rules may refer to them). With
/// `netfilter_keeps` connections that netfilter still translates, the nftables tables are
/// emptied, not deleted, and made to keep conntrack on ([`nft_emptying`]). Every part is tried;
/// the error names each one that failed.
pub fn remove(found: &Leftovers, netfilter_keeps: usize) -> Result<Removed> {
    let mut removed = Leftovers::default();
    let mut emptied = Vec::new();
    let mut errors: Vec<anyhow::Error> = Vec::new();
    for ipt in &found.iptables {
        match remove_iptables(&ipt.backend) {
            Ok(Some(plan)) => removed.iptables.push(IptablesLeftovers {
                backend: ipt.backend.clone(),
                plan,
            }),
            Ok(None) => {}
            Err(e) => errors.push(e),
        }
    }
    if netfilter_keeps > 0 {
        info!(
            netfilter_keeps,
            "emptying kube-proxy's nftables tables instead of deleting them: connections \
             netfilter translates need their NAT hooks and conntrack"
        );
        match which("nft") {
            Some(nft) => {
                for family in ["ip", "ip6"] {
                    let table = NftTable {
                        family: family.to_owned(),
                        name: "kube-proxy".to_owned(),
                    };
                    let exists = found.nft_tables.contains(&table);
                    match empty_nft_table(&nft, &table, exists) {
                        Ok(_) => emptied.push(table),
                        Err(e) => errors.push(e.context(format!(
                            "keeping conntrack on for the connections netfilter translates \
                             ({family})"
                        ))),
                    }
                }
            }
            None => errors.push(anyhow!(
                "nft is not installed: conntrack may stop, and with it the connections \
                 netfilter translates, once kube-proxy's rules are gone"
            )),
        }
    } else if !found.nft_tables.is_empty() {
        match which("nft") {
            Some(nft) => {
                for table in &found.nft_tables {
                    let args = ["delete", "table", &table.family, &table.name];
                    match run(&nft, &args, None) {
                        Ok(_) => removed.nft_tables.push(table.clone()),
                        Err(e) if format!("{e:#}").contains("No such file") => {}
                        Err(e) => errors.push(e),
                    }
                }
            }
            None => errors.push(anyhow!("nft is no longer installed")),
        }
    }
    if let Some(n) = found.ipvs_virtual_servers.filter(|n| *n > 0) {
        match which("ipvsadm").map(|ipvsadm| run(&ipvsadm, &["-C"], None)) {
            Some(Ok(_)) => removed.ipvs_virtual_servers = Some(n),
            Some(Err(e)) => errors.push(e),
            None => errors.push(anyhow!("ipvsadm is no longer installed")),
        }
    }
    if found.ipvs_link {
        match ipvs_link().and_then(|link| link.map(delete_link).transpose()) {
            Ok(Some(())) => removed.ipvs_link = true,
            Ok(None) => {}
            Err(e) => errors.push(e),
        }
    }
    if !found.ipsets.is_empty() {
        match which("ipset") {
            Some(ipset) => {
                for name in &found.ipsets {
                    match run(&ipset, &["destroy", name], None) {
                        Ok(_) => removed.ipsets.push(name.clone()),
                        Err(e) if format!("{e:#}").contains("does not exist") => {}
                        Err(e) => errors.push(e),
                    }
                }
            }
            None => errors.push(anyhow!("ipset is no longer installed")),
        }
    }
    errors.extend(
        (found.unreadable.iter()).map(|u| anyhow!("kube-proxy's rules, if any, stay in {u}")),
    );
    let removed = Removed { removed, emptied };
    if errors.is_empty() {
        return Ok(removed);
    }
    let all: Vec<String> = errors.iter().map(|e| format!("{e:#}")).collect();
    if !removed.removed.is_empty() || !removed.emptied.is_empty() {
        warn!("removed part of kube-proxy's rules: {removed}");
    }
    bail!("{}", all.join("; "))
}

/// Reads `backend`'s tables again and removes kube-proxy's part. The plan carried out, `None`
/// when nothing was left.
fn remove_iptables(backend: &Backend) -> Result<Option<Plan>> {
    let plan = plan(&run(&backend.save, &[], None)?);
    if plan.is_empty() {
        return Ok(None);
    }
    let input = plan.restore_input();
    run(&backend.restore, &["--noflush", "-w", "5"], Some(&input))
        .with_context(|| format!("removing kube-proxy's chains ({backend}) with:\n{input}"))?;
    Ok(Some(plan))
}

/// The iptables backends of `family` whose tools are installed, one per mode: `-nft` and
/// `-legacy` explicitly, and the selected one when it is neither (an unknown build).
fn backends(family: Family) -> Vec<Backend> {
    let tool = family.tool();
    let mut out: Vec<Backend> = Vec::new();
    for suffix in ["-nft", "-legacy", ""] {
        let (Some(save), Some(restore)) = (
            which(&format!("{tool}{suffix}-save")),
            which(&format!("{tool}{suffix}-restore")),
        ) else {
            continue;
        };
        let mode = match run(&save, &["--version"], None) {
            Ok(version) => backend_mode(&version).unwrap_or_else(|| version.trim().to_owned()),
            Err(e) => {
                warn!("{e:#}; skipping this iptables backend");
                continue;
            }
        };
        if out.iter().any(|b| b.mode == mode) {
            continue;
        }
        out.push(Backend {
            family,
            save,
            restore,
            mode,
        });
    }
    out
}

/// The executable `name` in `PATH`.
fn which(name: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH").unwrap_or_else(|| DEFAULT_PATH.into());
    std::env::split_paths(&path)
        .map(|dir| dir.join(name))
        .find(|p| {
            std::fs::metadata(p).is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
        })
}

/// Runs `program args` with `stdin`, within [`COMMAND_TIMEOUT`]: its stdout, or an error
/// naming the command and its stderr.
fn run(program: &Path, args: &[&str], stdin: Option<&str>) -> Result<String> {
    let what = std::iter::once(program.display().to_string())
        .chain(args.iter().map(|a| (*a).to_owned()))
        .collect::<Vec<_>>()
        .join(" ");
    let mut child = Command::new(program)
        .args(args)
        .stdin(if stdin.is_some() {
            Stdio::piped()
        } else {
            Stdio::null()
        })
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .with_context(|| format!("`{what}`"))?;
    if let (Some(mut pipe), Some(input)) = (child.stdin.take(), stdin) {
        let input = input.to_owned();
        // A thread: the tool may fill its output pipes before reading all of its input.
        thread::spawn(move || pipe.write_all(input.as_bytes()));
    }
    let stdout = reader(child.stdout.take());
    let stderr = reader(child.stderr.take());
    let deadline = Instant::now() + COMMAND_TIMEOUT;
    let status: ExitStatus = loop {
        if let Some(status) = child.try_wait().with_context(|| format!("`{what}`"))? {
            break status;
        }
        if Instant::now() >= deadline {
            let _ = child.kill();
            let _ = child.wait();
            bail!("`{what}` did not finish within {COMMAND_TIMEOUT:?}; killed");
        }
        thread::sleep(Duration::from_millis(5));
    };
    let stdout = stdout.join().unwrap_or_default();
    let stderr = stderr.join().unwrap_or_default();
    if !status.success() {
        bail!("`{what}` failed ({status}): {}", stderr.trim());
    }
    Ok(stdout)
}

/// Reads `pipe` to its end on a thread.
fn reader<R: io::Read + Send + 'static>(pipe: Option<R>) -> thread::JoinHandle<String> {
    thread::spawn(move || {
        let mut buf = Vec::new();
        if let Some(mut pipe) = pipe {
            let _ = pipe.read_to_end(&mut buf);
        }
        String::from_utf8_lossy(&buf).into_owned()
    })
}

/// The ifindex of [`IPVS_LINK`], if it exists.
fn ipvs_link() -> Result<Option<u32>> {
    let links = super::links::dump().context("listing links (RTM_GETLINK)")?;
    Ok(links.iter().find(|l| l.name == IPVS_LINK).map(|l| {
        if l.kind.as_deref() != Some("dummy") {
            debug!(kind = ?l.kind, "{IPVS_LINK} is not a dummy device");
        }
        l.index
    }))
}

/// Deletes the link `index` (`RTM_DELLINK`); gone already is fine.
fn delete_link(index: u32) -> Result<()> {
    let mut link = LinkMessage::default();
    link.header.index = index;
    let mut msg = NetlinkMessage::new(
        NetlinkHeader::default(),
        NetlinkPayload::from(RouteNetlinkMessage::DelLink(link)),
    );
    msg.header.flags = NLM_F_REQUEST | NLM_F_ACK;
    msg.header.sequence_number = 1;
    msg.finalize();
    let mut request = vec![0u8; msg.buffer_len()];
    msg.serialize(&mut request);
    let what = || format!("deleting {IPVS_LINK} (RTM_DELLINK)");
    let socket = super::netlink::route_socket(0).with_context(what)?;
    socket.send(&request, 0).with_context(what)?;
    let mut buf = vec![0u8; 8192];
    // The answer is one NLMSG_ERROR (0: done); anything else before it is skipped.
    for _ in 0..16 {
        let n = socket.recv(&mut &mut buf[..], 0).with_context(what)?;
        match ack_code(&buf[..n.min(buf.len())]) {
            Some(0) => return Ok(()),
            Some(errno) if errno == libc::ENODEV => return Ok(()),
            Some(errno) => return Err(io::Error::from_raw_os_error(errno)).with_context(what),
            None => {}
        }
    }
    bail!("{}: no answer from the kernel", what())
}

/// Pure: the errno of the first `NLMSG_ERROR` in a datagram (0 for an acknowledgement).
fn ack_code(mut b: &[u8]) -> Option<i32> {
    while let Ok(msg) = NetlinkBuffer::new_checked(b) {
        let len = msg.length() as usize;
        if msg.message_type() == NLMSG_ERROR {
            let code = ErrorBuffer::new_checked(msg.payload()).ok()?.code();
            return Some(code.map_or(0, |c| -c.get()));
        }
        b = b.get(len.next_multiple_of(4).max(1)..).unwrap_or_default();
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A node's `iptables-save` after kube-proxy (iptables mode, a ClusterIP Service with two
    /// endpoints, a NodePort one with one), the kubelet, Docker and a CNI's portmap ran there.
    const NODE_SAVE: &str = r#"# Generated by iptables-nft-save v1.8.9 on Sat Dec  5 10:00:00 2026
*mangle
:PREROUTING ACCEPT [0:0]
:INPUT ACCEPT [0:0]
:FORWARD ACCEPT [0:0]
:OUTPUT ACCEPT [0:0]
:POSTROUTING ACCEPT [0:0]
:KUBE-IPTABLES-HINT - [0:0]
:KUBE-KUBELET-CANARY - [0:0]
:KUBE-PROXY-CANARY - [0:0]
COMMIT
# Completed on Sat Dec  5 10:00:00 2026
# Generated by iptables-nft-save v1.8.9 on Sat Dec  5 10:00:00 2026
*filter
:INPUT ACCEPT [0:0]
:FORWARD DROP [0:0]
:OUTPUT ACCEPT [0:0]
:DOCKER - [0:0]
:DOCKER-USER - [0:0]
:KUBE-EXTERNAL-SERVICES - [0:0]
:KUBE-FIREWALL - [0:0]
:KUBE-FORWARD - [0:0]
:KUBE-KUBELET-CANARY - [0:0]
:KUBE-NODEPORTS - [0:0]
:KUBE-PROXY-CANARY - [0:0]
:KUBE-PROXY-FIREWALL - [0:0]
:KUBE-SERVICES - [0:0]
-A INPUT -m conntrack --ctstate NEW -m comment --comment "kubernetes load balancer firewall" -j KUBE-PROXY-FIREWALL
-A INPUT -m comment --comment "kubernetes health check service ports" -j KUBE-NODEPORTS
-A INPUT -m conntrack --ctstate NEW -m comment --comment "kubernetes externally-visible service portals" -j KUBE-EXTERNAL-SERVICES
-A INPUT -j KUBE-FIREWALL
-A FORWARD -m conntrack --ctstate NEW -m comment --comment "kubernetes load balancer firewall" -j KUBE-PROXY-FIREWALL
-A FORWARD -m comment --comment "kubernetes forwarding rules" -j KUBE-FORWARD
-A FORWARD -m conntrack --ctstate NEW -m comment --comment "kubernetes service portals" -j KUBE-SERVICES
-A FORWARD -j DOCKER-USER
-A FORWARD -o docker0 -j DOCKER
-A OUTPUT -m conntrack --ctstate NEW -m comment --comment "kubernetes load balancer firewall" -j KUBE-PROXY-FIREWALL
-A OUTPUT -m conntrack --ctstate NEW -m comment --comment "kubernetes service portals" -j KUBE-SERVICES
-A OUTPUT -j KUBE-FIREWALL
-A DOCKER-USER -j RETURN
-A KUBE-FIREWALL ! -s 127.0.0.0/8 -d 127.0.0.0/8 -m comment --comment "block incoming localnet connections" -m conntrack ! --ctstate RELATED,ESTABLISHED,DNAT -j DROP
-A KUBE-FORWARD -m conntrack --ctstate INVALID -j DROP
-A KUBE-FORWARD -m comment --comment "kubernetes forwarding rules" -m mark --mark 0x4000/0x4000 -j ACCEPT
-A KUBE-FORWARD -m comment --comment "kubernetes forwarding conntrack rule" -m conntrack --ctstate RELATED,ESTABLISHED -j ACCEPT
COMMIT
# Completed on Sat Dec  5 10:00:00 2026
# Generated by iptables-nft-save v1.8.9 on Sat Dec  5 10:00:00 2026
*nat
:PREROUTING ACCEPT [0:0]
:INPUT ACCEPT [0:0]
:OUTPUT ACCEPT [0:0]
:POSTROUTING ACCEPT [0:0]
:CNI-HOSTPORT-DNAT - [0:0]
:CNI-HOSTPORT-MASQ - [0:0]
:DOCKER - [0:0]
:KUBE-EXT-BF2LB5WJRBPLA42J - [0:0]
:KUBE-KUBELET-CANARY - [0:0]
:KUBE-MARK-MASQ - [0:0]
:KUBE-NODEPORTS - [0:0]
:KUBE-POSTROUTING - [0:0]
:KUBE-PROXY-CANARY - [0:0]
:KUBE-SEP-6E7XQMQ4RAYOWTTM - [0:0]
:KUBE-SEP-IT2ZTR26TO4XFPTO - [0:0]
:KUBE-SEP-N4G2XR5TDX7PQE7P - [0:0]
:KUBE-SERVICES - [0:0]
:KUBE-SVC-ERIFXISQEP7F7OF4 - [0:0]
:KUBE-SVC-BF2LB5WJRBPLA42J - [0:0]
-A PREROUTING -m comment --comment "kubernetes service portals" -j KUBE-SERVICES
-A PREROUTING -m addrtype --dst-type LOCAL -j DOCKER
-A PREROUTING -m addrtype --dst-type LOCAL -j CNI-HOSTPORT-DNAT
-A OUTPUT -m comment --comment "kubernetes service portals" -j KUBE-SERVICES
-A OUTPUT ! -d 127.0.0.0/8 -m addrtype --dst-type LOCAL -j DOCKER
-A POSTROUTING -m comment --comment "kubernetes postrouting rules" -j KUBE-POSTROUTING
-A POSTROUTING -s 172.17.0.0/16 ! -o docker0 -j MASQUERADE
-A POSTROUTING -m comment --comment "CNI portfwd requiring masquerade" -j CNI-HOSTPORT-MASQ
-A CNI-HOSTPORT-MASQ -m mark --mark 0x2000/0x2000 -j MASQUERADE
-A DOCKER -i docker0 -j RETURN
-A KUBE-EXT-BF2LB5WJRBPLA42J -m comment --comment "masquerade traffic for demo/web:http external destinations" -j KUBE-MARK-MASQ
-A KUBE-EXT-BF2LB5WJRBPLA42J -j KUBE-SVC-BF2LB5WJRBPLA42J
-A KUBE-MARK-MASQ -j MARK --set-xmark 0x4000/0x4000
-A KUBE-NODEPORTS -p tcp -m comment --comment "demo/web:http" -m tcp --dport 30080 -j KUBE-EXT-BF2LB5WJRBPLA42J
-A KUBE-POSTROUTING -m mark ! --mark 0x4000/0x4000 -j RETURN
-A KUBE-POSTROUTING -j MARK --set-xmark 0x4000/0x0
-A KUBE-POSTROUTING -m comment --comment "kubernetes service traffic requiring SNAT" -j MASQUERADE --random-fully
-A KUBE-SEP-6E7XQMQ4RAYOWTTM -s 10.244.1.11/32 -m comment --comment "kube-system/kube-dns:dns-tcp" -j KUBE-MARK-MASQ
-A KUBE-SEP-6E7XQMQ4RAYOWTTM -p tcp -m comment --comment "kube-system/kube-dns:dns-tcp" -m tcp -j DNAT --to-destination 10.244.1.11:53
-A KUBE-SEP-IT2ZTR26TO4XFPTO -s 10.244.1.12/32 -m comment --comment "kube-system/kube-dns:dns-tcp" -j KUBE-MARK-MASQ
-A KUBE-SEP-IT2ZTR26TO4XFPTO -p tcp -m comment --comment "kube-system/kube-dns:dns-tcp" -m tcp -j DNAT --to-destination 10.244.1.12:53
-A KUBE-SEP-N4G2XR5TDX7PQE7P -s 10.244.2.5/32 -m comment --comment "demo/web:http" -j KUBE-MARK-MASQ
-A KUBE-SEP-N4G2XR5TDX7PQE7P -p tcp -m comment --comment "demo/web:http" -m tcp -j DNAT --to-destination 10.244.2.5:8080
-A KUBE-SERVICES -d 10.96.0.10/32 -p tcp -m comment --comment "kube-system/kube-dns:dns-tcp cluster IP" -m tcp --dport 53 -j KUBE-SVC-ERIFXISQEP7F7OF4
-A KUBE-SERVICES -d 10.96.10.10/32 -p tcp -m comment --comment "demo/web:http cluster IP" -m tcp --dport 80 -j KUBE-SVC-BF2LB5WJRBPLA42J
-A KUBE-SERVICES -m comment --comment "kubernetes service nodeports; NOTE: this must be the last rule in this chain" -m addrtype --dst-type LOCAL -j KUBE-NODEPORTS
-A KUBE-SVC-BF2LB5WJRBPLA42J ! -s 10.244.0.0/16 -d 10.96.10.10/32 -p tcp -m comment --comment "demo/web:http cluster IP" -m tcp --dport 80 -j KUBE-MARK-MASQ
-A KUBE-SVC-BF2LB5WJRBPLA42J -m comment --comment "demo/web:http -> 10.244.2.5:8080" -j KUBE-SEP-N4G2XR5TDX7PQE7P
-A KUBE-SVC-ERIFXISQEP7F7OF4 ! -s 10.244.0.0/16 -d 10.96.0.10/32 -p tcp -m comment --comment "kube-system/kube-dns:dns-tcp cluster IP" -m tcp --dport 53 -j KUBE-MARK-MASQ
-A KUBE-SVC-ERIFXISQEP7F7OF4 -m comment --comment "kube-system/kube-dns:dns-tcp -> 10.244.1.11:53" -m statistic --mode random --probability 0.50000000000 -j KUBE-SEP-6E7XQMQ4RAYOWTTM
-A KUBE-SVC-ERIFXISQEP7F7OF4 -m comment --comment "kube-system/kube-dns:dns-tcp -> 10.244.1.12:53" -j KUBE-SEP-IT2ZTR26TO4XFPTO
COMMIT
# Completed on Sat Dec  5 10:00:00 2026
"#;

    fn table<'a>(plan: &'a Plan, name: &str) -> &'a TablePlan {
        plan.tables
            .iter()
            .find(|t| t.table == name)
            .unwrap_or_else(|| panic!("no {name} in {plan:?}"))
    }

    #[test]
    fn a_node_s_rules_lose_kube_proxy_s_jumps_and_chains_only() {
        let plan = plan(NODE_SAVE);
        let nat = table(&plan, "nat");
        let jumps: Vec<&str> = nat.jumps.iter().map(|(c, _)| c.as_str()).collect();
        assert_eq!(jumps, ["PREROUTING", "OUTPUT", "POSTROUTING"]);
        assert_eq!(
            nat.jumps[0].1,
            "-m comment --comment \"kubernetes service portals\" -j KUBE-SERVICES"
        );
        let chains: Vec<&str> = nat.chains.iter().map(String::as_str).collect();
        assert_eq!(
            chains,
            [
                "KUBE-EXT-BF2LB5WJRBPLA42J",
                "KUBE-MARK-MASQ",
                "KUBE-NODEPORTS",
                "KUBE-POSTROUTING",
                "KUBE-PROXY-CANARY",
                "KUBE-SEP-6E7XQMQ4RAYOWTTM",
                "KUBE-SEP-IT2ZTR26TO4XFPTO",
                "KUBE-SEP-N4G2XR5TDX7PQE7P",
                "KUBE-SERVICES",
                "KUBE-SVC-BF2LB5WJRBPLA42J",
                "KUBE-SVC-ERIFXISQEP7F7OF4",
            ]
        );
        assert!(nat.referenced.is_empty());

        let filter = table(&plan, "filter");
        assert_eq!(filter.jumps.len(), 8, "{:?}", filter.jumps);
        assert!(
            filter
                .jumps
                .iter()
                .all(|(_, spec)| !spec.contains("KUBE-FIREWALL") && !spec.contains("DOCKER"))
        );
        let chains: Vec<&str> = filter.chains.iter().map(String::as_str).collect();
        assert_eq!(
            chains,
            [
                "KUBE-EXTERNAL-SERVICES",
                "KUBE-FORWARD",
                "KUBE-NODEPORTS",
                "KUBE-PROXY-CANARY",
                "KUBE-PROXY-FIREWALL",
                "KUBE-SERVICES",
            ]
        );

        let mangle = table(&plan, "mangle");
        assert!(mangle.jumps.is_empty());
        assert_eq!(
            mangle.chains.iter().collect::<Vec<_>>(),
            ["KUBE-PROXY-CANARY"]
        );
        assert_eq!(plan.chain_count(), 18);
        assert_eq!(plan.table_names(), ["mangle", "filter", "nat"]);
    }

    #[test]
    fn the_restore_input_deletes_jumps_then_flushes_then_deletes_chains() {
        let input = plan(NODE_SAVE).restore_input();
        for line in input.lines() {
            let kept = KEPT_CHAINS
                .iter()
                .chain(&[
                    "DOCKER",
                    "DOCKER-USER",
                    "CNI-HOSTPORT-DNAT",
                    "CNI-HOSTPORT-MASQ",
                ])
                .any(|c| line.split_whitespace().any(|w| w == *c));
            assert!(!kept, "touches a chain that stays: {line}");
        }
        let nat_start = input.find("*nat\n").expect("nat");
        let nat = &input[nat_start..];
        let nat = &nat[..nat.find("COMMIT\n").expect("COMMIT")];
        let first_f = nat.find("\n-F ").expect("-F");
        let first_x = nat.find("\n-X ").expect("-X");
        let last_d = nat.rfind("\n-D ").expect("-D");
        assert!(last_d < first_f && first_f < first_x, "{nat}");
        assert!(nat.contains(
            "-D POSTROUTING -m comment --comment \"kubernetes postrouting rules\" -j KUBE-POSTROUTING\n"
        ));
        assert!(nat.contains("-X KUBE-SVC-ERIFXISQEP7F7OF4\n"));
        assert_eq!(nat.matches("\n-F ").count(), nat.matches("\n-X ").count());
        assert_eq!(input.matches("COMMIT\n").count(), 3);
        assert!(input.contains("*mangle\n-F KUBE-PROXY-CANARY\n-X KUBE-PROXY-CANARY\nCOMMIT\n"));
    }

    #[test]
    fn the_kubelet_s_and_other_programs_chains_alone_need_nothing() {
        let save = "*filter\n:INPUT ACCEPT [0:0]\n:KUBE-FIREWALL - [0:0]\n:cali-INPUT - [0:0]\n\
                    :KUBE-ROUTER-INPUT - [0:0]\n-A INPUT -j KUBE-FIREWALL\n-A INPUT -j cali-INPUT\n\
                    -A INPUT -j KUBE-ROUTER-INPUT\nCOMMIT\n*nat\n:PREROUTING ACCEPT [0:0]\n\
                    :KUBE-MARK-DROP - [0:0]\n:KUBE-KUBELET-CANARY - [0:0]\nCOMMIT\n";
        let plan = plan(save);
        assert!(plan.is_empty(), "{plan:?}");
        assert_eq!(plan.restore_input(), "");
    }

    #[test]
    fn a_chain_another_program_jumps_to_is_flushed_not_deleted() {
        let save = "*nat\n:PREROUTING ACCEPT [0:0]\n:KUBE-SERVICES - [0:0]\n:KUBE-SVC-A - [0:0]\n\
                    :cali-PREROUTING - [0:0]\n-A PREROUTING -j cali-PREROUTING\n\
                    -A cali-PREROUTING -j KUBE-SERVICES\n-A KUBE-SERVICES -j KUBE-SVC-A\nCOMMIT\n";
        let plan = plan(save);
        let nat = table(&plan, "nat");
        assert!(nat.jumps.is_empty());
        assert_eq!(nat.referenced.iter().collect::<Vec<_>>(), ["KUBE-SERVICES"]);
        assert_eq!(nat.chains.iter().collect::<Vec<_>>(), ["KUBE-SVC-A"]);
        assert_eq!(
            plan.restore_input(),
            "*nat\n-F KUBE-SVC-A\n-F KUBE-SERVICES\n-X KUBE-SVC-A\nCOMMIT\n"
        );
    }

    #[test]
    fn counters_gotos_and_quoted_words_are_read() {
        let save = "*nat\n:OUTPUT ACCEPT [4:240]\n:KUBE-SERVICES - [0:0]\n\
                    [3:180] -A OUTPUT -m comment --comment \"say \\\"-j X\\\" here\" -g KUBE-SERVICES\n\
                    COMMIT\n";
        let plan = plan(save);
        let nat = table(&plan, "nat");
        assert_eq!(
            nat.jumps,
            [(
                "OUTPUT".to_owned(),
                "-m comment --comment \"say \\\"-j X\\\" here\" -g KUBE-SERVICES".to_owned()
            )]
        );
        assert_eq!(
            words("-m comment --comment \"a \\\"b\\\" c\" -j Y"),
            ["-m", "comment", "--comment", "a \"b\" c", "-j", "Y"]
        );
        assert_eq!(
            jump_target("-p tcp -j DNAT --to-destination 1.2.3.4:80").as_deref(),
            Some("DNAT")
        );
        assert_eq!(jump_target("-p tcp -m tcp --dport 80"), None);
    }

    #[test]
    fn ipvs_mode_chains_are_kube_proxy_s() {
        for chain in [
            "KUBE-NODE-PORT",
            "KUBE-LOAD-BALANCER",
            "KUBE-IPVS-FILTER",
            "KUBE-IPVS-OUT-FILTER",
            "KUBE-SOURCE-RANGES-FIREWALL",
            "KUBE-XLB-ABC",
            "KUBE-FW-ABC",
            "KUBE-SVL-ABC",
        ] {
            assert!(is_kube_proxy_chain(chain), "{chain}");
        }
        for chain in KEPT_CHAINS.iter().chain(&[
            "DOCKER",
            "KUBE-ROUTER-FORWARD",
            "KUBE-POD-FW-X",
            "CNI-abc",
            "cali-fw-x",
        ]) {
            assert!(!is_kube_proxy_chain(chain), "{chain}");
        }
        assert!(is_kube_proxy_ipset("KUBE-CLUSTER-IP"));
        assert!(is_kube_proxy_ipset("KUBE-6-NODE-PORT-TCP"));
        assert!(!is_kube_proxy_ipset("KUBE-SRC-ABC"));
        assert!(!is_kube_proxy_ipset("cali40all-hosts"));
    }

    #[test]
    fn nft_tables_of_kube_proxy_are_found() {
        let list = "table ip nat\ntable ip filter\ntable ip kube-proxy\ntable ip6 kube-proxy\n\
                    table inet kube-proxy-x\ntable inet cilium\n";
        let tables = nft_kube_proxy_tables(list);
        let names: Vec<String> = tables.iter().map(ToString::to_string).collect();
        assert_eq!(names, ["table ip kube-proxy", "table ip6 kube-proxy"]);
        assert!(nft_kube_proxy_tables("table ip nat\n").is_empty());
    }

    #[test]
    fn an_emptied_nft_table_keeps_its_chains_and_conntrack_on() {
        let table = &nft_kube_proxy_tables("table ip6 kube-proxy\n")[0];
        let listing = "table ip6 kube-proxy {\n\
                       \tcomment \"rules for kube-proxy\"\n\
                       \tset cluster-ips {\n\t\ttype ipv6_addr\n\t}\n\
                       \tchain nat-prerouting {\n\
                       \t\ttype nat hook prerouting priority dstnat; policy accept;\n\
                       \t\tjump services\n\t}\n\
                       \tchain services {\n\t\tip6 daddr . meta l4proto . th dport vmap @service-ips\n\t}\n\
                       }\n";
        let keep = "add chain ip6 kube-proxy conntrack-user\n\
                    add rule ip6 kube-proxy conntrack-user ct state established,related counter \
                    comment \"keeps conntrack on for connections netfilter still translates\"\n";
        assert_eq!(
            nft_emptying(table, Some(listing)),
            format!(
                "add table ip6 kube-proxy\n\
                 flush chain ip6 kube-proxy nat-prerouting\n\
                 flush chain ip6 kube-proxy services\n{keep}"
            )
        );
        assert_eq!(
            nft_emptying(table, None),
            format!("add table ip6 kube-proxy\n{keep}")
        );
    }

    #[test]
    fn ipvsadm_and_version_output_are_read() {
        let list = "IP Virtual Server version 1.2.1 (size=4096)\n\
                    Prot LocalAddress:Port Scheduler Flags\n  -> RemoteAddress:Port           Forward Weight ActiveConn InActConn\n\
                    TCP  10.96.0.1:443 rr\n  -> 192.168.1.10:6443            Masq    1      0          0\n\
                    UDP  10.96.0.10:53 rr\n  -> 10.244.1.11:53               Masq    1      0          0\n";
        assert_eq!(ipvs_virtual_servers(list), 2);
        assert_eq!(
            backend_mode("iptables-save v1.8.9 (nf_tables)\n").as_deref(),
            Some("nf_tables")
        );
        assert_eq!(
            backend_mode("iptables-save v1.8.9 (legacy)").as_deref(),
            Some("legacy")
        );
        assert_eq!(backend_mode("iptables-save v1.4.21"), None);
    }

    #[test]
    fn the_summary_names_each_part() {
        let found = Leftovers {
            iptables: vec![IptablesLeftovers {
                backend: Backend {
                    family: Family::V4,
                    save: PathBuf::from("/usr/sbin/iptables-nft-save"),
                    restore: PathBuf::from("/usr/sbin/iptables-nft-restore"),
                    mode: "nf_tables".to_owned(),
                },
                plan: plan(NODE_SAVE),
            }],
            nft_tables: nft_kube_proxy_tables("table ip kube-proxy\n"),
            ipvs_link: true,
            ipvs_virtual_servers: None,
            ipsets: Vec::new(),
            unreadable: vec!["iptables (legacy): Permission denied".to_owned()],
        };
        assert!(!found.is_empty());
        assert_eq!(
            found.summary(),
            "iptables (nf_tables): 18 KUBE- chains in mangle, filter, nat; nftables: table ip \
             kube-proxy; kube-ipvs0; not readable: iptables (legacy): Permission denied"
        );
        assert!(Leftovers::default().is_empty());
        assert_eq!(Leftovers::default().summary(), "nothing");
        let removed = Removed {
            removed: Leftovers {
                ipvs_link: true,
                ..Leftovers::default()
            },
            emptied: nft_kube_proxy_tables("table ip kube-proxy\n"),
        };
        assert_eq!(
            removed.summary(),
            "kube-ipvs0; emptied, kept for the connections netfilter still translates: table ip \
             kube-proxy"
        );
    }

    #[test]
    fn an_acknowledgement_and_an_error_are_told_apart() {
        // nlmsghdr (16) + nlmsgerr's error (4) + the request's header (16).
        let mut ack = vec![0u8; 36];
        ack[..4].copy_from_slice(&36u32.to_ne_bytes());
        ack[4..6].copy_from_slice(&NLMSG_ERROR.to_ne_bytes());
        assert_eq!(ack_code(&ack), Some(0));
        ack[16..20].copy_from_slice(&(-libc::EPERM).to_ne_bytes());
        assert_eq!(ack_code(&ack), Some(libc::EPERM));
        assert_eq!(ack_code(&[]), None);
    }
}
