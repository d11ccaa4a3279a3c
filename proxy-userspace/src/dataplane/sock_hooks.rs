//! The cgroup socket hooks by what they are: the object's program for each, and where the
//! kernel runs it. A leaf: the loader, the program pins and the attaching (`super::sock_lb`)
//! all name hooks.

use std::fmt;

use proxy_common::{
    PROG_SOCK_BIND4, PROG_SOCK_BIND6, PROG_SOCK_CONNECT4, PROG_SOCK_CONNECT6,
    PROG_SOCK_GETPEERNAME4, PROG_SOCK_GETPEERNAME6, PROG_SOCK_RECVMSG4, PROG_SOCK_RECVMSG6,
    PROG_SOCK_SENDMSG4, PROG_SOCK_SENDMSG6,
};

/// One socket hook.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum SockHook {
    Connect4,
    Sendmsg4,
    Recvmsg4,
    Getpeername4,
    Connect6,
    Sendmsg6,
    Recvmsg6,
    Getpeername6,
    Bind4,
    Bind6,
}

impl SockHook {
    /// Both families' hooks: IPv6 sockets reach IPv6 Services, and IPv4 ones by v4-mapped
    /// addresses (`proxy-ebpf/src/sock6.rs`); the bind hooks watch for another proxy taking
    /// over (`proxy_common::presence`).
    pub const ALL: [SockHook; 10] = [
        SockHook::Connect4,
        SockHook::Sendmsg4,
        SockHook::Recvmsg4,
        SockHook::Getpeername4,
        SockHook::Connect6,
        SockHook::Sendmsg6,
        SockHook::Recvmsg6,
        SockHook::Getpeername6,
        SockHook::Bind4,
        SockHook::Bind6,
    ];

    pub const fn program(self) -> &'static str {
        match self {
            SockHook::Connect4 => PROG_SOCK_CONNECT4,
            SockHook::Sendmsg4 => PROG_SOCK_SENDMSG4,
            SockHook::Recvmsg4 => PROG_SOCK_RECVMSG4,
            SockHook::Getpeername4 => PROG_SOCK_GETPEERNAME4,
            SockHook::Connect6 => PROG_SOCK_CONNECT6,
            SockHook::Sendmsg6 => PROG_SOCK_SENDMSG6,
            SockHook::Recvmsg6 => PROG_SOCK_RECVMSG6,
            SockHook::Getpeername6 => PROG_SOCK_GETPEERNAME6,
            SockHook::Bind4 => PROG_SOCK_BIND4,
            SockHook::Bind6 => PROG_SOCK_BIND6,
        }
    }

    /// The hook of the program `name`, if it is one of the socket hooks.
    pub fn of_program(name: &str) -> Option<SockHook> {
        SockHook::ALL.into_iter().find(|h| h.program() == name)
    }

    /// Where the kernel runs it (a program pinned by an earlier agent is opened with it).
    pub const fn attach_type(self) -> aya::programs::CgroupSockAddrAttachType {
        use aya::programs::CgroupSockAddrAttachType as T;
        match self {
            SockHook::Connect4 => T::Connect4,
            SockHook::Sendmsg4 => T::UDPSendMsg4,
            SockHook::Recvmsg4 => T::UDPRecvMsg4,
            SockHook::Getpeername4 => T::GetPeerName4,
            SockHook::Connect6 => T::Connect6,
            SockHook::Sendmsg6 => T::UDPSendMsg6,
            SockHook::Recvmsg6 => T::UDPRecvMsg6,
            SockHook::Getpeername6 => T::GetPeerName6,
            SockHook::Bind4 => T::Bind4,
            SockHook::Bind6 => T::Bind6,
        }
    }

    pub(crate) const fn as_str(self) -> &'static str {
        match self {
            SockHook::Connect4 => "connect4",
            SockHook::Sendmsg4 => "sendmsg4",
            SockHook::Recvmsg4 => "recvmsg4",
            SockHook::Getpeername4 => "getpeername4",
            SockHook::Connect6 => "connect6",
            SockHook::Sendmsg6 => "sendmsg6",
            SockHook::Recvmsg6 => "recvmsg6",
            SockHook::Getpeername6 => "getpeername6",
            SockHook::Bind4 => "bind4",
            SockHook::Bind6 => "bind6",
        }
    }
}

impl fmt::Display for SockHook {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}
