//! `cargo xtask setup`: install or check what a fresh Debian 12 machine needs. Idempotent: each
//! step checks first and only acts when something is missing.

use std::{process::Command, time::Instant};

use anyhow::{Context as _, Result, bail};

use crate::util::{is_root, output, sh};

/// Debian packages: LLVM 22 for bpf-linker, bpftool, and the tools the privileged tests use.
pub const APT_PACKAGES: &[&str] = &[
    "llvm-22-dev",
    "libpolly-22-dev",
    "libzstd-dev",
    "zlib1g-dev",
    "bpftool",
    "iproute2",
    "curl",
    "socat",
    "iperf3",
    "ethtool",
    "python3",
    // Also what `cargo xtask image` copies into the image (proxy-image/src/rootfs.rs): the
    // netfilter tools, netbase's /etc/protocols, /etc/services, /etc/ethertypes, and objcopy.
    "nftables",
    "iptables",
    "netbase",
    "binutils",
    // tests/image.rs: the agent's image loaded and run by a real container runtime.
    "podman",
    "crun",
    "runc",
    "skopeo",
    "uidmap",
    "fuse-overlayfs",
];

/// The bpf-linker release that works with aya 0.14 and Debian's LLVM 22.
pub const BPF_LINKER_VERSION: &str = "0.13.0";
const LLVM_PREFIX: &str = "/usr/lib/llvm-22";

pub fn run(check_only: bool) -> Result<()> {
    let started = Instant::now();
    let root = is_root();
    if !root && !check_only {
        eprintln!(
            "note: not root: checking only; installing anything needs root (sudo cargo xtask setup)"
        );
    }
    let install = root && !check_only;

    apt(install)?;
    rust_toolchains(install)?;
    bpf_linker(install)?;
    bpffs(install)?;
    versions();
    eprintln!("setup: ok ({:.1}s)", started.elapsed().as_secs_f64());
    Ok(())
}

fn installed(package: &str) -> bool {
    output("dpkg-query", &["-W", "-f=${Status}", package])
        .is_some_and(|s| s == "install ok installed")
}

fn apt(install: bool) -> Result<()> {
    let missing: Vec<&str> = APT_PACKAGES
        .iter()
        .copied()
        .filter(|p| !installed(p))
        .collect();
    if missing.is_empty() {
        eprintln!("apt packages: all {} present", APT_PACKAGES.len());
        return Ok(());
    }
    let line = missing.join(" ");
    if !install {
        bail!(
            "missing Debian packages: {line}\n  install them as root: apt-get update && apt-get install -y {line}\n  (or run `sudo cargo xtask setup`)"
        );
    }
    eprintln!("apt packages missing: {line}");
    sh(Command::new("apt-get")
        .arg("update")
        .env("DEBIAN_FRONTEND", "noninteractive"))
    .context("apt-get update (needs root and network access to the Debian mirrors)")?;
    sh(Command::new("apt-get")
        .args(["install", "-y"])
        .args(&missing)
        .env("DEBIAN_FRONTEND", "noninteractive"))
    .with_context(|| format!("apt-get install -y {line}"))?;
    let still: Vec<&str> = missing.into_iter().filter(|p| !installed(p)).collect();
    if !still.is_empty() {
        bail!(
            "apt-get ran but these are still missing: {}",
            still.join(" ")
        );
    }
    Ok(())
}

fn rust_toolchains(install: bool) -> Result<()> {
    if output("rustup", &["--version"]).is_none() {
        bail!(
            "rustup not found on PATH; install it from rustup.rs, then rerun `cargo xtask setup`"
        );
    }
    let toolchains = output("rustup", &["toolchain", "list"]).unwrap_or_default();
    if !toolchains.lines().any(|l| l.starts_with("nightly")) {
        if !install {
            bail!("nightly toolchain missing: rustup toolchain install nightly --profile minimal");
        }
        sh(Command::new("rustup").args([
            "toolchain",
            "install",
            "nightly",
            "--profile",
            "minimal",
        ]))
        .context("installing the nightly toolchain")?;
    }
    let components = output(
        "rustup",
        &["component", "list", "--toolchain", "nightly", "--installed"],
    )
    .unwrap_or_default();
    // rust-src: build-std for bpfel-unknown-none; rustfmt: the repo's rustfmt.toml uses unstable
    // options; clippy: the eBPF crate's lint pass.
    for component in ["rust-src", "rustfmt", "clippy"] {
        if components.lines().any(|l| l.starts_with(component)) {
            continue;
        }
        if !install {
            bail!(
                "nightly component {component} missing: rustup component add {component} --toolchain nightly"
            );
        }
        sh(Command::new("rustup").args(["component", "add", component, "--toolchain", "nightly"]))
            .with_context(|| format!("adding {component} to nightly"))?;
    }
    let stable_components =
        output("rustup", &["component", "list", "--installed"]).unwrap_or_default();
    for component in ["rustfmt", "clippy"] {
        if stable_components.lines().any(|l| l.starts_with(component)) {
            continue;
        }
        if !install {
            bail!("component {component} missing: rustup component add {component}");
        }
        sh(Command::new("rustup").args(["component", "add", component]))
            .with_context(|| format!("adding {component}"))?;
    }
    eprintln!("rust: nightly with rust-src, rustfmt, clippy present");
    Ok(())
}

