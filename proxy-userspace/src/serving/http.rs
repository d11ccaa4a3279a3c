//! The small HTTP/1 server under `/healthz`, `/livez` and `/metrics`: accept loop, the reply
//! headers upstream sets, and binding with retries while kube-proxy still holds the port.
//!
//! Owns no endpoint's semantics (those are [`crate::serving::health`]'s and [`crate::serving::metrics`]'s, which
//! call it); calls nothing else in the crate.

use std::{convert::Infallible, net::SocketAddr, time::Duration};

use http_body_util::Full;
use hyper::{Request, Response, StatusCode, body::Bytes, header, service::service_fn};
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::net::TcpListener;
use tracing::{debug, error, info};

/// How long to wait before retrying a failed bind (the port may still be held by kube-proxy).
const BIND_RETRY: Duration = Duration::from_secs(5);
/// Slow clients are cut off after this long without a complete request head.
const HEADER_TIMEOUT: Duration = Duration::from_secs(10);

/// A response with the headers upstream sets.
pub(crate) fn reply(code: StatusCode, content_type: &str, body: String) -> Response<Full<Bytes>> {
    let mut r = Response::new(Full::new(Bytes::from(body)));
    *r.status_mut() = code;
    if let Ok(v) = content_type.parse() {
        r.headers_mut().insert(header::CONTENT_TYPE, v);
    }
    r.headers_mut().insert(
        header::X_CONTENT_TYPE_OPTIONS,
        header::HeaderValue::from_static("nosniff"),
    );
    r
}

/// A minimal HTTP/1 server: every request is answered by `handle` (GET-only semantics; bodies
/// are ignored). One task per connection on the caller's runtime.
pub(crate) async fn serve<F>(listener: TcpListener, handle: F)
where
    F: Fn(&Request<hyper::body::Incoming>) -> Response<Full<Bytes>> + Clone + Send + Sync + 'static,
{
    loop {
        let stream = match listener.accept().await {
            Ok((s, _)) => s,
            Err(e) => {
                debug!("accept: {e}");
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        let handle = handle.clone();
        tokio::spawn(async move {
            let svc = service_fn(move |req| {
                let resp = handle(&req);
                async move { Ok::<_, Infallible>(resp) }
            });
            let conn = hyper::server::conn::http1::Builder::new()
                .timer(TokioTimer::new())
                .header_read_timeout(HEADER_TIMEOUT)
                .serve_connection(TokioIo::new(stream), svc);
            if let Err(e) = conn.await {
                debug!("http connection: {e}");
            }
        });
    }
}

/// Binds `addr`, retrying every few seconds with an error log while it is taken (like upstream,
/// which keeps proxying and retries: the port may still be held by kube-proxy during a switch).
pub async fn bind_with_retry(what: &str, addr: SocketAddr) -> TcpListener {
    let mut logged = false;
    loop {
        let bound = match dual_stack(addr) {
            Some(Ok(l)) => Ok(l),
            // No IPv6 on this node: the IPv4 wildcard alone.
            Some(Err(_)) | None => TcpListener::bind(addr).await,
        };
        match bound {
            Ok(l) => {
                let shown = l.local_addr().unwrap_or(addr);
                info!("{what} serving on http://{shown}");
                return l;
            }
            Err(e) => {
                if !logged {
                    error!(
                        "{what}: cannot listen on {addr}: {e}; retrying every {BIND_RETRY:?} (is kube-proxy still running on this node?)"
                    );
                    logged = true;
                }
                tokio::time::sleep(BIND_RETRY).await;
            }
        }
    }
}

/// For the IPv4 wildcard (`0.0.0.0:port`), a listener on `[::]:port` that also accepts IPv4
/// (IPV6_V6ONLY off whatever `net.ipv6.bindv6only` says), as Go's listener on `0.0.0.0` is and
/// kube-proxy's /healthz therefore answers on both families. `None` for any other address.
fn dual_stack(addr: SocketAddr) -> Option<std::io::Result<TcpListener>> {
    use nix::sys::socket::{
        AddressFamily, Backlog, SockFlag, SockType, SockaddrIn6, bind, listen, setsockopt, socket,
        sockopt,
    };
    let SocketAddr::V4(v4) = addr else {
        return None;
    };
    if !v4.ip().is_unspecified() {
        return None;
    }
    let listener = (|| -> nix::Result<std::net::TcpListener> {
        let fd = socket(
            AddressFamily::Inet6,
            SockType::Stream,
            SockFlag::SOCK_CLOEXEC | SockFlag::SOCK_NONBLOCK,
            None,
        )?;
        setsockopt(&fd, sockopt::ReuseAddr, &true)?;
        setsockopt(&fd, sockopt::Ipv6V6Only, &false)?;
        let any = std::net::SocketAddrV6::new(std::net::Ipv6Addr::UNSPECIFIED, v4.port(), 0, 0);
        bind(
            std::os::fd::AsRawFd::as_raw_fd(&fd),
            &SockaddrIn6::from(any),
        )?;
        listen(&fd, Backlog::new(1024)?)?;
        Ok(std::net::TcpListener::from(fd))
    })();
    Some(
        listener
            .map_err(std::io::Error::from)
            .and_then(TcpListener::from_std),
    )
}

/// A plain HTTP/1.1 GET over a real TCP connection, for tests (blocking std I/O on a worker).
#[cfg(test)]
pub(crate) mod test_http {
    use std::{
        io::{Read as _, Write as _},
        net::{SocketAddr, TcpStream},
    };

    /// Returns (status code, response head, body).
    pub async fn get(addr: SocketAddr, path: &str, accept: &str) -> (u16, String, String) {
        let req = format!(
            "GET {path} HTTP/1.1\r\nHost: {addr}\r\nAccept: {accept}\r\nConnection: close\r\n\r\n"
        );
        tokio::task::spawn_blocking(move || {
            let mut s = TcpStream::connect(addr).expect("connect");
            s.write_all(req.as_bytes()).expect("write");
            let mut buf = String::new();
            s.read_to_string(&mut buf).expect("read");
            let (head, body) = buf.split_once("\r\n\r\n").expect("an HTTP response");
            let code = head[9..12].parse().expect("status code");
            (code, head.to_owned(), body.to_owned())
        })
        .await
        .expect("client thread")
    }
}

#[cfg(test)]
mod tests {
    use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

    use super::*;

    #[tokio::test]
    async fn the_ipv4_wildcard_listens_on_both_families_like_go() {
        let l = bind_with_retry("test", (Ipv4Addr::UNSPECIFIED, 0).into()).await;
        let port = l.local_addr().expect("addr").port();
        tokio::spawn(serve(l, |_| {
            reply(StatusCode::OK, "text/plain", "ok".into())
        }));
        for ip in [
            IpAddr::V4(Ipv4Addr::LOCALHOST),
            IpAddr::V6(Ipv6Addr::LOCALHOST),
        ] {
            let (code, _, body) = test_http::get((ip, port).into(), "/", "*/*").await;
            assert_eq!((code, body.as_str()), (200, "ok"), "over {ip}");
        }
        let l = bind_with_retry("test", (Ipv4Addr::LOCALHOST, 0).into()).await;
        assert!(
            l.local_addr().expect("addr").is_ipv4(),
            "a given address stays itself"
        );
    }
}
