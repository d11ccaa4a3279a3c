//! Health-check node ports (`spec.healthCheckNodePort` of externalTrafficPolicy Local
//! LoadBalancer Services), like upstream `pkg/proxy/healthcheck`: a load balancer asks every node
//! and sends only to nodes answering 200, i.e. those with local endpoints.
//!
//! One small HTTP/1.1 server per port, listening on the NodePort addresses only (like upstream
//! with `nodePortAddresses` set; never on 0.0.0.0, so loopback and addresses outside
//! `--nodeport-addresses` do not expose it). One [`HealthCheckServers`] per family, as upstream
//! runs one ServiceHealthServer per family's proxier: the IPv4 one on the IPv4 NodePort
//! addresses with the IPv4 family's counts, the IPv6 one on the IPv6 NodePort addresses with the
//! IPv6 family's (a dual-stack Service's port answers on both, each with its own family's local
//! endpoints). Every request (any path) is answered with
//! `{"service":{"namespace":NS,"name":NAME},"localEndpoints":N,"serviceProxyHealthy":BOOL}` and
//! `X-Load-Balancing-Endpoint-Weight: N`, status 200 iff N > 0 and the proxy is healthy, else 503.
//! "Healthy" is evaluated per request, as upstream does: the same freshness rule as /healthz (no
//! change left unprogrammed for longer than twice syncPeriod), so a stuck agent stops attracting
//! load-balancer traffic.
//!
//! Bounded: at most [`MAX_CONNECTIONS`] connections per port are served at once (more are closed
//! at once, unanswered), and each one gets [`READ_TIMEOUT`] to send its request head and
//! [`WRITE_TIMEOUT`] to take the answer, so idle or slow clients cannot pile up tasks and sockets.

use std::{
    collections::BTreeMap,
    net::{IpAddr, Ipv4Addr, SocketAddr},
    sync::{Arc, Mutex},
    time::{Duration, SystemTime},
};

use tokio::{
    net::{TcpListener, TcpStream},
    sync::Semaphore,
    task::JoinHandle,
};
use tracing::{debug, error, info};

use crate::{pipeline::translate::HealthCheck, serving::health::HealthState};

/// What one port reports (the proxy's health is added when a request comes).
#[derive(Clone, Debug, PartialEq, Eq)]
struct Report {
    namespace: String,
    name: String,
    local_endpoints: usize,
}

/// Connections one health-check port serves at the same time.
pub const MAX_CONNECTIONS: usize = 64;
/// Time a client has to send its request head (the answer does not depend on it).
pub const READ_TIMEOUT: Duration = Duration::from_secs(5);
/// Time a client has to take the answer.
pub const WRITE_TIMEOUT: Duration = Duration::from_secs(5);

struct Server<A> {
    report: Arc<Mutex<Report>>,
    /// The addresses listened on (the NodePort addresses when the server started).
    addrs: Vec<A>,
    /// One accept loop per address.
    tasks: Vec<JoinHandle<()>>,
}

impl<A> Server<A> {
    fn is_finished(&self) -> bool {
        self.tasks.iter().any(|t| t.is_finished())
    }
}

impl<A> Drop for Server<A> {
    fn drop(&mut self) {
        for t in &self.tasks {
            t.abort();
        }
    }
}

/// The running health-check servers of one address family (`A`: [`Ipv4Addr`] or
/// [`std::net::Ipv6Addr`]), reconciled after every sync.
pub struct HealthCheckServers<A = Ipv4Addr> {
    servers: BTreeMap<u16, Server<A>>,
    /// The proxy's health (/healthz's state); none known = healthy.
    proxy: Arc<HealthState>,
    /// The last update left a wanted port without a server (retried by the next update).
    incomplete: bool,
}

impl<A: Copy + Eq + Into<IpAddr>> HealthCheckServers<A> {
    /// Servers answering with `proxy`'s health (the agent's /healthz state).
    pub fn new(proxy: Arc<HealthState>) -> Self {
        Self {
            servers: BTreeMap::new(),
            proxy,
            incomplete: false,
        }
    }

