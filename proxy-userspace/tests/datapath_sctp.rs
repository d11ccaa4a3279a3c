//! SCTP datapath table tests, IPv4 and IPv6 (the association tables run on both families): the
//! real eBPF object run with BPF_PROG_TEST_RUN. Each step is {packet in, verdict, packet out};
//! every translated packet's CRC32c is recomputed here (`proxy_common::crc32c::checksum`,
//! checked against the standard vectors in its unit tests) and compared byte for byte with the
//! packet built with the translated fields.
//!
//! Privileged (root). Run:
//! `cargo test -p proxy-userspace --test datapath_sctp -- --test-threads=1 --nocapture`

mod common_datapath;
mod common_packet;

use std::{
    collections::BTreeMap,
    net::{IpAddr, Ipv4Addr, Ipv6Addr},
};

use aya::{
    Ebpf,
    maps::{HashMap, MapData},
};
use common_datapath::{TC_ACT_REDIRECT, TC_ACT_SHOT, TC_NEXT};
use common_packet::{
    CLIENT_MAC, Decoded, Decoded6, ETH_HLEN, ETH_P_IP, ETH_P_IPV6, Ext6, HOST_MAC, ICMPV6, eth,
    icmp6_frame, ipv6_packet,
};
use kube_proxy_ebpf::dataplane::maps::Node6Map;
use proxy_common::{
    Backend, Counter, CtKey, CtValue, DatapathConfig, MAP_BACKENDS, MAP_CONNTRACK, MAP_SERVICES,
    MAP_SNAT, PROG_TC_EGRESS, PROG_TC_INGRESS, ServiceKey, ServiceValue, SnatKey, SnatValue,
    backend_flags, crc32c, csum, ct_dir, ct_state,
    flow_state::sctp_chunk as chunk,
    ipv6::{
        Backend6, Ct6Key, Ct6Value, MAP_BACKENDS6, MAP_CONNTRACK6, MAP_SERVICES6, MAP_SNAT6,
        Service6Key, Snat6Key, Snat6Value,
    },
    proto, service_flags,
};

const CLIENT: Ipv4Addr = Ipv4Addr::new(10, 244, 1, 2);
/// A ClusterIP with SCTP :3868 → backend 21 on :3869 (a port rewrite: the CRC32c changes) and
/// SCTP :9000 → backend 22 on :9000 (address-only: the CRC32c stays as it is).
const VIP: Ipv4Addr = Ipv4Addr::new(10, 96, 0, 30);
const VIP_EMPTY: Ipv4Addr = Ipv4Addr::new(10, 96, 0, 99);
const BE_21: Ipv4Addr = Ipv4Addr::new(10, 244, 1, 21);
const BE_22: Ipv4Addr = Ipv4Addr::new(10, 244, 2, 22);
const NODE_IP: Ipv4Addr = Ipv4Addr::new(192, 168, 50, 10);
const NODE_PORT: u16 = 30868;
const EXT_CLIENT: Ipv4Addr = Ipv4Addr::new(192, 168, 50, 100);
const REMOTE_BE: Ipv4Addr = Ipv4Addr::new(10, 244, 2, 20);

/// The addresses of one family's tables (the same Services on IPv4 and IPv6).
#[derive(Clone, Copy)]
struct Family {
    client: IpAddr,
    vip: IpAddr,
    vip_empty: IpAddr,
    be_21: IpAddr,
    be_22: IpAddr,
}

const V4: Family = Family {
    client: IpAddr::V4(CLIENT),
    vip: IpAddr::V4(VIP),
    vip_empty: IpAddr::V4(VIP_EMPTY),
    be_21: IpAddr::V4(BE_21),
    be_22: IpAddr::V4(BE_22),
};

const V6: Family = Family {
    client: IpAddr::V6(Ipv6Addr::new(0xfd00, 0x244, 1, 0, 0, 0, 0, 2)),
    vip: IpAddr::V6(Ipv6Addr::new(0xfd00, 0x96, 0, 0, 0, 0, 0, 0x30)),
    vip_empty: IpAddr::V6(Ipv6Addr::new(0xfd00, 0x96, 0, 0, 0, 0, 0, 0x99)),
    be_21: IpAddr::V6(Ipv6Addr::new(0xfd00, 0x244, 1, 0, 0, 0, 0, 0x21)),
    be_22: IpAddr::V6(Ipv6Addr::new(0xfd00, 0x244, 2, 0, 0, 0, 0, 0x22)),
};

/// An SCTP packet with one chunk (and any bundled behind it), over IPv4 or IPv6 and Ethernet,
/// built with a valid CRC32c.
#[derive(Clone, Debug)]
struct Sctp {
    saddr: IpAddr,
    daddr: IpAddr,
    sport: u16,
    dport: u16,
    vtag: u32,
    chunk: u8,
    /// Chunk value (padded to 4 bytes by the builder).
    value: Vec<u8>,
    /// Raw IPv4 flags + fragment offset.
    frag: u16,
    /// IPv6 extension headers.
    ext: Vec<Ext6>,
    /// Chunks bundled after the first: (type, value).
    bundled: Vec<(u8, Vec<u8>)>,
    /// CRC32c field 0, as the stack leaves it for offload (CHECKSUM_PARTIAL).
    crc_left_to_offload: bool,
}

impl Sctp {
    fn new(
        saddr: impl Into<IpAddr>,
        sport: u16,
        daddr: impl Into<IpAddr>,
        dport: u16,
        chunk: u8,
    ) -> Self {
        Self {
            saddr: saddr.into(),
            daddr: daddr.into(),
            sport,
            dport,
            vtag: if chunk == chunk::INIT { 0 } else { 0x1122_3344 },
            chunk,
            value: b"sctp chunk value".to_vec(),
            frag: 0x4000,
            ext: Vec::new(),
            bundled: Vec::new(),
            crc_left_to_offload: false,
        }
    }

    /// The same packet with its CRC32c left to offload (field 0).
    fn crc_left_to_offload(mut self) -> Self {
        self.crc_left_to_offload = true;
        self
    }

    /// The same packet with a chunk of `chunk` type bundled behind its chunks.
    fn bundle(mut self, chunk: u8, value: &[u8]) -> Self {
        self.bundled.push((chunk, value.to_vec()));
        self
    }

    fn value(mut self, value: &[u8]) -> Self {
        self.value = value.to_vec();
        self
    }

    fn to(&self, addr: impl Into<IpAddr>, port: u16) -> Self {
        Self {
            daddr: addr.into(),
            dport: port,
            ..self.clone()
        }
    }

    fn from(&self, addr: impl Into<IpAddr>, port: u16) -> Self {
        Self {
            saddr: addr.into(),
            sport: port,
            ..self.clone()
        }
    }

    /// The other direction, same chunk kind unless changed.
    fn reversed(&self, chunk: u8) -> Self {
        Self {
            saddr: self.daddr,
            daddr: self.saddr,
            sport: self.dport,
            dport: self.sport,
            chunk,
            ..self.clone()
        }
    }

