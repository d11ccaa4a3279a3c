//! Telling an uninstall from a restart.
//!
//! A DaemonSet's pod gets the same SIGTERM when it is rolled (an upgrade), when its node drains
//! or shuts down, and when the DaemonSet is deleted. The datapath must outlive the first ones
//! (every flow kept, the next agent adopts it) and must not outlive the last: a removed agent
//! whose programs stay attached would shadow kube-proxy with frozen maps. So the agent watches
//! its own DaemonSet (`--daemonset`) and, told to stop, decides from it and its Node:
//! - the DaemonSet is gone, or being deleted (a deletionTimestamp: foreground deletion) →
//!   uninstall;
//! - the DaemonSet's pod template no longer selects this node (its nodeSelector or required node
//!   affinity, against the Node's labels and name: a node opting out by label) → uninstall;
//! - anything else, and whatever it cannot know (no `--daemonset`, never listed, the API server
//!   unreachable and the watch silent) → keep the datapath, as for a restart.
//!
//! The watch delivers a deletion before the pods are told to stop (the garbage collector deletes
//! them after their owner), and at the stop a fresh GET confirms what the store says, so a watch
//! lagging by a moment cannot keep a deleted DaemonSet alive. The decision itself is pure
//! ([`decide`], [`selects`]).

use std::{collections::BTreeMap, fmt, str::FromStr, time::Duration};

use k8s_openapi::api::{
    apps::v1::DaemonSet,
    core::v1::{Node, NodeSelectorRequirement, NodeSelectorTerm, PodSpec},
};

/// The agent's own DaemonSet, `NAMESPACE/NAME` (`--daemonset`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DaemonSetRef {
    pub namespace: String,
    pub name: String,
}

impl FromStr for DaemonSetRef {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        match s.trim().split_once('/') {
            Some((ns, name)) if !ns.is_empty() && !name.is_empty() && !name.contains('/') => {
                Ok(Self {
                    namespace: ns.to_owned(),
                    name: name.to_owned(),
                })
            }
            _ => Err(format!(
                "{s:?} is not NAMESPACE/NAME (e.g. kube-system/kube-proxy-ebpf)"
            )),
        }
    }
}

impl fmt::Display for DaemonSetRef {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.namespace, self.name)
    }
}

/// What a stop does with the datapath.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Stop {
    /// Leave it attached and pinned for the next agent (why, for the log).
    Keep(String),
    /// Remove it: the agent is being uninstalled from this node (why, for the log).
    Uninstall(String),
}

/// What the agent knows of its DaemonSet at the stop.
#[derive(Clone, Copy, Debug)]
pub enum Owner<'a> {
    /// Never listed (or no `--daemonset`): nothing can be concluded.
    Unknown,
    /// Listed, and not there.
    Gone,
    Present(&'a DaemonSet),
}

/// The stop's verdict (see the module doc). `node`: this node's Node object as last seen.
pub fn decide(ds: &DaemonSetRef, owner: Owner<'_>, node: Option<&Node>, node_name: &str) -> Stop {
    let ds_obj = match owner {
        Owner::Unknown => {
            return Stop::Keep(format!(
                "DaemonSet {ds} not known (never listed): treated as a restart"
            ));
        }
        Owner::Gone => return Stop::Uninstall(format!("DaemonSet {ds} was deleted")),
        Owner::Present(obj) => obj,
    };
    if ds_obj.metadata.deletion_timestamp.is_some() {
        return Stop::Uninstall(format!("DaemonSet {ds} is being deleted"));
    }
    let Some(spec) = ds_obj.spec.template.spec.as_ref() else {
        return Stop::Keep(format!("DaemonSet {ds} has no pod spec"));
    };
    let Some(node) = node else {
        return Stop::Keep(format!(
            "Node {node_name} not known: DaemonSet {ds} present, treated as a restart"
        ));
    };
    let empty = BTreeMap::new();
    let labels = node.metadata.labels.as_ref().unwrap_or(&empty);
    if selects(spec, node_name, labels) {
        Stop::Keep(format!("DaemonSet {ds} present and selects this node"))
    } else {
        Stop::Uninstall(format!(
            "DaemonSet {ds} no longer selects node {node_name} (nodeSelector or node affinity against its labels)"
        ))
    }
}

/// Does a pod spec's node selection admit the node `name` with `labels`? Its nodeSelector (every
/// pair) and its required node affinity (any term; within a term every expression and field),
/// as the scheduler and the DaemonSet controller read them. Taints are left out: a DaemonSet
/// that replaces kube-proxy tolerates them all.
pub fn selects(spec: &PodSpec, name: &str, labels: &BTreeMap<String, String>) -> bool {
    let selector_ok = spec
        .node_selector
        .iter()
        .flatten()
        .all(|(k, v)| labels.get(k) == Some(v));
    let required = spec
        .affinity
        .as_ref()
        .and_then(|a| a.node_affinity.as_ref())
        .and_then(|n| {
            n.required_during_scheduling_ignored_during_execution
                .as_ref()
        });
    let affinity_ok = required.is_none_or(|r| {
        r.node_selector_terms
            .iter()
            .any(|t| term_matches(t, name, labels))
    });
    selector_ok && affinity_ok
}

