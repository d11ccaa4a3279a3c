//! Which endpoints of a Service port receive new flows on this node (upstream
//! `pkg/proxy/topology.go` `CategorizeEndpoints`, for ClusterIP traffic).

use std::net::Ipv4Addr;

use crate::{
    pipeline::model::{DesiredBackend, Family},
    sources::endpoints::EndpointInfo,
};

/// How a Service port picks endpoints.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Policy {
    /// internalTrafficPolicy: Local — only this node's endpoints.
    pub local_only: bool,
}

/// The endpoints chosen for new flows, and the ones kept only for established flows.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Categorized<A: Family = Ipv4Addr> {
    /// Receive new flows. Sorted, no duplicates.
    pub selected: Vec<DesiredBackend<A>>,
    /// Not selected but kept so established flows finish: serving and terminating endpoints,
    /// and not-ready ones (flagged `not_serving` unless serving). A ready endpoint left out by
    /// topology or a Local policy is not kept. Sorted, disjoint from `selected`.
    pub retained: Vec<DesiredBackend<A>>,
    /// The Service port has a usable endpoint somewhere in the cluster (upstream
    /// `hasAnyEndpoints`): ready, or serving and terminating, on any node. With a Local policy
    /// and nothing `selected`, this tells "drop" (served elsewhere) from "reject" (nowhere).
    pub usable_anywhere: bool,
}

impl<A: Family> Categorized<A> {
    /// Nothing selected but usable endpoints elsewhere: with a Local policy, new flows are
    /// dropped (upstream), not rejected.
    pub fn drops(&self) -> bool {
        self.selected.is_empty() && self.usable_anywhere
    }
}

/// Which topology hints narrow the cluster endpoints (upstream `topologyModeFromHints`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Topology<'a> {
    /// Every ready endpoint.
    None,
    /// Endpoints hinted for this node (trafficDistribution PreferSameNode).
    SameNode,
    /// Endpoints hinted for this zone (PreferSameZone / PreferClose / topology-aware hints).
    SameZone(&'a str),
}

/// Pick the endpoints for one Service port.
///
/// Cluster policy: ready endpoints, narrowed by the hints when usable ([`topology`]); if none,
/// the serving-and-terminating ones (no narrowing: hints are only used when some ready
/// endpoint matches them). Local policy: this node's ready endpoints; if none, this node's
/// serving-and-terminating ones; hints are not used.
pub fn categorize<A: Family>(
    endpoints: &[EndpointInfo<A>],
    policy: Policy,
    zone: Option<&str>,
) -> Categorized<A> {
    let topology = if policy.local_only {
        Topology::None
    } else {
        topology(endpoints, zone)
    };
    let in_scope = |ep: &EndpointInfo<A>| {
        if policy.local_only {
            return ep.local;
        }
        match topology {
            Topology::None => true,
            Topology::SameNode => ep.hinted_for_node,
            Topology::SameZone(z) => ep.zone_hints.contains(z),
        }
    };
    let mut selected: Vec<DesiredBackend<A>> = endpoints
        .iter()
        .filter(|ep| ep.ready && in_scope(ep))
        .map(backend)
        .collect();
    if selected.is_empty() {
        selected = endpoints
            .iter()
            .filter(|ep| ep.serving && ep.terminating && (!policy.local_only || ep.local))
            .map(backend)
            .collect();
    }
    selected.sort();
    selected.dedup();
    // `selected` is sorted by endpoint first (field order of DesiredBackend).
    let is_selected = |b: &DesiredBackend<A>| {
        selected
            .binary_search_by(|s| s.endpoint.cmp(&b.endpoint))
            .is_ok()
    };
    // A pod whose readiness probe fails keeps its established connections, as with netfilter:
    // only new flows stop going to it.
    let mut retained: Vec<DesiredBackend<A>> = endpoints
        .iter()
        .filter(|ep| (ep.serving && ep.terminating) || !ep.ready)
        .map(|ep| DesiredBackend {
            not_serving: !ep.serving,
            ..backend(ep)
        })
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

/// Upstream `topologyModeFromHints`, used whatever the Service asked for (the EndpointSlice
/// controller only writes hints when it did): node hints if every ready endpoint carries some
/// and one names this node; else zone hints if every ready endpoint carries some and one names
/// this node's zone; else none (a partial rollout of hints must not funnel traffic to the few
/// hinted endpoints).
fn topology<'a, A: Family>(endpoints: &[EndpointInfo<A>], zone: Option<&'a str>) -> Topology<'a> {
    let zone = zone.unwrap_or_default();
    let mut ready = false;
    let (mut all_node_hints, mut for_node) = (true, false);
    let (mut all_zone_hints, mut for_zone) = (true, false);
    for ep in endpoints.iter().filter(|ep| ep.ready) {
        ready = true;
        all_node_hints &= ep.has_node_hints;
        for_node |= ep.hinted_for_node;
        all_zone_hints &= !ep.zone_hints.is_empty();
        for_zone |= !zone.is_empty() && ep.zone_hints.contains(zone);
    }
    if !ready {
        Topology::None
    } else if all_node_hints && for_node {
        Topology::SameNode
    } else if all_zone_hints && for_zone {
        Topology::SameZone(zone)
    } else {
        Topology::None
    }
}

fn backend<A: Family>(ep: &EndpointInfo<A>) -> DesiredBackend<A> {
    DesiredBackend {
        endpoint: ep.endpoint,
        terminating: ep.terminating,
        local: ep.local,
        not_serving: false,
    }
}
