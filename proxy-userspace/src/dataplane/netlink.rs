//! Wakes the agent when interfaces appear or go (RTMGRP_LINK), so new pods get the programs within
//! milliseconds, and when IPv4 addresses change (RTMGRP_IPV4_IFADDR: NodePort addresses, SNAT
//! address). Messages are not parsed: any event triggers a rescan, which is cheap.

use std::{
    io,
    os::fd::{AsRawFd as _, FromRawFd as _},
    thread,
};

use tokio::sync::mpsc;

const RTMGRP_LINK: u32 = 1;
const RTMGRP_IPV4_IFADDR: u32 = 0x10;

/// A NETLINK_ROUTE socket of this network namespace, owned by the returned `File`.
pub fn route_socket() -> io::Result<std::fs::File> {
    // SAFETY: plain socket(2); the fd is owned by the File created right after and closed with it.
    unsafe {
        let fd = libc::socket(
            libc::AF_NETLINK,
            libc::SOCK_RAW | libc::SOCK_CLOEXEC,
            libc::NETLINK_ROUTE,
        );
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(std::fs::File::from_raw_fd(fd))
    }
}

/// Starts a thread that sends `()` on every batch of link events. The thread ends when the
/// receiver is dropped (on the next event).
pub fn watch_links() -> io::Result<mpsc::Receiver<()>> {
    let file = route_socket()?;
    let fd = file.as_raw_fd();
    // SAFETY: bind(2) on our own open socket with a zeroed sockaddr_nl of the right size.
    unsafe {
        let mut addr: libc::sockaddr_nl = std::mem::zeroed();
        addr.nl_family = libc::AF_NETLINK as u16;
        addr.nl_groups = RTMGRP_LINK | RTMGRP_IPV4_IFADDR;
        let rc = libc::bind(
            fd,
            (&addr as *const libc::sockaddr_nl).cast(),
            std::mem::size_of::<libc::sockaddr_nl>() as u32,
        );
        if rc < 0 {
            return Err(io::Error::last_os_error());
        }
    }
    let (tx, rx) = mpsc::channel(1);
    thread::Builder::new().name("netlink-links".into()).spawn(move || {
        use std::io::Read as _;
        let mut file = file;
        let mut buf = vec![0u8; 64 * 1024];
        loop {
            match file.read(&mut buf) {
                // ENOBUFS (events were lost) also means "rescan".
                Ok(_) => {}
                Err(e) if e.raw_os_error() == Some(libc::ENOBUFS) => {}
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => {
                    tracing::error!("netlink link watch stopped: {e}; new interfaces are picked up by the periodic rescan only");
                    return;
                }
            }
            // One pending rescan is enough: a full channel means one is already queued.
            match tx.try_send(()) {
                Ok(()) | Err(mpsc::error::TrySendError::Full(())) => {}
                Err(mpsc::error::TrySendError::Closed(())) => return,
            }
        }
    })?;
    Ok(rx)
}
