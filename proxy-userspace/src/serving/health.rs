//! `/healthz` and `/livez` on healthzBindAddress, with upstream kube-proxy's semantics
//! (`pkg/proxy/healthcheck/proxy_health.go`), served by [`crate::serving::http`]; answers are counted in
//! [`crate::serving::metrics`].
//!
//! What is implemented:
//! - The agent reports two events: [`HealthState::queued`] when a change is waiting for a sync
//!   (the source marked the state dirty, or a sync failed and will be retried), and
//!   [`HealthState::updated`] when a sync has been applied to the maps.
//! - The proxy is *healthy* unless a change has been waiting longer than the health timeout,
//!   which is 2 × syncPeriod as upstream sets it. Only the oldest waiting change counts; a
//!   successful sync clears it. So an idle proxy stays healthy, a starting proxy is healthy until
//!   its first queued change is overdue, and a proxy whose map writes keep failing becomes
//!   unhealthy after 2 × syncPeriod. (Upstream does not queue on a failed sync: its periodic
//!   retry is silent. Queuing here makes broken map writes visible; documented choice.)
//! - `/livez`: 200 when healthy, else 503. Body as v1.36's `ProxyHealth`:
//!   `{"lastUpdated":..,"currentTime":..,"healthy":BOOL,"status":{"IPv4":{"lastUpdated":..,
//!   "healthy":BOOL},"IPv6":{..}}}`; `status` has one entry per IP family the node runs (IPv6
//!   once the node has IPv6 Services) and is left out before the first sync, as upstream's
//!   empty map is.
//! - The listener on `0.0.0.0` takes IPv6 too, as Go's does (`serving::http`).
//! - `/healthz`: as `/livez`, and also 503 when the node is not eligible (the Node is being
//!   deleted or carries the `ToBeDeletedByClusterAutoscaler` taint), so load balancers drain
//!   the node, and when the Node is missing (listed and not there, or deleted), as upstream. Body
//!   adds `"nodeEligible"` after `currentTime`; `healthy` stays the proxy's own health.
//!   Standalone mode has no Node: always eligible. The Kubernetes source calls
//!   [`HealthState::set_node_eligible`] with [`node_eligible`].
//! - `/healthz` is also 503 while the agent's pins are lost and cannot be put back (bpffs
//!   unmounted under it, [`crate::dataplane::pin_keeper`]): the datapath still runs on the maps
//!   and links it holds open, but a restarted agent would start from empty maps. The body then
//!   carries `"pinsProblem"` (not upstream's). `/livez` stays the sync's health: restarting the
//!   agent would not bring the pins back.
//! - `/healthz` is also 503 while the sources' initial lists (Services, EndpointSlices, the
//!   Node) have been missing for longer than the health timeout since the agent started
//!   ([`HealthState::waiting_for_lists`]): an agent that never reaches its API server is not
//!   ready, whatever its datapath still does. The body then carries `"initialListsMissing"`.
//!   And while the agent reaches the API server through an address its own datapath translates
//!   (the `kubernetes` Service's ClusterIP, say: `sources::kube::bootstrap`), the body carries
//!   `"apiServerAddress"` saying so, 200 or not. Neither is upstream's.
//! - Times are RFC 3339 wall-clock times like Go's `time.Time` in JSON. The top-level
//!   `lastUpdated` is the current time in a 200 answer (upstream keeps that old meaning for
//!   compatibility), else the last sync (`0001-01-01T00:00:00Z`, Go's zero time, before the
//!   first one); the family's `lastUpdated` is always its last sync.
//! - Every answer counts in `kubeproxy_proxy_healthz_total{code}` / `kubeproxy_proxy_livez_total`.

use std::{
    sync::{Arc, Mutex, MutexGuard},
    time::{Duration, SystemTime},
};

use hyper::StatusCode;
use k8s_openapi::{api::core::v1::Node, jiff::Timestamp};
use serde::Serialize;
use tokio::net::TcpListener;
use tracing::info;

