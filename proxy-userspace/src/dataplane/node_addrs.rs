//! The node's addresses: which ones NodePorts answer on (`--nodeport-addresses`), and which
//! one SNATed external flows leave with; per family (the IPv6 family's from [`list6`], the same
//! selection over [`Ipv6Addr`]). Listing (getifaddrs, in the agent's network namespace) is the
//! IO edge; the selection is pure.

use std::{
    collections::BTreeMap,
    io,
    net::{IpAddr, Ipv4Addr, Ipv6Addr},
};

use proxy_common::NodeInfo;
use tracing::{error, info};

use crate::{
    dataplane::{
        self,
        interfaces::{Interface, Patterns},
        maps::{NodeMap, SnatDeviceMap},
        service_cidrs::{self, ServiceCidrs},
        source_ranges::{self, SourceRanges},
    },
    pipeline::{
        addresses::{Cidr, NodePortAddresses},
        model::{DesiredState, Family},
        translate::HealthCheck,
        translate_cache::FrontendChange,
    },
    serving::healthcheck::HealthCheckServers,
};

/// One address (IPv4 unless said) of an interface of this network namespace.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct IfAddr<A = Ipv4Addr> {
    pub ifname: String,
    pub addr: A,
}

/// What the agent derives from the node's addresses of one family.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NodeAddrs<A = Ipv4Addr> {
    /// Where NodePorts answer, sorted, no duplicates.
    pub nodeport: Vec<A>,
    /// Source address of SNATed external flows.
    pub snat: Option<A>,
}

impl<A> Default for NodeAddrs<A> {
    fn default() -> Self {
        Self {
            nodeport: Vec::new(),
            snat: None,
        }
    }
}

/// A node address family: which of its addresses may carry NodePorts.
pub trait NodeFamily: Copy + Ord + Into<IpAddr> {
    /// Not loopback, not unspecified; for IPv6 not link-local either (every pod veth has an
    /// fe80:: address, and one is only reachable with its interface: NodePorts on them would
    /// multiply the frontends by the pods for nothing upstream serves).
    fn usable(self) -> bool;
}

impl NodeFamily for Ipv4Addr {
    fn usable(self) -> bool {
        !self.is_loopback() && !self.is_unspecified()
    }
}

impl NodeFamily for Ipv6Addr {
    fn usable(self) -> bool {
        !self.is_loopback() && !self.is_unspecified() && !self.is_unicast_link_local()
    }
}

/// The agent's north-south state: node addresses (NodePort frontends, the SNAT address in
/// `NODE_V1`), loadBalancerSourceRanges (`SRCRANGES_V1`), the Service address space
/// (`SVCCIDRS_V1`) and the health-check node ports.
pub struct External {
    node_map: NodeMap,
    nodeport_cfg: NodePortAddresses,
    devices: Patterns,
    addrs: NodeAddrs,
    written: Option<NodeInfo>,
    health_checks: HealthCheckServers,
    source_ranges: SourceRanges,
    /// The attached tunnel devices and the SNAT source address of each (`SNATDEV_V1`).
    snat_devices: SnatDeviceMap,
    tunnels: Vec<Interface>,
    all: Vec<IfAddr>,
    devices_written: Option<BTreeMap<u32, [u8; 4]>>,
    service_cidrs: ServiceCidrs,
    /// The Service CIDRs (IPv4 network, prefix length) of `--service-cidr`, and of the
    /// cluster's ServiceCIDR objects; both apply.
    service_cidr_flag: Vec<(Ipv4Addr, u8)>,
    service_cidr_api: Vec<(Ipv4Addr, u8)>,
    /// The source ranges and ClusterIPs the desired state needs, kept by the changed frontends.
    ranges: source_ranges::WantedRanges,
    cluster_ips: service_cidrs::ClusterIps,
    /// The next [`External::apply`] compares the whole maps (a full sync, or the CIDRs
    /// changed).
    full_ranges: bool,
    full_cidrs: bool,
}

impl External {
    /// The node's SNAT address as written for the datapath (`None`: none known).
    pub fn snat_addr(&self) -> Option<Ipv4Addr> {
        self.addrs.snat
    }

