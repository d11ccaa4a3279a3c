//! Results: JSON, Markdown tables (every figure with its ratio against the baseline measured in
//! the same run) and SVG plots.

use std::fmt::Write as _;

use proxy_common::Scheduler;
use serde_json::{Value, json};

use super::{
    Size,
    e2e::{Mode, Run},
    inproc::{self, PACKET_KINDS, SizeResult},
    loadgen::LoadResult,
    snat_rate,
    svg::{Chart, Series, line_chart},
};

#[derive(Default)]
pub struct Results {
    pub size: Option<Size>,
    pub command_line: String,
    pub machine: Value,
    pub seconds: f64,
    pub datapath_sizes: Vec<usize>,
    pub control_sizes: Vec<usize>,
    pub inproc: Vec<SizeResult>,
    pub restore: Vec<Value>,
    /// `e2e::cold_start` rows.
    pub cold_start: Vec<Value>,
    pub agent: Vec<Value>,
    pub e2e: Vec<Run>,
    pub iptables_version: Value,
    pub nft_version: Value,
    pub loadavg_at_end: f64,
    /// Maglev tables' memory (`inproc::maglev_memory`).
    pub maglev: Option<Value>,
    /// NodePort new connections through SNAT, one run per dataplane.
    pub snat_rate: Vec<snat_rate::Run>,
}

pub fn machine() -> Value {
    let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let model = cpuinfo
        .lines()
        .find(|l| l.starts_with("model name"))
        .and_then(|l| l.split(':').nth(1))
        .map(|s| s.trim().to_owned())
        .unwrap_or_default();
    let nproc = std::thread::available_parallelism().map_or(0, usize::from);
    let kernel = std::fs::read_to_string("/proc/sys/kernel/osrelease")
        .unwrap_or_default()
        .trim()
        .to_owned();
    let mem_kib: u64 = std::fs::read_to_string("/proc/meminfo")
        .unwrap_or_default()
        .lines()
        .find(|l| l.starts_with("MemTotal:"))
        .and_then(|l| l.split_whitespace().nth(1)?.parse().ok())
        .unwrap_or(0);
    json!({ "nproc": nproc, "cpu_model": model, "kernel": kernel,
            "mem_gib": (mem_kib as f64 / 1024.0 / 1024.0 * 10.0).round() / 10.0,
            "loadavg_at_start": loadavg() })
}

/// The 1-minute load average (the machine is shared: other work shows up here).
pub fn loadavg() -> f64 {
    std::fs::read_to_string("/proc/loadavg")
        .ok()
        .and_then(|s| s.split_whitespace().next()?.parse().ok())
        .unwrap_or(f64::NAN)
}

fn f(v: f64, digits: usize) -> String {
    if v.is_finite() {
        format!("{v:.digits$}")
    } else {
        "–".into()
    }
}

fn ratio(a: f64, b: f64) -> String {
    if a.is_finite() && b.is_finite() && b != 0.0 {
        format!("{:.2}×", a / b)
    } else {
        "–".into()
    }
}

fn with_ratio(v: f64, base: f64, digits: usize) -> String {
    format!("{} ({})", f(v, digits), ratio(v, base))
}

