//! Unprivileged: every YAML document under deploy/ (examples included) parses into its
//! k8s-openapi type by kind without losing a field (a misspelt field fails here, not in a
//! cluster), the ConfigMap's KubeProxyConfiguration passes this proxy's own parser without a
//! warning, and the DaemonSet's command line parses with the agent's own CLI. Least privilege
//! (issue 13): every container drops all capabilities and adds only BPF, NET_ADMIN, PERFMON, runs
//! with a read-only root filesystem, no privilege escalation and the runtime's default seccomp
//! profile (the privileged exceptions are the bpffs mount step and the node-settings step,
//! which only runs `--init-only`); hostPath volumes are the bpffs
//! and the cgroup root only; the ClusterRole is get/list/watch plus Event create/patch; /metrics
//! binds to loopback. tests/least_privilege.rs checks the agent works with exactly these caps.

use std::{
    collections::BTreeMap,
    path::{Path, PathBuf},
};

use clap::Parser as _;
use k8s_openapi::{
    api::{
        apps::v1::DaemonSet,
        core::v1::{ConfigMap, Service, ServiceAccount},
        discovery::v1::EndpointSlice,
        rbac::v1::{ClusterRole, ClusterRoleBinding, Role, RoleBinding},
    },
    serde::{Serialize, de::DeserializeOwned},
};
use kube_proxy_ebpf::cli::{Cli, Command, config};
use serde_json::Value;

fn deploy_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy")
}

fn yaml_files(dir: &Path, out: &mut Vec<PathBuf>) {
    let mut entries: Vec<_> = std::fs::read_dir(dir)
        .unwrap_or_else(|e| panic!("reading {}: {e}", dir.display()))
        .map(|e| e.expect("dir entry").path())
        .collect();
    entries.sort();
    for p in entries {
        if p.is_dir() {
            yaml_files(&p, out);
        } else if matches!(p.extension().and_then(|e| e.to_str()), Some("yaml" | "yml")) {
            out.push(p);
        }
    }
}

/// Every field of `original` must survive a round trip through the typed object; returns the
/// paths that did not (k8s-openapi silently ignores unknown fields).
fn lost_fields(original: &Value, typed: &Value, path: &str, lost: &mut Vec<String>) {
    match (original, typed) {
        (Value::Object(o), Value::Object(t)) => {
            for (k, v) in o {
                let p = format!("{path}.{k}");
                match t.get(k) {
                    Some(tv) => lost_fields(v, tv, &p, lost),
                    // Empty values may be dropped by serialization without meaning anything.
                    None if is_empty(v) => {}
                    None => lost.push(p),
                }
            }
        }
        (Value::Array(o), Value::Array(t)) => {
            for (i, (ov, tv)) in o.iter().zip(t).enumerate() {
                lost_fields(ov, tv, &format!("{path}[{i}]"), lost);
            }
        }
        _ => {}
    }
}

fn is_empty(v: &Value) -> bool {
    match v {
        Value::Null => true,
        Value::Object(m) => m.is_empty(),
        Value::Array(s) => s.is_empty(),
        _ => false,
    }
}

/// Parses one document as `T` and checks nothing was dropped.
fn typed<T: DeserializeOwned + Serialize>(doc: &Value, at: &str) -> T {
    let obj: T = serde_json::from_value(doc.clone())
        .unwrap_or_else(|e| panic!("{at}: does not parse as its kind: {e}"));
    let back = serde_json::to_value(&obj).expect("serialize");
    let mut lost = Vec::new();
    lost_fields(doc, &back, "", &mut lost);
    assert!(
        lost.is_empty(),
        "{at}: fields not part of the API (typos?): {lost:?}"
    );
    obj
}

#[derive(Default)]
struct Objects {
    daemonsets: BTreeMap<String, DaemonSet>,
    service_accounts: Vec<ServiceAccount>,
    cluster_roles: Vec<ClusterRole>,
    bindings: Vec<ClusterRoleBinding>,
    roles: Vec<Role>,
    role_bindings: Vec<RoleBinding>,
    config_maps: Vec<ConfigMap>,
    services: usize,
    slices: usize,
}