    /// The SCTP packet (common header + the chunk), CRC32c in place.
    fn sctp_bytes(&self) -> Vec<u8> {
        let mut s = Vec::new();
        s.extend_from_slice(&self.sport.to_be_bytes());
        s.extend_from_slice(&self.dport.to_be_bytes());
        s.extend_from_slice(&self.vtag.to_be_bytes());
        s.extend_from_slice(&[0; 4]);
        for (chunk, value) in std::iter::once((self.chunk, &self.value))
            .chain(self.bundled.iter().map(|(c, v)| (*c, v)))
        {
            s.push(chunk);
            s.push(0);
            s.extend_from_slice(&((4 + value.len()) as u16).to_be_bytes());
            s.extend_from_slice(value);
            s.resize(s.len().div_ceil(4) * 4, 0);
        }
        if !self.crc_left_to_offload {
            let field = crc32c::checksum(&s).to_le_bytes();
            s[8..12].copy_from_slice(&field);
        }
        s
    }

    fn bytes(&self) -> Vec<u8> {
        let sctp = self.sctp_bytes();
        let (saddr, daddr) = match (self.saddr, self.daddr) {
            (IpAddr::V4(s), IpAddr::V4(d)) => (s, d),
            (IpAddr::V6(s), IpAddr::V6(d)) => {
                return ipv6_packet(
                    HOST_MAC,
                    CLIENT_MAC,
                    s,
                    d,
                    64,
                    &self.ext,
                    proto::SCTP,
                    &sctp,
                );
            }
            _ => panic!("{self:?}: addresses of two families"),
        };
        let mut ip = vec![0x45, 0];
        ip.extend_from_slice(&((20 + sctp.len()) as u16).to_be_bytes());
        ip.extend_from_slice(&0x4321u16.to_be_bytes());
        ip.extend_from_slice(&self.frag.to_be_bytes());
        ip.extend_from_slice(&[64, proto::SCTP, 0, 0]);
        ip.extend_from_slice(&saddr.octets());
        ip.extend_from_slice(&daddr.octets());
        let c = csum::ipv4_header(&ip).to_be_bytes();
        ip[10..12].copy_from_slice(&c);
        let mut f = eth(HOST_MAC, CLIENT_MAC, ETH_P_IP);
        f.extend_from_slice(&ip);
        f.extend_from_slice(&sctp);
        f
    }
}

fn is_ipv6(frame: &[u8]) -> bool {
    u16::from_be_bytes([frame[12], frame[13]]) == ETH_P_IPV6
}

/// The SCTP packet (IPv4 or IPv6 payload) of `frame`.
fn sctp_of(frame: &[u8]) -> Vec<u8> {
    if is_ipv6(frame) {
        Decoded6::parse(frame).l4
    } else {
        Decoded::parse(frame).l4
    }
}

/// The CRC32c of the SCTP packet in `frame` verifies.
fn crc_ok(frame: &[u8]) -> bool {
    let mut s = sctp_of(frame);
    let field: [u8; 4] = s[8..12].try_into().unwrap();
    s[8..12].copy_from_slice(&[0; 4]);
    crc32c::checksum(&s).to_le_bytes() == field
}

/// The conntrack entry fields these tests read, either family.
struct Entry {
    state: u8,
    created_ns: u64,
    frontend_addr: Vec<u8>,
    frontend_port: u16,
    backend_id: u32,
}

/// [`Datapath::entry`] in one family's map: the IPv4 and IPv6 conntrack keys and values have
/// the same fields, only the address widths differ.
macro_rules! sctp_entry {
    ($dp:expr, $map:expr, $key:ident, $value:ident, $s:expr, $d:expr, $sport:expr, $dport:expr, $dir:expr) => {{
        let key = $key {
            saddr: $s.octets(),
            daddr: $d.octets(),
            sport: $sport.to_be_bytes(),
            dport: $dport.to_be_bytes(),
            proto: proto::SCTP,
            dir: $dir,
            _pad: [0; 2],
        };
        $dp.map::<$key, $value>($map)
            .get(&key, 0)
            .ok()
            .map(|c| Entry {
                state: c.state,
                created_ns: c.created_ns,
                frontend_addr: c.frontend_addr.to_vec(),
                frontend_port: u16::from_be_bytes(c.frontend_port),
                backend_id: c.backend_id,
            })
    }};
}

struct Datapath {
    bpf: Ebpf,
}

impl Datapath {
    fn load() -> Self {
        let maps = [
            MAP_SERVICES,
            MAP_BACKENDS,
            MAP_CONNTRACK,
            MAP_SERVICES6,
            MAP_BACKENDS6,
            MAP_CONNTRACK6,
        ];
        Self {
            bpf: common_datapath::load_object(&DatapathConfig::DEFAULT, None, &maps, 4096),
        }
    }

    /// The SCTP ClusterIP frontends (see [`VIP`]) and an empty one, on both families.
    fn with_services() -> Self {
        let mut dp = Self::load();
        for f in [V4, V6] {
            dp.set_family_frontend(f.vip, 3868, 1, &[(21, f.be_21, 3869)]);
            dp.set_family_frontend(f.vip, 9000, 2, &[(22, f.be_22, 9000)]);
            dp.set_family_frontend(f.vip_empty, 3868, 3, &[]);
        }
        dp
    }

    /// A ClusterIP frontend of either family (no flags).
    fn set_family_frontend(
        &mut self,
        addr: IpAddr,
        port: u16,
        rev_nat_id: u32,
        backends: &[(u32, IpAddr, u16)],
    ) {
        self.set_family_frontend_with_flags(addr, port, 0, rev_nat_id, backends);
    }

    /// A frontend of either family with `service_flags` `flags`.
    fn set_family_frontend_with_flags(
        &mut self,
        addr: IpAddr,
        port: u16,
        flags: u16,
        rev_nat_id: u32,
        backends: &[(u32, IpAddr, u16)],
    ) {
        let IpAddr::V6(addr) = addr else {
            let IpAddr::V4(addr) = addr else {
                unreachable!()
            };
            let v4: Vec<_> = backends
                .iter()
                .map(|&(id, b, port)| match b {
                    IpAddr::V4(b) => (id, b, port, 0),
                    IpAddr::V6(_) => panic!("an IPv6 backend of an IPv4 frontend"),
                })
                .collect();
            return self.set_frontend(addr, port, flags, rev_nat_id, &v4);
        };
        let key = Service6Key::new(addr.octets(), port.to_be_bytes(), proto::SCTP, 0);
        for (i, &(id, baddr, bport)) in backends.iter().enumerate() {
            let IpAddr::V6(baddr) = baddr else {
                panic!("an IPv4 backend of an IPv6 frontend")
            };
            let b = Backend6 {
                addr: baddr.octets(),
                port: bport.to_be_bytes(),
                proto: proto::SCTP,
                flags: 0,
            };
            self.map::<u32, Backend6>(MAP_BACKENDS6)
                .insert(id, b, 0)
                .expect("insert IPv6 backend");
            self.map::<Service6Key, ServiceValue>(MAP_SERVICES6)
                .insert(key.with_slot(i as u16 + 1), ServiceValue::slot(id), 0)
                .expect("insert IPv6 slot");
        }
        let fe = ServiceValue::frontend_with_flags(backends.len() as u16, rev_nat_id, flags);
        self.map::<Service6Key, ServiceValue>(MAP_SERVICES6)
            .insert(key, fe, 0)
            .expect("insert IPv6 frontend");
    }

