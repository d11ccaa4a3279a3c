//! IPv6 datapath table tests, mirroring tests/datapath.rs for IPv4: the real eBPF object, loaded
//! into the kernel, run with BPF_PROG_TEST_RUN through the attached entry programs
//! (`tc_ingress`/`tc_egress`, which tail-call the IPv6 programs). The maps are written directly
//! (the control plane does not write IPv6 Services yet). Addresses: fd00::/8 only.
//!
//! Privileged (root). Run:
//! `cargo test -p proxy-userspace --test datapath6 -- --test-threads=1 --nocapture`

mod common_datapath;
mod common_packet;

use std::{collections::BTreeMap, net::Ipv6Addr};

use aya::{
    Ebpf,
    maps::{
        Array, HashMap, MapData,
        lpm_trie::{Key, LpmTrie},
    },
};
use common_datapath::{TC_ACT_REDIRECT, TC_ACT_SHOT, TC_NEXT};
use common_packet::{
    CLIENT_MAC, Decoded6, ETH_HLEN, Ext6, HOST_MAC, ICMPV6, L4, Pkt6, ext6, icmp6_frame,
    ipv6_packet, tcp_flags::*,
};
use kube_proxy_ebpf::dataplane::{
    clock::monotonic_ns,
    maps::{ClusterCidrs6Map, Node6Map},
};
use proxy_common::{
    AffinityValue, CLASH_PORT_MAX, CLASH_PORT_MIN, CLASH_PROBES, Counter, DatapathConfig,
    MAP_LC_ADJUST, MAP_LC_FLOWS, PROG_TC_EGRESS, PROG_TC_EGRESS_L3, PROG_TC_INGRESS,
    PROG_TC_INGRESS_L3, SCOPE_INTERNAL, SNAT_NODE_PORT_MIN, SNAT_PORT_MIN, ServiceValue,
    backend_flags, csum, ct_dir, ct_flags, ct_state,
    hash::{PortProbe, SnatPorts, pick_slot},
    ipv6::{
        Affinity6Key, Affinity6MatchKey, Backend6, Ct6Key, Ct6Value, MAP_AFFINITY_MATCH6,
        MAP_AFFINITY6, MAP_BACKENDS6, MAP_CONNTRACK6, MAP_SERVICE_CIDRS6, MAP_SERVICES6, MAP_SNAT6,
        MAP_SOURCE_RANGES6, SOURCE_RANGE6_FRONTEND_BITS, Service6Key, Snat6Key, Snat6Value,
        SourceRange6Key, flow_hash6,
    },
    proto, sched, service_cidr, service_flags,
};

const CLIENT: Ipv6Addr = Ipv6Addr::new(0xfd00, 0x244, 1, 0, 0, 0, 0, 2);
/// A ClusterIP with TCP :80 and UDP :53.
const VIP: Ipv6Addr = Ipv6Addr::new(0xfd00, 0x96, 0, 0, 0, 0, 0, 0x10);
/// A ClusterIP whose Services have no endpoints (TCP :80, UDP :53).
const VIP_EMPTY: Ipv6Addr = Ipv6Addr::new(0xfd00, 0x96, 0, 0, 0, 0, 0, 0x99);
/// A pod reached directly (no Service).
const POD: Ipv6Addr = Ipv6Addr::new(0xfd00, 0x244, 9, 0, 0, 0, 0, 9);
/// A router on the path to the backends.
const ROUTER: Ipv6Addr = Ipv6Addr::new(0xfd00, 0x1, 0, 0, 0, 0, 0, 1);

const TCP_IDS: [u32; 2] = [1, 2];
const UDP_IDS: [u32; 2] = [11, 12];

fn backend_addr(id: u32) -> (Ipv6Addr, u16) {
    match id {
        1 => (Ipv6Addr::new(0xfd00, 0x244, 1, 0, 0, 0, 0, 0x10), 8080),
        2 => (Ipv6Addr::new(0xfd00, 0x244, 2, 0, 0, 0, 0, 0x20), 8080),
        11 => (Ipv6Addr::new(0xfd00, 0x244, 1, 0, 0, 0, 0, 0x11), 5353),
        12 => (Ipv6Addr::new(0xfd00, 0x244, 2, 0, 0, 0, 0, 0x12), 5353),
        _ => panic!("no test backend {id}"),
    }
}

const TEST_CAPACITY: u32 = 4_096;

struct Datapath {
    bpf: Ebpf,
}

impl Datapath {
    fn load() -> Self {
        Self::load_with(DatapathConfig::DEFAULT)
    }

    fn load_with(cfg: DatapathConfig) -> Self {
        Self::load_with_log(cfg, None)
    }

    /// As [`Datapath::load_with`], the datapath trace at `log_level` (`None`: the object's
    /// default, off).
    fn load_with_log(cfg: DatapathConfig, log_level: Option<u8>) -> Self {
        let maps = [
            proxy_common::MAP_SERVICES,
            proxy_common::MAP_BACKENDS,
            proxy_common::MAP_CONNTRACK,
            MAP_SERVICES6,
            MAP_BACKENDS6,
            MAP_CONNTRACK6,
        ];
        let bpf = common_datapath::load_object(&cfg, log_level, &maps, TEST_CAPACITY);
        let mut dp = Self { bpf };
        dp.set_service(VIP, 80, proto::TCP, 1, &TCP_IDS);
        dp.set_service(VIP, 53, proto::UDP, 2, &UDP_IDS);
        dp.set_service(VIP_EMPTY, 80, proto::TCP, 3, &[]);
        dp.set_service(VIP_EMPTY, 53, proto::UDP, 4, &[]);
        dp
    }

    fn services(&mut self) -> HashMap<&mut MapData, Service6Key, ServiceValue> {
        HashMap::try_from(self.bpf.map_mut(MAP_SERVICES6).unwrap()).unwrap()
    }

    fn backends(&mut self) -> HashMap<&mut MapData, u32, Backend6> {
        HashMap::try_from(self.bpf.map_mut(MAP_BACKENDS6).unwrap()).unwrap()
    }

    fn conntrack(&mut self) -> HashMap<&mut MapData, Ct6Key, Ct6Value> {
        HashMap::try_from(self.bpf.map_mut(MAP_CONNTRACK6).unwrap()).unwrap()
    }

    /// `VIP`:80/TCP (the test backends 1 and 2) picks round robin.
    fn round_robin_on_vip(&mut self) {
        let key = Service6Key::new(VIP.octets(), 80u16.to_be_bytes(), proto::TCP, 0);
        let mut fe = ServiceValue::frontend(2, 1);
        fe.scheduler = sched::code::ROUND_ROBIN;
        self.services().insert(key, fe, 0).unwrap();
    }

    /// The ingress program's file descriptor number (for `common_datapath::race_on_two_cpus`).
    fn ingress_fd(&self) -> std::os::fd::RawFd {
        use std::os::fd::{AsFd, AsRawFd};
        let fd = common_datapath::prog(&self.bpf, PROG_TC_INGRESS)
            .fd()
            .expect("program fd");
        fd.as_fd().as_raw_fd()
    }

    /// Every conntrack entry removed.
    fn clear_conntrack(&mut self) {
        let keys: Vec<Ct6Key> = self.conntrack().keys().map(|k| k.expect("key")).collect();
        let mut ct = self.conntrack();
        for key in keys {
            let _ = ct.remove(&key);
        }
    }

    fn ct(&mut self, key: &Ct6Key) -> Option<Ct6Value> {
        self.conntrack().get(key, 0).ok()
    }

    /// A Service the way the agent writes one: backends → slots → frontend.
    fn set_service(&mut self, vip: Ipv6Addr, port: u16, proto: u8, rev_nat: u32, ids: &[u32]) {
        let key = Service6Key::new(vip.octets(), port.to_be_bytes(), proto, 0);
        self.set_frontend_entry(key, 0, rev_nat, ids);
    }

    /// The frontend entry at `key` (any scope) with `flags` and the test backends `ids`.
    fn set_frontend_entry(&mut self, key: Service6Key, flags: u16, rev_nat: u32, ids: &[u32]) {
        let proto = key.proto;
        for &id in ids {
            let (addr, port) = backend_addr(id);
            let b = Backend6 {
                addr: addr.octets(),
                port: port.to_be_bytes(),
                proto,
                flags: 0,
            };
            self.backends().insert(id, b, 0).unwrap();
        }
        for (i, &id) in ids.iter().enumerate() {
            self.services()
                .insert(key.with_slot(i as u16 + 1), ServiceValue::slot(id), 0)
                .unwrap();
        }
        let fe = ServiceValue::frontend_with_flags(ids.len() as u16, rev_nat, flags);
        self.services().insert(key, fe, 0).unwrap();
    }

    fn counters(&self) -> BTreeMap<&'static str, u64> {
        common_datapath::counters(&self.bpf)
    }

    /// One run of `prog` over `input`, nothing checked: (verdict, output frame).
    fn run(&self, prog: &str, input: &[u8]) -> (u32, Vec<u8>) {
        common_datapath::run(&self.bpf, prog, input)
    }

    /// One run of `prog` over `input`; checks the verdict and that exactly the `counts` (plus
    /// one ingress/egress packet) moved. Returns the output frame.
    fn step(
        &self,
        what: &str,
        prog: &str,
        input: &[u8],
        verdict: u32,
        counts: &[(Counter, u64)],
    ) -> Vec<u8> {
        let before = self.counters();
        let (v, out, _) = common_datapath::try_run_checked(&self.bpf, prog, input, verdict)
            .unwrap_or_else(|e| panic!("{what}: BPF_PROG_TEST_RUN of {prog}: {e:#?}"));
        assert_eq!(v, verdict, "{what}: verdict");
        let after = self.counters();
        let mut want: BTreeMap<&str, u64> = counts.iter().map(|(c, n)| (c.name(), *n)).collect();
        let packets = if prog == PROG_TC_INGRESS || prog == PROG_TC_INGRESS_L3 {
            Counter::IngressPackets
        } else {
            Counter::EgressPackets
        };
        *want.entry(packets.name()).or_default() += 1;
        for (name, n) in &after {
            let delta = n - before[name];
            let w = want.get(name).copied().unwrap_or(0);
            assert_eq!(
                delta, w,
                "{what}: counter {name} moved by {delta}, expected {w}"
            );
        }
        out
    }
}

/// The backend id a new flow's 5-tuple picks (random scheduler, seed 0 as loaded).
fn picked(p: &Pkt6, ids: &[u32]) -> u32 {
    let (sport, dport) = ports(p);
    let h = flow_hash6(
        0,
        p.saddr.octets(),
        p.daddr.octets(),
        sport.to_be_bytes(),
        dport.to_be_bytes(),
        p.proto(),
    );
    ids[pick_slot(h, ids.len() as u16).unwrap() as usize - 1]
}

fn ports(p: &Pkt6) -> (u16, u16) {
    match p.l4 {
        L4::Tcp { sport, dport, .. } | L4::Udp { sport, dport, .. } => (sport, dport),
    }
}

fn set_ports(p: &mut Pkt6, s: u16, d: u16) {
    match &mut p.l4 {
        L4::Tcp { sport, dport, .. } | L4::Udp { sport, dport, .. } => {
            *sport = s;
            *dport = d;
        }
    }
}

/// `p` as the backend `id` receives it after DNAT.
fn dnated(p: &Pkt6, id: u32) -> Pkt6 {
    let (addr, port) = backend_addr(id);
    let mut d = p.clone();
    d.daddr = addr;
    let (sport, _) = ports(p);
    set_ports(&mut d, sport, port);
    d
}

/// The backend's SYN-ACK to the SYN `p` (to backend `id`).
fn syn_ack_from(p: &Pkt6, id: u32) -> Pkt6 {
    let mut synack = dnated(p, id).reversed();
    if let L4::Tcp { flags, .. } = &mut synack.l4 {
        *flags = SYN | ACK;
    }
    synack
}

impl Datapath {
    /// `input` through `prog` passes on (TC_NEXT) moving exactly `counts`, and comes out as
    /// `want` (see [`assert_packet`]). Returns the output frame.
    fn translated(
        &self,
        what: &str,
        prog: &str,
        input: &Pkt6,
        counts: &[(Counter, u64)],
        want: &Pkt6,
    ) -> Vec<u8> {
        let out = self.step(what, prog, &input.bytes(), TC_NEXT, counts);
        assert_packet(what, &out, want);
        out
    }
}

impl Datapath {
    /// A new flow's first packet `p` through tc ingress is DNATed to backend `id`.
    fn new_flow_dnated(&self, what: &str, p: &Pkt6, id: u32) -> Vec<u8> {
        self.translated(what, PROG_TC_INGRESS, p, NEW, &dnated(p, id))
    }

    /// A backend's `reply` to `original` through tc egress comes out from `original`'s
    /// frontend ([`rev_natted`]).
    fn reply_rev_natted(&self, what: &str, reply: &Pkt6, original: &Pkt6) -> Vec<u8> {
        self.translated(
            what,
            PROG_TC_EGRESS,
            reply,
            REPLY,
            &rev_natted(reply, original),
        )
    }
}

/// Output must be `want` byte for byte, and its L4 checksum must verify by recomputation.
fn assert_packet(what: &str, out: &[u8], want: &Pkt6) {
    let d = Decoded6::parse(out);
    assert!(d.l4_csum_ok(), "{what}: L4 checksum invalid");
    assert_eq!(out, want.bytes(), "{what}: output differs from {want:?}");
}

const NEW: &[(Counter, u64)] = &[(Counter::NewFlow, 1), (Counter::PickRandom, 1)];
const REPLY: &[(Counter, u64)] = &[(Counter::ReplyTranslated, 1)];
const ESTABLISHED: &[(Counter, u64)] = &[(Counter::EstablishedFlow, 1)];
const NOT_SERVICE: &[(Counter, u64)] = &[(Counter::NotService, 1)];

#[test]
fn tcp_flow_is_dnated_tracked_and_reverse_natted() {
    let dp = Datapath::load();
    let syn = Pkt6::tcp(CLIENT, 40_000, VIP, 80, SYN);
    let id = picked(&syn, &TCP_IDS);
    dp.new_flow_dnated("SYN to the VIP", &syn, id);

    let mut dp = dp;
    let original = original_key(&syn);
    let ct = dp.ct(&original).expect("ORIGINAL entry");
    let (baddr, _) = backend_addr(id);
    assert_eq!(
        (ct.backend_id, ct.rev_nat_id, ct.state),
        (id, 1, ct_state::SYN_SENT)
    );
    assert_eq!(
        (ct.backend_addr, ct.frontend_addr),
        (baddr.octets(), VIP.octets())
    );
    let reply = reply_key(&syn, id);
    assert!(dp.ct(&reply).is_some(), "REPLY entry");

    // A bare ACK before any SYN-ACK (a spoofed or blind handshake) is translated but does not
    // establish the flow: it keeps the opening flow's transitory timeout.
    let early = Pkt6::tcp(CLIENT, 40_000, VIP, 80, ACK);
    dp.translated(
        "ACK before the SYN-ACK",
        PROG_TC_INGRESS,
        &early,
        ESTABLISHED,
        &dnated(&early, id),
    );
    assert_eq!(
        dp.ct(&original).unwrap().state,
        ct_state::SYN_SENT,
        "SYN then ACK without a SYN-ACK is not established"
    );

    // The backend's SYN-ACK leaves toward the client from the VIP.
    let synack = syn_ack_from(&syn, id);
    let want = rev_natted(&synack, &syn);
    dp.translated("SYN-ACK reverse NAT", PROG_TC_EGRESS, &synack, REPLY, &want);
    let ct = dp.ct(&original).unwrap();
    assert_ne!(
        ct.flags & ct_flags::SEEN_REPLY,
        0,
        "the reply marks the flow"
    );
    assert_eq!(
        ct.state,
        ct_state::SYN_RECV,
        "the backend's SYN-ACK answers the SYN"
    );
    assert_eq!(dp.ct(&reply).unwrap().state, ct_state::SYN_RECV);

    // Established: the same backend, through conntrack.
    let ack = Pkt6::tcp(CLIENT, 40_000, VIP, 80, ACK).payload(b"GET / HTTP/1.1\r\n\r\n");
    dp.translated(
        "ACK with data, established",
        PROG_TC_INGRESS,
        &ack,
        ESTABLISHED,
        &dnated(&ack, id),
    );
    assert_eq!(dp.ct(&original).unwrap().state, ct_state::ESTABLISHED);
    assert_eq!(
        dp.ct(&reply).unwrap().state,
        ct_state::ESTABLISHED,
        "the state change reaches the REPLY entry"
    );
}

/// As IPv4's `a_direct_tcp_flow_is_established_by_the_client_s_ack_and_closed_by_its_fin`.
#[test]
fn a_direct_ipv6_tcp_flow_is_established_by_the_client_s_ack_and_closed_by_its_fin() {
    let mut dp = Datapath::load();
    let pod: Ipv6Addr = "fd00:244::99".parse().unwrap();
    let c = |flags| Pkt6::tcp(CLIENT, 38_000, pod, 8080, flags);
    for (what, flags, state) in [
        ("SYN", SYN, ct_state::SYN_SENT),
        ("handshake ACK", ACK, ct_state::ESTABLISHED),
        ("data", PSH | ACK, ct_state::ESTABLISHED),
        ("the client's FIN", FIN | ACK, ct_state::CLOSING),
        ("the client's last ACK", ACK, ct_state::CLOSING),
    ] {
        let (verdict, out) = dp.run(PROG_TC_INGRESS, &c(flags).bytes());
        assert_eq!(
            (verdict, out),
            (TC_NEXT, c(flags).bytes()),
            "{what}: untouched"
        );
        let v = dp
            .ct(&original_key(&c(flags)))
            .unwrap_or_else(|| panic!("{what}: direct entry"));
        assert_eq!(v.flags & ct_flags::DIRECT, ct_flags::DIRECT, "{what}");
        assert_eq!(v.state, state, "{what}");
    }
}

