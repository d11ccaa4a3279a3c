//! `xtask-bench`: the measuring side of `cargo xtask bench` (built with `--features bench`, in
//! release unless `--smoke`). `cargo xtask bench` builds it and runs `xtask-bench run`; the
//! hidden `serve` and `loadgen` subcommands run inside network namespaces.
#![forbid(unsafe_code)]

mod change;
mod e2e;
mod inproc;
mod loadgen;
mod packet;
mod report;
mod snat_rate;
mod stats;
mod svg;
mod workload;

use std::{
    path::PathBuf,
    time::{Duration, Instant},
};

use anyhow::{Context as _, Result, bail};
use clap::{Parser, Subcommand, ValueEnum};
use serde_json::{Value, json};

#[derive(Debug, Parser)]
#[command(
    name = "xtask-bench",
    about = "kube-proxy-ebpf benchmarks (run by cargo xtask bench)"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Run the benchmark set and write results.json, results.md and the SVG plots.
    Run(RunArgs),
    /// HTTP server for backend pods (runs inside a pod namespace).
    #[command(hide = true)]
    Serve(loadgen::ServeArgs),
    /// Short-connection load generator (runs inside the client namespace).
    #[command(hide = true)]
    Loadgen(loadgen::LoadArgs),
    /// Only the first full sync (translate → plan → apply into fresh maps) at `services`,
    /// `rounds` times, each line split by part: for iterating on the control plane's cost.
    FirstSync {
        services: usize,
        #[arg(long, default_value_t = 5)]
        rounds: usize,
    },
    /// Only the agent binary's footprint on a manifest folder of `services` (start → first sync,
    /// VmHWM), as the control part measures it.
    Footprint {
        services: usize,
        #[arg(long)]
        agent_bin: PathBuf,
    },
    /// What one endpoint change costs at `services` Services: in process (the agent's sync, by
    /// part) and, with `--agent-bin`, end to end (API event → map write).
    ChangeLatency {
        #[arg(long, default_value_t = 50_000)]
        services: usize,
        #[arg(long, default_value_t = 10)]
        endpoints: usize,
        #[arg(long, default_value_t = 200)]
        changes: usize,
        /// The node's scheduler for the in-process part (`mh`: every Service has a Maglev
        /// table).
        #[arg(long, default_value = "random", value_parser = parse_scheduler)]
        scheduler: proxy_common::Scheduler,
        /// The Services' families for the in-process part (`ipv6`, `dual`: the agent runs in a
        /// node namespace the bench creates, with an IPv6 address).
        #[arg(long, value_enum, default_value = "ipv4")]
        family: change::Family,
        /// The release agent binary: also measure end to end (API event → map write).
        #[arg(long)]
        agent_bin: Option<PathBuf>,
        /// End to end: the agent's `--sync-period` (its default, 30 s, when not given). A short
        /// one puts periodic passes among the changes (with `--changes` past 30 s' worth, the
        /// conntrack walk too).
        #[arg(long)]
        agent_sync_period: Option<String>,
    },
    /// Only the cold start: agent start → first sync at each of `services` on a fresh node
    /// (IPv4, then with IPv6) and on a restart, beside kube-proxy's rule-set load times.
    ColdStart {
        #[arg(value_delimiter = ',', default_value = "1,10000")]
        services: Vec<usize>,
        #[arg(long, default_value_t = 3)]
        rounds: usize,
        #[arg(long)]
        agent_bin: PathBuf,
    },
    /// Write the footprint's manifest folder for `services` generated Services × 10 endpoints
    /// into `dir` (to run the agent on it by hand, e.g. under heaptrack).
    WriteManifests { services: usize, dir: PathBuf },
    /// Only the Maglev tables' kernel memory for `services` Maglev Services × 10 endpoints.
    MaglevMemory { services: usize },
    /// Print the baseline rule set the bench loads for `n` generated Services (to inspect it).
    Rules {
        #[arg(value_enum)]
        mode: RulesMode,
        services: usize,
    },
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum RulesMode {
    Iptables,
    Nftables,
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, ValueEnum)]
pub enum Size {
    Smoke,
    Quick,
    #[default]
    Full,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Part {
    Datapath,
    Control,
    E2e,
    /// NodePort new connections through SNAT, ours vs kube-proxy's rule sets.
    SnatRate,
}

#[derive(Debug, clap::Args)]
struct RunArgs {
    #[arg(long, value_enum, default_value = "full")]
    size: Size,
    /// Only these parts (default: all).
    #[arg(long, value_enum, value_delimiter = ',')]
    only: Vec<Part>,
    /// The agent binary (`kube-proxy-ebpf`).
    #[arg(long)]
    agent_bin: PathBuf,
    /// Where to write results.json, results.md and the plots.
    #[arg(long)]
    out_dir: PathBuf,
    /// The command line to print in the report.
    #[arg(long, default_value = "cargo xtask bench")]
    command_line: String,
}

/// Sizes and effort per level.
pub struct Plan {
    pub datapath: Vec<usize>,
    pub control: Vec<usize>,
    pub e2e: Vec<usize>,
    pub restore: Vec<usize>,
    pub rss: Vec<usize>,
    /// Services of the cold-start rows, and rounds each (`e2e::cold_start`).
    pub cold_start: Vec<usize>,
    pub cold_start_rounds: usize,
    pub effort: inproc::Effort,
    pub e2e_cfg: e2e::Config,
    pub snat_rate: snat_rate::Config,
}

fn plan(size: Size, agent_bin: PathBuf) -> Result<Plan> {
    let bench_bin = std::env::current_exe().context("locating the bench binary")?;
    let cfg = |backends, duration_ms, iperf_secs, timeout_s| e2e::Config {
        bench_bin: bench_bin.clone(),
        agent_bin: agent_bin.clone(),
        backends,
        concurrency: 8,
        duration_ms,
        max_conns: 500_000,
        iperf_secs,
        program_timeout: Duration::from_secs(timeout_s),
    };
    let snat = |rate, seconds| snat_rate::Config {
        bench_bin: bench_bin.clone(),
        agent_bin: agent_bin.clone(),
        rate,
        seconds,
        timeout_ms: 3_000,
        agent_timeout: Duration::from_secs(60),
    };
    Ok(match size {
        Size::Smoke => Plan {
            datapath: vec![1, 10],
            control: vec![10],
            e2e: vec![10],
            restore: vec![10],
            rss: vec![10],
            cold_start: vec![1],
            cold_start_rounds: 1,
            effort: inproc::Effort {
                new_flows: 200,
                calls: 3,
                repeat: 1_000,
                changes: 3,
            },
            e2e_cfg: cfg(2, 1_000, 1, 60),
            snat_rate: snat(50, 2),
        },
        Size::Quick => Plan {
            datapath: vec![1, 1_000, 10_000],
            control: vec![1_000, 5_000, 10_000],
            e2e: vec![1, 1_000],
            restore: vec![1_000, 10_000],
            rss: vec![1_000, 10_000],
            cold_start: vec![1, 10_000],
            cold_start_rounds: 1,
            effort: inproc::Effort {
                new_flows: 5_000,
                calls: 21,
                repeat: 10_000,
                changes: 11,
            },
            e2e_cfg: cfg(10, 3_000, 3, 60),
            snat_rate: snat(500, 10),
        },
        Size::Full => Plan {
            datapath: vec![1, 100, 1_000, 10_000, 100_000],
            control: vec![1_000, 5_000, 10_000, 50_000],
            e2e: vec![1, 1_000, 10_000],
            restore: vec![1_000, 10_000, 50_000],
            rss: vec![1_000, 5_000, 10_000, 50_000],
            cold_start: vec![1, 10_000],
            cold_start_rounds: 3,
            effort: inproc::Effort {
                new_flows: 20_000,
                calls: 51,
                repeat: 10_000,
                changes: 21,
            },
            e2e_cfg: cfg(10, 5_000, 5, 180),
            snat_rate: snat(1_000, 20),
        },
    })
}

fn first_sync(services: usize, rounds: usize) -> Result<()> {
    proxy_testenv::ensure_bpffs()?;
    let mut totals = Vec::new();
    for _ in 0..rounds.clamp(1, 100) {
        let r = inproc::measure(services, false, false, inproc::Effort::default())?;
        let t = r.full_sync;
        println!(
            "first sync at {services}: {:.1} ms (translate {:.1}, plan {:.1}, apply {:.1}; {} ops)",
            inproc::ms(t.total()),
            inproc::ms(t.translate),
            inproc::ms(t.plan),
            inproc::ms(t.apply),
            t.ops
        );
        totals.push(inproc::ms(t.total()));
    }
    totals.sort_by(f64::total_cmp);
    println!("median {:.1} ms", totals[totals.len() / 2]);
    Ok(())
}

fn main() -> std::process::ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Run(args) => run(args),
        Command::Serve(args) => loadgen::serve(&args),
        Command::Loadgen(args) => loadgen::loadgen(&args),
        Command::FirstSync { services, rounds } => first_sync(services, rounds),
        Command::Footprint {
            services,
            agent_bin,
        } => plan(Size::Quick, agent_bin).and_then(|p| {
            proxy_testenv::ensure_bpffs()?;
            let v = e2e::agent_footprint(&p.e2e_cfg, services)?;
            println!("{v}");
            Ok(())
        }),
        Command::ColdStart {
            services,
            rounds,
            agent_bin,
        } => plan(Size::Quick, agent_bin).and_then(|p| {
            proxy_testenv::ensure_bpffs()?;
            for n in services {
                let v = e2e::cold_start(&p.e2e_cfg, n, rounds)?;
                println!("{v}");
            }
            Ok(())
        }),
        Command::ChangeLatency {
            services,
            endpoints,
            changes,
            scheduler,
            family,
            agent_bin,
            agent_sync_period,
        } => {
            let (endpoints, changes) = (endpoints.clamp(1, 60), changes.clamp(1, 100_000));
            change::in_process(services, endpoints, changes, scheduler, family).and_then(|()| {
                match &agent_bin {
                    Some(bin) => change::end_to_end(
                        services,
                        endpoints,
                        changes,
                        bin,
                        agent_sync_period.as_deref(),
                    ),
                    None => Ok(()),
                }
            })
        }
        Command::WriteManifests { services, dir } => std::fs::create_dir_all(&dir)
            .context("creating the manifest folder")
            .and_then(|()| workload::write_manifests(&dir, &workload::generated(services))),
        Command::MaglevMemory { services } => inproc::maglev_memory(services).map(|v| {
            println!("{v}");
        }),
        Command::Rules { mode, services } => {
            let specs = workload::generated(services);
            print!(
                "{}",
                match mode {
                    RulesMode::Iptables => workload::iptables_restore(&specs),
                    RulesMode::Nftables => workload::nft_ruleset(&specs),
                }
            );
            Ok(())
        }
    };
    match result {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}

