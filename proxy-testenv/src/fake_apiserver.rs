//! An in-process fake Kubernetes API server for the kube source's tests.
//!
//! It speaks just enough of the API for list+watch clients (kube-rs reflectors, client-go
//! informers): `GET` list and `?watch=true` on `/api/v1/services`,
//! `/apis/discovery.k8s.io/v1/endpointslices`, `/api/v1/nodes`, `/apis/apps/v1/daemonsets`
//! (cluster-wide, or one namespace's `.../namespaces/{ns}/{plural}`; `GET` of one namespaced
//! object by name too), with
//! `labelSelector` (`k`, `!k`, `k=v`, `k!=v`), `fieldSelector` (`metadata.name`,
//! `metadata.namespace`), `limit`/`continue` paging, `resourceVersion`, `timeoutSeconds`,
//! BOOKMARK events when `allowWatchBookmarks=true`, and "410 Gone" (an ERROR event with code 410,
//! "too old resource version") for watches from a compacted resourceVersion. Events
//! (events.k8s.io/v1) can be created (`POST .../namespaces/{ns}/events`) and patched (`PATCH
//! .../events/{name}`, a series update); they are recorded for the test ([`FakeApiServer::events`])
//! and not served back. Plain HTTP/1.1 on 127.0.0.1, one thread per connection (std only: small
//! and quick to build).
//!
//! The test drives it through [`FakeApiServer`]: create/update/delete objects (JSON values),
//! drop every connection mid-stream, expire watches (410), stop (connections refused) and start
//! again on the same port. It can listen inside a network namespace (the agent's node), without
//! the test process leaving the root namespace: only the listening socket is created in there.
//!
//! Network safety: it binds 127.0.0.1 only (of the root namespace, or of the given namespace).

use std::{
    collections::{BTreeMap, HashMap, VecDeque},
    fs::File,
    io::{self, BufRead as _, BufReader, Read as _, Write as _},
    net::{Shutdown, TcpListener, TcpStream},
    path::{Path, PathBuf},
    sync::{
        Arc, Condvar, Mutex, MutexGuard,
        atomic::{AtomicBool, AtomicU64, Ordering},
    },
    thread::{self, JoinHandle},
    time::{Duration, Instant},
};

use anyhow::{Context as _, Result, bail};
use serde_json::{Value, json};

/// The resources served.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Kind {
    Service,
    EndpointSlice,
    Node,
    ServiceCidr,
    DaemonSet,
}

impl Kind {
    const ALL: [Kind; 5] = [
        Kind::Service,
        Kind::EndpointSlice,
        Kind::Node,
        Kind::ServiceCidr,
        Kind::DaemonSet,
    ];

    pub fn path(self) -> &'static str {
        match self {
            Kind::Service => "/api/v1/services",
            Kind::EndpointSlice => "/apis/discovery.k8s.io/v1/endpointslices",
            Kind::Node => "/api/v1/nodes",
            Kind::ServiceCidr => "/apis/networking.k8s.io/v1/servicecidrs",
            Kind::DaemonSet => "/apis/apps/v1/daemonsets",
        }
    }

    pub fn api_version(self) -> &'static str {
        match self {
            Kind::Service | Kind::Node => "v1",
            Kind::EndpointSlice => "discovery.k8s.io/v1",
            Kind::ServiceCidr => "networking.k8s.io/v1",
            Kind::DaemonSet => "apps/v1",
        }
    }

    pub fn kind(self) -> &'static str {
        match self {
            Kind::Service => "Service",
            Kind::EndpointSlice => "EndpointSlice",
            Kind::Node => "Node",
            Kind::ServiceCidr => "ServiceCIDR",
            Kind::DaemonSet => "DaemonSet",
        }
    }

    /// Nodes and ServiceCIDRs have no namespace.
    fn cluster_scoped(self) -> bool {
        matches!(self, Kind::Node | Kind::ServiceCidr)
    }

    fn from_kind(kind: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|k| k.kind() == kind)
    }

    /// The kind a request path names, and for a namespaced path
    /// (`<group>/namespaces/{ns}/{plural}[/{name}]`) its namespace and object name.
    fn route(path: &str) -> Option<(Self, Option<String>, Option<String>)> {
        Self::ALL.into_iter().find_map(|k| {
            if k.path() == path {
                return Some((k, None, None));
            }
            let (group, plural) = k.path().rsplit_once('/')?;
            let rest = path.strip_prefix(group)?.strip_prefix("/namespaces/")?;
            let mut parts = rest.split('/');
            let (ns, p) = (parts.next()?, parts.next()?);
            let name = parts.next().map(str::to_owned);
            (p == plural && parts.next().is_none() && !k.cluster_scoped())
                .then(|| (k, Some(ns.to_owned()), name))
        })
    }
}

