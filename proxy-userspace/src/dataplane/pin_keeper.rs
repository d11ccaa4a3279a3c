//! Keeps the pins under the pin directory in place while the agent runs (issue 13, item 5).
//!
//! The maps and links are pinned so that they outlive the agent: the next agent adopts them and
//! traffic never stops. Someone removing those pins (`rm -r` of the pin directory) or unmounting
//! the bpffs under a running agent would, without this, lose both: a TCX or cgroup link whose
//! pin goes and that no process holds open is detached at once (traffic stops), and the next
//! agent starts from empty maps (every flow's conntrack entry gone).
//!
//! So the agent holds every pinned object open itself, by fd (`BPF_OBJ_GET`;
//! [`PinKeeper::hold_new`]: the maps at start, the links after each attach), which keeps the
//! programs attached and the maps alive whatever happens to the files, and checks the pins
//! periodically ([`PinKeeper::check`]):
//! - a pin missing from a directory still on a bpffs (the directory recreated if its parent is a
//!   bpffs): pinned again from the held fd (`BPF_OBJ_PIN`) — repaired, logged as a warning;
//! - the directory not on a bpffs and not creatable there (bpffs unmounted): nothing can be
//!   pinned; reported as a problem (the agent logs it once and fails `/healthz`) until a bpffs is
//!   mounted there again, when the next check pins everything back.
//!
//! The agent forgets the links it releases itself ([`PinKeeper::forget`]), so a released link is
//! never kept attached by its held fd.

use std::{
    collections::BTreeMap,
    os::fd::{AsFd as _, OwnedFd},
    path::{Path, PathBuf},
};

use super::{bpffs::PinLayout, link_sys};

/// What one check found.
#[derive(Debug, PartialEq, Eq)]
pub enum PinCheck {
    /// Every held object is pinned where it was.
    Intact,
    /// These pins (relative to the pin directory) were missing and are pinned again.
    Repaired(Vec<PathBuf>),
    /// The pins cannot be put back; why.
    Lost(String),
}

/// The pinned objects this agent holds open, by path relative to the pin directory.
pub struct PinKeeper {
    pins: PinLayout,
    held: BTreeMap<PathBuf, OwnedFd>,
}

impl PinKeeper {
    pub fn new(pins: PinLayout) -> Self {
        Self {
            pins,
            held: BTreeMap::new(),
        }
    }

    /// How many objects are held.
    pub fn held(&self) -> usize {
        self.held.len()
    }

    /// Opens and holds every pin in the pin directory not held yet, and (`links`) in its
    /// `links/`: the maps at start (the links an earlier agent pinned are not held until this
    /// one has adopted or replaced them), the links after each attach. Returns how many were
    /// added.
    pub fn hold_new(&mut self, links: bool) -> usize {
        let mut added = 0;
        let dirs = if links {
            vec![self.pins.dir.clone(), self.pins.links_dir()]
        } else {
            vec![self.pins.dir.clone()]
        };
        for dir in dirs {
            let Ok(entries) = std::fs::read_dir(&dir) else {
                continue;
            };
            for entry in entries.flatten() {
                let path = entry.path();
                if !entry.file_type().is_ok_and(|t| t.is_file()) {
                    continue;
                }
                let Some(rel) = relative(&self.pins.dir, &path) else {
                    continue;
                };
                if self.held.contains_key(&rel) {
                    continue;
                }
                match link_sys::obj_get(&path) {
                    Ok(fd) => {
                        self.held.insert(rel, fd);
                        added += 1;
                    }
                    Err(e) => {
                        tracing::debug!(pin = %path.display(), "not holding pin: {e}");
                    }
                }
            }
        }
        added
    }

    /// Stops holding the links the agent released itself (pin names under `links/`).
    pub fn forget<'a>(&mut self, link_pins: impl IntoIterator<Item = &'a str>) {
        for name in link_pins {
            self.held.remove(&Path::new("links").join(name));
        }
    }

    /// Stops holding these maps (pin names in the pin directory): the old layout's maps a
    /// migration retires, so they are never pinned again.
    pub fn forget_maps<'a>(&mut self, map_pins: impl IntoIterator<Item = &'a str>) {
        for name in map_pins {
            self.held.remove(Path::new(name));
        }
    }

    /// Stops holding the links under `links/` named `<prefix>...` whose pin is gone: right after
    /// the agent itself released some (the socket hooks of another cgroup, detached and unpinned
    /// at start), so a detached link is never pinned again.
    pub fn forget_gone(&mut self, prefix: &str) {
        let dir = self.pins.dir.clone();
        self.held.retain(|rel, _| {
            let is_link = rel
                .strip_prefix("links")
                .ok()
                .and_then(Path::to_str)
                .is_some_and(|n| n.starts_with(prefix));
            !is_link || dir.join(rel).symlink_metadata().is_ok()
        });
    }

    /// Puts back every missing pin of a held object (see the module docs).
    pub fn check(&mut self) -> PinCheck {
        let dir = &self.pins.dir;
        if !super::bpffs::is_bpffs(dir) || !super::bpffs::is_bpffs(&self.pins.links_dir()) {
            // Gone (removed, or its bpffs unmounted): recreate it if its parent is a bpffs.
            if let Err(e) = self.pins.create() {
                return PinCheck::Lost(format!(
                    "pin directory {} is not on a bpffs any more and cannot be recreated ({e}): \
                     bpffs unmounted under the agent? The datapath keeps running on the {} maps \
                     and links this agent holds open, but a restarted agent would start from \
                     empty maps; mount the bpffs there again (the agent pins everything back)",
                    dir.display(),
                    self.held.len()
                ));
            }
        }
        let mut repaired = Vec::new();
        let mut failed = Vec::new();
        for (rel, fd) in &self.held {
            let path = dir.join(rel);
            if path.symlink_metadata().is_ok() {
                continue;
            }
            match link_sys::obj_pin(fd.as_fd(), &path) {
                Ok(()) => repaired.push(rel.clone()),
                Err(e) => failed.push(format!("{}: {e}", path.display())),
            }
        }
        if !failed.is_empty() {
            return PinCheck::Lost(format!(
                "cannot pin again {} of the agent's maps and links under {}: {}",
                failed.len(),
                dir.display(),
                failed.join("; ")
            ));
        }
        if repaired.is_empty() {
            PinCheck::Intact
        } else {
            PinCheck::Repaired(repaired)
        }
    }
}

fn relative(dir: &Path, path: &Path) -> Option<PathBuf> {
    path.strip_prefix(dir).ok().map(Path::to_path_buf)
}
