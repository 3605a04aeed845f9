//! The compute-thread budget of one rank: how many threads its CPU kernels may use, so that the ranks
//! sharing a host do not oversubscribe its cores.
//!
//! Order: `--threads N`, then `RAYON_NUM_THREADS`, then the host's cores divided by the ranks on this host
//! (at least one). The communication thread is one more thread per rank; it is not subtracted, because it
//! sleeps in I/O while the kernels run and the kernels wait while it reduces (see ARCHITECTURE.md).

use std::fmt;

/// Where the compute-thread count came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ThreadSource {
    Flag,
    RayonEnv,
    /// The host's cores divided by the ranks on this host.
    CoresPerLocalRank {
        cores: usize,
        local_ranks: usize,
    },
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ThreadBudget {
    pub compute: usize,
    pub source: ThreadSource,
}

impl fmt::Display for ThreadBudget {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let plural = if self.compute == 1 { "" } else { "s" };
        write!(f, "{} compute thread{plural} ", self.compute)?;
        match self.source {
            ThreadSource::Flag => write!(f, "(--threads)"),
            ThreadSource::RayonEnv => write!(f, "(RAYON_NUM_THREADS)"),
            ThreadSource::CoresPerLocalRank { cores, local_ranks } => {
                write!(f, "({cores} cores / {local_ranks} local rank(s))")
            }
        }
    }
}

/// Most threads a rank may ask for: far above any host, far below what would exhaust the process.
pub const MAX_THREADS: usize = 1024;

/// The budget for a rank. `rayon_env` is the value of `RAYON_NUM_THREADS`, if set; `local_ranks` the number
/// of ranks on this host; `cores` what the process may run on (`std::thread::available_parallelism`).
pub fn thread_budget(
    flag: Option<usize>,
    rayon_env: Option<&str>,
    local_ranks: usize,
    cores: usize,
) -> Result<ThreadBudget, String> {
    let checked = |n: usize, what: &str| {
        if (1..=MAX_THREADS).contains(&n) {
            Ok(n)
        } else {
            Err(format!("{what} {n} must be between 1 and {MAX_THREADS}"))
        }
    };
    if let Some(n) = flag {
        return Ok(ThreadBudget {
            compute: checked(n, "--threads")?,
            source: ThreadSource::Flag,
        });
    }
    // rayon treats 0 (and an unparsable value) as "pick for me"; so does this budget.
    if let Some(n) = rayon_env
        .and_then(|v| v.trim().parse::<usize>().ok())
        .filter(|&n| n > 0)
    {
        return Ok(ThreadBudget {
            compute: checked(n, "RAYON_NUM_THREADS")?,
            source: ThreadSource::RayonEnv,
        });
    }
    let (cores, local_ranks) = (cores.max(1), local_ranks.max(1));
    Ok(ThreadBudget {
        compute: (cores / local_ranks).max(1),
        source: ThreadSource::CoresPerLocalRank { cores, local_ranks },
    })
}

/// Sizes the process-wide rayon pool that the CPU kernels run on. Call once, from the thread that will run
/// the kernels, before any kernel runs.
///
/// With one compute thread, that calling thread becomes the pool's only worker, so every parallel loop
/// runs inline on it. Otherwise each kernel call would hand its work to a separate worker thread and sleep
/// until it finished: about a hundred hand-offs per step, which cost `tiny` a fifth of its step on two
/// cores (BENCHMARKS.md). The price is that no other thread may use the global pool: such work would wait
/// until the calling thread next runs a parallel loop. Only the training thread does.
pub fn install(budget: ThreadBudget) -> Result<(), String> {
    let mut builder = rayon::ThreadPoolBuilder::new().num_threads(budget.compute);
    if budget.compute == 1 {
        builder = builder.use_current_thread();
    }
    match builder.build_global() {
        Ok(()) => Ok(()),
        // Already built (a second run in the same process, as in tests): fine if the size agrees.
        Err(_) if rayon::current_num_threads() == budget.compute => Ok(()),
        Err(e) => Err(format!(
            "cannot use {budget}: the thread pool already runs {} threads ({e})",
            rayon::current_num_threads()
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cores_are_divided_among_local_ranks() {
        let b = thread_budget(None, None, 2, 2).unwrap();
        assert_eq!(b.compute, 1);
        assert_eq!(b.to_string(), "1 compute thread (2 cores / 2 local rank(s))");
        assert_eq!(thread_budget(None, None, 1, 16).unwrap().compute, 16);
        assert_eq!(thread_budget(None, None, 3, 16).unwrap().compute, 5);
        // More ranks than cores: one thread each, never zero.
        assert_eq!(thread_budget(None, None, 4, 2).unwrap().compute, 1);
        assert_eq!(thread_budget(None, None, 0, 0).unwrap().compute, 1);
    }

    #[test]
    fn the_flag_beats_the_environment_which_beats_the_default() {
        let flag = thread_budget(Some(3), Some("5"), 2, 2).unwrap();
        assert_eq!((flag.compute, flag.source), (3, ThreadSource::Flag));
        let env = thread_budget(None, Some(" 5 "), 2, 2).unwrap();
        assert_eq!((env.compute, env.source), (5, ThreadSource::RayonEnv));
        for ignored in ["0", "", "many"] {
            assert_eq!(
                thread_budget(None, Some(ignored), 2, 8).unwrap().compute,
                4,
                "{ignored:?}"
            );
        }
    }

    #[test]
    fn absurd_counts_are_refused() {
        assert!(thread_budget(Some(0), None, 1, 2).unwrap_err().contains("--threads 0"));
        let err = thread_budget(Some(1 << 20), None, 1, 2).unwrap_err();
        assert!(err.contains("between 1 and 1024"), "{err}");
        assert!(thread_budget(None, Some("100000"), 1, 2)
            .unwrap_err()
            .contains("RAYON_NUM_THREADS"));
    }
}
