//! `cargo xtask soak [--secs N] [--services N] [--rate N] [--debug]`: the long form of the churn
//! soak (issue 13, item 4). Runs proxy-userspace's `churn_soak` test target as root, in release
//! unless `--debug`, with `KPE_SOAK_SECS` / `KPE_SOAK_SERVICES` / `KPE_SOAK_RATE` set from the
//! flags, and shows its `SOAK ...` figures (changes applied, requests and failures, agent RSS
//! min/max, map occupancy before/after). The short form runs in `cargo xtask test` with the
//! target's defaults (40 s, 200 Services, 20 changes/s).
//!
//! `cargo xtask soak --faults [--outage-secs N] [--fault-services N]`: the long form of the
//! faults suite instead (issue 13, item 5): proxy-userspace's `faults` target with
//! `KPE_FAULT_OUTAGE_SECS` (default 300: the API server gone for 5 minutes under load) and
//! `KPE_FAULT_SERVICES` (default 20,000: the first sync SIGKILLed). Its figures are the
//! `FAULT ...` lines. The short form runs in `cargo xtask test` (10 s outage, 6,000 Services).

use anyhow::{Result, bail};

use crate::util::{cargo, is_root, sh, step_start};

#[derive(Debug, clap::Args)]
pub struct Args {
    /// How long the churn runs, in seconds.
    #[arg(long, default_value_t = 600)]
    secs: u64,
    /// How many Services (three of them carry the traffic).
    #[arg(long, default_value_t = 1_000)]
    services: u64,
    /// Endpoint changes per second.
    #[arg(long, default_value_t = 20)]
    rate: u64,
    /// Run the debug build (no release build of the agent; slower agent, faster start).
    #[arg(long)]
    debug: bool,
    /// Run the faults suite (API outage, SIGKILL mid-sync, map full, pins) instead of the churn.
    #[arg(long)]
    faults: bool,
    /// With --faults: how long the API server is gone, in seconds.
    #[arg(long, default_value_t = 300)]
    outage_secs: u64,
    /// With --faults: Services of the first sync that is SIGKILLed.
    #[arg(long, default_value_t = 20_000)]
    fault_services: u64,
}

pub fn run(args: &Args) -> Result<()> {
    if !is_root() {
        bail!("cargo xtask soak needs root (eBPF load, network namespaces); run it with sudo");
    }
    proxy_testenv::ensure_bpffs()?;
    if args.faults {
        return run_faults(args);
    }
    let started = step_start(&format!(
        "churn soak: {} s, {} Services, {} changes/s",
        args.secs, args.services, args.rate
    ));
    let mut cmd = cargo();
    cmd.args(["test", "-p", "proxy-userspace", "--test", "churn_soak"]);
    if !args.debug {
        cmd.arg("--release");
    }
    cmd.args(["--", "--test-threads=1", "--nocapture"])
        .env("KPE_PRIVILEGED", "1")
        .env("KPE_SOAK_SECS", args.secs.to_string())
        .env("KPE_SOAK_SERVICES", args.services.to_string())
        .env("KPE_SOAK_RATE", args.rate.to_string());
    sh(&mut cmd)?;
    eprintln!(
        "churn soak passed in {:.0} s (figures: the SOAK lines above)",
        started.elapsed().as_secs_f64()
    );
    Ok(())
}

fn run_faults(args: &Args) -> Result<()> {
    let started = step_start(&format!(
        "faults: {} s API outage under load, SIGKILL mid first sync of {} Services, map full, pins",
        args.outage_secs, args.fault_services
    ));
    let mut cmd = cargo();
    cmd.args(["test", "-p", "proxy-userspace", "--test", "faults"]);
    if !args.debug {
        cmd.arg("--release");
    }
    cmd.args(["--", "--test-threads=1", "--nocapture"])
        .env("KPE_PRIVILEGED", "1")
        .env("KPE_FAULT_OUTAGE_SECS", args.outage_secs.to_string())
        .env("KPE_FAULT_SERVICES", args.fault_services.to_string());
    sh(&mut cmd)?;
    eprintln!(
        "faults passed in {:.0} s (figures: the FAULT lines above)",
        started.elapsed().as_secs_f64()
    );
    Ok(())
}
