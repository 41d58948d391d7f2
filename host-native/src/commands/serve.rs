//! `highwater serve`: the server on a runtime of its own, until Ctrl-C or SIGTERM (a second
//! signal, or a stop that outlasts `--shutdown-timeout-secs`, exits at once).

use std::time::Duration;

use tokio::sync::watch;

use crate::serve::{serve, ServeArgs};

/// A signal counts as the second (exit at once) only this long after the first.
const SECOND_SIGNAL_AFTER: Duration = Duration::from_secs(1);

/// Runs `highwater serve` until Ctrl-C or SIGTERM.
pub fn run(args: ServeArgs) -> anyhow::Result<()> {
    crate::runtime::init_tracing("info");
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        // Once per burst of scope-sync sockets: their memory goes back to the system.
        .on_thread_park(crate::serve::flush_thread_cache_if_asked)
        .build()?;
    let bound = Duration::from_secs(args.shutdown_timeout_secs);
    runtime.block_on(async move {
        let (stop_tx, stop) = watch::channel(false);
        tokio::spawn(async move {
            crate::runtime::wait_for_signal().await;
            tracing::info!(
                timeout_secs = bound.as_secs(),
                "stopping: finishing the current group, closing sockets (a second signal exits at once)"
            );
            let _ = stop_tx.send(true);
            // Ended with the runtime once the server has stopped. A signal within a second
            // of the first is the same stop delivered twice (a terminal's Ctrl-C reaches the
            // whole process group, and `npx` or a launcher forwards it as well), not a second.
            let second = async {
                tokio::time::sleep(SECOND_SIGNAL_AFTER).await;
                crate::runtime::wait_for_signal().await;
            };
            tokio::select! {
                () = second => {
                    tracing::warn!("a second signal: exiting now");
                    std::process::exit(130);
                }
                () = tokio::time::sleep(bound) => {
                    tracing::error!(timeout_secs = bound.as_secs(), "did not stop in time: exiting now");
                    std::process::exit(1);
                }
            }
        });
        serve(args, stop).await
    })?;
    Ok(())
}
