//! The previous release's agent as a test fixture: the `kube-proxy-ebpf` binary (with the eBPF
//! object its own build.rs embedded) of a pinned earlier commit, built from a `git archive` of
//! that commit under `<target>/prev-release/<commit>/src` with the same toolchain (the `cargo`
//! that runs this), in a target directory of its own (`<target>/prev-release/target`, shared by
//! every fixture commit, so a rebuild only compiles what changed), and cached by commit: the
//! binary is copied to `<target>/prev-release/<commit>/kube-proxy-ebpf` once the build succeeds,
//! and a second call returns it without running cargo.
//!
//! The workspace's own target directory is not used: the fixture's uplifted binary would land
//! on `target/debug/kube-proxy-ebpf`, the binary the tests run as the new agent.
//!
//! A clone without the commit (shallow) fails with a message saying so: the upgrade test never
//! skips silently. CI clones with full history (`git clone .`).

use std::{
    path::{Path, PathBuf},
    process::{Command, Stdio},
    time::{Duration, Instant},
};

use anyhow::{Context as _, Result, bail};

/// The previous release the upgrade test starts from: issue 11 resolved (main of 2026-12-02
/// 05:24). Its pinned maps are today's (`_V1` names, same shapes: only the unpinned `LOG6`
/// scratch map was added since), and it writes no layout marker (`LAYOUT`), which this release
/// reads as layout 1.
pub const PREVIOUS_RELEASE: &str = "d08603cbb5884f6a78319e030295750812ba8f10";

/// A built (or cached) previous release.
#[derive(Clone, Debug)]
pub struct PrevRelease {
    pub commit: String,
    /// Its `kube-proxy-ebpf` binary.
    pub bin: PathBuf,
    /// How long the build took; `None` when the cached binary was used.
    pub built_in: Option<Duration>,
}

/// The workspace's target directory: `CARGO_TARGET_DIR` if set, else `<workspace>/target`.
pub fn target_dir(workspace: &Path) -> PathBuf {
    match std::env::var_os("CARGO_TARGET_DIR") {
        Some(dir) if !dir.is_empty() => {
            let dir = PathBuf::from(dir);
            if dir.is_absolute() {
                dir
            } else {
                workspace.join(dir)
            }
        }
        _ => workspace.join("target"),
    }
}

/// The workspace root, from a crate directory inside it (`env!("CARGO_MANIFEST_DIR")`).
pub fn workspace_of(manifest_dir: &Path) -> PathBuf {
    manifest_dir
        .parent()
        .map_or_else(|| manifest_dir.to_path_buf(), Path::to_path_buf)
}

/// The agent of [`PREVIOUS_RELEASE`] (see [`agent_of`]).
pub fn previous_release(workspace: &Path) -> Result<PrevRelease> {
    agent_of(workspace, PREVIOUS_RELEASE)
}

/// The agent binary of `commit` of the repository at `workspace`: the cached one, else built
/// (see the module doc). Fails with what to do if the commit is not in the clone or the build
/// fails.
pub fn agent_of(workspace: &Path, commit: &str) -> Result<PrevRelease> {
    let root = target_dir(workspace).join("prev-release");
    let dir = root.join(commit);
    let bin = dir.join("kube-proxy-ebpf");
    if bin.is_file() {
        return Ok(PrevRelease {
            commit: commit.to_owned(),
            bin,
            built_in: None,
        });
    }
    let known = Command::new("git")
        .arg("-C")
        .arg(workspace)
        .args(["cat-file", "-e", &format!("{commit}^{{commit}}")])
        .stderr(Stdio::null())
        .status()
        .context("running git cat-file (is git installed?)")?;
    if !known.success() {
        bail!(
            "commit {commit} (the previous release the upgrade test starts from) is not in the \
             repository at {}: a shallow clone? Fetch the full history (`git fetch --unshallow`; \
             CI clones with `git clone .`)",
            workspace.display()
        );
    }
    let started = Instant::now();
    let src = dir.join("src");
    if src.exists() {
        std::fs::remove_dir_all(&src).with_context(|| format!("removing {}", src.display()))?;
    }
    std::fs::create_dir_all(&src).with_context(|| format!("creating {}", src.display()))?;
    let tar = dir.join("src.tar");
    run(Command::new("git")
        .arg("-C")
        .arg(workspace)
        .args(["archive", "--format=tar", "-o"])
        .arg(&tar)
        .arg(commit))?;
    run(Command::new("tar").arg("-xf").arg(&tar).arg("-C").arg(&src))?;
    std::fs::remove_file(&tar).with_context(|| format!("removing {}", tar.display()))?;

    let fixture_target = root.join("target");
    // The cargo running us (same toolchain), else the rustup proxy from PATH.
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let mut build = Command::new(cargo);
    build
        .current_dir(&src)
        .args([
            "build",
            "--locked",
            "-p",
            "proxy-userspace",
            "--bin",
            "kube-proxy-ebpf",
        ])
        .env("CARGO_TARGET_DIR", &fixture_target)
        // Set by an outer `cargo test` / build script for its own crate, not for this build.
        .env_remove("CARGO_MANIFEST_DIR")
        .env_remove("CARGO_PRIMARY_PACKAGE")
        .env_remove("AYA_BUILD_SKIP");
    run(&mut build).with_context(|| format!("building the agent of commit {commit}"))?;
    let built = fixture_target.join("debug/kube-proxy-ebpf");
    let partial = dir.join("kube-proxy-ebpf.partial");
    std::fs::copy(&built, &partial)
        .with_context(|| format!("copying {} to {}", built.display(), partial.display()))?;
    std::fs::rename(&partial, &bin).with_context(|| format!("renaming to {}", bin.display()))?;
    Ok(PrevRelease {
        commit: commit.to_owned(),
        bin,
        built_in: Some(started.elapsed()),
    })
}

fn run(cmd: &mut Command) -> Result<()> {
    let shown = format!("{cmd:?}");
    eprintln!("+ {shown}");
    let status = cmd.status().with_context(|| format!("running {shown}"))?;
    if !status.success() {
        bail!("{shown} failed ({status})");
    }
    Ok(())
}
