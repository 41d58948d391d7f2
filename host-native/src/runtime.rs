//! Process plumbing shared by the long-running commands: logging and stop signals.

/// Logs to stderr, filtered by `RUST_LOG` (else `default_level`). A second call is a no-op.
/// Colours only on a terminal: a log file, a pipe or journald gets plain text.
pub fn init_tracing(default_level: &str) {
    use std::io::IsTerminal as _;
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default_level));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    let _ = match LOG_FORMAT.get().copied().unwrap_or_default() {
        // One JSON object per line: the event's fields flattened next to `timestamp`, `level`,
        // `target`, and the fields of the spans it happened in.
        LogFormat::Json => builder
            .json()
            .flatten_event(true)
            .with_current_span(false)
            .with_span_list(true)
            .try_init(),
        LogFormat::Text => builder
            .with_ansi(
                std::io::stderr().is_terminal()
                    && std::env::var_os("NO_COLOR").is_none_or(|v| v.is_empty()),
            )
            .try_init(),
    };
}

/// How log lines are written to stderr.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum LogFormat {
    /// Human-readable lines, coloured only on a terminal (and never with `NO_COLOR`).
    #[default]
    Text,
    /// One JSON object per line, for log collectors.
    Json,
}

static LOG_FORMAT: std::sync::OnceLock<LogFormat> = std::sync::OnceLock::new();

/// Sets the format [`init_tracing`] uses; the first call wins. Call before any command runs.
pub fn set_log_format(format: LogFormat) {
    let _ = LOG_FORMAT.set(format);
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

/// Reconnect delays for a host loop: the engine's capped, fully jittered backoff (the one the
/// browser client uses), from `initial` up to `max`, seeded from the clock and the process id
/// so that servers that lost the same peer do not come back in step.
pub(crate) fn backoff(
    initial: std::time::Duration,
    max: std::time::Duration,
) -> highwater_engine::backoff::Backoff {
    let millis = |d: std::time::Duration| u64::try_from(d.as_millis()).unwrap_or(u64::MAX);
    let seed = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64)
        ^ u64::from(std::process::id());
    highwater_engine::backoff::Backoff::new(
        highwater_engine::backoff::BackoffPolicy {
            initial_ms: millis(initial),
            max_ms: millis(max),
        },
        seed,
    )
}

/// The next delay of `backoff`.
pub(crate) fn next_delay(backoff: &mut highwater_engine::backoff::Backoff) -> std::time::Duration {
    std::time::Duration::from_millis(backoff.next_delay_ms(0))
}

/// How often a long step logs its progress.
pub(crate) const PROGRESS_INTERVAL: std::time::Duration = std::time::Duration::from_secs(5);

/// The clock of a long step's progress log (a subscriber's catch-up, a snapshot build, a
/// backfill, a snapshot download): [`Progress::due`] says when a line is due, at most once per
/// interval; the step writes the line with its own fields.
#[derive(Debug)]
pub(crate) struct Progress {
    started: std::time::Instant,
    next: std::time::Instant,
    every: std::time::Duration,
    logged: bool,
}

impl Progress {
    pub(crate) fn new() -> Progress {
        Progress::every(PROGRESS_INTERVAL)
    }

    pub(crate) fn every(every: std::time::Duration) -> Progress {
        let started = std::time::Instant::now();
        Progress {
            started,
            next: started + every,
            every,
            logged: false,
        }
    }

    /// Whether a progress line is due now; if so, the next one is due an interval later.
    pub(crate) fn due(&mut self) -> bool {
        let now = std::time::Instant::now();
        if now < self.next {
            return false;
        }
        self.next = now + self.every;
        self.logged = true;
        true
    }

    /// Whether any progress line was logged: a step that logged progress also logs its end.
    pub(crate) fn logged(&self) -> bool {
        self.logged
    }

    /// Seconds since the step started, for log fields.
    pub(crate) fn elapsed_s(&self) -> f64 {
        (self.started.elapsed().as_secs_f64() * 10.0).round() / 10.0
    }
}

#[cfg(test)]
mod progress_tests {
    use super::Progress;
    use std::time::Duration;

    #[test]
    fn progress_is_due_once_per_interval_and_remembers_it_logged() {
        let mut progress = Progress::every(Duration::from_millis(30));
        assert!(!progress.due());
        assert!(!progress.logged());
        std::thread::sleep(Duration::from_millis(40));
        assert!(progress.due());
        assert!(!progress.due(), "not twice in one interval");
        assert!(progress.logged());
        std::thread::sleep(Duration::from_millis(40));
        assert!(progress.due());
        assert!(progress.elapsed_s() >= 0.1 - 0.05);
    }
}
