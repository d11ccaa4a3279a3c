//! The agent under test, run standalone in the node namespace.

use std::{
    path::{Path, PathBuf},
    process::{ExitStatus, Output},
    thread,
    time::{Duration, Instant},
};

use anyhow::{Context as _, Result, bail};
use serde::Deserialize;

use crate::{
    cgroup::Cgroup,
    netns::NetNs,
    process::{Proc, describe, run_with_timeout, tail},
};

/// The `--status-file` JSON the agent rewrites after every successful sync.
#[derive(Clone, Debug, Default, Deserialize, PartialEq, Eq)]
#[serde(default)]
pub struct AgentStatus {
    pub syncs: u64,
    pub frontends: u64,
    pub backends: u64,
    pub interfaces: Vec<String>,
    pub problems: u64,
}

/// `kube-proxy-ebpf run` started with `nsenter --net=<node>` (network namespace only, so its
/// pins land on the host bpffs and survive restarts). Drop kills it.
#[derive(Debug)]
pub struct Agent {
    proc: Option<Proc>,
    bin: PathBuf,
    node_ns: PathBuf,
    /// `--manifests DIR` or `--kubeconfig FILE`, plus any extra flags.
    source_args: Vec<std::ffi::OsString>,
    pin_dir: PathBuf,
    status_file: PathBuf,
    log: PathBuf,
    /// `--pod-interfaces` (`None`: the agent's default, detection).
    pod_interfaces: Option<String>,
    /// The agent's own cgroup for its socket hooks (`--socket-lb-cgroup`): clients run in it
    /// ([`Agent::host`]) reach Services from the node's namespace. Dropped after the process.
    cgroup: Cgroup,
    /// Environment variables given to the agent (the kubelet's, say).
    env: Vec<(String, String)>,
}

impl Agent {
    /// Starts the agent for `manifests`, pinning under `pin_dir`, watching `veth-*`. Its status
    /// file and log go to `work_dir` (`agent-status.json`, `agent.log`, appended across runs).
    pub fn start(
        bin: &Path,
        node: &NetNs,
        manifests: &Path,
        pin_dir: &Path,
        work_dir: &Path,
    ) -> Result<Self> {
        let args = ["--manifests".as_ref(), manifests.as_os_str()];
        Self::start_with(bin, node, &args, pin_dir, work_dir)
    }

    /// Starts the agent on the Kubernetes API described by `kubeconfig` (e.g. a
    /// [`crate::FakeApiServer`] listening in the node namespace), with `extra` flags.
    pub fn start_kube(
        bin: &Path,
        node: &NetNs,
        kubeconfig: &Path,
        extra: &[&str],
        pin_dir: &Path,
        work_dir: &Path,
    ) -> Result<Self> {
        let mut args = vec!["--kubeconfig".as_ref(), kubeconfig.as_os_str()];
        args.extend(extra.iter().map(|a| std::ffi::OsStr::new(*a)));
        Self::start_with(bin, node, &args, pin_dir, work_dir)
    }

    /// Starts the agent with the given source flags (`--manifests DIR`, `--kubeconfig FILE`,
    /// `--master URL`, ...).
    pub fn start_with(
        bin: &Path,
        node: &NetNs,
        source_args: &[&std::ffi::OsStr],
        pin_dir: &Path,
        work_dir: &Path,
    ) -> Result<Self> {
        Self::start_with_env(bin, node, source_args, &[], pin_dir, work_dir)
    }

    /// [`Agent::start_with`] with environment variables (what a pod's container gets).
    pub fn start_with_env(
        bin: &Path,
        node: &NetNs,
        source_args: &[&std::ffi::OsStr],
        env: &[(&str, &str)],
        pin_dir: &Path,
        work_dir: &Path,
    ) -> Result<Self> {
        let mut agent = Self::unstarted(bin, node, source_args, env, pin_dir, work_dir)?;
        agent.restart()?;
        Ok(agent)
    }

