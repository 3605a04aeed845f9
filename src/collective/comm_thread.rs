//! A rank's collectives on their own thread, behind handles, so that a gradient bucket travels while the
//! caller goes on computing.
//!
//! The thread owns the rank's [`Collective`] and runs the jobs it is given one at a time, in the order they
//! were submitted. Every rank submits the same jobs in the same order (the trainer's bucket plan is the same
//! on every rank), so the rings line up and frames keep their sequence numbers. A job's result, and the
//! time its collective took, come back through the [`Pending`] handle returned at submission; dropping a
//! handle does not cancel the job, which keeps the order on every rank intact.

use super::{Collective, CollectiveError, ComputeBusy, Result, SentBytes};
use std::sync::mpsc::{channel, Receiver, Sender};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

type Job = Box<dyn FnOnce(&mut dyn Collective) + Send>;

/// The communication thread of one rank.
pub struct CommThread {
    rank: usize,
    /// The transport's flag for compute running beside the collectives, when it has one.
    busy: Option<ComputeBusy>,
    /// The transport's count of bytes sent.
    sent: SentBytes,
    jobs: Option<Sender<Job>>,
    thread: Option<JoinHandle<()>>,
}

/// The result of a submitted job, once the communication thread has run it.
#[must_use = "a collective's result tells whether it succeeded"]
pub struct Pending<T> {
    result: Receiver<(Result<T>, JobTimes)>,
}

/// When a job's collective ran on the communication thread.
#[derive(Clone, Copy, Debug)]
pub struct JobTimes {
    pub started: Instant,
    pub took: Duration,
}

impl<T> Pending<T> {
    /// Waits for the job; returns its result and when its collective ran on the thread.
    pub fn wait_timed(self) -> Result<(T, JobTimes)> {
        match self.result.recv() {
            Ok((result, times)) => result.map(|value| (value, times)),
            Err(_) => Err(thread_gone()),
        }
    }

    /// Waits for the job and returns its result.
    pub fn wait(self) -> Result<T> {
        self.wait_timed().map(|(value, _)| value)
    }
}

fn thread_gone() -> CollectiveError {
    CollectiveError::Local("the communication thread stopped (an earlier collective panicked)".into())
}

impl CommThread {
    /// Moves `comm` onto a new thread named after its rank; fails only when the system refuses a thread.
    pub fn spawn(mut comm: Box<dyn Collective>) -> std::io::Result<Self> {
        let rank = comm.rank();
        let busy = comm.compute_busy();
        let sent = comm.sent_bytes();
        let (jobs, queue) = channel::<Job>();
        let thread = std::thread::Builder::new()
            .name(format!("ringtrain-comm-{rank}"))
            .spawn(move || {
                for job in queue {
                    job(comm.as_mut());
                }
            })?;
        Ok(CommThread {
            rank,
            busy,
            sent,
            jobs: Some(jobs),
            thread: Some(thread),
        })
    }

    pub fn rank(&self) -> usize {
        self.rank
    }

    /// Bytes the transport has sent so far, read without waiting for the collectives in flight.
    pub fn sent_bytes(&self) -> u64 {
        self.sent.get()
    }

    /// Tells the transport whether this rank's compute runs while the queued collectives do (see
    /// [`ComputeBusy`]); until told otherwise, it assumes the rank waits for them.
    pub fn set_compute_busy(&self, busy: bool) {
        if let Some(flag) = &self.busy {
            flag.set(busy);
        }
    }