/// One nodeSelectorTerm: an empty term matches nothing (upstream's rule).
fn term_matches(term: &NodeSelectorTerm, name: &str, labels: &BTreeMap<String, String>) -> bool {
    let exprs = term.match_expressions.as_deref().unwrap_or_default();
    let fields = term.match_fields.as_deref().unwrap_or_default();
    if exprs.is_empty() && fields.is_empty() {
        return false;
    }
    let mut name_field = BTreeMap::new();
    name_field.insert("metadata.name".to_owned(), name.to_owned());
    exprs.iter().all(|e| requirement_matches(e, labels))
        && fields
            .iter()
            .all(|f| requirement_matches(f, &name_field) && f.key == "metadata.name")
}

fn requirement_matches(r: &NodeSelectorRequirement, labels: &BTreeMap<String, String>) -> bool {
    let value = labels.get(&r.key);
    let values = r.values.as_deref().unwrap_or_default();
    let number = |s: &str| s.parse::<i64>().ok();
    match r.operator.as_str() {
        "In" => value.is_some_and(|v| values.contains(v)),
        "NotIn" => value.is_none_or(|v| !values.contains(v)),
        "Exists" => value.is_some(),
        "DoesNotExist" => value.is_none(),
        "Gt" | "Lt" => {
            let (Some(have), [want]) = (value.and_then(|v| number(v)), values) else {
                return false;
            };
            let Some(want) = number(want) else {
                return false;
            };
            if r.operator == "Gt" {
                have > want
            } else {
                have < want
            }
        }
        _ => false,
    }
}

/// How long the stop waits for the fresh GET of the DaemonSet before it goes by the watch.
pub const CONFIRM_TIMEOUT: Duration = Duration::from_secs(2);

