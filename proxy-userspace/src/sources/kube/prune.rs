//! Pruning: the reflector stores keep only what `translate` reads, so a big cluster costs little
//! memory (managedFields alone are often half of an object).

use std::collections::BTreeMap;

use k8s_openapi::{
    api::{
        core::v1::{Node, Service},
        discovery::v1::EndpointSlice,
    },
    apimachinery::pkg::apis::meta::v1::ObjectMeta,
};

use crate::{pipeline::translate, sources::endpoints::LABEL_SERVICE_NAME};

/// Annotation carrying when the endpoints changed (for network programming latency).
pub const ANNOTATION_LAST_CHANGE_TRIGGER_TIME: &str =
    "endpoints.kubernetes.io/last-change-trigger-time";
/// The Node label holding the node's zone.
pub const LABEL_ZONE: &str = "topology.kubernetes.io/zone";

/// Service annotations that survive pruning (read by `translate`).
const SERVICE_ANNOTATIONS: [&str; 3] = [
    translate::ANNOTATION_TOPOLOGY_MODE,
    translate::ANNOTATION_TOPOLOGY_AWARE_HINTS,
    translate::ANNOTATION_SCHEDULER,
];
/// Service labels that survive pruning (read by `translate`).
const SERVICE_LABELS: [&str; 1] = [translate::LABEL_SERVICE_PROXY_NAME];
const SLICE_ANNOTATIONS: [&str; 1] = [ANNOTATION_LAST_CHANGE_TRIGGER_TIME];
const SLICE_LABELS: [&str; 1] = [LABEL_SERVICE_NAME];

/// Keeps name, namespace, resourceVersion and the listed labels and annotations.
fn prune_meta(meta: &mut ObjectMeta, labels: &[&str], annotations: &[&str]) {
    let keep = |map: &mut Option<BTreeMap<String, String>>, keys: &[&str]| {
        if let Some(m) = map {
            m.retain(|k, _| keys.contains(&k.as_str()));
            if m.is_empty() {
                *map = None;
            }
        }
    };
    keep(&mut meta.labels, labels);
    keep(&mut meta.annotations, annotations);
    meta.managed_fields = None;
    meta.owner_references = None;
    meta.finalizers = None;
    meta.generate_name = None;
    meta.uid = None;
    meta.creation_timestamp = None;
    meta.generation = None;
}

/// A Service also keeps its creationTimestamp (the older Service wins a contested frontend) and
/// uid (the Event about a lost frontend refers to it).
pub fn service(svc: &mut Service) {
    let created = svc.metadata.creation_timestamp.take();
    let uid = svc.metadata.uid.take();
    prune_meta(&mut svc.metadata, &SERVICE_LABELS, &SERVICE_ANNOTATIONS);
    svc.metadata.creation_timestamp = created;
    svc.metadata.uid = uid;
    if let Some(spec) = &mut svc.spec {
        // The pod selector is the EndpointSlice controller's business, not the proxy's.
        spec.selector = None;
    }
    if let Some(status) = &mut svc.status {
        status.conditions = None;
    }
}

pub fn endpoint_slice(slice: &mut EndpointSlice) {
    prune_meta(&mut slice.metadata, &SLICE_LABELS, &SLICE_ANNOTATIONS);
    for ep in slice.endpoints.iter_mut().flatten() {
        ep.target_ref = None;
        ep.deprecated_topology = None;
        ep.hostname = None;
    }
}

