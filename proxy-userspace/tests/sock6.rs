//! Privileged: the IPv6 cgroup socket hooks (connect6, sendmsg6, recvmsg6, getpeername6) with
//! real sockets. A test namespace stands for the node: its loopback holds the "backend"
//! addresses (fd00:244::5 and 10.244.0.5) with real servers on them, and nothing routes the
//! Service addresses (fd00:96::/64, 10.96.0.0/12), so a client reaches them only if the hooks
//! translate. The object is loaded by the test with the namespace's cookie, attached through
//! `sock_lb::reconcile` to a cgroup the test creates, and the Services are written straight into
//! the maps (the agent does not program IPv6 Services yet).
//!
//! Run by `sudo cargo xtask test` (KPE_PRIVILEGED=1); skipped otherwise.

use std::{collections::BTreeMap, net::Ipv6Addr, time::Duration};

use aya::{
    Ebpf, EbpfLoader,
    maps::{
        Array, HashMap, MapData,
        lpm_trie::{Key, LpmTrie},
    },
};
use kube_proxy_ebpf::dataplane::{
    bpffs::PinLayout,
    ebpf_object::EBPF_OBJECT,
    loader,
    sock_lb::{self, SockHook},
};
use proxy_common::{
    AffinityValue, Backend, CONFIG_GLOBAL, DatapathConfig, MAP_BACKENDS, MAP_SERVICES,
    SCOPE_INTERNAL, SOCK_LB_GLOBAL, ServiceKey, ServiceValue, SockLbConfig,
    ipv6::{
        Affinity6Key, Backend6, MAP_AFFINITY6, MAP_BACKENDS6, MAP_NODE6, MAP_SERVICE_CIDRS6,
        MAP_SERVICES6, MAP_SOCK_REVNAT6, MAP_SOURCE_RANGES6, Node6Info,
        SOURCE_RANGE6_FRONTEND_BITS, Service6Key, SourceRange6Key,
    },
    proto, service_cidr, service_flags,
};
use proxy_testenv::{Cgroup, Exec as _, NetNs, PinDir, Proc, require_privileged, unique_prefix};

/// An IPv6 ClusterIP with TCP :80 and UDP :53.
const VIP6: Ipv6Addr = Ipv6Addr::new(0xfd00, 0x96, 0, 0, 0, 0, 0, 0x10);
/// An IPv6 ClusterIP whose Service has no endpoints (TCP :80).
const EMPTY6: Ipv6Addr = Ipv6Addr::new(0xfd00, 0x96, 0, 0, 0, 0, 0, 0x99);
/// An externalTrafficPolicy Local frontend with no local endpoint and an in-cluster entry.
const LOCAL6: Ipv6Addr = Ipv6Addr::new(0xfd00, 0x96, 0, 0, 0, 0, 0, 0x20);
/// The IPv6 backend (on the namespace's loopback).
const BACKEND6: Ipv6Addr = Ipv6Addr::new(0xfd00, 0x244, 0, 0, 0, 0, 0, 5);
/// An IPv4 ClusterIP (TCP :80, UDP :53), reached from IPv6 sockets as ::ffff:10.96.0.10.
const VIP4: [u8; 4] = [10, 96, 0, 10];
const BACKEND4: [u8; 4] = [10, 244, 0, 5];
/// The node's IPv6 address as the agent writes it to `NODE6_V1` (on no interface: the hooks
/// only use it as the node's client address).
const NODE6: Ipv6Addr = Ipv6Addr::new(0xfd00, 0x10, 0, 0, 0, 0, 0, 1);
/// An IPv6 LoadBalancer IP whose source ranges hold `NODE6`, and one whose ranges do not.
const LB_IN6: Ipv6Addr = Ipv6Addr::new(0xfd00, 0xab, 0, 0, 0, 0, 0, 1);
const LB_OUT6: Ipv6Addr = Ipv6Addr::new(0xfd00, 0xab, 0, 0, 0, 0, 0, 2);
/// An IPv6 ClusterIP with ClientIP session affinity (TCP :80).
const AFFINITY6: Ipv6Addr = Ipv6Addr::new(0xfd00, 0x96, 0, 0, 0, 0, 0, 0x30);
const TCP_PORT: u16 = 8080;
const UDP_PORT: u16 = 5353;

