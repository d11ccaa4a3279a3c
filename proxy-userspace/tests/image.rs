//! Privileged: the agent's image run by real container runtimes as deploy/daemonset.yaml runs it.
//! The image archive is built from the debug agent by `proxy_image::build` (what `cargo xtask
//! image` writes), loaded into a private podman store, and run with crun and with runc:
//! - the init container `mount-bpffs` (privileged, Bidirectional) on an empty directory standing
//!   for the host's /sys/fs/bpf mounts a bpffs that the host side sees, and finds it on a second
//!   run;
//! - the agent container, with the manifest's command (`$(NODE_NAME)`, `$(POD_NAMESPACE)`
//!   expanded like the kubelet does), env, volume mounts and securityContext (capabilities drop
//!   ALL add BPF/NET_ADMIN/PERFMON, no privilege escalation, read-only root, uid 0, the
//!   RuntimeDefault seccomp profile), in the node's network namespace (hostNetwork), with
//!   deploy/configmap.yaml's configuration and kubeadm's kubeconfig naming the fake API server,
//!   serves a ClusterIP to a pod and a NodePort to an external client (real TCP backends in
//!   their own namespaces);
//! - `podman inspect` and /proc of the container's process say it ran with exactly that;
//! - the image's netfilter tools (iptables' nft and legacy backends, nft) run under that
//!   securityContext (read-only root, no CAP_NET_RAW): before the agent starts, kube-proxy's
//!   leftovers are put in the node's namespace (its nftables-mode `table ip kube-proxy`, and an
//!   iptables-mode `KUBE-` chain set loaded by the image's own `iptables-nft-restore
//!   --noflush`), which the image's `iptables-nft-save` and `nft list tables` see; once the
//!   agent is ready (`--remove-kube-proxy-rules`, in the manifest's args) it has logged
//!   `removed kube-proxy's rules` and neither is left.
//!
//! RuntimeDefault: containerd's and Docker's default profiles allow bpf(2) to a container holding
//! CAP_BPF and perf_event_open(2) to one holding CAP_PERFMON; podman's (containers/common, also
//! CRI-O's) allows both only with CAP_SYS_ADMIN, so under it the agent cannot load anything (the
//! CRI-O caveat in docs/replacing-kube-proxy.md; checked here too). The agent runs with podman's
//! default profile changed only in those two rules, the way containerd's differs.
//!
//! Hosts: the hostPaths are test-owned (a bpffs instance in a temp dir, a cgroup v2 directory the
//! test creates); nothing is attached to the machine's root cgroup or network namespace. On a
//! hybrid cgroup host whose v2 hierarchy holds a controller crun refuses to start ("cgroups in
//! hybrid mode not supported"); crun then runs in a mount namespace of its own where that
//! hierarchy is hidden, so it manages the container's v1 cgroups only. Rlimits the runtime
//! would raise are pinned to this process's own (no CAP_SYS_RESOURCE in some sandboxes).
//!
//! Run by `sudo cargo xtask test` (sets KPE_PRIVILEGED=1, one test thread); skipped otherwise.

mod common_kube;
mod common_netns;

use std::{
    collections::BTreeSet,
    net::Ipv4Addr,
    os::unix::fs::PermissionsExt as _,
    path::{Path, PathBuf},
    process::{Command, Output},
    thread,
    time::{Duration, Instant},
};

use common_kube::{
    BIN, NODE, backend_ips,
    deployed::{
        self, KUBELET_ENV, SERVICE_ACCOUNT_MOUNT, container, container_argv, container_env,
        daemonset, kubeadm_kubeconfig, service_account,
    },
    node, ready, service, slice,
};
use k8s_openapi::api::{
    apps::v1::DaemonSet,
    core::v1::{Container, Volume},
};
use nix::{
    mount::{MntFlags, MsFlags, mount, umount2},
    sys::statfs::{BPF_FS_MAGIC, statfs},
};
use proxy_testenv::{
    CLUSTER_CIDR, Cgroup, FakeApiServer, TempDir, Topology, Uplink,
    kube_proxy::{self, KubeProxyService},
    require_privileged, run_with_timeout,
};
use serde_json::{Value, json};

const VIP: Ipv4Addr = Ipv4Addr::new(10, 96, 7, 10);
const NODE_PORT: u16 = 30_081;
const NODE_IP: Ipv4Addr = Ipv4Addr::new(192, 168, 62, 10);
const EXT_IP: Ipv4Addr = Ipv4Addr::new(192, 168, 62, 100);
const AGENT: &str = "kube-proxy-ebpf";
const MOUNT_STEP: &str = "mount-bpffs";
/// Where Debian's podman keeps its default seccomp profile (containers-common).
const PODMAN_SECCOMP: &str = "/usr/share/containers/seccomp.json";
const PODMAN_TIMEOUT: Duration = Duration::from_secs(120);
/// kube-proxy's leftovers are for a Service the test sends nothing to (the same backends), so
/// its rules are never hit, removed yet or not.
const LEFTOVER_VIP: Ipv4Addr = Ipv4Addr::new(10, 96, 7, 20);
const LEFTOVER_NODE_PORT: u16 = 30_082;
/// The agent's log line once it removed kube-proxy's rules (`--remove-kube-proxy-rules`).
const REMOVED_LINE: &str = "removed kube-proxy's rules";
/// Where the iptables-mode leftovers are mounted in the container that loads them.
const IPTABLES_RULES_MOUNT: &str = "/kube-proxy-iptables.rules";

// ---------------------------------------------------------------------------------------------
// Mounts and the private podman store

/// A mount the test made at `path`, detached on drop (the bpffs over it too).
struct MountGuard {
    path: PathBuf,
}

