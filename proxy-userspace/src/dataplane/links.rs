//! The links of this network namespace and what they are, from an `RTM_GETLINK` dump: kind
//! (`IFLA_INFO_KIND`), hardware type, master (a bond's or bridge's port), and whether a pair
//! device's peer lives in another namespace (`IFLA_LINK_NETNSID`: a pod's veth); and the devices
//! carrying a default route, from an `RTM_GETROUTE` dump (`dataplane::devices` decides from these
//! which interfaces get the programs). Tunnel devices (flannel.1, vxlan.calico, tunl0, wg0, ...)
//! are found by link kind. Flows that leave through a tunnel must
//! be translated there too (SNAT of forwarded external flows), so the agent attaches to them
//! without their being named in `--devices`. The dump also tells which devices carry bare IP
//! packets (L3 devices: ipip, gre, WireGuard), which get the `_l3` programs. Parsing the dump is
//! pure (netlink-packet-route's types); the socket (netlink-sys) is the IO edge.

use std::{collections::BTreeSet, io};

use netlink_packet_core::{
    Emitable as _, ErrorBuffer, NLM_F_DUMP, NLM_F_REQUEST, NLMSG_DONE, NLMSG_ERROR, NetlinkBuffer,
    NetlinkHeader, NetlinkMessage, NetlinkPayload, NlasIterator, Parseable as _,
    ParseableParametrized as _,
};
use netlink_packet_route::{
    RouteNetlinkMessage,
    link::{InfoKind, LinkAttribute, LinkHeader, LinkInfo, LinkMessage},
    route::{RouteAttribute, RouteHeader, RouteLwEnCapType, RouteMessage},
};

use super::interfaces::Interface;

/// Link kinds that are tunnels carrying Ethernet frames: the programs' parser (Ethernet + IPv4)
/// applies inside them as on any Ethernet device (`tc_ingress`/`tc_egress`).
pub const ETHERNET_TUNNEL_KINDS: [&str; 4] = ["vxlan", "geneve", "gretap", "ip6gretap"];
/// Link kinds that are tunnels carrying bare IP packets (no Ethernet header): attached with
/// `tc_ingress_l3`/`tc_egress_l3`, which parse from the IPv4 header (IPv6 packets pass).
pub const L3_TUNNEL_KINDS: [&str; 6] = ["ipip", "gre", "ip6gre", "sit", "ip6tnl", "wireguard"];
/// The kind of TUN/TAP devices: a tunnel when in TUN mode (bare IP packets: wireguard-go,
/// tailscale, OpenVPN), not in TAP mode (Ethernet: a VM's NIC, not an overlay).
pub const TUN_KIND: &str = "tun";

/// `ARPHRD_ETHER`: the device's frames start with an Ethernet header.
const ARPHRD_ETHER: u16 = 1;
/// Hardware types of devices whose packets start at the IP header (no L2 header at tc):
/// `ARPHRD_TUNNEL` (ipip), `ARPHRD_TUNNEL6` (ip6tnl), `ARPHRD_SIT`, `ARPHRD_IPGRE` (gre),
/// `ARPHRD_IP6GRE`, `ARPHRD_NONE` (WireGuard, tun).
const ARPHRD_L3: [u16; 6] = [768, 769, 776, 778, 823, 65534];
/// `RTM_NEWLINK`, the type of each message of the dump (netlink-packet-route keeps its constant
/// private).
const RTM_NEWLINK: u16 = 16;
/// `RTM_NEWROUTE`, the type of each message of a route dump.
const RTM_NEWROUTE: u16 = 24;
const IFLA_LINKINFO: u16 = 18;
const IFLA_INFO_KIND: u16 = 1;
/// Bound on the dump's datagrams (each holds many links): a namespace with more is cut short.
const MAX_DUMP_READS: usize = 4096;

/// One interface and what it is.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Link {
    pub index: u32,
    pub name: String,
    /// `IFLA_INFO_KIND` (`vxlan`, `veth`, ...); `None` for physical devices and loopback.
    pub kind: Option<String>,
    /// `ifi_type` (`ARPHRD_*`).
    pub hw_type: u16,
    /// `IFLA_MASTER`: the bond or bridge this device is a port of.
    pub master: Option<u32>,
    /// `IFLA_LINK_NETNSID`: the namespace (id as seen from here) of a pair device's peer, when
    /// it lives in another namespace.
    pub peer_netns: Option<i32>,
}

