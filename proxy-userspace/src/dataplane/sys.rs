//! The libc calls no maintained crate wraps (nix has neither): `SO_NETNS_COOKIE` and glibc's
//! `malloc_trim`. With the BPF syscalls aya 0.14 lacks (`link_sys`, `batch`), the only `unsafe`
//! in the crate (`lib.rs` denies it elsewhere).
//!
//! May call: nothing in the crate (a leaf).

use std::os::fd::AsRawFd as _;

use nix::sys::socket::{AddressFamily, SockFlag, SockType, socket};

/// The network namespace cookie of the calling thread's namespace (`SO_NETNS_COOKIE`, Linux ≥
/// 5.14): what the socket hooks compare against.
pub fn own_netns_cookie() -> std::io::Result<u64> {
    let sock = socket(
        AddressFamily::Inet,
        SockType::Datagram,
        SockFlag::SOCK_CLOEXEC,
        None,
    )?;
    let mut cookie: u64 = 0;
    let mut len = size_of::<u64>() as libc::socklen_t;
    // SAFETY: `sock` is an open socket we own for the call; getsockopt writes at most `len`
    // (8) bytes into `cookie`, a live u64, and the new length into `len`.
    let rc = unsafe {
        libc::getsockopt(
            sock.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_NETNS_COOKIE,
            (&mut cookie as *mut u64).cast(),
            &mut len,
        )
    };
    if rc < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(cookie)
}

/// A full pass (and the initial lists before it) allocates and frees about the size of the whole
/// state; glibc keeps freed memory below its top chunk, so RSS would stay at that peak. Hand it
/// back to the kernel (a few ms, once per full pass).
pub fn release_free_heap() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: malloc_trim takes no pointers and only returns the allocator's free pages.
    unsafe {
        libc::malloc_trim(0);
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn this_namespace_has_a_cookie() {
        let a = super::own_netns_cookie().expect("SO_NETNS_COOKIE");
        assert_ne!(a, 0);
        assert_eq!(
            super::own_netns_cookie().unwrap(),
            a,
            "one namespace, one cookie"
        );
    }
}
