//! What goes into the image, read from the build machine: the agent binary without its debug
//! info; the netfilter tools it runs to remove kube-proxy's leftover rules
//! (`--remove-kube-proxy-rules`), as kube-proxy's own image (registry.k8s.io's
//! distroless-iptables) ships them: iptables with its nft and legacy backends and their
//! extensions, and nft ([`NETFILTER_TOOLS`], [`netfilter_tools`]); the shared libraries `ldd`
//! lists for all of them and the dynamic loader; netbase's /etc/protocols, /etc/services and
//! /etc/ethertypes, which the tools' name lookups read; and the directories the DaemonSet mounts
//! onto. No shell, no package manager, no /etc/passwd.

use std::{
    collections::{BTreeMap, BTreeSet},
    path::{Path, PathBuf},
    process::Command,
};

use anyhow::{Context as _, Result, bail};

use crate::oci::Rootfs;

/// Where the agent lives in the image (the manifests' `command` and the entrypoint).
pub const AGENT_PATH: &str = "/usr/local/bin/kube-proxy-ebpf";

/// Mount points: the kernel filesystems a runtime mounts, and deploy/daemonset.yaml's
/// volumeMounts (the bpffs step's /sys/fs/bpf; the agent's bpffs, cgroup v2 root, ConfigMap and
/// kubeconfig). Present in the image so a read-only root needs no directory created in it.
pub const MOUNT_POINTS: &[&str] = &[
    "/dev",
    "/etc/kube-proxy-ebpf",
    "/proc",
    "/run/kube-proxy-ebpf/bpffs",
    "/run/kube-proxy-ebpf/cgroupv2",
    "/sys/fs/bpf",
    "/var/lib/kube-proxy",
];

/// Where the netfilter tools live in the image (on the image's PATH, `oci::IMAGE_PATH_ENV`).
pub const TOOLS_DIR: &str = "/usr/sbin";

/// A netfilter tool the image carries: a binary of the build machine (symlinks resolved), copied
/// to [`TOOLS_DIR`] under its own file name, and the names the agent calls it by, as symlinks to
/// it (the xtables multi-binaries dispatch on argv[0]'s basename).
#[derive(Clone, Copy, Debug)]
pub struct Tool {
    pub binary: &'static str,
    /// The Debian package that installs it.
    pub package: &'static str,
    pub names: &'static [&'static str],
}

/// iptables' two backends and nft, with every name the agent runs. The unsuffixed names
/// (`iptables-save`, ...) are the nft backend, whatever the build machine's alternatives say:
/// the backend current kube-proxy and Debian default to; the legacy one is named explicitly.
pub const NETFILTER_TOOLS: &[Tool] = &[
    Tool {
        binary: "/usr/sbin/xtables-nft-multi",
        package: "iptables",
        names: &[
            "iptables",
            "iptables-save",
            "iptables-restore",
            "ip6tables",
            "ip6tables-save",
            "ip6tables-restore",
            "iptables-nft",
            "iptables-nft-save",
            "iptables-nft-restore",
            "ip6tables-nft",
            "ip6tables-nft-save",
            "ip6tables-nft-restore",
        ],
    },
    Tool {
        binary: "/usr/sbin/xtables-legacy-multi",
        package: "iptables",
        names: &[
            "iptables-legacy",
            "iptables-legacy-save",
            "iptables-legacy-restore",
            "ip6tables-legacy",
            "ip6tables-legacy-save",
            "ip6tables-legacy-restore",
        ],
    },
    Tool {
        binary: "/usr/sbin/nft",
        package: "nftables",
        names: &[],
    },
];

/// Files the tools read at run time that a scratch image lacks (Debian package `netbase`): the
/// protocol and service names iptables and nft print and parse (`-p tcp`, `meta l4proto tcp`),
/// and the Ethernet types (ebtables, nft's `ether type`). Without them glibc's lookups fail and
/// the tools fall back to numbers or their built-in tables.
pub const NETBASE_FILES: &[&str] = &["/etc/ethertypes", "/etc/protocols", "/etc/services"];

/// The netfilter tools as read from the build machine.
#[derive(Clone, Debug, Default)]
pub struct NetfilterTools {
    /// (path in the image, contents, mode): the binaries, the xtables extensions, netbase's files.
    pub files: Vec<(String, Vec<u8>, u32)>,
    /// (path in the image, target): the tools' names, and the extensions' aliases.
    pub symlinks: Vec<(String, String)>,
    /// The binaries and extensions, as on the build machine: `ldd` them for their libraries.
    pub executables: Vec<PathBuf>,
}