/// Dual-stack servers on every address of the namespace: TCP answers with the address it was
/// reached on (getsockname), UDP echoes with it.
const SERVERS_PY: &str = r#"
import socket, sys, threading
def tcp():
    s = socket.socket(socket.AF_INET6, socket.SOCK_STREAM)
    s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("::", int(sys.argv[1])))
    s.listen(16)
    while True:
        c, _ = s.accept()
        c.sendall(("tcp " + c.getsockname()[0]).encode())
        c.close()
def udp():
    s = socket.socket(socket.AF_INET6, socket.SOCK_DGRAM)
    s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
    s.bind(("::", int(sys.argv[2])))
    while True:
        data, peer = s.recvfrom(2048)
        s.sendto(b"udp " + data, peer)
threading.Thread(target=udp, daemon=True).start()
print("ready", flush=True)
tcp()
"#;

/// The client: one line per check, `name result...` (errors as `name error <errno name>`).
const CLIENT_PY: &str = r#"
import errno, socket, sys
vip6, empty6, vip4m = sys.argv[1], sys.argv[2], sys.argv[3]
def tcp(name, addr, port):
    s = socket.socket(socket.AF_INET6, socket.SOCK_STREAM)
    s.settimeout(3)
    try:
        s.connect((addr, port))
        peer = s.getpeername()
        data = s.recv(200).decode()
        print(name, "peer", "[%s]:%d" % peer[:2], "got", data.replace(" ", "_"))
    except OSError as e:
        print(name, "error", errno.errorcode.get(e.errno, str(e)))
def udp(name, addr, port, connected):
    s = socket.socket(socket.AF_INET6, socket.SOCK_DGRAM)
    s.settimeout(3)
    try:
        if connected:
            s.connect((addr, port))
            s.send(b"ping")
            peer = s.getpeername()
            data, frm = s.recvfrom(200)
            print(name, "peer", "[%s]:%d" % peer[:2], "from", "[%s]:%d" % frm[:2], "got", data.decode().replace(" ", "_"))
        else:
            s.sendto(b"ping", (addr, port))
            data, frm = s.recvfrom(200)
            print(name, "from", "[%s]:%d" % frm[:2], "got", data.decode().replace(" ", "_"))
    except OSError as e:
        print(name, "error", errno.errorcode.get(e.errno, str(e)))
tcp("tcp6", vip6, 80)
udp("udp6", vip6, 53, False)
udp("udp6_connected", vip6, 53, True)
tcp("tcp_mapped", vip4m, 80)
udp("udp_mapped", vip4m, 53, False)
tcp("tcp6_empty", empty6, 80)
tcp("tcp6_other_port", vip6, 81)
tcp("tcp6_unallocated", "fd00:96::77", 80)
tcp("tcp6_local", sys.argv[4], 80)
tcp("tcp6_lb_in", sys.argv[5], 80)
tcp("tcp6_lb_out", sys.argv[6], 80)
tcp("tcp6_affinity", sys.argv[7], 80)
"#;

struct Node {
    // Dropped in this order: client processes and servers, then the namespace, the cgroup and
    // the pinned links.
    _servers: Proc,
    ns: NetNs,
    cgroup: Cgroup,
    bpf: Ebpf,
    _pins: PinDir,
}