    fn set_frontend(
        &mut self,
        addr: Ipv4Addr,
        port: u16,
        flags: u16,
        rev_nat_id: u32,
        backends: &[(u32, Ipv4Addr, u16, u8)],
    ) {
        let key = ServiceKey::new(addr.octets(), port.to_be_bytes(), proto::SCTP, 0);
        for (i, (id, baddr, bport, bflags)) in backends.iter().enumerate() {
            let b = Backend {
                addr: baddr.octets(),
                port: bport.to_be_bytes(),
                proto: proto::SCTP,
                flags: *bflags,
            };
            self.map::<u32, Backend>(MAP_BACKENDS)
                .insert(*id, b, 0)
                .expect("insert backend");
            self.map::<ServiceKey, ServiceValue>(MAP_SERVICES)
                .insert(key.with_slot(i as u16 + 1), ServiceValue::slot(*id), 0)
                .expect("insert slot");
        }
        let fe = ServiceValue::frontend_with_flags(backends.len() as u16, rev_nat_id, flags);
        self.map::<ServiceKey, ServiceValue>(MAP_SERVICES)
            .insert(key, fe, 0)
            .expect("insert frontend");
    }

    fn map<K: aya::Pod, V: aya::Pod>(&mut self, name: &str) -> HashMap<&mut MapData, K, V> {
        HashMap::try_from(self.bpf.map_mut(name).expect(name)).expect(name)
    }

    fn set_node_addr(&mut self, addr: Ipv4Addr) {
        common_datapath::set_node_addr(&mut self.bpf, addr);
    }

    fn run(&self, prog: &str, input: &[u8]) -> (u32, Vec<u8>) {
        common_datapath::run(&self.bpf, prog, input)
    }

    fn counters(&self) -> BTreeMap<&'static str, u64> {
        common_datapath::counters(&self.bpf)
    }

    /// Run `input` through `prog` (on a CHECKSUM_COMPLETE skb whose `skb->csum` must stay
    /// right); the verdict must be `verdict`, the output `want` byte for byte (a valid IPv4
    /// checksum, on IPv4, and CRC32c), and `counter` must have moved by one.
    fn step(
        &self,
        what: &str,
        prog: &str,
        input: &Sctp,
        verdict: u32,
        want: Option<&Sctp>,
        counter: Counter,
    ) -> Vec<u8> {
        let before = self.counters();
        let (v, out, _) =
            common_datapath::try_run_checked(&self.bpf, prog, &input.bytes(), verdict)
                .unwrap_or_else(|e| panic!("{what}: BPF_PROG_TEST_RUN of {prog}: {e}"));
        assert_eq!(v, verdict, "{what}: verdict");
        if let Some(want) = want {
            if !is_ipv6(&out) {
                let d = Decoded::parse(&out);
                assert!(d.ip_csum_ok(), "{what}: IPv4 header checksum invalid");
            }
            assert!(
                want.crc_left_to_offload || crc_ok(&out),
                "{what}: SCTP CRC32c invalid after translation"
            );
            assert_eq!(out, want.bytes(), "{what}: output differs from {want:?}");
        }
        let after = self.counters();
        assert_eq!(
            after[counter.name()] - before[counter.name()],
            1,
            "{what}: counter {}",
            counter.name()
        );
        out
    }

    /// `init` to a Service without endpoints through tc ingress: the verdict TC_ACT_REDIRECT
    /// (the ICMP error goes back out), counted under `NoEndpointsRejected`. Returns the error.
    fn rejected(&self, init: &Sctp) -> Vec<u8> {
        let what = "INIT to a Service without endpoints";
        let counter = Counter::NoEndpointsRejected;
        self.step(what, PROG_TC_INGRESS, init, TC_ACT_REDIRECT, None, counter)
    }

    /// `frame` through tc ingress is dropped (TC_ACT_SHOT), counted once under `counter`.
    fn ingress_drops(&self, what: &str, frame: &[u8], counter: Counter) {
        let before = self.counters();
        let (v, _) = self.run(PROG_TC_INGRESS, frame);
        assert_eq!(v, TC_ACT_SHOT, "{what}: verdict");
        let c = counter.name();
        assert_eq!(self.counters()[c] - before[c], 1, "{what}: counter {c}");
    }

    /// `frame` through `prog` passes on (TC_NEXT) byte for byte as it came.
    fn passes_untouched(&self, what: &str, prog: &str, frame: &[u8]) {
        let (v, out) = self.run(prog, frame);
        assert_eq!((v, out.as_slice()), (TC_NEXT, frame), "{what}");
    }

    /// A [`Datapath::step`] through tc ingress that passes on (TC_NEXT).
    fn ingress(&self, what: &str, input: &Sctp, want: Option<&Sctp>, counter: Counter) -> Vec<u8> {
        self.step(what, PROG_TC_INGRESS, input, TC_NEXT, want, counter)
    }

    /// A [`Datapath::step`] through tc egress that passes on (TC_NEXT).
    fn egress(&self, what: &str, input: &Sctp, want: Option<&Sctp>, counter: Counter) -> Vec<u8> {
        self.step(what, PROG_TC_EGRESS, input, TC_NEXT, want, counter)
    }

    /// The conntrack entry of `saddr:sport → daddr:dport` in direction `dir`, either family.
    fn entry(
        &mut self,
        (saddr, sport): (IpAddr, u16),
        (daddr, dport): (IpAddr, u16),
        dir: u8,
    ) -> Option<Entry> {
        match (saddr, daddr) {
            (IpAddr::V4(s), IpAddr::V4(d)) => {
                sctp_entry!(self, MAP_CONNTRACK, CtKey, CtValue, s, d, sport, dport, dir)
            }
            (IpAddr::V6(s), IpAddr::V6(d)) => {
                sctp_entry!(
                    self,
                    MAP_CONNTRACK6,
                    Ct6Key,
                    Ct6Value,
                    s,
                    d,
                    sport,
                    dport,
                    dir
                )
            }
            _ => panic!("{saddr} and {daddr}: addresses of two families"),
        }
    }

    /// The ORIGINAL entry of `client`'s flow, either family: (state, created_ns).
    fn original(&mut self, client: &Sctp) -> Option<(u8, u64)> {
        let (from, to) = ((client.saddr, client.sport), (client.daddr, client.dport));
        (self.entry(from, to, ct_dir::ORIGINAL)).map(|e| (e.state, e.created_ns))
    }

    fn state(&mut self, client: &Sctp) -> u8 {
        self.original(client).expect("ORIGINAL conntrack entry").0
    }

    /// The REPLY entry of `client`'s flow to `backend:port`, either family: (frontend address
    /// octets, frontend port, backend id).
    fn reply(&mut self, client: &Sctp, backend: IpAddr, port: u16) -> Option<(Vec<u8>, u16, u32)> {
        let (from, to) = ((backend, port), (client.saddr, client.sport));
        (self.entry(from, to, ct_dir::REPLY))
            .map(|e| (e.frontend_addr, e.frontend_port, e.backend_id))
    }
}

