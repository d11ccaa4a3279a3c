//! Packet fuzz of every tc program entry (tc_ingress, tc_ingress_l3, tc_egress, tc_egress_l3; the
//! IPv6, new-flow, direct-flow, reject and SNAT programs are reached through their prog arrays, as
//! on a node) with BPF_PROG_TEST_RUN, over a map state programmed the way the agent programs it
//! (`diff::plan` → `ServiceMaps::apply_all`, both families): ClusterIPs, a NodePort, externalIPs
//! with eTP=Local (one with local endpoints, one without), TCP/UDP/SCTP, Services without
//! endpoints, session affinity, Maglev, Service CIDRs, node addresses and cluster CIDRs.
//!
//! A seeded generator (splitmix64; `KPE_FUZZ_SEED`, `KPE_FUZZ_PACKETS`) makes IPv4/IPv6 ×
//! TCP/UDP/SCTP/ICMP/ICMPv6 packets to frontends, to Service-CIDR addresses without one and to
//! non-Service addresses, follows translated flows (replies, forwarded packets, ICMP errors
//! quoting them) and mutates: truncation, bad IHL and lengths, IPv4 options, IPv6 extension
//! chains, fragments (first, middle, last), odd TCP flags, VLAN/QinQ tags, empty payloads, random
//! bytes. Checked per packet:
//! 1. a packet that involves no Service, backend, node or hairpin address (outer and, for an ICMP
//!    error, quoted addresses) comes out byte-identical with TCX_NEXT;
//! 2. a packet passed modified has the input's length, and its IPv4 header and TCP/UDP/ICMP/
//!    ICMPv6 checksum residuals are the input's (a valid checksum stays valid; computed here, not
//!    with the datapath's arithmetic); a valid SCTP CRC32c stays valid; a UDP/IPv4 checksum 0
//!    stays 0; a redirected answer to a well-formed packet has valid checksums;
//! 3. verdicts are TCX_NEXT, TC_ACT_SHOT or (ingress only) TC_ACT_REDIRECT;
//! 4. every hash map the datapath writes holds at most max_entries and no more entries than the
//!    packets so far could create; the maps only userspace writes keep their entry count.
//!
//! On failure the seed, the case index, the program and the packet (hex) are printed.
//! Privileged. Short run by default; `cargo xtask fuzz` runs 10^6 packets in release.

mod common_datapath;
mod common_packet;

use std::{
    collections::BTreeMap,
    fmt::Write as _,
    net::{IpAddr, Ipv4Addr, Ipv6Addr},
    sync::Arc,
    time::Instant,
};

use aya::{
    Ebpf,
    maps::{
        HashMap, MapData,
        lpm_trie::{Key, LpmTrie},
    },
};
use common_datapath::{TC_ACT_REDIRECT, TC_ACT_SHOT, TC_NEXT};
use common_packet::{ETH_HLEN, ETH_P_IP, ETH_P_IPV6, Ext6, eth, ext6, ipv6_packet};
use kube_proxy_ebpf::{
    dataplane::maps::{ClusterCidrs6Map, Node6Map, ServiceMaps},
    pipeline::{
        diff,
        encode::FamilyAbi,
        model::{
            Balancing, DesiredBackend, DesiredFrontend, DesiredState, EndpointAddr, Family,
            Frontend, FrontendKind, Protocol, Scope, ServicePortName,
        },
        programmed::{Capacities, Programmed},
    },
};
use proxy_common::{
    AffinityKey, AffinityValue, ClusterCidrs, CtKey, CtValue, DatapathConfig, FragKey, FragValue,
    HAIRPIN_SNAT_ADDR, Ipv4Prefix, MAP_AFFINITY, MAP_CONNTRACK, MAP_FRAGMENTS, MAP_SERVICE_CIDRS,
    MAP_SNAT, PROG_TC_EGRESS, PROG_TC_EGRESS_L3, PROG_TC_INGRESS, PROG_TC_INGRESS_L3, Scheduler,
    SnatKey, SnatValue,
    ipv6::{
        Affinity6Key, Ct6Key, Ct6Value, Frag6Key, Frag6Value, MAP_AFFINITY6, MAP_CONNTRACK6,
        MAP_FRAGMENTS6, MAP_SERVICE_CIDRS6, MAP_SNAT6, Snat6Value,
    },
    proto, service_cidr,
};
use proxy_testenv::require_privileged;

/// Packets of the default (short) run: well under a minute in a debug build.
const DEFAULT_PACKETS: u64 = 100_000;
/// The default seed (a run is reproducible; `cargo xtask fuzz` picks a new one).
const DEFAULT_SEED: u64 = 0x6b70_652d_f022;
/// Capacity of the flow maps (conntrack, SNAT, affinity, fragments): small, so that long runs
/// fill them and evict.
const FLOW_MAP_CAPACITY: u32 = 2_048;

const ICMP: u8 = 1;
const ICMPV6: u8 = 58;

// ---------------------------------------------------------------- the cluster

const NODE4: Ipv4Addr = Ipv4Addr::new(192, 168, 50, 1);
const NODE6: Ipv6Addr = Ipv6Addr::new(0xfd00, 0x50, 0, 0, 0, 0, 0, 0x10);
const EXTERNAL_IP4: Ipv4Addr = Ipv4Addr::new(192, 168, 60, 5);
const EXTERNAL_IP6: Ipv6Addr = Ipv6Addr::new(0xfd00, 0x60, 0, 0, 0, 0, 0, 5);

/// One Service port of the test cluster, in one family.
struct Svc {
    addr: IpAddr,
    port: u16,
    protocol: Protocol,
    kind: FrontendKind,
    scheduler: Scheduler,
    affinity: Option<u32>,
    external_local: bool,
    drop_when_empty: bool,
    /// (backend address, port, local to this node).
    backends: Vec<(IpAddr, u16, bool)>,
}

fn v4(a: u8, b: u8, c: u8, d: u8) -> IpAddr {
    IpAddr::V4(Ipv4Addr::new(a, b, c, d))
}

fn v6(segs: [u16; 8]) -> IpAddr {
    IpAddr::V6(Ipv6Addr::new(
        segs[0], segs[1], segs[2], segs[3], segs[4], segs[5], segs[6], segs[7],
    ))
}

fn pod4(n: u8) -> IpAddr {
    v4(10, 244, n / 10 + 1, n)
}

fn pod6(n: u8) -> IpAddr {
    v6([0xfd00, 0x244, 0, 0, 0, 0, (n / 10 + 1) as u16, n as u16])
}

/// An address of a family from a host part.
type AddrOf<T> = fn(T) -> IpAddr;

