//! Snapshot → desired state: which frontends exist and which backends each one sends to.
//!
//! Pure. Follows upstream kube-proxy's Service handling (pkg/proxy, v1.36): skipped
//! Service kinds, frontends per Service port × ClusterIP, endpoints joined from EndpointSlices
//! ([`crate::sources::endpoints`]) and categorised ([`crate::pipeline::topology`]). A bad object is reported as a
//! [`Problem`] and skipped; everything else is still programmed.
//!
//! Frontends asked for by more than one Service are settled one frontend at a time
//! ([`resolve`]): a ClusterIP beats any other kind, then the older Service wins, then
//! namespace/name order. The loser goes without that frontend only (a [`FrontendConflict`],
//! reported as a Problem); its other frontends are programmed.
//!
//! Per address family, like upstream's dual-stack proxier (one proxier per family behind a
//! meta-proxier): the functions are generic over the family ([`Family`]), and a family's
//! frontends come only from the Service's cluster IP of that family (`spec.ipFamilies` /
//! `spec.clusterIPs`, upstream `GetClusterIPByFamily`), its externalIPs, LoadBalancer IPs,
//! source ranges and node addresses of that family, and its EndpointSlices of that
//! `addressType`. A dual-stack Service whose slices are all IPv4 thus gets IPv6 frontends
//! without backends (rejected, as upstream). A Service not of a family has nothing in it. What
//! is wrong with the Service as a whole (ports, affinity, scheduler, a bad address) is reported
//! by its primary family's translation only, so each problem is reported once.

use std::{
    collections::{HashMap, hash_map::Entry},
    net::{IpAddr, Ipv4Addr, Ipv6Addr},
    sync::Arc,
};

use k8s_openapi::jiff::Timestamp;

pub use crate::sources::services::{
    ANNOTATION_LB_SOURCE_RANGES, ANNOTATION_SCHEDULER, LABEL_SERVICE_PROXY_NAME,
};
use crate::{
    pipeline::{
        model::{
            Balancing, ClaimRule, DesiredFrontend, DesiredState, Family, Frontend,
            FrontendConflict, FrontendKind, Problem, Protocol, Scheduler, Scope, ServicePortName,
        },
        topology::{self, Policy},
    },
    sources::{
        endpoints::{SNAPSHOT_SOURCE, SliceFamily, SliceIndex},
        services::{ClusterIp, IpFamilies, PortProtocol, ServiceData, ServiceType},
        snapshot::Snapshot,
    },
};
/// Annotation enabling topology-aware routing (value `Auto`).
pub const ANNOTATION_TOPOLOGY_MODE: &str = "service.kubernetes.io/topology-mode";
/// The annotation's pre-1.27 name, still honoured upstream.
pub const ANNOTATION_TOPOLOGY_AWARE_HINTS: &str = "service.kubernetes.io/topology-aware-hints";

/// Facts about the node this agent runs on.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct NodeContext {
    /// The Node object's name (endpoints with this `nodeName` are local).
    pub node_name: String,
    /// The node's `topology.kubernetes.io/zone` label, for zone hints.
    pub zone: Option<String>,
    /// The node's scheduler (`--scheduler`, else KubeProxyConfiguration `ipvs.scheduler`) for
    /// Services without a scheduler annotation.
    pub scheduler: Scheduler,
}

/// What `translate` made of a snapshot.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Translation {
    pub desired: DesiredState,
    /// The IPv6 family's desired state (`SERVICES6_V1` ...).
    pub desired6: DesiredState<Ipv6Addr>,
    /// Invalid or unsupported objects (or parts of them) that were skipped.
    pub problems: Vec<Problem>,
    /// Deliberate, expected skips worth telling the user once (e.g. the IPv6 half of a
    /// dual-stack Service): not errors.
    pub notes: Vec<Problem>,
    /// Health-check node ports to serve on the IPv4 NodePort addresses (externalTrafficPolicy
    /// Local LoadBalancer Services with an IPv4 cluster IP), sorted by port; counts of the IPv4
    /// family's local endpoints.
    pub health_checks: Vec<HealthCheck>,
    /// The same for the IPv6 family (served on the IPv6 NodePort addresses, counting IPv6
    /// endpoints): upstream runs one ServiceHealthServer per family's proxier.
    pub health_checks6: Vec<HealthCheck>,
    /// Frontends two or more Services asked for, one per losing claim, sorted (each is also in
    /// `problems`).
    pub conflicts: Vec<FrontendConflict>,
    /// The same for IPv6 frontends.
    pub conflicts6: Vec<FrontendConflict<Ipv6Addr>>,
}

/// A `spec.healthCheckNodePort` and what it reports (upstream `pkg/proxy/healthcheck`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HealthCheck {
    pub namespace: String,
    pub name: String,
    pub port: u16,
    /// This node's ready endpoints, summed over the Service's ports (upstream
    /// `LocalReadyEndpoints`; serving-terminating ones do not count).
    pub local_endpoints: usize,
}

/// Why (part of) a Service is not programmed.
#[derive(Debug, thiserror::Error)]
enum ServiceError {
    #[error("clusterIP {0:?} is not an IP address; Service skipped")]
    BadClusterIp(String),
    #[error("spec.ipFamilies is not one or two distinct families of IPv4, IPv6; Service skipped")]
    BadIpFamilies,
    #[error(
        "spec.clusterIPs {ips:?} do not match spec.ipFamilies {families:?} (one address of each \
         family, in order); Service skipped"
    )]
    FamilyMismatch {
        ips: Vec<String>,
        families: Vec<&'static str>,
    },
    #[error("port {name:?} has invalid number {port} (must be 1-65535); Service skipped")]
    BadPort { name: String, port: i32 },
    #[error("port {name:?} has unknown protocol {protocol:?}; Service skipped")]
    BadProtocol { name: String, protocol: String },
    #[error("port {port}/{protocol} is listed twice; Service skipped")]
    DuplicatePort { port: u16, protocol: Protocol },
    #[error(
        "loadBalancerSourceRanges entry {0:?} is not a CIDR; entry ignored (the other ranges apply)"
    )]
    BadSourceRange(String),
    #[error(
        "externalIPs entry {0:?} is not an IP address; entry ignored (the other frontends apply)"
    )]
    BadExternalIp(String),
    #[error(
        "sessionAffinityConfig.clientIP.timeoutSeconds {0} is outside 1-{MAX_AFFINITY_TIMEOUT_S}; \
         the default {DEFAULT_AFFINITY_TIMEOUT_S} s applies"
    )]
    BadAffinityTimeout(i32),
    #[error(
        "annotation {ANNOTATION_SCHEDULER} {value:?} is not a scheduler (use one of {names}); \
         the node's scheduler {node} applies",
        names = proxy_common::sched::SCHEDULER_NAMES,
        node = node.name()
    )]
    BadScheduler { value: String, node: Scheduler },
}

/// `sessionAffinityConfig.clientIP.timeoutSeconds` default and maximum (upstream's validation:
/// 0 < timeout <= 86400).
pub const DEFAULT_AFFINITY_TIMEOUT_S: u32 = 10_800;
pub const MAX_AFFINITY_TIMEOUT_S: u32 = 86_400;

/// Turn a snapshot into the desired state for this node, without NodePort frontends (no node
/// addresses known); see [`translate_for_node`].
pub fn translate(snapshot: &Snapshot, node: &NodeContext) -> Translation {
    translate_for_node(snapshot, node, &[])
}

/// Turn a snapshot into the IPv4 desired state for this node; NodePorts answer on
/// `nodeport_addrs` (the node's addresses selected by `--nodeport-addresses`). IPv6 frontends
/// without NodePorts; see [`translate_families`].
pub fn translate_for_node(
    snapshot: &Snapshot,
    node: &NodeContext,
    nodeport_addrs: &[Ipv4Addr],
) -> Translation {
    translate_families(snapshot, node, nodeport_addrs, &[])
}

/// Turn a snapshot into both families' desired states for this node, each family's NodePorts on
/// that family's node addresses.
pub fn translate_families(
    snapshot: &Snapshot,
    node: &NodeContext,
    nodeport_addrs: &[Ipv4Addr],
    nodeport_addrs6: &[Ipv6Addr],
) -> Translation {
    let mut out = Translation::default();
    // Sorted so that health checks sharing a port come in the same order whatever order the
    // source listed the Services in (claims do not depend on it: see `resolve`).
    let mut services: Vec<&ServiceData> = snapshot.services.iter().map(|s| &**s).collect();
    services.sort_by_key(|s| (&s.namespace, &s.name));
    let four = translate_family(snapshot, &services, node, nodeport_addrs, &mut out);
    (out.desired, out.conflicts, out.health_checks) = four;
    let six = translate_family(snapshot, &services, node, nodeport_addrs6, &mut out);
    (out.desired6, out.conflicts6, out.health_checks6) = six;
    out
}

/// What [`translate_one_family`] makes of one family.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct OneFamily<A: Family> {
    pub desired: DesiredState<A>,
    pub problems: Vec<Problem>,
    /// This family's health-check node ports, sorted by port (see
    /// [`Translation::health_checks6`]).
    pub health_checks: Vec<HealthCheck>,
}

/// One family's desired state, problems and health checks (the IPv6 family's full translation
/// in the agent, beside the IPv4 translation cache).
pub fn translate_one_family<A: SliceFamily>(
    snapshot: &Snapshot,
    node: &NodeContext,
    nodeport_addrs: &[A],
) -> OneFamily<A> {
    let mut out = Translation::default();
    let mut services: Vec<&ServiceData> = snapshot.services.iter().map(|s| &**s).collect();
    services.sort_by_key(|s| (&s.namespace, &s.name));
    let (desired, _, health_checks) =
        translate_family(snapshot, &services, node, nodeport_addrs, &mut out);
    OneFamily {
        desired,
        problems: out.problems,
        health_checks,
    }
}

/// One family's desired state, conflicts and health checks (sorted by port); problems and notes
/// into `out`.
fn translate_family<A: SliceFamily>(
    snapshot: &Snapshot,
    services: &[&ServiceData],
    node: &NodeContext,
    nodeport_addrs: &[A],
    out: &mut Translation,
) -> (DesiredState<A>, Vec<FrontendConflict<A>>, Vec<HealthCheck>) {
    let slices: SliceIndex<'_, A> = SliceIndex::new(
        snapshot.endpoint_slices.iter().map(|s| &**s),
        &node.node_name,
        &mut out.problems,
    );
    let mut desired = DesiredState::default();
    let mut all_conflicts = Vec::new();
    let mut translations = Vec::with_capacity(services.len());
    let mut health_checks = Vec::new();
    for svc in services {
        let Some(mut t) = translate_service(svc, &slices, node, nodeport_addrs) else {
            continue;
        };
        if let Some(remarks) = t.remarks.take() {
            let Remarks {
                mut problems,
                mut notes,
                health_check,
            } = *remarks;
            out.problems.append(&mut problems);
            out.notes.append(&mut notes);
            health_checks.extend(health_check);
        }
        translations.push(t);
    }
    // Grouped by frontend (a stable sort: claimants stay in name order within a group).
    let mut claims: Vec<Claim<'_, A>> = translations.iter().flat_map(|t| t.claims()).collect();
    claims.sort_by_key(|c| c.frontend);
    for list in claims.chunk_by(|a, b| a.frontend == b.frontend) {
        let Some((winner, conflicts)) = resolve(list) else {
            continue;
        };
        for (frontend, df) in list[winner].entries {
            desired.frontends.insert(*frontend, df.clone());
        }
        out.problems.extend(conflicts.iter().map(conflict_problem));
        all_conflicts.extend(conflicts);
    }
    all_conflicts.sort();
    health_checks.sort_by_key(|h| h.port);
    (desired, all_conflicts, health_checks)
}

/// A frontend and what it should do, as translations share it with the desired state.
pub type FrontendEntry<A = Ipv4Addr> = (Frontend<A>, Arc<DesiredFrontend<A>>);

/// One Service's part of a translation, before the frontend claims between Services.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ServiceTranslation<A: Family = Ipv4Addr> {
    /// The frontends the Service asks for, in Service port order, each address:port/protocol
    /// once (an in-cluster entry right after its all-clients entry). Each is claimed on its own
    /// ([`resolve`]). Empty when the Service is skipped.
    pub frontends: Box<[FrontendEntry<A>]>,
    /// The Service's `metadata.creationTimestamp` (the older Service wins a contested frontend).
    pub created: Option<Timestamp>,
    /// Problems, notes and the health check, which most Services have none of (`None`: none;
    /// boxed because the translation cache keeps a translation per Service).
    pub remarks: Option<Box<Remarks>>,
}

/// What a [`ServiceTranslation`] reports besides its frontends.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Remarks {
    pub problems: Vec<Problem>,
    pub notes: Vec<Problem>,
    /// Served whatever the claims: it reports the Service's local endpoints.
    pub health_check: Option<HealthCheck>,
}

impl Remarks {
    fn is_empty(&self) -> bool {
        self.problems.is_empty() && self.notes.is_empty() && self.health_check.is_none()
    }
}

impl<A: Family> Default for ServiceTranslation<A> {
    fn default() -> Self {
        Self {
            frontends: Box::new([]),
            created: None,
            remarks: None,
        }
    }
}

impl<A: Family> ServiceTranslation<A> {
    pub fn problems(&self) -> &[Problem] {
        self.remarks.as_ref().map_or(&[], |r| &r.problems)
    }

    pub fn notes(&self) -> &[Problem] {
        self.remarks.as_ref().map_or(&[], |r| &r.notes)
    }

    /// Takes the health check out (and the remarks, when nothing else is left in them).
    pub fn take_health_check(&mut self) -> Option<HealthCheck> {
        let remarks = self.remarks.as_mut()?;
        let hc = remarks.health_check.take();
        if remarks.is_empty() {
            self.remarks = None;
        }
        hc
    }

    /// The Service's claims, one per address:port/protocol it asks for.
    pub fn claims(&self) -> impl Iterator<Item = Claim<'_, A>> {
        (0..self.frontends.len()).filter_map(|i| self.claim_at(i))
    }

    /// The claim whose all-clients entry is `frontends[entry]` (`None` for an in-cluster entry
    /// or an index out of range).
    pub fn claim_at(&self, entry: usize) -> Option<Claim<'_, A>> {
        let (frontend, desired) = self.frontends.get(entry)?;
        if frontend.scope != Scope::AllClients {
            return None;
        }
        let with_in_cluster = self
            .frontends
            .get(entry + 1)
            .is_some_and(|(f, _)| *f == frontend.in_cluster());
        let end = entry + 1 + usize::from(with_in_cluster);
        Some(Claim {
            frontend: *frontend,
            desired,
            created: self.created,
            entries: self.frontends.get(entry..end)?,
        })
    }
}

/// One Service's claim on a frontend (address, port, protocol, for every client).
#[derive(Clone, Copy, Debug)]
pub struct Claim<'a, A: Family = Ipv4Addr> {
    pub frontend: Frontend<A>,
    desired: &'a DesiredFrontend<A>,
    created: Option<Timestamp>,
    /// What the claim programs if it wins: the frontend, and for an externalTrafficPolicy Local
    /// external frontend the in-cluster entry beside it.
    pub entries: &'a [FrontendEntry<A>],
}