/// A DaemonSet as the watch keeps it: its name, namespace and deletion timestamp, and the node
/// selection of its pod template; nothing else (the pod template is most of the object).
pub fn prune(mut ds: DaemonSet) -> DaemonSet {
    ds.metadata.managed_fields = None;
    ds.metadata.annotations = None;
    ds.status = None;
    let template = ds.spec.template.spec.take().map(|pod| PodSpec {
        node_selector: pod.node_selector,
        affinity: pod.affinity.map(|a| k8s_openapi::api::core::v1::Affinity {
            node_affinity: a.node_affinity,
            ..Default::default()
        }),
        ..Default::default()
    });
    ds.spec.template = k8s_openapi::api::core::v1::PodTemplateSpec {
        metadata: None,
        spec: template,
    };
    ds
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn ds(spec: serde_json::Value) -> DaemonSet {
        serde_json::from_value(json!({
            "metadata": {"name": "kube-proxy-ebpf", "namespace": "kube-system"},
            "spec": {"selector": {"matchLabels": {"app": "x"}},
                     "template": {"metadata": {"labels": {"app": "x"}}, "spec": spec}}
        }))
        .unwrap()
    }

    fn node(labels: serde_json::Value) -> Node {
        serde_json::from_value(json!({"metadata": {"name": "node-1", "labels": labels}})).unwrap()
    }

    fn r() -> DaemonSetRef {
        "kube-system/kube-proxy-ebpf".parse().unwrap()
    }

    const OPT_OUT: &str = "kube-proxy-ebpf.io/opt-out";

    fn opt_out_affinity() -> serde_json::Value {
        json!({"containers": [], "nodeSelector": {"kubernetes.io/os": "linux"},
               "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
                   "nodeSelectorTerms": [{"matchExpressions": [
                       {"key": OPT_OUT, "operator": "NotIn", "values": ["true"]}]}]}}}})
    }

    #[test]
    fn a_deleted_or_deleting_daemonset_uninstalls_a_present_one_restarts() {
        let n = node(json!({"kubernetes.io/os": "linux"}));
        let present = ds(opt_out_affinity());
        assert!(matches!(
            decide(&r(), Owner::Present(&present), Some(&n), "node-1"),
            Stop::Keep(_)
        ));
        assert!(matches!(
            decide(&r(), Owner::Gone, Some(&n), "node-1"),
            Stop::Uninstall(_)
        ));
        let mut deleting = present.clone();
        deleting.metadata.deletion_timestamp =
            Some(k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(
                "2026-12-04T18:00:00Z".parse().unwrap(),
            ));
        assert!(matches!(
            decide(&r(), Owner::Present(&deleting), Some(&n), "node-1"),
            Stop::Uninstall(_)
        ));
        assert!(matches!(
            decide(&r(), Owner::Unknown, Some(&n), "node-1"),
            Stop::Keep(_)
        ));
        assert!(
            matches!(
                decide(&r(), Owner::Present(&present), None, "node-1"),
                Stop::Keep(_)
            ),
            "the Node never seen: no conclusion"
        );
    }

    #[test]
    fn a_node_that_opted_out_by_label_uninstalls() {
        let present = ds(opt_out_affinity());
        let out = node(json!({"kubernetes.io/os": "linux", OPT_OUT: "true"}));
        assert_eq!(
            decide(&r(), Owner::Present(&present), Some(&out), "node-1"),
            Stop::Uninstall(
                "DaemonSet kube-system/kube-proxy-ebpf no longer selects node node-1 (nodeSelector or node affinity against its labels)".into()
            )
        );
        let windows = node(json!({"kubernetes.io/os": "windows"}));
        assert!(matches!(
            decide(&r(), Owner::Present(&present), Some(&windows), "node-1"),
            Stop::Uninstall(_)
        ));
    }

    #[test]
    fn node_selection_follows_the_scheduler_rules() {
        let labels: BTreeMap<String, String> = [
            ("zone".to_owned(), "a".to_owned()),
            ("cpus".to_owned(), "8".to_owned()),
        ]
        .into();
        let spec = |affinity: serde_json::Value| -> PodSpec {
            serde_json::from_value(json!({"containers": [], "affinity": {"nodeAffinity": {
                "requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": affinity}}}}))
            .unwrap()
        };
        let e = |key: &str, op: &str, values: &[&str]| json!({"key": key, "operator": op, "values": values});
        let cases = [
            (
                json!([{"matchExpressions": [e("zone", "In", &["a", "b"])]}]),
                true,
            ),
            (
                json!([{"matchExpressions": [e("zone", "In", &["b"])]}]),
                false,
            ),
            (
                json!([{"matchExpressions": [e("zone", "NotIn", &["b"])]}]),
                true,
            ),
            (
                json!([{"matchExpressions": [e("gpu", "NotIn", &["x"])]}]),
                true,
            ),
            (
                json!([{"matchExpressions": [{"key": "zone", "operator": "Exists"}]}]),
                true,
            ),
            (
                json!([{"matchExpressions": [{"key": "zone", "operator": "DoesNotExist"}]}]),
                false,
            ),
            (
                json!([{"matchExpressions": [e("cpus", "Gt", &["4"])]}]),
                true,
            ),
            (
                json!([{"matchExpressions": [e("cpus", "Lt", &["4"])]}]),
                false,
            ),
            (
                json!([{"matchExpressions": [e("zone", "Gt", &["4"])]}]),
                false,
            ),
            // Terms are ORed, expressions within one ANDed.
            (
                json!([{"matchExpressions": [e("zone", "In", &["b"])]},
                    {"matchExpressions": [e("cpus", "In", &["8"])]}]),
                true,
            ),
            (
                json!([{"matchExpressions": [e("zone", "In", &["a"]), e("cpus", "In", &["4"])]}]),
                false,
            ),
            (
                json!([{"matchFields": [e("metadata.name", "In", &["node-1"])]}]),
                true,
            ),
            (
                json!([{"matchFields": [e("metadata.name", "NotIn", &["node-1"])]}]),
                false,
            ),
            (json!([{}]), false),
            (
                json!([{"matchExpressions": [e("zone", "Near", &["a"])]}]),
                false,
            ),
        ];
        for (terms, want) in cases {
            assert_eq!(
                selects(&spec(terms.clone()), "node-1", &labels),
                want,
                "{terms}"
            );
        }
        let plain: PodSpec = serde_json::from_value(json!({"containers": []})).unwrap();
        assert!(selects(&plain, "node-1", &labels));
        let selector: PodSpec =
            serde_json::from_value(json!({"containers": [], "nodeSelector": {"zone": "b"}}))
                .unwrap();
        assert!(!selects(&selector, "node-1", &labels));
    }

    #[test]
    fn pruning_keeps_the_node_selection_and_the_deletion() {
        let mut full = ds(opt_out_affinity());
        full.metadata.deletion_timestamp =
            Some(k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(
                "2026-12-04T18:00:00Z".parse().unwrap(),
            ));
        let pruned = prune(full.clone());
        let spec = pruned.spec.template.spec.as_ref().unwrap();
        assert_eq!(
            spec.node_selector,
            full.spec.template.spec.as_ref().unwrap().node_selector
        );
        assert!(spec.affinity.as_ref().unwrap().node_affinity.is_some());
        assert!(pruned.metadata.deletion_timestamp.is_some());
    }

    #[test]
    fn the_flag_is_namespace_slash_name() {
        assert_eq!(r().to_string(), "kube-system/kube-proxy-ebpf");
        for bad in ["kube-proxy-ebpf", "/x", "x/", "a/b/c", ""] {
            assert!(bad.parse::<DaemonSetRef>().is_err(), "{bad}");
        }
    }
}