    /// `proxy`: the agent's health (/healthz state), reported by the health-check node ports.
    pub fn new(
        ebpf: &mut aya::Ebpf,
        proxy: std::sync::Arc<crate::serving::health::HealthState>,
    ) -> dataplane::Result<Self> {
        Ok(Self {
            node_map: NodeMap::from_ebpf(ebpf)?,
            nodeport_cfg: NodePortAddresses::default(),
            devices: Patterns::default(),
            addrs: NodeAddrs::default(),
            written: None,
            health_checks: HealthCheckServers::new(proxy),
            source_ranges: SourceRanges::from_ebpf(ebpf)?,
            snat_devices: SnatDeviceMap::from_ebpf(ebpf)?,
            tunnels: Vec::new(),
            all: Vec::new(),
            devices_written: None,
            service_cidrs: ServiceCidrs::from_ebpf(ebpf)?,
            service_cidr_flag: Vec::new(),
            service_cidr_api: Vec::new(),
            ranges: Default::default(),
            cluster_ips: Default::default(),
            full_ranges: true,
            full_cidrs: true,
        })
    }

    /// The Service CIDRs of `--service-cidr`.
    pub fn set_service_cidrs(&mut self, cidrs: Vec<(Ipv4Addr, u8)>) {
        self.full_cidrs |= set_cidrs(&mut self.service_cidr_flag, cidrs, "--service-cidr");
    }

    /// The Service CIDRs of the cluster's ServiceCIDR objects (read at each sync).
    pub fn set_api_service_cidrs(&mut self, cidrs: Vec<(Ipv4Addr, u8)>) {
        self.full_cidrs |= set_cidrs(&mut self.service_cidr_api, cidrs, "ServiceCIDR objects");
    }

    /// Sets `--nodeport-addresses` and `--devices`, and lists the addresses.
    pub fn configure(&mut self, nodeport: NodePortAddresses, devices: Patterns) {
        self.nodeport_cfg = nodeport;
        self.devices = devices;
        self.refresh();
    }

    /// The external devices (detected, or `--devices`): `primary` NodePort addresses and the
    /// SNAT address come from them. True when the selection changed (a sync is due).
    pub fn set_devices(&mut self, devices: Patterns) -> bool {
        if devices == self.devices {
            return false;
        }
        self.devices = devices;
        self.refresh()
    }

    /// Lists the node's addresses again; true when the selection changed (a sync is due).
    pub fn refresh(&mut self) -> bool {
        let all = match list() {
            Ok(a) => a,
            Err(e) => {
                error!("listing the node's addresses failed: {e}; keeping the previous ones");
                return false;
            }
        };
        let addrs = select(&all, &self.nodeport_cfg, &self.devices);
        self.all = all;
        self.write_snat_devices();
        if addrs == self.addrs {
            return false;
        }
        info!(nodeport = ?addrs.nodeport, snat = ?addrs.snat, "node addresses");
        self.addrs = addrs;
        true
    }

    /// The tunnel devices the programs are attached to: flows leaving through one of them are
    /// SNATed to its own address (if it has one).
    pub fn set_tunnels(&mut self, tunnels: Vec<Interface>) {
        if tunnels != self.tunnels {
            self.tunnels = tunnels;
            self.write_snat_devices();
        }
    }

    fn write_snat_devices(&mut self) {
        let wanted = tunnel_snat_addrs(&self.all, &self.tunnels);
        if self.devices_written.as_ref() == Some(&wanted) {
            return;
        }
        match self.snat_devices.sync(&wanted) {
            Ok(()) => {
                info!(devices = ?self.tunnels.iter().filter(|t| wanted.contains_key(&t.index)).map(|t| &t.name).collect::<Vec<_>>(), "SNAT source of flows leaving through tunnel devices: their own address");
                self.devices_written = Some(wanted);
            }
            Err(e) => {
                self.devices_written = None;
                error!(
                    "writing the tunnel devices' SNAT addresses: {e}; retrying on the next change"
                );
            }
        }
    }

    /// Where NodePorts answer.
    pub fn nodeport_addrs(&self) -> &[Ipv4Addr] {
        &self.addrs.nodeport
    }

