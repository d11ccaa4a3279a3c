//! The Kubernetes API source: reflectors on Services, EndpointSlices and this node's Node.
//!
//! Each reflector (kube-runtime `watcher` + store) lists, then watches; on a dropped watch it
//! resumes from its resourceVersion, on 410 Gone it relists, and between failed attempts it backs
//! off (exponential from 0.5 s, capped at 5 s, with jitter: an API server back from an outage
//! is noticed within seconds, not the default's 30 s). The store applies a relist atomically at its end
//! (`InitDone`), so a sync never reads a half-listed or reset store: while the API server is
//! unreachable the stores keep their last state and the dataplane is left as it is. Objects
//! deleted during an outage vanish from the store at the relist and from the maps by the diff.
//!
//! Objects are pruned ([`prune`]) before they enter the stores; EndpointSlices are then kept
//! parsed, as [`SliceData`] (converted in the event stream, before the store sees them).
//! Services and EndpointSlices go into lists kept per event ([`store`]; relists applied at
//! `InitDone` the same way), which a sync reads as two `Arc` clones; the Node and the
//! ServiceCIDRs into kube-rs stores.
//!
//! An API outage (connection errors, 5xx, 429) is logged once when the first reflector meets it
//! and once when the API server answers again ([`Reachability`]), not per retry: kube-proxy logs
//! nothing at its default level through an outage, and the dataplane is unaffected by one. A 410
//! Gone (history compacted, relist) is the normal path: debug only. Other errors (403 after an
//! RBAC change, say) keep a warning per reflector every 10 s.

pub mod bootstrap;
pub mod events;
pub mod prune;
pub mod store;
pub mod uninstall;

use std::{
    fmt::Debug,
    path::PathBuf,
    sync::{Arc, Mutex, MutexGuard},
    time::{Duration, Instant},
};

use futures::StreamExt as _;
use k8s_openapi::api::{
    apps::v1::DaemonSet,
    core::v1::{Node, Service},
    discovery::v1::EndpointSlice,
    networking::v1::ServiceCIDR,
};
use kube::{
    Api, Client, Config,
    config::{KubeConfigOptions, Kubeconfig},
    runtime::{
        WatchStreamExt as _,
        reflector::{self, Lookup, Store},
        utils::{Backoff, ResetTimerBackoff},
        watcher,
    },
};
use serde::de::DeserializeOwned;
use tokio::{sync::Notify, task::JoinHandle};
use tracing::{debug, info, trace, warn};

use crate::sources::{
    endpoints::SliceData,
    kube::store::{Keyed, SharedOrdered},
    services::ServiceData,
    snapshot::{Changes, Snapshot},
};

/// kube-proxy's Service filter: Services owned by another proxy, and headless ones, are never
/// sent to us.
pub const SERVICE_LABEL_SELECTOR: &str =
    "!service.kubernetes.io/service-proxy-name,!service.kubernetes.io/headless";

