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
//! - a pin that holds another object than the one held (its kind and kernel id differ: a pin
//!   renamed over another, or another tool or agent pinning its own object there): that pin is
//!   removed and the held object pinned in its place. The attached programs use the held
//!   objects, so those are what a restarted agent must adopt; adopting the stranger would start
//!   it on a wrong map (or leave an interface's link unpinned, detached when this agent exits).
//!   A pin replaced again at the next check means something keeps writing there (a second agent
//!   on the same pin directory?): that is reported as a problem too, while each check still puts
//!   this agent's objects back;
//! - the directory not on a bpffs and not creatable there (bpffs unmounted): nothing can be
//!   pinned; reported as a problem (the agent logs it once and fails `/healthz`) until a bpffs is
//!   mounted there again, when the next check pins everything back.
//!
//! The keeper also holds the pin directory's lock (`super::pin_lock`): a directory recreated
//! under the agent (by the check, or by someone else) is a new inode the old lock does not
//! cover, so the check takes the lock on it again before pinning anything back; if another
//! process holds that one (an agent started on the empty directory), nothing is pinned there
//! and the check reports it.
//!
//! The agent forgets the links it releases or attaches anew itself ([`PinKeeper::forget`]), so a
//! released link is never kept attached by its held fd, and a link it pins anew at a path is
//! not taken for a stranger.

use std::{
    collections::{BTreeMap, BTreeSet},
    os::fd::{AsFd as _, OwnedFd},
    path::{Path, PathBuf},
};

use super::{
    bpffs::PinLayout,
    link_sys::{self, ObjIdentity},
    pin_lock::PinDirLock,
};

/// What one check found.
#[derive(Debug, PartialEq, Eq)]
pub enum PinCheck {
    /// Every held object is pinned where it was.
    Intact,
    /// Pins (relative to the pin directory) put back: `missing` ones pinned again, `replaced`
    /// ones (holding another object) swapped back to the held object.
    Repaired {
        missing: Vec<PathBuf>,
        replaced: Vec<Replaced>,
    },
    /// The pins cannot be put back, or keep being replaced; why.
    Lost(String),
}

/// A pin found holding another object than the one held, and put back.
#[derive(Debug, PartialEq, Eq)]
pub struct Replaced {
    pub pin: PathBuf,
    /// What the pin held.
    pub found: ObjIdentity,
    /// The held object, pinned there again.
    pub ours: ObjIdentity,
}

/// One held object: the fd that keeps it alive and who it is.
struct Held {
    fd: OwnedFd,
    identity: ObjIdentity,
}

/// The pinned objects this agent holds open, by path relative to the pin directory.
pub struct PinKeeper {
    pins: PinLayout,
    held: BTreeMap<PathBuf, Held>,
    /// The pins the last check found replaced: replaced again means a writer that keeps at it.
    replaced_last: BTreeSet<PathBuf>,
    /// The pin directory's lock, once the agent hands it over ([`PinKeeper::keep_lock`]).
    lock: Option<PinDirLock>,
}

impl PinKeeper {
    pub fn new(pins: PinLayout) -> Self {
        Self {
            pins,
            held: BTreeMap::new(),
            replaced_last: BTreeSet::new(),
            lock: None,
        }
    }

