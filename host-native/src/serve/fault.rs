//! A poisoned lock stops the server. A panic while a lock was held may have left the state
//! machine behind it half-updated (a streamer or scope server between two fields of one
//! transition), so no caller may go on with it: [`Fault::lock`] records the failure, which
//! `run_server` turns into a shutdown and a [`super::ServeError::Poisoned`], and then panics
//! in the calling task so nothing further runs against that state.

use std::sync::{Arc, Mutex, MutexGuard};

use tokio::sync::watch;

/// Where a poisoned lock is reported; cheap to clone, shared by every part of one server.
#[derive(Debug, Clone)]
pub(crate) struct Fault {
    failed: Arc<watch::Sender<Option<String>>>,
}

impl Default for Fault {
    fn default() -> Self {
        Fault {
            failed: Arc::new(watch::channel(None).0),
        }
    }
}

impl Fault {
    /// Locks `mutex`; a poisoned one is reported as the server's failure, then this task
    /// panics instead of touching the state behind it.
    pub(crate) fn lock<'a, T>(&self, mutex: &'a Mutex<T>, what: &str) -> MutexGuard<'a, T> {
        match mutex.lock() {
            Ok(guard) => guard,
            Err(_) => {
                let message = format!(
                    "expected the {what} lock to be healthy, found it poisoned by a panic \
                     while it was held: its state may be half-updated"
                );
                tracing::error!("{message}: stopping the server");
                self.failed.send_if_modified(|failed| {
                    if failed.is_none() {
                        *failed = Some(message.clone());
                        true
                    } else {
                        false
                    }
                });
                panic!("{message}");
            }
        }
    }

    /// The first failure recorded, once there is one.
    pub(crate) fn failed(&self) -> watch::Receiver<Option<String>> {
        self.failed.subscribe()
    }

    /// The failure recorded so far, if any.
    pub(crate) fn failure(&self) -> Option<String> {
        self.failed.borrow().clone()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_poisoned_lock_is_reported_and_never_handed_out() {
        let fault = Fault::default();
        let mutex = Arc::new(Mutex::new(0_u32));
        assert_eq!(
            *fault.lock(&mutex, "counter"),
            0,
            "a healthy lock is handed out"
        );
        assert_eq!(fault.failure(), None);
        let poisoner = mutex.clone();
        let _ = std::thread::spawn(move || {
            let mut guard = poisoner.lock().expect("healthy");
            *guard = 1;
            panic!("panic while holding the lock");
        })
        .join();
        assert!(mutex.is_poisoned());
        let again = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            *fault.lock(&mutex, "counter")
        }));
        assert!(again.is_err(), "the poisoned state was handed out");
        let failure = fault.failure().expect("the failure is recorded");
        assert!(failure.contains("counter lock"), "{failure}");
        assert!(failure.contains("poisoned"), "{failure}");
    }
}