    fn unstarted(
        bin: &Path,
        node: &NetNs,
        source_args: &[&std::ffi::OsStr],
        env: &[(&str, &str)],
        pin_dir: &Path,
        work_dir: &Path,
    ) -> Result<Self> {
        let cgroup_name = format!(
            "kpe-test-{}",
            pin_dir
                .file_name()
                .map(|n| n.to_string_lossy().into_owned())
                .unwrap_or_else(crate::unique_prefix)
        );
        let agent = Self {
            cgroup: Cgroup::new(&cgroup_name)?,
            proc: None,
            bin: bin.to_path_buf(),
            node_ns: node.path(),
            source_args: source_args.iter().map(|a| a.to_os_string()).collect(),
            pin_dir: pin_dir.to_path_buf(),
            status_file: work_dir.join("agent-status.json"),
            log: work_dir.join("agent.log"),
            pod_interfaces: Some("veth-*".to_owned()),
            env: env
                .iter()
                .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
                .collect(),
        };
        Ok(agent)
    }

    /// [`Agent::start_with`] leaving the interfaces to the agent's detection (no
    /// `--pod-interfaces veth-*`): what a DaemonSet with default flags does.
    pub fn start_detecting(
        bin: &Path,
        node: &NetNs,
        source_args: &[&std::ffi::OsStr],
        pin_dir: &Path,
        work_dir: &Path,
    ) -> Result<Self> {
        let mut agent = Self::unstarted(bin, node, source_args, &[], pin_dir, work_dir)?;
        agent.pod_interfaces = None;
        agent.restart()?;
        Ok(agent)
    }

    /// Starts a second agent like this one, on the same pins and node, with its own cgroup, log
    /// and status file under `work_dir`: two agents on one node (the second must wait for the
    /// first's pin directory lock).
    pub fn start_second(&self, work_dir: &Path) -> Result<Self> {
        let mut agent = Self {
            cgroup: Cgroup::new(&format!("kpe-test-{}", crate::unique_prefix()))?,
            proc: None,
            bin: self.bin.clone(),
            node_ns: self.node_ns.clone(),
            source_args: self.source_args.clone(),
            pin_dir: self.pin_dir.clone(),
            status_file: work_dir.join("agent-status.json"),
            log: work_dir.join("agent.log"),
            pod_interfaces: self.pod_interfaces.clone(),
            env: self.env.clone(),
        };
        agent.restart()?;
        Ok(agent)
    }

    /// Starts the agent again with other source flags (e.g. a flag added or dropped), on the same
    /// pins, cgroup and log: what an upgrade with a changed DaemonSet does.
    pub fn restart_with(&mut self, source_args: &[&std::ffi::OsStr]) -> Result<()> {
        self.source_args = source_args.iter().map(|a| a.to_os_string()).collect();
        self.restart()
    }

    /// Starts `bin` instead of the current binary, with the same flags, pins, cgroup and log:
    /// what a DaemonSet rolling to another image does (the old agent stopped first, by
    /// [`Agent::stop`]).
    pub fn restart_as(&mut self, bin: &Path) -> Result<()> {
        self.bin = bin.to_path_buf();
        self.restart()
    }

    /// The binary this agent runs (and [`Agent::cli`] uses).
    pub fn bin(&self) -> &Path {
        &self.bin
    }

    /// Starts the agent again (after [`Agent::stop`] or [`Agent::kill`]) with the same flags.
    /// The old status file is removed first so `wait_synced` sees this run's syncs only.
    pub fn restart(&mut self) -> Result<()> {
        if let Some(mut old) = self.proc.take() {
            old.kill()?;
        }
        let _ = std::fs::remove_file(&self.status_file);
        let mut cmd = std::process::Command::new("nsenter");
        cmd.arg(format!("--net={}", self.node_ns.display()))
            .arg(&self.bin)
            .arg("run")
            .args(&self.source_args)
            .arg("--pin-dir")
            .arg(&self.pin_dir)
            .args(
                self.pod_interfaces
                    .iter()
                    .flat_map(|p| ["--pod-interfaces", p.as_str()]),
            )
            .arg("--status-file")
            .arg(&self.status_file)
            .arg("--socket-lb-cgroup")
            .arg(self.cgroup.path());
        if std::env::var_os("RUST_LOG").is_none() {
            cmd.env("RUST_LOG", "info");
        }
        cmd.envs(self.env.iter().map(|(k, v)| (k, v)));
        {
            use std::io::Write as _;
            let mut log = std::fs::File::options()
                .create(true)
                .append(true)
                .open(&self.log)?;
            writeln!(log, "--- starting {cmd:?}")?;
        }
        self.proc = Some(Proc::spawn(cmd, Some(&self.log))?);
        Ok(())
    }