/// As IPv4's `direct_flows_start_over_when_their_destination_becomes_a_frontend`: a direct
/// flow toward what later became a frontend starts over under the next frontend generation
/// (UDP, a SYN); an established TCP connection keeps going straight.
#[test]
fn direct_flows_start_over_when_their_destination_becomes_a_frontend() {
    let later: Ipv6Addr = "fd00:96::77".parse().unwrap();
    let mut dp = Datapath::load();
    let q = Pkt6::udp(CLIENT, 36_000, later, 53);
    let syn = Pkt6::tcp(CLIENT, 36_001, later, 80, SYN);
    let connection = Pkt6::tcp(CLIENT, 36_002, later, 80, SYN);
    let ack = Pkt6::tcp(CLIENT, 36_002, later, 80, ACK);
    for (what, p) in [
        ("UDP", &q),
        ("a SYN", &syn),
        ("a connection's SYN", &connection),
    ] {
        dp.step(what, PROG_TC_INGRESS, &p.bytes(), TC_NEXT, NOT_SERVICE);
    }
    dp.set_service(later, 53, proto::UDP, 9, &UDP_IDS);
    dp.set_service(later, 80, proto::TCP, 8, &TCP_IDS);
    dp.step(
        "frontend written, generation not moved on yet: still direct",
        PROG_TC_INGRESS,
        &q.bytes(),
        TC_NEXT,
        &[(Counter::DirectFlow, 1)],
    );
    let mut generation: Array<&mut MapData, u32> = Array::try_from(
        dp.bpf
            .map_mut(proxy_common::MAP_FRONTEND_GEN)
            .expect("FRONTGEN_V1"),
    )
    .expect("array");
    generation.set(0, 1, 0).expect("moving the generation on");
    let restarted = [NEW, &[(Counter::DirectBecameFrontend, 1)]].concat();
    dp.translated(
        "UDP after the new generation",
        PROG_TC_INGRESS,
        &q,
        &restarted,
        &dnated(&q, picked(&q, &UDP_IDS)),
    );
    dp.step(
        "an established connection's segment keeps going straight",
        PROG_TC_INGRESS,
        &ack.bytes(),
        TC_NEXT,
        &[(Counter::DirectFlow, 1)],
    );
    dp.translated(
        "a retransmitted SYN",
        PROG_TC_INGRESS,
        &syn,
        &restarted,
        &dnated(&syn, picked(&syn, &TCP_IDS)),
    );
}

/// As IPv4's `udp_flows_expire_after_udp_timeout_until_they_are_streams`: an answered lookup
/// keeps `udp_timeout_s`, a flow still active 2 s after it began with answers is a stream and
/// holds `udp_stream_timeout_s`. Aged by rewriting the timestamps.
#[test]
fn ipv6_udp_flows_expire_after_udp_timeout_until_they_are_streams() {
    const S: u64 = 1_000_000_000;
    let mut dp = Datapath::load_with(DatapathConfig {
        udp_timeout_s: 1,
        udp_stream_timeout_s: 3,
        ..DatapathConfig::DEFAULT
    });
    let lookup = Pkt6::udp(CLIENT, 36_000, VIP, 53).payload(b"query");
    let stream = Pkt6::udp(CLIENT, 36_001, VIP, 53).payload(b"query");
    for q in [&lookup, &stream] {
        let id = picked(q, &UDP_IDS);
        dp.new_flow_dnated("new UDP flow", q, id);
        let answer = dnated(q, id).reversed();
        dp.reply_rev_natted("the backend answers", &answer, q);
    }
    let age = |dp: &mut Datapath, q: &Pkt6, idle: u64, began: u64| {
        let key = original_key(q);
        let mut v = dp.ct(&key).expect("ORIGINAL entry");
        v.last_seen_ns = v.last_seen_ns.saturating_sub(idle);
        v.created_ns = v.last_seen_ns.saturating_sub(began);
        dp.conntrack().insert(key, v, 0).expect("age entry");
    };
    age(&mut dp, &lookup, 2 * S, 0);
    age(&mut dp, &stream, 2 * S, 5 * S);
    dp.translated(
        "an answered lookup after 2 s: no stream, expired",
        PROG_TC_INGRESS,
        &lookup,
        &[
            (Counter::ConntrackExpired, 1),
            (Counter::NewFlow, 1),
            (Counter::PickRandom, 1),
        ],
        &dnated(&lookup, picked(&lookup, &UDP_IDS)),
    );
    dp.translated(
        "a stream after 2 s: still established",
        PROG_TC_INGRESS,
        &stream,
        ESTABLISHED,
        &dnated(&stream, picked(&stream, &UDP_IDS)),
    );
}

#[test]
fn udp_flow_is_dnated_and_reverse_natted_with_checksums_never_zero() {
    let dp = Datapath::load();
    let q = Pkt6::udp(CLIENT, 33_000, VIP, 53).payload(b"\x12\x34query");
    let id = picked(&q, &UDP_IDS);
    dp.new_flow_dnated("UDP query", &q, id);
    let answer = dnated(&q, id).reversed();
    let want = rev_natted(&answer, &q);
    dp.translated("UDP answer", PROG_TC_EGRESS, &answer, REPLY, &want);

    // A payload whose translated checksum computes to 0: it must be written as 0xffff.
    let sport = 33_001;
    let probe = Pkt6::udp(CLIENT, sport, VIP, 53);
    let id = picked(&probe, &UDP_IDS);
    let zeroing = (0..=u16::MAX)
        .map(|w| probe.clone().payload(&w.to_be_bytes()))
        .find(|p| {
            let mut seg = dnated(p, id).segment();
            seg[6..8].copy_from_slice(&[0, 0]);
            let (b, _) = backend_addr(id);
            csum::l4_v6(CLIENT.octets(), b.octets(), proto::UDP, &seg) == 0
        })
        .expect("a payload that sums to zero");
    let out = dp.step(
        "UDP whose translated checksum is 0",
        PROG_TC_INGRESS,
        &zeroing.bytes(),
        TC_NEXT,
        NEW,
    );
    let d = Decoded6::parse(&out);
    assert_eq!(d.l4_csum_field(), 0xffff, "a computed 0 is sent as 0xffff");
    assert_packet("UDP checksum 0xffff", &out, &dnated(&zeroing, id));

    // A UDP datagram with checksum 0 (invalid on IPv6) to a Service is dropped, elsewhere passed.
    let zero = Pkt6::udp(CLIENT, 33_002, VIP, 53).zero_udp_csum();
    dp.step(
        "UDP checksum 0 to a Service",
        PROG_TC_INGRESS,
        &zero.bytes(),
        TC_ACT_SHOT,
        &[(Counter::DropMalformed, 1)],
    );
    let zero_pod = Pkt6::udp(CLIENT, 33_002, POD, 53).zero_udp_csum().bytes();
    let out = dp.step(
        "UDP checksum 0 to a pod",
        PROG_TC_INGRESS,
        &zero_pod,
        TC_NEXT,
        NOT_SERVICE,
    );
    assert_eq!(out, zero_pod);
}

/// Checks an ICMPv6 port unreachable answering `input` (from the VIP, quoting the input's IPv6
/// header chain and 8 bytes of L4 header).
fn check_icmp6_unreachable(what: &str, input: &[u8], out: &[u8]) {
    let orig = Decoded6::parse(input);
    let d = Decoded6::parse(out);
    assert_eq!(
        (d.dst_mac, d.src_mac),
        (CLIENT_MAC, HOST_MAC),
        "{what}: MACs swapped"
    );
    assert_eq!(
        (d.saddr, d.daddr),
        (orig.daddr, orig.saddr),
        "{what}: from the VIP"
    );
    assert_eq!(d.proto, ICMPV6, "{what}: ICMPv6");
    assert!(d.l4_csum_ok(), "{what}: ICMPv6 checksum invalid");
    assert_eq!((d.l4[0], d.l4[1]), (1, 4), "{what}: type 1 code 4");
    assert_eq!(&d.l4[4..8], &[0; 4], "{what}: unused field");
    let chain = input.len() - ETH_HLEN - orig.l4.len();
    let want = &input[ETH_HLEN..ETH_HLEN + chain + 8];
    assert_eq!(
        &d.l4[8..8 + want.len()],
        want,
        "{what}: quoted header chain + 8 bytes"
    );
    assert_eq!(
        out.len(),
        ETH_HLEN + 40 + d.l4.len(),
        "{what}: payload length"
    );
}

#[test]
fn a_service_without_endpoints_answers_icmpv6_port_unreachable() {
    let dp = Datapath::load();
    let rejected: &[(Counter, u64)] = &[(Counter::NoEndpointsRejected, 1)];
    let rejected_ext: &[(Counter, u64)] = &[
        (Counter::NoEndpointsRejected, 1),
        (Counter::Ipv6ExtHeaders, 1),
    ];
    for (what, pkt, counts) in [
        ("UDP", Pkt6::udp(CLIENT, 34_000, VIP_EMPTY, 53), rejected),
        (
            "TCP SYN",
            Pkt6::tcp(CLIENT, 34_001, VIP_EMPTY, 80, SYN),
            rejected,
        ),
        (
            "UDP with destination options",
            Pkt6::udp(CLIENT, 34_002, VIP_EMPTY, 53).ext(Ext6::options(ext6::DEST_OPTS, 16)),
            rejected_ext,
        ),
    ] {
        let input = pkt.bytes();
        let out = dp.step(what, PROG_TC_INGRESS, &input, TC_ACT_REDIRECT, counts);
        check_icmp6_unreachable(what, &input, &out);
    }
    // On an L3 device there are no MACs to answer with: dropped, as for IPv4.
    dp.step(
        "L3 device: dropped",
        PROG_TC_INGRESS_L3,
        &Pkt6::udp(CLIENT, 34_003, VIP_EMPTY, 53).l3_bytes(),
        TC_ACT_SHOT,
        &[(Counter::DropRejectFailed, 1)],
    );
}

#[test]
fn a_tcp_segment_whose_backend_is_gone_is_reset() {
    let mut dp = Datapath::load();
    let syn = Pkt6::tcp(CLIENT, 41_000, VIP, 80, SYN);
    let id = picked(&syn, &TCP_IDS);
    dp.step("SYN", PROG_TC_INGRESS, &syn.bytes(), TC_NEXT, NEW);
    dp.backends().remove(&id).unwrap();
    let ack = Pkt6::tcp(CLIENT, 41_000, VIP, 80, ACK).payload(b"xyz");
    let out = dp.step(
        "ACK to a gone backend",
        PROG_TC_INGRESS,
        &ack.bytes(),
        TC_ACT_REDIRECT,
        &[(Counter::StaleBackendReset, 1)],
    );
    let d = Decoded6::parse(&out);
    assert_eq!((d.saddr, d.daddr, d.proto), (VIP, CLIENT, proto::TCP));
    assert!(d.l4_csum_ok(), "RST checksum");
    assert_eq!((d.sport(), d.dport()), (80, 41_000));
    assert_eq!(d.l4[13], RST, "RST for a segment with ACK");
    assert_eq!(
        &d.l4[4..8],
        &5000u32.to_be_bytes(),
        "seq = the segment's ack"
    );
    assert_eq!(d.l4.len(), 20);
}

impl Datapath {
    /// The agent's writes for a Service port on `VIP` whose endpoint `gone` turned not ready:
    /// `keep`'s slots and frontend, the last slot removed, `gone`'s entry kept flagged
    /// NOT_SERVING.
    fn mark_not_serving(&mut self, port: u16, proto_: u8, rev_nat: u32, keep: &[u32], gone: u32) {
        let mut b = self.backends().get(&gone, 0).unwrap();
        b.flags = backend_flags::NOT_SERVING;
        self.backends().insert(gone, b, 0).unwrap();
        self.set_service(VIP, port, proto_, rev_nat, keep);
        let last = Service6Key::new(VIP.octets(), port.to_be_bytes(), proto_, 0)
            .with_slot(keep.len() as u16 + 1);
        self.services().remove(&last).unwrap();
    }
}

/// IPv6 twin of the IPv4 table: established TCP to a NOT_SERVING backend is still DNATed to it
/// (both halves of the program: `tc_ingress6` and its new-flow program), new flows never pick
/// it, UDP to it is picked anew, and once its entry is gone the flow is reset.
#[test]
fn not_serving_backend_keeps_tcp_flows_udp_is_reselected() {
    let mut dp = Datapath::load();
    let syn = Pkt6::tcp(CLIENT, 43_000, VIP, 80, SYN);
    let x = picked(&syn, &TCP_IDS);
    let live = if x == 1 { 2 } else { 1 };
    dp.new_flow_dnated("SYN", &syn, x);
    let q = Pkt6::udp(CLIENT, 43_001, VIP, 53);
    let ux = picked(&q, &UDP_IDS);
    let ulive = if ux == 11 { 12 } else { 11 };
    dp.new_flow_dnated("UDP", &q, ux);

    dp.mark_not_serving(80, proto::TCP, 1, &[live], x);
    dp.mark_not_serving(53, proto::UDP, 2, &[ulive], ux);

    for len in [1usize, 1000] {
        let data = Pkt6::tcp(CLIENT, 43_000, VIP, 80, PSH | ACK).payload(&vec![5; len]);
        dp.translated(
            "established TCP to a not-serving backend: still DNATed to it",
            PROG_TC_INGRESS,
            &data,
            ESTABLISHED,
            &dnated(&data, x),
        );
    }
    let mut would_have = 0;
    for sport in 44_000..44_040 {
        let syn = Pkt6::tcp(CLIENT, sport, VIP, 80, SYN);
        would_have += usize::from(picked(&syn, &TCP_IDS) == x);
        dp.new_flow_dnated("a new flow: the serving backend", &syn, live);
    }
    assert!(
        would_have > 5,
        "some flows hashed to the not-serving backend"
    );
    dp.translated(
        "UDP to a not-serving backend is reselected",
        PROG_TC_INGRESS,
        &q,
        &[
            (Counter::StaleBackendReselected, 1),
            (Counter::PickRandom, 1),
        ],
        &dnated(&q, ulive),
    );
    assert_eq!(dp.ct(&original_key(&q)).unwrap().backend_id, ulive);
    assert!(
        dp.ct(&reply_key(&q, ux)).is_none(),
        "old REPLY entry removed"
    );
    assert_eq!(dp.ct(&original_key(&syn)).unwrap().backend_id, x);

    // Gone from the slices: the entry goes, the next segment is reset.
    dp.backends().remove(&x).unwrap();
    let ack = Pkt6::tcp(CLIENT, 43_000, VIP, 80, ACK).payload(b"xyz");
    let out = dp.step(
        "ACK once the backend is gone",
        PROG_TC_INGRESS,
        &ack.bytes(),
        TC_ACT_REDIRECT,
        &[(Counter::StaleBackendReset, 1)],
    );
    let d = Decoded6::parse(&out);
    assert_eq!(d.l4[13], RST, "RST");
}

#[test]
fn extension_headers_are_walked_kept_and_bounded() {
    let dp = Datapath::load();
    let syn = Pkt6::tcp(CLIENT, 42_000, VIP, 80, SYN)
        .ext(Ext6::options(ext6::HOP_BY_HOP, 8))
        .ext(Ext6::options(ext6::DEST_OPTS, 16));
    let id = picked(&syn, &TCP_IDS);
    dp.translated(
        "hop-by-hop + destination options before TCP: extension headers kept",
        PROG_TC_INGRESS,
        &syn,
        &[
            (Counter::NewFlow, 1),
            (Counter::PickRandom, 1),
            (Counter::Ipv6ExtHeaders, 1),
        ],
        &dnated(&syn, id),
    );

    // More than MAX_EXT_HEADERS: the walk stops, the packet passes untouched (ports unknown).
    let mut long = Pkt6::tcp(CLIENT, 42_001, VIP, 80, SYN);
    for _ in 0..=proxy_common::ipv6::MAX_EXT_HEADERS {
        long = long.ext(Ext6::options(ext6::DEST_OPTS, 8));
    }
    let input = long.bytes();
    let out = dp.step(
        "too many extension headers",
        PROG_TC_INGRESS,
        &input,
        TC_NEXT,
        &[(Counter::Ipv6ExtUnparsed, 1)],
    );
    assert_eq!(out, input, "passed untouched");
    // Exactly MAX_EXT_HEADERS are still walked.
    let mut max = Pkt6::tcp(CLIENT, 42_002, VIP, 80, SYN);
    for _ in 0..proxy_common::ipv6::MAX_EXT_HEADERS {
        max = max.ext(Ext6::options(ext6::DEST_OPTS, 8));
    }
    let id = picked(&max, &TCP_IDS);
    dp.translated(
        "MAX_EXT_HEADERS extension headers",
        PROG_TC_INGRESS,
        &max,
        &[
            (Counter::NewFlow, 1),
            (Counter::PickRandom, 1),
            (Counter::Ipv6ExtHeaders, 1),
        ],
        &dnated(&max, id),
    );

    // ESP: nothing behind it can be read.
    let esp = ipv6_packet(
        HOST_MAC,
        CLIENT_MAC,
        CLIENT,
        VIP,
        64,
        &[],
        ext6::ESP,
        &[0, 0, 0, 1, 0, 0, 0, 1, 0xaa, 0xbb, 0xcc, 0xdd],
    );
    let out = dp.step(
        "ESP",
        PROG_TC_INGRESS,
        &esp,
        TC_NEXT,
        &[(Counter::Ipv6ExtUnparsed, 1)],
    );
    assert_eq!(out, esp);
    // A TCP header cut off after the extension headers, to a Service: dropped as malformed.
    let mut cut = syn.bytes();
    cut.truncate(cut.len() - syn.payload.len() - 8);
    let plen = (cut.len() - ETH_HLEN - 40) as u16;
    cut[ETH_HLEN + 4..ETH_HLEN + 6].copy_from_slice(&plen.to_be_bytes());
    dp.step(
        "truncated TCP behind extension headers, to a Service",
        PROG_TC_INGRESS,
        &cut,
        TC_ACT_SHOT,
        &[(Counter::DropMalformed, 1)],
    );
}

/// `p`'s datagram in fragments of `chunk` bytes of fragmentable part each (a multiple of 8).
fn fragments6(p: &Pkt6, chunk: usize, id: u32) -> Vec<Vec<u8>> {
    let segment = p.segment();
    segment
        .chunks(chunk)
        .enumerate()
        .map(|(i, part)| {
            let more = (i + 1) * chunk < segment.len();
            let frag = Ext6::fragment((i * chunk / 8) as u16, more, id);
            // The fragment header names the L4 protocol as its next header.
            ipv6_packet(
                p.dst_mac,
                p.src_mac,
                p.saddr,
                p.daddr,
                p.hop_limit,
                &[frag],
                p.proto(),
                part,
            )
        })
        .collect()
}

