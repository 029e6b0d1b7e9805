use clap::Parser;

use aether_controller::config::Config;

// Every review allocates its body, its parsed object and its answer: glibc's malloc was a
// quarter of the webhook's CPU under 200 concurrent reviews (benches/controller.rs).
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let config = Config::parse();
    let _traces = aether_common::telemetry::init(config.log_format, &config.telemetry, &aether_controller::TELEMETRY)?;
    let shutdown = aether_common::shutdown::on_signal()?;
    let running = aether_controller::start(config, shutdown).await?;
    running.wait().await?;
    Ok(())
}
