//! Privileged self-test of the topology without the agent: pods reach each other directly
//! through the node namespace, over IPv4 and IPv6, and the external client reaches the nodes. Runs only with KPE_PRIVILEGED=1 (`sudo cargo xtask test`).

use std::time::Duration;

use proxy_testenv::{
    BACKENDS, BACKENDS6, CLIENT_IP6, ConnectOutcome, EXT_CLIENT_IP6, MultiNode, NODE_IPS6,
    NODE_LOCAL_IP6, POD_CIDRS6, Topology, http_url, http6_get_with_peer, ipv6_of,
    require_privileged,
};

#[test]
fn pods_talk_directly_through_the_node() {
    require_privileged!();
    let mut topo = Topology::new().expect("topology");
    for (name, ip) in BACKENDS {
        let reply = topo
            .curl(&format!("http://{ip}:8080/"))
            .expect("direct curl");
        assert_eq!(reply.body, name);
        assert_eq!(reply.remote_ip, ip.to_string());
        let udp = topo.udp_request(ip, 5353, "hi").expect("direct udp");
        assert_eq!(udp.body, format!("{name}:hi"));
        assert_eq!(*udp.from.ip(), ip);
    }
    let many = topo
        .curl_many("http://10.244.1.11:8080/", 20)
        .expect("curl_many");
    assert!(
        many.iter()
            .all(|r| r.as_ref().is_ok_and(|r| r.body == "be1")),
        "{many:?}"
    );

    // Nothing listens on :9: the backend's kernel answers with a RST.
    let (outcome, _) = topo
        .tcp_connect(BACKENDS[0].1, 9, Duration::from_secs(2))
        .expect("connect helper");
    assert_eq!(outcome, ConnectOutcome::Refused);

    // No route to a ClusterIP without the agent: fails fast, never leaves the node namespace.
    let err = topo
        .curl("http://10.96.0.10/")
        .expect_err("no service without the agent");
    assert!(err.to_string().contains("exit 7"), "{err:#}");

    topo.start_iperf3_server("be1").expect("iperf3 server");
    let summary = topo
        .iperf3_client(BACKENDS[0].1, 5201, 1)
        .expect("iperf3")
        .wait()
        .expect("wait");
    assert!(summary.success, "{summary:?}");

    topo.remove_pod("be3").expect("remove");
    assert!(topo.curl("http://10.244.1.13:8080/").is_err());
    topo.add_backend("be4", "10.244.1.14".parse().expect("ip"))
        .expect("add");
    assert_eq!(
        topo.curl("http://10.244.1.14:8080/").expect("be4").body,
        "be4"
    );
}

#[test]
fn pods_talk_over_ipv6_through_the_node() {
    require_privileged!();
    let topo = Topology::new().expect("topology");
    let client = topo.pod("client").expect("client");
    assert_eq!(client.ip6, CLIENT_IP6);
    for (name, ip6) in BACKENDS6 {
        let reply = topo.curl(&http_url(ip6, 8080)).expect("direct curl -6");
        assert_eq!(reply.body, name);
        assert_eq!(reply.remote_ip, ip6.to_string());
        let udp = topo.udp6_request(ip6, 5353, "hi6").expect("direct udp6");
        assert_eq!(udp.body, format!("{name}:hi6"));
        assert_eq!(*udp.from.ip(), ip6);
        assert_eq!(udp.from.port(), 5353);
    }
    // A reply larger than the MTU comes back whole (fragmented by the backend's kernel).
    let big = topo
        .udp6_request(BACKENDS6[0].1, 5353, "big:3000")
        .expect("big udp6");
    assert_eq!(big.body, format!("be1:{}", "x".repeat(3000)));
    // The backend saw the client's own IPv6 address.
    let seen = http_get_with_peer_from_client(&topo);
    assert!(seen.starts_with(&format!("[{CLIENT_IP6}]:")), "{seen}");
    let (outcome, _) = topo
        .tcp6_connect(BACKENDS6[1].1, 9, Duration::from_secs(2))
        .expect("connect helper");
    assert_eq!(outcome, ConnectOutcome::Refused);
    // No route to an IPv6 ClusterIP without the agent: the node has no route for it.
    let (outcome, _) = topo
        .tcp6_connect(
            "fd00:10:96::10".parse().unwrap(),
            80,
            Duration::from_secs(2),
        )
        .expect("connect helper");
    assert!(
        matches!(outcome, ConnectOutcome::Error(ref e) if e == "ENETUNREACH" || e == "EHOSTUNREACH"),
        "{outcome:?}"
    );
    // A process of the node itself reaches a pod over IPv6, from the node's own address.
    let v = http6_get_with_peer(topo.node(), BACKENDS6[2].1, 8080).expect("node → pod");
    assert_eq!(v.body, "be3");
    assert!(
        v.client_addr.starts_with(&format!("[{NODE_LOCAL_IP6}]:")),
        "{v:?}"
    );
    // IPv4 is unchanged beside it.
    assert_eq!(
        topo.curl(&http_url(BACKENDS[0].1, 8080))
            .expect("curl")
            .body,
        "be1"
    );
}

/// X-Client-Addr as be2 saw a request from the client pod over IPv6.
fn http_get_with_peer_from_client(topo: &Topology) -> String {
    let v = http6_get_with_peer(
        topo.pod("client").expect("client").ns(),
        BACKENDS6[1].1,
        8080,
    )
    .expect("GET over IPv6");
    assert_eq!(v.body, "be2");
    assert_eq!(v.peer, format!("[{}]:8080", BACKENDS6[1].1));
    v.client_addr
}

#[test]
fn external_client_reaches_nodes_and_remote_pods_over_ipv6() {
    require_privileged!();
    let mut net = MultiNode::new().expect("multinode");
    let be = "10.244.2.21".parse().expect("ip");
    net.add_backend(1, "be21", be).expect("backend on node B");
    let be6 = ipv6_of(be);
    // The client reaches both nodes' IPv6 addresses: a TCP connect to a closed port is refused
    // by the node itself (nothing listens there), which proves the round trip and ND on the wire.
    for ip6 in NODE_IPS6 {
        let (outcome, _) = net
            .tcp6_connect(ip6, 9, Duration::from_secs(2))
            .expect("connect helper");
        assert_eq!(outcome, ConnectOutcome::Refused, "to {ip6}");
    }
    // A client pod on node A reaches node B's pod (routed A → wire → B over IPv6).
    net.node_mut(0)
        .add_pod("client", "10.244.1.2".parse().expect("ip"))
        .expect("client pod on A");
    let reply = net.node(0).curl(&http_url(be6, 8080)).expect("curl -6");
    assert_eq!(reply.body, "be21");
    let udp = net.node(0).udp6_request(be6, 5353, "x").expect("udp6");
    assert_eq!(udp.body, "be21:x");
    assert_eq!(*udp.from.ip(), be6);
    // The external client reaches node B's pod when routed through node B.
    net.route6_via_node(POD_CIDRS6[1], 1).expect("route");
    let r = net
        .http_get(&http_url(be6, 8080))
        .expect("GET from outside");
    assert_eq!((r.code, r.body.as_str()), (200, "be21"));
    assert_eq!(
        r.client_addr.rsplit_once(':').map(|(a, _)| a),
        Some(format!("[{EXT_CLIENT_IP6}]").as_str())
    );
    let u = net
        .udp6_request(be6, 5353, "ext")
        .expect("udp6 from outside");
    assert_eq!(u.body, "be21:ext");
}
