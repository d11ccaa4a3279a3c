//! `cargo xtask prev-release [--commit C]`: the upgrade test's fixture, the previous release's
//! agent (`proxy_testenv::prev_release`), built once per commit under target/prev-release/.
//! `cargo xtask test` runs it as its own step before the privileged tests, so its build time
//! shows in the summary; tests/upgrade.rs then finds it cached.

use anyhow::Result;

use crate::util::workspace_root;

pub fn run(commit: Option<&str>) -> Result<std::path::PathBuf> {
    let commit = commit.unwrap_or(proxy_testenv::prev_release::PREVIOUS_RELEASE);
    let built = proxy_testenv::prev_release::agent_of(&workspace_root(), commit)?;
    match built.built_in {
        Some(took) => println!(
            "previous release {} built in {:.1} s: {}",
            built.commit,
            took.as_secs_f64(),
            built.bin.display()
        ),
        None => println!(
            "previous release {} (cached): {}",
            built.commit,
            built.bin.display()
        ),
    }
    Ok(built.bin)
}