impl MountGuard {
    /// `path` bind-mounted to itself and made shared, so a mount a container makes there with
    /// Bidirectional propagation reaches this namespace (the host's /sys/fs/bpf of a node).
    fn shared_dir(path: &Path) -> Self {
        std::fs::create_dir_all(path).expect("mount point");
        mount(
            Some(path),
            path,
            None::<&str>,
            MsFlags::MS_BIND,
            None::<&str>,
        )
        .expect("bind");
        let guard = Self {
            path: path.to_owned(),
        };
        mount(
            None::<&str>,
            path,
            None::<&str>,
            MsFlags::MS_SHARED,
            None::<&str>,
        )
        .expect("make shared");
        guard
    }

    /// `source` bind-mounted at `path`.
    fn bind(source: &Path, path: &Path) -> Self {
        std::fs::create_dir_all(path).expect("mount point");
        mount(
            Some(source),
            path,
            None::<&str>,
            MsFlags::MS_BIND,
            None::<&str>,
        )
        .expect("bind");
        Self {
            path: path.to_owned(),
        }
    }
}

impl Drop for MountGuard {
    fn drop(&mut self) {
        // The bind and whatever was stacked on it (the bpffs): bounded, each a lazy detach.
        for _ in 0..4 {
            if umount2(&self.path, MntFlags::MNT_DETACH).is_err() {
                break;
            }
        }
    }
}

/// The OCI runtime podman runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Runtime {
    Crun,
    Runc,
}

impl Runtime {
    fn name(self) -> &'static str {
        match self {
            Runtime::Crun => "crun",
            Runtime::Runc => "runc",
        }
    }
}

/// crun refuses hybrid hosts whose cgroup v2 hierarchy holds a controller.
fn crun_needs_v1_only_view() -> bool {
    let fs_type = |p: &str| statfs(p).map(|s| s.filesystem_type());
    let tmpfs_root = fs_type("/sys/fs/cgroup").is_ok_and(|t| t == nix::sys::statfs::TMPFS_MAGIC);
    let unified =
        fs_type("/sys/fs/cgroup/unified").is_ok_and(|t| t == nix::sys::statfs::CGROUP2_SUPER_MAGIC);
    tmpfs_root
        && unified
        && std::fs::read_to_string("/sys/fs/cgroup/unified/cgroup.controllers")
            .is_ok_and(|c| !c.trim().is_empty())
}

/// podman with its own root, runroot and tmpdir under a temp dir (nothing in the machine's
/// stores), the cgroupfs manager (no systemd) with a cgroup parent of its own, and `runtime`.
/// Drop removes its containers (by name, in this store only), kills their conmon by PID,
/// detaches what is mounted under it and removes its cgroup parent.
struct Podman {
    dir: TempDir,
    /// `--cgroup-parent` of every container (conmon goes to `<parent>/conmon`).
    cgroup_parent: String,
    runtime_path: PathBuf,
    containers: std::cell::RefCell<Vec<String>>,
    conmons: std::cell::RefCell<Vec<i32>>,
}

impl Podman {
    fn new(runtime: Runtime) -> Self {
        let dir = TempDir::new("kpe-podman").expect("podman dir");
        let runtime_path = match runtime {
            Runtime::Crun if crun_needs_v1_only_view() => {
                // A mount namespace of crun's own (each of its invocations), the cgroup v2 mount
                // made private there and covered, so crun sees a v1-only host. Other mounts keep
                // their propagation (a Bidirectional volume still reaches the host).
                let wrapper = dir.join("crun-v1-only");
                std::fs::write(
                    &wrapper,
                    "#!/bin/sh\nexec unshare --mount --propagation unchanged sh -c 'mount \
                     --make-private /sys/fs/cgroup/unified && mount -t tmpfs -o size=64k \
                     crun-v1-only /sys/fs/cgroup/unified && exec crun \"$@\"' crun \"$@\"\n",
                )
                .expect("crun wrapper");
                std::fs::set_permissions(&wrapper, std::fs::Permissions::from_mode(0o755))
                    .expect("chmod");
                wrapper
            }
            _ => PathBuf::from(runtime.name()),
        };
        Self {
            cgroup_parent: format!(
                "/kpe-podman-{}",
                dir.path().file_name().unwrap_or_default().to_string_lossy()
            ),
            dir,
            runtime_path,
            containers: Default::default(),
            conmons: Default::default(),
        }
    }

    fn command(&self, args: &[&str]) -> Command {
        let mut cmd = Command::new("podman");
        let d = self.dir.path();
        cmd.arg("--root")
            .arg(d.join("root"))
            .arg("--runroot")
            .arg(d.join("runroot"))
            .arg("--tmpdir")
            .arg(d.join("tmp"))
            .args(["--storage-driver", "vfs", "--cgroup-manager", "cgroupfs"])
            .args(["--events-backend", "file", "--runtime"])
            .arg(&self.runtime_path)
            .args(args);
        cmd
    }

    fn output(&self, args: &[&str]) -> Output {
        run_with_timeout(self.command(args), PODMAN_TIMEOUT)
            .unwrap_or_else(|e| panic!("podman {args:?}: {e:#}"))
    }

    /// `podman args...`, which must succeed: its stdout.
    fn ok(&self, args: &[&str]) -> String {
        let out = self.output(args);
        assert!(
            out.status.success(),
            "podman {args:?} ({}): {}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    fn inspect(&self, name: &str) -> Value {
        let text = self.ok(&["inspect", "--type", "container", name]);
        let all: Value = serde_json::from_str(&text).expect("podman inspect JSON");
        all[0].clone()
    }

    fn logs(&self, name: &str) -> String {
        let out = self.output(&["logs", name]);
        format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        )
    }

