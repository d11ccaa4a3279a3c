//! deploy/ as a kubelet would run it: the DaemonSet (typed, k8s-openapi), its containers'
//! command lines with `$(VAR)` expanded from their env, the ConfigMap's configuration, and what
//! the kubelet gives a pod (the `kubernetes` Service's env, a service account directory, kubeadm's
//! kube-proxy kubeconfig).

use std::path::{Path, PathBuf};

use k8s_openapi::api::{apps::v1::DaemonSet, core::v1::Container};
use serde_json::Value;

/// What the kubelet puts in every container: the `kubernetes` Service's ClusterIP.
pub const KUBELET_ENV: [(&str, &str); 3] = [
    ("KUBERNETES_SERVICE_HOST", "10.96.0.1"),
    ("KUBERNETES_SERVICE_PORT", "443"),
    ("KUBERNETES_PORT", "tcp://10.96.0.1:443"),
];
/// Where deploy/ mounts kubeadm's kube-proxy kubeconfig.
pub const DEPLOYED_KUBECONFIG: &str = "/var/lib/kube-proxy/kubeconfig.conf";
/// Where the kubelet mounts a pod's service account.
pub const SERVICE_ACCOUNT_MOUNT: &str = "/var/run/secrets/kubernetes.io/serviceaccount";
/// The namespace deploy/ installs into (the DaemonSet's `metadata.namespace`).
pub const POD_NAMESPACE: &str = "kube-system";

/// The YAML documents of deploy/`file`.
pub fn deploy(file: &str) -> Vec<Value> {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../deploy")
        .join(file);
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{file}: {e}"));
    serde_saphyr::from_multiple(&text).unwrap_or_else(|e| panic!("{file}: {e}"))
}

/// The agent's DaemonSet of deploy/daemonset.yaml.
pub fn daemonset() -> DaemonSet {
    let doc = deploy("daemonset.yaml")
        .into_iter()
        .find(|d| d["kind"] == "DaemonSet" && d["metadata"]["name"] == "kube-proxy-ebpf")
        .expect("the agent's DaemonSet");
    serde_json::from_value(doc).expect("deploy/daemonset.yaml parses as a DaemonSet")
}

/// The container (or init container) `name` of `ds`.
pub fn container<'a>(ds: &'a DaemonSet, name: &str) -> &'a Container {
    let pod = ds.spec.template.spec.as_ref();
    let pod = pod.expect("pod spec");
    pod.init_containers
        .iter()
        .flatten()
        .chain(&pod.containers)
        .find(|c| c.name == name)
        .unwrap_or_else(|| panic!("no container {name}"))
}

/// `c`'s env as the kubelet resolves it on `node`: literal values, and the downward API's
/// `spec.nodeName` and `metadata.namespace`.
pub fn container_env(c: &Container, node: &str) -> Vec<(String, String)> {
    c.env
        .iter()
        .flatten()
        .map(|e| {
            let value = match (&e.value, &e.value_from) {
                (Some(v), _) => v.clone(),
                (None, Some(from)) => {
                    let field = from.field_ref.as_ref().map(|f| f.field_path.as_str());
                    match field {
                        Some("spec.nodeName") => node.to_owned(),
                        Some("metadata.namespace") => POD_NAMESPACE.to_owned(),
                        other => panic!(
                            "env {}: a source this test does not know: {other:?}",
                            e.name
                        ),
                    }
                }
                (None, None) => String::new(),
            };
            (e.name.clone(), value)
        })
        .collect()
}

/// `c`'s command and args with `$(VAR)` replaced by the values of its env, as the kubelet
/// expands them (an unknown `$(VAR)` stays as written).
pub fn container_argv(c: &Container, node: &str) -> Vec<String> {
    let env = container_env(c, node);
    c.command
        .iter()
        .flatten()
        .chain(c.args.iter().flatten())
        .map(|a| {
            env.iter()
                .fold(a.clone(), |a, (k, v)| a.replace(&format!("$({k})"), v))
        })
        .collect()
}

/// deploy/configmap.yaml's `config.yaml`, as the agent reads it.
pub fn deployed_config() -> String {
    let cm = deploy("configmap.yaml").remove(0);
    let text = cm["data"]["config.yaml"].as_str().expect("config.yaml");
    assert!(text.contains(DEPLOYED_KUBECONFIG), "{text}");
    text.to_owned()
}

/// A self-signed CA certificate (its key was discarded): the cluster CA of the test's service
/// account. Nothing is signed with it; the fake API server speaks plain HTTP.
const TEST_CA_PEM: &str = "-----BEGIN CERTIFICATE-----
MIIBhDCCASmgAwIBAgIUWq1U/Ki+74zz6HTF6PgeFNua9ZEwCgYIKoZIzj0EAwIw
FjEUMBIGA1UEAwwLa3BlLXRlc3QtY2EwIBcNMjYxMjA1MDg0NTA3WhgPMjEyNjEx
MTEwODQ1MDdaMBYxFDASBgNVBAMMC2twZS10ZXN0LWNhMFkwEwYHKoZIzj0CAQYI
KoZIzj0DAQcDQgAEDDSHJEbIT1eojEu2qrONwYPXJRIyuNR9X3VB+VT2UNBfqyyL
g4uJk+uGOtiwrpeAekxXast6sFgpnJohc9v3ZKNTMFEwHQYDVR0OBBYEFKwylQ59
klSWzNDTlQ39RSaHJklKMB8GA1UdIwQYMBaAFKwylQ59klSWzNDTlQ39RSaHJklK
MA8GA1UdEwEB/wQFMAMBAf8wCgYIKoZIzj0EAwIDSQAwRgIhAMPGegVtLxMa9Cew
JZc1Cx4xccYDkDXc+IJqNKgPI1dNAiEA6ixfTzh3uNaBxwdmWL9k3DvP5xFogUJu
SODrYN1QBHc=
-----END CERTIFICATE-----
";

/// A service account directory as the kubelet mounts it (token, namespace, the cluster's CA).
pub fn service_account(dir: &Path) -> PathBuf {
    let sa = dir.join("serviceaccount");
    std::fs::create_dir_all(&sa).expect("sa dir");
    std::fs::write(sa.join("token"), "test-token").expect("token");
    std::fs::write(sa.join("namespace"), POD_NAMESPACE).expect("namespace");
    std::fs::write(sa.join("ca.crt"), TEST_CA_PEM).expect("ca.crt");
    sa
}

/// kubeadm's kube-proxy kubeconfig (`kubeconfig.conf`): the control-plane endpoint, and the
/// pod's service account token and CA as found at `sa_dir` (plain HTTP here: the fake API server
/// speaks no TLS). The CA matters in an image without system CA certificates: without one the
/// client looks for the system's and fails.
pub fn kubeadm_kubeconfig(server: &str, sa_dir: &Path) -> String {
    format!(
        "apiVersion: v1\nkind: Config\nclusters:\n- cluster:\n    certificate-authority: {}\n    \
         server: {server}\n  name: default\ncontexts:\n- context:\n    cluster: default\n    \
         namespace: default\n    user: default\n  name: default\ncurrent-context: default\n\
         users:\n- name: default\n  user:\n    tokenFile: {}\n",
        sa_dir.join("ca.crt").display(),
        sa_dir.join("token").display()
    )
}