/// The L4 segment of a datagram from its fragments (in order).
fn reassembled_segment(frags: &[Vec<u8>]) -> Vec<u8> {
    frags
        .iter()
        .flat_map(|f| f[ETH_HLEN + 48..].to_vec())
        .collect()
}

#[test]
fn fragments_of_a_datagram_to_a_service_are_translated_like_the_first() {
    let dp = Datapath::load();
    let dgram = Pkt6::udp(CLIENT, 35_000, VIP, 53).payload(&[7u8; 1200]);
    let id = picked(&dgram, &UDP_IDS);
    let frags = fragments6(&dgram, 640, 0xabcd_0001);
    assert_eq!(frags.len(), 2);
    let first = dp.step(
        "first fragment",
        PROG_TC_INGRESS,
        &frags[0],
        TC_NEXT,
        &[
            (Counter::NewFlow, 1),
            (Counter::PickRandom, 1),
            (Counter::Ipv6ExtHeaders, 1),
        ],
    );
    let second = dp.step(
        "second fragment",
        PROG_TC_INGRESS,
        &frags[1],
        TC_NEXT,
        &[(Counter::FragmentTranslated, 1)],
    );
    let want = fragments6(&dnated(&dgram, id), 640, 0xabcd_0001);
    assert_eq!(first, want[0], "first fragment translated");
    assert_eq!(second, want[1], "later fragment gets the same addresses");
    let (b, _) = backend_addr(id);
    let seg = reassembled_segment(&[first, second]);
    assert_eq!(
        csum::l4_v6(CLIENT.octets(), b.octets(), proto::UDP, &seg),
        0,
        "the reassembled datagram's checksum verifies"
    );
    // A later fragment of an unknown datagram passes untouched.
    let stray = fragments6(&dgram, 640, 0x0bad_0002);
    let out = dp.step(
        "unmatched later fragment",
        PROG_TC_INGRESS,
        &stray[1],
        TC_NEXT,
        &[(Counter::FragmentUnmatched, 1)],
    );
    assert_eq!(out, stray[1]);
    // A datagram whose first fragment was answered (no endpoints): its later fragments drop.
    let empty = Pkt6::udp(CLIENT, 35_001, VIP_EMPTY, 53).payload(&[8u8; 1200]);
    let efr = fragments6(&empty, 640, 0xabcd_0003);
    dp.step(
        "first fragment to a Service without endpoints",
        PROG_TC_INGRESS,
        &efr[0],
        TC_ACT_REDIRECT,
        &[
            (Counter::NoEndpointsRejected, 1),
            (Counter::Ipv6ExtHeaders, 1),
        ],
    );
    dp.step(
        "its later fragment",
        PROG_TC_INGRESS,
        &efr[1],
        TC_ACT_SHOT,
        &[(Counter::DropFragment, 1)],
    );
}

/// A Packet Too Big (MTU 1280) from `from` to the client, quoting the L3 packet `quoted`.
fn packet_too_big(from: Ipv6Addr, quoted: &[u8]) -> Vec<u8> {
    icmp6_frame(from, CLIENT, 2, 0, [0, 0, 0x05, 0x00], quoted)
}

impl Datapath {
    /// A router's Packet Too Big quoting `quoted` leaves egress reverse translated: from
    /// `frontend`, quoting `want_quoted`, the MTU untouched and the ICMPv6 checksum valid.
    fn ptb_reverse_translated(
        &self,
        what: &str,
        quoted: &[u8],
        frontend: Ipv6Addr,
        want_quoted: &[u8],
    ) {
        let ptb = packet_too_big(ROUTER, quoted);
        let counts = &[(Counter::IcmpErrorTranslated, 1)];
        let out = self.step(what, PROG_TC_EGRESS, &ptb, TC_NEXT, counts);
        assert!(
            Decoded6::parse(&out).l4_csum_ok(),
            "{what}: ICMPv6 checksum after the rewrite"
        );
        assert_eq!(
            out,
            packet_too_big(frontend, want_quoted),
            "{what}: from {frontend}, quoting the packet as the client sent it"
        );
    }

    /// A router's Packet Too Big about a flow nobody translated leaves egress untouched.
    fn ptb_untouched(&self, what: &str, quoted: &[u8]) {
        let ptb = packet_too_big(ROUTER, quoted);
        let counts = &[(Counter::ReplyNotTracked, 1)];
        let out = self.step(what, PROG_TC_EGRESS, &ptb, TC_NEXT, counts);
        assert_eq!(out, ptb, "{what}: untouched");
    }
}

#[test]
fn packet_too_big_about_a_translated_flow_is_reverse_translated() {
    let dp = Datapath::load();
    let data = Pkt6::tcp(CLIENT, 43_000, VIP, 80, SYN);
    let id = picked(&data, &TCP_IDS);
    dp.step("SYN", PROG_TC_INGRESS, &data.bytes(), TC_NEXT, NEW);
    // A router between node and backend sends Packet Too Big about client → backend.
    let quoted = dnated(&data, id).l3_bytes();
    // Quoted as the client sent it (client → VIP:80; the quoted TCP checksum stays as it was),
    // from the VIP, the MTU untouched.
    let mut want_quoted = quoted.clone();
    want_quoted[24..40].copy_from_slice(&VIP.octets());
    want_quoted[42..44].copy_from_slice(&80u16.to_be_bytes());
    dp.ptb_reverse_translated("PTB toward the client", &quoted, VIP, &want_quoted);
    // The same error about a flow nobody translated passes untouched.
    let other = Pkt6::tcp(CLIENT, 43_001, POD, 80, SYN).l3_bytes();
    dp.ptb_untouched("PTB about an untranslated flow", &other);
}

#[test]
fn neighbour_discovery_and_non_service_ipv6_are_never_modified() {
    let dp = Datapath::load();
    let mut ns_body = vec![0u8; 4];
    ns_body.extend_from_slice(&VIP.octets());
    let rows: Vec<(&str, Vec<u8>)> = vec![
        (
            "neighbour solicitation for the VIP",
            icmp6_frame(CLIENT, VIP, 135, 0, [0; 4], &VIP.octets()),
        ),
        (
            "neighbour advertisement",
            icmp6_frame(CLIENT, VIP, 136, 0, [0x60, 0, 0, 0], &CLIENT.octets()),
        ),
        (
            "router solicitation",
            icmp6_frame(CLIENT, ROUTER, 133, 0, [0; 4], &[]),
        ),
        (
            "router advertisement",
            icmp6_frame(ROUTER, CLIENT, 134, 0, [64, 0, 0, 0], &[0; 8]),
        ),
        (
            "redirect",
            icmp6_frame(ROUTER, CLIENT, 137, 0, [0; 4], &ns_body),
        ),
        (
            "echo request to the VIP",
            icmp6_frame(CLIENT, VIP, 128, 0, [0, 1, 0, 1], b"ping"),
        ),
        (
            "TCP to a pod",
            Pkt6::tcp(CLIENT, 44_000, POD, 80, SYN).bytes(),
        ),
        ("UDP to a pod", Pkt6::udp(CLIENT, 44_001, POD, 53).bytes()),
        (
            "TCP to the VIP on another port",
            Pkt6::tcp(CLIENT, 44_002, VIP, 443, SYN).bytes(),
        ),
    ];
    for (what, input) in &rows {
        let out = dp.step(what, PROG_TC_INGRESS, input, TC_NEXT, NOT_SERVICE);
        assert_eq!(&out, input, "{what}: ingress must pass it untouched");
        let out = dp.step(
            what,
            PROG_TC_EGRESS,
            input,
            TC_NEXT,
            &[(Counter::ReplyNotTracked, 1)],
        );
        assert_eq!(&out, input, "{what}: egress must pass it untouched");
    }
}

#[test]
fn l3_devices_carry_ipv6_by_the_version_nibble() {
    let dp = Datapath::load();
    let syn = Pkt6::tcp(CLIENT, 45_000, VIP, 80, SYN);
    let id = picked(&syn, &TCP_IDS);
    let out = dp.step(
        "SYN via an L3 device",
        PROG_TC_INGRESS_L3,
        &syn.l3_bytes(),
        TC_NEXT,
        NEW,
    );
    assert_eq!(out, dnated(&syn, id).l3_bytes());
    let reply = dnated(&syn, id).reversed();
    let out = dp.step(
        "reply via an L3 device",
        PROG_TC_EGRESS_L3,
        &reply.l3_bytes(),
        TC_NEXT,
        REPLY,
    );
    let mut want = reply.clone();
    want.saddr = VIP;
    set_ports(&mut want, 80, 45_000);
    assert_eq!(out, want.l3_bytes());
}

#[test]
fn round_robin_and_source_hash_pick_on_ipv6() {
    let mut dp = Datapath::load();
    let key = Service6Key::new(VIP.octets(), 80u16.to_be_bytes(), proto::TCP, 0);
    let mut fe = ServiceValue::frontend(2, 1);
    fe.scheduler = sched::code::ROUND_ROBIN;
    dp.services().insert(key, fe, 0).unwrap();
    let mut seen = Vec::new();
    for sport in 46_000..46_004 {
        let syn = Pkt6::tcp(CLIENT, sport, VIP, 80, SYN);
        let out = dp.step(
            "round robin",
            PROG_TC_INGRESS,
            &syn.bytes(),
            TC_NEXT,
            &[(Counter::NewFlow, 1), (Counter::PickRoundRobin, 1)],
        );
        seen.push(Decoded6::parse(&out).daddr);
    }
    assert_eq!(seen[0], seen[2]);
    assert_eq!(seen[1], seen[3]);
    assert_ne!(seen[0], seen[1], "round robin alternates");
    fe.scheduler = sched::code::SOURCE_HASH;
    dp.services().insert(key, fe, 0).unwrap();
    let first: Vec<_> = (46_010..46_014)
        .map(|sport| {
            let out = dp.step(
                "source hash",
                PROG_TC_INGRESS,
                &Pkt6::tcp(CLIENT, sport, VIP, 80, SYN).bytes(),
                TC_NEXT,
                &[(Counter::NewFlow, 1), (Counter::PickSourceHash, 1)],
            );
            Decoded6::parse(&out).daddr
        })
        .collect();
    assert!(
        first.iter().all(|a| *a == first[0]),
        "one client, one backend"
    );
}

/// Prints the IPv6 per-packet cost (no pass/fail on time), beside `datapath::per_packet_cost`
/// for IPv4: new flow (single runs), established DNAT and reply reverse NAT (repeated runs over
/// two Services that translate into each other, so every repetition takes the real path).
#[test]
fn per_packet_cost() {
    let mut dp = Datapath::load();
    let single = |dp: &Datapath, prog: &str, frame: &[u8]| {
        let (verdict, _, duration) = common_datapath::try_run(&dp.bpf, prog, frame, 1).unwrap();
        assert_eq!(verdict, TC_NEXT);
        duration
    };
    let mut new_flow: Vec<_> = (0..2_000u16)
        .map(|i| {
            single(
                &dp,
                PROG_TC_INGRESS,
                &Pkt6::tcp(CLIENT, 10_000 + i, VIP, 80, SYN).bytes(),
            )
        })
        .collect();
    new_flow.sort();

    let a = Ipv6Addr::new(0xfd00, 0x96, 1, 0, 0, 0, 0, 1);
    let b = Ipv6Addr::new(0xfd00, 0x96, 1, 0, 0, 0, 0, 2);
    for (id, to, port) in [(100u32, b, 81u16), (101, a, 80)] {
        let be = Backend6 {
            addr: to.octets(),
            port: port.to_be_bytes(),
            proto: proto::TCP,
            flags: 0,
        };
        dp.backends().insert(id, be, 0).unwrap();
    }
    for (vip, port, id, rev) in [(a, 80u16, 100u32, 10u32), (b, 81, 101, 11)] {
        let k = Service6Key::new(vip.octets(), port.to_be_bytes(), proto::TCP, 0);
        dp.services()
            .insert(k.with_slot(1), ServiceValue::slot(id), 0)
            .unwrap();
        dp.services()
            .insert(k, ServiceValue::frontend(1, rev), 0)
            .unwrap();
    }
    let to_a = Pkt6::tcp(CLIENT, 50_000, a, 80, ACK).payload(&[0; 64]);
    let to_b = Pkt6::tcp(CLIENT, 50_000, b, 81, ACK).payload(&[0; 64]);
    for p in [&to_a, &to_b] {
        single(&dp, PROG_TC_INGRESS, &p.bytes());
    }
    let repeated = |dp: &Datapath, prog: &str, frame: &[u8], counter: Counter| {
        let before = dp.counters()[counter.name()];
        let (_, out, duration) = common_datapath::try_run(&dp.bpf, prog, frame, 100_000).unwrap();
        assert_eq!(
            dp.counters()[counter.name()] - before,
            100_000,
            "every repetition took the {} path",
            counter.name()
        );
        assert!(
            Decoded6::parse(&out).l4_csum_ok(),
            "checksum after 100,000 rewrites"
        );
        duration
    };
    let established = repeated(
        &dp,
        PROG_TC_INGRESS,
        &to_a.bytes(),
        Counter::EstablishedFlow,
    );
    let reply = Pkt6::tcp(b, 81, CLIENT, 50_000, ACK).payload(&[0; 64]);
    let reply_cost = repeated(
        &dp,
        PROG_TC_EGRESS,
        &reply.bytes(),
        Counter::ReplyTranslated,
    );
    let not_service = {
        let f = Pkt6::tcp(CLIENT, 50_001, POD, 80, ACK).bytes();
        common_datapath::try_run(&dp.bpf, PROG_TC_INGRESS, &f, 100_000)
            .unwrap()
            .2
    };
    println!(
        "IPv6 per-packet cost (BPF_PROG_TEST_RUN): new flow median {} ns (p90 {} ns, single runs), \
         established {} ns, reply {} ns, not a Service {} ns",
        new_flow[new_flow.len() / 2].as_nanos(),
        new_flow[new_flow.len() * 9 / 10].as_nanos(),
        established.as_nanos(),
        reply_cost.as_nanos(),
        not_service.as_nanos(),
    );
}

#[test]
fn a_udp_flow_whose_backend_is_gone_moves_and_an_idle_one_is_picked_again() {
    let mut dp = Datapath::load();
    let q = Pkt6::udp(CLIENT, 36_000, VIP, 53);
    let id = picked(&q, &UDP_IDS);
    dp.step("first datagram", PROG_TC_INGRESS, &q.bytes(), TC_NEXT, NEW);
    // The backend goes away and another one takes its slot: the flow moves there.
    let other = if id == 11 { 12 } else { 11 };
    let key = Service6Key::new(VIP.octets(), 53u16.to_be_bytes(), proto::UDP, 0);
    dp.services()
        .insert(key, ServiceValue::frontend(1, 2), 0)
        .unwrap();
    dp.services()
        .insert(key.with_slot(1), ServiceValue::slot(other), 0)
        .unwrap();
    dp.backends().remove(&id).unwrap();
    dp.translated(
        "next datagram, backend gone: moved to the live backend",
        PROG_TC_INGRESS,
        &q,
        &[
            (Counter::StaleBackendReselected, 1),
            (Counter::PickRandom, 1),
        ],
        &dnated(&q, other),
    );
    assert!(
        dp.ct(&reply_key(&q, id)).is_none(),
        "the old REPLY entry is removed"
    );

    // An entry idle past its timeout is replaced by a new pick.
    let original = original_key(&q);
    let mut ct = dp.ct(&original).unwrap();
    ct.last_seen_ns = 1;
    dp.conntrack().insert(original, ct, 0).unwrap();
    dp.step(
        "datagram after the idle timeout",
        PROG_TC_INGRESS,
        &q.bytes(),
        TC_NEXT,
        &[
            (Counter::ConntrackExpired, 1),
            (Counter::NewFlow, 1),
            (Counter::PickRandom, 1),
        ],
    );
    assert!(dp.ct(&original).unwrap().last_seen_ns > 1, "a fresh entry");
}

#[test]
fn load_balancer_source_ranges_take_ipv6_prefixes() {
    let mut dp = Datapath::load();
    let lb = Ipv6Addr::new(0xfd00, 0xab, 0, 0, 0, 0, 0, 1);
    let key = Service6Key::new(lb.octets(), 80u16.to_be_bytes(), proto::TCP, 0);
    dp.services()
        .insert(key.with_slot(1), ServiceValue::slot(1), 0)
        .unwrap();
    dp.services()
        .insert(
            key,
            ServiceValue::frontend_with_flags(1, 7, service_flags::SOURCE_RANGES),
            0,
        )
        .unwrap();
    {
        let mut ranges: LpmTrie<&mut MapData, SourceRange6Key, u32> =
            LpmTrie::try_from(dp.bpf.map_mut(MAP_SOURCE_RANGES6).unwrap()).unwrap();
        // fd00:244:1::/48 may reach the LB IP.
        let mut source = [0u8; 16];
        source[..6].copy_from_slice(&[0xfd, 0x00, 0x02, 0x44, 0x00, 0x01]);
        let data = SourceRange6Key {
            frontend_addr: lb.octets(),
            frontend_port: 80u16.to_be_bytes(),
            proto: proto::TCP,
            _pad: 0,
            source,
        };
        ranges
            .insert(&Key::new(SOURCE_RANGE6_FRONTEND_BITS + 48, data), 1, 0)
            .unwrap();
    }
    let inside = Pkt6::tcp(CLIENT, 47_000, lb, 80, SYN);
    dp.new_flow_dnated("from inside the range", &inside, 1);
    let outsider = Ipv6Addr::new(0xfd00, 0x999, 0, 0, 0, 0, 0, 1);
    dp.step(
        "from outside the range",
        PROG_TC_INGRESS,
        &Pkt6::tcp(outsider, 47_001, lb, 80, SYN).bytes(),
        TC_ACT_SHOT,
        &[(Counter::DropSourceRange, 1)],
    );
    // The same client on another frontend without ranges is not affected.
    let id = picked(&Pkt6::tcp(outsider, 47_002, VIP, 80, SYN), &TCP_IDS);
    let syn = Pkt6::tcp(outsider, 47_002, VIP, 80, SYN);
    dp.new_flow_dnated("a ClusterIP", &syn, id);
}