    /// Runs a container (`podman run` + `flags` + image + `argv[1..]`, entrypoint `argv[0]`);
    /// `detach` returns once it started, else when it exited.
    fn run(&self, name: &str, flags: &[String], argv: &[String], detach: bool) -> Output {
        self.containers.borrow_mut().push(name.to_owned());
        let entrypoint = serde_json::to_string(&argv[..1]).expect("JSON");
        let parent = format!("--cgroup-parent={}", self.cgroup_parent);
        let mut args: Vec<&str> = vec!["run", "--name", name, "--pull", "never", &parent];
        if detach {
            args.push("--detach");
        }
        args.extend(flags.iter().map(String::as_str));
        args.extend(["--entrypoint", &entrypoint, deployed_image()]);
        args.extend(argv[1..].iter().map(String::as_str));
        let out = self.output(&args);
        if let Some(pid) = self
            .inspect_opt(name)
            .and_then(|c| c["State"]["ConmonPid"].as_i64())
            && pid > 1
        {
            self.conmons.borrow_mut().push(pid as i32);
        }
        out
    }

    fn inspect_opt(&self, name: &str) -> Option<Value> {
        let out = self.output(&["inspect", "--type", "container", name]);
        out.status.success().then(|| {
            let all: Value = serde_json::from_slice(&out.stdout).unwrap_or_default();
            all[0].clone()
        })
    }
}

impl Drop for Podman {
    fn drop(&mut self) {
        for name in self.containers.borrow().iter() {
            let _ = run_with_timeout(
                self.command(&["rm", "--force", "--time", "0", name]),
                PODMAN_TIMEOUT,
            );
        }
        for pid in self.conmons.borrow().iter() {
            let _ = nix::sys::signal::kill(
                nix::unistd::Pid::from_raw(*pid),
                nix::sys::signal::Signal::SIGKILL,
            );
        }
        // Mounts podman left under its directories (a container's shm), deepest first.
        let root = self.dir.path().to_string_lossy().into_owned();
        let mut mounts: Vec<String> = std::fs::read_to_string("/proc/self/mountinfo")
            .unwrap_or_default()
            .lines()
            .filter_map(|l| l.split_whitespace().nth(4).map(str::to_owned))
            .filter(|m| m.starts_with(&root))
            .collect();
        mounts.sort_by_key(|m| std::cmp::Reverse(m.len()));
        for m in mounts {
            let _ = umount2(m.as_str(), MntFlags::MNT_DETACH);
        }
        remove_cgroup_parent(&self.cgroup_parent);
    }
}

/// Removes `parent` and its `conmon` child from every cgroup hierarchy mounted (v1 controllers
/// and v2), once they are empty: bounded, two seconds at most.
fn remove_cgroup_parent(parent: &str) {
    let hierarchies: Vec<PathBuf> = std::fs::read_to_string("/proc/self/mountinfo")
        .unwrap_or_default()
        .lines()
        .filter_map(|l| {
            let (pre, post) = l.split_once(" - ")?;
            let fs_type = post.split_whitespace().next()?;
            let mount_point = pre.split_whitespace().nth(4)?;
            (fs_type == "cgroup" || fs_type == "cgroup2").then(|| PathBuf::from(mount_point))
        })
        .collect();
    let deadline = Instant::now() + Duration::from_secs(2);
    for h in hierarchies {
        let dir = h.join(parent.trim_start_matches('/'));
        for d in [dir.join("conmon"), dir] {
            while d.exists() && std::fs::remove_dir(&d).is_err() && Instant::now() < deadline {
                thread::sleep(Duration::from_millis(20));
            }
        }
    }
}

/// The image the manifests run.
fn deployed_image() -> &'static str {
    "kube-proxy-ebpf:latest"
}

// ---------------------------------------------------------------------------------------------
// The manifest as podman flags

/// The host side of each volume: hostPaths and ConfigMaps mapped to the test's directories.
struct HostSide {
    bpffs: PathBuf,
    cgroup: PathBuf,
    config: PathBuf,
    kubeconfig: PathBuf,
}

impl HostSide {
    fn source(&self, volume: &Volume) -> &Path {
        if let Some(hp) = &volume.host_path {
            return match hp.path.as_str() {
                "/sys/fs/bpf" => &self.bpffs,
                "/sys/fs/cgroup" => &self.cgroup,
                other => panic!("hostPath {other}: not one this test maps to its own directory"),
            };
        }
        match volume.config_map.as_ref().map(|c| c.name.as_str()) {
            Some("kube-proxy-ebpf") => &self.config,
            Some("kube-proxy") => &self.kubeconfig,
            other => panic!(
                "volume {}: a source this test does not know: {other:?}",
                volume.name
            ),
        }
    }
}

/// podman's propagation option of a Kubernetes mountPropagation.
fn propagation(mode: Option<&str>) -> &'static str {
    match mode {
        Some("Bidirectional") => "rshared",
        Some("HostToContainer") => "rslave",
        None | Some("None") => "rprivate",
        Some(other) => panic!("mountPropagation {other}"),
    }
}

/// What the kubelet asks of the runtime for container `c` of `ds`, as `podman run` flags: the
/// pod's network (the node's namespace), the securityContext, env and volume mounts.
fn podman_flags(
    ds: &DaemonSet,
    c: &Container,
    node_netns: &Path,
    host: &HostSide,
    seccomp_profile: Option<&Path>,
) -> Vec<String> {
    let pod = ds.spec.template.spec.as_ref();
    let pod = pod.expect("pod spec");
    assert_eq!(pod.host_network, Some(true), "hostNetwork");
    let mut flags = vec![format!("--network=ns:{}", node_netns.display())];
    let sc = c.security_context.as_ref().expect("securityContext");
    if sc.read_only_root_filesystem == Some(true) {
        // A Kubernetes read-only root has no tmpfs over /tmp, /var/tmp, /run.
        flags.extend(["--read-only".into(), "--read-only-tmpfs=false".into()]);
    }
    if sc.privileged == Some(true) {
        flags.push("--privileged".into());
    } else {
        if sc.allow_privilege_escalation == Some(false) {
            flags.push("--security-opt=no-new-privileges".into());
        }
        let caps = sc.capabilities.as_ref().expect("capabilities");
        for cap in caps.drop.iter().flatten() {
            flags.push(format!("--cap-drop={cap}"));
        }
        for cap in caps.add.iter().flatten() {
            flags.push(format!("--cap-add={cap}"));
        }
        let seccomp = sc.seccomp_profile.as_ref().map(|s| s.type_.as_str());
        assert_eq!(seccomp, Some("RuntimeDefault"));
        // None: podman's own default profile.
        if let Some(profile) = seccomp_profile {
            flags.push(format!("--security-opt=seccomp={}", profile.display()));
        }
    }
    if let Some(uid) = sc.run_as_user {
        flags.push(format!("--user={uid}"));
    }
    for (k, v) in container_env(c, NODE) {
        flags.push(format!("--env={k}={v}"));
    }
    let volumes = pod.volumes.as_deref().unwrap_or_default();
    for m in c.volume_mounts.iter().flatten() {
        let volume = volumes
            .iter()
            .find(|v| v.name == m.name)
            .unwrap_or_else(|| panic!("volumeMount {}: no volume", m.name));
        let ro = if m.read_only == Some(true) {
            "ro"
        } else {
            "rw"
        };
        flags.push(format!(
            "--volume={}:{}:{ro},{}",
            host.source(volume).display(),
            m.mount_path,
            propagation(m.mount_propagation.as_deref())
        ));
    }
    flags
}

