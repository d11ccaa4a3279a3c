//! The demo's IPv6 stage: the dual-stack examples' IPv6 frontends (demo/web and demo/echo's
//! IPv6 ClusterIPs, the IPv6-only demo/web6, demo/web's NodePort on the nodes' IPv6 addresses,
//! a node process through connect6), counted on a line of their own.
//!
//! Strict or not: until the agent programs IPv6 Services the stage is expected to fail, so its
//! failures fail the demo only when it is strict — `KPE_DEMO_IPV6=1`, or node-a's agent has IPv6
//! frontends in its pinned `SERVICES6_V1` map (read with bpftool: it turns strict by itself once
//! the IPv6 control plane programs that map); `KPE_DEMO_IPV6=0` keeps it lenient regardless. Not
//! strict, each step stops at its first failure.

use std::{collections::BTreeMap, net::Ipv6Addr, path::Path, process::Command};

use anyhow::{Context as _, Result, bail};
use proxy_testenv::{
    BACKENDS, EXT_CLIENT_IP6, InCgroup, MultiNode, NODE_IPS6, NODE_NAMES, http_url,
    http6_get_with_peer,
};

/// demo/web, demo/echo (IPv6 halves) and demo/web6 in deploy/examples/services.yaml.
pub const WEB6: Ipv6Addr = Ipv6Addr::new(0xfd00, 0x10, 0x96, 0, 0, 0, 0, 0x10);
pub const ECHO6: Ipv6Addr = Ipv6Addr::new(0xfd00, 0x10, 0x96, 0, 0, 0, 0, 0x20);
pub const WEB6_ONLY: Ipv6Addr = Ipv6Addr::new(0xfd00, 0x10, 0x96, 0, 0, 0, 0, 0x50);
/// Environment variable that makes the IPv6 stage's failures fail the demo.
pub const STRICT_ENV: &str = "KPE_DEMO_IPV6";
/// The pinned map whose entries are the agent's IPv6 frontends (proxy_common::ipv6::MAP_SERVICES6).
const SERVICES6_MAP: &str = "SERVICES6_V1";
const HTTP_REQUESTS: usize = 60;
const UDP_REQUESTS: usize = 10;
/// Failures printed per step (the rest are counted).
const SHOWN_FAILURES: usize = 3;

/// Whether the stage's failures count, and why.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Strictness {
    pub strict: bool,
    pub why: String,
}

/// What the stage saw.
#[derive(Debug, Default)]
pub struct Outcome {
    pub requests: usize,
    pub failed: usize,
    /// Answers per backend pod name.
    pub answered: BTreeMap<String, usize>,
}

/// Strict when `KPE_DEMO_IPV6=1`, or `pin_dir`'s `SERVICES6_V1` has entries and the variable is
/// not `0`.
pub fn strictness(pin_dir: &Path) -> Strictness {
    decide(
        std::env::var(STRICT_ENV).ok().as_deref(),
        services6_entries(pin_dir),
    )
}

fn decide(env: Option<&str>, entries: Result<usize>) -> Strictness {
    let (strict, why) = match (env, entries) {
        (Some("1"), _) => (true, format!("{STRICT_ENV}=1")),
        // An escape hatch while the IPv6 pieces are merged one by one.
        (Some("0"), _) => (false, format!("{STRICT_ENV}=0")),
        (_, Ok(n)) if n > 0 => (true, format!("{SERVICES6_MAP} has {n} IPv6 frontends")),
        (_, Ok(_)) => (
            false,
            format!("{SERVICES6_MAP} is empty: IPv6 Services not programmed yet"),
        ),
        (_, Err(e)) => (false, format!("{SERVICES6_MAP} not read: {e:#}")),
    };
    Strictness { strict, why }
}