/// The Services of both families.
fn cluster() -> Vec<Svc> {
    let mut out = Vec::new();
    for family6 in [false, true] {
        let (vip, pod): (AddrOf<u16>, AddrOf<u8>) = if family6 {
            (|h| v6([0xfd00, 0x96, 0, 0, 0, 0, 0, h]), pod6)
        } else {
            (|h| v4(10, 96, (h >> 8) as u8, h as u8), pod4)
        };
        let (node, external) = if family6 {
            (IpAddr::V6(NODE6), IpAddr::V6(EXTERNAL_IP6))
        } else {
            (IpAddr::V4(NODE4), IpAddr::V4(EXTERNAL_IP4))
        };
        let svc = |addr, port, protocol, backends: Vec<(IpAddr, u16, bool)>| Svc {
            addr,
            port,
            protocol,
            kind: FrontendKind::ClusterIp,
            scheduler: Scheduler::Random,
            affinity: None,
            external_local: false,
            drop_when_empty: false,
            backends,
        };
        out.push(svc(
            vip(10),
            80,
            Protocol::Tcp,
            vec![(pod(10), 8080, true), (pod(20), 8080, false)],
        ));
        out.push(Svc {
            affinity: Some(60),
            ..svc(
                vip(10),
                53,
                Protocol::Udp,
                vec![(pod(11), 5353, true), (pod(21), 5353, false)],
            )
        });
        out.push(svc(
            vip(10),
            9000,
            Protocol::Sctp,
            vec![(pod(12), 9000, true)],
        ));
        out.push(Svc {
            scheduler: Scheduler::Maglev,
            ..svc(
                vip(20),
                443,
                Protocol::Tcp,
                vec![
                    (pod(13), 8443, true),
                    (pod(23), 8443, false),
                    (pod(33), 8443, false),
                ],
            )
        });
        out.push(svc(vip(99), 80, Protocol::Tcp, vec![]));
        out.push(svc(vip(99), 53, Protocol::Udp, vec![]));
        out.push(svc(vip(99), 9000, Protocol::Sctp, vec![]));
        // A NodePort (eTP=Cluster: SNAT to the node for the remote backend).
        out.push(Svc {
            kind: FrontendKind::NodePort,
            ..svc(
                node,
                30080,
                Protocol::Tcp,
                vec![(pod(10), 8080, true), (pod(20), 8080, false)],
            )
        });
        out.push(Svc {
            kind: FrontendKind::NodePort,
            ..svc(node, 30053, Protocol::Udp, vec![(pod(21), 5353, false)])
        });
        // An externalIP with eTP=Local: this node's endpoint only (and its in-cluster entry).
        out.push(Svc {
            kind: FrontendKind::ExternalIp,
            external_local: true,
            ..svc(external, 80, Protocol::Tcp, vec![(pod(10), 8080, true)])
        });
        // eTP=Local with endpoints only elsewhere: new flows dropped.
        out.push(Svc {
            kind: FrontendKind::ExternalIp,
            external_local: true,
            drop_when_empty: true,
            ..svc(external, 81, Protocol::Tcp, vec![])
        });
    }
    out
}

fn protocol_number(p: Protocol) -> u8 {
    match p {
        Protocol::Tcp => proto::TCP,
        Protocol::Udp => proto::UDP,
        Protocol::Sctp => proto::SCTP,
    }
}

/// The desired state of one family, as `translate` makes it.
fn desired<A: Family>(svcs: &[Svc], conv: impl Fn(IpAddr) -> Option<A>) -> DesiredState<A> {
    let mut frontends = BTreeMap::new();
    for (i, s) in svcs.iter().enumerate() {
        let Some(addr) = conv(s.addr) else { continue };
        let backend = |&(a, port, local): &(IpAddr, u16, bool)| DesiredBackend {
            endpoint: EndpointAddr {
                addr: conv(a).expect("backend of the frontend's family"),
                port,
                protocol: s.protocol,
            },
            terminating: false,
            local,
            not_serving: false,
        };
        let mut backends: Vec<_> = s.backends.iter().map(backend).collect();
        backends.sort();
        let df = DesiredFrontend {
            service: ServicePortName {
                namespace: "fuzz".into(),
                name: format!("svc{i}"),
                port_name: String::new(),
            },
            kind: s.kind,
            balancing: Balancing {
                scheduler: s.scheduler,
                affinity_timeout_s: s.affinity,
            },
            external_local: s.external_local,
            drop_when_empty: s.drop_when_empty,
            source_ranges: Vec::new(),
            backends,
            retained: Vec::new(),
        };
        let fe = Frontend::new(addr, s.port, s.protocol);
        if s.external_local {
            // The in-cluster entry carries the cluster-wide endpoints like a ClusterIP.
            let in_cluster = Frontend {
                scope: Scope::InCluster,
                ..fe
            };
            let mut all = df.clone();
            all.external_local = false;
            all.drop_when_empty = false;
            if all.backends.is_empty() {
                all.backends = vec![DesiredBackend {
                    endpoint: EndpointAddr {
                        addr: conv(if addr_is_v6(s.addr) {
                            pod6(40)
                        } else {
                            pod4(40)
                        })
                        .unwrap(),
                        port: 8080,
                        protocol: s.protocol,
                    },
                    terminating: false,
                    local: false,
                    not_serving: false,
                }];
            }
            frontends.insert(in_cluster, Arc::new(all));
        }
        frontends.insert(fe, Arc::new(df));
    }
    DesiredState { frontends }
}

fn addr_is_v6(a: IpAddr) -> bool {
    matches!(a, IpAddr::V6(_))
}

/// Every backend address of the cluster (both families), the in-cluster-only one included.
fn backend_addrs(svcs: &[Svc]) -> Vec<IpAddr> {
    let mut out: Vec<IpAddr> = svcs
        .iter()
        .flat_map(|s| s.backends.iter().map(|b| b.0))
        .collect();
    out.extend([pod4(40), pod6(40)]);
    out.sort();
    out.dedup();
    out
}

fn plan_and_apply<A: FamilyAbi>(
    maps: &mut ServiceMaps<A>,
    desired: &DesiredState<A>,
    caps: &Capacities,
    other: &kube_proxy_ebpf::pipeline::programmed::SharedIds,
) -> Programmed<A> {
    let plan = diff::plan_sharing(desired, &Programmed::default(), caps, other);
    assert!(plan.skipped.is_empty(), "skipped: {:?}", plan.skipped);
    let (applied, err) = maps.apply_all(&plan.ops);
    assert!(err.is_none(), "apply failed after {applied} ops: {err:?}");
    let mut programmed = Programmed::default();
    for op in &plan.ops {
        programmed.apply(op);
    }
    programmed
}

