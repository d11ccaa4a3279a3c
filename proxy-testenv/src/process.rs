//! Child processes: a [`Proc`] guard that kills its process group on drop, and bounded runs.

use std::{
    fs::File,
    io::Read,
    os::unix::process::{CommandExt as _, ExitStatusExt as _},
    path::{Path, PathBuf},
    process::{Child, Command, ExitStatus, Output, Stdio},
    thread,
    time::{Duration, Instant},
};

use anyhow::{Context as _, Result, bail};
use nix::{
    errno::Errno,
    sys::signal::{Signal, killpg},
    unistd::Pid,
};

/// A child process in its own process group. Drop sends SIGKILL to the group and reaps the child.
#[derive(Debug)]
pub struct Proc {
    child: Option<Child>,
    what: String,
    log: Option<PathBuf>,
}

impl Proc {
    /// Spawns `cmd` in a new process group, stdin closed. stdout and stderr go to `log` when
    /// given (appended), else to /dev/null.
    pub fn spawn(mut cmd: Command, log: Option<&Path>) -> Result<Self> {
        let what = format!("{cmd:?}");
        cmd.stdin(Stdio::null()).process_group(0);
        match log {
            Some(path) => {
                let file = File::options()
                    .create(true)
                    .append(true)
                    .open(path)
                    .with_context(|| format!("opening log {}", path.display()))?;
                cmd.stdout(file.try_clone()?).stderr(file);
            }
            None => {
                cmd.stdout(Stdio::null()).stderr(Stdio::null());
            }
        }
        let child = cmd.spawn().with_context(|| format!("spawning {what}"))?;
        Ok(Self {
            child: Some(child),
            what,
            log: log.map(Path::to_path_buf),
        })
    }

    /// PID of the child (also its process group id).
    pub fn pid(&self) -> u32 {
        self.child.as_ref().map_or(0, Child::id)
    }

    /// The command line, for messages.
    pub fn what(&self) -> &str {
        &self.what
    }

    /// The log file given at spawn.
    pub fn log(&self) -> Option<&Path> {
        self.log.as_deref()
    }

    /// The last `max` bytes of the log file (empty without a log).
    pub fn log_tail(&self, max: usize) -> String {
        self.log
            .as_deref()
            .map(|p| tail(p, max))
            .unwrap_or_default()
    }

    /// `Some(status)` once the child has exited.
    pub fn try_wait(&mut self) -> Result<Option<ExitStatus>> {
        match self.child.as_mut() {
            Some(child) => Ok(child.try_wait()?),
            None => bail!("{} was already reaped", self.what),
        }
    }

    /// Waits up to `timeout` for the child to exit by itself.
    pub fn wait_timeout(&mut self, timeout: Duration) -> Result<Option<ExitStatus>> {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(status) = self.try_wait()? {
                return Ok(Some(status));
            }
            if Instant::now() >= deadline {
                return Ok(None);
            }
            thread::sleep(Duration::from_millis(20));
        }
    }

    /// Sends `signal` to the child's process group.
    pub fn signal(&self, signal: Signal) -> Result<()> {
        let pid = self.pid();
        if pid == 0 {
            bail!("{} has no pid", self.what);
        }
        let pgid = i32::try_from(pid).context("pid out of range")?;
        match killpg(Pid::from_raw(pgid), signal) {
            // ESRCH: the group is already gone.
            Ok(()) | Err(Errno::ESRCH) => Ok(()),
            Err(e) => Err(e).with_context(|| format!("killpg({pgid}, {signal})")),
        }
    }

    /// SIGTERM, then wait up to `grace`; SIGKILL if still running. Returns the exit status.
    pub fn terminate(&mut self, grace: Duration) -> Result<ExitStatus> {
        if let Some(status) = self.try_wait()? {
            return Ok(status);
        }
        self.signal(Signal::SIGTERM)?;
        if let Some(status) = self.wait_timeout(grace)? {
            return Ok(status);
        }
        self.kill()
    }

    /// SIGKILL to the group and reap. Returns the exit status.
    pub fn kill(&mut self) -> Result<ExitStatus> {
        if let Some(status) = self.try_wait()? {
            // The leader is gone; still clear any stragglers of its group.
            let _ = self.signal(Signal::SIGKILL);
            return Ok(status);
        }
        self.signal(Signal::SIGKILL)?;
        let child = self.child.as_mut().context("no child")?;
        Ok(child.wait()?)
    }

    /// Waits for exit (bounded by `timeout`, killing on expiry) and returns the status.
    pub fn wait_or_kill(&mut self, timeout: Duration) -> Result<ExitStatus> {
        match self.wait_timeout(timeout)? {
            Some(status) => Ok(status),
            None => {
                let status = self.kill()?;
                bail!(
                    "{} did not exit within {timeout:?}; killed ({status})",
                    self.what
                )
            }
        }
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        if self.child.is_some() {
            let _ = self.kill();
            self.child = None;
        }
    }
}

