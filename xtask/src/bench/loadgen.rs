//! The bench's own traffic tools, run inside a namespace as hidden subcommands of the bench
//! binary (`ip netns exec <ns> <bench-bin> loadgen|serve ...`):
//!
//! - `serve`: a minimal HTTP/1.1 server (a few threads blocking in `accept`), one response per
//!   connection, then close (the server closes first, so TIME_WAIT lands on the backend, where the
//!   topology sets `tcp_max_tw_buckets=0`).
//! - `loadgen`: short-connection load at fixed concurrency for a fixed time (and at most a fixed
//!   number of connections): connect, one GET, read to EOF, close. Latency is measured from
//!   before `connect()` to the end of the response, so it includes the handshake, where the NAT
//!   decision is made. Prints one JSON object.
//! - `loadgen --rate R`: the same connections paced at a fixed rate of new connections (open
//!   loop, [`PacedResult`]): connection `i` starts at `i / R` s whatever the others do, on a pool
//!   of threads large enough that a connection waiting for its timeout never delays the next.
//!
//! Both are bounded in time (`--max-seconds` for the server, `--duration-ms` and `--max-conns` for
//! the client), so a lost guard cannot leave load running.

use std::{
    io::{Read as _, Write as _},
    net::{SocketAddr, SocketAddrV4, TcpListener, TcpStream},
    sync::{
        Arc,
        atomic::{AtomicU64, Ordering},
    },
    thread,
    time::{Duration, Instant},
};

use anyhow::{Context as _, Result, bail};

#[derive(Debug, clap::Args)]
pub struct ServeArgs {
    /// TCP port to listen on (all addresses of the namespace).
    #[arg(long)]
    pub port: u16,
    /// Worker threads, each blocking in accept().
    #[arg(long, default_value_t = 4)]
    pub threads: usize,
    /// Body of every response (the pod's name).
    #[arg(long)]
    pub name: String,
    /// File created once the socket listens.
    #[arg(long)]
    pub ready: std::path::PathBuf,
    /// Exit after this long whatever happens.
    #[arg(long, default_value_t = 3600)]
    pub max_seconds: u64,
}

#[derive(Debug, clap::Args)]
pub struct LoadArgs {
    /// Comma-separated ip:port list; connections go round-robin over them.
    #[arg(long, value_delimiter = ',')]
    pub targets: Vec<SocketAddrV4>,
    /// Connections in flight at any time (one thread each).
    #[arg(long, default_value_t = 4)]
    pub concurrency: usize,
    /// How long to generate load.
    #[arg(long, default_value_t = 5000)]
    pub duration_ms: u64,
    /// Upper bound on connections in total.
    #[arg(long, default_value_t = 1_000_000)]
    pub max_conns: u64,
    /// Per-connection timeout (connect, and each read/write).
    #[arg(long, default_value_t = 3000)]
    pub timeout_ms: u64,
    /// Paced mode: start this many new connections a second for `--duration-ms` (at most
    /// `--max-conns`), whatever the answers take (`--concurrency` is not used).
    #[arg(long)]
    pub rate: Option<f64>,
}

pub fn serve(args: &ServeArgs) -> Result<()> {
    let listener = TcpListener::bind(("0.0.0.0", args.port))
        .with_context(|| format!("binding 0.0.0.0:{}", args.port))?;
    std::fs::write(&args.ready, "ready\n")
        .with_context(|| format!("writing {}", args.ready.display()))?;
    let body = format!("{}\n", args.name);
    let response: Arc<[u8]> = format!(
        "HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )
    .into_bytes()
    .into();
    let listener = Arc::new(listener);
    for _ in 0..args.threads.max(1) {
        let listener = Arc::clone(&listener);
        let response = Arc::clone(&response);
        thread::spawn(move || {
            loop {
                if let Ok((stream, _)) = listener.accept() {
                    let _ = handle(stream, &response);
                }
            }
        });
    }
    thread::sleep(Duration::from_secs(args.max_seconds));
    Ok(())
}

fn handle(mut s: TcpStream, response: &[u8]) -> std::io::Result<()> {
    s.set_read_timeout(Some(Duration::from_secs(5)))?;
    s.set_nodelay(true)?;
    let mut buf = [0u8; 4096];
    let mut have = 0usize;
    loop {
        let n = s.read(&mut buf[have..])?;
        if n == 0 {
            return Ok(());
        }
        have += n;
        if buf[..have].windows(4).any(|w| w == b"\r\n\r\n") || have == buf.len() {
            break;
        }
    }
    s.write_all(response)
}

/// What one `loadgen` run measured (printed as JSON).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct LoadResult {
    pub ok: u64,
    pub errors: u64,
    /// First error message seen (if any).
    pub first_error: Option<String>,
    pub seconds: f64,
    /// Successful connections (= requests) per second.
    pub conns_per_s: f64,
    pub p50_us: u64,
    pub p90_us: u64,
    pub p99_us: u64,
    pub max_us: u64,
    /// Requests that took ≥ 900 ms (a SYN retransmission, the TIME_WAIT pitfall).
    pub slow_1s: u64,
}