/// How often a failing reflector logs at warn level (every error is logged at debug).
const ERROR_LOG_INTERVAL: Duration = Duration::from_secs(10);

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error(
        "reading kubeconfig {path}: {source}; check --kubeconfig or clientConnection.kubeconfig \
         (deploy/ takes kubeadm's kube-proxy kubeconfig from its `kube-proxy` ConfigMap; without \
         it set clientConnection.kubeconfig to \"\" and KPE_MASTER to https://HOST:PORT)"
    )]
    Kubeconfig {
        path: PathBuf,
        source: kube::config::KubeconfigError,
    },
    #[error(
        "no Kubernetes API configuration found ({0}); pass --kubeconfig, --master or --manifests, \
         or run in a pod with a service account"
    )]
    Infer(#[from] kube::config::InferConfigError),
    #[error("--master {url:?} is not a URL: {reason}")]
    Master { url: String, reason: String },
    #[error("creating the Kubernetes client: {0}")]
    Client(#[from] kube::Error),
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

/// How to reach the API server (kube-proxy's `--kubeconfig` and `--master`; [`bootstrap`]).
#[derive(Clone, Debug, Default)]
pub struct Connection {
    /// A kubeconfig file (kube-proxy's, kubeadm's `kube-proxy` ConfigMap's `kubeconfig.conf`).
    pub kubeconfig: Option<PathBuf>,
    /// Overrides the server URL of the kubeconfig; alone, the URL used with the pod's service
    /// account (token and CA).
    pub master: Option<String>,
    /// Where the pod's service account is mounted.
    pub service_account_dir: PathBuf,
}

impl Connection {
    /// The client, and the API server's URL it talks to. Without a kubeconfig: the service
    /// account (with `master`, or `KUBERNETES_SERVICE_HOST`/`_PORT`), else the URL of `master`
    /// alone, else `KUBECONFIG` or `~/.kube/config`.
    pub async fn client(&self) -> Result<(Client, http::Uri)> {
        let master = match &self.master {
            Some(url) => Some(url.parse::<http::Uri>().map_err(|e| Error::Master {
                url: url.clone(),
                reason: e.to_string(),
            })?),
            None => None,
        };
        let from_file = async |path: &PathBuf, kubeconfig: Result<Kubeconfig, _>| {
            let kubeconfig = kubeconfig.map_err(|source| Error::Kubeconfig {
                path: path.clone(),
                source,
            })?;
            Config::from_custom_kubeconfig(kubeconfig, &KubeConfigOptions::default())
                .await
                .map_err(|source| Error::Kubeconfig {
                    path: path.clone(),
                    source,
                })
        };
        let in_cluster = bootstrap::in_cluster_kubeconfig(
            &self.service_account_dir,
            self.master.as_deref(),
            |k| std::env::var(k).ok(),
        );
        let mut config = match (&self.kubeconfig, in_cluster, &master) {
            (Some(path), _, _) => from_file(path, Kubeconfig::read_from(path)).await?,
            (None, Some(text), _) => {
                let dir = &self.service_account_dir;
                from_file(dir, Kubeconfig::from_yaml(&text)).await?
            }
            (None, None, Some(url)) => Config::new(url.clone()),
            (None, None, None) => Config::infer().await?,
        };
        if let Some(url) = master {
            config.cluster_url = url;
        }
        // Watches are long polls; the read timeout must not cut them (the watcher sets its own
        // server-side timeout and resumes).
        config.read_timeout = None;
        let url = config.cluster_url.clone();
        Ok((Client::try_from(config)?, url))
    }
}

/// The three reflectors and what they know.
pub struct KubeSource {
    /// Services and EndpointSlices in lists kept per event ([`store`]): reading them is one
    /// pointer copy each.
    services: Arc<SharedOrdered<ServiceData>>,
    slices: Arc<SharedOrdered<SliceData>>,
    node: Store<Node>,
    /// The cluster's ServiceCIDR objects (networking.k8s.io/v1, Kubernetes 1.33+); stays empty
    /// where the API is not served or not granted.
    service_cidrs: Store<ServiceCIDR>,
    /// The agent's own DaemonSet (`--daemonset`), watched to tell an uninstall from a restart.
    owner: Option<Box<OwnerWatch>>,
    node_name: String,
    changed: Arc<Notify>,
    reachability: Arc<Reachability>,
    tasks: Vec<JoinHandle<()>>,
}

/// The watch on the agent's DaemonSet ([`uninstall`]).
struct OwnerWatch {
    ds: uninstall::DaemonSetRef,
    api: Api<DaemonSet>,
    store: Store<DaemonSet>,
}

impl KubeSource {
    /// Starts the reflectors (and, with `owner`, a watch on the agent's DaemonSet). Returns at
    /// once; see [`KubeSource::wait_ready`].
    pub fn start(client: Client, node_name: &str, owner: Option<uninstall::DaemonSetRef>) -> Self {
        let changed = Arc::new(Notify::new());
        let reachability = Arc::new(Reachability::new(client.clone()));
        let services = Arc::new(SharedOrdered::default());
        let slices = Arc::new(SharedOrdered::default());
        let t1 = reflect_into(
            services.clone(),
            Api::<Service>::all(client.clone()),
            watcher::Config::default().labels(SERVICE_LABEL_SELECTOR),
            |mut svc| {
                prune::service(&mut svc);
                ServiceData::from(&svc)
            },
            changed.clone(),
            reachability.clone(),
            Required::Yes,
        );
        let t2 = reflect_into(
            slices.clone(),
            Api::<EndpointSlice>::all(client.clone()),
            watcher::Config::default(),
            |mut slice| {
                prune::endpoint_slice(&mut slice);
                SliceData::from(&slice)
            },
            changed.clone(),
            reachability.clone(),
            Required::Yes,
        );
        let (node, t3) = reflect(
            Api::<Node>::all(client.clone()),
            watcher::Config::default().fields(&format!("metadata.name={node_name}")),
            |mut node| {
                prune::node(&mut node);
                node
            },
            changed.clone(),
            reachability.clone(),
            Required::Yes,
        );
        let mut tasks = Vec::new();
        let owner = owner.map(|ds| {
            let api = Api::<DaemonSet>::namespaced(client.clone(), &ds.namespace);
            // Its changes wake nobody: it is read only when the agent stops.
            let (store, task) = reflect(
                api.clone(),
                watcher::Config::default().fields(&format!("metadata.name={}", ds.name)),
                uninstall::prune,
                Arc::new(Notify::new()),
                reachability.clone(),
                Required::No,
            );
            tasks.push(task);
            Box::new(OwnerWatch { ds, api, store })
        });
        let (service_cidrs, t4) = reflect(
            Api::<ServiceCIDR>::all(client),
            watcher::Config::default(),
            |mut cidr| {
                cidr.metadata.managed_fields = None;
                cidr.metadata.annotations = None;
                cidr.status = None;
                cidr
            },
            changed.clone(),
            reachability.clone(),
            Required::No,
        );
        tasks.extend([t1, t2, t3, t4]);
        Self {
            services,
            slices,
            node,
            service_cidrs,
            owner,
            node_name: node_name.to_owned(),
            changed,
            reachability,
            tasks,
        }
    }

    /// What a stop now does with the datapath ([`uninstall`]): decided from the agent's
    /// DaemonSet, confirmed by a fresh GET (at most [`uninstall::CONFIRM_TIMEOUT`]; the watch's
    /// view when the API server does not answer), and this node's Node.
    pub async fn stop_kind(&self) -> uninstall::Stop {
        let Some(owner) = &self.owner else {
            return uninstall::Stop::Keep("no --daemonset: a stop keeps the datapath".into());
        };
        let listed = futures::FutureExt::now_or_never(owner.store.wait_until_ready()).is_some();
        let watched = owner.store.state().into_iter().next();
        let fresh = tokio::time::timeout(
            uninstall::CONFIRM_TIMEOUT,
            owner.api.get_opt(&owner.ds.name),
        )
        .await;
        let confirmed = match fresh {
            Ok(Ok(found)) => Some(found.map(|ds| Arc::new(uninstall::prune(ds)))),
            Ok(Err(e)) => {
                warn!(daemonset = %owner.ds, "reading the DaemonSet at the stop failed ({e}); going by the watch");
                None
            }
            Err(_) => {
                warn!(daemonset = %owner.ds, "the API server did not answer within {:?} at the stop; going by the watch", uninstall::CONFIRM_TIMEOUT);
                None
            }
        };
        let known = match confirmed {
            Some(found) => Some(found),
            None if listed => Some(watched),
            None => None,
        };
        let owner_state = match &known {
            None => uninstall::Owner::Unknown,
            Some(None) => uninstall::Owner::Gone,
            Some(Some(ds)) => uninstall::Owner::Present(ds),
        };
        let node = self.node.state().into_iter().next();
        uninstall::decide(&owner.ds, owner_state, node.as_deref(), &self.node_name)
    }

    /// Resolves once every reflector has completed its initial list.
    pub async fn wait_ready(&self) {
        // The writers live as long as their tasks, which run until `self` is dropped.
        self.services.wait_until_ready().await;
        self.slices.wait_until_ready().await;
        let _ = self.node.wait_until_ready().await;
    }

    /// Resolves when a store changed since the last call (changes coalesce into one wake-up).
    /// Cancel-safe: a change seen while nobody waits is kept for the next call.
    pub async fn changed(&self) {
        self.changed.notified().await;
    }

    /// The stores' current content as a snapshot: the lists are shared with the stores, not
    /// copied (one `Arc` clone each); a changed object gets a new `Arc` in the same place, an
    /// unchanged one keeps its `Arc` across snapshots.
    pub fn snapshot(&self) -> Snapshot {
        Snapshot {
            services: self.services.state(),
            endpoint_slices: self.slices.state(),
        }
    }

    /// [`KubeSource::snapshot`] and what changed since the last call (the one reader is the
    /// agent's sync; another caller would take changes the sync then does not see).
    pub fn snapshot_and_changes(&self) -> (Snapshot, Changes) {
        let (services, service_changes) = self.services.state_and_changes();
        let (endpoint_slices, slice_changes) = self.slices.state_and_changes();
        (
            Snapshot {
                services,
                endpoint_slices,
            },
            Changes {
                services: service_changes,
                endpoint_slices: slice_changes,
            },
        )
    }

    /// The CIDRs of family `A` of the cluster's ServiceCIDR objects (`spec.cidrs`; the other
    /// family's and unparsable ones left out), sorted.
    pub fn service_cidrs<A: crate::pipeline::model::Family>(&self) -> Vec<(A, u8)> {
        let mut out: Vec<(A, u8)> = self
            .service_cidrs
            .state()
            .iter()
            .filter_map(|c| c.spec.as_ref()?.cidrs.as_ref())
            .flatten()
            .filter_map(|c| c.parse::<crate::pipeline::addresses::Cidr>().ok())
            .filter_map(|c| Some((A::of(c.addr)?, c.prefix_len)))
            .collect();
        out.sort();
        out.dedup();
        out
    }

    /// This node's `topology.kubernetes.io/zone` label (None until the Node is seen).
    pub fn zone(&self) -> Option<String> {
        self.node.state().first().and_then(|n| {
            n.metadata
                .labels
                .as_ref()
                .and_then(|l| l.get(prune::LABEL_ZONE))
                .cloned()
        })
    }

    /// Is this node eligible for traffic (/healthz)? Not when its Node is being deleted or carries
    /// the cluster autoscaler's deletion taint, nor when the Node is missing once listed
    /// (deleted, or never created: upstream's healthz says the same); eligible before the first
    /// list.
    pub fn node_eligible(&self) -> bool {
        let listed = futures::FutureExt::now_or_never(self.node.wait_until_ready()).is_some();
        match self.node.state().first() {
            Some(n) => crate::serving::health::node_eligible(n),
            None => !listed,
        }
    }

    /// Object counts (Services, EndpointSlices), for logs.
    pub fn counts(&self) -> (usize, usize) {
        (self.services.len(), self.slices.len())
    }
}

impl Drop for KubeSource {
    fn drop(&mut self) {
        for t in &self.tasks {
            t.abort();
        }
        self.reachability.stop();
    }
}

/// Is this watch error the API server being unreachable or overloaded (connection refused or
/// reset, TLS or timeout, 5xx, 429), as opposed to a request it refuses (403, 404, ...)?
fn unavailable(e: &watcher::Error) -> bool {
    match e {
        watcher::Error::InitialListFailed(e)
        | watcher::Error::WatchStartFailed(e)
        | watcher::Error::WatchFailed(e) => match e {
            kube::Error::Api(status) => unavailable_code(status.code),
            _ => true,
        },
        watcher::Error::WatchError(status) => unavailable_code(status.code),
        watcher::Error::NoResourceVersion => false,
    }
}

fn unavailable_code(code: u16) -> bool {
    code >= 500 || code == 429
}

/// Whether the API server answers, shared by the reflectors: the first reflector to meet an
/// outage logs it (once) and starts a probe (`GET /version` with the reflectors' backoff), which
/// logs the recovery (once) when the server answers anything again. A reflector that resumes
/// its watch without a relist emits no event, so the reflectors alone could not tell that a
/// quiet cluster's API server is back.
struct Reachability {
    client: Client,
    outage: Mutex<Outage>,
}

impl Debug for Reachability {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Reachability")
            .field("outage", &self.outage)
            .finish_non_exhaustive()
    }
}

#[derive(Debug, Default)]
struct Outage {
    /// When the outage being reported started (`None`: the API server answers).
    since: Option<Instant>,
    probe: Option<JoinHandle<()>>,
}

impl Reachability {
    fn new(client: Client) -> Self {
        Self {
            client,
            outage: Mutex::new(Outage::default()),
        }
    }

    fn lock(&self) -> MutexGuard<'_, Outage> {
        // Plain field writes: a panic while holding the lock cannot leave it inconsistent.
        self.outage.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// A reflector of `kind` could not reach the API server.
    fn failed(self: &Arc<Self>, kind: &str, e: &watcher::Error) {
        let mut outage = self.lock();
        if outage.since.is_some() {
            debug!(%kind, "API server still unreachable: {e}");
            return;
        }
        warn!(
            %kind,
            "API server unreachable: {e}; the dataplane keeps its last state, the watches retry \
             with backoff (logged again when it answers)"
        );
        outage.since = Some(Instant::now());
        let this = self.clone();
        outage.probe = Some(tokio::spawn(async move { this.probe().await }));
    }

    /// Polls the API server until it answers, then ends the outage.
    async fn probe(&self) {
        let mut backoff = CappedBackoff::default();
        loop {
            tokio::time::sleep(backoff.next().unwrap_or(CappedBackoff::MAX)).await;
            match self.client.apiserver_version().await {
                Ok(_) => break,
                Err(kube::Error::Api(status)) if !unavailable_code(status.code) => break,
                Err(e) => debug!("API server probe: {e}"),
            }
        }
        let mut outage = self.lock();
        let down = outage.since.take().map(|t| t.elapsed()).unwrap_or_default();
        outage.probe = None;
        info!(
            down_s = down.as_secs(),
            "API server reachable again; the watches resume and converge by diff"
        );
    }

    fn stop(&self) {
        if let Some(probe) = self.lock().probe.take() {
            probe.abort();
        }
    }
}

/// Exponential backoff between failed list/watch attempts: 0.5 s doubling to a 5 s cap, each delay
/// jittered down by up to 25% so many agents do not retry in lockstep after an API outage.
#[derive(Clone, Debug)]
pub struct CappedBackoff {
    next: Duration,
    seed: u64,
}

impl CappedBackoff {
    const MIN: Duration = Duration::from_millis(500);
    const MAX: Duration = Duration::from_secs(5);
}

impl Default for CappedBackoff {
    fn default() -> Self {
        let seed = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(1, |d| d.as_nanos() as u64)
            | 1;
        Self {
            next: Self::MIN,
            seed,
        }
    }
}

impl Iterator for CappedBackoff {
    type Item = Duration;

    fn next(&mut self) -> Option<Duration> {
        let delay = self.next;
        self.next = (self.next * 2).min(Self::MAX);
        // xorshift64: cheap jitter, no extra dependency.
        self.seed ^= self.seed << 13;
        self.seed ^= self.seed >> 7;
        self.seed ^= self.seed << 17;
        let jitter = 1.0 - (self.seed % 1000) as f64 / 4000.0;
        Some(delay.mul_f64(jitter))
    }
}

impl Backoff for CappedBackoff {
    fn reset(&mut self) {
        self.next = Self::MIN;
    }
}

/// Whether the agent needs a resource to work at all.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Required {
    Yes,
    /// An API that older clusters do not serve (404), or that the RBAC may not grant yet (403):
    /// said once, then the reflector stops and its store stays empty.
    No,
}

