//! A long TCP stream through whatever the test puts between a client and a server: the server
//! sends a 251-periodic byte pattern, paced (16 KiB every 5 ms), until told to stop; the client
//! checks every byte and times the longest gap between two reads. The stream is whole when the
//! client got every byte the server sent, in order, on its one connection, and saw the clean end.

use std::{
    net::IpAddr,
    path::{Path, PathBuf},
    thread,
    time::{Duration, Instant},
};

use anyhow::{Context as _, Result, bail};
use serde::Deserialize;

use crate::{netns::NetNs, process::Proc};

/// Sends the pattern to its one client until the stop file exists (at most 180 s), then closes;
/// prints the bytes sent. Args: port, ready file, stop file.
const SERVER_PY: &str = r#"
import os, socket, sys, time
port, ready, stop = int(sys.argv[1]), sys.argv[2], sys.argv[3]
ls = socket.socket()
ls.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
ls.bind(("0.0.0.0", port))
ls.listen(1)
open(ready, "w").write("ready\n")
conn, peer = ls.accept()
chunk = bytes(i % 251 for i in range(251 * 64))
sent, end = 0, time.monotonic() + 180
while time.monotonic() < end and not os.path.exists(stop):
    conn.sendall(chunk)
    sent += len(chunk)
    time.sleep(0.005)
conn.shutdown(socket.SHUT_WR)
conn.recv(1)
print("sent %d" % sent, flush=True)
"#;

/// Connects, prints its own address, receives until EOF checking every byte; prints one JSON
/// line. Args: ip, port.
const CLIENT_PY: &str = r#"
import json, socket, sys, time
s = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=5)
print("local %s:%d" % s.getsockname()[:2], flush=True)
s.settimeout(10)
big = bytes(i % 251 for i in range(251 * 300))
total, gap, last, bad, err, eof = 0, 0.0, time.monotonic(), None, None, False
try:
    while True:
        data = s.recv(65536)
        now = time.monotonic()
        gap, last = max(gap, now - last), now
        if not data:
            eof = True
            break
        o = total % 251
        if bad is None and data != big[o:o + len(data)]:
            bad = total + next(j for j in range(len(data)) if data[j] != big[o + j])
        total += len(data)
except Exception as e:
    err = repr(e)
s.close()
print(json.dumps({"bytes": total, "max_gap_ms": int(gap * 1000), "mismatch": bad, "error": err, "eof": eof}), flush=True)
"#;

/// What the client saw, and what the server sent.
#[derive(Clone, Debug, Default, Deserialize, PartialEq, Eq)]
pub struct StreamSummary {
    pub bytes: u64,
    pub max_gap_ms: u64,
    pub mismatch: Option<u64>,
    pub error: Option<String>,
    pub eof: bool,
    #[serde(skip)]
    pub sent: u64,
}

impl StreamSummary {
    /// Every byte sent arrived, in order, and the stream ended cleanly.
    pub fn whole(&self) -> bool {
        self.eof && self.error.is_none() && self.mismatch.is_none() && self.bytes == self.sent
    }
}

/// A running stream. Drop kills both ends.
#[derive(Debug)]
pub struct ByteStream {
    client: Proc,
    server: Proc,
    client_log: PathBuf,
    server_log: PathBuf,
    stop_file: PathBuf,
    local: String,
}

impl ByteStream {
    /// Starts the server in `server_ns` on `server_port`, then the client in `client_ns` toward
    /// `ip:port` (a Service address, or the server itself); returns once the client connected.
    /// Scripts and logs go to `work_dir`, named after `name`.
    pub fn start(
        work_dir: &Path,
        name: &str,
        server_ns: &NetNs,
        server_port: u16,
        client_ns: &NetNs,
        ip: IpAddr,
        port: u16,
    ) -> Result<Self> {
        let file = |what: &str| work_dir.join(format!("stream-{name}-{what}"));
        let (server_py, client_py) = (file("server.py"), file("client.py"));
        std::fs::write(&server_py, SERVER_PY).context("writing the stream server")?;
        std::fs::write(&client_py, CLIENT_PY).context("writing the stream client")?;
        let (ready, stop_file) = (file("ready"), file("stop"));
        let (server_log, client_log) = (file("server.log"), file("client.log"));
        for f in [&ready, &stop_file, &server_log, &client_log] {
            let _ = std::fs::remove_file(f);
        }
        let s = |p: &Path| p.to_string_lossy().into_owned();
        let server = server_ns.spawn(
            &[
                "python3",
                &s(&server_py),
                &server_port.to_string(),
                &s(&ready),
                &s(&stop_file),
            ],
            Some(&server_log),
        )?;
        wait_until(Duration::from_secs(10), || ready.exists())
            .with_context(|| format!("the {name} stream server did not start"))?;
        let client = client_ns.spawn(
            &[
                "python3",
                &s(&client_py),
                &ip.to_string(),
                &port.to_string(),
            ],
            Some(&client_log),
        )?;
        let mut local = None;
        wait_until(Duration::from_secs(10), || {
            local = std::fs::read_to_string(&client_log).ok().and_then(|t| {
                t.lines()
                    .find_map(|l| l.strip_prefix("local ").map(str::to_owned))
            });
            local.is_some()
        })
        .with_context(|| {
            format!(
                "the {name} stream did not connect to {ip}:{port}: {}",
                std::fs::read_to_string(&client_log).unwrap_or_default()
            )
        })?;
        Ok(Self {
            client,
            server,
            client_log,
            server_log,
            stop_file,
            local: local.unwrap_or_default(),
        })
    }

