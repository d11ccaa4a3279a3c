//! `cargo xtask fuzz [--packets N] [--seed S]`: the packet fuzz of every tc program
//! (proxy-userspace/tests/fuzz_packets.rs) in a release build with many packets. The test target
//! prints the seed, packets/s and packets per verdict; a failure prints the case to reproduce
//! (`KPE_FUZZ_SEED=… KPE_FUZZ_PACKETS=…`). Needs root.

use std::time::{SystemTime, UNIX_EPOCH};

use anyhow::{Result, bail};

use crate::util::{cargo, is_root, sh};

#[derive(Debug, clap::Args)]
pub struct Args {
    /// Packets to generate and run (each through one tc entry).
    #[arg(long, default_value_t = 1_000_000)]
    packets: u64,
    /// Generator seed (decimal or 0x-hex); a new one from the clock when not given (printed).
    #[arg(long)]
    seed: Option<String>,
}

pub fn run(args: &Args) -> Result<()> {
    if !is_root() {
        bail!("cargo xtask fuzz needs root (BPF_PROG_TEST_RUN); run it with sudo");
    }
    let seed = match &args.seed {
        Some(s) => s.clone(),
        None => {
            let nanos = SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map_or(0, |d| d.as_nanos() as u64);
            format!("{nanos:#x}")
        }
    };
    eprintln!("fuzz: seed {seed}, {} packets", args.packets);
    sh(cargo()
        .args([
            "test",
            "--release",
            "-p",
            "proxy-userspace",
            "--test",
            "fuzz_packets",
            "--",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(proxy_testenv::PRIVILEGED_ENV, "1")
        .env("KPE_FUZZ_SEED", &seed)
        .env("KPE_FUZZ_PACKETS", args.packets.to_string()))
}
