//! Privileged: every pod and every external device, whatever the CNI names them, with the
//! agent's default flags (no `--pod-interfaces`, no `--devices`). A node whose client pod's
//! host-side veth is named like AWS VPC CNI's (`eni0abc`) and whose address and default route
//! sit on a bridge (`br-up`) carrying two veths, one to an external client: the pod reaches a
//! ClusterIP, the external client a NodePort (SNATed to the node, externalTrafficPolicy
//! Cluster), and the bridge's ports get no programs of their own (the bridge has them).
//!
//! Run by `sudo cargo xtask test` (sets KPE_PRIVILEGED=1, one test thread); skipped otherwise.
//! Everything lives in network namespaces the test creates: the node's default route points at
//! the external client's namespace, which routes nowhere else.

mod common_netns;

use std::{net::Ipv4Addr, path::Path, time::Duration};

use common_netns::BIN;
use proxy_testenv::{ManifestDir, PinDir, Topology, require_privileged};

const CLIENT: Ipv4Addr = Ipv4Addr::new(10, 244, 1, 2);
const BE1: Ipv4Addr = Ipv4Addr::new(10, 244, 1, 11);
const VIP: Ipv4Addr = Ipv4Addr::new(10, 96, 10, 10);
const NODE_PORT: u16 = 30_080;
const NODE_IP: Ipv4Addr = Ipv4Addr::new(192, 168, 61, 10);
const EXT_IP: Ipv4Addr = Ipv4Addr::new(192, 168, 61, 100);

#[test]
fn any_cni_s_pod_veth_and_a_bridge_uplink_are_found_with_default_flags() {
    require_privileged!();
    proxy_testenv::ensure_bpffs().expect("bpffs");
    let mut topo = Topology::bare().expect("node");
    topo.add_pod_on("client", CLIENT, "eni0abc")
        .expect("client pod");
    topo.add_backend("be1", BE1).expect("backend");
    let proxy_testenv::Uplink { ext, idle: _idle } =
        topo.add_uplink(NODE_IP, EXT_IP).expect("uplink");
    let manifests = ManifestDir::new().expect("manifests");
    manifests
        .write_yaml(
            "demo",
            "web",
            &format!(
                "apiVersion: v1\nkind: Service\nmetadata:\n  name: web\n  namespace: demo\nspec:\n  \
                 type: NodePort\n  clusterIP: {VIP}\n  ports:\n  - name: http\n    port: 80\n    \
                 targetPort: 8080\n    nodePort: {NODE_PORT}\n---\napiVersion: discovery.k8s.io/v1\n\
                 kind: EndpointSlice\nmetadata:\n  name: web-1\n  namespace: demo\n  labels:\n    \
                 kubernetes.io/service-name: web\naddressType: IPv4\nports:\n- name: http\n  \
                 port: 8080\n  protocol: TCP\nendpoints:\n- addresses: [\"{BE1}\"]\n  \
                 conditions: {{ready: true}}\n"
            ),
        )
        .expect("manifest");
    let pins = PinDir::new(&format!("{}-pins", topo.prefix())).expect("pins");
    let args = ["--manifests".as_ref(), manifests.path().as_os_str()];
    let mut agent = proxy_testenv::Agent::start_detecting(
        Path::new(BIN),
        topo.node(),
        &args,
        pins.path(),
        topo.tmp().path(),
    )
    .expect("agent");
    let want = ["eni0abc", "veth-be1", "br-up"].map(String::from);
    let status = agent
        .wait_attached(&want)
        .unwrap_or_else(|e| panic!("{e:#}"));
    agent.check(
        !status.interfaces.iter().any(|i| i.starts_with("up-")),
        || {
            format!(
                "the uplink bridge's ports got programs too: {:?}",
                status.interfaces
            )
        },
    );
    agent
        .wait_log(
            &["interfaces chosen", "external=[\"br-up\"]"],
            Duration::from_secs(5),
        )
        .unwrap_or_else(|e| panic!("{e:#}"));
    // The uplink's address becomes the SNAT address once the devices are known (after the
    // first sync); the sync that follows writes it.
    agent
        .wait_log(
            &["node addresses", &format!("snat=Some({NODE_IP})")],
            Duration::from_secs(5),
        )
        .unwrap_or_else(|e| panic!("{e:#}"));
    agent
        .wait_synced(2, Duration::from_secs(10))
        .unwrap_or_else(|e| panic!("{e:#}"));

    let replies = topo
        .curl_many_from("client", &format!("http://{VIP}/"), 5)
        .unwrap_or_else(|e| agent.fail(&format!("{e:#}")));
    for (i, r) in replies.iter().enumerate() {
        agent.check(r.as_ref().is_ok_and(|r| r.body == "be1"), || {
            format!("pod behind eni0abc, request {i} to the ClusterIP: {r:?}")
        });
    }
    let url = format!("http://{NODE_IP}:{NODE_PORT}/");
    for i in 0..5 {
        let out = ext
            .output(
                &[
                    "curl",
                    "-s",
                    "--max-time",
                    "3",
                    "-w",
                    "\x1e%header{x-client-addr}",
                    &url,
                ],
                Duration::from_secs(10),
            )
            .expect("curl");
        let text = String::from_utf8_lossy(&out.stdout).into_owned();
        let (body, client) = text.split_once('\x1e').unwrap_or((&text, ""));
        agent.check(body.trim() == "be1", || {
            format!("external request {i} to the NodePort on the bridge: {text:?}")
        });
        agent.check(client.starts_with(&format!("{NODE_IP}:")), || {
            format!("eTP=Cluster: the backend saw {client}, not the node's address")
        });
    }
}