impl LoadResult {
    pub fn to_json(&self) -> serde_json::Value {
        serde_json::json!({
            "ok": self.ok, "errors": self.errors, "first_error": self.first_error,
            "seconds": self.seconds, "conns_per_s": self.conns_per_s,
            "p50_us": self.p50_us, "p90_us": self.p90_us, "p99_us": self.p99_us,
            "max_us": self.max_us, "slow_1s": self.slow_1s,
        })
    }

    pub fn from_json(v: &serde_json::Value) -> Result<Self> {
        let u = |k: &str| {
            v[k].as_u64()
                .with_context(|| format!("loadgen JSON: no {k}"))
        };
        let f = |k: &str| {
            v[k].as_f64()
                .with_context(|| format!("loadgen JSON: no {k}"))
        };
        Ok(Self {
            ok: u("ok")?,
            errors: u("errors")?,
            first_error: v["first_error"].as_str().map(str::to_owned),
            seconds: f("seconds")?,
            conns_per_s: f("conns_per_s")?,
            p50_us: u("p50_us")?,
            p90_us: u("p90_us")?,
            p99_us: u("p99_us")?,
            max_us: u("max_us")?,
            slow_1s: u("slow_1s")?,
        })
    }
}

pub fn loadgen(args: &LoadArgs) -> Result<()> {
    let result = match args.rate {
        Some(rate) => run_paced(args, rate)?.to_json(),
        None => run_load(args)?.to_json(),
    };
    println!("{result}");
    Ok(())
}

fn run_load(args: &LoadArgs) -> Result<LoadResult> {
    if args.targets.is_empty() {
        bail!("loadgen: no --targets");
    }
    let duration = Duration::from_millis(args.duration_ms.min(120_000));
    let timeout = Duration::from_millis(args.timeout_ms.max(1));
    let started = Instant::now();
    let deadline = started + duration;
    let issued = Arc::new(AtomicU64::new(0));
    let targets: Arc<[SocketAddrV4]> = args.targets.clone().into();
    let max_conns = args.max_conns;
    let workers: Vec<_> = (0..args.concurrency.clamp(1, 256))
        .map(|_| {
            let issued = Arc::clone(&issued);
            let targets = Arc::clone(&targets);
            thread::spawn(move || {
                let mut lat = Vec::with_capacity(65_536);
                let mut errors = 0u64;
                let mut first_error = None;
                while Instant::now() < deadline {
                    let n = issued.fetch_add(1, Ordering::Relaxed);
                    if n >= max_conns {
                        break;
                    }
                    let target = targets[(n % targets.len() as u64) as usize];
                    let t0 = Instant::now();
                    match request(target, timeout) {
                        Ok(()) => lat.push(t0.elapsed().as_micros() as u64),
                        Err(e) => {
                            errors += 1;
                            first_error.get_or_insert_with(|| format!("{target}: {e}"));
                        }
                    }
                }
                (lat, errors, first_error)
            })
        })
        .collect();
    let mut all = Vec::new();
    let mut errors = 0;
    let mut first_error = None;
    for w in workers {
        let (lat, e, fe) = w
            .join()
            .map_err(|_| anyhow::anyhow!("loadgen worker panicked"))?;
        all.extend(lat);
        errors += e;
        if first_error.is_none() {
            first_error = fe;
        }
    }
    let seconds = started.elapsed().as_secs_f64();
    all.sort_unstable();
    let pct = |p: f64| -> u64 {
        if all.is_empty() {
            return 0;
        }
        let i = ((all.len() as f64 - 1.0) * p).round() as usize;
        all[i.min(all.len() - 1)]
    };
    Ok(LoadResult {
        ok: all.len() as u64,
        errors,
        first_error,
        seconds,
        conns_per_s: all.len() as f64 / seconds,
        p50_us: pct(0.50),
        p90_us: pct(0.90),
        p99_us: pct(0.99),
        max_us: all.last().copied().unwrap_or(0),
        slow_1s: all.iter().filter(|&&us| us >= 900_000).count() as u64,
    })
}

