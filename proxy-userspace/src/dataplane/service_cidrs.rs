//! The Service address space in `SVCCIDRS_V1` (an LPM trie keyed by IPv4 address), and the IPv6
//! family's in `SVCCIDRS6_V1` (the same code over [`CidrFamily`]): the Service CIDRs of that
//! family (ServiceCIDR objects in Kubernetes mode, `--service-cidr` otherwise) and every
//! allocated ClusterIP as a host entry (/32, /128). The datapath looks it up when a new flow's destination is no
//! frontend: a ClusterIP's other ports are rejected, the rest of the CIDRs dropped (upstream
//! nftables' cluster-ips-check).
//!
//! Like the source ranges, the entries depend only on the desired frontends and the CIDRs (no
//! ids): the wanted set is pure ([`wanted`]), the map layer writes what differs, then removes
//! what is no longer wanted. The shadow is read back from the pinned map at start-up.
//!
//! IPv4: between full syncs the ClusterIPs are kept by [`ClusterIps`] from the changed frontends
//! (one count per frontend on the address), and only the addresses whose count crossed zero
//! are written ([`ServiceCidrs::sync_changed`]); a full sync compares the whole set. IPv6 (the
//! family translated in full at each of its syncs, `crate::family6`): the whole set, compared
//! with what the map holds, each sync ([`ServiceCidrs::sync`]).

use std::{
    collections::{BTreeMap, BTreeSet},
    fmt,
    net::{Ipv4Addr, Ipv6Addr},
};

use aya::maps::{
    MapData,
    lpm_trie::{Key, LpmTrie},
};
use proxy_common::{MAP_SERVICE_CIDRS, ipv6::MAP_SERVICE_CIDRS6, service_cidr};
use tracing::{error, info};

use crate::{
    dataplane,
    pipeline::{
        addresses::Cidr,
        model::{DesiredFrontend, DesiredState, Family, Frontend, FrontendKind, Scope},
        translate_cache::FrontendChange,
    },
};

/// A family's Service address space map: its name and key bytes.
pub trait CidrFamily: Family {
    /// The address in network order (the trie key's data).
    type Octets: Copy + Ord + fmt::Debug + aya::Pod;
    const MAP: &'static str;
    fn octets(self) -> Self::Octets;
}

impl CidrFamily for Ipv4Addr {
    type Octets = [u8; 4];
    const MAP: &'static str = MAP_SERVICE_CIDRS;
    fn octets(self) -> [u8; 4] {
        Ipv4Addr::octets(&self)
    }
}

impl CidrFamily for Ipv6Addr {
    type Octets = [u8; 16];
    const MAP: &'static str = MAP_SERVICE_CIDRS6;
    fn octets(self) -> [u8; 16] {
        Ipv6Addr::octets(&self)
    }
}

/// (prefix length, network address in network order) → `service_cidr::*`.
pub type Entries<A = Ipv4Addr> = BTreeMap<(u32, <A as CidrFamily>::Octets), u32>;

/// Pure: the prefixes of family `A` of `cidrs` (`--service-cidr` lists both families).
pub fn prefixes<A: Family>(cidrs: &[Cidr]) -> Vec<(A, u8)> {
    (cidrs.iter())
        .filter_map(|c| Some((A::of(c.addr)?, c.prefix_len)))
        .collect()
}

/// Pure: every entry the desired state and the Service CIDRs (network, prefix length) need.
pub fn wanted<A: CidrFamily>(desired: &DesiredState<A>, cidrs: &[(A, u8)]) -> Entries<A> {
    let ips = (desired.frontends.iter())
        .filter(|(fe, df)| is_cluster_ip(fe, df))
        .map(|(fe, _)| fe.addr.octets());
    entries(cidrs, ips)
}

/// The CIDRs' entries, then the ClusterIPs' (a host CIDR that is also a ClusterIP is that
/// ClusterIP).
fn entries<A: CidrFamily>(
    cidrs: &[(A, u8)],
    cluster_ips: impl Iterator<Item = A::Octets>,
) -> Entries<A> {
    let mut out: Entries<A> = cidrs
        .iter()
        .map(|&c| (cidr_key(c), service_cidr::UNALLOCATED))
        .collect();
    for ip in cluster_ips {
        out.insert((u32::from(A::BITS), ip), service_cidr::CLUSTER_IP);
    }
    out
}

