//! The link syscalls aya 0.14 does not offer on a pinned link: BPF_OBJ_GET (open the pin),
//! BPF_OBJ_PIN (pin an fd held open again, `super::pin_keeper`), BPF_OBJ_GET_INFO_BY_FD (which
//! object a pin holds, [`obj_identity`]), BPF_LINK_DETACH (leave the hook now) and
//! BPF_LINK_UPDATE (swap the program, atomically). The attr layouts are the kernel's
//! `union bpf_attr` members `obj_get` (BPF_OBJ_PIN shares it), `info`, `link_detach` and
//! `link_update`.

use std::{
    io,
    os::fd::{AsRawFd as _, BorrowedFd, FromRawFd as _, OwnedFd},
    path::Path,
};

const BPF_OBJ_PIN: libc::c_long = 6;
const BPF_OBJ_GET: libc::c_long = 7;
const BPF_OBJ_GET_INFO_BY_FD: libc::c_long = 15;
const BPF_LINK_UPDATE: libc::c_long = 29;
const BPF_LINK_DETACH: libc::c_long = 34;

fn sys_bpf<T>(cmd: libc::c_long, attr: &T) -> io::Result<libc::c_long> {
    // SAFETY: `attr` is a valid, initialised attr struct of the command's layout, alive for the
    // call; the kernel reads at most `size_of::<T>()` bytes of it.
    let rc = unsafe { libc::syscall(libc::SYS_bpf, cmd, attr as *const T, size_of::<T>()) };
    if rc < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(rc)
    }
}

/// Opens a pinned BPF object (here: a link).
pub fn obj_get(path: &Path) -> io::Result<OwnedFd> {
    use std::os::unix::ffi::OsStrExt as _;
    #[repr(C)]
    struct ObjGet {
        pathname: u64,
        bpf_fd: u32,
        file_flags: u32,
    }
    let c_path = std::ffi::CString::new(path.as_os_str().as_bytes()).map_err(io::Error::other)?;
    let fd = sys_bpf(
        BPF_OBJ_GET,
        &ObjGet {
            pathname: c_path.as_ptr() as u64,
            bpf_fd: 0,
            file_flags: 0,
        },
    )?;
    // SAFETY: the kernel returned a new fd that we own.
    Ok(unsafe { OwnedFd::from_raw_fd(fd as i32) })
}

/// Pins the BPF object (map, link, program) behind `fd` at `path` (on a bpffs; fails with
/// EEXIST if the path is taken).
pub fn obj_pin(fd: BorrowedFd<'_>, path: &Path) -> io::Result<()> {
    use std::os::unix::ffi::OsStrExt as _;
    #[repr(C)]
    struct ObjPin {
        pathname: u64,
        bpf_fd: u32,
        file_flags: u32,
    }
    let c_path = std::ffi::CString::new(path.as_os_str().as_bytes()).map_err(io::Error::other)?;
    sys_bpf(
        BPF_OBJ_PIN,
        &ObjPin {
            pathname: c_path.as_ptr() as u64,
            bpf_fd: fd.as_raw_fd() as u32,
            file_flags: 0,
        },
    )
    .map(drop)
}

/// Which kind of BPF object an fd refers to: ids are unique only within a kind.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ObjKind {
    Map,
    Link,
    Program,
}

/// A BPF object's identity: its kind and kernel id (`bpftool map|link|prog show id N`). Two fds
/// refer to the same object exactly when their identities are equal.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ObjIdentity {
    pub kind: ObjKind,
    pub id: u32,
}

impl std::fmt::Display for ObjIdentity {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let kind = match self.kind {
            ObjKind::Map => "map",
            ObjKind::Link => "link",
            ObjKind::Program => "prog",
        };
        write!(f, "{kind} id {}", self.id)
    }
}

/// The identity of the BPF object behind `fd`. The kind comes from the fd's anon inode name
/// (`anon_inode:bpf-map`, `bpf_link` or `bpf-link`, `bpf-prog`), the id from BPF_OBJ_GET_INFO_BY_FD: the
/// `bpf_map_info`, `bpf_link_info` and `bpf_prog_info` structs all start with `type` and `id`
/// (u32 each), and the kernel fills at most `info_len` bytes.
pub fn obj_identity(fd: BorrowedFd<'_>) -> io::Result<ObjIdentity> {
    let target = std::fs::read_link(format!("/proc/self/fd/{}", fd.as_raw_fd()))?;
    let kind = match target.to_str() {
        Some("anon_inode:bpf-map") => ObjKind::Map,
        // `bpf_link` when created, `bpf-link` when opened from a pin (`bpf_link_new_fd`).
        Some("anon_inode:bpf_link" | "anon_inode:bpf-link") => ObjKind::Link,
        Some("anon_inode:bpf-prog") => ObjKind::Program,
        _ => {
            return Err(io::Error::other(format!(
                "not a BPF map, link or program ({})",
                target.display()
            )));
        }
    };
    let [_, id] = info_words(fd)?;
    Ok(ObjIdentity { kind, id })
}

/// The first `N` u32 words of the object's info (BPF_OBJ_GET_INFO_BY_FD; the kernel fills at
/// most that many bytes).
fn info_words<const N: usize>(fd: BorrowedFd<'_>) -> io::Result<[u32; N]> {
    #[repr(C)]
    struct InfoByFd {
        bpf_fd: u32,
        info_len: u32,
        info: u64,
    }
    let mut info = [0u32; N];
    sys_bpf(
        BPF_OBJ_GET_INFO_BY_FD,
        &InfoByFd {
            bpf_fd: fd.as_raw_fd() as u32,
            info_len: size_of_val(&info) as u32,
            info: info.as_mut_ptr() as u64,
        },
    )?;
    Ok(info)
}

/// The id of the program a BPF link runs (`bpf_link_info`: `type`, `id`, then `prog_id`).
pub fn link_program_id(link: BorrowedFd<'_>) -> io::Result<u32> {
    let [_, _, prog_id] = info_words(link)?;
    Ok(prog_id)
}

/// Detaches the link from its hook now (dropping the last reference would, later).
pub fn link_detach(link: BorrowedFd<'_>) -> io::Result<()> {
    let link_fd = link.as_raw_fd() as u32;
    sys_bpf(BPF_LINK_DETACH, &link_fd).map(drop)
}

/// Replaces the link's program with `prog` in one step: the hook is never without a program.
pub fn link_update(link: BorrowedFd<'_>, prog: BorrowedFd<'_>) -> io::Result<()> {
    #[repr(C)]
    struct LinkUpdate {
        link_fd: u32,
        new_prog_fd: u32,
        flags: u32,
        old_prog_fd: u32,
    }
    sys_bpf(
        BPF_LINK_UPDATE,
        &LinkUpdate {
            link_fd: link.as_raw_fd() as u32,
            new_prog_fd: prog.as_raw_fd() as u32,
            flags: 0,
            old_prog_fd: 0,
        },
    )
    .map(drop)
}

/// Opens a pinned link and detaches it.
pub fn detach_pinned_link(path: &Path) -> io::Result<()> {
    use std::os::fd::AsFd as _;
    link_detach(obj_get(path)?.as_fd())
}