fn load_all() -> Objects {
    let mut files = Vec::new();
    yaml_files(&deploy_dir(), &mut files);
    assert!(!files.is_empty(), "no YAML under deploy/");
    let mut objects = Objects::default();
    for file in &files {
        let text = std::fs::read_to_string(file).expect("read");
        let docs: Vec<Value> = serde_saphyr::from_multiple(&text)
            .unwrap_or_else(|e| panic!("{}: not YAML: {e}", file.display()));
        for (i, doc) in docs.into_iter().enumerate() {
            let at = format!("{} document {i}", file.display());
            if doc.is_null() {
                continue;
            }
            let api_version = doc.get("apiVersion").and_then(Value::as_str);
            let kind = doc.get("kind").and_then(Value::as_str);
            match (api_version, kind) {
                (Some("apps/v1"), Some("DaemonSet")) => {
                    let ds: DaemonSet = typed(&doc, &at);
                    let name = ds.metadata.name.clone().expect("DaemonSet name");
                    objects.daemonsets.insert(name, ds);
                }
                (Some("v1"), Some("ServiceAccount")) => {
                    objects.service_accounts.push(typed(&doc, &at))
                }
                (Some("rbac.authorization.k8s.io/v1"), Some("ClusterRole")) => {
                    objects.cluster_roles.push(typed(&doc, &at))
                }
                (Some("rbac.authorization.k8s.io/v1"), Some("ClusterRoleBinding")) => {
                    objects.bindings.push(typed(&doc, &at))
                }
                (Some("rbac.authorization.k8s.io/v1"), Some("Role")) => {
                    objects.roles.push(typed(&doc, &at))
                }
                (Some("rbac.authorization.k8s.io/v1"), Some("RoleBinding")) => {
                    objects.role_bindings.push(typed(&doc, &at))
                }
                (Some("v1"), Some("ConfigMap")) => objects.config_maps.push(typed(&doc, &at)),
                (Some("v1"), Some("Service")) => {
                    typed::<Service>(&doc, &at);
                    objects.services += 1;
                }
                (Some("discovery.k8s.io/v1"), Some("EndpointSlice")) => {
                    typed::<EndpointSlice>(&doc, &at);
                    objects.slices += 1;
                }
                other => panic!("{at}: unexpected apiVersion/kind {other:?}"),
            }
        }
    }
    objects
}

#[test]
fn every_document_parses_as_its_kind() {
    let o = load_all();
    assert!(o.daemonsets.contains_key("kube-proxy-ebpf"));
    assert!(o.daemonsets.contains_key("kube-proxy-ebpf-cleanup"));
    assert_eq!(o.service_accounts.len(), 1);
    assert_eq!(o.cluster_roles.len(), 1);
    assert_eq!(o.bindings.len(), 1);
    assert_eq!(o.config_maps.len(), 1);
    assert!(o.services > 0 && o.slices > 0, "deploy/examples included");
}

#[test]
fn lost_field_check_catches_typos() {
    let doc: Value = serde_saphyr::from_str(
        "apiVersion: v1\nkind: ServiceAccount\nmetadata:\n  name: x\n  namspace: y\n",
    )
    .expect("yaml");
    let r = std::panic::catch_unwind(|| typed::<ServiceAccount>(&doc, "typo"));
    assert!(r.is_err(), "a misspelt field must fail");
}

fn config_text(o: &Objects) -> String {
    let cm = &o.config_maps[0];
    assert_eq!(cm.metadata.name.as_deref(), Some("kube-proxy-ebpf"));
    assert_eq!(cm.metadata.namespace.as_deref(), Some("kube-system"));
    cm.data
        .as_ref()
        .and_then(|d| d.get("config.yaml"))
        .expect("ConfigMap data config.yaml")
        .clone()
}

