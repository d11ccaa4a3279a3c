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
    let result = run_load(args)?;
    println!("{}", result.to_json());
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

fn request(target: SocketAddrV4, timeout: Duration) -> std::io::Result<()> {
    let mut s = TcpStream::connect_timeout(&SocketAddr::V4(target), timeout)?;
    s.set_read_timeout(Some(timeout))?;
    s.set_write_timeout(Some(timeout))?;
    s.set_nodelay(true)?;
    s.write_all(b"GET / HTTP/1.1\r\nHost: bench\r\nConnection: close\r\n\r\n")?;
    let mut buf = [0u8; 1024];
    let mut have = 0usize;
    loop {
        let n = s.read(&mut buf[have..])?;
        if n == 0 {
            break;
        }
        have = (have + n).min(buf.len() - 1);
    }
    if !buf[..have].starts_with(b"HTTP/1.1 200") {
        return Err(std::io::Error::other(format!(
            "bad response ({have} bytes)"
        )));
    }
    Ok(())
}
