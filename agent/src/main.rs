use clap::{Parser, Subcommand};

#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[derive(Parser)]
#[command(name = "aether-agent", version, about = "Aether's node agent")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Serve the node: CNI socket, registrar stream, xDS for the node's Envoy.
    Run(aether_agent::config::Config),
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    match cli.command {
        Command::Run(config) => {
            aether_common::telemetry::init_logging(config.log_format);
            let shutdown = aether_common::shutdown::on_signal()?;
            let running = aether_agent::server::start(config, shutdown).await?;
            running.wait().await;
        }
    }
    Ok(())
}