/// Runs `cmd` to completion with captured output, killing it (and its process group) after
/// `timeout`. A non-zero exit is not an error here; the caller looks at `status`.
pub fn run_with_timeout(mut cmd: Command, timeout: Duration) -> Result<Output> {
    let what = format!("{cmd:?}");
    cmd.stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .process_group(0);
    let mut child = cmd.spawn().with_context(|| format!("spawning {what}"))?;
    let mut out = child.stdout.take().context("stdout pipe")?;
    let mut err = child.stderr.take().context("stderr pipe")?;
    let out_reader = thread::spawn(move || {
        let mut buf = Vec::new();
        let _ = out.read_to_end(&mut buf);
        buf
    });
    let err_reader = thread::spawn(move || {
        let mut buf = Vec::new();
        let _ = err.read_to_end(&mut buf);
        buf
    });
    let deadline = Instant::now() + timeout;
    let status = loop {
        if let Some(status) = child.try_wait()? {
            break status;
        }
        if Instant::now() >= deadline {
            let pgid = i32::try_from(child.id()).context("pid out of range")?;
            let _ = killpg(Pid::from_raw(pgid), Signal::SIGKILL);
            let _ = child.wait();
            bail!("{what} did not finish within {timeout:?}; killed");
        }
        thread::sleep(Duration::from_millis(5));
    };
    // Grandchildren may still hold the pipes; the process group is ours, clear it.
    if let Ok(pgid) = i32::try_from(child.id()) {
        // ESRCH is expected.
        let _ = killpg(Pid::from_raw(pgid), Signal::SIGKILL);
    }
    let stdout = out_reader.join().unwrap_or_default();
    let stderr = err_reader.join().unwrap_or_default();
    Ok(Output {
        status,
        stdout,
        stderr,
    })
}

/// Runs `cmd` with a timeout and fails unless it exits 0; returns its stdout as text.
pub(crate) fn run_ok(cmd: Command, timeout: Duration) -> Result<String> {
    let what = format!("{cmd:?}");
    let out = run_with_timeout(cmd, timeout)?;
    if !out.status.success() {
        bail!(
            "{what} failed ({}): {}",
            describe(out.status),
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// "exit code N" or "signal N".
pub(crate) fn describe(status: ExitStatus) -> String {
    match (status.code(), status.signal()) {
        (Some(code), _) => format!("exit code {code}"),
        (None, Some(sig)) => format!("killed by signal {sig}"),
        _ => status.to_string(),
    }
}

/// The last `max` bytes of a file, lossily decoded.
pub(crate) fn tail(path: &Path, max: usize) -> String {
    let Ok(bytes) = std::fs::read(path) else {
        return String::new();
    };
    let start = bytes.len().saturating_sub(max);
    String::from_utf8_lossy(&bytes[start..]).into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn run_with_timeout_captures_output() {
        let mut cmd = Command::new("sh");
        cmd.args(["-c", "echo out; echo err >&2; exit 3"]);
        let out = run_with_timeout(cmd, Duration::from_secs(5)).expect("sh runs");
        assert_eq!(out.status.code(), Some(3));
        assert_eq!(String::from_utf8_lossy(&out.stdout), "out\n");
        assert_eq!(String::from_utf8_lossy(&out.stderr), "err\n");
    }

    #[test]
    fn run_with_timeout_kills_on_expiry() {
        let mut cmd = Command::new("sleep");
        cmd.arg("30");
        let started = Instant::now();
        let err = run_with_timeout(cmd, Duration::from_millis(200)).expect_err("times out");
        assert!(started.elapsed() < Duration::from_secs(5));
        assert!(err.to_string().contains("did not finish"), "{err}");
    }

    #[test]
    fn proc_drop_kills_the_group() {
        let mut cmd = Command::new("sh");
        // The shell forks a sleep into the same group; both must die.
        cmd.args(["-c", "sleep 30 & sleep 30"]);
        let proc = Proc::spawn(cmd, None).expect("spawn");
        let pgid = proc.pid() as i32;
        drop(proc);
        // No signal: only checks whether the group still exists. The orphaned sleep is reaped
        // by init a moment later (longer on a loaded machine): wait for that, bounded.
        let gone = (0..100).any(|_| {
            thread::sleep(Duration::from_millis(50));
            killpg(Pid::from_raw(pgid), None) == Err(Errno::ESRCH)
        });
        assert!(gone, "process group {pgid} still alive 5 s after drop");
    }

    #[test]
    fn terminate_returns_status() {
        let mut cmd = Command::new("sleep");
        cmd.arg("30");
        let mut proc = Proc::spawn(cmd, None).expect("spawn");
        let status = proc.terminate(Duration::from_secs(2)).expect("terminate");
        assert_eq!(status.signal(), Some(Signal::SIGTERM as i32));
    }
}