    /// The frontends of one update changed (`desired`: their new values): the source ranges
    /// and ClusterIPs follow, written by the next [`External::apply`]. `full`: counted again
    /// from the whole desired state, and the next apply compares the whole maps.
    pub fn desired_changes(
        &mut self,
        changes: &[FrontendChange],
        desired: &DesiredState,
        full: bool,
    ) {
        if full {
            self.ranges.rebuild(desired);
            self.cluster_ips.rebuild(desired);
            self.full_ranges = true;
            self.full_cidrs = true;
        } else {
            self.ranges.update(changes, desired);
            self.cluster_ips.update(changes, desired);
        }
    }

    /// Whether the health-check servers need no update for unchanged checks (see
    /// [`HealthCheckServers::settled`]).
    pub fn health_checks_settled(&self) -> bool {
        self.health_checks.settled(&self.addrs.nodeport)
    }

    /// After a sync: the SNAT address into `NODE_V1`, the changed source ranges into
    /// `SRCRANGES_V1`, the changed ClusterIPs and the Service CIDRs into `SVCCIDRS_V1`, and
    /// (`checks`, when they may have changed) the health-check servers to the translation's.
    pub fn apply(&mut self, checks: Option<&[HealthCheck]>) {
        let info = NodeInfo {
            snat_addr: self.addrs.snat.map_or([0; 4], |a| a.octets()),
            flags: 0,
        };
        if self.written != Some(info) {
            match self.node_map.write(&info) {
                Ok(()) => self.written = Some(info),
                Err(e) => error!("writing the node's SNAT address: {e}; retrying on the next sync"),
            }
        }
        if std::mem::take(&mut self.full_ranges) {
            self.source_ranges.sync_all(&mut self.ranges);
        } else {
            self.source_ranges.sync_changed(&mut self.ranges);
        }
        let cidrs: Vec<(Ipv4Addr, u8)> = self
            .service_cidr_flag
            .iter()
            .chain(&self.service_cidr_api)
            .copied()
            .collect();
        if std::mem::take(&mut self.full_cidrs) {
            self.service_cidrs.sync_all(&mut self.cluster_ips, &cidrs);
        } else {
            self.service_cidrs
                .sync_changed(&mut self.cluster_ips, &cidrs);
        }
        if let Some(checks) = checks {
            self.health_checks.update(checks, &self.addrs.nodeport);
        }
    }
}

/// Replaces a list of Service CIDRs (of either family), logging when it changed.
pub fn set_cidrs<A: Family>(list: &mut Vec<(A, u8)>, mut cidrs: Vec<(A, u8)>, from: &str) -> bool {
    cidrs.sort();
    cidrs.dedup();
    if cidrs == *list {
        return false;
    }
    let shown: Vec<String> = cidrs.iter().map(|(a, l)| format!("{a}/{l}")).collect();
    info!(service_cidrs = ?shown, "{} Service CIDRs from {from}", A::NAME);
    *list = cidrs;
    true
}

/// Every IPv4 address of this network namespace's interfaces, sorted.
pub fn list() -> io::Result<Vec<IfAddr>> {
    let mut out: Vec<IfAddr> = nix::ifaddrs::getifaddrs()?
        .filter_map(|ifa| {
            let sin = *ifa.address?.as_sockaddr_in()?;
            Some(IfAddr {
                ifname: ifa.interface_name,
                addr: sin.ip(),
            })
        })
        .collect();
    out.sort();
    out.dedup();
    Ok(out)
}

/// The interfaces holding a usable address of either family (not loopback, not link-local):
/// what `dataplane::devices` takes for a device carrying the node's traffic.
pub fn addressed_interfaces() -> io::Result<std::collections::BTreeSet<String>> {
    let v4 = list()?
        .into_iter()
        .filter(|a| a.addr.usable())
        .map(|a| a.ifname);
    let v6 = list6()?
        .into_iter()
        .filter(|a| a.addr.usable())
        .map(|a| a.ifname);
    Ok(v4.chain(v6).collect())
}