impl Link {
    /// The device's packets start at the IP header (ipip, gre, WireGuard): it needs the `_l3`
    /// programs.
    pub fn is_l3(&self) -> bool {
        ARPHRD_L3.contains(&self.hw_type)
    }
}

/// A tunnel device, and which programs it takes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Tunnel {
    pub interface: Interface,
    pub kind: String,
    /// Frames start with an Ethernet header (vxlan, geneve, gretap): `tc_ingress`/`tc_egress`.
    /// Otherwise an L3 tunnel (ipip, gre, wireguard) with bare IP packets: the `_l3` programs.
    pub ethernet: bool,
}

/// Pure: the ifindexes of the L3 devices among `links` (see [`Link::is_l3`]).
pub fn l3_devices(links: &[Link]) -> BTreeSet<u32> {
    links
        .iter()
        .filter(|l| l.is_l3())
        .map(|l| l.index)
        .collect()
}

/// Pure: the tunnel devices among `links`.
pub fn tunnels(links: &[Link]) -> Vec<Tunnel> {
    links
        .iter()
        .filter_map(|l| {
            let kind = l.kind.as_deref()?;
            let known = ETHERNET_TUNNEL_KINDS.contains(&kind)
                || L3_TUNNEL_KINDS.contains(&kind)
                || (kind == TUN_KIND && l.is_l3());
            known.then(|| Tunnel {
                interface: Interface {
                    index: l.index,
                    name: l.name.clone(),
                },
                kind: kind.to_owned(),
                ethernet: l.hw_type == ARPHRD_ETHER,
            })
        })
        .collect()
}

/// Every interface of this network namespace with its kind (`RTM_GETLINK` dump).
pub fn dump() -> io::Result<Vec<Link>> {
    dump_of(
        RouteNetlinkMessage::GetLink(LinkMessage::default()),
        RTM_NEWLINK,
        parse_link,
    )
}

/// The ifindexes of the devices carrying a default route (IPv4 or IPv6, main table; every
/// next hop of a multipath one), from an `RTM_GETROUTE` dump.
pub fn default_route_devices() -> io::Result<BTreeSet<u32>> {
    let routes = dump_of(
        RouteNetlinkMessage::GetRoute(RouteMessage::default()),
        RTM_NEWROUTE,
        parse_default_route,
    )?;
    Ok(routes.into_iter().flatten().collect())
}

/// One dump: `request` sent, every message of type `ty` parsed by `parse`.
fn dump_of<T>(
    request: RouteNetlinkMessage,
    ty: u16,
    parse: fn(&[u8]) -> Option<T>,
) -> io::Result<Vec<T>> {
    let socket = super::netlink::route_socket(0)?;
    socket.send(&dump_request(request, 1), 0)?;
    let mut out = Vec::new();
    let mut buf = vec![0u8; 64 * 1024];
    for _ in 0..MAX_DUMP_READS {
        let n = socket.recv(&mut &mut buf[..], 0)?;
        match parse_dump(&buf[..n.min(buf.len())], ty, parse, &mut out) {
            Ok(true) => return Ok(out),
            Ok(false) => {}
            Err(errno) => return Err(io::Error::from_raw_os_error(errno)),
        }
    }
    Ok(out)
}

/// A dump request (`request`'s header empty: every family, every object).
fn dump_request(request: RouteNetlinkMessage, seq: u32) -> Vec<u8> {
    let mut msg = NetlinkMessage::new(NetlinkHeader::default(), NetlinkPayload::from(request));
    msg.header.flags = NLM_F_REQUEST | NLM_F_DUMP;
    msg.header.sequence_number = seq;
    msg.finalize();
    let mut buf = vec![0u8; msg.buffer_len()];
    msg.serialize(&mut buf);
    buf
}

