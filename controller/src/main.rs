use clap::Parser;

use aether_controller::config::Config;

// Every review allocates its body, its parsed object and its answer: glibc's malloc was a
// quarter of the webhook's CPU under 200 concurrent reviews (benches/controller.rs).
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

// One thread: a review is ~20 µs of CPU-bound work, so one core answers tens of thousands
// a second, and a second worker only added cross-thread wakeups and work stealing (a
// third more CPU per review and a slower p99 under 200 concurrent reviews,
// benches/controller.rs). TLS handshakes are rare: kube-apiserver keeps its connections.
#[tokio::main(flavor = "current_thread")]
async fn main() -> anyhow::Result<()> {
    let config = Config::parse();
    let _traces = aether_common::telemetry::init(config.log_format, &config.telemetry, &aether_controller::TELEMETRY)?;
    let shutdown = aether_common::shutdown::on_signal()?;
    let running = aether_controller::start(config, shutdown).await?;
    running.wait().await?;
    Ok(())
}
