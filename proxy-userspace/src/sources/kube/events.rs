//! Events about Services (Kubernetes mode), Warnings:
//! - on a Service that lost a frontend to another Service ([`FrontendConflict`],
//!   [`ConflictEvents`]);
//! - on a Service whose frontend the dataplane could not program as desired: a map full, more
//!   backends than a frontend carries ([`SkippedFrontend`], [`SkipEvents`]).
//!
//! Bounded: an Event is published when a problem appears (not at every sync while it lasts; one
//! that goes away and comes back is published again), the problems a sync finds for the same
//! Service (and, for conflicts, the same winner) make one Event, and the queue to the publishing
//! task is bounded (a full queue drops, with a debug line: the Problem is logged and counted
//! anyway).

use std::collections::{BTreeMap, BTreeSet};

use k8s_openapi::api::core::v1::ObjectReference;
use kube::{
    Client,
    runtime::events::{Event, EventType, Recorder, Reporter},
};
use tokio::sync::mpsc;
use tracing::{debug, warn};

use crate::{
    pipeline::{
        model::{FrontendConflict, SkippedFrontend},
        translate,
    },
    sources::{services::ServiceData, snapshot::Snapshot},
};

/// The reporting controller's name on our Events.
pub const REPORTING_CONTROLLER: &str = "kube-proxy-ebpf";
/// `reason` of the Event on a Service that lost a frontend.
pub const REASON_FRONTEND_CONFLICT: &str = "FrontendConflict";
/// `action` of that Event: the frontend was not programmed for this Service.
pub const ACTION_SKIP_FRONTEND: &str = "SkipFrontend";
/// `reason` of the Event on a Service whose frontend hit a dataplane limit (a map full, too
/// many backends).
pub const REASON_DATAPLANE_LIMIT: &str = "DataplaneLimit";
/// `action` of that Event: programming the frontend (not done, or done without its Maglev
/// table, as the note says).
pub const ACTION_PROGRAM_FRONTEND: &str = "ProgramFrontend";
/// Events waiting for the publishing task, at most.
const QUEUE: usize = 256;
/// The API's limit on an Event's note.
const NOTE_MAX_BYTES: usize = 1024;

/// One Event to publish: about `regarding` (the Service with the problem), related to another
/// (a conflict's winner).
#[derive(Clone, Debug, PartialEq)]
pub struct ServiceEvent {
    pub reason: &'static str,
    pub action: &'static str,
    pub regarding: ObjectReference,
    pub related: Option<ObjectReference>,
    pub note: String,
}

/// Which conflicts were already published (pure; the agent keeps one).
#[derive(Debug, Default)]
pub struct ConflictEvents {
    published: BTreeSet<FrontendConflict>,
}

impl ConflictEvents {
    /// The Events for the conflicts in `now` that were not there at the last call, one per
    /// (loser, winner) pair; Services are looked up in `snapshot` for their uid.
    pub fn appeared(&mut self, now: &[FrontendConflict], snapshot: &Snapshot) -> Vec<ServiceEvent> {
        let now: BTreeSet<FrontendConflict> = now.iter().cloned().collect();
        let mut pairs: BTreeMap<(ServiceKey, ServiceKey), Vec<String>> = BTreeMap::new();
        for c in now.difference(&self.published) {
            let key = (service_key(&c.loser), service_key(&c.winner));
            pairs
                .entry(key)
                .or_default()
                .push(translate::conflict_problem(c).reason);
        }
        self.published = now;
        if pairs.is_empty() {
            return Vec::new();
        }
        let reference = references(snapshot);
        pairs
            .into_iter()
            .map(|((loser, winner), reasons)| ServiceEvent {
                reason: REASON_FRONTEND_CONFLICT,
                action: ACTION_SKIP_FRONTEND,
                regarding: reference(&loser),
                related: Some(reference(&winner)),
                note: truncate(reasons.join("; "), NOTE_MAX_BYTES),
            })
            .collect()
    }
}

/// Which skipped frontends were already published (pure; the agent keeps one).
#[derive(Debug, Default)]
pub struct SkipEvents {
    /// (Service, frontend) pairs skipped at the last call.
    published: BTreeSet<(ServiceKey, String)>,
}