/// One reflector task into a kube-rs store (Node, ServiceCIDR): see [`run_reflector`].
fn reflect<K, T>(
    api: Api<K>,
    config: watcher::Config,
    keep: fn(K) -> T,
    changed: Arc<Notify>,
    reachability: Arc<Reachability>,
    required: Required,
) -> (Store<T>, JoinHandle<()>)
where
    K: kube::Resource<DynamicType = ()> + Clone + DeserializeOwned + Debug + Send + Sync + 'static,
    T: Lookup<DynamicType = ()> + Clone + Send + Sync + 'static,
{
    let (reader, mut writer) = reflector::store::<T>();
    let task = run_reflector(
        api,
        config,
        keep,
        move |event| writer.apply_watcher_event(&event),
        changed,
        reachability,
        required,
    );
    (reader, task)
}

/// One reflector task into an ordered store (Services, EndpointSlices): see [`run_reflector`].
fn reflect_into<K, T>(
    store: Arc<SharedOrdered<T>>,
    api: Api<K>,
    config: watcher::Config,
    keep: fn(K) -> T,
    changed: Arc<Notify>,
    reachability: Arc<Reachability>,
    required: Required,
) -> JoinHandle<()>
where
    K: kube::Resource<DynamicType = ()> + Clone + DeserializeOwned + Debug + Send + Sync + 'static,
    T: Lookup<DynamicType = ()> + Keyed + PartialEq + Clone + Debug + Send + Sync + 'static,
{
    run_reflector(
        api,
        config,
        keep,
        move |event| {
            store.apply(event);
        },
        changed,
        reachability,
        required,
    )
}