    /// Whether [`HealthCheckServers::update`] with the same checks on `addrs` would change
    /// nothing: every wanted port served, no server stopped, none on other addresses. (The
    /// agent calls `update` only when this is false or the checks changed.)
    pub fn settled(&self, addrs: &[A]) -> bool {
        !self.incomplete && (self.servers.values()).all(|s| !s.is_finished() && s.addrs == addrs)
    }

    /// Serves exactly `checks` (starting and stopping servers), with the current counts, on
    /// `addrs` (the NodePort addresses; a server whose addresses changed is started again).
    /// Outside a tokio runtime (tests, benchmarks) nothing is served.
    pub fn update(&mut self, checks: &[HealthCheck], addrs: &[A]) {
        if tokio::runtime::Handle::try_current().is_err() {
            return;
        }
        let wanted: BTreeMap<u16, &HealthCheck> = checks.iter().map(|c| (c.port, c)).collect();
        self.incomplete = false;
        self.servers.retain(|port, s| {
            let keep = wanted.contains_key(port) && !s.is_finished() && s.addrs == addrs;
            if !keep {
                info!(port, "health-check node port closed");
            }
            keep
        });
        for (port, check) in wanted {
            let report = Report {
                namespace: check.namespace.clone(),
                name: check.name.clone(),
                local_endpoints: check.local_endpoints,
            };
            if let Some(s) = self.servers.get(&port) {
                let mut current = s.report.lock().unwrap_or_else(|e| e.into_inner());
                if *current != report {
                    debug!(
                        port,
                        local_endpoints = report.local_endpoints,
                        "health-check report"
                    );
                    *current = report;
                }
                continue;
            }
            let service = format!("{}/{}", check.namespace, check.name);
            if addrs.is_empty() {
                error!(port, %service, "health-check node port: no NodePort address to listen on; retrying on the next sync");
                self.incomplete = true;
                continue;
            }
            // Bind synchronously so a taken port is reported now and retried on the next sync.
            let listeners: Result<Vec<TcpListener>, _> = addrs
                .iter()
                .map(|&a| {
                    std::net::TcpListener::bind(SocketAddr::new(a.into(), port)).and_then(|l| {
                        l.set_nonblocking(true)?;
                        TcpListener::from_std(l)
                    })
                })
                .collect();
            let listeners = match listeners {
                Ok(l) => l,
                Err(e) => {
                    error!(port, %service, "health-check node port: bind failed: {e}; retrying on the next sync");
                    self.incomplete = true;
                    continue;
                }
            };
            let shown: Vec<IpAddr> = addrs.iter().map(|&a| a.into()).collect();
            info!(port, %service, addrs = ?shown, "serving health-check node port");
            let report = Arc::new(Mutex::new(report));
            let permits = Arc::new(Semaphore::new(MAX_CONNECTIONS));
            let tasks = listeners
                .into_iter()
                .map(|l| {
                    tokio::spawn(serve(
                        l,
                        report.clone(),
                        self.proxy.clone(),
                        permits.clone(),
                    ))
                })
                .collect();
            self.servers.insert(
                port,
                Server {
                    report,
                    addrs: addrs.to_vec(),
                    tasks,
                },
            );
        }
    }

    /// Ports being served.
    pub fn ports(&self) -> Vec<u16> {
        self.servers.keys().copied().collect()
    }
}

