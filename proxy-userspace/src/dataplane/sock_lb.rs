//! Attaching the cgroup socket hooks (Services for the node's own processes) to a cgroup v2
//! directory with bpf links pinned under `<pin dir>/links/cgroup_<cgroup id>_<hook>`. Like the
//! TCX links, a restarted agent adopts each pin and swaps its new program in atomically
//! (BPF_LINK_UPDATE); pins for another cgroup (the flag changed) are detached and removed.
//!
//! The programs only translate sockets of the network namespace the agent runs in (its netns
//! cookie is a load-time global), so attaching at the host's cgroup root leaves pods alone.

use std::{
    collections::BTreeSet,
    os::{fd::AsFd as _, unix::fs::MetadataExt as _},
    path::{Path, PathBuf},
};

use aya::{
    Ebpf,
    programs::{CgroupAttachMode, links::FdLink},
};

pub use super::sock_hooks::SockHook;
use super::{Error, Result, bpffs::PinLayout, link_sys, loader};

/// A pinned cgroup link: which cgroup (its id, the cgroup2 directory's inode) and which hook.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct CgroupLinkId {
    pub cgroup_id: u64,
    pub hook: SockHook,
}

impl CgroupLinkId {
    pub fn pin_name(&self) -> String {
        format!("cgroup_{}_{}", self.cgroup_id, self.hook)
    }

    pub fn from_pin_name(s: &str) -> Option<Self> {
        let rest = s.strip_prefix("cgroup_")?;
        let (id, hook) = rest.split_once('_')?;
        let hook = SockHook::ALL.into_iter().find(|h| h.as_str() == hook)?;
        Some(Self {
            cgroup_id: id.parse().ok()?,
            hook,
        })
    }
}

/// What an attach pass did.
#[derive(Debug, Default)]
pub struct SockLbReport {
    pub attached: Vec<SockHook>,
    pub adopted: Vec<SockHook>,
    /// Pins of another cgroup (or of a disabled socket LB), detached.
    pub released: usize,
}

/// Where the hooks go: a cgroup v2 directory. `auto` resolves to the root of the first cgroup2
/// mount (`/sys/fs/cgroup` on a unified host, `/sys/fs/cgroup/unified` on a hybrid one).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum SockLbCgroup {
    Off,
    Auto,
    Path(PathBuf),
}

impl std::str::FromStr for SockLbCgroup {
    type Err = String;

    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s {
            "" => Err("empty; use auto, none or a cgroup v2 directory".into()),
            "none" | "off" => Ok(SockLbCgroup::Off),
            "auto" => Ok(SockLbCgroup::Auto),
            p => Ok(SockLbCgroup::Path(PathBuf::from(p))),
        }
    }
}

impl SockLbCgroup {
    /// The directory to attach to; `Ok(None)` when switched off.
    pub fn resolve(&self) -> Result<Option<PathBuf>> {
        let path = match self {
            SockLbCgroup::Off => return Ok(None),
            SockLbCgroup::Path(p) => p.clone(),
            SockLbCgroup::Auto => {
                let mounts =
                    std::fs::read_to_string("/proc/self/mounts").map_err(|source| Error::Io {
                        what: "reading /proc/self/mounts".into(),
                        source,
                    })?;
                cgroup2_mount(&mounts).ok_or_else(|| Error::Io {
                    what: "--socket-lb-cgroup auto".into(),
                    source: std::io::Error::other(
                        "no cgroup2 mount found; mount one or pass --socket-lb-cgroup none",
                    ),
                })?
            }
        };
        Ok(Some(path))
    }
}

/// Pure: the mount point of the first cgroup2 filesystem in a `/proc/mounts` text.
pub fn cgroup2_mount(mounts: &str) -> Option<PathBuf> {
    mounts.lines().find_map(|line| {
        let mut fields = line.split_whitespace();
        let (_dev, dir, fstype) = (fields.next()?, fields.next()?, fields.next()?);
        (fstype == "cgroup2").then(|| PathBuf::from(dir.replace("\\040", " ")))
    })
}

/// Makes the pinned cgroup links equal to the hooks on `cgroup` (`None`: no hooks).
pub fn reconcile(ebpf: &mut Ebpf, pins: &PinLayout, cgroup: Option<&Path>) -> Result<SockLbReport> {
    let mut report = SockLbReport::default();
    let wanted_id = match cgroup {
        Some(dir) => Some(
            std::fs::metadata(dir)
                .map_err(|source| Error::Io {
                    what: format!("socket LB cgroup {}", dir.display()),
                    source,
                })?
                .ino(),
        ),
        None => None,
    };
    let pinned = pinned_links(pins);
    for id in &pinned {
        if Some(id.cgroup_id) != wanted_id {
            let path = pins.links_dir().join(id.pin_name());
            if let Err(e) = link_sys::detach_pinned_link(&path) {
                tracing::warn!(link = %path.display(), "explicit detach failed ({e}); removing the pin detaches it");
            }
            let _ = super::maps::remove_if_exists(&path);
            report.released += 1;
        }
    }
    let (Some(dir), Some(cgroup_id)) = (cgroup, wanted_id) else {
        return Ok(report);
    };
    for hook in SockHook::ALL {
        let id = CgroupLinkId { cgroup_id, hook };
        let path = pins.links_dir().join(id.pin_name());
        if pinned.contains(&id) {
            match adopt(ebpf, &path, hook) {
                Ok(()) => {
                    report.adopted.push(hook);
                    continue;
                }
                Err(e) => {
                    tracing::warn!(link = %path.display(), "adopting pinned cgroup link failed ({e}); attaching anew");
                    let _ = link_sys::detach_pinned_link(&path);
                    let _ = super::maps::remove_if_exists(&path);
                }
            }
        }
        attach(ebpf, dir, &path, hook)?;
        report.attached.push(hook);
    }
    Ok(report)
}