#[test]
fn configmap_holds_a_clean_kube_proxy_configuration() {
    let o = load_all();
    let parsed = config::parse("deploy/configmap.yaml config.yaml", &config_text(&o))
        .unwrap_or_else(|e| panic!("{e}"));
    assert!(parsed.warnings.is_empty(), "{:?}", parsed.warnings);
    let c = parsed.config;
    assert_eq!(
        c.healthz_bind_address.map(|b| b.to_string()).as_deref(),
        Some("0.0.0.0:10256")
    );
    assert_eq!(
        c.metrics_bind_address.map(|b| b.to_string()).as_deref(),
        Some("127.0.0.1:10249")
    );
    assert!(c.sync_period.is_some() && c.min_sync_period.is_some());
}

#[test]
fn daemonset_replaces_kube_proxy() {
    let o = load_all();
    let ds = &o.daemonsets["kube-proxy-ebpf"];
    assert_eq!(ds.metadata.namespace.as_deref(), Some("kube-system"));
    let pod = ds.spec.template.spec.as_ref().expect("pod spec");
    assert_eq!(pod.host_network, Some(true));
    // The node's resolver: cluster DNS is a ClusterIP the agent itself translates.
    assert_eq!(pod.dns_policy.as_deref(), Some("Default"));
    assert_eq!(
        pod.priority_class_name.as_deref(),
        Some("system-node-critical")
    );
    assert_eq!(
        pod.service_account_name.as_deref(),
        o.service_accounts[0].metadata.name.as_deref()
    );
    let tolerations = pod.tolerations.as_ref().expect("tolerations");
    assert!(
        tolerations
            .iter()
            .any(|t| t.operator.as_deref() == Some("Exists") && t.key.is_none()),
        "tolerates every taint, like kube-proxy"
    );
    let c = &pod.containers[0];
    let node_name = c
        .env
        .as_ref()
        .and_then(|e| e.iter().find(|v| v.name == "NODE_NAME"))
        .and_then(|v| v.value_from.as_ref())
        .and_then(|f| f.field_ref.as_ref())
        .map(|f| f.field_path.as_str());
    assert_eq!(node_name, Some("spec.nodeName"));

    // The command line is one the agent accepts, and reads the mounted ConfigMap.
    let argv: Vec<String> = c
        .command
        .iter()
        .flatten()
        .chain(c.args.iter().flatten())
        .map(|a| {
            a.replace("$(NODE_NAME)", "node-1")
                .replace("$(POD_NAMESPACE)", "kube-system")
        })
        .collect();
    let cli = Cli::try_parse_from(&argv).unwrap_or_else(|e| panic!("{argv:?}: {e}"));
    let Command::Run(run) = cli.command else {
        panic!("{argv:?} is not `run`")
    };
    // --daemonset names this DaemonSet (uninstall or restart is read from it), in the pod's own
    // namespace.
    assert_eq!(
        run.daemonset.as_ref().map(ToString::to_string).as_deref(),
        Some("kube-system/kube-proxy-ebpf")
    );
    let pod_namespace = c
        .env
        .as_ref()
        .and_then(|e| e.iter().find(|v| v.name == "POD_NAMESPACE"))
        .and_then(|v| v.value_from.as_ref())
        .and_then(|f| f.field_ref.as_ref())
        .map(|f| f.field_path.as_str());
    assert_eq!(pod_namespace, Some("metadata.namespace"));
    // The API server through kubeadm's kube-proxy kubeconfig (clientConnection.kubeconfig in
    // the ConfigMap), mounted from kubeadm's `kube-proxy` ConfigMap, optional.
    let kubeconfig_volume = pod
        .volumes
        .iter()
        .flatten()
        .find(|v| v.name == "kube-proxy-kubeconfig")
        .and_then(|v| v.config_map.as_ref())
        .expect("kubeadm's kube-proxy ConfigMap volume");
    assert_eq!(kubeconfig_volume.name, "kube-proxy");
    assert_eq!(kubeconfig_volume.optional, Some(true));
    let file = config::parse("config.yaml", &config_text(&o))
        .unwrap_or_else(|e| panic!("{e}"))
        .config;
    let kubeconfig = file.kubeconfig.expect("clientConnection.kubeconfig");
    let mount = c
        .volume_mounts
        .iter()
        .flatten()
        .find(|m| m.name == "kube-proxy-kubeconfig")
        .expect("the kubeconfig volume is mounted");
    assert_eq!(
        kubeconfig.strip_prefix(&mount.mount_path).ok(),
        Some(Path::new("kubeconfig.conf")),
        "clientConnection.kubeconfig names the mounted kubeadm kubeconfig"
    );
    let config_path = run.config.expect("--config");
    let mounts = c.volume_mounts.as_ref().expect("mounts");
    let config_mount = mounts
        .iter()
        .find(|m| config_path.starts_with(&m.mount_path))
        .expect("--config file is on a mounted volume");
    let volumes = pod.volumes.as_ref().expect("volumes");
    let config_volume = volumes
        .iter()
        .find(|v| v.name == config_mount.name)
        .and_then(|v| v.config_map.as_ref())
        .expect("--config's volume is a ConfigMap");
    assert_eq!(
        config_volume.name,
        o.config_maps[0].metadata.name.clone().unwrap_or_default()
    );
    assert!(config_path.ends_with("config.yaml"));
    assert_eq!(run.hostname_override.as_deref(), Some("node-1"));

    // Pins on the host's bpffs, so they outlive the pod; `dump` run in the container (kubectl
    // exec) finds them through KPE_PIN_DIR.
    assert_eq!(
        host_pin_dir(&run.pins.pin_dir, mounts, volumes),
        Path::new(proxy_common::DEFAULT_PIN_DIR)
    );
    let pin_env = c
        .env
        .as_ref()
        .and_then(|e| e.iter().find(|v| v.name == "KPE_PIN_DIR"))
        .and_then(|v| v.value.as_deref());
    assert_eq!(pin_env.map(Path::new), Some(run.pins.pin_dir.as_path()));

    // Socket hooks on the host's cgroup v2 root (not the container's private cgroup namespace).
    let kube_proxy_ebpf::dataplane::sock_lb::SockLbCgroup::Path(cgroup) = &run.socket_lb_cgroup
    else {
        panic!("--socket-lb-cgroup must name the mounted host cgroup, not auto/none")
    };
    let cgroup_mount = mounts
        .iter()
        .find(|m| cgroup.starts_with(&m.mount_path))
        .expect("--socket-lb-cgroup is on a mounted volume");
    let cgroup_volume = volumes
        .iter()
        .find(|v| v.name == cgroup_mount.name)
        .and_then(|v| v.host_path.as_ref())
        .expect("the cgroup volume is a hostPath");
    assert_eq!(cgroup_volume.path, "/sys/fs/cgroup");

    // Probes on the health port, the right paths.
    let probe = |p: Option<&k8s_openapi::api::core::v1::Probe>| {
        let get = p.and_then(|p| p.http_get.as_ref()).expect("httpGet probe");
        (
            get.path.clone().unwrap_or_default(),
            serde_json::to_value(&get.port).expect("port"),
        )
    };
    assert_eq!(
        probe(c.liveness_probe.as_ref()),
        ("/livez".into(), serde_json::json!(10256))
    );
    assert_eq!(
        probe(c.readiness_probe.as_ref()),
        ("/healthz".into(), serde_json::json!(10256))
    );

    // Capabilities: not privileged, only what the agent needs.
    let sc = c.security_context.as_ref().expect("securityContext");
    assert_ne!(sc.privileged, Some(true), "the agent is not privileged");
    let caps = sc.capabilities.as_ref().expect("capabilities");
    assert_eq!(caps.drop.as_deref(), Some(&["ALL".to_owned()][..]));
    let mut add = caps.add.clone().unwrap_or_default();
    add.sort();
    assert_eq!(add, ["BPF", "NET_ADMIN", "PERFMON"]);
    assert!(
        c.resources
            .as_ref()
            .and_then(|r| r.requests.as_ref())
            .is_some()
    );
}

