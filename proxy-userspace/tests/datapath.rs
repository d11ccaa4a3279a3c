//! Datapath table tests: the real eBPF object, loaded into the kernel, run with
//! BPF_PROG_TEST_RUN (no interface, no traffic). Each step is {description, packet in, expected
//! verdict, expected packet out, counter deltas}; map effects are checked after the steps.
//!
//! Privileged (root, bpffs not needed). Run:
//! `cargo test -p proxy-userspace --test datapath -- --test-threads=1 --nocapture`

mod common_datapath;
mod common_packet;

use std::{collections::BTreeMap, net::Ipv4Addr, time::Duration};

use aya::{
    Ebpf, EbpfLoader,
    maps::{
        Array, HashMap, MapData,
        lpm_trie::{Key, LpmTrie},
    },
    programs::{SchedClassifier, TestRun, TestRunOptions},
};
use common_datapath::{TC_ACT_REDIRECT, TC_ACT_SHOT, TC_NEXT};
use common_packet::{
    CLIENT_MAC, Decoded, ETH_HLEN, HOST_MAC, Pkt, arp_frame, eth, fragments, ipv6_frame,
    reassemble, tcp_flags::*,
};
use kube_proxy_ebpf::{
    agent::flow_is_dead,
    dataplane::{
        clock::monotonic_ns,
        ebpf_object::EBPF_OBJECT,
        lc_counts, loader,
        maps::Snat,
        snat_gc::{self, Collected},
    },
    pipeline::programmed::Programmed,
};
use proxy_common::{
    AffinityKey, AffinityMatchKey, AffinityValue, Backend, CLASH_PORT_MAX, CLASH_PORT_MIN,
    CLASH_PROBES, CONFIG_GLOBAL, ClusterCidrs, Counter, CtKey, CtValue, DatapathConfig, FragKey,
    FragValue, HAIRPIN_SNAT_ADDR, Ipv4Prefix, MAP_AFFINITY, MAP_AFFINITY_MATCH, MAP_BACKENDS,
    MAP_CONNTRACK, MAP_FRAGMENTS, MAP_LC_ADJUST, MAP_LC_FLOWS, MAP_MAGLEV, MAP_SERVICE_CIDRS,
    MAP_SERVICES, MAP_SNAT, MAP_SNAT_DEVICES, MAP_SOURCE_RANGES, PROG_TC_EGRESS, PROG_TC_EGRESS_L3,
    PROG_TC_INGRESS, PROG_TC_INGRESS_L3, SCOPE_INTERNAL, SOURCE_RANGE_FRONTEND_BITS, ServiceKey,
    ServiceValue, SnatDevice, SnatKey, SnatValue, SourceRangeKey, backend_flags, bpf_log, ct_dir,
    ct_flags, ct_state, frag_action, frag_hook,
    hash::{PortProbe, SnatPorts, flow_hash, pick_slot},
    maglev::{self, Chunk, MaglevKey},
    proto, sched, service_cidr, service_flags,
};

const CLIENT: Ipv4Addr = Ipv4Addr::new(10, 244, 1, 2);
/// A ClusterIP with TCP :80 and UDP :53.
const VIP: Ipv4Addr = Ipv4Addr::new(10, 96, 0, 10);
/// A ClusterIP whose Services have no endpoints (TCP :80, UDP :53).
const VIP_EMPTY: Ipv4Addr = Ipv4Addr::new(10, 96, 0, 99);
const OTHER: Ipv4Addr = Ipv4Addr::new(192, 0, 2, 7);

const TCP_REVNAT: u32 = 1;
const UDP_REVNAT: u32 = 2;

/// Backends by id: TCP 1..=4 on :8080, UDP 11..=12 on :5353.
fn backend_addr(id: u32) -> (Ipv4Addr, u16) {
    match id {
        1 => (Ipv4Addr::new(10, 244, 1, 10), 8080),
        2 => (Ipv4Addr::new(10, 244, 2, 20), 8080),
        3 => (Ipv4Addr::new(10, 244, 3, 30), 8080),
        4 => (Ipv4Addr::new(10, 244, 4, 40), 8080),
        11 => (Ipv4Addr::new(10, 244, 1, 11), 5353),
        12 => (Ipv4Addr::new(10, 244, 2, 12), 5353),
        _ => panic!("no test backend {id}"),
    }
}

/// Test capacities: small maps load fast; the datapath does not depend on their size.
const TEST_CAPACITY: u32 = 16_384;

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

    /// As [`Datapath::load_with`]; `log_level` sets the datapath trace's global (`None`: the
    /// object's default, off).
    fn load_with_log(cfg: DatapathConfig, log_level: Option<u8>) -> Self {
        let maps = [MAP_SERVICES, MAP_BACKENDS, MAP_CONNTRACK];
        Self {
            bpf: common_datapath::load_object(&cfg, log_level, &maps, TEST_CAPACITY),
        }
    }

    fn prog(&self, name: &str) -> &SchedClassifier {
        common_datapath::prog(&self.bpf, name)
    }

    /// `repeat` runs of `prog` over `input`: (verdict, output frame, mean duration of one run).
    fn run_timed(&self, prog: &str, input: &[u8], repeat: u32) -> (u32, Vec<u8>, Duration) {
        self.try_run(prog, input, repeat).unwrap_or_else(|e| {
            panic!(
                "BPF_PROG_TEST_RUN of {prog} over {} bytes failed: {e:#?}",
                input.len()
            )
        })
    }

    fn try_run(
        &self,
        prog: &str,
        input: &[u8],
        repeat: u32,
    ) -> Result<(u32, Vec<u8>, Duration), String> {
        common_datapath::try_run(&self.bpf, prog, input, repeat)
    }

    /// One run of `prog` over `input` as a GSO packet (`__sk_buff` gso_size/gso_segs set, as the
    /// kernel hands a GRO/GSO aggregate to tc): (verdict, output frame).
    fn run_gso(&self, prog: &str, input: &[u8], gso_size: u32, gso_segs: u32) -> (u32, Vec<u8>) {
        // struct __sk_buff (uapi, 192 bytes): gso_segs at 164, gso_size at 176; every other field
        // zero, as BPF_PROG_TEST_RUN requires.
        let mut ctx = [0u8; 192];
        ctx[164..168].copy_from_slice(&gso_segs.to_ne_bytes());
        ctx[176..180].copy_from_slice(&gso_size.to_ne_bytes());
        let mut out = vec![0u8; input.len() + 256];
        let opts = TestRunOptions {
            data_in: Some(input),
            data_out: Some(&mut out),
            ctx_in: Some(&ctx),
            ..Default::default()
        };
        let result = self
            .prog(prog)
            .test_run(opts)
            .unwrap_or_else(|e| panic!("GSO BPF_PROG_TEST_RUN of {prog}: {e:#?}"));
        out.truncate(result.data_size_out as usize);
        (result.return_value, out)
    }

    fn run(&self, prog: &str, input: &[u8]) -> (u32, Vec<u8>) {
        let (verdict, out, _) = self.run_timed(prog, input, 1);
        (verdict, out)
    }

    fn services(&mut self) -> HashMap<&mut MapData, ServiceKey, ServiceValue> {
        HashMap::try_from(self.bpf.map_mut(MAP_SERVICES).expect("SERVICES map"))
            .expect("SERVICES type")
    }

    fn backends(&mut self) -> HashMap<&mut MapData, u32, Backend> {
        HashMap::try_from(self.bpf.map_mut(MAP_BACKENDS).expect("BACKENDS map"))
            .expect("BACKENDS type")
    }

    fn conntrack(&mut self) -> HashMap<&mut MapData, CtKey, CtValue> {
        HashMap::try_from(self.bpf.map_mut(MAP_CONNTRACK).expect("CONNTRACK map"))
            .expect("CONNTRACK type")
    }

    fn snat(&mut self) -> HashMap<&mut MapData, SnatKey, SnatValue> {
        HashMap::try_from(self.bpf.map_mut(MAP_SNAT).expect("SNAT map")).expect("SNAT type")
    }

    fn fragments(&mut self) -> HashMap<&mut MapData, FragKey, FragValue> {
        HashMap::try_from(self.bpf.map_mut(MAP_FRAGMENTS).expect("FRAGMENTS map"))
            .expect("FRAGMENTS type")
    }

    /// The fragment record of `pkt`'s datagram at `hook`, as its fragments arrive there.
    fn frag_record(&mut self, pkt: &Pkt, hook: u8) -> Option<FragValue> {
        self.fragments().get(&frag_key(pkt, hook), 0).ok()
    }

    fn set_node_addr(&mut self, addr: Ipv4Addr) {
        common_datapath::set_node_addr(&mut self.bpf, addr);
    }

    /// A frontend with `service_flags` and raw backends (ids from 200 up).
    fn set_frontend(
        &mut self,
        addr: Ipv4Addr,
        port: u16,
        proto: u8,
        flags: u16,
        backends: &[(u32, Backend)],
    ) {
        let key = ServiceKey::new(addr.octets(), port.to_be_bytes(), proto, 0);
        self.set_frontend_entry(key, 50, flags, backends);
    }

    /// The in-cluster (`SCOPE_INTERNAL`) entry of an eTP=Local frontend, with rev-NAT id 51 and
    /// no flags (in-cluster traffic is carried like a ClusterIP's, as the agent writes it).
    fn set_in_cluster_frontend(
        &mut self,
        addr: Ipv4Addr,
        port: u16,
        proto: u8,
        backends: &[(u32, Backend)],
    ) {
        let key = ServiceKey {
            scope: SCOPE_INTERNAL,
            ..ServiceKey::new(addr.octets(), port.to_be_bytes(), proto, 0)
        };
        self.set_frontend_entry(key, 51, 0, backends);
    }

    fn set_frontend_entry(
        &mut self,
        key: ServiceKey,
        rev_nat_id: u32,
        flags: u16,
        backends: &[(u32, Backend)],
    ) {
        for (i, (id, b)) in backends.iter().enumerate() {
            self.backends().insert(*id, *b, 0).expect("insert backend");
            self.services()
                .insert(key.with_slot(i as u16 + 1), ServiceValue::slot(*id), 0)
                .expect("insert slot");
        }
        self.services()
            .insert(
                key,
                ServiceValue::frontend_with_flags(backends.len() as u16, rev_nat_id, flags),
                0,
            )
            .expect("insert frontend");
    }

    fn set_backend(&mut self, id: u32, proto: u8) {
        let (addr, port) = backend_addr(id);
        let b = Backend {
            addr: addr.octets(),
            port: port.to_be_bytes(),
            proto,
            flags: 0,
        };
        self.backends().insert(id, b, 0).expect("insert backend");
    }

    fn remove_backend(&mut self, id: u32) {
        self.backends().remove(&id).expect("remove backend");
    }

    /// Write a Service the way the agent does: backends → slots → frontend.
    fn set_service(
        &mut self,
        vip: Ipv4Addr,
        port: u16,
        proto: u8,
        rev_nat_id: u32,
        backend_ids: &[u32],
    ) {
        for &id in backend_ids {
            self.set_backend(id, proto);
        }
        let key = ServiceKey::new(vip.octets(), port.to_be_bytes(), proto, 0);
        let mut services = self.services();
        for (i, &id) in backend_ids.iter().enumerate() {
            services
                .insert(key.with_slot(i as u16 + 1), ServiceValue::slot(id), 0)
                .expect("insert slot");
        }
        services
            .insert(
                key,
                ServiceValue::frontend(backend_ids.len() as u16, rev_nat_id),
                0,
            )
            .expect("insert frontend");
    }

    /// The standard services: VIP:80/TCP → backends 1, 2; VIP:53/UDP → 11, 12; VIP_EMPTY with none.
    fn with_services(mut self) -> Self {
        self.set_service(VIP, 80, proto::TCP, TCP_REVNAT, &[1, 2]);
        self.set_service(VIP, 53, proto::UDP, UDP_REVNAT, &[11, 12]);
        self.set_service(VIP_EMPTY, 80, proto::TCP, 3, &[]);
        self.set_service(VIP_EMPTY, 53, proto::UDP, 4, &[]);
        self
    }

    fn ct(&mut self, key: &CtKey) -> Option<CtValue> {
        self.conntrack().get(key, 0).ok()
    }

    /// `VIP`:80/TCP picks round robin.
    fn round_robin_on_vip(&mut self) {
        let key = ServiceKey::new(VIP.octets(), 80u16.to_be_bytes(), proto::TCP, 0);
        let mut frontend = self.services().get(&key, 0).expect("frontend");
        frontend.scheduler = proxy_common::Scheduler::RoundRobin.code();
        self.services()
            .insert(key, frontend, 0)
            .expect("rr frontend");
    }

    /// The ingress program's file descriptor number (for `common_datapath::race_on_two_cpus`).
    fn ingress_fd(&self) -> std::os::fd::RawFd {
        use std::os::fd::{AsFd, AsRawFd};
        let fd = self.prog(PROG_TC_INGRESS).fd().expect("program fd");
        fd.as_fd().as_raw_fd()
    }

    /// Every conntrack and SNAT entry removed.
    fn clear_flows(&mut self) {
        let keys: Vec<CtKey> = self.conntrack().keys().map(|k| k.expect("key")).collect();
        for key in keys {
            let _ = self.conntrack().remove(&key);
        }
        let keys: Vec<SnatKey> = self.snat().keys().map(|k| k.expect("key")).collect();
        for key in keys {
            let _ = self.snat().remove(&key);
        }
    }

    fn ct_len(&mut self) -> usize {
        self.conntrack().keys().count()
    }

    fn counters(&self) -> BTreeMap<&'static str, u64> {
        common_datapath::counters(&self.bpf)
    }

    fn counter(&self, c: Counter) -> u64 {
        self.counters()[c.name()]
    }

    /// Run a step and check it; returns the decoded output when it is IPv4.
    fn check(&mut self, step: Step) -> Vec<u8> {
        let before = self.counters();
        let what = step.what;
        let run = common_datapath::try_run_checked(&self.bpf, step.prog, &step.input, step.verdict);
        let (verdict, out, _) = match run {
            Ok(run) => run,
            // The kernel's test harness itself refuses IPv4 frames without a full IPv4 header
            // (6.18: EINVAL below 14 + 20 bytes), so those rows cannot reach the program here.
            Err(_) if step.input.len() < 14 + 20 => {
                println!(
                    "{what}: skipped, BPF_PROG_TEST_RUN refuses a {}-byte IPv4 frame",
                    step.input.len()
                );
                return Vec::new();
            }
            Err(e) => panic!("{what}: BPF_PROG_TEST_RUN of {} failed: {e:#?}", step.prog),
        };
        assert_eq!(verdict, step.verdict, "{what}: verdict");
        match &step.expect {
            Expect::Unchanged => assert_eq!(out, step.input, "{what}: packet must pass untouched"),
            Expect::Dropped => {}
            Expect::Packet(p) => {
                let (d, want) = if is_l3(step.prog) {
                    (Decoded::parse_l3(&out), p.l3_bytes())
                } else {
                    (Decoded::parse(&out), p.bytes())
                };
                assert!(d.ip_csum_ok(), "{what}: IPv4 header checksum invalid");
                assert!(d.l4_csum_ok(), "{what}: L4 checksum invalid");
                assert_eq!(
                    out, want,
                    "{what}: output packet differs from the expected {p:?}"
                );
            }
            Expect::Fragment(bytes) => {
                let d = if is_l3(step.prog) {
                    Decoded::parse_l3(&out)
                } else {
                    Decoded::parse(&out)
                };
                assert!(d.ip_csum_ok(), "{what}: IPv4 header checksum invalid");
                assert_eq!(&out, bytes, "{what}: output fragment differs");
            }
            Expect::IcmpUnreachable => check_icmp_unreachable(what, &step.input, &out),
            Expect::Rst { seq, ack, flags } => {
                check_rst(what, &step.input, &out, *seq, *ack, *flags)
            }
        }
        let after = self.counters();
        let mut expected: BTreeMap<&str, u64> =
            step.counts.iter().map(|(c, n)| (c.name(), *n)).collect();
        let packets = if step.prog == PROG_TC_INGRESS || step.prog == PROG_TC_INGRESS_L3 {
            Counter::IngressPackets
        } else {
            Counter::EgressPackets
        };
        *expected.entry(packets.name()).or_default() += 1;
        // Every backend choice counts one pick of its frontend's scheduler (`pick_*`). A step
        // that lists none expects one pick per new or reselected flow, of any scheduler, except
        // a flow sent to its client's session-affinity endpoint (`affinity_hit`: no pick).
        let pick_names = proxy_common::stats::PICK_COUNTERS.map(|c| c.name());
        let picks_listed = step
            .counts
            .iter()
            .any(|(c, _)| pick_names.contains(&c.name()));
        if !picks_listed {
            let implied: u64 = [Counter::NewFlow, Counter::StaleBackendReselected]
                .iter()
                .map(|c| expected.get(c.name()).copied().unwrap_or(0))
                .sum::<u64>()
                - (after[Counter::AffinityHit.name()] - before[Counter::AffinityHit.name()]);
            let picked: u64 = pick_names.iter().map(|n| after[n] - before[n]).sum();
            assert_eq!(
                picked, implied,
                "{what}: {picked} scheduler picks counted, expected one per new flow ({implied})"
            );
        }
        for (name, after_n) in &after {
            if !picks_listed && pick_names.contains(name) {
                continue;
            }
            let delta = after_n - before[name];
            let want = expected.get(name).copied().unwrap_or(0);
            assert_eq!(
                delta, want,
                "{what}: counter {name} changed by {delta}, expected {want}"
            );
        }
        out
    }
}

enum Expect {
    /// Output == input.
    Unchanged,
    /// TC_ACT_SHOT; the output is not looked at.
    Dropped,
    /// Output == this packet, byte for byte (checksums included), and its checksums verify.
    Packet(Pkt),
    /// Output == these bytes (an IP fragment: only its IPv4 checksum can be verified alone).
    Fragment(Vec<u8>),
    /// A well-formed ICMP port unreachable answering the input.
    IcmpUnreachable,
    /// A TCP RST answering the input.
    Rst { seq: u32, ack: u32, flags: u8 },
}

struct Step<'a> {
    what: &'a str,
    prog: &'static str,
    input: Vec<u8>,
    verdict: u32,
    expect: Expect,
    /// Counter deltas besides ingress_packets/egress_packets; every other counter must not move.
    counts: &'a [(Counter, u64)],
}

fn ingress<'a>(
    what: &'a str,
    input: Vec<u8>,
    verdict: u32,
    expect: Expect,
    counts: &'a [(Counter, u64)],
) -> Step<'a> {
    Step {
        what,
        prog: PROG_TC_INGRESS,
        input,
        verdict,
        expect,
        counts,
    }
}

fn egress<'a>(
    what: &'a str,
    input: Vec<u8>,
    verdict: u32,
    expect: Expect,
    counts: &'a [(Counter, u64)],
) -> Step<'a> {
    Step {
        what,
        prog: PROG_TC_EGRESS,
        input,
        verdict,
        expect,
        counts,
    }
}

/// One of the L3-device programs (packets without Ethernet header).
fn is_l3(prog: &str) -> bool {
    prog == PROG_TC_INGRESS_L3 || prog == PROG_TC_EGRESS_L3
}

/// A step through `tc_ingress_l3` (an L3 device: `input` without Ethernet header).
fn ingress_l3<'a>(
    what: &'a str,
    input: Vec<u8>,
    verdict: u32,
    expect: Expect,
    counts: &'a [(Counter, u64)],
) -> Step<'a> {
    Step {
        prog: PROG_TC_INGRESS_L3,
        ..ingress(what, input, verdict, expect, counts)
    }
}

/// A step through `tc_egress_l3`.
fn egress_l3<'a>(
    what: &'a str,
    input: Vec<u8>,
    verdict: u32,
    expect: Expect,
    counts: &'a [(Counter, u64)],
) -> Step<'a> {
    Step {
        prog: PROG_TC_EGRESS_L3,
        ..egress(what, input, verdict, expect, counts)
    }
}

fn check_icmp_unreachable(what: &str, input: &[u8], out: &[u8]) {
    let orig = Decoded::parse(input);
    let d = Decoded::parse(out);
    assert_eq!(
        d.dst_mac, orig.src_mac,
        "{what}: ICMP must go back to the client's MAC"
    );
    assert_eq!(d.src_mac, orig.dst_mac, "{what}: ICMP source MAC");
    assert_eq!(
        (d.ihl, d.proto, d.ttl),
        (20, proto::ICMP, 64),
        "{what}: outer IPv4 header (ihl, proto, ttl)"
    );
    assert_eq!(d.saddr, orig.daddr, "{what}: ICMP must come from the VIP");
    assert_eq!(d.daddr, orig.saddr, "{what}: ICMP must go to the client");
    assert_eq!(
        out.len(),
        14 + d.tot_len,
        "{what}: frame length matches IPv4 total length"
    );
    assert!(d.ip_csum_ok(), "{what}: outer IPv4 checksum invalid");
    assert!(d.l4_csum_ok(), "{what}: ICMP checksum invalid");
    assert_eq!(
        (d.l4[0], d.l4[1]),
        (3, 3),
        "{what}: ICMP type/code must be 3/3 (port unreachable)"
    );
    assert_eq!(&d.l4[4..8], &[0; 4], "{what}: ICMP unused field");
    let quoted = &d.l4[8..];
    let want = &input[14..14 + orig.ihl + 8];
    assert!(
        quoted.len() >= want.len(),
        "{what}: ICMP quotes {} bytes, need {}",
        quoted.len(),
        want.len()
    );
    assert_eq!(
        &quoted[..want.len()],
        want,
        "{what}: quoted data must be the original IPv4 header + 8 bytes"
    );
}

fn check_rst(what: &str, input: &[u8], out: &[u8], seq: u32, ack: u32, flags: u8) {
    let orig = Decoded::parse(input);
    let d = Decoded::parse(out);
    assert_eq!(
        (d.dst_mac, d.src_mac),
        (orig.src_mac, orig.dst_mac),
        "{what}: RST MACs swapped"
    );
    assert_eq!(
        (d.ihl, d.proto, d.tot_len),
        (20, proto::TCP, 40),
        "{what}: RST IPv4 header"
    );
    assert_eq!(
        (d.saddr, d.daddr),
        (orig.daddr, orig.saddr),
        "{what}: RST addresses swapped (from the VIP)"
    );
    assert_eq!(
        (d.sport(), d.dport()),
        (orig.dport(), orig.sport()),
        "{what}: RST ports swapped"
    );
    assert_eq!(out.len(), 14 + 40, "{what}: RST frame length");
    assert!(d.ip_csum_ok(), "{what}: RST IPv4 checksum invalid");
    assert!(d.l4_csum_ok(), "{what}: RST TCP checksum invalid");
    assert_eq!(d.tcp_flags(), flags, "{what}: RST flags");
    assert_eq!(
        (d.tcp_seq(), d.tcp_ack()),
        (seq, ack),
        "{what}: RST seq/ack"
    );
}

/// The backend id the datapath must pick for a new flow (same pure functions), seed 0.
fn expected_pick(pkt: &Pkt, ids: &[u32]) -> u32 {
    expected_pick_seeded(0, pkt, ids)
}

/// As [`expected_pick`] under the flow hash seed `seed`.
fn expected_pick_seeded(seed: u32, pkt: &Pkt, ids: &[u32]) -> u32 {
    let hash = flow_hash(
        seed,
        pkt.saddr.octets(),
        pkt.daddr.octets(),
        pkt.sport().to_be_bytes(),
        pkt.dport().to_be_bytes(),
        pkt.proto(),
    );
    ids[pick_slot(hash, ids.len() as u16).expect("non-empty") as usize - 1]
}

/// `pkt` with its destination rewritten to backend `id`.
fn dnated(pkt: &Pkt, id: u32) -> Pkt {
    let (addr, port) = backend_addr(id);
    let mut p = pkt.clone();
    p.daddr = addr;
    set_ports(&mut p, pkt.sport(), port);
    p
}

fn set_ports(p: &mut Pkt, s: u16, d: u16) {
    match &mut p.l4 {
        common_packet::L4::Tcp { sport, dport, .. }
        | common_packet::L4::Udp { sport, dport, .. } => {
            *sport = s;
            *dport = d;
        }
    }
}

/// The reply of backend `id` to `pkt` (as the backend sends it, before reverse NAT).
fn reply_from(pkt: &Pkt, id: u32) -> Pkt {
    dnated(pkt, id).reversed()
}

/// The backend's SYN-ACK to the SYN `pkt` (to backend `id`).
fn syn_ack_from(pkt: &Pkt, id: u32) -> Pkt {
    let mut p = reply_from(pkt, id);
    if let common_packet::L4::Tcp { flags, .. } = &mut p.l4 {
        *flags = SYN | ACK;
    }
    p
}

/// `reply` with its source rewritten to the frontend of `pkt`.
fn rev_natted(reply: &Pkt, pkt: &Pkt) -> Pkt {
    let mut p = reply.clone();
    p.saddr = pkt.daddr;
    set_ports(&mut p, pkt.dport(), reply.dport());
    p
}

fn original_key(pkt: &Pkt) -> CtKey {
    CtKey {
        saddr: pkt.saddr.octets(),
        daddr: pkt.daddr.octets(),
        sport: pkt.sport().to_be_bytes(),
        dport: pkt.dport().to_be_bytes(),
        proto: pkt.proto(),
        dir: ct_dir::ORIGINAL,
        _pad: [0; 2],
    }
}

fn reply_key(pkt: &Pkt, id: u32) -> CtKey {
    let (addr, port) = backend_addr(id);
    CtKey {
        saddr: addr.octets(),
        daddr: pkt.saddr.octets(),
        sport: port.to_be_bytes(),
        dport: pkt.sport().to_be_bytes(),
        proto: pkt.proto(),
        dir: ct_dir::REPLY,
        _pad: [0; 2],
    }
}

/// Both conntrack entries of `pkt`'s flow exist and name backend `id` with the given state.
fn assert_flow(
    dp: &mut Datapath,
    what: &str,
    pkt: &Pkt,
    id: u32,
    rev_nat_id: u32,
    state: u8,
) -> CtValue {
    let orig = dp
        .ct(&original_key(pkt))
        .unwrap_or_else(|| panic!("{what}: ORIGINAL conntrack entry missing"));
    let reply = dp
        .ct(&reply_key(pkt, id))
        .unwrap_or_else(|| panic!("{what}: REPLY conntrack entry missing"));
    let (addr, port) = backend_addr(id);
    assert_eq!(orig.backend_id, id, "{what}: ORIGINAL backend_id");
    assert_eq!(orig.rev_nat_id, rev_nat_id, "{what}: ORIGINAL rev_nat_id");
    assert_eq!(
        orig.frontend_addr,
        pkt.daddr.octets(),
        "{what}: frontend addr"
    );
    assert_eq!(
        orig.frontend_port,
        pkt.dport().to_be_bytes(),
        "{what}: frontend port"
    );
    assert_eq!(
        orig.backend_addr,
        addr.octets(),
        "{what}: backend addr snapshot"
    );
    assert_eq!(
        orig.backend_port,
        port.to_be_bytes(),
        "{what}: backend port snapshot"
    );
    assert_eq!(orig.state, state, "{what}: ORIGINAL state");
    assert!(
        orig.created_ns > 0 && orig.last_seen_ns >= orig.created_ns,
        "{what}: timestamps {orig:?}"
    );
    assert_eq!(
        (
            reply.backend_id,
            reply.frontend_addr,
            reply.frontend_port,
            reply.backend_addr,
            reply.backend_port
        ),
        (
            orig.backend_id,
            orig.frontend_addr,
            orig.frontend_port,
            orig.backend_addr,
            orig.backend_port
        ),
        "{what}: REPLY entry must carry the same translation"
    );
    orig
}

/// A client port whose flow picks a different backend among `after` than among `before`.
fn port_that_moves(base: &Pkt, before: &[u32], after: &[u32]) -> u16 {
    (40_000..41_000)
        .find(|&port| {
            let mut p = base.clone();
            set_ports(&mut p, port, base.dport());
            expected_pick(&p, before) != expected_pick(&p, after)
        })
        .expect("some port changes backend when the set grows")
}

/// The backend of a new flow comes from the flow hash keyed by the load-time `hash_seed` (random
/// per node in the agent): under two seeds the same 64 SYNs go where each seed says, and the two
/// seeds disagree on some of them (a seed the datapath ignored would match only one).
#[test]
fn the_load_time_hash_seed_keys_the_backend_pick() {
    let mut moved = 0;
    for seed in [0x1234_5678u32, 0xdead_beef] {
        let mut dp = Datapath::load_with(DatapathConfig {
            hash_seed: seed,
            ..DatapathConfig::DEFAULT
        });
        dp.set_service(VIP, 80, proto::TCP, TCP_REVNAT, &[1, 2, 3, 4]);
        for port in 40_000..40_064u16 {
            let syn = Pkt::tcp(CLIENT, port, VIP, 80, SYN);
            let want = expected_pick_seeded(seed, &syn, &[1, 2, 3, 4]);
            let (verdict, out) = dp.run(PROG_TC_INGRESS, &syn.bytes());
            assert_eq!(verdict, TC_NEXT, "seed {seed:#x} port {port}: verdict");
            assert_eq!(
                Decoded::parse(&out).daddr,
                backend_addr(want).0,
                "seed {seed:#x} port {port}: backend"
            );
            if want != expected_pick_seeded(0, &syn, &[1, 2, 3, 4]) {
                moved += 1;
            }
        }
    }
    assert!(moved > 32, "only {moved} of 128 picks depend on the seed");
}

#[test]
fn tcp_flow_is_dnated_tracked_and_reverse_natted() {
    let mut dp = Datapath::load().with_services();
    let base = Pkt::tcp(CLIENT, 0, VIP, 80, SYN);
    let sport = port_that_moves(&base, &[1, 2], &[1, 2, 3, 4]);
    let syn = Pkt::tcp(CLIENT, sport, VIP, 80, SYN);
    let id = expected_pick(&syn, &[1, 2]);

    dp.check(ingress(
        "SYN to VIP:80 is DNATed to the picked backend",
        syn.bytes(),
        TC_NEXT,
        Expect::Packet(dnated(&syn, id)),
        &[(Counter::NewFlow, 1)],
    ));
    assert_flow(
        &mut dp,
        "after SYN",
        &syn,
        id,
        TCP_REVNAT,
        ct_state::SYN_SENT,
    );
    assert_eq!(dp.ct_len(), 2, "one flow = two conntrack entries");

    // A bare ACK before any SYN-ACK (a spoofed or blind handshake) follows the flow but does
    // not establish it: the flow keeps the opening flow's transitory timeout.
    let early = Pkt::tcp(CLIENT, sport, VIP, 80, ACK);
    dp.check(ingress(
        "ACK before the SYN-ACK follows the flow",
        early.bytes(),
        TC_NEXT,
        Expect::Packet(dnated(&early, id)),
        &[(Counter::EstablishedFlow, 1)],
    ));
    assert_flow(
        &mut dp,
        "SYN then ACK without a SYN-ACK: not established",
        &syn,
        id,
        TCP_REVNAT,
        ct_state::SYN_SENT,
    );

    let synack = syn_ack_from(&syn, id);
    dp.check(egress(
        "SYN-ACK from the backend is reverse-NATed to VIP:80",
        synack.bytes(),
        TC_NEXT,
        Expect::Packet(rev_natted(&synack, &syn)),
        &[(Counter::ReplyTranslated, 1)],
    ));
    assert_flow(
        &mut dp,
        "after SYN-ACK",
        &syn,
        id,
        TCP_REVNAT,
        ct_state::SYN_RECV,
    );

    let ack = Pkt::tcp(CLIENT, sport, VIP, 80, ACK);
    dp.check(ingress(
        "handshake ACK follows the flow",
        ack.bytes(),
        TC_NEXT,
        Expect::Packet(dnated(&ack, id)),
        &[(Counter::EstablishedFlow, 1)],
    ));
    assert_flow(
        &mut dp,
        "after ACK",
        &syn,
        id,
        TCP_REVNAT,
        ct_state::ESTABLISHED,
    );

    // The Service grows: the hash alone would now send this flow elsewhere; conntrack must not.
    dp.set_service(VIP, 80, proto::TCP, TCP_REVNAT, &[1, 2, 3, 4]);
    let data = Pkt::tcp(CLIENT, sport, VIP, 80, PSH | ACK).payload(b"GET / HTTP/1.1\r\n\r\n");
    assert_ne!(
        expected_pick(&data, &[1, 2, 3, 4]),
        id,
        "test setup: the port must move under a pure hash"
    );
    dp.check(ingress(
        "data after the backend set grew keeps its backend",
        data.bytes(),
        TC_NEXT,
        Expect::Packet(dnated(&data, id)),
        &[(Counter::EstablishedFlow, 1)],
    ));

    let reply = reply_from(&data, id).payload(b"HTTP/1.1 200 OK\r\n\r\n");
    dp.check(egress(
        "reply from the backend is reverse-NATed",
        reply.bytes(),
        TC_NEXT,
        Expect::Packet(rev_natted(&reply, &data)),
        &[(Counter::ReplyTranslated, 1)],
    ));

    let stranger = Pkt::tcp(backend_addr(id).0, 8080, CLIENT, sport + 1, ACK);
    dp.check(egress(
        "a reply with no conntrack entry passes unchanged",
        stranger.bytes(),
        TC_NEXT,
        Expect::Unchanged,
        &[(Counter::ReplyNotTracked, 1)],
    ));
    let direct = Pkt::tcp(backend_addr(id).0, 8080, CLIENT, sport, ACK).options(&[1, 1, 1, 0]);
    let direct_out = rev_natted(&direct, &data);
    dp.check(egress(
        "a reply with IP options is reverse-NATed, options kept",
        direct.bytes(),
        TC_NEXT,
        Expect::Packet(direct_out),
        &[(Counter::ReplyTranslated, 1), (Counter::IpOptions, 1)],
    ));

    let fin = reply_from(&data, id);
    let mut fin = fin.clone();
    if let common_packet::L4::Tcp { flags, .. } = &mut fin.l4 {
        *flags = FIN | ACK;
    }
    dp.check(egress(
        "FIN from the backend is reverse-NATed",
        fin.bytes(),
        TC_NEXT,
        Expect::Packet(rev_natted(&fin, &data)),
        &[(Counter::ReplyTranslated, 1)],
    ));
    // The backend's FIN half-closes the flow (kube-proxy's tcpCloseWaitTimeout applies): the
    // client may still send.
    assert_eq!(
        dp.ct(&reply_key(&syn, id)).unwrap().state,
        ct_state::FIN_REPLY,
        "FIN on egress half-closes the REPLY entry"
    );
    assert_eq!(
        dp.ct(&original_key(&syn)).unwrap().state,
        ct_state::FIN_REPLY,
        "FIN on egress half-closes the ORIGINAL entry"
    );
    let client_fin = Pkt::tcp(CLIENT, sport, VIP, 80, FIN | ACK);
    dp.check(ingress(
        "the client's FIN after the backend's is still translated",
        client_fin.bytes(),
        TC_NEXT,
        Expect::Packet(dnated(&client_fin, id)),
        &[(Counter::EstablishedFlow, 1)],
    ));
    assert_eq!(
        dp.ct(&original_key(&syn)).unwrap().state,
        ct_state::CLOSING,
        "FINs from both sides close the ORIGINAL entry"
    );
    let last_ack = reply_from(&data, id);
    dp.check(egress(
        "the backend's last ACK",
        last_ack.bytes(),
        TC_NEXT,
        Expect::Packet(rev_natted(&last_ack, &data)),
        &[(Counter::ReplyTranslated, 1)],
    ));
    assert_eq!(
        dp.ct(&reply_key(&syn, id)).unwrap().state,
        ct_state::CLOSING,
        "the REPLY entry takes the ORIGINAL's state with the backend's next packet"
    );

    // A new connection on the closed tuple is a new flow, picked over the current backends.
    let again = Pkt::tcp(CLIENT, sport, VIP, 80, SYN);
    let new_id = expected_pick(&again, &[1, 2, 3, 4]);
    dp.check(ingress(
        "SYN reusing a closed tuple is picked anew",
        again.bytes(),
        TC_NEXT,
        Expect::Packet(dnated(&again, new_id)),
        &[(Counter::NewFlow, 1)],
    ));
    assert_flow(
        &mut dp,
        "after tuple reuse",
        &again,
        new_id,
        TCP_REVNAT,
        ct_state::SYN_SENT,
    );
    // The old REPLY entry: the new flow's own again if it went to the same backend; otherwise
    // retired, holding the tuple while that backend may keep the connection in TIME_WAIT.
    let old_reply = dp
        .ct(&reply_key(&syn, id))
        .expect("the old reply tuple's entry");
    if new_id == id {
        assert_eq!(
            old_reply.flags & ct_flags::RETIRED,
            0,
            "reused by the new flow"
        );
        assert_eq!(
            old_reply.state,
            ct_state::SYN_SENT,
            "the new flow's REPLY entry"
        );
    } else {
        assert_eq!(
            old_reply.flags & ct_flags::RETIRED,
            ct_flags::RETIRED,
            "the old REPLY entry of the reused tuple is retired"
        );
    }
}