/// Pure: the output devices of one `RTM_NEWROUTE` message if it is a default route of the main
/// table (`None` otherwise).
fn parse_default_route(payload: &[u8]) -> Option<Vec<u32>> {
    let header = RouteHeader::parse(payload).ok()?;
    if header.destination_prefix_length != 0 {
        return None;
    }
    let mut table = u32::from(header.table);
    let mut devices = Vec::new();
    let attrs = payload.get(header.buffer_len()..).unwrap_or_default();
    for nla in NlasIterator::new(attrs) {
        let Ok(nla) = nla else { break };
        let param = (
            header.address_family,
            header.kind,
            RouteLwEnCapType::default(),
        );
        match RouteAttribute::parse_with_param(&nla, param) {
            Ok(RouteAttribute::Oif(index)) => devices.push(index),
            Ok(RouteAttribute::Table(t)) => table = t,
            Ok(RouteAttribute::MultiPath(hops)) => {
                devices.extend(hops.iter().map(|h| h.interface_index));
            }
            _ => {}
        }
    }
    (table == u32::from(RouteHeader::RT_TABLE_MAIN)).then_some(devices)
}

/// Pure: appends the objects of type `ty` of one datagram of a dump. `Ok(true)` at the end of
/// the dump, `Err(errno)` if the kernel answered with an error. A truncated message ends the
/// datagram.
fn parse_dump<T>(
    mut b: &[u8],
    ty: u16,
    parse: fn(&[u8]) -> Option<T>,
    out: &mut Vec<T>,
) -> Result<bool, i32> {
    while let Ok(msg) = NetlinkBuffer::new_checked(b) {
        let len = msg.length() as usize;
        match msg.message_type() {
            NLMSG_DONE => return Ok(true),
            NLMSG_ERROR => {
                let code = ErrorBuffer::new_checked(msg.payload())
                    .ok()
                    .and_then(|e| e.code());
                return match code {
                    Some(code) => Err(-code.get()),
                    None => Ok(true),
                };
            }
            t if t == ty => out.extend(parse(msg.payload())),
            _ => {}
        }
        b = b.get(len.next_multiple_of(4)..).unwrap_or_default();
    }
    Ok(false)
}

/// Pure: one `RTM_NEWLINK` message. Attributes are parsed one by one so that one the library
/// rejects (a newer kernel's layout) costs only that attribute; the link kind is read on its own
/// when the rest of `IFLA_LINKINFO` does not parse.
fn parse_link(payload: &[u8]) -> Option<Link> {
    let header = LinkHeader::parse(payload).ok()?;
    let mut link = Link {
        index: header.index,
        name: String::new(),
        kind: None,
        hw_type: header.link_layer_type.into(),
        master: None,
        peer_netns: None,
    };
    let attrs = payload.get(header.buffer_len()..).unwrap_or_default();
    for nla in NlasIterator::new(attrs) {
        let Ok(nla) = nla else { break };
        match LinkAttribute::parse_with_param(&nla, header.interface_family) {
            Ok(LinkAttribute::IfName(name)) => link.name = name,
            Ok(LinkAttribute::Controller(master)) if master != 0 => link.master = Some(master),
            Ok(LinkAttribute::LinkNetNsId(id)) if id >= 0 => link.peer_netns = Some(id),
            Ok(LinkAttribute::LinkInfo(infos)) => {
                link.kind = infos.iter().find_map(|i| match i {
                    LinkInfo::Kind(k) => Some(k.to_string()),
                    _ => None,
                });
            }
            Err(_) if nla.kind() == IFLA_LINKINFO => {
                link.kind = NlasIterator::new(nla.value())
                    .flatten()
                    .filter(|i| i.kind() == IFLA_INFO_KIND)
                    .find_map(|i| InfoKind::parse(&i).ok())
                    .map(|k| k.to_string());
            }
            _ => {}
        }
    }
    (link.index != 0 && !link.name.is_empty()).then_some(link)
}

#[cfg(test)]
mod tests {
    use super::*;

    // The kernel's layout, written out by hand so the tests do not check the library against
    // itself.
    const NLMSG_HDRLEN: usize = 16;
    const IFINFOMSG_LEN: usize = 16;
    const IFLA_IFNAME: u16 = 3;

    use netlink_packet_core::NlaBuffer;
    use netlink_packet_route::AddressFamily;