/// One reflector task: watcher (with backoff) → `keep` (prune, and convert to what the store
/// holds) → `apply` (the store); wakes `changed` after every event that may have changed the store
/// (Apply, Delete, end of a (re)list).
fn run_reflector<K, T>(
    api: Api<K>,
    config: watcher::Config,
    keep: fn(K) -> T,
    mut apply: impl FnMut(watcher::Event<T>) + Send + 'static,
    changed: Arc<Notify>,
    reachability: Arc<Reachability>,
    required: Required,
) -> JoinHandle<()>
where
    K: kube::Resource<DynamicType = ()> + Clone + DeserializeOwned + Debug + Send + Sync + 'static,
    T: Send + 'static,
{
    let kind = K::kind(&()).into_owned();
    let stream = watcher(api, config)
        .backoff(ResetTimerBackoff::new(
            CappedBackoff::default(),
            Duration::from_secs(60),
        ))
        .map(move |event| event.map(|event| convert_event(event, keep)));
    tokio::spawn(async move {
        let mut stream = std::pin::pin!(stream);
        let mut failing = false;
        let mut last_warn: Option<Instant> = None;
        let mut lists = 0u64;
        while let Some(event) = stream.next().await {
            // The store first, then the wake-up (the agent reads the store when woken).
            let event = event.map(|event| {
                let marker = marker(&event);
                apply(event);
                marker
            });
            match event {
                Ok(watcher::Event::Apply(()) | watcher::Event::Delete(())) => {
                    // `xtask-bench change-latency` splits a change's time by this line.
                    trace!(%kind, "watch event stored");
                    changed.notify_one();
                }
                Ok(watcher::Event::InitDone) => {
                    lists += 1;
                    if std::mem::take(&mut failing) || lists > 1 {
                        // The outage itself is reported by `Reachability`, once.
                        debug!(%kind, "relisted; converging by diff");
                    } else {
                        debug!(%kind, "initial list done");
                    }
                    changed.notify_one();
                }
                Ok(watcher::Event::Init | watcher::Event::InitApply(())) => {}
                Err(watcher::Error::InitialListFailed(kube::Error::Api(status)))
                    if required == Required::No && matches!(status.code, 403 | 404) =>
                {
                    if status.code == 404 {
                        info!(%kind, "not served by this API server (Kubernetes < 1.33?); not watched");
                    } else {
                        warn!(%kind, "listing is forbidden ({status}); not watched: grant list and watch on it to use it");
                    }
                    return;
                }
                Err(e) if unavailable(&e) => {
                    failing = true;
                    reachability.failed(&kind, &e);
                }
                // 410 Gone: the history was compacted; the watcher relists (the normal path).
                Err(watcher::Error::WatchError(status)) if status.code == 410 => {
                    debug!(%kind, "resourceVersion expired, relisting: {status}");
                }
                Err(e) => {
                    failing = true;
                    if last_warn.is_none_or(|t| t.elapsed() >= ERROR_LOG_INTERVAL) {
                        warn!(%kind, "watch failed, retrying with backoff; dataplane unchanged: {e}");
                        last_warn = Some(Instant::now());
                    } else {
                        debug!(%kind, "watch failed: {e}");
                    }
                }
            }
        }
    })
}

