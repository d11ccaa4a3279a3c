//! `cargo xtask bench [--quick|--smoke]`: builds the measuring binary (`xtask-bench`, xtask with
//! `--features bench`, release unless `--smoke`) and the agent, then runs `xtask-bench run`,
//! which writes `<target>/bench/results.{json,md}` and SVG plots and prints the tables.
//!
//! The measuring code lives beside this file (`main.rs` is the `xtask-bench` binary); keeping it
//! out of the default xtask build keeps `cargo xtask setup` free of the agent's eBPF build.

use std::{path::PathBuf, process::Command};

use anyhow::{Context as _, Result, bail};

use crate::util::{cargo, is_root, sh, step_start, target_dir, workspace_root};

#[derive(Debug, clap::Args)]
pub struct Args {
    /// Fewer sizes and shorter runs (under 5 minutes on 2 cores, plus build).
    #[arg(long, conflicts_with = "smoke")]
    quick: bool,
    /// Tiny sizes, 1 s load, debug build: only checks that the bench works (cargo xtask test).
    #[arg(long)]
    smoke: bool,
    /// Only these parts: datapath, control, e2e, snat-rate (comma-separated).
    #[arg(long)]
    only: Option<String>,
    /// Also copy results.md and the SVG plots into docs/bench/ (for BENCHMARKS.md).
    #[arg(long)]
    update_docs: bool,
    /// Skip `cargo xtask setup`.
    #[arg(long)]
    no_setup: bool,
}

pub fn run(args: &Args) -> Result<()> {
    if !is_root() {
        bail!("cargo xtask bench needs root (eBPF load, network namespaces); run it with sudo");
    }
    if !args.no_setup && !args.smoke {
        crate::setup::run(false)?;
    }
    let size = if args.smoke {
        "smoke"
    } else if args.quick {
        "quick"
    } else {
        "full"
    };
    let started = step_start("build (bench binary and agent)");
    let release = !args.smoke;
    let profile_args: &[&str] = if release { &["--release"] } else { &[] };
    sh(cargo()
        .args([
            "build",
            "-p",
            "xtask",
            "--features",
            "bench",
            "--bin",
            "xtask-bench",
        ])
        .args(profile_args))?;
    sh(cargo()
        .args(["build", "-p", "proxy-userspace", "--bin", "kube-proxy-ebpf"])
        .args(profile_args))?;
    let target = target_dir()?;
    let bin_dir = target.join(if release { "release" } else { "debug" });
    let bench_bin = bin_dir.join("xtask-bench");
    let agent_bin = bin_dir.join("kube-proxy-ebpf");
    eprintln!("built in {:.0}s", started.elapsed().as_secs_f64());

    let out_dir = target.join("bench");
    let mut shown = String::from("cargo xtask bench");
    if args.smoke {
        shown.push_str(" --smoke");
    } else if args.quick {
        shown.push_str(" --quick");
    }
    if let Some(only) = &args.only {
        shown.push_str(" --only ");
        shown.push_str(only);
    }
    let mut cmd = Command::new(&bench_bin);
    cmd.current_dir(workspace_root())
        .args(["run", "--size", size, "--agent-bin"])
        .arg(&agent_bin)
        .arg("--out-dir")
        .arg(&out_dir)
        .args(["--command-line", &shown]);
    if let Some(only) = &args.only {
        cmd.args(["--only", only]);
    }
    sh(&mut cmd)?;
    if args.update_docs {
        let docs = workspace_root().join("docs").join("bench");
        std::fs::create_dir_all(&docs)?;
        for entry in std::fs::read_dir(&out_dir)? {
            let path: PathBuf = entry?.path();
            let name = path.file_name().context("file name")?.to_owned();
            let keep = path
                .extension()
                .is_some_and(|e| e == "svg" || e == "md" || e == "json");
            if keep {
                std::fs::copy(&path, docs.join(&name))
                    .with_context(|| format!("copying {}", path.display()))?;
            }
        }
        eprintln!("copied results and plots to {}", docs.display());
    }
    Ok(())
}