    /// Queues `job` behind every job submitted before it.
    pub fn submit<T: Send + 'static>(
        &self,
        job: impl FnOnce(&mut dyn Collective) -> Result<T> + Send + 'static,
    ) -> Pending<T> {
        let (tx, result) = channel();
        let boxed: Job = Box::new(move |comm| {
            let started = Instant::now();
            let value = job(comm);
            // The caller may have dropped its handle; the job still ran, in order.
            let times = JobTimes {
                started,
                took: started.elapsed(),
            };
            let _ = tx.send((value, times));
        });
        if let Some(jobs) = &self.jobs {
            // A send fails only when the thread has ended; the handle then reports it.
            let _ = jobs.send(boxed);
        }
        Pending { result }
    }

    /// Runs `job` after everything queued and waits for it.
    pub fn run<T: Send + 'static>(
        &self,
        job: impl FnOnce(&mut dyn Collective) -> Result<T> + Send + 'static,
    ) -> Result<T> {
        self.submit(job).wait()
    }

    /// Starts an all-reduce (mean) of `buf`; the handle gives the buffer back reduced.
    pub fn all_reduce_mean(&self, mut buf: Vec<f32>) -> Pending<Vec<f32>> {
        self.submit(move |comm| comm.all_reduce_mean(&mut buf).map(|()| buf))
    }

    /// Starts a reduce-scatter (mean) of `buf`; the handle gives the buffer back, this rank's chunk reduced.
    pub fn reduce_scatter_mean(&self, mut buf: Vec<f32>) -> Pending<Vec<f32>> {
        self.submit(move |comm| comm.reduce_scatter_mean(&mut buf).map(|_| buf))
    }

    /// Starts an all-reduce (sum) of `buf`; the handle gives the buffer back, reduced.
    pub fn all_reduce_sum(&self, mut buf: Vec<f32>) -> Pending<Vec<f32>> {
        self.submit(move |comm| comm.all_reduce_sum(&mut buf).map(|()| buf))
    }

    /// Starts a reduce-scatter (sum) of `buf`; the handle gives the buffer back, this rank's chunk reduced.
    pub fn reduce_scatter_sum(&self, mut buf: Vec<f32>) -> Pending<Vec<f32>> {
        self.submit(move |comm| comm.reduce_scatter_sum(&mut buf).map(|_| buf))
    }

    /// Starts a reduce-scatter of `buf` (a sum with `sum`, else a mean) and then hands the reduced chunk to
    /// the right neighbour ([`Collective::shift_right`]): the handle gives the buffer back with this rank's
    /// chunk reduced and its left neighbour's reduced chunk beside it.
    pub fn reduce_scatter_and_shift(&self, mut buf: Vec<f32>, sum: bool) -> Pending<Vec<f32>> {
        self.submit(move |comm| {
            match sum {
                true => comm.reduce_scatter_sum(&mut buf)?,
                false => comm.reduce_scatter_mean(&mut buf)?,
            };
            comm.shift_right(&mut buf).map(|()| buf)
        })
    }

    /// Starts an all-gather of `buf` (this rank's chunk filled in); the handle gives back the whole buffer.
    pub fn all_gather(&self, mut buf: Vec<f32>) -> Pending<Vec<f32>> {
        self.submit(move |comm| comm.all_gather(&mut buf).map(|()| buf))
    }
}

impl Drop for CommThread {
    /// Lets queued jobs finish, then ends the thread.
    fn drop(&mut self) {
        self.jobs.take();
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::collective::mem;

    #[test]
    fn jobs_run_in_submission_order_and_reduce_like_the_blocking_calls() {
        let comms = mem::mem_cluster(3, mem::MemOptions::default());
        let threads: Vec<_> = comms
            .into_iter()
            .map(|comm| {
                std::thread::spawn(move || {
                    let comm = CommThread::spawn(Box::new(comm)).unwrap();
                    let r = comm.rank() as f32;
                    let first = comm.all_reduce_mean(vec![r; 5]);
                    let second = comm.all_reduce_mean(vec![2.0 * r; 7]);
                    let scalars = comm.run(move |c| {
                        let mut v = [1.0f64];
                        c.all_reduce_scalars(&mut v).map(|()| v[0])
                    });
                    (second.wait().unwrap(), first.wait().unwrap(), scalars.unwrap())
                })
            })
            .collect();
        for t in threads {
            let (second, first, scalars) = t.join().unwrap();
            assert_eq!(first, vec![1.0; 5]);
            assert_eq!(second, vec![2.0; 7]);
            assert_eq!(scalars, 3.0);
        }
    }

    #[test]
    fn a_failed_collective_reports_through_its_handle() {
        let options = mem::MemOptions {
            deadline: Duration::from_millis(200),
            ..Default::default()
        };
        let mut comms = mem::mem_cluster(2, options);
        let lonely = CommThread::spawn(Box::new(comms.remove(0))).unwrap();
        drop(comms);
        let err = lonely.all_reduce_mean(vec![1.0; 3]).wait().unwrap_err();
        assert!(
            err.peer() == Some(1) || matches!(err, CollectiveError::Local(_)),
            "{err}"
        );
    }
}