/// Reads [`NETFILTER_TOOLS`], iptables' extensions (the directory libxtables loads them from)
/// and [`NETBASE_FILES`] from this machine. A tool, the extensions or a file missing is an error
/// naming the Debian package to install, not a smaller image.
pub fn netfilter_tools() -> Result<NetfilterTools> {
    let mut tools = NetfilterTools::default();
    for tool in NETFILTER_TOOLS {
        let (real, data) = read_tool(Path::new(tool.binary), tool.package)?;
        let file_name = Path::new(tool.binary)
            .file_name()
            .expect("a tool path has a file name")
            .to_string_lossy()
            .into_owned();
        tools
            .files
            .push((format!("{TOOLS_DIR}/{file_name}"), data, 0o755));
        tools.executables.push(real);
        for name in tool.names {
            tools
                .symlinks
                .push((format!("{TOOLS_DIR}/{name}"), file_name.clone()));
        }
    }
    let dir = xtables_extension_dir(Path::new(NETFILTER_TOOLS[0].binary))?;
    let image_dir = dir.to_string_lossy().into_owned();
    let mut entries: Vec<_> = std::fs::read_dir(&dir)
        .with_context(|| format!("reading {}", dir.display()))?
        .collect::<std::io::Result<_>>()
        .with_context(|| format!("reading {}", dir.display()))?;
    entries.sort_by_key(std::fs::DirEntry::file_name);
    for entry in entries {
        let name = entry.file_name().to_string_lossy().into_owned();
        if !name.ends_with(".so") {
            continue;
        }
        let path = entry.path();
        let image_path = format!("{image_dir}/{name}");
        // An alias in the same directory (libxt_state.so -> libxt_conntrack.so) stays one.
        if let Ok(target) = std::fs::read_link(&path)
            && target.components().count() == 1
        {
            tools
                .symlinks
                .push((image_path, target.to_string_lossy().into_owned()));
            continue;
        }
        let data = std::fs::read(&path).with_context(|| format!("reading {}", path.display()))?;
        tools.files.push((image_path, data, 0o644));
        tools.executables.push(path);
    }
    for file in NETBASE_FILES {
        let data = std::fs::read(file).with_context(|| {
            format!(
                "{file} (read by iptables and nft in the image) is missing on this machine: \
                 apt-get install netbase"
            )
        })?;
        tools.files.push(((*file).to_owned(), data, 0o644));
    }
    Ok(tools)
}

/// `path` with its symlinks resolved, and its contents; missing is an error naming `package`.
pub fn read_tool(path: &Path, package: &str) -> Result<(PathBuf, Vec<u8>)> {
    let missing = || {
        format!(
            "{} (a netfilter tool the image carries for --remove-kube-proxy-rules) is missing on \
             this machine: apt-get install {package} (or `sudo cargo xtask setup`)",
            path.display()
        )
    };
    let real = std::fs::canonicalize(path).with_context(missing)?;
    let data = std::fs::read(&real).with_context(missing)?;
    Ok((real, data))
}

/// The directory libxtables loads iptables' extensions (`libxt_*.so`) from: `xtables` beside
/// libxtables itself (Debian's `/usr/lib/<multiarch>/xtables`), checked against the path
/// compiled into the library. The image keeps it at the same path.
fn xtables_extension_dir(xtables_binary: &Path) -> Result<PathBuf> {
    let libxtables = library_paths(xtables_binary)?
        .into_iter()
        .find(|p| {
            p.file_name()
                .is_some_and(|n| n.to_string_lossy().starts_with("libxtables.so"))
        })
        .with_context(|| format!("ldd {}: no libxtables", xtables_binary.display()))?;
    let real = std::fs::canonicalize(&libxtables)
        .with_context(|| format!("resolving {}", libxtables.display()))?;
    let dir = real
        .parent()
        .context("libxtables has no directory")?
        .join("xtables");
    let compiled_in = std::fs::read(&real)
        .with_context(|| format!("reading {}", real.display()))?
        .windows(dir.as_os_str().len() + 1)
        .any(|w| w[..w.len() - 1] == *dir.as_os_str().as_encoded_bytes() && w[w.len() - 1] == 0);
    if !compiled_in || !dir.is_dir() {
        bail!(
            "iptables' extensions: {} is not the directory {} loads them from (or is missing): \
             reinstall iptables",
            dir.display(),
            real.display()
        );
    }
    Ok(dir)
}