/// The trie key of a CIDR (host bits cleared).
fn cidr_key<A: CidrFamily>((net, len): (A, u8)) -> (u32, A::Octets) {
    let len = len.min(A::BITS);
    (u32::from(len), net.network(len).octets())
}

fn is_cluster_ip<A: Family>(fe: &Frontend<A>, df: &DesiredFrontend<A>) -> bool {
    df.kind == FrontendKind::ClusterIp && fe.scope == Scope::AllClients
}

/// The ClusterIPs of the desired state, kept up to date by the changed frontends, and the
/// addresses whose entry may differ from the map.
#[derive(Debug, Default)]
pub struct ClusterIps {
    /// Frontends per ClusterIP (one per Service port).
    counts: BTreeMap<[u8; 4], u32>,
    changed: BTreeSet<[u8; 4]>,
}

impl ClusterIps {
    /// The frontends of one update changed (`desired`: their new values).
    pub fn update(&mut self, changes: &[FrontendChange], desired: &DesiredState) {
        for c in changes {
            let fe = &c.frontend;
            if let Some(old) = c.old.as_deref()
                && is_cluster_ip(fe, old)
            {
                let ip = fe.addr.octets();
                if let Some(n) = self.counts.get_mut(&ip) {
                    *n -= 1;
                    if *n == 0 {
                        self.counts.remove(&ip);
                        self.changed.insert(ip);
                    }
                }
            }
            if let Some(new) = desired.frontends.get(fe)
                && is_cluster_ip(fe, new)
            {
                let n = self.counts.entry(fe.addr.octets()).or_default();
                *n += 1;
                if *n == 1 {
                    self.changed.insert(fe.addr.octets());
                }
            }
        }
    }

    /// Counted again from the whole desired state (full syncs).
    pub fn rebuild(&mut self, desired: &DesiredState) {
        self.counts.clear();
        for (fe, df) in &desired.frontends {
            if is_cluster_ip(fe, df) {
                *self.counts.entry(fe.addr.octets()).or_default() += 1;
            }
        }
    }

    /// Every entry, as [`wanted`] of the desired state these counts follow.
    pub fn entries(&self, cidrs: &[(Ipv4Addr, u8)]) -> Entries {
        entries(cidrs, self.counts.keys().copied())
    }

    /// What the entry of `ip` should be (`None`: no entry).
    fn wanted(&self, ip: [u8; 4], cidrs: &[(Ipv4Addr, u8)]) -> Option<u32> {
        if self.counts.contains_key(&ip) {
            Some(service_cidr::CLUSTER_IP)
        } else {
            (cidrs.iter().any(|&c| cidr_key(c) == (32, ip))).then_some(service_cidr::UNALLOCATED)
        }
    }
}

/// One family's map and what it carries.
pub struct ServiceCidrs<A: CidrFamily = Ipv4Addr> {
    map: LpmTrie<MapData, A::Octets, u32>,
    programmed: Entries<A>,
    /// The last sync had writes that failed (logged once until one succeeds again).
    failing: bool,
}

impl<A: CidrFamily> ServiceCidrs<A> {
    /// Takes the map out of a loaded object and reads back what it carries.
    pub fn from_ebpf(ebpf: &mut aya::Ebpf) -> dataplane::Result<Self> {
        let name = A::MAP;
        let map = ebpf
            .take_map(name)
            .ok_or(dataplane::Error::Missing { what: "map", name })?;
        let map: LpmTrie<MapData, A::Octets, u32> =
            LpmTrie::try_from(map).map_err(|source| dataplane::Error::Map { name, source })?;
        let programmed = map
            .iter()
            .filter_map(Result::ok)
            .map(|(k, v)| ((k.prefix_len(), k.data()), v))
            .collect();
        Ok(Self {
            map,
            programmed,
            failing: false,
        })
    }