fn octets(a: IpAddr) -> Vec<u8> {
    match a {
        IpAddr::V4(a) => a.octets().to_vec(),
        IpAddr::V6(a) => a.octets().to_vec(),
    }
}

/// An association's life through a ClusterIP whose target port differs: INIT DNATed (address,
/// port, CRC32c), INIT_ACK reverse-NATed, COOKIE_ECHO establishing, DATA both ways (a large
/// chunk: the CRC update's distance beyond 255 bytes), ABORT closing the flow, and a new INIT on
/// the closed tuple starting over.
#[test]
fn sctp_association_is_dnated_tracked_and_reverse_natted() {
    association(V4);
}

#[test]
fn sctp_association_over_ipv6_is_dnated_tracked_and_reverse_natted() {
    association(V6);
}

fn association(f: Family) {
    let mut dp = Datapath::with_services();
    let init = Sctp::new(f.client, 40_000, f.vip, 3868, chunk::INIT);
    dp.ingress(
        "INIT to VIP:3868 is DNATed to backend 21 on :3869 with a valid CRC32c",
        &init,
        Some(&init.to(f.be_21, 3869)),
        Counter::NewFlow,
    );
    assert_eq!(dp.state(&init), ct_state::SYN_SENT, "INIT: COOKIE_WAIT");
    assert_eq!(
        dp.reply(&init, f.be_21, 3869).expect("REPLY entry"),
        (octets(f.vip), 3868, 21)
    );

    let init_ack = init.to(f.be_21, 3869).reversed(chunk::INIT_ACK);
    dp.egress(
        "INIT_ACK from the backend is reverse-NATed to VIP:3868",
        &init_ack,
        Some(&init_ack.from(f.vip, 3868)),
        Counter::ReplyTranslated,
    );
    assert_eq!(
        dp.state(&init),
        ct_state::SYN_RECV,
        "INIT_ACK answers, the association still opening"
    );

    for (what, c) in [
        (
            "COOKIE_ECHO establishes the association",
            chunk::COOKIE_ECHO,
        ),
        ("DATA of the established association", chunk::DATA),
    ] {
        let p = Sctp::new(f.client, 40_000, f.vip, 3868, c);
        dp.step(
            what,
            PROG_TC_INGRESS,
            &p,
            TC_NEXT,
            Some(&p.to(f.be_21, 3869)),
            Counter::EstablishedFlow,
        );
        assert_eq!(dp.state(&init), ct_state::ESTABLISHED, "{what}");
    }
    let big = Sctp::new(f.client, 40_000, f.vip, 3868, chunk::DATA).value(&[0xa5; 1400]);
    dp.ingress(
        "a 1,400-byte DATA chunk keeps a valid CRC32c",
        &big,
        Some(&big.to(f.be_21, 3869)),
        Counter::EstablishedFlow,
    );
    let back = big
        .to(f.be_21, 3869)
        .reversed(chunk::DATA)
        .value(&[0x3c; 777]);
    dp.egress(
        "a large DATA chunk from the backend is reverse-NATed",
        &back,
        Some(&back.from(f.vip, 3868)),
        Counter::ReplyTranslated,
    );

    let abort = Sctp::new(f.client, 40_000, f.vip, 3868, chunk::ABORT);
    dp.ingress(
        "ABORT is DNATed and closes the flow",
        &abort,
        Some(&abort.to(f.be_21, 3869)),
        Counter::EstablishedFlow,
    );
    assert_eq!(dp.state(&init), ct_state::CLOSING, "ABORT: CLOSED");
    let again = dp.original(&init).unwrap().1;
    dp.ingress(
        "a new INIT on the closed tuple starts a new flow",
        &init,
        Some(&init.to(f.be_21, 3869)),
        Counter::NewFlow,
    );
    assert_eq!(dp.state(&init), ct_state::SYN_SENT);
    assert!(
        dp.original(&init).unwrap().1 > again,
        "the entry is a new one"
    );
}

/// Like TCP, an SCTP association keeps a backend that turned not ready (`NOT_SERVING`, no slot
/// left: every endpoint of the Service not ready), while a new association is rejected as for
/// any Service without endpoints (kube-proxy's REJECT matches new connections only).
#[test]
fn sctp_association_keeps_a_not_serving_backend() {
    not_serving_keeps_the_association(V4);
}

#[test]
fn sctp_association_over_ipv6_keeps_a_not_serving_backend() {
    not_serving_keeps_the_association(V6);
}

/// The backend's INIT_ACK to `init` (to backend 21), reverse-NATed on its way to the client:
/// the association is answered, the client's COOKIE_ECHO then establishes it.
fn answer_init(dp: &Datapath, f: &Family, init: &Sctp) {
    let ack = init.to(f.be_21, 3869).reversed(chunk::INIT_ACK);
    dp.egress(
        "INIT_ACK",
        &ack,
        Some(&ack.from(f.vip, 3868)),
        Counter::ReplyTranslated,
    );
}