/// The root filesystem: the agent (already stripped), the netfilter `tools` at [`TOOLS_DIR`]
/// with their names as symlinks, and the `libraries` (the agent's and the tools', merged) at the
/// paths `ldd` named, plus [`MOUNT_POINTS`] and a world-writable /tmp.
pub fn agent_rootfs(
    agent: Vec<u8>,
    libraries: Vec<(String, Vec<u8>)>,
    tools: NetfilterTools,
) -> Rootfs {
    let mut fs = Rootfs::default();
    fs.file(AGENT_PATH, 0o755, agent);
    for (path, data) in libraries {
        fs.file(&path, 0o755, data);
    }
    for (path, data, mode) in tools.files {
        fs.file(&path, mode, data);
    }
    for (path, target) in tools.symlinks {
        fs.symlink(&path, &target);
    }
    for dir in MOUNT_POINTS {
        fs.dir(dir, 0o755);
    }
    fs.dir("/tmp", 0o1777);
    fs
}

/// `binary` without debug sections (`objcopy --strip-debug`; symbols stay, for backtraces).
/// The eBPF object embedded in the agent is data, not debug info, and stays.
pub fn strip_debug(binary: &Path, out: &Path) -> Result<()> {
    let status = Command::new("objcopy")
        .arg("--strip-debug")
        .arg(binary)
        .arg(out)
        .status()
        .context("running objcopy (binutils)")?;
    if !status.success() {
        bail!(
            "objcopy --strip-debug {} failed ({status})",
            binary.display()
        );
    }
    Ok(())
}

/// The shared libraries and the loader `binary` needs, as `ldd` resolves them here, with their
/// contents (symlinks followed: the image holds plain files at the listed paths).
pub fn shared_libraries(binary: &Path) -> Result<Vec<(String, Vec<u8>)>> {
    shared_libraries_of(&[binary])
}

/// [`shared_libraries`] of every one of `binaries`, merged: each library once.
pub fn shared_libraries_of(binaries: &[&Path]) -> Result<Vec<(String, Vec<u8>)>> {
    let mut paths = BTreeSet::new();
    for binary in binaries {
        paths.extend(library_paths(binary)?);
    }
    let mut libs = BTreeMap::new();
    for path in paths {
        let data = std::fs::read(&path).with_context(|| format!("reading {}", path.display()))?;
        libs.insert(path.to_string_lossy().into_owned(), data);
    }
    Ok(libs.into_iter().collect())
}

