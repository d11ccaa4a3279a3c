//! Events about Services (Kubernetes mode): a Warning on a Service that lost a frontend to
//! another Service ([`FrontendConflict`]).
//!
//! Bounded: an Event is published when a conflict appears (not at every sync while it lasts; a
//! conflict that goes away and comes back is published again), the conflicts a sync finds
//! between the same two Services make one Event, and the queue to the publishing task is bounded
//! (a full queue drops, with a debug line: the Problem is logged and counted anyway).

use std::collections::{BTreeMap, BTreeSet};

use k8s_openapi::api::core::v1::ObjectReference;
use kube::{
    Client,
    runtime::events::{Event, EventType, Recorder, Reporter},
};
use tokio::sync::mpsc;
use tracing::{debug, warn};

use crate::{
    pipeline::{model::FrontendConflict, translate},
    sources::{services::ServiceData, snapshot::Snapshot},
};

/// The reporting controller's name on our Events.
pub const REPORTING_CONTROLLER: &str = "kube-proxy-ebpf";
/// `reason` of the Event on a Service that lost a frontend.
pub const REASON_FRONTEND_CONFLICT: &str = "FrontendConflict";
/// `action` of that Event: the frontend was not programmed for this Service.
pub const ACTION_SKIP_FRONTEND: &str = "SkipFrontend";
/// Events waiting for the publishing task, at most.
const QUEUE: usize = 256;
/// The API's limit on an Event's note.
const NOTE_MAX_BYTES: usize = 1024;

/// One Event to publish: about `regarding` (the losing Service), related to the winner.
#[derive(Clone, Debug, PartialEq)]
pub struct ServiceEvent {
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
        let uids: BTreeMap<ServiceKey, Option<String>> = snapshot
            .services
            .iter()
            .filter_map(|s| Some((key_of(s)?, s.uid.as_deref().map(str::to_owned))))
            .collect();
        let reference = |key: &ServiceKey| ObjectReference {
            api_version: Some("v1".into()),
            kind: Some("Service".into()),
            namespace: Some(key.0.clone()),
            name: Some(key.1.clone()),
            uid: uids.get(key).cloned().flatten(),
            ..Default::default()
        };
        pairs
            .into_iter()
            .map(|((loser, winner), reasons)| ServiceEvent {
                regarding: reference(&loser),
                related: Some(reference(&winner)),
                note: truncate(reasons.join("; "), NOTE_MAX_BYTES),
            })
            .collect()
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
                    reason: REASON_FRONTEND_CONFLICT.into(),
                    note: Some(e.note),
                    action: ACTION_SKIP_FRONTEND.into(),
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
    fn long_notes_are_cut_on_a_character_boundary() {
        let s = truncate("é".repeat(600), NOTE_MAX_BYTES);
        assert!(s.len() <= NOTE_MAX_BYTES && s.ends_with('…'), "{}", s.len());
        assert_eq!(truncate("short".into(), NOTE_MAX_BYTES), "short");
    }
}
