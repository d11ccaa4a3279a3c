//! Wakes the agent when interfaces appear or go (RTMGRP_LINK), so new pods get the programs within
//! milliseconds, when routes change (a default route moving makes another device external) and
//! when addresses change (RTMGRP_IPV4_IFADDR, RTMGRP_IPV6_IFADDR: each
//! family's NodePort addresses and SNAT address). Messages are not parsed: any event triggers a rescan, which is cheap. The socket is
//! `netlink-sys`'s (no unsafe here).

use std::{io, thread};

use netlink_sys::{Socket, SocketAddr, protocols::NETLINK_ROUTE};
use tokio::sync::mpsc;

const RTMGRP_LINK: u32 = 1;
const RTMGRP_IPV4_IFADDR: u32 = 0x10;
const RTMGRP_IPV6_IFADDR: u32 = 0x100;
const RTMGRP_IPV4_ROUTE: u32 = 0x40;
const RTMGRP_IPV6_ROUTE: u32 = 0x400;

/// A NETLINK_ROUTE socket of this network namespace (close-on-exec), bound to a kernel-chosen
/// port and to the multicast `groups` (0: none).
pub fn route_socket(groups: u32) -> io::Result<Socket> {
    let mut socket = Socket::new(NETLINK_ROUTE)?;
    socket.bind(&SocketAddr::new(0, groups))?;
    Ok(socket)
}

/// Starts a thread that sends `()` on every batch of link events. The thread ends when the
/// receiver is dropped (on the next event).
pub fn watch_links() -> io::Result<mpsc::Receiver<()>> {
    let socket = route_socket(
        RTMGRP_LINK
            | RTMGRP_IPV4_IFADDR
            | RTMGRP_IPV6_IFADDR
            | RTMGRP_IPV4_ROUTE
            | RTMGRP_IPV6_ROUTE,
    )?;
    let (tx, rx) = mpsc::channel(1);
    thread::Builder::new().name("netlink-links".into()).spawn(move || {
        let mut buf = vec![0u8; 64 * 1024];
        loop {
            match socket.recv(&mut &mut buf[..], 0) {
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