/// The loaded object with the cluster programmed; the service maps (taken out of the object;
/// the programs keep them) are returned for the entry counts.
fn load(svcs: &[Svc]) -> (Ebpf, ServiceMaps, ServiceMaps<Ipv6Addr>) {
    let mut cfg = DatapathConfig::DEFAULT;
    cfg.cluster_cidrs = ClusterCidrs {
        count: 1,
        ..ClusterCidrs::NONE
    };
    cfg.cluster_cidrs.prefixes[0] = Ipv4Prefix {
        addr: [10, 244, 0, 0],
        mask: [255, 255, 0, 0],
    };
    let flow_maps = [
        MAP_CONNTRACK,
        MAP_CONNTRACK6,
        MAP_SNAT,
        MAP_SNAT6,
        MAP_AFFINITY,
        MAP_AFFINITY6,
        MAP_FRAGMENTS,
        MAP_FRAGMENTS6,
    ];
    let mut bpf = common_datapath::load_object(&cfg, None, &flow_maps, FLOW_MAP_CAPACITY);
    common_datapath::set_node_addr(&mut bpf, NODE4);
    Node6Map::from_ebpf(&mut bpf)
        .expect("NODE6 map")
        .set(NODE6)
        .expect("write NODE6");
    ClusterCidrs6Map::from_ebpf(&mut bpf)
        .expect("CLUSTERCIDRS6 map")
        .sync(&[(Ipv6Addr::new(0xfd00, 0x244, 0, 0, 0, 0, 0, 0), 32)])
        .expect("write CLUSTERCIDRS6");
    {
        let mut trie: LpmTrie<&mut MapData, [u8; 4], u32> =
            LpmTrie::try_from(bpf.map_mut(MAP_SERVICE_CIDRS).expect("SVCCIDRS")).unwrap();
        trie.insert(&Key::new(16, [10, 96, 0, 0]), service_cidr::UNALLOCATED, 0)
            .unwrap();
        for s in svcs {
            if let (IpAddr::V4(a), FrontendKind::ClusterIp) = (s.addr, s.kind) {
                trie.insert(&Key::new(32, a.octets()), service_cidr::CLUSTER_IP, 0)
                    .unwrap();
            }
        }
    }
    {
        let mut trie: LpmTrie<&mut MapData, [u8; 16], u32> =
            LpmTrie::try_from(bpf.map_mut(MAP_SERVICE_CIDRS6).expect("SVCCIDRS6")).unwrap();
        let cidr = Ipv6Addr::new(0xfd00, 0x96, 0, 0, 0, 0, 0, 0).octets();
        trie.insert(&Key::new(112, cidr), service_cidr::UNALLOCATED, 0)
            .unwrap();
        for s in svcs {
            if let (IpAddr::V6(a), FrontendKind::ClusterIp) = (s.addr, s.kind) {
                trie.insert(&Key::new(128, a.octets()), service_cidr::CLUSTER_IP, 0)
                    .unwrap();
            }
        }
    }
    let mut maps4 = ServiceMaps::from_ebpf(&mut bpf).expect("IPv4 service maps");
    let mut maps6 = maps4.ipv6(Some(&mut bpf), None).expect("IPv6 service maps");
    let caps = Capacities {
        maglev_table_size: cfg.maglev_table_size,
        ..maps4.capacities().expect("capacities")
    };
    let programmed4 = plan_and_apply(
        &mut maps4,
        &desired(svcs, |a| match a {
            IpAddr::V4(a) => Some(a),
            IpAddr::V6(_) => None,
        }),
        &caps,
        &Default::default(),
    );
    let caps6 = Capacities::ipv6(caps.maglev_chunks, caps.maglev_table_size);
    plan_and_apply(
        &mut maps6,
        &desired(svcs, |a| match a {
            IpAddr::V6(a) => Some(a),
            IpAddr::V4(_) => None,
        }),
        &caps6,
        &programmed4.shared_ids(),
    );
    (bpf, maps4, maps6)
}

// ---------------------------------------------------------------- checksums (independent)

/// The 16-bit one's complement sum of `data` (odd length padded), added to `acc`, folded.
fn ones_sum(data: &[u8], acc: u32) -> u16 {
    let mut s = acc as u64;
    for c in data.chunks(2) {
        let w = if c.len() == 2 {
            u16::from_be_bytes([c[0], c[1]])
        } else {
            u16::from_be_bytes([c[0], 0])
        };
        s += w as u64;
    }
    while s > 0xffff {
        s = (s & 0xffff) + (s >> 16);
    }
    s as u16
}

/// The checksum to store for `data` (its checksum field zero).
fn internet_csum(data: &[u8], acc: u32) -> u16 {
    !ones_sum(data, acc)
}

fn pseudo_sum(src: &[u8], dst: &[u8], proto: u8, len: u32) -> u32 {
    let mut s = ones_sum(src, 0) as u32 + ones_sum(dst, 0) as u32;
    s += proto as u32;
    s += (len >> 16) + (len & 0xffff);
    s
}

/// A residual of 0 (0x0000 or 0xffff) means "verifies".
fn norm(r: u16) -> u16 {
    if r == 0xffff { 0 } else { r }
}

/// CRC32c (Castagnoli), bitwise.
fn crc32c(data: &[u8]) -> u32 {
    let mut crc = !0u32;
    for &b in data {
        crc ^= b as u32;
        for _ in 0..8 {
            crc = if crc & 1 != 0 {
                (crc >> 1) ^ 0x82f6_3b78
            } else {
                crc >> 1
            };
        }
    }
    !crc
}

fn sctp_crc_ok(seg: &[u8]) -> bool {
    if seg.len() < 12 {
        return false;
    }
    let mut s = seg.to_vec();
    let field = [s[8], s[9], s[10], s[11]];
    s[8..12].fill(0);
    crc32c(&s).to_le_bytes() == field
}

// ---------------------------------------------------------------- the generator

/// splitmix64.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }

    /// True with probability `pct`%.
    fn chance(&mut self, pct: u64) -> bool {
        self.below(100) < pct
    }

    fn pick<'a, T>(&mut self, items: &'a [T]) -> &'a T {
        &items[self.below(items.len() as u64) as usize]
    }

    fn bytes(&mut self, n: usize) -> Vec<u8> {
        (0..n).map(|_| self.next() as u8).collect()
    }

    fn port(&mut self) -> u16 {
        if self.chance(50) {
            *self.pick(&[0, 1, 53, 80, 81, 443, 5353, 8080, 9000, 30080, 30053, 65535])
        } else {
            self.next() as u16
        }
    }
}

/// An L4 flow: addresses of one family, protocol, ports (ICMP: the echo id as `sport`).
#[derive(Clone, Copy, Debug)]
struct Flow {
    src: IpAddr,
    dst: IpAddr,
    proto: u8,
    sport: u16,
    dport: u16,
}

impl Flow {
    fn reversed(self) -> Self {
        Flow {
            src: self.dst,
            dst: self.src,
            sport: self.dport,
            dport: self.sport,
            ..self
        }
    }

    fn is_v6(&self) -> bool {
        addr_is_v6(self.src)
    }
}

fn octets(a: IpAddr) -> Vec<u8> {
    match a {
        IpAddr::V4(a) => a.octets().to_vec(),
        IpAddr::V6(a) => a.octets().to_vec(),
    }
}

/// What a generated case is made of, kept to derive later cases (replies, ICMP errors).
struct Case {
    frame: Vec<u8>,
    prog: &'static str,
    /// Built without mutation: checksums right, lengths consistent.
    clean: bool,
    /// The flow, when the packet is a whole (unfragmented) clean TCP/UDP/SCTP packet.
    flow: Option<Flow>,
    /// Addresses that must all be uninvolved for invariant 1 (outer, and quoted for an ICMP
    /// error).
    addrs: Vec<IpAddr>,
}

struct Gen {
    rng: Rng,
    svcs: Vec<Svc>,
    backends: Vec<IpAddr>,
    /// Translated packets seen (hook, output frame's flow), newest last, bounded.
    recent: Vec<(bool, Flow, Vec<u8>)>,
}

const RECENT: usize = 64;

impl Gen {
    fn addr_pool(&mut self, v6: bool) -> IpAddr {
        let r = self.rng.below(100);
        let svc_addrs: Vec<(IpAddr, u16, u8)> = self
            .svcs
            .iter()
            .filter(|s| addr_is_v6(s.addr) == v6)
            .map(|s| (s.addr, s.port, protocol_number(s.protocol)))
            .collect();
        if r < 35 {
            self.rng.pick(&svc_addrs).0
        } else if r < 45 {
            // Inside the Service CIDR, no frontend.
            if v6 {
                v6_addr([0xfd00, 0x96, 0, 0, 0, 0, 0, 0x77])
            } else {
                v4(10, 96, 0, 77)
            }
        } else if r < 55 {
            let b: Vec<IpAddr> = self
                .backends
                .iter()
                .copied()
                .filter(|a| addr_is_v6(*a) == v6)
                .collect();
            *self.rng.pick(&b)
        } else if r < 75 {
            self.client(v6)
        } else {
            // Nowhere in particular (outside every Service range).
            if v6 {
                *self.rng.pick(&[
                    v6_addr([0x2001, 0xdb8, 0, 0, 0, 0, 0, 7]),
                    v6_addr([0xfd00, 0x244, 0, 0, 0, 0, 9, 9]),
                    v6_addr([0xfd00, 0x97, 0, 0, 0, 0, 0, 1]),
                ])
            } else {
                *self.rng.pick(&[
                    v4(192, 0, 2, 7),
                    v4(198, 51, 100, 9),
                    v4(10, 244, 9, 9),
                    v4(10, 97, 0, 1),
                ])
            }
        }
    }