/// Why one connection failed: the step, and the socket error (or a bad reply).
#[derive(Debug)]
struct Failure {
    step: &'static str,
    error: std::io::Error,
}

impl Failure {
    fn at(step: &'static str) -> impl FnOnce(std::io::Error) -> Self {
        move |error| Self { step, error }
    }

    /// `step:cause`, a short name to count failures by (`connect:refused`, `recv:timeout`, ...).
    fn kind(&self) -> String {
        use std::io::ErrorKind as K;
        if self.step == "reply" {
            return "reply:bad".to_owned();
        }
        let cause = match self.error.kind() {
            K::ConnectionRefused => "refused".to_owned(),
            K::TimedOut | K::WouldBlock => "timeout".to_owned(),
            K::ConnectionReset => "reset".to_owned(),
            K::AddrNotAvailable => "no-source-port".to_owned(),
            k => format!("{k:?}").to_lowercase(),
        };
        format!("{}:{cause}", self.step)
    }
}

impl std::fmt::Display for Failure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}: {}", self.step, self.error)
    }
}

/// Connect, one GET, read to EOF (the server closes first), close.
fn request(target: SocketAddrV4, timeout: Duration) -> Result<(), Failure> {
    let mut s = TcpStream::connect_timeout(&SocketAddr::V4(target), timeout)
        .map_err(Failure::at("connect"))?;
    (s.set_read_timeout(Some(timeout)))
        .and_then(|()| s.set_write_timeout(Some(timeout)))
        .and_then(|()| s.set_nodelay(true))
        .map_err(Failure::at("connect"))?;
    s.write_all(b"GET / HTTP/1.1\r\nHost: bench\r\nConnection: close\r\n\r\n")
        .map_err(Failure::at("send"))?;
    let mut buf = [0u8; 1024];
    let mut have = 0usize;
    loop {
        let n = s.read(&mut buf[have..]).map_err(Failure::at("recv"))?;
        if n == 0 {
            break;
        }
        have = (have + n).min(buf.len() - 1);
    }
    if !buf[..have].starts_with(b"HTTP/1.1 200") {
        return Err(Failure::at("reply")(std::io::Error::other(format!(
            "bad response ({have} bytes)"
        ))));
    }
    Ok(())
}

/// What one paced `loadgen --rate` run measured (printed as JSON).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct PacedResult {
    /// The rate asked for (new connections a second).
    pub rate: f64,
    /// Connections the rate and duration (and `--max-conns`) called for.
    pub planned: u64,
    /// Connections started (`planned` unless launches fell so far behind that the time bound
    /// stopped them).
    pub attempted: u64,
    /// Answered with a whole `200` reply.
    pub answered: u64,
    pub failed: u64,
    /// Failures by `step:cause` ([`Failure::kind`]).
    pub failures: std::collections::BTreeMap<String, u64>,
    /// The earliest failure: when (s after the first launch) and what.
    pub first_failure_at_s: Option<f64>,
    pub first_error: Option<String>,
    /// From the first launch's due time to one interval after the last launch.
    pub launch_seconds: f64,
    /// Answered connections per second of `launch_seconds`.
    pub achieved_per_s: f64,
    /// Answered connections' latency: before `connect()` to the end of the reply.
    pub p50_us: u64,
    pub p90_us: u64,
    pub p99_us: u64,
    pub max_us: u64,
    /// Answered in ≥ 900 ms (a lost SYN retransmitted after 1 s).
    pub slow_1s: u64,
    /// How late a launch came against its due time: the largest, and how many ≥ 10 ms.
    pub max_launch_lag_us: u64,
    pub late_launches: u64,
    /// Worker threads (each holds at most one connection).
    pub threads: usize,
}