    /// Holds the pin directory's lock from now on, taking it again on a recreated directory.
    pub fn keep_lock(&mut self, lock: PinDirLock) {
        self.lock = Some(lock);
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
                match link_sys::obj_get(&path)
                    .and_then(|fd| Ok((link_sys::obj_identity(fd.as_fd())?, fd)))
                {
                    Ok((identity, fd)) => {
                        self.held.insert(rel, Held { fd, identity });
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

    /// Stops holding the links under `links/` named `<prefix>...` whose pin is gone or holds
    /// another link: right after the agent itself released or attached some (the socket hooks
    /// of another cgroup, detached and unpinned at start; a hook attached anew where adopting
    /// the pinned one failed), so a detached link is never pinned again and a new one is held by
    /// the next [`PinKeeper::hold_new`].
    pub fn forget_changed(&mut self, prefix: &str) {
        let dir = self.pins.dir.clone();
        self.held.retain(|rel, held| {
            let is_link = rel
                .strip_prefix("links")
                .ok()
                .and_then(Path::to_str)
                .is_some_and(|n| n.starts_with(prefix));
            !is_link || pinned_identity(&dir.join(rel)) == Some(held.identity)
        });
    }

    /// Puts back every missing pin of a held object (see the module docs).
    pub fn check(&mut self) -> PinCheck {
        let dir = &self.pins.dir.clone();
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
        if let Err(why) = self.relock() {
            return PinCheck::Lost(why);
        }
        let mut missing = Vec::new();
        let mut replaced = Vec::new();
        let mut failed = Vec::new();
        for (rel, held) in &self.held {
            let path = dir.join(rel);
            if path.symlink_metadata().is_ok() {
                let Some(found) = pinned_identity(&path) else {
                    continue;
                };
                if found == held.identity {
                    continue;
                }
                // Another object under our pin: ours back in its place.
                if let Err(e) = std::fs::remove_file(&path) {
                    failed.push(format!("{} (holds {found}): {e}", path.display()));
                    continue;
                }
                match link_sys::obj_pin(held.fd.as_fd(), &path) {
                    Ok(()) => replaced.push(Replaced {
                        pin: rel.clone(),
                        found,
                        ours: held.identity,
                    }),
                    Err(e) => failed.push(format!("{}: {e}", path.display())),
                }
                continue;
            }
            match link_sys::obj_pin(held.fd.as_fd(), &path) {
                Ok(()) => missing.push(rel.clone()),
                Err(e) => failed.push(format!("{}: {e}", path.display())),
            }
        }
        let again: Vec<String> = replaced
            .iter()
            .filter(|r| self.replaced_last.contains(&r.pin))
            .map(|r| format!("{} (found {}, ours {})", r.pin.display(), r.found, r.ours))
            .collect();
        self.replaced_last = replaced.iter().map(|r| r.pin.clone()).collect();
        if !failed.is_empty() {
            return PinCheck::Lost(format!(
                "cannot pin again {} of the agent's maps and links under {}: {}",
                failed.len(),
                dir.display(),
                failed.join("; ")
            ));
        }
        if !again.is_empty() {
            return PinCheck::Lost(format!(
                "{} pins under {} were replaced by other objects again since the last check: {}; \
                 something keeps pinning there (a second agent or tool on this pin directory?). \
                 Each check pins this agent's objects back, but a restarted agent adopts whatever \
                 is pinned; stop the other writer",
                again.len(),
                dir.display(),
                again.join(", ")
            ));
        }
        if missing.is_empty() && replaced.is_empty() {
            PinCheck::Intact
        } else {
            PinCheck::Repaired { missing, replaced }
        }
    }
}

impl PinKeeper {
    /// Takes the lock again if the pin directory is not the one locked (recreated since).
    fn relock(&mut self) -> Result<(), String> {
        let Some(lock) = &self.lock else {
            return Ok(());
        };
        let dir = &self.pins.dir;
        if lock.covers(dir) {
            return Ok(());
        }
        match PinDirLock::try_acquire(&self.pins) {
            Ok(Some(new)) => {
                tracing::info!(pin_dir = %dir.display(), "pin directory recreated: locked again");
                self.lock = Some(new);
                Ok(())
            }
            Ok(None) => Err(format!(
                "the pin directory {} was recreated and another process holds its lock (an agent \
                 started on it after it was removed?); this agent pins nothing there while it \
                 does. The datapath keeps running on the {} maps and links this agent holds \
                 open; stop one of the two agents",
                dir.display(),
                self.held.len()
            )),
            Err(e) => Err(format!("locking the recreated pin directory: {e}")),
        }
    }
}

/// The identity of the object pinned at `path`, if it is a BPF object this process can open.
fn pinned_identity(path: &Path) -> Option<ObjIdentity> {
    let fd = link_sys::obj_get(path)
        .map_err(|e| tracing::debug!(pin = %path.display(), "cannot open pin: {e}"))
        .ok()?;
    link_sys::obj_identity(fd.as_fd())
        .map_err(|e| tracing::debug!(pin = %path.display(), "cannot identify pin: {e}"))
        .ok()
}

fn relative(dir: &Path, path: &Path) -> Option<PathBuf> {
    path.strip_prefix(dir).ok().map(Path::to_path_buf)
}
