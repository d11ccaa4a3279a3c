//! Privileged IPv6 hairpin tests on the dual-stack topology (proxy-testenv, as tests/netns6.rs):
//! a pod that reaches an IPv6 ClusterIP, or its node's IPv6 address at a NodePort, whose only
//! endpoint is itself gets its own connection (TCP) and its own answer (UDP), SNATed by the
//! datapath to the frontend address (`ipv6::snat` says why that source), so it never sees a
//! packet from its own address.
//!
//! Run by `sudo cargo xtask test` (sets KPE_PRIVILEGED=1, one test thread); skipped otherwise.
//! RAII guards remove namespaces, agents and pins even when an assertion fails.

use std::net::Ipv6Addr;

use proxy_common::{SNAT_PORT_MAX, SNAT_PORT_MIN};
use proxy_testenv::{
    BACKENDS6, FamilyService, NODE_LOCAL_IP6, ServicePort, http6_get_with_peer, require_privileged,
    udp6_request_from,
};

mod common_netns;
use common_netns::Env;

/// demo/self6: TCP 80 → 8080 and UDP 53 → 5353, its only endpoint the pod be1.
const SELF6: Ipv6Addr = Ipv6Addr::new(0xfd00, 0x10, 0x96, 0, 0, 0, 0, 0x30);

/// demo/self6's NodePort (the same number for TCP and UDP).
const SELF6_NODE_PORT: u16 = 30081;

/// The standard topology, demo/self6 written (its NodePort `node_ports`), the agent synced and
/// attached to every pod.
fn start(node_ports: &[u16]) -> Env {
    Env::start(|manifests| {
        manifests
            .write_family_service(&FamilyService {
                namespace: "demo",
                name: "self6",
                cluster_ips: &[SELF6.into()],
                ports: &[ServicePort::tcp(80, 8080), ServicePort::udp(53, 5353)],
                node_ports,
                endpoints: &[BACKENDS6[0].1.into()],
            })
            .expect("writing demo/self6");
    })
}

/// The pod be1 reaches itself at `frontend`:`tcp_port` (HTTP) and `frontend`:`udp_port` three
/// times each: answered by itself, the peer and the reply's source the frontend, and its server
/// side sees the frontend address and a SNAT port as the client, never its own address.
fn reaches_itself(env: &Env, frontend: Ipv6Addr, tcp_port: u16, udp_port: u16) {
    let (name, ip6) = BACKENDS6[0];
    let pod = env
        .topo
        .pod(name)
        .unwrap_or_else(|e| env.fail(&format!("{e:#}")));
    for i in 0..3 {
        let v = http6_get_with_peer(pod.ns(), frontend, tcp_port).unwrap_or_else(|e| {
            env.fail(&format!("hairpin GET {i} [{frontend}]:{tcp_port}: {e:#}"))
        });
        env.check(v.body == name, || format!("request {i}: {v:?}"));
        env.check(v.peer == format!("[{frontend}]:{tcp_port}"), || {
            format!("{v:?}")
        });
        let port = port_from(&v.client_addr, frontend);
        env.check(
            port.is_some_and(|p| (SNAT_PORT_MIN..=SNAT_PORT_MAX).contains(&p)),
            || {
                format!(
                    "request {i}: {name} saw its client as {v:?}, want [{frontend}]:<SNAT port>"
                )
            },
        );
        env.check(!v.client_addr.contains(&ip6.to_string()), || {
            format!("{v:?}")
        });
    }
    for i in 0..3 {
        let payload = format!("self6-{i}-0123456789");
        let u = udp6_request_from(pod.ns(), frontend, udp_port, &payload).unwrap_or_else(|e| {
            env.fail(&format!("hairpin UDP {i} [{frontend}]:{udp_port}: {e:#}"))
        });
        env.check(
            *u.from.ip() == frontend && u.from.port() == udp_port,
            || format!("reply from {}, want [{frontend}]:{udp_port}", u.from),
        );
        env.check(u.body == format!("{name}:{payload}"), || format!("{u:?}"));
    }
}

/// The port of a "[addr]:port" client address whose address is `addr`.
fn port_from(client_addr: &str, addr: Ipv6Addr) -> Option<u16> {
    client_addr
        .strip_prefix(&format!("[{addr}]:"))?
        .parse()
        .ok()
}

#[test]
fn a_pod_reaches_itself_through_an_ipv6_clusterip() {
    require_privileged!();
    let env = start(&[]);
    reaches_itself(&env, SELF6, 80, 53);
}

/// The node's IPv6 address (`NODE_LOCAL_IP6`, on its loopback) at demo/self6's NodePort: the
/// hairpin flow is SNATed to that address.
#[test]
fn a_pod_reaches_itself_through_its_node_s_ipv6_nodeport() {
    require_privileged!();
    let env = start(&[SELF6_NODE_PORT, SELF6_NODE_PORT]);
    reaches_itself(&env, NODE_LOCAL_IP6, SELF6_NODE_PORT, SELF6_NODE_PORT);
}
