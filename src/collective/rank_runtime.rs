//! One thread at a time runs all of a rank's QUIC work.
//!
//! A rank's endpoint driver, connection drivers, stream readers and the collective loop live on a tokio
//! current-thread runtime. While a collective runs, the caller's thread drives that runtime itself
//! ([`RankRuntime::block_on`]), so a received datagram goes from the socket through quinn to the ring
//! engine and back out without waking another thread. Between collectives (while the caller computes), an
//! idle thread drives it instead, so keep-alives, acknowledgements and control-plane messages are still
//! answered. With a multi-thread runtime every sub-chunk crossed threads several times (endpoint driver →
//! connection driver → reader → collective loop), which cost futex wake-ups and scheduler switches on a
//! machine whose cores are busy with the data itself. The current-thread runtime made 4 KiB all-reduces
//! faster (twice as fast at N=4) and cut the system time of 64 MiB ones (BENCHMARKS.md, "Transport settings").
//!
//! Hand-over: the caller raises `foreground` and wakes the idle thread, which leaves its `block_on` and
//! waits; tokio then gives the runtime's driver to the caller's `block_on`. When the caller is done, the idle
//! thread takes it back.

use std::future::Future;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;

use tokio::runtime::Runtime;
use tokio::sync::Notify;

#[derive(Default)]
struct Phase {
    /// Callers inside [`RankRuntime::block_on`].
    foreground: usize,
    stop: bool,
}

#[derive(Default)]
struct Idle {
    phase: Mutex<Phase>,
    /// Wakes the idle thread when the last caller leaves, or to stop it.
    resume: Condvar,
    /// Makes the idle thread leave its `block_on` so a caller can take the runtime.
    release: Notify,
}

impl Idle {
    fn lock(&self) -> MutexGuard<'_, Phase> {
        // The phase is two plain fields, valid even if a holder panicked.
        self.phase.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// A rank's runtime, driven by the caller during collectives and by an idle thread in between.
pub struct RankRuntime {
    rt: Option<Arc<Runtime>>,
    idle: Arc<Idle>,
    thread: Option<JoinHandle<()>>,
}

/// Decrements `foreground` when a caller leaves, even by panic.
struct Foreground<'a>(&'a Idle);

impl Drop for Foreground<'_> {
    fn drop(&mut self) {
        let mut p = self.0.lock();
        p.foreground -= 1;
        if p.foreground == 0 {
            self.0.resume.notify_all();
        }
    }
}

impl RankRuntime {
    /// Builds the runtime; `name` names the idle thread.
    pub fn new(name: String) -> std::io::Result<Self> {
        let rt = Arc::new(tokio::runtime::Builder::new_current_thread().enable_all().build()?);
        let idle = Arc::new(Idle::default());
        let thread = {
            let (rt, idle) = (rt.clone(), idle.clone());
            std::thread::Builder::new().name(name).spawn(move || loop {
                {
                    let mut p = idle.lock();
                    while p.foreground > 0 && !p.stop {
                        p = idle.resume.wait(p).unwrap_or_else(|e| e.into_inner());
                    }
                    if p.stop {
                        return;
                    }
                }
                // A stale wake-up only makes this loop once more.
                rt.block_on(idle.release.notified());
            })?
        };
        Ok(RankRuntime {
            rt: Some(rt),
            idle,
            thread: Some(thread),
        })
    }

    fn runtime(&self) -> &Runtime {
        self.rt.as_ref().expect("runtime present until drop")
    }

    /// Runs `f` to completion on the calling thread, which drives the runtime (its spawned tasks and I/O)
    /// meanwhile.
    pub fn block_on<F: Future>(&self, f: F) -> F::Output {
        self.idle.lock().foreground += 1;
        let _leave = Foreground(&self.idle);
        self.idle.release.notify_one();
        self.runtime().block_on(f)
    }

    fn stop_idle_thread(&mut self) {
        self.idle.lock().stop = true;
        self.idle.resume.notify_all();
        self.idle.release.notify_one();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// Stops the idle thread, then the runtime: tasks still pending are dropped without being polled again.
impl Drop for RankRuntime {
    fn drop(&mut self) {
        self.stop_idle_thread();
        if let Some(rt) = self.rt.take() {
            // Only the idle thread held another reference, and it has been joined.
            if let Ok(rt) = Arc::try_unwrap(rt) {
                rt.shutdown_background();
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    /// Spawned tasks keep running between `block_on` calls (only the idle thread can drive them then), and a
    /// caller's `block_on` still gets the runtime and its timers.
    #[test]
    fn tasks_progress_between_and_during_foreground_calls() {
        let rr = RankRuntime::new("test-idle".into()).unwrap();
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
        rr.block_on(async {
            tokio::spawn(async move {
                for i in 0..10u32 {
                    tokio::time::sleep(Duration::from_millis(2)).await;
                    let _ = tx.send(i);
                }
            });
        });
        let mut got = Vec::new();
        let until = std::time::Instant::now() + Duration::from_secs(10);
        while got.len() < 10 && std::time::Instant::now() < until {
            std::thread::sleep(Duration::from_millis(5));
            while let Ok(i) = rx.try_recv() {
                got.push(i);
            }
        }
        assert_eq!(
            got,
            (0..10).collect::<Vec<_>>(),
            "the idle thread did not drive the task"
        );
        let slept = rr.block_on(async {
            let t = tokio::time::Instant::now();
            tokio::time::sleep(Duration::from_millis(20)).await;
            t.elapsed()
        });
        assert!(slept >= Duration::from_millis(20));
    }
}