    /// The node's own processes as the socket hooks see them: commands in the node namespace and
    /// the agent's cgroup.
    pub fn host<'a>(&'a self, node: &'a NetNs) -> crate::InCgroup<'a> {
        self.cgroup.in_ns(node)
    }

    /// The agent's cgroup (its socket hooks are attached there).
    pub fn cgroup_path(&self) -> &Path {
        self.cgroup.path()
    }

    /// `args` as a process of the node (in `node` and the agent's cgroup), to spawn: a
    /// hostNetwork program that the socket hooks see (another Service proxy, say).
    pub fn host_command(&self, node: &NetNs, args: &[&str]) -> std::process::Command {
        self.cgroup.command(node, args)
    }

    /// The current status file, `None` before the first sync of this run.
    pub fn status(&self) -> Result<Option<AgentStatus>> {
        match std::fs::read_to_string(&self.status_file) {
            Ok(text) => Ok(Some(serde_json::from_str(&text).with_context(|| {
                format!("parsing {}: {text:?}", self.status_file.display())
            })?)),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(e).with_context(|| format!("reading {}", self.status_file.display())),
        }
    }

    /// Polls the status file until `syncs >= min_syncs`; fails early if the agent exits and
    /// with the log tail on timeout.
    pub fn wait_synced(&mut self, min_syncs: u64, timeout: Duration) -> Result<AgentStatus> {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(status) = self.status()?
                && status.syncs >= min_syncs
            {
                return Ok(status);
            }
            let proc = self.proc.as_mut().context("agent is not running")?;
            if let Some(exit) = proc.try_wait()? {
                bail!(
                    "agent exited ({}) before syncing; log:\n{}",
                    describe(exit),
                    self.log_tail()
                );
            }
            if Instant::now() >= deadline {
                bail!(
                    "agent did not reach {min_syncs} syncs within {timeout:?} (status {:?}); log:\n{}",
                    self.status().ok().flatten(),
                    self.log_tail()
                );
            }
            thread::sleep(Duration::from_millis(20));
        }
    }

    /// Waits for the first sync (30 s), then until `interfaces` all carry the programs (10 s;
    /// the agent attaches after its first sync). Either failure names what was missing.
    pub fn wait_attached(&mut self, interfaces: &[String]) -> Result<AgentStatus> {
        self.wait_attached_within(interfaces, Duration::from_secs(30))
    }

    /// [`Agent::wait_attached`] with another bound on the first sync (a test starting several
    /// agents at once on a loaded machine: a bound, not a measurement).
    pub fn wait_attached_within(
        &mut self,
        interfaces: &[String],
        first_sync: Duration,
    ) -> Result<AgentStatus> {
        self.wait_synced(1, first_sync)?;
        self.wait_status(Duration::from_secs(10), |s| {
            interfaces.iter().all(|w| s.interfaces.contains(w))
        })
        .with_context(|| format!("agent did not attach to {interfaces:?}"))
    }

    /// Waits until the status satisfies `pred` (e.g. a backend count after a manifest change).
    pub fn wait_status(
        &mut self,
        timeout: Duration,
        mut pred: impl FnMut(&AgentStatus) -> bool,
    ) -> Result<AgentStatus> {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(status) = self.status()?
                && pred(&status)
            {
                return Ok(status);
            }
            if Instant::now() >= deadline {
                bail!(
                    "agent status {:?} did not reach the expected state within {timeout:?}; log:\n{}",
                    self.status().ok().flatten(),
                    self.log_tail()
                );
            }
            thread::sleep(Duration::from_millis(20));
        }
    }

    /// Waits until a line of this run's log (since the last start) contains every one of
    /// `needles`; returns how long it waited. Fails with the log tail on timeout or if the agent
    /// exits.
    pub fn wait_log(&mut self, needles: &[&str], timeout: Duration) -> Result<Duration> {
        let started = Instant::now();
        loop {
            let text = std::fs::read_to_string(&self.log).unwrap_or_default();
            let run = text.rsplit("--- starting ").next().unwrap_or_default();
            if run.lines().any(|l| needles.iter().all(|n| l.contains(n))) {
                return Ok(started.elapsed());
            }
            if !self.is_running() {
                bail!(
                    "the agent exited before logging {needles:?}:\n{}",
                    self.log_tail()
                );
            }
            if started.elapsed() > timeout {
                bail!(
                    "no log line with {needles:?} within {timeout:?}:\n{}",
                    self.log_tail()
                );
            }
            thread::sleep(Duration::from_millis(20));
        }
    }

    /// SIGTERM and wait (up to 10 s, then SIGKILL). Returns the exit status.
    pub fn stop(&mut self) -> Result<ExitStatus> {
        let mut proc = self.proc.take().context("agent is not running")?;
        proc.terminate(Duration::from_secs(10))
    }

    /// SIGKILL and reap.
    pub fn kill(&mut self) -> Result<ExitStatus> {
        let mut proc = self.proc.take().context("agent is not running")?;
        proc.kill()
    }

    /// Whether the agent process is still running.
    pub fn is_running(&mut self) -> bool {
        self.proc
            .as_mut()
            .is_some_and(|p| matches!(p.try_wait(), Ok(None)))
    }

    /// The agent's PID (nsenter execs it, so this is the agent itself), if running.
    pub fn pid(&self) -> Option<u32> {
        self.proc.as_ref().map(Proc::pid)
    }

    pub fn log_path(&self) -> &Path {
        &self.log
    }

    pub fn pin_dir(&self) -> &Path {
        &self.pin_dir
    }

    /// Panics with `msg` and the tail of the agent's log (what a failed test wants to show).
    pub fn fail(&self, msg: &str) -> ! {
        panic!("{msg}\n--- agent log (tail) ---\n{}", self.log_tail())
    }

    /// [`Agent::fail`] with the message from `msg` unless `cond` holds.
    pub fn check(&self, cond: bool, msg: impl FnOnce() -> String) {
        if !cond {
            self.fail(&msg());
        }
    }

    /// The last 4 KiB of the agent log.
    pub fn log_tail(&self) -> String {
        tail(&self.log, 4096)
    }

    /// A datapath counter, summed over CPUs (`dump stats` of this agent's pins).
    pub fn counter(&self, name: &str) -> Result<u64> {
        let pin_dir = self.pin_dir.to_string_lossy().into_owned();
        let out = self.cli(&["dump", "stats", "--pin-dir", &pin_dir])?;
        let text = String::from_utf8_lossy(&out.stdout);
        text.lines()
            .find_map(|l| {
                let mut f = l.split_whitespace();
                (f.next() == Some(name)).then(|| f.last()?.parse().ok())?
            })
            .with_context(|| format!("no counter {name} in `dump stats`:\n{text}"))
    }

    /// Runs `kube-proxy-ebpf <args>` (dump, cleanup) in the node's network namespace.
    pub fn cli(&self, args: &[&str]) -> Result<Output> {
        cli(&self.bin, &self.node_ns, args)
    }
}

impl Drop for Agent {
    fn drop(&mut self) {
        if let Some(mut proc) = self.proc.take() {
            let _ = proc.kill();
        }
    }
}

/// Runs `<bin> <args>` inside the network namespace at `netns_path` (via nsenter, so the host
/// bpffs is visible), bounded to 30 s.
pub fn cli(bin: &Path, netns_path: &Path, args: &[&str]) -> Result<Output> {
    let mut cmd = std::process::Command::new("nsenter");
    cmd.arg(format!("--net={}", netns_path.display()))
        .arg(bin)
        .args(args);
    run_with_timeout(cmd, Duration::from_secs(30))
}