    fn attr(ty: u16, payload: &[u8]) -> Vec<u8> {
        let mut a = Vec::new();
        a.extend_from_slice(&((4 + payload.len()) as u16).to_ne_bytes());
        a.extend_from_slice(&ty.to_ne_bytes());
        a.extend_from_slice(payload);
        while a.len() % 4 != 0 {
            a.push(0);
        }
        a
    }

    fn newlink(index: u32, hw_type: u16, name: &str, kind: Option<&str>) -> Vec<u8> {
        let mut body = vec![0u8; IFINFOMSG_LEN];
        body[2..4].copy_from_slice(&hw_type.to_ne_bytes());
        body[4..8].copy_from_slice(&index.to_ne_bytes());
        body.extend(attr(IFLA_IFNAME, format!("{name}\0").as_bytes()));
        if let Some(kind) = kind {
            // Nested: IFLA_INFO_KIND, then an IFLA_INFO_DATA the parser skips.
            let mut info = attr(IFLA_INFO_KIND, format!("{kind}\0").as_bytes());
            info.extend(attr(2, &[1, 2, 3, 4, 5]));
            body.extend(attr(IFLA_LINKINFO | 0x8000, &info));
        }
        body.extend(attr(4, &1500u32.to_ne_bytes()));
        message(RTM_NEWLINK, &body)
    }

    fn message(ty: u16, body: &[u8]) -> Vec<u8> {
        let mut m = Vec::new();
        m.extend_from_slice(&((NLMSG_HDRLEN + body.len()) as u32).to_ne_bytes());
        m.extend_from_slice(&ty.to_ne_bytes());
        m.extend_from_slice(&0x2u16.to_ne_bytes());
        m.extend_from_slice(&[0u8; 8]);
        m.extend_from_slice(body);
        m
    }

    #[test]
    fn a_dump_gives_names_kinds_and_hardware_types() {
        let mut datagram = newlink(1, 772, "lo", None);
        datagram.extend(newlink(2, 1, "ext0", Some("veth")));
        datagram.extend(newlink(7, 1, "flannel.1", Some("vxlan")));
        datagram.extend(newlink(8, 768, "tunl0", Some("ipip")));
        datagram.extend(newlink(9, 65534, "wg0", Some("wireguard")));
        datagram.extend(newlink(10, 65534, "tailscale0", Some("tun")));
        datagram.extend(newlink(11, 1, "tap-vm1", Some("tun")));
        let mut links = Vec::new();
        assert_eq!(
            parse_dump(&datagram, RTM_NEWLINK, parse_link, &mut links),
            Ok(false)
        );
        assert_eq!(
            parse_dump(
                &message(NLMSG_DONE, &[0; 4]),
                RTM_NEWLINK,
                parse_link,
                &mut links
            ),
            Ok(true)
        );
        let names: Vec<_> = links
            .iter()
            .map(|l| (l.index, l.name.as_str(), l.kind.as_deref(), l.hw_type))
            .collect();
        assert_eq!(
            names,
            vec![
                (1, "lo", None, 772),
                (2, "ext0", Some("veth"), 1),
                (7, "flannel.1", Some("vxlan"), 1),
                (8, "tunl0", Some("ipip"), 768),
                (9, "wg0", Some("wireguard"), 65534),
                (10, "tailscale0", Some("tun"), 65534),
                (11, "tap-vm1", Some("tun"), 1),
            ]
        );
        let t = tunnels(&links);
        let summary: Vec<_> = t
            .iter()
            .map(|t| (t.interface.name.as_str(), t.kind.as_str(), t.ethernet))
            .collect();
        assert_eq!(
            summary,
            vec![
                ("flannel.1", "vxlan", true),
                ("tunl0", "ipip", false),
                ("wg0", "wireguard", false),
                ("tailscale0", "tun", false),
            ]
        );
        assert_eq!(l3_devices(&links), BTreeSet::from([8, 9, 10]));
    }