    fn client(&mut self, v6: bool) -> IpAddr {
        if v6 {
            *self.rng.pick(&[
                v6_addr([0xfd00, 0x244, 0, 0, 0, 0, 1, 2]),
                v6_addr([0xfd00, 0x244, 0, 0, 0, 0, 3, 3]),
                v6_addr([0x2001, 0xdb8, 0x77, 0, 0, 0, 0, 5]),
            ])
        } else {
            *self
                .rng
                .pick(&[v4(10, 244, 1, 2), v4(10, 244, 3, 3), v4(203, 0, 113, 5)])
        }
    }

    /// A fresh flow: to a frontend (its own port and protocol, mostly), or anywhere.
    fn fresh_flow(&mut self) -> Flow {
        let v6 = self.rng.chance(45);
        let src = if self.rng.chance(85) {
            self.client(v6)
        } else {
            self.addr_pool(v6)
        };
        if self.rng.chance(55) {
            let fe: Vec<(IpAddr, u16, u8)> = self
                .svcs
                .iter()
                .filter(|s| addr_is_v6(s.addr) == v6)
                .map(|s| (s.addr, s.port, protocol_number(s.protocol)))
                .collect();
            let &(dst, port, p) = self.rng.pick(&fe);
            let sport = 1024 + self.rng.below(2000) as u16;
            return Flow {
                src,
                dst,
                proto: p,
                sport,
                dport: if self.rng.chance(90) {
                    port
                } else {
                    self.rng.port()
                },
            };
        }
        let dst = self.addr_pool(v6);
        let icmp = if v6 { ICMPV6 } else { ICMP };
        let p = *self
            .rng
            .pick(&[proto::TCP, proto::UDP, proto::SCTP, icmp, 47]);
        Flow {
            src,
            dst,
            proto: p,
            sport: self.rng.port(),
            dport: self.rng.port(),
        }
    }

    fn tcp_flags(&mut self) -> u8 {
        let any = self.rng.next() as u8;
        *self.rng.pick(&[
            0x02, 0x02, 0x12, 0x10, 0x10, 0x18, 0x11, 0x04, 0x14, 0x00, 0xff, 0x03, 0x06, 0x29, any,
        ])
    }

    /// The L4 segment of `f` with `payload`, its checksum right for the pseudo-header of `f`.
    fn segment(&mut self, f: &Flow, payload: &[u8]) -> Vec<u8> {
        let (s, d) = (octets(f.src), octets(f.dst));
        let mut seg = Vec::new();
        match f.proto {
            proto::TCP => {
                let opt_words = if self.rng.chance(20) {
                    self.rng.below(5) as usize
                } else {
                    0
                };
                seg.extend_from_slice(&f.sport.to_be_bytes());
                seg.extend_from_slice(&f.dport.to_be_bytes());
                seg.extend_from_slice(&(self.rng.next() as u32).to_be_bytes());
                seg.extend_from_slice(&(self.rng.next() as u32).to_be_bytes());
                let flags = self.tcp_flags();
                seg.extend_from_slice(&[((5 + opt_words as u8) << 4), flags, 0xfa, 0xf0]);
                seg.extend_from_slice(&[0, 0, 0, 0]);
                for _ in 0..opt_words {
                    seg.extend_from_slice(&[2, 4, 5, 0xb4]); // MSS
                }
                seg.extend_from_slice(payload);
                let c = internet_csum(&seg, pseudo_sum(&s, &d, proto::TCP, seg.len() as u32));
                seg[16..18].copy_from_slice(&c.to_be_bytes());
            }
            proto::UDP => {
                seg.extend_from_slice(&f.sport.to_be_bytes());
                seg.extend_from_slice(&f.dport.to_be_bytes());
                seg.extend_from_slice(&((8 + payload.len()) as u16).to_be_bytes());
                seg.extend_from_slice(&[0, 0]);
                seg.extend_from_slice(payload);
                if f.is_v6() || !self.rng.chance(10) {
                    let c =
                        match internet_csum(&seg, pseudo_sum(&s, &d, proto::UDP, seg.len() as u32))
                        {
                            0 => 0xffff,
                            c => c,
                        };
                    seg[6..8].copy_from_slice(&c.to_be_bytes());
                }
            }
            proto::SCTP => {
                seg.extend_from_slice(&f.sport.to_be_bytes());
                seg.extend_from_slice(&f.dport.to_be_bytes());
                seg.extend_from_slice(&(self.rng.next() as u32).to_be_bytes());
                seg.extend_from_slice(&[0, 0, 0, 0]);
                // One chunk: INIT, DATA, SACK, ABORT, SHUTDOWN, SHUTDOWN ACK, COOKIE ECHO, any.
                let any = self.rng.next() as u8;
                let kind = *self.rng.pick(&[1, 1, 0, 3, 6, 7, 8, 10, 14, any]);
                let body = payload.len().div_ceil(4) * 4;
                seg.extend_from_slice(&[kind, 0]);
                seg.extend_from_slice(&((4 + payload.len()) as u16).to_be_bytes());
                seg.extend_from_slice(payload);
                seg.resize(16 + body, 0);
                let c = crc32c(&seg).to_le_bytes();
                seg[8..12].copy_from_slice(&c);
            }
            ICMP | ICMPV6 => {
                let any = self.rng.next() as u8;
                let kind = if f.proto == ICMP {
                    *self.rng.pick(&[8, 0, 8, 13, any])
                } else {
                    *self.rng.pick(&[128, 129, 128, 135, any])
                };
                seg.extend_from_slice(&[kind, 0, 0, 0]);
                seg.extend_from_slice(&f.sport.to_be_bytes());
                seg.extend_from_slice(&f.dport.to_be_bytes());
                seg.extend_from_slice(payload);
                let acc = if f.proto == ICMPV6 {
                    pseudo_sum(&s, &d, ICMPV6, seg.len() as u32)
                } else {
                    0
                };
                let c = internet_csum(&seg, acc);
                seg[2..4].copy_from_slice(&c.to_be_bytes());
            }
            _ => seg.extend_from_slice(payload),
        }
        seg
    }

    /// An ICMP/ICMPv6 error from `src` to `dst` quoting `quoted` (an L3 packet), truncated.
    fn icmp_error(&mut self, src: IpAddr, dst: IpAddr, quoted: &[u8]) -> (u8, Vec<u8>) {
        let v6 = addr_is_v6(src);
        let keep = match self.rng.below(4) {
            0 => quoted.len(),
            1 => quoted.len().min(if v6 { 48 } else { 28 }),
            _ => self.rng.below(quoted.len() as u64 + 1) as usize,
        };
        let (kind, code, p) = if v6 {
            (
                *self.rng.pick(&[1, 1, 2, 3, 4]),
                self.rng.below(7) as u8,
                ICMPV6,
            )
        } else {
            (
                *self.rng.pick(&[3, 3, 11, 12]),
                self.rng.below(16) as u8,
                ICMP,
            )
        };
        let mut m = vec![kind, code, 0, 0];
        m.extend_from_slice(&if kind == 2 || (kind == 3 && code == 4 && !v6) {
            [0, 0, 0x05, 0x78] // MTU
        } else {
            [0, 0, 0, 0]
        });
        m.extend_from_slice(&quoted[..keep]);
        let acc = if v6 {
            pseudo_sum(&octets(src), &octets(dst), ICMPV6, m.len() as u32)
        } else {
            0
        };
        let c = internet_csum(&m, acc);
        m[2..4].copy_from_slice(&c.to_be_bytes());
        (p, m)
    }