/// (kind, namespace, name); cluster-scoped objects have an empty namespace.
type Key = (Kind, String, String);

#[derive(Clone)]
struct Change {
    rv: u64,
    kind: Kind,
    /// The object before (None: created).
    old: Option<Arc<Value>>,
    /// The object after (None: deleted).
    new: Option<Arc<Value>>,
}

#[derive(Default)]
struct State {
    rv: u64,
    objects: BTreeMap<Key, Arc<Value>>,
    history: VecDeque<Change>,
    /// Watches from a resourceVersion older than this get 410 Gone.
    compacted: u64,
    /// Bumped to end every open watch (connections dropped, server stopped).
    epoch: u64,
    /// Bumped to end every open watch with a 410 ERROR event.
    expiry: u64,
}

struct Shared {
    state: Mutex<State>,
    cond: Condvar,
    conns: Mutex<HashMap<u64, TcpStream>>,
    next_conn: AtomicU64,
    requests: Mutex<Vec<String>>,
    /// Events created and patched, in arrival order.
    events: Mutex<Vec<RecordedEvent>>,
    bookmark_interval: Duration,
    /// Kinds answered 404 (an older API server without them).
    unserved: Mutex<Vec<Kind>>,
}

/// An Event the client created or patched.
#[derive(Clone, Debug)]
pub struct RecordedEvent {
    /// `POST` (created) or `PATCH` (a series update of an earlier one).
    pub method: String,
    pub namespace: String,
    pub body: Value,
}

/// The events.k8s.io/v1 collection of a namespace.
const EVENTS_PREFIX: &str = "/apis/events.k8s.io/v1/namespaces/";