/// The paths `ldd` lists for `binary` (an executable or a shared object).
pub fn library_paths(binary: &Path) -> Result<Vec<PathBuf>> {
    let out = Command::new("ldd")
        .arg(binary)
        .output()
        .context("running ldd")?;
    let text = String::from_utf8_lossy(&out.stdout);
    // ldd exits 1 for a static binary ("not a dynamic executable"): nothing to copy.
    if !out.status.success() && !text.contains("not a dynamic executable") {
        bail!(
            "ldd {} failed ({}): {}",
            binary.display(),
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
    }
    parse_ldd(&text).with_context(|| format!("ldd {}", binary.display()))
}

/// The absolute paths in `ldd` output: `name => /path (addr)` and the loader's `/path (addr)`;
/// the vDSO has no file. A library ldd could not find is an error.
pub fn parse_ldd(text: &str) -> Result<Vec<PathBuf>> {
    let mut paths = Vec::new();
    for line in text.lines().map(str::trim) {
        if line.contains("=> not found") {
            bail!("ldd: a library is missing on this machine: {line}");
        }
        let target = line.split_once("=>").map_or(line, |(_, t)| t).trim();
        if let Some(path) = target.split_whitespace().next()
            && path.starts_with('/')
        {
            paths.push(PathBuf::from(path));
        }
    }
    paths.sort();
    paths.dedup();
    Ok(paths)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ldd_output_gives_the_libraries_and_the_loader() {
        let text = "\tlinux-vdso.so.1 (0x00007ffd)\n\
                    \tlibgcc_s.so.1 => /lib/x86_64-linux-gnu/libgcc_s.so.1 (0x00007f8c)\n\
                    \tlibc.so.6 => /lib/x86_64-linux-gnu/libc.so.6 (0x00007f8c)\n\
                    \t/lib64/ld-linux-x86-64.so.2 (0x00007f8c)\n";
        let got = parse_ldd(text).unwrap();
        let got: Vec<&str> = got.iter().map(|p| p.to_str().unwrap()).collect();
        assert_eq!(
            got,
            [
                "/lib/x86_64-linux-gnu/libc.so.6",
                "/lib/x86_64-linux-gnu/libgcc_s.so.1",
                "/lib64/ld-linux-x86-64.so.2"
            ]
        );
        assert!(parse_ldd("\tstatically linked\n").unwrap().is_empty());
        assert!(parse_ldd("\tlibfoo.so => not found\n").is_err());
    }

    #[test]
    fn the_rootfs_has_the_agent_its_libraries_and_the_mount_points_only() {
        let tools = NetfilterTools {
            files: vec![("/usr/sbin/nft".into(), vec![3], 0o755)],
            symlinks: vec![(
                "/usr/sbin/iptables-nft-save".into(),
                "xtables-nft-multi".into(),
            )],
            executables: vec![],
        };
        let fs = agent_rootfs(vec![1], vec![("/lib64/ld.so".into(), vec![2])], tools);
        let files: Vec<&str> = fs.paths().collect();
        for want in [
            "usr/local/bin/kube-proxy-ebpf",
            "lib64/ld.so",
            "run/kube-proxy-ebpf/cgroupv2",
            "sys/fs/bpf",
            "tmp",
            "usr/sbin/nft",
            "usr/sbin/iptables-nft-save",
        ] {
            assert!(files.contains(&want), "{want}: {files:?}");
        }
        assert!(
            !files
                .iter()
                .any(|f| f.starts_with("bin") || f.contains("passwd"))
        );
        assert_eq!(
            fs.symlinks().collect::<Vec<_>>(),
            [("usr/sbin/iptables-nft-save", "xtables-nft-multi")]
        );
    }

    #[test]
    fn every_name_the_agent_runs_is_a_tool_and_each_name_is_given_once() {
        let names: Vec<&str> = NETFILTER_TOOLS
            .iter()
            .flat_map(|t| t.names.iter().copied())
            .collect();
        let unique: BTreeSet<&str> = names.iter().copied().collect();
        assert_eq!(unique.len(), names.len(), "{names:?}");
        for family in ["iptables", "ip6tables"] {
            for backend in ["", "-nft", "-legacy"] {
                for verb in ["", "-save", "-restore"] {
                    let name = format!("{family}{backend}{verb}");
                    assert!(unique.contains(name.as_str()), "{name} missing");
                }
            }
        }
        // nft is the binary itself; the unsuffixed iptables names are the nft backend.
        assert!(NETFILTER_TOOLS.iter().any(|t| t.binary.ends_with("/nft")));
        let nft_multi = NETFILTER_TOOLS
            .iter()
            .find(|t| t.binary.ends_with("xtables-nft-multi"))
            .unwrap();
        assert!(nft_multi.names.contains(&"iptables-save"));
    }

    #[test]
    fn a_missing_tool_is_an_error_naming_its_package() {
        let err = read_tool(Path::new("/nonexistent/sbin/nft"), "nftables").unwrap_err();
        let text = format!("{err:#}");
        assert!(
            text.contains("/nonexistent/sbin/nft") && text.contains("apt-get install nftables"),
            "{text}"
        );
    }

    /// On a build machine with the tools (Debian's iptables and nftables): every binary, name
    /// and extension is there, and the libraries the tools need resolve.
    #[test]
    fn this_machine_s_tools_are_read_with_their_extensions() {
        if !Path::new("/usr/sbin/xtables-nft-multi").exists()
            || !Path::new("/usr/sbin/nft").exists()
        {
            eprintln!("skipped: iptables or nftables not installed here");
            return;
        }
        let tools = netfilter_tools().unwrap();
        let files: Vec<&str> = tools.files.iter().map(|(p, ..)| p.as_str()).collect();
        for want in [
            "/usr/sbin/xtables-nft-multi",
            "/usr/sbin/xtables-legacy-multi",
            "/usr/sbin/nft",
            "/etc/protocols",
        ] {
            assert!(files.contains(&want), "{want}: {files:?}");
        }
        assert!(
            files
                .iter()
                .any(|f| f.ends_with("/xtables/libxt_comment.so")),
            "{files:?}"
        );
        let exes: Vec<&Path> = tools.executables.iter().map(PathBuf::as_path).collect();
        let libs = shared_libraries_of(&exes).unwrap();
        let lib_paths: Vec<&str> = libs.iter().map(|(p, _)| p.as_str()).collect();
        assert!(
            lib_paths.iter().any(|p| p.contains("libnftables.so"))
                && lib_paths.iter().any(|p| p.contains("libxtables.so")),
            "{lib_paths:?}"
        );
        let unique: BTreeSet<&str> = lib_paths.iter().copied().collect();
        assert_eq!(unique.len(), lib_paths.len());
    }
}
