//! Health-check node ports (`spec.healthCheckNodePort` of externalTrafficPolicy Local
//! LoadBalancer Services), like upstream `pkg/proxy/healthcheck`: a load balancer asks every node
//! and sends only to nodes answering 200, i.e. those with local endpoints.
//!
//! One small HTTP/1.1 server per port on all addresses; every request (any path) is answered with
//! `{"service":{"namespace":NS,"name":NAME},"localEndpoints":N,"serviceProxyHealthy":BOOL}` and
//! `X-Load-Balancing-Endpoint-Weight: N`, status 200 iff N > 0 and the proxy is healthy, else 503.
//! "Healthy" is evaluated per request, as upstream does: the same freshness rule as /healthz (no
//! change left unprogrammed for longer than twice syncPeriod), so a stuck agent stops attracting
//! load-balancer traffic.

use std::{
    collections::BTreeMap,
    net::{Ipv4Addr, SocketAddr},
    sync::{Arc, Mutex},
    time::{Duration, SystemTime},
};

use tokio::{
    net::{TcpListener, TcpStream},
    task::JoinHandle,
};
use tracing::{debug, error, info};

use crate::{health::HealthState, translate::HealthCheck};

/// What one port reports (the proxy's health is added when a request comes).
#[derive(Clone, Debug, PartialEq, Eq)]
struct Report {
    namespace: String,
    name: String,
    local_endpoints: usize,
}

struct Server {
    report: Arc<Mutex<Report>>,
    task: JoinHandle<()>,
}

impl Drop for Server {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// The running health-check servers, reconciled after every sync.
#[derive(Default)]
pub struct HealthCheckServers {
    servers: BTreeMap<u16, Server>,
    /// The proxy's health (/healthz's state); none known = healthy.
    proxy: Arc<HealthState>,
}

impl HealthCheckServers {
    /// Servers answering with `proxy`'s health (the agent's /healthz state).
    pub fn new(proxy: Arc<HealthState>) -> Self {
        Self {
            servers: BTreeMap::new(),
            proxy,
        }
    }

    /// Serves exactly `checks` (starting and stopping servers), with the current counts.
    /// Outside a tokio runtime (tests, benchmarks) nothing is served.
    pub fn update(&mut self, checks: &[HealthCheck]) {
        if tokio::runtime::Handle::try_current().is_err() {
            return;
        }
        let wanted: BTreeMap<u16, &HealthCheck> = checks.iter().map(|c| (c.port, c)).collect();
        self.servers.retain(|port, s| {
            let keep = wanted.contains_key(port) && !s.task.is_finished();
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
            let addr = SocketAddr::from((Ipv4Addr::UNSPECIFIED, port));
            // Bind synchronously so a taken port is reported now and retried on the next sync.
            let listener = match std::net::TcpListener::bind(addr).and_then(|l| {
                l.set_nonblocking(true)?;
                TcpListener::from_std(l)
            }) {
                Ok(l) => l,
                Err(e) => {
                    error!(port, service = %format!("{}/{}", check.namespace, check.name), "health-check node port: bind failed: {e}; retrying on the next sync");
                    continue;
                }
            };
            info!(port, service = %format!("{}/{}", check.namespace, check.name), "serving health-check node port");
            let report = Arc::new(Mutex::new(report));
            let task = tokio::spawn(serve(listener, report.clone(), self.proxy.clone()));
            self.servers.insert(port, Server { report, task });
        }
    }

    /// Ports being served.
    pub fn ports(&self) -> Vec<u16> {
        self.servers.keys().copied().collect()
    }
}

async fn serve(listener: TcpListener, report: Arc<Mutex<Report>>, proxy: Arc<HealthState>) {
    loop {
        let (stream, _) = match listener.accept().await {
            Ok(s) => s,
            Err(e) => {
                debug!("health-check accept: {e}");
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        let (report, proxy) = (report.clone(), proxy.clone());
        tokio::spawn(async move {
            // The answer does not depend on the request; read its head (bounded in size and
            // time) so closing does not reset the connection, then answer.
            let _ = tokio::time::timeout(Duration::from_secs(5), read_head(&stream)).await;
            let r = report.lock().unwrap_or_else(|e| e.into_inner()).clone();
            let healthy = proxy.health_at(SystemTime::now()).healthy;
            let _ = tokio::time::timeout(
                Duration::from_secs(5),
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
        use std::io::{Read as _, Write as _};
        let mut s = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        s.write_all(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n").unwrap();
        let mut out = String::new();
        s.read_to_string(&mut out).unwrap();
        out
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn serves_and_follows_updates_over_tcp() {
        // Port 0 is not a valid health-check port; pick a free one first.
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let check = |n| HealthCheck {
            namespace: "demo".into(),
            name: "web".into(),
            port,
            local_endpoints: n,
        };
        let proxy = Arc::new(HealthState::new(Duration::from_secs(60)));
        let mut servers = HealthCheckServers::new(proxy.clone());
        servers.update(&[check(0)]);
        assert_eq!(servers.ports(), vec![port]);
        let fetch = || tokio::task::spawn_blocking(move || get(port));
        assert!(fetch().await.unwrap().starts_with("HTTP/1.1 503 "));
        servers.update(&[check(1)]);
        assert!(fetch().await.unwrap().starts_with("HTTP/1.1 200 "));
        // A change queued longer than the health timeout ago and never programmed: the proxy is
        // stuck, the node stops attracting load-balancer traffic although it has an endpoint.
        proxy.queued_at(SystemTime::now() - Duration::from_secs(120));
        let stuck = fetch().await.unwrap();
        assert!(stuck.starts_with("HTTP/1.1 503 "), "{stuck}");
        assert!(stuck.contains("\"serviceProxyHealthy\":false"), "{stuck}");
        proxy.updated();
        assert!(fetch().await.unwrap().starts_with("HTTP/1.1 200 "));
        servers.update(&[]);
        assert!(servers.ports().is_empty());
    }
}