impl SkipEvents {
    /// The Events for the frontends in `now` that were not skipped at the last call, one per
    /// Service (its new frontends' reasons in the note); the plan retries a skipped frontend at
    /// every sync, so `now` is the whole list each time.
    pub fn appeared(&mut self, now: &[SkippedFrontend], snapshot: &Snapshot) -> Vec<ServiceEvent> {
        let mut by_service: BTreeMap<ServiceKey, Vec<String>> = BTreeMap::new();
        let mut current = BTreeSet::new();
        for skip in now {
            let key = service_key(&skip.service);
            if current.insert((key.clone(), skip.frontend.clone()))
                && !self
                    .published
                    .contains(&(key.clone(), skip.frontend.clone()))
            {
                (by_service.entry(key).or_default())
                    .push(format!("frontend {}: {}", skip.frontend, skip.reason));
            }
        }
        self.published = current;
        if by_service.is_empty() {
            return Vec::new();
        }
        let reference = references(snapshot);
        by_service
            .into_iter()
            .map(|(service, reasons)| ServiceEvent {
                reason: REASON_DATAPLANE_LIMIT,
                action: ACTION_PROGRAM_FRONTEND,
                regarding: reference(&service),
                related: None,
                note: truncate(reasons.join("; "), NOTE_MAX_BYTES),
            })
            .collect()
    }
}

/// A Service's object reference (with its uid from `snapshot`, when it has one).
fn references(snapshot: &Snapshot) -> impl Fn(&ServiceKey) -> ObjectReference {
    let uids: BTreeMap<ServiceKey, Option<String>> = snapshot
        .services
        .iter()
        .filter_map(|s| Some((key_of(s)?, s.uid.as_deref().map(str::to_owned))))
        .collect();
    move |key: &ServiceKey| ObjectReference {
        api_version: Some("v1".into()),
        kind: Some("Service".into()),
        namespace: Some(key.0.clone()),
        name: Some(key.1.clone()),
        uid: uids.get(key).cloned().flatten(),
        ..Default::default()
    }
}

type ServiceKey = (String, String);

fn service_key(s: &crate::pipeline::model::ServicePortName) -> ServiceKey {
    (s.namespace.clone(), s.name.clone())
}

fn key_of(svc: &ServiceData) -> Option<ServiceKey> {
    let namespace = svc.namespace.as_deref().unwrap_or("default");
    Some((namespace.to_owned(), svc.name.as_deref()?.to_owned()))
}

/// `s` cut to at most `max` bytes on a character boundary (with "…" when cut).
fn truncate(mut s: String, max: usize) -> String {
    if s.len() <= max {
        return s;
    }
    let ellipsis = "…";
    let mut end = max - ellipsis.len();
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    s.truncate(end);
    s.push_str(ellipsis);
    s
}

/// Publishes [`ServiceEvent`]s from a background task (kube-rs [`Recorder`]).
#[derive(Clone, Debug)]
pub struct EventSink {
    tx: mpsc::Sender<ServiceEvent>,
}

impl EventSink {
    /// Starts the publishing task on the current runtime; `instance` is this node's name.
    pub fn start(client: Client, instance: &str) -> Self {
        let (tx, mut rx) = mpsc::channel::<ServiceEvent>(QUEUE);
        let recorder = Recorder::new(
            client,
            Reporter {
                controller: REPORTING_CONTROLLER.into(),
                instance: Some(instance.to_owned()),
            },
        );
        tokio::spawn(async move {
            while let Some(e) = rx.recv().await {
                let event = Event {
                    type_: EventType::Warning,
                    reason: e.reason.into(),
                    note: Some(e.note),
                    action: e.action.into(),
                    secondary: e.related,
                };
                if let Err(err) = recorder.publish(&event, &e.regarding).await {
                    let name = e.regarding.name.unwrap_or_default();
                    let namespace = e.regarding.namespace.unwrap_or_default();
                    warn!("publishing an Event on Service {namespace}/{name}: {err}");
                }
            }
        });
        Self { tx }
    }