    /// The L3 packet (IPv4 header with options and maybe a fragment of `upper`, or IPv6 with an
    /// extension chain) and whether it is fragmented.
    fn l3(&mut self, src: IpAddr, dst: IpAddr, p: u8, upper: &[u8]) -> (Vec<u8>, bool) {
        let fragment = self.rng.chance(12) && upper.len() > 8;
        match (src, dst) {
            (IpAddr::V4(s), IpAddr::V4(d)) => {
                let opts = if self.rng.chance(15) {
                    let words = 1 + self.rng.below(10) as usize;
                    let mut o = vec![1u8; words * 4]; // NOPs
                    if self.rng.chance(30) {
                        o[0] = 0x94; // Router Alert
                        o[1] = 4;
                        o[2] = 0;
                        o[3] = 0;
                    }
                    if self.rng.chance(30) {
                        let last = o.len() - 1;
                        o[last] = 0; // EOL
                    }
                    o
                } else {
                    Vec::new()
                };
                let (part, field) = if fragment {
                    let units = upper.len().div_ceil(8);
                    match self.rng.below(3) {
                        0 => {
                            let n = 1 + self.rng.below(units as u64 - 1) as usize;
                            (&upper[..(n * 8).min(upper.len())], 0x2000u16)
                        }
                        1 => {
                            let off = self.rng.below(units as u64) as usize;
                            let end = (off * 8 + 8).min(upper.len());
                            (&upper[off * 8..end], 0x2000 | off as u16)
                        }
                        _ => {
                            let off = 1 + self.rng.below(units as u64 - 1) as usize;
                            (&upper[(off * 8).min(upper.len())..], off as u16)
                        }
                    }
                } else if self.rng.chance(70) {
                    (upper, 0x4000)
                } else {
                    (upper, 0)
                };
                let ihl = 20 + opts.len();
                let mut ip = vec![0x40 | (ihl / 4) as u8, 0];
                ip.extend_from_slice(&((ihl + part.len()) as u16).to_be_bytes());
                ip.extend_from_slice(&(self.rng.next() as u16).to_be_bytes());
                ip.extend_from_slice(&field.to_be_bytes());
                ip.extend_from_slice(&[64, p, 0, 0]);
                ip.extend_from_slice(&s.octets());
                ip.extend_from_slice(&d.octets());
                ip.extend_from_slice(&opts);
                let c = internet_csum(&ip, 0);
                ip[10..12].copy_from_slice(&c.to_be_bytes());
                ip.extend_from_slice(part);
                (ip, fragment)
            }
            (IpAddr::V6(s), IpAddr::V6(d)) => {
                let mut ext = Vec::new();
                if self.rng.chance(20) {
                    let n = 1 + self.rng.below(3);
                    for i in 0..n {
                        match self.rng.below(3) {
                            0 if i == 0 => ext.push(Ext6::options(ext6::HOP_BY_HOP, 8)),
                            1 => ext.push(Ext6 {
                                kind: ext6::ROUTING,
                                body: vec![4, 0, 0, 0, 0, 0], // segments left 0
                            }),
                            _ => ext.push(Ext6::options(
                                ext6::DEST_OPTS,
                                8 * (1 + self.rng.below(2) as usize),
                            )),
                        }
                    }
                }
                let mut part = upper;
                if fragment {
                    let units = upper.len().div_ceil(8);
                    let id = self.rng.next() as u32;
                    let (off, more, range) = match self.rng.below(3) {
                        0 => {
                            let n = 1 + self.rng.below(units as u64 - 1) as usize;
                            (0, true, 0..(n * 8).min(upper.len()))
                        }
                        1 => {
                            let off = self.rng.below(units as u64) as usize;
                            (off, true, off * 8..(off * 8 + 8).min(upper.len()))
                        }
                        _ => {
                            let off = 1 + self.rng.below(units as u64 - 1) as usize;
                            (off, false, (off * 8).min(upper.len())..upper.len())
                        }
                    };
                    ext.push(Ext6::fragment(off as u16, more, id));
                    part = &upper[range];
                }
                let f = ipv6_packet([0; 6], [0; 6], s, d, 64, &ext, p, part);
                (f[ETH_HLEN..].to_vec(), fragment)
            }
            _ => unreachable!("mixed families"),
        }
    }

    /// Ethernet in front of `l3`, maybe with VLAN tags.
    fn frame(&mut self, l3: &[u8]) -> (Vec<u8>, bool) {
        let ethertype = if l3.first().is_some_and(|b| b >> 4 == 6) {
            ETH_P_IPV6
        } else {
            ETH_P_IP
        };
        let mut f = eth([2, 0, 0, 0, 0, 2], [2, 0, 0, 0, 0, 1], ethertype);
        let vlan = self.rng.chance(5);
        if vlan {
            f.truncate(12);
            if self.rng.chance(40) {
                f.extend_from_slice(&[0x88, 0xa8, 0, 7]); // QinQ outer tag
            }
            f.extend_from_slice(&[0x81, 0x00, 0, 42]);
            f.extend_from_slice(&ethertype.to_be_bytes());
        }
        f.extend_from_slice(l3);
        (f, vlan)
    }

    fn payload(&mut self) -> Vec<u8> {
        match self.rng.below(4) {
            0 => Vec::new(),
            1 => {
                let n = self.rng.below(8) as usize;
                self.rng.bytes(n)
            }
            _ => {
                let n = self.rng.below(120) as usize;
                self.rng.bytes(n)
            }
        }
    }