fn not_serving_keeps_the_association(f: Family) {
    let mut dp = Datapath::with_services();
    let init = Sctp::new(f.client, 40_500, f.vip, 3868, chunk::INIT);
    dp.ingress(
        "INIT",
        &init,
        Some(&init.to(f.be_21, 3869)),
        Counter::NewFlow,
    );
    answer_init(&dp, &f, &init);
    let echo = Sctp::new(f.client, 40_500, f.vip, 3868, chunk::COOKIE_ECHO);
    let to_21 = echo.to(f.be_21, 3869);
    dp.ingress("COOKIE_ECHO", &echo, Some(&to_21), Counter::EstablishedFlow);
    // Backend 21 turns not ready: its entry stays, flagged; the frontend has no slot left.
    match f.vip {
        IpAddr::V4(vip) => {
            let mut b = dp.map::<u32, Backend>(MAP_BACKENDS).get(&21, 0).unwrap();
            b.flags = backend_flags::NOT_SERVING;
            dp.map::<u32, Backend>(MAP_BACKENDS)
                .insert(21, b, 0)
                .unwrap();
            dp.set_family_frontend(f.vip, 3868, 1, &[]);
            let slot = ServiceKey::new(vip.octets(), 3868u16.to_be_bytes(), proto::SCTP, 1);
            dp.map::<ServiceKey, ServiceValue>(MAP_SERVICES)
                .remove(&slot)
                .unwrap();
        }
        IpAddr::V6(vip) => {
            let mut b = dp.map::<u32, Backend6>(MAP_BACKENDS6).get(&21, 0).unwrap();
            b.flags = backend_flags::NOT_SERVING;
            dp.map::<u32, Backend6>(MAP_BACKENDS6)
                .insert(21, b, 0)
                .unwrap();
            dp.set_family_frontend(f.vip, 3868, 1, &[]);
            let slot = Service6Key::new(vip.octets(), 3868u16.to_be_bytes(), proto::SCTP, 1);
            dp.map::<Service6Key, ServiceValue>(MAP_SERVICES6)
                .remove(&slot)
                .unwrap();
        }
    }
    let data = Sctp::new(f.client, 40_500, f.vip, 3868, chunk::DATA).value(&[7; 600]);
    dp.ingress(
        "DATA of the association to a not-serving backend is still DNATed to it",
        &data,
        Some(&data.to(f.be_21, 3869)),
        Counter::EstablishedFlow,
    );
    assert_eq!(dp.state(&init), ct_state::ESTABLISHED);
    let other = Sctp::new(f.client, 40_501, f.vip, 3868, chunk::INIT);
    dp.rejected(&other);
}

/// A graceful shutdown: the client's SHUTDOWN half-closes, the backend's SHUTDOWN_ACK closes,
/// the client's SHUTDOWN_COMPLETE keeps it closed; a backend ABORT closes a flow too.
#[test]
fn sctp_shutdown_and_backend_abort_close_the_flow() {
    shutdown_and_abort(V4);
}

#[test]
fn sctp_over_ipv6_shutdown_and_backend_abort_close_the_flow() {
    shutdown_and_abort(V6);
}

fn shutdown_and_abort(f: Family) {
    let mut dp = Datapath::with_services();
    let c = |chunk| Sctp::new(f.client, 40_100, f.vip, 3868, chunk);
    let b = |chunk| c(chunk).to(f.be_21, 3869).reversed(chunk);
    dp.ingress(
        "INIT",
        &c(chunk::INIT),
        Some(&c(chunk::INIT).to(f.be_21, 3869)),
        Counter::NewFlow,
    );
    answer_init(&dp, &f, &c(chunk::INIT));
    dp.ingress(
        "COOKIE_ECHO",
        &c(chunk::COOKIE_ECHO),
        None,
        Counter::EstablishedFlow,
    );
    dp.egress(
        "COOKIE_ACK",
        &b(chunk::COOKIE_ACK),
        Some(&b(chunk::COOKIE_ACK).from(f.vip, 3868)),
        Counter::ReplyTranslated,
    );
    assert_eq!(dp.state(&c(chunk::INIT)), ct_state::ESTABLISHED);
    dp.ingress(
        "SHUTDOWN",
        &c(chunk::SHUTDOWN),
        None,
        Counter::EstablishedFlow,
    );
    assert_eq!(
        dp.state(&c(chunk::INIT)),
        ct_state::FIN_ORIGINAL,
        "SHUTDOWN_SENT"
    );
    dp.egress(
        "HEARTBEAT from the backend",
        &b(chunk::HEARTBEAT),
        None,
        Counter::ReplyTranslated,
    );
    assert_eq!(dp.state(&c(chunk::INIT)), ct_state::FIN_ORIGINAL);
    dp.egress(
        "SHUTDOWN_ACK",
        &b(chunk::SHUTDOWN_ACK),
        Some(&b(chunk::SHUTDOWN_ACK).from(f.vip, 3868)),
        Counter::ReplyTranslated,
    );
    assert_eq!(dp.state(&c(chunk::INIT)), ct_state::CLOSING);
    dp.ingress(
        "SHUTDOWN_COMPLETE",
        &c(chunk::SHUTDOWN_COMPLETE),
        Some(&c(chunk::SHUTDOWN_COMPLETE).to(f.be_21, 3869)),
        Counter::EstablishedFlow,
    );
    assert_eq!(dp.state(&c(chunk::INIT)), ct_state::CLOSING);

    let c2 = |chunk| Sctp::new(f.client, 40_101, f.vip, 3868, chunk);
    let b2 = |chunk| c2(chunk).to(f.be_21, 3869).reversed(chunk);
    dp.ingress("INIT 2", &c2(chunk::INIT), None, Counter::NewFlow);
    answer_init(&dp, &f, &c2(chunk::INIT));
    dp.ingress(
        "COOKIE_ECHO 2",
        &c2(chunk::COOKIE_ECHO),
        None,
        Counter::EstablishedFlow,
    );
    dp.egress(
        "ABORT from the backend",
        &b2(chunk::ABORT),
        Some(&b2(chunk::ABORT).from(f.vip, 3868)),
        Counter::ReplyTranslated,
    );
    assert_eq!(dp.state(&c2(chunk::INIT)), ct_state::CLOSING);
}

/// Same port on the frontend and the backend: only the address changes, which the CRC32c does
/// not cover: the SCTP packet leaves byte for byte as it came.
#[test]
fn sctp_address_only_dnat_keeps_the_crc_as_it_was() {
    address_only(V4);
}

#[test]
fn sctp_over_ipv6_address_only_dnat_keeps_the_crc_as_it_was() {
    address_only(V6);
}

fn address_only(f: Family) {
    let dp = Datapath::with_services();
    let init = Sctp::new(f.client, 40_200, f.vip, 9000, chunk::INIT);
    let out = dp.ingress(
        "INIT to VIP:9000 is DNATed to backend 22 on :9000",
        &init,
        Some(&init.to(f.be_22, 9000)),
        Counter::NewFlow,
    );
    assert_eq!(sctp_of(&out), init.sctp_bytes(), "SCTP bytes untouched");
}

/// A Service without endpoints answers an INIT with ICMP port unreachable (as for UDP, and as
/// kube-proxy's REJECT rules do for SCTP), quoting the IPv4 header and the SCTP common header's
/// first 8 bytes (ports and verification tag: what the client matches the error with).
#[test]
fn sctp_to_a_service_without_endpoints_is_answered_port_unreachable() {
    let dp = Datapath::with_services();
    let init = Sctp::new(CLIENT, 40_300, VIP_EMPTY, 3868, chunk::INIT);
    let out = dp.rejected(&init);
    let d = Decoded::parse(&out);
    assert_eq!(
        (d.proto, d.saddr, d.daddr),
        (proto::ICMP, VIP_EMPTY, CLIENT)
    );
    assert!(d.ip_csum_ok() && d.l4_csum_ok(), "ICMP checksums");
    assert_eq!((d.l4[0], d.l4[1]), (3, 3), "port unreachable");
    let input = init.bytes();
    assert_eq!(&d.l4[8..], &input[14..14 + 20 + 8], "quoted IPv4 + 8 bytes");
}

