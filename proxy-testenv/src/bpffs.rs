//! bpffs: mount check and a pin directory guard.

use std::{
    path::{Path, PathBuf},
    process::Command,
    time::Duration,
};

use anyhow::{Context as _, Result, bail};

use crate::process::run_ok;

/// Where bpffs is mounted on the host.
pub const BPFFS_ROOT: &str = "/sys/fs/bpf";

/// True when `/sys/fs/bpf` is a bpffs mount.
pub fn is_bpffs_mounted() -> bool {
    use nix::sys::statfs::{BPF_FS_MAGIC, statfs};
    statfs(BPFFS_ROOT).is_ok_and(|st| st.filesystem_type() == BPF_FS_MAGIC)
}

/// Mounts bpffs at `/sys/fs/bpf` unless it is mounted already (needs root).
pub fn ensure_bpffs() -> Result<()> {
    if is_bpffs_mounted() {
        return Ok(());
    }
    std::fs::create_dir_all(BPFFS_ROOT).with_context(|| format!("creating {BPFFS_ROOT}"))?;
    let mut cmd = Command::new("mount");
    cmd.args(["-t", "bpf", "bpf", BPFFS_ROOT]);
    run_ok(cmd, Duration::from_secs(10)).context("mounting bpffs (needs root)")?;
    if !is_bpffs_mounted() {
        bail!("mounted bpffs at {BPFFS_ROOT} but statfs does not report it");
    }
    Ok(())
}

/// A directory on the host bpffs (`/sys/fs/bpf/<name>`), not created here (the agent creates
/// it), removed recursively on drop — unpinning maps and links the agent left.
#[derive(Debug)]
pub struct PinDir {
    path: PathBuf,
}

impl PinDir {
    /// A pin dir named `<name>` under bpffs. Fails if bpffs is not mounted or the path exists.
    pub fn new(name: &str) -> Result<Self> {
        if !is_bpffs_mounted() {
            bail!("bpffs is not mounted at {BPFFS_ROOT}; run `mount -t bpf bpf {BPFFS_ROOT}`");
        }
        let path = Path::new(BPFFS_ROOT).join(name);
        if path.exists() {
            bail!("{} exists already; refusing to adopt it", path.display());
        }
        Ok(Self { path })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Whether the directory exists now.
    pub fn exists(&self) -> bool {
        self.path.exists()
    }
}

impl Drop for PinDir {
    fn drop(&mut self) {
        if self.path.exists()
            && let Err(e) = std::fs::remove_dir_all(&self.path)
        {
            eprintln!(
                "warning: could not remove pin dir {}: {e}",
                self.path.display()
            );
        }
    }
}
