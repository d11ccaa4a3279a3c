//! `kube-proxy-ebpf`: wiring only — parse flags, set up logging, dispatch.
#![forbid(unsafe_code)]

use clap::{CommandFactory as _, FromArgMatches as _};
use kube_proxy_ebpf::{
    agent,
    cli::{Cli, Command, cleanup, config, dump},
    dataplane::bpffs::PinLayout,
};
use tracing_subscriber::EnvFilter;

fn main() -> anyhow::Result<()> {
    // ArgMatches, not just the parsed struct: `--config` needs to know which flags were given.
    let matches = Cli::command().get_matches();
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
    }
}
