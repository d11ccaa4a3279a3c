//! Privileged: kube-proxy's leftovers found and removed (`dataplane::kube_proxy_rules`) in a node
//! namespace holding every mode's: its iptables-mode rules (`proxy_testenv::kube_proxy`, upstream's
//! shape) through the selected backend, a few of its chains through `iptables-legacy` and
//! `ip6tables`, its nftables-mode tables (ip and ip6) and IPVS mode's `kube-ipvs0`, beside the
//! kubelet's chains (`KUBE-FIREWALL` jumped from INPUT and OUTPUT, the canary, the hint) and
//! other programs' (a CNI's portmap, Docker's). `find()` reports every part of kube-proxy's,
//! `remove()` removes exactly that: the tables then hold no kube-proxy chain and no jump to
//! one, the rest is as it was, `kube-ipvs0` is gone and `find()` finds nothing more.
//!
//! Run by `sudo cargo xtask test` (sets KPE_PRIVILEGED=1, one test thread); skipped otherwise.
//! Every command runs in the namespace the test creates (the library's on a thread moved there
//! with setns); the namespace guard deletes it, and its tables, even when an assertion fails.

use std::{fs::File, net::Ipv4Addr, path::Path, thread};

use kube_proxy_ebpf::dataplane::kube_proxy_rules::{self, Family, Leftovers, Removed};
use proxy_testenv::{
    NetNs, TempDir,
    kube_proxy::{self, KubeProxyService},
    require_privileged,
};

const CLUSTER_CIDR: &str = "10.244.0.0/16";

/// The kubelet's chains and other programs', with the jumps to them: `(tool, table, commands)`.
const KEPT: &[(&str, &str, &[&[&str]])] = &[
    (
        "iptables",
        "filter",
        &[
            &["-N", "KUBE-FIREWALL"],
            &[
                "-A",
                "KUBE-FIREWALL",
                "!",
                "-s",
                "127.0.0.0/8",
                "-d",
                "127.0.0.0/8",
                "-m",
                "comment",
                "--comment",
                "block incoming localnet connections",
                "-m",
                "conntrack",
                "!",
                "--ctstate",
                "RELATED,ESTABLISHED,DNAT",
                "-j",
                "DROP",
            ],
            &["-I", "INPUT", "-j", "KUBE-FIREWALL"],
            &["-I", "OUTPUT", "-j", "KUBE-FIREWALL"],
            &["-N", "KUBE-KUBELET-CANARY"],
            &["-N", "DOCKER-USER"],
            &["-A", "DOCKER-USER", "-j", "RETURN"],
            &["-A", "FORWARD", "-j", "DOCKER-USER"],
        ],
    ),
    (
        "iptables",
        "nat",
        &[
            &["-N", "KUBE-KUBELET-CANARY"],
            &["-N", "CNI-HOSTPORT-DNAT"],
            &[
                "-A",
                "PREROUTING",
                "-m",
                "addrtype",
                "--dst-type",
                "LOCAL",
                "-j",
                "CNI-HOSTPORT-DNAT",
            ],
        ],
    ),
    (
        "iptables",
        "mangle",
        &[
            &["-N", "KUBE-IPTABLES-HINT"],
            &["-N", "KUBE-KUBELET-CANARY"],
        ],
    ),
    (
        "iptables-legacy",
        "nat",
        &[&["-N", "DOCKER"], &["-A", "OUTPUT", "-j", "DOCKER"]],
    ),
    ("ip6tables", "mangle", &[&["-N", "KUBE-IPTABLES-HINT"]]),
];

/// kube-proxy's chains through the other backend and family, as an older kube-proxy (legacy)
/// or its IPv6 half left them.
const OTHER_KUBE_PROXY: &[(&str, &str, &[&[&str]])] = &[
    (
        "iptables-legacy",
        "nat",
        &[
            &["-N", "KUBE-SERVICES"],
            &["-N", "KUBE-SVC-LEGACYLEGACYLEGA"],
            &["-A", "KUBE-SERVICES", "-j", "KUBE-SVC-LEGACYLEGACYLEGA"],
            &[
                "-A",
                "OUTPUT",
                "-m",
                "comment",
                "--comment",
                "kubernetes service portals",
                "-j",
                "KUBE-SERVICES",
            ],
        ],
    ),
    (
        "ip6tables",
        "nat",
        &[
            &["-N", "KUBE-SERVICES"],
            &["-N", "KUBE-POSTROUTING"],
            &[
                "-A",
                "PREROUTING",
                "-m",
                "comment",
                "--comment",
                "kubernetes service portals",
                "-j",
                "KUBE-SERVICES",
            ],
            &[
                "-A",
                "POSTROUTING",
                "-m",
                "comment",
                "--comment",
                "kubernetes postrouting rules",
                "-j",
                "KUBE-POSTROUTING",
            ],
        ],
    ),
];