    fn case(&mut self) -> Case {
        let l3_device = self.rng.chance(15);
        let r = self.rng.below(100);
        let (ingress, flow, icmp_quote) = if r < 30 && !self.recent.is_empty() {
            // Follow a translated packet: its reply, its next packet, or an ICMP error about it.
            let (was_ingress, flow, frame) = self.rng.pick(&self.recent).clone();
            match self.rng.below(4) {
                0 | 1 => (!was_ingress, flow.reversed(), None),
                2 => (!was_ingress, flow, None),
                _ => {
                    let l3 = strip_l2(&frame).to_vec();
                    let v6 = flow.is_v6();
                    let src = if self.rng.chance(50) {
                        flow.dst
                    } else {
                        self.addr_pool(v6)
                    };
                    (
                        !was_ingress,
                        Flow {
                            src,
                            ..flow.reversed()
                        },
                        Some(l3),
                    )
                }
            }
        } else {
            (self.rng.chance(60), self.fresh_flow(), None)
        };
        let mut flow = flow;
        let mut addrs = vec![flow.src, flow.dst];
        let (p, upper, whole_flow) = if let Some(quoted) = icmp_quote {
            if let Some((s, d)) = l3_addrs(&quoted) {
                addrs.extend([s, d]);
            }
            let (p, m) = self.icmp_error(flow.src, flow.dst, &quoted);
            (p, m, false)
        } else if matches!(flow.proto, ICMP | ICMPV6) && self.rng.chance(50) {
            // An ICMP error quoting an arbitrary packet.
            let inner = self.fresh_flow();
            let inner = Flow {
                src: if inner.is_v6() == flow.is_v6() {
                    inner.src
                } else {
                    flow.dst
                },
                dst: if inner.is_v6() == flow.is_v6() {
                    inner.dst
                } else {
                    flow.src
                },
                ..inner
            };
            let payload = self.payload();
            let seg = self.segment(&inner, &payload);
            let (quoted, _) = self.l3(inner.src, inner.dst, inner.proto, &seg);
            if let Some((s, d)) = l3_addrs(&quoted) {
                addrs.extend([s, d]);
            }
            let (p, m) = self.icmp_error(flow.src, flow.dst, &quoted);
            flow.proto = p;
            (p, m, false)
        } else {
            let payload = self.payload();
            (
                flow.proto,
                self.segment(&flow, &payload),
                matches!(flow.proto, proto::TCP | proto::UDP | proto::SCTP),
            )
        };
        let (l3, fragmented) = self.l3(flow.src, flow.dst, p, &upper);
        let (mut frame, vlan) = if l3_device {
            (l3, false)
        } else {
            self.frame(&l3)
        };
        let clean = !self.mutate(&mut frame, l3_device);
        let prog = match (ingress, l3_device) {
            (true, false) => PROG_TC_INGRESS,
            (true, true) => PROG_TC_INGRESS_L3,
            (false, false) => PROG_TC_EGRESS,
            (false, true) => PROG_TC_EGRESS_L3,
        };
        // A flipped byte may have moved an address (into the Service CIDR, onto a backend): the
        // frame's own addresses count too.
        if let Some((s, d)) = l3_offset(&frame, prog).and_then(|off| l3_addrs(&frame[off..])) {
            addrs.extend([s, d]);
        }
        Case {
            frame,
            prog,
            clean,
            flow: (clean && whole_flow && !fragmented && !vlan).then_some(flow),
            addrs,
        }
    }

    /// Maybe damage `frame`; true if it did.
    fn mutate(&mut self, frame: &mut Vec<u8>, l3_device: bool) -> bool {
        if !self.rng.chance(25) {
            return false;
        }
        let l2 = if l3_device { 0 } else { ETH_HLEN };
        match self.rng.below(8) {
            // Truncated somewhere (most often inside the headers).
            0 | 1 => {
                let cut = if self.rng.chance(70) {
                    l2 + self.rng.below(70) as usize
                } else {
                    self.rng.below(frame.len() as u64) as usize
                };
                frame.truncate(cut.min(frame.len()));
            }
            // Bad IHL / version / lengths (checksum not fixed).
            2 => {
                if let Some(b) = frame.get_mut(l2) {
                    *b = (*b & 0xf0) | self.rng.below(16) as u8;
                }
            }
            3 => {
                let v6 = frame.get(l2).is_some_and(|b| b >> 4 == 6);
                let off = l2 + if v6 { 4 } else { 2 };
                let len = self.rng.next() as u16;
                if frame.len() >= off + 2 {
                    frame[off..off + 2].copy_from_slice(&len.to_be_bytes());
                }
            }
            // Random bytes flipped anywhere (headers mostly).
            4 | 5 => {
                for _ in 0..1 + self.rng.below(4) {
                    let limit = frame.len().min(l2 + 80) as u64;
                    if limit == 0 {
                        break;
                    }
                    let i = self.rng.below(limit) as usize;
                    frame[i] ^= 1 << self.rng.below(8);
                }
            }
            // Extra bytes after the IP packet.
            6 => {
                let n = 1 + self.rng.below(16) as usize;
                let extra = self.rng.bytes(n);
                frame.extend_from_slice(&extra);
            }
            // Pure noise behind an IP-ish start.
            _ => {
                let n = self.rng.below(100) as usize;
                let noise = self.rng.bytes(n);
                frame.truncate(l2 + 1.min(frame.len().saturating_sub(l2)));
                frame.extend_from_slice(&noise);
            }
        }
        true
    }
}

fn v6_addr(segs: [u16; 8]) -> IpAddr {
    v6(segs)
}

fn strip_l2(frame: &[u8]) -> &[u8] {
    &frame[ETH_HLEN.min(frame.len())..]
}

/// The source and destination of an L3 packet (IPv4 or IPv6), if its header is there.
fn l3_addrs(l3: &[u8]) -> Option<(IpAddr, IpAddr)> {
    match l3.first()? >> 4 {
        4 if l3.len() >= 20 => Some((
            IpAddr::V4(Ipv4Addr::from(<[u8; 4]>::try_from(&l3[12..16]).ok()?)),
            IpAddr::V4(Ipv4Addr::from(<[u8; 4]>::try_from(&l3[16..20]).ok()?)),
        )),
        6 if l3.len() >= 40 => Some((
            IpAddr::V6(Ipv6Addr::from(<[u8; 16]>::try_from(&l3[8..24]).ok()?)),
            IpAddr::V6(Ipv6Addr::from(<[u8; 16]>::try_from(&l3[24..40]).ok()?)),
        )),
        _ => None,
    }
}

// ---------------------------------------------------------------- the invariants

/// An address a Service, a backend, the node or hairpin SNAT uses (the datapath may rewrite a
/// packet that carries one).
fn involved(a: IpAddr, svcs: &[Svc], backends: &[IpAddr]) -> bool {
    let in_range = match a {
        IpAddr::V4(x) => {
            let o = x.octets();
            (o[0] == 10 && o[1] == 96) || o == HAIRPIN_SNAT_ADDR || o[0] == 169
        }
        IpAddr::V6(x) => {
            let s = x.segments();
            (s[0] == 0xfd00 && s[1] == 0x96) || (s[0] & 0xffc0) == 0xfe80
        }
    };
    in_range
        || a == IpAddr::V4(NODE4)
        || a == IpAddr::V6(NODE6)
        || svcs.iter().any(|s| s.addr == a)
        || backends.contains(&a)
}

/// Where the L3 header of `frame` starts for program `prog` (None: VLAN or not IP: the
/// datapath does not parse it).
fn l3_offset(frame: &[u8], prog: &str) -> Option<usize> {
    if prog == PROG_TC_INGRESS_L3 || prog == PROG_TC_EGRESS_L3 {
        return Some(0);
    }
    let et = u16::from_be_bytes([*frame.get(12)?, *frame.get(13)?]);
    (et == ETH_P_IP || et == ETH_P_IPV6).then_some(ETH_HLEN)
}

/// The checksum facts of one packet that a correct translation keeps.
#[derive(Debug, PartialEq, Eq)]
struct Sums {
    /// IPv4 header residual (None: IPv6 or header not all there).
    ip: Option<u16>,
    /// L4 residual over the bytes present (pseudo-header with the header's length) for
    /// TCP/UDP/ICMP/ICMPv6 of a packet carrying the L4 header; None otherwise.
    l4: Option<u16>,
    /// UDP/IPv4 checksum field 0 ("none").
    udp_none: bool,
    /// SCTP CRC32c valid (whole packets only).
    sctp_ok: Option<bool>,
    /// Quoted IPv4 header residual of an ICMP error.
    inner_ip: Option<u16>,
}