/// Entries of the pinned `SERVICES6_V1` under `pin_dir` (`bpftool -j map dump pinned`).
fn services6_entries(pin_dir: &Path) -> Result<usize> {
    let path = pin_dir.join(SERVICES6_MAP);
    if !path.exists() {
        bail!("{} is not pinned", path.display());
    }
    let out = Command::new("bpftool")
        .args(["-j", "map", "dump", "pinned"])
        .arg(&path)
        .output()
        .context("running bpftool (cargo xtask setup installs it)")?;
    if !out.status.success() {
        bail!(
            "bpftool map dump {}: {}",
            path.display(),
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    count_entries(&out.stdout)
}

fn count_entries(json: &[u8]) -> Result<usize> {
    let v: serde_json::Value = serde_json::from_slice(json).context("bpftool JSON")?;
    v.as_array()
        .map(Vec::len)
        .context("bpftool map dump printed no array")
}

impl Outcome {
    /// Runs `step` `n` times (stopping at the first failure unless `strict`); `Ok(backend)`
    /// counts an answer.
    fn steps(
        &mut self,
        strict: bool,
        what: &str,
        n: usize,
        mut step: impl FnMut(usize) -> Result<String>,
    ) {
        let mut failed = 0;
        for i in 0..n {
            self.requests += 1;
            match step(i) {
                Ok(backend) => *self.answered.entry(backend).or_default() += 1,
                Err(e) => {
                    failed += 1;
                    if failed <= SHOWN_FAILURES {
                        println!("ipv6: {what}: FAILED: {e:#}");
                    }
                    if !strict {
                        println!("ipv6: {what}: stopped after the first failure (not strict)");
                        break;
                    }
                }
            }
        }
        if failed > SHOWN_FAILURES {
            println!(
                "ipv6: {what}: {} more failures not shown",
                failed - SHOWN_FAILURES
            );
        }
        self.failed += failed;
    }
}

fn backend_name(body: &str) -> Result<String> {
    if BACKENDS.iter().any(|(n, _)| *n == body) {
        Ok(body.to_owned())
    } else {
        bail!("answered by {body:?}, not one of be1-3")
    }
}

/// The stage. node-a (`a`) holds the client and backend pods; `host_b` is a process of node-b.
pub fn run(net: &MultiNode, a: usize, host_b: &InCgroup<'_>, strict: bool) -> Outcome {
    let topo = net.node(a);
    let mut o = Outcome::default();

    for (vip, name) in [(WEB6, "demo/web"), (WEB6_ONLY, "demo/web6")] {
        let url = http_url(vip, 80);
        eprintln!("\n==> {HTTP_REQUESTS} HTTP requests to {url} ({name}, IPv6)");
        o.steps(strict, &format!("GET {url}"), HTTP_REQUESTS, |_| {
            let r = topo.curl(&url)?;
            if r.remote_ip != vip.to_string() {
                bail!("reply from {} instead of the VIP {vip}", r.remote_ip);
            }
            backend_name(&r.body)
        });
    }

    eprintln!("\n==> {UDP_REQUESTS} UDP datagrams to [{ECHO6}]:53 (demo/echo, IPv6)");
    o.steps(strict, &format!("UDP [{ECHO6}]:53"), UDP_REQUESTS, |i| {
        let payload = format!("ping6-{i}");
        let r = topo.udp6_request(ECHO6, 53, &payload)?;
        if *r.from.ip() != ECHO6 || r.from.port() != 53 {
            bail!("reply from {} instead of [{ECHO6}]:53", r.from);
        }
        let (backend, echoed) = r.body.split_once(':').unwrap_or_default();
        if echoed != payload {
            bail!("echoed {:?}", r.body);
        }
        backend_name(backend)
    });

    eprintln!(
        "\n==> NodePort 30080 (demo/web) over IPv6 from the external client {EXT_CLIENT_IP6}, \
         through each node"
    );
    for (i, node_ip) in NODE_IPS6.iter().enumerate() {
        let url = http_url(*node_ip, 30080);
        o.steps(strict, &format!("nodeport {url}"), 1, |_| {
            let r = net.http_get(&url)?;
            let backend = backend_name(&r.body)?;
            // eTP=Cluster: every node masquerades the external client to its own address.
            if r.code != 200 || !r.client_addr.starts_with(&format!("[{node_ip}]:")) {
                bail!(
                    "HTTP {}, the backend saw {:?}, want [{node_ip}]:* (SNAT)",
                    r.code,
                    r.client_addr
                );
            }
            println!(
                "ipv6 nodeport: external client {EXT_CLIENT_IP6} → [{node_ip}]:30080 ({}) → \
                 answered by {backend}; backend saw {}",
                NODE_NAMES[i], r.client_addr
            );
            Ok(backend)
        });
    }

    eprintln!("\n==> a process of node-b to [{WEB6}]:80 (connect6 socket hook)");
    o.steps(strict, &format!("host connect6 [{WEB6}]:80"), 3, |_| {
        let v = http6_get_with_peer(host_b, WEB6, 80)?;
        if v.peer != format!("[{WEB6}]:80") {
            bail!("getpeername() said {}", v.peer);
        }
        backend_name(&v.body)
    });
    o
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn strict_by_the_variable_or_programmed_frontends() {
        assert!(decide(Some("1"), Ok(0)).strict);
        assert!(decide(Some("1"), Err(anyhow::anyhow!("no map"))).strict);
        assert!(decide(None, Ok(3)).strict);
        assert!(!decide(Some("0"), Ok(3)).strict);
        let lenient = decide(None, Ok(0));
        assert!(!lenient.strict);
        assert!(lenient.why.contains("empty"), "{}", lenient.why);
        assert!(!decide(None, Err(anyhow::anyhow!("not pinned"))).strict);
    }

    #[test]
    fn bpftool_dump_entries() {
        assert_eq!(count_entries(b"[]").unwrap(), 0);
        assert_eq!(
            count_entries(br#"[{"key":["0x0"],"value":["0x1"]},{"key":["0x1"],"value":["0x2"]}]"#)
                .unwrap(),
            2
        );
        assert!(count_entries(b"{}").is_err());
    }
}
