//! What goes into the image, read from the build machine: the agent binary without its debug
//! info, the shared libraries `ldd` lists for it and the dynamic loader (no shell, no package
//! manager, no /etc/passwd), and the directories the DaemonSet mounts onto.

use std::{
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

/// The root filesystem: the agent (already stripped) and its libraries at the paths `ldd`
/// named, plus [`MOUNT_POINTS`] and a world-writable /tmp.
pub fn agent_rootfs(agent: Vec<u8>, libraries: Vec<(String, Vec<u8>)>) -> Rootfs {
    let mut fs = Rootfs::default();
    fs.file(AGENT_PATH, 0o755, agent);
    for (path, data) in libraries {
        fs.file(&path, 0o755, data);
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
    let mut libs = Vec::new();
    for path in parse_ldd(&text)? {
        let data = std::fs::read(&path).with_context(|| format!("reading {}", path.display()))?;
        libs.push((path.to_string_lossy().into_owned(), data));
    }
    Ok(libs)
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
        let fs = agent_rootfs(vec![1], vec![("/lib64/ld.so".into(), vec![2])]);
        let files: Vec<&str> = fs.paths().collect();
        for want in [
            "usr/local/bin/kube-proxy-ebpf",
            "lib64/ld.so",
            "run/kube-proxy-ebpf/cgroupv2",
            "sys/fs/bpf",
            "tmp",
        ] {
            assert!(files.contains(&want), "{want}: {files:?}");
        }
        assert!(
            !files
                .iter()
                .any(|f| f.starts_with("bin") || f.contains("passwd"))
        );
    }
}