/// A Node keeps its name, labels (the zone; the agent's DaemonSet may select nodes by any of
/// them: `uninstall`), deletion timestamp and the autoscaler's deletion taint (what /healthz's
/// node eligibility reads): the rest (status, images, conditions) is large and changes every few
/// seconds.
pub fn node(node: &mut Node) {
    let labels = node.metadata.labels.take();
    prune_meta(&mut node.metadata, &[], &[]);
    node.metadata.labels = labels;
    let taints = node.spec.take().and_then(|s| s.taints).map(|t| {
        t.into_iter()
            .filter(|t| t.key == crate::serving::health::TAINT_TO_BE_DELETED)
            .collect::<Vec<_>>()
    });
    node.spec =
        taints
            .filter(|t| !t.is_empty())
            .map(|taints| k8s_openapi::api::core::v1::NodeSpec {
                taints: Some(taints),
                ..Default::default()
            });
    node.status = None;
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    #[test]
    fn pruning_keeps_what_translate_reads() {
        let mut svc: Service = serde_json::from_value(json!({
            "metadata": {"name": "web", "namespace": "demo", "uid": "u", "resourceVersion": "7",
                "creationTimestamp": "2026-01-02T03:04:05Z", "generation": 3,
                "labels": {"app": "web", "service.kubernetes.io/service-proxy-name": "x"},
                "annotations": {"kubectl.kubernetes.io/last-applied-configuration": "{...}",
                                "service.kubernetes.io/topology-mode": "Auto",
                                "kube-proxy-ebpf.io/scheduler": "rr"},
                "managedFields": [{"manager": "kubectl", "operation": "Apply"}]},
            "spec": {"clusterIP": "10.96.0.10", "selector": {"app": "web"},
                     "ports": [{"port": 80, "targetPort": 8080}]}
        }))
        .expect("service");
        service(&mut svc);
        let v = serde_json::to_value(&svc).expect("json");
        assert_eq!(
            v["metadata"],
            json!({"name": "web", "namespace": "demo", "resourceVersion": "7", "uid": "u",
                   "creationTimestamp": "2026-01-02T03:04:05Z",
                   "labels": {"service.kubernetes.io/service-proxy-name": "x"},
                   "annotations": {"service.kubernetes.io/topology-mode": "Auto",
                                   "kube-proxy-ebpf.io/scheduler": "rr"}})
        );
        assert_eq!(v["spec"]["clusterIP"], "10.96.0.10");
        assert!(v["spec"].get("selector").is_none());

        let mut slice: EndpointSlice = serde_json::from_value(json!({
            "addressType": "IPv4",
            "metadata": {"name": "web-abc", "namespace": "demo",
                "labels": {"kubernetes.io/service-name": "web", "endpointslice.kubernetes.io/managed-by": "x"},
                "annotations": {"endpoints.kubernetes.io/last-change-trigger-time": "2026-01-01T00:00:00Z", "other": "y"}},
            "endpoints": [{"addresses": ["10.0.0.1"], "nodeName": "n1", "zone": "a",
                           "targetRef": {"kind": "Pod", "name": "web-1"},
                           "hints": {"forZones": [{"name": "a"}]},
                           "conditions": {"ready": true}}],
            "ports": [{"port": 8080}]
        }))
        .expect("slice");
        endpoint_slice(&mut slice);
        let v = serde_json::to_value(&slice).expect("json");
        assert_eq!(
            v["metadata"]["labels"],
            json!({"kubernetes.io/service-name": "web"})
        );
        assert_eq!(
            v["metadata"]["annotations"],
            json!({"endpoints.kubernetes.io/last-change-trigger-time": "2026-01-01T00:00:00Z"})
        );
        assert_eq!(
            v["endpoints"][0],
            json!({"addresses": ["10.0.0.1"], "nodeName": "n1", "zone": "a",
                   "hints": {"forZones": [{"name": "a"}]}, "conditions": {"ready": true}})
        );

        let mut n: Node = serde_json::from_value(json!({
            "metadata": {"name": "n1", "labels": {"topology.kubernetes.io/zone": "a", "kubernetes.io/os": "linux"}},
            "status": {"addresses": [{"type": "InternalIP", "address": "192.0.2.1"}]}
        }))
        .expect("node");
        node(&mut n);
        let v = serde_json::to_value(&n).expect("json");
        // Every label stays: the agent's DaemonSet may select nodes by any of them.
        assert_eq!(
            v,
            json!({"apiVersion": "v1", "kind": "Node",
                   "metadata": {"name": "n1", "labels": {"topology.kubernetes.io/zone": "a",
                                                         "kubernetes.io/os": "linux"}}})
        );
    }

    #[test]
    fn node_pruning_keeps_what_health_eligibility_reads() {
        let mut n: Node = serde_json::from_value(json!({
            "metadata": {"name": "n1", "deletionTimestamp": "2026-01-01T00:00:00Z"},
            "spec": {"podCIDR": "10.244.1.0/24", "taints": [
                {"key": "node.kubernetes.io/unschedulable", "effect": "NoSchedule"},
                {"key": "ToBeDeletedByClusterAutoscaler", "value": "1", "effect": "NoSchedule"}]}
        }))
        .expect("node");
        node(&mut n);
        let spec = n.spec.as_ref().expect("taint kept");
        assert_eq!(spec.pod_cidr, None);
        let taints = spec.taints.as_ref().expect("taints");
        assert_eq!(taints.len(), 1);
        assert_eq!(taints[0].key, "ToBeDeletedByClusterAutoscaler");
        assert!(n.metadata.deletion_timestamp.is_some());
        assert!(!crate::serving::health::node_eligible(&n));

        let mut plain: Node =
            serde_json::from_value(json!({"metadata": {"name": "n2"}, "spec": {"taints": [
                {"key": "node.kubernetes.io/unschedulable", "effect": "NoSchedule"}]}}))
            .expect("node");
        node(&mut plain);
        assert!(plain.spec.is_none(), "unrelated taints are dropped");
        assert!(crate::serving::health::node_eligible(&plain));
    }
}
