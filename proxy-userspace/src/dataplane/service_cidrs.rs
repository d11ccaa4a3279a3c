//! The Service address space in `SVCCIDRS_V1` (an LPM trie keyed by IPv4 address): the Service
//! CIDRs (ServiceCIDR objects in Kubernetes mode, `--service-cidr` otherwise) and every
//! allocated ClusterIP as a /32. The datapath looks it up when a new flow's destination is no
//! frontend: a ClusterIP's other ports are rejected, the rest of the CIDRs dropped (upstream
//! nftables' cluster-ips-check).
//!
//! Like the source ranges, the entries depend only on the desired frontends and the CIDRs (no
//! ids): the wanted set is pure ([`wanted`]), the map layer writes what differs, then removes
//! what is no longer wanted. The shadow is read back from the pinned map at start-up.

use std::{collections::BTreeMap, net::Ipv4Addr};

use aya::maps::{
    MapData,
    lpm_trie::{Key, LpmTrie},
};
use proxy_common::{MAP_SERVICE_CIDRS, service_cidr};
use tracing::{error, info};

use crate::{
    dataplane,
    pipeline::model::{DesiredState, FrontendKind, Scope},
};

/// (prefix length, network address in network order) → `service_cidr::*`.
pub type Entries = BTreeMap<(u32, [u8; 4]), u32>;

/// Pure: every entry the desired state and the Service CIDRs (network, prefix length) need.
pub fn wanted(desired: &DesiredState, cidrs: &[(Ipv4Addr, u8)]) -> Entries {
    let mut out = Entries::new();
    for (net, len) in cidrs {
        let len = u32::from(*len).min(32);
        let mask = u32::MAX.checked_shl(32 - len).unwrap_or(0);
        let net = (u32::from(*net) & mask).to_be_bytes();
        out.insert((len, net), service_cidr::UNALLOCATED);
    }
    // After the CIDRs: a /32 CIDR that is also a ClusterIP is that ClusterIP.
    for (fe, df) in &desired.frontends {
        if df.kind == FrontendKind::ClusterIp && fe.scope == Scope::AllClients {
            out.insert((32, fe.addr.octets()), service_cidr::CLUSTER_IP);
        }
    }
    out
}

/// The map and what it carries.
pub struct ServiceCidrs {
    map: LpmTrie<MapData, [u8; 4], u32>,
    programmed: Entries,
    /// The last sync had writes that failed (logged once until one succeeds again).
    failing: bool,
}

impl ServiceCidrs {
    /// Takes the map out of a loaded object and reads back what it carries.
    pub fn from_ebpf(ebpf: &mut aya::Ebpf) -> dataplane::Result<Self> {
        let name = MAP_SERVICE_CIDRS;
        let map = ebpf
            .take_map(name)
            .ok_or(dataplane::Error::Missing { what: "map", name })?;
        let map: LpmTrie<MapData, [u8; 4], u32> =
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

    /// Makes the map carry exactly `want` (writes first, then removals). Failed writes are
    /// retried on the next sync and logged once (the map full: one line, not one per entry).
    pub fn sync(&mut self, want: &Entries) {
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
        let stale: Vec<(u32, [u8; 4])> = self
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
        match first_error {
            Some(e) if !self.failing => {
                error!(
                    failed,
                    "{MAP_SERVICE_CIDRS}: {failed} ClusterIP/Service CIDR entries not written \
                     ({e}); those addresses pass unchecked; retrying on every sync"
                );
                self.failing = true;
            }
            Some(_) => {}
            None if self.failing => {
                info!("{MAP_SERVICE_CIDRS}: every ClusterIP/Service CIDR entry written again");
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
    use crate::pipeline::model::{DesiredFrontend, Frontend, Protocol, ServicePortName};

    fn frontend(kind: FrontendKind) -> Arc<DesiredFrontend> {
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
            wanted(&DesiredState::default(), &[]).is_empty(),
            "nothing: the map stays empty"
        );
    }
}