/// Odd SCTP packets to a Service: a header without a chunk is dropped as malformed; an IP
/// fragment is dropped (not translated: see packet.rs). To no Service they pass untouched.
#[test]
fn sctp_truncated_and_fragmented_packets_to_a_service_are_dropped() {
    let dp = Datapath::with_services();
    let init = Sctp::new(CLIENT, 40_400, VIP, 3868, chunk::INIT);
    let mut short = init.bytes();
    short.truncate(14 + 20 + 12);
    short[16..18].copy_from_slice(&32u16.to_be_bytes());
    let c = csum::ipv4_header(&{
        let mut h = short[14..34].to_vec();
        h[10..12].copy_from_slice(&[0, 0]);
        h
    });
    short[24..26].copy_from_slice(&c.to_be_bytes());
    dp.ingress_drops(
        "SCTP header without a chunk",
        &short,
        Counter::DropMalformed,
    );
    let first_fragment = Sctp {
        frag: 0x2000,
        ..init.clone()
    };
    dp.ingress_drops(
        "first fragment of an SCTP packet to a Service",
        &first_fragment.bytes(),
        Counter::DropFragment,
    );
    let elsewhere = Sctp::new(
        CLIENT,
        40_400,
        Ipv4Addr::new(10, 244, 9, 9),
        3868,
        chunk::INIT,
    );
    dp.passes_untouched("untracked: untouched", PROG_TC_EGRESS, &elsewhere.bytes());
}

/// NodePort to a remote backend: DNAT on ingress, SNAT to the node (address and port, CRC32c
/// updated) on egress, the backend's answer back to the client and out from the NodePort.
#[test]
fn sctp_node_port_to_a_remote_backend_is_snated_to_the_node() {
    let mut dp = Datapath::load();
    dp.set_frontend(
        NODE_IP,
        NODE_PORT,
        service_flags::EXTERNAL,
        50,
        &[(200, REMOTE_BE, 3869, 0)],
    );
    dp.set_node_addr(NODE_IP);
    let init = Sctp::new(EXT_CLIENT, 40_500, NODE_IP, NODE_PORT, chunk::INIT);
    let fwd = init.to(REMOTE_BE, 3869);
    dp.ingress(
        "INIT to the NodePort: DNAT to the remote backend",
        &init,
        Some(&fwd),
        Counter::NewFlow,
    );
    let out_key = SnatKey {
        saddr: EXT_CLIENT.octets(),
        daddr: REMOTE_BE.octets(),
        sport: 40_500u16.to_be_bytes(),
        dport: 3869u16.to_be_bytes(),
        proto: proto::SCTP,
        dir: ct_dir::ORIGINAL,
        _pad: [0; 2],
    };
    let snat: SnatValue = dp
        .map::<SnatKey, SnatValue>(MAP_SNAT)
        .get(&out_key, 0)
        .expect("SNAT out entry");
    assert_eq!(snat.addr, NODE_IP.octets());
    let nat_port = u16::from_be_bytes(snat.port);
    let snated = fwd.from(NODE_IP, nat_port);
    dp.egress(
        "the forwarded INIT leaves from the node's address and port",
        &fwd,
        Some(&snated),
        Counter::SnatTranslated,
    );
    let ack = snated.reversed(chunk::INIT_ACK);
    let unsnat = ack.to(EXT_CLIENT, 40_500);
    dp.ingress(
        "the backend's INIT_ACK goes back to the client",
        &ack,
        Some(&unsnat),
        Counter::SnatReplyTranslated,
    );
    dp.egress(
        "toward the client: from the NodePort",
        &unsnat,
        Some(&unsnat.from(NODE_IP, NODE_PORT)),
        Counter::ReplyTranslated,
    );
}

/// IPv6: an INIT from outside the cluster to a NodePort whose backend is on another node is
/// DNATed, SNATed to the node's IPv6 address on the way out (`SNAT6_V1`), and the backend's
/// INIT_ACK goes back to the client from the NodePort, every CRC32c valid.
#[test]
fn sctp_over_ipv6_node_port_to_a_remote_backend_is_snated_to_the_node() {
    let node = Ipv6Addr::new(0xfd00, 0x50, 0, 0, 0, 0, 0, 0x10);
    let ext_client = Ipv6Addr::new(0xfd00, 0x50, 0, 0, 0, 0, 0, 0x100);
    let remote_be = Ipv6Addr::new(0xfd00, 0x244, 2, 0, 0, 0, 0, 0x20);
    let mut dp = Datapath::load();
    dp.set_family_frontend_with_flags(
        IpAddr::V6(node),
        NODE_PORT,
        service_flags::EXTERNAL,
        50,
        &[(200, IpAddr::V6(remote_be), 3869)],
    );
    Node6Map::from_ebpf(&mut dp.bpf)
        .expect("NODE6 map")
        .set(node)
        .expect("node IPv6 address");
    let init = Sctp::new(ext_client, 40_500, node, NODE_PORT, chunk::INIT);
    let fwd = init.to(remote_be, 3869);
    let out = dp.ingress(
        "INIT to the IPv6 NodePort: DNAT to the remote backend",
        &init,
        Some(&fwd),
        Counter::NewFlow,
    );
    assert!(crc_ok(&out), "CRC32c after DNAT");
    let out_key = Snat6Key {
        saddr: ext_client.octets(),
        daddr: remote_be.octets(),
        sport: 40_500u16.to_be_bytes(),
        dport: 3869u16.to_be_bytes(),
        proto: proto::SCTP,
        dir: ct_dir::ORIGINAL,
        _pad: [0; 2],
    };
    let snat: Snat6Value = dp
        .map::<Snat6Key, Snat6Value>(MAP_SNAT6)
        .get(&out_key, 0)
        .expect("SNAT6 out entry");
    assert_eq!(
        snat.addr,
        node.octets(),
        "SNATed to the node's IPv6 address"
    );
    let nat_port = u16::from_be_bytes(snat.port);
    let snated = fwd.from(node, nat_port);
    let out = dp.egress(
        "the forwarded INIT leaves from the node's IPv6 address and port",
        &fwd,
        Some(&snated),
        Counter::SnatTranslated,
    );
    assert!(crc_ok(&out), "CRC32c after SNAT");
    let ack = snated.reversed(chunk::INIT_ACK);
    let unsnat = ack.to(ext_client, 40_500);
    dp.ingress(
        "the backend's INIT_ACK goes back to the client",
        &ack,
        Some(&unsnat),
        Counter::SnatReplyTranslated,
    );
    let out = dp.egress(
        "toward the client: from the NodePort",
        &unsnat,
        Some(&unsnat.from(node, NODE_PORT)),
        Counter::ReplyTranslated,
    );
    assert!(crc_ok(&out), "CRC32c of the answer");
}

