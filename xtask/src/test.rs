//! `cargo xtask test`: every tier, in order, with a summary. Needs root.

use std::{process::Command, time::Instant};

use anyhow::{Context as _, Result, bail};

use crate::util::{cargo, is_root, sh, step_start, workspace_root};

/// Packages whose integration tests (`tests/*.rs`, one target each) run in the privileged step.
/// Every target is run there, found by listing the folder: a suite added later cannot be left
/// out of CI by a forgotten list entry (the unprivileged ones just run a second time, cheaply).
const PRIVILEGED_PACKAGES: &[&str] = &["proxy-testenv", "proxy-userspace"];

/// The integration test targets of `package`, sorted: the `.rs` files directly in its `tests/`
/// (sub-folders are shared harness modules, not targets).
fn test_targets(package: &str) -> Result<Vec<String>> {
    let dir = workspace_root().join(package).join("tests");
    let mut targets = Vec::new();
    for entry in std::fs::read_dir(&dir).with_context(|| format!("listing {}", dir.display()))? {
        let path = entry?.path();
        if path.is_file()
            && path.extension().is_some_and(|e| e == "rs")
            && let Some(stem) = path.file_stem().and_then(|s| s.to_str())
        {
            targets.push(stem.to_owned());
        }
    }
    targets.sort();
    Ok(targets)
}

struct Outcome {
    name: String,
    ok: bool,
    secs: f64,
    note: String,
}

pub fn run(no_setup: bool) -> Result<()> {
    if !is_root() {
        bail!("cargo xtask test needs root (eBPF load, network namespaces); run it with sudo");
    }
    let started = Instant::now();
    if !no_setup {
        crate::setup::run(false)?;
    }
    proxy_testenv::ensure_bpffs()?;

    let mut outcomes = Vec::new();
    let mut step = |name: &str, cmd: &mut Command| {
        let started = step_start(name);
        let result = sh(cmd);
        let secs = started.elapsed().as_secs_f64();
        if let Err(e) = &result {
            eprintln!("FAILED: {name}: {e:#}");
        }
        outcomes.push(Outcome {
            name: name.to_owned(),
            ok: result.is_ok(),
            secs,
            note: result.err().map(|e| format!("{e:#}")).unwrap_or_default(),
        });
    };

    // The repo's rustfmt.toml uses unstable options (group_imports, imports_granularity):
    // only nightly rustfmt applies them; stable warns and formats differently.
    step(
        "fmt",
        cargo().args(["+nightly", "fmt", "--all", "--", "--check"]),
    );
    // `--workspace` means all members, including proxy-ebpf (a no_std BPF crate): exclude it.
    step(
        "clippy (host crates)",
        cargo()
            .args([
                "clippy",
                "--workspace",
                "--exclude",
                "proxy-ebpf",
                "--all-targets",
                "--",
            ])
            .args(["-D", "warnings"]),
    );
    step(
        "clippy (eBPF crate)",
        cargo()
            .current_dir(workspace_root().join("proxy-ebpf"))
            .args([
                "+nightly",
                "clippy",
                "-p",
                "proxy-ebpf",
                "--target",
                "bpfel-unknown-none",
            ])
            .args(["-Z", "build-std=core", "--", "-D", "warnings"]),
    );
    // The privileged packages' integration targets all run in the privileged step below (the
    // BPF_PROG_TEST_RUN tables need only root, so here they would run twice): only their unit
    // and doc tests run here, and every test of the other packages.
    let mut others = cargo();
    others.args(["test", "--workspace", "--exclude", "proxy-ebpf"]);
    let mut units = cargo();
    units.arg("test");
    let mut docs = cargo();
    docs.arg("test");
    for package in PRIVILEGED_PACKAGES {
        others.args(["--exclude", package]);
        units.args(["-p", package]);
        docs.args(["-p", package]);
    }
    units.args(["--lib", "--bins"]);
    docs.arg("--doc");
    for cmd in [&mut others, &mut units, &mut docs] {
        cmd.env_remove(proxy_testenv::PRIVILEGED_ENV);
    }
    step("unprivileged tests", &mut others);
    step("unit tests (agent)", &mut units);
    step("doc tests (agent)", &mut docs);
    // The upgrade test's fixture (the previous release's agent), built here so its time shows;
    // a clone without that commit fails this step and the upgrade test with the same message.
    step(
        "previous release (fixture)",
        cargo().args(["xtask", "prev-release"]),
    );
    // One cargo invocation: `-p A -p B --test x --test y` picks each target from its package.
    let mut privileged: Vec<String> = Vec::new();
    let mut names: Vec<String> = Vec::new();
    for package in PRIVILEGED_PACKAGES {
        privileged.extend(["-p".to_owned(), (*package).to_owned()]);
        names.extend(test_targets(package)?);
    }
    eprintln!("privileged test targets: {}", names.join(" "));
    for target in names {
        privileged.extend(["--test".to_owned(), target]);
    }
    if !privileged.is_empty() {
        step(
            "privileged tests",
            cargo()
                .arg("test")
                // One failing test binary must not hide the others' results.
                .arg("--no-fail-fast")
                .args(&privileged)
                .args(["--", "--test-threads=1"])
                .env(proxy_testenv::PRIVILEGED_ENV, "1"),
        );
    }

    // The bench at tiny sizes (debug build, 1 s of load): only checks that it still works.
    step("bench (smoke)", cargo().args(["xtask", "bench", "--smoke"]));

    eprintln!("\nsummary:");
    for o in &outcomes {
        let verdict = if o.ok { "ok" } else { "FAILED" };
        eprintln!(
            "  {:<24} {verdict:<6} {:>6.1}s {}",
            o.name,
            o.secs,
            first_line(&o.note)
        );
    }
    let failed = outcomes.iter().filter(|o| !o.ok).count();
    println!(
        "xtask test: {} steps ok, {failed} steps failed in {:.0}s",
        outcomes.len() - failed,
        started.elapsed().as_secs_f64()
    );
    if failed > 0 {
        bail!("{failed} test steps failed");
    }
    Ok(())
}

fn first_line(s: &str) -> &str {
    s.lines().next().unwrap_or_default()
}
