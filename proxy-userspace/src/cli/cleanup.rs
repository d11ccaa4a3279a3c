//! `kube-proxy-ebpf cleanup` / `run --cleanup`: remove every link and map this agent pinned.
//! With the pins gone and no agent holding fds, the kernel detaches the programs and frees the maps.

use tracing::info;

use crate::dataplane::{attach, bpffs::PinLayout, maps, pin_lock::PinDirLock};

pub fn cleanup(pins: &PinLayout) -> anyhow::Result<()> {
    if !pins.dir.exists() {
        info!(pin_dir = %pins.dir.display(), "nothing to clean up");
        return Ok(());
    }
    // The running agent's lock (`dataplane::pin_lock`): cleaning up under it would detach its
    // programs while it keeps pinning them back.
    let Some(_lock) = PinDirLock::try_acquire(pins)? else {
        anyhow::bail!(
            "an agent is running on the pin directory {} (it holds the directory's lock): stop \
             it first, then clean up",
            pins.dir.display()
        );
    };
    remove_datapath(pins)
}

/// Detaches every pinned link (tc and cgroup) and unpins every map, then removes the pin
/// directory. The caller holds the directory's lock (`cleanup`, or an agent uninstalling itself).
pub fn remove_datapath(pins: &PinLayout) -> anyhow::Result<()> {
    let links = attach::release_all(pins)?;
    maps::unpin_all(pins)?;
    crate::dataplane::program_pins::remove_all(pins)?;
    for dir in [pins.links_dir(), pins.dir.clone()] {
        match std::fs::remove_dir(&dir) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
                anyhow::bail!(
                    "removing {}: {e} (something else is pinned there?)",
                    dir.display()
                )
            }
            _ => {}
        }
    }
    info!(pin_dir = %pins.dir.display(), links, "cleaned up: programs detached, maps unpinned");
    Ok(())
}