// Reply-tuple clash resolution (as tests/datapath.rs): no two live flows share a reply tuple; a
// new flow whose REPLY key another live flow holds leaves with another source port, and its
// replies go back to the client's own port. Flows straight to pods are tracked for this.

/// A second ClusterIP whose Services select the same pods as `VIP`'s.
const VIP2: Ipv6Addr = Ipv6Addr::new(0xfd00, 0x96, 0, 0, 0, 0, 0, 0x11);

fn two_frontends_one_backend() -> Datapath {
    let mut dp = Datapath::load();
    dp.set_service(VIP, 80, proto::TCP, 1, &[1]);
    dp.set_service(VIP2, 80, proto::TCP, 5, &[1]);
    dp.set_service(VIP, 53, proto::UDP, 2, &[11]);
    dp.set_service(VIP2, 53, proto::UDP, 6, &[11]);
    dp
}

/// As IPv4's `a_flow_never_moves_a_reply_entry_another_flow_took_after_its_own_was_evicted`.
#[test]
fn an_ipv6_flow_never_moves_a_reply_entry_another_flow_took_after_its_own_was_evicted() {
    let mut dp = two_frontends_one_backend();
    let a = Pkt6::tcp(CLIENT, 40_100, VIP, 80, SYN);
    dp.run(PROG_TC_INGRESS, &a.bytes());
    dp.conntrack()
        .remove(&reply_key(&a, 1))
        .expect("evict the first flow's REPLY");
    let b = Pkt6::tcp(CLIENT, 40_100, VIP2, 80, SYN);
    dp.run(PROG_TC_INGRESS, &b.bytes());
    let held = dp.ct(&reply_key(&b, 1)).expect("the second flow's REPLY");
    assert_eq!(
        held.frontend_addr,
        VIP2.octets(),
        "test setup: the second flow took the freed tuple"
    );
    let fin = Pkt6::tcp(CLIENT, 40_100, VIP, 80, FIN | ACK);
    dp.run(PROG_TC_INGRESS, &fin.bytes());
    assert_eq!(
        dp.ct(&reply_key(&b, 1)),
        Some(held),
        "the first flow's FIN must leave the second flow's REPLY entry as it was"
    );
}

fn original_key(p: &Pkt6) -> Ct6Key {
    let (sport, dport) = ports(p);
    Ct6Key {
        saddr: p.saddr.octets(),
        daddr: p.daddr.octets(),
        sport: sport.to_be_bytes(),
        dport: dport.to_be_bytes(),
        proto: p.proto(),
        dir: ct_dir::ORIGINAL,
        _pad: [0; 2],
    }
}

/// The REPLY key of `p`'s flow to backend `id` (the client's own port).
fn reply_key(p: &Pkt6, id: u32) -> Ct6Key {
    let (addr, port) = backend_addr(id);
    let (sport, _) = ports(p);
    Ct6Key {
        saddr: addr.octets(),
        daddr: p.saddr.octets(),
        sport: port.to_be_bytes(),
        dport: sport.to_be_bytes(),
        proto: p.proto(),
        dir: ct_dir::REPLY,
        _pad: [0; 2],
    }
}

/// The source port the datapath moves a clashing flow to when the first probe is free (the
/// flow-hash start in `CLASH_PORT_MIN..=CLASH_PORT_MAX`, proxy-ebpf `ipv6::conntrack`).
fn clash_port(p: &Pkt6) -> u16 {
    first_probe(p, CLASH_PORT_MIN, CLASH_PORT_MAX)
}

/// The first port a bounded probe over `min..=max` from `p`'s flow hash tries.
fn first_probe(p: &Pkt6, min: u16, max: u16) -> u16 {
    nth_probe(p, min, max, 0)
}

/// The `n`-th port a bounded probe over `min..=max` from `p`'s flow hash tries.
fn nth_probe(p: &Pkt6, min: u16, max: u16, n: u32) -> u16 {
    let (sport, dport) = ports(p);
    let hash = flow_hash6(
        DatapathConfig::DEFAULT.hash_seed,
        p.saddr.octets(),
        p.daddr.octets(),
        sport.to_be_bytes(),
        dport.to_be_bytes(),
        p.proto(),
    );
    PortProbe::new(hash, min, max).port(n)
}

fn with_sport(p: &Pkt6, port: u16) -> Pkt6 {
    let mut q = p.clone();
    set_ports(&mut q, port, ports(p).1);
    q
}

fn with_dport(p: &Pkt6, port: u16) -> Pkt6 {
    let mut q = p.clone();
    set_ports(&mut q, ports(p).0, port);
    q
}

/// A backend's `reply` as the client receives it: from `original`'s frontend.
fn rev_natted(reply: &Pkt6, original: &Pkt6) -> Pkt6 {
    let mut q = reply.clone();
    q.saddr = original.daddr;
    set_ports(&mut q, ports(original).1, ports(reply).1);
    q
}

const REMAPPED: &[(Counter, u64)] = &[
    (Counter::NewFlow, 1),
    (Counter::PickRandom, 1),
    (Counter::ReplyTupleRemapped, 1),
];

#[test]
fn one_client_port_through_two_frontends_to_one_backend_gets_unique_reply_tuples() {
    let mut dp = two_frontends_one_backend();
    let a = Pkt6::tcp(CLIENT, 40_000, VIP, 80, SYN);
    dp.new_flow_dnated("first flow: DNAT, the client's own port", &a, 1);
    let b = Pkt6::tcp(CLIENT, 40_000, VIP2, 80, SYN);
    let moved = clash_port(&b);
    dp.translated(
        "second flow: same client port, other VIP, same backend: DNAT and another source port",
        PROG_TC_INGRESS,
        &b,
        REMAPPED,
        &with_sport(&dnated(&b, 1), moved),
    );
    let ct = dp.ct(&original_key(&b)).expect("second flow's ORIGINAL");
    assert_eq!(ct.flags & ct_flags::SPORT_NAT, ct_flags::SPORT_NAT);
    assert_eq!(u16::from_be_bytes(ct.nat_sport), moved);
    let first = dp.ct(&reply_key(&a, 1)).expect("first flow's REPLY");
    assert_eq!(
        first.frontend_addr,
        VIP.octets(),
        "first flow's REPLY still its own"
    );

    // Each backend reply goes to its own flow: source = its VIP, destination = the client port.
    let reply_b = with_dport(&dnated(&b, 1).reversed(), moved);
    dp.translated(
        "reply on the moved port: from VIP2:80, back to the client's own port",
        PROG_TC_EGRESS,
        &reply_b,
        REPLY,
        &with_dport(&rev_natted(&reply_b, &b), 40_000),
    );
    let reply_a = dnated(&a, 1).reversed();
    dp.reply_rev_natted("reply on the client's port: from VIP:80", &reply_a, &a);
    let ack_b = Pkt6::tcp(CLIENT, 40_000, VIP2, 80, ACK);
    dp.translated(
        "the second flow's next packet keeps the moved port",
        PROG_TC_INGRESS,
        &ack_b,
        ESTABLISHED,
        &with_sport(&dnated(&ack_b, 1), moved),
    );

    // Ending the second flow never removes the first one's entries.
    dp.run(
        PROG_TC_INGRESS,
        &Pkt6::tcp(CLIENT, 40_000, VIP2, 80, RST | ACK).bytes(),
    );
    dp.set_service(VIP2, 80, proto::TCP, 5, &[]);
    dp.run(
        PROG_TC_INGRESS,
        &Pkt6::tcp(CLIENT, 40_000, VIP2, 80, SYN).bytes(),
    );
    assert!(
        dp.ct(&original_key(&b)).is_none(),
        "the second flow is gone"
    );
    assert!(
        dp.ct(&reply_key(&a, 1))
            .is_some_and(|v| v.frontend_addr == VIP.octets()),
        "the first flow's REPLY entry survives the second flow's end"
    );
    dp.reply_rev_natted("the first flow still answers from VIP:80", &reply_a, &a);
}

/// As tests/datapath.rs: a clash probe reaching another client port's live flow to the same
/// frontend and backend treats it as taken, never as its own entry to overwrite.
#[test]
fn a_clash_probe_never_takes_the_reply_tuple_of_another_port_s_flow_to_the_same_frontend() {
    let mut dp = two_frontends_one_backend();
    let b = Pkt6::tcp(CLIENT, 45_000, VIP, 80, SYN);
    let probed = clash_port(&b);
    dp.new_flow_dnated(
        "VIP2 flow from 45000",
        &Pkt6::tcp(CLIENT, 45_000, VIP2, 80, SYN),
        1,
    );
    let a = Pkt6::tcp(CLIENT, probed, VIP, 80, SYN);
    dp.new_flow_dnated("VIP flow from the probed port", &a, 1);
    let next = (1..CLASH_PROBES)
        .map(|n| nth_probe(&b, CLASH_PORT_MIN, CLASH_PORT_MAX, n))
        .find(|&port| port != 45_000 && port != probed)
        .expect("a later probe");
    dp.translated(
        "VIP flow from 45000: its own tuple and first probe held, the next probe free",
        PROG_TC_INGRESS,
        &b,
        REMAPPED,
        &with_sport(&dnated(&b, 1), next),
    );
    let reply_a = dnated(&a, 1).reversed();
    dp.reply_rev_natted(
        "the probed port's flow still gets its own replies",
        &reply_a,
        &a,
    );
    let reply_b = with_dport(&dnated(&b, 1).reversed(), next);
    dp.translated(
        "the moved flow's replies go back to 45000",
        PROG_TC_EGRESS,
        &reply_b,
        REPLY,
        &with_dport(&rev_natted(&reply_b, &b), 45_000),
    );
    let _ = dp.ct(&original_key(&b)).expect("moved flow tracked");
}

#[test]
fn udp_datagrams_alternating_between_two_vips_come_back_from_the_right_one() {
    let dp = two_frontends_one_backend();
    let q1 = Pkt6::udp(CLIENT, 41_000, VIP, 53).payload(b"q1");
    let q2 = Pkt6::udp(CLIENT, 41_000, VIP2, 53).payload(b"q2");
    let moved = clash_port(&q2);
    for round in 0..3 {
        let established: &[(Counter, u64)] = ESTABLISHED;
        let out = dp.step(
            "to VIP",
            PROG_TC_INGRESS,
            &q1.bytes(),
            TC_NEXT,
            if round == 0 { NEW } else { established },
        );
        assert_packet("to VIP", &out, &dnated(&q1, 11));
        let out = dp.step(
            "to VIP2",
            PROG_TC_INGRESS,
            &q2.bytes(),
            TC_NEXT,
            if round == 0 { REMAPPED } else { established },
        );
        assert_packet(
            "to VIP2: moved to another port",
            &out,
            &with_sport(&dnated(&q2, 11), moved),
        );
        let r1 = dnated(&q1, 11).reversed().payload(b"a1");
        dp.reply_rev_natted("answer to VIP's query: from VIP", &r1, &q1);
        let r2 = with_dport(&dnated(&q2, 11).reversed().payload(b"a2"), moved);
        dp.translated(
            "answer to VIP2's query: from VIP2, to the client's port",
            PROG_TC_EGRESS,
            &r2,
            REPLY,
            &with_dport(&rev_natted(&r2, &q2), 41_000),
        );
    }
}

#[test]
fn a_vip_flow_and_a_direct_flow_from_one_port_to_one_pod_keep_their_replies() {
    let dp = two_frontends_one_backend();
    let (pod, pod_port) = backend_addr(1);
    // VIP first, then straight to the pod from the same port.
    let v = Pkt6::tcp(CLIENT, 42_000, VIP, 80, SYN);
    dp.step("VIP flow", PROG_TC_INGRESS, &v.bytes(), TC_NEXT, NEW);
    let d = Pkt6::tcp(CLIENT, 42_000, pod, pod_port, SYN);
    let moved = clash_port(&d);
    dp.translated(
        "direct flow on the VIP flow's reply tuple: only its source port moves",
        PROG_TC_INGRESS,
        &d,
        &[(Counter::DirectFlow, 1), (Counter::ReplyTupleRemapped, 1)],
        &with_sport(&d, moved),
    );
    let ack = Pkt6::tcp(CLIENT, 42_000, pod, pod_port, ACK);
    dp.translated(
        "the direct flow's next packet: the direct flow keeps its moved port",
        PROG_TC_INGRESS,
        &ack,
        &[(Counter::DirectFlow, 1)],
        &with_sport(&ack, moved),
    );
    let d_reply = with_dport(&d.reversed(), moved);
    dp.translated(
        "the pod's answer to the direct flow: from the pod, to the client's port",
        PROG_TC_EGRESS,
        &d_reply,
        &[(Counter::DirectFlow, 1)],
        &with_dport(&d_reply, 42_000),
    );
    let v_reply = dnated(&v, 1).reversed();
    dp.reply_rev_natted("the VIP flow's answer: from the VIP", &v_reply, &v);

    // Straight to the pod first, then through the VIP from the same port.
    let d2 = Pkt6::tcp(CLIENT, 42_100, pod, pod_port, SYN);
    let out = dp.step(
        "direct flow",
        PROG_TC_INGRESS,
        &d2.bytes(),
        TC_NEXT,
        NOT_SERVICE,
    );
    assert_eq!(out, d2.bytes(), "direct flow: tracked, untouched");
    let v2 = Pkt6::tcp(CLIENT, 42_100, VIP, 80, SYN);
    let moved2 = clash_port(&v2);
    dp.translated(
        "VIP flow on the direct flow's tuple: DNAT and another source port",
        PROG_TC_INGRESS,
        &v2,
        REMAPPED,
        &with_sport(&dnated(&v2, 1), moved2),
    );
    let out = dp.step(
        "the pod's answer to the direct flow",
        PROG_TC_EGRESS,
        &d2.reversed().bytes(),
        TC_NEXT,
        &[(Counter::ReplyNotTracked, 1)],
    );
    assert_eq!(out, d2.reversed().bytes(), "passes untranslated");
}

/// As tests/datapath.rs: a connection reopening a closed flow's tuple to another backend leaves
/// the old reply tuple held (`ct_flags::RETIRED`) while that backend may be in TIME_WAIT.
#[test]
fn a_reopened_flow_s_old_reply_tuple_stays_held_while_the_backend_may_be_in_time_wait() {
    let mut dp = two_frontends_one_backend();
    let a = Pkt6::tcp(CLIENT, 44_000, VIP, 80, SYN);
    dp.new_flow_dnated("first connection", &a, 1);
    dp.run(
        PROG_TC_INGRESS,
        &Pkt6::tcp(CLIENT, 44_000, VIP, 80, RST | ACK).bytes(),
    );
    dp.set_service(VIP, 80, proto::TCP, 1, &[2]);
    dp.new_flow_dnated(
        "a SYN on the closed flow's tuple: to the new backend",
        &a,
        2,
    );
    let retired = dp.ct(&reply_key(&a, 1)).expect("the old REPLY entry stays");
    assert_eq!(
        retired.flags & ct_flags::RETIRED,
        ct_flags::RETIRED,
        "retired: {retired:?}"
    );
    let out = dp.step(
        "a late packet from the old backend",
        PROG_TC_EGRESS,
        &dnated(&a, 1).reversed().bytes(),
        TC_NEXT,
        &[(Counter::ReplyNotTracked, 1)],
    );
    assert_eq!(out, dnated(&a, 1).reversed().bytes(), "passes untranslated");
    dp.reply_rev_natted(
        "the new backend's answer comes from the VIP",
        &dnated(&a, 2).reversed(),
        &a,
    );
    let b = Pkt6::tcp(CLIENT, 44_000, VIP2, 80, SYN);
    dp.translated(
        "a flow onto the retired tuple gets another source port",
        PROG_TC_INGRESS,
        &b,
        REMAPPED,
        &with_sport(&dnated(&b, 1), clash_port(&b)),
    );
    let mut aged = retired;
    aged.last_seen_ns = 0;
    dp.conntrack()
        .insert(reply_key(&a, 1), aged, 0)
        .expect("age the retired entry");
    let (pod, pod_port) = backend_addr(1);
    let d = Pkt6::tcp(CLIENT, 44_000, pod, pod_port, SYN);
    let out = dp.step(
        "a direct connection on the idle retired tuple",
        PROG_TC_INGRESS,
        &d.bytes(),
        TC_NEXT,
        &[(Counter::NotService, 1), (Counter::ReplyTupleReclaimed, 1)],
    );
    assert_eq!(out, d.bytes(), "it keeps its port");
    assert!(
        dp.ct(&reply_key(&a, 1)).is_none(),
        "the idle retired entry is gone"
    );
    let reopened = dp.ct(&original_key(&a)).expect("the reopened flow stays");
    assert_eq!(reopened.backend_addr, backend_addr(2).0.octets());
}