#[test]
fn tcp_without_conntrack_follows_the_hash() {
    let mut dp = Datapath::load().with_services();
    // Conntrack lost (agent restart with new maps, LRU eviction): a mid-flow packet is picked by the
    // same hash, so with an unchanged backend set it reaches the same backend.
    let ack = Pkt::tcp(CLIENT, 41_234, VIP, 80, ACK);
    let id = expected_pick(&ack, &[1, 2]);
    dp.check(ingress(
        "mid-flow ACK without an entry",
        ack.bytes(),
        TC_NEXT,
        Expect::Packet(dnated(&ack, id)),
        &[(Counter::NewFlow, 1)],
    ));
    assert_flow(
        &mut dp,
        "mid-flow pickup",
        &ack,
        id,
        TCP_REVNAT,
        ct_state::ESTABLISHED,
    );
    let rst = Pkt::tcp(CLIENT, 41_234, VIP, 80, RST | ACK);
    dp.check(ingress(
        "client RST is forwarded",
        rst.bytes(),
        TC_NEXT,
        Expect::Packet(dnated(&rst, id)),
        &[(Counter::EstablishedFlow, 1)],
    ));
    assert_flow(
        &mut dp,
        "after RST",
        &ack,
        id,
        TCP_REVNAT,
        ct_state::CLOSING,
    );
}

#[test]
fn udp_flow_is_dnated_and_reverse_natted() {
    let mut dp = Datapath::load().with_services();
    let q = Pkt::udp(CLIENT, 33_000, VIP, 53).payload(b"\x12\x34 dns query");
    let id = expected_pick(&q, &[11, 12]);
    dp.check(ingress(
        "UDP datagram to VIP:53 is DNATed",
        q.bytes(),
        TC_NEXT,
        Expect::Packet(dnated(&q, id)),
        &[(Counter::NewFlow, 1)],
    ));
    assert_flow(&mut dp, "UDP flow", &q, id, UDP_REVNAT, ct_state::UDP);
    dp.check(ingress(
        "second datagram of the flow",
        q.bytes(),
        TC_NEXT,
        Expect::Packet(dnated(&q, id)),
        &[(Counter::EstablishedFlow, 1)],
    ));
    let r = reply_from(&q, id).payload(b"\x12\x34 dns answer");
    dp.check(egress(
        "UDP reply is reverse-NATed",
        r.bytes(),
        TC_NEXT,
        Expect::Packet(rev_natted(&r, &q)),
        &[(Counter::ReplyTranslated, 1)],
    ));

    // Checksum 0 ("none") must stay 0 through both rewrites.
    let z = Pkt::udp(CLIENT, 33_001, VIP, 53).zero_udp_csum();
    let zid = expected_pick(&z, &[11, 12]);
    let out = dp.check(ingress(
        "UDP with checksum 0 is DNATed, checksum stays 0",
        z.bytes(),
        TC_NEXT,
        Expect::Packet(dnated(&z, zid)),
        &[(Counter::NewFlow, 1)],
    ));
    assert_eq!(
        Decoded::parse(&out).l4_csum_field(),
        0,
        "UDP checksum 0 must stay 0"
    );
    let zr = reply_from(&z, zid);
    let out = dp.check(egress(
        "UDP reply with checksum 0",
        zr.bytes(),
        TC_NEXT,
        Expect::Packet(rev_natted(&zr, &z)),
        &[(Counter::ReplyTranslated, 1)],
    ));
    assert_eq!(
        Decoded::parse(&out).l4_csum_field(),
        0,
        "UDP reply checksum 0 must stay 0"
    );

    // Ethernet padding after the IPv4 packet (short frames) is carried along.
    let short = Pkt::udp(CLIENT, 33_002, VIP, 53).payload(b"x");
    let mut padded = short.bytes();
    padded.resize(60, 0);
    let mut want = dnated(&short, expected_pick(&short, &[11, 12])).bytes();
    want.resize(60, 0);
    let (verdict, out) = dp.run(PROG_TC_INGRESS, &padded);
    assert_eq!(
        (verdict, out),
        (TC_NEXT, want),
        "padded minimum-size frame is DNATed, padding kept"
    );
}

/// IPv4 BIG TCP (Linux ≥ 6.3): a GSO aggregate beyond 64 KiB carries IPv4 total length 0 and
/// its length in the skb. Such packets of a flow are DNATed on ingress and reverse-NATed on
/// egress like any other (they were dropped as malformed), bytes equal to the same packets with a
/// real total length, translated, then given total length 0.
#[test]
fn ipv4_big_tcp_packets_are_translated() {
    /// The frame with IPv4 total length 0 and its header checksum recomputed.
    fn big(frame: Vec<u8>) -> Vec<u8> {
        let mut f = frame;
        f[14 + 2..14 + 4].copy_from_slice(&[0, 0]);
        f[14 + 10..14 + 12].copy_from_slice(&[0, 0]);
        let c = proxy_common::csum::ipv4_header(&f[14..14 + 20]).to_be_bytes();
        f[14 + 10..14 + 12].copy_from_slice(&c);
        f
    }
    let dp = Datapath::load().with_services();
    let syn = Pkt::tcp(CLIENT, 41_000, VIP, 80, SYN);
    let id = expected_pick(&syn, &[1, 2]);
    let (verdict, out) = dp.run(PROG_TC_INGRESS, &syn.bytes());
    assert_eq!((verdict, out), (TC_NEXT, dnated(&syn, id).bytes()), "SYN");

    let data = Pkt::tcp(CLIENT, 41_000, VIP, 80, PSH | ACK).payload(&[0x5a; 2_000]);
    let (verdict, out) = dp.run_gso(PROG_TC_INGRESS, &big(data.bytes()), 1_000, 2);
    assert_eq!(verdict, TC_NEXT, "BIG TCP data to the VIP: verdict");
    assert_eq!(
        out,
        big(dnated(&data, id).bytes()),
        "BIG TCP data to the VIP is DNATed to backend {id}"
    );
    assert_eq!(dp.counter(Counter::EstablishedFlow), 1);
    assert_eq!(dp.counter(Counter::DropMalformed), 0);

    let reply = reply_from(&data, id);
    let (verdict, out) = dp.run_gso(PROG_TC_EGRESS, &big(reply.bytes()), 1_000, 2);
    assert_eq!(verdict, TC_NEXT, "BIG TCP reply: verdict");
    assert_eq!(
        out,
        big(rev_natted(&reply, &data).bytes()),
        "BIG TCP reply from the backend comes from the VIP"
    );
    assert_eq!(dp.counter(Counter::ReplyTranslated), 1);

    // Total length 0 without GSO is still malformed: dropped when addressed to a Service.
    let (verdict, _) = dp.run(PROG_TC_INGRESS, &big(data.bytes()));
    assert_eq!(verdict, TC_ACT_SHOT, "total length 0 on a non-GSO packet");
    assert_eq!(dp.counter(Counter::DropMalformed), 1);
}

/// Generated answers are rate-limited per CPU (`proxy_common::ratelimit`): a flood of SYNs to a
/// Service without endpoints gets at most the burst plus the rate's worth for the time it took
/// (per CPU the test thread ran on) as ICMP errors; the rest is dropped and counted. Bounds, not
/// timings: the elapsed time only widens the allowance.
#[test]
fn generated_answers_are_rate_limited() {
    use proxy_common::ratelimit::{REJECT_BURST, REJECT_COST_NS};
    let dp = Datapath::load().with_services();
    let syn = Pkt::tcp(CLIENT, 40_000, VIP_EMPTY, 80, SYN).bytes();
    let started = std::time::Instant::now();
    let (mut answered, mut dropped, mut sent) = (0u64, 0u64, 0u64);
    while dropped < 20 && sent < 20_000 {
        match dp.run(PROG_TC_INGRESS, &syn).0 {
            TC_ACT_REDIRECT => answered += 1,
            TC_ACT_SHOT => dropped += 1,
            other => panic!("verdict {other} for a SYN to a Service without endpoints"),
        }
        sent += 1;
    }
    let elapsed = started.elapsed().as_nanos() as u64;
    let cpus = aya::util::nr_cpus().expect("CPU count") as u64;
    let allowance = cpus * (REJECT_BURST + elapsed / REJECT_COST_NS + 1);
    eprintln!(
        "{sent} SYNs in {elapsed} ns: {answered} answered, {dropped} dropped (allowance {allowance})"
    );
    assert!(
        dropped >= 20,
        "nothing over the limit after {sent} SYNs ({answered} answered)"
    );
    assert!(
        (REJECT_BURST..=allowance).contains(&answered),
        "{answered} answers, want the burst {REJECT_BURST} up to {allowance}"
    );
    assert_eq!(dp.counter(Counter::DropRejectRateLimited), dropped);
    assert_eq!(dp.counter(Counter::NoEndpointsRejected), answered);
}

#[test]
fn service_without_endpoints_answers_icmp_port_unreachable() {
    let mut dp = Datapath::load().with_services();
    let big = vec![0xab; 1000];
    let table = [
        (
            "TCP SYN to a Service without endpoints",
            Pkt::tcp(CLIENT, 40_000, VIP_EMPTY, 80, SYN),
        ),
        (
            "UDP to a Service without endpoints",
            Pkt::udp(CLIENT, 40_001, VIP_EMPTY, 53),
        ),
        (
            "UDP with a large payload (cut to header + 8 bytes)",
            Pkt::udp(CLIENT, 40_002, VIP_EMPTY, 53).payload(&big),
        ),
        (
            "UDP with IP options (quoted with the options)",
            Pkt::udp(CLIENT, 40_003, VIP_EMPTY, 53).options(&[0x94, 4, 0, 0, 1, 1, 1, 0]),
        ),
        (
            "TCP data with 40 bytes of IP options",
            Pkt::tcp(CLIENT, 40_004, VIP_EMPTY, 80, PSH | ACK).options(&[1; 40]),
        ),
    ];
    for (what, pkt) in table {
        let ip_options = if pkt.ip_options.is_empty() { 0 } else { 1 };
        dp.check(ingress(
            what,
            pkt.bytes(),
            TC_ACT_REDIRECT,
            Expect::IcmpUnreachable,
            &[
                (Counter::NoEndpointsRejected, 1),
                (Counter::IpOptions, ip_options),
            ],
        ));
    }
    assert_eq!(
        dp.ct_len(),
        0,
        "rejected packets create no conntrack entries"
    );
}

impl Datapath {
    /// Backend `id` rewritten with `backend_flags` (as the agent does when its endpoint turns
    /// not ready: the entry stays, flagged; its slot goes).
    fn set_backend_flags(&mut self, id: u32, proto: u8, flags: u8) {
        let (addr, port) = backend_addr(id);
        let b = Backend {
            addr: addr.octets(),
            port: port.to_be_bytes(),
            proto,
            flags,
        };
        self.backends().insert(id, b, 0).expect("rewrite backend");
    }

    /// The agent's writes for a Service port whose endpoint `gone` turned not ready: the
    /// remaining ids' slots and frontend, the last slot removed, `gone` flagged NOT_SERVING.
    fn mark_not_serving(&mut self, port: u16, proto_: u8, rev_nat: u32, keep: &[u32], gone: u32) {
        self.set_backend_flags(gone, proto_, backend_flags::NOT_SERVING);
        self.set_service(VIP, port, proto_, rev_nat, keep);
        self.services()
            .remove(&ServiceKey::new(
                VIP.octets(),
                port.to_be_bytes(),
                proto_,
                keep.len() as u16 + 1,
            ))
            .expect("remove the last slot");
    }
}

/// A pod whose readiness probe fails keeps its established TCP connections (netfilter keeps
/// their conntrack entries; only rules for new connections change): its backend entry stays,
/// flagged NOT_SERVING, and is in no slot. New flows never pick it; a UDP flow to it is picked
/// anew (upstream clears UDP conntrack for endpoints no longer serving). Once the endpoint
/// leaves the slices (entry deleted), the TCP flow is reset as before.
#[test]
fn not_serving_backend_keeps_tcp_flows_udp_is_reselected_new_flows_avoid_it() {
    let mut dp = Datapath::load().with_services();

    let syn = Pkt::tcp(CLIENT, 35_000, VIP, 80, SYN);
    let x = expected_pick(&syn, &[1, 2]);
    let live = if x == 1 { 2 } else { 1 };
    dp.check(ingress(
        "TCP flow created",
        syn.bytes(),
        TC_NEXT,
        Expect::Packet(dnated(&syn, x)),
        &[(Counter::NewFlow, 1)],
    ));
    dp.run(PROG_TC_EGRESS, &syn_ack_from(&syn, x).bytes());
    let q = Pkt::udp(CLIENT, 35_001, VIP, 53);
    let ux = expected_pick(&q, &[11, 12]);
    let ulive = if ux == 11 { 12 } else { 11 };
    dp.check(ingress(
        "UDP flow created",
        q.bytes(),
        TC_NEXT,
        Expect::Packet(dnated(&q, ux)),
        &[(Counter::NewFlow, 1)],
    ));

    dp.mark_not_serving(80, proto::TCP, TCP_REVNAT, &[live], x);
    dp.mark_not_serving(53, proto::UDP, UDP_REVNAT, &[ulive], ux);

    for (i, len) in [1usize, 300, 1400].into_iter().enumerate() {
        let data = Pkt::tcp(CLIENT, 35_000, VIP, 80, PSH | ACK)
            .seq_ack(1001 + i as u32 * 2000, 777)
            .payload(&vec![9; len]);
        dp.check(ingress(
            "established TCP to a not-serving backend is still DNATed to it",
            data.bytes(),
            TC_NEXT,
            Expect::Packet(dnated(&data, x)),
            &[(Counter::EstablishedFlow, 1)],
        ));
    }
    assert_flow(
        &mut dp,
        "TCP entry kept",
        &syn,
        x,
        TCP_REVNAT,
        ct_state::ESTABLISHED,
    );
    // Its SYN retransmitted (the handshake started before the endpoint turned not ready):
    // the same backend, like a netfilter conntrack entry.
    dp.check(ingress(
        "SYN retransmit of a tracked flow keeps its not-serving backend",
        syn.bytes(),
        TC_NEXT,
        Expect::Packet(dnated(&syn, x)),
        &[(Counter::EstablishedFlow, 1)],
    ));

    // New TCP flows never pick it, though the hash would have sent some there.
    let mut would_have = 0;
    for sport in 36_000..36_040 {
        let syn = Pkt::tcp(CLIENT, sport, VIP, 80, SYN);
        would_have += usize::from(expected_pick(&syn, &[1, 2]) == x);
        dp.check(ingress(
            "a new TCP flow goes to the serving backend",
            syn.bytes(),
            TC_NEXT,
            Expect::Packet(dnated(&syn, live)),
            &[(Counter::NewFlow, 1)],
        ));
    }
    assert!(
        would_have > 5,
        "some flows hashed to the not-serving backend"
    );

    // UDP: the next datagram is re-picked to the serving backend; both entries move.
    dp.check(ingress(
        "UDP to a not-serving backend is reselected",
        q.bytes(),
        TC_NEXT,
        Expect::Packet(dnated(&q, ulive)),
        &[(Counter::StaleBackendReselected, 1)],
    ));
    assert_flow(&mut dp, "UDP moved", &q, ulive, UDP_REVNAT, ct_state::UDP);
    assert!(
        dp.ct(&reply_key(&q, ux)).is_none(),
        "the not-serving backend's REPLY entry is removed"
    );

    // Ready again: the flow goes on, new flows may pick it again.
    dp.set_service(VIP, 80, proto::TCP, TCP_REVNAT, &[1, 2]);
    let ack = Pkt::tcp(CLIENT, 35_000, VIP, 80, ACK).seq_ack(9001, 777);
    dp.check(ingress(
        "ready again: still its backend",
        ack.bytes(),
        TC_NEXT,
        Expect::Packet(dnated(&ack, x)),
        &[(Counter::EstablishedFlow, 1)],
    ));

    // The endpoint leaves the slices: its entry goes, the flow is reset (as before).
    dp.mark_not_serving(80, proto::TCP, TCP_REVNAT, &[live], x);
    dp.remove_backend(x);
    dp.check(ingress(
        "TCP to a backend gone from the slices is reset",
        ack.bytes(),
        TC_ACT_REDIRECT,
        Expect::Rst {
            seq: 777,
            ack: 0,
            flags: RST,
        },
        &[(Counter::StaleBackendReset, 1)],
    ));
    assert!(dp.ct(&original_key(&syn)).is_none(), "entry deleted");
}

/// A client's affinity record naming a backend that turned not ready is not honoured: its
/// match entry left with its slot, so the client's next new flow is scheduled (and recorded)
/// among the serving backends, while its established flow to the old one goes on.
#[test]
fn affinity_record_of_a_not_serving_backend_is_not_honoured() {
    let mut dp = Datapath::load();
    let key = clusterip_key(80, proto::TCP);
    dp.set_affinity_frontend(key, TCP_REVNAT, 0, Some(600), &[1, 2, 3, 4]);
    let first = Pkt::tcp(CLIENT, 41_000, VIP, 80, SYN);
    let chosen = dp.new_flow_backend(&first);
    assert_eq!(dp.affinity_record(CLIENT).unwrap().backend_id, chosen);
    let rest: Vec<u32> = [1, 2, 3, 4].into_iter().filter(|b| *b != chosen).collect();
    dp.set_affinity_frontend(key, TCP_REVNAT, 0, Some(600), &rest);
    dp.services()
        .remove(&key.with_slot(4))
        .expect("remove the last slot");
    dp.set_backend_flags(chosen, proto::TCP, backend_flags::NOT_SERVING);
    for sport in 41_001..41_011 {
        let syn = Pkt::tcp(CLIENT, sport, VIP, 80, SYN);
        let got = dp.new_flow_backend(&syn);
        assert_ne!(
            got, chosen,
            "a new flow of the client avoids the not-serving backend"
        );
        assert!(rest.contains(&got));
    }
    let again = dp.affinity_record(CLIENT).unwrap().backend_id;
    assert!(
        rest.contains(&again),
        "the record now names a serving backend"
    );
    let ack = Pkt::tcp(CLIENT, 41_000, VIP, 80, ACK);
    dp.check(ingress(
        "the client's established flow keeps its backend",
        ack.bytes(),
        TC_NEXT,
        Expect::Packet(dnated(&ack, chosen)),
        &[(Counter::EstablishedFlow, 1)],
    ));
}

#[test]
fn stale_backend_udp_is_reselected_tcp_is_reset() {
    let mut dp = Datapath::load().with_services();

    // UDP: the backend goes away; the next datagram goes to a live one and both entries move.
    let q = Pkt::udp(CLIENT, 34_000, VIP, 53);
    let dead = expected_pick(&q, &[11, 12]);
    let live = if dead == 11 { 12 } else { 11 };
    dp.check(ingress(
        "UDP flow created",
        q.bytes(),
        TC_NEXT,
        Expect::Packet(dnated(&q, dead)),
        &[(Counter::NewFlow, 1)],
    ));
    dp.set_service(VIP, 53, proto::UDP, UDP_REVNAT, &[live]);
    dp.services()
        .remove(&ServiceKey::new(
            VIP.octets(),
            53u16.to_be_bytes(),
            proto::UDP,
            2,
        ))
        .expect("remove slot 2");
    dp.remove_backend(dead);
    dp.check(ingress(
        "UDP to a removed backend is reselected",
        q.bytes(),
        TC_NEXT,
        Expect::Packet(dnated(&q, live)),
        &[(Counter::StaleBackendReselected, 1)],
    ));
    assert_flow(
        &mut dp,
        "after reselection",
        &q,
        live,
        UDP_REVNAT,
        ct_state::UDP,
    );
    assert!(
        dp.ct(&reply_key(&q, dead)).is_none(),
        "the dead backend's REPLY entry is removed"
    );

    // TCP: established flow, backend removed, next segment → RST to the client, entries deleted.
    let syn = Pkt::tcp(CLIENT, 34_001, VIP, 80, SYN);
    let dead = expected_pick(&syn, &[1, 2]);
    let live = if dead == 1 { 2 } else { 1 };
    dp.check(ingress(
        "TCP flow created",
        syn.bytes(),
        TC_NEXT,
        Expect::Packet(dnated(&syn, dead)),
        &[(Counter::NewFlow, 1)],
    ));
    let ack = Pkt::tcp(CLIENT, 34_001, VIP, 80, ACK).seq_ack(1001, 777);
    dp.check(ingress(
        "TCP established",
        ack.bytes(),
        TC_NEXT,
        Expect::Packet(dnated(&ack, dead)),
        &[(Counter::EstablishedFlow, 1)],
    ));
    dp.set_service(VIP, 80, proto::TCP, TCP_REVNAT, &[live]);
    dp.services()
        .remove(&ServiceKey::new(
            VIP.octets(),
            80u16.to_be_bytes(),
            proto::TCP,
            2,
        ))
        .expect("remove slot 2");
    dp.remove_backend(dead);
    let data = Pkt::tcp(CLIENT, 34_001, VIP, 80, PSH | ACK)
        .seq_ack(1001, 777)
        .payload(&[7; 300]);
    dp.check(ingress(
        "TCP segment to a removed backend is answered with RST",
        data.bytes(),
        TC_ACT_REDIRECT,
        Expect::Rst {
            seq: 777,
            ack: 0,
            flags: RST,
        },
        &[(Counter::StaleBackendReset, 1)],
    ));
    assert!(
        dp.ct(&original_key(&syn)).is_none(),
        "ORIGINAL entry deleted after RST"
    );
    assert!(
        dp.ct(&reply_key(&syn, dead)).is_none(),
        "REPLY entry deleted after RST"
    );

    // A segment without ACK (odd, but possible) gets RST|ACK acknowledging it.
    dp.check(ingress(
        "TCP flow recreated",
        syn.bytes(),
        TC_NEXT,
        Expect::Packet(dnated(&syn, live)),
        &[(Counter::NewFlow, 1)],
    ));
    dp.set_backend(3, proto::TCP);
    dp.set_service(VIP, 80, proto::TCP, TCP_REVNAT, &[3]);
    dp.remove_backend(live);
    let noack = Pkt::tcp(CLIENT, 34_001, VIP, 80, PSH)
        .seq_ack(5000, 0)
        .payload(&[1; 10])
        .options(&[1, 1, 1, 1]);
    dp.check(ingress(
        "segment without ACK and with IP options → RST|ACK, options dropped",
        noack.bytes(),
        TC_ACT_REDIRECT,
        Expect::Rst {
            seq: 0,
            ack: 5010,
            flags: RST | ACK,
        },
        &[(Counter::StaleBackendReset, 1), (Counter::IpOptions, 1)],
    ));

    // A SYN on a stale entry is simply a new flow.
    let syn2 = Pkt::tcp(CLIENT, 34_002, VIP, 80, SYN);
    dp.check(ingress(
        "SYN flow to backend 3",
        syn2.bytes(),
        TC_NEXT,
        Expect::Packet(dnated(&syn2, 3)),
        &[(Counter::NewFlow, 1)],
    ));
    dp.set_backend(4, proto::TCP);
    dp.set_service(VIP, 80, proto::TCP, TCP_REVNAT, &[4]);
    dp.remove_backend(3);
    dp.check(ingress(
        "SYN retransmit after its backend went away is picked anew",
        syn2.bytes(),
        TC_NEXT,
        Expect::Packet(dnated(&syn2, 4)),
        &[(Counter::NewFlow, 1)],
    ));
    assert_flow(
        &mut dp,
        "SYN re-pick",
        &syn2,
        4,
        TCP_REVNAT,
        ct_state::SYN_SENT,
    );

    // A client RST on a flow whose backend is gone is not answered with a RST: dropped, forgotten.
    dp.remove_backend(4);
    let rst = Pkt::tcp(CLIENT, 34_002, VIP, 80, RST | ACK);
    dp.check(ingress(
        "client RST to a removed backend is dropped, not answered",
        rst.bytes(),
        TC_ACT_SHOT,
        Expect::Dropped,
        &[(Counter::DropNoBackend, 1)],
    ));
    assert!(
        dp.ct(&original_key(&syn2)).is_none(),
        "ORIGINAL entry deleted after the RST"
    );
    assert!(
        dp.ct(&reply_key(&syn2, 4)).is_none(),
        "REPLY entry deleted after the RST"
    );

    // Backend id reused for another address: also stale (the entry keeps an address snapshot).
    let q2 = Pkt::udp(CLIENT, 34_003, VIP, 53);
    let only = if dp.backends().get(&11, 0).is_ok() {
        11
    } else {
        12
    };
    dp.check(ingress(
        "UDP flow on the remaining backend",
        q2.bytes(),
        TC_NEXT,
        Expect::Packet(dnated(&q2, only)),
        &[(Counter::NewFlow, 1)],
    ));
    let moved = Backend {
        addr: [10, 244, 9, 99],
        port: 5353u16.to_be_bytes(),
        proto: proto::UDP,
        flags: 0,
    };
    dp.backends()
        .insert(only, moved, 0)
        .expect("rewrite backend");
    let mut want = q2.clone();
    want.daddr = Ipv4Addr::new(10, 244, 9, 99);
    set_ports(&mut want, 34_003, 5353);
    dp.check(ingress(
        "backend id now names another address → reselected",
        q2.bytes(),
        TC_NEXT,
        Expect::Packet(want),
        &[(Counter::StaleBackendReselected, 1)],
    ));
}