/// The rlimits podman would raise (nofile 1048576, nproc 32768), pinned to this process's own
/// so they need no CAP_SYS_RESOURCE (which some sandboxes withhold).
fn ulimit_flags() -> Vec<String> {
    let limit = |r| nix::sys::resource::getrlimit(r).expect("getrlimit");
    let (_, nofile) = limit(nix::sys::resource::Resource::RLIMIT_NOFILE);
    let (_, nproc) = limit(nix::sys::resource::Resource::RLIMIT_NPROC);
    let nofile = nofile.min(1_048_576);
    let nproc = nproc.min(32_768);
    vec![
        format!("--ulimit=nofile={nofile}:{nofile}"),
        format!("--ulimit=nproc={nproc}:{nproc}"),
    ]
}

/// containerd's RuntimeDefault, as a change to podman's default profile: bpf(2) also allowed
/// with CAP_BPF and perf_event_open(2) with CAP_PERFMON (podman's allows them only with
/// CAP_SYS_ADMIN). Every other rule is podman's.
fn containerd_runtime_default(podman_default: &Value) -> Value {
    let mut profile = podman_default.clone();
    let rules = profile["syscalls"].as_array_mut().expect("syscalls");
    let widened = [("bpf", "CAP_BPF"), ("perf_event_open", "CAP_PERFMON")];
    let mut added = Vec::new();
    for rule in rules.iter_mut() {
        for (syscall, cap) in widened {
            let names = rule["names"].as_array().cloned().unwrap_or_default();
            if !names.iter().any(|n| n == syscall) {
                continue;
            }
            let excludes_admin_only = rule["excludes"]["caps"] == json!(["CAP_SYS_ADMIN"]);
            if rule["action"] != "SCMP_ACT_ALLOW" && excludes_admin_only {
                // The denial applies only to containers holding neither capability.
                let mut denial = rule.clone();
                denial["names"] = json!([syscall]);
                denial["excludes"]["caps"] = json!(["CAP_SYS_ADMIN", cap]);
                added.push(denial);
                added.push(json!({"names": [syscall], "action": "SCMP_ACT_ALLOW",
                                  "includes": {"caps": [cap]}}));
                rule["names"] = json!(names.iter().filter(|n| *n != syscall).collect::<Vec<_>>());
            }
        }
    }
    assert_eq!(
        added.len(),
        4,
        "podman's profile no longer denies bpf/perf_event_open alike"
    );
    rules.extend(added);
    profile
}

// ---------------------------------------------------------------------------------------------
// The node

/// The one-node topology with an uplink and an external client, the fake API server serving a
/// NodePort Service, and the test's host side. Field order is drop order: podman's containers
/// first, then mounts, cgroup, API server, namespaces.
struct Node {
    podman: Podman,
    _bpffs: MountGuard,
    _cgroup_bind: MountGuard,
    _cgroup: Cgroup,
    api: FakeApiServer,
    uplink: Uplink,
    topo: Topology,
    host: HostSide,
    seccomp: PathBuf,
}

impl Node {
    fn new(runtime: Runtime, archive: &Path) -> Self {
        let topo = Topology::new().expect("topology");
        let uplink = topo.add_uplink(NODE_IP, EXT_IP).expect("uplink");
        let api = FakeApiServer::start_in(Some(&topo.node().path())).expect("fake API server");
        let mut web = service("web", VIP, 80);
        web["spec"]["type"] = json!("NodePort");
        web["spec"]["ports"][0]["nodePort"] = json!(NODE_PORT);
        api.apply_all([
            node("zone-a"),
            web,
            slice("web", "1", &ready(&backend_ips())),
        ])
        .expect("objects");
        let tmp = topo.tmp().path().to_owned();
        let cgroup = Cgroup::new(&format!("kpe-test-{}", topo.prefix())).expect("cgroup");
        let cgroup_bind = MountGuard::bind(cgroup.path(), &tmp.join("host-cgroup2"));
        let bpffs = MountGuard::shared_dir(&tmp.join("host-bpffs"));
        let config = tmp.join("configmap");
        std::fs::create_dir_all(&config).expect("configmap dir");
        std::fs::write(config.join("config.yaml"), deployed::deployed_config()).expect("config");
        let kubeconfig = tmp.join("kube-proxy");
        std::fs::create_dir_all(&kubeconfig).expect("kubeconfig dir");
        std::fs::write(
            kubeconfig.join("kubeconfig.conf"),
            kubeadm_kubeconfig(&api.url(), Path::new(SERVICE_ACCOUNT_MOUNT)),
        )
        .expect("kubeconfig");
        let podman_default: Value = serde_json::from_str(
            &std::fs::read_to_string(PODMAN_SECCOMP).expect("podman's default seccomp profile"),
        )
        .expect("seccomp JSON");
        let seccomp = tmp.join("seccomp-runtime-default.json");
        std::fs::write(
            &seccomp,
            serde_json::to_vec(&containerd_runtime_default(&podman_default)).expect("JSON"),
        )
        .expect("seccomp profile");
        let podman = Podman::new(runtime);
        let loaded = podman.ok(&["load", "--input", &archive.to_string_lossy()]);
        assert!(
            loaded.contains("kube-proxy-ebpf:latest"),
            "podman load: {loaded}"
        );
        Self {
            podman,
            _bpffs: bpffs,
            _cgroup_bind: cgroup_bind,
            _cgroup: cgroup,
            api,
            uplink,
            host: HostSide {
                bpffs: tmp.join("host-bpffs"),
                cgroup: tmp.join("host-cgroup2"),
                config,
                kubeconfig,
            },
            topo,
            seccomp,
        }
    }

