//! `cargo xtask setup | build-ebpf | prev-release | test | demo | bench | soak | fuzz | image`.
#![forbid(unsafe_code)]

mod bench;
mod build_ebpf;
mod demo;
mod fuzz;
mod image;
mod prev_release;
mod setup;
mod soak;
mod test;
mod util;

use clap::{Parser, Subcommand};

#[derive(Debug, Parser)]
#[command(name = "xtask", about = "kube-proxy-ebpf project tasks")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Install (as root) or check everything a fresh Debian 12 machine needs: LLVM 22, bpf-linker
    /// 0.13.0, nightly + rust-src, bpftool, iproute2, test tools; mount bpffs. Idempotent.
    Setup {
        /// Only check and report; install nothing.
        #[arg(long)]
        check: bool,
    },
    /// Build the agent (its build.rs builds the eBPF object) and list the object's programs and
    /// maps.
    BuildEbpf,
    /// Build (or find cached) the previous release's agent, the upgrade test's fixture: a
    /// `git archive` of a pinned earlier commit built under target/prev-release/. Prints its
    /// path and how long the build took.
    PrevRelease {
        /// The commit to build (default: the one tests/upgrade.rs starts from).
        #[arg(long)]
        commit: Option<String>,
    },
    /// Run every test tier: fmt, clippy (host and eBPF), unprivileged tests, privileged tests.
    /// Needs root.
    Test {
        /// Skip `cargo xtask setup` before the tiers.
        #[arg(long)]
        no_setup: bool,
    },
    /// Build, make a two-node topology of network namespaces with an external client, run the
    /// agent on deploy/examples on both nodes and send traffic through the Services (ClusterIPs
    /// from a pod, a NodePort from the external client). Needs root.
    Demo,
    /// Benchmarks: datapath ns/packet vs Services, control-plane times, agent RSS, end-to-end
    /// rate/latency/throughput vs kube-proxy's iptables and nftables rule sets. Needs root.
    Bench(bench::Args),
    /// The long churn soak: endpoint changes at a fixed rate across many Services through the
    /// fake API server with traffic running (0 failed requests, flat RSS, map occupancy back at
    /// its baseline). Release build; 600 s and 1,000 Services unless told. Needs root.
    Soak(soak::Args),
    /// Packet fuzz of every tc program (BPF_PROG_TEST_RUN, release build, 10^6 packets by
    /// default): prints the seed, packets/s and packets per verdict. Needs root.
    Fuzz(fuzz::Args),
    /// The agent's OCI image as an image-layout archive (no Docker, nothing pulled): the binary
    /// (release build unless --binary), its shared libraries and loader, the DaemonSet's mount
    /// points. Reproducible (fixed mtimes, SOURCE_DATE_EPOCH or 0).
    Image(image::Args),
}

fn main() -> std::process::ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Setup { check } => setup::run(check),
        Command::BuildEbpf => build_ebpf::run().map(|_| ()),
        Command::PrevRelease { commit } => prev_release::run(commit.as_deref()).map(|_| ()),
        Command::Test { no_setup } => test::run(no_setup),
        Command::Demo => demo::run(),
        Command::Bench(args) => bench::run(&args),
        Command::Soak(args) => soak::run(&args),
        Command::Fuzz(args) => fuzz::run(&args),
        Command::Image(args) => image::run(&args),
    };
    match result {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}
