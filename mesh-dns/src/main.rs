use clap::Parser;

use aether_mesh_dns::config::Config;

fn main() -> anyhow::Result<()> {
    let config = Config::parse();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(config.worker_count())
        .enable_all()
        .build()?;
    runtime.block_on(async {
        // In the runtime: the OTLP trace exporter's channel lives on it.
        let _traces =
            aether_common::telemetry::init(config.log_format, &config.telemetry, &aether_mesh_dns::app::TELEMETRY)?;
        let shutdown = aether_common::shutdown::on_signal()?;
        let running = aether_mesh_dns::app::start(config, shutdown).await?;
        running.wait().await?;
        Ok(())
    })
}
