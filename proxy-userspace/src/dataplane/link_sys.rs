//! The link syscalls aya 0.14 does not offer on a pinned link: BPF_OBJ_GET (open the pin),
//! BPF_OBJ_PIN (pin an fd held open again, `super::pin_keeper`), BPF_LINK_DETACH (leave the hook
//! now) and BPF_LINK_UPDATE (swap the program, atomically). The attr layouts are the kernel's
//! `union bpf_attr` members `obj_get` (BPF_OBJ_PIN shares it), `link_detach` and `link_update`.

use std::{
    io,
    os::fd::{AsRawFd as _, BorrowedFd, FromRawFd as _, OwnedFd},
    path::Path,
};

const BPF_OBJ_PIN: libc::c_long = 6;
const BPF_OBJ_GET: libc::c_long = 7;
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