async fn serve(
    listener: TcpListener,
    report: Arc<Mutex<Report>>,
    proxy: Arc<HealthState>,
    permits: Arc<Semaphore>,
) {
    loop {
        let (stream, peer) = match listener.accept().await {
            Ok(s) => s,
            Err(e) => {
                debug!("health-check accept: {e}");
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        let Ok(permit) = permits.clone().try_acquire_owned() else {
            debug!(%peer, "health-check node port: {MAX_CONNECTIONS} connections open; closing this one");
            drop(stream);
            continue;
        };
        let (report, proxy) = (report.clone(), proxy.clone());
        tokio::spawn(async move {
            let _permit = permit;
            // The answer does not depend on the request; read its head (bounded in size and
            // time) so closing does not reset the connection, then answer.
            let _ = tokio::time::timeout(READ_TIMEOUT, read_head(&stream)).await;
            let r = report.lock().unwrap_or_else(|e| e.into_inner()).clone();
            let healthy = proxy.health_at(SystemTime::now()).healthy;
            let _ = tokio::time::timeout(
                WRITE_TIMEOUT,
                write_all(&stream, response(&r, healthy).as_bytes()),
            )
            .await;
        });
    }
}

async fn read_head(stream: &TcpStream) {
    let mut buf = [0u8; 4096];
    let mut seen = 0;
    while seen < buf.len() {
        if stream.readable().await.is_err() {
            return;
        }
        match stream.try_read(&mut buf[seen..]) {
            Ok(0) => return,
            Ok(n) => seen += n,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => continue,
            Err(_) => return,
        }
        if buf[..seen].windows(4).any(|w| w == b"\r\n\r\n") {
            return;
        }
    }
}

async fn write_all(stream: &TcpStream, mut bytes: &[u8]) {
    while !bytes.is_empty() {
        if stream.writable().await.is_err() {
            return;
        }
        match stream.try_write(bytes) {
            Ok(n) => bytes = &bytes[n..],
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => continue,
            Err(_) => return,
        }
    }
}

/// The full HTTP response for a report and the proxy's health.
fn response(r: &Report, healthy: bool) -> String {
    let body = serde_json::json!({
        "service": {"namespace": r.namespace, "name": r.name},
        "localEndpoints": r.local_endpoints,
        "serviceProxyHealthy": healthy,
    })
    .to_string();
    let status = if r.local_endpoints > 0 && healthy {
        "200 OK"
    } else {
        "503 Service Unavailable"
    };
    format!(
        "HTTP/1.1 {status}\r\nContent-Type: application/json\r\nX-Content-Type-Options: nosniff\r\nX-Load-Balancing-Endpoint-Weight: {}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        r.local_endpoints,
        body.len()
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn report(n: usize) -> Report {
        Report {
            namespace: "demo".into(),
            name: "web".into(),
            local_endpoints: n,
        }
    }

    #[test]
    fn status_and_body_follow_upstream() {
        let ok = response(&report(2), true);
        assert!(ok.starts_with("HTTP/1.1 200 OK\r\n"), "{ok}");
        assert!(
            ok.contains("X-Load-Balancing-Endpoint-Weight: 2\r\n"),
            "{ok}"
        );
        let body = ok.split("\r\n\r\n").nth(1).unwrap();
        let v: serde_json::Value = serde_json::from_str(body).unwrap();
        assert_eq!(
            v,
            serde_json::json!({"service":{"namespace":"demo","name":"web"},"localEndpoints":2,"serviceProxyHealthy":true})
        );
        assert!(response(&report(0), true).starts_with("HTTP/1.1 503 "));
        let stuck = response(&report(3), false);
        assert!(stuck.starts_with("HTTP/1.1 503 "), "{stuck}");
        assert!(stuck.contains("\"serviceProxyHealthy\":false"), "{stuck}");
    }

    /// A blocking GET (the server runs on the test's multi-thread runtime).
    fn get(port: u16) -> String {
        get_from(Ipv4Addr::LOCALHOST, port).unwrap()
    }

    fn get_from(addr: Ipv4Addr, port: u16) -> std::io::Result<String> {
        use std::io::{Read as _, Write as _};
        let mut s = std::net::TcpStream::connect((addr, port))?;
        s.set_read_timeout(Some(Duration::from_secs(5)))?;
        s.write_all(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")?;
        let mut out = String::new();
        s.read_to_string(&mut out)?;
        Ok(out)
    }

    fn free_port() -> u16 {
        std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port()
    }

    fn check(port: u16, n: usize) -> HealthCheck {
        HealthCheck {
            namespace: "demo".into(),
            name: "web".into(),
            port,
            local_endpoints: n,
        }
    }

    /// Listening on the NodePort addresses only: 127.0.0.2 (also loopback, so reachable on a
    /// wildcard socket) is refused while 127.0.0.1 answers; a new address set moves the server.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn listens_on_the_nodeport_addresses_only() {
        let port = free_port();
        let (one, two) = (Ipv4Addr::new(127, 0, 0, 1), Ipv4Addr::new(127, 0, 0, 2));
        let mut servers =
            HealthCheckServers::new(Arc::new(HealthState::new(Duration::from_secs(60))));
        servers.update(&[check(port, 1)], &[one]);
        let fetch = |a| tokio::task::spawn_blocking(move || get_from(a, port));
        assert!(
            fetch(one)
                .await
                .unwrap()
                .unwrap()
                .starts_with("HTTP/1.1 200 ")
        );
        let refused = fetch(two).await.unwrap();
        assert!(
            refused
                .as_ref()
                .is_err_and(|e| e.kind() == std::io::ErrorKind::ConnectionRefused),
            "{two} is not a NodePort address: {refused:?}"
        );
        servers.update(&[check(port, 1)], &[two]);
        assert!(
            fetch(two)
                .await
                .unwrap()
                .unwrap()
                .starts_with("HTTP/1.1 200 ")
        );
        assert!(fetch(one).await.unwrap().is_err(), "moved off {one}");
        servers.update(&[check(port, 1)], &[]);
        assert!(
            servers.ports().is_empty(),
            "no NodePort address: nothing served"
        );
    }

    /// At most MAX_CONNECTIONS connections are served at once: with that many idle clients
    /// holding the port, one more is closed unanswered; once they leave, requests are answered.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn concurrent_connections_are_bounded() {
        use std::io::Read as _;
        let port = free_port();
        let mut servers =
            HealthCheckServers::new(Arc::new(HealthState::new(Duration::from_secs(60))));
        servers.update(&[check(port, 1)], &[Ipv4Addr::LOCALHOST]);
        let (idle, extra) = tokio::task::spawn_blocking(move || {
            let idle: Vec<std::net::TcpStream> = (0..MAX_CONNECTIONS)
                .map(|_| std::net::TcpStream::connect(("127.0.0.1", port)).unwrap())
                .collect();
            // The server takes the idle ones in accept order, so the next one is over the limit
            // once it is accepted: it is closed without an answer (EOF or reset, no bytes).
            let mut extra = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
            extra
                .set_read_timeout(Some(Duration::from_secs(4)))
                .unwrap();
            let mut buf = Vec::new();
            let got = extra.read_to_end(&mut buf);
            (idle, (got.map_err(|e| e.kind()), buf))
        })
        .await
        .unwrap();
        assert!(
            extra.1.is_empty()
                && matches!(extra.0, Ok(_) | Err(std::io::ErrorKind::ConnectionReset)),
            "the connection over the limit must be closed unanswered: {extra:?}"
        );
        drop(idle);
        // The idle clients' tasks see EOF and give their permits back.
        let mut answered = false;
        for _ in 0..50 {
            let reply = tokio::task::spawn_blocking(move || get_from(Ipv4Addr::LOCALHOST, port))
                .await
                .unwrap();
            if reply.is_ok_and(|r| r.starts_with("HTTP/1.1 200 ")) {
                answered = true;
                break;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        assert!(
            answered,
            "requests are answered again once the idle clients left"
        );
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn serves_and_follows_updates_over_tcp() {
        // Port 0 is not a valid health-check port; pick a free one first.
        let port = free_port();
        let check = |n| check(port, n);
        let proxy = Arc::new(HealthState::new(Duration::from_secs(60)));
        let mut servers = HealthCheckServers::new(proxy.clone());
        let local = [Ipv4Addr::LOCALHOST];
        servers.update(&[check(0)], &local);
        assert_eq!(servers.ports(), vec![port]);
        let fetch = || tokio::task::spawn_blocking(move || get(port));
        assert!(fetch().await.unwrap().starts_with("HTTP/1.1 503 "));
        servers.update(&[check(1)], &local);
        assert!(fetch().await.unwrap().starts_with("HTTP/1.1 200 "));
        // A change queued longer than the health timeout ago and never programmed: the proxy is
        // stuck, the node stops attracting load-balancer traffic although it has an endpoint.
        proxy.queued_at(SystemTime::now() - Duration::from_secs(120));
        let stuck = fetch().await.unwrap();
        assert!(stuck.starts_with("HTTP/1.1 503 "), "{stuck}");
        assert!(stuck.contains("\"serviceProxyHealthy\":false"), "{stuck}");
        proxy.updated();
        assert!(fetch().await.unwrap().starts_with("HTTP/1.1 200 "));
        servers.update(&[], &local);
        assert!(servers.ports().is_empty());
    }
}
