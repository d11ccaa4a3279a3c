//! Privileged self-test of the topology without the agent: pods reach each other directly
//! through the node namespace. Runs only with KPE_PRIVILEGED=1 (`sudo cargo xtask test`).

use std::time::Duration;

use proxy_testenv::{BACKENDS, ConnectOutcome, Topology, require_privileged};

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