#[test]
fn cleanup_daemonset_runs_the_cleanup_command() {
    let o = load_all();
    let pod = o.daemonsets["kube-proxy-ebpf-cleanup"]
        .spec
        .template
        .spec
        .as_ref()
        .expect("pod spec");
    let init = &pod.init_containers.as_ref().expect("init containers")[0];
    let argv: Vec<String> = init.command.clone().unwrap_or_default();
    let cli = Cli::try_parse_from(&argv).unwrap_or_else(|e| panic!("{argv:?}: {e}"));
    let Command::Cleanup(pins) = cli.command else {
        panic!("{argv:?} is not `cleanup`")
    };
    // The same host directory the agent pins in.
    let mounts = init.volume_mounts.as_deref().unwrap_or_default();
    let volumes = pod.volumes.as_deref().unwrap_or_default();
    assert_eq!(
        host_pin_dir(&pins.pin_dir, mounts, volumes),
        Path::new(proxy_common::DEFAULT_PIN_DIR)
    );
}

/// Where `pin_dir` (a path in the container) is on the host: it must be on a hostPath mount of
/// the host's /sys/fs/bpf, mounted outside /sys (the runtimes' default AppArmor profiles deny
/// writes under /sys/fs/ but the cgroup fs, and pinning or unpinning is a write).
fn host_pin_dir(
    pin_dir: &Path,
    mounts: &[k8s_openapi::api::core::v1::VolumeMount],
    volumes: &[k8s_openapi::api::core::v1::Volume],
) -> PathBuf {
    let mount = mounts
        .iter()
        .find(|m| pin_dir.starts_with(&m.mount_path))
        .unwrap_or_else(|| panic!("--pin-dir {} is on no mounted volume", pin_dir.display()));
    assert!(
        !Path::new(&mount.mount_path).starts_with("/sys"),
        "the bpffs is mounted at {} (under /sys: default AppArmor profiles deny pinning there)",
        mount.mount_path
    );
    let host = volumes
        .iter()
        .find(|v| v.name == mount.name)
        .and_then(|v| v.host_path.as_ref())
        .unwrap_or_else(|| panic!("--pin-dir's volume {} is not a hostPath", mount.name));
    assert_eq!(host.path, "/sys/fs/bpf", "the pins are on the host's bpffs");
    let rel = pin_dir.strip_prefix(&mount.mount_path).expect("prefix");
    Path::new(&host.path).join(rel)
}