/// An ICMP error (`type_`, `code`) from `from` to `to` quoting the IPv4 header and the first 8
/// bytes of `quoted`'s SCTP packet.
fn icmp_error(from: Ipv4Addr, to: Ipv4Addr, type_: u8, code: u8, quoted: &Sctp) -> Vec<u8> {
    let q = quoted.bytes();
    let mut icmp = vec![type_, code, 0, 0, 0, 0, 0x05, 0xdc];
    icmp.extend_from_slice(&q[14..14 + 20 + 8]);
    let c = csum::fold(csum::sum(&icmp, 0)).to_be_bytes();
    icmp[2..4].copy_from_slice(&c);
    let mut ip = vec![0x45, 0];
    ip.extend_from_slice(&((20 + icmp.len()) as u16).to_be_bytes());
    ip.extend_from_slice(&[0, 0, 0, 0, 64, proto::ICMP, 0, 0]);
    ip.extend_from_slice(&from.octets());
    ip.extend_from_slice(&to.octets());
    let c = csum::ipv4_header(&ip).to_be_bytes();
    ip[10..12].copy_from_slice(&c);
    let mut f = eth(HOST_MAC, CLIENT_MAC, ETH_P_IP);
    f.extend_from_slice(&ip);
    f.extend_from_slice(&icmp);
    f
}

/// A "fragmentation needed" from the backend about a DNATed association reaches the client as
/// if from the VIP, quoting client → VIP:port (what the client's SCTP stack matches it with).
#[test]
fn icmp_errors_about_sctp_flows_are_reverse_translated() {
    let dp = Datapath::with_services();
    let init = Sctp::new(CLIENT, 40_600, VIP, 3868, chunk::INIT);
    let fwd = init.to(BE_21, 3869);
    dp.ingress("INIT", &init, Some(&fwd), Counter::NewFlow);
    let before = dp.counters();
    let (v, out) = dp.run(PROG_TC_EGRESS, &icmp_error(BE_21, CLIENT, 3, 4, &fwd));
    assert_eq!(v, TC_NEXT);
    let counted = Counter::IcmpErrorTranslated.name();
    assert_eq!(dp.counters()[counted] - before[counted], 1);
    let d = Decoded::parse(&out);
    assert!(d.ip_csum_ok() && d.l4_csum_ok(), "outer and ICMP checksums");
    assert_eq!(d.saddr, VIP, "the error comes from the VIP");
    let want = icmp_error(VIP, CLIENT, 3, 4, &init);
    assert_eq!(
        &out[14 + 20 + 8..],
        &want[14 + 20 + 8..],
        "quotes client → VIP:3868"
    );
}

/// IPv6: a Service without endpoints answers an INIT with ICMPv6 destination unreachable, port
/// unreachable (type 1 code 4), from the VIP, quoting the IPv6 header and the SCTP common
/// header's first 8 bytes.
#[test]
fn sctp_over_ipv6_to_a_service_without_endpoints_is_answered_port_unreachable() {
    let dp = Datapath::with_services();
    let init = Sctp::new(V6.client, 40_300, V6.vip_empty, 3868, chunk::INIT);
    let out = dp.rejected(&init);
    let d = Decoded6::parse(&out);
    assert_eq!(
        (d.proto, IpAddr::V6(d.saddr), IpAddr::V6(d.daddr)),
        (ICMPV6, V6.vip_empty, V6.client)
    );
    assert!(d.l4_csum_ok(), "ICMPv6 checksum");
    assert_eq!((d.l4[0], d.l4[1]), (1, 4), "port unreachable");
    let input = init.bytes();
    assert_eq!(
        &d.l4[8..],
        &input[ETH_HLEN..ETH_HLEN + 40 + 8],
        "quoted IPv6 header + 8 bytes"
    );
}

/// The IPv6 tables' client and VIP.
fn v6_client_vip() -> (Ipv6Addr, Ipv6Addr) {
    match (V6.client, V6.vip) {
        (IpAddr::V6(client), IpAddr::V6(vip)) => (client, vip),
        _ => unreachable!("V6 holds IPv6 addresses"),
    }
}

/// A frame from the IPv6 client to the VIP with `sctp` (any bytes) behind `ext`.
fn sctp6_to_vip(ext: &[Ext6], sctp: &[u8]) -> Vec<u8> {
    let (client, vip) = v6_client_vip();
    ipv6_packet(
        HOST_MAC,
        CLIENT_MAC,
        client,
        vip,
        64,
        ext,
        proto::SCTP,
        sctp,
    )
}

/// IPv6: an SCTP header without a chunk to a Service is dropped as malformed; the first
/// fragment of an SCTP packet to a Service is dropped (as on IPv4: not translated), and its
/// later fragments pass untouched; to no Service a first fragment passes untouched.
#[test]
fn sctp_over_ipv6_truncated_and_fragmented_packets_to_a_service_are_dropped() {
    let dp = Datapath::with_services();
    let (client, vip) = v6_client_vip();
    let init = Sctp::new(client, 40_400, vip, 3868, chunk::INIT);
    let short = sctp6_to_vip(&[], &init.sctp_bytes()[..12]);
    dp.ingress_drops(
        "SCTP header without a chunk",
        &short,
        Counter::DropMalformed,
    );
    let first_fragment = Sctp {
        ext: vec![Ext6::fragment(0, true, 0x77)],
        ..init.clone()
    };
    dp.ingress_drops(
        "first fragment of an SCTP packet to a Service",
        &first_fragment.bytes(),
        Counter::DropFragment,
    );
    let later = sctp6_to_vip(&[Ext6::fragment(4, false, 0x77)], &[0; 16]);
    dp.passes_untouched("a later fragment: untouched", PROG_TC_INGRESS, &later);
    let elsewhere = first_fragment.to(Ipv6Addr::new(0xfd00, 0x244, 9, 0, 0, 0, 0, 9), 3868);
    dp.passes_untouched(
        "to no Service: untouched",
        PROG_TC_INGRESS,
        &elsewhere.bytes(),
    );
}

/// IPv6: a Packet Too Big from a router about a DNATed association reaches the client from the
/// VIP, quoting client → VIP:port, the ICMPv6 checksum valid.
#[test]
fn packet_too_big_about_an_sctp_flow_over_ipv6_is_reverse_translated() {
    let dp = Datapath::with_services();
    let (client, vip) = v6_client_vip();
    let init = Sctp::new(client, 40_600, vip, 3868, chunk::INIT);
    let fwd = init.to(V6.be_21, 3869);
    dp.ingress("INIT", &init, Some(&fwd), Counter::NewFlow);
    let router = Ipv6Addr::new(0xfd00, 0x1, 0, 0, 0, 0, 0, 1);
    let ptb = |from, quoted: &Sctp| {
        let q = quoted.bytes();
        icmp6_frame(
            from,
            client,
            2,
            0,
            [0, 0, 0x05, 0x00],
            &q[ETH_HLEN..ETH_HLEN + 40 + 8],
        )
    };
    let before = dp.counters();
    let (v, out) = dp.run(PROG_TC_EGRESS, &ptb(router, &fwd));
    assert_eq!(v, TC_NEXT);
    let counted = Counter::IcmpErrorTranslated.name();
    assert_eq!(dp.counters()[counted] - before[counted], 1);
    assert!(Decoded6::parse(&out).l4_csum_ok(), "ICMPv6 checksum");
    assert_eq!(
        out,
        ptb(vip, &init),
        "from the VIP, quoting client → VIP:3868"
    );
}

