//! Which interfaces get the programs: by what they are, whatever the CNI names them
//! (`--pod-interfaces` and `--devices` globs only override). Pure; the facts come from
//! `links` (link dump, default routes) and `node_addrs` (addresses).
//!
//! - **Pod-facing**: every pair device (veth, netkit) whose peer lives in another network
//!   namespace: a pod's host side, whatever its name (`veth*`, `cali*`, `lxc*`, AWS VPC CNI's
//!   `eni*`, Azure's `azv*`, GKE's `gke*`, Kube-OVN's). Bridge ports included (bridge CNIs:
//!   the reply between two pods of one bridge is reverse-translated on the client's port), bond
//!   ports not (a bond carries the node's own traffic), and not a pair device that is itself the
//!   node's uplink (a kind node's `eth0`: it carries a default route).
//! - **External** (NodePort, externalIPs, LoadBalancer IPs arrive there): like Cilium's device
//!   detection, the devices that carry the node's traffic: a device with a global address or a
//!   default route (bonds, VLANs, physical NICs), except loopback, tunnels (attached by kind,
//!   `links::tunnels`) and ports of a bond or bridge (their master is the device). Bridges,
//!   pair devices, Open vSwitch and dummy devices count only with a default route: a pod
//!   bridge (`cni0`, `docker0`) or a dummy holding addresses (`nodelocaldns`, `kube-ipvs0`)
//!   receives nothing from outside. A bridge's ports are not pod-facing once the bridge is an
//!   external device (the node's uplink), so no packet meets the programs twice.

use std::collections::BTreeSet;

use super::{
    interfaces::{Interface, Patterns},
    links::{self, Link},
};

/// How one kind of interface is chosen: detected, or named by globs.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum Choice {
    #[default]
    Auto,
    Globs(Patterns),
}

impl Choice {
    /// A flag's value: empty or `auto` detects, anything else is comma-separated globs.
    pub fn parse(flag: &str) -> Self {
        match flag.trim() {
            "" | "auto" => Choice::Auto,
            globs => Choice::Globs(Patterns::parse(globs)),
        }
    }
}

/// How both kinds are chosen (`--pod-interfaces`, `--devices`).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Choices {
    pub pods: Choice,
    pub external: Choice,
}

impl Choices {
    /// Nothing at all (an agent that attaches nothing: benches).
    pub fn none() -> Self {
        Self {
            pods: Choice::Globs(Patterns::default()),
            external: Choice::Globs(Patterns::default()),
        }
    }
}

impl std::fmt::Display for Choice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Choice::Auto => f.write_str("auto"),
            Choice::Globs(p) => write!(f, "{p:?}"),
        }
    }
}

/// What the kernel says about this namespace's interfaces.
#[derive(Clone, Debug)]
pub struct Facts<'a> {
    pub links: &'a [Link],
    /// Interfaces holding a usable (not loopback, not link-local) address of either family.
    pub addressed: &'a BTreeSet<String>,
    /// Interfaces carrying a default route (`links::default_route_devices`).
    pub default_routes: &'a BTreeSet<u32>,
}

/// The chosen interfaces.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Selection {
    pub pods: Vec<Interface>,
    pub external: Vec<Interface>,
}

impl Selection {
    /// Both sets, each interface once, by ifindex.
    pub fn all(&self) -> Vec<Interface> {
        let mut out: Vec<Interface> = self.pods.iter().chain(&self.external).cloned().collect();
        out.sort_by_key(|i| i.index);
        out.dedup_by_key(|i| i.index);
        out
    }
}

/// `ARPHRD_LOOPBACK`.
const ARPHRD_LOOPBACK: u16 = 772;
/// Pair devices: one end here, the other possibly in a pod.
const PAIR_KINDS: [&str; 2] = ["veth", "netkit"];
/// Devices that are external only with a default route (see the module doc).
const ROUTE_ONLY_KINDS: [&str; 6] = ["veth", "netkit", "bridge", "openvswitch", "dummy", "tun"];

fn interface(l: &Link) -> Interface {
    Interface {
        index: l.index,
        name: l.name.clone(),
    }
}

/// Pure: the pod-facing and external interfaces of `facts` under `pods` and `external`.
pub fn select(facts: &Facts<'_>, pods: &Choice, external: &Choice) -> Selection {
    let tunnels: BTreeSet<u32> = links::tunnels(facts.links)
        .iter()
        .map(|t| t.interface.index)
        .collect();
    let external_set: Vec<&Link> = match external {
        Choice::Globs(p) => facts.links.iter().filter(|l| p.matches(&l.name)).collect(),
        Choice::Auto => facts
            .links
            .iter()
            .filter(|l| is_external(l, facts, &tunnels))
            .collect(),
    };
    let external_idx: BTreeSet<u32> = external_set.iter().map(|l| l.index).collect();
    let bonds: BTreeSet<u32> = facts
        .links
        .iter()
        .filter(|l| l.kind.as_deref() == Some("bond"))
        .map(|l| l.index)
        .collect();
    let pod_set: Vec<&Link> = match pods {
        Choice::Globs(p) => facts.links.iter().filter(|l| p.matches(&l.name)).collect(),
        Choice::Auto => facts
            .links
            .iter()
            .filter(|l| {
                l.kind.as_deref().is_some_and(|k| PAIR_KINDS.contains(&k))
                    && l.peer_netns.is_some()
                    && !external_idx.contains(&l.index)
                    && l.master
                        .is_none_or(|m| !external_idx.contains(&m) && !bonds.contains(&m))
            })
            .collect(),
    };
    Selection {
        pods: pod_set.into_iter().map(interface).collect(),
        external: external_set.into_iter().map(interface).collect(),
    }
}