#[test]
fn rbac_is_least_privilege() {
    let o = load_all();
    let role = &o.cluster_roles[0];
    let mut granted: Vec<(String, String, String)> = Vec::new();
    for rule in role.rules.iter().flatten() {
        for group in rule.api_groups.iter().flatten() {
            for resource in rule.resources.iter().flatten() {
                for verb in &rule.verbs {
                    granted.push((group.clone(), resource.clone(), verb.clone()));
                }
            }
        }
    }
    let allowed = |g: &str, r: &str, v: &str| match (g, r) {
        ("", "services" | "nodes")
        | ("discovery.k8s.io", "endpointslices")
        | ("networking.k8s.io", "servicecidrs") => matches!(v, "get" | "list" | "watch"),
        // kube-rs's Recorder: events.k8s.io/v1 only, create then patch for a repeat.
        ("events.k8s.io", "events") => matches!(v, "create" | "patch"),
        _ => false,
    };
    for (g, r, v) in &granted {
        assert!(allowed(g, r, v), "ClusterRole grants {v} on {g}/{r}");
    }
    let mut needed = vec![
        ("events.k8s.io", "events", "create"),
        ("events.k8s.io", "events", "patch"),
    ];
    for (g, r) in [
        ("", "services"),
        ("", "nodes"),
        ("discovery.k8s.io", "endpointslices"),
        ("networking.k8s.io", "servicecidrs"),
    ] {
        needed.extend(["get", "list", "watch"].map(|v| (g, r, v)));
    }
    for (g, r, v) in needed {
        assert!(
            granted.contains(&(g.into(), r.into(), v.into())),
            "missing {v} on {g}/{r}"
        );
    }
    // The namespaced Role: read the agent's own DaemonSet (uninstall or restart), nothing else.
    assert_eq!(o.roles.len(), 1, "one Role");
    let ns_role = &o.roles[0];
    assert_eq!(ns_role.metadata.namespace.as_deref(), Some("kube-system"));
    for rule in ns_role.rules.iter().flatten() {
        assert_eq!(rule.api_groups.as_deref(), Some(&["apps".to_owned()][..]));
        assert_eq!(
            rule.resources.as_deref(),
            Some(&["daemonsets".to_owned()][..])
        );
        assert_eq!(
            rule.resource_names.as_deref(),
            Some(&["kube-proxy-ebpf".to_owned()][..]),
            "only the agent's own DaemonSet"
        );
        for v in &rule.verbs {
            assert!(
                matches!(v.as_str(), "get" | "list" | "watch"),
                "Role grants {v}"
            );
        }
    }
    let rb = &o.role_bindings[0];
    assert_eq!(rb.role_ref.kind, "Role");
    assert_eq!(
        Some(rb.role_ref.name.as_str()),
        ns_role.metadata.name.as_deref()
    );
    assert_eq!(rb.metadata.namespace.as_deref(), Some("kube-system"));
    let b = &o.bindings[0];
    assert_eq!(
        b.role_ref.name,
        role.metadata.name.clone().unwrap_or_default()
    );
    let subject = &b.subjects.as_ref().expect("subjects")[0];
    assert_eq!(subject.kind, "ServiceAccount");
    assert_eq!(
        Some(subject.name.as_str()),
        o.service_accounts[0].metadata.name.as_deref()
    );
    assert_eq!(subject.namespace.as_deref(), Some("kube-system"));
}