    /// Queues `events`; drops them when the queue is full.
    pub fn send(&self, events: Vec<ServiceEvent>) {
        for e in events {
            if self.tx.try_send(e).is_err() {
                debug!("event queue full or closed; Event dropped (the problem is logged)");
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::{net::Ipv4Addr, sync::Arc};

    use serde_json::json;

    use super::*;
    use crate::pipeline::model::{ClaimRule, Frontend, FrontendKind, Protocol, ServicePortName};

    fn port(namespace: &str, name: &str, port_name: &str) -> ServicePortName {
        ServicePortName {
            namespace: namespace.into(),
            name: name.into(),
            port_name: port_name.into(),
        }
    }

    fn conflict(port_number: u16, loser: &str, winner: &str) -> FrontendConflict {
        FrontendConflict {
            frontend: Frontend::new(Ipv4Addr::new(10, 96, 0, 10), port_number, Protocol::Udp),
            loser: port("a", loser, "dns"),
            loser_kind: FrontendKind::ExternalIp,
            winner: port("kube-system", winner, "dns"),
            winner_kind: FrontendKind::ClusterIp,
            rule: ClaimRule::ClusterIpFirst,
        }
    }

    #[test]
    fn one_event_per_appearance_and_pair_with_the_services_uids() {
        let svc = |ns: &str, name: &str, uid: &str| {
            Arc::new(ServiceData::from(
                serde_json::from_value::<k8s_openapi::api::core::v1::Service>(
                    json!({"metadata": {"namespace": ns, "name": name, "uid": uid}}),
                )
                .expect("Service"),
            ))
        };
        let snapshot = Snapshot {
            services: Arc::new(vec![
                svc("a", "intruder", "u-1"),
                svc("kube-system", "kube-dns", "u-2"),
            ]),
            endpoint_slices: Arc::default(),
        };
        let mut events = ConflictEvents::default();
        let two_ports = [
            conflict(53, "intruder", "kube-dns"),
            conflict(54, "intruder", "kube-dns"),
        ];
        let first = events.appeared(&two_ports, &snapshot);
        assert_eq!(first.len(), 1, "one Event for the pair: {first:?}");
        let e = &first[0];
        assert_eq!(e.regarding.name.as_deref(), Some("intruder"));
        assert_eq!(e.regarding.namespace.as_deref(), Some("a"));
        assert_eq!(e.regarding.uid.as_deref(), Some("u-1"));
        assert_eq!(e.regarding.kind.as_deref(), Some("Service"));
        let related = e.related.as_ref().expect("related");
        assert_eq!(related.name.as_deref(), Some("kube-dns"));
        assert_eq!(related.uid.as_deref(), Some("u-2"));
        assert!(e.note.contains("10.96.0.10:53/UDP"), "{}", e.note);
        assert!(e.note.contains("10.96.0.10:54/UDP"), "{}", e.note);

        assert_eq!(
            events.appeared(&two_ports, &snapshot),
            [],
            "no Event per sync"
        );
        assert_eq!(
            events.appeared(&two_ports[..1], &snapshot),
            [],
            "one conflict gone"
        );
        let back = events.appeared(&two_ports, &snapshot);
        assert_eq!(
            back.len(),
            1,
            "a conflict that comes back is published again"
        );
        assert!(back[0].note.contains(":54/UDP") && !back[0].note.contains(":53/UDP"));
        assert_eq!(events.appeared(&[], &snapshot), []);
    }

    #[test]
    fn a_skipped_frontend_becomes_one_event_per_service_when_it_first_appears() {
        let snapshot = Snapshot {
            services: Arc::new(vec![Arc::new(ServiceData::from(
                serde_json::from_value::<k8s_openapi::api::core::v1::Service>(
                    json!({"metadata": {"namespace": "demo", "name": "full-1", "uid": "u-1"}}),
                )
                .expect("Service"),
            ))]),
            endpoint_slices: Arc::default(),
        };
        let skip = |name: &str, frontend: &str| SkippedFrontend {
            service: port("demo", name, "http"),
            frontend: frontend.into(),
            reason: format!(
                "demo/{name}:http: SERVICES map full (needs 4 more entries, 12 of 14 in use); not programmed"
            ),
        };
        let all = [
            skip("full-1", "10.96.1.1:80/TCP"),
            skip("full-1", "10.96.1.1:81/TCP"),
            skip("full-2", "10.96.1.2:80/TCP"),
        ];
        let mut events = SkipEvents::default();
        let first = events.appeared(&all, &snapshot);
        assert_eq!(first.len(), 2, "one Event per Service: {first:?}");
        let e = &first[0];
        assert_eq!(
            (e.reason, e.action),
            (REASON_DATAPLANE_LIMIT, ACTION_PROGRAM_FRONTEND)
        );
        assert_eq!(e.regarding.name.as_deref(), Some("full-1"));
        assert_eq!(e.regarding.uid.as_deref(), Some("u-1"));
        assert_eq!(e.related, None);
        assert!(
            e.note
                .contains("frontend 10.96.1.1:80/TCP: demo/full-1:http: SERVICES map full")
                && e.note.contains("frontend 10.96.1.1:81/TCP"),
            "{}",
            e.note
        );
        assert_eq!(first[1].regarding.name.as_deref(), Some("full-2"));
        assert_eq!(first[1].regarding.uid, None, "not in the snapshot");

        assert_eq!(events.appeared(&all, &snapshot), [], "no Event per sync");
        assert_eq!(events.appeared(&all[..1], &snapshot), [], "two fit now");
        let back = events.appeared(&all, &snapshot);
        assert_eq!(back.len(), 2, "skipped again, published again: {back:?}");
        assert!(back[0].note.contains(":81/TCP") && !back[0].note.contains(":80/TCP"));
        assert_eq!(events.appeared(&[], &snapshot), []);
    }

    #[test]
    fn long_notes_are_cut_on_a_character_boundary() {
        let s = truncate("é".repeat(600), NOTE_MAX_BYTES);
        assert!(s.len() <= NOTE_MAX_BYTES && s.ends_with('…'), "{}", s.len());
        assert_eq!(truncate("short".into(), NOTE_MAX_BYTES), "short");
    }
}