fn is_external(l: &Link, facts: &Facts<'_>, tunnels: &BTreeSet<u32>) -> bool {
    if l.hw_type == ARPHRD_LOOPBACK || l.master.is_some() || tunnels.contains(&l.index) {
        return false;
    }
    let routed = facts.default_routes.contains(&l.index);
    match l.kind.as_deref() {
        Some(k) if ROUTE_ONLY_KINDS.contains(&k) => routed,
        _ => routed || facts.addressed.contains(&l.name),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn link(index: u32, name: &str, kind: Option<&str>) -> Link {
        Link {
            index,
            name: name.into(),
            kind: kind.map(Into::into),
            hw_type: 1,
            master: None,
            peer_netns: None,
        }
    }

    fn pod(index: u32, name: &str) -> Link {
        Link {
            peer_netns: Some(3),
            ..link(index, name, Some("veth"))
        }
    }

    fn names(v: &[Interface]) -> Vec<&str> {
        v.iter().map(|i| i.name.as_str()).collect()
    }

    fn set(v: &[&str]) -> BTreeSet<String> {
        v.iter().map(|s| (*s).to_owned()).collect()
    }

    #[test]
    fn pods_are_pair_devices_with_a_peer_elsewhere_whatever_their_name() {
        let mut lo = link(1, "lo", None);
        lo.hw_type = ARPHRD_LOOPBACK;
        let links = [
            lo,
            link(2, "eth0", None),
            pod(3, "eni0abc"),
            pod(4, "azv12"),
            pod(5, "gke77"),
            Link {
                kind: Some("netkit".into()),
                ..pod(6, "nk0")
            },
            link(7, "veth-local", Some("veth")),
            link(8, "flannel.1", Some("vxlan")),
        ];
        let addressed = set(&["lo", "eth0", "flannel.1"]);
        let routes = BTreeSet::from([2]);
        let facts = Facts {
            links: &links,
            addressed: &addressed,
            default_routes: &routes,
        };
        let s = select(&facts, &Choice::Auto, &Choice::Auto);
        assert_eq!(names(&s.pods), ["eni0abc", "azv12", "gke77", "nk0"]);
        assert_eq!(names(&s.external), ["eth0"], "loopback and tunnels are not");
    }

    #[test]
    fn the_uplink_is_the_bond_or_bridge_holding_the_address_and_route_not_its_ports() {
        let port = |i, name: &str, master| Link {
            master: Some(master),
            ..pod(i, name)
        };
        let links = [
            link(10, "br-ext", Some("bridge")),
            port(11, "ext-a", 10),
            port(12, "ext-b", 10),
            link(20, "bond0", Some("bond")),
            Link {
                master: Some(20),
                ..link(21, "eth1", None)
            },
            link(22, "bond0.100", Some("vlan")),
            link(30, "cni0", Some("bridge")),
            port(31, "vethab12", 30),
            port(32, "vethcd34", 30),
            link(40, "nodelocaldns", Some("dummy")),
            link(41, "kube-ipvs0", Some("dummy")),
            link(42, "docker0", Some("bridge")),
        ];
        let addressed = set(&[
            "br-ext",
            "bond0",
            "bond0.100",
            "cni0",
            "nodelocaldns",
            "kube-ipvs0",
            "docker0",
        ]);
        let routes = BTreeSet::from([10]);
        let facts = Facts {
            links: &links,
            addressed: &addressed,
            default_routes: &routes,
        };
        let s = select(&facts, &Choice::Auto, &Choice::Auto);
        assert_eq!(names(&s.external), ["br-ext", "bond0", "bond0.100"]);
        assert_eq!(
            names(&s.pods),
            ["vethab12", "vethcd34"],
            "the uplink bridge's ports and bond ports are no pods; a pod bridge's ports are"
        );
        // Without its default route the uplink bridge is taken for a pod bridge.
        let facts = Facts {
            default_routes: &BTreeSet::new(),
            ..facts
        };
        let s = select(&facts, &Choice::Auto, &Choice::Auto);
        assert_eq!(names(&s.external), ["bond0", "bond0.100"]);
    }

    #[test]
    fn a_pair_device_carrying_the_default_route_is_the_uplink_not_a_pod() {
        // A kind node: its eth0 is a veth whose peer is in the host's namespace.
        let links = [pod(2, "eth0"), pod(5, "veth1234")];
        let addressed = set(&["eth0"]);
        let routes = BTreeSet::from([2]);
        let facts = Facts {
            links: &links,
            addressed: &addressed,
            default_routes: &routes,
        };
        let s = select(&facts, &Choice::Auto, &Choice::Auto);
        assert_eq!(names(&s.external), ["eth0"]);
        assert_eq!(names(&s.pods), ["veth1234"]);
        assert_eq!(names(&s.all()), ["eth0", "veth1234"]);
    }

    #[test]
    fn globs_override_detection_per_kind() {
        let links = [pod(2, "veth-a"), pod(3, "eni9"), link(4, "ext0", None)];
        let facts = Facts {
            links: &links,
            addressed: &set(&["ext0"]),
            default_routes: &BTreeSet::new(),
        };
        let s = select(&facts, &Choice::parse("veth-*"), &Choice::parse("auto"));
        assert_eq!(names(&s.pods), ["veth-a"]);
        assert_eq!(names(&s.external), ["ext0"]);
        let s = select(&facts, &Choice::parse(""), &Choice::parse("nothing*"));
        assert_eq!(names(&s.pods), ["veth-a", "eni9"]);
        assert!(s.external.is_empty());
    }
}