/// The capabilities a container of deploy/ may add (issue 13); anything else fails here.
const ALLOWED_CAPS: [&str; 3] = ["BPF", "NET_ADMIN", "PERFMON"];

/// Every container and init container of every DaemonSet, with its DaemonSet's name.
fn containers(o: &Objects) -> Vec<(String, bool, &k8s_openapi::api::core::v1::Container)> {
    let mut out = Vec::new();
    for (name, ds) in &o.daemonsets {
        let pod = ds.spec.template.spec.as_ref();
        let pod = pod.unwrap_or_else(|| panic!("DaemonSet {name}: no pod spec"));
        for c in pod.init_containers.iter().flatten() {
            out.push((name.clone(), true, c));
        }
        for c in &pod.containers {
            out.push((name.clone(), false, c));
        }
    }
    out
}

#[test]
fn every_container_runs_with_least_privilege() {
    let o = load_all();
    let mut checked = 0;
    for (ds, init, c) in containers(&o) {
        let at = format!("DaemonSet {ds} container {}", c.name);
        let sc = c
            .security_context
            .as_ref()
            .unwrap_or_else(|| panic!("{at}: no securityContext"));
        assert_eq!(
            sc.read_only_root_filesystem,
            Some(true),
            "{at}: readOnlyRootFilesystem"
        );
        if sc.privileged == Some(true) && c.name == "node-settings" {
            // The second exception, justified in daemonset.yaml: /proc/sys is read-only in an
            // unprivileged container. It only runs `--init-only` (nf_conntrack settings) and
            // sees only the read-only ConfigMap.
            assert!(init && ds == "kube-proxy-ebpf", "{at}: privileged");
            let argv: Vec<String> = c.command.iter().flatten().cloned().collect();
            assert_eq!(
                argv.get(1).map(String::as_str),
                Some("--init-only"),
                "{at}: the privileged step only writes the node's settings: {argv:?}"
            );
            let cli =
                Cli::try_parse_from(kube_proxy_ebpf::cli::kube_proxy::with_default_subcommand(
                    argv.iter().map(Into::into).collect(),
                ))
                .unwrap_or_else(|e| panic!("{at}: {argv:?}: {e}"));
            let Command::Run(run) = cli.command else {
                panic!("{at}: not `run`")
            };
            assert_eq!(run.kube_proxy.init_only, Some(true));
            let mounts = c.volume_mounts.as_deref().unwrap_or_default();
            assert_eq!(mounts.len(), 1, "{at}: only the ConfigMap");
            assert_eq!(mounts[0].name, "config", "{at}");
            assert_eq!(mounts[0].read_only, Some(true), "{at}");
            checked += 1;
            continue;
        }
        if sc.privileged == Some(true) {
            // The one other exception, justified in daemonset.yaml: mounting a bpffs needs
            // CAP_SYS_ADMIN, Bidirectional propagation needs privileged. It must stay a
            // short init step that does nothing else.
            assert!(
                init && ds == "kube-proxy-ebpf" && c.name == "mount-bpffs",
                "{at}: privileged"
            );
            let argv = c.command.iter().flatten().cloned().collect::<Vec<_>>();
            let cli = Cli::try_parse_from(&argv).unwrap_or_else(|e| panic!("{at}: {argv:?}: {e}"));
            let Command::MountBpffs(args) = cli.command else {
                panic!("{at}: the privileged step only mounts the bpffs: {argv:?}")
            };
            assert_eq!(args.dir, Path::new("/sys/fs/bpf"), "{at}");
            let mounts = c.volume_mounts.as_deref().unwrap_or_default();
            assert_eq!(mounts.len(), 1, "{at}: only the bpffs mount");
            assert_eq!(mounts[0].mount_path, "/sys/fs/bpf", "{at}");
            checked += 1;
            continue;
        }
        assert_eq!(
            sc.allow_privilege_escalation,
            Some(false),
            "{at}: allowPrivilegeEscalation"
        );
        let caps = sc
            .capabilities
            .as_ref()
            .unwrap_or_else(|| panic!("{at}: no capabilities"));
        assert_eq!(
            caps.drop.as_deref(),
            Some(&["ALL".to_owned()][..]),
            "{at}: drop ALL"
        );
        for cap in caps.add.iter().flatten() {
            assert!(ALLOWED_CAPS.contains(&cap.as_str()), "{at}: adds {cap}");
        }
        let seccomp = sc
            .seccomp_profile
            .as_ref()
            .unwrap_or_else(|| panic!("{at}: no seccompProfile"));
        assert_eq!(seccomp.type_, "RuntimeDefault", "{at}: seccompProfile");
        checked += 1;
    }
    assert_eq!(
        checked, 5,
        "agent, its bpffs and node-settings steps, cleanup and its idler"
    );

    for (name, ds) in &o.daemonsets {
        let pod = ds.spec.template.spec.as_ref();
        let pod = pod.expect("pod spec");
        assert_ne!(pod.host_pid, Some(true), "DaemonSet {name}: hostPID");
        assert_ne!(pod.host_ipc, Some(true), "DaemonSet {name}: hostIPC");
        if let Some(sc) = &pod.security_context
            && let Some(p) = &sc.seccomp_profile
        {
            assert_ne!(
                p.type_, "Unconfined",
                "DaemonSet {name}: pod seccompProfile"
            );
        }
        for v in pod.volumes.iter().flatten() {
            if let Some(hp) = &v.host_path {
                assert!(
                    matches!(hp.path.as_str(), "/sys/fs/bpf" | "/sys/fs/cgroup"),
                    "DaemonSet {name} volume {}: hostPath {}",
                    v.name,
                    hp.path
                );
            }
        }
    }
}