fn bpf_linker_version() -> Option<String> {
    output("bpf-linker", &["--version"])
        .and_then(|v| v.split_whitespace().nth(1).map(str::to_owned))
}

fn bpf_linker(install: bool) -> Result<()> {
    let have = bpf_linker_version();
    if have.as_deref() == Some(BPF_LINKER_VERSION) {
        eprintln!("bpf-linker {BPF_LINKER_VERSION} present");
        return Ok(());
    }
    let cmdline = format!(
        "LLVM_PREFIX={LLVM_PREFIX} cargo install bpf-linker@{BPF_LINKER_VERSION} --locked --no-default-features --features llvm-22 --force"
    );
    if !install {
        bail!(
            "bpf-linker {BPF_LINKER_VERSION} missing (found {}): {cmdline}",
            have.as_deref().unwrap_or("none")
        );
    }
    if !std::path::Path::new(LLVM_PREFIX)
        .join("bin/llvm-config")
        .exists()
    {
        bail!(
            "{LLVM_PREFIX}/bin/llvm-config missing: apt-get install -y llvm-22-dev libpolly-22-dev"
        );
    }
    eprintln!(
        "bpf-linker: found {}, building {BPF_LINKER_VERSION} against LLVM 22 (a few minutes)",
        have.as_deref().unwrap_or("none")
    );
    sh(Command::new("cargo")
        .args(["install", &format!("bpf-linker@{BPF_LINKER_VERSION}")])
        .args([
            "--locked",
            "--no-default-features",
            "--features",
            "llvm-22",
            "--force",
        ])
        .env("LLVM_PREFIX", LLVM_PREFIX))
    .with_context(|| format!("building bpf-linker: {cmdline}"))?;
    match bpf_linker_version() {
        Some(v) if v == BPF_LINKER_VERSION => Ok(()),
        other => bail!(
            "bpf-linker on PATH reports {other:?} after installing {BPF_LINKER_VERSION}; is ~/.cargo/bin first on PATH?"
        ),
    }
}

fn bpffs(install: bool) -> Result<()> {
    if proxy_testenv::is_bpffs_mounted() {
        eprintln!("bpffs mounted at {}", proxy_testenv::BPFFS_ROOT);
        return Ok(());
    }
    if !install {
        eprintln!(
            "warning: bpffs not mounted at {0}; as root: mount -t bpf bpf {0}",
            proxy_testenv::BPFFS_ROOT
        );
        return Ok(());
    }
    proxy_testenv::ensure_bpffs()?;
    eprintln!("bpffs mounted at {}", proxy_testenv::BPFFS_ROOT);
    Ok(())
}

fn versions() {
    let first_line = |program: &str, args: &[&str]| {
        output(program, args)
            .and_then(|s| s.lines().next().map(str::to_owned))
            .unwrap_or_else(|| "not found".to_owned())
    };
    eprintln!("versions:");
    eprintln!("  kernel       {}", first_line("uname", &["-r"]));
    eprintln!("  rustc        {}", first_line("rustc", &["--version"]));
    eprintln!(
        "  rustc +nightly {}",
        first_line("rustc", &["+nightly", "--version"])
    );
    eprintln!(
        "  bpf-linker   {}",
        first_line("bpf-linker", &["--version"])
    );
    eprintln!(
        "  llvm         {}",
        first_line(&format!("{LLVM_PREFIX}/bin/llvm-config"), &["--version"])
    );
    eprintln!("  bpftool      {}", first_line("bpftool", &["version"]));
    eprintln!("  iproute2     {}", first_line("ip", &["-V"]));
    eprintln!("  iperf3       {}", first_line("iperf3", &["--version"]));
    eprintln!("  curl         {}", first_line("curl", &["--version"]));
    eprintln!("  python3      {}", first_line("python3", &["--version"]));
}