#[test]
fn a_closed_vip_flow_s_reply_tuple_is_reclaimed_and_evicted_entries_come_back() {
    let mut dp = Datapath::load_with(DatapathConfig {
        tcp_transitory_timeout_s: 1,
        ..DatapathConfig::DEFAULT
    });
    dp.set_service(VIP, 80, proto::TCP, 1, &[1]);
    let (pod, pod_port) = backend_addr(1);
    let v = Pkt6::tcp(CLIENT, 43_000, VIP, 80, SYN);
    dp.run(PROG_TC_INGRESS, &v.bytes());
    // The VIP flow ended long ago (both entries idle past the 1 s timeout).
    for key in [original_key(&v), reply_key(&v, 1)] {
        let mut e = dp.ct(&key).expect("entry");
        e.last_seen_ns = 0;
        e.state = ct_state::CLOSING;
        dp.conntrack().insert(key, e, 0).expect("age entry");
    }
    let d = Pkt6::tcp(CLIENT, 43_000, pod, pod_port, SYN);
    let out = dp.step(
        "a new direct connection on a dead flow's tuple",
        PROG_TC_INGRESS,
        &d.bytes(),
        TC_NEXT,
        &[(Counter::NotService, 1), (Counter::ReplyTupleReclaimed, 1)],
    );
    assert_eq!(out, d.bytes(), "it keeps its port");
    assert!(
        dp.ct(&original_key(&v)).is_none(),
        "dead flow's ORIGINAL gone"
    );
    assert!(dp.ct(&reply_key(&v, 1)).is_none(), "dead flow's REPLY gone");
    let out = dp.step(
        "the pod's answer",
        PROG_TC_EGRESS,
        &d.reversed().bytes(),
        TC_NEXT,
        &[(Counter::ReplyNotTracked, 1)],
    );
    assert_eq!(out, d.reversed().bytes(), "not rewritten to the VIP");

    // A live flow survives the eviction of either entry.
    let live = Pkt6::tcp(CLIENT, 43_100, VIP, 80, SYN);
    dp.run(PROG_TC_INGRESS, &live.bytes());
    dp.run(PROG_TC_EGRESS, &syn_ack_from(&live, 1).bytes());
    dp.conntrack()
        .remove(&reply_key(&live, 1))
        .expect("evict REPLY");
    let ack = Pkt6::tcp(CLIENT, 43_100, VIP, 80, ACK);
    dp.translated(
        "a packet whose REPLY entry was evicted: DNATed, its REPLY entry written again",
        PROG_TC_INGRESS,
        &ack,
        &[
            (Counter::EstablishedFlow, 1),
            (Counter::ConntrackRestored, 1),
        ],
        &dnated(&ack, 1),
    );
    assert!(dp.ct(&reply_key(&live, 1)).is_some(), "REPLY back");
    let reply = dnated(&live, 1).reversed();
    dp.conntrack()
        .remove(&original_key(&live))
        .expect("evict ORIGINAL");
    dp.translated(
        "a reply whose ORIGINAL entry was evicted: translated, its ORIGINAL written again",
        PROG_TC_EGRESS,
        &reply,
        &[
            (Counter::ReplyTranslated, 1),
            (Counter::ConntrackRestored, 1),
        ],
        &rev_natted(&reply, &live),
    );
    // The Service changes: without the restored ORIGINAL, the client's next packet would be a
    // new flow to whatever the Service holds now.
    dp.set_service(VIP, 80, proto::TCP, 1, &[1, 2]);
    dp.translated(
        "the client's next packet keeps its backend",
        PROG_TC_INGRESS,
        &ack,
        ESTABLISHED,
        &dnated(&ack, 1),
    );
}

#[test]
fn an_icmpv6_error_about_a_moved_flow_quotes_the_client_s_own_port() {
    let dp = two_frontends_one_backend();
    dp.run(
        PROG_TC_INGRESS,
        &Pkt6::tcp(CLIENT, 44_000, VIP, 80, SYN).bytes(),
    );
    let b = Pkt6::tcp(CLIENT, 44_000, VIP2, 80, SYN);
    let moved = clash_port(&b);
    dp.step("moved flow", PROG_TC_INGRESS, &b.bytes(), TC_NEXT, REMAPPED);
    // Packet Too Big about client:moved → backend, from a router on the way.
    let quoted = with_sport(&dnated(&b, 1), moved).l3_bytes();
    // From VIP2, quoting client:44000 → VIP2:80.
    let mut want_quoted = quoted.clone();
    want_quoted[24..40].copy_from_slice(&VIP2.octets());
    want_quoted[40..42].copy_from_slice(&44_000u16.to_be_bytes());
    want_quoted[42..44].copy_from_slice(&80u16.to_be_bytes());
    dp.ptb_reverse_translated("PTB about the moved flow", &quoted, VIP2, &want_quoted);
}

// Session affinity (ClientIP) and least connection on IPv6 (as tests/datapath.rs): records in
// AFFINITY6_V1 per (Service port scope, client), usable while AFFMATCH6_V1 names the backend and
// the last use is within the timeout; lc counts in LCFLOWS_V1 (shared with IPv4 by backend id).

/// The scope id the affinity tests give their Service port.
const AFFINITY_ID: u32 = 9;

fn vip_key(port: u16, proto_: u8) -> Service6Key {
    Service6Key::new(VIP.octets(), port.to_be_bytes(), proto_, 0)
}

impl Datapath {
    fn affinity(&mut self) -> HashMap<&mut MapData, Affinity6Key, AffinityValue> {
        HashMap::try_from(self.bpf.map_mut(MAP_AFFINITY6).unwrap()).unwrap()
    }

    fn affinity_matches(&mut self) -> HashMap<&mut MapData, Affinity6MatchKey, u32> {
        HashMap::try_from(self.bpf.map_mut(MAP_AFFINITY_MATCH6).unwrap()).unwrap()
    }

    fn affinity_record(&mut self, client: Ipv6Addr) -> Option<AffinityValue> {
        let key = Affinity6Key {
            affinity_id: AFFINITY_ID,
            client: client.octets(),
        };
        self.affinity().get(&key, 0).ok()
    }

    fn set_affinity_record(&mut self, client: Ipv6Addr, backend_id: u32, last_used_ns: u64) {
        let key = Affinity6Key {
            affinity_id: AFFINITY_ID,
            client: client.octets(),
        };
        let value = AffinityValue {
            backend_id,
            _pad: 0,
            last_used_ns,
        };
        self.affinity().insert(key, value, 0).unwrap();
    }

    /// VIP:80/TCP as the agent writes an affinity frontend (backends → slots → match entries →
    /// frontend), timeout `timeout_s`.
    fn set_affinity_frontend(&mut self, timeout_s: u32, ids: &[u32]) {
        self.set_service(VIP, 80, proto::TCP, 1, ids);
        let key = vip_key(80, proto::TCP);
        let stale: Vec<Affinity6MatchKey> = self
            .affinity_matches()
            .keys()
            .map(|k| k.unwrap())
            .filter(|k| !ids.contains(&k.backend_id))
            .collect();
        for k in stale {
            self.affinity_matches().remove(&k).unwrap();
        }
        for &backend_id in ids {
            let m = Affinity6MatchKey {
                frontend: key,
                backend_id,
            };
            self.affinity_matches().insert(m, 1, 0).unwrap();
        }
        let mut value = ServiceValue::frontend(ids.len() as u16, 1);
        value.flags |= service_flags::AFFINITY;
        value.affinity_timeout_s = timeout_s;
        value.affinity_id = AFFINITY_ID;
        self.services().insert(key, value, 0).unwrap();
    }

    fn set_scheduler(&mut self, key: Service6Key, code: u8) {
        let mut v = self.services().get(&key, 0).unwrap();
        v.scheduler = code;
        self.services().insert(key, v, 0).unwrap();
    }

    /// Backend `id`'s effective least-connection count (what lc compares).
    fn lc_count(&self, id: u32) -> u64 {
        let array = |name| -> Array<&MapData, u64> {
            Array::try_from(self.bpf.map(name).unwrap()).unwrap()
        };
        let active = array(MAP_LC_FLOWS).get(&id, 0).unwrap();
        let adjust = array(MAP_LC_ADJUST).get(&id, 0).unwrap();
        proxy_common::lc::effective(active, adjust)
    }

    fn lc_counts(&self, ids: &[u32]) -> Vec<u64> {
        ids.iter().map(|&id| self.lc_count(id)).collect()
    }

    /// A new flow's first packet through tc ingress: the backend its conntrack entry names.
    fn new_flow_backend(&mut self, p: &Pkt6) -> u32 {
        let (verdict, _) = self.run(PROG_TC_INGRESS, &p.bytes());
        assert_eq!(verdict, TC_NEXT, "new flow {p:?}");
        self.ct(&original_key(p)).expect("entry").backend_id
    }
}

const AFFINITY_MISS: &[(Counter, u64)] = &[
    (Counter::NewFlow, 1),
    (Counter::PickRandom, 1),
    (Counter::AffinityMiss, 1),
];
const AFFINITY_HIT: &[(Counter, u64)] = &[(Counter::NewFlow, 1), (Counter::AffinityHit, 1)];

#[test]
fn affinity_sends_an_ipv6_client_s_new_flows_to_one_backend_until_it_expires_or_leaves() {
    let mut dp = Datapath::load();
    let ids = [1, 2];
    dp.set_affinity_frontend(60, &ids);
    let before = monotonic_ns();
    let first = Pkt6::tcp(CLIENT, 40_000, VIP, 80, SYN);
    let chosen = picked(&first, &ids);
    dp.translated(
        "first flow: a client's first flow: the scheduler's pick",
        PROG_TC_INGRESS,
        &first,
        AFFINITY_MISS,
        &dnated(&first, chosen),
    );
    let record = dp.affinity_record(CLIENT).expect("record written");
    assert_eq!(record.backend_id, chosen);
    assert!(record.last_used_ns >= before);
    let mut hashed_elsewhere = 0;
    for sport in 40_001..40_021 {
        let syn = Pkt6::tcp(CLIENT, sport, VIP, 80, SYN);
        hashed_elsewhere += usize::from(picked(&syn, &ids) != chosen);
        dp.translated(
            "another new flow: the recorded backend",
            PROG_TC_INGRESS,
            &syn,
            AFFINITY_HIT,
            &dnated(&syn, chosen),
        );
    }
    assert!(
        hashed_elsewhere > 3,
        "the flows would have spread without affinity"
    );
    // Packets of a known flow do not look at the record.
    let stamped = dp.affinity_record(CLIENT).unwrap().last_used_ns;
    let ack = Pkt6::tcp(CLIENT, 40_000, VIP, 80, ACK);
    dp.step(
        "established",
        PROG_TC_INGRESS,
        &ack.bytes(),
        TC_NEXT,
        ESTABLISHED,
    );
    assert_eq!(dp.affinity_record(CLIENT).unwrap().last_used_ns, stamped);

    // A record last used at boot, with a 1 s timeout: expired, a fresh pick replaces it.
    dp.set_affinity_frontend(1, &ids);
    let other = if chosen == 1 { 2 } else { 1 };
    let sport = (41_000..42_000)
        .find(|&s| picked(&Pkt6::tcp(CLIENT, s, VIP, 80, SYN), &ids) == other)
        .unwrap();
    dp.set_affinity_record(CLIENT, chosen, 0);
    let syn = Pkt6::tcp(CLIENT, sport, VIP, 80, SYN);
    dp.translated(
        "expired record: a fresh pick",
        PROG_TC_INGRESS,
        &syn,
        AFFINITY_MISS,
        &dnated(&syn, other),
    );
    assert_eq!(dp.affinity_record(CLIENT).unwrap().backend_id, other);

    // The recorded endpoint leaves the Service (its backend entry stays): the remaining one.
    dp.set_affinity_frontend(3_600, &[chosen]);
    assert!(
        dp.backends().get(&other, 0).is_ok(),
        "the backend still exists"
    );
    let syn = Pkt6::tcp(CLIENT, 43_000, VIP, 80, SYN);
    dp.translated(
        "recorded endpoint gone: a new pick among the remaining",
        PROG_TC_INGRESS,
        &syn,
        AFFINITY_MISS,
        &dnated(&syn, chosen),
    );
    assert_eq!(dp.affinity_record(CLIENT).unwrap().backend_id, chosen);

    // Affinity off (the frontend entry): the scheduler again, no record looked at.
    dp.set_service(VIP, 80, proto::TCP, 1, &ids);
    for sport in 44_000..44_010 {
        let syn = Pkt6::tcp(CLIENT, sport, VIP, 80, SYN);
        assert_eq!(
            dp.new_flow_backend(&syn),
            picked(&syn, &ids),
            "affinity off: the hash"
        );
    }
}

/// lc: while backend 1 holds long flows, new flows go to the idle backend 2 until it holds as
/// many; counts follow every flow's end (client RST, FIN from both sides, replacement) back to 0.
#[test]
fn least_connection_on_ipv6_sends_new_flows_to_the_least_loaded_and_counts_follow_flow_ends() {
    let mut dp = Datapath::load();
    let ids = [1, 2];
    dp.set_service(VIP, 80, proto::TCP, 1, &ids);
    // Two long flows to backend 1, started under random (every translated flow is counted).
    let long: Vec<u16> = (40_000..41_000)
        .filter(|&s| picked(&Pkt6::tcp(CLIENT, s, VIP, 80, SYN), &ids) == 1)
        .take(2)
        .collect();
    for &port in &long {
        assert_eq!(
            dp.new_flow_backend(&Pkt6::tcp(CLIENT, port, VIP, 80, SYN)),
            1
        );
    }
    assert_eq!(dp.lc_counts(&ids), [2, 0]);
    dp.set_scheduler(vip_key(80, proto::TCP), sched::code::LEAST_CONNECTION);
    let lc_new: &[(Counter, u64)] = &[(Counter::NewFlow, 1), (Counter::PickLeastConnection, 1)];
    for (i, port) in [50_000u16, 50_001].into_iter().enumerate() {
        let syn = Pkt6::tcp(CLIENT, port, VIP, 80, SYN);
        let out = dp.step(
            "lc new flow",
            PROG_TC_INGRESS,
            &syn.bytes(),
            TC_NEXT,
            lc_new,
        );
        assert_packet("lc: the idle backend", &out, &dnated(&syn, 2));
        assert_eq!(dp.lc_counts(&ids), [2, i as u64 + 1]);
    }
    // Backend 1's flows end: a client RST, then a FIN from each side.
    let rst = Pkt6::tcp(CLIENT, long[0], VIP, 80, RST | ACK);
    dp.step(
        "client RST",
        PROG_TC_INGRESS,
        &rst.bytes(),
        TC_NEXT,
        ESTABLISHED,
    );
    assert_eq!(dp.lc_counts(&ids), [1, 2], "a RST ends a counted flow");
    let fin = Pkt6::tcp(CLIENT, long[1], VIP, 80, FIN | ACK);
    dp.step(
        "client FIN",
        PROG_TC_INGRESS,
        &fin.bytes(),
        TC_NEXT,
        ESTABLISHED,
    );
    assert_eq!(
        dp.lc_counts(&ids),
        [1, 2],
        "a half-closed flow still counts"
    );
    let backend_fin = dnated(&fin, 1).reversed();
    dp.step(
        "backend FIN",
        PROG_TC_EGRESS,
        &backend_fin.bytes(),
        TC_NEXT,
        REPLY,
    );
    assert_eq!(
        dp.lc_counts(&ids),
        [0, 2],
        "both of backend 1's flows ended"
    );
    // Retransmitted RST / FIN of a closed flow: no second decrement.
    dp.run(PROG_TC_INGRESS, &rst.bytes());
    dp.run(PROG_TC_EGRESS, &backend_fin.bytes());
    assert_eq!(
        dp.lc_counts(&ids),
        [0, 2],
        "each flow gives its unit back once"
    );
    // The emptied backend gets the next new flows.
    assert_eq!(
        dp.new_flow_backend(&Pkt6::tcp(CLIENT, 50_002, VIP, 80, SYN)),
        1
    );
    assert_eq!(
        dp.new_flow_backend(&Pkt6::tcp(CLIENT, 50_003, VIP, 80, SYN)),
        1
    );
    assert_eq!(dp.lc_counts(&ids), [2, 2]);
    // A SYN on a closed flow's tuple replaces it: counted once, as a new flow.
    let again = dp.new_flow_backend(&Pkt6::tcp(CLIENT, long[0], VIP, 80, SYN));
    let mut want = vec![2, 2];
    want[again as usize - 1] += 1;
    assert_eq!(dp.lc_counts(&ids), want);
    // Every open flow ends with a RST (from the client, or from the backend through egress).
    for (i, port) in [long[0], 50_000, 50_001, 50_002, 50_003]
        .into_iter()
        .enumerate()
    {
        let rst = Pkt6::tcp(CLIENT, port, VIP, 80, RST | ACK);
        if i % 2 == 0 {
            dp.run(PROG_TC_INGRESS, &rst.bytes());
        } else {
            let id = dp.ct(&original_key(&rst)).expect("open flow").backend_id;
            dp.run(PROG_TC_EGRESS, &dnated(&rst, id).reversed().bytes());
        }
    }
    assert_eq!(dp.lc_counts(&ids), [0, 0], "every flow ended");
}

// The IPv6 Service address space (SVCCIDRS6_V1, as SVCCIDRS_V1): new flows to no frontend
// inside it are answered (an allocated ClusterIP's other ports) or dropped (unallocated).

/// The IPv6 Service CIDR of these tests (VIP and VIP_EMPTY are inside it).
const SERVICE_CIDR6: (Ipv6Addr, u32) = (Ipv6Addr::new(0xfd00, 0x96, 0, 0, 0, 0, 0, 0), 112);

impl Datapath {
    fn set_service_cidr6(&mut self, addr: Ipv6Addr, prefix: u32, what: u32) {
        let mut trie: LpmTrie<&mut MapData, [u8; 16], u32> =
            LpmTrie::try_from(self.bpf.map_mut(MAP_SERVICE_CIDRS6).unwrap()).unwrap();
        trie.insert(&Key::new(prefix, addr.octets()), what, 0)
            .unwrap();
    }
}

#[test]
fn new_flows_to_no_frontend_in_the_ipv6_service_cidr_are_answered_or_dropped() {
    let mut dp = Datapath::load();
    dp.set_service_cidr6(SERVICE_CIDR6.0, SERVICE_CIDR6.1, service_cidr::UNALLOCATED);
    dp.set_service_cidr6(VIP, 128, service_cidr::CLUSTER_IP);
    let port_rejected: &[(Counter, u64)] = &[(Counter::ClusterIpPortRejected, 1)];
    for (what, pkt) in [
        (
            "TCP SYN to a ClusterIP's other port",
            Pkt6::tcp(CLIENT, 46_000, VIP, 443, SYN),
        ),
        (
            "UDP to a ClusterIP's other port",
            Pkt6::udp(CLIENT, 46_001, VIP, 9_999),
        ),
    ] {
        let input = pkt.bytes();
        let out = dp.step(
            what,
            PROG_TC_INGRESS,
            &input,
            TC_ACT_REDIRECT,
            port_rejected,
        );
        check_icmp6_unreachable(what, &input, &out);
    }
    let unallocated = Ipv6Addr::new(0xfd00, 0x96, 0, 0, 0, 0, 0, 0x77);
    let dropped: &[(Counter, u64)] = &[(Counter::DropUnallocatedServiceIp, 1)];
    for (what, pkt) in [
        (
            "TCP SYN to an unallocated address",
            Pkt6::tcp(CLIENT, 46_002, unallocated, 80, SYN),
        ),
        (
            "UDP to an unallocated address",
            Pkt6::udp(CLIENT, 46_003, unallocated, 53),
        ),
    ] {
        dp.step(what, PROG_TC_INGRESS, &pkt.bytes(), TC_ACT_SHOT, dropped);
    }
    // Mid-connection TCP (a flow from before the agent) and addresses outside pass; the
    // ClusterIP's own ports are translated as ever.
    for (what, pkt) in [
        (
            "mid-connection TCP to an unallocated address",
            Pkt6::tcp(CLIENT, 46_004, unallocated, 80, ACK),
        ),
        ("TCP SYN to a pod", Pkt6::tcp(CLIENT, 46_005, POD, 80, SYN)),
    ] {
        let out = dp.step(what, PROG_TC_INGRESS, &pkt.bytes(), TC_NEXT, NOT_SERVICE);
        assert_eq!(out, pkt.bytes(), "{what}: untouched");
    }
    let syn = Pkt6::tcp(CLIENT, 46_006, VIP, 80, SYN);
    dp.new_flow_dnated("SYN to the ClusterIP's port", &syn, picked(&syn, &TCP_IDS));
    // A Service without endpoints still answers as one (not as a port of no Service).
    dp.set_service_cidr6(VIP_EMPTY, 128, service_cidr::CLUSTER_IP);
    let empty = Pkt6::udp(CLIENT, 46_007, VIP_EMPTY, 53).bytes();
    let out = dp.step(
        "UDP to a Service without endpoints",
        PROG_TC_INGRESS,
        &empty,
        TC_ACT_REDIRECT,
        &[(Counter::NoEndpointsRejected, 1)],
    );
    check_icmp6_unreachable("UDP to a Service without endpoints", &empty, &out);
}

