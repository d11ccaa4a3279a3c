//! A network namespace guard.

use std::{
    path::PathBuf,
    process::{Command, Output},
    time::Duration,
};

use anyhow::{Result, bail};
use nix::{
    sys::signal::{Signal, kill},
    unistd::Pid,
};

use crate::process::{Proc, run_ok, run_with_timeout};

/// Bound for the short commands run through [`NetNs::exec`].
pub const EXEC_TIMEOUT: Duration = Duration::from_secs(30);

/// A named network namespace (`ip netns add`), deleted on drop after killing whatever still
/// runs inside it (by PID; the namespace was created by this guard, so they are ours).
#[derive(Debug)]
pub struct NetNs {
    name: String,
}

impl NetNs {
    /// Creates the namespace with loopback up and IPv6 duplicate address detection off (the
    /// links are the test's own: addresses must be usable at once, not "tentative" for a
    /// second). Fails if the name exists already.
    pub fn new(name: &str) -> Result<Self> {
        if Self::path_of(name).exists() {
            bail!("network namespace {name} exists already; refusing to adopt it");
        }
        let mut cmd = Command::new("ip");
        cmd.args(["netns", "add", name]);
        run_ok(cmd, EXEC_TIMEOUT)?;
        let ns = Self {
            name: name.to_owned(),
        };
        ns.exec(&[
            "sysctl",
            "-qw",
            "net.ipv6.conf.all.accept_dad=0",
            "net.ipv6.conf.default.accept_dad=0",
        ])?;
        ns.exec(&["ip", "link", "set", "lo", "up"])?;
        Ok(ns)
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    /// `/var/run/netns/<name>`, for `nsenter --net=`.
    pub fn path(&self) -> PathBuf {
        Self::path_of(&self.name)
    }

    fn path_of(name: &str) -> PathBuf {
        PathBuf::from("/var/run/netns").join(name)
    }

    /// `ip netns exec <name> args...` (private mount namespace, fresh /sys: fine for servers
    /// and clients, not for anything that pins to the host bpffs — see [`NetNs::nsenter`]).
    pub fn command(&self, args: &[&str]) -> Command {
        let mut cmd = Command::new("ip");
        cmd.args(["netns", "exec", &self.name]).args(args);
        cmd
    }

    /// `nsenter --net=<path> args...`: enters only the network namespace, so the process sees
    /// the host's /sys/fs/bpf (needed by the agent, whose pins must outlive it).
    pub fn nsenter(&self, args: &[&str]) -> Command {
        let mut cmd = Command::new("nsenter");
        cmd.arg(format!("--net={}", self.path().display()))
            .args(args);
        cmd
    }

    /// Runs a short command in the namespace; fails unless it exits 0. Returns stdout.
    pub fn exec(&self, args: &[&str]) -> Result<String> {
        run_ok(self.command(args), EXEC_TIMEOUT)
    }

    /// Runs a command in the namespace with a timeout; any exit status is returned.
    pub fn output(&self, args: &[&str], timeout: Duration) -> Result<Output> {
        run_with_timeout(self.command(args), timeout)
    }

    /// Starts a long-running command in the namespace, logging to `log` when given.
    pub fn spawn(&self, args: &[&str], log: Option<&std::path::Path>) -> Result<Proc> {
        Proc::spawn(self.command(args), log)
    }

    /// Sets a sysctl inside the namespace (`sysctl -qw key=value`).
    pub fn sysctl(&self, key: &str, value: &str) -> Result<()> {
        self.exec(&["sysctl", "-qw", &format!("{key}={value}")])?;
        Ok(())
    }

    /// PIDs of processes whose network namespace is this one.
    pub fn pids(&self) -> Vec<i32> {
        let mut cmd = Command::new("ip");
        cmd.args(["netns", "pids", &self.name]);
        run_ok(cmd, EXEC_TIMEOUT)
            .map(|out| {
                out.split_whitespace()
                    .filter_map(|p| p.parse().ok())
                    .collect()
            })
            .unwrap_or_default()
    }
}

impl Drop for NetNs {
    fn drop(&mut self) {
        for pid in self.pids() {
            if pid > 1 && pid != std::process::id() as i32 {
                let _ = kill(Pid::from_raw(pid), Signal::SIGKILL);
            }
        }
        let mut cmd = Command::new("ip");
        cmd.args(["netns", "delete", &self.name]);
        if let Err(e) = run_ok(cmd, EXEC_TIMEOUT) {
            eprintln!(
                "warning: could not delete network namespace {}: {e:#}",
                self.name
            );
        }
    }
}