fn n_fmt(n: usize) -> String {
    let s = n.to_string();
    let mut out = String::new();
    for (i, c) in s.chars().enumerate() {
        if i > 0 && (s.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(c);
    }
    out
}

/// Legend names for the datapath plot.
fn short_kind(k: &str) -> &str {
    match k {
        "new_flow" => "new flow, one Service",
        "new_flow_spread" => "new flow, spread",
        "established" => "established",
        "reply" => "reply (egress)",
        "no_service" => "not a Service",
        "single_floor" => "1-run method floor",
        other => other,
    }
}

/// Per-scheduler new-flow and established ns/packet, one table each: a row per size, a column
/// per scheduler, ratios against the smallest size (flat = 1.00×).
fn scheduler_tables(s: &mut String, dp: &[(usize, inproc::PacketCosts)]) {
    let Some((n0, base)) = dp.first() else {
        return;
    };
    type Get = fn(&inproc::SchedCosts) -> f64;
    let kinds: [(&str, &str, Get); 2] = [
        ("new flow (SYN)", "a Service of 10 endpoints", |c| {
            c.new_flow
        }),
        (
            "established flow",
            "the established-flow pair of Services",
            |c| c.established,
        ),
    ];
    for (title, what, get) in kinds {
        let _ = writeln!(
            s,
            "### Datapath per scheduler: {title}, ns per packet (median; {what} with the \
             `kube-proxy-ebpf.io/scheduler` annotation among the others), ratio vs {} Service{}\n",
            n_fmt(*n0),
            if *n0 == 1 { "" } else { "s" }
        );
        let _ = write!(s, "| Services × 10 endpoints |");
        for sc in Scheduler::ALL {
            let _ = write!(s, " {} |", sc.name());
        }
        let _ = write!(s, "\n|---:|");
        for _ in Scheduler::ALL {
            s.push_str("---:|");
        }
        s.push('\n');
        for (n, c) in dp {
            let _ = write!(s, "| {} |", n_fmt(*n));
            for (sc, b) in c.schedulers.iter().zip(&base.schedulers) {
                let _ = write!(s, " {} |", with_ratio(get(sc), get(b), 0));
            }
            s.push('\n');
        }
        s.push('\n');
    }
}

/// IPv6 beside IPv4, per size: the same kinds, "IPv4 / IPv6" in each cell.
fn ipv6_table(s: &mut String, dp: &[(usize, inproc::PacketCosts)]) {
    let _ = writeln!(
        s,
        "### Datapath: IPv4 / IPv6 ns per packet (median; one IPv6 Service of 10 endpoints \
         and an IPv6 established-flow pair written straight into the IPv6 maps)\n\n\
         | Services × 10 endpoints | new flow (SYN) | established flow | reply (tc_egress) | not a Service |\n\
         |---:|---:|---:|---:|---:|"
    );
    for (n, c) in dp {
        let v6 = &c.ipv6;
        let _ = writeln!(
            s,
            "| {} | {:.0} / {:.0} | {:.0} / {:.0} | {:.0} / {:.0} | {:.0} / {:.0} |",
            n_fmt(*n),
            c.new_flow,
            v6.new_flow,
            c.established,
            v6.established,
            c.reply,
            v6.reply,
            c.no_service,
            v6.no_service
        );
    }
    s.push('\n');
}

pub fn print_run(r: &Run) {
    if let Some(s) = &r.skipped {
        eprintln!("  skipped: {s}");
        return;
    }
    let l = |x: &Option<LoadResult>| {
        x.as_ref().map_or("–".into(), |x| {
            format!(
                "{:.0} conn/s p50 {} µs p99 {} µs errors {} slow {}",
                x.conns_per_s, x.p50_us, x.p99_us, x.errors, x.slow_1s
            )
        })
    };
    eprintln!(
        "  programmed in {:.0} ms; direct {}; VIP {}; iperf3 direct {:.2} Gbit/s VIP {:.2} Gbit/s",
        r.program_ms.unwrap_or(f64::NAN),
        l(&r.direct),
        l(&r.vip),
        r.iperf_direct_gbps.unwrap_or(f64::NAN),
        r.iperf_vip_gbps.unwrap_or(f64::NAN)
    );
    eprintln!(
        "  from the node itself: direct {}; VIP {}",
        l(&r.host_direct),
        l(&r.host_vip)
    );
}

/// `12 (connect:timeout 10, recv:reset 2)`, or `0`.
fn failures(l: &super::loadgen::PacedResult) -> String {
    if l.failures.is_empty() {
        return l.failed.to_string();
    }
    let by: Vec<String> = (l.failures.iter())
        .map(|(kind, n)| format!("{kind} {n}"))
        .collect();
    format!("{} ({})", l.failed, by.join(", "))
}

fn opt(v: Option<u64>) -> String {
    v.map_or("–".into(), |v| n_fmt(v as usize))
}

pub fn print_snat_run(r: &snat_rate::Run) {
    if let Some(s) = &r.skipped {
        eprintln!("  skipped: {s}");
        return;
    }
    let Some(l) = &r.load else { return };
    eprintln!(
        "  {} attempted, {} answered, failed {}; {:.0} conn/s; p50 {} µs p99 {} µs max {} µs; \
         launches: {} late, max lag {:.1} ms ({} threads); first error {:?}",
        l.attempted,
        l.answered,
        failures(l),
        l.achieved_per_s,
        l.p50_us,
        l.p99_us,
        l.max_us,
        l.late_launches,
        l.max_launch_lag_us as f64 / 1e3,
        l.threads,
        l.first_error
    );
    let counters: Vec<String> = (snat_rate::COUNTERS.iter())
        .map(|c| format!("{c} {}", opt(r.counter(c))))
        .collect();
    eprintln!(
        "  node A: {}; tracked flows after {}, insert_failed {}{}",
        counters.join(", "),
        opt(r.conntrack_entries),
        opt(r.conntrack_insert_failed),
        r.map_entries.map_or(String::new(), |(ct, snat)| format!(
            "; CONNTRACK_V1 entries {}, SNAT_V1 entries {}",
            n_fmt(ct as usize),
            n_fmt(snat as usize)
        ))
    );
}

/// The NodePort-through-SNAT section: a row per dataplane, then ours against each baseline.
fn snat_rate_section(s: &mut String, runs: &[snat_rate::Run]) {
    let Some(first) = runs.first() else {
        return;
    };
    let _ = writeln!(
        s,
        "### NodePort new connections through SNAT: {}/s for {} s, ours vs kube-proxy's rule sets\n\n\
         An external client opens short connections (connect, one HTTP GET, read to EOF; the \
         server closes first) to NodePort {} of node A, whose only endpoint is a pod on node B \
         (externalTrafficPolicy Cluster: node A SNATs every connection to its own address toward \
         that one backend; the baselines with kube-proxy's `MASQUERADE --random-fully`). A new \
         connection is due every 1/{} s whatever the others do (open loop); each dataplane in a \
         fresh two-node topology. Latency: before `connect()` to the end of the reply, answered \
         connections only.\n\n\
         | dataplane | attempted | answered | failed (by cause) | answered conn/s | p50 µs | p99 µs | max µs | slow ≥0.9 s | late launches ≥10 ms (max lag ms) | node A: snat_new / snat_port_kept / drop_snat_ports_exhausted | node A flows tracked after the load: netfilter's entries, ours ORIGINAL entries (insert_failed) | 1-min load avg after |\n\
         |---|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        first.rate,
        first.seconds,
        snat_rate::NODE_PORT,
        first.rate
    );
    for r in runs {
        if let Some(why) = &r.skipped {
            let _ = writeln!(
                s,
                "| {} | skipped: {} | | | | | | | | | | | |",
                r.mode.name(),
                why.lines().next().unwrap_or_default()
            );
            continue;
        }
        let Some(l) = &r.load else { continue };
        let counters: Vec<String> = (snat_rate::COUNTERS.iter())
            .map(|c| opt(r.counter(c)))
            .collect();
        let _ = writeln!(
            s,
            "| {} | {} | {} | {} | {} | {} | {} | {} | {} | {} ({}) | {} | {} ({}) | {} |",
            r.mode.name(),
            n_fmt(l.attempted as usize),
            n_fmt(l.answered as usize),
            failures(l),
            f(l.achieved_per_s, 0),
            l.p50_us,
            l.p99_us,
            l.max_us,
            l.slow_1s,
            l.late_launches,
            f(l.max_launch_lag_us as f64 / 1e3, 1),
            if r.mode == Mode::Ebpf {
                counters.join(" / ")
            } else {
                "–".into()
            },
            opt(r.conntrack_entries),
            opt(r.conntrack_insert_failed),
            f(r.loadavg_after, 2),
        );
    }
    s.push('\n');
    let _ = writeln!(
        s,
        "| metric (ratio = ours / baseline) | kube-proxy-ebpf | iptables | nftables | ours/iptables | ours/nftables |\n\
         |---|---:|---:|---:|---:|---:|"
    );
    type Metric = fn(&super::loadgen::PacedResult) -> f64;
    let metrics: [(&str, Metric, usize); 4] = [
        ("answered conn/s", |l| l.achieved_per_s, 0),
        (
            "answered %",
            |l| 100.0 * l.answered as f64 / l.attempted.max(1) as f64,
            2,
        ),
        ("p50 µs", |l| l.p50_us as f64, 0),
        ("p99 µs", |l| l.p99_us as f64, 0),
    ];
    for (name, get, digits) in metrics {
        let val = |mode| {
            (runs.iter())
                .find(|r| r.mode == mode && r.skipped.is_none())
                .and_then(|r| r.load.as_ref())
                .map_or(f64::NAN, get)
        };
        let (o, i, nf) = (val(Mode::Ebpf), val(Mode::Iptables), val(Mode::Nftables));
        let _ = writeln!(
            s,
            "| {name} | {} | {} | {} | {} | {} |",
            f(o, digits),
            f(i, digits),
            f(nf, digits),
            ratio(o, i),
            ratio(o, nf)
        );
    }
    // Conntrack pressure: flows still tracked just after the load (one entry per flow each).
    let tracked = |mode| {
        (runs.iter())
            .find(|r| r.mode == mode && r.skipped.is_none())
            .and_then(|r| r.conntrack_entries)
            .map_or(f64::NAN, |n| n as f64)
    };
    let (o, i, nf) = (
        tracked(Mode::Ebpf),
        tracked(Mode::Iptables),
        tracked(Mode::Nftables),
    );
    let _ = writeln!(
        s,
        "| flows tracked after the load | {} | {} | {} | {} | {} |",
        f(o, 0),
        f(i, 0),
        f(nf, 0),
        ratio(o, i),
        ratio(o, nf)
    );
    s.push('\n');
}

impl Results {
    pub fn to_json(&self) -> Value {
        json!({
            "size": format!("{:?}", self.size.unwrap_or_default()).to_lowercase(),
            "command": self.command_line,
            "machine": self.machine,
            "iptables": self.iptables_version,
            "nft": self.nft_version,
            "seconds": self.seconds,
            "loadavg_at_end": self.loadavg_at_end,
            "in_process": self.inproc.iter().map(SizeResult::to_json).collect::<Vec<_>>(),
            "netfilter_restore": self.restore,
            "agent_binary": self.agent,
            "end_to_end": self.e2e.iter().map(Run::to_json).collect::<Vec<_>>(),
            "maglev_tables": self.maglev,
            "nodeport_snat_rate": self.snat_rate.iter().map(snat_rate::Run::to_json).collect::<Vec<_>>(),
        })
    }

    fn dp(&self) -> Vec<(usize, inproc::PacketCosts)> {
        self.inproc
            .iter()
            .filter(|r| self.datapath_sizes.contains(&r.services))
            .filter_map(|r| r.packets.map(|p| (r.services, p)))
            .collect()
    }

    fn cp(&self) -> Vec<&SizeResult> {
        self.inproc
            .iter()
            .filter(|r| self.control_sizes.contains(&r.services))
            .collect()
    }

    fn restore_ms(&self, mode: Mode, n: usize) -> (Option<f64>, Option<u64>) {
        self.restore
            .iter()
            .find(|v| v["mode"] == mode.name() && v["services"] == n)
            .map_or((None, None), |v| {
                (v["ms"].as_f64(), v["timed_out_after_s"].as_u64())
            })
    }

    fn e2e_run(&self, mode: Mode, n: usize) -> Option<&Run> {
        self.e2e
            .iter()
            .find(|r| r.mode == mode && r.services == n && r.skipped.is_none())
    }

    pub fn markdown(&self) -> String {
        let mut s = String::new();
        let m = &self.machine;
        let _ = writeln!(
            s,
            "Machine: {} × {} ({} GiB), kernel {}; {}; {}. Command: `{}` ({:.0} s). \
             1-min load average at start {}, at end {} (shared machine: other work competes).\n",
            m["nproc"],
            m["cpu_model"].as_str().unwrap_or("?"),
            m["mem_gib"],
            m["kernel"].as_str().unwrap_or("?"),
            self.iptables_version.as_str().unwrap_or("iptables: absent"),
            self.nft_version.as_str().unwrap_or("nft: absent"),
            self.command_line,
            self.seconds,
            m["loadavg_at_start"],
            self.loadavg_at_end
        );

        let dp = self.dp();
        if let Some((_, base)) = dp.first() {
            let _ = writeln!(
                s,
                "### Datapath: ns per packet (BPF_PROG_TEST_RUN, median), ratio vs {} Service\n",
                dp[0].0
            );
            let _ = write!(s, "| Services × 10 endpoints |");
            for (_, title) in PACKET_KINDS {
                let _ = write!(s, " {title} |");
            }
            let _ = write!(s, "\n|---:|");
            for _ in PACKET_KINDS {
                s.push_str("---:|");
            }
            s.push('\n');
            for (n, c) in &dp {
                let _ = write!(s, "| {} |", n_fmt(*n));
                for (k, _) in PACKET_KINDS {
                    let _ = write!(s, " {} |", with_ratio(c.get(k), base.get(k), 0));
                }
                s.push('\n');
            }
            s.push('\n');
            scheduler_tables(&mut s, &dp);
            ipv6_table(&mut s, &dp);
        }

        let cp = self.cp();
        if !cp.is_empty() {
            let _ = writeln!(
                s,
                "### Control plane in process: snapshot → programmed maps (ms)\n\n\
                 | Services × 10 endpoints | translate | plan | apply (map writes) | first full sync | map ops | one endpoint change (p50, translate+plan+apply) |\n\
                 |---:|---:|---:|---:|---:|---:|---:|"
            );
            for r in &cp {
                let fs = r.full_sync;
                let _ = writeln!(
                    s,
                    "| {} | {} | {} | {} | **{}** | {} | {} |",
                    n_fmt(r.services),
                    f(inproc::ms(fs.translate), 1),
                    f(inproc::ms(fs.plan), 1),
                    f(inproc::ms(fs.apply), 1),
                    f(inproc::ms(fs.total()), 1),
                    n_fmt(fs.ops),
                    r.change.map_or("–".into(), |(parts, total)| format!(
                        "{} ({} + {} + {})",
                        f(inproc::ms(total), 2),
                        f(inproc::ms(parts.translate), 2),
                        f(inproc::ms(parts.plan), 2),
                        f(inproc::ms(parts.apply), 3)
                    )),
                );
            }
            s.push('\n');
        }

        if !self.restore.is_empty() {
            let _ = writeln!(
                s,
                "### Programming time vs kube-proxy's rule sets (same Services, ms; ratio = baseline / ours)\n\n\
                 | Services × 10 endpoints | ours: in-process full sync | ours: agent start → first sync (incl. YAML) | iptables-restore | nft -f |\n\
                 |---:|---:|---:|---:|---:|"
            );
            let mut sizes: Vec<usize> = self
                .restore
                .iter()
                .filter_map(|v| v["services"].as_u64().map(|n| n as usize))
                .collect();
            sizes.dedup();
            for n in sizes {
                let ours = self
                    .inproc
                    .iter()
                    .find(|r| r.services == n)
                    .map_or(f64::NAN, |r| inproc::ms(r.full_sync.total()));
                let agent = self
                    .agent
                    .iter()
                    .find(|v| v["services"] == n)
                    .and_then(|v| v["start_to_first_sync_ms"].as_f64())
                    .unwrap_or(f64::NAN);
                let cell = |mode| match self.restore_ms(mode, n) {
                    (Some(ms), _) => format!("{} ({} of ours)", f(ms, 0), ratio(ms, ours)),
                    (None, Some(t)) => format!("> {t} s (timed out)"),
                    _ => "–".into(),
                };
                let _ = writeln!(
                    s,
                    "| {} | {} | {} | {} | {} |",
                    n_fmt(n),
                    f(ours, 1),
                    f(agent, 0),
                    cell(Mode::Iptables),
                    cell(Mode::Nftables)
                );
            }
            s.push('\n');
        }

        if !self.cold_start.is_empty() {
            let _ = writeln!(
                s,
                "### Cold start: agent start → first sync (ms; median of the rounds) vs kube-proxy's rule-set load\n\n\
                 | Services × 10 endpoints | fresh node, IPv4 | fresh node, IPv6 too | restart (programs taken from pins) | iptables-restore | nft -f |\n\
                 |---:|---:|---:|---:|---:|---:|"
            );
            for v in &self.cold_start {
                let ms = |k: &str| f(v[k].as_f64().unwrap_or(f64::NAN), 0);
                let _ = writeln!(
                    s,
                    "| {} | {} | {} | {} | {} | {} |",
                    n_fmt(v["services"].as_u64().unwrap_or(0) as usize),
                    ms("fresh_ipv4_ms"),
                    ms("fresh_dual_stack_ms"),
                    ms("restart_ms"),
                    ms("iptables_ms"),
                    ms("nftables_ms")
                );
            }
            s.push('\n');
        }

        if !self.agent.is_empty() {
            let _ = writeln!(
                s,
                "### Agent binary on a manifest folder (peak RSS after the first sync)\n\n\
                 | Services × 10 endpoints | start → first sync (ms) | VmHWM (MiB) | VmRSS (MiB) | frontends programmed | problems |\n\
                 |---:|---:|---:|---:|---:|---:|"
            );
            for v in &self.agent {
                let _ = writeln!(
                    s,
                    "| {} | {} | {} | {} | {} | {} |",
                    n_fmt(v["services"].as_u64().unwrap_or(0) as usize),
                    f(v["start_to_first_sync_ms"].as_f64().unwrap_or(f64::NAN), 0),
                    f(v["vm_hwm_mib"].as_f64().unwrap_or(f64::NAN), 1),
                    f(v["vm_rss_mib"].as_f64().unwrap_or(f64::NAN), 1),
                    v["frontends_programmed"],
                    v["problems"]
                );
            }
            s.push('\n');
        }

        if let Some(v) = &self.maglev {
            let mib = |k: &str| v[k].as_u64().unwrap_or(0) as f64 / (1u64 << 20) as f64;
            let _ = writeln!(
                s,
                "### Maglev tables (`mh`): kernel memory\n\n\
                 {} Maglev Services × 10 endpoints at M = {} ({} chunks of 960 entries per table): \
                 {:.1} MiB allocated (2 KiB per chunk), {:.1} MiB by the kernel's account \
                 (memlock); planned and written in {:.0} ms.\n",
                n_fmt(v["services"].as_u64().unwrap_or(0) as usize),
                v["table_size"],
                v["chunks_per_table"],
                mib("allocated_bytes"),
                mib("kernel_memlock_bytes"),
                v["plan_and_write_ms"].as_f64().unwrap_or(f64::NAN)
            );
        }

        if !self.e2e.is_empty() {
            let _ = writeln!(
                s,
                "### End to end: short connections (one HTTP request each, latency incl. handshake) and iperf3\n\n\
                 | Services | dataplane | direct conn/s | VIP conn/s (VIP/direct) | p50 µs direct / VIP | p99 µs direct / VIP | errors (slow ≥0.9 s) | iperf3 Gbit/s direct | iperf3 VIP (VIP/direct) | programmed in (ms) |\n\
                 |---:|---|---:|---:|---:|---:|---:|---:|---:|---:|"
            );
            for r in &self.e2e {
                if let Some(why) = &r.skipped {
                    let _ = writeln!(
                        s,
                        "| {} | {} | skipped: {} | | | | | | | |",
                        n_fmt(r.services),
                        r.mode.name(),
                        why.lines().next().unwrap_or_default()
                    );
                    continue;
                }
                let (Some(d), Some(v)) = (&r.direct, &r.vip) else {
                    continue;
                };
                let id = r.iperf_direct_gbps.unwrap_or(f64::NAN);
                let iv = r.iperf_vip_gbps.unwrap_or(f64::NAN);
                let _ = writeln!(
                    s,
                    "| {} | {} | {} | {} | {} / {} | {} / {} | {} ({}) | {} | {} | {} |",
                    n_fmt(r.services),
                    r.mode.name(),
                    f(d.conns_per_s, 0),
                    with_ratio(v.conns_per_s, d.conns_per_s, 0),
                    d.p50_us,
                    v.p50_us,
                    d.p99_us,
                    v.p99_us,
                    d.errors + v.errors,
                    d.slow_1s + v.slow_1s,
                    f(id, 2),
                    with_ratio(iv, id, 2),
                    f(r.program_ms.unwrap_or(f64::NAN), 0),
                );
            }
            s.push('\n');
            let _ = writeln!(
                s,
                "### End to end from a process of the node itself (host network; ours: cgroup socket hooks, baselines: the OUTPUT chain)\n\n\
                 | Services | dataplane | direct conn/s | VIP conn/s (VIP/direct) | p50 µs direct / VIP | p99 µs direct / VIP | errors (slow ≥0.9 s) |\n\
                 |---:|---|---:|---:|---:|---:|---:|"
            );
            for r in &self.e2e {
                let (Some(d), Some(v)) = (&r.host_direct, &r.host_vip) else {
                    continue;
                };
                let _ = writeln!(
                    s,
                    "| {} | {} | {} | {} | {} / {} | {} / {} | {} ({}) |",
                    n_fmt(r.services),
                    r.mode.name(),
                    f(d.conns_per_s, 0),
                    with_ratio(v.conns_per_s, d.conns_per_s, 0),
                    d.p50_us,
                    v.p50_us,
                    d.p99_us,
                    v.p99_us,
                    d.errors + v.errors,
                    d.slow_1s + v.slow_1s,
                );
            }
            s.push('\n');
            let _ = writeln!(
                s,
                "### End to end through the VIP: ours vs kube-proxy's rule sets (ratio = ours / baseline; latency: lower is better)\n\n\
                 | Services | metric | kube-proxy-ebpf | iptables | nftables | ours/iptables | ours/nftables |\n\
                 |---:|---|---:|---:|---:|---:|---:|"
            );
            let mut sizes: Vec<usize> = self.e2e.iter().map(|r| r.services).collect();
            sizes.dedup();
            type Metric = fn(&Run) -> Option<f64>;
            let metrics: [(&str, Metric, usize); 7] = [
                ("VIP conn/s", |r| r.vip.as_ref().map(|v| v.conns_per_s), 0),
                ("VIP p50 µs", |r| r.vip.as_ref().map(|v| v.p50_us as f64), 0),
                ("VIP p99 µs", |r| r.vip.as_ref().map(|v| v.p99_us as f64), 0),
                ("iperf3 VIP Gbit/s", |r| r.iperf_vip_gbps, 2),
                (
                    "from the node: VIP conn/s",
                    |r| r.host_vip.as_ref().map(|v| v.conns_per_s),
                    0,
                ),
                (
                    "from the node: VIP p50 µs",
                    |r| r.host_vip.as_ref().map(|v| v.p50_us as f64),
                    0,
                ),
                (
                    "from the node: VIP p99 µs",
                    |r| r.host_vip.as_ref().map(|v| v.p99_us as f64),
                    0,
                ),
            ];
            for n in sizes {
                for (name, get, digits) in metrics {
                    let val = |mode| self.e2e_run(mode, n).and_then(get).unwrap_or(f64::NAN);
                    let (o, i, nf) = (val(Mode::Ebpf), val(Mode::Iptables), val(Mode::Nftables));
                    let _ = writeln!(
                        s,
                        "| {} | {name} | {} | {} | {} | {} | {} |",
                        n_fmt(n),
                        f(o, digits),
                        f(i, digits),
                        f(nf, digits),
                        ratio(o, i),
                        ratio(o, nf)
                    );
                }
            }
            s.push('\n');
        }
        snat_rate_section(&mut s, &self.snat_rate);
        s
    }

    pub fn plots(&self) -> Vec<(&'static str, String)> {
        let mut out = Vec::new();
        let dp = self.dp();
        if !dp.is_empty() {
            let series = PACKET_KINDS
                .iter()
                .map(|(k, _)| Series {
                    name: short_kind(k).to_owned(),
                    points: dp.iter().map(|(n, c)| (*n as f64, c.get(k))).collect(),
                })
                .collect::<Vec<_>>();
            out.push((
                "datapath-ns-per-packet.svg",
                line_chart(
                    &Chart {
                        title: "Datapath cost per packet vs number of Services",
                        x_label: "Services × 10 endpoints",
                        y_label: "ns per packet (median)",
                        log_x: true,
                        log_y: false,
                        y_from_zero: true,
                    },
                    &series,
                ),
            ));
        }
        let cp = self.cp();
        if !cp.is_empty() {
            let mut series = vec![Series {
                name: "ours: full sync".into(),
                points: cp
                    .iter()
                    .map(|r| (r.services as f64, inproc::ms(r.full_sync.total())))
                    .collect(),
            }];
            series.push(Series {
                name: "ours: endpoint change".into(),
                points: cp
                    .iter()
                    .filter_map(|r| r.change.map(|(_, d)| (r.services as f64, inproc::ms(d))))
                    .collect(),
            });
            for mode in [Mode::Iptables, Mode::Nftables] {
                series.push(Series {
                    name: match mode {
                        Mode::Iptables => "iptables-restore".into(),
                        _ => "nft -f".into(),
                    },
                    points: self
                        .restore
                        .iter()
                        .filter(|v| v["mode"] == mode.name())
                        .filter_map(|v| Some((v["services"].as_f64()?, v["ms"].as_f64()?)))
                        .collect(),
                });
            }
            out.push((
                "control-plane-ms.svg",
                line_chart(
                    &Chart {
                        title: "Programming time vs number of Services",
                        x_label: "Services × 10 endpoints",
                        y_label: "ms (log)",
                        log_x: true,
                        log_y: true,
                        y_from_zero: false,
                    },
                    &series,
                ),
            ));
        }
        if !self.e2e.is_empty() {
            let mut series = Vec::new();
            for mode in Mode::ALL {
                let runs: Vec<&Run> = self
                    .e2e
                    .iter()
                    .filter(|r| r.mode == mode && r.skipped.is_none())
                    .collect();
                series.push(Series {
                    name: format!("{} VIP/direct", mode.name()),
                    points: runs
                        .iter()
                        .filter_map(|r| {
                            Some((
                                r.services.max(1) as f64,
                                r.vip.as_ref()?.conns_per_s / r.direct.as_ref()?.conns_per_s,
                            ))
                        })
                        .collect(),
                });
            }
            out.push((
                "e2e-vip-vs-direct.svg",
                line_chart(
                    &Chart {
                        title: "Short-connection rate through the VIP / straight to the pods",
                        x_label: "Services × 10 endpoints",
                        y_label: "VIP conn/s ÷ direct conn/s",
                        log_x: true,
                        log_y: false,
                        y_from_zero: true,
                    },
                    &series,
                ),
            ));
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::loadgen::PacedResult;

    fn snat_run(mode: Mode, answered: u64, p99_us: u64) -> snat_rate::Run {
        snat_rate::Run {
            mode,
            rate: 1_000,
            seconds: 20,
            skipped: None,
            load: Some(PacedResult {
                rate: 1_000.0,
                planned: 20_000,
                attempted: 20_000,
                answered,
                failed: 20_000 - answered,
                failures: [("connect:timeout".to_owned(), 20_000 - answered)]
                    .into_iter()
                    .filter(|(_, n)| *n > 0)
                    .collect(),
                achieved_per_s: answered as f64 / 20.0,
                p50_us: 500,
                p99_us,
                ..Default::default()
            }),
            counters: vec![Some(20_000), Some(19_990), Some(0)],
            conntrack_entries: Some(20_000),
            conntrack_insert_failed: (mode != Mode::Ebpf).then_some(0),
            map_entries: (mode == Mode::Ebpf).then_some((40_000, 40_000)),
            loadavg_after: 1.5,
        }
    }

    #[test]
    fn the_snat_section_has_a_row_per_dataplane_and_ours_over_each_baseline() {
        let mut s = String::new();
        let runs = [
            snat_run(Mode::Ebpf, 19_990, 2_000),
            snat_run(Mode::Iptables, 20_000, 1_000),
            snat_run(Mode::Nftables, 20_000, 4_000),
        ];
        snat_rate_section(&mut s, &runs);
        assert!(s.starts_with("### NodePort new connections through SNAT: 1000/s for 20 s"));
        assert!(
            s.contains(
                "| kube-proxy-ebpf | 20,000 | 19,990 | 10 (connect:timeout 10) | 1000 | 500 | \
                 2000 |"
            ),
            "{s}"
        );
        assert!(s.contains("| 20,000 / 19,990 / 0 | 20,000 (–) |"), "{s}");
        assert!(
            s.contains("| flows tracked after the load | 20000 | 20000 | 20000 | 1.00× | 1.00× |"),
            "{s}"
        );
        assert!(s.contains("| iptables | 20,000 | 20,000 | 0 |"), "{s}");
        assert!(s.contains("| 20,000 (0) | 1.50 |"), "{s}");
        assert!(
            s.contains("| p99 µs | 2000 | 1000 | 4000 | 2.00× | 0.50× |"),
            "{s}"
        );
        let mut empty = String::new();
        snat_rate_section(&mut empty, &[]);
        assert!(empty.is_empty());
    }
}