fn pinned_links(pins: &PinLayout) -> BTreeSet<CgroupLinkId> {
    let Ok(dir) = std::fs::read_dir(pins.links_dir()) else {
        return BTreeSet::new();
    };
    dir.filter_map(|e| e.ok())
        .filter_map(|e| CgroupLinkId::from_pin_name(&e.file_name().to_string_lossy()))
        .collect()
}

fn adopt(ebpf: &mut Ebpf, path: &Path, hook: SockHook) -> Result<()> {
    let io_err = |what: &str, source| Error::Io {
        what: format!("{what} {}", path.display()),
        source,
    };
    let link = link_sys::obj_get(path).map_err(|e| io_err("opening pinned link", e))?;
    let prog = loader::sock_program_mut(ebpf, hook.program())?;
    let prog_fd = prog.fd().map_err(|source| Error::Program {
        name: hook.program(),
        source,
    })?;
    link_sys::link_update(link.as_fd(), prog_fd.as_fd())
        .map_err(|e| io_err("swapping the program of", e))
}

fn attach(ebpf: &mut Ebpf, dir: &Path, path: &Path, hook: SockHook) -> Result<()> {
    let attach_err = |source| Error::Attach {
        interface: format!("cgroup {}", dir.display()),
        program: hook.program(),
        source,
    };
    let cgroup = std::fs::File::open(dir).map_err(|source| Error::Io {
        what: format!("opening cgroup {}", dir.display()),
        source,
    })?;
    let prog = loader::sock_program_mut(ebpf, hook.program())?;
    // A bpf link (aya uses BPF_LINK_CREATE on this kernel) always joins the cgroup's program list
    // like BPF_F_ALLOW_MULTI, so other programs on the cgroup keep running; the kernel refuses any
    // explicit attach flag on a link, hence `Single` (no flags).
    let link_id = prog
        .attach(&cgroup, CgroupAttachMode::Single)
        .map_err(attach_err)?;
    let link = prog.take_link(link_id).map_err(attach_err)?;
    let fd_link = FdLink::try_from(link).map_err(|source| Error::Link {
        path: path.to_path_buf(),
        source,
    })?;
    fd_link.pin(path).map_err(|source| Error::PinLink {
        path: path.to_path_buf(),
        source,
    })?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_loader_loads_every_hooks_program() {
        let programs: Vec<&str> = SockHook::ALL.iter().map(|h| h.program()).collect();
        assert_eq!(programs, loader::SOCK_PROGRAMS);
    }

    #[test]
    fn pin_names_round_trip() {
        for hook in SockHook::ALL {
            let id = CgroupLinkId {
                cgroup_id: 4242,
                hook,
            };
            assert_eq!(CgroupLinkId::from_pin_name(&id.pin_name()), Some(id));
        }
        assert_eq!(CgroupLinkId::from_pin_name("3_eth0_ingress"), None);
        assert_eq!(CgroupLinkId::from_pin_name("cgroup_x_connect4"), None);
        assert_eq!(CgroupLinkId::from_pin_name("cgroup_1_listen4"), None);
    }

    #[test]
    fn finds_the_cgroup2_mount_on_hybrid_and_unified_hosts() {
        let hybrid = "tmpfs /sys/fs/cgroup tmpfs rw 0 0\n\
                      cgroup /sys/fs/cgroup/cpu cgroup rw,cpu 0 0\n\
                      cgroup2 /sys/fs/cgroup/unified cgroup2 rw 0 0\n";
        assert_eq!(
            cgroup2_mount(hybrid),
            Some(PathBuf::from("/sys/fs/cgroup/unified"))
        );
        let unified = "cgroup2 /sys/fs/cgroup cgroup2 rw,nsdelegate 0 0\n";
        assert_eq!(
            cgroup2_mount(unified),
            Some(PathBuf::from("/sys/fs/cgroup"))
        );
        assert_eq!(cgroup2_mount("proc /proc proc rw 0 0\n"), None);
    }

    #[test]
    fn flag_values() {
        assert_eq!("none".parse(), Ok(SockLbCgroup::Off));
        assert_eq!("auto".parse(), Ok(SockLbCgroup::Auto));
        assert_eq!(
            "/run/cg".parse(),
            Ok(SockLbCgroup::Path(PathBuf::from("/run/cg")))
        );
        assert!("".parse::<SockLbCgroup>().is_err());
    }
}