/// The node's IPv6 addresses (as [`list`] for IPv4).
pub fn list6() -> io::Result<Vec<IfAddr<Ipv6Addr>>> {
    let mut out: Vec<IfAddr<Ipv6Addr>> = nix::ifaddrs::getifaddrs()?
        .filter_map(|ifa| {
            let sin6 = *ifa.address?.as_sockaddr_in6()?;
            Some(IfAddr {
                ifname: ifa.interface_name,
                addr: sin6.ip(),
            })
        })
        .collect();
    out.sort();
    out.dedup();
    Ok(out)
}

/// Pure: NodePort addresses and the SNAT address from the node's addresses of one family
/// (`primary` and the CIDRs apply per family, as upstream: an IPv4 CIDR selects no IPv6
/// address).
///
/// - `All` (empty list): every address except loopback (upstream's nftables mode never serves
///   NodePorts on localhost either).
/// - `Primary`: the addresses of the external devices (`--devices`); without devices, the first
///   non-loopback address. (Upstream takes the Node object's InternalIPs; standalone mode has none.)
/// - CIDRs: the addresses inside any of them.
///
/// The SNAT address is the first NodePort address on an external device, else the first address
/// on an external device, else the first NodePort address.
pub fn select<A: NodeFamily>(
    addrs: &[IfAddr<A>],
    cfg: &NodePortAddresses,
    devices: &Patterns,
) -> NodeAddrs<A> {
    let usable = |a: &&IfAddr<A>| a.addr.usable();
    let on_device = |a: &&IfAddr<A>| !devices.is_empty() && devices.matches(&a.ifname);
    let mut nodeport: Vec<A> = match cfg {
        NodePortAddresses::All => addrs.iter().filter(usable).map(|a| a.addr).collect(),
        NodePortAddresses::Primary => {
            let on_devices: Vec<A> = addrs
                .iter()
                .filter(usable)
                .filter(on_device)
                .map(|a| a.addr)
                .collect();
            if on_devices.is_empty() {
                addrs
                    .iter()
                    .find(usable)
                    .map(|a| a.addr)
                    .into_iter()
                    .collect()
            } else {
                on_devices
            }
        }
        NodePortAddresses::Cidrs(cidrs) => addrs
            .iter()
            .filter(usable)
            .filter(|a| cidrs.iter().any(|c: &Cidr| c.contains(a.addr.into())))
            .map(|a| a.addr)
            .collect(),
    };
    nodeport.sort();
    nodeport.dedup();
    let snat = addrs
        .iter()
        .filter(usable)
        .filter(on_device)
        .find(|a| nodeport.contains(&a.addr))
        .or_else(|| addrs.iter().filter(usable).find(on_device))
        .map(|a| a.addr)
        .or_else(|| nodeport.first().copied());
    NodeAddrs { nodeport, snat }
}