/// `event` without its object (what the reflector loop decides on, after the store took it).
fn marker<T>(event: &watcher::Event<T>) -> watcher::Event<()> {
    match event {
        watcher::Event::Apply(_) => watcher::Event::Apply(()),
        watcher::Event::Delete(_) => watcher::Event::Delete(()),
        watcher::Event::Init => watcher::Event::Init,
        watcher::Event::InitApply(_) => watcher::Event::InitApply(()),
        watcher::Event::InitDone => watcher::Event::InitDone,
    }
}

/// `event` with its object(s) passed through `f` (markers unchanged, so a relist still swaps
/// in atomically at `InitDone`).
fn convert_event<K, T>(event: watcher::Event<K>, f: fn(K) -> T) -> watcher::Event<T> {
    match event {
        watcher::Event::Apply(o) => watcher::Event::Apply(f(o)),
        watcher::Event::Delete(o) => watcher::Event::Delete(f(o)),
        watcher::Event::Init => watcher::Event::Init,
        watcher::Event::InitApply(o) => watcher::Event::InitApply(f(o)),
        watcher::Event::InitDone => watcher::Event::InitDone,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_doubles_to_a_five_second_cap_with_bounded_jitter_and_resets() {
        let mut b = CappedBackoff::default();
        let delays: Vec<Duration> = b.by_ref().take(8).collect();
        let nominal = [0.5, 1.0, 2.0, 4.0, 5.0, 5.0, 5.0, 5.0];
        for (d, n) in delays.iter().zip(nominal) {
            let s = d.as_secs_f64();
            assert!(
                s <= n && s >= n * 0.75,
                "delay {s} s outside [{}, {n}]",
                n * 0.75
            );
        }
        b.reset();
        assert!(b.next().expect("endless") <= Duration::from_millis(500));
    }
}
