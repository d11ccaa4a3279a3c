//! `kube-proxy-ebpf mount-bpffs [DIR]`: the DaemonSet's privileged init step. The image has no
//! shell or `mount`, so the agent does it: DIR (the host's /sys/fs/bpf, mounted with
//! Bidirectional propagation) is left alone if it is a bpffs already, else a bpffs is mounted
//! there.

use std::path::Path;

use anyhow::{Context as _, bail};
use nix::{
    errno::Errno,
    mount::{MsFlags, mount},
};

use crate::dataplane::bpffs::is_bpffs;

/// What [`mount_bpffs`] found or did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Outcome {
    AlreadyMounted,
    Mounted,
}

pub fn mount_bpffs(dir: &Path) -> anyhow::Result<Outcome> {
    if is_bpffs(dir) {
        return Ok(Outcome::AlreadyMounted);
    }
    let meta = std::fs::metadata(dir).with_context(|| format!("{}", dir.display()))?;
    if !meta.is_dir() {
        bail!("{} is not a directory", dir.display());
    }
    match mount(
        Some("bpf"),
        dir,
        Some("bpf"),
        MsFlags::MS_NOSUID | MsFlags::MS_NODEV | MsFlags::MS_NOEXEC,
        None::<&str>,
    ) {
        Ok(()) => {}
        Err(Errno::EPERM) => bail!(
            "mounting a bpffs at {}: permission denied (needs CAP_SYS_ADMIN: the init \
             container runs privileged)",
            dir.display()
        ),
        Err(e) => return Err(e).with_context(|| format!("mounting a bpffs at {}", dir.display())),
    }
    if !is_bpffs(dir) {
        bail!(
            "mounted a bpffs at {} but statfs does not report one there",
            dir.display()
        );
    }
    Ok(Outcome::Mounted)
}
