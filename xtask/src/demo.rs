//! `cargo xtask demo`: the agent standalone on deploy/examples in a one-node topology of network
//! namespaces, with traffic through each example Service. Needs root. Everything it creates is
//! an RAII guard (namespaces, processes, pin dir, temp dirs), removed on exit or failure.

use std::{
    collections::BTreeMap,
    net::Ipv4Addr,
    path::{Path, PathBuf},
    time::Duration,
};

use anyhow::{Context as _, Result, bail};
use proxy_testenv::{Agent, BACKENDS, ConnectOutcome, ManifestDir, PinDir, ServicePort, Topology};

use crate::util::{is_root, workspace_root};

const WEB: Ipv4Addr = Ipv4Addr::new(10, 96, 0, 10);
const ECHO: Ipv4Addr = Ipv4Addr::new(10, 96, 0, 20);
const EMPTY: Ipv4Addr = Ipv4Addr::new(10, 96, 0, 30);
const BULK: Ipv4Addr = Ipv4Addr::new(10, 96, 0, 40);
const HTTP_REQUESTS: usize = 300;
const UDP_REQUESTS: usize = 30;

pub fn run() -> Result<()> {
    if !is_root() {
        bail!("cargo xtask demo needs root (eBPF load, network namespaces); run it with sudo");
    }
    crate::setup::run(false)?;
    let bin = crate::build_ebpf::run()?;
    proxy_testenv::ensure_bpffs()?;

    let (manifests, _generated) = manifests()?;
    eprintln!("\n==> topology");
    let mut topo = Topology::new().context("creating the demo topology")?;
    topo.start_iperf3_server("be1")?;
    eprintln!(
        "namespaces {}-{{node,client,be1,be2,be3}}; client 10.244.1.2, backends 10.244.1.11-13",
        topo.prefix()
    );
    let pins = PinDir::new(&format!("{}-demo", topo.prefix()))?;
    eprintln!("\n==> agent on {}", manifests.display());
    let mut agent = Agent::start(
        &bin,
        topo.node(),
        &manifests,
        pins.path(),
        topo.tmp().path(),
    )?;
    let status = agent.wait_synced(1, Duration::from_secs(30))?;
    eprintln!(
        "agent synced: {} frontends, {} backends, interfaces {:?}, {} problems",
        status.frontends, status.backends, status.interfaces, status.problems
    );
    // Interfaces are attached after the first sync; wait until all pods' veths are in.
    let status = agent
        .wait_status(Duration::from_secs(10), |s| s.interfaces.len() >= 4)
        .unwrap_or(status);
    eprintln!("attached to {:?}", status.interfaces);

    let mut answered: BTreeMap<String, (usize, usize)> = BTreeMap::new();
    let mut failed = 0usize;
    let mut requests = 0usize;

    eprintln!("\n==> {HTTP_REQUESTS} HTTP requests to http://{WEB}/ (demo/web)");
    for reply in topo.curl_many(&format!("http://{WEB}/"), HTTP_REQUESTS)? {
        requests += 1;
        match reply {
            Ok(r) if r.remote_ip == WEB.to_string() => answered.entry(r.body).or_default().0 += 1,
            Ok(r) => {
                failed += 1;
                eprintln!("reply from {} instead of the VIP {WEB}", r.remote_ip);
            }
            Err(e) => {
                failed += 1;
                eprintln!("request failed: {e}");
            }
        }
    }

    eprintln!("\n==> {UDP_REQUESTS} UDP datagrams to {ECHO}:53 (demo/echo)");
    for i in 0..UDP_REQUESTS {
        requests += 1;
        match topo.udp_request(ECHO, 53, &format!("ping{i}")) {
            Ok(r) if *r.from.ip() == ECHO && r.from.port() == 53 => {
                let backend = r.body.split(':').next().unwrap_or_default().to_owned();
                answered.entry(backend).or_default().1 += 1;
            }
            Ok(r) => {
                failed += 1;
                eprintln!("UDP reply from {} instead of {ECHO}:53", r.from);
            }
            Err(e) => {
                failed += 1;
                eprintln!("UDP request failed: {e:#}");
            }
        }
    }

    eprintln!("\n==> TCP connect to {EMPTY}:80 (demo/empty, no endpoints)");
    let (outcome, elapsed) = topo.tcp_connect(EMPTY, 80, Duration::from_secs(3))?;
    let verdict = match &outcome {
        ConnectOutcome::Refused => "refused (as kube-proxy does)".to_owned(),
        other => format!("{other:?} (expected: refused)"),
    };
    println!(
        "demo/empty {EMPTY}:80: {verdict} after {} ms",
        elapsed.as_millis()
    );

    eprintln!("\n==> iperf3 2 s through {BULK}:5201 (demo/bulk)");
    match topo.iperf3_client(BULK, 5201, 2).and_then(|run| run.wait()) {
        Ok(s) if s.success => println!(
            "demo/bulk {BULK}:5201: {:.2} Gbit/s over {:.1} s, {} retransmits",
            s.bits_per_second / 1e9,
            s.seconds,
            s.retransmits
        ),
        Ok(s) => println!("demo/bulk {BULK}:5201: iperf3 failed: {s:?}"),
        Err(e) => println!("demo/bulk {BULK}:5201: iperf3 failed: {e:#}"),
    }

    println!("\nper-backend distribution:");
    println!(
        "  {:<8} {:>15} {:>8} {:>6}",
        "backend", "address", "http", "udp"
    );
    for (name, ip) in BACKENDS {
        let (http, udp) = answered.get(name).copied().unwrap_or_default();
        println!("  {name:<8} {ip:>15} {http:>8} {udp:>6}");
    }
    for (name, (http, udp)) in answered
        .iter()
        .filter(|(n, _)| !BACKENDS.iter().any(|(b, _)| b == n))
    {
        println!("  {name:<8} {:>15} {http:>8} {udp:>6}", "?");
    }

    println!(
        "\nkube-proxy-ebpf dump services --pin-dir {}:",
        pins.path().display()
    );
    let pin = pins.path().to_string_lossy().into_owned();
    match agent.cli(&["dump", "services", "--pin-dir", &pin]) {
        Ok(out) => {
            print!("{}", String::from_utf8_lossy(&out.stdout));
            if !out.status.success() {
                println!(
                    "(dump failed: {})",
                    String::from_utf8_lossy(&out.stderr).trim()
                );
            }
        }
        Err(e) => println!("(dump failed: {e:#})"),
    }

    let backends = answered.len();
    agent.stop().context("stopping the agent")?;
    // Remove links and maps before the namespaces go (the guards would also do it).
    let cleanup = agent.cli(&["cleanup", "--pin-dir", &pin])?;
    if !cleanup.status.success() {
        eprintln!(
            "cleanup: {}",
            String::from_utf8_lossy(&cleanup.stderr).trim()
        );
    }
    println!("demo: {requests} requests, {backends} backends answered, {failed} failed");
    if failed > 0 || backends < 3 {
        bail!("demo failed: {failed} failed requests, {backends} backends answered (want 0 and 3)");
    }
    Ok(())
}

