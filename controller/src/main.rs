use clap::Parser;

use aether_controller::config::Config;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let config = Config::parse();
    aether_common::telemetry::init_logging(config.log_format);
    let shutdown = aether_common::shutdown::on_signal()?;
    let running = aether_controller::start(config, shutdown).await?;
    running.wait().await?;
    Ok(())
}