    /// The client's own address and port (`a.b.c.d:port`).
    pub fn local(&self) -> &str {
        &self.local
    }

    /// Whether the client still runs (it exits at the stream's end or on an error).
    pub fn running(&mut self) -> bool {
        matches!(self.client.try_wait(), Ok(None))
    }

    /// Tells the server to end the stream and waits (up to `timeout`) for the client's summary.
    pub fn finish(mut self, timeout: Duration) -> Result<StreamSummary> {
        std::fs::write(&self.stop_file, "stop\n").context("writing the stop file")?;
        let summary_line = |log: &Path, prefix: &str| -> Option<String> {
            std::fs::read_to_string(log)
                .ok()?
                .lines()
                .find(|l| l.starts_with(prefix))
                .map(str::to_owned)
        };
        let mut line = None;
        wait_until(timeout, || {
            line = summary_line(&self.client_log, "{");
            line.is_some()
        })
        .with_context(|| {
            format!(
                "the stream client did not finish: {}",
                std::fs::read_to_string(&self.client_log).unwrap_or_default()
            )
        })?;
        let mut summary: StreamSummary =
            serde_json::from_str(&line.unwrap_or_default()).context("the client's summary")?;
        let mut sent = None;
        wait_until(Duration::from_secs(5), || {
            sent = summary_line(&self.server_log, "sent ")
                .and_then(|l| l.trim_start_matches("sent ").trim().parse().ok());
            sent.is_some()
        })
        .with_context(|| {
            format!(
                "the stream server did not report: {}",
                std::fs::read_to_string(&self.server_log).unwrap_or_default()
            )
        })?;
        summary.sent = sent.unwrap_or_default();
        let _ = self.client.kill();
        let _ = self.server.kill();
        Ok(summary)
    }
}

fn wait_until(timeout: Duration, mut cond: impl FnMut() -> bool) -> Result<()> {
    let deadline = Instant::now() + timeout;
    while !cond() {
        if Instant::now() >= deadline {
            bail!("timed out after {timeout:?}");
        }
        thread::sleep(Duration::from_millis(20));
    }
    Ok(())
}

/// Sends a datagram every 200 ms from one fixed source port, the way statsd, syslog or a QUIC
/// client keep one socket, and records every reply with its CLOCK_MONOTONIC time. Args: out
/// file, destination, port, source port, datagrams to send (the run is bounded by it).
const PINGER_PY: &str = r#"
import select, socket, sys, time
out, dst, dport, sport, n = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
fam = socket.AF_INET6 if ":" in dst else socket.AF_INET
s = socket.socket(fam, socket.SOCK_DGRAM)
s.bind(("::" if fam == socket.AF_INET6 else "0.0.0.0", sport))
f = open(out, "w")
for i in range(n):
    try:
        s.sendto(b"ping%d" % i, (dst, dport))
    except OSError:
        pass
    end = time.monotonic() + 0.2
    while True:
        left = end - time.monotonic()
        if left <= 0:
            break
        if select.select([s], [], [], left)[0]:
            try:
                data = s.recv(2048)
            except OSError:
                continue
            f.write("%d %s\n" % (time.monotonic_ns(), data.decode(errors="replace")))
            f.flush()
f.write("done\n")
f.close()
"#;

/// How often a [`UdpPinger`] sends.
pub const PINGER_PERIOD: Duration = Duration::from_millis(200);

/// A fixed-source-port UDP client sending every [`PINGER_PERIOD`] ([`PINGER_PY`]).
#[derive(Debug)]
pub struct UdpPinger {
    out: PathBuf,
    proc: Proc,
}

/// One reply a [`UdpPinger`] got: when (CLOCK_MONOTONIC ns) and what.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PingReply {
    pub at_ns: u64,
    pub body: String,
}

impl UdpPinger {
    /// Starts sending from `ns` to `dst:port` from source port `sport`, `count` datagrams.
    pub fn start(
        ns: &NetNs,
        dir: &Path,
        name: &str,
        dst: IpAddr,
        port: u16,
        sport: u16,
        count: u32,
    ) -> Result<Self> {
        let out = dir.join(format!("pinger-{name}.out"));
        let proc = ns.spawn(
            &[
                "python3",
                "-c",
                PINGER_PY,
                out.to_str().context("path")?,
                &dst.to_string(),
                &port.to_string(),
                &sport.to_string(),
                &count.to_string(),
            ],
            Some(&dir.join(format!("pinger-{name}.log"))),
        )?;
        Ok(Self { out, proc })
    }

    /// The replies so far.
    pub fn replies(&self) -> Vec<PingReply> {
        let text = std::fs::read_to_string(&self.out).unwrap_or_default();
        text.lines()
            .filter_map(|l| {
                let (at, body) = l.split_once(' ')?;
                Some(PingReply {
                    at_ns: at.parse().ok()?,
                    body: body.to_owned(),
                })
            })
            .collect()
    }

    /// Waits until it sent its last datagram (at most `timeout`), then stops it.
    pub fn finish(mut self, timeout: Duration) -> Vec<PingReply> {
        let started = Instant::now();
        while started.elapsed() < timeout {
            let done = std::fs::read_to_string(&self.out).is_ok_and(|t| t.ends_with("done\n"));
            if done {
                break;
            }
            thread::sleep(Duration::from_millis(50));
        }
        let _ = self.proc.kill();
        self.replies()
    }
}
