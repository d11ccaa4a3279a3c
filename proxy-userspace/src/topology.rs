//! Which endpoints of a Service port receive new flows on this node (upstream
//! `pkg/proxy/topology.go` `CategorizeEndpoints`, for ClusterIP traffic).

use crate::{endpoints::EndpointInfo, model::DesiredBackend};

/// How a Service port picks endpoints.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Policy {
    /// internalTrafficPolicy: Local — only this node's endpoints.
    pub local_only: bool,
    /// The Service asked for topology-aware routing (trafficDistribution or the topology-mode
    /// annotation), so zone hints may be used.
    pub topology_aware: bool,
}

/// The endpoints chosen for new flows, and the ones kept only for established flows.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Categorized {
    /// Receive new flows. Sorted, no duplicates.
    pub selected: Vec<DesiredBackend>,
    /// Serving and terminating but not selected: kept so established flows finish. Sorted,
    /// disjoint from `selected`.
    pub retained: Vec<DesiredBackend>,
    /// The Service port has a usable endpoint somewhere in the cluster (upstream
    /// `hasAnyEndpoints`): ready, or serving and terminating, on any node. With a Local policy
    /// and nothing `selected`, this tells "drop" (served elsewhere) from "reject" (nowhere).
    pub usable_anywhere: bool,
}

impl Categorized {
    /// Nothing selected but usable endpoints elsewhere: with a Local policy, new flows are
    /// dropped (upstream), not rejected.
    pub fn drops(&self) -> bool {
        self.selected.is_empty() && self.usable_anywhere
    }
}

/// Pick the endpoints for one Service port.
///
/// Cluster policy: ready endpoints (narrowed to this zone's hints when usable); if none, the
/// serving-and-terminating ones (same narrowing). Local policy: this node's ready endpoints; if
/// none, this node's serving-and-terminating ones; hints are not used.
pub fn categorize(endpoints: &[EndpointInfo], policy: Policy, zone: Option<&str>) -> Categorized {
    let hint_zone = zone.filter(|z| policy.topology_aware && zone_hints_usable(endpoints, z));
    let in_scope = |ep: &EndpointInfo| {
        if policy.local_only {
            ep.local
        } else {
            hint_zone.is_none_or(|z| ep.zone_hints.contains(z))
        }
    };
    let mut selected: Vec<DesiredBackend> = endpoints
        .iter()
        .filter(|ep| ep.ready && in_scope(ep))
        .map(backend)
        .collect();
    if selected.is_empty() {
        selected = endpoints
            .iter()
            .filter(|ep| ep.serving && ep.terminating && in_scope(ep))
            .map(backend)
            .collect();
    }
    selected.sort();
    selected.dedup();
    // `selected` is sorted by endpoint first (field order of DesiredBackend).
    let is_selected = |b: &DesiredBackend| {
        selected
            .binary_search_by(|s| s.endpoint.cmp(&b.endpoint))
            .is_ok()
    };
    let mut retained: Vec<DesiredBackend> = endpoints
        .iter()
        .filter(|ep| ep.serving && ep.terminating)
        .map(backend)
        .filter(|b| !is_selected(b))
        .collect();
    retained.sort();
    retained.dedup();
    let usable_anywhere = if policy.local_only {
        endpoints
            .iter()
            .any(|ep| ep.ready || (ep.serving && ep.terminating))
    } else {
        !selected.is_empty()
    };
    Categorized {
        selected,
        retained,
        usable_anywhere,
    }
}

/// Upstream `topologyModeFromHints`: zone hints are used only if every ready endpoint carries
/// some and at least one names this node's zone; otherwise all of them are ignored (a partial
/// rollout of hints must not funnel traffic to the few hinted endpoints).
fn zone_hints_usable(endpoints: &[EndpointInfo], zone: &str) -> bool {
    if zone.is_empty() {
        return false;
    }
    let mut any_for_zone = false;
    for ep in endpoints.iter().filter(|ep| ep.ready) {
        if ep.zone_hints.is_empty() {
            return false;
        }
        any_for_zone |= ep.zone_hints.contains(zone);
    }
    any_for_zone
}

fn backend(ep: &EndpointInfo) -> DesiredBackend {
    DesiredBackend {
        endpoint: ep.endpoint,
        terminating: ep.terminating,
        local: ep.local,
    }
}