    #[test]
    fn a_link_info_the_library_rejects_still_gives_the_kind() {
        // IFLA_INFO_DATA of a vxlan holding one attribute that claims 8 bytes and has 5.
        let mut info = attr(IFLA_INFO_KIND, b"vxlan\0");
        info.extend(attr(2, &[8, 0, 1, 0, 9]));
        let linkinfo = attr(IFLA_LINKINFO | 0x8000, &info);
        let nla = NlaBuffer::new_checked(&linkinfo[..]).unwrap();
        assert!(
            LinkAttribute::parse_with_param(&nla, AddressFamily::Unspec).is_err(),
            "the fallback is what this test exercises"
        );
        let mut body = vec![0u8; IFINFOMSG_LEN];
        body[2..4].copy_from_slice(&1u16.to_ne_bytes());
        body[4..8].copy_from_slice(&5u32.to_ne_bytes());
        body.extend(attr(IFLA_IFNAME, b"vxlan.calico\0"));
        body.extend(linkinfo);
        let mut links = Vec::new();
        assert_eq!(
            parse_dump(
                &message(RTM_NEWLINK, &body),
                RTM_NEWLINK,
                parse_link,
                &mut links
            ),
            Ok(false)
        );
        assert_eq!(
            links,
            vec![Link {
                index: 5,
                name: "vxlan.calico".into(),
                kind: Some("vxlan".into()),
                hw_type: 1,
                master: None,
                peer_netns: None,
            }]
        );
    }

    #[test]
    fn errors_and_truncated_messages_end_the_parse() {
        let mut links = Vec::new();
        let mut err = (-libc::EPERM).to_ne_bytes().to_vec();
        err.extend([0u8; 16]);
        assert_eq!(
            parse_dump(
                &message(NLMSG_ERROR, &err),
                RTM_NEWLINK,
                parse_link,
                &mut links
            ),
            Err(libc::EPERM)
        );
        let whole = newlink(3, 1, "vxlan0", Some("vxlan"));
        assert_eq!(
            parse_dump(
                &whole[..whole.len() - 8],
                RTM_NEWLINK,
                parse_link,
                &mut links
            ),
            Ok(false)
        );
        assert!(links.is_empty(), "a truncated message is not half-read");
    }

    #[test]
    fn the_dump_request_is_an_empty_getlink_dump() {
        let mut want = Vec::new();
        want.extend_from_slice(&32u32.to_ne_bytes()); // nlmsghdr + ifinfomsg
        want.extend_from_slice(&18u16.to_ne_bytes()); // RTM_GETLINK
        want.extend_from_slice(&0x301u16.to_ne_bytes()); // NLM_F_REQUEST | NLM_F_DUMP
        want.extend_from_slice(&7u32.to_ne_bytes()); // sequence
        want.extend_from_slice(&0u32.to_ne_bytes()); // port
        want.extend_from_slice(&[0u8; IFINFOMSG_LEN]);
        assert_eq!(
            dump_request(RouteNetlinkMessage::GetLink(LinkMessage::default()), 7),
            want
        );
    }

    /// An `RTM_NEWROUTE` of family `family` to a /`dst_len` in `table`, out of `oif`.
    fn newroute(family: u8, dst_len: u8, table: u32, oif: u32) -> Vec<u8> {
        // struct rtmsg: family, dst_len, src_len, tos, table, protocol, scope, type, flags.
        let mut body = vec![family, dst_len, 0, 0, 254, 3, 0, 1, 0, 0, 0, 0];
        body.extend(attr(15, &table.to_ne_bytes())); // RTA_TABLE
        body.extend(attr(4, &oif.to_ne_bytes())); // RTA_OIF
        message(RTM_NEWROUTE, &body)
    }

    #[test]
    fn default_routes_of_the_main_table_name_their_devices() {
        let mut datagram = newroute(2, 0, 254, 3);
        datagram.extend(newroute(2, 24, 254, 4)); // a subnet route
        datagram.extend(newroute(10, 0, 254, 5)); // IPv6 default
        datagram.extend(newroute(2, 0, 255, 6)); // the local table
        let mut routes = Vec::new();
        assert_eq!(
            parse_dump(&datagram, RTM_NEWROUTE, parse_default_route, &mut routes),
            Ok(false)
        );
        let devices: BTreeSet<u32> = routes.into_iter().flatten().collect();
        assert_eq!(devices, BTreeSet::from([3, 5]));
    }

    #[test]
    fn dumps_this_namespace() {
        let links = dump().expect("RTM_GETLINK dump");
        assert!(links.iter().any(|l| l.name == "lo"), "{links:?}");
    }
}
