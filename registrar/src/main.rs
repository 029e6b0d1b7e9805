use clap::Parser;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let config = aether_registrar::Config::parse();
    aether_common::telemetry::init_logging(config.log_format);
    let shutdown = aether_common::shutdown::on_signal()?;
    let running = aether_registrar::start(config, shutdown).await?;
    running.wait().await;
    Ok(())
}
