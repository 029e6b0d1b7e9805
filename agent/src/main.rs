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
// Parsed once at start-up: the size difference between the configs costs nothing.
#[allow(clippy::large_enum_variant)]
enum Command {
    /// Serve the node: CNI socket, registrar stream, xDS for the node's Envoy.
    Run(aether_agent::config::Config),
    /// Supervise the node's Envoy: hot restarts, takeover of a predecessor's Envoy, crash restarts, drain.
    Proxy(aether_agent::proxy::ProxyConfig),
    /// Serve an edge gateway: one Gateway of the `aether` class, xDS for its own Envoy.
    Edge(aether_agent::edge::EdgeConfig),
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    match cli.command {
        Command::Run(mut config) => {
            config
                .telemetry
                .otel_node_name
                .get_or_insert_with(|| config.node_name.clone());
            let _traces =
                aether_common::telemetry::init(config.log_format, &config.telemetry, &aether_agent::server::TELEMETRY)?;
            let shutdown = aether_common::shutdown::on_signal()?;
            let running = aether_agent::server::start(config, shutdown).await?;
            running
                .wait()
                .await
                .map_err(|failure| anyhow::anyhow!("stopped because {failure}"))?;
        }
        Command::Proxy(mut config) => {
            config
                .telemetry
                .otel_node_name
                .get_or_insert_with(|| config.node_name.clone());
            let _traces =
                aether_common::telemetry::init(config.log_format, &config.telemetry, &aether_agent::proxy::TELEMETRY)?;
            let shutdown = aether_common::shutdown::on_signal()?;
            aether_agent::proxy::run(config, shutdown).await?;
        }
        Command::Edge(mut config) => {
            config
                .telemetry
                .otel_node_name
                .get_or_insert_with(|| config.pod_name.clone());
            let _traces =
                aether_common::telemetry::init(config.log_format, &config.telemetry, &aether_agent::edge::TELEMETRY)?;
            let shutdown = aether_common::shutdown::on_signal()?;
            aether_agent::edge::run(config, shutdown).await?;
        }
    }
    Ok(())
}