impl<A: Family> Claim<'_, A> {
    /// Lower wins: a ClusterIP first, then the older Service (one without a creationTimestamp,
    /// as in manifests, after every one with), then namespace/name.
    fn rank(&self) -> (bool, bool, Option<Timestamp>, &str, &str) {
        let service = &self.desired.service;
        (
            self.desired.kind != FrontendKind::ClusterIp,
            self.created.is_none(),
            self.created,
            &service.namespace,
            &service.name,
        )
    }
}

/// Settles one frontend between the Services claiming it, in any order: the winning claim's
/// position in `claims`, and a conflict for each other claim. `None` when `claims` is empty.
/// Pure and per frontend, so the full and the incremental translation agree.
pub fn resolve<A: Family>(claims: &[Claim<'_, A>]) -> Option<(usize, Vec<FrontendConflict<A>>)> {
    let (winner, w) = claims
        .iter()
        .enumerate()
        .min_by(|(_, a), (_, b)| a.rank().cmp(&b.rank()))?;
    let conflicts = claims
        .iter()
        .enumerate()
        .filter(|(i, _)| *i != winner)
        .map(|(_, l)| {
            let rule = if (w.desired.kind == FrontendKind::ClusterIp)
                != (l.desired.kind == FrontendKind::ClusterIp)
            {
                ClaimRule::ClusterIpFirst
            } else if w.created != l.created {
                ClaimRule::Older
            } else {
                ClaimRule::NameOrder
            };
            FrontendConflict {
                frontend: w.frontend,
                loser: l.desired.service.clone(),
                loser_kind: l.desired.kind,
                winner: w.desired.service.clone(),
                winner_kind: w.desired.kind,
                rule,
            }
        })
        .collect();
    Some((winner, conflicts))
}

/// The problem reported for the loser of a conflict.
pub fn conflict_problem<A: Family>(c: &FrontendConflict<A>) -> Problem {
    Problem {
        source: SNAPSHOT_SOURCE.to_owned(),
        object: format!("Service {}/{}", c.loser.namespace, c.loser.name),
        reason: format!(
            "frontend {} ({}{}) is held by Service {} as its {} ({}); this frontend is skipped, \
             the Service's other frontends are programmed",
            c.frontend,
            c.loser_kind,
            if c.loser.port_name.is_empty() {
                String::new()
            } else {
                format!(" of port {:?}", c.loser.port_name)
            },
            c.winner,
            c.winner_kind,
            c.rule
        ),
    }
}

/// Translate one Service for family `A` with the endpoints of `slices` (which may hold only this
/// Service's slices). `None`: the Service is not for this proxy (ExternalName, headless, another
/// proxy's), or has no cluster IP of this family (and, unless `A` is its primary family, when
/// it is skipped: its primary family reports why).
pub fn translate_service<A: SliceFamily>(
    svc: &ServiceData,
    slices: &SliceIndex<'_, A>,
    node: &NodeContext,
    nodeport_addrs: &[A],
) -> Option<ServiceTranslation<A>> {
    if !handled(svc) {
        return None;
    }
    let mut out = ServiceTranslation::default();
    let mut remarks = Remarks::default();
    let family = match family_cluster_ip::<A>(svc) {
        Ok(f) => f,
        Err((e, primary)) => {
            if !primary {
                return None;
            }
            remarks.problems.push(service_problem(svc, e.to_string()));
            out.remarks = Some(Box::new(remarks));
            out.created = svc.created;
            return Some(out);
        }
    };
    let cluster_ip = family.cluster_ip?;
    match service_frontends(svc, cluster_ip, slices, node, nodeport_addrs) {
        Ok(f) => {
            if family.primary {
                for e in f.port_problems {
                    remarks.problems.push(service_problem(svc, e.to_string()));
                }
            }
            // The secondary family: the same frontends, its Service-wide problems left to the
            // primary's translation.
            out.frontends = frontends_box(f.frontends);
            // Each family its own health check (its own endpoints; upstream's per-family
            // proxiers each run a ServiceHealthServer), served on its own node addresses.
            remarks.health_check = f.health_check;
        }
        Err(e) if family.primary => remarks.problems.push(service_problem(svc, e.to_string())),
        Err(_) => return None,
    }
    if !remarks.is_empty() {
        out.remarks = Some(Box::new(remarks));
    }
    out.created = svc.created;
    Some(out)
}

/// A Service's frontends as a translation keeps them: collected into a box of its exact length
/// (a collect into a `Vec` would reuse the grown buffer of (Frontend, DesiredFrontend), kept for
/// the Service's lifetime in the cache).
type FrontendList<A> = Vec<(Frontend<A>, DesiredFrontend<A>)>;

fn frontends_box<A: Family>(frontends: FrontendList<A>) -> Box<[FrontendEntry<A>]> {
    dedup_own(frontends)
        .into_iter()
        .map(|(frontend, df)| (frontend, Arc::new(df)))
        .collect::<Vec<_>>()
        .into_boxed_slice()
}

/// A Service's cluster IP of one family.
struct FamilyIp<A> {
    /// Upstream `GetClusterIPByFamily`: `clusterIPs[i]` where `ipFamilies[i]` is the family
    /// (without ipFamilies, the cluster IP if it is of the family).
    cluster_ip: Option<A>,
    /// The family is the Service's primary one (`ipFamilies[0]`, else the first cluster IP's).
    primary: bool,
}

/// The Service's cluster IP of family `A`. Err: the cluster IPs or families are bad, with
/// whether `A` reports it (IPv4 when the primary family cannot be told).
fn family_cluster_ip<A: Family>(svc: &ServiceData) -> Result<FamilyIp<A>, (ServiceError, bool)> {
    let ipv4_reports = A::NAME == Ipv4Addr::NAME;
    let mut ips: Vec<IpAddr> = Vec::with_capacity(svc.cluster_ips.len());
    for ip in svc.cluster_ips.iter() {
        match ip {
            ClusterIp::V4(a) => ips.push(IpAddr::V4(*a)),
            ClusterIp::Other(raw) => match raw.parse::<IpAddr>() {
                Ok(a) => ips.push(a),
                Err(_) => return Err((ServiceError::BadClusterIp(raw.to_string()), ipv4_reports)),
            },
        }
    }
    let families = svc.ip_families.names();
    if svc.ip_families == IpFamilies::Invalid {
        return Err((ServiceError::BadIpFamilies, ipv4_reports));
    }
    let family_name = |a: &IpAddr| {
        if a.is_ipv4() {
            Ipv4Addr::NAME
        } else {
            Ipv6Addr::NAME
        }
    };
    let primary_name = families
        .first()
        .copied()
        .or_else(|| ips.first().map(family_name))
        .unwrap_or(Ipv4Addr::NAME);
    let primary = primary_name == A::NAME;
    let mismatch = if families.is_empty() {
        // Without ipFamilies (manifests, old objects): the addresses say; one of each at most.
        ips.len() > 2 || (ips.len() == 2 && family_name(&ips[0]) == family_name(&ips[1]))
    } else {
        // Upstream validation: clusterIPs[i] is of family ipFamilies[i]; a Service may list
        // fewer cluster IPs than families only while it has none (headless is skipped above).
        ips.len() != families.len()
            || ips
                .iter()
                .zip(families)
                .any(|(ip, f)| family_name(ip) != *f)
    };
    if mismatch {
        let e = ServiceError::FamilyMismatch {
            ips: ips.iter().map(ToString::to_string).collect(),
            families: families.to_vec(),
        };
        return Err((e, primary));
    }
    Ok(FamilyIp {
        cluster_ip: ips.into_iter().find_map(A::of),
        primary,
    })
}

/// One Service asking twice for one address:port/protocol (an externalIP equal to its own
/// ClusterIP, a NodePort equal to another port on an externalIP that is a node address): its
/// ClusterIP entry is kept, else the first; a dropped external entry takes its in-cluster entry
/// along.
fn dedup_own<A: Family>(frontends: FrontendList<A>) -> FrontendList<A> {
    // The usual case, cheaply: no address:port/protocol twice (a few frontends: compared
    // pairwise without allocating; many: sorted).
    let keys = || (frontends.iter().map(|(f, _)| *f)).filter(|f| f.scope == Scope::AllClients);
    let unique = if frontends.len() <= 16 {
        keys()
            .enumerate()
            .all(|(i, a)| keys().skip(i + 1).all(|b| a != b))
    } else {
        let mut sorted: Vec<Frontend<A>> = keys().collect();
        sorted.sort_unstable();
        sorted.windows(2).all(|w| w[0] != w[1])
    };
    if unique {
        return frontends;
    }
    let mut kept: HashMap<Frontend<A>, usize> = HashMap::with_capacity(frontends.len());
    for (i, (f, df)) in frontends.iter().enumerate() {
        if f.scope != Scope::AllClients {
            continue;
        }
        match kept.entry(*f) {
            Entry::Vacant(v) => {
                v.insert(i);
            }
            Entry::Occupied(mut o) => {
                let first = frontends.get(*o.get()).map(|(_, d)| d.kind);
                if df.kind == FrontendKind::ClusterIp && first != Some(FrontendKind::ClusterIp) {
                    o.insert(i);
                }
            }
        }
    }
    frontends
        .into_iter()
        .enumerate()
        .filter(|(i, (f, _))| match f.scope {
            Scope::AllClients => kept.get(f) == Some(i),
            Scope::InCluster => i
                .checked_sub(1)
                .is_some_and(|prev| kept.get(&f.all_clients()) == Some(&prev)),
        })
        .map(|(_, e)| e)
        .collect()
}

fn service_problem(svc: &ServiceData, reason: String) -> Problem {
    Problem {
        source: SNAPSHOT_SOURCE.to_owned(),
        object: format!("Service {}", svc.namespaced_name()),
        reason,
    }
}

/// Whether this proxy programs the Service at all (upstream skips these silently).
fn handled(svc: &ServiceData) -> bool {
    let external_name = svc.type_ == ServiceType::ExternalName;
    let headless = (svc.cluster_ips.first())
        .is_none_or(|ip| matches!(ip, ClusterIp::Other(raw) if raw.is_empty() || &**raw == "None"));
    !(external_name || svc.other_proxy || headless)
}

struct ServiceFrontends<A: Family> {
    frontends: FrontendList<A>,
    /// Problems that do not skip the Service (bad source ranges, a bad scheduler annotation).
    port_problems: Vec<ServiceError>,
    health_check: Option<HealthCheck>,
}

/// spec.externalIPs and status.loadBalancer.ingress[].ip (unless ipMode is Proxy: the load
/// balancer then proxies and sends to the node, not to the VIP) of family `A`; unparsable
/// addresses and the other family's are left out (upstream logs and ignores them too, and
/// filters them per family); unparsable externalIPs are reported by [`bad_external_ips`].
fn external_addrs<A: Family>(svc: &ServiceData) -> Vec<(FrontendKind, A)> {
    let v4 = |ip: &str| ip.parse::<IpAddr>().ok().and_then(A::of);
    let external_ips = (svc.extra().external_ips.iter())
        .filter_map(|ip| v4(ip))
        .map(|a| (FrontendKind::ExternalIp, a));
    // (entries with ipMode Proxy are not kept)
    let lb = (svc.extra().lb_ingress_ips.iter())
        .filter_map(|ip| v4(ip))
        .map(|a| (FrontendKind::LoadBalancer, a));
    let mut all: Vec<_> = external_ips.chain(lb).collect();
    all.sort();
    all.dedup_by_key(|(_, a)| *a);
    all
}

/// spec.externalIPs entries that are not IP addresses (the API server refuses them; a manifest
/// may hold them): one problem each, the Service's other frontends programmed.
fn bad_external_ips(svc: &ServiceData) -> impl Iterator<Item = ServiceError> + '_ {
    (svc.extra().external_ips.iter())
        .filter(|ip| ip.parse::<IpAddr>().is_err())
        .map(|ip| ServiceError::BadExternalIp(ip.to_string()))
}

/// loadBalancerSourceRanges (or the legacy annotation) of family `A` as networks, host bits
/// cleared; the other family's ranges are left out (they apply to its frontends: upstream
/// filters them per family), unparsable ones reported.
fn source_ranges<A: Family>(svc: &ServiceData) -> (Vec<(A, u8)>, Vec<ServiceError>) {
    let field: Vec<String> = (svc.extra().load_balancer_source_ranges.iter())
        .map(|s| s.to_string())
        .collect();
    let items = if field.is_empty() {
        (svc.extra().source_ranges_annotation.as_deref())
            .map(|v| v.split(',').map(|s| s.trim().to_owned()).collect())
            .unwrap_or_default()
    } else {
        field
    };
    let mut ranges = Vec::new();
    let mut bad = Vec::new();
    for item in items.iter().filter(|s| !s.is_empty()) {
        match item.parse::<crate::pipeline::addresses::Cidr>() {
            Ok(cidr) => {
                if let Some(a) = A::of(cidr.addr) {
                    ranges.push((a.network(cidr.prefix_len), cidr.prefix_len));
                }
            }
            Err(_) => bad.push(ServiceError::BadSourceRange(item.clone())),
        }
    }
    ranges.sort();
    ranges.dedup();
    (ranges, bad)
}

