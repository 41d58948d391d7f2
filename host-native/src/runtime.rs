//! Process plumbing shared by the long-running commands: logging and stop signals.

/// Logs to stderr, filtered by `RUST_LOG` (else `default_level`). A second call is a no-op.
/// Colours only on a terminal: a log file, a pipe or journald gets plain text.
pub fn init_tracing(default_level: &str) {
    use std::io::IsTerminal as _;
    let _ = tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default_level)),
        )
        .with_ansi(
            std::io::stderr().is_terminal()
                && std::env::var_os("NO_COLOR").is_none_or(|v| v.is_empty()),
        )
        .with_writer(std::io::stderr)
        .try_init();
}

/// Resolves on Ctrl-C or SIGTERM.
pub async fn wait_for_signal() {
    let terminate = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut signal) => {
                signal.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = terminate => {}
    }
}