/// A flow straight to a pod is tracked from the client's side only (its replies pass
/// untracked): the client's ACK after its SYN establishes it, and its FIN closes it (the
/// transitory timeout, as netfilter's entry once both FINs passed) instead of leaving it
/// half-closed on the close-wait timeout (an hour) after every connection.
#[test]
fn a_direct_tcp_flow_is_established_by_the_client_s_ack_and_closed_by_its_fin() {
    let mut dp = Datapath::load().with_services();
    let pod = Ipv4Addr::new(10, 244, 9, 9);
    let c = |flags| Pkt::tcp(CLIENT, 38_000, pod, 8080, flags);
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

/// A flow that began before its destination was a Service frontend (a client sending to a
/// ClusterIP before the Service existed) is tracked as a direct flow. Once the frontend is there
/// and the agent has moved the frontend generation on (`FRONTGEN_V1`), the flow's next UDP
/// datagram or TCP SYN starts a translated flow; an established TCP connection keeps going
/// straight. Without the new generation, the direct entry stands (the agent moves it on after
/// writing the frontend).
#[test]
fn direct_flows_start_over_when_their_destination_becomes_a_frontend() {
    const LATER: Ipv4Addr = Ipv4Addr::new(10, 96, 0, 77);
    let mut dp = Datapath::load();
    let q = Pkt::udp(CLIENT, 36_000, LATER, 53);
    let syn = Pkt::tcp(CLIENT, 36_001, LATER, 80, SYN);
    let established = Pkt::tcp(CLIENT, 36_002, LATER, 80, SYN);
    let ack = Pkt::tcp(CLIENT, 36_002, LATER, 80, ACK);
    for (what, p) in [
        ("UDP to no Service yet", &q),
        ("TCP SYN to no Service yet", &syn),
        ("TCP SYN of a connection to no Service yet", &established),
    ] {
        // Tracked as a direct flow, counted as a packet to no Service.
        dp.check(ingress(
            what,
            p.bytes(),
            TC_NEXT,
            Expect::Unchanged,
            &[(Counter::NotService, 1)],
        ));
    }
    dp.check(ingress(
        "UDP again: the direct flow",
        q.bytes(),
        TC_NEXT,
        Expect::Unchanged,
        &[(Counter::DirectFlow, 1)],
    ));
    dp.set_service(LATER, 53, proto::UDP, 9, &[11, 12]);
    dp.set_service(LATER, 80, proto::TCP, 8, &[1, 2]);
    dp.check(ingress(
        "frontend written, generation not moved on yet: still direct",
        q.bytes(),
        TC_NEXT,
        Expect::Unchanged,
        &[(Counter::DirectFlow, 1), (Counter::DirectBecameFrontend, 0)],
    ));
    let mut generation: Array<&mut MapData, u32> = Array::try_from(
        dp.bpf
            .map_mut(proxy_common::MAP_FRONTEND_GEN)
            .expect("FRONTGEN_V1"),
    )
    .expect("array");
    generation.set(0, 1, 0).expect("moving the generation on");
    let id = expected_pick(&q, &[11, 12]);
    dp.check(ingress(
        "UDP after the new generation: translated",
        q.bytes(),
        TC_NEXT,
        Expect::Packet(dnated(&q, id)),
        &[(Counter::DirectBecameFrontend, 1), (Counter::NewFlow, 1)],
    ));
    dp.check(ingress(
        "and stays so",
        q.bytes(),
        TC_NEXT,
        Expect::Packet(dnated(&q, id)),
        &[(Counter::EstablishedFlow, 1)],
    ));
    dp.check(ingress(
        "an established connection's segment keeps going straight",
        ack.bytes(),
        TC_NEXT,
        Expect::Unchanged,
        &[(Counter::DirectFlow, 1), (Counter::DirectBecameFrontend, 0)],
    ));
    let sid = expected_pick(&syn, &[1, 2]);
    dp.check(ingress(
        "a retransmitted SYN: translated",
        syn.bytes(),
        TC_NEXT,
        Expect::Packet(dnated(&syn, sid)),
        &[(Counter::DirectBecameFrontend, 1), (Counter::NewFlow, 1)],
    ));
}

#[test]
fn idle_expired_entries_are_replaced() {
    let cfg = DatapathConfig {
        udp_timeout_s: 1,
        tcp_transitory_timeout_s: 1,
        ..DatapathConfig::DEFAULT
    };
    let mut dp = Datapath::load_with(cfg).with_services();
    let q = Pkt::udp(CLIENT, 35_000, VIP, 53);
    let first = expected_pick(&q, &[11, 12]);
    dp.check(ingress(
        "UDP flow created",
        q.bytes(),
        TC_NEXT,
        Expect::Packet(dnated(&q, first)),
        &[(Counter::NewFlow, 1)],
    ));
    let created = assert_flow(&mut dp, "created", &q, first, UDP_REVNAT, ct_state::UDP);
    dp.check(ingress(
        "fresh entry is used",
        q.bytes(),
        TC_NEXT,
        Expect::Packet(dnated(&q, first)),
        &[(Counter::EstablishedFlow, 1)],
    ));

    // Age the entry by 5 s and move the Service to the other backend: an expired flow is new.
    let other = if first == 11 { 12 } else { 11 };
    let mut aged = created;
    aged.last_seen_ns = aged.last_seen_ns.saturating_sub(5_000_000_000);
    dp.conntrack()
        .insert(original_key(&q), aged, 0)
        .expect("age entry");
    dp.set_service(VIP, 53, proto::UDP, UDP_REVNAT, &[other]);
    dp.services()
        .remove(&ServiceKey::new(
            VIP.octets(),
            53u16.to_be_bytes(),
            proto::UDP,
            2,
        ))
        .expect("remove slot 2");
    dp.check(ingress(
        "expired entry is replaced by a new pick",
        q.bytes(),
        TC_NEXT,
        Expect::Packet(dnated(&q, other)),
        &[(Counter::ConntrackExpired, 1), (Counter::NewFlow, 1)],
    ));
    let renewed = assert_flow(&mut dp, "renewed", &q, other, UDP_REVNAT, ct_state::UDP);
    assert!(
        renewed.created_ns > created.created_ns,
        "the replacement is a new entry (created_ns moved)"
    );
    assert!(
        dp.ct(&reply_key(&q, first)).is_none(),
        "the expired flow's REPLY entry is removed"
    );

    // Real time: TCP SYN_SENT with a 1 s transitory timeout, 1.2 s of silence.
    let syn = Pkt::tcp(CLIENT, 35_001, VIP, 80, SYN);
    let id = expected_pick(&syn, &[1, 2]);
    dp.check(ingress(
        "SYN",
        syn.bytes(),
        TC_NEXT,
        Expect::Packet(dnated(&syn, id)),
        &[(Counter::NewFlow, 1)],
    ));
    std::thread::sleep(Duration::from_millis(1200));
    dp.check(ingress(
        "SYN retransmit after the timeout",
        syn.bytes(),
        TC_NEXT,
        Expect::Packet(dnated(&syn, id)),
        &[(Counter::ConntrackExpired, 1), (Counter::NewFlow, 1)],
    ));
}

/// netfilter's UDP timeouts: a flow the backend never answered (one-shot datagrams) expires
/// after `udp_timeout_s`, and so does a request with its answer (a DNS lookup); a flow still
/// active more than 2 s after it began with the backend answering (`SEEN_REPLY` on both
/// entries) is a stream and holds until `udp_stream_timeout_s`. Entries are aged by rewriting
/// their timestamps (no sleeping).
#[test]
fn udp_flows_expire_after_udp_timeout_until_they_are_streams() {
    const S: u64 = 1_000_000_000;
    let cfg = DatapathConfig {
        udp_timeout_s: 1,
        udp_stream_timeout_s: 3,
        ..DatapathConfig::DEFAULT
    };
    let mut dp = Datapath::load_with(cfg).with_services();
    let one_shot = Pkt::udp(CLIENT, 36_000, VIP, 53).payload(b"query");
    let stream = Pkt::udp(CLIENT, 36_001, VIP, 53).payload(b"query");
    let lookup = Pkt::udp(CLIENT, 36_002, VIP, 53).payload(b"query");
    let (id1, id2, id3) = (
        expected_pick(&one_shot, &[11, 12]),
        expected_pick(&stream, &[11, 12]),
        expected_pick(&lookup, &[11, 12]),
    );
    for (q, id) in [(&one_shot, id1), (&stream, id2), (&lookup, id3)] {
        dp.check(ingress(
            "new UDP flow",
            q.bytes(),
            TC_NEXT,
            Expect::Packet(dnated(q, id)),
            &[(Counter::NewFlow, 1)],
        ));
    }
    for (q, id) in [(&stream, id2), (&lookup, id3)] {
        let r = reply_from(q, id).payload(b"answer");
        dp.check(egress(
            "the backend answers",
            r.bytes(),
            TC_NEXT,
            Expect::Packet(rev_natted(&r, q)),
            &[(Counter::ReplyTranslated, 1)],
        ));
    }
    let flags = |dp: &mut Datapath, key: CtKey| dp.ct(&key).expect("entry").flags;
    assert_eq!(
        flags(&mut dp, original_key(&one_shot)) & ct_flags::SEEN_REPLY,
        0,
        "unanswered flow: no SEEN_REPLY"
    );
    assert_eq!(
        flags(&mut dp, reply_key(&one_shot, id1)) & ct_flags::SEEN_REPLY,
        0
    );
    assert_ne!(
        flags(&mut dp, original_key(&stream)) & ct_flags::SEEN_REPLY,
        0,
        "answered flow: SEEN_REPLY on ORIGINAL"
    );
    assert_ne!(
        flags(&mut dp, reply_key(&stream, id2)) & ct_flags::SEEN_REPLY,
        0,
        "and on REPLY"
    );

    // Each flow idle for `idle`, having begun `began` before its last packet.
    let age = |dp: &mut Datapath, q: &Pkt, idle: u64, began: u64| {
        let key = original_key(q);
        let mut v = dp.ct(&key).expect("ORIGINAL entry");
        v.last_seen_ns = v.last_seen_ns.saturating_sub(idle);
        v.created_ns = v.last_seen_ns.saturating_sub(began);
        dp.conntrack().insert(key, v, 0).expect("age entry");
    };
    // Idle for 2 s: past the one-shot timeout (1 s), within the stream one (3 s). The lookup
    // was answered at once; the stream was still going 5 s after it began.
    age(&mut dp, &one_shot, 2 * S, 0);
    age(&mut dp, &lookup, 2 * S, 0);
    age(&mut dp, &stream, 2 * S, 5 * S);
    dp.check(ingress(
        "one-shot flow after 2 s: expired, a new flow",
        one_shot.bytes(),
        TC_NEXT,
        Expect::Packet(dnated(&one_shot, id1)),
        &[(Counter::ConntrackExpired, 1), (Counter::NewFlow, 1)],
    ));
    dp.check(ingress(
        "an answered lookup after 2 s: no stream, expired",
        lookup.bytes(),
        TC_NEXT,
        Expect::Packet(dnated(&lookup, id3)),
        &[(Counter::ConntrackExpired, 1), (Counter::NewFlow, 1)],
    ));
    dp.check(ingress(
        "a stream after 2 s: still established",
        stream.bytes(),
        TC_NEXT,
        Expect::Packet(dnated(&stream, id2)),
        &[(Counter::EstablishedFlow, 1)],
    ));
    // Idle for 4 s: past the stream timeout too.
    age(&mut dp, &stream, 4 * S, 5 * S);
    dp.check(ingress(
        "a stream after 4 s: expired",
        stream.bytes(),
        TC_NEXT,
        Expect::Packet(dnated(&stream, id2)),
        &[(Counter::ConntrackExpired, 1), (Counter::NewFlow, 1)],
    ));
    assert_eq!(
        flags(&mut dp, original_key(&stream)) & ct_flags::SEEN_REPLY,
        0,
        "the replacing flow starts unanswered"
    );
}

/// kube-proxy's tcpCloseWaitTimeout: a flow half-closed by one side holds the close-wait
/// timeout (the other side may still send), a flow closed by both sides only the transitory one.
#[test]
fn half_closed_tcp_flows_hold_the_close_wait_timeout_closed_ones_do_not() {
    const S: u64 = 1_000_000_000;
    let cfg = DatapathConfig {
        tcp_transitory_timeout_s: 1,
        tcp_close_wait_timeout_s: 3,
        ..DatapathConfig::DEFAULT
    };
    let mut dp = Datapath::load_with(cfg).with_services();
    let half = Pkt::tcp(CLIENT, 37_000, VIP, 80, ACK);
    let closed = Pkt::tcp(CLIENT, 37_001, VIP, 80, ACK);
    for q in [&half, &closed] {
        let id = expected_pick(q, &[1, 2]);
        let mut fin = q.clone();
        if let common_packet::L4::Tcp { flags, .. } = &mut fin.l4 {
            *flags = FIN | ACK;
        }
        dp.check(ingress(
            "a mid-flow segment, then the client's FIN",
            q.bytes(),
            TC_NEXT,
            Expect::Packet(dnated(q, id)),
            &[(Counter::NewFlow, 1)],
        ));
        dp.check(ingress(
            "client FIN",
            fin.bytes(),
            TC_NEXT,
            Expect::Packet(dnated(&fin, id)),
            &[(Counter::EstablishedFlow, 1)],
        ));
        assert_eq!(
            dp.ct(&original_key(q)).expect("entry").state,
            ct_state::FIN_ORIGINAL
        );
    }
    let id = expected_pick(&closed, &[1, 2]);
    let mut bfin = reply_from(&closed, id);
    if let common_packet::L4::Tcp { flags, .. } = &mut bfin.l4 {
        *flags = FIN | ACK;
    }
    dp.check(egress(
        "the backend's FIN closes the second flow",
        bfin.bytes(),
        TC_NEXT,
        Expect::Packet(rev_natted(&bfin, &closed)),
        &[(Counter::ReplyTranslated, 1)],
    ));
    assert_eq!(
        dp.ct(&original_key(&closed)).expect("entry").state,
        ct_state::CLOSING
    );
    // The backend closes first and the client answers with a RST: no backend packet follows to
    // carry the state over, so the client's RST closes the REPLY entry too.
    let reset = Pkt::tcp(CLIENT, 37_002, VIP, 80, ACK);
    let rid = expected_pick(&reset, &[1, 2]);
    dp.check(ingress(
        "third flow",
        reset.bytes(),
        TC_NEXT,
        Expect::Packet(dnated(&reset, rid)),
        &[(Counter::NewFlow, 1)],
    ));
    let mut rfin = reply_from(&reset, rid);
    if let common_packet::L4::Tcp { flags, .. } = &mut rfin.l4 {
        *flags = FIN | ACK;
    }
    dp.check(egress(
        "the backend's FIN",
        rfin.bytes(),
        TC_NEXT,
        Expect::Packet(rev_natted(&rfin, &reset)),
        &[(Counter::ReplyTranslated, 1)],
    ));
    assert_eq!(
        dp.ct(&reply_key(&reset, rid)).expect("REPLY").state,
        ct_state::FIN_REPLY
    );
    let rst = Pkt::tcp(CLIENT, 37_002, VIP, 80, RST);
    dp.check(ingress(
        "the client's RST",
        rst.bytes(),
        TC_NEXT,
        Expect::Packet(dnated(&rst, rid)),
        &[(Counter::EstablishedFlow, 1)],
    ));
    for key in [original_key(&reset), reply_key(&reset, rid)] {
        assert_eq!(
            dp.ct(&key).expect("entry").state,
            ct_state::CLOSING,
            "{key:?} closed by the client's RST"
        );
    }

    for q in [&half, &closed] {
        let key = original_key(q);
        let mut v = dp.ct(&key).expect("ORIGINAL entry");
        v.last_seen_ns = v.last_seen_ns.saturating_sub(2 * S);
        dp.conntrack().insert(key, v, 0).expect("age entry");
    }
    let hid = expected_pick(&half, &[1, 2]);
    dp.check(ingress(
        "half-closed for 2 s (close-wait 3 s): the client's ACK still reaches its backend",
        half.bytes(),
        TC_NEXT,
        Expect::Packet(dnated(&half, hid)),
        &[(Counter::EstablishedFlow, 1)],
    ));
    dp.check(ingress(
        "closed for 2 s (transitory 1 s): expired",
        closed.bytes(),
        TC_NEXT,
        Expect::Packet(dnated(&closed, id)),
        &[(Counter::ConntrackExpired, 1), (Counter::NewFlow, 1)],
    ));
}

/// Raw frames for the malformed cases.
fn raw_ipv4(header: &[u8], rest: &[u8]) -> Vec<u8> {
    let mut f = eth(HOST_MAC, CLIENT_MAC, common_packet::ETH_P_IP);
    f.extend_from_slice(header);
    f.extend_from_slice(rest);
    f
}

#[test]
fn odd_and_malformed_packets_table() {
    let mut dp = Datapath::load().with_services();
    let syn_vip = Pkt::tcp(CLIENT, 36_000, VIP, 80, SYN).bytes();
    let syn_other = Pkt::tcp(CLIENT, 36_000, OTHER, 80, SYN).bytes();
    let set_tot_len = |f: &[u8], len: u16| {
        let mut f = f.to_vec();
        f[16..18].copy_from_slice(&len.to_be_bytes());
        f
    };
    let ip_hdr = |f: &[u8]| f[14..34].to_vec();
    let mut ihl4 = syn_vip.clone();
    ihl4[14] = 0x44;
    let mut v6_in_v4 = syn_vip.clone();
    v6_in_v4[14] = 0x65;
    // An IPv4 header whose total length says "20 + 10" with only 10 bytes of TCP header.
    let truncated_tcp = |dst: &[u8]| {
        let mut h = ip_hdr(dst);
        h[2..4].copy_from_slice(&30u16.to_be_bytes());
        raw_ipv4(&h, &dst[34..44])
    };
    let mut bad_doff = syn_vip.clone();
    bad_doff[14 + 20 + 12] = 0x40;
    let only_two_l4_bytes = {
        let mut h = ip_hdr(&syn_vip);
        h[2..4].copy_from_slice(&22u16.to_be_bytes());
        raw_ipv4(&h, &[0x8c, 0xa0])
    };
    let first_frag_other = Pkt::udp(CLIENT, 36_001, OTHER, 53)
        .frag(0x2000)
        .payload(&[1; 64])
        .bytes();
    let later_frag_vip = Pkt::udp(CLIENT, 36_001, VIP, 53)
        .frag(185)
        .payload(&[1; 64])
        .bytes();
    let mut icmp_echo = ip_hdr(&syn_vip);
    icmp_echo[9] = proto::ICMP;
    let icmp_echo = raw_ipv4(&icmp_echo, &[8, 0, 0xf7, 0xff, 0, 0, 0, 0]);

    // Rows: passed untouched (TC_NEXT) or dropped (TC_ACT_SHOT), each with its one counter.
    let pass = |what, input, counter| (what, input, TC_NEXT, Expect::Unchanged, counter);
    let shot = |what, input, counter| (what, input, TC_ACT_SHOT, Expect::Dropped, counter);
    let short_ip = raw_ipv4(&syn_vip[14..24], &[]);
    let tot_beyond_vip = set_tot_len(&syn_vip, 1500);
    let tot_beyond_other = set_tot_len(&syn_other, 1500);
    let tot_short = set_tot_len(&syn_vip, 12);
    let port_443 = Pkt::tcp(CLIENT, 36_002, VIP, 443, SYN).bytes();
    let udp_to_tcp_port = Pkt::udp(CLIENT, 36_003, VIP, 80).bytes();
    use Counter::*;
    // (BPF_PROG_TEST_RUN refuses a frame with a partial IPv4 header: those rows are skipped.)
    let table = [
        pass("ARP", arp_frame(), NotIpv4),
        // IPv6 goes to the IPv6 programs (tests/datapath6.rs): a UDP checksum of 0 is not
        // translatable there, and the address is no Service's.
        pass("IPv6", ipv6_frame(), NotService),
        pass(
            "Ethernet header and one byte",
            raw_ipv4(&[0x45], &[]),
            MalformedPassed,
        ),
        pass("short IPv4 header (10 bytes)", short_ip, MalformedPassed),
        pass("IHL 4 (< 5)", ihl4, MalformedPassed),
        pass("version 6 in an IPv4 frame", v6_in_v4, MalformedPassed),
        shot(
            "total length beyond the packet, to a Service",
            tot_beyond_vip,
            DropMalformed,
        ),
        pass(
            "total length beyond the packet, elsewhere",
            tot_beyond_other,
            NotService,
        ),
        shot(
            "total length shorter than the header",
            tot_short,
            DropMalformed,
        ),
        shot(
            "truncated TCP header to a Service",
            truncated_tcp(&syn_vip),
            DropMalformed,
        ),
        pass(
            "truncated TCP header elsewhere",
            truncated_tcp(&syn_other),
            NotService,
        ),
        shot("TCP data offset < 5 to a Service", bad_doff, DropMalformed),
        pass(
            "2 bytes of L4 (no ports)",
            only_two_l4_bytes,
            MalformedPassed,
        ),
        pass("first fragment elsewhere", first_frag_other, NotService),
        pass(
            "later fragment to a VIP, its first fragment never seen",
            later_frag_vip,
            FragmentUnmatched,
        ),
        pass("ICMP echo to a VIP", icmp_echo, NotService),
        pass("TCP to a non-VIP address", syn_other.clone(), NotService),
        pass(
            "TCP to the VIP on a port without a Service",
            port_443,
            NotService,
        ),
        pass(
            "UDP to a TCP-only port of the VIP",
            udp_to_tcp_port,
            NotService,
        ),
    ];
    for (what, input, verdict, expect, counter) in table {
        dp.check(ingress(what, input, verdict, expect, &[(counter, 1)]));
    }
    // Connections straight to non-Service addresses are tracked as DIRECT markers (so that no
    // translated flow takes their reply tuple): one ORIGINAL entry each, without translation.
    let entries: Vec<(CtKey, CtValue)> = dp
        .conntrack()
        .iter()
        .map(|e| e.expect("conntrack entry"))
        .collect();
    assert!(
        entries.iter().all(|(k, v)| v.flags == ct_flags::DIRECT
            && k.dir == ct_dir::ORIGINAL
            && v.backend_addr == k.daddr
            && v.backend_port == k.dport),
        "the odd packets created only untranslated direct-flow markers: {entries:?}"
    );
    assert_eq!(
        entries.len(),
        4,
        "markers for the TCP SYN to another address, the SYN to a VIP port without a Service, the \
         UDP datagram to a TCP-only port and the first fragment to another address: {entries:?}"
    );

    // IP options: parsed past, preserved, still DNATed.
    let with_opts = Pkt::tcp(CLIENT, 36_010, VIP, 80, SYN).options(&[0x94, 0x04, 0, 0, 1, 1, 1, 0]);
    let id = expected_pick(&with_opts, &[1, 2]);
    dp.check(ingress(
        "SYN with IP options is DNATed, options preserved",
        with_opts.bytes(),
        TC_NEXT,
        Expect::Packet(dnated(&with_opts, id)),
        &[(Counter::NewFlow, 1), (Counter::IpOptions, 1)],
    ));
    let max_opts = Pkt::udp(CLIENT, 36_011, VIP, 53).options(&[1; 40]);
    let id = expected_pick(&max_opts, &[11, 12]);
    dp.check(ingress(
        "UDP with 40 bytes of IP options (IHL 15)",
        max_opts.bytes(),
        TC_NEXT,
        Expect::Packet(dnated(&max_opts, id)),
        &[(Counter::NewFlow, 1), (Counter::IpOptions, 1)],
    ));

    // Egress sees the same odd packets and passes all of them untouched.
    let egress_table: Vec<(&str, Vec<u8>, Counter)> = vec![
        ("ARP on egress", arp_frame(), Counter::NotIpv4),
        ("IPv6 on egress", ipv6_frame(), Counter::MalformedPassed),
        (
            "short IPv4 header on egress",
            raw_ipv4(&syn_vip[14..24], &[]),
            Counter::MalformedPassed,
        ),
        (
            "truncated TCP on egress",
            truncated_tcp(&syn_vip),
            Counter::MalformedPassed,
        ),
        (
            "first fragment on egress, not a reply",
            Pkt::udp(VIP, 53, CLIENT, 36_001).frag(0x2000).bytes(),
            Counter::ReplyNotTracked,
        ),
        (
            "later fragment on egress of that passed datagram",
            Pkt::udp(VIP, 53, CLIENT, 36_001).frag(185).bytes(),
            Counter::FragmentPassed,
        ),
        (
            "ICMP on egress",
            raw_ipv4(
                &ip_hdr(&syn_vip)
                    .iter()
                    .enumerate()
                    .map(|(i, b)| if i == 9 { 1 } else { *b })
                    .collect::<Vec<_>>(),
                &[0; 8],
            ),
            Counter::ReplyNotTracked,
        ),
    ];
    for (what, input, counter) in egress_table {
        dp.check(egress(
            what,
            input,
            TC_NEXT,
            Expect::Unchanged,
            &[(counter, 1)],
        ));
    }
}

fn frag_key(pkt: &Pkt, hook: u8) -> FragKey {
    FragKey {
        saddr: pkt.saddr.octets(),
        daddr: pkt.daddr.octets(),
        id: pkt.ip_id.to_be_bytes(),
        proto: pkt.proto(),
        hook,
    }
}

/// A UDP datagram of 4,000 payload bytes (DF clear): three fragments at MTU 1500.
fn big(p: Pkt, ip_id: u16) -> Pkt {
    let payload: Vec<u8> = (0..4000u32).map(|i| (i * 7) as u8).collect();
    p.frag(0).ip_id(ip_id).payload(&payload)
}

/// IPv4 payload bytes per fragment at MTU 1500 (20-byte header).
const FRAG_CHUNK: usize = 1480;

/// Runs the fragments of `input` (as the sender's stack cut it at MTU 1500) through `prog`: the
/// first one must count `first`, every later one `later`, each output must be the same fragment
/// of `want`, and the outputs must reassemble into `want` with a valid UDP checksum.
fn check_datagram(
    dp: &mut Datapath,
    prog: &'static str,
    what: &str,
    input: &Pkt,
    want: &Pkt,
    first: &[(Counter, u64)],
    later: Counter,
) {
    // On an L3 device the fragments carry no Ethernet header (put back to reassemble).
    let l2 = if is_l3(prog) { ETH_HLEN } else { 0 };
    let frags: Vec<_> = fragments(&input.bytes(), FRAG_CHUNK)
        .into_iter()
        .map(|f| f[l2..].to_vec())
        .collect();
    let wanted: Vec<_> = fragments(&want.bytes(), FRAG_CHUNK)
        .into_iter()
        .map(|f| f[l2..].to_vec())
        .collect();
    assert_eq!(
        frags.len(),
        3,
        "{what}: a 4,000-byte datagram is 3 fragments"
    );
    let mut outs = Vec::new();
    for (i, (frag, w)) in frags.into_iter().zip(wanted).enumerate() {
        let what = format!("{what}: fragment {}", i + 1);
        let later = [(later, 1)];
        outs.push(dp.check(Step {
            what: &what,
            prog,
            input: frag,
            verdict: TC_NEXT,
            expect: Expect::Fragment(w),
            counts: if i == 0 { first } else { &later },
        }));
    }
    let eth_header = &want.bytes()[..l2];
    let outs: Vec<_> = outs.iter().map(|o| [eth_header, o].concat()).collect();
    let whole = reassemble(&outs);
    assert!(
        Decoded::parse(&whole).l4_csum_ok(),
        "{what}: the reassembled datagram's UDP checksum is invalid"
    );
    assert_eq!(whole, want.bytes(), "{what}: reassembled datagram");
}

/// A fragment record names the addresses its later fragments get.
fn assert_record(dp: &mut Datapath, what: &str, pkt: &Pkt, hook: u8, action: u8, to: &Pkt) {
    let rec = dp
        .frag_record(pkt, hook)
        .unwrap_or_else(|| panic!("{what}: no fragment record"));
    assert_eq!(
        (rec.action, rec.saddr, rec.daddr),
        (action, to.saddr.octets(), to.daddr.octets()),
        "{what}: fragment record"
    );
    assert!(rec.created_ns > 0, "{what}: record time {rec:?}");
}

#[test]
fn fragmented_datagrams_to_and_from_a_clusterip_are_translated() {
    let mut dp = Datapath::load().with_services();
    use Counter::*;

    let req = big(Pkt::udp(CLIENT, 36_100, VIP, 53), 0x0101);
    let id = expected_pick(&req, &[11, 12]);
    let fwd = dnated(&req, id);
    check_datagram(
        &mut dp,
        PROG_TC_INGRESS,
        "request to the ClusterIP",
        &req,
        &fwd,
        &[(NewFlow, 1)],
        FragmentTranslated,
    );
    assert_record(
        &mut dp,
        "request",
        &req,
        frag_hook::INGRESS,
        frag_action::TRANSLATE,
        &fwd,
    );
    assert_flow(&mut dp, "request", &req, id, UDP_REVNAT, ct_state::UDP);
    // On its way to the backend it leaves through the backend's veth: not a reply, passed.
    check_datagram(
        &mut dp,
        PROG_TC_EGRESS,
        "request leaving toward the backend",
        &fwd,
        &fwd,
        &[(ReplyNotTracked, 1)],
        FragmentPassed,
    );

    // The 4,000-byte answer: into the node through the backend's veth (ingress: not a Service,
    // passed, recorded as such), out through the client's (egress: reverse NAT). Same addresses
    // at both hooks, one record each.
    let reply = big(reply_from(&req, id), 0x0202);
    check_datagram(
        &mut dp,
        PROG_TC_INGRESS,
        "reply entering from the backend",
        &reply,
        &reply,
        &[(NotService, 1)],
        FragmentPassed,
    );
    let back = rev_natted(&reply, &req);
    check_datagram(
        &mut dp,
        PROG_TC_EGRESS,
        "reply toward the client",
        &reply,
        &back,
        &[(ReplyTranslated, 1)],
        FragmentTranslated,
    );
    assert_record(
        &mut dp,
        "reply at ingress",
        &reply,
        frag_hook::INGRESS,
        frag_action::PASS,
        &reply,
    );
    assert_record(
        &mut dp,
        "reply at egress",
        &reply,
        frag_hook::EGRESS,
        frag_action::TRANSLATE,
        &back,
    );

    // A later fragment before its first one: nothing to match, passed untouched and counted; the
    // rest of the datagram is still translated.
    let ooo = big(Pkt::udp(CLIENT, 36_101, VIP, 53), 0x0303);
    let frags = fragments(&ooo.bytes(), FRAG_CHUNK);
    let id = expected_pick(&ooo, &[11, 12]);
    let want = fragments(&dnated(&ooo, id).bytes(), FRAG_CHUNK);
    dp.check(ingress(
        "second fragment before the first",
        frags[1].clone(),
        TC_NEXT,
        Expect::Unchanged,
        &[(FragmentUnmatched, 1)],
    ));
    dp.check(ingress(
        "then the first fragment",
        frags[0].clone(),
        TC_NEXT,
        Expect::Fragment(want[0].clone()),
        &[(NewFlow, 1)],
    ));
    dp.check(ingress(
        "then the third",
        frags[2].clone(),
        TC_NEXT,
        Expect::Fragment(want[2].clone()),
        &[(FragmentTranslated, 1)],
    ));
    // The same IP id between other addresses, or at the other hook, is another datagram.
    let mut other_src = frags[2].clone();
    other_src[14 + 15] ^= 1;
    let other_src = {
        let mut f = other_src;
        f[24..26].copy_from_slice(&[0, 0]);
        let c = proxy_common::csum::ipv4_header(&f[14..34]);
        f[24..26].copy_from_slice(&c.to_be_bytes());
        f
    };
    dp.check(ingress(
        "same IP id from another source",
        other_src,
        TC_NEXT,
        Expect::Unchanged,
        &[(FragmentUnmatched, 1)],
    ));
    dp.check(egress(
        "same datagram's fragment at the other hook",
        frags[2].clone(),
        TC_NEXT,
        Expect::Unchanged,
        &[(FragmentUnmatched, 1)],
    ));

    // A Service without endpoints answers the first fragment with ICMP port unreachable; the
    // later fragments are dropped rather than sent on to the VIP.
    let rej = big(Pkt::udp(CLIENT, 36_102, VIP_EMPTY, 53), 0x0404);
    let frags = fragments(&rej.bytes(), FRAG_CHUNK);
    dp.check(ingress(
        "first fragment to a Service without endpoints",
        frags[0].clone(),
        TC_ACT_REDIRECT,
        Expect::IcmpUnreachable,
        &[(NoEndpointsRejected, 1)],
    ));
    for f in &frags[1..] {
        dp.check(ingress(
            "later fragment of the rejected datagram",
            f.clone(),
            TC_ACT_SHOT,
            Expect::Dropped,
            &[(DropFragment, 1)],
        ));
    }
    assert_eq!(
        dp.frag_record(&rej, frag_hook::INGRESS).map(|r| r.action),
        Some(frag_action::DROP)
    );

    // A record is matched only within the 30 s reassembly window after its first fragment.
    let stale = big(Pkt::udp(CLIENT, 36_103, VIP, 53), 0x0505);
    let record = FragValue {
        created_ns: monotonic_ns() + 3_600_000_000_000,
        saddr: CLIENT.octets(),
        daddr: OTHER.octets(),
        action: frag_action::TRANSLATE,
        _pad: [0; 7],
    };
    dp.fragments()
        .insert(frag_key(&stale, frag_hook::INGRESS), record, 0)
        .expect("write a record outside the window");
    dp.check(ingress(
        "later fragment outside its record's window",
        fragments(&stale.bytes(), FRAG_CHUNK)[1].clone(),
        TC_NEXT,
        Expect::Unchanged,
        &[(FragmentUnmatched, 1)],
    ));
}

#[test]
fn fragmented_datagrams_through_a_snated_nodeport_are_translated() {
    let mut dp = nodeport_datapath();
    dp.set_node_addr(NODE_IP);
    use Counter::*;

    let req = big(Pkt::udp(EXT_CLIENT, 5100, NODE_IP, NODE_PORT), 0x0606);
    let fwd = with_dst(&req, REMOTE_BE, 5353);
    check_datagram(
        &mut dp,
        PROG_TC_INGRESS,
        "NodePort request",
        &req,
        &fwd,
        &[(NewFlow, 1), (SnatNew, 1), (SnatPortKept, 1)],
        FragmentTranslated,
    );
    let nat_port = u16::from_be_bytes(
        dp.snat()
            .get(&snat_out_key(&req, REMOTE_BE, 5353), 0)
            .expect("SNAT out entry")
            .port,
    );
    let snated = with_src(&fwd, NODE_IP, nat_port);
    check_datagram(
        &mut dp,
        PROG_TC_EGRESS,
        "NodePort request forwarded to the remote backend",
        &fwd,
        &snated,
        &[(SnatTranslated, 1)],
        FragmentTranslated,
    );
    let reply = big(Pkt::udp(REMOTE_BE, 5353, NODE_IP, nat_port), 0x0707);
    let unsnated = with_dst(&reply, EXT_CLIENT, 5100);
    check_datagram(
        &mut dp,
        PROG_TC_INGRESS,
        "reply arriving from the remote backend (un-SNAT)",
        &reply,
        &unsnated,
        &[(SnatReplyTranslated, 1)],
        FragmentTranslated,
    );
    check_datagram(
        &mut dp,
        PROG_TC_EGRESS,
        "reply toward the client (from the NodePort)",
        &unsnated,
        &with_src(&unsnated, NODE_IP, NODE_PORT),
        &[(ReplyTranslated, 1)],
        FragmentTranslated,
    );
    assert_eq!(
        dp.fragments().keys().count(),
        4,
        "one record per datagram and hook"
    );

    // A TCP datagram cut in fragments, to an eTP=Local NodePort without local endpoints: its
    // first fragment is dropped (not answered), and so are the later ones.
    let tcp = Pkt::tcp(EXT_CLIENT, 5200, NODE_IP, NODE_PORT + 2, ACK)
        .frag(0)
        .ip_id(0x0808)
        .payload(&[7; 3000]);
    let frags = fragments(&tcp.bytes(), FRAG_CHUNK);
    dp.check(ingress(
        "TCP first fragment, eTP=Local without local endpoints",
        frags[0].clone(),
        TC_ACT_SHOT,
        Expect::Dropped,
        &[(DropNoLocalEndpoints, 1)],
    ));
    for f in &frags[1..] {
        dp.check(ingress(
            "later TCP fragment of the dropped datagram",
            f.clone(),
            TC_ACT_SHOT,
            Expect::Dropped,
            &[(DropFragment, 1)],
        ));
    }
}

/// Prints what a later fragment costs (record lookup + two address rewrites). Never asserts on
/// timing.
#[test]
fn per_fragment_cost() {
    let mut dp = Datapath::load().with_services();
    // BPF_PROG_TEST_RUN repeats on its own output: two records that translate into each other
    // (CLIENT → A becomes CLIENT → B and back) make every repetition a real translation.
    let a = Ipv4Addr::new(10, 96, 1, 1);
    let b = Ipv4Addr::new(10, 96, 1, 2);
    let dgram = |dst| big(Pkt::udp(CLIENT, 50_000, dst, 53), 0x0909);
    for (from, to) in [(a, b), (b, a)] {
        let rec = FragValue {
            created_ns: monotonic_ns(),
            saddr: CLIENT.octets(),
            daddr: to.octets(),
            action: frag_action::TRANSLATE,
            _pad: [0; 7],
        };
        dp.fragments()
            .insert(frag_key(&dgram(from), frag_hook::INGRESS), rec, 0)
            .expect("write a fragment record");
    }
    let later = fragments(&dgram(a).bytes(), FRAG_CHUNK)[1].clone();
    let before = dp.counter(Counter::FragmentTranslated);
    let (verdict, out, cost) = dp.run_timed(PROG_TC_INGRESS, &later, 100_000);
    assert_eq!(verdict, TC_NEXT);
    assert_eq!(
        dp.counter(Counter::FragmentTranslated) - before,
        100_000,
        "every repetition was translated"
    );
    assert!(
        Decoded::parse(&out).ip_csum_ok(),
        "100,000 rewrites keep the IPv4 checksum valid"
    );
    println!("per-fragment cost: later_fragment_ns={}", cost.as_nanos());
}

#[test]
fn counters_sum_over_cpus_and_name_every_outcome() {
    let mut dp = Datapath::load().with_services();
    let before = dp.counters();
    assert!(
        before.values().all(|n| *n == 0),
        "a fresh object starts at zero: {before:?}"
    );
    for port in 0..10u16 {
        let (verdict, _) = dp.run(
            PROG_TC_INGRESS,
            &Pkt::tcp(CLIENT, 37_000 + port, VIP, 80, SYN).bytes(),
        );
        assert_eq!(verdict, TC_NEXT);
    }
    dp.run(PROG_TC_INGRESS, &arp_frame());
    dp.run(PROG_TC_INGRESS, &Pkt::udp(CLIENT, 1, VIP_EMPTY, 53).bytes());
    dp.run(PROG_TC_EGRESS, &Pkt::udp(OTHER, 1, CLIENT, 2).bytes());
    assert_eq!(dp.counter(Counter::IngressPackets), 12);
    assert_eq!(dp.counter(Counter::NewFlow), 10);
    assert_eq!(dp.counter(Counter::NotIpv4), 1);
    assert_eq!(dp.counter(Counter::NoEndpointsRejected), 1);
    assert_eq!(dp.counter(Counter::EgressPackets), 1);
    assert_eq!(dp.counter(Counter::ReplyNotTracked), 1);
    assert_eq!(dp.ct_len(), 20, "10 flows, two entries each");
}

/// Each new flow counts one pick under its frontend's scheduler code (`pick_*`, one counter per
/// code); a code the datapath does not know picks by the flow hash and counts as `pick_random`.
/// No pick is counted for a frontend without backends, nor for an established packet.
#[test]
fn each_pick_counts_under_the_frontend_s_scheduler() {
    let mut dp = Datapath::load().with_services();
    let key = ServiceKey::new(VIP.octets(), 80u16.to_be_bytes(), proto::TCP, 0);
    let codes = proxy_common::Scheduler::ALL.map(|s| s.code());
    for (i, code) in codes.into_iter().chain([77]).enumerate() {
        let mut frontend = dp.services().get(&key, 0).expect("frontend");
        frontend.scheduler = code;
        dp.services()
            .insert(key, frontend, 0)
            .expect("set scheduler");
        let before = dp.counters();
        let syn = Pkt::tcp(CLIENT, 38_000 + i as u16, VIP, 80, SYN).bytes();
        assert_eq!(dp.run(PROG_TC_INGRESS, &syn).0, TC_NEXT);
        let ack = Pkt::tcp(CLIENT, 38_000 + i as u16, VIP, 80, ACK).bytes();
        assert_eq!(dp.run(PROG_TC_INGRESS, &ack).0, TC_NEXT);
        dp.run(PROG_TC_INGRESS, &Pkt::udp(CLIENT, 1, VIP_EMPTY, 53).bytes());
        let after = dp.counters();
        let want = if code <= proxy_common::sched::code::MAGLEV {
            proxy_common::stats::PICK_COUNTERS[code as usize]
        } else {
            Counter::PickRandom
        };
        for c in proxy_common::stats::PICK_COUNTERS {
            let delta = after[c.name()] - before[c.name()];
            assert_eq!(
                delta,
                u64::from(c == want),
                "code {code}: {} changed by {delta}",
                c.name()
            );
        }
    }
}

fn median(mut v: Vec<Duration>) -> u128 {
    v.sort();
    v[v.len() / 2].as_nanos()
}

/// The Maglev (`mh`) frontend's backends: UDP :5353 on 10.244.9.1..=n, under node-local ids
/// `first_id..`.
fn maglev_backends(n: u8, first_id: u32) -> Vec<(u32, Backend)> {
    (1..=n)
        .map(|i| {
            let addr = Ipv4Addr::new(10, 244, 9, i);
            (
                first_id + u32::from(i),
                raw_backend(addr, 5353, proto::UDP, 0),
            )
        })
        .collect()
}

/// A Maglev frontend VIP:53/UDP written as the agent does: backends, slots, the table built by
/// the agent's builder (`MaglevTable`), then the frontend entry naming table `table`.
fn set_maglev_frontend(dp: &mut Datapath, m: u32, table: u32, backends: &[(u32, Backend)]) {
    let key = ServiceKey::new(VIP.octets(), 53u16.to_be_bytes(), proto::UDP, 0);
    dp.set_frontend_entry(key, UDP_REVNAT, 0, backends);
    let endpoints = backends
        .iter()
        .map(|(_, b)| kube_proxy_ebpf::pipeline::encode::decode_endpoint(b).expect("UDP endpoint"))
        .collect();
    let built = kube_proxy_ebpf::pipeline::maglev::MaglevTable::new(m, endpoints);
    let mut tables: HashMap<&mut MapData, MaglevKey, Chunk> =
        HashMap::try_from(dp.bpf.map_mut(MAP_MAGLEV).expect("MAGLEV map")).expect("MAGLEV type");
    for (k, v) in built.map_entries(table) {
        tables.insert(k, v, 0).expect("insert chunk");
    }
    let mut value = ServiceValue::frontend(backends.len() as u16, UDP_REVNAT);
    value.scheduler = sched::code::MAGLEV;
    value.maglev_table = table;
    dp.services()
        .insert(key, value, 0)
        .expect("insert frontend");
}

/// Where 1,000 UDP flows from CLIENT (ports 20000..21000) to VIP:53 are DNATed.
fn maglev_destinations(dp: &mut Datapath) -> Vec<Ipv4Addr> {
    new_udp_flows(dp).0
}

/// 1,000 new UDP flows from CLIENT (ports 20000..21000) to VIP:53: where each is DNATed, and
/// the median cost of one (ns, single runs).
fn new_udp_flows(dp: &mut Datapath) -> (Vec<Ipv4Addr>, u128) {
    let mut times = Vec::new();
    let daddrs = (20_000..21_000u16)
        .map(|port| {
            let q = Pkt::udp(CLIENT, port, VIP, 53).payload(b"q");
            let (verdict, out, d) = dp.run_timed(PROG_TC_INGRESS, &q.bytes(), 1);
            assert_eq!(verdict, TC_NEXT, "port {port}: verdict");
            times.push(d);
            Decoded::parse(&out).daddr
        })
        .collect();
    (daddrs, median(times))
}

/// The datapath's Maglev pick equals the userspace model's for 1,000 flows: the table the agent
/// builds, the position `maglev::flow_index` of the unseeded 5-tuple hash, the slot's backend.
/// The node's hash seed does not change it, nor do node-local backend ids (a second "node" with
/// other ids and another table id sends every flow to the same backend), and a frontend whose
/// table is missing falls back to the flow hash, counted.
#[test]
fn maglev_pick_equals_the_userspace_model_on_every_node() {
    let m = 1_021; // two chunks: the split between them is exercised
    let cfg = |seed| DatapathConfig {
        hash_seed: seed,
        maglev_table_size: m,
        ..DatapathConfig::DEFAULT
    };
    let backends = maglev_backends(5, 200);
    let mut dp = Datapath::load_with(cfg(0x1234_5678));
    set_maglev_frontend(&mut dp, m, 7, &backends);
    let endpoints = backends
        .iter()
        .map(|(_, b)| kube_proxy_ebpf::pipeline::encode::decode_endpoint(b).unwrap())
        .collect();
    let model = kube_proxy_ebpf::pipeline::maglev::MaglevTable::new(m, endpoints).entries();
    let before = dp.counters();
    let (got, maglev_ns) = new_udp_flows(&mut dp);
    let mut per_backend = BTreeMap::<Ipv4Addr, u32>::new();
    for (port, daddr) in (20_000..21_000u16).zip(&got) {
        let hash = flow_hash(
            maglev::FLOW_SEED,
            CLIENT.octets(),
            VIP.octets(),
            port.to_be_bytes(),
            53u16.to_be_bytes(),
            proto::UDP,
        );
        let slot = model[maglev::flow_index(hash, m) as usize];
        let want = Ipv4Addr::from(backends[slot as usize - 1].1.addr);
        assert_eq!(*daddr, want, "port {port}: slot {slot}");
        *per_backend.entry(*daddr).or_default() += 1;
    }
    assert_eq!(per_backend.len(), 5, "all backends used: {per_backend:?}");
    let after = dp.counters();
    let fallback = Counter::MaglevFallback.name();
    assert_eq!(
        after[fallback] - before[fallback],
        0,
        "every flow found its table"
    );
    assert_eq!(
        after[Counter::NewFlow.name()] - before[Counter::NewFlow.name()],
        1_000
    );

    // Another node: other seed, other backend ids, other table id; the same endpoints.
    let mut other = Datapath::load_with(cfg(0xdead_beef));
    set_maglev_frontend(&mut other, m, 3, &maglev_backends(5, 300));
    assert_eq!(
        maglev_destinations(&mut other),
        got,
        "another node, the same backends"
    );

    // The cost of a new flow next to the flow-hash pick (printed, never asserted).
    let mut random = Datapath::load_with(cfg(0x1234_5678));
    let key = ServiceKey::new(VIP.octets(), 53u16.to_be_bytes(), proto::UDP, 0);
    random.set_frontend_entry(key, UDP_REVNAT, 0, &backends);
    let (_, random_ns) = new_udp_flows(&mut random);
    println!("new UDP flow, median of 1,000: Maglev {maglev_ns} ns, flow hash {random_ns} ns");

    // No table: the flow hash picks, and the fallback is counted.
    let mut bare = Datapath::load_with(cfg(0));
    set_maglev_frontend(&mut bare, m, 7, &backends);
    let mut tables: HashMap<&mut MapData, MaglevKey, Chunk> =
        HashMap::try_from(bare.bpf.map_mut(MAP_MAGLEV).unwrap()).unwrap();
    for chunk in 0..maglev::chunks(m) {
        tables.remove(&MaglevKey { table: 7, chunk }).unwrap();
    }
    let q = Pkt::udp(CLIENT, 20_000, VIP, 53).payload(b"q");
    let ids: Vec<u32> = backends.iter().map(|(id, _)| *id).collect();
    let slot = pick_slot(
        flow_hash(
            0,
            CLIENT.octets(),
            VIP.octets(),
            20_000u16.to_be_bytes(),
            [0, 53],
            proto::UDP,
        ),
        5,
    )
    .unwrap();
    let before = bare.counter(Counter::MaglevFallback);
    let (_, out) = bare.run(PROG_TC_INGRESS, &q.bytes());
    assert_eq!(
        Decoded::parse(&out).daddr,
        Ipv4Addr::from(backends[slot as usize - 1].1.addr),
        "fallback pick (backend id {})",
        ids[slot as usize - 1]
    );
    assert_eq!(bare.counter(Counter::MaglevFallback), before + 1);
}

/// Prints the datapath's cost per packet. Never asserts on timing.
#[test]
fn per_packet_cost() {
    let mut dp = Datapath::load().with_services();

    // New flows: a fresh source port per run.
    let new_flow: Vec<Duration> = (0..2_000u16)
        .map(|i| {
            let (verdict, _, d) = dp.run_timed(
                PROG_TC_INGRESS,
                &Pkt::tcp(CLIENT, 10_000 + i, VIP, 80, SYN).bytes(),
                1,
            );
            assert_eq!(verdict, TC_NEXT, "new flow verdict");
            d
        })
        .collect();

    // BPF_PROG_TEST_RUN repeats on the same skb, so the program sees its own output again. Two
    // Services that translate into each other (A:80 → B:81, B:81 → A:80) make every repetition a
    // real established-flow DNAT (and, on egress, a real reverse NAT), alternating between them.
    let a = Ipv4Addr::new(10, 96, 1, 1);
    let b = Ipv4Addr::new(10, 96, 1, 2);
    let backend = |addr: Ipv4Addr, port: u16| Backend {
        addr: addr.octets(),
        port: port.to_be_bytes(),
        proto: proto::TCP,
        flags: 0,
    };
    dp.backends().insert(100, backend(b, 81), 0).unwrap();
    dp.backends().insert(101, backend(a, 80), 0).unwrap();
    {
        let mut s = dp.services();
        let ka = ServiceKey::new(a.octets(), 80u16.to_be_bytes(), proto::TCP, 0);
        let kb = ServiceKey::new(b.octets(), 81u16.to_be_bytes(), proto::TCP, 0);
        s.insert(ka.with_slot(1), ServiceValue::slot(100), 0)
            .unwrap();
        s.insert(ka, ServiceValue::frontend(1, 10), 0).unwrap();
        s.insert(kb.with_slot(1), ServiceValue::slot(101), 0)
            .unwrap();
        s.insert(kb, ServiceValue::frontend(1, 11), 0).unwrap();
    }
    let to_a = Pkt::tcp(CLIENT, 50_000, a, 80, ACK).payload(&[0; 64]);
    let to_b = Pkt::tcp(CLIENT, 50_000, b, 81, ACK).payload(&[0; 64]);
    for p in [&to_a, &to_b] {
        let (verdict, out) = dp.run(PROG_TC_INGRESS, &p.bytes());
        assert_eq!(verdict, TC_NEXT);
        assert!(
            Decoded::parse(&out).l4_csum_ok(),
            "cycle setup keeps checksums valid"
        );
    }
    let est_before = dp.counter(Counter::EstablishedFlow);
    let (_, out, established) = dp.run_timed(PROG_TC_INGRESS, &to_a.bytes(), 100_000);
    assert_eq!(
        dp.counter(Counter::EstablishedFlow) - est_before,
        100_000,
        "every repetition took the established path"
    );
    assert!(
        Decoded::parse(&out).l4_csum_ok(),
        "100,000 incremental rewrites keep the TCP checksum valid"
    );

    // Replies: from "backend" B:81 to the client → source A:80 → matches the other flow's REPLY.
    let reply = Pkt::tcp(b, 81, CLIENT, 50_000, ACK).payload(&[0; 64]);
    let rep_before = dp.counter(Counter::ReplyTranslated);
    let (_, out, reply_cost) = dp.run_timed(PROG_TC_EGRESS, &reply.bytes(), 100_000);
    assert_eq!(
        dp.counter(Counter::ReplyTranslated) - rep_before,
        100_000,
        "every repetition was reverse-NATed"
    );
    assert!(
        Decoded::parse(&out).l4_csum_ok(),
        "reply rewrites keep the TCP checksum valid"
    );

    let (_, _, not_service) = dp.run_timed(
        PROG_TC_INGRESS,
        &Pkt::tcp(CLIENT, 50_001, OTHER, 80, ACK).bytes(),
        100_000,
    );

    // The same miss with the Service address space populated (a /12 and 10,000 ClusterIPs):
    // the LPM lookup every new non-Service flow now makes.
    {
        let mut cidrs: LpmTrie<&mut MapData, [u8; 4], u32> =
            LpmTrie::try_from(dp.bpf.map_mut(MAP_SERVICE_CIDRS).expect("SVCCIDRS map"))
                .expect("SVCCIDRS type");
        cidrs
            .insert(&Key::new(12, [10, 96, 0, 0]), service_cidr::UNALLOCATED, 0)
            .expect("insert the Service CIDR");
        for i in 0..10_000u32 {
            let ip = (u32::from(Ipv4Addr::new(10, 96, 0, 0)) + i).to_be_bytes();
            cidrs
                .insert(&Key::new(32, ip), service_cidr::CLUSTER_IP, 0)
                .expect("insert a ClusterIP");
        }
    }
    let (_, _, not_service_cidrs) = dp.run_timed(
        PROG_TC_INGRESS,
        &Pkt::tcp(CLIENT, 50_001, OTHER, 80, ACK).bytes(),
        100_000,
    );

    println!(
        "per-packet cost: new_flow_ns={} established_ns={} reply_ns={} not_service_ns={} \
         not_service_with_10000_cluster_ips_ns={}",
        median(new_flow),
        established.as_nanos(),
        reply_cost.as_nanos(),
        not_service.as_nanos(),
        not_service_cidrs.as_nanos()
    );
}

/// The node's address on the external device, the NodePort, an external client, backends.
const NODE_IP: Ipv4Addr = Ipv4Addr::new(192, 168, 50, 10);
const NODE_PORT: u16 = 30080;
const EXT_CLIENT: Ipv4Addr = Ipv4Addr::new(192, 168, 50, 100);
const REMOTE_BE: Ipv4Addr = Ipv4Addr::new(10, 244, 2, 20);
const LOCAL_BE: Ipv4Addr = Ipv4Addr::new(10, 244, 1, 10);

fn raw_backend(addr: Ipv4Addr, port: u16, proto: u8, flags: u8) -> Backend {
    Backend {
        addr: addr.octets(),
        port: port.to_be_bytes(),
        proto,
        flags,
    }
}

/// NodePort frontends: NODE_IP:30080/TCP and /UDP (eTP=Cluster, one remote backend),
/// NODE_IP:30081/TCP (eTP=Cluster, one local backend), NODE_IP:30082/TCP (eTP=Local, none here,
/// some on other nodes: `DROP_WHEN_EMPTY`).
fn nodeport_datapath() -> Datapath {
    nodeport_datapath_with(DatapathConfig::DEFAULT)
}

/// [`nodeport_datapath`] with other timeouts.
fn nodeport_datapath_with(cfg: DatapathConfig) -> Datapath {
    let mut dp = Datapath::load_with(cfg);
    let ext = service_flags::EXTERNAL;
    dp.set_frontend(
        NODE_IP,
        NODE_PORT,
        proto::TCP,
        ext,
        &[(200, raw_backend(REMOTE_BE, 8080, proto::TCP, 0))],
    );
    dp.set_frontend(
        NODE_IP,
        NODE_PORT,
        proto::UDP,
        ext,
        &[(201, raw_backend(REMOTE_BE, 5353, proto::UDP, 0))],
    );
    dp.set_frontend(
        NODE_IP,
        NODE_PORT + 1,
        proto::TCP,
        ext,
        &[(
            202,
            raw_backend(LOCAL_BE, 8080, proto::TCP, backend_flags::LOCAL),
        )],
    );
    dp.set_frontend(
        NODE_IP,
        NODE_PORT + 2,
        proto::TCP,
        ext | service_flags::EXTERNAL_LOCAL | service_flags::DROP_WHEN_EMPTY,
        &[],
    );
    dp
}

fn with_src(p: &Pkt, addr: Ipv4Addr, port: u16) -> Pkt {
    let mut q = p.clone();
    q.saddr = addr;
    set_ports(&mut q, port, p.dport());
    q
}

fn with_dst(p: &Pkt, addr: Ipv4Addr, port: u16) -> Pkt {
    let mut q = p.clone();
    q.daddr = addr;
    set_ports(&mut q, p.sport(), port);
    q
}

fn snat_out_key(client: &Pkt, backend: Ipv4Addr, bport: u16) -> SnatKey {
    SnatKey {
        saddr: client.saddr.octets(),
        daddr: backend.octets(),
        sport: client.sport().to_be_bytes(),
        dport: bport.to_be_bytes(),
        proto: client.proto(),
        dir: ct_dir::ORIGINAL,
        _pad: [0; 2],
    }
}

fn snat_in_key(backend: Ipv4Addr, bport: u16, node_port: u16, proto: u8) -> SnatKey {
    SnatKey {
        saddr: backend.octets(),
        daddr: NODE_IP.octets(),
        sport: bport.to_be_bytes(),
        dport: node_port.to_be_bytes(),
        proto,
        dir: ct_dir::REPLY,
        _pad: [0; 2],
    }
}

/// The first port the datapath's SNAT probe tries for a flow on the node's address (the client's
/// own) or on another source (where the walk starts: the same pure hash).
fn snat_probe_start(client: &Pkt, backend: Ipv4Addr, bport: u16, on_node_addr: bool) -> u16 {
    snat_probe_port(client, backend, bport, on_node_addr, 0)
}

/// The `n`-th port the datapath's SNAT probe tries for a flow to `backend:bport`.
fn snat_probe_port(client: &Pkt, backend: Ipv4Addr, bport: u16, on_node_addr: bool, n: u32) -> u16 {
    let h = flow_hash(
        0,
        client.saddr.octets(),
        backend.octets(),
        client.sport().to_be_bytes(),
        bport.to_be_bytes(),
        client.proto(),
    );
    SnatPorts::new(h, client.proto(), client.sport(), on_node_addr).port(n)
}

/// BPF_PROG_TEST_RUN runs on the loopback device (ifindex 1), which stands for a tunnel device.
const TEST_RUN_IFINDEX: u32 = 1;

/// [`nodeport_datapath`] with the node's address set and the test-run device a tunnel with its
/// own SNAT address `tunnel_ip` (`SNATDEV_V1`).
fn nodeport_datapath_through_tunnel(tunnel_ip: Ipv4Addr) -> Datapath {
    let mut dp = nodeport_datapath();
    dp.set_node_addr(NODE_IP);
    let mut devices: HashMap<&mut MapData, u32, SnatDevice> =
        HashMap::try_from(dp.bpf.map_mut(MAP_SNAT_DEVICES).expect("SNATDEV map"))
            .expect("SNATDEV type");
    devices
        .insert(
            TEST_RUN_IFINDEX,
            SnatDevice {
                addr: tunnel_ip.octets(),
            },
            0,
        )
        .expect("write SNATDEV");
    dp
}

/// A forwarded flow leaving through a tunnel device with an address of its own (`SNATDEV_V1`)
/// takes that address as source, like MASQUERADE (BPF_PROG_TEST_RUN runs on the loopback
/// device, ifindex 1, which stands for the tunnel here). Ingress allocated on the node's address
/// before routing; the first packet out moves the port to the device's address and frees the
/// node's; the backend's reply to the device's address is translated back to the client.
#[test]
fn forwarded_flow_through_a_tunnel_device_is_snated_to_the_device_address() {
    const TUNNEL_IP: Ipv4Addr = Ipv4Addr::new(10, 244, 1, 0);
    let mut dp = nodeport_datapath_through_tunnel(TUNNEL_IP);

    let syn = Pkt::tcp(EXT_CLIENT, 40_010, NODE_IP, NODE_PORT, SYN);
    let fwd = with_dst(&syn, REMOTE_BE, 8080);
    dp.check(ingress(
        "nodeport SYN to a remote backend: DNAT, port allocated on the node's address",
        syn.bytes(),
        TC_NEXT,
        Expect::Packet(fwd.clone()),
        &[
            (Counter::NewFlow, 1),
            (Counter::SnatNew, 1),
            (Counter::SnatPortKept, 1),
        ],
    ));
    let out = dp
        .snat()
        .get(&snat_out_key(&syn, REMOTE_BE, 8080), 0)
        .expect("SNAT out entry");
    assert_eq!(out.addr, NODE_IP.octets());
    let node_port = u16::from_be_bytes(out.port);

    // The device's address is another `in` key space: the first probe is free there too.
    let port = snat_probe_start(&syn, REMOTE_BE, 8080, false);
    dp.check(egress(
        "forwarded SYN out through the tunnel: source is the device's address",
        fwd.bytes(),
        TC_NEXT,
        Expect::Packet(with_src(&fwd, TUNNEL_IP, port)),
        &[(Counter::SnatTranslated, 1), (Counter::SnatDeviceSource, 1)],
    ));
    let out = dp
        .snat()
        .get(&snat_out_key(&syn, REMOTE_BE, 8080), 0)
        .expect("SNAT out entry");
    assert_eq!(
        (out.addr, u16::from_be_bytes(out.port)),
        (TUNNEL_IP.octets(), port),
        "out entry moved to the device's address"
    );
    let in_key = |addr: Ipv4Addr, port: u16| SnatKey {
        daddr: addr.octets(),
        ..snat_in_key(REMOTE_BE, 8080, port, proto::TCP)
    };
    assert!(
        dp.snat().get(&in_key(NODE_IP, node_port), 0).is_err(),
        "the node address's port is given back"
    );
    let back = dp
        .snat()
        .get(&in_key(TUNNEL_IP, port), 0)
        .expect("in entry on the device's address");
    assert_eq!(
        (back.addr, back.port),
        (EXT_CLIENT.octets(), 40_010u16.to_be_bytes())
    );

    let ack = Pkt::tcp(EXT_CLIENT, 40_010, NODE_IP, NODE_PORT, ACK).payload(b"GET /");
    let ack_fwd = with_dst(&ack, REMOTE_BE, 8080);
    dp.check(ingress(
        "established: DNAT from conntrack",
        ack.bytes(),
        TC_NEXT,
        Expect::Packet(ack_fwd.clone()),
        &[(Counter::EstablishedFlow, 1)],
    ));
    dp.check(egress(
        "established: same device address and port, nothing moves",
        ack_fwd.bytes(),
        TC_NEXT,
        Expect::Packet(with_src(&ack_fwd, TUNNEL_IP, port)),
        &[(Counter::SnatTranslated, 1)],
    ));
    let synack = Pkt::tcp(REMOTE_BE, 8080, TUNNEL_IP, port, SYN | ACK);
    let unsnat = with_dst(&synack, EXT_CLIENT, 40_010);
    dp.check(ingress(
        "the backend's reply to the device's address goes back to the client",
        synack.bytes(),
        TC_NEXT,
        Expect::Packet(unsnat.clone()),
        &[(Counter::SnatReplyTranslated, 1)],
    ));
    dp.check(egress(
        "toward the client: source becomes the NodePort",
        unsnat.bytes(),
        TC_NEXT,
        Expect::Packet(with_src(&unsnat, NODE_IP, NODE_PORT)),
        &[(Counter::ReplyTranslated, 1)],
    ));
}

/// An eTP=Cluster NodePort flow forwarded to a remote backend through an L3 tunnel (ipip/tunl0,
/// WireGuard: packets without Ethernet header, `tc_egress_l3`/`tc_ingress_l3`): SNATed to the
/// device's address on the way out, its replies un-SNATed as they come back through the tunnel.
#[test]
fn forwarded_flow_through_an_l3_tunnel_is_snated_and_its_reply_unsnated() {
    const TUNNEL_IP: Ipv4Addr = Ipv4Addr::new(10, 244, 1, 1);
    let mut dp = nodeport_datapath_through_tunnel(TUNNEL_IP);

    let syn = Pkt::tcp(EXT_CLIENT, 40_030, NODE_IP, NODE_PORT, SYN);
    let fwd = with_dst(&syn, REMOTE_BE, 8080);
    dp.check(ingress(
        "nodeport SYN on the external device: DNAT to the remote backend",
        syn.bytes(),
        TC_NEXT,
        Expect::Packet(fwd.clone()),
        &[
            (Counter::NewFlow, 1),
            (Counter::SnatNew, 1),
            (Counter::SnatPortKept, 1),
        ],
    ));
    let port = snat_probe_start(&syn, REMOTE_BE, 8080, false);
    dp.check(egress_l3(
        "forwarded SYN out through the L3 tunnel: source is the device's address",
        fwd.l3_bytes(),
        TC_NEXT,
        Expect::Packet(with_src(&fwd, TUNNEL_IP, port)),
        &[(Counter::SnatTranslated, 1), (Counter::SnatDeviceSource, 1)],
    ));
    let ack = Pkt::tcp(EXT_CLIENT, 40_030, NODE_IP, NODE_PORT, ACK).payload(b"GET /");
    let ack_fwd = with_dst(&ack, REMOTE_BE, 8080);
    dp.check(ingress(
        "established: DNAT from conntrack",
        ack.bytes(),
        TC_NEXT,
        Expect::Packet(ack_fwd.clone()),
        &[(Counter::EstablishedFlow, 1)],
    ));
    dp.check(egress_l3(
        "established: same device address and port",
        ack_fwd.l3_bytes(),
        TC_NEXT,
        Expect::Packet(with_src(&ack_fwd, TUNNEL_IP, port)),
        &[(Counter::SnatTranslated, 1)],
    ));
    let synack = Pkt::tcp(REMOTE_BE, 8080, TUNNEL_IP, port, SYN | ACK);
    let unsnat = with_dst(&synack, EXT_CLIENT, 40_030);
    dp.check(ingress_l3(
        "the backend's reply through the L3 tunnel goes back to the client",
        synack.l3_bytes(),
        TC_NEXT,
        Expect::Packet(unsnat.clone()),
        &[(Counter::SnatReplyTranslated, 1)],
    ));
    dp.check(egress(
        "toward the client on the external device: source becomes the NodePort",
        unsnat.bytes(),
        TC_NEXT,
        Expect::Packet(with_src(&unsnat, NODE_IP, NODE_PORT)),
        &[(Counter::ReplyTranslated, 1)],
    ));

    let dgram = Pkt::udp(EXT_CLIENT, 40_031, NODE_IP, NODE_PORT);
    let dgram_fwd = with_dst(&dgram, REMOTE_BE, 5353);
    dp.check(ingress(
        "nodeport UDP datagram: DNAT to the remote backend",
        dgram.bytes(),
        TC_NEXT,
        Expect::Packet(dgram_fwd.clone()),
        &[
            (Counter::NewFlow, 1),
            (Counter::SnatNew, 1),
            (Counter::SnatPortKept, 1),
        ],
    ));
    let uport = snat_probe_start(&dgram, REMOTE_BE, 5353, false);
    dp.check(egress_l3(
        "UDP out through the L3 tunnel: SNAT to the device's address",
        dgram_fwd.l3_bytes(),
        TC_NEXT,
        Expect::Packet(with_src(&dgram_fwd, TUNNEL_IP, uport)),
        &[(Counter::SnatTranslated, 1), (Counter::SnatDeviceSource, 1)],
    ));
    let answer = Pkt::udp(REMOTE_BE, 5353, TUNNEL_IP, uport);
    dp.check(ingress_l3(
        "UDP answer through the L3 tunnel: back to the client",
        answer.l3_bytes(),
        TC_NEXT,
        Expect::Packet(with_dst(&answer, EXT_CLIENT, 40_031)),
        &[(Counter::SnatReplyTranslated, 1)],
    ));
}

/// Fragmented datagrams of a NodePort flow whose remote backend is reached through an L3 tunnel:
/// the later fragments get what their first one got at each L3 hook too.
#[test]
fn fragmented_datagrams_through_an_l3_tunnel_are_translated() {
    let mut dp = nodeport_datapath();
    dp.set_node_addr(NODE_IP);
    use Counter::*;
    let req = big(Pkt::udp(EXT_CLIENT, 5300, NODE_IP, NODE_PORT), 0x0909);
    let fwd = with_dst(&req, REMOTE_BE, 5353);
    check_datagram(
        &mut dp,
        PROG_TC_INGRESS,
        "NodePort request on the external device",
        &req,
        &fwd,
        &[(NewFlow, 1), (SnatNew, 1), (SnatPortKept, 1)],
        FragmentTranslated,
    );
    let nat_port = u16::from_be_bytes(
        dp.snat()
            .get(&snat_out_key(&req, REMOTE_BE, 5353), 0)
            .expect("SNAT out entry")
            .port,
    );
    check_datagram(
        &mut dp,
        PROG_TC_EGRESS_L3,
        "NodePort request out through the L3 tunnel (SNAT)",
        &fwd,
        &with_src(&fwd, NODE_IP, nat_port),
        &[(SnatTranslated, 1)],
        FragmentTranslated,
    );
    let reply = big(Pkt::udp(REMOTE_BE, 5353, NODE_IP, nat_port), 0x0a0a);
    check_datagram(
        &mut dp,
        PROG_TC_INGRESS_L3,
        "reply arriving through the L3 tunnel (un-SNAT)",
        &reply,
        &with_dst(&reply, EXT_CLIENT, 5300),
        &[(SnatReplyTranslated, 1)],
        FragmentTranslated,
    );
}

/// The L3-device programs run the whole flow, tail-called parts included (their own L3
/// variants): a new flow to a ClusterIP, its reply, a flow to no Service, a Service without
/// endpoints (no answer can be built without MACs: dropped), IPv6 (passed).
#[test]
fn l3_device_programs_translate_track_and_drop_like_the_ethernet_ones() {
    let mut dp = Datapath::load().with_services();
    let syn = Pkt::tcp(CLIENT, 41_000, VIP, 80, SYN);
    let id = expected_pick(&syn, &[1, 2]);
    dp.check(ingress_l3(
        "SYN to VIP:80 arriving through an L3 tunnel: DNAT (tc_ingress_new_l3)",
        syn.l3_bytes(),
        TC_NEXT,
        Expect::Packet(dnated(&syn, id)),
        &[(Counter::NewFlow, 1)],
    ));
    let mut synack = reply_from(&syn, id);
    if let common_packet::L4::Tcp { flags, .. } = &mut synack.l4 {
        *flags = SYN | ACK;
    }
    dp.check(egress_l3(
        "SYN-ACK leaving through the L3 tunnel: reverse NAT to VIP:80",
        synack.l3_bytes(),
        TC_NEXT,
        Expect::Packet(rev_natted(&synack, &syn)),
        &[(Counter::ReplyTranslated, 1)],
    ));
    let ack = Pkt::tcp(CLIENT, 41_000, VIP, 80, ACK).payload(b"GET /");
    dp.check(ingress_l3(
        "established through the L3 tunnel",
        ack.l3_bytes(),
        TC_NEXT,
        Expect::Packet(dnated(&ack, id)),
        &[(Counter::EstablishedFlow, 1)],
    ));
    let ct_before = dp.ct_len();
    let direct = Pkt::udp(CLIENT, 41_001, OTHER, 53);
    dp.check(ingress_l3(
        "UDP to no Service: tracked by tc_ingress_direct_l3, untouched",
        direct.l3_bytes(),
        TC_NEXT,
        Expect::Unchanged,
        &[(Counter::NotService, 1)],
    ));
    assert!(dp.ct_len() > ct_before, "the direct flow is tracked");
    dp.check(ingress_l3(
        "SYN to a Service without endpoints: no MACs to answer with, dropped",
        Pkt::tcp(CLIENT, 41_002, VIP_EMPTY, 80, SYN).l3_bytes(),
        TC_ACT_SHOT,
        Expect::Dropped,
        &[(Counter::DropRejectFailed, 1)],
    ));
    let mut ipv6 = vec![0x60, 0, 0, 0, 0, 20, 6, 64];
    ipv6.extend([0u8; 32 + 20]);
    dp.check(ingress_l3(
        "IPv6 through an L3 tunnel passes (to the IPv6 program: a TCP header of zeros, no Service)",
        ipv6.clone(),
        TC_NEXT,
        Expect::Unchanged,
        &[(Counter::NotService, 1)],
    ));
    dp.check(egress_l3(
        "IPv6 out through an L3 tunnel passes",
        ipv6,
        TC_NEXT,
        Expect::Unchanged,
        &[(Counter::MalformedPassed, 1)],
    ));
}

#[test]
fn nodeport_to_remote_backend_is_snated_and_reverse_translated() {
    let mut dp = nodeport_datapath();
    let syn = Pkt::tcp(EXT_CLIENT, 40_000, NODE_IP, NODE_PORT, SYN);

    // Before the agent wrote the node's address: DNAT only, counted.
    let fwd = with_dst(&syn, REMOTE_BE, 8080);
    dp.check(ingress(
        "nodeport SYN, no node address yet: DNAT, no SNAT",
        syn.bytes(),
        TC_NEXT,
        Expect::Packet(fwd.clone()),
        &[(Counter::NewFlow, 1), (Counter::SnatNoNodeAddr, 1)],
    ));
    dp.check(egress(
        "forwarded SYN without SNAT entry passes untouched",
        fwd.bytes(),
        TC_NEXT,
        Expect::Unchanged,
        &[(Counter::ReplyNotTracked, 1)],
    ));
    assert_eq!(
        dp.snat().keys().count(),
        0,
        "no SNAT entries without an address"
    );

    dp.set_node_addr(NODE_IP);
    let syn = Pkt::tcp(EXT_CLIENT, 40_001, NODE_IP, NODE_PORT, SYN);
    let fwd = with_dst(&syn, REMOTE_BE, 8080);
    dp.check(ingress(
        "nodeport SYN to a remote backend: DNAT + SNAT port allocated",
        syn.bytes(),
        TC_NEXT,
        Expect::Packet(fwd.clone()),
        &[
            (Counter::NewFlow, 1),
            (Counter::SnatNew, 1),
            (Counter::SnatPortKept, 1),
        ],
    ));
    let out = dp
        .snat()
        .get(&snat_out_key(&syn, REMOTE_BE, 8080), 0)
        .expect("SNAT out entry");
    let nat_port = u16::from_be_bytes(out.port);
    assert_eq!(out.addr, NODE_IP.octets(), "SNAT to the node address");
    assert_eq!(
        nat_port,
        snat_probe_start(&syn, REMOTE_BE, 8080, true),
        "first probe free"
    );
    let back = dp
        .snat()
        .get(&snat_in_key(REMOTE_BE, 8080, nat_port, proto::TCP), 0)
        .expect("SNAT in entry");
    assert_eq!(
        (back.addr, back.port),
        (EXT_CLIENT.octets(), 40_001u16.to_be_bytes())
    );

    dp.check(egress(
        "forwarded SYN leaves with the node's address and port",
        fwd.bytes(),
        TC_NEXT,
        Expect::Packet(with_src(&fwd, NODE_IP, nat_port)),
        &[(Counter::SnatTranslated, 1)],
    ));
    let synack = Pkt::tcp(REMOTE_BE, 8080, NODE_IP, nat_port, SYN | ACK);
    let unsnat = with_dst(&synack, EXT_CLIENT, 40_001);
    dp.check(ingress(
        "the remote backend's SYN-ACK goes back to the client (destination restored)",
        synack.bytes(),
        TC_NEXT,
        Expect::Packet(unsnat.clone()),
        &[(Counter::SnatReplyTranslated, 1)],
    ));
    dp.check(egress(
        "toward the client: source becomes the NodePort",
        unsnat.bytes(),
        TC_NEXT,
        Expect::Packet(with_src(&unsnat, NODE_IP, NODE_PORT)),
        &[(Counter::ReplyTranslated, 1)],
    ));
    let ack = Pkt::tcp(EXT_CLIENT, 40_001, NODE_IP, NODE_PORT, ACK).payload(b"GET /");
    let ack_fwd = with_dst(&ack, REMOTE_BE, 8080);
    dp.check(ingress(
        "established: DNAT from conntrack",
        ack.bytes(),
        TC_NEXT,
        Expect::Packet(ack_fwd.clone()),
        &[(Counter::EstablishedFlow, 1)],
    ));
    dp.check(egress(
        "established: same SNAT port",
        ack_fwd.bytes(),
        TC_NEXT,
        Expect::Packet(with_src(&ack_fwd, NODE_IP, nat_port)),
        &[(Counter::SnatTranslated, 1)],
    ));

    // A port taken by a live flow of another client to the same backend is skipped.
    let other = Pkt::tcp(EXT_CLIENT, 40_002, NODE_IP, NODE_PORT, SYN);
    let start = snat_probe_start(&other, REMOTE_BE, 8080, true);
    let squatter = SnatValue {
        last_seen_ns: u64::MAX / 2,
        addr: [192, 168, 50, 200],
        port: 1234u16.to_be_bytes(),
        state: ct_state::ESTABLISHED,
        flags: 0,
    };
    dp.snat()
        .insert(snat_in_key(REMOTE_BE, 8080, start, proto::TCP), squatter, 0)
        .expect("occupy the first probe");
    dp.check(ingress(
        "second client: its first port is taken, the next one is used",
        other.bytes(),
        TC_NEXT,
        Expect::Packet(with_dst(&other, REMOTE_BE, 8080)),
        &[(Counter::NewFlow, 1), (Counter::SnatNew, 1)],
    ));
    let got = dp
        .snat()
        .get(&snat_out_key(&other, REMOTE_BE, 8080), 0)
        .expect("second out entry");
    let want = snat_probe_port(&other, REMOTE_BE, 8080, true, 1);
    assert_eq!(
        u16::from_be_bytes(got.port),
        want,
        "probe moved on to its second port"
    );
    assert_eq!(
        dp.snat()
            .get(&snat_in_key(REMOTE_BE, 8080, start, proto::TCP), 0)
            .expect("squatter kept")
            .addr,
        [192, 168, 50, 200],
        "the live flow's entry is untouched"
    );

    // UDP: the same path.
    let dgram = Pkt::udp(EXT_CLIENT, 5000, NODE_IP, NODE_PORT).payload(b"ping");
    let dfwd = with_dst(&dgram, REMOTE_BE, 5353);
    dp.check(ingress(
        "UDP nodeport to a remote backend: DNAT + SNAT",
        dgram.bytes(),
        TC_NEXT,
        Expect::Packet(dfwd.clone()),
        &[
            (Counter::NewFlow, 1),
            (Counter::SnatNew, 1),
            (Counter::SnatPortKept, 1),
        ],
    ));
    let uport = u16::from_be_bytes(
        dp.snat()
            .get(&snat_out_key(&dgram, REMOTE_BE, 5353), 0)
            .expect("UDP out entry")
            .port,
    );
    dp.check(egress(
        "UDP forwarded: SNAT",
        dfwd.bytes(),
        TC_NEXT,
        Expect::Packet(with_src(&dfwd, NODE_IP, uport)),
        &[(Counter::SnatTranslated, 1)],
    ));
    let dreply = Pkt::udp(REMOTE_BE, 5353, NODE_IP, uport).payload(b"pong");
    let dback = with_dst(&dreply, EXT_CLIENT, 5000);
    let seen = |dp: &mut Datapath| {
        let out = dp.snat().get(&snat_out_key(&dgram, REMOTE_BE, 5353), 0);
        let inn = dp
            .snat()
            .get(&snat_in_key(REMOTE_BE, 5353, uport, proto::UDP), 0);
        let ct = dp.ct(&original_key(&dgram));
        [
            out.map(|v| v.flags),
            inn.map(|v| v.flags),
            ct.map(|v| v.flags).ok_or(aya::maps::MapError::KeyNotFound),
        ]
        .map(|f| f.expect("entry") & ct_flags::SEEN_REPLY != 0)
    };
    assert_eq!(
        seen(&mut dp),
        [false; 3],
        "no reply yet: SNAT out/in, conntrack"
    );
    dp.check(ingress(
        "UDP reply: back to the client",
        dreply.bytes(),
        TC_NEXT,
        Expect::Packet(dback.clone()),
        &[(Counter::SnatReplyTranslated, 1)],
    ));
    assert_eq!(
        seen(&mut dp),
        [true, true, false],
        "the reply marks both SNAT entries answered (udpStreamTimeout)"
    );
    dp.check(egress(
        "UDP reply: from the NodePort",
        dback.bytes(),
        TC_NEXT,
        Expect::Packet(with_src(&dback, NODE_IP, NODE_PORT)),
        &[(Counter::ReplyTranslated, 1)],
    ));
    assert_eq!(seen(&mut dp), [true; 3], "and then the conntrack entries");

    // A packet to a SNAT-range port that is no flow's passes.
    let stray = Pkt::tcp(REMOTE_BE, 8080, NODE_IP, 65_000, ACK);
    if dp
        .snat()
        .get(&snat_in_key(REMOTE_BE, 8080, 65_000, proto::TCP), 0)
        .is_err()
    {
        dp.check(ingress(
            "stray packet to a free SNAT port passes",
            stray.bytes(),
            TC_NEXT,
            Expect::Unchanged,
            &[(Counter::NotService, 1)],
        ));
    }
}

/// The agent's SNAT garbage collection over pairs the datapath allocated itself: it finds each
/// flow's partner entry as the datapath keyed it, removes both entries of a flow idle past its
/// timeout, and keeps a flow only the backend still talks on (its replies refresh `in` only),
/// which keeps translating.
#[test]
fn snat_gc_removes_the_datapath_s_pairs_of_idle_flows_only() {
    proxy_testenv::require_privileged!();
    let cfg = DatapathConfig {
        tcp_established_timeout_s: 100,
        tcp_transitory_timeout_s: 10,
        udp_timeout_s: 5,
        ..DatapathConfig::DEFAULT
    };
    let mut dp = nodeport_datapath_with(cfg);
    dp.set_node_addr(NODE_IP);
    let idle = Pkt::tcp(EXT_CLIENT, 41_000, NODE_IP, NODE_PORT, SYN);
    let busy = Pkt::tcp(EXT_CLIENT, 41_001, NODE_IP, NODE_PORT, SYN);
    let streaming = Pkt::udp(EXT_CLIENT, 41_002, NODE_IP, NODE_PORT).payload(b"subscribe");
    let mut pairs = Vec::new();
    for (pkt, bport) in [(&idle, 8080), (&busy, 8080), (&streaming, 5353)] {
        let (verdict, _) = dp.run(PROG_TC_INGRESS, &pkt.bytes());
        assert_eq!(verdict, TC_NEXT, "new nodeport flow");
        let out_key = snat_out_key(pkt, REMOTE_BE, bport);
        let out = dp.snat().get(&out_key, 0).expect("SNAT out entry");
        let in_key = snat_in_key(REMOTE_BE, bport, u16::from_be_bytes(out.port), pkt.proto());
        let inn = dp.snat().get(&in_key, 0).expect("SNAT in entry");
        assert!(snat_gc::is_pair(&out_key, &out, &in_key, &inn));
        assert_eq!(snat_gc::in_key_of_out(&out_key, &out), in_key);
        assert_eq!(snat_gc::out_key_of_in(&in_key, &inn), out_key);
        pairs.push((out_key, in_key));
    }
    assert_eq!(dp.snat().keys().count(), 6);

    // Age entries as if time had passed: the whole `idle` flow, and the `streaming` flow's
    // `out` entry only (the client went quiet, the backend keeps sending).
    // The GC runs with a clock 1,000 s past the datapath's (CLOCK_MONOTONIC), so the test does
    // not depend on the machine's uptime: every entry is re-stamped relative to it.
    let now = monotonic_ns() + 1_000_000_000_000;
    let aged = now - 200_000_000_000;
    for key in dp
        .snat()
        .keys()
        .map(|k| k.expect("SNAT key"))
        .collect::<Vec<_>>()
    {
        let mut v = dp.snat().get(&key, 0).expect("entry to stamp");
        v.last_seen_ns = now - 1_000_000_000;
        dp.snat().insert(key, v, 0).expect("stamp entry");
    }
    for key in [pairs[0].0, pairs[0].1, pairs[2].0] {
        let mut v = dp.snat().get(&key, 0).expect("entry to age");
        v.last_seen_ns = aged;
        dp.snat().insert(key, v, 0).expect("age entry");
    }

    let mut snat = Snat::from_ebpf(&mut dp.bpf).expect("SNAT map");
    let done = snat_gc::collect(&mut snat, now, &cfg);
    assert_eq!(
        done,
        Collected {
            flows: 1,
            orphans: 0,
            removed: 2,
            remaining: 4,
        }
    );
    assert!(snat.get(&pairs[0].0).is_none(), "idle flow's out entry");
    assert!(snat.get(&pairs[0].1).is_none(), "idle flow's in entry");
    for key in [pairs[1].0, pairs[1].1, pairs[2].0, pairs[2].1] {
        assert!(snat.get(&key).is_some(), "live entry {key:?} kept");
    }

    let uport = u16::from_be_bytes(pairs[2].1.dport);
    let reply = Pkt::udp(REMOTE_BE, 5353, NODE_IP, uport).payload(b"update");
    dp.check(ingress(
        "the backend's next datagram still goes back to the client",
        reply.bytes(),
        TC_NEXT,
        Expect::Packet(with_dst(&reply, EXT_CLIENT, 41_002)),
        &[(Counter::SnatReplyTranslated, 1)],
    ));
}

/// eTP=Cluster: like kube-proxy (which masquerades every flow to an external destination of
/// such a Service), an external client's flow is SNATed to the node even when the backend is
/// local; a pod inside the cluster CIDR keeps its address.
#[test]
fn nodeport_local_backend_is_masqueraded_for_external_clients_only() {
    let mut dp = nodeport_datapath_with(cluster_cidr_config());
    dp.set_node_addr(NODE_IP);
    let syn = Pkt::tcp(EXT_CLIENT, 41_000, NODE_IP, NODE_PORT + 1, SYN);
    let fwd = with_dst(&syn, LOCAL_BE, 8080);
    dp.check(ingress(
        "external client → nodeport with a local backend: DNAT + SNAT port allocated",
        syn.bytes(),
        TC_NEXT,
        Expect::Packet(fwd.clone()),
        &[
            (Counter::NewFlow, 1),
            (Counter::SnatNew, 1),
            (Counter::SnatPortKept, 1),
        ],
    ));
    let out = dp
        .snat()
        .get(&snat_out_key(&syn, LOCAL_BE, 8080), 0)
        .expect("SNAT out entry for the local backend");
    let nat_port = u16::from_be_bytes(out.port);
    assert_eq!(out.addr, NODE_IP.octets(), "SNAT to the node address");
    dp.check(egress(
        "toward the local backend: the node's address and port (the backend sees the node)",
        fwd.bytes(),
        TC_NEXT,
        Expect::Packet(with_src(&fwd, NODE_IP, nat_port)),
        &[(Counter::SnatTranslated, 1)],
    ));
    let synack = Pkt::tcp(LOCAL_BE, 8080, NODE_IP, nat_port, SYN | ACK);
    let unsnat = with_dst(&synack, EXT_CLIENT, 41_000);
    dp.check(ingress(
        "the local backend's SYN-ACK goes back to the client (destination restored)",
        synack.bytes(),
        TC_NEXT,
        Expect::Packet(unsnat.clone()),
        &[(Counter::SnatReplyTranslated, 1)],
    ));
    dp.check(egress(
        "toward the client: from the NodePort",
        unsnat.bytes(),
        TC_NEXT,
        Expect::Packet(with_src(&unsnat, NODE_IP, NODE_PORT + 1)),
        &[(Counter::ReplyTranslated, 1)],
    ));

    let pod_syn = Pkt::tcp(POD_CLIENT, 41_001, NODE_IP, NODE_PORT + 1, SYN);
    let pod_fwd = with_dst(&pod_syn, LOCAL_BE, 8080);
    dp.check(ingress(
        "pod in the cluster CIDR → the same nodeport: DNAT only",
        pod_syn.bytes(),
        TC_NEXT,
        Expect::Packet(pod_fwd.clone()),
        &[(Counter::NewFlow, 1)],
    ));
    dp.check(egress(
        "toward the local backend: the pod keeps its address",
        pod_fwd.bytes(),
        TC_NEXT,
        Expect::Unchanged,
        &[(Counter::ReplyNotTracked, 1)],
    ));
    let reply = pod_fwd.reversed();
    dp.check(egress(
        "local backend's reply toward the pod: from the NodePort",
        reply.bytes(),
        TC_NEXT,
        Expect::Packet(with_src(&reply, NODE_IP, NODE_PORT + 1)),
        &[(Counter::ReplyTranslated, 1)],
    ));
    assert_eq!(
        dp.snat().keys().count(),
        2,
        "one SNAT pair: the external client's flow only"
    );

    let syn = Pkt::tcp(EXT_CLIENT, 41_002, NODE_IP, NODE_PORT + 2, SYN);
    dp.check(ingress(
        "eTP=Local without local endpoints (some elsewhere): dropped, not rejected",
        syn.bytes(),
        TC_ACT_SHOT,
        Expect::Dropped,
        &[(Counter::DropNoLocalEndpoints, 1)],
    ));
    assert_eq!(dp.ct_len(), 4, "only the two nodeport flows are tracked");
}

/// The datapath's configuration with the cluster CIDR 10.244.0.0/16.
fn cluster_cidr_config() -> DatapathConfig {
    let mut cfg = DatapathConfig::DEFAULT;
    cfg.cluster_cidrs = ClusterCidrs {
        count: 1,
        ..ClusterCidrs::NONE
    };
    cfg.cluster_cidrs.prefixes[0] = Ipv4Prefix {
        addr: [10, 244, 0, 0],
        mask: [255, 255, 0, 0],
    };
    cfg
}

/// A pod on this node (inside the cluster CIDR 10.244.0.0/16).
const POD_CLIENT: Ipv4Addr = Ipv4Addr::new(10, 244, 1, 30);

/// `nodeport_datapath` loaded with the cluster CIDR 10.244.0.0/16 (or none), plus the
/// in-cluster entry of the eTP=Local NodePort NODE_IP:30082/TCP: one remote backend.
fn etp_local_datapath(cluster_cidr: bool) -> Datapath {
    let mut dp = Datapath::load_with(if cluster_cidr {
        cluster_cidr_config()
    } else {
        DatapathConfig::DEFAULT
    });
    dp.set_frontend(
        NODE_IP,
        NODE_PORT + 2,
        proto::TCP,
        service_flags::EXTERNAL | service_flags::EXTERNAL_LOCAL | service_flags::DROP_WHEN_EMPTY,
        &[],
    );
    dp.set_in_cluster_frontend(
        NODE_IP,
        NODE_PORT + 2,
        proto::TCP,
        &[(203, raw_backend(REMOTE_BE, 8080, proto::TCP, 0))],
    );
    dp.set_node_addr(NODE_IP);
    dp
}

#[test]
fn etp_local_in_cluster_clients_use_the_cluster_endpoints_outside_clients_are_dropped() {
    let mut dp = etp_local_datapath(true);
    let port = NODE_PORT + 2;

    let syn = Pkt::tcp(POD_CLIENT, 42_000, NODE_IP, port, SYN);
    let fwd = with_dst(&syn, REMOTE_BE, 8080);
    dp.check(ingress(
        "pod → eTP=Local NodePort without local endpoints: DNAT to the cluster endpoint, no SNAT",
        syn.bytes(),
        TC_NEXT,
        Expect::Packet(fwd.clone()),
        &[(Counter::NewFlow, 1)],
    ));
    let ct = dp.ct(&original_key(&syn)).expect("conntrack entry");
    assert_eq!(ct.rev_nat_id, 51, "the in-cluster entry's rev-NAT id");
    assert_eq!(
        (ct.frontend_addr, ct.frontend_port),
        (NODE_IP.octets(), port.to_be_bytes()),
        "replies appear to come from the NodePort"
    );
    dp.check(egress(
        "toward the remote backend: the pod's own address, like upstream (no masquerade)",
        fwd.bytes(),
        TC_NEXT,
        Expect::Packet(fwd.clone()),
        &[(Counter::ReplyNotTracked, 1)],
    ));
    // The backend answers the pod directly (pod CIDRs are routed); on its way into the pod the
    // reply is reverse-NATed from conntrack.
    let synack = Pkt::tcp(REMOTE_BE, 8080, POD_CLIENT, 42_000, SYN | ACK);
    dp.check(egress(
        "toward the pod: from the NodePort",
        synack.bytes(),
        TC_NEXT,
        Expect::Packet(with_src(&synack, NODE_IP, port)),
        &[(Counter::ReplyTranslated, 1)],
    ));
    let ack = Pkt::tcp(POD_CLIENT, 42_000, NODE_IP, port, ACK);
    dp.check(ingress(
        "established: DNAT from conntrack",
        ack.bytes(),
        TC_NEXT,
        Expect::Packet(with_dst(&ack, REMOTE_BE, 8080)),
        &[(Counter::EstablishedFlow, 1)],
    ));

    let outside = Pkt::tcp(EXT_CLIENT, 42_001, NODE_IP, port, SYN);
    dp.check(ingress(
        "external client → the same NodePort: dropped (no local endpoint)",
        outside.bytes(),
        TC_ACT_SHOT,
        Expect::Dropped,
        &[(Counter::DropNoLocalEndpoints, 1)],
    ));
    let other_cidr = Pkt::tcp(Ipv4Addr::new(10, 245, 0, 1), 42_002, NODE_IP, port, SYN);
    dp.check(ingress(
        "a source just outside the cluster CIDR is external",
        other_cidr.bytes(),
        TC_ACT_SHOT,
        Expect::Dropped,
        &[(Counter::DropNoLocalEndpoints, 1)],
    ));
}

#[test]
fn etp_local_without_a_cluster_cidr_treats_pods_as_external() {
    // Upstream: detectLocalMode ClusterCIDR without clusterCIDR detects no local traffic.
    let mut dp = etp_local_datapath(false);
    let syn = Pkt::tcp(POD_CLIENT, 42_100, NODE_IP, NODE_PORT + 2, SYN);
    dp.check(ingress(
        "pod → eTP=Local NodePort, no cluster CIDR configured: dropped",
        syn.bytes(),
        TC_ACT_SHOT,
        Expect::Dropped,
        &[(Counter::DropNoLocalEndpoints, 1)],
    ));
    assert_eq!(dp.ct_len(), 0);
}

/// Upstream's verdicts when a frontend has no backends: no usable endpoint anywhere is rejected
/// whatever the policy (eTP=Local included); a Local policy whose endpoints are all on other
/// nodes (the agent sets `DROP_WHEN_EMPTY`) is dropped (iTP=Local ClusterIP included).
#[test]
fn no_backends_rejected_unless_a_local_policy_is_served_elsewhere() {
    let mut dp = Datapath::load();
    dp.set_node_addr(NODE_IP);
    let ext_local = service_flags::EXTERNAL | service_flags::EXTERNAL_LOCAL;
    // eTP=Local NodePort, no endpoint on any node.
    dp.set_frontend(NODE_IP, NODE_PORT + 3, proto::TCP, ext_local, &[]);
    dp.set_frontend(NODE_IP, NODE_PORT + 3, proto::UDP, ext_local, &[]);
    // iTP=Local ClusterIP with endpoints on other nodes only.
    let itp_vip = Ipv4Addr::new(10, 96, 0, 88);
    dp.set_frontend(itp_vip, 80, proto::TCP, service_flags::DROP_WHEN_EMPTY, &[]);
    dp.set_frontend(itp_vip, 53, proto::UDP, service_flags::DROP_WHEN_EMPTY, &[]);
    // iTP=Local ClusterIP with no endpoint anywhere.
    let empty_vip = Ipv4Addr::new(10, 96, 0, 89);
    dp.set_frontend(empty_vip, 80, proto::TCP, 0, &[]);

    let rejected = [(Counter::NoEndpointsRejected, 1)];
    for (what, pkt) in [
        (
            "eTP=Local NodePort, no endpoints anywhere: TCP rejected",
            Pkt::tcp(EXT_CLIENT, 43_000, NODE_IP, NODE_PORT + 3, SYN),
        ),
        (
            "eTP=Local NodePort, no endpoints anywhere: UDP rejected",
            Pkt::udp(EXT_CLIENT, 43_001, NODE_IP, NODE_PORT + 3),
        ),
        (
            "iTP=Local ClusterIP, no endpoints anywhere: rejected",
            Pkt::tcp(POD_CLIENT, 43_002, empty_vip, 80, SYN),
        ),
    ] {
        dp.check(ingress(
            what,
            pkt.bytes(),
            TC_ACT_REDIRECT,
            Expect::IcmpUnreachable,
            &rejected,
        ));
    }
    let dropped = [(Counter::DropNoLocalEndpoints, 1)];
    for (what, pkt) in [
        (
            "iTP=Local ClusterIP served by other nodes only: TCP dropped",
            Pkt::tcp(POD_CLIENT, 43_003, itp_vip, 80, SYN),
        ),
        (
            "iTP=Local ClusterIP served by other nodes only: UDP dropped",
            Pkt::udp(POD_CLIENT, 43_004, itp_vip, 53),
        ),
    ] {
        dp.check(ingress(
            what,
            pkt.bytes(),
            TC_ACT_SHOT,
            Expect::Dropped,
            &dropped,
        ));
    }
    assert_eq!(dp.ct_len(), 0, "no verdict here creates conntrack entries");
}

/// Upstream nftables' cluster-ips-check: a new flow to an allocated ClusterIP on a port none of
/// its Services has is rejected; to an unallocated address inside the Service CIDRs, dropped;
/// instead of being passed on to the node's routing (and its default route).
#[test]
fn service_cidr_misses_are_rejected_on_cluster_ips_and_dropped_elsewhere() {
    let mut dp = Datapath::load().with_services();
    {
        let mut cidrs: LpmTrie<&mut MapData, [u8; 4], u32> =
            LpmTrie::try_from(dp.bpf.map_mut(MAP_SERVICE_CIDRS).expect("SVCCIDRS map"))
                .expect("SVCCIDRS type");
        cidrs
            .insert(&Key::new(12, [10, 96, 0, 0]), service_cidr::UNALLOCATED, 0)
            .expect("insert the Service CIDR");
        for vip in [VIP, VIP_EMPTY] {
            cidrs
                .insert(&Key::new(32, vip.octets()), service_cidr::CLUSTER_IP, 0)
                .expect("insert a ClusterIP");
        }
    }
    let rejected = [(Counter::ClusterIpPortRejected, 1)];
    for (what, pkt) in [
        (
            "TCP to a ClusterIP on a port no Service has: rejected",
            Pkt::tcp(CLIENT, 44_000, VIP, 81, SYN),
        ),
        (
            "UDP to a ClusterIP on a port no Service has: rejected",
            Pkt::udp(CLIENT, 44_001, VIP, 54),
        ),
    ] {
        dp.check(ingress(
            what,
            pkt.bytes(),
            TC_ACT_REDIRECT,
            Expect::IcmpUnreachable,
            &rejected,
        ));
    }
    let dropped = [(Counter::DropUnallocatedServiceIp, 1)];
    for (what, pkt) in [
        (
            "TCP to an unallocated address of the Service CIDR: dropped",
            Pkt::tcp(CLIENT, 44_002, Ipv4Addr::new(10, 100, 3, 4), 80, SYN),
        ),
        (
            "UDP to an unallocated address of the Service CIDR: dropped",
            Pkt::udp(CLIENT, 44_003, Ipv4Addr::new(10, 96, 0, 11), 53),
        ),
    ] {
        dp.check(ingress(
            what,
            pkt.bytes(),
            TC_ACT_SHOT,
            Expect::Dropped,
            &dropped,
        ));
    }
    let syn = Pkt::tcp(CLIENT, 44_004, VIP, 80, SYN);
    let id = expected_pick(&syn, &[1, 2]);
    dp.check(ingress(
        "the ClusterIP's Service port is translated as before",
        syn.bytes(),
        TC_NEXT,
        Expect::Packet(dnated(&syn, id)),
        &[(Counter::NewFlow, 1)],
    ));
    dp.check(ingress(
        "outside the Service CIDRs: passed untouched",
        Pkt::tcp(CLIENT, 44_005, Ipv4Addr::new(10, 112, 0, 1), 80, SYN).bytes(),
        TC_NEXT,
        Expect::Unchanged,
        &[(Counter::NotService, 1)],
    ));
    let translated = dp
        .conntrack()
        .iter()
        .map(|e| e.expect("conntrack entry"))
        .filter(|(_, v)| v.flags & ct_flags::DIRECT == 0)
        .count();
    assert_eq!(
        translated, 2,
        "only the Service flow is translated (the pass-through flow is a DIRECT marker)"
    );
    assert_eq!(
        dp.ct_len(),
        3,
        "the two Service entries and one DIRECT marker"
    );
}

#[test]
fn hairpin_flow_is_snated_to_the_link_local_address() {
    let mut dp = Datapath::load();
    let vip = Ipv4Addr::new(10, 96, 0, 77);
    dp.set_frontend(
        vip,
        80,
        proto::TCP,
        0,
        &[(
            210,
            raw_backend(CLIENT, 8080, proto::TCP, backend_flags::LOCAL),
        )],
    );
    let hairpin = Ipv4Addr::from(HAIRPIN_SNAT_ADDR);
    let syn = Pkt::tcp(CLIENT, 42_000, vip, 80, SYN);
    let fwd = with_dst(&syn, CLIENT, 8080);
    dp.check(ingress(
        "pod to its own Service, picked as its own backend: DNAT + hairpin SNAT port",
        syn.bytes(),
        TC_NEXT,
        Expect::Packet(fwd.clone()),
        &[(Counter::NewFlow, 1), (Counter::HairpinSnat, 1)],
    ));
    let out = dp
        .snat()
        .get(&snat_out_key(&syn, CLIENT, 8080), 0)
        .expect("hairpin out entry");
    assert_eq!(out.addr, HAIRPIN_SNAT_ADDR, "hairpin source");
    let port = u16::from_be_bytes(out.port);
    dp.check(egress(
        "back toward the pod: source becomes the link-local address",
        fwd.bytes(),
        TC_NEXT,
        Expect::Packet(with_src(&fwd, hairpin, port)),
        &[(Counter::SnatTranslated, 1)],
    ));
    let synack = Pkt::tcp(CLIENT, 8080, hairpin, port, SYN | ACK);
    let back = with_dst(&synack, CLIENT, 42_000);
    dp.check(ingress(
        "the pod answers the link-local address: destination restored",
        synack.bytes(),
        TC_NEXT,
        Expect::Packet(back.clone()),
        &[(Counter::SnatReplyTranslated, 1)],
    ));
    dp.check(egress(
        "toward the pod as client: from the VIP",
        back.bytes(),
        TC_NEXT,
        Expect::Packet(with_src(&back, vip, 80)),
        &[(Counter::ReplyTranslated, 1)],
    ));
}

#[test]
fn load_balancer_source_ranges_drop_new_flows_from_outside() {
    let mut dp = Datapath::load();
    let lb = Ipv4Addr::new(192, 168, 70, 10);
    dp.set_frontend(
        lb,
        80,
        proto::TCP,
        service_flags::EXTERNAL | service_flags::SOURCE_RANGES,
        &[(
            220,
            raw_backend(LOCAL_BE, 8080, proto::TCP, backend_flags::LOCAL),
        )],
    );
    {
        let mut ranges: LpmTrie<&mut MapData, SourceRangeKey, u32> =
            LpmTrie::try_from(dp.bpf.map_mut(MAP_SOURCE_RANGES).expect("SRCRANGES map"))
                .expect("SRCRANGES type");
        let key = SourceRangeKey {
            frontend_addr: lb.octets(),
            frontend_port: 80u16.to_be_bytes(),
            proto: proto::TCP,
            _pad: 0,
            source: [192, 168, 50, 96],
        };
        ranges
            .insert(&Key::new(SOURCE_RANGE_FRONTEND_BITS + 29, key), 1, 0)
            .expect("insert range");
    }
    let inside = Pkt::tcp(EXT_CLIENT, 43_000, lb, 80, SYN);
    dp.check(ingress(
        "LB IP from inside loadBalancerSourceRanges (192.168.50.96/29): DNAT",
        inside.bytes(),
        TC_NEXT,
        Expect::Packet(with_dst(&inside, LOCAL_BE, 8080)),
        // eTP=Cluster from outside the cluster: masquerade wanted, no node address written here.
        &[(Counter::NewFlow, 1), (Counter::SnatNoNodeAddr, 1)],
    ));
    let outside = Pkt::tcp(Ipv4Addr::new(192, 168, 50, 104), 43_000, lb, 80, SYN);
    dp.check(ingress(
        "LB IP from outside the ranges: dropped and counted",
        outside.bytes(),
        TC_ACT_SHOT,
        Expect::Dropped,
        &[(Counter::DropSourceRange, 1)],
    ));
    let other_port = Pkt::tcp(EXT_CLIENT, 43_001, lb, 81, SYN);
    dp.check(ingress(
        "ranges belong to their frontend: another port of the address is no Service here",
        other_port.bytes(),
        TC_NEXT,
        Expect::Unchanged,
        &[(Counter::NotService, 1)],
    ));
}

/// An ICMP port unreachable from `src` to `dst` quoting the whole IPv4 packet of `quoted`.
fn icmp_error(src: Ipv4Addr, dst: Ipv4Addr, quoted: &Pkt) -> Vec<u8> {
    let q = quoted.bytes();
    let mut icmp = vec![3, 3, 0, 0, 0, 0, 0, 0];
    icmp.extend_from_slice(&q[14..]);
    let c = proxy_common::csum::fold(proxy_common::csum::sum(&icmp, 0)).to_be_bytes();
    icmp[2..4].copy_from_slice(&c);
    let len = (20 + icmp.len()) as u16;
    let mut ip = vec![0x45, 0xc0, 0, 0, 0, 0, 0, 0, 64, proto::ICMP, 0, 0];
    ip[2..4].copy_from_slice(&len.to_be_bytes());
    ip.extend_from_slice(&src.octets());
    ip.extend_from_slice(&dst.octets());
    let c = proxy_common::csum::ipv4_header(&ip).to_be_bytes();
    ip[10..12].copy_from_slice(&c);
    let mut frame = eth(HOST_MAC, CLIENT_MAC, 0x0800);
    frame.extend_from_slice(&ip);
    frame.extend_from_slice(&icmp);
    frame
}

/// A NodePort datagram from the external client's `sport` to the remote backend (SNATed):
/// the datapath and the node port it left with.
fn snated_nodeport_datagram(sport: u16) -> (Datapath, u16) {
    let mut dp = nodeport_datapath();
    dp.set_node_addr(NODE_IP);
    let dgram = Pkt::udp(EXT_CLIENT, sport, NODE_IP, NODE_PORT).payload(b"ping");
    dp.run(PROG_TC_INGRESS, &dgram.bytes());
    let port = u16::from_be_bytes(
        dp.snat()
            .get(&snat_out_key(&dgram, REMOTE_BE, 5353), 0)
            .expect("out entry")
            .port,
    );
    (dp, port)
}

/// `frame` through `prog` passes on unchanged.
fn passes_untouched(dp: &Datapath, prog: &str, frame: &[u8], what: &str) {
    let (verdict, out) = dp.run(prog, frame);
    assert_eq!(
        (verdict, out.as_slice()),
        (TC_NEXT, frame),
        "{what}: passes untouched"
    );
}

/// Runs `prog` over an ICMP error and checks: verdict OK, one `icmp_error_translated`, valid
/// outer/ICMP/quoted-IPv4 checksums, and the outer and quoted addresses/ports.
fn check_icmp_translation(
    dp: &Datapath,
    what: &str,
    prog: &str,
    input: &[u8],
    outer: (Ipv4Addr, Ipv4Addr),
    quoted: ((Ipv4Addr, u16), (Ipv4Addr, u16)),
) -> Vec<u8> {
    let before = dp.counter(Counter::IcmpErrorTranslated);
    let (verdict, out) = dp.run(prog, input);
    assert_eq!(verdict, TC_NEXT, "{what}: verdict");
    assert_eq!(
        dp.counter(Counter::IcmpErrorTranslated) - before,
        1,
        "{what}: counted"
    );
    let d = Decoded::parse(&out);
    assert!(d.ip_csum_ok(), "{what}: outer IPv4 checksum");
    assert!(d.l4_csum_ok(), "{what}: ICMP checksum");
    assert_eq!((d.saddr, d.daddr), outer, "{what}: outer addresses");
    let inner = &d.l4[8..];
    assert_eq!(
        proxy_common::csum::ipv4_header(&inner[..20]),
        0,
        "{what}: quoted IPv4 checksum"
    );
    let addr = |o: usize| Ipv4Addr::new(inner[o], inner[o + 1], inner[o + 2], inner[o + 3]);
    let port = |o: usize| u16::from_be_bytes([inner[20 + o], inner[21 + o]]);
    assert_eq!(
        ((addr(12), port(0)), (addr(16), port(2))),
        quoted,
        "{what}: quoted source and destination"
    );
    assert_eq!(out.len(), input.len(), "{what}: length unchanged");
    out
}

#[test]
fn icmp_errors_about_translated_flows_are_reverse_translated() {
    // ClusterIP: the backend's port unreachable to the client comes from the VIP and quotes it.
    let dp = Datapath::load().with_services();
    let dgram = Pkt::udp(CLIENT, 5000, VIP, 53).payload(b"query");
    let id = expected_pick(&dgram, &[11, 12]);
    dp.run(PROG_TC_INGRESS, &dgram.bytes());
    let (be, be_port) = backend_addr(id);
    let err = icmp_error(be, CLIENT, &dnated(&dgram, id));
    check_icmp_translation(
        &dp,
        "ClusterIP: ICMP from the backend toward the client",
        PROG_TC_EGRESS,
        &err,
        (VIP, CLIENT),
        ((CLIENT, 5000), (VIP, 53)),
    );
    let stray = icmp_error(be, CLIENT, &Pkt::udp(CLIENT, 5001, be, be_port));
    passes_untouched(
        &dp,
        PROG_TC_EGRESS,
        &stray,
        "an error about no tracked flow",
    );

    // NodePort with SNAT: the remote backend's error reaches node A (ingress), goes on to the
    // client quoting client → backend, and leaves (egress) from the NodePort quoting it.
    let (dp, port) = snated_nodeport_datagram(5000);
    let quoted = Pkt::udp(NODE_IP, port, REMOTE_BE, 5353).payload(b"ping");
    let err = icmp_error(REMOTE_BE, NODE_IP, &quoted);
    let mid = check_icmp_translation(
        &dp,
        "SNAT: ICMP from the remote backend, ingress on node A",
        PROG_TC_INGRESS,
        &err,
        (REMOTE_BE, EXT_CLIENT),
        ((EXT_CLIENT, 5000), (REMOTE_BE, 5353)),
    );
    check_icmp_translation(
        &dp,
        "SNAT: the same error, egress toward the client",
        PROG_TC_EGRESS,
        &mid,
        (NODE_IP, EXT_CLIENT),
        ((EXT_CLIENT, 5000), (NODE_IP, NODE_PORT)),
    );
}

/// An error about a reply on its way back to the client (a router on the client's side, or the
/// client), quoting frontend:port → client as the reply left the node, goes on to the backend
/// quoting the reply as the backend sent it: backend:port → client for a ClusterIP flow,
/// backend:port → the node's SNAT address and port for a SNATed NodePort flow (netfilter's
/// RELATED handling; a Fragmentation Needed so reaches the backend and PMTU discovery works).
#[test]
fn icmp_errors_about_replies_go_on_to_the_backend() {
    let router = Ipv4Addr::new(192, 168, 50, 254);
    let dp = Datapath::load().with_services();
    let dgram = Pkt::udp(CLIENT, 5000, VIP, 53).payload(b"query");
    let id = expected_pick(&dgram, &[11, 12]);
    dp.run(PROG_TC_INGRESS, &dgram.bytes());
    let (be, be_port) = backend_addr(id);
    let reply = Pkt::udp(VIP, 53, CLIENT, 5000).payload(b"answer");
    check_icmp_translation(
        &dp,
        "ClusterIP: an error about the reply, to the backend",
        PROG_TC_INGRESS,
        &icmp_error(router, VIP, &reply),
        (router, be),
        ((be, be_port), (CLIENT, 5000)),
    );
    let stray = icmp_error(router, VIP, &Pkt::udp(VIP, 53, CLIENT, 5001));
    passes_untouched(
        &dp,
        PROG_TC_INGRESS,
        &stray,
        "an error about no tracked flow",
    );

    let (dp, port) = snated_nodeport_datagram(5100);
    let reply = Pkt::udp(NODE_IP, NODE_PORT, EXT_CLIENT, 5100).payload(b"pong");
    check_icmp_translation(
        &dp,
        "SNATed NodePort: an error about the reply, to the remote backend",
        PROG_TC_INGRESS,
        &icmp_error(router, NODE_IP, &reply),
        (router, REMOTE_BE),
        ((REMOTE_BE, 5353), (NODE_IP, port)),
    );
}

/// Found by the packet fuzz (`fuzz_packets`): an ICMP error whose IPv4 total length ends before
/// the quoted ports (the bytes after it, a trailer or padding, are not part of the packet, and its
/// ICMP checksum does not cover them) passes untouched; translating it rewrote those bytes and
/// adjusted the checksum for them, so the ICMP checksum over the real packet no longer verified.
#[test]
fn icmp_error_whose_quoted_ports_lie_beyond_the_ip_total_length_passes_untouched() {
    let dp = Datapath::load().with_services();
    let dgram = Pkt::udp(CLIENT, 5002, VIP, 53).payload(b"query");
    let id = expected_pick(&dgram, &[11, 12]);
    dp.run(PROG_TC_INGRESS, &dgram.bytes());
    let (be, _) = backend_addr(id);
    let mut err = icmp_error(be, CLIENT, &dnated(&dgram, id));
    // The IPv4 packet as sent ends after the quoted IPv4 header (ICMP checksum over these 28
    // bytes, header checksum right); the quoted ports follow as trailing bytes of the frame.
    let icmp_end = ETH_HLEN + 20 + 8 + 20;
    let tot_len = (icmp_end - ETH_HLEN) as u16;
    err[ETH_HLEN + 2..ETH_HLEN + 4].copy_from_slice(&tot_len.to_be_bytes());
    err[ETH_HLEN + 10..ETH_HLEN + 12].copy_from_slice(&[0, 0]);
    let c = proxy_common::csum::ipv4_header(&err[ETH_HLEN..ETH_HLEN + 20]).to_be_bytes();
    err[ETH_HLEN + 10..ETH_HLEN + 12].copy_from_slice(&c);
    let icmp = ETH_HLEN + 20;
    err[icmp + 2..icmp + 4].copy_from_slice(&[0, 0]);
    let c = proxy_common::csum::fold(proxy_common::csum::sum(&err[icmp..icmp_end], 0));
    err[icmp + 2..icmp + 4].copy_from_slice(&c.to_be_bytes());
    let (verdict, out) = dp.run(PROG_TC_EGRESS, &err);
    assert_eq!(verdict, TC_NEXT, "verdict");
    let d = Decoded::parse(&out);
    assert!(
        d.l4_csum_ok(),
        "the ICMP checksum over the IPv4 packet still verifies"
    );
    assert_eq!(out, err, "passed untouched");
}

/// Per-packet cost of the NodePort path with SNAT (medians of single runs, never asserted), next
/// to the ClusterIP path measured the same way.
#[test]
fn per_packet_cost_nodeport_snat() {
    let mut dp = nodeport_datapath().with_services();
    dp.set_node_addr(NODE_IP);
    const RUNS: u16 = 2_000;
    let single = |dp: &Datapath, prog: &str, pkt: &[u8]| {
        let (verdict, _, d) = dp.run_timed(prog, pkt, 1);
        assert_eq!(verdict, TC_NEXT, "{prog} verdict");
        d
    };
    let new: Vec<Duration> = (0..RUNS)
        .map(|i| {
            let p = Pkt::tcp(EXT_CLIENT, 10_000 + i, NODE_IP, NODE_PORT, SYN);
            single(&dp, PROG_TC_INGRESS, &p.bytes())
        })
        .collect();
    let snat_new = dp.counter(Counter::SnatNew);
    assert_eq!(snat_new, u64::from(RUNS), "every new flow was SNATed");

    let syn = Pkt::tcp(EXT_CLIENT, 10_000, NODE_IP, NODE_PORT, SYN);
    let nat_port = u16::from_be_bytes(
        dp.snat()
            .get(&snat_out_key(&syn, REMOTE_BE, 8080), 0)
            .expect("out entry")
            .port,
    );
    let ack = Pkt::tcp(EXT_CLIENT, 10_000, NODE_IP, NODE_PORT, ACK).payload(&[0; 64]);
    let fwd = with_dst(&ack, REMOTE_BE, 8080).bytes();
    let reply = Pkt::tcp(REMOTE_BE, 8080, NODE_IP, nat_port, ACK).payload(&[0; 64]);
    let unsnat = with_dst(&reply, EXT_CLIENT, 10_000).bytes();
    let (ack, reply) = (ack.bytes(), reply.bytes());
    let mut established = Vec::new();
    let mut replies = Vec::new();
    for _ in 0..RUNS {
        established.push(single(&dp, PROG_TC_INGRESS, &ack) + single(&dp, PROG_TC_EGRESS, &fwd));
        replies.push(single(&dp, PROG_TC_INGRESS, &reply) + single(&dp, PROG_TC_EGRESS, &unsnat));
    }
    assert_eq!(dp.counter(Counter::SnatTranslated), u64::from(RUNS));
    assert_eq!(dp.counter(Counter::SnatReplyTranslated), u64::from(RUNS));

    // ClusterIP, same method: new flows, established ingress + untracked egress, reply egress.
    let cluster_new: Vec<Duration> = (0..RUNS)
        .map(|i| {
            let p = Pkt::tcp(CLIENT, 10_000 + i, VIP, 80, SYN);
            single(&dp, PROG_TC_INGRESS, &p.bytes())
        })
        .collect();
    let c_ack = Pkt::tcp(CLIENT, 10_000, VIP, 80, ACK).payload(&[0; 64]);
    let c_id = expected_pick(&c_ack, &[1, 2]);
    let c_fwd = dnated(&c_ack, c_id).bytes();
    let c_reply = reply_from(&c_ack, c_id).bytes();
    let c_ack = c_ack.bytes();
    let mut cluster_established = Vec::new();
    let mut cluster_reply = Vec::new();
    for _ in 0..RUNS {
        cluster_established
            .push(single(&dp, PROG_TC_INGRESS, &c_ack) + single(&dp, PROG_TC_EGRESS, &c_fwd));
        cluster_reply.push(single(&dp, PROG_TC_EGRESS, &c_reply));
    }
    println!(
        "per-packet cost: nodeport_snat_new_ns={} nodeport_snat_established_ns={} nodeport_snat_reply_ns={} \
         (single-run medians; established = ingress DNAT + egress SNAT, reply = ingress un-SNAT + egress reverse DNAT)",
        median(new),
        median(established),
        median(replies)
    );
    println!(
        "per-packet cost, same method: clusterip_new_ns={} clusterip_established_ns={} clusterip_reply_ns={} \
         (established = ingress DNAT + egress untracked lookup, reply = egress reverse DNAT)",
        median(cluster_new),
        median(cluster_established),
        median(cluster_reply)
    );
}

/// A second ClusterIP whose Services select the same pods as `VIP`'s.
const VIP2: Ipv4Addr = Ipv4Addr::new(10, 96, 0, 11);
const VIP2_TCP_REVNAT: u32 = 5;
const VIP2_UDP_REVNAT: u32 = 6;

/// The source port the datapath moves a clashing flow to when the first probe is free: the
/// flow-hash start in `CLASH_PORT_MIN..=CLASH_PORT_MAX` (proxy-ebpf `conntrack::choose_sport`).
fn clash_port(p: &Pkt) -> u16 {
    clash_probe(p, 0)
}

/// The `n`-th source port the clash probe of `p`'s flow tries.
fn clash_probe(p: &Pkt, n: u32) -> u16 {
    let hash = flow_hash(
        DatapathConfig::DEFAULT.hash_seed,
        p.saddr.octets(),
        p.daddr.octets(),
        p.sport().to_be_bytes(),
        p.dport().to_be_bytes(),
        p.proto(),
    );
    PortProbe::new(hash, CLASH_PORT_MIN, CLASH_PORT_MAX).port(n)
}

fn with_dport(p: &Pkt, port: u16) -> Pkt {
    let mut q = p.clone();
    set_ports(&mut q, p.sport(), port);
    q
}

fn with_sport(p: &Pkt, port: u16) -> Pkt {
    let mut q = p.clone();
    set_ports(&mut q, port, p.dport());
    q
}

fn two_frontends_one_backend() -> Datapath {
    let mut dp = Datapath::load();
    dp.set_service(VIP, 80, proto::TCP, TCP_REVNAT, &[1]);
    dp.set_service(VIP2, 80, proto::TCP, VIP2_TCP_REVNAT, &[1]);
    dp.set_service(VIP, 53, proto::UDP, UDP_REVNAT, &[11]);
    dp.set_service(VIP2, 53, proto::UDP, VIP2_UDP_REVNAT, &[11]);
    dp
}

/// A REPLY entry another flow took after ours was evicted (the tuple looked free) is never
/// moved by our packets: the first flow's FIN, a state change that reaches its REPLY entry,
/// leaves the second flow's entry at that key as it was.
#[test]
fn a_flow_never_moves_a_reply_entry_another_flow_took_after_its_own_was_evicted() {
    let mut dp = two_frontends_one_backend();
    let a = Pkt::tcp(CLIENT, 40_100, VIP, 80, SYN);
    dp.run(PROG_TC_INGRESS, &a.bytes());
    dp.conntrack()
        .remove(&reply_key(&a, 1))
        .expect("evict the first flow's REPLY");
    let b = Pkt::tcp(CLIENT, 40_100, VIP2, 80, SYN);
    dp.run(PROG_TC_INGRESS, &b.bytes());
    let held = dp.ct(&reply_key(&b, 1)).expect("the second flow's REPLY");
    assert_eq!(
        held.frontend_addr,
        VIP2.octets(),
        "test setup: the second flow took the freed tuple"
    );
    let fin = Pkt::tcp(CLIENT, 40_100, VIP, 80, FIN | ACK);
    dp.run(PROG_TC_INGRESS, &fin.bytes());
    assert_eq!(
        dp.ct(&reply_key(&b, 1)),
        Some(held),
        "the first flow's FIN must leave the second flow's REPLY entry as it was"
    );
}

#[test]
fn one_client_port_through_two_frontends_to_one_backend_gets_unique_reply_tuples() {
    let mut dp = two_frontends_one_backend();
    let a = Pkt::tcp(CLIENT, 40_000, VIP, 80, SYN);
    dp.check(ingress(
        "first flow: DNAT, the client's own port",
        a.bytes(),
        TC_NEXT,
        Expect::Packet(dnated(&a, 1)),
        &[(Counter::NewFlow, 1)],
    ));
    let b = Pkt::tcp(CLIENT, 40_000, VIP2, 80, SYN);
    let moved = clash_port(&b);
    dp.check(ingress(
        "same client port, other VIP, same backend: DNAT and another source port",
        b.bytes(),
        TC_NEXT,
        Expect::Packet(with_sport(&dnated(&b, 1), moved)),
        &[(Counter::NewFlow, 1), (Counter::ReplyTupleRemapped, 1)],
    ));
    let ct = dp.ct(&original_key(&b)).expect("second flow's ORIGINAL");
    assert_eq!(ct.flags & ct_flags::SPORT_NAT, ct_flags::SPORT_NAT);
    assert_eq!(u16::from_be_bytes(ct.nat_sport), moved);
    let first = dp
        .ct(&reply_key(&a, 1))
        .expect("first flow's REPLY untouched");
    assert_eq!(
        first.frontend_addr,
        VIP.octets(),
        "first flow's REPLY still its own"
    );

    // Each backend reply goes to its own flow: source = its VIP, destination = the client port.
    let reply_b = with_dport(&reply_from(&b, 1), moved);
    dp.check(egress(
        "reply on the moved port: from VIP2:80, back to the client's own port",
        reply_b.bytes(),
        TC_NEXT,
        Expect::Packet(with_dport(&rev_natted(&reply_b, &b), 40_000)),
        &[(Counter::ReplyTranslated, 1)],
    ));
    let reply_a = reply_from(&a, 1);
    dp.check(egress(
        "reply on the client's port: from VIP:80",
        reply_a.bytes(),
        TC_NEXT,
        Expect::Packet(rev_natted(&reply_a, &a)),
        &[(Counter::ReplyTranslated, 1)],
    ));
    let ack_b = Pkt::tcp(CLIENT, 40_000, VIP2, 80, ACK);
    dp.check(ingress(
        "the second flow's next packet keeps the moved port",
        ack_b.bytes(),
        TC_NEXT,
        Expect::Packet(with_sport(&dnated(&ack_b, 1), moved)),
        &[(Counter::EstablishedFlow, 1)],
    ));

    // Ending the second flow never removes the first one's entries.
    let rst_b = Pkt::tcp(CLIENT, 40_000, VIP2, 80, RST | ACK);
    dp.run(PROG_TC_INGRESS, &rst_b.bytes());
    dp.set_service(VIP2, 80, proto::TCP, VIP2_TCP_REVNAT, &[]);
    dp.run(
        PROG_TC_INGRESS,
        &Pkt::tcp(CLIENT, 40_000, VIP2, 80, SYN).bytes(),
    );
    assert!(
        dp.ct(&reply_key(&a, 1))
            .is_some_and(|v| v.frontend_addr == VIP.octets()),
        "the first flow's REPLY entry survives the second flow's end"
    );
    dp.check(egress(
        "the first flow still answers from VIP:80",
        reply_a.bytes(),
        TC_NEXT,
        Expect::Packet(rev_natted(&reply_a, &a)),
        &[(Counter::ReplyTranslated, 1)],
    ));
}

/// One client's flows through a VIP hold a block of consecutive reply tuples (the kernel hands
/// out ports in sequence). A clashing flow whose probe starts inside that block must still find
/// a free port: a walk over consecutive ports found 16 held ones there and dropped the SYN
/// (`drop_reply_tuple_exhausted`; the netns clash test lost 1 connection in ~150 runs to it).
#[test]
fn a_clash_probe_starting_in_a_block_of_held_consecutive_ports_still_finds_a_free_one() {
    let mut dp = two_frontends_one_backend();
    let b = Pkt::tcp(CLIENT, 45_000, VIP, 80, SYN);
    let first = clash_probe(&b, 0);
    let range = (CLASH_PORT_MAX - CLASH_PORT_MIN) as u32 + 1;
    let block: Vec<u16> = (0..64u32)
        .map(|k| ((first - CLASH_PORT_MIN) as u32 + k) % range)
        .map(|off| (CLASH_PORT_MIN as u32 + off) as u16)
        .filter(|&port| port != 45_000)
        .collect();
    for &port in &block {
        let a = Pkt::tcp(CLIENT, port, VIP2, 80, SYN);
        dp.check(ingress(
            "a VIP2 flow from a port of the block, with its own port",
            a.bytes(),
            TC_NEXT,
            Expect::Packet(dnated(&a, 1)),
            &[(Counter::NewFlow, 1)],
        ));
    }
    let c = Pkt::tcp(CLIENT, 45_000, VIP2, 80, SYN);
    dp.check(ingress(
        "VIP2 flow from 45000",
        c.bytes(),
        TC_NEXT,
        Expect::Packet(dnated(&c, 1)),
        &[(Counter::NewFlow, 1)],
    ));
    let free = (1..CLASH_PROBES)
        .map(|n| clash_probe(&b, n))
        .find(|port| *port != 45_000 && !block.contains(port))
        .expect("a probe outside the block");
    dp.check(ingress(
        "VIP flow from 45000: its tuple and the block are held, a probe outside is free",
        b.bytes(),
        TC_NEXT,
        Expect::Packet(with_sport(&dnated(&b, 1), free)),
        &[(Counter::NewFlow, 1), (Counter::ReplyTupleRemapped, 1)],
    ));
    assert_eq!(dp.counter(Counter::DropReplyTupleExhausted), 0);
}

/// A clash probe that reaches the REPLY key of another client port's live flow to the same
/// frontend and backend must treat it as taken, never as "our own entry" to overwrite: that
/// would send the other flow's replies to this flow's client port (the other connection then
/// never completes: its SYN-ACKs reach the wrong socket).
#[test]
fn a_clash_probe_never_takes_the_reply_tuple_of_another_port_s_flow_to_the_same_frontend() {
    let mut dp = two_frontends_one_backend();
    let b = Pkt::tcp(CLIENT, 45_000, VIP, 80, SYN);
    let probed = clash_probe(&b, 0);
    assert_ne!(probed, 45_000);
    // Through VIP2, client port 45000 holds the reply tuple (backend 1 → client:45000).
    let c = Pkt::tcp(CLIENT, 45_000, VIP2, 80, SYN);
    dp.check(ingress(
        "VIP2 flow from 45000",
        c.bytes(),
        TC_NEXT,
        Expect::Packet(dnated(&c, 1)),
        &[(Counter::NewFlow, 1)],
    ));
    // Through VIP, from the port b's first probe will try, with its own port.
    let a = Pkt::tcp(CLIENT, probed, VIP, 80, SYN);
    dp.check(ingress(
        "VIP flow from the probed port",
        a.bytes(),
        TC_NEXT,
        Expect::Packet(dnated(&a, 1)),
        &[(Counter::NewFlow, 1)],
    ));
    let next = (1..CLASH_PROBES)
        .map(|n| clash_probe(&b, n))
        .find(|&port| port != 45_000 && port != probed)
        .expect("a later probe");
    dp.check(ingress(
        "VIP flow from 45000: its own tuple and its first probe are held, the next probe is free",
        b.bytes(),
        TC_NEXT,
        Expect::Packet(with_sport(&dnated(&b, 1), next)),
        &[(Counter::NewFlow, 1), (Counter::ReplyTupleRemapped, 1)],
    ));
    let reply_a = reply_from(&a, 1);
    dp.check(egress(
        "the probed port's flow still gets its own replies",
        reply_a.bytes(),
        TC_NEXT,
        Expect::Packet(rev_natted(&reply_a, &a)),
        &[(Counter::ReplyTranslated, 1)],
    ));
    let reply_b = with_dport(&reply_from(&b, 1), next);
    dp.check(egress(
        "the moved flow's replies go back to 45000",
        reply_b.bytes(),
        TC_NEXT,
        Expect::Packet(with_dport(&rev_natted(&reply_b, &b), 45_000)),
        &[(Counter::ReplyTranslated, 1)],
    ));
}

#[test]
fn udp_datagrams_alternating_between_two_vips_come_back_from_the_right_one() {
    let mut dp = two_frontends_one_backend();
    let q1 = Pkt::udp(CLIENT, 41_000, VIP, 53).payload(b"q1");
    let q2 = Pkt::udp(CLIENT, 41_000, VIP2, 53).payload(b"q2");
    let moved = clash_port(&q2);
    for round in 0..3 {
        dp.check(ingress(
            "to VIP",
            q1.bytes(),
            TC_NEXT,
            Expect::Packet(dnated(&q1, 11)),
            &[(
                if round == 0 {
                    Counter::NewFlow
                } else {
                    Counter::EstablishedFlow
                },
                1,
            )],
        ));
        let counters: &[(Counter, u64)] = if round == 0 {
            &[(Counter::NewFlow, 1), (Counter::ReplyTupleRemapped, 1)]
        } else {
            &[(Counter::EstablishedFlow, 1)]
        };
        dp.check(ingress(
            "to VIP2: moved to another port",
            q2.bytes(),
            TC_NEXT,
            Expect::Packet(with_sport(&dnated(&q2, 11), moved)),
            counters,
        ));
        let r1 = reply_from(&q1, 11).payload(b"a1");
        dp.check(egress(
            "answer to VIP's query: from VIP",
            r1.bytes(),
            TC_NEXT,
            Expect::Packet(rev_natted(&r1, &q1)),
            &[(Counter::ReplyTranslated, 1)],
        ));
        let r2 = with_dport(&reply_from(&q2, 11).payload(b"a2"), moved);
        dp.check(egress(
            "answer to VIP2's query: from VIP2, to the client's port",
            r2.bytes(),
            TC_NEXT,
            Expect::Packet(with_dport(&rev_natted(&r2, &q2), 41_000)),
            &[(Counter::ReplyTranslated, 1)],
        ));
    }
}

#[test]
fn a_vip_flow_and_a_direct_flow_from_one_port_to_one_pod_keep_their_replies() {
    let mut dp = two_frontends_one_backend();
    let (pod, pod_port) = backend_addr(1);
    // VIP first, then straight to the pod from the same port.
    let v = Pkt::tcp(CLIENT, 42_000, VIP, 80, SYN);
    dp.check(ingress(
        "VIP flow",
        v.bytes(),
        TC_NEXT,
        Expect::Packet(dnated(&v, 1)),
        &[(Counter::NewFlow, 1)],
    ));
    let d = Pkt::tcp(CLIENT, 42_000, pod, pod_port, SYN);
    let moved = clash_port(&d);
    dp.check(ingress(
        "direct flow on the VIP flow's reply tuple: only its source port moves",
        d.bytes(),
        TC_NEXT,
        Expect::Packet(with_sport(&d, moved)),
        &[(Counter::DirectFlow, 1), (Counter::ReplyTupleRemapped, 1)],
    ));
    let d_reply = with_dport(&d.reversed(), moved);
    dp.check(egress(
        "the pod's answer to the direct flow: from the pod, to the client's port",
        d_reply.bytes(),
        TC_NEXT,
        Expect::Packet(with_dport(&d_reply, 42_000)),
        &[(Counter::DirectFlow, 1)],
    ));
    let v_reply = reply_from(&v, 1);
    dp.check(egress(
        "the VIP flow's answer: from the VIP",
        v_reply.bytes(),
        TC_NEXT,
        Expect::Packet(rev_natted(&v_reply, &v)),
        &[(Counter::ReplyTranslated, 1)],
    ));

    // Straight to the pod first, then through the VIP from the same port.
    let d2 = Pkt::tcp(CLIENT, 42_100, pod, pod_port, SYN);
    dp.check(ingress(
        "direct flow: tracked, untouched",
        d2.bytes(),
        TC_NEXT,
        Expect::Unchanged,
        &[(Counter::NotService, 1)],
    ));
    let v2 = Pkt::tcp(CLIENT, 42_100, VIP, 80, SYN);
    let moved2 = clash_port(&v2);
    dp.check(ingress(
        "VIP flow on the direct flow's tuple: DNAT and another source port",
        v2.bytes(),
        TC_NEXT,
        Expect::Packet(with_sport(&dnated(&v2, 1), moved2)),
        &[(Counter::NewFlow, 1), (Counter::ReplyTupleRemapped, 1)],
    ));
    let d2_reply = d2.reversed();
    dp.check(egress(
        "the pod's answer to the direct flow passes untranslated",
        d2_reply.bytes(),
        TC_NEXT,
        Expect::Unchanged,
        &[(Counter::ReplyNotTracked, 1)],
    ));
}

#[test]
fn a_closed_vip_flow_s_reply_tuple_is_reclaimed_and_evicted_entries_come_back() {
    let cfg = DatapathConfig {
        tcp_transitory_timeout_s: 1,
        ..DatapathConfig::DEFAULT
    };
    let mut dp = Datapath::load_with(cfg);
    dp.set_service(VIP, 80, proto::TCP, TCP_REVNAT, &[1]);
    let (pod, pod_port) = backend_addr(1);
    let v = Pkt::tcp(CLIENT, 43_000, VIP, 80, SYN);
    dp.run(PROG_TC_INGRESS, &v.bytes());
    // The VIP flow ended long ago (both entries idle past the 1 s timeout).
    for key in [original_key(&v), reply_key(&v, 1)] {
        let mut e = dp.ct(&key).expect("entry");
        e.last_seen_ns = 0;
        e.state = ct_state::CLOSING;
        dp.conntrack().insert(key, e, 0).expect("age entry");
    }
    let d = Pkt::tcp(CLIENT, 43_000, pod, pod_port, SYN);
    dp.check(ingress(
        "a new direct connection on a dead flow's tuple keeps its port",
        d.bytes(),
        TC_NEXT,
        Expect::Unchanged,
        &[(Counter::NotService, 1), (Counter::ReplyTupleReclaimed, 1)],
    ));
    assert!(
        dp.ct(&original_key(&v)).is_none(),
        "dead flow's ORIGINAL gone"
    );
    assert!(dp.ct(&reply_key(&v, 1)).is_none(), "dead flow's REPLY gone");
    dp.check(egress(
        "the pod's answer is not rewritten to the VIP",
        d.reversed().bytes(),
        TC_NEXT,
        Expect::Unchanged,
        &[(Counter::ReplyNotTracked, 1)],
    ));

    // A live flow survives the eviction of either entry.
    let live = Pkt::tcp(CLIENT, 43_100, VIP, 80, SYN);
    dp.run(PROG_TC_INGRESS, &live.bytes());
    dp.run(PROG_TC_EGRESS, &syn_ack_from(&live, 1).bytes());
    dp.conntrack()
        .remove(&reply_key(&live, 1))
        .expect("evict REPLY");
    let ack = Pkt::tcp(CLIENT, 43_100, VIP, 80, ACK);
    dp.check(ingress(
        "a packet whose REPLY entry was evicted writes it again",
        ack.bytes(),
        TC_NEXT,
        Expect::Packet(dnated(&ack, 1)),
        &[
            (Counter::EstablishedFlow, 1),
            (Counter::ConntrackRestored, 1),
        ],
    ));
    let reply = reply_from(&live, 1);
    dp.conntrack()
        .remove(&original_key(&live))
        .expect("evict ORIGINAL");
    dp.check(egress(
        "a reply whose ORIGINAL entry was evicted is translated and writes it again",
        reply.bytes(),
        TC_NEXT,
        Expect::Packet(rev_natted(&reply, &live)),
        &[
            (Counter::ReplyTranslated, 1),
            (Counter::ConntrackRestored, 1),
        ],
    ));
    // The Service changes: without the restored ORIGINAL, the client's next packet would be a
    // new flow to whatever the Service holds now.
    dp.set_service(VIP, 80, proto::TCP, TCP_REVNAT, &[1, 2, 3, 4]);
    dp.check(ingress(
        "the client's next packet keeps its backend",
        ack.bytes(),
        TC_NEXT,
        Expect::Packet(dnated(&ack, 1)),
        &[(Counter::EstablishedFlow, 1)],
    ));
}

/// A new connection on a closed flow's tuple (netfilter: "reopen") is chosen again; when it goes
/// to another backend, the old flow's reply tuple stays held (`ct_flags::RETIRED`) until it idles
/// out, because the old backend may still keep that connection in TIME_WAIT: a flow from the same
/// client port through another frontend to that backend must not meet it (its SYN would carry
/// another ISN and timestamp offset, which TIME_WAIT's PAWS check rejects).
#[test]
fn a_reopened_flow_s_old_reply_tuple_stays_held_while_the_backend_may_be_in_time_wait() {
    let mut dp = Datapath::load();
    dp.set_service(VIP, 80, proto::TCP, TCP_REVNAT, &[1]);
    dp.set_service(VIP2, 80, proto::TCP, VIP2_TCP_REVNAT, &[1]);
    let a = Pkt::tcp(CLIENT, 44_000, VIP, 80, SYN);
    dp.run(PROG_TC_INGRESS, &a.bytes());
    let rst = Pkt::tcp(CLIENT, 44_000, VIP, 80, RST | ACK);
    dp.run(PROG_TC_INGRESS, &rst.bytes());
    assert_flow(&mut dp, "closed", &a, 1, TCP_REVNAT, ct_state::CLOSING);

    // The Service now sends to backend 2; the same client port opens a new connection.
    dp.set_service(VIP, 80, proto::TCP, TCP_REVNAT, &[2]);
    dp.check(ingress(
        "a SYN on the closed flow's tuple is a new flow, to the Service's backend now",
        a.bytes(),
        TC_NEXT,
        Expect::Packet(dnated(&a, 2)),
        &[(Counter::NewFlow, 1)],
    ));
    assert_flow(&mut dp, "reopened", &a, 2, TCP_REVNAT, ct_state::SYN_SENT);
    let retired = dp
        .ct(&reply_key(&a, 1))
        .expect("the old flow's REPLY entry stays");
    assert_eq!(
        retired.flags & ct_flags::RETIRED,
        ct_flags::RETIRED,
        "the old REPLY entry is retired: {retired:?}"
    );
    assert_eq!(retired.state, ct_state::CLOSING, "retired entry state");
    dp.check(egress(
        "a late packet from the old backend passes untranslated (its flow is over)",
        reply_from(&a, 1).bytes(),
        TC_NEXT,
        Expect::Unchanged,
        &[(Counter::ReplyNotTracked, 1)],
    ));
    let answer = reply_from(&a, 2);
    dp.check(egress(
        "the new backend's answer comes from the VIP",
        answer.bytes(),
        TC_NEXT,
        Expect::Packet(rev_natted(&answer, &a)),
        &[(Counter::ReplyTranslated, 1)],
    ));

    // Same client port, another frontend, the old backend: the held tuple moves the new flow.
    let b = Pkt::tcp(CLIENT, 44_000, VIP2, 80, SYN);
    let moved = clash_port(&b);
    dp.check(ingress(
        "a flow onto the retired tuple gets another source port",
        b.bytes(),
        TC_NEXT,
        Expect::Packet(with_sport(&dnated(&b, 1), moved)),
        &[(Counter::NewFlow, 1), (Counter::ReplyTupleRemapped, 1)],
    ));

    // Once the retired entry idled out (the old backend's TIME_WAIT is over), its tuple is free.
    let mut aged = dp.ct(&reply_key(&a, 1)).expect("retired entry");
    aged.last_seen_ns = 0;
    dp.conntrack()
        .insert(reply_key(&a, 1), aged, 0)
        .expect("age the retired entry");
    let (pod, pod_port) = backend_addr(1);
    dp.check(ingress(
        "a direct connection on the idle retired tuple keeps its port",
        Pkt::tcp(CLIENT, 44_000, pod, pod_port, SYN).bytes(),
        TC_NEXT,
        Expect::Unchanged,
        &[(Counter::NotService, 1), (Counter::ReplyTupleReclaimed, 1)],
    ));
    assert!(
        dp.ct(&reply_key(&a, 1)).is_none(),
        "the idle retired entry is gone"
    );
    assert_flow(
        &mut dp,
        "the reopened flow is untouched",
        &a,
        2,
        TCP_REVNAT,
        ct_state::SYN_SENT,
    );

    // A reopened flow that picks the same backend takes its old tuple back (the backend sees the
    // same four-tuple with the client's next ISN, which TIME_WAIT accepts).
    let c = Pkt::tcp(CLIENT, 44_100, VIP, 80, SYN);
    dp.run(PROG_TC_INGRESS, &c.bytes());
    dp.run(
        PROG_TC_INGRESS,
        &Pkt::tcp(CLIENT, 44_100, VIP, 80, RST | ACK).bytes(),
    );
    dp.check(ingress(
        "reopened to the same backend",
        c.bytes(),
        TC_NEXT,
        Expect::Packet(dnated(&c, 2)),
        &[(Counter::NewFlow, 1)],
    ));
    let own = assert_flow(
        &mut dp,
        "same backend",
        &c,
        2,
        TCP_REVNAT,
        ct_state::SYN_SENT,
    );
    assert_eq!(own.flags & ct_flags::SPORT_NAT, 0, "the client's own port");
    let reply = dp.ct(&reply_key(&c, 2)).expect("REPLY entry");
    assert_eq!(
        reply.flags & ct_flags::RETIRED,
        0,
        "its own live REPLY entry"
    );
    let answer = reply_from(&c, 2);
    dp.check(egress(
        "the backend's answer comes from the VIP",
        answer.bytes(),
        TC_NEXT,
        Expect::Packet(rev_natted(&answer, &c)),
        &[(Counter::ReplyTranslated, 1)],
    ));
}

/// The flow walk judges entries from a listing and removes the dead ones afterwards; meanwhile
/// the datapath may reuse a key (a reopened tuple) or see a packet of that flow. Removal only
/// takes an entry still as it was listed, never the live flow that replaced it.
#[test]
fn the_flow_walk_removes_an_entry_only_if_it_is_still_as_listed() {
    let mut dp = Datapath::load().with_services();
    let syn = Pkt::tcp(CLIENT, 46_000, VIP, 80, SYN);
    dp.run(PROG_TC_INGRESS, &syn.bytes());
    let key = original_key(&syn);
    let listed = dp.ct(&key).expect("flow");
    std::thread::sleep(Duration::from_millis(2));
    let ack = Pkt::tcp(CLIENT, 46_000, VIP, 80, ACK);
    dp.run(PROG_TC_INGRESS, &ack.bytes());
    let touched = dp.ct(&key).expect("flow");
    assert!(
        touched.last_seen_ns > listed.last_seen_ns,
        "the packet touched it"
    );
    let mut ct =
        kube_proxy_ebpf::dataplane::maps::Conntrack::from_ebpf(&mut dp.bpf).expect("conntrack map");
    assert!(
        !ct.remove_if_unchanged(&key, &listed),
        "an entry touched since it was listed stays"
    );
    assert!(
        ct.remove_if_unchanged(&key, &touched),
        "an entry still as listed is removed"
    );
    assert!(
        ct.entries().iter().all(|(k, _)| *k != key),
        "and is gone from the map"
    );
}

// Session affinity (ClientIP): records in AFFINITY_V1 per (Service port scope, client), usable
// while the frontend's AFFMATCH_V1 names the backend and the last use is within the timeout.

/// The scope id the affinity tests give their Service port.
const AFFINITY_ID: u32 = 9;

impl Datapath {
    fn affinity(&mut self) -> HashMap<&mut MapData, AffinityKey, AffinityValue> {
        HashMap::try_from(self.bpf.map_mut(MAP_AFFINITY).expect("AFFINITY map"))
            .expect("AFFINITY type")
    }

    fn affinity_matches(&mut self) -> HashMap<&mut MapData, AffinityMatchKey, u32> {
        HashMap::try_from(self.bpf.map_mut(MAP_AFFINITY_MATCH).expect("AFFMATCH map"))
            .expect("AFFMATCH type")
    }

    fn affinity_record(&mut self, client: Ipv4Addr) -> Option<AffinityValue> {
        self.affinity().get(&affinity_key(client), 0).ok()
    }

    fn set_affinity_record(&mut self, client: Ipv4Addr, backend_id: u32, last_used_ns: u64) {
        let value = AffinityValue {
            backend_id,
            _pad: 0,
            last_used_ns,
        };
        self.affinity()
            .insert(affinity_key(client), value, 0)
            .expect("write record");
    }

    /// A frontend as the agent writes one (backends → slots → match entries → frontend), with
    /// session affinity (`timeout_s`, scope `AFFINITY_ID`) or without (`None`); `flags` besides.
    fn set_affinity_frontend(
        &mut self,
        key: ServiceKey,
        rev_nat_id: u32,
        flags: u16,
        timeout_s: Option<u32>,
        backend_ids: &[u32],
    ) {
        for &id in backend_ids {
            self.set_backend(id, key.proto);
        }
        for (i, &id) in backend_ids.iter().enumerate() {
            self.services()
                .insert(key.with_slot(i as u16 + 1), ServiceValue::slot(id), 0)
                .expect("insert slot");
        }
        // Match entries of backends that left go first; the new ones before the frontend.
        let stale: Vec<AffinityMatchKey> = self
            .affinity_matches()
            .keys()
            .map(|k| k.expect("match key"))
            .filter(|k| {
                k.frontend == key && (timeout_s.is_none() || !backend_ids.contains(&k.backend_id))
            })
            .collect();
        for k in stale {
            self.affinity_matches().remove(&k).expect("remove match");
        }
        let mut value =
            ServiceValue::frontend_with_flags(backend_ids.len() as u16, rev_nat_id, flags);
        if let Some(timeout) = timeout_s {
            for &backend_id in backend_ids {
                let m = AffinityMatchKey {
                    frontend: key,
                    backend_id,
                };
                self.affinity_matches()
                    .insert(m, 1, 0)
                    .expect("insert match");
            }
            value.flags |= service_flags::AFFINITY;
            value.affinity_timeout_s = timeout;
            value.affinity_id = AFFINITY_ID;
        }
        self.services()
            .insert(key, value, 0)
            .expect("insert frontend");
    }

    /// A new flow's first packet through tc ingress: the backend its conntrack entry names.
    fn new_flow_backend(&mut self, pkt: &Pkt) -> u32 {
        let (verdict, _) = self.run(PROG_TC_INGRESS, &pkt.bytes());
        assert_eq!(verdict, TC_NEXT, "new flow {pkt:?} passed translated");
        self.ct(&original_key(pkt))
            .unwrap_or_else(|| panic!("no conntrack entry for {pkt:?}"))
            .backend_id
    }
}

fn affinity_key(client: Ipv4Addr) -> AffinityKey {
    AffinityKey {
        affinity_id: AFFINITY_ID,
        client: client.octets(),
    }
}

fn clusterip_key(port: u16, proto: u8) -> ServiceKey {
    ServiceKey::new(VIP.octets(), port.to_be_bytes(), proto, 0)
}

/// The first source port from `from` whose flow the scheduler (seed 0) sends somewhere other
/// than `not`, among `ids`.
fn sport_picking_other_than(from: u16, not: u32, ids: &[u32], proto_: u8) -> u16 {
    (from..from + 1_000)
        .find(|&p| {
            let pkt = if proto_ == proto::TCP {
                Pkt::tcp(CLIENT, p, VIP, 80, SYN)
            } else {
                Pkt::udp(CLIENT, p, VIP, 53)
            };
            expected_pick(&pkt, ids) != not
        })
        .expect("a port that hashes elsewhere")
}

#[test]
fn affinity_sends_a_client_s_new_flows_to_one_backend_tcp_and_udp_and_off_spreads() {
    let mut dp = Datapath::load();
    let tcp = [1, 2, 3, 4];
    dp.set_affinity_frontend(clusterip_key(80, proto::TCP), TCP_REVNAT, 0, Some(60), &tcp);
    let before = monotonic_ns();
    let first = Pkt::tcp(CLIENT, 40_000, VIP, 80, SYN);
    let chosen = expected_pick(&first, &tcp);
    dp.check(ingress(
        "a client's first flow: the scheduler's pick, recorded",
        first.bytes(),
        TC_NEXT,
        Expect::Packet(dnated(&first, chosen)),
        &[(Counter::NewFlow, 1), (Counter::AffinityMiss, 1)],
    ));
    let record = dp.affinity_record(CLIENT).expect("record written");
    assert_eq!(record.backend_id, chosen);
    assert!(record.last_used_ns >= before);
    let mut hashed_elsewhere = 0;
    for sport in 40_001..40_021 {
        let syn = Pkt::tcp(CLIENT, sport, VIP, 80, SYN);
        hashed_elsewhere += usize::from(expected_pick(&syn, &tcp) != chosen);
        dp.check(ingress(
            "another new flow of the client: its recorded backend",
            syn.bytes(),
            TC_NEXT,
            Expect::Packet(dnated(&syn, chosen)),
            &[(Counter::NewFlow, 1), (Counter::AffinityHit, 1)],
        ));
    }
    assert!(
        hashed_elsewhere > 5,
        "the flows would have spread without affinity"
    );
    // Packets of a known flow do not look at the record (only new flows refresh it).
    let stamped = dp.affinity_record(CLIENT).unwrap().last_used_ns;
    let ack = Pkt::tcp(CLIENT, 40_000, VIP, 80, ACK);
    dp.check(ingress(
        "an established flow's packet",
        ack.bytes(),
        TC_NEXT,
        Expect::Packet(dnated(&ack, chosen)),
        &[(Counter::EstablishedFlow, 1)],
    ));
    assert_eq!(dp.affinity_record(CLIENT).unwrap().last_used_ns, stamped);

    // UDP: the same. (The test gives the UDP port the same scope id as the TCP one, so it uses
    // another client, whose record the TCP flows above never touched.)
    let udp = [11, 12];
    dp.set_affinity_frontend(clusterip_key(53, proto::UDP), UDP_REVNAT, 0, Some(60), &udp);
    let udp_client = Ipv4Addr::new(10, 244, 1, 3);
    let q = with_src(&Pkt::udp(CLIENT, 0, VIP, 53), udp_client, 33_000);
    let udp_chosen = dp.new_flow_backend(&q);
    for sport in 33_001..33_021 {
        let q = with_src(&Pkt::udp(CLIENT, 0, VIP, 53), udp_client, sport);
        assert_eq!(dp.new_flow_backend(&q), udp_chosen, "UDP datagram {sport}");
    }
    assert_eq!(dp.counter(Counter::AffinityMiss), 2, "one miss per client");
    assert_eq!(dp.counter(Counter::AffinityHit), 40);

    // Affinity switched off (the frontend entry): the next new flows follow the scheduler again.
    dp.set_affinity_frontend(clusterip_key(80, proto::TCP), TCP_REVNAT, 0, None, &tcp);
    let mut seen = std::collections::BTreeSet::new();
    for sport in 41_000..41_020 {
        let syn = Pkt::tcp(CLIENT, sport, VIP, 80, SYN);
        let got = dp.new_flow_backend(&syn);
        assert_eq!(got, expected_pick(&syn, &tcp), "affinity off: the hash");
        seen.insert(got);
    }
    assert!(seen.len() >= 2, "affinity off spreads: {seen:?}");
    assert_eq!(dp.counter(Counter::AffinityHit), 40, "no record looked at");
}

#[test]
fn affinity_record_past_its_timeout_is_replaced_by_a_fresh_pick() {
    let mut dp = Datapath::load();
    let ids = [1, 2, 3, 4];
    dp.set_affinity_frontend(clusterip_key(80, proto::TCP), TCP_REVNAT, 0, Some(1), &ids);
    // A record last used at boot (0 ns): with a 1 s timeout it has expired (the kernel has been
    // up for more than a second). Its backend is one this flow does not hash to.
    let sport = sport_picking_other_than(42_000, 3, &ids, proto::TCP);
    dp.set_affinity_record(CLIENT, 3, 0);
    let syn = Pkt::tcp(CLIENT, sport, VIP, 80, SYN);
    let fresh = expected_pick(&syn, &ids);
    let before = monotonic_ns();
    dp.check(ingress(
        "expired record: a fresh pick",
        syn.bytes(),
        TC_NEXT,
        Expect::Packet(dnated(&syn, fresh)),
        &[(Counter::NewFlow, 1), (Counter::AffinityMiss, 1)],
    ));
    let record = dp.affinity_record(CLIENT).expect("record");
    assert_eq!(record.backend_id, fresh, "the fresh pick is the new record");
    assert!(record.last_used_ns >= before, "its last use restarted");

    // A live record (just used) with a longer timeout is followed, and refreshed.
    dp.set_affinity_frontend(
        clusterip_key(80, proto::TCP),
        TCP_REVNAT,
        0,
        Some(3_600),
        &ids,
    );
    let now = monotonic_ns();
    dp.set_affinity_record(CLIENT, 3, now);
    let syn = Pkt::tcp(CLIENT, sport + 1_000, VIP, 80, SYN);
    dp.check(ingress(
        "live record: its backend",
        syn.bytes(),
        TC_NEXT,
        Expect::Packet(dnated(&syn, 3)),
        &[(Counter::NewFlow, 1), (Counter::AffinityHit, 1)],
    ));
    assert!(dp.affinity_record(CLIENT).unwrap().last_used_ns >= now);
}

#[test]
fn affinity_to_an_endpoint_that_left_the_service_picks_among_the_remaining() {
    let mut dp = Datapath::load();
    dp.set_affinity_frontend(
        clusterip_key(80, proto::TCP),
        TCP_REVNAT,
        0,
        Some(3_600),
        &[1, 2, 3],
    );
    let first = Pkt::tcp(CLIENT, 43_000, VIP, 80, SYN);
    let gone = dp.new_flow_backend(&first);
    // The endpoint leaves the Service (its backend entry stays: another Service may use it).
    let remaining: Vec<u32> = [1, 2, 3].into_iter().filter(|&id| id != gone).collect();
    dp.set_affinity_frontend(
        clusterip_key(80, proto::TCP),
        TCP_REVNAT,
        0,
        Some(3_600),
        &remaining,
    );
    assert!(
        dp.backends().get(&gone, 0).is_ok(),
        "the backend still exists"
    );
    let syn = Pkt::tcp(CLIENT, 43_001, VIP, 80, SYN);
    let next = expected_pick(&syn, &remaining);
    dp.check(ingress(
        "recorded endpoint gone: a new pick among the remaining",
        syn.bytes(),
        TC_NEXT,
        Expect::Packet(dnated(&syn, next)),
        &[(Counter::NewFlow, 1), (Counter::AffinityMiss, 1)],
    ));
    assert_eq!(dp.affinity_record(CLIENT).unwrap().backend_id, next);
    for sport in 43_002..43_020 {
        let syn = Pkt::tcp(CLIENT, sport, VIP, 80, SYN);
        assert_eq!(dp.new_flow_backend(&syn), next, "sticky to the new pick");
    }
}

#[test]
fn affinity_is_shared_by_the_frontends_of_a_service_port() {
    let mut dp = Datapath::load();
    dp.set_node_addr(NODE_IP);
    // ClusterIP and NodePort of one Service port (one scope id), their slots in other orders.
    dp.set_affinity_frontend(
        clusterip_key(80, proto::TCP),
        TCP_REVNAT,
        0,
        Some(3_600),
        &[1, 2, 3, 4],
    );
    let node_port = ServiceKey::new(NODE_IP.octets(), NODE_PORT.to_be_bytes(), proto::TCP, 0);
    dp.set_affinity_frontend(
        node_port,
        5,
        service_flags::EXTERNAL,
        Some(3_600),
        &[4, 3, 2, 1],
    );
    for round in 0..8u16 {
        let client = Ipv4Addr::new(10, 244, 9, round as u8 + 1);
        let to_cluster_ip = with_src(&Pkt::tcp(CLIENT, 0, VIP, 80, SYN), client, 44_000);
        let chosen = dp.new_flow_backend(&to_cluster_ip);
        let to_node_port = with_src(
            &Pkt::tcp(CLIENT, 0, NODE_IP, NODE_PORT, SYN),
            client,
            44_001,
        );
        assert_eq!(
            dp.new_flow_backend(&to_node_port),
            chosen,
            "client {client}: through the NodePort, the backend it got through the ClusterIP"
        );
    }
    assert_eq!(dp.counter(Counter::AffinityHit), 8);
    assert_eq!(dp.counter(Counter::AffinityMiss), 8);
}

/// What session affinity adds to a new flow (printed, not asserted: single-run medians over
/// 2,000 new flows of one client, every one after the first a hit, against the same frontend
/// without affinity). Run with `--nocapture`.
#[test]
fn affinity_new_flow_cost() {
    let mut dp = Datapath::load();
    let ids = [1, 2, 3, 4];
    let new_flows = |dp: &mut Datapath, base: u16| -> u128 {
        let runs: Vec<Duration> = (0..2_000u16)
            .map(|i| {
                let syn = Pkt::tcp(CLIENT, base + i, VIP, 80, SYN).bytes();
                let (verdict, _, d) = dp.run_timed(PROG_TC_INGRESS, &syn, 1);
                assert_eq!(verdict, TC_NEXT, "new flow verdict");
                d
            })
            .collect();
        median(runs)
    };
    dp.set_affinity_frontend(clusterip_key(80, proto::TCP), TCP_REVNAT, 0, None, &ids);
    let plain = new_flows(&mut dp, 10_000);
    dp.set_affinity_frontend(
        clusterip_key(80, proto::TCP),
        TCP_REVNAT,
        0,
        Some(3_600),
        &ids,
    );
    let sticky = new_flows(&mut dp, 20_000);
    assert_eq!(
        (
            dp.counter(Counter::AffinityMiss),
            dp.counter(Counter::AffinityHit)
        ),
        (1, 1_999),
        "one pick, then hits"
    );
    println!("per-packet cost: new_flow_ns={plain} new_flow_affinity_hit_ns={sticky}");
}

// --- Schedulers: round robin and least connection (issue 10) ---

impl Datapath {
    /// Set the scheduler (`sched::code::*`) of the frontend entry `vip:port/proto`.
    fn set_scheduler(&mut self, vip: Ipv4Addr, port: u16, proto: u8, code: u8) {
        let key = ServiceKey::new(vip.octets(), port.to_be_bytes(), proto, 0);
        let mut v = self.services().get(&key, 0).expect("frontend");
        v.scheduler = code;
        self.services().insert(key, v, 0).expect("write frontend");
    }

    fn lc_array(&self, name: &str) -> Array<&MapData, u64> {
        Array::try_from(self.bpf.map(name).expect("LC map")).expect("LC map type")
    }

    /// Backend `id`'s effective least-connection count (what lc compares).
    fn lc_count(&self, id: u32) -> u64 {
        let active = self.lc_array(MAP_LC_FLOWS).get(&id, 0).expect("LCFLOWS");
        let adjust = self.lc_array(MAP_LC_ADJUST).get(&id, 0).expect("LCADJ");
        proxy_common::lc::effective(active, adjust)
    }

    fn lc_counts(&self, ids: &[u32]) -> Vec<u64> {
        ids.iter().map(|&id| self.lc_count(id)).collect()
    }

    /// One agent reconciliation (`lc_counts::reconcile`, as `Agent::gc_conntrack` runs it) at
    /// CLOCK_MONOTONIC `now`: dead entries removed, corrections written.
    fn lc_reconcile(&mut self, now: u64) {
        let mut programmed = Programmed::default();
        for (id, b) in self.backends().iter().map(Result::unwrap) {
            programmed.backends.insert(id, b);
        }
        let cfg = DatapathConfig::DEFAULT;
        let done = {
            let flows = self.lc_array(MAP_LC_FLOWS);
            let ct: HashMap<&MapData, CtKey, CtValue> =
                HashMap::try_from(self.bpf.map(MAP_CONNTRACK).unwrap()).unwrap();
            let backends = &programmed.backends;
            lc_counts::reconcile(
                1..=20,
                |id| flows.get(&id, 0).unwrap(),
                || now,
                lc_counts::Listing::ipv4(
                    || ct.iter().map(Result::unwrap).collect(),
                    |k, v, now| flow_is_dead(k, v, now, &cfg, &programmed),
                    backends,
                ),
                lc_counts::Listing::none(),
            )
        };
        for (key, _) in &done.dead {
            self.conntrack().remove(key).expect("remove dead entry");
        }
        let mut adjust: Array<&mut MapData, u64> =
            Array::try_from(self.bpf.map_mut(MAP_LC_ADJUST).unwrap()).unwrap();
        for (id, v) in done.corrections {
            adjust.set(id, v, 0).expect("write LCADJ");
        }
    }

    /// A new TCP flow (SYN) from CLIENT:`port` to VIP:80: the backend id it was sent to.
    fn syn_to(&mut self, port: u16, ids: &[u32]) -> u32 {
        let syn = Pkt::tcp(CLIENT, port, VIP, 80, SYN);
        let (verdict, out) = self.run(PROG_TC_INGRESS, &syn.bytes());
        assert_eq!(verdict, TC_NEXT, "SYN from port {port}");
        let d = Decoded::parse(&out);
        *ids.iter()
            .find(|&&id| backend_addr(id).0 == d.daddr)
            .unwrap_or_else(|| panic!("SYN from port {port} went to {}", d.daddr))
    }
}

/// rr: 30 sequential new flows over 3 endpoints go 1, 2, 3, 1, 2, 3, … (each exactly 10), and
/// the frontend's datapath-owned position counted them; as the agent reads the entry back
/// (`as_programmed`), the position is no difference from what it wrote.
#[test]
fn round_robin_cycles_exactly_over_the_endpoints() {
    let mut dp = Datapath::load();
    dp.set_service(VIP, 80, proto::TCP, TCP_REVNAT, &[1, 2, 3]);
    dp.set_scheduler(VIP, 80, proto::TCP, sched::code::ROUND_ROBIN);
    let ids = [1, 2, 3];
    let mut per = BTreeMap::new();
    for i in 0..30u16 {
        let syn = Pkt::tcp(CLIENT, 50_000 + i, VIP, 80, SYN);
        let want = ids[i as usize % 3];
        dp.check(ingress(
            "rr new flow",
            syn.bytes(),
            TC_NEXT,
            Expect::Packet(dnated(&syn, want)),
            &[(Counter::NewFlow, 1)],
        ));
        *per.entry(want).or_insert(0) += 1;
        // Known flows do not advance the position.
        let ack = Pkt::tcp(CLIENT, 50_000 + i, VIP, 80, ACK);
        dp.check(ingress(
            "rr established",
            ack.bytes(),
            TC_NEXT,
            Expect::Packet(dnated(&ack, want)),
            &[(Counter::EstablishedFlow, 1)],
        ));
    }
    assert_eq!(per, BTreeMap::from([(1, 10), (2, 10), (3, 10)]));
    let key = ServiceKey::new(VIP.octets(), 80u16.to_be_bytes(), proto::TCP, 0);
    let entry = dp.services().get(&key, 0).unwrap();
    assert_eq!(entry.rr_next, 30, "one position per new flow");
    let mut written = ServiceValue::frontend(3, TCP_REVNAT);
    written.scheduler = sched::code::ROUND_ROBIN;
    assert_eq!(entry.as_programmed(), written);
}

/// lc: while backends 1 and 2 hold long flows, new flows go to the idle backend 3 until it holds
/// as many; counts follow every flow's end (client RST, FIN from both sides, replacement of an
/// idle-expired entry) back to zero.
#[test]
fn least_connection_sends_new_flows_to_the_least_loaded_and_counts_follow_flow_ends() {
    let mut dp = Datapath::load();
    let ids = [1, 2, 3];
    dp.set_service(VIP, 80, proto::TCP, TCP_REVNAT, &ids);
    // The long flows start under random (every translated flow is counted, whatever the
    // scheduler): two to 1 and 2 each, found by the same flow hash as the datapath's.
    let mut long = Vec::new();
    let mut held = BTreeMap::<u32, usize>::new();
    for port in 40_000..41_000u16 {
        let syn = Pkt::tcp(CLIENT, port, VIP, 80, SYN);
        let id = expected_pick(&syn, &ids);
        if id != 3 && held.get(&id).copied().unwrap_or(0) < 2 {
            assert_eq!(dp.syn_to(port, &ids), id);
            *held.entry(id).or_default() += 1;
            long.push((port, id));
        }
        if long.len() == 4 {
            break;
        }
    }
    assert_eq!(dp.lc_counts(&ids), [2, 2, 0]);
    dp.set_scheduler(VIP, 80, proto::TCP, sched::code::LEAST_CONNECTION);
    // Two new flows: both to the idle backend 3 (then all hold 2).
    assert_eq!(dp.syn_to(50_000, &ids), 3);
    assert_eq!(dp.lc_counts(&ids), [2, 2, 1]);
    assert_eq!(dp.syn_to(50_001, &ids), 3);
    assert_eq!(dp.lc_counts(&ids), [2, 2, 2]);
    // Backend 1's flows end: a client RST, then a FIN from each side.
    let (p0, p1) = (
        long[0],
        long.iter()
            .find(|l| l.1 == long[0].1 && l.0 != long[0].0)
            .unwrap(),
    );
    let one = p0.1;
    let rst = Pkt::tcp(CLIENT, p0.0, VIP, 80, RST | ACK);
    dp.check(ingress(
        "client RST ends a counted flow",
        rst.bytes(),
        TC_NEXT,
        Expect::Packet(dnated(&rst, one)),
        &[(Counter::EstablishedFlow, 1)],
    ));
    let fin = Pkt::tcp(CLIENT, p1.0, VIP, 80, FIN | ACK);
    dp.check(ingress(
        "client FIN half-closes",
        fin.bytes(),
        TC_NEXT,
        Expect::Packet(dnated(&fin, one)),
        &[(Counter::EstablishedFlow, 1)],
    ));
    let mut counts = dp.lc_counts(&ids);
    assert_eq!(
        counts[one as usize - 1],
        1,
        "a half-closed flow still counts"
    );
    let backend_fin = reply_from(&Pkt::tcp(CLIENT, p1.0, VIP, 80, FIN | ACK), one);
    dp.check(egress(
        "backend FIN closes",
        backend_fin.bytes(),
        TC_NEXT,
        Expect::Packet(rev_natted(&backend_fin, &fin)),
        &[(Counter::ReplyTranslated, 1)],
    ));
    counts[one as usize - 1] = 0;
    assert_eq!(
        dp.lc_counts(&ids),
        counts,
        "both of backend {one}'s flows ended"
    );
    // Retransmitted RST / FIN of a closed flow: no second decrement.
    dp.run(PROG_TC_INGRESS, &rst.bytes());
    dp.run(PROG_TC_EGRESS, &backend_fin.bytes());
    assert_eq!(
        dp.lc_counts(&ids),
        counts,
        "each flow gives its unit back once"
    );
    // The emptied backend gets the next new flows.
    assert_eq!(dp.syn_to(50_002, &ids), one);
    assert_eq!(dp.syn_to(50_003, &ids), one);
    assert_eq!(dp.lc_counts(&ids), [2, 2, 2]);
    // A SYN reusing the closed flow's tuple replaces it: counted once, as a new flow.
    let again = dp.syn_to(p0.0, &ids);
    let mut want = vec![2, 2, 2];
    want[again as usize - 1] += 1;
    assert_eq!(dp.lc_counts(&ids), want);
    // Every open flow ends with a RST (from the client, or from the backend through egress):
    // all counts back to zero.
    let open: Vec<u16> = long.iter().map(|l| l.0).filter(|&p| p != p1.0).collect();
    for (i, port) in open.into_iter().chain(50_000..50_004).enumerate() {
        let rst = Pkt::tcp(CLIENT, port, VIP, 80, RST | ACK);
        if i % 2 == 0 {
            dp.run(PROG_TC_INGRESS, &rst.bytes());
        } else {
            let id = dp.ct(&original_key(&rst)).expect("open flow").backend_id;
            dp.run(PROG_TC_EGRESS, &reply_from(&rst, id).bytes());
        }
    }
    assert_eq!(dp.lc_counts(&ids), [0, 0, 0], "every flow ended");
}

/// lc counts of flows the datapath never sees end (idle expiry with no packet, LRU eviction of
/// both entries, or of only the ORIGINAL one) come back to the truth with the agent's
/// reconciliation, and its corrections do not accumulate.
#[test]
fn least_connection_counts_are_reconciled_after_expiry_and_eviction() {
    let mut dp = Datapath::load();
    let ids = [1, 2, 3];
    dp.set_service(VIP, 80, proto::TCP, TCP_REVNAT, &ids);
    dp.set_scheduler(VIP, 80, proto::TCP, sched::code::LEAST_CONNECTION);
    // Six flows: lc spreads them two per backend.
    let mut flows = Vec::new();
    for port in 51_000..51_006u16 {
        let id = dp.syn_to(port, &ids);
        let ack = Pkt::tcp(CLIENT, port, VIP, 80, ACK);
        dp.run(PROG_TC_INGRESS, &ack.bytes());
        flows.push((port, id));
    }
    assert_eq!(dp.lc_counts(&ids), [2, 2, 2], "{flows:?}");
    // Reconciling a truthful state changes nothing, however often.
    dp.lc_reconcile(monotonic_ns());
    dp.lc_reconcile(monotonic_ns());
    assert_eq!(dp.lc_counts(&ids), [2, 2, 2]);
    // LRU evicts both entries of one of backend 1's flows, and only the ORIGINAL entry of one of
    // backend 2's (that flow lives on: the REPLY entry brings it back).
    let gone = *flows.iter().find(|f| f.1 == 1).unwrap();
    let half = *flows.iter().find(|f| f.1 == 2).unwrap();
    let gone_pkt = Pkt::tcp(CLIENT, gone.0, VIP, 80, ACK);
    let half_pkt = Pkt::tcp(CLIENT, half.0, VIP, 80, ACK);
    dp.conntrack().remove(&original_key(&gone_pkt)).unwrap();
    dp.conntrack().remove(&reply_key(&gone_pkt, 1)).unwrap();
    dp.conntrack().remove(&original_key(&half_pkt)).unwrap();
    assert_eq!(
        dp.lc_counts(&ids),
        [2, 2, 2],
        "the datapath cannot see evictions"
    );
    dp.lc_reconcile(monotonic_ns());
    assert_eq!(
        dp.lc_counts(&ids),
        [1, 2, 2],
        "evicted flow uncounted, half-evicted kept"
    );
    // The half-evicted flow's next reply writes its ORIGINAL entry again, still counted once.
    let reply = reply_from(&half_pkt, 2);
    dp.run(PROG_TC_EGRESS, &reply.bytes());
    assert!(dp.ct(&original_key(&half_pkt)).unwrap().flags & ct_flags::COUNTED != 0);
    dp.lc_reconcile(monotonic_ns());
    assert_eq!(dp.lc_counts(&ids), [1, 2, 2]);
    // Every flow idles out with no packet: a walk past the timeout removes them and zeroes the
    // counts.
    let later = monotonic_ns()
        + 2 * DatapathConfig::DEFAULT.tcp_established_timeout_s as u64 * 1_000_000_000;
    dp.lc_reconcile(later);
    assert_eq!(dp.ct_len(), 0, "the walk removed the expired entries");
    assert_eq!(dp.lc_counts(&ids), [0, 0, 0]);
    // New flows start from the corrected counts: three go to three backends.
    let mut got: Vec<u32> = (52_000..52_003u16).map(|p| dp.syn_to(p, &ids)).collect();
    got.sort_unstable();
    assert_eq!(got, ids);
    assert_eq!(dp.lc_counts(&ids), [1, 1, 1]);
}

/// The datapath trace's records as aya-log decodes them: (level, target, message).
#[derive(Clone, Default)]
struct Records(std::sync::Arc<std::sync::Mutex<Vec<(log::Level, String, String)>>>);

impl Records {
    /// (level, message) of every record so far.
    fn messages(&self) -> Vec<(log::Level, String)> {
        let records = self.0.lock().unwrap();
        records.iter().map(|(l, _, m)| (*l, m.clone())).collect()
    }
}

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

/// A new TCP flow and two replies, a SYN to a Service without endpoints and an untracked egress
/// packet through `dp`: the records its trace wrote for them.
fn traced_flows(dp: &mut Datapath) -> (u32, Vec<(log::Level, String, String)>) {
    let records = Records::default();
    let mut logger = aya_log::EbpfLogger::init_with_logger(&mut dp.bpf, records.clone())
        .expect("the object carries aya-log's ring buffer");
    let syn = Pkt::tcp(CLIENT, 40_000, VIP, 80, SYN);
    let id = expected_pick(&syn, &[1, 2]);
    assert_eq!(dp.run(PROG_TC_INGRESS, &syn.bytes()).0, TC_NEXT, "new flow");
    let reply = reply_from(&syn, id);
    for _ in 0..2 {
        assert_eq!(dp.run(PROG_TC_EGRESS, &reply.bytes()).0, TC_NEXT, "reply");
    }
    let empty = Pkt::tcp(CLIENT, 40_001, VIP_EMPTY, 80, SYN);
    assert_eq!(
        dp.run(PROG_TC_INGRESS, &empty.bytes()).0,
        TC_ACT_REDIRECT,
        "rejected"
    );
    let untracked = Pkt::udp(OTHER, 1_234, CLIENT, 5_678);
    assert_eq!(dp.run(PROG_TC_EGRESS, &untracked.bytes()).0, TC_NEXT);
    logger.flush();
    let got = records.0.lock().unwrap().clone();
    (id, got)
}

#[test]
fn the_datapath_trace_names_each_flow_at_its_level_and_is_silent_when_off() {
    use log::Level::{Debug, Info, Trace};
    let (id, records) = traced_flows(
        &mut Datapath::load_with_log(DatapathConfig::DEFAULT, Some(bpf_log::TRACE)).with_services(),
    );
    let (baddr, bport) = backend_addr(id);
    let want = [
        (
            Debug,
            format!(
                "new flow tcp {CLIENT}:40000 -> {VIP}:80: backend {id} {baddr}:{bport} (random)"
            ),
        ),
        (
            Debug,
            format!("first reply {baddr}:{bport} -> {CLIENT}:40000: from {VIP}:80"),
        ),
        (
            Trace,
            format!("reply {baddr}:{bport} -> {CLIENT}:40000: from {VIP}:80"),
        ),
        (
            Info,
            format!("tcp {CLIENT}:40001 -> {VIP_EMPTY}:80: no endpoints: rejected"),
        ),
        (
            Trace,
            format!("no conntrack entry: udp {OTHER}:1234 -> {CLIENT}:5678: passed"),
        ),
    ];
    let got: Vec<(log::Level, String)> = records
        .iter()
        .map(|(level, target, msg)| {
            assert_eq!(target, bpf_log::TARGET, "{msg}");
            (*level, msg.clone())
        })
        .collect();
    assert_eq!(got, want.to_vec(), "at trace: every record, in order");

    // At info only the refused flow; the finer records were removed at load.
    let (_, records) = traced_flows(
        &mut Datapath::load_with_log(DatapathConfig::DEFAULT, Some(bpf_log::INFO)).with_services(),
    );
    let got: Vec<(log::Level, String)> = records.into_iter().map(|(l, _, m)| (l, m)).collect();
    assert_eq!(got, vec![want[3].clone()], "at info");

    // The object's default: off, nothing in the ring.
    let (_, records) = traced_flows(&mut Datapath::load().with_services());
    assert!(records.is_empty(), "off by default: {records:?}");
}

#[test]
fn every_program_verifies_with_the_datapath_trace_at_every_level() {
    // The socket hooks' bodies only exist for the verifier with a netns cookie set.
    let sock_lb = proxy_common::SockLbConfig { netns_cookie: 1 };
    let mut report = Vec::new();
    for level in [
        bpf_log::OFF,
        bpf_log::ERROR,
        bpf_log::WARN,
        bpf_log::INFO,
        bpf_log::DEBUG,
        bpf_log::TRACE,
    ] {
        let mut ebpf = EbpfLoader::new()
            .override_global(CONFIG_GLOBAL, &DatapathConfig::DEFAULT, true)
            .override_global(proxy_common::SOCK_LB_GLOBAL, &sock_lb, true)
            .override_global(bpf_log::LOG_LEVEL_GLOBAL, &level, true)
            .load(EBPF_OBJECT)
            .expect("load");
        loader::load_programs(&mut ebpf)
            .unwrap_or_else(|e| panic!("level {level}: verifier rejected a program: {e:#?}"));
        let count = |name: &str| -> u32 {
            let info = match ebpf.program(name).expect(name) {
                aya::programs::Program::SchedClassifier(p) => p.info(),
                aya::programs::Program::CgroupSockAddr(p) => p.info(),
                _ => unreachable!("{name}"),
            };
            info.expect("info")
                .verified_instruction_count()
                .unwrap_or_default()
        };
        report.push(format!(
            "level {level}: tc_ingress {} tc_ingress_new {} tc_ingress_reject {} tc_egress {} sock_connect4 {} sock_connect6 {} sock_recvmsg6 {}",
            count(PROG_TC_INGRESS),
            count(proxy_common::PROG_TC_INGRESS_NEW),
            count(proxy_common::PROG_TC_INGRESS_REJECT),
            count(PROG_TC_EGRESS),
            count(proxy_common::PROG_SOCK_CONNECT4),
            count(proxy_common::PROG_SOCK_CONNECT6),
            count(proxy_common::PROG_SOCK_RECVMSG6),
        ));
    }
    println!(
        "instructions the verifier processed:\n{}",
        report.join("\n")
    );
}

#[test]
fn the_datapath_trace_names_affinity_hits_and_source_range_drops() {
    let mut dp = Datapath::load_with_log(DatapathConfig::DEFAULT, Some(bpf_log::DEBUG));
    let records = Records::default();
    let mut logger = aya_log::EbpfLogger::init_with_logger(&mut dp.bpf, records.clone())
        .expect("aya-log's ring buffer");
    // A live affinity record: the client keeps backend 3, whatever the hash says.
    let ids = [1, 2, 3];
    dp.set_affinity_frontend(
        clusterip_key(80, proto::TCP),
        TCP_REVNAT,
        0,
        Some(3_600),
        &ids,
    );
    dp.set_affinity_record(CLIENT, 3, monotonic_ns());
    let syn = Pkt::tcp(CLIENT, 41_000, VIP, 80, SYN);
    assert_eq!(dp.new_flow_backend(&syn), 3);
    // A LoadBalancer IP with source ranges and none that holds this client.
    let lb = Ipv4Addr::new(192, 168, 70, 10);
    dp.set_frontend(
        lb,
        80,
        proto::TCP,
        service_flags::EXTERNAL | service_flags::SOURCE_RANGES,
        &[(
            220,
            raw_backend(LOCAL_BE, 8080, proto::TCP, backend_flags::LOCAL),
        )],
    );
    let outside = Pkt::tcp(EXT_CLIENT, 43_000, lb, 80, SYN);
    assert_eq!(dp.run(PROG_TC_INGRESS, &outside.bytes()).0, TC_ACT_SHOT);
    logger.flush();
    let (be, port) = backend_addr(3);
    let got = records.messages();
    assert_eq!(
        got,
        vec![
            (
                log::Level::Debug,
                format!("affinity: client {CLIENT} keeps backend 3")
            ),
            (
                log::Level::Debug,
                format!("new flow tcp {CLIENT}:41000 -> {VIP}:80: backend 3 {be}:{port} (random)")
            ),
            (
                log::Level::Info,
                format!(
                    "tcp {EXT_CLIENT}:43000 -> {lb}:80: outside loadBalancerSourceRanges: dropped"
                )
            ),
        ]
    );
}

#[test]
fn the_datapath_trace_names_snat_exhaustion_and_local_policy_drops() {
    let mut dp = Datapath::load_with_log(DatapathConfig::DEFAULT, Some(bpf_log::INFO));
    let records = Records::default();
    let mut logger = aya_log::EbpfLogger::init_with_logger(&mut dp.bpf, records.clone())
        .expect("aya-log's ring buffer");
    let ext = service_flags::EXTERNAL;
    dp.set_frontend(
        NODE_IP,
        NODE_PORT,
        proto::TCP,
        ext,
        &[(200, raw_backend(REMOTE_BE, 8080, proto::TCP, 0))],
    );
    dp.set_frontend(
        NODE_IP,
        NODE_PORT + 2,
        proto::TCP,
        ext | service_flags::EXTERNAL_LOCAL | service_flags::DROP_WHEN_EMPTY,
        &[],
    );
    dp.set_node_addr(NODE_IP);
    // Every node port the flow's probe tries is held by a live flow of another client.
    let syn = Pkt::tcp(EXT_CLIENT, 44_000, NODE_IP, NODE_PORT, SYN);
    let h = flow_hash(
        0,
        EXT_CLIENT.octets(),
        REMOTE_BE.octets(),
        44_000u16.to_be_bytes(),
        8080u16.to_be_bytes(),
        proto::TCP,
    );
    let probe = SnatPorts::new(h, proto::TCP, 44_000, true);
    let now = monotonic_ns();
    for i in 0..proxy_common::SNAT_PROBES {
        let taken = SnatValue {
            last_seen_ns: now,
            addr: OTHER.octets(),
            port: 1_000u16.to_be_bytes(),
            state: ct_state::ESTABLISHED,
            flags: 0,
        };
        dp.snat()
            .insert(
                snat_in_key(REMOTE_BE, 8080, probe.port(i), proto::TCP),
                taken,
                0,
            )
            .expect("insert taken port");
    }
    dp.check(ingress(
        "NodePort SYN without a free SNAT port: dropped",
        syn.bytes(),
        TC_ACT_SHOT,
        Expect::Dropped,
        // The backend was picked before the SNAT port ran out.
        &[
            (Counter::DropSnatPortsExhausted, 1),
            (Counter::PickRandom, 1),
        ],
    ));
    let local = Pkt::tcp(EXT_CLIENT, 44_001, NODE_IP, NODE_PORT + 2, SYN);
    dp.check(ingress(
        "eTP=Local NodePort without local endpoints: dropped",
        local.bytes(),
        TC_ACT_SHOT,
        Expect::Dropped,
        &[(Counter::DropNoLocalEndpoints, 1)],
    ));
    logger.flush();
    let got = records.messages();
    assert_eq!(
        got,
        vec![
            (
                log::Level::Warn,
                format!(
                    "{EXT_CLIENT}:44000 -> {NODE_IP}:{NODE_PORT}: no SNAT port toward backend {REMOTE_BE}:8080: dropped"
                )
            ),
            (
                log::Level::Info,
                format!(
                    "tcp {EXT_CLIENT}:44001 -> {NODE_IP}:{}: no local endpoints: dropped",
                    NODE_PORT + 2
                )
            ),
        ]
    );
}

/// A SNATed NodePort flow taken over from netfilter (its conntrack and SNAT entries flagged
/// `NETFILTER`): the client's packets and the backend's replies arriving on ingress pass
/// untouched while netfilter translates them, are dropped while its entry is deleted
/// (`HANDOFF`), then are translated by the datapath.
#[test]
fn a_snated_flow_taken_over_from_netfilter_passes_until_it_is_handed_over() {
    let mut dp = nodeport_datapath();
    dp.set_node_addr(NODE_IP);
    let syn = Pkt::tcp(EXT_CLIENT, 40_100, NODE_IP, NODE_PORT, SYN);
    dp.check(ingress(
        "the flow's SYN",
        syn.bytes(),
        TC_NEXT,
        Expect::Packet(with_dst(&syn, REMOTE_BE, 8080)),
        &[
            (Counter::NewFlow, 1),
            (Counter::SnatNew, 1),
            (Counter::SnatPortKept, 1),
        ],
    ));
    let nat_port = u16::from_be_bytes(
        dp.snat()
            .get(&snat_out_key(&syn, REMOTE_BE, 8080), 0)
            .expect("SNAT out entry")
            .port,
    );
    let in_key = snat_in_key(REMOTE_BE, 8080, nat_port, proto::TCP);
    let original = original_key(&syn);
    let set_flags = |dp: &mut Datapath, flags: u8| {
        let clear = !(ct_flags::NETFILTER | ct_flags::HANDOFF);
        let mut ct = dp.ct(&original).expect("ORIGINAL entry");
        ct.flags = (ct.flags & clear) | flags;
        dp.conntrack().insert(original, ct, 0).expect("written");
        let mut inn = dp.snat().get(&in_key, 0).expect("SNAT in entry");
        inn.flags = (inn.flags & clear) | flags;
        dp.snat().insert(in_key, inn, 0).expect("written");
    };
    let ack = Pkt::tcp(EXT_CLIENT, 40_100, NODE_IP, NODE_PORT, ACK).payload(b"GET /");
    let answer = Pkt::tcp(REMOTE_BE, 8080, NODE_IP, nat_port, ACK).payload(b"200");
    set_flags(&mut dp, ct_flags::NETFILTER);
    for (what, p) in [
        ("the client's packet", &ack),
        ("the backend's reply", &answer),
    ] {
        dp.check(ingress(
            &format!("netfilter still translates it: {what} passes untouched"),
            p.bytes(),
            TC_NEXT,
            Expect::Unchanged,
            &[(Counter::NetfilterFlow, 1)],
        ));
    }
    set_flags(&mut dp, ct_flags::NETFILTER | ct_flags::HANDOFF);
    for (what, p) in [
        ("the client's packet", &ack),
        ("the backend's reply", &answer),
    ] {
        dp.check(ingress(
            &format!("netfilter's entry being deleted: {what} is dropped"),
            p.bytes(),
            TC_ACT_SHOT,
            Expect::Dropped,
            &[(Counter::DropTakeoverHandoff, 1)],
        ));
    }
    set_flags(&mut dp, 0);
    dp.check(ingress(
        "handed over: the client's packet is DNATed",
        ack.bytes(),
        TC_NEXT,
        Expect::Packet(with_dst(&ack, REMOTE_BE, 8080)),
        &[(Counter::EstablishedFlow, 1)],
    ));
    dp.check(ingress(
        "handed over: the backend's reply goes back to the client",
        answer.bytes(),
        TC_NEXT,
        Expect::Packet(with_dst(&answer, EXT_CLIENT, 40_100)),
        &[(Counter::SnatReplyTranslated, 1)],
    ));
}

/// The `in` entry of the SNATed flow on the node's `port` toward `REMOTE_BE:8080`, rewritten with
/// `state`, `flags` and a last packet `ago` before now (as the flow would have left it).
fn age_snat_in_entry(dp: &mut Datapath, port: u16, state: u8, flags: u8, ago: Duration) {
    let key = snat_in_key(REMOTE_BE, 8080, port, proto::TCP);
    let mut v = dp.snat().get(&key, 0).expect("the flow's `in` entry");
    v.state = state;
    v.flags = flags;
    v.last_seen_ns = monotonic_ns() - ago.as_nanos() as u64;
    dp.snat()
        .insert(key, v, 0)
        .expect("rewriting the `in` entry");
}

/// The client (address, port) the `in` entry of the node's `port` toward `REMOTE_BE:8080` holds.
fn snat_in_client(dp: &mut Datapath, port: u16) -> Option<(Ipv4Addr, u16)> {
    let v = dp
        .snat()
        .get(&snat_in_key(REMOTE_BE, 8080, port, proto::TCP), 0)
        .ok()?;
    Some((Ipv4Addr::from(v.addr), u16::from_be_bytes(v.port)))
}

/// A new client's SYN to the NodePort from `PORT`, DNATed to `REMOTE_BE:8080`, moving `counts`.
fn new_client(dp: &mut Datapath, client: Ipv4Addr, what: &str, counts: &[(Counter, u64)]) -> Pkt {
    let syn = Pkt::tcp(client, SNAT_TEST_PORT, NODE_IP, NODE_PORT, SYN);
    dp.check(ingress(
        what,
        syn.bytes(),
        TC_NEXT,
        Expect::Packet(with_dst(&syn, REMOTE_BE, 8080)),
        counts,
    ));
    syn
}

/// The client port of [`new_client`]'s flows.
const SNAT_TEST_PORT: u16 = 40_100;

/// Like MASQUERADE: a NodePort flow SNATed to the node keeps its client's port while that tuple
/// is free; a second client on the same port walks on; the port is taken over from a flow whose
/// SYN went unanswered for `SNAT_UNANSWERED_SYN_HOLD_S` and, by a new SYN, from a closed flow
/// (never from a live one). A connection the node opens from that port to the same backend is
/// given another source port while the SNATed flow lives, and both get their own replies; once
/// the SNATed flow has closed, the node's connection takes the tuple as it is.
#[test]
fn a_snated_flow_keeps_its_port_closed_and_unanswered_flows_give_it_up_and_the_node_remaps_its_own()
{
    let mut dp = nodeport_datapath();
    dp.set_node_addr(NODE_IP);
    const PORT: u16 = SNAT_TEST_PORT;
    let kept = &[
        (Counter::NewFlow, 1),
        (Counter::SnatNew, 1),
        (Counter::SnatPortKept, 1),
    ];
    new_client(&mut dp, EXT_CLIENT, "first client: its own port kept", kept);
    assert_eq!(snat_in_client(&mut dp, PORT), Some((EXT_CLIENT, PORT)));

    // Another client on the same port while the first flow's SYN is fresh: the walk.
    let second = new_client(
        &mut dp,
        OTHER,
        "second client on the same port: the next port of its walk",
        &[(Counter::NewFlow, 1), (Counter::SnatNew, 1)],
    );
    let walked = snat_probe_port(
        &with_dst(&second, REMOTE_BE, 8080),
        REMOTE_BE,
        8080,
        true,
        1,
    );
    assert_ne!(walked, PORT);
    assert_eq!(snat_in_client(&mut dp, walked), Some((OTHER, PORT)));
    assert_eq!(
        snat_in_client(&mut dp, PORT),
        Some((EXT_CLIENT, PORT)),
        "the live flow's entry is untouched"
    );

    // The first flow's SYN unanswered past the hold: a third client takes the port.
    let hold = Duration::from_secs(proxy_common::SNAT_UNANSWERED_SYN_HOLD_S);
    age_snat_in_entry(
        &mut dp,
        PORT,
        ct_state::SYN_SENT,
        0,
        hold - Duration::from_secs(1),
    );
    let third_client = Ipv4Addr::new(192, 168, 50, 101);
    new_client(
        &mut dp,
        third_client,
        "third client while the unanswered SYN is within its hold: walks on",
        &[(Counter::NewFlow, 1), (Counter::SnatNew, 1)],
    );
    assert_eq!(snat_in_client(&mut dp, PORT), Some((EXT_CLIENT, PORT)));
    age_snat_in_entry(
        &mut dp,
        PORT,
        ct_state::SYN_SENT,
        0,
        hold + Duration::from_secs(1),
    );
    let fourth_client = Ipv4Addr::new(192, 168, 50, 102);
    new_client(
        &mut dp,
        fourth_client,
        "a client after the SYN went unanswered past its hold: the port is reclaimed",
        kept,
    );
    assert_eq!(snat_in_client(&mut dp, PORT), Some((fourth_client, PORT)));

    // An answered, established flow holds its port; closed (both FINs seen), a new SYN takes it.
    age_snat_in_entry(
        &mut dp,
        PORT,
        ct_state::ESTABLISHED,
        ct_flags::SEEN_REPLY,
        Duration::from_secs(60),
    );
    let fifth_client = Ipv4Addr::new(192, 168, 50, 103);
    new_client(
        &mut dp,
        fifth_client,
        "a client while the port's flow is established and idle 60 s: walks on",
        &[(Counter::NewFlow, 1), (Counter::SnatNew, 1)],
    );
    age_snat_in_entry(
        &mut dp,
        PORT,
        ct_state::CLOSING,
        ct_flags::SEEN_REPLY,
        Duration::ZERO,
    );
    let sixth_client = Ipv4Addr::new(192, 168, 50, 104);
    new_client(
        &mut dp,
        sixth_client,
        "a new SYN takes the port of a flow that has just closed (TIME_WAIT reuse)",
        kept,
    );
    assert_eq!(snat_in_client(&mut dp, PORT), Some((sixth_client, PORT)));

    // The node opens a connection from the same port to the same backend while that flow lives.
    age_snat_in_entry(
        &mut dp,
        PORT,
        ct_state::ESTABLISHED,
        ct_flags::SEEN_REPLY,
        Duration::from_secs(1),
    );
    let host_syn = Pkt::tcp(NODE_IP, PORT, REMOTE_BE, 8080, SYN);
    let remapped = snat_probe_port(&host_syn, REMOTE_BE, 8080, true, 1);
    dp.check(egress(
        "the node's own SYN on a tuple a live SNATed flow holds: another source port",
        host_syn.bytes(),
        TC_NEXT,
        Expect::Packet(with_src(&host_syn, NODE_IP, remapped)),
        &[
            (Counter::SnatTranslated, 1),
            (Counter::SnatNew, 1),
            (Counter::SnatNodeConnectionRemapped, 1),
        ],
    ));
    let synack = Pkt::tcp(REMOTE_BE, 8080, NODE_IP, remapped, SYN | ACK);
    dp.check(ingress(
        "the backend's answer to the node's connection: back to the node's own port",
        synack.bytes(),
        TC_NEXT,
        Expect::Packet(with_dst(&synack, NODE_IP, PORT)),
        &[(Counter::SnatReplyTranslated, 1)],
    ));
    let flow_reply = Pkt::tcp(REMOTE_BE, 8080, NODE_IP, PORT, ACK);
    dp.check(ingress(
        "the SNATed flow's reply still goes to its client",
        flow_reply.bytes(),
        TC_NEXT,
        Expect::Packet(with_dst(&flow_reply, sixth_client, PORT)),
        &[(Counter::SnatReplyTranslated, 1)],
    ));
    let host_ack = Pkt::tcp(NODE_IP, PORT, REMOTE_BE, 8080, ACK);
    dp.check(egress(
        "the node's connection keeps its remapped port",
        host_ack.bytes(),
        TC_NEXT,
        Expect::Packet(with_src(&host_ack, NODE_IP, remapped)),
        &[(Counter::SnatTranslated, 1)],
    ));

    // The SNATed flow closed: the node's next connection on that tuple leaves as it is, and
    // the closed flow's entry is gone.
    age_snat_in_entry(
        &mut dp,
        PORT,
        ct_state::CLOSING,
        ct_flags::SEEN_REPLY,
        Duration::ZERO,
    );
    let host_udp = Pkt::udp(NODE_IP, PORT, REMOTE_BE, 8080);
    dp.check(egress(
        "a UDP datagram of the node on a free tuple: untouched",
        host_udp.bytes(),
        TC_NEXT,
        Expect::Unchanged,
        &[(Counter::ReplyNotTracked, 1)],
    ));
    dp.snat()
        .remove(&snat_out_key(&host_syn, REMOTE_BE, 8080))
        .expect("forgetting the node's first connection");
    let host_again = Pkt::tcp(NODE_IP, PORT, REMOTE_BE, 8080, SYN);
    dp.check(egress(
        "the node's SYN on the tuple of a closed SNATed flow: untouched, the tuple given up",
        host_again.bytes(),
        TC_NEXT,
        Expect::Unchanged,
        &[(Counter::ReplyNotTracked, 1)],
    ));
    assert_eq!(snat_in_client(&mut dp, PORT), None);
}

/// A port a socket of the node holds (a TCP listener, a bound UDP socket) is not given to a
/// SNATed flow, even as its client's own: the walk goes on. Run in a network namespace of its
/// own (the sockets live there; the test run's packets are looked up in it).
#[test]
fn a_snat_port_a_socket_of_the_node_holds_is_skipped() {
    let mut dp = nodeport_datapath();
    dp.set_node_addr(NODE_IP);
    std::thread::scope(|s| {
        s.spawn(|| {
            nix::sched::unshare(nix::sched::CloneFlags::CLONE_NEWNET)
                .expect("a network namespace for this thread");
            let _tcp = std::net::TcpListener::bind("0.0.0.0:40200").expect("TCP listener");
            let _udp = std::net::UdpSocket::bind("0.0.0.0:40201").expect("UDP socket");
            for (what, syn, bport) in [
                (
                    "TCP",
                    Pkt::tcp(EXT_CLIENT, 40_200, NODE_IP, NODE_PORT, SYN),
                    8080,
                ),
                (
                    "UDP",
                    Pkt::udp(EXT_CLIENT, 40_201, NODE_IP, NODE_PORT),
                    5353,
                ),
            ] {
                let fwd = with_dst(&syn, REMOTE_BE, bport);
                dp.check(ingress(
                    &format!("{what}: the client's port is a socket's: the next port"),
                    syn.bytes(),
                    TC_NEXT,
                    Expect::Packet(fwd.clone()),
                    &[
                        (Counter::NewFlow, 1),
                        (Counter::SnatNew, 1),
                        (Counter::SnatPortLocalSocket, 1),
                    ],
                ));
                let out = dp
                    .snat()
                    .get(&snat_out_key(&syn, REMOTE_BE, bport), 0)
                    .expect("out entry");
                assert_eq!(
                    u16::from_be_bytes(out.port),
                    snat_probe_port(&fwd, REMOTE_BE, bport, true, 1),
                    "{what}"
                );
            }
            // Without the sockets the client's port is kept.
            let free = Pkt::tcp(EXT_CLIENT, 40_202, NODE_IP, NODE_PORT, SYN);
            dp.check(ingress(
                "TCP: a port no socket holds: kept",
                free.bytes(),
                TC_NEXT,
                Expect::Packet(with_dst(&free, REMOTE_BE, 8080)),
                &[
                    (Counter::NewFlow, 1),
                    (Counter::SnatNew, 1),
                    (Counter::SnatPortKept, 1),
                ],
            ));
        });
    });
}

/// The same new flow's first packet on two CPUs at once (a SYN and its retransmission, or two
/// datagrams of a new UDP flow, taken by two receive queues): one of them creates the flow and
/// the other follows it, so both leave for the same backend and the round-robin frontend's
/// flow is counted once. Each round sends one new flow's SYN on two CPUs at once
/// (`common_datapath::race_on_two_cpus`, which lines the two runs up within a few hundred
/// nanoseconds: most rounds race); before, the racing rounds split (each CPU created the flow
/// with its own pick).
#[test]
fn a_flow_opened_on_two_cpus_at_once_goes_to_one_backend() {
    let mut dp = Datapath::load().with_services();
    dp.round_robin_on_vip();
    let fd = dp.ingress_fd();
    const ROUNDS: u16 = 4_000;
    let syn = |r: u16| Pkt::tcp(CLIENT, 20_000 + r, VIP, 80, SYN);
    let runs = common_datapath::race_on_two_cpus(fd, ROUNDS as usize, |_, r| syn(r as u16).bytes());
    let mut split = Vec::new();
    for (r, round) in (0..ROUNDS).zip(&runs) {
        let to = |cpu: usize| {
            let (verdict, out) = &round[cpu];
            assert_eq!(*verdict, TC_NEXT, "round {r} on CPU {cpu}");
            Decoded::parse(out).daddr
        };
        let ct = dp.ct(&original_key(&syn(r))).expect("the flow's entry");
        let kept = Ipv4Addr::from(ct.backend_addr);
        if to(0) != to(1) || to(0) != kept {
            split.push((r, to(0), to(1), kept));
        }
    }
    println!(
        "{ROUNDS} flows opened on two CPUs at once: {} followed the other CPU's, {} split",
        dp.counter(Counter::ConntrackInsertRaced),
        split.len()
    );
    assert!(
        split.is_empty(),
        "flows whose two first packets left for different backends, or not for the one the \
         entry keeps (round, CPU 0, CPU 1, entry): {:?}",
        &split[..split.len().min(10)]
    );
    assert_eq!(
        dp.ct_len(),
        2 * ROUNDS as usize,
        "one flow, two entries, per round"
    );
}

/// Two new flows with one reply tuple (the same client port to two ClusterIPs that share their
/// one backend) created on two CPUs at once never both keep it: one moves to another source
/// port, or, when both found the tuple free at the same instant, the later insert is refused and
/// its packet dropped (`drop_conntrack_insert_failed`, netfilter's insert_failed; the SYN's
/// retransmission picks again). Before, both wrote the REPLY entry and the first flow's replies
/// were reverse-translated as the second's frontend.
#[test]
fn two_flows_with_one_reply_tuple_on_two_cpus_at_once_never_share_it() {
    const VIP2: Ipv4Addr = Ipv4Addr::new(10, 96, 0, 11);
    let mut dp = Datapath::load().with_services();
    dp.set_service(VIP, 80, proto::TCP, TCP_REVNAT, &[1]);
    dp.set_service(VIP2, 80, proto::TCP, 5, &[1]);
    let fd = dp.ingress_fd();
    const ROUNDS: usize = 4_000;
    let runs = common_datapath::race_on_two_cpus(fd, ROUNDS, |cpu, r| {
        let vip = if cpu == 0 { VIP } else { VIP2 };
        Pkt::tcp(CLIENT, 20_000 + r as u16, vip, 80, SYN).bytes()
    });
    let mut shared = Vec::new();
    for (r, round) in runs.iter().enumerate() {
        let sport = |cpu: usize| {
            let (verdict, out) = &round[cpu];
            match *verdict {
                TC_NEXT => Some(u16::from_be_bytes([out[ETH_HLEN + 20], out[ETH_HLEN + 21]])),
                TC_ACT_SHOT => None,
                v => panic!("round {r} on CPU {cpu}: verdict {v}"),
            }
        };
        match (sport(0), sport(1)) {
            (Some(a), Some(b)) if a == b => shared.push((r, a)),
            (None, None) => panic!("round {r}: both flows dropped"),
            _ => {}
        }
    }
    println!(
        "{ROUNDS} pairs of flows with one reply tuple on two CPUs at once: {} moved, {} refused \
         at the insert, {} shared the tuple",
        dp.counter(Counter::ReplyTupleRemapped),
        dp.counter(Counter::DropConntrackInsertFailed),
        shared.len()
    );
    assert!(
        shared.is_empty(),
        "pairs that both left with one source port toward one backend (round, port): {:?}",
        &shared[..shared.len().min(10)]
    );
}

/// Two new SNATed flows that both want the port of one idle flow (two external clients on the
/// same source port, the port's holder a SYN unanswered past its hold) on two CPUs at once:
/// only one takes the port over (`claim_idle`, a compare-and-exchange on the holder's last-seen
/// time); the other walks on to another port. Before, both overwrote the entry and their `out`
/// entries named one node port toward one backend, so the backend's replies for one of them
/// reached the other's client.
#[test]
fn two_flows_reclaiming_one_idle_snat_port_on_two_cpus_at_once_never_share_it() {
    let mut dp = nodeport_datapath();
    dp.set_node_addr(NODE_IP);
    // Batches of 2,000 rounds (12,000 of the test maps' 16,384 conntrack entries), the flow
    // maps emptied between them.
    const BATCHES: usize = 2;
    const ROUNDS: usize = 2_000;
    let port = |r: usize| 20_000 + r as u16;
    let holder = Ipv4Addr::new(192, 168, 50, 110);
    let racers = [
        Ipv4Addr::new(192, 168, 50, 111),
        Ipv4Addr::new(192, 168, 50, 112),
    ];
    let hold = Duration::from_secs(proxy_common::SNAT_UNANSWERED_SYN_HOLD_S);
    let fd = dp.ingress_fd();
    let mut shared = Vec::new();
    let mut taken_over = 0;
    for batch in 0..BATCHES {
        for r in 0..ROUNDS {
            let syn = Pkt::tcp(holder, port(r), NODE_IP, NODE_PORT, SYN);
            assert_eq!(dp.run(PROG_TC_INGRESS, &syn.bytes()).0, TC_NEXT);
            age_snat_in_entry(
                &mut dp,
                port(r),
                ct_state::SYN_SENT,
                0,
                hold + Duration::from_secs(1),
            );
        }
        let runs = common_datapath::race_on_two_cpus(fd, ROUNDS, |cpu, r| {
            Pkt::tcp(racers[cpu], port(r), NODE_IP, NODE_PORT, SYN).bytes()
        });
        for (r, round) in runs.iter().enumerate() {
            // The node port each flow's `out` entry names (egress rewrites the source by it).
            let mut left = |cpu: usize| {
                let (verdict, out) = &round[cpu];
                assert_eq!(*verdict, TC_NEXT, "batch {batch} round {r} on CPU {cpu}");
                assert_eq!(Decoded::parse(out).daddr, REMOTE_BE);
                let racer = Pkt::tcp(racers[cpu], port(r), NODE_IP, NODE_PORT, SYN);
                let out = (dp.snat())
                    .get(&snat_out_key(&racer, REMOTE_BE, 8080), 0)
                    .expect("the racer's `out` entry");
                u16::from_be_bytes(out.port)
            };
            let (a, b) = (left(0), left(1));
            if a == b {
                shared.push((batch, r, a));
            }
            taken_over += usize::from(a == port(r) || b == port(r));
        }
        dp.clear_flows();
    }
    const PAIRS: usize = BATCHES * ROUNDS;
    println!(
        "{PAIRS} pairs of flows reclaiming one idle SNAT port on two CPUs at once: {taken_over} \
         took the port over, {} shared one port",
        shared.len()
    );
    // A loser's walk may land on a later round's idle port and take that over first.
    assert!(
        taken_over > PAIRS / 2,
        "the idle ports were taken over ({taken_over} of {PAIRS})"
    );
    assert!(
        shared.is_empty(),
        "pairs whose `out` entries name one node port toward one backend (batch, round, port): {:?}",
        &shared[..shared.len().min(10)]
    );
}

/// A late packet of a backend whose flow lost its ORIGINAL entry (LRU) after the client opened a
/// new flow on the same tuple to another backend moves only its own REPLY entry: the new flow
/// keeps its state and its least-connection unit. Before, the old backend's FIN half-closed the
/// new flow (and a RST would have closed it and given back its unit).
#[test]
fn a_late_reply_of_an_evicted_flow_never_moves_the_flow_now_on_its_tuple() {
    let mut dp = Datapath::load().with_services();
    dp.round_robin_on_vip();
    let syn = Pkt::tcp(CLIENT, 41_000, VIP, 80, SYN);
    let (verdict, out) = dp.run(PROG_TC_INGRESS, &syn.bytes());
    assert_eq!(verdict, TC_NEXT);
    let first = Decoded::parse(&out).daddr;
    dp.conntrack()
        .remove(&original_key(&syn))
        .expect("evicting the first flow's ORIGINAL entry");
    let (verdict, out) = dp.run(PROG_TC_INGRESS, &syn.bytes());
    assert_eq!(verdict, TC_NEXT);
    let second = Decoded::parse(&out).daddr;
    assert_ne!(
        first, second,
        "round robin: the new flow goes to the other backend"
    );
    let before = dp.ct(&original_key(&syn)).expect("the new flow's entry");
    assert_eq!(Ipv4Addr::from(before.backend_addr), second);

    // The first backend's FIN (its connection is still open on its side).
    let fin = Pkt::tcp(first, 8080, CLIENT, 41_000, FIN | ACK);
    let (verdict, _) = dp.run(PROG_TC_EGRESS, &fin.bytes());
    assert_eq!(verdict, TC_NEXT);
    let after = dp.ct(&original_key(&syn)).expect("the new flow's entry");
    assert_eq!(
        (after.state, after.flags, Ipv4Addr::from(after.backend_addr)),
        (before.state, before.flags, second),
        "the new flow's entry is as it was (state {} before)",
        before.state
    );
}