/// The frontends of family `A` of a Service whose cluster IP of that family is `cluster_ip`.
fn service_frontends<A: SliceFamily>(
    svc: &ServiceData,
    cluster_ip: A,
    slices: &SliceIndex<'_, A>,
    node: &NodeContext,
    nodeport_addrs: &[A],
) -> Result<ServiceFrontends<A>, ServiceError> {
    let namespace = svc.namespace.as_deref().unwrap_or("default");
    let name = svc.name.as_deref().unwrap_or_default();
    let addrs = [cluster_ip];

    let policy = policy(svc);
    let mut balancing_problems = Vec::new();
    let balancing = balancing(svc, node, &mut balancing_problems);
    let node_ports = matches!(svc.type_, ServiceType::NodePort | ServiceType::LoadBalancer);
    let external_local = svc.external_local;
    // eTP=Cluster external traffic uses the cluster endpoints (topology included), like upstream;
    // so do in-cluster clients of an eTP=Local frontend (internalTrafficPolicy does not apply).
    let cluster_external_policy = Policy { local_only: false };
    let external_policy = Policy {
        local_only: external_local,
    };
    let external = external_addrs::<A>(svc);
    let health_check_port = (svc.extra().health_check_node_port)
        .and_then(|p| u16::try_from(p).ok())
        .filter(|p| *p != 0 && external_local && svc.type_ == ServiceType::LoadBalancer);
    let mut local_endpoints = 0usize;
    let (lb_source_ranges, bad_ranges) = source_ranges::<A>(svc);
    let mut port_problems = balancing_problems;
    port_problems.extend(bad_ranges);
    port_problems.extend(bad_external_ips(svc));
    let (affinity_timeout_s, affinity_problem) = session_affinity(svc);
    let balancing = Balancing {
        affinity_timeout_s,
        ..balancing
    };
    port_problems.extend(affinity_problem);
    let mut frontends = Vec::new();
    let mut seen_ports = Vec::new();
    for sp in svc.ports.iter() {
        let port_name = sp.name.as_deref().unwrap_or_default().to_owned();
        let protocol = match &sp.protocol {
            PortProtocol::Tcp => Protocol::Tcp,
            PortProtocol::Udp => Protocol::Udp,
            PortProtocol::Sctp => Protocol::Sctp,
            PortProtocol::Other(other) => {
                let protocol = other.to_string();
                return Err(ServiceError::BadProtocol {
                    name: port_name,
                    protocol,
                });
            }
        };
        let port = match u16::try_from(sp.port) {
            Ok(p) if p != 0 => p,
            _ => {
                return Err(ServiceError::BadPort {
                    name: port_name,
                    port: sp.port,
                });
            }
        };
        if seen_ports.contains(&(port, protocol)) {
            return Err(ServiceError::DuplicatePort { port, protocol });
        }
        seen_ports.push((port, protocol));

        let endpoints = slices.endpoints(namespace, name, &port_name, protocol);
        let chosen = topology::categorize(&endpoints, policy, node.zone.as_deref());
        let service = ServicePortName {
            namespace: namespace.to_owned(),
            name: name.to_owned(),
            port_name,
        };
        for addr in &addrs {
            let frontend = Frontend::new(*addr, port, protocol);
            let df = DesiredFrontend {
                service: service.clone(),
                kind: FrontendKind::ClusterIp,
                balancing,
                external_local: false,
                drop_when_empty: policy.local_only && chosen.drops(),
                source_ranges: Vec::new(),
                backends: chosen.selected.clone(),
                retained: chosen.retained.clone(),
            };
            frontends.push((frontend, df));
        }

        let node_port = sp
            .node_port
            .and_then(|p| u16::try_from(p).ok())
            .filter(|p| *p != 0 && node_ports);
        let mut external_frontends: Vec<(FrontendKind, A, u16)> = external
            .iter()
            .map(|(kind, addr)| (*kind, *addr, port))
            .collect();
        if let Some(np) = node_port {
            external_frontends.extend(
                nodeport_addrs
                    .iter()
                    .map(|a| (FrontendKind::NodePort, *a, np)),
            );
        }
        let chosen = topology::categorize(&endpoints, external_policy, node.zone.as_deref());
        // Upstream `LocalReadyEndpoints`: ready local endpoints, summed over the Service's ports.
        // Terminating ones never count, so a draining node fails its health check while its
        // terminating pods still serve the fallback.
        local_endpoints += endpoints.iter().filter(|e| e.local && e.ready).count();
        // eTP=Local: clients inside the cluster get the cluster-wide endpoints instead (what
        // eTP=Cluster would select), through an in-cluster entry beside each external frontend.
        let in_cluster = external_local.then(|| {
            topology::categorize(&endpoints, cluster_external_policy, node.zone.as_deref())
        });
        for (kind, addr, port) in external_frontends {
            let frontend = Frontend::new(addr, port, protocol);
            let df = DesiredFrontend {
                service: service.clone(),
                kind,
                balancing,
                external_local,
                drop_when_empty: external_local && chosen.drops(),
                source_ranges: if kind == FrontendKind::LoadBalancer {
                    lb_source_ranges.clone()
                } else {
                    Vec::new()
                },
                backends: chosen.selected.clone(),
                retained: chosen.retained.clone(),
            };
            // Same source ranges: they apply before the datapath chooses the entry.
            let internal = in_cluster.as_ref().map(|cluster| DesiredFrontend {
                external_local: false,
                drop_when_empty: false,
                backends: cluster.selected.clone(),
                retained: cluster.retained.clone(),
                ..df.clone()
            });
            frontends.push((frontend, df));
            frontends.extend(internal.map(|df| (frontend.in_cluster(), df)));
        }
    }
    let health_check = health_check_port.map(|port| HealthCheck {
        namespace: namespace.to_owned(),
        name: name.to_owned(),
        port,
        local_endpoints,
    });
    Ok(ServiceFrontends {
        frontends,
        port_problems,
        health_check,
    })
}

/// The Service's endpoint-selection policy for ClusterIP traffic. Topology hints need no
/// opt-in here: like upstream (since trafficDistribution went GA), they are used whenever the
/// endpoints carry them (see [`topology::categorize`]).
fn policy(svc: &ServiceData) -> Policy {
    Policy {
        local_only: svc.internal_local,
    }
}

/// How the Service's frontends choose backends: its scheduler and session affinity. A bad
/// setting is reported in `problems` and the default applies (the Service is still programmed).
fn balancing(svc: &ServiceData, node: &NodeContext, problems: &mut Vec<ServiceError>) -> Balancing {
    Balancing {
        scheduler: scheduler(svc, node, problems),
        affinity_timeout_s: None,
    }
}

/// `spec.sessionAffinity: ClientIP`: its timeout (`sessionAffinityConfig.clientIP.timeoutSeconds`,
/// default 10800 s). A timeout the API server would refuse (outside 1-86400) is reported and the
/// default used, so the Service keeps its affinity.
fn session_affinity(svc: &ServiceData) -> (Option<u32>, Option<ServiceError>) {
    if !svc.client_ip_affinity {
        return (None, None);
    }
    let configured = svc.extra().affinity_timeout_seconds;
    match configured {
        None => (Some(DEFAULT_AFFINITY_TIMEOUT_S), None),
        Some(t) => match u32::try_from(t) {
            Ok(t) if (1..=MAX_AFFINITY_TIMEOUT_S).contains(&t) => (Some(t), None),
            _ => (
                Some(DEFAULT_AFFINITY_TIMEOUT_S),
                Some(ServiceError::BadAffinityTimeout(t)),
            ),
        },
    }
}

/// The `kube-proxy-ebpf.io/scheduler` annotation (trimmed; empty = not set), else the node's.
fn scheduler(svc: &ServiceData, node: &NodeContext, problems: &mut Vec<ServiceError>) -> Scheduler {
    let value = (svc.extra().scheduler_annotation.as_deref())
        .map(|v| v.trim())
        .filter(|v| !v.is_empty());
    let Some(value) = value else {
        return node.scheduler;
    };
    Scheduler::parse(value).unwrap_or_else(|| {
        problems.push(ServiceError::BadScheduler {
            value: value.to_owned(),
            node: node.scheduler,
        });
        node.scheduler
    })
}

#[cfg(test)]
mod tests {
    use k8s_openapi::api::{core::v1::Service, discovery::v1::EndpointSlice};
    use serde_json::{Value, json};

    use super::*;

    const NODE: &str = "node-a";
    const ZONE: &str = "zone-a";

    fn service(name: &str, spec: Value) -> Service {
        service_meta(json!({"name": name, "namespace": "demo"}), spec)
    }

    fn service_meta(metadata: Value, spec: Value) -> Service {
        serde_json::from_value(json!({"metadata": metadata, "spec": spec}))
            .expect("Service fixture")
    }

    /// A ClusterIP Service with one port per (name, port, protocol).
    fn cluster_ip(name: &str, ip: &str, ports: &[(&str, i32, &str)]) -> Service {
        let ports: Vec<Value> = ports
            .iter()
            .map(|(n, p, proto)| json!({"name": n, "port": p, "protocol": proto}))
            .collect();
        service(name, json!({"clusterIP": ip, "ports": ports}))
    }

    fn slice_typed(
        service: &str,
        name: &str,
        address_type: &str,
        ports: Value,
        endpoints: Vec<Value>,
    ) -> EndpointSlice {
        serde_json::from_value(json!({
            "metadata": {"name": name, "namespace": "demo",
                         "labels": {"kubernetes.io/service-name": service}},
            "addressType": address_type,
            "ports": ports,
            "endpoints": endpoints,
        }))
        .expect("EndpointSlice fixture")
    }

    fn slice(service: &str, name: &str, ports: Value, endpoints: Vec<Value>) -> EndpointSlice {
        slice_typed(service, name, "IPv4", ports, endpoints)
    }

    /// An endpoint; `conditions` as (ready, serving, terminating), None = field absent.
    fn ep(addr: &str, node: &str, c: (Option<bool>, Option<bool>, Option<bool>)) -> Value {
        json!({"addresses": [addr], "nodeName": node,
               "conditions": {"ready": c.0, "serving": c.1, "terminating": c.2}})
    }

    fn ready(addr: &str) -> Value {
        ep(addr, "node-b", (Some(true), Some(true), Some(false)))
    }

    fn terminating(addr: &str, serving: bool) -> Value {
        ep(addr, "node-b", (Some(false), Some(serving), Some(true)))
    }

    fn hinted(addr: &str, zones: &[&str]) -> Value {
        let mut v = ready(addr);
        let zones: Vec<Value> = zones.iter().map(|z| json!({"name": z})).collect();
        v["hints"] = json!({"forZones": zones});
        v
    }

    fn http_port(port: i32) -> Value {
        json!([{"name": "http", "port": port, "protocol": "TCP"}])
    }

