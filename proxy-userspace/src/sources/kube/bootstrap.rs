//! Reaching the API server on a node this agent must bootstrap.
//!
//! In a pod, "in-cluster" configuration reaches the API server at `KUBERNETES_SERVICE_HOST`,
//! which the kubelet sets to the `kubernetes` Service's ClusterIP: an address only a running
//! Service proxy translates. On a node whose datapath is not there yet (a new node, a reboot:
//! the bpffs is in memory) nothing translates it, the initial lists never come, and the node
//! never gets its Services. So the agent takes the real endpoint the ways users already give it
//! (kube-proxy's kubeconfig, `--master`, or `KUBERNETES_SERVICE_HOST`/`_PORT` set in the
//! DaemonSet) and says so, once at start and in /healthz, when the address it uses is one it
//! translates itself ([`translated_here`]).
//!
//! With `--master` and no kubeconfig the pod's service account still authenticates: its token
//! and CA are used with the given URL (`in_cluster_kubeconfig`), as Cilium's
//! `k8sServiceHost` keeps them.

use std::{
    net::{IpAddr, SocketAddr, ToSocketAddrs as _},
    path::Path,
};

use crate::pipeline::addresses::Cidr;

/// Where a pod's service account is mounted (the default of `--service-account-dir`).
pub const SERVICE_ACCOUNT_DIR: &str = "/var/run/secrets/kubernetes.io/serviceaccount";

/// The in-cluster kubeconfig: the service account's token and CA at `dir`, and the API server at
/// `server` (`--master`), else at `KUBERNETES_SERVICE_HOST`:`KUBERNETES_SERVICE_PORT` (`env`).
/// `None` when the directory holds no token (not in a pod).
pub fn in_cluster_kubeconfig(
    dir: &Path,
    server: Option<&str>,
    env: impl Fn(&str) -> Option<String>,
) -> Option<String> {
    let token = dir.join("token");
    if !token.exists() {
        return None;
    }
    let server = match server {
        Some(url) => url.to_owned(),
        None => {
            let host = env("KUBERNETES_SERVICE_HOST")?;
            let port = env("KUBERNETES_SERVICE_PORT").unwrap_or_else(|| "443".into());
            let host = match host.parse::<IpAddr>() {
                Ok(IpAddr::V6(v6)) => format!("[{v6}]"),
                _ => host,
            };
            format!("https://{host}:{port}")
        }
    };
    let ca = dir.join("ca.crt");
    let ca_line = if ca.exists() {
        format!("    certificate-authority: {}\n", quote(&ca))
    } else {
        String::new()
    };
    let namespace = std::fs::read_to_string(dir.join("namespace"))
        .ok()
        .map(|n| n.trim().to_owned())
        .filter(|n| !n.is_empty())
        .unwrap_or_else(|| "default".into());
    Some(format!(
        "apiVersion: v1\nkind: Config\nclusters:\n- name: in-cluster\n  cluster:\n    \
         server: {server:?}\n{ca_line}users:\n- name: service-account\n  user:\n    \
         tokenFile: {}\ncontexts:\n- name: in-cluster\n  context:\n    cluster: in-cluster\n    \
         user: service-account\n    namespace: {namespace:?}\ncurrent-context: in-cluster\n",
        quote(&token)
    ))
}

fn quote(p: &Path) -> String {
    format!("{:?}", p.to_string_lossy())
}

/// What the kubelet says the `kubernetes` Service's ClusterIP is (`KUBERNETES_PORT`,
/// `tcp://10.96.0.1:443`, set in every container whatever the pod's env overrides).
pub fn kubelet_master_service(env: impl Fn(&str) -> Option<String>) -> Option<SocketAddr> {
    env("KUBERNETES_PORT")?.strip_prefix("tcp://")?.parse().ok()
}

/// What the agent knows of the addresses it translates, at start.
pub struct Translated<'a> {
    /// The `kubernetes` Service's ClusterIP as the kubelet told it ([`kubelet_master_service`]).
    pub master_service: Option<SocketAddr>,
    /// `--service-cidr`.
    pub service_cidrs: &'a [Cidr],
    /// A frontend of the pinned datapath (adopted maps): `(address, port)` TCP.
    pub pinned_frontend: &'a dyn Fn(SocketAddr) -> bool,
}

