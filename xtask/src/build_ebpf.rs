//! `cargo xtask build-ebpf`: a thin alias of the one build path (proxy-userspace's build.rs)
//! that also says where the object is and what it holds.

use std::{path::PathBuf, time::SystemTime};

use anyhow::{Context as _, Result, bail};
use aya_obj::generated::bpf_map_type;

use crate::util::{cargo, sh, target_dir};

/// Builds proxy-userspace (and so the eBPF object), prints the object's path and contents.
/// Returns the path of the `kube-proxy-ebpf` binary.
pub fn run_build() -> Result<PathBuf> {
    sh(cargo().args(["build", "-p", "proxy-userspace"]))?;
    let target = target_dir()?;
    let bin = target.join("debug/kube-proxy-ebpf");
    if !bin.exists() {
        bail!("built proxy-userspace but {} is missing", bin.display());
    }
    Ok(bin)
}

pub fn run() -> Result<PathBuf> {
    let bin = run_build()?;
    let object = find_object()?;
    println!("eBPF object: {}", object.display());
    describe(&std::fs::read(&object).with_context(|| format!("reading {}", object.display()))?)?;
    println!("agent binary: {}", bin.display());
    Ok(bin)
}

/// The newest `target/debug/build/proxy-userspace-*/out/proxy-ebpf`.
pub fn find_object() -> Result<PathBuf> {
    let build = target_dir()?.join("debug/build");
    let mut best: Option<(SystemTime, PathBuf)> = None;
    for entry in
        std::fs::read_dir(&build).with_context(|| format!("reading {}", build.display()))?
    {
        let entry = entry?;
        if !entry
            .file_name()
            .to_string_lossy()
            .starts_with("proxy-userspace-")
        {
            continue;
        }
        let candidate = entry.path().join("out/proxy-ebpf");
        let Ok(meta) = candidate.metadata() else {
            continue;
        };
        if meta.len() == 0 {
            continue; // AYA_BUILD_SKIP placeholder
        }
        let modified = meta.modified()?;
        if best.as_ref().is_none_or(|(t, _)| modified > *t) {
            best = Some((modified, candidate));
        }
    }
    best.map(|(_, p)| p).with_context(|| {
        format!(
            "no proxy-ebpf object under {}/proxy-userspace-*/out",
            build.display()
        )
    })
}

/// Prints the programs and maps of an eBPF ELF object.
pub fn describe(bytes: &[u8]) -> Result<()> {
    let obj = aya_obj::Object::parse(bytes).context("parsing the eBPF object")?;
    let mut programs: Vec<_> = obj.programs.iter().collect();
    programs.sort_by(|a, b| a.0.cmp(b.0));
    println!("programs ({}):", programs.len());
    println!("  {:<28} section", "name");
    for (name, program) in programs {
        println!("  {name:<28} {:?}", program.section);
    }
    let mut maps: Vec<_> = obj.maps.iter().collect();
    maps.sort_by(|a, b| a.0.cmp(b.0));
    println!("maps ({}):", maps.len());
    println!(
        "  {:<28} {:<28} {:>5} {:>6} {:>11}",
        "name", "type", "key", "value", "max_entries"
    );
    for (name, map) in maps {
        let kind = bpf_map_type::try_from(map.map_type())
            .map(|t| {
                format!("{t:?}")
                    .trim_start_matches("BPF_MAP_TYPE_")
                    .to_owned()
            })
            .unwrap_or_else(|_| format!("type {}", map.map_type()));
        println!(
            "  {name:<28} {kind:<28} {:>5} {:>6} {:>11}",
            map.key_size(),
            map.value_size(),
            map.max_entries()
        );
    }
    Ok(())
}