fn step(name: &str) -> Instant {
    eprintln!("\n==> {name}");
    Instant::now()
}

fn run(args: RunArgs) -> Result<()> {
    if !nix::unistd::geteuid().is_root() {
        bail!("the bench needs root (eBPF load, network namespaces)");
    }
    proxy_testenv::ensure_bpffs()?;
    let started = Instant::now();
    let p = plan(args.size, args.agent_bin.clone())?;
    let want = |part| args.only.is_empty() || args.only.contains(&part);
    let mut results = report::Results {
        size: Some(args.size),
        command_line: args.command_line.clone(),
        machine: report::machine(),
        ..Default::default()
    };

    // 1 + 4 (in-process): one load per size, filled through translate → plan → apply.
    if want(Part::Datapath) || want(Part::Control) {
        let mut sizes: Vec<usize> = Vec::new();
        if want(Part::Datapath) {
            sizes.extend(&p.datapath);
        }
        if want(Part::Control) {
            sizes.extend(&p.control);
        }
        sizes.sort_unstable();
        sizes.dedup();
        for n in sizes {
            let t = step(&format!("in-process: {n} Services × 10 endpoints"));
            let packets = want(Part::Datapath) && p.datapath.contains(&n);
            let change = want(Part::Control) && p.control.contains(&n);
            let r = inproc::measure(n, packets, change, p.effort)
                .with_context(|| format!("in-process measurement at {n} Services"))?;
            eprintln!(
                "  full sync {:.1} ms ({} ops){}{} [{:.1}s]",
                inproc::ms(r.full_sync.total()),
                r.full_sync.ops,
                r.packets
                    .map(|c| format!(
                        "; ns/packet new {:.0} est {:.0} reply {:.0} none {:.0} \
                         (IPv6 {:.0} / {:.0} / {:.0} / {:.0})",
                        c.new_flow,
                        c.established,
                        c.reply,
                        c.no_service,
                        c.ipv6.new_flow,
                        c.ipv6.established,
                        c.ipv6.reply,
                        c.ipv6.no_service
                    ))
                    .unwrap_or_default(),
                r.change
                    .map(|(_, d)| format!("; endpoint change {:.2} ms", inproc::ms(d)))
                    .unwrap_or_default(),
                t.elapsed().as_secs_f64()
            );
            if let Some(c) = r.packets {
                let per: Vec<String> = proxy_common::Scheduler::ALL
                    .iter()
                    .zip(c.schedulers)
                    .map(|(s, c)| format!("{} {:.0}/{:.0}", s.name(), c.new_flow, c.established))
                    .collect();
                eprintln!("  per scheduler, ns new/established: {}", per.join(", "));
            }
            results.inproc.push(r);
        }
        if want(Part::Datapath) {
            results.datapath_sizes = p.datapath.clone();
        }
        if want(Part::Control) {
            results.control_sizes = p.control.clone();
        }
    }

    // Maglev tables' memory at the largest control size (10,000 for quick and full).
    if want(Part::Control) {
        let n = p.control.iter().copied().max().unwrap_or(10).min(10_000);
        let t = step(&format!("Maglev tables: {n} mh Services × 10 endpoints"));
        let v = inproc::maglev_memory(n).context("Maglev table memory")?;
        eprintln!("  {v} [{:.1}s]", t.elapsed().as_secs_f64());
        results.maglev = Some(v);
    }

    let have_iptables = which("iptables-restore");
    let have_nft = which("nft");
    results.iptables_version = tool_version("iptables", &["--version"]);
    results.nft_version = tool_version("nft", &["--version"]);

    // 4: baselines' programming time and the agent's footprint.
    if want(Part::Control) {
        for &n in &p.restore {
            for mode in [e2e::Mode::Iptables, e2e::Mode::Nftables] {
                if (mode == e2e::Mode::Iptables && !have_iptables)
                    || (mode == e2e::Mode::Nftables && !have_nft)
                {
                    continue;
                }
                let t = step(&format!("{} restore: {n} Services", mode.name()));
                let r = e2e::restore_time(&p.e2e_cfg, mode, n)?;
                let v = match r {
                    e2e::Programmed::Done(ms) => {
                        eprintln!("  {ms:.0} ms");
                        json!({ "mode": mode.name(), "services": n, "ms": ms })
                    }
                    e2e::Programmed::TimedOut => {
                        eprintln!("  > {:?}", p.e2e_cfg.program_timeout);
                        json!({ "mode": mode.name(), "services": n, "ms": null,
                                "timed_out_after_s": p.e2e_cfg.program_timeout.as_secs() })
                    }
                };
                let _ = t;
                results.restore.push(v);
            }
        }
        for &n in &p.cold_start {
            let t = step(&format!(
                "cold start: {n} Services (fresh node, with IPv6, restart)"
            ));
            let v = e2e::cold_start(&p.e2e_cfg, n, p.cold_start_rounds)?;
            eprintln!("  {v} [{:.1}s]", t.elapsed().as_secs_f64());
            results.cold_start.push(v);
        }
        for &n in &p.rss {
            let t = step(&format!(
                "agent binary: {n} Services (first sync, peak RSS)"
            ));
            let v = e2e::agent_footprint(&p.e2e_cfg, n)?;
            eprintln!("  {v} [{:.1}s]", t.elapsed().as_secs_f64());
            results.agent.push(v);
        }
    }

    // 2 + 3: end to end, ours and the baselines.
    if want(Part::E2e) {
        for &n in &p.e2e {
            for mode in e2e::Mode::ALL {
                if (mode == e2e::Mode::Iptables && !have_iptables)
                    || (mode == e2e::Mode::Nftables && !have_nft)
                {
                    continue;
                }
                let t = step(&format!("end to end: {} at {n} Services", mode.name()));
                let r = e2e::run(&p.e2e_cfg, mode, n)
                    .with_context(|| format!("end to end: {} at {n} Services", mode.name()))?;
                report::print_run(&r);
                eprintln!("  [{:.1}s]", t.elapsed().as_secs_f64());
                results.e2e.push(r);
            }
        }
    }

    // NodePort new connections through SNAT: ours, then the baselines, each in a fresh topology.
    if want(Part::SnatRate) {
        let c = &p.snat_rate;
        for mode in e2e::Mode::ALL {
            if (mode == e2e::Mode::Iptables && !have_iptables)
                || (mode == e2e::Mode::Nftables && !have_nft)
            {
                continue;
            }
            let t = step(&format!(
                "NodePort through SNAT: {} at {}/s for {} s",
                mode.name(),
                c.rate,
                c.seconds
            ));
            let r = snat_rate::run(c, mode)
                .with_context(|| format!("NodePort through SNAT: {}", mode.name()))?;
            report::print_snat_run(&r);
            eprintln!("  [{:.1}s]", t.elapsed().as_secs_f64());
            results.snat_rate.push(r);
        }
    }

    results.seconds = started.elapsed().as_secs_f64();
    results.loadavg_at_end = report::loadavg();
    std::fs::create_dir_all(&args.out_dir)?;
    let json_path = args.out_dir.join("results.json");
    std::fs::write(
        &json_path,
        serde_json::to_string_pretty(&results.to_json())?,
    )?;
    let md = results.markdown();
    std::fs::write(args.out_dir.join("results.md"), &md)?;
    for (name, svg) in results.plots() {
        std::fs::write(args.out_dir.join(name), svg)?;
    }
    println!("{md}");
    eprintln!(
        "bench: wrote {} (+ results.md, *.svg) in {:.0}s",
        json_path.display(),
        results.seconds
    );
    Ok(())
}

fn which(tool: &str) -> bool {
    std::process::Command::new("sh")
        .args(["-c", &format!("command -v {tool}")])
        .output()
        .is_ok_and(|o| o.status.success())
}

fn tool_version(tool: &str, args: &[&str]) -> Value {
    std::process::Command::new(tool)
        .args(args)
        .output()
        .ok()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_owned())
        .into()
}

fn parse_scheduler(name: &str) -> Result<proxy_common::Scheduler, String> {
    proxy_common::Scheduler::parse(name).ok_or_else(|| format!("unknown scheduler {name:?}"))
}
