use clap::Parser;

// mimalloc keeps RSS close to what is live: glibc's per-thread arenas held on to
// ~100 MiB freed by watcher snapshots in the 1,000-watcher benchmark.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let config = aether_registrar::Config::parse();
    let _traces = aether_common::telemetry::init(config.log_format, &config.telemetry, &aether_registrar::TELEMETRY)?;
    let shutdown = aether_common::shutdown::on_signal()?;
    let running = aether_registrar::start(config, shutdown).await?;
    running
        .wait()
        .await
        .map_err(|failure| anyhow::anyhow!("stopped because {failure}"))
}