impl PacedResult {
    pub fn to_json(&self) -> serde_json::Value {
        serde_json::json!({
            "rate": self.rate, "planned": self.planned, "attempted": self.attempted,
            "answered": self.answered, "failed": self.failed, "failures": self.failures,
            "first_failure_at_s": self.first_failure_at_s, "first_error": self.first_error,
            "launch_seconds": self.launch_seconds, "achieved_per_s": self.achieved_per_s,
            "p50_us": self.p50_us, "p90_us": self.p90_us, "p99_us": self.p99_us,
            "max_us": self.max_us, "slow_1s": self.slow_1s,
            "max_launch_lag_us": self.max_launch_lag_us, "late_launches": self.late_launches,
            "threads": self.threads,
        })
    }

    pub fn from_json(v: &serde_json::Value) -> Result<Self> {
        let u = |k: &str| {
            v[k].as_u64()
                .with_context(|| format!("paced loadgen JSON: no {k}"))
        };
        let f = |k: &str| {
            v[k].as_f64()
                .with_context(|| format!("paced loadgen JSON: no {k}"))
        };
        Ok(Self {
            rate: f("rate")?,
            planned: u("planned")?,
            attempted: u("attempted")?,
            answered: u("answered")?,
            failed: u("failed")?,
            failures: (v["failures"].as_object().into_iter().flatten())
                .map(|(k, n)| (k.clone(), n.as_u64().unwrap_or(0)))
                .collect(),
            first_failure_at_s: v["first_failure_at_s"].as_f64(),
            first_error: v["first_error"].as_str().map(str::to_owned),
            launch_seconds: f("launch_seconds")?,
            achieved_per_s: f("achieved_per_s")?,
            p50_us: u("p50_us")?,
            p90_us: u("p90_us")?,
            p99_us: u("p99_us")?,
            max_us: u("max_us")?,
            slow_1s: u("slow_1s")?,
            max_launch_lag_us: u("max_launch_lag_us")?,
            late_launches: u("late_launches")?,
            threads: u("threads")? as usize,
        })
    }
}

/// Most worker threads a paced run starts (each holds at most one socket).
const MAX_PACED_THREADS: usize = 4096;
/// A launch this late against its due time counts as late.
const LATE: Duration = Duration::from_millis(10);

/// What one worker of [`run_paced`] saw.
#[derive(Default)]
struct Worker {
    latencies_us: Vec<u64>,
    attempted: u64,
    failures: std::collections::BTreeMap<String, u64>,
    /// The earliest failure: (s after the first launch, message).
    first_failure: Option<(f64, String)>,
    max_lag: Duration,
    late: u64,
    last_launch: Option<Instant>,
}

