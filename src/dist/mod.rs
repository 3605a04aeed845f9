//! Distributed launch: environment detection, the cluster secret, and the rendezvous protocol's messages.
//!
//! The network side of the rendezvous lives in [`crate::collective::quic`] (quinn is imported in one place);
//! this module holds what can be decided without sockets: who am I, where is the master, which secret, and
//! whether a hello matches this job.

pub mod env;
pub mod rendezvous;

pub use env::{detect_launch, load_secret, resolve_master, LaunchEnv, LaunchFlags, LaunchSource};
pub use rendezvous::{Control, Hello};
