//! `make demo`: brings up one node of the mesh (registrar, agent with the built-in CA, the Envoy supervisor,
//! mesh-dns, pods wired by CNI), shows it working step by step, and removes everything it created, also when
//! interrupted (SIGINT/SIGTERM). Needs root. See `aether_demo`.

use std::panic::AssertUnwindSafe;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use aether_demo::{self as demo, Demo, DemoError, Options};
use anyhow::Context;
use clap::Parser;
use tokio::signal::unix::{SignalKind, signal};

/// Bring up one node of the Aether mesh and show it working.
#[derive(Debug, Parser)]
#[command(name = "aether-demo")]
struct Config {
    /// Keep the node up after the demo until Ctrl-C (to explore the printed debug endpoints).
    #[arg(long, env = "AETHER_DEMO_HOLD")]
    hold: bool,
    /// Services of other teams registered in the catalog (kept out of this node's Envoy by demand scoping).
    #[arg(long, env = "AETHER_DEMO_EXTRA_SERVICES", default_value_t = 40)]
    extra_services: usize,
    /// Requests sent to show the load spread over the backend replicas.
    #[arg(long, env = "AETHER_DEMO_REQUESTS", default_value_t = 50)]
    requests: usize,
}

fn main() -> ExitCode {
    let config = Config::parse();
    match start(config) {
        Ok(()) => {
            println!("make demo: done");
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("make demo failed: {e:#}");
            ExitCode::FAILURE
        }
    }
}

fn start(config: Config) -> anyhow::Result<()> {
    let work = demo::work_dir();
    let tmp = work.join("tmp");
    std::fs::create_dir_all(&tmp).with_context(|| format!("creating {}", tmp.display()))?;
    // Logs and temp files of every process the demo starts land in the work dir, which the teardown (or the next
    // run's sweep) removes.
    #[allow(unsafe_code)]
    // SAFETY: no other thread exists yet (the runtime is built below), so nothing reads the environment meanwhile.
    unsafe {
        std::env::set_var("TMPDIR", &tmp);
    }
    let default_hook = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        println!("FAILED");
        default_hook(info);
    }));
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .context("building the tokio runtime")?;
    let outcome = std::panic::catch_unwind(AssertUnwindSafe(|| runtime.block_on(run(config, work))));
    runtime.shutdown_timeout(Duration::from_secs(5));
    match outcome {
        Ok(result) => result.map_err(anyhow::Error::from),
        Err(_) => anyhow::bail!("a step panicked (message above); everything it created was removed"),
    }
}

async fn run(config: Config, work: PathBuf) -> Result<(), DemoError> {
    let mut sigint = signal(SignalKind::interrupt()).map_err(|e| DemoError::Failed(format!("SIGINT handler: {e}")))?;
    let mut sigterm =
        signal(SignalKind::terminate()).map_err(|e| DemoError::Failed(format!("SIGTERM handler: {e}")))?;
    let options = Options {
        extra_services: config.extra_services,
        requests: config.requests,
        ..Options::default()
    };
    let mut demo = Demo::new(work, options)?;
    let mut result = tokio::select! {
        r = demo.run() => r,
        _ = sigint.recv() => Err(DemoError::Interrupted("SIGINT")),
        _ = sigterm.recv() => Err(DemoError::Interrupted("SIGTERM")),
    };
    if result.is_ok() && config.hold {
        println!("holding the node up: press Ctrl-C (or send SIGTERM) to tear it down");
        tokio::select! {
            _ = sigint.recv() => {}
            _ = sigterm.recv() => {}
        }
    }
    if let Err(DemoError::Interrupted(signal)) = &result {
        println!("\ninterrupted by {signal}: removing everything the demo created");
    }
    // Further signals are caught by the handlers above and ignored: the teardown always completes.
    let cleanup = demo.teardown_step().await;
    if result.is_ok() {
        println!("\n{}", demo.summary());
        result = cleanup.map(|()| println!("  cleanup:        nothing left behind"));
    } else if let Err(e) = cleanup {
        eprintln!("{e}");
    }
    result
}