/// Why the API server at `host:port` is reached through an address this agent's own datapath
/// translates (`None`: it is not, as far as the agent can tell). A host name is resolved here
/// (the node's resolver: the DaemonSet uses `dnsPolicy: Default`).
pub fn translated_here(host: &str, port: u16, known: &Translated<'_>) -> Option<String> {
    let host = host.trim_start_matches('[').trim_end_matches(']');
    let addrs: Vec<SocketAddr> = match host.parse::<IpAddr>() {
        Ok(ip) => vec![SocketAddr::new(ip, port)],
        Err(_) => (host, port)
            .to_socket_addrs()
            .map(Iterator::collect)
            .unwrap_or_default(),
    };
    addrs.into_iter().find_map(|addr| {
        if known.master_service == Some(addr) {
            return Some(format!(
                "the API server address {addr} is the `kubernetes` Service's ClusterIP (the \
                 kubelet's KUBERNETES_PORT)"
            ));
        }
        if (known.pinned_frontend)(addr) {
            return Some(format!(
                "the API server address {addr} is a Service frontend of this node's datapath"
            ));
        }
        known
            .service_cidrs
            .iter()
            .find(|c| c.contains(addr.ip()))
            .map(|c| {
                format!(
                    "the API server address {addr} is inside the Service CIDR {}/{} \
                     (--service-cidr)",
                    c.addr, c.prefix_len
                )
            })
    })
}

/// The log line and /healthz reason for [`translated_here`]'s `why`.
pub fn advice(why: &str) -> String {
    format!(
        "{why}: this agent must translate that address itself, so on a node without a running \
         datapath (a new or rebooted node) it can never reach its API server. Give it the real \
         endpoint: kube-proxy's kubeconfig (--kubeconfig or clientConnection.kubeconfig), \
         --master https://HOST:PORT (the service account's token and CA are kept), or \
         KUBERNETES_SERVICE_HOST/KUBERNETES_SERVICE_PORT set in the DaemonSet"
    )
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use super::*;

    fn env(vars: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
        let map: HashMap<String, String> = vars
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect();
        move |k| map.get(k).cloned()
    }

    #[test]
    fn the_in_cluster_kubeconfig_keeps_the_token_and_ca_with_the_given_server() {
        let dir = std::env::temp_dir().join(format!("kpe-sa-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let no_env = env(&[]);
        assert_eq!(in_cluster_kubeconfig(&dir, None, &no_env), None, "no token");
        std::fs::write(dir.join("token"), "t").unwrap();
        std::fs::write(dir.join("ca.crt"), "c").unwrap();
        std::fs::write(dir.join("namespace"), "kube-system\n").unwrap();
        assert_eq!(
            in_cluster_kubeconfig(&dir, None, &no_env),
            None,
            "no server anywhere"
        );
        let kubelet = env(&[
            ("KUBERNETES_SERVICE_HOST", "fd00:10:96::1"),
            ("KUBERNETES_SERVICE_PORT", "443"),
        ]);
        let text = in_cluster_kubeconfig(&dir, None, &kubelet).unwrap();
        assert!(
            text.contains("server: \"https://[fd00:10:96::1]:443\""),
            "{text}"
        );
        let text = in_cluster_kubeconfig(&dir, Some("https://10.0.0.5:6443"), &kubelet).unwrap();
        assert!(text.contains("server: \"https://10.0.0.5:6443\""), "{text}");
        assert!(text.contains("tokenFile:") && text.contains("certificate-authority:"));
        assert!(text.contains("namespace: \"kube-system\""));
        let parsed = kube::config::Kubeconfig::from_yaml(&text).expect("a kubeconfig kube reads");
        assert_eq!(parsed.current_context.as_deref(), Some("in-cluster"));
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn the_kubernetes_clusterip_a_pinned_frontend_and_the_service_cidr_are_translated_here() {
        let master = kubelet_master_service(env(&[("KUBERNETES_PORT", "tcp://10.96.0.1:443")]));
        assert_eq!(master, Some("10.96.0.1:443".parse().unwrap()));
        let cidrs = ["10.97.0.0/16".parse::<Cidr>().unwrap()];
        let pinned = |a: SocketAddr| a == "10.98.0.7:6443".parse().unwrap();
        let known = Translated {
            master_service: master,
            service_cidrs: &cidrs,
            pinned_frontend: &pinned,
        };
        let why = translated_here("10.96.0.1", 443, &known).unwrap();
        assert!(why.contains("`kubernetes` Service's ClusterIP"), "{why}");
        let why = translated_here("10.98.0.7", 6443, &known).unwrap();
        assert!(why.contains("Service frontend"), "{why}");
        let why = translated_here("10.97.3.3", 443, &known).unwrap();
        assert!(why.contains("10.97.0.0/16"), "{why}");
        assert_eq!(translated_here("192.168.1.10", 6443, &known), None);
        assert_eq!(translated_here("127.0.0.1", 6443, &known), None);
        assert!(advice("x").contains("--master"));
    }
}