/// Pure: the SNAT source address of each tunnel device, MASQUERADE's choice: an address of the
/// device itself (the first one listed; loopback and 0.0.0.0 never). Devices without one are left
/// out and use the node's SNAT address.
pub fn tunnel_snat_addrs(addrs: &[IfAddr], tunnels: &[Interface]) -> BTreeMap<u32, [u8; 4]> {
    tunnels
        .iter()
        .filter_map(|t| {
            let a = addrs.iter().find(|a| {
                a.ifname == t.name && !a.addr.is_loopback() && !a.addr.is_unspecified()
            })?;
            Some((t.index, a.addr.octets()))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn addrs() -> Vec<IfAddr> {
        [
            ("lo", [127, 0, 0, 1]),
            ("lo", [169, 254, 1, 1]),
            ("eth0", [192, 168, 50, 10]),
            ("eth1", [10, 0, 0, 5]),
        ]
        .into_iter()
        .map(|(n, a)| IfAddr {
            ifname: n.into(),
            addr: Ipv4Addr::from(a),
        })
        .collect()
    }

    fn ip(a: [u8; 4]) -> Ipv4Addr {
        Ipv4Addr::from(a)
    }

    #[test]
    fn a_tunnel_device_snats_to_its_own_address_if_it_has_one() {
        let mut all = addrs();
        all.push(IfAddr {
            ifname: "flannel.1".into(),
            addr: ip([10, 244, 1, 0]),
        });
        let tunnels = [
            Interface {
                index: 7,
                name: "flannel.1".into(),
            },
            Interface {
                index: 8,
                name: "geneve0".into(),
            },
        ];
        assert_eq!(
            tunnel_snat_addrs(&all, &tunnels),
            BTreeMap::from([(7, [10, 244, 1, 0])]),
            "geneve0 has no address: it keeps the node's"
        );
    }

    #[test]
    fn all_means_every_non_loopback_address() {
        let got = select(&addrs(), &NodePortAddresses::All, &Patterns::parse("eth0"));
        assert_eq!(
            got.nodeport,
            vec![
                ip([10, 0, 0, 5]),
                ip([169, 254, 1, 1]),
                ip([192, 168, 50, 10])
            ]
        );
        assert_eq!(
            got.snat,
            Some(ip([192, 168, 50, 10])),
            "the device's address"
        );
    }

    #[test]
    fn primary_is_the_devices_addresses() {
        let got = select(
            &addrs(),
            &NodePortAddresses::Primary,
            &Patterns::parse("eth*"),
        );
        assert_eq!(
            got.nodeport,
            vec![ip([10, 0, 0, 5]), ip([192, 168, 50, 10])]
        );
        let none = select(&addrs(), &NodePortAddresses::Primary, &Patterns::default());
        assert_eq!(none.nodeport, vec![ip([169, 254, 1, 1])]);
        assert_eq!(none.snat, Some(ip([169, 254, 1, 1])));
    }

    /// IPv6 node addresses go through the same selection: `all` leaves out loopback and the
    /// link-local fe80:: ones, `primary` is the devices' IPv6 addresses, CIDRs of the other
    /// family select nothing, IPv6 CIDRs select inside them.
    #[test]
    fn ipv6_node_addresses_are_selected_per_family() {
        let v6 = |s: &str| s.parse::<Ipv6Addr>().unwrap();
        let addrs: Vec<IfAddr<Ipv6Addr>> = [
            ("lo", "::1"),
            ("eth0", "fe80::1"),
            ("eth0", "2001:db8:50::10"),
            ("eth1", "fd00:10::5"),
            ("veth1", "fe80::2"),
        ]
        .into_iter()
        .map(|(n, a)| IfAddr {
            ifname: n.into(),
            addr: v6(a),
        })
        .collect();
        let all = select(&addrs, &NodePortAddresses::All, &Patterns::parse("eth0"));
        assert_eq!(all.nodeport, [v6("2001:db8:50::10"), v6("fd00:10::5")]);
        assert_eq!(all.snat, Some(v6("2001:db8:50::10")));
        let primary = select(
            &addrs,
            &NodePortAddresses::Primary,
            &Patterns::parse("eth1"),
        );
        assert_eq!(primary.nodeport, [v6("fd00:10::5")]);
        let mixed = NodePortAddresses::from_list(&["10.0.0.0/8", "2001:db8::/32"]).unwrap();
        assert_eq!(
            select(&addrs, &mixed, &Patterns::default()).nodeport,
            [v6("2001:db8:50::10")]
        );
        let v4_only = NodePortAddresses::from_list(&["10.0.0.0/8"]).unwrap();
        assert!(
            select(&addrs, &v4_only, &Patterns::default())
                .nodeport
                .is_empty()
        );
        // And the IPv4 selection ignores the IPv6 CIDR.
        assert_eq!(
            select(&super::tests::addrs(), &mixed, &Patterns::default()).nodeport,
            [ip([10, 0, 0, 5])]
        );
    }

    #[test]
    fn cidrs_filter_and_snat_prefers_a_nodeport_address_on_a_device() {
        let cfg = NodePortAddresses::from_list(&["10.0.0.0/8"]).unwrap();
        let got = select(&addrs(), &cfg, &Patterns::parse("eth*"));
        assert_eq!(got.nodeport, vec![ip([10, 0, 0, 5])]);
        assert_eq!(got.snat, Some(ip([10, 0, 0, 5])));
        let nothing = NodePortAddresses::from_list(&["172.16.0.0/12"]).unwrap();
        let got = select(&addrs(), &nothing, &Patterns::parse("eth0"));
        assert!(got.nodeport.is_empty());
        assert_eq!(got.snat, Some(ip([192, 168, 50, 10])));
    }
}