#[test]
fn an_icmpv6_error_whose_quoted_packet_has_extension_headers_is_reverse_translated() {
    let dp = Datapath::load();
    let data = Pkt6::tcp(CLIENT, 47_000, VIP, 80, SYN);
    let id = picked(&data, &TCP_IDS);
    dp.step("SYN", PROG_TC_INGRESS, &data.bytes(), TC_NEXT, NEW);
    // The quoted packet carries destination options, or is a datagram's first fragment: its
    // ports are found after the quoted extension headers.
    for (what, ext, ext_len) in [
        (
            "destination options",
            Ext6::options(ext6::DEST_OPTS, 16),
            16,
        ),
        ("a first fragment", Ext6::fragment(0, true, 7), 8),
    ] {
        let quoted = dnated(&data, id).ext(ext).l3_bytes();
        // From the VIP, quoting client → VIP:80.
        let mut want_quoted = quoted.clone();
        want_quoted[24..40].copy_from_slice(&VIP.octets());
        let dport = 40 + ext_len + 2;
        want_quoted[dport..dport + 2].copy_from_slice(&80u16.to_be_bytes());
        dp.ptb_reverse_translated(what, &quoted, VIP, &want_quoted);
    }
    // A quoted later fragment has no ports to find: passed untouched.
    let later = dnated(&data, id)
        .ext(Ext6::fragment(1, false, 7))
        .l3_bytes();
    dp.ptb_untouched("a quoted later fragment", &later);
}

/// An IPv6 node address with an eTP=Local NodePort and an external client.
const NODE6: Ipv6Addr = Ipv6Addr::new(0xfd00, 0x50, 0, 0, 0, 0, 0, 0x10);
const EXT_CLIENT6: Ipv6Addr = Ipv6Addr::new(0xfd00, 0x50, 0, 0, 0, 0, 0, 0x100);

/// As on IPv4: a pod (inside the IPv6 cluster CIDR) reaching an eTP=Local NodePort without a
/// local endpoint goes to the Service's cluster-wide endpoints through the in-cluster entry
/// (its rev-NAT id in conntrack, replies from the NodePort); a client outside the CIDR, or any
/// client while no IPv6 cluster CIDR is written, is dropped (no local endpoint).
#[test]
fn etp_local_on_ipv6_in_cluster_clients_use_the_cluster_endpoints_outside_clients_are_dropped() {
    let mut dp = Datapath::load();
    let port: u16 = 30_082;
    let external = Service6Key::new(NODE6.octets(), port.to_be_bytes(), proto::TCP, 0);
    let local_only =
        service_flags::EXTERNAL | service_flags::EXTERNAL_LOCAL | service_flags::DROP_WHEN_EMPTY;
    dp.set_frontend_entry(external, local_only, 60, &[]);
    let internal = Service6Key {
        scope: SCOPE_INTERNAL,
        ..external
    };
    dp.set_frontend_entry(internal, 0, 61, &[2]);
    let dropped = &[(Counter::DropNoLocalEndpoints, 1)];

    let early = Pkt6::tcp(CLIENT, 44_000, NODE6, port, SYN);
    dp.step(
        "pod → eTP=Local NodePort, no IPv6 cluster CIDR yet: external, dropped",
        PROG_TC_INGRESS,
        &early.bytes(),
        TC_ACT_SHOT,
        dropped,
    );

    // Written as the agent writes them (host bits cleared, the old entries replaced); the map
    // stays referenced by the programs after it is taken out of the object.
    let mut cidrs = ClusterCidrs6Map::from_ebpf(&mut dp.bpf).unwrap();
    cidrs
        .sync(&[(Ipv6Addr::new(0xfd00, 0x99, 0, 0, 0, 0, 0, 0), 32)])
        .unwrap();
    cidrs
        .sync(&[(Ipv6Addr::new(0xfd00, 0x244, 0, 0, 0, 0, 0, 7), 32)])
        .unwrap();
    let err = cidrs
        .sync(&[(Ipv6Addr::new(0xfd00, 0x244, 0, 0, 0, 0, 0, 0), 129)])
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("CLUSTERCIDRS6_V1") && err.contains("/129"),
        "the error names the map and the prefix: {err}"
    );
    drop(cidrs);
    let syn = Pkt6::tcp(CLIENT, 44_001, NODE6, port, SYN);
    dp.new_flow_dnated(
        "pod → eTP=Local NodePort: DNAT to the cluster-wide endpoint",
        &syn,
        2,
    );
    let ct = dp.ct(&original_key(&syn)).expect("ORIGINAL entry");
    assert_eq!(ct.rev_nat_id, 61, "the in-cluster entry's rev-NAT id");
    assert_eq!(
        (ct.frontend_addr, ct.frontend_port),
        (NODE6.octets(), port.to_be_bytes()),
        "replies appear to come from the NodePort"
    );
    let synack = dnated(&syn, 2).reversed();
    dp.reply_rev_natted("toward the pod: from the NodePort", &synack, &syn);

    for (what, client) in [
        ("an external client: dropped", EXT_CLIENT6),
        (
            "a source just outside the cluster CIDR is external",
            Ipv6Addr::new(0xfd00, 0x245, 0, 0, 0, 0, 0, 1),
        ),
        (
            "a source in a CIDR the last sync removed is external",
            Ipv6Addr::new(0xfd00, 0x99, 0, 0, 0, 0, 0, 5),
        ),
    ] {
        let outside = Pkt6::tcp(client, 44_002, NODE6, port, SYN);
        dp.step(
            what,
            PROG_TC_INGRESS,
            &outside.bytes(),
            TC_ACT_SHOT,
            dropped,
        );
    }
}

/// SNAT to the node on IPv6 (`SNAT6_V1`, the node address in `NODE6_V1`), as on IPv4.
impl Datapath {
    fn snat6(&mut self) -> HashMap<&mut MapData, Snat6Key, Snat6Value> {
        HashMap::try_from(self.bpf.map_mut(MAP_SNAT6).unwrap()).unwrap()
    }

    /// The node's IPv6 SNAT address, written as the agent writes it.
    fn set_node6(&mut self, addr: Ipv6Addr) {
        Node6Map::from_ebpf(&mut self.bpf)
            .unwrap()
            .set(addr)
            .unwrap();
    }

    /// An eTP=Cluster NodePort on `NODE6` (TCP `port`) to the test backends `ids`, their
    /// `backend_flags` set to `flags`.
    fn set_nodeport(&mut self, port: u16, ids: &[u32], flags: u8) {
        let key = Service6Key::new(NODE6.octets(), port.to_be_bytes(), proto::TCP, 0);
        self.set_frontend_entry(key, service_flags::EXTERNAL, 70, ids);
        for &id in ids {
            let mut b = self.backends().get(&id, 0).unwrap();
            b.flags = flags;
            self.backends().insert(id, b, 0).unwrap();
        }
    }
}

/// The first SNAT port a flow (after DNAT: client → backend) tries: on the node's address its
/// client's own port, on another source (hairpin) where its walk starts.
fn snat_start_port(p: &Pkt6, on_node_addr: bool) -> u16 {
    snat_port(p, on_node_addr, 0)
}

/// The `n`-th SNAT port a flow (after DNAT: client → backend) tries.
fn snat_port(p: &Pkt6, on_node_addr: bool, n: u32) -> u16 {
    let (sport, dport) = ports(p);
    let hash = flow_hash6(
        DatapathConfig::DEFAULT.hash_seed,
        p.saddr.octets(),
        p.daddr.octets(),
        sport.to_be_bytes(),
        dport.to_be_bytes(),
        p.proto(),
    );
    SnatPorts::new(hash, p.proto(), sport, on_node_addr).port(n)
}

/// `p` (client → backend) as it leaves the node SNATed to `NODE6`:`port`.
fn snated(p: &Pkt6, port: u16) -> Pkt6 {
    let mut q = p.clone();
    q.saddr = NODE6;
    set_ports(&mut q, port, ports(p).1);
    q
}

const SNAT_NEW: &[(Counter, u64)] = &[
    (Counter::NewFlow, 1),
    (Counter::PickRandom, 1),
    (Counter::SnatNew, 1),
    (Counter::SnatPortKept, 1),
];

/// An external client's NodePort flow to a backend on another node leaves with the node's IPv6
/// address and a port of the SNAT range (pseudo-header checksum kept valid); the backend's reply
/// to that address:port is put back to the client on ingress, then reverse-DNATed on egress
/// toward the client so it comes from the NodePort.
#[test]
fn a_nodeport_flow_to_a_remote_backend_is_snated_to_the_node_and_its_reply_comes_back() {
    let mut dp = Datapath::load();
    dp.set_node6(NODE6);
    let port: u16 = 30_090;
    dp.set_nodeport(port, &[2], 0);
    for (what, syn) in [
        ("TCP", Pkt6::tcp(EXT_CLIENT6, 45_000, NODE6, port, SYN)),
        // Same backend over UDP (the frontend entry is per protocol).
        ("UDP", Pkt6::udp(EXT_CLIENT6, 45_001, NODE6, port)),
    ] {
        if what == "UDP" {
            let key = Service6Key::new(NODE6.octets(), port.to_be_bytes(), proto::UDP, 0);
            dp.set_frontend_entry(key, service_flags::EXTERNAL, 71, &[12]);
        }
        let id = if what == "TCP" { 2 } else { 12 };
        let forwarded = dnated(&syn, id);
        dp.translated(
            &format!("{what}: ingress DNATs and allocates"),
            PROG_TC_INGRESS,
            &syn,
            SNAT_NEW,
            &forwarded,
        );
        let snat_port = snat_start_port(&forwarded, true);
        assert_eq!(
            snat_port,
            ports(&syn).0,
            "{what}: the client's own port kept"
        );
        let out = dp.translated(
            &format!("{what}: egress toward the remote backend: source is the node"),
            PROG_TC_EGRESS,
            &forwarded,
            &[(Counter::SnatTranslated, 1)],
            &snated(&forwarded, snat_port),
        );
        let d = Decoded6::parse(&out);
        assert_eq!(d.saddr, NODE6, "{what}: source address");

        let (backend, backend_port) = backend_addr(id);
        let in_key = Snat6Key {
            saddr: backend.octets(),
            daddr: NODE6.octets(),
            sport: backend_port.to_be_bytes(),
            dport: snat_port.to_be_bytes(),
            proto: syn.proto(),
            dir: ct_dir::REPLY,
            _pad: [0; 2],
        };
        let client = dp.snat6().get(&in_key, 0).expect("the `in` entry");
        assert_eq!(
            (client.addr, u16::from_be_bytes(client.port)),
            (EXT_CLIENT6.octets(), ports(&syn).0)
        );

        let reply = snated(&forwarded, snat_port).reversed();
        let mut to_client = reply.clone();
        to_client.daddr = EXT_CLIENT6;
        set_ports(&mut to_client, backend_port, ports(&syn).0);
        dp.translated(
            &format!("{what}: the backend's reply on ingress goes back to the client"),
            PROG_TC_INGRESS,
            &reply,
            &[(Counter::SnatReplyTranslated, 1)],
            &to_client,
        );
        dp.translated(
            &format!("{what}: toward the client it comes from the NodePort"),
            PROG_TC_EGRESS,
            &to_client,
            REPLY,
            &rev_natted(&to_client, &syn),
        );
        let seen = dp.snat6().get(&in_key, 0).unwrap();
        assert_ne!(seen.flags & ct_flags::SEEN_REPLY, 0, "{what}: answered");
    }
}

/// A pod (inside the IPv6 cluster CIDR) reaching a NodePort whose backend is local keeps its
/// own address (the backend answers it directly); a client outside the cluster CIDR is SNATed
/// even to a local backend, as kube-proxy masquerades it; without a node IPv6 address such a
/// flow goes out unSNATed and is counted.
#[test]
fn a_local_backend_keeps_an_in_cluster_client_s_address_and_snats_an_outside_one() {
    let mut dp = Datapath::load();
    let port: u16 = 30_091;
    dp.set_nodeport(port, &[1], backend_flags::LOCAL);
    ClusterCidrs6Map::from_ebpf(&mut dp.bpf)
        .unwrap()
        .sync(&[(Ipv6Addr::new(0xfd00, 0x244, 0, 0, 0, 0, 0, 0), 32)])
        .unwrap();

    let pod = Pkt6::tcp(CLIENT, 45_100, NODE6, port, SYN);
    dp.new_flow_dnated("pod → NodePort, local backend: DNAT only", &pod, 1);
    let forwarded = dnated(&pod, 1);
    dp.translated(
        "egress: the pod's own address",
        PROG_TC_EGRESS,
        &forwarded,
        &[(Counter::ReplyNotTracked, 1)],
        &forwarded,
    );

    let outside = Pkt6::tcp(EXT_CLIENT6, 45_101, NODE6, port, SYN);
    dp.translated(
        "an outside client, no node IPv6 address yet: DNAT, unSNATed",
        PROG_TC_INGRESS,
        &outside,
        &[
            (Counter::NewFlow, 1),
            (Counter::PickRandom, 1),
            (Counter::SnatNoNodeAddr, 1),
        ],
        &dnated(&outside, 1),
    );
    dp.set_node6(NODE6);
    let outside = Pkt6::tcp(EXT_CLIENT6, 45_102, NODE6, port, SYN);
    let forwarded = dnated(&outside, 1);
    dp.translated(
        "an outside client to a local backend is SNATed",
        PROG_TC_INGRESS,
        &outside,
        SNAT_NEW,
        &forwarded,
    );
    dp.translated(
        "egress: source is the node",
        PROG_TC_EGRESS,
        &forwarded,
        &[(Counter::SnatTranslated, 1)],
        &snated(&forwarded, snat_start_port(&forwarded, true)),
    );
}

/// Two clients whose flows to one backend probe the same first SNAT port: the second gets
/// another port of the range, and each reply goes back to its own client.
#[test]
fn two_clients_clashing_on_a_snat_port_get_different_ports() {
    let mut dp = Datapath::load();
    dp.set_node6(NODE6);
    let port: u16 = 30_092;
    dp.set_nodeport(port, &[2], 0);
    let first = Pkt6::tcp(EXT_CLIENT6, 45_200, NODE6, port, SYN);
    let taken = snat_start_port(&dnated(&first, 2), true);
    let other = Ipv6Addr::new(0xfd00, 0x50, 0, 0, 0, 0, 0, 0x101);
    let second = (1_024..=u16::MAX)
        .map(|sport| Pkt6::tcp(other, sport, NODE6, port, SYN))
        .find(|p| snat_start_port(&dnated(p, 2), true) == taken)
        .expect("a client port whose flow probes the same first SNAT port");

    let mut got = Vec::new();
    for (what, syn) in [("first", &first), ("second", &second)] {
        let forwarded = dnated(syn, 2);
        // The second client's port is the first's: taken, it walks on (nothing kept).
        let counts: &[(Counter, u64)] = if what == "first" {
            SNAT_NEW
        } else {
            &SNAT_NEW[..3]
        };
        dp.translated(what, PROG_TC_INGRESS, syn, counts, &forwarded);
        let out = dp.step(
            what,
            PROG_TC_EGRESS,
            &forwarded.bytes(),
            TC_NEXT,
            &[(Counter::SnatTranslated, 1)],
        );
        let d = Decoded6::parse(&out);
        assert!(d.l4_csum_ok(), "{what}: checksum");
        assert_eq!(d.saddr, NODE6, "{what}: source is the node");
        let sport = u16::from_be_bytes([d.l4[0], d.l4[1]]);
        assert!(sport >= SNAT_NODE_PORT_MIN, "{what}: {sport}");
        assert_packet(what, &out, &snated(&forwarded, sport));
        got.push((syn.clone(), forwarded, sport));
    }
    assert_eq!(got[0].2, taken, "the first flow has its first probe");
    assert_ne!(
        got[1].2, got[0].2,
        "the clashing flow moved to another port"
    );
    for (syn, forwarded, sport) in &got {
        let reply = snated(forwarded, *sport).reversed();
        let mut to_client = reply.clone();
        to_client.daddr = syn.saddr;
        set_ports(&mut to_client, ports(forwarded).1, ports(syn).0);
        dp.translated(
            "each reply back to its own client",
            PROG_TC_INGRESS,
            &reply,
            &[(Counter::SnatReplyTranslated, 1)],
            &to_client,
        );
    }
}

/// A ClusterIP whose only backend is the pod `CLIENT` itself (hairpin).
const VIP_HAIRPIN: Ipv6Addr = Ipv6Addr::new(0xfd00, 0x96, 0, 0, 0, 0, 0, 0x30);
const HAIRPIN_ID: u32 = 30;

/// The out entry key of a forwarded packet (client → backend).
fn snat_out_key(forwarded: &Pkt6) -> Snat6Key {
    let (sport, dport) = ports(forwarded);
    Snat6Key {
        saddr: forwarded.saddr.octets(),
        daddr: forwarded.daddr.octets(),
        sport: sport.to_be_bytes(),
        dport: dport.to_be_bytes(),
        proto: forwarded.proto(),
        dir: ct_dir::ORIGINAL,
        _pad: [0; 2],
    }
}