use crate::serving::{http, metrics::Metrics};

/// Taint the cluster autoscaler puts on a node it is about to remove.
pub const TAINT_TO_BE_DELETED: &str = "ToBeDeletedByClusterAutoscaler";
/// Health timeout before the sync period is known (2 × upstream's default syncPeriod of 30 s).
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(60);

#[derive(Debug)]
struct Inner {
    timeout: Duration,
    last_updated: Option<SystemTime>,
    oldest_queued: Option<SystemTime>,
    node_eligible: bool,
    /// Why the pins under the pin directory cannot be kept (bpffs unmounted), if they cannot.
    pins_problem: Option<String>,
    /// Since when the sources' initial lists are awaited, and what is known of why (cleared by
    /// the first sync).
    waiting_for_lists: Option<(SystemTime, String)>,
    /// The API server is reached through an address this agent's datapath translates.
    api_address: Option<String>,
    /// The node runs IPv6 Services too (`status` then has an `IPv6` entry).
    ipv6: bool,
}

/// The proxy's health, shared between the sync loop, the Node watch and the HTTP server.
#[derive(Debug)]
pub struct HealthState {
    inner: Mutex<Inner>,
}

impl Default for HealthState {
    fn default() -> Self {
        Self::new(DEFAULT_TIMEOUT)
    }
}

/// One health verdict.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Health {
    /// Synced recently enough (what `/livez` answers).
    pub healthy: bool,
    pub node_eligible: bool,
    /// The agent's maps and links are pinned where a restarted agent finds them
    /// ([`crate::dataplane::pin_keeper`]); else why not (`/healthz` answers 503).
    pub pins_problem: Option<String>,
    pub last_updated: Option<SystemTime>,
    pub current_time: SystemTime,
    /// The initial lists have been missing longer than the timeout: why (`/healthz` is 503).
    pub lists_missing: Option<String>,
    /// The API server address warning ([`HealthState::set_api_address_problem`]).
    pub api_address: Option<String>,
    /// The node runs IPv6 Services too.
    pub ipv6: bool,
}

impl HealthState {
    /// `timeout`: how long a queued change may wait for a sync (2 × syncPeriod upstream).
    pub fn new(timeout: Duration) -> Self {
        Self {
            inner: Mutex::new(Inner {
                timeout,
                last_updated: None,
                oldest_queued: None,
                node_eligible: true,
                pins_problem: None,
                waiting_for_lists: None,
                api_address: None,
                ipv6: false,
            }),
        }
    }

    /// The agent waits for the sources' initial lists from `since`; `why` says what it waits
    /// for (shown once the wait is overdue). Cleared by the first applied sync.
    pub fn waiting_for_lists(&self, since: SystemTime, why: String) {
        self.lock().waiting_for_lists = Some((since, why));
    }

    /// Whether the node runs IPv6 Services (each sync says; `status` follows).
    pub fn set_ipv6(&self, ipv6: bool) {
        self.lock().ipv6 = ipv6;
    }