    fn name(&self, container: &str) -> String {
        format!("{}-{container}", self.topo.prefix())
    }

    /// The service account directory the kubelet mounts into every container.
    fn service_account(&self) -> PathBuf {
        service_account(self.topo.tmp().path())
    }

    /// The agent container's flags: the manifest's, plus what the kubelet adds (the service
    /// account, the `kubernetes` Service's env) and the rlimits; `seccomp` None for podman's
    /// own default profile.
    fn agent_flags(&self, ds: &DaemonSet, seccomp: Option<&Path>) -> Vec<String> {
        let c = container(ds, AGENT);
        let mut flags = podman_flags(ds, c, &self.topo.node().path(), &self.host, seccomp);
        flags.push(format!(
            "--volume={}:{SERVICE_ACCOUNT_MOUNT}:ro",
            self.service_account().display()
        ));
        flags.extend(KUBELET_ENV.iter().map(|(k, v)| format!("--env={k}={v}")));
        flags.extend(ulimit_flags());
        flags
    }

    /// Runs init container `mount-bpffs` as the manifest says; its output.
    fn mount_step(&self, ds: &DaemonSet, run: usize) -> String {
        let c = container(ds, MOUNT_STEP);
        let mut flags = podman_flags(
            ds,
            c,
            &self.topo.node().path(),
            &self.host,
            Some(&self.seccomp),
        );
        flags.extend(ulimit_flags());
        let name = self.name(&format!("{MOUNT_STEP}-{run}"));
        let argv = container_argv(c, NODE);
        let out = self.podman.run(&name, &flags, &argv, false);
        let text = String::from_utf8_lossy(&out.stdout).into_owned();
        assert!(
            out.status.success(),
            "{MOUNT_STEP} ({}): {text}{}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
        let inspect = self.podman.inspect(&name);
        assert_eq!(inspect["HostConfig"]["Privileged"], true, "{MOUNT_STEP}");
        assert_eq!(
            inspect["HostConfig"]["ReadonlyRootfs"], true,
            "{MOUNT_STEP}"
        );
        text
    }

    /// The agent's container has stopped: its log, then panic.
    fn fail(&self, what: &str) -> ! {
        let name = self.name(AGENT);
        let state = self
            .podman
            .inspect_opt(&name)
            .map(|c| c["State"].to_string())
            .unwrap_or_default();
        panic!(
            "{what}\ncontainer state: {state}\ncontainer log (tail):\n{}",
            tail(&self.podman.logs(&name), 40)
        );
    }
}

fn tail(text: &str, n: usize) -> String {
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(n)..].join("\n")
}

fn is_bpffs(path: &Path) -> bool {
    statfs(path).is_ok_and(|s| s.filesystem_type() == BPF_FS_MAGIC)
}

/// The `Cap*` masks of /proc/`pid`/status, and NoNewPrivs and Seccomp.
fn proc_status(pid: i64) -> std::collections::BTreeMap<String, String> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("proc status");
    status
        .lines()
        .filter_map(|l| l.split_once(':'))
        .filter(|(k, _)| {
            k.starts_with("Cap") || *k == "NoNewPrivs" || *k == "Seccomp" || *k == "Uid"
        })
        .map(|(k, v)| (k.to_owned(), v.trim().to_owned()))
        .collect()
}

// ---------------------------------------------------------------------------------------------