/// `VIP_HAIRPIN`:80/TCP with the pod `CLIENT`:8080 as its only backend.
fn hairpin_datapath() -> Datapath {
    let mut dp = Datapath::load();
    let itself = Backend6 {
        addr: CLIENT.octets(),
        port: 8080u16.to_be_bytes(),
        proto: proto::TCP,
        flags: backend_flags::LOCAL,
    };
    dp.backends().insert(HAIRPIN_ID, itself, 0).unwrap();
    let key = Service6Key::new(VIP_HAIRPIN.octets(), 80u16.to_be_bytes(), proto::TCP, 0);
    dp.services()
        .insert(key.with_slot(1), ServiceValue::slot(HAIRPIN_ID), 0)
        .unwrap();
    dp.services()
        .insert(key, ServiceValue::frontend_with_flags(1, 80, 0), 0)
        .unwrap();
    dp
}

/// A pod picked as its own backend through an IPv6 ClusterIP: DNATed to itself and, as it could
/// not accept a packet from its own address, SNATed to the ClusterIP (its frontend) and a port
/// of the SNAT range, with no node IPv6 address written (hairpin needs none); its answer to
/// that address:port goes back to it as client and comes from the ClusterIP's port.
#[test]
fn a_hairpin_flow_is_snated_to_its_frontend_and_its_reply_comes_back_from_the_vip() {
    let mut dp = hairpin_datapath();

    let syn = Pkt6::tcp(CLIENT, 46_000, VIP_HAIRPIN, 80, SYN);
    let forwarded = with_dport(
        &Pkt6 {
            daddr: CLIENT,
            ..syn.clone()
        },
        8080,
    );
    dp.translated(
        "pod → its own ClusterIP: DNAT to itself, hairpin port allocated",
        PROG_TC_INGRESS,
        &syn,
        &[
            (Counter::NewFlow, 1),
            (Counter::PickRandom, 1),
            (Counter::HairpinSnat, 1),
        ],
        &forwarded,
    );
    let out = dp
        .snat6()
        .get(&snat_out_key(&forwarded), 0)
        .expect("the hairpin flow's out entry");
    assert_eq!(out.addr, VIP_HAIRPIN.octets(), "hairpin source is the VIP");
    let port = u16::from_be_bytes(out.port);
    assert_eq!(port, snat_start_port(&forwarded, false), "its first probe");

    let mut from_vip = with_sport(&forwarded, port);
    from_vip.saddr = VIP_HAIRPIN;
    dp.translated(
        "egress back toward the pod: from the VIP and the SNAT port",
        PROG_TC_EGRESS,
        &forwarded,
        &[(Counter::SnatTranslated, 1)],
        &from_vip,
    );

    let synack = Pkt6::tcp(CLIENT, 8080, VIP_HAIRPIN, port, SYN | ACK);
    let back = with_dport(&synack, 46_000);
    let back = Pkt6 {
        daddr: CLIENT,
        ..back
    };
    dp.translated(
        "the pod answers the VIP:port: destination back to the pod as client",
        PROG_TC_INGRESS,
        &synack,
        &[(Counter::SnatReplyTranslated, 1)],
        &back,
    );
    dp.translated(
        "toward the pod as client: from the ClusterIP's port",
        PROG_TC_EGRESS,
        &back,
        REPLY,
        &rev_natted(&back, &syn),
    );

    let ack = Pkt6::tcp(CLIENT, 46_000, VIP_HAIRPIN, 80, ACK);
    let ack_fwd = with_dport(
        &Pkt6 {
            daddr: CLIENT,
            ..ack.clone()
        },
        8080,
    );
    dp.translated(
        "the client's next segment: DNAT from conntrack",
        PROG_TC_INGRESS,
        &ack,
        ESTABLISHED,
        &ack_fwd,
    );
    let mut ack_out = with_sport(&ack_fwd, port);
    ack_out.saddr = VIP_HAIRPIN;
    dp.translated(
        "and SNAT from its out entry",
        PROG_TC_EGRESS,
        &ack_fwd,
        &[(Counter::SnatTranslated, 1)],
        &ack_out,
    );
}

/// A pod that reached itself through its ClusterIP (hairpin) answers the packet it received
/// (VIP:port → pod:8080) with an ICMPv6 error (Packet Too Big) to the VIP: tc ingress sends it
/// back to the pod as client, quoting pod:46000 → pod:8080 (its `in` entry), and tc egress toward
/// the pod makes it come from the ClusterIP and quote pod:46000 → VIP:80, the packet the pod
/// sent; each step keeps the ICMPv6 checksum valid and the MTU as it was.
#[test]
fn an_icmpv6_error_about_a_hairpin_flow_comes_back_from_the_vip_quoting_the_client_s_packet() {
    let dp = hairpin_datapath();
    let syn = Pkt6::tcp(CLIENT, 46_000, VIP_HAIRPIN, 80, SYN);
    let forwarded = with_dport(
        &Pkt6 {
            daddr: CLIENT,
            ..syn.clone()
        },
        8080,
    );
    dp.run(PROG_TC_INGRESS, &syn.bytes());
    let (_, out) = dp.run(PROG_TC_EGRESS, &forwarded.bytes());
    let received = Decoded6::parse(&out);
    assert_eq!(received.saddr, VIP_HAIRPIN, "the hairpin source");
    let port = u16::from_be_bytes([received.l4[0], received.l4[1]]);
    // The pod's error about the segment it received, quoted as it arrived.
    let quoted = out[ETH_HLEN..].to_vec();
    let mtu = [0, 0, 0x05, 0x00];
    let err = icmp6_frame(CLIENT, VIP_HAIRPIN, 2, 0, mtu, &quoted);
    let counts = &[(Counter::IcmpErrorTranslated, 1)];
    let mid = dp.step(
        "ingress: the pod's error to the VIP:port",
        PROG_TC_INGRESS,
        &err,
        TC_NEXT,
        counts,
    );
    // To the pod as client, quoting the packet before the hairpin SNAT (pod:46000 → pod:8080;
    // the quoted TCP checksum stays as it was).
    let mut want_quoted = quoted.clone();
    want_quoted[8..24].copy_from_slice(&CLIENT.octets());
    want_quoted[40..42].copy_from_slice(&46_000u16.to_be_bytes());
    assert!(
        Decoded6::parse(&mid).l4_csum_ok(),
        "ingress: ICMPv6 checksum after the rewrite"
    );
    assert_eq!(
        mid,
        icmp6_frame(CLIENT, CLIENT, 2, 0, mtu, &want_quoted),
        "ingress: to the pod as client, quoting pod:46000 → pod:8080 (SNAT port {port} undone)"
    );
    let out = dp.step(
        "egress: the error toward the pod as client",
        PROG_TC_EGRESS,
        &mid,
        TC_NEXT,
        counts,
    );
    want_quoted[24..40].copy_from_slice(&VIP_HAIRPIN.octets());
    want_quoted[42..44].copy_from_slice(&80u16.to_be_bytes());
    assert!(
        Decoded6::parse(&out).l4_csum_ok(),
        "egress: ICMPv6 checksum after the rewrite"
    );
    assert_eq!(
        out,
        icmp6_frame(VIP_HAIRPIN, CLIENT, 2, 0, mtu, &want_quoted),
        "egress: from the VIP, quoting pod:46000 → VIP:80"
    );
    // An error quoting a SNAT-range port nobody allocated passes untouched.
    let mut stray_quoted = quoted.clone();
    stray_quoted[40..42].copy_from_slice(&port.wrapping_add(1).max(SNAT_PORT_MIN).to_be_bytes());
    let stray = icmp6_frame(CLIENT, VIP_HAIRPIN, 2, 0, mtu, &stray_quoted);
    let out = dp.step(
        "ingress: an error about no SNATed flow",
        PROG_TC_INGRESS,
        &stray,
        TC_NEXT,
        NOT_SERVICE,
    );
    assert_eq!(out, stray, "untouched");
}

/// The egress `out` lookup is skipped while the node has no IPv6 SNAT address, except for a
/// pod's packet to itself (hairpin, found above with no node address): a flow SNATed on an
/// address the agent then removed (`::` written) goes out with its own source, as netfilter
/// drops the masquerade of flows on an address that left the node; with an address written
/// again, the flow is SNATed again (its entries are still there).
#[test]
fn without_a_node_address_only_hairpin_flows_are_looked_up_on_egress() {
    let mut dp = Datapath::load();
    // Kept: the map is taken out of the object once (the programs keep it).
    let mut node6 = Node6Map::from_ebpf(&mut dp.bpf).unwrap();
    node6.set(NODE6).unwrap();
    let port: u16 = 30_093;
    dp.set_nodeport(port, &[2], 0);
    let syn = Pkt6::tcp(EXT_CLIENT6, 45_300, NODE6, port, SYN);
    let forwarded = dnated(&syn, 2);
    dp.translated("NodePort flow", PROG_TC_INGRESS, &syn, SNAT_NEW, &forwarded);
    let snat_port = snat_start_port(&forwarded, true);
    let snated_out = snated(&forwarded, snat_port);
    dp.translated(
        "SNATed while the node has an address",
        PROG_TC_EGRESS,
        &forwarded,
        &[(Counter::SnatTranslated, 1)],
        &snated_out,
    );
    node6.set(Ipv6Addr::UNSPECIFIED).unwrap();
    dp.translated(
        "the address removed: out unSNATed, no lookup",
        PROG_TC_EGRESS,
        &forwarded,
        &[(Counter::ReplyNotTracked, 1)],
        &forwarded,
    );
    assert!(
        dp.snat6().get(&snat_out_key(&forwarded), 0).is_ok(),
        "the entries are left to the sweep and the LRU"
    );
    node6.set(NODE6).unwrap();
    dp.translated(
        "an address again: SNATed from the same entries",
        PROG_TC_EGRESS,
        &forwarded,
        &[(Counter::SnatTranslated, 1)],
        &snated_out,
    );
}

/// Prints the IPv6 egress cost of a packet that is neither a reply nor SNATed (traffic toward a
/// pod that no flow translates), with no node IPv6 address and with one (no pass/fail on time;
/// the bench's "not a Service" is the ingress side). Checks every run passed it untouched.
#[test]
fn egress_cost_of_an_untranslated_packet_with_and_without_a_node_address() {
    let mut dp = Datapath::load();
    let frame = Pkt6::tcp(CLIENT, 50_001, POD, 80, ACK)
        .payload(&[0; 64])
        .bytes();
    let run = |dp: &Datapath| {
        let before = dp.counters()[Counter::ReplyNotTracked.name()];
        let (verdict, out, took) =
            common_datapath::try_run(&dp.bpf, PROG_TC_EGRESS, &frame, 100_000).unwrap();
        assert_eq!(verdict, TC_NEXT);
        assert_eq!(out, frame, "untouched");
        assert_eq!(
            dp.counters()[Counter::ReplyNotTracked.name()] - before,
            100_000
        );
        took
    };
    let unset = run(&dp);
    dp.set_node6(NODE6);
    let set = run(&dp);
    println!(
        "IPv6 egress, untranslated packet (BPF_PROG_TEST_RUN, 100,000 repeats): no node address \
         {} ns, node address written {} ns",
        unset.as_nanos(),
        set.as_nanos()
    );
}

/// The datapath trace's records as aya-log decodes them: (level, target, message).
#[derive(Clone, Default)]
struct Records(std::sync::Arc<std::sync::Mutex<Vec<(log::Level, String, String)>>>);

impl log::Log for Records {
    fn enabled(&self, _: &log::Metadata) -> bool {
        true
    }

    fn log(&self, record: &log::Record) {
        self.0.lock().unwrap().push((
            record.level(),
            record.target().to_owned(),
            record.args().to_string(),
        ));
    }

    fn flush(&self) {}
}

/// A new IPv6 TCP flow and two replies, a SYN to a Service without endpoints and an untracked
/// egress packet through `dp` (as tests/datapath.rs's `traced_flows`): (level, message) of the
/// records its trace wrote, each checked to be under the trace's target.
fn traced_flows6(dp: &mut Datapath) -> (u32, Vec<(log::Level, String)>) {
    let records = Records::default();
    let mut logger = aya_log::EbpfLogger::init_with_logger(&mut dp.bpf, records.clone())
        .expect("the object carries aya-log's ring buffer");
    let syn = Pkt6::tcp(CLIENT, 40_000, VIP, 80, SYN);
    let id = picked(&syn, &TCP_IDS);
    assert_eq!(dp.run(PROG_TC_INGRESS, &syn.bytes()).0, TC_NEXT, "new flow");
    let reply = dnated(&syn, id).reversed();
    for _ in 0..2 {
        assert_eq!(dp.run(PROG_TC_EGRESS, &reply.bytes()).0, TC_NEXT, "reply");
    }
    let empty = Pkt6::tcp(CLIENT, 40_001, VIP_EMPTY, 80, SYN);
    assert_eq!(
        dp.run(PROG_TC_INGRESS, &empty.bytes()).0,
        TC_ACT_REDIRECT,
        "rejected"
    );
    let untracked = Pkt6::udp(POD, 1_234, CLIENT, 5_678);
    assert_eq!(dp.run(PROG_TC_EGRESS, &untracked.bytes()).0, TC_NEXT);
    logger.flush();
    let got = records.0.lock().unwrap().clone();
    let got = got
        .into_iter()
        .map(|(level, target, msg)| {
            assert_eq!(target, proxy_common::bpf_log::TARGET, "{msg}");
            (level, msg)
        })
        .collect();
    (id, got)
}

/// `--bpf-log` on IPv6: the records of one or two addresses as IPv4's at the same levels
/// (addresses in brackets), only those at or above the level loaded, none when off. (The new
/// flow and its replies have no IPv6 record: `proxy-ebpf/src/log.rs` says why.)
#[test]
fn the_datapath_trace_names_each_ipv6_flow_at_its_level_and_is_silent_when_off() {
    use log::Level::{Info, Trace};
    use proxy_common::bpf_log;
    let (_, got) = traced_flows6(&mut Datapath::load_with_log(
        DatapathConfig::DEFAULT,
        Some(bpf_log::TRACE),
    ));
    let want = [
        (
            Info,
            format!("tcp [{CLIENT}]:40001 -> [{VIP_EMPTY}]:80: no endpoints: rejected"),
        ),
        (
            Trace,
            format!("no conntrack entry: udp [{POD}]:1234 -> [{CLIENT}]:5678: passed"),
        ),
    ];
    assert_eq!(got, want.to_vec(), "at trace: every record, in order");

    let (_, got) = traced_flows6(&mut Datapath::load_with_log(
        DatapathConfig::DEFAULT,
        Some(bpf_log::INFO),
    ));
    assert_eq!(got, vec![want[0].clone()], "at info: only the refused flow");

    let (_, got) = traced_flows6(&mut Datapath::load());
    assert!(got.is_empty(), "off by default: {got:?}");
}

/// Found by the packet fuzz (`fuzz_packets`, seed 0x5eed2026): a Packet Too Big whose IPv6
/// payload length ends inside its quote (the rest of the quote follows as a trailer the ICMPv6
/// checksum does not cover and the stack cuts off) passes untouched, as on IPv4. Translating it
/// rewrote the quoted addresses and ports beyond the packet and adjusted the checksum for them.
#[test]
fn packet_too_big_whose_quote_ends_beyond_the_payload_length_passes_untouched() {
    let dp = Datapath::load();
    let data = Pkt6::tcp(CLIENT, 43_100, VIP, 80, SYN);
    let id = picked(&data, &TCP_IDS);
    dp.step("SYN", PROG_TC_INGRESS, &data.bytes(), TC_NEXT, NEW);
    let quoted = dnated(&data, id).l3_bytes();
    // Cut inside the quoted IPv6 header, and after it inside the quoted ports.
    for cut in [36, 42] {
        let mut frame = packet_too_big(ROUTER, &quoted[..cut]);
        frame.extend_from_slice(&quoted[cut..]);
        let (verdict, out) = dp.run(PROG_TC_EGRESS, &frame);
        assert_eq!(verdict, TC_NEXT, "quote cut at {cut}: verdict");
        assert_eq!(out, frame, "quote cut at {cut}: passed untouched");
    }
}

/// A flow taken over from netfilter (its entries flagged `NETFILTER`): its client packets pass
/// untouched while netfilter translates them, are dropped while the agent deletes netfilter's
/// entry (`HANDOFF`), then are DNATed; a reply that reaches egress untranslated is translated
/// all along (netfilter translated it only while its entry existed).
#[test]
fn a_flow_taken_over_from_netfilter_passes_until_it_is_handed_over() {
    let mut dp = Datapath::load();
    let q = Pkt6::udp(CLIENT, 33_100, VIP, 53).payload(b"query");
    let id = picked(&q, &UDP_IDS);
    dp.new_flow_dnated("the flow's first datagram", &q, id);
    let key = original_key(&q);
    let set_flags = |dp: &mut Datapath, flags: u8| {
        let mut v = dp.ct(&key).expect("the ORIGINAL entry");
        v.flags = (v.flags & !(ct_flags::NETFILTER | ct_flags::HANDOFF)) | flags;
        dp.conntrack().insert(key, v, 0).expect("flags written");
    };
    set_flags(&mut dp, ct_flags::NETFILTER);
    let out = dp.step(
        "netfilter still translates it",
        PROG_TC_INGRESS,
        &q.bytes(),
        TC_NEXT,
        &[(Counter::NetfilterFlow, 1)],
    );
    assert_eq!(out, q.bytes(), "passed untouched");
    let answer = dnated(&q, id).reversed();
    dp.translated(
        "a reply netfilter did not translate",
        PROG_TC_EGRESS,
        &answer,
        REPLY,
        &rev_natted(&answer, &q),
    );
    set_flags(&mut dp, ct_flags::HANDOFF | ct_flags::NETFILTER);
    dp.step(
        "netfilter's entry being deleted",
        PROG_TC_INGRESS,
        &q.bytes(),
        TC_ACT_SHOT,
        &[(Counter::DropTakeoverHandoff, 1)],
    );
    set_flags(&mut dp, 0);
    dp.translated(
        "handed over",
        PROG_TC_INGRESS,
        &q,
        &[(Counter::EstablishedFlow, 1)],
        &dnated(&q, id),
    );
}