    /// What the map carries (as written by this agent or read back at start-up).
    pub fn programmed(&self) -> &Entries<A> {
        &self.programmed
    }
}

impl ServiceCidrs {
    /// Writes the entries of the ClusterIPs that changed since the last call (a failed write is
    /// kept for the next), as [`ServiceCidrs::sync`] would for the whole set.
    pub fn sync_changed(&mut self, ips: &mut ClusterIps, cidrs: &[(Ipv4Addr, u8)]) {
        let mut failed = 0usize;
        let mut first_error = None;
        let changed = std::mem::take(&mut ips.changed);
        for ip in changed {
            let key = (32, ip);
            let want = ips.wanted(ip, cidrs);
            if self.programmed.get(&key).copied() == want {
                continue;
            }
            let done = match want {
                Some(kind) => self.map.insert(&Key::new(32, ip), kind, 0),
                None => match self.map.remove(&Key::new(32, ip)) {
                    Err(aya::maps::MapError::KeyNotFound) => Ok(()),
                    other => other,
                },
            };
            match done {
                Ok(()) => match want {
                    Some(kind) => self.programmed.insert(key, kind),
                    None => self.programmed.remove(&key),
                },
                Err(e) => {
                    failed += 1;
                    first_error.get_or_insert(e);
                    ips.changed.insert(ip);
                    None
                }
            };
        }
        self.report(failed, first_error);
    }

    /// Makes the map carry exactly the entries of `ips` and `cidrs` (a full sync); the /32
    /// entries whose write failed are left marked for the next [`ServiceCidrs::sync_changed`].
    pub fn sync_all(&mut self, ips: &mut ClusterIps, cidrs: &[(Ipv4Addr, u8)]) {
        let want = ips.entries(cidrs);
        let _all_written = self.sync(&want);
        ips.changed = (want.iter())
            .filter(|(k, v)| self.programmed.get(k) != Some(v))
            .map(|(k, _)| *k)
            .chain(
                self.programmed
                    .keys()
                    .filter(|k| !want.contains_key(k))
                    .copied(),
            )
            .filter(|(len, _)| *len == 32)
            .map(|(_, ip)| ip)
            .collect();
    }
}

impl<A: CidrFamily> ServiceCidrs<A> {
    /// Makes the map carry exactly `want` (writes first, then removals). Failed writes are
    /// logged once (the map full: one line, not one per entry); false when one failed (the
    /// caller calls again at its next sync).
    pub fn sync(&mut self, want: &Entries<A>) -> bool {
        let mut failed = 0usize;
        let mut first_error = None;
        for (&(len, net), &kind) in want {
            if self.programmed.get(&(len, net)) == Some(&kind) {
                continue;
            }
            match self.map.insert(&Key::new(len, net), kind, 0) {
                Ok(()) => {
                    self.programmed.insert((len, net), kind);
                }
                Err(e) => {
                    failed += 1;
                    first_error.get_or_insert(e);
                }
            }
        }
        let stale: Vec<(u32, A::Octets)> = self
            .programmed
            .keys()
            .filter(|k| !want.contains_key(k))
            .copied()
            .collect();
        for (len, net) in stale {
            match self.map.remove(&Key::new(len, net)) {
                Ok(()) | Err(aya::maps::MapError::KeyNotFound) => {
                    self.programmed.remove(&(len, net));
                }
                Err(e) => {
                    failed += 1;
                    first_error.get_or_insert(e);
                }
            }
        }
        self.report(failed, first_error);
        failed == 0
    }

