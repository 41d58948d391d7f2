//! The threads replay reads run on: a fixed number, started with the hub and kept for its
//! life.
//!
//! The runtime's blocking pool (`spawn_blocking`) starts a thread whenever none is idle at the
//! moment a task comes, and lets each go after 10 idle seconds. Under a burst of subscribes
//! that came to 9 threads beyond the four reads allowed at once (a read's permit is released
//! before its thread is idle again), each with its stack and its allocator cache resident
//! until it exited, so the server's memory after a burst depended on how long ago the burst's
//! threads last worked (`BENCHMARKS.md`, "Scope sync"). Here a burst queues its reads, the
//! same threads take them in turn, and a thread that finds the queue empty gives its
//! allocator cache back before it waits.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::{Arc, Mutex};

/// A read to run on a pool thread.
type Job = Box<dyn FnOnce() + Send>;

/// A fixed set of threads taking jobs from one queue, in the order they came.
pub(super) struct ReadPool {
    jobs: Sender<Job>,
}

impl ReadPool {
    /// Starts `threads` threads named `name-N`, each within `handle`'s runtime context (a job
    /// may spawn tasks). They end once the pool is dropped and the queue is empty.
    pub(super) fn start(
        threads: usize,
        name: &str,
        handle: &tokio::runtime::Handle,
    ) -> std::io::Result<ReadPool> {
        let (jobs, queue) = channel::<Job>();
        let queue = Arc::new(Mutex::new(queue));
        for n in 0..threads {
            let queue = Arc::clone(&queue);
            let handle = handle.clone();
            std::thread::Builder::new()
                .name(format!("{name}-{n}"))
                .spawn(move || {
                    let _runtime = handle.enter();
                    work(&queue);
                })?;
        }
        Ok(ReadPool { jobs })
    }

    /// Queues `job`; it runs on the first thread free.
    pub(super) fn run(&self, job: impl FnOnce() + Send + 'static) {
        // The queue's receiver lives as long as its threads, which end only after the pool
        // (this sender) is dropped: a send cannot fail while `self` exists.
        let _ = self.jobs.send(Box::new(job));
    }
}

/// One thread's life: take a job, run it, and give the allocator cache back whenever the
/// queue is found empty (the end of a burst, or a lone read).
fn work(queue: &Mutex<Receiver<Job>>) {
    loop {
        let next = {
            let Ok(queue) = queue.lock() else {
                return;
            };
            match queue.try_recv() {
                Ok(job) => Ok(job),
                Err(_) => {
                    super::flush_thread_cache();
                    queue.recv()
                }
            }
        };
        let Ok(job) = next else {
            return;
        };
        // A job that panics (a poisoned lock: the server is stopping) loses its read, not the
        // thread.
        let _ = catch_unwind(AssertUnwindSafe(job));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeSet;
    use std::time::Duration;

    #[test]
    fn every_job_runs_on_one_of_the_pools_threads_even_after_one_panics() {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap();
        let pool = ReadPool::start(2, "test-reader", runtime.handle()).unwrap();
        let (done, results) = channel();
        pool.run(|| panic!("a read that panics"));
        for i in 0..20 {
            let done = done.clone();
            pool.run(move || {
                let name = std::thread::current().name().unwrap().to_owned();
                // A job may use the runtime, as the hub's reads do.
                drop(tokio::runtime::Handle::current());
                done.send((i, name)).unwrap();
            });
        }
        let mut seen = BTreeSet::new();
        let mut threads = BTreeSet::new();
        for _ in 0..20 {
            let (i, name) = results.recv_timeout(Duration::from_secs(10)).unwrap();
            seen.insert(i);
            threads.insert(name);
        }
        assert_eq!(seen, (0..20).collect::<BTreeSet<_>>());
        assert!(
            threads.iter().all(|name| name.starts_with("test-reader-")),
            "{threads:?}"
        );
        assert!(threads.len() <= 2, "{threads:?}");
    }
}