/// The `in` entry of a SNATed IPv6 flow taken over from netfilter: the backend's replies on
/// ingress pass untouched while netfilter translates them (`NETFILTER`), are dropped while its
/// entry is deleted (`HANDOFF`), then go back to the client.
#[test]
fn a_snated_flow_taken_over_from_netfilter_passes_its_replies_until_handed_over() {
    let mut dp = Datapath::load();
    dp.set_node6(NODE6);
    let port: u16 = 30_091;
    dp.set_nodeport(port, &[2], 0);
    let syn = Pkt6::tcp(EXT_CLIENT6, 45_100, NODE6, port, SYN);
    let forwarded = dnated(&syn, 2);
    dp.translated(
        "the flow's SYN",
        PROG_TC_INGRESS,
        &syn,
        SNAT_NEW,
        &forwarded,
    );
    let snat_port = snat_start_port(&forwarded, true);
    let (backend, backend_port) = backend_addr(2);
    let in_key = Snat6Key {
        saddr: backend.octets(),
        daddr: NODE6.octets(),
        sport: backend_port.to_be_bytes(),
        dport: snat_port.to_be_bytes(),
        proto: proto::TCP,
        dir: ct_dir::REPLY,
        _pad: [0; 2],
    };
    let set_flags = |dp: &mut Datapath, flags: u8| {
        let mut v = dp.snat6().get(&in_key, 0).expect("the `in` entry");
        v.flags = (v.flags & !(ct_flags::NETFILTER | ct_flags::HANDOFF)) | flags;
        dp.snat6().insert(in_key, v, 0).expect("written");
    };
    let reply = snated(&forwarded, snat_port).reversed();
    set_flags(&mut dp, ct_flags::NETFILTER);
    let out = dp.step(
        "netfilter still translates it",
        PROG_TC_INGRESS,
        &reply.bytes(),
        TC_NEXT,
        &[(Counter::NetfilterFlow, 1)],
    );
    assert_eq!(out, reply.bytes(), "passed untouched");
    set_flags(&mut dp, ct_flags::NETFILTER | ct_flags::HANDOFF);
    dp.step(
        "netfilter's entry being deleted",
        PROG_TC_INGRESS,
        &reply.bytes(),
        TC_ACT_SHOT,
        &[(Counter::DropTakeoverHandoff, 1)],
    );
    set_flags(&mut dp, 0);
    let mut to_client = reply.clone();
    to_client.daddr = EXT_CLIENT6;
    set_ports(&mut to_client, backend_port, 45_100);
    dp.translated(
        "handed over: back to the client",
        PROG_TC_INGRESS,
        &reply,
        &[(Counter::SnatReplyTranslated, 1)],
        &to_client,
    );
}

/// As on IPv4: a NodePort flow SNATed to the node keeps its client's port; a connection the
/// node opens from that port to the same backend while the flow lives (the SNAT program,
/// tail-called from `tc_egress6`) gets another source port, and each reply goes to its own
/// end; a UDP datagram of the node on a free tuple passes untouched.
#[test]
fn a_node_connection_on_a_port_a_snated_flow_kept_is_remapped() {
    let mut dp = Datapath::load();
    dp.set_node6(NODE6);
    let port: u16 = 30_094;
    dp.set_nodeport(port, &[2], 0);
    const PORT: u16 = 45_400;
    let syn = Pkt6::tcp(EXT_CLIENT6, PORT, NODE6, port, SYN);
    let forwarded = dnated(&syn, 2);
    dp.translated(
        "the client's SYN",
        PROG_TC_INGRESS,
        &syn,
        SNAT_NEW,
        &forwarded,
    );
    dp.translated(
        "egress: the client's own port kept",
        PROG_TC_EGRESS,
        &forwarded,
        &[(Counter::SnatTranslated, 1)],
        &snated(&forwarded, PORT),
    );
    let (backend, backend_port) = backend_addr(2);
    let host_syn = Pkt6::tcp(NODE6, PORT, backend, backend_port, SYN);
    let remapped = snat_port(&host_syn, true, 1);
    assert_ne!(remapped, PORT);
    dp.translated(
        "the node's own SYN on the tuple the live flow holds: another source port",
        PROG_TC_EGRESS,
        &host_syn,
        &[
            (Counter::SnatTranslated, 1),
            (Counter::SnatNew, 1),
            (Counter::SnatNodeConnectionRemapped, 1),
        ],
        &snated(&host_syn, remapped),
    );
    let answer = Pkt6::tcp(backend, backend_port, NODE6, remapped, SYN | ACK);
    let mut to_node = answer.clone();
    set_ports(&mut to_node, backend_port, PORT);
    dp.translated(
        "the backend's answer to the node: back to the node's own port",
        PROG_TC_INGRESS,
        &answer,
        &[(Counter::SnatReplyTranslated, 1)],
        &to_node,
    );
    let flow_reply = Pkt6::tcp(backend, backend_port, NODE6, PORT, SYN | ACK);
    let mut to_client = flow_reply.clone();
    to_client.daddr = EXT_CLIENT6;
    dp.translated(
        "the SNATed flow's answer still goes to its client",
        PROG_TC_INGRESS,
        &flow_reply,
        &[(Counter::SnatReplyTranslated, 1)],
        &to_client,
    );
    let host_udp = Pkt6::udp(NODE6, PORT, backend, backend_port);
    dp.step(
        "a UDP datagram of the node on a free tuple: untouched",
        PROG_TC_EGRESS,
        &host_udp.bytes(),
        TC_NEXT,
        &[(Counter::ReplyNotTracked, 1)],
    );
}

/// As on IPv4: a router's Packet Too Big about a reply on its way back to the client (quoting
/// frontend:port → client, as the reply left the node) goes on to the backend quoting the reply
/// as the backend sent it: backend:port → client for a ClusterIP flow, backend:port → the node's
/// address and SNAT port for a SNATed NodePort flow; the MTU untouched, the checksum valid.
#[test]
fn packet_too_big_about_a_reply_goes_on_to_the_backend() {
    let mtu = [0, 0, 0x05, 0x00];
    let mut dp = Datapath::load();
    let data = Pkt6::tcp(CLIENT, 43_100, VIP, 80, SYN);
    let id = picked(&data, &TCP_IDS);
    dp.step("SYN", PROG_TC_INGRESS, &data.bytes(), TC_NEXT, NEW);
    let (be, be_port) = backend_addr(id);
    let counts = &[(Counter::IcmpErrorTranslated, 1)];
    let cases = [
        (
            "ClusterIP",
            Pkt6::tcp(VIP, 80, CLIENT, 43_100, SYN | ACK),
            VIP,
            (be, be_port),
            (CLIENT, 43_100u16),
        ),
        (
            "SNATed NodePort",
            Pkt6::tcp(NODE6, 30_095, EXT_CLIENT6, 45_500, SYN | ACK),
            NODE6,
            backend_addr(2),
            (NODE6, 45_500),
        ),
    ];
    dp.set_node6(NODE6);
    dp.set_nodeport(30_095, &[2], 0);
    let syn = Pkt6::tcp(EXT_CLIENT6, 45_500, NODE6, 30_095, SYN);
    dp.translated(
        "NodePort SYN",
        PROG_TC_INGRESS,
        &syn,
        SNAT_NEW,
        &dnated(&syn, 2),
    );
    for (what, reply, frontend, (backend, backend_port), (peer, peer_port)) in cases {
        let quoted = reply.l3_bytes();
        let mut want_quoted = quoted.clone();
        want_quoted[8..24].copy_from_slice(&backend.octets());
        want_quoted[24..40].copy_from_slice(&peer.octets());
        want_quoted[40..42].copy_from_slice(&backend_port.to_be_bytes());
        want_quoted[42..44].copy_from_slice(&peer_port.to_be_bytes());
        let ptb = icmp6_frame(ROUTER, frontend, 2, 0, mtu, &quoted);
        let out = dp.step(what, PROG_TC_INGRESS, &ptb, TC_NEXT, counts);
        assert!(
            Decoded6::parse(&out).l4_csum_ok(),
            "{what}: ICMPv6 checksum"
        );
        assert_eq!(
            out,
            icmp6_frame(ROUTER, backend, 2, 0, mtu, &want_quoted),
            "{what}: to {backend}, quoting the reply as it sent it"
        );
    }
    // About a reply of no tracked flow: untouched.
    let stray = Pkt6::tcp(VIP, 80, CLIENT, 43_101, SYN | ACK).l3_bytes();
    let ptb = icmp6_frame(ROUTER, VIP, 2, 0, mtu, &stray);
    let out = dp.step(
        "no tracked flow",
        PROG_TC_INGRESS,
        &ptb,
        TC_NEXT,
        &[(Counter::NotService, 1)],
    );
    assert_eq!(out, ptb, "untouched");
}

/// IPv6 twin of `datapath::a_flow_opened_on_two_cpus_at_once_goes_to_one_backend`: the same
/// new flow's SYN on two CPUs at once leaves for one backend, the one its entry keeps.
#[test]
fn a_flow_opened_on_two_cpus_at_once_goes_to_one_backend() {
    let mut dp = Datapath::load();
    dp.round_robin_on_vip();
    let fd = dp.ingress_fd();
    // Batches of 1,500 flows (3,000 of the test maps' 4,096 conntrack entries: none evicted),
    // the map emptied between them.
    const BATCHES: usize = 3;
    const ROUNDS: u16 = 1_500;
    let syn = |r: u16| Pkt6::tcp(CLIENT, 20_000 + r, VIP, 80, SYN);
    let mut split = Vec::new();
    for batch in 0..BATCHES {
        let runs =
            common_datapath::race_on_two_cpus(fd, ROUNDS as usize, |_, r| syn(r as u16).bytes());
        for (r, round) in (0..ROUNDS).zip(&runs) {
            let to = |cpu: usize| {
                let (verdict, out) = &round[cpu];
                assert_eq!(*verdict, TC_NEXT, "batch {batch} round {r} on CPU {cpu}");
                Decoded6::parse(out).daddr
            };
            let ct = dp.ct(&original_key(&syn(r))).expect("the flow's entry");
            let kept = Ipv6Addr::from(ct.backend_addr);
            if to(0) != to(1) || to(0) != kept {
                split.push((batch, r, to(0), to(1), kept));
            }
        }
        assert_eq!(dp.conntrack().keys().count(), 2 * ROUNDS as usize);
        dp.clear_conntrack();
    }
    let raced = dp.counters()[Counter::ConntrackInsertRaced.name()];
    println!(
        "{BATCHES} × {ROUNDS} IPv6 flows opened on two CPUs at once: {raced} followed the other \
         CPU's, {} split",
        split.len()
    );
    assert!(
        split.is_empty(),
        "flows whose two first packets left for different backends, or not for the one the \
         entry keeps (batch, round, CPU 0, CPU 1, entry): {:?}",
        &split[..split.len().min(10)]
    );
}

/// IPv6 twin of `datapath::two_flows_with_one_reply_tuple_on_two_cpus_at_once_never_share_it`.
#[test]
fn two_ipv6_flows_with_one_reply_tuple_on_two_cpus_at_once_never_share_it() {
    let mut dp = two_frontends_one_backend();
    let fd = dp.ingress_fd();
    // Batches of 750 pairs (3,000 of the test maps' 4,096 conntrack entries: none evicted),
    // the map emptied between them.
    const BATCHES: usize = 4;
    const ROUNDS: usize = 750;
    let mut shared = Vec::new();
    for batch in 0..BATCHES {
        let runs = common_datapath::race_on_two_cpus(fd, ROUNDS, |cpu, r| {
            let vip = if cpu == 0 { VIP } else { VIP2 };
            Pkt6::tcp(CLIENT, 20_000 + r as u16, vip, 80, SYN).bytes()
        });
        for (r, round) in runs.iter().enumerate() {
            let sport = |cpu: usize| {
                let (verdict, out) = &round[cpu];
                match *verdict {
                    TC_NEXT => {
                        let l4 = Decoded6::parse(out).l4;
                        Some(u16::from_be_bytes([l4[0], l4[1]]))
                    }
                    TC_ACT_SHOT => None,
                    v => panic!("batch {batch} round {r} on CPU {cpu}: verdict {v}"),
                }
            };
            match (sport(0), sport(1)) {
                (Some(a), Some(b)) if a == b => shared.push((batch, r, a)),
                (None, None) => panic!("batch {batch} round {r}: both flows dropped"),
                _ => {}
            }
        }
        dp.clear_conntrack();
    }
    let counters = dp.counters();
    println!(
        "{BATCHES} × {ROUNDS} pairs of IPv6 flows with one reply tuple on two CPUs at once: {} moved, {} \
         refused at the insert, {} shared the tuple",
        counters[Counter::ReplyTupleRemapped.name()],
        counters[Counter::DropConntrackInsertFailed.name()],
        shared.len()
    );
    assert!(
        shared.is_empty(),
        "pairs that both left with one source port toward one backend (batch, round, port): {:?}",
        &shared[..shared.len().min(10)]
    );
}

/// IPv6 twin of
/// `datapath::two_flows_reclaiming_one_idle_snat_port_on_two_cpus_at_once_never_share_it`: the
/// two flows' `out` entries never name one node port (the source rewrite itself is egress's).
#[test]
fn two_ipv6_flows_reclaiming_one_idle_snat_port_on_two_cpus_at_once_never_share_it() {
    let mut dp = Datapath::load();
    dp.set_node6(NODE6);
    let nodeport: u16 = 30_091;
    dp.set_nodeport(nodeport, &[2], 0);
    let (backend, backend_port) = backend_addr(2);
    // Batches of 500 holders and 1,000 racing flows (3,000 of the test maps' 4,096 conntrack
    // entries), the flow maps emptied between them.
    const BATCHES: usize = 2;
    const ROUNDS: usize = 500;
    let port = |r: usize| 20_000 + r as u16;
    let client = |last: u16| Ipv6Addr::new(0xfd00, 0x50, 0, 0, 0, 0, 0, last);
    let (holder, racers) = (client(0x110), [client(0x111), client(0x112)]);
    let hold = proxy_common::SNAT_UNANSWERED_SYN_HOLD_S * 1_000_000_000;
    let in_key = |p: u16| Snat6Key {
        saddr: backend.octets(),
        daddr: NODE6.octets(),
        sport: backend_port.to_be_bytes(),
        dport: p.to_be_bytes(),
        proto: proto::TCP,
        dir: ct_dir::REPLY,
        _pad: [0; 2],
    };
    let fd = dp.ingress_fd();
    let mut shared = Vec::new();
    for batch in 0..BATCHES {
        for r in 0..ROUNDS {
            let syn = Pkt6::tcp(holder, port(r), NODE6, nodeport, SYN);
            assert_eq!(dp.run(PROG_TC_INGRESS, &syn.bytes()).0, TC_NEXT);
            // The holder's SYN unanswered past its hold: its port may be taken over.
            let mut v = (dp.snat6().get(&in_key(port(r)), 0)).expect("the holder's `in` entry");
            v.last_seen_ns = monotonic_ns() - hold - 1_000_000_000;
            dp.snat6().insert(in_key(port(r)), v, 0).unwrap();
        }
        let runs = common_datapath::race_on_two_cpus(fd, ROUNDS, |cpu, r| {
            Pkt6::tcp(racers[cpu], port(r), NODE6, nodeport, SYN).bytes()
        });
        for (r, round) in runs.iter().enumerate() {
            let mut node_port = |cpu: usize| {
                assert_eq!(
                    round[cpu].0, TC_NEXT,
                    "batch {batch} round {r} on CPU {cpu}"
                );
                let out_key = Snat6Key {
                    saddr: racers[cpu].octets(),
                    daddr: backend.octets(),
                    sport: port(r).to_be_bytes(),
                    dport: backend_port.to_be_bytes(),
                    proto: proto::TCP,
                    dir: ct_dir::ORIGINAL,
                    _pad: [0; 2],
                };
                let out = dp
                    .snat6()
                    .get(&out_key, 0)
                    .expect("the racer's `out` entry");
                u16::from_be_bytes(out.port)
            };
            let (a, b) = (node_port(0), node_port(1));
            if a == b {
                shared.push((batch, r, a));
            }
        }
        dp.clear_conntrack();
        let keys: Vec<Snat6Key> = dp.snat6().keys().map(|k| k.expect("key")).collect();
        for key in keys {
            let _ = dp.snat6().remove(&key);
        }
    }
    println!(
        "{BATCHES} × {ROUNDS} pairs of IPv6 flows reclaiming one idle SNAT port on two CPUs at once: {} \
         shared one port",
        shared.len()
    );
    assert!(
        shared.is_empty(),
        "pairs whose `out` entries name one node port toward one backend (batch, round, port): {:?}",
        &shared[..shared.len().min(10)]
    );
}

/// IPv6 twin of `datapath::a_late_reply_of_an_evicted_flow_never_moves_the_flow_now_on_its_tuple`.
#[test]
fn a_late_ipv6_reply_of_an_evicted_flow_never_moves_the_flow_now_on_its_tuple() {
    let mut dp = Datapath::load();
    dp.round_robin_on_vip();
    let syn = Pkt6::tcp(CLIENT, 41_000, VIP, 80, SYN);
    let (verdict, out) = dp.run(PROG_TC_INGRESS, &syn.bytes());
    assert_eq!(verdict, TC_NEXT);
    let first = Decoded6::parse(&out).daddr;
    dp.conntrack()
        .remove(&original_key(&syn))
        .expect("evicting the first flow's ORIGINAL entry");
    let (verdict, out) = dp.run(PROG_TC_INGRESS, &syn.bytes());
    assert_eq!(verdict, TC_NEXT);
    let second = Decoded6::parse(&out).daddr;
    assert_ne!(
        first, second,
        "round robin: the new flow goes to the other backend"
    );
    let before = dp.ct(&original_key(&syn)).expect("the new flow's entry");

    let fin = Pkt6::tcp(first, 8080, CLIENT, 41_000, FIN | ACK);
    let (verdict, _) = dp.run(PROG_TC_EGRESS, &fin.bytes());
    assert_eq!(verdict, TC_NEXT);
    let after = dp.ct(&original_key(&syn)).expect("the new flow's entry");
    assert_eq!(
        (after.state, after.flags, Ipv6Addr::from(after.backend_addr)),
        (before.state, before.flags, second),
        "the new flow's entry is as it was (state {} before)",
        before.state
    );
}
