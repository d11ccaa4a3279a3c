//! `cargo xtask image [--binary PATH] [--output FILE]`: the agent's OCI image as an image-layout
//! archive, built from this checkout without Docker and without pulling anything
//! (`proxy_image::build`). Load it with `podman load -i FILE`, `skopeo copy oci-archive:FILE ...`
//! or `ctr -n k8s.io images import FILE`.

use std::path::PathBuf;

use anyhow::{Result, bail};

use crate::util::{cargo, output, sh, target_dir, workspace_root};

#[derive(Debug, clap::Args)]
pub struct Args {
    /// An agent binary already built (e.g. target/debug/kube-proxy-ebpf) instead of a release
    /// build; its debug info is stripped either way.
    #[arg(long)]
    pub binary: Option<PathBuf>,
    /// Where to write the archive (default: <target dir>/kube-proxy-ebpf-image.tar).
    #[arg(long)]
    pub output: Option<PathBuf>,
}

pub fn run(args: &Args) -> Result<()> {
    let target = target_dir()?;
    let binary = match &args.binary {
        Some(b) => b.clone(),
        None => {
            sh(cargo().args([
                "build",
                "--release",
                "--locked",
                "-p",
                "proxy-userspace",
                "--bin",
                "kube-proxy-ebpf",
            ]))?;
            target.join("release/kube-proxy-ebpf")
        }
    };
    if !binary.is_file() {
        bail!("{}: no such binary", binary.display());
    }
    let archive = args
        .output
        .clone()
        .unwrap_or_else(|| target.join("kube-proxy-ebpf-image.tar"));
    let root = workspace_root();
    let root = root.to_string_lossy();
    // The commit, marked when the checkout has uncommitted changes (then it is not the source).
    let revision = output("git", &["-C", &root, "rev-parse", "HEAD"]).map(|rev| {
        let dirty =
            output("git", &["-C", &root, "status", "--porcelain"]).is_some_and(|s| !s.is_empty());
        if dirty { format!("{rev}-dirty") } else { rev }
    });
    let built = proxy_image::build(
        &proxy_image::ImageSource {
            binary,
            revision,
            epoch: proxy_image::source_date_epoch(),
        },
        &archive,
    )?;
    let path = built.archive.display();
    println!(
        "image {} ({}, {} files, layer {:.1} MB): {path} ({:.1} MB)\n  load: podman load -i \
         {path} | skopeo copy oci-archive:{path} ... | ctr -n k8s.io images import {path}",
        built.reference,
        built.written.manifest_digest,
        built.files.len(),
        built.written.layer_size as f64 / 1e6,
        built.archive_size as f64 / 1e6,
    );
    Ok(())
}
