//! kube-proxy-ebpf's container image, built without Docker, a daemon or a registry: the agent
//! binary, the netfilter tools it runs to remove kube-proxy's rules (iptables, nft) and exactly
//! what they need at run time ([`rootfs`]), written as a reproducible OCI
//! image-layout archive ([`oci`], [`tar`]) that `podman load`, `skopeo copy oci-archive:...`
//! and `ctr import` accept. `cargo xtask image` and tests/image.rs call [`build`].
#![forbid(unsafe_code)]

pub mod oci;
pub mod rootfs;
pub mod tar;

use std::{
    fs::File,
    io::BufWriter,
    path::{Path, PathBuf},
};

use anyhow::{Context as _, Result};
pub use oci::{ImageMeta, Written};

/// The name deploy/daemonset.yaml runs (`image: kube-proxy-ebpf:latest`).
pub const IMAGE_NAME: &str = "kube-proxy-ebpf";
pub const IMAGE_TAG: &str = "latest";

/// What to build the image from.
#[derive(Clone, Debug)]
pub struct ImageSource {
    /// The agent binary (release or debug build; its debug info is stripped).
    pub binary: PathBuf,
    /// The commit it was built from (a label), if known.
    pub revision: Option<String>,
    /// Every timestamp in the archive: SOURCE_DATE_EPOCH, or 0.
    pub epoch: u64,
}

/// What [`build`] wrote.
#[derive(Clone, Debug)]
pub struct Built {
    pub archive: PathBuf,
    pub reference: String,
    pub written: Written,
    pub archive_size: u64,
    /// The files in the image (paths, sorted).
    pub files: Vec<String>,
}

/// The OCI architecture name of this machine (the binary is built for it).
pub fn host_architecture() -> &'static str {
    match std::env::consts::ARCH {
        "x86_64" => "amd64",
        "aarch64" => "arm64",
        "riscv64" => "riscv64",
        "s390x" => "s390x",
        "powerpc64" => "ppc64le",
        other => other,
    }
}

/// SOURCE_DATE_EPOCH if set and numeric, else 0.
pub fn source_date_epoch() -> u64 {
    std::env::var("SOURCE_DATE_EPOCH")
        .ok()
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0)
}

/// Builds the image of `source` and writes its archive to `archive` (through a temporary file
/// beside it, renamed at the end: no half-written archive is left under that name).
pub fn build(source: &ImageSource, archive: &Path) -> Result<Built> {
    let dir = archive.parent().unwrap_or(Path::new("."));
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let stripped = dir.join(format!(
        ".{}.stripped",
        archive.file_name().unwrap_or_default().to_string_lossy()
    ));
    rootfs::strip_debug(&source.binary, &stripped)?;
    let agent = std::fs::read(&stripped);
    let _ = std::fs::remove_file(&stripped);
    let agent = agent.context("reading the stripped agent")?;
    let tools = rootfs::netfilter_tools()?;
    // The agent's libraries and the tools' (their extensions' too), each once.
    let mut binaries = vec![source.binary.as_path()];
    binaries.extend(tools.executables.iter().map(PathBuf::as_path));
    let libraries = rootfs::shared_libraries_of(&binaries)?;
    let fs = rootfs::agent_rootfs(agent, libraries, tools);
    let meta = ImageMeta {
        name: IMAGE_NAME.to_owned(),
        tag: IMAGE_TAG.to_owned(),
        architecture: host_architecture().to_owned(),
        entrypoint: vec![rootfs::AGENT_PATH.to_owned()],
        version: env!("CARGO_PKG_VERSION").to_owned(),
        revision: source.revision.clone(),
        epoch: source.epoch,
    };
    let partial = archive.with_extension("partial");
    let file = File::create(&partial).with_context(|| format!("creating {}", partial.display()))?;
    let written = oci::write_archive(&fs, &meta, BufWriter::new(file))
        .with_context(|| format!("writing {}", partial.display()))?;
    std::fs::rename(&partial, archive)
        .with_context(|| format!("renaming {} to {}", partial.display(), archive.display()))?;
    Ok(Built {
        archive: archive.to_path_buf(),
        reference: meta.reference(),
        archive_size: std::fs::metadata(archive)?.len(),
        written,
        files: fs.paths().map(str::to_owned).collect(),
    })
}
