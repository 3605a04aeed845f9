//! What can go wrong in a backend, as values callers can match on.
//!
//! Trait methods return `anyhow::Result`; the errors a backend raises are [`BackendError`]s inside it, so
//! a caller tells them apart with `err.downcast_ref::<BackendError>()`. The wording names quantities
//! (batch size, sequence length, bytes), never command-line flags: the command line adds those.

/// An error raised by a backend.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum BackendError {
    /// No device to run on: none found, none matching the selection, or none able to run the kernels.
    #[error("{0}")]
    NoAdapter(String),
    /// `op` cannot compute the requested shape on this backend; `detail` says which limit, with the
    /// quantities involved.
    #[error("{op} {detail}")]
    ShapeUnsupported { op: String, detail: String },
    /// Device memory ran out allocating `what` (`bytes` long, when known).
    #[error("out of memory allocating {what}{}", bytes.map(|b| format!(" ({b} bytes)")).unwrap_or_default())]
    OutOfMemory { what: String, bytes: Option<u64> },
    /// The device was lost (driver reset, device removed or destroyed); nothing more can run on it.
    #[error("the device was lost: {0}")]
    DeviceLost(String),
    /// Any other failure the driver or the graphics API reported.
    #[error("{0}")]
    Driver(String),
    /// A call the backend cannot honour as made: a transfer whose lengths differ, a view out of bounds.
    #[error("{0}")]
    InvalidView(String),
}

/// `anyhow::ensure!` with a [`BackendError::InvalidView`] (in a function returning `anyhow::Result`).
macro_rules! ensure_view {
    ($cond:expr, $($fmt:tt)+) => {
        if !$cond {
            return Err($crate::backend::BackendError::InvalidView(format!($($fmt)+)).into());
        }
    };
}
pub(crate) use ensure_view;
