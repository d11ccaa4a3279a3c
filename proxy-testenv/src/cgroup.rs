//! A private cgroup v2 directory for the agent's socket hooks, and clients run inside it.
//!
//! The agent's cgroup socket hooks act on every process of the cgroup they are attached to, so a
//! test never attaches them to a cgroup it did not create: each [`crate::Agent`] gets its own
//! child of the cgroup2 mount, holding only the test's own clients (the hooks also check the
//! socket's network namespace, so even those are translated only inside the test's node).

use std::{
    ffi::CString,
    os::unix::{ffi::OsStrExt as _, process::CommandExt as _},
    path::{Path, PathBuf},
    process::{Command, Output},
    thread,
    time::{Duration, Instant},
};

use anyhow::{Context as _, Result, bail};
use nix::{
    errno::Errno,
    fcntl::{OFlag, open},
    sys::{
        signal::{Signal, kill},
        stat::Mode,
    },
    unistd::{Pid, write},
};

use crate::{
    netns::NetNs,
    process::{describe, run_with_timeout},
    topology::Exec,
};

/// `<cgroup2 mount>/<name>`, removed on drop after killing what still runs in it (by PID: the
/// directory was created by this guard, so its processes are ours).
#[derive(Debug)]
pub struct Cgroup {
    path: PathBuf,
}

impl Cgroup {
    /// Creates `<cgroup2 mount>/<name>`. Fails if no cgroup2 is mounted or the name exists.
    pub fn new(name: &str) -> Result<Self> {
        let mounts = std::fs::read_to_string("/proc/self/mounts")?;
        let root = mounts
            .lines()
            .find_map(|l| {
                let f: Vec<&str> = l.split_whitespace().collect();
                (f.len() > 2 && f[2] == "cgroup2").then(|| PathBuf::from(f[1]))
            })
            .context("no cgroup2 mount (needed for the socket hooks)")?;
        let path = root.join(name);
        std::fs::create_dir(&path)
            .with_context(|| format!("creating cgroup {}", path.display()))?;
        Ok(Self { path })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// `args` run in `ns` (`ip netns exec`), as a member of this cgroup from before exec.
    pub fn command(&self, ns: &NetNs, args: &[&str]) -> Command {
        let mut cmd = ns.command(args);
        let procs = CString::new(self.path.join("cgroup.procs").as_os_str().as_bytes())
            .expect("cgroup path without NUL");
        // SAFETY: between fork and exec the closure only calls open/write/close (async-signal-
        // safe; nix's wrappers do not allocate for a `CStr` path) on a path prepared before the
        // fork; "0" moves the writing process itself.
        unsafe {
            cmd.pre_exec(move || {
                let fd = open(
                    procs.as_c_str(),
                    OFlag::O_WRONLY | OFlag::O_CLOEXEC,
                    Mode::empty(),
                )?;
                match write(&fd, b"0")? {
                    1 => Ok(()),
                    _ => Err(std::io::Error::from(Errno::EIO)),
                }
            });
        }
        cmd
    }

    /// The processes of `ns` that are members of this cgroup, as an [`Exec`] target.
    pub fn in_ns<'a>(&'a self, ns: &'a NetNs) -> InCgroup<'a> {
        InCgroup { cgroup: self, ns }
    }

    fn pids(&self) -> Vec<i32> {
        std::fs::read_to_string(self.path.join("cgroup.procs"))
            .map(|s| s.lines().filter_map(|l| l.trim().parse().ok()).collect())
            .unwrap_or_default()
    }
}

impl Drop for Cgroup {
    fn drop(&mut self) {
        let deadline = Instant::now() + Duration::from_secs(2);
        loop {
            for pid in self.pids() {
                if pid > 1 && pid != std::process::id() as i32 {
                    let _ = kill(Pid::from_raw(pid), Signal::SIGKILL);
                }
            }
            match std::fs::remove_dir(&self.path) {
                Ok(()) => return,
                Err(e) if Instant::now() >= deadline => {
                    eprintln!(
                        "warning: could not remove cgroup {}: {e}",
                        self.path.display()
                    );
                    return;
                }
                Err(_) => thread::sleep(Duration::from_millis(20)),
            }
        }
    }
}

/// Commands in a namespace and a cgroup: the node's own processes, as the socket hooks see them.
#[derive(Clone, Copy, Debug)]
pub struct InCgroup<'a> {
    cgroup: &'a Cgroup,
    ns: &'a NetNs,
}

impl Exec for InCgroup<'_> {
    fn output(&self, args: &[&str], timeout: Duration) -> Result<Output> {
        run_with_timeout(self.cgroup.command(self.ns, args), timeout)
    }
}

/// What a client in the node's own namespace saw of one HTTP exchange.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SocketView {
    /// `getpeername()` after connect: the Service (address:port) when the hooks translated.
    pub peer: String,
    /// The body (the backend's name).
    pub body: String,
    /// The backend's `X-Client-Addr`: the source it saw.
    pub client_addr: String,
}

const HTTP_PEER_PY: &str = r#"
import socket, sys
s = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=3)
p = s.getpeername()
peer = ("[%s]:%d" if ":" in p[0] else "%s:%d") % p[:2]
s.sendall(b"GET / HTTP/1.0\r\nHost: x\r\n\r\n")
data = b""
while True:
    c = s.recv(65536)
    if not c:
        break
    data += c
head, _, body = data.partition(b"\r\n\r\n")
client = ""
for line in head.decode(errors="replace").split("\r\n"):
    if line.lower().startswith("x-client-addr:"):
        client = line.split(":", 1)[1].strip()
print(peer)
print(client)
print(body.decode(errors="replace").strip())
"#;

/// One HTTP GET over a socket, with what `getpeername()` said about it.
pub fn http_get_with_peer(
    exec: &impl Exec,
    ip: std::net::Ipv4Addr,
    port: u16,
) -> Result<SocketView> {
    http_get_with_peer_any(exec, ip.into(), port)
}

/// [`http_get_with_peer`] over IPv6 (an AF_INET6 socket: the connect6 hook); `peer` reads
/// `"[addr]:port"`.
pub fn http6_get_with_peer(
    exec: &impl Exec,
    ip: std::net::Ipv6Addr,
    port: u16,
) -> Result<SocketView> {
    http_get_with_peer_any(exec, ip.into(), port)
}

fn http_get_with_peer_any(exec: &impl Exec, ip: std::net::IpAddr, port: u16) -> Result<SocketView> {
    let out = exec.output(
        &[
            "python3",
            "-c",
            HTTP_PEER_PY,
            &ip.to_string(),
            &port.to_string(),
        ],
        Duration::from_secs(10),
    )?;
    if !out.status.success() {
        bail!(
            "HTTP GET {} failed ({}): {}",
            std::net::SocketAddr::new(ip, port),
            describe(out.status),
            String::from_utf8_lossy(&out.stderr)
                .lines()
                .last()
                .unwrap_or_default()
        );
    }
    let stdout = String::from_utf8_lossy(&out.stdout);
    let mut lines = stdout.lines();
    let mut next = || lines.next().unwrap_or_default().to_owned();
    Ok(SocketView {
        peer: next(),
        client_addr: next(),
        body: next(),
    })
}