fn services() -> Vec<KubeProxyService> {
    vec![
        KubeProxyService::tcp("demo", "web", Ipv4Addr::new(10, 96, 7, 10), 80)
            .node_port(30_080)
            .target(
                8080,
                &[Ipv4Addr::new(10, 244, 1, 11), Ipv4Addr::new(10, 244, 1, 12)],
            ),
        KubeProxyService::tcp("kube-system", "dns", Ipv4Addr::new(10, 96, 0, 10), 53)
            .target(53, &[Ipv4Addr::new(10, 244, 1, 13)]),
        KubeProxyService::tcp("demo", "idle", Ipv4Addr::new(10, 96, 7, 20), 80),
    ]
}

/// Runs `f` on a thread moved into `ns` (only that thread: the test's own stay where they
/// are).
fn in_netns<T: Send>(ns: &NetNs, f: impl FnOnce() -> T + Send) -> T {
    let path = ns.path();
    thread::scope(|scope| {
        scope
            .spawn(|| {
                let file = File::open(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
                nix::sched::setns(&file, nix::sched::CloneFlags::CLONE_NEWNET)
                    .unwrap_or_else(|e| panic!("setns {}: {e}", path.display()));
                f()
            })
            .join()
            .expect("the thread in the namespace panicked")
    })
}

fn has_tool(name: &str) -> bool {
    ["/usr/sbin", "/sbin", "/usr/bin", "/bin"]
        .iter()
        .any(|dir| Path::new(dir).join(name).exists())
}

fn apply(ns: &NetNs, rules: &[(&str, &str, &[&[&str]])]) {
    for (tool, table, commands) in rules {
        for command in *commands {
            let mut argv = vec![*tool, "-t", table];
            argv.extend_from_slice(command);
            ns.exec(&argv)
                .unwrap_or_else(|e| panic!("{argv:?} in {}: {e:#}", ns.name()));
        }
    }
}

/// The chains of `save` output per table: `table:CHAIN`.
fn chains(save: &str) -> Vec<String> {
    let mut table = "";
    let mut out = Vec::new();
    for line in save.lines() {
        if let Some(t) = line.strip_prefix('*') {
            table = t;
        } else if let Some(decl) = line.strip_prefix(':') {
            out.push(format!(
                "{table}:{}",
                decl.split_whitespace().next().unwrap_or_default()
            ));
        }
    }
    out
}

#[test]
fn every_mode_s_leftovers_are_found_and_only_they_removed() {
    require_privileged!();
    let legacy = has_tool("iptables-legacy");
    let ns = NetNs::new(&format!("{}-kpr", proxy_testenv::unique_prefix())).expect("namespace");
    let tmp = TempDir::new("kpe-kube-proxy-rules").expect("temp dir");

    // kube-proxy's: iptables mode through the selected backend, nftables mode, IPVS's device.
    let services = services();
    kube_proxy::install_iptables(
        &ns,
        &kube_proxy::iptables_ruleset(&services, CLUSTER_CIDR),
        tmp.path(),
    )
    .unwrap_or_else(|e| panic!("{e:#}"));
    kube_proxy::install(
        &ns,
        &kube_proxy::nft_ruleset(&services, CLUSTER_CIDR),
        tmp.path(),
    )
    .unwrap_or_else(|e| panic!("{e:#}"));
    ns.exec(&["nft", "add", "table", "ip6", "kube-proxy"])
        .expect("table ip6 kube-proxy");
    // A dummy as kube-proxy makes it; a bridge (no ports either) where the kernel has no dummy.
    if ns
        .exec(&["ip", "link", "add", "kube-ipvs0", "type", "dummy"])
        .is_err()
    {
        eprintln!("no dummy devices here: kube-ipvs0 is a bridge");
        ns.exec(&["ip", "link", "add", "kube-ipvs0", "type", "bridge"])
            .expect("kube-ipvs0");
    }
    let others: Vec<_> = OTHER_KUBE_PROXY
        .iter()
        .filter(|(tool, ..)| legacy || !tool.contains("legacy"))
        .copied()
        .collect();
    apply(&ns, &others);
    // Everyone else's.
    let kept: Vec<_> = KEPT
        .iter()
        .filter(|(tool, ..)| legacy || !tool.contains("legacy"))
        .copied()
        .collect();
    apply(&ns, &kept);

    let saves: Vec<&str> = if legacy {
        vec!["iptables-save", "iptables-legacy-save", "ip6tables-save"]
    } else {
        vec!["iptables-save", "ip6tables-save"]
    };
    let save_all = |what: &str| -> Vec<(String, String)> {
        saves
            .iter()
            .map(|tool| {
                let out = ns
                    .exec(&[tool])
                    .unwrap_or_else(|e| panic!("{tool} {what}: {e:#}"));
                ((*tool).to_owned(), out)
            })
            .collect()
    };
    let before = save_all("before");

    let found: Leftovers =
        in_netns(&ns, kube_proxy_rules::find).unwrap_or_else(|e| panic!("{e:#}"));
    eprintln!("found: {found}");
    let v4: Vec<_> = found
        .iptables
        .iter()
        .filter(|i| i.backend.family == Family::V4)
        .collect();
    assert_eq!(v4.len(), if legacy { 2 } else { 1 }, "{found:?}");
    let nft = v4
        .iter()
        .find(|i| i.backend.mode == "nf_tables")
        .unwrap_or_else(|| panic!("no nf_tables backend in {found:?}"));
    // nat: the 5 fixed chains, 3 Service chains, 3 endpoint chains, 1 external chain; filter:
    // 6; mangle: the canary.
    assert_eq!(nft.plan.chain_count(), 12 + 6 + 1, "{:?}", nft.plan);
    assert_eq!(nft.plan.table_names().len(), 3, "{:?}", nft.plan);
    if legacy {
        let l = v4
            .iter()
            .find(|i| i.backend.mode == "legacy")
            .unwrap_or_else(|| panic!("no legacy backend in {found:?}"));
        assert_eq!(l.plan.chain_count(), 2, "{:?}", l.plan);
    }
    let v6: Vec<_> = found
        .iptables
        .iter()
        .filter(|i| i.backend.family == Family::V6)
        .collect();
    assert_eq!(v6.len(), 1, "{found:?}");
    assert_eq!(v6[0].plan.chain_count(), 2, "{:?}", v6[0].plan);
    let tables: Vec<String> = found.nft_tables.iter().map(ToString::to_string).collect();
    assert_eq!(tables, ["table ip kube-proxy", "table ip6 kube-proxy"]);
    assert!(found.ipvs_link, "{found:?}");
    let summary = found.summary();
    for part in [
        "iptables (nf_tables): 19 KUBE- chains",
        "nftables: table ip kube-proxy",
        "kube-ipvs0",
    ] {
        assert!(summary.contains(part), "{part:?} not in {summary:?}");
    }

    let removed =
        in_netns(&ns, || kube_proxy_rules::remove(&found, 0)).unwrap_or_else(|e| panic!("{e:#}"));
    eprintln!("removed: {removed}");
    assert_eq!(
        removed,
        Removed {
            removed: found.clone(),
            emptied: Vec::new(),
        }
    );

    // No kube-proxy chain and no jump to one; every other chain and rule as before.
    for ((tool, after), (_, before)) in save_all("after").iter().zip(&before) {
        for chain in chains(after) {
            let name = chain.split_once(':').map_or("", |(_, c)| c);
            assert!(
                !kube_proxy_rules::is_kube_proxy_chain(name),
                "{tool}: {chain} remains:\n{after}"
            );
        }
        let kept_chains: Vec<String> = chains(before)
            .into_iter()
            .filter(|c| {
                !kube_proxy_rules::is_kube_proxy_chain(c.split_once(':').map_or("", |(_, c)| c))
            })
            .collect();
        assert_eq!(chains(after), kept_chains, "{tool}:\n{after}");
        let rules = |save: &str| -> Vec<String> {
            save.lines()
                .filter(|l| l.starts_with("-A ") || l.starts_with('*'))
                .filter(|l| {
                    !l.split_whitespace()
                        .any(kube_proxy_rules::is_kube_proxy_chain)
                })
                .map(String::from)
                .collect()
        };
        assert_eq!(rules(after), rules(before), "{tool}:\n{after}");
        assert!(
            !after.lines().any(|l| l.starts_with("-A ")
                && l.split_whitespace()
                    .any(kube_proxy_rules::is_kube_proxy_chain)),
            "{tool}: a rule of or to kube-proxy's chains remains:\n{after}"
        );
    }
    let after = ns.exec(&["iptables-save"]).expect("iptables-save");
    for rule in [
        "-A INPUT -j KUBE-FIREWALL",
        "-A OUTPUT -j KUBE-FIREWALL",
        "-A FORWARD -j DOCKER-USER",
        "-A PREROUTING -m addrtype --dst-type LOCAL -j CNI-HOSTPORT-DNAT",
        "-A KUBE-FIREWALL ! -s 127.0.0.0/8 -d 127.0.0.0/8",
    ] {
        assert!(after.contains(rule), "{rule:?} is gone:\n{after}");
    }
    let tables = ns
        .exec(&["nft", "list", "tables"])
        .expect("nft list tables");
    assert!(!tables.contains("kube-proxy"), "{tables}");
    assert!(
        ns.exec(&["ip", "link", "show", "kube-ipvs0"]).is_err(),
        "kube-ipvs0 remains"
    );

    let again = in_netns(&ns, kube_proxy_rules::find).unwrap_or_else(|e| panic!("{e:#}"));
    assert!(again.is_empty(), "left after remove(): {again}");
}

/// Connections netfilter still translates (`netfilter_keeps`): kube-proxy's nftables table is
/// emptied, its chains (the NAT hooks) kept, a rule keeping conntrack on added (the IPv6 table
/// created for it), and both deleted by a later `remove()` without such connections.
#[test]
fn with_connections_netfilter_keeps_the_nft_table_is_emptied_not_deleted() {
    require_privileged!();
    let ns = NetNs::new(&format!("{}-kpr", proxy_testenv::unique_prefix())).expect("namespace");
    let tmp = TempDir::new("kpe-kube-proxy-rules").expect("temp dir");
    kube_proxy::install(
        &ns,
        &kube_proxy::nft_ruleset(&services(), CLUSTER_CIDR),
        tmp.path(),
    )
    .unwrap_or_else(|e| panic!("{e:#}"));

    let found = in_netns(&ns, kube_proxy_rules::find).unwrap_or_else(|e| panic!("{e:#}"));
    let removed =
        in_netns(&ns, || kube_proxy_rules::remove(&found, 3)).unwrap_or_else(|e| panic!("{e:#}"));
    assert!(removed.removed.nft_tables.is_empty(), "{removed:?}");
    let both =
        kube_proxy_rules::nft_kube_proxy_tables("table ip kube-proxy\ntable ip6 kube-proxy\n");
    assert_eq!(found.nft_tables, both[..1]);
    assert_eq!(removed.emptied, both);
    let table = ns
        .exec(&["nft", "list", "table", "ip", "kube-proxy"])
        .expect("the emptied table");
    for hook in ["hook prerouting", "hook output", "hook postrouting"] {
        assert!(table.contains(hook), "{hook:?} is gone:\n{table}");
    }
    for rule in ["dnat to", "masquerade fully-random", "jump ", "vmap @"] {
        assert!(!table.contains(rule), "{rule:?} remains:\n{table}");
    }
    for table in ["ip", "ip6"] {
        let listed = ns
            .exec(&[
                "nft",
                "list",
                "chain",
                table,
                "kube-proxy",
                "conntrack-user",
            ])
            .expect("the chain keeping conntrack on");
        assert!(
            listed.contains("ct state established,related counter"),
            "{listed}"
        );
    }

    let later = in_netns(&ns, kube_proxy_rules::find).unwrap_or_else(|e| panic!("{e:#}"));
    assert_eq!(later.nft_tables, both);
    let removed =
        in_netns(&ns, || kube_proxy_rules::remove(&later, 0)).unwrap_or_else(|e| panic!("{e:#}"));
    assert_eq!(removed.removed.nft_tables, both);
    let tables = ns
        .exec(&["nft", "list", "tables"])
        .expect("nft list tables");
    assert!(!tables.contains("kube-proxy"), "{tables}");
}