/// Bundled chunks move the flow as netfilter's walk of all chunks does: DATA + SHUTDOWN shuts
/// the client's side down, SACK + ABORT from the backend ends the association. Before, only the
/// first chunk was read and such flows stayed ESTABLISHED (210 s).
#[test]
fn sctp_bundled_shutdown_and_abort_move_the_flow() {
    bundled_shutdown_and_abort(V4);
}

#[test]
fn sctp_over_ipv6_bundled_shutdown_and_abort_move_the_flow() {
    bundled_shutdown_and_abort(V6);
}

const SACK: u8 = 3;

fn bundled_shutdown_and_abort(f: Family) {
    let mut dp = Datapath::with_services();
    let c = |port, chunk| Sctp::new(f.client, port, f.vip, 3868, chunk);
    let establish = |dp: &mut Datapath, port| {
        let init = c(port, chunk::INIT);
        dp.ingress(
            "INIT",
            &init,
            Some(&init.to(f.be_21, 3869)),
            Counter::NewFlow,
        );
        answer_init(dp, &f, &init);
        let echo = c(port, chunk::COOKIE_ECHO).bundle(chunk::DATA, b"first data");
        let out = dp.ingress(
            "COOKIE_ECHO + DATA",
            &echo,
            Some(&echo.to(f.be_21, 3869)),
            Counter::EstablishedFlow,
        );
        assert!(crc_ok(&out));
        assert_eq!(dp.state(&init), ct_state::ESTABLISHED);
    };
    establish(&mut dp, 40_500);
    let data_shutdown = c(40_500, chunk::DATA).bundle(chunk::SHUTDOWN, &[0, 0, 0, 1]);
    dp.ingress(
        "DATA + SHUTDOWN",
        &data_shutdown,
        Some(&data_shutdown.to(f.be_21, 3869)),
        Counter::EstablishedFlow,
    );
    assert_eq!(
        dp.state(&c(40_500, chunk::INIT)),
        ct_state::FIN_ORIGINAL,
        "SHUTDOWN bundled behind DATA: SHUTDOWN_SENT"
    );

    establish(&mut dp, 40_501);
    let sack_abort = c(40_501, SACK)
        .to(f.be_21, 3869)
        .reversed(SACK)
        .bundle(chunk::ABORT, &[]);
    dp.egress(
        "SACK + ABORT from the backend",
        &sack_abort,
        Some(&sack_abort.from(f.vip, 3868)),
        Counter::ReplyTranslated,
    );
    assert_eq!(
        dp.state(&c(40_501, chunk::INIT)),
        ct_state::CLOSING,
        "ABORT bundled behind SACK: CLOSED"
    );
}

/// Bundles netfilter's SCTP tracker calls INVALID (kube-proxy drops INVALID packets): INIT with
/// another chunk, COOKIE_ECHO behind DATA, a zero-length chunk. To a Service they are dropped as
/// malformed, and no flow is created; to no Service they pass untouched.
#[test]
fn sctp_invalid_bundles_to_a_service_are_dropped() {
    invalid_bundles(V4);
}

#[test]
fn sctp_over_ipv6_invalid_bundles_to_a_service_are_dropped() {
    invalid_bundles(V6);
}

fn invalid_bundles(f: Family) {
    let mut dp = Datapath::with_services();
    let init_data = Sctp::new(f.client, 40_600, f.vip, 3868, chunk::INIT).bundle(chunk::DATA, b"x");
    let echo_late =
        Sctp::new(f.client, 40_601, f.vip, 3868, chunk::DATA).bundle(chunk::COOKIE_ECHO, b"cookie");
    let mut zero = Sctp::new(f.client, 40_602, f.vip, 3868, chunk::DATA).bundle(chunk::DATA, b"");
    zero.value = b"abcd".to_vec();
    let mut zero_bytes = zero.bytes();
    // The bundled chunk's length field (the frame's last two of its 4 header bytes) to 0, CRC
    // recomputed so only the chunk is wrong.
    let end = zero_bytes.len();
    zero_bytes[end - 2..].copy_from_slice(&[0, 0]);
    let l4 = if is_ipv6(&zero_bytes) {
        ETH_HLEN + 40
    } else {
        ETH_HLEN + 20
    };
    zero_bytes[l4 + 8..l4 + 12].copy_from_slice(&[0; 4]);
    let field = crc32c::checksum(&zero_bytes[l4..]).to_le_bytes();
    zero_bytes[l4 + 8..l4 + 12].copy_from_slice(&field);
    for (what, frame) in [
        ("INIT bundled with DATA", init_data.bytes()),
        ("COOKIE_ECHO behind DATA", echo_late.bytes()),
        ("a zero-length bundled chunk", zero_bytes),
    ] {
        dp.ingress_drops(what, &frame, Counter::DropMalformed);
    }
    assert_eq!(dp.original(&init_data), None, "no flow for an invalid INIT");
    let elsewhere = init_data.to(f.be_22, 3868);
    dp.passes_untouched(
        "an invalid bundle to no Service",
        PROG_TC_INGRESS,
        &elsewhere.bytes(),
    );
}

/// An SCTP packet whose CRC32c the node's stack leaves to offload (pods' SCTP over veth: field
/// 0, CHECKSUM_PARTIAL) keeps the 0 through the port rewrites both ways, so the device or the
/// kernel's fallback computes the CRC over the translated packet; updating the placeholder would
/// send a wrong CRC out of any device without SCTP CRC offload (vxlan, virtio, most NICs).
#[test]
fn an_sctp_crc_left_to_offload_stays_zero_through_the_translation() {
    for (name, f) in [("IPv4", V4), ("IPv6", V6)] {
        let dp = Datapath::with_services();
        let init = Sctp::new(f.client, 40_010, f.vip, 3868, chunk::INIT).crc_left_to_offload();
        let out = dp.ingress(
            "INIT with its CRC left to offload: DNATed, port rewritten, CRC field still 0",
            &init,
            Some(&init.to(f.be_21, 3869)),
            Counter::NewFlow,
        );
        assert_eq!(sctp_of(&out)[8..12], [0; 4], "{name}: the placeholder kept");
        let init_ack = init.to(f.be_21, 3869).reversed(chunk::INIT_ACK);
        dp.egress(
            "INIT_ACK with its CRC left to offload: reverse-NATed, CRC field still 0",
            &init_ack,
            Some(&init_ack.from(f.vip, 3868)),
            Counter::ReplyTranslated,
        );
    }
}