    /// What a test expects of one frontend: selected and retained backends as
    /// "addr:port" + " T" (terminating) + " L" (local) + " N" (not serving).
    struct Want<'a> {
        frontend: &'a str,
        selected: &'a [&'a str],
        retained: &'a [&'a str],
    }

    struct Case<'a> {
        services: Vec<Service>,
        slices: Vec<EndpointSlice>,
        want: &'a [Want<'a>],
        /// Substrings of "object: reason", one per expected problem, in order.
        problems: &'a [&'a str],
        notes: usize,
    }

    fn show(b: &crate::pipeline::model::DesiredBackend) -> String {
        let mut s = format!("{}:{}", b.endpoint.addr, b.endpoint.port);
        if b.terminating {
            s.push_str(" T");
        }
        if b.local {
            s.push_str(" L");
        }
        if b.not_serving {
            s.push_str(" N");
        }
        s
    }

    fn run(case: Case<'_>) -> Translation {
        let snapshot = Snapshot::new(case.services, case.slices);
        let node = NodeContext {
            scheduler: Default::default(),
            node_name: NODE.into(),
            zone: Some(ZONE.into()),
        };
        let t = translate(&snapshot, &node);
        let got: Vec<(String, Vec<String>, Vec<String>)> = t
            .desired
            .frontends
            .iter()
            .map(|(fe, df)| {
                (
                    fe.to_string(),
                    df.backends.iter().map(show).collect(),
                    df.retained.iter().map(show).collect(),
                )
            })
            .collect();
        let want: Vec<(String, Vec<String>, Vec<String>)> = case
            .want
            .iter()
            .map(|w| {
                let v = |s: &[&str]| s.iter().map(|x| x.to_string()).collect();
                (w.frontend.to_owned(), v(w.selected), v(w.retained))
            })
            .collect();
        assert_eq!(got, want);
        let problems: Vec<String> = t
            .problems
            .iter()
            .map(|p| format!("{}: {}", p.object, p.reason))
            .collect();
        assert_eq!(
            problems.len(),
            case.problems.len(),
            "problems: {problems:#?}"
        );
        for (p, want) in problems.iter().zip(case.problems) {
            assert!(p.contains(want), "problem {p:?} should contain {want:?}");
        }
        assert_eq!(t.notes.len(), case.notes, "notes: {:?}", t.notes);
        t
    }

    fn web_slice() -> EndpointSlice {
        slice("web", "web-1", http_port(8080), vec![ready("10.0.0.1")])
    }

    #[test]
    fn external_name_skipped() {
        run(Case {
            services: vec![service(
                "ext",
                json!({"type": "ExternalName", "externalName": "example.com",
                                                 "ports": [{"port": 80}]}),
            )],
            slices: vec![],
            want: &[],
            problems: &[],
            notes: 0,
        });
    }

    #[test]
    fn headless_skipped() {
        run(Case {
            services: vec![
                service(
                    "none",
                    json!({"clusterIP": "None", "ports": [{"port": 80}]}),
                ),
                service("empty", json!({"clusterIP": "", "ports": [{"port": 80}]})),
                service("unset", json!({"ports": [{"port": 80}]})),
            ],
            slices: vec![],
            want: &[],
            problems: &[],
            notes: 0,
        });
    }

    #[test]
    fn service_proxy_name_label_skipped() {
        let labels = json!({"name": "other", "namespace": "demo",
                            "labels": {"service.kubernetes.io/service-proxy-name": "someone-else"}});
        run(Case {
            services: vec![service_meta(
                labels,
                json!({"clusterIP": "10.96.0.1", "ports": [{"port": 80}]}),
            )],
            slices: vec![],
            want: &[],
            problems: &[],
            notes: 0,
        });
    }

    #[test]
    fn no_endpoints_gives_frontend_with_empty_backends() {
        run(Case {
            services: vec![cluster_ip("web", "10.96.0.10", &[("http", 80, "TCP")])],
            slices: vec![],
            want: &[Want {
                frontend: "10.96.0.10:80/TCP",
                selected: &[],
                retained: &[],
            }],
            problems: &[],
            notes: 0,
        });
    }

    #[test]
    fn named_target_port_resolves_per_slice() {
        // Two pod versions listen on different container ports behind one named targetPort.
        run(Case {
            services: vec![cluster_ip("web", "10.96.0.10", &[("http", 80, "TCP")])],
            slices: vec![
                slice("web", "web-v1", http_port(8080), vec![ready("10.0.0.1")]),
                slice("web", "web-v2", http_port(9090), vec![ready("10.0.0.2")]),
            ],
            want: &[Want {
                frontend: "10.96.0.10:80/TCP",
                selected: &["10.0.0.1:8080", "10.0.0.2:9090"],
                retained: &[],
            }],
            problems: &[],
            notes: 0,
        });
    }

    #[test]
    fn ports_matched_by_name_and_protocol() {
        let ports = json!([{"name": "dns", "port": 5353, "protocol": "UDP"},
                           {"name": "dns-tcp", "port": 5354, "protocol": "TCP"},
                           {"name": "dns", "port": 9999, "protocol": "TCP"}]);
        run(Case {
            services: vec![cluster_ip(
                "dns",
                "10.96.0.53",
                &[("dns", 53, "UDP"), ("dns-tcp", 53, "TCP")],
            )],
            slices: vec![slice("dns", "dns-1", ports, vec![ready("10.0.0.1")])],
            want: &[
                Want {
                    frontend: "10.96.0.53:53/TCP",
                    selected: &["10.0.0.1:5354"],
                    retained: &[],
                },
                Want {
                    frontend: "10.96.0.53:53/UDP",
                    selected: &["10.0.0.1:5353"],
                    retained: &[],
                },
            ],
            problems: &[],
            notes: 0,
        });
    }

    #[test]
    fn unnamed_port_matches_unnamed_slice_port_only() {
        let svc = service(
            "web",
            json!({"clusterIP": "10.96.0.10", "ports": [{"port": 80}]}),
        );
        run(Case {
            services: vec![svc],
            slices: vec![
                slice(
                    "web",
                    "web-1",
                    json!([{"port": 8080}]),
                    vec![ready("10.0.0.1")],
                ),
                slice("web", "web-2", http_port(9090), vec![ready("10.0.0.2")]),
            ],
            want: &[Want {
                frontend: "10.96.0.10:80/TCP",
                selected: &["10.0.0.1:8080"],
                retained: &[],
            }],
            problems: &[],
            notes: 0,
        });
    }

    #[test]
    fn multiple_slices_merge_and_dedupe_preferring_the_local_copy() {
        let local = ep("10.0.0.2", NODE, (Some(true), None, None));
        run(Case {
            services: vec![cluster_ip("web", "10.96.0.10", &[("http", 80, "TCP")])],
            slices: vec![
                slice(
                    "web",
                    "web-a",
                    http_port(8080),
                    vec![ready("10.0.0.1"), ready("10.0.0.2")],
                ),
                slice(
                    "web",
                    "web-b",
                    http_port(8080),
                    vec![local, ready("10.0.0.3")],
                ),
            ],
            want: &[Want {
                frontend: "10.96.0.10:80/TCP",
                selected: &["10.0.0.1:8080", "10.0.0.2:8080 L", "10.0.0.3:8080"],
                retained: &[],
            }],
            problems: &[],
            notes: 0,
        });
    }

    #[test]
    fn slices_of_other_namespaces_services_and_address_types_are_ignored() {
        let mut other_ns = web_slice();
        other_ns.metadata.namespace = Some("elsewhere".into());
        run(Case {
            services: vec![cluster_ip("web", "10.96.0.10", &[("http", 80, "TCP")])],
            slices: vec![
                other_ns,
                slice("api", "api-1", http_port(8080), vec![ready("10.0.0.2")]),
                slice_typed(
                    "web",
                    "web-v6",
                    "IPv6",
                    http_port(8080),
                    vec![ready("fd00::1")],
                ),
                slice_typed(
                    "web",
                    "web-fqdn",
                    "FQDN",
                    http_port(8080),
                    vec![ready("example.com")],
                ),
            ],
            want: &[Want {
                frontend: "10.96.0.10:80/TCP",
                selected: &[],
                retained: &[],
            }],
            problems: &[],
            notes: 0,
        });
    }

    #[test]
    fn ready_endpoints_selected_serving_terminating_retained() {
        run(Case {
            services: vec![cluster_ip("web", "10.96.0.10", &[("http", 80, "TCP")])],
            slices: vec![slice(
                "web",
                "web-1",
                http_port(8080),
                vec![
                    ready("10.0.0.1"),
                    terminating("10.0.0.2", true),
                    // Not serving: retained for its established TCP/SCTP flows, flagged.
                    terminating("10.0.0.3", false),
                    ep(
                        "10.0.0.4",
                        "node-b",
                        (Some(false), Some(false), Some(false)),
                    ), // not ready (a failing readiness probe): the same
                    // Not ready yet serving (the API allows it): retained, not flagged.
                    ep("10.0.0.5", "node-b", (Some(false), Some(true), Some(false))),
                ],
            )],
            want: &[Want {
                frontend: "10.96.0.10:80/TCP",
                selected: &["10.0.0.1:8080"],
                retained: &[
                    "10.0.0.2:8080 T",
                    "10.0.0.3:8080 T N",
                    "10.0.0.4:8080 N",
                    "10.0.0.5:8080",
                ],
            }],
            problems: &[],
            notes: 0,
        });
    }

    #[test]
    fn serving_terminating_fallback_when_none_ready() {
        run(Case {
            services: vec![cluster_ip("web", "10.96.0.10", &[("http", 80, "TCP")])],
            slices: vec![slice(
                "web",
                "web-1",
                http_port(8080),
                vec![
                    terminating("10.0.0.2", true),
                    terminating("10.0.0.3", false),
                ],
            )],
            want: &[Want {
                frontend: "10.96.0.10:80/TCP",
                selected: &["10.0.0.2:8080 T"],
                retained: &["10.0.0.3:8080 T N"],
            }],
            problems: &[],
            notes: 0,
        });
    }

    /// Every endpoint not ready: nothing selected (new flows rejected), all retained flagged
    /// not serving, so established TCP flows go on (kube-proxy's REJECT matches NEW only).
    #[test]
    fn none_ready_selects_nothing_and_retains_all_not_serving() {
        let not_ready = |a: &str| ep(a, "node-b", (Some(false), Some(false), Some(false)));
        let t = run(Case {
            services: vec![cluster_ip("web", "10.96.0.10", &[("http", 80, "TCP")])],
            slices: vec![slice(
                "web",
                "web-1",
                http_port(8080),
                vec![not_ready("10.0.0.1"), not_ready("10.0.0.2")],
            )],
            want: &[Want {
                frontend: "10.96.0.10:80/TCP",
                selected: &[],
                retained: &["10.0.0.1:8080 N", "10.0.0.2:8080 N"],
            }],
            problems: &[],
            notes: 0,
        });
        let df = t.desired.frontends.values().next().expect("frontend");
        assert!(!df.drop_when_empty, "rejected, not dropped");
    }

    #[test]
    fn nil_conditions_ready_true_serving_as_ready_terminating_false() {
        run(Case {
            services: vec![cluster_ip("web", "10.96.0.10", &[("http", 80, "TCP")])],
            slices: vec![slice(
                "web",
                "web-1",
                http_port(8080),
                vec![
                    // No conditions at all: ready.
                    json!({"addresses": ["10.0.0.1"]}),
                    // Not ready, terminating, serving unset = not serving: no fallback,
                    // retained flagged not serving.
                    ep("10.0.0.2", "node-b", (Some(false), None, Some(true))),
                ],
            )],
            want: &[Want {
                frontend: "10.96.0.10:80/TCP",
                selected: &["10.0.0.1:8080"],
                retained: &["10.0.0.2:8080 T N"],
            }],
            problems: &[],
            notes: 0,
        });
    }

    fn itp_local(name: &str, ip: &str) -> Service {
        service(
            name,
            json!({"clusterIP": ip, "internalTrafficPolicy": "Local",
                             "ports": [{"name": "http", "port": 80}]}),
        )
    }

    #[test]
    fn itp_local_selects_only_this_nodes_endpoints() {
        let local_ready = ep("10.0.0.1", NODE, (Some(true), Some(true), Some(false)));
        let local_term = ep("10.0.0.3", NODE, (Some(false), Some(true), Some(true)));
        run(Case {
            services: vec![itp_local("web", "10.96.0.10")],
            slices: vec![slice(
                "web",
                "web-1",
                http_port(8080),
                vec![local_ready, ready("10.0.0.2"), local_term],
            )],
            want: &[Want {
                frontend: "10.96.0.10:80/TCP",
                selected: &["10.0.0.1:8080 L"],
                retained: &["10.0.0.3:8080 T L"],
            }],
            problems: &[],
            notes: 0,
        });
    }

    #[test]
    fn itp_local_falls_back_to_local_serving_terminating() {
        let local_term = ep("10.0.0.3", NODE, (Some(false), Some(true), Some(true)));
        run(Case {
            services: vec![itp_local("web", "10.96.0.10")],
            slices: vec![slice(
                "web",
                "web-1",
                http_port(8080),
                vec![ready("10.0.0.2"), local_term],
            )],
            want: &[Want {
                frontend: "10.96.0.10:80/TCP",
                selected: &["10.0.0.3:8080 T L"],
                retained: &[],
            }],
            problems: &[],
            notes: 0,
        });
    }

    #[test]
    fn itp_local_without_local_endpoints_selects_none() {
        run(Case {
            services: vec![itp_local("web", "10.96.0.10")],
            slices: vec![slice(
                "web",
                "web-1",
                http_port(8080),
                vec![ready("10.0.0.2")],
            )],
            want: &[Want {
                frontend: "10.96.0.10:80/TCP",
                selected: &[],
                retained: &[],
            }],
            problems: &[],
            notes: 0,
        });
    }

    fn prefer_close(name: &str) -> Service {
        service(
            name,
            json!({"clusterIP": "10.96.0.10", "trafficDistribution": "PreferClose",
                             "ports": [{"name": "http", "port": 80}]}),
        )
    }

    #[test]
    fn zone_hints_used_when_every_ready_endpoint_has_hints_and_one_matches() {
        run(Case {
            services: vec![prefer_close("web")],
            slices: vec![slice(
                "web",
                "web-1",
                http_port(8080),
                vec![
                    hinted("10.0.0.1", &[ZONE]),
                    hinted("10.0.0.2", &["zone-b"]),
                    hinted("10.0.0.3", &["zone-b", ZONE]),
                    terminating("10.0.0.4", false), // not ready: its missing hints do not count
                ],
            )],
            want: &[Want {
                frontend: "10.96.0.10:80/TCP",
                selected: &["10.0.0.1:8080", "10.0.0.3:8080"],
                // A ready endpoint of another zone is not kept; a not-ready one is.
                retained: &["10.0.0.4:8080 T N"],
            }],
            problems: &[],
            notes: 0,
        });
    }

    #[test]
    fn zone_hints_ignored_when_a_ready_endpoint_has_none() {
        run(Case {
            services: vec![prefer_close("web")],
            slices: vec![slice(
                "web",
                "web-1",
                http_port(8080),
                vec![hinted("10.0.0.1", &[ZONE]), ready("10.0.0.2")],
            )],
            want: &[Want {
                frontend: "10.96.0.10:80/TCP",
                selected: &["10.0.0.1:8080", "10.0.0.2:8080"],
                retained: &[],
            }],
            problems: &[],
            notes: 0,
        });
    }

    #[test]
    fn zone_hints_ignored_when_none_matches_this_zone() {
        run(Case {
            services: vec![prefer_close("web")],
            slices: vec![slice(
                "web",
                "web-1",
                http_port(8080),
                vec![
                    hinted("10.0.0.1", &["zone-b"]),
                    hinted("10.0.0.2", &["zone-c"]),
                ],
            )],
            want: &[Want {
                frontend: "10.96.0.10:80/TCP",
                selected: &["10.0.0.1:8080", "10.0.0.2:8080"],
                retained: &[],
            }],
            problems: &[],
            notes: 0,
        });
    }

    /// Upstream (trafficDistribution GA): hints are used whenever the endpoints carry them,
    /// whether or not the Service asked for topology (annotation or trafficDistribution).
    #[test]
    fn zone_hints_used_without_the_service_asking() {
        run(Case {
            services: vec![cluster_ip("web", "10.96.0.10", &[("http", 80, "TCP")])],
            slices: vec![slice(
                "web",
                "web-1",
                http_port(8080),
                vec![hinted("10.0.0.1", &[ZONE]), hinted("10.0.0.2", &["zone-b"])],
            )],
            want: &[Want {
                frontend: "10.96.0.10:80/TCP",
                selected: &["10.0.0.1:8080"],
                retained: &[],
            }],
            problems: &[],
            notes: 0,
        });
    }

    /// A ready endpoint with node hints (`forNodes`, PreferSameNode) and zone hints.
    fn node_hinted(addr: &str, nodes: &[&str], zones: &[&str]) -> Value {
        let mut v = hinted(addr, zones);
        v["hints"]["forNodes"] = nodes.iter().map(|n| json!({"name": n})).collect();
        v
    }

    /// PreferSameNode (upstream `topologyModeFromHints`): node hints win when every ready
    /// endpoint has some and one names this node; otherwise zone hints apply as before.
    #[test]
    fn node_hints_preferred_when_every_ready_endpoint_has_them_and_one_names_this_node() {
        let same_node = |name: &str| {
            service(
                name,
                json!({"clusterIP": "10.96.0.10", "trafficDistribution": "PreferSameNode",
                       "ports": [{"name": "http", "port": 80}]}),
            )
        };
        let cases: [(&str, Vec<Value>, &[&str]); 4] = [
            (
                "every endpoint node-hinted, one for this node: that one",
                vec![
                    node_hinted("10.0.0.1", &[NODE], &[ZONE]),
                    node_hinted("10.0.0.2", &["node-b"], &[ZONE]),
                    node_hinted("10.0.0.3", &["node-c"], &["zone-b"]),
                ],
                &["10.0.0.1:8080"],
            ),
            (
                "no endpoint for this node: the zone hints",
                vec![
                    node_hinted("10.0.0.1", &["node-b"], &[ZONE]),
                    node_hinted("10.0.0.2", &["node-c"], &[ZONE]),
                    node_hinted("10.0.0.3", &["node-d"], &["zone-b"]),
                ],
                &["10.0.0.1:8080", "10.0.0.2:8080"],
            ),
            (
                "one ready endpoint without node hints: the zone hints",
                vec![
                    node_hinted("10.0.0.1", &[NODE], &[ZONE]),
                    hinted("10.0.0.2", &[ZONE]),
                    hinted("10.0.0.3", &["zone-b"]),
                ],
                &["10.0.0.1:8080", "10.0.0.2:8080"],
            ),
            (
                "a not-ready endpoint's missing hints do not count",
                vec![
                    node_hinted("10.0.0.1", &[NODE], &[ZONE]),
                    node_hinted("10.0.0.2", &["node-b"], &[ZONE]),
                    terminating("10.0.0.4", false),
                ],
                &["10.0.0.1:8080"],
            ),
        ];
        for (what, endpoints, selected) in cases {
            let t = translate(
                &Snapshot::new(
                    vec![same_node("web")],
                    vec![slice("web", "web-1", http_port(8080), endpoints)],
                ),
                &NodeContext {
                    scheduler: Default::default(),
                    node_name: NODE.into(),
                    zone: Some(ZONE.into()),
                },
            );
            let got: Vec<String> = t
                .desired
                .frontends
                .values()
                .next()
                .expect("frontend")
                .backends
                .iter()
                .map(show)
                .collect();
            assert_eq!(got, selected, "{what}");
        }
    }

    /// Both families' frontends as "addr:port/proto kind -> backends" (IPv4 first), to compare
    /// whole translations.
    fn by_family(t: &Translation) -> (Vec<String>, Vec<String>) {
        fn one<A: Family>(state: &DesiredState<A>) -> Vec<String> {
            (state.frontends.iter())
                .map(|(fe, df)| {
                    let backends: Vec<String> = (df.backends.iter())
                        .map(|b| format!("{}", b.endpoint))
                        .collect();
                    let ranges: Vec<String> = df
                        .source_ranges
                        .iter()
                        .map(|(a, l)| format!("{a}/{l}"))
                        .collect();
                    let mut line = format!("{fe} {} -> [{}]", df.kind.label(), backends.join(" "));
                    if !ranges.is_empty() {
                        line.push_str(&format!(" from {}", ranges.join(" ")));
                    }
                    if df.drop_when_empty {
                        line.push_str(" drop");
                    }
                    line
                })
                .collect()
        }
        (one(&t.desired), one(&t.desired6))
    }

    fn translate_dual(services: Vec<Service>, slices: Vec<EndpointSlice>) -> Translation {
        let snapshot = Snapshot::new(services, slices);
        let node = NodeContext {
            scheduler: Default::default(),
            node_name: NODE.into(),
            zone: Some(ZONE.into()),
        };
        let v6: Ipv6Addr = "2001:db8:50::10".parse().unwrap();
        translate_families(&snapshot, &node, &NODE_ADDRS[..1], &[v6])
    }

    fn slice6(service: &str, name: &str, endpoints: Vec<Value>) -> EndpointSlice {
        slice_typed(service, name, "IPv6", http_port(8080), endpoints)
    }

    /// A dual-stack Service gets frontends on both families, each with its own family's
    /// endpoints (the IPv6 slice feeds IPv6 frontends only), NodePorts on each family's node
    /// addresses, externalIPs / LB IPs / source ranges split by family.
    #[test]
    fn dual_stack_service_gets_both_families_from_their_own_slices() {
        let svc = external_service(
            "dual",
            json!({"type": "LoadBalancer", "clusterIP": "10.96.0.10",
                   "clusterIPs": ["10.96.0.10", "fd00:96::10"], "ipFamilies": ["IPv4", "IPv6"],
                   "externalIPs": ["192.168.60.10", "2001:db8:60::10"],
                   "loadBalancerSourceRanges": ["192.168.0.0/16", "2001:db8:1:2::3/48"],
                   "ports": [{"name": "http", "port": 80, "nodePort": 30080}]}),
            json!({"loadBalancer": {"ingress": [{"ip": "192.168.70.10"},
                                                {"ip": "2001:db8:70::10"}]}}),
        );
        let t = translate_dual(
            vec![svc],
            vec![
                slice("dual", "dual-4", http_port(8080), vec![ready("10.244.1.1")]),
                slice6(
                    "dual",
                    "dual-6",
                    vec![ready("fd00:244::1"), ready("fd00:244::2")],
                ),
            ],
        );
        assert_eq!(t.problems, [], "{:?}", t.problems);
        let (v4, v6) = by_family(&t);
        assert_eq!(
            v4,
            [
                "10.96.0.10:80/TCP cluster_ip -> [10.244.1.1:8080/TCP]",
                "192.168.50.10:30080/TCP node_port -> [10.244.1.1:8080/TCP]",
                "192.168.60.10:80/TCP external_ip -> [10.244.1.1:8080/TCP]",
                "192.168.70.10:80/TCP load_balancer -> [10.244.1.1:8080/TCP] from 192.168.0.0/16",
            ]
        );
        let six = "[fd00:244::1:8080/TCP fd00:244::2:8080/TCP]";
        assert_eq!(
            v6,
            [
                format!("2001:db8:50::10:30080/TCP node_port -> {six}"),
                format!("2001:db8:60::10:80/TCP external_ip -> {six}"),
                format!("2001:db8:70::10:80/TCP load_balancer -> {six} from 2001:db8:1::/48"),
                format!("fd00:96::10:80/TCP cluster_ip -> {six}"),
            ]
        );
    }

    /// An IPv6-only Service has IPv6 frontends only (its IPv4 externalIP included: upstream's
    /// IPv4 proxier skips a Service without an IPv4 cluster IP), and reports its problems once.
    #[test]
    fn ipv6_only_service_has_no_ipv4_frontends() {
        let svc = external_service(
            "v6",
            json!({"type": "NodePort", "clusterIP": "fd00:96::20", "ipFamilies": ["IPv6"],
                   "externalIPs": ["192.168.60.20", "2001:db8:60::20"],
                   "sessionAffinity": "ClientIP",
                   "sessionAffinityConfig": {"clientIP": {"timeoutSeconds": 0}},
                   "ports": [{"name": "http", "port": 80, "nodePort": 30081}]}),
            json!({}),
        );
        let t = translate_dual(
            vec![svc],
            vec![slice6("v6", "v6-1", vec![ready("fd00:244::5")])],
        );
        let (v4, v6) = by_family(&t);
        assert_eq!(v4, Vec::<String>::new());
        assert_eq!(
            v6,
            [
                "2001:db8:50::10:30081/TCP node_port -> [fd00:244::5:8080/TCP]",
                "2001:db8:60::20:80/TCP external_ip -> [fd00:244::5:8080/TCP]",
                "fd00:96::20:80/TCP cluster_ip -> [fd00:244::5:8080/TCP]",
            ]
        );
        assert!(
            t.desired6
                .frontends
                .values()
                .all(|df| df.balancing.affinity_timeout_s == Some(DEFAULT_AFFINITY_TIMEOUT_S)),
            "affinity on IPv6 too"
        );
        assert_eq!(
            t.problems.len(),
            1,
            "the bad timeout once: {:?}",
            t.problems
        );
        assert!(t.problems[0].reason.contains("timeoutSeconds 0"));
    }

    /// Upstream's dual-stack rule: a dual-stack Service whose slices are all IPv4 works on IPv4
    /// and has IPv6 frontends without backends (rejected: ICMPv6 unreachable), never IPv4
    /// backends behind an IPv6 frontend; IPv6 slices never feed IPv4 frontends.
    #[test]
    fn each_family_gets_its_own_slices_only() {
        let dual = |name: &str, v4: &str, v6: &str| {
            service(
                name,
                json!({"clusterIP": v4, "clusterIPs": [v4, v6], "ipFamilies": ["IPv4", "IPv6"],
                       "internalTrafficPolicy": "Local", "ports": [{"name": "http", "port": 80}]}),
            )
        };
        let t = translate_dual(
            vec![
                dual("only4", "10.96.0.30", "fd00:96::30"),
                dual("only6", "10.96.0.31", "fd00:96::31"),
            ],
            vec![
                slice(
                    "only4",
                    "only4-1",
                    http_port(8080),
                    vec![ep("10.244.1.30", NODE, (Some(true), None, None))],
                ),
                slice6(
                    "only6",
                    "only6-1",
                    vec![ep("fd00:244::31", NODE, (Some(true), None, None))],
                ),
                // An IPv4 address in an IPv6 slice is not an IPv6 endpoint.
                slice6("only4", "only4-6", vec![ready("10.244.1.99")]),
            ],
        );
        let (v4, v6) = by_family(&t);
        assert_eq!(
            v4,
            [
                "10.96.0.30:80/TCP cluster_ip -> [10.244.1.30:8080/TCP]",
                "10.96.0.31:80/TCP cluster_ip -> []",
            ]
        );
        assert_eq!(
            v6,
            [
                "fd00:96::30:80/TCP cluster_ip -> []",
                "fd00:96::31:80/TCP cluster_ip -> [fd00:244::31:8080/TCP]",
            ]
        );
        // No endpoint of the family anywhere: rejected (not dropped as "served elsewhere").
        assert!(t.desired6.frontends.values().all(|df| !df.drop_when_empty));
        assert_eq!(t.problems.len(), 1, "{:?}", t.problems);
        assert!(
            t.problems[0].object == "EndpointSlice demo/only4-6"
                && t.problems[0].reason.contains("not an IPv6 address"),
            "{}",
            t.problems[0]
        );
    }

    /// One health-check node port per family, as upstream's per-family proxiers: each family
    /// lists the Services with a cluster IP of that family (IPv6 primary or not), and counts
    /// only that family's local ready endpoints (a dual-stack Service with local IPv4 endpoints
    /// only is healthy on IPv4 and not on IPv6).
    #[test]
    fn health_checks_are_per_family_with_each_familys_local_endpoints() {
        let lb = |name: &str, ips: Value, families: Value, port: i32| {
            external_service(
                name,
                json!({"type": "LoadBalancer", "clusterIP": ips[0], "clusterIPs": ips,
                       "ipFamilies": families, "externalTrafficPolicy": "Local",
                       "healthCheckNodePort": port,
                       "ports": [{"name": "http", "port": 80, "nodePort": port + 1}]}),
                json!({}),
            )
        };
        let local = |a: &str| ep(a, NODE, (Some(true), Some(true), Some(false)));
        let t = translate_dual(
            vec![
                lb(
                    "six-first",
                    json!(["fd00::1", "10.96.0.1"]),
                    json!(["IPv6", "IPv4"]),
                    31000,
                ),
                lb(
                    "four-first",
                    json!(["10.96.0.2", "fd00::2"]),
                    json!(["IPv4", "IPv6"]),
                    31010,
                ),
                lb("six-only", json!(["fd00::3"]), json!(["IPv6"]), 31020),
            ],
            vec![
                // six-first: one local IPv4 endpoint, two local IPv6 ones and a remote one.
                slice(
                    "six-first",
                    "sf-4",
                    http_port(8080),
                    vec![local("10.244.1.5")],
                ),
                slice6(
                    "six-first",
                    "sf-6",
                    vec![
                        local("fd00:244:1::5"),
                        local("fd00:244:1::6"),
                        ready("fd00:244:2::5"),
                    ],
                ),
                // four-first: local IPv4 endpoints only.
                slice(
                    "four-first",
                    "ff-4",
                    http_port(8080),
                    vec![local("10.244.1.7"), local("10.244.1.8")],
                ),
                slice6("six-only", "so-6", vec![local("fd00:244:1::9")]),
            ],
        );
        let counts = |checks: &[HealthCheck]| -> Vec<(String, u16, usize)> {
            (checks.iter())
                .map(|h| (h.name.clone(), h.port, h.local_endpoints))
                .collect()
        };
        assert_eq!(
            counts(&t.health_checks),
            [
                ("six-first".into(), 31000, 1),
                ("four-first".into(), 31010, 2)
            ]
        );
        assert_eq!(
            counts(&t.health_checks6),
            [
                ("six-first".into(), 31000, 2),
                ("four-first".into(), 31010, 0),
                ("six-only".into(), 31020, 1)
            ]
        );
        // The one-family translation the agent's IPv6 family runs reports the same.
        let snapshot = Snapshot::new(
            vec![lb("six-only", json!(["fd00::3"]), json!(["IPv6"]), 31020)],
            vec![slice6("six-only", "so-6", vec![local("fd00:244:1::9")])],
        );
        let node = NodeContext {
            scheduler: Default::default(),
            node_name: NODE.into(),
            zone: Some(ZONE.into()),
        };
        let v6: Ipv6Addr = "2001:db8:50::10".parse().unwrap();
        let one = translate_one_family(&snapshot, &node, &[v6]);
        assert_eq!(counts(&one.health_checks), [("six-only".into(), 31020, 1)]);
        let four = translate_one_family(&snapshot, &node, &NODE_ADDRS[..1]);
        assert!(four.health_checks.is_empty(), "{:?}", four.health_checks);
    }

    /// Bad family input is reported once, naming the Service, and skips it on both families;
    /// other Services are kept.
    #[test]
    fn bad_dual_stack_input_is_reported_once() {
        let t = translate_dual(
            vec![
                // Two IPv6 addresses (no ipFamilies).
                service(
                    "two6",
                    json!({"clusterIP": "fd00::1", "clusterIPs": ["fd00::1", "fd00::2"],
                                       "ports": [{"port": 80}]}),
                ),
                // The families say IPv4 first; the first address is IPv6.
                service(
                    "swapped",
                    json!({"clusterIP": "fd00::3",
                    "clusterIPs": ["fd00::3", "10.96.0.3"], "ipFamilies": ["IPv4", "IPv6"],
                    "ports": [{"port": 80}]}),
                ),
                // A bad second address: the Service is skipped on both families.
                service(
                    "bad6",
                    json!({"clusterIP": "10.96.0.4",
                    "clusterIPs": ["10.96.0.4", "fd00::zz"], "ports": [{"port": 80}]}),
                ),
                service(
                    "families",
                    json!({"clusterIP": "10.96.0.5", "ipFamilies": ["IPv4", "IPv4"],
                    "ports": [{"port": 80}]}),
                ),
                // A bad IPv6 source range is reported (by the primary family only).
                service(
                    "ranges",
                    json!({"type": "LoadBalancer", "clusterIP": "fd00::6",
                    "clusterIPs": ["fd00::6", "10.96.0.6"], "ipFamilies": ["IPv6", "IPv4"],
                    "loadBalancerSourceRanges": ["2001:db8::/129"],
                    "ports": [{"port": 80}]}),
                ),
                service(
                    "good",
                    json!({"clusterIP": "fd00::7", "ports": [{"port": 80}]}),
                ),
            ],
            vec![],
        );
        let (v4, v6) = by_family(&t);
        assert_eq!(v4, ["10.96.0.6:80/TCP cluster_ip -> []"]);
        assert_eq!(
            v6,
            [
                "fd00::6:80/TCP cluster_ip -> []",
                "fd00::7:80/TCP cluster_ip -> []"
            ]
        );
        let mut reported: Vec<(String, String)> = (t.problems.iter())
            .map(|p| (p.object.clone(), p.reason.clone()))
            .collect();
        reported.sort();
        let objects: Vec<&str> = reported.iter().map(|(o, _)| o.as_str()).collect();
        assert_eq!(
            objects,
            [
                "Service demo/bad6",
                "Service demo/families",
                "Service demo/ranges",
                "Service demo/swapped",
                "Service demo/two6",
            ],
            "{reported:#?}"
        );
        assert!(reported[0].1.contains("\"fd00::zz\" is not an IP address"));
        assert!(reported[1].1.contains("spec.ipFamilies"));
        assert!(reported[2].1.contains("\"2001:db8::/129\""));
        assert!(reported[3].1.contains("do not match spec.ipFamilies"));
        assert!(reported[4].1.contains("do not match"));
        assert_eq!(t.notes, []);
    }

    #[test]
    fn bad_cluster_ip_reported_and_others_kept() {
        run(Case {
            services: vec![
                cluster_ip("bad", "10.96.0.300", &[("http", 80, "TCP")]),
                cluster_ip("web", "10.96.0.10", &[("http", 80, "TCP")]),
            ],
            slices: vec![web_slice()],
            want: &[Want {
                frontend: "10.96.0.10:80/TCP",
                selected: &["10.0.0.1:8080"],
                retained: &[],
            }],
            problems: &["Service demo/bad: clusterIP \"10.96.0.300\" is not an IP address"],
            notes: 0,
        });
    }

    #[test]
    fn port_zero_or_too_large_reported_and_service_skipped() {
        run(Case {
            services: vec![
                cluster_ip("zero", "10.96.0.1", &[("a", 0, "TCP")]),
                cluster_ip(
                    "big",
                    "10.96.0.2",
                    &[("ok", 80, "TCP"), ("b", 70000, "TCP")],
                ),
                cluster_ip("web", "10.96.0.10", &[("http", 80, "TCP")]),
            ],
            slices: vec![web_slice()],
            want: &[Want {
                frontend: "10.96.0.10:80/TCP",
                selected: &["10.0.0.1:8080"],
                retained: &[],
            }],
            problems: &[
                "Service demo/big: port \"b\" has invalid number 70000",
                "Service demo/zero: port \"a\" has invalid number 0",
            ],
            notes: 0,
        });
    }

    #[test]
    fn sctp_ports_are_programmed_like_tcp_with_their_slice_ports() {
        // The same port number on SCTP and TCP is two frontends, each with its own target port.
        let slices = vec![slice(
            "web",
            "web-1",
            json!([{"name": "sig", "port": 9001, "protocol": "SCTP"},
                   {"name": "http", "port": 8080, "protocol": "TCP"}]),
            vec![ready("10.0.0.1")],
        )];
        run(Case {
            services: vec![cluster_ip(
                "web",
                "10.96.0.10",
                &[("sig", 80, "SCTP"), ("http", 80, "TCP")],
            )],
            slices,
            want: &[
                Want {
                    frontend: "10.96.0.10:80/TCP",
                    selected: &["10.0.0.1:8080"],
                    retained: &[],
                },
                Want {
                    frontend: "10.96.0.10:80/SCTP",
                    selected: &["10.0.0.1:9001"],
                    retained: &[],
                },
            ],
            problems: &[],
            notes: 0,
        });
    }

    #[test]
    fn sctp_port_without_an_sctp_slice_port_has_no_endpoints() {
        // A slice port of the same name but another protocol does not serve the SCTP port.
        run(Case {
            services: vec![cluster_ip("web", "10.96.0.10", &[("http", 9000, "SCTP")])],
            slices: vec![web_slice()],
            want: &[Want {
                frontend: "10.96.0.10:9000/SCTP",
                selected: &[],
                retained: &[],
            }],
            problems: &[],
            notes: 0,
        });
    }

    #[test]
    fn unknown_protocol_is_reported_and_skips_the_service() {
        run(Case {
            services: vec![
                cluster_ip(
                    "web",
                    "10.96.0.10",
                    &[("x", 9000, "ICMP"), ("http", 80, "TCP")],
                ),
                cluster_ip("other", "10.96.0.11", &[("http", 80, "TCP")]),
            ],
            slices: vec![],
            want: &[Want {
                frontend: "10.96.0.11:80/TCP",
                selected: &[],
                retained: &[],
            }],
            problems: &["Service demo/web: port \"x\" has unknown protocol \"ICMP\""],
            notes: 0,
        });
    }

    #[test]
    fn duplicate_cluster_ip_ports_go_to_the_first_by_name_whatever_the_input_order() {
        for order in [["a", "b"], ["b", "a"]] {
            let services = order
                .iter()
                .map(|n| cluster_ip(n, "10.96.0.10", &[("http", 80, "TCP"), ("x", 81, "TCP")]))
                .collect();
            run(Case {
                services,
                slices: vec![],
                want: &[
                    Want {
                        frontend: "10.96.0.10:80/TCP",
                        selected: &[],
                        retained: &[],
                    },
                    Want {
                        frontend: "10.96.0.10:81/TCP",
                        selected: &[],
                        retained: &[],
                    },
                ],
                problems: &[
                    "Service demo/b: frontend 10.96.0.10:80/TCP (clusterIP of port \"http\") is \
                     held by Service demo/a:http as its clusterIP (same creationTimestamp",
                    "Service demo/b: frontend 10.96.0.10:81/TCP (clusterIP of port \"x\") is \
                     held by Service demo/a:x as its clusterIP",
                ],
                notes: 0,
            });
        }
    }

    #[test]
    fn bad_endpoint_address_reported_and_endpoint_skipped() {
        run(Case {
            services: vec![cluster_ip("web", "10.96.0.10", &[("http", 80, "TCP")])],
            slices: vec![slice(
                "web",
                "web-1",
                http_port(8080),
                vec![ready("10.0.0.256"), ready("10.0.0.1")],
            )],
            want: &[Want {
                frontend: "10.96.0.10:80/TCP",
                selected: &["10.0.0.1:8080"],
                retained: &[],
            }],
            problems: &["EndpointSlice demo/web-1: endpoint address \"10.0.0.256\""],
            notes: 0,
        });
    }

    #[test]
    fn deploy_examples_translate_without_problems() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/examples");
        let load = crate::sources::manifests::load_dir(&dir);
        assert_eq!(load.problems, [], "deploy/examples must load cleanly");
        let node = NodeContext {
            scheduler: Default::default(),
            node_name: "node-a".into(),
            zone: None,
        };
        let t = translate(&load.snapshot, &node);
        assert_eq!(t.problems, []);
        // The examples are dual-stack: only their IPv6 cluster IPs may be noted (not programmed
        // until the IPv6 control plane lands; then the IPv6 frontends belong in `got` below).
        assert!(
            (t.notes.iter()).all(|n| n.reason.starts_with("IPv6 cluster IP(s)")),
            "{:?}",
            t.notes
        );
        let three = |port| {
            ["10.244.1.11", "10.244.1.12", "10.244.1.13"]
                .map(|a| format!("{a}:{port} L"))
                .to_vec()
        };
        let got: Vec<(String, Vec<String>)> = t
            .desired
            .frontends
            .iter()
            .map(|(fe, df)| (fe.to_string(), df.backends.iter().map(show).collect()))
            .collect();
        assert_eq!(
            got,
            [
                ("10.96.0.10:80/TCP".to_owned(), three(8080)),
                ("10.96.0.20:53/UDP".to_owned(), three(5353)),
                ("10.96.0.30:80/TCP".to_owned(), vec![]),
                (
                    "10.96.0.40:5201/TCP".to_owned(),
                    vec!["10.244.1.11:5201 L".to_owned()]
                ),
            ]
        );
        let web = t.desired.frontends.values().next().expect("web");
        assert_eq!(web.service.to_string(), "demo/web:http");
    }

    // ----- NodePort, externalIPs, LoadBalancer, externalTrafficPolicy, health-check node port.

    const NODE_ADDRS: [Ipv4Addr; 2] = [Ipv4Addr::new(192, 168, 50, 10), Ipv4Addr::new(10, 0, 0, 5)];

    fn translate_node(services: Vec<Service>, slices: Vec<EndpointSlice>) -> Translation {
        let snapshot = Snapshot::new(services, slices);
        let node = NodeContext {
            scheduler: Default::default(),
            node_name: NODE.into(),
            zone: Some(ZONE.into()),
        };
        translate_for_node(&snapshot, &node, &NODE_ADDRS)
    }

    /// Frontend → (kind, eTP local, selected backends).
    fn frontends(t: &Translation) -> Vec<(String, FrontendKind, bool, Vec<String>)> {
        t.desired
            .frontends
            .iter()
            .map(|(fe, df)| {
                (
                    fe.to_string(),
                    df.kind,
                    df.external_local,
                    df.backends.iter().map(show).collect(),
                )
            })
            .collect()
    }

    fn external_service(name: &str, spec: Value, status: Value) -> Service {
        serde_json::from_value(json!({
            "metadata": {"name": name, "namespace": "demo"},
            "spec": spec,
            "status": status,
        }))
        .expect("Service fixture")
    }

    fn local_and_remote_slice(service: &str) -> EndpointSlice {
        slice(
            service,
            &format!("{service}-1"),
            json!([{"name": "http", "port": 8080, "protocol": "TCP"}]),
            vec![
                ep("10.244.1.11", NODE, (Some(true), Some(true), Some(false))),
                ready("10.244.2.11"),
            ],
        )
    }

    #[test]
    fn node_port_gets_a_frontend_on_every_node_port_address() {
        let svc = external_service(
            "np",
            json!({"type": "NodePort", "clusterIP": "10.96.0.50",
                   "ports": [{"name": "http", "port": 80, "nodePort": 30080, "protocol": "TCP"}]}),
            json!({}),
        );
        let t = translate_node(vec![svc], vec![local_and_remote_slice("np")]);
        let both = vec![
            "10.244.1.11:8080 L".to_owned(),
            "10.244.2.11:8080".to_owned(),
        ];
        assert_eq!(
            frontends(&t),
            vec![
                (
                    "10.0.0.5:30080/TCP".into(),
                    FrontendKind::NodePort,
                    false,
                    both.clone()
                ),
                (
                    "10.96.0.50:80/TCP".into(),
                    FrontendKind::ClusterIp,
                    false,
                    both.clone()
                ),
                (
                    "192.168.50.10:30080/TCP".into(),
                    FrontendKind::NodePort,
                    false,
                    both
                ),
            ]
        );
        assert!(t.problems.is_empty(), "{:?}", t.problems);
        assert!(
            t.health_checks.is_empty(),
            "no health check for eTP=Cluster"
        );
    }

    #[test]
    fn node_port_field_ignored_on_cluster_ip_services_and_without_node_addresses() {
        let svc = external_service(
            "cip",
            json!({"type": "ClusterIP", "clusterIP": "10.96.0.51",
                   "ports": [{"name": "http", "port": 80, "nodePort": 30081}]}),
            json!({}),
        );
        let t = translate_node(vec![svc.clone()], vec![local_and_remote_slice("cip")]);
        assert_eq!(t.desired.frontends.len(), 1, "ClusterIP only");
        let np = external_service(
            "np",
            json!({"type": "NodePort", "clusterIP": "10.96.0.52",
                   "ports": [{"name": "http", "port": 80, "nodePort": 30082}]}),
            json!({}),
        );
        let snapshot = Snapshot::new(vec![np], vec![local_and_remote_slice("np")]);
        let t = translate(&snapshot, &NodeContext::default());
        assert_eq!(
            t.desired.frontends.len(),
            1,
            "no node addresses: no NodePorts"
        );
    }

    #[test]
    fn external_ips_and_load_balancer_ips_unless_ip_mode_proxy() {
        let svc = external_service(
            "lb",
            json!({"type": "LoadBalancer", "clusterIP": "10.96.0.53",
                   "externalIPs": ["192.168.60.10", "fd00::1", "not-an-ip"],
                   "ports": [{"name": "http", "port": 80, "nodePort": 30083}]}),
            json!({"loadBalancer": {"ingress": [
                {"ip": "192.168.70.10"},
                {"ip": "192.168.70.11", "ipMode": "VIP"},
                {"ip": "192.168.70.12", "ipMode": "Proxy"},
                {"hostname": "lb.example.com"},
            ]}}),
        );
        let t = translate_node(vec![svc], vec![local_and_remote_slice("lb")]);
        let kinds: Vec<(String, FrontendKind)> = frontends(&t)
            .into_iter()
            .map(|(fe, kind, _, _)| (fe, kind))
            .collect();
        assert_eq!(
            kinds,
            vec![
                ("10.0.0.5:30083/TCP".into(), FrontendKind::NodePort),
                ("10.96.0.53:80/TCP".into(), FrontendKind::ClusterIp),
                ("192.168.50.10:30083/TCP".into(), FrontendKind::NodePort),
                ("192.168.60.10:80/TCP".into(), FrontendKind::ExternalIp),
                ("192.168.70.10:80/TCP".into(), FrontendKind::LoadBalancer),
                ("192.168.70.11:80/TCP".into(), FrontendKind::LoadBalancer),
            ]
        );
        // The unparsable entry is reported on the Service (the other family's is not a problem).
        let problems: Vec<String> = t.problems.iter().map(|p| p.to_string()).collect();
        assert_eq!(problems.len(), 1, "{problems:?}");
        assert!(
            problems[0].contains("Service demo/lb") && problems[0].contains("\"not-an-ip\""),
            "{problems:?}"
        );
    }

    #[test]
    fn sctp_node_port_external_ip_and_load_balancer_ip() {
        let svc = external_service(
            "lb",
            json!({"type": "LoadBalancer", "clusterIP": "10.96.0.55",
                   "externalIPs": ["192.168.60.11"],
                   "ports": [{"name": "sig", "port": 3868, "nodePort": 30868,
                              "protocol": "SCTP"}]}),
            json!({"loadBalancer": {"ingress": [{"ip": "192.168.70.30"}]}}),
        );
        let slice = slice(
            "lb",
            "lb-1",
            json!([{"name": "sig", "port": 3869, "protocol": "SCTP"}]),
            vec![ready("10.244.2.11")],
        );
        let t = translate_node(vec![svc], vec![slice]);
        let backends = vec!["10.244.2.11:3869".to_owned()];
        assert_eq!(
            frontends(&t),
            vec![
                (
                    "10.0.0.5:30868/SCTP".into(),
                    FrontendKind::NodePort,
                    false,
                    backends.clone()
                ),
                (
                    "10.96.0.55:3868/SCTP".into(),
                    FrontendKind::ClusterIp,
                    false,
                    backends.clone()
                ),
                (
                    "192.168.50.10:30868/SCTP".into(),
                    FrontendKind::NodePort,
                    false,
                    backends.clone()
                ),
                (
                    "192.168.60.11:3868/SCTP".into(),
                    FrontendKind::ExternalIp,
                    false,
                    backends.clone()
                ),
                (
                    "192.168.70.30:3868/SCTP".into(),
                    FrontendKind::LoadBalancer,
                    false,
                    backends
                ),
            ]
        );
        assert!(t.problems.is_empty(), "{:?}", t.problems);
    }

    #[test]
    fn external_traffic_policy_local_selects_this_nodes_endpoints_for_external_frontends_only() {
        let svc = external_service(
            "local",
            json!({"type": "LoadBalancer", "clusterIP": "10.96.0.54",
                   "externalTrafficPolicy": "Local", "healthCheckNodePort": 32000,
                   "ports": [{"name": "http", "port": 80, "nodePort": 30084}]}),
            json!({"loadBalancer": {"ingress": [{"ip": "192.168.70.20"}]}}),
        );
        let t = translate_node(vec![svc], vec![local_and_remote_slice("local")]);
        let local = vec!["10.244.1.11:8080 L".to_owned()];
        let both = vec![
            "10.244.1.11:8080 L".to_owned(),
            "10.244.2.11:8080".to_owned(),
        ];
        // Each external frontend has an in-cluster entry with the cluster-wide endpoints.
        assert_eq!(
            frontends(&t),
            vec![
                (
                    "10.0.0.5:30084/TCP".into(),
                    FrontendKind::NodePort,
                    true,
                    local.clone()
                ),
                (
                    "10.0.0.5:30084/TCP (in-cluster)".into(),
                    FrontendKind::NodePort,
                    false,
                    both.clone()
                ),
                (
                    "10.96.0.54:80/TCP".into(),
                    FrontendKind::ClusterIp,
                    false,
                    both.clone()
                ),
                (
                    "192.168.50.10:30084/TCP".into(),
                    FrontendKind::NodePort,
                    true,
                    local.clone()
                ),
                (
                    "192.168.50.10:30084/TCP (in-cluster)".into(),
                    FrontendKind::NodePort,
                    false,
                    both.clone()
                ),
                (
                    "192.168.70.20:80/TCP".into(),
                    FrontendKind::LoadBalancer,
                    true,
                    local
                ),
                (
                    "192.168.70.20:80/TCP (in-cluster)".into(),
                    FrontendKind::LoadBalancer,
                    false,
                    both
                ),
            ]
        );
        assert_eq!(
            t.health_checks,
            vec![HealthCheck {
                namespace: "demo".into(),
                name: "local".into(),
                port: 32000,
                local_endpoints: 1,
            }]
        );
    }

    /// Upstream's `localEndpoints`: this node's ready endpoints summed over the Service's ports;
    /// a draining node (only terminating local endpoints, still serving the fallback) reports 0.
    #[test]
    fn health_check_counts_ready_local_endpoints_summed_over_ports() {
        let svc = |name: &str, ip: &str, hc: i32| {
            external_service(
                name,
                json!({"type": "LoadBalancer", "clusterIP": ip, "externalTrafficPolicy": "Local",
                       "healthCheckNodePort": hc,
                       "ports": [{"name": "http", "port": 80, "nodePort": hc - 2000},
                                 {"name": "dns", "port": 53, "protocol": "UDP",
                                  "nodePort": hc - 1999}]}),
                json!({}),
            )
        };
        let ports = json!([{"name": "http", "port": 8080, "protocol": "TCP"},
                           {"name": "dns", "port": 5353, "protocol": "UDP"}]);
        let local_ready = |a: &str| ep(a, NODE, (Some(true), Some(true), Some(false)));
        let local_draining = |a: &str| ep(a, NODE, (Some(false), Some(true), Some(true)));
        let t = translate_node(
            vec![
                svc("serving", "10.96.2.1", 32100),
                svc("draining", "10.96.2.2", 32200),
            ],
            vec![
                slice(
                    "serving",
                    "serving-1",
                    ports.clone(),
                    vec![
                        local_ready("10.244.1.21"),
                        local_ready("10.244.1.22"),
                        local_draining("10.244.1.23"),
                        ready("10.244.2.21"),
                    ],
                ),
                slice(
                    "draining",
                    "draining-1",
                    ports,
                    vec![local_draining("10.244.1.31"), ready("10.244.2.31")],
                ),
            ],
        );
        let counts: Vec<(&str, u16, usize)> = t
            .health_checks
            .iter()
            .map(|h| (h.name.as_str(), h.port, h.local_endpoints))
            .collect();
        assert_eq!(counts, vec![("serving", 32100, 4), ("draining", 32200, 0)]);
        // The draining node's terminating pod still serves eTP=Local traffic (the fallback).
        let np = Frontend::new(NODE_ADDRS[0], 30200, Protocol::Tcp);
        assert_eq!(
            t.desired.frontends[&np]
                .backends
                .iter()
                .map(show)
                .collect::<Vec<_>>(),
            vec!["10.244.1.31:8080 T L".to_owned()]
        );
    }

    #[test]
    fn etp_local_without_local_endpoints_has_empty_external_frontends_and_a_zero_health_check() {
        let svc = external_service(
            "elsewhere",
            json!({"type": "LoadBalancer", "clusterIP": "10.96.0.55",
                   "externalTrafficPolicy": "Local", "healthCheckNodePort": 32001,
                   "ports": [{"name": "http", "port": 80, "nodePort": 30085}]}),
            json!({}),
        );
        let remote_only = slice(
            "elsewhere",
            "elsewhere-1",
            json!([{"name": "http", "port": 8080, "protocol": "TCP"}]),
            vec![ready("10.244.2.11")],
        );
        let t = translate_node(vec![svc], vec![remote_only]);
        for (fe, df) in &t.desired.frontends {
            let backends = &df.backends;
            if df.kind == FrontendKind::ClusterIp {
                assert_eq!(backends.len(), 1, "{fe}: ClusterIP keeps cluster endpoints");
            } else if fe.scope == crate::pipeline::model::Scope::InCluster {
                assert!(
                    !df.external_local && backends.len() == 1,
                    "{fe}: {backends:?}"
                );
            } else {
                assert!(
                    df.external_local && backends.is_empty(),
                    "{fe}: {backends:?}"
                );
            }
        }
        assert_eq!(t.health_checks.len(), 1);
        assert_eq!(t.health_checks[0].local_endpoints, 0);
    }

    #[test]
    fn frontend_flags_follow_kind_and_policy() {
        use proxy_common::service_flags;
        let svc = external_service(
            "local",
            json!({"type": "NodePort", "clusterIP": "10.96.0.56", "externalTrafficPolicy": "Local",
                   "ports": [{"name": "http", "port": 80, "nodePort": 30086}]}),
            json!({}),
        );
        let t = translate_node(vec![svc], vec![local_and_remote_slice("local")]);
        let flags: Vec<u16> = t
            .desired
            .frontends
            .iter()
            .map(|(fe, d)| crate::pipeline::encode::frontend_flags(fe, d))
            .collect();
        let ext_local = service_flags::EXTERNAL | service_flags::EXTERNAL_LOCAL;
        // Node address 1 (+ its in-cluster entry), the ClusterIP, node address 2 (+ in-cluster):
        // in-cluster entries carry in-cluster traffic like a ClusterIP (no SNAT, no drop).
        assert_eq!(flags, vec![ext_local, 0, 0, ext_local, 0]);
        assert!(
            t.health_checks.is_empty(),
            "NodePort type has no health check"
        );
    }

    /// Upstream's verdicts without a usable endpoint: no usable endpoint anywhere rejects for
    /// every policy; a Local policy (internal or external) served only by other nodes drops.
    #[test]
    fn no_endpoint_verdicts_drop_only_when_a_local_policy_is_served_elsewhere() {
        use proxy_common::service_flags::{DROP_WHEN_EMPTY, EXTERNAL, EXTERNAL_LOCAL};
        let http = || json!([{"name": "http", "port": 8080, "protocol": "TCP"}]);
        let itp = |name: &str, ip: &str| {
            external_service(
                name,
                json!({"clusterIP": ip, "internalTrafficPolicy": "Local",
                       "ports": [{"name": "http", "port": 80}]}),
                json!({}),
            )
        };
        let etp = |name: &str, ip: &str, np: i32| {
            external_service(
                name,
                json!({"type": "NodePort", "clusterIP": ip, "externalTrafficPolicy": "Local",
                       "ports": [{"name": "http", "port": 80, "nodePort": np}]}),
                json!({}),
            )
        };
        let not_serving = ep(
            "10.244.2.13",
            "node-b",
            (Some(false), Some(false), Some(true)),
        );
        let t = translate_node(
            vec![
                itp("itp-elsewhere", "10.96.1.1"),
                itp("itp-nowhere", "10.96.1.2"),
                etp("etp-elsewhere", "10.96.1.3", 30101),
                etp("etp-nowhere", "10.96.1.4", 30102),
                etp("etp-draining-elsewhere", "10.96.1.5", 30103),
            ],
            vec![
                slice("itp-elsewhere", "a", http(), vec![ready("10.244.2.11")]),
                slice("itp-nowhere", "b", http(), vec![not_serving.clone()]),
                slice("etp-elsewhere", "c", http(), vec![ready("10.244.2.12")]),
                slice("etp-nowhere", "d", http(), vec![not_serving]),
                slice(
                    "etp-draining-elsewhere",
                    "e",
                    http(),
                    vec![terminating("10.244.2.14", true)],
                ),
            ],
        );
        let flags = |frontend: &str| {
            let (fe, df) = t
                .desired
                .frontends
                .iter()
                .find(|(fe, _)| fe.to_string() == frontend)
                .unwrap_or_else(|| panic!("no frontend {frontend}"));
            crate::pipeline::encode::frontend_flags(fe, df)
        };
        let ext = EXTERNAL | EXTERNAL_LOCAL;
        for (frontend, want) in [
            ("10.96.1.1:80/TCP", DROP_WHEN_EMPTY),
            ("10.96.1.2:80/TCP", 0),
            ("192.168.50.10:30101/TCP", ext | DROP_WHEN_EMPTY),
            ("192.168.50.10:30101/TCP (in-cluster)", 0),
            ("10.96.1.3:80/TCP", 0),
            ("192.168.50.10:30102/TCP", ext),
            ("192.168.50.10:30102/TCP (in-cluster)", 0),
            ("192.168.50.10:30103/TCP", ext | DROP_WHEN_EMPTY),
        ] {
            assert_eq!(flags(frontend), want, "{frontend}");
        }
    }

    #[test]
    fn session_affinity_client_ip_sets_the_timeout_on_every_frontend_of_the_service() {
        let svc = |name: &str, ip: &str, extra: Value| {
            let mut spec = json!({"type": "NodePort", "clusterIP": ip,
                                  "ports": [{"name": "http", "port": 80, "nodePort": 30090}]});
            spec.as_object_mut()
                .unwrap()
                .extend(extra.as_object().unwrap().clone());
            service(name, spec)
        };
        let cases = [
            ("none", json!({}), None, false),
            ("off", json!({"sessionAffinity": "None"}), None, false),
            (
                "dflt",
                json!({"sessionAffinity": "ClientIP"}),
                Some(10_800),
                false,
            ),
            (
                "short",
                json!({"sessionAffinity": "ClientIP",
                       "sessionAffinityConfig": {"clientIP": {"timeoutSeconds": 2}}}),
                Some(2),
                false,
            ),
            (
                "zero",
                json!({"sessionAffinity": "ClientIP",
                       "sessionAffinityConfig": {"clientIP": {"timeoutSeconds": 0}}}),
                Some(10_800),
                true,
            ),
            (
                "huge",
                json!({"sessionAffinity": "ClientIP",
                       "sessionAffinityConfig": {"clientIP": {"timeoutSeconds": 86_401}}}),
                Some(10_800),
                true,
            ),
        ];
        for (name, extra, want, problem) in cases {
            let t = translate_node(
                vec![svc(name, "10.96.0.90", extra)],
                vec![local_and_remote_slice(name)],
            );
            assert!(
                t.desired.frontends.len() >= 2,
                "{name}: ClusterIP and NodePort"
            );
            for (fe, df) in &t.desired.frontends {
                assert_eq!(df.balancing.affinity_timeout_s, want, "{name} {fe}");
            }
            assert_eq!(
                t.problems.len(),
                usize::from(problem),
                "{name}: {:?}",
                t.problems
            );
            if problem {
                let p = &t.problems[0];
                assert!(
                    p.object.contains(name) && p.reason.contains("timeoutSeconds"),
                    "{p:?}"
                );
            }
        }
    }

    #[test]
    fn load_balancer_source_ranges_apply_to_load_balancer_ips_only() {
        let svc = external_service(
            "ranges",
            json!({"type": "LoadBalancer", "clusterIP": "10.96.0.57",
                   "loadBalancerSourceRanges": ["192.168.50.100/30", "fd00::/8", "bogus"],
                   "externalIPs": ["192.168.60.11"],
                   "ports": [{"name": "http", "port": 80, "nodePort": 30087}]}),
            json!({"loadBalancer": {"ingress": [{"ip": "192.168.70.30"}]}}),
        );
        let t = translate_node(vec![svc], vec![local_and_remote_slice("ranges")]);
        for (fe, df) in &t.desired.frontends {
            let want = if df.kind == FrontendKind::LoadBalancer {
                vec![(Ipv4Addr::new(192, 168, 50, 100), 30)]
            } else {
                vec![]
            };
            assert_eq!(df.source_ranges, want, "{fe}");
            let flagged = crate::pipeline::encode::frontend_flags(fe, df)
                & proxy_common::service_flags::SOURCE_RANGES;
            assert_eq!(flagged != 0, !want.is_empty(), "{fe}");
        }
        assert_eq!(t.problems.len(), 1, "{:?}", t.problems);
        assert!(
            t.problems[0].reason.contains("\"bogus\""),
            "{:?}",
            t.problems
        );

        let annotated: Service = serde_json::from_value(json!({
            "metadata": {"name": "ann", "namespace": "demo", "annotations":
                {ANNOTATION_LB_SOURCE_RANGES: "10.1.2.3/8, 172.16.0.0/12"}},
            "spec": {"type": "LoadBalancer", "clusterIP": "10.96.0.58",
                     "ports": [{"name": "http", "port": 80, "nodePort": 30088}]},
            "status": {"loadBalancer": {"ingress": [{"ip": "192.168.70.31"}]}},
        }))
        .unwrap();
        let t = translate_node(vec![annotated], vec![local_and_remote_slice("ann")]);
        let lb = t
            .desired
            .frontends
            .values()
            .find(|df| df.kind == FrontendKind::LoadBalancer)
            .expect("LB frontend");
        assert_eq!(
            lb.source_ranges,
            vec![
                (Ipv4Addr::new(10, 0, 0, 0), 8),
                (Ipv4Addr::new(172, 16, 0, 0), 12)
            ],
            "annotation used, host bits cleared"
        );
    }

    #[test]
    fn scheduler_annotation_wins_over_the_node_and_a_bad_one_keeps_the_node_s() {
        let svc = |name: &str, ip: &str, node_port: i32, annotation: Option<&str>| {
            let mut meta = json!({"name": name, "namespace": "demo"});
            if let Some(a) = annotation {
                meta["annotations"] = json!({ANNOTATION_SCHEDULER: a});
            }
            service_meta(
                meta,
                json!({"type": "NodePort", "clusterIP": ip,
                       "ports": [{"name": "http", "port": 80, "nodePort": node_port}]}),
            )
        };
        let services = vec![
            svc("plain", "10.96.0.61", 30091, None),
            svc("rr", "10.96.0.62", 30092, Some("rr")),
            svc("alias", "10.96.0.63", 30093, Some(" wlc ")),
            svc("blank", "10.96.0.64", 30094, Some("  ")),
            svc("bad", "10.96.0.65", 30095, Some("fastest")),
        ];
        let slices = ["plain", "rr", "alias", "blank", "bad"]
            .map(local_and_remote_slice)
            .to_vec();
        let node = NodeContext {
            scheduler: Scheduler::SourceHash,
            node_name: NODE.into(),
            zone: None,
        };
        let t = translate_for_node(&Snapshot::new(services, slices), &node, &NODE_ADDRS);
        let by_service = |name: &str| -> Vec<Scheduler> {
            let v: Vec<Scheduler> = (t.desired.frontends.values())
                .filter(|df| df.service.name == name)
                .map(|df| df.balancing.scheduler)
                .collect();
            assert!(
                v.len() > 1,
                "{name}: ClusterIP and NodePort frontends: {v:?}"
            );
            v
        };
        let all = |s: Scheduler, n: &str| by_service(n).iter().all(|x| *x == s);
        assert!(all(Scheduler::SourceHash, "plain"), "node default");
        assert!(
            all(Scheduler::RoundRobin, "rr"),
            "annotation wins, on every frontend"
        );
        assert!(
            all(Scheduler::LeastConnection, "alias"),
            "IPVS alias, trimmed"
        );
        assert!(all(Scheduler::SourceHash, "blank"), "blank = not set");
        assert!(
            all(Scheduler::SourceHash, "bad"),
            "bad: the node's, still programmed"
        );
        assert_eq!(t.problems.len(), 1, "{:?}", t.problems);
        let p = &t.problems[0];
        assert_eq!(p.object, "Service demo/bad");
        assert!(
            p.reason.contains(ANNOTATION_SCHEDULER)
                && p.reason.contains("\"fastest\"")
                && p.reason.contains("mh (maglev)")
                && p.reason.contains("scheduler sh applies"),
            "{p}"
        );
    }

    #[test]
    fn in_cluster_entries_select_like_etp_cluster_whatever_the_internal_policy() {
        // iTP=Local narrows the ClusterIP to this node; eTP=Local narrows external clients to
        // this node; in-cluster clients of the external frontends get every ready endpoint, with
        // the terminating fallback when none is ready (upstream's cluster endpoints).
        let svc = external_service(
            "both-local",
            json!({"type": "NodePort", "clusterIP": "10.96.0.59",
                   "externalTrafficPolicy": "Local", "internalTrafficPolicy": "Local",
                   "ports": [{"name": "http", "port": 80, "nodePort": 30089}]}),
            json!({}),
        );
        let t = translate_node(
            vec![svc.clone()],
            vec![local_and_remote_slice("both-local")],
        );
        let got: Vec<(String, Vec<String>)> = frontends(&t)
            .into_iter()
            .filter(|(fe, ..)| fe.starts_with("10."))
            .map(|(fe, _, _, b)| (fe, b))
            .collect();
        let local = vec!["10.244.1.11:8080 L".to_owned()];
        let both = vec![
            "10.244.1.11:8080 L".to_owned(),
            "10.244.2.11:8080".to_owned(),
        ];
        assert_eq!(
            got,
            vec![
                ("10.0.0.5:30089/TCP".into(), local.clone()),
                ("10.0.0.5:30089/TCP (in-cluster)".into(), both),
                ("10.96.0.59:80/TCP".into(), local),
            ]
        );

        let terminating_only = slice(
            "both-local",
            "both-local-1",
            json!([{"name": "http", "port": 8080, "protocol": "TCP"}]),
            vec![
                terminating("10.244.2.12", true),
                terminating("10.244.2.13", false),
            ],
        );
        let t = translate_node(vec![svc], vec![terminating_only]);
        let fe = Frontend::new(NODE_ADDRS[0], 30089, Protocol::Tcp).in_cluster();
        let df = &t.desired.frontends[&fe];
        assert_eq!(
            df.backends.iter().map(show).collect::<Vec<_>>(),
            ["10.244.2.12:8080 T"],
            "terminating fallback: serving ones only"
        );
    }

    #[test]
    fn in_cluster_entries_keep_the_load_balancer_source_ranges() {
        let svc = external_service(
            "lb-local",
            json!({"type": "LoadBalancer", "clusterIP": "10.96.0.60",
                   "externalTrafficPolicy": "Local",
                   "loadBalancerSourceRanges": ["10.244.0.0/16"],
                   "ports": [{"name": "http", "port": 80, "nodePort": 30090}]}),
            json!({"loadBalancer": {"ingress": [{"ip": "192.168.70.40"}]}}),
        );
        let t = translate_node(vec![svc], vec![local_and_remote_slice("lb-local")]);
        let lb = Frontend::new(Ipv4Addr::new(192, 168, 70, 40), 80, Protocol::Tcp);
        let (outer, inner) = (
            &t.desired.frontends[&lb],
            &t.desired.frontends[&lb.in_cluster()],
        );
        assert_eq!(inner.source_ranges, outer.source_ranges);
        assert_eq!(inner.kind, FrontendKind::LoadBalancer);
        use proxy_common::service_flags::SOURCE_RANGES;
        assert_eq!(
            crate::pipeline::encode::frontend_flags(&lb.in_cluster(), inner),
            SOURCE_RANGES
        );
    }

    /// A Service in `namespace` created at `created` (RFC 3339; None: no creationTimestamp).
    fn service_at(namespace: &str, name: &str, created: Option<&str>, spec: Value) -> Service {
        let mut metadata = json!({"name": name, "namespace": namespace});
        if let Some(t) = created {
            metadata["creationTimestamp"] = json!(t);
        }
        service_meta(metadata, spec)
    }

    fn dns_slice(namespace: &str, service: &str, addr: &str) -> EndpointSlice {
        serde_json::from_value(json!({
            "metadata": {"name": format!("{service}-1"), "namespace": namespace,
                         "labels": {"kubernetes.io/service-name": service}},
            "addressType": "IPv4",
            "ports": [{"name": "dns", "port": 5353, "protocol": "UDP"},
                      {"name": "http", "port": 8080, "protocol": "TCP"}],
            "endpoints": [ready(addr)],
        }))
        .expect("EndpointSlice fixture")
    }

    /// Who holds a frontend: (namespace/name, kind, backends).
    fn holder(t: &Translation, frontend: &str) -> Option<(String, FrontendKind, Vec<String>)> {
        let (_, df) = t
            .desired
            .frontends
            .iter()
            .find(|(f, _)| f.to_string() == frontend)?;
        let name = format!("{}/{}", df.service.namespace, df.service.name);
        Some((name, df.kind, df.backends.iter().map(show).collect()))
    }

    fn problem_texts(t: &Translation) -> Vec<String> {
        t.problems
            .iter()
            .map(|p| format!("{}: {}", p.object, p.reason))
            .collect()
    }

    /// The measured take-over: a Service in namespace `a` (first by name, and older) with
    /// `externalIPs: [<kube-dns's ClusterIP>]` on 53/UDP. The ClusterIP stays kube-dns's; the
    /// intruder loses only that frontend (its own ClusterIP and its other port's externalIP are
    /// programmed), with one problem naming both Services.
    #[test]
    fn a_cluster_ip_beats_an_older_services_external_ip() {
        let kube_dns = service_at(
            "kube-system",
            "kube-dns",
            Some("2026-06-01T00:00:00Z"),
            json!({"clusterIP": "10.96.0.10",
                   "ports": [{"name": "dns", "port": 53, "protocol": "UDP"}]}),
        );
        let intruder = service_at(
            "a",
            "intruder",
            Some("2026-01-01T00:00:00Z"),
            json!({"clusterIP": "10.96.7.7", "externalIPs": ["10.96.0.10"],
                   "ports": [{"name": "dns", "port": 53, "protocol": "UDP"},
                             {"name": "http", "port": 80, "protocol": "TCP"}]}),
        );
        for services in [
            vec![kube_dns.clone(), intruder.clone()],
            vec![intruder.clone(), kube_dns.clone()],
        ] {
            let t = translate_node(
                services,
                vec![
                    dns_slice("kube-system", "kube-dns", "10.244.0.53"),
                    dns_slice("a", "intruder", "10.244.0.66"),
                ],
            );
            assert_eq!(
                holder(&t, "10.96.0.10:53/UDP"),
                Some((
                    "kube-system/kube-dns".into(),
                    FrontendKind::ClusterIp,
                    vec!["10.244.0.53:5353".into()]
                ))
            );
            assert_eq!(
                holder(&t, "10.96.0.10:80/TCP"),
                Some((
                    "a/intruder".into(),
                    FrontendKind::ExternalIp,
                    vec!["10.244.0.66:8080".into()]
                )),
                "the intruder's other externalIP frontend is programmed"
            );
            for own in ["10.96.7.7:53/UDP", "10.96.7.7:80/TCP"] {
                assert!(
                    holder(&t, own).is_some_and(|h| h.0 == "a/intruder"),
                    "{own}"
                );
            }
            assert_eq!(
                problem_texts(&t),
                [
                    "Service a/intruder: frontend 10.96.0.10:53/UDP (externalIP of port \"dns\") is \
                  held by Service kube-system/kube-dns:dns as its clusterIP (a clusterIP always \
                  wins); this frontend is skipped, the Service's other frontends are programmed"
                ]
            );
            assert_eq!(
                t.conflicts,
                [FrontendConflict {
                    frontend: Frontend::new(Ipv4Addr::new(10, 96, 0, 10), 53, Protocol::Udp),
                    loser: ServicePortName {
                        namespace: "a".into(),
                        name: "intruder".into(),
                        port_name: "dns".into()
                    },
                    loser_kind: FrontendKind::ExternalIp,
                    winner: ServicePortName {
                        namespace: "kube-system".into(),
                        name: "kube-dns".into(),
                        port_name: "dns".into()
                    },
                    winner_kind: FrontendKind::ClusterIp,
                    rule: ClaimRule::ClusterIpFirst,
                }]
            );
        }
    }

    /// Between externalIPs the older Service wins, whatever the names; same timestamp (or none):
    /// the first by namespace/name.
    #[test]
    fn the_older_service_wins_an_external_ip_then_name_order() {
        let ext = |ns: &str, name: &str, created: Option<&str>, cluster_ip: &str| {
            service_at(
                ns,
                name,
                created,
                json!({"clusterIP": cluster_ip, "externalIPs": ["192.0.2.1"],
                       "ports": [{"name": "http", "port": 80, "protocol": "TCP"}]}),
            )
        };
        let cases = [
            // (first Service's timestamp, second's, expected holder, rule)
            (
                Some("2026-02-01T00:00:00Z"),
                Some("2026-01-01T00:00:00Z"),
                "z/second",
                ClaimRule::Older,
            ),
            (
                Some("2026-01-01T00:00:00Z"),
                Some("2026-02-01T00:00:00Z"),
                "a/first",
                ClaimRule::Older,
            ),
            (
                Some("2026-01-01T00:00:00Z"),
                Some("2026-01-01T00:00:00Z"),
                "a/first",
                ClaimRule::NameOrder,
            ),
            (None, None, "a/first", ClaimRule::NameOrder),
            // Without a timestamp (a manifest) a Service counts as newer than any with one.
            (
                None,
                Some("2026-01-01T00:00:00Z"),
                "z/second",
                ClaimRule::Older,
            ),
        ];
        for (first_ts, second_ts, want, rule) in cases {
            let t = translate_node(
                vec![
                    ext("z", "second", second_ts, "10.96.0.2"),
                    ext("a", "first", first_ts, "10.96.0.1"),
                ],
                vec![],
            );
            let at = format!("{first_ts:?} {second_ts:?}");
            let got = holder(&t, "192.0.2.1:80/TCP").expect("held");
            assert_eq!(got.0, want, "{at}");
            assert_eq!(got.1, FrontendKind::ExternalIp, "{at}");
            assert_eq!(t.conflicts.len(), 1, "{at}");
            assert_eq!(t.conflicts[0].rule, rule, "{at}");
            assert_ne!(
                format!(
                    "{}/{}",
                    t.conflicts[0].loser.namespace, t.conflicts[0].loser.name
                ),
                want,
                "{at}"
            );
            // Both ClusterIPs are programmed.
            assert!(holder(&t, "10.96.0.1:80/TCP").is_some(), "{at}");
            assert!(holder(&t, "10.96.0.2:80/TCP").is_some(), "{at}");
        }
    }

    /// Two ClusterIPs equal (manifests can say so): the older Service wins, port by port.
    #[test]
    fn equal_cluster_ips_go_to_the_older_service() {
        let t = translate_node(
            vec![
                service_at(
                    "demo",
                    "a",
                    Some("2026-03-01T00:00:00Z"),
                    json!({"clusterIP": "10.96.0.10",
                           "ports": [{"name": "http", "port": 80}, {"name": "x", "port": 81}]}),
                ),
                service_at(
                    "demo",
                    "b",
                    Some("2026-01-01T00:00:00Z"),
                    json!({"clusterIP": "10.96.0.10", "ports": [{"name": "http", "port": 80}]}),
                ),
            ],
            vec![],
        );
        assert_eq!(holder(&t, "10.96.0.10:80/TCP").expect("held").0, "demo/b");
        assert_eq!(
            holder(&t, "10.96.0.10:81/TCP").expect("held").0,
            "demo/a",
            "the loser keeps the port nobody else claims"
        );
        assert_eq!(t.conflicts.len(), 1);
        assert_eq!(t.conflicts[0].rule, ClaimRule::Older);
        assert_eq!(t.conflicts[0].loser.name, "a");
    }

    /// Two NodePorts equal (manifests can say so): the older Service wins on every node
    /// address; the loser keeps its ClusterIP.
    #[test]
    fn equal_node_ports_go_to_the_older_service_on_every_node_address() {
        let np = |name: &str, created: &str, cluster_ip: &str| {
            service_at(
                "demo",
                name,
                Some(created),
                json!({"type": "NodePort", "clusterIP": cluster_ip,
                       "ports": [{"name": "http", "port": 80, "nodePort": 30080}]}),
            )
        };
        let t = translate_node(
            vec![
                np("a", "2026-05-01T00:00:00Z", "10.96.0.1"),
                np("b", "2026-04-01T00:00:00Z", "10.96.0.2"),
            ],
            vec![],
        );
        for addr in NODE_ADDRS {
            let f = format!("{addr}:30080/TCP");
            assert_eq!(
                holder(&t, &f).map(|h| (h.0, h.1)),
                Some(("demo/b".into(), FrontendKind::NodePort)),
                "{f}"
            );
        }
        assert_eq!(holder(&t, "10.96.0.1:80/TCP").expect("held").0, "demo/a");
        assert_eq!(t.conflicts.len(), NODE_ADDRS.len());
        assert!(t.conflicts.iter().all(|c| c.loser.name == "a"));
        assert_eq!(t.problems.len(), NODE_ADDRS.len());
    }

    /// A losing externalTrafficPolicy Local frontend takes its in-cluster entry along; a
    /// winning one keeps it.
    #[test]
    fn the_in_cluster_entry_follows_its_frontends_winner() {
        let local = |name: &str, created: &str, cluster_ip: &str| {
            service_at(
                "demo",
                name,
                Some(created),
                json!({"type": "LoadBalancer", "clusterIP": cluster_ip,
                       "externalTrafficPolicy": "Local", "externalIPs": ["192.0.2.9"],
                       "ports": [{"name": "http", "port": 80}]}),
            )
        };
        let cluster = service_at(
            "demo",
            "cluster",
            Some("2026-01-01T00:00:00Z"),
            json!({"clusterIP": "10.96.0.3", "externalIPs": ["192.0.2.9"],
                   "ports": [{"name": "http", "port": 80}]}),
        );
        // The eTP=Cluster Service is older: no in-cluster entry remains for 192.0.2.9:80.
        let t = translate_node(
            vec![
                local("local", "2026-02-01T00:00:00Z", "10.96.0.4"),
                cluster.clone(),
            ],
            vec![],
        );
        assert_eq!(
            holder(&t, "192.0.2.9:80/TCP").expect("held").0,
            "demo/cluster"
        );
        assert!(
            holder(&t, "192.0.2.9:80/TCP (in-cluster)").is_none(),
            "{:?}",
            t.desired.frontends.keys().collect::<Vec<_>>()
        );
        // The eTP=Local Service is older: its frontend and its in-cluster entry.
        let t = translate_node(
            vec![local("local", "2025-12-01T00:00:00Z", "10.96.0.4"), cluster],
            vec![],
        );
        assert_eq!(
            holder(&t, "192.0.2.9:80/TCP").expect("held").0,
            "demo/local"
        );
        assert_eq!(
            holder(&t, "192.0.2.9:80/TCP (in-cluster)").expect("held").0,
            "demo/local"
        );
    }

    /// A Service whose externalIP is its own ClusterIP asks for one frontend twice: the
    /// ClusterIP entry is kept, and nothing is reported.
    #[test]
    fn an_external_ip_equal_to_the_services_own_cluster_ip_keeps_the_cluster_ip_entry() {
        let t = translate_node(
            vec![service_at(
                "demo",
                "self",
                None,
                json!({"clusterIP": "10.96.0.8", "externalIPs": ["10.96.0.8"],
                       "externalTrafficPolicy": "Local", "type": "LoadBalancer",
                       "ports": [{"name": "http", "port": 80}]}),
            )],
            vec![],
        );
        assert_eq!(
            holder(&t, "10.96.0.8:80/TCP").map(|h| h.1),
            Some(FrontendKind::ClusterIp)
        );
        assert!(holder(&t, "10.96.0.8:80/TCP (in-cluster)").is_none());
        assert!(t.problems.is_empty(), "{:?}", t.problems);
        assert!(t.conflicts.is_empty());
    }
}