/// deploy/examples when it has manifests; otherwise the same Services written to a temp dir.
fn manifests() -> Result<(PathBuf, Option<ManifestDir>)> {
    let examples = workspace_root().join("deploy/examples");
    if has_yaml(&examples) {
        return Ok((examples, None));
    }
    eprintln!(
        "note: {} has no manifests yet; writing the example Services to a temp dir",
        examples.display()
    );
    let dir = ManifestDir::new()?;
    let be: Vec<Ipv4Addr> = BACKENDS.iter().map(|(_, ip)| *ip).collect();
    dir.write_service("demo", "web", WEB, &[ServicePort::tcp(80, 8080)], &be)?;
    dir.write_service("demo", "echo", ECHO, &[ServicePort::udp(53, 5353)], &be)?;
    dir.write_service("demo", "empty", EMPTY, &[ServicePort::tcp(80, 8080)], &[])?;
    dir.write_service(
        "demo",
        "bulk",
        BULK,
        &[ServicePort::tcp(5201, 5201)],
        &be[..1],
    )?;
    Ok((dir.path().to_path_buf(), Some(dir)))
}

fn has_yaml(dir: &Path) -> bool {
    std::fs::read_dir(dir).is_ok_and(|entries| {
        entries.flatten().any(|e| {
            let name = e.file_name();
            let name = name.to_string_lossy();
            name.ends_with(".yaml") || name.ends_with(".yml")
        })
    })
}