fn sums(l3: &[u8]) -> Option<Sums> {
    let version = l3.first()? >> 4;
    let (src, dst, mut next, mut off, end, later_fragment, frag) = if version == 4 {
        let ihl = ((l3[0] & 0x0f) as usize) * 4;
        if ihl < 20 || l3.len() < ihl {
            return Some(Sums {
                ip: None,
                l4: None,
                udp_none: false,
                sctp_ok: None,
                inner_ip: None,
            });
        }
        let tot = u16::from_be_bytes([l3[2], l3[3]]) as usize;
        let field = u16::from_be_bytes([l3[6], l3[7]]);
        (
            l3[12..16].to_vec(),
            l3[16..20].to_vec(),
            l3[9],
            ihl,
            tot.clamp(ihl, l3.len().max(ihl)).min(l3.len()),
            field & 0x1fff != 0,
            field & 0x3fff != 0,
        )
    } else if version == 6 && l3.len() >= 40 {
        let plen = u16::from_be_bytes([l3[4], l3[5]]) as usize;
        (
            l3[8..24].to_vec(),
            l3[24..40].to_vec(),
            l3[6],
            40,
            (40 + plen).min(l3.len()),
            false,
            false,
        )
    } else {
        return None;
    };
    let ip = (version == 4).then(|| norm(ones_sum(&l3[..off], 0)));
    let (mut later_fragment, mut frag) = (later_fragment, frag);
    if version == 6 {
        for _ in 0..8 {
            if !matches!(next, 0 | 43 | 44 | 60) || off + 8 > end {
                break;
            }
            let len = if next == 44 {
                let field = u16::from_be_bytes([l3[off + 2], l3[off + 3]]);
                later_fragment |= field >> 3 != 0;
                frag = true;
                8
            } else {
                (l3[off + 1] as usize + 1) * 8
            };
            next = l3[off];
            off += len;
        }
    }
    let mut out = Sums {
        ip,
        l4: None,
        udp_none: false,
        sctp_ok: None,
        inner_ip: None,
    };
    if later_fragment || off > end {
        return Some(out);
    }
    let seg = &l3[off..end];
    let claimed = if version == 4 {
        (u16::from_be_bytes([l3[2], l3[3]]) as usize).saturating_sub(off)
    } else {
        (u16::from_be_bytes([l3[4], l3[5]]) as usize + 40).saturating_sub(off)
    } as u32;
    match next {
        proto::TCP | proto::UDP | ICMPV6 => {
            out.l4 = Some(norm(ones_sum(seg, pseudo_sum(&src, &dst, next, claimed))));
            out.udp_none =
                version == 4 && next == proto::UDP && seg.len() >= 8 && seg[6..8] == [0, 0];
        }
        ICMP if version == 4 => {
            out.l4 = Some(norm(ones_sum(seg, 0)));
            if seg.len() >= 8 + 20 && seg[8] >> 4 == 4 {
                let ihl = ((seg[8] & 0x0f) as usize) * 4;
                if ihl >= 20 && seg.len() >= 8 + ihl {
                    out.inner_ip = Some(norm(ones_sum(&seg[8..8 + ihl], 0)));
                }
            }
        }
        proto::SCTP if !frag => out.sctp_ok = Some(sctp_crc_ok(seg)),
        _ => {}
    }
    Some(out)
}

/// The answer (ICMP error or TCP RST) a program redirected: all its checksums verify.
fn answer_ok(l3: &[u8]) -> Result<(), String> {
    let s = sums(l3).ok_or("answer is not IP")?;
    if s.ip.is_some_and(|r| r != 0) {
        return Err(format!("answer's IPv4 header checksum residual {:?}", s.ip));
    }
    if s.l4 != Some(0) {
        return Err(format!("answer's L4 checksum residual {:?}", s.l4));
    }
    Ok(())
}

fn hex(b: &[u8]) -> String {
    let mut s = String::with_capacity(b.len() * 2);
    for x in b {
        let _ = write!(s, "{x:02x}");
    }
    s
}

/// Checks one run; Err(message) names the broken invariant.
fn check(case: &Case, verdict: u32, out: &[u8], uninvolved: bool) -> Result<(), String> {
    let ingress = case.prog == PROG_TC_INGRESS || case.prog == PROG_TC_INGRESS_L3;
    let allowed =
        verdict == TC_NEXT || verdict == TC_ACT_SHOT || (ingress && verdict == TC_ACT_REDIRECT);
    if !allowed {
        return Err(format!(
            "verdict {verdict} is not one this program may return"
        ));
    }
    if uninvolved && (verdict != TC_NEXT || out != case.frame) {
        return Err(format!(
            "a packet involving no Service came out changed (verdict {verdict}, output {})",
            hex(out)
        ));
    }
    if verdict == TC_ACT_REDIRECT {
        if case.clean {
            let off = l3_offset(out, case.prog).ok_or("answer is not IP")?;
            answer_ok(&out[off..])?;
        }
        return Ok(());
    }
    if verdict != TC_NEXT || out == case.frame {
        return Ok(());
    }
    if out.len() != case.frame.len() {
        return Err(format!(
            "passed packet changed length {} → {}",
            case.frame.len(),
            out.len()
        ));
    }
    let off = l3_offset(&case.frame, case.prog)
        .ok_or("a packet the datapath does not parse (VLAN, not IP) was modified")?;
    if out[..off] != case.frame[..off] {
        return Err("the Ethernet header of a passed packet was modified".into());
    }
    let (Some(before), Some(after)) = (sums(&case.frame[off..]), sums(&out[off..])) else {
        return Err("a packet without an IP header was modified".into());
    };
    if before.ip != after.ip {
        return Err(format!(
            "IPv4 header checksum residual {:?} → {:?}",
            before.ip, after.ip
        ));
    }
    if before.udp_none {
        if !after.udp_none {
            return Err("a UDP checksum of 0 (none) was rewritten".into());
        }
    } else if before.l4 != after.l4 {
        return Err(format!(
            "L4 checksum residual {:?} → {:?}",
            before.l4, after.l4
        ));
    }
    if before.sctp_ok == Some(true) && after.sctp_ok != Some(true) {
        return Err("a valid SCTP CRC32c became invalid".into());
    }
    if before.inner_ip != after.inner_ip {
        return Err(format!(
            "quoted IPv4 header checksum residual {:?} → {:?}",
            before.inner_ip, after.inner_ip
        ));
    }
    Ok(())
}

fn map_data(map: &aya::maps::Map) -> &MapData {
    match map {
        aya::maps::Map::HashMap(m) | aya::maps::Map::LruHashMap(m) => m,
        _ => panic!("not a hash map"),
    }
}

/// The entries of a hash map of the object and its max_entries.
fn fill<K: aya::Pod, V: aya::Pod>(bpf: &Ebpf, name: &str) -> (usize, u32) {
    let map = bpf.map(name).unwrap_or_else(|| panic!("map {name}"));
    let h: HashMap<&MapData, K, V> =
        HashMap::try_from(map).unwrap_or_else(|e| panic!("map {name}: {e}"));
    let max = map_data(map).info().expect("map info").max_entries();
    (h.keys().count(), max)
}

/// Invariant 4 after `packets` packets: (map, entries, max, most the packets could create).
fn map_bounds(bpf: &Ebpf, packets: u64) -> Vec<(&'static str, usize, u32, u64)> {
    vec![
        (MAP_CONNTRACK, fill::<CtKey, CtValue>(bpf, MAP_CONNTRACK), 2),
        (
            MAP_CONNTRACK6,
            fill::<Ct6Key, Ct6Value>(bpf, MAP_CONNTRACK6),
            2,
        ),
        (MAP_SNAT, fill::<SnatKey, SnatValue>(bpf, MAP_SNAT), 2),
        (MAP_SNAT6, fill::<Ct6Key, Snat6Value>(bpf, MAP_SNAT6), 2),
        (
            MAP_AFFINITY,
            fill::<AffinityKey, AffinityValue>(bpf, MAP_AFFINITY),
            1,
        ),
        (
            MAP_AFFINITY6,
            fill::<Affinity6Key, AffinityValue>(bpf, MAP_AFFINITY6),
            1,
        ),
        (
            MAP_FRAGMENTS,
            fill::<FragKey, FragValue>(bpf, MAP_FRAGMENTS),
            1,
        ),
        (
            MAP_FRAGMENTS6,
            fill::<Frag6Key, Frag6Value>(bpf, MAP_FRAGMENTS6),
            1,
        ),
    ]
    .into_iter()
    .map(|(name, (n, max), per)| (name, n, max, per * packets))
    .collect()
}