fn run_the_daemonset(runtime: Runtime, archive: &Path) {
    let started = Instant::now();
    let rt = runtime.name();
    let ds = daemonset();
    let node = Node::new(runtime, archive);

    // The init step on the host's empty /sys/fs/bpf: mounts a bpffs the host side sees.
    assert!(!is_bpffs(&node.host.bpffs));
    let first = node.mount_step(&ds, 1);
    assert!(
        first.contains("mounted a bpffs at /sys/fs/bpf") && is_bpffs(&node.host.bpffs),
        "{rt}: {MOUNT_STEP} did not mount a bpffs the host sees: {first:?}"
    );
    let second = node.mount_step(&ds, 2);
    assert!(
        second.contains("/sys/fs/bpf is a bpffs already"),
        "{rt}: second {MOUNT_STEP}: {second:?}"
    );

    // kube-proxy's rules, as a node it ran on has them, put there with the image's own tools.
    load_kube_proxy_leftovers(&node, &ds, rt);

    // The agent's container.
    let c = container(&ds, AGENT);
    let argv = container_argv(c, NODE);
    assert!(
        argv.contains(&format!("--hostname-override={NODE}"))
            && argv.contains(&"--daemonset=kube-system/kube-proxy-ebpf".to_owned()),
        "kubelet expansion: {argv:?}"
    );
    let name = node.name(AGENT);
    let out = node.podman.run(
        &name,
        &node.agent_flags(&ds, Some(&node.seccomp)),
        &argv,
        true,
    );
    if !out.status.success() {
        node.fail(&format!(
            "{rt}: podman run ({}): {}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        ));
    }
    wait_ready(&node, rt);
    let ready_after = started.elapsed();
    assert_serves(&node, rt);
    assert_kube_proxy_rules_removed(&node, rt);
    assert_ran_as_the_manifest_says(&node, &ds, &argv, rt);
    assert_bpf_allowed_only_under_runtime_default(&node, &ds, &argv, rt);
    eprintln!(
        "image: {rt}: mount-bpffs mounted then found the bpffs; the image's iptables and nft \
         loaded and listed kube-proxy's rules; the agent's container ready {} ms after this \
         runtime's node set-up began, ClusterIP and NodePort answered, kube-proxy's rules \
         removed, security context as the manifest says; {:.1} s in all",
        ready_after.as_millis(),
        started.elapsed().as_secs_f64()
    );
}

/// kube-proxy's iptables-mode rules (nat table): the `KUBE-SERVICES` portal jumped to from
/// PREROUTING and OUTPUT, masquerading of marked packets, and one Service's `KUBE-SVC-`/
/// `KUBE-SEP-` chains, with the matches and targets kube-proxy uses (comment, statistic, mark,
/// DNAT, MASQUERADE: the image's xtables extensions). `iptables-restore --noflush` input.
fn kube_proxy_iptables_rules() -> String {
    let backend = backend_ips()[0];
    let spn = "demo/kp-leftover:http";
    let svc = format!("KUBE-SVC-{}", kube_proxy::short_hash(spn, 16));
    let sep = format!(
        "KUBE-SEP-{}",
        kube_proxy::short_hash(&format!("{spn}{backend}"), 16)
    );
    format!(
        "*nat\n\
         :KUBE-SERVICES - [0:0]\n\
         :KUBE-POSTROUTING - [0:0]\n\
         :KUBE-MARK-MASQ - [0:0]\n\
         :{svc} - [0:0]\n\
         :{sep} - [0:0]\n\
         -A PREROUTING -m comment --comment \"kubernetes service portals\" -j KUBE-SERVICES\n\
         -A OUTPUT -m comment --comment \"kubernetes service portals\" -j KUBE-SERVICES\n\
         -A POSTROUTING -m comment --comment \"kubernetes postrouting rules\" -j KUBE-POSTROUTING\n\
         -A KUBE-MARK-MASQ -j MARK --or-mark 0x4000\n\
         -A KUBE-POSTROUTING -m mark ! --mark 0x4000/0x4000 -j RETURN\n\
         -A KUBE-POSTROUTING -j MARK --xor-mark 0x4000\n\
         -A KUBE-POSTROUTING -m comment --comment \"kubernetes service traffic requiring SNAT\" \
         -j MASQUERADE --random-fully\n\
         -A KUBE-SERVICES -d {LEFTOVER_VIP}/32 -p tcp -m comment --comment \"{spn} cluster IP\" \
         -m tcp --dport 80 -j {svc}\n\
         -A {svc} -m comment --comment \"{spn} -> {backend}:8080\" -m statistic --mode random \
         --probability 1.0 -j {sep}\n\
         -A {sep} -p tcp -m comment --comment \"{spn}\" -m tcp -j DNAT --to-destination \
         {backend}:8080\n\
         COMMIT\n"
    )
}

/// Runs `argv` (a netfilter tool of the image) in a container like the agent's: the manifest's
/// securityContext (read-only root; BPF, NET_ADMIN, PERFMON only), its mounts and the node's
/// network, plus `extra` flags. Its stdout; panics unless it exits 0.
fn run_tool(node: &Node, ds: &DaemonSet, name: &str, argv: &[&str], extra: &[String]) -> String {
    let mut flags = node.agent_flags(ds, Some(&node.seccomp));
    flags.extend_from_slice(extra);
    let argv: Vec<String> = argv.iter().map(|a| (*a).to_owned()).collect();
    let out = node.podman.run(&node.name(name), &flags, &argv, false);
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "{argv:?} in the image ({}): {stdout}{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    stdout
}

/// kube-proxy's leftovers in the node's namespace before the agent starts: its nftables-mode
/// table (loaded with the machine's nft, as kube-proxy would) and its iptables-mode chains
/// (loaded by the image's `iptables-nft-restore --noflush` under the agent's securityContext).
/// The image's `iptables-nft-save` and `nft list tables` then see both, and its legacy backend
/// and nft run.
fn load_kube_proxy_leftovers(node: &Node, ds: &DaemonSet, rt: &str) {
    let services = [
        KubeProxyService::tcp("demo", "kp-leftover", LEFTOVER_VIP, 80)
            .node_port(LEFTOVER_NODE_PORT)
            .target(8080, &backend_ips()),
    ];
    let tmp = node.topo.tmp().path();
    kube_proxy::install(
        node.topo.node(),
        &kube_proxy::nft_ruleset(&services, CLUSTER_CIDR),
        tmp,
    )
    .unwrap_or_else(|e| panic!("{rt}: kube-proxy's nftables rules: {e:#}"));
    let rules = tmp.join("kube-proxy-iptables.rules");
    std::fs::write(&rules, kube_proxy_iptables_rules()).expect("iptables rules");
    let mount = format!("--volume={}:{IPTABLES_RULES_MOUNT}:ro", rules.display());
    run_tool(
        node,
        ds,
        "iptables-nft-restore",
        &["iptables-nft-restore", "--noflush", IPTABLES_RULES_MOUNT],
        &[mount],
    );
    let saved = run_tool(
        node,
        ds,
        "iptables-nft-save",
        &["iptables-nft-save", "-t", "nat"],
        &[],
    );
    assert!(
        saved.contains(":KUBE-SERVICES")
            && saved.contains("-j KUBE-SVC-")
            && saved.contains("--probability 1")
            && saved.contains("-j DNAT --to-destination"),
        "{rt}: the image's iptables-nft-save does not show kube-proxy's chains:\n{saved}"
    );
    let tables = run_tool(node, ds, "nft-list-tables", &["nft", "list", "tables"], &[]);
    assert!(
        tables.lines().any(|l| l.trim() == "table ip kube-proxy"),
        "{rt}: the image's nft list tables: {tables:?}"
    );
    for (name, argv) in [
        ("nft-version", ["nft", "--version"]),
        (
            "iptables-legacy-version",
            ["iptables-legacy-save", "--version"],
        ),
        ("ip6tables-version", ["ip6tables-save", "--version"]),
    ] {
        let version = run_tool(node, ds, name, &argv, &[]);
        assert!(
            version.contains(" v"),
            "{rt}: {argv:?} in the image: {version:?}"
        );
    }
}

/// Once the agent is ready: it logged that it removed kube-proxy's rules (on a thread of its
/// own after the attach, so within a while), and the node's namespace has neither kube-proxy's
/// nftables table nor its `KUBE-` iptables chains.
fn assert_kube_proxy_rules_removed(node: &Node, rt: &str) {
    let name = node.name(AGENT);
    let deadline = Instant::now() + Duration::from_secs(30);
    let log = loop {
        let log = node.podman.logs(&name);
        if log.contains(REMOVED_LINE) {
            break log;
        }
        if Instant::now() >= deadline {
            node.fail(&format!(
                "{rt}: no {REMOVED_LINE:?} in the agent's log within 30 s of ready"
            ));
        }
        thread::sleep(Duration::from_millis(250));
    };
    let line = log
        .lines()
        .find(|l| l.contains(REMOVED_LINE))
        .unwrap_or_default();
    let netns_output = |argv: &[&str]| -> String {
        let out = node
            .topo
            .node()
            .output(argv, Duration::from_secs(30))
            .unwrap_or_else(|e| panic!("{argv:?} in the node: {e:#}"));
        assert!(
            out.status.success(),
            "{argv:?} in the node ({}): {}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    let tables = netns_output(&["nft", "list", "tables"]);
    assert!(
        !tables.contains("kube-proxy"),
        "{rt}: kube-proxy's nftables table remains after {line:?}:\n{tables}"
    );
    let saved = netns_output(&["iptables-nft-save"]);
    assert!(
        !saved.contains("KUBE-SERVICES") && !saved.contains("KUBE-SVC-"),
        "{rt}: kube-proxy's iptables chains remain after {line:?}:\n{saved}"
    );
    eprintln!("image: {rt}: the agent {}", line.trim());
}

/// /healthz answers 200 in the node (synced from the API server, programs attached); fails at
/// once if the container stops.
fn wait_ready(node: &Node, rt: &str) {
    let name = node.name(AGENT);
    let deadline = Instant::now() + Duration::from_secs(90);
    loop {
        let (code, _) =
            proxy_testenv::http_status(node.topo.node(), "http://127.0.0.1:10256/healthz")
                .unwrap_or((0, String::new()));
        if code == 200 {
            return;
        }
        let running = node
            .podman
            .inspect_opt(&name)
            .is_some_and(|c| c["State"]["Running"] == true);
        if !running {
            node.fail(&format!("{rt}: the agent's container stopped"));
        }
        if Instant::now() >= deadline {
            node.fail(&format!("{rt}: /healthz not 200 within 90 s"));
        }
        thread::sleep(Duration::from_millis(250));
    }
}

/// A pod through the ClusterIP, the external client through the NodePort on the node's uplink:
/// each reply from a backend.
fn assert_serves(node: &Node, rt: &str) {
    let replies = node
        .topo
        .curl_many(&format!("http://{VIP}/"), 6)
        .unwrap_or_else(|e| node.fail(&format!("{e:#}")));
    for (i, r) in replies.iter().enumerate() {
        if !r.as_ref().is_ok_and(|r| r.body.starts_with("be")) {
            node.fail(&format!(
                "{rt}: request {i} from the pod to the ClusterIP: {r:?}"
            ));
        }
    }
    let url = format!("http://{NODE_IP}:{NODE_PORT}/");
    for i in 0..3 {
        let out = node
            .uplink
            .ext
            .output(
                &["curl", "-s", "--max-time", "3", &url],
                Duration::from_secs(10),
            )
            .expect("curl");
        let body = String::from_utf8_lossy(&out.stdout);
        if !body.trim().starts_with("be") {
            node.fail(&format!(
                "{rt}: external request {i} to the NodePort: {body:?} ({})",
                out.status
            ));
        }
    }
}

/// The strings of a JSON array.
fn strings(v: &Value) -> Vec<String> {
    v.as_array()
        .into_iter()
        .flatten()
        .filter_map(|s| s.as_str().map(str::to_owned))
        .collect()
}

/// What the agent's container ran with, as podman reports it and as the kernel has it, against
/// the manifest: image, command, capabilities, read-only root, uid, no_new_privs, seccomp,
/// network, mounts; and the API server it used.
fn assert_ran_as_the_manifest_says(node: &Node, ds: &DaemonSet, argv: &[String], rt: &str) {
    let c = container(ds, AGENT);
    let name = node.name(AGENT);
    let inspect = node.podman.inspect(&name);
    let set = |v: &Value| -> BTreeSet<String> { strings(v).into_iter().collect() };

    // The manifest's short name as the kubelet's runtimes complete it (docker.io/library/).
    let image = c.image.as_deref().expect("image");
    assert_eq!(image, deployed_image(), "the manifest's image");
    assert_eq!(
        inspect["ImageName"],
        format!("docker.io/library/{image}"),
        "{rt}: image"
    );
    let loaded = node
        .podman
        .ok(&["image", "inspect", "--format", "{{.Id}}", image]);
    assert_eq!(
        inspect["Image"].as_str(),
        Some(loaded.trim()),
        "{rt}: the container's image is not the one loaded"
    );
    let mut ran = vec![inspect["Path"].as_str().unwrap_or_default().to_owned()];
    ran.extend(strings(&inspect["Args"]));
    assert_eq!(ran, argv, "{rt}: command");

    let sc = c.security_context.as_ref().expect("securityContext");
    let added: BTreeSet<String> = sc
        .capabilities
        .as_ref()
        .and_then(|c| c.add.clone())
        .unwrap_or_default()
        .into_iter()
        .collect();
    let cap_names: BTreeSet<String> = added.iter().map(|c| format!("CAP_{c}")).collect();
    assert_eq!(
        set(&inspect["EffectiveCaps"]),
        cap_names,
        "{rt}: effective caps"
    );
    assert_eq!(
        set(&inspect["HostConfig"]["CapAdd"]),
        cap_names,
        "{rt}: CapAdd"
    );
    assert_eq!(
        inspect["HostConfig"]["ReadonlyRootfs"], true,
        "{rt}: read-only root"
    );
    assert_eq!(
        inspect["HostConfig"]["Privileged"], false,
        "{rt}: privileged"
    );
    assert_eq!(inspect["Config"]["User"], "0", "{rt}: runAsUser");
    let security_opt = set(&inspect["HostConfig"]["SecurityOpt"]);
    assert!(
        security_opt.contains("no-new-privileges"),
        "{rt}: SecurityOpt {security_opt:?}"
    );
    assert!(
        security_opt.contains(&format!("seccomp={}", node.seccomp.display())),
        "{rt}: seccomp profile: {security_opt:?}"
    );
    assert_eq!(
        inspect["HostConfig"]["NetworkMode"],
        format!("ns:{}", node.topo.node().path().display()),
        "{rt}: hostNetwork"
    );

    // Mounts: each volumeMount at its path, from the test's side of its volume, read-only and
    // propagated as the manifest says; plus the service account the kubelet adds.
    let mounts: BTreeSet<(String, String, bool, String)> = inspect["Mounts"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|m| {
            (
                m["Destination"].as_str().unwrap_or_default().to_owned(),
                m["Source"].as_str().unwrap_or_default().to_owned(),
                m["RW"] == true,
                m["Propagation"].as_str().unwrap_or_default().to_owned(),
            )
        })
        .collect();
    let volumes = ds
        .spec
        .template
        .spec
        .as_ref()
        .expect("pod")
        .volumes
        .as_deref();
    let volumes = volumes.unwrap_or_default();
    let mut want: BTreeSet<(String, String, bool, String)> = c
        .volume_mounts
        .iter()
        .flatten()
        .map(|m| {
            let v = volumes.iter().find(|v| v.name == m.name).expect("volume");
            (
                m.mount_path.clone(),
                node.host.source(v).to_string_lossy().into_owned(),
                m.read_only != Some(true),
                propagation(m.mount_propagation.as_deref()).to_owned(),
            )
        })
        .collect();
    want.insert((
        SERVICE_ACCOUNT_MOUNT.to_owned(),
        node.service_account().to_string_lossy().into_owned(),
        false,
        "rprivate".to_owned(),
    ));
    assert_eq!(mounts, want, "{rt}: mounts");

    // The kernel's view of the container's process.
    let pid = inspect["State"]["Pid"].as_i64().expect("container pid");
    let status = proc_status(pid);
    let mask: u64 = added
        .iter()
        .fold(0, |m, c| m | 1 << proxy_testenv::capability_bit(c));
    let want_mask = format!("{mask:016x}");
    for key in ["CapEff", "CapPrm", "CapBnd"] {
        assert_eq!(status.get(key), Some(&want_mask), "{rt}: {key}: {status:?}");
    }
    let field = |k: &str| status.get(k).map(String::as_str);
    assert_eq!(field("NoNewPrivs"), Some("1"), "{rt}: no_new_privs");
    assert_eq!(field("Seccomp"), Some("2"), "{rt}: seccomp filter");
    assert!(
        field("Uid").is_some_and(|u| u.split_whitespace().all(|f| f == "0")),
        "{rt}: uid {status:?}"
    );

    let log = node.podman.logs(&name);
    assert!(
        log.contains(&format!(
            "api_server={}",
            node.api.url().trim_end_matches('/')
        )),
        "{rt}: the agent did not use the kubeconfig's server:\n{}",
        tail(&log, 30)
    );
}

/// `dump services` in a second container like the agent's (what `kubectl exec ... dump` reads):
/// the pinned maps through bpf(2), allowed under RuntimeDefault as containerd has it, refused
/// under podman's (CRI-O's) own default profile.
fn assert_bpf_allowed_only_under_runtime_default(
    node: &Node,
    ds: &DaemonSet,
    argv: &[String],
    rt: &str,
) {
    let dump_argv = [argv[0].clone(), "dump".to_owned(), "services".to_owned()];
    let dump = |seccomp: Option<&Path>, name: &str| {
        let flags = node.agent_flags(ds, seccomp);
        node.podman.run(&node.name(name), &flags, &dump_argv, false)
    };
    let out = dump(Some(&node.seccomp), "dump");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && text.contains(&VIP.to_string()),
        "{rt}: dump services under RuntimeDefault ({}): {text}{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    let out = dump(None, "dump-podman-default");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && err.contains("Operation not permitted"),
        "{rt}: podman's default seccomp profile allowed bpf(2) without CAP_SYS_ADMIN ({}): {err}",
        out.status
    );
}

#[test]
fn the_image_runs_the_daemonset_with_crun_and_runc() {
    require_privileged!();
    let started = Instant::now();
    let dir = TempDir::new("kpe-image").expect("temp dir");
    let archive = dir.join("kube-proxy-ebpf-image.tar");
    let built = proxy_image::build(
        &proxy_image::ImageSource {
            binary: PathBuf::from(BIN),
            revision: None,
            epoch: 0,
        },
        &archive,
    )
    .unwrap_or_else(|e| panic!("building the image: {e:#}"));
    eprintln!(
        "image: {} built from the debug agent in {:.1} s: {} files, {:.1} MB",
        built.reference,
        started.elapsed().as_secs_f64(),
        built.files.len(),
        built.archive_size as f64 / 1e6
    );
    for runtime in [Runtime::Crun, Runtime::Runc] {
        run_the_daemonset(runtime, &archive);
    }
}