impl Shared {
    fn state(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// The running (or stopped) fake API server. Drop stops it.
pub struct FakeApiServer {
    shared: Arc<Shared>,
    netns: Option<PathBuf>,
    port: u16,
    running: Option<(Arc<AtomicBool>, JoinHandle<()>)>,
}

impl FakeApiServer {
    /// Starts on 127.0.0.1:<ephemeral port> in this process's network namespace.
    pub fn start() -> Result<Self> {
        Self::start_in(None)
    }

    /// Starts on 127.0.0.1 inside the network namespace at `netns` (e.g. `/var/run/netns/X`),
    /// reachable only from processes in that namespace.
    pub fn start_in(netns: Option<&Path>) -> Result<Self> {
        let mut server = Self {
            shared: Arc::new(Shared {
                state: Mutex::new(State::default()),
                cond: Condvar::new(),
                conns: Mutex::new(HashMap::new()),
                next_conn: AtomicU64::new(0),
                requests: Mutex::new(Vec::new()),
                events: Mutex::new(Vec::new()),
                bookmark_interval: Duration::from_secs(2),
                unserved: Mutex::new(Vec::new()),
            }),
            netns: netns.map(Path::to_path_buf),
            port: 0,
            running: None,
        };
        server.resume()?;
        Ok(server)
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    pub fn url(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    /// Writes a kubeconfig pointing at this server (no credentials) and returns its path.
    pub fn write_kubeconfig(&self, path: &Path) -> Result<PathBuf> {
        let text = format!(
            "apiVersion: v1\nkind: Config\nclusters:\n- name: fake\n  cluster:\n    server: {}\n\
             users:\n- name: fake\n  user: {{}}\ncontexts:\n- name: fake\n  context:\n    \
             cluster: fake\n    user: fake\ncurrent-context: fake\n",
            self.url()
        );
        std::fs::write(path, text).with_context(|| format!("writing {}", path.display()))?;
        Ok(path.to_path_buf())
    }

    /// Listens again (same port after the first start). No-op when running.
    pub fn resume(&mut self) -> Result<()> {
        if self.running.is_some() {
            return Ok(());
        }
        let listener = bind_in(self.netns.as_deref(), self.port)?;
        self.port = listener.local_addr()?.port();
        listener.set_nonblocking(true)?;
        let stop = Arc::new(AtomicBool::new(false));
        let shared = self.shared.clone();
        let stop2 = stop.clone();
        let acceptor = thread::Builder::new()
            .name("fake-apiserver".into())
            .spawn(move || accept_loop(&listener, &shared, &stop2))?;
        self.running = Some((stop, acceptor));
        Ok(())
    }

    /// Stops listening and closes every connection: clients see "connection refused" until
    /// [`FakeApiServer::resume`]. The objects are kept (and may be changed meanwhile).
    pub fn stop(&mut self) {
        if let Some((stop, acceptor)) = self.running.take() {
            stop.store(true, Ordering::SeqCst);
            let _ = acceptor.join();
        }
        self.drop_connections();
    }

    /// Closes every open connection mid-stream (watches resume from their resourceVersion).
    pub fn drop_connections(&self) {
        {
            let mut st = self.shared.state();
            st.epoch += 1;
        }
        self.shared.cond.notify_all();
        let conns = self.shared.conns.lock().unwrap_or_else(|e| e.into_inner());
        for stream in conns.values() {
            let _ = stream.shutdown(Shutdown::Both);
        }
    }

    /// Forgets the event history and ends every open watch with a 410 Gone ERROR event, so
    /// clients must relist.
    pub fn expire_watches(&self) {
        {
            let mut st = self.shared.state();
            st.compacted = st.rv;
            st.history.clear();
            st.expiry += 1;
        }
        self.shared.cond.notify_all();
    }

    /// Creates or replaces an object (kind, namespace and name from the JSON). Returns its new
    /// resourceVersion.
    pub fn apply(&self, mut obj: Value) -> Result<u64> {
        let kind_str = obj["kind"].as_str().unwrap_or_default().to_owned();
        let kind =
            Kind::from_kind(&kind_str).with_context(|| format!("unsupported kind {kind_str:?}"))?;
        let name = obj["metadata"]["name"]
            .as_str()
            .context("object without metadata.name")?
            .to_owned();
        let namespace = if kind.cluster_scoped() {
            String::new()
        } else {
            let ns = obj["metadata"]["namespace"].as_str().unwrap_or("default");
            ns.to_owned()
        };
        if !kind.cluster_scoped() {
            obj["metadata"]["namespace"] = json!(namespace);
        }
        obj["apiVersion"] = json!(kind.api_version());
        let rv = {
            let mut st = self.shared.state();
            st.rv += 1;
            let rv = st.rv;
            obj["metadata"]["resourceVersion"] = json!(rv.to_string());
            let new = Arc::new(obj);
            let old = st.objects.insert((kind, namespace, name), new.clone());
            st.history.push_back(Change {
                rv,
                kind,
                old,
                new: Some(new),
            });
            rv
        };
        self.shared.cond.notify_all();
        Ok(rv)
    }

    /// Applies many objects (one event each).
    pub fn apply_all(&self, objs: impl IntoIterator<Item = Value>) -> Result<()> {
        for obj in objs {
            self.apply(obj)?;
        }
        Ok(())
    }

    /// Deletes an object; false if it did not exist.
    pub fn delete(&self, kind: Kind, namespace: &str, name: &str) -> bool {
        let ns = if kind.cluster_scoped() { "" } else { namespace };
        let deleted = {
            let mut st = self.shared.state();
            match st.objects.remove(&(kind, ns.to_owned(), name.to_owned())) {
                Some(old) => {
                    st.rv += 1;
                    let rv = st.rv;
                    // The DELETED event carries the last state with the deletion's version.
                    let mut gone = (*old).clone();
                    gone["metadata"]["resourceVersion"] = json!(rv.to_string());
                    st.history.push_back(Change {
                        rv,
                        kind,
                        old: Some(Arc::new(gone)),
                        new: None,
                    });
                    true
                }
                None => false,
            }
        };
        self.shared.cond.notify_all();
        deleted
    }

    /// The stored object, if any.
    pub fn get(&self, kind: Kind, namespace: &str, name: &str) -> Option<Value> {
        let ns = if kind.cluster_scoped() { "" } else { namespace };
        self.shared
            .state()
            .objects
            .get(&(kind, ns.to_owned(), name.to_owned()))
            .map(|v| (**v).clone())
    }

    /// The latest resourceVersion.
    pub fn resource_version(&self) -> u64 {
        self.shared.state().rv
    }

    /// Request lines served so far (`GET /api/v1/services?...`), oldest first.
    pub fn requests(&self) -> Vec<String> {
        self.shared
            .requests
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// Events created (`POST`) and patched (`PATCH`) so far, oldest first.
    pub fn events(&self) -> Vec<RecordedEvent> {
        self.shared
            .events
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// From now on, requests for `kind` get 404 Not Found, as from an API server that does not
    /// serve it (e.g. ServiceCIDR before Kubernetes 1.33).
    pub fn unserve(&self, kind: Kind) {
        self.shared
            .unserved
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(kind);
    }

    /// How many list (non-watch) requests were served for `kind`.
    pub fn list_count(&self, kind: Kind) -> usize {
        self.requests()
            .iter()
            .filter(|r| {
                let path = r.split_whitespace().nth(1).unwrap_or_default();
                let (p, q) = path.split_once('?').unwrap_or((path, ""));
                p == kind.path() && !q.contains("watch=true") && !q.contains("continue=")
            })
            .count()
    }
}

impl Drop for FakeApiServer {
    fn drop(&mut self) {
        self.stop();
    }
}

/// Binds 127.0.0.1:`port`, inside `netns` when given (from a short-lived thread that entered
/// it: the socket stays in that namespace, the rest of the process does not move).
fn bind_in(netns: Option<&Path>, port: u16) -> Result<TcpListener> {
    let Some(netns) = netns else {
        return Ok(TcpListener::bind(("127.0.0.1", port))?);
    };
    let netns = netns.to_path_buf();
    thread::spawn(move || -> Result<TcpListener> {
        let ns = File::open(&netns).with_context(|| format!("opening {}", netns.display()))?;
        // Moves only this thread, which ends after binding.
        nix::sched::setns(&ns, nix::sched::CloneFlags::CLONE_NEWNET)
            .with_context(|| format!("entering {}", netns.display()))?;
        Ok(TcpListener::bind(("127.0.0.1", port))?)
    })
    .join()
    .map_err(|_| anyhow::anyhow!("bind thread panicked"))?
}

fn accept_loop(listener: &TcpListener, shared: &Arc<Shared>, stop: &AtomicBool) {
    while !stop.load(Ordering::SeqCst) {
        match listener.accept() {
            Ok((stream, _)) => {
                let _ = stream.set_nonblocking(false);
                let _ = stream.set_nodelay(true);
                let id = shared.next_conn.fetch_add(1, Ordering::Relaxed);
                if let Ok(clone) = stream.try_clone() {
                    shared
                        .conns
                        .lock()
                        .unwrap_or_else(|e| e.into_inner())
                        .insert(id, clone);
                }
                let shared = shared.clone();
                let _ = thread::Builder::new()
                    .name(format!("fake-apiserver-{id}"))
                    .spawn(move || {
                        let _ = serve_connection(stream, &shared);
                        shared
                            .conns
                            .lock()
                            .unwrap_or_else(|e| e.into_inner())
                            .remove(&id);
                    });
            }
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                thread::sleep(Duration::from_millis(2));
            }
            Err(_) => thread::sleep(Duration::from_millis(20)),
        }
    }
}

/// A parsed request target.
struct Request {
    kind: Option<Kind>,
    query: HashMap<String, String>,
    /// A namespaced path's namespace, and object name (a GET of one object).
    namespace: Option<String>,
    name: Option<String>,
}

fn serve_connection(stream: TcpStream, shared: &Shared) -> Result<()> {
    let mut reader = BufReader::new(stream.try_clone()?);
    let mut out = stream;
    loop {
        let mut line = String::new();
        if reader.read_line(&mut line)? == 0 {
            return Ok(());
        }
        let request_line = line.trim_end().to_owned();
        // Headers: only Content-Length matters (the body of an Event POST or PATCH).
        let mut content_length = 0usize;
        loop {
            let mut h = String::new();
            if reader.read_line(&mut h)? == 0 {
                return Ok(());
            }
            if h.trim_end().is_empty() {
                break;
            }
            if let Some((name, value)) = h.split_once(':')
                && name.eq_ignore_ascii_case("content-length")
            {
                content_length = value.trim().parse().unwrap_or(0);
            }
        }
        let mut body = vec![0u8; content_length.min(1 << 20)];
        reader.read_exact(&mut body)?;
        shared
            .requests
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(request_line.clone());
        let mut parts = request_line.split_whitespace();
        let method = parts.next().unwrap_or_default();
        let target = parts.next().unwrap_or_default();
        let (path, query) = target.split_once('?').unwrap_or((target, ""));
        let unserved = shared
            .unserved
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone();
        let route = Kind::route(path).filter(|(k, _, _)| !unserved.contains(k));
        let mut req = Request {
            kind: route.as_ref().map(|r| r.0),
            query: parse_query(query),
            namespace: route.as_ref().and_then(|r| r.1.clone()),
            name: route.and_then(|r| r.2),
        };
        if let Some(ns) = &req.namespace {
            // A namespace's collection: the cluster-wide one with a namespace field selector.
            let fields = req.query.remove("fieldSelector").unwrap_or_default();
            let joined = if fields.is_empty() {
                format!("metadata.namespace={ns}")
            } else {
                format!("{fields},metadata.namespace={ns}")
            };
            req.query.insert("fieldSelector".into(), joined);
        }
        if let Some(namespace) = event_namespace(method, path) {
            let Ok(body) = serde_json::from_slice::<Value>(&body) else {
                let status = status_json(400, "BadRequest", "body is not JSON");
                write_response(&mut out, "400 Bad Request", &status)?;
                continue;
            };
            shared
                .events
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .push(RecordedEvent {
                    method: method.to_owned(),
                    namespace,
                    body: body.clone(),
                });
            let code = if method == "POST" {
                "201 Created"
            } else {
                "200 OK"
            };
            write_response(&mut out, code, &body)?;
            continue;
        }
        match (method, req.kind) {
            ("GET", Some(kind)) if req.query.get("watch").is_some_and(|w| w == "true") => {
                return serve_watch(&mut out, shared, kind, &req);
            }
            ("GET", Some(kind)) if req.name.is_some() => serve_get(&mut out, shared, kind, &req)?,
            ("GET", Some(kind)) => serve_list(&mut out, shared, kind, &req)?,
            _ => {
                let body = status_json(404, "NotFound", &format!("{method} {path} not served"));
                write_response(&mut out, "404 Not Found", &body)?;
            }
        }
    }
}

/// The namespace of an Event create (`POST <prefix>{ns}/events`) or patch (`PATCH
/// <prefix>{ns}/events/{name}`); `None` for any other request.
fn event_namespace(method: &str, path: &str) -> Option<String> {
    let rest = path.strip_prefix(EVENTS_PREFIX)?;
    let parts: Vec<&str> = rest.split('/').collect();
    match (method, parts.as_slice()) {
        ("POST", [ns, "events"]) | ("PATCH", [ns, "events", _]) => Some((*ns).to_owned()),
        _ => None,
    }
}

fn status_json(code: u16, reason: &str, message: &str) -> Value {
    json!({"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
           "message": message, "reason": reason, "code": code})
}

fn write_response(out: &mut TcpStream, status: &str, body: &Value) -> io::Result<()> {
    let body = serde_json::to_vec(body)?;
    write!(
        out,
        "HTTP/1.1 {status}\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n",
        body.len()
    )?;
    out.write_all(&body)?;
    out.flush()
}

fn serve_list(out: &mut TcpStream, shared: &Shared, kind: Kind, req: &Request) -> Result<()> {
    let labels = LabelSelector::parse(req.query.get("labelSelector").map_or("", String::as_str));
    let fields = FieldSelector::parse(req.query.get("fieldSelector").map_or("", String::as_str));
    let limit: usize = req
        .query
        .get("limit")
        .and_then(|l| l.parse().ok())
        .filter(|&l| l > 0)
        .unwrap_or(usize::MAX);
    let (mut list_rv, offset) = match req.query.get("continue") {
        Some(token) => {
            let (rv, off) = token.split_once(':').unwrap_or(("0", "0"));
            (rv.parse().unwrap_or(0), off.parse().unwrap_or(0))
        }
        None => (0, 0),
    };
    let (items, more) = {
        let st = shared.state();
        if list_rv == 0 {
            list_rv = st.rv;
        }
        let mut matching = st
            .objects
            .iter()
            .filter(|((k, _, _), v)| *k == kind && labels.matches(v) && fields.matches(v))
            .skip(offset);
        let items: Vec<Arc<Value>> = matching
            .by_ref()
            .take(limit)
            .map(|(_, v)| v.clone())
            .collect();
        (items, matching.next().is_some())
    };
    let mut metadata = json!({"resourceVersion": list_rv.to_string()});
    if more {
        metadata["continue"] = json!(format!("{list_rv}:{}", offset + items.len()));
    }
    let body = json!({
        "apiVersion": kind.api_version(),
        "kind": format!("{}List", kind.kind()),
        "metadata": metadata,
        "items": items.iter().map(|v| (**v).clone()).collect::<Vec<_>>(),
    });
    write_response(out, "200 OK", &body)?;
    Ok(())
}

/// `GET .../namespaces/{ns}/{plural}/{name}`: the object, or 404 NotFound as the API says it.
fn serve_get(out: &mut TcpStream, shared: &Shared, kind: Kind, req: &Request) -> Result<()> {
    let ns = req.namespace.clone().unwrap_or_default();
    let name = req.name.clone().unwrap_or_default();
    let found = shared
        .state()
        .objects
        .get(&(kind, ns, name.clone()))
        .cloned();
    match found {
        Some(obj) => write_response(out, "200 OK", &obj)?,
        None => {
            let plural = kind.path().rsplit('/').next().unwrap_or_default();
            let body = status_json(404, "NotFound", &format!("{plural} \"{name}\" not found"));
            write_response(out, "404 Not Found", &body)?;
        }
    }
    Ok(())
}

fn write_chunk(out: &mut TcpStream, event: &Value) -> io::Result<()> {
    let mut line = serde_json::to_vec(event)?;
    line.push(b'\n');
    write!(out, "{:x}\r\n", line.len())?;
    out.write_all(&line)?;
    out.write_all(b"\r\n")?;
    out.flush()
}

fn serve_watch(out: &mut TcpStream, shared: &Shared, kind: Kind, req: &Request) -> Result<()> {
    let labels = LabelSelector::parse(req.query.get("labelSelector").map_or("", String::as_str));
    let fields = FieldSelector::parse(req.query.get("fieldSelector").map_or("", String::as_str));
    let bookmarks = req
        .query
        .get("allowWatchBookmarks")
        .is_some_and(|b| b == "true");
    let timeout = req
        .query
        .get("timeoutSeconds")
        .and_then(|t| t.parse().ok())
        .map_or(Duration::from_secs(1800), Duration::from_secs);
    let deadline = Instant::now() + timeout;
    write!(
        out,
        "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\
         Connection: close\r\n\r\n"
    )?;
    out.flush()?;
    let matches = |v: &Option<Arc<Value>>| {
        v.as_ref()
            .is_some_and(|v| labels.matches(v) && fields.matches(v))
    };
    let (mut cursor, epoch, expiry) = {
        let st = shared.state();
        let from: u64 = req
            .query
            .get("resourceVersion")
            .and_then(|r| r.parse().ok())
            .unwrap_or(st.rv);
        if from < st.compacted {
            drop(st);
            let gone = status_json(410, "Expired", &format!("too old resource version: {from}"));
            write_chunk(out, &json!({"type": "ERROR", "object": gone}))?;
            out.write_all(b"0\r\n\r\n")?;
            return Ok(());
        }
        (from, st.epoch, st.expiry)
    };
    let mut last_sent = Instant::now();
    loop {
        let (events, expired, ended, bookmark_rv) = {
            let mut st = shared.state();
            loop {
                let start = st.history.partition_point(|c| c.rv <= cursor);
                let pending = st.history.iter().skip(start).any(|c| c.kind == kind);
                let now = Instant::now();
                let bookmark_due = bookmarks && now >= last_sent + shared.bookmark_interval;
                if pending
                    || st.epoch != epoch
                    || st.expiry != expiry
                    || now >= deadline
                    || bookmark_due
                {
                    break;
                }
                let wait = (last_sent + shared.bookmark_interval)
                    .min(deadline)
                    .saturating_duration_since(now)
                    .max(Duration::from_millis(1));
                st = shared
                    .cond
                    .wait_timeout(st, wait)
                    .unwrap_or_else(|e| e.into_inner())
                    .0;
            }
            let start = st.history.partition_point(|c| c.rv <= cursor);
            let events: Vec<Change> = st
                .history
                .iter()
                .skip(start)
                .filter(|c| c.kind == kind)
                .cloned()
                .collect();
            (
                events,
                st.expiry != expiry,
                st.epoch != epoch || Instant::now() >= deadline,
                st.rv,
            )
        };
        if expired {
            let gone = status_json(410, "Expired", "too old resource version");
            write_chunk(out, &json!({"type": "ERROR", "object": gone}))?;
            out.write_all(b"0\r\n\r\n")?;
            return Ok(());
        }
        if ended {
            // Dropped (the socket is shut down) or timed out: end the stream cleanly if we can.
            let _ = out.write_all(b"0\r\n\r\n");
            return Ok(());
        }
        if events.is_empty() {
            // Bookmark: every event of this kind up to bookmark_rv has been sent.
            let obj = json!({"kind": kind.kind(), "apiVersion": kind.api_version(),
                             "metadata": {"resourceVersion": bookmark_rv.to_string()}});
            write_chunk(out, &json!({"type": "BOOKMARK", "object": obj}))?;
            cursor = bookmark_rv;
        }
        for c in events {
            let (was, is) = (matches(&c.old), matches(&c.new));
            let event = match (was, is, &c.new) {
                (false, true, Some(new)) => Some(("ADDED", new.clone())),
                (true, true, Some(new)) => Some(("MODIFIED", new.clone())),
                (true, false, Some(new)) => Some(("DELETED", new.clone())),
                (true, _, None) => c.old.clone().map(|old| ("DELETED", old)),
                _ => None,
            };
            if let Some((ty, obj)) = event {
                write_chunk(out, &json!({"type": ty, "object": *obj}))?;
            }
            cursor = c.rv;
        }
        last_sent = Instant::now();
    }
}

fn parse_query(query: &str) -> HashMap<String, String> {
    query
        .split('&')
        .filter(|p| !p.is_empty())
        .map(|p| {
            let (k, v) = p.split_once('=').unwrap_or((p, ""));
            (percent_decode(k), percent_decode(v))
        })
        .collect()
}

fn percent_decode(s: &str) -> String {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        match bytes[i] {
            b'%' if i + 2 < bytes.len() => {
                let hex = std::str::from_utf8(&bytes[i + 1..i + 3]).unwrap_or("");
                match u8::from_str_radix(hex, 16) {
                    Ok(b) => {
                        out.push(b);
                        i += 3;
                    }
                    Err(_) => {
                        out.push(b'%');
                        i += 1;
                    }
                }
            }
            b'+' => {
                out.push(b' ');
                i += 1;
            }
            b => {
                out.push(b);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// Equality-based label selector terms: `k`, `!k`, `k=v`, `k==v`, `k!=v`.
#[derive(Debug, Default)]
struct LabelSelector(Vec<(String, LabelOp)>);

#[derive(Debug)]
enum LabelOp {
    Exists,
    NotExists,
    Eq(String),
    NotEq(String),
}

impl LabelSelector {
    fn parse(s: &str) -> Self {
        let terms = s
            .split(',')
            .map(str::trim)
            .filter(|t| !t.is_empty())
            .map(|t| {
                if let Some(k) = t.strip_prefix('!') {
                    (k.to_owned(), LabelOp::NotExists)
                } else if let Some((k, v)) = t.split_once("!=") {
                    (k.to_owned(), LabelOp::NotEq(v.to_owned()))
                } else if let Some((k, v)) = t.split_once("==").or_else(|| t.split_once('=')) {
                    (k.to_owned(), LabelOp::Eq(v.to_owned()))
                } else {
                    (t.to_owned(), LabelOp::Exists)
                }
            })
            .collect();
        Self(terms)
    }

    fn matches(&self, obj: &Value) -> bool {
        let labels = &obj["metadata"]["labels"];
        self.0.iter().all(|(k, op)| {
            let v = labels.get(k).and_then(Value::as_str);
            match op {
                LabelOp::Exists => v.is_some(),
                LabelOp::NotExists => v.is_none(),
                LabelOp::Eq(want) => v == Some(want.as_str()),
                LabelOp::NotEq(want) => v != Some(want.as_str()),
            }
        })
    }
}

/// `metadata.name=x`, `metadata.namespace=y` (comma-separated, all must match).
#[derive(Debug, Default)]
struct FieldSelector(Vec<(String, String)>);

impl FieldSelector {
    fn parse(s: &str) -> Self {
        Self(
            s.split(',')
                .filter_map(|t| {
                    let (k, v) = t.split_once("==").or_else(|| t.split_once('='))?;
                    Some((k.trim().to_owned(), v.trim().to_owned()))
                })
                .collect(),
        )
    }

    fn matches(&self, obj: &Value) -> bool {
        self.0.iter().all(|(k, want)| {
            let field = k
                .split('.')
                .try_fold(obj, |v, part| v.get(part))
                .and_then(Value::as_str)
                .unwrap_or_default();
            field == want
        })
    }
}

/// Polls `cond` every 10 ms until it holds, up to `timeout`.
pub fn wait_for(timeout: Duration, what: &str, mut cond: impl FnMut() -> bool) -> Result<()> {
    let deadline = Instant::now() + timeout;
    while !cond() {
        if Instant::now() >= deadline {
            bail!("timed out after {timeout:?} waiting for {what}");
        }
        thread::sleep(Duration::from_millis(10));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::io::Read as _;

    use super::*;

    fn get(server: &FakeApiServer, target: &str) -> String {
        let mut s = TcpStream::connect(("127.0.0.1", server.port())).expect("connect");
        write!(
            s,
            "GET {target} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
        )
        .expect("send");
        s.set_read_timeout(Some(Duration::from_secs(5)))
            .expect("timeout");
        let mut buf = Vec::new();
        let _ = s.read_to_end(&mut buf);
        String::from_utf8_lossy(&buf).into_owned()
    }

    fn svc(name: &str, labels: Value) -> Value {
        json!({"apiVersion": "v1", "kind": "Service",
               "metadata": {"name": name, "namespace": "demo", "labels": labels},
               "spec": {"clusterIP": "10.96.0.1", "ports": [{"port": 80}]}})
    }

    #[test]
    fn list_honours_selectors_and_paging() {
        let server = FakeApiServer::start().expect("start");
        server.apply(svc("a", json!({}))).expect("a");
        server
            .apply(svc("b", json!({"service.kubernetes.io/headless": ""})))
            .expect("b");
        server.apply(svc("c", json!({}))).expect("c");
        let all = get(&server, "/api/v1/services");
        assert!(all.contains("\"a\"") && all.contains("\"b\"") && all.contains("\"c\""));
        let filtered = get(
            &server,
            "/api/v1/services?labelSelector=%21service.kubernetes.io%2Fheadless",
        );
        assert!(
            filtered.contains("\"a\"") && !filtered.contains("\"b\""),
            "{filtered}"
        );
        let page = get(&server, "/api/v1/services?limit=2");
        assert!(page.contains("\"continue\":\"3:2\""), "{page}");
        let rest = get(&server, "/api/v1/services?limit=2&continue=3:2");
        assert!(
            rest.contains("\"c\"") && !rest.contains("\"continue\""),
            "{rest}"
        );
    }

    #[test]
    fn namespaced_paths_list_one_namespace_and_get_one_object() {
        let server = FakeApiServer::start().expect("start");
        let ds = |ns: &str, name: &str| {
            json!({"apiVersion": "apps/v1", "kind": "DaemonSet",
                   "metadata": {"name": name, "namespace": ns}})
        };
        server.apply(ds("kube-system", "agent")).expect("agent");
        server.apply(ds("other", "agent")).expect("other");
        let list = get(
            &server,
            "/apis/apps/v1/namespaces/kube-system/daemonsets?fieldSelector=metadata.name%3Dagent",
        );
        assert!(
            list.contains("kube-system") && !list.contains("\"other\""),
            "{list}"
        );
        let one = get(
            &server,
            "/apis/apps/v1/namespaces/kube-system/daemonsets/agent",
        );
        assert!(
            one.starts_with("HTTP/1.1 200") && one.contains("\"agent\""),
            "{one}"
        );
        assert!(server.delete(Kind::DaemonSet, "kube-system", "agent"));
        let gone = get(
            &server,
            "/apis/apps/v1/namespaces/kube-system/daemonsets/agent",
        );
        assert!(
            gone.starts_with("HTTP/1.1 404") && gone.contains("NotFound"),
            "{gone}"
        );
        let nodes = get(&server, "/api/v1/namespaces/x/nodes");
        assert!(nodes.starts_with("HTTP/1.1 404"), "cluster-scoped: {nodes}");
    }

    #[test]
    fn watch_replays_from_a_version_and_410s_after_expiry() {
        let server = FakeApiServer::start().expect("start");
        server.apply(svc("a", json!({}))).expect("a");
        server.apply(svc("b", json!({}))).expect("b");
        assert!(server.delete(Kind::Service, "demo", "a"));
        let w = get(
            &server,
            "/api/v1/services?watch=true&resourceVersion=1&timeoutSeconds=1",
        );
        assert!(w.contains("\"ADDED\"") && w.contains("\"DELETED\""), "{w}");
        assert!(!w.contains("\"name\":\"a\",\"namespace\":\"demo\",\"resourceVersion\":\"1\""));
        server.expire_watches();
        let w = get(
            &server,
            "/api/v1/services?watch=true&resourceVersion=1&timeoutSeconds=1",
        );
        assert!(w.contains("\"code\":410"), "{w}");
    }

    #[test]
    fn stopped_server_refuses_and_resumes_on_the_same_port() {
        let mut server = FakeApiServer::start().expect("start");
        let port = server.port();
        server.stop();
        assert!(TcpStream::connect(("127.0.0.1", port)).is_err());
        server.resume().expect("resume");
        assert_eq!(server.port(), port);
        assert!(get(&server, "/api/v1/nodes").contains("NodeList"));
    }
}