fn env_u64(name: &str, default: u64) -> u64 {
    match std::env::var(name) {
        Ok(v) => {
            let v = v.trim();
            let parsed = match v.strip_prefix("0x") {
                Some(h) => u64::from_str_radix(h, 16),
                None => v.parse(),
            };
            parsed.unwrap_or_else(|e| panic!("{name}={v}: not a number ({e})"))
        }
        Err(_) => default,
    }
}

/// The parsed flow of a translated output (for later cases), if it is a whole TCP/UDP/SCTP packet.
fn flow_of(out: &[u8], prog: &str, proto_: u8) -> Option<Flow> {
    let off = l3_offset(out, prog)?;
    let l3 = &out[off..];
    let (src, dst) = l3_addrs(l3)?;
    let l4 = if l3[0] >> 4 == 4 {
        ((l3[0] & 0x0f) as usize) * 4
    } else {
        if l3[6] != proto_ {
            return None;
        }
        40
    };
    let ports = l3.get(l4..l4 + 4)?;
    Some(Flow {
        src,
        dst,
        proto: proto_,
        sport: u16::from_be_bytes([ports[0], ports[1]]),
        dport: u16::from_be_bytes([ports[2], ports[3]]),
    })
}

#[test]
fn random_and_mutated_packets_keep_the_datapath_invariants() {
    require_privileged!();
    let seed = env_u64("KPE_FUZZ_SEED", DEFAULT_SEED);
    let packets = env_u64("KPE_FUZZ_PACKETS", DEFAULT_PACKETS);
    println!(
        "fuzz: seed {seed:#x}, {packets} packets (KPE_FUZZ_SEED={seed:#x} KPE_FUZZ_PACKETS={packets})"
    );
    let svcs = cluster();
    let (bpf, maps4, maps6) = load(&svcs);
    let service_entries = (
        maps4.services().len(),
        maps4.affinity_matches().len(),
        maps6.services().len(),
        maps6.affinity_matches().len(),
    );
    let backends = backend_addrs(&svcs);
    let mut generator = Gen {
        rng: Rng(seed),
        svcs: cluster(),
        backends: backends.clone(),
        recent: Vec::new(),
    };
    let mut verdicts: BTreeMap<String, u64> = BTreeMap::new();
    let mut per_prog: BTreeMap<&str, u64> = BTreeMap::new();
    let (mut refused, mut modified, mut uninvolved_n) = (0u64, 0u64, 0u64);
    let started = Instant::now();
    let mut run_time = std::time::Duration::ZERO;
    for i in 0..packets {
        let case = generator.case();
        let uninvolved = !case.addrs.iter().any(|a| involved(*a, &svcs, &backends));
        let t = Instant::now();
        let result = common_datapath::try_run(&bpf, case.prog, &case.frame, 1);
        run_time += t.elapsed();
        let (verdict, out) = match result {
            Ok((v, out, _)) => (v, out),
            // The kernel's test harness refuses frames shorter than the headers it reads
            // itself (Ethernet, and the IPv4/IPv6 header its EtherType names).
            Err(_) if case.frame.len() < ETH_HLEN + 40 => {
                refused += 1;
                continue;
            }
            Err(e) => panic!(
                "fuzz seed {seed:#x} case {i}: BPF_PROG_TEST_RUN of {} failed: {e:#?}\n  input {}",
                case.prog,
                hex(&case.frame)
            ),
        };
        if let Err(why) = check(&case, verdict, &out, uninvolved) {
            panic!(
                "fuzz seed {seed:#x} case {i} ({}): {why}\n  input  {}\n  output {}\n  reproduce: KPE_FUZZ_SEED={seed:#x} KPE_FUZZ_PACKETS={}",
                case.prog,
                hex(&case.frame),
                hex(&out),
                i + 1
            );
        }
        *per_prog.entry(case.prog).or_default() += 1;
        *verdicts
            .entry(match verdict {
                TC_NEXT => "pass (TCX_NEXT)".into(),
                TC_ACT_SHOT => "drop (SHOT)".into(),
                TC_ACT_REDIRECT => "redirect".into(),
                v => format!("{v}"),
            })
            .or_default() += 1;
        uninvolved_n += uninvolved as u64;
        if verdict == TC_NEXT && out != case.frame {
            modified += 1;
            if let Some(f) = case.flow
                && let Some(out_flow) = flow_of(&out, case.prog, f.proto)
            {
                let ingress = case.prog == PROG_TC_INGRESS || case.prog == PROG_TC_INGRESS_L3;
                if generator.recent.len() == RECENT {
                    generator.recent.remove(0);
                }
                generator.recent.push((ingress, out_flow, out.clone()));
            }
        } else if verdict == TC_NEXT
            && let Some(f) = case.flow
            && generator.rng.chance(10)
        {
            // An untranslated clean packet: its reply and next packets are cases too.
            let ingress = case.prog == PROG_TC_INGRESS || case.prog == PROG_TC_INGRESS_L3;
            if generator.recent.len() == RECENT {
                generator.recent.remove(0);
            }
            generator.recent.push((ingress, f, out.clone()));
        }
        if (i + 1) % 5_000 == 0 || i + 1 == packets || i == 300 {
            for (name, n, max, most) in map_bounds(&bpf, i + 1) {
                assert!(
                    n as u64 <= max as u64 && n as u64 <= most,
                    "fuzz seed {seed:#x} after case {i}: {name} holds {n} entries (max_entries {max}, at most {most} from the packets)"
                );
            }
            let now = (
                maps4.services().len(),
                maps4.affinity_matches().len(),
                maps6.services().len(),
                maps6.affinity_matches().len(),
            );
            assert_eq!(
                now, service_entries,
                "fuzz seed {seed:#x} after case {i}: the datapath changed the number of entries of the maps only userspace writes (SERVICES, AFFMATCH, both families)"
            );
        }
    }
    let secs = started.elapsed().as_secs_f64();
    let ran = packets - refused;
    println!(
        "fuzz: {ran} packets run ({refused} refused by BPF_PROG_TEST_RUN as too short) in {secs:.1} s: {:.0} packets/s overall, {:.0} packets/s in BPF_PROG_TEST_RUN",
        ran as f64 / secs,
        ran as f64 / run_time.as_secs_f64()
    );
    println!("fuzz: per verdict {verdicts:?}");
    println!("fuzz: per program {per_prog:?}");
    println!(
        "fuzz: {modified} passed modified (translated), {uninvolved_n} involved no Service (byte-identical)"
    );
    for (name, n, max, _) in map_bounds(&bpf, packets) {
        println!("fuzz: {name} {n}/{max} entries");
    }
    let counters = common_datapath::counters(&bpf);
    let nonzero: BTreeMap<_, _> = counters.into_iter().filter(|(_, n)| *n > 0).collect();
    println!("fuzz: datapath counters {nonzero:?}");
}