#[test]
fn agent_and_cleanup_add_exactly_what_they_use() {
    let o = load_all();
    let added = |ds: &str, name: &str| {
        let (_, _, c) = containers(&o)
            .into_iter()
            .find(|(d, _, c)| d == ds && c.name == name)
            .unwrap_or_else(|| panic!("DaemonSet {ds} has no container {name}"));
        let mut add = (c.security_context.as_ref())
            .and_then(|s| s.capabilities.as_ref())
            .and_then(|c| c.add.clone())
            .unwrap_or_default();
        add.sort();
        add
    };
    assert_eq!(
        added("kube-proxy-ebpf", "kube-proxy-ebpf"),
        ["BPF", "NET_ADMIN", "PERFMON"]
    );
    // cleanup loads no program: no PERFMON (tests/least_privilege.rs runs it with these two).
    assert_eq!(
        added("kube-proxy-ebpf-cleanup", "cleanup"),
        ["BPF", "NET_ADMIN"]
    );
    assert!(added("kube-proxy-ebpf-cleanup", "done").is_empty());
}

#[test]
fn metrics_bind_to_loopback_as_deployed_and_by_default() {
    use kube_proxy_ebpf::cli::RunArgs;
    let o = load_all();
    let file = config::parse("config.yaml", &config_text(&o))
        .unwrap_or_else(|e| panic!("{e}"))
        .config;
    let ds = &o.daemonsets["kube-proxy-ebpf"];
    let c = &ds.spec.template.spec.as_ref().expect("pod").containers[0];
    let argv: Vec<String> = c
        .command
        .iter()
        .flatten()
        .chain(c.args.iter().flatten())
        .map(|a| {
            a.replace("$(NODE_NAME)", "node-1")
                .replace("$(POD_NAMESPACE)", "kube-system")
        })
        .collect();
    let effective = |argv: &[String], file: &config::FileConfig| -> RunArgs {
        use clap::{CommandFactory as _, FromArgMatches as _};
        let matches = Cli::command()
            .try_get_matches_from(argv)
            .unwrap_or_else(|e| panic!("{argv:?}: {e}"));
        let explicit = config::explicit_args(matches.subcommand_matches("run").expect("run"));
        let Command::Run(mut run) = Cli::from_arg_matches(&matches).expect("cli").command else {
            panic!("{argv:?} is not `run`")
        };
        config::apply(&mut run, file, &explicit).unwrap_or_else(|e| panic!("{e}"));
        run
    };
    let loopback = |run: &RunArgs| run.metrics_bind_address.0.map(|a| a.ip().is_loopback());
    // As deployed: the DaemonSet's flags over the ConfigMap.
    let run = effective(&argv, &file);
    assert_eq!(
        run.metrics_bind_address.to_string(),
        "127.0.0.1:10249",
        "/metrics as deployed"
    );
    // The agent's own default, with a config file that does not set it.
    let bare: Vec<String> = ["kube-proxy-ebpf", "run", "--manifests", "/m"]
        .map(String::from)
        .to_vec();
    const HEAD: &str =
        "apiVersion: kubeproxy.config.k8s.io/v1alpha1\nkind: KubeProxyConfiguration\n";
    let empty = config::parse("empty.yaml", HEAD)
        .unwrap_or_else(|e| panic!("{e}"))
        .config;
    assert_eq!(loopback(&effective(&bare, &empty)), Some(true), "default");
    // kube-proxy's `metricsBindAddress: ""` means the default, not every address.
    let blank = config::parse("blank.yaml", &format!("{HEAD}metricsBindAddress: \"\"\n"))
        .unwrap_or_else(|e| panic!("{e}"))
        .config;
    assert_eq!(
        loopback(&effective(&bare, &blank)),
        Some(true),
        "empty value"
    );
}