    /// Logs failed writes once until a sync writes everything again.
    fn report(&mut self, failed: usize, first_error: Option<aya::maps::MapError>) {
        match first_error {
            Some(e) if !self.failing => {
                error!(
                    failed,
                    "{}: {failed} ClusterIP/Service CIDR entries not written ({e}); those \
                     addresses pass unchecked; retrying on every sync",
                    A::MAP
                );
                self.failing = true;
            }
            Some(_) => {}
            None if self.failing => {
                info!(
                    "{}: every ClusterIP/Service CIDR entry written again",
                    A::MAP
                );
                self.failing = false;
            }
            None => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;
    use crate::pipeline::model::{Protocol, ServicePortName};

    fn frontend<A: Family>(kind: FrontendKind) -> Arc<DesiredFrontend<A>> {
        Arc::new(DesiredFrontend {
            balancing: Default::default(),
            service: ServicePortName {
                namespace: "demo".into(),
                name: "web".into(),
                port_name: String::new(),
            },
            kind,
            external_local: false,
            drop_when_empty: false,
            source_ranges: vec![],
            backends: vec![],
            retained: vec![],
        })
    }

    #[test]
    fn cluster_ips_are_host_entries_over_the_cidrs_external_frontends_are_not() {
        let mut desired = DesiredState::default();
        let vip = Ipv4Addr::new(10, 96, 0, 10);
        for port in [80, 443] {
            desired.frontends.insert(
                Frontend::new(vip, port, Protocol::Tcp),
                frontend(FrontendKind::ClusterIp),
            );
        }
        desired.frontends.insert(
            Frontend::new(Ipv4Addr::new(192, 168, 50, 10), 30080, Protocol::Tcp),
            frontend(FrontendKind::NodePort),
        );
        desired.frontends.insert(
            Frontend::new(Ipv4Addr::new(10, 96, 0, 20), 53, Protocol::Udp),
            frontend(FrontendKind::ClusterIp),
        );
        let cidrs = [
            (Ipv4Addr::new(10, 96, 3, 7), 12), // host bits cleared
            (Ipv4Addr::new(10, 96, 0, 20), 32),
        ];
        let w = wanted(&desired, &cidrs);
        let want: Entries = [
            ((12, [10, 96, 0, 0]), service_cidr::UNALLOCATED),
            ((32, [10, 96, 0, 10]), service_cidr::CLUSTER_IP),
            ((32, [10, 96, 0, 20]), service_cidr::CLUSTER_IP),
        ]
        .into_iter()
        .collect();
        assert_eq!(w, want);
        assert!(
            wanted::<Ipv4Addr>(&DesiredState::default(), &[]).is_empty(),
            "nothing: the map stays empty"
        );
    }

    /// The IPv6 family's entries: its CIDRs of a mixed `--service-cidr` list (host bits
    /// cleared), its ClusterIPs as /128 host entries, nothing of the IPv4 family.
    #[test]
    fn ipv6_entries_are_the_ipv6_cidrs_and_clusterips() {
        let cidrs: Vec<Cidr> = ["10.96.0.0/16", "fd00:10:96::1:2/108", "fd00:20::/64"]
            .iter()
            .map(|c| c.parse().unwrap())
            .collect();
        let six = prefixes::<Ipv6Addr>(&cidrs);
        let v6 = |s: &str| s.parse::<Ipv6Addr>().unwrap();
        assert_eq!(six, [(v6("fd00:10:96::1:2"), 108), (v6("fd00:20::"), 64)]);
        assert_eq!(
            prefixes::<Ipv4Addr>(&cidrs),
            [(Ipv4Addr::new(10, 96, 0, 0), 16)]
        );
        let mut desired: DesiredState<Ipv6Addr> = DesiredState::default();
        let vip = v6("fd00:10:96::10");
        let df = frontend::<Ipv6Addr>;
        desired.frontends.insert(
            Frontend::new(vip, 80, Protocol::Tcp),
            df(FrontendKind::ClusterIp),
        );
        desired.frontends.insert(
            Frontend::new(v6("2001:db8:50::10"), 30080, Protocol::Tcp),
            df(FrontendKind::NodePort),
        );
        let want: Entries<Ipv6Addr> = [
            (
                (108, v6("fd00:10:96::").octets()),
                service_cidr::UNALLOCATED,
            ),
            ((64, v6("fd00:20::").octets()), service_cidr::UNALLOCATED),
            ((128, vip.octets()), service_cidr::CLUSTER_IP),
        ]
        .into_iter()
        .collect();
        assert_eq!(wanted(&desired, &six), want);
    }
}
