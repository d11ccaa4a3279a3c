use anyhow::{Context as _, anyhow};
use aya_build::Toolchain;

/// Builds proxy-ebpf for the BPF target with the nightly toolchain (aya-build) and leaves the
/// object in OUT_DIR, where `src/dataplane/ebpf_object.rs` embeds it. This is the only eBPF build path.
fn main() -> anyhow::Result<()> {
    // AYA_BUILD_SKIP=1 skips the eBPF build (for host-only work on the pure modules); leave an
    // empty object so the crate still compiles. Loading it fails with a clear parse error.
    if std::env::var_os("AYA_BUILD_SKIP").is_some_and(|v| v == "1") {
        let out = std::path::PathBuf::from(std::env::var("OUT_DIR")?).join("proxy-ebpf");
        if !out.exists() {
            std::fs::write(&out, b"")?;
        }
    }
    let cargo_metadata::Metadata { packages, .. } = cargo_metadata::MetadataCommand::new()
        .no_deps()
        .exec()
        .context("MetadataCommand::exec")?;
    let ebpf_package = packages
        .into_iter()
        .find(|cargo_metadata::Package { name, .. }| name.as_str() == "proxy-ebpf")
        .ok_or_else(|| anyhow!("proxy-ebpf package not found"))?;
    let cargo_metadata::Package {
        name,
        manifest_path,
        ..
    } = ebpf_package;
    let root_dir = manifest_path
        .parent()
        .ok_or_else(|| anyhow!("no parent for {manifest_path}"))?
        .as_str();
    let ebpf_package = aya_build::Package {
        name: name.as_str(),
        root_dir,
        ..Default::default()
    };
    // aya-build watches the eBPF crate only; the object also compiles proxy-common (the ABI),
    // whose change must rebuild it too.
    let common_dir = std::path::Path::new(root_dir).join("../proxy-common");
    println!(
        "cargo:rerun-if-changed={}",
        common_dir.join("src").display()
    );
    println!(
        "cargo:rerun-if-changed={}",
        common_dir.join("Cargo.toml").display()
    );
    aya_build::build_ebpf([ebpf_package], Toolchain::default())
}
