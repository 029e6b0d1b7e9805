//! `aether-cni`: with no arguments it is a CNI plugin (CNI_COMMAND in the environment,
//! config on stdin, result or error JSON on stdout, logs to a file); `aether-cni
//! install` / `uninstall` manage its installation on the node.

use std::io::{Read, Write};
use std::process::ExitCode;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use aether_cni::install::{self, Change, InstallConfig, UninstallConfig};
use aether_cni::owner::OwnerState;
use anyhow::Context;
use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(name = "aether-cni", about = "Aether's chained CNI plugin and its installer")]
struct Cli {
    #[command(subcommand)]
    command: Sub,
}

#[derive(Subcommand)]
enum Sub {
    /// Copy the plugin into the CNI bin dir and chain it into the first CNI config; keep it there.
    Install(Box<InstallConfig>),
    /// Remove the plugin from every CNI config and the bin dir.
    Uninstall(UninstallConfig),
}

fn main() -> ExitCode {
    if std::env::args_os().len() <= 1 {
        return plugin_main();
    }
    let cli = Cli::parse();
    aether_cni_logging_stderr();
    let result = match cli.command {
        Sub::Install(config) => run_install(&config),
        Sub::Uninstall(config) => install::uninstall(&config)
            .map(|changed| tracing::info!(?changed, "aether-cni uninstalled"))
            .context("uninstall"),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("aether-cni: {error:#}");
            ExitCode::FAILURE
        }
    }
}

fn log_change(config: &InstallConfig, change: &Change) {
    match change {
        Change::NoConfig => {
            tracing::warn!(dir = %config.conf_dir.display(), "no CNI config yet; waiting for the primary CNI")
        }
        Change::Unchanged(path) => tracing::debug!(path = %path.display(), "our plugin is chained"),
        Change::Written(path) => tracing::info!(path = %path.display(), "chained our plugin into the CNI config"),
    }
}

/// Installs; with `--watch`, keeps the plugin chained until SIGTERM/SIGINT, then leaves it in place unless the
/// owner DaemonSet is being uninstalled.
fn run_install(config: &InstallConfig) -> anyhow::Result<()> {
    if !config.watch {
        return install::install(config, &AtomicBool::new(false), &mut |c| log_change(config, c)).context("install");
    }
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    runtime.block_on(async {
        use tokio::signal::unix::{SignalKind, signal};
        // Before anything is installed: a SIGTERM from then on is ours to handle.
        let mut terminate = signal(SignalKind::terminate())?;
        let mut interrupt = signal(SignalKind::interrupt())?;
        let stop = Arc::new(AtomicBool::new(false));
        let (done_tx, done_rx) = tokio::sync::oneshot::channel();
        let watcher = {
            let (config, stop) = (config.clone(), stop.clone());
            std::thread::spawn(move || {
                let result = install::install(&config, &stop, &mut |c| log_change(&config, c));
                let _ = done_tx.send(result);
            })
        };
        tokio::select! {
            result = done_rx => return result.context("the watcher thread died")?.context("install"),
            _ = terminate.recv() => {}
            _ = interrupt.recv() => {}
        }
        // Stop repairing first, or the watcher would put back what an uninstall removes.
        stop.store(true, Ordering::Release);
        let _ = tokio::task::spawn_blocking(move || watcher.join()).await;
        let Some(owner) = &config.owner_daemonset else {
            tracing::info!("stopping; the plugin stays chained");
            return Ok(());
        };
        match aether_cni::owner::owner_state(owner).await {
            Ok(OwnerState::Present) => {
                tracing::info!(namespace = %owner.namespace, daemonset = %owner.name,
                    "stopping for a rollout or restart; the plugin stays chained (new pods wait for the next agent)");
                Ok(())
            }
            Ok(OwnerState::Going) => {
                let changed = install::uninstall(&UninstallConfig {
                    bin_dir: config.bin_dir.clone(),
                    conf_dir: config.conf_dir.clone(),
                })
                .context("uninstall")?;
                tracing::info!(namespace = %owner.namespace, daemonset = %owner.name, ?changed,
                    "the DaemonSet is being deleted: removed the plugin from the node");
                Ok(())
            }
            Err(error) => {
                // Fail closed: a plugin left behind blocks pod starts visibly; one removed by mistake lets pods
                // start without capture.
                tracing::warn!(namespace = %owner.namespace, daemonset = %owner.name, %error,
                    "cannot tell an uninstall from a rollout; the plugin stays chained (`aether-cni uninstall` removes it)");
                Ok(())
            }
        }
    })
}

fn aether_cni_logging_stderr() {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .try_init();
}

/// Plugin mode: stdout carries only the CNI answer; logs go to the config's `logFile`.
fn plugin_main() -> ExitCode {
    let mut stdin = Vec::new();
    if let Err(e) = std::io::stdin().read_to_end(&mut stdin) {
        stdin.clear();
        eprintln!("aether-cni: reading stdin: {e}");
    }
    log_to_file(&stdin);
    let runtime = match tokio::runtime::Builder::new_current_thread().enable_all().build() {
        Ok(rt) => rt,
        Err(e) => {
            let error = aether_cni::error::CniError::new(aether_cni::error::Code::Other, format!("tokio runtime: {e}"));
            println!("{}", error.to_json("1.1.0"));
            return ExitCode::FAILURE;
        }
    };
    let output = runtime.block_on(aether_cni::plugin::run(|k| std::env::var(k).ok(), &stdin));
    let mut out = std::io::stdout().lock();
    if !output.stdout.is_empty() {
        let _ = writeln!(out, "{}", output.stdout);
    }
    let _ = out.flush();
    if output.exit_code == 0 {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(output.exit_code as u8)
    }
}

/// Best effort: a log file we cannot open means no logs, never logs on stdout.
fn log_to_file(stdin: &[u8]) {
    let value: serde_json::Value = serde_json::from_slice(stdin).unwrap_or_default();
    let path = value
        .get("logFile")
        .and_then(|v| v.as_str())
        .filter(|p| p.starts_with('/'))
        .unwrap_or(aether_cni::config::DEFAULT_LOG_FILE)
        .to_owned();
    let level = value
        .get("logLevel")
        .and_then(|v| v.as_str())
        .unwrap_or("info")
        .to_owned();
    let path = std::path::PathBuf::from(path);
    if let Some(dir) = path.parent() {
        let _ = std::fs::create_dir_all(dir);
    }
    let Ok(file) = std::fs::OpenOptions::new().create(true).append(true).open(&path) else {
        return;
    };
    let filter =
        tracing_subscriber::EnvFilter::try_new(&level).unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(false)
        // `&File` is a writer, so a shared file needs no lock: each event is one append(2).
        .with_writer(std::sync::Arc::new(file))
        .try_init();
}
