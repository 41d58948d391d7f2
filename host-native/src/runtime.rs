//! Process plumbing shared by the long-running commands: logging and stop signals.

/// Logs to stderr, filtered by `RUST_LOG` (else `default_level`). A second call is a no-op.
pub fn init_tracing(default_level: &str) {
    let _ = tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default_level)),
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