/// Paced (open-loop) load: connection `i` is due at `i / rate` s after the start, on worker
/// `i mod threads`; `threads` covers `rate` × (timeout + 1 s), so a connection that waits for its
/// timeout has ended before its worker's next one is due. Bounded: `rate × duration` connections
/// (at most `--max-conns`), none launched later than the duration plus the timeout.
fn run_paced(args: &LoadArgs, rate: f64) -> Result<PacedResult> {
    use std::sync::{Barrier, OnceLock};
    if args.targets.is_empty() {
        bail!("loadgen: no --targets");
    }
    if !(rate.is_finite() && (0.1..=100_000.0).contains(&rate)) {
        bail!("loadgen: --rate {rate} is not in 0.1..=100000");
    }
    let duration = Duration::from_millis(args.duration_ms.min(120_000));
    let timeout = Duration::from_millis(args.timeout_ms.clamp(1, 30_000));
    let planned = ((rate * duration.as_secs_f64()).floor() as u64).min(args.max_conns);
    let threads = ((rate * (timeout.as_secs_f64() + 1.0)).ceil() as usize)
        .min(MAX_PACED_THREADS)
        .min(open_files_limit().saturating_sub(64).max(1))
        .min(planned.max(1) as usize);
    let start = Arc::new(OnceLock::<Instant>::new());
    let barrier = Arc::new(Barrier::new(threads + 1));
    let targets: Arc<[SocketAddrV4]> = args.targets.clone().into();
    let mut workers = Vec::with_capacity(threads);
    for k in 0..threads {
        let (start, barrier, targets) = (start.clone(), barrier.clone(), targets.clone());
        let worker = thread::Builder::new()
            .name(format!("paced-{k}"))
            .stack_size(128 * 1024)
            .spawn(move || {
                barrier.wait();
                let t0 = *start.get().expect("start time set before the barrier");
                let stop = t0 + duration + timeout;
                let mut w = Worker::default();
                for i in (k as u64..planned).step_by(threads) {
                    let due = t0 + Duration::from_secs_f64(i as f64 / rate);
                    let now = Instant::now();
                    if now < due {
                        thread::sleep(due - now);
                    } else if now >= stop {
                        break;
                    }
                    let began = Instant::now();
                    let lag = began.saturating_duration_since(due);
                    w.max_lag = w.max_lag.max(lag);
                    w.late += u64::from(lag >= LATE);
                    w.attempted += 1;
                    w.last_launch = Some(began);
                    let target = targets[(i % targets.len() as u64) as usize];
                    match request(target, timeout) {
                        Ok(()) => w.latencies_us.push(began.elapsed().as_micros() as u64),
                        Err(e) => {
                            *w.failures.entry(e.kind()).or_default() += 1;
                            let at = (began - t0).as_secs_f64();
                            if w.first_failure.as_ref().is_none_or(|(t, _)| at < *t) {
                                w.first_failure = Some((at, format!("{target}: {e}")));
                            }
                        }
                    }
                }
                w
            })
            .with_context(|| format!("starting paced worker {k} of {threads}"))?;
        workers.push(worker);
    }
    // Every worker exists before the clock starts: spawning them is not launch lag.
    let t0 = Instant::now() + Duration::from_millis(20);
    let _ = start.set(t0);
    barrier.wait();
    let mut all = Worker::default();
    for w in workers {
        let w = w
            .join()
            .map_err(|_| anyhow::anyhow!("paced loadgen worker panicked"))?;
        all.latencies_us.extend(w.latencies_us);
        all.attempted += w.attempted;
        for (kind, n) in w.failures {
            *all.failures.entry(kind).or_default() += n;
        }
        if let Some((at, e)) = w.first_failure
            && all.first_failure.as_ref().is_none_or(|(t, _)| at < *t)
        {
            all.first_failure = Some((at, e));
        }
        all.max_lag = all.max_lag.max(w.max_lag);
        all.late += w.late;
        all.last_launch = all.last_launch.max(w.last_launch);
    }
    let launch_seconds = all
        .last_launch
        .map_or(0.0, |l| (l - t0).as_secs_f64() + 1.0 / rate);
    let mut lat = all.latencies_us;
    lat.sort_unstable();
    let pct = |p: f64| -> u64 {
        if lat.is_empty() {
            return 0;
        }
        lat[(((lat.len() as f64 - 1.0) * p).round() as usize).min(lat.len() - 1)]
    };
    let answered = lat.len() as u64;
    let (first_failure_at_s, first_error) = all.first_failure.unzip();
    Ok(PacedResult {
        rate,
        planned,
        attempted: all.attempted,
        answered,
        failed: all.failures.values().sum(),
        failures: all.failures,
        first_failure_at_s,
        first_error,
        launch_seconds,
        achieved_per_s: if launch_seconds > 0.0 {
            answered as f64 / launch_seconds
        } else {
            0.0
        },
        p50_us: pct(0.50),
        p90_us: pct(0.90),
        p99_us: pct(0.99),
        max_us: lat.last().copied().unwrap_or(0),
        slow_1s: lat.iter().filter(|&&us| us >= 900_000).count() as u64,
        max_launch_lag_us: all.max_lag.as_micros() as u64,
        late_launches: all.late,
        threads,
    })
}

/// This process's soft limit on open files (`/proc/self/limits`; 1024 if unreadable).
fn open_files_limit() -> usize {
    std::fs::read_to_string("/proc/self/limits")
        .ok()
        .and_then(|text| {
            let line = text.lines().find(|l| l.starts_with("Max open files"))?;
            let soft = line["Max open files".len()..].split_whitespace().next()?;
            Some(if soft == "unlimited" {
                usize::MAX
            } else {
                soft.parse().ok()?
            })
        })
        .unwrap_or(1024)
}