    /// The API server is reached through an address this agent translates (`Some(why)`).
    pub fn set_api_address_problem(&self, problem: Option<String>) {
        self.lock().api_address = problem;
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        // A panic while holding this lock cannot leave it inconsistent (plain field writes).
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub fn set_timeout(&self, timeout: Duration) {
        self.lock().timeout = timeout;
    }

    /// A change is waiting for a sync. Only the first one since the last sync is remembered.
    pub fn queued(&self) {
        self.queued_at(SystemTime::now());
    }

    pub fn queued_at(&self, now: SystemTime) {
        self.lock().oldest_queued.get_or_insert(now);
    }

    /// A sync was applied: everything queued before it is carried.
    pub fn updated(&self) {
        self.updated_at(SystemTime::now());
    }

    pub fn updated_at(&self, now: SystemTime) {
        let mut i = self.lock();
        i.last_updated = Some(now);
        i.oldest_queued = None;
        i.waiting_for_lists = None;
    }

    /// Whether this node should receive load-balancer traffic (see [`node_eligible`]).
    pub fn set_node_eligible(&self, eligible: bool) {
        let mut i = self.lock();
        if i.node_eligible != eligible {
            info!(eligible, "node eligibility changed (/healthz follows)");
        }
        i.node_eligible = eligible;
    }

    /// The pins are lost and cannot be restored (`Some(why)`), or are in place again (`None`).
    pub fn set_pins_problem(&self, problem: Option<String>) {
        self.lock().pins_problem = problem;
    }

    pub fn health_at(&self, now: SystemTime) -> Health {
        let i = self.lock();
        let overdue = i
            .oldest_queued
            .is_some_and(|q| now.duration_since(q).unwrap_or_default() > i.timeout);
        let lists_missing = i.waiting_for_lists.as_ref().and_then(|(since, why)| {
            let waited = now.duration_since(*since).unwrap_or_default();
            (waited > i.timeout).then(|| {
                format!(
                    "the initial lists of Services, EndpointSlices and the Node have been \
                     missing for {} s: {why}",
                    waited.as_secs()
                )
            })
        });
        Health {
            healthy: !overdue,
            node_eligible: i.node_eligible,
            pins_problem: i.pins_problem.clone(),
            last_updated: i.last_updated,
            current_time: now,
            lists_missing,
            api_address: i.api_address.clone(),
            ipv6: i.ipv6,
        }
    }
}

/// Upstream's rule: a Node being deleted, or tainted for removal by the cluster autoscaler, is
/// not eligible for load-balancer traffic.
pub fn node_eligible(node: &Node) -> bool {
    let deleting = node.metadata.deletion_timestamp.is_some();
    let tainted = node
        .spec
        .as_ref()
        .and_then(|s| s.taints.as_ref())
        .is_some_and(|t| t.iter().any(|t| t.key == TAINT_TO_BE_DELETED));
    !deleting && !tainted
}

fn go_time(t: Option<SystemTime>) -> String {
    // By hand: jiff's SystemTime conversions need its `std` feature, which k8s-openapi leaves off.
    let ts = t
        .and_then(|t| t.duration_since(SystemTime::UNIX_EPOCH).ok())
        .and_then(|d| {
            Timestamp::new(i64::try_from(d.as_secs()).ok()?, d.subsec_nanos() as i32).ok()
        });
    match ts {
        Some(ts) => ts.to_string(),
        None => "0001-01-01T00:00:00Z".to_owned(),
    }
}

/// Upstream's `ProxyHealth` (field order is the JSON's).
#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
struct Payload {
    last_updated: String,
    current_time: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    node_eligible: Option<bool>,
    healthy: bool,
    /// `/healthz` only, and only while the pins are lost: why (not in upstream's answer).
    #[serde(skip_serializing_if = "Option::is_none")]
    pins_problem: Option<String>,
    /// `/healthz` only: the initial lists are overdue, and why (not upstream's).
    #[serde(skip_serializing_if = "Option::is_none")]
    initial_lists_missing: Option<String>,
    /// `/healthz` only: the API server is reached through an address this agent translates
    /// (not upstream's).
    #[serde(skip_serializing_if = "Option::is_none")]
    api_server_address: Option<String>,
    /// Per IP family (`IPv4`); absent before the first sync.
    #[serde(skip_serializing_if = "Option::is_none")]
    status: Option<Status>,
}

/// One entry per IP family the node runs, as upstream's map keyed by family.
#[derive(Serialize)]
struct Status {
    #[serde(rename = "IPv4")]
    ipv4: FamilyHealth,
    #[serde(rename = "IPv6", skip_serializing_if = "Option::is_none")]
    ipv6: Option<FamilyHealth>,
}

/// Upstream's `ProxierHealth`: one IP family's proxier.
#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
struct FamilyHealth {
    last_updated: String,
    healthy: bool,
}

/// The answer to `GET path` (pure apart from counting it in `metrics`).
pub fn respond(path: &str, health: &Health, metrics: &Metrics) -> (StatusCode, String) {
    let (ok, node_eligible) = match path {
        "/healthz" => (
            health.healthy
                && health.node_eligible
                && health.pins_problem.is_none()
                && health.lists_missing.is_none(),
            Some(health.node_eligible),
        ),
        "/livez" => (health.healthy, None),
        _ => return (StatusCode::NOT_FOUND, "404 page not found\n".to_owned()),
    };
    let code = if ok {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    if path == "/healthz" {
        metrics.healthz_answered(code.as_u16());
    } else {
        metrics.livez_answered(code.as_u16());
    }
    let current_time = go_time(Some(health.current_time));
    let body = Payload {
        last_updated: if ok {
            current_time.clone()
        } else {
            go_time(health.last_updated)
        },
        current_time,
        node_eligible,
        healthy: health.healthy,
        pins_problem: (path == "/healthz")
            .then(|| health.pins_problem.clone())
            .flatten(),
        initial_lists_missing: (path == "/healthz")
            .then(|| health.lists_missing.clone())
            .flatten(),
        api_server_address: (path == "/healthz")
            .then(|| health.api_address.clone())
            .flatten(),
        status: health.last_updated.map(|t| {
            // One sync carries both families.
            let family = || FamilyHealth {
                last_updated: go_time(Some(t)),
                healthy: health.healthy,
            };
            Status {
                ipv4: family(),
                ipv6: health.ipv6.then(family),
            }
        }),
    };
    (code, serde_json::to_string(&body).unwrap_or_default())
}

/// Serves `/healthz` and `/livez` on `listener` until the task is dropped.
pub async fn serve_health(listener: TcpListener, state: Arc<HealthState>, metrics: Arc<Metrics>) {
    http::serve(listener, move |req| {
        let (code, body) = respond(
            req.uri().path(),
            &state.health_at(SystemTime::now()),
            &metrics,
        );
        http::reply(code, "application/json", body)
    })
    .await;
}

#[cfg(test)]
mod tests {
    use std::net::SocketAddr;

    use k8s_openapi::{
        api::core::v1::{NodeSpec, Taint},
        apimachinery::pkg::apis::meta::v1::Time,
    };

    use super::*;

    fn at(s: u64) -> SystemTime {
        SystemTime::UNIX_EPOCH + Duration::from_secs(1_700_000_000 + s)
    }

    #[test]
    fn freshness_follows_the_oldest_queued_change() {
        // (step, event, time, expect healthy)
        enum Ev {
            Queue,
            Update,
            Check,
        }
        let h = HealthState::new(Duration::from_secs(60));
        let steps = [
            ("starting, nothing queued", Ev::Check, 0, true),
            ("first change queued", Ev::Queue, 1, true),
            ("queued 59 s ago", Ev::Check, 60, true),
            (
                "another change does not reset the clock",
                Ev::Queue,
                60,
                true,
            ),
            ("queued 61 s ago, never synced", Ev::Check, 62, false),
            ("synced", Ev::Update, 63, true),
            ("idle long after a sync", Ev::Check, 10_000, true),
            ("change queued", Ev::Queue, 10_001, true),
            ("overdue again", Ev::Check, 10_062, false),
        ];
        for (what, ev, t, healthy) in steps {
            match ev {
                Ev::Queue => h.queued_at(at(t)),
                Ev::Update => h.updated_at(at(t)),
                Ev::Check => {}
            }
            assert_eq!(h.health_at(at(t)).healthy, healthy, "{what}");
        }
    }

    #[test]
    fn initial_lists_missing_past_the_timeout_fail_healthz_with_the_reason_not_livez() {
        let m = Metrics::new();
        let h = HealthState::new(Duration::from_secs(60));
        h.waiting_for_lists(at(0), "API server unreachable".into());
        h.set_api_address_problem(Some("10.96.0.1 is a ClusterIP".into()));
        let (code, body) = respond("/healthz", &h.health_at(at(30)), &m);
        assert_eq!(code, StatusCode::OK, "within the timeout: {body}");
        assert!(
            body.contains("\"apiServerAddress\":\"10.96.0.1 is a ClusterIP\""),
            "{body}"
        );
        let (code, body) = respond("/healthz", &h.health_at(at(61)), &m);
        assert_eq!(code, StatusCode::SERVICE_UNAVAILABLE, "{body}");
        assert!(
            body.contains("\"initialListsMissing\":\"the initial lists of Services, EndpointSlices and the Node have been missing for 61 s: API server unreachable\""),
            "{body}"
        );
        let (code, _) = respond("/livez", &h.health_at(at(61)), &m);
        assert_eq!(code, StatusCode::OK, "liveness: restarting would not help");
        h.updated_at(at(62));
        let (code, body) = respond("/healthz", &h.health_at(at(63)), &m);
        assert_eq!(code, StatusCode::OK, "{body}");
        assert!(!body.contains("initialListsMissing"), "{body}");
    }

    #[test]
    fn status_has_an_entry_per_family_the_node_runs() {
        let m = Metrics::new();
        let h = HealthState::default();
        h.updated_at(at(0));
        let (_, body) = respond("/healthz", &h.health_at(at(1)), &m);
        assert!(
            body.contains("\"IPv4\"") && !body.contains("\"IPv6\""),
            "{body}"
        );
        h.set_ipv6(true);
        let (_, body) = respond("/healthz", &h.health_at(at(1)), &m);
        assert!(
            body.contains("\"IPv4\"") && body.contains("\"IPv6\":{\"lastUpdated\""),
            "{body}"
        );
    }

    #[test]
    fn lost_pins_fail_healthz_with_the_reason_not_livez() {
        let m = Metrics::new();
        let h = HealthState::default();
        h.updated_at(at(0));
        h.set_pins_problem(Some("bpffs unmounted".into()));
        let (code, body) = respond("/healthz", &h.health_at(at(1)), &m);
        assert_eq!(code, StatusCode::SERVICE_UNAVAILABLE);
        assert!(
            body.contains(r#""healthy":true,"pinsProblem":"bpffs unmounted""#),
            "{body}"
        );
        let (code, body) = respond("/livez", &h.health_at(at(1)), &m);
        assert_eq!(
            code,
            StatusCode::OK,
            "a restart would not bring the pins back"
        );
        assert!(!body.contains("pinsProblem"), "{body}");
        h.set_pins_problem(None);
        let (code, body) = respond("/healthz", &h.health_at(at(1)), &m);
        assert_eq!(code, StatusCode::OK);
        assert!(!body.contains("pinsProblem"), "{body}");
    }

    #[test]
    fn healthz_needs_an_eligible_node_livez_does_not() {
        let m = Metrics::new();
        let h = HealthState::default();
        h.updated_at(at(0));
        let (code, body) = respond("/healthz", &h.health_at(at(1)), &m);
        assert_eq!(code, StatusCode::OK);
        // v1.36's body: a 200 says lastUpdated = now; the family carries the real sync time.
        assert_eq!(
            body,
            r#"{"lastUpdated":"2023-11-14T22:13:21Z","currentTime":"2023-11-14T22:13:21Z","nodeEligible":true,"healthy":true,"status":{"IPv4":{"lastUpdated":"2023-11-14T22:13:20Z","healthy":true}}}"#
        );
        h.set_node_eligible(false);
        let (code, body) = respond("/healthz", &h.health_at(at(1)), &m);
        assert_eq!(code, StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(
            body,
            r#"{"lastUpdated":"2023-11-14T22:13:20Z","currentTime":"2023-11-14T22:13:21Z","nodeEligible":false,"healthy":true,"status":{"IPv4":{"lastUpdated":"2023-11-14T22:13:20Z","healthy":true}}}"#,
            "the proxy itself is healthy; only the node is not eligible"
        );
        let (code, body) = respond("/livez", &h.health_at(at(1)), &m);
        assert_eq!(code, StatusCode::OK);
        assert!(!body.contains("nodeEligible"), "{body}");
        let (code, _) = respond("/nope", &h.health_at(at(1)), &m);
        assert_eq!(code, StatusCode::NOT_FOUND);
        let fresh = HealthState::default();
        let (_, body) = respond("/livez", &fresh.health_at(at(0)), &m);
        assert_eq!(
            body,
            r#"{"lastUpdated":"2023-11-14T22:13:20Z","currentTime":"2023-11-14T22:13:20Z","healthy":true}"#,
            "before the first sync: healthy, no per-family status"
        );
        // Overdue: 503, both levels unhealthy, lastUpdated the real last sync.
        h.set_node_eligible(true);
        h.queued_at(at(2));
        let (code, body) = respond("/livez", &h.health_at(at(100)), &m);
        assert_eq!(code, StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(
            body,
            r#"{"lastUpdated":"2023-11-14T22:13:20Z","currentTime":"2023-11-14T22:15:00Z","healthy":false,"status":{"IPv4":{"lastUpdated":"2023-11-14T22:13:20Z","healthy":false}}}"#
        );
        let text = m.encode_text();
        for line in [
            "kubeproxy_proxy_healthz_total{code=\"200\"} 1",
            "kubeproxy_proxy_healthz_total{code=\"503\"} 1",
            "kubeproxy_proxy_livez_total{code=\"200\"} 2",
            "kubeproxy_proxy_livez_total{code=\"503\"} 1",
        ] {
            assert!(text.lines().any(|l| l == line), "{line} missing in\n{text}");
        }
    }

    #[test]
    fn node_eligibility_like_upstream() {
        let mut node = Node::default();
        assert!(node_eligible(&node));
        node.spec = Some(NodeSpec {
            taints: Some(vec![Taint {
                key: "node.kubernetes.io/unschedulable".into(),
                effect: "NoSchedule".into(),
                ..Default::default()
            }]),
            ..Default::default()
        });
        assert!(node_eligible(&node), "other taints do not matter");
        node.spec
            .as_mut()
            .unwrap()
            .taints
            .as_mut()
            .unwrap()
            .push(Taint {
                key: TAINT_TO_BE_DELETED.into(),
                effect: "NoSchedule".into(),
                ..Default::default()
            });
        assert!(!node_eligible(&node));
        let mut deleting = Node::default();
        deleting.metadata.deletion_timestamp = Some(Time(Timestamp::UNIX_EPOCH));
        assert!(!node_eligible(&deleting));
    }

    async fn get(addr: SocketAddr, path: &str) -> (u16, String) {
        let (code, _, body) = http::test_http::get(addr, path, "*/*").await;
        (code, body)
    }

    #[tokio::test]
    async fn serves_over_tcp_on_loopback() {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("addr");
        let state = Arc::new(HealthState::new(Duration::from_millis(50)));
        let metrics = Arc::new(Metrics::new());
        let server = tokio::spawn(serve_health(listener, state.clone(), metrics));
        let (code, body) = get(addr, "/livez").await;
        assert_eq!(code, 200, "{body}");
        state.queued();
        tokio::time::sleep(Duration::from_millis(80)).await;
        let (code, body) = get(addr, "/healthz").await;
        assert_eq!(code, 503, "overdue change: {body}");
        state.updated();
        assert_eq!(get(addr, "/healthz").await.0, 200);
        server.abort();
    }
}