impl Node {
    /// The namespace with its servers, the object loaded with its netns cookie and the eight
    /// hooks attached to a new cgroup.
    fn start() -> Self {
        proxy_testenv::ensure_bpffs().expect("bpffs");
        let prefix = unique_prefix();
        let ns = NetNs::new(&format!("{prefix}-s6")).expect("namespace");
        ns.exec(&[
            "ip",
            "-6",
            "addr",
            "add",
            &format!("{BACKEND6}/128"),
            "dev",
            "lo",
            "nodad",
        ])
        .expect("IPv6 backend address");
        ns.exec(&["ip", "addr", "add", "10.244.0.5/32", "dev", "lo"])
            .expect("IPv4 backend address");
        let cookie: u64 = ns
            .exec(&[
                "python3",
                "-c",
                "import socket; s = socket.socket(); \
                 print(int.from_bytes(s.getsockopt(socket.SOL_SOCKET, 71, 8), 'little'))",
            ])
            .expect("SO_NETNS_COOKIE")
            .trim()
            .parse()
            .expect("cookie");
        let mut servers = ns
            .spawn(
                &[
                    "python3",
                    "-u",
                    "-c",
                    SERVERS_PY,
                    &TCP_PORT.to_string(),
                    &UDP_PORT.to_string(),
                ],
                None,
            )
            .expect("servers");
        let cgroup = Cgroup::new(&format!("{prefix}-s6")).expect("cgroup");
        let pins_dir = PinDir::new(&format!("{prefix}-s6")).expect("pin dir");
        let pins = PinLayout::new(pins_dir.path());
        pins.create().expect("pin directories");
        let mut bpf = EbpfLoader::new()
            .override_global(CONFIG_GLOBAL, &DatapathConfig::DEFAULT, true)
            .override_global(
                SOCK_LB_GLOBAL,
                &SockLbConfig {
                    netns_cookie: cookie,
                },
                true,
            )
            .load(EBPF_OBJECT)
            .expect("loading the object (root?)");
        loader::load_programs(&mut bpf).expect("verifier");
        let report = sock_lb::reconcile(&mut bpf, &pins, Some(cgroup.path())).expect("attach");
        assert_eq!(report.attached, SockHook::ALL.to_vec(), "all eight hooks");
        // The servers listen before any client runs (bounded: 5 s).
        let deadline = std::time::Instant::now() + Duration::from_secs(5);
        while !ns
            .exec(&["ss", "-Hltn", &format!("sport = :{TCP_PORT}")])
            .is_ok_and(|out| !out.trim().is_empty())
        {
            assert!(
                std::time::Instant::now() < deadline,
                "servers did not listen: {}",
                servers
                    .try_wait()
                    .map(|s| format!("{s:?}"))
                    .unwrap_or_default()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        Self {
            _servers: servers,
            ns,
            cgroup,
            bpf,
            _pins: pins_dir,
        }
    }

    fn services6(&mut self) -> HashMap<&mut MapData, Service6Key, ServiceValue> {
        HashMap::try_from(self.bpf.map_mut(MAP_SERVICES6).expect("SERVICES6")).expect("map")
    }

    /// An IPv6 Service the way the agent writes one: backends → slots → frontend.
    fn set_service6(&mut self, vip: Ipv6Addr, port: u16, proto: u8, backends: &[(u32, u16)]) {
        let key = Service6Key::new(vip.octets(), port.to_be_bytes(), proto, 0);
        self.set_frontend6(key, 0, backends);
    }

    /// One frontend entry (any scope) with `flags` and its slots.
    fn set_frontend6(&mut self, key: Service6Key, flags: u16, backends: &[(u32, u16)]) {
        let value = ServiceValue::frontend_with_flags(backends.len() as u16, 1, flags);
        self.set_frontend6_value(key, value, backends);
    }

    /// One frontend entry with its value as given (its `count` from `backends`) and its slots.
    fn set_frontend6_value(
        &mut self,
        key: Service6Key,
        value: ServiceValue,
        backends: &[(u32, u16)],
    ) {
        let proto = key.proto;
        for &(id, backend_port) in backends {
            let b = Backend6 {
                addr: BACKEND6.octets(),
                port: backend_port.to_be_bytes(),
                proto,
                flags: 0,
            };
            let mut map: HashMap<_, u32, Backend6> =
                HashMap::try_from(self.bpf.map_mut(MAP_BACKENDS6).expect("BACKENDS6"))
                    .expect("map");
            map.insert(id, b, 0).expect("backend");
        }
        for (slot, &(id, _)) in backends.iter().enumerate() {
            self.services6()
                .insert(key.with_slot(slot as u16 + 1), ServiceValue::slot(id), 0)
                .expect("slot");
        }
        let value = ServiceValue {
            count: backends.len() as u16,
            ..value
        };
        self.services6().insert(key, value, 0).expect("frontend");
    }

    /// The node's IPv6 address in `NODE6_V1`, as the agent writes it.
    fn set_node6(&mut self, addr: Ipv6Addr) {
        let mut node: Array<_, Node6Info> =
            Array::try_from(self.bpf.map_mut(MAP_NODE6).expect("NODE6")).expect("map");
        node.set(
            0,
            Node6Info {
                snat_addr: addr.octets(),
            },
            0,
        )
        .expect("node address");
    }

    /// A loadBalancerSourceRanges prefix of an IPv6 frontend (TCP :80).
    fn set_source_range6(&mut self, lb: Ipv6Addr, range: Ipv6Addr, prefix_len: u32) {
        let mut trie: LpmTrie<_, SourceRange6Key, u32> =
            LpmTrie::try_from(self.bpf.map_mut(MAP_SOURCE_RANGES6).expect("SRCRANGES6"))
                .expect("map");
        let data = SourceRange6Key {
            frontend_addr: lb.octets(),
            frontend_port: 80u16.to_be_bytes(),
            proto: proto::TCP,
            _pad: 0,
            source: range.octets(),
        };
        trie.insert(
            &Key::new(SOURCE_RANGE6_FRONTEND_BITS + prefix_len, data),
            1,
            0,
        )
        .expect("source range");
    }

    /// The IPv4 Service of a v4-mapped address.
    fn set_service4(&mut self, port: u16, proto: u8, id: u32, backend_port: u16) {
        self.set_service4_backends(port, proto, &[(id, backend_port)]);
    }

    /// The IPv4 Service of a v4-mapped address with these backends (id, port on `BACKEND4`).
    fn set_service4_backends(&mut self, port: u16, proto: u8, backends: &[(u32, u16)]) {
        for &(id, backend_port) in backends {
            let b = Backend {
                addr: BACKEND4,
                port: backend_port.to_be_bytes(),
                proto,
                flags: 0,
            };
            let mut map: HashMap<_, u32, Backend> =
                HashMap::try_from(self.bpf.map_mut(MAP_BACKENDS).expect("BACKENDS")).expect("map");
            map.insert(id, b, 0).expect("backend");
        }
        let mut services: HashMap<_, ServiceKey, ServiceValue> =
            HashMap::try_from(self.bpf.map_mut(MAP_SERVICES).expect("SERVICES")).expect("map");
        let key = ServiceKey::new(VIP4, port.to_be_bytes(), proto, 0);
        for (slot, &(id, _)) in backends.iter().enumerate() {
            services
                .insert(key.with_slot(slot as u16 + 1), ServiceValue::slot(id), 0)
                .expect("slot");
        }
        let value = ServiceValue::frontend(backends.len() as u16, 1);
        services.insert(key, value, 0).expect("frontend");
    }

    /// The IPv6 Service CIDR fd00:96::/64 with `VIP6` allocated.
    fn set_service_cidr6(&mut self) {
        let mut trie: LpmTrie<_, [u8; 16], u32> =
            LpmTrie::try_from(self.bpf.map_mut(MAP_SERVICE_CIDRS6).expect("SVCCIDRS6"))
                .expect("map");
        let cidr = Ipv6Addr::new(0xfd00, 0x96, 0, 0, 0, 0, 0, 0);
        trie.insert(&Key::new(64, cidr.octets()), service_cidr::UNALLOCATED, 0)
            .expect("CIDR");
        trie.insert(&Key::new(128, VIP6.octets()), service_cidr::CLUSTER_IP, 0)
            .expect("ClusterIP");
    }

    /// Runs the client in the cgroup and the namespace: check name → its words.
    fn client(&self) -> BTreeMap<String, Vec<String>> {
        let out = self
            .cgroup
            .in_ns(&self.ns)
            .output(
                &[
                    "python3",
                    "-c",
                    CLIENT_PY,
                    &VIP6.to_string(),
                    &EMPTY6.to_string(),
                    "::ffff:10.96.0.10",
                    &LOCAL6.to_string(),
                    &LB_IN6.to_string(),
                    &LB_OUT6.to_string(),
                    &AFFINITY6.to_string(),
                ],
                Duration::from_secs(30),
            )
            .expect("client");
        assert!(
            out.status.success(),
            "client failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout)
            .lines()
            .filter_map(|l| {
                let mut words = l.split_whitespace().map(str::to_owned);
                Some((words.next()?, words.collect()))
            })
            .collect()
    }
}

fn words(s: &str) -> Vec<String> {
    s.split_whitespace().map(str::to_owned).collect()
}

/// IPv6 sockets of the node reach an IPv6 ClusterIP (TCP connect, UDP sendmsg and connected
/// UDP) and an IPv4 one by its v4-mapped address, each at the real server on the backend address,
/// with getpeername()/recvfrom() showing the Service; a Service without endpoints and another
/// port of a ClusterIP are refused, an unallocated Service address fails, and an
/// externalTrafficPolicy Local frontend sends the node to its in-cluster endpoints.
#[test]
fn ipv6_sockets_reach_ipv6_and_v4_mapped_clusterips_through_the_socket_hooks() {
    require_privileged!();
    let mut node = Node::start();
    node.set_service6(VIP6, 80, proto::TCP, &[(1, TCP_PORT)]);
    node.set_service6(VIP6, 53, proto::UDP, &[(2, UDP_PORT)]);
    node.set_service6(EMPTY6, 80, proto::TCP, &[]);
    node.set_service4(80, proto::TCP, 21, TCP_PORT);
    node.set_service4(53, proto::UDP, 22, UDP_PORT);
    node.set_service_cidr6();
    // eTP=Local: the frontend every client uses has no endpoint here, its in-cluster entry
    // (what the node's own traffic uses, as kube-proxy's short-circuit) has one.
    let local = Service6Key::new(LOCAL6.octets(), 80u16.to_be_bytes(), proto::TCP, 0);
    node.set_frontend6(local, service_flags::EXTERNAL_LOCAL, &[]);
    node.set_frontend6(
        Service6Key {
            scope: SCOPE_INTERNAL,
            ..local
        },
        0,
        &[(3, TCP_PORT)],
    );

    let got = node.client();
    eprintln!("client: {got:#?}");
    let check = |name: &str, want: &str| {
        assert_eq!(
            got.get(name),
            Some(&words(want)),
            "{name}: the client saw {:?}",
            got.get(name)
        );
    };
    // The server answers with the address it was reached on: the backend's; the client's
    // getpeername() shows the Service.
    check("tcp6", "peer [fd00:96::10]:80 got tcp_fd00:244::5");
    check("udp6", "from [fd00:96::10]:53 got udp_ping");
    check(
        "udp6_connected",
        "peer [fd00:96::10]:53 from [fd00:96::10]:53 got udp_ping",
    );
    // v4-mapped: translated through the IPv4 maps, the socket stays IPv6.
    check(
        "tcp_mapped",
        "peer [::ffff:10.96.0.10]:80 got tcp_::ffff:10.244.0.5",
    );
    check("udp_mapped", "from [::ffff:10.96.0.10]:53 got udp_ping");
    check("tcp6_empty", "error ECONNREFUSED");
    // As on IPv4 (and upstream's filter-output): a ClusterIP's other port is refused, an
    // unallocated address of the Service CIDR fails at once as a dropped SYN would end.
    check("tcp6_other_port", "error ECONNREFUSED");
    check("tcp6_unallocated", "error ETIMEDOUT");
    check("tcp6_local", "peer [fd00:96::20]:80 got tcp_fd00:244::5");

    // The reverse map holds the IPv6 sockets' frontends as the client named them (TCP,
    // unconnected UDP, connected UDP, and the eTP=Local address, not its in-cluster entry).
    let rev: HashMap<_, proxy_common::ipv6::SockRev6Key, proxy_common::ipv6::RevNat6> =
        HashMap::try_from(node.bpf.map(MAP_SOCK_REVNAT6).expect("SOCKREV6")).expect("map");
    let mut shown: Vec<(Ipv6Addr, u16, u8)> = rev
        .iter()
        .filter_map(Result::ok)
        .inspect(|(k, _)| assert_eq!(k.backend_addr, BACKEND6.octets(), "{k:?}"))
        .map(|(k, v)| (v.addr.into(), u16::from_be_bytes(v.port), k.proto))
        .collect();
    shown.sort();
    assert_eq!(
        shown,
        [
            (VIP6, 53, proto::UDP),
            (VIP6, 53, proto::UDP),
            (VIP6, 80, proto::TCP),
            (LOCAL6, 80, proto::TCP),
        ]
    );
}

/// The node as an IPv6 client is its address in `NODE6_V1` (as the IPv4 hooks use the node's
/// IPv4 address): a LoadBalancer IP with source ranges lets the node through when a range holds
/// that address and refuses it otherwise, and the session affinity record of the node's
/// connect() is keyed by that address.
#[test]
fn the_node_as_an_ipv6_client_is_its_node6_address() {
    require_privileged!();
    let mut node = Node::start();
    node.set_node6(NODE6);
    node.set_service_cidr6();
    for lb in [LB_IN6, LB_OUT6] {
        let key = Service6Key::new(lb.octets(), 80u16.to_be_bytes(), proto::TCP, 0);
        node.set_frontend6(key, service_flags::SOURCE_RANGES, &[(4, TCP_PORT)]);
    }
    // NODE6's /64 for LB_IN6; another /64 for LB_OUT6.
    node.set_source_range6(LB_IN6, Ipv6Addr::new(0xfd00, 0x10, 0, 0, 0, 0, 0, 0), 64);
    node.set_source_range6(LB_OUT6, Ipv6Addr::new(0xfd00, 0x11, 0, 0, 0, 0, 0, 0), 64);
    let affinity = Service6Key::new(AFFINITY6.octets(), 80u16.to_be_bytes(), proto::TCP, 0);
    node.set_frontend6_value(
        affinity,
        ServiceValue {
            affinity_timeout_s: 300,
            affinity_id: 7,
            ..ServiceValue::frontend_with_flags(0, 1, service_flags::AFFINITY)
        },
        &[(5, TCP_PORT)],
    );

    let got = node.client();
    eprintln!("client: {got:#?}");
    let check = |name: &str, want: &str| {
        assert_eq!(
            got.get(name),
            Some(&words(want)),
            "{name}: the client saw {:?}",
            got.get(name)
        );
    };
    check("tcp6_lb_in", "peer [fd00:ab::1]:80 got tcp_fd00:244::5");
    check("tcp6_lb_out", "error ECONNREFUSED");
    check("tcp6_affinity", "peer [fd00:96::30]:80 got tcp_fd00:244::5");

    let records: HashMap<_, Affinity6Key, AffinityValue> =
        HashMap::try_from(node.bpf.map(MAP_AFFINITY6).expect("AFFINITY6")).expect("map");
    let records: Vec<(u32, Ipv6Addr, u32)> = records
        .iter()
        .filter_map(Result::ok)
        .map(|(k, v)| (k.affinity_id, k.client.into(), v.backend_id))
        .collect();
    assert_eq!(records, [(7, NODE6, 5)], "the node's affinity record");
}

/// UDP servers on the given ports (both families): each answers with its own port.
const PORT_ECHO_PY: &str = r#"
import socket, sys, threading
def serve(port):
    s = socket.socket(socket.AF_INET6, socket.SOCK_DGRAM)
    s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
    s.bind(("::", port))
    while True:
        _, peer = s.recvfrom(2048)
        s.sendto(str(port).encode(), peer)
for p in sys.argv[1:]:
    threading.Thread(target=serve, args=(int(p),), daemon=True).start()
print("ready", flush=True)
threading.Event().wait()
"#;

/// One unconnected UDP socket per family sends `n` datagrams to the Service (one answered
/// before the next), prints the ports that answered, waits for the test's flag file, and
/// sends `n` more from the same sockets.
const STICKY_CLIENT_PY: &str = r#"
import os, socket, sys, time
vip6, vip4, flag, n = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
def ports(s, addr):
    got = []
    for _ in range(n):
        s.sendto(b"x", addr)
        got.append(s.recvfrom(100)[0].decode())
    return got
s6 = socket.socket(socket.AF_INET6, socket.SOCK_DGRAM)
s4 = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s6.settimeout(3)
s4.settimeout(3)
print("before6", *ports(s6, (vip6, 53)), flush=True)
print("before4", *ports(s4, (vip4, 53)), flush=True)
deadline = time.time() + 20
while not os.path.exists(flag):
    if time.time() > deadline:
        sys.exit("the test never wrote " + flag)
    time.sleep(0.02)
print("after6", *ports(s6, (vip6, 53)), flush=True)
print("after4", *ports(s4, (vip4, 53)), flush=True)
"#;

/// An unconnected UDP socket of the node keeps one backend per frontend while it sends, as
/// netfilter keeps a UDP tuple's backend (the socket keeps its source port), instead of a new
/// random backend per sendmsg(); once that backend is gone, its next datagram goes to another
/// one and stays there. IPv6 and IPv4 sockets, four backends each.
#[test]
fn an_unconnected_udp_socket_keeps_its_backend_until_the_backend_is_gone() {
    require_privileged!();
    const PORTS: [u16; 4] = [6001, 6002, 6003, 6004];
    const SENDS: usize = 20;
    let mut node = Node::start();
    let tmp = proxy_testenv::TempDir::new("kpe-sockpick").expect("temp dir");
    let ports: Vec<String> = PORTS.iter().map(u16::to_string).collect();
    let mut args = vec!["python3", "-u", "-c", PORT_ECHO_PY];
    args.extend(ports.iter().map(String::as_str));
    let servers_log = tmp.join("servers.log");
    let _servers = node.ns.spawn(&args, Some(&servers_log)).expect("servers");
    wait_for_line(&servers_log, "ready");
    let backends6: Vec<(u32, u16)> = (31..).zip(PORTS).collect();
    let backends4: Vec<(u32, u16)> = (41..).zip(PORTS).collect();
    node.set_service6(VIP6, 53, proto::UDP, &backends6);
    node.set_service4_backends(53, proto::UDP, &backends4);

    let flag = tmp.join("go");
    let log = tmp.join("client.log");
    let sends = SENDS.to_string();
    let client_args = [
        "python3",
        "-u",
        "-c",
        STICKY_CLIENT_PY,
        &VIP6.to_string(),
        "10.96.0.10",
        flag.to_str().expect("UTF-8 path"),
        &sends,
    ];
    let mut client =
        Proc::spawn(node.cgroup.command(&node.ns, &client_args), Some(&log)).expect("client");
    wait_for_line(&log, "before4");
    let answered = |name: &str| -> Vec<u16> {
        let text = std::fs::read_to_string(&log).expect("client log");
        let line = text
            .lines()
            .find(|l| l.split_whitespace().next() == Some(name))
            .unwrap_or_else(|| panic!("no {name} line in the client's output:\n{text}"));
        line.split_whitespace()
            .skip(1)
            .map(|p| p.parse().expect("port"))
            .collect()
    };
    let one_backend = |name: &str| -> u16 {
        let got = answered(name);
        assert_eq!(got.len(), SENDS, "{name}: every datagram answered: {got:?}");
        assert!(
            got.iter().all(|p| *p == got[0]),
            "{name}: one socket's datagrams to one Service must stay on one backend, went to \
             {got:?}"
        );
        got[0]
    };
    let kept6 = one_backend("before6");
    let kept4 = one_backend("before4");

    // The backends the sockets kept leave their Services, as the agent removes an endpoint.
    let without = |all: &[(u32, u16)], port: u16| -> (Vec<(u32, u16)>, u32) {
        let gone = all.iter().find(|(_, p)| *p == port).expect("kept port").0;
        (
            all.iter().copied().filter(|(id, _)| *id != gone).collect(),
            gone,
        )
    };
    let (left6, gone6) = without(&backends6, kept6);
    let (left4, gone4) = without(&backends4, kept4);
    node.set_service6(VIP6, 53, proto::UDP, &left6);
    node.set_service4_backends(53, proto::UDP, &left4);
    let mut b6: HashMap<_, u32, Backend6> =
        HashMap::try_from(node.bpf.map_mut(MAP_BACKENDS6).expect("BACKENDS6")).expect("map");
    b6.remove(&gone6).expect("remove the IPv6 backend");
    let mut b4: HashMap<_, u32, Backend> =
        HashMap::try_from(node.bpf.map_mut(MAP_BACKENDS).expect("BACKENDS")).expect("map");
    b4.remove(&gone4).expect("remove the IPv4 backend");
    std::fs::write(&flag, b"go").expect("flag");

    let status = client
        .wait_or_kill(Duration::from_secs(30))
        .expect("client ends");
    assert!(status.success(), "client: {}", client.log_tail(2000));
    let moved6 = one_backend("after6");
    let moved4 = one_backend("after4");
    assert_ne!(moved6, kept6, "IPv6: the removed backend got datagrams");
    assert_ne!(moved4, kept4, "IPv4: the removed backend got datagrams");
}

/// Waits (bounded: 15 s) until `log` has a line starting with `word`.
fn wait_for_line(log: &std::path::Path, word: &str) {
    let deadline = std::time::Instant::now() + Duration::from_secs(15);
    loop {
        let text = std::fs::read_to_string(log).unwrap_or_default();
        if text.lines().any(|l| l.starts_with(word)) {
            return;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "no {word:?} line in {} after 15 s:\n{text}",
            log.display()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}
