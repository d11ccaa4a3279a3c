//! `kube-proxy-ebpf`: wiring only — the allocator, parse flags, set up logging, dispatch.
#![deny(unsafe_code)]

use clap::{CommandFactory as _, FromArgMatches as _};
use kube_proxy_ebpf::{
    agent,
    cli::{Cli, Command, cleanup, config, dump, mount_bpffs},
    dataplane::bpffs::PinLayout,
};
use tracing_subscriber::EnvFilter;

/// jemalloc, not glibc's malloc: at 50,000 Services the agent holds ~1.5 M small allocations
/// (names, objects, frontends), and glibc's 8-byte chunk headers and per-thread arenas (the flow
/// walk's thread kept ~16 MB of freed vectors) came to ~30 MiB of RSS over the heap in use.
#[global_allocator]
static ALLOC: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

/// jemalloc's options, read at its first allocation: one arena (two busy threads; an arena per
/// thread kept each one's freed pages apart) and freed pages given back to the kernel at once
/// (no decay: the agent is idle between syncs, so delayed purging would leave a full sync's
/// garbage resident, and there is no background thread to purge it).
#[allow(unsafe_code)]
// SAFETY: jemalloc reads this NUL-terminated string once, as `const char *malloc_conf`; it is
// never written.
#[unsafe(export_name = "_rjem_malloc_conf")]
static MALLOC_CONF: &[u8; 44] = b"narenas:1,dirty_decay_ms:0,muzzy_decay_ms:0\0";

fn main() -> anyhow::Result<()> {
    // ArgMatches, not just the parsed struct: `--config` needs to know which flags were given.
    // kube-proxy's command line runs as it is: no subcommand means `run`.
    let argv =
        kube_proxy_ebpf::cli::kube_proxy::with_default_subcommand(std::env::args_os().collect());
    let matches = Cli::command().get_matches_from(argv);
    let cli = Cli::from_arg_matches(&matches).unwrap_or_else(|e| e.exit());
    let rust_log = std::env::var(EnvFilter::DEFAULT_ENV).ok();
    tracing_subscriber::fmt()
        .with_env_filter(EnvFilter::new(cli.log_filter(rust_log.as_deref())))
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
    match cli.command {
        Command::Run(mut args) => {
            let explicit = matches
                .subcommand_matches("run")
                .map(config::explicit_args)
                .unwrap_or_default();
            config::resolve(&mut args, &explicit)?;
            // One thread is plenty: the work is a few syscalls per change.
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()?;
            rt.block_on(agent::run(args))
        }
        Command::Dump(args) => {
            print!(
                "{}",
                dump::dump(&PinLayout::new(&args.pins.pin_dir), args.what)?
            );
            Ok(())
        }
        Command::Cleanup(args) => cleanup::cleanup(&PinLayout::new(&args.pin_dir)),
        Command::MountBpffs(args) => {
            match mount_bpffs::mount_bpffs(&args.dir)? {
                mount_bpffs::Outcome::AlreadyMounted => {
                    println!("{} is a bpffs already", args.dir.display());
                }
                mount_bpffs::Outcome::Mounted => {
                    println!("mounted a bpffs at {}", args.dir.display());
                }
            }
            Ok(())
        }
    }
}
